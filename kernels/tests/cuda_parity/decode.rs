//! The second-version decode kernels (cu/decode2.cu, `SLUICE_CUDA_DECODE_KERNELS=v2`)
//! against the CPU backend: FP8 and FP4 products and SwiGLU pairs at V4-Flash shapes and
//! at odd ones (partial row tiles, K splits whose warps get unequal or no rounds), rows
//! 1-8 (one and two mma column blocks) and plain products of 9-32 rows (FP4 up to 16),
//! and the routed experts of decode batches of 1-64
//! rows (top-k and hash routing with an expert named twice for one token; 9-64 rows by
//! segments of 4 and of 8 rows), each on poisoned outputs.
//! Every case first checks that v2 really takes it (the kernel it runs is printed).
//! Also the FP8 tensor-core gemv the v2 path tries first for FP8 products of 1-2 rows.

use super::*;

/// The same MoE layer on backend `b` with SwiGLU clamp `limit` (route scale 1.5).
pub(super) fn experts_layer<B: Backend>(
    b: &B,
    gate: &TestWeight,
    routing: Routing,
    experts: &[[TestWeight; 3]],
    shared: &[TestWeight; 3],
    k: usize,
    limit: f32,
) -> MoeWeights<B> {
    let expert = |e: &[TestWeight; 3]| ExpertWeights {
        w1: b.weight(e[0].view()),
        w2: b.weight(e[1].view()),
        w3: b.weight(e[2].view()),
    };
    MoeWeights {
        gate: b.weight(gate.view()),
        routing,
        experts: experts.iter().map(expert).collect(),
        expert_base: 0,
        shared: Some(expert(shared)),
        top_k: k,
        route_scale: 1.5,
        swiglu_limit: limit,
    }
}

#[test]
fn cuda_decode_v2_products_match_cpu() {
    let Some(g) = gpu("cuda_decode_v2_products_match_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("decode v2 products");
    // (outputs, inputs): wq_a, wq_b-like (K 1024), wo_b (K 8192), an expert's or the shared
    // expert's gate/up and down, then odd shapes: partial row tiles, 3 or 6 rounds of K
    // over 8 warps (some warps without a round), few outputs (K split over many parts).
    let shapes = [(1024, 4096), (8192, 1024), (4096, 8192), (2048, 4096), (4096, 2048), (200, 384), (24, 1024)];
    for (n, k) in shapes {
        for dtype in ["fp8", "fp4"] {
            let w = weight(&mut rng, n, k, 0.05, dtype);
            let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
            // 9-16 and 17-32 rows: one launch of 2 or 4 column blocks of 8 rows, f16
            // activations alone (FP4 up to 16).
            let wide: &[usize] = if dtype == "fp8" { &[9, 16, 17, 32] } else { &[9, 16] };
            for &rows in [1, 2, 3, 4, 5, 8].iter().chain(wide) {
                let x = rand_vec(&mut rng, rows * k, 1.0);
                let gx = g.upload(&x);
                let kernel = g.decode_v2_kernel(&gx, rows, 1, &gw, None);
                let kernel = kernel.unwrap_or_else(|| panic!("v2 does not take {dtype} {n}x{k} at {rows} rows"));
                let mut out = poisoned(g, rows * n);
                g.decode_matmul("v2", &gx, rows, 1, &gw, &mut out);
                let mut want = vec![0f32; rows * n];
                c.matmul(&x, rows, &cw, &mut want);
                check(&format!("v2 matmul {n}x{k} rows={rows} ({kernel})"), dtype, &g.download(&out), &want);
            }
        }
    }
}

/// The attention output's grouped projection (`wo_a`: 8 groups of 4096 inputs → 1024
/// outputs each, every group reading its own slice of the row) on the v2 kernels, and a
/// narrower grouping (4 groups of 64 outputs over 256 inputs: two units a group).
#[test]
fn cuda_decode_v2_grouped_products_match_cpu() {
    let Some(g) = gpu("cuda_decode_v2_grouped_products_match_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("decode v2 grouped");
    for (groups, n, k) in [(8, 8 * 1024, 4096), (4, 4 * 64, 256)] {
        for dtype in ["fp8", "fp4"] {
            let w = weight(&mut rng, n, k, 0.05, dtype);
            let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
            for rows in [1, 3, 5, 8] {
                let x = rand_vec(&mut rng, rows * groups * k, 1.0);
                let gx = g.upload(&x);
                // Up to 4 rows every unit gets a block of its own; at 5-8 rows the wider
                // activations leave one block an SM (or a K split), so 8 x 1024 x 4096 goes
                // to v1 there, and the result is checked either way.
                let kernel = g.decode_v2_kernel(&gx, rows, groups, &gw, None);
                assert!(kernel.is_some() || rows > 4, "v2 does not take grouped {dtype} {n}x{k} at {rows} rows");
                let kernel = kernel.unwrap_or("v1");
                let mut out = poisoned(g, rows * n);
                g.decode_matmul("v2", &gx, rows, groups, &gw, &mut out);
                let mut want = vec![0f32; rows * n];
                c.grouped_matmul(&x, rows, groups, &cw, &mut want);
                let what = format!("v2 grouped {groups}x{}x{k} rows={rows} ({kernel})", n / groups);
                check(&what, dtype, &g.download(&out), &want);
            }
        }
    }
}

/// Allowed max|Δ|/max|CPU| of the FP8 tensor-core gemv (cu/gemv_f8mma.cu): its
/// activations are three e4m3 parts (~2^-12 of each value, below 2^-18 of the row's
/// largest); measured 1.3-2.0e-5 on the H200, so this bound is ten times that, where a
/// wrong fragment, scale or part gives errors of order 1.
const F8MMA_TOL: f32 = 2e-4;

/// The FP8 tensor-core gemv at 1 and 2 rows: wo_b (K 8192, the largest activations), the
/// shared expert's down projection (K 2048), odd shapes (N = 4,112: 257 tiles, so
/// blocks take one or two, and the last scale block has 16 rows; K = 3,072 and 6,144: odd
/// counts of 1024- and 2048-input chunks, the kernel's two chunk sizes) and the grouped
/// wo_a (8 groups of 1024 outputs over 4096 inputs: blocks whose tiles cross into the
/// next group), on poisoned outputs, against the CPU; rows of very different magnitudes
/// (each row's parts have their own scale). Every case first checks that this kernel's
/// plan takes it, with chunks of 2048 where K is a multiple (unless
/// `SLUICE_CUDA_F8MMA_CHUNK=1024`), then runs the kernel alone (on sm_90 the engine tries
/// the warpgroup gemv first: f8wg.rs); wq_b's shape (K 1024) is not this kernel's and
/// runs the engine's path.
#[test]
fn cuda_f8mma_products_match_cpu() {
    let Some(g) = gpu("cuda_f8mma_products_match_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("f8mma products");
    let narrow_only = std::env::var("SLUICE_CUDA_F8MMA_CHUNK").ok().filter(|v| v == "1024");
    let shapes =
        [(1, 4096, 8192), (1, 4096, 2048), (1, 4112, 3072), (1, 4112, 6144), (8, 8 * 1024, 4096), (1, 32768, 1024)];
    for (groups, n, k) in shapes {
        let w = weight(&mut rng, n, k, 0.05, "fp8");
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for rows in [1, 2] {
            let x: Vec<f32> = (0..rows).flat_map(|r| rand_vec(&mut rng, groups * k, [1.0, 3e-3][r])).collect();
            let gx = g.upload(&x);
            let kernel = g.decode_f8mma_kernel(&gx, rows, groups, &gw);
            assert_eq!(kernel.is_some(), k > 1024, "f8mma takes {groups} x {n}x{k} at {rows} rows: {kernel:?}");
            let wide = narrow_only.is_none() && k % 2048 == 0;
            assert_eq!(kernel.is_some_and(|k| k.contains("_w_")), wide, "chunks of {groups} x {n}x{k}: {kernel:?}");
            let mut out = poisoned(g, rows * n);
            // The kernel alone (the engine's path tries the warpgroup gemv first on sm_90).
            let kernel = match kernel {
                Some(_) => g.decode_fp8_kernel_alone("f8mma", &gx, rows, groups, &gw, &mut out).expect("f8mma runs"),
                None => {
                    g.decode_matmul("v2", &gx, rows, groups, &gw, &mut out);
                    "v2"
                }
            };
            let got = g.download(&out);
            let mut want = vec![0f32; rows * n];
            c.grouped_matmul(&x, rows, groups, &cw, &mut want);
            let tol = if kernel == "v2" { tol("fp8") } else { F8MMA_TOL };
            for r in 0..rows {
                let span = r * n..(r + 1) * n;
                let e = rel_err(&got[span.clone()], &want[span]);
                eprintln!("PARITY f8mma {groups}x{n}x{k} rows={rows} row {r} ({kernel}) {e:.2e}");
                assert!(e <= tol, "{kernel} {groups} x {n}x{k} row {r} of {rows}: {e:.3e} above {tol:.0e}");
            }
        }
    }
}

#[test]
fn cuda_decode_v2_swiglu_pairs_match_cpu() {
    let Some(g) = gpu("cuda_decode_v2_swiglu_pairs_match_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("decode v2 swiglu");
    for (n, k, limit) in [(2048, 4096, 10.0f32), (200, 384, 2.0), (24, 1024, 10.0)] {
        for dtype in ["fp8", "fp4"] {
            let (w1, w3) = (weight(&mut rng, n, k, 0.05, dtype), weight(&mut rng, n, k, 0.05, dtype));
            let (g1, g3) = (g.weight(w1.view()), g.weight(w3.view()));
            let (c1, c3) = (c.weight(w1.view()), c.weight(w3.view()));
            for rows in [1, 3, 4, 8] {
                let x = rand_vec(&mut rng, rows * k, 1.0);
                let gx = g.upload(&x);
                let kernel = g.decode_swiglu_kernel(&gx, rows, &g1, &g3);
                let kernel = kernel.unwrap_or_else(|| panic!("v2 does not take the {dtype} pair {n}x{k}"));
                let mut out = poisoned(g, rows * n);
                g.decode_swiglu("v2", &gx, rows, &g1, &g3, limit, &mut out);
                let (mut gate, mut up) = (vec![0f32; rows * n], vec![0f32; rows * n]);
                c.matmul(&x, rows, &c1, &mut gate);
                c.matmul(&x, rows, &c3, &mut up);
                let want = swiglu_reference(&gate, &up, limit);
                check(&format!("v2 swiglu {n}x{k} rows={rows} ({kernel})"), dtype, &g.download(&out), &want);
            }
        }
    }
}

/// The routed experts of decode batches at V4-Flash widths (hidden 4096, experts of 2048
/// in FP4, an FP8 shared expert, top-6 of 12), both decode versions against the CPU:
/// 1-8 rows (every expert over the whole batch) and 9-64 rows (segments of one expert's
/// rows: with 12 experts a 64-row batch gives each ~32 rows, several 8-row segments),
/// then 64 narrower experts, where 9-64 row batches take 4-row segments, and V4-Pro's
/// 384 experts (the top-k warp's lanes then hold 12 each) narrowed, at a few sizes, with
/// the experts in twins of equal router rows and biases and an odd top-k (5): a row's
/// fifth choice is then a tie between twins, which both devices must give to the lower
/// expert id (the twins' expert weights differ, so the other choice moves the output far
/// past the bound).
#[test]
fn cuda_decode_v2_experts_match_cpu() {
    let Some(g) = gpu("cuda_decode_v2_experts_match_cpu") else { return };
    let g = &*g;
    let mut rng = rng("decode v2 experts");
    check_experts(g, &mut rng, (4096, 2048, 12, 6), &[1, 3, 8, 9, 24, 64], false);
    check_experts(g, &mut rng, (1024, 256, 64, 6), &[9, 21, 64], false);
    check_experts(g, &mut rng, (512, 128, 384, 5), &[1, 5, 40], true);
}

/// A hash-routing table over a 32-token vocabulary whose even tokens name their first
/// expert twice (an expert list with repeats; row 0 of every test batch is token 0).
pub(super) fn hash_table_with_repeats(k: usize, n_exp: usize) -> (usize, Vec<u32>) {
    let vocab: usize = 32;
    let tid2eid = (0..vocab * k)
        .map(|i| {
            let (t, j) = (i / k, i % k);
            let j = if t.is_multiple_of(2) && j == k - 1 { 0 } else { j };
            ((t * 5 + j * 7) % n_exp) as u32
        })
        .collect();
    (vocab, tid2eid)
}

/// One MoE layer of (hidden, expert width, experts, top-k) under top-k and hash routing
/// at two SwiGLU clamps, each batch size of `batches` both decode versions vs the CPU;
/// with `twins`, experts 2i and 2i + 1 get the same router row and bias.
fn check_experts(
    g: &CudaBackend,
    rng: &mut ChaCha8Rng,
    (d, inter, n_exp, k): (usize, usize, usize, usize),
    batches: &[usize],
    twins: bool,
) {
    let c = CpuBackend::new();
    let mut gate = weight(rng, n_exp, d, 0.05, "f32");
    let experts: Vec<[TestWeight; 3]> = (0..n_exp).map(|_| expert_weights(rng, d, inter, "fp4")).collect();
    let shared = expert_weights(rng, d, inter, "fp8");
    let mut bias = rand_vec(rng, n_exp, 0.2);
    if twins {
        for e in (0..n_exp).step_by(2) {
            gate.host.data.copy_within(e * d..(e + 1) * d, (e + 1) * d);
            bias[e + 1] = bias[e];
        }
    }
    let (vocab, tid2eid) = hash_table_with_repeats(k, n_exp);
    for limit in [10.0f32, 2.0] {
        for hash in [false, true] {
            let routing =
                || if hash { Routing::Hash { tid2eid: tid2eid.clone() } } else { Routing::TopK { bias: bias.clone() } };
            let gm = experts_layer(g, &gate, routing(), &experts, &shared, k, limit);
            let cm = experts_layer(&c, &gate, routing(), &experts, &shared, k, limit);
            for &rows in batches {
                assert!(g.decode_v2_experts(rows, &gm), "v2 does not take the experts at {rows} rows");
                let x = rand_vec(rng, rows * d, 1.0);
                let tokens = batch_tokens(rng, rows, vocab);
                let gx = g.upload(&x);
                let mut want = vec![0f32; rows * d];
                c.moe(&x, rows, &tokens, &cm, 0..rows, &mut want);
                // 1-64 rows: "v2" runs the `wgmma` kernels on sm_90 (moe_wgmma.rs's own test
                // covers 1-8), "v2-segments" the segment kernels everywhere; "v1" and "v2" route
                // in one launch with the lists (`moe_route_lists`), "v2-segments" in two.
                let variants: &[&str] = if rows <= 64 { &["v1", "v2", "v2-segments"] } else { &["v1", "v2"] };
                for &variant in variants {
                    let mut out = poisoned(g, rows * d);
                    g.decode_moe(variant, &gx, rows, &tokens, &gm, 0..rows, &mut out);
                    let what = format!("{variant} moe {n_exp}x{inter} limit={limit} hash={hash} rows={rows}");
                    check(&what, "fp4", &g.download(&out), &want);
                }
            }
        }
    }
}
