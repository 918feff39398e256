#!/usr/bin/env python3
"""Compile sluice's CUDA kernels without a GPU: the same NVRTC program the backend builds
at run time (kernels/src/cuda/cu/*.cu concatenated in the order nvrtc.rs lists them,
compute_90a, no fast-math), then ptxas for sm_90a with its resource report (registers,
shared memory, stack frame, spills per kernel). Catches compile errors and register
spills before any device time is spent.

    python3 tools/cuda/check_kernels.py            # errors and a per-kernel table
    python3 tools/cuda/check_kernels.py --ptx out.ptx --only gemv_fp4
    python3 tools/cuda/check_kernels.py --sass gemv_fp4_r1    # disassembly of one kernel
    python3 tools/cuda/check_kernels.py --cache .device/ptx    # the backend's PTX cache file

The pinned NVRTC and ptxas come from PyPI (nvidia-cuda-nvrtc, nvidia-cuda-nvcc 13.0.88,
the CUDA release of the lent H200 machines) in a venv under target/cuda-tools, made on
first use; cuobjdump and nvdisasm (for --sass) from nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm 13.2.51 (the oldest on PyPI; they read sm_90 objects from ptxas 13.0).
"""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CU = ROOT / "kernels/src/cuda/cu"
VENV = ROOT / "target/cuda-tools"
PINS = ["nvidia-cuda-nvrtc==13.0.88", "nvidia-cuda-nvcc==13.0.88"]
SASS_PINS = ["nvidia-cuda-cuobjdump==13.2.51", "nvidia-cuda-nvdisasm==13.2.51"]


def tools() -> Path:
    """The venv's nvidia/cu13 directory (lib/libnvrtc.so.13, bin/ptxas)."""
    py = VENV / "bin/python3"
    if not py.exists():
        print(f"making {VENV} with {' '.join(PINS)} ...", file=sys.stderr)
        venv.create(VENV, with_pip=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *PINS], check=True)
    found = list(VENV.glob("lib/python3*/site-packages/nvidia/cu13"))
    if not found:
        sys.exit(f"no nvidia/cu13 in {VENV}: delete it and run again")
    return found[0]


def sources() -> str:
    """The program exactly as nvrtc.rs assembles it."""
    order = re.findall(r'\("([\w.]+)", include_str!\("cu/[\w.]+"\)\)', (ROOT / "kernels/src/cuda/nvrtc.rs").read_text())
    return "".join(f"// ---- {n} ----\n{(CU / n).read_text()}\n" for n in order)


def nvrtc_ptx(lib: Path, src: str, arch: str) -> str:
    # NVRTC opens its builtins library by name: load it first from the same folder.
    ctypes.CDLL(str(next(lib.parent.glob("libnvrtc-builtins.so.*"))), mode=ctypes.RTLD_GLOBAL)
    nv = ctypes.CDLL(str(lib))
    prog = ctypes.c_void_p()
    check = lambda r, what: r == 0 or sys.exit(f"NVRTC {what} failed ({r})")
    check(nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"sluice.cu", 0, None, None), "create")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    if r != 0:
        sys.exit(f"NVRTC compile failed:\n{text}")
    if text:
        print(text, file=sys.stderr)
    nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(nv.nvrtcGetPTX(prog, ptx), "get PTX")
    return ptx.value.decode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptx", help="also write the PTX here")
    ap.add_argument("--only", help="report only kernels whose name contains this")
    ap.add_argument("--arch", default="90a")
    ap.add_argument("--sass", help="print the SASS of this kernel")
    ap.add_argument("--cache", help="also write the PTX into this directory under the name the backend's PTX "
                    "cache looks for (SLUICE_PTX_CACHE; kernels/src/cuda/nvrtc.rs), so a GPU machine skips NVRTC")
    args = ap.parse_args()
    cu13 = tools()
    src, arch = sources(), f"compute_{args.arch}"
    ptx = nvrtc_ptx(cu13 / "lib/libnvrtc.so.13", src, arch)
    if args.cache:
        # The key nvrtc.rs computes: SHA-256 of the program, the arch and the options, 12 bytes in hex.
        import hashlib
        key = hashlib.sha256(src.encode() + arch.encode() + b"--std=c++17").hexdigest()[:24]
        Path(args.cache).mkdir(parents=True, exist_ok=True)
        (Path(args.cache) / f"sluice-{key}-{arch}.ptx").write_text(ptx)
    out = Path(args.ptx) if args.ptx else VENV / "sluice.ptx"
    out.write_text(ptx)
    cubin = VENV / "sluice.cubin"
    res = subprocess.run([str(cu13 / "bin/ptxas"), f"-arch=sm_{args.arch}", "-v", str(out), "-o", str(cubin)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"ptxas failed:\n{res.stderr}")
    rows, name = [], None
    for line in res.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            frame, st, ld = map(int, m.groups())
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            smem = re.search(r"(\d+) bytes smem", line)
            rows.append((name, int(m.group(1)), int(smem.group(1)) if smem else 0, frame, st, ld))
            name = None
    if args.sass:
        if not (cu13 / "bin/nvdisasm").exists():
            subprocess.run([str(VENV / "bin/python3"), "-m", "pip", "install", "-q", *SASS_PINS], check=True)
        env = dict(os.environ, PATH=f"{cu13 / 'bin'}:{os.environ.get('PATH', '')}")
        sass = subprocess.run([str(cu13 / "bin/cuobjdump"), "-sass", "-fun", args.sass, str(cubin)],
                              capture_output=True, text=True, check=True, env=env).stdout
        print(sass)
        ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
        counts = {}
        for o in ops:
            counts[o] = counts.get(o, 0) + 1
        print("instruction mix:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))
        return
    spills = [r for r in rows if r[4] or r[5]]
    print(f"{'kernel':<44} {'regs':>5} {'smem':>7} {'frame':>6} {'spill st/ld':>12}")
    for r in rows:
        if not args.only or args.only in r[0]:
            print(f"{r[0]:<44} {r[1]:>5} {r[2]:>7} {r[3]:>6} {r[4]:>6}/{r[5]:<5}")
    print(f"{len(rows)} kernels compiled for sm_{args.arch}; {len(spills)} with register spills")


if __name__ == "__main__":
    main()
