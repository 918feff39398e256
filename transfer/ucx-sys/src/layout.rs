//! The C compiler's view of the UCX headers (from `csrc/layout.c`), for checking that
//! the declarations in [`raw`] match them byte for byte.

use std::ffi::{CStr, c_char};

use crate::raw;

/// Every entry of the C table: `("sizeof T" | "alignof T" | "offsetof T.field" |
/// "const NAME", value)`.
pub fn c_table() -> Vec<(String, i64)> {
    // SAFETY: a pure function over a static table.
    let len = unsafe { raw::ucx_sys_layout_len() };
    (0..len)
        .map(|i| {
            let mut name: *const c_char = std::ptr::null();
            let mut value = 0i64;
            // SAFETY: i < len, so the entry exists; both out-pointers are valid.
            let found = unsafe { raw::ucx_sys_layout_entry(i, &mut name, &mut value) };
            assert_eq!(found, 1, "layout entry {i} of {len} missing");
            // SAFETY: table names are static NUL-terminated string literals.
            let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
            (name, value)
        })
        .collect()
}
