//! A scripted store for unit tests (tower's `mock` idea): each operation's
//! next calls fail, land but lose their answer, or land late and never
//! answer, as a test says; everything else is a [`MemoryStore`].

use super::memory::MemoryStore;
use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, Resolution, Span, Store,
    StoreError, UnixMillis, Verdict,
};
use crate::idempotency::RecordKey;
use async_trait::async_trait;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the scripted store does with the next call of an operation.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Act {
    /// Fails without touching the records (nothing landed).
    Fail,
    /// Applies the write, then loses the answer.
    Lose,
    /// Applies the write `after` from now, in a task of its own (like a
    /// statement the database still runs), and never answers.
    LandLate(Duration),
}

/// A [`MemoryStore`] whose next calls of each operation follow a script;
/// unscripted calls pass through.
#[derive(Default)]
pub(crate) struct FlakyStore {
    inner: Arc<MemoryStore>,
    script: Mutex<Vec<(&'static str, VecDeque<Act>)>>,
    /// Writes applied by [`Act::LandLate`] so far.
    pub(crate) late_landings: Arc<AtomicU32>,
    /// What it reports as its call bound.
    bound: Duration,
}

impl FlakyStore {
    pub(crate) fn with_bound(bound: Duration) -> Self {
        Self {
            bound,
            ..Self::default()
        }
    }

    pub(crate) fn script(&self, op: &'static str, acts: &[Act]) {
        let mut script = self.script.lock().unwrap();
        script.retain(|(o, _)| *o != op);
        script.push((op, acts.iter().copied().collect()));
    }

    /// How many scripted acts of `op` are still to come.
    pub(crate) fn remaining(&self, op: &'static str) -> usize {
        let script = self.script.lock().unwrap();
        script
            .iter()
            .find(|(o, _)| *o == op)
            .map_or(0, |(_, acts)| acts.len())
    }

    fn next(&self, op: &'static str) -> Option<Act> {
        let mut script = self.script.lock().unwrap();
        script
            .iter_mut()
            .find(|(o, _)| *o == op)
            .and_then(|(_, acts)| acts.pop_front())
    }

    async fn run<T: Send + 'static>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        match self.next(op) {
            None => call.await,
            Some(Act::Fail) => Err(StoreError::unavailable(format!("scripted {op} failure"))),
            Some(Act::Lose) => {
                let _ = call.await;
                Err(StoreError::unavailable(format!(
                    "scripted lost {op} answer"
                )))
            }
            Some(Act::LandLate(after)) => {
                let landed = self.late_landings.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = call.await;
                    landed.fetch_add(1, Ordering::SeqCst);
                });
                std::future::pending().await
            }
        }
    }
}

#[async_trait]
impl Store for FlakyStore {
    async fn claim(&self, c: &Claim) -> Result<ClaimOutcome, StoreError> {
        let (inner, c) = (self.inner.clone(), c.clone());
        self.run("claim", async move { inner.claim(&c).await })
            .await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        let (inner, key, token) = (self.inner.clone(), *key, *token);
        self.run(
            "renew",
            async move { inner.renew(&key, &token, lease).await },
        )
        .await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        let (inner, key, token, c) = (self.inner.clone(), *key, *token, completion.clone());
        self.run("complete", async move {
            inner.complete(&key, &token, &c, keep).await
        })
        .await
    }
    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        let (inner, key, token) = (self.inner.clone(), *key, *token);
        self.run("release", async move { inner.release(&key, &token).await })
            .await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.inner.delete(key).await
    }
    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        now: UnixMillis,
    ) -> Result<bool, StoreError> {
        self.inner.resolve(key, verdict, now).await
    }
    async fn resolution(&self, key: &RecordKey) -> Result<Option<Resolution>, StoreError> {
        self.inner.resolution(key).await
    }
    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        self.inner.sweep(now, batch).await
    }
    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        now: UnixMillis,
    ) -> Result<Vec<(RecordKey, crate::store::Record)>, StoreError> {
        self.inner.scan_completed(after, limit, now).await
    }
    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &crate::store::StoredResponse,
        new: &crate::store::StoredResponse,
    ) -> Result<bool, StoreError> {
        self.inner.rewrite_response(key, old, new).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
    fn backend(&self) -> &'static str {
        "flaky"
    }
    fn call_bound(&self) -> Duration {
        self.bound
    }
}
