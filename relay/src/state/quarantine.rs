//! `trellara.quarantine`: transactions the applier could not apply, kept
//! whole (their envelope) with the reason and the recovery, until a later
//! apply of the same transaction or a new snapshot resolves them. A
//! transaction held at a schema change also names the table and its
//! description after the change, which `schema accept` checks the target
//! against before it releases the hold.

use tokio_postgres::GenericClient;

/// An unresolved quarantine record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantined {
    pub commit_lsn: String,
    pub xid: i64,
    pub reason: String,
    pub recovery: String,
    pub attempts: i32,
    /// Held at a schema change on this table.
    pub held_table: Option<String>,
}

/// The flow's unresolved records, oldest commit first.
pub async fn open(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Vec<Quarantined>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT commit_lsn::text, xid, reason, recovery, attempts, held_table FROM trellara.quarantine
             WHERE flow = $1 AND resolved_at IS NULL ORDER BY commit_lsn",
            &[&flow],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Quarantined {
            commit_lsn: r.get(0),
            xid: r.get(1),
            reason: r.get(2),
            recovery: r.get(3),
            attempts: r.get(4),
            held_table: r.get(5),
        })
        .collect())
}

/// Resolves every open record of `flow`: a new snapshot's copy holds what
/// they could not apply.
pub async fn supersede(
    client: &impl GenericClient,
    flow: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "UPDATE trellara.quarantine SET resolved_at = now(), reason = reason || ' (superseded by a new snapshot)'
             WHERE flow = $1 AND resolved_at IS NULL",
            &[&flow],
        )
        .await?;
    Ok(())
}

/// Resolves `flow`'s open holds at schema changes on `table` that
/// committed before `boundary`, where the table was copied again (`reseed
/// --table`): the copy holds what they could not apply. Their commit LSNs.
pub async fn release_below(
    client: &impl GenericClient,
    flow: &str,
    table: &str,
    boundary: trellara_common::Lsn,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "UPDATE trellara.quarantine
             SET resolved_at = now(), reason = reason || ' (released by a copy of the table at ' || $3::text || ')'
             WHERE flow = $1 AND held_table = $2 AND resolved_at IS NULL AND commit_lsn < $3::text::pg_lsn
             RETURNING commit_lsn::text",
            &[&flow, &table, &boundary.to_string()],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// What the applier records for a transaction it sets aside.
#[derive(Debug)]
pub struct Record<'a> {
    pub flow: &'a str,
    pub commit_lsn: trellara_common::Lsn,
    pub xid: u64,
    pub reason: &'a str,
    pub recovery: &'a str,
    pub envelope: &'a [u8],
    /// Held at a schema change: the table and its description after it
    /// (an encoded RelationSchema).
    pub held: Option<(&'a str, &'a [u8])>,
}

/// Records (or counts one more attempt at) a quarantined transaction.
pub async fn record(
    client: &impl GenericClient,
    record: &Record<'_>,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO trellara.quarantine (flow, commit_lsn, xid, reason, recovery, envelope, held_table, held_schema)
             VALUES ($1, $2::text::pg_lsn, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (flow, commit_lsn) DO UPDATE
             SET reason = EXCLUDED.reason, recovery = EXCLUDED.recovery,
                 held_table = EXCLUDED.held_table, held_schema = EXCLUDED.held_schema,
                 attempts = trellara.quarantine.attempts + 1, resolved_at = NULL",
            &[
                &record.flow,
                &record.commit_lsn.to_string(),
                &(record.xid as i64),
                &record.reason,
                &record.recovery,
                &record.envelope,
                &record.held.map(|(table, _)| table),
                &record.held.map(|(_, schema)| schema),
            ],
        )
        .await?;
    Ok(())
}

/// The applier's statement for records its transaction has now applied:
/// `$1` flow, `$2` their commit LSNs as text.
pub const RESOLVE: &str = "UPDATE trellara.quarantine SET resolved_at = now()
     WHERE flow = $1 AND commit_lsn = ANY($2::text[]::pg_lsn[]) AND resolved_at IS NULL";

/// An open hold at a schema change on one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub commit_lsn: String,
    pub reason: String,
    /// The table's description after the change (an encoded
    /// RelationSchema).
    pub schema: Vec<u8>,
}

/// `flow`'s open holds at schema changes on `table`, oldest first.
pub async fn holds(
    client: &impl GenericClient,
    flow: &str,
    table: &str,
) -> Result<Vec<Hold>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT commit_lsn::text, reason, held_schema FROM trellara.quarantine
             WHERE flow = $1 AND held_table = $2 AND resolved_at IS NULL AND held_schema IS NOT NULL
             ORDER BY commit_lsn",
            &[&flow, &table],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Hold {
            commit_lsn: r.get(0),
            reason: r.get(1),
            schema: r.get(2),
        })
        .collect())
}

/// Whether the record at `commit_lsn` no longer holds its sink: resolved
/// (a snapshot or a copy of the table superseded it), the description it
/// holds at accepted ([`super::schema::accept`]), or gone.
pub async fn released(
    client: &impl GenericClient,
    flow: &str,
    commit_lsn: trellara_common::Lsn,
) -> Result<bool, tokio_postgres::Error> {
    let commit = commit_lsn.to_string();
    let row = client
        .query_opt(
            "SELECT resolved_at IS NOT NULL, held_table, held_schema FROM trellara.quarantine
             WHERE flow = $1 AND commit_lsn = $2::text::pg_lsn",
            &[&flow, &commit],
        )
        .await?;
    let Some(row) = row else {
        return Ok(true);
    };
    let (resolved, table, schema): (bool, Option<String>, Option<Vec<u8>>) =
        (row.get(0), row.get(1), row.get(2));
    let Some(table) = table.filter(|_| !resolved) else {
        return Ok(true);
    };
    // A description that cannot be read was never accepted: the sink
    // holds until a copy resolves it.
    let after = schema
        .and_then(|s| prost::Message::decode(s.as_slice()).ok())
        .map(|r: trellara_common::envelope::RelationSchema| r.fingerprint as i64);
    match after {
        Some(after) => super::schema::accepted(client, flow, &table, &commit, after).await,
        None => Ok(false),
    }
}
