//! Model fingerprint: identifies which weights, architecture and KV entry dtype a piece
//! of KV state was computed by. Exported sequences, transferred pages and cached
//! prefix blocks carry it; nothing is ever imported under a different fingerprint.
//!
//! It hashes the parsed config, the KV dtype, and per weight file its safetensors
//! header (names, dtypes, shapes, offsets), its length and sixteen 4 KiB samples spread
//! over the data. Reading every weight byte would make start-up of a 600 GB checkpoint
//! take minutes; headers plus samples tell apart any two checkpoints that differ in
//! layout or in retrained weights.

use kernels::EntryDtype;
pub use model_spec::Fingerprint;
use model_spec::ModelConfig;
use sha2::{Digest, Sha256};

use crate::checkpoint::SafetensorsSet;

const SAMPLES: usize = 16;
const SAMPLE_BYTES: usize = 4096;

/// The fingerprint of a loaded checkpoint for a KV entry dtype.
pub fn compute(config: &ModelConfig, files: &SafetensorsSet, kv_dtype: EntryDtype) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"sluice-model-fingerprint-v1\0");
    h.update(format!("{config:?}").as_bytes());
    h.update(kv_dtype.name().as_bytes());
    let mut per_file: Vec<[u8; 32]> = files
        .files()
        .map(|(header, data)| {
            let mut f = Sha256::new();
            f.update(header);
            f.update((data.len() as u64).to_le_bytes());
            for i in 0..SAMPLES {
                let at = (data.len().saturating_sub(SAMPLE_BYTES)) * i / (SAMPLES - 1);
                f.update(&data[at..(at + SAMPLE_BYTES).min(data.len())]);
            }
            f.finalize().into()
        })
        .collect();
    // Shard order on disk must not matter.
    per_file.sort();
    for f in per_file {
        h.update(f);
    }
    Fingerprint(h.finalize().into())
}
