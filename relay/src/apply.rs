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
struct Refusal(String);

impl From<tokio_postgres::Error> for Refusal {
    fn from(e: tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(db) => Refusal(format!(
                "{} (SQLSTATE {}){}",
                db.message(),
                db.code().code(),
                db.detail().map(|d| format!(": {d}")).unwrap_or_default()
            )),
            None => Refusal(e.to_string()),
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

    /// Applies every record of `log` past this flow's cursor.
    pub async fn apply_log(&mut self, log: &Log<FsStorage>) -> Result<ApplyStats, ApplyError> {
        let name = cursor_name(&self.flow);
        let start = log.register_consumer(&name)?;
        let mut stats = ApplyStats::default();
        let mut reader = log.read_from(start.next_offset)?;
        // One source transaction at a time: a whole envelope or all its chunks.
        while let Some(first) = reader.next().transpose()? {
            let mut records = vec![first];
            let mut envelopes = Vec::new();
            let mut broken = None;
            while let Some(last) = records.last() {
                match envelope::decode(&last.payload) {
                    Ok(env) => {
                        let done = env
                            .boundary
                            .as_ref()
                            .is_none_or(|b| b.chunk_index + 1 >= b.chunk_count);
                        envelopes.push(env);
                        if done {
                            break;
                        }
                    }
                    Err(e) => {
                        broken = Some(format!(
                            "envelope at log offset {} is invalid: {e}",
                            last.offset
                        ));
                        break;
                    }
                }
                match reader.next().transpose()? {
                    Some(next) => records.push(next),
                    None => {
                        // The rest of the chunks are not durable yet.
                        return Ok(stats);
                    }
                }
            }
            let last = records.last().map(|r| (r.offset, r.commit_lsn));
            let Some((last_offset, commit_lsn)) = last else {
                break;
            };
            if let Some(reason) = broken {
                let payload = records
                    .last()
                    .map(|r| r.payload.clone())
                    .unwrap_or_default();
                return Err(self
                    .quarantine(Lsn(commit_lsn), 0, reason, &payload)
                    .await?);
            }
            match self.apply_transaction(&envelopes, &mut stats).await {
                Ok(()) => {}
                Err(Refusal(reason)) => {
                    let bytes = envelopes
                        .first()
                        .and_then(|e| envelope::encode(e).ok())
                        .unwrap_or_default();
                    let xid = envelopes.first().map_or(0, |e| e.xid);
                    return Err(self
                        .quarantine(Lsn(commit_lsn), xid, reason, &bytes)
                        .await?);
                }
            }
            log.commit_cursor(&name, CursorPosition::after(last_offset, commit_lsn))?;
        }
        Ok(stats)
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

    async fn apply_transaction(
        &mut self,
        envelopes: &[Envelope],
        stats: &mut ApplyStats,
    ) -> Result<(), Refusal> {
        let Some(head) = envelopes.first() else {
            return Ok(());
        };
        let commit = Lsn(head.commit_lsn).to_string();
        self.client.batch_execute("BEGIN").await?;
        let result = async {
            let row = self
                .client
                .query_opt(
                    "SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = $1 FOR UPDATE",
                    &[&self.flow],
                )
                .await?;
            let checkpoint: Option<Lsn> = row.and_then(|r| r.get::<_, String>(0).parse().ok());
            if checkpoint.is_some_and(|c| c >= Lsn(head.commit_lsn)) {
                self.client
                    .execute(
                        "UPDATE trellara.checkpoints SET duplicates_skipped = duplicates_skipped + 1 WHERE flow = $1",
                        &[&self.flow],
                    )
                    .await?;
                stats.duplicates_skipped += 1;
                return Ok(false);
            }
            for env in envelopes {
                let relations: HashMap<u32, &RelationSchema> =
                    env.relations.iter().map(|r| (r.relation_id, r)).collect();
                for ch in &env.changes {
                    if let Some(change::Body::Row(row)) = &ch.body {
                        let relation = relations.get(&row.relation_id).ok_or_else(|| {
                            Refusal(format!("change {} names relation {} without schema", ch.sequence, row.relation_id))
                        })?;
                        self.apply_row(relation, row).await?;
                        stats.rows += 1;
                    }
                }
            }
            let tail = envelopes.last().unwrap_or(head);
            self.client
                .execute(
                    "INSERT INTO trellara.checkpoints AS c (flow, source_id, commit_lsn, end_lsn, xid, transactions)
                     VALUES ($1, $2, $3::text::pg_lsn, $4::text::pg_lsn, $5, 1)
                     ON CONFLICT (flow) DO UPDATE SET source_id = EXCLUDED.source_id,
                        commit_lsn = EXCLUDED.commit_lsn, end_lsn = EXCLUDED.end_lsn, xid = EXCLUDED.xid,
                        transactions = c.transactions + 1, updated_at = now()",
                    &[
                        &self.flow,
                        &self.source_id,
                        &commit,
                        &Lsn(tail.end_lsn).to_string(),
                        &(head.xid as i64),
                    ],
                )
                .await?;
            let resolved = self
                .client
                .execute(
                    "UPDATE trellara.quarantine SET resolved_at = now()
                     WHERE flow = $1 AND commit_lsn = $2::text::pg_lsn AND resolved_at IS NULL",
                    &[&self.flow, &commit],
                )
                .await?;
            stats.quarantine_resolved += resolved;
            Ok::<bool, Refusal>(true)
        }
        .await;
        match result {
            Ok(applied) => {
                self.client.batch_execute("COMMIT").await?;
                if applied {
                    stats.transactions += 1;
                }
                Ok(())
            }
            Err(refusal) => {
                self.client.batch_execute("ROLLBACK").await?;
                Err(refusal)
            }
        }
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
            return Err(Refusal(format!(
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
                return Err(Refusal(format!(
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
        let op =
            Operation::try_from(row.operation).map_err(|_| Refusal("unknown operation".into()))?;
        let cast = |i: usize, col: &str| {
            format!(
                "${i}::text::{}",
                table.types.get(col).map_or("text", String::as_str)
            )
        };
        let mut params: Vec<Option<String>> = Vec::new();
        let sql = match op {
            Operation::Truncate => {
                let mut sql = format!("TRUNCATE {}", table.qualified);
                if row.truncate_restart_identity {
                    sql.push_str(" RESTART IDENTITY");
                }
                if row.truncate_cascade {
                    sql.push_str(" CASCADE");
                }
                self.client.batch_execute(&sql).await?;
                return Ok(());
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
                    return Err(Refusal(format!(
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
            Operation::Unspecified => return Err(Refusal("unspecified operation".into())),
        };
        let statement = self.statement(sql, params.len()).await?;
        let refs: Vec<&(dyn ToSql + Sync)> =
            params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
        let n = self.client.execute(&statement, &refs).await?;
        if n != 1 {
            return Err(Refusal(format!(
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

/// A column value as text for `$n::text::type`; NULL as None.
fn text_of(v: &envelope::Value) -> Result<Option<String>, Refusal> {
    Ok(match &v.kind {
        Some(value::Kind::Null(_)) => None,
        Some(value::Kind::Text(s)) => Some(s.clone()),
        Some(value::Kind::Boolean(b)) => Some(b.to_string()),
        Some(value::Kind::Int64(i)) => Some(i.to_string()),
        Some(value::Kind::Float64(f)) => Some(f.to_string()),
        Some(value::Kind::Binary(_)) => {
            return Err(Refusal(
                "binary-format values are not supported by the Postgres applier yet".into(),
            ));
        }
        Some(value::Kind::UnchangedToast(_) | value::Kind::Absent(_)) | None => {
            return Err(Refusal(
                "a value the applier cannot write (unchanged TOAST in an insert, or absent)".into(),
            ));
        }
    })
}
