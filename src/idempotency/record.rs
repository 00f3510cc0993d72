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
    /// What the claiming request was; `None` for a record written before
    /// stores kept it (SQL migration 4, the Redis codec's second layout).
    pub first_use: Option<FirstUse>,
}

/// The longest method a record keeps (RFC 9110 methods are short tokens;
/// a custom one past this is cut).
pub const MAX_FIRST_METHOD_BYTES: usize = 32;
/// The longest path a record keeps: enough to recognise the endpoint, and
/// a bound on what a client can make every record carry.
pub const MAX_FIRST_PATH_BYTES: usize = 256;

/// What a key was first used for: the method and path of the request that
/// claimed it, so the 422 a reused key gets can say so (SDKs that reuse
/// keys by mistake are common). The path is the client's, as sent; never
/// the query, which may carry data. Both are bounded, cut on a character
/// boundary. Kept only in the record's own scope, like everything else in
/// it: another client's request never finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirstUse {
    pub method: String,
    pub path: String,
}

impl FirstUse {
    pub fn new(method: &str, path: &str) -> Self {
        let path = path.split_once('?').map_or(path, |(path, _)| path);
        Self {
            method: cut(method, MAX_FIRST_METHOD_BYTES).to_string(),
            path: cut(path, MAX_FIRST_PATH_BYTES).to_string(),
        }
    }
}

/// What a request under a reused key (another fingerprint) learns of the
/// record there: when the key was first used and, where the record kept
/// it, for what. Never the record's state (in flight, completed) nor its
/// response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyReuse {
    /// The record's `created_at`: its claim.
    pub first_used_at: UnixMillis,
    pub first_use: Option<FirstUse>,
}

/// `s`, at most `max` bytes of it, ending on a character boundary.
fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_use_is_bounded_and_has_no_query() {
        let f = FirstUse::new("POST", "/payments?card=4242");
        assert_eq!((f.method.as_str(), f.path.as_str()), ("POST", "/payments"));
        let long = format!("/{}", "a".repeat(300));
        assert_eq!(
            FirstUse::new("POST", &long).path.len(),
            MAX_FIRST_PATH_BYTES
        );
        // 'é' is two bytes: a cut at 256 would split the one at 255..257.
        let wide = format!("/{}é/tail", "a".repeat(254));
        let path = FirstUse::new("POST", &wide).path;
        assert_eq!(path.len(), 255);
        assert!(path.ends_with('a'));
        let method = FirstUse::new(&"M".repeat(40), "/").method;
        assert_eq!(method.len(), MAX_FIRST_METHOD_BYTES);
    }
}
