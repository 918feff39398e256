//! The KV wire description (see `WIRE_VERSION`): everything two processes must agree on before
//! one writes KV bytes into the other's memory. Pages and state move as raw bytes and
//! the receiver reads them through its own layout table, so the description names the
//! model fingerprint, entry dtype, page and state geometry and the per-layer table
//! (with each branch's entry stride); any difference refuses the transfer and names the
//! first field that differs.

use kernels::{AttnKind, Branch, EntryDtype, KvLayout, LayerSpec};
use model_spec::Fingerprint;
use sluice_proto::v1 as pb;
use thiserror::Error;

/// 3: fp8 entries (byte records) and per-layer RoPE dims and entry strides. A version-2
/// peer knows neither, so the two refuse each other instead of misreading bytes.
/// 4: commits carry KV checksums ([`kernels::kv_checksum`], computable in GPU memory)
/// instead of xxh3, and a target may name regions of device memory (one per GPU of the
/// receiver, page ids and slot relative to them).
pub const WIRE_VERSION: u32 = 4;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error(
        "peer speaks KV wire version {theirs}, this build speaks version {WIRE_VERSION}: \
         upgrade prefill and decode workers together"
    )]
    Version { theirs: u32 },
    #[error("KV geometry differs in {field}: theirs {theirs}, ours {ours}")]
    Mismatch { field: String, theirs: String, ours: String },
    #[error("malformed KV description: {0}")]
    Malformed(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireGeometry {
    pub fingerprint: Fingerprint,
    pub dtype: EntryDtype,
    pub block: usize,
    pub window: usize,
    pub page_bytes: usize,
    /// Window-ring bytes of one state slot.
    pub ring_bytes: usize,
    /// Compressor-slot bytes of one state slot (f32).
    pub comp_bytes: usize,
    /// Last-token logits of one slot (vocab × f32).
    pub logits_bytes: usize,
    pub layers: Vec<WireLayer>,
}

/// One row of the layer table: what the layer stores and how far apart its entries lie
/// (storage elements: dims for f32/bf16, record bytes for fp8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireLayer {
    pub spec: LayerSpec,
    pub main_stride: usize,
    pub index_stride: usize,
}

impl WireGeometry {
    pub fn new(layout: &KvLayout, fingerprint: &Fingerprint, vocab: usize) -> Self {
        WireGeometry {
            fingerprint: fingerprint.clone(),
            dtype: layout.dtype,
            block: layout.block,
            window: layout.window,
            page_bytes: layout.page_bytes(),
            ring_bytes: layout.ring_elems * layout.dtype.size(),
            comp_bytes: layout.comp_elems * 4,
            logits_bytes: vocab * 4,
            layers: layout
                .layers
                .iter()
                .map(|l| WireLayer {
                    spec: l.spec,
                    main_stride: l.stride(Branch::Main),
                    index_stride: l.stride(Branch::Indexer),
                })
                .collect(),
        }
    }

    pub fn to_proto(&self) -> pb::KvGeometry {
        pb::KvGeometry {
            fingerprint: self.fingerprint.hex(),
            entry_dtype: self.dtype.name().to_string(),
            block_tokens: self.block as u32,
            window: self.window as u32,
            page_bytes: self.page_bytes as u64,
            ring_bytes: self.ring_bytes as u64,
            comp_bytes: self.comp_bytes as u64,
            logits_bytes: self.logits_bytes as u64,
            layers: self
                .layers
                .iter()
                .map(|l| pb::LayerGeometry {
                    kind: l.spec.kind.name().to_string(),
                    ratio: l.spec.ratio as u32,
                    head_dim: l.spec.head_dim as u32,
                    index_dim: l.spec.index_dim as u32,
                    rope_dim: l.spec.rope_dim as u32,
                    main_stride: l.main_stride as u32,
                    index_stride: l.index_stride as u32,
                })
                .collect(),
        }
    }

    pub fn from_proto(g: &pb::KvGeometry) -> Result<Self, WireError> {
        let bad = |what: &str| WireError::Malformed(what.to_string());
        let layers = g
            .layers
            .iter()
            .map(|l| {
                let kind = match l.kind.as_str() {
                    "window" => AttnKind::Window,
                    "csa" => AttnKind::Csa,
                    "hca" => AttnKind::Hca,
                    other => return Err(bad(&format!("layer kind `{other}`"))),
                };
                let spec = LayerSpec {
                    kind,
                    ratio: l.ratio as usize,
                    head_dim: l.head_dim as usize,
                    index_dim: l.index_dim as usize,
                    rope_dim: l.rope_dim as usize,
                };
                Ok(WireLayer { spec, main_stride: l.main_stride as usize, index_stride: l.index_stride as usize })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(WireGeometry {
            fingerprint: Fingerprint::from_hex(&g.fingerprint).ok_or_else(|| bad("fingerprint"))?,
            dtype: EntryDtype::parse(&g.entry_dtype).ok_or_else(|| bad("entry dtype"))?,
            block: g.block_tokens as usize,
            window: g.window as usize,
            page_bytes: g.page_bytes as usize,
            ring_bytes: g.ring_bytes as usize,
            comp_bytes: g.comp_bytes as usize,
            logits_bytes: g.logits_bytes as usize,
            layers,
        })
    }

    /// `Ok` when bytes written by one side mean the same to the other.
    pub fn check_compatible(&self, theirs: &WireGeometry) -> Result<(), WireError> {
        let differ =
            |field: &str, t: String, o: String| Err(WireError::Mismatch { field: field.into(), theirs: t, ours: o });
        if theirs.fingerprint != self.fingerprint {
            return differ("model fingerprint", theirs.fingerprint.short(), self.fingerprint.short());
        }
        if theirs.dtype != self.dtype {
            return differ("entry dtype", theirs.dtype.name().into(), self.dtype.name().into());
        }
        for (field, t, o) in [
            ("block tokens", theirs.block, self.block),
            ("window", theirs.window, self.window),
            ("page bytes", theirs.page_bytes, self.page_bytes),
            ("ring bytes", theirs.ring_bytes, self.ring_bytes),
            ("compressor bytes", theirs.comp_bytes, self.comp_bytes),
            ("logits bytes", theirs.logits_bytes, self.logits_bytes),
            ("layer count", theirs.layers.len(), self.layers.len()),
        ] {
            if t != o {
                return differ(field, t.to_string(), o.to_string());
            }
        }
        for (i, (t, o)) in theirs.layers.iter().zip(&self.layers).enumerate() {
            if t != o {
                return differ(&format!("layer {i}"), format!("{t:?}"), format!("{o:?}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> WireGeometry {
        let specs = [
            LayerSpec { kind: AttnKind::Window, ratio: 0, head_dim: 32, index_dim: 0, rope_dim: 16 },
            LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: 32, index_dim: 16, rope_dim: 16 },
            LayerSpec { kind: AttnKind::Hca, ratio: 128, head_dim: 32, index_dim: 0, rope_dim: 16 },
        ];
        let layout = KvLayout::new(128, 128, EntryDtype::Bf16, &specs);
        WireGeometry::new(&layout, &Fingerprint([7; 32]), 320)
    }

    #[test]
    fn proto_round_trip_and_mismatches_are_named() {
        let g = geometry();
        assert_eq!(WireGeometry::from_proto(&g.to_proto()).unwrap(), g);
        assert!(g.check_compatible(&g).is_ok());
        let mut other = g.clone();
        other.layers[1].spec.index_dim = 8;
        let err = g.check_compatible(&other).unwrap_err();
        assert!(err.to_string().contains("layer 1"), "{err}");
        let mut other = g.clone();
        other.fingerprint = Fingerprint([8; 32]);
        assert!(g.check_compatible(&other).unwrap_err().to_string().contains("model fingerprint"));
        let mut p = g.to_proto();
        p.entry_dtype = "fp16".into();
        assert!(matches!(WireGeometry::from_proto(&p), Err(WireError::Malformed(_))));
    }

    #[test]
    fn fp8_geometry_names_dtype_and_record_strides() {
        let bf16 = geometry();
        let specs: Vec<LayerSpec> = bf16.layers.iter().map(|l| l.spec).collect();
        let fp8 = WireGeometry::new(&KvLayout::new(128, 128, EntryDtype::Fp8, &specs), &Fingerprint([7; 32]), 320);
        assert_eq!(WireGeometry::from_proto(&fp8.to_proto()).unwrap(), fp8);
        // head_dim 32 with 16 rope dims: 16 codes + 32 tail bytes + 1 scale → 56 bytes;
        // a 16-dim indexer key: 16 codes + 1 scale → 24 bytes.
        assert_eq!((fp8.layers[1].main_stride, fp8.layers[1].index_stride), (56, 24));
        assert_eq!(fp8.to_proto().entry_dtype, "fp8");
        let err = bf16.check_compatible(&fp8).unwrap_err().to_string();
        assert!(err.contains("entry dtype") && err.contains("fp8") && err.contains("bf16"), "{err}");
        // Same dtype, different record layout (say a peer that kept no BF16 tail).
        let mut other = fp8.clone();
        other.layers[1].main_stride = 40;
        assert!(fp8.check_compatible(&other).unwrap_err().to_string().contains("layer 1"));
    }
}
