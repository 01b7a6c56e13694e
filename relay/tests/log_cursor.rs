//! Consumer cursors: durable, crash-consistent, never silently reset.

mod log_support;

use log_support::{dir, open_sim, payload, small_config};
use trellara_relay::log::storage::{SimCrash, SimFault, SimOp, SimStorage};
use trellara_relay::log::{CursorPosition, Error, Log};

fn cursor_path(consumer: &str) -> std::path::PathBuf {
    dir().join("cursors").join(format!("{consumer}.cursor"))
}

/// A log with 20 records and consumer `applier` at offset 5.
fn setup() -> SimStorage {
    let sim = SimStorage::new(11);
    let (log, _) = open_sim(&sim, &small_config(400));
    for i in 0..20 {
        log.append(100 + i, &payload(i, 30)).unwrap();
    }
    assert_eq!(
        log.register_consumer("applier").unwrap(),
        CursorPosition::start_at(0)
    );
    log.commit_cursor("applier", CursorPosition::after(4, 104))
        .unwrap();
    sim
}

#[test]
fn cursors_survive_reopen_and_crash() {
    let sim = setup();
    sim.crash(SimCrash::TornTail);
    let (log, _) = open_sim(&sim, &small_config(400));
    assert_eq!(log.cursor("applier"), Some(CursorPosition::after(4, 104)));
    // Registering again is idempotent and keeps the position.
    assert_eq!(
        log.register_consumer("applier").unwrap(),
        CursorPosition::after(4, 104)
    );
    assert_eq!(
        log.cursors(),
        vec![("applier".to_owned(), CursorPosition::after(4, 104))]
    );
}

#[test]
fn crash_at_each_step_of_a_commit_leaves_old_or_new_never_garbage() {
    let old = CursorPosition::after(4, 104);
    let new = CursorPosition::after(9, 109);
    for op in [
        SimOp::Open,
        SimOp::Append,
        SimOp::Sync,
        SimOp::Rename,
        SimOp::SyncDir,
    ] {
        for crash in [
            SimCrash::LoseUnsynced,
            SimCrash::TornTail,
            SimCrash::GarbageTail,
        ] {
            let sim = setup();
            let (log, _) = open_sim(&sim, &small_config(400));
            sim.inject(SimFault::once(op).on_path("cursors"));
            assert!(log.commit_cursor("applier", new).is_err(), "{op:?}");
            // The failed commit did not move the in-memory cursor.
            assert_eq!(log.cursor("applier"), Some(old), "{op:?}");
            drop(log);
            sim.clear_faults();
            sim.crash(crash);
            let (log, _) = open_sim(&sim, &small_config(400));
            let after = log.cursor("applier").unwrap();
            assert!(after == old || after == new, "{op:?} {crash:?}: {after:?}");
            if op == SimOp::Rename {
                // Crash between temp write and rename: the old cursor holds.
                assert_eq!(after, old);
                let temp = dir().join("cursors").join("applier.cursor.tmp");
                assert!(sim.read_file(&temp).is_none(), "temp removed on open");
            }
        }
    }
}

#[test]
fn torn_temp_file_is_ignored_and_removed() {
    let sim = setup();
    let temp = dir().join("cursors").join("applier.cursor.tmp");
    sim.write_file(&temp, b"TRLC\x01\x00 torn").unwrap();
    let (log, report) = open_sim(&sim, &small_config(400));
    assert!(report.removed_files.contains(&temp));
    assert_eq!(log.cursor("applier"), Some(CursorPosition::after(4, 104)));
    assert!(sim.read_file(&temp).is_none());
}

#[test]
fn torn_or_corrupt_cursor_file_is_a_named_error() {
    let sim = setup();
    let path = cursor_path("applier");
    let good = sim.read_file(&path).unwrap();
    let mut damaged: Vec<Vec<u8>> = (0..good.len()).map(|n| good[..n].to_vec()).collect();
    for i in 0..good.len() {
        let mut flipped = good.clone();
        flipped[i] ^= 0x08;
        damaged.push(flipped);
    }
    for bytes in damaged {
        let fork = sim.fork();
        fork.write_file(&path, &bytes).unwrap();
        match Log::open(fork.clone(), dir(), small_config(400)) {
            Err(err @ Error::CursorCorrupt { .. }) => {
                let Error::CursorCorrupt {
                    consumer, path: p, ..
                } = &err
                else {
                    unreachable!()
                };
                assert_eq!(consumer, "applier");
                assert_eq!(p, &path);
                assert!(err.to_string().contains("not reset to 0"));
            }
            other => panic!("expected CursorCorrupt for {bytes:?}, got {other:?}"),
        }
    }
}

#[test]
fn cursor_commits_are_checked_against_the_log() {
    let sim = setup();
    let (log, _) = open_sim(&sim, &small_config(400));
    assert!(matches!(
        log.commit_cursor("nobody", CursorPosition::start_at(0)),
        Err(Error::UnknownConsumer { .. })
    ));
    assert!(matches!(
        log.commit_cursor("applier", CursorPosition::start_at(21)),
        Err(Error::CursorOutOfRange {
            cursor: 21,
            next: 20,
            ..
        })
    ));
    assert!(matches!(
        log.register_consumer("../evil"),
        Err(Error::InvalidConsumerName { .. })
    ));
    log.commit_cursor("applier", CursorPosition::start_at(20))
        .unwrap();
    log.unregister_consumer("applier").unwrap();
    assert_eq!(log.cursor("applier"), None);
    drop(log);
    let (log, _) = open_sim(&sim, &small_config(400));
    assert_eq!(log.cursor("applier"), None, "unregistering is durable");
}

#[test]
fn cursor_ahead_of_the_log_is_an_error_on_open() {
    let sim = setup();
    // A cursor file copied from a longer log (or a log that lost data).
    let ahead = SimStorage::new(0);
    let (other, _) = open_sim(&ahead, &small_config(400));
    for i in 0..30 {
        other.append(i, b"x").unwrap();
    }
    other.register_consumer("applier").unwrap();
    other
        .commit_cursor("applier", CursorPosition::start_at(30))
        .unwrap();
    let bytes = ahead.read_file(&cursor_path("applier")).unwrap();
    sim.write_file(&cursor_path("applier"), &bytes).unwrap();
    match Log::open(sim.clone(), dir(), small_config(400)) {
        Err(Error::CursorOutOfRange {
            consumer,
            cursor: 30,
            next: 20,
            ..
        }) => assert_eq!(consumer, "applier"),
        other => panic!("expected CursorOutOfRange, got {other:?}"),
    }
}
