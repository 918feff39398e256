//! The routed FP4 experts of decode batches on Hopper's warpgroup instruction
//! (cu/moe_wgmma.cu: e2m1 codes turned into e4m3 in registers, one FP4 scale group per
//! `wgmma`, K split by thread-block clusters) against the CPU, through the engine's MoE
//! block (the v2 path takes these kernels on sm_90 for 1-64 rows; `cuda_parity decode`'s
//! experts test runs them at 9-64 rows).

use super::decode::{experts_layer, hash_table_with_repeats};
use super::*;

/// Allowed max|Δ|/max|CPU| of a MoE block on these kernels: the activations (the rows,
/// then h) are three e4m3 parts each (~2^-12 of a value) and each wgmma's 32 products
/// are summed by the tensor core in fewer bits than f32 (gemv_f8wg's bound, a little
/// wider for the two products in a row); a wrong fragment, swizzle, scale byte or K part
/// gives errors of order 1.
const WGMOE_TOL: f32 = 5e-4;

/// An FP4 weight whose 32-input scale groups differ in magnitude by up to 2^4 (a pattern
/// over rows and groups), so every group gets its own ue8m0 scale and a scale byte read
/// for the wrong group or row is seen.
fn blocky_fp4(rng: &mut ChaCha8Rng, n: usize, k: usize, std: f32) -> TestWeight {
    let mut host = HostMatrix::new(n, k, rand_vec(rng, n * k, std));
    for r in 0..n {
        for c in 0..k {
            let e = ((r % 7) * 3 + c / 32) % 5;
            host.data[r * k + c] *= [0.25f32, 0.5, 1.0, 2.0, 4.0][e];
        }
    }
    TestWeight { stored: Some(OwnedWeight::quantize(&host, OwnedFormat::Fp4)), host }
}

/// A MoE layer of [`blocky_fp4`] experts (hidden `d`, expert width `inter`, `n_exp`
/// experts, top-`k`) with an FP8 shared expert, a top-k bias and a hash table that names
/// an expert twice for token 0: what the `wgmma` expert tests build both devices from.
pub(super) struct Fp4Moe {
    pub d: usize,
    pub vocab: usize,
    gate: TestWeight,
    experts: Vec<[TestWeight; 3]>,
    shared: [TestWeight; 3],
    bias: Vec<f32>,
    tid2eid: Vec<u32>,
    k: usize,
}

impl Fp4Moe {
    pub(super) fn new(rng: &mut ChaCha8Rng, (d, inter, n_exp, k): (usize, usize, usize, usize)) -> Self {
        let gate = weight(rng, n_exp, d, 0.05, "f32");
        let experts = (0..n_exp)
            .map(|_| {
                [blocky_fp4(rng, inter, d, 0.03), blocky_fp4(rng, d, inter, 0.05), blocky_fp4(rng, inter, d, 0.03)]
            })
            .collect();
        let shared = expert_weights(rng, d, inter, "fp8");
        let bias = rand_vec(rng, n_exp, 0.2);
        let (vocab, tid2eid) = hash_table_with_repeats(k, n_exp);
        Fp4Moe { d, vocab, gate, experts, shared, bias, tid2eid, k }
    }

    /// The layer on backend `b` at SwiGLU clamp `limit`, hash or top-k routing.
    pub(super) fn on<B: Backend>(&self, b: &B, limit: f32, hash: bool) -> MoeWeights<B> {
        let routing = if hash {
            Routing::Hash { tid2eid: self.tid2eid.clone() }
        } else {
            Routing::TopK { bias: self.bias.clone() }
        };
        experts_layer(b, &self.gate, routing, &self.experts, &self.shared, self.k, limit)
    }

    /// max|Δ|/max|CPU| of the layer on `rows` random rows (poisoned GPU output): the CPU's
    /// `moe` on `cm` against the GPU's through `run(x, tokens, out)`.
    pub(super) fn error(
        &self,
        rng: &mut ChaCha8Rng,
        g: &CudaBackend,
        cm: &MoeWeights<CpuBackend>,
        rows: usize,
        run: impl FnOnce(&[f32], &[u32], &mut <CudaBackend as Backend>::Buf),
    ) -> f32 {
        let x = rand_vec(rng, rows * self.d, 1.0);
        let tokens = batch_tokens(rng, rows, self.vocab);
        let mut want = vec![0f32; rows * self.d];
        CpuBackend::new().moe(&x, rows, &tokens, cm, 0..rows, &mut want);
        let mut out = poisoned(g, rows * self.d);
        run(&x, &tokens, &mut out);
        rel_err(&g.download(&out), &want)
    }
}

/// MoE layers of (hidden, expert width, experts, top-k) under top-k and hash routing (an
/// expert named twice for one token: a segment of two positions of one row), batches
/// whose experts get one, two or more rows (segments of two; from 32 rows segments of
/// four, the `_p_r4_` kernels, checked), at SwiGLU clamps 10 and 2: V4-Flash's widths
/// (gate/up split over clusters of 2, down unsplit, 1-40 rows) and a narrow layer whose
/// few units split K over clusters of 4 and 2. The printed plan names the kernels and
/// grids; each case first checks that the engine takes these kernels.
#[test]
fn cuda_moe_wgmma_experts_match_cpu() {
    let Some(g) = wgmma_gpu("cuda_moe_wgmma_experts_match_cpu", &["SLUICE_CUDA_MOE_WGMMA"]) else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("moe wgmma");
    // ((hidden, expert width, experts, top-k), batch sizes)
    type Layer<'a> = ((usize, usize, usize, usize), &'a [usize]);
    let layers: [Layer; 2] = [((4096, 2048, 12, 6), &[1, 2, 3, 8, 16, 40]), ((1024, 512, 64, 6), &[1, 5, 8, 16, 33])];
    // Segments of four from 32 rows unless a knob moves that (or runs the kernels without
    // the pipelined fragments, which have no such form).
    let r4_default =
        ["SLUICE_CUDA_MOE_WGMMA_R4_ROWS", "SLUICE_CUDA_MOE_WGMMA_PIPE"].iter().all(|knob| std::env::var(knob).is_err());
    for ((d, inter, n_exp, k), batches) in layers {
        let layer = Fp4Moe::new(&mut rng, (d, inter, n_exp, k));
        for limit in [10.0f32, 2.0] {
            for hash in [false, true] {
                let (gm, cm) = (layer.on(g, limit, hash), layer.on(&c, limit, hash));
                for &rows in batches {
                    let what = format!("wgmoe {n_exp}x{inter}x{d} limit={limit} hash={hash} rows={rows}");
                    let plan = g.decode_moe_wgmma(rows, &gm).unwrap_or_else(|| panic!("{what}: not taken"));
                    if r4_default {
                        assert_eq!(plan.contains("_r4_"), rows >= 32, "{what}: segments of four from 32 rows: {plan}");
                    }
                    let e = layer.error(&mut rng, g, &cm, rows, |x, tokens, out| {
                        g.decode_moe("v2", &g.upload(x), rows, tokens, &gm, 0..rows, out)
                    });
                    eprintln!("PARITY {what} [{plan}] {e:.2e}");
                    assert!(e <= WGMOE_TOL, "{what} [{plan}]: max|Δ|/max|CPU| {e:.3e} above {WGMOE_TOL:.0e}");
                }
            }
        }
    }
}
