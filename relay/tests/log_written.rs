//! Records written but not yet durable: visible early to a written-horizon
//! reader (the applier's), to nothing else until `sync_through` covers
//! them, and gone after a crash before it.

mod log_support;

use log_support::{contents, open, open_sim, payload, small_config};
use trellara_relay::log::storage::{FsStorage, SimCrash, SimFault, SimOp, SimStorage};
use trellara_relay::log::{Error, Log, Record};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

fn written<S: trellara_relay::log::storage::Storage>(log: &Log<S>) -> Vec<(u64, Vec<u8>)> {
    log.read_written_from(log.first_offset())
        .unwrap()
        .collect::<Result<Vec<Record>, _>>()
        .unwrap()
        .into_iter()
        .map(|r| (r.commit_lsn, r.payload))
        .collect()
}

#[test]
fn written_records_are_read_early_and_durable_only_after_sync_through() {
    let sim = SimStorage::new(31);
    let cfg = small_config(4096);
    let (log, _) = open_sim(&sim, &cfg);
    let durable: Vec<(u64, Vec<u8>)> = (0..2).map(|i| (i + 1, payload(i, 40))).collect();
    log.append_batch(durable.iter().map(|(l, p)| (*l, p.as_slice())))
        .unwrap();
    let early: Vec<(u64, Vec<u8>)> = (2..4).map(|i| (i + 1, payload(i, 40))).collect();
    let range = log
        .write_batch(early.iter().map(|(l, p)| (*l, p.as_slice())))
        .unwrap();
    assert_eq!(range, 2..4);

    // Only the applier's reader sees them; the durable end has not moved.
    assert_eq!((log.next_offset(), log.written_end()), (2, 4));
    assert_eq!(contents(&log), durable);
    let all: Vec<_> = durable.iter().chain(&early).cloned().collect();
    assert_eq!(written(&log), all);
    assert_eq!(log.last_durable().unwrap().offset, 1);

    // A crash now loses them: nothing durable had claimed them.
    drop(log);
    sim.crash(SimCrash::LoseUnsynced);
    let (log, _) = open_sim(&sim, &cfg);
    assert_eq!(written(&log), durable);

    // Written again and synced: durable for every reader, across a crash.
    let range = log
        .write_batch(early.iter().map(|(l, p)| (*l, p.as_slice())))
        .unwrap();
    runtime().block_on(log.sync_through(range.end)).unwrap();
    assert_eq!(log.next_offset(), 4);
    assert_eq!(contents(&log), all);
    drop(log);
    sim.crash(SimCrash::LoseUnsynced);
    let (log, _) = open_sim(&sim, &cfg);
    assert_eq!(contents(&log), all);
}

#[test]
fn a_failed_fsync_leaves_written_records_undurable_and_says_so() {
    let sim = SimStorage::new(32);
    let (log, _) = open_sim(&sim, &small_config(4096));
    log.append(1, b"durable").unwrap();
    let range = log.write_batch([(2, b"early".as_slice())]).unwrap();
    sim.inject(SimFault::once(SimOp::Sync).on_path(".seg"));
    let err = runtime().block_on(log.sync_through(range.end)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Io {
                op: "fsync segment",
                ..
            }
        ),
        "{err}"
    );
    // What was durable stays the only durable thing; the log is poisoned,
    // so a later wait fails too instead of pretending.
    assert_eq!(contents(&log), vec![(1, b"durable".to_vec())]);
    assert_eq!(log.next_offset(), 1);
    assert!(matches!(
        runtime().block_on(log.sync_through(range.end)),
        Err(Error::Poisoned { .. })
    ));
    // Already durable is answered without touching the disk.
    runtime().block_on(log.sync_through(1)).unwrap();
}

#[test]
fn subscribers_hear_of_writes_and_of_durability() {
    let sim = SimStorage::new(33);
    let (log, _) = open_sim(&sim, &small_config(4096));
    let mut moved = log.subscribe();
    assert!(!moved.has_changed().unwrap());
    let range = log.write_batch([(1, b"one".as_slice())]).unwrap();
    assert!(moved.has_changed().unwrap(), "a write is news");
    moved.borrow_and_update();
    runtime().block_on(log.sync_through(range.end)).unwrap();
    assert!(moved.has_changed().unwrap(), "durability is news");
}

#[test]
fn on_real_storage_sync_through_makes_written_records_durable() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(&FsStorage::new(), dir.path(), &small_config(1 << 20));
    let range = log
        .write_batch((0..64).map(|i| (i + 1, payload(i, 1000))))
        .unwrap();
    assert_eq!(log.next_offset(), 0);
    runtime().block_on(log.sync_through(range.end)).unwrap();
    assert_eq!(log.next_offset(), 64);
    drop(log);
    let (log, _) = open(&FsStorage::new(), dir.path(), &small_config(1 << 20));
    assert_eq!(contents(&log).len(), 64);
}

#[test]
fn concurrent_waiters_share_one_fsync() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(&FsStorage::new(), dir.path(), &small_config(1 << 20));
    let range = log
        .write_batch((0..8).map(|i| (i + 1, payload(i, 100))))
        .unwrap();
    let before = log.stats().fsyncs;
    let (a, b) = runtime()
        .block_on(async { tokio::join!(log.sync_through(range.end), log.sync_through(range.end)) });
    a.unwrap();
    b.unwrap();
    assert_eq!(
        log.stats().fsyncs - before,
        1,
        "the second waiter followed the first"
    );
    assert_eq!(log.next_offset(), 8);
}
