//! The routed FP4 experts of prefill-sized batches on Hopper's warpgroup instruction
//! (cu/moe_fp4wg.cu: the rows as two bf16 parts, e2m1 codes turned into scaled bf16 A
//! fragments in registers, tiles of one expert's rows) against the CPU, through the
//! engine's MoE block (routing read back, grouped products); and FP8 products of
//! prefill-sized batches on the same kernel over FP8 codes (`fp8wg_gemm`).

use super::moe_wgmma::Fp4Moe;
use super::*;

/// Allowed max|Δ|/max|CPU| of a MoE block on these kernels: bf16 products of the exact
/// weights and the rows' two bf16 parts (~16 significant bits; then h's) summed in f32
/// (measured 5e-6–1.4e-5); a wrong fragment, swizzle, scale byte, tile or part plane
/// gives errors of order 1.
const FP4WG_TOL: f32 = 1e-4;

/// MoE layers of (hidden, expert width, experts, top-k) under top-k and hash routing (an
/// expert named twice for one token), at batches past the decode paths (257 rows and
/// more) whose experts get several 128-row tiles, the last one partial, and one expert
/// whose rows end the last part's plane: V4-Flash's widths and a narrow layer of many
/// experts (tiles of a few rows). Each case first checks that the engine takes these
/// kernels.
#[test]
fn cuda_moe_fp4wg_experts_match_cpu() {
    let Some(g) = wgmma_gpu("cuda_moe_fp4wg_experts_match_cpu", &["SLUICE_CUDA_FP4WG"]) else { return };
    let c = CpuBackend::new();
    let mut rng = rng("moe fp4wg");
    // ((hidden, expert width, experts, top-k), batch sizes)
    type Layer<'a> = ((usize, usize, usize, usize), &'a [usize]);
    let layers: [Layer; 2] = [((4096, 2048, 8, 6), &[300]), ((1024, 512, 64, 6), &[257, 1000])];
    for ((d, inter, n_exp, k), batches) in layers {
        let layer = Fp4Moe::new(&mut rng, (d, inter, n_exp, k));
        for (limit, hash) in [(10.0f32, false), (2.0, true)] {
            let (gm, cm) = (layer.on(g, limit, hash), layer.on(&c, limit, hash));
            assert!(g.grouped_fp4wg(&gm), "fp4wg {n_exp}x{inter}x{d}: not taken");
            for &rows in batches {
                let what = format!("fp4wg {n_exp}x{inter}x{d} limit={limit} hash={hash} rows={rows}");
                let e = layer.error(&mut rng, g, &cm, rows, |x, tokens, out| {
                    g.moe(&g.upload(x), rows, tokens, &gm, 0..rows, out)
                });
                eprintln!("PARITY {what} {e:.2e}");
                assert!(e <= FP4WG_TOL, "{what}: max|Δ|/max|CPU| {e:.3e} above {FP4WG_TOL:.0e}");
            }
        }
    }
}

/// Allowed max|Δ|/max|CPU| of an FP8 product on `fp8wg_gemm`: bf16 products of the exact
/// weights and the rows' two bf16 parts (~16 significant bits) summed in f32, as the
/// `gemm_fp8` tiles before it (`cuda_parity`'s f32-level bound for split activations).
const FP8WG_TOL: f32 = 1e-4;

/// FP8 products of prefill-sized batches on `fp8wg_gemm` against the CPU: V4-Flash's
/// `wq_a` (1,024 × 4,096), `wq_b` (32,768 × 1,024), the grouped `wo_a` (8 groups of
/// 1,024 outputs over 4,096 inputs each) and a narrow one (128 × 256), at row counts that
/// leave a partial last tile (300, 1,000) and one tile (128); outputs start poisoned.
#[test]
fn cuda_fp8wg_products_match_cpu() {
    let Some(g) = wgmma_gpu("cuda_fp8wg_products_match_cpu", &["SLUICE_CUDA_FP4WG"]) else { return };
    let c = CpuBackend::new();
    let mut rng = rng("fp8wg products");
    // (groups, outputs a group, inputs a group, row counts); 9-32 rows: decode batches,
    // which the engine's products of `wq_b` and the grouped `wo_a` send here too.
    let shapes: [(usize, usize, usize, &[usize]); 4] = [
        (1, 1024, 4096, &[300, 1000]),
        (1, 32768, 1024, &[9, 32, 128]),
        (8, 1024, 4096, &[17, 300]),
        (1, 128, 256, &[1000]),
    ];
    for (groups, g_out, k, row_counts) in shapes {
        let w = weight(&mut rng, groups * g_out, k, 0.05, "fp8");
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for &rows in row_counts {
            let what = format!("fp8wg {groups}x{g_out}x{k} rows={rows}");
            assert!(g.fp8wg_takes(rows, groups, &gw), "{what}: not taken");
            // (Unless SLUICE_CUDA_FP8WG_DECODE=0 keeps decode batches on the gemv loops.)
            let decode_here = std::env::var("SLUICE_CUDA_FP8WG_DECODE").map_or(true, |v| v != "0");
            if rows <= 32 && decode_here {
                assert!(g.fp8wg_takes_decode_rows(rows, groups, &gw), "{what}: a decode batch left on the gemv loops");
            }
            let x = rand_vec(&mut rng, rows * groups * k, 1.0);
            let mut want = vec![0f32; rows * groups * g_out];
            let mut out = poisoned(g, rows * groups * g_out);
            if groups == 1 {
                c.matmul(&x, rows, &cw, &mut want);
                g.matmul(&g.upload(&x), rows, &gw, &mut out);
            } else {
                c.grouped_matmul(&x, rows, groups, &cw, &mut want);
                g.grouped_matmul(&g.upload(&x), rows, groups, &gw, &mut out);
            }
            let e = rel_err(&g.download(&out), &want);
            eprintln!("PARITY {what} {e:.2e}");
            assert!(e <= FP8WG_TOL, "{what}: max|Δ|/max|CPU| {e:.3e} above {FP8WG_TOL:.0e}");
        }
    }
}
