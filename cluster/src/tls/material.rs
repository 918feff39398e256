//! What a service's TLS is made of, read from PEM files: its certificate chain and key
//! (one identity, presented both as a server and as a client) and the cluster CA its
//! peers' certificates must chain to, with the verifiers built from it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::CertifiedKey;
use sha2::{Digest, Sha256};

use super::TlsError;

/// Where the PEM files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl Paths {
    /// The three files of a directory as a Kubernetes TLS secret mounts them.
    pub fn in_dir(dir: &Path) -> Self {
        Paths { cert: dir.join("tls.crt"), key: dir.join("tls.key"), ca: dir.join("ca.crt") }
    }

    pub fn all(&self) -> [&Path; 3] {
        [&self.cert, &self.key, &self.ca]
    }
}

/// One loaded set: identity, trust roots and the verifiers made from them.
#[derive(Debug)]
pub struct Material {
    pub identity: Arc<CertifiedKey>,
    pub roots: Arc<RootCertStore>,
    /// Verifies clients on internal listeners: a certificate chained to `roots` is required.
    pub client_verifier: Arc<dyn ClientCertVerifier>,
    /// Verifies servers this service dials.
    pub server_verifier: Arc<WebPkiServerVerifier>,
    /// SHA-256 of the leaf certificate (hex), for logs: it tells which one is served.
    pub fingerprint: String,
}

/// SHA-256 of a DER certificate, lowercase hex.
pub fn fingerprint(der: &[u8]) -> String {
    Sha256::digest(der).iter().map(|b| format!("{b:02x}")).collect()
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::File { path: path.into(), reason: e.to_string() })
}

fn bad(path: &Path, reason: impl Into<String>) -> TlsError {
    TlsError::File { path: path.into(), reason: reason.into() }
}

/// Every certificate in a PEM file; at least one.
pub fn certificates(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(path, format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(bad(path, "no CERTIFICATE block in it"));
    }
    Ok(certs)
}

/// Trust roots from a PEM bundle (every certificate in it).
pub fn roots(pem: &[u8], path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for c in certificates(pem, path)? {
        store.add(c).map_err(|e| bad(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(store))
}

impl Material {
    pub fn load(paths: &Paths) -> Result<Self, TlsError> {
        Self::from_pem(&read(&paths.cert)?, &read(&paths.key)?, &read(&paths.ca)?, paths)
    }

    /// Parse and check: the key must belong to the certificate, the CA must make verifiers.
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8], paths: &Paths) -> Result<Self, TlsError> {
        let chain = certificates(cert, &paths.cert)?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad(&paths.key, format!("no private key: {e}")))?;
        let provider = super::provider();
        let fingerprint = fingerprint(&chain[0]);
        let identity = CertifiedKey::from_der(chain, key, &provider)
            .map_err(|e| bad(&paths.key, format!("does not fit {}: {e}", paths.cert.display())))?;
        let roots = roots(ca, &paths.ca)?;
        let client_verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| bad(&paths.ca, e.to_string()))?;
        let server_verifier = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider)
            .build()
            .map_err(|e| bad(&paths.ca, e.to_string()))?;
        Ok(Material { identity: Arc::new(identity), roots, client_verifier, server_verifier, fingerprint })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::generate::Ca;

    #[test]
    fn a_key_must_fit_its_certificate() {
        let ca = Ca::new("test CA").unwrap();
        let a = ca.issue(&["a.test".into()]).unwrap();
        let b = ca.issue(&["b.test".into()]).unwrap();
        let paths = Paths::in_dir(Path::new("/x"));
        let m =
            Material::from_pem(a.cert_pem.as_bytes(), a.key_pem.as_bytes(), ca.cert_pem.as_bytes(), &paths).unwrap();
        assert_eq!(m.fingerprint, fingerprint(&certificates(a.cert_pem.as_bytes(), &paths.cert).unwrap()[0]));
        let e = Material::from_pem(a.cert_pem.as_bytes(), b.key_pem.as_bytes(), ca.cert_pem.as_bytes(), &paths)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/x/tls.key") && e.contains("does not fit"), "{e}");
        let e = Material::from_pem(b"junk", a.key_pem.as_bytes(), ca.cert_pem.as_bytes(), &paths).unwrap_err();
        assert!(e.to_string().contains("/x/tls.crt"), "{e}");
        let e = Material::from_pem(a.cert_pem.as_bytes(), a.key_pem.as_bytes(), b"", &paths).unwrap_err();
        assert!(e.to_string().contains("/x/ca.crt"), "{e}");
    }
}
