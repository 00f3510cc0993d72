//! A private PgBouncer in transaction pooling mode, in front of the shared
//! PostgreSQL (`IDEMGATE_TEST_DATABASE_URL`) or another server
//! ([`PrivatePgBouncer::in_front_of`]), on a free port; killed and its
//! directory removed on drop.
//!
//! It runs as the `postgres` OS user (PgBouncer refuses root), trusts every
//! client (`auth_type = trust`) and logs into PostgreSQL with the shared
//! URL's user and password. Its server pool is small on purpose
//! ([`SERVER_POOL`]): a proxy's connections then share server connections,
//! as they do in production, so anything that relies on session state
//! breaks here too. Clients get no TLS (`client_tls_sslmode = disable`).

use super::pg_cluster::postgres_ids;
use super::services::database_url;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Server connections per (database, user): fewer than a proxy's pool.
pub const SERVER_POOL: usize = 3;

pub struct PrivatePgBouncer {
    pub port: u16,
    /// `user@.../db` of the URL clients use.
    user: String,
    database: String,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl PrivatePgBouncer {
    pub fn start() -> Self {
        Self::start_with("")
    }

    /// One that accepts and drops the `options` startup parameter (as some
    /// deployments configure it), so a client that prepares statements by
    /// name gets as far as running them.
    pub fn start_ignoring_options() -> Self {
        Self::start_with("ignore_startup_parameters = options\n")
    }

    fn start_with(extra: &str) -> Self {
        Self::start_for(&database_url(), extra)
    }

    /// One in front of the server `url` names (e.g. a private cluster),
    /// with `extra` lines in its `[pgbouncer]` section.
    pub fn in_front_of(url: &str, extra: &str) -> Self {
        Self::start_for(url, extra)
    }

    fn start_for(url: &str, extra: &str) -> Self {
        let (uid, gid) = postgres_ids();
        let shared: tokio_postgres::Config = url.parse().expect("the server's URL parses");
        let host = match shared.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".into(),
        };
        let port = shared.get_ports().first().copied().unwrap_or(5432);
        let user = shared.get_user().unwrap_or("postgres").to_string();
        let database = shared.get_dbname().unwrap_or("test").to_string();
        let password = shared
            .get_password()
            .map(|p| format!(" password={}", String::from_utf8_lossy(p)))
            .unwrap_or_default();
        let dir = tempfile::Builder::new()
            .prefix("idemgate-pgbouncer-")
            .tempdir()
            .expect("tempdir for pgbouncer");
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).expect("chown");
        let listen = super::free_port().port();
        let ini = dir.path().join("pgbouncer.ini");
        let userlist = dir.path().join("userlist.txt");
        std::fs::write(&userlist, format!("\"{user}\" \"\"\n")).expect("write userlist");
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host={host} port={port} user={user}{password}\n\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\n\
                 unix_socket_dir =\nauth_type = trust\nauth_file = {userlist}\n\
                 pool_mode = transaction\ndefault_pool_size = {SERVER_POOL}\n\
                 max_client_conn = 200\nlogfile = {log}\nadmin_users = {user}\n{extra}",
                userlist = userlist.display(),
                log = dir.path().join("pgbouncer.log").display(),
            ),
        )
        .expect("write pgbouncer.ini");
        for f in [&ini, &userlist] {
            std::os::unix::fs::chown(f, Some(uid), Some(gid)).expect("chown");
        }
        let child = Command::new("pgbouncer")
            .arg(&ini)
            .uid(uid)
            .gid(gid)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pgbouncer (apt-get install pgbouncer; scripts/test.sh installs it)");
        let mut bouncer = Self {
            port: listen,
            user,
            database,
            child: Some(child),
            dir,
        };
        bouncer.wait_listening();
        bouncer
    }

    fn wait_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], self.port));
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                panic!("pgbouncer exited ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "pgbouncer did not listen within 10 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The database behind this PgBouncer, through it, `query` appended.
    pub fn url(&self, query: &str) -> String {
        let sep = if query.is_empty() { "" } else { "?" };
        format!(
            "postgres://{}@127.0.0.1:{}/{}{sep}{query}",
            self.user, self.port, self.database
        )
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PrivatePgBouncer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
