//! `trellara chaos run`: the failure matrix, run here - each scenario's
//! deterministic simulation over seeded histories, with the invariant it
//! protects and the commands that prove and recover it. Exits 1 when any
//! scenario fails, naming the seed that replays the failure.

use super::Format;
use crate::sim::{SCENARIOS, Scenario};
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    #[command(subcommand)]
    command: ChaosCommand,
}

#[derive(Debug, clap::Subcommand)]
enum ChaosCommand {
    /// Run the scenarios (all, or one family) over N seeds each.
    Run {
        /// Only this family: source-and-stream, target-apply, capture,
        /// snapshot or pipeline (not a qualification run).
        #[arg(long)]
        family: Option<String>,
        /// Seeded histories per scenario.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        seeds: u64,
        /// First seed (replay a reported failure with --seed S --seeds 1).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Write the correctness report: one self-contained HTML page with the
    /// matrix, per-invariant results and the seeds. Deterministic (same
    /// seeds, same page), so docs/correctness-report.html can be checked
    /// against it.
    Report {
        /// Where to write the page.
        #[arg(long)]
        output: std::path::PathBuf,
        /// Seeded histories per scenario.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=100_000))]
        seeds: u64,
    },
}

/// The simulator opens no sockets or pipes of its own, so a closed stdout
/// (`trellara chaos run | head`) may end it the conventional way, by
/// SIGPIPE, instead of a panic in `println!` (Rust ignores SIGPIPE, which
/// the relay's socket code relies on elsewhere).
fn end_quietly_on_a_closed_pipe() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // SAFETY: restoring the default disposition installs no handler code;
    // nothing else in this process depends on SIGPIPE being ignored.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
}

pub fn run(args: ChaosArgs) -> anyhow::Result<ExitCode> {
    end_quietly_on_a_closed_pipe();
    let (family, seeds, first, format) = match args.command {
        ChaosCommand::Run {
            family,
            seeds,
            seed,
            format,
        } => (family, seeds, seed, format),
        ChaosCommand::Report { output, seeds } => return report(&output, seeds),
    };
    let selected: Vec<_> = SCENARIOS
        .iter()
        .filter(|s| family.as_deref().is_none_or(|f| s.family == f))
        .collect();
    if selected.is_empty() {
        let families: std::collections::BTreeSet<_> = SCENARIOS.iter().map(|s| s.family).collect();
        anyhow::bail!(
            "no scenarios in family {:?}\nhint: families: {}",
            family.unwrap_or_default(),
            families.into_iter().collect::<Vec<_>>().join(", ")
        );
    }
    let mut failed = 0;
    let ran = selected.len();
    let mut rows = Vec::new();
    let mut results = Vec::with_capacity(ran);
    for scenario in selected {
        let result = run_scenario(scenario, first, seeds);
        if result.is_err() {
            failed += 1;
        }
        results.push((scenario, result.clone()));
        match format {
            Format::Text => {
                let verdict = match &result {
                    Ok(faults) => format!("✓ held over {seeds} seeds ({faults} faults injected)"),
                    Err(e) => format!("✗ FAILED: {e}"),
                };
                outln!("{} {:<60} {verdict}", scenario.id, scenario.simulation);
                outln!("       invariant: {}", scenario.invariant);
                outln!(
                    "       proof: {}  recovery: {}",
                    scenario.proof,
                    scenario.recovery
                );
            }
            Format::Json => rows.push(serde_json::json!({
                "id": scenario.id,
                "family": scenario.family,
                "simulation": scenario.simulation,
                "invariant": scenario.invariant,
                "proof": scenario.proof,
                "recovery": scenario.recovery,
                "seeds": seeds,
                "first_seed": first,
                "passed": result.is_ok(),
                "faults": result.as_ref().ok(),
                "failure": result.as_ref().err(),
            })),
        }
    }
    match format {
        Format::Text => {
            outln!("{ran} scenarios, {failed} failed");
            outln!("qualification: {}", qualification(&results).1);
        }
        Format::Json => {
            let (qualified, verdict) = qualification(&results);
            outln!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "scenarios": rows,
                    "failed": failed,
                    "qualified": qualified,
                    "qualification": verdict,
                }))?
            );
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The qualification verdict of a run, computed from its results (see
/// [`crate::sim::qualified`]), and how to say it.
fn qualification(results: &[(&Scenario, Result<u32, String>)]) -> (bool, String) {
    let qualified = crate::sim::qualified(results);
    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    let verdict = if qualified {
        "qualified: every invariant held across all seeds of every scenario".to_owned()
    } else if failed > 0 {
        format!("not qualified: {failed} scenario(s) failed")
    } else {
        format!(
            "not a qualification run: {} of the {} scenarios ran (drop --family)",
            results.len(),
            SCENARIOS.len()
        )
    };
    (qualified, verdict)
}

/// Runs one scenario with the simulated histories' own log warnings (torn
/// index files, poisoned logs: the faults being simulated) kept quiet.
fn run_scenario(scenario: &Scenario, first: u64, seeds: u64) -> Result<u32, String> {
    tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
        crate::sim::run_scenario(scenario, first, seeds)
    })
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Runs every scenario over seeds 0..`seeds` and writes the report.
fn report(output: &std::path::Path, seeds: u64) -> anyhow::Result<ExitCode> {
    use anyhow::Context;
    use std::fmt::Write;
    let results: Vec<_> = SCENARIOS
        .iter()
        .map(|s| (s, run_scenario(s, 0, seeds)))
        .collect();
    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    let (_, verdict) = qualification(&results);
    let mut html = String::new();
    let _ = write!(
        html,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Trellara correctness report</title>\n<style>body{{font-family:system-ui,sans-serif;margin:2rem;max-width:72rem}}table{{border-collapse:collapse;width:100%}}td,th{{border:1px solid #ccc;padding:.35rem .5rem;text-align:left;vertical-align:top}}.ok{{color:#176f2c}}.bad{{color:#b00020}}code{{font-size:.9em}}</style></head><body>\n<h1>Trellara correctness report</h1>\n<p>Generated by <code>trellara chaos report --seeds {seeds}</code>: every scenario of the failure matrix, each a deterministic simulation of Trellara's real code (native relay, external capture with its pgoutput decoder and assembler, durable log, applier, snapshot machine, the round composition) over simulated storage, a simulated walsender, source and target, run over seeds 0 to {last}. One seed replays one history: <code>trellara chaos run --seed S --seeds 1</code>. {total} scenarios, {failed} failed. A build is qualified only when every invariant held across all seeds.</p>\n<p><strong>Verdict: {verdict}</strong>. Families: source-and-stream, target-apply, capture, snapshot, pipeline.</p>\n",
        last = seeds - 1,
        total = results.len(),
    );
    html.push_str("<h2>Matrix</h2>\n<table><tr><th>id</th><th>family</th><th>simulation</th><th>invariant</th><th>result</th><th>proof</th><th>recovery</th></tr>\n");
    for (s, result) in &results {
        let verdict = match result {
            Ok(faults) => {
                format!(
                    "<span class=\"ok\">held over {seeds} seeds ({faults} faults injected)</span>"
                )
            }
            Err(e) => format!("<span class=\"bad\">FAILED: {}</span>", escape(e)),
        };
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{verdict}</td><td><code>{}</code></td><td>{}</td></tr>",
            escape(s.id),
            escape(s.family),
            escape(s.simulation),
            escape(s.invariant),
            escape(s.proof),
            escape(s.recovery)
        );
    }
    html.push_str("</table>\n<h2>Per invariant</h2>\n<table><tr><th>invariant</th><th>scenarios</th><th>held</th></tr>\n");
    let mut invariants: Vec<&str> = SCENARIOS.iter().map(|s| s.invariant).collect();
    invariants.dedup();
    for invariant in invariants {
        let ids: Vec<_> = results
            .iter()
            .filter(|(s, _)| s.invariant == invariant)
            .collect();
        let held = ids.iter().all(|(_, r)| r.is_ok());
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td class=\"{}\">{}</td></tr>",
            escape(invariant),
            ids.iter().map(|(s, _)| s.id).collect::<Vec<_>>().join(", "),
            if held { "ok" } else { "bad" },
            if held { "yes" } else { "no" }
        );
    }
    html.push_str("</table>\n</body></html>\n");
    std::fs::write(output, &html).with_context(|| format!("write {}", output.display()))?;
    errln!(
        "wrote {}: {} scenarios, {failed} failed",
        output.display(),
        results.len()
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
