//! The fence's state: where `trellara verify` holds a following flow's
//! applier, so that both sides can be read at one source position
//! ([`crate::fence`]).
//!
//! Invariants:
//! * The fence is the checkpoint row's `fence_lsn`, which the applier reads
//!   with its checkpoint lock. A fence committed before that lock was taken
//!   is seen by it: the lock waits for the update's transaction, then
//!   returns the row's new version.
//! * A fence holds only while its holder's session holds the flow's fence
//!   advisory lock: a verify that dies (or loses its session) releases the
//!   applier, whatever `fence_lsn` still says.

use tokio_postgres::Client;
use trellara_common::Lsn;

/// The flow's fence (`$1` the flow) as text, or NULL when there is none or
/// its holder is gone. pg_locks shows the two-key advisory lock as classid,
/// objid (oids) with objsubid 2.
macro_rules! fence_text {
    () => {
        "CASE WHEN fence_lsn IS NOT NULL AND EXISTS (
            SELECT 1 FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::int8 = (hashtext('trellara.fence')::int8 & 4294967295)
              AND l.objid::int8 = (hashtext($1)::int8 & 4294967295))
         THEN fence_lsn::text END"
    };
}
pub(crate) use fence_text;

/// The applier's look at the fence while it holds, outside a transaction.
const CURRENT: &str = concat!(
    "SELECT ",
    fence_text!(),
    " FROM trellara.checkpoints WHERE flow = $1"
);

/// Takes the flow's fence lock for this session; false when another
/// session (another verify) holds it.
pub async fn hold(client: &Client, flow: &str) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtext('trellara.fence'), hashtext($1))",
            &[&flow],
        )
        .await?
        .get(0))
}

/// Lets the applier go on: what `fence_lsn` says no longer holds it.
pub async fn release(client: &Client, flow: &str) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "SELECT pg_advisory_unlock(hashtext('trellara.fence'), hashtext($1))",
            &[&flow],
        )
        .await
        .map(drop)
}

/// Forgets a fence nobody holds any longer, so the applier's lock no
/// longer asks pg_locks about it; a fence another verify holds stays.
/// Gives up (an error) past `patience` waiting for the row.
pub async fn clear(
    client: &Client,
    flow: &str,
    patience: std::time::Duration,
) -> Result<(), tokio_postgres::Error> {
    within(
        client,
        patience,
        concat!(
            "UPDATE trellara.checkpoints SET fence_lsn = NULL WHERE flow = $1 AND fence_lsn IS NOT NULL AND (",
            fence_text!(),
            ") IS NULL"
        ),
        &[&flow],
    )
    .await
    .map(drop)
}

/// `sql` in a transaction of its own that waits at most `patience` for a
/// lock (`lock_timeout`, SQLSTATE 55P03 past it): a statement abandoned by
/// a client-side timeout would go on waiting on the server, and every
/// later statement of the session behind it.
async fn within(
    client: &Client,
    patience: std::time::Duration,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<u64, tokio_postgres::Error> {
    let ms = patience.as_millis().clamp(1, i32::MAX as u128);
    client
        .batch_execute(&format!("BEGIN; SET LOCAL lock_timeout = {ms}"))
        .await?;
    match client.execute(sql, params).await {
        Ok(n) => {
            client.batch_execute("COMMIT").await?;
            Ok(n)
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

/// Moves the fence to `at`; false when the flow has no checkpoint row (no
/// boundary handed off yet). Waits for the applier's open transaction,
/// which holds the row, at most `patience` (then SQLSTATE 55P03): once
/// this returns, its next one sees `at`.
pub async fn set(
    client: &Client,
    flow: &str,
    at: Lsn,
    patience: std::time::Duration,
) -> Result<bool, tokio_postgres::Error> {
    Ok(within(
        client,
        patience,
        "UPDATE trellara.checkpoints SET fence_lsn = $2::text::pg_lsn WHERE flow = $1",
        &[&flow, &at.to_string()],
    )
    .await?
        == 1)
}

/// The fence that holds the flow's applier now, if any.
pub async fn current(client: &Client, flow: &str) -> Result<Option<Lsn>, tokio_postgres::Error> {
    let row = client.query_opt(CURRENT, &[&flow]).await?;
    Ok(row
        .and_then(|r| r.get::<_, Option<String>>(0))
        .and_then(|t| t.parse().ok()))
}
