//! The target side of `trellara preflight` (the source side is the
//! read-only grader, `trellara_check`): every table of the flow exists on
//! the target with the source's columns and types. Read-only: the queries
//! run in a READ ONLY transaction and create nothing.

use crate::config::{Flow, split_table};
use serde::Serialize;
use tokio_postgres::Client;

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub side: &'static str,
    pub check: String,
    pub ok: bool,
    /// A blocker stops `run`; a note does not.
    pub blocking: bool,
    pub detail: String,
    pub action: Option<String>,
}

fn finding(
    side: &'static str,
    check: &str,
    ok: bool,
    blocking: bool,
    detail: String,
    action: Option<String>,
) -> Finding {
    Finding {
        side,
        check: check.to_owned(),
        ok,
        blocking: blocking && !ok,
        detail,
        action: if ok { None } else { action },
    }
}

pub async fn target(
    flow: &Flow,
    source: &Client,
    target: &Client,
) -> Result<Vec<Finding>, tokio_postgres::Error> {
    target.batch_execute("BEGIN READ ONLY").await?;
    let mut out = Vec::new();
    let columns = "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
                   WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '' ORDER BY a.attnum";
    for table in &flow.tables {
        let Some((schema, name)) = split_table(table) else {
            continue;
        };
        let qualified = format!("\"{schema}\".\"{name}\"");
        let want: Vec<(String, String)> = source
            .query(columns, &[&qualified])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let have: Vec<(String, String)> = target
            .query(columns, &[&qualified])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        if have.is_empty() {
            out.push(finding("target", &format!("table {table}"), false, true, "does not exist on the target".into(),
                Some(format!("create {table} on the target with the source's columns (pg_dump --schema-only --table {table} from the source)"))));
            continue;
        }
        let problems: Vec<String> = want
            .iter()
            .filter_map(|(col, ty)| match have.iter().find(|(c, _)| c == col) {
                None => Some(format!("missing column {col} {ty}")),
                Some((_, t)) if t != ty => {
                    Some(format!("column {col} is {t}, the source has {ty}"))
                }
                _ => None,
            })
            .collect();
        out.push(finding(
            "target",
            &format!("table {table}"),
            problems.is_empty(),
            true,
            if problems.is_empty() {
                format!("{} compatible columns", want.len())
            } else {
                problems.join("; ")
            },
            Some(format!(
                "ALTER TABLE {table} ... so its columns match the source"
            )),
        ));
    }
    if let Some(refusal) = crate::snapshot::native_refusal(flow, source).await? {
        out.push(finding(
            "source",
            "native capture",
            false,
            true,
            refusal,
            Some("set capture: external for this flow in trellara.yml".into()),
        ));
    }
    target.batch_execute("ROLLBACK").await?;
    Ok(out)
}
