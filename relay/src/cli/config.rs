//! `trellara config show` (each flow's resolved plan) and `trellara config
//! redact` (a copy of the file that is safe to share). Neither connects to
//! anything nor starts a throwaway target; both print secrets redacted.

use super::Format;
use crate::config::{self, Config};
use crate::plan::Plan;
use anyhow::Context;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    #[command(subcommand)]
    command: ConfigCommand,
}

#[derive(Debug, clap::Subcommand)]
enum ConfigCommand {
    /// Print each flow's resolved plan: where source and target are
    /// (passwords redacted), slot, publication, log, transport and tuning.
    Show {
        #[arg(long, default_value = "trellara.yml")]
        config: PathBuf,
        #[arg(long)]
        flow: Option<String>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Print the config with every inline URL's password redacted, as
    /// YAML to share in a review or a support request.
    Redact {
        #[arg(long, default_value = "trellara.yml")]
        config: PathBuf,
    },
}

pub fn run(args: ConfigArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        ConfigCommand::Show {
            config,
            flow,
            format,
        } => show(&config, flow.as_deref(), format),
        ConfigCommand::Redact { config } => redact(&config),
    }
}

fn show(path: &std::path::Path, only: Option<&str>, format: Format) -> anyhow::Result<ExitCode> {
    let loaded = config::load(path)?;
    let plans: Vec<Plan> = super::flow::flows(&loaded, only)?
        .into_iter()
        .map(|(index, _)| Plan::resolve(&loaded, index))
        .collect();
    if format == Format::Json {
        outln!("{:#}", serde_json::to_value(&plans)?);
        return Ok(ExitCode::SUCCESS);
    }
    for plan in &plans {
        outln!("flow {}", plan.flow);
        outln!("  source       {}", plan.source);
        outln!("  source_id    {}", plan.source_id);
        for sink in &plan.sinks {
            outln!(
                "  sink         {} -> {} (cursor {})",
                sink.dataset_id,
                sink.target,
                sink.cursor
            );
        }
        outln!("  slot         {}", plan.slot);
        outln!("  publication  {}", plan.publication);
        outln!("  tables       {}", plan.tables.join(", "));
        outln!(
            "  capture      {}",
            serde_json::to_value(plan.capture)?.as_str().unwrap_or("?")
        );
        let t = &plan.transport;
        outln!(
            "  transport    {}{}",
            t.kind,
            match (&t.brokers, &t.topic) {
                (Some(b), Some(topic)) => format!(" (topic {topic} on {b})"),
                _ => String::new(),
            }
        );
        outln!("  log_dir      {}", t.log_dir.display());
        outln!("  retention    {} MiB", t.retention_bytes >> 20);
        outln!(
            "  endpoints    http://{}/metrics (run --follow)",
            plan.listen
        );
        let tuning = serde_json::to_value(plan.tuning)?;
        let fields: Vec<String> = tuning
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        outln!("  tuning       {}", fields.join(" "));
    }
    Ok(ExitCode::SUCCESS)
}

fn redact(path: &std::path::Path) -> anyhow::Result<ExitCode> {
    // The file as written (relative paths stay relative), not as loaded.
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let parsed: Config =
        config::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    out!("{}", config::to_yaml(&parsed.redacted())?);
    Ok(ExitCode::SUCCESS)
}
