//! Source and target safety on every major (issue 18): each write command
//! refuses a flow that preflight's checks block, with exit 3 and the fix,
//! before it creates or changes anything on either side.
//!
//! - a target that is the source database itself, reached by other URL
//!   text (a Unix socket instead of TCP) as a role that is not a superuser;
//! - a table without a key or replica identity, whose UPDATE and DELETE on
//!   the source would fail once it was published;
//! - a log directory of another flow and source.
//!
//! What trellara writes (config, log, cursors, lock) is owner-only
//! whatever the umask.
//!
//! "Nothing changed" is a footprint of each database taken before and
//! after: slots, publications and their tables, the trellara schema, and
//! the contents of every user table.

use std::path::Path;
use std::process::{Command, Output};
use trellara_tests::{Cluster, ClusterOptions, Major, test_cluster};

const TABLES: &str = "
CREATE TABLE public.orders (id bigint PRIMARY KEY, note text);
CREATE TABLE public.nokey (a int, b text);
INSERT INTO public.orders SELECT g, 'o' || g FROM generate_series(1, 20) g;
INSERT INTO public.nokey SELECT g, 'n' || g FROM generate_series(1, 5) g;
";

fn trellara(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("run trellara")
}

/// Stdout and stderr of a command that must exit with `code`.
fn exits(out: &Output, code: i32, what: &str) -> String {
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(code), "{what}:\n{text}");
    text
}

/// Everything a flow could create or change in database `db`.
fn footprint(cluster: &Cluster, db: &str) -> String {
    let mut client = cluster.try_connect(db).expect("connect");
    let row = client
        .query_one(
            "SELECT coalesce((SELECT string_agg(slot_name || '@' || coalesce(database, ''), ',' ORDER BY slot_name) FROM pg_replication_slots), ''),
                    coalesce((SELECT string_agg(pubname || ':' || tablename, ',' ORDER BY pubname, tablename) FROM pg_publication_tables), ''),
                    coalesce((SELECT string_agg(pubname, ',' ORDER BY pubname) FROM pg_publication), ''),
                    (SELECT count(*) FROM pg_namespace WHERE nspname = 'trellara'),
                    coalesce((SELECT md5(string_agg(o::text, ',' ORDER BY id)) FROM public.orders o), ''),
                    coalesce((SELECT md5(string_agg(n::text, ',' ORDER BY a)) FROM public.nokey n), '')",
            &[],
        )
        .expect("footprint");
    format!(
        "slots [{}] published [{}] publications [{}] trellara schemas {} orders {} nokey {}",
        row.get::<_, String>(0),
        row.get::<_, String>(1),
        row.get::<_, String>(2),
        row.get::<_, i64>(3),
        row.get::<_, String>(4),
        row.get::<_, String>(5)
    )
}

/// Tests run side by side: each follower serves its endpoints on a free port.
const SERVICE: &str = "service:\n  relay_listen: 127.0.0.1:0\n";

fn config(flow: &str, source: &str, target: &str, tables: &[&str], log_dir: &str) -> String {
    format!(
        "schema_version: 2\nenvironment: evaluation\n{SERVICE}flows:\n  - name: {flow}\n    source:\n      url: {source}\n    target:\n      url: {target}\n    tables: [{}]\n    transport:\n      kind: local\n      log_dir: {log_dir}\n",
        tables.join(", ")
    )
}

/// Runs `scenario` on each supported major, naming it on stderr.
fn on_every_major(scenario: impl Fn(Major)) {
    for major in Major::ALL {
        eprintln!("on {major}");
        scenario(major);
    }
}

/// Writes `file` in `d`: flow `flow` with its own log, `./.trellara/<flow>/log`.
fn write_flow(d: &Path, file: &str, flow: &str, source: &str, target: &str, tables: &[&str]) {
    write_flow_logged(
        d,
        file,
        flow,
        source,
        target,
        tables,
        &format!("./.trellara/{flow}/log"),
    );
}

/// [`write_flow`] with the log in `log_dir`.
fn write_flow_logged(
    d: &Path,
    file: &str,
    flow: &str,
    source: &str,
    target: &str,
    tables: &[&str],
    log_dir: &str,
) {
    std::fs::write(d.join(file), config(flow, source, target, tables, log_dir))
        .expect("write config");
}

/// Waits for `child` to exit; past `seconds` kills it and fails with
/// `hang` (a hang is a failure, not a stuck test).
fn ends_within(child: &mut std::process::Child, seconds: u64, hang: &str) {
    let started = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > std::time::Duration::from_secs(seconds) {
            let _ = child.kill();
            panic!("{hang}");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Creates each database of `names` on `c` and runs `sql` in it.
fn databases(c: &Cluster, names: &[&str], sql: &str) {
    for db in names {
        c.psql(&format!("CREATE DATABASE {db}"));
        c.try_connect(db)
            .expect("connect")
            .batch_execute(sql)
            .expect("schema");
    }
}

#[test]
fn hostile_flows_are_refused_before_anything_changes_pg15() {
    hostile_flows(Major::Pg15);
}

#[test]
fn hostile_flows_are_refused_before_anything_changes_pg16() {
    hostile_flows(Major::Pg16);
}

#[test]
fn hostile_flows_are_refused_before_anything_changes_pg17() {
    hostile_flows(Major::Pg17);
}

#[test]
fn hostile_flows_are_refused_before_anything_changes_pg18() {
    hostile_flows(Major::Pg18);
}

/// Every directory under `root` is 0700 and every file 0600.
fn owner_only(root: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut seen = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir") {
            let path = entry.expect("entry").path();
            let meta = std::fs::symlink_metadata(&path).expect("stat");
            let mode = meta.permissions().mode() & 0o777;
            if meta.is_dir() {
                assert_eq!(mode, 0o700, "{}", path.display());
                stack.push(path);
            } else if meta.is_file() {
                assert_eq!(mode, 0o600, "{}", path.display());
            }
            seen += 1;
        }
    }
    assert!(seen > 3, "files under {}", root.display());
}

fn hostile_flows(major: Major) {
    let Some(c) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    // Whatever the umask, what trellara writes is its owner's alone.
    nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    databases(&c, &["src", "tgt", "src2", "tgt2"], TABLES);
    // A target role that is no superuser and may only use its own tables.
    c.psql("CREATE ROLE app LOGIN");
    for db in ["src", "tgt"] {
        let mut client = c.try_connect(db).expect("connect");
        client
            .batch_execute(&format!(
                "GRANT ALL ON ALL TABLES IN SCHEMA public TO app; GRANT CREATE ON DATABASE {db} TO app"
            ))
            .expect("grant");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let tcp = |db: &str| c.connection_string(db);
    let socket = |user: &str, db: &str| {
        format!(
            "postgresql://{user}@/{db}?host={}&port={}",
            c.socket_dir().display(),
            c.port()
        )
    };
    let before: Vec<String> = ["src", "tgt", "src2", "tgt2"]
        .iter()
        .map(|db| footprint(&c, db))
        .collect();
    let unchanged = |what: &str| {
        for (db, was) in ["src", "tgt", "src2", "tgt2"].iter().zip(&before) {
            assert_eq!(&footprint(&c, db), was, "{what} changed database {db}");
        }
    };

    // The source database itself as the target, over its socket, as app.
    write_flow(
        d,
        "same.yml",
        "same",
        &tcp("src"),
        &socket("app", "src"),
        &["public.orders"],
    );
    for args in [
        &["preflight", "--config", "same.yml"][..],
        &["run", "--config", "same.yml", "--local"],
        &["reseed", "--config", "same.yml"],
        &["verify", "--config", "same.yml"],
    ] {
        let text = exits(&trellara(d, args), 3, &args.join(" "));
        assert!(text.contains("is the source database itself"), "{text}");
        assert!(text.contains("another database"), "names the fix: {text}");
        unchanged(args[0]);
    }
    assert!(!d.join(".trellara/same/log").exists(), "no log was made");

    // A table whose UPDATE and DELETE would fail on the source once published.
    write_flow(
        d,
        "nokey.yml",
        "nokey",
        &tcp("src"),
        &tcp("tgt"),
        &["public.orders", "public.nokey"],
    );
    for args in [
        &["run", "--config", "nokey.yml", "--local"][..],
        &["reseed", "--config", "nokey.yml"],
    ] {
        let text = exits(&trellara(d, args), 3, &args.join(" "));
        assert!(
            text.contains("C06")
                && text.contains("public.nokey")
                && text.contains("REPLICA IDENTITY"),
            "{text}"
        );
        unchanged(args[0]);
    }
    // With a second flow that fails otherwise, the exit says the worst: 1.
    let two = format!(
        "{}  - name: down\n    source:\n      url: {}\n    target:\n      url: postgresql://u@127.0.0.1:1/x?connect_timeout=1\n    tables: [public.orders]\n    transport:\n      kind: local\n      log_dir: ./.trellara/down/log\n",
        config(
            "nokey",
            &tcp("src"),
            &tcp("tgt"),
            &["public.orders", "public.nokey"],
            "./.trellara/nokey/log"
        ),
        tcp("src2")
    );
    std::fs::write(d.join("mixed.yml"), two).expect("write config");
    let text = exits(
        &trellara(d, &["run", "--config", "mixed.yml", "--local"]),
        1,
        "a refused flow and a failed one",
    );
    assert!(
        text.contains("C06") && text.contains("connect to the target database"),
        "{text}"
    );
    unchanged("a refused flow and a failed one");
    let mut app = c.try_connect("src").expect("connect");
    app.batch_execute(
        "UPDATE public.nokey SET b = b || '!' WHERE a = 1; DELETE FROM public.nokey WHERE a = 2",
    )
    .expect("the source's own UPDATE and DELETE still work");
    app.batch_execute(
        "UPDATE public.nokey SET b = 'n1' WHERE a = 1; INSERT INTO public.nokey VALUES (2, 'n2')",
    )
    .expect("put back");

    // A flow on another database of this cluster is fine (the nonce
    // session is seen, but in another database), and owns its log.
    write_flow_logged(
        d,
        "one.yml",
        "one",
        &tcp("src"),
        &socket("app", "tgt"),
        &["public.orders"],
        "./.trellara/shared/log",
    );
    let text = exits(
        &trellara(d, &["run", "--config", "one.yml", "--local", "--verify"]),
        0,
        "a flow into another database",
    );
    assert!(text.contains("one CONVERGED"), "{text}");
    let owner = std::fs::read_to_string(d.join(".trellara/shared/log/meta/owner")).expect("owner");
    assert!(owner.contains("\"flow\": \"one\""), "{owner}");
    owner_only(&d.join(".trellara"));

    // Another flow, from another source database, pointed at that log.
    let src2_before = footprint(&c, "src2");
    let tgt2_before = footprint(&c, "tgt2");
    write_flow_logged(
        d,
        "two.yml",
        "two",
        &tcp("src2"),
        &tcp("tgt2"),
        &["public.orders"],
        "./.trellara/shared/log",
    );
    for args in [
        &["run", "--config", "two.yml", "--local"][..],
        &["preflight", "--config", "two.yml"],
    ] {
        let text = exits(&trellara(d, args), 3, &args.join(" "));
        assert!(text.contains("belongs to flow one"), "{text}");
        assert_eq!(footprint(&c, "src2"), src2_before);
        assert_eq!(footprint(&c, "tgt2"), tgt2_before);
    }
    // Nor does its teardown remove the other flow's log.
    let text = exits(
        &trellara(d, &["teardown", "--config", "two.yml", "--yes"]),
        0,
        "teardown of the other flow",
    );
    assert!(
        text.contains("kept: log directory") && text.contains("belongs to flow one"),
        "{text}"
    );
    assert!(d.join(".trellara/shared/log").exists());
    // The first flow's log is whole and still its own.
    c.try_connect("src")
        .expect("connect")
        .batch_execute("INSERT INTO public.orders VALUES (21, 'o21')")
        .expect("write");
    let text = exits(
        &trellara(d, &["run", "--config", "one.yml", "--local", "--verify"]),
        0,
        "the first flow again",
    );
    assert!(text.contains("one CONVERGED"), "{text}");

    // A reseed whose copy fails after the checks passed (a target CHECK the
    // source's rows break) leaves the target's table as it was.
    let mut tgt = c.try_connect("tgt").expect("connect");
    tgt.batch_execute("ALTER TABLE public.orders ADD CONSTRAINT small CHECK (id <= 21)")
        .expect("constraint");
    c.try_connect("src")
        .expect("connect")
        .batch_execute("INSERT INTO public.orders VALUES (22, 'o22')")
        .expect("write");
    // The target's tables (the slot the failed reseed made is gone again).
    let tables = |db: &str| {
        let f = footprint(&c, db);
        f[f.find(" orders ").expect("orders")..].to_owned()
    };
    let kept = tables("tgt");
    let text = exits(
        &trellara(d, &["reseed", "--config", "one.yml"]),
        1,
        "a reseed whose copy fails",
    );
    assert!(text.contains("small"), "names the constraint: {text}");
    assert_eq!(tables("tgt"), kept, "the target table is as it was");
    tgt.batch_execute("ALTER TABLE public.orders DROP CONSTRAINT small")
        .expect("drop constraint");
    let text = exits(
        &trellara(d, &["reseed", "--config", "one.yml", "--verify"]),
        0,
        "the reseed again",
    );
    assert!(text.contains("one CONVERGED"), "{text}");
}

/// `init` gives each config's flow its own log directory, so two configs
/// written in one directory never share one.
#[test]
fn init_gives_each_config_its_own_log() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    nix::sys::stat::umask(nix::sys::stat::Mode::empty());
    let mut dirs = Vec::new();
    for name in ["a.yml", "b.yml"] {
        let out = trellara(
            dir.path(),
            &[
                "init",
                "--source-database-url",
                "postgresql://u@127.0.0.1:1/s",
                "--target-database-url",
                "postgresql://u@127.0.0.1:1/t",
                "--table",
                "public.orders",
                "--evaluate",
                "--output",
                name,
            ],
        );
        exits(&out, 0, "init");
        let mode = std::fs::metadata(dir.path().join(name))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the config may hold passwords");
        let text = std::fs::read_to_string(dir.path().join(name)).expect("read");
        let line = text
            .lines()
            .find(|l| l.contains("log_dir"))
            .expect("a log_dir")
            .to_owned();
        dirs.push(line);
    }
    assert_ne!(dirs[0], dirs[1]);
}

#[test]
fn a_stopping_run_applies_asynchronous_commits_and_lag_is_behind_not_diverged() {
    on_every_major(asynchronous_commits);
}

/// Transactions committed with `synchronous_commit = off` (the walwriter
/// slowed to 10 s, so they sit unflushed) are applied by the `run` that
/// starts right after them; a target behind such commits is
/// WATERMARK_BEHIND, never DIVERGED.
fn asynchronous_commits(major: Major) {
    let options = ClusterOptions::new().setting("wal_writer_delay", "10s");
    let Some(source) = test_cluster(major, &options) else {
        return;
    };
    let Some(target) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    source.psql(TABLES);
    target.psql(TABLES);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(
        d,
        "trellara.yml",
        "lazy",
        &source.connection_string("postgres"),
        &target.connection_string("postgres"),
        &["public.orders"],
    );
    exits(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        0,
        "first run",
    );
    let lazy = |from: i64| {
        let mut client = source.connect();
        for id in from..from + 5 {
            client
                .batch_execute(&format!(
                    "BEGIN; SET LOCAL synchronous_commit = off; INSERT INTO public.orders VALUES ({id}, 'lazy'); COMMIT"
                ))
                .expect("asynchronous commit");
        }
    };
    lazy(100);
    let text = exits(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        0,
        "a run right after asynchronous commits",
    );
    assert!(text.contains("lazy CONVERGED"), "{text}");
    assert_eq!(
        target.psql_value("SELECT count(*) FROM public.orders WHERE note = 'lazy'"),
        "5"
    );
    lazy(200);
    let text = exits(
        &trellara(d, &["verify", "--config", "trellara.yml"]),
        1,
        "verify behind asynchronous commits",
    );
    assert!(
        text.contains("lazy WATERMARK_BEHIND") && !text.contains("DIVERGED"),
        "{text}"
    );
    assert!(
        text.contains("trellara run --config"),
        "names the catch-up: {text}"
    );
}

#[test]
fn teardown_removes_what_a_flow_left_and_a_failed_first_run_leaves_nothing() {
    on_every_major(teardown);
}

fn teardown(major: Major) {
    let Some(c) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    databases(&c, &["src", "tgt"], TABLES);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(
        d,
        "trellara.yml",
        "t",
        &c.connection_string("src"),
        &c.connection_string("tgt"),
        &["public.orders"],
    );
    let slots = || c.psql_value("SELECT count(*) FROM pg_replication_slots");
    let publications = || {
        c.try_connect("src")
            .expect("connect")
            .query_one("SELECT count(*) FROM pg_publication", &[])
            .expect("count")
            .get::<_, i64>(0)
    };
    let target_rows = || {
        c.try_connect("tgt")
            .expect("connect")
            .query_one("SELECT count(*) FROM public.orders", &[])
            .expect("count")
            .get::<_, i64>(0)
    };

    // A first run that fails in its copy removes the slot and publication
    // it created.
    let mut tgt = c.try_connect("tgt").expect("connect");
    tgt.batch_execute(
        "TRUNCATE public.orders; ALTER TABLE public.orders ADD CONSTRAINT small CHECK (id <= 3)",
    )
    .expect("constraint");
    let text = exits(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        1,
        "a first run whose copy fails",
    );
    assert!(text.contains("dropped slot trellara_t"), "{text}");
    assert_eq!(slots(), "0", "no slot left holding WAL");
    assert_eq!(publications(), 0, "no publication left");
    tgt.batch_execute("ALTER TABLE public.orders DROP CONSTRAINT small")
        .expect("drop constraint");

    let text = exits(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        0,
        "run",
    );
    assert!(text.contains("t CONVERGED"), "{text}");
    let before = (footprint(&c, "src"), footprint(&c, "tgt"));

    // Without --yes: the plan, and nothing removed.
    let text = exits(
        &trellara(d, &["teardown", "--config", "trellara.yml"]),
        1,
        "teardown without --yes",
    );
    for item in [
        "replication slot trellara_t",
        "publication trellara_t",
        "state rows of flow t",
        "log directory",
        "kept: the target tables public.orders",
        "--yes",
    ] {
        assert!(text.contains(item), "{item}: {text}");
    }
    assert_eq!((footprint(&c, "src"), footprint(&c, "tgt")), before);

    // Never while the flow runs.
    let mut follow = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["run", "--config", "trellara.yml", "--local", "--follow"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("follow");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while c.psql_value("SELECT count(*) FROM pg_replication_slots WHERE active") != "1" {
        assert!(
            std::time::Instant::now() < deadline,
            "follow never streamed"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let text = exits(
        &trellara(d, &["teardown", "--config", "trellara.yml", "--yes"]),
        1,
        "teardown while running",
    );
    assert!(text.contains("is running"), "{text}");
    assert_eq!(slots(), "1");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(follow.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    assert!(follow.wait().expect("wait").success());

    let text = exits(
        &trellara(d, &["teardown", "--config", "trellara.yml", "--yes"]),
        0,
        "teardown",
    );
    assert!(
        text.contains("removed:") && text.contains("replication slot trellara_t"),
        "{text}"
    );
    assert_eq!(slots(), "0");
    assert_eq!(publications(), 0);
    assert!(!d.join(".trellara/t/log").exists());
    let state: i64 = c
        .try_connect("tgt")
        .expect("connect")
        .query_one("SELECT count(*) FROM trellara.checkpoints", &[])
        .expect("state")
        .get(0);
    assert_eq!(state, 0, "the flow's state rows are gone");
    assert_eq!(target_rows(), 20, "the target's rows are kept");

    // A publication the operator made is theirs: kept.
    c.try_connect("src")
        .expect("connect")
        .batch_execute("CREATE PUBLICATION trellara_t FOR TABLE public.orders")
        .expect("publication");
    exits(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        0,
        "run on the operator's publication",
    );
    let text = exits(
        &trellara(d, &["teardown", "--config", "trellara.yml", "--yes"]),
        0,
        "teardown",
    );
    assert!(text.contains("trellara did not create it"), "{text}");
    assert_eq!(publications(), 1);
    assert_eq!(slots(), "0");
}

#[test]
fn status_and_repair_plan_name_every_stop_with_its_command() {
    on_every_major(stops_are_visible);
}

/// A held schema change that stopped capture, and a slot dropped behind the
/// flow's back, are named by status and repair plan with commands that
/// carry the flow; a flow that never ran reads as such, without nulls.
fn stops_are_visible(major: Major) {
    let Some(c) = test_cluster(
        major,
        &ClusterOptions::new().setting("max_prepared_transactions", "2"),
    ) else {
        return;
    };
    databases(&c, &["src", "tgt"], TABLES);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(
        d,
        "trellara.yml",
        "s",
        &c.connection_string("src"),
        &c.connection_string("tgt"),
        &["public.orders"],
    );
    let status = |format: &str| {
        let out = trellara(
            d,
            &[
                "status",
                "--config",
                "trellara.yml",
                "--flow",
                "s",
                "--format",
                format,
            ],
        );
        exits(&out, 0, "status")
    };
    let json = status("json");
    assert!(
        json.contains("\"never_ran\": true") && !json.contains("null"),
        "{json}"
    );
    exits(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        0,
        "run",
    );

    // The replica identity changes the relation's fingerprint, not its
    // columns: capture meets the change (a key change, held) on the next
    // row.
    c.try_connect("src")
        .expect("connect")
        .batch_execute("ALTER TABLE public.orders REPLICA IDENTITY FULL; UPDATE public.orders SET note = 'x' WHERE id = 1")
        .expect("drift");
    let text = exits(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        1,
        "a run meeting schema drift",
    );
    assert!(
        text.contains("schema change on public.orders held"),
        "{text}"
    );
    // Logged, and held at the sink: a quarantine naming the change and
    // its fixes.
    let text = status("text");
    assert!(
        text.contains("quarantine  1 open")
            && text.contains("schema change on public.orders held")
            && text.contains("key_change on public.orders: block"),
        "{text}"
    );
    assert!(
        text.contains(
            "trellara schema accept --config trellara.yml --flow s --table public.orders"
        ) && text.contains("trellara reseed --config trellara.yml --flow s"),
        "{text}"
    );
    let plan = exits(
        &trellara(d, &["repair", "plan", "--config", "trellara.yml"]),
        0,
        "repair plan",
    );
    assert!(
        plan.contains("schema change on public.orders held"),
        "{plan}"
    );
    assert!(!plan.contains("nothing is blocked"), "{plan}");
    for line in plan
        .lines()
        .filter(|l| l.trim_start().starts_with("trellara "))
    {
        assert!(
            line.contains("--flow s"),
            "every command names the flow: {line}"
        );
    }

    // The slot dropped behind the flow's back.
    c.try_connect("src")
        .expect("connect")
        .batch_execute("SELECT pg_drop_replication_slot('trellara_s')")
        .expect("drop the slot");
    let text = status("text");
    assert!(text.contains("trellara_s missing"), "{text}");
    let plan = exits(
        &trellara(d, &["repair", "plan", "--config", "trellara.yml"]),
        0,
        "repair plan",
    );
    assert!(
        plan.contains("slot trellara_s on the source, which is missing"),
        "{plan}"
    );

    // The reseed the plan names: converged, and the stop is gone.
    let text = exits(
        &trellara(
            d,
            &[
                "reseed",
                "--config",
                "trellara.yml",
                "--flow",
                "s",
                "--verify",
            ],
        ),
        0,
        "reseed",
    );
    assert!(text.contains("s CONVERGED"), "{text}");
    let text = status("text");
    assert!(
        !text.contains("STOPPED") && text.contains("trellara_s idle"),
        "{text}"
    );
    let plan = exits(
        &trellara(d, &["repair", "plan", "--config", "trellara.yml"]),
        0,
        "repair plan",
    );
    assert!(plan.contains("nothing is blocked"), "{plan}");

    // An open prepared transaction (slot creation would wait on it) is
    // named by preflight with its gid and the statement that ends it.
    let mut src = c.try_connect("src").expect("connect");
    src.batch_execute(
        "BEGIN; INSERT INTO public.nokey VALUES (99, 'p'); PREPARE TRANSACTION 'pay42'",
    )
    .expect("prepare");
    let out = trellara(d, &["preflight", "--config", "trellara.yml"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains("W19")
            && text.contains("pay42")
            && text.contains("ROLLBACK PREPARED 'pay42'"),
        "{text}"
    );

    // A first run's slot creation waits on it, and says so with the gid.
    databases(&c, &["tgt3"], TABLES);
    write_flow(
        d,
        "p.yml",
        "p",
        &c.connection_string("src"),
        &c.connection_string("tgt3"),
        &["public.orders"],
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["run", "--config", "p.yml", "--local"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn run");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut said = String::new();
    while !said.contains("pay42") {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => said.push_str(&line),
            Err(_) => {
                let _ = child.kill();
                panic!("the waiting slot creation was not reported: {said}");
            }
        }
    }
    assert!(said.contains("creating the slot waits"), "{said}");
    // SIGTERM cancels the wait on the server: no walsender is left to
    // create the slot once the transaction ends, with nobody to read it.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    ends_within(
        &mut child,
        10,
        "the run ignored SIGTERM while creating its slot",
    );
    let status = child.wait().expect("wait");
    assert_eq!(
        status.code(),
        Some(1),
        "a run stopped short of its end is no success"
    );
    let walsenders =
        || c.psql_value("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'");
    let gone = std::time::Instant::now();
    while walsenders() != "0" && gone.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(
        walsenders(),
        "0",
        "the slot creation was cancelled on the server"
    );
    src.batch_execute("ROLLBACK PREPARED 'pay42'")
        .expect("rollback prepared");
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        c.psql_value("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'trellara_p'"),
        "0",
        "no slot appears once the transaction ends"
    );

    // A run whose wait ends goes on.
    src.batch_execute(
        "BEGIN; INSERT INTO public.nokey VALUES (98, 'p'); PREPARE TRANSACTION 'pay43'",
    )
    .expect("prepare");
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["run", "--config", "p.yml", "--local"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn run");
    let waiting = std::time::Instant::now();
    while walsenders() == "0" && waiting.elapsed() < std::time::Duration::from_secs(30) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    src.batch_execute("ROLLBACK PREPARED 'pay43'")
        .expect("rollback prepared");
    assert!(
        child.wait().expect("wait").success(),
        "the run goes on once it ended"
    );
}

#[test]
fn sequences_are_brought_forward_and_one_behind_is_a_note() {
    on_every_major(sequences);
}

/// The serial and identity sequences of the flow's tables reach the
/// source's values on the target at the end of a run, so the target hands
/// out no key the source already used; verify notes one behind, never a
/// divergence.
fn sequences(major: Major) {
    let Some(c) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let schema = "CREATE TABLE public.ids (id bigserial PRIMARY KEY, v text);
                  CREATE TABLE public.idn (id int GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, v text);";
    databases(&c, &["src", "tgt"], schema);
    let mut src = c.try_connect("src").expect("connect");
    src.batch_execute(
        "INSERT INTO public.ids (v) SELECT 'v' FROM generate_series(1, 50);
         INSERT INTO public.idn (v) SELECT 'v' FROM generate_series(1, 30);",
    )
    .expect("rows");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(
        d,
        "trellara.yml",
        "q",
        &c.connection_string("src"),
        &c.connection_string("tgt"),
        &["public.ids", "public.idn"],
    );
    let text = exits(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        0,
        "run",
    );
    assert!(
        text.contains("q CONVERGED") && text.contains("brought forward"),
        "{text}"
    );
    // A cutover: the target's next keys follow the source's.
    let mut tgt = c.try_connect("tgt").expect("connect");
    tgt.batch_execute(
        "INSERT INTO public.ids (v) VALUES ('t'); INSERT INTO public.idn (v) VALUES ('t')",
    )
    .expect("no duplicate key on the target");
    tgt.batch_execute("DELETE FROM public.ids WHERE v = 't'; DELETE FROM public.idn WHERE v = 't'")
        .expect("undo");

    // Moved on the source without a row: a note, not a divergence.
    src.batch_execute("SELECT setval('public.ids_id_seq', 1000)")
        .expect("setval");
    let text = exits(
        &trellara(d, &["verify", "--config", "trellara.yml"]),
        0,
        "verify",
    );
    assert!(
        text.contains("q CONVERGED") && text.contains("note: sequence public.ids_id_seq"),
        "{text}"
    );
    exits(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        0,
        "run",
    );
    let text = exits(
        &trellara(d, &["verify", "--config", "trellara.yml"]),
        0,
        "verify",
    );
    assert!(!text.contains("note: sequence"), "{text}");
    assert_eq!(
        c.try_connect("tgt")
            .expect("connect")
            .query_one("SELECT last_value FROM public.ids_id_seq", &[])
            .expect("value")
            .get::<_, i64>(0),
        1000
    );
}

/// A peer that accepts TCP and never answers: every command that connects
/// gives up within connect_timeout (here 1 s) with a clear error, for the
/// grader's session, the SQL sessions and the replication session alike.
#[test]
fn a_peer_that_never_answers_is_an_error_within_connect_timeout() {
    let port = trellara_tests::endpoints::mute_peer();
    let url = format!("postgresql://u@127.0.0.1:{port}/db?connect_timeout=1");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(d, "trellara.yml", "mute", &url, &url, &["public.orders"]);
    for (args, code) in [
        (&["check", "--database-url", &url][..], 2),
        (&["preflight", "--config", "trellara.yml"], 2),
        (&["run", "--config", "trellara.yml", "--local"], 1),
        (&["verify", "--config", "trellara.yml"], 2),
        (&["status", "--config", "trellara.yml"], 1),
        (&["teardown", "--config", "trellara.yml"], 1),
    ] {
        let started = std::time::Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
            .current_dir(d)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn");
        ends_within(
            &mut child,
            20,
            &format!("{} hangs on a peer that never answers", args.join(" ")),
        );
        let out = child.wait_with_output().expect("output");
        let text = exits(&out, code, &args.join(" "));
        assert!(
            text.contains("connect_timeout"),
            "{}: {text}",
            args.join(" ")
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(8),
            "{}",
            args.join(" ")
        );
    }
}

/// The spec's evaluation loop as typed: `init --evaluate` with no target
/// URL replicates into a throwaway cluster under the flow's directory,
/// which any command starts when it is down and teardown removes. The
/// tables have mixed-case names, spelled as SQL spells them.
#[test]
fn an_evaluation_without_a_target_url_gets_a_throwaway_target() {
    on_every_major(throwaway_target);
}

fn throwaway_target(major: Major) {
    let Some(c) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    databases(
        &c,
        &["shop"],
        "CREATE TABLE public.\"Sales\" (id bigint PRIMARY KEY, \"Amount\" numeric(10,2) NOT NULL, note varchar(8));
         CREATE TABLE public.orders (id bigint PRIMARY KEY, total numeric GENERATED ALWAYS AS (id * 2) STORED);
         CREATE TABLE public.sales (id bigint PRIMARY KEY, other text);
         INSERT INTO public.\"Sales\" SELECT g, g * 1.25, 'n' || g FROM generate_series(1, 50) g;
         INSERT INTO public.orders SELECT g FROM generate_series(1, 10) g;
         INSERT INTO public.sales VALUES (1, 'not this one');",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let source = c.connection_string("shop");
    let text = exits(
        &trellara(
            d,
            &[
                "init",
                "--source-database-url",
                &source,
                "--table",
                "public.\"Sales\"",
                "--table",
                "Public.Orders",
                "--flow",
                "ev",
                "--evaluate",
            ],
        ),
        0,
        "init --evaluate without a target URL",
    );
    assert!(text.contains("throwaway target"), "{text}");
    let yml = std::fs::read_to_string(d.join("trellara.yml")).expect("config");
    assert!(
        yml.contains("throwaway: ./.trellara/trellara/ev/target")
            && yml.contains("public.\"Sales\"")
            && yml.contains("- public.orders"),
        "{yml}"
    );
    let cluster = d.join(".trellara/trellara/ev/target");
    assert_eq!(
        std::fs::read_to_string(cluster.join("PG_VERSION"))
            .expect("PG_VERSION")
            .trim(),
        major.number().to_string(),
        "the source's major"
    );
    let text = exits(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        0,
        "the loop into the throwaway target",
    );
    assert!(
        text.contains("ev CONVERGED") && text.contains("public.\"Sales\""),
        "{text}"
    );
    c.try_connect("shop")
        .expect("connect")
        .batch_execute(
            "UPDATE public.\"Sales\" SET \"Amount\" = \"Amount\" + 1 WHERE id <= 10;
             DELETE FROM public.\"Sales\" WHERE id = 50;
             INSERT INTO public.orders VALUES (11);
             UPDATE public.sales SET other = 'changed'",
        )
        .expect("writes");
    let text = exits(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        0,
        "changes to the mixed-case table",
    );
    assert!(
        text.contains("ev CONVERGED") && text.contains("rows 49 / 49"),
        "{text}"
    );
    let text = exits(
        &trellara(
            d,
            &[
                "verify",
                "--config",
                "trellara.yml",
                "--table",
                "public.\"Sales\"",
            ],
        ),
        0,
        "verify --table of a mixed-case name",
    );
    assert!(text.contains("CONVERGED"), "{text}");
    let text = exits(
        &trellara(
            d,
            &[
                "verify",
                "--config",
                "trellara.yml",
                "--table",
                "public.Sales",
            ],
        ),
        2,
        "an unquoted name folds to public.sales, which the flow has not",
    );
    assert!(
        text.contains("\"public.sales\"") && text.contains("public.\"Sales\""),
        "{text}"
    );

    // Stopped behind its back, it is started by the next command.
    let pg_ctl = c.install().bindir().join("pg_ctl");
    let mut stop = if nix::unistd::geteuid().is_root() {
        let mut cmd = Command::new("runuser");
        cmd.args(["-u", "trellara", "--"]).arg(&pg_ctl);
        cmd
    } else {
        Command::new(&pg_ctl)
    };
    let stopped = stop
        .arg("stop")
        .arg("-w")
        .arg("-D")
        .arg(&cluster)
        .output()
        .expect("pg_ctl");
    assert!(stopped.status.success(), "{stopped:?}");
    let text = exits(
        &trellara(d, &["status", "--config", "trellara.yml"]),
        0,
        "status",
    );
    assert!(
        text.contains("throwaway cluster in")
            && text.contains("was stopped, started for this command"),
        "{text}"
    );
    let text = exits(
        &trellara(d, &["status", "--config", "trellara.yml"]),
        0,
        "status",
    );
    assert!(
        text.contains("(running;") && text.contains("last verify CONVERGED"),
        "{text}"
    );

    // Another flow's config pointed at it uses, stops and removes nothing.
    let other = yml.replace("name: ev", "name: other").replace(
        "throwaway: ./.trellara/trellara/ev/target",
        "throwaway: ./.trellara/trellara/ev/target\n",
    );
    std::fs::write(d.join("other.yml"), other).expect("write");
    for args in [
        &["status", "--config", "other.yml"][..],
        &["teardown", "--config", "other.yml", "--yes"],
    ] {
        let text = exits(&trellara(d, args), 1, &args.join(" "));
        assert!(
            text.contains("is not the throwaway target init made for flow other"),
            "{text}"
        );
        assert!(cluster.join("PG_VERSION").exists(), "{}", args.join(" "));
    }
    // Nor does init --force leave it behind with nothing naming it.
    let text = exits(
        &trellara(
            d,
            &[
                "init",
                "--source-database-url",
                &source,
                "--table",
                "public.orders",
                "--flow",
                "ev",
                "--evaluate",
                "--force",
            ],
        ),
        1,
        "init --force over a config with a throwaway target",
    );
    assert!(text.contains("which --force would leave behind"), "{text}");
    assert_eq!(
        std::fs::read_to_string(d.join("trellara.yml")).expect("config"),
        yml
    );

    let text = exits(
        &trellara(d, &["teardown", "--config", "trellara.yml", "--yes"]),
        0,
        "teardown",
    );
    assert!(text.contains("the throwaway target cluster in"), "{text}");
    assert!(
        !d.join(".trellara").exists(),
        "teardown leaves no empty directories"
    );
    assert!(!cluster.exists(), "the throwaway target is removed");
    let left = footprint_slots(&c, "shop");
    assert_eq!(
        left, "slots [] publications []",
        "nothing left on the source"
    );
}

/// Slots and publications of `db`.
fn footprint_slots(cluster: &Cluster, db: &str) -> String {
    let mut client = cluster.try_connect(db).expect("connect");
    let row = client
        .query_one(
            "SELECT coalesce((SELECT string_agg(slot_name, ',') FROM pg_replication_slots), ''),
                    coalesce((SELECT string_agg(pubname, ',') FROM pg_publication), '')",
            &[],
        )
        .expect("footprint");
    format!(
        "slots [{}] publications [{}]",
        row.get::<_, String>(0),
        row.get::<_, String>(1)
    )
}

/// Refusals of the throwaway path leave nothing: no target URL without
/// --evaluate, a directory that is already there, a source that is down.
#[test]
fn a_throwaway_target_is_made_only_when_asked_and_only_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let text = exits(
        &trellara(
            d,
            &[
                "init",
                "--source-database-url",
                "postgresql://u@127.0.0.1:1/db",
                "--table",
                "public.t",
            ],
        ),
        1,
        "no target URL without --evaluate",
    );
    assert!(text.contains("--target-database-url is required"), "{text}");
    let text = exits(
        &trellara(
            d,
            &[
                "init",
                "--source-database-url",
                "postgresql://u@127.0.0.1:1/db?connect_timeout=2",
                "--table",
                "public.t",
                "--evaluate",
            ],
        ),
        1,
        "a source that is down",
    );
    assert!(text.contains("connect to the source database"), "{text}");
    assert!(
        !d.join("trellara.yml").exists() && !d.join(".trellara/trellara/main/target").exists(),
        "nothing made"
    );
    std::fs::create_dir_all(d.join(".trellara/trellara/main/target")).expect("mkdir");
    std::fs::write(d.join(".trellara/trellara/main/target/keep"), "mine").expect("write");
    let Some(c) = test_cluster(Major::Pg15, &ClusterOptions::new()) else {
        return;
    };
    let text = exits(
        &trellara(
            d,
            &[
                "init",
                "--source-database-url",
                &c.connection_string("postgres"),
                "--table",
                "public.t",
                "--evaluate",
            ],
        ),
        1,
        "a directory already there",
    );
    assert!(
        text.contains("is not a throwaway target made by trellara init"),
        "{text}"
    );
    assert_eq!(
        std::fs::read_to_string(d.join(".trellara/trellara/main/target/keep")).expect("kept"),
        "mine"
    );
    assert!(!d.join("trellara.yml").exists());
}

/// A reader that stops reading (`| head`) is no error and no panic.
#[test]
fn a_closed_pipe_is_not_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(
        d,
        "trellara.yml",
        "pipe",
        "postgresql://u@h/db",
        "postgresql://u@h/db2",
        &["public.orders"],
    );
    for args in [
        &["check", "--config", "trellara.yml"][..],
        &["check", "--config", "trellara.yml", "--format", "json"],
    ] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_trellara"))
            .current_dir(d)
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{}: {stderr}", args.join(" "));
        assert_eq!(out.status.code(), Some(0), "{}: {stderr}", args.join(" "));
    }
    // Closed stderr: no panic, the command's own status.
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["status", "--config", "missing.yml"])
        .stderr(writer)
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(1),
        "a missing config, told to nobody"
    );
    // Output lost to a full disk is a failure, not a success.
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let out = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["check", "--config", "trellara.yml", "--format", "json"])
        .stdout(full)
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("standard output") && stderr.contains("No space left"),
        "{stderr}"
    );
}

/// A catalog statement blocked behind a lock is an error naming the
/// timeout, not a hang (the majors run side by side: each waits 30 s).
#[test]
fn a_catalog_statement_behind_a_lock_is_an_error_not_a_hang() {
    let majors: Vec<_> = Major::ALL
        .into_iter()
        .map(|major| std::thread::spawn(move || blocked_catalog(major)))
        .collect();
    for m in majors {
        m.join().expect("a major's scenario");
    }
}

fn blocked_catalog(major: Major) {
    let Some(c) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    databases(&c, &["src", "tgt"], TABLES);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(
        d,
        "trellara.yml",
        "lock",
        &c.connection_string("src"),
        &c.connection_string("tgt"),
        &["public.orders"],
    );
    exits(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        0,
        "a first run",
    );
    let mut holder = c.try_connect("tgt").expect("connect");
    holder
        .batch_execute("BEGIN; LOCK TABLE trellara.checkpoints IN ACCESS EXCLUSIVE MODE")
        .expect("lock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["status", "--config", "trellara.yml"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    ends_within(
        &mut child,
        60,
        &format!("status hangs behind a lock on {major}"),
    );
    let text = exits(
        &child.wait_with_output().expect("output"),
        1,
        "status behind a lock",
    );
    assert!(text.contains("statement timeout"), "{major}: {text}");
    holder.batch_execute("ROLLBACK").expect("unlock");
}

/// Two configs made by `init` in one directory name their flow `main`
/// alike, so both default to slot and publication `trellara_main`. On one
/// source into two targets, the second is refused before it could drop or
/// share the first's slot, and its teardown keeps what the first streams.
#[test]
fn a_flow_of_the_same_name_never_takes_another_configs_slot() {
    on_every_major(same_name);
}

fn same_name(major: Major) {
    let Some(c) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    databases(&c, &["src", "ta", "tb"], TABLES);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    for (file, target) in [("a.yml", "ta"), ("b.yml", "tb")] {
        exits(
            &trellara(
                d,
                &[
                    "init",
                    "--source-database-url",
                    &c.connection_string("src"),
                    "--target-database-url",
                    &c.connection_string(target),
                    "--table",
                    "public.orders",
                    "--evaluate",
                    "--output",
                    file,
                ],
            ),
            0,
            "init",
        );
    }
    let text = exits(
        &trellara(d, &["run", "--config", "a.yml", "--local", "--verify"]),
        0,
        "the first config's flow",
    );
    assert!(text.contains("main CONVERGED"), "{text}");
    let src_before = footprint(&c, "src");
    let tb_before = footprint(&c, "tb");
    for args in [
        &["preflight", "--config", "b.yml"][..],
        &["run", "--config", "b.yml", "--local"],
        &["reseed", "--config", "b.yml"],
    ] {
        let text = exits(&trellara(d, args), 3, &args.join(" "));
        assert!(
            text.contains("replication slot trellara_main exists")
                && text.contains("give this flow its own source.slot"),
            "{text}"
        );
        assert_eq!(footprint(&c, "src"), src_before, "{}", args.join(" "));
        assert_eq!(footprint(&c, "tb"), tb_before, "{}", args.join(" "));
    }
    let text = exits(
        &trellara(d, &["teardown", "--config", "b.yml", "--yes"]),
        0,
        "the second config's teardown",
    );
    assert!(
        text.contains("kept: replication slot trellara_main")
            && text.contains("kept: publication trellara_main"),
        "{text}"
    );
    assert_eq!(
        footprint(&c, "src"),
        src_before,
        "teardown kept the first flow's slot"
    );
    // The first flow lost nothing.
    c.try_connect("src")
        .expect("connect")
        .batch_execute("INSERT INTO public.orders VALUES (100, 'after'); DELETE FROM public.orders WHERE id = 1")
        .expect("write");
    let text = exits(
        &trellara(d, &["run", "--config", "a.yml", "--local", "--verify"]),
        0,
        "the first flow again",
    );
    assert!(
        text.contains("main CONVERGED") && text.contains("applied 1 transactions"),
        "{text}"
    );
}

/// `run --follow` waiting to follow again (its target is down) still
/// holds its log: a teardown meanwhile is refused, not undone by the next
/// round.
#[test]
fn a_following_run_between_rounds_keeps_its_log() {
    let Some(c) = test_cluster(Major::Pg17, &ClusterOptions::new()) else {
        return;
    };
    databases(&c, &["src"], TABLES);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(
        d,
        "trellara.yml",
        "wait",
        &c.connection_string("src"),
        "postgresql://u@127.0.0.1:1/down?connect_timeout=1",
        &["public.orders"],
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["run", "--config", "trellara.yml", "--local", "--follow"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    std::thread::sleep(std::time::Duration::from_secs(2));
    let out = trellara(d, &["teardown", "--config", "trellara.yml", "--yes"]);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
    let text = exits(&out, 1, "teardown while the flow waits to follow again");
    assert!(text.contains("flow wait is running"), "{text}");
}

#[test]
fn a_second_process_on_a_flow_is_refused_through_the_target() {
    for major in Major::ALL {
        eprintln!("on {major}");
        second_process(major);
    }
}

/// Two hosts with the same config (each its own directory and log): the
/// second run is refused through the target's lock (exit 3, naming the
/// holder), leaves nothing on its host, and runs once the first stopped.
fn second_process(major: Major) {
    let Some(c) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    databases(&c, &["src", "tgt"], TABLES);
    let (first, second) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    // The second host's sessions are told apart by their application_name.
    for (d, app) in [(first.path(), "first"), (second.path(), "second")] {
        write_flow(
            d,
            "trellara.yml",
            "busy",
            &c.connection_string("src"),
            &format!("{}?application_name={app}", c.connection_string("tgt")),
            &["public.orders"],
        );
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(first.path())
        .args(["run", "--config", "trellara.yml", "--local", "--follow"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let mut target = c.try_connect("tgt").expect("connect");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let held: i64 = target
            .query_one(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
                &[],
            )
            .expect("pg_locks")
            .get(0);
        // One per part of the flow: capture and apply.
        if held == 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the first run never took its lock"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let text = exits(
        &trellara(
            second.path(),
            &["run", "--config", "trellara.yml", "--local"],
        ),
        3,
        "a second process on the flow",
    );
    assert!(
        text.contains("flow busy is already running against this target") && text.contains("pid"),
        "{text}"
    );
    assert!(
        !second.path().join(".trellara").exists(),
        "the refused run left nothing on its host"
    );
    // The target keeps dropping the first process's working sessions (all
    // but the one that holds the lock, whose only statements take it or
    // confirm it): its rounds fail and it waits to retry, still holding
    // the flow on the target.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let terminator = {
        let stop = std::sync::Arc::clone(&stop);
        let mut killer = c.try_connect("tgt").expect("connect");
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                killer
                    .execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                         WHERE datname = 'tgt' AND application_name = 'first'
                           AND query NOT LIKE '%hashtext(''trellara.flow'')%'",
                        &[],
                    )
                    .expect("terminate the first process's target sessions");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let refused = trellara(
        second.path(),
        &["run", "--config", "trellara.yml", "--local"],
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    terminator.join().expect("terminator");
    let text = exits(&refused, 3, "a second process while the first retries");
    assert!(
        text.contains("flow busy is already running against this target"),
        "{text}"
    );
    // The lock's own session terminated: the first process notices, and
    // takes the lock again on a new session.
    let holder = |target: &mut postgres::Client| -> Option<i32> {
        target
            .query_opt(
                "SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND granted",
                &[],
            )
            .expect("pg_locks")
            .map(|r| r.get(0))
    };
    let old = holder(&mut target).expect("the first process holds the lock");
    target
        .execute("SELECT pg_terminate_backend($1)", &[&old])
        .expect("terminate the lock's session");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while holder(&mut target).is_none_or(|pid| pid == old) {
        assert!(
            std::time::Instant::now() < deadline,
            "the first process never took its lock again"
        );
        assert!(
            child.try_wait().expect("poll").is_none(),
            "the follower ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Nor may the other host tear the flow down under it.
    let text = exits(
        &trellara(
            second.path(),
            &["teardown", "--config", "trellara.yml", "--yes"],
        ),
        1,
        "a teardown from the other host",
    );
    assert!(text.contains("holds its lock on the target"), "{text}");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    ends_within(&mut child, 60, "the first run after SIGTERM");
    // The lock went with the first process. The second host has no log
    // of what the first captured, so it may not just go on: it is told
    // to reseed, never streams past a gap.
    let text = exits(
        &trellara(
            second.path(),
            &["run", "--config", "trellara.yml", "--local"],
        ),
        1,
        "the second run once the first stopped",
    );
    assert!(
        !text.contains("already running") && text.contains("past what the log holds"),
        "{text}"
    );
}

#[test]
fn a_slot_another_consumer_streams_is_refused_with_its_pid() {
    on_every_major(slot_held_elsewhere);
}

/// An outside consumer (pg_recvlogical) streaming the flow's slot: the run
/// stops, naming that consumer's pid, and leaves the slot where it was.
fn slot_held_elsewhere(major: Major) {
    let Some(c) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    databases(&c, &["src", "tgt"], TABLES);
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    write_flow(
        d,
        "trellara.yml",
        "t",
        &c.connection_string("src"),
        &c.connection_string("tgt"),
        &["public.orders"],
    );
    exits(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        0,
        "first run",
    );
    let mut other = Command::new(c.install().bin("pg_recvlogical"))
        .args([
            "-h",
            c.host(),
            "-p",
            &c.port().to_string(),
            "-U",
            "postgres",
        ])
        .args([
            "-d",
            "src",
            "--slot",
            "trellara_t",
            "--start",
            "-f",
            "/dev/null",
        ])
        .args([
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=trellara_t",
        ])
        .spawn()
        .expect("pg_recvlogical");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let pid = loop {
        let pid = c.psql_value(
            "SELECT coalesce(active_pid, 0) FROM pg_replication_slots WHERE slot_name = 'trellara_t'",
        );
        if pid != "0" {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pg_recvlogical never streamed"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let confirmed = || {
        c.psql_value(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'trellara_t'",
        )
    };
    let before = confirmed();
    let out = trellara(d, &["run", "--config", "trellara.yml", "--local"]);
    let _ = other.kill();
    let _ = other.wait();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains(&format!("is held by another process (pid {pid})")),
        "names the consumer: {text}"
    );
    assert_eq!(confirmed(), before, "the slot is where it was");
}
