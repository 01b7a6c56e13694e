//! The `trellara` command line: one file per subcommand. Commands whose
//! feature has not landed say so and name the issue, instead of pretending.
//!
//! Exit status: 0 success, 1 error, 2 bad usage (clap), 3 refused by
//! preflight's checks before anything was created or changed.

/// `println!` for command output that a reader who stopped reading
/// (`status | head`) cannot break: see [`write_out`].
macro_rules! outln {
    () => { $crate::cli::write_out(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::cli::write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!`, likewise.
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::write_out(format_args!($($arg)*)) };
}

/// `eprintln!` that a closed stderr (`2>&1 | head`) cannot panic.
macro_rules! errln {
    ($($arg:tt)*) => { $crate::cli::write_err(format_args!("{}\n", format_args!($($arg)*))) };
}

mod chaos;
mod config;
mod flow;
mod log;
mod relay;
mod schema;
mod semantics;
mod teardown;

use clap::{Parser, Subcommand, ValueEnum};
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "trellara",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("TRELLARA_COMMIT"), ")"),
    about = "Verified change data for PostgreSQL",
    long_about = None,
    // The short help lists the nine public commands and no tenth
    // (`trellara <command> --help` gives a command's own).
    disable_help_subcommand = true
)]
pub struct Cli {
    /// More logging: -v info, -vv debug, -vvv trace (RUST_LOG wins when set).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,

    #[command(subcommand)]
    pub command: Command,
}

/// Output shape of reporting commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Format {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Repair {
    /// Name what is blocked and the commands that unblock it.
    Plan(flow::StatusArgs),
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Write a trellara.yml for a flow.
    Init(flow::InitArgs),
    /// Validate a config offline, or grade a source (read-only).
    Check(flow::CheckArgs),
    /// Check the live source and target for a configured flow (read-only).
    Preflight(flow::PreflightArgs),
    /// Run a flow: capture, durable log, apply, optionally verify.
    Run(flow::RunArgs),
    /// Prove convergence or name the divergence and its recovery command.
    Verify(flow::VerifyArgs),
    /// Flow status, diagnostics and reports.
    Status(flow::StatusArgs),
    /// Fleet configuration, reports and scorecards.
    Fleet(NotBuilt),
    /// Lakehouse fan-in plans and epochs.
    Lake(NotBuilt),
    /// Show or migrate configuration.
    Config(config::ConfigArgs),
    /// Inspect and verify a durable segment log directory.
    #[command(hide = true)]
    Log(log::LogArgs),
    /// Run the capture role: a slot into the durable log (and a Kafka flow's topic).
    #[command(hide = true)]
    Relay(relay::RelayArgs),
    /// Run the apply role of a flow of one sink: its topic or local log into the target.
    #[command(hide = true)]
    Apply(flow::ApplyArgs),
    /// Run the failure matrix (deterministic simulation).
    #[command(hide = true)]
    Chaos(chaos::ChaosArgs),
    /// Re-enter the snapshot state machine for a destination past retention.
    #[command(hide = true)]
    Reseed(flow::ReseedArgs),
    /// Name what is blocked and the commands that unblock it.
    #[command(hide = true, name = "repair-plan")]
    RepairPlan(flow::StatusArgs),
    /// `repair plan`: the same as `repair-plan`. There is deliberately no
    /// `repair apply`.
    #[command(hide = true)]
    Repair {
        #[command(subcommand)]
        action: Repair,
    },
    /// Remove a flow's slot, publication, state rows and log (not its target tables).
    #[command(hide = true)]
    Teardown(teardown::TeardownArgs),
    /// Stream position tools (locate-local).
    #[command(hide = true)]
    Stream(flow::StreamArgs),
    /// Schema contracts: the plan of a schema change (ddl-plan).
    #[command(hide = true)]
    Schema(schema::SchemaArgs),
    /// Observe the target while a flow applies: was anything half-applied?
    #[command(hide = true)]
    Semantics(semantics::SemanticsArgs),
    /// The pilot scorecard (evidence tooling).
    #[command(hide = true, name = "pilot-scorecard")]
    PilotScorecard(NotBuilt),
    /// The pilot's forwardable evidence package.
    #[command(hide = true, name = "pilot-package")]
    PilotPackage(NotBuilt),
}

/// Arguments of a command that has not landed yet: accepted, then refused
/// with the issue that builds it.
#[derive(Debug, clap::Args)]
pub struct NotBuilt {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    args: Vec<String>,
}

/// Writes command output. Once the reader has gone (EPIPE), later output
/// is dropped and the command finishes its work: a closed pipe must not
/// panic, nor cut a run short between its durable steps.
pub fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    static GONE: AtomicBool = AtomicBool::new(false);
    if GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        GONE.store(true, Ordering::Relaxed);
        // A reader that left wanted no more; a full disk lost output the
        // command must not report as written (see [`output_error`]).
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            let _ = OUTPUT_ERROR.set(e.to_string());
        }
    }
}

static OUTPUT_ERROR: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The filter the process started with (RUST_LOG or `-v`), restored when
/// `service.log_level` is removed.
static STARTUP_FILTER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Why command output could not be written (other than a closed pipe):
/// the command then fails, whatever it did.
pub fn output_error() -> Option<&'static str> {
    OUTPUT_ERROR.get().map(String::as_str)
}

/// Writes to stderr; a stderr that is gone cannot be told so.
pub fn write_err(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_fmt(args);
}

pub use crate::errors::chain;

/// Exit status of a command that failed with `err`: 3 when preflight's
/// checks refused it (nothing was created or changed), else `otherwise`.
pub fn exit_status(err: &anyhow::Error, otherwise: u8) -> u8 {
    let blocked = err.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<crate::flow::FlowError>(),
            Some(
                crate::flow::FlowError::Blocked { .. }
                    | crate::flow::FlowError::Busy { .. }
                    | crate::flow::FlowError::SplitNeedsOneSink { .. }
            )
        )
    });
    if blocked { EXIT_BLOCKED } else { otherwise }
}

/// Refused by preflight's checks (docs/CLI.md).
pub const EXIT_BLOCKED: u8 = 3;

/// The installed log filter, replaceable while the process runs
/// (`service.log_level` on SIGHUP).
static LOG_FILTER: std::sync::OnceLock<
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>,
> = std::sync::OnceLock::new();

pub fn init_tracing(verbose: u8) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = STARTUP_FILTER.set(filter.to_string());
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    // Colour codes only for a person at a terminal, and never under NO_COLOR.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(ansi),
        )
        .init();
    let _ = LOG_FILTER.set(handle);
}

/// Logs at `service.log_level` from now on (None: as the process started,
/// by `-v`). RUST_LOG, when set, is the operator's word for this process
/// and wins: Err says so. Ok: the filter now in force.
pub(crate) fn set_log_level(level: Option<&str>) -> Result<String, String> {
    if std::env::var_os("RUST_LOG").is_some_and(|v| !v.is_empty()) {
        return Err("RUST_LOG is set for this process and wins over service.log_level".into());
    }
    let level = level
        .or(STARTUP_FILTER.get().map(String::as_str))
        .unwrap_or("warn")
        .to_owned();
    let filter = tracing_subscriber::EnvFilter::builder()
        .parse(&level)
        .map_err(|e| format!("{level:?} is not a log filter: {e}"))?;
    let handle = LOG_FILTER
        .get()
        .ok_or_else(|| "no log filter is installed".to_owned())?;
    handle.reload(filter).map_err(|e| e.to_string())?;
    Ok(level)
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let (name, issue) = match cli.command {
        Command::Log(args) => return log::run(args),
        Command::Relay(args) => return relay::run(args),
        Command::Apply(args) => return flow::apply(args),
        Command::Init(args) => return flow::init(args),
        Command::Check(args) => return flow::check(args),
        Command::Run(args) => return flow::run(args),
        Command::Verify(args) => return flow::verify(args),
        Command::Status(args) => return flow::status(args),
        Command::Preflight(args) => return flow::preflight(args),
        Command::Fleet(_) => ("fleet", "the fleet fan-in issue"),
        Command::Lake(_) => ("lake", "the fleet fan-in issue"),
        Command::PilotScorecard(_) => ("pilot-scorecard", "the evidence package issue"),
        Command::PilotPackage(_) => ("pilot-package", "the evidence package issue"),
        Command::Config(args) => return config::run(args),
        Command::Chaos(args) => return chaos::run(args),
        Command::Reseed(args) => return flow::reseed(args),
        Command::RepairPlan(args)
        | Command::Repair {
            action: Repair::Plan(args),
        } => return flow::repair_plan(args),
        Command::Stream(args) => return flow::stream(args),
        Command::Teardown(args) => return teardown::run(args),
        Command::Semantics(args) => return semantics::run(args),
        Command::Schema(args) => return schema::run(args),
    };
    Err(not_built(name, issue))
}

/// A command that has not landed: refused, naming the issue that builds it.
fn not_built(name: &str, issue: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "`trellara {name}` is not built yet; it arrives with {issue}.\n\
         hint: see docs/CLI.md for what is built"
    )
}
