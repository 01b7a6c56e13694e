//! Snapshot and handoff: the real snapshot machine
//! ([`snapshot::run_machine`]) and the flow's rule for when to re-plan
//! ([`snapshot::needs_snapshot`]) over a simulated source (two tables, a
//! seeded stream of transactions that keeps committing while tables are
//! copied, a slot whose consistent point splits history into "in the
//! snapshot" and "in the stream", a column added mid-run) and the in-memory
//! [`SimTarget`]; after the handoff the stream goes through the real log
//! into the real [`Applier`].
//!
//! Invariants checked:
//! - after the handoff, every committed target state equals the source as
//!   of the checkpoint committed with it (the copy's boundary and the
//!   stream meet with no gap and no duplicate);
//! - a run interrupted anywhere before the handoff is re-planned (new slot,
//!   new boundary), its tables copied again without doubling a row; one
//!   interrupted after the handoff streams on from its slot;
//! - DDL during the run fails closed (the copy or the stream refuses the
//!   unknown column) until the target has it;
//! - the state machine refuses a stale process's backward move;
//! - at the end the target equals the source, every streamed transaction
//!   counted once, the run handed off with both tables recorded.

use super::target::{CheckpointRow, Db, SimTarget, Table};
use super::{CrashOnce, Rng, sim_envelope, sim_log_config};
use crate::apply::{Applier, ApplyError};
use crate::crash::{CrashPoint, NoCrash};
use crate::log::Log;
use crate::log::storage::SimStorage;
use crate::snapshot::{self, RunState, RunStore, Slot, SnapshotError, SnapshotIo};
use crate::state::SnapshotState;
use trellara_common::Lsn;
use trellara_common::envelope::{
    self, BeforeImage, ColumnSchema, Operation, RelationSchema, ReplicaIdentity, RowChange, Value,
    value,
};

/// What goes wrong in a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SnapshotFault {
    /// Nothing: the source keeps writing while the tables are copied.
    Writes,
    /// The process dies at the point (`CopyInProgress` is reached inside
    /// the simulated copy).
    Crash(CrashPoint),
    /// The source's COPY fails mid-table.
    SourceFails,
    /// The COMMIT of a table's copy loses its session (committed or not).
    TargetFails,
    /// A column is added to `public.b` while the run copies.
    Ddl,
    /// A stale process tries to move the handed-off run backward.
    Backward,
}

/// What one simulated history did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct SnapshotHistory {
    pub transactions: usize,
    pub plans: u32,
    pub faults: u32,
    pub streamed: u64,
}

const TABLES: [&str; 2] = ["public.a", "public.b"];

/// One source transaction: its commit and its row changes by table.
struct SrcTxn {
    commit: u64,
    /// Written after the DDL: `public.b` rows carry `extra`.
    extra: bool,
    rows: Vec<(usize, RowChange)>,
}

/// The simulated source database.
struct Source {
    rng: Rng,
    txns: Vec<SrcTxn>,
    total: usize,
    pos: u64,
    next_id: u64,
    /// `public.b` has the column `extra` (the DDL ran).
    extra: bool,
    publication: bool,
    slot: Option<Lsn>,
    snapshots: u32,
    /// Exported snapshots by name, with their boundary.
    exported: std::collections::HashMap<String, Lsn>,
    /// Where the next transaction commits, when set (exactly at a boundary).
    commit_at: Option<u64>,
}

fn relation(table: usize, extra: bool) -> RelationSchema {
    let column = |name: &str, type_oid, key| ColumnSchema {
        name: name.into(),
        type_oid,
        type_modifier: -1,
        key,
    };
    let mut columns = vec![column("id", 20, true), column("note", 25, false)];
    if table == 1 && extra {
        columns.push(column("extra", 25, false));
    }
    let (_, name) = TABLES[table].split_at(7);
    let mut relation = RelationSchema {
        relation_id: 16_401 + table as u32,
        namespace: "public".into(),
        name: name.into(),
        replica_identity: ReplicaIdentity::Default as i32,
        columns,
        fingerprint: 0,
    };
    relation.fingerprint = trellara_common::fingerprint::fingerprint(&relation);
    relation
}

fn text(s: &str) -> Value {
    Value {
        kind: Some(value::Kind::Text(s.to_owned())),
    }
}

fn text_of(v: &Value) -> Option<String> {
    match &v.kind {
        Some(value::Kind::Text(s)) => Some(s.clone()),
        _ => None,
    }
}

/// Pads every row to the widest (a column added later reads NULL in older
/// rows), so states compare across the DDL.
fn normalized(table: &Table) -> Table {
    let width = table.values().map(Vec::len).max().unwrap_or(0);
    table
        .iter()
        .map(|(k, row)| {
            let mut row = row.clone();
            row.resize(width.max(3), None);
            (k.clone(), row)
        })
        .collect()
}

impl Source {
    fn new(seed: u64) -> Source {
        let mut rng = Rng(seed ^ 0x005A_A95B);
        let total = 10 + rng.below(20) as usize;
        Source {
            rng,
            txns: Vec::new(),
            total,
            pos: 0x0400_0000,
            next_id: 1,
            extra: false,
            publication: false,
            slot: None,
            snapshots: 0,
            exported: std::collections::HashMap::new(),
            commit_at: None,
        }
    }

    /// Commits one more transaction; false once the history is complete.
    fn commit(&mut self) -> bool {
        if self.txns.len() >= self.total {
            return false;
        }
        let state = self.state_at(u64::MAX);
        let mut rows = Vec::new();
        for _ in 0..1 + self.rng.below(4) {
            let t = self.rng.below(2) as usize;
            let keys: Vec<String> = state[t].keys().cloned().collect();
            let note = format!("n{}", self.rng.below(1000));
            let after = |id: &str| {
                let mut v = vec![text(id), text(&note)];
                if t == 1 && self.extra {
                    v.push(text(&format!("x{id}")));
                }
                v
            };
            let roll = self.rng.below(10);
            let row = if keys.is_empty() || roll < 5 {
                let id = self.next_id.to_string();
                self.next_id += 1;
                change(Operation::Insert, t, Vec::new(), after(&id))
            } else {
                let key = keys[self.rng.below(keys.len() as u64) as usize].clone();
                if rows.iter().any(|(rt, r): &(usize, RowChange)| {
                    *rt == t && r.after.first().and_then(text_of).as_deref() == Some(key.as_str())
                        || r.before.first().and_then(text_of).as_deref() == Some(key.as_str())
                }) {
                    // Touched already in this transaction: keep it simple.
                    continue;
                }
                if roll < 8 {
                    change(Operation::Update, t, Vec::new(), after(&key))
                } else {
                    let width = relation(t, self.extra).columns.len();
                    let mut before = vec![text(&key)];
                    before.resize(
                        width,
                        Value {
                            kind: Some(value::Kind::Absent(true)),
                        },
                    );
                    change(Operation::Delete, t, before, Vec::new())
                }
            };
            rows.push((t, row));
        }
        if rows.is_empty() {
            let id = self.next_id.to_string();
            self.next_id += 1;
            rows.push((
                0,
                change(Operation::Insert, 0, Vec::new(), vec![text(&id), text("n")]),
            ));
        }
        self.pos = match self.commit_at.take() {
            Some(at) => at,
            None => self.pos + 0x100 + self.rng.below(0x400),
        };
        self.txns.push(SrcTxn {
            commit: self.pos,
            extra: self.extra,
            rows,
        });
        true
    }

    /// Both tables with every transaction committed before `before`.
    fn state_at(&self, before: u64) -> [Table; 2] {
        let mut state = [Table::new(), Table::new()];
        for txn in self.txns.iter().take_while(|t| t.commit < before) {
            for (t, row) in &txn.rows {
                let table = &mut state[*t];
                if row.operation == Operation::Delete as i32 {
                    if let Some(key) = row.before.first().and_then(text_of) {
                        table.remove(&key);
                    }
                } else if let Some(key) = row.after.first().and_then(text_of) {
                    table.insert(key, row.after.iter().map(text_of).collect());
                }
            }
        }
        state
    }

    fn columns(&self, table: usize) -> Vec<String> {
        relation(table, self.extra)
            .columns
            .into_iter()
            .map(|c| c.name)
            .collect()
    }

    fn envelope(&self, txn: &SrcTxn) -> Result<Vec<u8>, String> {
        let rows: Vec<RowChange> = txn.rows.iter().map(|(_, r)| r.clone()).collect();
        let total = rows.len() as u64;
        let mut env = sim_envelope(rows, 0, (0, 1), total);
        let mut used: Vec<usize> = txn.rows.iter().map(|(t, _)| *t).collect();
        used.sort_unstable();
        used.dedup();
        env.relations = used.into_iter().map(|t| relation(t, txn.extra)).collect();
        env.begin_lsn = txn.commit - 0x40;
        env.commit_lsn = txn.commit;
        env.end_lsn = txn.commit + 0x28;
        env.xid = txn.commit >> 8;
        envelope::encode(&env).map_err(|e| format!("sim envelope: {e}"))
    }
}

fn change(operation: Operation, table: usize, before: Vec<Value>, after: Vec<Value>) -> RowChange {
    RowChange {
        relation_id: 16_401 + table as u32,
        operation: operation as i32,
        before_kind: if before.is_empty() {
            BeforeImage::None
        } else {
            BeforeImage::Key
        } as i32,
        before,
        after,
        truncate_cascade: false,
        truncate_restart_identity: false,
    }
}

/// The run row on the simulated target.
struct Runs<'a>(&'a mut SimTarget);

impl RunStore for Runs<'_> {
    async fn load_run(&mut self) -> Result<Option<RunState>, SnapshotError> {
        Ok(self
            .0
            .committed
            .run
            .map(|(run_id, state, consistent)| RunState {
                run_id,
                state,
                consistent_lsn: Some(consistent),
            }))
    }

    async fn set_state(
        &mut self,
        next: SnapshotState,
        _reason: Option<&str>,
    ) -> Result<(), SnapshotError> {
        if let Some(run) = self.0.committed.run.as_mut() {
            run.1 = next;
        }
        Ok(())
    }
}

/// The simulated source and target as the machine sees them.
struct Io<'a> {
    target: &'a mut SimTarget,
    source: &'a mut Source,
    fault: SnapshotFault,
    /// Copy attempts so far, and the one the fault strikes.
    copies: u32,
    nth: u32,
    fired: u32,
    /// Transactions the source committed while tables were copied.
    concurrent: u32,
}

impl RunStore for Io<'_> {
    async fn load_run(&mut self) -> Result<Option<RunState>, SnapshotError> {
        Runs(self.target).load_run().await
    }

    async fn set_state(
        &mut self,
        next: SnapshotState,
        reason: Option<&str>,
    ) -> Result<(), SnapshotError> {
        Runs(self.target).set_state(next, reason).await
    }
}

impl SnapshotIo for Io<'_> {
    async fn ensure_publication(&mut self) -> Result<Option<String>, SnapshotError> {
        if self.source.publication {
            return Ok(None);
        }
        self.source.publication = true;
        Ok(Some("created publication trellara_sim".into()))
    }

    async fn create_slot(&mut self) -> Result<(Slot, bool), SnapshotError> {
        let dropped = self.source.slot.is_some();
        let consistent = Lsn(self.source.pos + 1);
        self.source.slot = Some(consistent);
        self.source.snapshots += 1;
        // Half the time the next transaction commits exactly at the
        // boundary: in the stream, not in the snapshot.
        if self.source.rng.below(2) == 0 {
            self.source.commit_at = Some(consistent.0);
        }
        let snapshot = format!("00000003-{:08X}-1", self.source.snapshots);
        self.source.exported.insert(snapshot.clone(), consistent);
        Ok((
            Slot {
                name: "trellara_sim".into(),
                consistent,
                snapshot,
            },
            dropped,
        ))
    }

    async fn plan(&mut self, consistent: Lsn) -> Result<(), SnapshotError> {
        let db = &mut self.target.committed;
        let run_id = db.run.map_or(1, |r| r.0 + 1);
        db.run = Some((run_id, SnapshotState::Planned, consistent));
        db.copied.clear();
        Ok(())
    }

    async fn copy_table(
        &mut self,
        table: &str,
        snapshot: &str,
        _progress: &mut dyn FnMut(&str),
    ) -> Result<u64, SnapshotError> {
        // The source keeps committing while the run copies: those
        // transactions lie past the boundary, in the stream.
        for _ in 0..self.source.rng.below(3) {
            self.concurrent += u32::from(self.source.commit());
        }
        // The DDL lands before the first or the second table's copy.
        let ddl_now = self.source.rng.below(2) == 0 || self.copies > 0;
        if self.fault == SnapshotFault::Ddl && !self.source.extra && ddl_now {
            self.source.extra = true;
        }
        self.copies += 1;
        let strike = self.copies == self.nth;
        if strike && self.fault == SnapshotFault::SourceFails {
            self.fired += 1;
            return Err(SnapshotError::Simulated(
                "source: connection lost during COPY".into(),
            ));
        }
        let t = TABLES.iter().position(|n| *n == table).unwrap_or(0);
        // What the exported snapshot sees: commits before its boundary.
        let Some(boundary) = self.source.exported.get(snapshot).copied() else {
            return Err(SnapshotError::Simulated(format!(
                "source: snapshot {snapshot} does not exist"
            )));
        };
        let rows = self.source.state_at(boundary.0)[t].clone();
        let columns = self.source.columns(t);
        let db = self.target.begin_copy();
        let known = db.columns.get(table).cloned().unwrap_or_default();
        if let Some(missing) = columns.iter().find(|c| !known.contains(c)) {
            self.target.crash();
            return Err(SnapshotError::Table {
                table: table.to_owned(),
                problem: format!(
                    "cannot COPY into the target: column \"{missing}\" of relation does not exist"
                ),
                hint: "make the target's columns match the source".into(),
            });
        }
        let copied = db.tables.entry(table.to_owned()).or_default();
        copied.clear();
        for (key, mut row) in rows {
            row.resize(columns.len(), None);
            copied.insert(key, row);
        }
        let n = copied.len() as u64;
        db.copied.insert(table.to_owned(), n);
        if strike && self.fault == SnapshotFault::Crash(CrashPoint::CopyInProgress) {
            return Err(SnapshotError::Crashed(CrashPoint::CopyInProgress));
        }
        if strike && self.fault == SnapshotFault::TargetFails {
            self.fired += 1;
            if self.source.rng.below(2) == 0 {
                self.target.commit_copy();
            } else {
                self.target.crash();
            }
            return Err(SnapshotError::Simulated(
                "target: connection lost during COMMIT".into(),
            ));
        }
        self.target.commit_copy();
        Ok(n)
    }

    async fn release_snapshot(&mut self) {}

    async fn handoff(&mut self, checkpoint: Lsn, _consistent: Lsn) -> Result<(), SnapshotError> {
        let db = &mut self.target.committed;
        db.checkpoint = Some(CheckpointRow {
            commit_lsn: checkpoint,
            transactions: 0,
            duplicates: 0,
        });
        for q in db.quarantine.values_mut() {
            q.resolved = true;
        }
        Ok(())
    }
}

/// Checks one committed target state against the source, once the run is
/// handed off (while copying, tables hold different boundaries by design).
fn check_state(seed: u64, source: &Source, db: &Db, when: &str) -> Result<(), String> {
    let handed_off = db.run.is_some_and(|r| !snapshot::needs_snapshot(Some(r.1)));
    let Some(checkpoint) = db.checkpoint.filter(|_| handed_off) else {
        return Ok(());
    };
    let expected = source.state_at(checkpoint.commit_lsn.0 + 1);
    for (t, name) in TABLES.iter().enumerate() {
        let actual = db.tables.get(*name).map(normalized).unwrap_or_default();
        if actual != normalized(&expected[t]) {
            return Err(format!(
                "seed {seed}: {when}: {name} at checkpoint {} is not the source at that point: a gap or a duplicate at the handoff, or a half-applied transaction",
                checkpoint.commit_lsn
            ));
        }
    }
    Ok(())
}

/// Runs one snapshot history with `fault`. Err names the broken invariant.
pub(crate) fn history(seed: u64, fault: SnapshotFault) -> Result<SnapshotHistory, String> {
    let mut source = Source::new(seed);
    for _ in 0..2 + source.rng.below(6) {
        source.commit();
    }
    let nth = 1 + source.rng.below(2) as u32;
    let mut db = Db::default();
    for (t, name) in TABLES.iter().enumerate() {
        db.tables.insert((*name).into(), Table::new());
        db.columns.insert((*name).into(), source.columns(t));
    }
    let mut target = SimTarget::new(db);
    let hooks = match fault {
        SnapshotFault::Crash(point) if point != CrashPoint::CopyInProgress => CrashOnce::new(
            point,
            if point == CrashPoint::TableCopied {
                nth
            } else {
                1
            },
        ),
        _ => CrashOnce::never(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let storage = SimStorage::new(seed);
    let tables: Vec<String> = TABLES.iter().map(|t| (*t).to_owned()).collect();
    let mut history = SnapshotHistory::default();
    let (mut copies, mut fired) = (0, 0);
    let mut backward_tried = false;
    let mut rounds = 0;
    loop {
        rounds += 1;
        if rounds > 40 {
            return Err(format!(
                "seed {seed}: no progress after 40 rounds ({fault:?})"
            ));
        }
        let state = target.committed.run.map(|r| r.1);
        if snapshot::needs_snapshot(state) {
            history.plans += 1;
            let mut io = Io {
                target: &mut target,
                source: &mut source,
                fault,
                copies,
                nth,
                fired,
                concurrent: 0,
            };
            let result =
                runtime.block_on(snapshot::run_machine(&mut io, &tables, &mut |_| {}, &hooks));
            (copies, fired) = (io.copies, io.fired);
            if fault == SnapshotFault::Writes {
                history.faults += io.concurrent;
            }
            match result {
                Ok(report) => {
                    if target.committed.run.map(|r| r.2) != Some(report.consistent_lsn) {
                        return Err(format!(
                            "seed {seed}: the run records another boundary than the copy used"
                        ));
                    }
                }
                Err(SnapshotError::Crashed(_)) => {
                    history.faults += 1;
                    target.crash();
                    continue;
                }
                Err(SnapshotError::Simulated(_)) => continue,
                Err(SnapshotError::Table { problem, .. })
                    if fault == SnapshotFault::Ddl && problem.contains("extra") =>
                {
                    // The operator adds the column on the target.
                    history.faults += 1;
                    add_extra(&mut target);
                    continue;
                }
                Err(e) => return Err(format!("seed {seed}: the snapshot failed: {e} ({fault:?})")),
            }
        }
        for db in std::mem::take(&mut target.observed) {
            check_state(seed, &source, &db, "after the copy")?;
        }
        if fault == SnapshotFault::Backward && !backward_tried {
            backward_tried = true;
            history.faults += 1;
            let before = target.committed.run;
            for next in [
                SnapshotState::Copying,
                SnapshotState::Planned,
                SnapshotState::Copied,
            ] {
                let moved = runtime.block_on(snapshot::advance(&mut Runs(&mut target), next, None));
                if !matches!(moved, Err(SnapshotError::Transition { .. }))
                    || target.committed.run != before
                {
                    return Err(format!(
                        "seed {seed}: a stale process moved the handed-off run to {next:?}: {moved:?}"
                    ));
                }
            }
        }
        // The stream: capture appends what the slot holds past the boundary
        // (and past what the log has), then the applier applies it.
        let consistent = target.committed.run.map_or(0, |r| r.2.0);
        let dir = format!("/log-{}", history.plans);
        let (log, _) = Log::open(storage.clone(), &dir, sim_log_config())
            .map_err(|e| format!("seed {seed}: open the log: {e}"))?;
        let last = log.last_durable().map_or(0, |d| d.commit_lsn);
        let mut appended = Vec::new();
        for txn in source
            .txns
            .iter()
            .filter(|t| t.commit >= consistent && t.commit > last)
        {
            appended.push((txn.commit, source.envelope(txn)?));
        }
        if !appended.is_empty() {
            log.append_batch(appended.iter().map(|(lsn, b)| (*lsn, b.as_slice())))
                .map_err(|e| format!("seed {seed}: append: {e}"))?;
        }
        let mut applier = Applier::with_target(target, "sim", "sim", "trellara.yml");
        let applied = runtime.block_on(applier.apply_log_with(&log, &NoCrash));
        target = applier.into_target();
        for db in std::mem::take(&mut target.observed) {
            check_state(seed, &source, &db, "while streaming")?;
        }
        match applied {
            Ok(stats) => history.streamed += stats.transactions,
            Err(ApplyError::Quarantined { reason, .. })
                if fault == SnapshotFault::Ddl && reason.contains("extra") =>
            {
                history.faults += 1;
                add_extra(&mut target);
                continue;
            }
            Err(e) => return Err(format!("seed {seed}: apply failed: {e} ({fault:?})")),
        }
        // Writes go on; the history ends once everything is applied.
        let mut more = false;
        for _ in 0..1 + source.rng.below(3) {
            more |= source.commit();
        }
        if !more {
            break;
        }
    }
    history.transactions = source.txns.len();
    history.faults += fired;
    finish(seed, &source, &target.committed, fault, &history)?;
    Ok(history)
}

/// The operator adds `public.b.extra` on the target.
fn add_extra(target: &mut SimTarget) {
    let columns = target
        .committed
        .columns
        .entry(TABLES[1].into())
        .or_default();
    if !columns.iter().any(|c| c == "extra") {
        columns.push("extra".into());
    }
}

fn finish(
    seed: u64,
    source: &Source,
    db: &Db,
    fault: SnapshotFault,
    history: &SnapshotHistory,
) -> Result<(), String> {
    let Some((_, state, consistent)) = db.run else {
        return Err(format!("seed {seed}: no snapshot run recorded"));
    };
    if state != SnapshotState::StreamHandoffReady {
        return Err(format!(
            "seed {seed}: the run ended {state:?}, not handed off"
        ));
    }
    let end = source.state_at(u64::MAX);
    for (t, name) in TABLES.iter().enumerate() {
        let actual = db.tables.get(*name).map(normalized).unwrap_or_default();
        if actual != normalized(&end[t]) {
            return Err(format!(
                "seed {seed}: {name} does not equal the source at the end ({fault:?})"
            ));
        }
        if !db.copied.contains_key(*name) {
            return Err(format!(
                "seed {seed}: {name} has no copy recorded in the run"
            ));
        }
    }
    let streamed = source
        .txns
        .iter()
        .filter(|t| t.commit >= consistent.0)
        .count() as u64;
    let checkpoint = db.checkpoint.unwrap_or_default();
    if checkpoint.transactions != streamed || history.streamed != streamed {
        return Err(format!(
            "seed {seed}: {streamed} transactions lie past the boundary; the checkpoint counts {} and the applier applied {}",
            checkpoint.transactions, history.streamed
        ));
    }
    let last = source.txns.last().map_or(0, |t| t.commit);
    if streamed > 0 && checkpoint.commit_lsn.0 != last {
        return Err(format!(
            "seed {seed}: the checkpoint ended at {}, the source at {}",
            checkpoint.commit_lsn,
            Lsn(last)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replayed history is the same history.
    #[test]
    fn a_seed_replays_exactly() {
        for fault in [
            SnapshotFault::Crash(CrashPoint::CopyInProgress),
            SnapshotFault::Ddl,
        ] {
            assert_eq!(history(5, fault), history(5, fault));
        }
    }

    /// Interrupted runs are re-planned; handed-off ones are not.
    #[test]
    fn interruptions_before_the_handoff_re_plan_and_after_it_stream_on() {
        let plans = |fault| {
            (0..20)
                .map(|seed| {
                    history(seed, fault)
                        .map(|h| h.plans)
                        .unwrap_or_else(|e| panic!("{e}"))
                })
                .collect::<Vec<_>>()
        };
        assert!(
            plans(SnapshotFault::Crash(CrashPoint::CopiedNotHandedOff))
                .iter()
                .all(|p| *p == 2)
        );
        assert!(
            plans(SnapshotFault::Crash(CrashPoint::HandedOffNotStreaming))
                .iter()
                .all(|p| *p == 1)
        );
    }

    /// The mutation check: a handoff checkpoint at the boundary itself
    /// skips the transaction that commits exactly there.
    #[test]
    fn a_checkpoint_at_the_boundary_is_caught() {
        snapshot::mutation::CHECKPOINT_AT_BOUNDARY.with(|m| m.set(true));
        let failed = (0..30)
            .filter(|&seed| history(seed, SnapshotFault::Writes).is_err())
            .count();
        snapshot::mutation::CHECKPOINT_AT_BOUNDARY.with(|m| m.set(false));
        assert!(failed >= 10, "only {failed} of 30 histories noticed");
    }

    /// The mutation check: continuing a run interrupted mid-copy (instead
    /// of re-planning it) streams onto tables that were never copied at
    /// its boundary; the simulator must say so.
    #[test]
    fn continuing_an_interrupted_copy_is_caught() {
        let fault = SnapshotFault::Crash(CrashPoint::CopyInProgress);
        let fired: Vec<u64> = (0..30)
            .filter(|&seed| history(seed, fault).is_ok_and(|h| h.faults > 0))
            .collect();
        snapshot::mutation::CONTINUE_INTERRUPTED.with(|m| m.set(true));
        let missed: Vec<u64> = fired
            .iter()
            .copied()
            .filter(|&seed| history(seed, fault).is_ok())
            .collect();
        snapshot::mutation::CONTINUE_INTERRUPTED.with(|m| m.set(false));
        assert!(
            fired.len() >= 20,
            "the fault fired in {} histories",
            fired.len()
        );
        assert!(missed.is_empty(), "went unnoticed: seeds {missed:?}");
    }
}
