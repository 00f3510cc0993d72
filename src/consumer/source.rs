//! The seam between a broker and the delivery core: a [`Source`] yields
//! [`Delivery`]s, and each delivery is told its fate once. A broker is one
//! module implementing these two traits (`amqp.rs`, `jetstream.rs`; a
//! Kafka source would be a third) and one arm in `run.rs`'s `connect`.

use super::fate::Reason;
use bytes::Bytes;
use std::time::Duration;

/// A broker failure: the connection (or channel) is gone, or an operation
/// on it failed. The runner reconnects.
#[derive(Debug, thiserror::Error)]
#[error("{text}")]
pub struct SourceError {
    text: String,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Failed,
    /// The consumer's settings cannot work with what the broker has
    /// (`run.rs`: fatal at start-up, retried after).
    Refused,
    /// The source gave its connection up (an operation had no answer in
    /// time); the runner logs that once for the whole connection.
    Lost,
}

impl SourceError {
    pub fn new(what: &str, e: impl std::fmt::Display) -> Self {
        Self::text(format!("{what}: {e}"))
    }

    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            kind: Kind::Failed,
        }
    }

    /// A refusal naming the setting to change: retrying cannot help
    /// until the broker's side or the config changes.
    pub fn refused(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            kind: Kind::Refused,
        }
    }

    /// The connection was given up (already logged by the runner).
    pub fn lost(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            kind: Kind::Lost,
        }
    }

    pub fn is_refused(&self) -> bool {
        self.kind == Kind::Refused
    }

    pub fn is_lost(&self) -> bool {
        self.kind == Kind::Lost
    }
}

/// One message as the core sees it, whatever the broker.
#[derive(Clone, Debug, Default)]
pub struct Message {
    /// The broker's message id (AMQP `message_id`, JetStream `Nats-Msg-Id`).
    pub id: Option<String>,
    /// String-valued headers, in the broker's order.
    pub headers: Vec<(String, String)>,
    pub content_type: Option<String>,
    pub payload: Bytes,
    /// This delivery's attempt number (1-based), counted per message
    /// across redeliveries and restarts by the broker: JetStream's
    /// `num_delivered`; AMQP's `x-idemgate-attempts` header (set on the
    /// copy a retry republishes) or a quorum queue's `x-delivery-count`.
    pub attempt: u32,
    /// Not to be delivered before then: a copy republished before its
    /// backoff was over (AMQP `x-idemgate-not-before`; see `run.rs`).
    pub not_before: Option<std::time::SystemTime>,
}

impl Message {
    /// The first header named `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Takes deliveries from one broker connection.
#[async_trait::async_trait]
pub trait Source: Send {
    /// The next delivery; `Err`: the connection is lost (the runner drops
    /// this source and connects again; unacked deliveries return to the
    /// broker).
    async fn next(&mut self) -> Result<Box<dyn Delivery>, SourceError>;

    /// Stops taking new deliveries (shutdown); those already handed out
    /// can still be settled.
    async fn stop(&mut self);

    /// Closes the connection (after shutdown settled what it could): the
    /// broker returns whatever is still unacked.
    async fn close(&mut self) {}
}

/// One delivery of a message: told its fate exactly once.
#[async_trait::async_trait]
pub trait Delivery: Send + Sync {
    fn message(&self) -> &Message;

    /// Done: the broker forgets it (JetStream: a confirmed double ack;
    /// AMQP: `basic.ack` on the channel it came on).
    async fn ack(&self) -> Result<(), SourceError>;

    /// Never retried (AMQP: `basic.reject` without requeue, to the queue's
    /// dead-letter exchange; JetStream: published to the consumer's
    /// `dead_letter_subject` when set, then `term`).
    async fn dead_letter(&self, reason: Reason) -> Result<(), SourceError>;

    /// Redelivered after `delay` as attempt `next_attempt` (a source that
    /// does not delay by itself gets what is left of the backoff after
    /// the core's hold, and carries it with the message).
    async fn retry_later(&self, delay: Duration, next_attempt: u32) -> Result<(), SourceError>;

    /// Whether [`Delivery::retry_later`] waits by itself (JetStream's
    /// delayed `nak`); if not, the core holds the delivery for the delay
    /// first (AMQP has no delayed negative ack).
    fn delays_by_itself(&self) -> bool;

    /// Whether the broker counts every redelivery as an attempt
    /// (JetStream's `num_delivered`): then a delivery whose key is in
    /// flight elsewhere is held and claimed again rather than given back
    /// (`run.rs`), so only attempts that called the upstream (or were cut
    /// short by a crash or lost connection) count. AMQP's retry copy
    /// carries its own count, unchanged by such a retry.
    fn counts_redeliveries(&self) -> bool;

    /// How often the handler must say it is still working, if at all
    /// (JetStream: half of `ack_wait`).
    fn progress_every(&self) -> Option<Duration>;

    /// Still working: keeps the broker from redelivering (JetStream `+WPI`).
    async fn progress(&self) -> Result<(), SourceError>;
}
