//! A private Redis Cluster: `redis-server --cluster-enabled yes` nodes on
//! free ports (client and bus ports both chosen here) in a temporary
//! directory, joined with `redis-cli --cluster create --cluster-replicas 0`,
//! ready once every node reports `cluster_state:ok`. Nodes can be killed
//! one by one; all are killed and the directory removed on drop.

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
}

impl RedisCluster {
    /// Starts `n` (at least 3) primaries sharing the 16384 slots.
    pub fn start(n: usize) -> Self {
        assert!(n >= 3, "a Redis Cluster needs at least three primaries");
        let dir = tempfile::TempDir::new().expect("tempdir");
        let mut cluster = Self {
            nodes: Vec::new(),
            dir,
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
        let addrs: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create (is redis-tools installed?)");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + Duration::from_secs(15);
        for port in cluster.ports() {
            while !command(port, "CLUSTER INFO").contains("cluster_state:ok") {
                assert!(
                    Instant::now() < deadline,
                    "the cluster did not reach cluster_state:ok within 15 s"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        cluster
    }

    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
    }

    /// The seed URL: the first node.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.nodes[0].port)
    }

    /// How many keys node `i` holds (`DBSIZE`).
    pub fn keys_on(&self, i: usize) -> u64 {
        let reply = command(self.nodes[i].port, "DBSIZE");
        reply
            .trim_start_matches(':')
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("DBSIZE answered {reply:?}"))
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
