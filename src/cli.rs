//! Command-line interface (clap derive).

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

/// Which scope a key belongs to (exactly one).
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct ScopeArgs {
    /// The scope header's value as the client sent it (e.g. "Bearer abc").
    #[arg(long)]
    pub scope_header_value: Option<String>,
    /// The scope's hash, as printed by `keys show`.
    #[arg(long)]
    pub scope: Option<String>,
    /// Requests that carried no scope header.
    #[arg(long)]
    pub anonymous: bool,
}

impl ScopeArgs {
    pub fn to_arg(&self) -> crate::keys::ScopeArg {
        use crate::keys::ScopeArg;
        match (&self.scope_header_value, &self.scope) {
            (Some(v), _) => ScopeArg::HeaderValue(v.clone()),
            (None, Some(h)) => ScopeArg::Hash(h.clone()),
            (None, None) => ScopeArg::Anonymous,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Show a key's record: state, fingerprint, status, headers, times, lease.
    Show {
        #[command(flatten)]
        scope: ScopeArgs,
        /// The idempotency key as the client sent it.
        key: String,
    },
    /// Delete a key's record whatever its state (e.g. a key stuck in flight).
    Delete {
        #[command(flatten)]
        scope: ScopeArgs,
        key: String,
    },
    /// Delete every expired record now.
    PurgeExpired,
}
