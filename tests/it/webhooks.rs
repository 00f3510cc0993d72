//! Deliveries without an `Idempotency-Key`: natural keys (a header or a
//! JSON pointer into the body), fixed consumer scopes, the presets for
//! GitHub, Standard Webhooks, Stripe, SNS, Pub/Sub and Shopify, and
//! canonical JSON fingerprints, through the proxy on every backend.

use crate::support::services::{database_url, require_postgres};
use crate::support::{
    backend_tests, free_port, run_to_completion, Action, Backend, Proxy, Req, Resp, Route,
    ServeProcess, TestConfig, TestSchema, Upstream, ORDERS,
};
use http::Method;

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
    let body = if attempt.is_multiple_of(2) {
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

// ===== through the real binary, on PostgreSQL =====

/// `idemgate serve` on PostgreSQL (a schema of its own) in front of `up`,
/// with `config` adding the routes; the directory and schema go with it.
struct Served {
    gate: ServeProcess,
    config: std::path::PathBuf,
    _dir: tempfile::TempDir,
    _schema: TestSchema,
}

async fn serve(up: &Upstream, config: impl FnOnce(TestConfig) -> TestConfig) -> Served {
    let db = database_url();
    require_postgres(&db).await;
    let schema = TestSchema::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (free_port(), free_port());
    config(
        TestConfig::new(up.addr)
            .listen(listen, admin)
            .set("store.backend", "postgres")
            .set("store.url", db)
            .set("store.schema", schema.schema.as_str())
            .set("store.pool_size", 2),
    )
    .write(&path);
    let gate = ServeProcess::start(&path, listen, admin, &[]).await;
    Served {
        gate,
        config: path,
        _dir: dir,
        _schema: schema,
    }
}

fn github_delivery(gate: &ServeProcess, id: &str, signature: &str) -> Req {
    Req::new(Method::POST, gate.url("/hooks/github"))
        .header("x-github-delivery", id)
        .header("x-github-event", "push")
        .header("x-hub-signature-256", &format!("sha256={signature}"))
        .header("content-type", "application/json")
        .body(r#"{"ref":"refs/heads/main","after":"59b20b8d"}"#)
}

/// Regression: `[defaults] require_key = false` (meant for the
/// Idempotency-Key routes) turned the preset's required key off, and a
/// delivery without its id was forwarded unprotected. It is a 400 now,
/// and `check-config` shows the preset's route as `required=true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preset_requires_its_delivery_id_despite_defaults_require_key_false() {
    let up = Upstream::start().await;
    let s = serve(&up, |c| {
        c.set("defaults.require_key", false)
            .route(Route::post(ORDERS))
            .route(Route::post("/hooks/github").set("preset", "github"))
    })
    .await;
    let no_id = Req::new(Method::POST, s.gate.url("/hooks/github"))
        .header("x-github-event", "push")
        .body("{}")
        .send()
        .await;
    assert_eq!(problem_slug(&no_id, 400), "key-missing");
    assert_eq!(up.hits("/hooks/github"), 0, "nothing was forwarded");
    // `[defaults]` still applies to the route without a preset.
    let open = s.gate.post(ORDERS).body("{}").send().await;
    assert_eq!(open.status(), 201, "{}", open.text());
    let checked = run_to_completion(
        &["check-config", "--config", s.config.to_str().unwrap()],
        &[],
    )
    .await;
    assert_eq!(checked.code, 0, "{}", checked.stderr);
    let line = |path: &str| {
        checked
            .stdout
            .lines()
            .find(|l| l.contains(&format!(" {path} ")))
            .unwrap_or_else(|| panic!("no route {path}:\n{}", checked.stdout))
            .to_string()
    };
    assert!(
        line("/hooks/github").contains(" required=true "),
        "{}",
        checked.stdout
    );
    assert!(
        line(ORDERS).contains(" required=false "),
        "{}",
        checked.stdout
    );
}

/// Regression (key squatting): an unsigned request naming a Stripe event
/// id got the upstream's 401, stored under the id; the genuine signed
/// delivery then got 422 for the sender's whole retry horizon. The 401 is
/// released now: the genuine delivery reaches the upstream and runs, and
/// its redelivery replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsigned_request_naming_a_delivery_id_does_not_block_the_genuine_delivery() {
    let up = Upstream::start().await;
    let s = serve(&up, |c| {
        c.route(Route::post("/hooks/stripe").set("preset", "stripe"))
    })
    .await;
    let event = |signature: Option<&str>, amount: u32| {
        let req = Req::new(Method::POST, s.gate.url("/hooks/stripe"))
            .header("content-type", "application/json");
        let req = match signature {
            Some(sig) => req.header("stripe-signature", &format!("t=1764580000,v1={sig}")),
            None => req,
        };
        req.body(format!(
            r#"{{"id":"evt_1QsQuat","object":"event","type":"payment_intent.succeeded","pending_webhooks":1,"data":{{"object":{{"id":"pi_1","amount":{amount}}}}}}}"#
        ))
    };
    // The upstream verifies the signature and refuses the forgery.
    up.push(Action::Status(401));
    let forged = event(None, 1).send().await;
    assert_eq!(forged.status(), 401, "{}", forged.text());
    let genuine = event(Some("5257a869"), 2000).send().await;
    assert_eq!(genuine.status(), 200, "{}", genuine.text());
    assert!(!genuine.replayed());
    assert_eq!(up.hits("/hooks/stripe"), 2, "the genuine delivery ran");
    assert!(String::from_utf8_lossy(&up.last().body).contains("2000"));
    let redelivered = event(Some("0c1d2e3f"), 2000).send().await;
    assert!(redelivered.replayed(), "{}", redelivered.text());
    assert_eq!(up.hits("/hooks/stripe"), 2);
}

/// Regression: a delivery the upstream refused with 401 while its secret
/// was being rotated had that 401 replayed to every redelivery (the
/// upstream processed 0 of 2). The redelivery runs now. A route's own
/// `release_statuses` still wins: listing only 5xx stores the 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_refused_during_a_secret_rotation_runs_on_its_redelivery() {
    let up = Upstream::start().await;
    let s = serve(&up, |c| {
        c.route(Route::post("/hooks/github").set("preset", "github"))
            .route(
                Route::post("/hooks/strict")
                    .set("preset", "github")
                    .set("release_statuses", vec!["5xx"]),
            )
    })
    .await;
    for status in [401, 403, 404] {
        let id = format!("72d3162e-{status}");
        up.push(Action::Status(status));
        let refused = github_delivery(&s.gate, &id, "old-secret").send().await;
        assert_eq!(refused.status(), status, "{}", refused.text());
        let redelivery = github_delivery(&s.gate, &id, "new-secret").send().await;
        assert_eq!(redelivery.status(), 200, "{status}: {}", redelivery.text());
        assert!(!redelivery.replayed(), "{status}: the redelivery ran");
        let again = github_delivery(&s.gate, &id, "new-secret").send().await;
        assert!(again.replayed(), "{status}: {}", again.text());
    }
    assert_eq!(
        up.hits("/hooks/github"),
        6,
        "each delivery ran twice: refused, then processed"
    );

    up.push(Action::Status(401));
    let strict = |sig| {
        Req::new(Method::POST, s.gate.url("/hooks/strict"))
            .header("x-github-delivery", "d-strict")
            .header("x-hub-signature-256", sig)
            .body("{}")
    };
    assert_eq!(strict("sha256=old").send().await.status(), 401);
    let replayed = strict("sha256=new").send().await;
    assert_eq!(replayed.status(), 401);
    assert!(replayed.replayed(), "the route's own list stores the 401");
    assert_eq!(up.hits("/hooks/strict"), 1);
}
