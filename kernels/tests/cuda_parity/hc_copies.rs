//! What a prefill's mHC boundary hands on: the first boundary, whose streams are copies
//! of the embedding (the GPU reads the rows alone: `Backend::hc_pre_copies`,
//! `Backend::hc_post_pre_copies`; the CPU makes the streams and runs `hc_pre` /
//! `hc_post_pre` on them), and the collapse's rows in bf16 for the products.

use kernels::backend::StreamCopies;
use kernels::cuda::CudaBuf;

use super::*;

/// The mHC weights of V4's shape on either backend.
fn hc_weights<B: Backend>(b: &B, mix: &TestWeight, base: &[f32], d: usize) -> HcWeights<B> {
    HcWeights {
        mix: b.weight(mix.view()),
        base: base.to_vec(),
        scale: [0.8, 1.1, 0.9],
        hc: 4,
        hidden: d,
        sinkhorn_iters: 20,
        norm_eps: 1e-6,
        hc_eps: 1e-6,
    }
}

/// Decode rows (the streams made, then the usual kernels) and prefill rows of an f32 and
/// a bf16 mixing weight (`hc_mix_copies_rows` and `hc_post_mix_rows` reading the rows:
/// asserted), against the CPU on the made streams; the updated streams bit for bit those
/// of the GPU's update of the made streams.
#[test]
fn cuda_hc_of_copied_streams_match_cpu() {
    let Some(g) = gpu("cuda_hc_of_copied_streams_match_cpu") else { return };
    let g = &*g;
    let c = CpuBackend::new();
    let mut rng = rng("mhc copies");
    let (hc, d) = (4, 4096);
    let mut from_rows = 0;
    for (mix_dtype, rows) in [("f32", 8), ("f32", 300), ("bf16", 600)] {
        let mix = weight(&mut rng, (2 + hc) * hc, hc * d, 0.02, mix_dtype);
        let base = rand_vec(&mut rng, (2 + hc) * hc, 0.5);
        let (gw, cw) = (hc_weights(g, &mix, &base, d), hc_weights(&c, &mix, &base, d));
        let x = rand_vec(&mut rng, rows * d, 1.0);
        let made: Vec<f32> = x.chunks(d).flat_map(|row| std::iter::repeat_n(row, hc).flatten().copied()).collect();
        let norm_w = rand_vec(&mut rng, d, 1.0);
        let out = rand_vec(&mut rng, rows * d, 1.0);
        let (gx, gnorm) = (g.upload(&x), g.upload(&norm_w));
        let copies = StreamCopies { x: &gx, rows, hc, hidden: d };
        from_rows += usize::from(g.hc_copies_from_rows(rows, &gw));

        // The pre-mix of the copies.
        let (mut col, mut post, mut comb) =
            (poisoned(g, rows * d), poisoned(g, rows * hc), poisoned(g, rows * hc * hc));
        g.hc_pre_copies(&copies, &gw, Some((&gnorm, 1e-6)), &mut col, &mut post, &mut comb);
        let (mut ccol, mut cpost, mut ccomb) =
            (vec![0f32; rows * d], vec![0f32; rows * hc], vec![0f32; rows * hc * hc]);
        c.hc_pre(&made, rows, &cw, Some((&norm_w, 1e-6)), &mut ccol, &mut cpost, &mut ccomb);
        check(&format!("hc_pre_copies normed rows={rows} mix {mix_dtype}"), "f32", &g.download(&col), &ccol);
        check(&format!("hc_pre_copies post rows={rows}"), "f32", &g.download(&post), &cpost);
        check(&format!("hc_pre_copies comb rows={rows}"), "f32", &g.download(&comb), &ccomb);

        // The first update of the copies with the next sub-block's pre-mix; post and comb
        // are read, then overwritten.
        let gout = g.upload(&out);
        let (mut fcol, mut fpost, mut fcomb) = (poisoned(g, rows * d), g.upload(&cpost), g.upload(&ccomb));
        let streams =
            g.hc_post_pre_copies(&copies, &gout, &gw, Some((&gnorm, 1e-6)), &mut fcol, &mut fpost, &mut fcomb);
        let mut gmade = g.upload(&made);
        let (mut mcol, mut mpost, mut mcomb) = (poisoned(g, rows * d), g.upload(&cpost), g.upload(&ccomb));
        g.hc_post_pre(&mut gmade, rows, hc, &gout, &gw, Some((&gnorm, 1e-6)), &mut mcol, &mut mpost, &mut mcomb);
        assert_eq!(
            g.download(&streams),
            g.download(&gmade),
            "rows={rows}: the copies' update differs from the made streams'"
        );
        assert_eq!(
            g.download(&fcol),
            g.download(&mcol),
            "rows={rows}: the next pre-mix differs from the made streams'"
        );
        let (mut cs, mut ccol2, mut cpost2, mut ccomb2) =
            (made.clone(), vec![0f32; rows * d], cpost.clone(), ccomb.clone());
        c.hc_post_pre(&mut cs, rows, hc, &out, &cw, Some((&norm_w, 1e-6)), &mut ccol2, &mut cpost2, &mut ccomb2);
        check(&format!("hc_post_pre_copies streams rows={rows}"), "f32", &g.download(&streams), &cs);
        check(&format!("hc_post_pre_copies normed rows={rows} mix {mix_dtype}"), "f32", &g.download(&fcol), &ccol2);
        check(&format!("hc_post_pre_copies post rows={rows}"), "f32", &g.download(&fpost), &cpost2);
        check(&format!("hc_post_pre_copies comb rows={rows}"), "f32", &g.download(&fcomb), &ccomb2);
    }
    let on = std::env::var("SLUICE_CUDA_HC_COPIES").map_or(true, |v| v != "0");
    eprintln!("PARITY hc copies: {from_rows} cases from the rows alone (hc_mix_copies_rows)");
    assert!(!on || from_rows == 2, "the rows alone were read in {from_rows} cases, expected 300 and 600 rows");
}

/// With bf16 activations a prefill's collapse also stores its normed rows in bf16, which
/// the sub-block's products read instead of rounding the rows again (asserted: the rows
/// carry them): every product of `matmul_many` over BF16 weights and a MoE layer of BF16
/// experts with a shared expert (router, shared pair, routed rows gathered) give the bits
/// they give on the same f32 rows uploaded afresh, which they round themselves; the MoE
/// layer (its shared expert's SwiGLU written in bf16) is within the bf16 bound of the CPU's.
#[test]
fn cuda_collapse_rounded_rows_feed_the_products_bit_for_bit() {
    let name = "cuda_collapse_rounded_rows_feed_the_products_bit_for_bit";
    let Some(g) = gpu_in(name, Activations::Bf16) else { return };
    let g = &*g;
    let mut rng = rng(name);
    let (hc, d, rows) = (4, 4096, 300);
    let mix = weight(&mut rng, (2 + hc) * hc, hc * d, 0.02, "f32");
    let base = rand_vec(&mut rng, (2 + hc) * hc, 0.5);
    let w = hc_weights(g, &mix, &base, d);
    let norm = g.upload(&rand_vec(&mut rng, d, 1.0));
    // A boundary inside the step (the update and the next pre-mix in one pass, whose
    // weights are taken apart and whose collapse stores the rows).
    let mut streams = g.upload(&rand_vec(&mut rng, rows * hc * d, 1.0));
    let out = g.upload(&rand_vec(&mut rng, rows * d, 1.0));
    let mut post = g.upload(&rand_vec(&mut rng, rows * hc, 1.0));
    let mut comb = g.upload(&rand_vec(&mut rng, rows * hc * hc, 0.5));
    let mut x = poisoned(g, rows * d);
    g.hc_post_pre(&mut streams, rows, hc, &out, &w, Some((&norm, 1e-6)), &mut x, &mut post, &mut comb);
    assert!(g.carries_bf16_rows(&x), "a prefill's collapse in bf16 activations should store bf16 rows");
    let plain = g.upload(&g.download(&x));
    assert!(!g.carries_bf16_rows(&plain));

    let outputs = [1024, 512, 64];
    let ws: Vec<_> = outputs.iter().map(|&n| g.weight(weight(&mut rng, n, d, 0.02, "bf16").view())).collect();
    let many = |x: &CudaBuf| -> Vec<Vec<f32>> {
        let mut outs: Vec<_> = outputs.iter().map(|n| poisoned(g, rows * n)).collect();
        g.matmul_many(x, rows, &ws.iter().collect::<Vec<_>>(), &mut outs.iter_mut().collect::<Vec<_>>());
        outs.iter().map(|o| g.download(o)).collect()
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (i, (a, b)) in many(&x).iter().zip(many(&plain)).enumerate() {
        assert_eq!(bits(a), bits(&b), "matmul_many[{i}]: the collapse's bf16 rows gave other products");
    }

    // A BF16 router too, so the router's product and the shared expert's pair read the
    // rows' one rounding (and the shared expert writes its SwiGLU in bf16): checked
    // against the CPU as well, with hash routing (the same experts on both devices; a
    // top-k of router scores from bf16 rows picks other experts than the CPU's f32 ones
    // for rows near a tie, and such a row's output is another sum).
    let (inter, n_exp, k) = (512, 16, 4);
    let gate = weight(&mut rng, n_exp, d, 0.05, "bf16");
    let experts: Vec<[TestWeight; 3]> = (0..n_exp).map(|_| expert_weights(&mut rng, d, inter, "bf16")).collect();
    let shared = expert_weights(&mut rng, d, inter, "bf16");
    let tid2eid: Vec<u32> = (0..rows * k).map(|i| ((i * 7 + i / k) % n_exp) as u32).collect();
    let routing = || Routing::Hash { tid2eid: tid2eid.clone() };
    let moe = moe_weights(g, &gate, routing(), &experts, &shared, k);
    assert!(g.routed_rows_in_bf16(rows * k, &moe), "{rows} rows should gather their routed rows in bf16");
    let tokens: Vec<u32> = (0..rows as u32).collect();
    let layer = |x: &CudaBuf| {
        let mut out = poisoned(g, rows * d);
        g.moe(x, rows, &tokens, &moe, 0..rows, &mut out);
        g.download(&out)
    };
    let got = layer(&x);
    assert_eq!(bits(&got), bits(&layer(&plain)), "moe: the collapse's bf16 rows gave another output");
    let c = CpuBackend::new();
    let cmoe = moe_weights(&c, &gate, routing(), &experts, &shared, k);
    let mut want = vec![0f32; rows * d];
    c.moe(&g.download(&x), rows, &tokens, &cmoe, 0..rows, &mut want);
    check("moe on the collapse's bf16 rows", "bf16", &got, &want);
    eprintln!("PARITY collapse bf16 rows: {} products and a MoE layer bit for bit", outputs.len());
}
