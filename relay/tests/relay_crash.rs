//! kill -9 drill: the `trellara relay` process is killed repeatedly while a
//! writer commits transactions; after the last restart every committed
//! transaction is in the log exactly once, in commit order. This is
//! publish-then-acknowledge on a real server and a real disk: a crash
//! between fsync and the acknowledgement costs a duplicate on the wire
//! (skipped by the resume), never a gap.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use trellara_common::{Lsn, envelope};
use trellara_relay::log::{Log, LogConfig, storage::FsStorage};
use trellara_tests::{ClusterOptions, Major, test_cluster};

fn spawn(url: &str, dir: &std::path::Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_trellara"))
        .args([
            "relay",
            "--slot",
            "crash_s",
            "--publication",
            "p",
            "--source-id",
            "src",
        ])
        .arg("--log-dir")
        .arg(dir)
        .env("TRELLARA_SOURCE_DATABASE_URL", url)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn trellara relay")
}

#[test]
fn relay_survives_kill_9_without_gaps_or_duplicates() {
    let Some(cluster) = test_cluster(Major::Pg18, &ClusterOptions::new()) else {
        return;
    };
    cluster.psql(
        "CREATE TABLE sales (id bigint PRIMARY KEY);
         CREATE PUBLICATION p FOR TABLE sales;",
    );
    cluster.psql("SELECT pg_create_logical_replication_slot('crash_s', 'pgoutput')");
    let url = cluster.connection_string("postgres");
    let dir = tempfile::tempdir().expect("tempdir");
    let total = 300;

    let writer = {
        let url = url.clone();
        std::thread::spawn(move || {
            let mut client = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
            for i in 0..total {
                client
                    .execute("INSERT INTO sales VALUES ($1)", &[&(i as i64)])
                    .expect("insert");
                std::thread::sleep(Duration::from_millis(3));
            }
        })
    };
    let mut relay = spawn(&url, dir.path());
    for kill_after_ms in [150, 230, 90, 310] {
        std::thread::sleep(Duration::from_millis(kill_after_ms));
        kill(Pid::from_raw(relay.id() as i32), Signal::SIGKILL).expect("kill -9");
        relay.wait().expect("reap");
        relay = spawn(&url, dir.path());
    }
    writer.join().expect("writer");

    let end: Lsn = cluster
        .psql_value("SELECT pg_current_wal_lsn()")
        .parse()
        .expect("lsn");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let confirmed: Lsn = cluster
            .psql_value(
                "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'crash_s'",
            )
            .parse()
            .expect("lsn");
        if confirmed >= end {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "relay did not catch up: {confirmed} < {end}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    kill(Pid::from_raw(relay.id() as i32), Signal::SIGTERM).expect("sigterm");
    let status = relay.wait().expect("reap");
    assert!(status.success(), "relay exits cleanly on SIGTERM: {status}");

    let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("open");
    let mut ids = Vec::new();
    let mut last_commit = 0;
    for record in log.read_from(log.first_offset()).expect("read") {
        let env = envelope::decode(&record.expect("record").payload).expect("valid envelope");
        assert!(
            env.commit_lsn > last_commit,
            "commit order, and no transaction twice"
        );
        last_commit = env.commit_lsn;
        for change in &env.changes {
            if let Some(envelope::change::Body::Row(row)) = &change.body
                && let Some(envelope::value::Kind::Text(id)) =
                    row.after.first().and_then(|v| v.kind.as_ref())
            {
                ids.push(id.parse::<i64>().expect("id"));
            }
        }
    }
    assert_eq!(
        ids,
        (0..total as i64).collect::<Vec<_>>(),
        "every committed transaction, once, in order"
    );
}
