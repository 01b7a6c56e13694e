//! A payload streamed from a reader is appended whole or not at all, and a
//! log opened by this build clears the scratch directory older builds kept.

mod log_support;

use std::io::{self, Read};

use log_support::{contents, dir, open, open_sim, payload, small_config};
use trellara_relay::log::storage::{
    FsStorage, OpenMode, SimCrash, SimFault, SimOp, SimStorage, Storage, StorageFile,
};
use trellara_relay::log::{Error, LogConfig};

#[test]
fn a_payload_larger_than_the_chunk_streams_in_and_survives_a_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let (log, _) = open(&FsStorage::new(), tmp.path(), &LogConfig::default());
    log.append(1, b"before").unwrap();
    // 4 MiB in envelope-sized pieces of varying length: 64 chunks of the
    // stream's 64 KiB buffer.
    let mut expected = Vec::new();
    let mut i = 0u64;
    while expected.len() < 4 << 20 {
        expected.extend_from_slice(&payload(i, 100 + (i as usize * 37) % 9000));
        i += 1;
    }
    let offset = log
        .append_from(2, expected.len() as u64, &mut expected.as_slice())
        .unwrap();
    assert_eq!(offset, 1);
    log.append(3, b"after").unwrap();
    let records = contents(&log);
    assert_eq!(records.len(), 3);
    assert_eq!(records[1].0, 2);
    assert!(records[1].1 == expected, "streamed payload differs");
    drop(log);
    let (log, report) = open(&FsStorage::new(), tmp.path(), &LogConfig::default());
    assert_eq!(report.torn_tail, None);
    assert!(contents(&log)[1].1 == expected);
}

#[test]
fn scratch_files_of_an_older_build_are_removed_on_open() {
    let sim = SimStorage::new(52);
    let legacy = dir().join("spill");
    sim.create_dir_all(&legacy).unwrap();
    let stale = legacy.join("00000000000000000000.spill");
    sim.open(&stale, OpenMode::Create)
        .unwrap()
        .append(&[1u8; 1000])
        .unwrap();
    let (log, report) = open_sim(&sim, &small_config(1 << 20));
    assert!(report.removed_files.contains(&stale), "{report:?}");
    assert!(sim.file_names(&legacy).is_empty());
    log.append(1, b"one").unwrap();
    assert!(
        sim.file_names(&legacy).is_empty(),
        "nothing writes there now"
    );
}

#[test]
fn a_log_without_the_old_scratch_directory_never_makes_one() {
    let sim = SimStorage::new(51);
    let (log, _) = open_sim(&sim, &small_config(1 << 20));
    log.append_from(1, 300_000, &mut &[7u8; 300_000][..])
        .unwrap();
    assert_eq!(contents(&log)[0].1, vec![7u8; 300_000]);
    assert!(sim.list(&dir().join("spill")).is_err());
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
