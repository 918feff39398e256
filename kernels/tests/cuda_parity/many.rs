//! Products of the same activations (`Backend::matmul_many`) against the CPU, one by
//! one, on poisoned outputs: a CSA layer's input projections at Flash widths (wq_a,
//! wkv, two compressors' wkv and wgate, the indexer's weights_proj: seven BF16 weights
//! of K = 4096), at one and two rows (one `gemv_many_bf16` launch), 3-8 rows (each on
//! its own), 9-300 rows (cuBLAS on one split of x; with `SLUICE_CUDA_GEMM_ROWS=9`, 9-32
//! rows `gemm_rows_bf16` product by product), more products than one launch
//! takes, a list with an FP8 weight in it (each on its own), and `wq_a` + `wkv` in FP8
//! (past 8 rows two `fp8wg_gemm` products split along K from one set of the rows' parts);
//! in bf16 activations, 9-64 rows as one batched cuBLAS call over 64-row chunks.

use super::*;

#[test]
fn cuda_products_of_one_input_match_cpu() {
    let Some(g) = gpu("cuda_products_of_one_input_match_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("matmul_many");
    let k = 4096;
    let csa = [1024, 512, 1024, 1024, 256, 256, 64];
    let nine = [1024, 512, 1024, 1024, 256, 256, 64, 512, 8];
    let cases: [(&str, &[usize], &[&str]); 4] = [
        ("csa", &csa, &["bf16"; 7]),
        ("nine", &nine, &["bf16"; 9]),
        ("mixed", &[1024, 512, 64], &["bf16", "fp8", "bf16"]),
        ("fp8", &[1024, 512], &["fp8", "fp8"]),
    ];
    for (what, outputs, dtypes) in cases {
        let ws: Vec<TestWeight> = outputs.iter().zip(dtypes).map(|(&n, d)| weight(&mut rng, n, k, 0.02, d)).collect();
        let gws: Vec<_> = ws.iter().map(|w| g.weight(w.view())).collect();
        let cws: Vec<_> = ws.iter().map(|w| c.weight(w.view())).collect();
        for rows in [1, 2, 3, 8, 9, 32, 33, 300] {
            let x = rand_vec(&mut rng, rows * k, 1.0);
            let gx = g.upload(&x);
            let mut outs: Vec<_> = outputs.iter().map(|n| poisoned(g, rows * n)).collect();
            g.matmul_many(&gx, rows, &gws.iter().collect::<Vec<_>>(), &mut outs.iter_mut().collect::<Vec<_>>());
            for (i, out) in outs.iter().enumerate() {
                let mut want = vec![0f32; rows * outputs[i]];
                c.matmul(&x, rows, &cws[i], &mut want);
                let got = g.download(out);
                check(&format!("matmul_many {what}[{i}] {}x{k} rows={rows}", outputs[i]), dtypes[i], &got, &want);
                // BF16 ones held as tightly as one product alone (f32 activations, or
                // split activations on cuBLAS): sharing a launch must not cost precision.
                let e = rel_err(&got, &want);
                let bound = if dtypes[i] == "bf16" { tol("f32") } else { tol(dtypes[i]) };
                assert!(e <= bound, "matmul_many {what}[{i}] rows={rows}: {e:.3e} above {bound:.0e}");
            }
        }
    }
}

/// In bf16 activations (the serving default) products of 9+ rows over BF16 weights share
/// one rounding of x: each of a CSA layer's seven input projections through
/// `matmul_many`, and a SwiGLU pair's gate and up, against the same product issued alone
/// (`matmul`, which rounds x itself) — and the CPU within the bf16 bound. Past 64 rows
/// they are the same cuBLAS products, so the same bits. At 3-64 rows the small ones are
/// one batched call over 64-row chunks of the weights (`chunked_products`): from 9 rows
/// the same rounded inputs and exact bf16 products as alone, summed by another kernel,
/// so within f32 rounding of the product alone; below 9 a product alone is a gemv of
/// the unrounded rows, so there the chunks are held to the CPU's bf16 bound. A list
/// with a product too wide to join (8,192 outputs) runs that one alone and the others
/// chunked. The SwiGLU pair is chunked the same way at 9-64 rows (within f32 rounding of
/// its products alone) and bit-equal to them past 64.
#[test]
fn cuda_products_of_one_input_share_one_bf16_rounding() {
    let name = "cuda_products_of_one_input_share_one_bf16_rounding";
    let Some(g) = gpu_in(name, Activations::Bf16) else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng(name);
    let k = 4096;
    let csa = [1024, 512, 1024, 1024, 256, 256, 64];
    let with_wide = [1024, 8192, 512, 64];
    let [w1, _, w3] = expert_weights(&mut rng, k, 1024, "bf16");
    let (g1, g3) = (g.weight(w1.view()), g.weight(w3.view()));
    let (c1, c3) = (c.weight(w1.view()), c.weight(w3.view()));
    for (what, outputs) in [("csa", &csa[..]), ("with a wide one", &with_wide[..])] {
        let ws: Vec<TestWeight> = outputs.iter().map(|&n| weight(&mut rng, n, k, 0.02, "bf16")).collect();
        let gws: Vec<_> = ws.iter().map(|w| g.weight(w.view())).collect();
        let cws: Vec<_> = ws.iter().map(|w| c.weight(w.view())).collect();
        for rows in [8, 9, 32, 64, 300] {
            let chunked = g.products_in_chunks(rows, &gws.iter().collect::<Vec<_>>());
            // From SLUICE_CUDA_CHUNKED_MIN_ROWS (default 3) to 64 rows.
            let min_rows = std::env::var("SLUICE_CUDA_CHUNKED_MIN_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
            let want_chunked = match (rows, what) {
                (65.., _) => 0,
                _ if rows < min_rows => 0,
                (_, "csa") => 7,
                _ => 3,
            };
            assert_eq!(chunked, want_chunked, "{what} rows={rows}: products in the batched call of chunks");
            let x = rand_vec(&mut rng, rows * k, 1.0);
            let gx = g.upload(&x);
            let mut outs: Vec<_> = outputs.iter().map(|n| poisoned(g, rows * n)).collect();
            g.matmul_many(&gx, rows, &gws.iter().collect::<Vec<_>>(), &mut outs.iter_mut().collect::<Vec<_>>());
            let mut worst = 0f32;
            for (i, out) in outs.iter().enumerate() {
                let mut alone = poisoned(g, rows * outputs[i]);
                g.matmul(&gx, rows, &gws[i], &mut alone);
                let (got, alone) = (g.download(out), g.download(&alone));
                if chunked == 0 || outputs[i] > 4096 {
                    let differ = got.iter().zip(&alone).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                    assert_eq!(differ, 0, "{what}[{i}] rows={rows}: {differ} values differ from the product alone");
                } else if rows >= 9 {
                    let e = rel_err(&got, &alone);
                    assert!(e <= 1e-5, "{what}[{i}] rows={rows}: {e:.2e} from the product alone (chunked)");
                    worst = worst.max(e);
                }
                // (Below 9 rows a product alone is a gemv of the unrounded rows: the
                // chunks' bf16 rounding is held to the CPU's bf16 bound below.)
                let mut want = vec![0f32; rows * outputs[i]];
                c.matmul(&x, rows, &cws[i], &mut want);
                check(&format!("matmul_many bf16 activations {what}[{i}] rows={rows}"), "bf16", &got, &want);
            }
            eprintln!("PARITY shared bf16 rounding {what} rows={rows}: {chunked} chunked, {worst:.1e} from alone");
        }
    }
    for rows in [9, 64, 300] {
        let x = rand_vec(&mut rng, rows * k, 1.0);
        let gx = g.upload(&x);
        // The pair: against its two products issued alone and the SwiGLU of those.
        let limit = 10.0;
        let mut pair = poisoned(g, rows * 1024);
        assert!(!g.swiglu_rows(&gx, rows, &g1, &g3, limit, &mut pair), "BF16 weights are not on fp8wg_gemm");
        let (mut gate, mut up) = (poisoned(g, rows * 1024), poisoned(g, rows * 1024));
        g.matmul(&gx, rows, &g1, &mut gate);
        g.matmul(&gx, rows, &g3, &mut up);
        let swiglu = |gate: &[f32], up: &[f32]| -> Vec<f32> {
            gate.iter()
                .zip(up)
                .map(|(&a, &u)| {
                    let a = a.min(limit);
                    a / (1.0 + (-a).exp()) * u.clamp(-limit, limit)
                })
                .collect()
        };
        let got = g.download(&pair);
        let from_alone = swiglu(&g.download(&gate), &g.download(&up));
        let e = rel_err(&got, &from_alone);
        // 9-64 rows: gate and up are one chunked call, summed by another kernel.
        let bound = if rows <= 64 { 1e-5 } else { 1e-6 };
        assert!(e <= bound, "SwiGLU pair rows={rows}: {e:.2e} from its products issued alone");
        let (mut cg, mut cu) = (vec![0f32; rows * 1024], vec![0f32; rows * 1024]);
        c.matmul(&x, rows, &c1, &mut cg);
        c.matmul(&x, rows, &c3, &mut cu);
        check(&format!("SwiGLU pair bf16 activations rows={rows}"), "bf16", &got, &swiglu(&cg, &cu));
        eprintln!("PARITY shared bf16 rounding rows={rows}: SwiGLU pair {e:.1e} from its products alone");
    }
}
