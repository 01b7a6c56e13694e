//! The external relay against real servers, on each major: pgoutput v2 from
//! a slot into the durable log, one envelope per committed transaction in
//! commit order (a large transaction streamed, then assembled), the slot
//! confirmed only up to what the log made durable, and a restart that
//! resumes without a gap or a duplicate in the log.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use trellara_common::Lsn;
use trellara_common::envelope::{self, Envelope, change, value};
use trellara_external_relay::pgoutput::ProtoVersion;
use trellara_relay::capture::{self, CaptureConfig, CaptureStats};
use trellara_relay::log::{Log, LogConfig, storage::FsStorage};
use trellara_tests::{Cluster, ClusterOptions, Major, test_cluster};

#[test]
fn relay_pg15() {
    live(Major::Pg15);
}

#[test]
fn relay_pg16() {
    live(Major::Pg16);
}

#[test]
fn relay_pg17() {
    live(Major::Pg17);
}

#[test]
fn relay_pg18() {
    live(Major::Pg18);
}

/// Capture running on its own thread until stopped.
struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<CaptureStats, String>>>,
}

impl Running {
    fn start(config: CaptureConfig) -> Running {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(capture::run(config, async {
                let _ = rx.await;
            }))
            .map_err(|e| e.to_string())
        });
        Running {
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    fn stop(mut self) -> CaptureStats {
        let _ = self.stop.take().map(|s| s.send(()));
        self.thread
            .take()
            .expect("running")
            .join()
            .expect("capture thread")
            .expect("capture ran cleanly")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
    }
}

fn config(cluster: &Cluster, dir: &Path) -> CaptureConfig {
    CaptureConfig {
        source: cluster.connection_string("postgres").parse().expect("url"),
        slot: "trellara_s".into(),
        publications: vec!["p".into()],
        create_slot: true,
        source_id: "src".into(),
        dataset_id: "sales".into(),
        log_dir: dir.to_path_buf(),
        proto_version: ProtoVersion::V2,
        memory_budget: 256 * 1024,
        chunk_bytes: 64 * 1024,
        status_interval: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
        pinned: HashMap::new(),
        schemas: HashMap::new(),
        floor: Default::default(),
        progress: None,
        begun: None,
        observe: None,
        rejoin_at: None,
        ddl: None,
    }
}

fn confirmed_flush(cluster: &Cluster) -> Option<Lsn> {
    let rows = cluster.psql(
        "SELECT coalesce(confirmed_flush_lsn::text, '') FROM pg_replication_slots WHERE slot_name = 'trellara_s'",
    );
    rows.first()?.first()?.parse().ok()
}

/// Waits until the slot is confirmed at or past `lsn`.
fn wait_confirmed(cluster: &Cluster, lsn: Lsn) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while confirmed_flush(cluster).is_none_or(|c| c < lsn) {
        assert!(
            Instant::now() < deadline,
            "slot not confirmed to {lsn} within 60 s (at {:?})",
            confirmed_flush(cluster)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn envelopes(dir: &Path) -> Vec<Envelope> {
    let (log, _) = Log::open(FsStorage::new(), dir, LogConfig::default()).expect("open log");
    log.read_from(log.first_offset())
        .expect("read")
        .map(|r| envelope::decode(&r.expect("record").payload).expect("valid envelope"))
        .collect()
}

fn inserted_ids(e: &Envelope) -> Vec<String> {
    e.changes
        .iter()
        .filter_map(|c| match &c.body {
            Some(change::Body::Row(r)) => match r.after.first().and_then(|v| v.kind.as_ref()) {
                Some(value::Kind::Text(s)) => Some(s.clone()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

fn live(major: Major) {
    let options = ClusterOptions::new().setting("logical_decoding_work_mem", "64kB");
    let Some(cluster) = test_cluster(major, &options) else {
        return;
    };
    cluster.psql(
        "CREATE TABLE sales (id bigint PRIMARY KEY, note text);
         CREATE TABLE unpublished (id int);
         CREATE PUBLICATION p FOR TABLE sales;",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let relay = Running::start(config(&cluster, dir.path()));
    // The slot exists once the relay has connected.
    let deadline = Instant::now() + Duration::from_secs(30);
    while confirmed_flush(&cluster).is_none() {
        assert!(Instant::now() < deadline, "relay never created its slot");
        std::thread::sleep(Duration::from_millis(50));
    }

    for i in 0..30 {
        cluster.psql(&format!("INSERT INTO sales VALUES ({i}, 'row {i}')"));
    }
    // Past logical_decoding_work_mem: streamed in blocks, assembled at commit.
    cluster.psql("INSERT INTO sales SELECT g, repeat('x', 100) FROM generate_series(1000, 4999) g");
    let end = Lsn(0).max(
        cluster
            .psql_value("SELECT pg_current_wal_lsn()")
            .parse()
            .expect("lsn"),
    );
    wait_confirmed(&cluster, end);
    relay.stop();

    let got = envelopes(dir.path());
    let mut txns: Vec<&Envelope> = Vec::new();
    for e in &got {
        let b = e.boundary.as_ref().expect("boundary");
        if b.chunk_index == 0 {
            txns.push(e);
        }
    }
    assert_eq!(txns.len(), 31, "{major}: one transaction per commit");
    for pair in got.windows(2) {
        assert!(
            pair[0].commit_lsn <= pair[1].commit_lsn,
            "{major}: commit order"
        );
    }
    for (i, e) in txns.iter().take(30).enumerate() {
        assert_eq!(inserted_ids(e), [i.to_string()], "{major}: transaction {i}");
        assert_eq!(e.source.as_ref().map(|s| s.source_id.as_str()), Some("src"));
    }
    let big: Vec<String> = got
        .iter()
        .filter(|e| e.commit_lsn == txns[30].commit_lsn)
        .flat_map(inserted_ids)
        .collect();
    assert_eq!(
        big.len(),
        4000,
        "{major}: the streamed transaction arrives whole"
    );
    assert!(
        got.len() > 31,
        "{major}: the large transaction was chunked ({} envelopes)",
        got.len()
    );

    // Publish then acknowledge: the slot is confirmed no further than the
    // last durable envelope (idle keepalives may add WAL with nothing open).
    let last_end = got.last().map(|e| Lsn(e.end_lsn)).expect("envelopes");
    assert!(confirmed_flush(&cluster).expect("slot") >= last_end);

    // Restart: resumes from the log, adds only what is new.
    let relay = Running::start(config(&cluster, dir.path()));
    for i in 30..40 {
        cluster.psql(&format!("INSERT INTO sales VALUES ({i}, 'row {i}')"));
    }
    cluster.psql("INSERT INTO unpublished VALUES (1)");
    let end: Lsn = cluster
        .psql_value("SELECT pg_current_wal_lsn()")
        .parse()
        .expect("lsn");
    wait_confirmed(&cluster, end);
    let stats = relay.stop();
    assert_eq!(
        stats.envelopes, 10,
        "{major}: only the new transactions were appended"
    );
    let all = envelopes(dir.path());
    assert_eq!(all.len(), got.len() + 10);
    let mut commits: Vec<u64> = all
        .iter()
        .filter(|e| e.boundary.as_ref().is_some_and(|b| b.chunk_index == 0))
        .map(|e| e.commit_lsn)
        .collect();
    let n = commits.len();
    commits.dedup();
    assert_eq!(commits.len(), n, "{major}: no transaction twice in the log");
}

/// Runs `scenario` against each supported major, naming it on stderr so a
/// failure says which one.
fn on_every_major(scenario: fn(Major)) {
    for major in Major::ALL {
        eprintln!("on {major}");
        scenario(major);
    }
}

/// Runs capture to completion (it must fail) and returns the error text.
fn capture_error(config: CaptureConfig) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let result = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(60),
            capture::run(config, std::future::pending()),
        )
        .await
    });
    match result {
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(stats)) => panic!("capture ended without an error: {stats:?}"),
        Err(_) => panic!("capture kept running; expected a definite error"),
    }
}

fn current_lsn(cluster: &Cluster) -> Lsn {
    cluster
        .psql_value("SELECT pg_current_wal_lsn()")
        .parse()
        .expect("lsn")
}

/// Captures a few transactions, then stops: a slot and a log to break.
fn prepared(cluster: &Cluster, dir: &Path) {
    cluster.psql(
        "CREATE TABLE sales (id bigint PRIMARY KEY, note text);
         CREATE PUBLICATION p FOR TABLE sales;",
    );
    let relay = Running::start(config(cluster, dir));
    let deadline = Instant::now() + Duration::from_secs(30);
    while confirmed_flush(cluster).is_none() {
        assert!(Instant::now() < deadline, "relay never created its slot");
        std::thread::sleep(Duration::from_millis(50));
    }
    cluster.psql("INSERT INTO sales VALUES (1, 'a')");
    wait_confirmed(cluster, current_lsn(cluster));
    relay.stop();
}

#[test]
fn a_slot_advanced_past_the_log_is_a_named_gap() {
    on_every_major(a_slot_advanced_past_the_log_is_a_named_gap_on);
}

fn a_slot_advanced_past_the_log_is_a_named_gap_on(major: Major) {
    let Some(cluster) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    prepared(&cluster, dir.path());
    cluster.psql("INSERT INTO sales VALUES (2, 'b')");
    cluster.psql("SELECT pg_replication_slot_advance('trellara_s', pg_current_wal_lsn())");
    let err = capture_error(config(&cluster, dir.path()));
    assert!(
        err.contains("trellara_s")
            && err.contains("past what the log holds")
            && err.contains("reseed"),
        "{err}"
    );
}

#[test]
fn a_slot_held_by_another_consumer_is_named() {
    on_every_major(a_slot_held_by_another_consumer_is_named_on);
}

fn a_slot_held_by_another_consumer_is_named_on(major: Major) {
    let Some(cluster) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    prepared(&cluster, dir.path());
    let holder = Running::start(config(&cluster, dir.path()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.psql_value("SELECT count(*) FROM pg_replication_slots WHERE active") != "1" {
        assert!(Instant::now() < deadline, "first relay never became active");
        std::thread::sleep(Duration::from_millis(50));
    }
    let other = tempfile::tempdir().expect("tempdir");
    let err = capture_error(config(&cluster, other.path()));
    assert!(err.contains("held by another process"), "{err}");
    holder.stop();
}

#[test]
fn an_invalidated_slot_stops_capture_with_reseed() {
    on_every_major(an_invalidated_slot_stops_capture_with_reseed_on);
}

fn an_invalidated_slot_stops_capture_with_reseed_on(major: Major) {
    let options = ClusterOptions::new().setting("max_slot_wal_keep_size", "1MB");
    let Some(cluster) = test_cluster(major, &options) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    prepared(&cluster, dir.path());
    // Push the slot's retained WAL far past max_slot_wal_keep_size.
    for _ in 0..4 {
        cluster.psql("CREATE TABLE IF NOT EXISTS filler (v text); INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 20000)");
        cluster.psql("SELECT pg_switch_wal()");
    }
    cluster.psql("CHECKPOINT");
    let status = cluster
        .psql_value("SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'trellara_s'");
    assert_eq!(status, "lost", "the slot should be invalidated by now");
    let err = capture_error(config(&cluster, dir.path()));
    assert!(
        err.contains("invalidated") && err.contains("reseed"),
        "{err}"
    );
}

#[test]
fn schema_drift_mid_stream_stops_capture_naming_the_relation() {
    on_every_major(schema_drift_mid_stream_stops_capture_naming_the_relation_on);
}

fn schema_drift_mid_stream_stops_capture_naming_the_relation_on(major: Major) {
    let Some(cluster) = test_cluster(major, &ClusterOptions::new()) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    prepared(&cluster, dir.path());
    let mut cfg = config(&cluster, dir.path());
    cfg.create_slot = false;
    // The fingerprint pinned when capture started, as a flow config will.
    let relay = Running::start(config(&cluster, dir.path()));
    cluster.psql("INSERT INTO sales VALUES (2, 'b')");
    wait_confirmed(&cluster, current_lsn(&cluster));
    relay.stop();
    let pinned = envelopes(dir.path())
        .last()
        .and_then(|e| e.relations.first().map(|r| r.fingerprint))
        .expect("a relation");
    cfg.pinned.insert("public.sales".into(), pinned);
    cluster.psql("ALTER TABLE sales ADD COLUMN region text");
    cluster.psql("INSERT INTO sales VALUES (3, 'c', 'eu')");
    let err = capture_error(cfg);
    assert!(
        err.contains("schema drift on public.sales") && err.contains(&format!("{pinned:#018x}")),
        "{err}"
    );
    let ids: Vec<String> = envelopes(dir.path())
        .iter()
        .flat_map(inserted_ids)
        .collect();
    assert_eq!(ids, ["1", "2"], "no row under the new schema was assembled");
}

#[test]
fn streamed_subtransaction_rollback_is_discarded_on_every_major() {
    for major in Major::ALL {
        let options = ClusterOptions::new().setting("logical_decoding_work_mem", "64kB");
        let Some(cluster) = test_cluster(major, &options) else {
            continue;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        prepared(&cluster, dir.path());
        let relay = Running::start(config(&cluster, dir.path()));
        // Each part is far past logical_decoding_work_mem, so the rolled-back
        // subtransaction is streamed before its abort arrives.
        cluster.psql(
            "BEGIN;
             INSERT INTO sales SELECT g, repeat('k', 100) FROM generate_series(100, 2099) g;
             SAVEPOINT s1;
             INSERT INTO sales SELECT g, repeat('r', 100) FROM generate_series(5000, 6999) g;
             ROLLBACK TO SAVEPOINT s1;
             INSERT INTO sales SELECT g, repeat('k', 100) FROM generate_series(9000, 9999) g;
             COMMIT;",
        );
        wait_confirmed(&cluster, current_lsn(&cluster));
        relay.stop();
        let all = envelopes(dir.path());
        let last_commit = all.last().map(|e| e.commit_lsn).expect("envelopes");
        let ids: Vec<i64> = all
            .iter()
            .filter(|e| e.commit_lsn == last_commit)
            .flat_map(inserted_ids)
            .map(|s| s.parse().expect("id"))
            .collect();
        let want: Vec<i64> = (100..2100).chain(9000..10000).collect();
        assert_eq!(
            ids, want,
            "{major}: the rolled-back subtransaction is gone, the rest is whole"
        );
    }
}
