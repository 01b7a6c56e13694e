//! A flow resolved into what a run uses: where source and target are, the
//! slot, publication and ids, the log, the transport, and the tuning every
//! stage runs with. `trellara config show` prints it; a run takes its
//! tuning from [`Tuning::DEFAULT`], so what is shown is what runs.
//!
//! Resolving has no side effect: a throwaway target is named, not started,
//! and a reference that does not resolve (an unset variable, a missing
//! file) is shown with its problem instead of failing the whole plan.

use crate::config::{CapturePath, Config, Flow, SecretRef, Transport};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;

/// The timings and sizes of a run. One place, so the CLI, the services and
/// `config show` agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Tuning {
    /// Capture: bytes of a transaction held in memory before it spills.
    pub memory_budget_bytes: usize,
    /// Capture: a large transaction's chunk size in the log.
    pub chunk_bytes: usize,
    /// Capture: how often standby status goes to the source.
    #[serde(with = "millis", rename = "status_interval_ms")]
    pub status_interval: Duration,
    /// Capture: the longest wait between reconnects to the source.
    #[serde(with = "millis", rename = "max_backoff_ms")]
    pub max_backoff: Duration,
    /// Apply: how long a chunked transaction's target transaction waits
    /// for its next chunk before it rolls back and retries.
    #[serde(with = "millis", rename = "chunk_patience_ms")]
    pub chunk_patience: Duration,
    /// Apply: how often the log cursor is persisted while applying.
    #[serde(with = "millis", rename = "cursor_every_ms")]
    pub cursor_every: Duration,
    /// Apply: nothing new for this long is idle.
    #[serde(with = "millis", rename = "idle_tick_ms")]
    pub idle_tick: Duration,
    /// How often a following run trims the log.
    #[serde(with = "millis", rename = "retention_every_ms")]
    pub retention_every: Duration,
    /// How often the gauges (slot WAL, log bytes) are read.
    #[serde(with = "millis", rename = "gauges_every_ms")]
    pub gauges_every: Duration,
    /// `run --follow`: first wait before following again after an error;
    /// it doubles up to `retry_max` and starts over after a round that
    /// ran `retry_reset`.
    #[serde(with = "millis", rename = "retry_first_ms")]
    pub retry_first: Duration,
    #[serde(with = "millis", rename = "retry_max_ms")]
    pub retry_max: Duration,
    #[serde(with = "millis", rename = "retry_reset_ms")]
    pub retry_reset: Duration,
}

impl Tuning {
    pub const DEFAULT: Tuning = Tuning {
        memory_budget_bytes: 64 << 20,
        chunk_bytes: 4 << 20,
        status_interval: Duration::from_millis(200),
        max_backoff: Duration::from_secs(10),
        chunk_patience: Duration::from_secs(2),
        cursor_every: Duration::from_millis(500),
        idle_tick: Duration::from_millis(50),
        retention_every: Duration::from_secs(10),
        gauges_every: Duration::from_secs(2),
        retry_first: Duration::from_secs(1),
        retry_max: Duration::from_secs(30),
        retry_reset: Duration::from_secs(60),
    };
}

mod millis {
    pub fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_u128(d.as_millis())
    }
}

/// Where a database is, as far as it can be told without connecting.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Endpoint {
    /// A connection string, its password redacted; `from` says where it
    /// came from (`inline`, `env:VAR`, `file:PATH`).
    Url { url: String, from: String },
    /// The throwaway local cluster `init --evaluate` made (started by the
    /// first command that needs it).
    Throwaway { dir: PathBuf },
    /// A reference that does not resolve here.
    Unresolved { from: String, problem: String },
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Url { url, from } => write!(f, "{url} (from {from})"),
            Endpoint::Throwaway { dir } => write!(f, "throwaway cluster in {}", dir.display()),
            Endpoint::Unresolved { problem, .. } => write!(f, "unresolved: {problem}"),
        }
    }
}

/// The transport as a run sets it up.
#[derive(Debug, Clone, Serialize)]
pub struct TransportPlan {
    pub kind: &'static str,
    pub log_dir: PathBuf,
    pub retention_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub brokers: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
}

/// One sink of a flow, resolved.
#[derive(Debug, Clone, Serialize)]
pub struct SinkPlan {
    /// The sink's name in metrics and evidence.
    pub dataset_id: String,
    pub target: Endpoint,
    /// Its applier's log cursor (or Kafka consumer group).
    pub cursor: String,
}

/// One flow, resolved.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub flow: String,
    pub source: Endpoint,
    pub sinks: Vec<SinkPlan>,
    pub slot: String,
    pub publication: String,
    pub source_id: String,
    pub tables: Vec<String>,
    pub capture: CapturePath,
    pub transport: TransportPlan,
    /// Where `run --follow` serves its endpoints.
    pub listen: std::net::SocketAddr,
    pub tuning: Tuning,
}

impl Plan {
    /// `flows[index]` of `config`, resolved without side effects.
    pub fn resolve(config: &Config, index: usize) -> Plan {
        let flow: &Flow = &config.flows[index];
        let sinks = flow
            .sinks()
            .into_iter()
            .map(|sink| SinkPlan {
                dataset_id: sink.name.to_owned(),
                target: match &sink.target.throwaway {
                    Some(dir) => Endpoint::Throwaway { dir: dir.clone() },
                    None => endpoint(&sink.target.url, &sink.field(index)),
                },
                cursor: crate::apply::sink_cursor(&flow.name, sink.name),
            })
            .collect();
        let (kind, log_dir, retention_mib, brokers, topic) = match &flow.transport {
            Transport::Local {
                log_dir,
                retention_mib,
            } => ("local", log_dir, retention_mib, None, None),
            Transport::Kafka {
                brokers,
                topic,
                log_dir,
                retention_mib,
            } => (
                "kafka",
                log_dir,
                retention_mib,
                Some(brokers.clone()),
                Some(topic.clone()),
            ),
        };
        Plan {
            flow: flow.name.clone(),
            source: endpoint(&flow.source.url, &format!("flows[{index}].source")),
            sinks,
            slot: flow.slot(),
            publication: flow.publication(),
            source_id: flow.source_id(),
            tables: flow.tables.clone(),
            capture: flow.capture,
            transport: TransportPlan {
                kind,
                log_dir: log_dir.clone(),
                retention_bytes: retention_mib << 20,
                brokers,
                topic,
            },
            listen: config.service.relay_listen,
            tuning: Tuning::DEFAULT,
        }
    }
}

fn endpoint(secret: &SecretRef, field: &str) -> Endpoint {
    let from = match (&secret.url, &secret.url_env, &secret.url_file) {
        (Some(_), _, _) => "inline".to_owned(),
        _ => secret.to_string(),
    };
    match secret.resolve(field) {
        Ok(url) => Endpoint::Url {
            url: trellara_check::redact(&url),
            from,
        },
        Err(issue) => Endpoint::Unresolved {
            from,
            problem: issue
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned(),
        },
    }
}
