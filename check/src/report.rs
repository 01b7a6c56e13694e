//! What the grader saw and what it concluded: the facts read from the
//! server, the findings the rules produced, the grade, the numbered actions,
//! and the three renderers (text, JSON, HTML).
//!
//! Invariants:
//! - A fact the grader could not read is `None` (JSON `null`) and has an
//!   `unknown` finding naming the grant that would reveal it; it is never
//!   rendered as fine.
//! - Nothing rendered contains a password: the target is `user@host:port/db`.
//! - The text report ends with the line [`NOTHING_CREATED`]; the HTML page is
//!   one self-contained document (no external assets) with every server- or
//!   user-supplied string escaped.

use serde::Serialize;
use std::fmt::Write as _;

/// The last line of the text report, and the claim of invariant 6.
pub const NOTHING_CREATED: &str = "nothing was created — no publication, slot, or checkpoint";

/// How the grader's verdict maps to a process exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// No critical finding: capture can be set up (exit 0).
    Ready,
    /// At least one critical finding (exit 3).
    Blocked,
    /// A fact needed to decide could not be read (exit 2).
    Unassessed,
}

impl Verdict {
    pub fn exit_code(self) -> i32 {
        match self {
            Verdict::Ready => 0,
            Verdict::Blocked => 3,
            Verdict::Unassessed => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ready => "ready",
            Verdict::Blocked => "blocked",
            Verdict::Unassessed => "unassessed",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Blocks capture; caps the grade at F and the exit status at 3.
    Critical,
    Warning,
    /// Could not be seen; counted against the grade, never as fine.
    Unknown,
    Note,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Critical => "critical",
            Severity::Warning => "warning",
            Severity::Unknown => "unknown",
            Severity::Note => "note",
        }
    }
}

/// One conclusion of one rule about one subject.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// Rule id from the rule table (docs/CHECK.md), e.g. `C01`.
    pub rule: &'static str,
    /// Rule name, e.g. `wal_level_not_logical`.
    pub name: &'static str,
    pub severity: Severity,
    /// What it is about: a setting, slot, table or role; `None` for the server.
    pub subject: Option<String>,
    pub message: String,
    /// Points this finding deducts before the rule's cap is applied.
    pub points: u32,
    /// The concrete statement or setting that resolves it, if there is one.
    pub action: Option<String>,
}

/// A rule's total deduction after its cap.
#[derive(Debug, Clone, Serialize)]
pub struct Deduction {
    pub rule: &'static str,
    pub name: &'static str,
    pub points: u32,
    /// Number of findings of this rule.
    pub count: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Grade {
    pub letter: char,
    /// 100 minus the deductions, floored at 0.
    pub score: u32,
    /// True when a critical finding forced the letter to F.
    pub capped_by_critical: bool,
    pub deductions: Vec<Deduction>,
}

/// A recommended action, numbered in the order to apply them.
#[derive(Debug, Clone, Serialize)]
pub struct Action {
    pub number: usize,
    /// SQL or a setting, to run as an administrator (never by the grader).
    pub statement: String,
    /// The rules (and subjects) this resolves.
    pub resolves: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Server {
    pub version: String,
    pub version_num: u32,
    pub standby: bool,
    pub database: String,
    /// `SHOW transaction_read_only` inside the grader's transaction.
    pub transaction_read_only: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoleAccess {
    pub name: String,
    pub superuser: bool,
    /// `rolreplication` (or superuser).
    pub replication_attribute: bool,
    /// Managed-provider roles this role is a member of that grant replication
    /// on that provider (e.g. `rds_replication`); not provable from the catalog.
    pub provider_replication_roles: Vec<String>,
    /// Provider replication roles that exist on this server.
    pub provider_roles_present: Vec<String>,
    /// Member of `pg_monitor` (or superuser).
    pub monitor: bool,
    /// Member of `pg_read_all_settings` (or superuser).
    pub read_all_settings: bool,
    /// Member of `pg_read_all_stats` (or superuser).
    pub read_all_stats: bool,
    /// `CREATE` on the database (needed to create a publication).
    pub create_on_database: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub wal_level: Option<String>,
    /// Megabytes; -1 is unlimited.
    pub max_slot_wal_keep_size_mb: Option<i64>,
    pub max_wal_size_mb: Option<i64>,
    pub max_replication_slots: Option<i64>,
    pub max_wal_senders: Option<i64>,
    /// PostgreSQL 18+; seconds, 0 disables the timeout.
    pub idle_replication_slot_timeout_s: Option<i64>,
    /// `None` when the server has no such setting (or it could not be read,
    /// see the findings); the list otherwise.
    pub output_plugin_libraries: Option<Vec<String>>,
    /// Whether the server has `output_plugin_libraries` (CVE-2026-6471
    /// minors); `None` when the role cannot tell.
    pub has_output_plugin_libraries: Option<bool>,
    pub sync_replication_slots: Option<String>,
    /// `synchronized_standby_slots` (or `standby_slot_names`) and its value.
    pub standby_slots_setting: Option<NamedSetting>,
    pub hot_standby_feedback: Option<String>,
    /// Managed-provider switch for logical decoding, when present
    /// (`rds.logical_replication`, `cloudsql.logical_decoding`).
    pub provider_logical_switch: Option<NamedSetting>,
}

/// A setting whose name differs across versions or providers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NamedSetting {
    pub name: String,
    pub value: String,
}

/// A publication covering a partitioned table (or its partitions).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TablePublication {
    pub name: String,
    pub via_partition_root: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    /// Slots that exist; `None` when `pg_replication_slots` is not readable.
    pub replication_slots: Option<i64>,
    /// Rows of `pg_stat_replication`; `None` when not readable.
    pub wal_senders: Option<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Identity {
    PrimaryKey,
    Index,
    Full,
    /// DEFAULT without a primary key, or NOTHING, or an invalid index.
    None,
}

#[derive(Debug, Clone, Serialize)]
pub struct TableReadiness {
    /// `schema.name` as written, quoted where needed.
    pub name: String,
    /// `table`, `partitioned table`, `view`, `foreign table`, ...
    pub kind: String,
    /// `default`, `index`, `full` or `nothing`.
    pub replica_identity: String,
    pub identity: Identity,
    pub unlogged: bool,
    /// Columns outside the identity key that can be TOASTed: with a key-only
    /// identity their old values are not in UPDATE/DELETE images.
    pub toastable_non_key_columns: Vec<String>,
    /// Publications covering the table (or its partitions) and their
    /// `publish_via_partition_root`.
    pub publications: Vec<TablePublication>,
    pub can_select: bool,
    pub estimated_rows: Option<i64>,
}

impl TableReadiness {
    pub fn replicable(&self) -> bool {
        !self.unlogged && matches!(self.kind.as_str(), "table" | "partitioned table")
    }

    pub fn ready(&self) -> bool {
        self.replicable() && self.identity != Identity::None
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Tables {
    /// True when the tables were named with `--table`.
    pub requested: bool,
    /// Names given with `--table` that do not exist.
    pub missing: Vec<String>,
    pub tables: Vec<TableReadiness>,
    /// True when the unrequested scan stopped at its limit.
    pub truncated: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Publication {
    pub name: String,
    pub all_tables: bool,
    pub via_partition_root: bool,
    /// Operations published, e.g. `insert, update, delete, truncate`.
    pub operations: String,
    pub tables: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotState {
    Active,
    /// Not invalidated, and nobody is consuming it.
    Stalled,
    Invalidated,
}

#[derive(Debug, Clone, Serialize)]
pub struct Slot {
    pub name: String,
    pub slot_type: String,
    pub plugin: Option<String>,
    pub database: Option<String>,
    pub temporary: bool,
    pub state: SlotState,
    pub active_pid: Option<i64>,
    pub restart_lsn: Option<String>,
    pub confirmed_flush_lsn: Option<String>,
    pub wal_status: Option<String>,
    pub safe_wal_size: Option<i64>,
    /// `pg_wal_lsn_diff(current, restart_lsn)`.
    pub retained_bytes: Option<i64>,
    /// PostgreSQL 17+: seconds since `inactive_since`; `None` before 17
    /// (duration unknown) or while active.
    pub inactive_seconds: Option<i64>,
    pub inactive_since: Option<String>,
    /// PostgreSQL 17+ `invalidation_reason`.
    pub invalidation_reason: Option<String>,
    /// PostgreSQL 16+ `conflicting`.
    pub conflicting: Option<bool>,
    /// PostgreSQL 17+.
    pub failover: Option<bool>,
    /// PostgreSQL 17+.
    pub synced: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Wal {
    pub sample_seconds: f64,
    /// WAL written per second over the sample; `None` when not measurable
    /// (e.g. a standby that has not received anything).
    pub bytes_per_second: Option<f64>,
    pub largest_retained_bytes: Option<i64>,
    /// Size of pg_wal (`pg_ls_waldir`), needs pg_monitor.
    pub pg_wal_bytes: Option<i64>,
    /// Hours until the most exposed slot (or a new one) reaches
    /// `max_slot_wal_keep_size` at the sampled rate; `None` if not bounded by
    /// the setting or not measurable, see `headroom_basis`.
    pub headroom_hours: Option<f64>,
    /// How the headroom was derived (or why it could not be).
    pub headroom_basis: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Failover {
    /// Failover slots exist from PostgreSQL 17.
    pub supported: bool,
    pub logical_slots: usize,
    pub failover_enabled: Vec<String>,
    pub failover_not_enabled: Vec<String>,
    pub synced: Vec<String>,
    /// Physical slots in use (standbys streaming through a slot).
    pub active_physical_slots: usize,
    /// One line for the summary.
    pub summary: String,
    pub guidance: Vec<String>,
}

/// One row of `pg_prepared_xacts`.
#[derive(Debug, Clone, Serialize)]
pub struct PreparedTransaction {
    pub gid: String,
    pub xid: String,
    pub prepared: String,
    pub database: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Conflicts {
    pub tablespace: i64,
    pub lock: i64,
    pub snapshot: i64,
    pub bufferpin: i64,
    pub deadlock: i64,
    /// PostgreSQL 16+.
    pub active_logicalslot: Option<i64>,
}

impl Conflicts {
    pub fn total(&self) -> i64 {
        self.tablespace
            + self.lock
            + self.snapshot
            + self.bufferpin
            + self.deadlock
            + self.active_logicalslot.unwrap_or(0)
    }
}

/// A fact the grader could not read.
#[derive(Debug, Clone, Serialize)]
pub struct Unknown {
    pub what: String,
    pub reason: String,
    /// The statement that would let the grader see it, if a grant would.
    pub grant: Option<String>,
}

/// Everything the probe read.
#[derive(Debug, Clone, Serialize)]
pub struct Facts {
    pub server: Server,
    pub role: RoleAccess,
    pub settings: Settings,
    pub usage: Usage,
    pub tables: Tables,
    pub publications: Vec<Publication>,
    /// False when the role may not read `pg_publication` (see `unknowns`).
    pub publications_visible: bool,
    pub slots: Vec<Slot>,
    /// False when the role may not read `pg_replication_slots` (see
    /// `unknowns`): `slots` is then empty but not "none".
    pub slots_visible: bool,
    pub wal: Wal,
    pub conflicts: Option<Conflicts>,
    /// Prepared (two-phase) transactions open on the server: creating a
    /// slot waits until each has ended.
    pub prepared_transactions: Vec<PreparedTransaction>,
    /// What could not be read, and the grant that would reveal it.
    pub unknowns: Vec<Unknown>,
    /// Statements the grader sent, in order (the audit trail of invariant 6).
    pub statements: usize,
}

/// The whole assessment.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub tool: String,
    /// `user@host:port/db`, never the password.
    pub target: String,
    pub verdict: Verdict,
    pub exit_code: i32,
    pub grade: Grade,
    pub findings: Vec<Finding>,
    pub actions: Vec<Action>,
    pub failover: Failover,
    #[serde(flatten)]
    pub facts: Facts,
    pub created: &'static str,
}

impl Report {
    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    pub fn exit_code(&self) -> i32 {
        self.verdict.exit_code()
    }

    pub fn critical(&self) -> impl Iterator<Item = &Finding> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Critical)
    }

    /// "ready", or "blocked by C06 (public.noid), C01 (wal_level)".
    pub fn verdict_line(&self) -> String {
        let blockers: Vec<String> = self
            .critical()
            .map(|f| match &f.subject {
                Some(s) => format!("{} ({s})", f.rule),
                None => f.rule.to_string(),
            })
            .collect();
        match self.verdict {
            Verdict::Blocked => format!("blocked by {}", blockers.join(", ")),
            Verdict::Unassessed => {
                "unassessed: an essential setting could not be read (see unknown findings)".into()
            }
            Verdict::Ready => "ready".into(),
        }
    }

    /// "4 tables ready · 1 note (TOAST)".
    pub fn readiness_line(&self) -> String {
        let t = &self.facts.tables;
        let ready = t.tables.iter().filter(|x| x.ready()).count();
        let mut parts = vec![format!(
            "{ready} {} ready",
            plural(ready, "table", "tables")
        )];
        let not_ready = t.tables.len() - ready + t.missing.len();
        if not_ready > 0 {
            parts.push(format!("{not_ready} not ready"));
        }
        let toast = self
            .findings
            .iter()
            .filter(|f| f.name == "toast_old_image")
            .count();
        if toast > 0 {
            parts.push(format!(
                "{toast} {} (TOAST)",
                plural(toast, "note", "notes")
            ));
        }
        let partition = self
            .findings
            .iter()
            .filter(|f| f.name == "partition_not_via_root")
            .count();
        if partition > 0 {
            parts.push(format!("{partition} partition root not published via root"));
        }
        if t.truncated {
            parts.push("scan truncated".into());
        }
        parts.join(" · ")
    }

    /// "3 active · 1 stalled 2h14m · 1 invalidated".
    pub fn slots_line(&self) -> String {
        let slots = &self.facts.slots;
        if !self.facts.slots_visible {
            return "unknown: pg_replication_slots is not readable by this role".into();
        }
        if slots.is_empty() {
            return "none".into();
        }
        let count = |s: SlotState| slots.iter().filter(|x| x.state == s).count();
        let mut parts = vec![format!("{} active", count(SlotState::Active))];
        let stalled: Vec<&Slot> = slots
            .iter()
            .filter(|x| x.state == SlotState::Stalled)
            .collect();
        if !stalled.is_empty() {
            let longest = stalled.iter().filter_map(|s| s.inactive_seconds).max();
            parts.push(match longest {
                Some(secs) => format!("{} stalled {}", stalled.len(), duration(secs)),
                None => format!(
                    "{} stalled (duration unknown before PostgreSQL 17)",
                    stalled.len()
                ),
            });
        }
        let invalid = count(SlotState::Invalidated);
        if invalid > 0 {
            parts.push(format!("{invalid} invalidated"));
        }
        parts.join(" · ")
    }

    /// "~36h at the rate of the last 5 s" or why there is no number.
    pub fn headroom_line(&self) -> String {
        let wal = &self.facts.wal;
        match wal.headroom_hours {
            Some(h) => format!(
                "~{} at the rate of the last {} s",
                hours(h),
                fmt_secs(wal.sample_seconds)
            ),
            None => wal.headroom_basis.clone(),
        }
    }
}

fn plural<'a>(n: usize, one: &'a str, many: &'a str) -> &'a str {
    if n == 1 { one } else { many }
}

fn fmt_secs(s: f64) -> String {
    if (s - s.round()).abs() < 0.05 {
        format!("{}", s.round() as i64)
    } else {
        format!("{s:.1}")
    }
}

/// 8040 -> "2h14m"; 90 -> "1m"; 200000 -> "2d7h".
pub fn duration(secs: i64) -> String {
    let secs = secs.max(0);
    let (d, h, m) = (secs / 86_400, secs % 86_400 / 3600, secs % 3600 / 60);
    if d > 0 {
        format!("{d}d{h}h")
    } else if h > 0 {
        format!("{h}h{m:02}m")
    } else if m > 0 {
        format!("{m}m")
    } else {
        format!("{secs}s")
    }
}

fn hours(h: f64) -> String {
    if h >= 48.0 {
        format!("{:.0}d", h / 24.0)
    } else if h >= 1.0 {
        format!("{h:.0}h")
    } else {
        format!("{:.0}m", (h * 60.0).max(0.0))
    }
}

/// 1536 -> "1.5 KiB".
pub fn bytes(n: i64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit.min(UNITS.len() - 1)])
    }
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    match v {
        Some(v) => v.to_string(),
        None => "unknown".into(),
    }
}

/// The summary block, then details, ending with [`NOTHING_CREATED`].
pub fn render_text(report: &Report) -> String {
    let f = &report.facts;
    let mut out = String::new();
    let role = if f.server.standby {
        "standby"
    } else {
        "primary"
    };
    let _ = writeln!(
        out,
        "trellara-check {} · {} · PostgreSQL {} ({role})",
        env!("CARGO_PKG_VERSION"),
        report.target,
        f.server.version
    );
    let _ = writeln!(out, "read-only · no state written");
    let _ = writeln!(out);
    let line = |out: &mut String, k: &str, v: String| {
        let _ = writeln!(out, "{k:<18} {v}");
    };
    line(
        &mut out,
        "grade",
        format!(
            "{} ({}/100){}",
            report.grade.letter,
            report.grade.score,
            if report.grade.capped_by_critical {
                " · capped at F by a critical finding"
            } else {
                ""
            }
        ),
    );
    line(&mut out, "verdict", report.verdict_line());
    line(&mut out, "capture readiness", report.readiness_line());
    line(&mut out, "slots", report.slots_line());
    line(&mut out, "wal headroom", report.headroom_line());
    line(&mut out, "failover slots", report.failover.summary.clone());
    let unknown = report
        .findings
        .iter()
        .filter(|x| x.severity == Severity::Unknown)
        .count();
    if unknown > 0 {
        line(
            &mut out,
            "unknown",
            format!("{unknown} not visible to this role"),
        );
    }
    line(
        &mut out,
        "actions",
        format!("{} recommended", report.actions.len()),
    );

    let _ = writeln!(out, "\nfindings");
    if report.findings.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for x in &report.findings {
        let _ = writeln!(
            out,
            "  [{}] {:<8} {}{}{}",
            x.rule,
            x.severity.as_str(),
            x.subject
                .as_ref()
                .map(|s| format!("{s}: "))
                .unwrap_or_default(),
            x.message,
            if x.points > 0 {
                format!(" (-{})", x.points)
            } else {
                String::new()
            }
        );
    }

    let _ = writeln!(out, "\ngrade rules (start at 100)");
    if report.grade.deductions.is_empty() {
        let _ = writeln!(out, "  no deductions");
    }
    for d in &report.grade.deductions {
        let _ = writeln!(
            out,
            "  {} {:<32} x{:<3} -{}",
            d.rule, d.name, d.count, d.points
        );
    }
    let _ = writeln!(
        out,
        "  = {} -> {} (A>=90 B>=80 C>=70 D>=60 else F; a critical finding caps at F)",
        report.grade.score, report.grade.letter
    );

    let _ = writeln!(out, "\nserver");
    let s = &f.settings;
    let _ = writeln!(out, "  wal_level                  {}", opt(&s.wal_level));
    let _ = writeln!(
        out,
        "  max_slot_wal_keep_size     {}",
        match s.max_slot_wal_keep_size_mb {
            Some(-1) => "-1 (unlimited)".to_string(),
            Some(mb) => format!("{mb} MB"),
            None => "unknown".into(),
        }
    );
    let _ = writeln!(
        out,
        "  replication slots          {} used of {}",
        opt(&f.usage.replication_slots),
        opt(&s.max_replication_slots)
    );
    let _ = writeln!(
        out,
        "  wal senders                {} used of {}",
        opt(&f.usage.wal_senders),
        opt(&s.max_wal_senders)
    );
    if f.server.version_num >= 180_000 {
        let _ = writeln!(
            out,
            "  idle_replication_slot_timeout {}",
            match s.idle_replication_slot_timeout_s {
                Some(0) => "0 (disabled)".to_string(),
                Some(v) => duration(v),
                None => "unknown".into(),
            }
        );
    }
    let _ = writeln!(
        out,
        "  output_plugin_libraries    {}",
        match (&s.has_output_plugin_libraries, &s.output_plugin_libraries) {
            (Some(true), Some(list)) => list.join(", "),
            (Some(false), _) => "not present on this server (predates CVE-2026-6471 minors)".into(),
            _ => "unknown".into(),
        }
    );
    let _ = writeln!(
        out,
        "  pg_wal size                {}",
        f.wal
            .pg_wal_bytes
            .map(bytes)
            .unwrap_or_else(|| "unknown".into())
    );
    let _ = writeln!(
        out,
        "  wal rate                   {} over the last {} s",
        f.wal
            .bytes_per_second
            .map(|r| format!("{}/s", bytes(r as i64)))
            .unwrap_or_else(|| "unknown".into()),
        fmt_secs(f.wal.sample_seconds)
    );
    if let Some(c) = &f.conflicts {
        let _ = writeln!(
            out,
            "  replication conflicts      {} (snapshot {}, lock {}, bufferpin {}, deadlock {}, tablespace {}{})",
            c.total(),
            c.snapshot,
            c.lock,
            c.bufferpin,
            c.deadlock,
            c.tablespace,
            c.active_logicalslot
                .map(|v| format!(", logical slot {v}"))
                .unwrap_or_default()
        );
    }
    let r = &f.role;
    let _ = writeln!(
        out,
        "  role                       {}{}{}{}",
        r.name,
        if r.superuser { " superuser" } else { "" },
        if r.replication_attribute {
            " replication"
        } else {
            ""
        },
        if r.monitor { " pg_monitor" } else { "" }
    );

    if !f.slots.is_empty() {
        let _ = writeln!(out, "\nslots");
        for x in &f.slots {
            let _ = writeln!(
                out,
                "  {} ({}{}) {} · wal_status {} · retained {} · safe_wal_size {}{}{}{}{}",
                x.name,
                x.slot_type,
                x.plugin
                    .as_ref()
                    .map(|p| format!(", {p}"))
                    .unwrap_or_default(),
                match x.state {
                    SlotState::Active if x.synced == Some(true) => {
                        "synced from the primary (held by the slot sync worker)".to_string()
                    }
                    SlotState::Active => "active".to_string(),
                    SlotState::Stalled => match x.inactive_seconds {
                        Some(s) => format!("stalled {}", duration(s)),
                        None => "stalled (inactive; duration unknown before PostgreSQL 17)".into(),
                    },
                    SlotState::Invalidated => "invalidated".into(),
                },
                opt(&x.wal_status),
                x.retained_bytes.map(bytes).unwrap_or_else(|| "-".into()),
                x.safe_wal_size.map(bytes).unwrap_or_else(|| "-".into()),
                x.invalidation_reason
                    .as_ref()
                    .map(|r| format!(" · invalidation_reason {r}"))
                    .unwrap_or_default(),
                x.conflicting
                    .filter(|c| *c)
                    .map(|_| " · conflicting")
                    .unwrap_or_default(),
                x.failover
                    .map(|v| format!(" · failover {v}"))
                    .unwrap_or_default(),
                x.synced
                    .map(|v| format!(" · synced {v}"))
                    .unwrap_or_default(),
            );
        }
    }

    if !f.tables.tables.is_empty() || !f.tables.missing.is_empty() {
        let _ = writeln!(out, "\ntables");
        for m in &f.tables.missing {
            let _ = writeln!(out, "  {m}: does not exist");
        }
        for t in &f.tables.tables {
            let _ = writeln!(
                out,
                "  {} ({}{}) identity {}{}{}",
                t.name,
                t.kind,
                if t.unlogged { ", unlogged" } else { "" },
                match t.identity {
                    Identity::PrimaryKey => "primary key".into(),
                    Identity::Index => "replica identity index".into(),
                    Identity::Full => "replica identity full".into(),
                    Identity::None => format!("none (replica identity {})", t.replica_identity),
                },
                if t.toastable_non_key_columns.is_empty() {
                    String::new()
                } else {
                    format!(
                        " · TOAST-able non-key columns {}",
                        t.toastable_non_key_columns.join(", ")
                    )
                },
                if t.publications.is_empty() {
                    String::new()
                } else {
                    format!(
                        " · publications {}",
                        t.publications
                            .iter()
                            .map(|p| format!("{} (via root {})", p.name, p.via_partition_root))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            );
        }
    }

    let _ = writeln!(out, "\nfailover");
    for g in &report.failover.guidance {
        let _ = writeln!(out, "  {g}");
    }

    let _ = writeln!(out, "\nactions");
    if report.actions.is_empty() {
        let _ = writeln!(out, "  none");
    }
    for a in &report.actions {
        let _ = writeln!(
            out,
            "  {}. {}   -- {}",
            a.number,
            a.statement,
            a.resolves.join("; ")
        );
    }
    let _ = writeln!(
        out,
        "\n{} read-only statements in one READ ONLY transaction (transaction_read_only = {})",
        f.statements,
        if f.server.transaction_read_only {
            "on"
        } else {
            "off"
        }
    );
    let _ = writeln!(out, "{NOTHING_CREATED}");
    out
}

/// The report as pretty-printed JSON (shape documented in docs/CHECK.md).
pub fn render_json(report: &Report) -> String {
    // Serializing plain data with string keys cannot fail; fall back to an
    // explicit error object rather than panicking.
    serde_json::to_string_pretty(report)
        .unwrap_or_else(|e| format!("{{\"error\": {:?}}}", e.to_string()))
}

/// Escapes text for HTML element content and attribute values.
pub fn escape_html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// One self-contained HTML page: inline CSS, no scripts, no external assets.
pub fn render_html(report: &Report) -> String {
    let e = escape_html;
    let mut out = String::new();
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<title>trellara-check {}</title><style>\
body{{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222}}\
table{{border-collapse:collapse;margin:.5em 0 1.5em}}td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}}\
.grade{{font-size:2.5em;font-weight:bold}}.critical{{color:#b00020}}.warning{{color:#a65c00}}.unknown{{color:#555}}.note{{color:#246}}\
code{{background:#f4f4f4;padding:0 .2em}}footer{{margin-top:2em;color:#555}}\
</style></head><body>\n",
        e(&report.target)
    );
    let f = &report.facts;
    let _ = writeln!(
        out,
        "<h1>trellara-check</h1><p>{} · PostgreSQL {} ({}) · read-only · no state written</p>",
        e(&report.target),
        e(&f.server.version),
        if f.server.standby {
            "standby"
        } else {
            "primary"
        }
    );
    let _ = write!(
        out,
        "<p><span class=\"grade\">{}</span> {}/100 · verdict <b>{}</b> (exit {})</p>\n<table>",
        report.grade.letter,
        report.grade.score,
        e(&report.verdict_line()),
        report.exit_code
    );
    for (k, v) in [
        ("capture readiness", report.readiness_line()),
        ("slots", report.slots_line()),
        ("wal headroom", report.headroom_line()),
        ("failover slots", report.failover.summary.clone()),
        ("actions", format!("{} recommended", report.actions.len())),
    ] {
        let _ = write!(out, "<tr><th>{}</th><td>{}</td></tr>", e(k), e(&v));
    }
    out.push_str("</table>\n<h2>Findings</h2><table><tr><th>rule</th><th>severity</th><th>subject</th><th>finding</th><th>points</th></tr>");
    for x in &report.findings {
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=\"{}\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            x.rule,
            x.severity.as_str(),
            x.severity.as_str(),
            e(x.subject.as_deref().unwrap_or("")),
            e(&x.message),
            x.points
        );
    }
    out.push_str("</table>\n<h2>Grade rules</h2><table><tr><th>rule</th><th>name</th><th>findings</th><th>deduction</th></tr>");
    for d in &report.grade.deductions {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>-{}</td></tr>",
            d.rule, d.name, d.count, d.points
        );
    }
    let _ = writeln!(
        out,
        "</table><p>Start at 100; A&gt;=90 B&gt;=80 C&gt;=70 D&gt;=60 else F; a critical finding caps the grade at F. Score {}.</p>",
        report.grade.score
    );
    out.push_str("<h2>Slots</h2><table><tr><th>slot</th><th>type</th><th>plugin</th><th>state</th><th>wal_status</th><th>retained</th><th>safe_wal_size</th><th>invalidation</th><th>failover</th><th>synced</th></tr>");
    for x in &f.slots {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            e(&x.name),
            e(&x.slot_type),
            e(x.plugin.as_deref().unwrap_or("")),
            match (x.state, x.inactive_seconds) {
                (SlotState::Active, _) => "active".to_string(),
                (SlotState::Stalled, Some(s)) => format!("stalled {}", duration(s)),
                (SlotState::Stalled, None) =>
                    "stalled (duration unknown before PostgreSQL 17)".into(),
                (SlotState::Invalidated, _) => "invalidated".into(),
            },
            e(&opt(&x.wal_status)),
            x.retained_bytes.map(bytes).unwrap_or_default(),
            x.safe_wal_size.map(bytes).unwrap_or_default(),
            e(x.invalidation_reason.as_deref().unwrap_or("")),
            x.failover.map(|v| v.to_string()).unwrap_or_default(),
            x.synced.map(|v| v.to_string()).unwrap_or_default(),
        );
    }
    out.push_str("</table>\n<h2>Tables</h2><table><tr><th>table</th><th>kind</th><th>identity</th><th>TOAST-able non-key columns</th><th>publications</th></tr>");
    for m in &f.tables.missing {
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=\"critical\">does not exist</td><td></td><td></td><td></td></tr>",
            e(m)
        );
    }
    for t in &f.tables.tables {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            e(&t.name),
            e(&t.kind),
            if t.unlogged { " (unlogged)" } else { "" },
            e(&t.replica_identity),
            e(&t.toastable_non_key_columns.join(", ")),
            e(&t.publications
                .iter()
                .map(|p| format!("{} (via root {})", p.name, p.via_partition_root))
                .collect::<Vec<_>>()
                .join(", "))
        );
    }
    out.push_str("</table>\n<h2>Failover</h2><ul>");
    for g in &report.failover.guidance {
        let _ = write!(out, "<li>{}</li>", e(g));
    }
    out.push_str("</ul>\n<h2>Actions</h2><ol>");
    for a in &report.actions {
        let _ = write!(
            out,
            "<li><code>{}</code> — {}</li>",
            e(&a.statement),
            e(&a.resolves.join("; "))
        );
    }
    let _ = write!(
        out,
        "</ol>\n<footer>{} read-only statements in one READ ONLY transaction. {}</footer>\n</body></html>\n",
        f.statements,
        e(NOTHING_CREATED)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes() {
        assert_eq!(duration(8040), "2h14m");
        assert_eq!(duration(90), "1m");
        assert_eq!(duration(5), "5s");
        assert_eq!(duration(200_000), "2d7h");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(12), "12 B");
        assert_eq!(hours(36.2), "36h");
        assert_eq!(hours(0.5), "30m");
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(
            escape_html("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }
}
