//! `trellara.verify_runs`: every verdict verify reached, with its evidence
//! as JSON, so status and evidence packages read them back.

use tokio_postgres::GenericClient;

/// Records a verdict and its evidence (JSON text).
pub async fn record(
    client: &impl GenericClient,
    flow: &str,
    verdict: &str,
    evidence: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO trellara.verify_runs (flow, verdict, evidence) VALUES ($1, $2, $3::text::jsonb)",
            &[&flow, &verdict, &evidence],
        )
        .await?;
    Ok(())
}

/// The last verdict about the whole flow (a `--table` verdict speaks for
/// one table) and when it was reached.
pub async fn last(
    client: &impl GenericClient,
    flow: &str,
) -> Result<Option<(String, String)>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT verdict, verified_at::text FROM trellara.verify_runs
             WHERE flow = $1 AND NOT evidence ? 'only_table' ORDER BY verified_at DESC LIMIT 1",
            &[&flow],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), r.get(1))))
}
