//! Not a stable API; for fuzz targets and property tests.
//!
//! The pure pieces that read hostile bytes or lay out stored ones are
//! crate-private; this one module hands them to `fuzz/` and
//! `tests/it/properties.rs` so no other item's visibility is widened for
//! them. Nothing here does I/O. Items that are public already (the key
//! parser, [`crate::idempotency::Fingerprint`], [`crate::config::Config`])
//! are used from where they live.

use crate::idempotency::{Fingerprint, Record, UnixMillis};
use crate::store::{Claim, Completion, StoreError};

pub use crate::proxy::forward::upstream_uri;
pub use crate::route::{normalize_path, resolve_dot_segments, PathPattern, RouteTable};
pub use crate::store::codec::{decode_headers, encode_headers, RecordRow};
pub use crate::store::redis::Cached;

/// The Redis value of a claim's lock.
pub fn redis_encode_lock(claim: &Claim) -> Vec<u8> {
    crate::store::redis::encode_lock(claim)
}

/// The Redis value of a completed or unstored record; `None` for the
/// states Redis never caches.
pub fn redis_encode_record(record: &Record) -> Option<Vec<u8>> {
    crate::store::redis::encode_record(record)
}

/// Reads a Redis value back.
pub fn redis_decode(value: &[u8]) -> Result<Cached, StoreError> {
    crate::store::redis::decode(value)
}

/// The row a SQL backend holds after writing `completion`: its `state`,
/// `status`, `headers` and `body` columns as the backends write them, the
/// others as given (no first use: a record claimed before migration 4).
pub fn completion_row(
    completion: &Completion,
    fingerprint: &Fingerprint,
    created_at: UnixMillis,
    expires_at: UnixMillis,
) -> RecordRow {
    let columns = completion.columns();
    RecordRow {
        fingerprint: fingerprint.0.to_vec(),
        state: columns.state.to_string(),
        locked_until: created_at,
        created_at,
        expires_at,
        status: columns.status.map(i64::from),
        headers: columns.headers,
        body: columns.body.map(<[u8]>::to_vec),
        first_method: None,
        first_path: None,
    }
}
