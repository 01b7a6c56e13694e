//! An in-memory target database for the simulator: tables keyed by their
//! replica identity, the flow's checkpoint row and quarantine records, with
//! real transaction semantics (a transaction works on a copy that replaces
//! the committed state at COMMIT, and vanishes on rollback or crash),
//! asynchronous commits a server crash undoes, and seeded faults at COMMIT
//! and at the checkpoint write. Every committed
//! state is kept, so the simulator can check what a concurrent reader could
//! have observed at each commit.

use crate::apply::{
    Locked, QuarantineRecord, Refusal, Settle, Target, TargetError, postgres::text_of,
};
use crate::state::SnapshotState;
use std::borrow::Cow;
use std::collections::BTreeMap;
use trellara_common::Lsn;
use trellara_common::envelope::{BeforeImage, Operation, RelationSchema, RowChange, value};

/// Rows of one table by key text.
pub(crate) type Table = BTreeMap<String, Vec<Option<String>>>;

/// The flow's row in `trellara.checkpoints`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CheckpointRow {
    pub commit_lsn: Lsn,
    pub transactions: u64,
    pub duplicates: u64,
}

/// One row of `trellara.quarantine`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct QuarantineRow {
    pub reason: String,
    pub attempts: u32,
    pub resolved: bool,
}

/// Everything the target holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Db {
    pub tables: BTreeMap<String, Table>,
    pub checkpoint: Option<CheckpointRow>,
    pub quarantine: BTreeMap<Lsn, QuarantineRow>,
    /// A check constraint on every table: `note` at most this many bytes.
    pub max_note: Option<usize>,
    /// Column names by table, where the simulation tracks them: a row
    /// naming a column its table lacks is refused (schema contract).
    pub columns: BTreeMap<String, Vec<String>>,
    /// `trellara.snapshot_runs`: (run id, state, consistent LSN).
    pub run: Option<(i64, SnapshotState, Lsn)>,
    /// `trellara.snapshot_tables`: rows copied by table.
    pub copied: BTreeMap<String, u64>,
}

/// Seeded target faults, each once, at the n-th call.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TargetFaults {
    /// The n-th COMMIT loses its session; `.1`: the server had committed.
    pub commit_lost: Option<(u32, bool)>,
    /// The n-th checkpoint write fails (disk full).
    pub checkpoint_fails: Option<u32>,
    /// The server crashes right after the n-th COMMIT (its reply lost),
    /// undoing what it had committed asynchronously.
    pub server_crash: Option<u32>,
}

#[derive(Debug, Default)]
pub(crate) struct SimTarget {
    pub committed: Db,
    /// What a server crash leaves when asynchronous commits followed the
    /// last durable one (None: everything committed is durable).
    durable: Option<Db>,
    open: Option<Db>,
    /// The open transaction commits durably.
    open_durable: bool,
    pub faults: TargetFaults,
    commits: u32,
    settles: u32,
    /// Faults that fired.
    pub fired: u32,
    /// Each committed state, in commit order, since the last take.
    pub observed: Vec<Db>,
    /// The checkpoint's commit LSN after each commit the applier saw
    /// succeed, for what watches beside a running applier (the pipeline
    /// family's operator).
    pub applied_to: std::rc::Rc<std::cell::Cell<Lsn>>,
    /// The checkpoint row's `fence_lsn` (crate::state::fence).
    pub fence: Option<Lsn>,
    /// A verify's session holds the fence lock: only then does the fence
    /// hold.
    pub fence_holder: bool,
}

fn table_name(relation: &RelationSchema) -> String {
    format!("{}.{}", relation.namespace, relation.name)
}

fn data(reason: String) -> Refusal {
    Refusal::Data(reason)
}

/// The key text of `values` (the key columns of `relation`).
fn key_of(relation: &RelationSchema, values: &[trellara_common::envelope::Value]) -> String {
    relation
        .columns
        .iter()
        .zip(values)
        .filter(|(c, _)| c.key)
        .map(|(_, v)| text_of(v).ok().flatten().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\u{1f}")
}

fn check(
    max_note: Option<usize>,
    relation: &RelationSchema,
    row: &[Option<String>],
) -> Result<(), Refusal> {
    let note = relation.columns.iter().position(|c| c.name == "note");
    if let (Some(max), Some(i)) = (max_note, note)
        && row
            .get(i)
            .and_then(Option::as_ref)
            .is_some_and(|n| n.len() > max)
    {
        return Err(data(format!(
            "new row for relation \"{}\" violates check constraint \"note_length\" (SQLSTATE 23514)",
            relation.name
        )));
    }
    Ok(())
}

impl SimTarget {
    pub fn new(db: Db) -> Self {
        SimTarget {
            committed: db,
            ..SimTarget::default()
        }
    }

    /// The process died: its open transaction is gone with its session.
    pub fn crash(&mut self) {
        self.open = None;
    }

    fn open(&mut self) -> Result<&mut Db, Refusal> {
        self.open
            .as_mut()
            .ok_or_else(|| data("no transaction is open".into()))
    }

    fn table(&mut self, relation: &RelationSchema) -> Result<&mut Table, Refusal> {
        let name = table_name(relation);
        let db = self.open()?;
        if let Some(columns) = db.columns.get(&name)
            && let Some(missing) = relation.columns.iter().find(|c| !columns.contains(&c.name))
        {
            return Err(data(crate::apply::missing_column(relation, &missing.name)));
        }
        db.tables
            .get_mut(&name)
            .ok_or_else(|| data(crate::apply::missing_table(relation)))
    }

    /// Opens a transaction outside the applier (the snapshot copy).
    pub fn begin_copy(&mut self) -> &mut Db {
        self.open.insert(self.committed.clone())
    }

    /// Commits the transaction `begin_copy` opened.
    pub fn commit_copy(&mut self) {
        if let Some(db) = self.open.take() {
            self.committed = db;
            self.observed.push(self.committed.clone());
        }
    }
}

impl SimTarget {
    /// Checkpoint, counts and quarantine resolution in the open transaction.
    fn settle(&mut self, settle: &Settle) -> Result<u64, Refusal> {
        self.settles += 1;
        if self.faults.checkpoint_fails == Some(self.settles) {
            self.fired += 1;
            return Err(Refusal::Transient(TargetError::Simulated(
                "could not extend file: No space left on device (SQLSTATE 53100)".into(),
            )));
        }
        let db = self.open()?;
        if let Some(last) = &settle.last {
            let row = db.checkpoint.get_or_insert_with(CheckpointRow::default);
            row.commit_lsn = last.commit_lsn;
            row.transactions += settle.applied;
            row.duplicates += settle.duplicates;
        } else if let Some(row) = db.checkpoint.as_mut() {
            row.duplicates += settle.duplicates;
        }
        let mut resolved = 0;
        for lsn in &settle.settled {
            if let Some(q) = db.quarantine.get_mut(lsn)
                && !q.resolved
            {
                q.resolved = true;
                resolved += 1;
            }
        }
        Ok(resolved)
    }

    fn commit(&mut self) -> Result<(), Refusal> {
        let db = self
            .open
            .take()
            .ok_or_else(|| data("no transaction".into()))?;
        self.commits += 1;
        let lost = self
            .faults
            .commit_lost
            .filter(|&(nth, _)| nth == self.commits)
            .map(|(_, applied)| applied);
        if lost == Some(false) {
            self.fired += 1;
            return Err(Refusal::Transient(TargetError::Simulated(
                "connection lost during COMMIT".into(),
            )));
        }
        if self.open_durable {
            self.durable = None;
        } else if self.durable.is_none() {
            self.durable = Some(self.committed.clone());
        }
        self.committed = db;
        self.observed.push(self.committed.clone());
        if self.faults.server_crash == Some(self.commits) {
            self.fired += 1;
            if let Some(durable) = self.durable.take() {
                self.committed = durable;
            }
            return Err(Refusal::Transient(TargetError::Simulated(
                "server closed the connection unexpectedly".into(),
            )));
        }
        if lost == Some(true) {
            self.fired += 1;
            return Err(Refusal::Transient(TargetError::Simulated(
                "connection lost during COMMIT".into(),
            )));
        }
        Ok(())
    }
}

impl Target for SimTarget {
    async fn begin(&mut self, durable: bool) -> Result<(), Refusal> {
        self.open = Some(self.committed.clone());
        self.open_durable = durable;
        Ok(())
    }

    async fn make_durable(&mut self, _flow: &str) -> Result<bool, Refusal> {
        // In PostgreSQL its COMMIT would commit an open transaction.
        if self.open.is_some() {
            return Err(data("make_durable inside an open transaction".into()));
        }
        if self.committed.checkpoint.is_none() {
            return Ok(false);
        }
        self.durable = None;
        Ok(true)
    }

    async fn settle_and_commit(
        &mut self,
        _flow: &str,
        _source_id: &str,
        settle: &Settle,
    ) -> Result<u64, Refusal> {
        let resolved = self.settle(settle)?;
        self.commit()?;
        self.applied_to.set(
            self.committed
                .checkpoint
                .map_or(Lsn::ZERO, |c| c.commit_lsn),
        );
        Ok(resolved)
    }

    async fn rollback(&mut self) {
        self.open = None;
    }

    async fn applied(&self, _flow: &str) -> Result<Option<Lsn>, TargetError> {
        Ok(self.committed.checkpoint.map(|c| c.commit_lsn))
    }

    type Lock = std::future::Ready<Result<Locked, Refusal>>;

    async fn send_lock_checkpoint(&mut self, _flow: &str) -> Result<Self::Lock, Refusal> {
        let fence = self.fence.filter(|_| self.fence_holder);
        Ok(std::future::ready(Ok(Locked {
            checkpoint: self.open()?.checkpoint.map(|c| c.commit_lsn),
            fence,
        })))
    }

    async fn fence(&mut self, _flow: &str) -> Result<Option<Lsn>, TargetError> {
        Ok(self.fence.filter(|_| self.fence_holder))
    }

    async fn insert_rows(
        &mut self,
        relation: &RelationSchema,
        rows: &[&RowChange],
    ) -> Result<(), Refusal> {
        let max_note = self.open()?.max_note;
        let table = self.table(relation)?;
        for row in rows {
            let values = row
                .after
                .iter()
                .map(|v| text_of(v).map(|t| t.map(Cow::into_owned)))
                .collect::<Result<Vec<_>, _>>()?;
            check(max_note, relation, &values)?;
            let key = key_of(relation, &row.after);
            if table.contains_key(&key) {
                return Err(data(format!(
                    "duplicate key value violates unique constraint \"{}_pkey\" (SQLSTATE 23505)",
                    relation.name
                )));
            }
            table.insert(key, values);
        }
        Ok(())
    }

    async fn truncate(&mut self, rows: &[(&RelationSchema, &RowChange)]) -> Result<(), Refusal> {
        for (relation, _) in rows {
            self.table(relation)?.clear();
        }
        Ok(())
    }

    async fn change_row(
        &mut self,
        relation: &RelationSchema,
        row: &RowChange,
    ) -> Result<Option<u64>, Refusal> {
        let max_note = self.open()?.max_note;
        let identity = if row.before_kind == BeforeImage::None as i32 {
            &row.after
        } else {
            &row.before
        };
        let key = key_of(relation, identity);
        let table = self.table(relation)?;
        let Some(old) = table.remove(&key) else {
            return Ok(Some(0));
        };
        if row.operation == Operation::Update as i32 {
            let mut new = Vec::with_capacity(old.len());
            for (i, v) in row.after.iter().enumerate() {
                new.push(match v.kind {
                    Some(value::Kind::UnchangedToast(_)) => old.get(i).cloned().flatten(),
                    _ => text_of(v)?.map(Cow::into_owned),
                });
            }
            check(max_note, relation, &new)?;
            let new_key = key_of(relation, &row.after);
            if table.contains_key(&new_key) {
                return Err(data(format!(
                    "duplicate key value violates unique constraint \"{}_pkey\" (SQLSTATE 23505)",
                    relation.name
                )));
            }
            table.insert(new_key, new);
        }
        Ok(Some(1))
    }

    async fn quarantine(&mut self, record: &QuarantineRecord<'_>) -> Result<(), TargetError> {
        let row = self
            .committed
            .quarantine
            .entry(record.commit_lsn)
            .or_insert_with(|| QuarantineRow {
                reason: String::new(),
                attempts: 0,
                resolved: false,
            });
        row.reason = record.reason.to_owned();
        row.attempts += 1;
        row.resolved = false;
        Ok(())
    }
}
