//! BF16 products of many rows on cuBLAS (prefill; decode batches past 8 rows) against
//! the CPU backend, with the activations split into bf16 hi + lo (the default) and
//! rounded once to bf16 (`SLUICE_CUDA_BF16_ACTIVATIONS=bf16`), on poisoned outputs:
//! decode-sized rows (hi and lo stacked into one product, then summed) and prefill-sized
//! ones (two products into the output), plain and block-diagonal.

use super::*;

/// Split activations keep ~16 mantissa bits, as the f32 products of the other paths
/// nearly do: held to the per-op suite's CUDA matmul bound (kernels/tests/parity.rs),
/// far inside the bf16 row of [`TOLERANCES`] that the rounded activations are held to.
const SPLIT_ACTIVATIONS_TOL: f32 = 1e-4;

#[test]
fn cuda_bf16_products_on_cublas_match_cpu() {
    let Some(g) = gpu("cuda_bf16_products_on_cublas_match_cpu") else { return };
    let c = CpuBackend::new();
    let mut rng = rng("cublas bf16 products");
    // (groups, outputs, inputs a group): wq_b-like, wo_b-like, the grouped wo_a, an odd
    // shape (K not a multiple of 32, outputs not of 128).
    for (groups, n, k) in [(1, 8192, 1024), (1, 4096, 8192), (8, 8 * 1024, 512), (1, 300, 200)] {
        let w = weight(&mut rng, n, k, 0.05, "bf16");
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for rows in [9, 33, 64, 65, 300] {
            let x = rand_vec(&mut rng, rows * groups * k, 1.0);
            let mut want = vec![0f32; rows * n];
            if groups == 1 {
                c.matmul(&x, rows, &cw, &mut want);
            } else {
                c.grouped_matmul(&x, rows, groups, &cw, &mut want);
            }
            let gx = g.upload(&x);
            for activations in ["split", "bf16"] {
                let mut out = poisoned(g, rows * n);
                g.cublas_bf16_matmul(activations, &gx, rows, groups, &gw, &mut out);
                let got = g.download(&out);
                let what = format!("cublas bf16 {groups}x{}x{k} rows={rows} x={activations}", n / groups);
                if activations == "split" {
                    let e = rel_err(&got, &want);
                    eprintln!("PARITY {what} bf16 {e:.2e}");
                    assert!(
                        e <= SPLIT_ACTIVATIONS_TOL,
                        "{what}: max|Δ|/max|ref| {e:.3e} above {SPLIT_ACTIVATIONS_TOL:.0e}"
                    );
                } else {
                    check(&what, "bf16", &got, &want);
                }
            }
        }
    }
}
