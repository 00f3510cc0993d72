//! In-process store: a mutex-guarded map. For tests and throwaway sidecars
//! only: **not durable**, records vanish on restart, and it is not shared
//! between replicas. It is also the reference the other backends match.

use super::{
    is_claimable, is_sweepable, Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record,
    RecordState, Resolution, Span, Store, StoreError, StoredResponse, UnixMillis, Verdict,
    RESOLVED_STATUS,
};
use crate::config::DEFAULT_STORE_TIMEOUT;
use crate::idempotency::RecordKey;
use async_trait::async_trait;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

pub struct MemoryStore {
    // A std mutex: no await happens while it is held.
    records: Mutex<HashMap<RecordKey, Entry>>,
    /// `store.timeout`: reported as the call bound, never waited for here.
    timeout: Duration,
}

struct Entry {
    record: Record,
    token: Option<LeaseToken>,
    resolution: Option<Resolution>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store with the default `store.timeout`.
    pub fn new() -> Self {
        Self {
            records: Mutex::default(),
            timeout: DEFAULT_STORE_TIMEOUT,
        }
    }

    /// The same, bounded by the configured `store.timeout`.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<RecordKey, Entry>) -> T) -> T {
        let mut guard = self.records.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }
}

impl Entry {
    /// Whether `token` currently owns this record, in flight.
    fn is_owned_by(&self, token: &LeaseToken) -> bool {
        self.token.as_ref() == Some(token)
            && matches!(self.record.state, RecordState::InFlight { .. })
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        Ok(self.with(|map| {
            let takeover = match map.get(&claim.key) {
                None => false,
                Some(entry) if is_claimable(&entry.record, &claim.fingerprint, claim.now) => {
                    matches!(entry.record.state, RecordState::InFlight { .. })
                }
                Some(entry) => return ClaimOutcome::Existing(entry.record.clone()),
            };
            map.insert(
                claim.key,
                Entry {
                    record: Record {
                        fingerprint: claim.fingerprint,
                        state: RecordState::InFlight {
                            locked_until: claim.locked_until(),
                        },
                        created_at: claim.now,
                        expires_at: claim.expires_at(),
                        first_use: claim.first_use.clone(),
                    },
                    token: Some(claim.token),
                    resolution: None,
                },
            );
            ClaimOutcome::Claimed { takeover }
        }))
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        Ok(self.with(|map| match map.get_mut(key) {
            Some(entry) if entry.is_owned_by(token) => {
                entry.record.state = RecordState::InFlight {
                    locked_until: lease.end(),
                };
                Fence::Held
            }
            _ => Fence::Lost,
        }))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        Ok(self.with(|map| match map.get_mut(key) {
            Some(entry) if entry.is_owned_by(token) => {
                entry.record.state = RecordState::from(completion);
                entry.token = None;
                entry.record.expires_at = entry.record.expires_at.max(keep.end());
                Fence::Held
            }
            _ => Fence::Lost,
        }))
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        Ok(self.with(|map| {
            if !map.get(key).is_some_and(|entry| entry.is_owned_by(token)) {
                return Fence::Lost;
            }
            map.remove(key);
            Fence::Held
        }))
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        Ok(self.with(|map| map.get(key).map(|entry| entry.record.clone())))
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        Ok(self.with(|map| map.remove(key).is_some()))
    }

    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        now: UnixMillis,
    ) -> Result<bool, StoreError> {
        Ok(self.with(|map| {
            let Some(entry) = map
                .get_mut(key)
                .filter(|entry| entry.record.state == RecordState::Unknown)
                // Expired: every claim takes it as new already.
                .filter(|entry| entry.record.expires_at > now)
            else {
                return false;
            };
            match verdict {
                Verdict::NotApplied => {
                    map.remove(key);
                }
                Verdict::Applied { reason } => {
                    entry.record.state = RecordState::Unstored {
                        status: RESOLVED_STATUS,
                    };
                    entry.resolution = Some(Resolution {
                        at: now,
                        reason: reason.clone(),
                    });
                }
            }
            true
        }))
    }

    async fn resolution(&self, key: &RecordKey) -> Result<Option<Resolution>, StoreError> {
        Ok(self.with(|map| map.get(key).and_then(|entry| entry.resolution.clone())))
    }

    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        Ok(self.with(|map| {
            let doomed: Vec<RecordKey> = map
                .iter()
                .filter(|(_, entry)| is_sweepable(&entry.record, now))
                .map(|(key, _)| *key)
                .take(batch as usize)
                .collect();
            for key in &doomed {
                map.remove(key);
            }
            doomed.len() as u64
        }))
    }

    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        now: UnixMillis,
    ) -> Result<Vec<(RecordKey, Record)>, StoreError> {
        Ok(self.with(|map| {
            let mut page: Vec<(RecordKey, Record)> = map
                .iter()
                .filter(|(key, _)| after.is_none_or(|after| **key > after))
                .filter(|(_, entry)| {
                    matches!(entry.record.state, RecordState::Completed(_))
                        && entry.record.expires_at > now
                })
                .map(|(key, entry)| (*key, entry.record.clone()))
                .collect();
            page.sort_unstable_by_key(|(key, _)| *key);
            page.truncate(limit as usize);
            page
        }))
    }

    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &StoredResponse,
        new: &StoredResponse,
    ) -> Result<bool, StoreError> {
        Ok(self.with(|map| match map.get_mut(key) {
            Some(entry) if matches!(&entry.record.state, RecordState::Completed(r) if r == old) => {
                entry.record.state = RecordState::Completed(new.clone());
                true
            }
            _ => false,
        }))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "memory"
    }

    fn call_bound(&self) -> Duration {
        self.timeout
    }
}
