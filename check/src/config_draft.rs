//! `--write-config`: a minimal `trellara.yml` draft from an assessment.
//!
//! Invariants:
//! - No draft is written for a blocked or unassessed source: the refusal
//!   names every critical finding.
//! - The draft never holds a credential: the URLs are references to
//!   `TRELLARA_SOURCE_DATABASE_URL` and `TRELLARA_TARGET_DATABASE_URL`
//!   (`environment: production`).
//! - It is a valid schema v2 config (`trellara check --config` passes it):
//!   one flow over the assessed tables, `capture: external`, the local log,
//!   written by serialising the relay's own config model.
//!   Without a table there is no flow, so no draft.

use crate::report::{Report, Verdict};
use std::fmt::Write as _;
use std::path::Path;
use trellara_common::config::{
    self, CapturePath, Config, Environment, Flow, SecretRef, ServiceConfig, Source, Target,
    Transport,
};

/// The environment variable the draft points the source at.
pub const SOURCE_URL_ENV: &str = "TRELLARA_SOURCE_DATABASE_URL";
/// The environment variable the draft points the target at.
pub const TARGET_URL_ENV: &str = "TRELLARA_TARGET_DATABASE_URL";

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("not writing a config: the source is blocked by {0}")]
    Blocked(String),
    #[error("not writing a config: the source could not be fully assessed")]
    Unassessed,
    #[error(
        "not writing a config: a flow needs its tables\nhint: pass --table schema.name (repeat for more)"
    )]
    NoTables,
    #[error("not writing a config: it would be invalid:\n{0}")]
    Invalid(String),
    #[error("could not write the draft")]
    Yaml(#[source] config::ConfigError),
    #[error("could not write {path}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The YAML text of the draft, or why there is none.
pub fn draft(report: &Report, tables: &[String]) -> Result<String, DraftError> {
    match report.verdict() {
        Verdict::Ready => {}
        Verdict::Blocked => {
            let names: Vec<String> = report
                .critical()
                .map(|f| match &f.subject {
                    Some(s) => format!("{} {} ({s})", f.rule, f.name),
                    None => format!("{} {}", f.rule, f.name),
                })
                .collect();
            return Err(DraftError::Blocked(names.join(", ")));
        }
        Verdict::Unassessed => return Err(DraftError::Unassessed),
    }
    if tables.is_empty() {
        return Err(DraftError::NoTables);
    }
    let flow = flow_name(&report.facts.server.database);
    let reference = |var: &str| SecretRef {
        url_env: Some(var.to_owned()),
        ..SecretRef::default()
    };
    let config = Config {
        schema_version: config::SCHEMA_VERSION,
        environment: Environment::Production,
        flows: vec![Flow {
            source: Source {
                url: reference(SOURCE_URL_ENV),
                source_id: None,
                slot: None,
                publication: None,
            },
            target: Some(Target {
                url: reference(TARGET_URL_ENV),
                throwaway: None,
            }),
            sinks: Vec::new(),
            tables: tables.iter().map(|t| t.trim().to_owned()).collect(),
            capture: CapturePath::External,
            transport: Transport::Local {
                log_dir: format!("./.trellara/{flow}/log").into(),
                retention_mib: config::DEFAULT_RETENTION_MIB,
            },
            schema: config::SchemaPolicy::default(),
            name: flow,
        }],
        service: ServiceConfig::default(),
    };
    let issues = config::validate(&config);
    if !issues.is_empty() {
        let list: Vec<String> = issues.iter().map(|i| format!("  {i}")).collect();
        return Err(DraftError::Invalid(list.join("\n")));
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# trellara.yml draft written by trellara-check {} from {} (grade {}); see docs/CONFIG.md.",
        env!("CARGO_PKG_VERSION"),
        report.target,
        report.grade.letter
    );
    let _ = writeln!(
        out,
        "# Export {SOURCE_URL_ENV} and {TARGET_URL_ENV}, then: trellara preflight --config <this file>"
    );
    out.push_str(&config::to_yaml(&config).map_err(DraftError::Yaml)?);
    Ok(out)
}

/// A flow name from a database name: 1-40 of `a-z 0-9 _ -`.
fn flow_name(database: &str) -> String {
    let mut name: String = database
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(32)
        .collect();
    if name.is_empty() {
        name.push_str("source");
    }
    name.push_str("-capture");
    name
}

/// Writes the draft to `path` (see [`draft`]).
pub fn write(report: &Report, tables: &[String], path: &Path) -> Result<(), DraftError> {
    let text = draft(report, tables)?;
    trellara_common::owner_only::write(path, text.as_bytes()).map_err(|source| DraftError::Write {
        path: path.display().to_string(),
        source,
    })
}
