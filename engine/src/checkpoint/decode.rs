//! Stored tensors → what the engine loads: weight matrices as typed views of their
//! stored bytes (BF16/F32/F16, FP8 e4m3 + 128×128 block scales, packed FP4 e2m1 +
//! per-32 scales; ue8m0 scales stored as F8_E8M0, U8 bytes or float containers), with
//! shape, dtype and scale grid checked; small float and integer tensors widened.

use kernels::quant::{self, QuantError};
use kernels::stored::{FP4_GROUP, FP8_BLOCK, Scales, Stored, WeightView};
use safetensors::Dtype;

use super::CheckpointError;
use super::files::RawTensor;

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

/// The bytes of a float tensor (F32, BF16, F16) of the given shape, unconverted.
pub fn float_bytes<'a>(t: &RawTensor<'a>, expected: &[usize]) -> Result<&'a [u8], CheckpointError> {
    if t.shape != expected {
        return Err(shape_err(t, expected));
    }
    match t.dtype {
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => Ok(t.bytes),
        _ => Err(dtype_err(t, "F32, BF16 or F16")),
    }
}

fn widen(t: &RawTensor<'_>) -> Result<Vec<f32>, CheckpointError> {
    Ok(match t.dtype {
        Dtype::F32 => t.bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => u16s(t.bytes).map(quant::bf16_to_f32).collect(),
        Dtype::F16 => u16s(t.bytes).map(quant::f16_to_f32).collect(),
        _ => return Err(dtype_err(t, "F32, BF16 or F16")),
    })
}

/// Block scales in any of the containers checkpoints use.
fn scales<'a>(t: &RawTensor<'a>) -> Result<Scales<'a>, CheckpointError> {
    match t.dtype {
        Dtype::F8_E8M0 | Dtype::U8 => Ok(Scales::Ue8m0(t.bytes)),
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => Ok(Scales::F32(widen(t)?)),
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

/// A `[rows, cols]` weight matrix as stored, with its shape, dtype and scale grid
/// checked (nothing is read beyond the scales).
pub fn weight<'a>(
    t: &RawTensor<'a>,
    scale: Option<&RawTensor<'a>>,
    rows: usize,
    cols: usize,
) -> Result<WeightView<'a>, CheckpointError> {
    let missing_scale = || CheckpointError::Quant {
        tensor: t.name.to_string(),
        reason: format!("{:?} weights need a block-scale tensor (`.scale` or `_scale_inv`) beside them", t.dtype),
    };
    let check_grid = |s: &RawTensor<'_>, want: (usize, usize), block: (usize, usize)| {
        let got = grid(s)?;
        if got == want { Ok(()) } else { Err(quant_err(s, QuantError::ScaleGrid { rows, cols, block, want, got })) }
    };
    let data = match t.dtype {
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => {
            if t.shape != [rows, cols] {
                return Err(shape_err(t, &[rows, cols]));
            }
            match t.dtype {
                Dtype::F32 => Stored::F32(t.bytes),
                Dtype::BF16 => Stored::Bf16(t.bytes),
                _ => Stored::F16(t.bytes),
            }
        }
        Dtype::F8_E4M3 => {
            if t.shape != [rows, cols] {
                return Err(shape_err(t, &[rows, cols]));
            }
            let s = scale.ok_or_else(missing_scale)?;
            check_grid(s, (rows.div_ceil(FP8_BLOCK.0), cols.div_ceil(FP8_BLOCK.1)), FP8_BLOCK)?;
            Stored::Fp8 { codes: t.bytes, scales: scales(s)? }
        }
        // Packed FP4: I8/U8 bytes hold two values each; F4 counts values.
        Dtype::I8 | Dtype::U8 | Dtype::F4 => {
            let stored_cols = if t.dtype == Dtype::F4 { cols } else { cols / 2 };
            if !cols.is_multiple_of(2) || t.shape != [rows, stored_cols] {
                return Err(shape_err(t, &[rows, stored_cols]));
            }
            let s = scale.ok_or_else(missing_scale)?;
            check_grid(s, (rows, cols.div_ceil(FP4_GROUP)), (1, FP4_GROUP))?;
            Stored::Fp4 { packed: t.bytes, scales: scales(s)? }
        }
        _ => return Err(dtype_err(t, "F32, BF16, F16, F8_E4M3 (+scale) or packed FP4 (+scale)")),
    };
    let view = WeightView { rows, cols, data };
    view.validate().map_err(|e| quant_err(t, e))?;
    Ok(view)
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
