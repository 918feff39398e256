//! The TLS flags every service takes (`#[command(flatten)] tls: TlsArgs`), checked once,
//! and the plaintext policy: without TLS a service listens on loopback addresses only,
//! unless `--insecure-plaintext` makes plaintext elsewhere an explicit choice.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::material::Paths;
use super::{Tls, TlsError};

/// Shortest poll of the certificate files: they are re-read only when they changed,
/// but a poll is a few `stat` calls per service.
const MIN_RELOAD_MS: u64 = 100;

#[derive(Args, Clone, Debug, Default)]
pub struct TlsArgs {
    /// Directory with `tls.crt`, `tls.key` and `ca.crt` (a mounted Kubernetes TLS secret,
    /// as cert-manager writes it). Turns TLS on for every listener and mutual TLS between
    /// services.
    #[arg(long, env = "SLUICE_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// This service's certificate chain (PEM); default `<--tls-dir>/tls.crt`.
    #[arg(long, env = "SLUICE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1); default `<--tls-dir>/tls.key`.
    #[arg(long, env = "SLUICE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): peers must present certificates that chain to it; default
    /// `<--tls-dir>/ca.crt`.
    #[arg(long, env = "SLUICE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Check peers' certificates for this DNS name instead of the host in their URL (peers
    /// found through etcd are addressed by pod IP: give every service certificate this name).
    #[arg(long, env = "SLUICE_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
    /// How often the certificate files are checked for changes (ms); a renewed certificate
    /// is served, and presented to peers, from the next check on, without a restart.
    #[arg(long, env = "SLUICE_TLS_RELOAD_MS", default_value_t = 10_000)]
    pub tls_reload_ms: u64,
    /// Serve plaintext on non-loopback addresses (e.g. inside a mesh that encrypts for
    /// you). Without TLS and without this flag, only loopback addresses are served.
    #[arg(long, env = "SLUICE_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: bool,
}

/// Whether `addr` (`host:port`, `[v6]:port`) is a loopback address. Host names other
/// than `localhost` are not: they may resolve to anything.
pub fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl TlsArgs {
    pub fn enabled(&self) -> bool {
        self.tls_dir.is_some() || self.tls_cert.is_some() || self.tls_key.is_some() || self.tls_ca.is_some()
    }

    /// The files, when TLS is on: explicit flags win over `--tls-dir`'s names.
    pub fn paths(&self) -> Result<Option<Paths>, String> {
        if !self.enabled() {
            return Ok(None);
        }
        let from_dir = |name: &str| self.tls_dir.as_ref().map(|d| d.join(name));
        let cert = self.tls_cert.clone().or_else(|| from_dir("tls.crt"));
        let key = self.tls_key.clone().or_else(|| from_dir("tls.key"));
        let ca = self.tls_ca.clone().or_else(|| from_dir("ca.crt"));
        match (cert, key, ca) {
            (Some(cert), Some(key), Some(ca)) => Ok(Some(Paths { cert, key, ca })),
            (cert, key, ca) => {
                let missing: Vec<&str> =
                    [("--tls-cert", cert.is_none()), ("--tls-key", key.is_none()), ("--tls-ca", ca.is_none())]
                        .into_iter()
                        .filter_map(|(flag, absent)| absent.then_some(flag))
                        .collect();
                Err(format!(
                    "TLS needs a certificate, its key and the cluster CA: give --tls-dir (with tls.crt, tls.key, ca.crt) or also {}",
                    missing.join(" and ")
                ))
            }
        }
    }

    /// Check the flags against the service's listeners (`(flag, address)`; a metrics
    /// listener may be `off`), touching no files.
    pub fn validate(&self, listeners: &[(&str, &str)]) -> Result<(), String> {
        let tls = self.paths()?.is_some();
        if tls && self.insecure_plaintext {
            return Err("--insecure-plaintext and TLS flags contradict each other: drop one".into());
        }
        if self.tls_reload_ms < MIN_RELOAD_MS {
            return Err(format!("--tls-reload-ms {} is too often; use at least {MIN_RELOAD_MS}", self.tls_reload_ms));
        }
        if let Some(name) = &self.tls_server_name
            && rustls::pki_types::ServerName::try_from(name.as_str()).is_err()
        {
            return Err(format!("--tls-server-name {name:?}: expected a DNS name, e.g. sluice.internal"));
        }
        if !tls && !self.insecure_plaintext {
            for (flag, addr) in listeners.iter().filter(|(_, a)| *a != crate::telemetry::serve::OFF) {
                if !is_loopback(addr) {
                    return Err(format!(
                        "{flag} {addr} is not a loopback address and TLS is off: give --tls-dir (or --tls-cert, \
                         --tls-key and --tls-ca) to serve TLS there, listen on 127.0.0.1, or pass \
                         --insecure-plaintext to serve plaintext on purpose"
                    ));
                }
            }
        }
        Ok(())
    }

    pub fn reload_every(&self) -> Duration {
        Duration::from_millis(self.tls_reload_ms)
    }

    /// Load the certificates (when TLS is on), start watching them for changes, and log
    /// how the service's `listeners` are served. Must run inside a tokio runtime.
    pub fn start(&self, listeners: &[(&str, &str)]) -> Result<Option<Tls>, TlsError> {
        let shown: Vec<String> = listeners
            .iter()
            .filter(|(_, a)| *a != crate::telemetry::serve::OFF)
            .map(|(flag, addr)| format!("{flag} {addr}"))
            .collect();
        let Some(paths) = self.paths().map_err(TlsError::Config)? else {
            if self.insecure_plaintext {
                tracing::warn!(
                    listeners = %shown.join(", "),
                    "TLS is off: serving PLAINTEXT by --insecure-plaintext; peers are not authenticated"
                );
            } else {
                tracing::info!(
                    listeners = %shown.join(", "),
                    "TLS is off: plaintext on loopback only (give --tls-dir to serve TLS)"
                );
            }
            return Ok(None);
        };
        let live = super::Live::load(paths)?;
        live.spawn_watch(self.reload_every());
        let m = live.current();
        tracing::info!(
            listeners = %shown.join(", "),
            certificate = %m.fingerprint,
            reload_ms = self.tls_reload_ms,
            "TLS is on: peers on internal ports must present a certificate of the cluster CA"
        );
        Ok(Some(Tls { live, server_name: self.tls_server_name.clone() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> TlsArgs {
        #[derive(clap::Parser)]
        struct Cmd {
            #[command(flatten)]
            tls: TlsArgs,
        }
        let mut v = vec!["svc"];
        v.extend_from_slice(extra);
        <Cmd as clap::Parser>::try_parse_from(v).expect("parses").tls
    }

    #[test]
    fn loopback_is_told_from_everything_else() {
        for a in ["127.0.0.1:50051", "127.1.2.3:0", "[::1]:8080", "localhost:9100", "LOCALHOST:1"] {
            assert!(is_loopback(a), "{a}");
        }
        for a in ["0.0.0.0:50051", "[::]:8080", "10.0.0.7:9100", "sluice-router:50051", "192.168.1.1:1"] {
            assert!(!is_loopback(a), "{a}");
        }
    }

    #[test]
    fn plaintext_is_refused_off_loopback_unless_asked_for() {
        let plain = args(&[]);
        assert!(plain.validate(&[("--listen", "127.0.0.1:1"), ("--metrics-listen", "off")]).is_ok());
        let e = plain.validate(&[("--listen", "127.0.0.1:1"), ("--metrics-listen", "0.0.0.0:9100")]).unwrap_err();
        assert!(e.contains("--metrics-listen 0.0.0.0:9100") && e.contains("--tls-dir"), "{e}");
        assert!(e.contains("--insecure-plaintext"), "{e}");
        assert!(args(&["--insecure-plaintext"]).validate(&[("--listen", "0.0.0.0:1")]).is_ok());
        assert!(args(&["--tls-dir", "/etc/sluice/tls"]).validate(&[("--listen", "0.0.0.0:1")]).is_ok());
    }

    #[test]
    fn tls_files_come_from_the_directory_or_the_flags() {
        let p = args(&["--tls-dir", "/s", "--tls-ca", "/other/ca.pem"]).paths().unwrap().unwrap();
        assert_eq!(p.cert, PathBuf::from("/s/tls.crt"));
        assert_eq!(p.key, PathBuf::from("/s/tls.key"));
        assert_eq!(p.ca, PathBuf::from("/other/ca.pem"));
        let e = args(&["--tls-cert", "/c.pem"]).paths().unwrap_err();
        assert!(e.contains("--tls-key and --tls-ca") && !e.contains("--tls-cert and"), "{e}");
        assert!(args(&[]).paths().unwrap().is_none());
        let e = args(&["--tls-dir", "/s", "--insecure-plaintext"]).validate(&[]).unwrap_err();
        assert!(e.contains("contradict"), "{e}");
        let e = args(&["--tls-dir", "/s", "--tls-reload-ms", "5"]).validate(&[]).unwrap_err();
        assert!(e.contains("--tls-reload-ms"), "{e}");
        let e = args(&["--tls-dir", "/s", "--tls-server-name", "not a name"]).validate(&[]).unwrap_err();
        assert!(e.contains("--tls-server-name"), "{e}");
    }
}
