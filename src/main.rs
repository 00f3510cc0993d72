//! The `idemgate` binary: parse arguments, load config, hand over to the library.

use clap::Parser;
use idemgate::cli::{Cli, Command, KeysCommand};
use idemgate::config::Config;
use std::process::ExitCode;

/// sysexits.h EX_USAGE: a bad config is the operator's input error.
const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { config, connect } => match Config::load(&config) {
            Ok(cfg) => {
                println!("{}: ok\n{}", config.display(), cfg);
                for w in cfg.warnings() {
                    println!("warning: {w}");
                }
                // What `serve` would do with this process's limits.
                match idemgate::fd_limit::preview(&cfg) {
                    Ok(plan) if plan.lowered() => println!("warning: {plan}"),
                    Ok(plan) => println!("{plan}"),
                    Err(e) => println!("warning: cannot read the file-descriptor limit: {e}"),
                }
                if connect {
                    return exit(runtime().and_then(|rt| rt.block_on(check_connect(&cfg))));
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("invalid configuration: {e}");
                ExitCode::from(EX_USAGE)
            }
        },
        Command::Serve { config } => {
            let cfg = match Config::load(&config) {
                Ok(cfg) => cfg,
                Err(e) => {
                    eprintln!("invalid configuration: {e}");
                    return ExitCode::from(EX_USAGE);
                }
            };
            idemgate::telemetry::init(cfg.log.format, &cfg.log.level);
            exit(runtime().and_then(|rt| rt.block_on(idemgate::run(cfg, config))))
        }
        Command::Migrate { config } => {
            let Some(cfg) = load(&config) else {
                return ExitCode::from(EX_USAGE);
            };
            idemgate::telemetry::init(cfg.log.format, &cfg.log.level);
            exit(runtime().and_then(|rt| rt.block_on(idemgate::store::run_migrate(cfg))))
        }
        Command::Keys { config, command } => {
            let Some(cfg) = load(&config) else {
                return ExitCode::from(EX_USAGE);
            };
            let named = |scope: idemgate::cli::ScopeArgs, key: String| {
                idemgate::keys::record_key(&key, &scope.to_arg(), &cfg)
            };
            let action = match command {
                KeysCommand::Show { scope, key } => {
                    named(scope, key).map(idemgate::keys::KeysAction::Show)
                }
                KeysCommand::Delete { scope, key } => {
                    named(scope, key).map(idemgate::keys::KeysAction::Delete)
                }
                KeysCommand::PurgeExpired => Ok(idemgate::keys::KeysAction::PurgeExpired),
            };
            let action = match action {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("idemgate keys: {e}");
                    return ExitCode::from(EX_USAGE);
                }
            };
            match runtime().and_then(|rt| rt.block_on(idemgate::keys::run(cfg, action))) {
                Ok(idemgate::keys::KeysOutcome::NoRecord) => {
                    ExitCode::from(idemgate::keys::EXIT_NO_RECORD)
                }
                other => exit(other.map(|_| ())),
            }
        }
        Command::Demo { listen, db } => {
            idemgate::telemetry::init(Default::default(), "info");
            exit(runtime().and_then(|rt| rt.block_on(idemgate::demo::run(listen, db))))
        }
        Command::DemoUpstream { listen } => {
            idemgate::telemetry::init(Default::default(), "info");
            exit(runtime().and_then(|rt| rt.block_on(idemgate::demo::run_upstream(listen))))
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

/// `check-config --connect`: one line per store reached.
async fn check_connect(cfg: &Config) -> anyhow::Result<()> {
    let reached = idemgate::store::check_connect(cfg)
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect: {e}"))?;
    for line in reached {
        println!("connect: {line}");
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
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
