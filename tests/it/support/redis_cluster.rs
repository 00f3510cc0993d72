//! A private Redis Cluster: `redis-server --cluster-enabled yes` nodes on
//! free ports (client and bus ports both chosen here) in a temporary
//! directory, joined with `redis-cli --cluster create --cluster-replicas 0`,
//! ready once every node reports `cluster_state:ok`. Nodes can be killed
//! one by one; all are killed and the directory removed on drop.
//!
//! [`RedisCluster::start_tls`] runs the same cluster over TLS only (client
//! and bus), with a test CA ([`TestPki`]); nodes announce the host name
//! `localhost` (the name on their certificate), as managed clusters
//! announce names rather than addresses.

use super::redis_tls::{spawn_tls_server, wait_listening, ClientAuth, TestPki, SERVER_NAME};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Node {
    port: u16,
    child: Option<Child>,
}

pub struct RedisCluster {
    nodes: Vec<Node>,
    dir: tempfile::TempDir,
    /// The certificates of a TLS cluster.
    pub pki: Option<TestPki>,
}

impl RedisCluster {
    /// Starts `n` (at least 3) primaries sharing the 16384 slots.
    pub fn start(n: usize) -> Self {
        Self::start_with_replicas(n, 0)
    }

    /// `primaries` primaries with `replicas` replicas each (failover).
    pub fn start_with_replicas(primaries: usize, replicas: usize) -> Self {
        let n = primaries * (1 + replicas);
        assert!(
            primaries >= 3,
            "a Redis Cluster needs at least three primaries"
        );
        let dir = tempfile::TempDir::new().expect("tempdir");
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
            pki: None,
        };
        for _ in 0..n {
            let (port, bus) = (super::free_port().port(), super::free_port().port());
            let child = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--cluster-port",
                    &bus.to_string(),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &format!("nodes-{port}.conf"),
                    // A killed node is noticed within a second.
                    "--cluster-node-timeout",
                    "1000",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    // A replica syncs at once (the default waits 5 s), so
                    // it can take over as soon as the test kills its primary.
                    "--repl-diskless-sync-delay",
                    "0",
                ])
                .current_dir(cluster.dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server (is it installed and on PATH?)");
            cluster.nodes.push(Node {
                port,
                child: Some(child),
            });
            cluster.wait_answering(port);
        }
        cluster.create(replicas);
        cluster
    }

    /// Like [`RedisCluster::start`], TLS only, announcing `localhost`.
    pub fn start_tls(n: usize) -> Self {
        assert!(n >= 3, "a Redis Cluster needs at least three primaries");
        let pki = TestPki::generate();
        let mut nodes = Vec::new();
        for _ in 0..n {
            let (port, bus) = (super::free_port().port(), super::free_port().port());
            let (bus, conf) = (bus.to_string(), format!("nodes-{port}.conf"));
            let child = spawn_tls_server(
                &pki,
                port,
                ClientAuth::No,
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    &conf,
                    "--cluster-port",
                    &bus,
                    "--cluster-node-timeout",
                    "1000",
                    "--tls-cluster",
                    "yes",
                    "--cluster-announce-hostname",
                    SERVER_NAME,
                    "--cluster-preferred-endpoint-type",
                    "hostname",
                ],
            );
            nodes.push(Node {
                port,
                child: Some(wait_listening(port, child)),
            });
        }
        let mut cluster = Self {
            nodes,
            dir: tempfile::TempDir::new().expect("tempdir"),
            pki: Some(pki),
        };
        cluster.create(0);
        cluster
    }

    /// `redis-cli --cluster create`, then waits for `cluster_state:ok`.
    fn create(&mut self, replicas: usize) {
        let addrs: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut cli = self.cli();
        let replicas = replicas.to_string();
        let out = cli.arg("--cluster").arg("create").args(&addrs).args([
            "--cluster-replicas",
            &replicas,
            "--cluster-yes",
        ]);
        let out = bounded_output(out, Duration::from_secs(20));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(15);
        for port in self.ports() {
            while !self
                .command(port, "CLUSTER INFO")
                .contains("cluster_state:ok")
            {
                assert!(
                    Instant::now() < deadline,
                    "the cluster did not reach cluster_state:ok within 15 s"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        // A replica that has not synced never takes over.
        if replicas != "0" {
            for port in self.ports() {
                loop {
                    let info = self.command(port, "INFO replication");
                    if info.contains("role:master") || info.contains("master_link_status:up") {
                        break;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "replica {port} did not sync within 15 s:\n{info}"
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// `redis-cli`, with the CA for a TLS cluster.
    fn cli(&self) -> Command {
        let mut cmd = Command::new("redis-cli");
        if let Some(pki) = &self.pki {
            cmd.args(["--tls", "--cacert"]).arg(pki.ca());
        }
        cmd
    }

    /// One command to the node on `port`; its reply as text ("" when it
    /// does not answer).
    fn command(&self, port: u16, line: &str) -> String {
        if self.pki.is_none() {
            return command(port, line);
        }
        self.cli()
            .args(["-p", &port.to_string()])
            .args(line.split(' '))
            .stdin(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default()
    }

    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The seed URL: the first node.
    pub fn url(&self) -> String {
        match self.pki {
            None => format!("redis://127.0.0.1:{}", self.nodes[0].port),
            Some(_) => format!("rediss://{SERVER_NAME}:{}", self.nodes[0].port),
        }
    }

    /// How many keys node `i` holds (`DBSIZE`).
    pub fn keys_on(&self, i: usize) -> u64 {
        let reply = self.command(self.nodes[i].port, "DBSIZE");
        reply
            .trim_start_matches(':')
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("DBSIZE answered {reply:?}"))
    }

    /// Kills a primary that has a replica, other than the seed (SIGKILL);
    /// returns its index. Its replica takes over after the node timeout.
    pub fn kill_a_replicated_primary(&mut self) -> usize {
        let nodes = self.command(self.nodes[0].port, "CLUSTER NODES");
        // <id> <ip:port@bus[,hostname]> <flags> <primary id or -> ...
        let fields: Vec<Vec<&str>> = nodes
            .lines()
            .map(|l| l.split(' ').collect::<Vec<_>>())
            .filter(|f| f.len() > 3)
            .collect();
        let port_of = |addr: &str| -> Option<u16> {
            addr.split(['@', ','])
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()
        };
        let victim = fields
            .iter()
            .filter(|f| f[2].contains("master") && port_of(f[1]) != Some(self.nodes[0].port))
            .find(|f| fields.iter().any(|r| r[3] == f[0]))
            .and_then(|f| port_of(f[1]))
            .unwrap_or_else(|| panic!("no replicated primary besides the seed:\n{nodes}"));
        let i = self
            .nodes
            .iter()
            .position(|n| n.port == victim)
            .expect("the primary is one of ours");
        self.kill(i);
        i
    }

    /// Holds every replica's replication stream (`CLIENT PAUSE <ms>
    /// WRITE` on the replica: it stops applying what its primary sends,
    /// still answers reads and stays connected) for up to `ms`, or, with
    /// `None`, lets them catch up again (`CLIENT UNPAUSE`); returns how
    /// many replicas. A held replica is one that lags: a failover to it
    /// now would lose the writes it holds back.
    pub fn hold_replicas(&self, ms: Option<u64>) -> usize {
        let nodes = self.command(self.nodes[0].port, "CLUSTER NODES");
        let replica_ports: Vec<u16> = nodes
            .lines()
            .map(|l| l.split(' ').collect::<Vec<_>>())
            .filter(|f| f.len() > 3 && f[2].contains("slave"))
            .filter_map(|f| {
                f[1].split(['@', ','])
                    .next()?
                    .rsplit(':')
                    .next()?
                    .parse()
                    .ok()
            })
            .collect();
        let line = match ms {
            Some(ms) => format!("CLIENT PAUSE {ms} WRITE"),
            None => "CLIENT UNPAUSE".to_string(),
        };
        for port in &replica_ports {
            let reply = self.command(*port, &line);
            assert!(reply.starts_with("+OK"), "{line} on {port}: {reply:?}");
        }
        replica_ports.len()
    }

    /// Waits (bounded) until every live node reports `cluster_state:ok`.
    pub fn wait_ok(&self, within: Duration) {
        let deadline = Instant::now() + within;
        let live: Vec<u16> = self
            .nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect();
        for port in live {
            while !self
                .command(port, "CLUSTER INFO")
                .contains("cluster_state:ok")
            {
                assert!(
                    Instant::now() < deadline,
                    "the cluster did not recover within {within:?}: node {port}:\n{}",
                    self.command(port, "CLUSTER NODES")
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Kills node `i` (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn wait_answering(&mut self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !command(port, "PING").starts_with("+PONG") {
            let node = self.nodes.last_mut().expect("a node");
            if let Some(Ok(Some(status))) = node.child.as_mut().map(|c| c.try_wait()) {
                panic!("redis-server --cluster-enabled on port {port} exited: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {port} did not answer within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

/// One inline command to `127.0.0.1:port`; the raw reply, or "" when the
/// node does not answer.
fn command(port: u16, line: &str) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(format!("{line}\r\n").as_bytes()).is_err() {
        return String::new();
    }
    let mut buf = vec![0u8; 8192];
    let mut out = Vec::new();
    // Bulk replies (CLUSTER INFO) may come in more than one read.
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if complete(&out) {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `reply` is one whole RESP reply: a line, or a bulk string
/// (`$len\r\n` + len bytes + `\r\n`).
fn complete(reply: &[u8]) -> bool {
    let Some(eol) = reply.windows(2).position(|w| w == b"\r\n") else {
        return false;
    };
    if reply[0] != b'$' {
        return true;
    }
    let len: i64 = String::from_utf8_lossy(&reply[1..eol])
        .parse()
        .unwrap_or(-1);
    len < 0 || reply.len() >= eol + 2 + len as usize + 2
}

/// Runs `cmd` to completion within `limit` (`redis-cli --cluster create`
/// waits forever for nodes that cannot meet); kills it and panics past it.
fn bounded_output(cmd: &mut Command, limit: Duration) -> std::process::Output {
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("run redis-cli (is redis-tools installed?)");
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} did not finish within {limit:?}:\n{}",
                std::fs::read_to_string(&out).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::process::Output {
        status,
        stdout: std::fs::read(&out).unwrap_or_default(),
        stderr: std::fs::read(&err).unwrap_or_default(),
    }
}
