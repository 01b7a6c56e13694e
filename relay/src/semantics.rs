//! `trellara semantics`: tries to observe a source transaction half-applied
//! on the target while the flow applies.
//!
//! Beside capture and apply (on the same log), an observer reads the
//! target again and again, each time in one REPEATABLE READ snapshot: the
//! flow's checkpoint `C` and the current rows of every key the log window
//! around the applier's cursor writes. Rows and checkpoint commit together,
//! so in every snapshot each key must hold what the last write at or below
//! `C` left (absent after a delete), and a key whose first write in the
//! window lies above `C` and is an insert must be absent. A row showing a
//! write above `C` is a transaction visible before its checkpoint (half
//! applied, or applied out of order); a row missing a write at or below `C`
//! is a transaction the checkpoint claims but the reader cannot see. Either
//! is reported with the transaction, the table and the key.
//!
//! The window runs from 200 records before the applier's cursor to 200
//! records past `C`, read inside the snapshot after `C`.
//!
//! Limits, stated in the output: keys written before the window whose only
//! write in it lies above `C` as an update or delete cannot be judged (their
//! earlier value is not in the window); a table is not judged in a read
//! whose window holds a TRUNCATE of it; tables without a primary key or
//! replica identity index (or with REPLICA IDENTITY FULL) are not read;
//! columns are compared as text in UTC, so a target column of another type
//! than the source's (numeric(12,2) for numeric, jsonb for json) reads as a
//! difference.

use crate::flow::{FlowError, Watch};
use crate::log::{Log, storage::FsStorage};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tokio_postgres::Client;
use trellara_common::Lsn;
use trellara_common::envelope::{
    self, BeforeImage, Operation, RelationSchema, ReplicaIdentity, change, value,
};

/// Transactions read each side of the applier's cursor.
const WINDOW: u64 = 200;
/// Row writes a window may hold; past it the window is cut (memory bound).
const MAX_WRITES: usize = 50_000;
/// Findings kept for the report (all are counted).
const MAX_FINDINGS: usize = 20;

/// One observation that breaks atomicity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub commit_lsn: Lsn,
    pub xid: u64,
    pub table: String,
    pub key: String,
    pub checkpoint: Option<Lsn>,
    pub detail: String,
}

/// What the observer saw.
#[derive(Debug, Default, Clone)]
pub struct SemanticsReport {
    pub reads: u64,
    /// Reads whose window held transactions not applied yet: the reader
    /// looked while they were in flight.
    pub reads_in_flight: u64,
    /// Distinct checkpoints observed.
    pub checkpoints: u64,
    /// Row versions compared.
    pub rows_compared: u64,
    /// Keys the window could not judge (see the module limits).
    pub rows_unjudged: u64,
    /// Reads whose window grew past its bound before reaching past the
    /// checkpoint (the applier far behind the log): not judged.
    pub reads_unjudged: u64,
    pub violations: u64,
    pub findings: Vec<Finding>,
    /// Tables not read, and why.
    pub not_checked: BTreeMap<String, String>,
}

/// One write to one key in the window.
#[derive(Debug, Clone)]
struct Write {
    commit: u64,
    xid: u64,
    insert: bool,
    /// Column name -> text (None: NULL); None: the row was deleted.
    after: Option<Vec<(String, Option<String>)>>,
}

/// A table the window writes: its key columns and the writes by key.
#[derive(Debug, Default)]
struct TableWrites {
    keys: Vec<String>,
    columns: Vec<String>,
    by_key: BTreeMap<Vec<String>, Vec<Write>>,
    /// The window holds a TRUNCATE of the table.
    truncated: bool,
}

fn quote(name: &str) -> String {
    postgres_protocol::escape::escape_identifier(name)
}

fn text(v: &envelope::Value) -> Option<Option<String>> {
    match &v.kind {
        Some(value::Kind::Null(_)) => Some(None),
        Some(value::Kind::Text(s)) => Some(Some(s.clone())),
        // As the type's output function writes it (what the reader fetches).
        Some(value::Kind::Boolean(b)) => Some(Some(if *b { "t" } else { "f" }.into())),
        Some(value::Kind::Int64(i)) => Some(Some(i.to_string())),
        // Unchanged TOAST, absent, binary, floats (their text depends on
        // settings): nothing to compare.
        _ => None,
    }
}

/// The observer: one target session, the flow's name, what it found.
#[derive(Debug)]
pub struct Observer {
    target: Client,
    flow: String,
    /// The log cursor of the sink whose target is read (the flow's first).
    cursor: String,
    pause: Duration,
    types: HashMap<String, HashMap<String, String>>,
    last_checkpoint: Option<Lsn>,
    pub report: SemanticsReport,
}

impl Observer {
    /// `target` must use the capture session's TimeZone (UTC) so time
    /// values compare as text: see [`Observer::prepare`].
    pub fn new(target: Client, flow: &str, cursor: String) -> Self {
        Observer {
            target,
            flow: flow.to_owned(),
            cursor,
            pause: Duration::from_millis(5),
            types: HashMap::new(),
            last_checkpoint: None,
            report: SemanticsReport::default(),
        }
    }

    /// The writes of the log from `WINDOW` records before `cursor` (the
    /// applier's, read before the checkpoint, so at or below it) to `WINDOW`
    /// records past the checkpoint `c`. None when the window would exceed
    /// `MAX_WRITES` before reaching past `c` (the read is not judged).
    fn window(
        &mut self,
        log: &Log<FsStorage>,
        cursor: u64,
        c: u64,
    ) -> Result<Option<BTreeMap<String, TableWrites>>, FlowError> {
        let from = cursor.saturating_sub(WINDOW).max(log.first_offset());
        let mut tables: BTreeMap<String, TableWrites> = BTreeMap::new();
        let mut writes = 0usize;
        let mut past = 0u64;
        for record in log.read_from(from)? {
            let record = record?;
            if record.commit_lsn > c {
                past += 1;
                if past > WINDOW {
                    break;
                }
            }
            if writes >= MAX_WRITES {
                if past == 0 {
                    return Ok(None);
                }
                break;
            }
            let Ok(env) = envelope::decode(&record.payload) else {
                continue;
            };
            for ch in &env.changes {
                let Some(change::Body::Row(row)) = &ch.body else {
                    continue;
                };
                let Some(relation) = env
                    .relations
                    .iter()
                    .find(|r| r.relation_id == row.relation_id)
                else {
                    continue;
                };
                let name = format!("{}.{}", quote(&relation.namespace), quote(&relation.name));
                if relation.replica_identity == ReplicaIdentity::Full as i32
                    || !relation.columns.iter().any(|c| c.key)
                {
                    // FULL identity marks every column a key: duplicates and
                    // types without equality make rows unfindable by it.
                    self.report.not_checked.insert(
                        name,
                        "no primary key or replica identity index to find rows by".into(),
                    );
                    continue;
                }
                let entry = tables.entry(name).or_insert_with(|| table_writes(relation));
                if row.operation == Operation::Truncate as i32 {
                    // Every key changes at once: the table is not judged
                    // row by row in a window holding a truncate.
                    entry.truncated = true;
                    continue;
                }
                for (key, write) in write_of(relation, row, env.commit_lsn, env.xid) {
                    entry.by_key.entry(key).or_default().push(write);
                    writes += 1;
                }
            }
        }
        Ok(Some(tables))
    }

    async fn column_types(&mut self, table: &str) -> Result<HashMap<String, String>, FlowError> {
        if let Some(t) = self.types.get(table) {
            return Ok(t.clone());
        }
        let rows = self
            .target
            .query(
                "SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute
                 WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
                &[&table],
            )
            .await?;
        let types: HashMap<String, String> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        self.types.insert(table.to_owned(), types.clone());
        Ok(types)
    }

    /// Sets the session up as capture's: UTC, ISO dates.
    pub async fn prepare(&self) -> Result<(), FlowError> {
        self.target.batch_execute("SET TimeZone = 'UTC'").await?;
        Ok(())
    }

    /// One read: the checkpoint and the window's keys in one snapshot.
    async fn read_once(&mut self, log: &Log<FsStorage>) -> Result<(), FlowError> {
        // The applier's cursor before the snapshot: at or below its
        // checkpoint, since the cursor moves only after the target commit.
        let cursor = log
            .cursor(&self.cursor)
            .map_or(log.first_offset(), |c| c.next_offset);
        self.target
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await?;
        let result = self.read_in_snapshot(log, cursor).await;
        let _ = self.target.batch_execute("COMMIT").await;
        result
    }

    async fn read_in_snapshot(
        &mut self,
        log: &Log<FsStorage>,
        cursor: u64,
    ) -> Result<(), FlowError> {
        let checkpoint = crate::state::checkpoint::applied(&self.target, &self.flow).await?;
        let c = checkpoint.map_or(0, |l| l.0);
        if checkpoint != self.last_checkpoint {
            self.report.checkpoints += 1;
            self.last_checkpoint = checkpoint;
        }
        let Some(window) = self.window(log, cursor, c)? else {
            self.report.reads_unjudged += 1;
            return Ok(());
        };
        let mut types = HashMap::new();
        for table in window.keys() {
            types.insert(table.clone(), self.column_types(table).await?);
        }
        self.report.reads += 1;
        let mut in_flight = false;
        for (table, writes) in &window {
            let Some(types) = types.get(table).filter(|t| !t.is_empty()) else {
                self.report
                    .not_checked
                    .insert(table.clone(), "missing on the target".into());
                continue;
            };
            if writes.truncated {
                self.report.rows_unjudged += writes.by_key.len() as u64;
                continue;
            }
            in_flight |= writes.by_key.values().flatten().any(|w| w.commit > c);
            let rows = self.fetch(table, writes, types).await?;
            for (key, history) in &writes.by_key {
                let expected = history.iter().rev().find(|w| w.commit <= c);
                let actual = rows.get(key);
                let verdict = match expected {
                    Some(w) => compare(w.after.as_ref(), actual),
                    None if history.first().is_some_and(|w| w.insert) => compare(None, actual),
                    None => {
                        self.report.rows_unjudged += 1;
                        continue;
                    }
                };
                self.report.rows_compared += 1;
                if let Err(detail) = verdict {
                    // Which transaction does the row show instead?
                    let ahead = history
                        .iter()
                        .find(|w| w.commit > c && compare(w.after.as_ref(), actual).is_ok());
                    let (culprit, what) = match (ahead, expected) {
                        (Some(w), _) => (
                            w,
                            "visible before the checkpoint says it is applied".to_owned(),
                        ),
                        (None, Some(w)) => (
                            w,
                            "applied per the checkpoint, but the reader cannot see it".to_owned(),
                        ),
                        (None, None) => match history.first() {
                            Some(w) => (w, "a row the source had not yet written".to_owned()),
                            None => continue,
                        },
                    };
                    self.report.violations += 1;
                    if self.report.findings.len() < MAX_FINDINGS {
                        self.report.findings.push(Finding {
                            commit_lsn: Lsn(culprit.commit),
                            xid: culprit.xid,
                            table: table.clone(),
                            key: key.join(", "),
                            checkpoint,
                            detail: format!("{what}: {detail}"),
                        });
                    }
                }
            }
        }
        if in_flight {
            self.report.reads_in_flight += 1;
        }
        Ok(())
    }

    /// The current rows of the window's keys, by key, as column texts.
    async fn fetch(
        &self,
        table: &str,
        writes: &TableWrites,
        types: &HashMap<String, String>,
    ) -> Result<HashMap<Vec<String>, Vec<(String, Option<String>)>>, FlowError> {
        let columns: Vec<&String> = writes
            .columns
            .iter()
            .filter(|c| types.contains_key(*c))
            .collect();
        // The type's output function (format's %s), as the source wrote
        // the values; a plain ::text cast differs for some types (boolean).
        let select: Vec<String> = columns
            .iter()
            .map(|c| {
                let c = quote(c);
                format!("CASE WHEN {c} IS NULL THEN NULL ELSE format('%s', {c}) END")
            })
            .collect();
        let keys: Vec<String> = writes.keys.iter().map(|k| quote(k)).collect();
        let unnest: Vec<String> = writes
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                format!(
                    "${}::text[]::{}[]",
                    i + 1,
                    types.get(k).map_or("text", String::as_str)
                )
            })
            .collect();
        let sql = format!(
            "SELECT {} FROM {table} WHERE ({}) IN (SELECT * FROM unnest({}))",
            select.join(", "),
            keys.join(", "),
            unnest.join(", ")
        );
        let mut params: Vec<Vec<String>> = vec![Vec::new(); writes.keys.len()];
        for key in writes.by_key.keys() {
            for (i, part) in key.iter().enumerate() {
                if let Some(p) = params.get_mut(i) {
                    p.push(part.clone());
                }
            }
        }
        let refs: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
            .iter()
            .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        let rows = self.target.query(&sql, &refs).await?;
        let key_index: Vec<usize> = writes
            .keys
            .iter()
            .filter_map(|k| columns.iter().position(|c| *c == k))
            .collect();
        let mut out = HashMap::new();
        for row in rows {
            let values: Vec<(String, Option<String>)> = columns
                .iter()
                .enumerate()
                .map(|(i, c)| ((*c).clone(), row.get::<_, Option<String>>(i)))
                .collect();
            let key: Vec<String> = key_index
                .iter()
                .map(|&i| values[i].1.clone().unwrap_or_default())
                .collect();
            out.insert(key, values);
        }
        Ok(out)
    }
}

fn table_writes(relation: &RelationSchema) -> TableWrites {
    TableWrites {
        keys: relation
            .columns
            .iter()
            .filter(|c| c.key)
            .map(|c| c.name.clone())
            .collect(),
        columns: relation.columns.iter().map(|c| c.name.clone()).collect(),
        by_key: BTreeMap::new(),
        truncated: false,
    }
}

/// The keys a row change writes and what it leaves there: a delete leaves
/// its key absent; an update that changes the key also leaves the old key
/// absent.
fn write_of(
    relation: &RelationSchema,
    row: &envelope::RowChange,
    commit: u64,
    xid: u64,
) -> Vec<(Vec<String>, Write)> {
    let key_of = |values: &[envelope::Value]| -> Option<Vec<String>> {
        relation
            .columns
            .iter()
            .zip(values)
            .filter(|(c, _)| c.key)
            .map(|(_, v)| text(v).flatten())
            .collect()
    };
    let gone = |key| {
        (
            key,
            Write {
                commit,
                xid,
                insert: false,
                after: None,
            },
        )
    };
    let mut out = Vec::new();
    let old = (row.before_kind != BeforeImage::None as i32)
        .then(|| key_of(&row.before))
        .flatten();
    if row.operation == Operation::Delete as i32 {
        out.extend(old.map(gone));
        return out;
    }
    let Some(key) = key_of(&row.after) else {
        return out;
    };
    if let Some(old) = old.filter(|o| *o != key) {
        out.push(gone(old));
    }
    let after = relation
        .columns
        .iter()
        .zip(&row.after)
        .filter_map(|(c, v)| text(v).map(|t| (c.name.clone(), t)))
        .collect();
    out.push((
        key,
        Write {
            commit,
            xid,
            insert: row.operation == Operation::Insert as i32,
            after: Some(after),
        },
    ));
    out
}

/// Whether `actual` shows `expected` (None: absent); the columns the write
/// carries are compared, others (unchanged TOAST) are not.
fn compare(
    expected: Option<&Vec<(String, Option<String>)>>,
    actual: Option<&Vec<(String, Option<String>)>>,
) -> Result<(), String> {
    match (expected, actual) {
        (None, None) => Ok(()),
        (None, Some(_)) => Err("the row is present".into()),
        (Some(_), None) => Err("the row is missing".into()),
        (Some(want), Some(have)) => {
            for (column, value) in want {
                let got = have.iter().find(|(c, _)| c == column).map(|(_, v)| v);
                if let Some(got) = got
                    && got != value
                {
                    return Err(format!(
                        "{column} is {}, expected {}",
                        got.as_deref().unwrap_or("NULL"),
                        value.as_deref().unwrap_or("NULL")
                    ));
                }
            }
            Ok(())
        }
    }
}

impl Watch for Observer {
    async fn watch(
        &mut self,
        log: &Log<FsStorage>,
        applied: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), FlowError> {
        let mut step = 0u64;
        loop {
            let finished = *applied.borrow();
            self.read_once(log).await?;
            if finished {
                return Ok(());
            }
            // Vary the moment of each read against the applier's commits.
            step = step.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let jitter = Duration::from_micros(step >> 54);
            tokio::time::sleep(self.pause + jitter).await;
        }
    }
}
