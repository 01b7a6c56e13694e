//! Pipeline: whole rounds of a flow as the live run composes them - the
//! real [`round::drive`] running the external relay's real capture loop
//! ([`capture::stream_changes`], stopped by the flow's own
//! [`capture_stop`]) beside the real apply stage
//! ([`delivery::apply_stage`] over the local log) into the in-memory
//! target, with an operator beside them who stops the following round
//! once the target caught up with the source (SIGTERM). The source is the
//! capture family's seeded walsender, without streamed transactions: its
//! interleaved streams are not a history a serializable source could
//! commit in order, which the target would rightly refuse.
//!
//! Each history has one fault: capture dies, the applier dies, the target
//! refuses a row (a check constraint, repaired by the operator before the
//! next round), or the source session drops. A dead process loses its
//! unsynced log writes and its open target transaction; every other
//! round ends as `run --follow` ends one, and the next round starts from
//! the log and the checkpoint.
//!
//! Invariants checked:
//! - every round ends (a round still running after 120 simulated seconds
//!   is a hang: a failed stage beside a capture that is never stopped, or
//!   a stage never told that capture ended);
//! - after a round whose capture ended while the applier lived, the
//!   checkpoint is the last transaction the log holds durably: what was
//!   durable is applied before the round reports capture's error;
//! - every committed target state equals the source at the checkpoint it
//!   commits with, and the checkpoint is never ahead of the durable log;
//! - at the end the target equals the source, every transaction counted
//!   once.

use super::capture::{self as sim_capture, Committed, Session, Walsender};
use super::target::{Db, SimTarget, Table};
use super::{CrashOnce, Rng};
use crate::apply::postgres::text_of;
use crate::apply::{Applier, ApplyError, cursor_name};
use crate::capture::{self, CaptureError, CaptureStats, SourceStream};
use crate::crash::CrashPoint;
use crate::flow::delivery::{self, Delivery, Droppable, Signals};
use crate::flow::{Following, capture_stop, round};
use crate::log::Log;
use crate::log::storage::{SimCrash, SimStorage};
use crate::plan::Tuning;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;
use trellara_common::Lsn;
use trellara_common::envelope::{BeforeImage, Operation, change, value};
use trellara_external_relay::pgwire::WireError;

/// What goes wrong in a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PipelineFault {
    /// The process dies in capture at the point; the storage loses what
    /// `SimCrash` says.
    CaptureCrash(CrashPoint, SimCrash),
    /// The process dies in the applier at the point.
    ApplierCrash(CrashPoint),
    /// The target refuses a row until the operator repairs it: the stage
    /// fails while capture is following.
    Refused,
    /// The source session drops: capture ends with an error while the
    /// stage has rows to apply.
    SessionLost,
}

/// What one simulated history did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct PipelineHistory {
    pub transactions: usize,
    pub rounds: u32,
    pub faults: u32,
}

const TABLE: &str = "public.sim";
/// A round that runs longer than this (simulated) never ends.
const HANG: Duration = Duration::from_secs(120);
/// The constraint of the `Refused` fault: notes the source writes are
/// `n0`..`n999`, so most histories write a longer one.
const MAX_NOTE: usize = 3;

/// The source's table after each commit, in commit order.
fn model(committed: &[Committed]) -> Result<Vec<(Lsn, Table)>, String> {
    let text = |v: &trellara_common::envelope::Value| {
        text_of(v)
            .map(|t| t.map(std::borrow::Cow::into_owned))
            .map_err(|e| format!("the model cannot read a value: {e:?}"))
    };
    let mut table = Table::new();
    let mut states = Vec::with_capacity(committed.len());
    for txn in committed {
        for body in &txn.bodies {
            let change::Body::Row(row) = body else {
                continue;
            };
            let key = |values: &[trellara_common::envelope::Value]| {
                values.first().map(text).transpose().map(Option::flatten)
            };
            match Operation::try_from(row.operation) {
                Ok(Operation::Insert) => {
                    let new = row.after.iter().map(text).collect::<Result<_, _>>()?;
                    table.insert(key(&row.after)?.unwrap_or_default(), new);
                }
                Ok(Operation::Update) => {
                    let identity = if row.before_kind == BeforeImage::None as i32 {
                        &row.after
                    } else {
                        &row.before
                    };
                    let old = table
                        .remove(&key(identity)?.unwrap_or_default())
                        .ok_or("the source updated a row it does not hold")?;
                    let mut new = Vec::with_capacity(old.len());
                    for (i, v) in row.after.iter().enumerate() {
                        new.push(match v.kind {
                            Some(value::Kind::UnchangedToast(_)) => old.get(i).cloned().flatten(),
                            _ => text(v)?,
                        });
                    }
                    table.insert(key(&row.after)?.unwrap_or_default(), new);
                }
                Ok(Operation::Delete) => {
                    table.remove(&key(&row.before)?.unwrap_or_default());
                }
                Ok(Operation::Truncate) => table.clear(),
                _ => {
                    return Err(format!(
                        "the source made a change of kind {}",
                        row.operation
                    ));
                }
            }
        }
        states.push((Lsn(txn.commit_lsn), table.clone()));
    }
    Ok(states)
}

/// The model's table at `checkpoint` (None: nothing applied).
fn at(states: &[(Lsn, Table)], checkpoint: Option<Lsn>) -> Option<&Table> {
    static EMPTY: Table = Table::new();
    match checkpoint {
        None => Some(&EMPTY),
        Some(lsn) => states.iter().find(|(c, _)| *c == lsn).map(|(_, t)| t),
    }
}

/// The commit LSN of the last transaction the log holds durably and whole.
fn durable_commit(log: &Log<SimStorage>) -> Lsn {
    capture::read_resume(log).map_or(Lsn::ZERO, |r| r.commit_lsn)
}

/// Runs one pipeline history with `fault`. Err names the broken invariant
/// and the seed that replays it.
pub(crate) fn history(seed: u64, fault: PipelineFault) -> Result<PipelineHistory, String> {
    let mut rng = Rng(seed ^ 0x0919_E11E);
    // No refusal in the source: the faults are the pipeline's.
    let src = sim_capture::source(&mut rng, sim_capture::CaptureFault::Failover, false);
    let states = model(&src.committed).map_err(|e| format!("seed {seed}: {e}"))?;
    let goal = src
        .committed
        .last()
        .map_or(Lsn::ZERO, |c| Lsn(c.commit_lsn));
    let mut history = PipelineHistory {
        transactions: src.committed.len(),
        ..PipelineHistory::default()
    };
    let storage = SimStorage::new(seed);
    let nth = 1 + rng.below(4) as u32;
    let (capture_hooks, apply_hooks) = match fault {
        PipelineFault::CaptureCrash(point, _) => (CrashOnce::new(point, nth), CrashOnce::never()),
        PipelineFault::ApplierCrash(point) => (CrashOnce::never(), CrashOnce::new(point, nth)),
        _ => (CrashOnce::never(), CrashOnce::never()),
    };
    let mut target = SimTarget::new(Db {
        tables: [(TABLE.to_owned(), Table::new())].into(),
        max_note: (fault == PipelineFault::Refused).then_some(MAX_NOTE),
        ..Db::default()
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let confirmed = Rc::new(Cell::new(0u64));
    let violations = Rc::new(RefCell::new(Vec::new()));
    let drop_after = 5 + rng.below(30);
    let begun = Arc::new(tokio::sync::Notify::new());
    let config = capture::CaptureConfig {
        begun: Some(Arc::clone(&begun)),
        ..sim_capture::config()
    };
    loop {
        history.rounds += 1;
        if history.rounds > 8 {
            return Err(format!(
                "seed {seed}: no progress after 8 rounds ({fault:?})"
            ));
        }
        let when = format!("round {}", history.rounds);
        let consumers = [capture::SOURCE_ACK, &cursor_name("sim")];
        let (log, resume) = sim_capture::reopen(&storage, &consumers, confirmed.get())
            .map_err(|e| format!("seed {seed}: {when}: {e} ({fault:?})"))?;
        let exhausted = Rc::new(Cell::new(false));
        let session = Session {
            seed: seed.wrapping_add(u64::from(history.rounds)),
            confirmed: confirmed.clone(),
            log: log.clone(),
            violations: violations.clone(),
            exhausted: exhausted.clone(),
            drop_after: (fault == PipelineFault::SessionLost && history.faults == 0)
                .then_some(drop_after),
            confirmed_history: Rc::default(),
        };
        let mut walsender = Walsender::start(&src, resume.ack_lsn.0, session);
        let mut assembler = sim_capture::assembler(
            &config,
            config.chunk_bytes,
            &format!("trellara-sim-pipeline-{seed}"),
            capture::pinned(&config, &log).map_err(|e| format!("seed {seed}: pins: {e}"))?,
        );
        let applied_to = target.applied_to.clone();
        applied_to.set(
            target
                .committed
                .checkpoint
                .map_or(Lsn::ZERO, |c| c.commit_lsn),
        );
        let mut applier = Applier::with_target(target, "sim", "sim", "trellara.yml");
        let droppable = Droppable::default();
        let (shutdown_tx, shutdown) = tokio::sync::watch::channel(false);
        let round = round::drive(
            |failed| {
                let (config, log, walsender, assembler) =
                    (&config, &log, &mut walsender, &mut assembler);
                let hooks = &capture_hooks;
                async move {
                    use futures_util::FutureExt;
                    // Following: only the operator's SIGTERM or the failed
                    // stage stops it (the position goal is unused).
                    let (_durable_tx, durable) = tokio::sync::watch::channel(Lsn::ZERO);
                    let following = Following {
                        shutdown,
                        until: None,
                    };
                    let stop = capture_stop(Some(following), Lsn::ZERO, durable, failed);
                    let stop = std::pin::pin!(stop.fuse());
                    let mut stats = CaptureStats::default();
                    let result = capture::stream_changes(
                        config, log, walsender, assembler, resume, &mut stats, stop, hooks,
                    )
                    .await;
                    if let Ok(true) = result {
                        // As the session does at shutdown: report what is
                        // durable.
                        let _ = walsender.send_status().await;
                    }
                    result
                }
            },
            |captured| {
                let signals = Signals {
                    captured,
                    begun: &begun,
                    observe: None,
                    tuning: &Tuning::DEFAULT,
                    droppable: &droppable,
                    hooks: &apply_hooks,
                };
                delivery::apply_stage(&mut applier, &Delivery::Local, &log, "sim", signals)
            },
            |ends: round::Ends| {
                let exhausted = exhausted.clone();
                async move {
                    // The operator: SIGTERM once the source has nothing
                    // more and the target caught up; gone when both ended.
                    loop {
                        if exhausted.get() && applied_to.get() >= goal {
                            let _ = shutdown_tx.send(true);
                        }
                        if *ends.captured.borrow() && *ends.applied.borrow() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            },
        );
        let ended = runtime.block_on(async { tokio::time::timeout(HANG, round).await });
        target = applier.into_target();
        let Ok((captured, applied, ())) = ended else {
            return Err(format!(
                "seed {seed}: {when} never ended ({fault:?}): the target is at {:?}, capture {}",
                target.committed.checkpoint.map(|c| c.commit_lsn),
                if exhausted.get() {
                    "sent everything"
                } else {
                    "still streaming"
                }
            ));
        };
        if let Some(v) = violations.borrow().first() {
            return Err(format!("seed {seed}: {when}: {v} ({fault:?})"));
        }
        let durable = durable_commit(&log);
        for db in std::mem::take(&mut target.observed) {
            let checkpoint = db.checkpoint.map(|c| c.commit_lsn);
            if checkpoint.is_some_and(|c| c > durable) {
                return Err(format!(
                    "seed {seed}: {when}: the checkpoint {checkpoint:?} is ahead of the durable log ({durable})"
                ));
            }
            let expected = at(&states, checkpoint);
            if expected != db.tables.get(TABLE) {
                return Err(format!(
                    "seed {seed}: {when}: the target committed with its checkpoint at {checkpoint:?} differs from the source there ({fault:?}):\n target: {:?}\n source: {expected:?}",
                    db.tables.get(TABLE)
                ));
            }
        }
        let checkpoint = target
            .committed
            .checkpoint
            .map_or(Lsn::ZERO, |c| c.commit_lsn);
        if applied.is_ok() && captured.is_err() && checkpoint != durable {
            return Err(format!(
                "seed {seed}: {when}: capture ended ({:?}) with the log durable to {durable}, the applier ended at {checkpoint}: what was durable was not all applied",
                captured.as_ref().err()
            ));
        }
        match (captured, applied) {
            (Ok(_), Ok(_)) => break,
            (Err(CaptureError::Crashed(_)), _) | (_, Err(ApplyError::Crashed(_))) => {
                // The process died: unsynced log writes and the open
                // target transaction are gone.
                history.faults += 1;
                target.crash();
                drop(log);
                let mode = match fault {
                    PipelineFault::CaptureCrash(_, mode) => mode,
                    _ => SimCrash::LoseUnsynced,
                };
                storage.crash(mode);
            }
            (_, Err(ApplyError::Quarantined { reason, .. })) if fault == PipelineFault::Refused => {
                if !reason.contains("note_length") {
                    return Err(format!("seed {seed}: {when}: quarantined for {reason:?}"));
                }
                // The operator drops the constraint and runs again.
                history.faults += 1;
                target.committed.max_note = None;
            }
            (Err(CaptureError::Wire(WireError::Closed)), Ok(_))
                if fault == PipelineFault::SessionLost =>
            {
                history.faults += 1;
            }
            (captured, applied) => {
                return Err(format!(
                    "seed {seed}: {when}: capture ended with {captured:?}, the applier with {applied:?} ({fault:?})"
                ));
            }
        }
    }
    let checkpoint = target.committed.checkpoint.unwrap_or_default();
    if target.committed.tables.get(TABLE) != at(&states, Some(goal)).or(Some(&Table::new())) {
        return Err(format!(
            "seed {seed}: the target ended differing from the source ({fault:?})"
        ));
    }
    if !src.committed.is_empty()
        && (checkpoint.commit_lsn != goal || checkpoint.transactions != src.committed.len() as u64)
    {
        return Err(format!(
            "seed {seed}: the checkpoint ended at {} after {} transactions; the source committed {} up to {goal} ({fault:?})",
            checkpoint.commit_lsn,
            checkpoint.transactions,
            src.committed.len()
        ));
    }
    Ok(history)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::round::mutation;

    /// Runs `fault` over 30 seeds with `switch` on and returns the failures.
    fn failures(
        switch: &'static std::thread::LocalKey<Cell<bool>>,
        fault: PipelineFault,
    ) -> Vec<String> {
        switch.with(|m| m.set(true));
        let failed = (0..30u64)
            .filter_map(|seed| history(seed, fault).err())
            .collect();
        switch.with(|m| m.set(false));
        failed
    }

    /// The mutation check: a capture not stopped when the stage beside it
    /// failed follows for ever, applying nothing.
    #[test]
    fn a_capture_not_stopped_by_a_failed_stage_is_caught() {
        for fault in [
            PipelineFault::Refused,
            PipelineFault::ApplierCrash(CrashPoint::AppliedNotCommitted),
        ] {
            let failed = failures(&mutation::STAGE_FAILURE_UNSAID, fault);
            assert!(
                failed.len() >= 20 && failed.iter().all(|f| f.contains("never ended")),
                "{fault:?}: {failed:?}"
            );
        }
    }

    /// The mutation check: a stage never told that capture ended waits for
    /// ever.
    #[test]
    fn a_stage_not_told_that_capture_ended_is_caught() {
        let failed = failures(&mutation::CAPTURE_END_UNSAID, PipelineFault::SessionLost);
        assert!(
            failed.len() >= 20 && failed.iter().all(|f| f.contains("never ended")),
            "{failed:?}"
        );
    }

    /// A replayed history is the same history.
    #[test]
    fn a_seed_replays_exactly() {
        for fault in [PipelineFault::Refused, PipelineFault::SessionLost] {
            assert_eq!(history(5, fault), history(5, fault));
        }
    }
}
