//! BF16 products of many rows on cuBLAS (prefill; decode batches past 8 rows) against
//! the CPU backend, with the activations split into bf16 hi + lo (`Activations::Split`)
//! and rounded once to bf16 (`Activations::Bf16`, the serving default), on poisoned outputs:
//! decode-sized rows (hi and lo stacked into one product, then summed) and prefill-sized
//! ones (two products into the output), plain and block-diagonal.

use super::*;

/// Split activations keep ~16 mantissa bits, as the f32 products of the other paths
/// nearly do: held to the per-op suite's CUDA matmul bound (kernels/tests/parity.rs),
/// far inside the bf16 row of [`TOLERANCES`] that the rounded activations are held to.
/// `gemm_rows.rs` holds the one-launch kernel's products (the same split) to it too.
pub(super) const SPLIT_ACTIVATIONS_TOL: f32 = 1e-4;

/// The CPU's `x · Wᵀ` (block-diagonal over `groups` when more than one), the reference of
/// the BF16 products here and in `gemm_rows.rs`.
pub(super) fn cpu_product(
    c: &CpuBackend,
    x: &<CpuBackend as Backend>::Buf,
    rows: usize,
    groups: usize,
    w: &<CpuBackend as Backend>::Weight,
) -> Vec<f32> {
    let mut want = vec![0f32; rows * w.rows];
    if groups == 1 {
        c.matmul(x, rows, w, &mut want);
    } else {
        c.grouped_matmul(x, rows, groups, w, &mut want);
    }
    want
}

#[test]
fn cuda_bf16_products_on_cublas_match_cpu() {
    let Some(g) = gpu("cuda_bf16_products_on_cublas_match_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("cublas bf16 products");
    // (groups, outputs, inputs a group): wq_b-like, wo_b-like, the grouped wo_a, an odd
    // shape (K not a multiple of 32, outputs not of 128).
    for (groups, n, k) in [(1, 8192, 1024), (1, 4096, 8192), (8, 8 * 1024, 512), (1, 300, 200)] {
        let w = weight(&mut rng, n, k, 0.05, "bf16");
        let (gw, cw) = (g.weight(w.view()), c.weight(w.view()));
        for rows in [9, 33, 64, 65, 300] {
            let x = rand_vec(&mut rng, rows * groups * k, 1.0);
            let want = cpu_product(&c, &x, rows, groups, &cw);
            let gx = g.upload(&x);
            for activations in [Activations::Split, Activations::Bf16] {
                let mut out = poisoned(g, rows * n);
                g.cublas_bf16_matmul(activations, &gx, rows, groups, &gw, &mut out);
                let got = g.download(&out);
                let what = format!("cublas bf16 {groups}x{}x{k} rows={rows} x={activations}", n / groups);
                if activations == Activations::Split {
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

/// Routed BF16 experts on cuBLAS: decode batches as batched products (9-64 rows; fewer
/// take the gemv kernels), a prefill-sized batch one product an expert at flash-bench's
/// shapes (8 experts of 1024, top 2, a BF16 shared expert), under top-k routing and hash
/// routing whose table names an expert twice for even tokens, at two SwiGLU clamps,
/// against the CPU; with split activations, then with bf16 ones (where a prefill's routed
/// rows go to cuBLAS gathered into bf16 at once: `routed_rows_in_bf16`).
#[test]
fn cuda_bf16_experts_on_cublas_match_cpu() {
    for activations in [Activations::Split, Activations::Bf16] {
        let Some(g) = gpu_in("cuda_bf16_experts_on_cublas_match_cpu", activations) else { return };
        bf16_experts_on_cublas_match_cpu(&g, activations);
    }
}

fn bf16_experts_on_cublas_match_cpu(g: &CudaBackend, activations: Activations) {
    let c = CpuBackend::new();
    let mut rng = rng("cublas bf16 experts");
    let (d, inter, n_exp, k) = (4096, 1024, 8, 2);
    let gate = weight(&mut rng, n_exp, d, 0.05, "f32");
    let experts: Vec<[TestWeight; 3]> = (0..n_exp).map(|_| expert_weights(&mut rng, d, inter, "bf16")).collect();
    let shared = expert_weights(&mut rng, d, inter, "bf16");
    let bias = rand_vec(&mut rng, n_exp, 0.2);
    let (vocab, tid2eid) = super::decode::hash_table_with_repeats(k, n_exp);
    for limit in [10.0f32, 2.0] {
        for hash in [false, true] {
            let routing =
                || if hash { Routing::Hash { tid2eid: tid2eid.clone() } } else { Routing::TopK { bias: bias.clone() } };
            let gm = super::decode::experts_layer(g, &gate, routing(), &experts, &shared, k, limit);
            let cm = super::decode::experts_layer(&c, &gate, routing(), &experts, &shared, k, limit);
            // 9-64 rows: batched products over slots; 600 and 1500: the routing read back,
            // the routed rows gathered into bf16 at once, one product an expert and
            // projection and one combine (a prefill's path).
            for rows in [9, 16, 33, 64, 600, 1500] {
                assert!(rows > 64 || g.cublas_experts(rows, &gm), "the experts of {rows} rows do not take cuBLAS");
                let in_bf16 = g.routed_rows_in_bf16(rows * k, &gm);
                assert_eq!(in_bf16, rows > 64 && activations == Activations::Bf16, "{rows} rows: bf16 rows {in_bf16}");
                let x = rand_vec(&mut rng, rows * d, 1.0);
                let tokens = batch_tokens(&mut rng, rows, vocab);
                let mut want = vec![0f32; rows * d];
                c.moe(&x, rows, &tokens, &cm, 0..rows, &mut want);
                let mut out = poisoned(g, rows * d);
                g.moe(&g.upload(&x), rows, &tokens, &gm, 0..rows, &mut out);
                check(&format!("cublas moe limit={limit} hash={hash} rows={rows}"), "bf16", &g.download(&out), &want);
            }
            assert!(!g.cublas_experts(8, &gm), "8 rows take the gemv kernels");
        }
    }
}
