//! The MoE block on the GPU: router product and routing kernel on the device; the
//! chosen experts come back to the host (one small copy per block) so each expert
//! runs one product over exactly the rows it received, gemv for a few rows and
//! cuBLAS for many; results are accumulated in expert order, as the CPU does, so the
//! sum does not depend on scheduling.

use cudarc::driver::DeviceRepr;

use super::CudaBackend;
use super::matmul::{Operand, matmul, swiglu_pair};
use super::memory::CudaBuf;
use super::runtime::{cfg, cfg_elems, launch};
use crate::backend::{ExpertWeights, MoeWeights, Routing};

/// Most routed experts the routing kernel's by-value bias holds.
const MAX_EXPERTS: usize = 512;

#[repr(C)]
#[derive(Clone, Copy)]
struct F512 {
    v: [f32; MAX_EXPERTS],
}

// SAFETY: a plain #[repr(C)] float array, `struct F512` in moe.cu.
unsafe impl DeviceRepr for F512 {}

/// SwiGLU expert on `x[rows, d]` (contiguous) into a new `[rows, d_out]`.
fn expert(b: &CudaBackend, x: u64, rows: usize, e: &ExpertWeights<CudaBackend>, limit: f32) -> CudaBuf {
    let g = &b.gpu;
    let inter = e.w1.rows;
    let h = b.alloc_buf(rows * inter);
    let op = Operand { x, x_stride: e.w1.cols, out: g.ptr(&h.mem), out_stride: inter, rows, groups: 1 };
    swiglu_pair(g, op, &e.w1, &e.w3, limit);
    let y = b.alloc_buf(rows * e.w2.rows);
    let op = Operand { x: g.ptr(&h.mem), x_stride: inter, out: g.ptr(&y.mem), out_stride: e.w2.rows, rows, groups: 1 };
    matmul(g, op, &e.w2);
    y
}

pub(crate) fn moe(
    b: &CudaBackend,
    x: &CudaBuf,
    rows: usize,
    tokens: &[u32],
    w: &MoeWeights<CudaBackend>,
    out: &mut CudaBuf,
) {
    let g = &b.gpu;
    let (n_exp, d, k) = (w.gate.rows, w.gate.cols, w.top_k);
    assert_eq!(x.len, rows * d, "moe input is not [rows, {d}]");
    assert_eq!(out.len, rows * d, "moe output is not [rows, {d}]");
    assert!(n_exp <= MAX_EXPERTS, "{n_exp} experts exceed the CUDA routing kernel's {MAX_EXPERTS}");
    if rows == 0 {
        return;
    }
    let (chosen, weights) = b.prof("moe: router", || {
        let logits = b.alloc_buf(rows * n_exp);
        let op = Operand { x: g.ptr(&x.mem), x_stride: d, out: g.ptr(&logits.mem), out_stride: n_exp, rows, groups: 1 };
        matmul(g, op, &w.gate);

        let mut bias = F512 { v: [0.0; MAX_EXPERTS] };
        let hash_rows = match &w.routing {
            Routing::TopK { bias: bv } => {
                bias.v[..bv.len()].copy_from_slice(bv);
                None
            }
            Routing::Hash { tid2eid } => {
                let mut rows_k = Vec::with_capacity(rows * k);
                for &t in &tokens[..rows] {
                    rows_k.extend_from_slice(&tid2eid[t as usize * k..(t as usize + 1) * k]);
                }
                Some(g.upload(&rows_k))
            }
        };
        let experts = g.alloc::<i32>(rows * k);
        let weights = b.alloc_buf(rows * k);
        launch!(
            g,
            "moe_route",
            cfg((rows.div_ceil(128) as u32, 1, 1), 128, 0),
            g.ptr(&logits.mem),
            rows as i32,
            n_exp as i32,
            k as i32,
            hash_rows.as_ref().map(|h| g.ptr(h)).unwrap_or(0),
            bias,
            w.route_scale,
            g.ptr(&experts),
            g.ptr(&weights.mem),
        );
        let mut chosen = vec![0i32; rows * k];
        g.read(&experts, 0, &mut chosen);
        (chosen, weights)
    });
    // Rows per expert in expert order; the list holds row ids, then weight indices.
    let mut per_expert: Vec<Vec<(u32, u32)>> = vec![Vec::new(); w.experts.len()];
    for (i, &e) in chosen.iter().enumerate() {
        let e = usize::try_from(e).ok().filter(|&e| e < w.experts.len());
        let e = e.unwrap_or_else(|| panic!("routing chose an expert outside 0..{}", w.experts.len()));
        per_expert[e].push(((i / k) as u32, i as u32));
    }
    let total = rows * k;
    let mut list = Vec::with_capacity(2 * total);
    list.extend(per_expert.iter().flatten().map(|&(r, _)| r));
    list.extend(per_expert.iter().flatten().map(|&(_, j)| j));
    let list = g.upload(&list);
    let lp = g.ptr(&list);

    b.prof("moe: experts", || {
        g.memset_zero(&mut out.mem);
        let mut at = 0usize;
        for (e, assigned) in per_expert.iter().enumerate() {
            let n = assigned.len();
            if n == 0 {
                continue;
            }
            let xg = b.alloc_buf(n * d);
            launch!(
                g,
                "gather_rows",
                cfg_elems(n * d),
                g.ptr(&xg.mem),
                g.ptr(&x.mem),
                lp + 4 * at as u64,
                n as i32,
                d as i32
            );
            let y = expert(b, g.ptr(&xg.mem), n, &w.experts[e], w.swiglu_limit);
            // A row listed twice for one expert (a hash table may repeat an expert) must be
            // summed in order: then one thread walks each column; otherwise every element
            // has its own thread.
            let mut seen: Vec<u32> = assigned.iter().map(|&(r, _)| r).collect();
            seen.dedup();
            let (name, c) = if seen.len() == n {
                ("moe_accumulate_rows", cfg_elems(n * d))
            } else {
                ("moe_accumulate", cfg((d.div_ceil(256) as u32, 1, 1), 256, 0))
            };
            launch!(
                g,
                name,
                c,
                g.ptr(&out.mem),
                g.ptr(&y.mem),
                lp + 4 * at as u64,
                lp + 4 * (total + at) as u64,
                g.ptr(&weights.mem),
                n as i32,
                d as i32
            );
            at += n;
        }
    });
    if let Some(shared) = &w.shared {
        b.prof("moe: shared", || {
            let y = expert(b, g.ptr(&x.mem), rows, shared, w.swiglu_limit);
            launch!(g, "add_into", cfg_elems(rows * d), g.ptr(&out.mem), g.ptr(&y.mem), (rows * d) as i64);
        });
    }
}
