//! The applier: envelopes from the durable log into a target, each source
//! transaction in one target transaction together with its checkpoint.
//! The ordering lives here, generic over [`Target`] (PostgreSQL in
//! [`postgres`]; an in-memory target in the deterministic simulator), so the
//! simulator drives this very code.
//!
//! Invariants:
//! * **Exactly-once effect.** Rows and the checkpoint `(flow, commit LSN,
//!   xid)` commit together; a transaction at or below the checkpoint is
//!   skipped and counted as a duplicate. The log cursor moves only after the
//!   target commit (and may be persisted later still), so a crash in
//!   between costs a redelivery, which the checkpoint absorbs.
//! * **Never ahead of the log.** Records are read as soon as they are
//!   written, so rows reach the target while the log's fsync runs; the
//!   target transaction commits only once [`Records::durable`] says the
//!   log holds them.
//! * **Never split.** All chunks of a chunked transaction apply in one
//!   target transaction.
//! * **Fail closed.** A transaction that cannot be applied as captured (a
//!   database error, a missing target table or column, an update or delete
//!   that matches no row, an envelope that fails its checksum) is rolled
//!   back and quarantined with its reason, its envelope and the recovery
//!   command; the flow stops there and never skips it. The next run retries
//!   it first and marks the record resolved when it applies.
//! * Unchanged TOAST values are left as they are (not in the SET list).

pub mod postgres;

pub use postgres::PgTarget;

use crate::crash::{CrashHooks, CrashPoint, NoCrash};
use crate::log::Log;
use crate::log::storage::FsStorage;
use crate::transport::{RecordReader, Records};
use std::collections::HashMap;
use std::time::Duration;
use tokio_postgres::Client;
use trellara_common::Lsn;
use trellara_common::envelope::{self, Envelope, Operation, RelationSchema, RowChange, change};
use trellara_common::table_name::TableName;

#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(
        "flow {flow}: transaction {xid} (commit {commit_lsn}) is quarantined: {reason}\n\
         hint: {recovery}"
    )]
    Quarantined {
        flow: String,
        xid: u64,
        commit_lsn: Lsn,
        reason: String,
        recovery: String,
        /// Held at a schema change on this table: released by `schema
        /// accept`, so a following sink waits for it.
        held: Option<String>,
    },
    #[error("target database")]
    Target(#[from] TargetError),
    #[error(transparent)]
    Log(#[from] crate::log::Error),
    #[error(transparent)]
    Transport(#[from] crate::transport::TransportError),
    /// Only the simulator's crash hooks produce this.
    #[error("simulated crash at {0:?}")]
    Crashed(CrashPoint),
    #[error(
        "flow {flow}: the record at log offset {offset} comes from source {found:?}, not from this flow's source {expected:?}; nothing of it was applied\nhint: the log or topic is shared with another flow: give each flow its own transport.log_dir (and topic), then `trellara reseed --config {config} --flow {flow}`"
    )]
    Foreign {
        flow: String,
        offset: u64,
        found: String,
        expected: String,
        config: String,
    },
}

/// A target that failed for reasons unrelated to the data.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("simulated target failure: {0}")]
    Simulated(String),
    #[error("could not make the applied transactions durable: {0}")]
    Durability(String),
}

impl From<tokio_postgres::Error> for ApplyError {
    fn from(e: tokio_postgres::Error) -> Self {
        ApplyError::Target(TargetError::Postgres(e))
    }
}

/// Why one transaction could not be applied.
#[derive(Debug)]
pub enum Refusal {
    /// The data cannot be applied as captured: quarantine it.
    Data(String),
    /// The target is busy, down or out of resources: retry later, the
    /// transaction itself is fine.
    Transient(TargetError),
    /// The process died here (simulator only): no rollback, no quarantine.
    Crashed(CrashPoint),
    /// The records being applied could not be made durable (a poisoned
    /// log): the transaction must not commit.
    Undurable(Box<ApplyError>),
    /// A schema change capture did not accept (`DdlEvent.held`) and the
    /// operator has not accepted on this target: quarantine the
    /// transaction as held at it.
    Held(Box<Hold>),
}

/// A transaction held at a schema change no sink applies on its own.
#[derive(Debug)]
pub struct Hold {
    /// The change, its decision and why, as capture named it.
    pub reason: String,
    pub table: String,
    /// The table's description after the change (an encoded
    /// RelationSchema), which `schema accept` checks the target against.
    pub schema: Vec<u8>,
}

/// Where the checkpoint moves: the last applied transaction of a target
/// transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub xid: u64,
}

/// What one target transaction settles besides its rows.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Settle {
    /// The new checkpoint (None: every transaction was a duplicate).
    pub last: Option<Checkpoint>,
    /// Source transactions applied.
    pub applied: u64,
    /// Redeliveries skipped, added to the flow's duplicate accounting.
    pub duplicates: u64,
    /// Commits now applied (or found already applied): their quarantine
    /// records, if any, are resolved.
    pub settled: Vec<Lsn>,
    /// Source commit times (Unix microseconds) of the transactions applied,
    /// for the lag metric.
    pub commit_micros: Vec<i64>,
    /// Redeliveries this target transaction skipped.
    pub skipped: u64,
}

/// A transaction the applier refuses, kept on the target.
pub use crate::state::quarantine::Record as QuarantineRecord;

/// What the applier needs from a target database. Everything between
/// The checkpoint lock's answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Locked {
    /// The commit LSN of the last applied transaction.
    pub checkpoint: Option<Lsn>,
    /// Where a verify holds the applier ([`crate::fence`]): no transaction
    /// committing at or past it is applied while it holds.
    pub fence: Option<Lsn>,
}

/// `begin` and `settle_and_commit` is one atomic target transaction;
/// `quarantine` runs outside one (after the rollback).
#[allow(async_fn_in_trait)] // used on one task; no Send bound needed
pub trait Target {
    /// Opens a target transaction. `durable`: its commit returns once the
    /// target made it durable. Otherwise it commits asynchronously, as
    /// PostgreSQL's own apply worker does, and a crash of the target
    /// server may undo it: the log still holds it, because the cursor
    /// moves past a commit only once a durable one follows it.
    async fn begin(&mut self, durable: bool) -> Result<(), Refusal>;
    /// Makes every commit of this session so far durable, outside a
    /// transaction. False when it could not (nothing of the flow's to
    /// write): the cursor then stays where it is.
    async fn make_durable(&mut self, flow: &str) -> Result<bool, Refusal>;
    /// Best effort: the session may be gone, which rolls back too.
    async fn rollback(&mut self);
    /// The flow's checkpoint as committed, read outside a transaction.
    async fn applied(&self, flow: &str) -> Result<Option<Lsn>, TargetError>;
    /// Answers the checkpoint lock later: statements sent behind it do not
    /// wait for it. The target answers in order, so poll it alongside them.
    type Lock: std::future::Future<Output = Result<Locked, Refusal>>;
    /// Sends the lock of the flow's checkpoint (held until commit, so no
    /// other applier can interleave) and returns its answer to come.
    async fn send_lock_checkpoint(&mut self, flow: &str) -> Result<Self::Lock, Refusal>;
    /// The flow's checkpoint, locked until commit.
    async fn lock_checkpoint(&mut self, flow: &str) -> Result<Locked, Refusal> {
        self.send_lock_checkpoint(flow).await?.await
    }
    /// The fence that holds the flow's applier now, read outside a
    /// transaction: how a held applier learns it may go on.
    async fn fence(&mut self, _flow: &str) -> Result<Option<Lsn>, TargetError> {
        Ok(None)
    }
    /// Moves the checkpoint and the counts, then commits; returns how many
    /// quarantine records it resolved. On an error the caller rolls back.
    async fn settle_and_commit(
        &mut self,
        flow: &str,
        source_id: &str,
        settle: &Settle,
    ) -> Result<u64, Refusal>;
    /// [`settle_and_commit`](Target::settle_and_commit), then opens the
    /// next transaction ([`begin`](Target::begin) and
    /// [`send_lock_checkpoint`](Target::send_lock_checkpoint)). A target
    /// that can sends all of it at once, so the next transaction costs the
    /// target no wake of its own. The commit's error is the caller's to
    /// roll back; a failure to open leaves no transaction open.
    async fn commit_and_open(
        &mut self,
        flow: &str,
        source_id: &str,
        settle: &Settle,
        durable: bool,
    ) -> Result<(u64, Option<Self::Lock>), Refusal> {
        let resolved = self.settle_and_commit(flow, source_id, settle).await?;
        if self.begin(durable).await.is_err() {
            return Ok((resolved, None));
        }
        match self.send_lock_checkpoint(flow).await {
            Ok(lock) => Ok((resolved, Some(lock))),
            Err(_) => {
                self.rollback().await;
                Ok((resolved, None))
            }
        }
    }
    /// Inserts a run of rows of one relation.
    async fn insert_rows(
        &mut self,
        relation: &RelationSchema,
        rows: &[&RowChange],
    ) -> Result<(), Refusal>;
    /// Truncates the tables of one TRUNCATE together.
    async fn truncate(&mut self, rows: &[(&RelationSchema, &RowChange)]) -> Result<(), Refusal>;
    /// Applies an update or delete; returns the rows it matched (None when
    /// nothing needed writing: an update of unchanged TOAST only).
    async fn change_row(
        &mut self,
        relation: &RelationSchema,
        row: &RowChange,
    ) -> Result<Option<u64>, Refusal>;
    async fn quarantine(&mut self, record: &QuarantineRecord<'_>) -> Result<(), TargetError>;
    /// Applies the schema change `ddl` to `relation` (its description
    /// after the change) in the open transaction, ahead of its rows, and
    /// records the sink's acknowledgement and the table's new pin there.
    /// Whether rows of `relation` in the transaction at `commit_lsn` may
    /// apply under the table's pin on this target: it is the pinned
    /// description, the table has no pin here, or the operator accepted
    /// that transaction (the pin then moves to it, in the open
    /// transaction). Rows under a description no event explained (native
    /// capture propagates none) are held.
    async fn keep_pin(
        &mut self,
        _flow: &str,
        _commit_lsn: Lsn,
        _relation: &RelationSchema,
    ) -> Result<(), Refusal> {
        Ok(())
    }
    async fn apply_ddl(&mut self, change: &SchemaChange<'_>) -> Result<(), Refusal> {
        Err(Refusal::Data(format!(
            "{}: this target does not apply schema changes",
            change.statement()
        )))
    }
    /// The tables `flow` copied, by name, each with its own boundary when
    /// it joined after the flow's; `None` when it has no copied tables to
    /// tell apart (a target that keeps no state, a log applied by hand).
    async fn copied_tables(
        &mut self,
        _flow: &str,
    ) -> Result<Option<HashMap<String, Option<Lsn>>>, Refusal> {
        Ok(None)
    }
}

/// A schema change as the sink applies it.
#[derive(Debug, Clone, Copy)]
pub struct SchemaChange<'a> {
    pub flow: &'a str,
    pub commit_lsn: Lsn,
    /// The relation's description after the change.
    pub relation: &'a RelationSchema,
    pub ddl: &'a envelope::DdlEvent,
}

impl SchemaChange<'_> {
    pub fn table(&self) -> String {
        TableName::new(&self.relation.namespace, &self.relation.name).to_string()
    }

    pub fn kind(&self) -> envelope::DdlKind {
        envelope::DdlKind::try_from(self.ddl.kind).unwrap_or(envelope::DdlKind::Unspecified)
    }

    /// `ddl-…@LSN`: the contract's barrier id with the change's commit.
    pub fn barrier_id(&self) -> String {
        let change = trellara_common::ddl::Change {
            kind: self.kind(),
            table: self.table(),
            column: (!self.ddl.column.is_empty()).then(|| self.ddl.column.clone()),
        };
        format!(
            "{}@{}",
            trellara_common::ddl::barrier_id(self.flow, &change),
            self.commit_lsn
        )
    }

    /// What the source's change amounts to, for people (never run).
    pub fn statement(&self) -> &str {
        &self.ddl.statement
    }
}

/// The description of relation `id`, which change `sequence` of `env`
/// names.
fn relation_of(env: &Envelope, id: u32, sequence: u64) -> Result<&RelationSchema, Refusal> {
    env.relations
        .iter()
        .find(|r| r.relation_id == id)
        .ok_or_else(|| {
            Refusal::Data(format!(
                "change {sequence} names relation {id} without its description"
            ))
        })
}

/// Whether every value of a source column (type `source_oid`, modifier
/// `source_mod`) lands unchanged in a target column (`target_oid`,
/// `target_mod`). A target without a modifier takes whatever its type
/// parses; one with a modifier must be the source's, or wider where wider
/// cannot change a value: a longer varchar or bit varying, a numeric with
/// more precision and the same scale, a time type with more fractional
/// digits. Anything else (a shorter length, another scale, a char(n) of
/// another length, a modifier on another type) could cut, pad or round.
pub(crate) fn fits(source_oid: u32, source_mod: i32, target_oid: u32, target_mod: i32) -> bool {
    const VARCHAR: u32 = 1043;
    const VARBIT: u32 = 1562;
    const NUMERIC: u32 = 1700;
    const TIME_TYPES: [u32; 5] = [1083, 1266, 1114, 1184, 1186];
    if target_mod < 0 {
        return true;
    }
    if source_oid != target_oid || source_mod < 0 {
        return false;
    }
    if source_mod == target_mod {
        return true;
    }
    match target_oid {
        VARCHAR | VARBIT => target_mod > source_mod,
        NUMERIC => {
            // typmod = ((precision << 16) | scale) + 4
            let (sp, ss) = ((source_mod - 4) >> 16, (source_mod - 4) & 0xffff);
            let (tp, ts) = ((target_mod - 4) >> 16, (target_mod - 4) & 0xffff);
            ss == ts && tp >= sp
        }
        // interval's modifier also holds its fields: only equal is safe.
        oid if TIME_TYPES.contains(&oid) && oid != 1186 => target_mod > source_mod,
        _ => false,
    }
}

/// A hold of rows no event explained, with why none did on `env`'s path.
fn unexplained_on(env: &Envelope, refusal: Refusal) -> Refusal {
    use trellara_common::envelope::capture::Path;
    let Refusal::Held(mut hold) = refusal else {
        return refusal;
    };
    let native = env
        .capture
        .as_ref()
        .is_some_and(|c| c.path == Path::Native as i32);
    hold.reason.push_str(if native {
        " (native capture propagates no schema change yet)"
    } else {
        " (external capture logs an event for each change it sees: the table's pin on this target is not the description the log had before it, as when a copy pinned a newer one)"
    });
    Refusal::Held(hold)
}

pub(crate) fn missing_table(relation: &RelationSchema) -> String {
    format!(
        "target table {} does not exist",
        TableName::new(&relation.namespace, &relation.name)
    )
}

pub(crate) fn missing_column(relation: &RelationSchema, column: &str) -> String {
    format!(
        "target table {} has no column {column:?} (schema contract breach)",
        TableName::new(&relation.namespace, &relation.name)
    )
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ApplyStats {
    pub transactions: u64,
    pub duplicates_skipped: u64,
    pub rows: u64,
    pub quarantine_resolved: u64,
}

pub struct Applier<T: Target = PgTarget> {
    target: T,
    flow: String,
    source_id: String,
    config_path: String,
    patience: Option<Duration>,
    /// The checkpoint as this applier last committed or read it (`None`:
    /// unknown, read it lock first).
    known_checkpoint: Option<Option<Lsn>>,
    cursor: LazyCursor,
    /// The log cursor it reads with ([`cursor_name`] unless set).
    consumer: String,
    /// The cursor must already exist: a sink's cursor that is missing was
    /// dropped past the log's cap, and starting afresh would skip a gap.
    consumer_known: bool,
    /// Whether the open (or last) target transaction commits durably.
    began_durable: bool,
    /// The next target transaction, opened while its source transaction
    /// was still arriving ([`open_ahead`](Applier::open_ahead)), or with
    /// the last commit ([`with_open_after_commit`](Applier::with_open_after_commit)).
    opened: Option<Opened<T::Lock>>,
    open_after_commit: bool,
    metrics: Option<crate::metrics::FlowMetrics>,
    joined: Joined,
    /// Where a verify holds this applier, as its last checkpoint lock or
    /// look said ([`crate::fence`]): nothing committing at or past it is
    /// applied.
    fence: Option<Lsn>,
    /// The last pass stopped at the fence.
    held: bool,
}

/// Which relations the applier applies: the tables the flow copied (the
/// target's `snapshot_tables`), each from its boundary. A table that joined
/// after the flow's boundary has one of its own: its changes that
/// committed before it are in its copy, and are not applied again. A table
/// with no copy (one that left the flow, or whose join failed) is not
/// applied at all: its target rows would be changes without a base. Read
/// from the target's state when a relation the applier has not found
/// copied appears, so a table that joined while this applier ran (the
/// relay service's round) is known before its first row.
#[derive(Debug, Default)]
struct Joined {
    by_relation: HashMap<u32, Seen>,
    /// Relations already said to be skipped (said once each).
    warned: std::collections::HashSet<u32>,
}

#[derive(Debug, Clone, Copy)]
enum Seen {
    /// Copied; from its own boundary when it joined later.
    Copied(Option<Lsn>),
    /// Not among the flow's copied tables when last looked up.
    NotCopied,
}

/// `BEGIN` and the checkpoint lock already sent, assuming `assumed`: the
/// target wakes and locks while capture decodes and logs the rows.
struct Opened<L> {
    lock: L,
    assumed: Option<Lsn>,
    /// How it commits ([`Target::begin`]).
    durable: bool,
}

/// Where the applier is in its records, ahead of its persisted cursor.
/// The target checkpoint is what exactly-once rests on; the cursor only
/// says where the next run starts reading and what retention may delete.
/// So it is persisted at most every `every` (two fsyncs each on the local
/// log): a crash costs the redelivery of what came after, which the
/// checkpoint skips and counts.
///
/// Between two persists the target commits asynchronously; the commit
/// that makes the cursor due is durable, and so is everything before it
/// (the target flushes in order). A target crash can thus lose only
/// commits the cursor has not passed, which the log delivers again.
#[derive(Debug, Default)]
struct LazyCursor {
    every: Duration,
    /// The last applied record not yet persisted: (offset, commit LSN).
    /// Its target commit was asynchronous (a durable one persists at once).
    unpersisted: Option<(u64, u64)>,
    persisted_at: Option<std::time::Instant>,
}

impl LazyCursor {
    fn due(&self) -> bool {
        self.persisted_at
            .is_none_or(|at| at.elapsed() >= self.every)
    }
}

impl<T: Target> std::fmt::Debug for Applier<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Applier")
            .field("flow", &self.flow)
            .finish_non_exhaustive()
    }
}

/// Source transactions per target transaction, and rows: bounded so a
/// batch's target transaction stays short.
const BATCH_TRANSACTIONS: usize = 500;
const BATCH_ROWS: usize = 20_000;
/// Rows held in one insert run (one statement).
const MAX_RUN_ROWS: usize = 5_000;

/// One source transaction read from the log: its envelope(s) and where it
/// ends in the log.
struct SourceTxn {
    envelopes: Vec<Envelope>,
    last_offset: u64,
    commit_lsn: u64,
    rows: usize,
}

enum Next {
    Txn(SourceTxn),
    /// The first chunk of a chunked transaction: applied chunk by chunk.
    Chunked(Box<Envelope>, crate::log::Record),
    /// (offset, commit LSN, reason, payload) of an envelope that fails to decode.
    Broken((u64, u64, String, Vec<u8>)),
    /// The log ends, or the rest of a chunked transaction is not durable yet.
    End,
    /// The next transaction commits at or past the fence (it is left in
    /// `pending`, not decoded).
    Fenced,
}

/// Rows held back to be written together: a run of inserts into one table
/// (one multi-row INSERT) or the tables of one TRUNCATE (which must go in
/// one statement when foreign keys link them).
#[derive(Default)]
struct Pending<'a> {
    relation: Option<&'a RelationSchema>,
    inserts: Vec<&'a RowChange>,
    truncate: Vec<(&'a RelationSchema, &'a RowChange)>,
}

/// The first chunk of a chunked transaction, decoded and as logged.
struct ChunkedRun {
    first: Envelope,
    first_bytes: Vec<u8>,
}

/// How a chunked transaction ended.
enum Chunked {
    Applied,
    /// Its last chunk is not durable yet.
    Incomplete,
    /// The run was cut by a crash; this record starts what follows.
    Restart(crate::log::Record),
    /// A fence holds it: nothing of it applied.
    Fenced,
}

/// How one try at a batch ended.
enum Attempt {
    /// Committed; the checkpoint is now this.
    Committed(Option<Lsn>),
    /// Rolled back: the checkpoint was not the one assumed.
    Moved,
    /// Rolled back: a fence holds a transaction of the batch (the fence,
    /// the checkpoint).
    Fenced(Lsn, Option<Lsn>),
}

enum ChunkStep {
    /// Every chunk applied; what commits with them.
    Done(Settle),
    Incomplete,
    Restart(crate::log::Record),
    Fenced,
}

/// What one read of the log gives the applier: whole transactions up to a
/// batch's bounds, and why it stopped short of them.
#[derive(Default)]
struct Read {
    txns: Vec<SourceTxn>,
    /// The first chunk of a chunked transaction, applied on its own.
    chunked: Option<(Box<Envelope>, crate::log::Record)>,
    /// (offset, commit LSN, reason, payload) of an envelope that fails to decode.
    broken: Option<(u64, u64, String, Vec<u8>)>,
    /// The log's durable end was reached.
    end: bool,
    /// The next transaction commits at or past the fence.
    fenced: bool,
}

/// Transactions decoded between two yields while a batch is read ahead:
/// each yield lets the batch in flight take its target's answer.
const READ_AHEAD_YIELD: usize = 16;

/// Reads up to a batch of whole transactions. `interleaved`, it yields
/// every [`READ_AHEAD_YIELD`] of them, so the target transaction being
/// written beside it is never kept waiting for the whole read.
async fn read_batch<D: RecordReader>(
    reader: &mut D,
    pending: &mut Option<crate::log::Record>,
    owner: &Owner<'_>,
    interleaved: bool,
    fence: Option<Lsn>,
) -> Result<Read, ApplyError> {
    let mut read = Read::default();
    let mut rows = 0usize;
    while read.txns.len() < BATCH_TRANSACTIONS && rows < BATCH_ROWS {
        match next_transaction(reader, pending, owner, fence)? {
            Next::Txn(txn) => {
                rows += txn.rows;
                read.txns.push(txn);
            }
            Next::Chunked(first, record) => {
                read.chunked = Some((first, record));
                break;
            }
            Next::Broken(b) => {
                read.broken = Some(b);
                break;
            }
            Next::End => {
                // A chunk run may be only partly durable: stop here and
                // reread it from the cursor next time.
                read.end = true;
                break;
            }
            Next::Fenced => {
                read.fenced = true;
                break;
            }
        }
        if interleaved && read.txns.len().is_multiple_of(READ_AHEAD_YIELD) {
            tokio::task::yield_now().await;
        }
    }
    Ok(read)
}

/// Reads the next whole transaction (all its chunks) from `reader`.
/// Chunks of one transaction are consecutive with the same commit LSN and
/// rising chunk index; a run cut short by a crash mid-append (its
/// transaction was appended again whole after it) is skipped.
fn next_transaction<D: RecordReader>(
    reader: &mut D,
    pending: &mut Option<crate::log::Record>,
    owner: &Owner<'_>,
    fence: Option<Lsn>,
) -> Result<Next, ApplyError> {
    let mut envelopes: Vec<Envelope> = Vec::new();
    loop {
        let record = match pending.take() {
            Some(record) => record,
            None => match reader.next_record()? {
                Some(record) => record,
                None => return Ok(Next::End),
            },
        };
        // A transaction's chunks share its commit LSN: one that started
        // below the fence ends below it.
        if envelopes.is_empty() && fence.is_some_and(|f| Lsn(record.commit_lsn) >= f) {
            *pending = Some(record);
            return Ok(Next::Fenced);
        }
        let env = match envelope::decode(&record.payload) {
            Ok(env) => env,
            Err(e) => {
                return Ok(Next::Broken((
                    record.offset,
                    record.commit_lsn,
                    e.to_string(),
                    record.payload,
                )));
            }
        };
        owner.check(&env, record.offset)?;
        let boundary = env.boundary.clone().unwrap_or_default();
        let continues = envelopes.first().is_some_and(|first| {
            first.commit_lsn == env.commit_lsn && boundary.chunk_index as usize == envelopes.len()
        });
        if !continues && !envelopes.is_empty() {
            tracing::warn!(
                commit_lsn = %Lsn(envelopes[0].commit_lsn),
                chunks = envelopes.len(),
                "skipping an incomplete chunk run left by a crash; its transaction follows whole"
            );
            envelopes.clear();
        }
        if envelopes.is_empty() && boundary.chunk_index != 0 {
            // The middle of a run whose start is gone: skip it the same way.
            continue;
        }
        if envelopes.is_empty() && boundary.chunk_count > 1 {
            return Ok(Next::Chunked(Box::new(env), record));
        }
        let done = boundary.chunk_index + 1 >= boundary.chunk_count.max(1);
        envelopes.push(env);
        if done {
            let rows = envelopes.iter().map(|e| e.changes.len()).sum();
            return Ok(Next::Txn(SourceTxn {
                envelopes,
                last_offset: record.offset,
                commit_lsn: record.commit_lsn,
                rows,
            }));
        }
    }
}

/// The fence the target answered, as the applier obeys it.
fn obeyed(fence: Option<Lsn>) -> Option<Lsn> {
    #[cfg(test)]
    if mutation::FENCE_IGNORED.with(std::cell::Cell::get) {
        return None;
    }
    fence
}

/// Whose records an applier applies: every envelope must carry its flow's
/// source id, or it stops before applying any of it.
struct Owner<'a> {
    flow: &'a str,
    source_id: &'a str,
    config_path: &'a str,
}

impl Owner<'_> {
    fn check(&self, env: &Envelope, offset: u64) -> Result<(), ApplyError> {
        let found = env.source.as_ref().map_or("", |s| s.source_id.as_str());
        if found == self.source_id {
            return Ok(());
        }
        Err(ApplyError::Foreign {
            flow: self.flow.to_owned(),
            offset,
            found: found.to_owned(),
            expected: self.source_id.to_owned(),
            config: self.config_path.to_owned(),
        })
    }
}

/// Adds `part` into `total`.
pub fn accumulate(total: &mut ApplyStats, part: ApplyStats) {
    total.transactions += part.transactions;
    total.duplicates_skipped += part.duplicates_skipped;
    total.rows += part.rows;
    total.quarantine_resolved += part.quarantine_resolved;
}

/// The log consumer name of a flow's applier.
pub fn cursor_name(flow: &str) -> String {
    format!("applier-{flow}")
}

/// The log cursor of a flow's sink: the flow's own applier cursor for the
/// sink named after it (a `target:` flow, or the sink that kept the
/// flow's name when it moved to `sinks:`), `sink-<name>` for the others.
/// The log is the flow's, so the sink's name alone tells them apart.
pub fn sink_cursor(flow: &str, sink: &str) -> String {
    if sink == flow {
        cursor_name(flow)
    } else {
        format!("sink-{sink}")
    }
}

/// The log cursor (or Kafka consumer group) of `flow`'s first sink.
pub fn first_cursor(flow: &crate::config::Flow) -> String {
    flow.first_sink().map_or_else(
        || cursor_name(&flow.name),
        |s| sink_cursor(&flow.name, s.name),
    )
}

fn crash(hooks: &dyn CrashHooks, point: CrashPoint) -> Result<(), Refusal> {
    if hooks.crash_at(point) {
        return Err(Refusal::Crashed(point));
    }
    Ok(())
}

/// Test-only switches that break one ordering rule each, for the
/// simulator's mutation checks (the matrix must be able to fail).
#[cfg(test)]
pub(crate) mod mutation {
    use std::cell::Cell;
    thread_local! {
        /// Move the log cursor before the target commit.
        pub(crate) static CURSOR_BEFORE_COMMIT: Cell<bool> = const { Cell::new(false) };
        /// Apply redeliveries as if the checkpoint were absent.
        pub(crate) static IGNORE_CHECKPOINT: Cell<bool> = const { Cell::new(false) };
        /// Persist the cursor past asynchronous target commits as they are.
        pub(crate) static PERSIST_UNDURABLE: Cell<bool> = const { Cell::new(false) };
        /// Apply past a verify's fence as if there were none.
        pub(crate) static FENCE_IGNORED: Cell<bool> = const { Cell::new(false) };
    }
}

impl Applier<PgTarget> {
    pub fn new(client: Client, flow: &str, source_id: &str, config_path: &str) -> Self {
        Applier::with_target(PgTarget::new(client), flow, source_id, config_path)
    }

    pub fn client(&self) -> &Client {
        self.target.client()
    }

    /// Applies every record of `log` past this flow's cursor, several
    /// source transactions per target transaction (never splitting one).
    pub async fn apply_log(&mut self, log: &Log<FsStorage>) -> Result<ApplyStats, ApplyError> {
        self.apply_log_with(log, &NoCrash).await
    }
}

impl<T: Target> Applier<T> {
    pub fn with_target(target: T, flow: &str, source_id: &str, config_path: &str) -> Self {
        Applier {
            target,
            flow: flow.to_owned(),
            source_id: source_id.to_owned(),
            config_path: config_path.to_owned(),
            patience: None,
            known_checkpoint: None,
            cursor: LazyCursor::default(),
            consumer: cursor_name(flow),
            consumer_known: false,
            began_durable: true,
            opened: None,
            open_after_commit: false,
            metrics: None,
            joined: Joined::default(),
            fence: None,
            held: false,
        }
    }

    /// Whether the last pass stopped at a verify's fence: the caller looks
    /// again soon rather than wait for the log.
    pub fn held(&self) -> bool {
        self.held
    }

    /// Opens the next target transaction before its rows are in the log:
    /// sends `BEGIN` and the checkpoint lock without waiting, so the target
    /// backend's wake-up and lock overlap the rest of the source
    /// transaction's capture. Only when the checkpoint is known (the lock's
    /// answer is checked when the rows go); a failure here is left for the
    /// apply to meet again.
    pub async fn open_ahead(&mut self) {
        let Some(assumed) = self.known_checkpoint.filter(|_| self.fence.is_none()) else {
            return;
        };
        if self.opened.is_some() || self.begin().await.is_err() {
            return;
        }
        match self.target.send_lock_checkpoint(&self.flow).await {
            Ok(lock) => {
                self.opened = Some(Opened {
                    lock,
                    assumed,
                    durable: self.began_durable,
                })
            }
            Err(_) => self.target.rollback().await,
        }
    }

    /// Opens the next target transaction with each commit, in the same
    /// round trip: for a flow that expects more transactions soon (a live
    /// source). The transaction waits for its rows; one that stays idle is
    /// rolled back by [`close_opened`](Applier::close_opened).
    pub fn with_open_after_commit(mut self) -> Self {
        self.open_after_commit = true;
        self
    }

    /// Opens a target transaction: a durable one when the cursor is due, so
    /// the cursor can persist after its commit.
    async fn begin(&mut self) -> Result<(), Refusal> {
        self.began_durable = self.cursor.due();
        self.target.begin(self.began_durable).await
    }

    /// Rolls back a transaction opened ahead whose rows did not come.
    pub async fn close_opened(&mut self) {
        if self.opened.take().is_some() {
            self.target.rollback().await;
        }
    }

    /// The lock of the transaction opened ahead, if it assumed `assumed`
    /// (any other is rolled back).
    async fn take_opened(&mut self, assumed: Option<Option<Lsn>>) -> Option<T::Lock> {
        let opened = self.opened.take()?;
        if assumed != Some(opened.assumed) {
            self.target.rollback().await;
            return None;
        }
        self.began_durable = opened.durable;
        Some(opened.lock)
    }

    /// Waits up to `patience` for the rest of a chunk run that is still
    /// being appended, keeping the target transaction open, so a large
    /// transaction is applied while it is written. Without it (the
    /// default) a partly durable run is rolled back and read again later.
    /// Counts what commits (applied, skipped, quarantined, lag) into the
    /// flow's metrics.
    pub fn with_metrics(mut self, metrics: crate::metrics::FlowMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    pub fn with_patience(mut self, patience: Duration) -> Self {
        self.patience = Some(patience);
        self
    }

    /// Persists the log cursor at most every `every` instead of after each
    /// target commit (the default), letting the commits in between be
    /// asynchronous; [`persist_cursor`](Self::persist_cursor) persists what
    /// is left.
    /// Reads with the log cursor `consumer`, registered at the log's
    /// start when missing (the first sink of a flow: [`first_cursor`]).
    pub fn with_cursor_name(mut self, consumer: String) -> Self {
        self.consumer = consumer;
        self
    }

    /// Reads with the log cursor `consumer`, which must exist (one of a
    /// flow's several sinks: [`sink_cursor`]).
    pub fn with_consumer(mut self, consumer: String) -> Self {
        self.consumer = consumer;
        self.consumer_known = true;
        self
    }

    pub fn with_cursor_every(mut self, every: Duration) -> Self {
        self.cursor.every = every;
        self
    }

    /// Persists the log cursor where the last target commit left it, first
    /// making that commit durable if it is not. Call it outside a target
    /// transaction.
    pub async fn persist_cursor<R: Records>(&mut self, log: &R) -> Result<(), ApplyError> {
        let Some((offset, commit_lsn)) = self.cursor.unpersisted else {
            return Ok(());
        };
        #[cfg(test)]
        let skip = mutation::PERSIST_UNDURABLE.with(std::cell::Cell::get);
        #[cfg(not(test))]
        let skip = false;
        if !skip {
            // The durable commit goes outside any transaction.
            self.close_opened().await;
            let durable = match self.target.make_durable(&self.flow).await {
                Ok(durable) => durable,
                Err(Refusal::Transient(e)) => return Err(ApplyError::Target(e)),
                Err(Refusal::Data(reason)) => {
                    return Err(ApplyError::Target(TargetError::Durability(reason)));
                }
                Err(Refusal::Held(hold)) => {
                    return Err(ApplyError::Target(TargetError::Durability(hold.reason)));
                }
                Err(Refusal::Crashed(point)) => return Err(ApplyError::Crashed(point)),
                Err(Refusal::Undurable(e)) => return Err(*e),
            };
            if !durable {
                tracing::warn!(flow = %self.flow, "the flow's checkpoint row is missing on the target: the log cursor stays where it is");
                // Tried again when due, not at every idle tick.
                self.cursor.persisted_at = Some(std::time::Instant::now());
                return Ok(());
            }
        }
        self.cursor.unpersisted = None;
        log.applied(&self.consumer, offset, commit_lsn)?;
        self.cursor.persisted_at = Some(std::time::Instant::now());
        Ok(())
    }

    /// Whether the cursor is due to persist: an idle flow persists it then,
    /// so it catches up within `every`.
    pub fn cursor_due(&self) -> bool {
        self.cursor.due()
    }

    /// After a target commit through `offset`: the cursor moves past it, on
    /// disk too when that commit was the durable one of a due cursor.
    fn moved_past<R: Records>(
        &mut self,
        log: &R,
        offset: u64,
        commit_lsn: u64,
    ) -> Result<(), ApplyError> {
        if self.began_durable {
            self.cursor.unpersisted = None;
            log.applied(&self.consumer, offset, commit_lsn)?;
            self.cursor.persisted_at = Some(std::time::Instant::now());
        } else {
            self.cursor.unpersisted = Some((offset, commit_lsn));
        }
        Ok(())
    }

    pub fn target(&self) -> &T {
        &self.target
    }

    /// The simulator inspects its target between rounds.
    pub(crate) fn target_mut(&mut self) -> &mut T {
        &mut self.target
    }

    pub fn into_target(self) -> T {
        self.target
    }

    /// [`apply_log`](Applier::apply_log) over any storage, stopping at the
    /// crash points `hooks` names (the simulator's; production passes
    /// [`NoCrash`]).
    pub async fn apply_log_with<R: Records>(
        &mut self,
        log: &R,
        hooks: &dyn CrashHooks,
    ) -> Result<ApplyStats, ApplyError> {
        let name = self.consumer.clone();
        // Ahead of the persisted cursor, the applier goes on from where it
        // is; otherwise the cursor says (it may have been moved).
        let start = match self.cursor.unpersisted {
            Some((offset, _)) => offset + 1,
            None if self.consumer_known => log.resume(&name)?,
            None => log.start(&name)?,
        };
        let mut stats = ApplyStats::default();
        let mut reader = log.read_from(start)?;
        let mut pending = None;
        // Owned, so the next batch is read while this applier writes one.
        let (flow, source_id, config_path) = (
            self.flow.clone(),
            self.source_id.clone(),
            self.config_path.clone(),
        );
        let owner = Owner {
            flow: &flow,
            source_id: &source_id,
            config_path: &config_path,
        };
        let mut ahead = None;
        self.held = false;
        loop {
            let read = match ahead.take() {
                Some(read) => read,
                None => read_batch(&mut reader, &mut pending, &owner, false, self.fence).await?,
            };
            let Read {
                txns: batch,
                chunked,
                broken,
                end,
                fenced,
            } = read;
            if !batch.is_empty() {
                let fence = self.fence;
                let applied = self.apply_batch(log, &batch, &mut stats, hooks);
                let more = chunked.is_none() && broken.is_none() && !end && !fenced;
                let held = if log.reads_ahead() && more {
                    // A full batch: more is there. Decoding it meanwhile
                    // takes the time the target spends on this one (PG 15,
                    // 500 single-row transactions: 1.3 ms of decoding,
                    // 1.0 ms of COPY, one after the other before).
                    let (applied, next) = tokio::join!(
                        applied,
                        read_batch(&mut reader, &mut pending, &owner, true, fence)
                    );
                    let held = applied?;
                    ahead = Some(next?);
                    held
                } else {
                    applied.await?
                };
                if held {
                    // The lock showed a fence inside the batch: what the
                    // batch held past the applied part is read again.
                    return self.hold(stats).await;
                }
            }
            if let Some((first, record)) = chunked {
                let chunked = ChunkedRun {
                    first: *first,
                    first_bytes: record.payload,
                };
                match self
                    .apply_chunked(log, &mut reader, chunked, &mut stats, hooks)
                    .await?
                {
                    Chunked::Applied => {}
                    Chunked::Incomplete => return Ok(stats),
                    Chunked::Fenced => return self.hold(stats).await,
                    Chunked::Restart(next) => pending = Some(next),
                }
                continue;
            }
            if let Some((offset, commit_lsn, reason, payload)) = broken {
                let reason = format!("envelope at log offset {offset} is invalid: {reason}");
                // Nothing at the target fixes it, and every rerun reads the
                // same bytes: the transaction must come from the source again.
                let recovery = format!(
                    "the log's copy of this transaction is damaged and every rerun meets it again: check the flow's log with `trellara log inspect --dir <transport.log_dir> --verify`, then take a new snapshot and stream with `trellara reseed --config {} --flow {}`",
                    self.config_path, self.flow
                );
                return Err(self
                    .quarantine_with(Lsn(commit_lsn), 0, reason, &payload, recovery, None)
                    .await?);
            }
            if fenced {
                // Still there, or released or moved meanwhile?
                self.close_opened().await;
                let now = obeyed(self.target.fence(&self.flow).await?);
                if now == self.fence {
                    self.held = true;
                    return Ok(stats);
                }
                self.fence = now;
                continue;
            }
            if batch.is_empty() || end {
                return Ok(stats);
            }
        }
    }

    /// Stops this pass at the fence its checkpoint lock showed. Nothing is
    /// left open: the verify that holds it moves it with an update of the
    /// checkpoint row, which an open transaction's lock would keep waiting.
    async fn hold(&mut self, stats: ApplyStats) -> Result<ApplyStats, ApplyError> {
        self.close_opened().await;
        self.held = true;
        Ok(stats)
    }

    /// One target transaction for the whole batch; if it is refused, each
    /// transaction alone, so the one that cannot apply is the one
    /// quarantined and every one before it lands.
    /// True when it stopped at a fence the checkpoint lock showed inside
    /// the batch: the transactions below it are applied, the rest not.
    async fn apply_batch<R: Records>(
        &mut self,
        log: &R,
        batch: &[SourceTxn],
        stats: &mut ApplyStats,
        hooks: &dyn CrashHooks,
    ) -> Result<bool, ApplyError> {
        let mut tentative = ApplyStats::default();
        let single = batch.len() == 1;
        #[cfg(test)]
        if mutation::CURSOR_BEFORE_COMMIT.with(std::cell::Cell::get)
            && let Some(last) = batch.last()
        {
            log.applied(&self.consumer, last.last_offset, last.commit_lsn)?;
        }
        match self
            .apply_transactions(log, batch, &mut tentative, hooks)
            .await
        {
            Ok(Some(fence)) => {
                // Rolled back: the part below the fence goes alone.
                let below = batch.partition_point(|t| Lsn(t.commit_lsn) < fence);
                if below > 0 {
                    Box::pin(self.apply_batch(log, &batch[..below], stats, hooks)).await?;
                }
                return Ok(true);
            }
            Ok(None) => {
                accumulate(stats, tentative);
                if hooks.crash_at(CrashPoint::CommittedCursorNotMoved) {
                    return Err(ApplyError::Crashed(CrashPoint::CommittedCursorNotMoved));
                }
                if let Some(last) = batch.last() {
                    self.moved_past(log, last.last_offset, last.commit_lsn)?;
                }
                return Ok(false);
            }
            Err(Refusal::Transient(e)) => return Err(ApplyError::Target(e)),
            Err(Refusal::Crashed(point)) => return Err(ApplyError::Crashed(point)),
            Err(Refusal::Undurable(e)) => return Err(*e),
            Err(Refusal::Data(reason)) if single => {
                let txn = &batch[0];
                let bytes = txn
                    .envelopes
                    .first()
                    .and_then(|e| envelope::encode(e).ok())
                    .unwrap_or_default();
                let xid = txn.envelopes.first().map_or(0, |e| e.xid);
                return Err(self
                    .quarantine(Lsn(txn.commit_lsn), xid, reason, &bytes)
                    .await?);
            }
            Err(Refusal::Held(hold)) if single => {
                let txn = &batch[0];
                let bytes = txn
                    .envelopes
                    .first()
                    .and_then(|e| envelope::encode(e).ok())
                    .unwrap_or_default();
                let xid = txn.envelopes.first().map_or(0, |e| e.xid);
                return Err(self
                    .quarantine_held(Lsn(txn.commit_lsn), xid, *hold, &bytes)
                    .await?);
            }
            Err(Refusal::Data(_) | Refusal::Held(_)) => {}
        }
        for txn in batch {
            if Box::pin(self.apply_batch(log, std::slice::from_ref(txn), stats, hooks)).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// What one committed target transaction adds to the metrics.
    fn count(&self, settle: &Settle) {
        if let Some(m) = &self.metrics {
            m.applied.inc_by(settle.applied);
            m.duplicates.inc_by(settle.skipped);
            for &micros in &settle.commit_micros {
                m.observe_commit(micros);
            }
        }
    }

    async fn quarantine(
        &mut self,
        commit_lsn: Lsn,
        xid: u64,
        reason: String,
        envelope: &[u8],
    ) -> Result<ApplyError, ApplyError> {
        let recovery = format!(
            "fix the cause named above at the target (or the config), then rerun `trellara run --config {} --flow {}`: the quarantined transaction is retried first; `trellara verify --config {} --flow {}` afterwards",
            self.config_path, self.flow, self.config_path, self.flow
        );
        self.quarantine_with(commit_lsn, xid, reason, envelope, recovery, None)
            .await
    }

    /// Quarantines a transaction held at a schema change: its record names
    /// the table and the description `schema accept` checks.
    async fn quarantine_held(
        &mut self,
        commit_lsn: Lsn,
        xid: u64,
        hold: Hold,
        envelope: &[u8],
    ) -> Result<ApplyError, ApplyError> {
        let (config, flow, table) = (&self.config_path, &self.flow, &hold.table);
        let recovery = format!(
            "apply the change on the target yourself, then `trellara schema accept --config {config} --flow {flow} --table {table}`: this sink goes on from the held transaction (a following one by itself, within seconds); or, the target's table made to take the source's columns, copy that table again while the flow follows: `trellara reseed --config {config} --flow {flow} --table {table}`; or copy every table again: `trellara reseed --config {config} --flow {flow}`"
        );
        let reason = format!(
            "schema change on {table} held: {}; no sink applies it on its own",
            hold.reason
        );
        self.quarantine_with(
            commit_lsn,
            xid,
            reason,
            envelope,
            recovery,
            Some((&hold.table, &hold.schema)),
        )
        .await
    }

    /// [`quarantine`](Self::quarantine) with its own recovery.
    async fn quarantine_with(
        &mut self,
        commit_lsn: Lsn,
        xid: u64,
        reason: String,
        envelope: &[u8],
        recovery: String,
        held: Option<(&str, &[u8])>,
    ) -> Result<ApplyError, ApplyError> {
        // The record is written outside any data transaction.
        self.close_opened().await;
        self.target
            .quarantine(&QuarantineRecord {
                flow: &self.flow,
                commit_lsn,
                xid,
                reason: &reason,
                recovery: &recovery,
                envelope,
                held,
            })
            .await?;
        tracing::error!(flow = %self.flow, commit_lsn = %commit_lsn, xid, reason = %reason, "transaction quarantined");
        if let Some(m) = &self.metrics {
            m.quarantined.inc();
        }
        Ok(ApplyError::Quarantined {
            flow: self.flow.clone(),
            xid,
            commit_lsn,
            reason,
            recovery,
            held: held.map(|(table, _)| table.to_owned()),
        })
    }

    /// One target transaction for the whole batch. When this applier knows
    /// the checkpoint (it committed or read it last in this session), the
    /// rows go out behind the checkpoint lock without waiting for its
    /// answer: one round trip before a small transaction's rows land
    /// instead of two. If the answer differs (another writer moved it), the
    /// transaction is rolled back, whatever its statements met, and
    /// applied again lock first.
    async fn apply_transactions<R: Records>(
        &mut self,
        log: &R,
        batch: &[SourceTxn],
        stats: &mut ApplyStats,
        hooks: &dyn CrashHooks,
    ) -> Result<Option<Lsn>, Refusal> {
        let mut assumed = self.known_checkpoint.take();
        loop {
            match self.apply_once(log, batch, stats, hooks, assumed).await? {
                Attempt::Committed(checkpoint) => {
                    self.known_checkpoint = Some(checkpoint);
                    return Ok(None);
                }
                Attempt::Fenced(fence, checkpoint) => {
                    self.known_checkpoint = Some(checkpoint);
                    *stats = ApplyStats::default();
                    return Ok(Some(fence));
                }
                Attempt::Moved => {
                    tracing::info!(flow = %self.flow, "the checkpoint moved behind this applier: applying again lock first");
                    *stats = ApplyStats::default();
                    assumed = None;
                }
            }
        }
    }

    /// [`apply_transactions`](Self::apply_transactions) once, assuming the
    /// checkpoint is `assumed` if given.
    async fn apply_once<R: Records>(
        &mut self,
        log: &R,
        batch: &[SourceTxn],
        stats: &mut ApplyStats,
        hooks: &dyn CrashHooks,
        assumed: Option<Option<Lsn>>,
    ) -> Result<Attempt, Refusal> {
        let lock = match self.take_opened(assumed).await {
            Some(lock) => Ok(lock),
            None => {
                self.begin().await?;
                self.target.send_lock_checkpoint(&self.flow).await
            }
        };
        // The batch is in commit order: its last is the one a fence holds
        // first.
        let last_commit = batch.last().map(|t| Lsn(t.commit_lsn));
        let fenced = move |locked: &Locked| {
            obeyed(locked.fence)
                .filter(|f| last_commit.is_some_and(|c| c >= *f))
                .map(|f| Attempt::Fenced(f, locked.checkpoint))
        };
        let result = async {
            let lock = lock?;
            let (checkpoint, settle) = match assumed {
                Some(assumed) => {
                    let (locked, settle) =
                        tokio::join!(biased; lock, self.write_rows(batch, assumed, stats));
                    // The lock answered first: its error, or a checkpoint
                    // moved by another writer, explains whatever the rows
                    // behind it met.
                    let locked = locked?;
                    self.fence = obeyed(locked.fence);
                    if locked.checkpoint != assumed {
                        return Ok(Err(Attempt::Moved));
                    }
                    if let Some(fenced) = fenced(&locked) {
                        return Ok(Err(fenced));
                    }
                    (assumed, settle)
                }
                None => {
                    let locked = lock.await?;
                    self.fence = obeyed(locked.fence);
                    if let Some(fenced) = fenced(&locked) {
                        return Ok(Err(fenced));
                    }
                    let checkpoint = locked.checkpoint;
                    (checkpoint, self.write_rows(batch, checkpoint, stats).await)
                }
            };
            let settle = settle?;
            crash(hooks, CrashPoint::AppliedNotCommitted)?;
            // The rows went out while the batch's fsync ran; nothing of it
            // commits before the log holds it durably.
            if let Some(last) = batch.last() {
                log.durable(last.last_offset)
                    .await
                    .map_err(|e| Refusal::Undurable(Box::new(e.into())))?;
            }
            Ok(Ok((checkpoint, settle)))
        }
        .await;
        match result {
            Ok(Ok((checkpoint, settle))) => {
                // A durable commit persists the cursor: the next one need
                // not be durable unless the cursor is due again by then.
                // Under a fence nothing is held open: the verify moves it
                // with an update of the row an open transaction locks.
                let next = (self.open_after_commit && self.fence.is_none()).then(|| {
                    self.cursor.every.is_zero() || (!self.began_durable && self.cursor.due())
                });
                let committed = match next {
                    None => self
                        .target
                        .settle_and_commit(&self.flow, &self.source_id, &settle)
                        .await
                        .map(|resolved| (resolved, None)),
                    Some(durable) => self
                        .target
                        .commit_and_open(&self.flow, &self.source_id, &settle, durable)
                        .await
                        .map(|(resolved, lock)| (resolved, lock.map(|lock| (lock, durable)))),
                };
                match committed {
                    Ok((resolved, opened)) => {
                        stats.quarantine_resolved += resolved;
                        stats.transactions += settle.applied;
                        self.count(&settle);
                        let checkpoint = settle.last.map(|l| l.commit_lsn).or(checkpoint);
                        self.opened = opened.map(|(lock, durable)| Opened {
                            lock,
                            assumed: checkpoint,
                            durable,
                        });
                        Ok(Attempt::Committed(checkpoint))
                    }
                    Err(refusal) => {
                        self.target.rollback().await;
                        Err(refusal)
                    }
                }
            }
            Ok(Err(attempt)) => {
                self.target.rollback().await;
                Ok(attempt)
            }
            Err(Refusal::Crashed(point)) => Err(Refusal::Crashed(point)),
            Err(refusal) => {
                self.target.rollback().await;
                Err(refusal)
            }
        }
    }

    /// Sends the rows of every transaction above `checkpoint`; returns what
    /// commits with them.
    async fn write_rows(
        &mut self,
        batch: &[SourceTxn],
        checkpoint: Option<Lsn>,
        stats: &mut ApplyStats,
    ) -> Result<Settle, Refusal> {
        #[cfg(test)]
        let checkpoint =
            checkpoint.filter(|_| !mutation::IGNORE_CHECKPOINT.with(std::cell::Cell::get));
        let mut applied: Vec<&SourceTxn> = Vec::new();
        let mut settled = Vec::new();
        let mut pending = Pending::default();
        // The checkpoint as this batch moves it: a redelivered copy in the
        // same batch (Kafka's at-least-once tail) is a duplicate too.
        let mut high = checkpoint;
        for txn in batch {
            settled.push(Lsn(txn.commit_lsn));
            if high.is_some_and(|c| c >= Lsn(txn.commit_lsn)) {
                stats.duplicates_skipped += 1;
                continue;
            }
            for env in &txn.envelopes {
                self.apply_envelope(env, stats, &mut pending).await?;
            }
            high = Some(Lsn(txn.commit_lsn));
            applied.push(txn);
        }
        self.flush(&mut pending).await?;
        let skipped = (batch.len() - applied.len()) as u64;
        let commit_micros = applied
            .iter()
            .map(|t| t.envelopes.first().map_or(0, |e| e.commit_time_micros))
            .collect();
        let last = applied.last().map(|t| Checkpoint {
            commit_lsn: Lsn(t.commit_lsn),
            end_lsn: Lsn(t.envelopes.last().map_or(t.commit_lsn, |e| e.end_lsn)),
            xid: t.envelopes.first().map_or(0, |e| e.xid),
        });
        Ok(Settle {
            last,
            applied: applied.len() as u64,
            duplicates: stats.duplicates_skipped,
            settled,
            commit_micros,
            skipped,
        })
    }

    /// A chunked transaction, one chunk in memory at a time, in one target
    /// transaction: applied, incomplete (its last chunk is not durable yet;
    /// nothing applied, cursor unchanged), or restarted (the run was cut by
    /// a crash and a new transaction starts at the returned record).
    async fn apply_chunked<R: Records>(
        &mut self,
        log: &R,
        reader: &mut R::Reader<'_>,
        run: ChunkedRun,
        stats: &mut ApplyStats,
        hooks: &dyn CrashHooks,
    ) -> Result<Chunked, ApplyError> {
        let ChunkedRun { first, first_bytes } = run;
        // Large transactions lock first; the next batch does too.
        self.close_opened().await;
        self.known_checkpoint = None;
        let commit = first.commit_lsn;
        let xid = first.xid;
        let mut tentative = ApplyStats::default();
        let began = self.begin().await;
        let mut current = first;
        let outcome = async {
            began?;
            let locked = self.target.lock_checkpoint(&self.flow).await?;
            self.fence = obeyed(locked.fence);
            if self.fence.is_some_and(|f| Lsn(commit) >= f) {
                return Ok(ChunkStep::Fenced);
            }
            let checkpoint = locked.checkpoint;
            #[cfg(test)]
            let checkpoint =
                checkpoint.filter(|_| !mutation::IGNORE_CHECKPOINT.with(std::cell::Cell::get));
            let duplicate = checkpoint.is_some_and(|c| c >= Lsn(commit));
            loop {
                let boundary = current.boundary.clone().unwrap_or_default();
                if !duplicate {
                    let mut pending = Pending::default();
                    self.apply_envelope(&current, &mut tentative, &mut pending)
                        .await?;
                    self.flush(&mut pending).await?;
                }
                // Applied: a chunk holding a wide value is not kept while
                // the next one is read.
                current.changes = Vec::new();
                if boundary.chunk_index + 1 >= boundary.chunk_count {
                    let mut settle = Settle {
                        settled: vec![Lsn(commit)],
                        ..Settle::default()
                    };
                    if duplicate {
                        tentative.duplicates_skipped += 1;
                        settle.duplicates = tentative.duplicates_skipped;
                        settle.skipped = 1;
                    } else {
                        settle.commit_micros = vec![current.commit_time_micros];
                        settle.last = Some(Checkpoint {
                            commit_lsn: Lsn(commit),
                            end_lsn: Lsn(current.end_lsn),
                            xid,
                        });
                        settle.applied = 1;
                        tentative.transactions += 1;
                    }
                    #[cfg(test)]
                    if mutation::CURSOR_BEFORE_COMMIT.with(std::cell::Cell::get) {
                        let last = reader.next_offset().saturating_sub(1);
                        log.applied(&self.consumer, last, commit)
                            .map_err(|e| Refusal::Data(e.to_string()))?;
                    }
                    crash(hooks, CrashPoint::AppliedNotCommitted)?;
                    log.durable(reader.next_offset().saturating_sub(1))
                        .await
                        .map_err(|e| Refusal::Undurable(Box::new(e.into())))?;
                    return Ok(ChunkStep::Done(settle));
                }
                let mut next = reader
                    .next_record()
                    .map_err(|e| Refusal::Undurable(Box::new(e.into())))?;
                // The rest of the run may still be on its way: with
                // patience, wait for it with the target transaction open
                // instead of rolling back and starting over.
                while next.is_none()
                    && let Some(patience) = self.patience
                    && log.wait_for_more(reader.next_offset(), patience).await
                {
                    next = reader
                        .next_record()
                        .map_err(|e| Refusal::Undurable(Box::new(e.into())))?;
                }
                let Some(record) = next else {
                    return Ok(ChunkStep::Incomplete);
                };
                let next = match envelope::decode(&record.payload) {
                    Ok(env) => env,
                    Err(_) => return Ok(ChunkStep::Restart(record)),
                };
                let b = next.boundary.clone().unwrap_or_default();
                if next.commit_lsn != commit || b.chunk_index != boundary.chunk_index + 1 {
                    return Ok(ChunkStep::Restart(record));
                }
                drop(record);
                current = next;
            }
        }
        .await;
        let refusal = match outcome {
            Ok(ChunkStep::Done(settle)) => {
                // The run's last chunk is the record just read.
                let last = reader.next_offset().saturating_sub(1);
                match self
                    .target
                    .settle_and_commit(&self.flow, &self.source_id, &settle)
                    .await
                {
                    Ok(resolved) => {
                        tentative.quarantine_resolved += resolved;
                        accumulate(stats, tentative);
                        self.count(&settle);
                        if hooks.crash_at(CrashPoint::CommittedCursorNotMoved) {
                            return Err(ApplyError::Crashed(CrashPoint::CommittedCursorNotMoved));
                        }
                        self.moved_past(log, last, commit)?;
                        return Ok(Chunked::Applied);
                    }
                    Err(refusal) => refusal,
                }
            }
            Ok(ChunkStep::Incomplete) => {
                self.target.rollback().await;
                return Ok(Chunked::Incomplete);
            }
            Ok(ChunkStep::Fenced) => {
                self.target.rollback().await;
                return Ok(Chunked::Fenced);
            }
            Ok(ChunkStep::Restart(record)) => {
                self.target.rollback().await;
                tracing::warn!(commit_lsn = %Lsn(commit), "skipping an incomplete chunk run left by a crash; its transaction follows whole");
                return Ok(Chunked::Restart(record));
            }
            Err(refusal) => refusal,
        };
        match refusal {
            Refusal::Crashed(point) => Err(ApplyError::Crashed(point)),
            Refusal::Undurable(e) => {
                self.target.rollback().await;
                Err(*e)
            }
            Refusal::Transient(e) => {
                self.target.rollback().await;
                Err(ApplyError::Target(e))
            }
            Refusal::Data(reason) => {
                self.target.rollback().await;
                Err(self
                    .quarantine(Lsn(commit), xid, reason, &first_bytes)
                    .await?)
            }
            Refusal::Held(hold) => {
                self.target.rollback().await;
                Err(self
                    .quarantine_held(Lsn(commit), xid, *hold, &first_bytes)
                    .await?)
            }
        }
    }

    /// Applies one envelope's rows. Runs of inserts into one table - across
    /// envelopes and source transactions of the same target transaction -
    /// are held in `pending` and go as multi-row INSERTs; the caller
    /// [`flush`](Self::flush)es before it commits or drops the envelopes.
    async fn apply_envelope<'a>(
        &mut self,
        env: &'a Envelope,
        stats: &mut ApplyStats,
        pending: &mut Pending<'a>,
    ) -> Result<(), Refusal> {
        let copied = self.in_joined_copy(env).await?;
        let mut pinned: Vec<u32> = Vec::new();
        for ch in &env.changes {
            let row = match &ch.body {
                Some(change::Body::Row(row)) => row,
                Some(change::Body::Ddl(ddl)) if !copied.contains(&ddl.relation_id) => {
                    let relation = relation_of(env, ddl.relation_id, ch.sequence)?;
                    // Whatever the table held before goes first, under the
                    // old schema.
                    self.flush(pending).await?;
                    self.target
                        .apply_ddl(&SchemaChange {
                            flow: &self.flow,
                            commit_lsn: Lsn(env.commit_lsn),
                            relation,
                            ddl,
                        })
                        .await?;
                    continue;
                }
                _ => continue,
            };
            if copied.contains(&row.relation_id) {
                continue;
            }
            let relation = relation_of(env, row.relation_id, ch.sequence)?;
            if !pinned.contains(&row.relation_id) {
                pinned.push(row.relation_id);
                self.target
                    .keep_pin(&self.flow, Lsn(env.commit_lsn), relation)
                    .await
                    .map_err(|refusal| unexplained_on(env, refusal))?;
            }
            stats.rows += 1;
            if row.operation == Operation::Truncate as i32 {
                self.flush_inserts(pending).await?;
                // Truncates go together (foreign keys may link their
                // tables), but only with the same RESTART IDENTITY: one
                // statement's would reset the others' sequences.
                if pending.truncate.first().is_some_and(|(_, r)| {
                    r.truncate_restart_identity != row.truncate_restart_identity
                }) {
                    let rows = std::mem::take(&mut pending.truncate);
                    self.target.truncate(&rows).await?;
                }
                pending.truncate.push((relation, row));
                continue;
            }
            if !pending.truncate.is_empty() {
                let rows = std::mem::take(&mut pending.truncate);
                self.target.truncate(&rows).await?;
            }
            let insert = row.operation == Operation::Insert as i32;
            let same_run = pending.relation.is_some_and(|r| {
                r.relation_id == relation.relation_id && r.fingerprint == relation.fingerprint
            });
            if !insert || !same_run || pending.inserts.len() >= MAX_RUN_ROWS {
                self.flush_inserts(pending).await?;
            }
            if insert {
                pending.relation = Some(relation);
                pending.inserts.push(row);
            } else {
                self.change_row(relation, row).await?;
            }
        }
        Ok(())
    }

    /// The relations of `env` whose changes are not applied: those of a
    /// table the flow has no copy of, and those already in the copy of a
    /// table that joined the flow (committed before its own boundary: the
    /// snapshot holds what committed before its consistent point; one
    /// committing exactly at it is streamed).
    async fn in_joined_copy(&mut self, env: &Envelope) -> Result<Vec<u32>, Refusal> {
        let unsure = env.relations.iter().any(|r| {
            !matches!(
                self.joined.by_relation.get(&r.relation_id),
                Some(Seen::Copied(_))
            )
        });
        if unsure {
            let copied = self.target.copied_tables(&self.flow).await?;
            for r in &env.relations {
                let name = TableName::new(&r.namespace, &r.name).to_string();
                let seen = match &copied {
                    // A target that keeps no state (the simulator's).
                    None => Seen::Copied(None),
                    Some(copied) => copied
                        .get(&name)
                        .map_or(Seen::NotCopied, |b| Seen::Copied(*b)),
                };
                if matches!(seen, Seen::NotCopied) && self.joined.warned.insert(r.relation_id) {
                    tracing::warn!(flow = %self.flow, table = %name, "changes of this table are not applied: the flow has no copy of it (it left the flow, or its join did not finish)");
                }
                self.joined.by_relation.insert(r.relation_id, seen);
            }
        }
        Ok(env
            .relations
            .iter()
            .filter(|r| match self.joined.by_relation.get(&r.relation_id) {
                Some(Seen::NotCopied) => true,
                Some(Seen::Copied(Some(boundary))) => env.commit_lsn < boundary.0,
                _ => false,
            })
            .map(|r| r.relation_id)
            .collect())
    }

    async fn flush_inserts(&mut self, pending: &mut Pending<'_>) -> Result<(), Refusal> {
        if let Some(relation) = pending.relation.take()
            && !pending.inserts.is_empty()
        {
            let rows = std::mem::take(&mut pending.inserts);
            self.target.insert_rows(relation, &rows).await?;
        }
        pending.inserts.clear();
        Ok(())
    }

    /// Writes everything `pending` holds, in order.
    async fn flush(&mut self, pending: &mut Pending<'_>) -> Result<(), Refusal> {
        self.flush_inserts(pending).await?;
        if !pending.truncate.is_empty() {
            let rows = std::mem::take(&mut pending.truncate);
            self.target.truncate(&rows).await?;
        }
        Ok(())
    }

    /// An update or delete must match exactly one row: anything else means
    /// the target diverged, and applying on would hide it.
    async fn change_row(
        &mut self,
        relation: &RelationSchema,
        row: &RowChange,
    ) -> Result<(), Refusal> {
        let op = match Operation::try_from(row.operation) {
            Ok(Operation::Update) => "update",
            Ok(Operation::Delete) => "delete",
            _ => {
                return Err(Refusal::Data(format!(
                    "change of {} has operation {}, which is neither update nor delete (a newer capture than this applier?)",
                    TableName::new(&relation.namespace, &relation.name),
                    row.operation
                )));
            }
        };
        match self.target.change_row(relation, row).await? {
            None | Some(1) => Ok(()),
            Some(n) => Err(Refusal::Data(format!(
                "{op} on {} matched {n} rows, expected 1: the target has diverged from the source (no silent divergence)\nhint: run `trellara verify --config {} --flow {}` to name the diverging key range",
                TableName::new(&relation.namespace, &relation.name),
                self.config_path,
                self.flow
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::LogConfig;
    use trellara_common::sample;

    fn chunk(commit: u64, index: u32, count: u32) -> Vec<u8> {
        envelope::encode(&sample::chunk(commit, index, count)).expect("valid chunk")
    }

    #[test]
    fn a_column_fits_only_when_no_value_can_change() {
        let numeric = |p: i32, s: i32| ((p << 16) | s) + 4;
        // varchar(10) -> varchar(3) cuts; -> varchar(20) or varchar does not.
        assert!(!fits(1043, 14, 1043, 7));
        assert!(fits(1043, 14, 1043, 24) && fits(1043, 14, 1043, -1));
        // text -> varchar(3): another type under a length.
        assert!(!fits(25, -1, 1043, 7));
        // numeric(12,2) -> numeric(10,1) rounds; -> numeric(14,2) does not;
        // unconstrained numeric -> numeric(12,2) may round.
        assert!(!fits(1700, numeric(12, 2), 1700, numeric(10, 1)));
        assert!(fits(1700, numeric(12, 2), 1700, numeric(14, 2)));
        assert!(!fits(1700, numeric(12, 2), 1700, numeric(14, 3)));
        assert!(!fits(1700, -1, 1700, numeric(12, 2)));
        // timestamp(6) -> timestamp(0) rounds; char(5) -> char(3) cuts,
        // -> char(8) pads; bit(3) -> bit(2).
        assert!(!fits(1114, 6, 1114, 0) && fits(1114, 3, 1114, 6));
        assert!(!fits(1042, 9, 1042, 7) && !fits(1042, 9, 1042, 12));
        assert!(!fits(1560, 3, 1560, 2));
        assert!(fits(23, -1, 23, -1) && fits(1042, 9, 1042, 9));
    }

    /// The samples' source.
    const OWNER: Owner<'static> = Owner {
        flow: "sales",
        source_id: "orders-primary",
        config_path: "trellara.yml",
    };

    #[test]
    fn a_record_of_another_source_is_refused_before_it_is_applied() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("open");
        let mut foreign = sample::chunk(0x5000_0000, 0, 1);
        if let Some(source) = foreign.source.as_mut() {
            source.source_id = "another-primary".into();
        }
        log.append(0x4000_0000, &chunk(0x4000_0000, 0, 1))
            .expect("append");
        log.append(0x5000_0000, &envelope::encode(&foreign).expect("valid"))
            .expect("append");
        let mut reader = log.read_from(0).expect("reader");
        let mut pending = None;
        assert!(matches!(
            next_transaction(&mut reader, &mut pending, &OWNER, None).expect("read"),
            Next::Txn(_)
        ));
        let err = next_transaction(&mut reader, &mut pending, &OWNER, None)
            .err()
            .expect("another source's record");
        assert!(
            matches!(&err, ApplyError::Foreign { offset: 1, found, .. } if found == "another-primary"),
            "{err}"
        );
    }

    #[test]
    fn chunked_transactions_are_handed_over_at_their_first_chunk() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("open");
        let x = 0x5000_0000;
        let y = 0x6000_0000;
        // The crash left X's first two chunks; then X was appended whole,
        // then Y. A middle-of-run chunk with no start is skipped too.
        for (lsn, bytes) in [
            (x, chunk(x, 0, 3)),
            (x, chunk(x, 1, 3)),
            (x, chunk(x, 0, 3)),
            (x, chunk(x, 1, 3)),
            (x, chunk(x, 2, 3)),
            (y, chunk(y, 0, 1)),
        ] {
            log.append(lsn, &bytes).expect("append");
        }
        let mut reader = log.read_from(0).expect("reader");
        let mut pending = None;
        // A chunked transaction is handed over at its first chunk, to be
        // applied one chunk at a time (apply_chunked restarts on a cut run).
        let Next::Chunked(first, record) =
            next_transaction(&mut reader, &mut pending, &OWNER, None).expect("read")
        else {
            panic!("X starts chunked")
        };
        assert_eq!((first.commit_lsn, record.offset), (x, 0));
        // A middle-of-run chunk without its start is skipped.
        let mut reader = log.read_from(1).expect("reader");
        let Next::Chunked(_, record) =
            next_transaction(&mut reader, &mut pending, &OWNER, None).expect("read")
        else {
            panic!("the whole X")
        };
        assert_eq!(
            record.offset, 2,
            "offset 1 (chunk 1 without chunk 0) skipped"
        );
        let mut reader = log.read_from(5).expect("reader");
        let Next::Txn(second) =
            next_transaction(&mut reader, &mut pending, &OWNER, None).expect("read")
        else {
            panic!("Y")
        };
        assert_eq!((second.commit_lsn, second.envelopes.len()), (y, 1));
        assert!(matches!(
            next_transaction(&mut reader, &mut pending, &OWNER, None).expect("read"),
            Next::End
        ));

        // A run's first chunk at the tail is handed over too; apply_chunked
        // finds the rest missing and leaves it for later.
        log.append(0x7000_0000, &chunk(0x7000_0000, 0, 2))
            .expect("append");
        let mut reader = log.read_from(6).expect("reader");
        assert!(matches!(
            next_transaction(&mut reader, &mut pending, &OWNER, None).expect("read"),
            Next::Chunked(..)
        ));
    }
}
