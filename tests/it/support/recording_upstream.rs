//! The recording upstream of the invariant harness: every request it
//! receives is an *execution*, recorded with the client's scope, key,
//! request id and body, the behaviour it chose and the exact response it
//! produced.
//!
//! Its answers embed the execution number, scope, key and request body, so
//! a response that reaches the wrong client, or answers the wrong request,
//! is recognizable wherever it turns up. What it does with each request is
//! drawn from a weighted [`Mix`]: quick or slow answers (some slower than
//! the proxy's `upstream_timeout`), 5xx, "not executed" statuses
//! (408/425/429), resets before the head and resets mid-body.

use super::seed::Seed;
use super::serve::{server, TestServer};
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use idemgate::body::{boxed, full, BoxError, ProxyBody};
use rand::rngs::StdRng;
use rand::Rng;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The request header carrying the harness's request id (forwarded by the
/// proxy like any end-to-end header, and not part of the fingerprint).
pub const REQUEST_ID: &str = "x-test-request";

/// What the upstream does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// Answers `status` (head and whole body) after `delay`.
    Answer { status: u16, delay: Duration },
    /// Closes the connection without answering, after `delay`.
    ResetBeforeHead { delay: Duration },
    /// Sends a 201 head and part of the body, then resets.
    ResetMidBody,
}

/// A kind of behaviour, drawn with a weight from a [`Mix`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// 201 (sometimes 200, 402 or 404: stored and replayed) within 150 ms.
    Quick,
    /// A stored status after 30-60% of the proxy's upstream timeout.
    SlowWithinTimeout,
    /// Answers after 160-200% of the upstream timeout: the proxy gave up
    /// before the head, so it released the key.
    SlowBeyondTimeout,
    /// 500, 502 or 503.
    ServerError,
    /// 408, 425 or 429 with `Retry-After: 1`: "not executed" answers.
    NotExecuted,
    ResetBeforeHead,
    ResetMidBody,
}

/// Weighted kinds of behaviour.
#[derive(Clone, Debug)]
pub struct Mix {
    weights: Vec<(Kind, u32)>,
}

impl Mix {
    /// Mostly quick answers, some slow ones within the timeout, a few 5xx.
    pub fn base() -> Self {
        Self {
            weights: vec![
                (Kind::Quick, 85),
                (Kind::SlowWithinTimeout, 8),
                (Kind::ServerError, 7),
            ],
        }
    }

    /// Adds (or replaces) `kind` with `weight`.
    pub fn with(mut self, kind: Kind, weight: u32) -> Self {
        self.weights.retain(|(k, _)| *k != kind);
        self.weights.push((kind, weight));
        self
    }

    fn draw(&self, timeout: Duration, rng: &mut StdRng) -> Behaviour {
        let total: u32 = self.weights.iter().map(|(_, w)| w).sum();
        let mut pick = rng.random_range(0..total.max(1));
        let kind = self
            .weights
            .iter()
            .find(|(_, w)| {
                let hit = pick < *w;
                pick = pick.saturating_sub(*w);
                hit
            })
            .map_or(Kind::Quick, |(k, _)| *k);
        let share = |rng: &mut StdRng, lo: f64, hi: f64| timeout.mul_f64(rng.random_range(lo..hi));
        let ms =
            |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.random_range(lo..hi));
        let stored_status = |rng: &mut StdRng| match rng.random_range(0..20) {
            0 => 200,
            1 => 402,
            2 => 404,
            _ => 201,
        };
        match kind {
            Kind::Quick => Behaviour::Answer {
                status: stored_status(rng),
                delay: ms(rng, 0, 150),
            },
            Kind::SlowWithinTimeout => Behaviour::Answer {
                status: stored_status(rng),
                delay: share(rng, 0.3, 0.6),
            },
            Kind::SlowBeyondTimeout => Behaviour::Answer {
                status: 201,
                delay: share(rng, 1.6, 2.0),
            },
            Kind::ServerError => Behaviour::Answer {
                status: [500, 502, 503][rng.random_range(0..3)],
                delay: ms(rng, 0, 100),
            },
            Kind::NotExecuted => Behaviour::Answer {
                status: [408, 425, 429][rng.random_range(0..3)],
                delay: ms(rng, 0, 50),
            },
            Kind::ResetBeforeHead => Behaviour::ResetBeforeHead {
                delay: ms(rng, 0, 100),
            },
            Kind::ResetMidBody => Behaviour::ResetMidBody,
        }
    }
}

/// A response as the upstream produced it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Produced {
    pub status: u16,
    pub headers: HeaderMap,
    /// The whole body (for [`Behaviour::ResetMidBody`]: what was sent).
    pub body: Bytes,
}

/// One request the upstream received.
#[derive(Clone, Debug)]
pub struct Execution {
    /// 1-based, in order of arrival.
    pub seq: u64,
    /// Which of the upstream's addresses it came to (0 unless started
    /// with [`RecordingUpstream::start_doors`]): who sent it.
    pub door: usize,
    pub arrived: Instant,
    /// The `Authorization` value (the proxy's default scope header).
    pub scope: Option<String>,
    pub key: Option<String>,
    pub request_id: Option<u64>,
    pub body: Bytes,
    pub behaviour: Behaviour,
    /// Set when the head went out (or the connection was reset); `None`
    /// when the proxy hung up first.
    pub answered: Option<Instant>,
    pub produced: Option<Produced>,
}

#[derive(Default)]
struct Log {
    executions: Mutex<Vec<Execution>>,
    active: AtomicUsize,
}

/// The recording upstream on 127.0.0.1:0.
pub struct RecordingUpstream {
    pub addr: SocketAddr,
    /// Every address it answers on ([`RecordingUpstream::start_doors`]);
    /// `addr` is the first.
    pub doors: Vec<SocketAddr>,
    log: Arc<Log>,
    _servers: Vec<TestServer>,
}

impl RecordingUpstream {
    /// Starts answering per `mix`; `timeout` is the proxy's
    /// `upstream_timeout`, which the slow kinds are measured against. The
    /// n-th execution of a scope's key draws from `seed` and (scope, key, n).
    pub async fn start(mix: Mix, timeout: Duration, seed: Seed) -> Self {
        Self::start_doors(mix, timeout, seed, 1).await
    }

    /// [`RecordingUpstream::start`] on `doors` addresses sharing one log,
    /// each execution recording the door it came to: one door per sender
    /// (a replica's deliveries, which carry no client of the harness's)
    /// tells whose an execution was.
    pub async fn start_doors(mix: Mix, timeout: Duration, seed: Seed, doors: usize) -> Self {
        let log = Arc::new(Log::default());
        let mix = Arc::new(mix);
        let mut servers = Vec::new();
        for door in 0..doors.max(1) {
            let (l, mix) = (log.clone(), mix.clone());
            let server = server()
                .serve(move |req, _| {
                    let (log, mix) = (l.clone(), mix.clone());
                    async move { handle(&log, &mix, timeout, seed, door, req).await }
                })
                .await;
            servers.push(server);
        }
        Self {
            addr: servers[0].addr,
            doors: servers.iter().map(|s| s.addr).collect(),
            log,
            _servers: servers,
        }
    }

    /// Everything received so far, in order of arrival.
    pub fn executions(&self) -> Vec<Execution> {
        self.log.executions.lock().unwrap().clone()
    }

    /// Requests still being handled.
    pub fn active(&self) -> usize {
        self.log.active.load(Ordering::SeqCst)
    }

    /// Waits until no request has been in progress for `quiet`, at most
    /// `bound`; returns whether it got there.
    pub async fn settle(&self, quiet: Duration, bound: Duration) -> bool {
        let deadline = Instant::now() + bound;
        let mut idle_since: Option<Instant> = None;
        while Instant::now() < deadline {
            let n = self.executions().len();
            if self.active() == 0 {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= quiet && self.executions().len() == n {
                    return true;
                }
            } else {
                idle_since = None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }
}

/// Counts a request in progress until dropped (also when hyper drops the
/// handler because the proxy hung up).
struct Active<'a>(&'a AtomicUsize);

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn header_str(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

async fn handle(
    log: &Log,
    mix: &Mix,
    timeout: Duration,
    seed: Seed,
    door: usize,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, std::io::Error> {
    log.active.fetch_add(1, Ordering::SeqCst);
    let _active = Active(&log.active);
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    let scope = header_str(&parts.headers, "authorization");
    let key = header_str(&parts.headers, "idempotency-key");
    let request_id = header_str(&parts.headers, REQUEST_ID).and_then(|v| v.parse().ok());
    // Recorded on arrival, before any delay: an execution the proxy gives
    // up on still counts.
    let (seq, behaviour, mut rng) = {
        let mut all = log.executions.lock().unwrap();
        let seq = all.len() as u64 + 1;
        let nth = all
            .iter()
            .filter(|e| e.scope == scope && e.key == key)
            .count();
        let mut rng = seed.rng(format_args!("execution {nth} of {scope:?} {key:?}"));
        let behaviour = mix.draw(timeout, &mut rng);
        all.push(Execution {
            seq,
            door,
            arrived: Instant::now(),
            scope: scope.clone(),
            key: key.clone(),
            request_id,
            body: body.clone(),
            behaviour,
            answered: None,
            produced: None,
        });
        (seq, behaviour, rng)
    };
    let answered = |produced: Option<Produced>| {
        let mut all = log.executions.lock().unwrap();
        let e = &mut all[seq as usize - 1];
        e.answered = Some(Instant::now());
        e.produced = produced;
    };

    let (status, delay) = match behaviour {
        Behaviour::Answer { status, delay } => (status, delay),
        Behaviour::ResetBeforeHead { delay } => {
            tokio::time::sleep(delay).await;
            answered(None);
            return Err(std::io::Error::other("reset before the head (on purpose)"));
        }
        Behaviour::ResetMidBody => (201, Duration::ZERO),
    };
    tokio::time::sleep(delay).await;

    let json = serde_json::json!({
        "exec": seq,
        "status": status,
        "scope": scope,
        "key": key,
        "request": request_id,
        "received": String::from_utf8_lossy(&body),
        "pad": "x".repeat(rng.random_range(0..512)),
    });
    let text = Bytes::from(json.to_string());
    let mut headers = HeaderMap::new();
    let mut add = |name: &'static str, value: String| {
        headers.append(
            HeaderName::from_static(name),
            HeaderValue::from_str(&value).expect("header value"),
        );
    };
    add("content-type", "application/json".into());
    add("location", format!("/orders/{seq}"));
    add("x-exec", seq.to_string());
    add("x-multi", "a".into());
    add("set-cookie", format!("session={seq}"));
    add("x-multi", "b".into());
    if matches!(status, 408 | 425 | 429) {
        add("retry-after", "1".into());
    }

    let mut resp = Response::builder()
        .status(StatusCode::from_u16(status).expect("status"))
        .body(full(Bytes::new()))
        .expect("response");
    *resp.headers_mut() = headers.clone();

    if behaviour == Behaviour::ResetMidBody {
        let sent = text.slice(..text.len() / 2);
        answered(Some(Produced {
            status,
            headers,
            body: sent.clone(),
        }));
        // The head and a first chunk go out; the reset comes a moment
        // later, so the proxy has really seen the answer's head.
        let chunks = futures_util::stream::unfold(0u8, move |step| {
            let sent = sent.clone();
            async move {
                let item: Result<Frame<Bytes>, BoxError> = match step {
                    0 => Ok(Frame::data(sent)),
                    1 => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        Err("reset mid-body (on purpose)".into())
                    }
                    _ => return None,
                };
                Some((item, step + 1))
            }
        });
        let (mut parts, _) = resp.into_parts();
        parts
            .headers
            .insert("content-length", HeaderValue::from(text.len() * 4));
        return Ok(Response::from_parts(parts, boxed(StreamBody::new(chunks))));
    }
    answered(Some(Produced {
        status,
        headers,
        body: text.clone(),
    }));
    *resp.body_mut() = full(text);
    Ok(resp)
}
