//! The subcommands, one file each. [`run`] starts the one asked for and
//! turns its result into the process's exit code.

pub mod args;
pub mod check_config;
pub mod demo;
pub mod keys;
pub mod migrate;
pub mod serve;

use crate::config::Config;
use args::{Cli, Command};
use std::future::Future;
use std::process::ExitCode;

/// sysexits.h EX_USAGE: a bad config is the operator's input error.
const EX_USAGE: u8 = 64;

pub fn run(cli: Cli) -> ExitCode {
    let with_config = |path: &std::path::Path, run: &dyn Fn(Config) -> ExitCode| match load(path) {
        Some(cfg) => run(cfg),
        None => ExitCode::from(EX_USAGE),
    };
    match cli.command {
        Command::CheckConfig { config, connect } => {
            with_config(&config, &|cfg| check_config::run(&config, &cfg, connect))
        }
        Command::Serve { config } => with_config(&config, &|cfg| {
            crate::telemetry::init(cfg.restart.log.format, &cfg.restart.log.level);
            exit(block_on(serve::run(cfg, config.clone())))
        }),
        Command::Migrate { config } => with_config(&config, &|cfg| {
            crate::telemetry::init(cfg.restart.log.format, &cfg.restart.log.level);
            exit(block_on(migrate::run(cfg)))
        }),
        Command::Keys { config, command } => {
            with_config(&config, &|cfg| keys::command(cfg, &command))
        }
        Command::Demo { listen, db } => {
            crate::telemetry::init(Default::default(), "info");
            exit(block_on(demo::run(listen, db)))
        }
        Command::DemoUpstream { listen } => {
            crate::telemetry::init(Default::default(), "info");
            exit(block_on(demo::run_upstream(listen)))
        }
    }
}

fn load(path: &std::path::Path) -> Option<Config> {
    match Config::load(path) {
        Ok(cfg) => Some(cfg),
        Err(e) => {
            eprintln!("invalid configuration: {e}");
            None
        }
    }
}

/// `work` on a new multi-threaded runtime.
fn block_on<T>(work: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(work)
}

fn exit(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemgate: {e:#}");
            ExitCode::FAILURE
        }
    }
}
