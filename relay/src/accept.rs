//! `trellara schema accept --flow F --table T`: releases the sinks held at
//! a schema change no sink applies on its own (`DdlEvent.held`), once the
//! operator made each target match the table's description after it.
//!
//! Invariants:
//! * Nothing is recorded unless every held sink's target has each column
//!   of that description, of the source's type with a modifier that takes
//!   its values unchanged, and no column of its own that a row under the new
//!   description could not be inserted without (NOT NULL, no default). A
//!   target that does not match is named with what it lacks. Each target's
//!   table is locked against DDL (SHARE UPDATE EXCLUSIVE, reads and writes
//!   go on) from its check to its record, so what was checked is what is
//!   accepted.
//! * The acceptance is one row per held transaction in that target's
//!   `trellara.schema_changes` (barrier `accepted:T@C/F`, F the fingerprint after,
//!   [`state::schema::acceptance`]), nothing else: the held sink reads it,
//!   goes on from that very transaction, passes its changes on T without
//!   DDL and moves T's pin in the transaction of its rows. A crash on
//!   either side leaves the hold or the acceptance, never half of one.

use std::collections::HashMap;

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
    #[error("source database")]
    Source(#[source] tokio_postgres::Error),
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
    let mut source = None;
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
        // Held from the check to the record: no ALTER of the table lands
        // in between (plain reads and writes go on).
        target
            .batch_execute("BEGIN; SET LOCAL lock_timeout = '10s'")
            .await?;
        let exists: bool = target
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.quoted()])
            .await?
            .get(0);
        if exists {
            target
                .batch_execute(&format!(
                    "LOCK TABLE {} IN SHARE UPDATE EXCLUSIVE MODE",
                    table.quoted()
                ))
                .await?;
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
            // A type of the source's own is named by the source only.
            let own = schema
                .columns
                .iter()
                .any(|c| c.type_oid >= FIRST_NORMAL_OID);
            if own && source.is_none() {
                let url = flow
                    .source
                    .url
                    .resolve(&format!("flows[{index}].source"))
                    .map_err(FlowError::from)?;
                source = Some(connect(&url, "source").await?);
            }
            let named = match &source {
                Some(source) => source_types(source, &schema)
                    .await
                    .map_err(AcceptError::Source)?,
                None => HashMap::new(),
            };
            let problems = mismatches(&target, (table, &named), &schema).await?;
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
    for (sink, target, holds, columns) in checked {
        let tx = &target;
        for hold in &holds {
            let after: RelationSchema =
                prost::Message::decode(hold.schema.as_slice()).unwrap_or_default();
            state::schema::accept(
                tx,
                &flow.name,
                &table_name,
                &hold.commit_lsn,
                &hold.reason,
                after.fingerprint as i64,
            )
            .await?;
        }
        target.batch_execute("COMMIT").await?;
        released.push(Released {
            sink,
            commit_lsns: holds.into_iter().map(|h| h.commit_lsn).collect(),
            columns,
        });
    }
    Ok(released)
}

/// The schema-qualified name of each type of the source's own (an enum,
/// a domain, a composite) that `schema`'s columns have, by OID.
pub(crate) async fn source_types(
    source: &tokio_postgres::Client,
    schema: &RelationSchema,
) -> Result<HashMap<u32, String>, tokio_postgres::Error> {
    let oids: Vec<i64> = schema
        .columns
        .iter()
        .filter(|c| c.type_oid >= FIRST_NORMAL_OID)
        .map(|c| i64::from(c.type_oid))
        .collect();
    if oids.is_empty() {
        return Ok(HashMap::new());
    }
    Ok(source
        .query(
            "SELECT t.oid::int8, n.nspname || '.' || t.typname FROM pg_type t
             JOIN pg_namespace n ON n.oid = t.typnamespace WHERE t.oid::int8 = ANY($1)",
            &[&oids],
        )
        .await?
        .iter()
        .map(|r| (u32::try_from(r.get::<_, i64>(0)).unwrap_or(0), r.get(1)))
        .collect())
}

/// What keeps the target's `table` from taking rows under `schema`;
/// `named`: the source's own types by OID ([`source_types`]), matched
/// by schema-qualified name and modifier.
pub(crate) async fn mismatches(
    target: &tokio_postgres::Client,
    (table, named): (&TableName, &HashMap<u32, String>),
    schema: &RelationSchema,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = target
        .query(
            "SELECT a.attname::text, a.atttypid::int8, a.atttypmod, format_type(a.atttypid, a.atttypmod),
                    a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = '',
                    n.nspname || '.' || t.typname
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid JOIN pg_namespace n ON n.oid = t.typnamespace
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
        // the source knows: the target's must have its name.
        if column.type_oid >= FIRST_NORMAL_OID {
            let target_type: String = row.get(5);
            match named.get(&column.type_oid) {
                Some(wanted) if *wanted == target_type && modifier == column.type_modifier => {}
                Some(wanted) => problems.push(format!(
                    "column {} is {spelled} on the target, not the source's {wanted}",
                    column.name
                )),
                None => problems.push(format!(
                    "column {} has a type (OID {}) the source no longer has, so the target's {spelled} cannot be checked against it",
                    column.name, column.type_oid
                )),
            }
            continue;
        }
        if oid != column.type_oid || !fits(column.type_oid, column.type_modifier, oid, modifier) {
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
