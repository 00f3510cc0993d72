//! `https://` upstreams against a real TLS server and a test CA: trust by
//! `ca_file`, SNI from the URL's host, ALPN for `protocol = "h2"`, a client
//! certificate for mTLS, and certificate errors as 502 problem+json with a
//! stable detail while the log names the cause.

use crate::support::tls_upstream::{CertFiles, TestCa, TlsUpstream, TlsUpstreamConfig};
use crate::support::{free_port, Backend, Proxy, Route, ServeProcess, TestConfig};
use std::path::Path;

const UNTRUSTED: &str = "the upstream's TLS certificate is not trusted";

fn path(p: &Path) -> String {
    p.display().to_string()
}

async fn upstream(server: &CertFiles, client_ca: Option<&Path>, alpn: &[&[u8]]) -> TlsUpstream {
    TlsUpstream::start(TlsUpstreamConfig {
        server,
        client_ca,
        alpn: alpn.iter().map(|p| p.to_vec()).collect(),
    })
    .await
}

/// A proxy whose default upstream is `https://localhost:PORT` trusting `ca`.
async fn proxy_to(up: &TlsUpstream, ca: &Path) -> Proxy {
    Proxy::builder(Backend::Memory, up.addr)
        .set(
            "server.upstream",
            format!("https://localhost:{}", up.addr.port()),
        )
        .set("server.upstream_ca_file", path(ca))
        .start()
        .await
}

#[tokio::test]
async fn an_https_upstream_signed_by_the_ca_file_is_reached_with_sni_from_the_url() {
    let ca = TestCa::new("a");
    let server = ca.leaf("server", &["localhost", "127.0.0.1"], false);
    let up = upstream(&server, None, &[]).await;
    let proxy = proxy_to(&up, &ca.ca_file()).await;

    let r = proxy.get("/hello").send().await;
    assert_eq!(r.status(), 200, "{}", r.text());
    assert_eq!(r.text(), "hello over tls");
    assert_eq!(r.header("x-tls-sni"), Some("localhost"));
    assert_eq!(r.header("x-tls-alpn"), Some(""), "http1: no ALPN offered");
    assert_eq!(r.header("x-http-version"), Some("HTTP/1.1"));
    assert_eq!(r.header("x-tls-client-cert"), Some("absent"));

    // Protected requests go the same way, and replay.
    let first = proxy.post("/orders").key("tls-1").body("{}").send().await;
    assert_eq!(first.status(), 200);
    let again = proxy.post("/orders").key("tls-1").body("{}").send().await;
    assert!(again.replayed());
}

#[tokio::test]
async fn a_named_h2_upstream_over_tls_negotiates_h2_by_alpn() {
    let ca = TestCa::new("h2");
    let server = ca.leaf("server", &["localhost"], false);
    let both = upstream(&server, None, &[b"h2", b"http/1.1"]).await;
    let h1_only = upstream(&server, None, &[b"http/1.1"]).await;
    let proxy = Proxy::builder(Backend::Memory, both.addr)
        .set(
            "upstreams.grpc.url",
            format!("https://localhost:{}", both.addr.port()),
        )
        .set("upstreams.grpc.protocol", "h2")
        .set("upstreams.grpc.ca_file", path(&ca.ca_file()))
        .set(
            "upstreams.legacy.url",
            format!("https://localhost:{}", h1_only.addr.port()),
        )
        .set("upstreams.legacy.protocol", "h2")
        .set("upstreams.legacy.ca_file", path(&ca.ca_file()))
        .routes(vec![
            Route::post("/grpc/*")
                .set("require_key", false)
                .set("upstream", "grpc"),
            Route::post("/legacy/*")
                .set("require_key", false)
                .set("upstream", "legacy"),
        ])
        .start()
        .await;

    let r = proxy.post("/grpc/x").body("m").send().await;
    assert_eq!(r.status(), 200, "{}", r.text());
    assert_eq!(r.header("x-tls-alpn"), Some("h2"));
    assert_eq!(r.header("x-http-version"), Some("HTTP/2.0"));

    // An upstream that only speaks HTTP/1.1 picks it; that works too.
    let r = proxy.post("/legacy/x").body("m").send().await;
    assert_eq!(r.status(), 200, "{}", r.text());
    assert_eq!(r.header("x-tls-alpn"), Some("http/1.1"));
    assert_eq!(r.header("x-http-version"), Some("HTTP/1.1"));
}

#[tokio::test]
async fn mtls_presents_the_client_certificate_and_without_one_the_upstream_refuses() {
    let ca = TestCa::new("server");
    let clients = TestCa::new("clients");
    let server = ca.leaf("server", &["localhost"], false);
    let client = clients.leaf("client", &["idemgate"], false);
    let up = upstream(&server, Some(&clients.ca_file()), &[]).await;
    let base = format!("https://localhost:{}", up.addr.port());
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.upstream", base.clone())
        .set("server.upstream_ca_file", path(&ca.ca_file()))
        .set("server.upstream_cert_file", path(&client.cert))
        .set("server.upstream_key_file", path(&client.key))
        .set("upstreams.anonymous.url", base)
        .set("upstreams.anonymous.ca_file", path(&ca.ca_file()))
        .routes(vec![Route::post("/anon/*")
            .set("methods", vec!["GET"])
            .set("require_key", false)
            .set("upstream", "anonymous")])
        .start()
        .await;

    let r = proxy.get("/with-cert").send().await;
    assert_eq!(r.status(), 200, "{}", r.text());
    assert_eq!(r.header("x-tls-client-cert"), Some("present"));

    let refused = proxy.get("/anon/x").send().await;
    let problem = refused.assert_problem(502);
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("#problem-upstream-tls"),
        "{problem}"
    );
    assert_eq!(
        problem["detail"], "the TLS handshake with the upstream failed",
        "{problem}"
    );
}

/// The real binary, so the log line can be read: one named upstream per
/// kind of bad certificate, each reached through its own route.
#[tokio::test]
async fn certificate_errors_are_502_with_one_stable_detail_and_the_log_names_each_cause() {
    let ca = TestCa::new("trusted");
    let stranger = TestCa::new("stranger");
    let unknown = stranger.leaf("unknown", &["localhost"], false);
    let mismatch = ca.leaf("mismatch", &["other.example"], false);
    let expired = ca.leaf("expired", &["localhost"], true);
    let good = ca.leaf("good", &["localhost"], false);
    let ups = [
        ("unknown", upstream(&unknown, None, &[]).await),
        ("mismatch", upstream(&mismatch, None, &[]).await),
        ("expired", upstream(&expired, None, &[]).await),
        ("good", upstream(&good, None, &[]).await),
    ];
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (listen, admin) = (free_port(), free_port());
    let mut config = TestConfig::new(ups[3].1.addr)
        .listen(listen, admin)
        .set("store.backend", "memory");
    for (name, up) in &ups {
        config = config
            .set(
                &format!("upstreams.{name}.url"),
                format!("https://localhost:{}", up.addr.port()),
            )
            .set(&format!("upstreams.{name}.ca_file"), path(&ca.ca_file()))
            .route(
                Route::post(&format!("/{name}"))
                    .set("methods", vec!["GET"])
                    .set("require_key", false)
                    .set("upstream", *name),
            );
    }
    let file = dir.path().join("idemgate.toml");
    config.write(&file);
    let serve = ServeProcess::start(&file, listen, admin, &[]).await;

    for (name, _) in &ups[..3] {
        let r = crate::support::Req::new(http::Method::GET, serve.url(&format!("/{name}")))
            .send()
            .await;
        let problem = r.assert_problem(502);
        assert_eq!(problem["detail"], UNTRUSTED, "{name}: {problem}");
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("#problem-upstream-tls"),
            "{problem}"
        );
    }
    let ok = crate::support::Req::new(http::Method::GET, serve.url("/good"))
        .send()
        .await;
    assert_eq!(ok.status(), 200, "{}", ok.text());

    let log = serve.log();
    for (name, cause) in [
        ("unknown", "unknown issuer"),
        ("mismatch", "name mismatch"),
        ("expired", "expired"),
    ] {
        let line = log
            .lines()
            .find(|l| l.contains("TLS handshake with the upstream failed") && l.contains(name))
            .unwrap_or_else(|| panic!("no TLS log line for {name}:\n{log}"));
        assert!(line.contains(cause), "{name}: {line}");
    }
}

#[tokio::test]
async fn the_system_roots_do_not_trust_a_private_ca() {
    let ca = TestCa::new("private");
    let server = ca.leaf("server", &["localhost"], false);
    let up = upstream(&server, None, &[]).await;
    // No ca_file: the system's roots, which do not know the test CA.
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set(
            "server.upstream",
            format!("https://localhost:{}", up.addr.port()),
        )
        .start()
        .await;
    let problem = proxy.get("/x").send().await.assert_problem(502);
    assert_eq!(problem["detail"], UNTRUSTED, "{problem}");
}

#[tokio::test]
async fn an_unreadable_ca_file_stops_the_start_naming_the_upstream_and_the_file() {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (listen, admin) = (free_port(), free_port());
    let missing = dir.path().join("missing-ca.pem");
    let config = TestConfig::new(listen)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .set("upstreams.orders.url", "https://localhost:1")
        .set("upstreams.orders.ca_file", path(&missing));
    let file = dir.path().join("idemgate.toml");
    config.write(&file);
    let run = crate::support::run_to_completion(&["serve", "--config", &path(&file)], &[]).await;
    assert_ne!(run.code, 0, "{run:?}");
    assert!(
        run.stderr.contains(&format!(
            "upstream orders (https://localhost:1/): ca_file {}",
            missing.display()
        )),
        "{}",
        run.stderr
    );
}

/// An upstream that accepts and never answers the TLS handshake fails
/// within `connect_timeout`, as a refused connect does (nothing was sent,
/// the key is released), not at the much longer request `timeout`.
#[tokio::test]
async fn a_silent_tls_handshake_fails_within_the_connect_timeout() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            open.push(conn);
        }
    });
    let ca = TestCa::new("silent");
    let proxy = Proxy::builder(Backend::Memory, addr)
        .set(
            "server.upstream",
            format!("https://localhost:{}", addr.port()),
        )
        .set("server.upstream_ca_file", path(&ca.ca_file()))
        .set("server.upstream_connect_timeout", "300ms")
        .set("server.upstream_timeout", "20s")
        .start()
        .await;
    let started = std::time::Instant::now();
    let r = proxy.post("/orders").key("silent-1").send().await;
    let problem = r.assert_problem(502);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "bounded by connect_timeout, not the 20s timeout: {:?}",
        started.elapsed()
    );
    assert!(
        problem["detail"].as_str().unwrap().contains("released"),
        "{problem}"
    );
    held.abort();
}
