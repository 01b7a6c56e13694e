//! `trellara relay`: run a capture stage alone until SIGTERM or Ctrl-C -
//! either a pgoutput slot into a durable log directory (external), or, with
//! `--native-socket`, the extension's worker over a 0600 Unix socket (native).

use crate::capture::{self, CaptureConfig};
use crate::native::{self, NativeConfig};
use anyhow::Context;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use trellara_external_relay::pgoutput::ProtoVersion;

#[derive(Debug, clap::Args)]
pub struct RelayArgs {
    /// Source connection string (postgresql://user[:password]@host:port/db?sslmode=...).
    /// Prefer TRELLARA_SOURCE_DATABASE_URL to keep the password out of ps.
    // Read by hand when absent, not with clap's `env`: clap counts an
    // environment value as given, and it would conflict with native mode.
    #[arg(long, conflicts_with = "native_socket")]
    source_database_url: Option<String>,
    /// Logical replication slot (pgoutput).
    #[arg(
        long,
        required_unless_present_any = ["native_socket", "config"],
        conflicts_with = "native_socket"
    )]
    slot: Option<String>,
    /// Publication(s) to stream.
    #[arg(
        long = "publication",
        required_unless_present_any = ["native_socket", "config"],
        conflicts_with = "native_socket"
    )]
    publications: Vec<String>,
    /// Create the slot if it does not exist.
    #[arg(long, conflicts_with = "native_socket")]
    create_slot: bool,
    /// Native mode: listen on this Unix socket (created 0600; its directory
    /// must not be writable by others) for the extension's capture worker.
    /// Run the relay as the PostgreSQL server's OS user.
    #[arg(long)]
    native_socket: Option<PathBuf>,
    /// Native mode from a flow with `capture: native`: the socket is
    /// `<log_dir>.sock`, the log and source id are the flow's.
    #[arg(long, conflicts_with_all = ["native_socket", "source_database_url", "slot", "publications", "log_dir", "source_id"])]
    config: Option<PathBuf>,
    /// The flow in --config (default: the only one).
    #[arg(long, requires = "config")]
    flow: Option<String>,
    /// Durable log directory.
    #[arg(long, required_unless_present = "config")]
    log_dir: Option<PathBuf>,
    /// Stable id of the source database, written into every envelope (in
    /// native mode: the worker's trellara.source_id must equal it).
    #[arg(long, required_unless_present = "config")]
    source_id: Option<String>,
    /// Dataset (flow) id; defaults to the source id.
    #[arg(long)]
    dataset_id: Option<String>,
    /// pgoutput protocol: 2 streams large in-progress transactions (with
    /// bounded memory); 1 waits for commit.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    proto_version: u8,
    /// Memory per transaction before it spills to disk, in MiB.
    #[arg(long, default_value_t = 64)]
    memory_budget_mib: usize,
}

pub fn run(args: RelayArgs) -> anyhow::Result<ExitCode> {
    if let Some(path) = &args.config {
        let prepared = super::flow::Prepared::new(path, args.flow.as_deref())?;
        // The capture role as a service: capture into the log, and
        // forward it to the topic of a Kafka flow; the apply service
        // reads the topic, or follows the local log on this host.
        return prepared.serve(crate::service::Role::Relay);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let log_dir = args.log_dir.unwrap_or_default();
    let source_id = args.source_id.unwrap_or_default();
    if let Some(socket_path) = args.native_socket {
        let config = NativeConfig {
            socket_path,
            log_dir,
            source_id,
            max_envelope_bytes: 256 << 20,
            progress: None,
            begun: None,
            observe: None,
            floor: trellara_common::Lsn::ZERO,
            owner: None,
        };
        return serve_native(&runtime, config);
    }
    let Some(url) = args.source_database_url.or_else(|| {
        std::env::var(super::flow::SOURCE_URL_ENV)
            .ok()
            .filter(|u| !u.is_empty())
    }) else {
        anyhow::bail!(
            "no source: pass --source-database-url URL or set {} (or --native-socket, or --config for a native flow)",
            super::flow::SOURCE_URL_ENV
        );
    };
    let source = url.parse().context("--source-database-url")?;
    let config = CaptureConfig {
        source,
        slot: args.slot.unwrap_or_default(),
        publications: args.publications,
        create_slot: args.create_slot,
        dataset_id: args.dataset_id.unwrap_or_else(|| source_id.clone()),
        source_id,
        log_dir,
        proto_version: if args.proto_version == 1 {
            ProtoVersion::V1
        } else {
            ProtoVersion::V2
        },
        memory_budget: args.memory_budget_mib << 20,
        chunk_bytes: 4 << 20,
        status_interval: Duration::from_secs(1),
        max_backoff: Duration::from_secs(30),
        pinned: HashMap::new(),
        schemas: HashMap::new(),
        floor: Default::default(),
        progress: None,
        begun: None,
        observe: None,
        rejoin_at: None,
        ddl: None,
    };
    let stats = runtime.block_on(capture::run(config, crate::flow::until_signal()))?;
    errln!(
        "relay stopped: {} envelopes appended, {} duplicates skipped, {} reconnects",
        stats.envelopes,
        stats.duplicates_skipped,
        stats.reconnects
    );
    Ok(ExitCode::SUCCESS)
}

/// Serves the native socket until SIGTERM or Ctrl-C, then says what it did.
fn serve_native(
    runtime: &tokio::runtime::Runtime,
    config: NativeConfig,
) -> anyhow::Result<ExitCode> {
    let stats = runtime.block_on(native::serve(config, crate::flow::until_signal()))?;
    errln!(
        "relay stopped: {} envelopes appended, {} duplicates skipped, {} frames rejected, {} connections",
        stats.envelopes,
        stats.duplicates_skipped,
        stats.rejected_frames,
        stats.connections
    );
    Ok(ExitCode::SUCCESS)
}
