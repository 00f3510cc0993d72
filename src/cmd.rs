//! The subcommands, one file each. [`run`] starts the one asked for and
//! turns its result into the process's exit code.

/// `print!` for what a command prints: a reader that went away (`idemgate
/// check-config | head -1`: EPIPE) is no failure and no panic, and the
/// command still ends with its own status ([`write_out`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::cmd::write_out(format_args!($($arg)*))
    };
}

/// `println!` as [`out!`].
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::cmd::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub mod args;
pub mod check_config;
pub mod demo;
pub mod keys;
pub mod migrate;
pub mod reload;
pub mod serve;

use crate::config::Config;
use args::{Cli, Command};
use std::future::Future;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

/// sysexits.h EX_USAGE: a bad config is the operator's input error.
const EX_USAGE: u8 = 64;

pub fn run(cli: Cli) -> ExitCode {
    let with_config = |path: &std::path::Path, run: &dyn Fn(Config) -> ExitCode| match load(path) {
        Some(cfg) => run(cfg),
        None => ExitCode::from(EX_USAGE),
    };
    match cli.command {
        Command::CheckConfig { config, connect } => with_config(&config, &|cfg| {
            if !files_ok(&config, &cfg) {
                return ExitCode::from(EX_USAGE);
            }
            check_config::run(&config, &cfg, connect)
        }),
        Command::Serve { config } => with_config(&config, &|cfg| {
            if !files_ok(&config, &cfg) {
                return ExitCode::from(EX_USAGE);
            }
            crate::telemetry::init(cfg.restart.log.format, &cfg.restart.log.level);
            exit(block_on(serve::run(cfg, config.clone())))
        }),
        Command::Migrate { config } => with_config(&config, &|cfg| {
            crate::telemetry::init(cfg.restart.log.format, &cfg.restart.log.level);
            exit(block_on(migrate::run(cfg)))
        }),
        Command::Keys { config, command } => {
            if !config.exists() {
                // Never a store of its own: only the proxy's file names it.
                eprintln!(
                    "idemgate keys: no config at {} (keys reads the proxy's own config: give --config FILE or set IDEMGATE_CONFIG; the default is read from the working directory)",
                    config.display()
                );
                return ExitCode::from(EX_USAGE);
            }
            with_config(&config, &|cfg| keys::command(cfg, &command))
        }
        Command::Reload { config, admin } => {
            with_config(
                &config,
                &|cfg| match block_on(async { Ok(reload::run(&cfg, admin).await) }) {
                    Ok(code) => code,
                    Err(e) => exit(Err(e)),
                },
            )
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

/// The files a config names but does not read at load (the listeners'
/// TLS): a bad one is a config error of `check-config` and `serve`.
fn files_ok(path: &std::path::Path, cfg: &Config) -> bool {
    match cfg.check_files() {
        Ok(()) => true,
        Err(e) => {
            eprintln!("invalid configuration: {}: {e}", path.display());
            false
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

/// Set once stdout cannot be written (its reader went away): what follows
/// is dropped, as a shell pipeline drops it.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);

/// Writes a command's output to stdout. `println!` panics when it cannot
/// (exit 101 under `| head`); here a closed pipe only ends the output: the
/// command goes on (a `keys delete` that ran is not undone by its reader
/// leaving) and exits with its own status. Another write error is said
/// once on stderr.
pub(crate) fn write_out(args: std::fmt::Arguments<'_>) {
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        STDOUT_GONE.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("idemgate: cannot write the output: {e}");
        }
    }
}
