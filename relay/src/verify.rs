//! `trellara verify`: CONVERGED with evidence, or a named divergence with
//! its recovery command. There is no third answer.
//!
//! Per table it compares row counts and an order-independent checksum: the
//! sum of a 60-bit hash of each row's canonical text (key and covered
//! columns), computed in SQL on both sides under the same session settings.
//! A keyed table larger than `chunk_rows` is aggregated in key-range chunks
//! of about that many rows (bounds found by walking the key index), so no
//! query scans the whole table; the chunks' sums add up to the table's.
//! A mismatch is narrowed by key range: a mismatching chunk is cut into 16
//! by the source's key order (ntile), each compared on the target over the
//! same range, and a mismatching one cut again, so the report names the
//! diverging key range. It also checks watermarks (nothing left in
//! the log past the applier, nothing captured-pending in the slot), the
//! snapshot handoff state and quarantine, and reports duplicate accounting.
//!
//! Verify alone promotes a run from stream_handoff_ready to verified, and
//! demotes verified to failed_recoverable on new evidence of divergence.

use crate::config::{Flow, quote_table};
use crate::log::{Log, LogConfig, storage::FsStorage};
use crate::state::SnapshotState;
use serde::Serialize;
use std::collections::HashMap;
use std::path::Path;
use tokio_postgres::Client;

#[derive(Debug, Clone, Serialize)]
pub struct TableEvidence {
    pub table: String,
    pub key: Vec<String>,
    pub source_rows: i64,
    pub target_rows: i64,
    pub source_checksum: String,
    pub target_checksum: String,
    /// Key-range chunks the table was aggregated in (1: one scan).
    pub chunks: usize,
    /// Key ranges whose rows differ, narrowest found.
    pub diverging_ranges: Vec<String>,
    /// What could not be checked, stated exactly.
    pub limits: Vec<String>,
    /// Source columns the target's table lacks: the rows are compared on
    /// the columns both have.
    pub missing_on_target: Vec<String>,
    /// Target columns the source's table lacks (not compared), each with
    /// the schema change that explains it, if one does.
    pub target_only: Vec<TargetColumn>,
}

/// A column only the target's table has.
#[derive(Debug, Clone, Serialize)]
pub struct TargetColumn {
    pub column: String,
    /// The accepted change that dropped it on the source (`drop_column at
    /// LSN`); None: no schema change of the flow explains it (a column of
    /// the target's own, or one changed by hand).
    pub explained_by: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Divergence {
    pub code: &'static str,
    pub detail: String,
    pub recovery: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub flow: String,
    /// The sink compared (its dataset_id): the flow's name for a flow of
    /// one target.
    pub sink: String,
    pub result: &'static str,
    pub tables: Vec<TableEvidence>,
    pub divergences: Vec<Divergence>,
    pub target_watermark: Option<String>,
    pub snapshot_state: Option<String>,
    pub consistent_lsn: Option<String>,
    pub transactions_applied: i64,
    pub duplicates_skipped: i64,
    /// `--table`: the one table compared. Such a verdict moves no state.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub only_table: Option<String>,
    /// What is worth knowing but is no divergence (a sequence behind).
    pub notes: Vec<String>,
    /// A following flow was compared at this source position (the fence,
    /// [`crate::fence`]): both sides hold exactly the transactions
    /// committing before it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fenced_at: Option<String>,
    /// How long the fence held the flow's apply, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apply_held_ms: Option<u64>,
}

/// How verify reaches a flow that follows, to fence it.
#[derive(Debug, Clone, Copy)]
pub struct Following<'a> {
    /// For the fence's replication session.
    pub source_url: &'a str,
    pub timeout: std::time::Duration,
}

impl VerifyError {
    /// A database error met while comparing `table`, named with it.
    fn in_table(self, table: &str) -> Self {
        let (side, e) = match self {
            VerifyError::Source(e) => ("source", e),
            VerifyError::Target(e) => ("target", e),
            other => return other,
        };
        let db = e.as_db_error();
        let hint = match db.map(|d| d.code().code()) {
            // undefined_table, undefined_column, datatype_mismatch
            Some("42P01" | "42703" | "42804") => format!(
                "the {side}'s {table} does not have what the source's has; `trellara preflight --config` names the difference"
            ),
            Some("42501") => format!("grant the role SELECT on {table} on the {side}"),
            _ => format!("check that the {side} is reachable and rerun verify"),
        };
        VerifyError::Table {
            table: table.to_owned(),
            side,
            message: db.map_or_else(|| e.to_string(), |d| d.message().to_owned()),
            hint,
        }
    }
}

impl Verdict {
    pub fn converged(&self) -> bool {
        self.divergences.is_empty()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("source database")]
    Source(#[source] tokio_postgres::Error),
    #[error("target database")]
    Target(#[source] tokio_postgres::Error),
    #[error(transparent)]
    Log(#[from] crate::log::Error),
    #[error("table {0} is not schema.table")]
    BadTable(String),
    #[error("the flow's snapshot state on the target: {0}")]
    State(String),
    #[error(transparent)]
    Horizon(#[from] crate::horizon::HorizonError),
    #[error("compare {table} on the {side}: {message}\nhint: {hint}")]
    Table {
        table: String,
        side: &'static str,
        message: String,
        hint: String,
    },
    #[error(transparent)]
    Fence(#[from] crate::fence::FenceError),
    #[error(
        "table {table} changed on the {side} (a DDL committed) while verify compared it at the fence {at}, so its rows were not judged\nhint: run verify again once the change is through; a change the flow cannot take stops it (trellara status)"
    )]
    SchemaMoved {
        table: String,
        side: &'static str,
        at: String,
    },
    #[error(transparent)]
    Following(#[from] crate::fence::Following),
    #[error("lock the log directory {path} to read it\nhint: check that this user may write there")]
    LogLock {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Verify's sessions: text forms that compare, and no statement bound (a
/// checksum over a large table runs as long as it takes).
const SESSION: &str = "SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'; SET IntervalStyle = 'postgres'; \
                       SET extra_float_digits = 3; SET bytea_output = 'hex'; SET lc_monetary = 'C'; \
                       SET statement_timeout = 0";

/// Columns of a table (canonical order) and its key columns as (quoted
/// name, type) (primary key, else the replica identity index), read from
/// the source.
async fn shape(
    source: &Client,
    qualified: &str,
) -> Result<(Vec<String>, Vec<(String, String)>), VerifyError> {
    let columns = source
        .query(
            "SELECT quote_ident(attname) FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            &[&qualified],
        )
        .await
        .map_err(VerifyError::Source)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let key = source
        .query(
            "SELECT quote_ident(a.attname), format_type(a.atttypid, a.atttypmod)
             FROM pg_index i
             JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) ON true
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
             WHERE i.indrelid = to_regclass($1) AND (i.indisprimary OR i.indisreplident)
             ORDER BY i.indisprimary DESC, k.n",
            &[&qualified],
        )
        .await
        .map_err(VerifyError::Source)?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect::<Vec<(String, String)>>();
    let mut dedup = Vec::new();
    for k in key {
        if !dedup.contains(&k) {
            dedup.push(k);
        }
    }
    Ok((columns, dedup))
}

/// The collation of each collatable column of `qualified` (quoted name →
/// collation), the database's own resolved for `default`.
async fn collations(
    client: &Client,
    qualified: &str,
) -> Result<HashMap<String, String>, tokio_postgres::Error> {
    // The ICU locale column is daticulocale on 15-16 and datlocale from 17.
    let rows = client
        .query(
            "SELECT quote_ident(a.attname),
                    CASE WHEN c.collname = 'default' THEN
                        (SELECT concat_ws(':', j->>'datlocprovider', coalesce(j->>'datlocale', j->>'daticulocale'), j->>'datcollate')
                         FROM pg_database d, to_jsonb(d) j WHERE d.datname = current_database())
                    ELSE c.collname END
             FROM pg_attribute a JOIN pg_collation c ON c.oid = a.attcollation
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
            &[&qualified],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The key as chunk bounds and ranges compare it. Both sides must order
/// the key alike, or the ranges found on the source would overlap or
/// leave gaps on the target: where a key column's collation differs, every
/// collatable key column is compared in `C` order on both sides (then the
/// bounds are found by sorting rather than walking the key's index).
async fn ordered_key(
    source: &Client,
    target: &Client,
    qualified: &str,
    key: Vec<(String, String)>,
) -> Result<Vec<(String, String)>, VerifyError> {
    let on_source = collations(source, qualified)
        .await
        .map_err(VerifyError::Source)?;
    let on_target = collations(target, qualified)
        .await
        .map_err(VerifyError::Target)?;
    if key
        .iter()
        .all(|(k, _)| on_source.get(k) == on_target.get(k))
    {
        return Ok(key);
    }
    tracing::info!(
        table = qualified,
        "key collations differ between source and target: comparing keys in C order"
    );
    Ok(key
        .into_iter()
        .map(|(k, ty)| {
            if on_source.contains_key(&k) || on_target.contains_key(&k) {
                (format!("({k} COLLATE \"C\")"), ty)
            } else {
                (k, ty)
            }
        })
        .collect())
}

/// `count(*)` and the checksum of the rows `from` holds (see
/// [`rows_of`](crate::snapshot::rows_of)) where `filter` holds.
async fn aggregate(
    client: &Client,
    from: &str,
    columns: &str,
    filter: &str,
) -> Result<(i64, String), tokio_postgres::Error> {
    let row = client
        .query_one(
            &format!(
                "SELECT count(*), coalesce(sum(('x' || substr(md5(convert_to(ROW({columns})::text, 'UTF8')), 1, 15))::bit(60)::bigint::numeric), 0)::text
                 FROM {from} t WHERE {filter}"
            ),
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// Key-range chunks of the source: the first and last key of each of `n`
/// chunks in key order, as text per key column.
async fn chunks(
    source: &Client,
    from: &str,
    key: &[(String, String)],
    filter: &str,
    n: i32,
) -> Result<Vec<(Vec<String>, Vec<String>)>, tokio_postgres::Error> {
    let names: Vec<&str> = key.iter().map(|(k, _)| k.as_str()).collect();
    let key_names = names.join(", ");
    let text_key: Vec<String> = names.iter().map(|k| format!("{k}::text")).collect();
    let desc: Vec<String> = names.iter().map(|k| format!("{k} DESC")).collect();
    let bucketed = format!(
        "(SELECT {key_names}, ntile({n}) OVER (ORDER BY {key_names}) AS b FROM {from} t WHERE {filter}) s"
    );
    let bound = |order: &str| {
        format!(
            "SELECT DISTINCT ON (b) ARRAY[{}] FROM {bucketed} ORDER BY b, {order}",
            text_key.join(", ")
        )
    };
    let lows = source.query(&bound(&key_names), &[]).await?;
    let highs = source.query(&bound(&desc.join(", ")), &[]).await?;
    Ok(lows
        .iter()
        .zip(&highs)
        .map(|(l, h)| (l.get::<_, Vec<String>>(0), h.get::<_, Vec<String>>(0)))
        .collect())
}

/// `'v1'::t1, 'v2'::t2` for a key's text values.
fn key_literal(key: &[(String, String)], values: &[String]) -> String {
    values
        .iter()
        .zip(key)
        .map(|(v, (_, ty))| format!("'{}'::{ty}", v.replace('\'', "''")))
        .collect::<Vec<_>>()
        .join(", ")
}

fn key_names(key: &[(String, String)]) -> String {
    key.iter()
        .map(|(n, _)| n.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// `ROW(k1, k2) BETWEEN ROW('lo1'::t1, ...) AND ROW('hi1'::t1, ...)`.
fn key_range(key: &[(String, String)], lo: &[String], hi: &[String]) -> String {
    format!(
        "ROW({}) BETWEEN ROW({}) AND ROW({})",
        key_names(key),
        key_literal(key, lo),
        key_literal(key, hi)
    )
}

/// Filters covering every key in chunks of `chunk_rows` source rows:
/// `ROW(k) <= hi1`, `ROW(k) > hi1 AND ROW(k) <= hi2`, ..., `ROW(k) > hiN`
/// (open at both ends, so target rows outside the source's keys are
/// covered too). Each bound is found by an index walk of `chunk_rows` keys;
/// a table with fewer rows is one range (`true`).
async fn chunk_filters(
    source: &Client,
    from: &str,
    key: &[(String, String)],
    chunk_rows: u64,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let names = key_names(key);
    let text_key: Vec<String> = key.iter().map(|(k, _)| format!("{k}::text")).collect();
    let mut filters = Vec::new();
    let mut lower: Option<String> = None;
    loop {
        let above = lower
            .as_deref()
            .map_or("true".to_owned(), |lo| format!("ROW({names}) > ROW({lo})"));
        let bound = source
            .query_opt(
                &format!(
                    "SELECT ARRAY[{}] FROM {from} WHERE {above} ORDER BY {names} OFFSET {} LIMIT 1",
                    text_key.join(", "),
                    chunk_rows.saturating_sub(1)
                ),
                &[],
            )
            .await?;
        let Some(bound) = bound else {
            filters.push(above);
            return Ok(filters);
        };
        let above = if lower.is_none() {
            // The first chunk is open below.
            String::new()
        } else {
            format!("{above} AND ")
        };
        let hi = key_literal(key, &bound.get::<_, Vec<String>>(0));
        filters.push(format!("{above}ROW({names}) <= ROW({hi})"));
        lower = Some(hi);
    }
}

/// Adds two checksum sums (decimal text; they outgrow i64 on big tables).
fn add_sums(a: &str, b: &str) -> String {
    let parse = |s: &str| s.parse::<i128>().unwrap_or(0);
    (parse(a) + parse(b)).to_string()
}

async fn verify_table(
    source: &Client,
    target: &Client,
    table: &str,
    chunk_rows: u64,
) -> Result<TableEvidence, VerifyError> {
    let qualified = quote_table(table).ok_or_else(|| VerifyError::BadTable(table.to_owned()))?;
    let (columns, key) = shape(source, &qualified).await?;
    // Compared on the columns both sides have: a change not applied on
    // this sink yet (held) is named, not a query error.
    let on_target_columns: Vec<(String, String)> = target
        .query(
            "SELECT attname::text, quote_ident(attname) FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            &[&qualified],
        )
        .await
        .map_err(VerifyError::Target)?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let (columns, missing_on_target): (Vec<String>, Vec<String>) =
        columns.into_iter().partition(|c| {
            on_target_columns.is_empty() || on_target_columns.iter().any(|(_, q)| q == c)
        });
    let target_only: Vec<TargetColumn> = on_target_columns
        .iter()
        .filter(|(_, q)| !columns.contains(q) && !missing_on_target.contains(q))
        .map(|(name, _)| TargetColumn {
            column: name.clone(),
            explained_by: None,
        })
        .collect();
    let key_columns: Vec<String> = key.iter().map(|(n, _)| n.clone()).collect();
    let key = ordered_key(source, target, &qualified, key).await?;
    let on_source = crate::snapshot::rows_of(source, &qualified)
        .await
        .map_err(VerifyError::Source)?;
    let on_target = crate::snapshot::rows_of(target, &qualified)
        .await
        .map_err(VerifyError::Target)?;
    let list = columns.join(", ");
    let mut filters = if key.is_empty() {
        vec!["true".to_owned()]
    } else {
        chunk_filters(source, &on_source, &key, chunk_rows)
            .await
            .map_err(VerifyError::Source)?
    };
    let key_ranges = filters.len();
    if key_ranges > 1 {
        // A key range holds no row with a NULL key, which only a target
        // without the key's NOT NULL can have: one more range for those.
        let null = key_columns
            .iter()
            .map(|k| format!("{k} IS NULL"))
            .collect::<Vec<_>>()
            .join(" OR ");
        // A partly NULL composite key can still compare within a range
        // (the first column decides): each row in exactly one of them.
        for filter in &mut filters {
            *filter = format!("{filter} AND NOT ({null})");
        }
        filters.push(format!("({null})"));
    }
    let mut evidence = TableEvidence {
        table: table.to_owned(),
        key: key_columns,
        source_rows: 0,
        target_rows: 0,
        source_checksum: "0".into(),
        target_checksum: "0".into(),
        chunks: key_ranges,
        diverging_ranges: Vec::new(),
        limits: Vec::new(),
        missing_on_target,
        target_only,
    };
    let mut mismatched = Vec::new();
    for filter in filters {
        let (s_rows, s_sum) = aggregate(source, &on_source, &list, &filter)
            .await
            .map_err(VerifyError::Source)?;
        let (t_rows, t_sum) = aggregate(target, &on_target, &list, &filter)
            .await
            .map_err(VerifyError::Target)?;
        if (s_rows, &s_sum) != (t_rows, &t_sum) {
            mismatched.push(filter);
        }
        evidence.source_rows += s_rows;
        evidence.target_rows += t_rows;
        evidence.source_checksum = add_sums(&evidence.source_checksum, &s_sum);
        evidence.target_checksum = add_sums(&evidence.target_checksum, &t_sum);
    }
    if key.is_empty() {
        evidence.limits.push(
            "no primary key or replica identity index: the checksum covers every column but a divergence cannot be narrowed to a key range".into(),
        );
    }
    if mismatched.is_empty() || key.is_empty() {
        return Ok(evidence);
    }
    // Narrow it down: two rounds of 16 key-range chunks within each
    // mismatching chunk.
    let mut ranges = mismatched;
    for _ in 0..2 {
        let mut narrower = Vec::new();
        for filter in &ranges {
            for (lo, hi) in chunks(source, &on_source, &key, filter, 16)
                .await
                .map_err(VerifyError::Source)?
            {
                let range = key_range(&key, &lo, &hi);
                let s = aggregate(source, &on_source, &list, &range)
                    .await
                    .map_err(VerifyError::Source)?;
                let t = aggregate(target, &on_target, &list, &range)
                    .await
                    .map_err(VerifyError::Target)?;
                if s != t {
                    narrower.push(range);
                }
            }
        }
        if narrower.is_empty() {
            break;
        }
        ranges = narrower;
    }
    if ranges == ["true"] {
        evidence
            .diverging_ranges
            .push("outside the source's key range (rows only on the target)".into());
    } else {
        evidence.diverging_ranges = ranges;
    }
    Ok(evidence)
}

/// Rows per key-range chunk of the whole-table aggregate by default.
pub const CHUNK_ROWS: u64 = 1_000_000;

/// The commands a divergence's recovery names.
struct Commands {
    run: String,
    reseed: String,
    /// `schema accept` up to its `--table`.
    accept: String,
    /// What to do when a running process holds what verify must read.
    busy: String,
}

impl Commands {
    fn of(flow: &Flow, config_path: &str) -> Self {
        Commands {
            run: format!("trellara run --config {config_path} --flow {}", flow.name),
            reseed: format!(
                "trellara reseed --config {config_path} --flow {}",
                flow.name
            ),
            accept: format!(
                "trellara schema accept --config {config_path} --flow {} --table",
                flow.name
            ),
            busy: format!(
                "stop the trellara process running flow {} (run --follow or relay), then rerun verify",
                flow.name
            ),
        }
    }
}

/// Runs every check for `flow` and records the verdict in the target. A
/// flow that follows is compared at a fence when `following` says how.
pub async fn verify(
    flow: &Flow,
    (sink, following): (&str, Option<Following<'_>>),
    source: &Client,
    target: &Client,
    only_table: Option<&str>,
    config_path: &str,
    chunk_rows: u64,
) -> Result<Verdict, VerifyError> {
    source
        .batch_execute(SESSION)
        .await
        .map_err(VerifyError::Source)?;
    target
        .batch_execute(SESSION)
        .await
        .map_err(VerifyError::Target)?;
    // The run as it was before anything was compared: the verdict moves
    // this run's state only.
    let snapshot = crate::snapshot::load(target, &flow.name)
        .await
        .map_err(state_error)?;
    let commands = Commands::of(flow, config_path);
    let cursor = crate::apply::sink_cursor(&flow.name, sink);
    let fence = match (crate::fence::followed_log(flow, target).await?, following) {
        (Some(dir), Some(following)) => Some(
            crate::fence::take(
                flow,
                (dir, &cursor),
                (following.source_url, source, target),
                following.timeout,
            )
            .await?,
        ),
        _ => None,
    };
    // Everything committed before verify started, however it was
    // committed: the slot is peeked once it is flushed (crate::horizon).
    // A fence makes the two sides' positions one.
    let horizon = match fence {
        Some(_) => None,
        None => Some(crate::horizon::last_record_end(source).await?),
    };
    let mut divergences = Vec::new();
    let tables = compare_tables(
        flow,
        source,
        target,
        only_table,
        chunk_rows,
        &commands,
        &mut divergences,
    )
    .await?;
    let checkpoint = crate::state::checkpoint::read(target, &flow.name)
        .await
        .map_err(VerifyError::Target)?;
    match horizon {
        Some(horizon) => {
            watermarks(
                flow,
                (source, target),
                &cursor,
                horizon,
                &commands,
                &mut divergences,
            )
            .await?;
        }
        None => {
            let at = fence.map(|f| f.at.to_string()).unwrap_or_default();
            // A snapshot reads the catalog as of its start, a table's rows
            // through its current file: a DDL that rewrote a table after
            // the fence (before verify first read it) shows its rows as
            // none, and would be a false divergence.
            let seen = catalog_stamps(flow, only_table, source, target).await?;
            // The fence's snapshots end here; what follows reads no rows.
            source
                .batch_execute("COMMIT")
                .await
                .map_err(VerifyError::Source)?;
            target
                .batch_execute("COMMIT")
                .await
                .map_err(VerifyError::Target)?;
            crate::fence::forget(target, flow).await;
            let now = catalog_stamps(flow, only_table, source, target).await?;
            if let Some((moved, _)) = seen.iter().zip(&now).find(|(a, b)| a != b) {
                return Err(VerifyError::SchemaMoved {
                    table: moved.table.clone(),
                    side: moved.side,
                    at,
                });
            }
        }
    }
    let quarantined = crate::state::quarantine::open(target, &flow.name)
        .await
        .map_err(VerifyError::Target)?;
    for q in &quarantined {
        divergences.push(Divergence {
            code: "QUARANTINED",
            detail: format!(
                "transaction at {} is quarantined: {}",
                q.commit_lsn, q.reason
            ),
            recovery: format!("fix the cause, then {}", commands.run),
        });
    }
    let state = snapshot.as_ref().map(|s| s.state);
    if !matches!(
        state,
        Some(SnapshotState::StreamHandoffReady | SnapshotState::Verified)
    ) {
        divergences.push(Divergence {
            code: "HANDOFF_INCOMPLETE",
            detail: format!(
                "the snapshot run is {}",
                state.map_or("missing", SnapshotState::as_str)
            ),
            recovery: commands.run.clone(),
        });
    }
    let mut verdict = Verdict {
        flow: flow.name.clone(),
        sink: sink.to_owned(),
        // Behind is lag, not a divergence: the rows cannot be judged
        // until the target has caught up, and the fix is a run.
        result: if divergences.is_empty() {
            "CONVERGED"
        } else if divergences.iter().any(|d| d.code == "WATERMARK_BEHIND") {
            "WATERMARK_BEHIND"
        } else {
            "DIVERGED"
        },
        tables,
        divergences,
        target_watermark: checkpoint.as_ref().map(|c| c.end_lsn.to_string()),
        snapshot_state: state.map(|s| s.as_str().to_owned()),
        consistent_lsn: snapshot
            .as_ref()
            .and_then(|s| s.consistent_lsn.map(|l| l.to_string())),
        transactions_applied: checkpoint.as_ref().map_or(0, |c| c.transactions),
        duplicates_skipped: checkpoint.as_ref().map_or(0, |c| c.duplicates_skipped),
        only_table: only_table.map(str::to_owned),
        notes: sequence_notes(flow, source, target, &commands).await,
        fenced_at: fence.map(|f| f.at.to_string()),
        apply_held_ms: fence.map(|f| u64::try_from(f.held.as_millis()).unwrap_or(u64::MAX)),
    };
    settle(flow, target, snapshot.as_ref(), &mut verdict).await?;
    let evidence = serde_json::to_string(&verdict).unwrap_or_default();
    crate::state::verdicts::record(target, &flow.name, verdict.result, &evidence)
        .await
        .map_err(VerifyError::Target)?;
    Ok(verdict)
}

fn state_error(e: crate::snapshot::SnapshotError) -> VerifyError {
    match e {
        crate::snapshot::SnapshotError::Target(t) => VerifyError::Target(t),
        other => VerifyError::State(other.to_string()),
    }
}

/// A table's catalog rows as one session sees them: what a DDL changes.
#[derive(Debug, PartialEq, Eq)]
struct Stamp {
    table: String,
    side: &'static str,
    /// Its pg_class row's xmin and file, its columns' xmins.
    catalog: Option<String>,
}

/// What a DDL of `qualified` changes, as `client`'s snapshot sees it: the
/// pg_class row's xmin and file and the columns' xmins of the table and of
/// each of its partitions (None: no table).
pub(crate) async fn catalog_stamp(
    client: &Client,
    qualified: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "WITH tree AS (SELECT to_regclass($1) AS relid UNION SELECT relid FROM pg_partition_tree(to_regclass($1)))
             SELECT string_agg(c.oid::text || ':' || c.xmin::text || '/' || c.relfilenode::text || '/'
                    || (SELECT string_agg(a.xmin::text, ',' ORDER BY a.attnum)
                        FROM pg_attribute a WHERE a.attrelid = c.oid), ';' ORDER BY c.oid)
             FROM tree t JOIN pg_class c ON c.oid = t.relid",
            &[&qualified],
        )
        .await?
        .get(0))
}

/// The [`Stamp`] of each compared table on both sides.
async fn catalog_stamps(
    flow: &Flow,
    only_table: Option<&str>,
    source: &Client,
    target: &Client,
) -> Result<Vec<Stamp>, VerifyError> {
    let mut stamps = Vec::new();
    for table in flow
        .tables
        .iter()
        .filter(|t| only_table.is_none_or(|o| o == t.as_str()))
    {
        let qualified = quote_table(table).ok_or_else(|| VerifyError::BadTable(table.clone()))?;
        for (side, client) in [("source", source), ("target", target)] {
            let catalog = catalog_stamp(client, &qualified)
                .await
                .map_err(|e| match side {
                    "source" => VerifyError::Source(e),
                    _ => VerifyError::Target(e),
                })?;
            stamps.push(Stamp {
                table: table.clone(),
                side,
                catalog,
            });
        }
    }
    Ok(stamps)
}

/// Compares each table of the flow (or `only_table`), adding a divergence
/// for each that differs.
async fn compare_tables(
    flow: &Flow,
    source: &Client,
    target: &Client,
    only_table: Option<&str>,
    chunk_rows: u64,
    commands: &Commands,
    divergences: &mut Vec<Divergence>,
) -> Result<Vec<TableEvidence>, VerifyError> {
    let Commands {
        run,
        reseed,
        accept,
        ..
    } = commands;
    let explains = crate::state::current(target)
        .await
        .map_err(VerifyError::Target)?;
    let mut tables = Vec::new();
    for table in flow
        .tables
        .iter()
        .filter(|t| only_table.is_none_or(|o| o == t.as_str()))
    {
        let mut e = verify_table(source, target, table, chunk_rows)
            .await
            .map_err(|e| e.in_table(table))?;
        for column in &mut e.target_only {
            if explains {
                column.explained_by =
                    crate::state::schema::dropped(target, &flow.name, table, &column.column)
                        .await
                        .map_err(VerifyError::Target)?
                        .map(|lsn| format!("drop_column at {lsn}"));
            }
            e.limits.push(match &column.explained_by {
                Some(change) => format!(
                    "target column {} was dropped on the source ({change}, accepted) and kept on the target: not compared",
                    column.column
                ),
                None => format!(
                    "target column {} is not on the source, and no schema change of the flow explains it (a column of the target's own?): not compared",
                    column.column
                ),
            });
        }
        if !e.missing_on_target.is_empty() {
            let missing = e.missing_on_target.join(", ");
            // Only a held change is the accept's to release; one the flow
            // has not met yet (it meets a table's change at its next row)
            // is in no quarantine.
            let held = explains
                && !crate::state::quarantine::holds(target, &flow.name, table)
                    .await
                    .map_err(VerifyError::Target)?
                    .is_empty();
            let (why, recovery) = if held {
                (
                    "a schema change held on this sink: see its quarantine",
                    format!(
                        "apply the change on the target, then `{accept} {table}` (or, the target's table made to take the source's columns, `{reseed} --table {table}` while the flow follows); or {reseed}"
                    ),
                )
            } else {
                (
                    "a schema change the flow has not met yet: it meets one at the table's next row change",
                    format!(
                        "let the flow take the table's next change, then verify again (a change it cannot take holds the sink, and `trellara status` names the fix); or {reseed}"
                    ),
                )
            };
            divergences.push(Divergence {
                code: "COLUMN_MISSING",
                detail: format!(
                    "{table}: the target has no column {missing} of the source's ({why}); the rows were compared on the columns both have"
                ),
                recovery,
            });
        }
        if e.source_rows != e.target_rows {
            divergences.push(Divergence {
                code: "ROW_COUNT_MISMATCH",
                detail: format!(
                    "{table}: source {} rows, target {}{}",
                    e.source_rows,
                    e.target_rows,
                    ranges(&e)
                ),
                recovery: format!("{run}; if it persists: {reseed}"),
            });
        } else if e.source_checksum != e.target_checksum {
            divergences.push(Divergence {
                code: "CHECKSUM_MISMATCH",
                detail: format!(
                    "{table}: same row count ({}), different content{}",
                    e.source_rows,
                    ranges(&e)
                ),
                recovery: format!("repair the named key range on the target or reseed: {reseed}"),
            });
        }
        tables.push(e);
    }
    Ok(tables)
}

/// The watermark checks: nothing durable past the applier (in the log, or
/// the topic), nothing committed before `horizon` pending in the slot.
async fn watermarks(
    flow: &Flow,
    (source, target): (&Client, &Client),
    cursor: &str,
    horizon: trellara_common::Lsn,
    commands: &Commands,
    divergences: &mut Vec<Divergence>,
) -> Result<(), VerifyError> {
    let lock = match flow.log_dir() {
        Some(dir) if dir.exists() => {
            crate::lock::try_lock(dir).map_err(|source| VerifyError::LogLock {
                path: dir.display().to_string(),
                source,
            })?
        }
        _ => None,
    };
    // What a running process holds cannot be read here, and a watermark
    // that is not checked is no convergence.
    match (flow.log_dir(), &lock) {
        (Some(dir), None) if dir.exists() => divergences.push(Divergence {
            code: "WATERMARK_UNVERIFIED",
            detail: match flow.transport {
                crate::config::Transport::Kafka { .. } => "the log was not read: a running trellara process (run --follow or relay) holds it, so what it captured but has not applied is unknown; a flow on the kafka transport is not fenced (its applier reads the topic, which carries no position record to hold it at)".to_owned(),
                crate::config::Transport::Local { .. } => "the log was not read: a running trellara process (run --follow or relay) holds it, so what it captured but has not applied is unknown".to_owned(),
            },
            recovery: commands.busy.clone(),
        }),
        (Some(dir), Some(_)) => {
            log_behind(flow, (dir, cursor), target, &commands.run, divergences).await?;
        }
        _ => {}
    }
    // Decoding sees flushed WAL only: an asynchronous commit not flushed
    // yet would be missed by the peek, and taken for a divergence.
    let patience = crate::horizon::flush_patience(source).await?;
    let flushed = crate::horizon::flushed_through(source, horizon, patience).await?;
    if !flushed {
        divergences.push(Divergence {
            code: "WATERMARK_UNVERIFIED",
            detail: format!(
                "the source did not flush its WAL through {horizon} within {} s, so the slot could not show every committed change",
                patience.as_secs()
            ),
            recovery: "check the source's walwriter and disk (pg_stat_wal), then rerun verify".into(),
        });
    }
    // Held until the slot is peeked: a process that took the log between
    // would stream the slot and move what was just read.
    let pending = slot_pending(flow, source).await;
    drop(lock);
    divergences.extend(pending_divergence(flow, pending, commands));
    Ok(())
}

/// What the log (and, store and forward, the topic) holds that the target
/// has not applied. The caller holds the log's lock.
async fn log_behind(
    flow: &Flow,
    (dir, cursor): (&Path, &str),
    target: &Client,
    run: &str,
    divergences: &mut Vec<Divergence>,
) -> Result<(), VerifyError> {
    let (log, _) = Log::open(FsStorage::new(), dir, LogConfig::default())?;
    let crate::config::Transport::Kafka { topic, .. } = &flow.transport else {
        divergences.extend(not_applied(&log, (cursor, flow.sinks().len() > 1), run));
        return Ok(());
    };
    // Store and forward: the log up to the publisher's cursor is in the
    // topic; the topic up to the checkpoint is applied.
    let published = log.cursor(&crate::transport::kafka::publisher_cursor(&flow.name));
    let next = published.map_or(log.first_offset(), |c| c.next_offset);
    divergences.extend(unread(
        &log,
        next,
        &format!("published to topic {topic}"),
        run,
    ));
    let applied = crate::state::checkpoint::applied(target, &flow.name)
        .await
        .map_err(VerifyError::Target)?;
    if let Some(last) = published.and_then(|c| c.last_commit_lsn)
        && applied.is_none_or(|a| a.0 < last)
    {
        divergences.push(Divergence {
            code: "WATERMARK_BEHIND",
            detail: format!(
                "topic {topic} holds transactions up to commit {} the target has not applied (checkpoint {})",
                trellara_common::Lsn(last),
                applied.map_or("none".to_owned(), |a| a.to_string())
            ),
            recovery: run.to_owned(),
        });
    }
    Ok(())
}

/// What the log holds past the sink's cursor `cursor`. Of `several`
/// sinks, one whose cursor is gone from a log with records (dropped when
/// it held the log past `transport.retention_mib`, or the sinks
/// reordered) cannot resume: the next run copies it again at a boundary
/// of its own, and the verdict says so rather than counting the log's
/// records as a backlog it will apply. A flow's only sink applies the log
/// from its start.
fn not_applied(
    log: &Log<FsStorage>,
    (cursor, several): (&str, bool),
    run: &str,
) -> Option<Divergence> {
    match log.cursor(cursor) {
        Some(at) => unread(log, at.next_offset, "applied", run),
        None if !several => unread(log, log.first_offset(), "applied", run),
        None if log.next_offset() > log.first_offset() => Some(Divergence {
            code: "WATERMARK_BEHIND",
            detail: format!(
                "the sink's cursor {cursor} is not in the log (it was dropped when the sink held the log past transport.retention_mib, or the sinks were reordered), so the sink cannot resume; the next run copies it again at a boundary of its own"
            ),
            recovery: run.to_owned(),
        }),
        None => None,
    }
}

/// The log's records from `next` on, which are not `done` yet.
fn unread(log: &Log<FsStorage>, next: u64, done: &str, run: &str) -> Option<Divergence> {
    let end = log.next_offset();
    (next < end).then(|| Divergence {
        code: "WATERMARK_BEHIND",
        detail: format!(
            "{} captured transactions are not {done} yet (log offsets {next}..{end})",
            end - next
        ),
        recovery: run.to_owned(),
    })
}

/// Peeks the slot with its own plugin (pgoutput with the publication, or
/// the native plugin restricted to the flow's tables) for one change.
async fn slot_pending(
    flow: &Flow,
    source: &Client,
) -> Result<Option<tokio_postgres::Row>, tokio_postgres::Error> {
    match flow.capture {
        crate::config::CapturePath::External => {
            source
                .query_opt(
                    "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, 1, 'proto_version', '1', 'publication_names', $2)",
                    &[&flow.slot(), &flow.publication()],
                )
                .await
        }
        crate::config::CapturePath::Native => {
            source
                .query_opt(
                    "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, 1, 'source_id', $2, 'tables', $3)",
                    &[&flow.slot(), &flow.source_id(), &flow.tables.join(",")],
                )
                .await
        }
    }
}

fn pending_divergence(
    flow: &Flow,
    pending: Result<Option<tokio_postgres::Row>, tokio_postgres::Error>,
    commands: &Commands,
) -> Option<Divergence> {
    match pending {
        Ok(Some(r)) if r.get::<_, i64>(0) > 0 => Some(Divergence {
            code: "WATERMARK_BEHIND",
            detail: format!(
                "slot {} holds committed changes not yet captured",
                flow.slot()
            ),
            recovery: commands.run.clone(),
        }),
        Ok(_) => None,
        // object_in_use: our relay is streaming the slot right now.
        Err(e) if e.as_db_error().is_some_and(|d| d.code().code() == "55006") => Some(Divergence {
            code: "WATERMARK_UNVERIFIED",
            detail: format!(
                "slot {} is being streamed, so its uncaptured changes could not be peeked",
                flow.slot()
            ),
            recovery: commands.busy.clone(),
        }),
        Err(e) => Some(Divergence {
            code: "WATERMARK_UNVERIFIED",
            detail: format!(
                "could not check slot {} for uncaptured changes: {}",
                flow.slot(),
                e.as_db_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_owned())
            ),
            recovery: format!(
                "make sure slot {} exists and the role may read it, then rerun verify",
                flow.slot()
            ),
        }),
    }
}

/// Sequences are not transactional: one behind is a note, not a
/// divergence.
async fn sequence_notes(
    flow: &Flow,
    source: &Client,
    target: &Client,
    commands: &Commands,
) -> Vec<String> {
    let run = &commands.run;
    match crate::sequences::owned(flow, source, target).await {
        Ok(owned) => owned
            .iter()
            .filter(|s| s.behind())
            .map(|s| {
                format!(
                    "sequence {} of {}.{} is at {} on the target, {} on the source (not a divergence: sequences are not transactional; `{run}` brings it forward)",
                    s.target.as_ref().map_or("", |t| t.0.as_str()),
                    s.table,
                    s.column,
                    s.target.as_ref().map_or(0, |t| t.1),
                    s.source.0
                )
            })
            .collect(),
        Err(e) => vec![format!(
            "the sequences of the flow's tables could not be compared: {}",
            e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_owned())
        )],
    }
}

/// Verification is a state transition as well as a report, on the
/// evidence of every table only. A verified run goes back only on evidence
/// that its copy is wrong: rows that differ while the target has applied
/// everything. Lag, a quarantined transaction or an unchecked watermark
/// explain a difference without it.
async fn settle(
    flow: &Flow,
    target: &Client,
    seen: Option<&crate::snapshot::RunState>,
    verdict: &mut Verdict,
) -> Result<(), VerifyError> {
    let data_differs = verdict
        .divergences
        .iter()
        .any(|d| matches!(d.code, "ROW_COUNT_MISMATCH" | "CHECKSUM_MISMATCH"));
    let explained = verdict.divergences.iter().any(|d| {
        matches!(
            d.code,
            "WATERMARK_BEHIND" | "WATERMARK_UNVERIFIED" | "QUARANTINED"
        )
    });
    settle_tables(flow, target, verdict, data_differs && !explained).await?;
    let state = seen.map(|s| s.state);
    let next = match (state, verdict.converged()) {
        _ if verdict.only_table.is_some() => None,
        (Some(SnapshotState::StreamHandoffReady), true) => Some(SnapshotState::Verified),
        (Some(SnapshotState::Verified), false) if data_differs && !explained => {
            Some(SnapshotState::FailedRecoverable)
        }
        _ => None,
    };
    let Some(next) = next else {
        return Ok(());
    };
    let reason = (!verdict.converged()).then(|| {
        verdict
            .divergences
            .iter()
            .map(|d| d.code)
            .collect::<Vec<_>>()
            .join(", ")
    });
    let seen = seen.ok_or_else(|| VerifyError::State("the run vanished".into()))?;
    let moved = crate::snapshot::transition_from(target, &flow.name, seen, next, reason.as_deref())
        .await
        .map_err(state_error)?;
    if moved {
        verdict.snapshot_state = Some(next.as_str().to_owned());
    } else {
        // A reseed re-planned the run while verify compared: this verdict
        // is about the run before it and moves nothing.
        tracing::warn!(flow = %flow.name, "the snapshot run changed while verify ran; its state was left as is");
    }
    Ok(())
}

/// The same for the tables with a snapshot state of their own (copied at
/// a boundary of their own): those compared are promoted by a CONVERGED
/// verdict, and one whose rows differ, unexplained, is failed_recoverable.
async fn settle_tables(
    flow: &Flow,
    target: &Client,
    verdict: &Verdict,
    unexplained: bool,
) -> Result<(), VerifyError> {
    let compared: Vec<String> = verdict.tables.iter().map(|t| t.table.clone()).collect();
    let differ: Vec<String> = verdict
        .tables
        .iter()
        .filter(|t| t.source_rows != t.target_rows || t.source_checksum != t.target_checksum)
        .map(|t| t.table.clone())
        .collect();
    let moves = if verdict.converged() {
        vec![(
            &compared,
            SnapshotState::StreamHandoffReady,
            SnapshotState::Verified,
        )]
    } else if unexplained && !differ.is_empty() {
        [SnapshotState::StreamHandoffReady, SnapshotState::Verified]
            .map(|from| (&differ, from, SnapshotState::FailedRecoverable))
            .to_vec()
    } else {
        Vec::new()
    };
    for (tables, from, to) in moves {
        crate::state::runs::move_tables(target, &flow.name, Some(tables), (from, to))
            .await
            .map_err(VerifyError::Target)?;
    }
    Ok(())
}

fn ranges(e: &TableEvidence) -> String {
    if e.diverging_ranges.is_empty() {
        String::new()
    } else {
        format!(
            "; diverging key range(s): {}",
            e.diverging_ranges.join(" | ")
        )
    }
}

pub fn render_text(v: &Verdict) -> String {
    let mut out = String::new();
    for t in &v.tables {
        out.push_str(&format!(
            "  {:<28} rows {} / {}  checksum {} / {}{}\n",
            t.table,
            t.source_rows,
            t.target_rows,
            t.source_checksum,
            t.target_checksum,
            if t.chunks > 1 {
                format!("  ({} key-range chunks)", t.chunks)
            } else {
                String::new()
            }
        ));
        for l in &t.limits {
            out.push_str(&format!("    not checked: {l}\n"));
        }
    }
    if let Some(at) = &v.fenced_at {
        out.push_str(&format!(
            "  compared at source LSN {at}: the flow follows, its apply was held {} ms at the fence\n",
            v.apply_held_ms.unwrap_or(0)
        ));
    }
    out.push_str(&format!(
        "  watermark {}  snapshot {} (consistent LSN {})  applied {} transactions, {} duplicates skipped\n",
        v.target_watermark.as_deref().unwrap_or("none"),
        v.snapshot_state.as_deref().unwrap_or("none"),
        v.consistent_lsn.as_deref().unwrap_or("-"),
        v.transactions_applied,
        v.duplicates_skipped
    ));
    for d in &v.divergences {
        out.push_str(&format!(
            "  {}: {}\n    recovery: {}\n",
            d.code, d.detail, d.recovery
        ));
    }
    for n in &v.notes {
        out.push_str(&format!("  note: {n}\n"));
    }
    if v.sink == v.flow {
        out.push_str(&format!("{} {}\n", v.flow, v.result));
    } else {
        out.push_str(&format!("{} (sink {}) {}\n", v.flow, v.sink, v.result));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_cursor_is_named_not_counted_as_a_backlog() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("log");
        // An empty log: nothing to apply, whether the cursor is there or not.
        assert!(not_applied(&log, ("sink-lake", true), "trellara run").is_none());
        log.register_consumer("sink-main").expect("register");
        for lsn in 1..=3 {
            log.append(lsn * 100, b"txn").expect("append");
        }
        let behind = not_applied(&log, ("sink-main", true), "trellara run").expect("behind");
        assert!(behind.detail.starts_with("3 captured"), "{}", behind.detail);
        // A flow's only sink has not applied any of it yet.
        let only = not_applied(&log, ("applier", false), "trellara run").expect("only");
        assert!(only.detail.starts_with("3 captured"), "{}", only.detail);
        let dropped = not_applied(&log, ("sink-lake", true), "trellara run").expect("dropped");
        assert_eq!(dropped.code, "WATERMARK_BEHIND");
        assert!(
            dropped.detail.contains("sink-lake is not in the log")
                && dropped.detail.contains("copies it again"),
            "{}",
            dropped.detail
        );
        assert_eq!(dropped.recovery, "trellara run");
    }
}
