//! Fuzz targets for every decoder of bytes that sluice takes from another process or
//! from a file. Each target is a plain function of `&[u8]` that panics when a property
//! fails, so the same body runs under three engines: the corpus replay and the bounded
//! mutation run in `cargo test -p sluice-fuzz`, and libFuzzer (`scripts/fuzz.sh`, the
//! binaries in `fuzz_targets/`). docs/reliability.md says what each target asserts and
//! what the runs found.
//!
//! Module map:
//! - [`kv_wire`]: the KV handshake (`KvTarget`: wire geometry, regions, page ids) and commit checksums.
//! - [`kvstore_record`]: record headers and tombstone payloads.
//! - [`kvstore_segment`]: a segment file scanned as recovery scans it.
//! - [`kvstore_recovery`]: a store directory of segment files opened, read, deleted from and reopened.
//! - [`sequence_export`]: a sequence's KV export imported into an engine's KV memory.
//! - [`router_generate`]: gRPC `GenerateRequest` (protobuf) into the router's validation.
//! - [`router_completion`]: the `/v1/completions` JSON body into the router's validation.
//! - [`router_chat`]: chat requests (JSON body and gRPC protobuf) into a plan, prompt and grammar.
//! - [`safetensors`]: checkpoint directories (headers, shard index, tensors decoded as the loader does).
//! - [`model_config`]: `config.json` in both forms, and the KV layout an accepted one implies.
//! - [`engine`]: what the bounded run in `cargo test` does (seeded mutation of the corpus, time-boxed).
//! - [`corpus`]: where each target's seeds and regression inputs live.
//! - [`seeds`]: the seed corpus, made by the real encoders.
//! - `structured`: building encoded inputs from fuzzer bytes (shared by the file-format targets).

pub mod corpus;
pub mod engine;
pub mod kv_wire;
pub mod kvstore_record;
pub mod kvstore_recovery;
pub mod kvstore_segment;
pub mod model_config;
pub mod router_chat;
pub mod router_completion;
pub mod router_generate;
pub mod safetensors;
pub mod seeds;
pub mod sequence_export;
mod structured;

/// A target's body: panics when a property fails.
pub type Body = fn(&[u8]);

/// Every target by name: the libFuzzer binary, `corpus/<name>/` and `regressions/<name>/`.
pub const TARGETS: &[(&str, Body)] = &[
    ("kv_wire", kv_wire::run),
    ("kvstore_record", kvstore_record::run),
    ("kvstore_segment", kvstore_segment::run),
    ("kvstore_recovery", kvstore_recovery::run),
    ("sequence_export", sequence_export::run),
    ("router_generate", router_generate::run),
    ("router_completion", router_completion::run),
    ("router_chat", router_chat::run),
    ("safetensors", safetensors::run),
    ("model_config", model_config::run),
];

/// The body of target `name`.
pub fn target(name: &str) -> Option<Body> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
}
