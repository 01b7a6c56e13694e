//! Segment log benchmarks, on the real file system (fsync included).
//!
//! ```text
//! cargo bench -p trellara-relay --bench log                 # all
//! cargo bench -p trellara-relay --bench log -- append/      # appends only
//! ```
//!
//! * `append/group_commit/frame=N`: `APPENDERS` threads each append records
//!   of N payload bytes and wait for durability; throughput is payload bytes
//!   made durable per second. The fsyncs/append ratio is printed.
//! * `read/sequential`: read a pre-written log front to back.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use trellara_relay::log::storage::FsStorage;
use trellara_relay::log::{Log, LogConfig};

const APPENDERS: usize = 4;

fn append_group_commit(c: &mut Criterion) {
    let mut group = c.benchmark_group("append");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    for (label, frame) in [
        ("1KiB", 1024usize),
        ("16KiB", 16 * 1024),
        ("256KiB", 256 * 1024),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let (log, _) =
            Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("open log");
        let payload = vec![0x5Au8; frame];
        group.throughput(Throughput::Bytes((frame * APPENDERS) as u64));
        group.bench_function(
            BenchmarkId::new("group_commit", format!("frame={label}")),
            |b| b.iter_custom(|iters| run_appenders(&log, &payload, iters)),
        );
        let stats = log.stats();
        eprintln!(
            "append/group_commit/frame={label}: {} appends, {} fsyncs ({:.2} appends per fsync)",
            stats.records,
            stats.fsyncs,
            stats.records as f64 / stats.fsyncs.max(1) as f64
        );
    }
    group.finish();
}

/// `APPENDERS` threads append `iters` records each; returns the wall time.
fn run_appenders(log: &Log<FsStorage>, payload: &[u8], iters: u64) -> Duration {
    let barrier = Arc::new(Barrier::new(APPENDERS + 1));
    let handles: Vec<_> = (0..APPENDERS)
        .map(|_| {
            let log = log.clone();
            let payload = payload.to_vec();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..iters {
                    log.append(i, &payload).expect("append");
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().expect("appender thread");
    }
    start.elapsed()
}

fn read_sequential(c: &mut Criterion) {
    let mut group = c.benchmark_group("read");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    let dir = tempfile::tempdir().expect("temp dir");
    let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("open log");
    let frame = 1024usize;
    let records = 32 * 1024u64;
    let payload = vec![0xA5u8; frame];
    for chunk in 0..records / 1024 {
        log.append_batch((0..1024).map(|i| (chunk * 1024 + i, payload.as_slice())))
            .expect("append batch");
    }
    group.throughput(Throughput::Bytes(records * frame as u64));
    group.bench_function("sequential", |b| {
        b.iter(|| {
            let mut n = 0u64;
            for record in log.read_from(0).expect("reader") {
                n += record.expect("record").payload.len() as u64;
            }
            assert_eq!(n, records * frame as u64);
        })
    });
    group.finish();
}

criterion_group!(benches, append_group_commit, read_sequential);
criterion_main!(benches);
