//! Recovery: torn tails are cut back to the last complete frame at every
//! possible byte; corruption anywhere else is an error naming file and byte.

mod log_support;

use std::path::Path;

use log_support::{
    contents, dir, frame_positions, open, open_sim, payload, segment_files, small_config,
};
use trellara_relay::log::storage::{FsStorage, SimCrash, SimFault, SimOp, SimStorage, Storage};
use trellara_relay::log::{Corruption, Error, Log, LogConfig};

/// A log of `n` records over several small segments; returns its model.
fn build<S: Storage>(storage: &S, dir: &Path, cfg: &LogConfig, n: u64) -> Vec<(u64, Vec<u8>)> {
    let (log, _) = open(storage, dir, cfg);
    let model: Vec<(u64, Vec<u8>)> = (0..n)
        .map(|i| (1000 + i, payload(i, 20 + (i as usize % 7))))
        .collect();
    for (lsn, p) in &model {
        log.append(*lsn, p).unwrap();
    }
    model
}

fn last_segment_and_frame(
    bytes_of: impl Fn(&Path) -> Vec<u8>,
    segments: &[std::path::PathBuf],
) -> (std::path::PathBuf, Vec<u8>, usize, usize) {
    let last = segments.last().unwrap().clone();
    let bytes = bytes_of(&last);
    let frames = frame_positions(&bytes);
    assert!(
        frames.len() >= 2,
        "the last segment needs an earlier frame too"
    );
    let (pos, len) = *frames.last().unwrap();
    assert_eq!(pos + len, bytes.len());
    (last, bytes, pos, len)
}

/// Reopens over damaged bytes and checks recovery to the frame before the
/// last one, then that the log takes new appends.
fn assert_recovers_to_prefix<S: Storage>(
    storage: &S,
    dir: &Path,
    cfg: &LogConfig,
    model: &[(u64, Vec<u8>)],
    segment: &Path,
    valid_len: u64,
    what: &str,
) {
    let (log, report) = open(storage, dir, cfg);
    let kept = &model[..model.len() - 1];
    assert_eq!(report.next_offset, kept.len() as u64, "{what}");
    let torn = report
        .torn_tail
        .unwrap_or_else(|| panic!("{what}: no torn tail reported"));
    assert_eq!(torn.segment, segment, "{what}");
    assert_eq!(torn.valid_len, valid_len, "{what}");
    assert_eq!(torn.next_offset, kept.len() as u64, "{what}");
    assert_eq!(contents(&log), kept, "{what}");
    let lsn = kept.last().unwrap().0;
    assert_eq!(log.last_durable().unwrap().commit_lsn, lsn, "{what}");
    assert_eq!(
        log.append(7, b"after recovery").unwrap(),
        kept.len() as u64,
        "{what}"
    );
}

#[test]
fn sim_truncating_the_last_frame_at_every_byte_recovers_the_prefix() {
    let sim = SimStorage::new(1);
    let cfg = small_config(300);
    let model = build(&sim, &dir(), &cfg, 27);
    let segments = segment_files(&sim, &dir());
    assert!(segments.len() >= 3);
    let (last, bytes, pos, len) = last_segment_and_frame(|p| sim.read_file(p).unwrap(), &segments);
    for cut in 0..len {
        let fork = sim.fork();
        fork.write_file(&last, &bytes[..pos + cut]).unwrap();
        if cut == 0 {
            // Ends exactly on a frame boundary: nothing torn.
            let (log, report) = open_sim(&fork, &cfg);
            assert_eq!(report.torn_tail, None);
            assert_eq!(contents(&log), model[..model.len() - 1]);
            continue;
        }
        assert_recovers_to_prefix(
            &fork,
            &dir(),
            &cfg,
            &model,
            &last,
            pos as u64,
            &format!("cut at +{cut}"),
        );
        assert_eq!(
            fork.read_file(&last).unwrap().len(),
            pos + 40 + b"after recovery".len()
        );
    }
}

#[test]
fn sim_flipping_any_byte_of_the_last_frame_recovers_the_prefix() {
    let sim = SimStorage::new(2);
    let cfg = small_config(300);
    let model = build(&sim, &dir(), &cfg, 27);
    let segments = segment_files(&sim, &dir());
    let (last, bytes, pos, len) = last_segment_and_frame(|p| sim.read_file(p).unwrap(), &segments);
    for i in 0..len {
        for mask in [0x01u8, 0x80, 0xff] {
            let fork = sim.fork();
            let mut bad = bytes.clone();
            bad[pos + i] ^= mask;
            fork.write_file(&last, &bad).unwrap();
            assert_recovers_to_prefix(
                &fork,
                &dir(),
                &cfg,
                &model,
                &last,
                pos as u64,
                &format!("flip {mask:#x} at +{i}"),
            );
        }
    }
}

#[test]
fn fs_truncating_or_flipping_the_last_frame_recovers_the_prefix() {
    let cfg = small_config(300);
    let origin = tempfile::tempdir().unwrap();
    let model = build(&FsStorage::new(), origin.path(), &cfg, 12);
    let mut segments: Vec<_> = std::fs::read_dir(origin.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segments.sort();
    let (last, bytes, pos, len) = last_segment_and_frame(|p| std::fs::read(p).unwrap(), &segments);
    let name = last.file_name().unwrap().to_owned();
    let copy_log = |damaged: &[u8]| {
        let tmp = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(origin.path()).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
            }
        }
        std::fs::write(tmp.path().join(&name), damaged).unwrap();
        tmp
    };
    for cut in 1..len {
        let tmp = copy_log(&bytes[..pos + cut]);
        let seg = tmp.path().join(&name);
        assert_recovers_to_prefix(
            &FsStorage::new(),
            tmp.path(),
            &cfg,
            &model,
            &seg,
            pos as u64,
            &format!("cut at +{cut}"),
        );
    }
    for i in 0..len {
        let mut bad = bytes.clone();
        bad[pos + i] ^= 0x20;
        let tmp = copy_log(&bad);
        let seg = tmp.path().join(&name);
        assert_recovers_to_prefix(
            &FsStorage::new(),
            tmp.path(),
            &cfg,
            &model,
            &seg,
            pos as u64,
            &format!("flip at +{i}"),
        );
    }
}

#[test]
fn corrupt_byte_in_a_sealed_segment_is_an_error_naming_file_and_offset() {
    let sim = SimStorage::new(3);
    let cfg = small_config(300);
    build(&sim, &dir(), &cfg, 27);
    let segments = segment_files(&sim, &dir());
    let sealed = segments[1].clone();
    let mut bytes = sim.read_file(&sealed).unwrap();
    let (pos, _) = frame_positions(&bytes)[1];
    bytes[pos + 45] ^= 0x40; // inside the payload of the segment's 2nd frame
    sim.write_file(&sealed, &bytes).unwrap();

    // With its index intact the segment opens; reading through it fails.
    let (log, _) = open_sim(&sim, &cfg);
    let err = log.read_from(0).unwrap().find_map(Result::err).unwrap();
    match &err {
        Error::Corrupt {
            path,
            pos: at,
            reason,
        } => {
            assert_eq!(path, &sealed);
            assert_eq!(*at, pos as u64);
            assert!(matches!(reason, Corruption::ChecksumMismatch { .. }));
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let message = err.to_string();
    assert!(
        message.contains(&sealed.display().to_string()) && message.contains(&format!("byte {pos}")),
        "{message}"
    );
    drop(log);

    // Without the index, open verifies the segment and refuses it.
    let index = sealed.with_extension("idx");
    sim.write_file(&index, b"not an index").unwrap();
    match Log::open(sim.clone(), dir(), cfg.clone()) {
        Err(Error::Corrupt { path, pos: at, .. }) => {
            assert_eq!(path, sealed);
            assert_eq!(at, pos as u64);
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn truncated_sealed_segment_is_an_error_not_a_torn_tail() {
    let sim = SimStorage::new(4);
    let cfg = small_config(300);
    build(&sim, &dir(), &cfg, 27);
    let segments = segment_files(&sim, &dir());
    let sealed = segments[0].clone();
    let bytes = sim.read_file(&sealed).unwrap();
    sim.write_file(&sealed, &bytes[..bytes.len() - 3]).unwrap();
    match Log::open(sim.clone(), dir(), cfg) {
        Err(Error::Corrupt {
            path,
            reason: Corruption::Truncated { .. },
            ..
        }) => assert_eq!(path, sealed),
        other => panic!("expected Corrupt(Truncated), got {other:?}"),
    }
}

#[test]
fn corrupt_frame_followed_by_a_valid_frame_in_the_last_segment_is_an_error() {
    let sim = SimStorage::new(5);
    let cfg = small_config(300);
    build(&sim, &dir(), &cfg, 27);
    let last = segment_files(&sim, &dir()).pop().unwrap();
    let mut bytes = sim.read_file(&last).unwrap();
    let frames = frame_positions(&bytes);
    assert!(frames.len() >= 2);
    let (pos, _) = frames[0];
    bytes[pos + 41] ^= 0x01;
    sim.write_file(&last, &bytes).unwrap();
    match Log::open(sim.clone(), dir(), cfg) {
        Err(Error::Corrupt { path, pos: at, .. }) => {
            assert_eq!(path, last);
            assert_eq!(at, pos as u64);
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert_eq!(
        sim.read_file(&last).unwrap(),
        bytes,
        "nothing was truncated"
    );
}

#[test]
fn torn_segment_header_of_a_fresh_segment_is_reinitialised() {
    let sim = SimStorage::new(6);
    let cfg = small_config(300);
    let model = build(&sim, &dir(), &cfg, 27);
    let last = segment_files(&sim, &dir()).pop().unwrap();
    let bytes = sim.read_file(&last).unwrap();
    let frames = frame_positions(&bytes);
    // Replace the last segment by the beginning of an empty one.
    let (log, _) = open_sim(&sim, &cfg);
    drop(log);
    for cut in [0usize, 5, 31] {
        let fork = sim.fork();
        fork.write_file(&last, &bytes[..cut]).unwrap();
        let open_result = Log::open(fork.clone(), dir(), cfg.clone());
        // Frames lived in that segment, so cutting its header loses them:
        // that is corruption of acknowledged data, but only detectable as
        // a torn header. The records before the segment must all survive.
        let (log, report) = open_result.unwrap();
        let torn = report.torn_tail.unwrap();
        assert_eq!(torn.segment, last);
        let kept = model.len() - frames.len();
        assert_eq!(contents(&log), model[..kept]);
    }
}

#[test]
fn missing_or_invalid_index_is_rebuilt_from_the_segment() {
    let sim = SimStorage::new(7);
    let cfg = small_config(300);
    let model = build(&sim, &dir(), &cfg, 40);
    let segments = segment_files(&sim, &dir());
    let first_index = segments[0].with_extension("idx");
    let second_index = segments[1].with_extension("idx");
    sim.remove(&first_index).unwrap();
    let mut bad = sim.read_file(&second_index).unwrap();
    bad[20] ^= 0xff;
    sim.write_file(&second_index, &bad).unwrap();
    let (log, report) = open_sim(&sim, &cfg);
    assert!(report.rebuilt_indexes.contains(&first_index));
    assert!(report.rebuilt_indexes.contains(&second_index));
    assert_eq!(contents(&log), model);
    for start in [0u64, 3, 17, 39] {
        let first = log.read_from(start).unwrap().next().unwrap().unwrap();
        assert_eq!(first.offset, start);
        assert_eq!(first.payload, model[start as usize].1);
    }
    drop(log);
    let (_, report) = open_sim(&sim, &cfg);
    assert!(
        report.rebuilt_indexes.is_empty(),
        "rebuilt indexes are reused"
    );
}

#[test]
fn a_lying_index_is_not_trusted_over_the_segment() {
    let sim = SimStorage::new(8);
    let cfg = small_config(4096);
    let (log, _) = open_sim(&sim, &cfg);
    let model: Vec<(u64, Vec<u8>)> = (0..60).map(|i| (i, payload(i, 30))).collect();
    for (lsn, p) in &model {
        log.append(*lsn, p).unwrap();
    }
    drop(log);
    // Roll once so segment 0 is sealed with an index, then make that
    // index point entries at the wrong frames (valid checksum, wrong data).
    let (log, _) = open_sim(
        &sim,
        &LogConfig {
            max_segment_bytes: 1,
            ..cfg.clone()
        },
    );
    log.append(99, b"roll").unwrap();
    drop(log);
    let first = segment_files(&sim, &dir())[0].clone();
    let index_path = first.with_extension("idx");
    let mut index = sim.read_file(&index_path).unwrap();
    let count = u32::from_le_bytes(index[40..44].try_into().unwrap()) as usize;
    assert!(count >= 3);
    for e in 1..count {
        let at = 48 + e * 16;
        let offset = u64::from_le_bytes(index[at..at + 8].try_into().unwrap());
        index[at..at + 8].copy_from_slice(&(offset + 1).to_le_bytes());
    }
    let body = index.len() - 8;
    let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&index[..body], 0);
    index[body..].copy_from_slice(&sum.to_le_bytes());
    sim.write_file(&index_path, &index).unwrap();
    let (log, _) = open_sim(&sim, &cfg);
    for start in [5u64, 20, 41, 59] {
        let record = log.read_from(start).unwrap().next().unwrap().unwrap();
        assert_eq!(record.offset, start);
        assert_eq!(record.payload, model[start as usize].1);
    }
}

#[test]
fn missing_middle_segment_is_a_gap_error() {
    let sim = SimStorage::new(9);
    let cfg = small_config(300);
    build(&sim, &dir(), &cfg, 27);
    let segments = segment_files(&sim, &dir());
    sim.remove(&segments[1]).unwrap();
    match Log::open(sim.clone(), dir(), cfg) {
        Err(Error::Gap { path, .. }) => assert_eq!(path, segments[2]),
        other => panic!("expected Gap, got {other:?}"),
    }
}

#[test]
fn crash_with_unsynced_tail_keeps_every_acknowledged_record() {
    for seed in 0..40u64 {
        for mode in [
            SimCrash::LoseUnsynced,
            SimCrash::TornTail,
            SimCrash::GarbageTail,
        ] {
            let sim = SimStorage::new(seed);
            let cfg = small_config(400);
            let model = build(&sim, &dir(), &cfg, 10 + seed % 7);
            let (log, _) = open_sim(&sim, &cfg);
            // This append's bytes reach the file but its fsync fails: it is
            // not acknowledged, and the crash may keep any prefix of it.
            sim.inject(SimFault::once(SimOp::Sync).on_path(".seg"));
            assert!(log.append(1, &payload(999, 64 + seed as usize)).is_err());
            drop(log);
            sim.clear_faults();
            sim.crash(mode);
            let (log, _) = open_sim(&sim, &cfg);
            let got = contents(&log);
            assert!(
                got.len() == model.len() || got.len() == model.len() + 1,
                "seed {seed} {mode:?}"
            );
            assert_eq!(got[..model.len()], model[..], "seed {seed} {mode:?}");
        }
    }
}
