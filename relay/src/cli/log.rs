//! `trellara log inspect`: what a durable segment log directory holds, and
//! (with `--verify`) proof that every record's checksum and envelope hold.

use super::Format;
use crate::log::{Log, LogConfig, storage::FsStorage};
use anyhow::Context;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use trellara_common::{Lsn, envelope};

#[derive(Debug, clap::Args)]
pub struct LogArgs {
    #[command(subcommand)]
    command: LogCommand,
}

#[derive(Debug, clap::Subcommand)]
enum LogCommand {
    /// Segments, records, cursors and retention pressure of a log directory.
    ///
    /// Opens the log as the relay does: a torn tail left by a crash is cut
    /// off and reported.
    Inspect {
        /// The log directory (e.g. ./.trellara/log).
        #[arg(long)]
        dir: PathBuf,
        /// Read every record back: frame checksums, then envelope decode and
        /// validation.
        #[arg(long)]
        verify: bool,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
}

pub fn run(args: LogArgs) -> anyhow::Result<ExitCode> {
    let LogCommand::Inspect {
        dir,
        verify,
        format,
    } = args.command;
    if !dir.is_dir() {
        anyhow::bail!(
            "log directory {} does not exist\nhint: pass the directory the relay writes, e.g. --dir ./.trellara/log",
            dir.display()
        );
    }
    let _lock = crate::lock::lock(&dir).context("inspect needs the log to itself")?;
    let (log, report) = Log::open(FsStorage, &dir, LogConfig::default())
        .with_context(|| format!("open log {}", dir.display()))?;

    let mut records = 0u64;
    let mut invalid = Vec::new();
    if verify {
        for record in log.read_from(log.first_offset())? {
            let record = record.with_context(|| format!("read log {}", dir.display()))?;
            records += 1;
            if let Err(err) = envelope::decode(&record.payload) {
                invalid.push(json!({"offset": record.offset, "error": err.to_string()}));
            }
        }
    }
    let segments: Vec<_> = log
        .segments()
        .iter()
        .map(|s| {
            json!({"path": s.path.display().to_string(), "base_offset": s.base_offset,
                   "bytes": s.bytes, "sealed": s.sealed})
        })
        .collect();
    let cursors: Vec<_> = log
        .cursors()
        .iter()
        .map(|(name, pos)| {
            json!({"consumer": name, "next_offset": pos.next_offset,
                   "last_commit_lsn": pos.last_commit_lsn.map(|l| Lsn(l).to_string())})
        })
        .collect();
    let pressure: Vec<_> = log
        .retention_pressure()
        .iter()
        .map(|p| {
            json!({"consumer": p.consumer, "held_segments": p.held_segments, "held_bytes": p.held_bytes})
        })
        .collect();
    let torn_tail = report.torn_tail.as_ref().map(|t| {
        json!({"segment": t.segment.display().to_string(), "valid_len": t.valid_len,
               "truncated_bytes": t.truncated_bytes, "reason": t.reason.to_string()})
    });
    let last = log.last_durable();
    let out = json!({
        "dir": dir.display().to_string(),
        "first_offset": log.first_offset(),
        "next_offset": log.next_offset(),
        "last_durable_commit_lsn": last.map(|d| Lsn(d.commit_lsn).to_string()),
        "segments": segments,
        "cursors": cursors,
        "retention_pressure": pressure,
        "torn_tail_repaired": torn_tail,
        "verified": verify.then(|| json!({"records": records, "invalid_envelopes": invalid})),
    });
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&out)?),
        Format::Text => {
            outln!("log {}", dir.display());
            outln!(
                "  records     {}..{} ({} segments)",
                log.first_offset(),
                log.next_offset(),
                segments.len()
            );
            match last {
                Some(d) => outln!(
                    "  durable     offset {} commit LSN {}",
                    d.offset,
                    Lsn(d.commit_lsn)
                ),
                None => outln!("  durable     empty"),
            }
            for (name, pos) in log.cursors() {
                outln!("  cursor      {name} at offset {}", pos.next_offset);
            }
            for p in log.retention_pressure() {
                outln!(
                    "  pressure    {} holds {} segments ({} bytes)",
                    p.consumer,
                    p.held_segments,
                    p.held_bytes
                );
            }
            if let Some(t) = &report.torn_tail {
                outln!(
                    "  repaired    torn tail of {}: {} bytes cut ({})",
                    t.segment.display(),
                    t.truncated_bytes,
                    t.reason
                );
            }
            if verify {
                outln!(
                    "  verified    {records} records, {} invalid envelopes",
                    invalid.len()
                );
                for bad in &invalid {
                    outln!("    offset {}: {}", bad["offset"], bad["error"]);
                }
            }
        }
    }
    Ok(if invalid.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
