//! Mixed client traffic for the invariant harness, and the record of what
//! every request saw.
//!
//! Workers run operations at random until a deadline: fresh keys,
//! sequential duplicates, concurrent duplicates spread over the replicas,
//! a reused key with a different body, a used key from another scope and,
//! where asked, requests the client abandons mid-flight. Each operation
//! retries like a real client (on 409, 503, released keys and transport
//! errors, within a patience). Every attempt is one [`Observation`]: its
//! own request id (the [`REQUEST_ID`] header, which the recording upstream
//! logs), target replica, times and what came back.
//!
//! Every choice comes from the run's [`Seed`]: each worker draws from its
//! own generator and names its own keys (`w<worker>k<n>`), each concurrent
//! sender and each sweep of a key from one derived from that key, so a
//! replay with the same seed makes the same choices (which of them meet
//! each other in time still depends on the scheduler).

use super::recording_upstream::REQUEST_ID;
use super::seed::Seed;
use super::{Req, Resp};
use bytes::Bytes;
use futures_util::StreamExt;
use http::Method;
use idemgate::net::errors::Chain;
use rand::rngs::StdRng;
use rand::Rng;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The scopes (`Authorization` values; `None` is the anonymous scope).
pub const SCOPES: [Option<&str>; 4] = [
    Some("Bearer alice"),
    Some("Bearer bob"),
    Some("Bearer carol"),
    None,
];

/// A request unanswered for this long hung (a violation); well above
/// every bound the proxy has in the harness's configs.
pub const CLIENT_BOUND: Duration = Duration::from_secs(8);

/// How long an operation keeps retrying during the load.
const LOAD_PATIENCE: Duration = Duration::from_secs(3);
const MAX_ATTEMPTS: usize = 8;
/// Concurrent requests of the final sweep.
const SWEEP_CONCURRENCY: usize = 8;

/// What one request got.
#[derive(Clone, Debug)]
pub enum Seen {
    Response(Resp),
    /// No response: refused, reset or closed.
    Transport(String),
    /// The client hung up on purpose (dropped the request future).
    Dropped,
    /// Nothing within [`CLIENT_BOUND`].
    Hung,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Traffic while the fault is injected.
    Load,
    /// One request per key afterwards, retried until it has an answer.
    Sweep,
}

/// One request and what it saw.
#[derive(Clone, Debug)]
pub struct Observation {
    pub id: u64,
    pub phase: Phase,
    pub scope: Option<&'static str>,
    pub key: String,
    pub body: Bytes,
    pub replica: usize,
    pub started: Instant,
    pub ended: Instant,
    pub seen: Seen,
}

/// A request as the traffic sends it (and as the sweep repeats it).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Call {
    pub scope: Option<&'static str>,
    pub key: String,
    pub body: Bytes,
}

/// The traffic generator and its log, shared by its workers.
pub struct Traffic {
    replicas: Vec<SocketAddr>,
    /// Some operations abandon requests mid-flight.
    drops: bool,
    seed: Seed,
    next_id: AtomicU64,
    log: Mutex<Vec<Observation>>,
    /// Calls made so far, for operations that reuse a key.
    used: Mutex<Vec<Call>>,
}

fn pick(rng: &mut StdRng, n: usize) -> usize {
    rng.random_range(0..n.max(1))
}

fn millis(rng: &mut StdRng, lo: u64, hi: u64) -> Duration {
    Duration::from_millis(rng.random_range(lo..hi))
}

/// One worker: its generator and the keys it made up so far.
struct Worker {
    id: usize,
    made: u64,
    rng: StdRng,
}

impl Worker {
    /// A name nobody used yet (for a key, or a body).
    fn next(&mut self) -> String {
        self.made += 1;
        format!("w{}k{}", self.id, self.made)
    }
}

impl Traffic {
    /// Traffic to `replicas` (by index; a replica may be down at times),
    /// choosing from `seed`.
    pub fn new(replicas: Vec<SocketAddr>, drops: bool, seed: Seed) -> Arc<Self> {
        Arc::new(Self {
            replicas,
            drops,
            seed,
            next_id: AtomicU64::new(1),
            log: Mutex::new(Vec::new()),
            used: Mutex::new(Vec::new()),
        })
    }

    pub fn observations(&self) -> Vec<Observation> {
        self.log.lock().unwrap().clone()
    }

    /// `workers` concurrent workers, each running operations until `load`
    /// has passed; returns when the last operation ended.
    pub async fn run(self: Arc<Self>, workers: usize, load: Duration) {
        let deadline = Instant::now() + load;
        let tasks = (0..workers).map(|id| {
            let me = self.clone();
            let rng = me.seed.rng(format_args!("worker {id}"));
            let mut worker = Worker { id, made: 0, rng };
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    me.clone().operation(&mut worker).await;
                }
            })
        });
        for t in futures_util::future::join_all(tasks).await {
            t.expect("traffic worker");
        }
    }

    /// Sends each group of calls in order on the `alive` replicas, each
    /// retried until it is answered (409s for up to `patience`),
    /// `SWEEP_CONCURRENCY` groups at a time.
    pub async fn sweep(
        self: Arc<Self>,
        groups: Vec<Vec<Call>>,
        alive: Vec<usize>,
        patience: Duration,
    ) {
        futures_util::stream::iter(groups.into_iter().enumerate())
            .for_each_concurrent(SWEEP_CONCURRENCY, |(i, calls)| {
                let me = self.clone();
                let first = alive[i % alive.len()];
                async move {
                    let Some(head) = calls.first() else { return };
                    let mut rng = me
                        .seed
                        .rng(format_args!("sweep {:?} {}", head.scope, head.key));
                    for call in &calls {
                        me.until_answered(Phase::Sweep, call, first, patience, &mut rng)
                            .await;
                    }
                }
            })
            .await;
    }

    fn fresh(&self, scope: Option<&'static str>, worker: &mut Worker) -> Call {
        let key = worker.next();
        let body = Bytes::from(format!(r#"{{"order":"{key}","v":"a"}}"#));
        Call { scope, key, body }
    }

    fn remember(&self, call: &Call) {
        self.used.lock().unwrap().push(call.clone());
    }

    fn some_used(&self, rng: &mut StdRng) -> Option<Call> {
        let used = self.used.lock().unwrap();
        (!used.is_empty()).then(|| used[pick(rng, used.len())].clone())
    }

    async fn operation(self: Arc<Self>, w: &mut Worker) {
        let scope = SCOPES[pick(&mut w.rng, SCOPES.len())];
        let replica = pick(&mut w.rng, self.replicas.len());
        let kinds = if self.drops { 12 } else { 9 };
        match pick(&mut w.rng, kinds) {
            // A fresh key, once.
            0..=2 => {
                let call = self.fresh(scope, w);
                self.remember(&call);
                self.until_answered(Phase::Load, &call, replica, LOAD_PATIENCE, &mut w.rng)
                    .await;
            }
            // Sequential duplicates, on any replica.
            3 | 4 => {
                let call = self.fresh(scope, w);
                self.remember(&call);
                for _ in 0..1 + pick(&mut w.rng, 3) {
                    let replica = pick(&mut w.rng, self.replicas.len());
                    self.until_answered(Phase::Load, &call, replica, LOAD_PATIENCE, &mut w.rng)
                        .await;
                }
            }
            // Concurrent duplicates, spread over the replicas.
            5 | 6 => {
                let call = self.fresh(scope, w);
                self.remember(&call);
                let sends = (0..3 + pick(&mut w.rng, 4)).map(|i| {
                    let (me, call) = (self.clone(), call.clone());
                    let mut rng = me.seed.rng(format_args!("sender {i} of {}", call.key));
                    tokio::spawn(async move {
                        let first = replica + i;
                        me.until_answered(Phase::Load, &call, first, LOAD_PATIENCE, &mut rng)
                            .await;
                    })
                });
                for t in futures_util::future::join_all(sends).await {
                    t.expect("duplicate sender");
                }
            }
            // A used key with a different body (422, or a new execution
            // after a release).
            7 => {
                if let Some(mut call) = self.some_used(&mut w.rng) {
                    let key = w.next();
                    call.body = Bytes::from(format!(r#"{{"order":"{key}","v":"b"}}"#));
                    self.remember(&call);
                    self.until_answered(Phase::Load, &call, replica, LOAD_PATIENCE, &mut w.rng)
                        .await;
                }
            }
            // A used key and body from another scope: its own execution.
            8 => {
                if let Some(mut call) = self.some_used(&mut w.rng) {
                    let others: Vec<_> = SCOPES.iter().filter(|s| **s != call.scope).collect();
                    call.scope = *others[pick(&mut w.rng, others.len())];
                    self.remember(&call);
                    self.until_answered(Phase::Load, &call, replica, LOAD_PATIENCE, &mut w.rng)
                        .await;
                }
            }
            // Hang up mid-request, then retry a little later.
            _ => {
                let call = self.fresh(scope, w);
                self.remember(&call);
                let after = millis(&mut w.rng, 5, 400);
                let gone = self.send(Phase::Load, &call, replica, Some(after)).await;
                if matches!(gone, Seen::Dropped) {
                    tokio::time::sleep(millis(&mut w.rng, 0, 300)).await;
                }
                let replica = pick(&mut w.rng, self.replicas.len());
                self.until_answered(Phase::Load, &call, replica, LOAD_PATIENCE, &mut w.rng)
                    .await;
            }
        }
    }

    /// Sends `call` until it gets an answer a client would not retry, or
    /// `patience` or [`MAX_ATTEMPTS`] run out. Transport errors move on to
    /// the next replica.
    async fn until_answered(
        &self,
        phase: Phase,
        call: &Call,
        first: usize,
        patience: Duration,
        rng: &mut StdRng,
    ) {
        let started = Instant::now();
        let mut replica = first % self.replicas.len();
        for _ in 0..MAX_ATTEMPTS {
            let seen = self.send(phase, call, replica, None).await;
            let Some(wait) = retry_after(&seen, rng) else {
                return;
            };
            if matches!(seen, Seen::Transport(_)) {
                // Half the clients that lost their connection are gone for
                // good (crashed with it), leaving their key to others.
                if phase == Phase::Load && pick(rng, 2) == 0 {
                    return;
                }
                replica = (replica + 1) % self.replicas.len();
            }
            if started.elapsed() + wait > patience {
                return;
            }
            tokio::time::sleep(wait).await;
        }
    }

    /// One request on a fresh connection; `drop_after` abandons it.
    async fn send(
        &self,
        phase: Phase,
        call: &Call,
        replica: usize,
        drop_after: Option<Duration>,
    ) -> Seen {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut req = Req::new(
            Method::POST,
            format!("http://{}{}", self.replicas[replica], super::ORDERS),
        )
        .key(&call.key)
        .header(REQUEST_ID, &id.to_string())
        .header("content-type", "application/json")
        .body(call.body.clone());
        if let Some(scope) = call.scope {
            req = req.header("authorization", scope);
        }
        let started = Instant::now();
        let bound = drop_after.unwrap_or(CLIENT_BOUND);
        let seen = match tokio::time::timeout(bound, req.try_send()).await {
            Ok(Ok(resp)) => Seen::Response(resp),
            Ok(Err(e)) => Seen::Transport(Chain(e.as_ref()).to_string()),
            Err(_) if drop_after.is_some() => Seen::Dropped,
            Err(_) => Seen::Hung,
        };
        self.log.lock().unwrap().push(Observation {
            id,
            phase,
            scope: call.scope,
            key: call.key.clone(),
            body: call.body.clone(),
            replica,
            started,
            ended: Instant::now(),
            seen: seen.clone(),
        });
        seen
    }
}

/// How long a client waits before retrying what it saw, or `None`: done.
fn retry_after(seen: &Seen, rng: &mut StdRng) -> Option<Duration> {
    match seen {
        Seen::Response(r) => match r.status() {
            409 => Some(millis(rng, 150, 300)),
            503 => Some(millis(rng, 200, 400)),
            408 | 425 | 429 | 500..=599 => Some(millis(rng, 20, 80)),
            _ => None,
        },
        Seen::Transport(_) => Some(millis(rng, 50, 150)),
        Seen::Dropped | Seen::Hung => None,
    }
}
