//! `errors = ..`: idemgate's own error answers in the shape the upstream
//! API's clients expect. `"stripe"` adds Stripe's `error` member (which the
//! Stripe SDKs raise on) and `Stripe-Should-Retry`; a template writes the
//! API's own shape; `[defaults] errors` also shapes answers outside every
//! route. Every shape keeps the status, `Retry-After` and `no-store`.

use crate::support::{backend_tests, free_port, Action, Backend, Proxy, Resp, Upstream, ORDERS};
use serde_json::Value;
use std::time::Duration;

backend_tests!(
    stripe_shaped_errors_carry_an_error_member_and_a_retry_hint,
    templated_errors_are_written_in_the_apis_own_shape,
);

const BODY: &str = r#"{"item":"kettle","qty":1}"#;

/// Asserts a Stripe-shaped answer: JSON with the problem members and
/// `error: { type, code?, message }`; returns its body.
fn stripe(r: &Resp, status: u16, kind: &str, code: Option<&str>, retry: &str) -> Value {
    assert_eq!(r.status(), status, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
    assert_eq!(r.header("cache-control"), Some("no-store"), "{r:?}");
    assert_eq!(r.header("stripe-should-retry"), Some(retry), "{r:?}");
    let body = r.json();
    assert_eq!(body["status"], status, "{body}");
    assert!(
        body["type"].as_str().unwrap().contains("#problem-"),
        "{body}"
    );
    assert!(body["safe_new_key"].is_boolean(), "{body}");
    let error = &body["error"];
    assert_eq!(error["type"], kind, "{body}");
    assert_eq!(error["code"].as_str(), code, "{body}");
    assert_eq!(error["message"], body["detail"], "{body}");
    body
}

async fn stripe_shaped_errors_carry_an_error_member_and_a_retry_hint(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("errors", "stripe")
        .start()
        .await;
    let missing = proxy.post(ORDERS).body(BODY).send().await;
    stripe(
        &missing,
        400,
        "invalid_request_error",
        Some("parameter_missing"),
        "false",
    );
    let invalid = proxy.post(ORDERS).key("\"open").body(BODY).send().await;
    stripe(&invalid, 400, "invalid_request_error", None, "false");

    up.push(Action::Delay(Duration::from_millis(800)));
    let slow = tokio::spawn(proxy.post(ORDERS).key("k-stripe-1").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let dup = proxy.post(ORDERS).key("k-stripe-1").body(BODY).send().await;
    let body = stripe(
        &dup,
        409,
        "idempotency_error",
        Some("idempotency_key_in_use"),
        "true",
    );
    assert!(dup.header("retry-after").is_some(), "{body}");
    let first = slow.await.unwrap();
    assert_eq!(first.status(), 201);
    assert!(
        first.header("stripe-should-retry").is_none(),
        "upstream answers untouched"
    );
    let reused = proxy.post(ORDERS).key("k-stripe-1").body("{}").send().await;
    stripe(&reused, 422, "idempotency_error", None, "false");
    let replay = proxy.post(ORDERS).key("k-stripe-1").body(BODY).send().await;
    assert!(replay.replayed() && replay.header("stripe-should-retry").is_none());
    assert_eq!(up.hits(ORDERS), 1);
}

async fn templated_errors_are_written_in_the_apis_own_shape(backend: Backend) {
    let up = Upstream::start().await;
    let mut shape = toml::Table::new();
    shape.insert(
        "template".into(),
        r#"{"errors":[{"status":"{{status}}","code":"{{code}}","title":"{{title}}","detail":"{{detail}}","key":"{{key_id}}"}]}"#.into(),
    );
    shape.insert("content_type".into(), "application/vnd.api+json".into());
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("errors", toml::Value::Table(shape))
        .start()
        .await;
    let missing = proxy.post(ORDERS).body(BODY).send().await;
    assert_eq!(missing.status(), 400);
    assert_eq!(
        missing.header("content-type"),
        Some("application/vnd.api+json")
    );
    assert_eq!(missing.header("cache-control"), Some("no-store"));
    let e = &missing.json()["errors"][0];
    assert_eq!(e["status"], "400", "{e}");
    assert_eq!(e["code"], "key-missing", "{e}");
    assert_eq!(e["key"], "", "no key was sent: {e}");

    assert_eq!(
        proxy
            .post(ORDERS)
            .key("k-tpl-1")
            .body(BODY)
            .send()
            .await
            .status(),
        201
    );
    let reused = proxy.post(ORDERS).key("k-tpl-1").body("{}").send().await;
    assert_eq!(reused.status(), 422);
    let e = &reused.json()["errors"][0];
    assert_eq!(e["code"], "key-reused", "{e}");
    let key = e["key"].as_str().unwrap();
    assert!(key.len() == 16 && !reused.text().contains("k-tpl-1"), "{e}");
    assert!(e["detail"].as_str().is_some_and(|d| !d.is_empty()), "{e}");
}

/// `[defaults] errors` shapes what idemgate answers outside every route:
/// here an unrouted request to an upstream that is not listening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defaults_shape_answers_outside_every_route() {
    // Nothing listens there.
    let proxy = Proxy::builder(Backend::Memory, free_port())
        .set("defaults.errors", "stripe")
        .start()
        .await;
    let r = proxy.get("/not-a-route").send().await;
    // Nothing reached an upstream: sending it again is safe.
    stripe(&r, 502, "api_error", None, "true");
}
