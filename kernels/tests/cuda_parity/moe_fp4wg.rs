//! The routed FP4 experts of prefill-sized batches on Hopper's warpgroup instruction
//! (cu/moe_fp4wg.cu: the rows as two bf16 parts or rounded once, e2m1 codes turned into
//! scaled bf16 A fragments in registers, tiles of one expert's rows) against the CPU,
//! through the engine's MoE block (routing read back, grouped products); and FP8
//! products of prefill-sized batches on the same kernel over FP8 codes (`fp8wg_gemm`).
//! Each test runs both activation precisions.

use super::moe_wgmma::Fp4Moe;
use super::*;

/// Allowed max|Δ|/max|CPU| of a MoE block on these kernels: bf16 products of the exact
/// weights and the rows' two bf16 parts (~16 significant bits; then h's) summed in f32
/// (measured 5e-6–1.4e-5); a wrong fragment, swizzle, scale byte, tile or part plane
/// gives errors of order 1.
const FP4WG_TOL: f32 = 1e-4;

/// The rows a product's reference multiplies when the product runs on `fp8wg_gemm`
/// (`on_fp8wg`; a knob may leave decode rows on the gemv loops, which multiply x as it
/// is): x rounded to bf16 (`Activations::Bf16`, the reference model's precision), or
/// x's two bf16 parts added back together (hi = bf16(x), lo = bf16(x − hi): what the
/// kernel multiplies, `fp4wg_parts`). The products are then those rows times W, summed
/// in f32 in another order. Against x itself the parts' residual (up to 2^-18 of x)
/// alone took the shared expert's pair at clamp 0.5 — outputs of at most ~0.16 from
/// products of magnitude ~10 — to 7.8e-5 of the 1e-4 bound, and once past it with fresh
/// inputs; the split-versus-f32 distance stays checked by the MoE blocks here and by
/// `cuda_conformance`.
fn rows_as_multiplied(x: &[f32], on_fp8wg: bool, activations: Activations) -> Vec<f32> {
    let bf16 = |v: f32| bf16_to_f32(f32_to_bf16(v));
    match (on_fp8wg, activations) {
        (false, _) => x.to_vec(),
        (true, Activations::Bf16) => x.iter().map(|&v| bf16(v)).collect(),
        (true, Activations::Split) => x
            .iter()
            .map(|&v| {
                let hi = bf16(v);
                hi + bf16(v - hi)
            })
            .collect(),
    }
}

/// The bound of a MoE block: [`FP4WG_TOL`] with split rows; with rounded ones the bf16
/// row of [`TOLERANCES`] (the block rounds its input and the experts' SwiGLU output
/// before each product, which the f32 CPU block does not).
fn moe_tol(activations: Activations) -> f32 {
    match activations {
        Activations::Split => FP4WG_TOL,
        Activations::Bf16 => tol("bf16"),
    }
}

/// `check` on the `wgmma` GPU in both precisions, split (f32 distance) first (skipped
/// as [`wgmma_gpu`] says).
fn in_both_precisions(test: &str, check: fn(&CudaBackend, Activations)) {
    for activations in [Activations::Split, Activations::Bf16] {
        let Some(g) = wgmma_gpu_in(test, &["SLUICE_CUDA_FP4WG"], activations) else { return };
        check(&g, activations);
    }
}

/// MoE layers of (hidden, expert width, experts, top-k) under top-k and hash routing (an
/// expert named twice for one token), at batches past the decode paths (257 rows and
/// more) whose experts get several 128-row tiles, the last one partial, and one expert
/// whose rows end the last part's plane: V4-Flash's widths, a narrow layer of many
/// experts (tiles of 17-32 rows) and one of 256 (~7 rows an expert, as a 300-token
/// prefill of V4-Flash: the short tiles' kernels, their 384-output gate and up too narrow
/// for the wide blocks). Each case first checks that the engine takes these kernels.
#[test]
fn cuda_moe_fp4wg_experts_match_cpu() {
    in_both_precisions("cuda_moe_fp4wg_experts_match_cpu", fp4wg_experts_match_cpu);
}

fn fp4wg_experts_match_cpu(g: &CudaBackend, activations: Activations) {
    let c = CpuBackend::new();
    let mut rng = rng("moe fp4wg");
    // ((hidden, expert width, experts, top-k), batch sizes)
    type Layer<'a> = ((usize, usize, usize, usize), &'a [usize]);
    let layers: [Layer; 3] =
        [((4096, 2048, 8, 6), &[300]), ((1024, 512, 64, 6), &[257, 1000]), ((1024, 384, 256, 6), &[300])];
    for ((d, inter, n_exp, k), batches) in layers {
        let layer = Fp4Moe::new(&mut rng, (d, inter, n_exp, k));
        for (limit, hash) in [(10.0f32, false), (2.0, true)] {
            let (gm, cm) = (layer.on(g, limit, hash), layer.on(&c, limit, hash));
            assert!(g.grouped_fp4wg(&gm), "fp4wg {n_exp}x{inter}x{d}: not taken");
            for &rows in batches {
                let what = format!("fp4wg {n_exp}x{inter}x{d} limit={limit} hash={hash} rows={rows} x={activations}");
                let e = layer.error(&mut rng, g, &cm, rows, |x, tokens, out| {
                    g.moe(&g.upload(x), rows, tokens, &gm, 0..rows, out)
                });
                eprintln!("PARITY {what} {e:.2e}");
                let bound = moe_tol(activations);
                assert!(e <= bound, "{what}: max|Δ|/max|CPU| {e:.3e} above {bound:.0e}");
            }
        }
    }
}

/// Allowed max|Δ|/max|CPU| of an FP8 product on `fp8wg_gemm`: bf16 products of the exact
/// weights and the rows' two bf16 parts (~16 significant bits) summed in f32, as the
/// `gemm_fp8` tiles before it (`cuda_parity`'s f32-level bound for split activations).
const FP8WG_TOL: f32 = 1e-4;

/// FP8 products on `fp8wg_gemm` against the CPU: V4-Flash's `wq_a` (1,024 × 4,096), `wq_b`
/// (32,768 × 1,024), the grouped `wo_a` (8 groups of 1,024 outputs over 4,096 inputs
/// each) and a narrow one (128 × 256), at prefill row counts that leave a partial last
/// tile (300, 1,000) and one tile (128); and decode batches of 9-64 rows, which the
/// engine sends here too: `wq_b` whole, and split along K where the blocks would not fill
/// the GPU, the grouped `wo_a`, `wq_a`, `wkv` (512 × 4,096), `wo_b` (4,096 × 8,192) and the
/// shared expert's down (4,096 × 2,048) (each checked to be dispatched so). Outputs start
/// poisoned.
#[test]
fn cuda_fp8wg_products_match_cpu() {
    in_both_precisions("cuda_fp8wg_products_match_cpu", fp8wg_products_match_cpu);
}

fn fp8wg_products_match_cpu(g: &CudaBackend, activations: Activations) {
    let c = CpuBackend::new();
    let mut rng = rng("fp8wg products");
    // (groups, outputs a group, inputs a group, row counts, split along K at decode rows:
    // fewer blocks than SMs)
    type Shape<'a> = (usize, usize, usize, &'a [usize], bool);
    let shapes: [Shape; 7] = [
        (1, 1024, 4096, &[16, 64, 300, 1000], true),
        (1, 32768, 1024, &[9, 32, 128], false),
        (8, 1024, 4096, &[17, 64, 300], true),
        (1, 128, 256, &[1000], false),
        (1, 512, 4096, &[9], true),
        (1, 4096, 8192, &[33, 64], true),
        (1, 4096, 2048, &[32], true),
    ];
    // (Unless SLUICE_CUDA_FP8WG_DECODE=0 or SLUICE_CUDA_FP8WG_SPLIT_BLOCKS=0 keep decode
    // batches on the gemv loops.)
    let env_on = |name: &str| std::env::var(name).map_or(true, |v| v != "0");
    let decode_here = env_on("SLUICE_CUDA_FP8WG_DECODE");
    let split_here = env_on("SLUICE_CUDA_FP8WG_SPLIT_BLOCKS");
    let split_rows: usize =
        std::env::var("SLUICE_CUDA_FP8WG_SPLIT_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1024);
    for (groups, g_out, k, row_counts, split) in shapes {
        let w = weight(&mut rng, groups * g_out, k, 0.05, "fp8");
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for &rows in row_counts {
            let what = format!("fp8wg {groups}x{g_out}x{k} rows={rows} x={activations}");
            assert!(g.fp8wg_takes(rows, groups, &gw), "{what}: not taken");
            let decode_rows = rows <= 64 && (split_here || !split);
            if decode_rows && decode_here && g.sms() >= 128 {
                assert!(g.fp8wg_takes_decode_rows(rows, groups, &gw), "{what}: a decode batch left on the gemv loops");
            }
            // (The split shapes are split on GPUs of 128 SMs or more, as the H200's 132;
            // past SLUICE_CUDA_FP8WG_SPLIT_ROWS (default 1,024) never; below it `wq_a`'s 24
            // blocks at 300 rows must split.)
            let splits = g.fp8wg_decode_splits(rows, groups, &gw);
            if g.sms() >= 128 {
                if rows <= split_rows.min(64) {
                    assert_eq!(splits > 1, split && split_here, "{what}: {splits} slices along K");
                } else if rows > split_rows {
                    assert_eq!(splits, 1, "{what}: split along K past SLUICE_CUDA_FP8WG_SPLIT_ROWS");
                } else if rows == 300 && groups == 1 && g_out == 1024 && split_here {
                    assert!(splits > 1, "{what}: not split along K at {split_rows} rows allowed");
                }
            }
            let x = rand_vec(&mut rng, rows * groups * k, 1.0);
            let mut want = vec![0f32; rows * groups * g_out];
            let mut out = poisoned(g, rows * groups * g_out);
            let xr = rows_as_multiplied(&x, rows > 64 || g.fp8wg_takes_decode_rows(rows, groups, &gw), activations);
            if groups == 1 {
                c.matmul(&xr, rows, &cw, &mut want);
                g.matmul(&g.upload(&x), rows, &gw, &mut out);
            } else {
                c.grouped_matmul(&xr, rows, groups, &cw, &mut want);
                g.grouped_matmul(&g.upload(&x), rows, groups, &gw, &mut out);
            }
            let e = rel_err(&g.download(&out), &want);
            eprintln!("PARITY {what} splits={splits} {e:.2e}");
            assert!(e <= FP8WG_TOL, "{what}: max|Δ|/max|CPU| {e:.3e} above {FP8WG_TOL:.0e}");
        }
    }
}

/// The shared expert's SwiGLU pair (V4-Flash: 2,048 × 4,096 FP8) at decode batches of
/// 9-64 rows and a 300-row prefill through the engine's pair, which runs it as two
/// products on `fp8wg_gemm` (split along K, one set of the rows' parts) and the SwiGLU (checked to be dispatched
/// so unless `SLUICE_CUDA_FP8WG_SWIGLU=0`); clamps 10 and 0.5; outputs start poisoned.
#[test]
fn cuda_fp8wg_swiglu_pairs_match_cpu() {
    in_both_precisions("cuda_fp8wg_swiglu_pairs_match_cpu", fp8wg_swiglu_pairs_match_cpu);
}

fn fp8wg_swiglu_pairs_match_cpu(g: &CudaBackend, activations: Activations) {
    let c = CpuBackend::new();
    let mut rng = rng("fp8wg swiglu pairs");
    let (n, k) = (2048, 4096);
    let (w1, w3) = (weight(&mut rng, n, k, 0.05, "fp8"), weight(&mut rng, n, k, 0.05, "fp8"));
    let (g1, g3) = (g.weight(w1.view()), g.weight(w3.view()));
    let (c1, c3) = (c.weight(w1.view()), c.weight(w3.view()));
    let on = |knob: &str| std::env::var(knob).map_or(true, |v| v != "0");
    for rows in [9, 32, 64, 300] {
        // (A prefill's pair shares its parts too, whatever SLUICE_CUDA_FP8WG_DECODE says.)
        let here = on("SLUICE_CUDA_FP8WG_SWIGLU") && (rows > 64 || on("SLUICE_CUDA_FP8WG_DECODE"));
        let x = rand_vec(&mut rng, rows * k, 1.0);
        let gx = g.upload(&x);
        let (mut gate, mut up) = (vec![0f32; rows * n], vec![0f32; rows * n]);
        let xr = rows_as_multiplied(&x, here, activations);
        c.matmul(&xr, rows, &c1, &mut gate);
        c.matmul(&xr, rows, &c3, &mut up);
        for limit in [10.0f32, 0.5] {
            let mut out = poisoned(g, rows * n);
            let on_wgmma = g.swiglu_rows(&gx, rows, &g1, &g3, limit, &mut out);
            assert_eq!(on_wgmma, here, "the pair at {rows} rows on fp8wg_gemm: {on_wgmma}");
            let want = swiglu_reference(&gate, &up, limit);
            let e = rel_err(&g.download(&out), &want);
            eprintln!("PARITY fp8wg pair {n}x{k} rows={rows} limit={limit} x={activations} {e:.2e}");
            assert!(
                e <= FP8WG_TOL,
                "fp8wg pair rows={rows} limit={limit} x={activations}: {e:.3e} above {FP8WG_TOL:.0e}"
            );
        }
    }
}
