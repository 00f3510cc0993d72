//! Configuration: the TOML file, parsed strictly into typed settings.
//!
//! Two stages, as in rpxy and pingora: [`RawConfig`] mirrors the file (serde,
//! `deny_unknown_fields`, values already typed where a type can say what is
//! wrong, so TOML's own error names the line), then [`Config::from_raw`]
//! applies defaults and cross-field checks. Every default is a `DEFAULT_*`
//! constant; `config/idemgate.toml` lists them all and a test parses it.
//!
//! Secrets do not have to sit in the file: `IDEMGATE_STORE_URL` and
//! `IDEMGATE_REDIS_URL` override `store.url` and `redis.url`,
//! `IDEMGATE_UPSTREAM` and `IDEMGATE_LISTEN` override the server addresses,
//! and `IDEMGATE_SCOPE_SECRET` (environment only) keys the scope digests.

pub mod units;

use crate::route::{PathPattern, RouteTable};
// Other modules still name these through `config`; they live in `route`.
pub use crate::route::{OnStoreError, RouteConfig};
use http::{HeaderName, Method, Uri};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use toml::Spanned;
use units::{ByteSize, HumanDuration};

/// Where `--config` points when it is not given.
pub const DEFAULT_CONFIG_PATH: &str = "config/idemgate.toml";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Long enough for a slow payment provider behind the upstream, short enough
/// that a hung upstream does not pin connections for minutes.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// A refused or black-holed upstream should fail fast: nothing was executed.
pub const DEFAULT_UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Matches common upstream keep-alive timeouts (nginx 75 s, Node 5 s is shorter and wins).
pub const DEFAULT_UPSTREAM_POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
pub const DEFAULT_UPSTREAM_POOL_MAX_IDLE: usize = 64;
/// Bounds memory and file descriptors; well under a default `ulimit -n` of 1M.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Slowloris protection for request heads.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// A protected body is buffered whole; a client trickling it must not pin
/// a connection and its memory for long.
pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Kubernetes' default terminationGracePeriodSeconds is 30 s; stay under it.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(25);
pub const DEFAULT_SQLITE_PATH: &str = "data/idemgate.db";
/// A store call that takes longer than this is treated as the store being down.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);
/// Small batches keep each delete short so the sweeper never stalls traffic.
pub const DEFAULT_SWEEP_BATCH: u32 = 500;
pub const DEFAULT_PG_SCHEMA: &str = "idemgate";
pub const DEFAULT_PG_POOL_SIZE: usize = 16;
pub const DEFAULT_PG_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
pub const DEFAULT_PG_STATEMENT_TIMEOUT: Duration = Duration::from_secs(2);
/// Redis is only a hint: give up on it quickly and ask the authority.
pub const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_millis(250);
pub const DEFAULT_REDIS_PREFIX: &str = "idemgate";
pub const DEFAULT_KEY_HEADER: &str = "Idempotency-Key";
pub const DEFAULT_SCOPE_HEADER: &str = "Authorization";
/// Stripe's retention; long enough for a client's retries over a day.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Renewed every third of itself while the upstream runs, so this only bounds
/// how long a crashed holder blocks its key.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_REQUEST_BODY: u64 = 1 << 20;
pub const DEFAULT_MAX_RESPONSE_BODY: u64 = 1 << 20;
/// Below this a renewal every lease/3 becomes a busy loop against the store.
const MIN_LEASE: Duration = Duration::from_millis(300);

/// A config problem, naming the file and, where known, the line and field.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub message: String,
}

// ===== the file as written =====

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    admin: Option<RawAdmin>,
    #[serde(default)]
    store: RawStore,
    #[serde(default)]
    redis: Option<RawRedis>,
    #[serde(default)]
    log: RawLog,
    #[serde(default)]
    defaults: RawRouteSettings,
    #[serde(default)]
    route: Vec<Spanned<RawRouteSettings>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<SocketAddr>,
    upstream: Option<UpstreamUri>,
    upstream_timeout: Option<HumanDuration>,
    upstream_connect_timeout: Option<HumanDuration>,
    upstream_pool_idle_timeout: Option<HumanDuration>,
    upstream_pool_max_idle: Option<usize>,
    max_connections: Option<usize>,
    header_read_timeout: Option<HumanDuration>,
    request_body_timeout: Option<HumanDuration>,
    shutdown_grace: Option<HumanDuration>,
    shutdown_delay: Option<HumanDuration>,
    preserve_host: Option<bool>,
    trust_forwarded_headers: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: Option<SocketAddr>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    backend: Option<Backend>,
    path: Option<PathBuf>,
    synchronous: Option<SqliteSync>,
    url: Option<Spanned<String>>,
    schema: Option<String>,
    pool_size: Option<usize>,
    connect_timeout: Option<HumanDuration>,
    statement_timeout: Option<HumanDuration>,
    timeout: Option<HumanDuration>,
    sweep_interval: Option<HumanDuration>,
    sweep_batch: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRedis {
    url: Option<String>,
    timeout: Option<HumanDuration>,
    prefix: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    format: Option<LogFormat>,
    level: Option<String>,
}

/// One `[[route]]`, and also `[defaults]` (which may not set `methods`/`path`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRouteSettings {
    methods: Option<Vec<MethodName>>,
    path: Option<Spanned<PatternValue>>,
    key_header: Option<HeaderNameValue>,
    require_key: Option<bool>,
    ttl: Option<HumanDuration>,
    lease: Option<HumanDuration>,
    scope_header: Option<HeaderNameValue>,
    fingerprint_headers: Option<Vec<HeaderNameValue>>,
    max_request_body: Option<ByteSize>,
    max_response_body: Option<ByteSize>,
    include_response_headers: Option<Vec<HeaderNameValue>>,
    exclude_response_headers: Option<Vec<HeaderNameValue>>,
    on_store_error: Option<OnStoreError>,
}

// ===== typed config =====

/// The whole, validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Key for the scope digests (`IDEMGATE_SCOPE_SECRET`); never printed.
    pub scope_secret: Option<Secret>,
    pub server: ServerConfig,
    pub admin: Option<AdminConfig>,
    pub store: StoreConfig,
    pub redis: Option<RedisConfig>,
    pub log: LogConfig,
    pub routes: RouteTable,
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Scheme and authority (and optional base path) of the upstream.
    pub upstream: Uri,
    pub upstream_timeout: Duration,
    pub upstream_connect_timeout: Duration,
    pub upstream_pool_idle_timeout: Duration,
    pub upstream_pool_max_idle: usize,
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    /// Time a client has to send a protected request's whole body (408).
    pub request_body_timeout: Duration,
    pub shutdown_grace: Duration,
    /// After SIGTERM, how long readiness fails while connections are still
    /// accepted, before the drain starts.
    pub shutdown_delay: Duration,
    /// Forward the client's `Host` instead of the upstream's authority.
    pub preserve_host: bool,
    /// Keep the client's `X-Forwarded-Proto/-Host` (behind a trusted proxy).
    pub trust_forwarded_headers: bool,
}

#[derive(Clone, Debug)]
pub struct AdminConfig {
    pub listen: SocketAddr,
}

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

#[derive(Clone, Debug)]
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
    pub timeout: Duration,
    pub sweep_interval: Duration,
    pub sweep_batch: u32,
}

#[derive(Clone, Debug)]
pub struct RedisConfig {
    pub url: String,
    pub timeout: Duration,
    pub prefix: String,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Clone, Debug)]
pub struct LogConfig {
    pub format: LogFormat,
    /// An `EnvFilter` directive; `RUST_LOG` wins when set.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".to_string(),
        }
    }
}

/// Bytes that never show up in `Debug` output or logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(****)")
    }
}

// ===== value types that validate while parsing =====

#[derive(Debug)]
struct UpstreamUri(Uri);

impl<'de> Deserialize<'de> for UpstreamUri {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_upstream(&s)
            .map(UpstreamUri)
            .map_err(serde::de::Error::custom)
    }
}

fn parse_upstream(s: &str) -> Result<Uri, String> {
    let uri: Uri = s
        .parse()
        .map_err(|e| format!("invalid upstream URL {s:?}: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(format!(
                "invalid upstream URL {s:?}: scheme {other:?} is not supported (use http://)"
            ))
        }
        None => {
            return Err(format!(
                "invalid upstream URL {s:?}: expected http://host:port"
            ))
        }
    }
    if uri.authority().is_none() {
        return Err(format!("invalid upstream URL {s:?}: missing host"));
    }
    if uri.query().is_some() {
        return Err(format!("invalid upstream URL {s:?}: must not have a query"));
    }
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(
            "invalid upstream URL: credentials (user:password@) are not supported; the upstream sees the client's own headers".to_string(),
        );
    }
    Ok(uri)
}

#[derive(Debug)]
struct MethodName(Method);

impl<'de> Deserialize<'de> for MethodName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let valid = !s.is_empty() && s.bytes().all(|b| b.is_ascii_uppercase());
        match Method::from_bytes(s.as_bytes()) {
            Ok(m) if valid => Ok(MethodName(m)),
            _ => Err(serde::de::Error::custom(format!(
                "invalid method {s:?}: expected an upper-case HTTP method such as \"POST\""
            ))),
        }
    }
}

#[derive(Debug)]
struct PatternValue(PathPattern);

impl<'de> Deserialize<'de> for PatternValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PathPattern::parse(&s)
            .map(PatternValue)
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug)]
struct HeaderNameValue(HeaderName);

impl<'de> Deserialize<'de> for HeaderNameValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HeaderName::from_bytes(s.as_bytes())
            .map(HeaderNameValue)
            .map_err(|_| serde::de::Error::custom(format!("invalid header name {s:?}")))
    }
}

// ===== loading =====

impl Config {
    /// Reads, parses and validates `path`, then applies environment overrides.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            message: format!("cannot read config: {e}"),
        })?;
        let env: BTreeMap<String, String> = std::env::vars()
            .filter(|(k, _)| k.starts_with("IDEMGATE_"))
            .collect();
        Self::parse_with_env(&text, &file, &env)
    }

    /// Parses config text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Self, ConfigError> {
        Self::parse_with_env(text, file, &BTreeMap::new())
    }

    /// Parses config text with the given `IDEMGATE_*` environment overrides.
    pub fn parse_with_env(
        text: &str,
        file: &str,
        env: &BTreeMap<String, String>,
    ) -> Result<Self, ConfigError> {
        let mut raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError {
            file: file.to_string(),
            message: e.to_string().trim_end().to_string(),
        })?;
        overlay_env(&mut raw, env).map_err(|message| ConfigError {
            file: file.to_string(),
            message,
        })?;
        Self::from_raw(raw, text, env).map_err(|message| ConfigError {
            file: file.to_string(),
            message,
        })
    }

    fn from_raw(
        raw: RawConfig,
        text: &str,
        env: &BTreeMap<String, String>,
    ) -> Result<Self, String> {
        let line_of = |offset: usize| {
            text.as_bytes()[..offset.min(text.len())]
                .iter()
                .filter(|&&b| b == b'\n')
                .count()
                + 1
        };
        let env_get = |k: &str| env.get(k).filter(|v| !v.is_empty()).cloned();

        let server = {
            let s = raw.server;
            let listen = match env_get("IDEMGATE_LISTEN") {
                Some(v) => v
                    .parse()
                    .map_err(|e| format!("IDEMGATE_LISTEN={v:?}: invalid address: {e}"))?,
                None => s
                    .listen
                    .unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("valid default")),
            };
            for (alias, rule) in [
                ("IDEMGATE_UPSTREAM", "IDEMGATE_SERVER_UPSTREAM"),
                ("IDEMGATE_LISTEN", "IDEMGATE_SERVER_LISTEN"),
            ] {
                if env_get(alias).is_some() && env_get(rule).is_some() {
                    return Err(format!("both {alias} and {rule} are set; set one"));
                }
            }
            let upstream = match env_get("IDEMGATE_UPSTREAM") {
                Some(v) => parse_upstream(&v).map_err(|e| format!("IDEMGATE_UPSTREAM: {e}"))?,
                None => s.upstream.map(|u| u.0).ok_or(
                    "server.upstream is required, e.g. upstream = \"http://127.0.0.1:3000\"",
                )?,
            };
            let max_connections = s.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS);
            if max_connections == 0 {
                return Err("server.max_connections must be at least 1".into());
            }
            let upstream_timeout = dur(s.upstream_timeout, DEFAULT_UPSTREAM_TIMEOUT);
            if upstream_timeout.is_zero() {
                return Err("server.upstream_timeout must be greater than 0".into());
            }
            ServerConfig {
                listen,
                upstream,
                upstream_timeout,
                upstream_connect_timeout: nonzero(
                    "server.upstream_connect_timeout",
                    dur(s.upstream_connect_timeout, DEFAULT_UPSTREAM_CONNECT_TIMEOUT),
                )?,
                upstream_pool_idle_timeout: dur(
                    s.upstream_pool_idle_timeout,
                    DEFAULT_UPSTREAM_POOL_IDLE_TIMEOUT,
                ),
                upstream_pool_max_idle: s
                    .upstream_pool_max_idle
                    .unwrap_or(DEFAULT_UPSTREAM_POOL_MAX_IDLE),
                max_connections,
                header_read_timeout: nonzero(
                    "server.header_read_timeout",
                    dur(s.header_read_timeout, DEFAULT_HEADER_READ_TIMEOUT),
                )?,
                request_body_timeout: nonzero(
                    "server.request_body_timeout",
                    dur(s.request_body_timeout, DEFAULT_REQUEST_BODY_TIMEOUT),
                )?,
                shutdown_grace: dur(s.shutdown_grace, DEFAULT_SHUTDOWN_GRACE),
                shutdown_delay: dur(s.shutdown_delay, Duration::ZERO),
                preserve_host: s.preserve_host.unwrap_or(false),
                trust_forwarded_headers: s.trust_forwarded_headers.unwrap_or(false),
            }
        };

        let admin = raw
            .admin
            .map(|a| {
                a.listen
                    .map(|listen| AdminConfig { listen })
                    .ok_or("admin.listen is required when [admin] is present")
            })
            .transpose()?;

        let store = {
            let s = raw.store;
            let backend = s.backend.unwrap_or(Backend::Sqlite);
            let url_line = s.url.as_ref().map(|u| line_of(u.span().start));
            let mut url = s.url.map(|u| u.into_inner());
            if let Some(v) = env_get("IDEMGATE_STORE_URL") {
                url = Some(v);
            }
            match backend {
                Backend::Postgres => {
                    let u = url.as_deref().ok_or(
                        "store.url is required for backend = \"postgres\" (or set IDEMGATE_STORE_URL)",
                    )?;
                    if !(u.starts_with("postgres://") || u.starts_with("postgresql://")) {
                        return Err(format!(
                            "store.url: expected a postgres://user@host:port/db URL, got {}",
                            mask_url(u)
                        ));
                    }
                }
                Backend::Sqlite | Backend::Memory => {
                    if let (Some(line), false) = (url_line, url.is_none()) {
                        return Err(format!(
                            "line {line}: store.url only applies to backend = \"postgres\""
                        ));
                    }
                    url = None;
                }
            }
            if backend != Backend::Sqlite && (s.path.is_some() || s.synchronous.is_some()) {
                return Err(
                    "store.path and store.synchronous only apply to backend = \"sqlite\"".into(),
                );
            }
            if backend != Backend::Postgres
                && (s.pool_size.is_some()
                    || s.schema.is_some()
                    || s.connect_timeout.is_some()
                    || s.statement_timeout.is_some())
            {
                return Err("store.pool_size, store.schema, store.connect_timeout and store.statement_timeout only apply to backend = \"postgres\"".into());
            }
            let pool_size = s.pool_size.unwrap_or(DEFAULT_PG_POOL_SIZE);
            if pool_size == 0 {
                return Err("store.pool_size must be at least 1".into());
            }
            let sweep_batch = s.sweep_batch.unwrap_or(DEFAULT_SWEEP_BATCH);
            if sweep_batch == 0 {
                return Err("store.sweep_batch must be at least 1".into());
            }
            let timeout = dur(s.timeout, DEFAULT_STORE_TIMEOUT);
            if timeout.is_zero() {
                return Err("store.timeout must be greater than 0".into());
            }
            let sweep_interval = dur(s.sweep_interval, DEFAULT_SWEEP_INTERVAL);
            if sweep_interval.is_zero() {
                return Err("store.sweep_interval must be greater than 0".into());
            }
            let schema = s.schema.unwrap_or_else(|| DEFAULT_PG_SCHEMA.to_string());
            if schema.is_empty()
                || !schema
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                || schema.as_bytes()[0].is_ascii_digit()
            {
                return Err(format!(
                    "store.schema {schema:?}: use lower-case letters, digits and '_', not starting with a digit"
                ));
            }
            StoreConfig {
                backend,
                schema,
                path: s.path.unwrap_or_else(|| PathBuf::from(DEFAULT_SQLITE_PATH)),
                synchronous: s.synchronous.unwrap_or(SqliteSync::Full),
                url,
                pool_size,
                connect_timeout: dur(s.connect_timeout, DEFAULT_PG_CONNECT_TIMEOUT),
                statement_timeout: dur(s.statement_timeout, DEFAULT_PG_STATEMENT_TIMEOUT),
                timeout,
                sweep_interval,
                sweep_batch,
            }
        };

        let redis_url_env = env_get("IDEMGATE_REDIS_URL");
        let redis = match (raw.redis, redis_url_env) {
            (None, None) => None,
            (r, env_url) => {
                let r = r.unwrap_or_default();
                let url = env_url.or(r.url).ok_or(
                    "redis.url is required when [redis] is present (or set IDEMGATE_REDIS_URL)",
                )?;
                if !(url.starts_with("redis://")
                    || url.starts_with("rediss://")
                    || url.starts_with("unix://"))
                {
                    return Err(format!(
                        "redis.url: expected redis://host:port, got {}",
                        mask_url(&url)
                    ));
                }
                let prefix = r.prefix.unwrap_or_else(|| DEFAULT_REDIS_PREFIX.to_string());
                if prefix.is_empty() || prefix.contains(char::is_whitespace) {
                    return Err("redis.prefix must be non-empty and contain no spaces".into());
                }
                Some(RedisConfig {
                    url,
                    timeout: dur(r.timeout, DEFAULT_REDIS_TIMEOUT),
                    prefix,
                })
            }
        };
        if redis.is_some() && store.backend != Backend::Postgres {
            return Err("[redis] is a fast path in front of PostgreSQL: it needs store.backend = \"postgres\"".into());
        }

        let log = LogConfig {
            format: raw.log.format.unwrap_or_default(),
            level: raw.log.level.unwrap_or_else(|| "info".to_string()),
        };
        tracing_subscriber::EnvFilter::try_new(&log.level)
            .map_err(|e| format!("log.level {:?}: {e}", log.level))?;

        if raw.defaults.methods.is_some() || raw.defaults.path.is_some() {
            return Err(
                "defaults: `methods` and `path` belong in a [[route]], not in [defaults]".into(),
            );
        }
        let mut routes: Vec<RouteConfig> = Vec::with_capacity(raw.route.len());
        for (i, spanned) in raw.route.into_iter().enumerate() {
            let line = line_of(spanned.span().start);
            let index = i + 1;
            let r = spanned.into_inner();
            let at = |msg: String| format!("line {line}: route #{index}: {msg}");
            let route = resolve_route(index, r, &raw.defaults).map_err(at)?;
            if let Some(prev) = routes.iter().find(|p| {
                p.path.same_shape(&route.path)
                    && p.methods.iter().any(|m| route.methods.contains(m))
            }) {
                return Err(at(format!(
                    "duplicate route: {} {} is already route #{}",
                    join_methods(&route.methods),
                    route.path,
                    prev.index
                )));
            }
            routes.push(route);
        }

        let scope_secret = env_get("IDEMGATE_SCOPE_SECRET")
            .map(|v| {
                if v.len() < 16 {
                    Err("IDEMGATE_SCOPE_SECRET must be at least 16 characters".to_string())
                } else {
                    Ok(Secret(v.into_bytes()))
                }
            })
            .transpose()?;

        Ok(Config {
            scope_secret,
            server,
            admin,
            store,
            redis,
            log,
            routes: RouteTable::new(routes),
        })
    }

    /// Settings that are valid but probably not what the operator wants.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for r in self.routes.iter() {
            if r.ttl < self.server.upstream_timeout + r.lease {
                out.push(format!(
                    "route #{} {}: ttl ({}) is shorter than upstream_timeout + lease ({} + {}): a slow request's key may expire soon after it completes",
                    r.index,
                    r.path,
                    units::format_duration(r.ttl),
                    units::format_duration(self.server.upstream_timeout),
                    units::format_duration(r.lease)
                ));
            }
        }
        out
    }

    /// The effective settings as text, secrets masked, for `check-config`.
    pub fn describe(&self) -> String {
        use units::{format_duration as d, format_size as sz};
        let mut out = String::new();
        let s = &self.server;
        let _ = fmt::Write::write_fmt(
            &mut out,
            format_args!(
                "listen     {}\nupstream   {} (timeout {}, connect {})\n",
                s.listen,
                s.upstream,
                d(s.upstream_timeout),
                d(s.upstream_connect_timeout)
            ),
        );
        if let Some(a) = &self.admin {
            out.push_str(&format!("admin      {}\n", a.listen));
        }
        let st = &self.store;
        let store_line = match st.backend {
            Backend::Sqlite => format!(
                "sqlite {} (synchronous = {})",
                st.path.display(),
                match st.synchronous {
                    SqliteSync::Full => "full",
                    SqliteSync::Normal => "normal",
                }
            ),
            Backend::Memory => "memory (not durable: records are lost on restart)".to_string(),
            Backend::Postgres => format!(
                "postgres {} (pool {})",
                mask_url(st.url.as_deref().unwrap_or_default()),
                st.pool_size
            ),
        };
        out.push_str(&format!("store      {store_line}\n"));
        if let Some(r) = &self.redis {
            out.push_str(&format!(
                "redis      {} (prefix {:?}, timeout {})\n",
                mask_url(&r.url),
                r.prefix,
                d(r.timeout)
            ));
        }
        out.push_str(&format!(
            "scopes     {}\n",
            if self.scope_secret.is_some() {
                "HMAC-SHA256 with IDEMGATE_SCOPE_SECRET"
            } else {
                "SHA-256 (set IDEMGATE_SCOPE_SECRET to key them)"
            }
        ));
        out.push_str("routes:\n");
        let routes: Vec<_> = self.routes.iter().collect();
        if routes.is_empty() {
            out.push_str("  (none: every request passes through unprotected)\n");
        }
        for r in routes {
            out.push_str(&format!(
                "  #{} {} {}  key={} required={} scope={} ttl={} lease={} max_request_body={} max_response_body={} on_store_error={}\n",
                r.index,
                join_methods(&r.methods),
                r.path,
                r.key_header,
                r.require_key,
                r.scope_header,
                d(r.ttl),
                d(r.lease),
                sz(r.max_request_body),
                sz(r.max_response_body),
                match r.on_store_error {
                    OnStoreError::Reject => "reject",
                    OnStoreError::Forward => "forward",
                },
            ));
        }
        out
    }
}

/// `Some` fields of `$over` replace those of `$base`.
macro_rules! overlay {
    ($base:expr, $over:expr; $($field:ident),* $(,)?) => {
        $( if $over.$field.is_some() { $base.$field = $over.$field; } )*
    };
}

/// The environment rule: `IDEMGATE_<SECTION>_<KEY>` sets `key` in
/// `[section]` (server, admin, store, redis, log), parsed as a TOML value
/// or else taken as a string, e.g. `IDEMGATE_SERVER_UPSTREAM_TIMEOUT=5s`
/// or `IDEMGATE_STORE_POOL_SIZE=32`. Routes and `[defaults]` come from the
/// file only. `IDEMGATE_STORE_URL`/`IDEMGATE_REDIS_URL` follow the rule too
/// but are applied (and masked) in [`Config::from_raw`].
fn overlay_env(raw: &mut RawConfig, env: &BTreeMap<String, String>) -> Result<(), String> {
    const SECTIONS: [&str; 5] = ["server", "admin", "store", "redis", "log"];
    const URLS: [&str; 2] = ["IDEMGATE_STORE_URL", "IDEMGATE_REDIS_URL"];
    for (name, value) in env {
        if URLS.contains(&name.as_str()) || value.is_empty() {
            continue;
        }
        let Some(rest) = name.strip_prefix("IDEMGATE_") else {
            continue;
        };
        let Some((section, key)) = SECTIONS.iter().find_map(|s| {
            rest.strip_prefix(&format!("{}_", s.to_ascii_uppercase()))
                .map(|k| (*s, k.to_ascii_lowercase()))
        }) else {
            continue;
        };
        // Parsed as one TOML value on its own (a newline cannot smuggle in
        // other keys), or taken as a string. Errors leave the value out: it
        // may be a secret set under the wrong name.
        let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
            .ok()
            .filter(|t| t.len() == 1)
            .and_then(|mut t| t.remove("v"));
        let value = parsed.unwrap_or_else(|| toml::Value::String(value.clone()));
        let mut section_table = toml::Table::new();
        section_table.insert(key.clone(), value);
        let mut doc = toml::Table::new();
        doc.insert(section.to_string(), toml::Value::Table(section_table));
        let over: RawConfig = doc
            .try_into()
            .map_err(|e: toml::de::Error| format!("{name}: {}", e.message().trim_end()))?;
        let (s, o) = (&mut raw.server, over.server);
        overlay!(s, o; listen, upstream, upstream_timeout, upstream_connect_timeout,
            upstream_pool_idle_timeout, upstream_pool_max_idle, max_connections,
            header_read_timeout, request_body_timeout, shutdown_grace, shutdown_delay, preserve_host,
            trust_forwarded_headers);
        if let Some(o) = over.admin {
            overlay!(raw.admin.get_or_insert_with(Default::default), o; listen);
        }
        let (s, o) = (&mut raw.store, over.store);
        overlay!(s, o; backend, path, synchronous, schema, pool_size, connect_timeout,
            statement_timeout, timeout, sweep_interval, sweep_batch);
        if let Some(o) = over.redis {
            overlay!(raw.redis.get_or_insert_with(Default::default), o; timeout, prefix);
        }
        let (s, o) = (&mut raw.log, over.log);
        overlay!(s, o; format, level);
    }
    Ok(())
}

fn resolve_route(
    index: usize,
    r: RawRouteSettings,
    defaults: &RawRouteSettings,
) -> Result<RouteConfig, String> {
    let methods: Vec<Method> = r
        .methods
        .ok_or("`methods` is required, e.g. methods = [\"POST\"]")?
        .into_iter()
        .map(|m| m.0)
        .collect();
    if methods.is_empty() {
        return Err("`methods` must list at least one method".into());
    }
    let path = r
        .path
        .ok_or("`path` is required, e.g. path = \"/orders\"")?
        .into_inner()
        .0;
    let headers = |v: Option<Vec<HeaderNameValue>>, d: &Option<Vec<HeaderNameValue>>| {
        v.or_else(|| d.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|h| h.0)
            .collect::<Vec<_>>()
    };
    let lease = r
        .lease
        .or(defaults.lease)
        .map(|d| d.0)
        .unwrap_or(DEFAULT_LEASE);
    if lease < MIN_LEASE {
        return Err(format!(
            "lease = {:?} is too short (minimum {})",
            units::format_duration(lease),
            units::format_duration(MIN_LEASE)
        ));
    }
    let ttl = r.ttl.or(defaults.ttl).map(|d| d.0).unwrap_or(DEFAULT_TTL);
    if ttl < lease {
        return Err(format!(
            "ttl ({}) must be at least the lease ({})",
            units::format_duration(ttl),
            units::format_duration(lease)
        ));
    }
    let pick_header = |v: &Option<HeaderNameValue>, d: &Option<HeaderNameValue>, fallback: &str| {
        v.as_ref()
            .or(d.as_ref())
            .map(|h| h.0.clone())
            .unwrap_or_else(|| HeaderName::from_bytes(fallback.as_bytes()).expect("valid default"))
    };
    let max_request_body = r
        .max_request_body
        .or(defaults.max_request_body)
        .map(|s| s.0)
        .unwrap_or(DEFAULT_MAX_REQUEST_BODY);
    let max_response_body = r
        .max_response_body
        .or(defaults.max_response_body)
        .map(|s| s.0)
        .unwrap_or(DEFAULT_MAX_RESPONSE_BODY);
    Ok(RouteConfig {
        index,
        label: std::sync::Arc::new(path.as_str().to_string()),
        methods,
        path,
        key_header: pick_header(&r.key_header, &defaults.key_header, DEFAULT_KEY_HEADER),
        require_key: r.require_key.or(defaults.require_key).unwrap_or(true),
        ttl,
        lease,
        scope_header: pick_header(
            &r.scope_header,
            &defaults.scope_header,
            DEFAULT_SCOPE_HEADER,
        ),
        fingerprint_headers: headers(r.fingerprint_headers, &defaults.fingerprint_headers),
        max_request_body,
        max_response_body,
        include_response_headers: headers(
            r.include_response_headers,
            &defaults.include_response_headers,
        ),
        exclude_response_headers: headers(
            r.exclude_response_headers,
            &defaults.exclude_response_headers,
        ),
        on_store_error: r
            .on_store_error
            .or(defaults.on_store_error)
            .unwrap_or(OnStoreError::Reject),
    })
}

fn nonzero(key: &str, d: Duration) -> Result<Duration, String> {
    if d.is_zero() {
        Err(format!("{key} must be greater than 0"))
    } else {
        Ok(d)
    }
}

fn dur(v: Option<HumanDuration>, default: Duration) -> Duration {
    v.map(|d| d.0).unwrap_or(default)
}

fn join_methods(methods: &[Method]) -> String {
    methods
        .iter()
        .map(Method::as_str)
        .collect::<Vec<_>>()
        .join(",")
}

/// Hides the password of a `scheme://user:password@host` URL, and the value
/// of a `password=` query parameter (libpq and tokio-postgres accept both).
pub fn mask_url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let mut out = match base.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:****@{host}"),
                None => base.to_string(),
            },
            None => base.to_string(),
        },
        None => base.to_string(),
    };
    if let Some(q) = query {
        let masked: Vec<String> = q
            .split('&')
            .map(|kv| match kv.split_once('=') {
                Some((k, _))
                    if k.eq_ignore_ascii_case("password") || k.eq_ignore_ascii_case("pass") =>
                {
                    format!("{k}=****")
                }
                _ => kv.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&masked.join("&"));
    }
    out
}

#[cfg(test)]
mod tests;
