//! Command-line interface (clap derive).

use super::keys::KeysCommand;
use crate::config::DEFAULT_CONFIG_PATH;
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "idemgate",
    version,
    about = "An idempotency reverse proxy: makes configured HTTP routes safe to retry"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size of its largest variant (`keys`, with
// every way of naming a scope) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy.
    Serve {
        #[arg(long, short, default_value = DEFAULT_CONFIG_PATH, env = "IDEMGATE_CONFIG")]
        config: PathBuf,
    },
    /// Validate a config file and print the effective settings and routes.
    CheckConfig {
        #[arg(long, short, default_value = DEFAULT_CONFIG_PATH, env = "IDEMGATE_CONFIG")]
        config: PathBuf,
        /// Also connect to the store and run one trivial call (no
        /// migration): exits 1 naming the cause (refused, TLS not trusted,
        /// host name mismatch, ...) when it cannot.
        #[arg(long)]
        connect: bool,
    },
    /// Run the proxy in front of a built-in demo orders API, on the embedded
    /// SQLite store, and print curl commands to try.
    Demo {
        /// Where the proxy listens.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// The SQLite file the demo uses (reset at start, like the demo API).
        #[arg(long, default_value = "data/demo.db")]
        db: PathBuf,
    },
    /// Apply the PostgreSQL schema migrations and exit (serve also does this).
    Migrate {
        #[arg(long, short, default_value = DEFAULT_CONFIG_PATH, env = "IDEMGATE_CONFIG")]
        config: PathBuf,
    },
    /// Ask the running proxy to reload its config (as SIGHUP does), over
    /// its admin listener from this host, and say whether it took it.
    Reload {
        #[arg(long, short, default_value = DEFAULT_CONFIG_PATH, env = "IDEMGATE_CONFIG")]
        config: PathBuf,
        /// The admin listener to ask, when not the config's `[admin] listen`.
        #[arg(long)]
        admin: Option<SocketAddr>,
    },
    /// Inspect and repair stored keys.
    Keys {
        #[arg(long, short, default_value = DEFAULT_CONFIG_PATH, env = "IDEMGATE_CONFIG", global = true)]
        config: PathBuf,
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Run only the demo orders API (the upstream in docker-compose).
    DemoUpstream {
        #[arg(long, default_value = "127.0.0.1:3000")]
        listen: SocketAddr,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::keys::ScopeArg;

    fn scope_of(args: &[&str]) -> Result<ScopeArg, clap::Error> {
        let all = [&["idemgate", "keys", "show"], args, &["k"]].concat();
        match Cli::try_parse_from(all)?.command {
            Command::Keys {
                command: KeysCommand::Show { scope, .. },
                ..
            } => Ok(scope.to_arg()),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn a_scope_is_named_exactly_one_way() {
        let consumer = scope_of(&["--scope-value", "stripe:/hooks/stripe"]).unwrap();
        assert!(matches!(consumer, ScopeArg::Value(v) if v == "stripe:/hooks/stripe"));
        assert!(scope_of(&["--scope-value", "a", "--anonymous"]).is_err());
        let value = scope_of(&["--scope-header-value", "Bearer a=="]).unwrap();
        assert!(matches!(value, ScopeArg::HeaderValue(v) if v == "Bearer a=="));
        let several = scope_of(&[
            "--scope-header",
            "Authorization=Bearer a",
            "--scope-header",
            "Stripe-Account=acct_1",
            "--route",
            "2",
        ])
        .unwrap();
        match several {
            ScopeArg::Headers { sent, route } => {
                let names: Vec<&str> = sent.iter().map(|h| h.name.as_str()).collect();
                assert_eq!(names, ["authorization", "stripe-account"]);
                assert_eq!(route, Some(2));
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            scope_of(&["--anonymous"]).unwrap(),
            ScopeArg::Anonymous
        ));
        for bad in [
            &[][..],
            &["--anonymous", "--scope-header", "A=b"],
            &["--scope-header-value", "x", "--scope", "ab"],
            &["--route", "2", "--anonymous"],
            &["--route", "2"],
            &["--scope-header", "no-equals-sign"],
        ] {
            assert!(scope_of(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn resolve_takes_exactly_one_verdict_and_a_reason() {
        use crate::store::Verdict;
        let parse = |args: &[&str]| -> Result<Verdict, clap::Error> {
            let all = [
                &["idemgate", "keys", "resolve", "--anonymous"],
                args,
                &["k"],
            ]
            .concat();
            match Cli::try_parse_from(all)?.command {
                Command::Keys {
                    command:
                        KeysCommand::Resolve {
                            verdict, reason, ..
                        },
                    ..
                } => Ok(verdict.verdict(&reason)),
                other => panic!("parsed as {other:?}"),
            }
        };
        assert_eq!(
            parse(&["--not-applied", "--reason", "refunded"]).unwrap(),
            Verdict::NotApplied
        );
        assert_eq!(
            parse(&["--applied", "--reason", " shipped "]).unwrap(),
            Verdict::Applied {
                reason: "shipped".into()
            }
        );
        for bad in [
            &["--reason", "why"][..],
            &["--applied", "--not-applied", "--reason", "why"],
            &["--applied"],
            &["--applied", "--reason", ""],
            &["--applied", "--reason", "  "],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
