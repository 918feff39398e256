//! Every backend op against `kernels::reference`, through one generic test body.
//!
//! Outputs are poisoned with NaN before each call so an element a backend forgets to
//! write fails the comparison. Sequence-aware ops are driven through uneven chunk
//! schedules with two sequences sharing batches, and compared with reference math
//! over whole token histories. The CUDA backend (feature `cuda`) runs the same `check_*`
//! functions on device 0; without a GPU those tests say they are skipped and pass.

use kernels::backend::{CompressorParams, ExpertWeights, HcHeadWeights, HcWeights, MoeWeights, Routing};
use kernels::kv_entry;
use kernels::quant::{bf16_to_f32, f32_to_bf16};
use kernels::reference as refr;
use kernels::rope::Yarn;
use kernels::stored::{OwnedFormat, OwnedWeight};
use kernels::{
    AttnKind, Backend, BatchPlan, Branch, CpuBackend, EntryDtype, EntryFormat, HostMatrix, KvLayout, KvState,
    LayerSpec, RopeTable,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Allowed max|Δ| / max|ref| per op family, for one activation precision.
struct Tolerances {
    matmul: f32,
    /// Products of 9-64 rows over FP8/FP4 weights: the GPU's decode kernels for 9-32
    /// rows take the activations as f16 alone (11 bits, a power-of-two scale per row and
    /// warp; the reference model computes these projections from bf16 activations), so
    /// they round each activation by up to 2^-12 of its row's range.
    matmul_wide: f32,
    elementwise: f32,
    moe: f32,
    attention: f32,
}

const F32_TOL: Tolerances =
    Tolerances { matmul: 1e-5, matmul_wide: 1e-5, elementwise: 1e-5, moe: 2e-5, attention: 2e-5 };
/// Sequence ops over fp8 entries (either device): both sides store through the same
/// codec, so only an element that f32-vs-f64 arithmetic puts on the other side of an FP8
/// rounding step (1/16 relative) differs.
const FP8_SEQ_TOL: f32 = 1e-2;
/// CUDA: f32 arithmetic in another order (parallel reductions, split-bf16 tensor-core
/// products for many rows, device `expf`/`sincosf`).
#[cfg(feature = "cuda")]
const CUDA_TOL: Tolerances =
    Tolerances { matmul: 1e-4, matmul_wide: 5e-4, elementwise: 1e-5, moe: 1e-4, attention: 1e-4 };

fn rand_vec(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * std * 1.732).collect()
}

fn rand_matrix(rng: &mut ChaCha8Rng, rows: usize, cols: usize, std: f32) -> HostMatrix {
    HostMatrix::new(rows, cols, rand_vec(rng, rows * cols, std))
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    got.iter().zip(want).map(|(g, w)| if g.is_nan() { f32::INFINITY } else { (g - w).abs() }).fold(0f32, f32::max)
        / scale
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:.3e} above {tol:.1e}");
}

fn poisoned<B: Backend>(b: &B, len: usize) -> B::Buf {
    b.upload(&vec![f32::NAN; len])
}

fn check_row_ops<B: Backend>(b: &B, tol: &Tolerances) {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (rows, bf16_exact) in [1, 2, 5, 33].into_iter().flat_map(|r| [(r, false), (r, true)]) {
        // Backends may store bf16-exact weights compactly; cover both kinds, with
        // more output rows than one widening block.
        let mut w = rand_matrix(&mut rng, 300, 45, 0.2);
        if bf16_exact {
            w.data.iter_mut().for_each(|v| *v = bf16_to_f32(f32_to_bf16(*v)));
        }
        let x = rand_vec(&mut rng, rows * 45, 1.0);
        let want = refr::matmul(&x, rows, &w);
        let mut out = poisoned(b, rows * 300);
        b.matmul(&b.upload(&x), rows, &b.weight((&w).into()), &mut out);
        assert_close(&format!("matmul rows={rows} bf16_exact={bf16_exact}"), &b.download(&out), &want, tol.matmul);

        let gw = rand_matrix(&mut rng, 3 * 7, 11, 0.3);
        let gx = rand_vec(&mut rng, rows * 3 * 11, 1.0);
        let want = refr::grouped_matmul(&gx, rows, 3, &gw);
        let mut out = poisoned(b, rows * 21);
        b.grouped_matmul(&b.upload(&gx), rows, 3, &b.weight((&gw).into()), &mut out);
        assert_close(&format!("grouped_matmul rows={rows}"), &b.download(&out), &want, tol.matmul);
    }

    // Weights as checkpoints store them (BF16, FP8 with 128×128 block scales, FP4 with
    // per-32 scales): the reference multiplies by the values they mean. Shapes with
    // partial scale blocks and K that the tensor-core tiles take (96, 256) or not (200).
    for (format, n, k) in [
        (OwnedFormat::Fp4, 300, 96),
        (OwnedFormat::Fp4, 64, 48),
        (OwnedFormat::Fp8, 130, 200),
        (OwnedFormat::Fp8, 256, 256),
        (OwnedFormat::Bf16, 140, 64),
    ] {
        let q = OwnedWeight::quantize(&rand_matrix(&mut rng, n, k, 0.2), format);
        let w = b.weight(q.view());
        for rows in [1, 5, 33, 70] {
            let x = rand_vec(&mut rng, rows * k, 1.0);
            let want = refr::matmul(&x, rows, &q.dequantized());
            let mut out = poisoned(b, rows * n);
            b.matmul(&b.upload(&x), rows, &w, &mut out);
            let wide = (9..=64).contains(&rows) && format != OwnedFormat::Bf16;
            let t = if wide { tol.matmul_wide } else { tol.matmul };
            assert_close(&format!("matmul {format:?} {n}x{k} rows={rows}"), &b.download(&out), &want, t);
        }
    }

    let x = rand_vec(&mut rng, 6 * 40, 3.0);
    let w = rand_vec(&mut rng, 40, 1.0);
    for weight in [None, Some(&w)] {
        let want = refr::rms_norm(&x, 40, weight.map(|w| w.as_slice()), 1e-6);
        let mut buf = b.upload(&x);
        b.rms_norm(&mut buf, 40, weight.map(|w| b.upload(w)).as_ref(), 1e-6);
        assert_close("rms_norm", &b.download(&buf), &want, tol.elementwise);
    }

    let yarn = Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 };
    for table in [RopeTable::plain(10000.0, 8), RopeTable::yarn(160000.0, 8, yarn, 1.0)] {
        for inverse in [false, true] {
            let positions: Vec<u32> = (0..5).map(|_| rng.random_range(0..70000)).collect();
            let x = rand_vec(&mut rng, 5 * 3 * 16, 1.0);
            let want = refr::rope(&x, 3, 16, &positions, &table, inverse);
            let mut buf = b.upload(&x);
            b.rope(&mut buf, 3, 16, &positions, &table, inverse);
            assert_close("rope", &b.download(&buf), &want, tol.elementwise);
        }
    }
    // Norm + RoPE of heads, the shapes a backend may fuse (head_dim a multiple of 128)
    // and one it may not, with and without a weight.
    for (heads, hd, pairs) in [(3, 256, 32), (2, 48, 8)] {
        let table = RopeTable::yarn(160000.0, 2 * pairs, yarn, 1.0);
        let positions: Vec<u32> = (0..5).map(|_| rng.random_range(0..70000)).collect();
        let x = rand_vec(&mut rng, 5 * heads * hd, 2.0);
        let w = rand_vec(&mut rng, hd, 1.0);
        for weight in [None, Some(&w)] {
            let normed = refr::rms_norm(&x, hd, weight.map(|w| w.as_slice()), 1e-6);
            let want = refr::rope(&normed, heads, hd, &positions, &table, false);
            let mut buf = b.upload(&x);
            let wb = weight.map(|w| b.upload(w));
            b.head_norm_rope(&mut buf, heads, hd, wb.as_ref(), 1e-6, &positions, &table, None);
            assert_close(&format!("head_norm_rope {heads}x{hd}"), &b.download(&buf), &want, tol.elementwise);
        }
    }
}

fn check_hc<B: Backend>(b: &B, tol: &Tolerances) {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (hc, d, rows) = (4, 24, 3);
    let mix = rand_matrix(&mut rng, (2 + hc) * hc, hc * d, 0.1);
    let base = rand_vec(&mut rng, (2 + hc) * hc, 0.5);
    let scale = [0.7, 1.3, 0.9];
    let streams = rand_vec(&mut rng, rows * hc * d, 1.0);
    let out = rand_vec(&mut rng, rows * d, 1.0);
    let w = b.hc_weights(HcWeights::<B> {
        mix: b.weight((&mix).into()),
        base: base.clone(),
        scale,
        hc,
        hidden: d,
        sinkhorn_iters: 20,
        norm_eps: 1e-6,
        hc_eps: 1e-6,
    });
    let (mut col, mut post, mut comb) = (poisoned(b, rows * d), poisoned(b, rows * hc), poisoned(b, rows * hc * hc));
    let sbuf = b.upload(&streams);
    b.hc_pre(&sbuf, rows, &w, None, &mut col, &mut post, &mut comb);
    let mut next = b.upload(&streams);
    b.hc_post(&mut next, rows, hc, &b.upload(&out), &post, &comb);
    // The sub-block's input norm taken by hc_pre.
    let norm_w = rand_vec(&mut rng, d, 1.0);
    let mut normed = poisoned(b, rows * d);
    let (mut post2, mut comb2) = (poisoned(b, rows * hc), poisoned(b, rows * hc * hc));
    b.hc_pre(&sbuf, rows, &w, Some((&b.upload(&norm_w), 1e-6)), &mut normed, &mut post2, &mut comb2);
    assert_eq!(b.download(&post2), b.download(&post), "hc_pre's post does not depend on the norm");
    assert_eq!(b.download(&comb2), b.download(&comb), "hc_pre's comb does not depend on the norm");

    let (mut want_col, mut want_next) = (Vec::new(), Vec::new());
    for r in 0..rows {
        let s = &streams[r * hc * d..(r + 1) * hc * d];
        let (pre, post, comb) = refr::hc_mapping(s, hc, &mix, &base, scale, 20, 1e-6, 1e-6);
        want_col.extend(refr::collapse(s, hc, &pre));
        want_next.extend(refr::expand(s, hc, &out[r * d..(r + 1) * d], &post, &comb));
    }
    assert_close("hc_pre collapsed", &b.download(&col), &want_col, tol.elementwise);
    let want_normed = refr::rms_norm(&want_col, d, Some(&norm_w), 1e-6);
    assert_close("hc_pre collapsed, normed", &b.download(&normed), &want_normed, tol.elementwise);
    assert_close("hc_post streams", &b.download(&next), &want_next, tol.elementwise);

    let hmix = rand_matrix(&mut rng, hc, hc * d, 0.1);
    let hbase = rand_vec(&mut rng, hc, 0.5);
    let head = b.hc_head_weights(HcHeadWeights::<B> {
        mix: b.weight((&hmix).into()),
        base: hbase.clone(),
        scale: 1.1,
        hc,
        hidden: d,
        norm_eps: 1e-6,
        hc_eps: 1e-6,
    });
    let mut got = poisoned(b, rows * d);
    b.hc_head(&sbuf, rows, &head, &mut got);
    let want: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let s = &streams[r * hc * d..(r + 1) * hc * d];
            refr::collapse(s, hc, &refr::hc_head_weights(s, hc, &hmix, &hbase, 1.1, 1e-6, 1e-6))
        })
        .collect();
    assert_close("hc_head", &b.download(&got), &want, tol.elementwise);
}

fn check_moe<B: Backend>(b: &B, tol: &Tolerances) {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let (d, inter, n_exp, k, rows) = (24, 16, 6, 2, 5);
    let gate = rand_matrix(&mut rng, n_exp, d, 0.5);
    let experts: Vec<[HostMatrix; 3]> = (0..n_exp)
        .map(|_| {
            [
                rand_matrix(&mut rng, inter, d, 0.6),
                rand_matrix(&mut rng, d, inter, 0.3),
                rand_matrix(&mut rng, inter, d, 0.6),
            ]
        })
        .collect();
    let shared = [
        rand_matrix(&mut rng, inter, d, 0.6),
        rand_matrix(&mut rng, d, inter, 0.3),
        rand_matrix(&mut rng, inter, d, 0.6),
    ];
    let bias = rand_vec(&mut rng, n_exp, 0.3);
    let tid2eid: Vec<u32> = (0..10 * k).map(|i| ((i * 5 + i / k) % n_exp) as u32).collect();
    let x = rand_vec(&mut rng, rows * d, 1.0);
    let tokens: Vec<u32> = (0..rows as u32).map(|r| (r * 3) % 10).collect();
    let limit = 1.5; // small enough that the clamps change results

    // The whole block on one device, then the part a device of an expert-parallel
    // layout computes: experts 2..5 only, the shared expert on rows 1..3 only.
    for (hash, held, shared_rows) in
        [(false, 0..n_exp, 0..rows), (true, 0..n_exp, 0..rows), (false, 2..5, 1..3), (true, 2..5, 1..3)]
    {
        let to_b = |m: &[HostMatrix; 3]| ExpertWeights::<B> {
            w1: b.weight((&m[0]).into()),
            w2: b.weight((&m[1]).into()),
            w3: b.weight((&m[2]).into()),
        };
        let w = b.moe_weights(MoeWeights::<B> {
            gate: b.weight((&gate).into()),
            routing: if hash {
                Routing::Hash { tid2eid: tid2eid.clone() }
            } else {
                Routing::TopK { bias: bias.clone() }
            },
            experts: experts[held.clone()].iter().map(to_b).collect(),
            expert_base: held.start,
            shared: Some(to_b(&shared)),
            top_k: k,
            route_scale: 1.5,
            swiglu_limit: limit,
        });
        let mut out = poisoned(b, rows * d);
        b.moe(&b.upload(&x), rows, &tokens, &w, shared_rows.clone(), &mut out);
        let logits = refr::matmul(&x, rows, &gate);
        let mut want = Vec::new();
        for r in 0..rows {
            let xr = &x[r * d..(r + 1) * d];
            let t = tokens[r] as usize;
            let hash_row = hash.then(|| &tid2eid[t * k..(t + 1) * k]);
            let chosen = refr::route(&logits[r * n_exp..(r + 1) * n_exp], k, Some(&bias), hash_row, 1.5);
            let mut acc = if shared_rows.contains(&r) {
                refr::swiglu(xr, &shared[0], &shared[1], &shared[2], limit)
            } else {
                vec![0.0; d]
            };
            for (e, wt) in chosen.into_iter().filter(|(e, _)| held.contains(e)) {
                let y = refr::swiglu(xr, &experts[e][0], &experts[e][1], &experts[e][2], limit);
                acc.iter_mut().zip(&y).for_each(|(a, v)| *a += (*v as f64 * wt) as f32);
            }
            want.extend(acc);
        }
        let name = format!("moe {} experts {held:?} shared rows {shared_rows:?}", if hash { "hash" } else { "top-k" });
        assert_close(&name, &b.download(&out), &want, tol.moe);
    }
}

/// Token history of one sequence for one layer.
struct History {
    new_kv: Vec<f32>,
    q: Vec<f32>,
    main_kv: Vec<f32>,
    main_score: Vec<f32>,
    idx_kv: Vec<f32>,
    idx_score: Vec<f32>,
    idx_q: Vec<f32>,
    idx_w: Vec<f32>,
}

const HEADS: usize = 3;
const HD: usize = 16;
const IDX_HEADS: usize = 4;
const IDX_DIM: usize = 8;
const TOP_K: usize = 3;

/// What storing entries in `fmt` keeps of them (the shared codec, the same for every
/// backend: what the reference attends to and what pages must decode to).
fn stored(v: &[f32], fmt: &EntryFormat) -> Vec<f32> {
    let mut v = v.to_vec();
    kv_entry::round(fmt, &mut v);
    v
}

fn check_sequence_ops<B: Backend>(b: &B, dtype: EntryDtype, tol: f32) {
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let specs = [
        LayerSpec { kind: AttnKind::Window, ratio: 0, head_dim: HD, index_dim: 0, rope_dim: 8 },
        LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM, rope_dim: 8 },
        LayerSpec { kind: AttnKind::Hca, ratio: 16, head_dim: HD, index_dim: 0, rope_dim: 8 },
    ];
    let (block, window) = (16, 8);
    let layout = KvLayout::new(block, window, dtype, &specs);
    let table = RopeTable::plain(10000.0, 8);
    let lengths = [45usize, 37];
    let slots = [1usize, 0];
    let page_tables: [Vec<u32>; 2] = [vec![0, 1, 2], vec![5, 3, 4]];
    let schedules: [&[usize]; 2] = [&[1, 7, 16, 3, 18], &[5, 1, 1, 30]];

    // Per sequence, per layer histories.
    let hist: Vec<Vec<History>> = lengths
        .iter()
        .map(|&t| {
            specs
                .iter()
                .map(|s| {
                    let cw = if s.kind == AttnKind::Csa { 2 * HD } else { HD };
                    History {
                        new_kv: stored(&rand_vec(&mut rng, t * HD, 1.0), &layout.layers[0].main),
                        q: rand_vec(&mut rng, t * HEADS * HD, 0.5),
                        main_kv: rand_vec(&mut rng, t * cw, 1.0),
                        main_score: rand_vec(&mut rng, t * cw, 1.5),
                        idx_kv: rand_vec(&mut rng, t * 2 * IDX_DIM, 1.0),
                        idx_score: rand_vec(&mut rng, t * 2 * IDX_DIM, 1.5),
                        idx_q: rand_vec(&mut rng, t * IDX_HEADS * IDX_DIM, 1.0),
                        idx_w: rand_vec(&mut rng, t * IDX_HEADS, 1.0),
                    }
                })
                .collect()
        })
        .collect();
    let params: Vec<[Vec<f32>; 4]> = specs
        .iter()
        .map(|s| {
            let cw = if s.kind == AttnKind::Csa { 2 * HD } else { HD };
            let ratio = s.ratio.max(1);
            [
                rand_vec(&mut rng, ratio * cw, 0.7),
                rand_vec(&mut rng, HD, 0.2).iter().map(|v| v + 1.0).collect(),
                rand_vec(&mut rng, ratio * 2 * IDX_DIM, 0.7),
                rand_vec(&mut rng, IDX_DIM, 0.2).iter().map(|v| v + 1.0).collect(),
            ]
        })
        .collect();
    let sinks = rand_vec(&mut rng, HEADS, 1.0);

    // Reference entries from whole histories.
    let entries = |s: usize, l: usize, branch: Branch| -> Vec<Vec<f32>> {
        let h = &hist[s][l];
        let spec = &specs[l];
        let (kv, sc, width, p) = match branch {
            Branch::Main => (&h.main_kv, &h.main_score, if spec.kind == AttnKind::Csa { 2 * HD } else { HD }, 0),
            Branch::Indexer => (&h.idx_kv, &h.idx_score, 2 * IDX_DIM, 2),
        };
        refr::compressed_entries(
            kv,
            sc,
            width,
            &params[l][p],
            spec.ratio,
            spec.kind == AttnKind::Csa,
            &params[l][p + 1],
            1e-6,
            &table,
        )
        .iter()
        .map(|e| stored(e, &layout.layers[l].format(branch)))
        .collect()
    };

    let mut kv = KvState::<B> {
        pages: b.kv_alloc(6 * layout.page_elems, dtype),
        rings: b.kv_alloc(2 * layout.ring_elems, dtype),
        comp: b.kv_alloc(2 * layout.comp_elems, EntryDtype::F32),
    };
    let ape: Vec<[B::Buf; 4]> =
        params.iter().map(|p| [b.upload(&p[0]), b.upload(&p[1]), b.upload(&p[2]), b.upload(&p[3])]).collect();
    let sinks_b = b.upload(&sinks);

    let mut done = [0usize; 2];
    let mut step = 0;
    while done != lengths {
        // Both sequences share each step while they both have chunks left.
        let mut parts = Vec::new();
        let mut picks = Vec::new();
        for s in 0..2 {
            if let Some(&c) = schedules[s].get(step) {
                let c = c.min(lengths[s] - done[s]);
                if c > 0 {
                    picks.push((s, done[s], c));
                }
            } else if done[s] < lengths[s] {
                picks.push((s, done[s], lengths[s] - done[s]));
            }
        }
        let toks: Vec<Vec<u32>> = picks.iter().map(|&(_, _, c)| vec![0; c]).collect();
        for (i, &(s, start, _)) in picks.iter().enumerate() {
            parts.push((slots[s], page_tables[s].clone(), start, toks[i].as_slice()));
        }
        let plan = BatchPlan::new(parts);
        let gather = |l: usize, f: &dyn Fn(&History) -> &Vec<f32>, w: usize| -> Vec<f32> {
            picks.iter().flat_map(|&(s, start, c)| f(&hist[s][l])[start * w..(start + c) * w].to_vec()).collect()
        };
        for (l, spec) in specs.iter().enumerate() {
            let new_kv = b.upload(&gather(l, &|h| &h.new_kv, HD));
            let q = gather(l, &|h| &h.q, HEADS * HD);
            let mut selection = None;
            if spec.kind != AttnKind::Window {
                let cw = if spec.kind == AttnKind::Csa { 2 * HD } else { HD };
                let p = CompressorParams::<B> { ape: &ape[l][0], norm: &ape[l][1], eps: 1e-6, rope: &table };
                b.compress(
                    &mut kv.view_mut(),
                    &layout,
                    l,
                    Branch::Main,
                    &plan,
                    &b.upload(&gather(l, &|h| &h.main_kv, cw)),
                    &b.upload(&gather(l, &|h| &h.main_score, cw)),
                    &p,
                );
            }
            if spec.kind == AttnKind::Csa {
                let p = CompressorParams::<B> { ape: &ape[l][2], norm: &ape[l][3], eps: 1e-6, rope: &table };
                b.compress(
                    &mut kv.view_mut(),
                    &layout,
                    l,
                    Branch::Indexer,
                    &plan,
                    &b.upload(&gather(l, &|h| &h.idx_kv, 2 * IDX_DIM)),
                    &b.upload(&gather(l, &|h| &h.idx_score, 2 * IDX_DIM)),
                    &p,
                );
                let sel = b.index_topk(
                    &kv.view(),
                    &layout,
                    l,
                    &plan,
                    &b.upload(&gather(l, &|h| &h.idx_q, IDX_HEADS * IDX_DIM)),
                    &b.upload(&gather(l, &|h| &h.idx_w, IDX_HEADS)),
                    IDX_HEADS,
                    TOP_K,
                );
                selection = Some(sel);
            }
            let mut out = poisoned(b, plan.rows() * HEADS * HD);
            b.attention(
                &kv.view(),
                &layout,
                l,
                &plan,
                &b.upload(&q),
                &new_kv,
                selection.as_ref(),
                &sinks_b,
                HEADS,
                0.25,
                &mut out,
            );
            b.store_window(&mut kv.view_mut(), &layout, l, &plan, &new_kv);

            let got = b.download(&out);
            let got_sel = selection.as_ref().map(|s| b.idx_download(&s.indices));
            let mut row = 0;
            for &(s, start, c) in &picks {
                let h = &hist[s][l];
                let main = if spec.kind != AttnKind::Window { entries(s, l, Branch::Main) } else { vec![] };
                let idx = if spec.kind == AttnKind::Csa { entries(s, l, Branch::Indexer) } else { vec![] };
                for t in start..start + c {
                    let mut keys: Vec<Vec<f32>> =
                        ((t + 1).saturating_sub(window)..=t).map(|p| h.new_kv[p * HD..(p + 1) * HD].to_vec()).collect();
                    match spec.kind {
                        AttnKind::Window => {}
                        AttnKind::Hca => keys.extend(main[..(t + 1) / spec.ratio].iter().cloned()),
                        AttnKind::Csa => {
                            let visible = (t + 1) / spec.ratio;
                            let want = refr::indexer_select(
                                &h.idx_q[t * IDX_HEADS * IDX_DIM..(t + 1) * IDX_HEADS * IDX_DIM],
                                &h.idx_w[t * IDX_HEADS..(t + 1) * IDX_HEADS],
                                &idx,
                                visible,
                                TOP_K,
                            );
                            let got_row: Vec<usize> = got_sel.as_ref().unwrap()[row * TOP_K..(row + 1) * TOP_K]
                                .iter()
                                .filter(|&&i| i >= 0)
                                .map(|&i| i as usize)
                                .collect();
                            assert_eq!(got_row, want, "indexer selection, seq {s} position {t}");
                            keys.extend(want.iter().map(|&i| main[i].clone()));
                        }
                    }
                    let want = refr::attention_row(&h.q[t * HEADS * HD..(t + 1) * HEADS * HD], &keys, &sinks, 0.25);
                    assert_close(
                        &format!("attention layer {l} seq {s} position {t} ({})", dtype.name()),
                        &got[row * HEADS * HD..(row + 1) * HEADS * HD],
                        &want,
                        tol,
                    );
                    row += 1;
                }
            }
        }
        for &(s, _, c) in &picks {
            done[s] += c;
        }
        step += 1;
    }

    // Every complete entry sits in its page, as the reference computes it.
    for (s, table_s) in page_tables.iter().enumerate() {
        for (l, spec) in specs.iter().enumerate() {
            let branches: &[Branch] = match spec.kind {
                AttnKind::Window => &[],
                AttnKind::Hca => &[Branch::Main],
                AttnKind::Csa => &[Branch::Main, Branch::Indexer],
            };
            for &branch in branches {
                let lk = &layout.layers[l];
                let fmt = lk.format(branch);
                let per_page = lk.entries_per_page(block);
                for (i, want) in entries(s, l, branch).iter().enumerate() {
                    let at = table_s[i / per_page] as usize * layout.page_elems
                        + lk.page_offset(branch)
                        + (i % per_page) * lk.stride(branch);
                    let bytes = b.kv_read(&kv.pages, at, lk.stride(branch));
                    let mut got = vec![0f32; fmt.dim];
                    kv_entry::decode(&fmt, &bytes, &mut got);
                    assert_close(&format!("entry {i} layer {l} seq {s} {branch:?}"), &got, want, tol);
                }
            }
        }
    }
}

/// KV checksums summed where the bytes are (`Backend::kv_sums`) equal the reference
/// function over the same bytes: whole ranges of every dtype, ranges at odd offsets and
/// lengths (which a GPU sums on the host), pieces of a whole joined by their word index,
/// and a range of zeros (which still has a non-zero checksum).
fn check_kv_sums<B: Backend>(b: &B) {
    use kernels::backend::SumRange;
    use kernels::kv_checksum::{finish, kv_checksum, partial_sum};
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    for dtype in [EntryDtype::F32, EntryDtype::Bf16, EntryDtype::Fp8] {
        let sz = dtype.size();
        let elems = 1 << 16;
        let bytes: Vec<u8> = (0..elems * sz).map(|_| rng.random::<u8>()).collect();
        let mut kv = b.kv_alloc(elems + 1024, dtype);
        b.kv_write(&mut kv, 0, &bytes);
        b.kv_fence();
        // Page-like ranges, an odd one, one crossing the written bytes into zeros.
        let ranges = [(0, elems), (4096, 8192), (1, 3 * 1024 + 5), (7, 1), (elems - 100, 1124)];
        let sums = b.kv_sums(&kv, &ranges.map(|(o, n)| SumRange::whole(o, n)));
        let mut all = bytes.clone();
        all.extend(vec![0u8; 1024 * sz]);
        for ((o, n), got) in ranges.into_iter().zip(sums) {
            let want = kv_checksum(&all[o * sz..(o + n) * sz]);
            assert_eq!(finish(got, n * sz), want, "{} range {o}+{n}", dtype.name());
        }
        // A whole made of two pieces, the second starting at word `first_word`.
        let (a, c) = (0..2048 / sz, 2048 / sz..(2048 + 5000) / sz);
        let pieces = [
            SumRange::whole(a.start, a.len()),
            SumRange { offset: c.start, elems: c.len(), first_word: (a.len() * sz / 8) as u64 },
        ];
        let p = b.kv_sums(&kv, &pieces);
        let joined = &all[..(a.len() + c.len()) * sz];
        assert_eq!(finish(p[0].wrapping_add(p[1]), joined.len()), kv_checksum(joined), "{} pieces", dtype.name());
        assert_eq!(partial_sum(&all[..a.len() * sz], 0), p[0]);
        let zeros = b.kv_sums(&kv, &[SumRange::whole(elems, 1024)])[0];
        assert_ne!(finish(zeros, 1024 * sz), finish(0, 1024 * sz), "zeros contribute");
    }
}

#[test]
fn cpu_kv_checksums_match_reference() {
    check_kv_sums(&CpuBackend::new());
    // Two CPU "devices": ranges inside one part are summed there, others joined.
    let sharded = kernels::sharded::Sharded::new(
        vec![CpuBackend::new(), CpuBackend::new()],
        Box::new(kernels::sharded::HostCollective),
    );
    check_kv_sums(&sharded);
}

#[test]
fn cpu_row_ops_match_reference() {
    check_row_ops(&CpuBackend::new(), &F32_TOL);
}

#[test]
fn cpu_hyper_connections_match_reference() {
    check_hc(&CpuBackend::new(), &F32_TOL);
}

#[test]
fn cpu_moe_matches_reference() {
    check_moe(&CpuBackend::new(), &F32_TOL);
}

#[test]
fn cpu_sequence_ops_match_reference_f32_storage() {
    check_sequence_ops(&CpuBackend::new(), EntryDtype::F32, F32_TOL.attention);
}

#[test]
fn cpu_sequence_ops_match_reference_bf16_storage() {
    // Entries are rounded to bf16 on both sides; what remains is f32-vs-f64 arithmetic
    // and the odd element whose rounding lands on the other side of a bf16 step.
    check_sequence_ops(&CpuBackend::new(), EntryDtype::Bf16, 1e-2);
}

#[test]
fn cpu_sequence_ops_match_reference_fp8_storage() {
    // Entries go through the same fp8 codec on both sides; what remains is f32-vs-f64
    // arithmetic, and an element whose rounding lands on the other side of an FP8 step.
    check_sequence_ops(&CpuBackend::new(), EntryDtype::Fp8, FP8_SEQ_TOL);
}

#[cfg(feature = "cuda")]
#[path = "common/cuda_gpu.rs"]
mod cuda_gpu;

#[cfg(feature = "cuda")]
mod cuda {
    use super::cuda_gpu::{gpu, gpu_in};
    use super::*;
    use kernels::Activations;

    #[test]
    fn cuda_kv_checksums_match_reference() {
        let Some(b) = gpu("cuda_kv_checksums_match_reference") else { return };
        let b = &*b;
        check_kv_sums(b);
    }

    #[test]
    fn cuda_row_ops_match_reference() {
        let Some(b) = gpu("cuda_row_ops_match_reference") else { return };
        let b = &*b;
        check_row_ops(b, &CUDA_TOL);
    }

    #[test]
    fn cuda_hyper_connections_match_reference() {
        let Some(b) = gpu("cuda_hyper_connections_match_reference") else { return };
        let b = &*b;
        check_hc(b, &CUDA_TOL);
    }

    #[test]
    fn cuda_moe_matches_reference() {
        let Some(b) = gpu("cuda_moe_matches_reference") else { return };
        let b = &*b;
        check_moe(b, &CUDA_TOL);
    }

    #[test]
    fn cuda_sequence_ops_match_reference_f32_storage() {
        let Some(b) = gpu("cuda_sequence_ops_match_reference_f32_storage") else { return };
        let b = &*b;
        check_sequence_ops(b, EntryDtype::F32, CUDA_TOL.attention);
    }

    #[test]
    fn cuda_sequence_ops_match_reference_bf16_storage() {
        let Some(b) = gpu("cuda_sequence_ops_match_reference_bf16_storage") else { return };
        let b = &*b;
        check_sequence_ops(b, EntryDtype::Bf16, 1e-2);
    }

    #[test]
    fn cuda_sequence_ops_match_reference_fp8_storage() {
        let Some(b) = gpu("cuda_sequence_ops_match_reference_fp8_storage") else { return };
        let b = &*b;
        check_sequence_ops(b, EntryDtype::Fp8, FP8_SEQ_TOL);
    }

    /// The serving precision: the tensor-core attention multiplies q and the softmax
    /// weights as one bf16 part each (not hi + lo), held to the bf16 entries' bound.
    #[test]
    fn cuda_sequence_ops_with_bf16_activations_match_reference() {
        let test = "cuda_sequence_ops_with_bf16_activations_match_reference";
        let Some(b) = gpu_in(test, Activations::Bf16) else { return };
        let b = &*b;
        check_sequence_ops(b, EntryDtype::Bf16, 1e-2);
        check_sequence_ops(b, EntryDtype::Fp8, FP8_SEQ_TOL);
    }
}
