# syntax=docker/dockerfile:1
#
# The sluice image: router, prefill-worker, decode-worker, kvstore and sluice (CLI) on PATH.
#   docker build -t <registry>/sluice:<tag> .
# The Helm chart (deploy/helm/sluice) runs it; see README "Operate".

# Rust toolchain; the workspace needs rust-version (Cargo.toml) or newer.
ARG RUST_VERSION=1
# CUDA runtime libraries of the image, as NVIDIA's apt repository names them (12-8 = 12.8).
ARG CUDA_PACKAGE_VERSION=12-8

FROM rust:${RUST_VERSION}-bookworm AS builder
ARG CUDA_PACKAGE_VERSION
# protoc for the gRPC API; UCX headers and libraries (transfer/ucx-sys is written against
# UCX 1.13, which is bookworm's); pip to fetch the CUDA-enabled UCX below.
RUN apt-get update \
 && apt-get install -y --no-install-recommends protobuf-compiler libprotobuf-dev libucx-dev python3-pip \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# A CUDA-enabled UCX for GPU workers (bookworm's libucx has no CUDA transports): the
# libucx-cu<major> wheel of PyPI, UCX 1.22 with cuda_copy/cuda_ipc/gdr_copy, for the
# image's CUDA major version. The runtime puts it first on the library path; on a node
# without a GPU its CUDA modules simply do not load. docs/cuda.md "UCX with CUDA memory".
RUN UCX_CUDA_MAJOR="${CUDA_PACKAGE_VERSION%%-*}" bash tools/ucx/fetch_cuda_ucx.sh /opt/ucx-cuda
# Cache mounts keep the registry and build between builds; the binaries are copied out
# in the same step because the target directory is not part of the layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --workspace --bins \
 && mkdir -p /out \
 && find target/release -maxdepth 1 -type f -executable -exec cp {} /out/ \;

# Runtime: Debian bookworm with NVIDIA's CUDA runtime libraries from NVIDIA's debian12
# repository, rather than an nvidia/cuda image. Why: the binaries link libucp/libucs from
# the builder, whose bindings (transfer/ucx-sys) are checked against UCX 1.13's exact
# struct layouts; bookworm's libucx0 is that same 1.13 build. NVIDIA publishes its
# nvidia/cuda images for Ubuntu (and RHEL-family) only, and there the UCX differs
# (Ubuntu 22.04: 1.12, older than the API we use; 24.04: 1.16) and so does glibc
# (22.04's 2.35 is older than bookworm's 2.36, which the builder links against). Same
# distribution in both stages means the same libucx and glibc by construction. The
# NVIDIA_* variables below are what the NVIDIA container toolkit reads to mount the
# driver, which is what makes an nvidia/cuda image a CUDA image.
FROM debian:bookworm-slim AS runtime
ARG CUDA_PACKAGE_VERSION
# libucx0: UCX runtime (tcp, shared memory and, with the verbs providers, InfiniBand/RoCE
#   transports); ucx-utils: ucx_info -d, to see what a pod's UCX can use.
# ibverbs-providers, librdmacm1: RDMA NIC drivers (mlx5, …) for UCX's rc/ud/dc transports.
# cuda-cudart, cuda-nvrtc: CUDA runtime and runtime compilation, for the CUDA backend.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && arch="$(dpkg --print-architecture | sed 's/amd64/x86_64/; s/arm64/sbsa/')" \
 && curl -fsSL -o /tmp/cuda-keyring.deb \
      "https://developer.download.nvidia.com/compute/cuda/repos/debian12/${arch}/cuda-keyring_1.1-1_all.deb" \
 && dpkg -i /tmp/cuda-keyring.deb \
 && rm /tmp/cuda-keyring.deb \
 && apt-get update \
 && apt-get install -y --no-install-recommends \
      libucx0 ucx-utils ibverbs-providers librdmacm1 \
      "cuda-cudart-${CUDA_PACKAGE_VERSION}" "cuda-nvrtc-${CUDA_PACKAGE_VERSION}" \
 && apt-get purge -y curl \
 && apt-get autoremove -y \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /opt/ucx-cuda /opt/ucx-cuda
# The CUDA-enabled UCX before bookworm's (the workers log which libucx they loaded and
# whether it reaches CUDA memory); its transport modules from its own directory.
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LD_LIBRARY_PATH=/opt/ucx-cuda/libucx/lib:/usr/local/cuda/lib64 \
    UCX_MODULE_DIR=/opt/ucx-cuda/libucx/lib/ucx

COPY --from=builder /out/ /usr/local/bin/
# Numeric uid/gid so Kubernetes' runAsNonRoot can verify it (the chart runs 10001).
RUN groupadd --system --gid 10001 sluice \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin sluice
USER 10001:10001
WORKDIR /tmp
# Router gRPC and HTTP (+ /metrics); workers' ports are set by their --listen flags.
EXPOSE 50051 8080
# No entrypoint: the chart (or `docker run … router --help`) names the binary.
CMD ["sluice", "--help"]
