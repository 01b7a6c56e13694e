//! The verified flow end to end with the `trellara` binary on every major:
//! init, check, preflight, run --local --verify ending at CONVERGED; a
//! second round after more writes; a concurrent reader that never sees a
//! half-applied transaction; a constraint violation quarantined, repaired
//! and replayed; a target row changed behind Trellara's back named by verify
//! with its key range; redelivery after a crash between target commit and
//! cursor move skipped and counted.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use trellara_tests::endpoints::{http_get, metric};
use trellara_tests::{Cluster, ClusterOptions, Major, test_cluster};

const SCHEMA: &str = "
CREATE TABLE public.orders (id bigint PRIMARY KEY, customer text NOT NULL, total numeric(12,2) NOT NULL);
CREATE TABLE public.line_items (order_id bigint NOT NULL, line int NOT NULL, qty int NOT NULL, price numeric(12,2) NOT NULL, note text, PRIMARY KEY (order_id, line));
";

/// `n` orders from `first`, each with its line items, one transaction each.
fn workload(cluster: &Cluster, first: i64, n: i64) {
    let mut client = cluster.connect();
    for o in first..first + n {
        let mut tx = client.transaction().expect("begin");
        let lines = 1 + o % 4;
        let mut total = 0i64;
        for l in 1..=lines {
            let (qty, price) = (1 + (o + l) % 3, 100 + (o * 7 + l) % 900);
            total += qty * price;
            tx.execute(
                "INSERT INTO public.line_items VALUES ($1, $2::int, $3::int, $4::text::numeric / 100, repeat('n', 3))",
                &[&o, &(l as i32), &(qty as i32), &price.to_string()],
            )
            .expect("line");
        }
        tx.execute(
            "INSERT INTO public.orders VALUES ($1, 'c' || $1::bigint::text, $2::text::numeric / 100)",
            &[&o, &total.to_string()],
        )
        .expect("order");
        tx.commit().expect("commit");
    }
}

fn trellara(dir: &Path, args: &[&str]) -> Output {
    trellara_with(dir, args, &[])
}

/// [`trellara`] with environment variables set for it.
fn trellara_with(dir: &Path, args: &[&str], vars: &[(&str, &Path)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(dir)
        .args(args)
        .envs(vars.iter().copied())
        .output()
        .expect("run trellara")
}

fn ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The stderr of a command that must exit with `code`.
fn fails(out: &Output, code: i32) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(code),
        "expected exit {code}:\n{}\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// `trellara init` in `dir` for flow `flow` of `tables`, evaluation mode.
fn init_flow(dir: &Path, source: &str, target: &str, tables: &[&str], flow: &str, capture: &str) {
    let mut args = vec![
        "init",
        "--source-database-url",
        source,
        "--target-database-url",
        target,
        "--flow",
        flow,
        "--capture",
        capture,
        "--evaluate",
    ];
    for table in tables {
        args.extend(["--table", table]);
    }
    ok(&trellara(dir, &args), "init");
    free_port(dir);
}

/// Tests run side by side: each follower serves its endpoints on a free
/// port, not the default 9401.
fn free_port(dir: &Path) {
    let path = dir.join("trellara.yml");
    let mut text = std::fs::read_to_string(&path).expect("the config init wrote");
    text.push_str("service:\n  relay_listen: 127.0.0.1:0\n");
    std::fs::write(&path, text).expect("config");
}

/// `run --local --verify`, which must succeed; its stdout.
fn run_verify(dir: &Path, what: &str) -> String {
    ok(
        &trellara(
            dir,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        what,
    )
}

/// Runs `scenario` against each supported major, naming it on stderr so a
/// failure says which one.
fn on_every_major(scenario: impl Fn(Major)) {
    for major in Major::ALL {
        eprintln!("on {major}");
        scenario(major);
    }
}

struct Pair {
    source: Cluster,
    target: Cluster,
    dir: tempfile::TempDir,
}

fn pair(major: Major) -> Option<Pair> {
    pair_by(major, |c| c.connection_string("postgres"))
}

/// A pair whose config reaches both servers by `url`.
fn pair_by(major: Major, url: impl Fn(&Cluster) -> String) -> Option<Pair> {
    let source = test_cluster(major, &ClusterOptions::new())?;
    let target = test_cluster(major, &ClusterOptions::new())?;
    source.psql(SCHEMA);
    target.psql(SCHEMA);
    let dir = tempfile::tempdir().expect("tempdir");
    let out = trellara(
        dir.path(),
        &[
            "init",
            "--source-database-url",
            &url(&source),
            "--target-database-url",
            &url(&target),
            "--table",
            "public.orders",
            "--table",
            "public.line_items",
            "--flow",
            "shop",
            "--evaluate",
        ],
    );
    ok(&out, "init");
    free_port(dir.path());
    Some(Pair {
        source,
        target,
        dir,
    })
}

#[test]
fn public_loop_pg15() {
    public_loop(Major::Pg15);
}

#[test]
fn public_loop_pg16() {
    public_loop(Major::Pg16);
}

#[test]
fn public_loop_pg17() {
    public_loop(Major::Pg17);
}

#[test]
fn public_loop_pg18() {
    public_loop(Major::Pg18);
}

fn public_loop(major: Major) {
    let Some(p) = pair(major) else { return };
    workload(&p.source, 1, 50);
    let d = p.dir.path();
    assert!(
        ok(
            &trellara(d, &["check", "--config", "trellara.yml"]),
            "check"
        )
        .contains("valid")
    );
    let pre = ok(
        &trellara(d, &["preflight", "--config", "trellara.yml"]),
        "preflight",
    );
    assert!(
        pre.contains("READY") && pre.contains("nothing was created"),
        "{pre}"
    );
    assert_eq!(
        p.source
            .psql_value("SELECT count(*) FROM pg_replication_slots"),
        "0",
        "preflight creates nothing"
    );
    // Before the first run the reporting commands only read, and say so.
    let status = ok(
        &trellara(d, &["status", "--config", "trellara.yml"]),
        "status before the first run",
    );
    assert!(status.contains("never ran against this target"), "{status}");
    let plan = ok(
        &trellara(d, &["repair", "plan", "--config", "trellara.yml"]),
        "repair plan before the first run",
    );
    assert!(
        plan.contains("has not run against this target yet"),
        "{plan}"
    );
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM pg_namespace WHERE nspname = 'trellara'"),
        "0",
        "status and repair plan create nothing"
    );
    let first = ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "run",
    );
    assert!(first.contains("shop CONVERGED"), "{major}: {first}");
    assert!(
        first.contains("copied public.line_items"),
        "{major}: {first}"
    );

    // More writes, applied while a reader checks every order against its
    // line items: a half-applied transaction would show a mismatch.
    workload(&p.source, 51, 150);
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let reader = {
        let (stop, reads) = (Arc::clone(&stop), Arc::clone(&reads));
        let url = p.target.connection_string("postgres");
        std::thread::spawn(move || {
            let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("reader");
            let mut torn = 0i64;
            while !stop.load(Ordering::Relaxed) {
                let row = c
                    .query_one(
                        "SELECT count(*) FROM public.orders o
                         WHERE o.total <> (SELECT coalesce(sum(qty * price), 0) FROM public.line_items l WHERE l.order_id = o.id)",
                        &[],
                    )
                    .expect("read");
                torn += row.get::<_, i64>(0);
                reads.fetch_add(1, Ordering::Relaxed);
            }
            torn
        })
    };
    let second = ok(
        &trellara(
            d,
            &[
                "run",
                "--config",
                "trellara.yml",
                "--local",
                "--verify",
                "--format",
                "json",
            ],
        ),
        "run",
    );
    stop.store(true, Ordering::Relaxed);
    assert_eq!(
        reader.join().expect("reader"),
        0,
        "{major}: a reader saw a half-applied transaction"
    );
    assert!(reads.load(Ordering::Relaxed) > 0);
    let verdicts: serde_json::Value = serde_json::from_str(&second).expect("json verdict");
    assert_eq!(verdicts[0]["result"], "CONVERGED", "{major}: {second}");
    assert_eq!(verdicts[0]["transactions_applied"], 150);
    assert_eq!(
        verdicts[0]["snapshot_state"], "verified",
        "verify promoted the run"
    );

    let status = ok(
        &trellara(
            d,
            &["status", "--config", "trellara.yml", "--format", "json"],
        ),
        "status",
    );
    let status: serde_json::Value = serde_json::from_str(&status).expect("json status");
    assert_eq!(status[0]["last_verify"]["verdict"], "CONVERGED");
}

#[test]
fn unix_socket_urls_reach_source_and_target() {
    on_every_major(unix_socket_urls_reach_source_and_target_on);
}

/// Both servers named by their socket directory, as local servers with
/// peer authentication usually are: the replication session, the snapshot,
/// the applier and verify all go over the Unix sockets. Each URL names a
/// directory holding only a link `.s.PGSQL.1` to the server's socket, and
/// port 1, where nothing listens on TCP: the flow can only work through
/// the sockets.
fn unix_socket_urls_reach_source_and_target_on(major: Major) {
    let links = tempfile::tempdir().expect("tempdir");
    let Some(p) = pair_by(major, |c| {
        let dir = links.path().join(c.port().to_string());
        std::fs::create_dir_all(&dir).expect("socket link dir");
        std::os::unix::fs::symlink(
            c.socket_dir().join(format!(".s.PGSQL.{}", c.port())),
            dir.join(".s.PGSQL.1"),
        )
        .expect("socket link");
        format!(
            "postgresql://postgres@/postgres?host={}&port=1",
            dir.display()
        )
    }) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 20);
    let pre = ok(
        &trellara(d, &["preflight", "--config", "trellara.yml"]),
        "preflight",
    );
    assert!(pre.contains("READY"), "{pre}");
    for (round, first) in [(1, 21), (2, 41)] {
        let out = ok(
            &trellara(
                d,
                &["run", "--config", "trellara.yml", "--local", "--verify"],
            ),
            &format!("run {round}"),
        );
        assert!(out.contains("shop CONVERGED"), "{major}: {out}");
        workload(&p.source, first, 20);
    }
    assert_eq!(
        p.target.psql_value("SELECT count(*) FROM public.orders"),
        "40"
    );

    // URLs naming no host (and the source no port), as `psql` takes them:
    // PGHOST names the directory that now holds both sockets, PGPORT the
    // source's port.
    let both = links.path().join("both");
    std::fs::create_dir(&both).expect("shared socket dir");
    for (cluster, port) in [(&p.source, 1), (&p.target, 2)] {
        std::os::unix::fs::symlink(
            cluster
                .socket_dir()
                .join(format!(".s.PGSQL.{}", cluster.port())),
            both.join(format!(".s.PGSQL.{port}")),
        )
        .expect("socket link");
    }
    let env: [(&str, &Path); 2] = [("PGHOST", &both), ("PGPORT", Path::new("1"))];
    ok(
        &trellara_with(
            d,
            &[
                "init",
                "--source-database-url",
                "postgresql://postgres@/postgres",
                "--target-database-url",
                "postgresql://postgres@/postgres?port=2",
                "--table",
                "public.orders",
                "--table",
                "public.line_items",
                "--flow",
                "shop",
                "--output",
                "hostless.yml",
                "--evaluate",
            ],
            &env,
        ),
        "init without hosts",
    );
    let out = ok(
        &trellara_with(
            d,
            &["run", "--config", "hostless.yml", "--local", "--verify"],
            &env,
        ),
        "run without hosts",
    );
    assert!(out.contains("shop CONVERGED"), "{major}: {out}");
    assert_eq!(
        p.target.psql_value("SELECT count(*) FROM public.orders"),
        "60"
    );
}

#[test]
fn semantics_sees_no_half_applied_transaction_and_catches_a_broken_target() {
    on_every_major(semantics_on);
}

/// Runs `trellara semantics` for `seconds` while `n` multi-table
/// transactions commit at the source from `first`; `tamper` runs on the
/// target midway. Returns the JSON report and the exit code.
fn semantics_run(
    p: &Pair,
    (config, first, n): (&str, i64, i64),
    seconds: &str,
    tamper: Option<&'static str>,
) -> (serde_json::Value, Option<i32>) {
    let writer = {
        let url = p.source.connection_string("postgres");
        std::thread::spawn(move || {
            let mut client = postgres::Client::connect(&url, postgres::NoTls).expect("writer");
            for o in first..first + n {
                let mut tx = client.transaction().expect("begin");
                for l in 1..=3 {
                    tx.execute(
                        "INSERT INTO public.line_items VALUES ($1, $2, 1, 1, 'n')",
                        &[&o, &l],
                    )
                    .expect("line");
                }
                tx.execute("INSERT INTO public.orders VALUES ($1, 'c', 3)", &[&o])
                    .expect("order");
                // Keys written again and again, and deletes: what a reader
                // must judge by the last write at its checkpoint.
                tx.execute(
                    "UPDATE public.line_items SET qty = qty + 1 WHERE order_id = $1 AND line = 1",
                    &[&(o - 2)],
                )
                .expect("update");
                if o % 7 == 0 {
                    tx.execute(
                        "DELETE FROM public.line_items WHERE order_id = $1 AND line = 3",
                        &[&(o - 5)],
                    )
                    .expect("delete");
                }
                tx.commit().expect("commit");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        })
    };
    let tamperer = tamper.map(|sql| {
        let url = p.target.connection_string("postgres");
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(1500));
            let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("tamper");
            c.batch_execute(sql).expect("tamper");
        })
    });
    let out = trellara(
        p.dir.path(),
        &[
            "semantics",
            "--config",
            config,
            "--duration",
            seconds,
            "--format",
            "json",
        ],
    );
    writer.join().expect("writer");
    if let Some(t) = tamperer {
        t.join().expect("tamperer");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let json = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{e}: {text}\n{}", String::from_utf8_lossy(&out.stderr)));
    (json, out.status.code())
}

fn semantics_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    ok(
        &trellara(
            p.dir.path(),
            &["run", "--config", "trellara.yml", "--local"],
        ),
        "run",
    );
    let (report, code) = semantics_run(&p, ("trellara.yml", 1, 400), "4", None);
    assert_eq!(code, Some(0), "{major}: {report}");
    assert_eq!(report["verdict"], "ATOMIC", "{major}: {report}");
    assert!(
        report["reads_in_flight"].as_u64() > Some(0) && report["rows_compared"].as_u64() > Some(0),
        "{major}: the reader looked while transactions applied: {report}"
    );
    // A target changed behind Trellara's back breaks what the checkpoint
    // claims: the reader must say so, naming the table.
    let (report, code) = semantics_run(
        &p,
        ("trellara.yml", 10_001, 400),
        "4",
        Some(
            "DELETE FROM public.line_items WHERE line = 2 AND order_id = (SELECT max(order_id) FROM public.line_items)",
        ),
    );
    assert_eq!(code, Some(1), "{major}: {report}");
    assert_eq!(report["verdict"], "HALF_APPLIED", "{major}: {report}");
    assert!(
        report["findings"][0]["table"]
            .as_str()
            .is_some_and(|t| t.contains("line_items")),
        "{major}: {report}"
    );

    // A flow of `sinks:` whose sink is named apart from the flow: the
    // reader's window is around that sink's cursor, so its reads are
    // judged. A window around a cursor that does not exist starts at the
    // log's first record, and past the backlog applied below (60,000 row
    // writes) outgrows its bound: every read unjudged.
    p.target.psql("CREATE DATABASE lake");
    p.target
        .try_connect("lake")
        .expect("connect")
        .batch_execute(SCHEMA)
        .expect("schema");
    std::fs::write(
        p.dir.path().join("sinks.yml"),
        format!(
            "schema_version: 2
flows:
  - name: shop2
    source:
      url: {}
    sinks:
      - name: lake
        target:
          url: {}
    tables: [public.orders, public.line_items]
    transport:
      kind: local
      log_dir: ./.trellara/shop2
service:
  relay_listen: 127.0.0.1:0
",
            p.source.connection_string("postgres"),
            p.target.connection_string("lake"),
        ),
    )
    .expect("config");
    ok(
        &trellara(p.dir.path(), &["run", "--config", "sinks.yml", "--local"]),
        "run of the sinks flow",
    );
    p.source.psql(
        "DO $$ BEGIN FOR o IN 30001..40000 LOOP
             INSERT INTO public.orders VALUES (o, 'b', 1);
             INSERT INTO public.line_items SELECT o, l, 1, 1, 'b' FROM generate_series(1, 5) l;
             COMMIT;
         END LOOP; END $$",
    );
    ok(
        &trellara(p.dir.path(), &["run", "--config", "sinks.yml", "--local"]),
        "the sinks flow applies its backlog",
    );
    let (report, code) = semantics_run(&p, ("sinks.yml", 20_001, 400), "4", None);
    assert_eq!(code, Some(0), "{major}: {report}");
    assert_eq!(report["verdict"], "ATOMIC", "{major}: {report}");
    let (judged, unjudged) = (
        report["reads"].as_u64().unwrap_or(0),
        report["reads_unjudged"].as_u64().unwrap_or(u64::MAX),
    );
    assert!(
        unjudged < judged,
        "{major}: reads judged around the sink's cursor: {report}"
    );
}

#[test]
fn a_stopped_flow_does_not_hold_the_others_back() {
    on_every_major(a_stopped_flow_does_not_hold_the_others_back_on);
}

fn a_stopped_flow_does_not_hold_the_others_back_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    let flow = |name: &str, table: &str| {
        format!(
            "  - name: {name}\n    source:\n      url: {}\n    target:\n      url: {}\n    tables: [{table}]\n    transport:\n      kind: local\n      log_dir: ./.trellara/{name}\n",
            p.source.connection_string("postgres"),
            p.target.connection_string("postgres")
        )
    };
    std::fs::write(
        d.join("two.yml"),
        format!(
            "schema_version: 2\nenvironment: evaluation\nflows:\n{}{}",
            flow("orders", "public.orders"),
            flow("lines", "public.line_items")
        ),
    )
    .expect("config");
    // The orders flow cannot land its rows on this target.
    p.target
        .psql("ALTER TABLE public.orders ADD CONSTRAINT small CHECK (total < 5) NOT VALID");
    workload(&p.source, 1, 20);
    let out = trellara(d, &["run", "--config", "two.yml", "--local"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{major}: {err}");
    assert!(err.contains("flow orders"), "{major}: {err}");
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.line_items"),
        p.source
            .psql_value("SELECT count(*) FROM public.line_items"),
        "{major}: the lines flow went on"
    );
}

#[test]
fn the_public_loop_over_kafka_converges() {
    let Some(broker) = trellara_tests::Broker::start() else {
        return;
    };
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        let config = std::fs::read_to_string(d.join("trellara.yml")).expect("config");
        let topic = format!("trellara-shop-{}", major.number());
        let kafka = config.replace(
            "    kind: local\n",
            &format!(
                "    kind: kafka\n    brokers: {}\n    topic: {topic}\n",
                broker.bootstrap()
            ),
        );
        assert_ne!(kafka, config, "the transport section was rewritten");
        std::fs::write(d.join("trellara.yml"), kafka).expect("write");
        ok(
            &trellara(d, &["check", "--config", "trellara.yml"]),
            "check accepts kafka",
        );
        workload(&p.source, 1, 30);
        let first = ok(
            &trellara(
                d,
                &["run", "--config", "trellara.yml", "--local", "--verify"],
            ),
            "run",
        );
        assert!(
            first.contains("transport: kafka topic") && first.contains("shop CONVERGED"),
            "{major}: {first}"
        );
        // Streamed through the topic: more writes, applied from it.
        workload(&p.source, 31, 40);
        let out = trellara(
            d,
            &[
                "run",
                "--config",
                "trellara.yml",
                "--local",
                "--verify",
                "--format",
                "json",
            ],
        );
        let text = ok(&out, "second run");
        let v: serde_json::Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v[0]["result"], "CONVERGED", "{major}: {v}");
        assert_eq!(v[0]["transactions_applied"], 40, "{major}: {v}");
        assert_eq!(
            p.target.psql_value("SELECT count(*) FROM public.orders"),
            "70"
        );
    });
}

#[test]
fn schema_changes_apply_with_their_rows_or_hold_naming_the_fix() {
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        for side in [&p.source, &p.target] {
            side.psql("ALTER TABLE public.line_items ADD COLUMN sku varchar(8)");
        }
        workload(&p.source, 1, 5);
        ok(
            &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
            "run",
        );
        assert_eq!(
            p.target.psql_value(
                "SELECT count(*) FROM trellara.snapshot_tables WHERE flow = 'shop' AND fingerprint IS NOT NULL AND pinned_schema IS NOT NULL"
            ),
            "2",
            "{major}: the copy pinned both tables"
        );
        // DDL after the boundary, before any streamed row of the table: the
        // first row under it carries the change. The target already owns
        // `region` (a column of its own, same name and type).
        p.target
            .psql("ALTER TABLE public.orders ADD COLUMN region text");
        p.source.psql(
            "ALTER TABLE public.orders ADD COLUMN region text;
             ALTER TABLE public.orders ADD COLUMN status text DEFAULT 'new';
             ALTER TABLE public.line_items ALTER COLUMN qty TYPE bigint;
             ALTER TABLE public.line_items ALTER COLUMN sku TYPE varchar(32);
             BEGIN;
             INSERT INTO public.orders VALUES (100, 'c', 0, 'eu', 'paid');
             INSERT INTO public.line_items VALUES (100, 1, 1099511627776, 1, 'n', 'LONG-SKU-1234567890');
             COMMIT;",
        );
        let out = run_verify(d, "run under the changed schema");
        assert!(out.contains("CONVERGED"), "{major}: {out}");
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(id || ':' || coalesce(region, '-') || ':' || status, ',' ORDER BY id) FROM public.orders WHERE id IN (1, 100)"
            ),
            "1:-:new,100:eu:paid",
            "{major}: the rows before the column read the source's default"
        );
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(format_type(atttypid, atttypmod), ',' ORDER BY attname) FROM pg_attribute WHERE attrelid = 'public.line_items'::regclass AND attname IN ('qty', 'sku')"
            ),
            "bigint,character varying(32)",
            "{major}"
        );
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(table_name || ' ' || kind || ' ' || outcome, ',' ORDER BY table_name, kind) FROM trellara.schema_changes WHERE flow = 'shop'"
            ),
            "public.line_items increase_varchar applied,public.line_items widen_type applied,public.orders add_nullable_column already_present,public.orders add_nullable_column applied",
            "{major}: each sink acknowledged each change once"
        );
        // A rerun finds nothing to do again: the pins moved with the change.
        p.source
            .psql("INSERT INTO public.orders VALUES (101, 'c', 0, 'us', 'paid')");
        ok(
            &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
            "run after the change",
        );
        assert_eq!(
            p.target
                .psql_value("SELECT count(*) FROM trellara.schema_changes WHERE flow = 'shop'"),
            "4"
        );
        // Destructive changes are logged, and the sink holds the
        // transaction at them, naming the fix.
        p.source.psql(
            "ALTER TABLE public.orders DROP COLUMN region;
             ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7;
             INSERT INTO public.orders VALUES (102, 'c', 0, 'paid', 8);",
        );
        let out = trellara(d, &["run", "--config", "trellara.yml", "--local"]);
        let err = fails(&out, 1);
        assert!(
            err.contains("schema change on public.orders held")
                && err.contains("drop_column on public.orders.region: block"),
            "{major}: {err}"
        );
        assert!(
            err.contains(
                "`trellara schema accept --config trellara.yml --flow shop --table public.orders`"
            ),
            "{major}: {err}"
        );
        assert_eq!(
            p.target
                .psql_value("SELECT count(*) FROM public.orders WHERE id = 102"),
            "0",
            "{major}: no row under the new schema landed"
        );
        assert_eq!(
            p.target.psql_value(
                "SELECT held_table FROM trellara.quarantine WHERE flow = 'shop' AND resolved_at IS NULL"
            ),
            "public.orders",
            "{major}"
        );
        // Verify names the column the target lacks (not a query error),
        // and compares the rest.
        let (code, v, err) = verdict(d, &[]);
        let codes: Vec<&str> = v["divergences"]
            .as_array()
            .map(|d| d.iter().filter_map(|d| d["code"].as_str()).collect())
            .unwrap_or_default();
        assert!(
            code == Some(1) && codes.contains(&"COLUMN_MISSING"),
            "{major}:\n{v:#}\n{err}"
        );
        assert!(
            v["divergences"]
                .as_array()
                .is_some_and(|d| d.iter().any(|d| d["code"] == "COLUMN_MISSING"
                    && d["recovery"]
                        .as_str()
                        .is_some_and(|r| r.contains("schema accept")))),
            "{major}: a held change's recovery is its accept:\n{v:#}"
        );
        assert!(
            v["tables"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["table"] == "public.orders"
                    && t["missing_on_target"] == serde_json::json!(["code"]))),
            "{major}:\n{v:#}"
        );
        // Done on the target (its `region` kept as its own) and accepted,
        // the sink goes on from there.
        p.target
            .psql("ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7");
        p.target
            .psql("ALTER TABLE public.line_items ADD COLUMN local_note text");
        let out = ok(
            &trellara(
                d,
                &[
                    "schema",
                    "accept",
                    "--config",
                    "trellara.yml",
                    "--table",
                    "public.orders",
                ],
            ),
            "schema accept",
        );
        assert!(
            out.contains("accepted the held change on public.orders"),
            "{major}: {out}"
        );
        let out = run_verify(d, "run after the accept");
        assert!(out.contains("CONVERGED"), "{major}: {out}");
        assert!(
            out.contains("target column region was dropped on the source (drop_column at")
                && out.contains("target column local_note is not on the source, and no schema change of the flow explains it"),
            "{major}: {out}"
        );
        assert_eq!(
            p.target.psql_value(
                "SELECT count(*) FROM trellara.quarantine WHERE flow = 'shop' AND resolved_at IS NULL"
            ),
            "0",
            "{major}: the applied transaction resolved its record"
        );
        assert_eq!(
            p.target
                .psql_value("SELECT count(*) FROM public.orders WHERE id = 102"),
            "1",
            "{major}"
        );
    });
}

/// A change no sink applies on its own, under `run --follow`: capture
/// goes on (the slot follows the log past it, so the source keeps no WAL
/// for the sink) while the sink holds at it; `schema accept` refuses
/// until the target matches, then the sink goes on by itself.
#[test]
fn a_held_change_holds_its_sink_while_capture_goes_on_until_accepted() {
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        workload(&p.source, 1, 5);
        let log = std::fs::File::create(d.join("follow.log")).expect("log file");
        let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
            .current_dir(d)
            .args(["run", "--config", "trellara.yml", "--local", "--follow"])
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn run --follow");
        let wait_for = |sql: &str, want: &str| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            loop {
                let got = p.target.psql_value(sql);
                if got == want {
                    return;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{major}: {sql} is {got}, never {want}"
                );
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        };
        wait_for("SELECT count(*) FROM public.orders", "5");
        p.source.psql(
            "ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7;
             INSERT INTO public.orders VALUES (100, 'c', 0, 8);",
        );
        workload(&p.source, 200, 3);
        let after = p.source.psql_value("SELECT pg_current_wal_lsn()");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let confirmed = p.source.psql_value(&format!(
                "SELECT confirmed_flush_lsn >= '{after}' FROM pg_replication_slots WHERE slot_name = 'trellara_shop'"
            ));
            if confirmed == "t" {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{major}: the slot stayed below {after} behind the held sink"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        wait_for(
            "SELECT held_table FROM trellara.quarantine WHERE flow = 'shop' AND resolved_at IS NULL",
            "public.orders",
        );
        assert_eq!(
            p.target.psql_value("SELECT count(*) FROM public.orders"),
            "5",
            "{major}: nothing from the held transaction on"
        );
        let accept = [
            "schema",
            "accept",
            "--config",
            "trellara.yml",
            "--table",
            "public.orders",
        ];
        let err = fails(&trellara(d, &accept), 1);
        assert!(err.contains("missing column code"), "{major}: {err}");
        // A one-table copy would release the hold, but the target's table
        // cannot take the copy yet: refused before anything is emptied.
        let reseed = [
            "reseed",
            "--config",
            "trellara.yml",
            "--flow",
            "shop",
            "--table",
            "public.orders",
        ];
        let err = fails(&trellara(d, &reseed), 1);
        assert!(
            err.contains("cannot take the table's columns after it")
                && err.contains("missing column code")
                && err.contains("schema accept"),
            "{major}: {err}"
        );
        assert_eq!(
            p.target.psql_value("SELECT count(*) FROM public.orders"),
            "5",
            "{major}: nothing emptied"
        );
        p.target
            .psql("ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7");
        // The sink waits for the accept; it does not meet the change again
        // before.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !std::fs::read_to_string(d.join("follow.log"))
            .unwrap_or_default()
            .contains("the sink holds at a schema change until it is accepted")
        {
            assert!(std::time::Instant::now() < deadline, "{major}: never held");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        std::thread::sleep(std::time::Duration::from_secs(3));
        assert_eq!(
            p.target.psql_value(
                "SELECT attempts FROM trellara.quarantine WHERE flow = 'shop' AND resolved_at IS NULL"
            ),
            "1",
            "{major}: recorded once while held"
        );
        ok(&trellara(d, &accept), "schema accept");
        wait_for("SELECT count(*) FROM public.orders", "9");
        assert!(
            child.try_wait().expect("poll").is_none(),
            "{major}: the follower kept running"
        );
        let status = terminate(&mut child);
        let said = std::fs::read_to_string(d.join("follow.log")).unwrap_or_default();
        assert!(
            status.success(),
            "{major}: exit 0 on SIGTERM: {status}\n{said}"
        );
        assert!(
            said.contains("is quarantined: schema change on public.orders held")
                && said.contains("the sink holds at a schema change until it is accepted"),
            "{major}: {said}"
        );
        let out = ok(
            &trellara(d, &["verify", "--config", "trellara.yml"]),
            "verify",
        );
        assert!(out.contains("shop CONVERGED"), "{major}: {out}");
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(kind || ' ' || outcome, ',' ORDER BY kind) FROM trellara.schema_changes WHERE flow = 'shop'"
            ),
            "accepted already_present,add_not_null_column already_present",
            "{major}"
        );
    });
}

/// The other fix for a held change: the target's table made to take the
/// source's columns, `reseed --table` copies it at a boundary of its own
/// and releases the hold; the sink goes on from the held transaction, the
/// other tables' rows of it and after it applied once, the table's passed
/// (its copy holds them).
#[test]
fn a_held_change_is_released_by_a_one_table_reseed() {
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        workload(&p.source, 1, 5);
        let (mut child, _, stderr) = spawn_follower(d);
        let wait = waiter(major, &stderr);
        wait("copied", 60, &|| {
            p.target.psql_value("SELECT count(*) FROM public.orders") == "5"
        });
        // The held transaction touches another table too.
        p.source.psql(
            "BEGIN;
             ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7;
             INSERT INTO public.orders VALUES (100, 'c', 0, 8);
             INSERT INTO public.line_items VALUES (100, 1, 1, 1.00, 'held');
             COMMIT;",
        );
        workload(&p.source, 200, 3);
        wait("held", 60, &|| {
            p.target.psql_value(
                "SELECT count(*) FROM trellara.quarantine WHERE flow = 'shop' AND resolved_at IS NULL AND held_table = 'public.orders'",
            ) == "1"
        });
        p.target
            .psql("ALTER TABLE public.orders ADD COLUMN code int");
        let reseed = [
            "reseed",
            "--config",
            "trellara.yml",
            "--flow",
            "shop",
            "--table",
            "public.orders",
            "--format",
            "json",
        ];
        // Changed again on the source since the hold: the copy pins that
        // description, which the target must take too; refused in the
        // copy's transaction, which leaves the table as it was.
        p.source
            .psql("ALTER TABLE public.orders ALTER COLUMN total TYPE numeric(14,2)");
        let err = fails(&trellara(d, &reseed), 1);
        assert!(
            err.contains("column total is numeric(12,2) on the target"),
            "{major}: {err}"
        );
        assert_eq!(
            p.target.psql_value("SELECT count(*) FROM public.orders"),
            "5",
            "{major}: nothing emptied"
        );
        p.target
            .psql("ALTER TABLE public.orders ALTER COLUMN total TYPE numeric(14,2)");
        let out = ok(&trellara(d, &reseed), "reseed --table");
        let v: serde_json::Value = serde_json::from_str(&out).expect("json");
        assert_eq!(v[0]["rows"], 9, "{major}: {v}");
        assert_eq!(
            v[0]["released"].as_array().map(Vec::len),
            Some(1),
            "{major}: {v}"
        );
        wait("caught up", 60, &|| {
            p.target
                .psql_value("SELECT count(*) FROM public.line_items")
                == p.source
                    .psql_value("SELECT count(*) FROM public.line_items")
        });
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(id || ':' || code, ',' ORDER BY id) FROM public.orders"
            ),
            "1:7,2:7,3:7,4:7,5:7,100:8,200:7,201:7,202:7",
            "{major}: the copy's rows, none twice"
        );
        assert!(
            child.try_wait().expect("poll").is_none(),
            "{major}: the follower kept running"
        );
        // The table's own later changes apply under the new description.
        p.source
            .psql("UPDATE public.orders SET code = 9 WHERE id = 1");
        wait("applied after the copy", 60, &|| {
            p.target
                .psql_value("SELECT code FROM public.orders WHERE id = 1")
                == "9"
        });
        let out = ok(
            &trellara(d, &["verify", "--config", "trellara.yml"]),
            "verify",
        );
        assert!(out.contains("shop CONVERGED"), "{major}: {out}");
        assert_eq!(
            p.target.psql_value(
                "SELECT count(*) FROM trellara.quarantine WHERE flow = 'shop' AND resolved_at IS NULL"
            ),
            "0",
            "{major}"
        );
        terminate(&mut child);
    });
}

/// One transaction that changes a table twice, rows after each: each
/// description is held and accepted on its own; an acceptance of the
/// first does not pass the second.
#[test]
fn two_held_changes_of_one_table_in_one_transaction_are_accepted_each() {
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        workload(&p.source, 1, 2);
        let run = ["run", "--config", "trellara.yml", "--local"];
        ok(&trellara(d, &run), "first run");
        p.source.psql(
            "BEGIN;
             ALTER TABLE public.orders ADD COLUMN a int NOT NULL DEFAULT 1;
             INSERT INTO public.orders VALUES (100, 'c', 0, 5);
             ALTER TABLE public.orders ADD COLUMN b int NOT NULL DEFAULT 2;
             INSERT INTO public.orders VALUES (101, 'c', 0, 5, 6);
             COMMIT;",
        );
        let accept = [
            "schema",
            "accept",
            "--config",
            "trellara.yml",
            "--table",
            "public.orders",
        ];
        let err = fails(&trellara(d, &run), 1);
        assert!(err.contains("public.orders.a"), "{major}: {err}");
        p.target
            .psql("ALTER TABLE public.orders ADD COLUMN a int NOT NULL DEFAULT 1");
        ok(&trellara(d, &accept), "accept the first");
        let err = fails(&trellara(d, &run), 1);
        assert!(
            err.contains("public.orders.b") && err.contains("schema change on public.orders held"),
            "{major}: the second description holds on its own: {err}"
        );
        let err = fails(&trellara(d, &accept), 1);
        assert!(err.contains("missing column b"), "{major}: {err}");
        p.target
            .psql("ALTER TABLE public.orders ADD COLUMN b int NOT NULL DEFAULT 2");
        ok(&trellara(d, &accept), "accept the second");
        ok(&trellara(d, &run), "run past both");
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(id || ':' || a || ':' || b, ',' ORDER BY id) FROM public.orders WHERE id >= 100"
            ),
            "100:5:2,101:5:6",
            "{major}"
        );
        let out = ok(
            &trellara(d, &["verify", "--config", "trellara.yml"]),
            "verify",
        );
        assert!(out.contains("shop CONVERGED"), "{major}: {out}");
    });
}

/// A held column of a type of the source's own (an enum): `schema
/// accept` holds the target's column to that type by its qualified name.
#[test]
fn accept_holds_a_column_of_the_sources_own_type_to_its_name() {
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        workload(&p.source, 1, 2);
        let run = ["run", "--config", "trellara.yml", "--local"];
        ok(&trellara(d, &run), "first run");
        p.source.psql(
            "CREATE TYPE public.mood AS ENUM ('ok', 'bad');
             ALTER TABLE public.orders ADD COLUMN m public.mood NOT NULL DEFAULT 'ok';
             INSERT INTO public.orders VALUES (100, 'c', 0, 'bad');",
        );
        fails(&trellara(d, &run), 1);
        let accept = [
            "schema",
            "accept",
            "--config",
            "trellara.yml",
            "--table",
            "public.orders",
        ];
        p.target
            .psql("ALTER TABLE public.orders ADD COLUMN m text NOT NULL DEFAULT 'ok'");
        let err = fails(&trellara(d, &accept), 1);
        assert!(
            err.contains("column m is text on the target, not the source's public.mood"),
            "{major}: {err}"
        );
        p.target.psql(
            "CREATE TYPE public.mood AS ENUM ('ok', 'bad');
             ALTER TABLE public.orders DROP COLUMN m;
             ALTER TABLE public.orders ADD COLUMN m public.mood NOT NULL DEFAULT 'ok';",
        );
        ok(&trellara(d, &accept), "accept");
        ok(&trellara(d, &run), "run past the change");
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(id || ':' || m, ',' ORDER BY id) FROM public.orders"
            ),
            "1:ok,2:ok,100:bad",
            "{major}"
        );
    });
}

/// ADD COLUMN inside a transaction large enough to stream while it runs:
/// the change takes its place among the rows, its default reaches the
/// target's old rows though the catalog holds it only once the transaction
/// commits, and a later ADD and DROP rolled back by savepoints go back with
/// their rows.
#[test]
fn a_change_inside_a_large_streamed_transaction_applies_at_its_place() {
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        p.source
            .psql("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'");
        p.source.psql("SELECT pg_reload_conf()");
        workload(&p.source, 1, 5);
        ok(
            &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
            "run",
        );
        let lines = |from: i64| {
            format!(
                "INSERT INTO public.line_items SELECT {from} + i / 10, i % 10, 1, 1, repeat('x', 200) FROM generate_series(0, 1999) i;"
            )
        };
        p.source.psql(&format!(
            "BEGIN;
             {}
             INSERT INTO public.orders VALUES (10, 'before', 1);
             ALTER TABLE public.orders ADD COLUMN status text DEFAULT 'new';
             INSERT INTO public.orders VALUES (11, 'after', 1, 'paid');
             {}
             SAVEPOINT a;
             ALTER TABLE public.orders ADD COLUMN doomed int;
             INSERT INTO public.orders VALUES (12, 'doomed', 1, 'x', 1);
             {}
             ROLLBACK TO SAVEPOINT a;
             INSERT INTO public.orders VALUES (13, 'after a', 1, 'paid');
             SAVEPOINT b;
             ALTER TABLE public.orders DROP COLUMN total;
             INSERT INTO public.orders VALUES (14, 'dropped', 'x');
             {}
             ROLLBACK TO SAVEPOINT b;
             INSERT INTO public.orders VALUES (15, 'after b', 1, 'paid');
             COMMIT;",
            lines(1_000),
            lines(2_000),
            lines(3_000),
            lines(4_000)
        ));
        let out = run_verify(d, "run over the streamed transaction");
        assert!(out.contains("CONVERGED"), "{major}: {out}");
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(id || ':' || status, ',' ORDER BY id) FROM public.orders"
            ),
            "1:new,2:new,3:new,4:new,5:new,10:new,11:paid,13:paid,15:paid",
            "{major}"
        );
        assert_eq!(
            p.target
                .psql_value("SELECT count(*) FROM public.line_items WHERE order_id >= 1000"),
            "4000",
            "{major}: the rows of both rolled-back savepoints are gone"
        );
        assert_eq!(
            p.target.psql_value(
                "SELECT count(*) FROM pg_attribute WHERE attrelid = 'public.orders'::regclass AND attname IN ('doomed', 'total') AND NOT attisdropped"
            ),
            "1",
            "{major}: only total, never doomed"
        );
        assert_eq!(
            p.target
                .psql_value("SELECT count(*) FROM trellara.schema_changes WHERE flow = 'shop'"),
            "1",
            "{major}"
        );
    });
}

/// A follower meets ADD COLUMN ... DEFAULT inside a large transaction
/// while it is still open: its Relation message streams before the column
/// is committed, so the event is completed from the catalog at the
/// transaction's commit, and the target's old rows read the default.
#[test]
fn a_column_added_in_an_open_streamed_transaction_is_filled_at_its_commit() {
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        p.source
            .psql("ALTER SYSTEM SET logical_decoding_work_mem = '64kB'");
        p.source.psql("SELECT pg_reload_conf()");
        workload(&p.source, 1, 3);
        let (mut child, addr, stderr) = spawn_follower(d);
        let wait_until = waiter(major, &stderr);
        wait_until("ready", 60, &|| http_get(&addr, "/readyz").0 == 200);
        let mut open =
            postgres::Client::connect(&p.source.connection_string("postgres"), postgres::NoTls)
                .expect("source session");
        open.batch_execute(
            "BEGIN;
             INSERT INTO public.line_items SELECT 1000 + i / 10, i % 10, 1, 1, repeat('x', 200) FROM generate_series(0, 1999) i;
             ALTER TABLE public.orders ADD COLUMN status text DEFAULT 'new';
             INSERT INTO public.orders VALUES (11, 'after', 1, 'paid');
             INSERT INTO public.line_items SELECT 2000 + i / 10, i % 10, 1, 1, repeat('x', 200) FROM generate_series(0, 1999) i;",
        )
        .expect("open transaction");
        // The walsender streams it (past 64 kB) while it stays open.
        std::thread::sleep(std::time::Duration::from_secs(3));
        open.batch_execute("COMMIT").expect("commit");
        wait_until("the transaction applied", 60, &|| {
            p.target
                .psql_value("SELECT count(*) FROM public.orders WHERE id = 11")
                == "1"
        });
        stop_follower(&mut child, &stderr, major);
        assert_eq!(
            p.target.psql_value(
                "SELECT string_agg(id || ':' || status, ',' ORDER BY id) FROM public.orders"
            ),
            "1:new,2:new,3:new,11:paid",
            "{major}"
        );
        converged(d, major, &[]);
    });
}

#[test]
fn quarantine_repair_and_replay() {
    on_every_major(quarantine_repair_and_replay_on);
}

fn quarantine_repair_and_replay_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    ok(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        "run",
    );
    // The target refuses what the source accepts.
    p.target
        .psql("ALTER TABLE public.orders ADD CONSTRAINT small CHECK (total < 5) NOT VALID");
    workload(&p.source, 6, 3);
    let out = trellara(d, &["run", "--config", "trellara.yml", "--local"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("quarantined")
            && err.contains("small")
            && err.contains("trellara run --config"),
        "{err}"
    );
    let verify = trellara(d, &["verify", "--config", "trellara.yml"]);
    assert_eq!(verify.status.code(), Some(1), "diverged");
    assert!(String::from_utf8_lossy(&verify.stdout).contains("QUARANTINED"));
    let status = ok(
        &trellara(d, &["status", "--config", "trellara.yml"]),
        "status",
    );
    assert!(status.contains("quarantine  1 open"), "{status}");
    // Nothing of the quarantined transaction is visible, nothing after it applied.
    assert_eq!(
        p.target.psql_value("SELECT count(*) FROM public.orders"),
        "5"
    );
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.line_items WHERE order_id > 5"),
        "0"
    );

    p.target
        .psql("ALTER TABLE public.orders DROP CONSTRAINT small");
    let again = ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "replay",
    );
    assert!(again.contains("shop CONVERGED"), "{again}");
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM trellara.quarantine WHERE resolved_at IS NOT NULL"),
        "1"
    );
}

#[test]
fn verify_names_a_row_changed_behind_its_back() {
    on_every_major(verify_names_a_row_changed_behind_its_back_on);
}

fn verify_names_a_row_changed_behind_its_back_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 400);
    ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "run",
    );
    // In key-range chunks of 100 rows the whole-table sums agree too.
    let chunked = &[
        "verify",
        "--config",
        "trellara.yml",
        "--chunk-rows",
        "100",
        "--format",
        "json",
    ];
    let out = trellara(d, chunked);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(out.status.code(), Some(0), "{v}");
    // 400 orders and 1,000 line items: 100-row chunks plus the open tail.
    assert_eq!(v[0]["tables"][0]["chunks"], 5, "{v}");
    assert_eq!(v[0]["tables"][1]["chunks"], 11, "{v}");
    assert_eq!(v[0]["snapshot_state"], "verified", "{v}");

    // Lag is no evidence against the copy: the run stays verified.
    workload(&p.source, 401, 1);
    let out = trellara(
        d,
        &["verify", "--config", "trellara.yml", "--format", "json"],
    );
    assert_eq!(out.status.code(), Some(1), "behind is diverged");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let codes = |v: &serde_json::Value| -> Vec<String> {
        v[0]["divergences"]
            .as_array()
            .expect("divergences")
            .iter()
            .map(|d| d["code"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    assert!(codes(&v).contains(&"WATERMARK_BEHIND".to_owned()), "{v}");
    assert_eq!(v[0]["snapshot_state"], "verified", "{v}");
    ok(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        "catch up",
    );

    p.target
        .psql("UPDATE public.line_items SET qty = qty + 1 WHERE order_id = 321 AND line = 1");
    // One table's verdict moves no state and is no flow's last verify.
    let out = trellara(
        d,
        &[
            "verify",
            "--config",
            "trellara.yml",
            "--table",
            "public.orders",
            "--format",
            "json",
        ],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(out.status.code(), Some(0), "orders alone converge: {v}");
    assert_eq!(v[0]["only_table"], "public.orders", "{v}");
    assert_eq!(v[0]["snapshot_state"], "verified", "{v}");
    let out = trellara(
        d,
        &["verify", "--config", "trellara.yml", "--format", "json"],
    );
    assert_eq!(out.status.code(), Some(1), "diverged");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let divergences = v[0]["divergences"].as_array().expect("divergences");
    assert_eq!(divergences.len(), 1, "{v}");
    assert_eq!(divergences[0]["code"], "CHECKSUM_MISMATCH");
    assert_narrow_range_around_321(&v);
    assert_eq!(
        v[0]["snapshot_state"], "failed_recoverable",
        "verified was demoted on new evidence"
    );
    // Chunked, the same divergence is found and named.
    let out = trellara(d, chunked);
    assert_eq!(out.status.code(), Some(1), "diverged");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_narrow_range_around_321(&v);
}

#[test]
fn verify_counts_null_keys_and_orders_keys_alike_on_both_sides() {
    on_every_major(verify_counts_null_keys_and_orders_keys_alike_on);
}

/// A text key whose target column has another collation, a target that
/// allows NULL keys, in a LATIN1 database: verify in key-range chunks
/// neither counts a row twice nor misses one, and the same text hashes
/// alike in either encoding.
fn verify_counts_null_keys_and_orders_keys_alike_on(major: Major) {
    let Some(source) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(target) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    source.psql("CREATE TABLE public.tags (name text, n int, label text, PRIMARY KEY (name, n))");
    target.psql(
        "CREATE DATABASE latin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    );
    // ICU orders a B c D, the source's C collation B D a c. Without ICU
    // the orders agree and only the NULL key is tested.
    let icu =
        target.psql_value("SELECT count(*) FROM pg_collation WHERE collname = 'und-x-icu'") == "1";
    let collate = if icu { "COLLATE \"und-x-icu\"" } else { "" };
    let mut latin1 =
        postgres::Client::connect(&target.connection_string("latin1"), postgres::NoTls)
            .expect("connect latin1");
    // Neither NOT NULL nor an index on the target's key.
    latin1
        .batch_execute(&format!(
            "CREATE TABLE public.tags (name text {collate}, n int, label text)"
        ))
        .expect("target table");
    source.psql(
        "INSERT INTO public.tags SELECT v, ascii(v), 'café ' || v FROM unnest(ARRAY['a','B','c','D','e','F','g','H']) v",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    init_flow(
        d,
        &source.connection_string("postgres"),
        &target.connection_string("latin1"),
        &["public.tags"],
        "tags",
        "external",
    );
    let out = run_verify(d, "run");
    assert!(out.contains("tags CONVERGED"), "{major}: {out}");
    let chunked = [
        "verify",
        "--config",
        "trellara.yml",
        "--chunk-rows",
        "2",
        "--format",
        "json",
    ];
    let out = trellara(d, &chunked);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(out.status.code(), Some(0), "{major} (icu {icu}): {v}");
    assert_eq!(v[0]["tables"][0]["chunks"], 5, "{v}");

    // Stray rows with a NULL in the key, one wholly NULL and one whose
    // first column still compares within a key range: each counted once.
    latin1
        .batch_execute("INSERT INTO public.tags VALUES (NULL, NULL), ('zz', NULL)")
        .expect("stray rows");
    let out = trellara(d, &chunked);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(out.status.code(), Some(1), "{major}: {v}");
    assert_eq!(v[0]["divergences"][0]["code"], "ROW_COUNT_MISMATCH", "{v}");
    assert_eq!(v[0]["tables"][0]["target_rows"], 10, "{v}");
    assert_eq!(
        v[0]["tables"][0]["diverging_ranges"],
        serde_json::json!(["(name IS NULL OR n IS NULL)"]),
        "{v}"
    );

    // A target table that lacks a column is COLUMN_MISSING, not a query
    // error; no quarantine holds it, so no accept is offered, and the
    // columns both have are still compared.
    latin1
        .batch_execute(
            "DELETE FROM public.tags WHERE n IS NULL; ALTER TABLE public.tags DROP COLUMN label",
        )
        .expect("drop column");
    let out = trellara(
        d,
        &["verify", "--config", "trellara.yml", "--format", "json"],
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(out.status.code(), Some(1), "{major}: {v}");
    let missing = &v[0]["divergences"][0];
    assert_eq!(missing["code"], "COLUMN_MISSING", "{v}");
    assert!(
        missing["detail"]
            .as_str()
            .is_some_and(|d| d.contains("no column label") && d.contains("has not met yet"))
            && missing["recovery"]
                .as_str()
                .is_some_and(|r| !r.contains("schema accept")),
        "{v}"
    );
    // (The diverged verify above left the run failed_recoverable.)
    let table = &v[0]["tables"][0];
    assert!(
        table["source_rows"] == 8 && table["source_checksum"] == table["target_checksum"],
        "{v}"
    );
    assert_eq!(
        v[0]["tables"][0]["missing_on_target"],
        serde_json::json!(["label"]),
        "{v}"
    );
}

#[test]
fn a_partitioned_table_replicates_and_verifies_through_its_root() {
    on_every_major(a_partitioned_table_replicates_and_verifies_through_its_root_on);
}

/// A partitioned table holds no rows itself: the snapshot copies its
/// partitions' rows, its changes are published under its own name, and
/// verify sums its partitions. Native capture refuses it by name.
fn a_partitioned_table_replicates_and_verifies_through_its_root_on(major: Major) {
    const EVENTS: &str = "
        CREATE TABLE public.events (id bigint NOT NULL, region text NOT NULL, amount int NOT NULL,
                                    PRIMARY KEY (id, region)) PARTITION BY LIST (region);
        CREATE TABLE public.events_eu PARTITION OF public.events FOR VALUES IN ('eu');
        CREATE TABLE public.events_us PARTITION OF public.events FOR VALUES IN ('us');";
    let Some(source) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(target) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    source.psql(EVENTS);
    target.psql(EVENTS);
    let insert = |from: i64, to: i64| {
        source.psql(&format!(
            "INSERT INTO public.events SELECT i, CASE WHEN i % 2 = 0 THEN 'eu' ELSE 'us' END, i FROM generate_series({from}, {to}) i"
        ));
    };
    insert(1, 100);
    let (s_url, t_url) = (
        source.connection_string("postgres"),
        target.connection_string("postgres"),
    );
    let init = |dir: &Path, capture: &str| {
        init_flow(dir, &s_url, &t_url, &["public.events"], "events", capture);
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    init(d, "external");
    let run = || run_verify(d, "run");
    let out = run();
    assert!(out.contains("events CONVERGED"), "{major}: {out}");
    assert_eq!(
        target.psql_value("SELECT count(*) FROM public.events"),
        "100"
    );
    // Streamed changes, one moving a row to the other partition.
    insert(101, 150);
    source.psql(
        "UPDATE public.events SET amount = -amount WHERE id <= 10;
         UPDATE public.events SET region = 'us' WHERE id = 20;
         DELETE FROM public.events WHERE id BETWEEN 30 AND 34",
    );
    let out = run();
    assert!(out.contains("events CONVERGED"), "{major}: {out}");
    assert_eq!(
        target.psql_value("SELECT count(*) || ' ' || sum(amount) || ' ' || count(*) FILTER (WHERE region = 'us') FROM public.events"),
        source.psql_value("SELECT count(*) || ' ' || sum(amount) || ' ' || count(*) FILTER (WHERE region = 'us') FROM public.events"),
    );
    target.psql("UPDATE public.events_us SET amount = amount + 1 WHERE id = 7");
    let out = trellara(d, &["verify", "--config", "trellara.yml"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{major}: {text}");
    assert!(text.contains("CHECKSUM_MISMATCH"), "{major}: {text}");

    let native = tempfile::tempdir().expect("tempdir");
    init(native.path(), "native");
    let err = fails(
        &trellara(
            native.path(),
            &["run", "--config", "trellara.yml", "--local"],
        ),
        3,
    );
    assert!(
        err.contains("table public.events is partitioned") && err.contains("capture: external"),
        "{err}"
    );
}

#[test]
fn a_table_joins_the_flow_at_its_own_boundary_and_leaves_it() {
    on_every_major(a_table_joins_and_leaves_on);
}

/// A table added to the config after the snapshot joins at a boundary of
/// its own: the next run brings the publication up to it, copies it in a
/// temporary slot's snapshot (emptying what the target had), and skips
/// its streamed changes that the copy already holds. Here one such change
/// commits after the publication change and before the boundary (a
/// transaction that was open when the join began holds the boundary
/// back): applied twice, its insert would collide with the copy. Removed
/// from the config, the table leaves: out of the publication, its rows on
/// the target kept, no longer compared.
fn a_table_joins_and_leaves_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    let run = |args: &[&str]| trellara(d, args);
    ok(
        &run(&["run", "--config", "trellara.yml", "--local"]),
        "first run",
    );
    for c in [&p.source, &p.target] {
        c.psql("CREATE TABLE public.extra (id int PRIMARY KEY, v text)");
    }
    p.target
        .psql("INSERT INTO public.extra VALUES (99, 'stale')");
    p.source
        .psql("INSERT INTO public.extra SELECT i, 'v' || i FROM generate_series(1, 7) i");
    let config = d.join("trellara.yml");
    let text = std::fs::read_to_string(&config).expect("config");
    let with_extra = text.replace(
        "  - public.line_items\n",
        "  - public.line_items\n  - public.extra\n",
    );
    assert_ne!(with_extra, text, "the config lists public.line_items");
    std::fs::write(&config, &with_extra).expect("add a table");
    // Open across the join's start, so the boundary waits for it.
    let mut open = p.source.try_connect("postgres").expect("connect");
    open.batch_execute("BEGIN; INSERT INTO public.extra VALUES (100, 'open')")
        .expect("open transaction");
    let child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["run", "--config", "trellara.yml", "--local", "--verify"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    wait_until("the join's temporary slot", 60, &|| {
        p.source.psql_value(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'trellara\\_join\\_%' AND temporary",
        ) == "1"
    });
    assert_eq!(
        p.source.psql_value(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'trellara_shop' AND tablename = 'extra'"
        ),
        "1",
        "the publication holds the table before its boundary"
    );
    // After the publication change, before the boundary: in the copy and
    // in the stream.
    p.source
        .psql("INSERT INTO public.extra VALUES (101, 'between'); UPDATE public.extra SET v = 'u' WHERE id = 2");
    open.batch_execute("COMMIT").expect("commit");
    let out = child.wait_with_output().expect("run ends");
    let stdout = ok(&out, "the run the table joins");
    assert!(
        stdout.contains("public.extra joined the flow at") && stdout.contains("shop CONVERGED"),
        "{stdout}"
    );
    assert_eq!(
        p.target.psql_value(
            "SELECT count(*) || ' ' || min(id) || ' ' || max(id) || ' ' || (SELECT v FROM public.extra WHERE id = 2) FROM public.extra"
        ),
        "9 1 101 u",
        "the copy replaced the target's rows, each change once"
    );
    assert_eq!(
        p.source.psql_value(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'trellara\\_join\\_%'"
        ),
        "0",
        "no join slot left"
    );
    // Streamed from now on.
    p.source.psql(
        "INSERT INTO public.extra VALUES (8, 'v8'); UPDATE public.extra SET v = 'w' WHERE id = 1",
    );
    let out = ok(
        &run(&["run", "--config", "trellara.yml", "--local", "--verify"]),
        "run after the join",
    );
    assert!(out.contains("shop CONVERGED"), "{out}");
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) || ' ' || max(v) FROM public.extra"),
        "10 w"
    );

    // It leaves: the flow no longer applies, streams or compares it, not
    // even what it wrote before the run that lets it go.
    std::fs::write(&config, &text).expect("remove the table");
    p.source
        .psql("INSERT INTO public.extra VALUES (200, 'before it left')");
    let out = ok(
        &run(&["run", "--config", "trellara.yml", "--local", "--verify"]),
        "run the table leaves",
    );
    assert!(
        out.contains("public.extra left the flow: removed from publication trellara_shop")
            && out.contains("shop CONVERGED"),
        "{out}"
    );
    p.source
        .psql("INSERT INTO public.extra VALUES (201, 'after')");
    workload(&p.source, 300, 2);
    let out = ok(
        &run(&["run", "--config", "trellara.yml", "--local", "--verify"]),
        "run after the table left",
    );
    assert!(out.contains("shop CONVERGED"), "{out}");
    assert_eq!(
        p.target.psql_value("SELECT count(*) FROM public.extra"),
        "10",
        "its rows stay, and what it wrote after leaving is not applied"
    );
    assert_eq!(
        p.target.psql_value("SELECT count(*) FROM public.orders"),
        "7"
    );
}

#[test]
fn tables_join_and_leave_a_following_flow_on_sighup() {
    on_every_major(tables_join_and_leave_on_sighup_on);
}

/// SIGHUP with a table added: the follower's round ends, the next copies
/// the table at its own boundary and streams it; with a table that fails
/// the first run's checks, the change is refused and the flow goes on as
/// it was; with the table removed, it leaves. The process never stops.
fn tables_join_and_leave_on_sighup_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 3);
    let (mut child, addr, stderr) = spawn_follower(d);
    wait_until("ready", 60, &|| http_get(&addr, "/readyz").0 == 200);
    for c in [&p.source, &p.target] {
        c.psql("CREATE TABLE public.extra (id int PRIMARY KEY, v text); CREATE TABLE public.nokey (v text)");
    }
    p.source
        .psql("INSERT INTO public.extra SELECT i, 'v' || i FROM generate_series(1, 5) i");
    let config = d.join("trellara.yml");
    let text = std::fs::read_to_string(&config).expect("config");
    let listed = |extra: &str| {
        text.replace(
            "  - public.line_items\n",
            &format!("  - public.line_items\n{extra}"),
        )
    };
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let hangup = || nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("sighup");
    let said = |what: &str| stderr.lock().unwrap().contains(what);
    let wait_until = waiter(major, &stderr);

    // A table without a key: refused by the first run's checks, undone.
    std::fs::write(&config, listed("  - public.nokey\n")).expect("config");
    hangup();
    wait_until("the keyless table refused", 60, &|| {
        said("reload: refused, the flow goes on")
    });
    workload(&p.source, 100, 2);
    wait_until("applied as before", 60, &|| {
        p.target.psql_value("SELECT count(*) FROM public.orders") == "5"
    });

    std::fs::write(&config, listed("  - public.extra\n")).expect("config");
    hangup();
    wait_until("the table joined", 60, &|| {
        said("public.extra joined the flow at")
    });
    p.source.psql(
        "INSERT INTO public.extra VALUES (6, 'v6'); UPDATE public.extra SET v = 'w' WHERE id = 1",
    );
    wait_until("its changes streamed", 60, &|| {
        p.target
            .psql_value("SELECT count(*) || ' ' || max(v) FROM public.extra")
            == "6 w"
    });

    std::fs::write(&config, &text).expect("config");
    hangup();
    wait_until("the table left", 60, &|| said("public.extra left the flow"));
    p.source
        .psql("INSERT INTO public.extra VALUES (7, 'after')");
    workload(&p.source, 200, 1);
    wait_until("the flow goes on", 60, &|| {
        p.target.psql_value("SELECT count(*) FROM public.orders") == "6"
    });
    assert_eq!(
        p.target.psql_value("SELECT count(*) FROM public.extra"),
        "6"
    );
    assert!(
        child.try_wait().expect("poll").is_none(),
        "SIGHUP never stops the process"
    );
    stop_follower(&mut child, &stderr, major);
}

#[test]
fn a_transaction_open_across_a_table_join_loses_nothing() {
    on_every_major(a_transaction_open_across_a_table_join_loses_nothing_on);
}

/// The upstream bug fixed in PostgreSQL 15.13, 16.9 and 17.5 ("changes
/// lost around ALTER PUBLICATION"): a walsender decoding a transaction that
/// touched a table before the table joined the publication, and again
/// after, caches the table as unpublished and went on skipping its changes
/// in later transactions too. A table joining on SIGHUP meets exactly that:
/// a source transaction open across the join, writing the table on both
/// sides of the `ALTER PUBLICATION`. Its rows must reach the target (the
/// copy at the boundary holds them), and so must every later change.
fn a_transaction_open_across_a_table_join_loses_nothing_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 3);
    let (mut child, addr, stderr) = spawn_follower(d);
    let wait_until = waiter(major, &stderr);
    wait_until("ready", 60, &|| http_get(&addr, "/readyz").0 == 200);
    for c in [&p.source, &p.target] {
        c.psql("CREATE TABLE public.extra (id int PRIMARY KEY, v text)");
    }
    p.source
        .psql("INSERT INTO public.extra SELECT i, 'v' || i FROM generate_series(1, 5) i");
    let mut open =
        postgres::Client::connect(&p.source.connection_string("postgres"), postgres::NoTls)
            .expect("source session");
    open.batch_execute("BEGIN; INSERT INTO public.extra VALUES (100, 'before the join')")
        .expect("open transaction");

    let config = d.join("trellara.yml");
    let text = std::fs::read_to_string(&config).expect("config");
    std::fs::write(
        &config,
        text.replace(
            "  - public.line_items\n",
            "  - public.line_items\n  - public.extra\n",
        ),
    )
    .expect("config");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("sighup");
    wait_until("the table published", 60, &|| {
        p.source.psql_value(
            "SELECT count(*) FROM pg_publication_tables WHERE schemaname = 'public' AND tablename = 'extra'",
        ) == "1"
    });
    // The boundary's snapshot waits for this transaction; it writes the
    // table again after the publication change committed, then ends.
    open.batch_execute("INSERT INTO public.extra VALUES (101, 'after the join'); COMMIT")
        .expect("commit the open transaction");
    wait_until("the table joined", 60, &|| {
        stderr
            .lock()
            .unwrap()
            .contains("public.extra joined the flow at")
    });
    p.source.psql(
        "INSERT INTO public.extra VALUES (6, 'v6'); UPDATE public.extra SET v = 'w' WHERE id = 1",
    );
    workload(&p.source, 100, 1);
    wait_until("every change to the joined table applied", 60, &|| {
        p.target
            .psql_value("SELECT count(*) || ' ' || min(v) FROM public.extra")
            == "8 after the join"
            && p.target
                .psql_value("SELECT v FROM public.extra WHERE id = 1")
                == "w"
    });
    stop_follower(&mut child, &stderr, major);
    assert!(
        run_verify(d, "verify").contains("CONVERGED"),
        "{major}: the flow converges after the join"
    );
}

#[test]
fn truncates_apply_with_their_own_restart_identity() {
    on_every_major(truncates_apply_with_their_own_restart_identity_on);
}

/// Two TRUNCATEs applied in one target transaction, one with RESTART
/// IDENTITY: only that one's table has its sequence reset.
fn truncates_apply_with_their_own_restart_identity_on(major: Major) {
    let Some(source) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(target) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    for c in [&source, &target] {
        c.psql(
            "CREATE TABLE public.a (id serial PRIMARY KEY, v int);
             CREATE TABLE public.b (id serial PRIMARY KEY, v int);",
        );
    }
    source.psql("INSERT INTO public.a (v) SELECT generate_series(1, 3); INSERT INTO public.b (v) SELECT generate_series(1, 3)");
    // The target's own sequences, far from where a reset would put them.
    target.psql("SELECT setval('public.a_id_seq', 100), setval('public.b_id_seq', 100)");
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    init_flow(
        d,
        &source.connection_string("postgres"),
        &target.connection_string("postgres"),
        &["public.a", "public.b"],
        "ab",
        "external",
    );
    let run = || run_verify(d, "run");
    assert!(run().contains("ab CONVERGED"));
    // One source transaction: its two TRUNCATE messages meet in one batch.
    source.psql("BEGIN; TRUNCATE public.a; TRUNCATE public.b RESTART IDENTITY; COMMIT");
    assert!(run().contains("ab CONVERGED"));
    assert_eq!(
        target.psql_value(
            "SELECT (SELECT count(*) FROM public.a) + (SELECT count(*) FROM public.b) || ' '
                    || (SELECT last_value FROM public.a_id_seq) || ' ' || (SELECT last_value FROM public.b_id_seq)"
        ),
        "0 100 1",
        "{major}: a keeps its sequence, b's restarts"
    );
}

#[test]
fn wide_values_arrive_byte_for_byte() {
    on_every_major(wide_values_arrive_byte_for_byte_on);
}

/// Values of megabytes go to the target in pieces (COPY): every escaped
/// character and every multi-byte one may fall on a piece's edge, and the
/// target must still read what the source holds, in a transaction of one
/// row, in one of several with an update between them, and beside NULL.
fn wide_values_arrive_byte_for_byte_on(major: Major) {
    let Some(source) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(target) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    for c in [&source, &target] {
        c.psql("CREATE TABLE public.w (id int PRIMARY KEY, v text, n int)");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    init_flow(
        d,
        &source.connection_string("postgres"),
        &target.connection_string("postgres"),
        &["public.w"],
        "wide",
        "external",
    );
    assert!(run_verify(d, "snapshot").contains("wide CONVERGED"));
    // 13 bytes a repeat: the 256 KiB piece edges fall on every offset of
    // it, inside the two- and three-byte characters too.
    let wide = |n: i32| format!(r"repeat(E'a\tb\\c\nd\rü€', {n})");
    source.psql(&format!(
        "ALTER TABLE public.w ALTER COLUMN v SET STORAGE EXTERNAL;
         INSERT INTO public.w VALUES (1, {}, 1);
         BEGIN;
         INSERT INTO public.w VALUES (2, {}, 2), (3, NULL, 3), (4, {}, 4);
         UPDATE public.w SET v = v || 'tail', n = 10 WHERE id = 1;
         INSERT INTO public.w VALUES (5, 'small', 5);
         COMMIT;",
        wide(200_000),
        wide(150_001),
        wide(40_000)
    ));
    assert!(run_verify(d, "wide values").contains("wide CONVERGED"));
    let digest = "SELECT string_agg(id || ':' || coalesce(md5(v), 'null') || ':' || coalesce(length(v), 0) || ':' || n, ',' ORDER BY id) FROM public.w";
    let on_source = source.psql_value(digest);
    assert!(
        on_source.starts_with("1:") && on_source.contains(":2000004:10,"),
        "{major}: {on_source}"
    );
    assert_eq!(target.psql_value(digest), on_source, "{major}");
}

#[test]
fn tables_linked_by_foreign_keys_are_copied_referenced_first() {
    on_every_major(tables_linked_by_foreign_keys_on);
}

/// The snapshot empties the flow's tables together and copies a table
/// after the tables it references, whatever the config's order; a table
/// outside the flow that references one is named with the fix.
fn tables_linked_by_foreign_keys_on(major: Major) {
    const SHOP: &str = "
        CREATE TABLE public.customers (id int PRIMARY KEY, name text NOT NULL);
        CREATE TABLE public.orders (id int PRIMARY KEY, customer_id int NOT NULL REFERENCES public.customers);";
    let Some(source) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(target) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    source.psql(SHOP);
    target.psql(SHOP);
    source.psql(
        "INSERT INTO public.customers SELECT i, 'c' || i FROM generate_series(1, 20) i;
         INSERT INTO public.orders SELECT i, 1 + i % 20 FROM generate_series(1, 50) i;",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    init_flow(
        d,
        &source.connection_string("postgres"),
        &target.connection_string("postgres"),
        &["public.orders", "public.customers"],
        "fk",
        "external",
    );
    let out = run_verify(d, "first run");
    assert!(out.contains("fk CONVERGED"), "{major}: {out}");
    // Copied again over the rows already there.
    source.psql("INSERT INTO public.customers VALUES (21, 'c21'); INSERT INTO public.orders VALUES (51, 21)");
    let out = ok(
        &trellara(d, &["reseed", "--config", "trellara.yml", "--verify"]),
        "reseed",
    );
    assert!(out.contains("fk CONVERGED"), "{major}: {out}");
    assert_eq!(
        target.psql_value("SELECT count(*) FROM public.orders"),
        "51"
    );

    target.psql("CREATE TABLE public.audit (customer_id int REFERENCES public.customers)");
    let err = fails(&trellara(d, &["reseed", "--config", "trellara.yml"]), 1);
    assert!(
        err.contains("referenced on the target by public.audit") && err.contains("DROP CONSTRAINT"),
        "{major}: {err}"
    );
}

#[test]
fn a_publication_the_operator_named_must_cover_the_flow() {
    on_every_major(a_publication_the_operator_named_on);
}

/// `source.publication` names the operator's own publication: one that
/// leaves a table or a kind of change out is refused with the ALTER that
/// fixes it, never altered behind the operator's back.
fn a_publication_the_operator_named_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    p.source.psql(
        "CREATE PUBLICATION shop_pub FOR TABLE public.orders WITH (publish = 'insert, update')",
    );
    let config = d.join("trellara.yml");
    let text = std::fs::read_to_string(&config).expect("config");
    let (head, tail) = text.split_once("  source:\n").expect("source section");
    std::fs::write(
        &config,
        format!("{head}  source:\n    publication: shop_pub\n{tail}"),
    )
    .expect("name the publication");
    workload(&p.source, 1, 5);
    let err = fails(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        1,
    );
    assert!(
        err.contains("publication shop_pub on the source does not stream all the flow copies")
            && err.contains("ALTER PUBLICATION shop_pub ADD TABLE \"public\".\"line_items\"")
            && err.contains("publish = 'insert, update, delete, truncate'"),
        "{major}: {err}"
    );
    assert_eq!(
        p.source
            .psql_value("SELECT count(*) FROM pg_publication_tables WHERE pubname = 'shop_pub'"),
        "1",
        "left as the operator made it"
    );
    // A column list leaves out what the copy has.
    p.source.psql(
        "ALTER PUBLICATION shop_pub ADD TABLE public.line_items (order_id, line, qty, price);
         ALTER PUBLICATION shop_pub SET (publish = 'insert, update, delete, truncate')",
    );
    let err = fails(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        1,
    );
    assert!(
        err.contains("filters the rows or columns of public.line_items"),
        "{major}: {err}"
    );
    p.source
        .psql("ALTER PUBLICATION shop_pub SET TABLE public.orders, public.line_items");
    // A slot of the flow's name on another database is another flow's.
    p.source.psql("CREATE DATABASE other");
    let mut other =
        postgres::Client::connect(&p.source.connection_string("other"), postgres::NoTls)
            .expect("connect other");
    other
        .batch_execute("SELECT pg_create_logical_replication_slot('trellara_shop', 'pgoutput')")
        .expect("slot on other");
    let err = fails(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        1,
    );
    assert!(
        err.contains("belongs to database other") && err.contains("source.slot"),
        "{major}: {err}"
    );
    assert_eq!(
        p.source.psql_value(
            "SELECT database FROM pg_replication_slots WHERE slot_name = 'trellara_shop'"
        ),
        "other",
        "not dropped"
    );
    other
        .batch_execute("SELECT pg_drop_replication_slot('trellara_shop')")
        .expect("drop");
    let out = run_verify(d, "run once the publication covers the flow");
    assert!(out.contains("shop CONVERGED"), "{major}: {out}");
}

#[test]
fn a_commit_refused_by_a_deferred_constraint_is_quarantined_cleanly() {
    on_every_major(a_commit_refused_by_a_deferred_constraint_on);
}

/// The target refuses a transaction only at its COMMIT (a deferred foreign
/// key the source lacks), while the next transaction's BEGIN and lock went
/// out behind it: the quarantine record still lands outside any
/// transaction, and after the repair the replay applies it once.
fn a_commit_refused_by_a_deferred_constraint_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 3);
    let run = || {
        trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        )
    };
    let out = run();
    assert!(String::from_utf8_lossy(&out.stdout).contains("shop CONVERGED"));
    p.target.psql(
        "ALTER TABLE public.line_items ADD CONSTRAINT lines_need_orders FOREIGN KEY (order_id)
         REFERENCES public.orders DEFERRABLE INITIALLY DEFERRED",
    );
    // A line item whose order the source never had.
    p.source
        .psql("INSERT INTO public.line_items VALUES (999, 1, 1, 1.00, 'orphan')");
    workload(&p.source, 10, 2);
    let err = fails(&run(), 1);
    assert!(
        err.contains("quarantined") && err.contains("lines_need_orders"),
        "{major}: {err}"
    );
    assert_eq!(
        p.target.psql_value(
            "SELECT count(*) FROM trellara.quarantine WHERE flow = 'shop' AND resolved_at IS NULL"
        ),
        "1",
        "the record committed although the failed COMMIT had the next BEGIN behind it"
    );
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.line_items WHERE order_id = 999"),
        "0"
    );
    p.target
        .psql("ALTER TABLE public.line_items DROP CONSTRAINT lines_need_orders");
    let out = run();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("shop CONVERGED"),
        "{major}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.line_items WHERE order_id = 999"),
        "1"
    );
}

#[test]
fn a_verdict_moves_only_the_run_it_checked() {
    on_every_major(a_verdict_moves_only_the_run_it_checked_on);
}

/// Verify reads the snapshot run before it compares anything; a run
/// re-planned meanwhile (a reseed) is not the one its verdict promotes.
fn a_verdict_moves_only_the_run_it_checked_on(major: Major) {
    use trellara_relay::{snapshot, state::SnapshotState};
    let Some(p) = pair(major) else {
        return;
    };
    workload(&p.source, 1, 5);
    ok(
        &trellara(
            p.dir.path(),
            &["run", "--config", "trellara.yml", "--local"],
        ),
        "run",
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let target = trellara_relay::flow::connect(&p.target.connection_string("postgres"), "target")
            .await
            .expect("connect");
        let seen = snapshot::load(&target, "shop")
            .await
            .expect("load")
            .expect("a run");
        assert_eq!(seen.state, SnapshotState::StreamHandoffReady);
        // Another process re-plans the run between the load and the verdict.
        target
            .batch_execute("UPDATE trellara.snapshot_runs SET run_id = run_id + 1, state = 'planned' WHERE flow = 'shop'")
            .await
            .expect("re-plan");
        let moved = snapshot::transition_from(&target, "shop", &seen, SnapshotState::Verified, None)
            .await
            .expect("transition");
        assert!(!moved, "the verdict of the old run moved the new one");
        let now = snapshot::load(&target, "shop").await.expect("load").expect("run");
        assert_eq!(now.state, SnapshotState::Planned);
        // The run as it now is moves.
        target
            .batch_execute("UPDATE trellara.snapshot_runs SET state = 'stream_handoff_ready' WHERE flow = 'shop'")
            .await
            .expect("back");
        let now = snapshot::load(&target, "shop").await.expect("load").expect("run");
        assert!(
            snapshot::transition_from(&target, "shop", &now, SnapshotState::Verified, None)
                .await
                .expect("transition")
        );
    });
}

/// The one diverging range of line_items brackets order 321 narrowly.
fn assert_narrow_range_around_321(v: &serde_json::Value) {
    let ranges = v[0]["tables"][1]["diverging_ranges"]
        .as_array()
        .expect("ranges");
    assert_eq!(ranges.len(), 1, "narrowed to one key range: {ranges:?}");
    let range = ranges[0].as_str().expect("text");
    let lo: i64 = range
        .split("ROW('")
        .nth(1)
        .and_then(|s| s.split('\'').next())
        .and_then(|s| s.parse().ok())
        .expect("lower key");
    let hi: i64 = range
        .split("ROW('")
        .nth(2)
        .and_then(|s| s.split('\'').next())
        .and_then(|s| s.parse().ok())
        .expect("upper key");
    assert!(lo <= 321 && 321 <= hi && hi - lo < 20, "{range}");
}

#[test]
fn redelivery_after_commit_before_cursor_is_skipped_and_counted() {
    on_every_major(redelivery_after_commit_before_cursor_is_skipped_and_counted_on);
}

fn redelivery_after_commit_before_cursor_is_skipped_and_counted_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    ok(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        "run",
    );
    workload(&p.source, 6, 20);
    ok(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        "run",
    );
    // The state a crash leaves between the target commit and the cursor
    // move: the target has everything, the cursor says nothing was applied.
    let log_dir = d.join(".trellara/trellara/shop/log");
    {
        let (log, _) = trellara_relay::log::Log::open(
            trellara_relay::log::storage::FsStorage::new(),
            &log_dir,
            trellara_relay::log::LogConfig::default(),
        )
        .expect("open log");
        log.commit_cursor(
            &trellara_relay::apply::cursor_name("shop"),
            trellara_relay::log::CursorPosition::start_at(log.first_offset()),
        )
        .expect("rewind");
    }
    let out = ok(
        &trellara(
            d,
            &[
                "run",
                "--config",
                "trellara.yml",
                "--local",
                "--verify",
                "--format",
                "json",
            ],
        ),
        "rerun",
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v[0]["result"], "CONVERGED", "{out}");
    assert_eq!(
        v[0]["duplicates_skipped"], 20,
        "every redelivered transaction skipped and counted"
    );
    assert_eq!(
        p.target.psql_value("SELECT count(*) FROM public.orders"),
        "25"
    );
}

#[test]
fn writes_during_the_snapshot_leave_no_gap_and_no_duplicate() {
    on_every_major(writes_during_the_snapshot_leave_no_gap_and_no_duplicate_on);
}

fn writes_during_the_snapshot_leave_no_gap_and_no_duplicate_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 300);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = Arc::clone(&stop);
        let url = p.source.connection_string("postgres");
        std::thread::spawn(move || {
            let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("writer");
            let mut id = 10_000i64;
            while !stop.load(Ordering::Relaxed) {
                c.execute("INSERT INTO public.orders VALUES ($1, 'live', 0)", &[&id])
                    .expect("insert");
                id += 1;
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            id - 10_000
        })
    };
    let first = trellara(d, &["run", "--config", "trellara.yml", "--local"]);
    stop.store(true, Ordering::Relaxed);
    let written = writer.join().expect("writer");
    ok(&first, "run during writes");
    assert!(written > 0);
    let out = ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "catch up",
    );
    assert!(out.contains("shop CONVERGED"), "{out}");
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.orders WHERE customer = 'live'"),
        written.to_string()
    );
}

#[test]
fn kill_9_mid_apply_shows_none_of_the_transaction_then_converges() {
    on_every_major(kill_9_mid_apply_shows_none_of_the_transaction_then_converges_on);
}

fn kill_9_mid_apply_shows_none_of_the_transaction_then_converges_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 3);
    ok(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        "run",
    );
    // One large source transaction: its apply takes a while.
    p.source.psql("INSERT INTO public.line_items SELECT 1000000 + g, 1, 1, 1, 'big' FROM generate_series(1, 400000) g");
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["run", "--config", "trellara.yml", "--local"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn run");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        // The applier's target transaction is open and has written rows.
        let busy = p.target.psql_value(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = 'postgres' AND state IN ('active', 'idle in transaction') AND (query LIKE 'INSERT INTO \"public\".\"line_items\"%' OR query LIKE 'COPY \"public\".\"line_items\"%')",
        );
        if busy != "0" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the apply never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    child.wait().expect("reap");
    // The target shows none of the interrupted transaction.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while p
        .target
        .psql_value("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction'")
        != "0"
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the killed session's transaction never ended"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.line_items WHERE note = 'big'"),
        "0"
    );
    let out = ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "rerun",
    );
    assert!(out.contains("shop CONVERGED"), "{out}");
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.line_items WHERE note = 'big'"),
        "400000"
    );
}

#[test]
fn reseed_repair_plan_and_locate_local() {
    on_every_major(reseed_repair_plan_and_locate_local_on);
}

fn reseed_repair_plan_and_locate_local_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 30);
    ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "run",
    );
    let here = ok(
        &trellara(
            d,
            &[
                "stream",
                "locate-local",
                "--config",
                "trellara.yml",
                "--format",
                "json",
            ],
        ),
        "locate-local",
    );
    let here: serde_json::Value = serde_json::from_str(&here).expect("json");
    assert_eq!(here[0]["present"], true, "{here}");

    p.target.psql("DELETE FROM public.orders WHERE id <= 10");
    let verify = trellara(d, &["verify", "--config", "trellara.yml"]);
    assert_eq!(verify.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&verify.stdout).contains("ROW_COUNT_MISMATCH"));
    let plan = ok(
        &trellara(d, &["repair-plan", "--config", "trellara.yml"]),
        "repair-plan",
    );
    assert!(
        plan.contains("failed_recoverable") && plan.contains("trellara reseed --config"),
        "{plan}"
    );
    let out = ok(
        &trellara(d, &["reseed", "--config", "trellara.yml", "--verify"]),
        "reseed",
    );
    assert!(
        out.contains("re-planning") && out.contains("shop CONVERGED"),
        "{out}"
    );
    assert_eq!(
        p.source
            .psql_value("SELECT count(*) FROM pg_replication_slots"),
        "1",
        "the old slot was replaced, not leaked"
    );
    let plan = ok(
        &trellara(d, &["repair", "plan", "--config", "trellara.yml"]),
        "repair plan",
    );
    assert!(plan.contains("nothing is blocked"), "{plan}");
}

#[test]
fn follow_applies_as_it_goes_and_stops_cleanly_on_sigterm() {
    on_every_major(follow_applies_as_it_goes_and_stops_cleanly_on_sigterm_on);
}

fn follow_applies_as_it_goes_and_stops_cleanly_on_sigterm_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["run", "--config", "trellara.yml", "--local", "--follow"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn run --follow");
    let wait_for = |sql: &str, want: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while p.target.psql_value(sql) != want {
            assert!(
                std::time::Instant::now() < deadline,
                "{sql} never reached {want}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    wait_for("SELECT count(*) FROM public.orders", "5");
    // The running process holds the log and streams the slot: verify
    // fences it and compares both sides at one source position.
    let out = ok(
        &trellara(d, &["verify", "--config", "trellara.yml"]),
        "verify of a following flow",
    );
    assert!(
        out.contains("shop CONVERGED") && out.contains("compared at source LSN"),
        "{out}"
    );
    for round in 0..3 {
        workload(&p.source, 100 + round * 10, 10);
        wait_for(
            "SELECT count(*) FROM public.orders",
            &(5 + (round + 1) * 10).to_string(),
        );
    }
    let status = terminate(&mut child);
    assert!(
        status.success(),
        "run --follow exits 0 on SIGTERM: {status}"
    );
    let out = ok(
        &trellara(d, &["verify", "--config", "trellara.yml"]),
        "verify",
    );
    assert!(out.contains("shop CONVERGED"), "{out}");
}

#[test]
fn follow_rides_through_a_target_restart() {
    on_every_major(follow_rides_through_a_target_restart_on);
}

/// The target server crashes and restarts under `run --follow`: the
/// follower reconnects by itself and goes on, nothing lost or doubled,
/// and still stops cleanly on SIGTERM.
fn follow_rides_through_a_target_restart_on(major: Major) {
    let Some(mut p) = pair(major) else {
        return;
    };
    let d = p.dir.path().to_owned();
    workload(&p.source, 1, 5);
    let log = std::fs::File::create(d.join("follow.log")).expect("log file");
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(&d)
        .args(["run", "--config", "trellara.yml", "--local", "--follow"])
        .stdout(log)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn run --follow");
    let wait_for = |target: &Cluster, sql: &str, want: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while target.psql_value(sql) != want {
            assert!(
                std::time::Instant::now() < deadline,
                "{sql} never reached {want}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    let orders = "SELECT count(*) FROM public.orders";
    // Streaming: the snapshot handed off (a signal during a snapshot stops
    // it unfinished, which the next run plans again).
    let handed_off =
        "SELECT coalesce((SELECT state FROM trellara.snapshot_runs WHERE flow = 'shop'), '')";
    wait_for(&p.target, orders, "5");
    wait_for(&p.target, handed_off, "stream_handoff_ready");
    p.target
        .crash_restart()
        .expect("crash and restart the target");
    workload(&p.source, 100, 10);
    wait_for(&p.target, orders, "15");
    assert!(
        child.try_wait().expect("poll").is_none(),
        "the follower kept running"
    );
    let status = terminate(&mut child);
    let said = std::fs::read_to_string(d.join("follow.log")).unwrap_or_default();
    assert!(status.success(), "exit 0 on SIGTERM: {status}\n{said}");
    assert!(said.contains("following again in"), "{said}");
    let out = ok(
        &trellara(&d, &["verify", "--config", "trellara.yml"]),
        "verify",
    );
    assert!(out.contains("shop CONVERGED"), "{out}");
}

#[test]
fn sigterm_stops_a_long_snapshot_copy_and_the_next_run_copies_again() {
    on_every_major(sigterm_stops_a_long_snapshot_copy_on);
}

/// `run --follow` told to stop while a large table is being copied ends
/// at once, leaving the snapshot unfinished; the next run plans it again
/// and converges.
fn sigterm_stops_a_long_snapshot_copy_on(major: Major) {
    let Some(source) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(target) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    for c in [&source, &target] {
        c.psql("CREATE TABLE public.big (id bigint PRIMARY KEY, v text)");
    }
    source.psql(
        "INSERT INTO public.big SELECT i, repeat('x', 200) FROM generate_series(1, 400000) i",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    init_flow(
        d,
        &source.connection_string("postgres"),
        &target.connection_string("postgres"),
        &["public.big"],
        "big",
        "external",
    );
    let child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["run", "--config", "trellara.yml", "--local", "--follow"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn run --follow");
    let state =
        "SELECT coalesce((SELECT state FROM trellara.snapshot_runs WHERE flow = 'big'), '')";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while target.psql_value("SELECT to_regclass('trellara.snapshot_runs') IS NOT NULL") != "t"
        || target.psql_value(state) != "copying"
    {
        assert!(std::time::Instant::now() < deadline, "never copying");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("sigterm");
    let out = child.wait_with_output().expect("reap");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{major}: {said}");
    assert!(
        said.contains("stopped by a signal before its handoff"),
        "{major}: {said}"
    );
    assert_eq!(
        target.psql_value(state),
        "copying",
        "{major}: left unfinished"
    );
    assert_eq!(
        target.psql_value("SELECT count(*) FROM public.big"),
        "0",
        "the copy rolled back"
    );
    let out = run_verify(d, "the next run");
    assert!(
        out.contains("re-planning") && out.contains("big CONVERGED"),
        "{major}: {out}"
    );
}

/// Chunk `index` of `count` of a transaction at `commit`, inserting id `id`.
fn sales_chunk(commit: u64, index: u32, count: u32, id: i64) -> Vec<u8> {
    let mut env = trellara_common::sample::chunk(commit, index, count);
    if let Some(trellara_common::envelope::change::Body::Row(row)) = env.changes[0].body.as_mut() {
        row.after[0] = trellara_common::sample::text(id.to_string());
    }
    trellara_common::envelope::encode(&env).expect("valid chunk")
}

/// A target with `public.sales`, an empty log and a one-thread runtime, for
/// tests that drive the applier directly.
struct ApplierRig {
    target: Cluster,
    log: trellara_relay::log::Log,
    rt: tokio::runtime::Runtime,
    url: String,
    _dir: tempfile::TempDir,
}

impl ApplierRig {
    fn new(major: Major) -> Option<Self> {
        Self::with_target(major, &ClusterOptions::new())
    }

    fn with_target(major: Major, options: &ClusterOptions) -> Option<Self> {
        let target = test_cluster(major, options)?;
        target.psql("CREATE TABLE public.sales (id bigint PRIMARY KEY, amount numeric, note text)");
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, _) = trellara_relay::log::Log::open(
            trellara_relay::log::storage::FsStorage::new(),
            dir.path(),
            trellara_relay::log::LogConfig::default(),
        )
        .expect("open");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let url = target.connection_string("postgres");
        Some(ApplierRig {
            target,
            log,
            rt,
            url,
            _dir: dir,
        })
    }

    /// An applier of flow `t` on its own target session.
    fn applier(&self) -> trellara_relay::apply::Applier {
        self.rt.block_on(async {
            let client = trellara_relay::flow::connect(&self.url, "target")
                .await
                .expect("connect");
            trellara_relay::state::ensure(&client).await.expect("state");
            trellara_relay::apply::Applier::new(client, "t", "orders-primary", "trellara.yml")
        })
    }
}

#[test]
fn chunked_transactions_apply_chunk_by_chunk_and_cut_runs_never_land() {
    on_every_major(chunked_transactions_apply_chunk_by_chunk_and_cut_runs_never_land_on);
}

fn chunked_transactions_apply_chunk_by_chunk_and_cut_runs_never_land_on(major: Major) {
    let Some(rig) = ApplierRig::new(major) else {
        return;
    };
    let ApplierRig {
        target, log, rt, ..
    } = &rig;
    let (x, y, z) = (0x5000_0000u64, 0x6000_0000u64, 0x7000_0000u64);
    // A crash cut X after two chunks; X was then appended whole; then Y.
    for (lsn, bytes) in [
        (x, sales_chunk(x, 0, 3, 1)),
        (x, sales_chunk(x, 1, 3, 2)),
        (x, sales_chunk(x, 0, 3, 1)),
        (x, sales_chunk(x, 1, 3, 2)),
        (x, sales_chunk(x, 2, 3, 3)),
        (y, sales_chunk(y, 0, 1, 4)),
        (z, sales_chunk(z, 0, 2, 5)),
    ] {
        log.append(lsn, &bytes).expect("append");
    }
    let mut applier = rig.applier();
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!(
        stats.transactions, 2,
        "X whole and Y; Z's last chunk is not durable yet"
    );
    assert_eq!(
        target.psql_value("SELECT string_agg(id::text, ',' ORDER BY id) FROM public.sales"),
        "1,2,3,4"
    );
    assert_eq!(
        target.psql_value("SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = 't'"),
        "0/60000000"
    );

    log.append(z, &sales_chunk(z, 1, 2, 6)).expect("append");
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!(stats.transactions, 1);
    assert_eq!(target.psql_value("SELECT count(*) FROM public.sales"), "6");
    // Redelivered whole: skipped and counted.
    log.commit_cursor(
        &trellara_relay::apply::cursor_name("t"),
        trellara_relay::log::CursorPosition::start_at(0),
    )
    .expect("rewind");
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!((stats.transactions, stats.duplicates_skipped), (0, 3));

    // With patience, a run whose last chunk is still being appended is
    // applied when it arrives, in the target transaction already open.
    // Chunks of 300 rows go as COPY, continued from chunk to chunk.
    let cursor = trellara_relay::apply::cursor_name("t");
    log.commit_cursor(
        &cursor,
        trellara_relay::log::CursorPosition::start_at(log.next_offset()),
    )
    .expect("skip ahead");
    let w = 0x8000_0000u64;
    let rows_chunk = |index: u32| {
        let mut env = trellara_common::sample::insert_transaction(300, 4);
        for (i, change) in env.changes.iter_mut().enumerate() {
            let sequence = u64::from(index) * 300 + i as u64;
            change.sequence = sequence;
            if let Some(trellara_common::envelope::change::Body::Row(row)) = change.body.as_mut() {
                row.after[0] = trellara_common::sample::text((1000 + sequence).to_string());
            }
        }
        env.commit_lsn = w;
        env.end_lsn = w + 0x10;
        env.begin_lsn = w - 0x10;
        env.boundary = Some(trellara_common::envelope::Boundary {
            mode: trellara_common::envelope::boundary::Mode::Chunked as i32,
            chunk_index: index,
            chunk_count: 3,
            first_sequence: u64::from(index) * 300,
            total_changes: 900,
            partition: 0,
            manifest_partitions: Vec::new(),
        });
        trellara_common::envelope::encode(&env).expect("valid chunk")
    };
    log.append(w, &rows_chunk(0)).expect("append");
    log.append(w, &rows_chunk(1)).expect("append");
    let mut patient = rig
        .applier()
        .with_patience(std::time::Duration::from_secs(10));
    let (stats, ()) = rt.block_on(async {
        tokio::join!(patient.apply_log(log), async {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let reader = trellara_relay::flow::connect(&rig.url, "target")
                .await
                .expect("connect");
            let visible: i64 = reader
                .query_one("SELECT count(*) FROM public.sales WHERE id >= 1000", &[])
                .await
                .expect("count")
                .get(0);
            assert_eq!(
                visible, 0,
                "nothing of the run is visible before its last chunk"
            );
            // The applier waits inside its transaction, its first COPY
            // still open (continued across chunks, not restarted).
            let waiting: i64 = reader
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE query LIKE 'COPY%public%sales%' AND state = 'active'
                       AND backend_xid IS NOT NULL",
                    &[],
                )
                .await
                .expect("activity")
                .get(0);
            assert_eq!(waiting, 1, "the applier's COPY is open in its transaction");
            log.append(w, &rows_chunk(2)).expect("append");
        })
    });
    assert_eq!(stats.expect("apply").transactions, 1);
    assert_eq!(
        target.psql_value("SELECT format('%s|%s|%s', count(*), min(id), max(id)) FROM public.sales WHERE id >= 1000"),
        "900|1000|1899"
    );
    assert_eq!(
        target.psql_value("SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = 't'"),
        "0/80000000"
    );
}

#[test]
fn a_target_crash_loses_only_commits_the_log_delivers_again() {
    on_every_major(a_target_crash_loses_only_commits_the_log_delivers_again_on);
}

/// Between two persists of its cursor the applier commits asynchronously.
/// A crash of the target server undoes those commits, and the log, whose
/// cursor has not passed them, delivers them again: nothing is lost, each
/// counted once. After `persist_cursor` (a durable commit first) a crash
/// loses nothing. The walwriter is slowed to 10 s so the undone commits
/// really are undone.
fn a_target_crash_loses_only_commits_the_log_delivers_again_on(major: Major) {
    let options = ClusterOptions::new().setting("wal_writer_delay", "10s");
    let Some(mut rig) = ApplierRig::with_target(major, &options) else {
        return;
    };
    let lazy = |rig: &ApplierRig| {
        rig.applier()
            .with_cursor_every(std::time::Duration::from_secs(3600))
    };
    let commit = |n: i64| 0x1000_0000u64 + n as u64 * 0x1000;
    let arrive = |rig: &ApplierRig,
                  applier: &mut trellara_relay::apply::Applier,
                  ids: std::ops::RangeInclusive<i64>| {
        for id in ids {
            rig.log
                .append(commit(id), &sales_chunk(commit(id), 0, 1, id))
                .expect("append");
            let stats = rig.rt.block_on(applier.apply_log(&rig.log)).expect("apply");
            assert_eq!(stats.transactions, 1, "one target commit per transaction");
        }
    };
    let cursor = |rig: &ApplierRig| {
        rig.log
            .cursor(&trellara_relay::apply::cursor_name("t"))
            .map(|c| c.next_offset)
    };
    let rows = |rig: &ApplierRig| rig.target.psql_value("SELECT count(*) FROM public.sales");

    // The session's first commit is durable and persists the cursor; the
    // next 29 are asynchronous.
    let mut applier = lazy(&rig);
    arrive(&rig, &mut applier, 1..=30);
    assert_eq!(rows(&rig), "30");
    assert_eq!(
        cursor(&rig),
        Some(1),
        "only the first commit persisted the cursor"
    );
    drop(applier);
    rig.target.crash_restart().expect("crash the target");
    let survived: i64 = rows(&rig).parse().expect("count");
    assert!(
        (1..30).contains(&survived),
        "the crash undid the asynchronous commits ({survived} of 30 rows survived)"
    );
    assert_eq!(
        rig.target.psql_value("SELECT commit_lsn = ('0/' || to_hex(max(id) * 4096 + 268435456))::pg_lsn FROM public.sales, trellara.checkpoints WHERE flow = 't' GROUP BY commit_lsn"),
        "t",
        "rows and checkpoint were undone together"
    );

    // A new session starts at the cursor: the lost tail comes again.
    let mut applier = lazy(&rig);
    let stats = rig.rt.block_on(applier.apply_log(&rig.log)).expect("apply");
    assert_eq!(
        (stats.transactions as i64, stats.duplicates_skipped as i64),
        (30 - survived, survived - 1),
        "the lost commits applied again, the surviving ones skipped and counted"
    );
    assert_eq!(rows(&rig), "30");

    // Persisting the cursor makes what it passes durable first.
    arrive(&rig, &mut applier, 31..=40);
    rig.rt
        .block_on(applier.persist_cursor(&rig.log))
        .expect("persist");
    assert_eq!(cursor(&rig), Some(rig.log.next_offset()));
    drop(applier);
    rig.target.crash_restart().expect("crash the target");
    assert_eq!(rows(&rig), "40", "nothing the cursor passed was lost");
    assert_eq!(
        rig.target.psql_value("SELECT transactions || '/' || duplicates_skipped FROM trellara.checkpoints WHERE flow = 't'"),
        format!("40/{}", survived - 1)
    );
}

#[test]
fn a_checkpoint_moved_by_another_writer_is_respected() {
    on_every_major(a_checkpoint_moved_by_another_writer_is_respected_on);
}

/// Another writer moves the checkpoint between two batches of one applier
/// session: the applier goes by the checkpoint it locks, not by what it
/// committed last, so nothing at or below the moved checkpoint is applied,
/// and a row the other writer put there is not taken for a data error.
fn a_checkpoint_moved_by_another_writer_is_respected_on(major: Major) {
    let Some(rig) = ApplierRig::new(major) else {
        return;
    };
    let ApplierRig {
        target, log, rt, ..
    } = &rig;
    let mut applier = rig.applier();
    let (a, b, c) = (0x1000_0000u64, 0x2000_0000u64, 0x3000_0000u64);
    log.append(a, &sales_chunk(a, 0, 1, 1)).expect("append");
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!(stats.transactions, 1);

    // Another writer claims B (its row is not there), then B and C arrive.
    target.psql("UPDATE trellara.checkpoints SET commit_lsn = '0/20000000' WHERE flow = 't'");
    log.append(b, &sales_chunk(b, 0, 1, 2)).expect("append");
    log.append(c, &sales_chunk(c, 0, 1, 3)).expect("append");
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!((stats.transactions, stats.duplicates_skipped), (1, 1));
    assert_eq!(
        target.psql_value("SELECT string_agg(id::text, ',' ORDER BY id) FROM public.sales"),
        "1,3",
        "B is at or below the moved checkpoint: skipped"
    );
    assert_eq!(
        target.psql_value("SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = 't'"),
        "0/30000000"
    );

    // The same when the other writer's row collides with the assumption.
    let d = 0x4000_0000u64;
    target.psql(
        "BEGIN; INSERT INTO public.sales VALUES (4, 1, 'other');
         UPDATE trellara.checkpoints SET commit_lsn = '0/40000000' WHERE flow = 't'; COMMIT",
    );
    log.append(d, &sales_chunk(d, 0, 1, 4)).expect("append");
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!((stats.transactions, stats.duplicates_skipped), (0, 1));
    assert_eq!(
        target.psql_value("SELECT count(*) FROM trellara.quarantine"),
        "0",
        "the other writer's row is not taken for a data error"
    );
}

#[test]
fn a_transaction_opened_ahead_holds_the_checkpoint_until_its_rows_commit() {
    on_every_major(a_transaction_opened_ahead_holds_the_checkpoint_until_its_rows_commit_on);
}

/// `run` opens the next target transaction as a source transaction begins
/// (`Applier::open_ahead`): from then the checkpoint is locked, so no other
/// writer interleaves; the rows commit in that transaction; one whose rows
/// do not come is rolled back; and a checkpoint another writer moved just
/// before the opening is still respected.
fn a_transaction_opened_ahead_holds_the_checkpoint_until_its_rows_commit_on(major: Major) {
    let Some(rig) = ApplierRig::new(major) else {
        return;
    };
    let ApplierRig {
        target, log, rt, ..
    } = &rig;
    let mut applier = rig.applier();
    let locked = || {
        target
            .try_psql("SELECT 1 FROM trellara.checkpoints WHERE flow = 't' FOR UPDATE NOWAIT")
            .is_err()
    };
    // The opening is sent without waiting: let the session's connection
    // put it on the wire and the target take the lock.
    let open_ahead = |applier: &mut trellara_relay::apply::Applier| {
        rt.block_on(async {
            applier.open_ahead().await;
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        });
    };
    let ids =
        || target.psql_value("SELECT string_agg(id::text, ',' ORDER BY id) FROM public.sales");
    let (a, b, c) = (0x1000_0000u64, 0x2000_0000u64, 0x3000_0000u64);
    open_ahead(&mut applier);
    assert!(
        !locked(),
        "no checkpoint known yet: nothing is opened ahead"
    );
    log.append(a, &sales_chunk(a, 0, 1, 1)).expect("append");
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!(stats.transactions, 1);

    open_ahead(&mut applier);
    assert!(locked(), "opened ahead: the checkpoint is locked");
    log.append(b, &sales_chunk(b, 0, 1, 2)).expect("append");
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!(stats.transactions, 1);
    assert_eq!(ids(), "1,2");
    assert_eq!(
        target.psql_value("SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = 't'"),
        "0/20000000"
    );
    assert!(!locked(), "committed with its rows: the lock is released");

    open_ahead(&mut applier);
    assert!(locked());
    rt.block_on(applier.close_opened());
    assert!(!locked(), "rows that did not come: rolled back");

    // Another writer claims C just before the opening: the lock's answer
    // is checked when C's rows go, and C is skipped as a duplicate.
    target.psql("UPDATE trellara.checkpoints SET commit_lsn = '0/30000000' WHERE flow = 't'");
    open_ahead(&mut applier);
    log.append(c, &sales_chunk(c, 0, 1, 3)).expect("append");
    let stats = rt.block_on(applier.apply_log(log)).expect("apply");
    assert_eq!((stats.transactions, stats.duplicates_skipped), (0, 1));
    assert_eq!(ids(), "1,2", "C is at or below the moved checkpoint");
    assert!(!locked());
}

#[test]
fn copy_carries_tabs_newlines_backslashes_and_nulls_exactly() {
    on_every_major(copy_carries_tabs_newlines_backslashes_and_nulls_exactly_on);
}

fn copy_carries_tabs_newlines_backslashes_and_nulls_exactly_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    ok(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        "run",
    );
    // One transaction of 1,000 rows: applied through COPY.
    p.source.psql(
        "INSERT INTO public.line_items
         SELECT g, 1, 1, 1, CASE g % 4 WHEN 0 THEN NULL WHEN 1 THEN E'tab\\there' WHEN 2 THEN E'line\\nbreak\\r' ELSE E'back\\\\slash \\\\N' END
         FROM generate_series(1, 1000) g",
    );
    let out = ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "run",
    );
    assert!(out.contains("shop CONVERGED"), "{out}");
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.line_items WHERE note IS NULL"),
        "250"
    );
    assert_eq!(
        p.target
            .psql_value("SELECT note FROM public.line_items WHERE order_id = 3"),
        "back\\slash \\N"
    );
}

/// Crash drills: `run --follow` (capture and apply in one process) is
/// killed with SIGKILL at a pseudo-random moment while a workload writes,
/// several times; after each, a plain `run --verify` must recover and end
/// CONVERGED. The seed is printed; TRELLARA_DRILL_SEED replays a sequence.
#[test]
fn crash_drills_under_load_converge() {
    on_every_major(crash_drills_under_load_converge_on);
}

fn crash_drills_under_load_converge_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    let seed: u64 = std::env::var("TRELLARA_DRILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0000 + u64::from(major.number()));
    eprintln!("crash drills on {major}: seed {seed}");
    let mut state = seed;
    let mut next = move || {
        // xorshift64: deterministic moments from the seed.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    ok(
        &trellara(d, &["run", "--config", "trellara.yml", "--local"]),
        "first run",
    );
    let mut first: i64 = 1_000;
    for drill in 0..3 {
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let stop = Arc::clone(&stop);
            let url = p.source.connection_config("postgres");
            let start = first;
            std::thread::spawn(move || {
                let mut client = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
                let mut o = start;
                while !stop.load(Ordering::Relaxed) {
                    let mut tx = client.transaction().expect("begin");
                    tx.execute(
                        "INSERT INTO public.line_items VALUES ($1, 1, 1, 1.00, 'drill')",
                        &[&o],
                    )
                    .expect("line");
                    tx.execute(
                        "INSERT INTO public.orders VALUES ($1, 'drill', 1.00)",
                        &[&o],
                    )
                    .expect("order");
                    tx.commit().expect("commit");
                    o += 1;
                }
                o
            })
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
            .current_dir(d)
            .args(["run", "--config", "trellara.yml", "--local", "--follow"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn run --follow");
        let moment = 200 + next() % 1500;
        std::thread::sleep(std::time::Duration::from_millis(moment));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("sigkill");
        let _ = child.wait();
        stop.store(true, Ordering::Relaxed);
        first = writer.join().expect("writer") + 1;
        let out = ok(
            &trellara(
                d,
                &["run", "--config", "trellara.yml", "--local", "--verify"],
            ),
            &format!("recovery run after drill {drill} (killed at {moment} ms, seed {seed})"),
        );
        assert!(
            out.contains("shop CONVERGED"),
            "drill {drill} (killed at {moment} ms, seed {seed}):\n{out}"
        );
    }
    assert_eq!(
        p.target.psql_value("SELECT count(*) FROM public.orders"),
        p.source.psql_value("SELECT count(*) FROM public.orders")
    );
}

#[test]
fn a_value_that_does_not_fit_its_target_column_is_quarantined_never_cut() {
    on_every_major(a_value_that_does_not_fit_on);
}

/// A target column narrower than the source's (varchar(3) for text,
/// numeric(10,0) for numeric) refuses the transaction - one row, or a
/// batch that goes as COPY - instead of cutting 'xxxxxx' to 'xxx' or
/// rounding 3.50 to 4.
fn a_value_that_does_not_fit_on(major: Major) {
    let Some(rig) = ApplierRig::new(major) else {
        return;
    };
    let ApplierRig {
        target, log, rt, ..
    } = &rig;
    let cases = [
        (
            "ALTER TABLE public.sales ALTER COLUMN note TYPE varchar(3)",
            1,
            "public.sales.note",
        ),
        (
            "ALTER TABLE public.sales ALTER COLUMN note TYPE varchar(3)",
            300,
            "public.sales.note",
        ),
        (
            "ALTER TABLE public.sales ALTER COLUMN amount TYPE numeric(10,0)",
            2,
            "public.sales.amount",
        ),
    ];
    for (i, (alter, rows, column)) in cases.iter().enumerate() {
        target.psql("DROP TABLE IF EXISTS public.sales; CREATE TABLE public.sales (id bigint PRIMARY KEY, amount numeric, note text)");
        target.psql(alter);
        let commit = 0x1000_0000 * (i as u64 + 1);
        let mut env = trellara_common::sample::insert_transaction(*rows, 6);
        env.commit_lsn = commit;
        env.end_lsn = commit + 0x10;
        env.begin_lsn = commit - 0x10;
        let bytes = trellara_common::envelope::encode(&env).expect("valid");
        log.append(commit, &bytes).expect("append");
        let mut applier = rig.applier();
        let err = rt
            .block_on(applier.apply_log(log))
            .expect_err("a value that does not fit");
        let text = err.to_string();
        assert!(
            text.contains("quarantined") && text.contains(column),
            "{major} {alter} x{rows}: {text}"
        );
        assert_eq!(
            target.psql_value("SELECT count(*) FROM public.sales"),
            "0",
            "{alter}: nothing applied"
        );
        target.psql("UPDATE trellara.quarantine SET resolved_at = now()");
        log.commit_cursor(
            &trellara_relay::apply::cursor_name("t"),
            trellara_relay::log::CursorPosition::start_at(log.next_offset()),
        )
        .expect("skip past it");
    }
}

/// `run --follow` in `dir`, its stderr gathered as it comes; returns the
/// child, the address it serves its endpoints on, and the stderr so far.
fn spawn_follower(d: &Path) -> (std::process::Child, String, Arc<std::sync::Mutex<String>>) {
    spawn_service(
        d,
        &["run", "--config", "trellara.yml", "--local", "--follow"],
    )
}

/// A service (`run --follow`, `relay`, `apply`) started in `dir` with
/// `args`, as [`spawn_follower`]: the address is read from whichever
/// stream names it.
fn spawn_service(
    d: &Path,
    args: &[&str],
) -> (std::process::Child, String, Arc<std::sync::Mutex<String>>) {
    use std::io::BufRead;
    let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn a service");
    let stderr = Arc::new(std::sync::Mutex::new(String::new()));
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let read = |pipe: Box<dyn std::io::Read + Send>,
                gather: Option<Arc<std::sync::Mutex<String>>>| {
        let addr_tx = addr_tx.clone();
        std::thread::spawn(move || {
            let mut pipe = std::io::BufReader::new(pipe);
            let mut line = String::new();
            while pipe.read_line(&mut line).is_ok_and(|n| n > 0) {
                if let Some(rest) = line.split("service: serving http://").nth(1) {
                    let addr = rest.split('/').next().unwrap_or_default().to_owned();
                    let _ = addr_tx.send(addr);
                }
                if let Some(g) = &gather {
                    g.lock().unwrap().push_str(&line);
                }
                line.clear();
            }
        });
    };
    read(
        Box::new(child.stderr.take().expect("stderr")),
        Some(Arc::clone(&stderr)),
    );
    // Both streams: progress lines go to stdout, reload lines to stderr.
    read(
        Box::new(child.stdout.take().expect("stdout")),
        Some(Arc::clone(&stderr)),
    );
    let addr = addr_rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .unwrap_or_else(|_| {
            panic!(
                "the service names the address it serves:\n{}",
                stderr.lock().unwrap()
            )
        });
    (child, addr, stderr)
}

/// The metric families of a scrape, after `promtool check metrics` passed
/// on it.
fn checked_families(d: &Path, metrics: &str) -> Vec<String> {
    let file = d.join("metrics.txt");
    std::fs::write(&file, metrics).expect("metrics file");
    let promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).expect("metrics file"))
        .output()
        .expect("promtool (Debian package prometheus, installed by scripts/setup)");
    assert!(
        promtool.status.success(),
        "promtool check metrics: {}{}\n{metrics}",
        String::from_utf8_lossy(&promtool.stdout),
        String::from_utf8_lossy(&promtool.stderr)
    );
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| l.split_whitespace().next().expect("a name").to_owned())
        .collect()
}

#[test]
fn a_kafka_flow_runs_as_separate_relay_and_apply_services() {
    let Some(broker) = trellara_tests::Broker::start() else {
        return;
    };
    on_every_major(|major| split_services_on(major, Some(&broker)));
}

#[test]
fn a_local_flow_runs_as_separate_relay_and_apply_services() {
    on_every_major(|major| split_services_on(major, None));
}

/// `trellara relay` (capture -> log [-> topic]) and `trellara apply`
/// (topic, or the relay's local log on this host -> target) as two
/// processes of one flow: each serves its own endpoints and only its own
/// series (promtool-checked, counted against the target), a second of
/// either and a `run` beside them are refused by their target locks, and
/// SIGTERM drains both to a verified target. Over the local log, either
/// process killed (-9) and started again goes on where it was.
fn split_services_on(major: Major, broker: Option<&trellara_tests::Broker>) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    let config = std::fs::read_to_string(d.join("trellara.yml")).expect("config");
    let topic = format!("trellara-split-{}", major.number());
    let transport = match broker {
        Some(broker) => format!(
            "    kind: kafka\n    brokers: {}\n    topic: {topic}\n",
            broker.bootstrap()
        ),
        None => "    kind: local\n".to_owned(),
    };
    let split = config.replace("    kind: local\n", &transport).replace(
        "  relay_listen: 127.0.0.1:0\n",
        "  relay_listen: 127.0.0.1:0\n  apply_listen: 127.0.0.1:0\n",
    );
    assert!(split.contains(&transport) && split.contains("apply_listen"));
    std::fs::write(d.join("trellara.yml"), split).expect("write");
    workload(&p.source, 1, 5);
    let wait_until = |what: &str, ok: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
        while !ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "{major}: never {what}"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    // The applier first: it waits, not ready, until the relay has made
    // the target ready.
    let (mut apply, mut apply_addr, mut apply_err) =
        spawn_service(d, &["apply", "--config", "trellara.yml"]);
    assert_eq!(http_get(&apply_addr, "/livez").0, 200);
    wait_until("the applier says it waits", &|| {
        apply_err.lock().unwrap().contains("waiting for the relay")
    });
    assert_eq!(http_get(&apply_addr, "/readyz").0, 503);
    let (mut relay, mut relay_addr, mut relay_err) =
        spawn_service(d, &["relay", "--config", "trellara.yml"]);
    assert_ne!(relay_addr, apply_addr);
    wait_until("both ready", &|| {
        http_get(&relay_addr, "/readyz").0 == 200 && http_get(&apply_addr, "/readyz").0 == 200
    });
    let orders = "SELECT count(*) FROM public.orders";
    assert_eq!(p.target.psql_value(orders), "5", "{major}: the snapshot");
    workload(&p.source, 100, 12);
    wait_until("applied through the topic or log", &|| {
        p.target.psql_value(orders) == "17"
    });
    // Verify beside the two services: fenced over the local log; on kafka
    // the applier reads the topic, which holds no position to fence at.
    let (code, v, err) = verdict(d, &[]);
    match broker {
        None => assert_eq!(
            (code, v["result"].as_str(), v["fenced_at"].is_string()),
            (Some(0), Some("CONVERGED"), true),
            "{major}:\n{v:#}\n{err}"
        ),
        Some(_) => assert!(
            code == Some(1)
                && v["divergences"][0]["code"] == "WATERMARK_UNVERIFIED"
                && v["divergences"][0]["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("the kafka transport is not fenced")),
            "{major}:\n{v:#}\n{err}"
        ),
    }
    // The gauges are read every 2 s: let a read happen after the last write.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let (_, relay_metrics) = http_get(&relay_addr, "/metrics");
    let (_, apply_metrics) = http_get(&apply_addr, "/metrics");
    assert_eq!(
        checked_families(d, &relay_metrics),
        [
            "trellara_captured_transactions_total",
            "trellara_log_retained_bytes",
            "trellara_slot_retained_wal_bytes",
        ],
        "{major}: the relay's series"
    );
    assert_eq!(
        checked_families(d, &apply_metrics),
        [
            "trellara_applied_transactions_total",
            "trellara_commit_to_apply_lag_seconds",
            "trellara_quarantined_transactions_total",
            "trellara_skipped_duplicate_transactions_total",
        ],
        "{major}: the applier's series"
    );
    assert!(
        relay_metrics
            .lines()
            .filter(|l| !l.starts_with('#'))
            .all(|l| l.contains("service=\"relay\""))
    );
    assert!(
        apply_metrics
            .lines()
            .filter(|l| !l.starts_with('#'))
            .all(|l| l.contains("service=\"apply\""))
    );
    assert_eq!(
        p.target
            .psql_value("SELECT transactions FROM trellara.checkpoints WHERE flow = 'shop'"),
        "12"
    );
    assert_eq!(
        metric(&relay_metrics, "trellara_captured_transactions_total"),
        12.0
    );
    assert_eq!(
        metric(&apply_metrics, "trellara_applied_transactions_total"),
        12.0
    );
    assert_eq!(
        metric(&apply_metrics, "trellara_commit_to_apply_lag_seconds_count"),
        12.0
    );
    assert!(metric(&relay_metrics, "trellara_slot_retained_wal_bytes") > 0.0);
    let (_, health) = http_get(&apply_addr, "/healthz");
    let health: serde_json::Value = serde_json::from_str(&health).expect("healthz is JSON");
    assert_eq!(health["service"], "apply", "{health}");
    assert_eq!(health["flows"][0]["state"], "following", "{health}");

    // A change no sink applies on its own: the relay logs on, the applier
    // holds at it (held, not ready) until the change is accepted.
    p.source.psql(
        "ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7;
         INSERT INTO public.orders VALUES (900, 'c', 0, 8);",
    );
    let state = |addr: &str| {
        let (_, health) = http_get(addr, "/healthz");
        serde_json::from_str::<serde_json::Value>(&health).expect("healthz is JSON")["flows"][0]
            ["state"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    wait_until("the applier holds", &|| state(&apply_addr) == "held");
    assert_eq!(http_get(&apply_addr, "/readyz").0, 503, "{major}");
    assert_eq!(state(&relay_addr), "following", "{major}: capture goes on");
    let after = p.source.psql_value("SELECT pg_current_wal_lsn()");
    wait_until("the slot past the held change", &|| {
        p.source.psql_value(&format!(
            "SELECT confirmed_flush_lsn >= '{after}' FROM pg_replication_slots WHERE slot_name = 'trellara_shop'"
        )) == "t"
    });
    p.target
        .psql("ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7");
    ok(
        &trellara(
            d,
            &[
                "schema",
                "accept",
                "--config",
                "trellara.yml",
                "--table",
                "public.orders",
            ],
        ),
        "schema accept",
    );
    wait_until("the held transaction applied", &|| {
        p.target.psql_value(orders) == "18"
    });
    wait_until("the applier follows again", &|| {
        state(&apply_addr) == "following"
    });

    // Each part is one process on the target, from any host.
    for (args, part) in [
        (&["apply", "--config", "trellara.yml"][..], "apply"),
        (&["relay", "--config", "trellara.yml"][..], "capture"),
        (
            &["run", "--config", "trellara.yml", "--local"][..],
            "capture",
        ),
    ] {
        let err = fails(&trellara(d, args), 3);
        assert!(
            err.contains("already running against this target")
                && err.contains(&format!("playing its {part} part")),
            "{major} {args:?}: {err}"
        );
    }
    if broker.is_none() {
        // The apply service killed mid-stream: started again, it resumes
        // from its own cursor in the relay's log.
        workload(&p.source, 300, 40);
        apply.kill().expect("kill -9 apply");
        apply.wait().expect("reap");
        workload(&p.source, 400, 10);
        let (again, again_addr, again_err) =
            spawn_service(d, &["apply", "--config", "trellara.yml"]);
        (apply, apply_addr, apply_err) = (again, again_addr, again_err);
        wait_until("applied after the apply service's kill", &|| {
            p.target.psql_value(orders) == "68"
        });
        // The relay killed: the apply service follows the log it reopens.
        relay.kill().expect("kill -9 relay");
        relay.wait().expect("reap");
        workload(&p.source, 500, 10);
        let (again, again_addr, again_err) =
            spawn_service(d, &["relay", "--config", "trellara.yml"]);
        (relay, relay_addr, relay_err) = (again, again_addr, again_err);
        wait_until("applied after the relay's kill", &|| {
            p.target.psql_value(orders) == "78"
        });
        wait_until("both ready again", &|| {
            http_get(&relay_addr, "/readyz").0 == 200 && http_get(&apply_addr, "/readyz").0 == 200
        });
        let apply_text = apply_err.lock().unwrap().clone();
        assert!(
            apply_text.contains("apply: following the log") && !apply_text.contains("replaced"),
            "{major}: {apply_text}"
        );
    }
    // SIGTERM drains both.
    let before = p.target.psql_value(orders).parse::<i64>().expect("a count");
    workload(&p.source, 200, 3);
    wait_until("applied before the stop", &|| {
        p.target.psql_value(orders) == (before + 3).to_string()
    });
    let relay_status = terminate(&mut relay);
    let apply_status = terminate(&mut apply);
    assert!(
        relay_status.success(),
        "{major}: relay {relay_status}:\n{}",
        relay_err.lock().unwrap()
    );
    // The relay's closing line counts what it captured and published; it
    // applied nothing, and says so.
    let relay_text = relay_err.lock().unwrap().clone();
    let kept = if broker.is_some() {
        "published to topic"
    } else {
        "kept in the log"
    };
    assert!(
        relay_text.contains(kept) && !relay_text.contains("; applied 0 ("),
        "{major}: {relay_text}"
    );
    assert!(
        apply_status.success(),
        "{major}: apply {apply_status}:\n{}",
        apply_err.lock().unwrap()
    );
    let out = ok(
        &trellara(d, &["verify", "--config", "trellara.yml"]),
        "verify",
    );
    assert!(out.contains("shop CONVERGED"), "{major}: {out}");
}

#[test]
fn a_following_flow_serves_its_endpoints_and_reloads_on_sighup() {
    on_every_major(a_following_flow_serves_its_endpoints_on);
}

/// `run --follow` serves /livez /readyz /healthz /metrics; the metrics
/// pass `promtool check metrics` and agree with the target, the slot and
/// the log; SIGHUP reloads without stopping (a broken config refused, a
/// valid one taken), and SIGTERM still drains.
fn a_following_flow_serves_its_endpoints_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    let (mut child, addr, stderr) = spawn_follower(d);
    assert!(addr.starts_with("127.0.0.1:"), "loopback: {addr}");
    assert_eq!(http_get(&addr, "/livez").0, 200);
    let wait_until = |what: &str, ok: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !ok() {
            assert!(std::time::Instant::now() < deadline, "never {what}");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    wait_until("ready", &|| http_get(&addr, "/readyz").0 == 200);
    let orders = "SELECT count(*) FROM public.orders";
    // Transactions after the snapshot: these are what the metrics count.
    workload(&p.source, 100, 12);
    wait_until("applied", &|| p.target.psql_value(orders) == "17");
    // The gauges are read every 2 s: let a read happen after the last write.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let slot_sql = "SELECT (pg_current_wal_lsn() - restart_lsn)::int8 FROM pg_replication_slots WHERE slot_name = 'trellara_shop'";
    let before: f64 = p.source.psql_value(slot_sql).parse().expect("bytes");
    let (status, metrics) = http_get(&addr, "/metrics");
    let after: f64 = p.source.psql_value(slot_sql).parse().expect("bytes");
    assert_eq!(status, 200);
    // Exactly the seven names, each series with exactly the three labels.
    assert_eq!(
        checked_families(d, &metrics),
        [
            "trellara_applied_transactions_total",
            "trellara_captured_transactions_total",
            "trellara_commit_to_apply_lag_seconds",
            "trellara_log_retained_bytes",
            "trellara_quarantined_transactions_total",
            "trellara_skipped_duplicate_transactions_total",
            "trellara_slot_retained_wal_bytes",
        ]
    );
    let source_id = p
        .target
        .psql_value("SELECT source_id FROM trellara.checkpoints WHERE flow = 'shop'");
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        let labels = line.split_once('{').expect("labels").1;
        let labels = labels.rsplit_once('}').expect("labels").0;
        let mut keys: Vec<&str> = labels
            .split(',')
            .map(|kv| kv.split_once('=').expect("k=v").0)
            .filter(|k| !(*k == "le" && line.contains("_bucket{")))
            .collect();
        keys.sort_unstable();
        assert_eq!(keys, ["dataset_id", "service", "source_id"], "{line}");
        assert!(
            line.contains(&format!("source_id=\"{source_id}\""))
                && line.contains("dataset_id=\"shop\""),
            "{line}"
        );
    }
    // The counters against the target: twelve transactions since start,
    // as the checkpoint counts them too.
    assert_eq!(
        p.target
            .psql_value("SELECT transactions FROM trellara.checkpoints WHERE flow = 'shop'"),
        "12"
    );
    assert_eq!(
        metric(&metrics, "trellara_captured_transactions_total"),
        12.0
    );
    assert_eq!(
        metric(&metrics, "trellara_applied_transactions_total"),
        12.0
    );
    assert_eq!(
        metric(&metrics, "trellara_quarantined_transactions_total"),
        p.target
            .psql_value("SELECT count(*) FROM trellara.quarantine WHERE flow = 'shop'")
            .parse::<f64>()
            .expect("count")
    );
    assert_eq!(
        metric(&metrics, "trellara_skipped_duplicate_transactions_total"),
        0.0
    );
    assert_eq!(
        metric(&metrics, "trellara_commit_to_apply_lag_seconds_count"),
        12.0
    );
    // The gauges against the slot and the log's segment files.
    let slot = metric(&metrics, "trellara_slot_retained_wal_bytes");
    assert!(
        slot >= before.min(after) - 65536.0 && slot <= before.max(after) + 65536.0,
        "slot retains {before}..{after} bytes; the gauge says {slot}"
    );
    let segments: u64 = std::fs::read_dir(d.join(".trellara/trellara/shop/log"))
        .expect("log dir")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".seg"))
        .map(|e| e.metadata().expect("segment").len())
        .sum();
    assert!(segments > 0);
    assert_eq!(
        metric(&metrics, "trellara_log_retained_bytes"),
        segments as f64
    );
    let (status, health) = http_get(&addr, "/healthz");
    assert_eq!(status, 200);
    let health: serde_json::Value = serde_json::from_str(&health).expect("healthz is JSON");
    assert_eq!(health["flows"][0]["flow"], "shop");
    assert_eq!(health["flows"][0]["state"], "following", "{health}");
    assert_eq!(health["ready"], true);

    // SIGHUP with a broken config: refused, the old one keeps running.
    let config = d.join("trellara.yml");
    let good = std::fs::read_to_string(&config).expect("config");
    std::fs::write(&config, good.replace("tables:", "tabels:")).expect("break config");
    let pid = child.id() as i32;
    let hangup = || {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGHUP,
        )
        .expect("sighup")
    };
    hangup();
    wait_until("the broken config refused", &|| {
        stderr.lock().unwrap().contains("reload: refused")
    });
    assert!(
        stderr.lock().unwrap().contains("tabels"),
        "{}",
        stderr.lock().unwrap()
    );
    // A valid one with a tighter lag bound: taken live.
    std::fs::write(
        &config,
        good.replace(
            "relay_listen: 127.0.0.1:0",
            "relay_listen: 127.0.0.1:0\n  ready_max_lag_seconds: 7",
        ),
    )
    .expect("config");
    hangup();
    wait_until("the new lag bound taken", &|| {
        stderr
            .lock()
            .unwrap()
            .contains("service.ready_max_lag_seconds is now 7 (applied live)")
    });
    assert!(
        child.try_wait().expect("poll").is_none(),
        "SIGHUP never stops the process"
    );
    // The endpoints' address, the log level and the retention limit: all
    // three live, none named as waiting for a restart.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let moved = format!("127.0.0.1:{port}");
    let mut live = String::new();
    for line in good.lines() {
        if line.trim_start().starts_with("retention_mib:") {
            continue;
        }
        live.push_str(&line.replace(
            "relay_listen: 127.0.0.1:0",
            &format!("relay_listen: {moved}\n  ready_max_lag_seconds: 7\n  log_level: debug"),
        ));
        live.push('\n');
        if let Some(rest) = line.strip_suffix(line.trim_start())
            && line.trim_start().starts_with("log_dir:")
        {
            live.push_str(&format!("{rest}retention_mib: 512\n"));
        }
    }
    assert!(live.contains("retention_mib: 512"), "{live}");
    std::fs::write(&config, &live).expect("config");
    let debug_before = stderr.lock().unwrap().matches(" DEBUG ").count();
    hangup();
    wait_until("the new address, level and retention taken", &|| {
        let text = stderr.lock().unwrap();
        text.contains(&format!(
            "service.relay_listen is now {moved} (applied live)"
        )) && text.contains("service.log_level is now debug (applied live)")
            && text.contains("flows[shop].transport.retention_mib is now 512 (applied live")
    });
    assert!(
        !stderr
            .lock()
            .unwrap()
            .contains("applies when the flow starts again"),
        "{}",
        stderr.lock().unwrap()
    );
    assert_eq!(http_get(&moved, "/livez").0, 200);
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "the old address no longer accepts"
    );
    workload(&p.source, 200, 3);
    wait_until("applied after the reloads", &|| {
        p.target.psql_value(orders) == "20"
    });
    assert!(
        stderr.lock().unwrap().matches(" DEBUG ").count() > debug_before,
        "debug lines after the reload"
    );
    assert_eq!(http_get(&moved, "/livez").0, 200);
    // Where the flow streams from never changes live: a new slot is
    // refused by name, and the flow goes on on its own.
    let renamed = live.replacen(
        "  source:\n",
        "  source:\n    slot: trellara_elsewhere\n",
        1,
    );
    assert_ne!(renamed, live, "the config has a source block");
    std::fs::write(&config, &renamed).expect("config");
    hangup();
    wait_until("the slot change refused", &|| {
        stderr
            .lock()
            .unwrap()
            .contains("flows[shop].source.slot changed: refused, the flow keeps running as it was")
    });
    workload(&p.source, 300, 2);
    wait_until("applied on the old slot", &|| {
        p.target.psql_value(orders) == "22"
    });
    // Nor the source URL or the capture path: each is refused by name.
    let mut moved_source = false;
    let elsewhere: String = live
        .lines()
        .map(|line| {
            let (indent, rest) = line.split_at(line.len() - line.trim_start().len());
            let swapped = if !moved_source && rest.starts_with("url: postgresql") {
                moved_source = true;
                format!("{indent}url: postgresql://nobody@127.0.0.1:1/elsewhere")
            } else if rest.starts_with("capture: external") {
                format!("{indent}capture: native")
            } else {
                line.to_owned()
            };
            swapped + "\n"
        })
        .collect();
    assert!(
        moved_source && elsewhere.contains("capture: native"),
        "the config names its source URL and capture path:\n{live}"
    );
    std::fs::write(&config, &elsewhere).expect("config");
    hangup();
    for field in ["flows[shop].source.url", "flows[shop].capture"] {
        wait_until(field, &|| {
            stderr.lock().unwrap().contains(&format!(
                "{field} changed: refused, the flow keeps running as it was"
            ))
        });
    }
    workload(&p.source, 400, 2);
    wait_until("applied from the old source", &|| {
        p.target.psql_value(orders) == "24"
    });
    stop_follower(&mut child, &stderr, major);
}

/// A [`wait_until`] for a spawned process: a failure names the major and
/// shows what the process has written to stderr so far.
fn waiter<'a>(
    major: Major,
    stderr: &'a std::sync::Mutex<String>,
) -> impl Fn(&str, u64, &dyn Fn() -> bool) + 'a {
    move |what, secs, ok| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while !ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "{major}: never {what}:\n{}",
                stderr.lock().unwrap()
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Polls `ok` every 100 ms for up to `secs` seconds.
fn wait_until(what: &str, secs: u64, ok: &dyn Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !ok() {
        assert!(std::time::Instant::now() < deadline, "never {what}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn an_unknown_server_error_is_retried_a_few_rounds_then_stops_the_flow() {
    on_every_major(an_unknown_server_error_is_retried_then_stops_on);
}

/// A target that refuses one row with a SQLSTATE no class names (XX000,
/// as an extension's internal error would): the follower retries the
/// round, since such an error may pass, but stops after a few rounds in a
/// row instead of looping for ever, naming the error; nothing of that
/// transaction is applied.
fn an_unknown_server_error_is_retried_then_stops_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    p.target.psql(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.id = 900 THEN RAISE EXCEPTION 'refused by the test' USING ERRCODE = 'XX000'; END IF; RETURN NEW; END $$;
         CREATE TRIGGER refuse BEFORE INSERT ON public.orders FOR EACH ROW EXECUTE FUNCTION public.refuse();",
    );
    workload(&p.source, 1, 3);
    let (mut child, addr, stderr) = spawn_follower(d);
    wait_until("ready", 60, &|| http_get(&addr, "/readyz").0 == 200);
    workload(&p.source, 900, 1);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{major}: still retrying after 90 s:\n{}",
            stderr.lock().unwrap()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let text = stderr.lock().unwrap().clone();
    assert!(!status.success(), "{major}: {text}");
    assert!(
        text.contains("following again in")
            && text.contains("rounds in a row ended with a server error no SQLSTATE class names"),
        "{major}: {text}"
    );
    assert!(text.contains("refused by the test"), "{major}: {text}");
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.orders WHERE id = 900"),
        "0",
        "{major}"
    );
}

#[test]
fn an_idle_flow_keeps_no_foreign_wal() {
    on_every_major(an_idle_flow_keeps_no_foreign_wal_on);
}

/// A following flow whose tables are quiet, on a source busy elsewhere
/// (256 MiB of WAL written in another database): the slot does not keep
/// that WAL, because the relay confirms the keepalive positions past its
/// last durable transaction. The slot gauge says the same.
fn an_idle_flow_keeps_no_foreign_wal_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 3);
    let (mut child, addr, stderr) = spawn_follower(d);
    wait_until("ready", 60, &|| http_get(&addr, "/readyz").0 == 200);
    p.source.psql("CREATE DATABASE elsewhere");
    let mut elsewhere = p
        .source
        .try_connect("elsewhere")
        .expect("connect elsewhere");
    let wal = |c: &mut postgres::Client| -> i64 {
        c.query_one("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8", &[])
            .expect("wal position")
            .get(0)
    };
    let from = wal(&mut elsewhere);
    elsewhere
        .batch_execute("CREATE TABLE noise (g int, pad text)")
        .expect("noise table");
    while wal(&mut elsewhere) - from < 256 << 20 {
        elsewhere
            .batch_execute(
                "INSERT INTO noise SELECT g, repeat(md5(g::text), 28) FROM generate_series(1, 50000) g",
            )
            .expect("foreign writes");
    }
    // A checkpoint logs the running transactions: the point a logical
    // slot's restart_lsn can move to.
    p.source.psql("CHECKPOINT");
    let retained = "SELECT (pg_current_wal_lsn() - restart_lsn)::int8 FROM pg_replication_slots WHERE slot_name = 'trellara_shop'";
    let limit = 16i64 << 20;
    wait_until("the slot released the foreign WAL", 60, &|| {
        p.source.psql_value(retained).parse::<i64>().expect("bytes") < limit
    });
    wait_until("the gauge shows it", 30, &|| {
        let (_, metrics) = http_get(&addr, "/metrics");
        metric(&metrics, "trellara_slot_retained_wal_bytes") < limit as f64
    });
    // Nothing of the foreign database reached the flow.
    let (_, metrics) = http_get(&addr, "/metrics");
    assert_eq!(
        metric(&metrics, "trellara_captured_transactions_total"),
        0.0
    );
    stop_follower(&mut child, &stderr, major);
}

/// SIGTERM to `child`, then its exit status.
fn terminate(child: &mut std::process::Child) -> std::process::ExitStatus {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("sigterm");
    child.wait().expect("reap")
}

#[test]
fn two_sinks_naming_one_database_by_other_urls_apply_once() {
    on_every_major(two_sinks_naming_one_database_on);
}

/// Two sinks whose URLs differ as text (a URL and the key-value form) but
/// reach one database: the config cannot tell, so the target's flow lock
/// does. The second sink is refused by name, with the fix, on every run,
/// and the first applies on.
/// Flow `shop` from `source` into sinks `main` and `lake`, its local
/// transport's settings followed by `transport_extra` (whole lines).
fn two_sinks_config(source: &str, (main, lake): (&str, &str), transport_extra: &str) -> String {
    format!(
        "schema_version: 2
flows:
  - name: shop
    source:
      url: {source}
    sinks:
      - name: main
        target:
          url: {main}
      - name: lake
        target:
          url: {lake}
    tables: [public.orders, public.line_items]
    transport:
      kind: local
      log_dir: ./log
{transport_extra}service:
  relay_listen: 127.0.0.1:0
"
    )
}

fn two_sinks_naming_one_database_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    std::fs::write(
        d.join("twice.yml"),
        two_sinks_config(
            &p.source.connection_string("postgres"),
            (
                &p.target.connection_string("postgres"),
                &p.target.connection_config("postgres"),
            ),
            "",
        ),
    )
    .expect("config");
    workload(&p.source, 1, 3);
    let out = trellara(d, &["run", "--config", "twice.yml", "--local"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{major}: refused: {stderr}");
    assert!(
        stderr.contains("flow shop, sink lake: its target's flow lock is held by")
            && stderr.contains("two of the flow's sinks name one database"),
        "{major}: the second sink named, with the fix: {stderr}"
    );
    workload(&p.source, 10, 2);
    let out = trellara(d, &["run", "--config", "twice.yml", "--local"]);
    assert!(!out.status.success(), "{major}: refused again");
    let count = "SELECT count(*) FROM public.orders";
    assert_eq!(p.source.psql_value(count), "5", "{major}");
    assert_eq!(
        p.target.psql_value(count),
        "5",
        "{major}: the first sink applies on"
    );
}

#[test]
fn a_held_change_is_accepted_sink_by_sink() {
    on_every_major(a_held_change_is_accepted_sink_by_sink_on);
}

/// Two sinks held at one change: `schema accept` records nothing while one
/// target does not match, `--sink` releases the one that does while the
/// other stays held, and the other goes on once it matches too.
fn a_held_change_is_accepted_sink_by_sink_on(major: Major) {
    let Some(source) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(main) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(lake) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    for c in [&source, &main, &lake] {
        c.psql(SCHEMA);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(
        d.join("trellara.yml"),
        two_sinks_config(
            &source.connection_string("postgres"),
            (
                &main.connection_string("postgres"),
                &lake.connection_string("postgres"),
            ),
            "",
        ),
    )
    .expect("config");
    workload(&source, 1, 3);
    let (mut child, addr, stderr) = spawn_follower(d);
    let wait_until = waiter(major, &stderr);
    wait_until("ready", 90, &|| http_get(&addr, "/readyz").0 == 200);
    let orders = "SELECT count(*) FROM public.orders";
    let held = "SELECT coalesce(string_agg(held_table, ','), '') FROM trellara.quarantine WHERE resolved_at IS NULL";
    source.psql(
        "ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7;
         INSERT INTO public.orders VALUES (100, 'c', 0, 8);",
    );
    for target in [&main, &lake] {
        wait_until("held", 60, &|| target.psql_value(held) == "public.orders");
    }
    main.psql("ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7");
    let accept = |extra: &[&str]| {
        let mut args = vec!["schema", "accept", "--table", "public.orders"];
        args.extend(extra);
        trellara(d, &args)
    };
    let err = fails(&accept(&[]), 1);
    assert!(
        err.contains("sink lake") && err.contains("missing column code"),
        "{major}: {err}"
    );
    let accepted = "SELECT count(*) FROM trellara.schema_changes WHERE kind = 'accepted'";
    assert_eq!(main.psql_value(accepted), "0", "{major}: nothing recorded");
    ok(&accept(&["--sink", "main"]), "accept on main");
    wait_until("main applied", 60, &|| main.psql_value(orders) == "4");
    assert_eq!(
        lake.psql_value(orders),
        "3",
        "{major}: the lake still holds"
    );
    assert_eq!(lake.psql_value(held), "public.orders", "{major}");
    lake.psql("ALTER TABLE public.orders ADD COLUMN code int NOT NULL DEFAULT 7");
    let out = ok(&accept(&[]), "accept on the lake");
    assert!(
        out.contains("for sink lake") && !out.contains("for sink main"),
        "{major}: {out}"
    );
    wait_until("lake applied", 60, &|| lake.psql_value(orders) == "4");
    let status = terminate(&mut child);
    assert!(status.success(), "{major}: {status}");
    let out = ok(
        &trellara(d, &["verify", "--config", "trellara.yml"]),
        "verify",
    );
    assert!(!out.contains("DIVERGED"), "{major}: {out}");
}

#[test]
fn two_sinks_share_one_slot_and_a_stalled_one_holds_back_neither() {
    on_every_major(two_sinks_share_one_slot_on);
}

/// One flow, one slot, two targets (`sinks:`): the second is copied at a
/// boundary of its own; while it is stalled (a reader holds its table
/// locked) the first keeps converging, and once free it catches up from
/// its own cursor. Stalled again while the log passes its cap, its cursor
/// is dropped instead of the log growing, and when free it is copied again
/// at a new boundary of its own: the flow's slot is never replaced.
fn two_sinks_share_one_slot_on(major: Major) {
    let Some(source) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(first) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let Some(lake) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    for c in [&source, &first, &lake] {
        c.psql(SCHEMA);
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(
        d.join("trellara.yml"),
        two_sinks_config(
            &source.connection_string("postgres"),
            (
                &first.connection_string("postgres"),
                &lake.connection_string("postgres"),
            ),
            "      retention_mib: 4\n",
        ),
    )
    .expect("config");
    workload(&source, 1, 3);
    let (mut child, addr, stderr) = spawn_follower(d);
    let wait_until = waiter(major, &stderr);
    wait_until("ready", 90, &|| http_get(&addr, "/readyz").0 == 200);
    let orders = "SELECT count(*) FROM public.orders";
    let content = "SELECT md5(string_agg(o::text, ',' ORDER BY id)) FROM public.orders o";
    for target in [&first, &lake] {
        assert_eq!(target.psql_value(orders), "3", "{major}: both copied");
    }
    let slot = "SELECT string_agg(slot_name || ' ' || slot_type, ',') FROM pg_replication_slots";
    let the_slot = source.psql_value(slot);
    assert_eq!(the_slot, "trellara_shop logical", "{major}: one slot");

    // Stalled: a reader holds the lake's table against writes (SHARE
    // lets reads pass); the first sink goes on.
    let mut reader = lake.connect();
    let stall = |reader: &mut postgres::Client| {
        reader
            .batch_execute("BEGIN; LOCK TABLE public.orders IN SHARE MODE")
            .expect("lock");
    };
    stall(&mut reader);
    workload(&source, 100, 20);
    wait_until("the first sink converged", 60, &|| {
        first.psql_value(orders) == "23"
    });
    assert_eq!(lake.psql_value(orders), "3", "{major}: the lake waits");
    reader.batch_execute("COMMIT").expect("unlock");
    wait_until("the lake caught up", 60, &|| {
        lake.psql_value(orders) == "23"
    });
    assert_eq!(lake.psql_value(content), source.psql_value(content));
    let (_, metrics) = http_get(&addr, "/metrics");
    assert_eq!(
        checked_families(d, &metrics).len(),
        7,
        "{major}: still the seven names"
    );
    // Two sinks, two apply series; each counts its own sink's commits
    // (the twenty streamed since the copies).
    for sink in ["main", "lake"] {
        let applied = metrics
            .lines()
            .find(|l| {
                l.starts_with("trellara_applied_transactions_total{")
                    && l.contains(&format!("dataset_id=\"{sink}\""))
            })
            .unwrap_or_else(|| panic!("{major}: no series of {sink}:\n{metrics}"));
        let counted: f64 = applied
            .rsplit_once(' ')
            .expect("value")
            .1
            .parse()
            .expect("number");
        assert_eq!(counted, 20.0, "{major}: {applied}");
    }

    // Past the cap (4 MiB) while stalled: the lake's cursor goes, the
    // log stays small, the first sink is untouched.
    stall(&mut reader);
    for batch in 0..6 {
        let from = 1000 + batch * 1000;
        source.psql(&format!(
            "INSERT INTO public.orders SELECT g, repeat('x', 2000), 1 FROM generate_series({from}, {}) g",
            from + 999
        ));
    }
    let written = source.psql_value("SELECT pg_current_wal_lsn()");
    wait_until("the first sink converged past the cap", 120, &|| {
        first.psql_value(orders) == "6023"
    });
    // The stalled sink holds neither the log nor the slot: the slot is
    // confirmed past everything the stall wrote.
    wait_until("the slot confirmed past the stalled sink", 60, &|| {
        source.psql_value(&format!(
            "SELECT confirmed_flush_lsn >= '{written}' FROM pg_replication_slots WHERE slot_name = 'trellara_shop'"
        )) == "t"
    });
    wait_until("the lake's cursor dropped", 60, &|| {
        stderr.lock().unwrap().contains("its cursor is dropped")
    });
    // Health says so: the lake needs a copy, and the process is not
    // ready while it does.
    let (code, health) = http_get(&addr, "/healthz");
    let health: serde_json::Value = serde_json::from_str(&health).expect("healthz json");
    let needs: Vec<(&str, bool)> = health["flows"]
        .as_array()
        .expect("flows")
        .iter()
        .map(|f| (f["dataset_id"].as_str().unwrap(), f["needs_copy"] == true))
        .collect();
    assert_eq!(
        (code, &health["ready"]),
        (200, &serde_json::json!(false)),
        "{major}: {health}"
    );
    assert_eq!(
        needs,
        [("lake", true), ("main", false)],
        "{major}: {health}"
    );
    let (_, why) = http_get(&addr, "/readyz");
    assert!(why.contains("sink lake: needs a copy"), "{major}: {why}");
    // Retention passes every 10 s: what was written after the drop goes
    // at the next one, within the cap and a segment.
    let log_bytes = || -> u64 {
        std::fs::read_dir(d.join("log"))
            .expect("log dir")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".seg"))
            .map(|e| e.metadata().map_or(0, |m| m.len()))
            .sum()
    };
    wait_until("the log trimmed to its cap for a stalled sink", 30, &|| {
        log_bytes() < 6 << 20
    });
    reader.batch_execute("COMMIT").expect("unlock");
    wait_until("the lake copied again at its own boundary", 120, &|| {
        lake.psql_value(orders) == "6023"
    });
    workload(&source, 300, 2);
    wait_until("both follow after it", 60, &|| {
        first.psql_value(orders) == "6025" && lake.psql_value(orders) == "6025"
    });
    wait_until("ready again once the lake is copied", 60, &|| {
        http_get(&addr, "/readyz").0 == 200
    });
    assert_eq!(lake.psql_value(content), source.psql_value(content));
    assert_eq!(first.psql_value(content), source.psql_value(content));
    assert_eq!(
        source.psql_value(slot),
        the_slot,
        "{major}: the one slot, never replaced, no seed slot left"
    );
    stop_follower(&mut child, &stderr, major);

    // Each sink has its own verify, status and reseed.
    let verdicts: serde_json::Value = serde_json::from_str(&ok(
        &trellara(
            d,
            &["verify", "--config", "trellara.yml", "--format", "json"],
        ),
        "verify",
    ))
    .expect("json");
    let judged: Vec<(&str, &str)> = verdicts
        .as_array()
        .expect("verdicts")
        .iter()
        .map(|v| (v["sink"].as_str().unwrap(), v["result"].as_str().unwrap()))
        .collect();
    assert_eq!(
        judged,
        [("main", "CONVERGED"), ("lake", "CONVERGED")],
        "{major}"
    );
    lake.psql("UPDATE public.orders SET customer = 'changed' WHERE id = 5000");
    let out = trellara(d, &["verify", "--config", "trellara.yml", "--sink", "lake"]);
    assert_eq!(out.status.code(), Some(1), "{major}: the lake diverged");
    assert!(String::from_utf8_lossy(&out.stdout).contains("shop (sink lake) DIVERGED"));
    ok(
        &trellara(d, &["verify", "--config", "trellara.yml", "--sink", "main"]),
        "the first sink is untouched",
    );
    let status: serde_json::Value = serde_json::from_str(&ok(
        &trellara(
            d,
            &["status", "--config", "trellara.yml", "--format", "json"],
        ),
        "status",
    ))
    .expect("json");
    let sink = &status[0]["sinks"][0];
    assert_eq!(
        (
            sink["sink"].as_str(),
            sink["needs_copy"].as_bool(),
            sink["last_verify"]["verdict"].as_str()
        ),
        (Some("lake"), Some(false), Some("DIVERGED")),
        "{major}: {status}"
    );
    let reseeded = ok(
        &trellara(
            d,
            &[
                "reseed",
                "--config",
                "trellara.yml",
                "--sink",
                "lake",
                "--verify",
            ],
        ),
        "reseed the lake",
    );
    assert!(
        reseeded.contains("shop (sink lake) CONVERGED"),
        "{reseeded}"
    );
    // The first sink copied again keeps the slot and the log: the lake
    // streams on from its cursor, not from a copy of its own.
    let reseeded = ok(
        &trellara(
            d,
            &[
                "reseed",
                "--config",
                "trellara.yml",
                "--sink",
                "main",
                "--verify",
            ],
        ),
        "reseed the first sink",
    );
    assert!(
        reseeded.contains("the flow's slot and log stay for its other sinks")
            && !reseeded.contains("slot trellara_shop created"),
        "{major}: {reseeded}"
    );
    assert!(
        reseeded.contains("shop (sink main) CONVERGED"),
        "{reseeded}"
    );
    workload(&source, 400, 2);
    let out = ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "both apply after the reseeds",
    );
    assert!(
        out.contains("shop (sink main) CONVERGED") && out.contains("shop (sink lake) CONVERGED"),
        "{major}: {out}"
    );
    assert_eq!(lake.psql_value(orders), "6027");
    assert_eq!(
        source.psql_value(slot),
        the_slot,
        "{major}: still the one slot"
    );

    // Reordered, each sink keeps its own cursor (by name), so the new
    // first one resumes where it was, with no copy and no gap.
    let config = d.join("trellara.yml");
    let text = std::fs::read_to_string(&config).expect("config");
    let (head, rest) = text.split_once("      - name: main\n").expect("main");
    let (main, tail) = rest.split_once("      - name: lake\n").expect("lake");
    let (lake_entry, after) = tail.split_once("    tables:").expect("tables");
    let swapped = format!(
        "{head}      - name: lake\n{lake_entry}      - name: main\n{main}    tables:{after}"
    );
    std::fs::write(&config, &swapped).expect("config");
    workload(&source, 450, 1);
    let out = ok(
        &trellara(
            d,
            &["run", "--config", "trellara.yml", "--local", "--verify"],
        ),
        "the sinks reordered",
    );
    assert!(
        out.contains("shop (sink lake) CONVERGED")
            && out.contains("shop (sink main) CONVERGED")
            && !out.contains("boundary of its own"),
        "{major}: {out}"
    );
    std::fs::write(&config, &text).expect("config");

    // The first sink quarantined while following: the lake goes on.
    first.psql("ALTER TABLE public.orders ADD CONSTRAINT small CHECK (total < 5) NOT VALID");
    let (mut child, addr, stderr) = spawn_follower(d);
    let wait_until = waiter(major, &stderr);
    wait_until("ready again", 90, &|| http_get(&addr, "/readyz").0 == 200);
    source.psql("INSERT INTO public.orders VALUES (9000, 'big', 99)");
    workload(&source, 500, 3);
    wait_until(
        "the lake applied past the first sink's refusal",
        60,
        &|| lake.psql_value(orders) == "6032",
    );
    let health = || -> serde_json::Value {
        serde_json::from_str(&http_get(&addr, "/healthz").1).expect("healthz is JSON")
    };
    wait_until("the first sink shown stopped", 60, &|| {
        health()["flows"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|f| f["dataset_id"] == "main" && f["state"] == "stopped")
    });
    let all = health();
    let lake_health = all["flows"]
        .as_array()
        .expect("flows")
        .iter()
        .find(|f| f["dataset_id"] == "lake")
        .expect("the lake's entry")
        .clone();
    assert_eq!(lake_health["state"], "following", "{major}: {all}");
    assert_eq!(
        http_get(&addr, "/readyz").0,
        503,
        "{major}: a stopped sink is not ready"
    );
    assert_eq!(
        first.psql_value(orders),
        "6028",
        "{major}: nothing of it applied"
    );
    assert!(
        child.try_wait().expect("poll").is_none(),
        "{major}: still running"
    );
    terminate(&mut child);
}

/// Every run opens with `state::ensure`. State tables an older build made
/// (one table and one column short) are completed; current ones are only
/// looked at, so a role that may create nothing on the target passes.
#[test]
fn state_tables_of_an_older_build_are_completed_and_current_ones_only_checked() {
    on_every_major(|major| {
        let Some(cluster) = test_cluster(major, &ClusterOptions::default()) else {
            return;
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let url = cluster.connection_string("postgres");
        rt.block_on(async {
            let admin = trellara_relay::flow::connect(&url, "target")
                .await
                .expect("connect");
            trellara_relay::state::ensure(&admin).await.expect("state");
            admin
                .batch_execute(
                    "DROP TABLE trellara.flow_stops;
                     ALTER TABLE trellara.snapshot_tables DROP COLUMN boundary_lsn;",
                )
                .await
                .expect("an older build's tables");
            trellara_relay::state::ensure(&admin)
                .await
                .expect("completed");
            let present: bool = admin
                .query_one(
                    "SELECT to_regclass('trellara.flow_stops') IS NOT NULL
                        AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'trellara.snapshot_tables'::regclass
                                    AND attname = 'boundary_lsn' AND NOT attisdropped)",
                    &[],
                )
                .await
                .expect("query")
                .get(0);
            assert!(present, "ensure left the older build's tables short");
            admin
                .batch_execute(
                    "CREATE ROLE plain LOGIN;
                     GRANT USAGE ON SCHEMA trellara TO plain;
                     REVOKE CREATE ON DATABASE postgres FROM PUBLIC;",
                )
                .await
                .expect("role");
            let plain_url = url.replacen("postgres@", "plain@", 1);
            let plain = trellara_relay::flow::connect(&plain_url, "target")
                .await
                .expect("connect as plain");
            trellara_relay::state::ensure(&plain)
                .await
                .expect("a current schema needs no right to create");
        });
    });
}

/// Orders from `first` on, one transaction each touching both tables, a
/// few hundred a second, until `stop`: a live source. Returns how many
/// committed.
fn live_load(cluster: &Cluster, first: i64, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<i64> {
    let mut client = cluster.connect();
    std::thread::spawn(move || {
        let mut o = first;
        while !stop.load(Ordering::Relaxed) {
            let mut tx = client.transaction().expect("begin");
            tx.execute(
                "INSERT INTO public.line_items VALUES ($1, 1, 1, 1.00, 'live')",
                &[&o],
            )
            .expect("line");
            tx.execute("INSERT INTO public.orders VALUES ($1, 'live', 1.00)", &[&o])
                .expect("order");
            // Rows of the flow's tables move too, not only new ones.
            tx.execute(
                "UPDATE public.orders SET total = total + 1 WHERE id = 1",
                &[],
            )
            .expect("update");
            tx.commit().expect("commit");
            o += 1;
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        o - first
    })
}

/// Asserts that `verify --format json` with `extra` converged (exit 0);
/// its verdict.
fn converged(d: &Path, major: Major, extra: &[&str]) -> serde_json::Value {
    let (code, v, err) = verdict(d, extra);
    assert_eq!(
        (code, v["result"].as_str()),
        (Some(0), Some("CONVERGED")),
        "{major}:\n{v:#}\n{err}"
    );
    v
}

/// Stops a follower with SIGTERM and asserts it drained cleanly.
fn stop_follower(child: &mut std::process::Child, stderr: &std::sync::Mutex<String>, major: Major) {
    let status = terminate(child);
    assert!(
        status.success(),
        "{major}: {status}\n{}",
        stderr.lock().unwrap()
    );
}

/// The verdict of `verify --format json` (one flow, one sink).
fn verdict(d: &Path, extra: &[&str]) -> (Option<i32>, serde_json::Value, String) {
    let mut args = vec!["verify", "--config", "trellara.yml", "--format", "json"];
    args.extend(extra);
    let out = trellara(d, &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json: serde_json::Value = serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code(), json[0].clone(), stderr)
}

#[test]
fn a_following_flow_under_load_is_verified_at_a_fence_and_a_change_behind_it_is_named() {
    on_every_major(
        a_following_flow_under_load_is_verified_at_a_fence_and_a_change_behind_it_is_named_on,
    );
}

fn a_following_flow_under_load_is_verified_at_a_fence_and_a_change_behind_it_is_named_on(
    major: Major,
) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    let (mut child, _, stderr) = spawn_follower(d);
    let wait = waiter(major, &stderr);
    wait("applied the first orders", 60, &|| {
        p.target.psql_value("SELECT count(*) FROM public.orders") == "5"
    });
    let stop = Arc::new(AtomicBool::new(false));
    let load = live_load(&p.source, 1000, Arc::clone(&stop));
    let mut fences = Vec::new();
    for i in 0..20 {
        let (code, v, err) = verdict(d, &[]);
        assert_eq!(
            (code, v["result"].as_str()),
            (Some(0), Some("CONVERGED")),
            "{major}: verify {i} of a following flow under load:\n{v:#}\n{err}"
        );
        let at: trellara_common::Lsn = v["fenced_at"]
            .as_str()
            .unwrap_or_else(|| panic!("{major}: verify {i} names its fence:\n{v:#}"))
            .parse()
            .expect("an LSN");
        fences.push(at);
    }
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "{major}: each verify fences later, while the source moves: {fences:?}"
    );
    // A row changed on the target behind the flow's back, one the load
    // never touches: named by table and key.
    p.target
        .psql("UPDATE public.orders SET customer = 'behind its back' WHERE id = 3");
    let (code, v, err) = verdict(d, &["--chunk-rows", "2"]);
    stop.store(true, Ordering::Relaxed);
    let committed = load.join().expect("load");
    assert_eq!(code, Some(1), "{major}: DIVERGED exits 1:\n{v:#}\n{err}");
    assert_eq!(v["result"], "DIVERGED", "{major}:\n{v:#}");
    let divergences = v["divergences"].as_array().expect("divergences");
    assert_eq!(divergences.len(), 1, "{major}: only the change:\n{v:#}");
    assert_eq!(
        divergences[0]["code"], "CHECKSUM_MISMATCH",
        "{major}:\n{v:#}"
    );
    let orders = v["tables"]
        .as_array()
        .expect("tables")
        .iter()
        .find(|t| t["table"] == "public.orders")
        .expect("orders compared");
    assert_eq!(
        orders["diverging_ranges"],
        serde_json::json!(["ROW(id) BETWEEN ROW('3'::bigint) AND ROW('3'::bigint)"]),
        "{major}: the range is the one key:\n{v:#}"
    );
    // A released fence is cleared: the applier's lock no longer looks
    // for its holder.
    assert_eq!(
        p.target
            .psql_value("SELECT fence_lsn IS NULL FROM trellara.checkpoints WHERE flow = 'shop'"),
        "t",
        "{major}"
    );
    stop_follower(&mut child, &stderr, major);
    eprintln!("{major}: {committed} transactions committed under the 21 verifies");
}

/// The fence's temporary slot waits for every source transaction with an
/// xid: one left open makes the fence give up at its timeout, naming it,
/// and the flow's apply goes on with nothing left behind.
#[test]
fn a_long_source_transaction_makes_the_fence_give_up_cleanly() {
    on_every_major(a_long_source_transaction_makes_the_fence_give_up_cleanly_on);
}

fn a_long_source_transaction_makes_the_fence_give_up_cleanly_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    let (mut child, _, stderr) = spawn_follower(d);
    let wait = waiter(major, &stderr);
    wait("applied the first orders", 60, &|| {
        p.target.psql_value("SELECT count(*) FROM public.orders") == "5"
    });
    let mut open = p.source.connect();
    let mut tx = open.transaction().expect("begin");
    tx.execute("INSERT INTO public.orders VALUES (500, 'open', 1.00)", &[])
        .expect("an xid");
    let backend: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .expect("pid")
        .get(0);
    let started = std::time::Instant::now();
    let (code, v, err) = verdict(d, &["--fence-timeout", "2"]);
    let took = started.elapsed();
    assert_eq!(code, Some(2), "{major}: could not verify:\n{v:#}\n{err}");
    assert!(
        err.contains("the fence was given up after 2 s")
            && err.contains("creating the fence's temporary slot waited for")
            && err.contains(&format!("(backend {backend},"))
            && err.contains("the flow's apply goes on, nothing was compared"),
        "{major}: names the transaction it waited for:\n{err}"
    );
    assert!(
        took < std::time::Duration::from_secs(20),
        "{major}: {took:?}"
    );
    tx.rollback().expect("rollback");
    wait("dropped the fence's temporary slot", 30, &|| {
        p.source.psql_value(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'trellara_fence%'",
        ) == "0"
    });
    // The apply was released: what commits now arrives.
    workload(&p.source, 6, 3);
    wait("applied past the given-up fence", 60, &|| {
        p.target.psql_value("SELECT count(*) FROM public.orders") == "8"
    });
    converged(d, major, &[]);
    stop_follower(&mut child, &stderr, major);
}

/// A verify killed inside its fence holds the applier no longer: the
/// fence is the fence lock of verify's own target session, so the apply
/// goes on by itself past the fence left in the checkpoint row, and the
/// source keeps no slot of it.
#[test]
fn a_verify_killed_inside_its_fence_releases_the_apply() {
    on_every_major(a_verify_killed_inside_its_fence_releases_the_apply_on);
}

fn a_verify_killed_inside_its_fence_releases_the_apply_on(major: Major) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    let (mut child, _, stderr) = spawn_follower(d);
    let wait = waiter(major, &stderr);
    wait("applied the first orders", 60, &|| {
        p.target.psql_value("SELECT count(*) FROM public.orders") == "5"
    });
    // Idle long enough to have closed the transaction it opens ahead,
    // then stopped: capture confirms nothing, so verify waits inside the
    // fence for it to pass the fence's position.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let follower = Pid::from_raw(child.id() as i32);
    kill(follower, Signal::SIGSTOP).expect("SIGSTOP");
    let mut verify = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args([
            "verify",
            "--config",
            "trellara.yml",
            "--fence-timeout",
            "120",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn verify");
    wait_until(
        "verify inside its fence, its snapshot imported",
        60,
        &|| {
            p.target.psql_value(
            "SELECT count(*) FROM trellara.checkpoints WHERE flow = 'shop' AND fence_lsn IS NOT NULL",
        ) == "1"
            && p.source.psql_value(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'
                 AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid()",
            ) == "1"
            && p.source.psql_value(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'trellara_fence%'",
            ) == "0"
        },
    );
    // Past the import it moves the fence at once; give it that moment.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        verify.try_wait().expect("verify").is_none(),
        "{major}: verify waits inside the fence"
    );
    verify.kill().expect("kill -9 verify");
    verify.wait().expect("reaped");
    workload(&p.source, 100, 3);
    kill(follower, Signal::SIGCONT).expect("SIGCONT");
    wait("applied past the dead verify's fence", 60, &|| {
        p.target.psql_value("SELECT count(*) FROM public.orders") == "8"
    });
    assert_eq!(
        p.source
            .psql_value("SELECT string_agg(slot_name, ',') FROM pg_replication_slots"),
        "trellara_shop",
        "{major}: only the flow's own slot"
    );
    converged(d, major, &[]);
    stop_follower(&mut child, &stderr, major);
}

/// A DDL that rewrites a flow table after the fence, before verify first
/// reads it, would make the old snapshot see the table empty: verify sees
/// the table's catalog move, fences again, and never says DIVERGED.
#[test]
fn a_ddl_between_the_fence_and_the_comparison_is_never_a_divergence() {
    on_every_major(a_ddl_between_the_fence_and_the_comparison_is_never_a_divergence_on);
}

fn a_ddl_between_the_fence_and_the_comparison_is_never_a_divergence_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    // Compared first, long enough to land the DDL meanwhile.
    p.source.psql(
        "INSERT INTO public.orders SELECT g, 'c', 1 FROM generate_series(1, 500000) g;
         INSERT INTO public.line_items SELECT g, 1, 1, 1, 'n' FROM generate_series(1, 50) g",
    );
    let (mut child, _, stderr) = spawn_follower(d);
    let wait = waiter(major, &stderr);
    wait("copied", 120, &|| {
        p.target
            .psql_value("SELECT count(*) FROM public.line_items")
            == "50"
    });
    let verify = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args(["verify", "--config", "trellara.yml", "--fence-timeout", "5"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn verify");
    // Verify's snapshot reads orders: line_items is not read (nor locked)
    // yet.
    let reading_orders = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
         WHERE l.relation = 'public.orders'::regclass AND a.backend_xmin IS NOT NULL
           AND a.pid <> pg_backend_pid()";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while p.source.psql_value(reading_orders) != "1" {
        assert!(
            std::time::Instant::now() < deadline,
            "{major}: verify never read orders"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // A widening the flow takes (auto-apply) that rewrites the table: the
    // verify that runs again after it has nothing to report.
    p.source
        .psql("ALTER TABLE public.line_items ALTER COLUMN qty TYPE bigint");
    let out = verify.wait_with_output().expect("verify");
    let (stdout, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.code() != Some(1) && !stdout.contains("DIVERGED"),
        "{major}: no divergence for a DDL ({}):\n{stdout}\n{err}",
        out.status
    );
    assert!(
        err.contains(
            "table public.line_items changed on the source (a DDL committed) while verify compared it at the fence"
        ),
        "{major}: names the table that moved:\n{stdout}\n{err}"
    );
    terminate(&mut child);
}

/// A target session that holds the checkpoint row keeps the fence from
/// moving: verify gives up at its deadline (the server-side lock timeout,
/// not a client-side one that would leave the statement waiting there).
#[test]
fn a_locked_checkpoint_row_makes_the_fence_give_up_at_its_deadline() {
    on_every_major(|major| {
        let Some(p) = pair(major) else {
            return;
        };
        let d = p.dir.path();
        workload(&p.source, 1, 3);
        let (mut child, _, stderr) = spawn_follower(d);
        let wait = waiter(major, &stderr);
        wait("applied", 60, &|| {
            p.target.psql_value("SELECT count(*) FROM public.orders") == "3"
        });
        // The copy's rows commit before the handoff writes the checkpoint.
        wait("handed off", 60, &|| {
            p.target
                .psql_value("SELECT count(*) FROM trellara.checkpoints WHERE flow = 'shop'")
                == "1"
        });
        let mut holder = p.target.connect();
        let mut tx = holder.transaction().expect("begin");
        let locked = tx
            .execute(
                "SELECT 1 FROM trellara.checkpoints WHERE flow = 'shop' FOR UPDATE",
                &[],
            )
            .expect("lock the row");
        assert_eq!(locked, 1, "{major}: the row is held");
        let started = std::time::Instant::now();
        let (code, v, err) = verdict(d, &["--fence-timeout", "2"]);
        let took = started.elapsed();
        assert!(
            code == Some(2)
                && err.contains("the fence was given up after 2 s")
                && err.contains("checkpoint row stayed locked"),
            "{major}: {code:?}\n{v:#}\n{err}"
        );
        assert!(
            took < std::time::Duration::from_secs(15),
            "{major}: {took:?}"
        );
        tx.rollback().expect("rollback");
        let (code, v, err) = verdict(d, &[]);
        assert_eq!(
            (code, v["result"].as_str()),
            (Some(0), Some("CONVERGED")),
            "{major}:\n{v:#}\n{err}"
        );
        terminate(&mut child);
    });
}

/// A reader of the target while [`live_load`] runs: each of its
/// transactions adds one line item and one order marked 'live' and adds 1
/// to order 1's total, so every snapshot must show as many of each as
/// order 1 grew from `base`. Read in one statement, and in a REPEATABLE
/// READ transaction that reads the tables apart (the view an older
/// snapshot keeps across a copy's commit). Returns the reads and what
/// each torn one saw.
fn torn_reader(
    target: &Cluster,
    base: f64,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, Vec<String>)> {
    let url = target.connection_string("postgres");
    std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("reader");
        let (mut reads, mut torn) = (0u64, Vec::new());
        // NaN when order 1 is not there at all.
        let grown = |c: &mut postgres::Transaction<'_>| -> f64 {
            c.query_opt(
                "SELECT (total - $1::float8::numeric)::float8 FROM public.orders WHERE id = 1",
                &[&base],
            )
            .expect("order 1")
            .map_or(f64::NAN, |r| r.get(0))
        };
        while !stop.load(Ordering::Relaxed) {
            let mut one = c.transaction().expect("begin");
            let row = one
                .query_one(
                    "SELECT (SELECT count(*) FROM public.line_items WHERE note = 'live'),
                            (SELECT count(*) FROM public.orders WHERE customer = 'live'),
                            coalesce((SELECT (total - $1::float8::numeric)::float8 FROM public.orders WHERE id = 1), 'NaN')",
                    &[&base],
                )
                .expect("read");
            let (lines, orders, grew): (i64, i64, f64) = (row.get(0), row.get(1), row.get(2));
            if lines != orders || orders as f64 != grew {
                torn.push(format!(
                    "one statement: {lines} lines, {orders} orders, order 1 grew {grew}"
                ));
            }
            one.commit().expect("commit");
            let mut apart = c
                .build_transaction()
                .isolation_level(postgres::IsolationLevel::RepeatableRead)
                .start()
                .expect("begin");
            let lines: i64 = apart
                .query_one(
                    "SELECT count(*) FROM public.line_items WHERE note = 'live'",
                    &[],
                )
                .expect("lines")
                .get(0);
            std::thread::sleep(std::time::Duration::from_millis(20));
            let orders: i64 = apart
                .query_one(
                    "SELECT count(*) FROM public.orders WHERE customer = 'live'",
                    &[],
                )
                .expect("orders")
                .get(0);
            let grew = grown(&mut apart);
            if lines != orders || orders as f64 != grew {
                torn.push(format!(
                    "apart: {lines} lines, {orders} orders, order 1 grew {grew}"
                ));
            }
            apart.commit().expect("commit");
            reads += 2;
        }
        (reads, torn)
    })
}

/// The `tables` entry of `table` in `status --format json` of the flow.
fn status_table(d: &Path, table: &str) -> serde_json::Value {
    let out = ok(
        &trellara(
            d,
            &["status", "--config", "trellara.yml", "--format", "json"],
        ),
        "status",
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("status json");
    v[0]["tables"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["table"] == table).cloned())
        .unwrap_or_else(|| panic!("status lists {table}:\n{v:#}"))
}

/// `reseed --table` copies one table again while its flow follows under
/// load: the row changed and the row deleted behind the flow's back are
/// mended, the other table is untouched, a reader never sees a source
/// transaction half applied (the apply holds at the table's boundary while
/// it is copied), status shows the table's own state and verify promotes
/// it. Refused with nothing done: a table another table's foreign key
/// references, and a flow that is not following.
#[test]
fn a_table_is_reseeded_under_load_and_no_reader_sees_half_a_transaction() {
    on_every_major(a_table_is_reseeded_under_load_and_no_reader_sees_half_a_transaction_on);
}

fn a_table_is_reseeded_under_load_and_no_reader_sees_half_a_transaction_on(major: Major) {
    let Some(p) = pair(major) else {
        return;
    };
    let d = p.dir.path();
    workload(&p.source, 1, 5);
    // Enough rows that the copy takes a while under the hold.
    p.source.psql(
        "INSERT INTO public.orders SELECT g, 'bulk', 1.00 FROM generate_series(100000, 299999) g",
    );
    let (mut child, _, stderr) = spawn_follower(d);
    let wait = waiter(major, &stderr);
    wait("applied the bulk orders", 120, &|| {
        p.target.psql_value("SELECT count(*) FROM public.orders") == "200005"
    });
    let reseed = |extra: &[&str]| {
        let mut args = vec![
            "reseed",
            "--config",
            "trellara.yml",
            "--table",
            "public.orders",
            "--format",
            "json",
        ];
        args.extend(extra);
        trellara(d, &args)
    };
    // Another table's foreign key: refused before the apply is held.
    p.target
        .psql("CREATE TABLE public.audit (order_id bigint REFERENCES public.orders)");
    let refused = reseed(&[]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{major}: {err}");
    assert!(
        err.contains("referenced on the target by public.audit (foreign key audit_order_id_fkey)")
            && err.contains("ALTER TABLE public.audit DROP CONSTRAINT audit_order_id_fkey"),
        "{major}: {err}"
    );
    p.target.psql("DROP TABLE public.audit");
    // A DELETE trigger would fire for every row the copy empties.
    p.target.psql(
        "CREATE FUNCTION public.noted() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN OLD; END $$;
         CREATE TRIGGER noted BEFORE DELETE ON public.orders FOR EACH ROW EXECUTE FUNCTION public.noted()",
    );
    let refused = reseed(&[]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        refused.status.code() == Some(1)
            && err.contains("has the DELETE trigger noted on the target")
            && err.contains("ALTER TABLE public.orders DISABLE TRIGGER noted"),
        "{major}: {err}"
    );
    p.target
        .psql("DROP TRIGGER noted ON public.orders; DROP FUNCTION public.noted()");
    // Behind the flow's back: what the copy mends.
    p.target.psql(
        "UPDATE public.orders SET customer = 'behind its back' WHERE id = 3; DELETE FROM public.orders WHERE id = 4",
    );
    let lines_before = p
        .target
        .psql_value("SELECT count(*) FROM public.line_items");
    let base: f64 = p
        .target
        .psql_value("SELECT total FROM public.orders WHERE id = 1")
        .parse()
        .expect("a total");
    let stop = Arc::new(AtomicBool::new(false));
    let load = live_load(&p.source, 1000, Arc::clone(&stop));
    let reader = torn_reader(&p.target, base, Arc::clone(&stop));
    std::thread::sleep(std::time::Duration::from_millis(500));
    // Killed inside its copy: the table as it was, no slot left, and the
    // apply resumes by itself.
    let mut killed = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(d)
        .args([
            "reseed",
            "--config",
            "trellara.yml",
            "--table",
            "public.orders",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn reseed");
    // Read on until the kill: a closed pipe would end it before.
    let mut lines = {
        use std::io::BufRead;
        std::io::BufReader::new(killed.stdout.take().expect("stdout")).lines()
    };
    let copying = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.contains("copying the table at it"));
    assert!(copying, "{major}: the reseed reached its copy");
    std::thread::sleep(std::time::Duration::from_millis(300));
    killed.kill().expect("kill -9");
    killed.wait().expect("reap");
    drop(lines);
    let applied = |sql: &str| p.target.psql_value(sql);
    let live_now: i64 = applied("SELECT count(*) FROM public.orders WHERE customer = 'live'")
        .parse()
        .expect("a count");
    wait("applied past the killed reseed's hold", 30, &|| {
        applied("SELECT count(*) FROM public.orders WHERE customer = 'live'")
            .parse::<i64>()
            .is_ok_and(|n| n > live_now + 5)
    });
    wait("no fence slot left", 30, &|| {
        p.source.psql_value(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'trellara_fence_%'",
        ) == "0"
    });
    assert_eq!(
        applied("SELECT customer FROM public.orders WHERE id = 3"),
        "behind its back",
        "{major}: the killed copy was rolled back"
    );
    let out = reseed(&[]);
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    assert!(
        out.status.success(),
        "{major}: reseed --table ({}):\n{report:#}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let reseeded = &report[0];
    let rows = reseeded["rows"].as_u64().expect("rows");
    assert!(rows >= 200_005, "{major}: every order copied:\n{report:#}");
    let boundary = reseeded["boundary_lsn"].as_str().expect("boundary");
    eprintln!(
        "{major}: reseed of {rows} rows held the apply {} ms (the copy {} ms)",
        reseeded["apply_held_ms"], reseeded["copy_ms"]
    );
    let own = status_table(d, "public.orders");
    assert_eq!(
        (own["state"].as_str(), own["boundary_lsn"].as_str()),
        (Some("stream_handoff_ready"), Some(boundary)),
        "{major}: status shows the table's own state:\n{own:#}"
    );
    assert!(
        status_table(d, "public.line_items")["state"].is_null(),
        "{major}: the other table keeps the run's"
    );
    // The flow goes on after the hold: the load's later rows arrive.
    std::thread::sleep(std::time::Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let committed = load.join().expect("load");
    let (reads, torn) = reader.join().expect("reader");
    assert!(
        torn.is_empty(),
        "{major}: a reader saw a source transaction half applied: {torn:?}"
    );
    assert!(reads > 10, "{major}: the reader read ({reads})");
    wait("applied the whole load", 60, &|| {
        p.target
            .psql_value("SELECT count(*) FROM public.orders WHERE customer = 'live'")
            == committed.to_string()
    });
    assert_eq!(
        p.target.psql_value(
            "SELECT customer || ' ' || (SELECT count(*) FROM public.orders WHERE id = 4) FROM public.orders WHERE id = 3"
        ),
        "c3 1",
        "{major}: the changed and the deleted order are mended"
    );
    assert_eq!(
        p.target
            .psql_value("SELECT count(*) FROM public.line_items WHERE note <> 'live'"),
        lines_before,
        "{major}: the other table's rows are untouched"
    );
    converged(d, major, &["--table", "public.orders"]);
    assert_eq!(
        status_table(d, "public.orders")["state"],
        "verified",
        "{major}: verify promoted the table"
    );
    stop_follower(&mut child, &stderr, major);
    // Nothing follows: nothing to hold, refused.
    let refused = reseed(&[]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{major}: {err}");
    assert!(err.contains("flow shop is not following"), "{major}: {err}");
}
