//! The KV wire description (see `WIRE_VERSION`): everything two processes must agree on before
//! one writes KV bytes into the other's memory. Pages and state move as raw bytes and
//! the receiver reads them through its own layout table, so the description names the
//! model fingerprint, entry dtype, page and state geometry and the per-layer table; any
//! difference refuses the transfer and names the first field that differs.

use kernels::{AttnKind, EntryDtype, KvLayout, LayerSpec};
use model_spec::Fingerprint;
use sluice_proto::v1 as pb;
use thiserror::Error;

pub const WIRE_VERSION: u32 = 2;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("KV wire version {theirs} is not supported (this build speaks {WIRE_VERSION})")]
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
    pub layers: Vec<LayerSpec>,
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
            layers: layout.layers.iter().map(|l| l.spec).collect(),
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
                    kind: l.kind.name().to_string(),
                    ratio: l.ratio as u32,
                    head_dim: l.head_dim as u32,
                    index_dim: l.index_dim as u32,
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
                Ok(LayerSpec {
                    kind,
                    ratio: l.ratio as usize,
                    head_dim: l.head_dim as usize,
                    index_dim: l.index_dim as usize,
                })
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
            LayerSpec { kind: AttnKind::Window, ratio: 0, head_dim: 32, index_dim: 0 },
            LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: 32, index_dim: 16 },
            LayerSpec { kind: AttnKind::Hca, ratio: 128, head_dim: 32, index_dim: 0 },
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
        other.layers[1].index_dim = 8;
        let err = g.check_compatible(&other).unwrap_err();
        assert!(err.to_string().contains("layer 1"), "{err}");
        let mut other = g.clone();
        other.fingerprint = Fingerprint([8; 32]);
        assert!(g.check_compatible(&other).unwrap_err().to_string().contains("model fingerprint"));
        let mut p = g.to_proto();
        p.entry_dtype = "fp16".into();
        assert!(matches!(WireGeometry::from_proto(&p), Err(WireError::Malformed(_))));
    }
}
