//! TLS to PostgreSQL, with libpq's words in the URL (ARCHITECTURE.md, docs):
//! `sslmode=require`, `verify-ca` or `verify-full`, and `sslrootcert=PATH`
//! (or `system`). The `postgres` crate parses only `disable`, `prefer` and
//! `require` and verifies nothing itself, so the URL's TLS words are taken
//! out here and turned into a rustls client (through the maintained
//! `tokio-postgres-rustls` connector):
//!
//! | `sslmode` | toolgate |
//! |---|---|
//! | absent, `disable`, `allow`, `prefer` | no TLS (a plain connection, as before TLS existed here) |
//! | `require` | TLS; the certificate is not checked, unless `sslrootcert` is given (then as `verify-ca`, as libpq does) |
//! | `verify-ca` | TLS; the chain must lead to `sslrootcert` (default: the platform's roots); any host name |
//! | `verify-full` | TLS; the chain as above and the host name must match |
//!
//! The verifier below that skips a check (the host name for `verify-ca`,
//! everything for a bare `require`) is written by hand: no crate offers
//! libpq's exact semantics over rustls; it still checks the handshake's
//! signatures with the provider's algorithms.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

use super::StoreError;

type R<T> = Result<T, StoreError>;

/// What the URL asks of the connection's encryption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// No TLS.
    Off,
    /// TLS, nothing verified.
    Require,
    /// TLS, the chain verified, any host name.
    VerifyCa,
    /// TLS, the chain and the host name verified.
    VerifyFull,
}

impl SslMode {
    /// As the URL says it.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Off => "plain",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// A PostgreSQL URL split into what the `postgres` crate reads and the TLS
/// settings it does not.
pub(crate) struct PgUrl {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) mode: SslMode,
    root_cert: Option<String>,
}

/// Parses a `postgres://` URL; never repeats it in an error (it may hold a password).
pub(crate) fn parse(url: &str) -> R<PgUrl> {
    let bad = || StoreError::Open("the PostgreSQL URL is not valid (postgres://USER@HOST/DB?...)".into());
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut kept = Vec::new();
    let mut mode = SslMode::Off;
    let mut root_cert = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "sslmode" => {
                mode = match v {
                    "disable" | "allow" | "prefer" => SslMode::Off,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    _ => {
                        return Err(StoreError::Open(
                            "sslmode: one of disable, prefer, require, verify-ca, verify-full".into(),
                        ))
                    }
                };
            }
            "sslrootcert" => root_cert = Some(percent_decode(v).ok_or_else(bad)?),
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() { base.to_string() } else { format!("{base}?{}", kept.join("&")) };
    let mut config: tokio_postgres::Config = rest.parse().map_err(|_| bad())?;
    if mode == SslMode::Require && root_cert.is_some() {
        // libpq: a root certificate given makes `require` verify the chain.
        mode = SslMode::VerifyCa;
    }
    config.ssl_mode(if mode == SslMode::Off {
        postgres::config::SslMode::Disable
    } else {
        postgres::config::SslMode::Require
    });
    Ok(PgUrl { config, mode, root_cert })
}

fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s).decode_utf8().ok().map(std::borrow::Cow::into_owned)
}

/// How a connection is made (kept for reconnecting).
#[derive(Clone)]
pub(crate) enum Connector {
    Plain,
    Tls(tokio_postgres_rustls::MakeRustlsConnect),
}

impl Connector {
    /// The connector the URL asks for; its files are read now.
    pub(crate) fn for_url(u: &PgUrl) -> R<Connector> {
        if u.mode == SslMode::Off {
            return Ok(Connector::Plain);
        }
        let provider = Arc::new(provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| StoreError::Open(format!("TLS: {e}")))?;
        let libpq = |chain| Arc::new(Libpq { chain, provider: provider.clone() });
        let config = if u.mode == SslMode::Require {
            builder.dangerous().with_custom_certificate_verifier(libpq(None)).with_no_client_auth()
        } else {
            let roots = Arc::new(roots(u.root_cert.as_deref())?);
            if u.mode == SslMode::VerifyFull {
                builder.with_root_certificates(roots).with_no_client_auth()
            } else {
                let chain = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                    .build()
                    .map_err(|e| StoreError::Open(format!("TLS: the root certificates cannot be used ({e})")))?;
                builder.dangerous().with_custom_certificate_verifier(libpq(Some(chain))).with_no_client_auth()
            }
        };
        Ok(Connector::Tls(tokio_postgres_rustls::MakeRustlsConnect::new(config)))
    }
}

/// ring, as the rest of toolgate (ureq) uses.
fn provider() -> rustls::crypto::CryptoProvider {
    // (Deprecated from rustls 0.23.48 for want of post-quantum key exchange;
    // toolgate moves to another provider everywhere at once.)
    #[allow(deprecated)]
    rustls::crypto::ring::default_provider()
}

fn roots(root_cert: Option<&str>) -> R<rustls::RootCertStore> {
    let mut store = rustls::RootCertStore::empty();
    match root_cert {
        Some(path) if path != "system" => {
            let bytes = std::fs::read(path)
                .map_err(|e| StoreError::Open(format!("sslrootcert cannot be read ({})", e.kind())))?;
            for cert in CertificateDer::pem_slice_iter(&bytes) {
                let cert = cert.map_err(|_| StoreError::Open("sslrootcert is not PEM".into()))?;
                store.add(cert).map_err(|e| StoreError::Open(format!("sslrootcert: {e}")))?;
            }
            if store.is_empty() {
                return Err(StoreError::Open("sslrootcert holds no certificate".into()));
            }
        }
        _ => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(native.certs);
            if added == 0 {
                return Err(StoreError::Open(
                    "TLS: the platform has no root certificates; give sslrootcert=PATH".into(),
                ));
            }
        }
    }
    Ok(store)
}

/// libpq's two checks rustls has no setting for: `verify-ca` (`chain`: the
/// chain verified, any host name) and a bare `require` (no chain: the
/// server's certificate not checked). Either way the handshake's signatures
/// are checked with the provider's algorithms.
#[derive(Debug)]
struct Libpq {
    chain: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for Libpq {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else { return Ok(ServerCertVerified::assertion()) };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tls_words_are_taken_out_of_the_url() {
        let u =
            parse("postgres://u@h:5433/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x").unwrap();
        assert_eq!(u.mode, SslMode::VerifyFull);
        assert_eq!(u.root_cert.as_deref(), Some("/etc/ca.pem"));
        assert_eq!(u.config.get_dbname(), Some("db"));
        assert_eq!(parse("postgres://u@h/db").unwrap().mode, SslMode::Off);
        assert_eq!(parse("postgres://u@h/db?sslmode=prefer").unwrap().mode, SslMode::Off);
        // libpq: a root certificate makes `require` verify the chain.
        assert_eq!(parse("postgres://u@h/db?sslmode=require&sslrootcert=/ca").unwrap().mode, SslMode::VerifyCa);
        let err = parse("postgres://u:secret@h/db?sslmode=maybe").err().unwrap().to_string();
        assert!(err.contains("sslmode") && !err.contains("secret"), "{err}");
    }
}
