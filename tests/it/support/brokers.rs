//! The brokers of the consumer tests (`consumers.rs`): the shared RabbitMQ
//! (127.0.0.1:5672, guest/guest) and NATS with JetStream (127.0.0.1:4222),
//! required (a missing one fails the test, naming what to start), with a
//! queue or stream of each test's own, deleted afterwards; a private
//! `nats-server -js` a test may stop and restart; and the counting
//! upstream the messages are delivered to.

use super::redis_tls::TestPki;
use super::serve::{server, TestServer};
use super::{free_port, wait_for};
use async_nats::jetstream;
use bytes::Bytes;
use futures_util::StreamExt;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A name no other test (or run) uses.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

// ===== the counting upstream =====

/// Counts executions per `Idempotency-Key` (the message key). A message's
/// JSON body may say how to answer: `"plan": [503, 201]` (the n-th
/// execution of the key answers the n-th status, the last one after
/// that; default 201), `"delay_ms": N`, and `"reset": true` (executes,
/// then drops the connection without answering).
pub struct Handler {
    pub addr: SocketAddr,
    executions: Arc<Mutex<HashMap<String, Vec<u16>>>>,
    /// While set, every request gets 503 without executing.
    unavailable: Arc<std::sync::atomic::AtomicBool>,
    _server: TestServer,
}

impl Handler {
    pub async fn start() -> Self {
        let executions: Arc<Mutex<HashMap<String, Vec<u16>>>> = Arc::default();
        let unavailable: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let seen = executions.clone();
        let down = unavailable.clone();
        let server = server()
            .serve(move |req: Request<Incoming>, _| {
                let seen = seen.clone();
                let down = down.load(std::sync::atomic::Ordering::SeqCst);
                async move {
                    if down {
                        return Ok(Response::builder()
                            .status(503)
                            .body(Full::new(Bytes::new()))
                            .unwrap());
                    }
                    let key = req
                        .headers()
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_string();
                    let body = req.into_body().collect().await?.to_bytes();
                    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    let plan: Vec<u16> = doc["plan"]
                        .as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(|s| s.as_u64())
                                .map(|s| s as u16)
                                .collect()
                        })
                        .unwrap_or_default();
                    if let Some(ms) = doc["delay_ms"].as_u64() {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    let status = {
                        let mut seen = seen.lock().unwrap();
                        let runs = seen.entry(key.clone()).or_default();
                        let status = plan.get(runs.len()).or(plan.last()).copied().unwrap_or(201);
                        runs.push(status);
                        status
                    };
                    if doc["reset"].as_bool() == Some(true) {
                        // Executed, then no answer: the proxy sees the
                        // connection fail after sending (an ambiguous outcome).
                        return Err("reset after executing".into());
                    }
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                        Response::builder()
                            .status(status)
                            .body(Full::new(Bytes::from(format!("{{\"key\":{key:?}}}"))))
                            .unwrap(),
                    )
                }
            })
            .await;
        Self {
            addr: server.addr,
            executions,
            unavailable,
            _server: server,
        }
    }

    /// Answers 503 to everything (executing nothing) while `down`.
    pub fn set_unavailable(&self, down: bool) {
        self.unavailable
            .store(down, std::sync::atomic::Ordering::SeqCst);
    }

    /// The statuses each execution of `key` answered.
    pub fn runs(&self, key: &str) -> Vec<u16> {
        self.executions
            .lock()
            .unwrap()
            .get(key)
            .cloned()
            .unwrap_or_default()
    }

    /// Every key and how many times it executed.
    pub fn counts(&self) -> HashMap<String, usize> {
        let e = self.executions.lock().unwrap();
        e.iter().map(|(k, v)| (k.clone(), v.len())).collect()
    }
}

// ===== RabbitMQ =====

/// Fails the test when RabbitMQ does not answer, naming what to start.
pub async fn rabbitmq(url: &str) -> Connection {
    match tokio::time::timeout(
        Duration::from_secs(5),
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    {
        Ok(Ok(c)) => c,
        other => panic!(
            "RabbitMQ is not reachable at {url} ({}): start it (`rabbitmq-server -detached`, or run scripts/test.sh, which starts it)",
            match other {
                Ok(Err(e)) => e.to_string(),
                _ => "timed out".to_string(),
            }
        ),
    }
}

/// A queue of the test's own with a dead-letter queue (`<name>.dlq`, fed
/// through the default exchange), deleted by [`TestQueue::delete`].
pub struct TestQueue {
    pub name: String,
    pub dlq: String,
    pub channel: Channel,
    _connection: Connection,
    /// The broker's URL, for the cleanup on drop.
    url: String,
}

/// Runs `work` on a thread with a runtime of its own (a drop may run
/// inside the test's runtime), best effort, bounded.
fn cleanup<F: std::future::Future<Output = ()> + Send + 'static>(work: F) {
    let done = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(5), work).await;
            });
        }
    });
    let _ = done.join();
}

impl Drop for TestQueue {
    /// Deletes the queues even when the test failed before its own delete.
    fn drop(&mut self) {
        let (url, queues) = (self.url.clone(), [self.name.clone(), self.dlq.clone()]);
        cleanup(async move {
            let Ok(c) = Connection::connect(&url, ConnectionProperties::default()).await else {
                return;
            };
            if let Ok(ch) = c.create_channel().await {
                for q in queues {
                    let _ = ch
                        .queue_delete(ShortString::from(q), QueueDeleteOptions::default())
                        .await;
                }
            }
            let _ = c.close(200, ShortString::from("bye")).await;
        });
    }
}

impl TestQueue {
    pub async fn new(prefix: &str) -> Self {
        Self::on(AMQP_URL, prefix).await
    }

    /// On the RabbitMQ at `url`.
    pub async fn on(url: &str, prefix: &str) -> Self {
        let connection = rabbitmq(url).await;
        let channel = connection.create_channel().await.unwrap();
        let name = unique(prefix);
        let dlq = format!("{name}.dlq");
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(
                ShortString::from(dlq.clone()),
                durable,
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut args = FieldTable::default();
        args.insert(
            ShortString::from("x-dead-letter-exchange"),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            ShortString::from("x-dead-letter-routing-key"),
            AMQPValue::LongString(dlq.as_str().into()),
        );
        channel
            .queue_declare(ShortString::from(name.clone()), durable, args)
            .await
            .unwrap();
        Self {
            name,
            dlq,
            channel,
            _connection: connection,
            url: url.to_string(),
        }
    }

    /// Publishes `body` (persistent, JSON) with `message_id` when given.
    pub async fn publish(&self, id: Option<&str>, body: &str) {
        self.publish_with(id, &[], body).await;
    }

    /// [`TestQueue::publish`] with string `headers`.
    pub async fn publish_with(&self, id: Option<&str>, headers: &[(&str, &str)], body: &str) {
        let mut props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type(ShortString::from("application/json"));
        if let Some(id) = id {
            props = props.with_message_id(ShortString::from(id));
        }
        if !headers.is_empty() {
            let mut table = FieldTable::default();
            for (n, v) in headers {
                table.insert(ShortString::from(*n), AMQPValue::LongString((*v).into()));
            }
            props = props.with_headers(table);
        }
        self.channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(self.name.clone()),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Takes every message of the dead-letter queue: their message ids
    /// (or bodies, where there is no id).
    pub async fn drain_dead_letters(&self) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(
                ShortString::from(self.dlq.clone()),
                BasicGetOptions::default(),
            )
            .await
            .unwrap()
        {
            let d = m.delivery;
            out.push(match d.properties.message_id() {
                Some(id) => id.as_str().to_string(),
                None => String::from_utf8_lossy(&d.data).into_owned(),
            });
            d.acker.ack(BasicAckOptions::default()).await.unwrap();
        }
        out
    }

    /// Takes every message of the dead-letter queue: the value of their
    /// string header `name` (`None` where they have none).
    pub async fn drain_dead_letter_header(&self, name: &str) -> Vec<Option<String>> {
        let mut out = Vec::new();
        while let Some(m) = self
            .channel
            .basic_get(
                ShortString::from(self.dlq.clone()),
                BasicGetOptions::default(),
            )
            .await
            .unwrap()
        {
            let d = m.delivery;
            let value = d.properties.headers().as_ref().and_then(|h| {
                h.inner().iter().find_map(|(n, v)| match v {
                    AMQPValue::LongString(s) if n.as_str() == name => {
                        Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                    }
                    _ => None,
                })
            });
            out.push(value);
            d.acker.ack(BasicAckOptions::default()).await.unwrap();
        }
        out
    }

    /// The same queues through a new connection (after a broker restart).
    pub async fn reconnected(mut self) -> Self {
        let connection = rabbitmq(&self.url).await;
        self.channel = connection.create_channel().await.unwrap();
        self._connection = connection;
        self
    }

    pub async fn delete(&self) {
        for q in [&self.name, &self.dlq] {
            let _ = self
                .channel
                .queue_delete(ShortString::from(q.clone()), QueueDeleteOptions::default())
                .await;
        }
    }
}

/// `rabbitmqctl`'s view of a queue on the machine's node (whatever its
/// name: `rabbitmqctl`'s default): (ready, unacknowledged).
pub fn rabbitmq_counts(queue: &str) -> (u64, u64) {
    counts(&[], queue)
}

/// [`rabbitmq_counts`] on the node `node`.
pub fn rabbitmq_counts_on(node: &str, queue: &str) -> (u64, u64) {
    counts(&["-n", node], queue)
}

fn counts(node: &[&str], queue: &str) -> (u64, u64) {
    let out = Command::new("rabbitmqctl")
        .arg("-q")
        .args(node)
        .args([
            "list_queues",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ])
        .output()
        .expect("run rabbitmqctl");
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() == 3 && cols[0] == queue {
            return (cols[1].parse().unwrap_or(0), cols[2].parse().unwrap_or(0));
        }
    }
    panic!("rabbitmqctl does not list the queue {queue}:\n{text}");
}

/// Closes the broker side of idemgate's connection for `queue` (named
/// `idemgate/<queue>`): its unacked deliveries return to the queue.
pub fn close_idemgate_connection(queue: &str) {
    let out = Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "pid", "client_properties"])
        .output()
        .expect("run rabbitmqctl");
    let text = String::from_utf8_lossy(&out.stdout);
    let tag = format!("idemgate/{queue}");
    let names: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(&tag))
        .filter_map(|l| l.split('\t').next())
        .collect();
    assert!(!names.is_empty(), "no connection named {tag}:\n{text}");
    for pid in names {
        let out = Command::new("rabbitmqctl")
            .args(["-q", "close_connection", pid, "test: forced redelivery"])
            .output()
            .expect("run rabbitmqctl");
        assert!(out.status.success(), "close_connection {pid}: {out:?}");
    }
}

/// A private RabbitMQ node (its own node name, ports, Mnesia and log
/// directories, and a config listening on its port only), which a test
/// may stop and start again; the shared node is never touched.
pub struct PrivateRabbit {
    pub port: u16,
    /// The TLS listener's port ([`PrivateRabbit::start_tls`]).
    pub tls_port: Option<u16>,
    /// The management plugin's HTTP port, which `rabbitmqadmin` talks to
    /// ([`PrivateRabbit::start_management`]).
    pub management_port: Option<u16>,
    pub node: String,
    dir: tempfile::TempDir,
    /// The `rabbitmq-server` script, reaped once the node stops.
    child: Option<Child>,
}

impl PrivateRabbit {
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// [`PrivateRabbit::start`] with a TLS listener too (`listeners.ssl`)
    /// presenting `pki`'s server certificate and requiring a client
    /// certificate its CA signed (`verify_peer`, `fail_if_no_peer_cert`).
    pub async fn start_tls(pki: &TestPki) -> Self {
        Self::start_with(Some(pki)).await
    }

    /// [`PrivateRabbit::start`] with the management plugin enabled (in
    /// this node's own enabled-plugins file) on a free port of its own.
    pub async fn start_management() -> Self {
        Self::start_on(None, true).await
    }

    async fn start_with(pki: Option<&TestPki>) -> Self {
        Self::start_on(pki, false).await
    }

    async fn start_on(pki: Option<&TestPki>, management: bool) -> Self {
        let port = free_port().port();
        let dir = tempfile::TempDir::new().unwrap();
        let path = dir.path();
        std::fs::create_dir_all(path.join("mnesia")).unwrap();
        std::fs::create_dir_all(path.join("log")).unwrap();
        let mut conf = format!("listeners.tcp.local = 127.0.0.1:{port}\n");
        let tls_port = pki.map(|pki| {
            let tls_port = free_port().port();
            // Copied: the node runs as the rabbitmq user.
            for file in ["ca.pem", "server.pem", "server.key"] {
                std::fs::copy(pki.path(file), path.join(file)).unwrap();
            }
            let at = |file: &str| path.join(file).display().to_string();
            conf.push_str(&format!(
                "listeners.ssl.default = 127.0.0.1:{tls_port}\n\
                 ssl_options.cacertfile = {}\n\
                 ssl_options.certfile = {}\n\
                 ssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_peer\n\
                 ssl_options.fail_if_no_peer_cert = true\n",
                at("ca.pem"),
                at("server.pem"),
                at("server.key"),
            ));
            tls_port
        });
        let management_port = management.then(|| {
            let port = free_port().port();
            conf.push_str(&format!(
                "management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {port}\n"
            ));
            std::fs::write(path.join("plugins"), "[rabbitmq_management].\n").unwrap();
            port
        });
        std::fs::write(path.join("rabbitmq.conf"), conf).unwrap();
        // rabbitmq-server run as root switches to the rabbitmq user.
        let status = Command::new("chown")
            .args(["-R", "rabbitmq"])
            .arg(path)
            .status()
            .expect("run chown");
        assert!(status.success());
        let _ = Command::new("chmod").arg("755").arg(path).status();
        let mut r = Self {
            port,
            tls_port,
            management_port,
            node: format!("idemgate-test-{port}@localhost"),
            dir,
            child: None,
        };
        r.up().await;
        r
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// `amqps://` to the TLS listener.
    pub fn tls_url(&self) -> String {
        let port = self.tls_port.expect("started with start_tls");
        format!("amqps://guest:guest@127.0.0.1:{port}/%2f")
    }

    pub async fn up(&mut self) {
        let p = self.dir.path();
        let dist = self.port + 1;
        let child = Command::new("rabbitmq-server")
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", dist.to_string())
            .env("RABBITMQ_MNESIA_BASE", p.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", p.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", p.join("plugins"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", p.join("feature_flags"))
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", p.join("expand"))
            .env("RABBITMQ_PID_FILE", p.join("node.pid"))
            .env("RABBITMQ_CONFIG_FILE", p.join("rabbitmq.conf"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start rabbitmq-server (install the rabbitmq-server package)");
        self.child = Some(child);
        let addr: SocketAddr = ([127, 0, 0, 1], self.port).into();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the private RabbitMQ node did not listen on {addr} within 60 s (logs in {})",
                p.join("log").display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if let Some(port) = self.management_port {
            // The plugin starts after the AMQP listener; it may take a while.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the private RabbitMQ node's management plugin did not listen on {port} within 60 s (logs in {})",
                    p.join("log").display()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        if let Some(tls_port) = self.tls_port {
            wait_for("the private RabbitMQ node's TLS listener", || async move {
                tokio::net::TcpStream::connect(("127.0.0.1", tls_port))
                    .await
                    .ok()
            })
            .await;
        }
    }

    /// `rabbitmqctl stop`: the node halts; durable queues and persistent
    /// messages are there at the next start.
    pub fn down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("rabbitmqctl")
                .args(["-q", "-n", &self.node, "stop"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        self.down();
    }
}

// ===== NATS JetStream =====

/// Fails the test when NATS does not answer, naming what to start.
pub async fn nats(url: &str) -> jetstream::Context {
    match async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(3))
        .connect(url)
        .await
    {
        Ok(c) => jetstream::new(c),
        Err(e) => panic!(
            "NATS is not reachable at {url} ({e}): start nats-server with JetStream (`nats-server -js`, or run scripts/test.sh, which starts it)"
        ),
    }
}

/// A stream of the test's own (`<NAME>.in`), with a dead-letter stream
/// capturing `<NAME>.dead`, deleted by [`TestStream::delete`].
pub struct TestStream {
    pub name: String,
    pub dead_subject: String,
    pub js: jetstream::Context,
    /// The server's URL, for the cleanup on drop.
    pub url: String,
}

impl Drop for TestStream {
    /// Deletes the streams even when the test failed before its own delete.
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        cleanup(async move {
            if let Ok(c) = async_nats::connect(url).await {
                let js = jetstream::new(c);
                let _ = js.delete_stream(&name).await;
                let _ = js.delete_stream(format!("{name}_DLQ")).await;
            }
        });
    }
}

impl TestStream {
    pub async fn new(url: &str, prefix: &str) -> Self {
        Self::on(nats(url).await, url, prefix).await
    }

    /// [`TestStream::new`] through `js`, a connection to `url` the test
    /// made (TLS).
    pub async fn on(js: jetstream::Context, url: &str, prefix: &str) -> Self {
        let name = unique(prefix).to_uppercase();
        let dead_subject = format!("{name}.dead");
        js.create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.in")],
            ..Default::default()
        })
        .await
        .unwrap();
        js.create_stream(jetstream::stream::Config {
            name: format!("{name}_DLQ"),
            subjects: vec![dead_subject.clone()],
            ..Default::default()
        })
        .await
        .unwrap();
        Self {
            name,
            dead_subject,
            js,
            url: url.to_string(),
        }
    }

    /// With the consumed stream's duplicate window set to `window`.
    pub async fn with_window(url: &str, prefix: &str, window: Duration) -> Self {
        let this = Self::new(url, prefix).await;
        let mut stream = this.js.get_stream(&this.name).await.unwrap();
        let mut config = stream.info().await.unwrap().config.clone();
        config.duplicate_window = window;
        this.js.update_stream(config).await.unwrap();
        this
    }

    /// The same streams through a new connection (after a broker restart).
    pub async fn reconnected(mut self) -> Self {
        self.js = nats(&self.url).await;
        self
    }

    /// Publishes `body` with `Nats-Msg-Id` when `id` is given (a repeat
    /// within the stream's duplicate window is dropped by the broker, so
    /// the duplicates a test wants carry a header key instead).
    pub async fn publish(&self, id: Option<&str>, headers: &[(&str, &str)], body: &str) {
        let mut h = async_nats::HeaderMap::new();
        if let Some(id) = id {
            h.insert("Nats-Msg-Id", id);
        }
        for (n, v) in headers {
            h.insert(*n, *v);
        }
        self.js
            .publish_with_headers(
                format!("{}.in", self.name),
                h,
                Bytes::from(body.to_string()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// The durable consumer's (pending, unacked) counts.
    pub async fn consumer_counts(&self, durable: &str) -> Option<(u64, usize)> {
        let stream = self.js.get_stream(&self.name).await.ok()?;
        let mut c: jetstream::consumer::PullConsumer = stream.get_consumer(durable).await.ok()?;
        let info = c.info().await.ok()?;
        Some((info.num_pending, info.num_ack_pending))
    }

    /// Every dead letter on the stream's dead-letter stream, in stream
    /// order (each acked as read).
    async fn dead_letter_messages(&self) -> Vec<async_nats::Message> {
        let stream = self
            .js
            .get_stream(format!("{}_DLQ", self.name))
            .await
            .unwrap();
        let c: jetstream::consumer::PullConsumer = stream
            .create_consumer(jetstream::consumer::pull::Config::default())
            .await
            .unwrap();
        let mut out = Vec::new();
        let mut batch = c
            .fetch()
            .max_messages(1000)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(m)) = batch.next().await {
            let _ = m.ack().await;
            out.push(m.message.clone());
        }
        out
    }

    /// The value of each dead letter's header `name`, in stream order.
    pub async fn dead_letter_header(&self, name: &str) -> Vec<Option<String>> {
        self.dead_letter_messages()
            .await
            .iter()
            .map(|m| {
                let h = m.headers.as_ref()?;
                Some(h.get(name)?.as_str().to_string())
            })
            .collect()
    }

    /// The dead letters' headers (name, value), in stream order.
    pub async fn dead_letter_headers(&self) -> Vec<Vec<(String, String)>> {
        let mut out = Vec::new();
        for m in self.dead_letter_messages().await {
            let mut h: Vec<(String, String)> = Vec::new();
            for (n, vs) in m.headers.iter().flat_map(|h| h.iter()) {
                for v in vs {
                    h.push((n.to_string(), v.as_str().to_string()));
                }
            }
            h.sort();
            out.push(h);
        }
        out
    }

    /// The dead letters' reasons by key header (`x-order-id`, else body).
    pub async fn dead_letters(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for m in self.dead_letter_messages().await {
            let h = m.headers.clone().unwrap_or_default();
            let key = h
                .get("x-order-id")
                .map(|v| v.as_str().to_string())
                .unwrap_or_else(|| String::from_utf8_lossy(&m.payload).into_owned());
            let reason = h
                .get("Idemgate-Dead-Letter-Reason")
                .map(|v| v.as_str().to_string())
                .unwrap_or_default();
            out.push((key, reason));
        }
        out
    }

    pub async fn delete(&self) {
        let _ = self.js.delete_stream(&self.name).await;
        let _ = self.js.delete_stream(format!("{}_DLQ", self.name)).await;
    }
}

/// A private `nats-server -js` on a free port with its own store, which a
/// test may stop and start again (the shared one is never touched).
pub struct PrivateNats {
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// TLS only, with the PKI's server certificate; clients must present
    /// a certificate its CA signed.
    tls: Option<NatsTls>,
}

/// The PKI's files a TLS `nats-server` is started with.
struct NatsTls {
    cert: String,
    key: String,
    ca: String,
}

impl PrivateNats {
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// TLS required (`--tlsverify`: clients present a certificate `pki`'s
    /// CA signed), with `pki`'s server certificate.
    pub async fn start_tls(pki: &TestPki) -> Self {
        let file = |name: &str| pki.path(name).display().to_string();
        Self::start_with(Some(NatsTls {
            cert: file("server.pem"),
            key: file("server.key"),
            ca: pki.ca(),
        }))
        .await
    }

    async fn start_with(tls: Option<NatsTls>) -> Self {
        let mut n = Self {
            addr: free_port(),
            dir: tempfile::TempDir::new().unwrap(),
            child: None,
            tls,
        };
        n.up().await;
        n
    }

    /// `tls://127.0.0.1:<port>`.
    pub fn tls_url(&self) -> String {
        format!("tls://{}", self.addr)
    }

    /// The test's own TLS connection: `pki`'s CA and client certificate.
    pub async fn tls_client(&self, pki: &TestPki) -> jetstream::Context {
        let client = async_nats::ConnectOptions::new()
            .require_tls(true)
            .add_root_certificates(pki.path("ca.pem"))
            .add_client_certificate(pki.path("client.pem"), pki.path("client.key"))
            .connection_timeout(Duration::from_secs(3))
            .connect(self.tls_url())
            .await
            .expect("connect to the private TLS nats-server");
        jetstream::new(client)
    }

    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    fn store(&self) -> PathBuf {
        self.dir.path().join("js")
    }

    pub async fn up(&mut self) {
        let mut command = Command::new("nats-server");
        command
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.addr.port().to_string(),
                "-sd",
            ])
            .arg(self.store());
        if let Some(tls) = &self.tls {
            command.args([
                "--tlsverify",
                "--tlscert",
                &tls.cert,
                "--tlskey",
                &tls.key,
                "--tlscacert",
                &tls.ca,
            ]);
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server (install the nats-server package)");
        self.child = Some(child);
        let addr = self.addr;
        wait_for("the private nats-server to listen", || async move {
            tokio::net::TcpStream::connect(addr).await.ok()
        })
        .await;
    }

    /// SIGTERM and wait: JetStream keeps its store for the next start.
    pub fn down(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
