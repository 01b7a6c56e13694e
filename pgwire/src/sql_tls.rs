//! Plain SQL sessions through tokio-postgres with the same TLS as the
//! replication sessions: rustls (ring), libpq's `sslmode` meanings
//! (`prefer`, `require`, `verify-ca`, `verify-full`) and `sslrootcert`, from
//! one connection string. tokio-postgres alone knows only
//! disable/prefer/require and ships no TLS.
//!
//! Invariant: a URL that asks for verification gets exactly the checks a
//! replication session on the same URL gets ([`crate::tls`]'s verifier).

use crate::WireError;
use crate::config::{ConnectOptions, SslMode};
use rustls::pki_types::ServerName;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::Socket;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// The tokio-postgres configuration and TLS maker for `options`.
pub fn sql_config(
    options: &ConnectOptions,
) -> Result<(tokio_postgres::Config, MakeTls), WireError> {
    let mut config = tokio_postgres::Config::new();
    config
        .host(&options.host)
        .port(options.port)
        .user(&options.user)
        .dbname(&options.dbname)
        .application_name(&options.application_name)
        .connect_timeout(options.connect_timeout)
        .ssl_mode(match options.ssl_mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            // Verification is ours (MakeTls); tokio-postgres only has to
            // insist on TLS.
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
    if let Some(password) = &options.password {
        config.password(password);
    }
    let tls = MakeTls {
        config: Arc::new(crate::tls::client_config(options)?),
    };
    Ok((config, tls))
}

/// Makes rustls connectors for tokio-postgres.
#[derive(Clone)]
pub struct MakeTls {
    config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for MakeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MakeTls").finish_non_exhaustive()
    }
}

impl MakeTlsConnect<Socket> for MakeTls {
    type Stream = TlsStream;
    type TlsConnect = Connector;
    type Error = io::Error;

    /// tokio-postgres asks for a connector before it knows whether TLS
    /// will be used, and with an empty name for a Unix socket (where it is
    /// not): a name that is no TLS name fails only if TLS is attempted.
    fn make_tls_connect(&mut self, domain: &str) -> Result<Connector, io::Error> {
        let name = ServerName::try_from(domain.to_owned())
            .map_err(|e| format!("host {domain:?} is not a valid TLS name: {e}"));
        Ok(Connector {
            connector: tokio_rustls::TlsConnector::from(Arc::clone(&self.config)),
            name,
        })
    }
}

pub struct Connector {
    connector: tokio_rustls::TlsConnector,
    name: Result<ServerName<'static>, String>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TlsConnect<Socket> for Connector {
    type Stream = TlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<TlsStream, io::Error>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let name = self
                .name
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let stream = self.connector.connect(name, stream).await?;
            Ok(TlsStream(stream))
        })
    }
}

/// A TLS session under tokio-postgres.
pub struct TlsStream(tokio_rustls::client::TlsStream<Socket>);

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream").finish_non_exhaustive()
    }
}

impl AsyncRead for TlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl tokio_postgres::tls::TlsStream for TlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        // SCRAM without channel binding, as the replication sessions do.
        ChannelBinding::none()
    }
}
