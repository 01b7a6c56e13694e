//! The rules: facts in, findings, grade, failover posture, WAL headroom and
//! numbered actions out. Pure functions over [`Facts`]; no I/O.
//!
//! Invariants:
//! - Every finding names a rule of [`RULES`]; its points come from that
//!   rule (W05 is the one rule whose points depend on a threshold), and a
//!   rule's total deduction never exceeds its cap.
//! - Any critical finding caps the grade at F and makes the verdict
//!   `blocked`; the verdict is `ready` only without one.
//! - Something the grader could not see is a `U01` finding (with the grant
//!   that would reveal it), never silence.
//! - Actions are concrete statements or settings, for an administrator to
//!   run; the grader runs none of them.

use crate::probe::quote_ident;
use crate::report::{
    Action, Deduction, Facts, Failover, Finding, Grade, Identity, Severity, SlotState, Verdict,
};
use std::collections::BTreeMap;

/// One row of the rule table (docs/CHECK.md prints the same table).
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub id: &'static str,
    pub name: &'static str,
    pub severity: Severity,
    /// Points per finding (W05: the largest of its thresholds; critical
    /// findings also force F whatever the score).
    pub points: u32,
    /// Most points the rule deducts in total.
    pub cap: u32,
    pub when: &'static str,
}

const fn rule(
    id: &'static str,
    name: &'static str,
    severity: Severity,
    points: u32,
    cap: u32,
    when: &'static str,
) -> Rule {
    Rule {
        id,
        name,
        severity,
        points,
        cap,
        when,
    }
}

use Severity::{Critical, Note, Unknown, Warning};

/// The rule table.
pub const RULES: &[Rule] = &[
    rule(
        "C01",
        "wal_level_not_logical",
        Critical,
        40,
        100,
        "wal_level is not logical",
    ),
    rule(
        "C02",
        "no_replication_privilege",
        Critical,
        40,
        100,
        "the role is neither superuser nor REPLICATION nor a member of a provider replication role",
    ),
    rule(
        "C03",
        "no_free_replication_slot",
        Critical,
        40,
        100,
        "max_replication_slots is used up (or 0)",
    ),
    rule(
        "C04",
        "no_free_wal_sender",
        Critical,
        40,
        100,
        "max_wal_senders is used up (or 0)",
    ),
    rule(
        "C05",
        "table_missing",
        Critical,
        40,
        100,
        "a --table does not exist (or is not visible)",
    ),
    rule(
        "C06",
        "table_without_identity",
        Critical,
        40,
        100,
        "a --table has no primary key and REPLICA IDENTITY DEFAULT, NOTHING or an invalid index",
    ),
    rule(
        "C07",
        "table_not_replicable",
        Critical,
        40,
        100,
        "a --table is unlogged, a view, foreign or another relation logical replication cannot publish",
    ),
    rule(
        "C08",
        "output_plugin_refused",
        Critical,
        40,
        100,
        "output_plugin_libraries does not list pgoutput",
    ),
    rule(
        "C09",
        "standby_before_16",
        Critical,
        40,
        100,
        "the server is a standby before PostgreSQL 16 (no logical decoding on standbys)",
    ),
    rule(
        "W01",
        "slot_stalled",
        Warning,
        10,
        20,
        "a slot is inactive (no consumer) and not invalidated: it retains WAL",
    ),
    rule(
        "W02",
        "slot_unreserved",
        Warning,
        15,
        30,
        "a slot's wal_status is unreserved: it is about to be invalidated",
    ),
    rule(
        "W03",
        "slot_extended",
        Warning,
        5,
        10,
        "a slot's wal_status is extended: it retains more than max_wal_size",
    ),
    rule(
        "W04",
        "slot_invalidated",
        Warning,
        5,
        10,
        "a slot is invalidated (wal_status lost, invalidation_reason or conflicting)",
    ),
    rule(
        "W05",
        "wal_headroom_low",
        Warning,
        25,
        25,
        "WAL headroom at the sampled rate is under 1 h (25), 6 h (15) or 24 h (5)",
    ),
    rule(
        "W06",
        "wal_retention_unbounded",
        Warning,
        10,
        10,
        "max_slot_wal_keep_size = -1 (and, on 18, idle_replication_slot_timeout = 0): a stalled slot can fill the disk",
    ),
    rule(
        "W07",
        "slot_headroom_low",
        Warning,
        10,
        10,
        "fewer than 2 free replication slots",
    ),
    rule(
        "W08",
        "sender_headroom_low",
        Warning,
        10,
        10,
        "fewer than 2 free WAL senders",
    ),
    rule(
        "W09",
        "failover_not_enabled",
        Warning,
        5,
        5,
        "PostgreSQL 17+ primary: a logical slot has failover = false",
    ),
    rule(
        "W10",
        "failover_not_synchronized",
        Warning,
        5,
        5,
        "PostgreSQL 17+ primary: a failover slot is not (provably) synchronized to a standby",
    ),
    rule(
        "W11",
        "table_without_identity_unrequested",
        Warning,
        5,
        15,
        "a table (no --table given) has no usable replica identity",
    ),
    rule(
        "W12",
        "toast_old_image",
        Note,
        2,
        6,
        "DEFAULT/INDEX identity with TOAST-able non-key columns: old images carry only the key",
    ),
    rule(
        "W13",
        "partition_not_via_root",
        Warning,
        5,
        10,
        "a publication covers a partitioned table with publish_via_partition_root = false",
    ),
    rule(
        "W14",
        "table_unlogged",
        Warning,
        2,
        6,
        "a table (no --table given) is unlogged: not replicable",
    ),
    rule(
        "W15",
        "table_not_readable",
        Warning,
        5,
        10,
        "the role lacks SELECT on a table (the initial snapshot needs it)",
    ),
    rule(
        "W16",
        "standby_conflicts",
        Warning,
        5,
        5,
        "replication conflicts were recorded (pg_stat_database_conflicts)",
    ),
    rule(
        "W17",
        "hot_standby_feedback_off",
        Warning,
        5,
        5,
        "a standby with hot_standby_feedback = off (logical slots there get invalidated by conflicts)",
    ),
    rule(
        "W18",
        "no_create_on_database",
        Warning,
        3,
        3,
        "the role cannot CREATE in the database (creating a publication needs it)",
    ),
    rule(
        "W19",
        "prepared_transaction_open",
        Warning,
        5,
        10,
        "a prepared (two-phase) transaction is open: creating a slot waits until it ends",
    ),
    rule(
        "N01",
        "output_plugin_libraries_absent",
        Note,
        0,
        0,
        "the server has no output_plugin_libraries (predates the CVE-2026-6471 minors)",
    ),
    rule(
        "N02",
        "output_plugin_trellara_not_allowed",
        Note,
        0,
        0,
        "output_plugin_libraries lists pgoutput but not trellara (needed only for native capture)",
    ),
    rule(
        "N03",
        "failover_unsupported",
        Note,
        0,
        0,
        "before PostgreSQL 17 logical slots are not synchronized to standbys",
    ),
    rule(
        "N04",
        "idle_timeout_disabled",
        Note,
        0,
        0,
        "PostgreSQL 18: idle_replication_slot_timeout = 0",
    ),
    rule(
        "U01",
        "not_visible",
        Unknown,
        3,
        15,
        "a fact this role cannot see (reported with the grant that reveals it)",
    ),
];

fn lookup(id: &str) -> &'static Rule {
    RULES
        .iter()
        .find(|r| r.id == id)
        .unwrap_or(&RULES[RULES.len() - 1])
}

struct Findings(Vec<Finding>);

impl Findings {
    fn add(&mut self, id: &str, subject: Option<String>, message: String, action: Option<String>) {
        let r = lookup(id);
        self.add_points(id, subject, message, action, r.points);
    }

    fn add_points(
        &mut self,
        id: &str,
        subject: Option<String>,
        message: String,
        action: Option<String>,
        points: u32,
    ) {
        let r = lookup(id);
        self.0.push(Finding {
            rule: r.id,
            name: r.name,
            severity: r.severity,
            subject,
            message,
            points,
            action,
        });
    }
}

const MIB: i64 = 1024 * 1024;

/// Bytes rounded up to whole GiB.
fn gib_ceil(bytes: i64) -> i64 {
    let gib = 1024 * MIB;
    bytes.max(0).saturating_add(gib - 1) / gib
}

/// Everything derived from the facts.
#[derive(Debug)]
pub struct Evaluation {
    pub findings: Vec<Finding>,
    pub grade: Grade,
    pub actions: Vec<Action>,
    pub failover: Failover,
    pub verdict: Verdict,
}

/// Applies the rules. Fills `facts.wal.headroom_*`.
pub fn evaluate(facts: &mut Facts) -> Evaluation {
    let mut out = Findings(Vec::new());
    let role_q = quote_ident(&facts.role.name);
    let s = facts.settings.clone();
    let standby = facts.server.standby;
    let v = facts.server.version_num;

    // Server settings.
    match s.wal_level.as_deref() {
        Some("logical") | None => {}
        Some(level) => {
            let action = match &s.provider_logical_switch {
                Some(x) if x.name.starts_with("rds.") => {
                    "set rds.logical_replication = 1 in the DB parameter group, then reboot the instance".to_string()
                }
                Some(x) => format!("set the {} flag to on, then restart the instance", x.name),
                None => "ALTER SYSTEM SET wal_level = logical; -- then restart PostgreSQL".to_string(),
            };
            out.add(
                "C01",
                Some("wal_level".into()),
                format!("wal_level is {level}; logical decoding needs wal_level = logical (takes effect after a restart)"),
                Some(action),
            );
        }
    }
    for p in &facts.prepared_transactions {
        let gid = p.gid.replace('\'', "''");
        out.add(
            "W19",
            Some(format!("prepared transaction {}", p.gid)),
            format!(
                "transaction {} (gid {}, database {}) has been prepared since {}: creating a replication slot waits until it is committed or rolled back",
                p.xid, p.gid, p.database, p.prepared
            ),
            Some(format!("COMMIT PREPARED '{gid}'; -- or ROLLBACK PREPARED '{gid}', as its owner decides")),
        );
    }
    if v < 160_000 && standby {
        out.add(
            "C09",
            None,
            format!("this is a standby on PostgreSQL {}: logical decoding on a standby needs PostgreSQL 16+; point capture at the primary", facts.server.version),
            None,
        );
    }

    // Replication privilege.
    let r = &facts.role;
    if !r.replication_attribute {
        if !r.provider_replication_roles.is_empty() {
            facts.unknowns.push(crate::report::Unknown {
                what: "replication privilege".into(),
                reason: format!(
                    "{} has no REPLICATION attribute but is a member of {}, which grants replication on that managed provider; the catalog cannot prove it (creating the slot will)",
                    r.name,
                    r.provider_replication_roles.join(", ")
                ),
                grant: None,
            });
        } else {
            let action = if r
                .provider_roles_present
                .iter()
                .any(|p| p == "rds_replication")
            {
                format!("GRANT rds_replication TO {role_q};")
            } else {
                format!("ALTER ROLE {role_q} WITH REPLICATION;")
            };
            out.add(
                "C02",
                Some(format!("role {}", r.name)),
                format!("role {} is not superuser, has no REPLICATION attribute and is in no provider replication role: it cannot create or stream a replication slot", r.name),
                Some(action),
            );
        }
    }
    if !r.create_on_database && !r.superuser {
        out.add(
            "W18",
            Some(format!("role {}", r.name)),
            format!(
                "role {} cannot CREATE in database {}: creating the publication needs it (or an administrator creates it)",
                r.name, facts.server.database
            ),
            Some(format!(
                "GRANT CREATE ON DATABASE {} TO {role_q};",
                quote_ident(&facts.server.database)
            )),
        );
    }

    // Slot and sender capacity.
    if let (Some(max), Some(used)) = (s.max_replication_slots, facts.usage.replication_slots) {
        let free = max - used;
        let action = format!(
            "ALTER SYSTEM SET max_replication_slots = {}; -- then restart PostgreSQL",
            used + 4
        );
        if free <= 0 {
            out.add(
                "C03",
                Some("max_replication_slots".into()),
                format!(
                    "{} of {max} replication slots used: none free for capture",
                    used
                ),
                Some(action),
            );
        } else if free < 2 {
            out.add(
                "W07",
                Some("max_replication_slots".into()),
                format!("{} of {max} replication slots used: {free} free", used),
                Some(action),
            );
        }
    }
    if let (Some(max), Some(used)) = (s.max_wal_senders, facts.usage.wal_senders) {
        let free = max - used;
        let action = format!(
            "ALTER SYSTEM SET max_wal_senders = {}; -- then restart PostgreSQL",
            used + 4
        );
        if free <= 0 {
            out.add(
                "C04",
                Some("max_wal_senders".into()),
                format!(
                    "{} of {max} WAL senders in use: none free for capture",
                    used
                ),
                Some(action),
            );
        } else if free < 2 {
            out.add(
                "W08",
                Some("max_wal_senders".into()),
                format!("{} of {max} WAL senders in use: {free} free", used),
                Some(action),
            );
        }
    }

    // output_plugin_libraries (CVE-2026-6471 minors).
    match (s.has_output_plugin_libraries, &s.output_plugin_libraries) {
        (Some(true), list) => {
            let list = list.clone().unwrap_or_default();
            let has = |p: &str| list.iter().any(|x| x == p);
            if !has("pgoutput") || !has("trellara") {
                let mut wanted = list.clone();
                for p in ["pgoutput", "trellara"] {
                    if !has(p) {
                        wanted.push(p.into());
                    }
                }
                let action = format!(
                    "ALTER SYSTEM SET output_plugin_libraries = {}; SELECT pg_reload_conf();",
                    wanted
                        .iter()
                        .map(|p| format!("'{}'", p.replace('\'', "''")))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                if !has("pgoutput") {
                    out.add("C08", Some("output_plugin_libraries".into()), format!("output_plugin_libraries = '{}' does not list pgoutput: the server refuses pgoutput slots and streams, superusers included", list.join(", ")), Some(action));
                } else {
                    out.add("N02", Some("output_plugin_libraries".into()), format!("output_plugin_libraries = '{}' allows pgoutput (external capture) but not trellara (native extension capture)", list.join(", ")), Some(action));
                }
            }
        }
        (Some(false), _) => out.add(
            "N01",
            Some("output_plugin_libraries".into()),
            "the server has no output_plugin_libraries setting: it predates the CVE-2026-6471 minor releases, so every decoding plugin is allowed; apply the latest minor release".into(),
            None,
        ),
        (None, _) => {}
    }

    // WAL retention and headroom.
    let keep = s.max_slot_wal_keep_size_mb;
    let idle = s.idle_replication_slot_timeout_s;
    if keep == Some(-1) && !matches!(idle, Some(t) if t > 0) {
        let largest = facts.wal.largest_retained_bytes.unwrap_or(0);
        let max_wal = s.max_wal_size_mb.unwrap_or(1024) * MIB;
        let suggest_gib = gib_ceil(
            [10 * 1024 * MIB, 2 * largest, 4 * max_wal]
                .into_iter()
                .max()
                .unwrap_or(10 * 1024 * MIB),
        );
        out.add(
            "W06",
            Some("max_slot_wal_keep_size".into()),
            format!(
                "max_slot_wal_keep_size = -1{}: a slot whose consumer stalls retains WAL until the disk is full",
                if v >= 180_000 { " and idle_replication_slot_timeout = 0" } else { "" }
            ),
            Some(format!(
                "ALTER SYSTEM SET max_slot_wal_keep_size = '{suggest_gib}GB'; SELECT pg_reload_conf(); -- size it to the pg_wal disk you can spare"
            )),
        );
    } else if v >= 180_000 && idle == Some(0) {
        out.add("N04", Some("idle_replication_slot_timeout".into()), "idle_replication_slot_timeout = 0: idle slots are invalidated only by max_slot_wal_keep_size".into(), None);
    }
    headroom(facts, &mut out);

    // Slots.
    for slot in facts.slots.clone() {
        let drop = format!(
            "SELECT pg_drop_replication_slot('{}');",
            slot.name.replace('\'', "''")
        );
        let retained = slot
            .retained_bytes
            .map(|b| format!("; retains {}", crate::report::bytes(b)))
            .unwrap_or_default();
        match slot.state {
            SlotState::Invalidated => {
                let why = slot
                    .invalidation_reason
                    .clone()
                    .or_else(|| {
                        (slot.conflicting == Some(true))
                            .then(|| "conflict with recovery (conflicting = true)".into())
                    })
                    .or_else(|| slot.wal_status.clone().map(|w| format!("wal_status {w}")))
                    .unwrap_or_else(|| "invalidated".into());
                out.add(
                    "W04",
                    Some(format!("slot {}", slot.name)),
                    format!("invalidated ({why}): it can never stream again and only occupies a slot; its consumer needs a reseed"),
                    Some(drop),
                );
            }
            SlotState::Stalled => {
                let how_long = match slot.inactive_seconds {
                    Some(secs) => format!("inactive for {}", crate::report::duration(secs)),
                    None if v >= 170_000 => "inactive (inactive_since unknown)".into(),
                    None => "inactive (for how long is unknown before PostgreSQL 17)".into(),
                };
                out.add(
                    "W01",
                    Some(format!("slot {}", slot.name)),
                    format!("stalled: no consumer, {how_long}{retained}; resume its consumer, or drop it if nobody will"),
                    Some(format!("{drop} -- only if no consumer will return to it")),
                );
            }
            SlotState::Active => {}
        }
        if slot.state != SlotState::Invalidated {
            match slot.wal_status.as_deref() {
                Some("unreserved") => out.add(
                    "W02",
                    Some(format!("slot {}", slot.name)),
                    format!("wal_status unreserved{retained}: it will be invalidated at the next checkpoint unless its consumer catches up"),
                    Some("ALTER SYSTEM SET max_slot_wal_keep_size = '<larger>'; SELECT pg_reload_conf(); -- or let the consumer catch up".into()),
                ),
                Some("extended") => out.add(
                    "W03",
                    Some(format!("slot {}", slot.name)),
                    format!("wal_status extended{retained}: it holds more than max_wal_size"),
                    None,
                ),
                _ => {}
            }
        }
    }

    // Standby posture.
    if standby && s.hot_standby_feedback.as_deref() == Some("off") {
        out.add(
            "W17",
            Some("hot_standby_feedback".into()),
            "hot_standby_feedback = off: logical slots on this standby are invalidated when the primary removes rows they need".into(),
            Some("ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf();".into()),
        );
    }
    if let Some(c) = &facts.conflicts
        && c.total() > 0
    {
        out.add(
            "W16",
            None,
            format!(
                "{} replication conflicts since the statistics reset (snapshot {}, lock {}, bufferpin {}, deadlock {}, tablespace {}{})",
                c.total(), c.snapshot, c.lock, c.bufferpin, c.deadlock, c.tablespace,
                c.active_logicalslot.map(|n| format!(", logical slot {n}")).unwrap_or_default()
            ),
            (standby && s.hot_standby_feedback.as_deref() != Some("on")).then(|| "ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf();".into()),
        );
    }

    // Failover.
    let failover = failover(facts, &mut out);

    // Tables.
    let requested = facts.tables.requested;
    for m in &facts.tables.missing {
        out.add(
            "C05",
            Some(m.clone()),
            format!("--table {m} does not exist (or is not visible to {}): check the name (schema.name)", facts.role.name),
            None,
        );
    }
    let publications = facts.publications.clone();
    for t in &facts.tables.tables {
        let subject = Some(t.name.clone());
        if !matches!(t.kind.as_str(), "table" | "partitioned table") {
            out.add(
                "C07",
                subject.clone(),
                format!(
                    "{} is a {}: logical replication publishes only tables",
                    t.name, t.kind
                ),
                None,
            );
            continue;
        }
        if t.unlogged {
            let msg = format!(
                "{} is UNLOGGED: its changes are not in the WAL, so they cannot be captured",
                t.name
            );
            let action = Some(format!("ALTER TABLE {} SET LOGGED;", t.name));
            out.add(
                if requested { "C07" } else { "W14" },
                subject.clone(),
                msg,
                action,
            );
        }
        if t.identity == Identity::None {
            let msg = format!(
                "no primary key and REPLICA IDENTITY {}: once published, UPDATE and DELETE on it fail, and changes cannot be keyed",
                t.replica_identity.to_uppercase()
            );
            let action = Some(format!(
                "ALTER TABLE {} REPLICA IDENTITY FULL; -- or add a primary key",
                t.name
            ));
            out.add(
                if requested { "C06" } else { "W11" },
                subject.clone(),
                msg,
                action,
            );
        }
        if !t.toastable_non_key_columns.is_empty() {
            out.add(
                "W12",
                subject.clone(),
                format!(
                    "REPLICA IDENTITY {} with TOAST-able non-key columns ({}): old images carry only the key, and unchanged TOASTed values are omitted from UPDATE images; use FULL if consumers need full old images",
                    if t.identity == Identity::Index { "INDEX" } else { "DEFAULT" },
                    t.toastable_non_key_columns.join(", ")
                ),
                Some(format!("ALTER TABLE {} REPLICA IDENTITY FULL; -- only if full old images are needed", t.name)),
            );
        }
        if t.kind == "partitioned table" {
            for publication in &t.publications {
                let p = &publication.name;
                if !publication.via_partition_root {
                    out.add(
                        "W13",
                        subject.clone(),
                        format!("publication {p} covers this partitioned table with publish_via_partition_root = false: changes arrive under each partition's name, not the table's"),
                        Some(format!("ALTER PUBLICATION {} SET (publish_via_partition_root = true);", quote_ident(p))),
                    );
                }
            }
        }
        if !t.can_select && !facts.role.superuser {
            out.add(
                "W15",
                subject.clone(),
                format!(
                    "{} cannot SELECT from {}: the initial snapshot needs it",
                    facts.role.name, t.name
                ),
                Some(format!("GRANT SELECT ON {} TO {role_q};", t.name)),
            );
        }
    }
    let _ = publications;

    // Unknowns.
    for u in &facts.unknowns {
        out.add(
            "U01",
            Some(u.what.clone()),
            format!("unknown: {}", u.reason),
            u.grant.clone(),
        );
    }

    let mut findings = out.0;
    findings.sort_by(|a, b| (a.severity, a.rule).cmp(&(b.severity, b.rule)));
    let grade = grade(&findings);
    let actions = actions(&findings);
    let essential_unknown =
        s.wal_level.is_none() || s.max_replication_slots.is_none() || s.max_wal_senders.is_none();
    let verdict = if findings.iter().any(|f| f.severity == Critical) {
        Verdict::Blocked
    } else if essential_unknown {
        Verdict::Unassessed
    } else {
        Verdict::Ready
    };
    Evaluation {
        findings,
        grade,
        actions,
        failover,
        verdict,
    }
}

/// Hours of headroom: (the smallest `safe_wal_size` of a live slot, or
/// `max_slot_wal_keep_size` minus what is retained) / the sampled rate.
fn headroom(facts: &mut Facts, out: &mut Findings) {
    let secs = format!("{} s", facts.wal.sample_seconds.round() as i64);
    let wal = &mut facts.wal;
    let live: Vec<_> = facts
        .slots
        .iter()
        .filter(|x| x.state != SlotState::Invalidated)
        .collect();
    match facts.settings.max_slot_wal_keep_size_mb {
        None => {
            wal.headroom_basis =
                "unknown: max_slot_wal_keep_size is not visible to this role".into()
        }
        Some(-1) => {
            wal.headroom_basis = format!(
                "bounded only by disk, which the grader cannot see (max_slot_wal_keep_size = -1){}",
                wal.largest_retained_bytes
                    .map(|b| format!("; slots retain up to {}", crate::report::bytes(b)))
                    .unwrap_or_default()
            );
        }
        Some(mb) => {
            let keep = mb.saturating_mul(MIB);
            let remaining = live
                .iter()
                .filter_map(|x| x.safe_wal_size)
                .min()
                .unwrap_or_else(|| keep - wal.largest_retained_bytes.unwrap_or(0))
                .max(0);
            let whose = if live.is_empty() {
                "a new slot"
            } else {
                "the most exposed slot"
            };
            match wal.bytes_per_second {
                None => {
                    wal.headroom_basis = format!(
                        "unknown: the WAL rate could not be sampled; {} of WAL before {whose} is invalidated",
                        crate::report::bytes(remaining)
                    )
                }
                Some(rate) if rate < 1.0 => {
                    wal.headroom_basis = format!(
                        "not measurable: no WAL was written in the last {secs}; {} of WAL before {whose} is invalidated (max_slot_wal_keep_size = {mb} MB)",
                        crate::report::bytes(remaining)
                    )
                }
                Some(rate) => {
                    let hours = remaining as f64 / rate / 3600.0;
                    wal.headroom_hours = Some(hours);
                    wal.headroom_basis = format!(
                        "{} before {whose} is invalidated (max_slot_wal_keep_size = {mb} MB) / {}/s, the rate of the last {secs}",
                        crate::report::bytes(remaining),
                        crate::report::bytes(rate as i64)
                    );
                    let points = if hours < 1.0 {
                        25
                    } else if hours < 6.0 {
                        15
                    } else if hours < 24.0 {
                        5
                    } else {
                        0
                    };
                    if points > 0 {
                        out.add_points(
                            "W05",
                            Some("wal headroom".into()),
                            format!("~{hours:.1} h of WAL headroom at the rate of the last {secs}: a consumer stalled that long loses its slot"),
                            Some(format!(
                                "ALTER SYSTEM SET max_slot_wal_keep_size = '{}GB'; SELECT pg_reload_conf(); -- if pg_wal has the room",
                                gib_ceil((rate * 3600.0 * 24.0) as i64 + wal.largest_retained_bytes.unwrap_or(0)).max(1)
                            )),
                            points,
                        );
                    }
                }
            }
        }
    }
}

fn failover(facts: &Facts, out: &mut Findings) -> Failover {
    let v = facts.server.version_num;
    let supported = v >= 170_000;
    let live_logical: Vec<_> = facts
        .slots
        .iter()
        .filter(|x| x.slot_type == "logical" && x.state != SlotState::Invalidated)
        .collect();
    let physical_names: Vec<String> = facts
        .slots
        .iter()
        .filter(|x| x.slot_type == "physical" && x.state == SlotState::Active)
        .map(|x| x.name.clone())
        .collect();
    let active_physical = physical_names.len();
    let enabled: Vec<String> = live_logical
        .iter()
        .filter(|x| x.failover == Some(true))
        .map(|x| x.name.clone())
        .collect();
    let not_enabled: Vec<String> = live_logical
        .iter()
        .filter(|x| x.failover == Some(false))
        .map(|x| x.name.clone())
        .collect();
    let synced: Vec<String> = facts
        .slots
        .iter()
        .filter(|x| x.synced == Some(true))
        .map(|x| x.name.clone())
        .collect();
    let mut guidance = Vec::new();
    let summary;
    if !supported {
        summary = "not supported before PostgreSQL 17 · slots are lost on failover".to_string();
        guidance.push(format!(
            "PostgreSQL {} does not synchronize logical slots to standbys: after a failover every logical slot, and its position, is gone; capture must be reseeded from the new primary. PostgreSQL 17+ has failover slots.",
            facts.server.version
        ));
        out.add(
            "N03",
            None,
            "logical slots are not synchronized to standbys before PostgreSQL 17: a failover loses them (plan a reseed)".into(),
            None,
        );
    } else if facts.server.standby {
        summary = format!(
            "supported · standby · sync_replication_slots = {} · {} synced",
            facts
                .settings
                .sync_replication_slots
                .as_deref()
                .unwrap_or("unknown"),
            synced.len()
        );
        guidance.push(format!(
            "on this standby sync_replication_slots = {}; synced slots: {}. Synchronization needs primary_slot_name, hot_standby_feedback = on and a dbname in primary_conninfo.",
            facts.settings.sync_replication_slots.as_deref().unwrap_or("unknown"),
            if synced.is_empty() { "none".into() } else { synced.join(", ") }
        ));
    } else {
        let (setting_name, setting_value) = facts
            .settings
            .standby_slots_setting
            .clone()
            .map(|x| (x.name, x.value))
            .unwrap_or_else(|| ("synchronized_standby_slots".into(), String::new()));
        if live_logical.is_empty() {
            summary = "supported · no logical slots yet (create them with failover = true)".into();
            guidance.push("create capture slots with failover = true: pg_create_logical_replication_slot('slot', 'pgoutput', false, false, true)".into());
        } else if enabled.is_empty() {
            summary = "supported · not enabled".into();
        } else if active_physical == 0 {
            summary = format!(
                "supported · {} enabled · not synchronized to any standby",
                enabled.len()
            );
        } else if setting_value.trim().is_empty() {
            summary = format!(
                "supported · {} enabled · {setting_name} empty",
                enabled.len()
            );
        } else {
            summary = format!(
                "supported · {} enabled · {setting_name} = {setting_value}",
                enabled.len()
            );
        }
        for name in &not_enabled {
            out.add(
                "W09",
                Some(format!("slot {name}")),
                "failover = false: this slot is not synchronized to standbys, so a failover loses it".into(),
                Some(format!(
                    "ALTER_REPLICATION_SLOT {} (FAILOVER true) -- replication command (psql \"dbname={} replication=database\"), slot inactive",
                    quote_ident(name),
                    facts.server.database
                )),
            );
        }
        if !not_enabled.is_empty() {
            guidance.push(format!(
                "failover is not enabled on {}: after a failover these slots do not exist on the new primary",
                not_enabled.join(", ")
            ));
        }
        for name in &enabled {
            if active_physical == 0 {
                guidance.push(format!(
                    "failover slot {name} is not synchronized to any standby: no standby streams through a physical slot, which slot synchronization needs (on the standby: primary_slot_name, hot_standby_feedback = on, sync_replication_slots = on)"
                ));
                out.add(
                    "W10",
                    Some(format!("slot {name}")),
                    "failover = true but not synchronized to any standby: no physical slot is in use by a standby".into(),
                    Some("ALTER SYSTEM SET sync_replication_slots = on; ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf(); -- on the standby, with primary_slot_name set".into()),
                );
            } else if setting_value.trim().is_empty() {
                guidance.push(format!(
                    "failover slot {name}: {setting_name} is empty, so a logical consumer may get ahead of the standby and the synchronized slot would be unusable after failover"
                ));
                out.add(
                    "W10",
                    Some(format!("slot {name}")),
                    format!("failover = true but {setting_name} is empty: synchronization to a standby is not confirmed before the consumer sees changes"),
                    Some(format!(
                        "ALTER SYSTEM SET {setting_name} = '{}'; SELECT pg_reload_conf();",
                        physical_names.join(", ").replace('\'', "''")
                    )),
                );
            } else {
                guidance.push(format!(
                    "failover slot {name}: {setting_name} = {setting_value}, and standbys stream through {}; synced = true on the standby confirms the synchronization (the primary cannot see the standby's sync_replication_slots)",
                    physical_names.join(", ")
                ));
            }
        }
    }
    Failover {
        supported,
        logical_slots: live_logical.len(),
        failover_enabled: enabled,
        failover_not_enabled: not_enabled,
        synced,
        active_physical_slots: active_physical,
        summary,
        guidance,
    }
}

/// Start at 100, subtract each rule's capped total; a critical finding caps
/// the letter at F.
pub fn grade(findings: &[Finding]) -> Grade {
    let mut by_rule: BTreeMap<&'static str, (u32, usize)> = BTreeMap::new();
    for f in findings {
        let e = by_rule.entry(f.rule).or_insert((0, 0));
        e.0 += f.points;
        e.1 += 1;
    }
    let deductions: Vec<Deduction> = by_rule
        .into_iter()
        .filter_map(|(id, (points, count))| {
            let r = lookup(id);
            let points = points.min(r.cap);
            (points > 0 || r.severity == Critical).then_some(Deduction {
                rule: r.id,
                name: r.name,
                points,
                count,
            })
        })
        .collect();
    let total: u32 = deductions.iter().map(|d| d.points).sum();
    let score = 100u32.saturating_sub(total);
    let critical = findings.iter().any(|f| f.severity == Critical);
    let letter = if critical { 'F' } else { letter(score) };
    Grade {
        letter,
        score,
        capped_by_critical: critical,
        deductions,
    }
}

pub fn letter(score: u32) -> char {
    match score {
        90.. => 'A',
        80..=89 => 'B',
        70..=79 => 'C',
        60..=69 => 'D',
        _ => 'F',
    }
}

/// Numbered, de-duplicated actions, critical first.
pub fn actions(findings: &[Finding]) -> Vec<Action> {
    let mut list: Vec<Action> = Vec::new();
    for f in findings {
        let Some(statement) = &f.action else { continue };
        let why = match &f.subject {
            Some(s) => format!("{} {}", f.rule, s),
            None => format!("{} {}", f.rule, f.name),
        };
        match list.iter_mut().find(|a| &a.statement == statement) {
            Some(a) => a.resolves.push(why),
            None => list.push(Action {
                number: list.len() + 1,
                statement: statement.clone(),
                resolves: vec![why],
            }),
        }
    }
    list
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{
        Conflicts, NamedSetting, RoleAccess, Server, Settings, Slot, Tables, Unknown, Usage, Wal,
    };

    /// A healthy PostgreSQL 17 primary: grade A, ready.
    fn healthy() -> Facts {
        Facts {
            server: Server {
                version: "17.9".into(),
                version_num: 170_009,
                standby: false,
                database: "shop".into(),
                transaction_read_only: true,
            },
            role: RoleAccess {
                name: "capture".into(),
                superuser: false,
                replication_attribute: true,
                provider_replication_roles: vec![],
                provider_roles_present: vec![],
                monitor: true,
                read_all_settings: true,
                read_all_stats: true,
                create_on_database: true,
            },
            settings: Settings {
                wal_level: Some("logical".into()),
                max_slot_wal_keep_size_mb: Some(100 * 1024),
                max_wal_size_mb: Some(1024),
                max_replication_slots: Some(10),
                max_wal_senders: Some(10),
                idle_replication_slot_timeout_s: None,
                output_plugin_libraries: Some(vec!["pgoutput".into(), "trellara".into()]),
                has_output_plugin_libraries: Some(true),
                sync_replication_slots: Some("off".into()),
                standby_slots_setting: Some(NamedSetting {
                    name: "synchronized_standby_slots".into(),
                    value: String::new(),
                }),
                hot_standby_feedback: Some("off".into()),
                provider_logical_switch: None,
            },
            usage: Usage {
                replication_slots: Some(0),
                wal_senders: Some(0),
            },
            tables: Tables {
                requested: false,
                missing: vec![],
                tables: vec![],
                truncated: false,
            },
            publications: vec![],
            publications_visible: true,
            slots: vec![],
            slots_visible: true,
            wal: Wal {
                sample_seconds: 5.0,
                bytes_per_second: Some(1024.0 * 1024.0),
                largest_retained_bytes: None,
                pg_wal_bytes: Some(1 << 30),
                headroom_hours: None,
                headroom_basis: String::new(),
            },
            conflicts: Some(Conflicts {
                tablespace: 0,
                lock: 0,
                snapshot: 0,
                bufferpin: 0,
                deadlock: 0,
                active_logicalslot: Some(0),
            }),
            prepared_transactions: vec![],
            unknowns: vec![],
            statements: 20,
        }
    }

    #[test]
    fn an_open_prepared_transaction_is_named_with_its_gid_and_fix() {
        let mut f = healthy();
        f.prepared_transactions
            .push(crate::report::PreparedTransaction {
                gid: "pay'42".into(),
                xid: "731".into(),
                prepared: "2026-12-01 10:00:00+00".into(),
                database: "shop".into(),
            });
        let e = evaluate(&mut f);
        let w = e.findings.iter().find(|x| x.rule == "W19").expect("W19");
        assert!(
            w.message.contains("transaction 731") && w.message.contains("pay'42"),
            "{}",
            w.message
        );
        assert_eq!(
            w.action.as_deref(),
            Some(
                "COMMIT PREPARED 'pay''42'; -- or ROLLBACK PREPARED 'pay''42', as its owner decides"
            )
        );
        assert_eq!(
            e.verdict,
            crate::report::Verdict::Ready,
            "a warning, not a blocker"
        );
    }

    fn slot(name: &str, state: SlotState, wal_status: &str) -> Slot {
        Slot {
            name: name.into(),
            slot_type: "logical".into(),
            plugin: Some("pgoutput".into()),
            database: Some("shop".into()),
            temporary: false,
            state,
            active_pid: None,
            restart_lsn: Some("0/1000000".into()),
            confirmed_flush_lsn: Some("0/1000000".into()),
            wal_status: Some(wal_status.into()),
            safe_wal_size: None,
            retained_bytes: Some(1 << 20),
            inactive_seconds: None,
            inactive_since: None,
            invalidation_reason: None,
            conflicting: Some(false),
            failover: Some(true),
            synced: Some(false),
        }
    }

    fn rules_of(e: &Evaluation) -> Vec<&'static str> {
        e.findings.iter().map(|f| f.rule).collect()
    }

    #[test]
    fn healthy_primary_is_a_ready() {
        let mut f = healthy();
        let e = evaluate(&mut f);
        assert_eq!(rules_of(&e), Vec::<&str>::new());
        assert_eq!(
            (e.grade.letter, e.grade.score, e.verdict),
            ('A', 100, Verdict::Ready)
        );
        // 100 GiB at 1 MiB/s.
        let h = f.wal.headroom_hours.expect("headroom");
        assert!((h - 100.0 * 1024.0 / 3600.0).abs() < 0.01, "{h}");
        assert!(f.wal.headroom_basis.contains("the rate of the last 5 s"));
    }

    #[test]
    fn capacity_and_plugins_block() {
        let mut f = healthy();
        f.usage.replication_slots = Some(10);
        f.usage.wal_senders = Some(9);
        f.settings.output_plugin_libraries = Some(vec!["test_decoding".into()]);
        let e = evaluate(&mut f);
        assert_eq!(rules_of(&e), ["C03", "C08", "W08"]);
        assert_eq!(e.verdict, Verdict::Blocked);
        assert!(e.actions.iter().any(|a| a.statement
            == "ALTER SYSTEM SET output_plugin_libraries = 'test_decoding', 'pgoutput', 'trellara'; SELECT pg_reload_conf();"));
    }

    #[test]
    fn standby_before_16_blocks_and_feedback_off_warns() {
        let mut f = healthy();
        f.server.version_num = 150_020;
        f.server.version = "15.20".into();
        f.server.standby = true;
        f.conflicts = Some(Conflicts {
            tablespace: 0,
            lock: 1,
            snapshot: 2,
            bufferpin: 0,
            deadlock: 0,
            active_logicalslot: None,
        });
        let e = evaluate(&mut f);
        assert_eq!(rules_of(&e), ["C09", "W16", "W17", "N03"]);
        assert_eq!(e.verdict, Verdict::Blocked);
    }

    #[test]
    fn provider_role_is_unknown_not_fine_and_missing_role_is_critical() {
        let mut f = healthy();
        f.role.replication_attribute = false;
        f.role.provider_replication_roles = vec!["rds_replication".into()];
        f.role.provider_roles_present = vec!["rds_replication".into()];
        let e = evaluate(&mut f);
        assert_eq!(rules_of(&e), ["U01"]);
        assert_eq!(e.verdict, Verdict::Ready);
        assert_eq!(e.grade.score, 97);

        let mut f = healthy();
        f.role.replication_attribute = false;
        f.role.provider_roles_present = vec!["rds_replication".into()];
        f.settings.wal_level = Some("replica".into());
        f.settings.provider_logical_switch = Some(NamedSetting {
            name: "rds.logical_replication".into(),
            value: "0".into(),
        });
        let e = evaluate(&mut f);
        assert_eq!(rules_of(&e), ["C01", "C02"]);
        assert_eq!(
            e.actions[0].statement,
            "set rds.logical_replication = 1 in the DB parameter group, then reboot the instance"
        );
        assert_eq!(e.actions[1].statement, "GRANT rds_replication TO capture;");
    }

    #[test]
    fn unreadable_essentials_are_unassessed() {
        let mut f = healthy();
        f.settings.wal_level = None;
        f.unknowns.push(Unknown {
            what: "wal_level".into(),
            reason: "not visible".into(),
            grant: Some("GRANT pg_read_all_settings TO capture;".into()),
        });
        let e = evaluate(&mut f);
        assert_eq!(e.verdict, Verdict::Unassessed);
        assert_eq!(e.verdict.exit_code(), 2);
        assert_eq!(
            e.actions[0].statement,
            "GRANT pg_read_all_settings TO capture;"
        );
    }

    #[test]
    fn slot_states_and_headroom_thresholds() {
        let mut f = healthy();
        f.settings.max_slot_wal_keep_size_mb = Some(4 * 1024);
        let mut unreserved = slot("a", SlotState::Active, "unreserved");
        unreserved.safe_wal_size = Some(-5);
        let mut extended = slot("b", SlotState::Active, "extended");
        extended.safe_wal_size = Some(3 << 30);
        f.slots = vec![unreserved, extended];
        f.usage.replication_slots = Some(2);
        let e = evaluate(&mut f);
        // No physical slot in use: failover slots are not synchronized.
        assert_eq!(rules_of(&e), ["W02", "W03", "W05", "W10", "W10"]);
        assert_eq!(f.wal.headroom_hours, Some(0.0));
        let w05 = e.findings.iter().find(|x| x.rule == "W05").expect("W05");
        assert_eq!(w05.points, 25);

        for (safe, points) in [(3 * 3600, 15), (12 * 3600, 5), (30 * 3600, 0)] {
            let mut f = healthy();
            f.settings.max_slot_wal_keep_size_mb = Some(1 << 20);
            let mut s = slot("a", SlotState::Active, "reserved");
            s.safe_wal_size = Some(safe * (1 << 20));
            s.failover = Some(false);
            f.slots = vec![s];
            let e = evaluate(&mut f);
            let got = e
                .findings
                .iter()
                .find(|x| x.rule == "W05")
                .map(|x| x.points);
            assert_eq!(got.unwrap_or(0), points, "safe {safe} s of WAL");
        }
    }

    #[test]
    fn unbounded_retention_and_idle_timeout() {
        let mut f = healthy();
        f.settings.max_slot_wal_keep_size_mb = Some(-1);
        let e = evaluate(&mut f);
        assert_eq!(rules_of(&e), ["W06"]);
        assert!(f.wal.headroom_hours.is_none());
        assert!(
            f.wal
                .headroom_basis
                .starts_with("bounded only by disk, which the grader cannot see")
        );

        let mut f = healthy();
        f.server.version_num = 180_006;
        f.settings.max_slot_wal_keep_size_mb = Some(-1);
        f.settings.idle_replication_slot_timeout_s = Some(3600);
        assert_eq!(rules_of(&evaluate(&mut f)), Vec::<&str>::new());
        f.settings.idle_replication_slot_timeout_s = Some(0);
        assert_eq!(rules_of(&evaluate(&mut f)), ["W06"]);
    }

    fn finding(id: &str, points: u32) -> Finding {
        let r = lookup(id);
        Finding {
            rule: r.id,
            name: r.name,
            severity: r.severity,
            subject: None,
            message: String::new(),
            points,
            action: None,
        }
    }

    #[test]
    fn rule_ids_are_unique_and_caps_hold() {
        for (i, r) in RULES.iter().enumerate() {
            assert!(RULES[..i].iter().all(|o| o.id != r.id), "{}", r.id);
            assert!(r.points <= r.cap || r.severity == Critical);
        }
        let g = grade(&[finding("W01", 10), finding("W01", 10), finding("W01", 10)]);
        assert_eq!((g.score, g.letter), (80, 'B'));
    }

    #[test]
    fn critical_caps_at_f() {
        let g = grade(&[finding("C01", 40)]);
        assert_eq!(g.letter, 'F');
        assert_eq!(g.score, 60);
        assert!(g.capped_by_critical);
    }

    #[test]
    fn docs_list_every_rule() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CHECK.md");
        let doc = std::fs::read_to_string(path).expect("docs/CHECK.md");
        for r in RULES {
            let row = format!(
                "| {} | `{}` | {} | {} | {} | {} |",
                r.id,
                r.name,
                r.severity.as_str(),
                r.points,
                r.cap,
                r.when
            );
            assert!(doc.contains(&row), "docs/CHECK.md lacks the row\n{row}");
        }
    }

    #[test]
    fn letters() {
        assert_eq!(
            [100, 90, 89, 80, 79, 70, 69, 60, 59, 0].map(letter),
            ['A', 'A', 'B', 'B', 'C', 'C', 'D', 'D', 'F', 'F']
        );
    }

    #[test]
    fn actions_dedupe_and_number() {
        let mut a = finding("W12", 2);
        a.action = Some("X".into());
        let mut b = finding("W12", 2);
        b.action = Some("X".into());
        let mut c = finding("W01", 10);
        c.action = Some("Y".into());
        let list = actions(&[a, b, c]);
        assert_eq!(list.len(), 2);
        assert_eq!((list[0].number, list[1].number), (1, 2));
        assert_eq!(list[0].resolves.len(), 2);
    }
}
