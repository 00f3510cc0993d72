//! One connection handle over a single Redis node, a Redis Cluster or the
//! master Redis Sentinel names (`sentinel.rs`), so the fast path sends the
//! same commands to each. One node and Sentinel are followed by
//! `master.rs` (reconnecting after a restart, a failover behind the same
//! address, a promotion), and their key names carry the master's epoch;
//! a cluster's do not (see below).
//!
//! Cluster mode needs no hash tags: every fast-path command and Lua script
//! touches exactly one key (`{prefix}:{scope}:{key}`: `SET`, `GET`+`PTTL`
//! in one pipeline on that key, the unlock/extend/complete scripts with
//! `KEYS[1]` only), so each goes whole to the node owning that key's slot,
//! and keys spread over every slot. The only multi-key command, the
//! healer's `DEL` of stale copies, is split per slot by the cluster
//! client. `MOVED` and `ASK` are followed inside the client (it refreshes
//! its slot map), so they never reach the fast path or its log.
//!
//! A cluster's key names carry no epoch: each shard fails over on its
//! own, and an epoch would have to be read per shard and kept per slot
//! by a client that hides which node answered. So an operator's `DEL` of
//! a copy PostgreSQL deleted or resolved waits (`WAIT`) until every
//! replica of that shard has it ([`RedisConn::replicated`]); when one
//! does not within `redis.timeout`, the delete says so, as when Redis
//! does not answer (docs/book/src/deploy.md, "Redis failover").

use super::master::{Follower, Following, Source};
use super::{sentinel, tls};
use crate::config::RedisConfig;
use crate::store::StoreError;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};
use std::sync::Arc;

/// Retries of one cluster request (a redirect during resharding, a
/// `TRYAGAIN` during failover) before it fails; `redis.timeout` bounds
/// them all, so a failing-over cluster costs one timeout, then the backoff.
const CLUSTER_RETRIES: u32 = 2;

/// A connection to the configured Redis: clones share the connection(s).
#[derive(Clone)]
pub(crate) enum RedisConn {
    /// One node (`url`, `cluster = false`): whichever server answers at
    /// that address now.
    Node(Following),
    /// A Redis Cluster (`cluster = true`), routing each key to its node.
    Cluster(ClusterConnection),
    /// Redis Sentinel (`sentinels`): whichever master is current.
    Sentinel(Following),
    /// One master (of `Node` or `Sentinel`), pinned for the commands of
    /// one operation whose key names carry its epoch (see
    /// [`RedisConn::pin`]).
    Master(MultiplexedConnection),
}

/// The connection for one operation's commands and the epoch its key names
/// carry (`None`: names carry none, a cluster).
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
            let follower = sentinel::follower(cfg, sentinel, certs)
                .map_err(|err| StoreError::caused("invalid redis.sentinels", err))?;
            return Ok(Self::Sentinel(Following(Arc::new(follower))));
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
            // Connect, then ask twice (INFO server, INFO replication).
            let bound = cfg.timeout * 3;
            let follower = Follower::new(Source::Node(client), cfg.timeout, bound);
            Ok(Self::Node(Following(Arc::new(follower))))
        }
    }

    /// For logs.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Node(Following(f)) | Self::Sentinel(Following(f)) => f.kind(),
            Self::Cluster(_) => "redis cluster",
            Self::Master(_) => "redis master",
        }
    }

    /// The connection for one operation: every command whose key name
    /// carries an epoch must go to the master of that epoch, never to the
    /// next one (which may hold older copies under the same name). `None`
    /// while no master is known (an attempt is under way).
    pub(crate) fn pin(&self) -> Option<Pinned> {
        match self {
            Self::Node(Following(f)) | Self::Sentinel(Following(f)) => f.pin().map(|m| Pinned {
                conn: Self::Master(m.conn),
                epoch: Some(m.epoch),
            }),
            other => Some(Pinned {
                conn: other.clone(),
                epoch: None,
            }),
        }
    }

    /// As [`RedisConn::pin`], waiting for a master to answer (for
    /// background work: the healer, unlocks left to a task).
    pub(crate) async fn pin_waiting(&self) -> redis::RedisResult<Pinned> {
        match self {
            Self::Node(Following(f)) | Self::Sentinel(Following(f)) => {
                f.master().await.map(|m| Pinned {
                    conn: Self::Master(m.conn),
                    epoch: Some(m.epoch),
                })
            }
            other => Ok(Pinned {
                conn: other.clone(),
                epoch: None,
            }),
        }
    }

    /// Whether an operation that finds no master known connects in line
    /// ([`RedisConn::pin_waiting`]) rather than going on without Redis:
    /// one node (a connect to one address, bounded by `redis.timeout`), not
    /// Sentinel (a lookup may ask every sentinel in turn).
    pub(crate) fn connects_in_line(&self) -> bool {
        matches!(self, Self::Node(_))
    }

    /// On a cluster, waits (`WAIT`, at most `timeout`) until every replica
    /// connected to the primary of `key`'s slot has what this connection
    /// wrote there before (an operator's `DEL`): a cluster's names carry
    /// no epoch, so a replica that lagged and is promoted later would hold
    /// the deleted copy again and replay it. `Err` says how many replicas
    /// acknowledged. One node's and Sentinel's names carry the master's
    /// epoch (a promoted replica's copies are never read): nothing to wait
    /// for there.
    pub(crate) async fn replicated(
        &self,
        key: &str,
        timeout: std::time::Duration,
    ) -> Result<(), String> {
        use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
        let Self::Cluster(c) = self else {
            return Ok(());
        };
        let mut c = c.clone();
        let node = || {
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::with_key(
                key,
                SlotAddr::Master,
            )))
        };
        let failed = |e: RedisError| format!("its cluster node did not answer WAIT: {e}");
        let info = c
            .route_command(redis::cmd("INFO").arg("replication").to_owned(), node())
            .await
            .map_err(failed)?;
        let info: String = redis::from_redis_value(info).map_err(|e| e.to_string())?;
        let replicas: i64 = info
            .lines()
            .find_map(|l| l.trim().strip_prefix("connected_slaves:"))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        if replicas == 0 {
            return Ok(());
        }
        let ms = u64::try_from(timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let wait = redis::cmd("WAIT").arg(replicas).arg(ms).to_owned();
        let acked = c.route_command(wait, node()).await.map_err(failed)?;
        let acked: i64 = redis::from_redis_value(acked).map_err(|e| e.to_string())?;
        if acked >= replicas {
            return Ok(());
        }
        Err(format!(
            "{acked} of the {replicas} replica(s) of its cluster node acknowledged the DEL within {ms} ms: a failover to a lagging one would replay the copy"
        ))
    }

    /// The fast path failed to reach Redis on the master of epoch `failed`
    /// (`None`: no master answered): forget that master so the next use
    /// connects again (and reads the epoch of whichever server answers
    /// then), unless another was found since. A cluster reconnects by
    /// itself.
    pub(crate) fn lost(&self, failed: Option<&Arc<str>>) {
        if let Self::Node(Following(f)) | Self::Sentinel(Following(f)) = self {
            f.lost(failed);
        }
    }
}

impl Pinned {
    /// The name of `base` (`{prefix}:{scope}:{key}`) on this connection:
    /// with an epoch, `{prefix}:{epoch}:{scope}:{key}`.
    pub(crate) fn name(&self, base: &str, prefix: &str) -> String {
        match &self.epoch {
            Some(epoch) => {
                // Pushed, not `format!`ed: this is on every Redis call.
                let rest = &base[prefix.len()..];
                let mut name = String::with_capacity(prefix.len() + 1 + epoch.len() + rest.len());
                name.push_str(prefix);
                name.push(':');
                name.push_str(epoch);
                name.push_str(rest);
                name
            }
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
