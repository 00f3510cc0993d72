//! Deliveries without an `Idempotency-Key`: natural keys (a header or a
//! JSON pointer into the body), fixed consumer scopes, the presets for
//! GitHub, Standard Webhooks, Stripe, SNS, Pub/Sub and Shopify, and
//! canonical JSON fingerprints, through the proxy on every backend.

use crate::support::{backend_tests, Backend, Proxy, Req, Resp, Route, Upstream};

backend_tests!(
    each_preset_runs_a_delivery_once_and_replays_three_redeliveries,
    a_json_pointer_key_is_required_and_validated,
    an_optional_json_pointer_key_passes_a_keyless_body_through,
    canonical_json_fingerprints_ignore_order_and_whitespace_but_not_values,
    a_fixed_consumer_scope_shares_keys_across_credentials,
);

/// One delivery as its sender makes it; `attempt` (0 = the first) changes
/// what the sender changes per attempt (timestamps, signatures, counters).
struct Delivery {
    preset: &'static str,
    build: fn(&Proxy, &str, &str, u32) -> Req,
}

fn github(p: &Proxy, path: &str, id: &str, attempt: u32) -> Req {
    p.post(path)
        .header("x-github-delivery", id)
        .header("x-github-event", "push")
        .header("x-github-hook-id", "292430182")
        .header("user-agent", "GitHub-Hookshot/9b0e1c5")
        .header("x-hub-signature-256", &format!("sha256={attempt:064x}"))
        .header("content-type", "application/json")
        .body(r#"{"ref":"refs/heads/main","before":"6113728f","after":"59b20b8d","repository":{"id":1296269,"full_name":"octocat/Hello-World"}}"#)
}

fn standard_webhooks(p: &Proxy, path: &str, id: &str, attempt: u32) -> Req {
    p.post(path)
        .header("webhook-id", id)
        .header("webhook-timestamp", &(1_764_580_000 + attempt * 300).to_string())
        .header("webhook-signature", &format!("v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI{attempt}="))
        .header("content-type", "application/json")
        .body(r#"{"type":"invoice.paid","timestamp":"2026-12-01T08:00:00Z","data":{"id":"inv_1","amount":1200}}"#)
}

fn stripe(p: &Proxy, path: &str, id: &str, attempt: u32) -> Req {
    // Stripe re-sends the event; `pending_webhooks` may differ per attempt,
    // and a client library may re-serialize it in another member order.
    let body = if attempt % 2 == 0 {
        format!(
            r#"{{"id":"{id}","object":"event","api_version":"2024-06-20","created":1764580000,"type":"payment_intent.succeeded","livemode":false,"pending_webhooks":{},"data":{{"object":{{"id":"pi_1","amount":2000,"currency":"eur"}}}}}}"#,
            3 - attempt.min(2)
        )
    } else {
        format!(
            r#"{{ "object": "event", "id": "{id}", "data": {{ "object": {{ "currency": "eur", "amount": 2000, "id": "pi_1" }} }}, "pending_webhooks": {attempt}, "type": "payment_intent.succeeded", "created": 1764580000, "livemode": false, "api_version": "2024-06-20" }}"#
        )
    };
    p.post(path)
        .header(
            "stripe-signature",
            &format!(
                "t={},v1=5257a869e7ecebeda32affa62cdca3fa51cad7e77a0e56ff536d0ce8e108d8b{attempt}",
                1_764_580_000 + attempt
            ),
        )
        .header("content-type", "application/json; charset=utf-8")
        .header(
            "user-agent",
            "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
        )
        .body(body)
}

fn sns(p: &Proxy, path: &str, id: &str, attempt: u32) -> Req {
    let _ = attempt;
    p.post(path)
        .header("x-amz-sns-message-type", "Notification")
        .header("x-amz-sns-message-id", id)
        .header("x-amz-sns-topic-arn", "arn:aws:sns:eu-west-1:123456789012:orders")
        .header("content-type", "text/plain; charset=UTF-8")
        .header("user-agent", "Amazon Simple Notification Service Agent")
        .body(format!(
            r#"{{"Type":"Notification","MessageId":"{id}","TopicArn":"arn:aws:sns:eu-west-1:123456789012:orders","Message":"{{\"order\":7}}","Timestamp":"2026-12-01T08:00:00.000Z","SignatureVersion":"2","Signature":"EXAMPLEpH+..","SigningCertURL":"https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-abc.pem"}}"#
        ))
}

fn pub_sub(p: &Proxy, path: &str, id: &str, attempt: u32) -> Req {
    p.post(path)
        .header("authorization", &format!("Bearer eyJhbGciOiJSUzI1NiJ9.attempt{attempt}.sig"))
        .header("content-type", "application/json")
        .header("user-agent", "APIs-Google; (+https://developers.google.com/webmasters/APIs-Google.html)")
        .body(format!(
            r#"{{"message":{{"attributes":{{"key":"value"}},"data":"SGVsbG8gQ2xvdWQgUHViL1N1YiEgSGVyZSBpcyBteSBtZXNzYWdlIQ==","messageId":"{id}","message_id":"{id}","publishTime":"2026-12-01T08:00:00.000Z","publish_time":"2026-12-01T08:00:00.000Z"}},"subscription":"projects/myproject/subscriptions/mysubscription","deliveryAttempt":{}}}"#,
            attempt + 1
        ))
}

fn shopify(p: &Proxy, path: &str, id: &str, attempt: u32) -> Req {
    p.post(path)
        .header("x-shopify-webhook-id", id)
        .header("x-shopify-topic", "orders/create")
        .header("x-shopify-shop-domain", "example.myshopify.com")
        .header(
            "x-shopify-hmac-sha256",
            &format!("XWmrwMey6OsLMeiZKwP4FppHH3cmAiiJJAweH5Jo4b{attempt}="),
        )
        .header(
            "x-shopify-triggered-at",
            &format!("2026-12-01T08:0{attempt}:00.000Z"),
        )
        .header("content-type", "application/json")
        .body(r#"{"id":820982911946154508,"email":"jon@example.com","total_price":"403.00"}"#)
}

const DELIVERIES: [Delivery; 6] = [
    Delivery {
        preset: "github",
        build: github,
    },
    Delivery {
        preset: "standard-webhooks",
        build: standard_webhooks,
    },
    Delivery {
        preset: "stripe",
        build: stripe,
    },
    Delivery {
        preset: "sns",
        build: sns,
    },
    Delivery {
        preset: "pub-sub",
        build: pub_sub,
    },
    Delivery {
        preset: "shopify",
        build: shopify,
    },
];

/// Each preset: a delivery reaches the upstream once; three redeliveries
/// that differ only in what the sender changes per attempt are answered
/// with the replayed 200 (not a 409 or 422, so the sender stops); a new
/// delivery id runs.
async fn each_preset_runs_a_delivery_once_and_replays_three_redeliveries(backend: Backend) {
    let up = Upstream::start().await;
    let routes = DELIVERIES
        .iter()
        .map(|d| Route::post(&format!("/hooks/{}", d.preset)).set("preset", d.preset))
        .collect();
    let proxy = Proxy::builder(backend, up.addr)
        .routes(routes)
        .start()
        .await;
    for d in &DELIVERIES {
        let path = format!("/hooks/{}", d.preset);
        let id = format!("{}-0b7a9b3e-5b8e-4a4c-9b1f-1d2e3f4a5b6c", d.preset);
        let id = if d.preset == "stripe" {
            format!("evt_{}", &id[7..20])
        } else {
            id
        };
        let first = (d.build)(&proxy, &path, &id, 0).send().await;
        assert_eq!(first.status(), 200, "{}: {}", d.preset, first.text());
        assert!(!first.replayed(), "{}", d.preset);
        for attempt in 1..=3 {
            let again = (d.build)(&proxy, &path, &id, attempt).send().await;
            assert_eq!(
                again.status(),
                200,
                "{} attempt {attempt}: {}",
                d.preset,
                again.text()
            );
            assert!(again.replayed(), "{} attempt {attempt}", d.preset);
            assert_eq!(again.body, first.body, "{}", d.preset);
        }
        assert_eq!(up.hits(&path), 1, "{}: the upstream ran once", d.preset);
        let other = (d.build)(&proxy, &path, &format!("{id}-2"), 0).send().await;
        assert_eq!(other.status(), 200, "{}", d.preset);
        assert!(!other.replayed(), "{}", d.preset);
        assert_eq!(up.hits(&path), 2, "{}: a new delivery runs", d.preset);
    }
}

fn problem_slug(resp: &Resp, status: u16) -> String {
    let json = resp.assert_problem(status);
    json["type"]
        .as_str()
        .and_then(|t| t.rsplit_once("#problem-"))
        .map(|(_, slug)| slug.to_string())
        .unwrap_or_else(|| panic!("no problem type: {json}"))
}

/// `key = { json = "/id" }`: the content type is not checked; a body that
/// is not JSON, or lacks the member, is a 400 naming the pointer; a string
/// or an integer is a key; anything else, or a string the header rules
/// refuse, is a 400 too. None of them reaches the upstream.
async fn a_json_pointer_key_is_required_and_validated(backend: Backend) {
    let up = Upstream::start().await;
    let route = Route::post("/events")
        .set("key", toml_table(&[("json", "/id")]))
        .set("scope", toml_table(&[("value", "events")]));
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![route])
        .start()
        .await;
    let send = |body: &str| {
        proxy
            .post("/events")
            .header("content-type", "text/plain")
            .body(body.to_string())
            .send()
    };

    let resp = send("id=1").await;
    assert_eq!(problem_slug(&resp, 400), "key-missing");
    assert!(
        resp.json()["detail"].as_str().unwrap().contains("/id"),
        "{}",
        resp.text()
    );
    assert_eq!(
        problem_slug(&send(r#"{"other":1}"#).await, 400),
        "key-missing"
    );
    assert_eq!(
        problem_slug(&send(r#"{"id":1.5}"#).await, 400),
        "key-invalid"
    );
    assert_eq!(
        problem_slug(&send(r#"{"id":null}"#).await, 400),
        "key-invalid"
    );
    assert_eq!(
        problem_slug(&send(r#"{"id":""}"#).await, 400),
        "key-invalid"
    );
    assert_eq!(
        problem_slug(&send(r#"{"id":"caf\u00e9"}"#).await, 400),
        "key-invalid"
    );
    let long = format!(r#"{{"id":"{}"}}"#, "a".repeat(256));
    assert_eq!(problem_slug(&send(&long).await, 400), "key-invalid");
    // Duplicate members make the id ambiguous: refused, not guessed.
    assert_eq!(
        problem_slug(&send(r#"{"id":"a","id":"b"}"#).await, 400),
        "key-missing"
    );
    assert_eq!(up.total_hits(), 0);

    // A string and an integer are keys; integers keep every digit.
    let a = send(r#"{"id":"evt_1"}"#).await;
    assert_eq!(a.status(), 200);
    assert!(send(r#"{"id":"evt_1"}"#).await.replayed());
    let big = send(r#"{"id":12345678901234567890}"#).await;
    assert!(!big.replayed());
    let next = send(r#"{"id":12345678901234567891}"#).await;
    assert!(!next.replayed(), "ids above 2^53 stay distinct");
    assert!(send(r#"{"id":12345678901234567890}"#).await.replayed());
    assert_eq!(up.hits("/events"), 3);
}

/// `require_key = false` with a body key: a body without it is forwarded
/// unprotected (every time), one with it is protected.
async fn an_optional_json_pointer_key_passes_a_keyless_body_through(backend: Backend) {
    let up = Upstream::start().await;
    let route = Route::post("/events")
        .set("key", toml_table(&[("json", "/message/messageId")]))
        .set("require_key", false);
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![route])
        .start()
        .await;
    for _ in 0..2 {
        let r = proxy.post("/events").body("not json").send().await;
        assert_eq!(r.status(), 200);
        assert!(!r.replayed());
    }
    assert_eq!(up.hits("/events"), 2);
    let body = r#"{"message":{"messageId":"42"}}"#;
    assert!(!proxy.post("/events").body(body).send().await.replayed());
    assert!(proxy.post("/events").body(body).send().await.replayed());
    assert_eq!(up.hits("/events"), 3);
    let received = &up.last().body;
    assert_eq!(
        received.as_ref(),
        body.as_bytes(),
        "the body is forwarded as sent"
    );
}

/// `fingerprint = "json"`: a retry re-serialized with another member order
/// or whitespace replays; a changed value is a 422. The raw route refuses
/// the reordered retry. A body that is not I-JSON (not JSON, a duplicate
/// member, nesting past the limit) is fingerprinted as its bytes.
async fn canonical_json_fingerprints_ignore_order_and_whitespace_but_not_values(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![
            Route::post("/json").set("fingerprint", "json"),
            Route::post("/raw"),
        ])
        .start()
        .await;
    let send =
        |path: &str, key: &str, body: &str| proxy.post(path).key(key).body(body.to_string()).send();
    let original =
        r#"{"amount":1000,"currency":"eur","items":[{"sku":"a","qty":1}],"note":"\u00e9"}"#;
    let reordered = "{ \"note\": \"é\", \"items\": [ { \"qty\": 1.0, \"sku\": \"a\" } ],\n  \"currency\": \"eur\", \"amount\": 1e3 }";
    let changed = r#"{"amount":1001,"currency":"eur","items":[{"sku":"a","qty":1}],"note":"é"}"#;
    let swapped = r#"{"amount":1000,"currency":"eur","items":[{"sku":"a","qty":1}],"note":"e"}"#;

    assert_eq!(send("/json", "k1", original).await.status(), 200);
    let again = send("/json", "k1", reordered).await;
    assert!(again.replayed(), "{}", again.text());
    send("/json", "k1", changed).await.assert_problem(422);
    send("/json", "k1", swapped).await.assert_problem(422);
    assert_eq!(up.hits("/json"), 1);

    assert_eq!(send("/raw", "r1", original).await.status(), 200);
    send("/raw", "r1", reordered).await.assert_problem(422);
    assert_eq!(up.hits("/raw"), 1);

    // Not I-JSON: the bytes decide.
    for (i, (body, same_meaning)) in [
        ("plain text", "plain  text"),
        (r#"{"a":1,"a":2}"#, r#"{ "a":1, "a":2 }"#),
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("bytes-{i}");
        assert_eq!(send("/json", &key, body).await.status(), 200);
        assert!(send("/json", &key, body).await.replayed());
        send("/json", &key, same_meaning).await.assert_problem(422);
    }
    // Far deeper than the parser goes: no stack overflow, raw bytes.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert_eq!(send("/json", "deep", &deep).await.status(), 200);
    assert!(send("/json", "deep", &deep).await.replayed());
    assert_eq!(up.hits("/json"), 4);
}

/// `scope = { value }`: the consumer, not the caller, owns the key, so a
/// redelivery with another credential (Pub/Sub signs each push with a new
/// token) is the same delivery; another route's value is another consumer.
async fn a_fixed_consumer_scope_shares_keys_across_credentials(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![
            Route::post("/a")
                .set("key", toml_table(&[("header", "x-message-id")]))
                .set("scope", toml_table(&[("value", "billing")])),
            Route::post("/b")
                .set("key", toml_table(&[("header", "x-message-id")]))
                .set("scope", toml_table(&[("value", "shipping")])),
            Route::post("/c").set("key", toml_table(&[("header", "x-message-id")])),
        ])
        .start()
        .await;
    let send = |path: &str, auth: &str| {
        proxy
            .post(path)
            .header("x-message-id", "m-1")
            .header("authorization", auth)
            .body("{}")
            .send()
    };
    assert!(!send("/a", "Bearer one").await.replayed());
    assert!(send("/a", "Bearer two").await.replayed());
    assert!(
        !send("/b", "Bearer one").await.replayed(),
        "another consumer"
    );
    // Scoped by the credential (the default): another caller, another key.
    assert!(!send("/c", "Bearer one").await.replayed());
    assert!(!send("/c", "Bearer two").await.replayed());
    assert!(send("/c", "Bearer two").await.replayed());
    assert_eq!(up.total_hits(), 4);
}

fn toml_table(pairs: &[(&str, &str)]) -> toml::Value {
    toml::Value::Table(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), toml::Value::String(v.to_string())))
            .collect(),
    )
}
