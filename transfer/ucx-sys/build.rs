//! Links libucp/libucs and compiles `csrc/layout.c`, the C side of the layout test.

use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc/layout.c");
    println!("cargo:rerun-if-env-changed=UCX_PREFIX");

    let prefix = env::var_os("UCX_PREFIX").map(PathBuf::from);
    let candidates: Vec<PathBuf> = match &prefix {
        Some(prefix) => vec![prefix.join("include")],
        None => vec!["/usr/include".into(), "/usr/local/include".into()],
    };
    let Some(include) = candidates.iter().find(|dir| dir.join("ucp/api/ucp.h").is_file()) else {
        let searched: Vec<String> = candidates.iter().map(|d| d.display().to_string()).collect();
        panic!(
            "\n\nucx-sys: UCX headers not found (looked for ucp/api/ucp.h in {}).\n\
             Install them with `apt-get install libucx-dev` (Debian/Ubuntu),\n\
             or set UCX_PREFIX to the prefix of a UCX 1.13 installation.\n\n",
            searched.join(", ")
        );
    };
    warn_on_other_api_version(include);

    cc::Build::new()
        .file("csrc/layout.c")
        .include(include)
        .warnings(true)
        .extra_warnings(true)
        .compile("ucx_sys_layout");

    if let Some(prefix) = &prefix {
        println!("cargo:rustc-link-search=native={}", prefix.join("lib").display());
    }
    println!("cargo:rustc-link-lib=dylib=ucp");
    println!("cargo:rustc-link-lib=dylib=ucs");
    println!("cargo:include={}", include.display());
}

/// The declarations in src/raw.rs follow the 1.13 headers; other versions may still match
/// (the layout test decides), but say so up front.
fn warn_on_other_api_version(include: &std::path::Path) {
    let Ok(text) = fs::read_to_string(include.join("ucp/api/ucp_version.h")) else { return };
    let value = |name: &str| {
        text.lines().find_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name)).then(|| words.next().map(str::to_owned))?
        })
    };
    let (major, minor) = (value("UCP_API_MAJOR"), value("UCP_API_MINOR"));
    if (major.as_deref(), minor.as_deref()) != (Some("1"), Some("13")) {
        println!(
            "cargo:warning=ucx-sys is written against UCX 1.13; found UCP API {}.{} in {} \
             (run `cargo test -p ucx-sys --test layout` to check the bindings)",
            major.unwrap_or_default(),
            minor.unwrap_or_default(),
            include.display()
        );
    }
}
