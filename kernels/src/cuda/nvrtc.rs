//! Run-time compilation of the kernel sources with NVRTC, once per process and source
//! version: the PTX is cached on disk, keyed by a hash of the sources, the options and
//! the target architecture, so later processes load it without compiling (the driver
//! then JIT-compiles PTX to machine code, and keeps its own cache of that).
//!
//! Cache directory: `$SLUICE_PTX_CACHE`, else `$XDG_CACHE_HOME/sluice/ptx`, else
//! `$HOME/.cache/sluice/ptx`; a cache that cannot be written only costs a compile.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use sha2::{Digest, Sha256};

use super::runtime::CudaError;

/// The sources, concatenated in this order into one program (no include paths).
const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("cu/common.cuh")),
    ("rows.cu", include_str!("cu/rows.cu")),
    ("gemv.cu", include_str!("cu/gemv.cu")),
    ("gemm.cu", include_str!("cu/gemm.cu")),
    ("gemm_f8.cu", include_str!("cu/gemm_f8.cu")),
    ("gemm_rows.cu", include_str!("cu/gemm_rows.cu")),
    ("tcgemv.cu", include_str!("cu/tcgemv.cu")),
    ("hc.cu", include_str!("cu/hc.cu")),
    ("hc_rows.cu", include_str!("cu/hc_rows.cu")),
    ("hc_rows_tc.cu", include_str!("cu/hc_rows_tc.cu")),
    ("moe.cu", include_str!("cu/moe.cu")),
    ("moe_slots.cu", include_str!("cu/moe_slots.cu")),
    ("compress.cu", include_str!("cu/compress.cu")),
    ("indexer.cu", include_str!("cu/indexer.cu")),
    ("attention.cu", include_str!("cu/attention.cu")),
    ("attention_mma.cu", include_str!("cu/attention_mma.cu")),
    ("checksum.cu", include_str!("cu/checksum.cu")),
    ("decode2.cu", include_str!("cu/decode2.cu")),
    ("decode2_segments.cu", include_str!("cu/decode2_segments.cu")),
    ("indexer_mma.cu", include_str!("cu/indexer_mma.cu")),
    ("readout.cu", include_str!("cu/readout.cu")),
    ("gemv_f8mma.cu", include_str!("cu/gemv_f8mma.cu")),
    ("gemv_f8wg.cu", include_str!("cu/gemv_f8wg.cu")),
    ("moe_wgmma.cu", include_str!("cu/moe_wgmma.cu")),
    ("moe_fp4wg.cu", include_str!("cu/moe_fp4wg.cu")),
    ("attention_wg.cu", include_str!("cu/attention_wg.cu")),
    ("indexer_wg.cu", include_str!("cu/indexer_wg.cu")),
];

/// No fast-math: sincos, exp and division stay IEEE-accurate, as the CPU reference is.
const OPTIONS: &[&str] = &["--std=c++17"];

pub(crate) fn source() -> String {
    let mut s = String::new();
    for (name, text) in SOURCES {
        s.push_str(&format!("// ---- {name} ----\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// `compute_XY` for the device: on Hopper `compute_90a`, the target whose PTX may use the
/// warpgroup instructions (`wgmma`, cu/gemv_f8wg.cu); such PTX runs on sm_90 parts only,
/// and it is compiled for the device at hand.
fn arch(cc: (i32, i32)) -> &'static str {
    match cc {
        (9, 0) => "compute_90a",
        (8, 9) => "compute_89",
        (8, 6) => "compute_86",
        (8, 0) => "compute_80",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        // Newer parts run compute_90 PTX through the driver's JIT.
        _ => "compute_90",
    }
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("SLUICE_PTX_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("sluice/ptx"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sluice/ptx"))
}

/// Compile (or load from the cache) and load the module. Returns it with a note of
/// where the PTX came from, for the start-up log.
pub(crate) fn load(ctx: &Arc<CudaContext>, cc: (i32, i32)) -> Result<(Arc<CudaModule>, String), CudaError> {
    let src = source();
    let arch = arch(cc);
    let mut h = Sha256::new();
    h.update(src.as_bytes());
    h.update(arch.as_bytes());
    for o in OPTIONS {
        h.update(o.as_bytes());
    }
    let key: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
    let path = cache_dir().map(|d| d.join(format!("sluice-{key}-{arch}.ptx")));
    if let Some(p) = &path
        && let Ok(text) = std::fs::read_to_string(p)
        && let Ok(m) = ctx.load_module(Ptx::from_src(text))
    {
        return Ok((m, format!("cached PTX {}", p.display())));
    }
    let opts = CompileOptions {
        arch: Some(arch),
        options: OPTIONS.iter().map(|s| s.to_string()).collect(),
        name: Some("sluice.cu".into()),
        ..Default::default()
    };
    let t = std::time::Instant::now();
    let ptx = compile_ptx_with_opts(&src, opts).map_err(|e| CudaError::Compile(compile_log(&e)))?;
    let text = ptx.to_src();
    let mut origin = format!("compiled with NVRTC for {arch} in {:.1} s", t.elapsed().as_secs_f64());
    if let Some(p) = &path {
        match write_atomic(p, &text) {
            Ok(()) => origin.push_str(&format!(", cached at {}", p.display())),
            Err(e) => origin.push_str(&format!(", not cached ({e})")),
        }
    }
    let m = ctx.load_module(Ptx::from_src(text)).map_err(|e| CudaError::Driver(format!("module load: {e:?}")))?;
    Ok((m, origin))
}

fn compile_log(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}

/// Write via a temporary file and rename, so a concurrent reader never sees half a file.
fn write_atomic(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}
