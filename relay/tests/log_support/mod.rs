//! Helpers shared by the `log_*` integration tests.
#![allow(dead_code, clippy::unwrap_used, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};

use trellara_relay::log::storage::{SimStorage, Storage};
use trellara_relay::log::{Log, LogConfig, OpenReport, Record};

pub const DIR: &str = "/log";

pub fn dir() -> PathBuf {
    PathBuf::from(DIR)
}

/// Small segments so a few records span several of them.
pub fn small_config(max_segment_bytes: u64) -> LogConfig {
    LogConfig {
        max_segment_bytes,
        index_interval_bytes: 128,
        read_buffer_bytes: 512,
        ..LogConfig::default()
    }
}

/// Deterministic, record-specific payload bytes.
pub fn payload(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (i.wrapping_mul(31).wrapping_add(j as u64 * 7) % 251) as u8)
        .collect()
}

pub fn open<S: Storage>(storage: &S, dir: &Path, config: &LogConfig) -> (Log<S>, OpenReport) {
    Log::open(storage.clone(), dir, config.clone()).unwrap()
}

pub fn open_sim(sim: &SimStorage, config: &LogConfig) -> (Log<SimStorage>, OpenReport) {
    open(sim, &dir(), config)
}

pub fn read_all<S: Storage>(log: &Log<S>) -> Vec<Record> {
    let first = log.first_offset();
    log.read_from(first)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
}

/// `(commit_lsn, payload)` of each record, for comparing with a model.
pub fn contents<S: Storage>(log: &Log<S>) -> Vec<(u64, Vec<u8>)> {
    read_all(log)
        .into_iter()
        .map(|r| (r.commit_lsn, r.payload))
        .collect()
}

/// Segment file names in `dir`, oldest first.
pub fn segment_files(sim: &SimStorage, dir: &Path) -> Vec<PathBuf> {
    sim.file_names(dir)
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .map(|n| dir.join(n))
        .collect()
}

/// Positions of the frames in a segment's bytes (walking the length
/// fields; the test wrote them, so they are trusted here).
pub fn frame_positions(segment: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut pos = 32;
    while pos + 40 <= segment.len() {
        let len = u32::from_le_bytes(segment[pos + 8..pos + 12].try_into().unwrap()) as usize;
        out.push((pos, 40 + len));
        pos += 40 + len;
    }
    out
}
