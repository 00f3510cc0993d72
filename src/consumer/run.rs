//! One consumer's life: connect (again, with backoff, after an outage,
//! logged once per outage), take deliveries at most `prefetch` /
//! `max_ack_pending` at a time, hand each to the protected path and tell
//! the broker its fate; on shutdown, stop taking new ones and finish those
//! in flight, and close, all by one deadline (`shutdown_grace` after
//! shutdown began).
//!
//! A refusal (the consumer's settings cannot work with the broker's
//! stream or durable) before the consumer ever consumed is reported to
//! `idemgate serve`, which then fails like a config error; after that
//! (the broker's side changed under a running consumer) it is logged and
//! retried with backoff like an outage.
//!
//! A source that cannot delay a retry by itself (AMQP) has its delivery
//! held for the backoff, at most the consumer's `lease`: a longer backoff
//! goes back to the broker with what is left of it, and a delivery whose
//! `not_before` is still ahead is held and sent back again without
//! calling the upstream (not an attempt).

use super::deliver;
use super::fate::{fate, Fate, Happened, RetryPolicy};
use super::link::Link;
use super::source::{Delivery, Source, SourceError};
use super::{amqp, jetstream};
use crate::config::consumers::{ConsumerConfig, SourceConfig};
use crate::lease::Holding;
use crate::metrics::Metrics;
use crate::net::backoff::Backoff;
use crate::proxy::Proxy;
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

/// Reconnecting: from a tenth of a second, doubling to 5 s.
const RECONNECT: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// A connection that stayed up this long was a good one.
const STABLE: Duration = Duration::from_secs(30);

/// Whether the reconnect backoff starts over after a lost connection:
/// only when it stayed up [`STABLE`] or settled a delivery. One that dies
/// at once (a message lapin cannot parse kills the connection, and the
/// broker puts it back first) keeps backing off instead of reconnecting
/// in a tight loop.
fn starts_over(up_for: Duration, settled: bool) -> bool {
    settled || up_for >= STABLE
}

/// What every delivery of one consumer shares.
pub struct Context {
    pub consumer: Arc<ConsumerConfig>,
    /// The running proxy (a reload swaps it): its upstreams and store.
    pub current: Arc<ArcSwap<Proxy>>,
    pub metrics: Arc<Metrics>,
    /// Cancelled when shutdown begins: stop taking messages, stop holding
    /// deliveries for a backoff.
    pub stopping: CancellationToken,
    /// Whether the broker connection is up and consuming (`/healthz`).
    pub up: Arc<AtomicBool>,
    /// TLS to the broker, built at start-up (`consumer::tls`).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Told of a refusal before the consumer first consumed (the start
    /// fails).
    pub refusals: mpsc::UnboundedSender<String>,
}

/// Connects to the consumer's broker.
async fn connect(ctx: &Context, link: &Arc<Link>) -> Result<Box<dyn Source>, SourceError> {
    let tls = ctx.tls.as_ref();
    match &ctx.consumer.source {
        SourceConfig::Amqp(a) => Ok(Box::new(amqp::connect(a, tls).await?)),
        SourceConfig::JetStream(j) => Ok(Box::new(jetstream::connect(j, tls, link.clone()).await?)),
    }
}

/// Runs until `ctx.stopping`, then finishes what is in flight and closes
/// by `grace` after it.
pub async fn run(ctx: Arc<Context>, grace: Duration) {
    let name = ctx.consumer.name.clone();
    let link = Arc::new(Link {
        name: name.clone(),
        source: ctx.consumer.source.url().to_string(),
        metrics: ctx.metrics.clone(),
        up: ctx.up.clone(),
        outage: std::sync::Mutex::new(false),
    });
    let mut retries = RECONNECT.start();
    let handlers = TaskTracker::new();
    let limit = match &ctx.consumer.source {
        SourceConfig::Amqp(a) => usize::from(a.prefetch),
        SourceConfig::JetStream(j) => usize::try_from(j.max_ack_pending).unwrap_or(1),
    };
    let permits = Arc::new(Semaphore::new(limit.max(1)));
    let mut consumed = false;
    // The source still connected when shutdown began.
    let mut open = loop {
        let connected = tokio::select! {
            c = connect(&ctx, &link) => c,
            _ = ctx.stopping.cancelled() => break None,
        };
        let mut source = match connected {
            Ok(source) => source,
            Err(e) => {
                if e.is_refused() && !consumed {
                    let _ = ctx.refusals.send(format!("consumer \"{name}\": {e}"));
                }
                link.down(&e);
                tokio::select! {
                    _ = tokio::time::sleep(retries.wait()) => continue,
                    _ = ctx.stopping.cancelled() => break None,
                }
            }
        };
        info!(consumer = %name, source = %ctx.consumer.source.url(), "consuming");
        consumed = true;
        link.up();
        let up_since = std::time::Instant::now();
        let settled = Arc::new(AtomicBool::new(false));
        let lost = loop {
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => p.expect("never closed"),
                _ = ctx.stopping.cancelled() => break None,
            };
            let delivery = tokio::select! {
                d = source.next() => d,
                _ = ctx.stopping.cancelled() => break None,
            };
            match delivery {
                Ok(delivery) => {
                    let ctx = ctx.clone();
                    let settled = settled.clone();
                    handlers.spawn(async move {
                        if handle(&ctx, delivery).await {
                            settled.store(true, Ordering::Relaxed);
                        }
                        drop(permit);
                    });
                }
                Err(e) => break Some(e),
            }
        };
        let Some(e) = lost else {
            break Some(source);
        };
        link.down(&e);
        drop(source);
        if starts_over(up_since.elapsed(), settled.load(Ordering::Relaxed)) {
            retries.reset();
        }
        tokio::select! {
            _ = tokio::time::sleep(retries.wait()) => {}
            _ = ctx.stopping.cancelled() => break None,
        }
    };
    // Shutdown began just now: one deadline for all of it. No new
    // deliveries; those in flight finish on their connection (their acks
    // need it), then it closes.
    let deadline = tokio::time::Instant::now() + grace;
    if let Some(source) = open.as_mut() {
        let _ = tokio::time::timeout_at(deadline, source.stop()).await;
    }
    handlers.close();
    if tokio::time::timeout_at(deadline, handlers.wait())
        .await
        .is_err()
    {
        warn!(consumer = %name, "grace period over with deliveries in flight; the broker redelivers them");
    }
    if let Some(source) = open.as_mut() {
        let _ = tokio::time::timeout_at(deadline, source.close()).await;
    }
    drop(open);
    ctx.metrics.consumers().broker_up(&name, false);
    ctx.up.store(false, Ordering::Relaxed);
    info!(consumer = %name, "consumer stopped");
}

/// One delivery: its request through the protected path, then its fate.
/// Whether the broker confirmed the fate.
async fn handle(ctx: &Context, delivery: Box<dyn Delivery>) -> bool {
    let name = &ctx.consumer.name;
    let metrics = ctx.metrics.consumers();
    metrics.received(name);
    let gauge = metrics.in_flight(name);
    gauge.inc();
    let msg = delivery.message();
    let attempt = msg.attempt.max(1);
    let early = msg
        .not_before
        .and_then(|t| t.duration_since(SystemTime::now()).ok())
        .filter(|left| !left.is_zero());
    if let Some(left) = early {
        // A copy sent back before its backoff was over: the rest of it,
        // not an attempt, the upstream not called.
        metrics.retried(name);
        let left = hold(ctx, &*delivery, left).await;
        let told = delivery.retry_later(left, attempt).await;
        gauge.dec();
        return told_or_logged(ctx, told, "-");
    }
    let (happened, key_id) = run_once(ctx, &*delivery).await;
    match happened {
        Happened::Executed { .. } => metrics.executed(name),
        Happened::Duplicate { .. } => metrics.duplicate(name),
        _ => {}
    }
    let c = &ctx.consumer;
    let policy = RetryPolicy {
        max_attempts: c.max_attempts,
        initial: c.retry_initial,
        max: c.retry_max,
    };
    let fate = fate(happened, attempt, &policy, rand::random());
    let key_id = key_id.as_deref().unwrap_or("-");
    debug!(consumer = %name, key.id = %key_id, attempt, ?happened, ?fate, "delivered");
    let told = match fate {
        Fate::Ack => delivery.ack().await,
        Fate::DeadLetter(reason) => {
            metrics.dead_lettered(name, reason.as_str());
            warn!(consumer = %name, key.id = %key_id, attempt, reason = reason.as_str(), "message dead-lettered");
            delivery.dead_letter(reason).await
        }
        Fate::Retry { delay, counted } => {
            metrics.retried(name);
            let next = if counted { attempt + 1 } else { attempt };
            let left = hold(ctx, &*delivery, delay).await;
            delivery.retry_later(left, next).await
        }
    };
    gauge.dec();
    told_or_logged(ctx, told, key_id)
}

/// Whether the broker was told the fate; if not, logged and counted (a
/// connection the source gave up is logged once by the runner instead).
fn told_or_logged(ctx: &Context, told: Result<(), SourceError>, key_id: &str) -> bool {
    let Err(e) = told else {
        return true;
    };
    let name = &ctx.consumer.name;
    ctx.metrics.consumers().not_told(name);
    if e.is_lost() {
        debug!(consumer = %name, key.id = %key_id, error = %e, "fate not told: connection given up");
    } else {
        warn!(consumer = %name, key.id = %key_id, error = %e,
            "could not tell the broker the message's fate; it will redeliver it, and the record answers the redelivery");
    }
    false
}

/// For a source that does not delay by itself: holds the delivery
/// (unacked) for `delay`, at most the consumer's `lease`, so a prefetch
/// slot is not kept for a whole `retry_max`; shutdown cuts it short.
/// Returns what is left of `delay` for the retry (all of it for a source
/// that delays by itself).
async fn hold(ctx: &Context, delivery: &dyn Delivery, delay: Duration) -> Duration {
    if delivery.delays_by_itself() {
        return delay;
    }
    let held = delay.min(ctx.consumer.route.lease);
    let started = tokio::time::Instant::now();
    tokio::select! {
        _ = tokio::time::sleep(held) => {}
        _ = ctx.stopping.cancelled() => {}
    }
    delay.saturating_sub(started.elapsed())
}

/// The delivery through the protected path, and the key's log id (`None`:
/// the message has no key), with progress while the claim is ours.
///
/// Where every redelivery counts as an attempt
/// ([`Delivery::counts_redeliveries`], JetStream), a delivery that finds
/// its key in flight elsewhere is not given back (its redelivery would be
/// counted though the upstream was not called, and could exhaust
/// `max_attempts`): it is held, with progress, and claimed again after
/// the key's `Retry-After` (within `retry_initial..retry_max`), until
/// the key is free or answered, or shutdown begins.
async fn run_once(ctx: &Context, delivery: &dyn Delivery) -> (Happened, Option<String>) {
    // The claim progress follows; `None` while held on purpose (busy).
    let claim: std::sync::Mutex<Option<Arc<Holding>>> = Default::default();
    let set = |h: Option<Arc<Holding>>| *claim.lock().unwrap_or_else(|p| p.into_inner()) = h;
    let ours = || {
        let claim = claim.lock().unwrap_or_else(|p| p.into_inner());
        claim.as_ref().is_none_or(|h| h.is_ours())
    };
    let c = &ctx.consumer;
    // One progress schedule for the whole delivery: a hold shorter than
    // its interval must not restart it.
    let work = async {
        loop {
            // Loaded again for each claim: a reload may have swapped it.
            let proxy = ctx.current.load_full();
            let Some(mut req) = deliver::request(c, delivery.message(), proxy.scope_secret())
            else {
                return (Happened::NoKey, None);
            };
            let key_id = req.record_key.log_id();
            let holding = Arc::new(Holding::default());
            req.holding = Some(holding.clone());
            set(Some(holding));
            let happened = deliver::happened(&proxy.deliver(req).await);
            match happened {
                Happened::InFlight { retry_after }
                    if delivery.counts_redeliveries() && !ctx.stopping.is_cancelled() =>
                {
                    let wait = retry_after.clamp(c.retry_initial, c.retry_max);
                    debug!(consumer = %c.name, key.id = %key_id, ?wait,
                        "key in flight elsewhere; holding the delivery to claim it again");
                    set(None);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = ctx.stopping.cancelled() => {}
                    }
                }
                _ => return (happened, Some(key_id)),
            }
        }
    };
    with_progress(delivery, ours, work).await
}

/// Runs `work`, telling the broker the delivery is still being worked on
/// every `progress_every` (JetStream `+WPI`) while `ours()` says so, until
/// it ends. For a delivery, `ours` is its claim's [`Holding`]: once the
/// lease is lost (or unconfirmed for a whole lease) another claimant may
/// hold the key, so the broker is let to redeliver the message; the
/// completion, fenced by the token, is then refused and nothing is acked.
async fn with_progress<F: std::future::Future>(
    delivery: &dyn Delivery,
    ours: impl Fn() -> bool,
    work: F,
) -> F::Output {
    let Some(every) = delivery.progress_every() else {
        return work.await;
    };
    tokio::pin!(work);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = tick.tick() => {
                if !ours() {
                    debug!("the claim is not ours (not yet, lost, or unconfirmed for a lease): no progress sent");
                } else if let Err(e) = delivery.progress().await {
                    debug!(error = %e, "progress not sent");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reconnect_backoff_starts_over_only_after_a_good_connection() {
        let s = Duration::from_secs;
        let table = [
            (Duration::ZERO, false, false),
            (Duration::from_millis(50), false, false),
            (s(29), false, false),
            (s(30), false, true),
            (s(3600), false, true),
            (Duration::ZERO, true, true),
            (s(1), true, true),
        ];
        for (up_for, settled, want) in table {
            assert_eq!(starts_over(up_for, settled), want, "{up_for:?} {settled}");
        }
    }

    /// A connection that dies at once, again and again, backs off to the
    /// cap instead of reconnecting in a tight loop.
    #[test]
    fn a_connection_dying_at_once_backs_off_to_the_cap() {
        let mut retries = RECONNECT.start_with(|| 0.5);
        let mut waits = Vec::new();
        for _ in 0..10 {
            if starts_over(Duration::from_millis(10), false) {
                retries.reset();
            }
            waits.push(retries.wait());
        }
        assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
        assert!(waits[9] >= Duration::from_secs(2), "{waits:?}");
    }
}
