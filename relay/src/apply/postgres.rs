//! The PostgreSQL [`Target`]: the applier's rows, checkpoint and quarantine
//! records as SQL on one target session. Values travel as text and are cast
//! to the target column's type (`$n::text::type`), the same unambiguous
//! forms the capture side produces; long insert runs go as COPY.
//!
//! Round trips are the latency of a small transaction, so the session
//! pipelines what does not depend on an answer: `BEGIN` goes with the
//! checkpoint lock, the rows can follow before the lock is answered
//! ([`Target::send_lock_checkpoint`]), and the checkpoint, the quarantine
//! resolution and `COMMIT` go together. If a pipelined statement fails, the
//! server turns the `COMMIT` behind it into a rollback, so nothing
//! half-settled commits.
//!
//! A target transaction commits asynchronously unless the applier asks for
//! a durable one ([`Target::begin`]); the `SET LOCAL` rides in the `BEGIN`
//! message, so it costs no round trip.

use super::{Locked, QuarantineRecord, Refusal, SchemaChange, Settle, Target, TargetError};
use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Statement};
use trellara_common::Lsn;
use trellara_common::envelope::{
    self, BeforeImage, Operation, RelationSchema, ReplicaIdentity, RowChange, value,
};
use trellara_common::table_name::TableName;

/// Types with no default equality operator.
const NO_EQUALITY: &[&str] = &[
    "json", "xml", "point", "line", "lseg", "box", "path", "polygon", "circle",
];
/// PostgreSQL's bind parameter limit.
const MAX_PARAMS: usize = 65_535;
/// Prepared statements kept per applier session.
const STATEMENT_CACHE: usize = 1_000;
/// Runs at least this long go as COPY instead of a multi-row INSERT.
const COPY_ROWS: usize = 200;
/// COPY data goes out in pieces of about this size, so the server parses
/// one while the next is built.
const COPY_PIECE: usize = 256 << 10;
/// How long a schema change waits for its table's lock each time, and how
/// many times: a long reader on the target is waited for, never queued
/// behind forever (every later query on the table would queue behind the
/// waiting ALTER). Past the last, the transaction is retried whole.
const DDL_LOCK_TIMEOUT_MS: u64 = 2_000;
const DDL_LOCK_ATTEMPTS: u32 = 5;
/// A run of inserts holding this much text goes as COPY, which sends it
/// in pieces: as bound parameters it would be copied whole into the
/// session's buffers (twice its size, and more), however large.
const WIDE_VALUE: usize = COPY_PIECE;

fn text_bytes(row: &RowChange) -> usize {
    row.after
        .iter()
        .map(|v| match &v.kind {
            Some(value::Kind::Text(t)) => t.len(),
            _ => 0,
        })
        .sum()
}

/// Whether the target's error may pass on a retry: a database error by
/// its SQLSTATE ([`trellara_common::retry`]), any other (a lost session)
/// always. A permanent one is about the data, and quarantines.
fn transient(e: &tokio_postgres::Error) -> bool {
    e.as_db_error()
        .is_none_or(|db| trellara_common::retry::transient(db.code().code()))
}

impl From<tokio_postgres::Error> for Refusal {
    fn from(e: tokio_postgres::Error) -> Self {
        if transient(&e) {
            return Refusal::Transient(TargetError::Postgres(e));
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

/// Target column names and types of one table.
#[derive(Debug, Clone)]
struct TargetTable {
    qualified: String,
    types: HashMap<String, String>,
}

/// One target session with its table and statement caches.
pub struct PgTarget {
    /// Shared with a checkpoint lock in flight, which answers after the
    /// statements sent behind it.
    client: Arc<Client>,
    tables: HashMap<String, TargetTable>,
    statements: HashMap<String, Statement>,
    /// `begin` was called and its `BEGIN` is not sent yet: it goes with
    /// the next statement.
    begin_pending: Option<&'static str>,
    copy: Option<OpenCopy>,
    /// The tables' pins (fingerprint and description) as last read; `None`
    /// until needed, and again after anything that may have moved one.
    pins: Option<HashMap<String, TablePin>>,
}

type TablePin = (u64, Option<trellara_common::envelope::RelationSchema>);

/// A COPY left open for the next run of rows into the same table.
struct OpenCopy {
    statement: String,
    table: String,
    sink: std::pin::Pin<Box<tokio_postgres::CopyInSink<bytes::Bytes>>>,
    /// Rows sent so far, checked against the server's count at the end.
    rows: u64,
}

use crate::state::checkpoint::applier::{
    COUNT_DUPLICATES, LOCK as LOCK_CHECKPOINT, TOUCH as TOUCH_CHECKPOINT,
    UPSERT as UPSERT_CHECKPOINT,
};
use crate::state::quarantine::RESOLVE as RESOLVE_QUARANTINE;

impl std::fmt::Debug for PgTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgTarget").finish_non_exhaustive()
    }
}

/// `BEGIN` with the commit's durability: one message, no extra reply.
fn begin_sql(durable: bool) -> &'static str {
    if durable {
        "BEGIN; SET LOCAL synchronous_commit TO on"
    } else {
        "BEGIN; SET LOCAL synchronous_commit TO off"
    }
}

fn qualified(relation: &RelationSchema) -> String {
    TableName::new(&relation.namespace, &relation.name).quoted()
}

fn quote_ident(name: &str) -> String {
    postgres_protocol::escape::escape_identifier(name)
}

impl PgTarget {
    /// The sink's acknowledgement of `change` and the table's new pin, in
    /// the open transaction; cached descriptions and statements are of the
    /// old table.
    async fn acknowledge(
        &mut self,
        change: &SchemaChange<'_>,
        outcome: &str,
    ) -> Result<(), Refusal> {
        let (relation, ddl) = (change.relation, change.ddl);
        self.pins = None;
        self.tables.remove(&qualified(relation));
        self.statements.clear();
        let table = change.table();
        let kind = trellara_common::ddl::kind_name(change.kind());
        let commit = change.commit_lsn.to_string();
        let (before, after) = (ddl.fingerprint_before as i64, ddl.fingerprint_after as i64);
        self.client
            .execute(
                crate::state::schema::ACKNOWLEDGE,
                &[
                    &change.flow,
                    &change.barrier_id(),
                    &table,
                    &kind,
                    &commit,
                    &change.statement(),
                    &before,
                    &after,
                    &outcome,
                    &ddl.column,
                ],
            )
            .await?;
        self.client
            .execute(
                crate::state::schema::REPIN,
                &[&change.flow, &table, &after, &{
                    use prost::Message as _;
                    relation.encode_to_vec()
                }],
            )
            .await?;
        Ok(())
    }

    pub fn new(client: Client) -> Self {
        PgTarget {
            client: Arc::new(client),
            tables: HashMap::new(),
            statements: HashMap::new(),
            begin_pending: None,
            copy: None,
            pins: None,
        }
    }

    /// Makes the session ready for the next statement: ends an open COPY
    /// and sends a `BEGIN` still held back by [`Target::begin`].
    async fn open(&mut self) -> Result<(), Refusal> {
        self.end_copy().await?;
        if let Some(begin) = self.begin_pending.take() {
            self.client.batch_execute(begin).await?;
        }
        Ok(())
    }

    /// A statement with server-inferred parameter types, prepared once.
    async fn prepared(&mut self, sql: &str) -> Result<Statement, Refusal> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let statement = self.client.prepare(sql).await?;
        self.statements.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The lock's answer to come, its requests (and a held-back `BEGIN`)
    /// already on the wire: whatever is sent next goes behind them.
    async fn lock_sent(
        &self,
        begin: Option<&'static str>,
        statement: Statement,
        flow: &str,
    ) -> <Self as Target>::Lock {
        let client = Arc::clone(&self.client);
        let flow = flow.to_owned();
        let mut lock: <Self as Target>::Lock = Box::pin(async move {
            let ((), row) = tokio::try_join!(
                biased;
                async {
                    if let Some(begin) = begin {
                        client.batch_execute(begin).await?;
                    }
                    Ok(())
                },
                async { client.query_opt(&statement, &[&flow]).await }
            )?;
            let Some(r) = row else {
                return Ok(Locked::default());
            };
            let lsn = |i: usize| {
                let text: Option<String> = r.get(i);
                text.map(|text| {
                    text.parse().map_err(|_| {
                        Refusal::Data(format!(
                            "the checkpoint of flow {flow} reads {text:?}, not an LSN (trellara.checkpoints was edited by hand)\nhint: reseed the flow (trellara reseed --config ...)"
                        ))
                    })
                })
                .transpose()
            };
            Ok(Locked {
                checkpoint: lsn(0)?,
                fence: lsn(1)?,
            })
        });
        let sent = std::future::poll_fn(|cx| Poll::Ready(lock.as_mut().poll(cx))).await;
        match sent {
            Poll::Pending => lock,
            Poll::Ready(answer) => Box::pin(std::future::ready(answer)),
        }
    }

    /// Settles and commits; with `next` (its durability), the next
    /// transaction's `BEGIN` and checkpoint lock follow in the same write.
    async fn commit_then(
        &mut self,
        flow: &str,
        source_id: &str,
        settle: &Settle,
        next: Option<bool>,
    ) -> Result<(u64, Option<<Self as Target>::Lock>), Refusal> {
        self.open().await?;
        let next = match next {
            Some(durable) => Some((begin_sql(durable), self.prepared(LOCK_CHECKPOINT).await?)),
            None => None,
        };
        // Resolving costs no round trip here (it is pipelined), so it is
        // sent whenever something settled, whoever quarantined it.
        let resolve = if settle.settled.is_empty() {
            None
        } else {
            Some(self.prepared(RESOLVE_QUARANTINE).await?)
        };
        let counts = match &settle.last {
            Some(_) => Some(self.prepared(UPSERT_CHECKPOINT).await?),
            None if settle.duplicates > 0 => Some(self.prepared(COUNT_DUPLICATES).await?),
            None => None,
        };
        let client = &self.client;
        let checkpoint = async {
            let Some(statement) = &counts else {
                return Ok(0);
            };
            match &settle.last {
                Some(last) => {
                    client
                        .execute(
                            statement,
                            &[
                                &flow,
                                &source_id,
                                &last.commit_lsn.to_string(),
                                &last.end_lsn.to_string(),
                                &(last.xid as i64),
                                &(settle.applied as i64),
                                &(settle.duplicates as i64),
                            ],
                        )
                        .await
                }
                None => {
                    client
                        .execute(statement, &[&flow, &(settle.duplicates as i64)])
                        .await
                }
            }
        };
        let resolved = async {
            let Some(statement) = &resolve else {
                return Ok(0);
            };
            let settled: Vec<String> = settle.settled.iter().map(Lsn::to_string).collect();
            client.execute(statement, &[&flow, &settled]).await
        };
        let end = client.batch_execute("COMMIT");
        // Polled in order, so the requests go out in this order at once.
        let mut commit =
            std::pin::pin!(async { tokio::try_join!(biased; checkpoint, resolved, end) });
        let first = std::future::poll_fn(|cx| Poll::Ready(commit.as_mut().poll(cx))).await;
        let lock = match next {
            Some((begin, statement)) => Some(self.lock_sent(Some(begin), statement, flow).await),
            None => None,
        };
        let (_, resolved, ()) = match first {
            Poll::Ready(answer) => answer,
            Poll::Pending => commit.await,
        }?;
        Ok((resolved, lock))
    }

    /// Streams `rows` into the open COPY of the same table and columns, or
    /// opens one. The COPY stays open across calls, so a large
    /// transaction's chunks become one COPY that the server ingests while
    /// the next chunk is read; any other statement ends it first.
    async fn copy_rows(
        &mut self,
        table: &TargetTable,
        columns: &[String],
        rows: &[&RowChange],
    ) -> Result<(), Refusal> {
        use futures_util::SinkExt;
        let statement = format!(
            "COPY {} ({}) FROM STDIN",
            table.qualified,
            columns.join(", ")
        );
        if self.copy.as_ref().is_some_and(|c| c.statement != statement) {
            self.end_copy().await?;
        }
        let open = match self.copy.take() {
            Some(open) => self.copy.insert(open),
            None => {
                // Prepared once: every batch of a backlog opens one.
                let prepared = self.prepared(&statement).await?;
                let sink = self.client.copy_in(&prepared).await?;
                self.copy.insert(OpenCopy {
                    statement,
                    table: table.qualified.clone(),
                    sink: Box::pin(sink),
                    rows: 0,
                })
            }
        };
        let mut data = bytes::BytesMut::with_capacity(COPY_PIECE + 4096);
        for row in rows {
            for (i, v) in row.after.iter().enumerate() {
                if i > 0 {
                    data.extend_from_slice(b"\t");
                }
                // Text, the common case, is escaped straight from the
                // envelope, not copied into a String first.
                match text_in(
                    &table.qualified,
                    columns.get(i).map_or("?", String::as_str),
                    v,
                )? {
                    None => data.extend_from_slice(b"\\N"),
                    Some(text) => {
                        // A wide value goes in pieces: no buffer ever holds
                        // all of it a second time.
                        for piece in text.as_bytes().chunks(COPY_PIECE) {
                            copy_escape(piece, &mut data);
                            if data.len() >= COPY_PIECE {
                                open.sink.send(data.split().freeze()).await?;
                            }
                        }
                    }
                }
            }
            data.extend_from_slice(b"\n");
            if data.len() >= COPY_PIECE {
                open.sink.send(data.split().freeze()).await?;
            }
        }
        if !data.is_empty() {
            open.sink.send(data.freeze()).await?;
        }
        open.rows += rows.len() as u64;
        Ok(())
    }

    /// Ends the open COPY, if any, checking that every row sent landed.
    async fn end_copy(&mut self) -> Result<(), Refusal> {
        let Some(mut open) = self.copy.take() else {
            return Ok(());
        };
        let copied = open.sink.as_mut().finish().await?;
        if copied != open.rows {
            return Err(Refusal::Data(format!(
                "COPY into {} wrote {copied} rows, expected {}: a trigger or rule on the target table drops or redirects rows\nhint: disable or drop it on the target (ALTER TABLE {} DISABLE TRIGGER name)",
                open.table, open.rows, open.table
            )));
        }
        Ok(())
    }

    async fn target_table(&mut self, relation: &RelationSchema) -> Result<TargetTable, Refusal> {
        let qualified = qualified(relation);
        if let Some(t) = self.tables.get(&qualified) {
            return Ok(t.clone());
        }
        // Values are cast to the column's type without its modifier: an
        // explicit cast to varchar(n), char(n) or bit(n) cuts or pads, the
        // assignment to the column refuses instead. Where the assignment
        // itself would round (numeric scale, time precision), `fits` refuses
        // the table up front.
        let rows = self
            .client
            .query(
                "SELECT a.attname::text,
                        CASE WHEN t.typcategory = 'V' OR a.atttypid = 'bit'::regtype THEN 'bit varying'
                             WHEN a.atttypid = 'bit[]'::regtype THEN 'bit varying[]'
                             ELSE format_type(a.atttypid, NULL) END,
                        a.atttypid::int8, a.atttypmod, format_type(a.atttypid, a.atttypmod)
                 FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
                 WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
                &[&qualified],
            )
            .await?;
        if rows.is_empty() {
            return Err(Refusal::Data(super::missing_table(relation)));
        }
        let table = TargetTable {
            qualified: qualified.clone(),
            types: rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
        };
        for column in &relation.columns {
            let Some(target) = rows.iter().find(|r| r.get::<_, String>(0) == column.name) else {
                return Err(Refusal::Data(super::missing_column(relation, &column.name)));
            };
            let (oid, modifier, shown): (i64, i32, String) =
                (target.get(2), target.get(3), target.get(4));
            if !super::fits(
                column.type_oid,
                column.type_modifier,
                u32::try_from(oid).unwrap_or(0),
                modifier,
            ) {
                return Err(Refusal::Data(format!(
                    "target column {}.{} is {shown}, narrower than or different from the source's (type {} modifier {}): a value could be cut or rounded, and none is silently changed\nhint: make the target column the source's type (ALTER TABLE {qualified} ALTER COLUMN {} TYPE ...), then rerun; `trellara preflight` names each such column",
                    TableName::new(&relation.namespace, &relation.name),
                    trellara_common::table_name::display_ident(&column.name),
                    column.type_oid,
                    column.type_modifier,
                    quote_ident(&column.name)
                )));
            }
        }
        self.tables.insert(qualified, table.clone());
        Ok(table)
    }

    /// Runs `alter` in the open transaction, each attempt under a lock
    /// timeout inside a savepoint, so a timed-out one leaves the
    /// transaction usable for the next.
    async fn alter_waiting(&mut self, alter: &str) -> Result<(), Refusal> {
        let mut attempt = 1;
        loop {
            let sql = format!(
                "SAVEPOINT trellara_ddl; SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT_MS}ms'; {alter}; SET LOCAL lock_timeout TO DEFAULT; RELEASE SAVEPOINT trellara_ddl"
            );
            match self.client.batch_execute(&sql).await {
                Ok(()) => return Ok(()),
                Err(e)
                    if attempt < DDL_LOCK_ATTEMPTS
                        && e.code()
                            == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
                {
                    tracing::warn!(
                        statement = alter,
                        attempt,
                        "schema change waits for its table's lock (a long reader on the target?)"
                    );
                    self.client
                        .batch_execute("ROLLBACK TO SAVEPOINT trellara_ddl")
                        .await?;
                    tokio::time::sleep(std::time::Duration::from_millis(200 * u64::from(attempt)))
                        .await;
                    attempt += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
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
}

impl Target for PgTarget {
    /// One message either way: the `SET LOCAL` costs the target no extra
    /// reply. `on` also for a role whose default is `off`, so a durable
    /// commit is one whatever the role says.
    async fn begin(&mut self, durable: bool) -> Result<(), Refusal> {
        // A COPY left by a transaction that never ended (a simulated crash
        // keeps the session) is aborted, not continued.
        self.copy = None;
        self.begin_pending = Some(begin_sql(durable));
        Ok(())
    }

    /// A durable commit that writes: PostgreSQL flushes its WAL in order,
    /// so it makes every earlier commit of this session durable too. (A
    /// transaction that writes nothing flushes nothing.)
    async fn make_durable(&mut self, flow: &str) -> Result<bool, Refusal> {
        self.end_copy().await?;
        let statement = self.prepared(TOUCH_CHECKPOINT).await?;
        let client = &self.client;
        let params: [&(dyn ToSql + Sync); 1] = [&flow];
        let (_, touched, ()) = tokio::try_join!(
            biased;
            client.batch_execute("BEGIN; SET LOCAL synchronous_commit TO on"),
            client.execute(&statement, &params),
            client.batch_execute("COMMIT")
        )?;
        Ok(touched == 1)
    }

    async fn rollback(&mut self) {
        // Dropping the sink aborts the COPY (CopyFail).
        self.copy = None;
        // A pin moved in the transaction moves back.
        self.pins = None;
        if self.begin_pending.take().is_some() {
            return;
        }
        // The session may be gone (a transient refusal), or a pipelined
        // COMMIT already rolled back: the transaction is over either way.
        let _ = self.client.batch_execute("ROLLBACK").await;
    }

    async fn applied(&self, flow: &str) -> Result<Option<Lsn>, TargetError> {
        Ok(crate::state::checkpoint::applied(&*self.client, flow).await?)
    }

    type Lock = Pin<Box<dyn Future<Output = Result<Locked, Refusal>>>>;

    async fn fence(&mut self, flow: &str) -> Result<Option<Lsn>, TargetError> {
        Ok(crate::state::fence::current(&self.client, flow).await?)
    }

    /// Sent at once, together with the held-back `BEGIN`.
    async fn send_lock_checkpoint(&mut self, flow: &str) -> Result<Self::Lock, Refusal> {
        self.end_copy().await?;
        let statement = self.prepared(LOCK_CHECKPOINT).await?;
        let begin = self.begin_pending.take();
        Ok(self.lock_sent(begin, statement, flow).await)
    }

    /// The checkpoint, counts, quarantine resolution and `COMMIT` in one
    /// round trip.
    async fn settle_and_commit(
        &mut self,
        flow: &str,
        source_id: &str,
        settle: &Settle,
    ) -> Result<u64, Refusal> {
        Ok(self.commit_then(flow, source_id, settle, None).await?.0)
    }

    /// The next transaction's `BEGIN` and lock go right behind the
    /// `COMMIT`: the backend runs them before it next waits for input.
    async fn commit_and_open(
        &mut self,
        flow: &str,
        source_id: &str,
        settle: &Settle,
        durable: bool,
    ) -> Result<(u64, Option<Self::Lock>), Refusal> {
        self.commit_then(flow, source_id, settle, Some(durable))
            .await
    }

    async fn insert_rows(
        &mut self,
        relation: &RelationSchema,
        rows: &[&RowChange],
    ) -> Result<(), Refusal> {
        let copy = rows.len() >= COPY_ROWS
            || rows.len() * relation.columns.len() > MAX_PARAMS
            || rows.iter().map(|r| text_bytes(r)).sum::<usize>() > WIDE_VALUE;
        // An open COPY continues only when nothing else has to be sent
        // first (the table's columns are known).
        if !(copy && self.copy.is_some() && self.tables.contains_key(&qualified(relation))) {
            self.open().await?;
        }
        let table = self.target_table(relation).await?;
        let columns: Vec<String> = relation
            .columns
            .iter()
            .map(|c| quote_ident(&c.name))
            .collect();
        if copy {
            return self.copy_rows(&table, &columns, rows).await;
        }
        let mut params: Vec<Option<Cow<'_, str>>> = Vec::with_capacity(rows.len() * columns.len());
        let mut tuples = Vec::with_capacity(rows.len());
        for row in rows {
            let mut values = Vec::with_capacity(columns.len());
            for (col, v) in relation.columns.iter().zip(&row.after) {
                params.push(text_in(&table.qualified, &col.name, v)?);
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

    /// `TRUNCATE a, b [RESTART IDENTITY]`. CASCADE is deliberately not
    /// replayed (as in PostgreSQL's own apply): on the target it could empty
    /// tables that are not replicated.
    async fn truncate(&mut self, rows: &[(&RelationSchema, &RowChange)]) -> Result<(), Refusal> {
        self.open().await?;
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

    async fn change_row(
        &mut self,
        relation: &RelationSchema,
        row: &RowChange,
    ) -> Result<Option<u64>, Refusal> {
        self.open().await?;
        let table = self.target_table(relation).await?;
        let update = row.operation == Operation::Update as i32;
        let cast = |i: usize, col: &str| {
            format!(
                "${i}::text::{}",
                table.types.get(col).map_or("text", String::as_str)
            )
        };
        let mut params: Vec<Option<Cow<'_, str>>> = Vec::new();
        let mut sets = Vec::new();
        if update {
            for (col, v) in relation.columns.iter().zip(&row.after) {
                if matches!(v.kind, Some(value::Kind::UnchangedToast(_))) {
                    continue;
                }
                params.push(text_in(&table.qualified, &col.name, v)?);
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
            params.push(text_in(&table.qualified, &col.name, v)?);
            let op = if full { "IS NOT DISTINCT FROM" } else { "=" };
            conds.push(format!(
                "{} {op} {}",
                quote_ident(&col.name),
                cast(params.len(), &col.name)
            ));
        }
        if conds.is_empty() {
            return Err(Refusal::Data(format!(
                "{}.{} has no replica identity columns to find the row by\nhint: on the source, give the table a primary key or ALTER TABLE {}.{} REPLICA IDENTITY FULL; then reseed",
                relation.namespace, relation.name, relation.namespace, relation.name
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
        let sql = if update {
            if sets.is_empty() {
                return Ok(None);
            }
            format!(
                "UPDATE {} SET {} WHERE {filter}",
                table.qualified,
                sets.join(", ")
            )
        } else {
            format!("DELETE FROM {} WHERE {filter}", table.qualified)
        };
        let statement = self.statement(sql, params.len()).await?;
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
        Ok(Some(self.client.execute(&statement, &refs).await?))
    }

    async fn quarantine(&mut self, record: &QuarantineRecord<'_>) -> Result<(), TargetError> {
        crate::state::quarantine::record(self.client.as_ref(), record).await?;
        Ok(())
    }

    async fn keep_pin(
        &mut self,
        flow: &str,
        commit_lsn: Lsn,
        relation: &RelationSchema,
    ) -> Result<(), Refusal> {
        use prost::Message as _;
        let table = TableName::new(&relation.namespace, &relation.name).to_string();
        let cached = |pins: &Option<HashMap<String, TablePin>>| {
            pins.as_ref().map(|p| {
                p.get(&table)
                    .is_none_or(|(f, _)| *f == relation.fingerprint)
            })
        };
        if cached(&self.pins) == Some(true) {
            return Ok(());
        }
        // Read again: a join or a reseed may have pinned it since.
        self.end_copy().await?;
        let pins = crate::state::runs::tables(self.client.as_ref(), flow)
            .await?
            .into_iter()
            .filter_map(|t| Some((t.name, (t.fingerprint?, t.schema))))
            .collect();
        self.pins = Some(pins);
        if cached(&self.pins) == Some(true) {
            return Ok(());
        }
        let (fingerprint, schema) = self
            .pins
            .as_ref()
            .and_then(|p| p.get(&table))
            .cloned()
            .unwrap_or_default();
        let commit = commit_lsn.to_string();
        let client = self.client.as_ref();
        if crate::state::schema::accepted(
            client,
            flow,
            &table,
            &commit,
            relation.fingerprint as i64,
        )
        .await?
        {
            self.open().await?;
            // Each change the pin moves past, acknowledged as the
            // operator's (verify explains a dropped column by it).
            for found in schema
                .as_ref()
                .map(|pinned| trellara_common::ddl::diff::diff(pinned, relation))
                .unwrap_or_default()
            {
                let kind = found
                    .kind
                    .unwrap_or(trellara_common::envelope::DdlKind::Unspecified);
                let change = trellara_common::ddl::Change {
                    kind,
                    table: table.clone(),
                    column: found.column.clone(),
                };
                let barrier = format!(
                    "{}@{commit}",
                    trellara_common::ddl::barrier_id(flow, &change)
                );
                self.client
                    .execute(
                        crate::state::schema::ACKNOWLEDGE,
                        &[
                            &flow,
                            &barrier,
                            &table,
                            &trellara_common::ddl::kind_name(kind),
                            &commit,
                            &found.what,
                            &(fingerprint as i64),
                            &(relation.fingerprint as i64),
                            &"already_present",
                            &found.column.unwrap_or_default(),
                        ],
                    )
                    .await?;
            }
            self.client
                .execute(
                    crate::state::schema::REPIN,
                    &[
                        &flow,
                        &table,
                        &(relation.fingerprint as i64),
                        &relation.encode_to_vec(),
                    ],
                )
                .await?;
            self.pins = None;
            return Ok(());
        }
        let changes = crate::contract::unexplained(schema.as_ref(), fingerprint, relation);
        Err(Refusal::Held(Box::new(super::Hold {
            reason: format!(
                "its rows arrive under a description that no schema event explained: {}",
                changes.join("; ")
            ),
            table,
            schema: relation.encode_to_vec(),
        })))
    }

    async fn apply_ddl(&mut self, change: &SchemaChange<'_>) -> Result<(), Refusal> {
        use trellara_common::envelope::DdlKind;
        self.open().await?;
        let relation = change.relation;
        let ddl = change.ddl;
        if !ddl.held.is_empty() {
            let (table, commit) = (change.table(), change.commit_lsn.to_string());
            let client = self.client.as_ref();
            let after = relation.fingerprint as i64;
            if !crate::state::schema::accepted(client, change.flow, &table, &commit, after).await? {
                use prost::Message as _;
                return Err(Refusal::Held(Box::new(super::Hold {
                    reason: ddl.held.clone(),
                    table,
                    schema: relation.encode_to_vec(),
                })));
            }
            // The operator made the target match and said so: no DDL.
            return self.acknowledge(change, "already_present").await;
        }
        let qualified = qualified(relation);
        let column = quote_ident(&ddl.column);
        // The type as this target names it: resolved in its own catalog,
        // so nothing from the log is run as SQL.
        let resolved = self
            .client
            .query_one(
                "SELECT t::oid::int8, format_type(t, $2) FROM (SELECT to_regtype($1) AS t) r",
                &[&ddl.type_name, &ddl.type_modifier],
            )
            .await?;
        let (type_oid, type_sql): (Option<i64>, Option<String>) =
            (resolved.get(0), resolved.get(1));
        let (Some(type_oid), Some(type_sql)) = (type_oid, type_sql) else {
            return Err(Refusal::Data(format!(
                "{}: the target has no type {:?}\nhint: create the type on the target, then the change applies on the next retry",
                change.statement(),
                ddl.type_name
            )));
        };
        let type_oid = u32::try_from(type_oid).unwrap_or(0);
        let existing = self
            .client
            .query_opt(
                "SELECT a.atttypid::int8, a.atttypmod, format_type(a.atttypid, a.atttypmod)
                 FROM pg_attribute a
                 WHERE a.attrelid = to_regclass($1) AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped",
                &[&qualified, &ddl.column],
            )
            .await?;
        // Already there as the change leaves it (a target-owned column of
        // the same name and type, or a replay): nothing to run.
        let present = existing.as_ref().is_some_and(|row| {
            u32::try_from(row.get::<_, i64>(0)).ok() == Some(type_oid)
                && super::fits(type_oid, ddl.type_modifier, type_oid, row.get(1))
        });
        let fill = match ddl.fill.as_ref().and_then(|v| v.kind.as_ref()) {
            Some(trellara_common::envelope::value::Kind::Text(v)) => Some(v),
            _ => None,
        };
        if present && let (Some(v), DdlKind::AddNullableColumn) = (fill, change.kind()) {
            // Its rows from before the change would read NULL (or the
            // target's own default), the source's read the fill.
            return Err(Refusal::Data(format!(
                "{}: target table {qualified} already has a column {column}, but the source's rows from before the change read {} there and the target's cannot be known to\nhint: set the target's old rows (UPDATE {qualified} SET {column} = {} WHERE {column} IS NULL) and retry, or reseed the table",
                change.statement(),
                postgres_protocol::escape::escape_literal(v),
                postgres_protocol::escape::escape_literal(v)
            )));
        }
        let alter = match change.kind() {
            _ if present => None,
            DdlKind::AddNullableColumn => {
                if let Some(row) = &existing {
                    return Err(Refusal::Data(format!(
                        "{}: target table {qualified} already has a column {column} of type {}, not the source's {type_sql}\nhint: rename or retype the target's own column, then the change applies on the next retry",
                        change.statement(),
                        row.get::<_, String>(2)
                    )));
                }
                let fill = fill
                    .map(|v| {
                        format!(
                            " DEFAULT {}::{type_sql}",
                            postgres_protocol::escape::escape_literal(v)
                        )
                    })
                    .unwrap_or_default();
                Some(format!(
                    "ALTER TABLE {qualified} ADD COLUMN {column} {type_sql}{fill}"
                ))
            }
            DdlKind::WidenType | DdlKind::IncreaseVarchar => {
                if existing.is_none() {
                    return Err(Refusal::Data(super::missing_column(relation, &ddl.column)));
                }
                Some(format!(
                    "ALTER TABLE {qualified} ALTER COLUMN {column} TYPE {type_sql}"
                ))
            }
            other => {
                return Err(Refusal::Data(format!(
                    "{}: a {} change is not applied by a sink\nhint: apply it on the target yourself, then reseed the table",
                    change.statement(),
                    trellara_common::ddl::kind_name(other)
                )));
            }
        };
        if let Some(alter) = &alter {
            self.alter_waiting(alter).await?;
        }
        let outcome = if alter.is_some() {
            "applied"
        } else {
            "already_present"
        };
        self.acknowledge(change, outcome).await
    }

    async fn copied_tables(
        &mut self,
        flow: &str,
    ) -> Result<Option<std::collections::HashMap<String, Option<Lsn>>>, Refusal> {
        // The session is busy with an open COPY until it ends.
        self.end_copy().await?;
        let copied: std::collections::HashMap<String, Option<Lsn>> =
            crate::state::runs::tables(self.client.as_ref(), flow)
                .await?
                .into_iter()
                .map(|t| (t.name, t.boundary))
                .collect();
        // A flow that copied nothing (a log applied by hand) has no
        // tables to tell apart.
        Ok(Some(copied).filter(|c| !c.is_empty()))
    }
}

/// COPY text format: backslash, newline, carriage return and tab escaped.
/// Runs between them are copied whole (most values have none).
fn copy_escape(bytes: &[u8], out: &mut bytes::BytesMut) {
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escaped: &[u8] = match b {
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        out.extend_from_slice(escaped);
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
}

/// A column value as text for `$n::text::type`; NULL as None.
/// [`text_of`] naming the table and column a refused value was for.
fn text_in<'v>(
    table: &str,
    column: &str,
    v: &'v envelope::Value,
) -> Result<Option<Cow<'v, str>>, Refusal> {
    text_of(v).map_err(|e| match e {
        Refusal::Data(reason) => Refusal::Data(format!("{table}, column {column}: {reason}")),
        other => other,
    })
}

/// A value's text form; text, the common case, borrowed from the envelope
/// (a wide value is not copied once more on its way to the target).
pub(crate) fn text_of(v: &envelope::Value) -> Result<Option<Cow<'_, str>>, Refusal> {
    Ok(match &v.kind {
        Some(value::Kind::Null(_)) => None,
        Some(value::Kind::Text(s)) => Some(Cow::Borrowed(s)),
        Some(value::Kind::Boolean(b)) => Some(Cow::Owned(b.to_string())),
        Some(value::Kind::Int64(i)) => Some(Cow::Owned(i.to_string())),
        Some(value::Kind::Float64(f)) => Some(Cow::Owned(f.to_string())),
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
    use super::copy_escape;

    #[test]
    fn copy_escape_escapes_exactly_the_four_specials() {
        let mut out = bytes::BytesMut::new();
        copy_escape(b"plain", &mut out);
        copy_escape(b"|a\tb\\c\nd\re\\N|", &mut out);
        copy_escape("ünï\\".as_bytes(), &mut out);
        assert_eq!(&out[..], "plain|a\\tb\\\\c\\nd\\re\\\\N|ünï\\\\".as_bytes());
    }
}
