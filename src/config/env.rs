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
//! is always taken as written, so a password in it never meets the TOML
//! parser (whose errors would quote it). An empty variable counts as unset,
//! and a variable wins over the file.
//!
//! The variables are laid onto the parsed file before it is read into typed
//! settings, so whatever key a section accepts can be set this way: no list
//! of keys is kept here, and an unknown key is the same error as in the
//! file. Variables for other sections (routes, `[defaults]`, or names such
//! as `IDEMGATE_CONFIG`) are not this module's business and are left alone.
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
        if value.is_empty() || ALIASES.iter().any(|(alias, _)| alias == name) {
            continue;
        }
        let setting = if let Some(rest) = name.strip_prefix("IDEMGATE_UPSTREAMS_") {
            let (upstream, key) =
                named_location(rest, upstreams).map_err(|e| format!("{name}: {e}"))?;
            let as_written = key == "url";
            let mut setting = Setting::new(NAMED, key, value, as_written);
            setting.name = Some(upstream);
            setting
        } else if let Some((section, key)) = location(name) {
            let as_written = key == "url";
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

/// Lays `settings` onto the parsed file.
pub(super) fn overlay<'a>(document: &mut DeTable<'a>, settings: &'a [Setting<'_>]) {
    for setting in settings {
        setting.apply(document);
    }
}

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
    fn every_alias_names_a_key_of_a_section() {
        for (alias, canonical) in ALIASES {
            assert!(location(alias).is_none(), "{alias}");
            assert!(location(canonical).is_some(), "{canonical}");
        }
    }
}
