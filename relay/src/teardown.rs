//! `trellara teardown`: removes a flow's footprint - its slot (which holds
//! WAL on the source), the publication if Trellara created it, the
//! settings and worker of native capture, its state rows on the target and
//! its log directory - and says exactly what it removed. The target's
//! tables and their rows are kept, as is a Kafka topic.
//!
//! The plan is read first and changes nothing; it is carried out only when
//! asked, and never while the flow runs (its log is locked or its slot is
//! being streamed). A publication is Trellara's when its comment says so:
//! `run` marks the ones it creates; one the operator made is left.

use crate::config::{CapturePath, Flow, Transport};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio_postgres::Client;

/// The comment `run` puts on a publication it creates.
pub fn publication_marker(flow: &str) -> String {
    format!("created by trellara for flow {flow}")
}

/// [`publication_marker`] as an SQL string literal.
pub fn publication_marker_literal(flow: &str) -> String {
    format!("'{}'", publication_marker(flow).replace('\'', "''"))
}

use crate::state::TABLES as STATE_TABLES;

/// The settings native capture sets with ALTER SYSTEM.
const NATIVE_SETTINGS: [&str; 5] = [
    "trellara.slot",
    "trellara.source_id",
    "trellara.dataset_id",
    "trellara.socket_path",
    "trellara.tables",
];

/// One thing teardown removes.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Step {
    /// Stop the native capture worker and reset the settings run set.
    NativeCapture {
        settings: Vec<String>,
    },
    Slot {
        name: String,
    },
    Publication {
        name: String,
    },
    StateRows {
        rows: i64,
    },
    LogDirectory {
        path: String,
    },
    /// The throwaway target `init --evaluate` made (crate::throwaway).
    ThrowawayTarget {
        path: String,
    },
}

impl Step {
    pub fn describe(&self, flow: &str) -> String {
        match self {
            Step::NativeCapture { settings } => format!(
                "stop the trellara capture worker on the source and reset {} (ALTER SYSTEM RESET, reload)",
                settings.join(", ")
            ),
            Step::Slot { name } => format!("replication slot {name} on the source"),
            Step::Publication { name } => {
                format!("publication {name} on the source (created by trellara)")
            }
            Step::StateRows { rows } => format!(
                "{rows} state rows of flow {flow} on the target ({})",
                STATE_TABLES.join(", ")
            ),
            Step::LogDirectory { path } => format!("log directory {path} (and its lock file)"),
            Step::ThrowawayTarget { path } => format!(
                "the throwaway target cluster in {path}: stopped, and removed with its data"
            ),
        }
    }
}

/// What teardown would remove for one flow, and what it keeps.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub flow: String,
    pub steps: Vec<Step>,
    pub kept: Vec<String>,
    #[serde(skip)]
    log_dir: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    #[error(
        "flow {flow} is running ({why}); nothing was removed\nhint: stop the trellara process running it (SIGTERM), then teardown again"
    )]
    Running { flow: String, why: String },
    #[error("the source database")]
    Source(#[source] tokio_postgres::Error),
    #[error("read the source's identity: {0}")]
    Owner(String),
    #[error("the target database")]
    Target(#[source] tokio_postgres::Error),
    #[error(transparent)]
    Throwaway(#[from] crate::throwaway::ThrowawayError),
    #[error("removed {removed}, then stopped (`teardown --yes` again removes the rest)")]
    Partly {
        removed: String,
        #[source]
        source: Box<TeardownError>,
    },
    #[error("log directory {path}")]
    LogDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Refuses while a process holds the flow's log: a run, a relay, or a
/// `--follow` waiting to follow again. Needs neither database.
pub fn refuse_running(flow: &Flow) -> Result<(), TeardownError> {
    // A run holds the lock file beside the log even while its snapshot
    // has removed the directory; look only when it exists (a dry run
    // creates nothing).
    if let Some(dir) = flow.log_dir()
        && crate::lock::lock_path(dir).exists()
        && crate::lock::try_lock(dir)
            .map_err(|source| TeardownError::LogDir {
                path: dir.display().to_string(),
                source,
            })?
            .is_none()
    {
        return Err(TeardownError::Running {
            flow: flow.name.clone(),
            why: format!("a trellara process holds its log {}", dir.display()),
        });
    }
    Ok(())
}

/// Reads what teardown would remove; changes nothing.
pub async fn plan(flow: &Flow, source: &Client, target: &Client) -> Result<Plan, TeardownError> {
    refuse_running(flow)?;
    // A run on another host holds the flow's lock on the target; taken
    // here, it also keeps a run from starting while teardown removes.
    if let Some(holder) = crate::state::lock_flow(target, &flow.name, crate::service::Role::Both)
        .await
        .map_err(TeardownError::Target)?
    {
        return Err(TeardownError::Running {
            flow: flow.name.clone(),
            why: format!("{holder} holds its lock on the target"),
        });
    }
    let mut steps = Vec::new();
    let mut kept = Vec::new();
    let slot = flow.slot();
    let active: Option<Option<i32>> = source
        .query_opt(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database()",
            &[&slot],
        )
        .await
        .map_err(TeardownError::Source)?
        .map(|r| r.get(0));
    if let Some(Some(pid)) = active
        && flow.capture == CapturePath::External
    {
        return Err(TeardownError::Running {
            flow: flow.name.clone(),
            why: format!("slot {slot} is being streamed by backend {pid}"),
        });
    }
    if flow.capture == CapturePath::Native {
        let mut ours = Vec::new();
        let has_extension: bool = source
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'trellara')",
                &[],
            )
            .await
            .map_err(TeardownError::Source)?
            .get(0);
        let set: Option<String> = source
            .query_one("SELECT current_setting('trellara.slot', true)", &[])
            .await
            .map_err(TeardownError::Source)?
            .get(0);
        // Settings another flow set are that flow's.
        if set.as_deref() == Some(slot.as_str()) {
            ours.extend(NATIVE_SETTINGS.iter().map(|s| (*s).to_owned()));
        }
        if has_extension && !ours.is_empty() {
            steps.push(Step::NativeCapture { settings: ours });
            kept.push("the trellara extension on the source (DROP EXTENSION trellara when nothing uses it)".into());
        }
    }
    // A slot (and publication) of the flow's name is this flow's only when
    // its target claimed it: another config's flow of the same name may
    // stream it.
    let ours = crate::state::owns_slot(target, &flow.name, &slot)
        .await
        .map_err(TeardownError::Target)?;
    if active.is_some() {
        if ours {
            steps.push(Step::Slot { name: slot });
        } else {
            kept.push(format!(
                "replication slot {slot} on the source: this flow's target has no record of creating it (another config's flow of the same name, or another tool's)"
            ));
        }
    }
    let publication = flow.publication();
    let comment: Option<Option<String>> = source
        .query_opt(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(TeardownError::Source)?
        .map(|r| r.get(0));
    match comment {
        Some(Some(c)) if c == publication_marker(&flow.name) && ours => {
            steps.push(Step::Publication { name: publication });
        }
        Some(Some(c)) if c == publication_marker(&flow.name) => kept.push(format!(
            "publication {publication} on the source: made by trellara for a flow named {}, but this flow's target has no record of it (another config's flow of that name?)",
            flow.name
        )),
        Some(_) => kept.push(format!(
            "publication {publication} on the source: trellara did not create it"
        )),
        None => {}
    }
    if crate::state::present(target)
        .await
        .map_err(TeardownError::Target)?
    {
        let rows = crate::state::rows_of(target, &flow.name)
            .await
            .map_err(TeardownError::Target)?;
        if rows > 0 {
            steps.push(Step::StateRows { rows });
        }
    }
    let mut log_dir = flow.log_dir().map(std::path::Path::to_path_buf);
    if let Some(dir) = &log_dir
        && dir.exists()
    {
        // Another flow's log (or one naming no owner) is not this flow's
        // to remove.
        let owner = crate::identity::LogOwner::of(flow, source)
            .await
            .map_err(|e| TeardownError::Owner(crate::errors::chain_of(&e)))?;
        match crate::identity::check_dir(dir, &owner) {
            Ok(()) => steps.push(Step::LogDirectory {
                path: dir.display().to_string(),
            }),
            Err(e) => {
                kept.push(format!("log directory {}: {e}", dir.display()));
                log_dir = None;
            }
        }
    }
    match flow.throwaway() {
        Some(dir) if crate::throwaway::is_ours(dir, &flow.name) => {
            steps.push(Step::ThrowawayTarget {
                path: dir.display().to_string(),
            })
        }
        _ => kept.push(format!(
            "the target tables {} and their rows",
            flow.tables.join(", ")
        )),
    }
    if let Transport::Kafka { topic, .. } = &flow.transport {
        kept.push(format!(
            "Kafka topic {topic} and consumer group {}: delete them on the broker if nothing else reads them",
            crate::apply::first_cursor(flow)
        ));
    }
    Ok(Plan {
        flow: flow.name.clone(),
        steps,
        kept,
        log_dir,
    })
}

/// Carries `plan` out, in the order that stops capture before what it
/// needs is removed; returns what was removed. The log stays locked
/// throughout, so no run starts on it meanwhile.
pub async fn execute(
    plan: &Plan,
    flow: &Flow,
    source: &Client,
    target: &Client,
) -> Result<Vec<String>, TeardownError> {
    let _lock = match &plan.log_dir {
        Some(dir) if dir.exists() => Some(
            crate::lock::try_lock(dir)
                .map_err(|source| TeardownError::LogDir {
                    path: dir.display().to_string(),
                    source,
                })?
                .ok_or_else(|| TeardownError::Running {
                    flow: flow.name.clone(),
                    why: format!("a trellara process holds its log {}", dir.display()),
                })?,
        ),
        _ => None,
    };
    let mut done = Vec::new();
    for step in &plan.steps {
        let result: Result<(), TeardownError> = async {
            match step {
                Step::NativeCapture { settings } => {
                    let mut sql = vec!["SELECT trellara.stop_worker()".to_owned()];
                    sql.extend(settings.iter().map(|s| format!("ALTER SYSTEM RESET {s}")));
                    sql.push("SELECT pg_reload_conf()".into());
                    for statement in &sql {
                        source
                            .batch_execute(statement)
                            .await
                            .map_err(TeardownError::Source)?;
                    }
                }
                Step::Slot { name } => {
                    drop_slot(source, name)
                        .await
                        .map_err(TeardownError::Source)?;
                }
                Step::Publication { name } => {
                    source
                        .batch_execute(&format!(
                            "DROP PUBLICATION IF EXISTS {}",
                            postgres_protocol::escape::escape_identifier(name)
                        ))
                        .await
                        .map_err(TeardownError::Source)?;
                }
                Step::StateRows { .. } => {
                    crate::state::forget(target, &flow.name)
                        .await
                        .map_err(TeardownError::Target)?;
                }
                Step::LogDirectory { path } => {
                    let dir = PathBuf::from(path);
                    crate::log::remove_log_dir(&dir).map_err(|source| TeardownError::LogDir {
                        path: path.clone(),
                        source,
                    })?;
                    let _ = std::fs::remove_file(dir.with_extension("sock"));
                    let _ = std::fs::remove_file(crate::lock::lock_path(&dir));
                    crate::throwaway::remove_empty_parents(&dir);
                }
                Step::ThrowawayTarget { path } => {
                    crate::throwaway::remove(std::path::Path::new(path), &flow.name)?;
                }
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            // What was removed stays said: a rerun removes the rest.
            return Err(if done.is_empty() {
                e
            } else {
                TeardownError::Partly {
                    removed: done.join("; "),
                    source: Box::new(e),
                }
            });
        }
        done.push(step.describe(&flow.name));
    }
    Ok(done)
}

/// Drops `slot` of the session's database if it exists; true when it did.
/// A session that just let go of it (a snapshot's, closing) is waited
/// for, a few seconds.
pub async fn drop_slot(source: &Client, slot: &str) -> Result<bool, tokio_postgres::Error> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match source
            .query_opt(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                 WHERE slot_name = $1 AND database = current_database()",
                &[&slot],
            )
            .await
        {
            Ok(row) => return Ok(row.is_some()),
            // object_in_use
            Err(e)
                if e.as_db_error().is_some_and(|d| d.code().code() == "55006")
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e),
        }
    }
}
