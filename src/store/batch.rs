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
//!
//! A batcher started with [`Sharing`] answers such a call from the batch
//! instead, when the call would get the same answer (`same`) and the answer
//! is one that many callers may hold (`shared`: for claims, a record found,
//! never a claim granted): one read serves a duplicate storm. Only calls
//! queued before the batch's statement was sent are answered so, so the
//! answer was read after each of them arrived, as its own statement's
//! would have been; any other answer (a claim granted, an error) sends
//! each of them alone, as without sharing.

use super::{Completion, LeaseToken, Span};
use crate::idempotency::RecordKey;
use std::collections::{HashMap, VecDeque};
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

/// When a call for a record already in a batch may take the batch's
/// answer for it (see the module docs).
pub(crate) struct Sharing<T, R> {
    /// Whether `follower` may take an answer read for `leader` at all.
    pub same: fn(leader: &T, follower: &T) -> bool,
    /// A copy of a leader, kept to answer its followers.
    pub copy: fn(&T) -> T,
    /// The follower's answer made from the leader's, if that answer is one
    /// many may hold; `None` sends the follower alone.
    pub answer: fn(leader: &T, follower: &T, answer: &R) -> Option<R>,
}

/// How a batcher forms batches.
struct Shape<T, R, K> {
    lanes: usize,
    max: usize,
    key: fn(&T) -> K,
    sharing: Option<Sharing<T, R>>,
}

/// Calls waiting on another call's answer in the same batch: the
/// leader's index in the batch and a copy of it, then the call.
type Followers<T, R> = Vec<(usize, T, Call<T, R>)>;

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
        Self::start_sharing(lanes, max, key, None, run)
    }

    /// [`Self::start`], answering a call for a record already in the batch
    /// from the batch's answer where `sharing` allows (module docs).
    pub(crate) fn start_sharing<K, F, Fut>(
        lanes: usize,
        max: usize,
        key: fn(&T) -> K,
        sharing: Option<Sharing<T, R>>,
        run: F,
    ) -> Self
    where
        K: Hash + Eq + Send + 'static,
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<R>> + Send + 'static,
    {
        let (calls, queue) = mpsc::unbounded_channel();
        let shape = Shape {
            lanes: lanes.max(1),
            max: max.max(1),
            key,
            sharing,
        };
        tokio::spawn(batch_loop(queue, shape, Arc::new(run)));
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
    shape: Shape<T, R, K>,
    run: Arc<F>,
) where
    T: Send + 'static,
    R: Send + 'static,
    K: Hash + Eq,
    F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<R>> + Send + 'static,
{
    let lanes = Arc::new(Semaphore::new(shape.lanes));
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
        // Each record's place in the batch.
        let mut seen = HashMap::new();
        let mut batch: Vec<Call<T, R>> = Vec::new();
        let mut followers: Followers<T, R> = Vec::new();
        let mut later = VecDeque::new();
        while let Some(call) = deferred.pop_front() {
            if batch.len() >= shape.max {
                later.push_back(call);
                continue;
            }
            let key = (shape.key)(&call.0);
            match seen.get(&key) {
                None => {
                    seen.insert(key, batch.len());
                    batch.push(call);
                }
                Some(&leader) => match &shape.sharing {
                    Some(sharing) if (sharing.same)(&batch[leader].0, &call.0) => {
                        followers.push((leader, (sharing.copy)(&batch[leader].0), call));
                    }
                    _ => answer_when_done(run(vec![call.0]), vec![call.1], None),
                },
            }
        }
        deferred = later;
        let (items, answers): (Vec<T>, Vec<oneshot::Sender<R>>) = batch.into_iter().unzip();
        let work = run(items);
        match &shape.sharing {
            Some(sharing) if !followers.is_empty() => {
                answer_sharing(work, answers, followers, sharing.answer, run.clone(), lane)
            }
            _ => answer_when_done(work, answers, Some(lane)),
        }
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

/// [`answer_when_done`], then each follower takes its leader's answer
/// where `share` makes one, or runs alone (as a batch of one, outside the
/// lanes) where it does not.
fn answer_sharing<T, R, F, Fut>(
    work: Fut,
    answers: Vec<oneshot::Sender<R>>,
    followers: Followers<T, R>,
    share: fn(&T, &T, &R) -> Option<R>,
    run: Arc<F>,
    lane: tokio::sync::OwnedSemaphorePermit,
) where
    T: Send + 'static,
    R: Send + 'static,
    F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<R>> + Send + 'static,
{
    let work = Box::pin(work);
    tokio::spawn(async move {
        let results = work.await;
        drop(lane);
        for (at, leader, (item, answer)) in followers {
            match results.get(at).and_then(|r| share(&leader, &item, r)) {
                Some(result) => {
                    let _ = answer.send(result);
                }
                None => answer_when_done(run(vec![item]), vec![answer], None),
            }
        }
        for (answer, result) in answers.into_iter().zip(results) {
            let _ = answer.send(result);
        }
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
        doubling_sharing(lanes, max, None, batches)
    }

    /// [`doubling`], with `sharing`.
    fn doubling_sharing(
        lanes: usize,
        max: usize,
        sharing: Option<Sharing<(u32, u32), u32>>,
        batches: Arc<Mutex<Vec<Vec<u32>>>>,
    ) -> Doubling {
        Batcher::start_sharing(
            lanes,
            max,
            |item: &(u32, u32)| item.0,
            sharing,
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

    /// [`doubling`] on one lane, sharing a leader's answer with followers
    /// whose value is odd (`same`) when the leader's answer is under 100
    /// (`answer`): a follower then answers the leader's answer plus one,
    /// which no run gives, so a shared answer is told from a run one.
    fn sharing(batches: Arc<Mutex<Vec<Vec<u32>>>>) -> Doubling {
        let sharing = Sharing {
            same: |_: &(u32, u32), follower: &(u32, u32)| follower.1 % 2 == 1,
            copy: |item: &(u32, u32)| *item,
            answer: |_: &(u32, u32), _: &(u32, u32), answer: &u32| {
                (*answer < 100).then_some(answer + 1)
            },
        };
        doubling_sharing(1, 64, Some(sharing), batches)
    }

    /// A duplicate storm on one record: calls queued behind a batch that
    /// reads it take the batch's answer (one run), where `same` and
    /// `answer` allow; the rest run alone, as without sharing.
    #[tokio::test(start_paused = true)]
    async fn calls_queued_for_a_record_in_the_batch_share_its_answer_where_allowed() {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let batcher = Arc::new(sharing(batches.clone()));
        // Occupy the lane so the rest queue up together.
        let first = spawn_call(&batcher, (0, 200));
        tokio::task::yield_now().await;
        // Key 7: leader 2 (answer 4), followers 3 and 5 share (5), 4 runs
        // alone (not `same`). Key 8: leader 60 (answer 120, not shared),
        // follower 61 runs alone.
        let calls: Vec<_> = [(7, 2), (7, 3), (7, 4), (7, 5), (8, 60), (8, 61)]
            .into_iter()
            .map(|item| spawn_call(&batcher, item))
            .collect();
        let mut answers = Vec::new();
        for call in calls {
            answers.push(call.await.unwrap());
        }
        assert_eq!(first.await.unwrap(), Some(400));
        assert_eq!(
            answers,
            [Some(4), Some(5), Some(8), Some(5), Some(120), Some(122)]
        );
        let mut ran: Vec<u32> = batches.lock().unwrap().iter().flatten().copied().collect();
        ran.sort();
        assert_eq!(ran, [2, 4, 60, 61, 200], "3 and 5 never ran");
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
