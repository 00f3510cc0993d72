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
        /// The SQLite file the demo uses.
        #[arg(long, default_value = "data/demo.db")]
        db: PathBuf,
    },
    /// Run only the demo orders API (the upstream in docker-compose).
    DemoUpstream {
        #[arg(long, default_value = "127.0.0.1:3000")]
        listen: SocketAddr,
    },
}
