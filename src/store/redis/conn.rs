//! One connection handle over a single Redis node or a Redis Cluster, so
//! the fast path sends the same commands to either.
//!
//! Cluster mode needs no hash tags: every fast-path command and Lua script
//! touches exactly one key (`{prefix}:{scope}:{key}`: `SET`, `GET`+`PTTL`
//! in one pipeline on that key, the unlock/extend/complete scripts with
//! `KEYS[1]` only), so each goes whole to the node owning that key's slot,
//! and keys spread over every slot. The only multi-key command, the
//! healer's `DEL` of stale copies, is split per slot by the cluster
//! client. `MOVED` and `ASK` are followed inside the client (it refreshes
//! its slot map), so they never reach the fast path or its log.

use super::tls;
use crate::config::RedisConfig;
use crate::store::StoreError;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};
use std::time::Duration;

/// Reconnect attempts per failed connection inside the connection manager;
/// further attempts happen on later calls, after the fast path's backoff.
const RECONNECT_RETRIES: usize = 1;

/// Retries of one cluster request (a redirect during resharding, a
/// `TRYAGAIN` during failover) before it fails; `redis.timeout` bounds
/// them all, so a failing-over cluster costs one timeout, then the backoff.
const CLUSTER_RETRIES: u32 = 2;

/// A connection to the configured Redis: clones share the connection(s).
#[derive(Clone)]
pub(crate) enum RedisConn {
    /// One node (`cluster = false`), reconnecting by itself.
    Node(ConnectionManager),
    /// A Redis Cluster (`cluster = true`), routing each key to its node.
    Cluster(ClusterConnection),
}

impl RedisConn {
    /// Builds the client for `cfg` without connecting: Redis being down is
    /// not an error here. A malformed URL or an unreadable certificate file
    /// is.
    pub(crate) fn lazy(cfg: &RedisConfig) -> Result<Self, StoreError> {
        tls::install_crypto_provider();
        let certs = tls::certificates(cfg)?;
        let url = cfg.client_url();
        // redis-rs parse errors do not echo the URL, so no password leaks.
        let invalid = |err: RedisError| StoreError::caused("invalid redis.url", err);
        if cfg.cluster {
            let mut builder = ClusterClientBuilder::new([url.as_str()])
                .connection_timeout(cfg.timeout)
                .response_timeout(cfg.timeout)
                .retries(CLUSTER_RETRIES)
                .min_retry_wait(10)
                .max_retry_wait(100);
            if let Some(certs) = certs {
                builder = builder.certs(certs);
            }
            let client = builder.build().map_err(invalid)?;
            let config = ClusterConfig::new()
                .set_connection_timeout(cfg.timeout)
                .set_response_timeout(cfg.timeout);
            Ok(Self::Cluster(
                client.get_pending_async_connection_with_config(config),
            ))
        } else {
            let client = match certs {
                Some(certs) => redis::Client::build_with_tls(url.as_str(), certs),
                None => redis::Client::open(url.as_str()),
            }
            .map_err(invalid)?;
            let config = ConnectionManagerConfig::new()
                .set_response_timeout(Some(cfg.timeout))
                .set_connection_timeout(Some(cfg.timeout))
                .set_number_of_retries(RECONNECT_RETRIES)
                .set_min_delay(Duration::from_millis(50))
                .set_max_delay(Duration::from_millis(500));
            let conn = ConnectionManager::new_lazy_with_config(client, config)
                .map_err(|err| StoreError::caused("redis connection manager", err))?;
            Ok(Self::Node(conn))
        }
    }

    /// For logs.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Node(_) => "redis",
            Self::Cluster(_) => "redis cluster",
        }
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Node(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Node(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Node(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}
