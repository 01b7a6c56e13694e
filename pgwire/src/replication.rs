//! Replication commands and the CopyBoth stream of `START_REPLICATION`.

use super::WireError;
use super::connection::{Backend, Connection, PgError};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use trellara_common::Lsn;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentifySystem {
    pub system_id: u64,
    pub timeline: u32,
    pub xlogpos: Lsn,
    pub dbname: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotCreated {
    pub slot_name: String,
    pub consistent_point: Lsn,
    /// Set when the snapshot was exported; valid until the next command on
    /// this session.
    pub snapshot_name: Option<String>,
}

/// A row of `pg_replication_slots`; columns a major lacks are `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub slot_name: String,
    pub plugin: Option<String>,
    pub slot_type: String,
    pub database: Option<String>,
    pub active: bool,
    pub active_pid: Option<i32>,
    pub restart_lsn: Option<Lsn>,
    pub confirmed_flush_lsn: Option<Lsn>,
    pub wal_status: Option<String>,
    /// PG 17+ (`invalidation_reason`); PG 16 reports only `conflicting`.
    pub invalidation_reason: Option<String>,
}

/// Slot names the server accepts: lower-case letters, digits, underscore.
pub fn validate_slot_name(name: &str) -> Result<(), WireError> {
    if !trellara_common::slot_name::is_valid(name) {
        return Err(WireError::Config(format!(
            "slot name {name:?} is invalid: use 1-63 lower-case letters, digits and underscores"
        )));
    }
    Ok(())
}

/// A literal for the replication grammar, which knows only `'...'` with
/// doubled quotes (never `E'...'`).
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

fn lsn(value: Option<&str>, what: &str) -> Result<Lsn, WireError> {
    value
        .ok_or_else(|| WireError::Protocol(format!("{what} missing")))?
        .parse()
        .map_err(|e| WireError::Protocol(format!("{what}: {e}")))
}

impl Connection {
    pub async fn identify_system(&mut self) -> Result<IdentifySystem, WireError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = rows
            .first()
            .ok_or_else(|| WireError::Protocol("IDENTIFY_SYSTEM returned no row".into()))?;
        let parse = |c: &str| row.get(c).map(str::to_owned);
        Ok(IdentifySystem {
            system_id: parse("systemid")
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| WireError::Protocol("IDENTIFY_SYSTEM systemid".into()))?,
            timeline: parse("timeline")
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| WireError::Protocol("IDENTIFY_SYSTEM timeline".into()))?,
            xlogpos: lsn(row.get("xlogpos"), "IDENTIFY_SYSTEM xlogpos")?,
            dbname: parse("dbname").unwrap_or_default(),
        })
    }

    /// `CREATE_REPLICATION_SLOT name LOGICAL pgoutput`, exporting a snapshot
    /// when asked (keep the session idle until every reader imported it),
    /// with FAILOVER on PG 17+ when asked.
    pub async fn create_logical_slot(
        &mut self,
        name: &str,
        export_snapshot: bool,
        failover: bool,
    ) -> Result<SlotCreated, WireError> {
        self.create_logical_slot_for(name, "pgoutput", export_snapshot, failover)
            .await
    }

    /// [`Self::create_logical_slot`] with another output plugin (e.g.
    /// `trellara` for the native path).
    pub async fn create_logical_slot_for(
        &mut self,
        name: &str,
        plugin: &str,
        export_snapshot: bool,
        failover: bool,
    ) -> Result<SlotCreated, WireError> {
        validate_slot_name(name)?;
        if plugin.is_empty()
            || !plugin
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(WireError::Config(format!(
                "output plugin name {plugin:?} must be lower-case letters, digits and _"
            )));
        }
        let version = self.server_version_num();
        let mut options = vec![format!(
            "SNAPSHOT {}",
            if export_snapshot {
                "'export'"
            } else {
                "'nothing'"
            }
        )];
        if failover {
            if version < 170000 {
                return Err(WireError::Config(format!(
                    "failover slots need PostgreSQL 17 or later; the server is {version}\nhint: drop failover from the slot settings"
                )));
            }
            options.push("FAILOVER true".into());
        }
        let sql = format!(
            "CREATE_REPLICATION_SLOT {name} LOGICAL {plugin} ({})",
            options.join(", ")
        );
        self.create_slot(&sql, name).await
    }

    /// Runs a `CREATE_REPLICATION_SLOT` and reads its one row.
    async fn create_slot(&mut self, sql: &str, name: &str) -> Result<SlotCreated, WireError> {
        let rows = self.simple_query(sql).await?;
        let row = rows
            .first()
            .ok_or_else(|| WireError::Protocol("CREATE_REPLICATION_SLOT returned no row".into()))?;
        Ok(SlotCreated {
            slot_name: row.get("slot_name").unwrap_or(name).to_owned(),
            consistent_point: lsn(row.get("consistent_point"), "consistent_point")?,
            snapshot_name: row.get("snapshot_name").map(str::to_owned),
        })
    }

    /// A temporary slot (gone when this session ends, however it ends)
    /// that exports its snapshot: a consistent point and the snapshot of
    /// exactly what committed before it, for a copy at a boundary of its
    /// own. pgoutput, which every server has; nothing is ever streamed
    /// from it.
    pub async fn create_temporary_slot(&mut self, name: &str) -> Result<SlotCreated, WireError> {
        validate_slot_name(name)?;
        let sql = format!(
            "CREATE_REPLICATION_SLOT {name} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')"
        );
        self.create_slot(&sql, name).await
    }

    pub async fn drop_slot(&mut self, name: &str) -> Result<(), WireError> {
        validate_slot_name(name)?;
        self.simple_query(&format!("DROP_REPLICATION_SLOT {name} WAIT"))
            .await
            .map(drop)
    }

    /// The slot's row of `pg_replication_slots`, if it exists. Do not call
    /// between creating a slot with an exported snapshot and its import:
    /// any command ends the export.
    pub async fn slot_info(&mut self, name: &str) -> Result<Option<SlotInfo>, WireError> {
        validate_slot_name(name)?;
        let rows = self
            .simple_query(&format!(
                "SELECT * FROM pg_catalog.pg_replication_slots WHERE slot_name = {}",
                quote_literal(name)
            ))
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let opt_lsn = |c: &str| row.get(c).and_then(|v| v.parse().ok());
        Ok(Some(SlotInfo {
            slot_name: name.to_owned(),
            plugin: row.get("plugin").map(str::to_owned),
            slot_type: row.get("slot_type").unwrap_or_default().to_owned(),
            database: row.get("database").map(str::to_owned),
            active: row.get("active") == Some("t"),
            active_pid: row.get("active_pid").and_then(|v| v.parse().ok()),
            restart_lsn: opt_lsn("restart_lsn"),
            confirmed_flush_lsn: opt_lsn("confirmed_flush_lsn"),
            wal_status: row.get("wal_status").map(str::to_owned),
            invalidation_reason: row
                .get("invalidation_reason")
                .map(str::to_owned)
                .or_else(|| (row.get("conflicting") == Some("t")).then(|| "conflicting".into())),
        }))
    }

    /// `START_REPLICATION SLOT s LOGICAL start (options)`. `start` must be a
    /// position the caller already made durable (or 0/0): the server skips
    /// every transaction that committed before it.
    pub async fn start_replication(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, String)],
    ) -> Result<ReplicationStream, WireError> {
        validate_slot_name(slot)?;
        let options: Vec<String> = options
            .iter()
            .map(|(k, v)| format!("\"{k}\" {}", quote_literal(v)))
            .collect();
        let sql = format!(
            "START_REPLICATION SLOT {slot} LOGICAL {start} ({})",
            options.join(", ")
        );
        frontend::query(&sql, &mut self.wbuf)?;
        self.flush().await?;
        loop {
            match self.read().await? {
                Backend::CopyBoth => break,
                Backend::Message(Message::ErrorResponse(e)) => {
                    let err = PgError::parse(&e);
                    // Drain to ReadyForQuery so the session state is clean.
                    while !matches!(
                        self.read().await?,
                        Backend::Message(Message::ReadyForQuery(_))
                    ) {}
                    return Err(err.into());
                }
                Backend::Message(Message::NoticeResponse(_)) => {}
                _ => return Err(WireError::Protocol("expected CopyBothResponse".into())),
            }
        }
        Ok(ReplicationStream {
            conn: self,
            durable: start,
            last_status: None,
        })
    }
}

/// One message of the replication stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationEvent {
    XLogData { start: Lsn, end: Lsn, data: Bytes },
    Keepalive { wal_end: Lsn, reply_requested: bool },
}

#[derive(Debug)]
pub struct ReplicationStream {
    conn: Connection,
    durable: Lsn,
    last_status: Option<Instant>,
}

/// Microseconds between the Unix and PostgreSQL epochs.
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

impl ReplicationStream {
    /// The next event; `Ok(None)` when the server ended the stream.
    /// Cancel-safe: a dropped call loses no bytes.
    pub async fn recv(&mut self) -> Result<Option<ReplicationEvent>, WireError> {
        loop {
            match self.conn.read().await? {
                Backend::Message(Message::CopyData(body)) => {
                    let mut data = body.into_bytes();
                    let event = match data.first() {
                        Some(b'w') if data.len() >= 25 => {
                            data.advance(1);
                            let start = Lsn(data.get_u64());
                            let end = Lsn(data.get_u64());
                            data.advance(8);
                            ReplicationEvent::XLogData { start, end, data }
                        }
                        Some(b'k') if data.len() >= 18 => {
                            data.advance(1);
                            let wal_end = Lsn(data.get_u64());
                            data.advance(8);
                            ReplicationEvent::Keepalive {
                                wal_end,
                                reply_requested: data.get_u8() == 1,
                            }
                        }
                        other => {
                            return Err(WireError::Protocol(format!(
                                "unknown replication message {:?} ({} bytes)",
                                other.map(|b| char::from(*b)),
                                data.len()
                            )));
                        }
                    };
                    return Ok(Some(event));
                }
                Backend::Message(Message::CopyDone) => return Ok(None),
                Backend::Message(Message::ErrorResponse(e)) => {
                    return Err(PgError::parse(&e).into());
                }
                Backend::Message(Message::NoticeResponse(_) | Message::ParameterStatus(_)) => {}
                _ => return Err(WireError::Protocol("unexpected message in COPY".into())),
            }
        }
    }

    /// Declares everything up to `lsn` durable. Never moves backwards.
    pub fn set_durable(&mut self, lsn: Lsn) {
        self.durable = self.durable.max(lsn);
    }

    pub fn durable(&self) -> Lsn {
        self.durable
    }

    /// Whether a periodic status update is due.
    pub fn status_due(&self, every: Duration) -> bool {
        self.last_status.is_none_or(|t| t.elapsed() >= every)
    }

    /// Standby status update: write = flush = apply = the durable position.
    pub async fn send_status(&mut self) -> Result<(), WireError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64)
            - PG_EPOCH_OFFSET_MICROS;
        let mut msg = BytesMut::with_capacity(34);
        msg.put_u8(b'r');
        for _ in 0..3 {
            msg.put_u64(self.durable.0);
        }
        msg.put_i64(now);
        msg.put_u8(0);
        frontend::CopyData::new(&msg[..])?.write(&mut self.conn.wbuf);
        self.conn.flush().await?;
        self.last_status = Some(Instant::now());
        Ok(())
    }

    /// Ends the stream (CopyDone) and returns the session.
    pub async fn finish(mut self) -> Result<Connection, WireError> {
        frontend::copy_done(&mut self.conn.wbuf);
        self.conn.flush().await?;
        loop {
            match self.conn.read().await? {
                Backend::Message(Message::ReadyForQuery(_)) => return Ok(self.conn),
                Backend::Message(Message::ErrorResponse(e)) => {
                    return Err(PgError::parse(&e).into());
                }
                _ => {}
            }
        }
    }

    pub fn backend_pid(&self) -> i32 {
        self.conn.backend_pid()
    }

    /// See [`Connection::pace_reads`].
    pub fn pace_reads(&mut self, every: Option<std::time::Duration>) {
        self.conn.pace_reads(every);
    }
}
