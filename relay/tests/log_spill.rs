//! Oversized payloads spill to disk and stream into the log with memory
//! bounded by the spill budget.

mod log_support;

use std::io::{self, Read, Write};

use log_support::{contents, dir, open, open_sim, payload, small_config};
use trellara_relay::log::storage::{FsStorage, SimCrash, SimFault, SimOp, SimStorage};
use trellara_relay::log::{Error, LogConfig};

const BUDGET: usize = 64 * 1024;

#[test]
fn payload_many_times_the_budget_spills_and_round_trips_within_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let (log, _) = open(&FsStorage::new(), tmp.path(), &LogConfig::default());
    log.append(1, b"before").unwrap();
    let mut spill = log.spill_buffer(BUDGET);
    let mut expected = Vec::new();
    // 64x the budget, in envelope-sized pieces of varying length.
    let mut i = 0u64;
    while expected.len() < 64 * BUDGET {
        let piece = payload(i, 100 + (i as usize * 37) % 9000);
        spill.write_all(&piece).unwrap();
        expected.extend_from_slice(&piece);
        i += 1;
    }
    assert!(spill.is_spilled());
    assert_eq!(spill.len(), expected.len() as u64);
    let offset = log.append_spill(2, &mut spill).unwrap();
    assert_eq!(offset, 1);
    assert!(
        spill.peak_memory() <= BUDGET,
        "peak {} > budget {BUDGET}",
        spill.peak_memory()
    );
    println!(
        "spilled {} bytes with peak memory {}",
        expected.len(),
        spill.peak_memory()
    );
    let spill_file = spill.spill_path().to_path_buf();
    assert!(spill_file.exists());
    drop(spill);
    assert!(!spill_file.exists(), "spill file removed on drop");

    log.append(3, b"after").unwrap();
    let records = contents(&log);
    assert_eq!(records.len(), 3);
    assert_eq!(records[1].0, 2);
    assert!(records[1].1 == expected, "spilled payload differs");
    drop(log);
    let (log, report) = open(&FsStorage::new(), tmp.path(), &LogConfig::default());
    assert_eq!(report.torn_tail, None);
    assert!(contents(&log)[1].1 == expected);
}

#[test]
fn small_payloads_never_touch_the_spill_directory() {
    let sim = SimStorage::new(51);
    let (log, _) = open_sim(&sim, &small_config(1 << 20));
    let mut spill = log.spill_buffer(BUDGET);
    spill.push(b"small transaction").unwrap();
    assert!(!spill.is_spilled());
    assert_eq!(log.append_spill(9, &mut spill).unwrap(), 0);
    assert!(sim.file_names(&dir().join("spill")).is_empty());
    // Reuse after clear.
    spill.clear().unwrap();
    assert!(spill.is_empty());
    spill.push(&[7u8; 3 * BUDGET]).unwrap();
    assert_eq!(log.append_spill(10, &mut spill).unwrap(), 1);
    assert_eq!(contents(&log)[1].1, vec![7u8; 3 * BUDGET]);
}

#[test]
fn stale_spill_files_are_removed_on_open() {
    let sim = SimStorage::new(52);
    let cfg = small_config(1 << 20);
    let (log, _) = open_sim(&sim, &cfg);
    let mut spill = log.spill_buffer(16);
    spill.push(&[1u8; 1000]).unwrap();
    let path = spill.spill_path().to_path_buf();
    // A crash while the transaction was being accumulated.
    std::mem::forget(spill);
    drop(log);
    let (_, report) = open_sim(&sim, &cfg);
    assert!(report.removed_files.contains(&path), "{report:?}");
    assert!(sim.file_names(&dir().join("spill")).is_empty());
}

struct Failing {
    left: usize,
}

impl Read for Failing {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Err(io::Error::other("source broke"));
        }
        let n = buf.len().min(self.left).min(1000);
        buf[..n].fill(0xAB);
        self.left -= n;
        Ok(n)
    }
}

#[test]
fn failing_or_short_source_appends_nothing() {
    let sim = SimStorage::new(53);
    let (log, _) = open_sim(&sim, &small_config(1 << 20));
    log.append(1, b"one").unwrap();
    let err = log
        .append_from(2, 50_000, &mut Failing { left: 20_000 })
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Source {
                expected: 50_000,
                read: 20_000,
                ..
            }
        ),
        "{err:?}"
    );
    let err = log.append_from(2, 50_000, &mut &[0u8; 10][..]).unwrap_err();
    assert!(matches!(err, Error::Source { read: 10, .. }), "{err:?}");
    assert!(
        !log.is_poisoned(),
        "a caller's source failing is not a disk failure"
    );
    assert_eq!(log.append(3, b"three").unwrap(), 1, "offsets stay dense");
    assert_eq!(log.append_from(4, 5, &mut &b"four!"[..]).unwrap(), 2);
    let got = contents(&log);
    assert_eq!(
        got,
        vec![
            (1, b"one".to_vec()),
            (3, b"three".to_vec()),
            (4, b"four!".to_vec())
        ]
    );
}

#[test]
fn crash_mid_stream_leaves_a_torn_tail_that_recovery_cuts() {
    for seed in 0..20 {
        let sim = SimStorage::new(seed);
        let cfg = small_config(1 << 20);
        let (log, _) = open_sim(&sim, &cfg);
        log.append(1, b"durable").unwrap();
        // The checksum patch fails: the frame is written with a zero
        // checksum and never completed.
        sim.inject(SimFault::once(SimOp::WriteAt).on_path(".seg"));
        let big = payload(5, 200_000);
        assert!(
            log.append_from(2, big.len() as u64, &mut big.as_slice())
                .is_err()
        );
        assert!(log.is_poisoned());
        drop(log);
        sim.clear_faults();
        sim.crash(SimCrash::TornTail);
        let (log, report) = open_sim(&sim, &cfg);
        assert_eq!(
            contents(&log),
            vec![(1, b"durable".to_vec())],
            "seed {seed}"
        );
        if let Some(torn) = report.torn_tail {
            assert_eq!(torn.next_offset, 1);
        }
    }
}
