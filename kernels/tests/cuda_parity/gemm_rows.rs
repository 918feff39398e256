//! BF16 products of decode batches through `gemm_rows_bf16` (opt-in:
//! `SLUICE_CUDA_GEMM_ROWS=9` routes 9-32 rows to it; the hook runs it at any 1-32)
//! against the CPU on poisoned outputs: the activations split in the kernel into bf16
//! hi + lo, plain and block-diagonal products, shapes that split K over clusters of 2-8
//! blocks (few outputs) or not (many outputs), outputs not a multiple of the 128-output
//! block, and batches that leave one or both halves of a block's 32 rows empty. Where
//! the backend's `matmul` routes the rows to the kernel it must give the same values;
//! elsewhere (cuBLAS) the same bound.

use super::cublas::{SPLIT_ACTIVATIONS_TOL, cpu_product};
use super::*;

#[test]
fn cuda_gemm_rows_bf16_matches_cpu() {
    let Some(g) = gpu("cuda_gemm_rows_bf16_matches_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("gemm_rows bf16");
    // (groups, outputs, inputs a group): wq_b-like (no K split), wo_b-like (K split over a
    // cluster of 8 blocks), grouped wo_a (4), a narrow product (8), outputs not a
    // multiple of 128 with K of 3 chunks (2).
    for (groups, n, k) in [(1, 32768, 1024), (1, 4096, 8192), (8, 8 * 1024, 512), (1, 1024, 4096), (1, 300, 384)] {
        let w = weight(&mut rng, n, k, 0.05, "bf16");
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for rows in [1, 8, 9, 16, 17, 31, 32] {
            // Rows of different magnitudes: each keeps its own relative precision.
            let mut x = rand_vec(&mut rng, rows * groups * k, 1.0);
            for (r, row) in x.chunks_mut(groups * k).enumerate() {
                row.iter_mut().for_each(|v| *v *= [1.0, 1e-3, 40.0][r % 3]);
            }
            let want = cpu_product(&c, &x, rows, groups, &cw);
            let gx = g.upload(&x);
            let mut out = poisoned(g, rows * n);
            let what = format!("gemm_rows bf16 {groups}x{}x{k} rows={rows}", n / groups);
            assert!(g.gemm_rows_matmul(&gx, rows, groups, &gw, &mut out), "{what}: the kernel refused the shape");
            let got = g.download(&out);
            // Per row: a row of 1e-3 must not hide in the error bound of a row of 40.
            for (r, (gr, wr)) in got.chunks(n).zip(want.chunks(n)).enumerate() {
                let e = rel_err(gr, wr);
                assert!(
                    e <= SPLIT_ACTIVATIONS_TOL,
                    "{what} row {r}: max|Δ|/max|ref| {e:.3e} above {SPLIT_ACTIVATIONS_TOL:.0e}"
                );
            }
            eprintln!("PARITY {what} bf16 {:.2e}", rel_err(&got, &want));
            if groups == 1 && (9..=32).contains(&rows) {
                // The backend's own product at these rows: the same kernel where it routes
                // them there (the same values), cuBLAS otherwise (the same bound).
                let mut via = poisoned(g, rows * n);
                g.matmul(&gx, rows, &gw, &mut via);
                let via = g.download(&via);
                if g.gemm_rows_routes(&gx, rows, groups, &gw) {
                    assert_eq!(via, got, "{what}: matmul's result differs from the kernel's");
                } else {
                    let e = rel_err(&via, &want);
                    assert!(e <= SPLIT_ACTIVATIONS_TOL, "{what} via matmul: {e:.3e} above {SPLIT_ACTIVATIONS_TOL:.0e}");
                }
            }
        }
    }
    // K not a multiple of 128 and more than 32 rows are not taken (cuBLAS keeps them).
    let w = weight(&mut rng, 256, 200, 0.05, "bf16");
    let gw = g.weight(w.view());
    let (gx, mut out) = (g.upload(&vec![1.0; 16 * 200]), g.zeros(16 * 256));
    assert!(!g.gemm_rows_matmul(&gx, 16, 1, &gw, &mut out), "K = 200 is not a multiple of 128");
    let w = weight(&mut rng, 256, 256, 0.05, "bf16");
    let gw = g.weight(w.view());
    let (gx, mut out) = (g.upload(&vec![1.0; 33 * 256]), g.zeros(33 * 256));
    assert!(!g.gemm_rows_matmul(&gx, 33, 1, &gw, &mut out), "33 rows exceed the kernel's 32");
}
