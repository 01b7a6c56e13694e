//! Group commit: concurrent appenders share fsyncs, and every acknowledged
//! record is readable in order afterwards.

mod log_support;

use std::sync::{Arc, Barrier};
use std::time::Duration;

use log_support::{open, open_sim, payload, read_all, small_config};
use trellara_relay::log::storage::{FsStorage, SimStorage, Storage};
use trellara_relay::log::{Log, LogConfig};

const THREADS: u64 = 8;
const PER_THREAD: u64 = 200;

/// Payload: thread id and sequence number, then filler.
fn tagged(thread: u64, seq: u64) -> Vec<u8> {
    let mut p = thread.to_le_bytes().to_vec();
    p.extend_from_slice(&seq.to_le_bytes());
    p.extend_from_slice(&payload(thread * 1000 + seq, 48));
    p
}

fn hammer<S: Storage>(log: &Log<S>) {
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let log = log.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let mut last = None;
                for seq in 0..PER_THREAD {
                    let offset = log.append(t * 1_000_000 + seq, &tagged(t, seq)).unwrap();
                    // Returned only once durable: the watermark covers it.
                    assert!(log.next_offset() > offset);
                    assert!(last.is_none_or(|l| offset > l));
                    last = Some(offset);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

fn check_all_readable<S: Storage>(log: &Log<S>) {
    let records = read_all(log);
    let total = THREADS * PER_THREAD;
    assert_eq!(records.len() as u64, total);
    let mut next_seq = vec![0u64; THREADS as usize];
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r.offset, i as u64, "offsets are dense");
        let t = u64::from_le_bytes(r.payload[..8].try_into().unwrap());
        let seq = u64::from_le_bytes(r.payload[8..16].try_into().unwrap());
        assert_eq!(seq, next_seq[t as usize], "thread {t} out of order");
        assert_eq!(r.commit_lsn, t * 1_000_000 + seq);
        assert_eq!(r.payload, tagged(t, seq));
        next_seq[t as usize] += 1;
    }
}

#[test]
fn fs_concurrent_appenders_share_fsyncs() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = LogConfig {
        max_segment_bytes: 64 * 1024,
        ..LogConfig::default()
    };
    let (log, _) = open(&FsStorage::new(), tmp.path(), &cfg);
    hammer(&log);
    let stats = log.stats();
    let total = THREADS * PER_THREAD;
    assert_eq!(stats.records, total);
    assert_eq!(stats.append_calls, total);
    assert!(stats.segments_rolled > 0);
    println!("fs: {} appends, {} fsyncs", stats.records, stats.fsyncs);
    assert!(stats.fsyncs < total, "{stats:?}");
    check_all_readable(&log);
    drop(log);
    let (log, report) = open(&FsStorage::new(), tmp.path(), &cfg);
    assert_eq!(report.torn_tail, None);
    check_all_readable(&log);
}

#[test]
fn sim_concurrent_appenders_with_slow_fsync_batch_heavily() {
    let sim = SimStorage::new(31);
    sim.set_sync_latency(Duration::from_micros(500));
    let (log, _) = open_sim(&sim, &small_config(16 * 1024));
    hammer(&log);
    let stats = log.stats();
    let total = THREADS * PER_THREAD;
    println!("sim: {} appends, {} fsyncs", stats.records, stats.fsyncs);
    // With a slow disk nearly every fsync covers several appenders.
    assert!(stats.fsyncs * 2 < total, "{stats:?}");
    check_all_readable(&log);
}

#[test]
fn a_batch_costs_one_fsync() {
    let sim = SimStorage::new(32);
    let (log, _) = open_sim(&sim, &small_config(1 << 20));
    let batch: Vec<(u64, Vec<u8>)> = (0..100).map(|i| (i, payload(i, 100))).collect();
    let range = log
        .append_batch(batch.iter().map(|(l, p)| (*l, p.as_slice())))
        .unwrap();
    assert_eq!(range, 0..100);
    let stats = log.stats();
    assert_eq!(
        (stats.records, stats.append_calls, stats.fsyncs),
        (100, 1, 1)
    );
    assert_eq!(
        log.append_batch(Vec::<(u64, Vec<u8>)>::new()).unwrap(),
        100..100
    );
    assert_eq!(log.stats().fsyncs, 1, "an empty batch syncs nothing");
}

#[test]
fn readers_tail_concurrent_appends_and_see_only_durable_records() {
    let sim = SimStorage::new(33);
    let (log, _) = open_sim(&sim, &small_config(2048));
    let writer = {
        let log = log.clone();
        std::thread::spawn(move || {
            for i in 0..500u64 {
                log.append(i, &payload(i, (i % 50) as usize)).unwrap();
            }
        })
    };
    let mut reader = log.read_from(0).unwrap();
    let mut seen = 0u64;
    while seen < 500 {
        match reader.next() {
            Some(record) => {
                let record = record.unwrap();
                assert_eq!(record.offset, seen);
                assert_eq!(record.payload, payload(seen, (seen % 50) as usize));
                assert!(record.offset < log.next_offset());
                seen += 1;
            }
            None => std::thread::yield_now(),
        }
    }
    writer.join().unwrap();
}

#[test]
fn records_larger_than_a_segment_get_their_own() {
    let sim = SimStorage::new(34);
    let (log, _) = open_sim(&sim, &small_config(256));
    log.append(1, &payload(0, 10)).unwrap();
    log.append(2, &payload(1, 1000)).unwrap();
    log.append(3, &payload(2, 10)).unwrap();
    let segments = log.segments();
    let bases: Vec<u64> = segments.iter().map(|s| s.base_offset).collect();
    assert_eq!(bases, vec![0, 1, 2]);
    assert!(segments[1].bytes > 256);
    assert_eq!(read_all(&log).len(), 3);
}
