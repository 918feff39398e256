//! Every CUDA kernel against its CPU counterpart at DeepSeek-V4-Flash sizes (hidden
//! 4096, 64 heads × 512, q_lora 1024, indexer 64 × 128, top-k 512, window 128, 4 mHC
//! streams), on fresh random inputs, with outputs poisoned (NaN) before each call so an
//! element the GPU forgets to write fails. The CPU backend is itself checked against
//! the f64 reference by `parity.rs`; this suite covers the shapes and code paths only
//! large problems reach (vector loads, split-K products, tensor-core GEMMs, key-axis
//! splits, radix select over hundreds of candidates, FP8 weights).
//!
//! Each check prints `PARITY <op> <dtype> <observed error>`; tolerances are per dtype in
//! [`TOLERANCES`]. Without a GPU every test prints that it is skipped and passes.
#![cfg(feature = "cuda")]

use std::sync::OnceLock;

use kernels::backend::{CompressorParams, ExpertWeights, HcHeadWeights, HcWeights, MoeWeights, Routing, Selection};
use kernels::cuda::CudaBackend;
use kernels::quant::{bf16_to_f32, dequant_fp8_blocks, f32_to_bf16, quantize_fp8_blocks, ue8m0_to_f32};
use kernels::rope::Yarn;
use kernels::{
    AttnKind, Backend, BatchPlan, Branch, CpuBackend, EntryDtype, HostMatrix, KvLayout, KvState, LayerSpec, RopeTable,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Allowed max|Δ|/max|CPU| by the dtype of the weights or KV entries involved. f32
/// differs only in summation order; bf16 and FP8 paths store the same rounded values on
/// both devices, so they land far below the 1e-2 the issue allows, which is what is
/// asserted for them.
const TOLERANCES: [(&str, f32); 3] = [("f32", 1e-4), ("bf16", 1e-2), ("fp8", 1e-2)];

fn tol(dtype: &str) -> f32 {
    TOLERANCES.iter().find(|(d, _)| *d == dtype).map(|t| t.1).expect("dtype in the table")
}

fn gpu(test: &str) -> Option<&'static CudaBackend> {
    static B: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    match B.get_or_init(|| CudaBackend::new(0).map_err(|e| e.to_string())) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            None
        }
    }
}

fn rng(test: &str) -> ChaCha8Rng {
    // Fresh inputs on every run, reproducible from the printed seed.
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    eprintln!("{test}: seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

fn rand_vec(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * std * 1.732).collect()
}

/// A weight whose values are exactly those of `dtype` storage.
fn weight(rng: &mut ChaCha8Rng, rows: usize, cols: usize, std: f32, dtype: &str) -> HostMatrix {
    let mut v = rand_vec(rng, rows * cols, std);
    match dtype {
        "f32" => {}
        "bf16" => v.iter_mut().for_each(|x| *x = bf16_to_f32(f32_to_bf16(*x))),
        "fp8" => {
            let (q, s) = quantize_fp8_blocks(&v, rows, cols, (128, 128));
            let scales: Vec<f32> = s.iter().map(|&b| ue8m0_to_f32(b)).collect();
            let grid = (rows.div_ceil(128), cols.div_ceil(128));
            v = dequant_fp8_blocks(&q, rows, cols, &scales, grid, (128, 128)).unwrap();
        }
        other => panic!("no dtype {other}"),
    }
    HostMatrix::new(rows, cols, v)
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

fn poisoned<B: Backend>(b: &B, len: usize) -> B::Buf {
    b.upload(&vec![f32::NAN; len])
}

#[test]
fn cuda_products_match_cpu_at_flash_shapes() {
    let Some(g) = gpu("cuda_products_match_cpu_at_flash_shapes") else { return };
    let c = CpuBackend::new();
    let mut rng = rng("products");
    // (outputs, inputs): wq_a, wq_b, the mHC mix (few outputs, long rows), an odd shape.
    for (n, k) in [(1024, 4096), (8192, 1024), (24, 16384), (200, 136)] {
        for dtype in ["f32", "bf16", "fp8"] {
            let w = weight(&mut rng, n, k, 0.05, dtype);
            let (gw, cw) = (g.weight(w.clone()), c.weight(w));
            for rows in [1, 3, 8, 20, 33] {
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
        let (gw, cw) = (g.weight(w.clone()), c.weight(w));
        for rows in [1, 5, 40] {
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
    let x = rand_vec(&mut rng, 11 * 512, 1.0);
    let mut gx = g.upload(&x);
    g.round_to(&mut gx, EntryDtype::Bf16);
    let mut want = x.clone();
    c.round_to(&mut want, EntryDtype::Bf16);
    assert_eq!(g.download(&gx), want, "bf16 rounding must be bit-identical");
    let gathered = g.gather_rows(&g.upload(&x), 512, &[3, 0, 10, 3]);
    assert_eq!(g.download(&gathered), c.gather_rows(&x, 512, &[3, 0, 10, 3]));
    for dtype in ["f32", "bf16", "fp8"] {
        let table = weight(&mut rng, 300, 4096, 0.5, dtype);
        let tokens = [5u32, 299, 0, 17];
        let mut out = poisoned(g, 4 * 4096);
        g.embed(&g.weight(table.clone()), &tokens, &mut out);
        let mut want = vec![0f32; 4 * 4096];
        c.embed(&c.weight(table), &tokens, &mut want);
        assert_eq!(g.download(&out), want, "embedding rows ({dtype}) must be exact");
    }
}

#[test]
fn cuda_hyper_connections_match_cpu_at_flash_shapes() {
    let Some(g) = gpu("cuda_hyper_connections_match_cpu_at_flash_shapes") else { return };
    let c = CpuBackend::new();
    let mut rng = rng("mhc");
    let (hc, d) = (4, 4096);
    let mix = weight(&mut rng, (2 + hc) * hc, hc * d, 0.02, "f32");
    let base = rand_vec(&mut rng, (2 + hc) * hc, 0.5);
    let gw = HcWeights::<CudaBackend> {
        mix: g.weight(mix.clone()),
        base: base.clone(),
        scale: [0.8, 1.1, 0.9],
        hc,
        hidden: d,
        sinkhorn_iters: 20,
        norm_eps: 1e-6,
        hc_eps: 1e-6,
    };
    let cw = HcWeights::<CpuBackend> {
        mix: c.weight(mix),
        base,
        scale: [0.8, 1.1, 0.9],
        hc,
        hidden: d,
        sinkhorn_iters: 20,
        norm_eps: 1e-6,
        hc_eps: 1e-6,
    };
    for rows in [1, 8, 29, 40] {
        let s = rand_vec(&mut rng, rows * hc * d, 1.0);
        let out = rand_vec(&mut rng, rows * d, 1.0);
        let (mut col, mut post, mut comb) =
            (poisoned(g, rows * d), poisoned(g, rows * hc), poisoned(g, rows * hc * hc));
        g.hc_pre(&g.upload(&s), rows, &gw, &mut col, &mut post, &mut comb);
        let (mut ccol, mut cpost, mut ccomb) =
            (vec![0f32; rows * d], vec![0f32; rows * hc], vec![0f32; rows * hc * hc]);
        c.hc_pre(&s, rows, &cw, &mut ccol, &mut cpost, &mut ccomb);
        check(&format!("hc_pre collapsed rows={rows}"), "f32", &g.download(&col), &ccol);
        check(&format!("hc_pre post rows={rows}"), "f32", &g.download(&post), &cpost);
        check(&format!("hc_pre comb rows={rows}"), "f32", &g.download(&comb), &ccomb);
        let mut gs = g.upload(&s);
        g.hc_post(&mut gs, rows, hc, &g.upload(&out), &post, &comb);
        let mut cs = s.clone();
        c.hc_post(&mut cs, rows, hc, &out, &cpost, &ccomb);
        check(&format!("hc_post rows={rows}"), "f32", &g.download(&gs), &cs);

        let hmix = weight(&mut rng, hc, hc * d, 0.02, "f32");
        let hbase = rand_vec(&mut rng, hc, 0.5);
        let gh = HcHeadWeights::<CudaBackend> {
            mix: g.weight(hmix.clone()),
            base: hbase.clone(),
            scale: 1.2,
            hc,
            hidden: d,
            norm_eps: 1e-6,
            hc_eps: 1e-6,
        };
        let ch = HcHeadWeights::<CpuBackend> {
            mix: c.weight(hmix),
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
}

#[test]
fn cuda_moe_matches_cpu_at_flash_width() {
    let Some(g) = gpu("cuda_moe_matches_cpu_at_flash_width") else { return };
    let c = CpuBackend::new();
    let mut rng = rng("moe");
    let (d, inter, n_exp, k) = (4096, 512, 16, 4);
    for dtype in ["bf16", "fp8"] {
        let gate = weight(&mut rng, n_exp, d, 0.05, "f32");
        let experts: Vec<[HostMatrix; 3]> = (0..n_exp)
            .map(|_| {
                [
                    weight(&mut rng, inter, d, 0.03, dtype),
                    weight(&mut rng, d, inter, 0.05, dtype),
                    weight(&mut rng, inter, d, 0.03, dtype),
                ]
            })
            .collect();
        let shared = [
            weight(&mut rng, inter, d, 0.03, dtype),
            weight(&mut rng, d, inter, 0.05, dtype),
            weight(&mut rng, inter, d, 0.03, dtype),
        ];
        let bias = rand_vec(&mut rng, n_exp, 0.2);
        let vocab = 64;
        let tid2eid: Vec<u32> = (0..vocab * k).map(|i| ((i * 7 + i / k) % n_exp) as u32).collect();
        for hash in [false, true] {
            let routing =
                || if hash { Routing::Hash { tid2eid: tid2eid.clone() } } else { Routing::TopK { bias: bias.clone() } };
            let gm = MoeWeights::<CudaBackend> {
                gate: g.weight(gate.clone()),
                routing: routing(),
                experts: experts
                    .iter()
                    .map(|e| ExpertWeights {
                        w1: g.weight(e[0].clone()),
                        w2: g.weight(e[1].clone()),
                        w3: g.weight(e[2].clone()),
                    })
                    .collect(),
                shared: Some(ExpertWeights {
                    w1: g.weight(shared[0].clone()),
                    w2: g.weight(shared[1].clone()),
                    w3: g.weight(shared[2].clone()),
                }),
                top_k: k,
                route_scale: 1.5,
                swiglu_limit: 2.0,
            };
            let cm = MoeWeights::<CpuBackend> {
                gate: c.weight(gate.clone()),
                routing: routing(),
                experts: experts
                    .iter()
                    .map(|e| ExpertWeights {
                        w1: c.weight(e[0].clone()),
                        w2: c.weight(e[1].clone()),
                        w3: c.weight(e[2].clone()),
                    })
                    .collect(),
                shared: Some(ExpertWeights {
                    w1: c.weight(shared[0].clone()),
                    w2: c.weight(shared[1].clone()),
                    w3: c.weight(shared[2].clone()),
                }),
                top_k: k,
                route_scale: 1.5,
                swiglu_limit: 2.0,
            };
            for rows in [1, 8, 37] {
                let x = rand_vec(&mut rng, rows * d, 1.0);
                let tokens: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
                let mut out = poisoned(g, rows * d);
                g.moe(&g.upload(&x), rows, &tokens, &gm, &mut out);
                let mut want = vec![0f32; rows * d];
                c.moe(&x, rows, &tokens, &cm, &mut want);
                check(&format!("moe hash={hash} rows={rows}"), dtype, &g.download(&out), &want);
            }
        }
    }
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
    };
    b.kv_write(&mut kv.pages, 0, &nan);
    let params = raw.iter().map(|p| [b.upload(&p[0]), b.upload(&p[1]), b.upload(&p[2]), b.upload(&p[3])]).collect();
    let sinks = b.upload(sinks);
    Side { b, kv, params, sinks }
}

/// Run one layer of one step on a backend: compressors, indexer (optionally forced to a
/// given selection), attention, ring update. Returns (attention output, selection).
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
) -> (Vec<f32>, Option<Vec<i32>>) {
    let b = s.b;
    let spec = layout.layers[l].spec;
    let up = |v: &Vec<f32>| b.upload(v);
    if spec.kind != AttnKind::Window {
        let p = CompressorParams::<B> { ape: &s.params[l][0], norm: &s.params[l][1], eps: 1e-6, rope };
        b.compress(&mut s.kv, layout, l, Branch::Main, plan, &up(&inp.main_kv), &up(&inp.main_score), &p);
    }
    let mut sel = None;
    if spec.kind == AttnKind::Csa {
        let p = CompressorParams::<B> { ape: &s.params[l][2], norm: &s.params[l][3], eps: 1e-6, rope };
        b.compress(&mut s.kv, layout, l, Branch::Indexer, plan, &up(&inp.idx_kv), &up(&inp.idx_score), &p);
        let chosen = b.index_topk(&s.kv, layout, l, plan, &up(&inp.idx_q), &up(&inp.idx_w), IDX_HEADS, TOP_K);
        sel = Some(b.idx_download(&chosen.indices));
    }
    let used = match (forced, &sel) {
        (Some(f), _) => Some(Selection::<B> { indices: from(b, f), top_k: TOP_K }),
        (None, Some(own)) => Some(Selection::<B> { indices: from(b, own), top_k: TOP_K }),
        _ => None,
    };
    let mut out = poisoned(b, plan.rows() * HEADS * HD);
    let new_kv = up(&inp.new_kv);
    b.attention(&s.kv, layout, l, plan, &up(&inp.q), &new_kv, used.as_ref(), &s.sinks, HEADS, 0.044, &mut out);
    b.store_window(&mut s.kv, layout, l, plan, &new_kv);
    (b.download(&out), sel)
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
            let at = pages[i / per_page] as usize * layout.page_elems + lk.page_index + (i % per_page) * IDX_DIM;
            let bytes = side.b.kv_read(&side.kv.pages, at, IDX_DIM);
            let key: Vec<f64> = match layout.dtype {
                EntryDtype::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(&bytes).into_iter().map(f64::from).collect(),
                EntryDtype::Bf16 => {
                    bytemuck::pod_collect_to_vec::<u8, u16>(&bytes).into_iter().map(|b| bf16_to_f32(b) as f64).collect()
                }
            };
            (0..IDX_HEADS)
                .map(|h| {
                    let dot: f64 = (0..IDX_DIM).map(|d| q[h * IDX_DIM + d] as f64 * key[d]).sum();
                    w[h] as f64 * dot.max(0.0)
                })
                .sum()
        })
        .collect()
}

fn sequence_ops(dtype: EntryDtype) {
    let name = format!("cuda_sequence_ops_match_cpu_at_flash_shapes_{}", dtype.name());
    let Some(g) = gpu(&name) else { return };
    let mut rng = rng(&name);
    let specs = [
        LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM },
        LayerSpec { kind: AttnKind::Hca, ratio: 128, head_dim: HD, index_dim: 0 },
        LayerSpec { kind: AttnKind::Window, ratio: 0, head_dim: HD, index_dim: 0 },
    ];
    let layout = KvLayout::new(128, 128, dtype, &specs);
    let yarn = Yarn { factor: 16.0, original_max_position: 65536.0, beta_fast: 32.0, beta_slow: 1.0 };
    let rope = RopeTable::yarn(160000.0, 64, yarn, 1.0);
    let raw: Vec<[Vec<f32>; 4]> = specs
        .iter()
        .map(|s| {
            let cw = if s.kind == AttnKind::Csa { 2 * HD } else { HD };
            let ratio = s.ratio.max(1);
            [
                rand_vec(&mut rng, ratio * cw, 0.5),
                rand_vec(&mut rng, HD, 0.2).iter().map(|v| v + 1.0).collect(),
                rand_vec(&mut rng, ratio * 2 * IDX_DIM, 0.5),
                rand_vec(&mut rng, IDX_DIM, 0.2).iter().map(|v| v + 1.0).collect(),
            ]
        })
        .collect();
    let sinks = rand_vec(&mut rng, HEADS, 1.0);
    let page_tables: [Vec<u32>; 2] = [(0..20).collect(), (20..24).rev().collect()];
    let cpu = CpuBackend::new();
    let mut gs = side(g, &layout, 24, 2, &raw, &sinks);
    let mut cs = side(&cpu, &layout, 24, 2, &raw, &sinks);
    // (seq, chunk) per step: a long prefill in uneven chunks (more CSA candidates than
    // top-k), a short sequence joining, then batched decode of both.
    let schedule: Vec<Vec<(usize, usize)>> = vec![
        vec![(0, 1300)],
        vec![(0, 917), (1, 1)],
        vec![(1, 140)],
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
            let round = |v: Vec<f32>| -> Vec<f32> {
                match dtype {
                    EntryDtype::F32 => v,
                    EntryDtype::Bf16 => v.into_iter().map(|x| bf16_to_f32(f32_to_bf16(x))).collect(),
                }
            };
            let inp = StepInputs {
                main_kv: rand_vec(&mut rng, rows * cw, 1.0),
                main_score: rand_vec(&mut rng, rows * cw, 1.5),
                idx_kv: rand_vec(&mut rng, rows * 2 * IDX_DIM, 1.0),
                idx_score: rand_vec(&mut rng, rows * 2 * IDX_DIM, 1.5),
                idx_q: rand_vec(&mut rng, rows * IDX_HEADS * IDX_DIM, 0.3),
                idx_w: rand_vec(&mut rng, rows * IDX_HEADS, 1.0),
                q: rand_vec(&mut rng, rows * HEADS * HD, 0.3),
                new_kv: round(rand_vec(&mut rng, rows * HD, 1.0)),
            };
            let (gout, gsel) = run_layer(&mut gs, &layout, l, &plan, &inp, &rope, None, &|b: &CudaBackend, v| {
                kernels::cuda::CudaIdx::from_host(b, v)
            });
            // The CPU attends over the GPU's selection, so attention is compared on
            // identical inputs; the selections are compared on their own below.
            let (cout, csel) = run_layer(&mut cs, &layout, l, &plan, &inp, &rope, gsel.as_deref(), &|_, v| v.to_vec());
            let e = rel_err(&gout, &cout);
            worst = worst.max(e);
            if e.is_nan() || e > tol(dtype.name()) {
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
    let to_f32 = |bytes: &[u8]| -> Vec<f32> {
        match dtype {
            EntryDtype::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(bytes),
            EntryDtype::Bf16 => bytemuck::pod_collect_to_vec::<u8, u16>(bytes).into_iter().map(bf16_to_f32).collect(),
        }
    };
    let (gp, cp) = (to_f32(&gpages), to_f32(&cpages));
    let nan_mismatch = gp.iter().zip(&cp).filter(|(a, b)| a.is_nan() != b.is_nan()).count();
    assert_eq!(nan_mismatch, 0, "entries written on one device only");
    let written: Vec<(f32, f32)> = gp.iter().zip(&cp).filter(|(a, _)| !a.is_nan()).map(|(a, b)| (*a, *b)).collect();
    assert!(!written.is_empty());
    let (ga, ca): (Vec<f32>, Vec<f32>) = written.into_iter().unzip();
    check("compressed entries", dtype.name(), &ga, &ca);
    let grings = to_f32(&gs.b.kv_read(&gs.kv.rings, 0, 2 * layout.ring_elems));
    let crings = to_f32(&cs.b.kv_read(&cs.kv.rings, 0, 2 * layout.ring_elems));
    assert_eq!(grings, crings, "window rings hold the same stored values");
    let gcomp = gs.b.kv_read(&gs.kv.comp, 0, 2 * layout.comp_elems);
    let ccomp = cs.b.kv_read(&cs.kv.comp, 0, 2 * layout.comp_elems);
    assert_eq!(gcomp, ccomp, "compressor rings hold the same bytes (copies of the inputs)");
    eprintln!("PARITY attention {} {worst:.2e}", dtype.name());
    eprintln!(
        "PARITY indexer-selection {}: {checked} rows identical to the CPU's, {near_ties} differing rows each the \
         top-k of the GPU's keys up to f32 ties",
        dtype.name()
    );
    assert!(checked > 0);
}

#[test]
fn cuda_sequence_ops_match_cpu_at_flash_shapes_f32() {
    sequence_ops(EntryDtype::F32);
}

#[test]
fn cuda_sequence_ops_match_cpu_at_flash_shapes_bf16() {
    sequence_ops(EntryDtype::Bf16);
}

/// Compressors inside a restored prefix (`pages_final_until`) refill their rings but
/// leave the prefix's entries alone, on both devices.
#[test]
fn cuda_compressor_respects_pages_final_until() {
    let Some(g) = gpu("cuda_compressor_respects_pages_final_until") else { return };
    let cpu = CpuBackend::new();
    let mut rng = rng("pages_final_until");
    let spec = [LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM }];
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
/// rings between long prefills: every entry and ring byte as on the CPU.
#[test]
fn cuda_compressor_long_batches_match_cpu() {
    let Some(g) = gpu("cuda_compressor_long_batches_match_cpu") else { return };
    let cpu = CpuBackend::new();
    let mut rng = rng("compressor_long_batches");
    let specs = [
        LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM },
        LayerSpec { kind: AttnKind::Hca, ratio: 128, head_dim: HD, index_dim: 0 },
    ];
    let layout = KvLayout::new(128, 128, EntryDtype::F32, &specs);
    let raw: Vec<[Vec<f32>; 4]> = specs
        .iter()
        .map(|s| {
            let cw = if s.kind == AttnKind::Csa { 2 * HD } else { HD };
            [
                rand_vec(&mut rng, s.ratio * cw, 0.5),
                rand_vec(&mut rng, HD, 0.2).iter().map(|v| v + 1.0).collect(),
                rand_vec(&mut rng, s.ratio * 2 * IDX_DIM, 0.5),
                rand_vec(&mut rng, IDX_DIM, 0.2).iter().map(|v| v + 1.0).collect(),
            ]
        })
        .collect();
    let sinks = vec![0.0; HEADS];
    // Pages: sequence 0 (8,195 tokens) 0..65, sequence 1 (3,301) 65..91 reversed,
    // sequence 2 (5) 91.
    let tables: [Vec<u32>; 3] = [(0..65).collect(), (65..91).rev().collect(), vec![91]];
    let mut gs = side(g, &layout, 92, 3, &raw, &sinks);
    let mut cs = side(&cpu, &layout, 92, 3, &raw, &sinks);
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
                g.compress(&mut gs.kv, &layout, l, branch, &plan, &g.upload(&kv), &g.upload(&sc), &p);
                let p = CompressorParams::<CpuBackend> {
                    ape: &cs.params[l][k],
                    norm: &cs.params[l][k + 1],
                    eps: 1e-6,
                    rope: &rope,
                };
                cpu.compress(&mut cs.kv, &layout, l, branch, &plan, &kv, &sc, &p);
            }
        }
    }
    let gp: Vec<f32> = bytemuck::pod_collect_to_vec(&gs.b.kv_read(&gs.kv.pages, 0, 92 * layout.page_elems));
    let cp: Vec<f32> = bytemuck::pod_collect_to_vec(&cs.b.kv_read(&cs.kv.pages, 0, 92 * layout.page_elems));
    let nan_mismatch = gp.iter().zip(&cp).filter(|(a, b)| a.is_nan() != b.is_nan()).count();
    assert_eq!(nan_mismatch, 0, "entries written on one device only");
    let (ga, ca): (Vec<f32>, Vec<f32>) = gp.iter().zip(&cp).filter(|(a, _)| !a.is_nan()).map(|(a, b)| (*a, *b)).unzip();
    // Sequences of 8,195, 3,302 and 5 tokens: CSA 2,048 + 825 + 1 entries of 512 + 128
    // values, HCA 64 + 25 entries of 512.
    let expected = (2048 + 825 + 1) * (HD + IDX_DIM) + (64 + 25) * HD;
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
        self.b.compress(&mut self.kv, layout, 0, Branch::Main, plan, &kv, &sc, &p);
    }
}

/// The indexer over many candidates (a 256K-token context: 65,536 CSA entries) picks
/// the same top-512 as the CPU, except at exact f32 ties.
#[test]
fn cuda_indexer_topk_over_many_candidates_matches_cpu() {
    let Some(g) = gpu("cuda_indexer_topk_over_many_candidates_matches_cpu") else { return };
    let cpu = CpuBackend::new();
    let mut rng = rng("topk");
    let spec = [LayerSpec { kind: AttnKind::Csa, ratio: 4, head_dim: HD, index_dim: IDX_DIM }];
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
            &gs.b.index_topk(&gs.kv, &layout, 0, plan, &gs.b.upload(&q), &gs.b.upload(&w), IDX_HEADS, TOP_K).indices,
        );
        let csel = cs.b.index_topk(&cs.kv, &layout, 0, plan, &q, &w, IDX_HEADS, TOP_K).indices;
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
        let rows = lens.len();
        let mut scores = vec![f32::NEG_INFINITY; rows * n_max];
        for (r, &n) in lens.iter().enumerate() {
            for i in 0..n {
                scores[r * n_max + i] = score(&mut rng, i);
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
}
