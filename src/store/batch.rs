//! Group commit: concurrent calls coalesced into one statement per round
//! trip, so one commit (one WAL flush, one fsync) serves many requests.
//!
//! [`Batcher`] runs at most `lanes` batches at a time. While every lane is
//! busy, calls queue; when a lane frees, the next batch takes everything
//! queued (up to `max`). An idle store therefore sends each call alone at
//! once, and a loaded one sends fewer, larger statements: no timer, no
//! added latency. Two calls for the same record never share a batch (a
//! multi-row upsert cannot touch one row twice): a call whose record is
//! already in the batch runs at once on its own (a batch of one, outside
//! the lanes), so a storm on one key is not serialized behind the lanes.

use super::{Completion, LeaseToken, Span};
use crate::idempotency::RecordKey;
use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, Semaphore};

/// One completion waiting for a batch: [`super::Store::complete`]'s arguments.
pub(crate) struct Completing {
    pub key: RecordKey,
    pub token: LeaseToken,
    pub completion: Completion,
    pub keep: Span,
}

type Call<T, R> = (T, oneshot::Sender<R>);

/// Coalesces calls of one kind; see the module docs.
pub(crate) struct Batcher<T, R> {
    calls: mpsc::UnboundedSender<Call<T, R>>,
}

impl<T, R> Batcher<T, R>
where
    T: Send + 'static,
    R: Send + 'static,
{
    /// Starts the batching task. `key` names the record a call touches;
    /// `run` executes one batch and answers each call, in order. The task
    /// ends when the batcher is dropped.
    pub(crate) fn start<K, F, Fut>(lanes: usize, max: usize, key: fn(&T) -> K, run: F) -> Self
    where
        K: Hash + Eq + Send + 'static,
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<R>> + Send + 'static,
    {
        let (calls, queue) = mpsc::unbounded_channel();
        tokio::spawn(batch_loop(queue, lanes.max(1), max.max(1), key, run));
        Self { calls }
    }

    /// Submits one call and waits for its answer; `None` if the batching
    /// task is gone (the runtime is shutting down).
    pub(crate) async fn call(&self, item: T) -> Option<R> {
        let (answer, answered) = oneshot::channel();
        self.calls.send((item, answer)).ok()?;
        answered.await.ok()
    }
}

async fn batch_loop<T, R, K, F, Fut>(
    mut queue: mpsc::UnboundedReceiver<Call<T, R>>,
    lanes: usize,
    max: usize,
    key: fn(&T) -> K,
    run: F,
) where
    T: Send + 'static,
    R: Send + 'static,
    K: Hash + Eq,
    F: Fn(Vec<T>) -> Fut,
    Fut: Future<Output = Vec<R>> + Send + 'static,
{
    let lanes = Arc::new(Semaphore::new(lanes));
    // Calls that lost their place to an earlier call for the same record.
    let mut deferred: VecDeque<Call<T, R>> = VecDeque::new();
    loop {
        if deferred.is_empty() {
            match queue.recv().await {
                Some(call) => deferred.push_back(call),
                None => return,
            }
        }
        // Wait for a lane first, so calls keep queueing meanwhile.
        let Ok(lane) = lanes.clone().acquire_owned().await else {
            return;
        };
        while let Ok(call) = queue.try_recv() {
            deferred.push_back(call);
        }
        let mut seen = HashSet::new();
        let mut batch = Vec::new();
        let mut later = VecDeque::new();
        while let Some(call) = deferred.pop_front() {
            if batch.len() >= max {
                later.push_back(call);
            } else if seen.insert(key(&call.0)) {
                batch.push(call);
            } else {
                answer_when_done(run(vec![call.0]), vec![call.1], None);
            }
        }
        deferred = later;
        let (items, answers): (Vec<T>, Vec<oneshot::Sender<R>>) = batch.into_iter().unzip();
        answer_when_done(run(items), answers, Some(lane));
    }
}

/// Runs one batch in a task of its own and answers its callers, then frees
/// its lane (if it holds one).
fn answer_when_done<R, Fut>(
    work: Fut,
    answers: Vec<oneshot::Sender<R>>,
    lane: Option<tokio::sync::OwnedSemaphorePermit>,
) where
    R: Send + 'static,
    Fut: Future<Output = Vec<R>> + Send + 'static,
{
    // Boxed before the spawn: a store's batch future (tokio-postgres
    // queries, retries) is kilobytes, and an unboxed one is copied whole
    // into the task, and again as the task's stage changes: half of a
    // fresh key's instructions on PostgreSQL were those copies
    // (callgrind, bench/profile.sh MODE=fresh STORE=postgres).
    let work = Box::pin(work);
    tokio::spawn(async move {
        let results = work.await;
        for (answer, result) in answers.into_iter().zip(results) {
            // The caller may have given up (its deadline); the work was
            // done anyway and the token decides what it means.
            let _ = answer.send(result);
        }
        drop(lane);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Duration;

    type Doubling = Batcher<(u32, u32), u32>;

    /// One call on a task of its own.
    fn spawn_call(
        batcher: &Arc<Doubling>,
        item: (u32, u32),
    ) -> tokio::task::JoinHandle<Option<u32>> {
        let b = batcher.clone();
        tokio::spawn(async move { b.call(item).await })
    }

    /// Records the batches it ran; each call answers its own value doubled.
    fn doubling(lanes: usize, max: usize, batches: Arc<Mutex<Vec<Vec<u32>>>>) -> Doubling {
        Batcher::start(
            lanes,
            max,
            |item: &(u32, u32)| item.0,
            move |items| {
                let batches = batches.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    let values = items.iter().map(|i| i.1).collect();
                    batches.lock().unwrap().push(values);
                    items.iter().map(|i| i.1 * 2).collect()
                }
            },
        )
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_batcher_sends_a_call_alone_and_a_busy_one_coalesces() {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let batcher = Arc::new(doubling(1, 64, batches.clone()));
        assert_eq!(batcher.call((1, 1)).await, Some(2));
        let calls = (2..12).map(|n| spawn_call(&batcher, (n, n)));
        let answers: Vec<_> = futures_util::future::join_all(calls)
            .await
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(answers, (2..12).map(|n| Some(n * 2)).collect::<Vec<_>>());
        let batches = batches.lock().unwrap();
        assert_eq!(batches[0], vec![1]);
        assert!(batches.len() < 11, "coalesced: {batches:?}");
        assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), 11);
    }

    #[tokio::test(start_paused = true)]
    async fn calls_for_one_record_never_share_a_batch_and_max_is_kept() {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let batcher = Arc::new(doubling(1, 3, batches.clone()));
        // Occupy the lane so the rest queue up together.
        let first = spawn_call(&batcher, (0, 100));
        tokio::task::yield_now().await;
        let calls: Vec<_> = [(7, 1), (7, 2), (8, 3), (9, 4), (10, 5)]
            .into_iter()
            .map(|item| spawn_call(&batcher, item))
            .collect();
        for (call, want) in calls.into_iter().zip([2, 4, 6, 8, 10]) {
            assert_eq!(call.await.unwrap(), Some(want));
        }
        assert_eq!(first.await.unwrap(), Some(200));
        for batch in batches.lock().unwrap().iter() {
            assert!(batch.len() <= 3, "{batch:?}");
            assert!(
                !(batch.contains(&1) && batch.contains(&2)),
                "one record twice in {batch:?}"
            );
        }
        // The second call for record 7 ran alone, not after the lane.
        assert!(batches.lock().unwrap().iter().any(|b| b == &vec![2]));
    }

    #[tokio::test(start_paused = true)]
    async fn a_storm_on_one_record_is_not_serialized_behind_the_lanes() {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let batcher = Arc::new(doubling(1, 64, batches.clone()));
        let started = tokio::time::Instant::now();
        let calls: Vec<_> = (1..=20).map(|n| spawn_call(&batcher, (7, n))).collect();
        for call in calls {
            assert!(call.await.unwrap().is_some());
        }
        // Twenty 10 ms calls on one lane, one at a time, would take 200 ms.
        let took = started.elapsed();
        assert!(took < Duration::from_millis(100), "{took:?}");
    }
}
