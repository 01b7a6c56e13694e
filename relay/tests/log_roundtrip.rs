//! Property test: any sequence of appends, batches, reopens and crashes
//! reads back exactly the acknowledged records, in order, with dense offsets.
//!
//! Failing cases are persisted to `log_roundtrip.regressions` beside this file
//! and replayed first on every run; proptest prints the failing input and
//! the simulator seed is part of it, so a failure replays exactly.

mod log_support;

use log_support::{contents, open, open_sim, payload, small_config};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};
use trellara_relay::log::LogConfig;
use trellara_relay::log::storage::{FsStorage, SimCrash, SimStorage, Storage};

#[derive(Clone, Debug)]
enum Op {
    Append { lsn: u64, len: usize },
    Batch { n: usize, len: usize },
    Reopen,
    Crash(SimCrash),
    ReadFrom { at_permille: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (1u64..1 << 40, 0usize..300).prop_map(|(lsn, len)| Op::Append { lsn, len }),
        2 => (0usize..12, 0usize..120).prop_map(|(n, len)| Op::Batch { n, len }),
        1 => Just(Op::Reopen),
        1 => prop_oneof![
            Just(SimCrash::LoseUnsynced),
            Just(SimCrash::TornTail),
            Just(SimCrash::GarbageTail)
        ]
        .prop_map(Op::Crash),
        1 => (0u64..=1000).prop_map(|at_permille| Op::ReadFrom { at_permille }),
    ]
}

fn config() -> Config {
    Config {
        cases: 48,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("regressions"))),
        ..Config::default()
    }
}

/// Runs `ops` against a log, checking it against a model after each step.
fn run<S: Storage>(
    storage: &S,
    dir: &std::path::Path,
    cfg: &LogConfig,
    ops: &[Op],
    crash: impl Fn(SimCrash),
) {
    let (mut log, _) = open(storage, dir, cfg);
    let mut model: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut next_lsn = 1u64;
    for op in ops {
        match op {
            Op::Append { lsn, len } => {
                let p = payload(model.len() as u64, *len);
                let offset = log.append(*lsn, &p).unwrap();
                assert_eq!(offset, model.len() as u64);
                model.push((*lsn, p));
            }
            Op::Batch { n, len } => {
                let batch: Vec<(u64, Vec<u8>)> = (0..*n)
                    .map(|i| {
                        next_lsn += 1;
                        (next_lsn, payload(model.len() as u64 + i as u64, *len + i))
                    })
                    .collect();
                let range = log
                    .append_batch(batch.iter().map(|(l, p)| (*l, p.as_slice())))
                    .unwrap();
                assert_eq!(range, model.len() as u64..(model.len() + n) as u64);
                model.extend(batch);
            }
            Op::Reopen => {
                drop(log);
                let (reopened, report) = open(storage, dir, cfg);
                assert_eq!(report.torn_tail, None, "clean reopen found a torn tail");
                log = reopened;
            }
            Op::Crash(mode) => {
                drop(log);
                crash(*mode);
                // Every append returned Ok, so nothing acknowledged may go.
                let (reopened, report) = open(storage, dir, cfg);
                assert_eq!(report.next_offset, model.len() as u64);
                log = reopened;
            }
            Op::ReadFrom { at_permille } => {
                let at = model.len() as u64 * at_permille / 1000;
                let got: Vec<(u64, Vec<u8>)> = log
                    .read_from(at)
                    .unwrap()
                    .map(|r| r.map(|r| (r.commit_lsn, r.payload)).unwrap())
                    .collect();
                assert_eq!(got, model[at as usize..]);
            }
        }
        assert_eq!(log.next_offset(), model.len() as u64);
        assert_eq!(
            log.last_durable().map(|d| (d.offset, d.commit_lsn)),
            model.last().map(|(lsn, _)| (model.len() as u64 - 1, *lsn))
        );
    }
    assert_eq!(contents(&log), model);
    drop(log);
    let (log, report) = open(storage, dir, cfg);
    assert_eq!(report.torn_tail, None);
    assert_eq!(contents(&log), model);
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn sim_append_read_reopen_crash_round_trips(
        seed in any::<u64>(),
        max_segment in 80u64..2048,
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let sim = SimStorage::new(seed);
        let cfg = small_config(max_segment);
        let crash_sim = sim.clone();
        run(&sim, &log_support::dir(), &cfg, &ops, move |mode| crash_sim.crash(mode));
    }
}

proptest! {
    #![proptest_config(Config { cases: 8, ..config() })]

    #[test]
    fn fs_append_read_reopen_round_trips(
        max_segment in 80u64..2048,
        ops in proptest::collection::vec(op(), 1..25),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = small_config(max_segment);
        // A real file system cannot lose power on demand: crashes become
        // plain reopens there (the simulator covers crash semantics).
        let ops: Vec<Op> = ops
            .into_iter()
            .map(|op| if let Op::Crash(_) = op { Op::Reopen } else { op })
            .collect();
        run(&FsStorage::new(), tmp.path(), &cfg, &ops, |_| {});
    }
}

#[test]
fn empty_log_reads_nothing_and_survives_reopen() {
    let sim = SimStorage::new(0);
    let cfg = LogConfig::default();
    let (log, report) = open_sim(&sim, &cfg);
    assert_eq!((report.segments, report.next_offset), (1, 0));
    assert_eq!(log.last_durable(), None);
    assert_eq!(log.read_from(0).unwrap().count(), 0);
    assert!(log.read_from(1).is_err());
    drop(log);
    let (log, _) = open_sim(&sim, &cfg);
    assert_eq!(log.next_offset(), 0);
}
