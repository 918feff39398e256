//! Read-only memory maps of weight files. Lives here because mapping a file is
//! `unsafe` (the OS may change the bytes under us) and this crate is where sluice keeps
//! its unsafe code.

use std::fs::File;

pub use memmap2::Mmap;

/// Map a file read-only.
pub fn map_readonly(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the mapping is read-only. Checkpoint files are inputs that are not
    // modified while a process serves them; truncating one underneath a running server
    // is an operator error this cannot guard against (reads would fault, not corrupt).
    unsafe { Mmap::map(file) }
}
