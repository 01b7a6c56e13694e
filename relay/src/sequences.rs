//! Sequences of the flow's tables. pgoutput carries no sequence changes,
//! and a snapshot's COPY does not move them, so without this a cutover to
//! the target would hand out keys the source already used. At the end of
//! every run each sequence a flow table owns (serial and identity columns)
//! is brought forward on the target to the source's value - never back: a
//! target ahead stays ahead. Sequences are not transactional, so verify
//! reports one that is behind as a note, not a divergence.

use crate::config::{Flow, quote_table};
use tokio_postgres::Client;

/// A sequence owned by a column of a flow table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owned {
    pub table: String,
    pub column: String,
    /// The source's value: `last_value`, and whether it was handed out.
    pub source: (i64, bool),
    /// The target's sequence of the same column and its value, if it has one.
    pub target: Option<(String, i64, bool)>,
}

impl Owned {
    /// Whether the target would hand out a value the source already has.
    pub fn behind(&self) -> bool {
        match &self.target {
            None => false,
            Some((_, value, called)) => (*value, *called) < self.source,
        }
    }
}

/// The owned sequences of the flow's tables on both sides.
pub async fn owned(
    flow: &Flow,
    source: &Client,
    target: &Client,
) -> Result<Vec<Owned>, tokio_postgres::Error> {
    let mut out = Vec::new();
    for table in &flow.tables {
        let Some(qualified) = quote_table(table) else {
            continue;
        };
        let columns = source
            .query(
                "SELECT a.attname::text, pg_get_serial_sequence($1, a.attname)
                 FROM pg_attribute a
                 WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
                   AND pg_get_serial_sequence($1, a.attname) IS NOT NULL",
                &[&qualified],
            )
            .await?;
        for row in columns {
            let (column, sequence): (String, String) = (row.get(0), row.get(1));
            let value = source
                .query_one(
                    &format!("SELECT last_value, is_called FROM {sequence}"),
                    &[],
                )
                .await?;
            let found: Option<String> = target
                .query_one(
                    "SELECT pg_get_serial_sequence($1, $2)",
                    &[&qualified, &column],
                )
                .await
                .ok()
                .and_then(|r| r.get(0));
            let target_value = match found {
                None => None,
                Some(seq) => {
                    let v = target
                        .query_one(&format!("SELECT last_value, is_called FROM {seq}"), &[])
                        .await?;
                    Some((seq, v.get(0), v.get(1)))
                }
            };
            out.push(Owned {
                table: table.clone(),
                column,
                source: (value.get(0), value.get(1)),
                target: target_value,
            });
        }
    }
    Ok(out)
}

/// Brings each target sequence that is behind forward to the source's
/// value; says what it moved.
pub async fn bring_forward(
    flow: &Flow,
    source: &Client,
    target: &Client,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let mut moved = Vec::new();
    for s in owned(flow, source, target).await? {
        if !s.behind() {
            continue;
        }
        let Some((seq, before, _)) = &s.target else {
            continue;
        };
        // setval takes the sequence as regclass: the text from
        // pg_get_serial_sequence is already a quoted, qualified name.
        target
            .execute(
                "SELECT setval($1::text::regclass, $2, $3)",
                &[seq, &s.source.0, &s.source.1],
            )
            .await?;
        moved.push(format!(
            "sequence {seq} of {}.{} brought forward from {before} to the source's {}",
            s.table, s.column, s.source.0
        ));
    }
    Ok(moved)
}
