//! `trellara`: parse arguments, set up tracing, dispatch. Everything else
//! lives in the library so tests and the simulator drive the same code.

use clap::Parser;
use std::process::ExitCode;
use trellara_relay::cli::{self, Cli};

fn main() -> ExitCode {
    let cli = Cli::parse();
    cli::init_tracing(cli.verbose);
    match cli::run(cli) {
        Ok(_) if let Some(e) = cli::output_error() => {
            cli::write_err(format_args!("error: standard output: {e}\n"));
            ExitCode::from(1)
        }
        Ok(code) => code,
        Err(err) => {
            // The whole context chain: what failed and why.
            cli::write_err(format_args!("error: {}\n", cli::chain(&err)));
            ExitCode::from(cli::exit_status(&err, 1))
        }
    }
}
