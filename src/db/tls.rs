//! TLS for PostgreSQL connections, with rustls (no OpenSSL to link).
//!
//! libpq's modes map as follows: `disable` — plain; `prefer` (the default) and `require` —
//! encrypt when the server offers it (required for `require`) without checking the certificate,
//! exactly like libpq; `verify-ca` / `verify-full` — require TLS and verify the server against
//! the system roots plus `PGSSLROOTCERT` (verify-ca is treated as verify-full).

use std::sync::Arc;

use anyhow::{Context, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::Failure;

/// Parses a libpq `sslmode` value into tokio-postgres's mode and "verify the certificate".
pub fn parse_sslmode(mode: &str) -> Result<(SslMode, bool)> {
    Ok(match mode {
        "disable" | "allow" => (SslMode::Disable, false),
        "prefer" => (SslMode::Prefer, false),
        "require" => (SslMode::Require, false),
        "verify-ca" | "verify-full" => (SslMode::Require, true),
        other => {
            return Err(Failure::Usage(format!(
                "unknown sslmode '{other}' (disable, prefer, require, verify-ca, verify-full)"
            ))
            .into())
        }
    })
}

/// Rewrites `sslmode=verify-ca|verify-full` in a URL or key=value string to `require` (which
/// tokio-postgres parses) and reports whether verification was asked for.
pub fn strip_verify_sslmode(conn: &str) -> (String, bool) {
    let mut verify = false;
    let mut out = conn.to_owned();
    for mode in ["sslmode=verify-full", "sslmode=verify-ca"] {
        if out.contains(mode) {
            verify = true;
            out = out.replace(mode, "sslmode=require");
        }
    }
    (out, verify)
}

/// The connector handed to tokio-postgres. Building it is cheap unless verification is on,
/// which reads the system's certificate store.
pub fn connector(verify: bool) -> Result<MakeRustlsConnect> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("cannot set up TLS")?;
    let config = if verify {
        builder
            .with_root_certificates(root_store()?)
            .with_no_client_auth()
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EncryptOnly(provider)))
            .with_no_client_auth()
    };
    Ok(MakeRustlsConnect::new(config))
}

/// The system's trusted root certificates (unreadable ones are skipped).
pub fn system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    roots
}

/// The system roots plus `PGSSLROOTCERT`, for verifying PostgreSQL servers.
fn root_store() -> Result<RootCertStore> {
    let mut roots = system_roots();
    if let Some(path) = std::env::var_os("PGSSLROOTCERT") {
        for cert in CertificateDer::pem_file_iter(&path)
            .with_context(|| format!("cannot read PGSSLROOTCERT {}", path.to_string_lossy()))?
        {
            roots
                .add(cert.context("bad certificate in PGSSLROOTCERT")?)
                .context("bad certificate in PGSSLROOTCERT")?;
        }
    }
    Ok(roots)
}

/// `sslmode=prefer/require`: encrypt, but accept any certificate, as libpq does. Signatures are
/// still checked so the handshake itself is sound.
#[derive(Debug)]
struct EncryptOnly(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifying_modes_become_require() {
        let (s, v) = strip_verify_sslmode("postgres://h/db?sslmode=verify-full");
        assert_eq!(s, "postgres://h/db?sslmode=require");
        assert!(v);
        assert!(!strip_verify_sslmode("host=h sslmode=prefer").1);
        assert!(parse_sslmode("bogus").is_err());
    }
}
