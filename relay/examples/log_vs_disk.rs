//! Log append bandwidth next to the raw write+fsync bandwidth of the same
//! disk, in the same run, at the same fsync cadence. Run by bench/log-vs-disk.
//!
//! 1. The log: `threads` appenders each append frames of `frame` bytes until
//!    `total` bytes are durable; group commit decides how many appends share
//!    an fsync (k = appends / fsyncs).
//! 2. Raw: one thread writes the same bytes sequentially to one file with
//!    `write` and calls `fdatasync` after every k frames - the cadence the log
//!    achieved - so the ratio isolates the log's own overhead (framing,
//!    checksums, index, coordination) from the disk.
//!
//! usage: log_vs_disk DIR FRAME_BYTES TOTAL_BYTES THREADS

use std::fs::OpenOptions;
use std::io::Write;
use std::sync::{Arc, Barrier};
use std::time::Instant;
use trellara_relay::log::storage::FsStorage;
use trellara_relay::log::{Log, LogConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, dir, frame, total, threads] = args.as_slice() else {
        return Err("usage: log_vs_disk DIR FRAME_BYTES TOTAL_BYTES THREADS".into());
    };
    let dir = std::path::PathBuf::from(dir);
    let frame: usize = frame.parse()?;
    let total: usize = total.parse()?;
    let threads: usize = threads.parse()?;
    let frames_per_thread = (total / frame / threads).max(1);
    let frames = frames_per_thread * threads;
    let bytes = (frames * frame) as f64;

    let log_dir = dir.join("log");
    let _ = std::fs::remove_dir_all(&log_dir);
    let (log, _) = Log::open(FsStorage::new(), &log_dir, LogConfig::default())?;
    let barrier = Arc::new(Barrier::new(threads + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let log = log.clone();
            let barrier = Arc::clone(&barrier);
            let payload = vec![t as u8; frame];
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..frames_per_thread {
                    log.append(i as u64, &payload).expect("append");
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().map_err(|_| "appender panicked")?;
    }
    let log_secs = start.elapsed().as_secs_f64();
    let stats = log.stats();
    drop(log);
    std::fs::remove_dir_all(&log_dir)?;
    let per_fsync = (stats.records as f64 / stats.fsyncs.max(1) as f64)
        .round()
        .max(1.0) as usize;

    let raw_path = dir.join("raw.dat");
    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&raw_path)?;
    let payload = vec![0x5Au8; frame];
    let start = Instant::now();
    for i in 0..frames {
        file.write_all(&payload)?;
        if (i + 1) % per_fsync == 0 || i + 1 == frames {
            file.sync_data()?;
        }
    }
    let raw_secs = start.elapsed().as_secs_f64();
    drop(file);
    std::fs::remove_file(&raw_path)?;

    let mib = |secs: f64| bytes / secs / (1024.0 * 1024.0);
    println!(
        "frame={frame} threads={threads} frames={frames} appends/fsync={per_fsync} \
         log={:.1}MiB/s raw={:.1}MiB/s ratio={:.0}%",
        mib(log_secs),
        mib(raw_secs),
        100.0 * raw_secs / log_secs
    );
    Ok(())
}
