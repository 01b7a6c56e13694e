//! `trellara schema accept --flow F --table T`: releases the sinks held at
//! a schema change no sink applies on its own (`DdlEvent.held`), once the
//! operator made each target match the table's description after it.
//!
//! Invariants:
//! * Nothing is recorded unless every held sink's target has each column
//!   of that description, of the source's type with a modifier that takes
//!   its values unchanged, and no column of its own that a row under the new
//!   description could not be inserted without (NOT NULL, no default). A
//!   target that does not match is named with what it lacks.
//! * The acceptance is one row per held transaction in that target's
//!   `trellara.schema_changes` (barrier `accepted:T@C/F`, F the fingerprint after,
//!   [`state::schema::acceptance`]), nothing else: the held sink reads it,
//!   goes on from that very transaction, passes its changes on T without
//!   DDL and moves T's pin in the transaction of its rows. A crash on
//!   either side leaves the hold or the acceptance, never half of one.

use crate::apply::fits;
use crate::config::Flow;
use crate::flow::{FlowError, connect, sink_url};
use crate::state;
use trellara_common::envelope::RelationSchema;
use trellara_common::table_name::TableName;

/// Type OIDs below this are built in: the same on every server, so a
/// source's OID names the target's type too.
const FIRST_NORMAL_OID: u32 = 16384;

#[derive(Debug, thiserror::Error)]
pub enum AcceptError {
    #[error(
        "flow {flow}: no sink holds a schema change on {table}{}\nhint: `trellara status --config {config} --flow {flow}` shows what holds the flow",
        if held.is_empty() { String::new() } else { format!(" (held: {})", held.join(", ")) }
    )]
    NotHeld {
        flow: String,
        table: String,
        held: Vec<String>,
        config: String,
    },
    #[error(
        "flow {flow}, sink {sink}: the target's {table} does not match the table after the held change, so nothing was accepted:\n  {}\nthe change: {reason}\nhint: make the target's table match (the change on the target as on the source), then run `trellara schema accept` again",
        problems.join("\n  ")
    )]
    Mismatch {
        flow: String,
        sink: String,
        table: String,
        problems: Vec<String>,
        reason: String,
    },
    #[error("no sink named {sink:?} in flow {flow}\nhint: --sink takes one of: {names}")]
    NoSink {
        flow: String,
        sink: String,
        names: String,
    },
    #[error(
        "flow {flow}, sink {sink}: the held record at {commit_lsn} has a description that cannot be read: {detail}\nhint: copy the table again: `trellara reseed --flow {flow}`"
    )]
    Unreadable {
        flow: String,
        sink: String,
        commit_lsn: String,
        detail: String,
    },
    #[error(transparent)]
    Flow(#[from] FlowError),
    #[error("target database")]
    Target(#[from] tokio_postgres::Error),
}

/// One sink released.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Released {
    pub sink: String,
    /// The held transactions, by commit LSN.
    pub commit_lsns: Vec<String>,
    /// The columns the target's table was found to have of the
    /// description after the change.
    pub columns: usize,
}

/// Accepts the held changes on `table` on every sink of `flow` that holds
/// one (or on `only`): checks each target first, then records on each.
pub async fn accept(
    (flow, index, config_path): (&Flow, usize, &str),
    table: &TableName,
    only: Option<&str>,
) -> Result<Vec<Released>, AcceptError> {
    let sinks = flow.sinks();
    if let Some(only) = only
        && !sinks.iter().any(|s| s.name == only)
    {
        let names: Vec<&str> = sinks.iter().map(|s| s.name).collect();
        return Err(AcceptError::NoSink {
            flow: flow.name.clone(),
            sink: only.to_owned(),
            names: names.join(", "),
        });
    }
    let table_name = table.to_string();
    let mut checked = Vec::new();
    let mut held_elsewhere = Vec::new();
    for sink in sinks.iter().filter(|s| only.is_none_or(|o| o == s.name)) {
        let target = connect(&sink_url(flow, index, *sink)?, "target").await?;
        if !state::current(&target).await? {
            continue;
        }
        let holds = state::quarantine::holds(&target, &flow.name, &table_name).await?;
        if holds.is_empty() {
            held_elsewhere.extend(
                state::quarantine::open(&target, &flow.name)
                    .await?
                    .into_iter()
                    .filter_map(|q| q.held_table),
            );
            continue;
        }
        let mut columns = 0;
        for hold in &holds {
            let schema: RelationSchema =
                prost::Message::decode(hold.schema.as_slice()).map_err(|e| {
                    AcceptError::Unreadable {
                        flow: flow.name.clone(),
                        sink: sink.name.to_owned(),
                        commit_lsn: hold.commit_lsn.clone(),
                        detail: e.to_string(),
                    }
                })?;
            let problems = mismatches(&target, table, &schema).await?;
            if !problems.is_empty() {
                return Err(AcceptError::Mismatch {
                    flow: flow.name.clone(),
                    sink: sink.name.to_owned(),
                    table: table_name,
                    problems,
                    reason: hold.reason.clone(),
                });
            }
            columns = schema.columns.len();
        }
        checked.push((sink.name.to_owned(), target, holds, columns));
    }
    if checked.is_empty() {
        held_elsewhere.sort();
        held_elsewhere.dedup();
        return Err(AcceptError::NotHeld {
            flow: flow.name.clone(),
            table: table_name,
            held: held_elsewhere,
            config: config_path.to_owned(),
        });
    }
    let mut released = Vec::new();
    for (sink, mut target, holds, columns) in checked {
        let tx = target.transaction().await?;
        for hold in &holds {
            let after: RelationSchema =
                prost::Message::decode(hold.schema.as_slice()).unwrap_or_default();
            state::schema::accept(
                &tx,
                &flow.name,
                &table_name,
                &hold.commit_lsn,
                &hold.reason,
                after.fingerprint as i64,
            )
            .await?;
        }
        tx.commit().await?;
        released.push(Released {
            sink,
            commit_lsns: holds.into_iter().map(|h| h.commit_lsn).collect(),
            columns,
        });
    }
    Ok(released)
}

/// What keeps the target's `table` from taking rows under `schema`.
pub(crate) async fn mismatches(
    target: &tokio_postgres::Client,
    table: &TableName,
    schema: &RelationSchema,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = target
        .query(
            "SELECT a.attname::text, a.atttypid::int8, a.atttypmod, format_type(a.atttypid, a.atttypmod),
                    a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = ''
             FROM pg_attribute a
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
             ORDER BY a.attnum",
            &[&table.quoted()],
        )
        .await?;
    if rows.is_empty() {
        return Ok(vec![format!("{table} does not exist on the target")]);
    }
    let mut problems = Vec::new();
    for column in &schema.columns {
        let Some(row) = rows.iter().find(|r| r.get::<_, String>(0) == column.name) else {
            problems.push(format!("missing column {}", column.name));
            continue;
        };
        let (oid, modifier, spelled) = (
            u32::try_from(row.get::<_, i64>(1)).unwrap_or(0),
            row.get::<_, i32>(2),
            row.get::<_, String>(3),
        );
        // A type of the source's own (an enum, a domain) has an OID only
        // the source knows: its name on the target is the operator's.
        if column.type_oid < FIRST_NORMAL_OID
            && (oid != column.type_oid
                || !fits(column.type_oid, column.type_modifier, oid, modifier))
        {
            let wanted: String = target
                .query_one(
                    "SELECT format_type($1::int8::oid, $2)",
                    &[&i64::from(column.type_oid), &column.type_modifier],
                )
                .await?
                .get(0);
            problems.push(format!(
                "column {} is {spelled} on the target, which does not take the source's {wanted} unchanged",
                column.name
            ));
        }
    }
    for row in &rows {
        let name: String = row.get(0);
        if row.get::<_, bool>(4) && !schema.columns.iter().any(|c| c.name == name) {
            problems.push(format!(
                "column {name} is NOT NULL without a default on the target, and the source no longer sends it: drop it or give it a default"
            ));
        }
    }
    Ok(problems)
}
