//! The config loader on any file and environment: it never panics, it is
//! deterministic, and neither its errors nor `check-config`'s printout of an
//! accepted config show the scope secret or a store or Redis password
//! given in the environment.
//!
//! Input: the TOML text, then optionally a NUL byte and `NAME=value` lines
//! (the `IDEMGATE_*` environment). The seeds are the shipped example files.
#![no_main]

use idemgate::config::Config;
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

/// A password the harness puts into every URL variable, so it can look for it.
const PASSWORD: &str = "pw-8d41c0fa77";

const SECRET: &str = "IDEMGATE_SCOPE_SECRET";

fuzz_target!(|raw: &[u8]| {
    let raw = String::from_utf8_lossy(raw);
    let (text, env_text) = raw.split_once('\0').unwrap_or((&raw, ""));
    if text.contains(PASSWORD) || env_text.contains(PASSWORD) {
        return;
    }
    let mut env = BTreeMap::new();
    for line in env_text.lines() {
        let (name, value) = line.split_once('=').unwrap_or((line, ""));
        let value = if name.ends_with("_URL") {
            // scheme://user:PASSWORD@rest, as a deployment writes it, or
            // misspelled (`postgres:/`): VALUEu:PASSWORD@db.
            match value.split_once("://") {
                Some((scheme, rest)) => format!("{scheme}://u:{PASSWORD}@{rest}"),
                None => format!("{value}u:{PASSWORD}@db"),
            }
        } else {
            value.to_string()
        };
        env.insert(name.to_string(), value);
    }
    let shown = show(text, &env);
    assert!(!shown.contains(PASSWORD), "a password is shown: {shown}");
    // The secret, unless the input or the printout without it has it anyway.
    let secret = env
        .get(SECRET)
        .filter(|s| s.len() >= 16)
        .filter(|s| !text.contains(s.as_str()))
        .filter(|s| {
            env.iter()
                .all(|(k, v)| k == SECRET || !v.contains(s.as_str()) && !k.contains(s.as_str()))
        });
    if let Some(secret) = secret {
        let mut without = env.clone();
        without.remove(SECRET);
        if !show(text, &without).contains(secret.as_str()) {
            assert!(
                !shown.contains(secret.as_str()),
                "the scope secret is shown: {shown}"
            );
        }
    }
});

/// Everything a user may see of a parse: the error, or `check-config`'s
/// printout, the warnings and the `Debug` form; checked to be the same on
/// a second parse.
fn show(text: &str, env: &BTreeMap<String, String>) -> String {
    match Config::parse_with_env(text, "fuzz.toml", env) {
        Ok(config) => {
            let again = Config::parse_with_env(text, "fuzz.toml", env).expect("deterministic");
            let shown = config.to_string();
            assert_eq!(again.to_string(), shown);
            let warnings = config.warnings().join("\n");
            format!("{shown}\n{warnings}\n{config:?}")
        }
        Err(e) => {
            let again = Config::parse_with_env(text, "fuzz.toml", env).expect_err("deterministic");
            assert_eq!(again.to_string(), e.to_string());
            format!("{e}\n{e:?}")
        }
    }
}
