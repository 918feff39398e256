//! Throwaway certificates (rcgen): a CA and the certificates it signs, for `sluice up
//! --tls` and tests. Production certificates come from cert-manager or your own CA.

use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SerialNumber,
};
use time::{Duration, OffsetDateTime};

use super::TlsError;

fn err(e: impl std::fmt::Display) -> TlsError {
    TlsError::Generate(e.to_string())
}

/// A certificate authority whose key stays in memory.
pub struct Ca {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate and its key, PEM.
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
    der: Vec<u8>,
}

impl Issued {
    /// SHA-256 of the certificate (as [`super::fingerprint`] and the logs show it).
    pub fn fingerprint(&self) -> String {
        super::fingerprint(&self.der)
    }

    /// Write `tls.crt`, `tls.key` (owner-only) and `ca.crt` into `dir`, as a mounted
    /// Kubernetes TLS secret holds them.
    pub fn write(&self, dir: &Path, ca: &Ca) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("tls.crt"), &self.cert_pem)?;
        write_private(&dir.join("tls.key"), &self.key_pem)?;
        std::fs::write(dir.join("ca.crt"), &ca.cert_pem)
    }
}

fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(text.as_bytes())
}

fn serial() -> SerialNumber {
    // Unique enough for throwaway certificates: they are told apart by fingerprint anyway.
    let nanos = OffsetDateTime::now_utc().unix_timestamp_nanos() as u128;
    let mut bytes = nanos.to_be_bytes()[4..].to_vec();
    bytes[0] &= 0x7f; // a positive INTEGER
    SerialNumber::from_slice(&bytes)
}

impl Ca {
    /// A new self-signed CA, valid for a year.
    pub fn new(name: &str) -> Result<Self, TlsError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + Duration::days(365);
        params.serial_number = Some(serial());
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.self_signed(&key).map_err(err)?;
        Ok(Ca { cert_pem: cert.pem(), issuer: Issuer::new(params, key) })
    }

    /// A certificate for `names` (DNS names or IP addresses), for both server and client
    /// authentication: one identity per service.
    pub fn issue(&self, names: &[String]) -> Result<Issued, TlsError> {
        let mut params = CertificateParams::new(names.to_vec()).map_err(err)?;
        params.distinguished_name.push(DnType::CommonName, names.first().map_or("sluice", String::as_str));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + Duration::days(90);
        params.serial_number = Some(serial());
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        Ok(Issued { cert_pem: cert.pem(), key_pem: key.serialize_pem(), der: cert.der().to_vec() })
    }
}

/// The names a certificate for services on this machine carries.
pub fn local_names() -> Vec<String> {
    vec!["localhost".into(), "127.0.0.1".into(), "::1".into()]
}
