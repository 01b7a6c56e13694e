//! `trellara.quarantine`: transactions the applier could not apply, kept
//! whole (their envelope) with the reason and the recovery, until a later
//! apply of the same transaction or a new snapshot resolves them.

use tokio_postgres::GenericClient;

/// An unresolved quarantine record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantined {
    pub commit_lsn: String,
    pub xid: i64,
    pub reason: String,
    pub recovery: String,
    pub attempts: i32,
}

/// The flow's unresolved records, oldest commit first.
pub async fn open(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Vec<Quarantined>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT commit_lsn::text, xid, reason, recovery, attempts FROM trellara.quarantine
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

/// What the applier records for a transaction it sets aside.
#[derive(Debug)]
pub struct Record<'a> {
    pub flow: &'a str,
    pub commit_lsn: trellara_common::Lsn,
    pub xid: u64,
    pub reason: &'a str,
    pub recovery: &'a str,
    pub envelope: &'a [u8],
}

/// Records (or counts one more attempt at) a quarantined transaction.
pub async fn record(
    client: &impl GenericClient,
    record: &Record<'_>,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO trellara.quarantine (flow, commit_lsn, xid, reason, recovery, envelope)
             VALUES ($1, $2::text::pg_lsn, $3, $4, $5, $6)
             ON CONFLICT (flow, commit_lsn) DO UPDATE
             SET reason = EXCLUDED.reason, attempts = trellara.quarantine.attempts + 1, resolved_at = NULL",
            &[
                &record.flow,
                &record.commit_lsn.to_string(),
                &(record.xid as i64),
                &record.reason,
                &record.recovery,
                &record.envelope,
            ],
        )
        .await?;
    Ok(())
}

/// The applier's statement for records its transaction has now applied:
/// `$1` flow, `$2` their commit LSNs as text.
pub const RESOLVE: &str = "UPDATE trellara.quarantine SET resolved_at = now()
     WHERE flow = $1 AND commit_lsn = ANY($2::text[]::pg_lsn[]) AND resolved_at IS NULL";
