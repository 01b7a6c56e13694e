//! Durable flow state in the target database, schema `trellara`: the apply
//! checkpoint ([`checkpoint`]), quarantine records ([`quarantine`]), the
//! snapshot state machine ([`runs`], [`SnapshotState`]), verify evidence
//! ([`verdicts`]), why a flow stopped, slot claims, and the advisory locks
//! that keep one process per part of a flow. Reports and evidence read
//! these tables, never process memory. This module and its children hold
//! every statement on a `trellara.*` table.
//!
//! The checkpoint row is written in the same target transaction as the rows
//! it accounts for; that is what makes redelivery detectable.

pub mod checkpoint;
pub mod fence;
pub mod quarantine;
pub mod runs;
pub mod schema;
pub mod verdicts;

use crate::service::Role;
use tokio_postgres::Client;

/// A `pg_lsn` column read as the server stores it: no text to parse.
fn lsn(l: tokio_postgres::types::PgLsn) -> trellara_common::Lsn {
    trellara_common::Lsn(u64::from(l))
}

/// The state tables, each keyed by `flow` (teardown removes a flow's rows
/// from each).
pub const TABLES: [&str; 8] = [
    "trellara.checkpoints",
    "trellara.flow_stops",
    "trellara.schema_changes",
    "trellara.slot_claims",
    "trellara.snapshot_runs",
    "trellara.snapshot_tables",
    "trellara.quarantine",
    "trellara.verify_runs",
];

const SCHEMA: &str = "
CREATE SCHEMA IF NOT EXISTS trellara;
CREATE TABLE IF NOT EXISTS trellara.checkpoints (
    flow text PRIMARY KEY,
    source_id text NOT NULL,
    commit_lsn pg_lsn NOT NULL,
    end_lsn pg_lsn NOT NULL,
    xid bigint NOT NULL,
    transactions bigint NOT NULL DEFAULT 0,
    duplicates_skipped bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS trellara.quarantine (
    flow text NOT NULL,
    commit_lsn pg_lsn NOT NULL,
    xid bigint NOT NULL,
    reason text NOT NULL,
    recovery text NOT NULL,
    envelope bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    attempts int NOT NULL DEFAULT 1,
    resolved_at timestamptz,
    PRIMARY KEY (flow, commit_lsn)
);
CREATE TABLE IF NOT EXISTS trellara.snapshot_runs (
    flow text PRIMARY KEY,
    run_id bigint NOT NULL,
    state text NOT NULL CHECK (state IN ('planned', 'copying', 'copied',
        'stream_handoff_ready', 'verified', 'failed_recoverable')),
    consistent_lsn pg_lsn,
    reason text,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS trellara.snapshot_tables (
    flow text NOT NULL,
    run_id bigint NOT NULL,
    table_name text NOT NULL,
    rows_copied bigint NOT NULL,
    copied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (flow, table_name)
);
-- The schema fingerprint the copy saw (capture pins it); added after 0.1.
-- Guarded: ALTER TABLE locks the table and needs its owner even when the
-- column exists, and a role that only uses the state tables must not fail.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = 'trellara' AND table_name = 'snapshot_tables'
                     AND column_name = 'fingerprint') THEN
        ALTER TABLE trellara.snapshot_tables ADD COLUMN fingerprint bigint;
    END IF;
END $$;
-- A table that joined a following flow has a boundary of its own: its
-- changes that committed before it are in its copy. NULL: the run's.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = 'trellara' AND table_name = 'snapshot_tables'
                     AND column_name = 'boundary_lsn') THEN
        ALTER TABLE trellara.snapshot_tables ADD COLUMN boundary_lsn pg_lsn;
    END IF;
END $$;
-- A table copied at a boundary of its own (a join, a one-table reseed)
-- has a snapshot state of its own, which verify promotes. NULL: the run's.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = 'trellara' AND table_name = 'snapshot_tables'
                     AND column_name = 'state') THEN
        ALTER TABLE trellara.snapshot_tables ADD COLUMN state text
            CHECK (state IN ('stream_handoff_ready', 'verified', 'failed_recoverable'));
    END IF;
END $$;
-- The whole description the fingerprint was taken of (an encoded
-- RelationSchema): what capture diffs a later change against.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = 'trellara' AND table_name = 'snapshot_tables'
                     AND column_name = 'pinned_schema') THEN
        ALTER TABLE trellara.snapshot_tables ADD COLUMN pinned_schema bytea;
    END IF;
END $$;
-- Where verify holds the applier (state::fence); NULL or without its
-- holder's advisory lock: nowhere.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = 'trellara' AND table_name = 'checkpoints'
                     AND column_name = 'fence_lsn') THEN
        ALTER TABLE trellara.checkpoints ADD COLUMN fence_lsn pg_lsn;
    END IF;
END $$;
-- A transaction held at a schema change no sink applies on its own: the
-- table, and its description after the change (an encoded RelationSchema)
-- that `schema accept` checks the target against. NULL: not a hold.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = 'trellara' AND table_name = 'quarantine'
                     AND column_name = 'held_table') THEN
        ALTER TABLE trellara.quarantine ADD COLUMN held_table text;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = 'trellara' AND table_name = 'quarantine'
                     AND column_name = 'held_schema') THEN
        ALTER TABLE trellara.quarantine ADD COLUMN held_schema bytea;
    END IF;
END $$;
-- Why a flow's last run stopped when it needs someone (schema drift, a
-- lost slot, a record of another source); cleared by a run that ends well.
CREATE TABLE IF NOT EXISTS trellara.flow_stops (
    flow text PRIMARY KEY,
    kind text NOT NULL,
    detail text NOT NULL,
    commands text[] NOT NULL,
    stopped_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS trellara.verify_runs (
    flow text NOT NULL,
    verified_at timestamptz NOT NULL DEFAULT now(),
    verdict text NOT NULL,
    evidence jsonb NOT NULL
);
-- The slots this flow is about to create or has created on its source,
-- written before the creation: a slot of the flow's name without a claim
-- here is another flow's (a config elsewhere with the same flow name).
-- Each schema change a sink applied (or found already applied), written
-- in the transaction of its first rows under the new schema: the sink's
-- acknowledgement of the change's barrier.
CREATE TABLE IF NOT EXISTS trellara.schema_changes (
    flow text NOT NULL,
    barrier_id text NOT NULL,
    table_name text NOT NULL,
    kind text NOT NULL,
    commit_lsn pg_lsn NOT NULL,
    statement text NOT NULL,
    fingerprint_before bigint NOT NULL,
    fingerprint_after bigint NOT NULL,
    outcome text NOT NULL CHECK (outcome IN ('applied', 'already_present')),
    acknowledged_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (flow, barrier_id)
);
CREATE TABLE IF NOT EXISTS trellara.slot_claims (
    flow text NOT NULL,
    slot text NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (flow, slot)
);
-- The column a schema change was on (NULL: a table kind), for verify to
-- explain a target column the source no longer has.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = 'trellara' AND table_name = 'schema_changes'
                     AND column_name = 'column_name') THEN
        ALTER TABLE trellara.schema_changes ADD COLUMN column_name text;
    END IF;
END $$;
";

/// The state tables the target has (one made by an older build may lack
/// the newer ones).
async fn existing_tables(client: &Client) -> Result<Vec<&'static str>, tokio_postgres::Error> {
    let mut out = Vec::new();
    for table in TABLES {
        let exists: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
            .await?
            .get(0);
        if exists {
            out.push(table);
        }
    }
    Ok(out)
}

/// How many rows the state tables hold for `flow`.
pub async fn rows_of(client: &Client, flow: &str) -> Result<i64, tokio_postgres::Error> {
    let mut rows = 0;
    for table in existing_tables(client).await? {
        rows += client
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE flow = $1"),
                &[&flow],
            )
            .await?
            .get::<_, i64>(0);
    }
    Ok(rows)
}

/// Deletes every row of `flow` from the state tables, in one transaction.
pub async fn forget(client: &Client, flow: &str) -> Result<(), tokio_postgres::Error> {
    let mut sql = String::from("BEGIN;");
    for table in existing_tables(client).await? {
        sql.push_str(&format!(
            " DELETE FROM {table} WHERE flow = {};",
            postgres_protocol::escape::escape_literal(flow)
        ));
    }
    sql.push_str(" COMMIT");
    client.batch_execute(&sql).await
}

/// The columns [`SCHEMA`] adds to a table an older build made, as
/// (table, column).
const ADDED_COLUMNS: [(&str, &str); 8] = [
    ("trellara.schema_changes", "column_name"),
    ("trellara.quarantine", "held_table"),
    ("trellara.quarantine", "held_schema"),
    ("trellara.snapshot_tables", "fingerprint"),
    ("trellara.snapshot_tables", "pinned_schema"),
    ("trellara.snapshot_tables", "boundary_lsn"),
    ("trellara.snapshot_tables", "state"),
    ("trellara.checkpoints", "fence_lsn"),
];

/// Creates the state schema if missing or older than this build (each
/// table and column of [`SCHEMA`]). A current one costs one query: every
/// run opens with this, and the DDL batch took 6-7 ms even when it changed
/// nothing; nor does a role without the right to create need it then.
pub async fn ensure(client: &Client) -> Result<(), tokio_postgres::Error> {
    if current(client).await? {
        return Ok(());
    }
    client.batch_execute(SCHEMA).await
}

/// Whether the target's state schema has every table and column this
/// build uses (readers of an older one leave the newer columns alone).
pub async fn current(client: &Client) -> Result<bool, tokio_postgres::Error> {
    let tables: Vec<&str> = TABLES.to_vec();
    let (added_tables, added_columns): (Vec<&str>, Vec<&str>) = ADDED_COLUMNS.into_iter().unzip();
    let current: bool = client
        .query_one(
            "SELECT (SELECT bool_and(to_regclass(t) IS NOT NULL) FROM unnest($1::text[]) t)
                AND (SELECT count(*) = cardinality($2::text[]) FROM unnest($2::text[], $3::text[]) c(t, col)
                     WHERE EXISTS (SELECT 1 FROM pg_attribute a
                                   WHERE a.attrelid = to_regclass(c.t) AND a.attname = c.col
                                     AND NOT a.attisdropped))",
            &[&tables, &added_tables, &added_columns],
        )
        .await?
        .get(0);
    Ok(current)
}

/// Why a flow stopped, as [`record_stop`] wrote it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stop {
    pub kind: String,
    pub detail: String,
    pub commands: Vec<String>,
    pub stopped_at: String,
}

/// Records why `flow` stopped (replacing an earlier record).
pub async fn record_stop(
    client: &Client,
    flow: &str,
    kind: &str,
    detail: &str,
    commands: &[String],
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO trellara.flow_stops (flow, kind, detail, commands) VALUES ($1, $2, $3, $4)
             ON CONFLICT (flow) DO UPDATE SET kind = EXCLUDED.kind, detail = EXCLUDED.detail,
                commands = EXCLUDED.commands, stopped_at = now()",
            &[&flow, &kind, &detail, &commands],
        )
        .await
        .map(drop)
}

/// Records, before creating it, that `slot` on the source is `flow`'s.
pub async fn claim_slot(
    client: &Client,
    flow: &str,
    slot: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO trellara.slot_claims (flow, slot) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&flow, &slot],
        )
        .await
        .map(drop)
}

/// Whether this target records `slot` as `flow`'s: claimed, or (a flow
/// that ran before claims existed) snapshotted here. Read-only: a target
/// without the state tables owns nothing.
pub async fn owns_slot(
    client: &Client,
    flow: &str,
    slot: &str,
) -> Result<bool, tokio_postgres::Error> {
    let tables: (bool, bool) = {
        let row = client
            .query_one(
                "SELECT to_regclass('trellara.slot_claims') IS NOT NULL,
                        to_regclass('trellara.snapshot_runs') IS NOT NULL",
                &[],
            )
            .await?;
        (row.get(0), row.get(1))
    };
    let claimed = tables.0
        && client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM trellara.slot_claims WHERE flow = $1 AND slot = $2)",
                &[&flow, &slot],
            )
            .await?
            .get::<_, bool>(0);
    let snapshotted = tables.1
        && client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM trellara.snapshot_runs WHERE flow = $1)",
                &[&flow],
            )
            .await?
            .get::<_, bool>(0);
    Ok(claimed || snapshotted)
}

/// How long [`lock_flow`] waits for a lock held by another session.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);

/// The advisory lock names a role holds, one per part of the flow: the
/// capture side under the flow's name (as before the roles were split),
/// the apply side under `<flow>:apply` (a flow name has no `:`).
fn lock_names(flow: &str, role: Role) -> Vec<(String, &'static str)> {
    let capture = (flow.to_owned(), "capture");
    let apply = (format!("{flow}:apply"), "apply");
    match role {
        Role::Both => vec![capture, apply],
        Role::Relay => vec![capture],
        Role::Apply => vec![apply],
    }
}

/// Takes the flow's locks for `role` on the target for this session: one
/// process plays each part of a flow against a target, whichever host it
/// is on (a local log lock only covers one machine). Session-level, so
/// they go with the session: a process that dies or loses its connection
/// frees them. None: taken; Some: who holds one (and none is kept).
pub async fn lock_flow(
    client: &Client,
    flow: &str,
    role: Role,
) -> Result<Option<String>, tokio_postgres::Error> {
    let names = lock_names(flow, role);
    // A process killed a moment ago leaves its session until the server
    // notices (at the end of the statement it was running): worth a wait.
    let patience = std::time::Instant::now() + LOCK_PATIENCE;
    let refused = loop {
        let mut taken = Vec::new();
        let mut refused = None;
        for (name, part) in &names {
            let got: bool = client
                .query_one(
                    "SELECT pg_try_advisory_lock(hashtext('trellara.flow'), hashtext($1))",
                    &[name],
                )
                .await?
                .get(0);
            if !got {
                refused = Some((name, *part));
                break;
            }
            taken.push(name);
        }
        let Some(refused) = refused else {
            return Ok(None);
        };
        // All or none: a half-taken set would block the other role.
        for name in taken {
            client
                .execute(
                    "SELECT pg_advisory_unlock(hashtext('trellara.flow'), hashtext($1))",
                    &[name],
                )
                .await?;
        }
        if std::time::Instant::now() >= patience {
            break refused;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    let (name, part) = refused;
    // The two-key form shows in pg_locks as classid, objid (as oids) with
    // objsubid 2.
    let holder = client
        .query_opt(
            "SELECT a.pid, coalesce(host(a.client_addr), 'a local socket'), a.application_name
             FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND l.classid::int8 = (hashtext('trellara.flow')::int8 & 4294967295)
               AND l.objid::int8 = (hashtext($1)::int8 & 4294967295)",
            &[name],
        )
        .await?;
    Ok(Some(holder.map_or_else(
        || format!("another session (not visible to this role), playing its {part} part,"),
        |r| {
            let (pid, from, app): (i32, String, String) = (r.get(0), r.get(1), r.get(2));
            format!(
                "the target session of pid {pid} from {from} (application_name {app:?}), playing its {part} part,"
            )
        },
    )))
}

/// Whether another session holds the flow's apply lock on this target: an
/// applier is at work (a `run`, or the apply service, from any host).
pub async fn applying(client: &Client, flow: &str) -> Result<bool, tokio_postgres::Error> {
    let (name, _) = lock_names(flow, Role::Apply).remove(0);
    Ok(client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l
             WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted AND l.pid <> pg_backend_pid()
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND l.classid::int8 = (hashtext('trellara.flow')::int8 & 4294967295)
               AND l.objid::int8 = (hashtext($1)::int8 & 4294967295))",
            &[&name],
        )
        .await?
        .get(0))
}

/// A target session of its own that holds a flow's locks for as long as
/// it lives: a follower keeps it across its retry rounds, so another
/// process cannot take the flow while this one waits to follow again.
#[derive(Debug)]
pub struct FlowLock {
    client: Client,
    flow: String,
    names: Vec<String>,
    /// A heartbeat found the lock gone (or could not ask in time).
    lost: std::sync::atomic::AtomicBool,
}

/// How often a held lock is confirmed, and how long one confirmation may
/// take: a session a NAT or load balancer dropped silently never reports
/// its close, so the lock is asked about, not assumed.
const LOCK_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(5);
const LOCK_HEARTBEAT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl FlowLock {
    /// Takes the locks of `role` on `client`, a session used for nothing
    /// else. Err with who holds one when another session does.
    pub async fn take(
        client: Client,
        flow: &str,
        role: Role,
    ) -> Result<Result<Self, String>, tokio_postgres::Error> {
        // A session idle for hours is the point: no idle timeout ends it.
        client
            .batch_execute(
                "SELECT set_config('idle_session_timeout', '0', false) \
                 WHERE current_setting('idle_session_timeout', true) IS NOT NULL",
            )
            .await?;
        Ok(match lock_flow(&client, flow, role).await? {
            None => Ok(FlowLock {
                client,
                flow: flow.to_owned(),
                names: lock_names(flow, role).into_iter().map(|(n, _)| n).collect(),
                lost: std::sync::atomic::AtomicBool::new(false),
            }),
            Some(holder) => Err(holder),
        })
    }

    /// Whether the lock is known gone: its session ended (the target
    /// restarted, or someone terminated it), or a heartbeat failed.
    pub fn is_lost(&self) -> bool {
        self.client.is_closed() || self.lost.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Resolves once the lock is lost: every [`LOCK_HEARTBEAT`] the session
    /// is asked whether it still holds every lock it took, and an answer
    /// that does not come within [`LOCK_HEARTBEAT_TIMEOUT`] counts as no.
    pub async fn lost(&self) {
        let expected = i64::try_from(self.names.len()).unwrap_or(i64::MAX);
        while !self.is_lost() {
            tokio::time::sleep(LOCK_HEARTBEAT).await;
            let held = tokio::time::timeout(
                LOCK_HEARTBEAT_TIMEOUT,
                self.client.query_one(
                    "SELECT count(*) FROM pg_locks
                     WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND objsubid = 2 AND granted
                       AND classid::int8 = (hashtext('trellara.flow')::int8 & 4294967295)
                       AND objid::int8 IN (SELECT hashtext(n)::int8 & 4294967295 FROM unnest($1::text[]) n)",
                    &[&self.names],
                ),
            )
            .await;
            if !matches!(held, Ok(Ok(ref row)) if row.get::<_, i64>(0) == expected) {
                tracing::warn!(flow = %self.flow, "the flow's target lock is gone");
                self.lost.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

/// Forgets a recorded stop: the flow ran again and ended well.
pub async fn clear_stop(client: &Client, flow: &str) -> Result<(), tokio_postgres::Error> {
    client
        .execute("DELETE FROM trellara.flow_stops WHERE flow = $1", &[&flow])
        .await
        .map(drop)
}

/// The recorded stop of `flow`, if any (none on a target whose state
/// tables predate the record).
pub async fn stop(client: &Client, flow: &str) -> Result<Option<Stop>, tokio_postgres::Error> {
    let exists: bool = client
        .query_one("SELECT to_regclass('trellara.flow_stops') IS NOT NULL", &[])
        .await?
        .get(0);
    if !exists {
        return Ok(None);
    }
    Ok(client
        .query_opt(
            "SELECT kind, detail, commands, stopped_at::text FROM trellara.flow_stops WHERE flow = $1",
            &[&flow],
        )
        .await?
        .map(|r| Stop {
            kind: r.get(0),
            detail: r.get(1),
            commands: r.get(2),
            stopped_at: r.get(3),
        }))
}

/// Whether the target holds the state tables as [`ensure`] makes them:
/// commands that only read (status, repair plan) create nothing.
pub async fn present(client: &Client) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "SELECT to_regclass('trellara.checkpoints') IS NOT NULL
                AND to_regclass('trellara.quarantine') IS NOT NULL
                AND to_regclass('trellara.snapshot_runs') IS NOT NULL
                AND to_regclass('trellara.verify_runs') IS NOT NULL
                AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('trellara.snapshot_tables')
                            AND attname = 'fingerprint' AND NOT attisdropped)",
            &[],
        )
        .await?
        .get(0))
}

/// The snapshot state machine's states, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotState {
    Planned,
    Copying,
    Copied,
    StreamHandoffReady,
    Verified,
    FailedRecoverable,
}

impl SnapshotState {
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotState::Planned => "planned",
            SnapshotState::Copying => "copying",
            SnapshotState::Copied => "copied",
            SnapshotState::StreamHandoffReady => "stream_handoff_ready",
            SnapshotState::Verified => "verified",
            SnapshotState::FailedRecoverable => "failed_recoverable",
        }
    }

    pub fn parse(s: &str) -> Option<SnapshotState> {
        Some(match s {
            "planned" => SnapshotState::Planned,
            "copying" => SnapshotState::Copying,
            "copied" => SnapshotState::Copied,
            "stream_handoff_ready" => SnapshotState::StreamHandoffReady,
            "verified" => SnapshotState::Verified,
            "failed_recoverable" => SnapshotState::FailedRecoverable,
            _ => return None,
        })
    }

    /// Whether moving from `self` to `next` is allowed. Forward one step at
    /// a time; verify alone promotes to verified and may demote verified;
    /// any state may fail; a failed run restarts only by re-planning.
    pub fn may_become(self, next: SnapshotState) -> bool {
        use SnapshotState as S;
        matches!(
            (self, next),
            (S::Planned, S::Copying)
                | (S::Copying, S::Copied)
                | (S::Copied, S::StreamHandoffReady)
                | (S::StreamHandoffReady, S::Verified)
                | (S::Verified, S::FailedRecoverable)
                | (S::FailedRecoverable, S::Planned)
                | (_, S::FailedRecoverable)
        )
    }
}

/// A slot of the flow's name that the flow's target never claimed.
#[derive(Debug)]
pub struct NotOurSlot<'a>(pub &'a str);

impl std::fmt::Display for NotOurSlot<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "replication slot {} exists on the source database and this flow's target has no record of creating it: another config's flow of the same name (or another tool) streams it, and taking it over would lose that flow's changes",
            self.0
        )
    }
}

/// The fix for [`NotOurSlot`].
pub fn not_our_slot_fix(slot: &str) -> String {
    format!(
        "give this flow its own source.slot and source.publication in trellara.yml (or another flow name); if nothing uses {slot}, drop it: SELECT pg_drop_replication_slot('{slot}')"
    )
}

#[cfg(test)]
mod tests {
    use super::SnapshotState as S;

    /// `ensure` skips the DDL when the tables and added columns it checks
    /// are there: a table or column the DDL makes and the check misses
    /// would never reach an older target.
    #[test]
    fn the_schema_check_covers_every_table_and_column_the_ddl_makes() {
        let words: Vec<&str> = super::SCHEMA
            .lines()
            .map(|l| l.split("--").next().unwrap_or(""))
            .flat_map(str::split_whitespace)
            .collect();
        let mut made = 0;
        for (i, w) in words.iter().enumerate() {
            if words[i..].starts_with(&["CREATE", "TABLE", "IF", "NOT", "EXISTS"]) {
                let table = words[i + 5];
                assert!(super::TABLES.contains(&table), "{table} is not in TABLES");
                made += 1;
            }
            if *w == "ADD" && words.get(i + 1) == Some(&"COLUMN") {
                let column = words[i + 2];
                let table = words[i - 1];
                assert!(
                    super::ADDED_COLUMNS.contains(&(table, column)),
                    "{table}.{column} is not in ADDED_COLUMNS"
                );
            }
        }
        assert_eq!(made, super::TABLES.len());
        // Nothing else it could make or change goes unchecked.
        for (i, w) in words.iter().enumerate() {
            if *w == "CREATE" {
                assert!(
                    matches!(words.get(i + 1), Some(&"SCHEMA" | &"TABLE")),
                    "ensure does not check what CREATE {} makes",
                    words[i + 1]
                );
            }
            if *w == "ALTER" {
                assert!(
                    words.get(i + 1) == Some(&"TABLE") && words.get(i + 3) == Some(&"ADD"),
                    "ensure does not check an ALTER other than ADD COLUMN"
                );
            }
        }
    }

    #[test]
    fn the_machine_refuses_unsafe_backward_moves() {
        assert!(S::Planned.may_become(S::Copying));
        assert!(S::Copied.may_become(S::StreamHandoffReady));
        assert!(S::StreamHandoffReady.may_become(S::Verified));
        assert!(S::Verified.may_become(S::FailedRecoverable));
        assert!(S::Copying.may_become(S::FailedRecoverable));
        for (from, to) in [
            (S::Copying, S::StreamHandoffReady),
            (S::Planned, S::Verified),
            (S::Verified, S::Copying),
            (S::StreamHandoffReady, S::Copying),
            (S::FailedRecoverable, S::Verified),
        ] {
            assert!(!from.may_become(to), "{from:?} -> {to:?}");
        }
        for s in [
            S::Planned,
            S::Copying,
            S::Copied,
            S::StreamHandoffReady,
            S::Verified,
            S::FailedRecoverable,
        ] {
            assert_eq!(S::parse(s.as_str()), Some(s));
        }
    }
}
