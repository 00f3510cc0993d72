//! The one seam every store call goes through. [`Instrumented`] wraps the
//! configured backend: it bounds each call by the backend's own
//! [`Store::call_bound`] (past it, the call is [`StoreError::Timeout`]) and
//! records its latency as `idemgate_store_duration_seconds{op}` (and, when
//! tracing, a child span of the request's), so callers write neither a
//! timeout nor a metric around a store call.
//!
//! It decides nothing else: no retries, and a timed-out write is reported,
//! not undone (it may still land; the caller's token decides what it means).

use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, Resolution, Span, Store,
    StoreError, StoredResponse, UnixMillis, Verdict,
};
use crate::idempotency::RecordKey;
use crate::metrics::Metrics;
use crate::telemetry::trace;
use async_trait::async_trait;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A store operation, as labelled in `store_duration_seconds{op}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Claim,
    Renew,
    Complete,
    Release,
    Get,
    Delete,
    Resolve,
    Sweep,
    Scan,
    Rewrite,
    Ping,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Claim => "claim",
            Op::Renew => "renew",
            Op::Complete => "complete",
            Op::Release => "release",
            Op::Get => "get",
            Op::Delete => "delete",
            Op::Resolve => "resolve",
            Op::Sweep => "sweep",
            Op::Scan => "scan",
            Op::Rewrite => "rewrite",
            Op::Ping => "ping",
        }
    }
}

/// A store whose every call is bounded and timed (see the module docs).
pub struct Instrumented {
    inner: Arc<dyn Store>,
    /// `inner.call_bound()`, read once: a backend's bound comes from its
    /// configuration and does not change.
    bound: Duration,
    metrics: Arc<Metrics>,
}

impl Instrumented {
    pub fn new(inner: Arc<dyn Store>, metrics: Arc<Metrics>) -> Self {
        Self {
            bound: inner.call_bound(),
            inner,
            metrics,
        }
    }

    /// Runs one call of `op` within the bound and records how long it took,
    /// whatever its result.
    async fn call<T>(
        &self,
        op: Op,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let _timer = Timer {
            op,
            started: Instant::now(),
            metrics: &self.metrics,
        };
        let span = trace::store(op.as_str());
        let result = tokio::time::timeout(self.bound, call)
            .await
            .unwrap_or(Err(StoreError::Timeout));
        span.finish(&result);
        result
    }
}

/// Records a call's latency when dropped, so a call its caller gave up on
/// (a renewal past its own deadline) is measured too.
struct Timer<'a> {
    op: Op,
    started: Instant,
    metrics: &'a Metrics,
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        self.metrics
            .store_op(self.op.as_str(), self.started.elapsed());
    }
}

#[async_trait]
impl Store for Instrumented {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        self.call(Op::Claim, self.inner.claim(claim)).await
    }

    async fn claim_authoritative(&self, claim: &Claim) -> Result<Option<ClaimOutcome>, StoreError> {
        self.call(Op::Claim, self.inner.claim_authoritative(claim))
            .await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        self.call(Op::Renew, self.inner.renew(key, token, lease))
            .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        self.call(
            Op::Complete,
            self.inner.complete(key, token, completion, keep),
        )
        .await
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        self.call(Op::Release, self.inner.release(key, token)).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.call(Op::Get, self.inner.get(key)).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.call(Op::Delete, self.inner.delete(key)).await
    }

    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        now: UnixMillis,
    ) -> Result<bool, StoreError> {
        self.call(Op::Resolve, self.inner.resolve(key, verdict, now))
            .await
    }

    async fn resolution(&self, key: &RecordKey) -> Result<Option<Resolution>, StoreError> {
        self.call(Op::Get, self.inner.resolution(key)).await
    }

    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        self.call(Op::Sweep, self.inner.sweep(now, batch)).await
    }

    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        now: UnixMillis,
    ) -> Result<Vec<(RecordKey, Record)>, StoreError> {
        self.call(Op::Scan, self.inner.scan_completed(after, limit, now))
            .await
    }

    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &StoredResponse,
        new: &StoredResponse,
    ) -> Result<bool, StoreError> {
        self.call(Op::Rewrite, self.inner.rewrite_response(key, old, new))
            .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(Op::Ping, self.inner.ping()).await
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn call_bound(&self) -> Duration {
        self.bound
    }

    fn degraded(&self) -> Option<String> {
        self.inner.degraded()
    }

    async fn ping_fast_path(&self) -> Option<crate::store::FastPathPing> {
        self.inner.ping_fast_path().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;
    use crate::store::sample_claim as claim;
    use crate::store::scripted::{Act, FlakyStore};

    fn series(metrics: &Metrics, what: &str, op: Op) -> f64 {
        let name = format!(
            "idemgate_store_duration_seconds_{what}{{op=\"{}\"}} ",
            op.as_str()
        );
        let text = metrics.encode();
        text.lines()
            .find_map(|line| line.strip_prefix(&name))
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no {name}in\n{text}"))
    }

    #[tokio::test]
    async fn a_call_past_the_bound_is_a_timeout_and_its_latency_is_recorded() {
        let metrics = Arc::new(Metrics::new());
        // Answers nothing for a long time: the claim outlasts the bound.
        let stuck = FlakyStore::with_bound(Duration::from_millis(50));
        stuck.script("claim", &[Act::LandLate(Duration::from_secs(3600))]);
        let store = Instrumented::new(Arc::new(stuck), metrics.clone());
        assert_eq!(store.call_bound(), Duration::from_millis(50));
        let started = Instant::now();
        let res = store.claim(&claim()).await;
        let took = started.elapsed();
        assert!(matches!(res, Err(StoreError::Timeout)), "{res:?}");
        assert!(took >= Duration::from_millis(50), "gave up after {took:?}");
        assert!(took < Duration::from_secs(5), "took {took:?}");
        assert_eq!(series(&metrics, "count", Op::Claim), 1.0);
        assert!(series(&metrics, "sum", Op::Claim) >= 0.05);
    }

    #[tokio::test]
    async fn every_operation_is_timed_under_its_name() {
        let metrics = Arc::new(Metrics::new());
        let store = Instrumented::new(Arc::new(MemoryStore::new()), metrics.clone());
        let claim = claim();
        let (key, token) = (&claim.key, &claim.token);
        assert!(matches!(
            store.claim(&claim).await,
            Ok(ClaimOutcome::Claimed { .. })
        ));
        let lease = Span {
            now: 1_000,
            ms: 1_000,
        };
        assert_eq!(store.renew(key, token, lease).await.unwrap(), Fence::Held);
        let done = Completion::Unstored { status: 200 };
        let keep = Span {
            now: 1_000,
            ms: 4_000,
        };
        assert_eq!(
            store.complete(key, token, &done, keep).await.unwrap(),
            Fence::Held
        );
        assert_eq!(store.release(key, token).await.unwrap(), Fence::Lost);
        assert!(store.get(key).await.unwrap().is_some());
        assert!(store.delete(key).await.unwrap());
        assert_eq!(store.sweep(10_000, 10).await.unwrap(), 0);
        store.ping().await.unwrap();
        for op in [
            Op::Claim,
            Op::Renew,
            Op::Complete,
            Op::Release,
            Op::Get,
            Op::Delete,
            Op::Sweep,
            Op::Ping,
        ] {
            assert_eq!(series(&metrics, "count", op), 1.0, "{op:?}");
        }
        assert_eq!(store.backend(), "memory");
    }
}
