//! NATS JetStream (`async-nats`): a durable pull consumer on the stream,
//! bound to when it exists and created (explicit acks, `ack_wait`,
//! `max_ack_pending`) when it does not. An existing one is refused unless
//! it has explicit acks, no `max_deliver` limit and `ack_wait` >= 1 s.
//!
//! - ack: a confirmed double ack (`AckSync`), so the runner knows it landed.
//! - dead-letter: the message, its headers without the `Nats-*` ones and
//!   `Idemgate-Dead-Letter-Reason` published (confirmed) to
//!   `dead_letter_subject` when one is set (a stream other than the
//!   consumed one must capture that subject), then a confirmed `+TERM`.
//!   The copy's `Nats-Msg-Id` is `idemgate-dl-<stream>-<sequence>` (one
//!   delivery dead-lettered twice is stored once); the original's is kept
//!   as `Idemgate-Original-Msg-Id`. A `duplicate` answer for that id is an
//!   error (the copy may not be stored), so the message is not termed.
//! - retry: `-NAK` with the delay; the broker redelivers it then.
//! - progress: `+WPI` every half of `ack_wait` while the upstream runs
//!   under a lease that is still ours (`lease::Holding`: claimed, renewed
//!   within the last lease length, not lost); once it is lost the broker
//!   is let to redeliver, and the refused completion is never acked. Also
//!   while a delivery whose key is in flight elsewhere is held.
//! - attempt: the broker's `num_delivered` for the message (kept by the
//!   broker across redeliveries, replicas and idemgate restarts). A
//!   delivery that finds its key in flight elsewhere is held and claimed
//!   again, not nak'd, so it adds no delivery (`counts_redeliveries`).
//!   Still counted: deliveries cut short by a crash, a lost connection or
//!   a shutdown, and naks of an unsettled delivery (store down, answer not
//!   yet recorded, lease lost).

use super::fate::Reason;
use super::link::Link;
use super::source::{Delivery, Message, Source, SourceError};
use crate::config::consumers::JetStreamSource;
use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tracing::debug;

/// How long a connect may take before the runner backs off and retries.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest `ack_wait` of a durable bound to (as in the config).
const MIN_ACK_WAIT: Duration = Duration::from_secs(1);
pub const REASON_HEADER: &str = "Idemgate-Dead-Letter-Reason";
pub const ORIGINAL_ID_HEADER: &str = "Idemgate-Original-Msg-Id";

pub struct JetStream {
    messages: Option<pull::Stream>,
    context: jetstream::Context,
    ack_wait: Duration,
    dead_letter_subject: Option<String>,
}

/// `link` hears of the client's own reconnects (it resumes pulling by
/// itself; the runner reconnects only when the message stream fails).
/// `tls` is the consumer's rustls configuration (`consumer::tls`): TLS is
/// required with it for a `tls://` URL, and used for a `nats://` one
/// whose server requires TLS.
pub async fn connect(
    config: &JetStreamSource,
    tls: Option<&Arc<rustls::ClientConfig>>,
    link: Arc<Link>,
) -> Result<JetStream, SourceError> {
    let mut options = async_nats::ConnectOptions::new();
    if let Some(tls) = tls {
        options = options
            .tls_client_config(rustls::ClientConfig::clone(tls))
            .require_tls(config.tls.is_some());
    }
    let client = options
        .connection_timeout(CONNECT_TIMEOUT)
        .event_callback(move |event| {
            match event {
                async_nats::Event::Disconnected => link.down(&"disconnected"),
                async_nats::Event::Connected => link.up(),
                _ => {}
            }
            std::future::ready(())
        })
        .connect(config.url.expose())
        .await
        .map_err(|e| SourceError::new("connect", super::tls::describe("NATS", &e)))?;
    let context = jetstream::new(client);
    let stream = context
        .get_stream(&config.stream)
        .await
        .map_err(|e| SourceError::new("get the stream", e))?;
    if let Some(dl) = &config.dead_letter_subject {
        let subjects = &stream.cached_info().config.subjects;
        if let Some(s) = subjects.iter().find(|s| subject_matches(s, dl)) {
            return Err(SourceError::refused(format!(
                "refusing to consume: dead_letter_subject {dl:?} is captured by the consumed stream {:?} (subject {s:?}), so dead letters would come back as new messages; capture it in another stream",
                config.stream
            )));
        }
    }
    let consumer: jetstream::consumer::PullConsumer = stream
        .get_or_create_consumer(
            &config.durable,
            pull::Config {
                durable_name: Some(config.durable.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: config.ack_wait,
                max_ack_pending: config.max_ack_pending,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| SourceError::new("bind the durable consumer", e))?;
    let bound = &consumer.cached_info().config;
    check_durable(bound).map_err(|e| {
        SourceError::refused(format!(
            "refusing to consume: the durable {:?} of stream {:?} {e}; delete it (idemgate creates it right) or fix it",
            config.durable, config.stream
        ))
    })?;
    let ack_wait = bound.ack_wait;
    let messages = consumer
        .messages()
        .await
        .map_err(|e| SourceError::new("pull messages", e))?;
    Ok(JetStream {
        messages: Some(messages),
        context,
        ack_wait,
        dead_letter_subject: config.dead_letter_subject.clone(),
    })
}

#[async_trait::async_trait]
impl Source for JetStream {
    async fn next(&mut self) -> Result<Box<dyn Delivery>, SourceError> {
        let Some(messages) = self.messages.as_mut() else {
            return std::future::pending().await;
        };
        match messages.next().await {
            Some(Ok(m)) => {
                let msg = message(&m)?;
                Ok(Box::new(JsDelivery {
                    m,
                    msg,
                    // Never zero (`interval_at` panics on it), whatever
                    // the durable says.
                    progress_every: (self.ack_wait / 2).max(Duration::from_millis(100)),
                    dead_letter_subject: self.dead_letter_subject.clone(),
                    context: self.context.clone(),
                }))
            }
            Some(Err(e)) => Err(SourceError::new("pull", e)),
            None => Err(SourceError::text("the message stream ended")),
        }
    }

    async fn stop(&mut self) {
        // No more pulls; acks still go out on the connection.
        self.messages = None;
    }
}

fn message(m: &jetstream::Message) -> Result<Message, SourceError> {
    let info = m
        .info()
        .map_err(|e| SourceError::new("message metadata", e))?;
    let mut headers = Vec::new();
    let mut id = None;
    let mut content_type = None;
    if let Some(map) = &m.message.headers {
        for (name, values) in map.iter() {
            let name = name.to_string();
            for v in values {
                let v = v.as_str().to_string();
                if name.eq_ignore_ascii_case("Nats-Msg-Id") {
                    id.get_or_insert(v.clone());
                }
                if name.eq_ignore_ascii_case("Content-Type") {
                    content_type.get_or_insert(v.clone());
                }
                headers.push((name.clone(), v));
            }
        }
    }
    Ok(Message {
        id,
        headers,
        content_type,
        payload: m.message.payload.clone(),
        attempt: u32::try_from(info.delivered).unwrap_or(1).max(1),
        not_before: None,
    })
}

struct JsDelivery {
    m: jetstream::Message,
    msg: Message,
    progress_every: Duration,
    dead_letter_subject: Option<String>,
    context: jetstream::Context,
}

fn err(what: &'static str) -> impl Fn(async_nats::Error) -> SourceError {
    move |e| SourceError::new(what, e)
}

#[async_trait::async_trait]
impl Delivery for JsDelivery {
    fn message(&self) -> &Message {
        &self.msg
    }

    async fn ack(&self) -> Result<(), SourceError> {
        self.m.double_ack().await.map_err(err("ack"))
    }

    async fn dead_letter(&self, reason: Reason) -> Result<(), SourceError> {
        if let Some(subject) = &self.dead_letter_subject {
            let info = self
                .m
                .info()
                .map_err(|e| SourceError::new("message metadata", e))?;
            let headers = dead_letter_headers(
                self.m.message.headers.as_ref(),
                reason,
                info.stream,
                info.stream_sequence,
            );
            let ack = self
                .context
                .publish_with_headers(subject.clone(), headers, self.m.message.payload.clone())
                .await
                .map_err(|e| SourceError::new("publish the dead letter", e))?;
            let ack = ack
                .await
                .map_err(|e| SourceError::new("publish the dead letter", e))?;
            // The copy's Nats-Msg-Id is derived from this message's stream
            // and sequence, so `duplicate` means an earlier delivery of this
            // very message stored its copy and its +TERM was lost (a broker
            // restart, a dropped connection): the copy is there, term it
            // now, or it would come back every ack_wait and, after the
            // dead-letter stream's duplicate window, be stored twice.
            if ack.duplicate {
                debug!(stream = %ack.stream, "dead letter already stored by an earlier delivery; terming");
            }
        }
        self.m
            .double_ack_with(AckKind::Term)
            .await
            .map_err(err("term"))
    }

    async fn retry_later(&self, delay: Duration, _next_attempt: u32) -> Result<(), SourceError> {
        self.m
            .ack_with(AckKind::Nak(Some(delay)))
            .await
            .map_err(err("nak"))
    }

    fn delays_by_itself(&self) -> bool {
        true
    }

    fn counts_redeliveries(&self) -> bool {
        true
    }

    fn progress_every(&self) -> Option<Duration> {
        Some(self.progress_every)
    }

    async fn progress(&self) -> Result<(), SourceError> {
        self.m
            .ack_with(AckKind::Progress)
            .await
            .map_err(err("progress"))
    }
}

/// An existing durable is bound as it is, so it must be one idemgate can
/// keep its promises with:
/// - explicit acks (`all` would ack a held or nak'd earlier message with a
///   later one's ack; `none` loses a message on a crash);
/// - no `max_deliver` limit: the server drops a message silently after so
///   many deliveries, the uncounted ones (naks while the store is down)
///   included, with no dead letter; `max_attempts` is idemgate's limit;
/// - `ack_wait` of at least a second (`+WPI` goes every half of it).
fn check_durable(c: &jetstream::consumer::Config) -> Result<(), String> {
    use jetstream::consumer::AckPolicy;
    if c.ack_policy != AckPolicy::Explicit {
        return Err(format!(
            "has ack_policy {:?}; idemgate needs explicit acks",
            c.ack_policy
        ));
    }
    if c.max_deliver > 0 {
        return Err(format!(
            "has max_deliver {}; idemgate needs it unlimited (-1): the server would drop a message silently after that many deliveries, with no dead letter (max_attempts is idemgate's limit)",
            c.max_deliver
        ));
    }
    if c.ack_wait < MIN_ACK_WAIT {
        return Err(format!(
            "has ack_wait {:?}; idemgate needs at least {MIN_ACK_WAIT:?}",
            c.ack_wait
        ));
    }
    Ok(())
}

/// The dead-letter copy's headers: the original's without `Nats-*` (its
/// `Nats-Msg-Id` would dedupe the copy away, `Nats-Expected-*` would fail
/// every publish, `Nats-Rollup` would purge earlier dead letters), its
/// message id as [`ORIGINAL_ID_HEADER`], a `Nats-Msg-Id` of its own
/// (stream and sequence: the same delivery dead-lettered twice, say after
/// a lost `+TERM`, is stored once) and the reason.
fn dead_letter_headers(
    original: Option<&async_nats::HeaderMap>,
    reason: Reason,
    stream: &str,
    sequence: u64,
) -> async_nats::HeaderMap {
    let mut out = async_nats::HeaderMap::new();
    if let Some(map) = original {
        for (name, values) in map.iter() {
            let n = name.to_string();
            let n = n.as_str();
            let nats = n.len() >= 5 && n[..5].eq_ignore_ascii_case("nats-");
            if nats {
                if n.eq_ignore_ascii_case("Nats-Msg-Id") {
                    if let Some(v) = values.first() {
                        out.insert(ORIGINAL_ID_HEADER, v.as_str());
                    }
                }
                continue;
            }
            if n.eq_ignore_ascii_case(REASON_HEADER) || n.eq_ignore_ascii_case(ORIGINAL_ID_HEADER) {
                continue;
            }
            for v in values {
                out.append(n, v.as_str());
            }
        }
    }
    out.insert(
        "Nats-Msg-Id",
        format!("idemgate-dl-{stream}-{sequence}").as_str(),
    );
    out.insert(REASON_HEADER, reason.as_str());
    out
}

/// Whether the stream subject `pattern` (`*` one token, `>` the rest)
/// captures `subject` (a subject without wildcards).
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_subjects_capture_like_the_server() {
        let table = [
            ("ORDERS.>", "ORDERS.dead", true),
            ("ORDERS.>", "ORDERS", false),
            ("ORDERS.*", "ORDERS.dead", true),
            ("ORDERS.*", "ORDERS.dead.x", false),
            ("ORDERS.in", "ORDERS.dead", false),
            ("*.dead", "ORDERS.dead", true),
            (">", "anything.at.all", true),
            ("ORDERS.dead", "ORDERS.dead", true),
            ("ORDERS.dead.>", "ORDERS.dead", false),
        ];
        for (p, s, want) in table {
            assert_eq!(subject_matches(p, s), want, "{p} {s}");
        }
    }

    #[test]
    fn a_durable_idemgate_cannot_keep_its_promises_with_is_refused() {
        use jetstream::consumer::{AckPolicy, Config};
        let ok = Config {
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: -1,
            ..Default::default()
        };
        let cases: [(Config, Option<&str>); 7] = [
            (ok.clone(), None),
            (
                Config {
                    max_deliver: 0,
                    ..ok.clone()
                },
                None,
            ),
            (
                Config {
                    ack_policy: AckPolicy::All,
                    ..ok.clone()
                },
                Some("ack_policy All"),
            ),
            (
                Config {
                    ack_policy: AckPolicy::None,
                    ..ok.clone()
                },
                Some("ack_policy None"),
            ),
            (
                Config {
                    max_deliver: 1000,
                    ..ok.clone()
                },
                Some("max_deliver 1000"),
            ),
            (
                Config {
                    ack_wait: Duration::from_nanos(1),
                    ..ok.clone()
                },
                Some("ack_wait 1ns"),
            ),
            (
                Config {
                    ack_wait: Duration::from_millis(999),
                    ..ok.clone()
                },
                Some("ack_wait 999ms"),
            ),
        ];
        for (c, want) in cases {
            match (check_durable(&c), want) {
                (Ok(()), None) => {}
                (Err(e), Some(w)) => assert!(e.contains(w), "{e} lacks {w}"),
                (got, want) => panic!("{got:?} for {want:?}"),
            }
        }
    }

    #[test]
    fn the_dead_letter_copy_drops_nats_headers_and_gets_its_own_id() {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", "order-1");
        h.insert("Nats-Expected-Stream", "ORDERS");
        h.insert("Nats-Expected-Last-Sequence", "7");
        h.insert("Nats-Rollup", "sub");
        h.insert("nats-ttl", "1s");
        h.insert("x-order-id", "k1");
        h.insert(REASON_HEADER, "forged");
        let out = dead_letter_headers(Some(&h), Reason::Rejected, "ORDERS", 42);
        let mut names: Vec<String> = out.iter().map(|(n, _)| n.to_string()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                REASON_HEADER,
                ORIGINAL_ID_HEADER,
                "Nats-Msg-Id",
                "x-order-id"
            ]
        );
        assert_eq!(
            out.get("Nats-Msg-Id").unwrap().as_str(),
            "idemgate-dl-ORDERS-42"
        );
        assert_eq!(out.get(ORIGINAL_ID_HEADER).unwrap().as_str(), "order-1");
        assert_eq!(out.get(REASON_HEADER).unwrap().as_str(), "rejected");
        assert_eq!(out.get("x-order-id").unwrap().as_str(), "k1");
        let none = dead_letter_headers(None, Reason::NoKey, "S", 1);
        assert!(none.get(ORIGINAL_ID_HEADER).is_none());
    }
}
