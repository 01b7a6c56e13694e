//! `trellara-check POSTGRES_URL`: parse arguments, assess, render, exit with
//! the verdict (0 ready, 3 blocked, 2 could not assess).

use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use trellara_check::{ConnectOptions, Request, config_draft, redact};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
    Html,
}

/// Read-only CDC readiness grade for a PostgreSQL source. Creates nothing.
#[derive(Debug, Parser)]
#[command(name = "trellara-check", version)]
struct Args {
    /// postgresql://user@host:port/db[?sslmode=...]; prefer the environment
    /// variable, which keeps the password out of `ps`.
    #[arg(env = "TRELLARA_SOURCE_DATABASE_URL", hide_env_values = true)]
    postgres_url: String,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Write the report here instead of standard output.
    #[arg(long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// A table to capture (schema.name); repeat or separate with commas.
    #[arg(long = "table", value_name = "SCHEMA.NAME", value_delimiter = ',')]
    tables: Vec<String>,
    /// Write a minimal trellara.yml draft (refused when blocked).
    #[arg(long, value_name = "FILE")]
    write_config: Option<PathBuf>,
    /// Length of the WAL-rate sample.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=300))]
    sample_seconds: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    ExitCode::from(run(args) as u8)
}

fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    redact(&trellara_common::errors::chain(err))
}

fn run(args: Args) -> i32 {
    let options: ConnectOptions = match args.postgres_url.parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("trellara-check: could not assess: {}", error_chain(&e));
            return 2;
        }
    };
    let request = Request {
        tables: args.tables.clone(),
        sample: Duration::from_secs(args.sample_seconds),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("trellara-check: could not start: {e}");
            return 2;
        }
    };
    let report = match runtime.block_on(trellara_check::assess(&options, &request)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("trellara-check: could not assess: {}", error_chain(&e));
            eprintln!("nothing was created — no publication, slot, or checkpoint");
            return e.exit_code();
        }
    };
    let rendered = match args.format {
        Format::Text => trellara_check::render_text(&report),
        Format::Json => trellara_check::render_json(&report),
        Format::Html => trellara_check::render_html(&report),
    };
    match &args.output {
        Some(path) => {
            if let Err(e) = std::fs::write(path, rendered) {
                eprintln!("trellara-check: could not write {}: {e}", path.display());
                return 2;
            }
        }
        // A reader that stopped early (`| head`) is not an error, and must
        // not panic the way print! does on EPIPE.
        None => {
            use std::io::Write;
            let mut stdout = std::io::stdout().lock();
            if let Err(e) = stdout
                .write_all(rendered.as_bytes())
                .and_then(|()| stdout.flush())
                && e.kind() != std::io::ErrorKind::BrokenPipe
            {
                eprintln!("trellara-check: could not write the report: {e}");
                return 2;
            }
        }
    }
    if let Some(path) = &args.write_config {
        match config_draft::write(&report, &args.tables, path) {
            Ok(()) => eprintln!("trellara-check: wrote config draft {}", path.display()),
            Err(e) => eprintln!("trellara-check: {}", error_chain(&e)),
        }
    }
    report.exit_code()
}
