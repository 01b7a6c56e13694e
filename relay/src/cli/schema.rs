//! `trellara schema ddl-plan`: the propagation contract of a schema change
//! (trellara_common::ddl), printed from the config alone; it connects to
//! nothing. `trellara schema accept`: releases the sinks held at a change
//! on one table once their targets match it (crate::accept).

use super::Format;
use crate::config::{self, ApplyMode};
use std::path::PathBuf;
use std::process::ExitCode;
use trellara_common::ddl::{self, Change, Contract};

#[derive(Debug, clap::Args)]
pub struct SchemaArgs {
    #[command(subcommand)]
    command: SchemaCommand,
}

#[derive(Debug, clap::Subcommand)]
enum SchemaCommand {
    /// Print how a schema change would be classified, decided and
    /// propagated, without touching anything.
    #[command(name = "ddl-plan")]
    DdlPlan {
        #[arg(long, default_value = "trellara.yml")]
        config: PathBuf,
        /// The flow (needed when the config has several).
        #[arg(long)]
        flow: Option<String>,
        /// KIND:schema.table[.column], e.g. add_nullable_column:public.orders.note
        #[arg(long)]
        change: String,
        /// Instead of the flow's schema.apply_mode.
        #[arg(long, value_enum)]
        apply_mode: Option<Mode>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
    /// Release the sinks held at a schema change on one table, once the
    /// change is applied on their targets.
    Accept {
        #[arg(long, default_value = "trellara.yml")]
        config: PathBuf,
        /// The flow (needed when the config has several).
        #[arg(long)]
        flow: Option<String>,
        /// The table the held change is on, schema.table.
        #[arg(long)]
        table: String,
        /// Only this sink (default: every sink that holds the change).
        #[arg(long)]
        sink: Option<String>,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
}

/// `--apply-mode`, as config's `schema.apply_mode` spells it.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Mode {
    Auto,
    Staged,
    Manual,
}

impl From<Mode> for ApplyMode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Auto => ApplyMode::Auto,
            Mode::Staged => ApplyMode::Staged,
            Mode::Manual => ApplyMode::Manual,
        }
    }
}

pub fn run(args: SchemaArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        SchemaCommand::DdlPlan {
            config,
            flow,
            change,
            apply_mode,
            format,
        } => {
            // The change first: a typo is named before the config is read.
            let change: Change = change.parse()?;
            let loaded = config::load(&config)?;
            let flows = super::flow::flows(&loaded, flow.as_deref())?;
            let (_, f) = one_flow(&flows)?;
            let contract = ddl::plan(f, &change, apply_mode.map(ApplyMode::from));
            match format {
                Format::Json => outln!("{}", serde_json::to_string_pretty(&contract)?),
                Format::Text => print(&contract),
            }
            Ok(ExitCode::SUCCESS)
        }
        SchemaCommand::Accept {
            config,
            flow,
            table,
            sink,
            format,
        } => {
            let table = trellara_common::table_name::TableName::parse(&table)
                .map_err(|e| anyhow::anyhow!("--table {table:?}: {e}"))?;
            let loaded = config::load(&config)?;
            let flows = super::flow::flows(&loaded, flow.as_deref())?;
            let (index, f) = one_flow(&flows)?;
            let config_path = config.display().to_string();
            let released = super::flow::runtime()?.block_on(crate::accept::accept(
                (f, index, &config_path),
                &table,
                sink.as_deref(),
            ))?;
            match format {
                Format::Json => outln!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "flow": f.name,
                        "table": table.to_string(),
                        "released": released,
                    }))?
                ),
                Format::Text => {
                    for r in &released {
                        outln!(
                            "accepted the held change on {table} for sink {} (held transaction {}): its target has the table's {} columns",
                            r.sink,
                            r.commit_lsns.join(", "),
                            r.columns
                        );
                    }
                    outln!(
                        "the sink goes on from the held transaction: a following run within seconds, otherwise at its next `trellara run --config {config_path} --flow {}`",
                        f.name
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The one flow a schema command is about.
fn one_flow<'a>(flows: &[(usize, &'a config::Flow)]) -> anyhow::Result<(usize, &'a config::Flow)> {
    if flows.len() > 1 {
        let names: Vec<&str> = flows.iter().map(|(_, f)| f.name.as_str()).collect();
        anyhow::bail!(
            "the config has {} flows: say which the change is on\nhint: --flow takes one of: {}",
            flows.len(),
            names.join(", ")
        );
    }
    Ok(flows[0])
}

fn print(c: &Contract) {
    let target = match &c.column {
        Some(column) => format!("{}.{column}", c.table),
        None => c.table.clone(),
    };
    outln!(
        "{} {target} on flow {} (apply mode {})",
        c.kind,
        c.flow,
        c.apply_mode
    );
    outln!("  compatibility      {}", c.compatibility);
    outln!("  decision           {}", c.decision);
    outln!("  why                {}", c.reason);
    outln!("  barrier            {}", c.barrier_id);
    outln!(
        "  affected sinks     {}",
        if c.affected_sinks.is_empty() {
            "none".to_owned()
        } else {
            c.affected_sinks.join(", ")
        }
    );
    outln!("  phases");
    for (i, phase) in c.phases.iter().enumerate() {
        outln!("    {}. {phase}", i + 1);
    }
    for ack in &c.acknowledgement {
        outln!(
            "  acknowledgement    sink {}: {}",
            ack.sink,
            ack.acknowledges
        );
    }
    outln!("  visibility pause   {}", c.visibility_pause);
    for fix in &c.fix {
        outln!("  fix                {fix}");
    }
    outln!("nothing was touched: the contract is computed from the config alone");
}
