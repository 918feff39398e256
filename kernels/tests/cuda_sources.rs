//! Checks on the CUDA kernel sources that need no GPU (they run in CI on any machine).
//!
//! Every kernel is launched with programmatic dependent launch (`Gpu::launch_raw` in
//! `src/cuda/runtime.rs`): it may be placed while the kernel before it is finishing, so
//! it must wait (`griddepcontrol.wait`) before touching memory an earlier kernel writes.
//! A kernel that forgot would read stale activations only on GPUs and only sometimes;
//! this test makes the rule a build failure instead.

use std::path::Path;

/// `(kernel name, body)` of every `__global__` function in `src`, macro-defined ones
/// included (their name is the macro parameter).
fn kernels(src: &str) -> Vec<(String, String)> {
    functions(src, "__global__")
}

/// `(name, body)` of every function whose declaration starts with `marker`.
fn functions(src: &str, marker: &str) -> Vec<(String, String)> {
    let bytes = src.as_bytes();
    let matching = |open_at: usize, open: u8, close: u8| -> usize {
        let mut depth = 0usize;
        for (i, &c) in bytes.iter().enumerate().skip(open_at) {
            if c == open {
                depth += 1;
            } else if c == close {
                depth -= 1;
                if depth == 0 {
                    return i;
                }
            }
        }
        panic!("unbalanced {} in the kernel sources", open as char);
    };
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = src[from..].find(marker) {
        let mut i = from + at + marker.len();
        let mut paren = i + src[i..].find('(').expect("kernel parameter list");
        if src[i..paren].trim_end().ends_with("__launch_bounds__") {
            i = matching(paren, b'(', b')') + 1;
            paren = i + src[i..].find('(').expect("kernel parameter list");
        }
        // The last word before the parameters (after `void`, `__forceinline__`, …).
        let name = src[i..paren].split(|c: char| c.is_whitespace() || c == '\\').rfind(|w| !w.is_empty());
        let name = name.unwrap_or_default().to_string();
        let params_end = matching(paren, b'(', b')');
        let open = params_end + src[params_end..].find('{').expect("kernel body");
        let close = matching(open, b'{', b'}');
        out.push((name, src[open + 1..close].to_string()));
        from = close;
    }
    out
}

#[test]
fn every_kernel_waits_for_the_kernel_before_it() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda/cu");
    let mut checked = 0;
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("kernel sources") {
        let path = entry.expect("directory entry").path();
        if path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        let src = std::fs::read_to_string(&path).expect("kernel source");
        for (name, body) in kernels(&src) {
            checked += 1;
            // Either the first statement waits (and lets the next kernel be placed), or the
            // kernel (or the device function it consists of) waits after work that touches
            // only memory no kernel writes (weights, the plan's uploads): a later
            // pdl_begin() or pdl_wait().
            let waits = |b: &str| b.contains("pdl_wait()") || b.contains("pdl_begin();");
            let body_waits = waits(&body)
                || functions(&src, "__device__").iter().any(|(f, b)| body.contains(&format!("{f}<")) && waits(b));
            if !body_waits {
                missing.push(format!("{} in {}", name, path.file_name().unwrap().to_string_lossy()));
            }
        }
    }
    assert!(checked >= 50, "found only {checked} kernels under {}: is the parser still right?", dir.display());
    assert!(missing.is_empty(), "kernels that never wait for the kernel before them: {missing:?}");
}

#[test]
fn the_parser_finds_macro_and_plain_kernels() {
    let src = r#"
        extern "C" __global__ void __launch_bounds__(256, 1) plain(int* x) { pdl_begin(); if (x) { x[0] = 1; } }
        #define K(NAME) \
            extern "C" __global__ void NAME(float* y) { \
                y[0] = 2.0f; \
            }
    "#;
    let found = kernels(src);
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].0, "plain");
    assert!(found[0].1.trim_start().starts_with("pdl_begin();"));
    assert!(found[0].1.contains("x[0] = 1;"));
    assert_eq!(found[1].0, "NAME");
    assert!(!found[1].1.contains("pdl_begin"));
}
