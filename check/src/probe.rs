//! Reads the facts: one plain (non-replication) session, one `BEGIN READ
//! ONLY` transaction, catalog and statistics queries chosen per server
//! version, and two `pg_current_wal_lsn()` samples around them.
//!
//! Invariants:
//! - Only these statements are ever sent: `BEGIN READ ONLY`, `SET LOCAL` of
//!   timeouts, `SHOW`, `SELECT` of catalogs, views and side-effect-free
//!   functions, `SAVEPOINT` / `RELEASE SAVEPOINT` / `ROLLBACK TO SAVEPOINT`
//!   (to survive a permission error without aborting the transaction), and
//!   `COMMIT` / `ROLLBACK`. No function that creates, drops, advances or
//!   consumes anything is called, and the session is not a replication
//!   session, so it cannot create a slot. `transaction_read_only` is checked
//!   to be `on` before any other query.
//! - A value the server does not return (NULL, a missing column, a denied
//!   function) becomes `None` plus an entry in `Facts::unknowns`; nothing is
//!   unwrapped from the server's answers.

use crate::CheckError;
use crate::report::{
    Conflicts, Facts, Identity, NamedSetting, PreparedTransaction, Publication, RoleAccess, Server,
    Settings, Slot, SlotState, TablePublication, TableReadiness, Tables, Unknown, Usage, Wal,
};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use trellara_pgwire::{ConnectOptions, Connection, Row, WireError, quote_literal};

/// Application name of the grader's session (`pg_stat_activity`, logs).
pub const APPLICATION_NAME: &str = "trellara-check";

/// Most tables listed when no `--table` is given.
const TABLE_SCAN_LIMIT: usize = 2000;

/// Managed-provider roles whose membership grants replication on that
/// provider (RDS/Aurora, Azure Flexible Server, Cloud SQL, AlloyDB, Neon).
pub const PROVIDER_REPLICATION_ROLES: [&str; 6] = [
    "rds_replication",
    "rds_superuser",
    "azure_pg_admin",
    "cloudsqlsuperuser",
    "alloydbsuperuser",
    "neon_superuser",
];

const SETTINGS: [&str; 16] = [
    "wal_level",
    "max_slot_wal_keep_size",
    "max_wal_size",
    "max_replication_slots",
    "max_wal_senders",
    "idle_replication_slot_timeout",
    "output_plugin_libraries",
    "sync_replication_slots",
    "synchronized_standby_slots",
    "standby_slot_names",
    "hot_standby_feedback",
    "rds.logical_replication",
    "cloudsql.logical_decoding",
    "wal_segment_size",
    "server_version_num",
    "transaction_read_only",
];

/// The grader's session: counts what it sends, isolates failing probes.
struct Session {
    conn: Connection,
    statements: usize,
}

enum Probe {
    Rows(Vec<Row>),
    /// The server refused (permission, missing object): the transaction is
    /// intact thanks to the savepoint.
    Denied(String),
}

impl Session {
    async fn exec(&mut self, what: &'static str, sql: &str) -> Result<Vec<Row>, CheckError> {
        self.statements += 1;
        self.conn
            .simple_query(sql)
            .await
            .map_err(|source| CheckError::Query {
                what,
                source: Box::new(source),
            })
    }

    /// A query that may be refused: wrapped in a savepoint so that a refusal
    /// leaves the read-only transaction usable.
    /// The three statements go in one message, one round trip: the server
    /// runs them in order and stops at the first error, which leaves the
    /// savepoint set for the rollback.
    async fn probe(&mut self, what: &'static str, sql: &str) -> Result<Probe, CheckError> {
        self.statements += 3;
        let batch = format!("SAVEPOINT trellara_check; {sql}; RELEASE SAVEPOINT trellara_check");
        match self.conn.simple_query(&batch).await {
            Ok(rows) => Ok(Probe::Rows(rows)),
            Err(WireError::Server(e)) => {
                self.exec(what, "ROLLBACK TO SAVEPOINT trellara_check")
                    .await?;
                Ok(Probe::Denied(format!(
                    "{} (SQLSTATE {})",
                    e.message, e.code
                )))
            }
            Err(source) => Err(CheckError::Query {
                what,
                source: Box::new(source),
            }),
        }
    }
}

fn text(row: &Row, col: &str) -> Option<String> {
    row.get(col).map(str::to_owned)
}

fn int(row: &Row, col: &str) -> Option<i64> {
    row.get(col).and_then(|v| v.trim().parse().ok())
}

fn boolean(row: &Row, col: &str) -> Option<bool> {
    match row.get(col) {
        Some("t" | "true" | "on") => Some(true),
        Some("f" | "false" | "off") => Some(false),
        _ => None,
    }
}

/// An identifier for statements shown to people: plain when plain, else
/// quoted by postgres-protocol.
pub use trellara_common::table_name::display_ident as quote_ident;

/// Reads every fact inside one read-only transaction, then commits it.
pub(crate) async fn gather(
    options: &ConnectOptions,
    tables: &[String],
    sample: Duration,
) -> Result<Facts, CheckError> {
    let mut options = options.clone();
    options.replication = false;
    options.application_name = APPLICATION_NAME.to_owned();
    let conn = Connection::connect(&options)
        .await
        .map_err(|source| CheckError::Connect {
            target: format!("{}@{}", options.user, options.target()),
            source: Box::new(source),
        })?;
    let mut s = Session {
        conn,
        statements: 0,
    };
    s.exec("begin", "BEGIN READ ONLY").await?;
    let result = gather_in_transaction(&mut s, tables, sample).await;
    match result {
        Ok(mut facts) => {
            s.exec("commit", "COMMIT").await?;
            facts.statements = s.statements;
            Ok(facts)
        }
        Err(e) => {
            // Best effort: the session is dropped right after anyway.
            let _ = s.exec("rollback", "ROLLBACK").await;
            Err(e)
        }
    }
}

async fn gather_in_transaction(
    s: &mut Session,
    tables: &[String],
    sample: Duration,
) -> Result<Facts, CheckError> {
    let read_only = s
        .exec("transaction_read_only", "SHOW transaction_read_only")
        .await?
        .first()
        .and_then(|r| text(r, "transaction_read_only"))
        .unwrap_or_default();
    if read_only != "on" {
        return Err(CheckError::NotReadOnly(read_only));
    }
    s.exec(
        "timeouts",
        "SET LOCAL statement_timeout = '30s'; SET LOCAL lock_timeout = '2s'",
    )
    .await?;
    s.statements += 1;

    let mut unknowns: Vec<Unknown> = Vec::new();

    let rows = s
        .exec(
            "server",
            "SELECT current_setting('server_version') AS version, \
             current_setting('server_version_num') AS num, \
             pg_is_in_recovery() AS standby, current_database() AS db",
        )
        .await?;
    let row = rows.first().ok_or(CheckError::Missing("server version"))?;
    let version_num: u32 = row
        .get("num")
        .and_then(|v| v.parse().ok())
        .ok_or(CheckError::Missing("server_version_num"))?;
    let server = Server {
        version: text(row, "version")
            .map(|v| v.split_whitespace().next().unwrap_or_default().to_owned())
            .unwrap_or_default(),
        version_num,
        standby: boolean(row, "standby").unwrap_or(false),
        database: text(row, "db").unwrap_or_default(),
        transaction_read_only: true,
    };
    let current_lsn_fn = if server.standby {
        "pg_last_wal_receive_lsn()"
    } else {
        "pg_current_wal_lsn()"
    };
    let retained_from = if server.standby {
        "pg_last_wal_replay_lsn()"
    } else {
        "pg_current_wal_lsn()"
    };

    // First WAL sample; the second one closes the window at the end.
    let started = Instant::now();
    let first_lsn = lsn_sample(s, current_lsn_fn).await?;

    let role = read_role(s).await?;
    let settings = read_settings(s, &role, &mut unknowns).await?;

    let slots = read_slots(s, version_num, retained_from, &role.name, &mut unknowns).await?;
    let senders = match s
        .probe(
            "wal senders",
            "SELECT count(*) AS senders FROM pg_stat_replication",
        )
        .await?
    {
        Probe::Rows(rows) => rows.first().and_then(|r| int(r, "senders")),
        Probe::Denied(why) => {
            unknowns.push(Unknown {
                what: "wal senders in use".into(),
                reason: format!("pg_stat_replication refused: {why}"),
                grant: Some(format!("GRANT pg_monitor TO {};", quote_ident(&role.name))),
            });
            None
        }
    };
    let usage = Usage {
        replication_slots: slots.as_ref().map(|v| v.len() as i64),
        wal_senders: senders,
    };
    let slots_visible = slots.is_some();
    let slots = slots.unwrap_or_default();

    let pg_wal_bytes = if role.monitor || role.superuser {
        match s
            .probe(
                "pg_wal size",
                "SELECT sum(size)::bigint AS bytes FROM pg_ls_waldir()",
            )
            .await?
        {
            Probe::Rows(rows) => rows.first().and_then(|r| int(r, "bytes")),
            Probe::Denied(why) => {
                unknowns.push(Unknown {
                    what: "pg_wal size".into(),
                    reason: format!("pg_ls_waldir() refused: {why}"),
                    grant: Some(format!("GRANT pg_monitor TO {};", quote_ident(&role.name))),
                });
                None
            }
        }
    } else {
        unknowns.push(Unknown {
            what: "pg_wal size".into(),
            reason: "pg_ls_waldir() needs pg_monitor".into(),
            grant: Some(format!("GRANT pg_monitor TO {};", quote_ident(&role.name))),
        });
        None
    };

    let table_facts = read_tables(s, tables, &mut unknowns).await?;
    let publications = read_publications(s, &role.name, &mut unknowns).await?;
    let publications_visible = publications.is_some();
    let publications = publications.unwrap_or_default();
    let conflicts = read_conflicts(s, version_num).await?;
    let prepared_transactions = read_prepared(s).await?;

    // Close the sample window.
    let elapsed = started.elapsed();
    if elapsed < sample {
        tokio::time::sleep(sample - elapsed).await;
    }
    let second_lsn = lsn_sample(s, current_lsn_fn).await?;
    let window = started.elapsed().as_secs_f64();
    let bytes_per_second = match (first_lsn.as_deref(), second_lsn.as_deref()) {
        (Some(a), Some(b)) => {
            let sql = format!(
                "SELECT pg_wal_lsn_diff({}, {})::bigint AS d",
                quote_literal(b),
                quote_literal(a)
            );
            let rows = s.exec("wal rate", &sql).await?;
            rows.first()
                .and_then(|r| int(r, "d"))
                .map(|d| d.max(0) as f64 / window.max(0.001))
        }
        _ => None,
    };
    if bytes_per_second.is_none() {
        unknowns.push(Unknown {
            what: "wal rate".into(),
            reason: if server.standby {
                "the standby has not received WAL from a primary (pg_last_wal_receive_lsn() is NULL)".into()
            } else {
                "pg_current_wal_lsn() returned nothing".into()
            },
            grant: None,
        });
    }
    let largest_retained_bytes = slots
        .iter()
        .filter(|x| x.state != SlotState::Invalidated)
        .filter_map(|x| x.retained_bytes)
        .max();
    let wal = Wal {
        sample_seconds: sample.as_secs_f64(),
        bytes_per_second,
        largest_retained_bytes,
        pg_wal_bytes,
        headroom_hours: None,
        headroom_basis: String::new(),
    };

    Ok(Facts {
        server,
        role,
        settings,
        usage,
        tables: table_facts,
        publications,
        publications_visible,
        slots,
        slots_visible,
        wal,
        conflicts,
        prepared_transactions,
        unknowns,
        statements: 0,
    })
}

/// `pg_prepared_xacts` (readable by every role).
async fn read_prepared(s: &mut Session) -> Result<Vec<PreparedTransaction>, CheckError> {
    let sql = "SELECT gid, transaction::text AS xid, prepared::text AS prepared, database::text AS database \
               FROM pg_prepared_xacts ORDER BY prepared";
    Ok(match s.probe("prepared transactions", sql).await? {
        Probe::Rows(rows) => rows
            .iter()
            .map(|r| PreparedTransaction {
                gid: text(r, "gid").unwrap_or_default(),
                xid: text(r, "xid").unwrap_or_default(),
                prepared: text(r, "prepared").unwrap_or_default(),
                database: text(r, "database").unwrap_or_default(),
            })
            .collect(),
        Probe::Denied(_) => Vec::new(),
    })
}

async fn lsn_sample(s: &mut Session, function: &str) -> Result<Option<String>, CheckError> {
    let rows = s
        .exec("wal position", &format!("SELECT {function}::text AS lsn"))
        .await?;
    Ok(rows.first().and_then(|r| text(r, "lsn")))
}

async fn read_role(s: &mut Session) -> Result<RoleAccess, CheckError> {
    let providers = PROVIDER_REPLICATION_ROLES
        .iter()
        .map(|r| quote_literal(r))
        .collect::<Vec<_>>()
        .join(", ");
    let sql = format!(
        "SELECT r.rolname, r.rolsuper, r.rolreplication, \
         pg_has_role(current_user, 'pg_monitor', 'usage') AS monitor, \
         pg_has_role(current_user, 'pg_read_all_settings', 'usage') AS read_settings, \
         pg_has_role(current_user, 'pg_read_all_stats', 'usage') AS read_stats, \
         has_database_privilege(current_database(), 'create') AS create_db, \
         (SELECT string_agg(p.rolname, ',' ORDER BY p.rolname) FROM pg_roles p \
            WHERE p.rolname IN ({providers})) AS providers_present, \
         (SELECT string_agg(p.rolname, ',' ORDER BY p.rolname) FROM pg_roles p \
            WHERE p.rolname IN ({providers}) AND pg_has_role(current_user, p.oid, 'member')) AS providers_member \
         FROM pg_roles r WHERE r.rolname = current_user"
    );
    let rows = s.exec("role", &sql).await?;
    let row = rows.first().ok_or(CheckError::Missing("current role"))?;
    let superuser = boolean(row, "rolsuper").unwrap_or(false);
    let list = |col| -> Vec<String> {
        text(row, col)
            .map(|v| v.split(',').map(str::to_owned).collect())
            .unwrap_or_default()
    };
    Ok(RoleAccess {
        name: text(row, "rolname").unwrap_or_default(),
        superuser,
        replication_attribute: superuser || boolean(row, "rolreplication").unwrap_or(false),
        provider_replication_roles: list("providers_member"),
        provider_roles_present: list("providers_present"),
        monitor: superuser || boolean(row, "monitor").unwrap_or(false),
        read_all_settings: superuser || boolean(row, "read_settings").unwrap_or(false),
        read_all_stats: superuser || boolean(row, "read_stats").unwrap_or(false),
        create_on_database: boolean(row, "create_db").unwrap_or(false),
    })
}

/// A setting's value converted to its base unit (bytes for sizes given in
/// MB/kB/B/8kB, seconds for times given in s/min/ms).
fn scaled(value: &str, unit: Option<&str>) -> Option<i64> {
    let v: i64 = value.trim().parse().ok()?;
    if v < 0 {
        return Some(v);
    }
    let factor: i64 = match unit.unwrap_or("") {
        "" | "B" | "s" => 1,
        "kB" => 1024,
        "8kB" => 8192,
        "MB" => 1024 * 1024,
        "16MB" => 16 * 1024 * 1024,
        "GB" => 1024 * 1024 * 1024,
        "min" => 60,
        "h" => 3600,
        "d" => 86_400,
        "ms" => return Some(v / 1000),
        _ => return None,
    };
    v.checked_mul(factor)
}

async fn read_settings(
    s: &mut Session,
    role: &RoleAccess,
    unknowns: &mut Vec<Unknown>,
) -> Result<Settings, CheckError> {
    let names = SETTINGS
        .iter()
        .map(|n| quote_literal(n))
        .collect::<Vec<_>>()
        .join(", ");
    let rows = s
        .exec(
            "settings",
            &format!("SELECT name, setting, unit FROM pg_settings WHERE name IN ({names})"),
        )
        .await?;
    let mut seen: HashMap<String, (String, Option<String>)> = HashMap::new();
    for row in &rows {
        if let (Some(name), Some(setting)) = (text(row, "name"), text(row, "setting")) {
            seen.insert(name, (setting, text(row, "unit")));
        }
    }
    let get = |n: &str| seen.get(n).map(|(v, _)| v.clone());
    let bytes = |n: &str| seen.get(n).and_then(|(v, u)| scaled(v, u.as_deref()));
    let mb = |n: &str| bytes(n).map(|b| if b < 0 { b } else { b / (1024 * 1024) });
    let can_see_all = role.superuser || role.read_all_settings;
    for essential in [
        "wal_level",
        "max_replication_slots",
        "max_wal_senders",
        "max_slot_wal_keep_size",
    ] {
        if !seen.contains_key(essential) {
            unknowns.push(Unknown {
                what: essential.to_owned(),
                reason: "not visible in pg_settings to this role".into(),
                grant: Some(format!(
                    "GRANT pg_read_all_settings TO {};",
                    quote_ident(&role.name)
                )),
            });
        }
    }
    let has_opl = if seen.contains_key("output_plugin_libraries") {
        Some(true)
    } else if can_see_all {
        Some(false)
    } else {
        // Absent either because the server predates it or because this role
        // may not see it: cannot tell.
        unknowns.push(Unknown {
            what: "output_plugin_libraries".into(),
            reason: "absent from pg_settings for this role: the server may predate it, or hide it from roles without pg_read_all_settings".into(),
            grant: Some(format!(
                "GRANT pg_read_all_settings TO {};",
                quote_ident(&role.name)
            )),
        });
        None
    };
    let standby_slots_setting = ["synchronized_standby_slots", "standby_slot_names"]
        .into_iter()
        .find_map(|n| {
            get(n).map(|value| NamedSetting {
                name: n.to_owned(),
                value,
            })
        });
    let provider_logical_switch = ["rds.logical_replication", "cloudsql.logical_decoding"]
        .into_iter()
        .find_map(|n| {
            get(n).map(|value| NamedSetting {
                name: n.to_owned(),
                value,
            })
        });
    let settings = Settings {
        wal_level: get("wal_level"),
        max_slot_wal_keep_size_mb: mb("max_slot_wal_keep_size"),
        max_wal_size_mb: mb("max_wal_size"),
        max_replication_slots: get("max_replication_slots").and_then(|v| v.parse().ok()),
        max_wal_senders: get("max_wal_senders").and_then(|v| v.parse().ok()),
        idle_replication_slot_timeout_s: bytes("idle_replication_slot_timeout"),
        output_plugin_libraries: get("output_plugin_libraries").map(|v| {
            v.split(',')
                .map(|x| x.trim().trim_matches('"').to_owned())
                .filter(|x| !x.is_empty())
                .collect()
        }),
        has_output_plugin_libraries: has_opl,
        sync_replication_slots: get("sync_replication_slots"),
        standby_slots_setting,
        hot_standby_feedback: get("hot_standby_feedback"),
        provider_logical_switch,
    };
    Ok(settings)
}

/// The slots, or `None` (and an unknown) when the role may not read them.
async fn read_slots(
    s: &mut Session,
    version_num: u32,
    retained_from: &str,
    role: &str,
    unknowns: &mut Vec<Unknown>,
) -> Result<Option<Vec<Slot>>, CheckError> {
    let mut columns = String::from(
        "slot_name, plugin, slot_type, database, temporary, active, active_pid, \
         restart_lsn::text AS restart_lsn, confirmed_flush_lsn::text AS confirmed_flush_lsn, \
         wal_status, safe_wal_size",
    );
    columns.push_str(&format!(
        ", pg_wal_lsn_diff({retained_from}, restart_lsn)::bigint AS retained_bytes"
    ));
    if version_num >= 160_000 {
        columns.push_str(", conflicting");
    }
    if version_num >= 170_000 {
        columns.push_str(
            ", inactive_since::text AS inactive_since, \
             extract(epoch FROM now() - inactive_since)::bigint AS inactive_seconds, \
             invalidation_reason, failover, synced",
        );
    }
    let sql = format!("SELECT {columns} FROM pg_replication_slots ORDER BY slot_name");
    let rows = match s.probe("slots", &sql).await? {
        Probe::Rows(rows) => rows,
        Probe::Denied(why) => {
            unknowns.push(Unknown {
                what: "replication slots".into(),
                reason: format!("pg_replication_slots refused: {why}"),
                grant: Some(format!(
                    "GRANT SELECT ON pg_catalog.pg_replication_slots TO {};",
                    quote_ident(role)
                )),
            });
            return Ok(None);
        }
    };
    Ok(Some(
        rows.iter()
            .map(|r| {
                let active = boolean(r, "active").unwrap_or(false);
                let wal_status = text(r, "wal_status");
                let invalidation_reason = text(r, "invalidation_reason");
                let conflicting = boolean(r, "conflicting");
                let invalidated = wal_status.as_deref() == Some("lost")
                    || invalidation_reason.is_some()
                    || conflicting == Some(true);
                let state = if invalidated {
                    SlotState::Invalidated
                } else if active {
                    SlotState::Active
                } else {
                    SlotState::Stalled
                };
                Slot {
                    name: text(r, "slot_name").unwrap_or_default(),
                    slot_type: text(r, "slot_type").unwrap_or_default(),
                    plugin: text(r, "plugin"),
                    database: text(r, "database"),
                    temporary: boolean(r, "temporary").unwrap_or(false),
                    state,
                    active_pid: int(r, "active_pid"),
                    restart_lsn: text(r, "restart_lsn"),
                    confirmed_flush_lsn: text(r, "confirmed_flush_lsn"),
                    wal_status,
                    safe_wal_size: int(r, "safe_wal_size"),
                    retained_bytes: int(r, "retained_bytes"),
                    inactive_seconds: if active {
                        None
                    } else {
                        int(r, "inactive_seconds")
                    },
                    inactive_since: text(r, "inactive_since"),
                    invalidation_reason,
                    conflicting,
                    failover: boolean(r, "failover"),
                    synced: boolean(r, "synced"),
                }
            })
            .collect(),
    ))
}

/// Validates `schema.name` (or `name`) and returns it for `to_regclass`.
/// `schema.table` as SQL spells it (quoted for to_regclass), or a bare
/// table name, which the session's search_path resolves.
fn table_name(name: &str) -> Result<(String, String), CheckError> {
    use trellara_common::table_name::TableName;
    let trimmed = name.trim();
    if let Ok(qualified) = TableName::parse(trimmed) {
        return Ok((qualified.quoted(), qualified.to_string()));
    }
    let bare = !trimmed.is_empty()
        && trimmed.len() <= 63
        && trimmed
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || !c.is_ascii());
    if bare {
        Ok((trimmed.to_owned(), trimmed.to_owned()))
    } else {
        Err(CheckError::TableName(name.to_owned()))
    }
}

async fn read_tables(
    s: &mut Session,
    requested: &[String],
    unknowns: &mut Vec<Unknown>,
) -> Result<Tables, CheckError> {
    let mut missing = Vec::new();
    let mut oids = Vec::new();
    for name in requested {
        let (sql_name, name) = table_name(name)?;
        let sql = format!(
            "SELECT to_regclass({})::oid AS oid",
            quote_literal(&sql_name)
        );
        match s.probe("resolve table", &sql).await? {
            Probe::Rows(rows) => match rows.first().and_then(|r| int(r, "oid")) {
                Some(oid) => oids.push(oid),
                None => missing.push(name),
            },
            Probe::Denied(_) => missing.push(name),
        }
    }
    let filter = if requested.is_empty() {
        format!(
            "c.relkind IN ('r', 'p') AND NOT c.relispartition AND c.relpersistence <> 't' \
             AND n.nspname NOT IN ('pg_catalog', 'information_schema') \
             AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp%' \
             ORDER BY n.nspname, c.relname LIMIT {}",
            TABLE_SCAN_LIMIT + 1
        )
    } else if oids.is_empty() {
        return Ok(Tables {
            requested: true,
            missing,
            tables: Vec::new(),
            truncated: false,
        });
    } else {
        format!(
            "c.oid IN ({}) ORDER BY n.nspname, c.relname",
            oids.iter()
                .map(|o| o.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    // Key columns: the primary key's for DEFAULT, the identity index's for
    // INDEX. Non-key columns with non-plain storage can be TOASTed.
    let sql = format!(
        "SELECT c.oid, n.nspname, c.relname, c.relkind, c.relpersistence, c.relreplident, \
         EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary) AS has_pk, \
         EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident \
                 AND i.indisvalid AND i.indisunique AND i.indimmediate) AS has_identity_index, \
         (SELECT string_agg(a.attname, ',' ORDER BY a.attnum) FROM pg_attribute a \
            WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped AND a.attstorage <> 'p' \
            AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid \
                 AND (CASE WHEN c.relreplident = 'i' THEN i.indisreplident ELSE i.indisprimary END) \
                 AND a.attnum = ANY (i.indkey::int2[]))) AS toastable, \
         has_table_privilege(c.oid, 'select') AS can_select, \
         c.reltuples::bigint AS estimated_rows \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {filter}"
    );
    let rows = s.exec("tables", &sql).await?;
    let truncated = requested.is_empty() && rows.len() > TABLE_SCAN_LIMIT;
    let mut tables = Vec::new();
    for r in rows.iter().take(TABLE_SCAN_LIMIT) {
        let (Some(oid), Some(schema), Some(relname)) =
            (int(r, "oid"), text(r, "nspname"), text(r, "relname"))
        else {
            continue;
        };
        let kind = match r.get("relkind") {
            Some("r") => "table",
            Some("p") => "partitioned table",
            Some("v") => "view",
            Some("m") => "materialized view",
            Some("f") => "foreign table",
            Some("S") => "sequence",
            Some("i" | "I") => "index",
            _ => "relation",
        };
        let replident = r.get("relreplident").unwrap_or("");
        let has_pk = boolean(r, "has_pk").unwrap_or(false);
        let identity = match replident {
            "f" => Identity::Full,
            "d" if has_pk => Identity::PrimaryKey,
            "i" if boolean(r, "has_identity_index").unwrap_or(false) => Identity::Index,
            _ => Identity::None,
        };
        let publications = if kind == "partitioned table" {
            let sql = format!(
                "SELECT p.pubname, p.pubviaroot FROM pg_publication p WHERE p.puballtables \
                 OR EXISTS (SELECT 1 FROM pg_publication_tables pt \
                    JOIN pg_class pc ON pc.relname = pt.tablename \
                    JOIN pg_namespace pn ON pn.oid = pc.relnamespace AND pn.nspname = pt.schemaname \
                    WHERE pt.pubname = p.pubname AND pc.oid IN (SELECT relid FROM pg_partition_tree({oid}::oid::regclass))) \
                 ORDER BY 1"
            );
            match s.probe("partition publications", &sql).await? {
                Probe::Rows(rows) => rows
                    .iter()
                    .filter_map(|p| {
                        Some(TablePublication {
                            name: text(p, "pubname")?,
                            via_partition_root: boolean(p, "pubviaroot")?,
                        })
                    })
                    .collect(),
                Probe::Denied(why) => {
                    unknowns.push(Unknown {
                        what: format!("publications of {schema}.{relname}"),
                        reason: why,
                        grant: None,
                    });
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        tables.push(TableReadiness {
            name: format!("{}.{}", quote_ident(&schema), quote_ident(&relname)),
            kind: kind.to_owned(),
            replica_identity: match replident {
                "d" => "default",
                "i" => "index",
                "f" => "full",
                "n" => "nothing",
                _ => "unknown",
            }
            .to_owned(),
            identity,
            unlogged: r.get("relpersistence") == Some("u"),
            toastable_non_key_columns: if matches!(identity, Identity::Full | Identity::None) {
                Vec::new()
            } else {
                text(r, "toastable")
                    .map(|v| v.split(',').map(quote_ident).collect())
                    .unwrap_or_default()
            },
            publications,
            can_select: boolean(r, "can_select").unwrap_or(false),
            estimated_rows: int(r, "estimated_rows").filter(|n| *n >= 0),
        });
    }
    Ok(Tables {
        requested: !requested.is_empty(),
        missing,
        tables,
        truncated,
    })
}

/// The publications, or `None` (and an unknown) when the role may not
/// read them.
async fn read_publications(
    s: &mut Session,
    role: &str,
    unknowns: &mut Vec<Unknown>,
) -> Result<Option<Vec<Publication>>, CheckError> {
    let sql = "SELECT p.pubname, p.puballtables, p.pubviaroot, p.pubinsert, p.pubupdate, \
             p.pubdelete, p.pubtruncate, \
             (SELECT count(*) FROM pg_publication_tables t WHERE t.pubname = p.pubname) AS tables \
             FROM pg_publication p ORDER BY p.pubname";
    let rows = match s.probe("publications", sql).await? {
        Probe::Rows(rows) => rows,
        Probe::Denied(why) => {
            unknowns.push(Unknown {
                what: "publications".into(),
                reason: format!("pg_publication refused: {why}"),
                grant: Some(format!(
                    "GRANT SELECT ON pg_catalog.pg_publication, pg_catalog.pg_publication_tables TO {};",
                    quote_ident(role)
                )),
            });
            return Ok(None);
        }
    };
    Ok(rows
        .iter()
        .filter_map(|r| {
            let ops: Vec<&str> = [
                ("pubinsert", "insert"),
                ("pubupdate", "update"),
                ("pubdelete", "delete"),
                ("pubtruncate", "truncate"),
            ]
            .into_iter()
            .filter(|(c, _)| boolean(r, c) == Some(true))
            .map(|(_, n)| n)
            .collect();
            Some(Publication {
                name: text(r, "pubname")?,
                all_tables: boolean(r, "puballtables").unwrap_or(false),
                via_partition_root: boolean(r, "pubviaroot").unwrap_or(false),
                operations: ops.join(", "),
                tables: int(r, "tables").unwrap_or(0),
            })
        })
        .collect::<Vec<_>>()
        .into())
}

async fn read_conflicts(
    s: &mut Session,
    version_num: u32,
) -> Result<Option<Conflicts>, CheckError> {
    let logical = if version_num >= 160_000 {
        ", COALESCE(sum(confl_active_logicalslot), 0)::bigint AS logicalslot"
    } else {
        ""
    };
    let sql = format!(
        "SELECT COALESCE(sum(confl_tablespace), 0)::bigint AS tablespace, \
         COALESCE(sum(confl_lock), 0)::bigint AS lock_conflicts, \
         COALESCE(sum(confl_snapshot), 0)::bigint AS snapshot, \
         COALESCE(sum(confl_bufferpin), 0)::bigint AS bufferpin, \
         COALESCE(sum(confl_deadlock), 0)::bigint AS deadlock{logical} \
         FROM pg_stat_database_conflicts"
    );
    Ok(match s.probe("conflicts", &sql).await? {
        Probe::Rows(rows) => rows.first().map(|r| Conflicts {
            tablespace: int(r, "tablespace").unwrap_or(0),
            lock: int(r, "lock_conflicts").unwrap_or(0),
            snapshot: int(r, "snapshot").unwrap_or(0),
            bufferpin: int(r, "bufferpin").unwrap_or(0),
            deadlock: int(r, "deadlock").unwrap_or(0),
            active_logicalslot: int(r, "logicalslot"),
        }),
        Probe::Denied(_) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_scale() {
        assert_eq!(scaled("-1", Some("MB")), Some(-1));
        assert_eq!(scaled("1", Some("MB")), Some(1 << 20));
        assert_eq!(scaled("2", Some("min")), Some(120));
        assert_eq!(scaled("1500", Some("ms")), Some(1));
        assert_eq!(scaled("x", None), None);
    }

    #[test]
    fn identifiers_quote() {
        assert_eq!(quote_ident("orders"), "orders");
        assert_eq!(quote_ident("Orders"), "\"Orders\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }

    #[test]
    fn table_names_are_checked() {
        assert_eq!(
            table_name("public.orders").unwrap().0,
            "\"public\".\"orders\""
        );
        assert_eq!(table_name("Public.Orders").unwrap().1, "public.orders");
        assert_eq!(table_name("s.\"a.b;c\"").unwrap().0, "\"s\".\"a.b;c\"");
        assert!(table_name("orders").is_ok());
        assert!(table_name("a.b.c").is_err());
        assert!(table_name("x; DROP TABLE y").is_err());
        assert!(table_name("").is_err());
    }
}
