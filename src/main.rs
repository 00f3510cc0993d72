//! The `idemgate` binary: parse the arguments, run the subcommand
//! ([`idemgate::cmd::run`]), exit with its code.

use clap::Parser;

fn main() -> std::process::ExitCode {
    idemgate::cmd::run(idemgate::cmd::args::Cli::parse())
}
