//! The stored-format products alone, for `sluice bench engine`'s kernel table: decode
//! gemv over FP4 experts and FP8/BF16 projections against the device's copy bandwidth
//! (each decode kernel version, `v1` and `v2`, in the same run), the routed experts of one
//! decode token (SwiGLU pair and down projection of 6 FP4 experts, both versions), and
//! the tensor-core GEMMs (FP8 projections, FP4 experts grouped) against a cuBLAS BF16
//! GEMM of the same shape in the same run. Weights are random values in the stored
//! formats; gemv and the experts rotate over enough distinct weights to exceed the L2
//! cache, so they measure device memory, not the cache — except the one-row runs labelled
//! "same copy", which read one weight every call (from L2 where it fits: the kernel's own
//! pace with device memory's latency taken away). `SLUICE_BENCH_PRODUCTS=TEXT` keeps only
//! the gemv rows whose name contains TEXT (e.g. `fp8`; `experts` the routed experts'
//! rows alone) and skips the rest of the table.
//!
//! Also the parity suite's entry points to either decode version (`decode_*`).

use cudarc::cublas::sys::cudaDataType;

use super::blas_op::BlasOp;
use super::cublas_bf16;
use super::decode_v2::{D2_KERNELS, D2Plan, d2_gemv, d2_plan};
use super::gemm_rows::{GemmRowsPlan, gemm_rows, gemm_rows_plan, gemm_rows_plan_always};
use super::gemv_f8mma::{F8Plan, f8mma_gemv, f8mma_plan, f8mma_plan_always};
use super::gemv_f8wg::{F8wgPlan, f8wg_gemv, f8wg_pair_plan, f8wg_plan_always};
use super::matmul::{
    Decode, GEMM_BM, Operand, Tiles, gemm, gemm_fp4_f8, gemm_kernel, gemv_simt, matmul, matmul_as, swiglu_pair,
};
use super::memory::CudaWeight;
use super::moe::{ListsRouting, experts_routed_on_device, moe_as, with_routing_apart};
use super::moe_v2::{experts_v2_plan, segments_plan};
use super::moe_wgmma::{wgmoe_plan, without_wgmoe};
use super::{CudaBackend, CudaBuf};
use crate::Activations;
use crate::backend::{Backend, ExpertWeights, MoeWeights, Routing};
use crate::kv_layout::KvLayout;
use crate::plan::BatchPlan;
use crate::stored::{OwnedFormat, OwnedWeight};

/// One row of the table.
#[derive(Clone, Debug)]
pub struct ProductTime {
    /// What ran (kernel family and shape).
    pub what: String,
    /// Microseconds per call, back to back on the device.
    pub us: f64,
    /// Bytes of weights a call streams (gemv rows), for GB/s.
    pub bytes: f64,
    /// Floating-point operations per call (GEMM rows), for TFLOP/s.
    pub flops: f64,
    /// cuBLAS BF16 GEMM of the same shape, microseconds (GEMM rows).
    pub cublas_us: Option<f64>,
}

/// What a kernel-table row of a decode product runs.
#[derive(Clone, Copy)]
enum Run<'a> {
    /// The engine's choice under a decode version.
    Engine(Decode),
    /// The FP8 tensor-core gemv alone.
    F8mma(&'a F8Plan),
    /// The FP8 warpgroup gemv alone.
    F8wg(&'a F8wgPlan),
    /// The v2 kernel alone.
    D2(&'a D2Plan),
    /// The SIMT gemv.
    Simt,
    /// The BF16 product of up to 32 rows in one launch (`gemm_rows_bf16`) alone.
    Rows(&'a GemmRowsPlan),
    /// cuBLAS with split activations (BF16), its split and sum launches included.
    Cublas,
    /// The engine's choice on the same copy every call: a weight that fits L2 is read
    /// from there, so this is the kernel's pace with device memory's latency taken away.
    SameCopy,
}

/// `n` values in [0, 1) from the xorshift sequence that starts at `state` (24 bits each):
/// the benchmark's inputs, the same every run.
pub(super) fn xorshift_unit(mut state: u64, n: usize) -> impl Iterator<Item = f32> {
    (0..n).map(move |_| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    })
}

fn noise(n: usize, salt: u64) -> Vec<f32> {
    xorshift_unit(0x9e37_79b9_7f4a_7c15u64 ^ salt.wrapping_mul(0xbf58_476d_1ce4_e5b9), n)
        .map(|u| (u - 0.5) * 0.1)
        .collect()
}

/// Random bytes of a stored weight, drawn directly in the format (quantising f32 values
/// would take minutes at these sizes): FP8 codes without the NaN code, FP4 nibbles, and
/// scales of 2^-7 around which the values stay O(0.1).
fn stored(b: &CudaBackend, rows: usize, cols: usize, format: OwnedFormat, salt: u64) -> CudaWeight {
    let mut x = 0x2545_f491_4f6c_dd1du64 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut bytes = |n: usize| -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.truncate(n);
        v
    };
    let q = match format {
        OwnedFormat::Bf16 => {
            let values =
                noise(rows * cols, salt).iter().flat_map(|&v| crate::quant::f32_to_bf16(v).to_le_bytes()).collect();
            OwnedWeight { rows, cols, format, values, scales: Vec::new() }
        }
        OwnedFormat::Fp8 => {
            let values = bytes(rows * cols).into_iter().map(|c| if c & 0x7f == 0x7f { c ^ 1 } else { c }).collect();
            let scales = vec![120u8; rows.div_ceil(128) * cols.div_ceil(128)];
            OwnedWeight { rows, cols, format, values, scales }
        }
        OwnedFormat::Fp4 => OwnedWeight {
            rows,
            cols,
            format,
            values: bytes(rows * cols / 2),
            scales: vec![120u8; rows * cols.div_ceil(32)],
        },
    };
    b.weight(q.view())
}

impl CudaBackend {
    /// The kernel table (see the module comment); `reps` calls per timing.
    pub fn bench_products(&self, reps: usize) -> Vec<ProductTime> {
        let mut out = Vec::new();
        // Decode gemv at 1, 8 and 32 rows: an expert's gate projection (FP4, 2048 × 4096, 64 of
        // them: 276 MB), a projection like wo_a (8192 × 4096) in FP8 and BF16 and one like
        // wq_b (32768 × 1024: K of one chunk, which the FP8 tensor-core gemv leaves to v2)
        // in FP8 and BF16 (8 copies each), and FP8 ones like wo_b (4096 × 8192: 64 tiles
        // of the warpgroup gemv, K split) and wq_a (1024 × 4096, 16 copies).
        let gemv_sets: [(&str, OwnedFormat, usize, usize, usize); 7] = [
            ("gemv fp4 expert 2048x4096", OwnedFormat::Fp4, 2048, 4096, 64),
            ("gemv fp8 8192x4096", OwnedFormat::Fp8, 8192, 4096, 8),
            ("gemv fp8 32768x1024", OwnedFormat::Fp8, 32768, 1024, 8),
            ("gemv fp8 4096x8192", OwnedFormat::Fp8, 4096, 8192, 8),
            ("gemv fp8 1024x4096", OwnedFormat::Fp8, 1024, 4096, 16),
            ("gemv bf16 8192x4096", OwnedFormat::Bf16, 8192, 4096, 8),
            ("gemv bf16 32768x1024", OwnedFormat::Bf16, 32768, 1024, 8),
        ];
        let only = std::env::var("SLUICE_BENCH_PRODUCTS").ok();
        for (what, format, n, k, copies) in gemv_sets {
            if only.as_deref().is_some_and(|o| !what.contains(o)) {
                continue;
            }
            let ws: Vec<CudaWeight> = (0..copies).map(|i| stored(self, n, k, format, i as u64)).collect();
            // 32 rows: a decode batch, v2's one FP8 launch against v1's launches of 8 rows
            // (BF16: `gemm_rows_bf16` against cuBLAS with split activations stacked into
            // one product, its split and sum included).
            for rows in [1usize, 8, 32] {
                let x = self.upload(&noise(rows * k, 99));
                let y = self.zeros(rows * n);
                let g = &self.gpu;
                let op = Operand { x: g.ptr(&x.mem), x_stride: k, out: g.ptr(&y.mem), out_stride: n, rows, groups: 1 };
                // The first version's choice (tensor cores for these formats), the second
                // version's kernels where they take the product, then the SIMT kernels.
                // The FP8 tensor-core gemv and the v2 kernel each on its own where both
                // take the product.
                let mut runs = vec![(" v1", Run::Engine(Decode::V1))];
                let f8wg = f8wg_plan_always(g, &op, &ws[0]);
                if let Some(plan) = &f8wg {
                    runs.push((" f8wg", Run::F8wg(plan)));
                }
                let f8mma = f8mma_plan_always(g, &op, &ws[0]);
                let d2 = d2_plan(g, &op, &ws[0], None);
                if let Some(plan) = &f8mma {
                    runs.push((" f8mma", Run::F8mma(plan)));
                }
                if let Some(plan) = &d2 {
                    runs.push((" v2", Run::D2(plan)));
                }
                runs.push((" simt", Run::Simt));
                let rows_plan = gemm_rows_plan_always(g, &op, &ws[0]);
                if let Some(plan) = &rows_plan {
                    runs.push((" rows", Run::Rows(plan)));
                }
                if format == OwnedFormat::Bf16 && rows > 8 {
                    runs.push((" cublas", Run::Cublas));
                }
                if rows == 1 {
                    runs.push((" engine, same copy (in L2 if it fits)", Run::SameCopy));
                }
                for (label, run) in runs {
                    let mut i = 0;
                    let t = self.time_kernel_us(reps * copies, || {
                        let w = &ws[i % copies];
                        match run {
                            Run::Engine(v) => matmul_as(g, op, w, v),
                            Run::F8mma(plan) => f8mma_gemv(g, plan, op, w),
                            Run::F8wg(plan) => f8wg_gemv(g, plan, op, w),
                            Run::D2(plan) => d2_gemv(g, plan, op, w, None, 0.0),
                            Run::Simt => gemv_simt(g, op, w, None, 0.0),
                            Run::Rows(plan) => gemm_rows(g, plan, op, w),
                            Run::Cublas => cublas_bf16::product_as(g, op, w, Activations::Split),
                            Run::SameCopy => matmul(g, op, &ws[0]),
                        }
                        i += 1;
                    });
                    out.push(ProductTime {
                        what: format!("{what}{label} rows={rows}"),
                        us: t.gpu_us,
                        bytes: ws[0].device_bytes() as f64,
                        flops: 2.0 * (rows * n * k) as f64,
                        cublas_us: None,
                    });
                }
            }
        }
        self.take_traffic();
        if only.as_deref().is_none_or(|o| "experts fp4".contains(o)) {
            out.extend(self.bench_experts(reps));
            self.take_traffic();
        }
        if only.is_some() {
            return out;
        }

        // Prefill GEMMs: 8192 rows through wo_a (FP8, 8192 × 4096), and one MoE layer's
        // gate projection at 8192 tokens × top-6 over 256 FP4 experts (192 rows each).
        let g = &self.gpu;
        let rows = 8192;
        for (format, n, k) in [(OwnedFormat::Fp8, 8192usize, 4096usize), (OwnedFormat::Bf16, 8192, 4096)] {
            let w = stored(self, n, k, format, 7);
            let x = self.upload(&noise(rows * k, 8));
            let y = self.zeros(rows * n);
            let op = Operand { x: g.ptr(&x.mem), x_stride: k, out: g.ptr(&y.mem), out_stride: n, rows, groups: 1 };
            let name = gemm_kernel(&op, &w).expect("tiled shape");
            let split = self.time_kernel_us(reps, || matmul(g, op, &w));
            let hi = self.time_kernel_us(reps, || gemm(g, &format!("{name}_hi"), op, &w, None));
            let cublas = self.time_cublas_bf16(rows, n, k, 1, reps);
            let flops = 2.0 * (rows * n * k) as f64;
            let f = if format == OwnedFormat::Fp8 { "fp8" } else { "bf16" };
            out.push(ProductTime {
                what: format!("gemm {f} {rows}x{n}x{k} (split x)"),
                us: split.gpu_us,
                bytes: 0.0,
                flops,
                cublas_us: Some(cublas),
            });
            out.push(ProductTime {
                what: format!("gemm {f} {rows}x{n}x{k} (bf16 x)"),
                us: hi.gpu_us,
                bytes: 0.0,
                flops,
                cublas_us: Some(cublas),
            });
        }
        let (experts, per, n, k) = (256usize, 192usize, 2048usize, 4096usize);
        let ws: Vec<CudaWeight> = (0..experts).map(|e| stored(self, n, k, OwnedFormat::Fp4, 100 + e as u64)).collect();
        let table: Vec<u64> = ws
            .iter()
            .flat_map(|w| {
                let (wp, sp) = w.ptrs();
                [wp, sp]
            })
            .collect();
        let table = g.upload(&table);
        let mut tiles = Vec::new();
        for e in 0..experts {
            for t in (0..per).step_by(GEMM_BM) {
                tiles.extend_from_slice(&[e as i32, (e * per + t) as i32, (per - t).min(GEMM_BM) as i32]);
            }
        }
        let tiles_dev = g.upload(&tiles);
        let total = experts * per;
        let x = self.upload(&noise(total * k, 5));
        let y = self.zeros(total * n);
        let op = Operand { x: g.ptr(&x.mem), x_stride: k, out: g.ptr(&y.mem), out_stride: n, rows: total, groups: 1 };
        let over = Tiles { tiles: g.ptr(&tiles_dev), count: tiles.len() / 3, wtab: g.ptr(&table) };
        let flops = 2.0 * (total * n * k) as f64;
        let cublas = self.time_cublas_bf16(per, n, k, experts, reps);
        for (suffix, label) in [("", "split x"), ("_hi", "bf16 x")] {
            let t = self.time_kernel_us(reps, || gemm(g, &format!("gemm_fp4{suffix}"), op, &ws[0], Some(&over)));
            out.push(ProductTime {
                what: format!("grouped gemm fp4 {experts} experts x {per} rows, {n}x{k} ({label})"),
                us: t.gpu_us,
                bytes: 0.0,
                flops,
                cublas_us: Some(cublas),
            });
        }
        // The FP8 tensor-core variant (activations in e4m3), quantisation included.
        let t = self.time_kernel_us(reps, || gemm_fp4_f8(g, op, &ws[0], Some(&over)));
        out.push(ProductTime {
            what: format!("grouped gemm fp4 {experts} experts x {per} rows, {n}x{k} (e4m3 x, fp8 tensor cores)"),
            us: t.gpu_us,
            bytes: 0.0,
            flops,
            cublas_us: Some(cublas),
        });
        // The same products on `wgmma` (the engine's on sm_90), the parts' staging included.
        if super::moe_fp4wg::available(g) {
            let by_height = super::moe_fp4wg::upload_tiles(g, &tiles);
            let t = self.time_kernel_us(reps, || {
                let parts = super::moe_fp4wg::parts(g, op.x, k, total, k, false);
                super::moe_fp4wg::product(g, &parts, &ws[0], &by_height, g.ptr(&table), op.out);
            });
            out.push(ProductTime {
                what: format!("grouped gemm fp4 {experts} experts x {per} rows, {n}x{k} (e4m3 parts, wgmma)"),
                us: t.gpu_us,
                bytes: 0.0,
                flops,
                cublas_us: Some(cublas),
            });
        }
        self.take_traffic();
        out
    }

    /// The routed experts of one decode token at V4-Flash widths, each decode version: 6 of
    /// 24 FP4 experts (gate/up 2048 × 4096, down 4096 × 2048, 12.6 MB an expert) through
    /// the device-routed path the engine takes at batch 1 (routing lists, SwiGLU pair, down
    /// projection, combine), four disjoint sets of 6 in turn so that each call streams
    /// 75 MB the L2 cannot hold from the call before.
    fn bench_experts(&self, reps: usize) -> Vec<ProductTime> {
        let (n_exp, top_k, d, inter, sets) = (24usize, 6usize, 4096usize, 2048usize, 4usize);
        let fp4 = |rows, cols, salt| stored(self, rows, cols, OwnedFormat::Fp4, salt);
        let experts: Vec<ExpertWeights<CudaBackend>> = (0..n_exp as u64)
            .map(|e| ExpertWeights {
                w1: fp4(inter, d, 500 + 3 * e),
                w2: fp4(d, inter, 501 + 3 * e),
                w3: fp4(inter, d, 502 + 3 * e),
            })
            .collect();
        let expert_bytes = experts[0].w1.device_bytes() + experts[0].w2.device_bytes() + experts[0].w3.device_bytes();
        let w = MoeWeights {
            gate: stored(self, n_exp, d, OwnedFormat::Bf16, 499),
            routing: Routing::TopK { bias: vec![0.0; n_exp] },
            experts,
            expert_base: 0,
            shared: None,
            top_k,
            route_scale: 1.0,
            swiglu_limit: 10.0,
        };
        let g = &self.gpu;
        let x = self.upload(&noise(d, 31));
        let chosen: Vec<_> =
            (0..sets).map(|s| g.upload(&(0..top_k).map(|j| (s * top_k + j) as i32).collect::<Vec<_>>())).collect();
        let weights = self.upload(&[0.3, 0.25, 0.2, 0.1, 0.1, 0.05]);
        let mut y = self.zeros(d);
        let mut out = Vec::new();
        // v2 by its segment kernels and, on sm_90, on `wgmma` (what the engine runs there).
        let runs = [("v1", Decode::V1, false), ("v2 segments", Decode::V2, false), ("v2 wgmma", Decode::V2, true)];
        for (label, variant, wgmma) in runs {
            if variant == Decode::V2 && experts_v2_plan(1, &w).is_none() || wgmma && wgmoe_plan(g, 1, &w).is_none() {
                continue;
            }
            let mut i = 0;
            let t = self.time_kernel_us(reps * sets, || {
                let set = &chosen[i % sets];
                let mut run = || {
                    let routing = ListsRouting::Chosen(set);
                    experts_routed_on_device(self, &x, 1, &[0], &w, routing, &weights, &mut y, variant, None)
                };
                if wgmma {
                    run()
                } else {
                    without_wgmoe(run)
                };
                i += 1;
            });
            out.push(ProductTime {
                what: format!("experts fp4 {label}: {top_k} of {n_exp}, 1 token, swiglu+down"),
                us: t.gpu_us,
                bytes: (top_k * expert_bytes) as f64,
                flops: 2.0 * (top_k * 3 * d * inter) as f64,
                cublas_us: None,
            });
        }
        out
    }

    /// The decode kernels this process runs (`SLUICE_CUDA_DECODE_KERNELS`): "v1" or "v2".
    pub fn decode_kernels(&self) -> &'static str {
        match Decode::from_env() {
            Decode::V1 => "v1",
            Decode::V2 => "v2",
        }
    }

    /// `out = x · Wᵀ` for a decode batch (at most 32 rows) with decode kernels `variant`
    /// (`v1` or `v2`; v2 leaves what it does not take to v1), for the parity suite;
    /// `groups` > 1 makes it the grouped product (`Backend::grouped_matmul`).
    pub fn decode_matmul(
        &self,
        variant: &str,
        x: &CudaBuf,
        rows: usize,
        groups: usize,
        w: &CudaWeight,
        out: &mut CudaBuf,
    ) {
        assert!(rows <= 32, "decode_matmul takes at most 32 rows");
        assert_eq!((x.len, out.len), (rows * groups * w.cols, rows * w.rows), "decode_matmul shapes");
        let g = &self.gpu;
        let op = Operand::contiguous(g.ptr(&x.mem), g.ptr(&out.mem), rows, groups, w);
        matmul_as(g, op, w, decode_variant(variant));
    }

    /// `out = x · Wᵀ` over a BF16 weight on cuBLAS (the path of BF16 products of many
    /// rows) with the activations in the precision given, for the parity suite; `groups`
    /// > 1 makes it the grouped product.
    pub fn cublas_bf16_matmul(
        &self,
        activations: Activations,
        x: &CudaBuf,
        rows: usize,
        groups: usize,
        w: &CudaWeight,
        out: &mut CudaBuf,
    ) {
        assert_eq!((x.len, out.len), (rows * groups * w.cols, rows * w.rows), "cublas_bf16_matmul shapes");
        let g = &self.gpu;
        let op = Operand::contiguous(g.ptr(&x.mem), g.ptr(&out.mem), rows, groups, w);
        cublas_bf16::product_as(g, op, w, activations);
    }

    /// Whether the backend's own products of `rows` rows over `w` take `gemm_rows_bf16`
    /// (`SLUICE_CUDA_GEMM_ROWS`), for the parity suite.
    pub fn gemm_rows_routes(&self, x: &CudaBuf, rows: usize, groups: usize, w: &CudaWeight) -> bool {
        let g = &self.gpu;
        let op = Operand::contiguous(g.ptr(&x.mem), 0, rows, groups, w);
        gemm_rows_plan(g, &op, w).is_some()
    }

    /// `out = x · Wᵀ` over a BF16 weight through `gemm_rows_bf16` (the 9-32-row decode
    /// product, opt-in) at any 1-32 rows, for the parity suite; false (nothing run) where
    /// the kernel does not take the shape.
    pub fn gemm_rows_matmul(&self, x: &CudaBuf, rows: usize, groups: usize, w: &CudaWeight, out: &mut CudaBuf) -> bool {
        assert_eq!((x.len, out.len), (rows * groups * w.cols, rows * w.rows), "gemm_rows_matmul shapes");
        let g = &self.gpu;
        let op = Operand::contiguous(g.ptr(&x.mem), g.ptr(&out.mem), rows, groups, w);
        let Some(plan) = gemm_rows_plan_always(g, &op, w) else { return false };
        gemm_rows(g, &plan, op, w);
        true
    }

    /// `out = silu(min(x·w1ᵀ, limit)) * clamp(x·w3ᵀ, ±limit)` for a decode batch with decode
    /// kernels `variant`, for the parity suite.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_swiglu(
        &self,
        variant: &str,
        x: &CudaBuf,
        rows: usize,
        w1: &CudaWeight,
        w3: &CudaWeight,
        limit: f32,
        out: &mut CudaBuf,
    ) {
        assert!(rows <= 8, "decode_swiglu takes at most 8 rows");
        let op = self.pair_operand(x, rows, w1, out);
        swiglu_pair(&self.gpu, op, w1, w3, limit, decode_variant(variant));
    }

    /// The operand of a SwiGLU pair over `w1`'s shape: `x[rows, w1.cols]` into
    /// `out[rows, w1.rows]` (shapes checked).
    fn pair_operand(&self, x: &CudaBuf, rows: usize, w1: &CudaWeight, out: &CudaBuf) -> Operand {
        assert_eq!((x.len, out.len), (rows * w1.cols, rows * w1.rows), "SwiGLU pair shapes");
        let g = &self.gpu;
        Operand { x: g.ptr(&x.mem), x_stride: w1.cols, out: g.ptr(&out.mem), out_stride: w1.rows, rows, groups: 1 }
    }

    /// The MoE block ([`Backend::moe`]) with decode kernels `variant` (`v1`, `v2`, or
    /// `v2-segments`: v2 with the routed experts kept off `wgmma` and routed by `moe_route` and
    /// `moe_lists` as two launches), for the parity suite.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_moe(
        &self,
        variant: &str,
        x: &CudaBuf,
        rows: usize,
        tokens: &[u32],
        w: &MoeWeights<Self>,
        shared_rows: std::ops::Range<usize>,
        out: &mut CudaBuf,
    ) {
        if variant == "v2-segments" {
            // (Routed by two launches too, so the parity suite reaches that form.)
            with_routing_apart(|| without_wgmoe(|| moe_as(self, x, rows, tokens, w, shared_rows, out, Decode::V2)));
        } else {
            moe_as(self, x, rows, tokens, w, shared_rows, out, decode_variant(variant));
        }
    }

    /// Whether [`Backend::indexer_select`] folds q's rotation and the weights' scale into
    /// the scoring's launches for this batch (`SLUICE_CUDA_INDEXER_PREP` respected), for
    /// the parity suite.
    pub fn indexer_prep_fused(
        &self,
        layout: &KvLayout,
        layer: usize,
        plan: &BatchPlan,
        heads: usize,
        top_k: usize,
    ) -> bool {
        super::attention::takes_prep(self, layout, layer, plan, heads, top_k)
    }

    /// Whether the indexer's scores of `plan` at `layer` run on `index_scores_wg` (keys kept
    /// in registers while a sequence's rows stream past them; for tests).
    pub fn indexer_scores_on_wgmma(&self, layout: &KvLayout, layer: usize, plan: &BatchPlan, heads: usize) -> bool {
        super::indexer_wg::rows_per_block(&self.gpu, layout, layer, plan, heads, 0).is_some()
    }

    /// The `wgmma` routed-expert kernels (and their K splits) the v2 path runs for a
    /// decode batch of `rows` rows over `w`, or `None` where it leaves the batch to the
    /// segment kernels (`SLUICE_CUDA_MOE_WGMMA` respected), for the parity suite.
    pub fn decode_moe_wgmma(&self, rows: usize, w: &MoeWeights<Self>) -> Option<String> {
        wgmoe_plan(&self.gpu, rows, w).map(|p| p.describe())
    }

    /// The v2 kernel a decode product (a SwiGLU pair with `w3`) of `rows` rows over `x`
    /// runs on, or `None` where v2 leaves it to v1.
    pub fn decode_v2_kernel(
        &self,
        x: &CudaBuf,
        rows: usize,
        groups: usize,
        w: &CudaWeight,
        w3: Option<&CudaWeight>,
    ) -> Option<&'static str> {
        let g = &self.gpu;
        let op = Operand::contiguous(g.ptr(&x.mem), 0, rows, groups, w);
        let plan = d2_plan(g, &op, w, w3)?;
        D2_KERNELS.iter().copied().find(|&k| k == plan.name)
    }

    /// The FP8 tensor-core gemv kernel the engine's v2 path runs for this product, if it
    /// takes it (`SLUICE_CUDA_F8MMA` respected), for the parity suite.
    pub fn decode_f8mma_kernel(&self, x: &CudaBuf, rows: usize, groups: usize, w: &CudaWeight) -> Option<&'static str> {
        let g = &self.gpu;
        let op = Operand::contiguous(g.ptr(&x.mem), 0, rows, groups, w);
        f8mma_plan(g, &op, w).map(|p| p.name)
    }

    /// One FP8 product of `rows` rows over `w` (`groups` diagonal blocks) by the kernel
    /// `kernel` names alone — `f8wg` (the warpgroup gemv) or `f8mma` (the FP8 tensor-core
    /// gemv) — whatever the knobs say, into `out`; the kernel it ran, or `None` (nothing
    /// run) where that kernel does not take the product. For the parity suite.
    pub fn decode_fp8_kernel_alone(
        &self,
        kernel: &str,
        x: &CudaBuf,
        rows: usize,
        groups: usize,
        w: &CudaWeight,
        out: &mut CudaBuf,
    ) -> Option<&'static str> {
        let g = &self.gpu;
        let op = Operand::contiguous(g.ptr(&x.mem), g.ptr(&out.mem), rows, groups, w);
        match kernel {
            "f8wg" => f8wg_plan_always(g, &op, w).map(|p| {
                f8wg_gemv(g, &p, op, w);
                p.name
            }),
            "f8mma" => f8mma_plan_always(g, &op, w).map(|p| {
                f8mma_gemv(g, &p, op, w);
                p.name
            }),
            other => panic!("no FP8 decode kernel {other}: f8wg or f8mma"),
        }
    }

    /// The kernel the engine's v2 path runs for a decode SwiGLU pair of `rows` rows: the
    /// FP8 warpgroup pair kernel where it takes the pair (`SLUICE_CUDA_F8WG` respected),
    /// else the v2 kernel, or `None` where v2 leaves it to v1. For the parity suite.
    pub fn decode_swiglu_kernel(
        &self,
        x: &CudaBuf,
        rows: usize,
        w1: &CudaWeight,
        w3: &CudaWeight,
    ) -> Option<&'static str> {
        let g = &self.gpu;
        let op = Operand::contiguous(g.ptr(&x.mem), 0, rows, 1, w1);
        f8wg_pair_plan(g, &op, w1, w3).map(|p| p.name).or_else(|| self.decode_v2_kernel(x, rows, 1, w1, Some(w3)))
    }

    /// The kernel `matmul_many` runs the FP8 products `ws` of `rows` rows of `x` in, when
    /// one warpgroup launch takes them all (`gemv_f8wg_many_*`; the knobs respected), for
    /// the parity suite.
    pub fn f8wg_many_kernel(&self, x: &CudaBuf, rows: usize, ws: &[&CudaWeight]) -> Option<&'static str> {
        let g = &self.gpu;
        super::gemv_f8wg::f8wg_many_plan(g, g.ptr(&x.mem), rows, ws).map(|p| p.name)
    }

    /// Decode steps record into a step arena of `bytes` (at least 64 KiB) that overflows
    /// never make larger: for the graph tests, steps that overflow it.
    pub fn pin_step_arena(&self, bytes: usize) {
        self.gpu.pin_step_arena(bytes);
    }

    /// The kernel attention runs a batch's layer `layer` in (`attention`, `attention_mma`
    /// or `attention_wg`), for the parity suite.
    pub fn attention_kernel(&self, layout: &KvLayout, layer: usize, plan: &BatchPlan, heads: usize) -> &'static str {
        super::attention::attention_kernel(&self.gpu, layout, layer, plan, heads).0
    }

    /// Whether `attention_projected` hands a batch of `rows` rows to `wo_a` (`groups`
    /// groups) as bf16 rows rotated back (`attention_io::projects_in_bf16`).
    pub fn attention_output_in_bf16(&self, rows: usize, groups: usize, wo_a: &CudaWeight) -> bool {
        super::attention_io::projects_in_bf16(&self.gpu, rows, groups, wo_a)
    }

    /// Whether `wo_a`'s product hands `wo_b` (of `rows` rows) bf16 rows stored by cuBLAS
    /// (`attention_io::wo_a_hands_bf16`), where the attention output went to `wo_a` in bf16.
    pub fn wo_a_output_in_bf16(&self, rows: usize, wo_b: &CudaWeight) -> bool {
        super::attention_io::wo_a_hands_bf16(&self.gpu, rows, wo_b)
    }

    /// Whether `hc_post_pre` of `rows` rows takes `hc_post_mix_rows` (a prefill's residual
    /// update and next mixing product in one pass), for the parity suite.
    pub fn hc_post_pre_in_one_pass(&self, rows: usize, w: &crate::backend::HcWeights<Self>) -> bool {
        super::hc::post_pre_in_one_pass(&self.gpu, rows, w)
    }

    /// Whether `x` carries its values rounded to bf16 beside them (`CudaBuf::bf16`: a
    /// prefill's mHC collapse stores them for the products), for the parity suite.
    pub fn carries_bf16_rows(&self, x: &CudaBuf) -> bool {
        x.bf16.is_some()
    }

    /// Whether a step's first mHC boundary of `rows` rows reads the embedding's rows
    /// alone (`hc_mix_copies_rows`, `hc_post_mix_rows` on the copies), for the parity suite.
    pub fn hc_copies_from_rows(&self, rows: usize, w: &crate::backend::HcWeights<Self>) -> bool {
        super::hc::copies_from_rows(&self.gpu, rows, w)
    }

    /// How many of `ws`, products of one input of `rows` rows through `matmul_many`, share
    /// one batched cuBLAS call of chunks (`chunked_products`; 0 where none do), for the
    /// parity suite.
    pub fn products_in_chunks(&self, rows: usize, ws: &[&CudaWeight]) -> usize {
        let g = &self.gpu;
        let on_cublas = g.activations == crate::Activations::Bf16
            && ws.len() > 1
            && (ws.iter().all(|w| super::cublas_bf16::takes(rows, w))
                || super::chunked_products::below_cublas(g, rows, ws.iter().copied()));
        let joining = ws.iter().filter(|w| super::chunked_products::joins(rows, w)).count();
        if on_cublas && joining > 1 { joining } else { 0 }
    }

    /// Whether the routed experts of a top-k decode batch of `rows` rows run as cuBLAS
    /// batched products (BF16 experts, `moe_cublas`), for the parity suite.
    pub fn cublas_experts(&self, rows: usize, w: &MoeWeights<Self>) -> bool {
        super::moe_cublas::slot_rows(rows, rows, w).is_some()
    }

    /// Whether the routed experts of a batch whose routing is read back and which routes
    /// `pairs` (row, expert) pairs to them run as bf16 rows gathered at once, one cuBLAS
    /// product an expert and projection and one combine (`moe_host`), for the parity suite.
    pub fn routed_rows_in_bf16(&self, pairs: usize, w: &MoeWeights<Self>) -> bool {
        super::moe_host::takes_bf16_rows(&self.gpu, w, pairs)
    }

    /// Whether v2 runs the routed experts of a decode batch of `rows` rows (else v1 does).
    pub fn decode_v2_experts(&self, rows: usize, w: &MoeWeights<Self>) -> bool {
        experts_v2_plan(rows, w).is_some() || segments_plan(rows, w).is_some()
    }

    /// Whether the routed experts of a prefill-sized batch run on the grouped FP4 `wgmma`
    /// products (`moe_fp4wg`), for the parity suite.
    pub fn grouped_fp4wg(&self, w: &MoeWeights<Self>) -> bool {
        super::moe_fp4wg::takes(&self.gpu, w)
    }

    /// Whether a product of `rows` rows over the FP8 weight `w` in `groups` groups runs on
    /// `fp8wg_gemm` (past the gemv launches' rows), for the parity suite.
    pub fn fp8wg_takes(&self, rows: usize, groups: usize, w: &CudaWeight) -> bool {
        let op = shape_operand(rows, groups, w);
        super::moe_fp4wg::fp8_takes(&self.gpu, &op, w)
    }

    /// Whether a product of `rows` decode rows (9 to 64) over `w` runs on `fp8wg_gemm`
    /// rather than the gemv loops (`matmul::fp8_rows_on_wgmma`).
    pub fn fp8wg_takes_decode_rows(&self, rows: usize, groups: usize, w: &CudaWeight) -> bool {
        let op = shape_operand(rows, groups, w);
        super::matmul::fp8_rows_on_wgmma(&self.gpu, &op, w)
    }

    /// `out = silu(min(x·w1ᵀ, limit)) * clamp(x·w3ᵀ, ±limit)` of any number of rows through
    /// the engine's SwiGLU pair (`matmul::swiglu_pair`), and whether the pair ran as two
    /// products on `fp8wg_gemm` (`matmul::swiglu_on_wgmma`).
    pub fn swiglu_rows(
        &self,
        x: &CudaBuf,
        rows: usize,
        w1: &CudaWeight,
        w3: &CudaWeight,
        limit: f32,
        out: &mut CudaBuf,
    ) -> bool {
        let op = self.pair_operand(x, rows, w1, out);
        let on_wgmma = super::matmul::swiglu_on_wgmma(&self.gpu, &op, w1, w3);
        swiglu_pair(&self.gpu, op, w1, w3, limit, super::matmul::Decode::from_env());
        on_wgmma
    }

    /// The GPU's streaming multiprocessors.
    pub fn sms(&self) -> usize {
        self.gpu.sms
    }

    /// Into how many slices along K the engine cuts a decode product of `rows` rows over
    /// `w` on `fp8wg_gemm` (`matmul::fp8_splits`; 1: not split).
    pub fn fp8wg_decode_splits(&self, rows: usize, groups: usize, w: &CudaWeight) -> usize {
        let op = shape_operand(rows, groups, w);
        super::matmul::fp8_splits(&self.gpu, &op, w)
    }

    /// `x[rows, K] · Wᵀ` for an FP4 weight both ways: the BF16 tensor-core GEMM the
    /// engine uses (split activations) and the FP8 tensor-core variant (e4m3
    /// activations), for the parity suite's comparison of their errors.
    pub fn fp4_gemm_both(&self, x: &[f32], rows: usize, w: &CudaWeight) -> (Vec<f32>, Vec<f32>) {
        let g = &self.gpu;
        assert_eq!(x.len(), rows * w.cols, "x is not [rows, {}]", w.cols);
        let xd = self.upload(x);
        let (a, b) = (self.zeros(rows * w.rows), self.zeros(rows * w.rows));
        let op =
            Operand { x: g.ptr(&xd.mem), x_stride: w.cols, out: g.ptr(&a.mem), out_stride: w.rows, rows, groups: 1 };
        gemm(g, "gemm_fp4", op, w, None);
        gemm_fp4_f8(g, Operand { out: g.ptr(&b.mem), ..op }, w, None);
        (self.download(&a), self.download(&b))
    }

    /// The BF16 tensor-core peak as cuBLAS reaches it: TFLOP/s of an 8192³ BF16 × BF16 →
    /// f32 GEMM (`reps` calls back to back), the ceiling prefill is read against.
    pub fn bf16_peak_tflops(&self, reps: usize) -> f64 {
        const N: usize = 8192;
        let us = self.time_cublas_bf16(N, N, N, 1, reps);
        2.0 * (N * N * N) as f64 / (us * 1e-6) / 1e12
    }

    /// cuBLAS BF16 × BF16 → f32 GEMM, `batch` products of `rows × n × k`, microseconds.
    fn time_cublas_bf16(&self, rows: usize, n: usize, k: usize, batch: usize, reps: usize) -> f64 {
        let g = &self.gpu;
        let bits = |len: usize, salt: u64| -> Vec<u16> {
            noise(len, salt).into_iter().map(crate::quant::f32_to_bf16).collect()
        };
        let a = g.upload(&bits(batch * n * k, 11));
        let xb = g.upload(&bits(batch * rows * k, 12));
        let c = g.alloc::<f32>(batch * rows * n);
        // x as `batch` groups of k columns side by side per row, as the grouped layout
        // `BlasOp::Strided` describes (ldb = batch·k): the same shapes and bytes per product.
        let (bf16, ldb, ldc) = (cudaDataType::CUDA_R_16BF, batch * k, batch * n);
        let (a, b, c) = (g.ptr(&a), g.ptr(&xb), g.ptr(&c));
        let product = BlasOp::Strided {
            a,
            a_type: bf16,
            b,
            b_type: bf16,
            ldb,
            c,
            c_type: cudaDataType::CUDA_R_32F,
            ldc,
            m: n,
            n: rows,
            k,
            groups: batch,
            beta: 0.0,
        };
        // SAFETY: a, xb and c were allocated above with exactly those shapes.
        self.time_kernel_us(reps, || unsafe { g.blas(product.clone()) }).gpu_us
    }
}

fn decode_variant(v: &str) -> Decode {
    Decode::parse(v).unwrap_or_else(|| panic!("decode kernels {v:?}: v1 or v2"))
}

/// An operand with no buffers behind it, only the shape of `rows` rows over `w` in
/// `groups` groups: what the dispatch rules read.
fn shape_operand(rows: usize, groups: usize, w: &CudaWeight) -> Operand {
    Operand { x: 0, x_stride: groups * w.cols, out: 0, out_stride: w.rows, rows, groups }
}
