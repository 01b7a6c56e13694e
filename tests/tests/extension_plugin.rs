//! The `trellara` output plugin (extension/) against real servers, one test
//! per major: frames read with `pg_logical_slot_{peek,get}_binary_changes`
//! are reassembled with `native_frame::Reassembler`, decoded with
//! `envelope::decode`, and must match what the SQL did - values and order,
//! unchanged TOAST distinct from NULL, old keys and full old rows, truncate
//! flags, transactional messages, a 20k-row transaction in chunks, origin
//! filtering, prepared transactions - with commit LSN, end LSN, commit time
//! and xid equal to what pgoutput reports for the same transactions.
//!
//! The extension must already be installed into each major:
//! `scripts/test-extension` builds and installs it, then runs these tests
//! with `TRELLARA_EXTENSION_TESTS=1`. Without that variable they skip loudly;
//! with it, a missing `trellara.so` fails under `CI=true` (saying to run
//! `scripts/test-extension`) and is skipped, loudly, elsewhere.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use trellara_common::envelope::{
    self, BeforeImage, ColumnSchema, Envelope, Operation, RelationSchema, ReplicaIdentity, Value,
    boundary, capture, change, value,
};
use trellara_common::fingerprint::fingerprint;
use trellara_common::native_frame::{FrameHeader, MAX_FRAME_BYTES, Reassembler};
use trellara_tests::{Cluster, ClusterOptions, Major, all_majors_required, test_cluster};

const CHUNK_BYTES: usize = 1024 * 1024;
const LARGE_ROWS: usize = 20_000;

#[test]
fn extension_plugin_pg15() {
    live(Major::Pg15);
}

#[test]
fn extension_plugin_pg16() {
    live(Major::Pg16);
}

#[test]
fn extension_plugin_pg17() {
    live(Major::Pg17);
}

#[test]
fn extension_plugin_pg18() {
    live(Major::Pg18);
}

#[test]
fn extension_walsender_pg15() {
    walsender(Major::Pg15);
}

#[test]
fn extension_walsender_pg16() {
    walsender(Major::Pg16);
}

#[test]
fn extension_walsender_pg17() {
    walsender(Major::Pg17);
}

#[test]
fn extension_walsender_pg18() {
    walsender(Major::Pg18);
}

#[test]
fn extension_types_pg15() {
    types(Major::Pg15);
}

#[test]
fn extension_types_pg16() {
    types(Major::Pg16);
}

#[test]
fn extension_types_pg17() {
    types(Major::Pg17);
}

#[test]
fn extension_types_pg18() {
    types(Major::Pg18);
}

/// Set by `scripts/test-extension` after it has installed the extension it
/// just built into every major. Without it these tests skip (loudly): a plain
/// `cargo nextest run --workspace` (the step of `scripts/test` that runs
/// before `scripts/test-extension`) would otherwise test whatever `.so` an
/// earlier build left behind, or fail on a fresh machine.
const RUN_VAR: &str = "TRELLARA_EXTENSION_TESTS";

/// Whether to run against `trellara.so` in this major: only under
/// `scripts/test-extension`, and then a missing library fails under CI.
fn extension_installed(major: Major) -> bool {
    if std::env::var_os(RUN_VAR).is_none_or(|v| v != "1") {
        eprintln!(
            "SKIP {major}: the extension tests run under scripts/test-extension \
             (which builds and installs trellara.so, then sets {RUN_VAR}=1)"
        );
        return false;
    }
    let Ok(install) = major.locate() else {
        // test_cluster reports a missing major itself.
        return true;
    };
    let output = Command::new(install.pg_config())
        .arg("--pkglibdir")
        .output()
        .unwrap_or_else(|err| panic!("{major}: pg_config --pkglibdir: {err}"));
    let libdir = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    let so = libdir.join("trellara.so");
    if so.exists() {
        return true;
    }
    let message = format!(
        "{major}: {} is missing; run scripts/test-extension to build and install the extension",
        so.display()
    );
    if all_majors_required() {
        panic!("{message}");
    }
    eprintln!("SKIP {message}");
    false
}

fn text(s: impl Into<String>) -> Value {
    Value {
        kind: Some(value::Kind::Text(s.into())),
    }
}
fn null() -> Value {
    Value {
        kind: Some(value::Kind::Null(true)),
    }
}
fn absent() -> Value {
    Value {
        kind: Some(value::Kind::Absent(true)),
    }
}
fn unchanged_toast() -> Value {
    Value {
        kind: Some(value::Kind::UnchangedToast(true)),
    }
}

/// Frames and their envelopes, as read from the slot.
struct Read {
    envelopes: Vec<Envelope>,
    /// Encoded length of each envelope.
    sizes: Vec<usize>,
    frames: usize,
    max_frame: usize,
}

fn read_slot(cluster: &Cluster, function: &str, options: &[&str]) -> Read {
    let mut client = cluster.connect();
    let mut args = vec!["source_id", "src"];
    args.extend_from_slice(options);
    let sql = format!("SELECT data FROM {function}('s', NULL, NULL, VARIADIC $1::text[])");
    let rows = client.query(&sql, &[&args]).unwrap_or_else(|err| {
        panic!(
            "{}: {function} failed: {err:?}\n{}",
            cluster.major(),
            cluster.log_contents()
        )
    });
    let mut reassembler = Reassembler::new(64 * 1024 * 1024);
    let mut read = Read {
        envelopes: Vec::new(),
        sizes: Vec::new(),
        frames: rows.len(),
        max_frame: 0,
    };
    for row in &rows {
        let frame: Vec<u8> = row.get(0);
        read.max_frame = read.max_frame.max(frame.len());
        let (header, _) = FrameHeader::parse(&frame).expect("frame parses");
        if let Some(bytes) = reassembler.push(&frame).expect("frames reassemble") {
            let envelope = envelope::decode(&bytes).expect("envelope decodes and validates");
            assert_eq!(header.commit_lsn, envelope.commit_lsn, "frame commit LSN");
            assert_eq!(
                Some(header.envelope_index),
                envelope.boundary.as_ref().map(|b| b.chunk_index),
                "frame envelope index is the chunk index"
            );
            read.sizes.push(bytes.len());
            read.envelopes.push(envelope);
        }
    }
    reassembler.finish().expect("no envelope left incomplete");
    read
}

/// One transaction as pgoutput reports it: (commit LSN, end LSN, commit time).
fn pgoutput_commits(cluster: &Cluster) -> BTreeMap<u64, (u64, u64, i64)> {
    let mut client = cluster.connect();
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('po', NULL, NULL, \
             'proto_version', '1', 'publication_names', 'p')",
            &[],
        )
        .expect("pgoutput slot reads");
    let mut out = BTreeMap::new();
    let mut xid = 0u64;
    for row in &rows {
        let data: Vec<u8> = row.get(0);
        let be64 = |at: usize| u64::from_be_bytes(data[at..at + 8].try_into().unwrap());
        match data[0] {
            b'B' => xid = u64::from(u32::from_be_bytes(data[17..21].try_into().unwrap())),
            b'C' => {
                out.insert(xid, (be64(2), be64(10), be64(18) as i64));
            }
            _ => {}
        }
    }
    out
}

/// The relation schema the catalogs give, for comparing with the envelope's.
fn catalog_schema(cluster: &Cluster, table: &str) -> RelationSchema {
    let rows = cluster.psql(&format!(
        "SELECT c.oid, n.nspname, c.relname, c.relreplident FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = '{table}'::regclass"
    ));
    let (oid, nsp, name, ident) = (&rows[0][0], &rows[0][1], &rows[0][2], &rows[0][3]);
    let identity = match ident.as_str() {
        "d" => ReplicaIdentity::Default,
        "f" => ReplicaIdentity::Full,
        "i" => ReplicaIdentity::Index,
        _ => ReplicaIdentity::Nothing,
    };
    let columns = cluster
        .psql(&format!(
            "SELECT a.attname, a.atttypid, a.atttypmod, EXISTS (SELECT 1 FROM pg_index i \
               WHERE i.indrelid = a.attrelid AND a.attnum = ANY(i.indkey::int2[]) \
                 AND (i.indisreplident OR (i.indisprimary AND '{ident}' = 'd'))) \
             FROM pg_attribute a WHERE a.attrelid = '{table}'::regclass AND a.attnum > 0 \
               AND NOT a.attisdropped ORDER BY a.attnum"
        ))
        .into_iter()
        .map(|c| ColumnSchema {
            name: c[0].clone(),
            type_oid: c[1].parse().unwrap(),
            type_modifier: c[2].parse().unwrap(),
            key: identity == ReplicaIdentity::Full || c[3] == "t",
        })
        .collect();
    let mut schema = RelationSchema {
        relation_id: oid.parse().unwrap(),
        namespace: nsp.clone(),
        name: name.clone(),
        replica_identity: identity as i32,
        columns,
        fingerprint: 0,
    };
    schema.fingerprint = fingerprint(&schema);
    schema
}

fn rows_of(envelope: &Envelope) -> Vec<&envelope::RowChange> {
    envelope
        .changes
        .iter()
        .filter_map(|c| match &c.body {
            Some(change::Body::Row(row)) => Some(row),
            _ => None,
        })
        .collect()
}

fn sql_error(cluster: &Cluster, sql: &str) -> String {
    let err = cluster.try_psql(sql).expect_err("the statement must fail");
    err.db_error()
        .map(|db| format!("{} (hint: {:?})", db.message(), db.hint()))
        .unwrap_or_else(|| trellara_tests::error_chain(&err))
}

/// Runs each statement as its own transaction, in one session.
fn each(cluster: &Cluster, statements: &[&str]) {
    let mut client = cluster.connect();
    for sql in statements {
        client.batch_execute(sql).unwrap_or_else(|err| {
            panic!(
                "{}: `{sql}` failed: {}",
                cluster.major(),
                trellara_tests::error_chain(&err)
            )
        });
    }
}

fn live(major: Major) {
    if !extension_installed(major) {
        return;
    }
    let options = ClusterOptions::new()
        .shared_preload_library("trellara")
        .setting("logical_decoding_work_mem", "64kB")
        .setting("max_prepared_transactions", "4");
    let Some(cluster) = test_cluster(major, &options) else {
        return;
    };

    // SQL surface.
    cluster.psql("CREATE EXTENSION trellara");
    let version = include_str!("../../extension/Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("extension version");
    assert_eq!(
        cluster.psql("SELECT trellara.extension_version(), trellara.protocol_version()"),
        [[version, "1"]]
    );
    // Preloaded but no worker configured or started: the queue exists and
    // is empty; nothing is invented.
    assert_eq!(
        cluster.try_psql("SELECT * FROM trellara.status()").unwrap(),
        [[
            Some("not_running".to_owned()),
            None,
            None,
            Some("0".to_owned()),
            Some("16".to_owned()),
            None,
            Some("0".to_owned()),
            Some("0".to_owned()),
        ]]
    );

    // A dropped column in the middle: schemas skip it.
    cluster.psql(
        "CREATE TABLE docs (id bigint PRIMARY KEY, junk int, title text, body text);
         ALTER TABLE docs DROP COLUMN junk;
         ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
         CREATE TABLE audit (id int, note text, amount numeric(10,2));
         ALTER TABLE audit REPLICA IDENTITY FULL;
         CREATE PUBLICATION p FOR ALL TABLES;",
    );
    cluster.psql("SELECT pg_create_logical_replication_slot('po', 'pgoutput')");
    let start_lsn: u64 = {
        let lsn = cluster
            .psql_value("SELECT lsn FROM pg_create_logical_replication_slot('s', 'trellara')");
        let (hi, lo) = lsn.split_once('/').unwrap();
        (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap()
    };

    // Refusals that name their cause.
    let err = sql_error(
        &cluster,
        "SELECT * FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL, 'source_id', 'src', 'bogus', 'x')",
    );
    assert!(err.contains("unknown option \"bogus\""), "{major}: {err}");
    let err = sql_error(
        &cluster,
        "SELECT * FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL, 'max_frame_bytes', '70000')",
    );
    assert!(err.contains("\"max_frame_bytes\""), "{major}: {err}");
    let err = sql_error(
        &cluster,
        "SELECT * FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL)",
    );
    assert!(err.contains("\"source_id\" is required"), "{major}: {err}");
    let err = sql_error(
        &cluster,
        "SELECT pg_create_logical_replication_slot('s2', 'trellara', false, true)",
    );
    assert!(
        err.contains("two_phase") && err.contains("\"s2\""),
        "{major}: {err}"
    );
    assert_eq!(
        cluster.psql_value("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 's2'"),
        "0",
        "{major}: the refused two_phase slot is not left behind"
    );

    // 1. One of everything in one transaction.
    let big = "x".repeat(10_000);
    let mut client = cluster.connect();
    let mut tx = client.transaction().unwrap();
    tx.batch_execute(&format!(
        "INSERT INTO docs VALUES (1, 'first', '{big}');
         INSERT INTO audit VALUES (1, NULL, 9.50);
         UPDATE docs SET title = 'second' WHERE id = 1;
         UPDATE docs SET id = 2 WHERE id = 1;
         UPDATE audit SET note = 'n' WHERE id = 1;
         SELECT pg_logical_emit_message(true, 'app', 'hello');
         SELECT pg_logical_emit_message(false, 'app', 'not in any envelope');
         DELETE FROM docs WHERE id = 2;
         DELETE FROM audit WHERE id = 1;
         TRUNCATE audit RESTART IDENTITY;"
    ))
    .unwrap();
    let mixed_xid: u64 = tx
        .query_one("SELECT pg_current_xact_id()::text", &[])
        .unwrap()
        .get::<_, String>(0)
        .parse()
        .unwrap();
    tx.commit().unwrap();

    // 2. A large transaction: chunked envelopes, spilled change log.
    cluster.psql(&format!(
        "INSERT INTO audit SELECT g, repeat('p', 100), g FROM generate_series(1, {LARGE_ROWS}) g"
    ));

    // 3. A transaction replayed from a replication origin, then a local one.
    each(
        &cluster,
        &[
            "SELECT pg_replication_origin_create('upstream')",
            "SELECT pg_replication_origin_session_setup('upstream')",
            "INSERT INTO docs VALUES (100, 'from upstream', 'u')",
            "SELECT pg_replication_origin_session_reset()",
            "INSERT INTO docs VALUES (101, 'local', 'l')",
        ],
    );

    // 4. A prepared transaction (normal slot: decoded at COMMIT PREPARED).
    each(
        &cluster,
        &[
            "BEGIN; INSERT INTO docs VALUES (200, 'prepared', 'p'); PREPARE TRANSACTION 'gx'",
            "COMMIT PREPARED 'gx'",
        ],
    );

    let pgoutput = pgoutput_commits(&cluster);
    let all = read_slot(
        &cluster,
        "pg_logical_slot_peek_binary_changes",
        // Budget 0: every transaction's change log spills to a temp file.
        &["memory_budget_bytes", "0"],
    );
    eprintln!(
        "{major}: {} frames (largest {} bytes), {} envelopes, sizes {:?}",
        all.frames,
        all.max_frame,
        all.envelopes.len(),
        all.sizes
    );
    assert!(all.max_frame <= MAX_FRAME_BYTES, "{major}: frame too large");

    let system_identifier = cluster.psql_value("SELECT system_identifier FROM pg_control_system()");
    let timeline = cluster.psql_value("SELECT timeline_id FROM pg_control_checkpoint()");
    let docs = catalog_schema(&cluster, "docs");
    let audit = catalog_schema(&cluster, "audit");
    assert_eq!(
        docs.columns
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>(),
        ["id", "title", "body"]
    );

    // Every envelope: identity, capture, LSN order, pgoutput agreement.
    let mut previous_commit = start_lsn;
    for env in &all.envelopes {
        let source = env.source.as_ref().unwrap();
        assert_eq!(source.source_id, "src");
        assert_eq!(source.dataset_id, "postgres");
        assert_eq!(source.database, "postgres");
        assert_eq!(source.system_identifier.to_string(), system_identifier);
        assert_eq!(source.timeline.to_string(), timeline);
        let capture = env.capture.as_ref().unwrap();
        assert_eq!(capture.path, capture::Path::Native as i32);
        assert_eq!(capture.decoder, "trellara/1");
        assert_eq!(capture.server_version_num, cluster.server_version_num());
        assert!(env.begin_lsn > start_lsn && env.begin_lsn <= env.commit_lsn);
        assert!(env.commit_lsn < env.end_lsn);
        assert!(env.commit_lsn >= previous_commit, "{major}: commit order");
        previous_commit = env.commit_lsn;
        let (commit_lsn, end_lsn, commit_time) = pgoutput[&env.xid];
        assert_eq!(
            env.commit_lsn, commit_lsn,
            "{major}: xid {} commit LSN",
            env.xid
        );
        assert_eq!(env.end_lsn, end_lsn, "{major}: xid {} end LSN", env.xid);
        assert_eq!(
            env.commit_time_micros,
            commit_time + 946_684_800_000_000,
            "{major}: commit time in Unix micros"
        );
        for relation in &env.relations {
            let expected = if relation.name == "docs" {
                &docs
            } else {
                &audit
            };
            assert_eq!(
                relation, expected,
                "{major}: relation schema and fingerprint"
            );
        }
    }
    // Transactions in commit order, each envelope of one transaction adjacent.
    let xids: Vec<u64> = {
        let mut x: Vec<u64> = all.envelopes.iter().map(|e| e.xid).collect();
        x.dedup();
        x
    };
    assert_eq!(
        xids.len(),
        5,
        "{major}: mixed, large, origin, local, prepared"
    );
    assert_eq!(xids[0], mixed_xid);
    assert_eq!(pgoutput.len(), 5);

    // 1. The mixed transaction, change by change.
    let mixed = &all.envelopes[0];
    assert_eq!(
        mixed.boundary.as_ref().unwrap().mode,
        boundary::Mode::Whole as i32
    );
    assert_eq!(mixed.origin, "");
    assert_eq!(mixed.changes.len(), 9, "{major}: {:#?}", mixed.changes);
    let rows = rows_of(mixed);
    let row = |i: usize| -> (i32, i32, &[Value], &[Value], u32) {
        let r = rows[i];
        (
            r.operation,
            r.before_kind,
            &r.before,
            &r.after,
            r.relation_id,
        )
    };
    let (d, a) = (docs.relation_id, audit.relation_id);
    let none = BeforeImage::None as i32;
    let (ins, upd, del) = (
        Operation::Insert as i32,
        Operation::Update as i32,
        Operation::Delete as i32,
    );
    assert_eq!(
        row(0),
        (
            ins,
            none,
            &[][..],
            &[text("1"), text("first"), text(&big)][..],
            d
        )
    );
    assert_eq!(
        row(1),
        (
            ins,
            none,
            &[][..],
            &[text("1"), null(), text("9.50")][..],
            a
        )
    );
    assert_eq!(
        row(2),
        (
            upd,
            none,
            &[][..],
            &[text("1"), text("second"), unchanged_toast()][..],
            d
        ),
        "{major}: unchanged TOAST is its own kind, never NULL"
    );
    assert_eq!(
        row(3),
        (
            upd,
            BeforeImage::Key as i32,
            &[text("1"), absent(), absent()][..],
            &[text("2"), text("second"), unchanged_toast()][..],
            d
        ),
        "{major}: key-changing update carries the old key"
    );
    assert_eq!(
        row(4),
        (
            upd,
            BeforeImage::Full as i32,
            &[text("1"), null(), text("9.50")][..],
            &[text("1"), text("n"), text("9.50")][..],
            a
        ),
        "{major}: REPLICA IDENTITY FULL carries the whole old row"
    );
    match &mixed.changes[5].body {
        Some(change::Body::Message(m)) => {
            assert_eq!((m.prefix.as_str(), &m.content[..]), ("app", &b"hello"[..]))
        }
        other => panic!("{major}: change 5 should be the message: {other:?}"),
    }
    assert_eq!(
        row(5),
        (
            del,
            BeforeImage::Key as i32,
            &[text("2"), absent(), absent()][..],
            &[][..],
            d
        )
    );
    assert_eq!(
        row(6),
        (
            del,
            BeforeImage::Full as i32,
            &[text("1"), text("n"), text("9.50")][..],
            &[][..],
            a
        )
    );
    let truncate = rows[7];
    assert_eq!(truncate.operation, Operation::Truncate as i32);
    assert_eq!(truncate.relation_id, a);
    assert!(truncate.truncate_restart_identity && !truncate.truncate_cascade);

    // 2. The large transaction: several chunks, each within chunk_bytes,
    // together exactly the inserted rows in order.
    let large: Vec<(usize, &Envelope)> = all
        .envelopes
        .iter()
        .enumerate()
        .filter(|(_, e)| e.xid == xids[1])
        .collect();
    let count = large.len();
    assert!(count >= 2, "{major}: 20k rows should not fit one envelope");
    let mut sequence = 0u64;
    let mut values = Vec::new();
    for (k, (i, env)) in large.iter().enumerate() {
        let b = env.boundary.as_ref().unwrap();
        assert_eq!(b.mode, boundary::Mode::Chunked as i32);
        assert_eq!((b.chunk_index as usize, b.chunk_count as usize), (k, count));
        assert_eq!(b.first_sequence, sequence);
        assert_eq!(b.total_changes, LARGE_ROWS as u64);
        assert!(
            all.sizes[*i] <= CHUNK_BYTES,
            "{major}: chunk {k} is {} bytes",
            all.sizes[*i]
        );
        assert_eq!(env.relations, std::slice::from_ref(&audit));
        sequence += env.changes.len() as u64;
        values.extend(rows_of(env).into_iter().map(|r| r.after.clone()));
    }
    assert_eq!(sequence, LARGE_ROWS as u64);
    for (g, after) in (1..=LARGE_ROWS).zip(&values) {
        assert_eq!(
            after,
            &[
                text(g.to_string()),
                text("p".repeat(100)),
                text(format!("{g}.00"))
            ]
        );
    }

    // 3 and 4. Origin, local and prepared transactions.
    let tail: Vec<&Envelope> = all.envelopes.iter().skip(1 + count).collect();
    assert_eq!(tail.len(), 3);
    assert_eq!(tail[0].origin, "upstream");
    assert_eq!(rows_of(tail[0])[0].after[1], text("from upstream"));
    assert_eq!(tail[1].origin, "");
    assert_eq!(rows_of(tail[2])[0].after[1], text("prepared"));

    // origin = 'none' drops exactly the replayed transaction.
    let local = read_slot(
        &cluster,
        "pg_logical_slot_get_binary_changes",
        &[
            "origin",
            "none",
            "max_frame_bytes",
            "4096",
            "chunk_bytes",
            "65536",
        ],
    );
    assert!(local.max_frame <= 4096, "{major}: max_frame_bytes honoured");
    let local_xids: Vec<u64> = {
        let mut x: Vec<u64> = local.envelopes.iter().map(|e| e.xid).collect();
        x.dedup();
        x
    };
    assert_eq!(
        local_xids,
        [xids[0], xids[1], xids[3], xids[4]],
        "{major}: origin 'none' skips the replayed transaction only"
    );
    assert!(
        local.sizes.iter().all(|s| *s <= 65_536),
        "{major}: chunk_bytes honoured: {:?}",
        local.sizes
    );

    // The spilled (first read) and in-memory (this read, default 4 MiB
    // budget) change logs give the same changes, however they are chunked.
    let flatten = |read: &Read, xid: u64| -> Vec<envelope::Change> {
        read.envelopes
            .iter()
            .filter(|e| e.xid == xid)
            .flat_map(|e| e.changes.clone())
            .collect()
    };
    for xid in &local_xids {
        assert_eq!(
            flatten(&all, *xid),
            flatten(&local, *xid),
            "{major}: xid {xid}"
        );
    }

    // A schema change inside a transaction: the two versions of the table
    // never share an envelope, each carries the schema its rows were read with.
    each(
        &cluster,
        &["BEGIN;
           INSERT INTO docs VALUES (300, 'before', 'b');
           ALTER TABLE docs ADD COLUMN extra int;
           INSERT INTO docs VALUES (301, 'after', 'a', 7);
           COMMIT"],
    );
    let altered = read_slot(&cluster, "pg_logical_slot_get_binary_changes", &[]);
    assert_eq!(
        altered.envelopes.len(),
        2,
        "{major}: split at the schema change"
    );
    let widths: Vec<usize> = altered
        .envelopes
        .iter()
        .map(|e| e.relations[0].columns.len())
        .collect();
    assert_eq!(widths, [3, 4]);
    assert_eq!(
        altered.envelopes[1].relations[0],
        catalog_schema(&cluster, "docs")
    );
    assert_eq!(
        rows_of(&altered.envelopes[1])[0].after,
        [text("301"), text("after"), text("a"), text("7")]
    );

    // Fast-forward (slot advance) does not load the plugin: no options needed.
    cluster.psql("INSERT INTO docs VALUES (400, 'skipped', 's')");
    cluster.psql("SELECT pg_replication_slot_advance('s', pg_current_wal_lsn())");
    assert!(
        read_slot(&cluster, "pg_logical_slot_get_binary_changes", &[])
            .envelopes
            .is_empty(),
        "{major}: advanced past the insert"
    );

    // A DELETE that carries no key fails closed, naming the table.
    each(
        &cluster,
        &[
            "SELECT pg_drop_replication_slot('s')",
            "SELECT pg_drop_replication_slot('po')",
            "DROP PUBLICATION p",
            "CREATE TABLE nokey (v int)",
            "SELECT pg_create_logical_replication_slot('s', 'trellara')",
            "INSERT INTO nokey VALUES (1)",
            "DELETE FROM nokey",
        ],
    );
    let err = sql_error(
        &cluster,
        "SELECT * FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, 'source_id', 'src')",
    );
    assert!(
        err.contains("DELETE from public.nokey carries no old key"),
        "{major}: {err}"
    );

    // After all that (including ERRORs mid-decoding): no backend crashed, the
    // skipped non-transactional message was counted, no spill file is left.
    assert_eq!(cluster.psql_value("SELECT 1"), "1");
    let log = cluster.log_contents();
    assert!(
        !log.contains("terminated by signal") && !log.contains("PANIC"),
        "{major}: server log shows a crash:\n{log}"
    );
    assert!(
        log.contains("trellara: skipped 1 non-transactional logical message(s)"),
        "{major}: skipped messages are counted in the log"
    );
    let tmp = cluster.data_dir().join("base").join("pgsql_tmp");
    let spill_files = std::fs::read_dir(&tmp)
        .map(|d| {
            d.filter_map(Result::ok)
                // PostgreSQL's own are pgsql_tmp<pid>.<n>; anything else
                // would be a spill file left with a name.
                .filter(|e| !e.file_name().to_string_lossy().starts_with("pgsql_tmp"))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(spill_files, 0, "{major}: spill files are unlinked");
}

/// The same plugin under a walsender (`pg_recvlogical`, START_REPLICATION
/// ... LOGICAL): the frames it writes (each followed by a newline) reassemble
/// into the same envelopes.
fn walsender(major: Major) {
    if !extension_installed(major) {
        return;
    }
    let Some(cluster) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    cluster.psql("CREATE TABLE t (id int PRIMARY KEY, v text)");
    cluster.psql("SELECT pg_create_logical_replication_slot('w', 'trellara')");
    cluster.psql("INSERT INTO t SELECT g, repeat('v', 50) FROM generate_series(1, 3000) g");
    cluster.psql("INSERT INTO t VALUES (0, 'last')");
    let end = cluster.psql_value("SELECT pg_current_wal_lsn()");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("frames.bin");
    let status = Command::new(cluster.install().bin("pg_recvlogical"))
        .arg("-d")
        .arg(cluster.connection_config("postgres"))
        .args([
            "--slot",
            "w",
            "--start",
            "--no-loop",
            "--endpos",
            &end,
            "-f",
        ])
        .arg(&out)
        .args(["-o", "source_id=src", "-o", "chunk_bytes=65536"])
        .status()
        .expect("pg_recvlogical runs");
    assert!(
        status.success(),
        "{major}: pg_recvlogical: {status}\n{}",
        cluster.log_contents()
    );
    let bytes = std::fs::read(&out).unwrap();
    let mut rest = &bytes[..];
    let mut reassembler = Reassembler::new(1 << 24);
    let mut envelopes = Vec::new();
    while !rest.is_empty() {
        let len = 40 + u32::from_le_bytes(rest[24..28].try_into().unwrap()) as usize;
        let (frame, tail) = rest.split_at(len);
        assert_eq!(
            tail.first(),
            Some(&b'\n'),
            "{major}: pg_recvlogical ends each message with a newline"
        );
        if let Some(envelope) = reassembler
            .push(frame)
            .expect("walsender frames reassemble")
        {
            envelopes.push(envelope::decode(&envelope).expect("envelope decodes"));
        }
        rest = &tail[1..];
    }
    reassembler.finish().unwrap();
    let first: Vec<&Envelope> = envelopes
        .iter()
        .filter(|e| e.xid == envelopes[0].xid)
        .collect();
    assert!(first.len() >= 2, "{major}: 3000 rows in 64 KiB chunks");
    let rows: usize = first.iter().map(|e| e.changes.len()).sum();
    assert_eq!(rows, 3000);
    let last = envelopes.last().unwrap();
    assert_ne!(last.xid, envelopes[0].xid);
    assert_eq!(rows_of(last)[0].after, [text("0"), text("last")]);
}

/// Every value is the type's text output (its output function, as
/// `format('%s', column)` applies it) in the same session settings: scalars, arrays, enums, domains,
/// composites, JSON, ranges, bytea, time zones, Unicode, NULLs, a generated column,
/// and rows routed to a leaf partition (reported under the partition).
fn types(major: Major) {
    if !extension_installed(major) {
        return;
    }
    let Some(cluster) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    cluster.psql(
        "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
         CREATE DOMAIN posint AS int CHECK (VALUE > 0);
         CREATE TYPE pair AS (a int, b text);
         CREATE TABLE typed (
             id int PRIMARY KEY, i2 int2, i8 int8, f4 float4, f8 float8, n numeric(12,4),
             nn numeric, b bool, t text, vc varchar(10), ch char(3), by bytea, d date,
             ts timestamp, tz timestamptz, iv interval, u uuid, j json, jb jsonb,
             ia int[], ta text[], ip inet, m mood, p posint, c pair, tr tsrange,
             g int GENERATED ALWAYS AS (id * 2) STORED);
         CREATE TABLE parted (k int, v text) PARTITION BY RANGE (k);
         CREATE TABLE parted_low PARTITION OF parted FOR VALUES FROM (0) TO (100);
         CREATE TABLE parted_high PARTITION OF parted FOR VALUES FROM (100) TO (200);
         ALTER TABLE parted_low REPLICA IDENTITY FULL;",
    );
    cluster.psql("SELECT pg_create_logical_replication_slot('s', 'trellara')");
    each(
        &cluster,
        &[
            "INSERT INTO typed VALUES
           (1, -32768, 9223372036854775807, 1.5, 0.1, 12345678.1234, 'NaN', true,
            E'tab\\there ''quoted'' \\\\ back ünïcødé 🐘', 'varchar', 'ab', '\\x00ff10',
            '2024-02-29', '2024-02-29 12:34:56.789', '2024-02-29 12:34:56+05:30',
            '1 year 2 mons 3 days 04:05:06', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
            '{\"k\": [1, 2]}', '{\"k\": [1, 2]}', '{1,NULL,3}', '{\"a b\",NULL,c}',
            '10.0.0.1/8', 'happy', 7, ROW(1, 'x y'), '[2024-01-01,2024-02-01)')",
            "INSERT INTO typed (id) VALUES (2)",
            "INSERT INTO parted VALUES (5, 'low'), (150, 'high')",
            "UPDATE parted SET v = 'low2' WHERE k = 5",
            "BEGIN; INSERT INTO parted VALUES (10, 'kept'); SAVEPOINT a; \
             INSERT INTO parted VALUES (11, 'rolled back'); ROLLBACK TO a; \
             SAVEPOINT b; INSERT INTO parted VALUES (12, 'released'); RELEASE b; COMMIT",
            "BEGIN; INSERT INTO parted VALUES (13, 'aborted'); ROLLBACK",
        ],
    );
    let read = read_slot(&cluster, "pg_logical_slot_get_binary_changes", &[]);
    assert_eq!(
        read.envelopes.len(),
        5,
        "{major}: five committed transactions (the aborted one emits nothing)"
    );

    let columns: Vec<String> = cluster
        .psql(
            "SELECT attname FROM pg_attribute WHERE attrelid = 'typed'::regclass \
             AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        )
        .into_iter()
        .map(|r| r[0].clone())
        .collect();
    let select = columns
        .iter()
        // The output function, as format('%s') applies it (a cast to text
        // may differ: true::text is 'true', boolout gives 't').
        .map(|c| format!("CASE WHEN {c} IS NULL THEN NULL ELSE format('%s', {c}) END"))
        .collect::<Vec<_>>()
        .join(", ");
    let expected = cluster
        .try_psql(&format!("SELECT {select} FROM typed ORDER BY id"))
        .unwrap();
    for (env, want) in read.envelopes[..2].iter().zip(&expected) {
        assert_eq!(env.relations[0], catalog_schema(&cluster, "typed"));
        let got = &rows_of(env)[0].after;
        let want: Vec<Value> = want
            .iter()
            .map(|v| v.as_ref().map_or_else(null, |s| text(s.clone())))
            .collect();
        for ((name, g), w) in columns.iter().zip(got).zip(&want) {
            assert_eq!(g, w, "{major}: column {name}");
        }
    }

    // Partitioned table: one transaction, rows under their leaf partitions.
    let parted = &read.envelopes[2];
    let names: Vec<&str> = parted.relations.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["parted_low", "parted_high"]);
    assert_eq!(rows_of(parted).len(), 2);
    let update = rows_of(&read.envelopes[3])[0];
    assert_eq!(update.before_kind, BeforeImage::Full as i32);
    assert_eq!(update.before, [text("5"), text("low")]);
    assert_eq!(update.after, [text("5"), text("low2")]);

    // Subtransactions: the rolled-back one is gone, the released one kept.
    let kept: Vec<&Value> = rows_of(&read.envelopes[4])
        .iter()
        .map(|r| &r.after[1])
        .collect();
    assert_eq!(kept, [&text("kept"), &text("released")]);
}
