//! Target apply: the real applier ([`Applier::apply_log_with`]) reading the
//! real log over simulated storage into the in-memory [`SimTarget`], with
//! one fault per history - a crash at an applier [`CrashPoint`], a lost
//! COMMIT, a failing checkpoint write, a redelivered log, or data the target
//! refuses (missing table, a row changed behind Trellara's back, a check
//! constraint) followed by the operator's repair.
//!
//! The source is a seeded workload of inserts, updates (some changing the
//! key) and deletes on `public.sim`, some transactions chunked, appended to
//! the log in three stages (a stage may end inside a chunk run). A reference
//! model replays the workload, so the state after every commit LSN is known.
//!
//! Invariants checked after every round and at the end:
//! - every committed target state equals the model at the checkpoint it
//!   commits with (no half-visible transaction, none missing, none twice);
//! - the checkpoint is never ahead of what the log holds durably, although
//!   the applier reads records before they are;
//! - a refused transaction is quarantined and the flow stops at it: the
//!   checkpoint stays before it, a retry without repair refuses it again;
//! - at the end, after repair: the target equals the source, the checkpoint
//!   is the last commit, every transaction counted once, redeliveries
//!   counted as duplicates, every quarantine record resolved (what
//!   `trellara verify` calls CONVERGED).

use super::target::{Db, SimTarget, Table};
use super::topic::SimTopic;
use super::{CrashOnce, Rng, sim_envelope, sim_log_config, sim_row};
use crate::apply::{Applier, ApplyError, cursor_name};
use crate::crash::CrashPoint;
use crate::log::storage::{SimCrash, SimFault, SimOp, SimStorage};
use crate::log::{CursorPosition, Log};
use crate::transport::TransportError;
use crate::transport::kafka::Publisher;
use trellara_common::Lsn;
use trellara_common::envelope::{self, Operation, RowChange};

/// What goes wrong in a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ApplyFault {
    /// The applier dies at the point (the k-th time).
    Crash(CrashPoint),
    /// The k-th COMMIT loses its session; `applied`: the server committed
    /// before the reply was lost.
    CommitLost { applied: bool },
    /// The k-th checkpoint write fails (disk full).
    CheckpointFails,
    /// After the flow caught up, its cursor is rewound to the start.
    Rewind,
    /// The target table does not exist until the operator creates it.
    MissingTable,
    /// A row the source later updates or deletes is deleted on the target
    /// behind Trellara's back; the operator restores it.
    RowDeletedBehind,
    /// A check constraint the source data breaks; the operator drops it.
    Constraint,
    /// The log holds the first chunk of a chunked transaction cut by a
    /// relay crash, then the transaction again, whole.
    CutChunkRun,
    /// Kafka transport: the relay dies after the broker acknowledged a
    /// batch, before the publisher's cursor moved.
    TopicPublishCrash,
    /// Kafka transport: a batch fails after part of it landed.
    TopicSendFails,
    /// Kafka transport: the applier dies after the target commit, before
    /// the group offset moved.
    TopicApplierCrash,
    /// A stage is written to the log but its fsync fails while the applier
    /// holds its rows (it reads written records early); the relay dies,
    /// the unsynced records are lost, and the source sends them again.
    LogFsyncFails,
    /// The applier persists its cursor lazily and commits asynchronously
    /// in between; the target server crashes after the k-th commit and
    /// comes back without what it had not made durable.
    TargetServerCrash,
    /// A verify fences the following applier (crate::fence) and dies, or
    /// releases it, in one window.
    Fence(FenceWindow),
}

/// Where a verify's fence ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FenceWindow {
    /// Verify dies holding the fence lock, before it set a fence.
    BeforeHold,
    /// Verify dies with the applier held at L, taking the target's
    /// snapshot: the fence stays in the checkpoint row.
    DuringSnapshot,
    /// Verify released the fence (it stays in the row), and a second
    /// verify fences further on.
    AfterRelease,
}

/// What one simulated history did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct ApplyHistory {
    pub transactions: usize,
    pub faults: u32,
    pub rounds: u32,
    pub duplicates: u64,
    pub quarantined: u32,
}

const TABLE: &str = "public.sim";
/// Notes the workload writes are shorter; the constraint fault adds one
/// this long.
const LONG_NOTE: usize = 40;

/// One source transaction: its log records and what it did.
struct Txn {
    commit: u64,
    records: Vec<Vec<u8>>,
    /// Keys its updates and deletes locate rows by.
    touches: Vec<String>,
    /// The model state after it committed.
    after: Table,
}

fn row_values(id: u64, note: &str) -> Vec<Option<String>> {
    vec![Some(id.to_string()), Some(note.to_owned())]
}

/// The seeded workload and its model states.
fn workload(rng: &mut Rng, fault: ApplyFault) -> Vec<Txn> {
    let count = 6 + rng.below(18) as usize;
    let long_note_at = rng.below(count as u64) as usize;
    let force_chunked_at = rng.below(count as u64) as usize;
    let mut state = Table::new();
    let mut next_id = 1u64;
    let mut lsn = 0x0200_0000u64;
    let mut txns = Vec::with_capacity(count);
    for t in 0..count {
        let mut rows: Vec<RowChange> = Vec::new();
        let mut touches = Vec::new();
        let changes = 1 + rng.below(6);
        for _ in 0..changes {
            let keys: Vec<u64> = state.keys().filter_map(|k| k.parse().ok()).collect();
            let roll = rng.below(10);
            let note = "n".repeat(rng.below(16) as usize);
            if keys.is_empty() || roll < 5 {
                rows.push(sim_row(Operation::Insert, next_id, &note, None));
                state.insert(next_id.to_string(), row_values(next_id, &note));
                next_id += 1;
                continue;
            }
            let old = keys[rng.below(keys.len() as u64) as usize];
            state.remove(&old.to_string());
            touches.push(old.to_string());
            if roll < 7 {
                rows.push(sim_row(Operation::Update, old, &note, None));
                state.insert(old.to_string(), row_values(old, &note));
            } else if roll < 8 {
                // A key-changing update locates the row by its old key.
                rows.push(sim_row(Operation::Update, next_id, &note, Some(old)));
                state.insert(next_id.to_string(), row_values(next_id, &note));
                next_id += 1;
            } else {
                rows.push(sim_row(Operation::Delete, old, "", Some(old)));
            }
        }
        if fault == ApplyFault::Constraint && t == long_note_at {
            let note = "L".repeat(LONG_NOTE);
            rows.push(sim_row(Operation::Insert, next_id, &note, None));
            state.insert(next_id.to_string(), row_values(next_id, &note));
            next_id += 1;
        }
        if fault == ApplyFault::CutChunkRun && t == force_chunked_at && rows.len() < 2 {
            rows.push(sim_row(Operation::Insert, next_id, "pad", None));
            state.insert(next_id.to_string(), row_values(next_id, "pad"));
            next_id += 1;
        }
        let chunked = rows.len() >= 2
            && (rng.below(3) == 0 || (fault == ApplyFault::CutChunkRun && t == force_chunked_at));
        let chunks = if chunked {
            2 + rng.below(rows.len().min(3) as u64 - 1) as usize
        } else {
            1
        };
        lsn += 0x100 + rng.below(0x1000);
        let total = rows.len() as u64;
        let per = rows.len().div_ceil(chunks);
        let mut records = Vec::with_capacity(chunks);
        let mut rows = rows.into_iter();
        for index in 0..chunks {
            let part: Vec<RowChange> = rows.by_ref().take(per).collect();
            let mut env = sim_envelope(
                part,
                (index * per) as u64,
                (index as u32, chunks as u32),
                total,
            );
            env.begin_lsn = lsn - 0x80;
            env.commit_lsn = lsn;
            env.end_lsn = lsn + 0x30;
            env.xid = lsn >> 8;
            records.push(envelope::encode(&env).expect("valid sim envelope"));
        }
        txns.push(Txn {
            commit: lsn,
            records,
            touches,
            after: state.clone(),
        });
    }
    txns
}

/// The model state at `checkpoint` (empty before the first commit).
fn model_at(txns: &[Txn], checkpoint: Option<Lsn>) -> Table {
    let Some(Lsn(at)) = checkpoint else {
        return Table::new();
    };
    txns.iter()
        .take_while(|t| t.commit <= at)
        .last()
        .map(|t| t.after.clone())
        .unwrap_or_default()
}

/// Checks one committed state against the model, ignoring `tampered` (the
/// row the operator removed behind Trellara's back, until repaired).
fn check_state(
    seed: u64,
    txns: &[Txn],
    db: &Db,
    tampered: Option<&str>,
    when: &str,
) -> Result<(), String> {
    let checkpoint = db.checkpoint.map(|c| c.commit_lsn);
    if let Some(Lsn(at)) = checkpoint
        && !txns.iter().any(|t| t.commit == at)
    {
        return Err(format!(
            "seed {seed}: {when}: the checkpoint {} is no source commit",
            Lsn(at)
        ));
    }
    let mut expected = model_at(txns, checkpoint);
    let mut actual = db.tables.get(TABLE).cloned().unwrap_or_default();
    if let Some(key) = tampered {
        expected.remove(key);
        actual.remove(key);
    }
    if expected != actual {
        let missing: Vec<_> = expected
            .keys()
            .filter(|k| actual.get(*k) != expected.get(*k))
            .collect();
        let extra: Vec<_> = actual
            .keys()
            .filter(|k| !expected.contains_key(*k))
            .collect();
        return Err(format!(
            "seed {seed}: {when}: the target at checkpoint {checkpoint:?} is not the source at that commit (rows missing or different: {missing:?}; extra: {extra:?}): a half-applied, lost or doubled transaction"
        ));
    }
    Ok(())
}

/// The log's records: every transaction's, a cut chunk run first where the
/// fault asks for one.
fn log_records(txns: &[Txn], fault: ApplyFault) -> Vec<(u64, Vec<u8>)> {
    let mut cut = fault == ApplyFault::CutChunkRun;
    let mut out = Vec::new();
    for txn in txns {
        if cut && txn.records.len() > 1 {
            out.push((txn.commit, txn.records[0].clone()));
            cut = false;
        }
        out.extend(txn.records.iter().map(|r| (txn.commit, r.clone())));
    }
    out
}

/// The commit LSN of the last transaction the log holds durably and whole.
fn durable_commit(log: &Log<SimStorage>) -> u64 {
    let Ok(reader) = log.read_from(log.first_offset()) else {
        return 0;
    };
    reader
        .filter_map(Result::ok)
        .filter(|r| {
            envelope::decode(&r.payload)
                .ok()
                .and_then(|e| e.boundary)
                .is_none_or(|b| b.chunk_index + 1 >= b.chunk_count)
        })
        .map(|r| r.commit_lsn)
        .last()
        .unwrap_or(0)
}

/// Runs one history of the applier with `fault`. Err names the broken
/// invariant and the seed that replays it.
pub(crate) fn history(seed: u64, fault: ApplyFault) -> Result<ApplyHistory, String> {
    if fault == ApplyFault::TargetServerCrash {
        return server_crash_history(seed);
    }
    if let ApplyFault::Fence(window) = fault {
        return fence_history(seed, window);
    }
    let mut rng = Rng(seed ^ 0x00A1_1CE5);
    let txns = workload(&mut rng, fault);
    let records = log_records(&txns, fault);
    let mut cuts = [
        0,
        rng.below(records.len() as u64 + 1) as usize,
        rng.below(records.len() as u64 + 1) as usize,
        records.len(),
    ];
    cuts.sort_unstable();
    let nth = 1 + rng.below(3) as u32;
    let storage = SimStorage::new(seed);
    let mut db = Db::default();
    if fault != ApplyFault::MissingTable {
        db.tables.insert(TABLE.into(), Table::new());
    }
    if fault == ApplyFault::Constraint {
        db.max_note = Some(LONG_NOTE - 1);
    }
    let mut target = SimTarget::new(db);
    match fault {
        ApplyFault::CommitLost { applied } => target.faults.commit_lost = Some((nth, applied)),
        ApplyFault::CheckpointFails => target.faults.checkpoint_fails = Some(nth),
        _ => {}
    }
    let hooks = match fault {
        ApplyFault::Crash(point) => CrashOnce::new(point, nth),
        ApplyFault::TopicApplierCrash => CrashOnce::new(CrashPoint::CommittedCursorNotMoved, nth),
        _ => CrashOnce::never(),
    };
    let via_topic = matches!(
        fault,
        ApplyFault::TopicPublishCrash | ApplyFault::TopicSendFails | ApplyFault::TopicApplierCrash
    );
    let topic = SimTopic::failing_at((fault == ApplyFault::TopicSendFails).then_some(nth));
    let publish_hooks = match fault {
        ApplyFault::TopicPublishCrash => CrashOnce::new(CrashPoint::PublishedCursorNotMoved, nth),
        _ => CrashOnce::never(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let mut history = ApplyHistory {
        transactions: txns.len(),
        ..ApplyHistory::default()
    };
    if fault == ApplyFault::CutChunkRun {
        history.faults += 1;
    }
    let mut stage = 0;
    let mut tampered: Option<String> = None;
    let mut refused: Option<(Lsn, u32)> = None;
    let mut rewound = false;
    let mut injected = false;
    loop {
        history.rounds += 1;
        if history.rounds > 20 {
            return Err(format!(
                "seed {seed}: no progress after {} rounds",
                history.rounds - 1
            ));
        }
        let (log, _) = Log::open(storage.clone(), "/log", sim_log_config())
            .map_err(|e| format!("seed {seed}: reopen the log: {e}"))?;
        // This round's stage is written but will never be durable.
        let mut undurable = false;
        if stage < 3 {
            let part = &records[cuts[stage]..cuts[stage + 1]];
            if !part.is_empty() {
                let records = part.iter().map(|(lsn, bytes)| (*lsn, bytes.as_slice()));
                if fault == ApplyFault::LogFsyncFails && !injected && stage + 1 >= nth as usize {
                    injected = true;
                    log.write_batch(records)
                        .map_err(|e| format!("seed {seed}: write: {e}"))?;
                    // The next segment fsync is the one covering the stage.
                    storage.inject(SimFault::once(SimOp::Sync).on_path(".seg"));
                    undurable = true;
                } else {
                    log.append_batch(records)
                        .map_err(|e| format!("seed {seed}: append: {e}"))?;
                }
            }
            stage += 1;
        }
        // What the log holds durably (a write that rolled a segment made
        // what came before the roll durable).
        let durable = if undurable {
            durable_commit(&log)
        } else {
            records[..cuts[stage]].last().map_or(0, |(lsn, _)| *lsn)
        };
        if via_topic {
            // Store and forward: the publisher moves what is durable to the
            // topic, then the applier reads the topic.
            // Small batches, so chunk runs span batches.
            let publisher =
                Publisher::with_producer(&topic, "sim").with_batch_records(1 + (seed % 3) as usize);
            match runtime.block_on(publisher.publish_with(&log, &publish_hooks)) {
                Ok(_) => {}
                Err(TransportError::Crashed(_)) => {
                    history.faults += 1;
                    drop(log);
                    storage.crash(SimCrash::LoseUnsynced);
                    continue;
                }
                // The broker failed mid-batch: the next round re-sends.
                Err(TransportError::Simulated(_)) => continue,
                Err(e) => return Err(format!("seed {seed}: publish: {e}")),
            }
        }
        let mut applier = Applier::with_target(target, "sim", "sim", "trellara.yml");
        let result = if via_topic {
            runtime.block_on(applier.apply_log_with(&topic, &hooks))
        } else {
            runtime.block_on(applier.apply_log_with(&log, &hooks))
        };
        target = applier.into_target();
        let when = format!("round {}", history.rounds);
        for db in std::mem::take(&mut target.observed) {
            check_state(seed, &txns, &db, tampered.as_deref(), &when)?;
            if let Some(c) = db.checkpoint
                && c.commit_lsn.0 > durable
            {
                return Err(format!(
                    "seed {seed}: {when}: the checkpoint {} is ahead of the durable log ({})",
                    c.commit_lsn,
                    Lsn(durable)
                ));
            }
        }
        if undurable {
            // The poisoned log ends the run (or the stage held nothing to
            // commit yet); the relay dies, and the stage it never made
            // durable comes again from the source.
            match result {
                Ok(stats) => history.duplicates += stats.duplicates_skipped,
                // The fsync failed under the applier: the fault fired.
                Err(ApplyError::Log(_) | ApplyError::Transport(TransportError::Log(_))) => {
                    history.faults += 1;
                }
                Err(e) => return Err(format!("seed {seed}: the applier failed: {e}")),
            }
            storage.clear_faults();
            target.crash();
            drop(log);
            storage.crash(SimCrash::LoseUnsynced);
            stage -= 1;
            continue;
        }
        match result {
            Ok(stats) => {
                history.duplicates += stats.duplicates_skipped;
                if fault == ApplyFault::RowDeletedBehind
                    && tampered.is_none()
                    && history.faults == 0
                {
                    tampered = tamper(&txns, &mut target);
                    history.faults += u32::from(tampered.is_some());
                }
                if stage < 3 {
                    continue;
                }
                if fault == ApplyFault::Rewind && !rewound {
                    rewound = true;
                    history.faults += 1;
                    log.commit_cursor(
                        &cursor_name("sim"),
                        CursorPosition::start_at(log.first_offset()),
                    )
                    .map_err(|e| format!("seed {seed}: rewind: {e}"))?;
                    continue;
                }
                break;
            }
            Err(ApplyError::Crashed(_)) => {
                history.faults += 1;
                target.crash();
                drop(log);
                storage.crash(SimCrash::LoseUnsynced);
            }

            Err(ApplyError::Target(_)) => {}
            Err(ApplyError::Quarantined {
                commit_lsn, reason, ..
            }) => {
                history.quarantined += 1;
                let at = target.committed.checkpoint.map(|c| c.commit_lsn);
                if at.is_some_and(|c| c >= commit_lsn) {
                    return Err(format!(
                        "seed {seed}: {commit_lsn} was quarantined but the checkpoint is at {at:?}: the flow went past it"
                    ));
                }
                let culprit = expected_refusal(&txns, fault, at, tampered.as_deref());
                if culprit != Some(commit_lsn.0) || !refusal_names(fault, &reason) {
                    return Err(format!(
                        "seed {seed}: {commit_lsn} quarantined ({reason}); expected {:?} under {fault:?}",
                        culprit.map(Lsn)
                    ));
                }
                let attempts = target
                    .committed
                    .quarantine
                    .get(&commit_lsn)
                    .map_or(0, |q| q.attempts);
                match refused {
                    // First refusal: retried as is, it must be refused again.
                    None => {
                        history.faults += 1;
                        refused = Some((commit_lsn, attempts));
                    }
                    Some((lsn, before)) if lsn == commit_lsn && attempts == before + 1 => {
                        repair(&txns, fault, &mut target, tampered.take());
                    }
                    Some(other) => {
                        return Err(format!(
                            "seed {seed}: {commit_lsn} quarantined (attempt {attempts}) after {other:?}"
                        ));
                    }
                }
            }
            Err(e) => return Err(format!("seed {seed}: the applier failed: {e}")),
        }
    }
    history.faults += target.fired + topic.fired.get();
    finish(seed, &txns, fault, &target.committed, &history)?;
    if via_topic {
        check_topic(seed, &topic, &records, &target.committed)?;
    }
    Ok(history)
}

/// An applier as `trellara run` sets it up on a local log: the cursor
/// persisted at most every hour here, so the commits in between are
/// asynchronous, and each commit opens the next transaction.
fn lazy(target: SimTarget) -> Applier<SimTarget> {
    Applier::with_target(target, "sim", "sim", "trellara.yml")
        .with_cursor_every(std::time::Duration::from_secs(3600))
        .with_open_after_commit()
}

/// TA-14..16. A following applier and a verify's fence, as `crate::fence`
/// moves it: a first part of the log applied, the fence taken at H, the
/// rest of the log written, the fence moved to L, then the window's end.
/// Checked: every committed state is the source at its checkpoint; while a
/// holder lives, no commit at or past its fence is applied; held at L, the
/// target is exactly the source's transactions before L (what verify's
/// snapshot compares); once the holder is gone, the rest applies.
fn fence_history(seed: u64, window: FenceWindow) -> Result<ApplyHistory, String> {
    let mut rng = Rng(seed ^ 0x00FE_4CE5);
    let fault = ApplyFault::Fence(window);
    let txns = workload(&mut rng, fault);
    let records = log_records(&txns, fault);
    let count = txns.len() as u64;
    // Fences at a commit (it is held) or just past it (it is not), before
    // the last commit: some transaction is always held.
    let at = |rng: &mut Rng, from: u64| {
        let i = from + rng.below(count - 1 - from);
        Lsn(txns[i as usize].commit + rng.below(2))
    };
    let first = 1 + rng.below(count / 2);
    let hold = at(&mut rng, first);
    let fence = at(&mut rng, first).max(hold);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let (log, _) = Log::open(SimStorage::new(seed), "/log", sim_log_config())
        .map_err(|e| format!("seed {seed}: open the log: {e}"))?;
    let split = txns[first as usize].commit;
    let append = |before: bool| {
        let part = records.iter().filter(|(c, _)| (*c < split) == before);
        log.append_batch(part.map(|(lsn, bytes)| (*lsn, bytes.as_slice())))
            .map(drop)
            .map_err(|e| format!("seed {seed}: append: {e}"))
    };
    let mut db = Db::default();
    db.tables.insert(TABLE.into(), Table::new());
    let mut applier = Applier::with_target(SimTarget::new(db), "sim", "sim", "trellara.yml");
    // One pass of the applier; no state of it past a live holder's fence.
    let pass = |applier: &mut Applier<SimTarget>, when: &str| -> Result<bool, String> {
        runtime
            .block_on(applier.apply_log_with(&log, &crate::crash::NoCrash))
            .map_err(|e| format!("seed {seed}: {when}: {e}"))?;
        let target = applier.target_mut();
        let held = target.fence.filter(|_| target.fence_holder);
        for db in std::mem::take(&mut target.observed) {
            check_state(seed, &txns, &db, None, when)?;
            if let (Some(f), Some(c)) = (held, db.checkpoint)
                && c.commit_lsn >= f
            {
                return Err(format!(
                    "seed {seed}: {when}: the applier applied commit {} past the fence {f} of a live verify",
                    c.commit_lsn
                ));
            }
        }
        Ok(applier.held())
    };
    // What verify's target snapshot sees with the applier held at `at`.
    let snapshot = |applier: &mut Applier<SimTarget>, at: Lsn, when: &str| {
        let below = txns
            .iter()
            .rev()
            .find(|t| Lsn(t.commit) < at)
            .map(|t| Lsn(t.commit));
        let db = &applier.target_mut().committed;
        let checkpoint = db.checkpoint.map(|c| c.commit_lsn);
        if checkpoint != below {
            return Err(format!(
                "seed {seed}: {when}: held at the fence {at}, the target is at {checkpoint:?}, not at the last commit before it ({below:?}): verify would compare two positions"
            ));
        }
        check_state(seed, &txns, db, None, when)
    };
    append(true)?;
    pass(&mut applier, "before the fence")?;
    applier.target_mut().fence_holder = true;
    if window == FenceWindow::BeforeHold {
        applier.target_mut().fence_holder = false;
        append(false)?;
    } else {
        applier.target_mut().fence = Some(hold);
        append(false)?;
        pass(&mut applier, "held at H")?;
        applier.target_mut().fence = Some(fence);
        pass(&mut applier, "held at L")?;
        snapshot(&mut applier, fence, "held at L")?;
        // Dead or released: the fence stays in the row either way.
        applier.target_mut().fence_holder = false;
        if window == FenceWindow::AfterRelease {
            let later = at(&mut rng, first).max(fence);
            let target = applier.target_mut();
            target.fence_holder = true;
            target.fence = Some(later);
            pass(&mut applier, "held by a second verify")?;
            snapshot(&mut applier, later, "held by a second verify")?;
            applier.target_mut().fence_holder = false;
        }
    }
    if pass(&mut applier, "after the fence")? {
        return Err(format!(
            "seed {seed}: the applier stays held with no verify holding a fence"
        ));
    }
    let db = &applier.target_mut().committed;
    let last = txns.last().map(|t| Lsn(t.commit));
    if db.checkpoint.map(|c| c.commit_lsn) != last {
        return Err(format!(
            "seed {seed}: after the fence the target is at {:?}, not at the source's last commit {last:?}: the applier stayed held",
            db.checkpoint.map(|c| c.commit_lsn)
        ));
    }
    check_state(seed, &txns, db, None, "after the fence")?;
    Ok(ApplyHistory {
        transactions: txns.len(),
        faults: 1,
        rounds: 1,
        ..ApplyHistory::default()
    })
}

/// TA-13. Transactions arrive one at a time and each is applied at once
/// (one target commit each, as under a paced source); after some, the
/// applier persists its cursor as an idle one does. The target server
/// crashes after a seeded commit, undoing its asynchronous commits since
/// the last durable one; the applier reconnects as a new session and
/// starts again from its persisted cursor.
fn server_crash_history(seed: u64) -> Result<ApplyHistory, String> {
    let fault = ApplyFault::TargetServerCrash;
    let mut rng = Rng(seed ^ 0x5E4C_0DE5);
    let txns = workload(&mut rng, fault);
    let storage = SimStorage::new(seed);
    let (log, _) = Log::open(storage, "/log", sim_log_config())
        .map_err(|e| format!("seed {seed}: open the log: {e}"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let mut db = Db::default();
    db.tables.insert(TABLE.into(), Table::new());
    let mut target = SimTarget::new(db);
    target.faults.server_crash = Some(2 + rng.below(txns.len() as u64 - 1) as u32);
    let mut applier = lazy(target);
    let mut history = ApplyHistory {
        transactions: txns.len(),
        ..ApplyHistory::default()
    };
    let mut arrived = 0;
    loop {
        history.rounds += 1;
        if history.rounds > 2 * txns.len() as u32 + 5 {
            return Err(format!(
                "seed {seed}: no progress after {} rounds",
                history.rounds - 1
            ));
        }
        if arrived < txns.len() {
            let txn = &txns[arrived];
            log.append_batch(txn.records.iter().map(|r| (txn.commit, r.as_slice())))
                .map_err(|e| format!("seed {seed}: append: {e}"))?;
            arrived += 1;
        }
        let result = runtime.block_on(applier.apply_log_with(&log, &CrashOnce::never()));
        let result = match result {
            Ok(stats) if rng.below(3) == 0 => runtime
                .block_on(applier.persist_cursor(&log))
                .map(|()| stats),
            other => other,
        };
        let when = format!("round {}", history.rounds);
        for db in std::mem::take(&mut applier.target_mut().observed) {
            check_state(seed, &txns, &db, None, &when)?;
        }
        match result {
            Ok(stats) => {
                history.duplicates += stats.duplicates_skipped;
                if arrived == txns.len() {
                    break;
                }
            }
            // The server went away with the session: a new session.
            Err(ApplyError::Target(_)) => {
                history.faults += 1;
                let target = applier.into_target();
                check_state(seed, &txns, &target.committed, None, "after the crash")?;
                applier = lazy(target);
            }
            Err(e) => return Err(format!("seed {seed}: the applier failed: {e}")),
        }
    }
    runtime
        .block_on(applier.persist_cursor(&log))
        .map_err(|e| format!("seed {seed}: persist: {e}"))?;
    let target = applier.into_target();
    finish(seed, &txns, fault, &target.committed, &history)?;
    Ok(history)
}

/// The topic holds the log, in order, with at most repeated tails (the
/// re-sends after a crash or a failed batch); the copies were skipped and
/// counted by the applier.
fn check_topic(seed: u64, topic: &SimTopic, log: &[(u64, Vec<u8>)], db: &Db) -> Result<(), String> {
    let held = topic.records.borrow();
    let mut seen = std::collections::HashSet::new();
    let firsts: Vec<&(u64, Vec<u8>)> = held.iter().filter(|r| seen.insert(*r)).collect();
    if firsts.len() != log.len() || firsts.iter().zip(log).any(|(a, b)| *a != b) {
        return Err(format!(
            "seed {seed}: the topic does not hold the log in order ({} distinct records of {})",
            firsts.len(),
            log.len()
        ));
    }
    // Whatever is re-sent starts at a transaction's first record: a re-send
    // that resumes in the middle of a chunk run could not be told from the
    // run itself.
    let mut seen_so_far = std::collections::HashSet::new();
    let mut previous_new = true;
    for r in held.iter() {
        let new = seen_so_far.insert(r);
        if !new && previous_new {
            let first = envelope::decode(&r.1)
                .ok()
                .and_then(|e| e.boundary)
                .is_none_or(|b| b.chunk_index == 0);
            if !first {
                return Err(format!(
                    "seed {seed}: the topic re-sends commit {} from the middle of its chunk run",
                    Lsn(r.0)
                ));
            }
        }
        previous_new = new;
    }
    // A copy is either skipped as a duplicate or, when it interleaves with
    // a chunk run, absorbed as a cut run; a transaction whose every record
    // went out twice must have been counted as a duplicate.
    let mut sent: std::collections::HashMap<&(u64, Vec<u8>), usize> =
        std::collections::HashMap::new();
    for r in held.iter() {
        *sent.entry(r).or_default() += 1;
    }
    let twice = log.iter().map(|r| r.0).any(|commit| {
        log.iter()
            .filter(|r| r.0 == commit)
            .all(|r| sent.get(r) >= Some(&2))
    });
    if twice && db.checkpoint.is_none_or(|c| c.duplicates == 0) {
        return Err(format!(
            "seed {seed}: the topic holds a whole transaction twice, none counted as a duplicate"
        ));
    }
    Ok(())
}

/// Deletes, behind Trellara's back, a committed row that a later source
/// transaction updates or deletes; returns its key.
fn tamper(txns: &[Txn], target: &mut SimTarget) -> Option<String> {
    let at = target.committed.checkpoint.map_or(0, |c| c.commit_lsn.0);
    let table = target.committed.tables.get_mut(TABLE)?;
    let key = txns
        .iter()
        .filter(|t| t.commit > at)
        .flat_map(|t| &t.touches)
        .find(|k| table.contains_key(*k))?
        .clone();
    table.remove(&key);
    Some(key)
}

/// The commit that must be refused under `fault`, from checkpoint `at`.
fn expected_refusal(
    txns: &[Txn],
    fault: ApplyFault,
    at: Option<Lsn>,
    tampered: Option<&str>,
) -> Option<u64> {
    let after = at.map_or(0, |l| l.0);
    let mut pending = txns.iter().filter(|t| t.commit > after);
    match fault {
        ApplyFault::MissingTable => pending.next().map(|t| t.commit),
        ApplyFault::RowDeletedBehind => pending
            .find(|t| tampered.is_some_and(|k| t.touches.iter().any(|x| x == k)))
            .map(|t| t.commit),
        ApplyFault::Constraint => pending
            .find(|t| {
                t.after
                    .values()
                    .any(|r| r[1].as_ref().is_some_and(|n| n.len() >= LONG_NOTE))
            })
            .map(|t| t.commit),
        _ => None,
    }
}

fn refusal_names(fault: ApplyFault, reason: &str) -> bool {
    match fault {
        ApplyFault::MissingTable => reason.contains("does not exist"),
        ApplyFault::RowDeletedBehind => reason.contains("matched 0 rows"),
        ApplyFault::Constraint => reason.contains("check constraint"),
        _ => false,
    }
}

/// What the operator does after reading the quarantine record.
fn repair(txns: &[Txn], fault: ApplyFault, target: &mut SimTarget, tampered: Option<String>) {
    match fault {
        ApplyFault::MissingTable => {
            target.committed.tables.insert(TABLE.into(), Table::new());
        }
        ApplyFault::Constraint => target.committed.max_note = None,
        ApplyFault::RowDeletedBehind => {
            let at = target.committed.checkpoint.map(|c| c.commit_lsn);
            let source = model_at(txns, at);
            if let Some(key) = tampered
                && let Some(row) = source.get(&key)
                && let Some(table) = target.committed.tables.get_mut(TABLE)
            {
                table.insert(key, row.clone());
            }
        }
        _ => {}
    }
}

/// After recovery: what `trellara verify` would call CONVERGED.
fn finish(
    seed: u64,
    txns: &[Txn],
    fault: ApplyFault,
    db: &Db,
    history: &ApplyHistory,
) -> Result<(), String> {
    check_state(seed, txns, db, None, "at the end")?;
    let last = txns.last().map_or(0, |t| t.commit);
    let checkpoint = db.checkpoint.unwrap_or_default();
    if checkpoint.commit_lsn.0 != last {
        return Err(format!(
            "seed {seed}: the checkpoint ended at {}, the source at {}",
            checkpoint.commit_lsn,
            Lsn(last)
        ));
    }
    if checkpoint.transactions != txns.len() as u64 {
        return Err(format!(
            "seed {seed}: {} transactions counted applied, the source committed {}",
            checkpoint.transactions,
            txns.len()
        ));
    }
    if let Some((lsn, q)) = db.quarantine.iter().find(|(_, q)| !q.resolved) {
        return Err(format!(
            "seed {seed}: quarantine record {lsn} ({}) left unresolved after it applied",
            q.reason
        ));
    }
    let redelivered = matches!(
        fault,
        ApplyFault::CommitLost { applied: true }
            | ApplyFault::Crash(CrashPoint::CommittedCursorNotMoved)
            | ApplyFault::TopicApplierCrash
            | ApplyFault::Rewind
    );
    if redelivered && history.faults > 0 && checkpoint.duplicates == 0 {
        return Err(format!(
            "seed {seed}: a redelivery under {fault:?} was not counted as a duplicate"
        ));
    }
    if fault == ApplyFault::Rewind && checkpoint.duplicates < txns.len() as u64 {
        return Err(format!(
            "seed {seed}: the rewound log redelivered {} transactions, {} counted as duplicates",
            txns.len(),
            checkpoint.duplicates
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::mutation;

    /// Runs `fault` over 30 seeds with the `switch` on; every history in
    /// which the fault fired must fail.
    fn caught(switch: &'static std::thread::LocalKey<std::cell::Cell<bool>>, fault: ApplyFault) {
        let fired: Vec<u64> = (0..30u64)
            .filter(|&seed| history(seed, fault).is_ok_and(|h| h.faults > 0))
            .collect();
        switch.with(|m| m.set(true));
        let missed: Vec<u64> = fired
            .iter()
            .copied()
            .filter(|&seed| history(seed, fault).is_ok())
            .collect();
        switch.with(|m| m.set(false));
        assert!(
            fired.len() >= 20,
            "the fault fired in {} histories",
            fired.len()
        );
        assert!(
            missed.is_empty(),
            "the broken ordering went unnoticed: seeds {missed:?}"
        );
    }

    /// The mutation check: an applier that does not obey a verify's fence
    /// applies past it while verify compares, and verify would read two
    /// positions.
    #[test]
    fn applying_past_a_fence_is_caught() {
        caught(
            &mutation::FENCE_IGNORED,
            ApplyFault::Fence(FenceWindow::DuringSnapshot),
        );
        caught(
            &mutation::FENCE_IGNORED,
            ApplyFault::Fence(FenceWindow::AfterRelease),
        );
    }

    /// The mutation check: moving the log cursor before the target commit
    /// loses the transactions of a crash in between.
    #[test]
    fn cursor_before_commit_is_caught() {
        caught(
            &mutation::CURSOR_BEFORE_COMMIT,
            ApplyFault::Crash(CrashPoint::AppliedNotCommitted),
        );
    }

    /// The mutation check: an applier that ignores its checkpoint applies
    /// redeliveries twice.
    #[test]
    fn ignoring_the_checkpoint_is_caught() {
        caught(&mutation::IGNORE_CHECKPOINT, ApplyFault::Rewind);
        caught(
            &mutation::IGNORE_CHECKPOINT,
            ApplyFault::Crash(CrashPoint::CommittedCursorNotMoved),
        );
    }

    /// The mutation check: a publisher that moves its cursor in the middle
    /// of a chunk run makes a failed batch re-send the run from its middle,
    /// and the applier loses the transaction; the simulator must say so.
    #[test]
    fn a_publisher_cursor_mid_run_is_caught() {
        crate::transport::kafka::mutation::CURSOR_MID_RUN.with(|m| m.set(true));
        // It takes a fault right after a batch that ended inside a run.
        let failed = (0..120u64)
            .filter(|&seed| {
                history(seed, ApplyFault::TopicSendFails).is_err()
                    || history(seed, ApplyFault::TopicPublishCrash).is_err()
            })
            .count();
        crate::transport::kafka::mutation::CURSOR_MID_RUN.with(|m| m.set(false));
        assert!(failed >= 5, "only {failed} of 120 histories noticed");
    }

    /// The mutation check: an applier that commits before the records it
    /// read early are durable leaves the target ahead of the log when the
    /// fsync fails.
    #[test]
    fn committing_before_the_log_is_durable_is_caught() {
        caught(
            &crate::transport::mutation::COMMIT_BEFORE_DURABLE,
            ApplyFault::LogFsyncFails,
        );
    }

    /// The mutation check: persisting the cursor past asynchronous target
    /// commits without making them durable first loses them when the
    /// target server crashes (the log has moved on). It takes a persist
    /// between asynchronous commits and the crash.
    #[test]
    fn persisting_past_undurable_commits_is_caught() {
        let fault = ApplyFault::TargetServerCrash;
        let fired = (0..40u64)
            .filter(|&seed| history(seed, fault).is_ok_and(|h| h.faults > 0))
            .count();
        assert!(fired >= 35, "the crash fired in {fired} of 40 histories");
        mutation::PERSIST_UNDURABLE.with(|m| m.set(true));
        let failed = (0..40u64)
            .filter(|&seed| history(seed, fault).is_err())
            .count();
        mutation::PERSIST_UNDURABLE.with(|m| m.set(false));
        assert!(failed >= 25, "only {failed} of 40 histories noticed");
    }

    /// An applier that persists its cursor lazily leaves it behind the
    /// target; a crash then costs only redeliveries, which the checkpoint
    /// skips and counts. `persist_cursor` catches it up.
    #[test]
    fn a_lazy_cursor_costs_only_counted_redeliveries() {
        let txns = workload(&mut Rng(3), ApplyFault::Rewind);
        let records = log_records(&txns, ApplyFault::Rewind);
        let first = txns[0].records.len();
        let storage = SimStorage::new(3);
        let (log, _) = Log::open(storage, "/log", sim_log_config()).expect("open");
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let mut db = Db::default();
        db.tables.insert(TABLE.into(), Table::new());
        let lazy = |target| {
            Applier::with_target(target, "sim", "sim", "trellara.yml")
                .with_cursor_every(std::time::Duration::from_secs(3600))
        };
        let append = |part: &[(u64, Vec<u8>)]| {
            log.append_batch(part.iter().map(|(lsn, bytes)| (*lsn, bytes.as_slice())))
                .expect("append");
        };
        let cursor = |log: &Log<SimStorage>| log.cursor(&cursor_name("sim")).map(|c| c.next_offset);

        let last = records.len() - txns[txns.len() - 1].records.len();
        let mut applier = lazy(SimTarget::new(db));
        append(&records[..first]);
        runtime
            .block_on(applier.apply_log_with(&log, &CrashOnce::never()))
            .expect("apply");
        // The first commit of a session persists at once; the rest waits.
        assert_eq!(cursor(&log), Some(first as u64));
        append(&records[first..last]);
        let stats = runtime
            .block_on(applier.apply_log_with(&log, &CrashOnce::never()))
            .expect("apply");
        let middle = txns.len() - 2;
        assert_eq!(stats.transactions as usize, middle);
        assert_eq!(cursor(&log), Some(first as u64), "not due yet");

        // The process dies here: a new applier starts at the cursor.
        let mut again = lazy(applier.into_target());
        let stats = runtime
            .block_on(again.apply_log_with(&log, &CrashOnce::never()))
            .expect("apply");
        assert_eq!(
            (stats.transactions, stats.duplicates_skipped as usize),
            (0, middle)
        );
        append(&records[last..]);
        let stats = runtime
            .block_on(again.apply_log_with(&log, &CrashOnce::never()))
            .expect("apply");
        assert_eq!(stats.transactions, 1);
        assert!(
            cursor(&log) < Some(log.next_offset()),
            "only the session's first commit persisted the cursor"
        );
        runtime
            .block_on(again.persist_cursor(&log))
            .expect("persist");
        assert_eq!(cursor(&log), Some(log.next_offset()));
        let target = again.into_target();
        check_state(3, &txns, &target.committed, None, "at the end").expect("state");
        let checkpoint = target.committed.checkpoint.expect("checkpoint");
        assert_eq!(
            (
                checkpoint.transactions as usize,
                checkpoint.duplicates as usize
            ),
            (txns.len(), middle)
        );
    }

    /// A replayed history is the same history.
    #[test]
    fn a_seed_replays_exactly() {
        for fault in [
            ApplyFault::Crash(CrashPoint::CommittedCursorNotMoved),
            ApplyFault::RowDeletedBehind,
        ] {
            assert_eq!(history(7, fault), history(7, fault));
        }
    }

    /// The workload exercises what it claims: chunked transactions, key
    /// changes, deletes, stage ends inside a chunk run.
    #[test]
    fn the_workload_covers_chunks_updates_and_deletes() {
        let mut chunked = 0;
        let mut touched = 0;
        for seed in 0..20 {
            let txns = workload(&mut Rng(seed), ApplyFault::Rewind);
            chunked += txns.iter().filter(|t| t.records.len() > 1).count();
            touched += txns.iter().map(|t| t.touches.len()).sum::<usize>();
        }
        assert!(chunked >= 20 && touched >= 100, "{chunked} {touched}");
    }
}
