#!/usr/bin/env bash
# A CUDA-enabled UCX for GPU workers (Debian's libucx has no CUDA transports): the
# libucx-cu13 wheel from PyPI (UCX 1.22.0 built with cuda_copy, cuda_ipc and gdr_copy),
# unpacked into DIR; UCX_CUDA_MAJOR=12 takes libucx-cu12 instead, for a CUDA 12 runtime
# (the Dockerfile's). Its libraries replace the system's at run time:
#
#   tools/ucx/fetch_cuda_ucx.sh /opt/ucx-cuda
#   export LD_LIBRARY_PATH=/opt/ucx-cuda/libucx/lib:$LD_LIBRARY_PATH
#   prefill-worker ... / decode-worker ...       # their start-up log names the libucx
#
# --pack OUT.tgz instead keeps only what serving and the GPU checks use (the libraries,
# the CUDA transport modules, ucx_info and ucx_perftest), for carrying to a machine.
set -euo pipefail
dest=${1:?usage: fetch_cuda_ucx.sh DIR [--pack OUT.tgz]}
version=1.22.0
major=${UCX_CUDA_MAJOR:-13}
case $major in 12 | 13) ;; *) echo "UCX_CUDA_MAJOR=$major: the wheels exist for CUDA 12 and 13" >&2 && exit 2 ;; esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" "libucx-cu$major==$version"
mkdir -p "$dest"
(cd "$dest" && python3 -m zipfile -e "$tmp"/libucx_cu"$major"-*.whl .)
chmod +x "$dest"/libucx/bin/* 2>/dev/null || true
if [ "${2:-}" = "--pack" ]; then
  out=${3:?--pack needs OUT.tgz}
  (cd "$dest" && tar -czf "$OLDPWD/$out" \
    libucx/lib/libucp.so.0 libucx/lib/libuct.so.0 libucx/lib/libucs.so.0 libucx/lib/libucm.so.0 \
    libucx/lib/libucs_signal.so.0 libucx/lib/ucx/libuct_cuda.so.0 libucx/lib/ucx/libucm_cuda.so.0 \
    libucx/lib/ucx/libuct_cma.so.0 libucx/lib/ucx/libucx_perftest_cuda.so.0 \
    libucx/bin/ucx_info libucx/bin/ucx_perftest "libucx_cu$major.libs")
  echo "packed $out ($(du -h "$out" | cut -f1))"
fi
echo "UCX $version with CUDA $major in $dest: export LD_LIBRARY_PATH=$dest/libucx/lib:\$LD_LIBRARY_PATH"
