//! Unit tests of the step recording's pure parts: keys and lanes.

use super::*;

fn launch(func: usize, grid: u32, params: &[u64]) -> Op {
    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    Op::Launch { func, cfg, params: params.to_vec(), offsets: (0..params.len()).collect() }
}

/// A recorded BF16 cuBLAS product (32 × 8 × 64) into f32 rows at `c`.
fn product(beta: f32, c: u64) -> Op {
    use cudarc::cublas::sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
    let (ldb, ldc, m, n, k, groups) = (64, 32, 32, 8, 64, 1);
    let (a, b, t) = (1, 2, CUDA_R_16BF);
    Op::Blas(BlasOp::Strided { a, a_type: t, b, b_type: t, ldb, c, c_type: CUDA_R_32F, ldc, m, n, k, groups, beta })
}

/// Only a cuBLAS product between a Fork and its Main or Join is on the side lane.
#[test]
fn side_lane_products_are_found() {
    let blas = || product(0.0, 3);
    assert!(!side_lane_blas(&[blas(), Op::Fork, launch(1, 1, &[]), Op::Main, blas(), Op::Join, blas()]));
    assert!(side_lane_blas(&[launch(1, 1, &[]), Op::Fork, blas(), Op::Main, Op::Join]));
    assert!(!side_lane_blas(&[Op::Fork, launch(1, 1, &[]), Op::Join]));
}

/// Keys differ when any launch's function, grid or argument differs, or an op is
/// added, and agree for equal records.
#[test]
fn record_keys_tell_steps_apart() {
    let base = || vec![launch(1, 4, &[10, 20]), Op::Memset { dst: 99, bytes: 8 }, launch(2, 8, &[30])];
    assert_eq!(record_key(&base()), record_key(&base()));
    let mut other_arg = base();
    other_arg[2] = launch(2, 8, &[31]);
    let mut other_grid = base();
    other_grid[0] = launch(1, 5, &[10, 20]);
    let mut other_func = base();
    other_func[0] = launch(3, 4, &[10, 20]);
    let mut longer = base();
    longer.push(Op::Copy { dst: 1, src: 2, bytes: 3 });
    let branch = || {
        let mut ops = base();
        ops.insert(1, Op::Fork);
        ops.insert(3, Op::Join);
        ops
    };
    let branched = branch();
    let mut on_main = branch();
    on_main.insert(2, Op::Main);
    let with_blas = |beta: f32, c: u64| {
        let mut ops = base();
        ops.insert(1, product(beta, c));
        ops
    };
    assert_eq!(record_key(&with_blas(0.0, 3)), record_key(&with_blas(0.0, 3)));
    assert_ne!(record_key(&branched), record_key(&base()));
    for (what, ops) in [
        ("argument", other_arg),
        ("grid", other_grid),
        ("function", other_func),
        ("ops", longer),
        ("branch", branched),
        ("lane", on_main),
        ("cuBLAS product", with_blas(0.0, 3)),
    ] {
        assert_ne!(record_key(&base()), record_key(&ops), "a different {what}");
    }
    for (what, ops) in [("beta", with_blas(1.0, 3)), ("output", with_blas(0.0, 4))] {
        assert_ne!(record_key(&with_blas(0.0, 3)), record_key(&ops), "a cuBLAS product's {what}");
    }
}
