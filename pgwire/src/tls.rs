//! SSLRequest negotiation and the rustls handshake (ring provider, no
//! process-global state). The one-byte answer to SSLRequest is read from the
//! bare socket so no plaintext byte can be smuggled into the TLS session.

use super::WireError;
use super::config::{ConnectOptions, SslMode};
use bytes::BytesMut;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, Error as RustlsError, RootCertStore, SignatureScheme};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The byte stream of a session, TLS or not.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

pub async fn negotiate(
    mut tcp: TcpStream,
    options: &ConnectOptions,
) -> Result<Box<dyn Io>, WireError> {
    if options.ssl_mode == SslMode::Disable {
        return Ok(Box::new(tcp));
    }
    let mut buf = BytesMut::new();
    postgres_protocol::message::frontend::ssl_request(&mut buf);
    tcp.write_all(&buf).await?;
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await?;
    match (answer[0], options.ssl_mode) {
        (b'S', _) => {}
        (b'N', SslMode::Prefer) => return Ok(Box::new(tcp)),
        (b'N', mode) => {
            return Err(WireError::Tls(format!(
                "the server at {} does not accept TLS but sslmode is {mode:?}\nhint: enable ssl on the server, or use sslmode=prefer/disable on a trusted network",
                options.target()
            )));
        }
        (other, _) => {
            return Err(WireError::Protocol(format!(
                "unexpected answer {other:#04x} to SSLRequest"
            )));
        }
    }
    let config = client_config(options)?;
    let name = ServerName::try_from(options.host.clone()).map_err(|e| {
        WireError::Tls(format!(
            "host {:?} is not a valid TLS name: {e}",
            options.host
        ))
    })?;
    let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .map_err(|e| WireError::Tls(format!("handshake with {}: {e}", options.target())))?;
    Ok(Box::new(stream))
}

pub(crate) fn client_config(options: &ConnectOptions) -> Result<rustls::ClientConfig, WireError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| WireError::Tls(e.to_string()))?;
    let mut roots = RootCertStore::empty();
    match &options.ssl_root_cert {
        // Without TLS (a Unix socket, `sslmode=disable`) the file is not
        // read, as libpq does not.
        Some(_) if options.ssl_mode == SslMode::Disable => {}
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| WireError::Tls(format!("sslrootcert {}: {e}", path.display())))?;
            for cert in certs {
                let cert = cert
                    .map_err(|e| WireError::Tls(format!("sslrootcert {}: {e}", path.display())))?;
                roots
                    .add(cert)
                    .map_err(|e| WireError::Tls(format!("sslrootcert {}: {e}", path.display())))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let verify = match options.ssl_mode {
        SslMode::VerifyFull => Verify::Full,
        SslMode::VerifyCa => Verify::ChainOnly,
        // libpq: require verifies the chain only when a root cert is given.
        SslMode::Require if options.ssl_root_cert.is_some() => Verify::ChainOnly,
        _ => Verify::Nothing,
    };
    Ok(match verify {
        Verify::Full => builder.with_root_certificates(roots).with_no_client_auth(),
        other => {
            let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots),
                Arc::clone(&provider),
            )
            .build()
            .map_err(|e| WireError::Tls(e.to_string()));
            let verifier = LibpqVerifier {
                webpki: if other == Verify::ChainOnly {
                    Some(webpki?)
                } else {
                    None
                },
                provider,
            };
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(verifier))
                .with_no_client_auth()
        }
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verify {
    Nothing,
    ChainOnly,
    Full,
}

/// libpq's weaker modes: `require` (encrypt, trust anything) and
/// `verify-ca` (a trusted chain, any host name). Signatures are always
/// checked so the handshake still proves possession of the key.
#[derive(Debug)]
struct LibpqVerifier {
    webpki: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for LibpqVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, RustlsError> {
        let Some(webpki) = &self.webpki else {
            return Ok(ServerCertVerified::assertion());
        };
        match webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Ok(ok) => Ok(ok),
            Err(RustlsError::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(RustlsError::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            Err(e) => Err(e),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, RustlsError> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, RustlsError> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
