//! `idemgate keys`: read and repair records behind a running proxy.
//!
//! Operators name a key the way clients send it, plus the scope: the scope
//! header's value (hashed here exactly as the proxy hashes it), a scope hash
//! as printed by `show`, or `--anonymous` for requests without the header.

use crate::clock::Clock;
use crate::config::Config;
use crate::idempotency::{IdempotencyKey, RecordKey, Scope};
use crate::store::{Record, RecordState, Store, StoreError, UnixMillis};
use anyhow::Context;
use std::fmt::Write;
use std::time::{Duration, UNIX_EPOCH};

/// How the operator named the scope.
#[derive(Clone, Debug)]
pub enum ScopeArg {
    HeaderValue(String),
    Hash(String),
    Anonymous,
}

impl ScopeArg {
    /// `secret` must be the proxy's `IDEMGATE_SCOPE_SECRET`, if it has one.
    pub fn resolve(&self, secret: Option<&[u8]>) -> Result<Scope, String> {
        match self {
            ScopeArg::HeaderValue(v) => Ok(Scope::derive(Some(v.as_bytes()), secret)),
            ScopeArg::Anonymous => Ok(Scope::derive(None, secret)),
            ScopeArg::Hash(h) => {
                let bytes = hex::decode(h.trim())
                    .map_err(|_| format!("--scope {h:?}: expected 64 hex characters"))?;
                let arr: [u8; 32] = bytes
                    .try_into()
                    .map_err(|_| format!("--scope {h:?}: expected 64 hex characters"))?;
                Ok(Scope(arr))
            }
        }
    }
}

/// The record key for `key` in `scope`.
pub fn record_key(key: &str, scope: &ScopeArg, secret: Option<&[u8]>) -> Result<RecordKey, String> {
    let key = IdempotencyKey::parse(key.as_bytes()).map_err(|e| format!("invalid key: {e}"))?;
    Ok(RecordKey::new(scope.resolve(secret)?, &key))
}

/// Human-readable description of a record (or of its absence).
pub async fn show(store: &dyn Store, key: &RecordKey, clock: &Clock) -> Result<String, StoreError> {
    let now = clock.now_millis();
    let Some(record) = store.get(key).await? else {
        return Ok(format!(
            "no record for key id {} in scope {}\n",
            key.log_id(),
            key.scope.to_hex()
        ));
    };
    Ok(describe(key, &record, now))
}

pub fn describe(key: &RecordKey, r: &Record, now: UnixMillis) -> String {
    let mut out = String::new();
    let expired = r.expires_at <= now;
    let _ = writeln!(out, "key id       {}", key.log_id());
    let _ = writeln!(out, "scope        {}", key.scope.to_hex());
    let _ = writeln!(
        out,
        "state        {}{}",
        r.state.as_str(),
        if expired {
            " (expired: the next request with this key runs as new)"
        } else {
            ""
        }
    );
    let _ = writeln!(out, "fingerprint  {}", r.fingerprint.to_hex());
    let _ = writeln!(out, "created      {}", time(r.created_at));
    let _ = writeln!(
        out,
        "expires      {} ({})",
        time(r.expires_at),
        relative(r.expires_at, now)
    );
    match &r.state {
        RecordState::InFlight { locked_until } => {
            let _ = writeln!(
                out,
                "lease until  {} ({}{})",
                time(*locked_until),
                relative(*locked_until, now),
                if *locked_until <= now {
                    ", abandoned: the next retry takes it over"
                } else {
                    ""
                }
            );
        }
        RecordState::Completed(resp) => {
            let _ = writeln!(out, "status       {}", resp.status);
            let _ = writeln!(out, "body         {} bytes", resp.body.len());
            let _ = writeln!(out, "headers");
            for (name, value) in &resp.headers {
                let _ = writeln!(out, "  {name}: {}", String::from_utf8_lossy(value));
            }
        }
        RecordState::Unstored { status } => {
            let _ = writeln!(
                out,
                "status       {status} (response was too large to store; retries get 410)"
            );
        }
    }
    out
}

fn time(ms: UnixMillis) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

fn relative(ms: UnixMillis, now: UnixMillis) -> String {
    let d = Duration::from_millis((ms - now).unsigned_abs() / 1000 * 1000);
    let h = humantime::format_duration(d).to_string();
    if ms >= now {
        format!("in {h}")
    } else {
        format!("{h} ago")
    }
}

/// Deletes expired records in batches until none are left; returns the count.
pub async fn purge_expired(
    store: &dyn Store,
    batch: u32,
    clock: &Clock,
) -> Result<u64, StoreError> {
    let mut total = 0;
    loop {
        let n = store.sweep(clock.now_millis(), batch).await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
    }
}

/// What `idemgate keys` was asked to do.
pub enum KeysAction {
    Show(RecordKey),
    Delete(RecordKey),
    PurgeExpired,
}

/// `idemgate keys ...` against the configured store.
pub async fn run(config: Config, action: KeysAction) -> anyhow::Result<()> {
    if config.store.backend == crate::config::Backend::Memory {
        anyhow::bail!(
            "the memory store lives inside the proxy process; nothing outside it can inspect its keys"
        );
    }
    let store = crate::store::open(&config)
        .await
        .context("cannot open the store")?;
    match action {
        KeysAction::Show(key) => {
            print!("{}", show(store.as_ref(), &key, &Clock::system()).await?);
        }
        KeysAction::Delete(key) => {
            if store.delete(&key).await? {
                println!("deleted key id {}", key.log_id());
            } else {
                println!("no record for key id {}", key.log_id());
            }
        }
        KeysAction::PurgeExpired => {
            let n =
                purge_expired(store.as_ref(), config.store.sweep_batch, &Clock::system()).await?;
            println!("deleted {n} expired records");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::Fingerprint;
    use crate::store::memory::MemoryStore;
    use crate::store::{Claim, Completion, LeaseToken, Span, StoredResponse};
    use bytes::Bytes;

    #[tokio::test]
    async fn show_delete_and_purge_work_on_a_store() {
        let store = MemoryStore::new();
        let scope = ScopeArg::HeaderValue("Bearer t".into());
        let key = record_key("\"k-1\"", &scope, None).unwrap();
        assert_eq!(key, record_key("k-1", &scope, None).unwrap());
        let token = LeaseToken::random();
        let clock = Clock::system();
        let now = clock.now_millis();
        store
            .claim(&Claim {
                key,
                fingerprint: Fingerprint([7; 32]),
                token,
                now,
                lease_ms: 30_000,
                ttl_ms: 60_000,
            })
            .await
            .unwrap();
        let text = show(&store, &key, &clock).await.unwrap();
        assert!(text.contains("state        in_flight"), "{text}");
        let resp = StoredResponse {
            status: 201,
            headers: vec![("location".into(), Bytes::from_static(b"/o/1"))],
            body: Bytes::from_static(b"{}"),
        };
        store
            .complete(
                &key,
                &token,
                &Completion::Stored(resp),
                Span { now, ms: 60_000 },
            )
            .await
            .unwrap();
        let text = show(&store, &key, &clock).await.unwrap();
        assert!(
            text.contains("status       201") && text.contains("location: /o/1"),
            "{text}"
        );
        assert!(!text.contains("k-1"), "the raw key must not be printed");
        assert!(store.delete(&key).await.unwrap());
        assert!(show(&store, &key, &clock)
            .await
            .unwrap()
            .starts_with("no record"));
        assert_eq!(purge_expired(&store, 10, &clock).await.unwrap(), 0);
    }

    #[test]
    fn scope_hash_must_be_hex() {
        assert!(ScopeArg::Hash("zz".into()).resolve(None).is_err());
        let s = Scope::from_header_value(None);
        assert!(ScopeArg::Hash(s.to_hex()).resolve(None).unwrap() == s);
    }
}
