//! `trellara.checkpoints`: per flow, the last applied transaction (its
//! commit and end LSN and xid) and the counts of applied and skipped ones.
//! The applier writes it in the same target transaction as the rows it
//! accounts for; a snapshot resets it at its boundary.

use super::lsn;
use tokio_postgres::GenericClient;
use trellara_common::Lsn;

/// A flow's checkpoint row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub transactions: i64,
    pub duplicates_skipped: i64,
    pub updated_at: String,
}

/// The checkpoint of `flow`, if it has one.
pub async fn read(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Option<Checkpoint>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT commit_lsn, end_lsn, transactions, duplicates_skipped, updated_at::text
             FROM trellara.checkpoints WHERE flow = $1",
            &[&flow],
        )
        .await?;
    Ok(row.map(|r| Checkpoint {
        commit_lsn: lsn(r.get(0)),
        end_lsn: lsn(r.get(1)),
        transactions: r.get(2),
        duplicates_skipped: r.get(3),
        updated_at: r.get(4),
    }))
}

/// The commit LSN of the last transaction applied for `flow`.
pub async fn applied(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Option<Lsn>, tokio_postgres::Error> {
    Ok(read(client, flow).await?.map(|c| c.commit_lsn))
}

/// The checkpoint a snapshot leaves at its boundary: nothing applied yet,
/// the stream to start after `consistent`.
pub async fn reset_at_boundary(
    client: &impl GenericClient,
    flow: &str,
    source_id: &str,
    checkpoint: Lsn,
    consistent: Lsn,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO trellara.checkpoints AS c (flow, source_id, commit_lsn, end_lsn, xid)
             VALUES ($1, $2, $3::text::pg_lsn, $4::text::pg_lsn, 0)
             ON CONFLICT (flow) DO UPDATE SET source_id = EXCLUDED.source_id,
                commit_lsn = EXCLUDED.commit_lsn, end_lsn = EXCLUDED.end_lsn, xid = 0,
                transactions = 0, duplicates_skipped = 0, updated_at = now()",
            &[
                &flow,
                &source_id,
                &checkpoint.to_string(),
                &consistent.to_string(),
            ],
        )
        .await?;
    Ok(())
}

/// The applier's statements, prepared once per session: it runs them
/// inside its own transactions, in the order its commit protocol needs.
pub mod applier {
    /// Locks the row for the transaction that will move it; also reads
    /// where a verify holds the applier ([`crate::state::fence`]).
    pub const LOCK: &str = concat!(
        "SELECT commit_lsn::text, ",
        crate::state::fence::fence_text!(),
        " FROM trellara.checkpoints WHERE flow = $1 FOR UPDATE"
    );
    /// `$1` flow, `$2` source id, `$3` commit LSN, `$4` end LSN, `$5` xid,
    /// `$6` transactions and `$7` duplicates to add.
    pub const UPSERT: &str = "INSERT INTO trellara.checkpoints AS c (flow, source_id, commit_lsn, end_lsn, xid, transactions, duplicates_skipped)
     VALUES ($1, $2, $3::text::pg_lsn, $4::text::pg_lsn, $5, $6, $7)
     ON CONFLICT (flow) DO UPDATE SET source_id = EXCLUDED.source_id,
        commit_lsn = EXCLUDED.commit_lsn, end_lsn = EXCLUDED.end_lsn, xid = EXCLUDED.xid,
        transactions = c.transactions + EXCLUDED.transactions,
        duplicates_skipped = c.duplicates_skipped + EXCLUDED.duplicates_skipped,
        updated_at = now()";
    pub const COUNT_DUPLICATES: &str = "UPDATE trellara.checkpoints SET duplicates_skipped = duplicates_skipped + $2 WHERE flow = $1";
    /// A write with no effect, for a durable commit to flush.
    pub const TOUCH: &str =
        "UPDATE trellara.checkpoints SET commit_lsn = commit_lsn WHERE flow = $1";
}
