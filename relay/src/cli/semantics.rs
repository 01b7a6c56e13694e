//! `trellara semantics` (hidden): runs the flow for `--duration` seconds
//! (capture and apply, as `run --follow` does) while an observer reads the
//! target and tries to catch a source transaction half-applied. Exit 0
//! ATOMIC (transactions were in flight and none was ever seen half
//! applied), 1 HALF_APPLIED, 2 error, 3 INCONCLUSIVE (nothing was in
//! flight while the reader looked: run a workload at the source meanwhile).

use super::Format;
use super::flow::{flows, runtime};
use crate::config;
use crate::flow;
use crate::semantics::Observer;
use anyhow::Context;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

const EXIT_HALF_APPLIED: u8 = 1;
const EXIT_ERROR: u8 = 2;
const EXIT_INCONCLUSIVE: u8 = 3;

#[derive(Debug, clap::Args)]
pub struct SemanticsArgs {
    #[arg(long, default_value = "trellara.yml")]
    config: PathBuf,
    /// Only this flow (one flow per run).
    #[arg(long)]
    flow: Option<String>,
    /// Seconds to apply and observe (run the source workload meanwhile).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    duration: u64,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

pub fn run(args: SemanticsArgs) -> anyhow::Result<ExitCode> {
    match observe(&args) {
        Ok(code) => Ok(code),
        Err(e) => {
            errln!("error: {}", super::chain(&e));
            Ok(ExitCode::from(EXIT_ERROR))
        }
    }
}

fn observe(args: &SemanticsArgs) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let config_path = args.config.display().to_string();
    let selected = flows(&config, args.flow.as_deref())?;
    let [(index, f)] = selected.as_slice() else {
        anyhow::bail!(
            "semantics observes one flow per run\nhint: pass --flow NAME (flows: {})",
            selected
                .iter()
                .map(|(_, f)| f.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    let text = args.format == Format::Text;
    let rt = runtime()?;
    let started = Instant::now();
    let (stopped, report) = rt.block_on(async {
        let (_, target_url) = flow::urls(f, *index)?;
        let target = flow::connect(&target_url, "target").await?;
        let mut observer = Observer::new(target, &f.name, crate::apply::first_cursor(f));
        observer.prepare().await?;
        let mut progress = |line: &str| {
            if text {
                outln!("[{}] {line}", f.name);
            } else {
                errln!("[{}] {line}", f.name);
            }
        };
        let mode = flow::Mode::For(Duration::from_secs(args.duration), flow::shutdown_signal());
        let job = flow::Job::new(*index, &config_path, mode).watched(&mut observer);
        // A flow that stops (say, a quarantined transaction) ends the
        // observation; what was observed until then is still reported.
        let stopped = flow::run(f, job, &mut progress)
            .await
            .with_context(|| format!("flow {}", f.name))
            .err();
        Ok::<_, anyhow::Error>((stopped, observer.report))
    })?;
    let seconds = started.elapsed().as_secs_f64();
    let verdict = if report.violations > 0 {
        "HALF_APPLIED"
    } else if report.reads_in_flight == 0 {
        "INCONCLUSIVE"
    } else {
        "ATOMIC"
    };
    let limits = [
        "keys whose earlier value lies before the log window around the applier (200 transactions each side) are not judged",
        "a table is not judged in a read whose window holds a TRUNCATE of it",
        "tables without a primary key or replica identity index (or with REPLICA IDENTITY FULL) are not read",
        "values are compared as text in UTC: target columns must have the source's types",
    ];
    match args.format {
        Format::Text => {
            outln!(
                "[{}] {} reads of the target in {seconds:.1}s; {} while transactions were in flight; {} checkpoints seen; {} row versions compared, {} not judgeable",
                f.name,
                report.reads,
                report.reads_in_flight,
                report.checkpoints,
                report.rows_compared,
                report.rows_unjudged
            );
            if report.reads_unjudged > 0 {
                outln!(
                    "[{}] {} reads not judged: the applier was too far behind the log for the window",
                    f.name,
                    report.reads_unjudged
                );
            }
            for (table, why) in &report.not_checked {
                outln!("[{}] not checked: {table}: {why}", f.name);
            }
            for finding in &report.findings {
                outln!(
                    "  transaction {} (xid {}) on {} key ({}), checkpoint {}: {}",
                    finding.commit_lsn,
                    finding.xid,
                    finding.table,
                    finding.key,
                    finding.checkpoint.map_or("none".into(), |c| c.to_string()),
                    finding.detail
                );
            }
            match verdict {
                "HALF_APPLIED" => outln!(
                    "{verdict}: {} observations broke a transaction's atomicity\nhint: `trellara verify --config {config_path}` names the diverging key ranges",
                    report.violations
                ),
                "INCONCLUSIVE" => outln!(
                    "{verdict}: no transaction was applying while the reader looked\nhint: run a workload of multi-table transactions at the source during `trellara semantics`"
                ),
                _ => outln!(
                    "{verdict}: no source transaction was ever observed half-applied ({} reads caught transactions in flight)",
                    report.reads_in_flight
                ),
            }
        }
        Format::Json => outln!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "flow": f.name,
                "verdict": verdict,
                "seconds": seconds,
                "reads": report.reads,
                "reads_in_flight": report.reads_in_flight,
                "checkpoints_seen": report.checkpoints,
                "rows_compared": report.rows_compared,
                "rows_unjudged": report.rows_unjudged,
                "reads_unjudged": report.reads_unjudged,
                "violations": report.violations,
                "findings": report.findings.iter().map(|x| json!({
                    "commit_lsn": x.commit_lsn.to_string(),
                    "xid": x.xid,
                    "table": x.table,
                    "key": x.key,
                    "checkpoint": x.checkpoint.map(|c| c.to_string()),
                    "detail": x.detail,
                })).collect::<Vec<_>>(),
                "not_checked": report.not_checked,
                "limits": limits,
            }))?
        ),
    }
    if let Some(e) = &stopped {
        errln!(
            "error: the flow stopped during the observation: {}",
            super::chain(e)
        );
    }
    Ok(match verdict {
        "HALF_APPLIED" => ExitCode::from(EXIT_HALF_APPLIED),
        _ if stopped.is_some() => ExitCode::from(EXIT_ERROR),
        "INCONCLUSIVE" => ExitCode::from(EXIT_INCONCLUSIVE),
        _ => ExitCode::SUCCESS,
    })
}
