//! Parameter bundles split between devices: replicated parts go to every device, each
//! routed expert to the device that holds it.

use super::Sharded;
use super::buf::ShardWeight;
use crate::backend::{Backend, ExpertWeights, HcHeadWeights, HcWeights, MoeWeights};

pub(super) fn hc<B: Backend>(s: &Sharded<B>, w: HcWeights<Sharded<B>>) -> Vec<B::Hc> {
    let HcWeights { mix, base, scale, hc, hidden, sinkhorn_iters, norm_eps, hc_eps } = w;
    s.ranks
        .iter()
        .zip(mix.into_replicas())
        .map(|(b, mix)| {
            b.hc_weights(HcWeights { mix, base: base.clone(), scale, hc, hidden, sinkhorn_iters, norm_eps, hc_eps })
        })
        .collect()
}

pub(super) fn hc_head<B: Backend>(s: &Sharded<B>, w: HcHeadWeights<Sharded<B>>) -> Vec<B::HcHead> {
    let HcHeadWeights { mix, base, scale, hc, hidden, norm_eps, hc_eps } = w;
    s.ranks
        .iter()
        .zip(mix.into_replicas())
        .map(|(b, mix)| {
            b.hc_head_weights(HcHeadWeights { mix, base: base.clone(), scale, hc, hidden, norm_eps, hc_eps })
        })
        .collect()
}

/// Every device gets the router and the shared expert, and the routed experts it holds
/// (a contiguous run of ids, so `expert_base` says which).
pub(super) fn moe<B: Backend>(s: &Sharded<B>, w: MoeWeights<Sharded<B>>) -> Vec<B::Moe> {
    let MoeWeights { gate, routing, experts, expert_base, shared, top_k, route_scale, swiglu_limit } = w;
    let n = s.ranks.len();
    let mut held: Vec<Vec<ExpertWeights<B>>> = (0..n).map(|_| Vec::new()).collect();
    let mut base = vec![None; n];
    for (i, e) in experts.into_iter().enumerate() {
        let (r1, w1) = held_by(e.w1);
        let (r2, w2) = held_by(e.w2);
        let (r3, w3) = held_by(e.w3);
        assert!(r1 == r2 && r2 == r3, "expert {} split over devices {r1}, {r2}, {r3}", expert_base + i);
        assert!(
            base[r1].is_none() || held[r1].len() + base[r1].unwrap_or(0) == expert_base + i,
            "experts of a device are not contiguous"
        );
        base[r1].get_or_insert(expert_base + i);
        held[r1].push(ExpertWeights { w1, w2, w3 });
    }
    let mut shared_parts: Vec<Option<ExpertWeights<B>>> = match shared {
        Some(e) => {
            let (w1, w2, w3) = (e.w1.into_replicas(), e.w2.into_replicas(), e.w3.into_replicas());
            w1.into_iter().zip(w2).zip(w3).map(|((w1, w2), w3)| Some(ExpertWeights { w1, w2, w3 })).collect()
        }
        None => (0..n).map(|_| None).collect(),
    };
    s.ranks
        .iter()
        .zip(gate.into_replicas())
        .zip(held)
        .enumerate()
        .map(|(r, ((b, gate), experts))| {
            b.moe_weights(MoeWeights {
                gate,
                routing: routing.clone(),
                experts,
                expert_base: base[r].unwrap_or(0),
                shared: shared_parts[r].take(),
                top_k,
                route_scale,
                swiglu_limit,
            })
        })
        .collect()
}

fn held_by<B: Backend>(w: ShardWeight<B>) -> (usize, B::Weight) {
    match w {
        ShardWeight::Held { rank, weight } => (rank, weight),
        ShardWeight::Replicated(_) => {
            panic!("a routed expert loaded on every device (load experts with expert_weight)")
        }
    }
}
