//! The SQL sessions a flow opens on its source and target: one way to
//! connect (the replication sessions' URL rules and TLS, a bounded
//! startup, unambiguous text forms, a bounded catalog statement), and the
//! URLs as messages may show them.

use std::time::Duration;
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connect to the {side} database ({target})")]
    Session {
        side: &'static str,
        target: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error(
        "connect to the {side} database ({target}): no session within connect_timeout ({seconds} s, covering TCP, TLS and authentication)\nhint: check the host and port; a slow server takes ?connect_timeout=SECONDS in the URL"
    )]
    Timeout {
        side: &'static str,
        target: String,
        seconds: f64,
    },
    #[error("the {side} database URL ({target}): {message}")]
    Url {
        side: &'static str,
        target: String,
        message: String,
    },
}

/// How long a catalog statement of a session [`connect`] opens may run:
/// one blocked behind a lock or a stuck server is an error naming it, not
/// a hang. Copy, apply and verify's comparisons set no bound.
pub const CATALOG_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection string without its password, for messages: the URL's
/// and the key=value form's (`password=`).
pub fn redact(url: &str) -> String {
    trellara_check::redact(url)
}

/// A session on the `side` ("source" or "target") database at `url`.
pub async fn connect(url: &str, side: &'static str) -> Result<Client, ConnectError> {
    // The same connection string rules and TLS (sslmode, sslrootcert) as
    // the replication sessions.
    let (config, tls) = url
        .parse::<trellara_external_relay::pgwire::ConnectOptions>()
        .and_then(|options| trellara_external_relay::pgwire::sql_config(&options))
        .map_err(|e| ConnectError::Url {
            side,
            target: redact(url),
            message: crate::errors::chain_of(&e),
        })?;
    // tokio-postgres bounds only the TCP connect by connect_timeout: the
    // whole startup is, so a peer that accepts and never answers is an error.
    let timeout = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(Duration::from_secs(10));
    let (client, connection) = tokio::time::timeout(timeout, config.connect(tls))
        .await
        .map_err(|_| ConnectError::Timeout {
            side,
            target: redact(url),
            seconds: timeout.as_secs_f64(),
        })?
        .map_err(|source| ConnectError::Session {
            side,
            target: redact(url),
            source,
        })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(side, error = %e, "database connection ended");
        }
    });
    // Copy and apply exchange values as text: the same unambiguous forms
    // the replication session uses. Catalog work is bounded unless the URL,
    // role or server already bound it; data work lifts the bound itself.
    client
        .batch_execute(&format!(
            "SET DateStyle = 'ISO'; SET IntervalStyle = 'postgres'; SET extra_float_digits = 3; \
             SELECT set_config('statement_timeout', '{}s', false) \
             WHERE current_setting('statement_timeout') = '0'",
            CATALOG_TIMEOUT.as_secs()
        ))
        .await
        .map_err(|source| ConnectError::Session {
            side,
            target: redact(url),
            source,
        })?;
    Ok(client)
}
