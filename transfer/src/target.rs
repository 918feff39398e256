//! Where one sequence's KV goes: the receiver's worker address, its four registered
//! regions (pages, window rings, compressor slots, logits), the destination page ids
//! and state slot.

use sluice_proto::v1 as pb;

use crate::wire::{WIRE_VERSION, WireError, WireGeometry};

/// A registered region as a peer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionSpec {
    pub base: u64,
    pub len: u64,
    pub rkey: Vec<u8>,
}

impl RegionSpec {
    fn to_proto(&self) -> pb::RemoteRegion {
        pb::RemoteRegion { base: self.base, len: self.len, rkey: self.rkey.clone() }
    }

    fn from_proto(r: Option<&pb::RemoteRegion>, name: &str) -> Result<Self, WireError> {
        let r = r.ok_or_else(|| WireError::Malformed(format!("missing {name} region")))?;
        Ok(RegionSpec { base: r.base, len: r.len, rkey: r.rkey.clone() })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub geometry: WireGeometry,
    pub ucx_address: Vec<u8>,
    pub pages: RegionSpec,
    pub rings: RegionSpec,
    pub comp: RegionSpec,
    pub logits: RegionSpec,
    pub page_ids: Vec<u32>,
    pub slot: u32,
}

impl Target {
    pub fn to_proto(&self) -> pb::KvTarget {
        pb::KvTarget {
            wire_version: WIRE_VERSION,
            geometry: Some(self.geometry.to_proto()),
            ucx_address: self.ucx_address.clone(),
            pages: Some(self.pages.to_proto()),
            rings: Some(self.rings.to_proto()),
            comp: Some(self.comp.to_proto()),
            logits: Some(self.logits.to_proto()),
            page_ids: self.page_ids.clone(),
            slot: self.slot,
        }
    }

    pub fn from_proto(t: &pb::KvTarget) -> Result<Self, WireError> {
        if t.wire_version != WIRE_VERSION {
            return Err(WireError::Version { theirs: t.wire_version });
        }
        let geometry = WireGeometry::from_proto(
            t.geometry.as_ref().ok_or_else(|| WireError::Malformed("missing geometry".into()))?,
        )?;
        let target = Target {
            geometry,
            ucx_address: t.ucx_address.clone(),
            pages: RegionSpec::from_proto(t.pages.as_ref(), "pages")?,
            rings: RegionSpec::from_proto(t.rings.as_ref(), "rings")?,
            comp: RegionSpec::from_proto(t.comp.as_ref(), "comp")?,
            logits: RegionSpec::from_proto(t.logits.as_ref(), "logits")?,
            page_ids: t.page_ids.clone(),
            slot: t.slot,
        };
        target.check_ranges()?;
        Ok(target)
    }

    /// Every byte a sender writes for this target (each page at its id, the state parts
    /// at the slot) lies inside the region the peer registered, and no address computed
    /// for it overflows: a peer's page id or slot must never send bytes elsewhere.
    fn check_ranges(&self) -> Result<(), WireError> {
        let g = &self.geometry;
        let fits = |r: &RegionSpec, index: u64, size: usize, what: &str| {
            let end = index.checked_mul(size as u64).and_then(|start| start.checked_add(size as u64));
            if end.is_some_and(|end| end <= r.len) && r.base.checked_add(r.len).is_some() {
                return Ok(());
            }
            Err(WireError::Malformed(format!(
                "{what} {index} ({size} bytes each) lies outside its region of {} bytes at {:#x}",
                r.len, r.base
            )))
        };
        for &id in &self.page_ids {
            fits(&self.pages, id as u64, g.page_bytes, "page")?;
        }
        fits(&self.rings, self.slot as u64, g.ring_bytes, "window rings of slot")?;
        fits(&self.comp, self.slot as u64, g.comp_bytes, "compressor slots of slot")?;
        fits(&self.logits, self.slot as u64, g.logits_bytes, "logits of slot")
    }
}

#[cfg(test)]
mod tests {
    use kernels::{AttnKind, EntryDtype, KvLayout, LayerSpec};
    use model_spec::Fingerprint;

    use super::*;

    fn target() -> Target {
        let spec = LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: 32, index_dim: 16, rope_dim: 16 };
        let region = RegionSpec { base: 4096, len: 1 << 20, rkey: vec![1, 2, 3] };
        Target {
            geometry: WireGeometry::new(&KvLayout::new(128, 128, EntryDtype::Fp8, &[spec]), &Fingerprint([5; 32]), 64),
            ucx_address: vec![9; 12],
            pages: region.clone(),
            rings: region.clone(),
            comp: region.clone(),
            logits: region,
            page_ids: vec![3, 1, 4],
            slot: 2,
        }
    }

    #[test]
    fn refuses_pages_and_slots_outside_the_regions() {
        // fuzz/regressions/kv_wire/page-outside-region: the sender's address arithmetic
        // trusted these.
        let t = target();
        let mut p = t.to_proto();
        p.page_ids.push(1 << 20);
        let err = Target::from_proto(&p).unwrap_err().to_string();
        assert!(err.contains("page 1048576") && err.contains("outside its region"), "{err}");
        let mut p = t.to_proto();
        p.slot = u32::MAX;
        assert!(Target::from_proto(&p).unwrap_err().to_string().contains("window rings of slot"));
        let mut p = t.to_proto();
        p.logits.as_mut().unwrap().base = u64::MAX - 8;
        assert!(Target::from_proto(&p).unwrap_err().to_string().contains("logits of slot"));
    }

    #[test]
    fn round_trips_and_refuses_other_wire_versions_naming_both() {
        let t = target();
        assert_eq!(Target::from_proto(&t.to_proto()).unwrap(), t);
        for theirs in [WIRE_VERSION - 1, WIRE_VERSION + 1] {
            let mut p = t.to_proto();
            p.wire_version = theirs;
            let err = Target::from_proto(&p).unwrap_err();
            assert_eq!(err, WireError::Version { theirs });
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("version {theirs}")) && msg.contains(&format!("version {WIRE_VERSION}")),
                "{msg}"
            );
        }
    }
}
