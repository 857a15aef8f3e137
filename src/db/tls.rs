//! TLS for PostgreSQL connections, with rustls (no OpenSSL to link).
//!
//! libpq's modes map as follows: `disable` — plain; `prefer` (the default) and `require` —
//! encrypt when the server offers it (required for `require`) without checking the certificate,
//! exactly like libpq; `verify-ca` / `verify-full` — require TLS and verify the server against
//! the system roots plus `sslrootcert` (verify-ca is treated as verify-full). A client
//! certificate (`sslcert`/`sslkey`) is presented when its file exists, in every mode.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
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

/// The files TLS may use, resolved as libpq resolves them: `sslcert`/`PGSSLCERT`, else
/// `~/.postgresql/postgresql.crt`; `sslkey`/`PGSSLKEY`, else `~/.postgresql/postgresql.key`;
/// `sslrootcert`/`PGSSLROOTCERT`, else `~/.postgresql/root.crt` (or `system`: the system roots
/// only). They are read only when a TCP connection asks for TLS, so a bad default file never
/// gets in the way of a Unix-socket connection.
#[derive(Clone, Debug, Default)]
pub struct Files {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub rootcert: Option<RootCert>,
}

/// Where the extra trusted roots for `verify-*` come from.
#[derive(Clone, Debug, PartialEq)]
pub enum RootCert {
    /// `sslrootcert=system`: the system's roots only.
    System,
    /// A PEM file; `explicit` when named (then it must exist), not when it is the default.
    File { path: PathBuf, explicit: bool },
}

impl Files {
    /// Resolves the file names from the connection string's values, the environment and the
    /// home directory.
    pub fn resolve(given: impl Fn(&str, &str) -> Option<String>, home: Option<&Path>) -> Files {
        let dot = |name: &str| home.map(|h| h.join(".postgresql").join(name));
        let rootcert = match given("sslrootcert", "PGSSLROOTCERT") {
            Some(s) if s == "system" => Some(RootCert::System),
            Some(s) => Some(RootCert::File {
                path: s.into(),
                explicit: true,
            }),
            None => dot("root.crt").map(|path| RootCert::File {
                path,
                explicit: false,
            }),
        };
        Files {
            cert: given("sslcert", "PGSSLCERT")
                .map(PathBuf::from)
                .or_else(|| dot("postgresql.crt")),
            key: given("sslkey", "PGSSLKEY")
                .map(PathBuf::from)
                .or_else(|| dot("postgresql.key")),
            rootcert,
        }
    }
}

/// The connector handed to tokio-postgres: certificate verification when `verify`, and the
/// client certificate of `files` when its certificate file exists (as libpq: a missing one
/// means "no client certificate", the server may still accept us). Reads the files each time.
pub fn connector(verify: bool, files: &Files) -> Result<MakeRustlsConnect> {
    Ok(MakeRustlsConnect::new(client_config(verify, files)?))
}

fn client_config(verify: bool, files: &Files) -> Result<ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("cannot set up TLS")?;
    let builder = if verify {
        builder.with_root_certificates(root_store(files.rootcert.as_ref())?)
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EncryptOnly(provider)))
    };
    let config = match client_identity(files)? {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).map_err(|e| {
            Failure::Usage(format!(
                "client certificate and key do not go together: {e}"
            ))
        })?,
        None => builder.with_no_client_auth(),
    };
    Ok(config)
}

/// The client certificate chain and its key, if the certificate file exists.
fn client_identity(
    files: &Files,
) -> Result<Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>> {
    let Some(cert) = files.cert.as_deref().filter(|c| c.exists()) else {
        return Ok(None);
    };
    let bad = |what: String| anyhow::Error::from(Failure::Usage(what));
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            bad(format!(
                "cannot read certificate file \"{}\": {e}",
                cert.display()
            ))
        })?;
    if chain.is_empty() {
        return Err(bad(format!(
            "certificate file \"{}\" holds no PEM certificate",
            cert.display()
        )));
    }
    let key = files.key.as_deref().filter(|k| k.exists()).ok_or_else(|| {
        bad(format!(
            "certificate present, but not private key file \"{}\"",
            files.key.as_deref().unwrap_or(Path::new("?")).display()
        ))
    })?;
    check_key_permissions(key).map_err(bad)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        bad(format!(
            "cannot read private key file \"{}\" (an unencrypted PEM key is needed): {e}",
            key.display()
        ))
    })?;
    Ok(Some((chain, key)))
}

/// libpq's rule: a key others can read is refused (0600 or less when it is ours, 0640 or less
/// when root owns it).
fn check_key_permissions(key: &Path) -> std::result::Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(key)
        .map_err(|e| format!("cannot read private key file \"{}\": {e}", key.display()))?;
    if !meta.is_file() {
        return Err(format!(
            "private key file \"{}\" is not a regular file",
            key.display()
        ));
    }
    let mode = meta.mode();
    let too_open = if meta.uid() == 0 {
        mode & 0o037 != 0
    } else {
        mode & 0o077 != 0
    };
    if too_open {
        return Err(format!(
            "private key file \"{}\" has group or world access; permissions must be u=rw (0600) or less if owned by the current user, or u=rw,g=r (0640) or less if owned by root",
            key.display()
        ));
    }
    Ok(())
}

/// The system's trusted root certificates (unreadable ones are skipped).
pub fn system_roots() -> RootCertStore {
    let mut roots = RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    roots
}

/// The system roots plus the root certificate file, for verifying PostgreSQL servers.
fn root_store(rootcert: Option<&RootCert>) -> Result<RootCertStore> {
    let mut roots = system_roots();
    let Some(RootCert::File { path, explicit }) = rootcert else {
        return Ok(roots);
    };
    if !explicit && !path.exists() {
        return Ok(roots);
    }
    let bad =
        |e: String| Failure::Usage(format!("root certificate file \"{}\": {e}", path.display()));
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(e.to_string()))? {
        roots
            .add(cert.map_err(|e| bad(e.to_string()))?)
            .map_err(|e| bad(e.to_string()))?;
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
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn sslmodes() {
        assert_eq!(
            parse_sslmode("verify-full").unwrap(),
            (SslMode::Require, true)
        );
        assert_eq!(parse_sslmode("allow").unwrap(), (SslMode::Disable, false));
        assert!(parse_sslmode("bogus").is_err());
    }

    #[test]
    fn default_files_are_under_home_and_named_ones_win() {
        let home = Path::new("/home/u");
        let f = Files::resolve(|_, _| None, Some(home));
        assert_eq!(f.cert.unwrap(), home.join(".postgresql/postgresql.crt"));
        assert_eq!(f.key.unwrap(), home.join(".postgresql/postgresql.key"));
        assert_eq!(
            f.rootcert.unwrap(),
            RootCert::File {
                path: home.join(".postgresql/root.crt"),
                explicit: false
            }
        );
        let f = Files::resolve(
            |k, _| match k {
                "sslcert" => Some("/c.crt".into()),
                "sslrootcert" => Some("system".into()),
                _ => None,
            },
            Some(home),
        );
        assert_eq!(f.cert.unwrap(), Path::new("/c.crt"));
        assert_eq!(f.rootcert.unwrap(), RootCert::System);
    }

    /// A throwaway self-signed certificate and key made by openssl, or None without openssl.
    fn throwaway_cert(dir: &Path, name: &str) -> Option<(PathBuf, PathBuf)> {
        let (crt, key) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
        );
        let ok = std::process::Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
            ])
            .args([
                "-nodes",
                "-days",
                "1",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
            ])
            .arg(&key)
            .arg("-out")
            .arg(&crt)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| {
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
            (crt, key)
        })
    }

    #[test]
    fn a_client_certificate_is_loaded_into_the_tls_config() {
        let dir = tempfile::tempdir().unwrap();
        let Some((crt, key)) = throwaway_cert(dir.path(), "leasectl") else {
            crate::warn!("openssl not found: the client certificate test is skipped");
            return;
        };
        let files = Files {
            cert: Some(crt.clone()),
            key: Some(key.clone()),
            rootcert: None,
        };
        for verify in [false, true] {
            let config = client_config(verify, &files).unwrap();
            assert!(
                config.client_auth_cert_resolver.has_certs(),
                "verify={verify}"
            );
        }
        // No certificate file: no client certificate, no error (libpq's rule).
        let none = Files {
            cert: Some(dir.path().join("absent.crt")),
            ..files.clone()
        };
        assert!(!client_config(false, &none)
            .unwrap()
            .client_auth_cert_resolver
            .has_certs());
        // A key others can read is refused, naming the file.
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = format!("{:#}", client_config(false, &files).err().unwrap());
        assert!(
            err.contains("group or world access") && err.contains("leasectl.key"),
            "{err}"
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        // A key that does not belong to the certificate is refused.
        let (_, other_key) = throwaway_cert(dir.path(), "other").unwrap();
        let mismatched = Files {
            key: Some(other_key),
            ..files.clone()
        };
        assert!(client_config(false, &mismatched).is_err());
        // A certificate without its key.
        let keyless = Files {
            key: Some(dir.path().join("absent.key")),
            ..files
        };
        let err = format!("{:#}", client_config(false, &keyless).err().unwrap());
        assert!(err.contains("not private key file"), "{err}");
    }
}
