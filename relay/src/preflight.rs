//! `trellara preflight`, and the gate in front of `run`, `reseed` and
//! `relay --config`: the read-only grader (`trellara_check`) on the source
//! for the flow's tables, then the flow's own checks: source and target are
//! two databases, the log directory is this flow's, every table exists on
//! the target with the source's columns and types. Read-only: the queries
//! run in READ ONLY transactions and create nothing.
//!
//! A command that would write refuses while any critical finding about
//! this flow stands ([`Assessment::blockers`]), before it creates or alters
//! anything on either side. The grader's findings about other objects
//! (another tool's stalled slot) are warnings there; a full
//! `max_replication_slots` does not block a flow whose slot already exists.

use crate::config::{Flow, quote_table};
use serde::Serialize;
use std::time::Duration;
use tokio_postgres::Client;

/// The grader's rule for "no free replication slot".
const NO_FREE_SLOT: &str = "C03";

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub side: &'static str,
    pub check: String,
    pub ok: bool,
    /// A blocker stops `run`; a note does not.
    pub blocking: bool,
    pub detail: String,
    pub action: Option<String>,
}

fn finding(
    side: &'static str,
    check: &str,
    ok: bool,
    blocking: bool,
    detail: String,
    action: Option<String>,
) -> Finding {
    Finding {
        side,
        check: check.to_owned(),
        ok,
        blocking: blocking && !ok,
        detail,
        action: if ok { None } else { action },
    }
}

/// What preflight found for one flow.
#[derive(Debug)]
pub struct Assessment {
    /// The grader's report of the source.
    pub source: trellara_check::Report,
    /// The flow's own checks (target tables, identity, log directory).
    pub flow: Vec<Finding>,
    /// The flow's slot exists on the source already.
    pub has_slot: bool,
}

impl Assessment {
    /// Each critical finding about this flow, with its fix.
    pub fn blockers(&self) -> Vec<String> {
        let source = self
            .source
            .critical()
            .filter(|f| !(self.has_slot && f.rule == NO_FREE_SLOT))
            .map(|f| with_fix(format!("source {}", graded(f)), f.action.as_deref()));
        let flow = self.flow.iter().filter(|f| f.blocking).map(|f| {
            with_fix(
                format!("{} {}: {}", f.side, f.check, f.detail),
                f.action.as_deref(),
            )
        });
        source.chain(flow).collect()
    }

    /// The grader's warnings (other slots, WAL headroom, ...): shown, not blocking.
    pub fn warnings(&self) -> Vec<String> {
        self.source
            .findings
            .iter()
            .filter(|f| f.severity == trellara_check::Severity::Warning)
            .map(graded)
            .collect()
    }

    /// Whether preflight answers BLOCKED: a blocker, or a fact the grader
    /// could not read (never taken as fine).
    pub fn blocked(&self) -> bool {
        !self.blockers().is_empty() || self.source.verdict() == trellara_check::Verdict::Unassessed
    }
}

/// `C06 (public.noid): message`.
fn graded(f: &trellara_check::report::Finding) -> String {
    match &f.subject {
        Some(subject) => format!("{} ({subject}): {}", f.rule, f.message),
        None => format!("{}: {}", f.rule, f.message),
    }
}

/// `what`, and its fix on the next line when there is one.
fn with_fix(what: String, fix: Option<&str>) -> String {
    match fix {
        Some(fix) => format!("{what}\n    fix: {fix}"),
        None => what,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error("the source database URL: {0}")]
    Url(String),
    #[error("grade the source")]
    Grade(#[source] trellara_check::CheckError),
    #[error("check the flow")]
    Postgres(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityError),
}

/// Every check of preflight for `flow`, read-only. `sample` is the grader's
/// WAL-rate window (preflight: 1 s; the gate in front of a run: none).
pub async fn assess(
    flow: &Flow,
    source_url: &str,
    source: &Client,
    target: &Client,
    sample: Duration,
) -> Result<Assessment, PreflightError> {
    let mut options: trellara_check::ConnectOptions = source_url
        .parse()
        .map_err(|e: trellara_check::WireError| PreflightError::Url(e.to_string()))?;
    options.replication = false;
    options.application_name = "trellara-check".into();
    let request = trellara_check::Request {
        tables: flow.tables.clone(),
        sample,
    };
    // The grader reads on a session of its own, so it runs while the
    // flow's own checks read on the run's sessions: a run's start waits
    // for the longer of the two, not their sum. Both are read-only, and
    // both finish (a future dropped mid-check would leave the target
    // session inside its READ ONLY transaction).
    let grading = async {
        trellara_check::assess(&options, &request)
            .await
            .map_err(PreflightError::Grade)
    };
    let (report, own) = tokio::join!(grading, flow_checks(flow, source, target));
    let report = report?;
    let (same, mut found) = own?;
    // A slot of the flow's name on another database is another flow's;
    // one on this database is this flow's only when its target says so.
    let slot = flow.slot();
    let mut has_slot = report.facts.slots.iter().any(|s| {
        s.name == slot && s.database.as_deref() == Some(report.facts.server.database.as_str())
    });
    if has_slot && !same && !crate::state::owns_slot(target, &flow.name, &slot).await? {
        has_slot = false;
        found.push(finding(
            "source",
            "slot",
            false,
            true,
            crate::state::NotOurSlot(&slot).to_string(),
            Some(crate::state::not_our_slot_fix(&slot)),
        ));
    }
    Ok(Assessment {
        source: report,
        flow: found,
        has_slot,
    })
}

/// The flow's own checks, on the run's sessions: the target is another
/// database, the log directory is the flow's, the target's tables match.
/// Whether the target is the source itself, and the findings.
async fn flow_checks(
    flow: &Flow,
    source: &Client,
    target: &Client,
) -> Result<(bool, Vec<Finding>), PreflightError> {
    let mut found = Vec::new();
    let same = crate::identity::same_database(source, target).await?;
    found.push(finding(
        "target",
        "identity",
        !same,
        true,
        if same {
            "is the source database itself: the snapshot would empty the source's tables".into()
        } else {
            "another database than the source".into()
        },
        Some("point the flow's target.url at another database".into()),
    ));
    let db = crate::identity::Database::read(source).await?;
    if let Some(dir) = flow.log_dir() {
        let owner = crate::identity::LogOwner {
            flow: flow.name.clone(),
            source_id: flow.source_id(),
            source: db,
        };
        let (ok, detail) = match crate::identity::check_dir(dir, &owner) {
            Ok(()) => (true, format!("{} is this flow's", dir.display())),
            Err(e) => (false, crate::errors::chain_of(&e)),
        };
        found.push(finding(
            "log",
            "log directory",
            ok,
            true,
            detail,
            Some("give this flow its own transport.log_dir in trellara.yml".into()),
        ));
    }
    if !same {
        found.extend(target_tables(flow, source, target).await?);
    }
    Ok((same, found))
}

/// Every table of the flow exists on the target with the source's columns.
async fn target_tables(
    flow: &Flow,
    source: &Client,
    target: &Client,
) -> Result<Vec<Finding>, tokio_postgres::Error> {
    target.batch_execute("BEGIN READ ONLY").await?;
    // A flow that copied its tables holds the target to the descriptions
    // it pinned: a change on the source since is the stream's to carry
    // (or to hold), not a mismatch to refuse the run for.
    let pinned: std::collections::HashMap<String, trellara_common::envelope::RelationSchema> =
        if crate::state::current(target).await? {
            crate::state::runs::tables(target, &flow.name)
                .await?
                .into_iter()
                .filter_map(|t| Some((t.name, t.schema?)))
                .collect()
        } else {
            Default::default()
        };
    let mut out = Vec::new();
    let columns = "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
                   WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' ORDER BY a.attnum";
    for table in &flow.tables {
        let Some(qualified) = quote_table(table) else {
            continue;
        };
        let want: Vec<(String, String)> = source
            .query(columns, &[&qualified])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let have: Vec<(String, String)> = target
            .query(columns, &[&qualified])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        if have.is_empty() {
            out.push(finding("target", &format!("table {table}"), false, true, "does not exist on the target".into(),
                Some(format!("create {table} on the target with the source's columns (pg_dump --schema-only --table '{}' from the source)", table.replace('\'', "'\\''")))));
            continue;
        }
        let pin = trellara_common::table_name::TableName::parse(table)
            .ok()
            .and_then(|t| pinned.get(&t.to_string()));
        let mut problems = Vec::new();
        for (col, ty) in &want {
            let at_pin = pin.map(|p| p.columns.iter().find(|c| &c.name == col));
            match (have.iter().find(|(c, _)| c == col), at_pin) {
                // Added on the source after the pin.
                (None, Some(None)) => {}
                (None, _) => problems.push(format!("missing column {col} {ty}")),
                (Some((_, t)), at_pin) if t != ty => {
                    let pinned_type = match at_pin.flatten() {
                        Some(c) => Some(
                            source
                                .query_one(
                                    "SELECT format_type($1::int8::oid, $2)",
                                    &[&i64::from(c.type_oid), &c.type_modifier],
                                )
                                .await?
                                .get::<_, String>(0),
                        ),
                        None => None,
                    };
                    if pinned_type.as_ref() != Some(t) {
                        problems.push(format!("column {col} is {t}, the source has {ty}"));
                    }
                }
                _ => {}
            }
        }
        out.push(finding(
            "target",
            &format!("table {table}"),
            problems.is_empty(),
            true,
            if problems.is_empty() {
                format!("{} compatible columns", want.len())
            } else {
                problems.join("; ")
            },
            Some(format!(
                "ALTER TABLE {table} ... so its columns match the source"
            )),
        ));
    }
    if let Some(refusal) = crate::snapshot::native_refusal(flow, source).await? {
        out.push(finding(
            "source",
            "native capture",
            false,
            true,
            refusal,
            Some("set capture: external for this flow in trellara.yml".into()),
        ));
    }
    target.batch_execute("ROLLBACK").await?;
    Ok(out)
}
