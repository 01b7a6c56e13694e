//! `trellara.schema_changes`: each schema change a sink applied, or found
//! its target already had, with its barrier; and each held change the
//! operator accepted (`schema accept`), under the barrier
//! `accepted:TABLE@COMMIT/FINGERPRINT` ([`acceptance`]). A row is written in the
//! target transaction of the change's first rows (the sink's
//! acknowledgement), and the table's pinned fingerprint in
//! `trellara.snapshot_tables` moves in that same transaction.

use tokio_postgres::GenericClient;

/// Records one sink's acknowledgement: `$1` flow, `$2` barrier id, `$3`
/// table, `$4` kind, `$5` commit LSN (text), `$6` statement, `$7`/`$8`
/// fingerprints before and after, `$9` outcome, `$10` the column ('' for
/// a table kind). A replay of the same
/// change (a crash after the target commit, before the log cursor moved)
/// finds its row and writes nothing.
pub const ACKNOWLEDGE: &str = "INSERT INTO trellara.schema_changes
        (flow, barrier_id, table_name, kind, commit_lsn, statement, fingerprint_before, fingerprint_after, outcome, column_name)
    VALUES ($1, $2, $3, $4, $5::text::pg_lsn, $6, $7, $8, $9, nullif($10, ''))
    ON CONFLICT (flow, barrier_id) DO NOTHING";

/// Moves the table's pin: `$1` flow, `$2` table, `$3` fingerprint, `$4`
/// the description (an encoded RelationSchema).
pub const REPIN: &str = "UPDATE trellara.snapshot_tables SET fingerprint = $3, pinned_schema = $4
    WHERE flow = $1 AND table_name = $2";

/// One acknowledged change, for `status`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Acknowledged {
    pub barrier_id: String,
    pub table: String,
    pub kind: String,
    pub commit_lsn: String,
    pub statement: String,
    pub outcome: String,
    pub acknowledged_at: String,
}

/// The flow's acknowledged changes, oldest first.
pub async fn changes(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Vec<Acknowledged>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT barrier_id, table_name, kind, commit_lsn::text, statement, outcome, acknowledged_at::text
             FROM trellara.schema_changes WHERE flow = $1 ORDER BY commit_lsn, barrier_id",
            &[&flow],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Acknowledged {
            barrier_id: r.get(0),
            table: r.get(1),
            kind: r.get(2),
            commit_lsn: r.get(3),
            statement: r.get(4),
            outcome: r.get(5),
            acknowledged_at: r.get(6),
        })
        .collect())
}

/// The barrier under which `schema accept` records the operator's
/// acceptance of every held change on `table` in the transaction at
/// `commit_lsn` (text form).
pub fn acceptance(table: &str, commit_lsn: &str, after: i64) -> String {
    format!("accepted:{table}@{commit_lsn}/{after}")
}

/// Records that the operator applied the held changes on `table` of the
/// transaction at `commit_lsn` on this target (`schema accept`), so the
/// sink passes them without DDL. `after`: the fingerprint after them; the
/// one before is the table's pin.
pub async fn accept(
    client: &impl GenericClient,
    flow: &str,
    table: &str,
    commit_lsn: &str,
    reason: &str,
    after: i64,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO trellara.schema_changes
                (flow, barrier_id, table_name, kind, commit_lsn, statement, fingerprint_before, fingerprint_after, outcome)
             VALUES ($1, $2, $3, 'accepted', $4::text::pg_lsn, $5,
                     coalesce((SELECT fingerprint FROM trellara.snapshot_tables WHERE flow = $1 AND table_name = $3), 0),
                     $6, 'already_present')
             ON CONFLICT (flow, barrier_id) DO NOTHING",
            &[&flow, &acceptance(table, commit_lsn, after), &table, &commit_lsn, &reason, &after],
        )
        .await?;
    Ok(())
}

/// Whether the held changes on `table` at `commit_lsn` that leave it at
/// the fingerprint `after` were accepted: one transaction may change a
/// table twice, and each description is accepted on its own.
pub async fn accepted(
    client: &impl GenericClient,
    flow: &str,
    table: &str,
    commit_lsn: &str,
    after: i64,
) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM trellara.schema_changes WHERE flow = $1 AND barrier_id = $2)",
            &[&flow, &acceptance(table, commit_lsn, after)],
        )
        .await?
        .get(0))
}

/// The commit of the latest change that dropped `column` from `table` and
/// that a sink passed (applied or accepted), if any.
pub async fn dropped(
    client: &impl GenericClient,
    flow: &str,
    table: &str,
    column: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT commit_lsn::text FROM trellara.schema_changes
             WHERE flow = $1 AND table_name = $2 AND column_name = $3 AND kind = 'drop_column'
             ORDER BY commit_lsn DESC LIMIT 1",
            &[&flow, &table, &column],
        )
        .await?
        .map(|r| r.get(0)))
}
