//! A log followed from another handle, as the apply service follows the
//! log its relay service writes: only what is durable is seen, segment
//! rolls and retention are followed, the follower's cursor on the disk
//! holds the writer's retention, and a follower never writes into a log
//! that replaced the one it opened.

use std::path::Path;
use std::time::Duration;

use trellara_relay::log::storage::FsStorage;
use trellara_relay::log::{CursorPosition, Error, Log, LogConfig, RetentionPolicy};

fn config() -> LogConfig {
    LogConfig {
        max_segment_bytes: 2048,
        index_interval_bytes: 512,
        retention: RetentionPolicy::keep_all(),
        ..LogConfig::default()
    }
}

fn writer(dir: &Path) -> Log {
    Log::open(FsStorage::new(), dir, config()).unwrap().0
}

fn payload(i: u64) -> Vec<u8> {
    format!("record {i:05} ")
        .into_bytes()
        .repeat(10 + (i % 7) as usize)
}

fn read_all(log: &Log, from: u64) -> Vec<(u64, u64, Vec<u8>)> {
    log.read_written_from(from)
        .unwrap()
        .map(|r| {
            let r = r.unwrap();
            (r.offset, r.commit_lsn, r.payload)
        })
        .collect()
}

#[test]
fn a_follower_sees_what_is_durable_and_follows_the_rolls() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    assert!(matches!(
        Log::follow(&dir, config()),
        Err(Error::NotWritten { .. })
    ));
    let log = writer(&dir);
    let follower = Log::follow(&dir, config()).unwrap();
    assert!(follower.is_follower() && !log.is_follower());
    assert_eq!(follower.next_offset(), 0);

    // Written but not durable: the follower does not see it.
    log.write_batch((0..3).map(|i| (100 + i, payload(i))))
        .unwrap();
    assert!(!follower.refresh().unwrap());
    assert_eq!(follower.written_end(), 0);
    assert!(read_all(&follower, 0).is_empty());
    log.sync().unwrap();
    assert!(follower.refresh().unwrap());
    assert_eq!(follower.written_end(), 3);

    // Many segments later, every record in order, whole.
    for i in 3..200 {
        log.append(100 + i, &payload(i)).unwrap();
        if i % 37 == 0 {
            follower.refresh().unwrap();
        }
    }
    assert!(log.segments().len() > 10, "{:?}", log.segments().len());
    follower.refresh().unwrap();
    let got = read_all(&follower, 0);
    assert_eq!(got.len(), 200);
    for (i, (offset, lsn, bytes)) in got.iter().enumerate() {
        let i = i as u64;
        assert_eq!((*offset, *lsn, bytes), (i, 100 + i, &payload(i)));
    }
    // A reader from the middle of a sealed segment.
    assert_eq!(read_all(&follower, 123).first().unwrap().0, 123);
    // It appends nothing and deletes nothing.
    assert!(matches!(
        follower.append(1, b"no"),
        Err(Error::ReadOnly { .. })
    ));
    assert!(matches!(
        follower.enforce_retention(),
        Err(Error::ReadOnly { .. })
    ));
    assert!(matches!(
        follower.unregister_consumer("applier"),
        Err(Error::ReadOnly { .. })
    ));
}

#[test]
fn the_followers_cursor_holds_the_writers_retention() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    let log = writer(&dir);
    log.register_consumer("applier").unwrap();
    for i in 0..120 {
        log.append(100 + i, &payload(i)).unwrap();
    }
    let follower = Log::follow(&dir, config()).unwrap();
    assert_eq!(follower.cursor("applier").unwrap().next_offset, 0);
    follower
        .commit_cursor("applier", CursorPosition::after(79, 179))
        .unwrap();
    let delete_all = RetentionPolicy {
        max_total_bytes: Some(0),
        ..RetentionPolicy::keep_all()
    };
    log.reload_cursors().unwrap();
    assert_eq!(log.cursor("applier").unwrap().next_offset, 80);
    let report = log.enforce_retention_with(&delete_all).unwrap();
    assert!(!report.deleted.is_empty());
    assert!(log.first_offset() <= 80 && log.first_offset() > 0);
    // The follower goes on past the removed segments, and lets their
    // handles go when it next lists the directory.
    for i in 120..200 {
        log.append(100 + i, &payload(i)).unwrap();
    }
    follower.refresh().unwrap();
    let got = read_all(&follower, 80);
    assert_eq!(got.len(), 120);
    assert_eq!(got.last().unwrap().0, 199);
    let first = follower.segments().first().unwrap().base_offset;
    assert!(first > 0 && first <= 80, "{first}");
    assert!(matches!(
        follower.read_written_from(0),
        Err(Error::OffsetTruncated { .. })
    ));
}

#[test]
fn a_follower_never_writes_into_a_log_that_replaced_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    let log = writer(&dir);
    log.register_consumer("applier").unwrap();
    for i in 0..50 {
        log.append(100 + i, &payload(i)).unwrap();
    }
    let follower = Log::follow(&dir, config()).unwrap();
    drop(log);
    // A reseed: the log removed, a new one in its place with its cursor at
    // the start of its own records.
    trellara_relay::log::remove_log_dir(&dir).unwrap();
    let new = writer(&dir);
    new.register_consumer("applier").unwrap();
    new.append(900, b"after the new boundary").unwrap();
    let err = follower
        .commit_cursor("applier", CursorPosition::after(40, 140))
        .unwrap_err();
    // Replaced is what the apply service retries on: it follows the new log.
    assert!(matches!(&err, Error::Replaced { .. }), "{err:?}");
    drop(new);
    let reopened = writer(&dir);
    assert_eq!(
        reopened.cursor("applier").unwrap(),
        CursorPosition::start_at(0),
        "the new log's cursor is untouched"
    );
    // Idle, the follower finds out within its check interval.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match follower.refresh() {
            Err(Error::Replaced { .. }) => break,
            Ok(false) => {}
            other => panic!("{other:?}"),
        }
        assert!(std::time::Instant::now() < deadline, "never replaced");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_follower_reads_no_byte_past_the_durable_end() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    let log = writer(&dir);
    for i in 0..3 {
        log.append(100 + i, &payload(i)).unwrap();
    }
    let active = log.segments().last().unwrap().path.clone();
    drop(log);
    // The relay killed in the middle of writing a frame: bytes past the
    // durable end that its recovery cuts and writes over.
    let torn = vec![0xAB; 300];
    std::fs::OpenOptions::new()
        .append(true)
        .open(&active)
        .and_then(|mut f| std::io::Write::write_all(&mut f, &torn))
        .unwrap();
    let follower = Log::follow(&dir, config()).unwrap();
    let mut reader = follower.read_written_from(0).unwrap();
    let first: Vec<u64> = reader.by_ref().map(|r| r.unwrap().offset).collect();
    assert_eq!(first, [0, 1, 2]);

    let log = writer(&dir);
    log.append(103, &payload(3)).unwrap();
    assert!(follower.refresh().unwrap());
    // The same reader goes on: what it buffered of the torn bytes would now
    // be another frame's place.
    let record = reader.next().unwrap().unwrap();
    assert_eq!((record.offset, record.payload), (3, payload(3)));
    assert!(reader.next().is_none());
}

#[test]
fn the_writer_opening_leaves_a_followers_commit_in_flight_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    let log = writer(&dir);
    log.register_consumer("applier").unwrap();
    log.append(100, b"one").unwrap();
    let follower = Log::follow(&dir, config()).unwrap();
    drop(log);
    // The relay restarts while the apply service commits its cursor, over
    // and over: no commit may lose its temp file to the opening.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let commits = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                follower
                    .commit_cursor("applier", CursorPosition::after(0, 100))
                    .unwrap();
                n += 1;
            }
            n
        })
    };
    for _ in 0..200 {
        drop(writer(&dir));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(commits.join().unwrap() > 0);
    assert_eq!(writer(&dir).cursor("applier").unwrap().next_offset, 1);
}

#[test]
fn an_unreadable_watermark_is_named_and_never_read_as_a_position() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    drop(writer(&dir));
    let mark = dir.join("durable");
    // Created, not written yet: the relay is opening the log.
    std::fs::write(&mark, b"").unwrap();
    assert!(matches!(
        Log::follow(&dir, config()),
        Err(Error::NotWritten { .. })
    ));
    std::fs::write(&mark, [0x5a; 48]).unwrap();
    let err = Log::follow(&dir, config()).unwrap_err();
    assert!(matches!(err, Error::WatermarkUnreadable { .. }), "{err:?}");
    assert!(
        err.to_string().contains("restart the flow's relay"),
        "{err}"
    );
    // The relay rewrites it when it opens the log.
    drop(writer(&dir));
    Log::follow(&dir, config()).unwrap();
}

/// A removal cut short by a crash (between the rename aside and the last
/// file) leaves `.<name>.removing-<pid>-<nonce>` beside the log; the next
/// removal or open of that log sweeps it, unless its process still runs.
/// One of this process's own pid that it is not removing now was left by
/// an earlier process with the same pid (PID 1 in a container).
#[test]
fn a_log_left_half_removed_is_swept_once_its_process_is_gone() {
    let root = tempfile::tempdir().expect("tempdir");
    let dir = root.path().join("log");
    let (log, _) = Log::open(FsStorage::new(), &dir, config()).expect("open");
    drop(log);
    let mut child = std::process::Command::new("true").spawn().expect("spawn");
    let dead = child.id();
    child.wait().expect("wait");
    let left = root.path().join(format!(".log.removing-{dead}-1"));
    std::fs::create_dir_all(left.join("cursors")).expect("left behind");
    std::fs::write(left.join("cursors/applier"), b"x").expect("file");
    let same_pid = root
        .path()
        .join(format!(".log.removing-{}-1", std::process::id()));
    std::fs::create_dir_all(&same_pid).expect("an earlier process's");
    let mut remover = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn");
    let running = root
        .path()
        .join(format!(".log.removing-{}-1", remover.id()));
    std::fs::create_dir_all(&running).expect("in progress");
    let other = root.path().join(".other.removing-1-1");
    std::fs::create_dir_all(&other).expect("another log's");

    trellara_relay::log::sweep_removed(&dir);
    assert!(!left.exists(), "a dead process's half-removed log stays");
    assert!(!same_pid.exists(), "an earlier process's of this pid stays");
    assert!(running.exists(), "a live process's removal was taken over");
    assert!(other.exists(), "another log's leftovers were touched");
    assert!(
        std::fs::read_dir(&dir).expect("the log").next().is_some(),
        "the log itself was touched"
    );

    std::fs::create_dir_all(&left).expect("left again");
    trellara_relay::log::remove_log_dir(&dir).expect("remove");
    assert!(!dir.exists() && !left.exists());
    remover.kill().expect("kill");
    let _ = remover.wait();
}

/// An idle follower waits on its writer's watermark file instead of
/// looking at it every millisecond (which cost an idle apply service 2.8%
/// of a core), and still wakes for what the writer makes durable.
#[test]
fn an_idle_follower_waits_for_its_writer_instead_of_polling() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    let log = writer(&dir);
    let follower = Log::follow(&dir, config()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let poll = Duration::from_millis(1);
    runtime.block_on(async {
        let before = follower.stats().looks;
        let came = follower
            .follow_past(0, Duration::from_millis(300), poll)
            .await
            .unwrap();
        assert!(!came);
        let looks = follower.stats().looks - before;
        assert!(
            looks <= 20,
            "{looks} looks in 300 ms of nothing: it polls every {poll:?}"
        );

        let writing = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            log.write_batch((0..3).map(|i| (100 + i, payload(i))))
                .unwrap();
            log.sync().unwrap();
        };
        let started = std::time::Instant::now();
        let (came, ()) = tokio::join!(
            follower.follow_past(0, Duration::from_secs(10), poll),
            writing
        );
        assert!(came.unwrap(), "the follower missed what became durable");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(read_all(&follower, 0).len(), 3);
    });
}
