//! Sequence-aware ops of one layer (compressors, indexer, attention, rings) on both
//! backends over scheduled batches: chunked prefills, sequences joining, batched decode.

use super::*;

/// Groups of the test's `wo_a` (V4's `o_groups`).
const O_GROUPS: usize = 8;

/// Every compressed entry of `pages` pages, decoded in (page, layer, branch, entry) order.
fn page_entries(layout: &KvLayout, bytes: &[u8], pages: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for p in 0..pages {
        for lk in &layout.layers {
            let branches: &[Branch] = match lk.kind() {
                AttnKind::Window => &[],
                AttnKind::Hca => &[Branch::Main],
                AttnKind::Csa => &[Branch::Main, Branch::Indexer],
            };
            for &br in branches {
                let fmt = lk.format(br);
                for i in 0..lk.entries_per_page(layout.block) {
                    let at = (p * layout.page_elems + lk.page_offset(br) + i * lk.stride(br)) * layout.dtype.size();
                    let n = out.len();
                    out.resize(n + fmt.dim, 0.0);
                    kv_entry::decode(&fmt, &bytes[at..at + fmt.bytes()], &mut out[n..]);
                }
            }
        }
    }
    out
}

/// Random projections of one layer for a batch, shared by both backends.
struct StepInputs {
    main_kv: Vec<f32>,
    main_score: Vec<f32>,
    idx_kv: Vec<f32>,
    idx_score: Vec<f32>,
    idx_q: Vec<f32>,
    idx_w: Vec<f32>,
    q: Vec<f32>,
    new_kv: Vec<f32>,
}

/// Run one layer of one step on a backend: compressors, indexer (optionally forced to a
/// given selection), attention, ring update. Returns (attention output, selection, and
/// with `proj` = (wo_a, groups, wo_b) `attention_projected`'s output).
/// `raw_query`: q is passed raw to `attention_of_raw_query` (head norm and RoPE still to
/// do; the CPU does them first, the GPU's `attention_wg` while staging q). `twice` runs
/// the attention a second time over the same inputs and requires the same bits: a restored prefix reproduces a cold run only if a row's attention does not
/// depend on anything but its inputs and the batch's shape (no races between a block's
/// warps, no order that varies run to run).
#[allow(clippy::too_many_arguments)]
fn run_layer<B: Backend>(
    s: &mut Side<'_, B>,
    layout: &KvLayout,
    l: usize,
    plan: &BatchPlan,
    inp: &StepInputs,
    rope: &RopeTable,
    forced: Option<&[i32]>,
    from: &dyn Fn(&B, &[i32]) -> B::Idx,
    twice: bool,
    raw_query: bool,
    proj: Option<(&B::Weight, usize, &B::Weight)>,
) -> (Vec<f32>, Option<Vec<i32>>, Option<Vec<f32>>) {
    let b = s.b;
    let spec = layout.layers[l].spec;
    let up = |v: &Vec<f32>| b.upload(v);
    if spec.kind != AttnKind::Window {
        let p = CompressorParams::<B> { ape: &s.params[l][0], norm: &s.params[l][1], eps: 1e-6, rope };
        b.compress(&mut s.kv.view_mut(), layout, l, Branch::Main, plan, &up(&inp.main_kv), &up(&inp.main_score), &p);
    }
    let mut sel = None;
    if spec.kind == AttnKind::Csa {
        let p = CompressorParams::<B> { ape: &s.params[l][2], norm: &s.params[l][3], eps: 1e-6, rope };
        b.compress(&mut s.kv.view_mut(), layout, l, Branch::Indexer, plan, &up(&inp.idx_kv), &up(&inp.idx_score), &p);
        let chosen = b.index_topk(&s.kv.view(), layout, l, plan, &up(&inp.idx_q), &up(&inp.idx_w), IDX_HEADS, TOP_K);
        sel = Some(b.idx_download(&chosen.indices));
    }
    let used = match (forced, &sel) {
        (Some(f), _) => Some(Selection::<B> { indices: from(b, f), top_k: TOP_K }),
        (None, Some(own)) => Some(Selection::<B> { indices: from(b, own), top_k: TOP_K }),
        _ => None,
    };
    let new_kv = up(&inp.new_kv);
    // A raw query (`raw_query`) goes through `attention_of_raw_query`, which may norm and
    // rotate it in place: each call gets its own upload.
    let attend = || {
        let mut out = poisoned(b, plan.rows() * HEADS * HD);
        let mut q = up(&inp.q);
        let (view, sel) = (s.kv.view(), used.as_ref());
        if raw_query {
            let prep = QueryPrep { eps: 1e-6, rope };
            b.attention_of_raw_query(
                &view, layout, l, plan, &mut q, &new_kv, sel, &s.sinks, HEADS, 0.044, &prep, &mut out,
            );
        } else {
            b.attention(&view, layout, l, plan, &q, &new_kv, sel, &s.sinks, HEADS, 0.044, &mut out);
        }
        b.download(&out)
    };
    let out = attend();
    // The sub-block's way on to wo_a, where asked: attention again (q uploaded afresh),
    // rotated back and multiplied, before the window rings change.
    let projected = proj.map(|(wo_a, groups, wo_b)| {
        let mut q = up(&inp.q);
        let mut projected = poisoned(b, plan.rows() * b.weight_shape(wo_b).0);
        let prep = QueryPrep { eps: 1e-6, rope };
        let io = AttentionIo {
            q: &mut q,
            new_kv: &new_kv,
            selected: used.as_ref(),
            sinks: &s.sinks,
            heads: HEADS,
            scale: 0.044,
            prep: raw_query.then_some(&prep),
        };
        b.attention_projected(
            &s.kv.view(),
            layout,
            l,
            plan,
            io,
            &OutputProjection { rope, groups, wo_a, wo_b },
            &mut projected,
        );
        b.download(&projected)
    });
    if twice {
        let again = attend();
        let differ = out.iter().zip(&again).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "layer {l}: attention run twice over the same inputs differs in {differ} values");
    }
    b.store_window(&mut s.kv.view_mut(), layout, l, plan, &new_kv);
    (out, sel, projected)
}

/// Indexer scores in f64 from the keys one side stored, for judging a selection.
fn f64_scores<B: Backend>(
    side: &Side<'_, B>,
    layout: &KvLayout,
    l: usize,
    pages: &[u32],
    q: &[f32],
    w: &[f32],
    n: usize,
) -> Vec<f64> {
    let lk = &layout.layers[l];
    let per_page = lk.entries_per_page(layout.block);
    (0..n)
        .map(|i| {
            let at = pages[i / per_page] as usize * layout.page_elems
                + lk.page_offset(Branch::Indexer)
                + (i % per_page) * lk.stride(Branch::Indexer);
            let bytes = side.b.kv_read(&side.kv.pages, at, lk.stride(Branch::Indexer));
            let mut key = vec![0f32; IDX_DIM];
            kv_entry::decode(&lk.index, &bytes, &mut key);
            let key: Vec<f64> = key.into_iter().map(f64::from).collect();
            (0..IDX_HEADS)
                .map(|h| {
                    let dot: f64 = (0..IDX_DIM).map(|d| q[h * IDX_DIM + d] as f64 * key[d]).sum();
                    w[h] as f64 * dot.max(0.0)
                })
                .sum()
        })
        .collect()
}

/// `kv_scale` multiplies the attention entries (and divides q, so the logits keep their
/// size): 2^17 puts every FP8 block's scale past what the tensor-core attention's fast
/// code conversion takes (attention_mma.cu, `TC_FAST_SCALE_MAX`). In `Activations::Bf16`
/// the tensor-core kernels round q and the softmax weights once to bf16 (prefill-sized
/// batches run `attention_wg` on sm_90, which the test asserts), held to the bf16 bound.
fn sequence_ops(dtype: EntryDtype, kv_scale: f32, activations: Activations) {
    let name = format!(
        "cuda_sequence_ops_{}match_cpu_at_flash_shapes_{}{}",
        if activations == Activations::Bf16 { "in_bf16_activations_" } else { "" },
        dtype.name(),
        if kv_scale == 1.0 { String::new() } else { format!("_kv_scale_{kv_scale}") }
    );
    let Some(g) = gpu_in(&name, activations) else { return };
    let g = &*g;
    let bound = if activations == Activations::Bf16 { tol("bf16") } else { tol(dtype.name()) };
    let wgmma = activations == Activations::Bf16
        && g.compute_capability().0 == 9
        && std::env::var("SLUICE_CUDA_ATT_WGMMA").map_or(true, |v| v != "0");
    let mut wg_layers = 0;
    // In bf16 activations with unscaled entries the query goes in raw (its head norm and
    // RoPE folded into attention_wg's staging where that kernel runs); a normed query
    // cannot carry the scaled runs' 2^-17, so those pass it prepared.
    let raw_query = activations == Activations::Bf16 && kv_scale == 1.0;
    let mut folded = 0;
    // Those runs also take the sub-block on to a BF16 wo_a (8 groups of 128 outputs) and
    // wo_b (1024 × 384): attention_projected, whose output goes to wo_a as bf16 rows
    // rotated back and wo_a's to wo_b as bf16 rows cuBLAS stores.
    let wo_a = raw_query.then(|| {
        let w = weight(&mut rng(&format!("{name} wo_a")), O_GROUPS * 128, HEADS * HD / O_GROUPS, 0.02, "bf16");
        let wb = weight(&mut rng(&format!("{name} wo_b")), 384, O_GROUPS * 128, 0.05, "bf16");
        let c = CpuBackend::new();
        ((g.weight(w.view()), g.weight(wb.view())), (c.weight(w.view()), c.weight(wb.view())))
    });
    let mut wo_b_bf16 = 0;
    let (mut projected_bf16, mut worst_projected) = (0, 0f32);
    let mut rng = rng(&name);
    let specs = [
        LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM, rope_dim: 64 },
        LayerSpec { kind: AttnKind::Hca, ratio: 128, head_dim: HD, index_dim: 0, rope_dim: 64 },
        LayerSpec { kind: AttnKind::Window, ratio: 0, head_dim: HD, index_dim: 0, rope_dim: 64 },
    ];
    let layout = KvLayout::new(128, 128, dtype, &specs);
    let yarn = Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 };
    let rope = RopeTable::yarn(160000.0, 64, yarn, 1.0);
    let raw = compressor_params(&mut rng, &specs, 0.5);
    let sinks = rand_vec(&mut rng, HEADS, 1.0);
    let page_tables: [Vec<u32>; 2] = [(0..20).collect(), (20..24).rev().collect()];
    let cpu = CpuBackend::new();
    let mut gs = side(g, &layout, 24, 2, &raw, &sinks);
    let mut cs = side(&cpu, &layout, 24, 2, &raw, &sinks);
    // (seq, chunk) per step: a long prefill in uneven chunks (more CSA candidates than
    // top-k), a short sequence joining, a chunk of 64 rows (few enough that the
    // tensor-core kernels split the keys), then batched decode of both.
    let schedule: Vec<Vec<(usize, usize)>> = vec![
        vec![(0, 1300)],
        vec![(0, 917), (1, 1)],
        vec![(1, 140)],
        vec![(1, 64)],
        vec![(0, 1), (1, 1)],
        vec![(0, 1), (1, 1)],
        vec![(0, 3), (1, 1)],
        vec![(0, 1)],
    ];
    let mut len = [0usize; 2];
    let (mut checked, mut near_ties) = (0, 0);
    let mut worst = 0f32;
    for step in &schedule {
        let toks: Vec<Vec<u32>> = step.iter().map(|&(_, c)| vec![0; c]).collect();
        let plan = BatchPlan::new(
            step.iter().zip(&toks).map(|(&(s, _), t)| (s, page_tables[s].clone(), len[s], t.as_slice())).collect(),
        );
        let rows = plan.rows();
        for (l, spec) in specs.iter().enumerate() {
            let cw = if spec.kind == AttnKind::Csa { 2 * HD } else { HD };
            let round = |mut v: Vec<f32>| -> Vec<f32> {
                kv_entry::round(&layout.layers[l].main, &mut v);
                v
            };
            let inp = StepInputs {
                main_kv: rand_vec(&mut rng, rows * cw, kv_scale),
                main_score: rand_vec(&mut rng, rows * cw, 1.5),
                idx_kv: rand_vec(&mut rng, rows * 2 * IDX_DIM, 1.0),
                idx_score: rand_vec(&mut rng, rows * 2 * IDX_DIM, 1.5),
                idx_q: rand_vec(&mut rng, rows * IDX_HEADS * IDX_DIM, 0.3),
                idx_w: rand_vec(&mut rng, rows * IDX_HEADS, 1.0),
                q: rand_vec(&mut rng, rows * HEADS * HD, 0.3 / kv_scale),
                new_kv: round(rand_vec(&mut rng, rows * HD, kv_scale)),
            };
            let kernel = g.attention_kernel(&layout, l, &plan, HEADS);
            if wgmma && dtype != EntryDtype::F32 && rows >= 64 {
                assert_eq!(kernel, "attention_wg", "{rows} rows of layer {l} ({:?})", spec.kind);
                let folds = std::env::var("SLUICE_CUDA_ATT_WG_QPREP").map_or(true, |v| v != "0");
                assert_eq!(g.attention_preps_query(&layout, l, &plan, HEADS), folds, "{rows} rows of layer {l}");
            }
            wg_layers += usize::from(kernel == "attention_wg");
            folded += usize::from(raw_query && g.attention_preps_query(&layout, l, &plan, HEADS));
            let (gout, gsel, gproj) = run_layer(
                &mut gs,
                &layout,
                l,
                &plan,
                &inp,
                &rope,
                None,
                &|b: &CudaBackend, v| kernels::cuda::CudaIdx::from_host(b, v),
                true,
                raw_query,
                wo_a.as_ref().map(|((gw, gb), _)| (gw, O_GROUPS, gb)),
            );
            // The CPU attends over the GPU's selection, so attention is compared on
            // identical inputs; the selections are compared on their own below.
            let (cout, csel, cproj) = run_layer(
                &mut cs,
                &layout,
                l,
                &plan,
                &inp,
                &rope,
                gsel.as_deref(),
                &|_, v| v.to_vec(),
                false,
                raw_query,
                wo_a.as_ref().map(|(_, (cw, cb))| (cw, O_GROUPS, cb)),
            );
            let e = rel_err(&gout, &cout);
            worst = worst.max(e);
            if e.is_nan() || e > bound {
                let (i, d) = gout
                    .iter()
                    .zip(&cout)
                    .map(|(a, b)| if a.is_nan() { f32::INFINITY } else { (a - b).abs() })
                    .enumerate()
                    .fold((0, 0f32), |m, (i, d)| if d > m.1 { (i, d) } else { m });
                let (row, head, dim) = (i / (HEADS * HD), i / HD % HEADS, i % HD);
                panic!(
                    "attention layer {l} ({:?}) step {step:?}: {e:.3e}; worst at row {row} (position {}) head {head} \
                     dim {dim}: gpu {} cpu {} (|Δ| {d})",
                    spec.kind, plan.positions[row], gout[i], cout[i]
                );
            }
            if let (Some(gp), Some(cp), Some(((gw, gb), _))) = (gproj, cproj, &wo_a) {
                let what = format!("attention → wo_a → wo_b layer {l} ({:?}) step {step:?}", spec.kind);
                check(&what, "bf16", &gp, &cp);
                // The same products from the GPU's own f32 attention output, rotated back
                // and rounded apart: only the rotation's f32 contraction and where wo_a's
                // output is rounded may differ.
                let mut apart = g.upload(&gout);
                g.rope(&mut apart, HEADS, HD, &plan.positions, &rope, true);
                let mut grouped = poisoned(g, rows * O_GROUPS * 128);
                g.grouped_matmul(&apart, rows, O_GROUPS, gw, &mut grouped);
                let mut want = poisoned(g, gp.len());
                g.matmul(&grouped, rows, gb, &mut want);
                let e = rel_err(&gp, &g.download(&want));
                assert!(e <= 1e-3, "{what}: {e:.2e} from the GPU's ops run apart");
                projected_bf16 += usize::from(g.attention_output_in_bf16(rows, O_GROUPS, gw));
                wo_b_bf16 +=
                    usize::from(g.attention_output_in_bf16(rows, O_GROUPS, gw) && g.wo_a_output_in_bf16(rows, gb));
                worst_projected = worst_projected.max(e);
            }
            if let (Some(gsel), Some(csel)) = (gsel, csel) {
                for (r, &pos) in plan.positions.iter().enumerate() {
                    let (gr, cr) = (&gsel[r * TOP_K..(r + 1) * TOP_K], &csel[r * TOP_K..(r + 1) * TOP_K]);
                    if gr == cr {
                        checked += 1;
                        continue;
                    }
                    // The two devices' keys may differ in their last bf16 bit (the
                    // compressors round the same value from slightly different f32s), so
                    // a differing row is judged on the GPU's own keys: its picks must be
                    // that row's top-k, up to exact ties in f32 (every pick scores at
                    // least every candidate left out, to rounding).
                    let owner = plan.row_owner()[r];
                    let s = &plan.seqs[owner];
                    let n = (pos as usize + 1) / 4;
                    let sc = f64_scores(
                        &gs,
                        &layout,
                        l,
                        &s.pages,
                        &inp.idx_q[r * IDX_HEADS * IDX_DIM..(r + 1) * IDX_HEADS * IDX_DIM],
                        &inp.idx_w[r * IDX_HEADS..(r + 1) * IDX_HEADS],
                        n,
                    );
                    let mut picked = vec![false; n];
                    for &id in gr.iter().filter(|&&id| id >= 0) {
                        picked[id as usize] = true;
                    }
                    let picks = picked.iter().filter(|&&p| p).count();
                    assert_eq!(picks, TOP_K.min(n), "row {r}: {picks} distinct picks of {n} candidates");
                    let lowest_pick = (0..n).filter(|&i| picked[i]).map(|i| sc[i]).fold(f64::INFINITY, f64::min);
                    let best_left = (0..n).filter(|&i| !picked[i]).map(|i| sc[i]).fold(f64::NEG_INFINITY, f64::max);
                    let top = sc.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
                    let gap = (best_left - lowest_pick) / top;
                    assert!(
                        gap < 1e-5,
                        "selection at row {r} (position {pos}) leaves out a candidate scoring {gap:.2e} (relative) \
                         above its lowest pick"
                    );
                    near_ties += 1;
                }
            }
        }
        for &(s, c) in step {
            len[s] += c;
        }
    }
    // Every entry written (or left poisoned) the same on both devices.
    let gpages = gs.b.kv_read(&gs.kv.pages, 0, 24 * layout.page_elems);
    let cpages = cs.b.kv_read(&cs.kv.pages, 0, 24 * layout.page_elems);
    let (gp, cp) = (page_entries(&layout, &gpages, 24), page_entries(&layout, &cpages, 24));
    let nan_mismatch = gp.iter().zip(&cp).filter(|(a, b)| a.is_nan() != b.is_nan()).count();
    assert_eq!(nan_mismatch, 0, "entries written on one device only");
    let written: Vec<(f32, f32)> = gp.iter().zip(&cp).filter(|(a, _)| !a.is_nan()).map(|(a, b)| (*a, *b)).collect();
    assert!(!written.is_empty());
    let (ga, ca): (Vec<f32>, Vec<f32>) = written.into_iter().unzip();
    if dtype == EntryDtype::Fp8 {
        check_fp8_entries(&ga, &ca);
    } else {
        check("compressed entries", dtype.name(), &ga, &ca);
    }
    // This step's new_kv went through the same codec on both devices: same bytes.
    let grings = gs.b.kv_read(&gs.kv.rings, 0, 2 * layout.ring_elems);
    let crings = cs.b.kv_read(&cs.kv.rings, 0, 2 * layout.ring_elems);
    assert!(grings == crings, "window rings hold the same stored bytes");
    let gcomp = gs.b.kv_read(&gs.kv.comp, 0, 2 * layout.comp_elems);
    let ccomp = cs.b.kv_read(&cs.kv.comp, 0, 2 * layout.comp_elems);
    assert_eq!(gcomp, ccomp, "compressor rings hold the same bytes (copies of the inputs)");
    eprintln!(
        "PARITY attention {}{} {activations}: {worst:.2e} ({wg_layers} layer steps on attention_wg)",
        dtype.name(),
        if kv_scale == 1.0 { "" } else { " (scaled)" }
    );
    assert!(!wgmma || wg_layers > 0, "no batch ran attention_wg");
    if raw_query {
        eprintln!(
            "PARITY attention → wo_a {}: {projected_bf16} layer steps with bf16 output rows, {worst_projected:.1e} from \
             the ops apart",
            dtype.name()
        );
        assert!(projected_bf16 > 0, "no batch handed wo_a bf16 rows");
        eprintln!(
            "PARITY attention → wo_a → wo_b {}: {wo_b_bf16} layer steps with wo_a's output in bf16",
            dtype.name()
        );
        let hands = std::env::var("SLUICE_CUDA_WO_A_BF16_OUT").map_or(true, |v| v != "0");
        assert_eq!(wo_b_bf16 > 0, hands, "wo_a handed wo_b bf16 rows in {wo_b_bf16} layer steps");
        eprintln!("PARITY attention {}: {folded} layer steps with the query prepared in attention_wg", dtype.name());
        let folds = std::env::var("SLUICE_CUDA_ATT_WG_QPREP").map_or(true, |v| v != "0");
        assert!(!(wgmma && folds) || folded > 0, "no batch folded the query's prep into attention_wg");
    }
    eprintln!(
        "PARITY indexer-selection {}: {checked} rows identical to the CPU's, {near_ties} differing rows each the \
         top-k of the GPU's keys up to f32 ties",
        dtype.name()
    );
    assert!(checked > 0);
}

#[test]
fn cuda_sequence_ops_match_cpu_at_flash_shapes_f32() {
    sequence_ops(EntryDtype::F32, 1.0, Activations::Split);
}

#[test]
fn cuda_sequence_ops_match_cpu_at_flash_shapes_bf16() {
    sequence_ops(EntryDtype::Bf16, 1.0, Activations::Split);
}

#[test]
fn cuda_sequence_ops_match_cpu_at_flash_shapes_fp8() {
    sequence_ops(EntryDtype::Fp8, 1.0, Activations::Split);
}

/// Entries whose FP8 block scales are above 2^7: the tensor-core attention's keys then
/// take its f32 code conversion.
#[test]
fn cuda_sequence_ops_match_cpu_at_flash_shapes_fp8_wide_scales() {
    sequence_ops(EntryDtype::Fp8, 131072.0, Activations::Split);
}

/// The serving precision: prefill-sized batches on the warpgroup attention (sm_90).
#[test]
fn cuda_sequence_ops_in_bf16_activations_match_cpu_at_flash_shapes_bf16() {
    sequence_ops(EntryDtype::Bf16, 1.0, Activations::Bf16);
}

#[test]
fn cuda_sequence_ops_in_bf16_activations_match_cpu_at_flash_shapes_fp8() {
    sequence_ops(EntryDtype::Fp8, 1.0, Activations::Bf16);
}

/// The warpgroup attention's f32 code conversion (FP8 block scales above 2^7).
#[test]
fn cuda_sequence_ops_in_bf16_activations_match_cpu_at_flash_shapes_fp8_wide_scales() {
    sequence_ops(EntryDtype::Fp8, 131072.0, Activations::Bf16);
}

/// Compressed fp8 entries of the two devices: the compressors' f32 sums differ in their
/// last bits, which moves the rare value across an FP8 rounding step (or a block's
/// maximum across a power of two). So: almost every value identical, and every other one
/// at most one FP8 step away (an e4m3 step is at most 1/8 of the value, 2^-9 of the
/// block's scale below the normal range).
fn check_fp8_entries(g: &[f32], c: &[f32]) {
    let top = c.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut differ = 0usize;
    for (i, (a, b)) in g.iter().zip(c).enumerate() {
        if a == b {
            continue;
        }
        differ += 1;
        let step = a.abs().max(b.abs()) / 8.0 + top * 2f32.powi(-18);
        assert!((a - b).abs() <= step, "fp8 entry value {i}: gpu {a} cpu {b}, more than one FP8 step apart");
    }
    let frac = differ as f64 / g.len() as f64;
    eprintln!("PARITY compressed entries fp8: {differ} of {} values one FP8 step apart", g.len());
    assert!(frac <= 1e-3, "{differ} of {} fp8 entry values differ between the devices", g.len());
}

/// Compressors inside a restored prefix (`pages_final_until`) refill their rings but
/// leave the prefix's entries alone, on both devices.
#[test]
fn cuda_compressor_respects_pages_final_until() {
    let Some(g) = gpu("cuda_compressor_respects_pages_final_until") else { return };
    let g = &*g;
    let cpu = CpuBackend::new();
    let mut rng = rng("pages_final_until");
    let spec = [LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM, rope_dim: 64 }];
    let layout = KvLayout::new(128, 128, EntryDtype::F32, &spec);
    let raw = vec![[
        rand_vec(&mut rng, 4 * 2 * HD, 0.5),
        vec![1.0; HD],
        rand_vec(&mut rng, 4 * 2 * IDX_DIM, 0.5),
        vec![1.0; IDX_DIM],
    ]];
    let sinks = vec![0.0; HEADS];
    let mut gs = side(g, &layout, 3, 1, &raw, &sinks);
    let mut cs = side(&cpu, &layout, 3, 1, &raw, &sinks);
    let rope = RopeTable::plain(160000.0, 64);
    let toks = vec![0u32; 100];
    let mut plan = BatchPlan::new(vec![(0, vec![0, 1, 2], 200, &toks)]);
    plan.seqs[0].pages_final_until = 256;
    let kvp = rand_vec(&mut rng, 100 * 2 * HD, 1.0);
    let scp = rand_vec(&mut rng, 100 * 2 * HD, 1.0);
    for s in [&mut gs as &mut dyn CompressSide, &mut cs] {
        s.compress_main(&layout, &plan, &kvp, &scp, &rope);
    }
    let gp: Vec<f32> = bytemuck::pod_collect_to_vec(&gs.b.kv_read(&gs.kv.pages, 0, 3 * layout.page_elems));
    let cp: Vec<f32> = bytemuck::pod_collect_to_vec(&cs.b.kv_read(&cs.kv.pages, 0, 3 * layout.page_elems));
    let entry = |i: usize| (i / 32) * layout.page_elems + (i % 32) * HD;
    for i in 50..75 {
        let (g, c) = (&gp[entry(i)..entry(i) + HD], &cp[entry(i)..entry(i) + HD]);
        // Entries 50..63 end at or before position 256: kept (poisoned); 64.. written.
        assert_eq!(g.iter().all(|v| v.is_nan()), i < 64, "GPU entry {i}");
        assert_eq!(c.iter().all(|v| v.is_nan()), i < 64, "CPU entry {i}");
        if i >= 64 {
            check(&format!("entry {i} after pages_final_until"), "f32", g, c);
        }
    }
}

/// The compressors over batches longer than the GPU holds blocks at once (so a block
/// pools several entries in turn), with sequences that start mid-window and read their
/// rings between long prefills: every entry and ring byte as on the CPU. HCA at ratio
/// 128 (8 chunks an entry, merged by the entry's last block) and at ratio 256 (16
/// chunks: the merge takes more than one round of partials).
#[test]
fn cuda_compressor_long_batches_match_cpu() {
    let Some(g) = gpu("cuda_compressor_long_batches_match_cpu") else { return };
    let g = &*g;
    let cpu = CpuBackend::new();
    let mut rng = rng("compressor_long_batches");
    let specs = [
        LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM, rope_dim: 64 },
        LayerSpec { kind: AttnKind::Hca, ratio: 128, head_dim: HD, index_dim: 0, rope_dim: 64 },
        LayerSpec { kind: AttnKind::Hca, ratio: 256, head_dim: HD, index_dim: 0, rope_dim: 64 },
    ];
    let layout = KvLayout::new(256, 128, EntryDtype::F32, &specs);
    let raw = compressor_params(&mut rng, &specs, 0.5);
    let sinks = vec![0.0; HEADS];
    // Pages of 256 tokens: sequence 0 (8,195 tokens) 0..33, sequence 1 (3,302) 33..46
    // reversed, sequence 2 (5) 46.
    let tables: [Vec<u32>; 3] = [(0..33).collect(), (33..46).rev().collect(), vec![46]];
    let mut gs = side(g, &layout, 47, 3, &raw, &sinks);
    let mut cs = side(&cpu, &layout, 47, 3, &raw, &sinks);
    let yarn = Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 };
    let rope = RopeTable::yarn(160000.0, 64, yarn, 1.0);
    let steps: [&[(usize, usize, usize)]; 3] =
        [&[(1, 0, 301)], &[(0, 0, 8192), (1, 301, 3000), (2, 0, 5)], &[(1, 3301, 1), (0, 8192, 3)]];
    for step in steps {
        let toks: Vec<Vec<u32>> = step.iter().map(|&(_, _, n)| vec![0; n]).collect();
        let plan = BatchPlan::new(
            step.iter().zip(&toks).map(|(&(s, at, _), t)| (s, tables[s].clone(), at, t.as_slice())).collect(),
        );
        let rows = plan.rows();
        for (l, spec) in specs.iter().enumerate() {
            let cw = if spec.kind == AttnKind::Csa { 2 * HD } else { HD };
            let branches: &[(Branch, usize)] = if spec.kind == AttnKind::Csa {
                &[(Branch::Main, cw), (Branch::Indexer, 2 * IDX_DIM)]
            } else {
                &[(Branch::Main, cw)]
            };
            for &(branch, width) in branches {
                let kv = rand_vec(&mut rng, rows * width, 1.0);
                let sc = rand_vec(&mut rng, rows * width, 1.5);
                let k = if branch == Branch::Main { 0 } else { 2 };
                let p = CompressorParams::<CudaBackend> {
                    ape: &gs.params[l][k],
                    norm: &gs.params[l][k + 1],
                    eps: 1e-6,
                    rope: &rope,
                };
                g.compress(&mut gs.kv.view_mut(), &layout, l, branch, &plan, &g.upload(&kv), &g.upload(&sc), &p);
                let p = CompressorParams::<CpuBackend> {
                    ape: &cs.params[l][k],
                    norm: &cs.params[l][k + 1],
                    eps: 1e-6,
                    rope: &rope,
                };
                cpu.compress(&mut cs.kv.view_mut(), &layout, l, branch, &plan, &kv, &sc, &p);
            }
        }
    }
    let gp: Vec<f32> = bytemuck::pod_collect_to_vec(&gs.b.kv_read(&gs.kv.pages, 0, 47 * layout.page_elems));
    let cp: Vec<f32> = bytemuck::pod_collect_to_vec(&cs.b.kv_read(&cs.kv.pages, 0, 47 * layout.page_elems));
    let nan_mismatch = gp.iter().zip(&cp).filter(|(a, b)| a.is_nan() != b.is_nan()).count();
    assert_eq!(nan_mismatch, 0, "entries written on one device only");
    let (ga, ca): (Vec<f32>, Vec<f32>) = gp.iter().zip(&cp).filter(|(a, _)| !a.is_nan()).map(|(a, b)| (*a, *b)).unzip();
    // Sequences of 8,195, 3,302 and 5 tokens: CSA 2,048 + 825 + 1 entries of 512 + 128
    // values, HCA 64 + 25 entries of 512 at ratio 128 and 32 + 12 at ratio 256.
    let expected = (2048 + 825 + 1) * (HD + IDX_DIM) + (64 + 25 + 32 + 12) * HD;
    assert_eq!(ga.len(), expected, "entries written");
    check("compressed entries, long batches", "f32", &ga, &ca);
    let gcomp = gs.b.kv_read(&gs.kv.comp, 0, 3 * layout.comp_elems);
    let ccomp = cs.b.kv_read(&cs.kv.comp, 0, 3 * layout.comp_elems);
    assert_eq!(gcomp, ccomp, "compressor rings hold the same bytes (copies of the inputs)");
}

/// Lets one loop drive the compressor on either backend.
trait CompressSide {
    fn compress_main(&mut self, layout: &KvLayout, plan: &BatchPlan, kv: &[f32], sc: &[f32], rope: &RopeTable);
}

impl<B: Backend> CompressSide for Side<'_, B> {
    fn compress_main(&mut self, layout: &KvLayout, plan: &BatchPlan, kv: &[f32], sc: &[f32], rope: &RopeTable) {
        let p = CompressorParams::<B> { ape: &self.params[0][0], norm: &self.params[0][1], eps: 1e-6, rope };
        let (kv, sc) = (self.b.upload(kv), self.b.upload(sc));
        self.b.compress(&mut self.kv.view_mut(), layout, 0, Branch::Main, plan, &kv, &sc, &p);
    }
}
