//! The store interface: where claims, leases and stored responses live.
//!
//! Every backend gives the same guarantees (the contract suite in
//! `tests/store_contract.rs` runs one body against all of them):
//! - [`Store::claim`] is one atomic step: insert the key as in flight, or take
//!   over a record whose ttl ran out or whose lease ran out, or report the
//!   record that is there. The backend decides, never a read-then-write in
//!   the caller.
//! - [`Store::renew`], [`Store::complete`] and [`Store::release`] are fenced
//!   by the claim's [`LeaseToken`]: a holder that lost its claim gets
//!   [`Fence::Lost`] and changes nothing.
//! - Time is an argument (`now`, unix milliseconds), so every backend agrees
//!   with the proxy's clock and tests control it.

pub mod memory;
pub mod postgres;
pub mod redis;
pub mod sqlite;

use crate::idempotency::{Fingerprint, RecordKey};
use async_trait::async_trait;
use bytes::Bytes;
use std::fmt;

/// Milliseconds since the unix epoch.
pub type UnixMillis = i64;

/// The wall clock, in the unit the store uses.
pub fn now_millis() -> UnixMillis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Random per-claim owner token; completion and release must present it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(pub [u8; 16]);

impl LeaseToken {
    pub fn random() -> Self {
        Self(rand::random())
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({})", hex::encode(&self.0[..4]))
    }
}

/// A response as stored and replayed: status, headers in order (repeated
/// names kept as separate entries), body bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Vec<(String, Bytes)>,
    pub body: Bytes,
}

/// What a record holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordState {
    /// Someone is executing it; their lease runs until `locked_until`.
    InFlight { locked_until: UnixMillis },
    /// Executed and stored: replay it.
    Completed(StoredResponse),
    /// Executed, but the response was over `max_response_body`: never run
    /// again, never replayed. `status` is what the upstream answered.
    Unstored { status: u16 },
}

impl RecordState {
    pub fn as_str(&self) -> &'static str {
        match self {
            RecordState::InFlight { .. } => "in_flight",
            RecordState::Completed(_) => "completed",
            RecordState::Unstored { .. } => "unstored",
        }
    }
}

/// A stored record, as read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub fingerprint: Fingerprint,
    pub state: RecordState,
    pub created_at: UnixMillis,
    pub expires_at: UnixMillis,
}

/// Everything a claim writes.
#[derive(Clone, Debug)]
pub struct Claim {
    pub key: RecordKey,
    pub fingerprint: Fingerprint,
    pub token: LeaseToken,
    pub now: UnixMillis,
    /// `locked_until = now + lease_ms`.
    pub lease_ms: i64,
    /// `expires_at = now + ttl_ms`.
    pub ttl_ms: i64,
}

impl Claim {
    pub fn locked_until(&self) -> UnixMillis {
        self.now + self.lease_ms
    }
    pub fn expires_at(&self) -> UnixMillis {
        self.now + self.ttl_ms
    }
}

/// The answer to a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller now holds the key. `takeover` is true when it replaced an
    /// in-flight record whose holder's lease had run out.
    Claimed { takeover: bool },
    /// A live record is there; [`crate::idempotency::decide`] says what it means.
    Existing(Record),
}

/// How a fenced write went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// The token still owned the record; the write happened.
    Held,
    /// Someone else owns the record now (or it is gone); nothing was written.
    Lost,
}

impl Fence {
    /// A fenced statement touches the one row its token owns, or none.
    pub fn from_rows(rows: u64) -> Self {
        if rows == 1 {
            Fence::Held
        } else {
            Fence::Lost
        }
    }
}

/// What a holder writes when the upstream has answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    Stored(StoredResponse),
    Unstored { status: u16 },
}

/// Why the store could not answer. Every variant means "unknown": the
/// proxy must not forward unguarded on any of them.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store timed out")]
    Timeout,
    #[error("store returned a corrupt record: {0}")]
    Corrupt(String),
}

/// The storage backend.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically claims `claim.key`, or returns the live record there.
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError>;

    /// Extends the holder's lease to `locked_until`.
    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        locked_until: UnixMillis,
    ) -> Result<Fence, StoreError>;

    /// Marks the holder's record completed. `expires_at` is the claim's
    /// (`Claim::expires_at`): the ttl counts from the claim, and a cache in
    /// front of the store needs it to expire its copy at the same moment.
    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        expires_at: UnixMillis,
    ) -> Result<Fence, StoreError>;

    /// Deletes the holder's in-flight record so a retry runs again.
    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError>;

    /// Reads a record, expired or not (for inspection).
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError>;

    /// Deletes a record whatever its state (operator repair). True if one was there.
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError>;

    /// Deletes up to `batch` records whose ttl ran out before `now` (never a
    /// live lease). Returns how many went.
    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError>;

    /// Cheap liveness probe for readiness.
    async fn ping(&self) -> Result<(), StoreError>;

    /// The backend's name for logs and metrics.
    fn backend(&self) -> &'static str;
}

// === stored header encoding, shared by the backends that keep bytes ===

/// Encodes headers as `count:u32, (name_len:u16, name, value_len:u32, value)*`.
pub fn encode_headers(headers: &[(String, Bytes)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + headers.len() * 32);
    out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    for (name, value) in headers {
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
    out
}

/// Inverse of [`encode_headers`].
pub fn decode_headers(mut buf: &[u8]) -> Result<Vec<(String, Bytes)>, StoreError> {
    fn take<'a>(buf: &mut &'a [u8], n: usize) -> Result<&'a [u8], StoreError> {
        if buf.len() < n {
            return Err(StoreError::Corrupt("truncated header block".into()));
        }
        let (head, rest) = buf.split_at(n);
        *buf = rest;
        Ok(head)
    }
    let count = u32::from_be_bytes(take(&mut buf, 4)?.try_into().expect("4 bytes"));
    let mut headers = Vec::with_capacity(count.min(1024) as usize);
    for _ in 0..count {
        let nlen = u16::from_be_bytes(take(&mut buf, 2)?.try_into().expect("2 bytes")) as usize;
        let name = std::str::from_utf8(take(&mut buf, nlen)?)
            .map_err(|_| StoreError::Corrupt("header name is not UTF-8".into()))?
            .to_string();
        let vlen = u32::from_be_bytes(take(&mut buf, 4)?.try_into().expect("4 bytes")) as usize;
        let value = Bytes::copy_from_slice(take(&mut buf, vlen)?);
        headers.push((name, value));
    }
    if !buf.is_empty() {
        return Err(StoreError::Corrupt("trailing bytes after headers".into()));
    }
    Ok(headers)
}

/// Whether a claim at `now` replaces `record`: an in-flight record only
/// once its lease ran out (its ttl alone never ends a live execution), any
/// other record once its ttl ran out. Every backend's claim implements this.
pub fn is_claimable(record: &Record, now: UnixMillis) -> bool {
    match record.state {
        RecordState::InFlight { locked_until } => locked_until <= now,
        _ => record.expires_at <= now,
    }
}

/// A record's columns as the SQL backends keep them; [`RecordRow::into_record`]
/// is the one place they become a [`Record`].
pub struct RecordRow {
    pub fingerprint: Vec<u8>,
    pub state: String,
    pub locked_until: i64,
    pub created_at: i64,
    pub expires_at: i64,
    pub status: Option<i64>,
    pub headers: Option<Vec<u8>>,
    pub body: Option<Vec<u8>>,
}

impl RecordRow {
    pub fn into_record(self) -> Result<Record, StoreError> {
        let status = || -> Result<u16, StoreError> {
            self.status
                .and_then(|s| u16::try_from(s).ok())
                .ok_or_else(|| StoreError::Corrupt("record has no valid status".into()))
        };
        let state = match self.state.as_str() {
            "in_flight" => RecordState::InFlight {
                locked_until: self.locked_until,
            },
            "completed" => RecordState::Completed(StoredResponse {
                status: status()?,
                headers: decode_headers(self.headers.as_deref().unwrap_or_default())?,
                body: Bytes::from(self.body.unwrap_or_default()),
            }),
            "unstored" => RecordState::Unstored { status: status()? },
            other => return Err(StoreError::Corrupt(format!("unknown state {other:?}"))),
        };
        Ok(Record {
            fingerprint: crate::idempotency::Fingerprint(array_from(
                &self.fingerprint,
                "fingerprint",
            )?),
            state,
            created_at: self.created_at,
            expires_at: self.expires_at,
        })
    }
}

/// Fixed-size byte columns read back from a backend.
pub fn array_from<const N: usize>(bytes: &[u8], what: &str) -> Result<[u8; N], StoreError> {
    bytes
        .try_into()
        .map_err(|_| StoreError::Corrupt(format!("{what} has {} bytes, expected {N}", bytes.len())))
}

/// Opens the backend the config names, with the Redis fast path in front
/// of PostgreSQL when `[redis]` is set (its counters go to `metrics`).
/// Neither PostgreSQL nor Redis has to be up yet: both connect lazily and
/// recover by themselves.
pub async fn open_with_metrics(
    cfg: &crate::config::Config,
    metrics: &crate::metrics::Metrics,
) -> Result<std::sync::Arc<dyn Store>, StoreError> {
    use crate::config::Backend;
    use std::sync::Arc;
    let store: Arc<dyn Store> = match cfg.store.backend {
        Backend::Memory => Arc::new(memory::MemoryStore::new()),
        Backend::Sqlite => {
            let path = cfg.store.path.clone();
            let sync = cfg.store.synchronous;
            Arc::new(
                tokio::task::spawn_blocking(move || sqlite::SqliteStore::open(&path, sync))
                    .await
                    .map_err(|e| StoreError::Unavailable(e.to_string()))??,
            )
        }
        Backend::Postgres => {
            let pg = postgres::PostgresStore::connect(&cfg.store).await?;
            // Migrate now when the database answers; otherwise the first
            // store call does it, so a proxy started before its database
            // heals by itself.
            match pg.migrate().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(applied = n, schema = pg.schema(), "applied migrations"),
                Err(e) => {
                    tracing::warn!(error = %e, "postgres not ready at start-up; will retry on first use")
                }
            }
            let pg: Arc<dyn Store> = Arc::new(pg);
            match &cfg.redis {
                None => pg,
                Some(redis_cfg) => {
                    let fast = redis::RedisFastPath::new(pg, redis_cfg).await?;
                    metrics.attach_fast_path(fast.counters());
                    Arc::new(fast)
                }
            }
        }
    };
    Ok(store)
}

/// [`open_with_metrics`] for callers that do not export metrics.
pub async fn open(cfg: &crate::config::Config) -> Result<std::sync::Arc<dyn Store>, StoreError> {
    open_with_metrics(cfg, &crate::metrics::Metrics::new()).await
}

/// Applies the PostgreSQL migrations (`idemgate migrate`); returns how many ran.
pub async fn migrate(cfg: &crate::config::Config) -> Result<u32, StoreError> {
    postgres::PostgresStore::connect(&cfg.store)
        .await?
        .migrate()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_encoding_round_trips_repeated_and_binary_values() {
        let headers = vec![
            ("location".to_string(), Bytes::from_static(b"/orders/1")),
            ("x-multi".to_string(), Bytes::from_static(b"a, b")),
            ("x-multi".to_string(), Bytes::from_static(b"c")),
            ("x-bin".to_string(), Bytes::from_static(b"\xff\x00")),
        ];
        let enc = encode_headers(&headers);
        assert_eq!(decode_headers(&enc).unwrap(), headers);
        assert!(decode_headers(&enc[..enc.len() - 1]).is_err());
        assert_eq!(decode_headers(&encode_headers(&[])).unwrap(), vec![]);
    }
}
