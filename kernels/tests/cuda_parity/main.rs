//! Every CUDA kernel against its CPU counterpart at DeepSeek-V4-Flash sizes (hidden
//! 4096, 64 heads × 512, q_lora 1024, indexer 64 × 128, top-k 512, window 128, 4 mHC
//! streams), on fresh random inputs, with outputs poisoned (NaN) before each call so an
//! element the GPU forgets to write fails. The CPU backend is itself checked against
//! the f64 reference by `parity.rs`; this suite covers the shapes and code paths only
//! large problems reach (vector loads, split-K products, tensor-core GEMMs, key-axis
//! splits, radix select over hundreds of candidates, FP8 and FP4 weights kept in their
//! stored formats).
//!
//! Each check prints `PARITY <op> <dtype> <observed error>`; tolerances are per dtype in
//! [`TOLERANCES`]. The backend's bf16 products take split activations (f32 distance);
//! tests of the reference model's one rounding (`Activations::Bf16`, the serving
//! default) run both precisions. Without a GPU every test prints that it is skipped and passes.
#![cfg(feature = "cuda")]

use kernels::backend::{
    AttentionIo, CompressorParams, ExpertWeights, HcHeadWeights, HcWeights, HeadNormJob, HeadNormShared, MoeWeights,
    OutputProjection, QueryPrep, Routing, Selection,
};
use kernels::cuda::CudaBackend;
use kernels::quant::{bf16_to_f32, f32_to_bf16};
use kernels::rope::Yarn;
use kernels::stored::{OwnedFormat, OwnedWeight, WeightView};
use kernels::{
    Activations, AttnKind, Backend, BatchPlan, Branch, CpuBackend, EntryDtype, EntryFormat, HostMatrix, KvLayout,
    KvState, LayerSpec, RopeTable, kv_entry,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// BF16 products of many rows on cuBLAS, both activation precisions.
mod cublas;
#[path = "../common/cuda_gpu.rs"]
mod cuda_gpu;
/// The second-version decode kernels (`SLUICE_CUDA_DECODE_KERNELS=v2`).
mod decode;
/// The FP8 warpgroup gemv (sm_90).
mod f8wg;
/// BF16 products of 9-32 decode rows in one tensor-core launch.
mod gemm_rows;
/// A step's first mHC boundary from the embedding's rows alone.
mod hc_copies;
/// Products of one input in one launch or one split.
mod many;
/// Routed FP4 experts of prefill-sized batches on `wgmma` (sm_90).
mod moe_fp4wg;
/// Routed FP4 experts of decode batches on `wgmma` (sm_90).
mod moe_wgmma;
/// The greedy read-out picked on the device.
mod readout;
/// Attention, compressors, indexer and rings over scheduled batches.
mod sequence;
/// The indexer's top-k over long rows.
mod topk;
use cuda_gpu::{Held, gpu, gpu_in};

/// Allowed max|Δ|/max|CPU| by the dtype of the weights or KV entries involved. f32
/// differs only in summation order; bf16, FP8 and FP4 weights mean the same values on
/// both devices (the GPU dequantises them inside its kernels, the CPU at load), so they
/// land far below the 1e-2 the issue allows, which is what is asserted for them.
const TOLERANCES: [(&str, f32); 4] = [("f32", 1e-4), ("bf16", 1e-2), ("fp8", 1e-2), ("fp4", 1e-2)];

fn tol(dtype: &str) -> f32 {
    TOLERANCES.iter().find(|(d, _)| *d == dtype).map(|t| t.1).expect("dtype in the table")
}

/// The GPU for a test of the warpgroup (`wgmma`) kernels, or None (the reason printed)
/// when there is none, it is not an sm_90 GPU (those kernels run there only), or one of
/// `knobs` is `0` (it turns the kernels the test checks off).
fn wgmma_gpu(test: &str, knobs: &[&str]) -> Option<Held> {
    wgmma_gpu_in(test, knobs, Activations::Split)
}

/// [`wgmma_gpu`] whose bf16 products take `activations`.
fn wgmma_gpu_in(test: &str, knobs: &[&str], activations: Activations) -> Option<Held> {
    let g = gpu_in(test, activations)?;
    if g.compute_capability().0 != 9 {
        eprintln!("{test}: skipped, not an sm_90 GPU (the wgmma kernels run on sm_90 only)");
        return None;
    }
    if let Some(k) = knobs.iter().find(|k| std::env::var(k).is_ok_and(|v| v == "0")) {
        eprintln!("{test}: skipped, {k}=0 turns the kernels off");
        return None;
    }
    Some(g)
}

fn rng(test: &str) -> ChaCha8Rng {
    // Fresh inputs on every run, reproducible from the printed seed: a failing run's
    // output shows it, and `SLUICE_PARITY_SEED=<seed>` draws the same inputs again (for
    // every generator of the run, so run the one failing test with it).
    let seed = std::env::var("SLUICE_PARITY_SEED").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("{test}: seed {seed} (SLUICE_PARITY_SEED={seed} repeats it)");
    ChaCha8Rng::seed_from_u64(seed)
}

fn rand_vec(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * std * 1.732).collect()
}

/// Random weight values stored as `dtype` stores them: f32 as drawn, bf16/fp8/fp4 in
/// those formats (FP8 with 128×128 ue8m0 block scales, FP4 packed with per-32 scales),
/// which the GPU keeps and the CPU dequantises.
#[derive(Clone)]
struct TestWeight {
    host: HostMatrix,
    stored: Option<OwnedWeight>,
}

impl TestWeight {
    fn view(&self) -> WeightView<'_> {
        self.stored.as_ref().map(OwnedWeight::view).unwrap_or_else(|| (&self.host).into())
    }
}

fn weight(rng: &mut ChaCha8Rng, rows: usize, cols: usize, std: f32, dtype: &str) -> TestWeight {
    let host = HostMatrix::new(rows, cols, rand_vec(rng, rows * cols, std));
    let format = match dtype {
        "f32" => return TestWeight { host, stored: None },
        "bf16" => OwnedFormat::Bf16,
        "fp8" => OwnedFormat::Fp8,
        "fp4" => OwnedFormat::Fp4,
        other => panic!("no dtype {other}"),
    };
    TestWeight { stored: Some(OwnedWeight::quantize(&host, format)), host }
}

/// An expert's three weights (gate, down, up) as `dtype` stores them, at the scales the
/// MoE tests use: (w1, w2, w3) of `inter` × `d`, `d` × `inter`, `inter` × `d`.
fn expert_weights(rng: &mut ChaCha8Rng, d: usize, inter: usize, dtype: &str) -> [TestWeight; 3] {
    [weight(rng, inter, d, 0.03, dtype), weight(rng, d, inter, 0.05, dtype), weight(rng, inter, d, 0.03, dtype)]
}

/// The reference SwiGLU of gate and up values: silu(min(g, limit)) · clamp(u, ±limit).
fn swiglu_reference(gate: &[f32], up: &[f32], limit: f32) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&a, &u)| {
            let a = a.min(limit);
            a / (1.0 + (-a).exp()) * u.clamp(-limit, limit)
        })
        .collect()
}

/// Token ids of a MoE test batch under `vocab`: row 0 is token 0 (whose hash-table row
/// names an expert twice, `decode::hash_table_with_repeats`), the rest random.
fn batch_tokens(rng: &mut ChaCha8Rng, rows: usize, vocab: usize) -> Vec<u32> {
    (0..rows).map(|i| if i == 0 { 0 } else { rng.random_range(0..vocab as u32) }).collect()
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).map(|(g, w)| if g.is_nan() { f32::INFINITY } else { (g - w).abs() }).fold(0f32, f32::max)
        / scale
}

fn check(op: &str, dtype: &str, got: &[f32], want: &[f32]) {
    let e = rel_err(got, want);
    eprintln!("PARITY {op} {dtype} {e:.2e}");
    assert!(e <= tol(dtype), "{op} ({dtype}): max|Δ|/max|ref| {e:.3e} above {:.0e}", tol(dtype));
}

/// Allowed max|Δ|/max|CPU| of the FP8 tensor-core variant of the FP4 GEMM, whose
/// activations are rounded to e4m3 (3 mantissa bits, up to 2^-4 relative per value):
/// a bound that catches a wrong fragment or scale (errors of order 1), not a parity claim.
const E4M3_ACTIVATIONS_TOL: f32 = 0.1;

fn poisoned<B: Backend>(b: &B, len: usize) -> B::Buf {
    b.upload(&vec![f32::NAN; len])
}

#[test]
fn cuda_products_match_cpu_at_flash_shapes() {
    let Some(g) = gpu("cuda_products_match_cpu_at_flash_shapes") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("products");
    // (outputs, inputs): wq_a, wq_b, the mHC mix (few outputs, long rows), an odd shape.
    // An expert's gate/up (2048 x 4096) and down (4096 x 2048) at FP4.
    for (n, k) in [(1024, 4096), (8192, 1024), (24, 16384), (200, 136), (2048, 4096), (4096, 2048)] {
        for dtype in ["f32", "bf16", "fp8", "fp4"] {
            let w = weight(&mut rng, n, k, 0.05, dtype);
            let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
            // Rows: one gemv launch (1-8), launches of 8 rows (12, 20; 33 and 64 where the
            // tiles would be few), tensor-core tiles of 64 rows with partial ones.
            for rows in [1, 3, 8, 12, 20, 33, 64, 130] {
                let x = rand_vec(&mut rng, rows * k, 1.0);
                let mut out = poisoned(g, rows * n);
                g.matmul(&g.upload(&x), rows, &gw, &mut out);
                let mut want = vec![0f32; rows * n];
                c.matmul(&x, rows, &cw, &mut want);
                check(&format!("matmul {n}x{k} rows={rows}"), dtype, &g.download(&out), &want);
            }
        }
    }
    // The attention output's grouped projection: 8 groups of 4096 -> 1024.
    for dtype in ["bf16", "fp8"] {
        let w = weight(&mut rng, 8 * 1024, 4096, 0.02, dtype);
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for rows in [1, 5, 24, 40, 100] {
            let x = rand_vec(&mut rng, rows * 8 * 4096, 1.0);
            let mut out = poisoned(g, rows * 8 * 1024);
            g.grouped_matmul(&g.upload(&x), rows, 8, &gw, &mut out);
            let mut want = vec![0f32; rows * 8 * 1024];
            c.grouped_matmul(&x, rows, 8, &cw, &mut want);
            check(&format!("grouped_matmul 8x1024x4096 rows={rows}"), dtype, &g.download(&out), &want);
        }
    }
}

#[test]
fn cuda_row_ops_match_cpu_at_flash_shapes() {
    let Some(g) = gpu("cuda_row_ops_match_cpu_at_flash_shapes") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("row ops");
    for (rows, dim, weighted) in [(7, 4096, true), (3 * 64, 512, false), (5, 1024, true), (2, 16384, false)] {
        let x = rand_vec(&mut rng, rows * dim, 2.0);
        let w = rand_vec(&mut rng, dim, 1.0);
        let mut gx = g.upload(&x);
        g.rms_norm(&mut gx, dim, weighted.then(|| g.upload(&w)).as_ref(), 1e-6);
        let mut want = x.clone();
        c.rms_norm(&mut want, dim, weighted.then_some(&w), 1e-6);
        check(&format!("rms_norm {rows}x{dim} weighted={weighted}"), "f32", &g.download(&gx), &want);
    }
    let yarn = Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 };
    for table in [RopeTable::plain(10000.0, 64), RopeTable::yarn(160000.0, 64, yarn, 1.0)] {
        for inverse in [false, true] {
            let rows = 9;
            let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..1_048_576)).collect();
            let x = rand_vec(&mut rng, rows * 64 * 512, 1.0);
            let mut gx = g.upload(&x);
            g.rope(&mut gx, 64, 512, &positions, &table, inverse);
            let mut want = x.clone();
            c.rope(&mut want, 64, 512, &positions, &table, inverse);
            check(&format!("rope 64x512 inverse={inverse}"), "f32", &g.download(&gx), &want);
        }
    }
    // Storage rounding: bf16 values, fp8 entries of V4's main (512 dims, 64 in BF16) and
    // indexer (128) formats and a tiny model's (32, 16: one partial scale block), over
    // values spanning many magnitudes so block scales differ from row to row.
    for (dtype, dim, tail) in
        [(EntryDtype::Bf16, 512, 64), (EntryDtype::Fp8, 512, 64), (EntryDtype::Fp8, 128, 0), (EntryDtype::Fp8, 32, 16)]
    {
        let fmt = EntryFormat { dtype, dim, tail };
        let x: Vec<f32> = rand_vec(&mut rng, 11 * dim, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 10f32.powi((i / 64 % 7) as i32 - 3))
            .collect();
        let mut gx = g.upload(&x);
        g.round_to(&mut gx, &fmt);
        let mut want = x.clone();
        c.round_to(&mut want, &fmt);
        assert_eq!(g.download(&gx), want, "{fmt:?} rounding must be bit-identical");
    }
    // Norm + RoPE (+ rounding) of the q heads (64 × 512, no weight) and of the new KV
    // entry (1 × 512, weighted), as the fused kernel runs them: unrounded within f32
    // tolerance of the CPU's three ops, and its rounding bit-identical to the CPU's
    // round_to of its own unrounded output.
    let table = RopeTable::yarn(160000.0, 64, yarn, 1.0);
    for (heads, weighted) in [(64, false), (1, true)] {
        for rows in [1, 5, 40] {
            let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..1_048_576)).collect();
            let x: Vec<f32> = rand_vec(&mut rng, rows * heads * 512, 1.0)
                .iter()
                .enumerate()
                .map(|(i, v)| v * 10f32.powi((i / 64 % 7) as i32 - 3))
                .collect();
            let w = rand_vec(&mut rng, 512, 1.0);
            let gw = weighted.then(|| g.upload(&w));
            let mut gx = g.upload(&x);
            g.head_norm_rope(&mut gx, heads, 512, gw.as_ref(), 1e-6, &positions, &table, None);
            let unrounded = g.download(&gx);
            let mut want = x.clone();
            c.head_norm_rope(&mut want, heads, 512, weighted.then_some(&w), 1e-6, &positions, &table, None);
            check(&format!("head_norm_rope {rows}x{heads}x512 weighted={weighted}"), "f32", &unrounded, &want);
            for dtype in [EntryDtype::Bf16, EntryDtype::Fp8] {
                let fmt = EntryFormat { dtype, dim: 512, tail: 64 };
                let mut gx = g.upload(&x);
                g.head_norm_rope(&mut gx, heads, 512, gw.as_ref(), 1e-6, &positions, &table, Some(&fmt));
                let mut want = unrounded.clone();
                c.round_to(&mut want, &fmt);
                assert_eq!(g.download(&gx), want, "head_norm_rope's {dtype:?} rounding must be round_to's");
            }
        }
    }
    // Both at once (head_norm_rope2: the q heads, then the weighted, rounded entry, one
    // launch): the same bits as the two calls.
    for rows in [1, 5, 40] {
        let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..1_048_576)).collect();
        let (q, kv, w) = (
            rand_vec(&mut rng, rows * 64 * 512, 1.0),
            rand_vec(&mut rng, rows * 512, 1.0),
            g.upload(&rand_vec(&mut rng, 512, 1.0)),
        );
        for dtype in [EntryDtype::Bf16, EntryDtype::Fp8] {
            let fmt = EntryFormat { dtype, dim: 512, tail: 64 };
            let shared = HeadNormShared { head_dim: 512, eps: 1e-6, positions: &positions, rope: &table };
            let (mut gq, mut gkv) = (g.upload(&q), g.upload(&kv));
            g.head_norm_rope2(
                &mut HeadNormJob { x: &mut gq, heads: 64, weight: None, round: None },
                &mut HeadNormJob { x: &mut gkv, heads: 1, weight: Some(&w), round: Some(&fmt) },
                &shared,
            );
            let (mut aq, mut akv) = (g.upload(&q), g.upload(&kv));
            g.head_norm_rope(&mut aq, 64, 512, None, 1e-6, &positions, &table, None);
            g.head_norm_rope(&mut akv, 1, 512, Some(&w), 1e-6, &positions, &table, Some(&fmt));
            assert_eq!(g.download(&gq), g.download(&aq), "head_norm_rope2's q heads ({rows} rows, {dtype:?})");
            assert_eq!(g.download(&gkv), g.download(&akv), "head_norm_rope2's entry ({rows} rows, {dtype:?})");
        }
    }

    let x = rand_vec(&mut rng, 11 * 512, 1.0);
    let gathered = g.gather_rows(&g.upload(&x), 512, &[3, 0, 10, 3]);
    assert_eq!(g.download(&gathered), c.gather_rows(&x, 512, &[3, 0, 10, 3]));
    for dtype in ["f32", "bf16", "fp8", "fp4"] {
        let table = weight(&mut rng, 300, 4096, 0.5, dtype);
        let tokens = [5u32, 299, 0, 17];
        let plan = kernels::BatchPlan::new(vec![(0, vec![0], 0, &tokens[..])]);
        let mut out = poisoned(g, 4 * 4096);
        g.embed(&g.weight(table.view()), &plan, &mut out);
        let mut want = vec![0f32; 4 * 4096];
        c.embed(&c.weight(table.view()), &plan, &mut want);
        assert_eq!(g.download(&out), want, "embedding rows ({dtype}) must be exact");
    }
}

#[test]
fn cuda_hyper_connections_match_cpu_at_flash_shapes() {
    let Some(g) = gpu("cuda_hyper_connections_match_cpu_at_flash_shapes") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("mhc");
    let d = 4096;
    let mut one_pass = 0;
    // Decode (gemv at one row, mix_rows up to 64; hc_post_mix a row a block up to 8 rows,
    // groups of rows past 8) and prefill-sized (cuBLAS past 64 rows;
    // from as many rows as SMs, V4's shape, `hc_pre_finish_rows`, and `hc_post_pre` in one
    // pass, `hc_post_mix_rows`, which 300 and 600 rows take: asserted below) mixing products; the mixing weight as stored in the checkpoints (f32) and in bf16;
    // V4's 4 streams, and 6 (36 logits: the Sinkhorn rounds of a block, not a warp).
    for (hc, mix_dtype, rows) in [
        (4, "f32", 1),
        (4, "f32", 8),
        (4, "f32", 29),
        (4, "f32", 40),
        (4, "f32", 300),
        (4, "bf16", 1),
        (4, "bf16", 5),
        (4, "bf16", 64),
        (4, "bf16", 100),
        (4, "bf16", 600),
        (6, "f32", 3),
    ] {
        let mix = weight(&mut rng, (2 + hc) * hc, hc * d, 0.02, mix_dtype);
        let base = rand_vec(&mut rng, (2 + hc) * hc, 0.5);
        // The same mHC weights on either backend.
        fn on<B: Backend>(b: &B, mix: &TestWeight, base: &[f32], hc: usize, d: usize) -> HcWeights<B> {
            HcWeights {
                mix: b.weight(mix.view()),
                base: base.to_vec(),
                scale: [0.8, 1.1, 0.9],
                hc,
                hidden: d,
                sinkhorn_iters: 20,
                norm_eps: 1e-6,
                hc_eps: 1e-6,
            }
        }
        let (gw, cw) = (on(g, &mix, &base, hc, d), on(&c, &mix, &base, hc, d));
        let s = rand_vec(&mut rng, rows * hc * d, 1.0);
        let out = rand_vec(&mut rng, rows * d, 1.0);
        let (mut col, mut post, mut comb) =
            (poisoned(g, rows * d), poisoned(g, rows * hc), poisoned(g, rows * hc * hc));
        g.hc_pre(&g.upload(&s), rows, &gw, None, &mut col, &mut post, &mut comb);
        let (mut ccol, mut cpost, mut ccomb) =
            (vec![0f32; rows * d], vec![0f32; rows * hc], vec![0f32; rows * hc * hc]);
        c.hc_pre(&s, rows, &cw, None, &mut ccol, &mut cpost, &mut ccomb);
        check(&format!("hc_pre collapsed rows={rows} mix {mix_dtype}"), "f32", &g.download(&col), &ccol);
        // With the sub-block's input norm (fused into the pre-mix kernel).
        let norm_w = rand_vec(&mut rng, d, 1.0);
        let mut normed = poisoned(g, rows * d);
        let (mut p2, mut m2) = (poisoned(g, rows * hc), poisoned(g, rows * hc * hc));
        g.hc_pre(&g.upload(&s), rows, &gw, Some((&g.upload(&norm_w), 1e-6)), &mut normed, &mut p2, &mut m2);
        let mut cnormed = vec![0f32; rows * d];
        let (mut cp2, mut cm2) = (vec![0f32; rows * hc], vec![0f32; rows * hc * hc]);
        c.hc_pre(&s, rows, &cw, Some((&norm_w, 1e-6)), &mut cnormed, &mut cp2, &mut cm2);
        check(&format!("hc_pre normed rows={rows} mix {mix_dtype}"), "f32", &g.download(&normed), &cnormed);
        check(&format!("hc_pre post rows={rows}"), "f32", &g.download(&post), &cpost);
        check(&format!("hc_pre comb rows={rows}"), "f32", &g.download(&comb), &ccomb);
        let mut gs = g.upload(&s);
        g.hc_post(&mut gs, rows, hc, &g.upload(&out), &post, &comb);
        let mut cs = s.clone();
        c.hc_post(&mut cs, rows, hc, &out, &cpost, &ccomb);
        check(&format!("hc_post rows={rows}"), "f32", &g.download(&gs), &cs);
        // hc_post and the next sub-block's hc_pre at once (decode rows: the mixing product
        // taken as the streams are written, `hc_post_mix`); post and comb are read, then
        // overwritten.
        let (gnorm, mut fused_s) = (g.upload(&norm_w), g.upload(&s));
        let (mut fcol, mut fpost, mut fcomb) =
            (poisoned(g, rows * d), g.upload(&g.download(&post)), g.upload(&g.download(&comb)));
        g.hc_post_pre(
            &mut fused_s,
            rows,
            hc,
            &g.upload(&out),
            &gw,
            Some((&gnorm, 1e-6)),
            &mut fcol,
            &mut fpost,
            &mut fcomb,
        );
        let (mut ccol3, mut cpost3, mut ccomb3) = (vec![0f32; rows * d], cpost.clone(), ccomb.clone());
        let mut cs3 = s.clone();
        c.hc_post_pre(&mut cs3, rows, hc, &out, &cw, Some((&norm_w, 1e-6)), &mut ccol3, &mut cpost3, &mut ccomb3);
        assert_eq!(g.download(&fused_s), g.download(&gs), "hc_post_pre rows={rows}: streams differ from hc_post's");
        one_pass += usize::from(g.hc_post_pre_in_one_pass(rows, &gw));
        check(&format!("hc_post_pre streams rows={rows}"), "f32", &g.download(&fused_s), &cs3);
        check(&format!("hc_post_pre normed rows={rows} mix {mix_dtype}"), "f32", &g.download(&fcol), &ccol3);
        check(&format!("hc_post_pre post rows={rows}"), "f32", &g.download(&fpost), &cpost3);
        check(&format!("hc_post_pre comb rows={rows}"), "f32", &g.download(&fcomb), &ccomb3);

        let hmix = weight(&mut rng, hc, hc * d, 0.02, "f32");
        let hbase = rand_vec(&mut rng, hc, 0.5);
        let gh = HcHeadWeights::<CudaBackend> {
            mix: g.weight(hmix.view()),
            base: hbase.clone(),
            scale: 1.2,
            hc,
            hidden: d,
            norm_eps: 1e-6,
            hc_eps: 1e-6,
        };
        let ch = HcHeadWeights::<CpuBackend> {
            mix: c.weight(hmix.view()),
            base: hbase,
            scale: 1.2,
            hc,
            hidden: d,
            norm_eps: 1e-6,
            hc_eps: 1e-6,
        };
        let mut got = poisoned(g, rows * d);
        g.hc_head(&g.upload(&s), rows, &gh, &mut got);
        let mut want = vec![0f32; rows * d];
        c.hc_head(&s, rows, &ch, &mut want);
        check(&format!("hc_head rows={rows}"), "f32", &g.download(&got), &want);
    }
    // 300 and 600 rows (f32 and bf16 weights) are at least as many as an H200's SMs.
    let one_pass_on = std::env::var("SLUICE_CUDA_HC_POST_MIX_PREFILL").map_or(true, |v| v != "0");
    eprintln!("PARITY hc_post_pre: {one_pass} cases in one pass (hc_post_mix_rows)");
    assert!(!one_pass_on || one_pass >= 2, "hc_post_mix_rows ran in {one_pass} cases, expected 300 and 600 rows");
}

#[test]
fn cuda_moe_matches_cpu_at_flash_width() {
    let Some(g) = gpu("cuda_moe_matches_cpu_at_flash_width") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("moe");
    let (d, inter, n_exp, k) = (4096, 512, 16, 4);
    for dtype in ["bf16", "fp8", "fp4"] {
        let gate = weight(&mut rng, n_exp, d, 0.05, "f32");
        let experts: Vec<[TestWeight; 3]> = (0..n_exp).map(|_| expert_weights(&mut rng, d, inter, dtype)).collect();
        let shared = expert_weights(&mut rng, d, inter, dtype);
        let bias = rand_vec(&mut rng, n_exp, 0.2);
        let vocab = 64;
        let tid2eid: Vec<u32> = (0..vocab * k).map(|i| ((i * 7 + i / k) % n_exp) as u32).collect();
        for hash in [false, true] {
            let routing =
                || if hash { Routing::Hash { tid2eid: tid2eid.clone() } } else { Routing::TopK { bias: bias.clone() } };
            let gm = moe_weights(g, &gate, routing(), &experts, &shared, k);
            let cm = moe_weights(&c, &gate, routing(), &experts, &shared, k);
            // 1 and 8 rows: routed on the device; 12 and 37: experts in launches of 8 rows
            // (FP4: by segments); 300: grouped tiles (300 rows give experts more than one
            // 64-row tile).
            for rows in [1, 8, 12, 37, 300] {
                let x = rand_vec(&mut rng, rows * d, 1.0);
                let tokens: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
                let mut out = poisoned(g, rows * d);
                g.moe(&g.upload(&x), rows, &tokens, &gm, 0..rows, &mut out);
                let mut want = vec![0f32; rows * d];
                c.moe(&x, rows, &tokens, &cm, 0..rows, &mut want);
                check(&format!("moe hash={hash} rows={rows}"), dtype, &g.download(&out), &want);
            }
        }
    }
}

/// The same MoE layer's weights on backend `b` (top-`k` routing scale 1.5, SwiGLU limit
/// 2), so both devices run one definition.
fn moe_weights<B: Backend>(
    b: &B,
    gate: &TestWeight,
    routing: Routing,
    experts: &[[TestWeight; 3]],
    shared: &[TestWeight; 3],
    k: usize,
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
        swiglu_limit: 2.0,
    }
}

/// Random compressor parameters of each layer (kv position bias, kv norm weight, indexer
/// position bias, indexer norm weight), biases of magnitude `scale`, norm weights near 1.
fn compressor_params(rng: &mut ChaCha8Rng, specs: &[LayerSpec], scale: f32) -> Vec<[Vec<f32>; 4]> {
    specs
        .iter()
        .map(|s| {
            let cw = if s.kind == AttnKind::Csa { 2 * HD } else { HD };
            let ratio = s.ratio.max(1);
            [
                rand_vec(rng, ratio * cw, scale),
                rand_vec(rng, HD, 0.2).iter().map(|v| v + 1.0).collect(),
                rand_vec(rng, ratio * 2 * IDX_DIM, scale),
                rand_vec(rng, IDX_DIM, 0.2).iter().map(|v| v + 1.0).collect(),
            ]
        })
        .collect()
}

// V4-Flash attention sizes, and one backend's KV state and layer parameters: shared by
// the sequence and top-k tests.
const HEADS: usize = 64;
const HD: usize = 512;
const IDX_HEADS: usize = 64;
const IDX_DIM: usize = 128;
const TOP_K: usize = 512;

struct Side<'a, B: Backend> {
    b: &'a B,
    kv: KvState<B>,
    params: Vec<[B::Buf; 4]>,
    sinks: B::Buf,
}

fn side<'a, B: Backend>(
    b: &'a B,
    layout: &KvLayout,
    pages: usize,
    slots: usize,
    raw: &[[Vec<f32>; 4]],
    sinks: &[f32],
) -> Side<'a, B> {
    let mut kv = KvState::<B> {
        pages: b.kv_alloc(pages * layout.page_elems, layout.dtype),
        rings: b.kv_alloc(slots * layout.ring_elems, layout.dtype),
        comp: b.kv_alloc(slots * layout.comp_elems, EntryDtype::F32),
    };
    // Poison the pages: entries nobody writes stay NaN on both sides.
    let nan: Vec<u8> = match layout.dtype {
        EntryDtype::F32 => f32::NAN.to_le_bytes().repeat(pages * layout.page_elems),
        EntryDtype::Bf16 => 0x7fc0u16.to_le_bytes().repeat(pages * layout.page_elems),
        // 0xff is NaN as an e4m3 code, a BF16 tail value and a ue8m0 scale alike.
        EntryDtype::Fp8 => vec![0xff; pages * layout.page_elems],
    };
    b.kv_write(&mut kv.pages, 0, &nan);
    let params = raw.iter().map(|p| [b.upload(&p[0]), b.upload(&p[1]), b.upload(&p[2]), b.upload(&p[3])]).collect();
    let sinks = b.upload(sinks);
    Side { b, kv, params, sinks }
}

/// The two tensor-core paths for FP4 expert products against the CPU at an expert's
/// shapes: the BF16 one the engine uses (weights dequantised to bf16 tiles, split
/// activations) and the FP8 variant (e4m3 weights and activations), whose error shows
/// what rounding the activations to e4m3 costs (docs/perf.md, beside their speeds).
#[test]
fn fp4_gemm_bf16_and_fp8_tensor_core_paths_against_cpu() {
    let Some(g) = gpu("fp4_gemm_bf16_and_fp8_tensor_core_paths_against_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("fp4 gemm paths");
    for (n, k) in [(2048, 4096), (4096, 2048), (200, 96)] {
        let w = weight(&mut rng, n, k, 0.05, "fp4");
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for rows in [130, 192] {
            let x = rand_vec(&mut rng, rows * k, 1.0);
            let mut want = vec![0f32; rows * n];
            c.matmul(&x, rows, &cw, &mut want);
            let (bf16, fp8) = g.fp4_gemm_both(&x, rows, &gw);
            let (eb, e8) = (rel_err(&bf16, &want), rel_err(&fp8, &want));
            eprintln!("PARITY fp4 gemm {n}x{k} rows={rows}: bf16 tensor cores {eb:.2e}, fp8 tensor cores {e8:.2e}");
            assert!(eb <= tol("fp4"), "bf16 tensor-core FP4 GEMM {n}x{k}: {eb:.3e}");
            assert!(e8 <= E4M3_ACTIVATIONS_TOL, "fp8 tensor-core FP4 GEMM {n}x{k}: {e8:.3e}");
        }
    }
}

/// Reads of 4 MB and more go through pinned pieces of 8 MB (a decode step's logits): an
/// upload of 20 MB plus a ragged tail comes back bit for bit, as does a small one.
#[test]
fn cuda_large_downloads_round_trip() {
    let Some(g) = gpu("cuda_large_downloads_round_trip") else { return };
    let g = &*g;
    let mut rng = rng("downloads");
    for n in [5_000_003usize, 2 << 20, 1000] {
        let x = rand_vec(&mut rng, n, 1.0);
        let back = g.download(&g.upload(&x));
        assert!(back.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()), "{n} floats did not come back as sent");
    }
}
