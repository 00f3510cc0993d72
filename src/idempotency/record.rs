//! A key's record as the protocol sees it: what a claim finds and what a
//! replay returns. The store keeps these; `decision.rs` reads them.

use super::Fingerprint;
use bytes::Bytes;

pub use crate::clock::UnixMillis;

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
    /// Sent upstream, but no answer came (timeout, reset) on a route with
    /// `on_ambiguous = "keep"`: it may have executed, so it never runs again
    /// under this key until an operator resolves it.
    Unknown,
}

impl RecordState {
    pub fn as_str(&self) -> &'static str {
        match self {
            RecordState::InFlight { .. } => "in_flight",
            RecordState::Completed(_) => "completed",
            RecordState::Unstored { .. } => "unstored",
            RecordState::Unknown => "unknown",
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
