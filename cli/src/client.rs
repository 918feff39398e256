//! A `sluice.v1.Generation` client: what `sluice generate --router` and the sample
//! request of `sluice up` use, over TLS (trusting a given CA) and with an API key when
//! the router wants them.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use cluster::tls::Dialer;
use sluice_proto::v1 as pb;
use sluice_proto::v1::generation_client::GenerationClient;

/// How to reach a router: plaintext or TLS, and the API key to send (if any).
#[derive(Clone, Default)]
pub struct Access {
    pub dialer: Dialer,
    pub api_key: Option<String>,
}

impl Access {
    /// `--tls-ca` (trust for an `https://` router) and `--api-key`.
    pub fn new(router: &str, tls_ca: Option<&std::path::Path>, api_key: Option<String>) -> Result<Self> {
        let dialer = match tls_ca {
            Some(ca) => Dialer::tls(cluster::tls::ClientTls::trusting(ca, None)?),
            None if router.starts_with("https://") => {
                bail!("{router} serves TLS: give --tls-ca with the CA that signed its certificate")
            }
            None => Dialer::plaintext(),
        };
        Ok(Access { dialer, api_key })
    }
}

/// Stream one request, calling `on_event` for every event; returns the final event.
pub async fn stream(
    router: &str,
    req: pb::GenerateRequest,
    on_event: impl FnMut(&pb::GenerateEvent),
) -> Result<pb::FinalEvent> {
    stream_with(router, &Access::default(), req, on_event).await
}

/// [`stream`] as `access` says.
pub async fn stream_with(
    router: &str,
    access: &Access,
    req: pb::GenerateRequest,
    mut on_event: impl FnMut(&pb::GenerateEvent),
) -> Result<pb::FinalEvent> {
    let url = access.dialer.url(router);
    let endpoint = access.dialer.endpoint(router).map_err(anyhow::Error::msg)?.connect_timeout(Duration::from_secs(5));
    let ch =
        access.dialer.connect(&endpoint).await.with_context(|| format!("cannot connect to the router at {url}"))?;
    let mut client = GenerationClient::new(ch);
    let mut req = tonic::Request::new(req);
    if let Some(key) = &access.api_key {
        let value = format!("Bearer {key}").parse().context("--api-key: not a valid header value")?;
        req.metadata_mut().insert("authorization", value);
    }
    let mut stream = client.generate(req).await.map_err(status_error)?.into_inner();
    while let Some(ev) = stream.message().await.map_err(status_error)? {
        on_event(&ev);
        if let Some(pb::generate_event::Event::Final(f)) = ev.event {
            return Ok(f);
        }
    }
    bail!("the router ended the stream without a final event")
}

fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}
