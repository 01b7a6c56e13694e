//! Tests of the harness itself: options, restart, `output_plugin_libraries`, and that
//! no server or directory outlives its `Cluster` (drop, and a killed test process).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use trellara_tests::{
    ClusterOptions, Major, error_chain, for_each_major, for_each_major_with, majors_for_test,
    postgres, test_cluster,
};

const WATCHDOG_CHILD_VAR: &str = "TRELLARA_TESTS_WATCHDOG_CHILD";

/// insufficient_privilege: what a server with `output_plugin_libraries` answers for
/// an unlisted plugin.
const REFUSED: &str = "42501";

#[test]
fn clusters_are_removed_on_drop() {
    let mut seen: Vec<(u16, PathBuf)> = Vec::new();
    for_each_major(|cluster| {
        assert!(cluster.data_dir().join("PG_VERSION").exists());
        assert!(
            cluster
                .log_contents()
                .contains("ready to accept connections")
        );
        assert!(
            cluster
                .connection_string("postgres")
                .starts_with("postgresql://postgres@127.0.0.1:")
        );
        let mut client =
            postgres::Client::connect(&cluster.connection_config("postgres"), postgres::NoTls)
                .expect("connect with the key-value connection string");
        let one: i32 = client.query_one("SELECT 1", &[]).expect("SELECT 1").get(0);
        assert_eq!(one, 1);
        seen.push((cluster.port(), cluster.socket_dir().to_path_buf()));
    });
    for (port, dir) in seen {
        assert!(!dir.exists(), "{} survived its cluster", dir.display());
        let refused = postgres::Client::connect(
            &format!("host=127.0.0.1 port={port} user=postgres connect_timeout=2"),
            postgres::NoTls,
        );
        assert!(refused.is_err(), "a server still answers on port {port}");
    }
}

#[test]
fn options_apply_and_survive_restart() {
    for major in majors_for_test() {
        let options = ClusterOptions::new()
            .setting("work_mem", "7MB")
            .setting("application_name", "it's quoted")
            .shared_preload_library("pgoutput");
        let Some(mut cluster) = test_cluster(major, &options) else {
            continue;
        };
        let port = cluster.port();
        cluster.psql("CREATE TABLE kept (id int); INSERT INTO kept VALUES (1)");
        cluster
            .restart()
            .unwrap_or_else(|err| panic!("{major}: restart failed: {}", error_chain(&err)));
        assert_eq!(cluster.port(), port);
        assert_eq!(cluster.psql_value("SHOW work_mem"), "7MB");
        assert_eq!(
            cluster.psql_value("SHOW shared_preload_libraries"),
            "pgoutput"
        );
        assert_eq!(cluster.psql_value("SELECT count(*) FROM kept"), "1");
        let rows = cluster.psql("SELECT NULL::text, 'x'");
        assert_eq!(rows, [["", "x"]]);
        let rows = cluster.try_psql("SELECT NULL::text").expect("query");
        assert_eq!(rows, [[None]]);
        let err = cluster
            .try_psql("SELECT * FROM missing_table")
            .expect_err("missing table");
        assert_eq!(err.db_error().map(|e| e.code().code()), Some("42P01"));
    }
}

#[test]
fn output_plugin_libraries_allow_trellara() {
    for_each_major(|cluster| {
        if cluster.has_output_plugin_libraries() {
            assert_eq!(
                cluster.psql_value("SHOW output_plugin_libraries"),
                "pgoutput, test_decoding, trellara"
            );
        }
        // Whether or not the extension is installed, it must not be refused.
        if let Err(err) =
            cluster.try_psql("SELECT pg_create_logical_replication_slot('t', 'trellara')")
        {
            assert_ne!(
                err.db_error().map(|e| e.code().code()),
                Some(REFUSED),
                "{}: {}",
                cluster.server_version(),
                error_chain(&err)
            );
        }
    });
}

#[test]
fn default_output_plugin_libraries_refuse_trellara() {
    let options = ClusterOptions::new().keep_default_output_plugin_libraries();
    for_each_major_with(&options, |cluster| {
        let result = cluster.try_psql("SELECT pg_create_logical_replication_slot('t', 'trellara')");
        if cluster.has_output_plugin_libraries() {
            let err = result.expect_err("an unlisted plugin must be refused");
            assert_eq!(
                err.db_error().map(|e| e.code().code()),
                Some(REFUSED),
                "{}",
                error_chain(&err)
            );
        }
    });
}

/// Starts a cluster in a child test process, SIGKILLs that process (so no `Drop`
/// runs) and checks that the watchdog stops the server and removes its directory.
#[test]
fn watchdog_cleans_up_after_a_killed_test_process() {
    let Some(&major) = majors_for_test().first() else {
        eprintln!("no major available; skipping");
        return;
    };
    let exe = std::env::current_exe().expect("path of this test binary");
    let mut child = Command::new(exe)
        .args(["--exact", "watchdog_child", "--ignored", "--nocapture"])
        .env(WATCHDOG_CHILD_VAR, major.number().to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the child test process");
    let stdout = child.stdout.take().expect("piped stdout");
    let line = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|line| line.starts_with("CLUSTER "));
    // Our own child, by pid.
    child.kill().expect("kill the child test process");
    child.wait().expect("reap the child test process");
    let line = line.expect("the child printed its cluster");
    let mut parts = line.split(' ').skip(1);
    let port: u16 = parts.next().and_then(|p| p.parse().ok()).expect("port");
    let dir = PathBuf::from(parts.next().expect("dir"));

    let deadline = Instant::now() + Duration::from_secs(20);
    while dir.exists() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    assert!(!dir.exists(), "watchdog left {} behind", dir.display());
    let refused = postgres::Client::connect(
        &format!("host=127.0.0.1 port={port} user=postgres connect_timeout=2"),
        postgres::NoTls,
    );
    assert!(refused.is_err(), "a server still answers on port {port}");
}

/// Helper process for the watchdog test; does nothing unless that test runs it.
#[test]
#[ignore = "run by watchdog_cleans_up_after_a_killed_test_process"]
fn watchdog_child() {
    let Some(major) = std::env::var(WATCHDOG_CHILD_VAR)
        .ok()
        .and_then(|n| n.parse().ok())
        .and_then(Major::from_number)
    else {
        return;
    };
    let cluster = test_cluster(major, &ClusterOptions::new()).expect("major available");
    println!(
        "CLUSTER {} {}",
        cluster.port(),
        cluster.socket_dir().display()
    );
    // Bounded: the parent kills us long before this ends.
    thread::sleep(Duration::from_secs(60));
}
