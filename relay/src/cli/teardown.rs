//! `trellara teardown --config trellara.yml [--flow NAME] [--yes]`: what a
//! flow left on the source, the target and disk, removed on request.
//! Without `--yes` it only says what it would remove (exit 1).

use super::Format;
use crate::config;
use crate::flow;
use anyhow::Context;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct TeardownArgs {
    #[arg(long, default_value = "trellara.yml")]
    config: PathBuf,
    /// Only this flow.
    #[arg(long)]
    flow: Option<String>,
    /// Remove it; without, print what would be removed and exit 1.
    #[arg(long)]
    yes: bool,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

pub fn run(args: TeardownArgs) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let config_path = args.config.display().to_string();
    let rt = super::flow::runtime()?;
    let mut out = Vec::new();
    for (index, f) in super::flow::flows(&config, args.flow.as_deref())? {
        let (plan, removed) = rt
            .block_on(async {
                // Before any connection: a flow waiting to follow again
                // holds its log while a database is down.
                crate::teardown::refuse_running(f)?;
                let (source_url, target_url) = flow::urls(f, index)?;
                let source = flow::connect(&source_url, "source").await?;
                let target = flow::connect(&target_url, "target").await?;
                flow::refuse_same_database(&source, &target, &config_path).await?;
                let plan = crate::teardown::plan(f, &source, &target).await?;
                let removed = if args.yes {
                    Some(crate::teardown::execute(&plan, f, &source, &target).await?)
                } else {
                    None
                };
                anyhow::Ok((plan, removed))
            })
            .with_context(|| format!("teardown flow {}", f.name))?;
        out.push((plan, removed));
    }
    match args.format {
        Format::Json => {
            let flows: Vec<_> = out
                .iter()
                .map(|(plan, removed)| {
                    json!({
                        "flow": plan.flow,
                        "dry_run": removed.is_none(),
                        "would_remove": if removed.is_none() { plan.steps.iter().map(|s| s.describe(&plan.flow)).collect() } else { Vec::new() },
                        "removed": removed.clone().unwrap_or_default(),
                        "kept": plan.kept,
                    })
                })
                .collect();
            outln!("{}", serde_json::to_string_pretty(&flows)?);
        }
        Format::Text => {
            for (plan, removed) in &out {
                match removed {
                    None => {
                        outln!("flow {}: teardown would remove:", plan.flow);
                        for step in &plan.steps {
                            outln!("  {}", step.describe(&plan.flow));
                        }
                        if plan.steps.is_empty() {
                            outln!("  nothing: the flow left nothing behind");
                        }
                    }
                    Some(done) => {
                        outln!("flow {}: removed:", plan.flow);
                        for line in done {
                            outln!("  {line}");
                        }
                        if done.is_empty() {
                            outln!("  nothing: the flow left nothing behind");
                        }
                    }
                }
                for line in &plan.kept {
                    outln!("  kept: {line}");
                }
            }
            if !args.yes {
                outln!(
                    "nothing was removed; to remove it: trellara teardown --config {config_path}{} --yes",
                    args.flow
                        .as_deref()
                        .map(|f| format!(" --flow {f}"))
                        .unwrap_or_default()
                );
            }
        }
    }
    Ok(if args.yes {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
