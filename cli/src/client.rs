//! A `sluice.v1.Generation` client: what `sluice generate --router` and the sample
//! request of `sluice up` use.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use sluice_proto::v1 as pb;
use sluice_proto::v1::generation_client::GenerationClient;

/// Stream one request, calling `on_event` for every event; returns the final event.
pub async fn stream(
    router: &str,
    req: pb::GenerateRequest,
    mut on_event: impl FnMut(&pb::GenerateEvent),
) -> Result<pb::FinalEvent> {
    let url = if router.starts_with("http://") || router.starts_with("https://") {
        router.to_string()
    } else {
        format!("http://{router}")
    };
    let ch = tonic::transport::Endpoint::from_shared(url.clone())
        .with_context(|| format!("router address `{router}`"))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("cannot connect to the router at {url}"))?;
    let mut client = GenerationClient::new(ch);
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
