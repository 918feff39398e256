//! Stored tensors → f32 (the CPU path computes in f32): float dtypes are widened,
//! FP8 e4m3 weights are scaled per 128×128 block, packed FP4 e2m1 weights per 32
//! inputs, with ue8m0 scales stored as F8_E8M0, U8 bytes or float containers.

use kernels::quant::{self, QuantError};
use safetensors::Dtype;

use super::CheckpointError;
use super::files::RawTensor;

/// FP8 block shape DeepSeek checkpoints use (`weight_block_size`).
pub const FP8_BLOCK: (usize, usize) = (128, 128);
/// Inputs per FP4 scale.
pub const FP4_GROUP: usize = 32;

fn shape_err(t: &RawTensor<'_>, expected: &[usize]) -> CheckpointError {
    CheckpointError::Shape { tensor: t.name.to_string(), expected: expected.to_vec(), actual: t.shape.to_vec() }
}

fn dtype_err(t: &RawTensor<'_>, what: &str) -> CheckpointError {
    CheckpointError::Dtype { tensor: t.name.to_string(), dtype: format!("{:?}", t.dtype), expected: what.to_string() }
}

fn quant_err(t: &RawTensor<'_>, e: QuantError) -> CheckpointError {
    CheckpointError::Quant { tensor: t.name.to_string(), reason: e.to_string() }
}

fn u16s(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]))
}

/// Widen a float tensor (F32, BF16, F16) to f32, checking its shape.
pub fn floats(t: &RawTensor<'_>, expected: &[usize]) -> Result<Vec<f32>, CheckpointError> {
    if t.shape != expected {
        return Err(shape_err(t, expected));
    }
    widen(t)
}

fn widen(t: &RawTensor<'_>) -> Result<Vec<f32>, CheckpointError> {
    Ok(match t.dtype {
        Dtype::F32 => t.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => u16s(t.bytes).map(quant::bf16_to_f32).collect(),
        Dtype::F16 => u16s(t.bytes).map(quant::f16_to_f32).collect(),
        _ => return Err(dtype_err(t, "F32, BF16 or F16")),
    })
}

/// ue8m0 scales in any of the containers checkpoints use.
fn scales(t: &RawTensor<'_>) -> Result<Vec<f32>, CheckpointError> {
    match t.dtype {
        Dtype::F8_E8M0 | Dtype::U8 => Ok(t.bytes.iter().map(|&b| quant::ue8m0_to_f32(b)).collect()),
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => widen(t),
        _ => Err(dtype_err(t, "F8_E8M0, U8 or a float dtype (block scales)")),
    }
}

fn grid(t: &RawTensor<'_>) -> Result<(usize, usize), CheckpointError> {
    match t.shape {
        [r, c] => Ok((*r, *c)),
        _ => Err(CheckpointError::Quant {
            tensor: t.name.to_string(),
            reason: format!("scale must be 2-D, got {:?}", t.shape),
        }),
    }
}

/// Decode a `[rows, cols]` weight matrix in whatever format it is stored.
pub fn matrix(
    t: &RawTensor<'_>,
    scale: Option<&RawTensor<'_>>,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>, CheckpointError> {
    let missing_scale = || CheckpointError::Quant {
        tensor: t.name.to_string(),
        reason: format!("{:?} weights need a block-scale tensor (`.scale` or `_scale_inv`) beside them", t.dtype),
    };
    match t.dtype {
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => floats(t, &[rows, cols]),
        Dtype::F8_E4M3 => {
            if t.shape != [rows, cols] {
                return Err(shape_err(t, &[rows, cols]));
            }
            let s = scale.ok_or_else(missing_scale)?;
            quant::dequant_fp8_blocks(t.bytes, rows, cols, &scales(s)?, grid(s)?, FP8_BLOCK)
                .map_err(|e| quant_err(s, e))
        }
        // Packed FP4: I8/U8 bytes hold two values each; F4 counts values.
        Dtype::I8 | Dtype::U8 | Dtype::F4 => {
            let stored_cols = if t.dtype == Dtype::F4 { cols } else { cols / 2 };
            if !cols.is_multiple_of(2) || t.shape != [rows, stored_cols] {
                return Err(shape_err(t, &[rows, stored_cols]));
            }
            let s = scale.ok_or_else(missing_scale)?;
            quant::dequant_fp4_groups(t.bytes, rows, cols, &scales(s)?, grid(s)?, FP4_GROUP)
                .map_err(|e| quant_err(s, e))
        }
        _ => Err(dtype_err(t, "F32, BF16, F16, F8_E4M3 (+scale) or packed FP4 (+scale)")),
    }
}

/// Integer table (e.g. `tid2eid`) with its shape checked.
pub fn ints(t: &RawTensor<'_>, expected: &[usize]) -> Result<Vec<i64>, CheckpointError> {
    if t.shape != expected {
        return Err(shape_err(t, expected));
    }
    Ok(match t.dtype {
        Dtype::I64 => t.bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
        Dtype::U64 => t.bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
        Dtype::I32 => t.bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
        Dtype::U32 => t.bytes.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
        Dtype::I16 => t.bytes.chunks_exact(2).map(|c| i16::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
        Dtype::U16 => u16s(t.bytes).map(|v| v as i64).collect(),
        Dtype::I8 => t.bytes.iter().map(|&b| b as i8 as i64).collect(),
        Dtype::U8 => t.bytes.iter().map(|&b| b as i64).collect(),
        _ => return Err(dtype_err(t, "an integer dtype")),
    })
}
