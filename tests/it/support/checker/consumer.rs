//! The invariant checker for message consumers (issue 24): what the
//! harness published to a queue or stream, what the recording upstream
//! executed (each replica through a door of its own), which faults
//! happened when, and what the broker and the store ended with, judged
//! against the consumer's promise (README, "Message consumers"):
//!
//! 1. **Nothing lost.** Every key published executed, and its last
//!    execution is an answer the consumer stores (not one that releases
//!    the key); the queue (or durable consumer) ends with nothing ready
//!    or pending and nothing unacked; the store ends with one completed
//!    record per key and none in flight or parked.
//! 2. **At most one execution per key, except after a documented
//!    release**: an answer that releases the key (the fate table's
//!    retry), or the *lease-expiry release*: the replica that sent it
//!    upstream was SIGKILLed before its answer could be recorded, so the
//!    key stayed in flight until its lease ran out and a redelivery of the
//!    same message took it over. Those keys are counted and named, and
//!    there can be no more of them than the killed replica could hold
//!    (its prefetch). A broker restart excuses nothing: deliveries whose
//!    acks it lost are answered from the record.
//! 3. **Every duplicate suppressed**: a repeated publish of a message runs
//!    only where (2) lets its key run again.
//! 4. **Dead letters only where expected**: a message whose key's
//!    recorded answer is 400 or above (`rejected`), a different payload
//!    under a used key (`mismatch`), a message without a key (`no_key`);
//!    each of those has its dead letter, and no other message has one.

use super::{upstream_release, Event, EventKind, Release, Report, IN_TRANSIT};
use crate::support::recording_upstream::Execution;
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

/// How long after the upstream's answer a live replica has surely recorded
/// it (the store answers in milliseconds here): an execution its replica
/// had answered this long before a SIGKILL is not in doubt.
const RECORDED_WITHIN: Duration = Duration::from_secs(1);

/// One message the harness published.
#[derive(Clone, Debug)]
pub struct Published {
    /// Its `x-test-request` header, which the upstream records as the
    /// execution's request id: unique per publish.
    pub request: u64,
    /// The message key (`None`: published without one).
    pub key: Option<String>,
    pub body: Bytes,
}

/// Everything a consumer run recorded.
pub struct ConsumerTrace {
    pub fault: &'static str,
    pub t0: Instant,
    pub published: Vec<Published>,
    /// Door `n` is replica `n`.
    pub executions: Vec<Execution>,
    /// `Killed(n)` / `Restarted(n)` for replica `n`, broker stops/starts.
    pub events: Vec<Event>,
    pub upstream_timeout: Duration,
    /// The most deliveries one replica holds at once (`prefetch`,
    /// `max_ack_pending`).
    pub prefetch: usize,
    /// The request id each dead letter carries (`None`: it carries none).
    pub dead_letters: Vec<Option<u64>>,
    /// The queue's (ready, unacked), or the durable consumer's (pending,
    /// ack pending), at the end.
    pub left: (u64, u64),
    /// The store's records by state at the end.
    pub records: BTreeMap<String, i64>,
}

/// Counts and violations of one consumer run.
#[derive(Clone, Debug, Default)]
pub struct ConsumerReport {
    /// The shared columns: `requests` are the messages published,
    /// `releases` the executions whose key could run again, `mismatches`
    /// the `mismatch` dead letters.
    pub report: Report,
    pub keys: usize,
    pub duplicates: usize,
    /// Duplicate publishes that never reached the upstream.
    pub suppressed: usize,
    /// Executions of a killed replica in flight at its kill (not answered
    /// yet), and those it had answered in the `RECORDED_WITHIN` before
    /// (possibly not recorded yet): their keys may run again.
    pub in_flight_at_kill: usize,
    pub answered_before_kill: usize,
    /// Keys re-run after the killed replica's lease ran out, with the
    /// execution numbers (first, again).
    pub taken_over: Vec<(String, u64, u64)>,
    pub dead_letters: usize,
    pub expected_dead_letters: usize,
    /// Dead letters beyond one per message expected to have one.
    pub extra_dead_letters: usize,
    pub left: (u64, u64),
}

/// Checks every consumer invariant over `trace`.
pub fn check_consumer(trace: &ConsumerTrace) -> ConsumerReport {
    let mut c = ConsumerChecker {
        t: trace,
        out: ConsumerReport {
            report: Report {
                fault: trace.fault,
                elapsed: trace.t0.elapsed(),
                requests: trace.published.len(),
                executions: trace.executions.len(),
                ..Report::default()
            },
            left: trace.left,
            dead_letters: trace.dead_letters.len(),
            ..ConsumerReport::default()
        },
    };
    let finals = c.executions();
    c.published(&finals);
    c.ended(&finals);
    c.out
}

struct ConsumerChecker<'a> {
    t: &'a ConsumerTrace,
    out: ConsumerReport,
}

impl<'a> ConsumerChecker<'a> {
    fn ms(&self, at: Instant) -> u128 {
        at.saturating_duration_since(self.t.t0).as_millis()
    }

    fn exec(&self, e: &Execution) -> String {
        format!(
            "execution {} (replica {}, message {:?}, key {:?}, {:?}, arrived {} ms, answered {:?} ms)",
            e.seq,
            e.door,
            e.request_id,
            e.key.as_deref().unwrap_or("-"),
            e.behaviour,
            self.ms(e.arrived),
            e.answered.map(|a| self.ms(a))
        )
    }

    fn violation(&mut self, v: String) {
        self.out.report.violations.push(v);
    }

    /// Whether, and from when, `e` let its key run again.
    fn release_of(&self, e: &Execution) -> Option<Release> {
        if let Some(at) = upstream_release(e, self.t.upstream_timeout) {
            return Some(Release::Free(at));
        }
        // Its replica was SIGKILLed while it was in flight, before its
        // answer could be recorded: the lease-expiry release.
        self.t
            .events
            .iter()
            .find(|ev| {
                ev.kind == EventKind::Killed(e.door)
                    && ev.at + IN_TRANSIT >= e.arrived
                    && e.answered.is_none_or(|a| a + RECORDED_WITHIN >= ev.at)
            })
            .map(|ev| Release::Abandoned(ev.at))
    }

    /// Invariant 2 per key; returns each key's last execution that did
    /// not release it (its recorded answer).
    fn executions(&mut self) -> HashMap<String, &'a Execution> {
        let t: &'a ConsumerTrace = self.t;
        let mut per_key: BTreeMap<&str, Vec<&'a Execution>> = BTreeMap::new();
        for e in &t.executions {
            match e.key.as_deref() {
                Some(k) => per_key.entry(k).or_default().push(e),
                None => {
                    let v = format!("the upstream got a message without a key: {}", self.exec(e));
                    self.violation(v);
                }
            }
        }
        let mut finals = HashMap::new();
        for (key, chain) in &per_key {
            for pair in chain.windows(2) {
                let (prev, next) = (pair[0], pair[1]);
                match self.release_of(prev) {
                    None => {
                        let v = format!(
                            "executed twice without a release: {} then {}",
                            self.exec(prev),
                            self.exec(next)
                        );
                        self.violation(v);
                    }
                    Some(Release::Free(at)) if next.arrived < at => {
                        let v = format!(
                            "executed again before the release: {} then {}",
                            self.exec(prev),
                            self.exec(next)
                        );
                        self.violation(v);
                    }
                    Some(Release::Abandoned(at)) => {
                        if next.arrived < at || next.body != prev.body {
                            let v = format!(
                                "a key the killed replica held was taken over {}: {} then {}",
                                if next.body != prev.body {
                                    "by a different message"
                                } else {
                                    "before the kill"
                                },
                                self.exec(prev),
                                self.exec(next)
                            );
                            self.violation(v);
                        }
                        self.out
                            .taken_over
                            .push((key.to_string(), prev.seq, next.seq));
                    }
                    Some(Release::Free(_)) => {}
                }
            }
            self.out.report.releases += chain
                .iter()
                .filter(|e| self.release_of(e).is_some())
                .count();
            for e in chain {
                if let Some(Release::Abandoned(kill)) = self.release_of(e) {
                    match e.answered {
                        Some(a) if a <= kill => self.out.answered_before_kill += 1,
                        _ => self.out.in_flight_at_kill += 1,
                    }
                }
            }
            let recorded = chain
                .iter()
                .rev()
                .find(|e| upstream_release(e, t.upstream_timeout).is_none());
            if let Some(e) = recorded {
                finals.insert(key.to_string(), *e);
            }
        }
        if self.out.taken_over.len() > t.prefetch {
            let keys: Vec<&str> = self.out.taken_over.iter().map(|x| x.0.as_str()).collect();
            let v = format!(
                "{} keys ran again after the kill, more than the killed replica could hold (prefetch {}): {keys:?}",
                keys.len(),
                t.prefetch
            );
            self.violation(v);
        }
        finals
    }

    /// Invariants 1, 3 and 4 per message published.
    fn published(&mut self, finals: &HashMap<String, &Execution>) {
        let t = self.t;
        let by_request: HashMap<u64, &Published> =
            t.published.iter().map(|p| (p.request, p)).collect();
        // What the upstream got is what was published.
        for e in &t.executions {
            let p = e.request_id.and_then(|r| by_request.get(&r));
            let Some(p) = p else {
                let v = format!(
                    "the upstream got a message the harness never published: {}",
                    self.exec(e)
                );
                self.violation(v);
                continue;
            };
            if p.key != e.key || p.body != e.body {
                let v = format!(
                    "the upstream got message {} with another key or body than published: {}",
                    p.request,
                    self.exec(e)
                );
                self.violation(v);
            }
        }
        let executed: BTreeSet<u64> = t.executions.iter().filter_map(|e| e.request_id).collect();
        let mut dead: HashMap<u64, usize> = HashMap::new();
        for d in &t.dead_letters {
            match d {
                Some(r) if by_request.contains_key(r) => *dead.entry(*r).or_default() += 1,
                other => {
                    let v = format!("a dead letter of no published message: {other:?}");
                    self.violation(v);
                }
            }
        }
        let mut seen: BTreeSet<(&str, &Bytes)> = BTreeSet::new();
        let mut keys: BTreeSet<&str> = BTreeSet::new();
        for p in &t.published {
            let found = dead.get(&p.request).copied().unwrap_or(0);
            let Some(key) = p.key.as_deref() else {
                // `no_key`: dead-lettered, never delivered.
                self.expect_dead(p, found, true, "no key (no_key)");
                if executed.contains(&p.request) {
                    let v = format!("message {} without a key was delivered", p.request);
                    self.violation(v);
                }
                continue;
            };
            keys.insert(key);
            if !seen.insert((key, &p.body)) {
                self.out.duplicates += 1;
                if !executed.contains(&p.request) {
                    self.out.suppressed += 1;
                }
            }
            let Some(last) = finals.get(key) else {
                let v = format!(
                    "lost: message {} (key {key}) never executed to a recorded answer",
                    p.request
                );
                self.violation(v);
                continue;
            };
            let status = last.produced.as_ref().map_or(0, |r| r.status);
            if last.body != p.body {
                self.out.report.mismatches += usize::from(found > 0);
                let why = format!("its key ran another payload ({})", self.exec(last));
                self.expect_dead(p, found, true, &why);
            } else {
                let why = format!("its key's recorded answer is {status}");
                self.expect_dead(p, found, status >= 400, &why);
            }
        }
        self.out.keys = keys.len();
    }

    /// Message `p` has `found` dead letters; it should have one (`want`).
    fn expect_dead(&mut self, p: &Published, found: usize, want: bool, why: &str) {
        let key = p.key.as_deref().unwrap_or("-");
        match (want, found) {
            (true, 0) => {
                let v = format!(
                    "lost: message {} (key {key}) was not dead-lettered although {why}",
                    p.request
                );
                self.violation(v);
            }
            (false, n) if n > 0 => {
                let v = format!(
                    "message {} (key {key}) was dead-lettered {n} time(s) although {why}",
                    p.request
                );
                self.violation(v);
            }
            (true, n) => {
                self.out.expected_dead_letters += 1;
                self.out.extra_dead_letters += n - 1;
            }
            _ => {}
        }
    }

    /// What the broker and the store ended with (invariant 1).
    fn ended(&mut self, finals: &HashMap<String, &Execution>) {
        let (ready, unacked) = self.t.left;
        if (ready, unacked) != (0, 0) {
            let v = format!(
                "the broker ends with {ready} message(s) ready or pending and {unacked} unacked"
            );
            self.violation(v);
        }
        let records = &self.t.records;
        for state in ["in_flight", "unknown"] {
            if let Some(n) = records.get(state).filter(|n| **n > 0) {
                let v = format!("the store ends with {n} record(s) {state}");
                self.violation(v);
            }
        }
        let completed = records.get("completed").copied().unwrap_or(0);
        if completed != finals.len() as i64 {
            let v = format!(
                "the store ends with {completed} completed record(s) for {} keys that ran to a recorded answer ({records:?})",
                finals.len()
            );
            self.violation(v);
        }
    }
}

impl fmt::Display for ConsumerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.report)?;
        writeln!(
            f,
            "  {} messages, {} keys, {} duplicates ({} never executed), {} executions, {} releases; \
             {} execution(s) in flight on the killed replica at the kill \
             ({} more answered in the second before it), \
             {} key(s) of them ran again after its lease ran out{}; \
             {} dead letters ({} expected, {} extra copies); broker left {} ready, {} unacked",
            self.report.requests,
            self.keys,
            self.duplicates,
            self.suppressed,
            self.report.executions,
            self.report.releases,
            self.in_flight_at_kill,
            self.answered_before_kill,
            self.taken_over.len(),
            if self.taken_over.is_empty() {
                String::new()
            } else {
                let ids: Vec<String> = self
                    .taken_over
                    .iter()
                    .map(|(k, a, b)| format!("{k} (executions {a}, {b})"))
                    .collect();
                format!(": {}", ids.join(", "))
            },
            self.dead_letters,
            self.expected_dead_letters,
            self.extra_dead_letters,
            self.left.0,
            self.left.1
        )
    }
}
