//! NATS JetStream (`async-nats`): a durable pull consumer on the stream,
//! bound to when it exists and created (explicit acks, `ack_wait`,
//! `max_ack_pending`) when it does not.
//!
//! - ack: a confirmed double ack (`AckSync`), so the runner knows it landed.
//! - dead-letter: the message, its headers and `Idemgate-Dead-Letter-Reason`
//!   published (confirmed) to `dead_letter_subject` when one is set (a
//!   stream must capture that subject), then `+TERM`.
//! - retry: `-NAK` with the delay; the broker redelivers it then.
//! - progress: `+WPI` every half of `ack_wait` while the upstream runs.
//! - attempt: the broker's `num_delivered` for the message (kept by the
//!   broker across redeliveries and idemgate restarts; a delivery that
//!   found the key in flight elsewhere counts too).

use super::fate::Reason;
use super::link::Link;
use super::source::{Delivery, Message, Source, SourceError};
use crate::config::consumers::JetStreamSource;
use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures_util::StreamExt;
use std::sync::Arc;
use std::time::Duration;

/// How long a connect may take before the runner backs off and retries.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub const REASON_HEADER: &str = "Idemgate-Dead-Letter-Reason";

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
    let ack_wait = consumer.cached_info().config.ack_wait;
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
                    progress_every: self.ack_wait / 2,
                    dead_letter_subject: self.dead_letter_subject.clone(),
                    context: self.context.clone(),
                }))
            }
            Some(Err(e)) => Err(SourceError::new("pull", e)),
            None => Err(SourceError("the message stream ended".into())),
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
            let mut headers = self.m.message.headers.clone().unwrap_or_default();
            headers.insert(REASON_HEADER, reason.as_str());
            let ack = self
                .context
                .publish_with_headers(subject.clone(), headers, self.m.message.payload.clone())
                .await
                .map_err(|e| SourceError::new("publish the dead letter", e))?;
            ack.await
                .map_err(|e| SourceError::new("publish the dead letter", e))?;
        }
        self.m.ack_with(AckKind::Term).await.map_err(err("term"))
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
