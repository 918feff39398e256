//! The indexer's top-k over long rows: against the CPU, and against its definition.

use super::*;

/// The indexer over many candidates (a 256K-token context: 65,536 CSA entries) picks
/// the same top-512 as the CPU, except at exact f32 ties.
#[test]
fn cuda_indexer_topk_over_many_candidates_matches_cpu() {
    let Some(g) = gpu("cuda_indexer_topk_over_many_candidates_matches_cpu") else { return };
    let g = &*g;
    let cpu = CpuBackend::new();
    let mut rng = rng("topk");
    let spec = [LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM, rope_dim: 64 }];
    let layout = KvLayout::new(128, 128, EntryDtype::Bf16, &spec);
    let ctx = 262_144usize;
    let pages = ctx / 128;
    let raw = vec![[vec![0.0; 4 * 2 * HD], vec![1.0; HD], vec![0.0; 4 * 2 * IDX_DIM], vec![1.0; IDX_DIM]]];
    let sinks = vec![0.0; HEADS];
    let mut gs = side(g, &layout, pages, 2, &raw, &sinks);
    let mut cs = side(&cpu, &layout, pages, 2, &raw, &sinks);
    // Random indexer keys straight into the pages (bf16 bits), the same on both.
    for p in 0..pages {
        let at = p * layout.page_elems + layout.layers[0].page_index;
        let k: Vec<u8> =
            (0..32 * IDX_DIM).flat_map(|_| f32_to_bf16(rng.random::<f32>() * 2.0 - 1.0).to_le_bytes()).collect();
        gs.b.kv_write(&mut gs.kv.pages, at, &k);
        cs.b.kv_write(&mut cs.kv.pages, at, &k);
    }
    let toks = [0u32; 6];
    let table: Vec<u32> = (0..pages as u32).collect();
    // Two rows of different lengths, then six rows of the long sequence's last tokens
    // (more slices than the GPU has SMs).
    let plans = [
        BatchPlan::new(vec![(0, table.clone(), ctx - 1, &toks[..1]), (1, table.clone(), 40_000, &toks[1..2])]),
        BatchPlan::new(vec![(0, table, ctx - 6, &toks[..])]),
    ];
    for plan in &plans {
        let rows = plan.rows();
        let q = rand_vec(&mut rng, rows * IDX_HEADS * IDX_DIM, 0.3);
        let w = rand_vec(&mut rng, rows * IDX_HEADS, 1.0);
        let gsel = g.idx_download(
            &gs.b
                .index_topk(&gs.kv.view(), &layout, 0, plan, &gs.b.upload(&q), &gs.b.upload(&w), IDX_HEADS, TOP_K)
                .indices,
        );
        let csel = cs.b.index_topk(&cs.kv.view(), &layout, 0, plan, &q, &w, IDX_HEADS, TOP_K).indices;
        for r in 0..rows {
            let (gr, cr) = (&gsel[r * TOP_K..(r + 1) * TOP_K], &csel[r * TOP_K..(r + 1) * TOP_K]);
            assert!(gr.windows(2).all(|p| p[0] < p[1]), "row {r}: selection is not ascending");
            let same = gr.iter().filter(|i| cr.binary_search(i).is_ok()).count();
            eprintln!(
                "PARITY topk {rows} rows, row {r} ({} candidates): {same}/{TOP_K} identical",
                (plan.positions[r] as usize + 1) / 4
            );
            assert!(same + 2 >= TOP_K, "row {r}: only {same} of {TOP_K} selected entries agree");
        }
    }
}

/// The top-k by definition: the k largest scores of the row's visible prefix, equal
/// scores taken in index order (`total_cmp`, as the CPU backend orders them), ids
/// ascending, -1 past the visible count.
fn topk_reference(row: &[f32], k: usize) -> Vec<i32> {
    let mut ids: Vec<usize> = (0..row.len()).collect();
    ids.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let mut top: Vec<i32> = ids.into_iter().take(k).map(|i| i as i32).collect();
    top.sort_unstable();
    top.resize(k, -1);
    top
}

/// The long-row selection (rows of more than 16,384 candidates: two digit passes over
/// blocks, then the candidates of the last digit sifted from global memory) equals the
/// definition exactly on inputs built to stress it: uniform scores (a quarter of a
/// million candidates crowding a few exponents), one repeated value (every candidate
/// ties), a handful of values (large tie groups at the threshold), signed zeros and
/// negatives, rows shorter than k, and more rows than one launch group (16M
/// candidates) holds.
#[test]
fn cuda_topk_long_rows_equal_the_definition() {
    let Some(g) = gpu("cuda_topk_long_rows_equal_the_definition") else { return };
    let g = &*g;
    let mut rng = rng("topk_definition");
    let ratio = 4;
    type Score = Box<dyn Fn(&mut ChaCha8Rng, usize) -> f32>;
    let uniform = || -> Score { Box::new(|r, _| r.random::<f32>()) };
    let one_value = || -> Score { Box::new(|_, _| 0.25) };
    let cases: Vec<(&str, usize, Vec<usize>, Score)> = vec![
        ("uniform", 262_144, vec![262_144, 200_001, 300], uniform()),
        ("one value", 65_536, vec![65_536, 20_000], one_value()),
        ("five values", 100_000, vec![100_000, 77_777], Box::new(|_, i| ((i * 7919) % 5) as f32 - 2.0)),
        (
            "signed zeros and negatives",
            40_000,
            vec![40_000],
            Box::new(|r, i| {
                if i % 3 == 0 {
                    -0.0
                } else if i % 3 == 1 {
                    0.0
                } else {
                    -r.random::<f32>()
                }
            }),
        ),
        ("many rows", 262_144, vec![262_144; 20], Box::new(|r, _| r.random::<f32>() * 2.0 - 1.0)),
        ("uniform, longer rows", 300_000, vec![300_000, 270_000, 100], uniform()),
        ("one value, longer rows", 300_000, vec![300_000], one_value()),
        // 58 rows of 290,000: two launch groups.
        ("many rows, two launch groups", 290_000, vec![290_000; 58], Box::new(|r, _| r.random::<f32>() * 2.0 - 1.0)),
    ];
    for (name, n_max, lens, score) in cases {
        check_topk_rows(g, &mut rng, name, n_max, &lens, ratio, &score);
    }
}

/// Rows of `lens[r]` candidates (of `n_max` slots, -inf past them) scored by `score`,
/// selected on the GPU: each row's ids equal the definition's ([`topk_reference`]).
fn check_topk_rows(
    g: &CudaBackend,
    rng: &mut ChaCha8Rng,
    name: &str,
    n_max: usize,
    lens: &[usize],
    ratio: usize,
    score: &dyn Fn(&mut ChaCha8Rng, usize) -> f32,
) {
    let rows = lens.len();
    let mut scores = vec![f32::NEG_INFINITY; rows * n_max];
    for (r, &n) in lens.iter().enumerate() {
        for i in 0..n {
            scores[r * n_max + i] = score(rng, i);
        }
    }
    let positions: Vec<u32> = lens.iter().map(|&n| (n * ratio - 1) as u32).collect();
    let got = g.topk_of_scores(&scores, n_max, &positions, ratio, TOP_K);
    for (r, &n) in lens.iter().enumerate() {
        let want = topk_reference(&scores[r * n_max..r * n_max + n], TOP_K);
        assert_eq!(&got[r * TOP_K..(r + 1) * TOP_K], &want[..], "{name}: row {r} ({n} candidates)");
    }
    eprintln!("PARITY topk {name}: {rows} rows of up to {n_max} candidates identical to the definition");
}

/// A prefill's many short rows (a warp a row, `topk_select_warp`: asserted) equal the
/// definition exactly: rows of every length up to 2,048 candidates (shorter than k, just
/// past it, full), on uniform scores, one repeated value, a handful of values (tie groups
/// at the threshold) and signed zeros with negatives.
#[test]
fn cuda_topk_prefill_rows_equal_the_definition() {
    let Some(g) = gpu("cuda_topk_prefill_rows_equal_the_definition") else { return };
    let g = &*g;
    let mut rng = rng("topk_prefill_rows");
    let (ratio, n_max, rows) = (4, 2048, 1100);
    assert!(g.topk_in_warps(rows, n_max), "{rows} rows of {n_max} candidates should take a warp a row");
    type Score = Box<dyn Fn(&mut ChaCha8Rng, usize) -> f32>;
    let cases: Vec<(&str, Score)> = vec![
        ("uniform", Box::new(|r, _| r.random::<f32>() * 2.0 - 1.0)),
        ("one value", Box::new(|_, _| 0.25)),
        ("five values", Box::new(|_, i| ((i * 7919) % 5) as f32 - 2.0)),
        ("signed zeros and negatives", Box::new(|r, i| [-0.0, 0.0, -r.random::<f32>()][i % 3])),
    ];
    // Every length from 1 to n_max, with the edges (k, k + 1, n_max) present.
    let lens: Vec<usize> = (0..rows)
        .map(|r| match r {
            0 => TOP_K,
            1 => TOP_K + 1,
            2 => n_max,
            _ => 1 + (r * 1931) % n_max,
        })
        .collect();
    for (name, score) in cases {
        check_topk_rows(g, &mut rng, &format!("prefill rows, {name}"), n_max, &lens, ratio, &score);
    }
}

/// A random indexer key for every entry slot of layer 0 in `pages` pages, in the layer's
/// entry format: (element offset, bytes), to write into either backend's pages.
fn random_index_entries(rng: &mut ChaCha8Rng, layout: &KvLayout, pages: usize) -> Vec<(usize, Vec<u8>)> {
    let lk = &layout.layers[0];
    let mut entries = Vec::new();
    for p in 0..pages {
        for e in 0..lk.entries_per_page(layout.block) {
            let at = p * layout.page_elems + lk.page_offset(Branch::Indexer) + e * lk.stride(Branch::Indexer);
            let key = rand_vec(rng, IDX_DIM, 1.0);
            let mut bytes = vec![0u8; lk.index.bytes()];
            kv_entry::encode(&lk.index, &key, &mut bytes);
            entries.push((at, bytes));
        }
    }
    entries
}

/// `indexer_select` (q rotated and the head weights scaled inside the tensor-core
/// scoring's own launches) picks exactly what rotating q, scaling the weights and then
/// `index_topk` pick on the same device — the same rotation of the same values, the same
/// rounding of the weights — for FP8 and BF16 keys, decode rows and a prefill chunk; and,
/// on the CPU, `indexer_select` is that sequence by definition, so the GPU's other
/// parity tests of `index_topk` carry over.
#[test]
fn cuda_indexer_select_equals_rope_scale_then_topk() {
    let Some(g) = gpu("cuda_indexer_select_equals_rope_scale_then_topk") else { return };
    let g = &*g;
    let mut rng = rng("indexer_select");
    let spec = [LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM, rope_dim: 64 }];
    let yarn = Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 };
    let rope = RopeTable::yarn(160000.0, 64, yarn, 1.0);
    let scale = 0.125 * (IDX_HEADS as f32).powf(-0.5);
    for dtype in [EntryDtype::Fp8, EntryDtype::Bf16] {
        let layout = KvLayout::new(128, 128, dtype, &spec);
        let ctx = 16_384usize;
        let pages = ctx / 128;
        let raw = vec![[vec![0.0; 4 * 2 * HD], vec![1.0; HD], vec![0.0; 4 * 2 * IDX_DIM], vec![1.0; IDX_DIM]]];
        let mut s = side(g, &layout, pages, 2, &raw, &vec![0.0; HEADS]);
        // Random indexer keys in the layer's entry format, straight into the pages.
        for (at, bytes) in random_index_entries(&mut rng, &layout, pages) {
            s.b.kv_write(&mut s.kv.pages, at, &bytes);
        }
        let table: Vec<u32> = (0..pages as u32).collect();
        let toks = [0u32; 64];
        let plans = [
            BatchPlan::new(vec![(0, table.clone(), ctx - 1, &toks[..1])]),
            BatchPlan::new(vec![(0, table.clone(), 9_000, &toks[..1]), (1, table.clone(), ctx - 2, &toks[1..2])]),
            BatchPlan::new(vec![(0, table, ctx - 64, &toks[..])]),
        ];
        for plan in &plans {
            let rows = plan.rows();
            let q = rand_vec(&mut rng, rows * IDX_HEADS * IDX_DIM, 0.3);
            let w = rand_vec(&mut rng, rows * IDX_HEADS, 1.0);
            let knob_off = std::env::var("SLUICE_CUDA_INDEXER_PREP").is_ok_and(|v| v == "0");
            assert!(
                knob_off || g.indexer_prep_fused(&layout, 0, plan, IDX_HEADS, TOP_K),
                "{} keys, {rows} rows: the scoring does not take the rotation and the scale",
                dtype.name()
            );
            let (mut fq, mut fw) = (s.b.upload(&q), s.b.upload(&w));
            let kv = s.kv.view();
            let fused = s.b.indexer_select(&kv, &layout, 0, plan, &mut fq, &mut fw, IDX_HEADS, TOP_K, &rope, scale);
            let (mut q2, mut w2) = (s.b.upload(&q), s.b.upload(&w));
            s.b.rope(&mut q2, IDX_HEADS, IDX_DIM, &plan.positions, &rope, false);
            s.b.scale(&mut w2, scale);
            let apart = s.b.index_topk(&kv, &layout, 0, plan, &q2, &w2, IDX_HEADS, TOP_K);
            let (fused, apart) = (g.idx_download(&fused.indices), g.idx_download(&apart.indices));
            let same = fused.iter().zip(&apart).filter(|(a, b)| a == b).count();
            eprintln!("PARITY indexer_select {} keys, {rows} rows: {same}/{} ids identical", dtype.name(), fused.len());
            assert_eq!(fused, apart, "{} keys, {rows} rows: the fused selection differs", dtype.name());
            assert!(fused.iter().any(|&i| i > 0), "nothing selected");
        }
    }
}

/// Prefill-sized batches score on `index_scores_wg` (a block keeps 256 keys of a sequence
/// in registers while its rows stream past them): the same top-512 as the CPU, except
/// where two scores lie within the kernels' rounding, for FP8 and BF16 keys, through
/// `index_topk` and through `indexer_select` (q rotated and the weights scaled inside the
/// launches). The batches: one chunk whose rows see 500 to 650 entries (the last key tile
/// partly visible, differently for each row), and two sequences over different pages
/// whose rows share blocks (the keys reloaded where a block's rows reach the second).
#[test]
fn cuda_indexer_prefill_scores_on_wgmma_match_cpu() {
    let Some(g) = gpu("cuda_indexer_prefill_scores_on_wgmma_match_cpu") else { return };
    let g = &*g;
    let cpu = CpuBackend::new();
    let mut rng = rng("indexer_wg");
    let spec = [LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM, rope_dim: 64 }];
    let yarn = Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 };
    let rope = RopeTable::yarn(160000.0, 64, yarn, 1.0);
    let scale = 0.125 * (IDX_HEADS as f32).powf(-0.5);
    let knob_off = std::env::var("SLUICE_CUDA_INDEXER_WG").is_ok_and(|v| v == "0");
    for dtype in [EntryDtype::Fp8, EntryDtype::Bf16] {
        let layout = KvLayout::new(128, 128, dtype, &spec);
        let ctx = 8192usize;
        let pages = ctx / 128;
        let raw = vec![[vec![0.0; 4 * 2 * HD], vec![1.0; HD], vec![0.0; 4 * 2 * IDX_DIM], vec![1.0; IDX_DIM]]];
        let sinks = vec![0.0; HEADS];
        let mut gs = side(g, &layout, pages, 2, &raw, &sinks);
        let mut cs = side(&cpu, &layout, pages, 2, &raw, &sinks);
        for (at, bytes) in random_index_entries(&mut rng, &layout, pages) {
            gs.b.kv_write(&mut gs.kv.pages, at, &bytes);
            cs.b.kv_write(&mut cs.kv.pages, at, &bytes);
        }
        let table: Vec<u32> = (0..pages as u32).collect();
        let reversed: Vec<u32> = table.iter().rev().copied().collect();
        let toks = vec![0u32; 600];
        let plans = [
            BatchPlan::new(vec![(0, table.clone(), 2000, &toks[..])]),
            BatchPlan::new(vec![(0, table, 6000, &toks[..100]), (1, reversed, 3000, &toks[100..300])]),
        ];
        for plan in &plans {
            let rows = plan.rows();
            assert!(
                knob_off || g.indexer_scores_on_wgmma(&layout, 0, plan, IDX_HEADS),
                "{} keys, {rows} rows: the batch does not take index_scores_wg",
                dtype.name()
            );
            let q = rand_vec(&mut rng, rows * IDX_HEADS * IDX_DIM, 0.3);
            let w = rand_vec(&mut rng, rows * IDX_HEADS, 1.0);
            let (gkv, ckv) = (gs.kv.view(), cs.kv.view());
            let plain = g.idx_download(
                &gs.b.index_topk(&gkv, &layout, 0, plan, &gs.b.upload(&q), &gs.b.upload(&w), IDX_HEADS, TOP_K).indices,
            );
            let cplain = cs.b.index_topk(&ckv, &layout, 0, plan, &q, &w, IDX_HEADS, TOP_K).indices;
            let (mut fq, mut fw) = (gs.b.upload(&q), gs.b.upload(&w));
            let fused = gs.b.indexer_select(&gkv, &layout, 0, plan, &mut fq, &mut fw, IDX_HEADS, TOP_K, &rope, scale);
            let fused = g.idx_download(&fused.indices);
            let (mut cq, mut cw) = (q.clone(), w.clone());
            let cfused = cs.b.indexer_select(&ckv, &layout, 0, plan, &mut cq, &mut cw, IDX_HEADS, TOP_K, &rope, scale);
            for (what, gsel, csel) in [("index_topk", &plain, &cplain), ("indexer_select", &fused, &cfused.indices)] {
                let mut most_off = 0;
                for r in 0..rows {
                    let (gr, cr) = (&gsel[r * TOP_K..(r + 1) * TOP_K], &csel[r * TOP_K..(r + 1) * TOP_K]);
                    let seen = (plan.positions[r] as usize + 1) / 4;
                    // Picks first (ascending), then -1 for the slots past the visible count.
                    let ids = |s: &[i32]| s.iter().copied().filter(|&i| i >= 0).collect::<Vec<i32>>();
                    let (gi, ci) = (ids(gr), ids(cr));
                    let want = seen.min(TOP_K);
                    assert_eq!(gi.len(), want, "{what}, row {r}: {} picks of {seen} entries", gi.len());
                    assert_eq!(ci.len(), want, "{what}, row {r}: the CPU made {} picks", ci.len());
                    assert!(gi.windows(2).all(|p| p[0] < p[1]), "{what}, row {r}: picks not ascending");
                    assert!(gi.iter().all(|&i| (i as usize) < seen), "{what}, row {r}: an unseen entry");
                    let same = gi.iter().filter(|i| ci.binary_search(i).is_ok()).count();
                    assert!(same + 2 >= want, "{what}, row {r}: only {same} of {want} selected entries agree");
                    most_off = most_off.max(want - same);
                }
                eprintln!(
                    "PARITY indexer wgmma {} keys, {what}, {rows} rows: at most {most_off} of a row's picks not the CPU's",
                    dtype.name()
                );
            }
        }
    }
}
