//! Entry storage in host memory: owned by the backend, or adopted from someone else
//! (a transport-allocated region that remote peers write pages into).

use crate::EntryDtype;
use crate::backend::ExternalMemory;
use crate::quant::{bf16_to_f32, f32_to_bf16};

enum Mem {
    /// u64 words keep every element type aligned.
    Owned(Vec<u64>),
    External(Box<dyn ExternalMemory>),
}

/// Entries of one dtype: pages, window rings, or (always f32) compressor slots.
pub struct CpuKv {
    dtype: EntryDtype,
    /// Elements (not bytes).
    len: usize,
    mem: Mem,
}

impl std::fmt::Debug for CpuKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.mem {
            Mem::Owned(_) => "owned",
            Mem::External(_) => "external",
        };
        write!(f, "CpuKv({} x {}, {kind})", self.len, self.dtype.name())
    }
}

impl CpuKv {
    pub fn zeroed(elems: usize, dtype: EntryDtype) -> Self {
        let words = (elems * dtype.size()).div_ceil(8);
        CpuKv { dtype, len: elems, mem: Mem::Owned(vec![0; words]) }
    }

    /// Use external memory for `elems` entries; fails if it is too small or misaligned.
    pub fn adopt(mem: Box<dyn ExternalMemory>, elems: usize, dtype: EntryDtype) -> Result<Self, String> {
        let need = elems * dtype.size();
        if mem.len() < need {
            return Err(format!("external region holds {} bytes, {need} needed", mem.len()));
        }
        if !(mem.as_ptr() as usize).is_multiple_of(8) {
            return Err("external region is not 8-byte aligned".into());
        }
        Ok(CpuKv { dtype, len: elems, mem: Mem::External(mem) })
    }

    pub fn dtype(&self) -> EntryDtype {
        self.dtype
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bytes(&self) -> &[u8] {
        let n = self.len * self.dtype.size();
        match &self.mem {
            Mem::Owned(v) => &bytemuck::cast_slice(v)[..n],
            // SAFETY: ExternalMemory guarantees `len()` valid, aligned, non-moving bytes
            // for the object's lifetime; `adopt` checked len() >= n.
            Mem::External(m) => unsafe { std::slice::from_raw_parts(m.as_ptr(), n) },
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.len * self.dtype.size();
        match &mut self.mem {
            Mem::Owned(v) => &mut bytemuck::cast_slice_mut(v)[..n],
            // SAFETY: as in `bytes`; `&mut self` makes this the only local view.
            Mem::External(m) => unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), n) },
        }
    }

    /// The storage as f32 elements (F32 dtype only).
    pub fn f32s(&self) -> &[f32] {
        assert_eq!(self.dtype, EntryDtype::F32, "f32 view of {} storage", self.dtype.name());
        bytemuck::cast_slice(self.bytes())
    }

    pub fn f32s_mut(&mut self) -> &mut [f32] {
        assert_eq!(self.dtype, EntryDtype::F32, "f32 view of {} storage", self.dtype.name());
        bytemuck::cast_slice_mut(self.bytes_mut())
    }

    /// Read `out.len()` elements starting at element `offset`, widened to f32.
    pub fn read(&self, offset: usize, out: &mut [f32]) {
        let n = out.len();
        match self.dtype {
            EntryDtype::F32 => out.copy_from_slice(&self.f32s()[offset..offset + n]),
            EntryDtype::Bf16 => {
                let v: &[u16] = bytemuck::cast_slice(self.bytes());
                out.iter_mut().zip(&v[offset..offset + n]).for_each(|(o, b)| *o = bf16_to_f32(*b))
            }
        }
    }

    /// Write f32 values starting at element `offset`, narrowed to the storage dtype.
    pub fn write(&mut self, offset: usize, data: &[f32]) {
        let n = data.len();
        match self.dtype {
            EntryDtype::F32 => self.f32s_mut()[offset..offset + n].copy_from_slice(data),
            EntryDtype::Bf16 => {
                let v: &mut [u16] = bytemuck::cast_slice_mut(self.bytes_mut());
                v[offset..offset + n].iter_mut().zip(data).for_each(|(b, x)| *b = f32_to_bf16(*x))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A heap block handed over as if a transport had allocated it.
    struct Block(*mut u64, usize);
    // SAFETY: the block is uniquely owned and freed only in Drop.
    unsafe impl Send for Block {}
    unsafe impl Sync for Block {}
    // SAFETY: the pointer comes from a live boxed slice of `len` bytes, 8-aligned.
    unsafe impl ExternalMemory for Block {
        fn as_ptr(&self) -> *mut u8 {
            self.0 as *mut u8
        }
        fn len(&self) -> usize {
            self.1 * 8
        }
    }
    impl Drop for Block {
        fn drop(&mut self) {
            // SAFETY: reconstructs the box leaked in `block`.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.0, self.1)) });
        }
    }
    fn block(words: usize) -> Box<Block> {
        let b: Box<[u64]> = vec![0u64; words].into_boxed_slice();
        Box::new(Block(Box::into_raw(b) as *mut u64, words))
    }

    #[test]
    fn adopted_memory_reads_and_writes_like_owned() {
        for dtype in [EntryDtype::F32, EntryDtype::Bf16] {
            let mut ext = CpuKv::adopt(block(16), 20, dtype).unwrap();
            let mut own = CpuKv::zeroed(20, dtype);
            let data: Vec<f32> = (0..7).map(|i| i as f32 * 0.75 - 2.0).collect();
            ext.write(5, &data);
            own.write(5, &data);
            assert_eq!(ext.bytes(), own.bytes());
            let mut back = vec![0f32; 7];
            ext.read(5, &mut back);
            assert_eq!(back, data);
        }
        let err = CpuKv::adopt(block(2), 20, EntryDtype::F32).unwrap_err();
        assert!(err.contains("16 bytes, 80 needed"), "{err}");
    }
}
