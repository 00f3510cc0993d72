//! RabbitMQ (AMQP 0-9-1, `lapin`): one connection per consumer, one
//! channel consuming the queue with `basic.qos` = `prefetch`, and a second
//! channel in confirm mode for the copies a retry republishes.
//!
//! - ack: `basic.ack` through the delivery's own acker, so always on the
//!   channel the delivery came from (a delivery tag means nothing on
//!   another channel).
//! - dead-letter: `basic.reject` without requeue: the queue's own
//!   `x-dead-letter-exchange` receives it (none set: RabbitMQ drops it).
//! - retry: AMQP has no delayed negative ack, so the core holds the
//!   delivery for the backoff; then a copy with `x-idemgate-attempts` set
//!   to the next attempt is published to the queue (default exchange,
//!   confirmed) and the original acked. The copy keeps the original's
//!   properties and headers except `user_id` and `x-delivery-count`.
//!   A crash between the two leaves
//!   both: the same key, so one runs. The copy is `mandatory`: should it
//!   be returned (no such queue), nacked or fail, the original is
//!   requeued (`basic.nack`) instead, never acked.
//! - hold: a delivery is held at most the consumer's `lease`; a longer
//!   backoff republishes the copy at the end of the hold with
//!   `x-idemgate-not-before` (unix milliseconds), and a copy delivered
//!   before then is held (and republished) again without calling the
//!   upstream, so no prefetch slot waits out a whole `retry_max`.
//! - bounded: every broker operation (connect, publish until confirmed,
//!   ack/reject/nack, cancel, close) has [`OPERATION_TIMEOUT`]. RabbitMQ
//!   stops reading from a connection that publishes during a memory or
//!   disk alarm (`connection.blocked`), and lapin then writes nothing,
//!   acks included. An operation that times out gives the connection up:
//!   its TCP socket is shut down (a Close would not get through), the
//!   broker returns its unacked deliveries, the runner reconnects.
//! - attempt: `x-idemgate-attempts` (1 on a first delivery) plus a quorum
//!   queue's `x-delivery-count` (redeliveries after a lost channel).

use super::fate::Reason;
use super::source::{Delivery, Message, Source, SourceError};
use crate::config::consumers::AmqpSource;
use bytes::Bytes;
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
};
use lapin::tcp::{AsyncTcpStream, RustlsConnector};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_util::sync::CancellationToken;

/// How long one broker operation may take: the whole connect (TCP, TLS,
/// AMQP handshake, channels, consume), a publish until its confirm, an
/// ack, reject or nack until written, a cancel, a close. A healthy broker
/// answers in milliseconds; one that blocked the connection
/// (`connection.blocked`: a memory or disk alarm) never does, and without
/// a bound the connection's acks would wait behind it until the alarm
/// clears.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(10);

/// The header a retried copy carries: its attempt number.
pub const ATTEMPTS_HEADER: &str = "x-idemgate-attempts";

/// The header of a copy republished before its backoff was over: when
/// the backoff ends (unix milliseconds).
pub const NOT_BEFORE_HEADER: &str = "x-idemgate-not-before";

pub struct Amqp {
    /// Taken when dropped, to be closed.
    connection: Option<Connection>,
    channel: Channel,
    publish: Channel,
    consumer: lapin::Consumer,
    queue: String,
    give_up: Arc<GiveUp>,
}

/// What a connection shares with its deliveries: a way to give it up.
#[derive(Default)]
struct GiveUp {
    /// Cancelled once the connection is given up; `next` then fails.
    given_up: CancellationToken,
    /// Why (the first operation that timed out).
    why: Mutex<Option<String>>,
    /// A duplicate of the connection's TCP socket: shutting it down ends
    /// the connection whatever lapin is waiting for (a blocked connection
    /// writes nothing, a Close neither), so the broker returns its
    /// unacked deliveries at once.
    socket: Mutex<Option<OwnedFd>>,
}

impl GiveUp {
    /// Gives the connection up; the runner logs `why` once, with the
    /// consumer's name, and reconnects.
    fn give_up(&self, why: String) -> SourceError {
        lock(&self.why).get_or_insert(why.clone());
        self.given_up.cancel();
        self.shut();
        SourceError::lost(why)
    }

    fn why(&self) -> String {
        lock(&self.why).clone().unwrap_or_default()
    }

    /// Keeps `fd`, a duplicate of the last socket connected.
    fn keep(&self, fd: OwnedFd) {
        if let Some(old) = lock(&self.socket).replace(fd) {
            shut(old);
        }
    }

    /// Ends the TCP connection (if one was made). Also needed after a
    /// clean close: the duplicate would keep the socket open otherwise.
    fn shut(&self) {
        if let Some(fd) = lock(&self.socket).take() {
            shut(fd);
        }
    }
}

/// `shutdown(2)` ends the connection for every descriptor of the socket
/// (lapin's too); closing our duplicate alone would not.
fn shut(fd: OwnedFd) {
    let _ = std::net::TcpStream::from(fd).shutdown(std::net::Shutdown::Both);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn err(what: &'static str) -> impl Fn(lapin::Error) -> SourceError {
    move |e| SourceError::new(what, e)
}

/// `op` within [`OPERATION_TIMEOUT`]; past it, the connection is given up.
async fn bounded<T>(
    give_up: &GiveUp,
    what: &'static str,
    op: impl Future<Output = lapin::Result<T>>,
) -> Result<T, SourceError> {
    match tokio::time::timeout(OPERATION_TIMEOUT, op).await {
        // Failed because the connection was given up (logged once).
        Ok(Err(e)) if give_up.given_up.is_cancelled() => Err(SourceError::lost(format!("{what}: {e}"))),
        Ok(done) => done.map_err(err(what)),
        Err(_) => Err(give_up.give_up(format!(
            "{what}: no answer from RabbitMQ within {}s (it blocks a connection that publishes during a memory or disk alarm); connection given up, its unacked deliveries return to the queue",
            OPERATION_TIMEOUT.as_secs()
        ))),
    }
}

/// `tls`: the consumer's rustls configuration (`consumer::tls`), for an
/// `amqps://` URL.
pub async fn connect(
    config: &AmqpSource,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Amqp, SourceError> {
    let give_up = Arc::new(GiveUp::default());
    let opened = tokio::time::timeout(OPERATION_TIMEOUT, open(config, tls, &give_up)).await;
    let opened = opened.unwrap_or_else(|_| {
        Err(SourceError::text(format!(
            "connect: no answer from RabbitMQ within {}s",
            OPERATION_TIMEOUT.as_secs()
        )))
    });
    if opened.is_err() {
        // Whatever half-open connection is left ends now.
        give_up.shut();
    }
    opened
}

async fn open(
    config: &AmqpSource,
    tls: Option<&Arc<rustls::ClientConfig>>,
    give_up: &Arc<GiveUp>,
) -> Result<Amqp, SourceError> {
    // Named after the queue, so an operator (or a test) can find it in
    // `rabbitmqctl list_connections client_properties`.
    let properties = ConnectionProperties::default()
        .with_connection_name(format!("idemgate/{}", config.queue).as_str().into());
    let connection = connect_with(config, tls, properties, give_up.clone())
        .await
        .map_err(|e| SourceError::new("connect", super::tls::describe("RabbitMQ", &e)))?;
    let ready = async {
        let channel = connection
            .create_channel()
            .await
            .map_err(err("open a channel"))?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await
            .map_err(err("basic.qos"))?;
        let publish = connection
            .create_channel()
            .await
            .map_err(err("open a channel"))?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(err("confirm.select"))?;
        let tag = format!("idemgate-{:016x}", rand::random::<u64>());
        let consumer = channel
            .basic_consume(
                ShortString::from(config.queue.clone()),
                ShortString::from(tag),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(err("basic.consume"))?;
        Ok((channel, publish, consumer))
    };
    match ready.await {
        Ok((channel, publish, consumer)) => Ok(Amqp {
            connection: Some(connection),
            channel,
            publish,
            consumer,
            queue: config.queue.clone(),
            give_up: give_up.clone(),
        }),
        Err(e) => {
            // Closed before its socket is shut (by `connect`).
            let _ = connection.close(200, ShortString::from("idemgate")).await;
            Err(e)
        }
    }
}

/// A connection over a TCP stream we connect (and keep a duplicate of, to
/// give it up), secured by `tls` for `amqps://` rather than by lapin's
/// own TLS (which builds its rustls configuration itself from PEM text or
/// PKCS#12): lapin drives AMQP over whatever transport its connector
/// hands it, here and on its own reconnects.
async fn connect_with(
    config: &AmqpSource,
    tls: Option<&Arc<rustls::ClientConfig>>,
    properties: ConnectionProperties,
    give_up: Arc<GiveUp>,
) -> lapin::Result<Connection> {
    let uri: AMQPUri = config
        .url
        .expose()
        .parse()
        .map_err(|e: String| lapin::Error::from(std::io::Error::other(e)))?;
    let connector = tls.map(|tls| RustlsConnector::from(tls.clone()));
    let runtime = lapin::runtime::default_runtime()?;
    Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, runtime| {
            let host = uri.authority.host.clone();
            let tcp = async {
                let addrs: Vec<SocketAddr> =
                    tokio::net::lookup_host((host.as_str(), uri.authority.port))
                        .await?
                        .collect();
                AsyncTcpStream::connect(&runtime, addrs).await
            };
            let stream = tokio::time::timeout(OPERATION_TIMEOUT, tcp)
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
            if let AsyncTcpStream::Plain(tcp) = &stream {
                if let Ok(fd) = tcp.get_ref().as_fd().try_clone_to_owned() {
                    give_up.keep(fd);
                }
            }
            Ok(match &connector {
                None => stream,
                Some(connector) => stream.into_rustls(connector, &host).await?,
            })
        },
        properties,
    )
    .await
}

#[async_trait::async_trait]
impl Source for Amqp {
    async fn next(&mut self) -> Result<Box<dyn Delivery>, SourceError> {
        let next = tokio::select! {
            next = self.consumer.next() => next,
            () = self.give_up.given_up.cancelled() => {
                return Err(SourceError::lost(self.give_up.why()));
            }
        };
        match next {
            Some(Ok(delivery)) => {
                let msg = message(&delivery.properties, &delivery.data);
                Ok(Box::new(AmqpDelivery {
                    delivery,
                    msg,
                    publish: self.publish.clone(),
                    queue: self.queue.clone(),
                    give_up: self.give_up.clone(),
                }))
            }
            Some(Err(e)) => Err(SourceError::new("consume", e)),
            None => Err(SourceError::text("the broker cancelled the consumer")),
        }
    }

    async fn close(&mut self) {
        let bye = || ShortString::from("idemgate stopping");
        let closing = async {
            let _ = self.channel.close(200, bye()).await;
            let _ = self.publish.close(200, bye()).await;
            if let Some(connection) = self.connection.take() {
                let _ = connection.close(200, bye()).await;
            }
        };
        let _ = tokio::time::timeout(OPERATION_TIMEOUT, closing).await;
        self.give_up.shut();
    }

    async fn stop(&mut self) {
        let tag = self.consumer.tag();
        let cancel = self
            .channel
            .basic_cancel(tag, BasicCancelOptions::default());
        let _ = tokio::time::timeout(OPERATION_TIMEOUT, cancel).await;
    }
}

impl Drop for Amqp {
    fn drop(&mut self) {
        // Unacked deliveries return to the queue when the connection closes.
        let give_up = self.give_up.clone();
        let Some(connection) = self.connection.take() else {
            give_up.shut();
            return;
        };
        tokio::spawn(async move {
            let bye = ShortString::from("idemgate stopping");
            let _ = tokio::time::timeout(OPERATION_TIMEOUT, connection.close(200, bye)).await;
            give_up.shut();
        });
    }
}

/// A header value as text, where it is one.
fn text(v: &AMQPValue) -> Option<String> {
    Some(match v {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok()?,
        AMQPValue::ShortString(s) => s.as_str().to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        _ => return None,
    })
}

fn message(properties: &BasicProperties, data: &[u8]) -> Message {
    let mut headers = Vec::new();
    if let Some(table) = properties.headers() {
        for (name, value) in table.inner() {
            if let Some(v) = text(value) {
                headers.push((name.as_str().to_string(), v));
            }
        }
    }
    let number = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.parse::<u32>().ok())
    };
    let attempt = number(ATTEMPTS_HEADER)
        .unwrap_or(1)
        .max(1)
        .saturating_add(number("x-delivery-count").unwrap_or(0));
    let not_before = headers
        .iter()
        .find(|(n, _)| n == NOT_BEFORE_HEADER)
        .and_then(|(_, v)| v.parse::<u64>().ok())
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
    Message {
        not_before,
        id: properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string()),
        headers,
        content_type: properties
            .content_type()
            .as_ref()
            .map(|s| s.as_str().to_string()),
        payload: Bytes::copy_from_slice(data),
        attempt,
    }
}

/// The headers a retry copy does not keep: a quorum queue's
/// `x-delivery-count` counts the original's redeliveries, and would be
/// added to the copy's own attempt number again and again.
const NOT_COPIED: &[&str] = &["x-delivery-count"];

/// The retry copy's properties: the original's, with `x-idemgate-attempts`
/// set to `next_attempt` and `x-idemgate-not-before` to `not_before` (or
/// none), without [`NOT_COPIED`] headers and without `user_id` (RabbitMQ
/// checks it against the publishing connection's user: a message another
/// user published would fail the copy's publish and close the publish
/// channel).
fn retry_properties(
    p: &BasicProperties,
    next_attempt: u32,
    not_before: Option<SystemTime>,
) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in p.headers().iter().flat_map(|t| t.inner()) {
        if !NOT_COPIED.contains(&name.as_str()) && name.as_str() != NOT_BEFORE_HEADER {
            headers.insert(name.clone(), value.clone());
        }
    }
    headers.insert(
        ShortString::from(ATTEMPTS_HEADER),
        AMQPValue::LongLongInt(i64::from(next_attempt)),
    );
    if let Some(at) = not_before {
        let ms = at
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_millis();
        headers.insert(
            ShortString::from(NOT_BEFORE_HEADER),
            AMQPValue::LongLongInt(i64::try_from(ms).unwrap_or(i64::MAX)),
        );
    }
    let mut out = BasicProperties::default().with_headers(headers);
    macro_rules! keep {
        ($($get:ident => $set:ident),*) => {$(
            if let Some(v) = p.$get() {
                out = out.$set(v.clone());
            }
        )*};
    }
    keep!(content_type => with_content_type, content_encoding => with_content_encoding,
        correlation_id => with_correlation_id, reply_to => with_reply_to,
        expiration => with_expiration, message_id => with_message_id,
        kind => with_type, app_id => with_app_id, cluster_id => with_cluster_id);
    if let Some(v) = *p.delivery_mode() {
        out = out.with_delivery_mode(v);
    }
    if let Some(v) = *p.priority() {
        out = out.with_priority(v);
    }
    if let Some(v) = *p.timestamp() {
        out = out.with_timestamp(v);
    }
    out
}

struct AmqpDelivery {
    delivery: lapin::message::Delivery,
    msg: Message,
    publish: Channel,
    queue: String,
    give_up: Arc<GiveUp>,
}

impl AmqpDelivery {
    /// An ack, reject or nack: lapin answers `Ok(false)` when it did not
    /// send it (the delivery's channel is closed, or it was settled
    /// already), which is no more a settlement than an error.
    async fn settle(
        &self,
        what: &'static str,
        op: impl Future<Output = lapin::Result<bool>>,
    ) -> Result<(), SourceError> {
        if bounded(&self.give_up, what, op).await? {
            Ok(())
        } else {
            Err(SourceError::text(format!(
                "{what} not sent: the delivery's channel is closed (or it was settled already); the broker redelivers it"
            )))
        }
    }

    /// The original back to the queue (its copy was not published).
    async fn requeue(&self) -> Result<(), SourceError> {
        let nack = self.delivery.acker.nack(BasicNackOptions {
            requeue: true,
            multiple: false,
        });
        self.settle("basic.nack", nack).await
    }
}

#[async_trait::async_trait]
impl Delivery for AmqpDelivery {
    fn message(&self) -> &Message {
        &self.msg
    }

    async fn ack(&self) -> Result<(), SourceError> {
        let ack = self.delivery.acker.ack(BasicAckOptions::default());
        self.settle("basic.ack", ack).await
    }

    async fn dead_letter(&self, _reason: Reason) -> Result<(), SourceError> {
        let reject = self
            .delivery
            .acker
            .reject(BasicRejectOptions { requeue: false });
        self.settle("basic.reject", reject).await
    }

    /// `delay`: what is left of the backoff after the hold (the copy
    /// carries it as `x-idemgate-not-before`).
    async fn retry_later(&self, delay: Duration, next_attempt: u32) -> Result<(), SourceError> {
        let not_before = (!delay.is_zero()).then(|| SystemTime::now() + delay);
        let properties = retry_properties(&self.delivery.properties, next_attempt, not_before);
        let published = bounded(&self.give_up, "publish the retry copy", async {
            let confirm = self
                .publish
                .basic_publish(
                    ShortString::from(""),
                    ShortString::from(self.queue.clone()),
                    // Returned, not dropped, when no queue takes it.
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    &self.delivery.data,
                    properties,
                )
                .await?;
            confirm.await
        })
        .await;
        let failed = match published {
            Ok(Confirmation::Ack(None)) => return self.ack().await,
            Ok(Confirmation::Ack(Some(returned))) => format!(
                "returned by the broker ({} {}): no queue {:?} took it",
                returned.reply_code,
                returned.reply_text.as_str(),
                self.queue
            ),
            Ok(Confirmation::Nack(_)) => "nacked by the broker".to_string(),
            Ok(Confirmation::NotRequested) => "not confirmed".to_string(),
            // Given up: the original returns with the connection.
            Err(e) if e.is_lost() => return Err(e),
            Err(e) => e.to_string(),
        };
        self.requeue().await?;
        Err(SourceError::text(format!(
            "the retry copy was not published ({failed}); the original was requeued instead"
        )))
    }

    fn delays_by_itself(&self) -> bool {
        false
    }

    fn counts_redeliveries(&self) -> bool {
        false
    }

    fn progress_every(&self) -> Option<Duration> {
        None
    }

    async fn progress(&self) -> Result<(), SourceError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_copy_drops_user_id_and_the_stale_delivery_count() {
        let mut h = FieldTable::default();
        h.insert("x-delivery-count".into(), AMQPValue::LongInt(3));
        h.insert(ATTEMPTS_HEADER.into(), AMQPValue::LongLongInt(2));
        h.insert("x-order-id".into(), AMQPValue::LongString("k1".into()));
        let original = BasicProperties::default()
            .with_headers(h)
            .with_user_id("someone-else".into())
            .with_message_id("m1".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_priority(5)
            .with_timestamp(7)
            .with_type("order".into())
            .with_app_id("shop".into())
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_expiration("60000".into())
            .with_content_encoding("gzip".into())
            .with_cluster_id("x".into());
        let copy = retry_properties(&original, 4, None);
        assert_eq!(copy.user_id(), &None);
        let mut want = FieldTable::default();
        want.insert(ATTEMPTS_HEADER.into(), AMQPValue::LongLongInt(4));
        want.insert("x-order-id".into(), AMQPValue::LongString("k1".into()));
        assert_eq!(copy.headers(), &Some(want.clone()));
        // Everything else is kept.
        let expected = BasicProperties::default()
            .with_headers(want)
            .with_message_id("m1".into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_priority(5)
            .with_timestamp(7)
            .with_type("order".into())
            .with_app_id("shop".into())
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_expiration("60000".into())
            .with_content_encoding("gzip".into())
            .with_cluster_id("x".into());
        assert_eq!(copy, expected);
        let m = message(&copy, b"{}");
        assert_eq!(m.attempt, 4);
    }

    #[test]
    fn a_copy_carries_the_end_of_its_backoff_and_the_next_copy_replaces_it() {
        let at = UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        let copy = retry_properties(&BasicProperties::default(), 2, Some(at));
        assert_eq!(message(&copy, b"").not_before, Some(at));
        let later = at + Duration::from_secs(1);
        let again = retry_properties(&copy, 2, Some(later));
        assert_eq!(message(&again, b"").not_before, Some(later));
        let due = retry_properties(&again, 3, None);
        assert_eq!(message(&due, b"").not_before, None);
        assert_eq!(message(&due, b"").attempt, 3);
    }
}
