//! `[[consumer]]`: message consumers that take messages from a broker
//! (RabbitMQ over AMQP 0-9-1, NATS JetStream) and deliver each to the
//! upstream as one protected request, scoped by the consumer's name
//! (README "Message consumers").
//!
//! Each consumer's route settings (`ttl`, `lease`, `release_statuses`,
//! `on_ambiguous`, `fingerprint`, `max_response_body`) resolve against
//! `[defaults]` like a route's, into the [`RouteConfig`] its deliveries
//! run under. A broker URL may come from the environment instead of the
//! file: `IDEMGATE_CONSUMER_<NAME>_URL` (the name upper-cased, `-` and
//! `.` as `_`), which wins over the file's; credentials belong there.

use super::raw::{RawConsumer, RawKey, RawSource};
use super::units::format_duration;
use super::{Invalid, OnAmbiguous, OnStoreError, RouteConfig};
use super::{DEFAULT_KEY_HEADER, DEFAULT_LEASE, DEFAULT_MAX_RESPONSE_BODY, MIN_LEASE};
use crate::idempotency::canonical_json::Pointer;
use crate::idempotency::decision::ReleaseStatuses;
use crate::net::tls::{ClientIdentity, ClientTls, FileNames, Roots, ServerCheck};
use crate::route::{InFlight, PathPattern};
use http::{HeaderName, Method};
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use toml::Spanned;

/// At least the broker's redelivery horizon; a week covers a consumer
/// that was down over a weekend.
pub const DEFAULT_CONSUMER_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// Attempts per message key before it is dead-lettered.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;
pub const DEFAULT_RETRY_INITIAL: Duration = Duration::from_secs(1);
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(300);
/// AMQP `basic.qos` prefetch: deliveries unacked at once, so the most
/// that run at once.
pub const DEFAULT_PREFETCH: u16 = 16;
/// JetStream's own default.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
pub const DEFAULT_MAX_ACK_PENDING: i64 = 16;
/// Below this a `+WPI` every half of it would be a busy loop.
const MIN_ACK_WAIT: Duration = Duration::from_secs(1);

// ===== the settings =====

/// One consumer, validated.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// Unique among the consumers; the scope of its keys.
    pub name: Arc<str>,
    pub source: SourceConfig,
    pub key: MessageKey,
    /// Attempts per message key (across redeliveries and restarts), then
    /// dead-letter.
    pub max_attempts: u32,
    pub retry_initial: Duration,
    pub retry_max: Duration,
    /// The settings its deliveries run under, as a route's: the method and
    /// path delivered to, the upstream, ttl, lease, and the rest.
    pub route: Arc<RouteConfig>,
}

/// Compared by what the file says (the route is made from it).
impl PartialEq for ConsumerConfig {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.source == other.source
            && self.key == other.key
            && self.max_attempts == other.max_attempts
            && self.retry_initial == other.retry_initial
            && self.retry_max == other.retry_max
            && format!("{:?}", self.route) == format!("{:?}", other.route)
    }
}

/// Where a message's idempotency key comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MessageKey {
    /// AMQP's `message_id` property; JetStream's `Nats-Msg-Id` header.
    MessageId,
    /// A message header.
    Header(HeaderName),
    /// A JSON pointer into the payload (a string, or an integer's digits).
    Json(Pointer),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceConfig {
    Amqp(AmqpSource),
    JetStream(JetStreamSource),
}

impl SourceConfig {
    pub fn url(&self) -> &BrokerUrl {
        match self {
            SourceConfig::Amqp(a) => &a.url,
            SourceConfig::JetStream(j) => &j.url,
        }
    }
}

/// A broker URL; it may carry credentials, so its `Debug` and `Display`
/// hide the password.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl(String);

impl BrokerUrl {
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `****`.
    pub fn masked(&self) -> String {
        let s = &self.0;
        let Some(scheme_end) = s.find("://").map(|i| i + 3) else {
            return s.clone();
        };
        let rest = &s[scheme_end..];
        let authority_end = rest.find('/').unwrap_or(rest.len());
        match rest[..authority_end].rfind('@') {
            Some(at) => {
                let userinfo = &rest[..at];
                let user = userinfo.split(':').next().unwrap_or("");
                let hidden = if userinfo.contains(':') {
                    format!("{user}:****")
                } else {
                    "****".to_string()
                };
                format!("{}{hidden}{}", &s[..scheme_end], &rest[at..])
            }
            None => s.clone(),
        }
    }
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.masked())
    }
}

impl fmt::Display for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.masked())
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmqpSource {
    pub url: BrokerUrl,
    pub queue: String,
    pub prefetch: u16,
    /// TLS (`amqps://`): through `net::tls`, chain and name verified.
    pub tls: Option<ClientTls>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JetStreamSource {
    pub url: BrokerUrl,
    pub stream: String,
    /// The durable pull consumer bound to (created when missing).
    pub durable: String,
    pub ack_wait: Duration,
    pub max_ack_pending: i64,
    pub dead_letter_subject: Option<String>,
    /// TLS required (`tls://`): through `net::tls`, chain and name
    /// verified. `None` for `nats://`, which still upgrades through
    /// `net::tls` (system roots) when the server requires TLS.
    pub tls: Option<ClientTls>,
}

impl fmt::Display for ConsumerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.route;
        let source = match &self.source {
            SourceConfig::Amqp(a) => {
                format!("amqp {} queue {:?} prefetch {}", a.url, a.queue, a.prefetch)
            }
            SourceConfig::JetStream(j) => format!(
                "jetstream {} stream {:?} durable {:?} ack_wait {}",
                j.url,
                j.stream,
                j.durable,
                format_duration(j.ack_wait)
            ),
        };
        let key = match &self.key {
            MessageKey::MessageId => "message-id".to_string(),
            MessageKey::Header(h) => format!("header {h}"),
            MessageKey::Json(p) => format!("json {p}"),
        };
        writeln!(
            f,
            "consumer   {}: {source} -> {} {} (upstream {}), key {key}, ttl {}, lease {}, max_attempts {}, retry {}..{}",
            self.name,
            r.methods[0],
            r.path,
            r.upstream.as_deref().unwrap_or("default"),
            format_duration(r.ttl),
            format_duration(r.lease),
            self.max_attempts,
            format_duration(self.retry_initial),
            format_duration(self.retry_max),
        )
    }
}

/// The environment variable that may hold a consumer's broker URL.
pub fn url_variable(name: &str) -> String {
    let upper: String = name
        .chars()
        .map(|c| match c {
            'a'..='z' => c.to_ascii_uppercase(),
            'A'..='Z' | '0'..='9' => c,
            _ => '_',
        })
        .collect();
    format!("IDEMGATE_CONSUMER_{upper}_URL")
}

/// The route settings `[defaults]` gives a consumer.
pub(super) struct Inherited<'a> {
    pub(super) lease: Option<Duration>,
    pub(super) release_statuses: Option<&'a ReleaseStatuses>,
    pub(super) on_ambiguous: Option<OnAmbiguous>,
    pub(super) max_response_body: Option<u64>,
}

/// The `[[consumer]]`s in file order; names must be unique.
pub(super) fn read(
    raw: Vec<Spanned<RawConsumer>>,
    inherited: &Inherited<'_>,
    env: &BTreeMap<String, String>,
) -> Result<Vec<ConsumerConfig>, Invalid> {
    let mut out: Vec<ConsumerConfig> = Vec::with_capacity(raw.len());
    for (i, spanned) in raw.into_iter().enumerate() {
        let span = spanned.span();
        let consumer = one(i, spanned.into_inner(), inherited, env).map_err(|e| match e {
            Invalid {
                at: None,
                field: None,
                message,
            } => Invalid::at(span.clone(), message),
            other => other,
        })?;
        if out.iter().any(|c| c.name == consumer.name) {
            return Err(Invalid::field(
                format!("consumer.{i}.name"),
                format!(
                    "consumer #{}: the name {:?} is already another consumer's; names scope the keys, so each must be unique",
                    i + 1,
                    &*consumer.name
                ),
            ));
        }
        out.push(consumer);
    }
    Ok(out)
}

fn one(
    i: usize,
    r: RawConsumer,
    inherited: &Inherited<'_>,
    env: &BTreeMap<String, String>,
) -> Result<ConsumerConfig, Invalid> {
    let at =
        |field: &str, message: String| Invalid::field(format!("consumer.{i}.{field}"), message);
    let n = i + 1;
    let name = r.name.ok_or_else(|| {
        Invalid::from(format!(
            "consumer #{n}: `name` is required, e.g. name = \"reserve-stock\""
        ))
    })?;
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(at(
            "name",
            format!(
                "consumer #{n}: name {name:?} must be 1 to 64 letters, digits, `-`, `_` or `.`"
            ),
        ));
    }
    let who = format!("consumer {name:?}");
    let variable = url_variable(&name);
    let from_env = env.get(&variable).filter(|v| !v.is_empty()).cloned();
    let url = |given: Option<String>, schemes: &[&str], example: &str| {
        let url = from_env.clone().or(given).ok_or_else(|| {
            at(
                "source",
                format!("{who}: the broker's `url` is required (in the file, or in {variable}), e.g. url = {example:?}"),
            )
        })?;
        if !schemes.iter().any(|s| url.starts_with(&format!("{s}://"))) {
            let url = BrokerUrl(url);
            return Err(at(
                "source",
                format!(
                    "{who}: url {url} must start with {}",
                    schemes
                        .iter()
                        .map(|s| format!("{s}://"))
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            ));
        }
        Ok(BrokerUrl(url))
    };
    let source = match r.source {
        None => {
            return Err(Invalid::from(format!(
                "{who}: `source` is required: source = {{ amqp = {{ url = \"amqp://127.0.0.1:5672/%2f\", queue = \"orders\" }} }} or source = {{ jetstream = {{ url = \"nats://127.0.0.1:4222\", stream = \"ORDERS\", durable = \"{name}\" }} }}"
            )))
        }
        Some(RawSource::Amqp(a)) => {
            let url = url(a.url, &["amqp", "amqps"], "amqp://127.0.0.1:5672/%2f")?;
            if a.queue.is_empty() {
                return Err(at("source", format!("{who}: `queue` must name a queue")));
            }
            let prefetch = a.prefetch.unwrap_or(DEFAULT_PREFETCH);
            if prefetch == 0 {
                return Err(at("source", format!("{who}: prefetch must be at least 1 (0 would mean unbounded)")));
            }
            let tls = broker_tls(
                &who,
                &url,
                url.expose().starts_with("amqps://"),
                "amqps://",
                [a.ca_file, a.cert_file, a.key_file],
            )
            .map_err(|m| at("source", m))?;
            SourceConfig::Amqp(AmqpSource {
                url,
                queue: a.queue,
                prefetch,
                tls,
            })
        }
        Some(RawSource::Jetstream(j)) => {
            let url = url(j.url, &["nats", "tls"], "nats://127.0.0.1:4222")?;
            let token = |what: &str, v: &str| {
                let ok = !v.is_empty()
                    && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
                match ok {
                    true => Ok(()),
                    false => Err(at(
                        "source",
                        format!("{who}: {what} {v:?} must be letters, digits, `-` or `_`"),
                    )),
                }
            };
            token("stream", &j.stream)?;
            token("durable", &j.durable)?;
            let ack_wait = j.ack_wait.map_or(DEFAULT_ACK_WAIT, |d| d.0);
            if ack_wait < MIN_ACK_WAIT {
                return Err(at(
                    "source",
                    format!("{who}: ack_wait {} is too short (minimum {})", format_duration(ack_wait), format_duration(MIN_ACK_WAIT)),
                ));
            }
            let max_ack_pending = j.max_ack_pending.unwrap_or(DEFAULT_MAX_ACK_PENDING);
            if max_ack_pending < 1 {
                return Err(at("source", format!("{who}: max_ack_pending must be at least 1")));
            }
            if let Some(s) = &j.dead_letter_subject {
                if s.is_empty() || s.contains([' ', '*', '>']) {
                    return Err(at(
                        "source",
                        format!("{who}: dead_letter_subject {s:?} must be a subject without wildcards"),
                    ));
                }
            }
            let tls = broker_tls(
                &who,
                &url,
                url.expose().starts_with("tls://"),
                "tls://",
                [j.ca_file, j.cert_file, j.key_file],
            )
            .map_err(|m| at("source", m))?;
            SourceConfig::JetStream(JetStreamSource {
                tls,
                url,
                stream: j.stream,
                durable: j.durable,
                ack_wait,
                max_ack_pending,
                dead_letter_subject: j.dead_letter_subject,
            })
        }
    };
    let deliver = r.deliver.ok_or_else(|| {
        Invalid::from(format!(
            "{who}: `deliver` is required, e.g. deliver = {{ method = \"POST\", path = \"/internal/{name}\" }}"
        ))
    })?;
    let path = PathPattern::parse(&deliver.path)
        .map_err(|e| at("deliver", format!("{who}: deliver.path: {e}")))?;
    // A path no request URI can carry (`/a b`) would fail every delivery.
    if !deliver.path.starts_with('/')
        || deliver.path.contains(['{', '}', '*', '?', '#'])
        || http::Uri::try_from(deliver.path.as_str()).is_err()
    {
        return Err(at(
            "deliver",
            format!("{who}: deliver.path {:?} must be one literal origin-form path such as \"/internal/{name}\"", deliver.path),
        ));
    }
    let lease = r
        .lease
        .map(|d| d.0)
        .or(inherited.lease)
        .unwrap_or(DEFAULT_LEASE);
    if lease < MIN_LEASE {
        return Err(at(
            "lease",
            format!(
                "{who}: lease = {:?} is too short (minimum {})",
                format_duration(lease),
                format_duration(MIN_LEASE)
            ),
        ));
    }
    // [defaults] ttl is written for HTTP clients' retries (a day); a
    // broker redelivers for longer, so a consumer's own default is a week.
    let ttl = r.ttl.map_or(DEFAULT_CONSUMER_TTL, |d| d.0);
    if ttl < lease {
        return Err(at(
            "ttl",
            format!(
                "{who}: ttl ({}) must be at least the lease ({})",
                format_duration(ttl),
                format_duration(lease)
            ),
        ));
    }
    let max_attempts = r.max_attempts.unwrap_or(DEFAULT_MAX_ATTEMPTS);
    if max_attempts == 0 {
        return Err(at(
            "max_attempts",
            format!("{who}: max_attempts must be at least 1"),
        ));
    }
    let retry_initial = r.retry_initial.map_or(DEFAULT_RETRY_INITIAL, |d| d.0);
    let retry_max = r
        .retry_max
        .map_or(DEFAULT_RETRY_MAX.max(retry_initial), |d| d.0);
    if retry_initial.is_zero() {
        return Err(at(
            "retry_initial",
            format!("{who}: retry_initial must be greater than 0"),
        ));
    }
    if retry_max < retry_initial {
        return Err(at(
            "retry_max",
            format!(
                "{who}: retry_max ({}) must be at least retry_initial ({})",
                format_duration(retry_max),
                format_duration(retry_initial)
            ),
        ));
    }
    let method = deliver.method.map_or(Method::POST, |m| m.0);
    let route = RouteConfig {
        index: 0,
        label: Arc::new(format!("consumer:{name}")),
        methods: vec![method],
        path,
        key_header: HeaderName::from_static_lower(DEFAULT_KEY_HEADER),
        require_key: true,
        ttl,
        lease,
        scope_headers: Vec::new(),
        fingerprint_headers: Vec::new(),
        // A message's size is the broker's to bound.
        max_request_body: u64::MAX,
        max_response_body: r
            .max_response_body
            .map(|s| s.0)
            .or(inherited.max_response_body)
            .unwrap_or(DEFAULT_MAX_RESPONSE_BODY),
        include_response_headers: Vec::new(),
        exclude_response_headers: Vec::new(),
        on_store_error: OnStoreError::Reject,
        release_statuses: r
            .release_statuses
            .map(|v| v.0)
            .or_else(|| inherited.release_statuses.cloned())
            .unwrap_or_default(),
        on_ambiguous: r
            .on_ambiguous
            .or(inherited.on_ambiguous)
            .unwrap_or_default(),
        upstream: deliver.upstream.map(|u| Arc::from(u.into_inner())),
        key_json: None,
        scope_value: Some(name.clone()),
        scope_client_cert: false,
        fingerprint: r.fingerprint.unwrap_or_default(),
        fingerprint_ignore: Vec::new(),
        in_flight: InFlight::Reject,
        preset: None,
        errors: Default::default(),
        strip_prefix: None,
        replay_check: None,
    };
    Ok(ConsumerConfig {
        name: Arc::from(name),
        source,
        key: match r.key.map(|k| k.0) {
            None | Some(RawKey::MessageId) => MessageKey::MessageId,
            Some(RawKey::Header(h)) => MessageKey::Header(h),
            Some(RawKey::Json(p)) => MessageKey::Json(p),
        },
        max_attempts,
        retry_initial,
        retry_max,
        route: Arc::new(route),
    })
}

/// What the consumer's TLS files are called in errors (`net::tls`).
pub const TLS_FILES: FileNames =
    FileNames::new("source ca_file", "source cert_file", "source key_file");

/// The TLS settings of a broker `url` (`tls_url`: its scheme is
/// `tls_scheme`) from its `ca_file`, `cert_file` and `key_file`: the
/// server's chain and name are always verified, against `ca_file` or the
/// system roots. Files on a plain URL, or a certificate without its key
/// (or the reverse), are refused: either would silently not be used.
fn broker_tls(
    who: &str,
    url: &BrokerUrl,
    tls_url: bool,
    tls_scheme: &str,
    [ca, cert, key]: [Option<PathBuf>; 3],
) -> Result<Option<ClientTls>, String> {
    if !tls_url {
        let given = [("ca_file", &ca), ("cert_file", &cert), ("key_file", &key)];
        if let Some((name, _)) = given.iter().find(|(_, f)| f.is_some()) {
            return Err(format!(
                "{who}: {name} only applies to a TLS URL ({tls_scheme}), but url is {url}"
            ));
        }
        return Ok(None);
    }
    let identity = match (cert, key) {
        (Some(cert), Some(key)) => Some(ClientIdentity { cert, key }),
        (None, None) => None,
        (Some(_), None) => {
            return Err(format!(
                "{who}: cert_file is set without key_file: a client certificate needs its private key (both PEM)"
            ))
        }
        (None, Some(_)) => {
            return Err(format!(
                "{who}: key_file is set without cert_file: a private key needs its client certificate (both PEM)"
            ))
        }
    };
    Ok(Some(ClientTls {
        check: ServerCheck::ChainAndName,
        roots: ca.map_or(Roots::System, Roots::File),
        identity,
        names: TLS_FILES,
    }))
}

/// `HeaderName::from_static` wants lower case.
trait FromStaticLower {
    fn from_static_lower(name: &str) -> HeaderName;
}

impl FromStaticLower for HeaderName {
    fn from_static_lower(name: &str) -> HeaderName {
        HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).expect("a valid header name")
    }
}

#[cfg(test)]
mod tests {
    use super::super::Config;
    use std::collections::BTreeMap;

    const BASE: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n";
    const AMQP: &str = "source = { amqp = { url = \"amqp://guest:guest@127.0.0.1:5672/%2f\", queue = \"orders\" } }\ndeliver = { path = \"/in\" }\n";

    fn parse(consumers: &str) -> Result<Config, String> {
        Config::parse(&format!("{BASE}{consumers}"), "c.toml").map_err(|e| e.to_string())
    }

    #[test]
    fn the_issue_example_parses_with_its_defaults() {
        let c = parse(&format!("[[consumer]]\nname = \"reserve-stock\"\n{AMQP}key = \"message-id\"\nttl = \"7d\"\nlease = \"30s\"\nmax_attempts = 10\nretry_initial = \"1s\"\nretry_max = \"5m\"\n"))
            .unwrap();
        let c = &c.restart.consumers[0];
        assert_eq!(&*c.name, "reserve-stock");
        assert_eq!(c.max_attempts, 10);
        assert_eq!(c.route.scope_value.as_deref(), Some("reserve-stock"));
        assert_eq!(c.route.methods, [http::Method::POST]);
        // The password never shows.
        let shown = format!("{c:?} {c}");
        assert!(!shown.contains("guest:guest"), "{shown}");
        assert!(shown.contains("guest:****"), "{shown}");
        let js = parse("[[consumer]]\nname = \"j\"\nsource = { jetstream = { url = \"nats://127.0.0.1:4222\", stream = \"ORDERS\", durable = \"j\", ack_wait = \"10s\", dead_letter_subject = \"ORDERS.dead\" } }\ndeliver = { method = \"PUT\", path = \"/j\" }\nkey = { json = \"/orderId\" }\non_ambiguous = \"keep\"\nrelease_statuses = [\"503\"]\n").unwrap();
        let j = &js.restart.consumers[0];
        assert_eq!(j.route.on_ambiguous, crate::route::OnAmbiguous::Keep);
        assert!(!j.route.release_statuses.contains(500));
    }

    /// Each mistake names the file, the line and the field.
    #[test]
    fn mistakes_name_the_file_line_and_field() {
        let rows: &[(&str, &str)] = &[
            ("[[consumer]]\nname = \"a\"\nsource = { amqp = { queue = \"q\" } }\ndeliver = { path = \"/in\" }\n", "line 5: consumer \"a\": the broker's `url` is required"),
            ("[[consumer]]\nname = \"a\"\nsource = { kafka = { topic = \"t\" } }\ndeliver = { path = \"/in\" }\n", "unknown variant `kafka`"),
            ("[[consumer]]\nname = \"a\"\nsource = { amqp = { url = \"amqp://h\", queue = \"q\", prefetch = 0 } }\ndeliver = { path = \"/in\" }\n", "line 5: consumer \"a\": prefetch must be at least 1"),
            (&format!("[[consumer]]\nname = \"a\"\n{AMQP}colour = \"blue\"\n"), "unknown field `colour`"),
            (&format!("[[consumer]]\nname = \"a b\"\n{AMQP}"), "line 4: consumer #1: name \"a b\""),
            (&format!("[[consumer]]\nname = \"a\"\n{AMQP}[[consumer]]\nname = \"a\"\n{AMQP}"), "line 8: consumer #2: the name \"a\" is already"),
            (&format!("[[consumer]]\nname = \"a\"\n{AMQP}max_attempts = 0\n"), "line 7: consumer \"a\": max_attempts must be at least 1"),
            // Pins consumer review M4: passed, then panicked on every message.
            ("[[consumer]]\nname = \"a\"\nsource = { amqp = { url = \"amqp://h\", queue = \"q\" } }\ndeliver = { path = \"/a b\" }\n", "must be one literal origin-form path"),
            (&format!("[[consumer]]\nname = \"a\"\n{AMQP}retry_initial = \"10s\"\nretry_max = \"1s\"\n"), "line 8: consumer \"a\": retry_max"),
            (&format!("[[consumer]]\nname = \"a\"\n{AMQP}key = \"offset\"\n"), "key: \"offset\" is not"),
            (&format!("[[consumer]]\nname = \"a\"\n{AMQP}ttl = \"1s\"\n"), "line 7: consumer \"a\": ttl (1s) must be at least the lease"),
            ("[[consumer]]\nname = \"a\"\nsource = { amqp = { url = \"amqp://h\", queue = \"q\" } }\ndeliver = { path = \"/in\", upstream = \"billing\" }\n", "line 6: consumer \"a\": deliver.upstream = \"billing\" names no [upstreams.billing]"),
            ("[[consumer]]\nname = \"a\"\nsource = { jetstream = { url = \"http://h\", stream = \"S\", durable = \"d\" } }\ndeliver = { path = \"/in\" }\n", "must start with nats:// or tls://"),
            ("[[consumer]]\nname = \"a\"\nsource = { amqp = { url = \"amqp://h\", queue = \"q\" } }\n", "line 3: consumer \"a\": `deliver` is required"),
            ("[[consumer]]\nname = \"a\"\nsource = { amqp = { url = \"amqp://h\", queue = \"q\", ca_file = \"/ca.pem\" } }\ndeliver = { path = \"/in\" }\n", "line 5: consumer \"a\": ca_file only applies to a TLS URL (amqps://), but url is amqp://h"),
            ("[[consumer]]\nname = \"a\"\nsource = { jetstream = { url = \"nats://h\", stream = \"S\", durable = \"d\", key_file = \"/k.pem\" } }\ndeliver = { path = \"/in\" }\n", "key_file only applies to a TLS URL (tls://), but url is nats://h"),
            ("[[consumer]]\nname = \"a\"\nsource = { amqp = { url = \"amqps://h\", queue = \"q\", cert_file = \"/c.pem\" } }\ndeliver = { path = \"/in\" }\n", "cert_file is set without key_file"),
            ("[[consumer]]\nname = \"a\"\nsource = { jetstream = { url = \"tls://h\", stream = \"S\", durable = \"d\", key_file = \"/k.pem\" } }\ndeliver = { path = \"/in\" }\n", "key_file is set without cert_file"),
            // Pins consumer review L8: a route's fixed scope equal to a
            // consumer's name was accepted, sharing one key namespace.
            (&format!("[[route]]\nmethods = [\"POST\"]\npath = \"/pay\"\nscope = {{ value = \"a\" }}\n[[consumer]]\nname = \"a\"\n{AMQP}"), "line 8: consumer \"a\": its name is the scope of its keys, and route #1 /pay has scope = { value = \"a\" }"),
            (&format!("[defaults]\nscope = {{ value = \"a\" }}\n[[route]]\nmethods = [\"POST\"]\npath = \"/pay\"\n[[consumer]]\nname = \"a\"\n{AMQP}"), "line 9: consumer \"a\": its name is the scope of its keys, and route #1 /pay"),
        ];
        for (text, want) in rows {
            let e = parse(text).unwrap_err();
            assert!(e.starts_with("c.toml: "), "{e}");
            assert!(e.contains(want), "{text}\nwant {want:?}\ngot  {e}");
        }
    }

    /// Pins consumer review L7: the memory store was accepted with
    /// consumers in silence, though a restart forgets every record and the
    /// broker then redelivers what was unacked. A warning (printed by
    /// `serve` at start-up and by `check-config`) names each consumer.
    #[test]
    fn the_memory_store_with_consumers_warns_naming_each() {
        let two = format!("[[consumer]]\nname = \"a\"\n{AMQP}[[consumer]]\nname = \"b\"\n{AMQP}");
        let memory = parse(&format!("[store]\nbackend = \"memory\"\n{two}")).unwrap();
        let about = |c: &Config| -> Vec<String> {
            c.warnings()
                .into_iter()
                .filter(|w| w.contains("forgets every record on restart"))
                .collect()
        };
        let warned = about(&memory);
        assert_eq!(warned.len(), 2, "{warned:?}");
        assert!(
            warned[0].starts_with("consumer \"a\": store.backend = \"memory\""),
            "{warned:?}"
        );
        assert!(warned[1].starts_with("consumer \"b\": "), "{warned:?}");
        // Without consumers, or on a durable store: no such warning.
        assert!(about(&parse("[store]\nbackend = \"memory\"\n").unwrap()).is_empty());
        let sqlite = parse(&format!(
            "[store]\nbackend = \"sqlite\"\npath = \"s.db\"\n{two}"
        ))
        .unwrap();
        assert!(about(&sqlite).is_empty());
    }

    /// TLS URLs verify the chain and the name, against `ca_file` or the
    /// system roots; a client certificate goes with its key.
    #[test]
    fn tls_urls_take_the_ca_and_client_certificate() {
        use super::SourceConfig;
        use crate::net::tls::{ClientIdentity, Roots, ServerCheck};
        let c = parse("[[consumer]]\nname = \"j\"\nsource = { jetstream = { url = \"tls://n:4222\", stream = \"S\", durable = \"d\", ca_file = \"/ca.pem\", cert_file = \"/c.pem\", key_file = \"/k.pem\" } }\ndeliver = { path = \"/in\" }\n").unwrap();
        let SourceConfig::JetStream(j) = &c.restart.consumers[0].source else {
            panic!("jetstream")
        };
        let tls = j.tls.as_ref().unwrap();
        assert_eq!(tls.check, ServerCheck::ChainAndName);
        assert_eq!(tls.roots, Roots::File("/ca.pem".into()));
        assert_eq!(
            tls.identity,
            Some(ClientIdentity {
                cert: "/c.pem".into(),
                key: "/k.pem".into()
            })
        );
        let c = parse("[[consumer]]\nname = \"a\"\nsource = { amqp = { url = \"amqps://h\", queue = \"q\" } }\ndeliver = { path = \"/in\" }\n").unwrap();
        let SourceConfig::Amqp(a) = &c.restart.consumers[0].source else {
            panic!("amqp")
        };
        assert_eq!(a.tls.as_ref().unwrap().roots, Roots::System);
        let plain = parse(&format!("[[consumer]]\nname = \"a\"\n{AMQP}")).unwrap();
        let SourceConfig::Amqp(a) = &plain.restart.consumers[0].source else {
            panic!("amqp")
        };
        assert_eq!(a.tls, None);
    }

    #[test]
    fn the_url_may_come_from_the_environment() {
        let text = format!("{BASE}[[consumer]]\nname = \"reserve-stock\"\nsource = {{ amqp = {{ queue = \"q\" }} }}\ndeliver = {{ path = \"/in\" }}\n");
        let env = BTreeMap::from([(
            "IDEMGATE_CONSUMER_RESERVE_STOCK_URL".to_string(),
            "amqp://u:secret@10.0.0.1:5672/%2f".to_string(),
        )]);
        let c = Config::parse_with_env(&text, "c.toml", &env).unwrap();
        let url = c.restart.consumers[0].source.url();
        assert_eq!(url.expose(), "amqp://u:secret@10.0.0.1:5672/%2f");
        assert_eq!(url.to_string(), "amqp://u:****@10.0.0.1:5672/%2f");
    }

    /// Consumers hold broker connections opened at start: a reload keeps
    /// them and names each one added, removed or changed.
    #[test]
    fn a_reload_names_each_consumer_it_would_change() {
        let one = |name: &str, queue: &str| {
            format!("[[consumer]]\nname = \"{name}\"\nsource = {{ amqp = {{ url = \"amqp://h\", queue = \"{queue}\" }} }}\ndeliver = {{ path = \"/in\" }}\n")
        };
        let a = parse(&one("a", "q")).unwrap().restart;
        let same = parse(&one("a", "q")).unwrap().restart;
        let changed = parse(&one("a", "r")).unwrap().restart;
        let added = parse(&format!("{}{}", one("a", "q"), one("b", "q")))
            .unwrap()
            .restart;
        let none = parse("").unwrap().restart;
        assert!(a.changes(&same).is_empty());
        assert_eq!(a.changes(&changed), ["consumer.a"]);
        assert_eq!(a.changes(&added), ["consumer.b"]);
        assert_eq!(a.changes(&none), ["consumer.a"]);
    }
}
