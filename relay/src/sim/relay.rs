//! Source and stream: the native relay's real ordering code
//! ([`native::serve_frames`]) and the real log over [`SimStorage`], fed by a
//! simulated worker through an in-memory pipe, and stopped at named crash
//! points as if the process died. After each crash the storage loses what
//! was not synced, the log is reopened (torn tails cut), and the worker
//! replays from the only position it trusts: the last Ack.
//!
//! ```text
//!  simulated worker ── frames ──▶ serve_frames ──▶ Log<SimStorage> (append + fsync)
//!        ▲  confirmed := Ack                 │ crash at CrashPoint (seeded k-th time)
//!        └──────────── Ack(end LSN) ◀────────┘ → storage.crash(mode) → reopen → replay
//! ```
//!
//! Invariants checked after every round and at the end:
//! - the source position (confirmed) is never ahead of what the log holds
//!   durably (publish before acknowledge);
//! - at the end every source transaction is in the log exactly once, in
//!   commit order, whole (no gap, no duplicate, no half transaction).

use super::{CrashOnce, Rng, sim_envelope, sim_log_config, sim_row};
use crate::crash::CrashPoint;
use crate::log::Log;
use crate::log::storage::{SimCrash, SimStorage};
use crate::native::{self, NativeConfig, NativeStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use trellara_common::envelope::{self, Envelope, Operation};
use trellara_common::native_frame::FrameWriter;
use trellara_common::native_wire::RelayMessage;

/// What goes wrong in a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RelayFault {
    /// The relay dies at `CrashPoint` (the k-th time) and the machine loses
    /// what `SimCrash` says.
    Crash(CrashPoint, SimCrash),
    /// One fsync fails (the k-th): the log poisons itself, the relay exits
    /// without acknowledging, restarts and the worker replays. The storage
    /// then loses what `SimCrash` says of the unsynced writes: all of them
    /// (the failed writeback), or a torn or garbage tail (the process died
    /// inside fsync: the append -> fsync window).
    FsyncFails(SimCrash),
    /// A crash at the point, and every sparse index file is lost with it:
    /// the reopened log rebuilds what it needs from the segments.
    CrashLosingIndex(CrashPoint),
}

/// What one simulated history did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct History {
    pub transactions: usize,
    pub crashes: u32,
    pub rounds: u32,
    pub duplicates_skipped: u64,
    pub index_files_lost: u32,
}

/// `rows` inserts into `public.sim` (note of `note_len` bytes), as a
/// whole-transaction envelope the relay accepts.
fn workload_transaction(rows: usize, note_len: usize) -> Envelope {
    let note = "x".repeat(note_len);
    let rows: Vec<_> = (0..rows as u64)
        .map(|i| sim_row(Operation::Insert, i, &note, None))
        .collect();
    let total = rows.len() as u64;
    sim_envelope(rows, 0, (0, 1), total)
}

/// Source transactions: commit LSNs increasing, sizes from the seed, framed
/// small so most span several frames.
fn source(rng: &mut Rng) -> Vec<(Envelope, Vec<Vec<u8>>)> {
    let count = 5 + rng.below(20) as usize;
    let mut lsn = 0x0100_0000u64;
    (0..count)
        .map(|_| {
            lsn += 0x100 + rng.below(0x1000);
            let mut env = workload_transaction(1 + rng.below(8) as usize, rng.below(300) as usize);
            env.begin_lsn = lsn - 0x80;
            env.commit_lsn = lsn;
            env.end_lsn = lsn + 0x30;
            env.xid = lsn >> 8;
            let bytes = envelope::encode(&env).unwrap_or_default();
            let mut frames = Vec::new();
            if let Ok(mut writer) = FrameWriter::new(lsn, 0, &bytes, 41 + rng.below(400) as usize) {
                let mut frame = Vec::new();
                while writer.write_next(&mut frame) {
                    frames.push(std::mem::take(&mut frame));
                }
            }
            (env, frames)
        })
        .collect()
}

/// Runs one history: the worker streams every transaction past its
/// confirmed position; the relay crashes once at `point` (the k-th time,
/// k from the seed) and the storage loses according to `mode`; then the
/// relay restarts and the worker replays. Err names the broken invariant.
#[cfg(test)]
pub(crate) fn native_relay_history(
    seed: u64,
    point: CrashPoint,
    mode: SimCrash,
) -> Result<History, String> {
    history_with(seed, RelayFault::Crash(point, mode))
}

/// Runs one history with `fault` (see [`native_relay_history`]).
pub(crate) fn history_with(seed: u64, fault: RelayFault) -> Result<History, String> {
    let (point, mode) = match fault {
        RelayFault::Crash(point, mode) => (point, mode),
        RelayFault::FsyncFails(mode) => (CrashPoint::AppendedNotSynced, mode),
        RelayFault::CrashLosingIndex(point) => (point, SimCrash::LoseUnsynced),
    };
    let mut rng = Rng(seed);
    let txns = source(&mut rng);
    let storage = SimStorage::new(seed);
    let quarantine = std::env::temp_dir().join(format!("trellara-sim-{seed}"));
    // One counter across rounds, as one process's metric lives across the
    // worker's reconnects.
    let registry = crate::metrics::Metrics::new();
    let observer = crate::service::Observer {
        metrics: registry.flow(crate::service::Role::Both, "sim", "sim"),
        registry,
        health: crate::service::Health::new("relay", std::time::Duration::from_secs(60))
            .flow("sim", "sim", "sim"),
        live: crate::service::LiveSettings::new(None),
    };
    let captured = observer.metrics.captured.clone();
    let config = NativeConfig {
        socket_path: quarantine.join("unused.sock"),
        log_dir: quarantine,
        source_id: "sim".into(),
        max_envelope_bytes: 1 << 20,
        progress: None,
        begun: None,
        observe: Some(observer),
        floor: trellara_common::Lsn::ZERO,
        owner: None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    // Early enough that every point is reached in (almost) every history.
    let hooks = CrashOnce::new(point, 1 + rng.below(3) as u32);
    // An fsync fault history crashes by the fault, not by a hook.
    hooks.fired.set(matches!(fault, RelayFault::FsyncFails(_)));
    let fsync_skip = rng.below(4) as u32;
    let last_end = txns.last().map_or(0, |(env, _)| env.end_lsn);
    let mut confirmed = 0u64;
    let mut history = History {
        transactions: txns.len(),
        ..History::default()
    };
    loop {
        history.rounds += 1;
        if history.rounds > 5 {
            return Err(format!(
                "seed {seed}: no progress after {} rounds",
                history.rounds - 1
            ));
        }
        let (log, _) = Log::open(storage.clone(), "/log", sim_log_config())
            .map_err(|e| format!("seed {seed}: reopen the log: {e}"))?;
        let resume =
            crate::capture::read_resume(&log).map_err(|e| format!("seed {seed}: resume: {e}"))?;
        if matches!(fault, RelayFault::FsyncFails(_)) && history.rounds == 1 {
            storage.inject(crate::log::storage::SimFault {
                op: crate::log::storage::SimOp::Sync,
                path_contains: None,
                skip: fsync_skip,
                times: 1,
            });
        }
        if confirmed > resume.ack_lsn.0 {
            return Err(format!(
                "seed {seed}: the source was acknowledged to {confirmed:#x} but the log holds only up to {:#x} after a crash at {point:?} ({mode:?})",
                resume.ack_lsn.0
            ));
        }
        let (worker, relay) = tokio::io::duplex(1 << 16);
        let (relay_read, mut relay_write) = tokio::io::split(relay);
        let (mut worker_read, mut worker_write) = tokio::io::split(worker);
        let mut stats = NativeStats::default();
        let replay: Vec<u8> = txns
            .iter()
            .filter(|(env, _)| env.end_lsn > confirmed)
            .flat_map(|(_, frames)| frames.iter().flatten().copied())
            .collect();
        let mut acked = confirmed;
        let outcome = runtime.block_on(async {
            let (config, log, stats, hooks) = (&config, &log, &mut stats, &hooks);
            let serve = async move {
                let mut read = BufReader::new(relay_read);
                let result = native::serve_frames(
                    config,
                    log,
                    resume,
                    &mut read,
                    &mut relay_write,
                    stats,
                    hooks,
                )
                .await;
                // The relay "process" is gone: both halves of its end drop,
                // so the worker's writes and reads fail instead of waiting.
                drop(read);
                drop(relay_write);
                result
            };
            let send = async {
                let _ = worker_write.write_all(&replay).await;
                worker_write
            };
            let receive = async {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 256];
                loop {
                    while let Ok(Some((message, used))) = RelayMessage::decode(&buf) {
                        buf.drain(..used);
                        if let RelayMessage::Ack { end_lsn } = message {
                            acked = acked.max(end_lsn);
                        }
                    }
                    if acked >= last_end {
                        return;
                    }
                    match worker_read.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
                    }
                }
            };
            let finish = async {
                let (mut writer, ()) = tokio::join!(send, receive);
                // Everything acknowledged (or the relay died): hang up.
                let _ = writer.shutdown().await;
            };
            let (served, ()) = tokio::join!(serve, finish);
            served
        });
        history.duplicates_skipped += stats.duplicates_skipped;
        confirmed = acked;
        drop(log);
        match outcome {
            Ok(()) => break,
            Err(native::ConnectionError::Ended(reason))
                if reason.starts_with("simulated crash") =>
            {
                history.crashes += 1;
                storage.crash(mode);
                if let RelayFault::CrashLosingIndex(_) = fault {
                    use crate::log::storage::Storage;
                    let dir = std::path::Path::new("/log");
                    for name in storage.list(dir).unwrap_or_default() {
                        if name.ends_with(".idx") && storage.remove(&dir.join(name)).is_ok() {
                            history.index_files_lost += 1;
                        }
                    }
                }
            }
            // A failed fsync poisons the log: the relay exits (the process
            // would), and what it had not synced is lost or torn.
            Err(native::ConnectionError::Fatal(_))
                if matches!(fault, RelayFault::FsyncFails(_)) =>
            {
                history.crashes += 1;
                storage.clear_faults();
                storage.crash(mode);
            }
            Err(e) => return Err(format!("seed {seed}: the relay failed: {e:?}")),
        }
    }
    // A fault that never got its turn must not fail the final read.
    storage.clear_faults();
    // Every transaction, once, in order, whole.
    let (log, _) = Log::open(storage.clone(), "/log", sim_log_config())
        .map_err(|e| format!("seed {seed}: reopen the log: {e}"))?;
    let reader = log
        .read_from(log.first_offset())
        .map_err(|e| format!("seed {seed}: read the log: {e}"))?;
    let mut commits = Vec::new();
    for record in reader {
        let record = record.map_err(|e| format!("seed {seed}: log record: {e}"))?;
        let env = envelope::decode(&record.payload)
            .map_err(|e| format!("seed {seed}: log envelope: {e}"))?;
        commits.push(env.commit_lsn);
    }
    let expected: Vec<u64> = txns.iter().map(|(env, _)| env.commit_lsn).collect();
    if commits != expected {
        return Err(format!(
            "seed {seed}: after a crash at {point:?} ({mode:?}) the log holds {commits:x?}, the source committed {expected:x?}"
        ));
    }
    if confirmed != last_end {
        return Err(format!(
            "seed {seed}: the source ended confirmed at {confirmed:#x}, not {last_end:#x}"
        ));
    }
    // A transaction resent after a crash is counted once: the counter
    // moves only when its append is durable.
    if captured.get() > txns.len() as u64 {
        return Err(format!(
            "seed {seed}: {} transactions counted as captured, the source committed {} ({point:?}, {mode:?})",
            captured.get(),
            txns.len()
        ));
    }
    Ok(history)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POINTS: [CrashPoint; 3] = [
        CrashPoint::ReceivedNotAppended,
        CrashPoint::AppendedNotAcknowledged,
        CrashPoint::Acknowledged,
    ];
    const MODES: [SimCrash; 3] = [
        SimCrash::LoseUnsynced,
        SimCrash::TornTail,
        SimCrash::GarbageTail,
    ];

    /// Every crash point under every storage crash mode, 40 seeds each:
    /// no gap, no duplicate, the source never ahead of the durable log.
    #[test]
    fn native_relay_survives_every_crash_point() {
        let mut crashes = 0;
        for point in POINTS {
            for mode in MODES {
                for seed in 0..40u64 {
                    let seed = seed * 7919 + point as u64 * 131 + mode as u64;
                    let history =
                        native_relay_history(seed, point, mode).unwrap_or_else(|e| panic!("{e}"));
                    crashes += history.crashes;
                }
            }
        }
        // 360 histories; group commit may append (and ack) a whole history
        // in fewer than `nth` flushes, so not every one crashes.
        assert!(crashes >= 300, "the crash points were reached: {crashes}");
    }

    /// The mutation check: with the relay acknowledging before it appends
    /// (a test-only switch), a crash in between leaves the source ahead of
    /// the log, and the simulator must say so.
    #[test]
    fn acknowledging_before_append_is_caught() {
        native::mutation::ACK_BEFORE_APPEND.with(|m| m.set(true));
        let caught = (0..40u64)
            .filter_map(|seed| {
                native_relay_history(seed, CrashPoint::Acknowledged, SimCrash::LoseUnsynced).err()
            })
            .collect::<Vec<_>>();
        native::mutation::ACK_BEFORE_APPEND.with(|m| m.set(false));
        assert!(
            caught.iter().any(|e| e.contains("acknowledged to")),
            "the broken ordering went unnoticed: {caught:?}"
        );
    }

    /// The index-loss scenarios really lose index files.
    #[test]
    fn index_loss_histories_lose_index_files() {
        let lost: u32 = (0..20)
            .map(|seed| {
                history_with(seed, RelayFault::CrashLosingIndex(CrashPoint::Acknowledged))
                    .map(|h| h.index_files_lost)
                    .unwrap_or_else(|e| panic!("{e}"))
            })
            .sum();
        assert!(lost > 0, "no index file existed to lose");
    }

    /// A replayed history is the same history.
    #[test]
    fn a_seed_replays_exactly() {
        let a = native_relay_history(42, CrashPoint::AppendedNotAcknowledged, SimCrash::TornTail);
        let b = native_relay_history(42, CrashPoint::AppendedNotAcknowledged, SimCrash::TornTail);
        assert_eq!(a, b);
        assert!(a.is_ok_and(|h| h.crashes == 1));
    }

    /// A crash after the Ack is the window where the worker replays what
    /// the log already has: duplicates are skipped, never appended twice.
    #[test]
    fn replay_after_an_ack_is_skipped_not_appended() {
        let skipped: u64 = (0..20)
            .map(|seed| {
                native_relay_history(
                    seed,
                    CrashPoint::AppendedNotAcknowledged,
                    SimCrash::LoseUnsynced,
                )
                .map(|h| h.duplicates_skipped)
                .unwrap_or_else(|e| panic!("{e}"))
            })
            .sum();
        assert!(skipped > 0, "some history replayed durable transactions");
    }
}
