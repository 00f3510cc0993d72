//! The file as written: a serde mirror of the TOML, every key optional.
//!
//! Unknown keys are errors (`deny_unknown_fields`), and values are typed
//! where a type can say what is wrong, so TOML's own error names the line.
//! Defaults and checks across keys are the sections' business (`server.rs`,
//! `store.rs`, `log.rs`, `routes.rs`).

use super::units::{ByteSize, HumanDuration};
use super::{
    Backend, LogFormat, MigrationLock, OnAmbiguous, OnStoreError, PlaintextResponses, Readiness,
    SqliteSync, UpstreamProtocol,
};
use crate::idempotency::canonical_json::Pointer;
use crate::idempotency::decision::{ReleaseStatuses, StatusEntry};
use crate::route::errors::{ErrorShape, ErrorTemplate};
use crate::route::{FingerprintMode, InFlight, PathPattern, Preset};
use http::{HeaderName, Method, Uri};
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use toml::Spanned;

/// A section or list the file leaves out is empty.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) server: RawServer,
    pub(super) admin: Option<RawAdmin>,
    pub(super) store: RawStore,
    pub(super) redis: Option<RawRedis>,
    pub(super) log: RawLog,
    /// Spanned: the section is refused at its line in a build without `otel`.
    pub(super) tracing: Option<Spanned<RawTracing>>,
    /// `[upstreams.NAME]`: named upstreams a route may choose.
    pub(super) upstreams: BTreeMap<String, Spanned<RawUpstream>>,
    pub(super) defaults: RawRouteSettings,
    pub(super) route: Vec<Spanned<RawRouteSettings>>,
    /// `[[consumer]]`: message consumers (`consumers.rs`).
    pub(super) consumer: Vec<Spanned<RawConsumer>>,
}

impl RawConfig {
    /// Reads the typed mirror out of a parsed document; `text` is the file
    /// the document came from, so an error shows its line.
    pub(super) fn from_document(
        document: Spanned<toml::de::DeTable<'_>>,
        text: &str,
    ) -> Result<Self, toml::de::Error> {
        Self::deserialize(toml::de::Deserializer::from(document)).map_err(|mut e| {
            e.set_input(Some(text));
            e
        })
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Option<SocketAddr>,
    pub(super) upstream: Option<UpstreamUri>,
    pub(super) upstream_timeout: Option<HumanDuration>,
    pub(super) upstream_connect_timeout: Option<HumanDuration>,
    pub(super) upstream_pool_idle_timeout: Option<HumanDuration>,
    pub(super) upstream_pool_max_idle: Option<usize>,
    pub(super) max_connections: Option<usize>,
    pub(super) header_read_timeout: Option<HumanDuration>,
    pub(super) idle_timeout: Option<HumanDuration>,
    pub(super) max_buffered_body_bytes: Option<ByteSize>,
    pub(super) h2_max_concurrent_streams: Option<u32>,
    pub(super) request_body_timeout: Option<HumanDuration>,
    pub(super) shutdown_grace: Option<HumanDuration>,
    pub(super) shutdown_delay: Option<HumanDuration>,
    pub(super) preserve_host: Option<bool>,
    pub(super) trust_forwarded_headers: Option<bool>,
    pub(super) readiness: Option<Readiness>,
    pub(super) readiness_path: Option<String>,
    pub(super) watch_config: Option<bool>,
    pub(super) upstream_protocol: Option<UpstreamProtocol>,
    pub(super) upstream_ca_file: Option<PathBuf>,
    pub(super) upstream_cert_file: Option<PathBuf>,
    pub(super) upstream_key_file: Option<PathBuf>,
    pub(super) tls_cert_file: Option<PathBuf>,
    pub(super) tls_key_file: Option<PathBuf>,
    pub(super) tls_client_ca_file: Option<PathBuf>,
}

/// One `[upstreams.NAME]`: the `[server] upstream*` keys without the prefix.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) url: Option<UpstreamUri>,
    pub(super) timeout: Option<HumanDuration>,
    pub(super) connect_timeout: Option<HumanDuration>,
    pub(super) pool_idle_timeout: Option<HumanDuration>,
    pub(super) pool_max_idle: Option<usize>,
    pub(super) protocol: Option<UpstreamProtocol>,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) cert_file: Option<PathBuf>,
    pub(super) key_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    pub(super) listen: Option<SocketAddr>,
    pub(super) tls_cert_file: Option<PathBuf>,
    pub(super) tls_key_file: Option<PathBuf>,
    pub(super) tls_client_ca_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub(super) backend: Option<Backend>,
    pub(super) path: Option<PathBuf>,
    pub(super) synchronous: Option<SqliteSync>,
    /// Spanned: a URL for the wrong backend is reported at its line.
    pub(super) url: Option<Spanned<String>>,
    pub(super) schema: Option<String>,
    pub(super) pool_size: Option<usize>,
    pub(super) connect_timeout: Option<HumanDuration>,
    pub(super) statement_timeout: Option<HumanDuration>,
    pub(super) migration_lock: Option<MigrationLock>,
    pub(super) require_synchronous_replication: Option<bool>,
    pub(super) plaintext_responses: Option<PlaintextResponses>,
    pub(super) timeout: Option<HumanDuration>,
    pub(super) sweep_interval: Option<HumanDuration>,
    pub(super) sweep_batch: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRedis {
    pub(super) url: Option<String>,
    pub(super) timeout: Option<HumanDuration>,
    pub(super) prefix: Option<String>,
    /// Spanned (this and the files below): a setting that does not fit the
    /// URL, or a certificate without its key, is reported at its line.
    pub(super) cluster: Option<Spanned<bool>>,
    pub(super) ca_file: Option<Spanned<PathBuf>>,
    pub(super) cert_file: Option<Spanned<PathBuf>>,
    pub(super) key_file: Option<Spanned<PathBuf>>,
    /// Redis Sentinel instead of `url`: the sentinels' `host:port`s and
    /// the master's name (both or neither), and the settings a URL would
    /// otherwise carry: the master's credentials, TLS (for the master and
    /// the sentinels), and the sentinels' own credentials. Spanned: each is
    /// reported at its line when it does not fit.
    pub(super) sentinels: Option<Spanned<Vec<String>>>,
    pub(super) sentinel_master: Option<Spanned<String>>,
    pub(super) username: Option<Spanned<String>>,
    pub(super) password: Option<Spanned<String>>,
    pub(super) tls: Option<Spanned<bool>>,
    pub(super) sentinel_username: Option<Spanned<String>>,
    pub(super) sentinel_password: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    pub(super) format: Option<LogFormat>,
    /// Spanned: an unknown level is reported at its line.
    pub(super) level: Option<Spanned<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTracing {
    /// Spanned: a bad URL is reported at its line.
    pub(super) otlp_endpoint: Option<Spanned<String>>,
    pub(super) service_name: Option<String>,
    pub(super) sampling_ratio: Option<f64>,
}

/// One `[[route]]`, and also `[defaults]` (which may not set `methods`/`path`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRouteSettings {
    pub(super) methods: Option<Vec<MethodName>>,
    pub(super) allow_custom_methods: Option<bool>,
    pub(super) path: Option<Spanned<PatternValue>>,
    pub(super) key_header: Option<HeaderNameValue>,
    pub(super) require_key: Option<bool>,
    pub(super) ttl: Option<HumanDuration>,
    pub(super) lease: Option<HumanDuration>,
    pub(super) scope_header: Option<HeaderNameValue>,
    /// Spanned: setting it beside `scope_header` is reported at its line.
    pub(super) scope_headers: Option<Spanned<ScopeHeadersValue>>,
    pub(super) fingerprint_headers: Option<Vec<HeaderNameValue>>,
    pub(super) max_request_body: Option<ByteSize>,
    pub(super) max_response_body: Option<ByteSize>,
    pub(super) include_response_headers: Option<Vec<HeaderNameValue>>,
    pub(super) exclude_response_headers: Option<Vec<HeaderNameValue>>,
    pub(super) on_store_error: Option<OnStoreError>,
    pub(super) release_statuses: Option<ReleaseStatusesValue>,
    pub(super) on_ambiguous: Option<OnAmbiguous>,
    /// Spanned: a name no `[upstreams.NAME]` defines is reported at its line.
    pub(super) upstream: Option<Spanned<String>>,
    /// `key = { header = ".." }` or `{ json = "/pointer" }`.
    pub(super) key: Option<KeySpec>,
    /// `scope = { header = ".." }` or `{ value = "consumer" }`.
    pub(super) scope: Option<ScopeSpec>,
    pub(super) fingerprint: Option<FingerprintMode>,
    pub(super) fingerprint_ignore: Option<Vec<PointerValue>>,
    pub(super) in_flight: Option<InFlightValue>,
    pub(super) preset: Option<Preset>,
    /// `errors = "problem" | "stripe" | { template = "..", content_type = ".." }`.
    pub(super) errors: Option<ErrorShapeValue>,
    /// A route's own: leading path segments removed before forwarding.
    pub(super) strip_prefix: Option<String>,
    /// `replay_check = { method = "GET", path = "/v1/session" }`, or
    /// `"off"` (a route turning off `[defaults]`' check).
    pub(super) replay_check: Option<ReplayCheckValue>,
    pub(super) replay_check_cache: Option<HumanDuration>,
}

/// `replay_check`: the request whose 2xx lets a replay through.
#[derive(Debug, Clone)]
pub(super) enum ReplayCheckValue {
    Off,
    Check {
        method: Method,
        path: http::uri::PathAndQuery,
        /// Spanned: a name no `[upstreams.NAME]` defines is reported at its line.
        upstream: Option<Spanned<String>>,
    },
}

impl ReplayCheckValue {
    /// The `[upstreams.NAME]` it names, if any.
    pub(super) fn upstream(&self) -> Option<&Spanned<String>> {
        match self {
            Self::Off => None,
            Self::Check { upstream, .. } => upstream.as_ref(),
        }
    }
}

impl<'de> Deserialize<'de> for ReplayCheckValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str = "replay_check = { method = \"GET\", path = \"/v1/session\" } (upstream optional) or replay_check = \"off\"";
        impl<'de> Visitor<'de> for V {
            type Value = ReplayCheckValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ReplayCheckValue, E> {
                match v {
                    "off" => Ok(ReplayCheckValue::Off),
                    _ => Err(E::custom(format!("replay_check: {v:?} is not {EXPECTED}"))),
                }
            }
            fn visit_map<A: de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<ReplayCheckValue, A::Error> {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Table {
                    method: Option<MethodName>,
                    path: String,
                    upstream: Option<Spanned<String>>,
                }
                let t = Table::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let path = t
                    .path
                    .starts_with('/')
                    .then(|| t.path.parse::<http::uri::PathAndQuery>().ok())
                    .flatten()
                    .ok_or_else(|| {
                        de::Error::custom(format!(
                            "replay_check.path {:?} must be an origin-form path such as \"/v1/session\"",
                            t.path
                        ))
                    })?;
                Ok(ReplayCheckValue::Check {
                    method: t.method.map_or(Method::GET, |m| m.0),
                    path,
                    upstream: t.upstream,
                })
            }
        }
        d.deserialize_any(V)
    }
}

// ===== [[consumer]] (config/consumers.rs) =====

/// One `[[consumer]]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConsumer {
    pub(super) name: Option<String>,
    pub(super) source: Option<RawSource>,
    pub(super) deliver: Option<RawDeliver>,
    pub(super) key: Option<KeyValue>,
    pub(super) ttl: Option<HumanDuration>,
    pub(super) lease: Option<HumanDuration>,
    pub(super) max_attempts: Option<u32>,
    pub(super) retry_initial: Option<HumanDuration>,
    pub(super) retry_max: Option<HumanDuration>,
    pub(super) on_ambiguous: Option<OnAmbiguous>,
    pub(super) release_statuses: Option<ReleaseStatusesValue>,
    pub(super) fingerprint: Option<FingerprintMode>,
    pub(super) max_response_body: Option<ByteSize>,
}

/// `source = { amqp = { .. } }` or `{ jetstream = { .. } }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "lowercase")]
pub(super) enum RawSource {
    Amqp(RawAmqp),
    Jetstream(RawJetStream),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAmqp {
    pub(super) url: Option<String>,
    pub(super) queue: String,
    pub(super) prefetch: Option<u16>,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) cert_file: Option<PathBuf>,
    pub(super) key_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawJetStream {
    pub(super) url: Option<String>,
    pub(super) stream: String,
    pub(super) durable: String,
    pub(super) ack_wait: Option<HumanDuration>,
    pub(super) max_ack_pending: Option<i64>,
    pub(super) dead_letter_subject: Option<String>,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) cert_file: Option<PathBuf>,
    pub(super) key_file: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDeliver {
    pub(super) method: Option<MethodName>,
    pub(super) path: String,
    pub(super) upstream: Option<Spanned<String>>,
}

/// `key = "message-id"`, `{ header = ".." }` or `{ json = "/pointer" }`.
#[derive(Debug)]
pub(super) struct KeyValue(pub(super) RawKey);

/// Where a message's key comes from, as written.
#[derive(Debug)]
pub(super) enum RawKey {
    MessageId,
    Header(HeaderName),
    Json(Pointer),
}

impl<'de> Deserialize<'de> for KeyValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str = "key = \"message-id\", key = { header = \"X-Order-Id\" } or key = { json = \"/orderId\" }";
        impl<'de> Visitor<'de> for V {
            type Value = KeyValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyValue, E> {
                match v {
                    "message-id" => Ok(KeyValue(RawKey::MessageId)),
                    _ => Err(E::custom(format!("key: {v:?} is not {EXPECTED}"))),
                }
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<KeyValue, A::Error> {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Table {
                    header: Option<HeaderNameValue>,
                    json: Option<PointerValue>,
                }
                let t = Table::deserialize(de::value::MapAccessDeserializer::new(map))?;
                match (t.header, t.json) {
                    (Some(h), None) => Ok(KeyValue(RawKey::Header(h.0))),
                    (None, Some(p)) => Ok(KeyValue(RawKey::Json(p.0))),
                    _ => Err(de::Error::custom(format!(
                        "key: set exactly one of `header` or `json`: {EXPECTED}"
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

// ===== value types that validate while parsing =====

#[derive(Debug)]
pub(super) struct UpstreamUri(pub(super) Uri);

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
        Some("http" | "https") => {}
        Some(other) => {
            return Err(format!(
                "invalid upstream URL {s:?}: scheme {other:?} is not supported (use http:// or https://)"
            ))
        }
        None => {
            return Err(format!(
                "invalid upstream URL {s:?}: expected http://host:port or https://host:port"
            ))
        }
    }
    if uri.authority().is_none() {
        return Err(format!("invalid upstream URL {s:?}: missing host"));
    }
    // `Uri` keeps any digits as the port; a connect would fail on each
    // request, long after check-config said "ok".
    // (`Uri::port` is `None` for one that is no `u16`.)
    let authority = uri.authority().map_or("", |a| a.as_str());
    let port = authority
        .rsplit_once(':')
        .filter(|(host, _)| !host.starts_with('[') || host.ends_with(']'))
        .map(|(_, port)| port);
    if let Some(port) = port.filter(|p| !p.is_empty()) {
        if !matches!(port.parse::<u16>(), Ok(1..)) {
            return Err(format!(
                "invalid upstream URL {s:?}: port {port} is out of range (1 to 65535)"
            ));
        }
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
pub(super) struct MethodName(pub(super) Method);

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
pub(super) struct PatternValue(pub(super) PathPattern);

impl<'de> Deserialize<'de> for PatternValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        PathPattern::parse(&s)
            .map(PatternValue)
            .map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug)]
pub(super) struct HeaderNameValue(pub(super) HeaderName);

impl<'de> Deserialize<'de> for HeaderNameValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        HeaderName::from_bytes(s.as_bytes())
            .map(HeaderNameValue)
            .map_err(|_| serde::de::Error::custom(format!("invalid header name {s:?}")))
    }
}

/// `release_statuses`: every entry checked as it is read, so a bad one is
/// reported at its line.
#[derive(Clone, Debug)]
pub(super) struct ReleaseStatusesValue(pub(super) ReleaseStatuses);

impl<'de> Deserialize<'de> for ReleaseStatusesValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let entries = Vec::<StatusEntryValue>::deserialize(d)?;
        ReleaseStatuses::new(entries.into_iter().map(|e| e.0).collect())
            .map(ReleaseStatusesValue)
            .map_err(|e| de::Error::custom(format!("release_statuses: {e}")))
    }
}

struct StatusEntryValue(StatusEntry);

impl<'de> Deserialize<'de> for StatusEntryValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = StatusEntryValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a status such as \"429\" or a class such as \"5xx\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<StatusEntryValue, E> {
                v.parse()
                    .map(StatusEntryValue)
                    .map_err(|e| E::custom(format!("release_statuses: {e}")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<StatusEntryValue, E> {
                Err(E::custom(format!(
                    "release_statuses: write each status as a string, e.g. \"{v}\""
                )))
            }
        }
        d.deserialize_any(V)
    }
}

/// `scope_headers`: at least one header, none twice.
#[derive(Clone, Debug)]
pub(super) struct ScopeHeadersValue(pub(super) Vec<HeaderName>);

impl<'de> Deserialize<'de> for ScopeHeadersValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let names: Vec<HeaderName> = Vec::<HeaderNameValue>::deserialize(d)?
            .into_iter()
            .map(|h| h.0)
            .collect();
        if names.is_empty() {
            return Err(de::Error::custom(
                "scope_headers must list at least one header, the credential (e.g. [\"Authorization\"])",
            ));
        }
        if let Some((_, twice)) = names
            .iter()
            .enumerate()
            .find(|(i, n)| names[..*i].contains(n))
        {
            return Err(de::Error::custom(format!(
                "scope_headers: {twice:?} is listed twice"
            )));
        }
        Ok(ScopeHeadersValue(names))
    }
}

// ===== natural keys and deliveries =====

/// An RFC 6901 pointer, checked as it is read.
#[derive(Clone, Debug)]
pub(super) struct PointerValue(pub(super) Pointer);

impl<'de> Deserialize<'de> for PointerValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Pointer::parse(&s)
            .map(PointerValue)
            .map_err(de::Error::custom)
    }
}

/// `key`: exactly one source.
#[derive(Clone, Debug)]
pub(super) enum KeySpec {
    Header(HeaderName),
    Json(Pointer),
}

impl<'de> Deserialize<'de> for KeySpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            header: Option<HeaderNameValue>,
            json: Option<PointerValue>,
        }
        match Raw::deserialize(d)? {
            Raw {
                header: Some(h),
                json: None,
            } => Ok(KeySpec::Header(h.0)),
            Raw {
                header: None,
                json: Some(p),
            } => Ok(KeySpec::Json(p.0)),
            _ => Err(de::Error::custom(
                "key: set exactly one of `header` (key = { header = \"X-GitHub-Delivery\" }) or `json` (key = { json = \"/message/messageId\" })",
            )),
        }
    }
}

/// `scope`: exactly one source.
#[derive(Clone, Debug)]
pub(super) enum ScopeSpec {
    Header(HeaderName),
    Value(String),
    /// `scope = { client_cert = true }`: the client's verified certificate.
    ClientCert,
}

impl<'de> Deserialize<'de> for ScopeSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            header: Option<HeaderNameValue>,
            value: Option<String>,
            client_cert: Option<bool>,
        }
        match Raw::deserialize(d)? {
            Raw {
                header: Some(h),
                value: None,
                client_cert: None,
            } => Ok(ScopeSpec::Header(h.0)),
            Raw {
                header: None,
                value: Some(v),
                client_cert: None,
            } if !v.is_empty() && v.len() <= 255 => Ok(ScopeSpec::Value(v)),
            Raw {
                value: Some(_),
                header: None,
                client_cert: None,
            } => Err(de::Error::custom(
                "scope: `value` must be 1 to 255 characters",
            )),
            Raw {
                header: None,
                value: None,
                client_cert: Some(true),
            } => Ok(ScopeSpec::ClientCert),
            Raw {
                client_cert: Some(false),
                ..
            } => Err(de::Error::custom(
                "scope: `client_cert` can only be true (leave `scope` out for the default scope headers)",
            )),
            _ => Err(de::Error::custom(
                "scope: set exactly one of `header` (scope = { header = \"X-Tenant-Id\" }), `value` (scope = { value = \"stripe\" }) or `client_cert` (scope = { client_cert = true }, with server.tls_client_ca_file)",
            )),
        }
    }
}

/// `in_flight = "reject"` or `in_flight = { wait = "10s" }`.
#[derive(Clone, Copy, Debug)]
pub(super) struct InFlightValue(pub(super) InFlight);

impl<'de> Deserialize<'de> for InFlightValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str = "in_flight = \"reject\" or in_flight = { wait = \"10s\" }";
        impl<'de> Visitor<'de> for V {
            type Value = InFlightValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<InFlightValue, E> {
                match v {
                    "reject" => Ok(InFlightValue(InFlight::Reject)),
                    _ => Err(E::custom(format!("in_flight: {v:?} is not {EXPECTED}"))),
                }
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<InFlightValue, A::Error> {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Wait {
                    wait: HumanDuration,
                }
                let w = Wait::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(InFlightValue(InFlight::Wait(w.wait.0)))
            }
        }
        d.deserialize_any(V)
    }
}

/// `errors = "problem"`, `errors = "stripe"` or
/// `errors = { template = "..", content_type = "application/json" }`
/// (content_type defaults to `application/json`); a template is checked
/// here, so its error names the line.
#[derive(Clone, Debug)]
pub(super) struct ErrorShapeValue(pub(super) ErrorShape);

impl<'de> Deserialize<'de> for ErrorShapeValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const EXPECTED: &str = "errors = \"problem\", \"stripe\" or { template = \"..\", content_type = \"application/json\" }";
        impl<'de> Visitor<'de> for V {
            type Value = ErrorShapeValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(EXPECTED)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ErrorShapeValue, E> {
                match v {
                    "problem" => Ok(ErrorShapeValue(ErrorShape::Problem)),
                    "stripe" => Ok(ErrorShapeValue(ErrorShape::Stripe)),
                    _ => Err(E::custom(format!("errors: {v:?} is not {EXPECTED}"))),
                }
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<ErrorShapeValue, A::Error> {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Template {
                    template: String,
                    content_type: Option<String>,
                }
                let t = Template::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let content_type = t.content_type.as_deref().unwrap_or("application/json");
                ErrorTemplate::parse(&t.template, content_type)
                    .map(|t| ErrorShapeValue(ErrorShape::Template(std::sync::Arc::new(t))))
                    .map_err(de::Error::custom)
            }
        }
        d.deserialize_any(V)
    }
}
