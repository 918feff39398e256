//! The FP8 warpgroup gemv (cu/gemv_f8wg.cu: `wgmma` over e4m3 tiles, K split by
//! thread-block clusters) against the CPU, and the engine's FP8 decode path taking it.

use super::*;
use kernels::cuda::{CudaBuf, CudaWeight};

/// Allowed max|Δ|/max|CPU| of a row of the warpgroup gemv: its activations are the same
/// three e4m3 parts as `gemv_f8mma`'s (~2^-12 of each value) and each wgmma's 32 products
/// are summed by the tensor core in fewer bits than f32 before the f32 sums take them;
/// the bound is `gemv_f8mma`'s, where a wrong tile, descriptor, scale or K part gives
/// errors of order 1.
const F8WG_TOL: f32 = 2e-4;

/// An FP8 weight whose 128 × 128 blocks have magnitudes 2^-2 .. 2^2 apart, so every
/// block gets its own scale and a scale read from the wrong block is seen.
fn blocky_fp8(rng: &mut ChaCha8Rng, n: usize, k: usize) -> TestWeight {
    let mut host = HostMatrix::new(n, k, rand_vec(rng, n * k, 0.05));
    for r in 0..n {
        for c in 0..k {
            let e = ((r / 128) * 3 + c / 128) % 5;
            host.data[r * k + c] *= [0.25f32, 0.5, 1.0, 2.0, 4.0][e];
        }
    }
    TestWeight { stored: Some(OwnedWeight::quantize(&host, OwnedFormat::Fp8)), host }
}

/// Shapes (groups, outputs, inputs) at 1 and 2 rows of very different magnitudes, on
/// poisoned outputs: V4-Flash's wo_b (K 8192), the shared expert's down projection (K
/// 2048), wq_b (32,768 × 1,024: many tiles), wq_a (1,024 × 4,096: few tiles, K split by a
/// cluster), the grouped wo_a (8 groups of 1,024 outputs over 4,096 inputs), and odd ones:
/// 65 tiles (clusters with one and two tiles), K = 384 (three chunks, no split possible
/// past 1), K = 3,072 (a split of 8 leaves three chunks a block), one tile. The printed
/// kernel names the K split the plan chose (the `_k` suffix; `_s4_`: rings of 4). Each
/// case checks the kernel takes the shape, then that the engine's FP8 decode path gives
/// the same bits (it runs this kernel) unless `SLUICE_CUDA_F8WG=0`.
#[test]
fn cuda_f8wg_products_match_cpu() {
    let Some(g) = wgmma_gpu("cuda_f8wg_products_match_cpu", &[]) else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("f8wg products");
    let engine_takes_it = std::env::var("SLUICE_CUDA_F8WG").map(|v| v != "0").unwrap_or(true);
    let shapes = [
        (1, 4096, 8192),
        (1, 4096, 2048),
        (1, 32768, 1024),
        (1, 1024, 4096),
        (8, 8 * 1024, 4096),
        (1, 65 * 64, 4096),
        (1, 2048, 384),
        (1, 512, 3072),
        (1, 64, 1024),
    ];
    for (groups, n, k) in shapes {
        let w = blocky_fp8(&mut rng, n, k);
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for rows in [1, 2] {
            let x: Vec<f32> = (0..rows).flat_map(|r| rand_vec(&mut rng, groups * k, [1.0, 3e-3][r])).collect();
            let gx = g.upload(&x);
            let mut out = poisoned(g, rows * n);
            let kernel = g.decode_fp8_kernel_alone("f8wg", &gx, rows, groups, &gw, &mut out);
            let kernel = kernel.unwrap_or_else(|| panic!("f8wg does not take {groups} x {n}x{k} at {rows} rows"));
            let got = g.download(&out);
            let mut want = vec![0f32; rows * n];
            c.grouped_matmul(&x, rows, groups, &cw, &mut want);
            for r in 0..rows {
                let span = r * n..(r + 1) * n;
                let e = rel_err(&got[span.clone()], &want[span]);
                eprintln!("PARITY f8wg {groups}x{n}x{k} rows={rows} row {r} ({kernel}) {e:.2e}");
                assert!(e <= F8WG_TOL, "{kernel} {groups} x {n}x{k} row {r} of {rows}: {e:.3e} above {F8WG_TOL:.0e}");
            }
            if engine_takes_it {
                let mut engine = poisoned(g, rows * n);
                g.decode_matmul("v2", &gx, rows, groups, &gw, &mut engine);
                let same = g.download(&engine).iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "the engine's FP8 decode path did not run {kernel} for {groups} x {n}x{k} at {rows} rows"
                );
            }
        }
    }
}

/// SwiGLU pairs of FP8 weights (`gemv_f8wg_pair_*`: each tile streams w1's chunk, then
/// w3's, and applies the clamp and SwiGLU to the pair's sums) at 1 and 2 rows of very
/// different magnitudes, on poisoned outputs, through the engine's decode path: V4-Flash's
/// shared expert (2,048 × 4,096), a pair whose few tiles split K over a cluster (1,024 ×
/// 7,168), 65 tiles × K 384, one tile; clamps 10 and 0.5 (the second clamps most gate and up
/// values; the error is measured against the products' magnitudes carried through SwiGLU,
/// since a clamp shrinks the output's range but not the products' errors). Blocky
/// weights, so a scale of the wrong matrix or block shows. Checks that the
/// pair kernel takes each case (skipped under `SLUICE_CUDA_F8WG=0` or `SLUICE_CUDA_F8WG_PAIR=0`).
#[test]
fn cuda_f8wg_swiglu_pairs_match_cpu() {
    let knobs = ["SLUICE_CUDA_F8WG", "SLUICE_CUDA_F8WG_PAIR"];
    let Some(g) = wgmma_gpu("cuda_f8wg_swiglu_pairs_match_cpu", &knobs) else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("f8wg swiglu pairs");
    for (n, k) in [(2048, 4096), (1024, 7168), (65 * 64, 384), (64, 1024)] {
        let (w1, w3) = (blocky_fp8(&mut rng, n, k), blocky_fp8(&mut rng, n, k));
        let (g1, g3) = (g.weight(w1.view()), g.weight(w3.view()));
        let (c1, c3) = (c.weight(w1.view()), c.weight(w3.view()));
        for rows in [1, 2] {
            let x: Vec<f32> = (0..rows).flat_map(|r| rand_vec(&mut rng, k, [1.0, 3e-3][r])).collect();
            let gx = g.upload(&x);
            let kernel = g.decode_swiglu_kernel(&gx, rows, &g1, &g3).unwrap_or_default();
            assert!(kernel.starts_with("gemv_f8wg_pair"), "the pair {n}x{k} at {rows} rows runs {kernel:?}");
            let (mut gate, mut up) = (vec![0f32; rows * n], vec![0f32; rows * n]);
            c.matmul(&x, rows, &c1, &mut gate);
            c.matmul(&x, rows, &c3, &mut up);
            for limit in [10.0f32, 0.5] {
                let mut out = poisoned(g, rows * n);
                g.decode_swiglu("v2", &gx, rows, &g1, &g3, limit, &mut out);
                let got = g.download(&out);
                let want = swiglu_reference(&gate, &up, limit);
                for r in 0..rows {
                    let span = r * n..(r + 1) * n;
                    // The products' own bound (F8WG_TOL of their largest magnitude) carried
                    // through SwiGLU, whose slopes are at most 1.1·|clamp(u)| in the gate and
                    // |silu(min(g, limit))| in the up value: with a clamp the output's range
                    // shrinks, not the products' errors.
                    let max_abs = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let (g_max, u_max) = (max_abs(&gate[span.clone()]), max_abs(&up[span.clone()]));
                    let silu = |a: f32| {
                        let a = a.min(limit);
                        a / (1.0 + (-a).exp())
                    };
                    let silu_max = gate[span.clone()].iter().fold(0f32, |m, &a| m.max(silu(a).abs()));
                    let scale = 1.1 * limit.min(u_max) * g_max + silu_max * u_max;
                    let err = got[span.clone()]
                        .iter()
                        .zip(&want[span])
                        .map(|(a, b)| if a.is_nan() { f32::INFINITY } else { (a - b).abs() })
                        .fold(0f32, f32::max);
                    let e = err / scale;
                    eprintln!("PARITY f8wg pair {n}x{k} limit={limit} rows={rows} row {r} ({kernel}) {e:.2e}");
                    assert!(e <= F8WG_TOL, "{kernel} pair {n}x{k} row {r} of {rows}: {e:.3e} above {F8WG_TOL:.0e}");
                }
            }
        }
    }
}

/// Several FP8 products of one input in one launch (`gemv_f8wg_many_*`, what
/// `Backend::matmul_many` runs a layer's `wq_a` and `wkv` in at decode) at 1 and 2 rows of
/// very different magnitudes, on poisoned outputs: V4-Flash's `wq_a` + `wkv` (1,024 and
/// 512 × 4,096: few tiles, K split by a cluster), three products of 128 / 2,048 / 384
/// rows over K 384 (a product of two tiles, clusters over a product boundary), four of 1,024
/// × 7,168, and a BF16 weight among two FP8 ones (it runs on its own). Blocky weights, so a
/// tile reading another product's map or scales shows. Checks that one launch takes the
/// FP8 products (skipped under `SLUICE_CUDA_F8WG=0`, `SLUICE_CUDA_F8WG_MANY=0` or
/// `SLUICE_CUDA_FUSED_PRODUCTS=0`).
#[test]
fn cuda_f8wg_many_products_match_cpu() {
    let knobs = ["SLUICE_CUDA_F8WG", "SLUICE_CUDA_F8WG_MANY", "SLUICE_CUDA_FUSED_PRODUCTS"];
    let Some(g) = wgmma_gpu("cuda_f8wg_many_products_match_cpu", &knobs) else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("f8wg many products");
    // (output rows of each product, K, a BF16 product among them)
    let cases: [(&[usize], usize, bool); 4] = [
        (&[1024, 512], 4096, false),
        (&[128, 2048, 384], 384, false),
        (&[1024; 4], 7168, false),
        (&[512, 256], 2048, true),
    ];
    for (ns, k, with_bf16) in cases {
        let mut ws: Vec<TestWeight> = ns.iter().map(|&n| blocky_fp8(&mut rng, n, k)).collect();
        if with_bf16 {
            let host = HostMatrix::new(192, k, rand_vec(&mut rng, 192 * k, 0.05));
            ws.insert(1, TestWeight { stored: Some(OwnedWeight::quantize(&host, OwnedFormat::Bf16)), host });
        }
        let gws: Vec<CudaWeight> = ws.iter().map(|w| g.weight(w.view())).collect();
        let cws: Vec<_> = ws.iter().map(|w| c.weight(w.view())).collect();
        for rows in [1, 2] {
            let x: Vec<f32> = (0..rows).flat_map(|r| rand_vec(&mut rng, k, [1.0, 3e-3][r])).collect();
            let gx = g.upload(&x);
            let fp8: Vec<&CudaWeight> = gws.iter().filter(|w| w.format() == "fp8").collect();
            let kernel = g.f8wg_many_kernel(&gx, rows, &fp8);
            let kernel = kernel.unwrap_or_else(|| panic!("no many-product launch takes {ns:?} x {k} at {rows} rows"));
            let mut outs: Vec<CudaBuf> = gws.iter().map(|w| poisoned(g, rows * w.rows)).collect();
            g.matmul_many(&gx, rows, &gws.iter().collect::<Vec<_>>(), &mut outs.iter_mut().collect::<Vec<_>>());
            for (i, (cw, out)) in cws.iter().zip(&outs).enumerate() {
                let n = gws[i].rows;
                let got = g.download(out);
                let mut want = vec![0f32; rows * n];
                c.matmul(&x, rows, cw, &mut want);
                for r in 0..rows {
                    let span = r * n..(r + 1) * n;
                    let e = rel_err(&got[span.clone()], &want[span]);
                    let what =
                        format!("{kernel} {ns:?} x {k} product {i} ({n} rows, {}) row {r} of {rows}", gws[i].format());
                    eprintln!("PARITY f8wg many {what}: {e:.2e}");
                    assert!(e <= F8WG_TOL, "{what}: {e:.3e} above {F8WG_TOL:.0e}");
                }
            }
        }
    }
}
