//! The stored-format products alone, for `sluice bench engine`'s kernel table: decode
//! gemv over FP4 experts and FP8/BF16 projections against the device's copy bandwidth,
//! and the tensor-core GEMMs (FP8 projections, FP4 experts grouped) against a cuBLAS
//! BF16 GEMM of the same shape in the same run. Weights are random values in the
//! stored formats; gemv rotates over enough distinct weights to exceed the L2 cache, so
//! it measures device memory, not the cache.

use cudarc::cublas::sys::cudaDataType;

use super::CudaBackend;
use super::matmul::{GEMM_BM, Operand, Tiles, cublas_gemm, gemm, gemm_fp4_f8, gemm_kernel, gemv_simt, matmul};
use super::memory::CudaWeight;
use crate::backend::Backend;
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

fn noise(n: usize, salt: u64) -> Vec<f32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ salt.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
        })
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
        // Decode gemv at one row: an expert's gate projection (FP4, 2048 × 4096, 64 of
        // them: 276 MB), a projection like wo_a (8192 × 4096) in FP8 and BF16 (8 copies).
        let gemv_sets: [(&str, OwnedFormat, usize, usize, usize); 3] = [
            ("gemv fp4 expert 2048x4096", OwnedFormat::Fp4, 2048, 4096, 64),
            ("gemv fp8 8192x4096", OwnedFormat::Fp8, 8192, 4096, 8),
            ("gemv bf16 8192x4096", OwnedFormat::Bf16, 8192, 4096, 8),
        ];
        for (what, format, n, k, copies) in gemv_sets {
            let ws: Vec<CudaWeight> = (0..copies).map(|i| stored(self, n, k, format, i as u64)).collect();
            for rows in [1usize, 8] {
                let x = self.upload(&noise(rows * k, 99));
                let y = self.zeros(rows * n);
                let g = &self.gpu;
                let op = Operand { x: g.ptr(&x.mem), x_stride: k, out: g.ptr(&y.mem), out_stride: n, rows, groups: 1 };
                // The engine's choice (tensor cores for these formats), then the SIMT kernels.
                for (label, simt) in [("", false), (" simt", true)] {
                    let mut i = 0;
                    let t = self.time_kernel_us(reps * copies, || {
                        let w = &ws[i % copies];
                        if simt {
                            gemv_simt(g, op, w, None, 0.0)
                        } else {
                            matmul(g, op, w)
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
                let (wp, sp) = super::matmul::weight_ptrs(g, w);
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
        self.take_traffic();
        out
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
        // cublas_gemm describes (ldb = batch·k): the same shapes and bytes per product.
        self.time_kernel_us(reps, || {
            cublas_gemm(
                g,
                g.ptr(&a),
                cudaDataType::CUDA_R_16BF,
                g.ptr(&xb),
                cudaDataType::CUDA_R_16BF,
                batch * k,
                g.ptr(&c),
                batch * n,
                n,
                rows,
                k,
                batch,
                0.0,
            )
        })
        .gpu_us
    }
}
