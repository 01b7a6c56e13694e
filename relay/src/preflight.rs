//! `trellara preflight`: checks a configured flow against the live source
//! and target, read-only, and names an action for every problem. Nothing is
//! created: the queries run in READ ONLY transactions.

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

async fn one(client: &Client, sql: &str) -> Result<Option<String>, tokio_postgres::Error> {
    Ok(client
        .query_opt(sql, &[])
        .await?
        .and_then(|r| r.get::<_, Option<String>>(0)))
}

pub async fn source(flow: &Flow, client: &Client) -> Result<Vec<Finding>, tokio_postgres::Error> {
    client.batch_execute("BEGIN READ ONLY").await?;
    let mut out = Vec::new();
    let wal_level = one(client, "SELECT current_setting('wal_level')")
        .await?
        .unwrap_or_default();
    out.push(finding(
        "source",
        "wal_level",
        wal_level == "logical",
        true,
        format!("wal_level = {wal_level}"),
        Some("ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL".into()),
    ));
    let replication = one(
        client,
        "SELECT (rolreplication OR rolsuper)::text FROM pg_roles WHERE rolname = current_user",
    )
    .await?;
    out.push(finding("source", "replication privilege", replication.as_deref() == Some("true"), true,
        format!("role {} {}", one(client, "SELECT current_user::text").await?.unwrap_or_default(),
            if replication.as_deref() == Some("true") { "may replicate" } else { "has no REPLICATION attribute" }),
        Some("ALTER ROLE <role> REPLICATION; (on managed providers: grant the provider's replication role)".into())));
    let slot_exists = client
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[&flow.slot()],
        )
        .await?
        .is_some();
    let free_slots: i64 = client.query_one("SELECT current_setting('max_replication_slots')::bigint - (SELECT count(*) FROM pg_replication_slots)", &[]).await?.get(0);
    out.push(finding("source", "replication slots", slot_exists || free_slots >= 1, true,
        if slot_exists { format!("slot {} exists", flow.slot()) } else { format!("{free_slots} free (one is needed)") },
        Some("raise max_replication_slots (restart) or drop an unused slot: SELECT pg_drop_replication_slot('<name>');".into())));
    let free_senders: i64 = client.query_one("SELECT current_setting('max_wal_senders')::bigint - (SELECT count(*) FROM pg_stat_replication)", &[]).await?.get(0);
    out.push(finding(
        "source",
        "wal senders",
        free_senders >= 1,
        true,
        format!("{free_senders} free (one is needed)"),
        Some("raise max_wal_senders (restart)".into()),
    ));
    if let Some(list) = one(
        client,
        "SELECT setting FROM pg_settings WHERE name = 'output_plugin_libraries'",
    )
    .await?
    {
        out.push(finding("source", "output_plugin_libraries", list.split(',').any(|p| p.trim() == "pgoutput"), true,
            format!("output_plugin_libraries = {list}"),
            Some("ALTER SYSTEM SET output_plugin_libraries = 'pgoutput', ...; SELECT pg_reload_conf();".into())));
    }
    for table in &flow.tables {
        let Some((schema, name)) = split_table(table) else {
            continue;
        };
        let row = client.query_opt(
            "SELECT c.relreplident::text, c.relpersistence::text, c.relkind::text,
                    EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND (i.indisprimary OR i.indisreplident))
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2",
            &[&schema, &name]).await?;
        let Some(row) = row else {
            out.push(finding(
                "source",
                &format!("table {table}"),
                false,
                true,
                "does not exist".into(),
                Some(format!(
                    "create {table} on the source or remove it from the flow's tables"
                )),
            ));
            continue;
        };
        let (ident, persistence, has_key): (String, String, bool) =
            (row.get(0), row.get(1), row.get(3));
        let usable = has_key || ident == "f";
        out.push(finding("source", &format!("table {table}"), usable && persistence != "u", true,
            if persistence == "u" { "is UNLOGGED: its changes are not in the WAL".into() }
            else if usable { format!("identity: {}", if ident == "f" { "FULL" } else { "primary key / index" }) }
            else { "has no primary key and REPLICA IDENTITY DEFAULT: updates and deletes cannot be matched".into() },
            Some(if persistence == "u" { format!("ALTER TABLE {table} SET LOGGED;") } else { format!("ALTER TABLE {table} ADD PRIMARY KEY (...); or ALTER TABLE {table} REPLICA IDENTITY FULL;") })));
    }
    let publication = client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&flow.publication()],
        )
        .await?
        .is_some();
    out.push(finding(
        "source",
        "publication",
        true,
        false,
        if publication {
            format!("publication {} exists", flow.publication())
        } else {
            format!(
                "publication {} will be created by `trellara run`",
                flow.publication()
            )
        },
        None,
    ));
    client.batch_execute("ROLLBACK").await?;
    Ok(out)
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
    target.batch_execute("ROLLBACK").await?;
    Ok(out)
}
