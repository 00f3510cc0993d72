//! The environment's part of the configuration: one rule for every key of
//! the `server`, `admin`, `store`, `redis`, `log` and `tracing` sections,
//! and of the named upstreams the file defines.
//!
//! `IDEMGATE_<SECTION>_<KEY>` sets `key` in `[section]`, e.g.
//! `IDEMGATE_SERVER_UPSTREAM_TIMEOUT=5s` or `IDEMGATE_STORE_POOL_SIZE=32`.
//! `IDEMGATE_UPSTREAMS_<NAME>_<KEY>` sets `key` in `[upstreams.NAME]`
//! (NAME upper-cased, `-` as `_`), e.g. `IDEMGATE_UPSTREAMS_BILLING_URL`,
//! for a NAME the file defines: the environment changes an upstream, it
//! never creates one (a route must name it in the file anyway).
//! The value is read as one TOML value, or else taken as a string; a `url`
//! and any `*password` key are always taken as written, so a password never
//! meets the TOML parser (whose errors would quote it). An empty variable
//! counts as unset, and a variable wins over the file.
//!
//! The variables are laid onto the parsed file before it is read into typed
//! settings, so whatever key a section accepts can be set this way: no list
//! of keys is kept here, and an unknown key is the same error as in the
//! file. Variables for other sections (routes, `[defaults]`, or names such
//! as `IDEMGATE_CONFIG`) are not this module's business and are left alone.
//! Neither are the service-link variables Kubernetes injects for each
//! Service (`IDEMGATE_ADMIN_PORT=tcp://10.0.0.1:9090` for a Service named
//! `idemgate-admin`; [`is_service_link`]): skipped, never read as keys.
//!
//! Two aliases ([`ALIASES`]) name the settings most deployments set, and
//! `IDEMGATE_SCOPE_SECRET` ([`scope_secret`]) is read from the environment
//! only.

use super::raw::RawConfig;
use super::Secret;
use serde::Deserialize;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use toml::de::{DeTable, DeValue};
use toml::Spanned;

/// The sections the environment may set.
const SECTIONS: [&str; 6] = ["server", "admin", "store", "redis", "log", "tracing"];

/// The section of named tables (`[upstreams.NAME]`) the environment may set.
const NAMED: &str = "upstreams";

/// Short names for the addresses most deployments set: `(alias, canonical)`.
/// An alias's value is taken as written; setting both names is an error.
const ALIASES: [(&str, &str); 2] = [
    ("IDEMGATE_LISTEN", "IDEMGATE_SERVER_LISTEN"),
    ("IDEMGATE_UPSTREAM", "IDEMGATE_SERVER_UPSTREAM"),
];

/// Keys whose variable is taken as written, never read as TOML: a URL
/// (which may carry a password) and the passwords themselves, so a secret
/// never meets the TOML parser, whose errors would quote it.
fn taken_as_written(key: &str) -> bool {
    key == "url" || key.ends_with("password")
}

/// The span of a value the file does not have. A value the file has keeps
/// its span when a variable replaces it, so a message about the key still
/// points at the line that sets it. No value in a file has an empty span.
pub(super) const NOT_IN_FILE: Range<usize> = 0..0;

/// One variable that sets a key of a section.
pub(super) struct Setting<'e> {
    section: &'static str,
    /// The named table within the section (`[upstreams.NAME]`), if any.
    name: Option<String>,
    key: String,
    value: &'e str,
    /// `v = <value>`: the value read as TOML, unless it is taken as written.
    toml: Option<String>,
}

/// The settings the environment makes, each checked on its own so that a
/// bad one is an error naming its variable. An unknown key of a known
/// section is an error too (without the value: it may be a secret set
/// under a wrong name).
/// `upstreams` are the names of the file's `[upstreams.NAME]` tables.
pub(super) fn settings<'e>(
    env: &'e BTreeMap<String, String>,
    upstreams: &[String],
) -> Result<Vec<Setting<'e>>, String> {
    let set = |name: &str| env.get(name).map(String::as_str).filter(|v| !v.is_empty());
    let mut out = Vec::new();
    for (name, value) in env {
        if value.is_empty() || name == STORE_KEYS || ALIASES.iter().any(|(alias, _)| alias == name)
        {
            continue;
        }
        if skipped_as_service_link(name, value) {
            tracing::debug!(
                variable = %name,
                "skipped a kubernetes service-link variable"
            );
            continue;
        }
        let setting = if let Some(rest) = name.strip_prefix("IDEMGATE_UPSTREAMS_") {
            let (upstream, key) =
                named_location(rest, upstreams).map_err(|e| format!("{name}: {e}"))?;
            let as_written = taken_as_written(&key);
            let mut setting = Setting::new(NAMED, key, value, as_written);
            setting.name = Some(upstream);
            setting
        } else if let Some((section, key)) = location(name) {
            let as_written = taken_as_written(&key);
            Setting::new(section, key, value, as_written)
        } else {
            continue;
        };
        setting.check().map_err(|e| format!("{name}: {e}"))?;
        out.push(setting);
    }
    for (alias, canonical) in ALIASES {
        if set(alias).is_some() && set(canonical).is_some() {
            return Err(format!("both {alias} and {canonical} are set; set one"));
        }
    }
    for (alias, canonical) in ALIASES {
        let (Some(value), Some((section, key))) = (set(alias), location(canonical)) else {
            continue;
        };
        let setting = Setting::new(section, key, value, true);
        setting.check().map_err(|e| match setting.key.as_str() {
            // Worded as before the aliases joined the rule: an address is
            // no secret, and the parser's message alone does not show it.
            "listen" => format!("{alias}={value:?}: invalid address: {e}"),
            _ => format!("{alias}: {e}"),
        })?;
        out.push(setting);
    }
    Ok(out)
}

/// The names (never the values) of the variables of `env` that
/// [`settings`] skips as Kubernetes service links, in name order:
/// `check-config` lists them, so an operator sees what was not read.
pub(super) fn service_links(env: &BTreeMap<String, String>) -> Vec<&str> {
    env.iter()
        .filter(|(name, value)| {
            !value.is_empty()
                && *name != STORE_KEYS
                && !ALIASES.iter().any(|(alias, _)| alias == name)
                && skipped_as_service_link(name, value)
        })
        .map(|(name, _)| name.as_str())
        .collect()
}

/// An `IDEMGATE_` variable [`is_service_link`] tells from a setting.
fn skipped_as_service_link(name: &str, value: &str) -> bool {
    name.starts_with("IDEMGATE_") && is_service_link(name, value)
}

/// Lays `settings` onto the parsed file.
pub(super) fn overlay<'a>(document: &mut DeTable<'a>, settings: &'a [Setting<'_>]) {
    for setting in settings {
        setting.apply(document);
    }
}

/// `IDEMGATE_STORE_ENCRYPTION_KEYS`: the keys stored responses are sealed
/// with (`ID:BASE64,...`; the first seals, all open). Environment only,
/// never a file; a malformed list names its entry, never a key.
pub(super) fn store_keys(
    env: &BTreeMap<String, String>,
) -> Result<Option<std::sync::Arc<crate::idempotency::vault::KeyRing>>, String> {
    match env.get(STORE_KEYS).filter(|v| !v.trim().is_empty()) {
        None => Ok(None),
        Some(list) => crate::idempotency::vault::KeyRing::parse(list)
            .map(|ring| Some(std::sync::Arc::new(ring)))
            .map_err(|e| e.to_string()),
    }
}

/// Read by [`store_keys`], never as a `[store]` setting.
const STORE_KEYS: &str = "IDEMGATE_STORE_ENCRYPTION_KEYS";

/// `IDEMGATE_SCOPE_SECRET`, the key of the scope digests: environment only,
/// so it never sits in a file, and at least 16 characters.
pub(super) fn scope_secret(env: &BTreeMap<String, String>) -> Result<Option<Secret>, String> {
    const NAME: &str = "IDEMGATE_SCOPE_SECRET";
    match env.get(NAME).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) if v.len() < 16 => Err(format!("{NAME} must be at least 16 characters")),
        Some(v) => Ok(Some(Secret(v.clone().into_bytes()))),
    }
}

/// The names of the `[upstreams.NAME]` tables of a parsed file.
pub(super) fn named_upstreams(document: &DeTable<'_>) -> Vec<String> {
    match document.get(NAMED).map(|v| v.get_ref()) {
        Some(DeValue::Table(t)) => t.keys().map(|k| k.get_ref().to_string()).collect(),
        _ => Vec::new(),
    }
}

/// `<NAME>_<KEY>` (after `IDEMGATE_UPSTREAMS_`) → (name, key), NAME being
/// one of `upstreams` as a variable spells it; the longest that fits wins.
fn named_location(rest: &str, upstreams: &[String]) -> Result<(String, String), String> {
    let spelled = |n: &str| n.to_ascii_uppercase().replace('-', "_");
    let fits: Vec<&String> = upstreams
        .iter()
        .filter(|n| {
            rest.strip_prefix(&spelled(n))
                .is_some_and(|k| k.len() > 1 && k.starts_with('_'))
        })
        .collect();
    let Some(longest) = fits.iter().map(|n| n.len()).max() else {
        return Err(format!(
            "names no [upstreams.NAME] section of the file ({}); the environment sets keys of the upstreams the file defines",
            if upstreams.is_empty() {
                "it defines none".to_string()
            } else {
                format!("defined: {}", upstreams.join(", "))
            }
        ));
    };
    let longest: Vec<&&String> = fits.iter().filter(|n| n.len() == longest).collect();
    if longest.len() > 1 {
        return Err(format!(
            "could set [upstreams.{}] or [upstreams.{}]; rename one of them",
            longest[0], longest[1]
        ));
    }
    let name = longest[0].to_string();
    let key = rest[spelled(&name).len() + 1..].to_ascii_lowercase();
    Ok((name, key))
}

/// `IDEMGATE_<SECTION>_<KEY>` → (section, key); the key in lower case.
fn location(name: &str) -> Option<(&'static str, String)> {
    let rest = name.strip_prefix("IDEMGATE_")?;
    SECTIONS.iter().find_map(|section| {
        rest.strip_prefix(&format!("{}_", section.to_ascii_uppercase()))
            .map(|key| (*section, key.to_ascii_lowercase()))
    })
}

/// Whether `name=value` is one of the variables Kubernetes injects for
/// each Service in the namespace (unless the pod spec sets
/// `enableServiceLinks: false`): a Service `idemgate-admin` at
/// 10.0.0.1:9090/TCP brings
///
/// ```text
/// IDEMGATE_ADMIN_SERVICE_HOST=10.0.0.1
/// IDEMGATE_ADMIN_SERVICE_PORT=9090
/// IDEMGATE_ADMIN_SERVICE_PORT_<PORT NAME>=9090   (a named port)
/// IDEMGATE_ADMIN_PORT=tcp://10.0.0.1:9090
/// IDEMGATE_ADMIN_PORT_9090_TCP=tcp://10.0.0.1:9090
/// IDEMGATE_ADMIN_PORT_9090_TCP_PROTO=tcp
/// IDEMGATE_ADMIN_PORT_9090_TCP_PORT=9090
/// IDEMGATE_ADMIN_PORT_9090_TCP_ADDR=10.0.0.1
/// ```
///
/// which would read as keys `port`, `service_host`, ... of `[admin]` and
/// stop the pod at start. Only a name of one of these shapes whose value
/// has that shape's form too (an IP address, a port number,
/// `proto://IP:PORT`) counts: any other variable is read as a setting.
fn is_service_link(name: &str, value: &str) -> bool {
    let is_ip = |v: &str| v.parse::<std::net::IpAddr>().is_ok();
    let is_port = |v: &str| matches!(v.parse::<u16>(), Ok(1..)) && !v.starts_with(['0', '+']);
    // `tcp://10.0.0.1:9090`, `udp://[fd00::1]:53`
    let is_url = |v: &str, proto: Option<&str>, port: Option<&str>| {
        let Some((scheme, addr)) = v.split_once("://") else {
            return false;
        };
        let Ok(addr) = addr.parse::<std::net::SocketAddr>() else {
            return false;
        };
        matches!(scheme, "tcp" | "udp" | "sctp")
            && proto.is_none_or(|p| p.to_ascii_lowercase() == scheme)
            && addr.port() != 0
            && port.is_none_or(|p| p == addr.port().to_string())
    };
    let is_proto = |p: &str| matches!(p, "TCP" | "UDP" | "SCTP");
    if name.ends_with("_SERVICE_HOST") {
        return is_ip(value);
    }
    if name.ends_with("_SERVICE_PORT") {
        return is_port(value);
    }
    if let Some((_, port_name)) = name.rsplit_once("_SERVICE_PORT_") {
        let spelled = |c: char| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_';
        return !port_name.is_empty() && port_name.chars().all(spelled) && is_port(value);
    }
    if name.ends_with("_PORT") && is_url(value, None, None) {
        return true;
    }
    // `_PORT_<N>_<PROTO>` and its `_PROTO`, `_PORT`, `_ADDR`.
    let parts: Vec<&str> = name.rsplit('_').collect();
    match parts.as_slice() {
        [proto, n, "PORT", _, ..] if is_proto(proto) && is_port(n) => {
            is_url(value, Some(proto), Some(n))
        }
        [field, proto, n, "PORT", _, ..] if is_proto(proto) && is_port(n) => match *field {
            "PROTO" => value == proto.to_ascii_lowercase(),
            "PORT" => value == *n,
            "ADDR" => is_ip(value),
            _ => false,
        },
        _ => false,
    }
}

// === impl Setting ===

impl<'e> Setting<'e> {
    fn new(section: &'static str, key: String, value: &'e str, as_written: bool) -> Self {
        let toml = (!as_written).then(|| format!("v = {value}"));
        Self {
            section,
            name: None,
            key,
            value,
            toml,
        }
    }

    /// The value: one TOML value on its own (a newline cannot smuggle in
    /// other keys), or else the text as a string.
    fn value(&self) -> DeValue<'_> {
        self.toml
            .as_deref()
            .and_then(one_value)
            .unwrap_or(DeValue::String(Cow::Borrowed(self.value)))
    }

    fn apply<'a>(&'a self, document: &mut DeTable<'a>) {
        // Not a table: the file alone was refused already.
        let Some(mut table) = subtable(document, self.section) else {
            return;
        };
        if let Some(name) = &self.name {
            let Some(named) = subtable(table, name) else {
                return;
            };
            table = named;
        }
        let span = table
            .get(self.key.as_str())
            .map_or(NOT_IN_FILE, |v| v.span());
        table.insert(
            Spanned::new(NOT_IN_FILE, Cow::Borrowed(self.key.as_str())),
            Spanned::new(span, self.value()),
        );
    }

    /// Reads the setting alone into the typed mirror: the same checks as
    /// the key gets in a file.
    fn check(&self) -> Result<(), String> {
        let mut document = DeTable::new();
        self.apply(&mut document);
        RawConfig::deserialize(toml::de::Deserializer::from(Spanned::new(
            NOT_IN_FILE,
            document,
        )))
        .map(drop)
        .map_err(|e| e.message().trim_end().to_string())
    }
}

/// The table `table` holds under `key`, added empty if it has none;
/// `None` if the key holds another value.
fn subtable<'a, 't>(table: &'t mut DeTable<'a>, key: &'a str) -> Option<&'t mut DeTable<'a>> {
    let value = table
        .entry(Spanned::new(NOT_IN_FILE, Cow::Borrowed(key)))
        .or_insert_with(|| Spanned::new(NOT_IN_FILE, DeValue::Table(DeTable::new())));
    match value.get_mut() {
        DeValue::Table(t) => Some(t),
        _ => None,
    }
}

/// `v` of the document `text`, if that is its only key. Read as
/// `toml::Value` reads it: an integer out of range is no TOML value (so the
/// text is taken as a string), and a datetime reaches serde as a string.
fn one_value(text: &str) -> Option<DeValue<'_>> {
    let table: toml::Table = toml::from_str(text).ok()?;
    if table.len() != 1 {
        return None;
    }
    let value = DeTable::parse(text).ok()?.into_inner().remove("v")?;
    Some(match value.into_inner() {
        DeValue::Datetime(d) => DeValue::String(Cow::Owned(d.to_string())),
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_service_links_are_told_from_settings_by_name_and_value() {
        let cases: &[(&str, &str, bool)] = &[
            ("IDEMGATE_ADMIN_SERVICE_HOST", "10.0.0.1", true),
            ("IDEMGATE_ADMIN_SERVICE_HOST", "fd00::1", true),
            ("IDEMGATE_ADMIN_SERVICE_PORT", "9090", true),
            ("IDEMGATE_ADMIN_SERVICE_PORT_METRICS", "9090", true),
            ("IDEMGATE_ADMIN_PORT", "tcp://10.0.0.1:9090", true),
            ("IDEMGATE_REDIS_PORT", "tcp://[fd00::1]:6379", true),
            ("IDEMGATE_STORE_PORT_5432_TCP", "tcp://10.0.0.2:5432", true),
            ("IDEMGATE_STORE_PORT_5432_TCP_PROTO", "tcp", true),
            ("IDEMGATE_STORE_PORT_5432_TCP_PORT", "5432", true),
            ("IDEMGATE_STORE_PORT_5432_TCP_ADDR", "10.0.0.2", true),
            ("IDEMGATE_LOG_PORT_53_UDP", "udp://10.0.0.3:53", true),
            ("IDEMGATE_UPSTREAMS_BILLING_SERVICE_HOST", "10.0.0.4", true),
            // The name's shape with a value of another form is a setting
            // (and an unknown key, refused as one).
            ("IDEMGATE_ADMIN_PORT", "9090", false),
            ("IDEMGATE_ADMIN_PORT", "http://10.0.0.1:9090", false),
            ("IDEMGATE_ADMIN_PORT", "tcp://admin:9090", false),
            ("IDEMGATE_ADMIN_SERVICE_HOST", "admin.local", false),
            ("IDEMGATE_ADMIN_SERVICE_PORT", "99999", false),
            ("IDEMGATE_ADMIN_SERVICE_PORT", "0", false),
            ("IDEMGATE_ADMIN_SERVICE_PORT_METRICS", "x", false),
            ("IDEMGATE_ADMIN_SERVICE_PORT_", "9090", false),
            ("IDEMGATE_STORE_PORT_5432_TCP", "tcp://10.0.0.2:5433", false),
            ("IDEMGATE_STORE_PORT_5432_TCP", "udp://10.0.0.2:5432", false),
            ("IDEMGATE_STORE_PORT_5432_TCP_PROTO", "udp", false),
            ("IDEMGATE_STORE_PORT_5432_TCP_PORT", "5433", false),
            ("IDEMGATE_STORE_PORT_5432_TCP_ADDR", "db", false),
            (
                "IDEMGATE_STORE_PORT_5432_HTTP",
                "tcp://10.0.0.2:5432",
                false,
            ),
            // Genuine settings.
            ("IDEMGATE_ADMIN_LISTEN", "10.0.0.1:9090", false),
            ("IDEMGATE_SERVER_UPSTREAM", "http://10.0.0.1:3000", false),
            ("IDEMGATE_STORE_POOL_SIZE", "32", false),
        ];
        for (name, value, want) in cases {
            assert_eq!(is_service_link(name, value), *want, "{name}={value}");
        }
    }

    #[test]
    fn service_links_are_skipped_and_other_variables_still_read() {
        let env: BTreeMap<String, String> = [
            ("IDEMGATE_ADMIN_PORT", "tcp://10.0.0.1:9090"),
            ("IDEMGATE_ADMIN_SERVICE_HOST", "10.0.0.1"),
            ("IDEMGATE_REDIS_PORT_6379_TCP_ADDR", "10.0.0.5"),
            ("IDEMGATE_STORE_POOL_SIZE", "32"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let read = settings(&env, &[]).unwrap();
        let keys: Vec<String> = read
            .iter()
            .map(|s| format!("{}.{}", s.section, s.key))
            .collect();
        assert_eq!(keys, ["store.pool_size"]);
        assert_eq!(
            service_links(&env),
            [
                "IDEMGATE_ADMIN_PORT",
                "IDEMGATE_ADMIN_SERVICE_HOST",
                "IDEMGATE_REDIS_PORT_6379_TCP_ADDR"
            ]
        );
        let mut unknown = env.clone();
        unknown.insert("IDEMGATE_ADMIN_PORT".into(), "9090".into());
        let err = settings(&unknown, &[]).err().unwrap();
        assert!(
            err.contains("IDEMGATE_ADMIN_PORT: unknown field `port`"),
            "{err}"
        );
    }

    #[test]
    fn every_alias_names_a_key_of_a_section() {
        for (alias, canonical) in ALIASES {
            assert!(location(alias).is_none(), "{alias}");
            assert!(location(canonical).is_some(), "{canonical}");
        }
    }
}
