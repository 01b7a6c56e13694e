//! trellara-check: a read-only grader of a PostgreSQL source's readiness for
//! change data capture. The `trellara-check` binary, `trellara check` and
//! `trellara preflight` all call [`assess`].
//!
//! ```text
//!  ConnectOptions ─▶ probe::gather ─▶ Facts ─▶ grade::evaluate ─▶ Report
//!   (plain session,   (BEGIN READ ONLY,          (rules, grade,     │
//!    app trellara-     SELECT/SHOW only,          actions)          ├─▶ render_text / render_json / render_html
//!    check)            2 WAL samples)                               └─▶ config_draft::write (ready only)
//! ```
//!
//! Invariants (ARCHITECTURE.md invariant 6):
//! - The grader writes nothing: no publication, slot, checkpoint, table or
//!   target state. Its only session is a plain (non-replication) one, every
//!   query runs in one `READ ONLY` transaction, and the statements it sends
//!   are listed in [`probe`]'s module docs.
//! - [`Report::verdict`] is `blocked` (exit 3) whenever a critical finding
//!   exists, `unassessed` (exit 2) when an essential fact is unknown, and
//!   `ready` (exit 0) only otherwise. A connection or query failure is a
//!   [`CheckError`] (exit 2). A blocked source never exits 0.
//! - No output contains the password.

pub mod config_draft;
pub mod grade;
pub mod probe;
pub mod report;

pub use report::{
    NOTHING_CREATED, Report, Severity, Verdict, render_html, render_json, render_text,
};
pub use trellara_pgwire::{ConnectOptions, WireError};

use std::time::Duration;

/// What to assess.
#[derive(Debug, Clone)]
pub struct Request {
    /// `schema.name` of the tables to capture; empty: every user table is
    /// scanned, and identity problems are warnings rather than blockers.
    pub tables: Vec<String>,
    /// How long to sample `pg_current_wal_lsn()` for the WAL rate.
    pub sample: Duration,
}

impl Default for Request {
    fn default() -> Self {
        Request {
            tables: Vec::new(),
            sample: Duration::from_secs(5),
        }
    }
}

/// Why there is no report (exit status 2: could not assess).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("could not connect to {target}")]
    Connect {
        /// `user@host:port/db`, no password.
        target: String,
        #[source]
        source: Box<WireError>,
    },
    #[error("query failed while reading {what}")]
    Query {
        what: &'static str,
        #[source]
        source: Box<WireError>,
    },
    #[error("the server did not return {0}")]
    Missing(&'static str),
    #[error(
        "the grader's transaction is not read-only (transaction_read_only = {0:?}); stopped before reading anything"
    )]
    NotReadOnly(String),
    #[error("invalid table name {0:?}: expected schema.name")]
    TableName(String),
}

impl CheckError {
    /// Always 2: the source could not be assessed.
    pub fn exit_code(&self) -> i32 {
        Verdict::Unassessed.exit_code()
    }
}

/// Reads the source (read-only) and grades it.
pub async fn assess(options: &ConnectOptions, request: &Request) -> Result<Report, CheckError> {
    let mut facts = probe::gather(options, &request.tables, request.sample).await?;
    let evaluation = grade::evaluate(&mut facts);
    Ok(Report {
        tool: format!("trellara-check {}", env!("CARGO_PKG_VERSION")),
        target: format!("{}@{}", options.user, options.target()),
        verdict: evaluation.verdict,
        exit_code: evaluation.verdict.exit_code(),
        grade: evaluation.grade,
        findings: evaluation.findings,
        actions: evaluation.actions,
        failover: evaluation.failover,
        facts,
        created: "nothing",
    })
}

pub use trellara_common::redact::redact;
