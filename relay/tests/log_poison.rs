//! A failed write or fsync poisons the log until it is reopened.

mod log_support;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use log_support::{contents, open_sim, payload, small_config};
use trellara_relay::log::storage::{SimCrash, SimFault, SimOp, SimStorage};
use trellara_relay::log::{Error, Log};

fn assert_poisoned(log: &Log<SimStorage>) {
    assert!(log.is_poisoned());
    assert!(matches!(
        log.append(1, b"later"),
        Err(Error::Poisoned { .. })
    ));
    assert!(matches!(
        log.append_batch([(1, b"a".as_slice())]),
        Err(Error::Poisoned { .. })
    ));
    assert!(matches!(log.sync(), Err(Error::Poisoned { .. })));
    assert!(matches!(
        log.append_from(1, 100, &mut &[0u8; 100][..]),
        Err(Error::Poisoned { .. })
    ));
}

#[test]
fn failed_fsync_poisons_until_reopen() {
    let sim = SimStorage::new(21);
    let cfg = small_config(4096);
    let (log, _) = open_sim(&sim, &cfg);
    let acked: Vec<(u64, Vec<u8>)> = (0..5).map(|i| (i + 1, payload(i, 40))).collect();
    for (lsn, p) in &acked {
        log.append(*lsn, p).unwrap();
    }
    sim.inject(SimFault::once(SimOp::Sync).on_path(".seg"));
    match log.append(6, b"not acknowledged") {
        Err(Error::Io { op, path, .. }) => {
            assert_eq!(op, "fsync segment");
            assert!(path.to_string_lossy().ends_with(".seg"));
        }
        other => panic!("expected the fsync error, got {other:?}"),
    }
    // The fault is gone, but the log must not pretend the retry worked.
    assert_poisoned(&log);
    let err = log.append(1, b"x").unwrap_err();
    assert!(err.to_string().contains("reopen the log"), "{err}");
    // What was durable is still readable, and only that.
    assert_eq!(contents(&log), acked);
    assert_eq!(log.last_durable().unwrap().offset, 4);

    // Reopen = recovery: the log works again. After power loss the
    // unacknowledged record is gone (or, if its bytes survived, it is a
    // duplicate the source will send again, never a gap).
    drop(log);
    sim.crash(SimCrash::LoseUnsynced);
    let (log, _) = open_sim(&sim, &cfg);
    assert!(!log.is_poisoned());
    assert_eq!(contents(&log), acked);
    assert_eq!(log.append(7, b"after reopen").unwrap(), 5);
}

#[test]
fn failed_write_poisons_too() {
    let sim = SimStorage::new(22);
    let (log, _) = open_sim(&sim, &small_config(4096));
    log.append(1, b"one").unwrap();
    sim.inject(SimFault::once(SimOp::Append).on_path(".seg"));
    assert!(matches!(
        log.append(2, b"two"),
        Err(Error::Io {
            op: "write segment",
            ..
        })
    ));
    assert_poisoned(&log);
}

#[test]
fn failed_fsync_while_rolling_poisons() {
    let sim = SimStorage::new(23);
    let cfg = small_config(200);
    let (log, _) = open_sim(&sim, &cfg);
    // Two 80-byte frames fill the first segment (32 + 160 of 200 bytes).
    for i in 0..2 {
        log.append(i, &payload(i, 40)).unwrap();
    }
    assert_eq!(log.segments().len(), 1);
    // The next append must roll: fail the fsync of the *new* segment.
    sim.inject(SimFault {
        op: SimOp::Sync,
        path_contains: Some("00000000000000000002.seg".into()),
        skip: 0,
        times: 1,
    });
    assert!(log.append(2, &payload(2, 40)).is_err());
    assert_poisoned(&log);
    drop(log);
    sim.crash(SimCrash::TornTail);
    let (log, _) = open_sim(&sim, &cfg);
    assert_eq!(log.next_offset(), 2);
    assert_eq!(log.append(2, b"again").unwrap(), 2);
}

#[test]
fn waiters_of_a_failed_group_commit_fail_too() {
    let sim = SimStorage::new(24);
    sim.set_sync_latency(Duration::from_millis(20));
    let (log, _) = open_sim(&sim, &small_config(1 << 20));
    log.append(0, b"durable").unwrap();
    sim.inject(SimFault::once(SimOp::Sync).on_path(".seg"));
    let threads = 4;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let log = log.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                log.append(t as u64, b"in the failing group")
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // The first fsync after the fault fails and poisons the log, so no
    // appender of that group (or later) may be told its record is durable.
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert!(log.is_poisoned());
    assert_eq!(log.next_offset(), 1);
}
