//! A message made into the protected request it is delivered as, and the
//! protected path's result read back as what [`Happened`].
//!
//! The request (documented in the README, "Message consumers"): the
//! consumer's `deliver` method and path; the payload as the body; the
//! message's content type; `Idempotency-Key: <key>` (the bare message key:
//! the consumer's name is the scope); `Idemgate-Consumer: <name>`;
//! `Idemgate-Attempt: <n>`; and each string-valued message header under
//! its own name, unless it is not a valid HTTP field, a hop-by-hop or
//! framing header, or one of those above. The fingerprint covers the
//! method, the path and the payload (raw, or canonical JSON with
//! `fingerprint = "json"`), not the headers.

use super::fate::Happened;
use super::source::Message;
use crate::config::consumers::{ConsumerConfig, MessageKey};
use crate::config::Secret;
use crate::error::ProxyError;
use crate::idempotency::canonical_json::{self, Json};
use crate::idempotency::{IdempotencyKey, RecordKey, Scope};
use crate::lease::KeyFate;
use crate::metrics::Outcome;
use crate::proxy::protected::prepare::{parse_body, prepare, ProtectedRequest};
use crate::proxy::protected::Recording;
use http::{header, HeaderName, HeaderValue, Request, Response};
use std::net::SocketAddr;
use std::time::Duration;

pub const ATTEMPT_HEADER: &str = "idemgate-attempt";
pub const CONSUMER_HEADER: &str = "idemgate-consumer";

/// Message headers never passed on: framing and hop-by-hop fields, and
/// those the delivery sets itself.
const NOT_PASSED: [&str; 12] = [
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "idempotency-key",
    ATTEMPT_HEADER,
    CONSUMER_HEADER,
];

/// The message's key, where the consumer's `key` says; `None`: it has none
/// (or one that is no valid key).
pub fn message_key(key: &MessageKey, msg: &Message) -> Option<IdempotencyKey> {
    let text = match key {
        MessageKey::MessageId => msg.id.clone()?,
        MessageKey::Header(name) => msg.header(name.as_str())?.to_string(),
        MessageKey::Json(pointer) => {
            let doc = canonical_json::parse(&msg.payload).ok()?;
            match pointer.find(&doc)? {
                Json::String(s) => s.clone(),
                Json::Number { text, .. } if is_integer(text) => text.to_string(),
                _ => return None,
            }
        }
    };
    IdempotencyKey::from_value(&text).ok()
}

fn is_integer(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// The protected request a message is delivered as; `None`: it has no
/// usable key.
pub fn request(
    consumer: &ConsumerConfig,
    msg: &Message,
    secret: Option<&Secret>,
) -> Option<ProtectedRequest> {
    let key = message_key(&consumer.key, msg)?;
    let route = consumer.route.clone();
    let mut builder = Request::builder()
        .method(route.methods[0].clone())
        .uri(route.path.as_str());
    let headers = builder.headers_mut().expect("a valid request head");
    for (name, value) in &msg.headers {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) else {
            continue;
        };
        if !NOT_PASSED.contains(&name.as_str()) {
            headers.append(name, value);
        }
    }
    if let Some(ct) = msg.content_type.as_deref() {
        if let Ok(v) = HeaderValue::from_str(ct) {
            headers.insert(header::CONTENT_TYPE, v);
        }
    }
    let key_value = HeaderValue::from_str(key.as_str()).ok()?;
    headers.insert(route.key_header.clone(), key_value);
    headers.insert(
        HeaderName::from_static(CONSUMER_HEADER),
        HeaderValue::from_str(&consumer.name).ok()?,
    );
    headers.insert(
        HeaderName::from_static(ATTEMPT_HEADER),
        HeaderValue::from(msg.attempt),
    );
    let (parts, ()) = builder.body(()).ok()?.into_parts();
    let secret = secret.map(Secret::expose);
    let record_key = RecordKey::new(Scope::of_value(&consumer.name, secret), &key);
    let doc = parse_body(&route, &msg.payload);
    // No client: the delivery comes from idemgate itself.
    let peer = SocketAddr::from(([127, 0, 0, 1], 0));
    Some(prepare(
        route,
        parts,
        msg.payload.clone(),
        record_key,
        doc,
        peer,
    ))
}

/// What the protected path's result means for the message.
pub fn happened<B>(result: &Result<(Outcome, Response<B>), ProxyError>) -> Happened {
    match result {
        Ok((Outcome::Forwarded, resp)) => {
            let status = resp.status().as_u16();
            match resp.extensions().get::<Recording>() {
                Some(Recording(c)) if c.fate == KeyFate::TakenOver => Happened::Unsettled,
                Some(Recording(c)) => Happened::Executed {
                    status,
                    recorded: c.recorded,
                },
                None => Happened::Executed {
                    status,
                    recorded: false,
                },
            }
        }
        Ok((Outcome::Replayed, resp)) => Happened::Duplicate {
            status: resp.status().as_u16(),
        },
        Ok((Outcome::UpstreamError, resp)) => Happened::Released {
            status: Some(resp.status().as_u16()),
            retry_after: retry_after(resp),
        },
        Ok(_) => Happened::Unsettled,
        Err(ProxyError::InFlight { retry_after_secs }) => Happened::InFlight {
            retry_after: Duration::from_secs(*retry_after_secs),
        },
        Err(ProxyError::Mismatch(_)) => Happened::Mismatch,
        Err(ProxyError::NotReplayable { status }) => Happened::Duplicate { status: *status },
        Err(ProxyError::OutcomeUnknown) => Happened::Parked,
        Err(ProxyError::Upstream {
            key: KeyFate::Released,
            ..
        }) => Happened::Released {
            status: None,
            retry_after: None,
        },
        // Kept (executed, body failed), Unknown (parked, maybe not yet
        // recorded), Locked, TakenOver: the redelivery reads the record.
        Err(_) => Happened::Unsettled,
    }
}

/// `Retry-After` in seconds (a date is not honoured: the backoff applies).
fn retry_after<B>(resp: &Response<B>) -> Option<Duration> {
    let v = resp.headers().get(header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn consumer(extra: &str) -> ConsumerConfig {
        let text = format!(
            "[server]\nupstream = \"http://127.0.0.1:3000\"\n[[consumer]]\nname = \"c\"\nsource = {{ amqp = {{ url = \"amqp://127.0.0.1:5672/%2f\", queue = \"q\" }} }}\ndeliver = {{ path = \"/in\" }}\n{extra}\n"
        );
        let config = Config::parse(&text, "t.toml").unwrap();
        config.restart.consumers[0].clone()
    }

    fn msg(id: Option<&str>, headers: &[(&str, &str)], payload: &str) -> Message {
        Message {
            id: id.map(String::from),
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            content_type: Some("application/json".into()),
            payload: bytes::Bytes::from(payload.to_string()),
            attempt: 2,
            not_before: None,
        }
    }

    #[test]
    fn key_table() {
        let by_id = consumer("");
        let by_header = consumer("key = { header = \"X-Order-Id\" }");
        let by_json = consumer("key = { json = \"/order/id\" }");
        let key = |c: &ConsumerConfig, m: &Message| {
            message_key(&c.key, m).map(|k| k.as_str().to_string())
        };
        let rows: &[(&ConsumerConfig, Message, Option<&str>)] = &[
            (&by_id, msg(Some("m1"), &[], "{}"), Some("m1")),
            (&by_id, msg(None, &[("x-order-id", "o1")], "{}"), None),
            (&by_id, msg(Some(""), &[], "{}"), None),
            (
                &by_header,
                msg(Some("m1"), &[("X-Order-Id", "o1")], "{}"),
                Some("o1"),
            ),
            (
                &by_header,
                msg(Some("m1"), &[("x-order-id", "o1")], "{}"),
                Some("o1"),
            ),
            (&by_header, msg(Some("m1"), &[], "{}"), None),
            (
                &by_json,
                msg(None, &[], r#"{"order":{"id":"o7"}}"#),
                Some("o7"),
            ),
            (
                &by_json,
                msg(None, &[], r#"{"order":{"id":42}}"#),
                Some("42"),
            ),
            (&by_json, msg(None, &[], r#"{"order":{"id":4.5}}"#), None),
            (&by_json, msg(None, &[], r#"{"order":{}}"#), None),
            (&by_json, msg(Some("m1"), &[], "not json"), None),
        ];
        for (i, (c, m, want)) in rows.iter().enumerate() {
            assert_eq!(key(c, m).as_deref(), *want, "row {i}");
        }
    }

    #[test]
    fn a_message_is_one_request_scoped_by_the_consumer() {
        let c = consumer("");
        let m = msg(
            Some("m1"),
            &[
                ("x-trace", "t1"),
                ("content-length", "9"),
                ("bad name", "x"),
                ("idempotency-key", "forged"),
            ],
            "{\"a\":1}",
        );
        let req = request(&c, &m, None).unwrap();
        assert_eq!(req.parts.method, http::Method::POST);
        assert_eq!(req.parts.uri, "/in");
        let h = &req.parts.headers;
        assert_eq!(h["idempotency-key"], "m1");
        assert_eq!(h["x-trace"], "t1");
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h[ATTEMPT_HEADER], "2");
        assert_eq!(h[CONSUMER_HEADER], "c");
        assert!(h.get("content-length").is_none());
        assert_eq!(h.get_all("idempotency-key").iter().count(), 1);
        // Another consumer's same message id is another key.
        let other = consumer("").clone();
        let other = ConsumerConfig {
            name: "d".into(),
            route: std::sync::Arc::new(crate::route::RouteConfig {
                scope_value: Some("d".into()),
                ..(*other.route).clone()
            }),
            ..other
        };
        let theirs = request(&other, &m, None).unwrap();
        assert_ne!(req.record_key, theirs.record_key);
        // Redelivery headers do not change the fingerprint; the payload does.
        let again = msg(Some("m1"), &[("x-trace", "t2")], "{\"a\":1}");
        let again = Message {
            attempt: 5,
            ..again
        };
        let same = request(&c, &again, None).unwrap();
        assert_eq!(req.record_key, same.record_key);
        assert_eq!(req.fingerprint, same.fingerprint);
        let changed = request(&c, &msg(Some("m1"), &[], "{\"a\":2}"), None).unwrap();
        assert_ne!(req.fingerprint, changed.fingerprint);
        assert!(request(&c, &msg(None, &[], "{}"), None).is_none());
    }
}
