//! The idempotency protocol, as pure data in and data out: no sockets, no
//! store, no clock reads (`now` is always an argument).
//!
//! Lifecycle of one key (scoped by client, see [`key::RecordKey`]):
//!
//! ```text
//!             claim (atomic insert)            complete (fenced by token)
//!   absent ─────────────────────────► in flight ────────────────────────► completed ──► (ttl) absent
//!     ▲                                │   │  renew (fenced) extends the lease              │
//!     │   release (fenced): 408, 425,  │   │                                                │
//!     └── 429, 5xx, refused, (timeout)─┘   └─ lease ran out: the same request takes it over │
//!     └──────────────────────────────────────────────────────────────── sweep after ttl ───┘
//! ```
//!
//! A response too large to store completes the key as `unstored`, and a
//! request sent but never answered on an `on_ambiguous = "keep"` route as
//! `unknown`: neither runs twice, and retries get a definite answer instead
//! of a replay.

pub mod canonical_json;
pub mod decision;
pub mod fingerprint;
pub mod key;
pub mod record;
pub mod vault;

pub use decision::{decide, settle, Decision, Settlement};
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, KeyError, RecordKey, RepeatedScopeHeader, Scope};
pub use record::{FirstUse, KeyReuse, Record, RecordState, StoredResponse, UnixMillis};
