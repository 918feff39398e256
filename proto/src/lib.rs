//! sluice's gRPC API, generated from `proto/sluice/v1/*.proto`.
//!
//! Module map:
//! - [`v1`]: package `sluice.v1` — the client-facing `Generation` service and the
//!   internal `Prefill` / `Decode` services (KV handshake, commit, decode stream) and
//!   the `KvStore` shared-prefix store.

/// Package `sluice.v1`.
pub mod v1 {
    tonic::include_proto!("sluice.v1");
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::v1::*;

    #[test]
    fn request_round_trips_through_the_wire_format() {
        let req = GenerateRequest {
            model: "small".into(),
            prompt: Some(generate_request::Prompt::TokenIds(TokenIds { ids: vec![1, 2, 3] })),
            max_tokens: 8,
            sampling: Some(SamplingParams { temperature: 0.7, seed: Some(42), top_logprobs: 2, ..Default::default() }),
            stop: None,
            request_id: "r-1".into(),
        };
        let bytes = req.encode_to_vec();
        assert_eq!(GenerateRequest::decode(bytes.as_slice()).unwrap(), req);
    }
}
