//! `trellara.snapshot_runs` and `trellara.snapshot_tables`: where each
//! flow's snapshot machine stands (its run, state and consistent point),
//! and per table what the run copied and the schema fingerprint it saw.
//! The machine's rules are in [`SnapshotState`]; this module only reads
//! and writes the rows.

use super::SnapshotState;
use tokio_postgres::GenericClient;
use tokio_postgres::types::PgLsn;
use trellara_common::Lsn;

/// Where a flow's snapshot stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunState {
    pub run_id: i64,
    pub state: SnapshotState,
    pub consistent_lsn: Option<Lsn>,
}

/// The run row as status shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunRow {
    pub run: RunState,
    pub reason: String,
}

/// The run of `flow`, with its reason.
pub async fn row(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Option<RunRow>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT run_id, state, consistent_lsn, coalesce(reason, '')
             FROM trellara.snapshot_runs WHERE flow = $1",
            &[&flow],
        )
        .await?;
    Ok(row.and_then(|r| {
        Some(RunRow {
            run: RunState {
                run_id: r.get(0),
                // The table's CHECK admits only the states this build knows.
                state: SnapshotState::parse(r.get(1))?,
                consistent_lsn: r.get::<_, Option<PgLsn>>(2).map(super::lsn),
            },
            reason: r.get(3),
        })
    }))
}

/// The run of `flow`, if it has one in a state this build knows.
pub async fn load(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Option<RunState>, tokio_postgres::Error> {
    Ok(row(client, flow).await?.map(|r| r.run))
}

/// Sets the run's state; the caller has checked the machine allows it.
pub async fn set_state(
    client: &impl GenericClient,
    flow: &str,
    next: SnapshotState,
    reason: Option<&str>,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "UPDATE trellara.snapshot_runs SET state = $2, reason = $3, updated_at = now() WHERE flow = $1",
            &[&flow, &next.as_str(), &reason],
        )
        .await?;
    Ok(())
}

/// Sets the state of run `seen` only if it is still that run in that
/// state; false when it moved.
pub async fn set_state_from(
    client: &impl GenericClient,
    flow: &str,
    seen: &RunState,
    next: SnapshotState,
    reason: Option<&str>,
) -> Result<bool, tokio_postgres::Error> {
    let moved = client
        .execute(
            "UPDATE trellara.snapshot_runs SET state = $2, reason = $3, updated_at = now()
             WHERE flow = $1 AND run_id = $4 AND state = $5",
            &[
                &flow,
                &next.as_str(),
                &reason,
                &seen.run_id,
                &seen.state.as_str(),
            ],
        )
        .await?;
    Ok(moved == 1)
}

/// A new run at `consistent`, planned, with nothing copied yet.
pub async fn plan(
    client: &impl GenericClient,
    flow: &str,
    consistent: Lsn,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO trellara.snapshot_runs AS r (flow, run_id, state, consistent_lsn)
             VALUES ($1, 1, 'planned', $2::text::pg_lsn)
             ON CONFLICT (flow) DO UPDATE SET run_id = r.run_id + 1, state = 'planned',
                consistent_lsn = EXCLUDED.consistent_lsn, reason = NULL, started_at = now(), updated_at = now()",
            &[&flow, &consistent.to_string()],
        )
        .await?;
    client
        .execute(
            "DELETE FROM trellara.snapshot_tables WHERE flow = $1",
            &[&flow],
        )
        .await?;
    Ok(())
}

/// Records that the current run copied `rows` of `table`, whose schema
/// then had `fingerprint`; `boundary` for a table copied at one of its own
/// (it joined the flow after its run's boundary, or was reseeded alone),
/// which then starts at stream_handoff_ready until verify promotes it.
pub async fn record_table(
    client: &impl GenericClient,
    flow: &str,
    table: &str,
    rows: u64,
    schema: &trellara_common::envelope::RelationSchema,
    boundary: Option<Lsn>,
) -> Result<(), tokio_postgres::Error> {
    use prost::Message as _;
    client
        .execute(
            "INSERT INTO trellara.snapshot_tables (flow, run_id, table_name, rows_copied, fingerprint, boundary_lsn, state, pinned_schema)
             SELECT $1, run_id, $2, $3, $4, $5::text::pg_lsn, CASE WHEN $5 IS NOT NULL THEN 'stream_handoff_ready' END, $6
             FROM trellara.snapshot_runs WHERE flow = $1
             ON CONFLICT (flow, table_name) DO UPDATE SET rows_copied = EXCLUDED.rows_copied,
                fingerprint = EXCLUDED.fingerprint, boundary_lsn = EXCLUDED.boundary_lsn,
                state = EXCLUDED.state, copied_at = now(), pinned_schema = EXCLUDED.pinned_schema",
            &[
                &flow,
                &table,
                &(rows as i64),
                &(schema.fingerprint as i64),
                &boundary.map(|b| b.to_string()),
                &schema.encode_to_vec(),
            ],
        )
        .await?;
    Ok(())
}

/// Forgets a table that left the flow: its rows on the target stay, and
/// verify no longer compares it.
pub async fn forget_table(
    client: &impl GenericClient,
    flow: &str,
    table: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "DELETE FROM trellara.snapshot_tables WHERE flow = $1 AND table_name = $2",
            &[&flow, &table],
        )
        .await?;
    Ok(())
}

/// A table the flow's current run copied, and the fingerprint it pinned
/// (none for a row written before fingerprints were kept).
#[derive(Debug, Clone, PartialEq)]
pub struct CopiedTable {
    pub name: String,
    pub fingerprint: Option<u64>,
    /// The whole description pinned with the fingerprint (none for a row
    /// of an older build).
    pub schema: Option<trellara_common::envelope::RelationSchema>,
    /// Its own boundary, when it was copied after the run's.
    pub boundary: Option<Lsn>,
    /// Its own snapshot state, when it has a boundary of its own.
    pub state: Option<SnapshotState>,
    pub rows_copied: i64,
    /// When it was copied.
    pub copied_at: String,
}

/// The tables the flow's current run copied.
pub async fn tables(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Vec<CopiedTable>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT table_name, fingerprint, boundary_lsn, state, rows_copied, copied_at::text, pinned_schema
             FROM trellara.snapshot_tables WHERE flow = $1 ORDER BY table_name",
            &[&flow],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| CopiedTable {
            name: r.get(0),
            fingerprint: r.get::<_, Option<i64>>(1).map(|f| f as u64),
            schema: r.get::<_, Option<&[u8]>>(6).and_then(|b| {
                use prost::Message as _;
                trellara_common::envelope::RelationSchema::decode(b).ok()
            }),
            boundary: r.get::<_, Option<PgLsn>>(2).map(super::lsn),
            state: r.get::<_, Option<&str>>(3).and_then(SnapshotState::parse),
            rows_copied: r.get(4),
            copied_at: r.get(5),
        })
        .collect())
}

/// Moves the flow's tables with a state of their own (`only`: that one)
/// from `from` to `to`, as a verdict about them allows; how many moved.
pub async fn move_tables(
    client: &impl GenericClient,
    flow: &str,
    only: Option<&[String]>,
    (from, to): (SnapshotState, SnapshotState),
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            "UPDATE trellara.snapshot_tables SET state = $3
             WHERE flow = $1 AND state = $2 AND ($4::text[] IS NULL OR table_name = ANY($4))",
            &[&flow, &from.as_str(), &to.as_str(), &only],
        )
        .await
}
