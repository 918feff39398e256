//! The kernel names the host code launches by literal are all in the table the backend
//! loads at start (`runtime::loaded_kernels`): a name missing there panics at its first
//! launch on a GPU ("unknown CUDA kernel"), which no CPU test would otherwise see.

use std::path::Path;

/// The string literals given as the kernel of `launch!(gpu, "name", …)` in `src`.
fn launched_literals(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in src.match_indices("launch!(") {
        let args = &src[at + "launch!(".len()..];
        // The first argument (the GPU) ends at its comma; a kernel given by literal is next.
        let Some(comma) = args.find(',') else { continue };
        let rest = args[comma + 1..].trim_start();
        if let Some(lit) = rest.strip_prefix('"') {
            names.extend(lit.find('"').map(|end| lit[..end].to_string()));
        }
    }
    names
}

#[test]
fn every_kernel_launched_by_name_is_loaded() {
    let loaded: Vec<&str> = super::runtime::loaded_kernels().collect();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("kernels/src/cuda") {
        let path = entry.expect("a directory entry").path();
        // (This file's own examples are not launches.)
        if path.extension().is_none_or(|e| e != "rs") || path.ends_with("launch_names.rs") {
            continue;
        }
        let src = std::fs::read_to_string(&path).expect("a source file");
        for name in launched_literals(&src) {
            assert!(
                loaded.contains(&name.as_str()),
                "{} launches {name}, which runtime.rs does not load",
                path.display()
            );
            seen += 1;
        }
    }
    // The scan itself works: the sources launch some fifty kernels by literal name.
    assert!(seen > 40, "only {seen} launches by name found: the scan no longer matches the launch! calls");
}

#[test]
fn literals_are_read_from_launch_calls() {
    let src = r#"launch!(g, "a_kernel", cfg(1), x); launch!(
        gpu,
        "other",
    ); launch!(g, name, cfg(1));"#;
    assert_eq!(launched_literals(src), ["a_kernel", "other"]);
}
