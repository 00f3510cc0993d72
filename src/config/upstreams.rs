//! `[upstreams.NAME]`: named upstreams, each with its own URL, timeouts,
//! pool, protocol and TLS files, and the check that every route's
//! `upstream = "NAME"` names one. The default upstream (`[server]
//! upstream*`) has the same shape ([`UpstreamConfig`]); `server.rs` reads it.
//!
//! Named upstreams are defined in the file; the environment (`env.rs`,
//! `IDEMGATE_UPSTREAMS_<NAME>_<KEY>`) can set the keys of one the file
//! defines, never create one.

use super::raw::RawUpstream;
use super::units::format_duration;
use super::{dur, nonzero, Invalid};
use super::{
    DEFAULT_UPSTREAM_CONNECT_TIMEOUT, DEFAULT_UPSTREAM_POOL_IDLE_TIMEOUT,
    DEFAULT_UPSTREAM_POOL_MAX_IDLE, DEFAULT_UPSTREAM_TIMEOUT,
};
use http::Uri;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;
use toml::Spanned;

/// The name the default upstream (`[server] upstream`) goes by in logs and
/// metrics; no `[upstreams.NAME]` may take it.
pub const DEFAULT_UPSTREAM_NAME: &str = "default";

/// The longest upstream name: it is a metric label and part of log lines.
const MAX_NAME_LEN: usize = 64;

/// How idemgate speaks to an upstream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
pub enum UpstreamProtocol {
    /// HTTP/1.1 (over TLS: ALPN offers `http/1.1` only). Upgrades work.
    #[default]
    #[serde(rename = "http1")]
    Http1,
    /// HTTP/2: prior knowledge (h2c) on `http://`; on `https://` ALPN
    /// offers `h2` and `http/1.1` and the upstream picks. Trailers pass.
    #[serde(rename = "h2")]
    H2,
}

impl UpstreamProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamProtocol::Http1 => "http1",
            UpstreamProtocol::H2 => "h2",
        }
    }
}

/// PEM files for an `https://` upstream; all optional.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UpstreamTls {
    /// Trust these CAs instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain (mTLS), with `key_file`.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// One upstream, named or the default, as the client builders need it.
#[derive(Clone, Debug)]
pub struct UpstreamConfig {
    pub name: String,
    /// Scheme (`http`/`https`), authority and optional base path.
    pub url: Uri,
    /// To the response head (protected routes: to the end of the body).
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub pool_idle_timeout: Duration,
    pub pool_max_idle: usize,
    pub protocol: UpstreamProtocol,
    pub tls: UpstreamTls,
}

impl UpstreamConfig {
    pub fn is_https(&self) -> bool {
        self.url.scheme_str() == Some("https")
    }
}

/// TLS files only mean something on `https://`; a certificate needs its key.
/// `prefix` is how the keys are named in messages (`server.upstream_`,
/// `upstreams.orders.`).
pub(super) fn check_tls(url: &Uri, tls: &UpstreamTls, prefix: &str) -> Result<(), String> {
    let https = url.scheme_str() == Some("https");
    for (key, set) in [
        ("ca_file", tls.ca_file.is_some()),
        ("cert_file", tls.cert_file.is_some()),
        ("key_file", tls.key_file.is_some()),
    ] {
        if set && !https {
            return Err(format!(
                "{prefix}{key} is set but the upstream URL {url} is not https://"
            ));
        }
    }
    match (&tls.cert_file, &tls.key_file) {
        (Some(_), None) => Err(format!(
            "{prefix}cert_file needs {prefix}key_file (the client certificate's private key)"
        )),
        (None, Some(_)) => Err(format!(
            "{prefix}key_file needs {prefix}cert_file (the client certificate)"
        )),
        _ => Ok(()),
    }
}

/// The `[upstreams.NAME]` sections, checked, by name.
pub(super) fn named(
    raw: BTreeMap<String, Spanned<RawUpstream>>,
) -> Result<BTreeMap<String, UpstreamConfig>, Invalid> {
    let mut out = BTreeMap::new();
    for (name, spanned) in raw {
        let span = spanned.span();
        let at = |msg: String| Invalid::at(span.clone(), msg);
        check_name(&name).map_err(at)?;
        let upstream = one(&name, spanned.into_inner()).map_err(|e| at(e.message))?;
        out.insert(name, upstream);
    }
    Ok(out)
}

/// Names are labels and log fields: short, lower-case, no spaces.
fn check_name(name: &str) -> Result<(), String> {
    if name == DEFAULT_UPSTREAM_NAME {
        return Err(format!(
            "[upstreams.{name}]: \"{DEFAULT_UPSTREAM_NAME}\" is the name of [server] upstream; choose another name"
        ));
    }
    let valid = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if !valid {
        return Err(format!(
            "[upstreams.{name:?}]: a name is 1 to {MAX_NAME_LEN} of a-z, 0-9, '_' and '-'"
        ));
    }
    Ok(())
}

fn one(name: &str, u: RawUpstream) -> Result<UpstreamConfig, Invalid> {
    let key = |k: &str| format!("upstreams.{name}.{k}");
    let url = u.url.map(|u| u.0).ok_or_else(|| {
        format!(
            "{} is required, e.g. url = \"http://127.0.0.1:3001\"",
            key("url")
        )
    })?;
    let tls = UpstreamTls {
        ca_file: u.ca_file,
        cert_file: u.cert_file,
        key_file: u.key_file,
    };
    check_tls(&url, &tls, &format!("upstreams.{name}."))?;
    Ok(UpstreamConfig {
        name: name.to_string(),
        url,
        timeout: nonzero(&key("timeout"), dur(u.timeout, DEFAULT_UPSTREAM_TIMEOUT))?,
        connect_timeout: nonzero(
            &key("connect_timeout"),
            dur(u.connect_timeout, DEFAULT_UPSTREAM_CONNECT_TIMEOUT),
        )?,
        pool_idle_timeout: dur(u.pool_idle_timeout, DEFAULT_UPSTREAM_POOL_IDLE_TIMEOUT),
        pool_max_idle: u.pool_max_idle.unwrap_or(DEFAULT_UPSTREAM_POOL_MAX_IDLE),
        protocol: u.protocol.unwrap_or_default(),
        tls,
    })
}

/// Every `upstream = "NAME"` (in `[defaults]` or a `[[route]]`) names a
/// defined `[upstreams.NAME]`; reported at the line that sets it.
pub(super) fn check_choices<'a>(
    choices: impl Iterator<Item = (String, &'a Spanned<String>)>,
    defined: &BTreeMap<String, UpstreamConfig>,
) -> Result<(), Invalid> {
    for (whose, choice) in choices {
        let name = choice.get_ref();
        if defined.contains_key(name) {
            continue;
        }
        let known = if defined.is_empty() {
            "none is defined".to_string()
        } else {
            format!(
                "defined: {}",
                defined.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        };
        return Err(Invalid::at(
            choice.span(),
            format!(
                "{whose}: upstream = {name:?} names no [upstreams.{name}] section ({known}); unrouted traffic goes to [server] upstream"
            ),
        ));
    }
    Ok(())
}

/// `check-config`'s line for one upstream.
impl fmt::Display for UpstreamConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (timeout {}, connect {}, {}",
            self.url,
            format_duration(self.timeout),
            format_duration(self.connect_timeout),
            self.protocol.as_str()
        )?;
        if let Some(ca) = &self.tls.ca_file {
            write!(f, ", ca {}", ca.display())?;
        }
        if let Some(cert) = &self.tls.cert_file {
            write!(f, ", client cert {}", cert.display())?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use crate::config::tests::env;
    use crate::config::{Config, UpstreamProtocol};
    use std::time::Duration;

    const SERVER: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n";

    fn parse(rest: &str) -> Result<Config, String> {
        Config::parse(&format!("{SERVER}{rest}"), "t.toml").map_err(|e| e.to_string())
    }

    #[test]
    fn routes_choose_named_upstreams_and_the_rest_go_to_the_default() {
        let cfg = parse(
            "[upstreams.orders]\nurl = \"https://orders.internal:8443/v1\"\ntimeout = \"5s\"\nprotocol = \"h2\"\nca_file = \"/ca.pem\"\n\
             [upstreams.billing]\nurl = \"http://127.0.0.1:3001\"\n\
             [[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\nupstream = \"orders\"\n\
             [[route]]\nmethods = [\"POST\"]\npath = \"/other\"\n",
        )
        .unwrap();
        let orders = &cfg.upstreams["orders"];
        assert!(orders.is_https());
        assert_eq!(orders.timeout, Duration::from_secs(5));
        assert_eq!(orders.protocol, UpstreamProtocol::H2);
        assert_eq!(
            orders.connect_timeout,
            super::DEFAULT_UPSTREAM_CONNECT_TIMEOUT
        );
        assert_eq!(cfg.upstreams["billing"].protocol, UpstreamProtocol::Http1);
        let routes: Vec<_> = cfg.routes.iter().map(|r| r.upstream.clone()).collect();
        assert_eq!(routes, vec![Some("orders".into()), None]);
        let default = cfg.server.default_upstream();
        assert_eq!(default.name, "default");
        assert_eq!(default.url, "http://127.0.0.1:3000/");
        assert!(cfg
            .to_string()
            .contains("upstream   orders: https://orders.internal:8443/v1"));
    }

    #[test]
    fn defaults_may_choose_an_upstream_for_every_route() {
        let cfg = parse(
            "[upstreams.orders]\nurl = \"http://127.0.0.1:3001\"\n[defaults]\nupstream = \"orders\"\n\
             [[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\n",
        )
        .unwrap();
        assert_eq!(
            cfg.routes.iter().next().unwrap().upstream.as_deref(),
            Some("orders")
        );
    }

    #[test]
    fn mistakes_name_the_file_line_and_field() {
        let cases = [
            (
                "[upstreams.orders]\nurl = \"http://127.0.0.1:3001\"\n[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\nupstream = \"ordres\"\n",
                "t.toml: line 8: route #1: upstream = \"ordres\" names no [upstreams.ordres] section (defined: orders)",
            ),
            (
                "[defaults]\nupstream = \"nowhere\"\n",
                "t.toml: line 4: defaults: upstream = \"nowhere\" names no [upstreams.nowhere] section (none is defined)",
            ),
            (
                "[upstreams.orders]\ntimeout = \"1s\"\n",
                "t.toml: line 3: upstreams.orders.url is required",
            ),
            (
                "[upstreams.Orders]\nurl = \"http://a:1\"\n",
                "t.toml: line 3: [upstreams.\"Orders\"]: a name is 1 to 64 of a-z",
            ),
            (
                "[upstreams.default]\nurl = \"http://a:1\"\n",
                "is the name of [server] upstream",
            ),
            (
                "[upstreams.orders]\nurl = \"http://a:1\"\nca_file = \"/ca.pem\"\n",
                "t.toml: line 3: upstreams.orders.ca_file is set but the upstream URL http://a:1/ is not https://",
            ),
            (
                "[upstreams.orders]\nurl = \"https://a:1\"\ncert_file = \"/c.pem\"\n",
                "upstreams.orders.cert_file needs upstreams.orders.key_file",
            ),
            (
                "[upstreams.orders]\nurl = \"https://a:1\"\nprotocol = \"h3\"\n",
                "line 5",
            ),
            ("[upstreams.orders]\nurl = \"https://a:1\"\nurll = 1\n", "unknown field `urll`"),
            (
                "[upstreams.orders]\nurl = \"ftp://a:1\"\n",
                "scheme \"ftp\" is not supported (use http:// or https://)",
            ),
            (
                "[upstreams.orders]\nurl = \"http://127.0.0.1:99999\"\n",
                "t.toml: TOML parse error at line 4, column 7",
            ),
            (
                "[upstreams.orders]\nurl = \"http://a:0/base\"\n",
                "invalid upstream URL \"http://a:0/base\": port 0 is out of range (1 to 65535)",
            ),
            (
                "[upstreams.orders]\nurl = \"http://a:1\"\ntimeout = \"0\"\n",
                "upstreams.orders.timeout must be greater than 0",
            ),
        ];
        for (text, want) in cases {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text}\n  got: {e}\n want: {want}");
        }
    }

    #[test]
    fn the_environment_sets_keys_of_the_upstreams_the_file_defines() {
        let text = format!(
            "{SERVER}[upstreams.orders]\nurl = \"http://127.0.0.1:3001\"\n[upstreams.orders-eu]\nurl = \"http://127.0.0.1:3002\"\n"
        );
        let cfg = Config::parse_with_env(
            &text,
            "t.toml",
            &env(&[
                ("IDEMGATE_UPSTREAMS_ORDERS_URL", "https://orders.prod:8443"),
                ("IDEMGATE_UPSTREAMS_ORDERS_CONNECT_TIMEOUT", "2s"),
                ("IDEMGATE_UPSTREAMS_ORDERS_EU_TIMEOUT", "9s"),
                ("IDEMGATE_UPSTREAMS_ORDERS_EU_PROTOCOL", "h2"),
            ]),
        )
        .unwrap();
        let orders = &cfg.upstreams["orders"];
        assert_eq!(orders.url, "https://orders.prod:8443/");
        assert_eq!(orders.connect_timeout, Duration::from_secs(2));
        // The longest name that fits wins: ORDERS_EU_TIMEOUT is orders-eu's.
        assert_eq!(orders.timeout, super::DEFAULT_UPSTREAM_TIMEOUT);
        assert_eq!(cfg.upstreams["orders-eu"].timeout, Duration::from_secs(9));
        assert_eq!(cfg.upstreams["orders-eu"].protocol, UpstreamProtocol::H2);

        for (name, value, want) in [
            (
                "IDEMGATE_UPSTREAMS_BILLING_URL",
                "http://b:1",
                "IDEMGATE_UPSTREAMS_BILLING_URL: names no [upstreams.NAME] section of the file (defined: orders, orders-eu)",
            ),
            (
                "IDEMGATE_UPSTREAMS_ORDERS_URLL",
                "http://b:1",
                "IDEMGATE_UPSTREAMS_ORDERS_URLL: unknown field `urll`",
            ),
            (
                "IDEMGATE_UPSTREAMS_ORDERS_PROTOCOL",
                "h3",
                "IDEMGATE_UPSTREAMS_ORDERS_PROTOCOL: unknown variant `h3`",
            ),
        ] {
            let e = Config::parse_with_env(&text, "t.toml", &env(&[(name, value)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{name}\n  got: {e}\n want: {want}");
        }
        let ambiguous = "[server]\nupstream = \"http://a:1\"\n[upstreams.a-b]\nurl = \"http://a:1\"\n[upstreams.a_b]\nurl = \"http://a:1\"\n";
        let e = Config::parse_with_env(
            ambiguous,
            "t.toml",
            &env(&[("IDEMGATE_UPSTREAMS_A_B_URL", "http://c:1")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("could set [upstreams.a-b] or [upstreams.a_b]"),
            "{e}"
        );
    }

    /// The book's gateway example (docs/book/src/gateway.md) is a working config.
    #[test]
    fn the_book_gateway_example_parses() {
        let doc = include_str!("../../docs/book/src/gateway.md");
        let start = doc
            .find("<!-- gateway-example")
            .and_then(|i| {
                doc[i..]
                    .find("```toml\n")
                    .map(|j| i + j + "```toml\n".len())
            })
            .expect("the gateway example in docs/book/src/gateway.md");
        let end = start + doc[start..].find("```").expect("its end");
        let cfg = Config::parse(&doc[start..end], "gateway.md").unwrap();
        assert_eq!(cfg.upstreams.len(), 3);
        assert_eq!(cfg.upstreams["grpc"].protocol, UpstreamProtocol::H2);
        assert!(cfg.upstreams["payments"].tls.cert_file.is_some());
        assert!(cfg.server.default_upstream().is_https());
        let chosen: Vec<_> = cfg.routes.iter().map(|r| r.upstream.clone()).collect();
        assert_eq!(
            chosen,
            vec![
                Some("payments".into()),
                Some("grpc".into()),
                Some("live".into())
            ]
        );
        assert!(cfg.warnings().is_empty(), "{:?}", cfg.warnings());
    }

    #[test]
    fn the_ttl_warning_uses_the_route_s_own_upstream_timeout() {
        let cfg = parse(
            "[upstreams.slow]\nurl = \"http://127.0.0.1:3001\"\ntimeout = \"10m\"\n\
             [[route]]\nmethods = [\"POST\"]\npath = \"/slow\"\nupstream = \"slow\"\nttl = \"5m\"\n\
             [[route]]\nmethods = [\"POST\"]\npath = \"/fast\"\nttl = \"5m\"\n",
        )
        .unwrap();
        let warnings = cfg.warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("route #1 /slow"), "{warnings:?}");
        assert!(warnings[0].contains("10m + 30s"), "{warnings:?}");
    }

    /// preserve_host beside an h2 upstream is named (its Host and
    /// :authority would disagree); either alone is not.
    #[test]
    fn preserve_host_with_an_h2_upstream_is_warned_about() {
        let with = |server: &str, rest: &str| {
            Config::parse(
                &format!("[server]\nupstream = \"http://127.0.0.1:3000\"\n{server}{rest}"),
                "t.toml",
            )
            .unwrap()
            .warnings()
        };
        let h2 = "[upstreams.grpc]\nurl = \"http://127.0.0.1:3001\"\nprotocol = \"h2\"\n";
        let about_host = |w: &[String]| w.iter().any(|w| w.contains("preserve_host"));
        let warned = with("preserve_host = true\n", h2);
        assert!(about_host(&warned), "{warned:?}");
        let warned = with("preserve_host = true\nupstream_protocol = \"h2\"\n", "");
        assert!(about_host(&warned), "{warned:?}");
        assert!(with("preserve_host = true\n", "").is_empty());
        assert!(with("", h2).is_empty());
    }

    #[test]
    fn the_default_upstream_takes_tls_files_and_a_protocol() {
        let cfg = Config::parse(
            "[server]\nupstream = \"https://api.internal\"\nupstream_protocol = \"h2\"\nupstream_ca_file = \"/ca.pem\"\nupstream_cert_file = \"/c.pem\"\nupstream_key_file = \"/k.pem\"\n",
            "t.toml",
        )
        .unwrap();
        let d = cfg.server.default_upstream();
        assert_eq!(d.protocol, UpstreamProtocol::H2);
        assert_eq!(
            d.tls.ca_file.as_deref(),
            Some(std::path::Path::new("/ca.pem"))
        );
        assert!(d.tls.key_file.is_some());
        let e = Config::parse(
            "[server]\nupstream = \"http://api.internal\"\nupstream_key_file = \"/k.pem\"\n",
            "t.toml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("server.upstream_key_file is set but the upstream URL"),
            "{e}"
        );
    }
}
