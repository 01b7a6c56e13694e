//! The public loop: `init`, `check --config`, `run`, `verify`, `status`.

use super::Format;
use crate::config::{
    self, CapturePath, Config, Environment, Flow, SecretRef, Source, Target, Transport,
};
use crate::flow;
use crate::service::Role;
use crate::verify;
use anyhow::Context;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use trellara_common::table_name::TableName;

/// Exit status of verify: 0 converged, 1 diverged, 2 could not verify.
/// The environment variable that keeps a source URL (and its password)
/// out of the process list.
pub(super) const SOURCE_URL_ENV: &str = "TRELLARA_SOURCE_DATABASE_URL";
const EXIT_DIVERGED: u8 = 1;
const EXIT_ERROR: u8 = 2;

#[derive(Debug, clap::Args)]
pub struct InitArgs {
    #[arg(long)]
    source_database_url: String,
    #[arg(long)]
    target_database_url: Option<String>,
    /// Tables to replicate (schema.table); repeat for more.
    #[arg(long = "table", required = true)]
    tables: Vec<String>,
    #[arg(long, value_enum, default_value = "external")]
    capture: CaptureArg,
    #[arg(long, default_value = "trellara.yml")]
    output: PathBuf,
    /// Flow name.
    #[arg(long, default_value = "main")]
    flow: String,
    /// Evaluation config: inline URLs, local durable log under ./.trellara.
    /// Without it the config is for production: URLs by environment
    /// variable reference only.
    #[arg(long)]
    evaluate: bool,
    /// Replace an existing file.
    #[arg(long)]
    force: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum CaptureArg {
    External,
    Native,
}

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Validate this config offline (no database is contacted).
    #[arg(long, conflicts_with = "database_url")]
    config: Option<PathBuf>,
    /// Grade a live source instead, read-only (the `trellara-check` grader).
    /// Without --config or this flag, TRELLARA_SOURCE_DATABASE_URL.
    // Read by hand, not with clap's `env`: clap counts an environment value
    // as given, so an exported URL would conflict with --config.
    #[arg(long)]
    database_url: Option<String>,
    /// With --database-url: tables to be captured (schema.table).
    #[arg(long = "table")]
    tables: Vec<String>,
    /// With --database-url: seconds to sample the WAL rate.
    #[arg(long, default_value_t = 5)]
    sample_seconds: u64,
    /// text, json, or (with --database-url) html.
    #[arg(long, default_value = "text", value_parser = ["text", "json", "html"])]
    format: String,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[arg(long, default_value = "trellara.yml")]
    config: PathBuf,
    /// Run capture, the durable log and the applier in this process (the
    /// one way `run` works in this build; the flow's transport still
    /// decides between the local log and Kafka).
    #[arg(long)]
    local: bool,
    /// End with `verify` and its exit status.
    #[arg(long)]
    verify: bool,
    /// Keep capturing and applying until SIGTERM or Ctrl-C.
    #[arg(long)]
    follow: bool,
    /// Only this flow.
    #[arg(long)]
    flow: Option<String>,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    #[arg(long, default_value = "trellara.yml")]
    config: PathBuf,
    /// Only this table (schema.table).
    #[arg(long)]
    table: Option<String>,
    #[arg(long)]
    flow: Option<String>,
    /// Only this sink of a flow with `sinks:` (its name); default: every sink.
    #[arg(long)]
    sink: Option<String>,
    /// Rows per key-range chunk of the whole-table checksum (a larger keyed
    /// table is read in chunks, never in one scan).
    #[arg(long, default_value_t = verify::CHUNK_ROWS, value_parser = clap::value_parser!(u64).range(1..))]
    chunk_rows: u64,
    /// Seconds a following flow's fence may take (the temporary slot waits
    /// for running source transactions); past it verify gives up, the
    /// apply goes on.
    #[arg(long, default_value_t = crate::fence::DEFAULT_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    fence_timeout: u64,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

#[derive(Debug, clap::Args)]
pub struct PreflightArgs {
    #[arg(long, default_value = "trellara.yml")]
    config: PathBuf,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[arg(long, default_value = "trellara.yml")]
    config: PathBuf,
    /// Only this flow.
    #[arg(long)]
    flow: Option<String>,
    #[arg(long, value_enum, default_value = "report")]
    view: View,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum View {
    Report,
    Diagnostics,
}

pub fn init(args: InitArgs) -> anyhow::Result<ExitCode> {
    if args.output.exists() && !args.force {
        anyhow::bail!(
            "{} already exists\nhint: pass --force to replace it, or --output another path",
            args.output.display()
        );
    }
    if let Some(parent) = args.output.parent().filter(|p| !p.as_os_str().is_empty())
        && !parent.is_dir()
    {
        anyhow::bail!(
            "--output {}: directory {} does not exist\nhint: create it first, or write the config elsewhere",
            args.output.display(),
            parent.display()
        );
    }
    // Replacing a config must not leave its throwaway target running with
    // nothing that names it.
    if args.output.exists()
        && let Ok(old) = config::load(&args.output)
        && let Some(dir) = old
            .flows
            .iter()
            .find_map(|f| f.throwaway().filter(|d| d.exists()))
    {
        anyhow::bail!(
            "{} names the throwaway target {}, which --force would leave behind\nhint: remove it first with `trellara teardown --config {} --yes`",
            args.output.display(),
            dir.display(),
            args.output.display()
        );
    }
    let reference = |inline: &str, var: &str| {
        if args.evaluate {
            SecretRef {
                url: Some(inline.to_owned()),
                ..SecretRef::default()
            }
        } else {
            SecretRef {
                url_env: Some(var.to_owned()),
                ..SecretRef::default()
            }
        }
    };
    let stem = args
        .output
        .file_stem()
        .map_or("trellara".into(), |s| s.to_string_lossy().into_owned());
    // Without a target URL, --evaluate replicates into a throwaway local
    // cluster made below (crate::throwaway).
    let throwaway = match (&args.target_database_url, args.evaluate) {
        (Some(_), _) => None,
        (None, true) => Some(crate::throwaway::default_dir(&stem, &args.flow)),
        (None, false) => anyhow::bail!(
            "--target-database-url is required\nhint: the verified flow replicates into a Postgres target; with --evaluate and no target URL, trellara makes a throwaway local one"
        ),
    };
    let mut config = Config {
        schema_version: config::SCHEMA_VERSION,
        environment: if args.evaluate {
            Environment::Evaluation
        } else {
            Environment::Production
        },
        service: config::ServiceConfig::default(),
        flows: vec![Flow {
            name: args.flow.clone(),
            source: Source {
                url: reference(&args.source_database_url, "TRELLARA_SOURCE_DATABASE_URL"),
                source_id: None,
                slot: None,
                publication: None,
            },
            target: Some(Target {
                url: match &args.target_database_url {
                    Some(url) => reference(url, "TRELLARA_TARGET_DATABASE_URL"),
                    None => SecretRef::default(),
                },
                throwaway: throwaway.clone(),
            }),
            sinks: Vec::new(),
            tables: args.tables.clone(),
            capture: match args.capture {
                CaptureArg::External => CapturePath::External,
                CaptureArg::Native => CapturePath::Native,
            },
            // Each config's flow its own log, so two configs written in
            // one directory never share one.
            transport: Transport::Local {
                log_dir: PathBuf::from(format!("./.trellara/{stem}/{}/log", args.flow)),
                retention_mib: config::DEFAULT_RETENTION_MIB,
            },
            schema: config::SchemaPolicy::default(),
        }],
    };
    let issues = config::validate(&config);
    if !issues.is_empty() {
        let list: Vec<String> = issues.iter().map(|i| format!("  {i}")).collect();
        anyhow::bail!("the config would be invalid:\n{}", list.join("\n"));
    }
    config::canonical_tables(&mut config.flows[0]);
    let yaml = config::to_yaml(&config)?;
    let made = match &throwaway {
        Some(relative) => {
            let base = std::path::absolute(
                args.output
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(std::path::Path::new(".")),
            )
            .context("resolve the config's directory")?;
            let dir = base.join(relative.strip_prefix("./").unwrap_or(relative));
            make_throwaway(&dir, &base, &args.source_database_url, &config.flows[0])?;
            Some(dir)
        }
        None => None,
    };
    // It may hold inline URLs with passwords: owner-only.
    if let Err(e) = trellara_common::owner_only::write(
        &args.output,
        format!("# trellara.yml, schema v2: see docs/CONFIG.md\n{yaml}").as_bytes(),
    ) {
        if let Some(dir) = &made {
            let _ = crate::throwaway::remove(dir, &config.flows[0].name);
        }
        return Err(anyhow::Error::new(e).context(format!("write {}", args.output.display())));
    }
    if let Some(dir) = &made {
        outln!(
            "throwaway target: PostgreSQL cluster in {} (its own Unix socket only); teardown stops and removes it",
            dir.display()
        );
    }
    outln!(
        "wrote {} (flow {}, {} table(s))",
        args.output.display(),
        args.flow,
        args.tables.len()
    );
    if !args.evaluate {
        outln!(
            "export TRELLARA_SOURCE_DATABASE_URL and TRELLARA_TARGET_DATABASE_URL before `trellara run`"
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The throwaway target of `init --evaluate`: a cluster of the source's
/// major in `dir`, holding the flow's table definitions. Reads the source
/// only; on any failure nothing is left behind.
fn make_throwaway(
    dir: &std::path::Path,
    base: &std::path::Path,
    source_url: &str,
    flow: &Flow,
) -> anyhow::Result<()> {
    let rt = runtime()?;
    let (major, collate, ctype) = rt.block_on(async {
        let source = flow::connect(source_url, "source").await?;
        let row = source
            .query_one(
                "SELECT current_setting('server_version_num'), datcollate::text, datctype::text
                 FROM pg_database WHERE datname = current_database()",
                &[],
            )
            .await
            .context("read the source's version and locale")?;
        let version: String = row.get(0);
        anyhow::Ok((
            version.parse::<u32>().context("server_version_num")? / 10000,
            row.get::<_, String>(1),
            row.get::<_, String>(2),
        ))
    })?;
    crate::throwaway::create(dir, base, major, Some((&collate, &ctype)), &flow.name)?;
    let copied = rt.block_on(async {
        let source = flow::connect(source_url, "source").await?;
        let target = flow::connect(&crate::throwaway::url(dir), "target").await?;
        anyhow::Ok(crate::throwaway::copy_tables(&source, &target, &flow.tables).await?)
    });
    if let Err(e) = copied {
        let _ = crate::throwaway::remove(dir, &flow.name);
        return Err(e.context("make the throwaway target (removed again)"));
    }
    Ok(())
}

pub fn check(args: CheckArgs) -> anyhow::Result<ExitCode> {
    let Some(path) = args.config else {
        let Some(url) = args
            .database_url
            .or_else(|| std::env::var(SOURCE_URL_ENV).ok().filter(|u| !u.is_empty()))
        else {
            anyhow::bail!(
                "pass --config trellara.yml to validate a config offline, or --database-url URL (or {SOURCE_URL_ENV}) to grade a source"
            );
        };
        let request = trellara_check::Request {
            tables: args.tables,
            sample: Duration::from_secs(args.sample_seconds),
        };
        return grade(&url, &request, &args.format);
    };
    if args.format == "html" {
        anyhow::bail!(
            "--format html is the grader's report (with --database-url); a config check prints text or json"
        );
    }
    let format = if args.format == "json" {
        Format::Json
    } else {
        Format::Text
    };
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "read {}\nhint: create one with `trellara init ... --evaluate`",
            path.display()
        )
    })?;
    let issues = match config::parse(&text) {
        Ok(config) => config::located(&text, config::validate(&config)),
        Err(message) => vec![config::parse_issue(&text, &message)],
    };
    match format {
        Format::Json => outln!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"config": path.display().to_string(), "valid": issues.is_empty(), "issues": issues})
            )?
        ),
        Format::Text => {
            if issues.is_empty() {
                outln!("{}: valid (schema v2)", path.display());
            }
            for i in &issues {
                outln!("{i}");
            }
        }
    }
    Ok(if issues.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The read-only grader: exit 0 ready, 3 blocked, 2 could not assess.
fn grade(url: &str, request: &trellara_check::Request, format: &str) -> anyhow::Result<ExitCode> {
    let mut options: trellara_check::ConnectOptions = match url.parse() {
        Ok(o) => o,
        Err(e) => {
            errln!("error: --database-url: {e}");
            return Ok(ExitCode::from(EXIT_ERROR));
        }
    };
    options.replication = false;
    options.application_name = "trellara-check".into();
    match runtime()?.block_on(trellara_check::assess(&options, request)) {
        Ok(report) => {
            let out = match format {
                "json" => trellara_check::render_json(&report),
                "html" => trellara_check::render_html(&report),
                _ => trellara_check::render_text(&report),
            };
            out!("{out}");
            Ok(ExitCode::from(report.exit_code() as u8))
        }
        Err(err) => {
            errln!("error: {}", crate::errors::chain_of(&err));
            Ok(ExitCode::from(err.exit_code() as u8))
        }
    }
}

pub(super) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
}

pub(super) fn flows<'a>(
    config: &'a Config,
    only: Option<&str>,
) -> anyhow::Result<Vec<(usize, &'a Flow)>> {
    let selected: Vec<_> = config
        .flows
        .iter()
        .enumerate()
        .filter(|(_, f)| only.is_none_or(|o| f.name == o))
        .collect();
    if selected.is_empty() {
        let names: Vec<&str> = config.flows.iter().map(|f| f.name.as_str()).collect();
        anyhow::bail!(
            "no flow named {:?} in the config\nhint: --flow takes one of: {}",
            only.unwrap_or(""),
            names.join(", ")
        );
    }
    Ok(selected)
}

/// A service's endpoints: `run --follow` plays both roles in one process
/// and serves one set, on the relay's address, covering capture and
/// apply; `relay` and `apply` each serve their own role's. Bound before
/// anything connects, so a taken port refuses the run untouched.
async fn serve_endpoints(
    config: &Config,
    config_path: &str,
    flow: &Flow,
    role: Role,
    hangup: tokio::signal::unix::Signal,
    progress: &mut dyn FnMut(&str),
) -> anyhow::Result<crate::service::Observer> {
    use crate::service::{Endpoints, Health, LiveSettings, Observer};
    let metrics = crate::metrics::Metrics::new();
    let health = Health::new(
        role.service(),
        std::time::Duration::from_secs(config.service.ready_max_lag_seconds),
    );
    // The capture series and the first sink's carry the first sink's name.
    let dataset = flow.first_sink().map_or(flow.name.as_str(), |s| s.name);
    let observe = Observer {
        metrics: metrics.flow(role, &flow.source_id(), dataset),
        health: health.flow(&flow.name, &flow.source_id(), dataset),
        live: LiveSettings::new(flow.retention_bytes()),
        registry: metrics.clone(),
    };
    if let Some(level) = &config.service.log_level
        && let Err(why) = super::set_log_level(Some(level))
    {
        progress(&format!("service: service.log_level not applied: {why}"));
    }
    let addr = role.listen(&config.service);
    let endpoints = Endpoints::bind(addr, metrics.clone(), Arc::clone(&health)).await?;
    let bound = endpoints.local_addr();
    progress(&format!(
        "service: serving http://{bound}/livez /readyz /healthz /metrics"
    ));
    let service = Service {
        role,
        metrics,
        health,
        live: Arc::clone(&observe.live),
        listen: addr,
        serving: tokio::spawn(endpoints.serve()),
    };
    tokio::spawn(reload_on_hangup(
        hangup,
        config_path.to_owned(),
        config.clone(),
        flow.name.clone(),
        service,
    ));
    Ok(observe)
}

/// What a reload may change in a running service.
struct Service {
    role: Role,
    metrics: crate::metrics::Metrics,
    health: Arc<crate::service::Health>,
    live: Arc<crate::service::LiveSettings>,
    /// The configured address (port 0 stays 0: a reload to the same
    /// config does not move the endpoints).
    listen: std::net::SocketAddr,
    serving: tokio::task::JoinHandle<()>,
}

/// A service process before it serves: the SIGHUP handler is installed
/// first of all, so a SIGHUP sent while the config loads or a database
/// connects is caught (and read after), not the default end.
pub(super) struct Prepared {
    pub rt: tokio::runtime::Runtime,
    hangup: tokio::signal::unix::Signal,
    pub config: Config,
    pub index: usize,
    config_path: String,
}

impl Prepared {
    /// The runtime, the handler and the one flow selected.
    pub fn new(config_path: &std::path::Path, flow: Option<&str>) -> anyhow::Result<Self> {
        // Two workers: a topic read blocks its thread for a moment, and
        // the endpoints answer meanwhile.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("start the async runtime")?;
        let hangup = {
            let _runtime = rt.enter();
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .context("listen for SIGHUP")?
        };
        let config = config::load(config_path)?;
        let selected = flows(&config, flow)?;
        let [(index, _)] = selected.as_slice() else {
            anyhow::bail!(
                "{}: {} flows; a service runs one flow per process\nhint: pass --flow NAME (one process per flow)",
                config_path.display(),
                selected.len()
            );
        };
        let index = *index;
        Ok(Prepared {
            rt,
            hangup,
            config,
            index,
            config_path: config_path.display().to_string(),
        })
    }

    /// Plays `role` of the flow until SIGTERM or Ctrl-C, serving its
    /// endpoints; what it did is said at the end.
    pub fn serve(self, role: Role) -> anyhow::Result<ExitCode> {
        let Prepared {
            rt,
            hangup,
            config,
            index,
            config_path,
        } = self;
        let flow = &config.flows[index];
        flow::check_split(flow, role)?;
        let mut progress = |line: &str| errln!("[{}] {line}", flow.name);
        let observe = rt.block_on(serve_endpoints(
            &config,
            &config_path,
            flow,
            role,
            hangup,
            &mut progress,
        ))?;
        rt.block_on(async {
            let job = flow::Job::service(index, &config_path, role, observe);
            flow::run(flow, job, &mut progress).await
        })
        .with_context(|| format!("flow {}", flow.name))?;
        Ok(ExitCode::SUCCESS)
    }
}

#[derive(Debug, clap::Args)]
pub struct ApplyArgs {
    /// The config file; the flow must have one sink (`target:`).
    #[arg(long)]
    config: PathBuf,
    /// The flow in --config (default: the only one).
    #[arg(long)]
    flow: Option<String>,
}

/// `trellara apply --config`: the apply role of a flow of one sink, a service.
pub fn apply(args: ApplyArgs) -> anyhow::Result<ExitCode> {
    Prepared::new(&args.config, args.flow.as_deref())?.serve(Role::Apply)
}

/// SIGHUP re-reads the config. One that fails to load or validate, or
/// that no longer has this flow, is refused and the running one stays;
/// a SIGHUP never stops the process. Of a valid one, the fields of
/// docs/CONFIG.md's reload table apply at once; every other changed field
/// is named as applying at the next start.
async fn reload_on_hangup(
    mut hangup: tokio::signal::unix::Signal,
    config_path: String,
    mut running: Config,
    flow: String,
    mut service: Service,
) {
    while hangup.recv().await.is_some() {
        let prefix = format!("[{flow}] reload");
        let loaded = match config::load(std::path::Path::new(&config_path)) {
            Ok(loaded) => loaded,
            Err(e) => {
                errln!(
                    "{prefix}: refused, the running config stays: {}",
                    super::chain(&anyhow::Error::new(e))
                );
                continue;
            }
        };
        let Some(new_flow) = loaded.flows.iter().find(|f| f.name == flow) else {
            errln!(
                "{prefix}: refused, the running config stays: {config_path} has no flow named {flow:?}\nhint: stop this process with SIGTERM to end the flow, or `trellara teardown` to remove it"
            );
            continue;
        };
        for line in apply_live(&mut running, &loaded, new_flow, &mut service).await {
            errln!("{prefix}: {line}");
        }
        let changed = changed_fields(&running, &loaded, new_flow, &flow);
        for field in &changed {
            errln!("{prefix}: {}", restart_field(field, &flow, &config_path));
        }
        if changed.is_empty() {
            errln!("{prefix}: config valid; nothing else changed");
        }
    }
}

/// What a reload says of a changed field that does not apply live. The
/// fields that say where the flow streams from and into (source, slot,
/// publication, target, capture path, transport) are refused outright:
/// changing them is a new flow, which a restart checks as a first run.
fn restart_field(field: &str, flow: &str, config_path: &str) -> String {
    let identity = ["source", "target", "sinks", "capture", "transport"]
        .iter()
        .any(|f| field.starts_with(&format!("flows[{flow}].{f}")));
    if identity {
        format!(
            "{field} changed: refused, the flow keeps running as it was; where a running flow streams from and into (source URL, slot, publication, target or sinks, capture path, transport) never changes live\nhint: to move the flow, end it (`trellara teardown --config {config_path}`, with the config it runs) and start the new one, checked first with `trellara preflight`; a restart with only this field changed meets the flow's own checks and stops with what to do"
        )
    } else {
        format!(
            "{field} changed: refused live, the flow keeps running with its old value; it applies when the flow starts again"
        )
    }
}

/// Applies what reloads live, and makes it part of `running`, so only
/// the rest is compared as waiting for a restart; one line per field.
async fn apply_live(
    running: &mut Config,
    loaded: &Config,
    new_flow: &Flow,
    service: &mut Service,
) -> Vec<String> {
    let mut lines = Vec::new();
    let (old, new) = (running.service.clone(), &loaded.service);
    if new.ready_max_lag_seconds != old.ready_max_lag_seconds {
        service
            .health
            .set_max_lag(Duration::from_secs(new.ready_max_lag_seconds));
        lines.push(format!(
            "service.ready_max_lag_seconds is now {} (applied live)",
            new.ready_max_lag_seconds
        ));
        running.service.ready_max_lag_seconds = new.ready_max_lag_seconds;
    }
    if new.log_level != old.log_level {
        // Removed: the filter the process started with (-v).
        match super::set_log_level(new.log_level.as_deref()) {
            Ok(level) => lines.push(format!("service.log_level is now {level} (applied live)")),
            Err(why) => lines.push(format!("service.log_level not applied: {why}")),
        }
        // Either way nothing waits for a restart: RUST_LOG would win then too.
        running.service.log_level.clone_from(&new.log_level);
    }
    let (role, field) = (service.role, service.role.listen_field());
    let listen = role.listen(new);
    if listen != service.listen {
        // The new address first: if it cannot be bound, the old one serves on.
        match crate::service::Endpoints::bind(
            listen,
            service.metrics.clone(),
            Arc::clone(&service.health),
        )
        .await
        {
            Ok(endpoints) => {
                let bound = endpoints.local_addr();
                // The old listener is closed before this says so.
                service.serving.abort();
                let _ = (&mut service.serving).await;
                service.serving = tokio::spawn(endpoints.serve());
                service.listen = listen;
                *role.listen_mut(&mut running.service) = listen;
                lines.push(format!(
                    "{field} is now {listen} (applied live): serving http://{bound}/livez /readyz /healthz /metrics"
                ));
            }
            Err(e) => lines.push(format!(
                "{field} not applied, still serving on {}: {}",
                service.listen,
                crate::errors::chain_of(&e)
            )),
        }
    }
    let as_set = |tables: &[String]| {
        tables
            .iter()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>()
    };
    // Only reordered: nothing to copy or let go of.
    if let Some(flow) = running.flows.iter_mut().find(|f| f.name == new_flow.name)
        && as_set(&flow.tables) == as_set(&new_flow.tables)
    {
        flow.tables.clone_from(&new_flow.tables);
    }
    if let Some(flow) = running.flows.iter_mut().find(|f| f.name == new_flow.name)
        && as_set(&flow.tables) != as_set(&new_flow.tables)
    {
        let joined: Vec<&String> = new_flow
            .tables
            .iter()
            .filter(|t| !flow.tables.contains(t))
            .collect();
        let left: Vec<&String> = flow
            .tables
            .iter()
            .filter(|t| !new_flow.tables.contains(t))
            .collect();
        let what = [("joining", &joined), ("leaving", &left)]
            .iter()
            .filter(|(_, t)| !t.is_empty())
            .map(|(how, t)| {
                format!(
                    "{how} {}",
                    t.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ")
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        if role.captures() {
            service.live.set_tables(new_flow.tables.clone());
            lines.push(format!(
                "flows[{}].tables changed ({what}); applied live: the next round passes the first run's checks, copies what joins at a boundary of its own and lets go of what leaves",
                new_flow.name
            ));
        } else {
            lines.push(format!(
                "flows[{}].tables changed ({what}); the relay service applies it (reload it too), and this applier follows",
                new_flow.name
            ));
        }
        flow.tables.clone_from(&new_flow.tables);
    }
    let retention = new_flow.retention_bytes();
    if let Some(flow) = running.flows.iter_mut().find(|f| f.name == new_flow.name)
        && flow.retention_bytes() != retention
        && let Some(mib) = retention_mib(&mut flow.transport)
        && let Some(new_mib) = retention.map(|b| b >> 20)
    {
        service.live.set_retention(retention);
        *mib = new_mib;
        lines.push(format!(
            "flows[{}].transport.retention_mib is now {new_mib} (applied live, at the next retention pass)",
            new_flow.name
        ));
    }
    lines
}

fn retention_mib(transport: &mut config::Transport) -> Option<&mut u64> {
    match transport {
        config::Transport::Local { retention_mib, .. }
        | config::Transport::Kafka { retention_mib, .. } => Some(retention_mib),
    }
}

/// The fields of the flow and the service section that differ, by path
/// (what [`apply_live`] applied is already in `running`).
fn changed_fields(running: &Config, loaded: &Config, new_flow: &Flow, flow: &str) -> Vec<String> {
    let as_map = |v: serde_json::Value| match v {
        serde_json::Value::Object(map) => map,
        _ => serde_json::Map::new(),
    };
    let mut changed = Vec::new();
    // Objects are compared field by field, so a message names the one
    // that changed (flows[shop].source.slot, not flows[shop].source).
    fn compare(
        changed: &mut Vec<String>,
        prefix: &str,
        old: &serde_json::Map<String, serde_json::Value>,
        new: &serde_json::Map<String, serde_json::Value>,
    ) {
        let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
        for key in keys {
            match (old.get(key), new.get(key)) {
                (Some(serde_json::Value::Object(a)), Some(serde_json::Value::Object(b))) => {
                    compare(changed, &format!("{prefix}{key}."), a, b);
                }
                (a, b) if a != b => changed.push(format!("{prefix}{key}")),
                _ => {}
            }
        }
    }
    let mut compare = |prefix: &str, old: serde_json::Value, new: serde_json::Value| {
        compare(&mut changed, prefix, &as_map(old), &as_map(new));
    };
    let old_flow = running.flows.iter().find(|f| f.name == flow);
    compare(
        &format!("flows[{flow}]."),
        serde_json::to_value(old_flow).unwrap_or_default(),
        serde_json::to_value(new_flow).unwrap_or_default(),
    );
    compare(
        "service.",
        serde_json::to_value(&running.service).unwrap_or_default(),
        serde_json::to_value(&loaded.service).unwrap_or_default(),
    );
    if running.environment != loaded.environment {
        changed.push("environment".into());
    }
    changed
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let rt = runtime()?;
    // First of all, so a SIGHUP sent while the config loads or a database
    // connects is caught (and read after), not the default end.
    let mut hangup = if args.follow {
        let _runtime = rt.enter();
        Some(
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .context("listen for SIGHUP")?,
        )
    } else {
        None
    };
    let config = config::load(&args.config)?;
    let config_path = args.config.display().to_string();
    let text = args.format == Format::Text;
    let mut reports = Vec::new();
    let mut failed: Vec<anyhow::Error> = Vec::new();
    let selected = flows(&config, args.flow.as_deref())?;
    if args.follow && selected.len() > 1 {
        anyhow::bail!(
            "--follow runs one flow per process\nhint: pass --flow NAME (one process per flow)"
        );
    }
    for (index, f) in selected {
        let mut progress = |line: &str| {
            if text {
                outln!("[{}] {line}", f.name);
            } else {
                errln!("[{}] {line}", f.name);
            }
        };
        // A flow that stops (a quarantined transaction, an unreachable
        // database) does not hold the others back.
        let round = if let Some(hangup) = hangup.take() {
            let observe = rt.block_on(serve_endpoints(
                &config,
                &config_path,
                f,
                Role::Both,
                hangup,
                &mut progress,
            ))?;
            rt.block_on(async {
                let job = flow::Job::service(index, &config_path, Role::Both, observe);
                flow::run(f, job, &mut progress).await
            })
        } else {
            let job = flow::Job::new(index, &config_path, flow::Mode::Once);
            rt.block_on(flow::run(f, job, &mut progress))
        };
        match round {
            Ok(report) => reports.push(report),
            // A signal stops the process, not only this flow.
            Err(e @ flow::FlowError::Snapshot(crate::snapshot::SnapshotError::Stopped)) => {
                failed.push(anyhow::Error::new(e).context(format!("flow {}", f.name)));
                break;
            }
            Err(e) => failed.push(anyhow::Error::new(e).context(format!("flow {}", f.name))),
        }
    }
    if !failed.is_empty() {
        // The exit status speaks for the worst: 3 (refused, nothing
        // changed) only when every failed flow was refused.
        let worst = failed
            .iter()
            .position(|e| super::exit_status(e, 1) != super::EXIT_BLOCKED)
            .unwrap_or(failed.len() - 1);
        let returned = failed.remove(worst);
        for e in &failed {
            errln!("error: {}", super::chain(e));
        }
        return Err(returned);
    }
    if args.format == Format::Json && !args.verify {
        let out: Vec<_> = reports.iter().map(run_json).collect();
        outln!("{}", serde_json::to_string_pretty(&out)?);
    }
    if args.verify {
        return could_not_verify(|| {
            verify_flows(
                &config,
                &config_path,
                Only {
                    flow: args.flow.as_deref(),
                    sink: None,
                    table: None,
                },
                args.format,
                (verify::CHUNK_ROWS, crate::fence::DEFAULT_TIMEOUT),
                &rt,
            )
        });
    }
    Ok(ExitCode::SUCCESS)
}

use std::time::Duration;
fn run_json(r: &flow::RunReport) -> serde_json::Value {
    json!({
        "flow": r.flow,
        "snapshot": r.snapshot.as_ref().map(|s| json!({
            "consistent_lsn": s.consistent_lsn.to_string(),
            "tables": s.tables.iter().map(|(t, n)| json!({"table": t, "rows": n})).collect::<Vec<_>>(),
        })),
        "envelopes_captured": r.envelopes_captured,
        "transactions_applied": r.apply.transactions,
        "rows_applied": r.apply.rows,
        "duplicates_skipped": r.apply.duplicates_skipped + r.capture_duplicates_skipped,
        "caught_up_to": r.caught_up_to.map(|l| l.to_string()),
        "sinks": r.sinks.iter().map(|s| json!({
            "sink": s.sink,
            "transactions_applied": s.applied.transactions,
            "rows_applied": s.applied.rows,
            "duplicates_skipped": s.applied.duplicates_skipped,
            "copied_at": s.seeded.iter().map(|c| c.consistent_lsn.to_string()).collect::<Vec<_>>(),
            "error": s.error.as_ref().map(|e| crate::errors::chain_of(e)),
        })).collect::<Vec<_>>(),
    })
}

pub fn verify(args: VerifyArgs) -> anyhow::Result<ExitCode> {
    could_not_verify(|| {
        let config = config::load(&args.config)?;
        // The config's tables are in display form; so is the one asked for.
        let table = args.table.as_deref().map(table_arg).transpose()?;
        let rt = runtime()?;
        verify_flows(
            &config,
            &args.config.display().to_string(),
            Only {
                flow: args.flow.as_deref(),
                sink: args.sink.as_deref(),
                table: table.as_deref(),
            },
            args.format,
            (
                args.chunk_rows,
                std::time::Duration::from_secs(args.fence_timeout),
            ),
            &rt,
        )
    })
}

/// `--table` naming a table that no selected flow replicates.
fn no_flow_replicates(config: &Config, only_flow: Option<&str>, table: &str) -> anyhow::Error {
    let tables: Vec<&str> = config
        .flows
        .iter()
        .filter(|f| only_flow.is_none_or(|o| f.name == o))
        .flat_map(|f| f.tables.iter().map(String::as_str))
        .collect();
    anyhow::anyhow!(
        "no flow replicates table {table:?}\nhint: --table takes schema.table as SQL spells it (unquoted names fold to lower case); the config lists {}",
        tables.join(", ")
    )
}

/// A verify that fails exits 2 (could not verify), never 1: a failed check
/// is no divergence.
fn could_not_verify(check: impl FnOnce() -> anyhow::Result<ExitCode>) -> anyhow::Result<ExitCode> {
    match check() {
        Ok(code) => Ok(code),
        Err(err) => {
            errln!("error: {}", super::chain(&err));
            Ok(ExitCode::from(super::exit_status(&err, EXIT_ERROR)))
        }
    }
}

/// How many fences a verify takes when a DDL lands between one and its
/// comparison each time.
const SCHEMA_MOVED_TRIES: u32 = 3;

/// What a verify compares: every flow, sink and table unless named.
#[derive(Debug, Clone, Copy)]
struct Only<'a> {
    flow: Option<&'a str>,
    sink: Option<&'a str>,
    table: Option<&'a str>,
}

fn verify_flows(
    config: &Config,
    config_path: &str,
    only: Only<'_>,
    format: Format,
    (chunk_rows, fence_timeout): (u64, std::time::Duration),
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<ExitCode> {
    let Only {
        flow: only_flow,
        sink: only_sink,
        table,
    } = only;
    let mut verdicts = Vec::new();
    for (index, f) in with_sink(config, only_flow, only_sink)? {
        if let Some(t) = table
            && !f.tables.iter().any(|x| x == t)
        {
            continue;
        }
        for sink in chosen_sinks(f, only_sink)? {
            let verdict = rt
                .block_on(async {
                    let source_url = f.source.url.resolve(&format!("flows[{index}].source"))?;
                    let target_url = flow::sink_url(f, index, sink)?;
                    let source = flow::connect(&source_url, "source").await?;
                    let target = flow::connect(&target_url, "target").await?;
                    flow::refuse_same_database(&source, &target, config_path).await?;
                    crate::state::ensure(&target).await?;
                    // A DDL between a fence and the comparison: a new
                    // fence, a few times, then the error.
                    let mut tries = 1;
                    loop {
                        match verify::verify(
                            f,
                            (
                                sink.name,
                                Some(verify::Following {
                                    source_url: &source_url,
                                    timeout: fence_timeout,
                                }),
                            ),
                            &source,
                            &target,
                            table,
                            config_path,
                            chunk_rows,
                        )
                        .await
                        {
                            Err(e @ verify::VerifyError::SchemaMoved { .. })
                                if tries < SCHEMA_MOVED_TRIES =>
                            {
                                errln!("verify: {}; verifying again", crate::errors::chain_of(&e));
                                tries += 1;
                            }
                            verdict => return anyhow::Ok(verdict?),
                        }
                    }
                })
                .with_context(|| match sink.position {
                    Some(_) => format!("verify flow {} sink {}", f.name, sink.name),
                    None => format!("verify flow {}", f.name),
                })?;
            verdicts.push(verdict);
        }
    }
    if verdicts.is_empty() {
        return Err(no_flow_replicates(config, only_flow, table.unwrap_or("")));
    }
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&verdicts)?),
        Format::Text => {
            for v in &verdicts {
                out!("{}", verify::render_text(v));
            }
        }
    }
    Ok(if verdicts.iter().all(verify::Verdict::converged) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_DIVERGED)
    })
}

pub fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let rt = runtime()?;
    let mut out = Vec::new();
    let path = args.config.display().to_string();
    for (index, f) in flows(&config, args.flow.as_deref())? {
        // Read before urls() starts it: whether it was up is news.
        let throwaway = match f.throwaway() {
            Some(dir) => Some(json!({
                "dir": dir.display().to_string(),
                "was_running": crate::throwaway::running(dir, &f.name)?,
            })),
            None => None,
        };
        let value = rt
            .block_on(flow_status(f, index, args.view, &path, throwaway))
            .with_context(|| format!("status flow {}", f.name))?;
        out.push(value);
    }
    match args.format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&out)?),
        Format::Text => {
            for v in &out {
                print_status(&path, v);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One flow's status, from the target's state tables, the slot and (with
/// diagnostics) the log.
async fn flow_status(
    f: &config::Flow,
    index: usize,
    view: View,
    path: &str,
    throwaway: Option<serde_json::Value>,
) -> anyhow::Result<serde_json::Value> {
    let (source_url, target_url) = flow::urls(f, index)?;
    let target = flow::connect(&target_url, "target").await?;
    if !crate::state::present(&target).await? {
        let mut v = json!({
            "flow": f.name,
            "never_ran": true,
            "next": [format!("trellara preflight --config {path}"), format!("trellara run --config {path} --flow {} --local --verify", f.name)],
        });
        if let Some(t) = throwaway {
            v["throwaway_target"] = t;
        }
        return Ok(v);
    }
    let checkpoint = crate::state::checkpoint::read(&target, &f.name).await?;
    let snapshot = crate::state::runs::row(&target, &f.name).await?;
    let quarantine = crate::state::quarantine::open(&target, &f.name).await?;
    let last_verify = crate::state::verdicts::last(&target, &f.name).await?;
    let mut v = json!({
        "flow": f.name,
        "tables": tables_json(&target, &f.name).await?,
        "checkpoint": checkpoint.map(|c| json!({"commit_lsn": c.commit_lsn.to_string(), "end_lsn": c.end_lsn.to_string(), "transactions": c.transactions, "duplicates_skipped": c.duplicates_skipped, "updated_at": c.updated_at})),
        "snapshot": snapshot.map(|s| json!({"state": s.run.state.as_str(), "consistent_lsn": s.run.consistent_lsn.map(|l| l.to_string()), "run_id": s.run.run_id, "reason": s.reason})),
        "quarantined": quarantine.iter().map(|q| json!({"commit_lsn": q.commit_lsn, "xid": q.xid, "reason": q.reason, "recovery": q.recovery, "attempts": q.attempts})).collect::<Vec<_>>(),
        "last_verify": last_verify.map(|(verdict, at)| json!({"verdict": verdict, "at": at})),
        "never_ran": false,
    });
    if let Some(t) = throwaway {
        v["throwaway_target"] = t;
    }
    if let Some(stop) = crate::state::stop(&target, &f.name).await? {
        v["stopped"] = serde_json::to_value(stop)?;
    }
    v["slot"] = slot_state(f, &source_url).await;
    let others: Vec<_> = f.sinks().into_iter().skip(1).collect();
    if !others.is_empty() {
        let mut sinks = Vec::new();
        for sink in others {
            sinks.push(sink_status(f, index, sink).await);
        }
        v["sinks"] = serde_json::Value::Array(sinks);
    }
    if matches!(view, View::Diagnostics)
        && let Some(dir) = f.log_dir()
        && dir.exists()
    {
        v["log"] = log_status(dir)?;
    }
    Ok(v)
}

/// The flow's copied tables as status shows them; state and boundary_lsn
/// null: the table's are the run's. None from the state tables of an
/// older build, which status leaves as they are.
async fn tables_json(
    target: &tokio_postgres::Client,
    flow: &str,
) -> anyhow::Result<serde_json::Value> {
    if !crate::state::current(target).await? {
        return Ok(serde_json::Value::Null);
    }
    let tables = crate::state::runs::tables(target, flow).await?;
    Ok(tables
        .iter()
        .map(|t| json!({"table": t.name, "rows_copied": t.rows_copied, "copied_at": t.copied_at, "boundary_lsn": t.boundary.map(|b| b.to_string()), "state": t.state.map(|s| s.as_str())}))
        .collect())
}

/// Each table at a boundary of its own, the one line status gives it.
fn print_tables(v: &serde_json::Value, indent: &str) {
    for t in v["tables"].as_array().into_iter().flatten() {
        if let Some(state) = t["state"].as_str() {
            outln!(
                "{indent}table       {} {state}, copied at its own boundary {} ({} rows, {})",
                t["table"].as_str().unwrap_or(""),
                t["boundary_lsn"].as_str().unwrap_or("-"),
                t["rows_copied"],
                t["copied_at"].as_str().unwrap_or("")
            );
        }
    }
}

/// One sink after the first: its target's state, and whether its log
/// cursor is there (a missing one is copied again at a boundary of its
/// own when the flow runs next). An unreachable target is reported, not
/// an error: the flow's other sinks go on without it.
async fn sink_status(
    f: &config::Flow,
    index: usize,
    sink: config::SinkRef<'_>,
) -> serde_json::Value {
    // The cursor file alone: a running flow holds the log's lock.
    let cursor = crate::apply::sink_cursor(&f.name, sink.name);
    let held = f
        .log_dir()
        .map(|d| d.join("cursors").join(format!("{cursor}.cursor")).exists());
    let mut v = json!({
        "sink": sink.name,
        "cursor": cursor,
        "needs_copy": held == Some(false),
    });
    let state = async {
        let target = flow::connect(&flow::sink_url(f, index, sink)?, "target").await?;
        if !crate::state::present(&target).await? {
            return anyhow::Ok(json!({"never_ran": true}));
        }
        let checkpoint = crate::state::checkpoint::read(&target, &f.name).await?;
        let snapshot = crate::state::runs::row(&target, &f.name).await?;
        let quarantined = crate::state::quarantine::open(&target, &f.name)
            .await?
            .len();
        let last_verify = crate::state::verdicts::last(&target, &f.name).await?;
        Ok(json!({
            "never_ran": false,
            "tables": tables_json(&target, &f.name).await?,
            "snapshot": snapshot.map(|s| json!({"state": s.run.state.as_str(), "consistent_lsn": s.run.consistent_lsn.map(|l| l.to_string())})),
            "checkpoint": checkpoint.map(|c| json!({"commit_lsn": c.commit_lsn.to_string(), "transactions": c.transactions, "duplicates_skipped": c.duplicates_skipped})),
            "quarantined": quarantined,
            "last_verify": last_verify.map(|(verdict, at)| json!({"verdict": verdict, "at": at})),
        }))
    };
    match state.await {
        Ok(found) => {
            if let (Some(v), Some(found)) = (v.as_object_mut(), found.as_object()) {
                v.extend(found.clone());
            }
        }
        Err(e) => v["error"] = json!(super::chain(&e)),
    }
    v
}

/// The log's offsets, cursors and retention pressure; only `in_use` while
/// a running process holds it.
fn log_status(dir: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    let Some(_lock) = crate::lock::try_lock(dir)? else {
        return Ok(json!({"dir": dir.display().to_string(), "in_use": true}));
    };
    let (log, _) = crate::log::Log::open(
        crate::log::storage::FsStorage::new(),
        dir,
        crate::log::LogConfig::default(),
    )?;
    Ok(json!({
        "dir": dir.display().to_string(),
        "next_offset": log.next_offset(),
        "cursors": log.cursors().iter().map(|(n, p)| json!({"consumer": n, "next_offset": p.next_offset})).collect::<Vec<_>>(),
        "retention_pressure": log.retention_pressure().iter().map(|p| json!({"consumer": p.consumer, "held_bytes": p.held_bytes})).collect::<Vec<_>>(),
    }))
}

/// `status --format text` of one flow.
/// One line for a sink after the first.
fn print_sink(sink: &serde_json::Value) {
    let name = sink["sink"].as_str().unwrap_or("");
    let line = if let Some(e) = sink["error"].as_str() {
        format!("unreachable: {}", e.lines().next().unwrap_or(""))
    } else if sink["never_ran"] == true {
        "never ran against its target".to_owned()
    } else {
        format!(
            "snapshot {}, applied {} transactions through {}, quarantine {} open, last verify {}",
            sink["snapshot"]["state"].as_str().unwrap_or("none"),
            sink["checkpoint"]["transactions"],
            sink["checkpoint"]["commit_lsn"].as_str().unwrap_or("-"),
            sink["quarantined"],
            sink["last_verify"]["verdict"].as_str().unwrap_or("never")
        )
    };
    outln!("  sink {name:<6} {line}");
    print_tables(sink, "    ");
    if sink["needs_copy"] == true {
        outln!(
            "    needs a copy: its log cursor is gone (a new log, or the sink held the log past transport.retention_mib); the next run copies it at a boundary of its own"
        );
    }
}

fn print_status(config_path: &str, v: &serde_json::Value) {
    outln!("flow {}", v["flow"].as_str().unwrap_or(""));
    if let Some(t) = v.get("throwaway_target").filter(|t| !t.is_null()) {
        outln!(
            "  target      throwaway cluster in {} ({}; teardown removes it)",
            t["dir"].as_str().unwrap_or(""),
            if t["was_running"] == true {
                "running"
            } else {
                "was stopped, started for this command"
            }
        );
    }
    if v["never_ran"] == true {
        outln!(
            "  never ran against this target (no trellara state tables): trellara run --config {} --flow {} --local",
            config_path,
            v["flow"].as_str().unwrap_or("")
        );
        return;
    }
    if let Some(stop) = v.get("stopped") {
        outln!(
            "  STOPPED     {} at {}",
            stop["detail"].as_str().unwrap_or(""),
            stop["stopped_at"].as_str().unwrap_or("")
        );
        for c in stop["commands"].as_array().into_iter().flatten() {
            outln!("    next: {}", c.as_str().unwrap_or(""));
        }
    }
    let slot = &v["slot"];
    outln!(
        "  slot        {} {}",
        slot["name"].as_str().unwrap_or(""),
        slot["state"].as_str().unwrap_or("")
    );
    outln!(
        "  snapshot    {}",
        v["snapshot"]["state"].as_str().unwrap_or("none")
    );
    // Only a table at a boundary of its own has a state apart from the run's.
    print_tables(v, "  ");
    if v["checkpoint"].is_null() {
        outln!("  applied     nothing yet (no checkpoint: the first run has not handed off)");
    } else {
        outln!(
            "  applied     {} transactions through {} ({} duplicates skipped)",
            v["checkpoint"]["transactions"],
            v["checkpoint"]["commit_lsn"].as_str().unwrap_or("-"),
            v["checkpoint"]["duplicates_skipped"]
        );
    }
    outln!(
        "  last verify {}",
        v["last_verify"]["verdict"].as_str().unwrap_or("never")
    );
    let q = v["quarantined"].as_array().map_or(0, Vec::len);
    outln!("  quarantine  {q} open");
    for sink in v["sinks"].as_array().into_iter().flatten() {
        print_sink(sink);
    }
    for item in v["quarantined"].as_array().into_iter().flatten() {
        outln!(
            "    {} {}\n      recovery: {}",
            item["commit_lsn"].as_str().unwrap_or(""),
            item["reason"].as_str().unwrap_or(""),
            item["recovery"].as_str().unwrap_or("")
        );
    }
    if let Some(log) = v.get("log") {
        outln!(
            "  log         {} records; cursors {}",
            log["next_offset"],
            log["cursors"]
        );
    }
}

/// Exit status of preflight: 0 ready, 3 blocked, 2 could not check.
/// The source side is the read-only grader for the flow's tables; the
/// target side checks every table exists with compatible columns.
pub fn preflight(args: PreflightArgs) -> anyhow::Result<ExitCode> {
    let outcome = (|| {
        let config = config::load(&args.config)?;
        let rt = runtime()?;
        let mut findings = Vec::new();
        for (index, f) in flows(&config, None)? {
            let found = rt
                .block_on(async {
                    let (source_url, target_url) = flow::urls(f, index)?;
                    let source = flow::connect(&source_url, "source").await?;
                    let target = flow::connect(&target_url, "target").await?;
                    anyhow::Ok(
                        crate::preflight::assess(
                            f,
                            &source_url,
                            &source,
                            &target,
                            Duration::from_secs(1),
                        )
                        .await?,
                    )
                })
                .with_context(|| format!("preflight flow {}", f.name))?;
            findings.push((f.name.clone(), found));
        }
        anyhow::Ok(findings)
    })();
    let findings = match outcome {
        Ok(f) => f,
        Err(err) => {
            errln!("error: {}", super::chain(&err));
            return Ok(ExitCode::from(EXIT_ERROR));
        }
    };
    let blocked = findings.iter().any(|(_, a)| a.blocked());
    match args.format {
        Format::Json => {
            let flows: Vec<_> = findings
                .iter()
                .map(|(n, a)| {
                    json!({
                        "flow": n,
                        "ready": !a.blocked(),
                        "blockers": a.blockers(),
                        "source": serde_json::from_str::<serde_json::Value>(&trellara_check::render_json(&a.source)).unwrap_or_default(),
                        "target": a.flow,
                    })
                })
                .collect();
            outln!(
                "{}",
                serde_json::to_string_pretty(&json!({"ready": !blocked, "flows": flows}))?
            );
        }
        Format::Text => {
            for (name, a) in &findings {
                outln!("flow {name}: source (read-only grade)");
                for line in trellara_check::render_text(&a.source).lines() {
                    outln!("  {line}");
                }
                if a.has_slot {
                    outln!(
                        "  the flow's slot exists: a full max_replication_slots does not block it"
                    );
                }
                outln!("flow {name}: target and flow");
                for f in &a.flow {
                    outln!(
                        "  {} {:<6} {:<26} {}",
                        if f.ok { "ok  " } else { "FAIL" },
                        f.side,
                        f.check,
                        f.detail
                    );
                    if let Some(a) = &f.action {
                        outln!("       action: {a}");
                    }
                }
            }
            outln!(
                "{} · nothing was created",
                if blocked { "BLOCKED" } else { "READY" }
            );
        }
    }
    Ok(if blocked {
        ExitCode::from(3)
    } else {
        ExitCode::SUCCESS
    })
}

#[derive(Debug, clap::Args)]
pub struct ReseedArgs {
    #[arg(long, default_value = "trellara.yml")]
    config: PathBuf,
    #[arg(long)]
    flow: Option<String>,
    /// Only this sink of a flow with `sinks:`: copied again at a boundary
    /// of its own, the flow's slot and the other sinks untouched.
    #[arg(long)]
    sink: Option<String>,
    /// Only this table, copied again at a boundary of its own while the
    /// flow follows (its apply held there meanwhile); the rest untouched.
    #[arg(long)]
    table: Option<String>,
    /// With --table: seconds reaching the hold may take (the temporary
    /// slot waits for running source transactions); the copy itself takes
    /// what the table's size needs.
    #[arg(long, requires = "table", default_value_t = crate::fence::DEFAULT_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600))]
    fence_timeout: u64,
    /// End with `verify` and its exit status.
    #[arg(long)]
    verify: bool,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
}

/// `--table T` as the config spells its tables.
fn table_arg(table: &str) -> anyhow::Result<String> {
    TableName::parse(table)
        .map(|n| n.to_string())
        .map_err(|e| anyhow::anyhow!("--table {table:?} {e}\nhint: write schema.table as SQL does: public.sales, or public.\"Sales\" for a mixed-case name"))
}

/// Re-snapshot: marks the run failed_recoverable (with the reason) and runs
/// the machine again from planned, then catches up and applies. With
/// `--table`, that table alone, while its flow follows.
pub fn reseed(args: ReseedArgs) -> anyhow::Result<ExitCode> {
    if let Some(table) = &args.table {
        return reseed_table(&args, &table_arg(table)?);
    }
    let config = config::load(&args.config)?;
    let config_path = args.config.display().to_string();
    let rt = runtime()?;
    let text = args.format == Format::Text;
    let mut reports = Vec::new();
    for (index, f) in with_sink(&config, args.flow.as_deref(), args.sink.as_deref())? {
        // JSON on stdout is the report alone; progress goes to stderr.
        let mut progress = |line: &str| {
            if text {
                outln!("[{}] {line}", f.name);
            } else {
                errln!("[{}] {line}", f.name);
            }
        };
        for sink in chosen_sinks(f, args.sink.as_deref())? {
            rt.block_on(flow::request_reseed(
                f,
                (index, sink),
                "reseed requested by the operator",
                &config_path,
                &mut progress,
            ))
            .with_context(|| format!("reseed flow {} sink {}", f.name, sink.name))?;
        }
        reports.push(
            rt.block_on(flow::run(
                f,
                flow::Job::new(index, &config_path, flow::Mode::Once),
                &mut progress,
            ))
            .with_context(|| format!("reseed flow {}", f.name))?,
        );
    }
    if !text && !args.verify {
        let out: Vec<_> = reports.iter().map(run_json).collect();
        outln!("{}", serde_json::to_string_pretty(&out)?);
    }
    if args.verify {
        return could_not_verify(|| {
            verify_flows(
                &config,
                &config_path,
                Only {
                    flow: args.flow.as_deref(),
                    sink: args.sink.as_deref(),
                    table: None,
                },
                args.format,
                (verify::CHUNK_ROWS, crate::fence::DEFAULT_TIMEOUT),
                &rt,
            )
        });
    }
    Ok(ExitCode::SUCCESS)
}

/// `reseed --table`: the table copied again on each chosen sink of each
/// flow that replicates it, one at a time, each under its flow's fence.
fn reseed_table(args: &ReseedArgs, table: &str) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let config_path = args.config.display().to_string();
    let rt = runtime()?;
    let text = args.format == Format::Text;
    let timeout = Duration::from_secs(args.fence_timeout);
    let chosen: Vec<_> = with_sink(&config, args.flow.as_deref(), args.sink.as_deref())?
        .into_iter()
        .filter(|(_, f)| f.tables.iter().any(|t| t == table))
        .collect();
    if chosen.is_empty() {
        return Err(no_flow_replicates(&config, args.flow.as_deref(), table));
    }
    let mut done = Vec::new();
    for (index, f) in chosen {
        let mut progress = |line: &str| {
            if text {
                outln!("[{}] {line}", f.name);
            } else {
                errln!("[{}] {line}", f.name);
            }
        };
        for sink in chosen_sinks(f, args.sink.as_deref())? {
            let reseeded = rt
                .block_on(async {
                    let source_url = f.source.url.resolve(&format!("flows[{index}].source"))?;
                    let target_url = flow::sink_url(f, index, sink)?;
                    let source = flow::connect(&source_url, "source").await?;
                    let target = flow::connect(&target_url, "target").await?;
                    flow::refuse_same_database(&source, &target, &config_path).await?;
                    let cursor = crate::apply::sink_cursor(&f.name, sink.name);
                    anyhow::Ok(
                        crate::reseed::table(
                            f,
                            (sink.name, &cursor),
                            (&source_url, &source, &target),
                            table,
                            (timeout, &config_path),
                            &mut progress,
                        )
                        .await?,
                    )
                })
                .with_context(|| match sink.position {
                    Some(_) => format!("reseed {table} of flow {} sink {}", f.name, sink.name),
                    None => format!("reseed {table} of flow {}", f.name),
                })?;
            if reseeded.released.is_empty() {
                progress(&format!(
                    "reseed {table}: copied {} rows at its own boundary {}; the apply was held {} ms (the copy {} ms); `trellara verify --config {config_path} --flow {} --table {table}` promotes it",
                    reseeded.rows,
                    reseeded.boundary_lsn,
                    reseeded.apply_held_ms,
                    reseeded.copy_ms,
                    f.name
                ));
            } else {
                progress(&format!(
                    "reseed {table}: copied {} rows at its own boundary {} (the copy {} ms), which released the hold at {}: the sink goes on from there, and {table} is ahead of the other tables until it has caught up; `trellara verify --config {config_path} --flow {}` once it has",
                    reseeded.rows,
                    reseeded.boundary_lsn,
                    reseeded.copy_ms,
                    reseeded.released.join(", "),
                    f.name
                ));
            }
            done.push(reseeded);
        }
    }
    if !text && !args.verify {
        outln!("{}", serde_json::to_string_pretty(&done)?);
    }
    if args.verify {
        return could_not_verify(|| {
            verify_flows(
                &config,
                &config_path,
                Only {
                    flow: args.flow.as_deref(),
                    sink: args.sink.as_deref(),
                    table: Some(table),
                },
                args.format,
                (verify::CHUNK_ROWS, timeout),
                &rt,
            )
        });
    }
    Ok(ExitCode::SUCCESS)
}

/// The flows `--flow` selects; with `--sink`, only those that have a sink
/// of that name, refused before anything is done when none has.
fn with_sink<'c>(
    config: &'c Config,
    only_flow: Option<&str>,
    only_sink: Option<&str>,
) -> anyhow::Result<Vec<(usize, &'c config::Flow)>> {
    let selected = flows(config, only_flow)?;
    let Some(name) = only_sink else {
        return Ok(selected);
    };
    let known: Vec<String> = selected
        .iter()
        .flat_map(|(_, f)| {
            f.sinks()
                .into_iter()
                .map(|s| format!("{}/{}", f.name, s.name))
        })
        .collect();
    let having: Vec<_> = selected
        .into_iter()
        .filter(|(_, f)| f.sinks().iter().any(|s| s.name == name))
        .collect();
    if having.is_empty() {
        anyhow::bail!(
            "no flow has a sink named {name:?}\nhint: --sink takes a sink's name; the sinks are {}",
            known.join(", ")
        );
    }
    Ok(having)
}

/// The flow's sinks `--sink` names (every one without it); an unknown
/// name is refused with the names there are.
fn chosen_sinks<'f>(
    f: &'f config::Flow,
    only: Option<&str>,
) -> anyhow::Result<Vec<config::SinkRef<'f>>> {
    let sinks: Vec<_> = f
        .sinks()
        .into_iter()
        .filter(|s| only.is_none_or(|o| o == s.name))
        .collect();
    if let Some(name) = only
        && sinks.is_empty()
    {
        let names: Vec<&str> = f.sinks().iter().map(|s| s.name).collect();
        anyhow::bail!(
            "flow {} has no sink named {name:?}\nhint: --sink takes one of {}",
            f.name,
            names.join(", ")
        );
    }
    Ok(sinks)
}

#[derive(Debug, clap::Args)]
pub struct StreamArgs {
    #[command(subcommand)]
    command: StreamCommand,
}

#[derive(Debug, clap::Subcommand)]
enum StreamCommand {
    /// Is the position each consumer needs still in the durable log?
    LocateLocal {
        #[arg(long, default_value = "trellara.yml")]
        config: PathBuf,
        #[arg(long, value_enum, default_value_t)]
        format: Format,
    },
}

pub fn stream(args: StreamArgs) -> anyhow::Result<ExitCode> {
    let StreamCommand::LocateLocal { config, format } = args.command;
    let config = config::load(&config)?;
    let mut out = Vec::new();
    let mut all_present = true;
    for (_, f) in flows(&config, None)? {
        let Some(dir) = f.log_dir() else { continue };
        if !dir.exists() {
            out.push(
                json!({"flow": f.name, "log": dir.display().to_string(), "present": false,
                "detail": "no durable log yet", "recovery": "trellara run --config ..."}),
            );
            all_present = false;
            continue;
        }
        let Some(_lock) = crate::lock::try_lock(dir)? else {
            // A live writer holds it: its applier is consuming the log now.
            out.push(json!({"flow": f.name, "log": dir.display().to_string(), "present": true,
                "detail": "the log is in use by a running trellara process, which is applying from it",
                "recovery": "none needed"}));
            continue;
        };
        let (log, _) = crate::log::Log::open(
            crate::log::storage::FsStorage::new(),
            dir,
            crate::log::LogConfig::default(),
        )?;
        let needed = log
            .cursor(&crate::apply::first_cursor(f))
            .map_or(log.first_offset(), |c| c.next_offset);
        let present = needed >= log.first_offset();
        all_present &= present;
        out.push(json!({
            "flow": f.name,
            "log": dir.display().to_string(),
            "needed_offset": needed,
            "log_first_offset": log.first_offset(),
            "log_next_offset": log.next_offset(),
            "present": present,
            "detail": if present { format!("offset {needed} is in the log ({} records still to apply)", log.next_offset().saturating_sub(needed)) }
                      else { format!("offset {needed} was removed by retention (log starts at {})", log.first_offset()) },
            "recovery": if present { "trellara run --config ...".to_owned() } else { "trellara reseed --config ...".to_owned() },
        }));
    }
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&out)?),
        Format::Text => {
            for v in &out {
                outln!(
                    "{}: {} — {}",
                    v["flow"].as_str().unwrap_or(""),
                    if v["present"] == true {
                        "present"
                    } else {
                        "NOT PRESENT"
                    },
                    v["detail"].as_str().unwrap_or("")
                );
                outln!("  next: {}", v["recovery"].as_str().unwrap_or(""));
            }
        }
    }
    Ok(if all_present {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The flow's slot as the source has it: `state` is active, idle, missing,
/// invalidated, or unknown (with the reason) when the source cannot be read.
async fn slot_state(f: &Flow, source_url: &str) -> serde_json::Value {
    let slot = f.slot();
    let read = async {
        let source = flow::connect(source_url, "source").await?;
        let row = source
            .query_opt(
                "SELECT active, coalesce(wal_status, ''), restart_lsn IS NULL FROM pg_replication_slots
                 WHERE slot_name = $1 AND database = current_database()",
                &[&slot],
            )
            .await?;
        anyhow::Ok(row.map(|r| {
            (
                r.get::<_, bool>(0),
                r.get::<_, String>(1),
                r.get::<_, bool>(2),
            )
        }))
    };
    match read.await {
        Ok(None) => json!({"name": slot, "state": "missing"}),
        Ok(Some((_, wal_status, no_restart))) if wal_status == "lost" || no_restart => {
            json!({"name": slot, "state": "invalidated", "wal_status": wal_status})
        }
        Ok(Some((active, wal_status, _))) => {
            json!({"name": slot, "state": if active { "active" } else { "idle" }, "wal_status": wal_status})
        }
        Err(e) => json!({"name": slot, "state": "unknown", "reason": super::chain(&e)}),
    }
}

/// What is blocked and the exact commands that unblock it. There is no
/// repair apply: the plan names the commands for the specific blockage.
pub fn repair_plan(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let config = config::load(&args.config)?;
    let path = args.config.display().to_string();
    let rt = runtime()?;
    let mut steps: Vec<serde_json::Value> = Vec::new();
    for (index, f) in flows(&config, args.flow.as_deref())? {
        let name = &f.name;
        rt.block_on(async {
            let (source_url, target_url) = flow::urls(f, index)?;
            let target = flow::connect(&target_url, "target").await?;
            if !crate::state::present(&target).await? {
                steps.push(json!({"flow": name, "blocked": "the flow has not run against this target yet (no trellara state tables)",
                    "commands": [format!("trellara preflight --config {path}"), format!("trellara run --config {path} --flow {name} --local --verify")]}));
                return anyhow::Ok(());
            }
            if let Some(stop) = crate::state::stop(&target, name).await? {
                steps.push(json!({"flow": name, "blocked": format!("the last run stopped ({}): {}", stop.kind, stop.detail), "commands": stop.commands}));
            }
            for q in crate::state::quarantine::open(&target, name).await? {
                steps.push(json!({"flow": name, "blocked": format!("transaction {} at {} is quarantined ({} attempts): {}", q.xid, q.commit_lsn, q.attempts, q.reason),
                    "commands": ["fix the cause named above at the target", format!("trellara run --config {path} --flow {name} --local"), format!("trellara verify --config {path} --flow {name}")]}));
            }
            let snapshot = crate::snapshot::load(&target, name).await?;
            let streaming = snapshot.as_ref().is_some_and(|s| {
                matches!(s.state, crate::state::SnapshotState::StreamHandoffReady | crate::state::SnapshotState::Verified)
            });
            if let Some(s) = &snapshot {
                if s.state == crate::state::SnapshotState::FailedRecoverable {
                    steps.push(json!({"flow": name, "blocked": "the snapshot run is failed_recoverable", "commands": [format!("trellara reseed --config {path} --flow {name} --verify")]}));
                } else if !streaming {
                    steps.push(json!({"flow": name, "blocked": format!("the snapshot run stopped at {}", s.state.as_str()), "commands": [format!("trellara run --config {path} --flow {name} --local")]}));
                }
            }
            if streaming && crate::state::current(&target).await? {
                for t in crate::state::runs::tables(&target, name).await? {
                    if t.state == Some(crate::state::SnapshotState::FailedRecoverable) {
                        let table = &t.name;
                        steps.push(json!({"flow": name, "blocked": format!("table {table}, copied at a boundary of its own, differs from the source (its last verify)"),
                            "commands": [format!("trellara reseed --config {path} --flow {name} --table {table} --verify (while the flow follows)")]}));
                    }
                }
            }
            let slot = slot_state(f, &source_url).await;
            if streaming && matches!(slot["state"].as_str(), Some("missing" | "invalidated")) {
                steps.push(json!({"flow": name, "blocked": format!("the flow streams from slot {} on the source, which is {}: the changes since it are not captured", f.slot(), slot["state"].as_str().unwrap_or("")),
                    "commands": [format!("trellara reseed --config {path} --flow {name} --verify")]}));
            }
            anyhow::Ok(())
        })?;
    }
    match args.format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&steps)?),
        Format::Text => {
            if steps.is_empty() {
                outln!("nothing is blocked");
            }
            for (i, s) in steps.iter().enumerate() {
                outln!(
                    "{}. [{}] {}",
                    i + 1,
                    s["flow"].as_str().unwrap_or(""),
                    s["blocked"].as_str().unwrap_or("")
                );
                for c in s["commands"].as_array().into_iter().flatten() {
                    outln!("     {}", c.as_str().unwrap_or(""));
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
