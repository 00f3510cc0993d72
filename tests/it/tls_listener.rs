//! TLS on the listener, through the real binary: HTTPS with TLS 1.2 and
//! 1.3 over HTTP/1.1 and h2 (ALPN), a protected request replayed over TLS,
//! certificate rotation (files renamed into place; a half-replaced pair
//! keeps the old one; open connections keep working), mTLS (no
//! certificate, another CA's, a valid one) and the `client_cert` scope,
//! config errors naming the file, and a stalled or garbage handshake that
//! holds only its own connection. The certificates are rcgen's, made per
//! test ([`TestCa`]); the client is tokio-rustls + hyper.

use crate::support::tls_upstream::{CertFiles, TestCa};
use crate::support::{
    bounded, free_port, run_on_config_text, run_to_completion, wait_for, Route, ServeProcess,
    TestConfig, Upstream, ORDERS,
};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::version::{TLS12, TLS13};
use rustls::{ClientConfig, ProtocolVersion, RootCertStore, SupportedProtocolVersion};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

const BODY: &str = r#"{"item":"book"}"#;

// ===== a TLS client =====

/// How the client connects.
struct Dial<'a> {
    ca: PathBuf,
    version: &'static SupportedProtocolVersion,
    alpn: &'static [u8],
    identity: Option<&'a CertFiles>,
}

impl<'a> Dial<'a> {
    fn new(ca: PathBuf) -> Self {
        Self {
            ca,
            version: &TLS13,
            alpn: b"http/1.1",
            identity: None,
        }
    }
}

async fn connect(addr: SocketAddr, dial: &Dial<'_>) -> std::io::Result<TlsStream<TcpStream>> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&dial.ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[dial.version])
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match dial.identity {
        None => builder.with_no_client_auth(),
        Some(id) => {
            let certs = CertificateDer::pem_file_iter(&id.cert)
                .unwrap()
                .map(Result::unwrap)
                .collect();
            let key = PrivateKeyDer::from_pem_file(&id.key).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
    };
    config.alpn_protocols = vec![dial.alpn.to_vec()];
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
}

/// What one request over TLS saw.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    version: Option<ProtocolVersion>,
    alpn: Option<Vec<u8>>,
    /// The server's certificate (DER).
    cert: Vec<u8>,
}

/// A connection that sends one request after another (HTTP/1.1 or h2, by
/// what ALPN chose).
enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

struct Conn {
    sender: Sender,
    version: Option<ProtocolVersion>,
    alpn: Option<Vec<u8>>,
    cert: Vec<u8>,
}

impl Conn {
    async fn open(addr: SocketAddr, dial: &Dial<'_>) -> std::io::Result<Self> {
        let tls = connect(addr, dial).await?;
        let (_, session) = tls.get_ref();
        let version = session.protocol_version();
        let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
        let cert = session.peer_certificates().unwrap()[0].to_vec();
        let io = TokioIo::new(tls);
        let sender = if alpn.as_deref() == Some(b"h2") {
            let (s, c) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(c);
            Sender::H2(s)
        } else {
            let (s, c) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(c);
            Sender::H1(s)
        };
        Ok(Self {
            sender,
            version,
            alpn,
            cert,
        })
    }

    async fn post(&mut self, path: &str, key: &str) -> Result<Answer, hyper::Error> {
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("https://localhost{path}"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))
            .unwrap();
        let resp = match &mut self.sender {
            Sender::H1(s) => {
                s.ready().await?;
                s.send_request(req).await?
            }
            Sender::H2(s) => {
                s.ready().await?;
                s.send_request(req).await?
            }
        };
        let status = resp.status();
        let replayed = resp.headers().contains_key("idempotent-replayed");
        resp.into_body().collect().await?;
        Ok(Answer {
            status,
            replayed,
            version: self.version,
            alpn: self.alpn.clone(),
            cert: self.cert.clone(),
        })
    }
}

/// One request on a new connection; `Err` when the handshake or the
/// request failed.
async fn post(addr: SocketAddr, dial: &Dial<'_>, key: &str) -> Result<Answer, String> {
    let mut conn = Conn::open(addr, dial).await.map_err(|e| e.to_string())?;
    conn.post(ORDERS, key).await.map_err(|e| format!("{e:?}"))
}

fn der(cert: &Path) -> Vec<u8> {
    CertificateDer::from_pem_file(cert).unwrap().to_vec()
}

// ===== the proxy =====

fn tls_config(
    up: &Upstream,
    server: &CertFiles,
    listen: SocketAddr,
    admin: SocketAddr,
) -> TestConfig {
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .set("server.tls_cert_file", server.cert.display().to_string())
        .set("server.tls_key_file", server.key.display().to_string())
        .route(Route::post(ORDERS))
}

async fn start(config: TestConfig, dir: &Path) -> ServeProcess {
    let path = dir.join("idemgate.toml");
    config.write(&path);
    let (listen, admin) = (
        config_addr(&config, "server"),
        config_addr(&config, "admin"),
    );
    ServeProcess::start(&path, listen, admin, &[]).await
}

fn config_addr(config: &TestConfig, section: &str) -> SocketAddr {
    let table: toml::Table = toml::from_str(&config.render()).unwrap();
    table[section]["listen"].as_str().unwrap().parse().unwrap()
}

/// Writes `from`'s bytes to `to` as a rename does: a new file takes the name.
fn rename_into_place(from: &Path, to: &Path) {
    let tmp = to.with_extension("tmp");
    std::fs::copy(from, &tmp).unwrap();
    std::fs::rename(&tmp, to).unwrap();
}

#[tokio::test]
async fn https_with_tls_1_2_and_1_3_over_h1_and_h2_and_a_replay() {
    let ca = TestCa::new("listener");
    let server = ca.leaf("server", &["localhost"], false);
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port(), free_port());
    let gate = start(tls_config(&up, &server, listen, admin), dir.path()).await;

    let mut keys = 0;
    for (version, name) in [
        (&TLS12, ProtocolVersion::TLSv1_2),
        (&TLS13, ProtocolVersion::TLSv1_3),
    ] {
        for alpn in [&b"h2"[..], b"http/1.1"] {
            let dial = Dial {
                version,
                alpn: if alpn == b"h2" { b"h2" } else { b"http/1.1" },
                ..Dial::new(ca.ca_file())
            };
            let key = format!("tls-{name:?}-{}", String::from_utf8_lossy(alpn));
            let first = post(listen, &dial, &key).await.unwrap();
            assert_eq!(first.status, StatusCode::CREATED, "{key}");
            assert_eq!(first.version, Some(name), "{key}");
            assert_eq!(first.alpn.as_deref(), Some(alpn), "{key}");
            assert!(!first.replayed, "{key}");
            assert_eq!(up.last().headers["x-forwarded-proto"], "https", "{key}");
            // The same key on another connection: replayed, not run again.
            let again = post(listen, &dial, &key).await.unwrap();
            assert!(again.replayed, "{key}: {again:?}");
            keys += 1;
            assert_eq!(up.hits(ORDERS), keys, "{key}: the upstream ran it once");
        }
    }

    // Plain HTTP on the TLS port gets no HTTP answer.
    let mut tcp = TcpStream::connect(listen).await.unwrap();
    tcp.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = bounded("the plain request is closed", tcp.read_to_end(&mut buf)).await;
    assert!(
        !buf.starts_with(b"HTTP/"),
        "{:?}",
        String::from_utf8_lossy(&buf)
    );
    assert_eq!(up.hits(ORDERS), keys);
    // The admin listener stays plain HTTP without admin.tls_*.
    assert_eq!(gate.admin_get("/healthz").send().await.status, 200);
}

#[tokio::test]
async fn the_admin_listener_serves_its_own_certificate_over_http1() {
    let ca = TestCa::new("admin");
    let server = ca.leaf("server", &["localhost"], false);
    let admin_pair = ca.leaf("admin", &["localhost"], false);
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port(), free_port());
    let config = tls_config(&up, &server, listen, admin)
        .set("admin.tls_cert_file", admin_pair.cert.display().to_string())
        .set("admin.tls_key_file", admin_pair.key.display().to_string());
    let _gate = start(config, dir.path()).await;
    let dial = Dial {
        alpn: b"h2",
        ..Dial::new(ca.ca_file())
    };
    // h2 is not offered: the admin speaks HTTP/1 only (a client that
    // offers only h2 gets no protocol it asked for).
    if let Ok(tls) = connect(admin, &dial).await {
        assert_eq!(tls.get_ref().1.alpn_protocol(), None);
    }
    let dial = Dial::new(ca.ca_file());
    let mut conn = Conn::open(admin, &dial).await.unwrap();
    assert_eq!(conn.cert, der(&admin_pair.cert));
    let Sender::H1(s) = &mut conn.sender else {
        panic!("admin over h2")
    };
    let resp = s
        .send_request(
            Request::get("/healthz")
                .header("host", "localhost")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);

    // `idemgate reload` asks it over TLS.
    let path = dir.path().join("idemgate.toml");
    let path = path.display().to_string();
    let run = run_to_completion(&["reload", "--config", &path], &[]).await;
    assert_eq!(run.code, 0, "{run:?}");
}

#[tokio::test]
async fn a_rotated_pair_is_served_within_seconds_and_a_half_replaced_one_never() {
    let ca = TestCa::new("rotation");
    let old = ca.leaf("old", &["localhost"], false);
    let new = ca.leaf("new", &["localhost"], false);
    let dir = tempfile::tempdir().unwrap();
    // The files the config names; the pairs are renamed into them.
    let live = CertFiles {
        cert: dir.path().join("tls.crt"),
        key: dir.path().join("tls.key"),
    };
    rename_into_place(&old.cert, &live.cert);
    rename_into_place(&old.key, &live.key);
    let up = Upstream::start().await;
    let (listen, admin) = (free_port(), free_port());
    let gate = start(tls_config(&up, &live, listen, admin), dir.path()).await;
    let dial = Dial::new(ca.ca_file());
    let mut kept = Conn::open(listen, &dial).await.unwrap();
    assert_eq!(kept.post(ORDERS, "r-1").await.unwrap().cert, der(&old.cert));

    // Half-replaced: the new certificate beside the old key. The old pair
    // keeps serving (no failed handshake), and the state is logged once.
    rename_into_place(&new.cert, &live.cert);
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let during = post(listen, &dial, "r-2").await.unwrap();
    assert_eq!(
        during.cert,
        der(&old.cert),
        "the old pair while half-replaced"
    );
    let warnings = gate
        .log()
        .matches("new listener certificate or key not usable")
        .count();
    assert_eq!(warnings, 1, "logged once:\n{}", gate.log());
    assert!(
        gate.log().contains("tls.key"),
        "names the key file:\n{}",
        gate.log()
    );
    assert!(!gate.log().contains("PRIVATE KEY"), "{}", gate.log());

    // The key follows: the new pair is served within a few seconds.
    rename_into_place(&new.key, &live.key);
    wait_for("the new certificate to be served", || async {
        let a = post(listen, &dial, "r-3").await.ok()?;
        (a.cert == der(&new.cert)).then_some(())
    })
    .await;
    // The connection opened before keeps working, on its session.
    let on_kept = kept.post(ORDERS, "r-4").await.unwrap();
    assert_eq!(
        (on_kept.status, on_kept.cert),
        (StatusCode::CREATED, der(&old.cert))
    );

    // Back to the old pair, replaced by SIGHUP's reload as well.
    rename_into_place(&old.cert, &live.cert);
    rename_into_place(&old.key, &live.key);
    gate.hangup();
    wait_for("the old certificate again", || async {
        let a = post(listen, &dial, "r-5").await.ok()?;
        (a.cert == der(&old.cert)).then_some(())
    })
    .await;

    // A key file removed: the pair keeps serving, logged once.
    std::fs::remove_file(&live.key).unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let without = post(listen, &dial, "r-6").await.unwrap();
    assert_eq!(without.cert, der(&old.cert));
    let unreadable = gate
        .log()
        .matches("listener certificate files not readable")
        .count();
    assert_eq!(unreadable, 1, "logged once:\n{}", gate.log());
}

#[tokio::test]
async fn mtls_refuses_clients_without_a_certificate_of_the_ca_and_scopes_keys_by_certificate() {
    let ca = TestCa::new("server");
    let server = ca.leaf("server", &["localhost"], false);
    let clients = TestCa::new("clients");
    let alice = clients.leaf("alice", &["alice"], false);
    let bob = clients.leaf("bob", &["bob"], false);
    let other = TestCa::new("other");
    let stranger = other.leaf("mallory", &["mallory"], false);
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port(), free_port());
    let config = TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "sqlite")
        .set(
            "store.path",
            dir.path().join("keys.db").display().to_string(),
        )
        .set("server.tls_cert_file", server.cert.display().to_string())
        .set("server.tls_key_file", server.key.display().to_string())
        .set(
            "server.tls_client_ca_file",
            clients.ca_file().display().to_string(),
        )
        .route(Route::post(ORDERS).set(
            "scope",
            toml::Table::from_iter([("client_cert".to_string(), toml::Value::Boolean(true))]),
        ));
    let _gate = start(config, dir.path()).await;

    let ca_file = ca.ca_file();
    let as_who = |identity| Dial {
        identity,
        ..Dial::new(ca_file.clone())
    };
    for (who, identity) in [
        ("no certificate", None),
        ("another CA's certificate", Some(&stranger)),
    ] {
        for version in [&TLS12, &TLS13] {
            let dial = Dial {
                version,
                ..as_who(identity)
            };
            let r = post(listen, &dial, "m-1").await;
            assert!(r.is_err(), "{who} ({version:?}) was served: {r:?}");
        }
    }
    assert_eq!(up.hits(ORDERS), 0);

    // Alice's key and Bob's same key are separate records.
    let first = post(listen, &as_who(Some(&alice)), "m-1").await.unwrap();
    assert_eq!((first.status, first.replayed), (StatusCode::CREATED, false));
    let again = post(listen, &as_who(Some(&alice)), "m-1").await.unwrap();
    assert!(again.replayed, "{again:?}");
    assert_eq!(up.hits(ORDERS), 1);
    let bobs = post(listen, &as_who(Some(&bob)), "m-1").await.unwrap();
    assert_eq!((bobs.status, bobs.replayed), (StatusCode::CREATED, false));
    assert_eq!(up.hits(ORDERS), 2, "Bob's key is not Alice's");
    let over_tls12 = Dial {
        version: &TLS12,
        ..as_who(Some(&bob))
    };
    assert!(post(listen, &over_tls12, "m-1").await.unwrap().replayed);

    // `keys show --client-cert FILE` names the scope of that certificate.
    let path = dir.path().join("idemgate.toml").display().to_string();
    for (who, cert, code) in [
        ("alice", &alice, 0),
        ("bob", &bob, 0),
        ("mallory", &stranger, 3),
    ] {
        let cert = cert.cert.display().to_string();
        let args = [
            "keys",
            "--config",
            &path,
            "show",
            "--client-cert",
            &cert,
            "m-1",
        ];
        let run = run_to_completion(&args, &[]).await;
        assert_eq!(run.code, code, "{who}: {run:?}");
    }
}

#[tokio::test]
async fn bad_listener_files_are_config_errors_naming_the_file() {
    let ca = TestCa::new("errors");
    let a = ca.leaf("a", &["localhost"], false);
    let b = ca.leaf("b", &["localhost"], false);
    let text = |cert: &Path, key: &Path| {
        format!(
            "[server]\nupstream = \"http://127.0.0.1:1\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n[store]\nbackend = \"memory\"\n",
            cert.display(),
            key.display()
        )
    };
    let missing = a.key.with_file_name("missing-key.pem");
    let key_pem = std::fs::read_to_string(&a.key).unwrap();
    let key_line = key_pem.lines().nth(1).unwrap().to_string();
    for (cert, key, needles) in [
        (
            &a.cert,
            &missing,
            vec![format!("server.tls_key_file {}: ", missing.display())],
        ),
        (
            &a.cert,
            &b.key,
            vec![format!(
                "server.tls_key_file {}: not the private key of the certificate in {}",
                b.key.display(),
                a.cert.display()
            )],
        ),
        // A key where the certificate should be.
        (
            &a.key,
            &a.key,
            vec![format!(
                "server.tls_cert_file {}: no PEM certificate",
                a.key.display()
            )],
        ),
    ] {
        for command in ["check-config", "serve"] {
            let (run, _) = run_on_config_text(&[command], &text(cert, key), &[]).await;
            assert_eq!(run.code, 64, "{command}: {run:?}");
            for needle in &needles {
                assert!(
                    run.stderr.contains(needle.as_str()),
                    "{command}: {needle:?} not in {}",
                    run.stderr
                );
            }
            assert!(
                !run.stderr.contains(&key_line),
                "key material printed: {}",
                run.stderr
            );
        }
    }
    let (ok, _) = run_on_config_text(&["check-config"], &text(&a.cert, &a.key), &[]).await;
    assert_eq!(ok.code, 0, "{ok:?}");
    assert!(ok.stdout.contains("tls        cert "), "{}", ok.stdout);
}

#[tokio::test]
async fn a_stalled_or_garbage_handshake_holds_only_its_own_connection() {
    let ca = TestCa::new("slow");
    let server = ca.leaf("server", &["localhost"], false);
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port(), free_port());
    let config = tls_config(&up, &server, listen, admin)
        .set("server.header_read_timeout", "1s")
        .set("server.max_connections", 8);
    let _gate = start(config, dir.path()).await;

    // Silent clients, one that sends half a ClientHello, one that sends garbage.
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(TcpStream::connect(listen).await.unwrap());
    }
    let mut partial = TcpStream::connect(listen).await.unwrap();
    partial
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .unwrap();
    let mut garbage = TcpStream::connect(listen).await.unwrap();
    garbage.write_all(&[0xde; 64]).await.unwrap();

    let dial = Dial::new(ca.ca_file());
    let served = tokio::time::timeout(Duration::from_secs(2), post(listen, &dial, "s-1"))
        .await
        .expect("a client behind stalled handshakes waits");
    assert_eq!(served.unwrap().status, StatusCode::CREATED);

    // Each stalled one is closed by the handshake deadline.
    stalled.push(partial);
    stalled.push(garbage);
    for mut s in stalled {
        let mut buf = [0u8; 256];
        let closed = tokio::time::timeout(Duration::from_secs(4), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => continue,
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a stalled handshake was not closed");
    }
}

/// A Kubernetes Secret volume: `tls.crt -> ..data/tls.crt`, and an update
/// swaps the `..data` symlink to a new timestamped directory at once.
#[tokio::test]
async fn a_kubernetes_secret_update_swapping_the_data_symlink_is_served() {
    use std::os::unix::fs::symlink;
    let ca = TestCa::new("secret");
    let old = ca.leaf("old", &["localhost"], false);
    let new = ca.leaf("new", &["localhost"], false);
    let volume = tempfile::tempdir().unwrap();
    let v = volume.path();
    let version = |name: &str, pair: &CertFiles| {
        std::fs::create_dir(v.join(name)).unwrap();
        std::fs::copy(&pair.cert, v.join(name).join("tls.crt")).unwrap();
        std::fs::copy(&pair.key, v.join(name).join("tls.key")).unwrap();
    };
    version("..2026_12_04_old", &old);
    symlink("..2026_12_04_old", v.join("..data")).unwrap();
    symlink("..data/tls.crt", v.join("tls.crt")).unwrap();
    symlink("..data/tls.key", v.join("tls.key")).unwrap();
    let live = CertFiles {
        cert: v.join("tls.crt"),
        key: v.join("tls.key"),
    };
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port(), free_port());
    let _gate = start(tls_config(&up, &live, listen, admin), dir.path()).await;
    let dial = Dial::new(ca.ca_file());
    assert_eq!(
        post(listen, &dial, "k-1").await.unwrap().cert,
        der(&old.cert)
    );

    version("..2026_12_04_new", &new);
    symlink("..2026_12_04_new", v.join("..data_tmp")).unwrap();
    std::fs::rename(v.join("..data_tmp"), v.join("..data")).unwrap();
    wait_for("the new certificate to be served", || async {
        let a = post(listen, &dial, "k-2").await.ok()?;
        (a.cert == der(&new.cert)).then_some(())
    })
    .await;
}
