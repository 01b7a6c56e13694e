//! The native path end to end on every major: the extension's background
//! worker (preloaded, configured by trellara.* settings) decodes its slot,
//! and `trellara relay --native-socket` (run as the server's OS user)
//! appends what it sends to the durable log. Checked against the source:
//! every committed transaction's xid is in the log, once, in commit order;
//! the slot never moves while the relay is down or has not acknowledged;
//! a worker killed with SIGKILL replays with no gap; a stalled relay fills
//! the 16-slot queue (backpressured) and loses nothing when it resumes.
//!
//! Needs `trellara.so` installed into each major: `scripts/test-extension`
//! builds it and runs this with `TRELLARA_EXTENSION_TESTS=1`; without that
//! variable the tests skip, loudly.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use trellara_common::envelope::{self, change, value};
use trellara_relay::log::{Log, LogConfig, storage::FsStorage};
use trellara_tests::endpoints::{http_get, metric};
use trellara_tests::{Cluster, ClusterOptions, Major, OS_USER, test_cluster};

const SLOT: &str = "native_slot";
const SOURCE_ID: &str = "native-src";

fn enabled(major: Major) -> bool {
    if std::env::var_os("TRELLARA_EXTENSION_TESTS").is_none_or(|v| v != "1") {
        eprintln!(
            "SKIP {major}: the native worker tests run under scripts/test-extension (TRELLARA_EXTENSION_TESTS=1)"
        );
        return false;
    }
    true
}

struct Native {
    cluster: Cluster,
    dir: tempfile::TempDir,
    relay: Option<Child>,
}

impl Native {
    fn start(major: Major) -> Option<Native> {
        if !enabled(major) {
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let owner = nix::unistd::User::from_name(OS_USER)
            .expect("getpwnam")
            .expect("OS user trellara (scripts/setup creates it)");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        nix::unistd::chown(dir.path(), Some(owner.uid), Some(owner.gid)).expect("chown");
        let socket = dir.path().join("relay.sock");
        let options = ClusterOptions::new()
            .shared_preload_library("trellara")
            .setting("trellara.enabled", "on")
            .setting("trellara.database", "postgres")
            .setting("trellara.slot", SLOT)
            .setting("trellara.source_id", SOURCE_ID)
            .setting("trellara.socket_path", socket.display().to_string())
            .setting("trellara.max_backoff", "500")
            // Small, so the large transactions below spill in the server.
            .setting("logical_decoding_work_mem", "64kB")
            // Not UTC: the worker must still write times in UTC.
            .setting("timezone", "Asia/Tokyo");
        let cluster = test_cluster(major, &options)?;
        cluster.psql("CREATE EXTENSION trellara");
        cluster.psql(&format!(
            "SELECT pg_create_logical_replication_slot('{SLOT}', 'trellara')"
        ));
        cluster.psql(
            "CREATE TABLE public.xids (xid bigint PRIMARY KEY);
             CREATE TABLE public.items (id bigint PRIMARY KEY, body text, qty int);
             CREATE TABLE public.notes (id bigint, note text);
             CREATE TABLE public.times (id int PRIMARY KEY, at timestamptz);
             ALTER TABLE public.notes REPLICA IDENTITY FULL;",
        );
        Some(Native {
            cluster,
            dir,
            relay: None,
        })
    }

    fn log_dir(&self) -> PathBuf {
        self.dir.path().join("log")
    }

    fn start_relay(&mut self) {
        // As the server's OS user (the socket's peer check wants the same
        // uid), started directly: runuser would stop itself when the relay
        // is stopped and never return.
        let owner = nix::unistd::User::from_name(OS_USER)
            .expect("getpwnam")
            .expect("OS user");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_trellara"));
        std::os::unix::process::CommandExt::uid(&mut cmd, owner.uid.as_raw());
        std::os::unix::process::CommandExt::gid(&mut cmd, owner.gid.as_raw());
        cmd.arg("relay")
            .arg("--native-socket")
            .arg(self.dir.path().join("relay.sock"))
            .arg("--log-dir")
            .arg(self.log_dir())
            .args(["--source-id", SOURCE_ID])
            .env(
                "RUST_LOG",
                std::env::var("TRELLARA_RELAY_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        self.relay = Some(cmd.spawn().expect("spawn trellara relay"));
    }

    fn relay_pid(&self) -> i32 {
        self.relay.as_ref().expect("relay running").id() as i32
    }

    fn signal_relay(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.relay_pid()), signal)
            .expect("signal relay");
    }

    /// Stops the relay (SIGTERM, or SIGKILL when `hard`).
    fn stop_relay(&mut self, hard: bool) {
        if self.relay.is_none() {
            return;
        }
        let signal = if hard {
            nix::sys::signal::Signal::SIGKILL
        } else {
            nix::sys::signal::Signal::SIGTERM
        };
        self.signal_relay(signal);
        let mut child = self.relay.take().expect("relay");
        let _ = child.wait();
    }

    fn status(&self) -> (String, String, i32, i32) {
        let row = self.cluster.psql(
            "SELECT state, coalesce(reason, ''), coalesce(pid, 0), coalesce(queue_occupancy, -1) FROM trellara.status()",
        );
        let r = &row[0];
        (
            r[0].clone(),
            r[1].clone(),
            r[2].parse().expect("pid"),
            r[3].parse().expect("occupancy"),
        )
    }

    fn confirmed(&self) -> String {
        self.cluster.psql_value(&format!(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        ))
    }

    /// Waits until the slot is confirmed at or past the current WAL insert
    /// position taken now (every transaction committed so far is durable).
    fn wait_caught_up(&self) {
        let target = self
            .cluster
            .psql_value("SELECT pg_current_wal_insert_lsn()");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let done = self.cluster.psql_value(&format!(
                "SELECT coalesce(confirmed_flush_lsn >= '{target}'::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
            ));
            if done == "t" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "slot not confirmed past {target} within 120 s; status {:?}, confirmed {}\n{}",
                self.status(),
                self.confirmed(),
                self.cluster.log_contents()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the worker to reach `state`.
    fn wait_state(&self, state: &str) -> (String, String, i32, i32) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let status = self.status();
            if status.0 == state {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "worker never reached {state}: {status:?}\n{}",
                self.cluster.log_contents()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The transactions in the log, `(xid, commit LSN)` per complete
    /// transaction, in log order; the relay must be stopped.
    fn logged(&self) -> Vec<(u64, u64)> {
        assert!(
            self.relay.is_none(),
            "stop the relay before reading its log"
        );
        let (log, _) =
            Log::open(FsStorage::new(), self.log_dir(), LogConfig::default()).expect("open log");
        let mut out = Vec::new();
        for record in log.read_from(log.first_offset()).expect("read") {
            let record = record.expect("record");
            let env = envelope::decode(&record.payload).expect("valid envelope");
            let b = env.boundary.unwrap_or_default();
            if b.chunk_index + 1 >= b.chunk_count.max(1) {
                out.push((env.xid, env.commit_lsn));
            }
        }
        drop(log);
        // Opened as root: hand anything it created back to the relay's user.
        let status = Command::new("chown")
            .args(["-R", OS_USER])
            .arg(self.log_dir())
            .status()
            .expect("chown");
        assert!(status.success());
        out
    }

    /// The xids the workload recorded in `public.xids`.
    fn source_xids(&self) -> BTreeSet<u64> {
        self.cluster
            .psql("SELECT xid FROM public.xids")
            .into_iter()
            .map(|r| r[0].parse().expect("xid"))
            .collect()
    }

    /// Asserts every recorded transaction is in the log exactly once and in
    /// commit-LSN order.
    fn assert_no_gap(&self) -> Vec<(u64, u64)> {
        let logged = self.logged();
        let mut seen = BTreeSet::new();
        for pair in logged.windows(2) {
            assert!(pair[0].1 < pair[1].1, "log out of commit order: {pair:?}");
        }
        for (xid, _) in &logged {
            assert!(seen.insert(*xid), "xid {xid} appended twice");
        }
        let missing: Vec<_> = self.source_xids().difference(&seen).copied().collect();
        assert!(
            missing.is_empty(),
            "committed xids missing from the log: {missing:?}"
        );
        logged
    }
}

impl Drop for Native {
    fn drop(&mut self) {
        if let Some(mut child) = self.relay.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One small transaction that records its xid.
fn small(cluster: &Cluster, id: i64) {
    cluster.psql(&format!(
        "BEGIN; INSERT INTO public.items VALUES ({id}, 'b{id}', 1);
         INSERT INTO public.xids VALUES (txid_current()); COMMIT;"
    ));
}

fn on_every_major(scenario: fn(Major)) {
    for major in Major::ALL {
        eprintln!("on {major}");
        scenario(major);
    }
}

/// Every callback through the worker into the log: insert, update,
/// delete, truncate, multi-table, a transaction far beyond 64 KiB and
/// logical_decoding_work_mem, unchanged TOAST, replica identity full.
#[test]
fn worker_captures_every_change_kind() {
    on_every_major(|major| {
        let Some(mut n) = Native::start(major) else {
            return;
        };
        n.start_relay();
        n.wait_state("running");
        let c = &n.cluster;
        small(c, 1);
        c.psql(
            "BEGIN; UPDATE public.items SET qty = 2 WHERE id = 1;
             INSERT INTO public.notes VALUES (1, 'n1');
             INSERT INTO public.xids VALUES (txid_current()); COMMIT;
             BEGIN; UPDATE public.notes SET note = 'n2' WHERE id = 1;
             DELETE FROM public.items WHERE id = 1;
             INSERT INTO public.xids VALUES (txid_current()); COMMIT;",
        );
        // A time, written by the worker in UTC whatever the server's zone.
        c.psql(
            "BEGIN; INSERT INTO public.times VALUES (1, '2026-01-02 03:04:05+00');
             INSERT INTO public.xids VALUES (txid_current()); COMMIT;",
        );
        // Large TOASTed value, then an update of another column only.
        c.psql(
            "BEGIN; INSERT INTO public.items VALUES (2, (SELECT string_agg(md5(i::text), '') FROM generate_series(1, 4000) i), 1);
             INSERT INTO public.xids VALUES (txid_current()); COMMIT;
             BEGIN; UPDATE public.items SET qty = 3 WHERE id = 2;
             INSERT INTO public.xids VALUES (txid_current()); COMMIT;",
        );
        // Far larger than one 64 KiB frame and logical_decoding_work_mem.
        c.psql(
            "BEGIN; INSERT INTO public.items SELECT i, repeat('x', 200), i FROM generate_series(100, 20099) i;
             INSERT INTO public.xids VALUES (txid_current()); COMMIT;
             BEGIN; TRUNCATE public.notes; INSERT INTO public.xids VALUES (txid_current()); COMMIT;",
        );
        n.wait_caught_up();
        let (state, _, _, occupancy) = n.status();
        assert_eq!((state.as_str(), occupancy), ("running", 0));
        n.stop_relay(false);
        let logged = n.assert_no_gap();

        // Read the changes back: kinds, unchanged TOAST, full old rows.
        let (log, _) =
            Log::open(FsStorage::new(), n.log_dir(), LogConfig::default()).expect("open log");
        let mut ops = Vec::new();
        let mut unchanged_toast = 0;
        let mut full_before = 0;
        let mut big_rows = 0;
        let mut time_text = None;
        for record in log.read_from(log.first_offset()).expect("read") {
            let env = envelope::decode(&record.expect("record").payload).expect("envelope");
            let table = |id: u32| {
                env.relations
                    .iter()
                    .find(|r| r.relation_id == id)
                    .map(|r| format!("{}.{}", r.namespace, r.name))
                    .unwrap_or_default()
            };
            for ch in &env.changes {
                let Some(change::Body::Row(row)) = &ch.body else {
                    continue;
                };
                let op = row.operation();
                ops.push(op);
                unchanged_toast += row
                    .after
                    .iter()
                    .filter(|v| matches!(v.kind, Some(value::Kind::UnchangedToast(true))))
                    .count();
                let relation = table(row.relation_id);
                if relation == "public.notes" && !row.before.is_empty() {
                    full_before += 1;
                }
                if relation == "public.items" && op == envelope::Operation::Insert {
                    big_rows += 1;
                }
                if relation == "public.times" {
                    time_text = row.after.get(1).and_then(|v| match &v.kind {
                        Some(value::Kind::Text(t)) => Some(t.clone()),
                        _ => None,
                    });
                }
            }
        }
        drop(log);
        assert!(big_rows >= 20_000, "{big_rows} item inserts");
        assert_eq!(
            time_text.as_deref(),
            Some("2026-01-02 03:04:05+00"),
            "{major}: times in UTC, as the external path writes them"
        );
        assert!(
            unchanged_toast >= 1,
            "the TOASTed body is marked unchanged, not NULL"
        );
        assert!(
            full_before >= 1,
            "REPLICA IDENTITY FULL carries the old row"
        );
        for op in [
            envelope::Operation::Insert,
            envelope::Operation::Update,
            envelope::Operation::Delete,
            envelope::Operation::Truncate,
        ] {
            assert!(ops.contains(&op), "{op:?} captured on {major}");
        }
        assert!(logged.len() >= 6);
    });
}

/// The relay is down, then stalled (SIGSTOP), then killed before it
/// acknowledged: the slot stays put each time; the worker waits with
/// backoff and says why; when a relay is back, nothing is missing.
#[test]
fn slot_moves_only_on_durable_acknowledgement() {
    on_every_major(|major| {
        let Some(mut n) = Native::start(major) else {
            return;
        };
        let (_, reason, _, _) = n.wait_state("waiting_for_relay");
        assert!(reason.contains("relay.sock"), "{reason}");
        let before = n.confirmed();
        small(&n.cluster, 1);
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(n.confirmed(), before, "no relay, no movement");

        n.start_relay();
        n.wait_caught_up();
        let caught_up = n.confirmed();
        assert_ne!(caught_up, before);

        // Stalled: frames may reach the socket, but nothing is acknowledged.
        n.signal_relay(nix::sys::signal::Signal::SIGSTOP);
        small(&n.cluster, 2);
        std::thread::sleep(Duration::from_secs(2));
        assert_eq!(n.confirmed(), caught_up, "not acknowledged, not confirmed");
        // Killed before acknowledging.
        n.stop_relay(true);
        std::thread::sleep(Duration::from_secs(1));
        assert_eq!(n.confirmed(), caught_up, "relay died: slot stays");
        n.wait_state("waiting_for_relay");

        n.start_relay();
        small(&n.cluster, 3);
        n.wait_caught_up();

        // WAL from another database holds no transaction of ours: the idle
        // slot still follows it (recorded durably by the relay first), so
        // the server can recycle that WAL.
        n.cluster.psql("CREATE DATABASE other");
        let mut other = n.cluster.try_connect("other").expect("connect other");
        other
            .batch_execute(
                "CREATE TABLE t (i int); INSERT INTO t SELECT generate_series(1, 10000);",
            )
            .expect("other writes");
        n.wait_caught_up();
        n.stop_relay(false);
        n.assert_no_gap();
    });
}

/// SIGKILL of the worker (the server restarts its processes; the worker
/// comes back and replays from confirmed_flush), then SIGTERM (only the
/// worker restarts): duplicates at most, no gap.
#[test]
fn worker_killed_replays_without_gap() {
    on_every_major(|major| {
        let Some(mut n) = Native::start(major) else {
            return;
        };
        n.start_relay();
        n.wait_state("running");
        for i in 0..50 {
            small(&n.cluster, i);
        }
        let (_, _, pid, _) = n.status();
        assert!(pid > 0);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .expect("kill worker");
        // The postmaster restarts every process after a backend crash; a
        // query may still succeed before it noticed, so wait for the new
        // worker, not for a connection.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let restarted = n
                .cluster
                .try_psql("SELECT coalesce(pid, 0) FROM trellara.status()")
                .ok()
                .and_then(|rows| rows.first()?.first()?.clone())
                .and_then(|p| p.parse::<i32>().ok())
                .is_some_and(|p| p != 0 && p != pid);
            if restarted {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "server and worker did not come back"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        for i in 50..100 {
            small(&n.cluster, i);
        }
        let (_, _, new_pid, _) = n.wait_state("running");
        assert_ne!(new_pid, pid, "a new worker process");
        n.wait_caught_up();

        // SIGTERM (pg_terminate_backend): the worker exits, PostgreSQL
        // restarts it, it replays; only the worker restarts this time.
        n.cluster
            .psql(&format!("SELECT pg_terminate_backend({new_pid})"));
        for i in 100..110 {
            small(&n.cluster, i);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (state, _, pid, _) = n.status();
            if state == "running" && pid != new_pid && pid != 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "worker not restarted after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        n.wait_caught_up();
        n.stop_relay(false);
        let logged = n.assert_no_gap();
        assert_eq!(n.source_xids().len(), 110);
        assert!(logged.len() >= 110);
    });
}

/// A stalled relay: the socket buffer and then the 16-slot queue fill, the
/// decoder waits (backpressured) instead of dropping or growing, and when
/// the relay resumes every transaction arrives.
#[test]
fn full_queue_backpressures_without_loss() {
    on_every_major(|major| {
        let Some(mut n) = Native::start(major) else {
            return;
        };
        n.start_relay();
        n.wait_state("running");
        n.signal_relay(nix::sys::signal::Signal::SIGSTOP);
        // ~16 MB of frames: far beyond the socket buffer and 16 x 64 KiB.
        n.cluster.psql(
            "BEGIN; INSERT INTO public.items SELECT i, repeat(md5(i::text), 16), i FROM generate_series(1, 30000) i;
             INSERT INTO public.xids VALUES (txid_current()); COMMIT;",
        );
        let (_, reason, _, occupancy) = n.wait_state("backpressured");
        assert_eq!(occupancy, 16, "the queue is full, not larger: {reason}");
        n.signal_relay(nix::sys::signal::Signal::SIGCONT);
        for i in 0..10 {
            small(&n.cluster, 100_000 + i);
        }
        n.wait_caught_up();
        n.stop_relay(false);
        n.assert_no_gap();
    });
}

/// The socket's safety rules, without a server: a directory others can
/// write and a path owned by someone else are refused by name.
#[test]
fn relay_refuses_unsafe_socket_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let out = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .arg("relay")
        .arg("--native-socket")
        .arg(dir.path().join("relay.sock"))
        .arg("--log-dir")
        .arg(dir.path().join("log"))
        .args(["--source-id", "x"])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("writable by group or others") && stderr.contains("chmod go-w"),
        "{stderr}"
    );

    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let foreign = dir.path().join("taken.sock");
    std::fs::write(&foreign, b"").expect("file");
    let out = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .arg("relay")
        .arg("--native-socket")
        .arg(&foreign)
        .arg("--log-dir")
        .arg(dir.path().join("log"))
        .args(["--source-id", "x"])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is not a socket"), "{stderr}");
}

/// A socket file that passes the worker's checks (the server's uid, 0600)
/// but is answered by another user: the worker asks the peer who it is and
/// sends nothing.
#[test]
fn worker_refuses_a_socket_answered_by_another_user() {
    on_every_major(|major| {
        let Some(n) = Native::start(major) else {
            return;
        };
        let owner = nix::unistd::User::from_name(OS_USER)
            .expect("getpwnam")
            .expect("OS user");
        let path = n.dir.path().join("relay.sock");
        // This test runs as root: the listener is not the server's user.
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        nix::unistd::chown(&path, Some(owner.uid), Some(owner.gid)).expect("chown");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        listener.set_nonblocking(true).expect("nonblocking");
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut held = Vec::new();
        loop {
            if let Ok((conn, _)) = listener.accept() {
                held.push(conn);
            }
            let (_, reason, _, _) = n.status();
            if reason.contains("was answered by uid 0") {
                assert!(reason.contains("not the server's uid"), "{reason}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{major}: worker never refused the socket: {:?}",
                n.status()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut got = [0u8; 64];
        for conn in &mut held {
            conn.set_nonblocking(true).expect("nonblocking");
            let read = std::io::Read::read(conn, &mut got);
            assert!(
                !matches!(read, Ok(n) if n > 0),
                "the worker sent its hello to a stranger"
            );
        }
    });
}

/// `ALTER EXTENSION trellara UPDATE` from 0.1.0 yields the same functions
/// (names, arguments, results, bodies) as a fresh install.
#[test]
fn upgrade_from_0_1_0_matches_a_fresh_install() {
    on_every_major(|major| {
        let Some(n) = Native::start(major) else {
            return;
        };
        let c = &n.cluster;
        c.psql("CREATE DATABASE upgraded");
        let catalog = |db: &str| {
            let mut client = c.try_connect(db).expect("connect");
            client
                .query(
                    "SELECT p.proname::text, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid), p.prosrc, (SELECT lanname::text FROM pg_language WHERE oid = p.prolang)
                       FROM pg_proc p
                       JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e'
                       JOIN pg_extension e ON e.oid = d.refobjid AND e.extname = 'trellara'
                      ORDER BY 1",
                    &[],
                )
                .expect("catalog")
                .iter()
                .map(|r| (0..5).map(|i| r.get::<_, String>(i)).collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        let mut up = c.try_connect("upgraded").expect("connect");
        up.batch_execute(
            "CREATE EXTENSION trellara VERSION '0.1.0'; ALTER EXTENSION trellara UPDATE;",
        )
        .expect("update");
        let version: String = up
            .query_one(
                "SELECT extversion FROM pg_extension WHERE extname = 'trellara'",
                &[],
            )
            .expect("version")
            .get(0);
        let current = include_str!("../../extension/Cargo.toml")
            .lines()
            .find_map(|l| l.strip_prefix("version = \""))
            .and_then(|v| v.strip_suffix('"'))
            .expect("extension version");
        assert_eq!(version, current);
        let fresh = catalog("postgres");
        assert!(fresh.iter().any(|f| f[0] == "start_worker"), "{fresh:?}");
        assert_eq!(catalog("upgraded"), fresh);
    });
}

/// `trellara run` with `capture: native`: the operator only preloaded the
/// library; run creates the extension and the slot (plugin trellara, with
/// the snapshot boundary), configures and starts the worker, relays its
/// frames into the log and applies them: CONVERGED, twice, with writes to
/// a table outside the flow left out by the worker.
/// A source with the extension preloaded, a target, and a flow over
/// `tables` with native capture, in a directory owned by the server's OS
/// user (the relay must run as it).
struct NativeFlow {
    source: Cluster,
    target: Cluster,
    dir: tempfile::TempDir,
    owner: nix::unistd::User,
    major: Major,
}

impl NativeFlow {
    fn start(major: Major, schema: &str, tables: &[&str]) -> Option<NativeFlow> {
        if !enabled(major) {
            return None;
        }
        let source = test_cluster(
            major,
            &ClusterOptions::new().shared_preload_library("trellara"),
        )?;
        let target = test_cluster(major, &ClusterOptions::new())?;
        source.psql(schema);
        target.psql(schema);
        let dir = tempfile::tempdir().expect("tempdir");
        let owner = nix::unistd::User::from_name(OS_USER)
            .expect("getpwnam")
            .expect("OS user");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        nix::unistd::chown(dir.path(), Some(owner.uid), Some(owner.gid)).expect("chown");
        let flow = NativeFlow {
            source,
            target,
            dir,
            owner,
            major,
        };
        let (source_url, target_url) = (
            flow.source.connection_string("postgres"),
            flow.target.connection_string("postgres"),
        );
        let mut args = vec![
            "init",
            "--source-database-url",
            &source_url,
            "--target-database-url",
            &target_url,
            "--capture",
            "native",
            "--evaluate",
        ];
        for table in tables {
            args.extend(["--table", table]);
        }
        flow.ok(&args);
        Some(flow)
    }

    /// `trellara args` as the server's OS user.
    fn run(&self, args: &[&str]) -> std::process::Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_trellara"));
        std::os::unix::process::CommandExt::uid(&mut cmd, self.owner.uid.as_raw());
        std::os::unix::process::CommandExt::gid(&mut cmd, self.owner.gid.as_raw());
        cmd.current_dir(self.dir.path())
            .env("HOME", self.dir.path())
            .args(args)
            .output()
            .expect("run trellara")
    }

    /// [`run`](Self::run), which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "trellara {args:?} failed on {}:\n{stdout}\n{}\n{}",
            self.major,
            String::from_utf8_lossy(&out.stderr),
            self.source.log_contents()
        );
        stdout
    }
}

#[test]
fn run_with_native_capture_converges() {
    on_every_major(|major| {
        // A mixed-case name with a comma: the worker's tables option
        // carries it quoted, as SQL spells it.
        let schema = "CREATE TABLE public.orders (id bigint PRIMARY KEY, note text, qty int);
                      CREATE TABLE public.\"Line,Items\" (id bigint PRIMARY KEY, \"Qty\" int)";
        let Some(flow) =
            NativeFlow::start(major, schema, &["public.orders", "public.\"Line,Items\""])
        else {
            return;
        };
        let (source, target, dir) = (&flow.source, &flow.target, &flow.dir);
        let trellara = |args: &[&str]| flow.ok(args);
        source.psql("CREATE TABLE public.elsewhere (id bigint PRIMARY KEY)");
        source
            .psql("INSERT INTO public.orders SELECT i, 'n' || i, i FROM generate_series(1, 500) i");

        let first = trellara(&["run", "--config", "trellara.yml", "--local", "--verify"]);
        assert!(first.contains("CONVERGED"), "{first}");

        source.psql(
            "INSERT INTO public.orders SELECT i, 'n' || i, i FROM generate_series(501, 800) i;
             UPDATE public.orders SET qty = qty + 1 WHERE id <= 100;
             DELETE FROM public.orders WHERE id BETWEEN 200 AND 210;
             INSERT INTO public.elsewhere SELECT generate_series(1, 50);
             INSERT INTO public.\"Line,Items\" SELECT i, i FROM generate_series(1, 40) i;
             UPDATE public.\"Line,Items\" SET \"Qty\" = 0 WHERE id <= 5;",
        );
        let second = trellara(&["run", "--config", "trellara.yml", "--local", "--verify"]);
        assert!(second.contains("CONVERGED"), "{second}");
        assert_eq!(
            target.psql_value("SELECT count(*) || ':' || sum(qty) FROM public.orders"),
            source.psql_value("SELECT count(*) || ':' || sum(qty) FROM public.orders")
        );
        assert_eq!(
            target.psql_value("SELECT count(*) || ':' || sum(\"Qty\") FROM public.\"Line,Items\""),
            "40:805"
        );
        let status = source.psql_value("SELECT state FROM trellara.status()");
        assert_eq!(status, "stopped", "run stops the worker it started");

        // A transaction captured and acknowledged but quarantined: the
        // slot is past it, the target's checkpoint before it. With the log
        // lost, the worker must refuse the gap, not start afresh.
        target.psql("ALTER TABLE public.orders ADD CONSTRAINT small CHECK (qty < 10000)");
        source.psql("INSERT INTO public.orders VALUES (9001, 'big', 20000)");
        let run = || flow.run(&["run", "--config", "trellara.yml", "--local"]);
        let quarantined = run();
        assert_eq!(quarantined.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&quarantined.stderr).contains("quarantined"));
        target.psql("ALTER TABLE public.orders DROP CONSTRAINT small");
        // The relay acknowledged it, but whether the worker confirmed that
        // before it was stopped is timing: confirm it here, as it would be.
        source.psql("SELECT pg_replication_slot_advance('trellara_main', pg_current_wal_lsn())");
        std::fs::remove_dir_all(dir.path().join(".trellara/trellara/main/log"))
            .expect("lose the log");
        let gap = run();
        let err = String::from_utf8_lossy(&gap.stderr);
        assert_eq!(gap.status.code(), Some(1), "{err}");
        assert!(
            err.contains("past the end of the relay's log"),
            "{major}: {err}"
        );
        assert_eq!(
            target.psql_value("SELECT count(*) FROM public.orders WHERE id = 9001"),
            "0"
        );
    });
}

/// The native path propagates no schema change yet: its rows under a new
/// description are logged, and the sink holds each transaction that meets
/// one, naming the change; `schema accept` refuses until the target
/// matches, then the sink goes on from there.
#[test]
fn a_schema_change_on_the_native_path_holds_naming_its_kind() {
    on_every_major(|major| {
        let schema = "CREATE TABLE public.orders (id bigint PRIMARY KEY, note text, qty int)";
        let Some(flow) = NativeFlow::start(major, schema, &["public.orders"]) else {
            return;
        };
        flow.source
            .psql("INSERT INTO public.orders SELECT i, 'n' || i, i FROM generate_series(1, 50) i");
        let first = flow.ok(&["run", "--config", "trellara.yml", "--local", "--verify"]);
        assert!(first.contains("CONVERGED"), "{first}");
        for side in [&flow.source, &flow.target] {
            side.psql("ALTER TABLE public.orders ADD COLUMN region text");
        }
        // Three transactions: each change meets its own.
        for sql in [
            "INSERT INTO public.orders VALUES (51, 'before', 1, NULL)",
            "ALTER TABLE public.orders ALTER COLUMN qty TYPE bigint",
            "INSERT INTO public.orders VALUES (52, 'after', 1, 'eu')",
        ] {
            flow.source.psql(sql);
        }
        let run = || {
            let out = flow.run(&["run", "--config", "trellara.yml", "--local"]);
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            assert_eq!(out.status.code(), Some(1), "{major}: {err}");
            err
        };
        let err = run();
        assert!(
            err.contains("schema change on public.orders held")
                && err.contains("add_nullable_column: column region added to public.orders")
                && err.contains("native capture propagates no schema change yet")
                && err.contains(
                    "trellara schema accept --config trellara.yml --flow main --table public.orders"
                ),
            "{major}: {err}"
        );
        assert_eq!(
            flow.target
                .psql_value("SELECT count(*) FROM public.orders WHERE id > 50"),
            "0",
            "{major}: nothing under the new schema landed"
        );
        let accept = [
            "schema",
            "accept",
            "--config",
            "trellara.yml",
            "--table",
            "public.orders",
        ];
        // The target has the column already: accepted as it stands.
        flow.ok(&accept);
        let err = run();
        assert!(err.contains("widen_type"), "{major}: {err}");
        assert_eq!(
            flow.target
                .psql_value("SELECT string_agg(id::text, ',') FROM public.orders WHERE id > 50"),
            "51",
            "{major}: the accepted transaction applied, the next one holds"
        );
        let out = flow.run(&accept);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.code() == Some(1)
                && err.contains("column qty is integer on the target, which does not take the source's bigint unchanged"),
            "{major}: {err}"
        );
        flow.target
            .psql("ALTER TABLE public.orders ALTER COLUMN qty TYPE bigint");
        flow.ok(&accept);
        let again = flow.ok(&["run", "--config", "trellara.yml", "--local", "--verify"]);
        assert!(again.contains("CONVERGED"), "{major}: {again}");
        assert_eq!(
            flow.target.psql_value(
                "SELECT string_agg(id || ':' || coalesce(region, '-'), ',' ORDER BY id) FROM public.orders WHERE id > 50"
            ),
            "51:-,52:eu"
        );
    });
}

/// `trellara relay --config` is the relay service of the flow on either
/// capture path: it serves its endpoints, is not ready while the source
/// cannot be reached (and says it follows again), makes no log before
/// preflight's checks passed, and SIGTERM ends it cleanly.
#[test]
fn relay_config_mode_uses_the_flow() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().expect("tempdir");
    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let config = |capture: &str| {
        format!(
            "schema_version: 2\nflows:\n  - name: shop\n    source:\n      url: postgresql://u@127.0.0.1:1/db\n    target:\n      url: postgresql://u@127.0.0.1:2/db\n    tables: [public.orders]\n    capture: {capture}\n    transport:\n      kind: local\n      log_dir: ./open/log\nservice:\n  relay_listen: 127.0.0.1:0\n"
        )
    };
    for capture in ["native", "external"] {
        std::fs::write(dir.path().join("trellara.yml"), config(capture)).expect("write");
        let mut child = Command::new(env!("CARGO_BIN_EXE_trellara"))
            .current_dir(dir.path())
            .args(["relay", "--config", "trellara.yml"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("relay");
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send(line);
            }
        });
        let mut seen = String::new();
        let mut addr = None;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(addr.is_some() && seen.contains("following again in")) {
            let line = rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("{capture}: no retry said:\n{seen}"));
            if let Some(rest) = line.split("service: serving http://").nth(1) {
                addr = rest.split('/').next().map(str::to_owned);
            }
            seen.push_str(&line);
            seen.push('\n');
        }
        let addr = addr.expect("an address");
        assert_eq!(http_get(&addr, "/livez").0, 200, "{capture}");
        assert_eq!(http_get(&addr, "/readyz").0, 503, "{capture}");
        assert!(seen.contains("connect to the"), "{capture}: {seen}");
        assert!(!dir.path().join("open/log").exists(), "{capture}: a log");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("sigterm");
        let status = child.wait().expect("reap");
        assert!(status.success(), "{capture}: {status}\n{seen}");
    }
}

/// The relay's side of the socket, driven by a test client with the
/// relay's own uid (no server needed): a good transaction is appended,
/// fsynced and acknowledged with its end LSN; a frame with one flipped
/// byte is rejected by name, kept in quarantine, and nothing after it is
/// appended or acknowledged.
#[test]
fn relay_acknowledges_good_frames_and_quarantines_a_bad_one() {
    use std::io::{Read, Write};
    use trellara_common::native_frame::encode_frames;
    use trellara_common::native_wire::{Hello, RelayMessage};

    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let socket = dir.path().join("relay.sock");
    let log_dir = dir.path().join("log");
    let mut relay = Command::new(env!("CARGO_BIN_EXE_trellara"))
        .arg("relay")
        .arg("--native-socket")
        .arg(&socket)
        .arg("--log-dir")
        .arg(&log_dir)
        .args(["--source-id", "sample-src"])
        .stderr(Stdio::null())
        .spawn()
        .expect("relay");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mode = std::fs::metadata(&socket)
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);

    let mut conn = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let hello = Hello {
        system_identifier: 7,
        slot: "s".into(),
    };
    conn.write_all(&hello.encode().expect("hello"))
        .expect("send hello");
    let read_message = |conn: &mut std::os::unix::net::UnixStream| {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 512];
        loop {
            if let Some((message, _)) = RelayMessage::decode(&buf).expect("relay message") {
                return message;
            }
            let n = conn.read(&mut chunk).expect("read");
            assert!(n > 0, "relay closed early");
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    assert_eq!(
        read_message(&mut conn),
        RelayMessage::Welcome { durable_end: 0 }
    );

    let frames_of = |mut env: envelope::Envelope, commit: u64| {
        env.commit_lsn = commit;
        env.end_lsn = commit + 0x30;
        env.begin_lsn = commit - 0x100;
        if let Some(source) = env.source.as_mut() {
            source.source_id = "sample-src".into();
        }
        let bytes = envelope::encode(&env).expect("encode");
        let mut writer = encode_frames(commit, 0, &bytes, 64 * 1024).expect("frames");
        let mut frames = Vec::new();
        let mut frame = Vec::new();
        while writer.write_next(&mut frame) {
            frames.push(std::mem::take(&mut frame));
        }
        frames
    };
    let good = frames_of(trellara_common::sample::insert_transaction(3, 10), 0x1000);
    for frame in &good {
        conn.write_all(frame).expect("send");
    }
    assert_eq!(
        read_message(&mut conn),
        RelayMessage::Ack { end_lsn: 0x1030 }
    );

    let mut bad = frames_of(trellara_common::sample::insert_transaction(3, 10), 0x2000);
    let last = bad.len() - 1;
    let at = bad[last].len() - 5;
    bad[last][at] ^= 0x01;
    for frame in &bad {
        conn.write_all(frame).expect("send");
    }
    match read_message(&mut conn) {
        RelayMessage::Reject { reason } => {
            assert!(
                reason.contains("checksum") && reason.contains("quarantine"),
                "{reason}"
            )
        }
        other => panic!("expected a reject, got {other:?}"),
    }
    let mut rest = Vec::new();
    let _ = conn.read_to_end(&mut rest);
    assert!(rest.is_empty(), "nothing after the reject: {rest:?}");
    let kept: Vec<_> = std::fs::read_dir(log_dir.join("quarantine"))
        .expect("quarantine dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(kept.iter().any(|n| n.ends_with(".bin")), "{kept:?}");
    assert!(kept.iter().any(|n| n.ends_with(".reason")), "{kept:?}");

    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(relay.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = relay.wait();
    let (log, _) = Log::open(FsStorage::new(), &log_dir, LogConfig::default()).expect("open log");
    let commits: Vec<u64> = log
        .read_from(log.first_offset())
        .expect("read")
        .map(|r| {
            envelope::decode(&r.expect("record").payload)
                .expect("envelope")
                .commit_lsn
        })
        .collect();
    assert_eq!(commits, [0x1000], "only the good transaction is in the log");
}

/// Replacing a running worker in one transaction (what `trellara run` does
/// with a worker left by an interrupted run): the old one goes for good -
/// PostgreSQL's restart of its registration retires itself - and exactly
/// one worker, the new one, streams.
#[test]
fn start_worker_replaces_the_running_worker() {
    on_every_major(|major| {
        let Some(mut n) = Native::start(major) else {
            return;
        };
        n.start_relay();
        let (_, _, old_pid, _) = n.wait_state("running");
        let mut client = n.cluster.connect();
        let mut tx = client.transaction().expect("begin");
        tx.execute("SELECT trellara.stop_worker()", &[])
            .expect("stop");
        let new_pid: i32 = tx
            .query_one("SELECT trellara.start_worker()", &[])
            .expect("start")
            .get(0);
        tx.commit().expect("commit");
        assert_ne!(new_pid, old_pid);
        // Past the 1 s restart of the old registration.
        std::thread::sleep(Duration::from_secs(3));
        let workers = n.cluster.psql_value(
            "SELECT string_agg(pid::text, ',') FROM pg_stat_activity WHERE backend_type = 'trellara capture'",
        );
        assert_eq!(workers, new_pid.to_string(), "one worker, the new one");
        let (state, _, pid, _) = n.wait_state("running");
        assert_eq!((state.as_str(), pid), ("running", new_pid));
        small(&n.cluster, 1);
        n.wait_caught_up();
        n.stop_relay(false);
        n.assert_no_gap();
    });
}

/// `run --follow` on the native path: its metrics count what the worker
/// sent and the target applied, and an idle flow on a source busy in
/// another database keeps no foreign WAL in its slot.
#[test]
fn a_native_follower_counts_and_keeps_no_foreign_wal() {
    on_every_major(|major| {
        if !enabled(major) {
            return;
        }
        let Some(source) = test_cluster(
            major,
            &ClusterOptions::new().shared_preload_library("trellara"),
        ) else {
            return;
        };
        let Some(target) = test_cluster(major, &ClusterOptions::new()) else {
            return;
        };
        let schema = "CREATE TABLE public.orders (id bigint PRIMARY KEY, note text)";
        source.psql(schema);
        target.psql(schema);
        let dir = tempfile::tempdir().expect("tempdir");
        let owner = nix::unistd::User::from_name(OS_USER)
            .expect("getpwnam")
            .expect("OS user");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        nix::unistd::chown(dir.path(), Some(owner.uid), Some(owner.gid)).expect("chown");
        let as_owner = |args: &[&str]| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_trellara"));
            std::os::unix::process::CommandExt::uid(&mut cmd, owner.uid.as_raw());
            std::os::unix::process::CommandExt::gid(&mut cmd, owner.gid.as_raw());
            cmd.current_dir(dir.path())
                .env("HOME", dir.path())
                .args(args);
            cmd
        };
        let init = as_owner(&[
            "init",
            "--source-database-url",
            &source.connection_string("postgres"),
            "--target-database-url",
            &target.connection_string("postgres"),
            "--table",
            "public.orders",
            "--capture",
            "native",
            "--evaluate",
        ])
        .output()
        .expect("init");
        assert!(
            init.status.success(),
            "{}",
            String::from_utf8_lossy(&init.stderr)
        );
        let config = dir.path().join("trellara.yml");
        let mut text = std::fs::read_to_string(&config).expect("config");
        text.push_str("service:\n  relay_listen: 127.0.0.1:0\n");
        std::fs::write(&config, text).expect("config");
        let mut child = as_owner(&["run", "--config", "trellara.yml", "--local", "--follow"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn run --follow");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(rest) = line.split("service: serving http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap_or_default().to_owned());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the follower names its address");
        let wait = |what: &str, ok: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(90);
            while !ok() {
                assert!(Instant::now() < deadline, "{major}: never {what}");
                std::thread::sleep(Duration::from_millis(100));
            }
        };
        wait("ready", &|| http_get(&addr, "/readyz").0 == 200);
        for id in 1..=7 {
            source.psql(&format!("INSERT INTO public.orders VALUES ({id}, 'n')"));
        }
        wait("applied", &|| {
            target.psql_value("SELECT count(*) FROM public.orders") == "7"
        });
        // The applier reads an append before its fsync returns, so the
        // relay counts a transaction captured (durable) a moment after the
        // target may already hold it: wait for both counts, not one read.
        wait("counted both ways", &|| {
            let metrics = http_get(&addr, "/metrics").1;
            metric(&metrics, "trellara_captured_transactions_total") == 7.0
                && metric(&metrics, "trellara_applied_transactions_total") == 7.0
        });
        let metrics = http_get(&addr, "/metrics").1;
        assert_eq!(
            metric(&metrics, "trellara_captured_transactions_total"),
            7.0,
            "{major}: no transaction counted twice"
        );
        // Verified while it follows: at a fence, on the native path too.
        let fenced_verify = |when: &str| {
            let out = as_owner(&["verify", "--config", "trellara.yml"])
                .output()
                .expect("verify");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success()
                    && text.contains("main CONVERGED")
                    && text.contains("compared at source LSN"),
                "{major}: verify {when}:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        fenced_verify("after the inserts");
        // One table copied again under the held apply, on this path too.
        target.psql("UPDATE public.orders SET note = 'behind its back' WHERE id = 2");
        let out = as_owner(&[
            "reseed",
            "--config",
            "trellara.yml",
            "--table",
            "public.orders",
            "--verify",
        ])
        .output()
        .expect("reseed --table");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success()
                && text.contains("copied 7 rows at its own boundary")
                && text.contains("main CONVERGED"),
            "{major}: reseed --table:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            target.psql_value("SELECT note FROM public.orders WHERE id = 2"),
            "n",
            "{major}: the changed row is mended"
        );
        // Foreign writes: 256 MiB of WAL in another database.
        source.psql("CREATE DATABASE elsewhere");
        let mut elsewhere = source.try_connect("elsewhere").expect("connect elsewhere");
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
        source.psql("CHECKPOINT");
        let retained = "SELECT (pg_current_wal_lsn() - restart_lsn)::int8 FROM pg_replication_slots WHERE slot_name = 'trellara_main'";
        let limit = 16i64 << 20;
        wait("the slot released the foreign WAL", &|| {
            source.psql_value(retained).parse::<i64>().expect("bytes") < limit
        });
        wait("the gauge shows it", &|| {
            metric(
                &http_get(&addr, "/metrics").1,
                "trellara_slot_retained_wal_bytes",
            ) < limit as f64
        });
        // Idle: the fence's position is passed by keepalives alone.
        fenced_verify("of the idle flow");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .expect("sigterm");
        assert!(
            child.wait().expect("reap").success(),
            "{major}: SIGTERM drains"
        );
    });
}
