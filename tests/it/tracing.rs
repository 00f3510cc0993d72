//! OpenTelemetry traces (feature `otel`), exported over OTLP/HTTP to a real
//! receiver on a local port (`support::otlp_receiver`), through the proxy
//! on a real socket, to the test upstream.

use crate::support::otlp_receiver::{OtlpReceiver, RecordedSpan};
use crate::support::{
    bounded, free_port, wait_until, Action, Backend, Proxy, Route, Upstream, ORDERS,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpListener;

/// A client's W3C trace context (sampled).
const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traceparent(trace: &str, span: &str, sampled: bool) -> String {
    format!("00-{trace}-{span}-{}", if sampled { "01" } else { "00" })
}

const SERVER: i32 = 2;
const CLIENT: i32 = 3;
/// `Status.code` in OTLP.
const ERROR: i32 = 2;

async fn start(receiver: &OtlpReceiver, up: &Upstream, ratio: f64) -> Proxy {
    Proxy::builder(Backend::Sqlite, up.addr)
        .set("tracing.otlp_endpoint", receiver.endpoint())
        .set("tracing.service_name", "idemgate-test")
        .set("tracing.sampling_ratio", ratio)
        .start()
        .await
}

fn children<'a>(spans: &'a [RecordedSpan], parent: &RecordedSpan) -> Vec<&'a RecordedSpan> {
    spans
        .iter()
        .filter(|s| s.trace_id == parent.trace_id && s.parent_span_id == parent.span_id)
        .collect()
}

#[tokio::test]
async fn a_protected_request_is_a_server_span_with_store_and_upstream_children_in_the_clients_trace(
) {
    let receiver = OtlpReceiver::start().await;
    let up = Upstream::start().await;
    let proxy = start(&receiver, &up, 1.0).await;
    let raw_key = "raw-key-5f1c9e-never-exported";
    let credential = "Bearer sk-trace-secret";

    let first = proxy
        .post(ORDERS)
        .key(raw_key)
        .header("authorization", credential)
        .header("traceparent", &traceparent(CLIENT_TRACE, CLIENT_SPAN, true))
        .body(r#"{"item":"book"}"#)
        .send()
        .await;
    assert_eq!(first.status(), 201);
    let retry = proxy
        .post(ORDERS)
        .key(raw_key)
        .header("authorization", credential)
        .body(r#"{"item":"book"}"#)
        .send()
        .await;
    assert_eq!(retry.status(), 201);
    assert!(retry.replayed());
    assert_eq!(up.hits(ORDERS), 1);
    // Shutting down flushes what is still queued.
    proxy.shutdown().await;

    let server = receiver
        .wait_for_span("the forwarded request's server span", |s| {
            s.kind == SERVER && s.attr("idemgate.outcome") == Some("forwarded")
        })
        .await;
    assert_eq!(server.service, "idemgate-test");
    assert_eq!(
        server.trace_id, CLIENT_TRACE,
        "continues the client's trace"
    );
    assert_eq!(server.parent_span_id, CLIENT_SPAN);
    assert_eq!(server.name, "POST /orders");
    assert_eq!(server.attr("http.route"), Some(ORDERS));
    assert_eq!(server.attr("http.request.method"), Some("POST"));
    assert_eq!(server.attr("http.response.status_code"), Some("201"));
    let key_id = server
        .attr("idemgate.key.id")
        .expect("a key id")
        .to_string();
    assert_eq!(key_id.len(), 16, "{key_id}");
    assert!(key_id.bytes().all(|b| b.is_ascii_hexdigit()), "{key_id}");

    let replay = receiver
        .wait_for_span("the replay's server span", |s| {
            s.kind == SERVER && s.attr("idemgate.outcome") == Some("replayed")
        })
        .await;
    assert_ne!(replay.trace_id, CLIENT_TRACE, "a trace of its own");
    assert_eq!(replay.attr("idemgate.key.id"), Some(key_id.as_str()));

    // Exported in the same final flush as the server spans, or before.
    let spans = receiver.spans();
    let under_first = children(&spans, &server);
    let names: Vec<&str> = under_first.iter().map(|s| s.name.as_str()).collect();
    for want in ["store claim", "upstream POST", "store complete"] {
        assert!(names.contains(&want), "{want} missing under {names:?}");
    }
    let upstream_span = under_first
        .iter()
        .find(|s| s.name == "upstream POST")
        .expect("upstream span");
    assert_eq!(upstream_span.kind, CLIENT);
    assert_eq!(upstream_span.attr("http.response.status_code"), Some("201"));
    let claim = under_first
        .iter()
        .find(|s| s.name == "store claim")
        .unwrap();
    assert_eq!(claim.attr("idemgate.store.op"), Some("claim"));

    // The upstream continued the same trace, under the upstream span.
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].headers["traceparent"],
        traceparent(CLIENT_TRACE, &upstream_span.span_id, true).as_str()
    );

    // The replay: claimed (found the record) and answered, never forwarded.
    let under_replay = children(&spans, &replay);
    assert!(
        under_replay.iter().any(|s| s.name == "store claim"),
        "{under_replay:?}"
    );
    assert!(
        !spans
            .iter()
            .any(|s| s.trace_id == replay.trace_id && s.kind == CLIENT),
        "a replay has no upstream span"
    );

    // Neither the key nor the credential is anywhere in what was exported.
    let bodies = receiver.bodies();
    assert!(!bodies.is_empty());
    for body in bodies {
        for secret in [raw_key, credential, "sk-trace-secret"] {
            assert!(
                !body.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "{secret:?} was exported"
            );
        }
    }
}

#[tokio::test]
async fn the_clients_sampling_decision_wins_and_unsampled_traces_still_reach_the_upstream() {
    let receiver = OtlpReceiver::start().await;
    let up = Upstream::start().await;
    // Traces started here are never sampled; a client's sampled one is.
    let proxy = start(&receiver, &up, 0.0).await;

    let sampled = proxy
        .get("/things/1")
        .header("traceparent", &traceparent(CLIENT_TRACE, CLIENT_SPAN, true))
        .send()
        .await;
    assert_eq!(sampled.status(), 200);
    let unsampled = proxy.get("/things/2").send().await;
    assert_eq!(unsampled.status(), 200);
    proxy.shutdown().await;

    let server = receiver
        .wait_for_span("the pass-through's server span", |s| s.kind == SERVER)
        .await;
    assert_eq!(server.trace_id, CLIENT_TRACE);
    assert_eq!(server.name, "GET");
    assert_eq!(server.attr("idemgate.outcome"), Some("passthrough"));
    assert_eq!(server.attr("http.route"), None, "unrouted");
    let spans = receiver.spans();
    let upstream_span = children(&spans, &server)
        .into_iter()
        .find(|s| s.kind == CLIENT)
        .expect("an upstream span");

    let seen = up.seen();
    let header = |i: usize| seen[i].headers["traceparent"].to_str().unwrap().to_string();
    assert_eq!(
        header(0),
        traceparent(CLIENT_TRACE, &upstream_span.span_id, true)
    );
    // Not recorded, but the upstream still gets a (new, unsampled) trace.
    let unsampled_parent = header(1);
    assert!(
        unsampled_parent.starts_with("00-") && unsampled_parent.ends_with("-00"),
        "{unsampled_parent}"
    );
    let unsampled_trace = &unsampled_parent[3..35];
    assert_ne!(unsampled_trace, CLIENT_TRACE);
    assert!(
        spans.iter().all(|s| s.trace_id != unsampled_trace),
        "an unsampled trace was exported"
    );
}

#[tokio::test]
async fn an_upstream_5xx_is_an_upstream_error_on_failed_spans() {
    let receiver = OtlpReceiver::start().await;
    let up = Upstream::start().await;
    let proxy = start(&receiver, &up, 1.0).await;
    up.push(Action::Status(503));
    let r = proxy.post(ORDERS).key("k-503").body("{}").send().await;
    assert_eq!(r.status(), 503);
    proxy.shutdown().await;

    let server = receiver
        .wait_for_span("the failed request's server span", |s| s.kind == SERVER)
        .await;
    assert_eq!(server.attr("idemgate.outcome"), Some("upstream_error"));
    assert_eq!(server.attr("http.response.status_code"), Some("503"));
    assert_eq!(server.status_code, ERROR);
    let spans = receiver.spans();
    let under = children(&spans, &server);
    let upstream_span = under
        .iter()
        .find(|s| s.kind == CLIENT)
        .expect("upstream span");
    assert_eq!(upstream_span.status_code, ERROR);
    // The key was released, not completed.
    let names: Vec<&str> = under.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"store release"), "{names:?}");
    assert!(!names.contains(&"store complete"), "{names:?}");
}

/// The outcome is the request's last: a forwarding route's pass-through
/// is recorded as `unguarded`, not `passthrough`.
#[tokio::test]
async fn a_store_outage_is_a_failed_claim_span_and_an_unguarded_forward_says_so() {
    let receiver = OtlpReceiver::start().await;
    let up = Upstream::start().await;
    // Nothing listens there: every store call is refused at once.
    let closed = free_port();
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&format!("postgres://postgres@{closed}/test"))
        .routes(vec![
            Route::post(ORDERS),
            Route::post("/webhooks").set("on_store_error", "forward"),
        ])
        .set("tracing.otlp_endpoint", receiver.endpoint())
        .start()
        .await;
    let refused = proxy.post(ORDERS).key("k-down").body("{}").send().await;
    assert_eq!(refused.status(), 503);
    let hook = proxy
        .post("/webhooks")
        .key("k-hook")
        .body("{}")
        .send()
        .await;
    assert_eq!(hook.status(), 200);
    proxy.shutdown().await;

    let rejected = receiver
        .wait_for_span("the refused request's span", |s| {
            s.kind == SERVER && s.attr("http.route") == Some(ORDERS)
        })
        .await;
    assert_eq!(rejected.attr("idemgate.outcome"), Some("store_error"));
    assert_eq!(rejected.status_code, ERROR);
    let spans = receiver.spans();
    let claim = children(&spans, &rejected)
        .into_iter()
        .find(|s| s.name == "store claim")
        .expect("a claim span");
    assert_eq!(claim.status_code, ERROR);
    assert!(children(&spans, &rejected).iter().all(|s| s.kind != CLIENT));

    let unguarded = receiver
        .wait_for_span("the unguarded request's span", |s| {
            s.kind == SERVER && s.attr("http.route") == Some("/webhooks")
        })
        .await;
    assert_eq!(unguarded.attr("idemgate.outcome"), Some("unguarded"));
    assert_eq!(unguarded.attr("http.response.status_code"), Some("200"));
    let spans = receiver.spans();
    assert!(children(&spans, &unguarded)
        .iter()
        .any(|s| s.kind == CLIENT));
}

/// Export runs beside the requests, never in their way: while an export
/// hangs on a collector that accepts and never answers, requests are
/// answered, and shutdown does not wait for it.
#[tokio::test]
async fn a_collector_that_never_answers_delays_no_request_nor_the_shutdown() {
    let silent = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let collector = silent.local_addr().expect("addr");
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
            count.fetch_add(1, Ordering::SeqCst);
        }
    });
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("tracing.otlp_endpoint", format!("http://{collector}"))
        .start()
        .await;
    let r = proxy.post(ORDERS).key("k-first").body("{}").send().await;
    assert_eq!(r.status(), 201);
    // The batch with that request's spans is on its way, and stuck.
    wait_until("an export to reach the silent collector", || {
        accepted.load(Ordering::SeqCst) > 0
    })
    .await;
    for i in 0..20 {
        let r = bounded(
            "a request while an export hangs",
            proxy.post(ORDERS).key(&format!("k-{i}")).body("{}").send(),
        )
        .await;
        assert_eq!(r.status(), 201);
    }
    bounded("the shutdown while an export hangs", proxy.shutdown()).await;
    hold.abort();
}

#[tokio::test]
async fn without_tracing_a_clients_traceparent_reaches_the_upstream_untouched() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    let sent = traceparent(CLIENT_TRACE, CLIENT_SPAN, true);
    let r = proxy
        .post(ORDERS)
        .key("k-untraced")
        .header("traceparent", &sent)
        .header("tracestate", "vendor=1")
        .body("{}")
        .send()
        .await;
    assert_eq!(r.status(), 201);
    let seen = up.last();
    assert_eq!(seen.headers["traceparent"], sent.as_str());
    assert_eq!(seen.headers["tracestate"], "vendor=1");
    proxy.shutdown().await;
}
