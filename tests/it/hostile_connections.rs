//! Hostile clients at the connection level, through the real server: each
//! case with the answer it must get. None may crash the proxy, hang it,
//! forward a protected request that never arrived whole, or keep memory.
//!
//! Malformed traffic goes over raw `TcpStream`s; HTTP/2 floods are written
//! frame by frame ([`h2raw`]) so they can break the rules a well-behaved
//! client library would keep (stream limits, resets before any answer).

use crate::support::{
    bounded, free_port, metric_value, Backend, Proxy, ServeProcess, TestConfig, Upstream, ORDERS,
};
use bytes::Bytes;
use http_body_util::StreamBody;
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::body::{boxed, BoxError};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The first bytes of the HTTP/2 connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A proxy that shuts anyone out with four silent sockets if nothing times
/// them out: the setting the attack used.
async fn small_proxy(up: &Upstream, extra: &[(&str, &str)]) -> Proxy {
    let mut b = Proxy::builder(Backend::Memory, up.addr)
        .set("server.max_connections", 4)
        .set("server.header_read_timeout", "1s");
    for (k, v) in extra {
        b = b.set(k, *v);
    }
    b.start().await
}

/// Reads and discards until the peer closes; how long that took, or `None`
/// when it was still open after `limit`.
async fn time_to_close(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(limit, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    closed.ok().map(|()| started.elapsed())
}

/// A plain request on a fresh connection gets its answer.
async fn served(proxy: &Proxy) {
    let resp = proxy.get("/health").send().await;
    assert_eq!(resp.status(), 200, "a normal client is served");
}

/// Pins issue 9 defect 1: sockets that connect and send nothing, one byte,
/// a partial HTTP/2 preface or a preface without a request held a
/// connection slot forever (protocol detection and the h2 handshake ran
/// before any timer). Four of them shut every other client out of a
/// `max_connections = 4` proxy; now each closes at `header_read_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_trickling_sockets_are_closed_at_the_head_deadline() {
    let up = Upstream::start().await;
    let proxy = small_proxy(&up, &[]).await;
    let mut preface_and_settings = H2_PREFACE.to_vec();
    preface_and_settings.extend(h2raw::settings());
    let openings: [(&str, &[u8]); 6] = [
        ("nothing", b""),
        ("one byte of the h2 preface", b"P"),
        ("one byte of an HTTP/1 method", b"G"),
        ("a partial h2 preface", &H2_PREFACE[..18]),
        (
            "an HTTP/1 head without its end",
            b"GET / HTTP/1.1\r\nHost: x\r\n",
        ),
        (
            "the h2 preface and SETTINGS, no request",
            &preface_and_settings,
        ),
    ];
    for (what, opening) in openings {
        let mut sockets = Vec::new();
        for _ in 0..4 {
            let mut s = TcpStream::connect(proxy.addr).await.expect("connect");
            s.write_all(opening).await.expect("write");
            sockets.push(s);
        }
        for s in &mut sockets {
            let lived = time_to_close(s, Duration::from_secs(5)).await;
            eprintln!("{what}: closed after {lived:?}");
            let lived = lived.unwrap_or_else(|| panic!("{what}: still open after 5 s"));
            assert!(lived < Duration::from_secs(3), "{what}: lived {lived:?}");
        }
        served(&proxy).await;
    }
}

/// Pins issue 9 defect 1 (idle keep-alive): a connection with no request
/// in progress closes after `idle_timeout`, over HTTP/1.1 between requests
/// and over HTTP/2 with no open stream (after a GOAWAY).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_are_closed() {
    let up = Upstream::start().await;
    let proxy = small_proxy(
        &up,
        &[
            ("server.header_read_timeout", "10s"),
            ("server.idle_timeout", "1s"),
        ],
    )
    .await;

    let mut h1 = TcpStream::connect(proxy.addr).await.expect("connect");
    h1.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut head = [0u8; 12];
    h1.read_exact(&mut head).await.expect("a response");
    assert_eq!(&head, b"HTTP/1.1 200");
    let lived = time_to_close(&mut h1, Duration::from_secs(5)).await;
    eprintln!("idle HTTP/1.1 keep-alive: closed after {lived:?}");
    assert!(
        lived.is_some_and(|d| d < Duration::from_secs(3)),
        "{lived:?}"
    );

    let mut h2 = h2raw::Conn::open(proxy.addr).await;
    h2.send(&h2raw::headers(1, "GET", "/health", &[], true))
        .await;
    let mut answered = false;
    let mut goaway = None;
    let started = Instant::now();
    while let Some(f) = h2.next_frame(Duration::from_secs(5)).await {
        answered |= f.kind == h2raw::HEADERS && f.stream == 1;
        if f.kind == h2raw::GOAWAY {
            goaway = Some(f.goaway_code());
        }
    }
    let lived = started.elapsed();
    eprintln!("idle h2: goaway {goaway:?}, closed after {lived:?}");
    assert!(answered, "the h2 request was answered");
    assert_eq!(goaway, Some(0), "GOAWAY NO_ERROR before closing");
    assert!(lived < Duration::from_secs(4), "{lived:?}");
    served(&proxy).await;
}

/// A flood of connections past `max_connections`: silent ones hold the
/// slots until their deadline, then everyone queued behind them is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_flood_past_max_connections_is_served_as_slots_free() {
    let up = Upstream::start().await;
    let proxy = small_proxy(&up, &[]).await;
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(TcpStream::connect(proxy.addr).await.expect("connect"));
    }
    let started = Instant::now();
    let clients: Vec<_> = (0..12)
        .map(|_| tokio::spawn(proxy.get("/health").send()))
        .collect();
    for c in clients {
        assert_eq!(c.await.expect("client task").status(), 200);
    }
    eprintln!(
        "12 clients behind 8 silent sockets served in {:?}",
        started.elapsed()
    );
    assert!(started.elapsed() < Duration::from_secs(8));
}

/// An h2c client that ignores SETTINGS_MAX_CONCURRENT_STREAMS: the streams
/// past `h2_max_concurrent_streams` are refused (RST_STREAM
/// REFUSED_STREAM), and none of the unfinished protected requests is
/// forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_stream_flood_beyond_the_limit_is_refused() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.h2_max_concurrent_streams", 10)
        .start()
        .await;
    let mut h2 = h2raw::Conn::open(proxy.addr).await;
    let mut flood = Vec::new();
    for i in 0..30u32 {
        let key = format!("flood-{i}");
        flood.extend(h2raw::headers(
            2 * i + 1,
            "POST",
            ORDERS,
            &[("idempotency-key", &key), ("content-length", "100")],
            false,
        ));
    }
    h2.send(&flood).await;
    let mut refused = 0;
    while let Some(f) = h2.next_frame(Duration::from_secs(1)).await {
        if f.kind == h2raw::RST_STREAM && f.rst_code() == h2raw::REFUSED_STREAM {
            refused += 1;
        }
    }
    assert_eq!(refused, 20, "the 20 streams past the limit are refused");
    drop(h2);
    assert_eq!(up.total_hits(), 0, "no unfinished request was forwarded");
    served(&proxy).await;
}

/// HTTP/2 rapid reset (CVE-2023-44487): streams opened and reset at once,
/// thousands in a row. The proxy answers GOAWAY ENHANCE_YOUR_CALM and
/// closes the connection; nothing is forwarded; others are still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2_rapid_reset_flood_is_cut_off() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    let mut h2 = h2raw::Conn::open(proxy.addr).await;
    let mut flood = Vec::new();
    for i in 0..2000u32 {
        let stream = 2 * i + 1;
        let key = format!("reset-{i}");
        flood.extend(h2raw::headers(
            stream,
            "POST",
            ORDERS,
            &[("idempotency-key", &key), ("content-length", "10")],
            false,
        ));
        flood.extend(h2raw::rst_stream(stream, h2raw::CANCEL));
    }
    // The proxy may close before reading it all.
    let _ = h2.stream.write_all(&flood).await;
    let mut goaway = None;
    while let Some(f) = h2.next_frame(Duration::from_secs(5)).await {
        if f.kind == h2raw::GOAWAY {
            goaway = Some(f.goaway_code());
        }
    }
    assert_eq!(
        goaway,
        Some(h2raw::ENHANCE_YOUR_CALM),
        "GOAWAY ENHANCE_YOUR_CALM"
    );
    assert_eq!(up.total_hits(), 0, "no reset request was forwarded");
    served(&proxy).await;
}

/// A header section past hyper's limits is answered 431, not left hanging:
/// too many fields, and one field larger than the read buffer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_header_sections_get_431() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;

    let mut many = String::from("GET /health HTTP/1.1\r\nHost: x\r\n");
    for i in 0..200 {
        many.push_str(&format!("x-h{i}: v\r\n"));
    }
    many.push_str("\r\n");
    let mut s = TcpStream::connect(proxy.addr).await.expect("connect");
    s.write_all(many.as_bytes()).await.expect("write");
    let answer = read_head(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");

    let s = TcpStream::connect(proxy.addr).await.expect("connect");
    let (mut r, mut w) = s.into_split();
    let writer = tokio::spawn(async move {
        let _ = w
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            .await;
        let chunk = vec![b'a'; 64 << 10];
        for _ in 0..32 {
            if w.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut buf = Vec::new();
    let _ = bounded("the answer to a 2 MiB header", r.read_to_end(&mut buf)).await;
    let answer = String::from_utf8_lossy(&buf);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    writer.abort();
    assert_eq!(up.total_hits(), 0);
    served(&proxy).await;
}

async fn read_head(s: &mut TcpStream) -> String {
    let mut buf = vec![0u8; 1024];
    let n = bounded("a response head", s.read(&mut buf))
        .await
        .expect("read");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

// ===== the body budget =====

/// A protected POST that declares `declared` bytes, sends `sent` of them
/// and stalls; resolves to the response head's first line, or `None` when
/// no answer came within `wait`.
pub(crate) async fn stalled_post(
    addr: SocketAddr,
    key: String,
    declared: usize,
    sent: usize,
    wait: Duration,
) -> (Option<String>, TcpStream) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST {ORDERS} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\nContent-Length: {declared}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.expect("write head");
    let (mut r, mut w) = s.into_split();
    let body = vec![b'x'; sent];
    let writer = tokio::spawn(async move {
        let _ = w.write_all(&body).await;
        w
    });
    let mut buf = vec![0u8; 4096];
    let answer = match tokio::time::timeout(wait, r.read(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => Some(String::from_utf8_lossy(&buf[..n]).into_owned()),
        _ => None,
    };
    let w = writer.await.expect("writer");
    (answer, r.reunite(w).expect("same stream"))
}

/// Pins issue 9 defect 2: stalled protected bodies were buffered without a
/// global bound. With `max_buffered_body_bytes = 4MiB`, four 1 MiB bodies
/// are being read; every further one is refused 503 + Retry-After
/// (problem+json) without being buffered, counted in
/// `idemgate_body_budget_refusals_total`; nothing is forwarded, and the
/// budget is free again once the clients leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_protected_bodies_past_the_budget_are_refused() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.max_buffered_body_bytes", "4MiB")
        .admin()
        .start()
        .await;
    let clients: Vec<_> = (0..12)
        .map(|i| {
            tokio::spawn(stalled_post(
                proxy.addr,
                format!("stall-{i}"),
                1 << 20,
                600 << 10,
                Duration::from_secs(5),
            ))
        })
        .collect();
    let mut refused = 0;
    let mut reading = Vec::new();
    for c in clients {
        let (answer, stream) = c.await.expect("client");
        match answer {
            Some(a) => {
                assert!(a.starts_with("HTTP/1.1 503"), "{a}");
                assert!(a.to_ascii_lowercase().contains("retry-after: 1"), "{a}");
                assert!(a.contains("application/problem+json"), "{a}");
                assert!(a.contains("#problem-overloaded"), "{a}");
                refused += 1;
            }
            None => reading.push(stream),
        }
    }
    assert_eq!(refused, 8, "past the budget: refused");
    assert_eq!(reading.len(), 4, "within the budget: being read");
    let metrics = proxy.admin_get("/metrics").send().await.text();
    assert_eq!(
        metric_value(&metrics, "idemgate_body_budget_refusals_total"),
        8,
        "{metrics}"
    );
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");

    drop(reading);
    crate::support::wait_for("the budget to be released", || async {
        let m = proxy.admin_get("/metrics").send().await.text();
        (metric_value(&m, "idemgate_buffered_body_bytes") == 0).then_some(())
    })
    .await;
    let resp = proxy.post(ORDERS).key("after").body("{}").send().await;
    assert_eq!(resp.status(), 201, "the budget is free again");
}

/// The same over one h2c connection: its streams share the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_h2_streams_past_the_budget_are_refused() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.max_buffered_body_bytes", "4MiB")
        .start()
        .await;
    let stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("h2 handshake");
    let conn = tokio::spawn(conn);
    let requests: Vec<_> = (0..12)
        .map(|i| {
            let mut sender = sender.clone();
            let part = Bytes::from(vec![b'x'; 600 << 10]);
            let frames = futures_util::StreamExt::chain(
                futures_util::stream::iter([Ok::<_, BoxError>(Frame::data(part))]),
                futures_util::stream::pending(),
            );
            let req = http::Request::post(format!("http://{}{ORDERS}", proxy.addr))
                .header("idempotency-key", format!("h2-stall-{i}"))
                .header("content-length", 1 << 20)
                .body(boxed(StreamBody::new(frames)))
                .expect("request");
            tokio::spawn(async move {
                let resp =
                    tokio::time::timeout(Duration::from_secs(5), sender.send_request(req)).await;
                match resp {
                    Ok(Ok(resp)) => Some(resp.status().as_u16()),
                    _ => None,
                }
            })
        })
        .collect();
    let mut refused = 0;
    let mut pending = 0;
    for r in requests {
        match r.await.expect("request task") {
            Some(503) => refused += 1,
            None => pending += 1,
            Some(other) => panic!("unexpected {other}"),
        }
    }
    assert_eq!((refused, pending), (8, 4));
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");
    conn.abort();
    drop(sender);
    crate::support::wait_until("the budget to be released", || {
        metric_value(&proxy.metrics.encode(), "idemgate_buffered_body_bytes") == 0
    })
    .await;
    let resp = proxy.post(ORDERS).key("after").body("{}").send().await;
    assert_eq!(resp.status(), 201);
}

// ===== bounded memory =====

/// Resident memory of `pid` in KiB (`VmRSS` in /proc/<pid>/status).
pub(crate) fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc status")
}

/// What the proxy may hold on top of `max_buffered_body_bytes` under the
/// flood below: per-connection buffers (hyper's read and write buffers,
/// the task, the socket's state: up to 80 KiB each, 16 MiB for 200
/// connections), and the allocator's slack. Repeated floods settle where
/// the allocator keeps its peak: measured over nine floods in a row at
/// budget + 15-33 MiB on 2026-12-04's main and on the commit before it
/// alike, so 32 was a coin toss (CI failed at +33). A leak of one
/// flood's bodies (28 MiB) per flood still exceeds this by the third.
/// docs/book/src/operations.md ("Memory") documents the same number.
const RSS_SLACK_MIB: u64 = 48;

/// What the allocator may keep for reuse after a flood has gone (freed,
/// not returned to the system): measured at 11-25 MiB, varying with how
/// the freed buffers fragment the allocator's arenas.
const RSS_RESIDUE_MIB: u64 = 40;

/// Pins issue 9 defect 2 (bounded memory): 200 clients each sending most of
/// a 1 MiB protected body and stalling grew the proxy from 9 MiB to
/// 319 MiB. Now its RSS stays within `max_buffered_body_bytes` plus
/// [`RSS_SLACK_MIB`], falls back to within [`RSS_RESIDUE_MIB`] of where it
/// started once the clients leave, and three floods in a row leave no more
/// than one flood's bound (nothing leaks: measured 37, 69, 75, 76 MiB after
/// one to four floods, the allocator keeping up to the peak). The residue
/// alone was a flaky bound (24 MiB, seen at 25 in CI): glibc keeps freed
/// arenas for reuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_flood_memory_stays_within_the_budget() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (listen, admin) = (free_port(), free_port());
    let config = dir.path().join("idemgate.toml");
    let budget_mib = 32;
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .set("server.max_buffered_body_bytes", format!("{budget_mib}MiB"))
        .set("server.request_body_timeout", "60s")
        .route(crate::support::Route::post(ORDERS))
        .write(&config);
    let child = ServeProcess::start(&config, listen, admin, &[]).await;
    let pid = child.pid();
    let before = rss_kib(pid);

    // One flood: RSS under it, how many were refused, RSS once it is gone
    // (freed buffers go back to the system over a moment, not at once).
    let flood = |round: usize, settle_below: u64| {
        let child = &child;
        async move {
            let clients: Vec<_> = (0..200)
                .map(|i| {
                    tokio::spawn(stalled_post(
                        listen,
                        format!("flood-{round}-{i}"),
                        1 << 20,
                        900 << 10,
                        Duration::from_secs(4),
                    ))
                })
                .collect();
            let mut streams = Vec::new();
            let mut refused = 0;
            for c in clients {
                let (answer, stream) = c.await.expect("client");
                refused += usize::from(answer.is_some_and(|a| a.starts_with("HTTP/1.1 503")));
                streams.push(stream);
            }
            let under = rss_kib(pid);
            drop(streams);
            crate::support::wait_for("the proxy to let go of every body", || async {
                let m = child.admin_get("/metrics").send().await.text();
                (metric_value(&m, "idemgate_buffered_body_bytes") == 0).then_some(())
            })
            .await;
            let mut after = rss_kib(pid);
            for _ in 0..50 {
                if after < settle_below {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                after = rss_kib(pid);
            }
            (under, refused, after)
        }
    };
    let (under, refused, after) = flood(0, before + RSS_RESIDUE_MIB * 1024).await;
    let peak_bound = before + (budget_mib + RSS_SLACK_MIB) * 1024;
    flood(1, after).await;
    let (_, _, again) = flood(2, after).await;
    eprintln!(
        "RSS before {} MiB, under the flood {} MiB, after {} MiB, after three floods {} MiB; {refused} of 200 refused",
        before / 1024,
        under / 1024,
        after / 1024,
        again / 1024
    );
    assert!(
        under <= peak_bound,
        "RSS grew from {before} KiB to {under} KiB under the flood"
    );
    assert!(refused >= 200 - budget_mib as usize, "{refused} refused");
    assert!(
        after < before + RSS_RESIDUE_MIB * 1024,
        "memory did not fall back after the clients left: {before} KiB before, {after} KiB after"
    );
    assert!(
        again <= peak_bound,
        "floods leave more behind each time (a leak): {after} KiB after one, {again} KiB after three"
    );
    let resp = child.post(ORDERS).key("after").body("{}").send().await;
    assert_eq!(resp.status(), 201);
}

/// HTTP/2 frames written and read by hand (RFC 9113 §4, HPACK RFC 7541
/// literals only), for clients that break the rules on purpose.
pub(crate) mod h2raw {
    use super::{bounded, H2_PREFACE};
    use std::net::SocketAddr;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    pub const HEADERS: u8 = 0x1;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const GOAWAY: u8 = 0x7;
    pub const CANCEL: u32 = 0x8;
    pub const REFUSED_STREAM: u32 = 0x7;
    pub const ENHANCE_YOUR_CALM: u32 = 0xb;
    const END_STREAM: u8 = 0x1;
    const END_HEADERS: u8 = 0x4;
    const ACK: u8 = 0x1;

    pub struct Frame {
        pub kind: u8,
        pub flags: u8,
        pub stream: u32,
        pub payload: Vec<u8>,
    }

    impl Frame {
        pub fn rst_code(&self) -> u32 {
            u32::from_be_bytes(self.payload[..4].try_into().expect("4 bytes"))
        }

        pub fn goaway_code(&self) -> u32 {
            u32::from_be_bytes(self.payload[4..8].try_into().expect("4 bytes"))
        }
    }

    pub fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len())
            .expect("small frame")
            .to_be_bytes();
        let mut out = vec![len[1], len[2], len[3], kind, flags];
        out.extend(stream.to_be_bytes());
        out.extend(payload);
        out
    }

    pub fn settings() -> Vec<u8> {
        frame(SETTINGS, 0, 0, &[])
    }

    pub fn rst_stream(stream: u32, code: u32) -> Vec<u8> {
        frame(RST_STREAM, 0, stream, &code.to_be_bytes())
    }

    /// HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
    fn int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
        let max = (1usize << n) - 1;
        if v < max {
            out.push(first | v as u8);
            return;
        }
        out.push(first | max as u8);
        v -= max;
        while v >= 128 {
            out.push((v % 128) as u8 | 0x80);
            v /= 128;
        }
        out.push(v as u8);
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        int(out, 0, 7, s.len());
        out.extend(s.as_bytes());
    }

    /// A HEADERS frame for `method path` with `extra` fields (lowercase).
    pub fn headers(
        stream: u32,
        method: &str,
        path: &str,
        extra: &[(&str, &str)],
        end_stream: bool,
    ) -> Vec<u8> {
        let mut block = Vec::new();
        // Indexed :method GET (2) / POST (3) and :scheme http (6).
        block.push(if method == "GET" { 0x82 } else { 0x83 });
        block.push(0x86);
        // Literal without indexing, indexed names :path (4), :authority (1).
        int(&mut block, 0, 4, 4);
        string(&mut block, path);
        int(&mut block, 0, 4, 1);
        string(&mut block, "localhost");
        for (name, value) in extra {
            block.push(0);
            string(&mut block, name);
            string(&mut block, value);
        }
        let flags = END_HEADERS | if end_stream { END_STREAM } else { 0 };
        frame(HEADERS, flags, stream, &block)
    }

    pub struct Conn {
        pub stream: TcpStream,
    }

    impl Conn {
        /// Preface and SETTINGS, then the server's SETTINGS acknowledged,
        /// so its limits are in force before anything else is sent.
        pub async fn open(addr: SocketAddr) -> Self {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            let mut hello = H2_PREFACE.to_vec();
            hello.extend(settings());
            stream.write_all(&hello).await.expect("write preface");
            let mut conn = Self { stream };
            loop {
                let f = conn
                    .next_frame(Duration::from_secs(5))
                    .await
                    .expect("the server's SETTINGS");
                if f.kind == SETTINGS && f.flags & ACK == 0 {
                    break;
                }
            }
            conn.send(&frame(SETTINGS, ACK, 0, &[])).await;
            conn
        }

        pub async fn send(&mut self, bytes: &[u8]) {
            bounded("an h2 write", self.stream.write_all(bytes))
                .await
                .expect("h2 write");
        }

        /// The next frame, or `None` at EOF, on an error or after `idle`.
        pub async fn next_frame(&mut self, idle: Duration) -> Option<Frame> {
            let read = async {
                let mut head = [0u8; 9];
                self.stream.read_exact(&mut head).await.ok()?;
                let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                let mut payload = vec![0u8; len];
                self.stream.read_exact(&mut payload).await.ok()?;
                Some(Frame {
                    kind: head[3],
                    flags: head[4],
                    stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
                    payload,
                })
            };
            tokio::time::timeout(idle, read).await.ok().flatten()
        }
    }
}

/// Sends a `GET /healthz` on a fresh connection to `addr`; its status
/// line, or `None` when nothing came back within `wait`.
async fn healthz_within(addr: SocketAddr, wait: Duration) -> Option<String> {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut head = [0u8; 12];
    match tokio::time::timeout(wait, s.read_exact(&mut head)).await {
        Ok(Ok(_)) => Some(String::from_utf8_lossy(&head).into_owned()),
        _ => None,
    }
}

/// Pins issue 18 (the admin listener): it accepted without a limit, so
/// silent sockets could take every descriptor. At
/// `ADMIN_MAX_CONNECTIONS` open ones the next waits in the backlog, and is
/// served as soon as one of them ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_connections_past_the_admin_limit_wait_for_a_slot() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.header_read_timeout", "30s")
        .admin()
        .start()
        .await;
    let admin = proxy.admin_addr.expect("admin");
    let mut silent = Vec::new();
    for _ in 0..idemgate::server::ADMIN_MAX_CONNECTIONS {
        silent.push(TcpStream::connect(admin).await.expect("connect"));
    }
    let queued = healthz_within(admin, Duration::from_secs(1)).await;
    assert_eq!(queued, None, "served past the admin limit");
    let queued = tokio::spawn(healthz_within(admin, Duration::from_secs(5)));
    tokio::time::sleep(Duration::from_millis(200)).await;
    silent.pop();
    let answer = queued.await.expect("client");
    assert_eq!(
        answer.as_deref(),
        Some("HTTP/1.1 200"),
        "served once a slot freed"
    );
}

/// Pins issue 18 (the admin listener): its HTTP/1 builder had no timer, so
/// hyper dropped its header timeout and a silent or trickling socket held
/// its admin connection forever; now each closes at `header_read_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_admin_sockets_are_closed_at_the_head_deadline() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.header_read_timeout", "1s")
        .admin()
        .start()
        .await;
    let admin = proxy.admin_addr.expect("admin");
    let openings: [(&str, &[u8]); 3] = [
        ("nothing", b""),
        ("one byte of a method", b"G"),
        (
            "a head without its end",
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n",
        ),
    ];
    for (what, opening) in openings {
        let mut s = TcpStream::connect(admin).await.expect("connect");
        s.write_all(opening).await.expect("write");
        let lived = time_to_close(&mut s, Duration::from_secs(5)).await;
        eprintln!("admin, {what}: closed after {lived:?}");
        let lived = lived.unwrap_or_else(|| panic!("{what}: still open after 5 s"));
        assert!(lived < Duration::from_secs(3), "{what}: lived {lived:?}");
    }
    assert_eq!(
        healthz_within(admin, Duration::from_secs(2))
            .await
            .as_deref(),
        Some("HTTP/1.1 200")
    );
}
