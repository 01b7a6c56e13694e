//! `trellara.yml`, schema version 2: flows (source, target, tables, capture
//! path, transport) under an environment. Documented field by field in
//! docs/CONFIG.md.
//!
//! Invariants:
//! * Unknown fields are errors (a typo never silently means a default).
//! * Every problem names its field path and the fix ([`ConfigIssue`]).
//! * `environment: production` refuses inline URLs: secrets come from an
//!   environment variable or an absolute file path. Resolved URLs are never
//!   printed; [`SecretRef`]'s Debug and Display redact them.

use crate::table_name::TableName;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const SCHEMA_VERSION: u32 = 2;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub schema_version: u32,
    #[serde(default)]
    pub environment: Environment,
    pub flows: Vec<Flow>,
    #[serde(default, skip_serializing_if = "ServiceConfig::is_default")]
    pub service: ServiceConfig,
}

/// Where the long-running processes serve /livez /readyz /healthz
/// /metrics, and what /readyz accepts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// `run --follow` (both roles) and the relay service. Loopback by
    /// default: the endpoints carry no authentication.
    #[serde(default = "default_relay_listen")]
    pub relay_listen: std::net::SocketAddr,
    /// The applier service.
    #[serde(default = "default_apply_listen")]
    pub apply_listen: std::net::SocketAddr,
    /// /readyz says not ready while the last applied transaction is older
    /// than this at its commit on the target.
    #[serde(default = "default_ready_lag")]
    pub ready_max_lag_seconds: u64,
    /// What the long-running process logs to stderr: a level (`info`) or
    /// `RUST_LOG` directives (`warn,trellara_relay=debug`). RUST_LOG, when
    /// set, wins; unset, `-v` decides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
}

impl ServiceConfig {
    fn is_default(&self) -> bool {
        *self == ServiceConfig::default()
    }
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            relay_listen: default_relay_listen(),
            apply_listen: default_apply_listen(),
            ready_max_lag_seconds: default_ready_lag(),
            log_level: None,
        }
    }
}

fn default_relay_listen() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 9401))
}

fn default_apply_listen() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 9402))
}

fn default_ready_lag() -> u64 {
    60
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Environment {
    /// A laptop or CI: inline URLs allowed, local log.
    #[default]
    Evaluation,
    /// Secrets only by reference.
    Production,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Flow {
    /// Lower-case letters, digits, `_` and `-`; names slots, cursors, state.
    pub name: String,
    pub source: Source,
    /// The flow's one sink (named after the flow), or none with `sinks:`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<Target>,
    /// Several sinks on the flow's one slot and log, each with its own
    /// cursor, checkpoint, verify and quarantine; instead of `target:`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sinks: Vec<Sink>,
    /// `schema.table`, each with a primary key or replica identity.
    pub tables: Vec<String>,
    #[serde(default)]
    pub capture: CapturePath,
    #[serde(default)]
    pub transport: Transport,
    /// How source schema changes are classified and applied
    /// (docs/SCHEMA.md).
    #[serde(default, skip_serializing_if = "SchemaPolicy::is_default")]
    pub schema: SchemaPolicy,
}

/// A flow's schema contract settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchemaPolicy {
    /// How a compatible change is decided.
    #[serde(default)]
    pub apply_mode: ApplyMode,
    /// What a table that appears in a publication the flow covers, but
    /// that flows[].tables does not list, becomes.
    #[serde(default)]
    pub unknown_table_policy: UnknownTablePolicy,
    /// Renames the operator vouches for: `schema.table.column: new_column`
    /// or `schema.table: schema.new_table`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub rename: std::collections::BTreeMap<String, String>,
}

impl SchemaPolicy {
    fn is_default(&self) -> bool {
        *self == SchemaPolicy::default()
    }
}

/// How a compatible schema change is decided; a mode only ever makes a
/// decision more careful (docs/SCHEMA.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApplyMode {
    /// Applied on each sink with its first rows under the new schema.
    #[default]
    Auto,
    /// Applied on each sink first; the rows after it released once every
    /// sink acknowledged.
    Staged,
    /// Held for the operator's review.
    Manual,
}

impl ApplyMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyMode::Auto => "auto",
            ApplyMode::Staged => "staged",
            ApplyMode::Manual => "manual",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownTablePolicy {
    /// Not replicated: its rows reach no sink (as before schema contracts).
    #[default]
    Ignore,
    /// Created on each sink from the source catalog, then replicated.
    AllowCompatible,
    /// Held for the operator's review.
    Block,
}

impl UnknownTablePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            UnknownTablePolicy::Ignore => "ignore",
            UnknownTablePolicy::AllowCompatible => "allow_compatible",
            UnknownTablePolicy::Block => "block",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    #[serde(flatten)]
    pub url: SecretRef,
    /// Stable id in every envelope and checkpoint; default: the flow name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_id: Option<String>,
    /// Logical slot; default `trellara_<flow>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<String>,
    /// Publication; default `trellara_<flow>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publication: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    #[serde(flatten)]
    pub url: SecretRef,
    /// A throwaway local cluster `init --evaluate` made in this directory
    /// (relative: to the config file's) instead of a URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throwaway: Option<PathBuf>,
}

/// One of a flow's sinks: a Postgres target of its own.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sink {
    /// The sink's `dataset_id` (its metrics series, cursor and status
    /// line); names as a flow's.
    pub name: String,
    pub target: Target,
}

/// A flow's sink as the code uses it, from `target:` or from `sinks:`.
#[derive(Debug, Clone, Copy)]
pub struct SinkRef<'a> {
    pub name: &'a str,
    pub target: &'a Target,
    /// Its place in `sinks:`; None for the flow's `target:`.
    pub position: Option<usize>,
}

impl SinkRef<'_> {
    /// The config path of its target, for errors: `flows[0].target` or
    /// `flows[0].sinks[1].target`.
    pub fn field(&self, flow_index: usize) -> String {
        match self.position {
            None => format!("flows[{flow_index}].target"),
            Some(p) => format!("flows[{flow_index}].sinks[{p}].target"),
        }
    }
}

/// A connection string given inline (`url`), by environment variable
/// (`url_env`) or by file (`url_file`, absolute path). Exactly one.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_env: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url_file: Option<PathBuf>,
}

impl std::fmt::Debug for SecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self}")
    }
}

impl std::fmt::Display for SecretRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.url, &self.url_env, &self.url_file) {
            (Some(_), _, _) => write!(f, "<redacted inline url>"),
            (_, Some(var), _) => write!(f, "env:{var}"),
            (_, _, Some(path)) => write!(f, "file:{}", path.display()),
            _ => write!(f, "<none>"),
        }
    }
}

impl SecretRef {
    /// The connection string. Errors name `field` and the fix.
    pub fn resolve(&self, field: &str) -> Result<String, ConfigIssue> {
        match (&self.url, &self.url_env, &self.url_file) {
            (Some(url), None, None) => Ok(url.clone()),
            (None, Some(var), None) => std::env::var(var).map_err(|_| {
                ConfigIssue::new(
                    format!("{field}.url_env"),
                    format!("environment variable {var} is not set"),
                    format!("export {var}=postgresql://..."),
                )
            }),
            (None, None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    ConfigIssue::new(
                        format!("{field}.url_file"),
                        format!("cannot read {}: {e}", path.display()),
                        "point url_file at a readable file holding only the URL".into(),
                    )
                })?;
                // A second line is not part of a URL: taking the first
                // (or all) would connect somewhere the file did not say.
                let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
                match lines.as_slice() {
                    [url] => Ok(url.trim().to_owned()),
                    _ => Err(ConfigIssue::new(
                        format!("{field}.url_file"),
                        format!(
                            "{} holds {} non-empty lines, not one URL",
                            path.display(),
                            lines.len()
                        ),
                        "keep only the connection string in the file, on one line".into(),
                    )),
                }
            }
            _ => Err(ConfigIssue::new(
                field.to_owned(),
                "needs exactly one of url, url_env, url_file".into(),
                "keep one of the three".into(),
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CapturePath {
    /// pgoutput over the replication protocol; works on managed providers.
    #[default]
    External,
    /// The trellara extension (shared_preload_libraries).
    Native,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Transport {
    /// The durable segment log in a local directory.
    Local {
        #[serde(default = "default_log_dir")]
        log_dir: PathBuf,
        /// Keep the log at most this large (MiB); only segments every
        /// consumer has passed are ever deleted, the rest is reported as
        /// retention pressure.
        #[serde(default = "default_retention_mib")]
        retention_mib: u64,
    },
    /// Store and forward to Kafka: the local log (as above) keeps the
    /// source's acknowledgements fast and durable; a publisher forwards it
    /// to `topic` (one partition) and the applier reads the topic.
    Kafka {
        /// `host:port[,host:port...]`
        brokers: String,
        topic: String,
        #[serde(default = "default_log_dir")]
        log_dir: PathBuf,
        #[serde(default = "default_retention_mib")]
        retention_mib: u64,
    },
}

impl Default for Transport {
    fn default() -> Self {
        Transport::Local {
            log_dir: default_log_dir(),
            retention_mib: default_retention_mib(),
        }
    }
}

/// The log's default size limit.
pub const DEFAULT_RETENTION_MIB: u64 = 1024;

fn default_retention_mib() -> u64 {
    DEFAULT_RETENTION_MIB
}

fn default_log_dir() -> PathBuf {
    PathBuf::from("./.trellara/log")
}

/// One problem: where, what, and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigIssue {
    pub field: String,
    /// The field's line in the file (or its nearest enclosing one's, for
    /// a field that is missing), when the issue came from a file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line: Option<usize>,
    pub problem: String,
    pub fix: String,
}

impl ConfigIssue {
    pub fn new(field: String, problem: String, fix: String) -> Self {
        ConfigIssue {
            field,
            line: None,
            problem,
            fix,
        }
    }
}

impl std::fmt::Display for ConfigIssue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.field)?;
        if let Some(line) = self.line {
            write!(f, " (line {line})")?;
        }
        write!(f, ": {}\n  fix: {}", self.problem, self.fix)
    }
}

/// A [`parse`] error as an issue: serde_yaml names the field path first
/// (`flows[0].source: unknown field ...`) and the line last.
pub fn parse_issue(text: &str, message: &str) -> ConfigIssue {
    let (first, hint) = message.split_once("\nhint: ").unwrap_or((message, ""));
    let (field, problem) = match first.split_once(": ") {
        Some((field, problem)) if !field.contains(' ') => (field, problem),
        _ => ("(file)", first),
    };
    let (problem, mut line) = match problem.split_once(" at line ") {
        Some((problem, at)) => (problem, at.split(' ').next().and_then(|l| l.parse().ok())),
        None => (problem, None),
    };
    // serde points at the mapping; the unknown key has a line of its own.
    if let Some(key) = problem
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(key, _)| key)
        && let Some(at) = line_of(text, &format!("{field}.{key}"))
        && at > line.unwrap_or(0)
    {
        line = Some(at);
    }
    ConfigIssue {
        field: field.to_owned(),
        line,
        problem: problem.to_owned(),
        fix: if hint.is_empty() {
            "see docs/CONFIG.md for every field (schema_version: 2)".into()
        } else {
            hint.to_owned()
        },
    }
}

/// `issues` with the line of each one's field in `text`.
pub fn located(text: &str, mut issues: Vec<ConfigIssue>) -> Vec<ConfigIssue> {
    for issue in &mut issues {
        issue.line = line_of(text, &issue.field);
    }
    issues
}

/// One step of a field path: `flows[0].tables[1]` is flows, 0, tables, 1.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    Key(String),
    Index(usize),
}

fn steps(field: &str) -> Vec<Step> {
    let mut out = Vec::new();
    for part in field.split('.') {
        let (key, rest) = part.split_once('[').unwrap_or((part, ""));
        if !key.is_empty() {
            out.push(Step::Key(key.to_owned()));
        }
        for index in rest.split('[') {
            if let Ok(i) = index.trim_end_matches(']').parse() {
                out.push(Step::Index(i));
            }
        }
    }
    out
}

/// The line of `field` in the YAML `text`, or of its longest enclosing
/// field that the text has. Reads the text's events, not its values.
pub fn line_of(text: &str, field: &str) -> Option<usize> {
    use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
    use yaml_rust2::scanner::Marker;
    enum Frame {
        Map { key: Option<String> },
        Seq { next: usize },
    }
    struct Finder {
        want: Vec<Step>,
        frames: Vec<Frame>,
        path: Vec<Step>,
        best: Option<(usize, usize)>,
    }
    impl Finder {
        fn seen(&mut self, path: &[Step], line: usize) {
            if self.want.starts_with(path) && self.best.is_none_or(|(len, _)| path.len() > len) {
                self.best = Some((path.len(), line));
            }
        }
        /// The path of the node starting now, and whether it is a key.
        fn position(&self) -> (Vec<Step>, bool) {
            let mut path = self.path.clone();
            match self.frames.last() {
                Some(Frame::Map { key: None }) => return (path, true),
                Some(Frame::Map { key: Some(k) }) => path.push(Step::Key(k.clone())),
                Some(Frame::Seq { next }) => path.push(Step::Index(*next)),
                None => {}
            }
            (path, false)
        }
        fn advance(&mut self) {
            match self.frames.last_mut() {
                Some(Frame::Map { key }) => *key = None,
                Some(Frame::Seq { next }) => *next += 1,
                None => {}
            }
        }
    }
    impl MarkedEventReceiver for Finder {
        fn on_event(&mut self, event: Event, mark: Marker) {
            match event {
                Event::Scalar(value, ..) => match self.position() {
                    (mut path, true) => {
                        path.push(Step::Key(value.clone()));
                        self.seen(&path, mark.line());
                        if let Some(Frame::Map { key }) = self.frames.last_mut() {
                            *key = Some(value);
                        }
                    }
                    (path, false) => {
                        self.seen(&path, mark.line());
                        self.advance();
                    }
                },
                Event::Alias(_) => {
                    let (path, _) = self.position();
                    self.seen(&path, mark.line());
                    self.advance();
                }
                Event::MappingStart(..) | Event::SequenceStart(..) => {
                    let (path, _) = self.position();
                    self.seen(&path, mark.line());
                    self.path = path;
                    self.frames
                        .push(if matches!(event, Event::MappingStart(..)) {
                            Frame::Map { key: None }
                        } else {
                            Frame::Seq { next: 0 }
                        });
                }
                Event::MappingEnd | Event::SequenceEnd => {
                    self.frames.pop();
                    // The enclosing frame's own step comes off the path.
                    if !self.frames.is_empty() {
                        self.path.pop();
                    }
                    self.advance();
                }
                _ => {}
            }
        }
    }
    let mut finder = Finder {
        want: steps(field),
        frames: Vec::new(),
        path: Vec::new(),
        best: None,
    };
    Parser::new_from_str(text).load(&mut finder, false).ok()?;
    finder.best.map(|(_, line)| line)
}

impl std::error::Error for ConfigIssue {}

/// Why a config file could not be used at all.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}\nhint: create one with `trellara init ... --evaluate`")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path} has {} problem(s):\n{}", issues.len(), issues.iter().map(|i| format!("  {i}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        path: String,
        issues: Vec<ConfigIssue>,
    },
    #[error("cannot write the config as YAML")]
    Yaml(#[source] serde_yaml_ng::Error),
}

/// Parses and validates; relative log directories resolve against the
/// config file's directory.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let mut config = parse(&text).map_err(|message| ConfigError::Parse {
        path: path.display().to_string(),
        message,
    })?;
    let issues = validate(&config);
    if !issues.is_empty() {
        return Err(ConfigError::Invalid {
            path: path.display().to_string(),
            issues: located(&text, issues),
        });
    }
    let base = path.parent().unwrap_or(Path::new("."));
    for flow in &mut config.flows {
        canonical_tables(flow);
        if let Some(dir) = flow.target.as_mut().and_then(|t| t.throwaway.as_mut())
            && dir.is_relative()
        {
            *dir = std::path::absolute(base.join(&*dir)).unwrap_or_else(|_| base.join(&*dir));
        }
        if let Transport::Local { log_dir, .. } | Transport::Kafka { log_dir, .. } =
            &mut flow.transport
            && log_dir.is_relative()
        {
            *log_dir = base.join(&*log_dir);
        }
    }
    Ok(config)
}

/// Each table in its one display form (`public."Sales"`, `public.sales`
/// for `public.Sales`), the key under which state and pins name it.
pub fn canonical_tables(flow: &mut Flow) {
    for table in &mut flow.tables {
        if let Ok(name) = TableName::parse(table) {
            *table = name.to_string();
        }
    }
}

/// The config as YAML that [`parse`] reads back to the same model. Fails
/// only on a path that is not UTF-8.
pub fn to_yaml(config: &Config) -> Result<String, ConfigError> {
    serde_yaml_ng::to_string(config).map_err(ConfigError::Yaml)
}

impl Config {
    /// A copy to share: each inline URL with its password redacted. A
    /// reference (`url_env`, `url_file`) names where the secret is, not it.
    pub fn redacted(&self) -> Config {
        let mut copy = self.clone();
        for flow in &mut copy.flows {
            let targets = flow
                .target
                .iter_mut()
                .chain(flow.sinks.iter_mut().map(|s| &mut s.target));
            for secret in std::iter::once(&mut flow.source.url).chain(targets.map(|t| &mut t.url)) {
                if let Some(url) = &mut secret.url {
                    *url = crate::redact::redact(url);
                }
            }
        }
        copy
    }
}

pub fn parse(text: &str) -> Result<Config, String> {
    serde_yaml_ng::from_str(text).map_err(|e| {
        format!(
            "{}\nhint: see docs/CONFIG.md for every field (schema_version: 2)",
            scrub(&e.to_string())
        )
    })
}

/// A parse error without the values it quotes: serde names an unexpected
/// value as `string "..."`, and that value may be a password or a URL with
/// one. Field and variant names (in backquotes) stay.
fn scrub(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut quoted = false;
    let mut escaped = false;
    for c in message.chars() {
        if quoted && escaped {
            escaped = false;
        } else if quoted && c == '\\' {
            escaped = true;
        } else if c == '"' {
            if !quoted {
                out.push_str("\"<redacted>\"");
            }
            quoted = !quoted;
        } else if !quoted {
            out.push(c);
        }
    }
    crate::redact::redact(&out)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 40
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// Every problem in the config, each naming its field and fix. Offline:
/// touches no database and reads no secret files.
pub fn validate(config: &Config) -> Vec<ConfigIssue> {
    let mut issues = Issues::default();
    let mut issue = |field: String, problem: String, fix: &str| issues.add(field, problem, fix);
    if config.schema_version != SCHEMA_VERSION {
        issue(
            "schema_version".into(),
            format!(
                "is {}, this build reads {SCHEMA_VERSION}",
                config.schema_version
            ),
            "set schema_version: 2 (see docs/CONFIG.md for changes)",
        );
    }
    if config.service.ready_max_lag_seconds == 0 {
        issue(
            "service.ready_max_lag_seconds".into(),
            "is 0: no flow could ever be ready".into(),
            "use a bound in seconds, e.g. 60",
        );
    }
    if let Some(level) = &config.service.log_level
        && let Err(e) = tracing_subscriber::EnvFilter::builder().parse(level)
    {
        issue(
            "service.log_level".into(),
            format!("{level:?} is not a log filter: {e}"),
            "use error, warn, info, debug or trace, or RUST_LOG directives such as warn,trellara_relay=debug",
        );
    }
    if config.flows.is_empty() {
        issue(
            "flows".into(),
            "is empty".into(),
            "add a flow, e.g. with `trellara init`",
        );
    }
    let mut shared = Shared::default();
    for (i, flow) in config.flows.iter().enumerate() {
        flow_identity(config.environment, i, flow, &mut shared, &mut issues);
        flow_secrets(config.environment, i, flow, &mut issues);
        flow_sinks(i, flow, &mut issues);
        flow_names(i, flow, &mut issues);
        flow_tables(i, flow, &mut issues);
        flow_transport(i, flow, &mut shared, &mut issues);
        flow_renames(i, flow, &mut issues);
    }
    issues.0
}

/// Each `schema.rename` entry names one of the flow's tables (or a column
/// of one) and a new name of the same shape.
fn flow_renames(i: usize, flow: &Flow, issues: &mut Issues) {
    for (from, to) in &flow.schema.rename {
        let field = format!("flows[{i}].schema.rename.{from}");
        let table = flow.tables.iter().find(|t| {
            from == *t
                || from
                    .strip_prefix(t.as_str())
                    .is_some_and(|c| c.len() > 1 && c.starts_with('.'))
        });
        let Some(table) = table else {
            issues.add(
                field,
                "names none of the flow's tables (nor a column of one)".into(),
                "key a rename by schema.table or schema.table.column as flows[].tables spells the table",
            );
            continue;
        };
        let is_table = from == table;
        let fits = if is_table {
            crate::table_name::TableName::parse(to).is_ok()
        } else {
            !to.is_empty() && !to.contains('.')
        };
        if !fits {
            issues.add(
                field,
                format!(
                    "maps to {to:?}, which is not a new {}",
                    if is_table {
                        "schema.table"
                    } else {
                        "column name"
                    }
                ),
                if is_table {
                    "map a table to its new schema.table"
                } else {
                    "map a column to its new name alone"
                },
            );
        }
    }
}

/// What [`validate`] found, in the order it found it.
#[derive(Default)]
struct Issues(Vec<ConfigIssue>);

impl Issues {
    fn add(&mut self, field: String, problem: String, fix: &str) {
        self.0
            .push(ConfigIssue::new(field, problem, fix.to_owned()));
    }
}

/// What two flows of one config may not share, gathered over the flows.
#[derive(Default)]
struct Shared {
    names: std::collections::HashSet<String>,
    log_dirs: std::collections::HashSet<std::path::PathBuf>,
    topics: std::collections::HashSet<String>,
    /// (the source as configured, the field, its value).
    source_names: std::collections::HashSet<(SourceRef, &'static str, String)>,
}

/// A source as its config names it: url, url_env, url_file.
type SourceRef = (Option<String>, Option<String>, Option<std::path::PathBuf>);

/// The flow's name, log, slot and publication, and where its target is.
fn flow_identity(
    environment: Environment,
    i: usize,
    flow: &Flow,
    shared: &mut Shared,
    issues: &mut Issues,
) {
    let at = |field: &str| format!("flows[{i}].{field}");
    let mut issue = |field: String, problem: String, fix: &str| issues.add(field, problem, fix);
    if !valid_name(&flow.name) {
        issue(
            at("name"),
            format!("{:?} is not a valid flow name", flow.name),
            "use 1-40 lower-case letters, digits, '_' or '-'",
        );
    }
    if !shared.names.insert(flow.name.clone()) {
        issue(
            at("name"),
            format!("{:?} is used by another flow", flow.name),
            "give each flow its own name",
        );
    }
    // Each log has one writer and one stream: two flows cannot share one.
    if let Some(dir) = flow.log_dir()
        && !shared.log_dirs.insert(dir.to_path_buf())
    {
        issue(
            at("transport.log_dir"),
            format!("{} is the log of another flow", dir.display()),
            "give each flow its own log_dir, e.g. ./.trellara/<flow>",
        );
    }
    // On one source, a second flow on the same slot would steal the
    // first's stream, and on the same publication would capture the
    // first's tables only.
    let source = &flow.source.url;
    let on = (
        source.url.clone(),
        source.url_env.clone(),
        source.url_file.clone(),
    );
    for (field, value) in [
        ("source.slot", flow.slot()),
        ("source.publication", flow.publication()),
    ] {
        if !shared
            .source_names
            .insert((on.clone(), field, value.clone()))
        {
            issue(
                at(field),
                format!("{value:?} is also another flow's, on the same source"),
                "set a distinct source.slot / source.publication, or rename the flow (names that differ only in '-' and '_' default to the same ones)",
            );
        }
    }
    let throwaway = flow.target.as_ref().and_then(|t| t.throwaway.as_ref());
    if let Some(dir) = throwaway
        && dir.file_name().is_none_or(|n| n == ".")
    {
        issue(
            at("target.throwaway"),
            format!(
                "{:?} names no directory of its own",
                dir.display().to_string()
            ),
            "leave the throwaway path init wrote (./.trellara/<config>/<flow>/target)",
        );
    }
    if throwaway.is_some() && environment == Environment::Production {
        issue(
            at("target.throwaway"),
            "a throwaway target is refused in environment: production".into(),
            "point the target at a real database with url_env or url_file",
        );
    }
}

/// The source and target connection strings: one form each, none inline
/// in production.
fn flow_secrets(environment: Environment, i: usize, flow: &Flow, issues: &mut Issues) {
    let at = |field: &str| format!("flows[{i}].{field}");
    let mut issue = |field: String, problem: String, fix: &str| issues.add(field, problem, fix);
    let mut sides = vec![("source".to_owned(), &flow.source.url, false)];
    for sink in flow.sinks() {
        let field = sink.field(i);
        let side = field
            .strip_prefix(&format!("flows[{i}]."))
            .unwrap_or(&field);
        sides.push((
            side.to_owned(),
            &sink.target.url,
            sink.target.throwaway.is_some(),
        ));
    }
    for (side, secret, throwaway) in sides {
        let side = side.as_str();
        // A sink of a `sinks:` list has no throwaway form.
        let listed = side.starts_with("sinks[");
        let set = [
            secret.url.is_some(),
            secret.url_env.is_some(),
            secret.url_file.is_some(),
            throwaway,
        ]
        .iter()
        .filter(|&&b| b)
        .count();
        if set != 1 {
            issue(
                at(side),
                if side != "source" && !listed {
                    format!("has {set} of url, url_env, url_file, throwaway")
                } else {
                    format!("has {set} of url, url_env, url_file")
                },
                if side != "source" && !listed {
                    "give exactly one of url, url_env, url_file or throwaway"
                } else {
                    "give exactly one of url, url_env or url_file"
                },
            );
        }
        if secret.url.is_some() && environment == Environment::Production {
            issue(
                at(&format!("{side}.url")),
                "inline connection strings are refused in environment: production".into(),
                "use url_env: VAR_NAME or url_file: /absolute/path",
            );
        }
        if let Some(path) = &secret.url_file
            && !path.is_absolute()
        {
            issue(
                at(&format!("{side}.url_file")),
                format!("{} is not an absolute path", path.display()),
                "use an absolute path",
            );
        }
    }
}

/// `target:` or `sinks:`, each sink named once and pointed at a database
/// of its own.
fn flow_sinks(i: usize, flow: &Flow, issues: &mut Issues) {
    let at = |field: &str| format!("flows[{i}].{field}");
    let mut issue = |field: String, problem: String, fix: &str| issues.add(field, problem, fix);
    match (&flow.target, flow.sinks.is_empty()) {
        (None, true) => issue(
            at("target"),
            "is missing, and no sink is listed under sinks:".into(),
            "give the flow a target: (url, url_env or url_file), or list its sinks (name and target) under sinks:",
        ),
        (Some(_), false) => issue(
            at("sinks"),
            "is given besides target:".into(),
            "list the flow's target as one of its sinks, or keep target: alone",
        ),
        _ => {}
    }
    if flow.sinks.len() > 1 && matches!(flow.transport, Transport::Kafka { .. }) {
        issue(
            at("transport.kind"),
            format!(
                "is kafka, and the flow has {} sinks: several sinks read the local log, not a topic (not built yet)",
                flow.sinks.len()
            ),
            "use transport kind: local for a flow with several sinks, or one flow per topic",
        );
    }
    let mut names = std::collections::HashSet::new();
    let mut urls: Vec<(SourceRef, usize)> = Vec::new();
    for (s, sink) in flow.sinks.iter().enumerate() {
        let at = |field: &str| format!("flows[{i}].sinks[{s}].{field}");
        if !valid_name(&sink.name) {
            issue(
                at("name"),
                format!("{:?} is not a valid sink name", sink.name),
                "use 1-40 lower-case letters, digits, '_' or '-'",
            );
        }
        if !names.insert(sink.name.as_str()) {
            issue(
                at("name"),
                format!("{:?} names another sink of this flow", sink.name),
                "give each sink its own name: it is the sink's dataset_id",
            );
        }
        if sink.target.throwaway.is_some() {
            issue(
                at("target.throwaway"),
                "a throwaway target is init --evaluate's one target".into(),
                "point each sink at a database with url, url_env or url_file",
            );
        }
        let url = &sink.target.url;
        let named = (url.url.clone(), url.url_env.clone(), url.url_file.clone());
        // One with none is refused as such (flow_secrets), not as a twin.
        let none = named == (None, None, None);
        if !none && let Some((_, first)) = urls.iter().find(|(u, _)| *u == named) {
            issue(
                at("target"),
                format!("is the target of sinks[{first}] too"),
                "give each sink a database of its own: two sinks on one database would apply every transaction twice",
            );
        } else {
            urls.push((named, s));
        }
    }
}

/// Explicit slot and publication names.
fn flow_names(i: usize, flow: &Flow, issues: &mut Issues) {
    let at = |field: &str| format!("flows[{i}].{field}");
    let mut issue = |field: String, problem: String, fix: &str| issues.add(field, problem, fix);
    for (field, value) in [
        ("source.slot", &flow.source.slot),
        ("source.publication", &flow.source.publication),
    ] {
        if let Some(v) = value
            && !crate::slot_name::is_valid(v)
        {
            issue(
                at(field),
                format!("{v:?} is not a valid name"),
                "use 1-63 lower-case letters, digits and underscores",
            );
        }
    }
}

/// The flow's tables: each schema.table, once, and never Trellara's own
/// state or the catalog.
fn flow_tables(i: usize, flow: &Flow, issues: &mut Issues) {
    let at = |field: &str| format!("flows[{i}].{field}");
    let mut issue = |field: String, problem: String, fix: &str| issues.add(field, problem, fix);
    if flow.tables.is_empty() {
        issue(
            at("tables"),
            "is empty".into(),
            "list the tables to replicate, e.g. [public.sales]",
        );
    }
    let mut seen = Vec::new();
    for (t, table) in flow.tables.iter().enumerate() {
        match TableName::parse(table) {
            Err(e) => issue(
                format!("flows[{i}].tables[{t}]"),
                format!("{table:?} {e}"),
                "write schema.table as SQL does: public.sales, or public.\"Sales\" for a mixed-case name",
            ),
            // Trellara's own state and the catalog are never data to move:
            // applying them would overwrite the target's checkpoints.
            Ok(name)
                if matches!(
                    name.schema.as_str(),
                    "trellara" | "pg_catalog" | "information_schema"
                ) || name.schema.starts_with("pg_toast") =>
            {
                issue(
                    format!("flows[{i}].tables[{t}]"),
                    format!(
                        "{table} is in schema {}, which is not replicated",
                        name.schema
                    ),
                    "list only the application's tables",
                )
            }
            Ok(name) if seen.contains(&name) => issue(
                format!("flows[{i}].tables[{t}]"),
                format!("{table} is listed twice (as {name})"),
                "list each table once",
            ),
            Ok(name) => seen.push(name),
        }
    }
}

/// A Kafka transport's brokers and topic, one topic per flow.
fn flow_transport(i: usize, flow: &Flow, shared: &mut Shared, issues: &mut Issues) {
    let at = |field: &str| format!("flows[{i}].{field}");
    let mut issue = |field: String, problem: String, fix: &str| issues.add(field, problem, fix);
    if let Transport::Kafka { topic, .. } = &flow.transport
        && !shared.topics.insert(topic.clone())
    {
        issue(
            at("transport.topic"),
            format!("{topic:?} is the topic of another flow"),
            "give each flow its own topic: each applier applies all it reads",
        );
    }
    if let Transport::Kafka { brokers, topic, .. } = &flow.transport {
        let bad_broker = brokers.split(',').any(|b| {
            b.trim()
                .rsplit_once(':')
                .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
        });
        if bad_broker {
            issue(
                at("transport.brokers"),
                format!("{brokers:?} is not host:port[,host:port...]"),
                "list the bootstrap brokers, e.g. 127.0.0.1:9092",
            );
        }
        let topic_ok = !topic.is_empty()
            && topic.len() <= 249
            && topic
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !topic_ok {
            issue(
                at("transport.topic"),
                format!("{topic:?} is not a Kafka topic name"),
                "use 1-249 characters of a-z A-Z 0-9 . _ -",
            );
        }
    }
}

/// `schema.table` quoted for SQL (postgres-protocol's escape_identifier).
pub fn quote_table(name: &str) -> Option<String> {
    TableName::parse(name).ok().map(|t| t.quoted())
}

impl Flow {
    fn default_name(&self) -> String {
        format!("trellara_{}", self.name.replace('-', "_"))
    }

    pub fn slot(&self) -> String {
        self.source
            .slot
            .clone()
            .unwrap_or_else(|| self.default_name())
    }

    pub fn publication(&self) -> String {
        self.source
            .publication
            .clone()
            .unwrap_or_else(|| self.default_name())
    }

    pub fn source_id(&self) -> String {
        self.source
            .source_id
            .clone()
            .unwrap_or_else(|| self.name.clone())
    }

    /// The flow's sinks, in order: its `target:` (named after the flow), or
    /// its `sinks:`.
    pub fn sinks(&self) -> Vec<SinkRef<'_>> {
        match &self.target {
            Some(target) => vec![SinkRef {
                name: &self.name,
                target,
                position: None,
            }],
            None => self
                .sinks
                .iter()
                .enumerate()
                .map(|(p, s)| SinkRef {
                    name: &s.name,
                    target: &s.target,
                    position: Some(p),
                })
                .collect(),
        }
    }

    /// The throwaway cluster `init --evaluate` made for the flow's target.
    pub fn throwaway(&self) -> Option<&Path> {
        self.target.as_ref()?.throwaway.as_deref()
    }

    /// The first sink: the one a first run copies its snapshot into and
    /// whose target holds the flow's boundary. A config that passed
    /// [`validate`] has one.
    pub fn first_sink(&self) -> Option<SinkRef<'_>> {
        self.sinks().into_iter().next()
    }

    /// The log's size limit in bytes (local transport).
    pub fn retention_bytes(&self) -> Option<u64> {
        match &self.transport {
            Transport::Local { retention_mib, .. } | Transport::Kafka { retention_mib, .. } => {
                Some(retention_mib << 20)
            }
        }
    }

    pub fn log_dir(&self) -> Option<&Path> {
        match &self.transport {
            Transport::Local { log_dir, .. } | Transport::Kafka { log_dir, .. } => Some(log_dir),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
schema_version: 2
environment: evaluation
flows:
  - name: shop
    source:
      url: postgresql://postgres@127.0.0.1:5432/shop
    target:
      url_env: TARGET_URL
    tables: [public.orders, public.line_items]
";

    #[test]
    fn a_minimal_config_is_valid_with_defaults() {
        let c = parse(GOOD).expect("parses");
        assert!(validate(&c).is_empty(), "{:?}", validate(&c));
        let f = &c.flows[0];
        assert_eq!(
            (f.slot(), f.publication(), f.source_id()),
            (
                "trellara_shop".into(),
                "trellara_shop".into(),
                "shop".into()
            )
        );
        assert_eq!(f.capture, CapturePath::External);
        assert_eq!(f.log_dir(), Some(Path::new("./.trellara/log")));
        assert!(
            !format!("{:?}", f.source.url).contains("postgres@"),
            "debug output redacts the URL"
        );
    }

    #[test]
    fn a_rename_must_name_a_flow_table_and_a_new_name_of_its_shape() {
        let with = |rename: &str| {
            let text = format!("{GOOD}    schema: {{rename: {{{rename}}}}}\n");
            let issues = validate(&parse(&text).expect("parses"));
            issues
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(
            with("public.orders.cust: customer, public.orders: public.sales"),
            ""
        );
        assert!(with("public.other.a: b").contains("names none of the flow's tables"));
        assert!(with("public.orders.cust: x.y").contains("not a new column name"));
    }

    #[test]
    fn state_catalog_and_duplicated_tables_are_refused() {
        for (tables, problem) in [
            ("[trellara.checkpoints]", "schema trellara"),
            ("[pg_catalog.pg_class]", "schema pg_catalog"),
            ("[public.orders, public.orders]", "listed twice"),
        ] {
            let config =
                parse(&GOOD.replace("[public.orders, public.line_items]", tables)).expect("parses");
            let issues = validate(&config);
            assert!(
                issues.iter().any(|i| i.problem.contains(problem)),
                "{tables}: {issues:?}"
            );
        }
    }

    #[test]
    fn a_log_level_that_does_not_parse_is_refused_by_name() {
        for (level, valid) in [
            ("info", true),
            ("warn,trellara_relay=debug", true),
            ("trellara_relay=loud", false),
        ] {
            let config =
                parse(&format!("service:\n  log_level: {level:?}\n{GOOD}")).expect("parses");
            let issues = validate(&config);
            assert_eq!(
                !issues.iter().any(|i| i.field == "service.log_level"),
                valid,
                "{level}: {issues:?}"
            );
        }
    }

    #[test]
    fn a_parse_error_quotes_no_value() {
        for text in [
            "schema_version: 2\nflows:\n  - name: a\n    source: \"postgresql://u:hunter2@h/db\"\n",
            "schema_version: 2\nflows:\n  - name: a\n    source:\n      url: [\"postgresql://u:hunter2@h/db\"]\n",
            "schema_version: hunter2\nflows: []\n",
            "schema_version: \"pa\\\"hunter2\"\nflows: []\n",
        ] {
            let err = parse(text).expect_err("invalid");
            assert!(!err.contains("hunter2"), "{err}");
            assert!(err.contains("line"), "names where: {err}");
        }
    }

    #[test]
    fn typos_are_errors_naming_the_field() {
        let err = parse(&GOOD.replace("tables:", "tabels:")).expect_err("unknown field");
        assert!(err.contains("tabels"), "{err}");
    }

    #[test]
    fn every_issue_names_field_and_fix() {
        let bad = GOOD
            .replace("schema_version: 2", "schema_version: 1")
            .replace("environment: evaluation", "environment: production")
            .replace("name: shop", "name: Shop!")
            .replace("public.line_items", "line_items");
        let issues = validate(&parse(&bad).expect("parses"));
        let fields: Vec<&str> = issues.iter().map(|i| i.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "schema_version",
                "flows[0].name",
                "flows[0].source.url",
                "flows[0].tables[1]"
            ]
        );
        assert!(issues.iter().all(|i| !i.fix.is_empty()));
    }

    #[test]
    fn each_issue_names_its_line() {
        let bad = GOOD
            .replace("schema_version: 2", "schema_version: 1")
            .replace("name: shop", "name: Shop!")
            .replace("public.line_items", "line_items")
            .replace(
                "    target:\n      url_env: TARGET_URL\n",
                "    target: {}\n",
            );
        let issues = located(&bad, validate(&parse(&bad).expect("parses")));
        let lines: Vec<(&str, Option<usize>)> =
            issues.iter().map(|i| (i.field.as_str(), i.line)).collect();
        // GOOD starts with an empty line: schema_version is on line 2.
        assert_eq!(
            lines,
            [
                ("schema_version", Some(2)),
                ("flows[0].name", Some(5)),
                // A field the text lacks: the line of what encloses it.
                ("flows[0].target", Some(8)),
                ("flows[0].tables[1]", Some(9)),
            ]
        );
        assert!(
            issues[3]
                .to_string()
                .starts_with("flows[0].tables[1] (line 9): ")
        );
        let block = "flows:\n  - name: a\n  - name: b\n    tables:\n      - x.y\n      - z\n";
        assert_eq!(line_of(block, "flows[1].tables[1]"), Some(6));
        assert_eq!(line_of(block, "flows[1].name"), Some(3));
        assert_eq!(line_of(block, "flows[0].tables"), Some(2));
    }

    #[test]
    fn a_parse_error_names_its_field_and_line() {
        let bad = GOOD.replace("url_env: TARGET_URL", "url_env: TARGET_URL\n      bogus: 1");
        let issue = parse_issue(&bad, &parse(&bad).expect_err("unknown field"));
        assert_eq!(issue.field, "flows[0].target");
        assert_eq!(
            issue.line,
            Some(10),
            "the unknown key's own line: {issue:?}"
        );
        assert!(
            !issue.problem.contains("at line"),
            "the line once: {issue:?}"
        );
        assert!(issue.problem.contains("unknown field `bogus`"), "{issue:?}");
        assert!(issue.fix.contains("docs/CONFIG.md"), "{issue:?}");
    }

    #[test]
    fn mixed_case_tables_are_as_sql_spells_them() {
        let text = GOOD.replace(
            "[public.orders, public.line_items]",
            "[public.orders, 'public.\"Sales\"', Public.Orders, 'public.\"bad']",
        );
        let mut config = parse(&text).expect("parses");
        let issues = validate(&config);
        let problems: Vec<(&str, &str)> = issues
            .iter()
            .map(|i| (i.field.as_str(), i.problem.as_str()))
            .collect();
        assert_eq!(
            problems,
            [
                (
                    "flows[0].tables[2]",
                    "Public.Orders is listed twice (as public.orders)"
                ),
                (
                    "flows[0].tables[3]",
                    "\"public.\\\"bad\" has a quoted identifier without its closing \""
                ),
            ]
        );
        config.flows[0].tables.truncate(2);
        canonical_tables(&mut config.flows[0]);
        assert_eq!(
            config.flows[0].tables,
            ["public.orders", "public.\"Sales\""]
        );
        assert_eq!(
            quote_table(&config.flows[0].tables[1]).as_deref(),
            Some("\"public\".\"Sales\"")
        );
    }

    #[test]
    fn kafka_transport_is_checked() {
        let kafka = |brokers: &str, topic: &str| {
            format!(
                "{GOOD}    transport:\n      kind: kafka\n      brokers: \"{brokers}\"\n      topic: \"{topic}\"\n"
            )
        };
        let good = parse(&kafka("127.0.0.1:9092,b:9093", "trellara.shop")).expect("parses");
        assert!(validate(&good).is_empty(), "{:?}", validate(&good));
        assert!(good.flows[0].log_dir().is_some(), "kafka keeps a local log");
        let bad = validate(&parse(&kafka("nohost", "a/b")).expect("parses"));
        let fields: Vec<&str> = bad.iter().map(|i| i.field.as_str()).collect();
        assert_eq!(
            fields,
            ["flows[0].transport.brokers", "flows[0].transport.topic"]
        );
    }

    #[test]
    fn two_flows_cannot_share_a_log() {
        let second = "
  - name: other
    source:
      url: postgresql://postgres@127.0.0.1:5432/shop
    target:
      url_env: TARGET_URL
    tables: [public.sales]
";
        let issues = validate(&parse(&format!("{GOOD}{second}")).expect("parses"));
        assert_eq!(issues.len(), 1, "{issues:?}");
        assert_eq!(issues[0].field, "flows[1].transport.log_dir");
        let own = format!(
            "{GOOD}{second}    transport:\n      kind: local\n      log_dir: ./.trellara/other\n"
        );
        assert!(validate(&parse(&own).expect("parses")).is_empty());
    }

    #[test]
    fn two_flows_on_one_source_cannot_share_a_slot_or_publication() {
        let second = |name: &str, url: &str| {
            format!(
                "  - name: {name}\n    source:\n      url: {url}\n    target:\n      url_env: TARGET_URL\n    tables: [public.sales]\n    transport:\n      kind: local\n      log_dir: ./.trellara/{name}\n"
            )
        };
        let shop = "postgresql://postgres@127.0.0.1:5432/shop";
        // `shop-x` and `shop_x` default to the same names.
        let clash = format!(
            "{GOOD}    transport:\n      kind: local\n      log_dir: ./.trellara/a\n{}{}",
            second("shop-x", shop),
            second("shop_x", shop)
        );
        let issues = validate(&parse(&clash).expect("parses"));
        let fields: Vec<&str> = issues.iter().map(|i| i.field.as_str()).collect();
        assert_eq!(
            fields,
            ["flows[2].source.slot", "flows[2].source.publication"],
            "{issues:?}"
        );
        // On other sources the same names are each source's own.
        let apart = format!(
            "{GOOD}    transport:\n      kind: local\n      log_dir: ./.trellara/a\n{}{}",
            second("shop-x", "postgresql://postgres@127.0.0.1:5433/shop"),
            second("shop_x", "postgresql://postgres@127.0.0.1:5434/shop")
        );
        let issues = validate(&parse(&apart).expect("parses"));
        assert!(issues.is_empty(), "{issues:?}");
    }

    #[test]
    fn secrets_resolve_from_env_and_file() {
        let dir = std::env::temp_dir().join(format!("trellara-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("url");
        std::fs::write(&file, "postgresql://u@h/db\n").expect("write");
        let by_file = SecretRef {
            url_file: Some(file),
            ..SecretRef::default()
        };
        assert_eq!(
            by_file.resolve("target").expect("file"),
            "postgresql://u@h/db"
        );
        std::fs::write(
            by_file.url_file.as_ref().expect("path"),
            "postgresql://u@h/db\npostgresql://u@other/db\n",
        )
        .expect("write");
        let err = by_file.resolve("target").expect_err("two lines");
        assert!(err.problem.contains("2 non-empty lines"), "{err}");
        let missing = SecretRef {
            url_env: Some("TRELLARA_SURELY_UNSET_VAR".into()),
            ..SecretRef::default()
        };
        let err = missing.resolve("flows[0].target").expect_err("unset");
        assert_eq!(err.field, "flows[0].target.url_env");
    }
    const SINKS: &str = "
schema_version: 2
flows:
  - name: shop
    source:
      url: postgresql://postgres@127.0.0.1:5432/shop
    sinks:
      - name: shop
        target:
          url_env: SHOP_TARGET
      - name: analytics
        target:
          url: postgresql://u:hunter2@a.example/lake
    tables: [public.orders]
";

    #[test]
    fn sinks_name_each_target_and_a_target_is_one_sink() {
        let c = parse(SINKS).expect("parses");
        assert!(validate(&c).is_empty(), "{:?}", validate(&c));
        let sinks = c.flows[0].sinks();
        let named: Vec<(&str, String)> = sinks.iter().map(|s| (s.name, s.field(0))).collect();
        assert_eq!(
            named,
            [
                ("shop", "flows[0].sinks[0].target".to_owned()),
                ("analytics", "flows[0].sinks[1].target".to_owned())
            ]
        );
        let one = parse(GOOD).expect("parses");
        let sinks = one.flows[0].sinks();
        assert_eq!(
            sinks
                .iter()
                .map(|s| (s.name, s.field(0)))
                .collect::<Vec<_>>(),
            [("shop", "flows[0].target".to_owned())]
        );
        // A sink's inline password is redacted as a target's is, and the
        // copy reads back as the same shape.
        let yaml = to_yaml(&c.redacted()).expect("yaml");
        assert!(!yaml.contains("hunter2"), "{yaml}");
        let back = parse(&yaml).expect("reads back");
        assert!(back.flows[0].target.is_none());
        assert_eq!(back.flows[0].sinks.len(), 2);
    }

    #[test]
    fn sinks_are_refused_by_field_when_they_clash() {
        let fields = |text: &str| -> Vec<(String, String)> {
            validate(&parse(text).expect("parses"))
                .into_iter()
                .map(|i| (i.field, i.problem))
                .collect()
        };
        let both = SINKS.replace(
            "    sinks:\n",
            "    target:\n      url_env: T\n    sinks:\n",
        );
        assert_eq!(fields(&both)[0].0, "flows[0].sinks");
        let neither = GOOD.replace("    target:\n      url_env: TARGET_URL\n", "");
        assert_eq!(
            fields(&neither),
            [(
                "flows[0].target".to_owned(),
                "is missing, and no sink is listed under sinks:".to_owned()
            )]
        );
        let twice = SINKS.replace("name: analytics", "name: shop");
        assert_eq!(
            fields(&twice),
            [(
                "flows[0].sinks[1].name".to_owned(),
                "\"shop\" names another sink of this flow".to_owned()
            )]
        );
        let same = SINKS.replace(
            "url: postgresql://u:hunter2@a.example/lake",
            "url_env: SHOP_TARGET",
        );
        assert_eq!(
            fields(&same),
            [(
                "flows[0].sinks[1].target".to_owned(),
                "is the target of sinks[0] too".to_owned()
            )]
        );
        let bad_name = SINKS.replace("name: analytics", "name: Lake");
        assert_eq!(fields(&bad_name)[0].0, "flows[0].sinks[1].name");
        let empty = SINKS.replace("          url_env: SHOP_TARGET", "          {}");
        let empty = empty.replace("        target:\n          {}", "        target: {}");
        assert_eq!(
            fields(&empty),
            [(
                "flows[0].sinks[0].target".to_owned(),
                "has 0 of url, url_env, url_file".to_owned()
            )],
            "one problem, and no twin of another sink"
        );
        let none = GOOD.replace(
            "    target:\n      url_env: TARGET_URL\n",
            "    sinks: []\n",
        );
        assert_eq!(fields(&none)[0].0, "flows[0].target");
        let two_urls = SINKS.replace(
            "          url_env: SHOP_TARGET",
            "          url_env: SHOP_TARGET\n          url_file: /etc/t",
        );
        assert_eq!(
            fields(&two_urls),
            [(
                "flows[0].sinks[0].target".to_owned(),
                "has 2 of url, url_env, url_file".to_owned()
            )]
        );
        let kafka = format!(
            "{SINKS}    transport:\n      kind: kafka\n      brokers: \"127.0.0.1:9092\"\n      topic: shop\n"
        );
        assert_eq!(fields(&kafka)[0].0, "flows[0].transport.kind");
        let production = SINKS.replace("flows:", "environment: production\nflows:");
        assert_eq!(
            fields(&production)[1..],
            [(
                "flows[0].sinks[1].target.url".to_owned(),
                "inline connection strings are refused in environment: production".to_owned()
            )]
        );
    }
}
