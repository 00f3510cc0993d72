//! `store.url` read the way libpq reads it, without opening a file: what
//! `check-config` checks and the store's connector is built from.
//!
//! The URL takes libpq's TLS parameters, so the URL given to `psql` works:
//! `sslmode` (`disable`, `allow`, `prefer` (default), `require`,
//! `verify-ca`, `verify-full`), `sslrootcert` (a CA file, or `system`),
//! `sslcert` and `sslkey`. As in libpq, `require` with an `sslrootcert`
//! verifies the chain (like `verify-ca`), and `sslrootcert=system` implies
//! `verify-full`. Unlike libpq, `verify-ca`/`verify-full` without
//! `sslrootcert` trust the system's roots (libpq would need
//! `~/.postgresql/root.crt`), so a managed database whose CA is public
//! needs no file.
//!
//! `pgbouncer=true` (Prisma's convention) says a transaction-pooling
//! PgBouncer is in front: `store::postgres` says what changes.

use crate::net::errors::Chain;
use crate::net::tls::{ClientIdentity, ClientTls, FileNames, Roots, ServerCheck};
use std::path::PathBuf;
use std::str::FromStr;

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// libpq tries plain first, then TLS; here it is `prefer` (TLS when the
    /// server offers it, unverified): the same servers are reachable.
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode={other:?}: expected disable, allow, prefer, require, verify-ca or verify-full"
                ))
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// `sslrootcert`: a CA file, or `system`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootCert {
    System,
    File(PathBuf),
}

/// A store URL with the parameters idemgate handles itself taken out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgUrl {
    /// The URL without them: what tokio-postgres parses.
    rest: String,
    pub sslmode: SslMode,
    pub sslrootcert: Option<RootCert>,
    pub identity: Option<ClientIdentity>,
    /// `pgbouncer=true`: a transaction-pooling PgBouncer is in front.
    pub pgbouncer: bool,
}

impl PgUrl {
    /// Reads `url` (a `postgres://` URL). Pure: no file is opened; the
    /// error says which parameter is wrong (never the password).
    pub fn parse(url: &str) -> Result<Self, String> {
        let (base, query) = match url.split_once('?') {
            Some((base, query)) => (base, query),
            None => (url, ""),
        };
        let mut kept = Vec::new();
        let mut sslmode = None;
        let mut rootcert = None;
        let mut cert = None;
        let mut key = None;
        let mut pgbouncer = false;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (raw_key, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = || percent_decode(raw_value);
            match percent_decode(raw_key)?.as_str() {
                "sslmode" => sslmode = Some(SslMode::parse(&value()?)?),
                "sslrootcert" => {
                    rootcert = Some(match value()?.as_str() {
                        "system" => RootCert::System,
                        path => RootCert::File(PathBuf::from(path)),
                    })
                }
                "sslcert" => cert = Some(PathBuf::from(value()?)),
                "sslkey" => key = Some(PathBuf::from(value()?)),
                "pgbouncer" => {
                    pgbouncer = match value()?.as_str() {
                        "true" => true,
                        "false" => false,
                        other => {
                            return Err(format!("pgbouncer={other:?}: expected true or false"))
                        }
                    }
                }
                unsupported @ ("sslpassword" | "sslcrl" | "sslcrldir") => {
                    return Err(format!(
                        "{unsupported} is not supported: use an unencrypted key file, and no CRL"
                    ))
                }
                // Read-write is what a store that writes needs, and what
                // `pg_config` sets when the URL says nothing.
                "target_session_attrs" => match value()?.as_str() {
                    "read-write" | "primary" => {}
                    other => {
                        return Err(format!(
                            "target_session_attrs={other:?}: idemgate writes to its store; use read-write (the default here), so that a standby among the hosts is skipped"
                        ))
                    }
                },
                // libpq's default; no other value means anything here.
                "sslsni" => {}
                _ => kept.push(pair),
            }
        }
        let sslmode = match (sslmode, &rootcert) {
            (None, Some(RootCert::System)) => SslMode::VerifyFull,
            (Some(mode), Some(RootCert::System)) if mode != SslMode::VerifyFull => {
                return Err(format!(
                    "sslmode={} may not be used with sslrootcert=system: use verify-full (as libpq)",
                    mode.as_str()
                ))
            }
            (mode, _) => mode.unwrap_or(SslMode::Prefer),
        };
        let identity = match (cert, key) {
            (Some(cert), Some(key)) => Some(ClientIdentity { cert, key }),
            (None, None) => None,
            _ => return Err("sslcert and sslkey must be given together".into()),
        };
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        Ok(Self {
            rest,
            sslmode,
            sslrootcert: rootcert,
            identity,
            pgbouncer,
        })
    }

    /// What the connector checks, libpq's way.
    pub fn client_tls(&self) -> ClientTls {
        let check = match self.sslmode {
            SslMode::Disable | SslMode::Allow | SslMode::Prefer => ServerCheck::Nothing,
            // libpq: "if a root CA file exists, require behaves like verify-ca".
            SslMode::Require if matches!(self.sslrootcert, Some(RootCert::File(_))) => {
                ServerCheck::Chain
            }
            SslMode::Require => ServerCheck::Nothing,
            SslMode::VerifyCa => ServerCheck::Chain,
            SslMode::VerifyFull => ServerCheck::ChainAndName,
        };
        let roots = match &self.sslrootcert {
            Some(RootCert::File(path)) => Roots::File(path.clone()),
            Some(RootCert::System) | None => Roots::System,
        };
        ClientTls {
            check,
            roots,
            identity: self.identity.clone(),
            names: FileNames::new("sslrootcert", "sslcert", "sslkey"),
        }
    }

    /// tokio-postgres's config for the rest of the URL, with the TLS mode.
    pub fn pg_config(&self) -> Result<tokio_postgres::Config, String> {
        // The parser's own message names the bad part, never the password.
        let mut pg =
            tokio_postgres::Config::from_str(&self.rest).map_err(|err| Chain(&err).to_string())?;
        // Every host is tried in order until one accepts writes: after a
        // failover the promoted standby is found, and a server in recovery
        // (or read-only) is never claimed on.
        pg.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
        pg.ssl_mode(match self.sslmode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Allow | SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
        Ok(pg)
    }
}

/// `%XX` decoded (URL query values: paths with spaces, `+` in names).
fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-encoding in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once decoded"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> PgUrl {
        PgUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    #[test]
    fn sslmodes_map_to_libpq_checks() {
        let check = |url: &str| parse(url).client_tls().check;
        let base = "postgres://u@db.example/app";
        for (query, want) in [
            // prefer by default
            ("", ServerCheck::Nothing),
            ("?sslmode=require", ServerCheck::Nothing),
            // libpq: require with a root file verifies the chain
            ("?sslmode=require&sslrootcert=/ca.pem", ServerCheck::Chain),
            ("?sslmode=verify-ca", ServerCheck::Chain),
            ("?sslmode=verify-full", ServerCheck::ChainAndName),
            // sslrootcert=system implies verify-full
            ("?sslrootcert=system", ServerCheck::ChainAndName),
        ] {
            assert_eq!(check(&format!("{base}{query}")), want, "{query}");
        }
        assert_eq!(
            parse(&format!("{base}?sslmode=verify-full"))
                .client_tls()
                .roots,
            Roots::System
        );
    }

    #[test]
    fn handled_parameters_are_taken_out_and_the_rest_kept() {
        let url = parse(
            "postgres://u:p%40ss@h:6432/db?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca%20dir%2Froot.crt&pgbouncer=true&connect_timeout=3",
        );
        assert_eq!(
            url.rest,
            "postgres://u:p%40ss@h:6432/db?application_name=x&connect_timeout=3"
        );
        assert!(url.pgbouncer);
        assert_eq!(
            url.sslrootcert,
            Some(RootCert::File("/etc/ca dir/root.crt".into()))
        );
        let pg = url.pg_config().unwrap();
        assert_eq!(pg.get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        assert_eq!(pg.get_application_name(), Some("x"));
        assert_eq!(
            pg.get_hosts(),
            [tokio_postgres::config::Host::Tcp("h".into())]
        );
        assert_eq!(pg.get_ports(), [6432]);
        assert_eq!(parse("postgres://u@h/db").rest, "postgres://u@h/db");
        assert!(!parse("postgres://u@h/db?pgbouncer=false").pgbouncer);
    }

    #[test]
    fn every_host_is_tried_for_a_writable_server() {
        use tokio_postgres::config::{Host, TargetSessionAttrs};
        for url in [
            "postgres://u@db-a:5432,db-b:5433/idemgate",
            "postgres://u@db-a:5432,db-b:5433/idemgate?target_session_attrs=read-write",
            "postgres://u@db-a:5432,db-b:5433/idemgate?target_session_attrs=primary",
        ] {
            let pg = parse(url).pg_config().unwrap();
            assert_eq!(
                pg.get_target_session_attrs(),
                TargetSessionAttrs::ReadWrite,
                "{url}"
            );
            assert_eq!(
                pg.get_hosts(),
                [Host::Tcp("db-a".into()), Host::Tcp("db-b".into())]
            );
            assert_eq!(pg.get_ports(), [5432, 5433]);
        }
        for other in ["any", "read-only", "standby", "prefer-standby"] {
            let url = format!("postgres://h/db?target_session_attrs={other}");
            let err = PgUrl::parse(&url).unwrap_err();
            assert!(err.contains("use read-write"), "{url}: {err}");
        }
    }

    #[test]
    fn bad_tls_parameters_are_refused_by_name() {
        for (url, says) in [
            ("postgres://h/db?sslmode=verify", "sslmode=\"verify\""),
            ("postgres://h/db?sslcert=/c.pem", "sslcert and sslkey"),
            (
                "postgres://h/db?sslmode=require&sslrootcert=system",
                "verify-full",
            ),
            ("postgres://h/db?pgbouncer=yes", "pgbouncer=\"yes\""),
            ("postgres://h/db?sslcrl=/crl.pem", "sslcrl is not supported"),
            ("postgres://h/db?sslrootcert=%zz", "percent-encoding"),
        ] {
            let err = PgUrl::parse(url).unwrap_err();
            assert!(err.contains(says), "{url}: {err}");
        }
    }

    #[test]
    fn check_config_names_a_bad_tls_parameter_without_the_password() {
        let text = "[server]\nupstream = \"http://127.0.0.1:9\"\n[store]\nbackend = \"postgres\"\n\
                    url = \"postgres://u:hunter2@h/db?sslmode=verify_full\"\n";
        let err = crate::config::Config::parse(text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("store.url: sslmode=\"verify_full\""), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }
}
