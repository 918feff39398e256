//! The routed FP4 experts of prefill-sized batches on Hopper's warpgroup instruction
//! (cu/moe_fp4wg.cu: the rows as three e4m3 parts, e2m1 codes turned into e4m3 in
//! registers, one FP4 scale group per `wgmma`, tiles of one expert's rows) against the
//! CPU, through the engine's MoE block (routing read back, grouped products).

use super::decode::{experts_layer, hash_table_with_repeats};
use super::moe_wgmma::blocky_fp4;
use super::*;

/// Allowed max|Δ|/max|CPU| of a MoE block on these kernels: the activations (the rows,
/// then h) are three e4m3 parts each (~2^-12 of a row's largest value) and each wgmma's
/// 32 products are summed by the tensor core in fewer bits than f32, as in the decode
/// kernels (`WGMOE_TOL`); a wrong fragment, swizzle, scale byte, tile or part plane gives
/// errors of order 1.
const FP4WG_TOL: f32 = 5e-4;

/// MoE layers of (hidden, expert width, experts, top-k) under top-k and hash routing (an
/// expert named twice for one token), at batches past the decode paths (257 rows and
/// more) whose experts get several 128-row tiles, the last one partial, and one expert
/// whose rows end the last part's plane: V4-Flash's widths and a narrow layer of many
/// experts (tiles of a few rows). Each case first checks that the engine takes these
/// kernels.
#[test]
fn cuda_moe_fp4wg_experts_match_cpu() {
    let Some(g) = gpu("cuda_moe_fp4wg_experts_match_cpu") else { return };
    if g.compute_capability().0 != 9 {
        eprintln!("cuda_moe_fp4wg_experts_match_cpu: skipped, not an sm_90 GPU (the wgmma kernels run on sm_90 only)");
        return;
    }
    if std::env::var("SLUICE_CUDA_FP4WG").is_ok_and(|v| v == "0") {
        eprintln!("cuda_moe_fp4wg_experts_match_cpu: skipped, SLUICE_CUDA_FP4WG=0 turns the kernels off");
        return;
    }
    let c = CpuBackend::new();
    let mut rng = rng("moe fp4wg");
    // ((hidden, expert width, experts, top-k), batch sizes)
    type Layer<'a> = ((usize, usize, usize, usize), &'a [usize]);
    let layers: [Layer; 2] = [((4096, 2048, 8, 6), &[300]), ((1024, 512, 64, 6), &[257, 1000])];
    for ((d, inter, n_exp, k), batches) in layers {
        let gate = weight(&mut rng, n_exp, d, 0.05, "f32");
        let experts: Vec<[TestWeight; 3]> = (0..n_exp)
            .map(|_| {
                let (a, b, c) = (
                    blocky_fp4(&mut rng, inter, d, 0.03),
                    blocky_fp4(&mut rng, d, inter, 0.05),
                    blocky_fp4(&mut rng, inter, d, 0.03),
                );
                [a, b, c]
            })
            .collect();
        let shared = expert_weights(&mut rng, d, inter, "fp8");
        let bias = rand_vec(&mut rng, n_exp, 0.2);
        let (vocab, tid2eid) = hash_table_with_repeats(k, n_exp);
        for (limit, hash) in [(10.0f32, false), (2.0, true)] {
            let routing =
                || if hash { Routing::Hash { tid2eid: tid2eid.clone() } } else { Routing::TopK { bias: bias.clone() } };
            let gm = experts_layer(g, &gate, routing(), &experts, &shared, k, limit);
            let cm = experts_layer(&c, &gate, routing(), &experts, &shared, k, limit);
            assert!(g.grouped_fp4wg(&gm), "fp4wg {n_exp}x{inter}x{d}: not taken");
            for &rows in batches {
                let what = format!("fp4wg {n_exp}x{inter}x{d} limit={limit} hash={hash} rows={rows}");
                let x = rand_vec(&mut rng, rows * d, 1.0);
                let tokens = batch_tokens(&mut rng, rows, vocab);
                let mut want = vec![0f32; rows * d];
                c.moe(&x, rows, &tokens, &cm, 0..rows, &mut want);
                let mut out = poisoned(g, rows * d);
                g.moe(&g.upload(&x), rows, &tokens, &gm, 0..rows, &mut out);
                let e = rel_err(&g.download(&out), &want);
                eprintln!("PARITY {what} {e:.2e}");
                assert!(e <= FP4WG_TOL, "{what}: max|Δ|/max|CPU| {e:.3e} above {FP4WG_TOL:.0e}");
            }
        }
    }
}
