//! A private PostgreSQL cluster with TLS, for the tests that need a server
//! configured their own way (a CA of their own, client certificates)
//! without touching the machine's shared one.
//!
//! [`PgCluster::shared`] runs `initdb` as the `postgres` OS user into a
//! temporary directory (tests run as root; PostgreSQL refuses root), with
//! a CA, a server certificate for `localhost`/`127.0.0.1` and a client
//! certificate for the role `certuser`, all generated here with rcgen. It
//! listens on 127.0.0.1 on a free port, durability off (fsync, full page
//! writes) to start fast. Tests running at the same time share one cluster;
//! the last one to finish drops it, which stops the server and removes
//! the directory.
//!
//! [`PgCluster::private`] starts one of a test's own, with settings of its
//! own appended (e.g. `synchronous_commit = off`, `ssl = off`), that the
//! test may crash ([`PgCluster::kill`]: SIGKILL to the postmaster and
//! every process of it) and start again on the same port and data
//! ([`PgCluster::restart`]).
//!
//! `pg_hba.conf`: `certuser` must present a client certificate
//! (`hostssl ... clientcert=verify-full`), `scramuser` a password
//! (SCRAM-SHA-256, TLS only); everyone else is trusted over TLS or plain
//! TCP.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The role that must authenticate with a client certificate.
pub const CERT_USER: &str = "certuser";

/// The role that authenticates with a password (SCRAM-SHA-256) over TLS.
pub const SCRAM_USER: &str = "scramuser";
pub const SCRAM_PASSWORD: &str = "scram-secret-pw";

/// A running private cluster and the files a client needs.
pub struct PgCluster {
    pub port: u16,
    /// The CA that signed the server's and the client's certificates.
    pub ca: PathBuf,
    /// A CA that signed nothing here (to prove a certificate is not trusted).
    pub other_ca: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    dir: tempfile::TempDir,
    data: PathBuf,
    postmaster: Option<Child>,
}

/// The one cluster tests share while any of them holds it.
static SHARED: Mutex<Weak<PgCluster>> = Mutex::new(Weak::new());

impl PgCluster {
    /// The cluster the running tests share, started when none is running.
    pub fn shared() -> Arc<PgCluster> {
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cluster) = shared.upgrade() {
            return cluster;
        }
        let cluster = Arc::new(Self::start());
        *shared = Arc::downgrade(&cluster);
        cluster
    }

    /// `postgres://{user}@{host}:{port}/postgres?{query}`.
    pub fn url(&self, user: &str, host: &str, query: &str) -> String {
        let sep = if query.is_empty() { "" } else { "?" };
        format!(
            "postgres://{user}@{host}:{}/postgres{sep}{query}",
            self.port
        )
    }

    /// A cluster of the caller's own (not shared), with `settings`
    /// (`postgresql.conf` lines) appended after the defaults, which they
    /// override.
    pub fn private(settings: &str) -> Self {
        Self::start_with(settings)
    }

    fn start() -> Self {
        Self::start_with("")
    }

    fn start_with(settings: &str) -> Self {
        let bin = postgres_bin_dir();
        let (uid, gid) = postgres_ids();
        let dir = tempfile::Builder::new()
            .prefix("idemgate-pg-")
            .tempdir()
            .expect("tempdir for the private cluster");
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown the cluster dir");
        let data = dir.path().join("data");
        let certs = Certs::write(dir.path(), uid, gid);
        let mut initdb = Command::new(bin.join("initdb"));
        initdb.args(["-D", &data.display().to_string()]).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
        ]);
        run_as_postgres(initdb, "initdb (install postgresql)");
        let port = super::free_port().port();
        let conf = format!(
            "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{dir}'\n\
             fsync = off\nfull_page_writes = off\nsynchronous_commit = off\n\
             max_connections = 60\nshared_buffers = 16MB\n\
             ssl = on\nssl_cert_file = '{cert}'\nssl_key_file = '{key}'\nssl_ca_file = '{ca}'\n",
            dir = dir.path().display(),
            cert = certs.server_cert.display(),
            key = certs.server_key.display(),
            ca = certs.ca.display(),
        );
        append(
            &data.join("postgresql.conf"),
            &format!("{conf}{settings}\n"),
        );
        let hba = format!(
            "local all all trust\n\
             hostssl all {CERT_USER} 127.0.0.1/32 trust clientcert=verify-full\n\
             hostssl all {SCRAM_USER} 127.0.0.1/32 scram-sha-256\n\
             host all {CERT_USER} 127.0.0.1/32 reject\n\
             host all all 127.0.0.1/32 trust\n\
             host replication all 127.0.0.1/32 trust\n"
        );
        std::fs::write(data.join("pg_hba.conf"), hba).expect("write pg_hba.conf");
        let mut cluster = Self {
            port,
            ca: certs.ca,
            other_ca: certs.other_ca,
            client_cert: certs.client_cert,
            client_key: certs.client_key,
            dir,
            data,
            postmaster: None,
        };
        cluster.spawn_postmaster(&bin);
        let psql = Command::new(bin.join("psql"))
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
            .args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qc"])
            .arg(format!(
                "CREATE ROLE {CERT_USER} LOGIN SUPERUSER; \
                 SET password_encryption = 'scram-sha-256'; \
                 CREATE ROLE {SCRAM_USER} LOGIN SUPERUSER PASSWORD '{SCRAM_PASSWORD}'"
            ))
            .env("PGSSLMODE", "disable")
            .output()
            .expect("run psql");
        assert!(
            psql.status.success(),
            "create role: {}",
            String::from_utf8_lossy(&psql.stderr)
        );
        cluster
    }

    /// Starts the postmaster on the data directory and waits until it
    /// accepts connections.
    fn spawn_postmaster(&mut self, bin: &Path) {
        let (uid, gid) = postgres_ids();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("postgres.log"))
            .expect("log file");
        let postmaster = Command::new(bin.join("postgres"))
            .args(["-D", &self.data.display().to_string()])
            .uid(uid)
            .gid(gid)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start postgres");
        self.postmaster = Some(postmaster);
        self.wait_ready(bin);
    }

    /// SIGKILL to the postmaster (its pid from the first line of
    /// `postmaster.pid`), then to every process it had started (backends,
    /// WAL sender and writer, checkpointer): the server dies at once, as
    /// when its machine loses power, with no shutdown code run anywhere,
    /// no checkpoint and the WAL buffers not written out. The postmaster
    /// is SIGSTOPped first so that it forks nothing while its children
    /// are listed; returns once every one of them is gone, so that the
    /// cluster can be [`restart`](Self::restart)ed (and its directory
    /// removed) with nothing of it left running.
    pub fn kill(&mut self) {
        let mut child = self.postmaster.take().expect("the cluster is running");
        let pid_file =
            std::fs::read_to_string(self.data.join("postmaster.pid")).expect("read postmaster.pid");
        let pid: u32 = pid_file
            .lines()
            .next()
            .and_then(|l| l.trim().parse().ok())
            .expect("postmaster.pid starts with the postmaster's pid");
        assert_eq!(pid, child.id(), "postmaster.pid names the postmaster");
        signal(pid, "-STOP");
        let children = children_of(pid);
        signal(pid, "-KILL");
        let _ = child.wait();
        for &c in &children {
            signal(c, "-KILL");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(c) = children.iter().find(|&&c| alive(c)) {
            assert!(
                Instant::now() < deadline,
                "process {c} of the SIGKILLed cluster still runs"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts it again on the same port and data (crash recovery replays
    /// the WAL that reached the files).
    pub fn restart(&mut self) {
        assert!(self.postmaster.is_none(), "stop it first");
        self.spawn_postmaster(&postgres_bin_dir());
    }

    fn wait_ready(&mut self, bin: &Path) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = Command::new(bin.join("pg_isready"))
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return;
            }
            if let Some(Ok(Some(status))) = self.postmaster.as_mut().map(|c| c.try_wait()) {
                panic!("private postgres exited ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "private postgres did not start in 30 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A streaming standby of this cluster (`pg_basebackup -R`), on a port
    /// and in a directory of its own, with `settings` appended, started;
    /// its TLS files are this cluster's, so it must not outlive it.
    pub fn standby(&self, settings: &str) -> PgCluster {
        let bin = postgres_bin_dir();
        let (uid, gid) = postgres_ids();
        let dir = tempfile::Builder::new()
            .prefix("idemgate-pg-standby-")
            .tempdir()
            .expect("tempdir for the standby");
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown the standby dir");
        let data = dir.path().join("data");
        let mut backup = Command::new(bin.join("pg_basebackup"));
        backup
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args(["-D", &data.display().to_string()])
            .args(["-R", "-X", "stream", "--no-sync", "--checkpoint=fast"])
            .env("PGSSLMODE", "disable");
        run_as_postgres(backup, "pg_basebackup");
        let port = super::free_port().port();
        append(
            &data.join("postgresql.conf"),
            &format!(
                "\nport = {port}\nunix_socket_directories = '{}'\nhot_standby = on\n{settings}\n",
                dir.path().display()
            ),
        );
        let mut standby = Self {
            port,
            ca: self.ca.clone(),
            other_ca: self.other_ca.clone(),
            client_cert: self.client_cert.clone(),
            client_key: self.client_key.clone(),
            dir,
            data,
            postmaster: None,
        };
        standby.spawn_postmaster(&bin);
        standby
    }

    /// `pg_ctl promote`: a standby becomes a primary (waits until it is).
    pub fn promote(&self) {
        let mut pg_ctl = Command::new(postgres_bin_dir().join("pg_ctl"));
        pg_ctl.args(["promote", "-w", "-D"]).arg(&self.data);
        run_as_postgres(pg_ctl, "pg_ctl promote");
    }

    /// Sends `sig` (`-STOP`, `-CONT`) to this primary's WAL sender: a
    /// stopped sender holds its standby back (what it had not sent yet
    /// stays on the primary; a stopped receiver would still find it in its
    /// socket).
    pub fn signal_wal_sender(&self, sig: &str) {
        let pid = self.query("SELECT pid FROM pg_stat_replication");
        let ok = Command::new("kill")
            .args([sig, &pid])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid} (the WAL sender)");
    }

    /// The first column of the first row of `sql`, as text.
    pub fn query(&self, sql: &str) -> String {
        let (uid, gid) = postgres_ids();
        let out = Command::new(postgres_bin_dir().join("psql"))
            .args(["-h", &self.dir.path().display().to_string()])
            .args(["-p", &self.port.to_string(), "-U", "postgres"])
            .args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-tAqc", sql])
            .uid(uid)
            .gid(gid)
            .stdin(Stdio::null())
            .output()
            .expect("run psql");
        assert!(
            out.status.success(),
            "psql {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Waits (up to 30 s) until `sql` gives `want`.
    pub fn wait_for_value(&self, sql: &str, want: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.query(sql);
            if got == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{sql:?} gave {got:?}, not {want:?}, for 30 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs `sql` as the superuser (over the socket directory: no TLS).
    pub fn psql(&self, sql: &str) {
        let mut psql = Command::new(postgres_bin_dir().join("psql"));
        psql.args(["-h", &self.dir.path().display().to_string()])
            .args(["-p", &self.port.to_string(), "-U", "postgres"])
            .args(["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qc", sql]);
        run_as_postgres(psql, &format!("psql {sql:?}"));
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if let Some(mut child) = self.postmaster.take() {
            // SIGQUIT: immediate shutdown, backends included.
            let _ = Command::new("kill")
                .args(["-QUIT", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // The TempDir removes the data directory after this.
    }
}

/// `kill {sig} {pid}`; a process already gone is not an error.
fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// The pids whose parent is `parent` (from `/proc/<pid>/stat`).
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // "pid (comm) state ppid ...": comm may hold spaces.
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

/// Whether `pid` still runs (a zombie waiting to be reaped does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next().map(str::to_string))
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// `/usr/lib/postgresql/<newest>/bin`.
fn postgres_bin_dir() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("no /usr/lib/postgresql: install postgresql (apt-get install postgresql)")
        .filter_map(|e| {
            let e = e.ok()?;
            let v = e.file_name().to_str()?.parse().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .expect("no /usr/lib/postgresql/*/bin/initdb: install postgresql")
}

/// Runs a PostgreSQL tool as the `postgres` OS user to completion; panics
/// with its stderr, naming `what`, unless it succeeds.
fn run_as_postgres(mut cmd: Command, what: &str) {
    let (uid, gid) = postgres_ids();
    let out = cmd
        .uid(uid)
        .gid(gid)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `postgres` OS user's uid and gid (PostgreSQL refuses to run as root).
pub fn postgres_ids() -> (u32, u32) {
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("run id");
        assert!(
            out.status.success(),
            "no `postgres` OS user: install postgresql"
        );
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("id prints a number")
    };
    (id("-u"), id("-g"))
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    f.write_all(text.as_bytes()).expect("append");
}

/// The PEM files a TLS test needs, written into the cluster's directory.
struct Certs {
    ca: PathBuf,
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

impl Certs {
    fn write(dir: &Path, uid: u32, gid: u32) -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
            IsCa, KeyPair, KeyUsagePurpose,
        };
        let ca_params = |name: &str| {
            let mut params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![
                KeyUsagePurpose::KeyCertSign,
                KeyUsagePurpose::CrlSign,
                KeyUsagePurpose::DigitalSignature,
            ];
            params.distinguished_name.push(DnType::CommonName, name);
            params
        };
        let ca = CertifiedIssuer::self_signed(
            ca_params("idemgate test CA"),
            KeyPair::generate().unwrap(),
        )
        .expect("self-sign the CA");
        let other = CertifiedIssuer::self_signed(
            ca_params("idemgate unrelated CA"),
            KeyPair::generate().unwrap(),
        )
        .expect("self-sign the other CA");
        let mut server =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .expect("server params");
        server
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate().unwrap();
        let server_cert = server.signed_by(&server_key, &ca).expect("sign server");
        let mut client = CertificateParams::new(Vec::<String>::new()).expect("client params");
        // clientcert=verify-full: the CN must be the role's name.
        client
            .distinguished_name
            .push(DnType::CommonName, CERT_USER);
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate().unwrap();
        let client_cert = client.signed_by(&client_key, &ca).expect("sign client");

        let write = |name: &str, text: String, owner: bool| -> PathBuf {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {name}: {e}"));
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            if owner {
                std::os::unix::fs::chown(&path, Some(uid), Some(gid)).unwrap();
            }
            path
        };
        Certs {
            ca: write("ca.crt", ca.pem(), true),
            other_ca: write("other-ca.crt", other.pem(), false),
            server_cert: write("server.crt", server_cert.pem(), true),
            server_key: write("server.key", server_key.serialize_pem(), true),
            client_cert: write("client.crt", client_cert.pem(), false),
            client_key: write("client.key", client_key.serialize_pem(), false),
        }
    }
}

/// Protected traffic through `proxy` in front of `up`, the way a client
/// sees it: a claim that completes, its replay, a 409 while a key is in
/// flight, and a 422 for the same key with another body. Keys start with
/// `tag`.
pub async fn exercise(proxy: &super::Proxy, up: &super::Upstream, tag: &str) {
    use super::{Action, ORDERS};
    let first = proxy
        .post(ORDERS)
        .key(&format!("{tag}-1"))
        .body("a")
        .send()
        .await;
    assert_eq!(first.status(), 201, "{}", first.text());
    let again = proxy
        .post(ORDERS)
        .key(&format!("{tag}-1"))
        .body("a")
        .send()
        .await;
    assert_eq!(again.status(), 201);
    assert!(again.replayed(), "the retry is a replay");
    assert_eq!(again.body, first.body);
    let mismatch = proxy
        .post(ORDERS)
        .key(&format!("{tag}-1"))
        .body("b")
        .send()
        .await;
    mismatch.assert_problem(422);
    let before = up.hits(ORDERS);
    up.push(Action::Delay(Duration::from_millis(600)));
    let slow = tokio::spawn(proxy.post(ORDERS).key(&format!("{tag}-2")).body("a").send());
    up.wait_hits(ORDERS, before + 1).await;
    let busy = proxy
        .post(ORDERS)
        .key(&format!("{tag}-2"))
        .body("a")
        .send()
        .await;
    busy.assert_problem(409);
    assert_eq!(slow.await.expect("slow request").status(), 201);
    let done = proxy
        .post(ORDERS)
        .key(&format!("{tag}-2"))
        .body("a")
        .send()
        .await;
    assert!(done.replayed(), "completed after the 409");
    assert_eq!(up.hits(ORDERS), before + 1, "each key executed once");
}
