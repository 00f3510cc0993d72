//! A private Redis Sentinel setup: a master, one replica (`--replicaof`)
//! and three sentinels (`redis-server <conf> --sentinel`, each with its own
//! config file, which Sentinel rewrites, in a temporary directory), all on
//! free ports. Sentinel is tuned to act within about a second of a kill:
//! `down-after-milliseconds` 500, `failover-timeout` 2000, quorum 2. Ready
//! once every sentinel sees the replica and the two other sentinels (a
//! failover needs a majority that knows each other). The master can be
//! killed (SIGKILL); everything is killed and the directory removed on drop.
//! [`SentinelSet::start_with_auth`] sets a password on the master and the
//! replica (`requirepass`, `masterauth`, `sentinel auth-pass`) and another
//! on the sentinels (`requirepass`, `sentinel sentinel-pass`).
//! [`SentinelSet::start_tls`] runs every server and sentinel on TLS only
//! (`tls-port`, `port 0`, `tls-replication yes`), with a certificate for
//! `localhost` and `127.0.0.1` (Sentinel names masters by address).

use super::redis_tls::{TestPki, SERVER_NAME};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "idemgate-test";

/// How long setup and a failover may take before the test fails.
const SETTLE: Duration = Duration::from_secs(20);

struct Server {
    port: u16,
    child: Option<Child>,
}

/// The passwords of [`SentinelSet::start_with_auth`].
#[derive(Clone)]
pub struct Auth {
    pub master: String,
    pub sentinel: String,
}

pub struct SentinelSet {
    /// `[0]` the first master, `[1]` its replica.
    servers: Vec<Server>,
    auth: Option<Auth>,
    /// Under [`SentinelSet::start_tls`]: the certificates.
    tls: Option<TestPki>,
    sentinels: Vec<Server>,
    dir: tempfile::TempDir,
}

impl SentinelSet {
    pub fn start() -> Self {
        Self::start_auth(None, None)
    }

    pub fn start_with_auth(auth: Auth) -> Self {
        Self::start_auth(Some(auth), None)
    }

    pub fn start_tls() -> Self {
        Self::start_auth(
            None,
            Some(TestPki::generate_for(&[SERVER_NAME, "127.0.0.1"])),
        )
    }

    /// Under [`SentinelSet::start_tls`], the CA file that signed every
    /// server's certificate.
    pub fn ca_file(&self) -> Option<String> {
        self.tls.as_ref().map(TestPki::ca)
    }

    fn start_auth(auth: Option<Auth>, tls: Option<TestPki>) -> Self {
        let dir = tempfile::TempDir::new().expect("tempdir");
        let master = super::free_port().port();
        let replica = super::free_port().port();
        let mut set = Self {
            auth: auth.clone(),
            tls,
            servers: Vec::new(),
            sentinels: Vec::new(),
            dir,
        };
        let pass = auth.as_ref().map(|a| a.master.as_str());
        let dir = set.dir.path().to_path_buf();
        let pki = set.tls.as_ref();
        set.servers
            .push(spawn_server(&dir, master, None, pass, pki));
        set.servers
            .push(spawn_server(&dir, replica, Some(master), pass, pki));
        let tls_lines = match pki {
            Some(pki) => format!(
                "port 0\ntls-port {{port}}\ntls-cert-file {}\ntls-key-file {}\n\
                 tls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\n",
                pki.path("server.pem").display(),
                pki.path("server.key").display(),
                pki.ca()
            ),
            None => "port {port}\n".to_string(),
        };
        let auth_lines = match &auth {
            Some(a) => format!(
                "sentinel auth-pass {MASTER_NAME} {}\nrequirepass {}\nsentinel sentinel-pass {}\n",
                a.master, a.sentinel, a.sentinel
            ),
            None => String::new(),
        };
        for i in 0..3 {
            let port = super::free_port().port();
            let conf = set.dir.path().join(format!("sentinel-{i}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "{ports}bind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {MASTER_NAME} 127.0.0.1 {master} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 500\n\
                     sentinel failover-timeout {MASTER_NAME} 2000\n\
                     sentinel parallel-syncs {MASTER_NAME} 1\n{auth_lines}",
                    dir = set.dir.path().display(),
                    ports = tls_lines.replace("{port}", &port.to_string()),
                ),
            )
            .expect("write a sentinel config");
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .current_dir(set.dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server --sentinel (is redis-server installed and on PATH?)");
            set.sentinels.push(Server {
                port,
                child: Some(child),
            });
        }
        set.wait_settled();
        set
    }

    /// `"127.0.0.1:port"` of each sentinel, for `redis.sentinels`.
    pub fn sentinel_addrs(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port))
            .collect()
    }

    /// The port of the first replica (the one a failover promotes).
    pub fn replica_port(&self) -> u16 {
        self.servers[1].port
    }

    /// The port of the server the sentinels call the master now.
    pub fn master_port(&self) -> u16 {
        for s in &self.sentinels {
            if let Ok(addr) = self.query_sentinel::<Vec<String>>(
                s.port,
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(MASTER_NAME),
            ) {
                if let Some(port) = addr.get(1).and_then(|p| p.parse().ok()) {
                    return port;
                }
            }
        }
        panic!("no sentinel names a master");
    }

    /// Makes every sentinel watch the server at `port` under
    /// [`MASTER_NAME`] instead (`SENTINEL REMOVE`, then `MONITOR`): the
    /// sentinels name another master while the old one stays up, and
    /// still a master, as on the far side of a partition.
    pub fn monitor_instead(&self, port: u16) {
        for s in &self.sentinels {
            let remove = redis::cmd("SENTINEL")
                .arg("REMOVE")
                .arg(MASTER_NAME)
                .to_owned();
            let _: redis::Value = self
                .query_sentinel(s.port, &remove)
                .expect("SENTINEL REMOVE");
            let monitor = redis::cmd("SENTINEL")
                .arg("MONITOR")
                .arg(MASTER_NAME)
                .arg("127.0.0.1")
                .arg(port)
                .arg(2)
                .to_owned();
            let _: redis::Value = self
                .query_sentinel(s.port, &monitor)
                .expect("SENTINEL MONITOR");
        }
    }

    /// Kills the current master (SIGKILL); returns its port.
    pub fn kill_master(&mut self) -> u16 {
        let port = self.master_port();
        let server = self
            .servers
            .iter_mut()
            .find(|s| s.port == port)
            .expect("the master is one of ours");
        if let Some(mut child) = server.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        port
    }

    /// Waits until the sentinels name a master other than `old` and that
    /// server says `role:master`; returns its port.
    pub fn wait_promoted(&self, old: u16) -> u16 {
        let deadline = Instant::now() + SETTLE;
        loop {
            let port = self.master_port();
            if port != old && self.role(port).as_deref() == Some("master") {
                return port;
            }
            assert!(
                Instant::now() < deadline,
                "no replica was promoted within {SETTLE:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The key names under `pattern` on the server at `port`.
    pub fn keys(&self, port: u16, pattern: &str) -> Vec<String> {
        self.query_server(port, redis::cmd("KEYS").arg(pattern))
            .expect("KEYS")
    }

    /// A raw value, `None` if absent.
    pub fn get(&self, port: u16, name: &str) -> Option<Vec<u8>> {
        self.query_server(port, redis::cmd("GET").arg(name))
            .expect("GET")
    }

    /// Sets a raw value with a PX expiry.
    pub fn set_px(&self, port: u16, name: &str, value: &[u8], px: u64) {
        let set = redis::cmd("SET")
            .arg(name)
            .arg(value)
            .arg("PX")
            .arg(px)
            .to_owned();
        let _: () = self.query_server(port, &set).expect("SET");
    }

    /// Whether the master or a sentinel answers a PING without a password.
    pub fn answers_without_password(&self) -> bool {
        let ping = redis::cmd("PING");
        let tls = self.tls.as_ref();
        query::<String>(self.master_port(), None, tls, &ping).is_ok()
            || query::<String>(self.sentinels[0].port, None, tls, &ping).is_ok()
    }

    fn query_server<T: redis::FromRedisValue>(
        &self,
        port: u16,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        let password = self.auth.as_ref().map(|a| a.master.as_str());
        query(port, password, self.tls.as_ref(), cmd)
    }

    fn query_sentinel<T: redis::FromRedisValue>(
        &self,
        port: u16,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<T> {
        let password = self.auth.as_ref().map(|a| a.sentinel.as_str());
        query(port, password, self.tls.as_ref(), cmd)
    }

    /// `role:` from `INFO replication`, `None` if the server does not answer.
    pub fn role(&self, port: u16) -> Option<String> {
        let info: String = self
            .query_server(port, redis::cmd("INFO").arg("replication"))
            .ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix("role:"))
            .map(|r| r.trim().to_string())
    }

    /// Until every sentinel sees the replica and the two other sentinels.
    fn wait_settled(&mut self) {
        let deadline = Instant::now() + SETTLE;
        loop {
            let ready = self.sentinels.iter().all(|s| {
                let Ok(info) = self.query_sentinel::<std::collections::HashMap<String, String>>(
                    s.port,
                    redis::cmd("SENTINEL").arg("master").arg(MASTER_NAME),
                ) else {
                    return false;
                };
                let n = |k: &str| info.get(k).map(String::as_str) == Some("2");
                n("num-other-sentinels") && info.get("num-slaves").map(String::as_str) == Some("1")
            });
            if ready {
                return;
            }
            for s in self.servers.iter_mut().chain(self.sentinels.iter_mut()) {
                if let Some(Ok(Some(status))) = s.child.as_mut().map(|c| c.try_wait()) {
                    panic!(
                        "redis-server on port {} exited during setup: {status}",
                        s.port
                    );
                }
            }
            assert!(
                Instant::now() < deadline,
                "the sentinels did not find each other and the replica within {SETTLE:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        for s in self.servers.iter_mut().chain(self.sentinels.iter_mut()) {
            if let Some(mut child) = s.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// Runs in `dir`: a replica writes the master's snapshot there when it
/// syncs (`--save ""` does not stop that), never into the checkout.
fn spawn_server(
    dir: &std::path::Path,
    port: u16,
    replica_of: Option<u16>,
    password: Option<&str>,
    tls: Option<&TestPki>,
) -> Server {
    let mut args: Vec<String> = match tls {
        Some(pki) => [
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &pki.path("server.pem").display().to_string(),
            "--tls-key-file",
            &pki.path("server.key").display().to_string(),
            "--tls-ca-cert-file",
            &pki.ca(),
            "--tls-auth-clients",
            "no",
            "--tls-replication",
            "yes",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        None => vec!["--port".to_string(), port.to_string()],
    };
    args.extend([
        "--bind".into(),
        "127.0.0.1".into(),
        "--save".into(),
        String::new(),
        "--appendonly".into(),
        "no".into(),
        // A replica syncs at once (the default waits 5 s).
        "--repl-diskless-sync-delay".into(),
        "0".into(),
    ]);
    if let Some(pass) = password {
        args.extend([
            "--requirepass".into(),
            pass.into(),
            "--masterauth".into(),
            pass.into(),
        ]);
    }
    if let Some(master) = replica_of {
        args.extend(["--replicaof".into(), "127.0.0.1".into(), master.to_string()]);
    }
    let child = Command::new("redis-server")
        .args(&args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn redis-server (is it installed and on PATH?)");
    let mut server = Server {
        port,
        child: Some(child),
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while query::<String>(port, password, tls, &redis::cmd("PING")).is_err() {
        if let Some(Ok(Some(status))) = server.child.as_mut().map(|c| c.try_wait()) {
            panic!("redis-server on port {port} exited: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "redis-server on port {port} did not answer within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

/// One command to `127.0.0.1:port` on a fresh connection (500 ms bounds),
/// over TLS trusting `tls`'s CA if given.
fn query<T: redis::FromRedisValue>(
    port: u16,
    password: Option<&str>,
    tls: Option<&TestPki>,
    cmd: &redis::Cmd,
) -> redis::RedisResult<T> {
    let auth = password.map(|p| format!(":{p}@")).unwrap_or_default();
    let client = match tls {
        Some(pki) => redis::Client::build_with_tls(
            format!("rediss://{auth}127.0.0.1:{port}"),
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(pki.path("ca.pem"))?),
            },
        )?,
        None => redis::Client::open(format!("redis://{auth}127.0.0.1:{port}"))?,
    };
    let mut conn = client.get_connection_with_timeout(Duration::from_millis(500))?;
    conn.set_read_timeout(Some(Duration::from_millis(500)))?;
    cmd.query(&mut conn)
}
