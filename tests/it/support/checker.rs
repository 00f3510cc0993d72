//! The invariant checker: what the recording upstream executed, what every
//! client saw and which faults happened when, judged against idemgate's
//! promise. Pure: it reads a [`Trace`] and returns a [`Report`].
//!
//! Per key (scope and `Idempotency-Key`):
//!
//! 1. **At most one execution, except after a documented release.** An
//!    execution is released when the upstream answered 5xx, 408, 425 or
//!    429, reset before its head, or was slower than `upstream_timeout`
//!    (the proxy gave up before the head); then any request may run under
//!    the key again, once the release happened. It is *abandoned* when its
//!    replica was SIGKILLed before its answer was recorded, or when the
//!    store was cut for longer than a lease before it could be (the lease
//!    ran out unrenewed: the documented limit of such an outage); then only
//!    the same request may take the key over, after the kill or the cut. Anything else
//!    (a reset mid-body, a stored answer, a SIGTERM with its grace) keeps
//!    the key.
//! 2. **Every replay is byte-identical to the original**: the status, body
//!    and stored headers the upstream produced for that execution, and the
//!    response its own client got; of the same scope, key and body; never
//!    of an answer that releases the key; never older than a completed
//!    execution that followed it.
//! 3. **No response crosses scopes or requests**: an answer without the
//!    replay marker is the execution of that very request.
//! 4. **Every request got a response or a documented error** (409, 422,
//!    503, 502/504, 410 as problem+json with their types, each where it can
//!    happen); no hangs; transport errors only from a replica that was
//!    down, and never for a request a gracefully stopping replica had
//!    already forwarded.
//!
//! [`consumer`] judges a message consumer's run by the same model of
//! releases (an answer that releases the key, a holder SIGKILLed before
//! recording) from what was published, executed and left behind.

pub mod consumer;

use super::recording_upstream::{Behaviour, Execution, Produced};
use super::traffic::{Observation, Seen};
use super::Resp;
use http::HeaderMap;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::{Duration, Instant};

/// How long after a SIGKILL the upstream may still read a request the
/// victim sent before it died: the kill is stamped before the signal, the
/// arrival after the upstream has read the body (a replica is restarted
/// far later than this).
const IN_TRANSIT: Duration = Duration::from_millis(250);

/// A fault the harness injected, and when.
#[derive(Clone, Copy, Debug)]
pub struct Event {
    pub at: Instant,
    pub kind: EventKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// SIGKILL to replica `n`.
    Killed(usize),
    /// SIGTERM to replica `n`.
    Terminated(usize),
    /// Replica `n` accepts again.
    Restarted(usize),
    RedisKilled,
    RedisRestarted,
    RedisFrozen,
    RedisResumed,
    PostgresCut,
    PostgresRestored,
    /// The broker a consumer reads was stopped (it excuses nothing: a
    /// consumer's deliveries are answered from the record after it).
    BrokerStopped,
    BrokerStarted,
}

/// Everything one run recorded.
pub struct Trace {
    pub fault: &'static str,
    pub t0: Instant,
    pub executions: Vec<Execution>,
    pub observations: Vec<Observation>,
    pub events: Vec<Event>,
    pub upstream_timeout: Duration,
    /// The routes' lease: a store outage longer than it lets a held key
    /// be taken over (README/deploy: "an outage longer than `lease`").
    pub lease: Duration,
}

/// Counts and violations of one run.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub fault: &'static str,
    pub elapsed: Duration,
    pub requests: usize,
    pub dropped: usize,
    pub executions: usize,
    pub replays: usize,
    pub releases: usize,
    pub conflicts: usize,
    pub mismatches: usize,
    pub unavailable: usize,
    pub upstream_errors: usize,
    pub gone: usize,
    pub transport_errors: usize,
    pub violations: Vec<String>,
}

/// 5xx and the "not executed" statuses: the key must be released.
pub fn releases_key(status: u16) -> bool {
    status >= 500 || matches!(status, 408 | 425 | 429)
}

/// Response headers that differ per hop or per response and are never
/// compared (`x-request-id` is the current request's, replays included).
const PER_RESPONSE: [&str; 5] = [
    "date",
    "content-length",
    "connection",
    "transfer-encoding",
    "x-request-id",
];

/// What idemgate says it did for a protected request: its own header,
/// never the upstream's, so checked on its own.
const STATUS: &str = "idempotency-status";

/// `(name, value)` pairs in `HeaderMap` order, without `skip`.
fn header_list(headers: &HeaderMap, skip: &[&str]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(n, _)| !skip.contains(&n.as_str()) && !PER_RESPONSE.contains(&n.as_str()))
        .map(|(n, v)| {
            (
                n.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// What a replay must carry: the produced headers minus what is never
/// stored (`Set-Cookie`, `Date`, `Content-Length`).
fn stored_headers(p: &Produced) -> Vec<(String, String)> {
    header_list(&p.headers, &["set-cookie"])
}

/// How a release is proven, and from when a new execution may start.
#[derive(Clone, Copy, Debug)]
enum Release {
    /// The record is gone: any request may run under the key.
    Free(Instant),
    /// The holder died: only the same request may take the key over.
    Abandoned(Instant),
}

/// Whether a 502/504 problem says the key could not be released (it stays
/// in flight until its lease runs out). Only makes the checker stricter
/// about who may run next; other wording counts as a plain release.
fn says_locked(detail: &str) -> bool {
    detail.contains("could not be released yet")
}

/// A response, read as the harness's upstream or the proxy wrote it.
enum Answer {
    /// Carries the recording upstream's execution number.
    Upstream {
        seq: u64,
        replayed: bool,
    },
    Problem {
        slug: String,
        detail: String,
    },
    Unknown(String),
}

fn read_answer(r: &Resp) -> Answer {
    let json: Option<serde_json::Value> = serde_json::from_slice(&r.body).ok();
    if r.headers.get("content-type").map(|v| v.as_bytes()) == Some(b"application/problem+json") {
        let json = json.unwrap_or_default();
        let slug = json["type"]
            .as_str()
            .and_then(|t| t.rsplit_once("#problem-"))
            .map(|(_, s)| s.to_string())
            .unwrap_or_default();
        let detail = json["detail"].as_str().unwrap_or_default().to_string();
        return Answer::Problem { slug, detail };
    }
    match json.as_ref().and_then(|j| j["exec"].as_u64()) {
        Some(seq) => Answer::Upstream {
            seq,
            replayed: r.replayed(),
        },
        None => Answer::Unknown(format!(
            "{} {}",
            r.status(),
            String::from_utf8_lossy(&r.body)
                .chars()
                .take(200)
                .collect::<String>()
        )),
    }
}

/// When the upstream's own answer released `e`'s key, if it did: a
/// release status, a reset before the head, or an answer slower than the
/// proxy's `upstream_timeout` (which gave up before the head).
fn upstream_release(e: &Execution, upstream_timeout: Duration) -> Option<Instant> {
    match e.behaviour {
        Behaviour::Answer { status, .. } if releases_key(status) => {
            Some(e.answered.unwrap_or(e.arrived))
        }
        Behaviour::ResetBeforeHead { .. } => Some(e.answered.unwrap_or(e.arrived)),
        Behaviour::Answer { delay, .. } if delay >= upstream_timeout => {
            // The proxy's timer started before the upstream's arrival.
            Some(e.arrived + upstream_timeout - Duration::from_millis(100))
        }
        _ => None,
    }
}

struct Checker<'a> {
    t: &'a Trace,
    by_seq: HashMap<u64, &'a Execution>,
    by_id: HashMap<u64, &'a Observation>,
    /// Execution numbers each observation saw, with when it ended.
    seen_exec: HashMap<u64, Vec<(&'a Observation, bool)>>,
    report: Report,
}

/// Checks every invariant over `trace`.
pub fn check(trace: &Trace) -> Report {
    let mut c = Checker {
        t: trace,
        by_seq: trace.executions.iter().map(|e| (e.seq, e)).collect(),
        by_id: trace.observations.iter().map(|o| (o.id, o)).collect(),
        seen_exec: HashMap::new(),
        report: Report {
            fault: trace.fault,
            elapsed: trace.t0.elapsed(),
            requests: trace.observations.len(),
            executions: trace.executions.len(),
            ..Report::default()
        },
    };
    for o in &trace.observations {
        if let Seen::Response(r) = &o.seen {
            if let Answer::Upstream { seq, replayed } = read_answer(r) {
                c.seen_exec.entry(seq).or_default().push((o, replayed));
            }
        }
    }
    for o in &trace.observations {
        c.observation(o);
    }
    c.executions();
    c.report
}

/// Answers lost to a crash at `crashed` (a measure, not an invariant of
/// its own: a failover to an asynchronous standby): keys whose answer
/// reached its client before `crashed` (the upstream's answer, not a
/// replay, of a status that keeps the key) and whose last response (the
/// sweep's, which repeats the request) is not a replay of that answer: the
/// key ran again, or answers 409 for a retry in flight. One line per key.
pub fn lost_answers(observations: &[Observation], crashed: Instant) -> Vec<String> {
    type Id<'a> = (Option<&'a str>, &'a str);
    let mut last: HashMap<Id, (Instant, String, Option<u64>)> = HashMap::new();
    let mut delivered: BTreeMap<Id, (u64, u64)> = BTreeMap::new();
    for o in observations {
        let Seen::Response(r) = &o.seen else { continue };
        let id = (o.scope, o.key.as_str());
        let answer = read_answer(r);
        let seq = match answer {
            Answer::Upstream { seq, replayed } => {
                if !replayed && !releases_key(r.status()) && o.ended < crashed {
                    delivered.insert(id, (seq, o.id));
                }
                Some(seq)
            }
            _ => None,
        };
        if last.get(&id).is_none_or(|(at, ..)| *at < o.started) {
            let what = match seq {
                Some(seq) => format!("execution {seq}"),
                None => format!("a {}", r.status()),
            };
            last.insert(id, (o.started, what, seq));
        }
    }
    delivered
        .into_iter()
        .filter_map(|(id, (seq, request))| {
            let (_, what, now) = &last[&id];
            (*now != Some(seq)).then(|| {
                format!(
                    "scope {:?}, key {}: request {request} got execution {seq} before the crash; the key's last answer is {what}",
                    id.0.unwrap_or("-"),
                    id.1
                )
            })
        })
        .collect()
}

impl Checker<'_> {
    fn ms(&self, at: Instant) -> u128 {
        at.saturating_duration_since(self.t.t0).as_millis()
    }

    fn who(&self, o: &Observation) -> String {
        format!(
            "request {} ({:?}, scope {:?}, key {}, replica {}, {}..{} ms)",
            o.id,
            o.phase,
            o.scope.unwrap_or("-"),
            o.key,
            o.replica,
            self.ms(o.started),
            self.ms(o.ended)
        )
    }

    fn exec(&self, e: &Execution) -> String {
        format!(
            "execution {} (request {:?}, scope {:?}, key {:?}, {:?}, arrived {} ms, answered {:?} ms)",
            e.seq,
            e.request_id,
            e.scope.as_deref().unwrap_or("-"),
            e.key.as_deref().unwrap_or("-"),
            e.behaviour,
            self.ms(e.arrived),
            e.answered.map(|a| self.ms(a))
        )
    }

    fn violation(&mut self, v: String) {
        self.report.violations.push(v);
    }

    fn same_key(o: &Observation, e: &Execution) -> bool {
        e.scope.as_deref() == o.scope && e.key.as_deref() == Some(o.key.as_str())
    }

    // ===== what each request saw =====

    fn observation(&mut self, o: &Observation) {
        match &o.seen {
            Seen::Dropped => self.report.dropped += 1,
            Seen::Hung => {
                let v = format!("{} got no answer within the client's bound", self.who(o));
                self.violation(v);
            }
            Seen::Transport(err) => {
                self.report.transport_errors += 1;
                self.transport(o, err);
            }
            Seen::Response(r) => match read_answer(r) {
                Answer::Upstream {
                    seq,
                    replayed: false,
                } => self.original(o, r, seq),
                Answer::Upstream {
                    seq,
                    replayed: true,
                } => {
                    self.report.replays += 1;
                    self.replay(o, r, seq);
                }
                Answer::Problem { slug, detail } => self.problem(o, r, &slug, &detail),
                Answer::Unknown(what) => {
                    let v = format!("{} got an undocumented response: {what}", self.who(o));
                    self.violation(v);
                }
            },
        }
    }

    /// A 409 ("in flight") for a key that was already completed: some
    /// request of the same scope and key had ended with a replay (which
    /// only a completed record gives) before this one started, and no
    /// execution of the key arrived in between (the record expired and the
    /// key ran anew). A stale lock copy in Redis must never answer so.
    fn conflict_after_completion(&mut self, o: &Observation) {
        let replayed_before = self.t.observations.iter().find(|p| {
            p.scope == o.scope
                && p.key == o.key
                && p.ended < o.started
                && matches!(&p.seen, Seen::Response(r) if matches!(
                    read_answer(r),
                    Answer::Upstream { replayed: true, .. }
                ))
        });
        let Some(p) = replayed_before else { return };
        let ran_again = self
            .t
            .executions
            .iter()
            .any(|e| Self::same_key(o, e) && e.arrived > p.ended && e.arrived < o.ended);
        if !ran_again {
            let v = format!(
                "{} got a 409 although {} had replayed the completed key before",
                self.who(o),
                self.who(p)
            );
            self.violation(v);
        }
    }

    fn transport(&mut self, o: &Observation, err: &str) {
        let down = self.down_intervals(o.replica);
        let overlapping = down
            .iter()
            .find(|(from, until, _)| *from <= o.ended && until.is_none_or(|u| u >= o.started));
        match overlapping {
            None => {
                let v = format!("{} failed with no fault to explain it: {err}", self.who(o));
                self.violation(v);
            }
            Some((from, _, graceful)) if *graceful => {
                // A gracefully stopping replica finishes what it forwarded.
                let forwarded = self
                    .t
                    .executions
                    .iter()
                    .find(|e| e.request_id == Some(o.id) && e.arrived < *from);
                if let Some(e) = forwarded {
                    let v = format!(
                        "{} lost its answer in a graceful shutdown although the upstream had it: {}; {err}",
                        self.who(o),
                        self.exec(e)
                    );
                    self.violation(v);
                }
            }
            Some(_) => {}
        }
    }

    /// When replica `n` was down: (from, until, by SIGTERM).
    fn down_intervals(&self, n: usize) -> Vec<(Instant, Option<Instant>, bool)> {
        let mut out: Vec<(Instant, Option<Instant>, bool)> = Vec::new();
        for ev in &self.t.events {
            match ev.kind {
                EventKind::Killed(i) if i == n => out.push((ev.at, None, false)),
                EventKind::Terminated(i) if i == n => out.push((ev.at, None, true)),
                EventKind::Restarted(i) if i == n => {
                    if let Some(last) = out.last_mut() {
                        last.1 = Some(ev.at);
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// Records "`o` `what`: `e`".
    fn flag(&mut self, o: &Observation, what: &str, e: &Execution) {
        let v = format!("{} {what}: {}", self.who(o), self.exec(e));
        self.violation(v);
    }

    fn original(&mut self, o: &Observation, r: &Resp, seq: u64) {
        let Some(e) = self.by_seq.get(&seq).copied() else {
            let v = format!("{} got execution {seq}, which never ran", self.who(o));
            return self.violation(v);
        };
        let altered = e.produced.as_ref().is_none_or(|p| {
            r.status() != p.status
                || r.body != p.body
                || header_list(&r.headers, &[STATUS]) != header_list(&p.headers, &[])
        });
        // What idemgate says it did: executed (stored, or too large to
        // store), or released for an answer that means "not executed".
        let said = r.header(STATUS);
        let honest = match &e.produced {
            Some(p) if releases_key(p.status) => said == Some("released"),
            _ => matches!(said, Some("created" | "unstored")),
        };
        if e.request_id != Some(o.id) {
            self.flag(
                o,
                "got another request's execution without the replay marker",
                e,
            );
        } else if altered {
            self.flag(o, "got something else than its execution produced", e);
        } else if !honest {
            let what = format!("got its execution with Idempotency-Status {said:?}");
            self.flag(o, &what, e);
        }
    }

    fn replay(&mut self, o: &Observation, r: &Resp, seq: u64) {
        let Some(e) = self.by_seq.get(&seq).copied() else {
            let v = format!(
                "{} got a replay of execution {seq}, which never ran",
                self.who(o)
            );
            return self.violation(v);
        };
        let Some(p) = &e.produced else {
            return self.flag(o, "got a replay of an answer never produced", e);
        };
        let late = matches!(e.behaviour, Behaviour::Answer { delay, .. } if delay >= self.t.upstream_timeout);
        let replayed = header_list(&r.headers, &["idempotent-replayed", STATUS]);
        let checks = [
            (
                e.scope.as_deref() != o.scope,
                "got a replay from another scope",
            ),
            (
                e.key.as_deref() != Some(o.key.as_str()),
                "got a replay of another key",
            ),
            (
                e.body != o.body,
                "got a replay of a different request under its key",
            ),
            (
                e.behaviour == Behaviour::ResetMidBody,
                "got a replay of a body the upstream cut off",
            ),
            (
                releases_key(p.status),
                "got a replay of an answer that releases the key (never stored)",
            ),
            (
                late,
                "got a replay of an answer that came after the upstream timeout",
            ),
            (
                r.status() != p.status || r.body != p.body || replayed != stored_headers(p),
                "got a replay that differs from the original",
            ),
            (
                r.header(STATUS) != Some("replayed"),
                "got a replay without Idempotency-Status: replayed",
            ),
        ];
        if let Some((_, what)) = checks.iter().find(|(broken, _)| *broken) {
            return self.flag(o, what, e);
        }
        // And what the original client got, minus what is never stored.
        let original = e
            .request_id
            .and_then(|id| self.by_id.get(&id).copied())
            .and_then(|first| match &first.seen {
                Seen::Response(f) if !f.replayed() => Some(f),
                _ => None,
            });
        if let Some(f) = original {
            if f.status != r.status
                || f.body != r.body
                || header_list(&f.headers, &["set-cookie", STATUS]) != replayed
            {
                return self.flag(
                    o,
                    "got a replay that differs from what the original client got",
                    e,
                );
            }
        }
        // Stale: the key ran again after this answer (a release or a
        // delete) and that execution completed before this replay.
        let newer = self.t.executions.iter().find(|n| {
            n.seq > e.seq
                && Self::same_key(o, n)
                && e.answered.is_some_and(|a| n.arrived >= a)
                && n.answered.is_some_and(|a| a < o.started)
                && matches!(n.behaviour, Behaviour::Answer { status, delay }
                    if !releases_key(status) && delay < self.t.upstream_timeout)
        });
        if let Some(n) = newer {
            let v = format!(
                "{} got a stale replay of {} although {} had completed before",
                self.who(o),
                self.exec(e),
                self.exec(n)
            );
            self.violation(v);
        }
    }

    fn problem(&mut self, o: &Observation, r: &Resp, slug: &str, detail: &str) {
        let status = r.status();
        let documented = matches!(
            (status, slug),
            (409, "in-flight")
                | (422, "key-reused")
                | (503, "store-unavailable")
                | (502, "upstream-failed")
                | (504, "upstream-timeout")
                | (410, "response-not-stored")
        );
        if !documented {
            let v = format!(
                "{} got an undocumented problem {status} {slug:?}: {detail}",
                self.who(o)
            );
            return self.violation(v);
        }
        match status {
            409 => {
                self.report.conflicts += 1;
                if r.header("retry-after").is_none() {
                    let v = format!("{} got a 409 without Retry-After", self.who(o));
                    self.violation(v);
                }
                self.conflict_after_completion(o);
            }
            422 => {
                self.report.mismatches += 1;
                let other = self.t.observations.iter().any(|x| {
                    x.scope == o.scope && x.key == o.key && x.body != o.body && x.started < o.ended
                });
                if !other {
                    let v = format!(
                        "{} got a 422 but no other request used its key",
                        self.who(o)
                    );
                    self.violation(v);
                }
            }
            503 => self.report.unavailable += 1,
            410 => {
                self.report.gone += 1;
                let cut = self
                    .t
                    .executions
                    .iter()
                    .any(|e| Self::same_key(o, e) && e.behaviour == Behaviour::ResetMidBody);
                if !cut {
                    let v = format!(
                        "{} got a 410 although no execution of its key was cut off",
                        self.who(o)
                    );
                    self.violation(v);
                }
            }
            _ => self.report.upstream_errors += 1,
        }
    }

    // ===== executions per key =====

    fn executions(&mut self) {
        let mut per_key: BTreeMap<(Option<String>, Option<String>), Vec<&Execution>> =
            BTreeMap::new();
        for e in &self.t.executions {
            per_key
                .entry((e.scope.clone(), e.key.clone()))
                .or_default()
                .push(e);
        }
        for chain in per_key.values() {
            for pair in chain.windows(2) {
                let (prev, next) = (pair[0], pair[1]);
                match self.release_of(prev) {
                    None => {
                        let v = format!(
                            "executed twice without a release: {} then {} (first answer seen by clients: {})",
                            self.exec(prev),
                            self.exec(next),
                            self.seen_by(prev)
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
                    Some(Release::Abandoned(at)) if next.arrived < at || next.body != prev.body => {
                        let v = format!(
                            "an abandoned key was taken over {}: {} then {}",
                            if next.body != prev.body {
                                "by a different request"
                            } else {
                                "before its holder died"
                            },
                            self.exec(prev),
                            self.exec(next)
                        );
                        self.violation(v);
                    }
                    Some(_) => {}
                }
            }
            self.report.releases += chain
                .iter()
                .filter(|e| self.release_of(e).is_some())
                .count();
        }
        for e in &self.t.executions {
            if e.key.is_none() || e.request_id.is_none() {
                let v = format!(
                    "the upstream got a request without key or request id: {}",
                    self.exec(e)
                );
                self.violation(v);
            }
        }
    }

    /// Who saw execution `e`'s answer, for violation messages.
    fn seen_by(&self, e: &Execution) -> String {
        let own = e
            .request_id
            .and_then(|id| self.by_id.get(&id))
            .map(|o| match &o.seen {
                Seen::Response(r) => format!("its request got {}", r.status()),
                other => format!("its request saw {other:?}"),
            })
            .unwrap_or_else(|| "its request is unknown".into());
        let replays = self
            .seen_exec
            .get(&e.seq)
            .map_or(0, |v| v.iter().filter(|(_, replayed)| *replayed).count());
        format!("{own}, {replays} replays")
    }

    /// The earliest a takeover of `e`'s key could happen, when a store cut
    /// longer than the lease began while `e` ran or before its answer could
    /// be recorded (answered at most 500 ms before the cut).
    fn outage_outlived_by(&self, e: &Execution) -> Option<Instant> {
        let events = &self.t.events;
        events.iter().enumerate().find_map(|(i, cut)| {
            if cut.kind != EventKind::PostgresCut {
                return None;
            }
            let restored = events[i..]
                .iter()
                .find(|ev| ev.kind == EventKind::PostgresRestored)
                .map_or(cut.at + Duration::from_secs(3600), |ev| ev.at);
            let outlived = restored.saturating_duration_since(cut.at) > self.t.lease;
            let pending = e.arrived < restored
                && e.answered
                    .is_none_or(|a| a + Duration::from_millis(500) >= cut.at);
            (outlived && pending).then_some(cut.at)
        })
    }

    /// Whether, and from when, `e` let the key run again.
    fn release_of(&self, e: &Execution) -> Option<Release> {
        let own = e.request_id.and_then(|id| self.by_id.get(&id).copied());
        if let Some(at) = upstream_release(e, self.t.upstream_timeout) {
            // A release the proxy could not write leaves the key in flight
            // until its lease runs out: only the same request may run then.
            let locked = own.is_some_and(|o| match &o.seen {
                Seen::Response(r) => matches!(read_answer(r),
                    Answer::Problem { detail, .. } if says_locked(&detail)),
                _ => false,
            });
            return Some(if locked {
                Release::Abandoned(at)
            } else {
                Release::Free(at)
            });
        }
        // The store was cut for longer than a lease while this execution's
        // answer waited to be recorded: its lease ran out unrenewed, so the
        // same request may take the key over once the lease could have run
        // out (the documented limit of an outage longer than `lease`).
        if let Some(at) = self.outage_outlived_by(e) {
            return Some(Release::Abandoned(at));
        }
        // The holder was SIGKILLed before its answer was recorded: before
        // its own client had an answer, and (for a client that had hung up)
        // before the upstream's answer plus a generous write time.
        let o = own?;
        let killed = self.t.events.iter().find(|ev| {
            ev.kind == EventKind::Killed(o.replica)
                && ev.at + IN_TRANSIT >= e.arrived
                && match o.seen {
                    Seen::Transport(_) => ev.at <= o.ended,
                    Seen::Dropped => e
                        .answered
                        .is_none_or(|a| ev.at < a + Duration::from_secs(1)),
                    _ => false,
                }
        })?;
        let answered_before = self
            .seen_exec
            .get(&e.seq)
            .is_some_and(|v| v.iter().any(|(x, _)| x.ended < killed.at));
        (!answered_before).then_some(Release::Abandoned(killed.at))
    }
}

// ===== the report =====

impl Report {
    /// One line of the invariant report.
    pub fn line(&self) -> String {
        format!(
            "{:<26} {:>8} {:>7} {:>6} {:>7} {:>8} {:>5} {:>5} {:>5} {:>5} {:>5} {:>5} {:>10} {:>6.1}s",
            self.fault,
            self.requests,
            self.dropped,
            self.executions,
            self.replays,
            self.releases,
            self.conflicts,
            self.mismatches,
            self.unavailable,
            self.upstream_errors,
            self.gone,
            self.transport_errors,
            self.violations.len(),
            self.elapsed.as_secs_f64()
        )
    }

    pub fn header() -> String {
        format!(
            "{:<26} {:>8} {:>7} {:>6} {:>7} {:>8} {:>5} {:>5} {:>5} {:>5} {:>5} {:>5} {:>10} {:>7}",
            "fault",
            "requests",
            "dropped",
            "execs",
            "replays",
            "releases",
            "409",
            "422",
            "503",
            "502/4",
            "410",
            "conn",
            "violations",
            "time"
        )
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "invariant report")?;
        writeln!(f, "{}", Report::header())?;
        writeln!(f, "{}", self.line())?;
        for v in self.violations.iter().take(40) {
            writeln!(f, "  violation: {v}")?;
        }
        if self.violations.len() > 40 {
            writeln!(f, "  … and {} more", self.violations.len() - 40)?;
        }
        Ok(())
    }
}
