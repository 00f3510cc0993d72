//! The master Redis Sentinel names, followed across failovers, and the
//! **epoch** of the master the fast path talks to.
//!
//! The redis crate's [`SentinelClient`] asks the sentinels for the
//! master's address and checks that the server there says `ROLE master`,
//! but hands back one plain connection that never asks again. So this
//! module keeps the current connection and drops it on every
//! connection-level failure (the fast path reports them through
//! [`Sentinel::lost`]); the next use asks the sentinels afresh, until
//! the one they promoted answers.
//!
//! The epoch is the master's `run_id` and `master_replid` (from `INFO`),
//! read on the connection right after it opened. Both change whenever the
//! data set may have lost writes: `run_id` on every restart, the
//! replication id on every promotion. A promoted replica that lagged
//! still holds copies the old master had replaced or deleted; the fast
//! path puts the epoch into its key names, so it never reads a copy
//! written under another master (those expire on their own TTLs).

use crate::config::{RedisConfig, SentinelConfig};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ErrorKind, RedisError, RedisResult, TlsCertificates,
    TlsMode,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Pause between two lookups while no master answers (the sentinels have
/// not promoted one yet): about what a sentinel's `down-after-milliseconds`
/// and election take at the least, and four lookups a second at most.
const LOOKUP_RETRY: Duration = Duration::from_millis(250);

/// The epoch's characters taken from each of `run_id` and `master_replid`
/// (40 hex digits each): 64 bits each tell two servers or promotions apart.
const EPOCH_PART: usize = 16;

/// The master of one Sentinel-monitored service, as last found.
pub(crate) struct Sentinel {
    /// The lookups, one at a time (the client caches its sentinel
    /// connections and is `&mut`).
    client: tokio::sync::Mutex<SentinelClient>,
    current: std::sync::Mutex<Option<Master>>,
    /// Whether a background lookup is running (see [`Sentinel::pin`]).
    looking: AtomicBool,
    config: AsyncConnectionConfig,
    /// Bounds one lookup: every sentinel asked, the master connected and
    /// its `INFO` read.
    lookup_bound: Duration,
}

/// A connection to the master and the epoch it was opened in.
#[derive(Clone)]
pub(crate) struct Master {
    pub(crate) conn: MultiplexedConnection,
    pub(crate) epoch: Arc<str>,
}

impl Sentinel {
    /// The client for `cfg`'s sentinels, without connecting.
    pub(crate) fn new(
        cfg: &RedisConfig,
        sentinel: &SentinelConfig,
        certs: Option<TlsCertificates>,
    ) -> RedisResult<Self> {
        let addrs = sentinel.sentinels.iter().map(|(host, port)| {
            if sentinel.tls {
                ConnectionAddr::TcpTls {
                    host: host.clone(),
                    port: *port,
                    insecure: false,
                    tls_params: None,
                }
            } else {
                ConnectionAddr::Tcp(host.clone(), *port)
            }
        });
        let mut builder =
            SentinelClientBuilder::new(addrs, &sentinel.master, SentinelServerType::Master)?;
        if let Some(user) = &sentinel.username {
            builder = builder.set_client_to_redis_username(user);
        }
        if let Some(password) = &sentinel.password {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some(user) = &sentinel.sentinel_username {
            builder = builder.set_client_to_sentinel_username(user);
        }
        if let Some(password) = &sentinel.sentinel_password {
            builder = builder.set_client_to_sentinel_password(password);
        }
        if sentinel.tls {
            builder = builder
                .set_client_to_redis_tls_mode(TlsMode::Secure)
                .set_client_to_sentinel_tls_mode(TlsMode::Secure);
            if let Some(certs) = certs {
                builder = builder
                    .set_client_to_redis_certificates(certs.clone())
                    .set_client_to_sentinel_certificates(certs);
            }
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(cfg.timeout))
            .set_response_timeout(Some(cfg.timeout));
        Ok(Self {
            client: tokio::sync::Mutex::new(builder.build()?),
            current: Default::default(),
            looking: Default::default(),
            config,
            // Each sentinel is tried in turn, then the master is connected
            // to and asked twice (ROLE, INFO).
            lookup_bound: cfg.timeout * (sentinel.sentinels.len() as u32 + 3),
        })
    }

    /// The current master, without waiting: `None` while none is known, and
    /// then a lookup starts in the background (the caller goes on without
    /// Redis, as during any outage).
    pub(crate) fn pin(self: &Arc<Self>) -> Option<Master> {
        if let Some(master) = super::lock(&self.current).clone() {
            return Some(master);
        }
        self.look_up_in_background();
        None
    }

    /// Asks the sentinels until a master answers, unless a lookup is under
    /// way already.
    fn look_up_in_background(self: &Arc<Self>) {
        if self.looking.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            while me.master().await.is_err() {
                tokio::time::sleep(LOOKUP_RETRY).await;
            }
            me.looking.store(false, Ordering::Release);
        });
    }

    /// The current master, asking the sentinels if none is known.
    pub(crate) async fn master(&self) -> RedisResult<Master> {
        if let Some(master) = super::lock(&self.current).clone() {
            return Ok(master);
        }
        let mut client = self.client.lock().await;
        // Another caller may have found it while this one waited.
        if let Some(master) = super::lock(&self.current).clone() {
            return Ok(master);
        }
        let lookup = async {
            let mut conn = client
                .get_async_connection_with_config(&self.config)
                .await?;
            let epoch = epoch(&mut conn).await?;
            Ok::<_, RedisError>(Master {
                conn,
                epoch: epoch.into(),
            })
        };
        let master = match tokio::time::timeout(self.lookup_bound, lookup).await {
            Ok(found) => found?,
            Err(_) => {
                return Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no sentinel named a master that answered in time",
                )))
            }
        };
        let previous = super::lock(&self.current).replace(master.clone());
        drop(previous);
        tracing::info!(epoch = %master.epoch, "redis sentinel: connected to the master");
        Ok(master)
    }

    /// The fast path could not use the master: forget it and ask the
    /// sentinels again at once, so the master they promote is known by the
    /// time the fast path's backoff ends.
    pub(crate) fn lost(self: &Arc<Self>) {
        super::lock(&self.current).take();
        self.look_up_in_background();
    }
}

/// The epoch of the server `conn` is connected to, which must be a master
/// (the sentinels may lag behind a demotion).
async fn epoch(conn: &mut MultiplexedConnection) -> RedisResult<String> {
    let (server, replication): (String, String) = redis::pipe()
        .cmd("INFO")
        .arg("server")
        .cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await?;
    let field = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    let not_master = || {
        RedisError::from((
            ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "the server the sentinels named is not a master (yet)",
        ))
    };
    if field(&replication, "role").as_deref() != Some("master") {
        return Err(not_master());
    }
    match (
        field(&server, "run_id"),
        field(&replication, "master_replid"),
    ) {
        (Some(run_id), Some(replid)) => Ok(epoch_of(&run_id, &replid)),
        _ => Err(not_master()),
    }
}

/// `run_id` and `master_replid`, shortened (see [`EPOCH_PART`]).
fn epoch_of(run_id: &str, replid: &str) -> String {
    let part = |s: &str| s.chars().take(EPOCH_PART).collect::<String>();
    format!("{}{}", part(run_id), part(replid))
}

/// A connection-like that sends each command to the current master, asking
/// the sentinels first if none is known (for the start-up probe, the
/// healer and `check-config --connect`; claims pin one master instead).
#[derive(Clone)]
pub(crate) struct Following(pub(crate) Arc<Sentinel>);

impl Following {
    async fn conn(&self) -> RedisResult<MultiplexedConnection> {
        self.0.master().await.map(|m| m.conn)
    }

    fn after(&self, result: &RedisResult<impl Sized>) {
        if let Err(err) = result {
            if super::is_connection_error(err) {
                self.0.lost();
            }
        }
    }
}

impl ConnectionLike for Following {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let result = match self.conn().await {
                Ok(mut conn) => conn.req_packed_command(cmd).await,
                Err(err) => Err(err),
            };
            self.after(&result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let result = match self.conn().await {
                Ok(mut conn) => conn.req_packed_commands(pipeline, offset, count).await,
                Err(err) => Err(err),
            };
            self.after(&result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_changes_with_a_restart_or_a_promotion() {
        let run = "0123456789abcdef0123456789abcdef01234567";
        let other_run = "f123456789abcdef0123456789abcdef01234567";
        let replid = "aaaaaaaaaaaaaaaabbbbbbbbbbbbbbbbcccccccc";
        let promoted = "baaaaaaaaaaaaaaabbbbbbbbbbbbbbbbcccccccc";
        let e = epoch_of(run, replid);
        assert_eq!(e.len(), 2 * EPOCH_PART);
        assert_eq!(e, epoch_of(run, replid));
        assert_ne!(e, epoch_of(other_run, replid), "restart");
        assert_ne!(e, epoch_of(run, promoted), "promotion");
    }
}
