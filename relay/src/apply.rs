//! The Postgres applier: envelopes from the durable log into target tables,
//! each source transaction in one target transaction together with its
//! checkpoint.
//!
//! Invariants:
//! * **Exactly-once effect.** Rows and the checkpoint `(flow, commit LSN,
//!   xid)` commit together; a transaction at or below the checkpoint is
//!   skipped and counted as a duplicate. The log cursor moves only after the
//!   target commit, so a crash in between costs a redelivery, which the
//!   checkpoint absorbs.
//! * **Never split.** All chunks of a chunked transaction apply in one
//!   target transaction.
//! * **Fail closed.** A transaction that cannot be applied as captured (a
//!   database error, a missing target table or column, an update or delete
//!   that matches no row, an envelope that fails its checksum) is rolled
//!   back and quarantined with its reason, its envelope and the recovery
//!   command; the flow stops there and never skips it. The next run retries
//!   it first and marks the record resolved when it applies.
//! * Unchanged TOAST values are left as they are (not in the SET list).

use crate::log::{CursorPosition, Log, storage::FsStorage};
use std::collections::HashMap;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Statement};
use trellara_common::Lsn;
use trellara_common::envelope::{
    self, BeforeImage, Envelope, Operation, RelationSchema, ReplicaIdentity, RowChange, change,
    value,
};

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
    },
    #[error("target database: {0}")]
    Target(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Log(#[from] crate::log::Error),
}

/// Why one transaction could not be applied; becomes a quarantine record.
#[derive(Debug)]
enum Refusal {
    /// The data cannot be applied as captured: quarantine it.
    Data(String),
    /// The target is busy, down or out of resources: retry later, the
    /// transaction itself is fine.
    Transient(tokio_postgres::Error),
}

/// SQLSTATE classes that say nothing about the data: serialization and
/// deadlock (40), resources (53), lock not available (55P03), operator
/// intervention / shutdown (57), connection (08).
fn transient(e: &tokio_postgres::Error) -> bool {
    match e.as_db_error() {
        None => true,
        Some(db) => {
            let code = db.code().code();
            ["40", "53", "57", "08"].iter().any(|c| code.starts_with(c)) || code == "55P03"
        }
    }
}

impl From<tokio_postgres::Error> for Refusal {
    fn from(e: tokio_postgres::Error) -> Self {
        if transient(&e) {
            return Refusal::Transient(e);
        }
        match e.as_db_error() {
            Some(db) => Refusal::Data(format!(
                "{} (SQLSTATE {}){}",
                db.message(),
                db.code().code(),
                db.detail().map(|d| format!(": {d}")).unwrap_or_default()
            )),
            None => Refusal::Data(e.to_string()),
        }
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ApplyStats {
    pub transactions: u64,
    pub duplicates_skipped: u64,
    pub rows: u64,
    pub quarantine_resolved: u64,
}

/// Target column names and types of one table.
#[derive(Debug, Clone)]
struct TargetTable {
    qualified: String,
    types: HashMap<String, String>,
}

pub struct Applier {
    client: Client,
    flow: String,
    source_id: String,
    tables: HashMap<String, TargetTable>,
    statements: HashMap<String, Statement>,
    config_path: String,
}

impl std::fmt::Debug for Applier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Applier")
            .field("flow", &self.flow)
            .finish_non_exhaustive()
    }
}

/// Types with no default equality operator.
const NO_EQUALITY: &[&str] = &[
    "json", "xml", "point", "line", "lseg", "box", "path", "polygon", "circle",
];

/// Source transactions per target transaction, and rows: bounded so a
/// batch's target transaction stays short.
const BATCH_TRANSACTIONS: usize = 500;
const BATCH_ROWS: usize = 20_000;
/// PostgreSQL's bind parameter limit.
const MAX_PARAMS: usize = 65_535;
/// Prepared statements kept per applier session.
const STATEMENT_CACHE: usize = 1_000;
/// Rows held in one insert run (one statement).
const MAX_RUN_ROWS: usize = 5_000;
/// Runs at least this long go as COPY instead of a multi-row INSERT.
const COPY_ROWS: usize = 200;

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

/// How a chunked transaction ended.
enum Chunked {
    Applied,
    /// Its last chunk is not durable yet.
    Incomplete,
    /// The run was cut by a crash; this record starts what follows.
    Restart(crate::log::Record),
}

enum ChunkStep {
    Done,
    Incomplete,
    Restart(crate::log::Record),
}

/// Reads the next whole transaction (all its chunks) from `reader`.
/// Chunks of one transaction are consecutive with the same commit LSN and
/// rising chunk index; a run cut short by a crash mid-append (its
/// transaction was appended again whole after it) is skipped.
fn next_transaction(
    reader: &mut crate::log::Reader<FsStorage>,
    pending: &mut Option<crate::log::Record>,
) -> Result<Next, ApplyError> {
    let mut envelopes: Vec<Envelope> = Vec::new();
    loop {
        let record = match pending.take() {
            Some(record) => record,
            None => match reader.next().transpose()? {
                Some(record) => record,
                None => return Ok(Next::End),
            },
        };
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

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl Applier {
    pub fn new(client: Client, flow: &str, source_id: &str, config_path: &str) -> Self {
        Applier {
            client,
            flow: flow.to_owned(),
            source_id: source_id.to_owned(),
            tables: HashMap::new(),
            statements: HashMap::new(),
            config_path: config_path.to_owned(),
        }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Applies every record of `log` past this flow's cursor, several
    /// source transactions per target transaction (never splitting one).
    pub async fn apply_log(&mut self, log: &Log<FsStorage>) -> Result<ApplyStats, ApplyError> {
        let name = cursor_name(&self.flow);
        let start = log.register_consumer(&name)?;
        let mut stats = ApplyStats::default();
        let mut reader = log.read_from(start.next_offset)?;
        let mut pending = None;
        loop {
            let mut batch: Vec<SourceTxn> = Vec::new();
            let mut rows = 0usize;
            let mut broken = None;
            let mut end = false;
            let mut chunked = None;
            while batch.len() < BATCH_TRANSACTIONS && rows < BATCH_ROWS {
                match next_transaction(&mut reader, &mut pending)? {
                    Next::Txn(txn) => {
                        rows += txn.rows;
                        batch.push(txn);
                    }
                    Next::Chunked(first, record) => {
                        chunked = Some((first, record));
                        break;
                    }
                    Next::Broken(b) => {
                        broken = Some(b);
                        break;
                    }
                    Next::End => {
                        // A chunk run may be only partly durable: stop here
                        // and reread it from the cursor next time.
                        end = true;
                        break;
                    }
                }
            }
            if !batch.is_empty() {
                self.apply_batch(log, &name, &batch, &mut stats).await?;
            }
            if let Some((first, record)) = chunked {
                match self
                    .apply_chunked(&mut reader, *first, record.payload, &mut stats)
                    .await?
                {
                    Chunked::Applied => {
                        let last = reader.next_offset().saturating_sub(1);
                        log.commit_cursor(&name, CursorPosition::after(last, record.commit_lsn))?;
                    }
                    Chunked::Incomplete => return Ok(stats),
                    Chunked::Restart(next) => pending = Some(next),
                }
                continue;
            }
            if let Some((offset, commit_lsn, reason, payload)) = broken {
                let reason = format!("envelope at log offset {offset} is invalid: {reason}");
                return Err(self
                    .quarantine(Lsn(commit_lsn), 0, reason, &payload)
                    .await?);
            }
            if batch.is_empty() || end {
                return Ok(stats);
            }
        }
    }

    /// One target transaction for the whole batch; if it is refused, each
    /// transaction alone, so the one that cannot apply is the one
    /// quarantined and every one before it lands.
    async fn apply_batch(
        &mut self,
        log: &Log<FsStorage>,
        cursor: &str,
        batch: &[SourceTxn],
        stats: &mut ApplyStats,
    ) -> Result<(), ApplyError> {
        let mut tentative = ApplyStats::default();
        let single = batch.len() == 1;
        match self.apply_transactions(batch, &mut tentative).await {
            Ok(()) => {
                accumulate(stats, tentative);
                if let Some(last) = batch.last() {
                    log.commit_cursor(
                        cursor,
                        CursorPosition::after(last.last_offset, last.commit_lsn),
                    )?;
                }
                return Ok(());
            }
            Err(Refusal::Transient(e)) => return Err(ApplyError::Target(e)),
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
            Err(_) => {}
        }
        for txn in batch {
            Box::pin(self.apply_batch(log, cursor, std::slice::from_ref(txn), stats)).await?;
        }
        Ok(())
    }

    async fn quarantine(
        &self,
        commit_lsn: Lsn,
        xid: u64,
        reason: String,
        envelope: &[u8],
    ) -> Result<ApplyError, ApplyError> {
        let recovery = format!(
            "fix the cause named above at the target (or the config), then rerun `trellara run --config {}`: the quarantined transaction is retried first; `trellara verify --config {}` afterwards",
            self.config_path, self.config_path
        );
        self.client
            .execute(
                "INSERT INTO trellara.quarantine (flow, commit_lsn, xid, reason, recovery, envelope)
                 VALUES ($1, $2::text::pg_lsn, $3, $4, $5, $6)
                 ON CONFLICT (flow, commit_lsn) DO UPDATE
                 SET reason = EXCLUDED.reason, attempts = trellara.quarantine.attempts + 1, resolved_at = NULL",
                &[
                    &self.flow,
                    &commit_lsn.to_string(),
                    &(xid as i64),
                    &reason,
                    &recovery,
                    &envelope,
                ],
            )
            .await?;
        tracing::error!(flow = %self.flow, commit_lsn = %commit_lsn, xid, reason = %reason, "transaction quarantined");
        Ok(ApplyError::Quarantined {
            flow: self.flow.clone(),
            xid,
            commit_lsn,
            reason,
            recovery,
        })
    }

    async fn apply_transactions(
        &mut self,
        batch: &[SourceTxn],
        stats: &mut ApplyStats,
    ) -> Result<(), Refusal> {
        self.client.batch_execute("BEGIN").await?;
        let result = async {
            let checkpoint = self.lock_checkpoint().await?;
            let mut applied: Vec<&SourceTxn> = Vec::new();
            let mut skipped: Vec<String> = Vec::new();
            let mut pending = Pending::default();
            for txn in batch {
                if checkpoint.is_some_and(|c| c >= Lsn(txn.commit_lsn)) {
                    stats.duplicates_skipped += 1;
                    skipped.push(Lsn(txn.commit_lsn).to_string());
                    continue;
                }
                for env in &txn.envelopes {
                    self.apply_envelope(env, stats, &mut pending).await?;
                }
                applied.push(txn);
            }
            self.flush(&mut pending).await?;
            let last = applied.last().map(|t| {
                let head = t.envelopes.first().map_or(0, |e| e.xid);
                let end = t.envelopes.last().map_or(t.commit_lsn, |e| e.end_lsn);
                (t.commit_lsn, end, head)
            });
            let mut settled = skipped;
            settled.extend(applied.iter().map(|t| Lsn(t.commit_lsn).to_string()));
            self.settle(last, applied.len(), stats, settled).await?;
            stats.transactions += applied.len() as u64;
            Ok::<(), Refusal>(())
        }
        .await;
        match result {
            Ok(()) => {
                self.client.batch_execute("COMMIT").await?;
                Ok(())
            }
            Err(refusal) => {
                // The session may be gone (a transient refusal): the
                // transaction is rolled back either way.
                let _ = self.client.batch_execute("ROLLBACK").await;
                Err(refusal)
            }
        }
    }

    /// Inside the open target transaction: the flow's checkpoint, locked
    /// until commit so no other applier can interleave.
    async fn lock_checkpoint(&self) -> Result<Option<Lsn>, Refusal> {
        let row = self
            .client
            .query_opt(
                "SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = $1 FOR UPDATE",
                &[&self.flow],
            )
            .await?;
        match row {
            None => Ok(None),
            Some(r) => {
                let text: String = r.get(0);
                text.parse().map(Some).map_err(|_| {
                    Refusal::Data(format!(
                        "the checkpoint of flow {} reads {text:?}, not an LSN",
                        self.flow
                    ))
                })
            }
        }
    }

    /// Inside the open target transaction: moves the checkpoint to the last
    /// applied transaction (`(commit, end, xid)`), adds the counts, and marks
    /// the settled commits' quarantine records resolved.
    async fn settle(
        &mut self,
        last: Option<(u64, u64, u64)>,
        applied: usize,
        stats: &mut ApplyStats,
        settled: Vec<String>,
    ) -> Result<(), Refusal> {
        if let Some((commit, end, xid)) = last {
            self.client
                .execute(
                    "INSERT INTO trellara.checkpoints AS c (flow, source_id, commit_lsn, end_lsn, xid, transactions, duplicates_skipped)
                     VALUES ($1, $2, $3::text::pg_lsn, $4::text::pg_lsn, $5, $6, $7)
                     ON CONFLICT (flow) DO UPDATE SET source_id = EXCLUDED.source_id,
                        commit_lsn = EXCLUDED.commit_lsn, end_lsn = EXCLUDED.end_lsn, xid = EXCLUDED.xid,
                        transactions = c.transactions + EXCLUDED.transactions,
                        duplicates_skipped = c.duplicates_skipped + EXCLUDED.duplicates_skipped,
                        updated_at = now()",
                    &[
                        &self.flow,
                        &self.source_id,
                        &Lsn(commit).to_string(),
                        &Lsn(end).to_string(),
                        &(xid as i64),
                        &(applied as i64),
                        &(stats.duplicates_skipped as i64),
                    ],
                )
                .await?;
        } else if stats.duplicates_skipped > 0 {
            self.client
                .execute(
                    "UPDATE trellara.checkpoints SET duplicates_skipped = duplicates_skipped + $2 WHERE flow = $1",
                    &[&self.flow, &(stats.duplicates_skipped as i64)],
                )
                .await?;
        }
        // Applied now, or already applied (e.g. fixed by hand): either way
        // nothing is left to repair.
        if !settled.is_empty() {
            stats.quarantine_resolved += self
                .client
                .execute(
                    "UPDATE trellara.quarantine SET resolved_at = now()
                     WHERE flow = $1 AND commit_lsn = ANY($2::text[]::pg_lsn[]) AND resolved_at IS NULL",
                    &[&self.flow, &settled],
                )
                .await?;
        }
        Ok(())
    }

    /// A chunked transaction, one chunk in memory at a time, in one target
    /// transaction. Returns `Ok(None)` when the run is not complete in the
    /// log yet (nothing applied, cursor unchanged), `Ok(Some(restart))` when
    /// the run was cut by a crash and a new transaction starts at `restart`.
    async fn apply_chunked(
        &mut self,
        reader: &mut crate::log::Reader<FsStorage>,
        first: Envelope,
        first_bytes: Vec<u8>,
        stats: &mut ApplyStats,
    ) -> Result<Chunked, ApplyError> {
        let commit = first.commit_lsn;
        let xid = first.xid;
        let mut tentative = ApplyStats::default();
        self.client.batch_execute("BEGIN").await?;
        let mut current = first;
        let outcome = async {
            let checkpoint = self.lock_checkpoint().await?;
            let duplicate = checkpoint.is_some_and(|c| c >= Lsn(commit));
            loop {
                let boundary = current.boundary.clone().unwrap_or_default();
                if !duplicate {
                    let mut pending = Pending::default();
                    self.apply_envelope(&current, &mut tentative, &mut pending)
                        .await?;
                    self.flush(&mut pending).await?;
                }
                if boundary.chunk_index + 1 >= boundary.chunk_count {
                    let settled = vec![Lsn(commit).to_string()];
                    if duplicate {
                        tentative.duplicates_skipped += 1;
                        self.settle(None, 0, &mut tentative, settled).await?;
                    } else {
                        let last = Some((commit, current.end_lsn, xid));
                        self.settle(last, 1, &mut tentative, settled).await?;
                        tentative.transactions += 1;
                    }
                    return Ok(ChunkStep::Done);
                }
                let Some(record) = reader
                    .next()
                    .transpose()
                    .map_err(|e| Refusal::Data(e.to_string()))?
                else {
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
                current = next;
            }
        }
        .await;
        match outcome {
            Ok(ChunkStep::Done) => {
                self.client.batch_execute("COMMIT").await?;
                accumulate(stats, tentative);
                Ok(Chunked::Applied)
            }
            Ok(ChunkStep::Incomplete) => {
                self.client.batch_execute("ROLLBACK").await?;
                Ok(Chunked::Incomplete)
            }
            Ok(ChunkStep::Restart(record)) => {
                self.client.batch_execute("ROLLBACK").await?;
                tracing::warn!(commit_lsn = %Lsn(commit), "skipping an incomplete chunk run left by a crash; its transaction follows whole");
                Ok(Chunked::Restart(record))
            }
            Err(Refusal::Transient(e)) => {
                let _ = self.client.batch_execute("ROLLBACK").await;
                Err(ApplyError::Target(e))
            }
            Err(Refusal::Data(reason)) => {
                let _ = self.client.batch_execute("ROLLBACK").await;
                Err(self
                    .quarantine(Lsn(commit), xid, reason, &first_bytes)
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
        for ch in &env.changes {
            let Some(change::Body::Row(row)) = &ch.body else {
                continue;
            };
            let relation = env
                .relations
                .iter()
                .find(|r| r.relation_id == row.relation_id)
                .ok_or_else(|| {
                    Refusal::Data(format!(
                        "change {} names relation {} without schema",
                        ch.sequence, row.relation_id
                    ))
                })?;
            stats.rows += 1;
            if row.operation == Operation::Truncate as i32 {
                self.flush_inserts(pending).await?;
                pending.truncate.push((relation, row));
                continue;
            }
            if !pending.truncate.is_empty() {
                let rows = std::mem::take(&mut pending.truncate);
                self.truncate(&rows).await?;
            }
            let insert = row.operation == Operation::Insert as i32;
            let limit = MAX_RUN_ROWS;
            let same_run = pending.relation.is_some_and(|r| {
                r.relation_id == relation.relation_id && r.fingerprint == relation.fingerprint
            });
            if !insert || !same_run || pending.inserts.len() >= limit {
                self.flush_inserts(pending).await?;
            }
            if insert {
                pending.relation = Some(relation);
                pending.inserts.push(row);
            } else {
                self.apply_row(relation, row).await?;
            }
        }
        Ok(())
    }

    async fn flush_inserts(&mut self, pending: &mut Pending<'_>) -> Result<(), Refusal> {
        if let Some(relation) = pending.relation.take()
            && !pending.inserts.is_empty()
        {
            let rows = std::mem::take(&mut pending.inserts);
            self.insert_rows(relation, &rows).await?;
        }
        pending.inserts.clear();
        Ok(())
    }

    /// Writes everything `pending` holds, in order.
    async fn flush(&mut self, pending: &mut Pending<'_>) -> Result<(), Refusal> {
        self.flush_inserts(pending).await?;
        if !pending.truncate.is_empty() {
            let rows = std::mem::take(&mut pending.truncate);
            self.truncate(&rows).await?;
        }
        Ok(())
    }

    /// `TRUNCATE a, b [RESTART IDENTITY]`. CASCADE is deliberately not
    /// replayed (as in PostgreSQL's own apply): on the target it could empty
    /// tables that are not replicated.
    async fn truncate(&mut self, rows: &[(&RelationSchema, &RowChange)]) -> Result<(), Refusal> {
        let mut tables = Vec::with_capacity(rows.len());
        for (relation, _) in rows {
            tables.push(self.target_table(relation).await?.qualified);
        }
        let mut sql = format!("TRUNCATE {}", tables.join(", "));
        if rows.iter().any(|(_, r)| r.truncate_restart_identity) {
            sql.push_str(" RESTART IDENTITY");
        }
        self.client.batch_execute(&sql).await?;
        Ok(())
    }

    async fn insert_rows(
        &mut self,
        relation: &RelationSchema,
        rows: &[&RowChange],
    ) -> Result<(), Refusal> {
        let table = self.target_table(relation).await?;
        let columns: Vec<String> = relation
            .columns
            .iter()
            .map(|c| quote_ident(&c.name))
            .collect();
        if rows.len() >= COPY_ROWS || rows.len() * columns.len() > MAX_PARAMS {
            return self.copy_rows(&table, &columns, rows).await;
        }
        let mut params: Vec<Option<String>> = Vec::with_capacity(rows.len() * columns.len());
        let mut tuples = Vec::with_capacity(rows.len());
        for row in rows {
            let mut values = Vec::with_capacity(columns.len());
            for (col, v) in relation.columns.iter().zip(&row.after) {
                params.push(text_of(v)?);
                values.push(format!(
                    "${}::text::{}",
                    params.len(),
                    table.types.get(&col.name).map_or("text", String::as_str)
                ));
            }
            tuples.push(format!("({})", values.join(", ")));
        }
        let sql = format!(
            "INSERT INTO {} ({}) VALUES {}",
            table.qualified,
            columns.join(", "),
            tuples.join(", ")
        );
        let statement = self.statement(sql, params.len()).await?;
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
        self.client.execute(&statement, &refs).await?;
        Ok(())
    }

    /// A long run of inserts as `COPY ... FROM STDIN` (text format) inside
    /// the open target transaction: the values are the same text the
    /// INSERT path casts, escaped per COPY's rules.
    async fn copy_rows(
        &mut self,
        table: &TargetTable,
        columns: &[String],
        rows: &[&RowChange],
    ) -> Result<(), Refusal> {
        use futures_util::SinkExt;
        let mut data = bytes::BytesMut::with_capacity(rows.len() * 64);
        for row in rows {
            for (i, v) in row.after.iter().enumerate() {
                if i > 0 {
                    data.extend_from_slice(b"\t");
                }
                match text_of(v)? {
                    None => data.extend_from_slice(b"\\N"),
                    Some(text) => copy_escape(&text, &mut data),
                }
            }
            data.extend_from_slice(b"\n");
        }
        let sink = self
            .client
            .copy_in(&format!(
                "COPY {} ({}) FROM STDIN",
                table.qualified,
                columns.join(", ")
            ))
            .await?;
        futures_util::pin_mut!(sink);
        sink.send(data.freeze()).await?;
        let copied = sink.finish().await?;
        if copied != rows.len() as u64 {
            return Err(Refusal::Data(format!(
                "COPY into {} wrote {copied} rows, expected {}",
                table.qualified,
                rows.len()
            )));
        }
        Ok(())
    }

    async fn target_table(&mut self, relation: &RelationSchema) -> Result<TargetTable, Refusal> {
        let qualified = format!(
            "{}.{}",
            quote_ident(&relation.namespace),
            quote_ident(&relation.name)
        );
        if let Some(t) = self.tables.get(&qualified) {
            return Ok(t.clone());
        }
        let rows = self
            .client
            .query(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod)
                 FROM pg_attribute a
                 WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
                &[&qualified],
            )
            .await?;
        if rows.is_empty() {
            return Err(Refusal::Data(format!(
                "target table {}.{} does not exist",
                relation.namespace, relation.name
            )));
        }
        let table = TargetTable {
            qualified: qualified.clone(),
            types: rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
        };
        for column in &relation.columns {
            if !table.types.contains_key(&column.name) {
                return Err(Refusal::Data(format!(
                    "target table {}.{} has no column {:?} (schema contract breach)",
                    relation.namespace, relation.name, column.name
                )));
            }
        }
        self.tables.insert(qualified, table.clone());
        Ok(table)
    }

    async fn statement(&mut self, sql: String, params: usize) -> Result<Statement, Refusal> {
        if let Some(s) = self.statements.get(&sql) {
            return Ok(s.clone());
        }
        // Bounded: multi-row INSERTs vary by row count and table.
        if self.statements.len() >= STATEMENT_CACHE {
            self.statements.clear();
        }
        let statement = self
            .client
            .prepare_typed(&sql, &vec![Type::TEXT; params])
            .await?;
        self.statements.insert(sql, statement.clone());
        Ok(statement)
    }

    async fn apply_row(
        &mut self,
        relation: &RelationSchema,
        row: &RowChange,
    ) -> Result<(), Refusal> {
        let table = self.target_table(relation).await?;
        let op = Operation::try_from(row.operation)
            .map_err(|_| Refusal::Data("unknown operation".into()))?;
        let cast = |i: usize, col: &str| {
            format!(
                "${i}::text::{}",
                table.types.get(col).map_or("text", String::as_str)
            )
        };
        let mut params: Vec<Option<String>> = Vec::new();
        let sql = match op {
            Operation::Truncate => {
                return self.truncate(&[(relation, row)]).await;
            }
            Operation::Insert => {
                let mut columns = Vec::new();
                let mut values = Vec::new();
                for (col, v) in relation.columns.iter().zip(&row.after) {
                    params.push(text_of(v)?);
                    columns.push(quote_ident(&col.name));
                    values.push(cast(params.len(), &col.name));
                }
                format!(
                    "INSERT INTO {} ({}) VALUES ({})",
                    table.qualified,
                    columns.join(", "),
                    values.join(", ")
                )
            }
            Operation::Update | Operation::Delete => {
                let mut sets = Vec::new();
                if op == Operation::Update {
                    for (col, v) in relation.columns.iter().zip(&row.after) {
                        if matches!(v.kind, Some(value::Kind::UnchangedToast(_))) {
                            continue;
                        }
                        params.push(text_of(v)?);
                        sets.push(format!(
                            "{} = {}",
                            quote_ident(&col.name),
                            cast(params.len(), &col.name)
                        ));
                    }
                }
                let identity = if row.before_kind == BeforeImage::None as i32 {
                    &row.after
                } else {
                    &row.before
                };
                let full = relation.replica_identity == ReplicaIdentity::Full as i32;
                let mut conds = Vec::new();
                for (col, v) in relation.columns.iter().zip(identity) {
                    let ty = table.types.get(&col.name).map_or("", String::as_str);
                    // Types without an equality operator cannot locate a row
                    // (PostgreSQL's apply leaves them out too).
                    if full
                        && NO_EQUALITY
                            .iter()
                            .any(|t| ty == *t || ty.starts_with(&format!("{t}[]")))
                    {
                        continue;
                    }
                    if !(col.key || full)
                        || matches!(
                            v.kind,
                            Some(value::Kind::Absent(_) | value::Kind::UnchangedToast(_))
                        )
                    {
                        continue;
                    }
                    params.push(text_of(v)?);
                    let op = if full { "IS NOT DISTINCT FROM" } else { "=" };
                    conds.push(format!(
                        "{} {op} {}",
                        quote_ident(&col.name),
                        cast(params.len(), &col.name)
                    ));
                }
                if conds.is_empty() {
                    return Err(Refusal::Data(format!(
                        "{}.{} has no replica identity columns to find the row by",
                        relation.namespace, relation.name
                    )));
                }
                // FULL identity may match duplicates: touch exactly one.
                let filter = if full {
                    format!(
                        "ctid = (SELECT ctid FROM {} WHERE {} LIMIT 1)",
                        table.qualified,
                        conds.join(" AND ")
                    )
                } else {
                    conds.join(" AND ")
                };
                if op == Operation::Update {
                    if sets.is_empty() {
                        return Ok(());
                    }
                    format!(
                        "UPDATE {} SET {} WHERE {filter}",
                        table.qualified,
                        sets.join(", ")
                    )
                } else {
                    format!("DELETE FROM {} WHERE {filter}", table.qualified)
                }
            }
            Operation::Unspecified => return Err(Refusal::Data("unspecified operation".into())),
        };
        let statement = self.statement(sql, params.len()).await?;
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
        let n = self.client.execute(&statement, &refs).await?;
        if n != 1 {
            return Err(Refusal::Data(format!(
                "{} on {}.{} matched {n} rows, expected 1: the target has diverged from the source (no silent divergence)\nhint: run `trellara verify --config {}` to name the diverging key range",
                if op == Operation::Update {
                    "update"
                } else if op == Operation::Delete {
                    "delete"
                } else {
                    "insert"
                },
                relation.namespace,
                relation.name,
                self.config_path
            )));
        }
        Ok(())
    }
}

/// COPY text format: backslash, newline, carriage return and tab escaped.
fn copy_escape(text: &str, out: &mut bytes::BytesMut) {
    for b in text.bytes() {
        match b {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            _ => out.extend_from_slice(&[b]),
        }
    }
}

/// A column value as text for `$n::text::type`; NULL as None.
fn text_of(v: &envelope::Value) -> Result<Option<String>, Refusal> {
    Ok(match &v.kind {
        Some(value::Kind::Null(_)) => None,
        Some(value::Kind::Text(s)) => Some(s.clone()),
        Some(value::Kind::Boolean(b)) => Some(b.to_string()),
        Some(value::Kind::Int64(i)) => Some(i.to_string()),
        Some(value::Kind::Float64(f)) => Some(f.to_string()),
        Some(value::Kind::Binary(_)) => {
            return Err(Refusal::Data(
                "binary-format values are not supported by the Postgres applier yet".into(),
            ));
        }
        Some(value::Kind::UnchangedToast(_) | value::Kind::Absent(_)) | None => {
            return Err(Refusal::Data(
                "a value the applier cannot write (unchanged TOAST in an insert, or absent)".into(),
            ));
        }
    })
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
            next_transaction(&mut reader, &mut pending).expect("read")
        else {
            panic!("X starts chunked")
        };
        assert_eq!((first.commit_lsn, record.offset), (x, 0));
        // A middle-of-run chunk without its start is skipped.
        let mut reader = log.read_from(1).expect("reader");
        let Next::Chunked(_, record) = next_transaction(&mut reader, &mut pending).expect("read")
        else {
            panic!("the whole X")
        };
        assert_eq!(
            record.offset, 2,
            "offset 1 (chunk 1 without chunk 0) skipped"
        );
        let mut reader = log.read_from(5).expect("reader");
        let Next::Txn(second) = next_transaction(&mut reader, &mut pending).expect("read") else {
            panic!("Y")
        };
        assert_eq!((second.commit_lsn, second.envelopes.len()), (y, 1));
        assert!(matches!(
            next_transaction(&mut reader, &mut pending).expect("read"),
            Next::End
        ));

        // A run's first chunk at the tail is handed over too; apply_chunked
        // finds the rest missing and leaves it for later.
        log.append(0x7000_0000, &chunk(0x7000_0000, 0, 2))
            .expect("append");
        let mut reader = log.read_from(6).expect("reader");
        assert!(matches!(
            next_transaction(&mut reader, &mut pending).expect("read"),
            Next::Chunked(..)
        ));
    }
}
