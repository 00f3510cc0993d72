//! In-process store: a mutex-guarded map. For tests and throwaway sidecars
//! only: **not durable**, records vanish on restart, and it is not shared
//! between replicas. It is also the reference the other backends match.

use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, RecordState, Store, StoreError,
    UnixMillis,
};
use crate::idempotency::RecordKey;
use async_trait::async_trait;
use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Default)]
pub struct MemoryStore {
    // A std mutex: no await happens while it is held.
    records: Mutex<HashMap<RecordKey, Entry>>,
}

struct Entry {
    record: Record,
    token: Option<LeaseToken>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<RecordKey, Entry>) -> T) -> T {
        let mut guard = self.records.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }
}

/// Whether `token` currently owns an in-flight `entry`.
fn owns(entry: Option<&Entry>, token: &LeaseToken) -> bool {
    matches!(entry, Some(e) if e.token.as_ref() == Some(token)
        && matches!(e.record.state, RecordState::InFlight { .. }))
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(&self, c: &Claim) -> Result<ClaimOutcome, StoreError> {
        Ok(self.with(|map| {
            let takeover = match map.get(&c.key) {
                None => false,
                Some(e) if super::is_claimable(&e.record, c.now) => {
                    matches!(e.record.state, RecordState::InFlight { .. })
                }
                Some(e) => return ClaimOutcome::Existing(e.record.clone()),
            };
            map.insert(
                c.key,
                Entry {
                    record: Record {
                        fingerprint: c.fingerprint,
                        state: RecordState::InFlight {
                            locked_until: c.locked_until(),
                        },
                        created_at: c.now,
                        expires_at: c.expires_at(),
                    },
                    token: Some(c.token),
                },
            );
            ClaimOutcome::Claimed { takeover }
        }))
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        locked_until: UnixMillis,
    ) -> Result<Fence, StoreError> {
        Ok(self.with(|map| {
            if !owns(map.get(key), token) {
                return Fence::Lost;
            }
            let e = map.get_mut(key).expect("checked above");
            e.record.state = RecordState::InFlight { locked_until };
            Fence::Held
        }))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        expires_at: UnixMillis,
    ) -> Result<Fence, StoreError> {
        Ok(self.with(|map| {
            if !owns(map.get(key), token) {
                return Fence::Lost;
            }
            let e = map.get_mut(key).expect("checked above");
            e.record.state = match completion {
                Completion::Stored(r) => RecordState::Completed(r.clone()),
                Completion::Unstored { status } => RecordState::Unstored { status: *status },
            };
            e.token = None;
            e.record.expires_at = expires_at;
            Fence::Held
        }))
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        Ok(self.with(|map| {
            if !owns(map.get(key), token) {
                return Fence::Lost;
            }
            map.remove(key);
            Fence::Held
        }))
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        Ok(self.with(|map| map.get(key).map(|e| e.record.clone())))
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        Ok(self.with(|map| map.remove(key).is_some()))
    }

    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        Ok(self.with(|map| {
            let doomed: Vec<RecordKey> = map
                .iter()
                .filter(|(_, e)| is_sweepable(&e.record, now))
                .map(|(k, _)| *k)
                .take(batch as usize)
                .collect();
            for k in &doomed {
                map.remove(k);
            }
            doomed.len() as u64
        }))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "memory"
    }
}

/// Expired, and not an in-flight record whose lease is still live.
pub(crate) fn is_sweepable(record: &Record, now: UnixMillis) -> bool {
    record.expires_at <= now
        && !matches!(record.state, RecordState::InFlight { locked_until } if locked_until > now)
}
