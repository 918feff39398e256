//! A sender and a receiver in one process: pages land in the slots the target names,
//! byte for byte, and mismatched geometry is refused before anything moves.

use std::time::Duration;

use kernels::backend::Backend;
use kernels::{AttnKind, CpuBackend, EntryDtype, KvLayout, LayerSpec};
use model_spec::Fingerprint;
use transfer::{Checksums, Receiver, SendParts, Sender, Target, WireGeometry};

fn geometry() -> WireGeometry {
    let specs = [
        LayerSpec { kind: AttnKind::Window, ratio: 0, head_dim: 32, index_dim: 0, rope_dim: 16 },
        LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: 32, index_dim: 16, rope_dim: 16 },
        LayerSpec { kind: AttnKind::Hca, ratio: 128, head_dim: 32, index_dim: 0, rope_dim: 16 },
    ];
    WireGeometry::new(&KvLayout::new(128, 128, EntryDtype::Bf16, &specs), &Fingerprint([3; 32]), 320)
}

fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt)).collect()
}

#[test]
fn pages_state_and_logits_land_where_the_target_says() {
    let g = geometry();
    let (pages_total, slots) = (8usize, 3usize);
    let rx = Receiver::start().unwrap();
    let pages = rx.allocate(pages_total * g.page_bytes).unwrap();
    let rings = rx.allocate(slots * g.ring_bytes).unwrap();
    let comp = rx.allocate(slots * g.comp_bytes).unwrap();
    let logits = rx.allocate(slots * g.logits_bytes).unwrap();
    let target = Target {
        geometry: g.clone(),
        ucx_address: rx.address().to_vec(),
        pages: pages.spec.clone(),
        rings: rings.spec.clone(),
        comp: comp.spec.clone(),
        logits: logits.spec.clone(),
        page_ids: vec![5, 2, 7],
        slot: 1,
    };
    // Through the proto form, as a prefill worker receives it.
    let target = Target::from_proto(&target.to_proto()).unwrap();

    let src_pages: Vec<Vec<u8>> = (0..3).map(|i| pattern(g.page_bytes, i)).collect();
    let (src_rings, src_comp, src_logits) =
        (pattern(g.ring_bytes, 9), pattern(g.comp_bytes, 10), pattern(g.logits_bytes, 11));
    let parts = SendParts {
        pages: src_pages.iter().map(|p| p.as_slice()).collect(),
        rings: &src_rings,
        comp: &src_comp,
        logits: &src_logits,
    };
    let mut tx = Sender::new().unwrap();
    let stats = tx.send(&target, &g, &parts, Duration::from_secs(20)).unwrap();
    assert_eq!(stats.bytes, parts.bytes());

    // Read the landed bytes the way a decode worker does: through its engine's KV storage.
    let cpu = CpuBackend::new();
    let kv =
        |r: transfer::RegisteredRegion, len: usize| cpu.kv_adopt(Box::new(r.region), len, EntryDtype::F32).unwrap();
    let (pk, rk, ck, lk) = (
        kv(pages, pages_total * g.page_bytes / 4),
        kv(rings, slots * g.ring_bytes / 4),
        kv(comp, slots * g.comp_bytes / 4),
        kv(logits, slots * g.logits_bytes / 4),
    );
    let page = |id: usize| cpu.kv_host_bytes(&pk).unwrap()[id * g.page_bytes..(id + 1) * g.page_bytes].to_vec();
    let slot = |k: &kernels::cpu::CpuKv, per: usize| cpu.kv_host_bytes(k).unwrap()[per..2 * per].to_vec();
    let landed = SendParts {
        pages: vec![],
        rings: &slot(&rk, g.ring_bytes),
        comp: &slot(&ck, g.comp_bytes),
        logits: &slot(&lk, g.logits_bytes),
    };
    let landed_pages = [page(5), page(2), page(7)];
    let landed = SendParts { pages: landed_pages.iter().map(|p| p.as_slice()).collect(), ..landed };
    assert_eq!(Checksums::of(&parts).first_mismatch(&Checksums::of(&landed)), None);
    assert!(page(0).iter().all(|&b| b == 0), "unreserved pages stay untouched");
}

#[test]
fn mismatched_geometry_is_refused_before_sending() {
    let g = geometry();
    let rx = Receiver::start().unwrap();
    let r = rx.allocate(g.page_bytes).unwrap();
    let mut theirs = g.clone();
    theirs.dtype = EntryDtype::F32;
    let target = Target {
        geometry: theirs,
        ucx_address: rx.address().to_vec(),
        pages: r.spec.clone(),
        rings: r.spec.clone(),
        comp: r.spec.clone(),
        logits: r.spec.clone(),
        page_ids: vec![0],
        slot: 0,
    };
    let empty = SendParts { pages: vec![], rings: &[], comp: &[], logits: &[] };
    let err = Sender::new().unwrap().send(&target, &g, &empty, Duration::from_secs(5)).unwrap_err();
    assert!(err.to_string().contains("entry dtype"), "{err}");
}
