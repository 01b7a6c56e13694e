//! trellara-check against real servers, one test per major: the main report
//! (stalled slot, invalidated slot, failover slot on 17+, tables with and
//! without identity, TOAST, unlogged, partitioned), the read-only proof
//! (catalog snapshot before and after identical; with log_statement = all,
//! every statement of the `trellara-check` session is read-only and there
//! are exactly as many as the grader says it sent), a pg_monitor-only role
//! and a role without it (unknowns with grants, never fine), and
//! wal_level = replica (blocked).

use std::time::Duration;
use trellara_check::report::{Identity, SlotState};
use trellara_check::{ConnectOptions, Report, Request, Severity, Verdict};
use trellara_tests::{Cluster, ClusterOptions, Major, test_cluster};

#[test]
fn check_pg15() {
    live(Major::Pg15);
}

#[test]
fn check_pg16() {
    live(Major::Pg16);
}

#[test]
fn check_pg17() {
    live(Major::Pg17);
}

#[test]
fn check_pg18() {
    live(Major::Pg18);
}

fn assess(url: &str, tables: &[&str]) -> Report {
    let options: ConnectOptions = url.parse().expect("url parses");
    let request = Request {
        tables: tables.iter().map(|t| t.to_string()).collect(),
        sample: Duration::from_secs(1),
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(trellara_check::assess(&options, &request))
        .expect("assessed")
}

fn url_as(cluster: &Cluster, user: &str) -> String {
    format!(
        "postgresql://{user}@{}:{}/postgres",
        cluster.host(),
        cluster.port()
    )
}

/// Catalog state the grader must not change.
fn snapshot(cluster: &Cluster) -> String {
    [
        "SELECT slot_name, plugin, slot_type, database, temporary, active, restart_lsn, confirmed_flush_lsn FROM pg_replication_slots ORDER BY 1",
        "SELECT pubname, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot FROM pg_publication ORDER BY 1",
        "SELECT prpubid, prrelid FROM pg_publication_rel ORDER BY 1, 2",
        "SELECT oid, relname, relkind, relpersistence, relreplident FROM pg_class ORDER BY oid",
        "SELECT rolname, rolsuper, rolreplication, rolcanlogin FROM pg_roles ORDER BY 1",
        "SELECT roname FROM pg_replication_origin ORDER BY 1",
        "SELECT datname FROM pg_database ORDER BY 1",
        "SELECT nspname FROM pg_namespace ORDER BY 1",
        "SELECT gid FROM pg_prepared_xacts ORDER BY 1",
    ]
    .iter()
    .map(|q| format!("{q}\n{:?}\n", cluster.psql(q)))
    .collect()
}

/// Removes '...' literals and "..." identifiers.
fn strip_quoted(sql: &str) -> String {
    let mut out = String::new();
    let mut quote: Option<char> = None;
    for c in sql.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '\'' || c == '"' => {
                quote = Some(c);
                out.push(' ');
            }
            None => out.push(c),
        }
    }
    out
}

/// Whether one logged statement is read-only.
fn read_only_statement(sql: &str) -> bool {
    let upper = strip_quoted(sql).to_uppercase();
    let start_ok = upper.starts_with("SELECT ")
        || upper.starts_with("SHOW ")
        || upper == "COMMIT"
        || upper == "ROLLBACK"
        || upper == "BEGIN READ ONLY"
        || upper.starts_with("SAVEPOINT ")
        || upper.starts_with("RELEASE SAVEPOINT ")
        || upper.starts_with("ROLLBACK TO SAVEPOINT ")
        || upper.starts_with("SET LOCAL STATEMENT_TIMEOUT ")
        || upper.starts_with("SET LOCAL LOCK_TIMEOUT ");
    const DENIED_WORDS: [&str; 20] = [
        "INSERT",
        "UPDATE",
        "DELETE",
        "MERGE",
        "CREATE",
        "DROP",
        "ALTER",
        "GRANT",
        "REVOKE",
        "TRUNCATE",
        "COPY",
        "CHECKPOINT",
        "VACUUM",
        "ANALYZE",
        "CLUSTER",
        "REINDEX",
        "LOCK",
        "NOTIFY",
        "CALL",
        "DO",
    ];
    const DENIED_PREFIXES: [&str; 17] = [
        "PG_CREATE",
        "PG_DROP",
        "PG_COPY_",
        "PG_REPLICATION_SLOT_ADVANCE",
        "PG_LOGICAL_SLOT_",
        "PG_SWITCH_WAL",
        "PG_RELOAD_CONF",
        "SET_CONFIG",
        "NEXTVAL",
        "SETVAL",
        "PG_LOGICAL_EMIT",
        "PG_REPLICATION_ORIGIN",
        "PG_TERMINATE",
        "PG_CANCEL",
        "PG_BACKUP",
        "PG_START_BACKUP",
        "LO_",
    ];
    let words: Vec<&str> = upper
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    let denied = words
        .iter()
        .any(|w| DENIED_WORDS.contains(w) || DENIED_PREFIXES.iter().any(|p| w.starts_with(p)));
    start_ok && !denied
}

/// The grader's logged statements in `log` (lines of its application
/// name). A message of several statements (a probe's SAVEPOINT, query and
/// RELEASE) is one line; none of the grader's own SQL has a `; ` inside.
fn grader_statements(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("] trellara-check "))
        .filter_map(|l| {
            l.find("LOG:  statement: ")
                .map(|i| l[i + "LOG:  statement: ".len()..].trim())
        })
        .flat_map(|message| message.split("; ").map(str::to_owned))
        .collect()
}

/// Runs `assess` and proves from the server log that it sent only
/// read-only statements, as many as it counted.
fn assess_audited(cluster: &Cluster, url: &str, tables: &[&str]) -> Report {
    let before = cluster.log_contents().len();
    let report = assess(url, tables);
    // The server writes its log asynchronously to our read: wait for COMMIT.
    let mut statements = Vec::new();
    for _ in 0..100 {
        let log = cluster.log_contents();
        statements = grader_statements(log.get(before..).unwrap_or(""));
        if statements.len() >= report.facts.statements {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        statements.len(),
        report.facts.statements,
        "every statement the grader sent is in the log (log_statement = all):\n{statements:#?}"
    );
    assert_eq!(
        statements.first().map(String::as_str),
        Some("BEGIN READ ONLY")
    );
    assert_eq!(statements.last().map(String::as_str), Some("COMMIT"));
    for sql in &statements {
        assert!(
            read_only_statement(sql),
            "the grader sent a statement that is not read-only: {sql}"
        );
    }
    assert!(report.facts.server.transaction_read_only);
    report
}

fn finding<'a>(
    report: &'a Report,
    rule: &str,
    subject: &str,
) -> Option<&'a trellara_check::report::Finding> {
    report
        .findings
        .iter()
        .find(|f| f.rule == rule && f.subject.as_deref().is_some_and(|s| s.contains(subject)))
}

fn has_action(report: &Report, needle: &str) -> bool {
    report.actions.iter().any(|a| a.statement.contains(needle))
}

fn live(major: Major) {
    let started = std::time::Instant::now();
    let options = ClusterOptions::new()
        .setting("max_slot_wal_keep_size", "1MB")
        .setting("log_statement", "all");
    let Some(cluster) = test_cluster(major, &options) else {
        return;
    };
    let v17 = major >= Major::Pg17;
    cluster.psql(
        "CREATE TABLE items (id int PRIMARY KEY, qty int);
         CREATE TABLE orders (id int PRIMARY KEY, note text, payload jsonb);
         CREATE TABLE noid (a int, b int);
         CREATE UNLOGGED TABLE scratch (id int PRIMARY KEY);
         CREATE TABLE measurements (id int, at date, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
         CREATE TABLE measurements_2026 PARTITION OF measurements FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
         CREATE PUBLICATION pub_parts FOR TABLE measurements;
         CREATE TABLE filler (t text);
         CREATE ROLE mon LOGIN; GRANT pg_monitor TO mon;
         CREATE ROLE bare LOGIN;",
    );
    // An invalidated slot: created, then left behind by more than
    // max_slot_wal_keep_size of WAL and a checkpoint.
    cluster.psql("SELECT pg_create_logical_replication_slot('lost', 'pgoutput')");
    for _ in 0..4 {
        cluster.psql("INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 20000)");
        cluster.psql("SELECT pg_switch_wal()");
    }
    cluster.psql("CHECKPOINT");
    assert_eq!(
        cluster.psql_value("SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'lost'"),
        "lost"
    );
    // A stalled slot: nobody consumes it.
    cluster.psql("SELECT pg_create_logical_replication_slot('stalled', 'pgoutput')");
    if v17 {
        // A failover slot on a primary without standbys.
        cluster
            .psql("SELECT pg_create_logical_replication_slot('f', 'pgoutput', false, false, true)");
    }
    let superuser = url_as(&cluster, "postgres");

    let before = snapshot(&cluster);
    let report = assess_audited(&cluster, &superuser, &[]);
    let text = trellara_check::render_text(&report);
    eprintln!("{text}");

    // Verdict: every table scanned (none named), so no blocker.
    assert_eq!(report.verdict(), Verdict::Ready, "{text}");
    assert_eq!(report.exit_code(), 0);
    assert!(text.trim_end().ends_with(trellara_check::NOTHING_CREATED));
    assert!(
        text.contains(&format!("grade              {}", report.grade.letter)),
        "{text}"
    );
    assert_eq!(report.facts.settings.wal_level.as_deref(), Some("logical"));
    assert_eq!(report.facts.settings.max_slot_wal_keep_size_mb, Some(1));
    assert_eq!(
        report.facts.settings.has_output_plugin_libraries,
        Some(cluster.has_output_plugin_libraries())
    );
    if cluster.has_output_plugin_libraries() {
        assert!(finding(&report, "C08", "output_plugin_libraries").is_none());
    } else {
        assert!(
            finding(&report, "N01", "output_plugin_libraries").is_some(),
            "{text}"
        );
    }

    // Slots.
    let slot = |name: &str| {
        report
            .facts
            .slots
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("slot {name} reported:\n{text}"))
    };
    let lost = slot("lost");
    assert_eq!(lost.state, SlotState::Invalidated);
    assert_eq!(lost.wal_status.as_deref(), Some("lost"));
    assert_eq!(lost.plugin.as_deref(), Some("pgoutput"));
    if v17 {
        assert_eq!(lost.invalidation_reason.as_deref(), Some("wal_removed"));
    }
    assert!(finding(&report, "W04", "lost").is_some(), "{text}");
    assert!(
        has_action(&report, "SELECT pg_drop_replication_slot('lost');"),
        "{text}"
    );
    let stalled = slot("stalled");
    assert_eq!(stalled.state, SlotState::Stalled);
    assert!(stalled.retained_bytes.is_some());
    assert!(stalled.safe_wal_size.is_some());
    let w01 = finding(&report, "W01", "stalled").expect("stalled slot finding");
    if v17 {
        assert!(stalled.inactive_seconds.is_some(), "inactive_since on 17+");
        assert!(w01.message.contains("inactive for"), "{}", w01.message);
    } else {
        assert!(stalled.inactive_seconds.is_none());
        assert!(
            w01.message.contains("unknown before PostgreSQL 17"),
            "{}",
            w01.message
        );
        assert!(
            text.contains("stalled (duration unknown before PostgreSQL 17)"),
            "{text}"
        );
    }
    if major >= Major::Pg16 {
        assert!(stalled.conflicting.is_some(), "conflicting on 16+");
    }

    // Failover posture.
    if v17 {
        let f = slot("f");
        assert_eq!((f.failover, f.synced), (Some(true), Some(false)));
        assert_eq!(stalled.failover, Some(false));
        assert!(finding(&report, "W09", "stalled").is_some(), "{text}");
        assert!(finding(&report, "W10", "slot f").is_some(), "{text}");
        assert!(
            report
                .failover
                .guidance
                .iter()
                .any(|g| g.contains("failover slot f is not synchronized to any standby")),
            "{:#?}",
            report.failover.guidance
        );
        assert!(
            report
                .failover
                .summary
                .contains("not synchronized to any standby"),
            "{text}"
        );
    } else {
        assert!(
            report
                .failover
                .summary
                .contains("not supported before PostgreSQL 17")
        );
        assert!(report.failover.guidance.iter().any(|g| g.contains("gone")));
        assert!(
            finding(&report, "N03", "").is_some()
                || report.findings.iter().any(|f| f.rule == "N03")
        );
    }
    if major >= Major::Pg18 {
        assert!(
            report
                .facts
                .settings
                .idle_replication_slot_timeout_s
                .is_some(),
            "{text}"
        );
    }

    // WAL: sampled, and headroom bounded by max_slot_wal_keep_size.
    assert!(report.facts.wal.bytes_per_second.is_some(), "{text}");
    assert!(report.facts.wal.pg_wal_bytes.is_some());
    assert!(
        report
            .headroom_line()
            .contains("max_slot_wal_keep_size = 1 MB")
            || report.facts.wal.headroom_hours.is_some(),
        "{}",
        report.headroom_line()
    );
    assert!(report.facts.conflicts.is_some());

    // Tables.
    let table = |name: &str| {
        report
            .facts
            .tables
            .tables
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("table {name} reported:\n{text}"))
    };
    assert_eq!(table("public.items").identity, Identity::PrimaryKey);
    assert!(table("public.items").toastable_non_key_columns.is_empty());
    assert_eq!(
        table("public.orders").toastable_non_key_columns,
        ["note", "payload"]
    );
    assert!(finding(&report, "W12", "public.orders").is_some(), "{text}");
    assert_eq!(table("public.noid").identity, Identity::None);
    assert!(finding(&report, "W11", "public.noid").is_some(), "{text}");
    assert!(table("public.scratch").unlogged);
    assert!(finding(&report, "W14", "public.scratch").is_some());
    let parts = table("public.measurements");
    assert_eq!(parts.kind, "partitioned table");
    assert_eq!(
        parts.publications,
        [trellara_check::report::TablePublication {
            name: "pub_parts".into(),
            via_partition_root: false
        }]
    );
    assert!(
        finding(&report, "W13", "public.measurements").is_some(),
        "{text}"
    );
    assert!(has_action(
        &report,
        "ALTER PUBLICATION pub_parts SET (publish_via_partition_root = true);"
    ));
    assert!(
        !report
            .facts
            .tables
            .tables
            .iter()
            .any(|t| t.name == "public.measurements_2026"),
        "leaf partitions are reported through their root"
    );
    assert!(
        report.readiness_line().contains("1 note (TOAST)"),
        "{}",
        report.readiness_line()
    );
    assert!(
        report
            .slots_line()
            .contains(if v17 { "2 stalled" } else { "1 stalled" }),
        "{}",
        report.slots_line()
    );

    // Grade arithmetic: 100 minus the capped deductions.
    let deducted: u32 = report.grade.deductions.iter().map(|d| d.points).sum();
    assert_eq!(report.grade.score, 100 - deducted.min(100));
    assert_eq!(
        report.grade.letter,
        trellara_check::grade::letter(report.grade.score)
    );

    // Named tables: one without identity blocks.
    let blocked = assess_audited(
        &cluster,
        &superuser,
        &["public.items", "public.noid", "public.nope", "scratch"],
    );
    assert_eq!(blocked.verdict(), Verdict::Blocked);
    assert_eq!(blocked.exit_code(), 3);
    assert_eq!(blocked.grade.letter, 'F');
    assert!(finding(&blocked, "C06", "public.noid").is_some());
    assert!(finding(&blocked, "C05", "public.nope").is_some());
    assert!(finding(&blocked, "C07", "public.scratch").is_some());
    assert!(has_action(
        &blocked,
        "ALTER TABLE public.noid REPLICA IDENTITY FULL;"
    ));
    assert!(
        trellara_check::config_draft::draft(&blocked, &["public.noid".into()])
            .expect_err("blocked: no draft")
            .to_string()
            .contains("C06 table_without_identity")
    );
    let ready = assess_audited(&cluster, &superuser, &["public.items", "public.orders"]);
    assert_eq!(
        ready.verdict(),
        Verdict::Ready,
        "{}",
        trellara_check::render_text(&ready)
    );
    // The draft is a config `trellara check --config` passes.
    let draft = trellara_check::config_draft::draft(
        &ready,
        &["public.items".into(), "public.orders".into()],
    )
    .expect("a draft for a ready source");
    let parsed = trellara_relay::config::parse(&draft).expect("the draft parses");
    let issues = trellara_relay::config::validate(&parsed);
    assert!(issues.is_empty(), "{draft}\n{issues:?}");
    assert!(matches!(
        trellara_check::config_draft::draft(&ready, &[]),
        Err(trellara_check::config_draft::DraftError::NoTables)
    ));

    // A pg_monitor-only role: sees slots and WAL, but has no replication
    // privilege (blocked, with the statement that grants it).
    let monitor = assess_audited(&cluster, &url_as(&cluster, "mon"), &[]);
    let monitor_text = trellara_check::render_text(&monitor);
    assert!(monitor.facts.role.monitor && !monitor.facts.role.superuser);
    assert_eq!(monitor.verdict(), Verdict::Blocked, "{monitor_text}");
    assert!(
        finding(&monitor, "C02", "role mon").is_some(),
        "{monitor_text}"
    );
    assert!(
        has_action(&monitor, "ALTER ROLE mon WITH REPLICATION;"),
        "{monitor_text}"
    );
    assert!(
        monitor.facts.wal.pg_wal_bytes.is_some(),
        "pg_monitor may call pg_ls_waldir()"
    );
    assert_eq!(monitor.facts.slots.len(), report.facts.slots.len());
    assert!(
        monitor.findings.iter().any(|f| f.rule == "W15"),
        "mon cannot SELECT the tables: {monitor_text}"
    );

    // A role without pg_monitor: what it cannot see is unknown, with the grant.
    let bare = assess_audited(&cluster, &url_as(&cluster, "bare"), &[]);
    let bare_text = trellara_check::render_text(&bare);
    assert!(bare.facts.wal.pg_wal_bytes.is_none());
    let unknown = finding(&bare, "U01", "pg_wal size").expect("pg_wal size unknown");
    assert_eq!(unknown.severity, Severity::Unknown);
    assert!(unknown.points > 0, "unknown is not fine");
    assert!(
        has_action(&bare, "GRANT pg_monitor TO bare;"),
        "{bare_text}"
    );
    assert!(
        bare_text.contains("pg_wal size                unknown"),
        "{bare_text}"
    );

    let after = snapshot(&cluster);
    assert_eq!(before, after, "the grader changed catalog state");

    // A provider that revokes pg_replication_slots: the slots are unknown,
    // with the grant, never "none".
    cluster.psql("REVOKE SELECT ON pg_catalog.pg_replication_slots FROM PUBLIC");
    let hidden = assess_audited(&cluster, &url_as(&cluster, "bare"), &[]);
    let hidden_text = trellara_check::render_text(&hidden);
    assert!(!hidden.facts.slots_visible);
    assert_eq!(hidden.facts.usage.replication_slots, None);
    assert!(hidden.slots_line().starts_with("unknown"), "{hidden_text}");
    assert!(
        has_action(
            &hidden,
            "GRANT SELECT ON pg_catalog.pg_replication_slots TO bare;"
        ),
        "{hidden_text}"
    );
    assert!(
        hidden_text.contains("replication slots          unknown used of 16"),
        "{hidden_text}"
    );
    eprintln!("{major}: check_live passed in {:.1?}", started.elapsed());
}

/// wal_level = replica: blocked, exit 3, the action names the setting.
#[test]
fn check_wal_level_replica() {
    let options = ClusterOptions::new().setting("wal_level", "replica");
    let Some(cluster) = test_cluster(Major::Pg16, &options) else {
        return;
    };
    let report = assess(&url_as(&cluster, "postgres"), &[]);
    let text = trellara_check::render_text(&report);
    assert_eq!(report.verdict(), Verdict::Blocked, "{text}");
    assert_eq!(report.exit_code(), 3);
    assert_eq!(report.grade.letter, 'F');
    let c01 = finding(&report, "C01", "wal_level").expect("C01");
    assert!(c01.message.contains("wal_level is replica"));
    assert_eq!(
        report.actions.first().map(|a| a.statement.as_str()),
        Some("ALTER SYSTEM SET wal_level = logical; -- then restart PostgreSQL"),
        "{text}"
    );
    assert!(
        text.contains("1. ALTER SYSTEM SET wal_level = logical;"),
        "{text}"
    );
}

/// A standby started from `primary` with pg_basebackup, stopped on drop.
struct Standby {
    dir: tempfile::TempDir,
    pg_ctl: std::path::PathBuf,
    port: u16,
}

fn as_owner(program: &std::path::Path) -> std::process::Command {
    if nix::unistd::geteuid().is_root() {
        let mut cmd = std::process::Command::new("runuser");
        cmd.args(["-u", trellara_tests::OS_USER, "--"]).arg(program);
        cmd
    } else {
        std::process::Command::new(program)
    }
}

fn run_ok(mut cmd: std::process::Command) {
    let out = cmd.output().expect("command runs");
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Standby {
    /// A streaming standby through physical slot `standby1`, with slot
    /// synchronization on (17+).
    fn start(primary: &Cluster) -> Standby {
        let dir = tempfile::Builder::new()
            .prefix("trellara-standby-")
            .tempdir()
            .expect("temp dir");
        if nix::unistd::geteuid().is_root() {
            let user = nix::unistd::User::from_name(trellara_tests::OS_USER)
                .expect("lookup")
                .expect("OS user");
            nix::unistd::chown(dir.path(), Some(user.uid), Some(user.gid)).expect("chown");
        }
        let data = dir.path().join("data");
        let mut backup = as_owner(&primary.install().bin("pg_basebackup"));
        backup
            .args(["-h", primary.host(), "-p", &primary.port().to_string()])
            .args([
                "-U", "postgres", "-R", "-C", "-S", "standby1", "-X", "stream", "-D",
            ])
            .arg(&data)
            .current_dir(dir.path());
        run_ok(backup);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        // postgresql.auto.conf is read last: it overrides the primary's
        // port and socket directory copied with the data directory.
        let auto = data.join("postgresql.auto.conf");
        let mut conf = std::fs::read_to_string(&auto).expect("auto conf");
        conf = conf.replace(
            "primary_conninfo = '",
            "primary_conninfo = 'dbname=postgres ",
        );
        conf.push_str(&format!(
            "\nport = {port}\nunix_socket_directories = '{}'\nhot_standby_feedback = on\n\
             sync_replication_slots = on\nprimary_slot_name = 'standby1'\nlog_statement = 'all'\n",
            dir.path().display()
        ));
        std::fs::write(&auto, conf).expect("write auto conf");
        let pg_ctl = primary.install().bin("pg_ctl");
        let mut start = as_owner(&pg_ctl);
        start
            .arg("start")
            .arg("-w")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.path().join("standby.log"))
            .current_dir(dir.path());
        run_ok(start);
        Standby { dir, pg_ctl, port }
    }

    fn url(&self) -> String {
        format!("postgresql://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn value(&self, sql: &str) -> Option<String> {
        let mut client = trellara_tests::postgres::Client::connect(
            &format!(
                "host=127.0.0.1 port={} user=postgres dbname=postgres",
                self.port
            ),
            trellara_tests::postgres::NoTls,
        )
        .ok()?;
        let rows = client.simple_query(sql).ok()?;
        rows.iter().find_map(|m| match m {
            trellara_tests::postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        let mut stop = as_owner(&self.pg_ctl);
        stop.args(["stop", "-m", "immediate", "-w", "-D"])
            .arg(self.dir.path().join("data"))
            .current_dir(self.dir.path());
        let _ = stop.output();
    }
}

#[test]
fn check_standby_pg17() {
    standby(Major::Pg17);
}

#[test]
fn check_standby_pg18() {
    standby(Major::Pg18);
}

/// A primary with a failover slot synchronized to a standby: the primary's
/// report confirms the setup, the standby's reports itself as a standby with
/// the synced slot, its WAL rate from the receive position, and conflicts.
fn standby(major: Major) {
    let mut options = ClusterOptions::new();
    if major >= Major::Pg18 {
        // Idle slots bounded in time: retention is not unbounded (no W06).
        options = options.setting("idle_replication_slot_timeout", "1h");
    }
    let Some(primary) = test_cluster(major, &options) else {
        return;
    };
    primary.psql("CREATE TABLE t (id int PRIMARY KEY, v int)");
    primary
        .psql("SELECT pg_create_logical_replication_slot('cap', 'pgoutput', false, false, true)");
    let standby = Standby::start(&primary);
    primary.psql("ALTER SYSTEM SET synchronized_standby_slots = 'standby1'");
    primary.psql("SELECT pg_reload_conf()");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while standby
        .value("SELECT synced FROM pg_replication_slots WHERE slot_name = 'cap'")
        .as_deref()
        != Some("t")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "slot cap never synced"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let report = assess(&url_as(&primary, "postgres"), &["public.t"]);
    let text = trellara_check::render_text(&report);
    assert!(!report.facts.server.standby);
    assert_eq!(
        report.failover.summary, "supported · 1 enabled · synchronized_standby_slots = standby1",
        "{text}"
    );
    assert!(report.findings.iter().all(|f| f.rule != "W10"), "{text}");
    assert!(
        report
            .failover
            .guidance
            .iter()
            .any(|g| g.contains("standbys stream through standby1")),
        "{text}"
    );
    assert_eq!(report.facts.usage.wal_senders, Some(1), "{text}");
    let physical = report
        .facts
        .slots
        .iter()
        .find(|x| x.name == "standby1")
        .expect("physical slot");
    assert_eq!(physical.state, SlotState::Active, "{text}");
    assert!(report.slots_line().starts_with("1 active"), "{text}");
    if major >= Major::Pg18 {
        assert_eq!(
            report.facts.settings.idle_replication_slot_timeout_s,
            Some(3600)
        );
        assert!(report.findings.iter().all(|f| f.rule != "W06"), "{text}");
        assert!(
            text.contains("idle_replication_slot_timeout 1h00m"),
            "{text}"
        );
    } else {
        assert!(report.findings.iter().any(|f| f.rule == "W06"), "{text}");
        assert!(
            report
                .headroom_line()
                .starts_with("bounded only by disk, which the grader cannot see"),
            "{text}"
        );
    }

    let on_standby = assess(&standby.url(), &["public.t"]);
    let text = trellara_check::render_text(&on_standby);
    eprintln!("{text}");
    assert!(on_standby.facts.server.standby, "{text}");
    assert!(text.contains("(standby)"));
    assert_eq!(on_standby.verdict(), Verdict::Ready, "{text}");
    assert_eq!(
        on_standby.failover.summary, "supported · standby · sync_replication_slots = on · 1 synced",
        "{text}"
    );
    assert_eq!(on_standby.failover.synced, ["cap"]);
    assert!(text.contains("synced from the primary"), "{text}");
    assert!(
        on_standby.facts.conflicts.is_some(),
        "conflicts are read on standbys"
    );
    assert!(
        on_standby.facts.wal.bytes_per_second.is_some(),
        "rate from pg_last_wal_receive_lsn(): {text}"
    );
    assert!(
        on_standby.findings.iter().all(|f| f.rule != "W17"),
        "hot_standby_feedback is on"
    );
}
