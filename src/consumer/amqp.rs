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
//!   both: the same key, so one runs. Should the publish fail, the
//!   original is requeued (`basic.nack`) instead.
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
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How long the TCP connect of an `amqps://` connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The header a retried copy carries: its attempt number.
pub const ATTEMPTS_HEADER: &str = "x-idemgate-attempts";

pub struct Amqp {
    /// Taken when dropped, to be closed.
    connection: Option<Connection>,
    channel: Channel,
    publish: Channel,
    consumer: lapin::Consumer,
    queue: String,
}

fn err(what: &'static str) -> impl Fn(lapin::Error) -> SourceError {
    move |e| SourceError::new(what, e)
}

/// `tls`: the consumer's rustls configuration (`consumer::tls`), for an
/// `amqps://` URL.
pub async fn connect(
    config: &AmqpSource,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Amqp, SourceError> {
    // Named after the queue, so an operator (or a test) can find it in
    // `rabbitmqctl list_connections client_properties`.
    let properties = ConnectionProperties::default()
        .with_connection_name(format!("idemgate/{}", config.queue).as_str().into());
    let connected = match tls {
        None => Connection::connect(config.url.expose(), properties).await,
        Some(tls) => connect_tls(config, tls, properties).await,
    };
    let connection =
        connected.map_err(|e| SourceError::new("connect", super::tls::describe("RabbitMQ", &e)))?;
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
    Ok(Amqp {
        connection: Some(connection),
        channel,
        publish,
        consumer,
        queue: config.queue.clone(),
    })
}

/// An `amqps://` connection over a stream `tls` secured, rather than
/// lapin's own TLS (which builds its rustls configuration itself from
/// PEM text or PKCS#12): lapin drives AMQP over whatever transport its
/// connector hands it, here and on its own reconnects.
async fn connect_tls(
    config: &AmqpSource,
    tls: &Arc<rustls::ClientConfig>,
    properties: ConnectionProperties,
) -> lapin::Result<Connection> {
    let uri: AMQPUri = config
        .url
        .expose()
        .parse()
        .map_err(|e: String| lapin::Error::from(std::io::Error::other(e)))?;
    let connector = RustlsConnector::from(tls.clone());
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
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, tcp)
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
            Ok(stream.into_rustls(&connector, &host).await?)
        },
        properties,
    )
    .await
}

#[async_trait::async_trait]
impl Source for Amqp {
    async fn next(&mut self) -> Result<Box<dyn Delivery>, SourceError> {
        match self.consumer.next().await {
            Some(Ok(delivery)) => {
                let msg = message(&delivery.properties, &delivery.data);
                Ok(Box::new(AmqpDelivery {
                    delivery,
                    msg,
                    publish: self.publish.clone(),
                    queue: self.queue.clone(),
                }))
            }
            Some(Err(e)) => Err(SourceError::new("consume", e)),
            None => Err(SourceError::text("the broker cancelled the consumer")),
        }
    }

    async fn close(&mut self) {
        let bye = || ShortString::from("idemgate stopping");
        let _ = self.channel.close(200, bye()).await;
        let _ = self.publish.close(200, bye()).await;
        if let Some(connection) = self.connection.take() {
            let _ = connection.close(200, bye()).await;
        }
    }

    async fn stop(&mut self) {
        let tag = self.consumer.tag();
        let _ = self
            .channel
            .basic_cancel(tag, BasicCancelOptions::default())
            .await;
    }
}

impl Drop for Amqp {
    fn drop(&mut self) {
        // Unacked deliveries return to the queue when the connection closes.
        let Some(connection) = self.connection.take() else {
            return;
        };
        tokio::spawn(async move {
            let _ = connection
                .close(200, ShortString::from("idemgate stopping"))
                .await;
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
    Message {
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
/// set to `next_attempt`, without [`NOT_COPIED`] headers and without
/// `user_id` (RabbitMQ checks it against the publishing connection's user:
/// a message another user published would fail the copy's publish and
/// close the publish channel).
fn retry_properties(p: &BasicProperties, next_attempt: u32) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (name, value) in p.headers().iter().flat_map(|t| t.inner()) {
        if !NOT_COPIED.contains(&name.as_str()) {
            headers.insert(name.clone(), value.clone());
        }
    }
    headers.insert(
        ShortString::from(ATTEMPTS_HEADER),
        AMQPValue::LongLongInt(i64::from(next_attempt)),
    );
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
}

#[async_trait::async_trait]
impl Delivery for AmqpDelivery {
    fn message(&self) -> &Message {
        &self.msg
    }

    async fn ack(&self) -> Result<(), SourceError> {
        self.delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map(drop)
            .map_err(err("basic.ack"))
    }

    async fn dead_letter(&self, _reason: Reason) -> Result<(), SourceError> {
        self.delivery
            .acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .map(drop)
            .map_err(err("basic.reject"))
    }

    async fn retry_later(&self, _delay: Duration, next_attempt: u32) -> Result<(), SourceError> {
        let properties = retry_properties(&self.delivery.properties, next_attempt);
        let published = async {
            let confirm = self
                .publish
                .basic_publish(
                    ShortString::from(""),
                    ShortString::from(self.queue.clone()),
                    BasicPublishOptions::default(),
                    &self.delivery.data,
                    properties,
                )
                .await?;
            confirm.await
        }
        .await;
        match published {
            Ok(c) if c.is_ack() => self.ack().await,
            _ => self
                .delivery
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    multiple: false,
                })
                .await
                .map(drop)
                .map_err(err("basic.nack")),
        }
    }

    fn delays_by_itself(&self) -> bool {
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
        let copy = retry_properties(&original, 4);
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
}
