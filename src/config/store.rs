//! `[store]` and `[redis]`: where records are kept, and the Redis fast path
//! in front of PostgreSQL.

use super::raw::{RawRedis, RawStore};
use super::units::format_duration;
use super::{at_least_one, dur, env, mask_url, nonzero, Invalid};
use super::{
    DEFAULT_PG_CONNECT_TIMEOUT, DEFAULT_PG_POOL_SIZE, DEFAULT_PG_SCHEMA,
    DEFAULT_PG_STATEMENT_TIMEOUT, DEFAULT_REDIS_PREFIX, DEFAULT_REDIS_TIMEOUT, DEFAULT_SQLITE_PATH,
    DEFAULT_STORE_TIMEOUT, DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_INTERVAL,
};
use serde::Deserialize;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Sqlite,
    Memory,
    Postgres,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Memory => "memory",
            Backend::Postgres => "postgres",
        }
    }
}

/// SQLite's `synchronous` pragma. `full` fsyncs every commit so a claim
/// survives power loss; `normal` survives process crashes only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SqliteSync {
    Full,
    Normal,
}

/// What a stored response that was never sealed is, once responses are
/// sealed at rest (`store.plaintext_responses`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlaintextResponses {
    /// Replayed as stored: records written before keys were set keep
    /// working until they expire or `keys reencrypt` seals them.
    Replay,
    /// Unreadable (410, never executed again, counted as `plaintext`): once
    /// `check-config --connect` says no record is left unsealed, a
    /// plaintext record can only have been written by someone other than
    /// idemgate, and replaying it would serve their response.
    Refuse,
}

/// How PostgreSQL migrations (and sweeps) keep replicas from colliding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigrationLock {
    /// One transaction under `pg_advisory_xact_lock` (PostgreSQL, and
    /// PgBouncer in transaction mode); sweeps take a try-lock so one
    /// replica sweeps at a time.
    Advisory,
    /// No advisory locks and no transaction around the DDL, for engines
    /// that lack them (CockroachDB, YugabyteDB): run `idemgate migrate`
    /// once before starting replicas; concurrent sweeps skip each other's
    /// rows (`SKIP LOCKED`).
    None,
}

/// `Debug` masks the URL's password (see [`mask_url`]).
#[derive(Clone, PartialEq)]
pub struct StoreConfig {
    pub backend: Backend,
    pub path: PathBuf,
    pub synchronous: SqliteSync,
    pub url: Option<String>,
    /// PostgreSQL schema holding idemgate's tables (created if missing).
    pub schema: String,
    pub pool_size: usize,
    pub connect_timeout: Duration,
    pub statement_timeout: Duration,
    /// PostgreSQL only: see [`MigrationLock`].
    pub migration_lock: MigrationLock,
    /// PostgreSQL only: claim only while the primary has a synchronous
    /// standby (a failover then loses no acknowledged claim or answer).
    pub require_synchronous_replication: bool,
    /// With `IDEMGATE_STORE_ENCRYPTION_KEYS`: see [`PlaintextResponses`].
    pub plaintext_responses: PlaintextResponses,
    pub timeout: Duration,
    pub sweep_interval: Duration,
    pub sweep_batch: u32,
}

/// `Debug` masks the URL's password (see [`mask_url`]).
#[derive(Clone, PartialEq)]
pub struct RedisConfig {
    /// As written: `redis://`, `rediss://` (TLS), their Valkey aliases
    /// `valkey://` and `valkeys://`, or `unix://`. [`RedisConfig::client_url`]
    /// is what the client gets.
    pub url: String,
    pub timeout: Duration,
    pub prefix: String,
    /// `url` is one node of a Redis Cluster (the seed): the client learns
    /// the others from it and follows `MOVED`/`ASK` itself.
    pub cluster: bool,
    /// PEM CA bundle that replaces the system roots (TLS URLs only).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain and its private key, for servers that
    /// require client certificates (TLS URLs only; both or neither).
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// Redis Sentinel names the master instead of `url` (which is then
    /// empty): the fast path asks the sentinels where it is, and again
    /// after every connection-level failure.
    pub sentinel: Option<SentinelConfig>,
}

/// `redis.sentinels` and what goes with them. `Debug` masks the passwords.
#[derive(Clone, PartialEq)]
pub struct SentinelConfig {
    /// `host:port` of each sentinel, in the order they are asked.
    pub sentinels: Vec<(String, u16)>,
    /// The name the sentinels monitor the master under.
    pub master: String,
    /// The master's credentials (ACL user, or `requirepass` alone).
    pub username: Option<String>,
    pub password: Option<String>,
    /// TLS to the master and to the sentinels (`redis.tls`), with
    /// `redis.ca_file` / `cert_file` / `key_file`.
    pub tls: bool,
    /// The sentinels' own credentials, when they require them.
    pub sentinel_username: Option<String>,
    pub sentinel_password: Option<String>,
}

impl fmt::Debug for SentinelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let masked = |p: &Option<String>| p.as_ref().map(|_| "****");
        f.debug_struct("SentinelConfig")
            .field("sentinels", &self.sentinels)
            .field("master", &self.master)
            .field("username", &self.username)
            .field("password", &masked(&self.password))
            .field("tls", &self.tls)
            .field("sentinel_username", &self.sentinel_username)
            .field("sentinel_password", &masked(&self.sentinel_password))
            .finish()
    }
}

// === impl StoreConfig ===

impl StoreConfig {
    /// How many hosts `store.url` lists for PostgreSQL (0 for another
    /// backend): more than one, and the store is expected to fail over
    /// from one to another.
    pub fn postgres_hosts(&self) -> usize {
        match (&self.backend, &self.url) {
            (Backend::Postgres, Some(url)) => super::pg_url::PgUrl::parse(url)
                .and_then(|u| u.pg_config())
                .map_or(0, |c| c.get_hosts().len()),
            _ => 0,
        }
    }
}

impl TryFrom<RawStore> for StoreConfig {
    type Error = Invalid;

    fn try_from(s: RawStore) -> Result<Self, Invalid> {
        let backend = s.backend.unwrap_or(Backend::Sqlite);
        let url = match backend {
            Backend::Postgres => {
                let u = s.url.map(|u| u.into_inner()).ok_or_else(|| {
                    Invalid::field(
                        "store.url",
                        "store.url is required for backend = \"postgres\" (or set IDEMGATE_STORE_URL)",
                    )
                })?;
                if !(u.starts_with("postgres://") || u.starts_with("postgresql://")) {
                    return Err(Invalid::field(
                        "store.url",
                        format!(
                            "store.url: expected a postgres://user@host:port/db URL, got {}",
                            mask_url(&u)
                        ),
                    ));
                }
                // libpq's TLS parameters and pgbouncer=true: checked here so
                // check-config names a bad one; files are read at start.
                super::pg_url::PgUrl::parse(&u)
                    .and_then(|url| url.pg_config().map(|_| ()))
                    .map_err(|e| format!("store.url: {e}"))?;
                Some(u)
            }
            Backend::Sqlite | Backend::Memory => {
                // Written in the file, a URL for another backend is a
                // mistake; from the environment alone (often set alike for
                // every deployment) it is ignored.
                if let Some(u) = s.url.filter(|u| u.span() != env::NOT_IN_FILE) {
                    return Err(Invalid::at(
                        u.span(),
                        "store.url only applies to backend = \"postgres\"",
                    ));
                }
                None
            }
        };
        // Named at the first such key the file sets.
        let sqlite_only = [
            ("store.path", s.path.is_some()),
            ("store.synchronous", s.synchronous.is_some()),
        ];
        if let Some((key, _)) = sqlite_only
            .iter()
            .find(|(_, set)| *set && backend != Backend::Sqlite)
        {
            return Err(Invalid::field(
                *key,
                "store.path and store.synchronous only apply to backend = \"sqlite\"",
            ));
        }
        let postgres_only = [
            ("store.pool_size", s.pool_size.is_some()),
            ("store.schema", s.schema.is_some()),
            ("store.connect_timeout", s.connect_timeout.is_some()),
            ("store.statement_timeout", s.statement_timeout.is_some()),
            ("store.migration_lock", s.migration_lock.is_some()),
            (
                "store.require_synchronous_replication",
                s.require_synchronous_replication.is_some(),
            ),
        ];
        if let Some((key, _)) = postgres_only
            .iter()
            .find(|(_, set)| *set && backend != Backend::Postgres)
        {
            return Err(Invalid::field(
                *key,
                format!("{key} only applies to backend = \"postgres\""),
            ));
        }
        let pool_size = at_least_one(
            "store.pool_size",
            s.pool_size.unwrap_or(DEFAULT_PG_POOL_SIZE),
        )?;
        let sweep_batch = at_least_one(
            "store.sweep_batch",
            s.sweep_batch.unwrap_or(DEFAULT_SWEEP_BATCH),
        )?;
        let timeout = nonzero("store.timeout", dur(s.timeout, DEFAULT_STORE_TIMEOUT))?;
        let sweep_interval = nonzero(
            "store.sweep_interval",
            dur(s.sweep_interval, DEFAULT_SWEEP_INTERVAL),
        )?;
        let schema = s.schema.unwrap_or_else(|| DEFAULT_PG_SCHEMA.to_string());
        if schema.is_empty()
            || !schema
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            || schema.as_bytes()[0].is_ascii_digit()
        {
            return Err(Invalid::field(
                "store.schema",
                format!(
                    "store.schema {schema:?}: use lower-case letters, digits and '_', not starting with a digit"
                ),
            ));
        }
        Ok(StoreConfig {
            backend,
            schema,
            path: s.path.unwrap_or_else(|| PathBuf::from(DEFAULT_SQLITE_PATH)),
            synchronous: s.synchronous.unwrap_or(SqliteSync::Full),
            url,
            pool_size,
            connect_timeout: dur(s.connect_timeout, DEFAULT_PG_CONNECT_TIMEOUT),
            statement_timeout: dur(s.statement_timeout, DEFAULT_PG_STATEMENT_TIMEOUT),
            migration_lock: s.migration_lock.unwrap_or(MigrationLock::Advisory),
            require_synchronous_replication: s.require_synchronous_replication.unwrap_or(false),
            plaintext_responses: s.plaintext_responses.unwrap_or(PlaintextResponses::Replay),
            timeout,
            sweep_interval,
            sweep_batch,
        })
    }
}

/// One line, password masked.
impl fmt::Display for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("store      ")?;
        match self.backend {
            Backend::Sqlite => writeln!(
                f,
                "sqlite {} (synchronous = {})",
                self.path.display(),
                match self.synchronous {
                    SqliteSync::Full => "full",
                    SqliteSync::Normal => "normal",
                }
            ),
            Backend::Memory => writeln!(f, "memory (not durable: records are lost on restart)"),
            Backend::Postgres => writeln!(
                f,
                "postgres {} (pool {})",
                mask_url(self.url.as_deref().unwrap_or_default()),
                self.pool_size
            ),
        }
    }
}

/// As derived, but the URL's password masked: a `{config:?}` in a log or a
/// panic message must not carry it.
impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("backend", &self.backend)
            .field("path", &self.path)
            .field("synchronous", &self.synchronous)
            .field("url", &self.url.as_deref().map(mask_url))
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("migration_lock", &self.migration_lock)
            .field(
                "require_synchronous_replication",
                &self.require_synchronous_replication,
            )
            .field("plaintext_responses", &self.plaintext_responses)
            .field("timeout", &self.timeout)
            .field("sweep_interval", &self.sweep_interval)
            .field("sweep_batch", &self.sweep_batch)
            .finish()
    }
}

// === impl RedisConfig ===

/// The URL schemes `redis.url` takes: `(scheme, TLS, what the client is given)`.
/// Valkey speaks the same protocol; its schemes are aliases.
const REDIS_SCHEMES: [(&str, bool, &str); 5] = [
    ("redis://", false, "redis://"),
    ("rediss://", true, "rediss://"),
    ("valkey://", false, "redis://"),
    ("valkeys://", true, "rediss://"),
    ("unix://", false, "unix://"),
];

fn redis_scheme(url: &str) -> Option<(&'static str, bool, &'static str)> {
    REDIS_SCHEMES
        .into_iter()
        .find(|(scheme, _, _)| url.starts_with(scheme))
}

impl RedisConfig {
    /// Whether the URL asks for TLS (`rediss://`, `valkeys://`), or
    /// `redis.tls` does for Sentinel.
    pub fn is_tls(&self) -> bool {
        match &self.sentinel {
            Some(s) => s.tls,
            None => redis_scheme(&self.url).is_some_and(|(_, tls, _)| tls),
        }
    }

    /// Where Redis is, for logs: the URL (password masked), or the
    /// sentinels and the master's name.
    pub fn shown_address(&self) -> String {
        match &self.sentinel {
            Some(s) => {
                let list: Vec<String> = s.sentinels.iter().map(|(h, p)| join_host(h, *p)).collect();
                format!("sentinel master {:?} via {}", s.master, list.join(","))
            }
            None => mask_url(&self.url),
        }
    }

    /// The URL with a Valkey scheme rewritten to the Redis one the client
    /// knows (`valkeys://h` → `rediss://h`).
    pub fn client_url(&self) -> String {
        match redis_scheme(&self.url) {
            Some((scheme, _, canonical)) => format!("{canonical}{}", &self.url[scheme.len()..]),
            None => self.url.clone(),
        }
    }
}

impl TryFrom<RawRedis> for RedisConfig {
    type Error = Invalid;

    fn try_from(mut r: RawRedis) -> Result<Self, Invalid> {
        let sentinel = sentinel_of(&mut r)?;
        let (url, tls) = match (&sentinel, r.url.take()) {
            (Some(s), _) => (String::new(), s.tls),
            (None, Some(url)) => {
                let tls = url_tls(&url)?;
                (url, tls)
            }
            (None, None) => {
                return Err(Invalid::field(
                    "redis.url",
                    "redis.url (or redis.sentinels with redis.sentinel_master) is required when [redis] is present (or set IDEMGATE_REDIS_URL)",
                ))
            }
        };
        let prefix = r.prefix.unwrap_or_else(|| DEFAULT_REDIS_PREFIX.to_string());
        if prefix.is_empty() || prefix.contains(char::is_whitespace) {
            return Err(Invalid::field(
                "redis.prefix",
                "redis.prefix must be non-empty and contain no spaces",
            ));
        }
        // Certificates on a plain URL would be silently unused: the
        // operator meant TLS and would get none.
        for (name, file) in [
            ("ca_file", &r.ca_file),
            ("cert_file", &r.cert_file),
            ("key_file", &r.key_file),
        ] {
            if let (Some(file), false) = (file, tls) {
                return Err(Invalid::at(
                    file.span(),
                    format!(
                        "redis.{name} only applies to a TLS URL (rediss:// or valkeys://) or redis.tls = true with Sentinel, but redis is {}",
                        if sentinel.is_some() { "Sentinel without redis.tls".to_string() } else { mask_url(&url) }
                    ),
                ));
            }
        }
        match (&r.cert_file, &r.key_file) {
            (Some(cert), None) => {
                return Err(Invalid::at(
                    cert.span(),
                    "redis.cert_file is set without redis.key_file: a client certificate needs its private key (both PEM)",
                ))
            }
            (None, Some(key)) => {
                return Err(Invalid::at(
                    key.span(),
                    "redis.key_file is set without redis.cert_file: a private key needs its client certificate (both PEM)",
                ))
            }
            _ => {}
        }
        let cluster = match r.cluster {
            Some(c) if *c.get_ref() && url.starts_with("unix://") => {
                return Err(Invalid::at(
                    c.span(),
                    "redis.cluster needs a TCP URL: cluster nodes announce host:port addresses",
                ))
            }
            Some(c) if *c.get_ref() && sentinel.is_some() => {
                return Err(Invalid::at(
                    c.span(),
                    "redis.cluster and redis.sentinels do not go together: a Redis Cluster fails over by itself (give one node in redis.url); Sentinel watches one master",
                ))
            }
            Some(c) => c.into_inner(),
            None => false,
        };
        Ok(RedisConfig {
            url,
            timeout: dur(r.timeout, DEFAULT_REDIS_TIMEOUT),
            prefix,
            cluster,
            ca_file: r.ca_file.map(|f| f.into_inner()),
            cert_file: r.cert_file.map(|f| f.into_inner()),
            key_file: r.key_file.map(|f| f.into_inner()),
            sentinel,
        })
    }
}

/// The URL's TLS, or why the URL is not one `redis.url` takes.
fn url_tls(url: &str) -> Result<bool, Invalid> {
    let Some((_, tls, _)) = redis_scheme(url) else {
        return Err(Invalid::field(
            "redis.url",
            format!(
                "redis.url: expected redis://host:port (rediss:// for TLS; valkey:// and valkeys:// also work), got {}",
                mask_url(url)
            ),
        ));
    };
    // redis-rs reads `#insecure` as "verify nothing"; a self-signed
    // server is trusted through its CA instead.
    if url.ends_with("#insecure") {
        return Err(Invalid::field(
            "redis.url",
            "redis.url: #insecure (no certificate verification) is not supported; give the server's CA in redis.ca_file",
        ));
    }
    Ok(tls)
}

/// `redis.sentinels` and the keys that go with it, taken out of `r`; `None`
/// without Sentinel. Every key that only Sentinel reads is an error
/// without it (a URL carries its own credentials and TLS), and Sentinel
/// with a URL is an error too: which one the fast path followed would be
/// a guess.
fn sentinel_of(r: &mut RawRedis) -> Result<Option<SentinelConfig>, Invalid> {
    let (sentinels, master) = match (r.sentinels.take(), r.sentinel_master.take()) {
        (None, None) => {
            let only_with_sentinel = [
                ("username", r.username.as_ref().map(|v| v.span())),
                ("password", r.password.as_ref().map(|v| v.span())),
                ("tls", r.tls.as_ref().map(|v| v.span())),
                ("sentinel_username", r.sentinel_username.as_ref().map(|v| v.span())),
                ("sentinel_password", r.sentinel_password.as_ref().map(|v| v.span())),
            ];
            if let Some((name, Some(span))) = only_with_sentinel.into_iter().find(|(_, s)| s.is_some()) {
                return Err(Invalid::at(
                    span,
                    format!("redis.{name} only applies with redis.sentinels: with redis.url, the URL carries credentials (redis://user:password@host) and TLS (rediss://)"),
                ));
            }
            return Ok(None);
        }
        (Some(list), None) => {
            return Err(Invalid::at(
                list.span(),
                "redis.sentinels is set without redis.sentinel_master: name the master the sentinels monitor (`sentinel monitor <name> ...`)",
            ))
        }
        (None, Some(master)) => {
            return Err(Invalid::at(
                master.span(),
                "redis.sentinel_master is set without redis.sentinels: list the sentinels as [\"host:port\", ...]",
            ))
        }
        (Some(list), Some(master)) => (list, master),
    };
    if r.url.is_some() {
        return Err(Invalid::at(
            sentinels.span(),
            "redis.sentinels and redis.url do not go together: with Sentinel the sentinels say where the master is (drop redis.url, or drop redis.sentinels)",
        ));
    }
    let span = sentinels.span();
    let list = sentinels.into_inner();
    if list.is_empty() {
        return Err(Invalid::at(
            span,
            "redis.sentinels is empty: list at least one \"host:port\"",
        ));
    }
    let sentinels = list
        .iter()
        .map(|entry| {
            parse_host_port(entry).ok_or_else(|| {
                Invalid::at(
                    span.clone(),
                    format!("redis.sentinels: expected \"host:port\" (\"[::1]:26379\" for IPv6), got {entry:?}"),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let master_span = master.span();
    let master = master.into_inner();
    if master.is_empty() || master.contains(char::is_whitespace) {
        return Err(Invalid::at(
            master_span,
            "redis.sentinel_master must be non-empty and contain no spaces",
        ));
    }
    let text =
        |v: Option<toml::Spanned<String>>| v.map(|v| v.into_inner()).filter(|v| !v.is_empty());
    Ok(Some(SentinelConfig {
        sentinels,
        master,
        username: text(r.username.take()),
        password: text(r.password.take()),
        tls: r.tls.take().is_some_and(|t| t.into_inner()),
        sentinel_username: text(r.sentinel_username.take()),
        sentinel_password: text(r.sentinel_password.take()),
    }))
}

/// `host:port`, or `[v6]:port`.
fn parse_host_port(entry: &str) -> Option<(String, u16)> {
    let (host, port) = entry.rsplit_once(':')?;
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.strip_suffix(']')?,
        None if host.contains(':') => return None,
        None => host,
    };
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    (!host.is_empty() && !host.contains(char::is_whitespace)).then(|| (host.to_string(), port))
}

/// `host:port` as written back (IPv6 in brackets).
fn join_host(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// As derived, but the URL's password masked.
impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &mask_url(&self.url))
            .field("timeout", &self.timeout)
            .field("prefix", &self.prefix)
            .field("cluster", &self.cluster)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("sentinel", &self.sentinel)
            .finish()
    }
}

/// One line, password masked.
impl fmt::Display for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "redis      {} (prefix {:?}, timeout {}",
            self.shown_address(),
            self.prefix,
            format_duration(self.timeout)
        )?;
        if self.cluster {
            f.write_str(", cluster")?;
        }
        if self.is_tls() {
            match &self.ca_file {
                Some(ca) => write!(f, ", TLS with CA {}", ca.display())?,
                None => f.write_str(", TLS with the system roots")?,
            }
            if let Some(cert) = &self.cert_file {
                write!(f, ", client certificate {}", cert.display())?;
            }
        }
        writeln!(f, ")")
    }
}

#[cfg(test)]
#[path = "redis_tests.rs"]
mod redis_tests;
