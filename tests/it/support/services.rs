//! External services for integration tests: where PostgreSQL and Redis are,
//! a fresh schema per test, private `redis-server` instances that can be
//! killed and restarted, and a TCP relay that can cut a connection to
//! PostgreSQL without stopping the shared server.
//!
//! Tests never skip: a missing service is a panic that says how to fix it.

use idemgate::config::{mask_url, Backend, MigrationLock, SqliteSync, StoreConfig};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream as StdStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// `IDEMGATE_TEST_DATABASE_URL`, or the local default.
pub fn database_url() -> String {
    std::env::var("IDEMGATE_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into())
}

/// `IDEMGATE_TEST_REDIS_URL`, or the local default.
pub fn redis_url() -> String {
    std::env::var("IDEMGATE_TEST_REDIS_URL").unwrap_or_else(|_| DEFAULT_REDIS_URL.into())
}

/// A schema (or Redis prefix) name no other test or run uses:
/// `<prefix>_<pid>_<counter>_<random>`, valid for `store.schema`.
pub fn unique_schema(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}_{}_{}_{:08x}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>()
    )
}

/// Panics with a clear message unless PostgreSQL answers at `url`.
pub async fn require_postgres(url: &str) {
    let attempt = async {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        let task = tokio::spawn(conn);
        let res = client.simple_query("SELECT 1").await.map(|_| ());
        drop(client);
        let _ = task.await;
        res
    };
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!(
            "PostgreSQL is not reachable at {}: {e}: start it (see README) or set IDEMGATE_TEST_DATABASE_URL",
            mask_url(url)
        ),
        Err(_) => panic!(
            "PostgreSQL is not reachable at {} (timed out): start it (see README) or set IDEMGATE_TEST_DATABASE_URL",
            mask_url(url)
        ),
    }
}

/// Panics with a clear message unless Redis answers PING at `url`
/// (`redis://host:port` only).
pub fn require_redis(url: &str) {
    // redis://[user:pass@]host:port[/db]
    let authority = url
        .trim_start_matches("redis://")
        .split('/')
        .next()
        .unwrap_or_default();
    let addr = authority.rsplit('@').next().unwrap_or_default().to_string();
    if !redis_answers(&addr) {
        panic!(
            "Redis is not reachable at {}: start it (see README) or set IDEMGATE_TEST_REDIS_URL",
            mask_url(url)
        );
    }
}

/// Drops a test schema (best effort, for cleanup at the end of a test).
pub async fn drop_schema(url: &str, schema: &str) {
    let Ok(Ok((client, conn))) = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_postgres::connect(url, tokio_postgres::NoTls),
    )
    .await
    else {
        return;
    };
    let task = tokio::spawn(conn);
    let _ = client
        .batch_execute(&format!(
            "SET lock_timeout = '5s'; DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
        ))
        .await;
    drop(client);
    let _ = task.await;
}

/// A PostgreSQL `StoreConfig` with short timeouts, as tests want them.
pub fn pg_store_config(url: &str, schema: &str) -> StoreConfig {
    StoreConfig {
        backend: Backend::Postgres,
        path: "unused.db".into(),
        synchronous: SqliteSync::Full,
        url: Some(url.to_string()),
        schema: schema.to_string(),
        pool_size: 8,
        connect_timeout: Duration::from_secs(1),
        statement_timeout: Duration::from_secs(2),
        migration_lock: MigrationLock::Advisory,
        require_synchronous_replication: false,
        plaintext_responses: idemgate::config::PlaintextResponses::Replay,
        timeout: Duration::from_secs(2),
        sweep_interval: Duration::from_secs(60),
        sweep_batch: 500,
    }
}

/// One blocking PING round trip.
fn redis_answers(addr: &str) -> bool {
    let Ok(sock_addr) = addr.parse::<SocketAddr>().or_else(|_| {
        use std::net::ToSocketAddrs;
        addr.to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or(())
    }) else {
        return false;
    };
    let Ok(mut s) = StdStream::connect_timeout(&sock_addr, Duration::from_millis(300)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// A `redis-server` of our own on a free port: no persistence, killed on drop.
pub struct PrivateRedis {
    port: u16,
    child: Option<Child>,
}

impl PrivateRedis {
    pub fn start() -> Self {
        let mut r = Self {
            port: super::free_port().port(),
            child: None,
        };
        r.spawn();
        r
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (is it installed and on PATH?)");
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !redis_answers(&addr) {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("redis-server on port {} exited: {status}", self.port);
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not answer within 10 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers
    /// (a slow or hung Redis). [`PrivateRedis::resume`] thaws it.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a [`PrivateRedis::pause`]d server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, sig: &str) {
        let pid = self
            .child
            .as_ref()
            .expect("redis-server is not running")
            .id();
        let status = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} {pid}: {status}");
    }

    /// Starts a fresh, empty server on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RelayState {
    Open,
    /// Current connections dropped; new ones accepted and then stalled
    /// (a black hole: the client's own timeouts must fire).
    Cut,
    /// Nothing forwarded either way, and nothing closed: current and new
    /// connections stall (a peer that vanished without a word: only the
    /// client's own timeouts end them).
    Frozen,
    Closed,
}

/// A TCP relay on 127.0.0.1:0 forwarding to `target`, that can be cut and
/// restored, or repointed at another target (a managed endpoint moving to
/// a promoted replica); stops when dropped (or with its runtime).
pub struct TcpRelay {
    addr: SocketAddr,
    state: Arc<watch::Sender<RelayState>>,
    /// Where new connections go, and how often that changed: a relayed
    /// connection ends when it changes.
    target: Arc<std::sync::Mutex<(SocketAddr, u64)>>,
    accept: JoinHandle<()>,
}

impl TcpRelay {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().expect("relay address");
        let (tx, _) = watch::channel(RelayState::Open);
        let state = Arc::new(tx);
        let target = Arc::new(std::sync::Mutex::new((target, 0)));
        let (st, tg) = (state.clone(), target.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                let rx = st.subscribe();
                tokio::spawn(relay_one(inbound, tg.clone(), rx));
            }
        });
        Self {
            addr,
            state,
            target,
            accept,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every relayed connection and stalls new ones.
    pub fn cut(&self) {
        self.state.send_replace(RelayState::Cut);
    }

    /// Stops forwarding on every connection, current and new, without
    /// closing any (a server that vanished silently).
    pub fn freeze(&self) {
        self.state.send_replace(RelayState::Frozen);
    }

    /// Relays new connections again.
    pub fn restore(&self) {
        self.state.send_replace(RelayState::Open);
    }

    /// Drops every relayed connection and relays new ones to `target`.
    pub fn repoint(&self, target: SocketAddr) {
        {
            let mut t = self.target.lock().unwrap_or_else(|p| p.into_inner());
            *t = (target, t.1 + 1);
        }
        // Wakes every relayed connection to look at the target again.
        self.state.send_modify(|_| {});
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        self.state.send_replace(RelayState::Closed);
        self.accept.abort();
    }
}

async fn relay_one(
    mut inbound: TcpStream,
    target: Arc<std::sync::Mutex<(SocketAddr, u64)>>,
    mut rx: watch::Receiver<RelayState>,
) {
    let stalled = |s: &RelayState| matches!(s, RelayState::Cut | RelayState::Frozen);
    if *rx.borrow_and_update() != RelayState::Open {
        // Stall: hold the socket, say nothing, until the relay opens or closes.
        let _ = rx.wait_for(|s| !stalled(s)).await;
        return;
    }
    let current = || *target.lock().unwrap_or_else(|p| p.into_inner());
    let (to, generation) = current();
    let Ok(mut outbound) = TcpStream::connect(to).await else {
        return;
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
        _ = rx.wait_for(|s| *s != RelayState::Open || current().1 != generation) => {}
    }
    if *rx.borrow() == RelayState::Frozen {
        // Both sockets held open, nothing read or written, until it ends.
        let _ = rx.wait_for(|s| *s == RelayState::Closed).await;
        drop((inbound, outbound));
    }
}

/// The `host:port` of the PostgreSQL server `database_url()` names (to put
/// a [`TcpRelay`] in front of it).
pub fn postgres_addr() -> SocketAddr {
    let url = database_url();
    let cfg: tokio_postgres::Config = url
        .parse()
        .unwrap_or_else(|e| panic!("IDEMGATE_TEST_DATABASE_URL does not parse: {e}"));
    let host = match cfg.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".into(),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    use std::net::ToSocketAddrs;
    (host.as_str(), port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| panic!("cannot resolve the PostgreSQL host {host:?}"))
}

/// `database_url()` with its host and port replaced by `addr` (a relay).
pub fn database_url_via(addr: SocketAddr) -> String {
    let cfg: tokio_postgres::Config = database_url().parse().expect("database url parses");
    let user = cfg.get_user().unwrap_or("postgres");
    let db = cfg.get_dbname().unwrap_or("test");
    let password = cfg
        .get_password()
        .map(|p| format!(":{}", String::from_utf8_lossy(p)))
        .unwrap_or_default();
    format!("postgres://{user}{password}@{addr}/{db}")
}

/// A PostgreSQL schema and a Redis prefix of one test's own (both named by
/// [`unique_schema`]); dropping it drops the schema and deletes the Redis
/// keys under the prefix on the shared Redis (best effort). Replicas share
/// one through an `Arc`.
pub struct TestSchema {
    pub schema: String,
    pub prefix: String,
}

impl TestSchema {
    pub fn new() -> Self {
        let schema = unique_schema("t");
        Self {
            prefix: schema.clone(),
            schema,
        }
    }
}

impl Default for TestSchema {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        let prefix = self.prefix.clone();
        // Drop runs inside the test's runtime (possibly a current-thread one):
        // do the async cleanup on a thread with a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                drop_schema(&database_url(), &schema).await;
                delete_redis_prefix_or_say(&prefix).await;
            });
        });
        let _ = cleanup.join();
    }
}

/// Deletes every key starting with `prefix` on the shared Redis (test
/// cleanup; errors ignored). SCAN, not KEYS: the shared Redis may hold many
/// keys, and KEYS blocks it while it looks.
async fn delete_redis_prefix(prefix: &str) -> Result<(), String> {
    let client = redis::Client::open(redis_url().as_str()).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        if !keys.is_empty() {
            let _: i64 = redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// [`delete_redis_prefix`], bounded, saying on stderr when a key may be
/// left behind (a test's cleanup must not fail the test, but must not be
/// silent either).
async fn delete_redis_prefix_or_say(prefix: &str) {
    match tokio::time::timeout(Duration::from_secs(15), delete_redis_prefix(prefix)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("test cleanup: Redis keys {prefix}* not deleted: {e}"),
        Err(_) => eprintln!("test cleanup: Redis keys {prefix}* not deleted: timed out"),
    }
}

/// Deletes the shared Redis's keys under a prefix when dropped, for tests
/// that give a store or a `serve` process a prefix of their own without a
/// [`TestSchema`]: the fast path's keys live for a route's ttl (a day by
/// default), so a test that does not delete them leaves them behind.
pub struct RedisPrefix(pub String);

impl Drop for RedisPrefix {
    fn drop(&mut self) {
        let prefix = self.0.clone();
        let cleanup = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                delete_redis_prefix_or_say(&prefix).await;
            });
        });
        let _ = cleanup.join();
    }
}
