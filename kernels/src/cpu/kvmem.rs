//! Entry storage in host memory: owned by the backend, or adopted from someone else
//! (a transport-allocated region that remote peers write pages into).

use crate::EntryDtype;
use crate::backend::ExternalMemory;
use crate::kv_entry;
use crate::kv_layout::EntryFormat;

enum Mem {
    /// u64 words keep every element type aligned.
    Owned(Vec<u64>),
    External(Box<dyn ExternalMemory>),
}

/// Entries of one dtype: pages, window rings, or (always f32) compressor slots.
pub struct CpuKv {
    dtype: EntryDtype,
    /// Elements (not bytes; for fp8 an element is a byte).
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

    /// Decode the entry stored at element `offset` into `out` (`fmt.dim` values).
    pub fn read_entry(&self, offset: usize, fmt: &EntryFormat, out: &mut [f32]) {
        debug_assert_eq!(fmt.dtype, self.dtype, "entry format of another dtype");
        let at = offset * self.dtype.size();
        kv_entry::decode(fmt, &self.bytes()[at..at + fmt.bytes()], out)
    }

    /// Encode `data` (`fmt.dim` values) as the entry at element `offset`.
    pub fn write_entry(&mut self, offset: usize, fmt: &EntryFormat, data: &[f32]) {
        debug_assert_eq!(fmt.dtype, self.dtype, "entry format of another dtype");
        let at = offset * self.dtype.size();
        kv_entry::encode(fmt, data, &mut self.bytes_mut()[at..at + fmt.bytes()])
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
        for dtype in EntryDtype::ALL {
            let fmt = EntryFormat { dtype, dim: 7, tail: 3 };
            let elems = 20 * 4 / dtype.size();
            let mut ext = CpuKv::adopt(block(16), elems, dtype).unwrap();
            let mut own = CpuKv::zeroed(elems, dtype);
            let data: Vec<f32> = (0..7).map(|i| i as f32 * 0.75 - 2.0).collect();
            let at = 8 / dtype.size();
            ext.write_entry(at, &fmt, &data);
            own.write_entry(at, &fmt, &data);
            assert_eq!(ext.bytes(), own.bytes());
            let mut back = vec![0f32; 7];
            ext.read_entry(at, &fmt, &mut back);
            assert_eq!(back, data, "{}", dtype.name());
        }
        let err = CpuKv::adopt(block(2), 20, EntryDtype::F32).unwrap_err();
        assert!(err.contains("16 bytes, 80 needed"), "{err}");
    }
}
