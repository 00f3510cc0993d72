//! One connection handle over a single Redis node, a Redis Cluster or the
//! master Redis Sentinel names (`sentinel.rs`), so the fast path sends the
//! same commands to each.
//!
//! Cluster mode needs no hash tags: every fast-path command and Lua script
//! touches exactly one key (`{prefix}:{scope}:{key}`: `SET`, `GET`+`PTTL`
//! in one pipeline on that key, the unlock/extend/complete scripts with
//! `KEYS[1]` only), so each goes whole to the node owning that key's slot,
//! and keys spread over every slot. The only multi-key command, the
//! healer's `DEL` of stale copies, is split per slot by the cluster
//! client. `MOVED` and `ASK` are followed inside the client (it refreshes
//! its slot map), so they never reach the fast path or its log.

use super::sentinel::{Following, Sentinel};
use super::tls;
use crate::config::RedisConfig;
use crate::store::StoreError;
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};
use std::sync::Arc;
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
    /// Redis Sentinel (`sentinels`): whichever master is current.
    Sentinel(Following),
    /// One master Sentinel named, pinned for the commands of one operation
    /// whose key names carry its epoch (see [`RedisConn::pin`]).
    Master(MultiplexedConnection),
}

/// The connection for one operation's commands and the epoch its key names
/// carry (`None`: names carry none, one node or a cluster).
pub(crate) struct Pinned {
    pub(crate) conn: RedisConn,
    pub(crate) epoch: Option<Arc<str>>,
}

impl RedisConn {
    /// Builds the client for `cfg` without connecting: Redis being down is
    /// not an error here. A malformed URL or an unreadable certificate file
    /// is.
    pub(crate) fn lazy(cfg: &RedisConfig) -> Result<Self, StoreError> {
        tls::install_crypto_provider();
        let certs = tls::certificates(cfg)?;
        if let Some(sentinel) = &cfg.sentinel {
            let client = Sentinel::new(cfg, sentinel, certs)
                .map_err(|err| StoreError::caused("invalid redis.sentinels", err))?;
            return Ok(Self::Sentinel(Following(Arc::new(client))));
        }
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
            Self::Sentinel(_) | Self::Master(_) => "redis sentinel",
        }
    }

    /// The connection for one operation: every command whose key name
    /// carries an epoch must go to the master of that epoch, never to the
    /// next one (which may hold older copies under the same name). `None`
    /// while Sentinel knows no master (a lookup is under way).
    pub(crate) fn pin(&self) -> Option<Pinned> {
        match self {
            Self::Sentinel(Following(sentinel)) => sentinel.pin().map(|m| Pinned {
                conn: Self::Master(m.conn),
                epoch: Some(m.epoch),
            }),
            other => Some(Pinned {
                conn: other.clone(),
                epoch: None,
            }),
        }
    }

    /// As [`RedisConn::pin`], waiting for Sentinel to name a master (for
    /// background work: the healer, unlocks left to a task).
    pub(crate) async fn pin_waiting(&self) -> redis::RedisResult<Pinned> {
        match self {
            Self::Sentinel(Following(sentinel)) => sentinel.master().await.map(|m| Pinned {
                conn: Self::Master(m.conn),
                epoch: Some(m.epoch),
            }),
            other => Ok(Pinned {
                conn: other.clone(),
                epoch: None,
            }),
        }
    }

    /// The fast path failed to reach Redis: with Sentinel, forget the
    /// master so the next use asks the sentinels again (after a failover
    /// they name another). One node and a cluster reconnect by themselves.
    pub(crate) fn lost(&self) {
        if let Self::Sentinel(Following(sentinel)) = self {
            sentinel.lost();
        }
    }
}

impl Pinned {
    /// The name of `base` (`{prefix}:{scope}:{key}`) on this connection:
    /// with an epoch, `{prefix}:{epoch}:{scope}:{key}`.
    pub(crate) fn name(&self, base: &str, prefix: &str) -> String {
        match &self.epoch {
            Some(epoch) => format!("{prefix}:{epoch}{}", &base[prefix.len()..]),
            None => base.to_string(),
        }
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Node(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
            Self::Sentinel(c) => c.req_packed_command(cmd),
            Self::Master(c) => c.req_packed_command(cmd),
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
            Self::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Master(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Node(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
            Self::Sentinel(c) => c.get_db(),
            Self::Master(c) => c.get_db(),
        }
    }
}
