//! Configuration: the TOML file, parsed strictly into typed settings.
//!
//! Two stages, as in rpxy and pingora: `raw.rs` mirrors the file (serde,
//! `deny_unknown_fields`, values already typed where a type can say what is
//! wrong, so TOML's own error names the line), then each section is turned
//! into its typed settings with its own defaults and checks (`server.rs`,
//! `store.rs`, `log.rs`, `routes.rs`); `Config::from_raw` only composes
//! them and checks what spans sections. Every default is a `DEFAULT_*`
//! constant; `config/idemgate.toml` lists them all and a test parses it.
//!
//! Secrets do not have to sit in the file: `env.rs` holds the one rule by
//! which `IDEMGATE_<SECTION>_<KEY>` overrides a key (`IDEMGATE_STORE_URL`,
//! `IDEMGATE_REDIS_URL` among them), the aliases `IDEMGATE_UPSTREAM` and
//! `IDEMGATE_LISTEN`, and `IDEMGATE_SCOPE_SECRET` (environment only), which
//! keys the scope digests.

pub mod consumers;
mod env;
mod log;
pub mod pg_url;
mod raw;
mod routes;
mod server;
mod store;
mod tracing;
pub mod units;
mod upstreams;

use crate::route::RouteTable;
use raw::RawConfig;
use routes::{Defaults, RoutesDisplay};
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;
use units::HumanDuration;

pub use consumers::ConsumerConfig;
pub use log::{LogConfig, LogFormat};
// Other modules still name these through `config`; they live in `route`.
pub use crate::route::{OnAmbiguous, OnStoreError, RouteConfig};
pub use server::{AdminConfig, Readiness, ServerConfig, ServerRestart};
pub use store::{
    Backend, MigrationLock, PlaintextResponses, RedisConfig, SentinelConfig, SqliteSync,
    StoreConfig,
};
pub use tracing::TracingConfig;
pub use upstreams::{UpstreamConfig, UpstreamProtocol, UpstreamTls, DEFAULT_UPSTREAM_NAME};

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
/// Longer than common client pool idle times (Go 90 s is longer and loses
/// a connection now and then; hyper and curl reuse within seconds), short
/// enough that idle clients cannot hold the connection slots.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Sized for a small sidecar: 64 protected bodies of the default 1 MiB
/// limit at once, whatever the number of connections.
pub const DEFAULT_MAX_BUFFERED_BODY_BYTES: u64 = 64 << 20;
/// RFC 9113 §6.5.2 recommends no fewer than 100; hyper's own 200 doubles
/// what one client connection can make the proxy hold.
pub const DEFAULT_H2_MAX_CONCURRENT_STREAMS: u32 = 100;
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
/// The credential: enough where one credential is one client. Routes of
/// APIs that carry a tenant in a second header list it too (`scope_headers`).
pub const DEFAULT_SCOPE_HEADER: http::HeaderName = http::header::AUTHORIZATION;
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

/// The whole, validated configuration: what a reload applies, and what
/// only a restart changes ([`Restart`]; `server::reload::as_reloaded`
/// names every field, so a new one must be placed).
#[derive(Clone, Debug)]
pub struct Config {
    /// Key for the scope digests (`IDEMGATE_SCOPE_SECRET`); never printed.
    pub scope_secret: Option<Secret>,
    /// The keys stored responses are sealed with
    /// (`IDEMGATE_STORE_ENCRYPTION_KEYS`); bound at start, like the store.
    pub store_keys: Option<std::sync::Arc<crate::idempotency::vault::KeyRing>>,
    pub server: ServerConfig,
    /// `[upstreams.NAME]`, by name; the default upstream is in `server`.
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    pub routes: RouteTable,
    pub restart: Restart,
}

/// How long a PostgreSQL failover may take before a lease shorter than it
/// is warned about (`check-config`, start-up) when `store.url` lists
/// several hosts: managed failovers take tens of seconds to two minutes
/// (docs/book/src/deploy.md, Failover).
pub const FAILOVER_HORIZON: Duration = Duration::from_secs(60);

/// What is bound at start and only a restart changes: a reload keeps the
/// running values ([`Restart::changes`] names those the file changed).
#[derive(Clone, Debug, PartialEq)]
pub struct Restart {
    pub server: ServerRestart,
    pub admin: Option<AdminConfig>,
    pub store: StoreConfig,
    pub redis: Option<RedisConfig>,
    pub log: LogConfig,
    /// `[tracing]`: OpenTelemetry export (feature `otel`); `None` = off.
    pub tracing: Option<TracingConfig>,
    /// `[[consumer]]`: each holds a broker connection opened at start, so
    /// a reload keeps the running consumers (and names those it changed).
    pub consumers: Vec<ConsumerConfig>,
}

impl Restart {
    /// The settings that differ in `new`, by config name: `[server]` and
    /// `[admin]` field by field (names from the serialized fields, never
    /// listed), the other sections whole (each one thing opened at start;
    /// the URLs' passwords are compared, never shown).
    pub fn changes(&self, new: &Restart) -> Vec<String> {
        // Exhaustive: a new section must say how it is named.
        let Restart {
            server,
            admin,
            store,
            redis,
            log,
            tracing,
            consumers,
        } = self;
        let mut out = changed_fields("server", server, &new.server);
        out.extend(changed_fields("admin", admin, &new.admin));
        let whole = [
            ("store", *store != new.store),
            ("redis", *redis != new.redis),
            ("log", *log != new.log),
            ("tracing", *tracing != new.tracing),
        ];
        out.extend(whole.iter().filter(|w| w.1).map(|w| w.0.to_string()));
        // By name: added, removed or changed.
        let names = consumers.iter().chain(&new.consumers).map(|c| &c.name);
        let mut names: Vec<_> = names.collect();
        names.sort();
        names.dedup();
        for name in names {
            let find = |list: &[ConsumerConfig]| list.iter().find(|c| &c.name == name).cloned();
            if find(consumers) != find(&new.consumers) {
                out.push(format!("consumer.{name}"));
            }
        }
        out
    }
}

/// `section.field` for each field that differs between the serialized
/// `old` and `new`, in declaration order. Both are one type, so their
/// fields line up; an absent section (`None`) has none.
fn changed_fields<T: serde::Serialize>(section: &str, old: &T, new: &T) -> Vec<String> {
    let fields = |v: &T| {
        let json = serde_json::to_string(v).expect("settings serialize");
        let mut json = serde_json::Deserializer::from_str(&json);
        serde::Deserializer::deserialize_any(&mut json, InOrder).expect("a struct or null")
    };
    let (old, new) = (fields(old), fields(new));
    let named = if old.len() >= new.len() { &old } else { &new };
    (0..named.len())
        .filter(|&i| old.get(i) != new.get(i))
        .map(|i| format!("{section}.{}", named[i].0))
        .collect()
}

/// Reads a serialized struct's fields in declaration order (a
/// `serde_json::Map` sorts them); `null` (an absent section) has none.
struct InOrder;

impl<'de> serde::de::Visitor<'de> for InOrder {
    type Value = Vec<(String, serde_json::Value)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a struct or null")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Vec::new())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = Vec::new();
        while let Some(field) = map.next_entry()? {
            fields.push(field);
        }
        Ok(fields)
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

// ===== loading =====

impl Config {
    /// Reads, parses and validates `path`, then applies environment overrides.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_bytes(path, Self::read(path)?)
    }

    /// The file's bytes, or the error every command gives for it.
    pub fn read(path: &Path) -> Result<Vec<u8>, ConfigError> {
        std::fs::read(path).map_err(|e| ConfigError {
            file: path.display().to_string(),
            message: format!("cannot read config: {e}"),
        })
    }

    /// As [`Config::load`], for the file's bytes already read (a reload
    /// applies exactly what its watcher judged complete).
    pub fn load_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = String::from_utf8(bytes).map_err(|_| ConfigError {
            file: file.clone(),
            message: "cannot read config: stream did not contain valid UTF-8".to_string(),
        })?;
        Self::parse_file(&text, path, &env_overrides())
    }

    /// [`Config::parse_with_env`] for the text of the file at `path`, with
    /// a relative `store.path` read from that file's directory
    /// ([`store_path_for`]): `serve`, `keys`, `check-config` and `migrate`
    /// open the same store from any working directory. The one place
    /// paths are resolved.
    pub fn parse_file(
        text: &str,
        path: &Path,
        env: &BTreeMap<String, String>,
    ) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let mut config = Self::parse_with_env(text, &file, env)?;
        let store = &mut config.restart.store;
        let given = std::mem::take(&mut store.path);
        store.path = store_path_for(&given, path);
        // Earlier versions read a relative path from the working directory:
        // a store left there must not be silently replaced by a new, empty
        // one (every key it holds would run again).
        let resolved = &store.path;
        if store.backend == Backend::Sqlite
            && *resolved != given
            && !resolved.exists()
            && given.exists()
        {
            return Err(ConfigError {
                file,
                message: Invalid::field(
                    "store.path",
                    format!(
                        "store.path {given:?} is read from the config file's directory: {} does not exist, but {} (from the working directory, where earlier versions looked) does: move that store there, or set store.path to its absolute path",
                        resolved.display(),
                        given.display()
                    ),
                )
                .located(text),
            });
        }
        Ok(config)
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
        let fail = |message: String| ConfigError {
            file: file.to_string(),
            message,
        };
        let raw = read_raw(text, env).map_err(fail)?;
        Self::from_raw(raw, env).map_err(|e| fail(e.located(text)))
    }

    /// Composes the sections, in file order, then checks what spans them.
    fn from_raw(raw: RawConfig, env: &BTreeMap<String, String>) -> Result<Self, Invalid> {
        let (server, server_restart) = server::read(raw.server)?;
        let consumers = {
            let d = &raw.defaults;
            let inherited = consumers::Inherited {
                lease: d.lease.map(|t| t.0),
                release_statuses: d.release_statuses.as_ref().map(|r| &r.0),
                on_ambiguous: d.on_ambiguous,
                max_response_body: d.max_response_body.map(|s| s.0),
            };
            consumers::read(raw.consumer, &inherited, env)?
        };
        let restart = Restart {
            server: server_restart,
            admin: raw.admin.map(AdminConfig::try_from).transpose()?,
            store: StoreConfig::try_from(raw.store)?,
            redis: raw.redis.map(RedisConfig::try_from).transpose()?,
            log: LogConfig::try_from(raw.log)?,
            tracing: match raw.tracing {
                Some(section) if !cfg!(feature = "otel") => {
                    let message = "[tracing] needs idemgate built with the `otel` feature (cargo build --features otel); this build has no tracing";
                    return Err(match section.span() {
                        env::NOT_IN_FILE => {
                            format!("{message} (set by IDEMGATE_TRACING_* variables)").into()
                        }
                        at => Invalid::at(at, message),
                    });
                }
                Some(section) => Some(TracingConfig::try_from(section.into_inner())?),
                None => None,
            },
            consumers,
        };
        let upstreams = upstreams::named(raw.upstreams)?;
        let choices = raw
            .defaults
            .upstream
            .iter()
            .map(|u| ("defaults".to_string(), u))
            .chain(raw.route.iter().enumerate().filter_map(|(i, r)| {
                let u = r.get_ref().upstream.as_ref()?;
                Some((format!("route #{}", i + 1), u))
            }))
            .chain(
                std::iter::once(("defaults: replay_check".to_string(), &raw.defaults))
                    .chain(
                        raw.route
                            .iter()
                            .enumerate()
                            .map(|(i, r)| (format!("route #{}: replay_check", i + 1), r.get_ref())),
                    )
                    .filter_map(|(whose, r)| Some((whose, r.replay_check.as_ref()?.upstream()?))),
            );
        upstreams::check_choices(choices, &upstreams)?;
        let routes = Defaults::try_from(raw.defaults)?.routes(raw.route)?;
        let config = Config {
            scope_secret: env::scope_secret(env)?,
            store_keys: env::store_keys(env)?,
            server,
            upstreams,
            routes,
            restart,
        };
        config.check_across()?;
        Ok(config)
    }

    /// The checks over settings of more than one section. A reload runs
    /// them again on the config as it will run ([`Config::check_composed`]).
    fn check_across(&self) -> Result<(), Invalid> {
        let restart = &self.restart;
        // Here, not at parse: a reload keeps the running consumers (they
        // need a restart), so the upstreams they deliver to must still be
        // in the file it loads (an unknown name would fall back to the
        // default upstream).
        for (i, c) in restart.consumers.iter().enumerate() {
            match c.route.upstream.as_deref() {
                Some(name) if !self.upstreams.contains_key(name) => {
                    return Err(Invalid::field(
                        format!("consumer.{i}.deliver"),
                        format!(
                            "consumer {:?}: deliver.upstream = {name:?} names no [upstreams.{name}] section",
                            &*c.name
                        ),
                    ))
                }
                _ => {}
            }
            // The name is the scope of the consumer's keys; a route with
            // the same fixed scope would share that namespace, so an HTTP
            // client's key could replay (or block) a message's, and the
            // reverse.
            if let Some(r) = self
                .routes
                .iter()
                .find(|r| r.scope_value.as_deref() == Some(&*c.name))
            {
                return Err(Invalid::field(
                    format!("consumer.{i}.name"),
                    format!(
                        "consumer {:?}: its name is the scope of its keys, and route #{} {} has scope = {{ value = {:?} }}: their keys would share one namespace; rename the consumer or change the route's scope",
                        &*c.name, r.index, r.path, &*c.name
                    ),
                ));
            }
        }
        if restart.store.plaintext_responses == PlaintextResponses::Refuse
            && self.store_keys.is_none()
        {
            return Err(Invalid::field(
                "store.plaintext_responses",
                "store.plaintext_responses = \"refuse\" needs IDEMGATE_STORE_ENCRYPTION_KEYS: without keys every stored response is plaintext",
            ));
        }
        if restart.redis.is_some() && restart.store.backend != Backend::Postgres {
            return Err(Invalid::field(
                "redis",
                "[redis] is a fast path in front of PostgreSQL: it needs store.backend = \"postgres\"",
            ));
        }
        let client_ca = restart
            .server
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca.is_some());
        if let Some(r) = self
            .routes
            .iter()
            .find(|r| r.scope_client_cert && !client_ca)
        {
            return Err(Invalid::field(
                format!("route.{}.scope", r.index - 1),
                format!(
                    "route #{} {}: scope = {{ client_cert = true }} needs server.tls_client_ca_file (and tls_cert_file, tls_key_file): without verified client certificates there is no identity to scope keys by",
                    r.index, r.path
                ),
            ));
        }
        let budget = restart.server.max_buffered_body_bytes;
        if let Some(r) = self.routes.iter().find(|r| r.max_request_body > budget) {
            return Err(Invalid::field(
                format!("route.{}.max_request_body", r.index - 1),
                format!(
                    "route #{} {}: max_request_body ({}) is larger than server.max_buffered_body_bytes ({}): such a body could never be buffered",
                    r.index,
                    r.path,
                    units::format_size(r.max_request_body),
                    units::format_size(budget)
                ),
            ));
        }
        Ok(())
    }

    /// The cross-section checks on a config composed from more than one
    /// file's settings (a reload keeps the running values of those only a
    /// restart changes), with the message naming the line of `text` (the
    /// new file, `file`) as [`Config::load`] does.
    pub fn check_composed(&self, text: &str, file: &str) -> Result<(), ConfigError> {
        self.check_across().map_err(|e| ConfigError {
            file: file.to_string(),
            message: e.located(text),
        })
    }

    /// The listeners' TLS settings (the proxy's, then the admin's).
    pub fn listener_tls(&self) -> impl Iterator<Item = &crate::net::tls_server::ListenerTls> {
        let admin = self.restart.admin.as_ref().and_then(|a| a.tls.as_ref());
        self.restart.server.tls.iter().chain(admin)
    }

    /// Reads the files the config names that a reload must not fail on
    /// (the listeners' certificates, keys and client CAs: a pair may be
    /// mid-rotation): `check-config` and `serve` check them before
    /// anything else.
    pub fn check_files(&self) -> Result<(), crate::net::tls::TlsError> {
        self.listener_tls()
            .try_for_each(crate::net::tls_server::check)
    }

    /// Settings that are valid but probably not what the operator wants.
    /// Among them, a `lease` shorter than [`FAILOVER_HORIZON`] with
    /// several PostgreSQL hosts in `store.url`.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for r in self.routes.iter() {
            // Safe methods (RFC 9110 §9.2.1, and QUERY) change nothing: a
            // repeat is harmless, so demanding a key for them only costs a
            // store round trip and replays stale answers. A routing-only
            // entry (`require_key = false`, e.g. a WebSocket GET) is fine.
            let safe = ["GET", "HEAD", "OPTIONS", "TRACE", "QUERY"];
            if r.require_key && r.methods.iter().all(|m| safe.contains(&m.as_str())) {
                out.push(format!(
                    "route #{} {}: protects only safe methods ({}): repeating them changes nothing, so protection only replays stored answers; list the methods that change state (POST, PUT, PATCH, DELETE)",
                    r.index,
                    r.path,
                    r.methods.iter().map(http::Method::as_str).collect::<Vec<_>>().join(", ")
                ));
            }
            // The route's own upstream's timeout.
            let upstream_timeout = r
                .upstream
                .as_deref()
                .and_then(|name| self.upstreams.get(name))
                .map_or(self.server.upstream_timeout, |u| u.timeout);
            if r.ttl < upstream_timeout + r.lease {
                out.push(format!(
                    "route #{} {}: ttl ({}) is shorter than upstream_timeout + lease ({} + {}): a slow request's key may expire soon after it completes",
                    r.index,
                    r.path,
                    units::format_duration(r.ttl),
                    units::format_duration(upstream_timeout),
                    units::format_duration(r.lease)
                ));
            }
        }
        // A store that fails over: an answer still waiting to be recorded
        // while no primary accepts writes is recorded only if its lease
        // outlasts the failover; otherwise a retry takes the key over once
        // the store is back and runs it again.
        let hosts = self.restart.store.postgres_hosts();
        if hosts > 1 {
            for r in self.routes.iter().filter(|r| r.require_key) {
                if r.lease < FAILOVER_HORIZON {
                    out.push(format!(
                        "route #{} {}: lease ({}) is shorter than {} and store.url lists {hosts} PostgreSQL hosts: a failover longer than the lease can run a request twice (an answer that waits for the new primary is fenced out once a retry took its key over); set lease above your failover's duration (docs/book/src/deploy.md, Failover)",
                        r.index,
                        r.path,
                        units::format_duration(r.lease),
                        units::format_duration(FAILOVER_HORIZON),
                    ));
                }
            }
        }
        out.extend(routes::shadowing_warnings(&self.routes));
        // A broker redelivers what was unacked at a restart: on the memory
        // store the records are gone by then, so those messages run again.
        if self.restart.store.backend == Backend::Memory {
            for c in &self.restart.consumers {
                out.push(format!(
                    "consumer {:?}: store.backend = \"memory\" forgets every record on restart, so a message the broker redelivers after one (unacked, or published twice) executes again; use sqlite or postgres",
                    &*c.name
                ));
            }
        }
        // The URI (so HTTP/2's :authority) is always the upstream's; a kept
        // client Host then disagrees with it, which RFC 9113 §8.3.1 lets an
        // HTTP/2 server refuse as malformed.
        let h2 = std::iter::once(self.server.upstream_protocol)
            .chain(self.upstreams.values().map(|u| u.protocol))
            .any(|p| p == UpstreamProtocol::H2);
        if self.server.preserve_host && h2 {
            out.push(
                "server.preserve_host = true with an HTTP/2 upstream (protocol = \"h2\"): it gets the client's Host beside an :authority naming the upstream, which some HTTP/2 servers refuse".to_string(),
            );
        }
        out
    }
}

/// The effective settings, one section after another, secrets masked.
impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let restart = &self.restart;
        writeln!(f, "listen     {}", restart.server.listen)?;
        write!(f, "{}", self.server)?;
        if let Some(tls) = &restart.server.tls {
            writeln!(f, "tls        {tls}")?;
        }
        if let Some(admin) = &restart.admin {
            writeln!(f, "admin      {}", admin.listen)?;
            if let Some(tls) = &admin.tls {
                writeln!(f, "admin tls  {tls}")?;
            }
        }
        write!(f, "{}", restart.store)?;
        if let Some(redis) = &restart.redis {
            write!(f, "{redis}")?;
        }
        if let Some(tracing) = &restart.tracing {
            write!(f, "{tracing}")?;
        }
        for (name, upstream) in &self.upstreams {
            writeln!(f, "upstream   {name}: {upstream}")?;
        }
        writeln!(
            f,
            "scopes     {}",
            if self.scope_secret.is_some() {
                "HMAC-SHA256 with IDEMGATE_SCOPE_SECRET"
            } else {
                "SHA-256 (set IDEMGATE_SCOPE_SECRET to key them)"
            }
        )?;
        match &self.store_keys {
            Some(ring) => writeln!(
                f,
                "responses  sealed at rest (AES-256-GCM) under key {:?}; {} key(s) open them; plaintext records {}",
                ring.current_id(),
                ring.len(),
                match self.restart.store.plaintext_responses {
                    PlaintextResponses::Replay => "replayed (store.plaintext_responses = \"refuse\" once none is left)",
                    PlaintextResponses::Refuse => "refused (410)",
                }
            )?,
            None => writeln!(
                f,
                "responses  stored in plaintext (set IDEMGATE_STORE_ENCRYPTION_KEYS to seal them)"
            )?,
        }
        write!(f, "{}", RoutesDisplay(&self.routes))?;
        for consumer in &self.restart.consumers {
            write!(f, "{consumer}")?;
        }
        Ok(())
    }
}

/// The file with the environment laid over it, as the typed mirror.
fn read_raw(text: &str, env: &BTreeMap<String, String>) -> Result<RawConfig, String> {
    let toml_fail = |e: toml::de::Error| e.to_string().trim_end().to_string();
    let mut document = toml::de::DeTable::parse(text).map_err(toml_fail)?;
    // The file on its own first: its mistakes are reported before any
    // variable's, even where a variable would replace the bad value.
    RawConfig::from_document(document.clone(), text).map_err(toml_fail)?;
    let settings = env::settings(env, &env::named_upstreams(document.get_ref()))?;
    env::overlay(document.get_mut(), &settings);
    RawConfig::from_document(document, text).map_err(toml_fail)
}

/// Where a `store.path` of the config file `config_file` is: a relative
/// one in the file's directory, an absolute one as it is.
pub fn store_path_for(path: &Path, config_file: &Path) -> PathBuf {
    match config_file.parent() {
        Some(dir) if path.is_relative() => dir.join(path),
        _ => path.to_path_buf(),
    }
}

// ===== shared by the sections =====

/// A section's complaint, with the place in the file it is about when the
/// section knows it: a span, or the dotted field it names (`store.pool_size`,
/// `route.2`), looked up in the file when the message is written.
#[derive(Debug)]
struct Invalid {
    at: Option<Range<usize>>,
    field: Option<String>,
    message: String,
}

impl Invalid {
    fn at(span: Range<usize>, message: impl Into<String>) -> Self {
        Self {
            at: Some(span),
            field: None,
            message: message.into(),
        }
    }

    /// About `field` (dotted, e.g. `store.pool_size`; array items by index,
    /// `route.0`): the message names the line of the deepest part of it the
    /// file has (the key, else its table's header).
    fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            at: None,
            field: Some(field.into()),
            message: message.into(),
        }
    }

    /// The message, after `line N: ` when the place is known.
    fn located(self, text: &str) -> String {
        let span = self
            .at
            .filter(|s| *s != env::NOT_IN_FILE)
            .or_else(|| self.field.as_deref().and_then(|f| span_of(text, f)));
        match span {
            Some(span) => {
                let line = text.as_bytes()[..span.start.min(text.len())]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1;
                format!("line {line}: {}", self.message)
            }
            None => self.message,
        }
    }
}

/// Where the file sets `field` (dotted; a number indexes an array, as in
/// `route.0`), or the deepest enclosing table it has: for checks over what
/// a table lacks or combines, its header is the line to look at.
fn span_of(text: &str, field: &str) -> Option<Range<usize>> {
    use toml::de::{DeTable, DeValue};
    let document = DeTable::parse(text).ok()?;
    let mut table: &DeTable<'_> = document.get_ref();
    let mut found = None;
    let mut parts = field.split('.').peekable();
    while let Some(part) = parts.next() {
        let Some((key, value)) = table.iter().find(|(k, _)| k.get_ref().as_ref() == part) else {
            break;
        };
        found = Some(key.span());
        let mut value = value;
        if let (DeValue::Array(items), Some(i)) = (
            value.get_ref(),
            parts.peek().and_then(|p| p.parse::<usize>().ok()),
        ) {
            parts.next();
            let Some(item) = items.get(i) else { break };
            value = item;
            found = Some(value.span());
        }
        match value.get_ref() {
            DeValue::Table(t) => table = t,
            _ => break,
        }
    }
    found
}

impl From<String> for Invalid {
    fn from(message: String) -> Self {
        Self {
            at: None,
            field: None,
            message,
        }
    }
}

impl From<&str> for Invalid {
    fn from(message: &str) -> Self {
        message.to_string().into()
    }
}

/// The names of this process's `IDEMGATE_*` variables that are Kubernetes
/// service links (`IDEMGATE_ADMIN_PORT=tcp://10.0.0.1:9090` for a Service
/// named `idemgate-admin`), which [`Config::load`] skips rather than reads
/// as settings; never their values.
pub fn skipped_service_links() -> Vec<String> {
    env::service_links(&env_overrides())
        .into_iter()
        .map(str::to_string)
        .collect()
}

/// The `IDEMGATE_*` variables of this process.
fn env_overrides() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with("IDEMGATE_"))
        .collect()
}

/// The value from the file, or the default.
fn dur(v: Option<HumanDuration>, default: Duration) -> Duration {
    v.map(|d| d.0).unwrap_or(default)
}

fn nonzero(key: &str, d: Duration) -> Result<Duration, Invalid> {
    if d.is_zero() {
        Err(Invalid::field(key, format!("{key} must be greater than 0")))
    } else {
        Ok(d)
    }
}

fn at_least_one<N: From<u8> + PartialEq>(key: &str, n: N) -> Result<N, Invalid> {
    if n == N::from(0) {
        Err(Invalid::field(key, format!("{key} must be at least 1")))
    } else {
        Ok(n)
    }
}

/// Hides what may be a password in a URL, well-formed or not: the userinfo
/// after its first `:` (`scheme://user:****@host`; in a misspelled URL such
/// as `redis:/:pw@host`, everything before the last `@` counts as
/// userinfo), and the value of a `password=` or `pass=` parameter (libpq
/// and tokio-postgres accept both). Where the URL is too garbled to tell,
/// more is masked, never less.
pub fn mask_url(url: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let userinfo_masked = match url[start..].rfind('@').map(|at| start + at) {
        Some(at) => match url[start..at].find(':') {
            Some(colon) => format!("{}****{}", &url[..start + colon + 1], &url[at..]),
            None => url.to_string(),
        },
        None => url.to_string(),
    };
    let mut out = String::with_capacity(userinfo_masked.len());
    let mut rest = userinfo_masked.as_str();
    let mut is_parameter = false;
    loop {
        let end = rest.find(['?', '&']).unwrap_or(rest.len());
        match rest[..end].split_once('=') {
            Some((k, _))
                if is_parameter
                    && (k.eq_ignore_ascii_case("password") || k.eq_ignore_ascii_case("pass")) =>
            {
                out.push_str(k);
                out.push_str("=****");
            }
            _ => out.push_str(&rest[..end]),
        }
        let Some(delimiter) = rest[end..].chars().next() else {
            break;
        };
        out.push(delimiter);
        rest = &rest[end + 1..];
        is_parameter = true;
    }
    out
}

#[cfg(test)]
mod tests;

/// A one-route config's route (`POST /o`) with `extra` route settings, for
/// unit tests.
#[cfg(test)]
pub(crate) fn test_route(extra: &str) -> std::sync::Arc<RouteConfig> {
    let text = format!(
        "[server]\nupstream = \"http://127.0.0.1:1\"\n[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\n{extra}"
    );
    let config = Config::parse(&text, "t.toml").expect("a valid test config");
    let route = config.routes.iter().next().expect("one route").clone();
    route
}
