//! Choosing the compute device at run time (`--device cpu|cuda:N`).
//!
//! [`Engine`] is generic over its backend, so code that serves any device either is
//! generic itself or holds an [`AnyEngine`] and reaches the engine inside with
//! [`with_engine!`](crate::with_engine):
//!
//! ```ignore
//! let mut engine = AnyEngine::load(&dir, Device::parse("cuda:0")?, options)?;
//! let logits = engine::with_engine!(&mut engine, e => e.prefill(&mut seq, &prompt, Logits::Last))?;
//! ```
//!
//! CUDA needs the engine's `cuda` feature; without it, or without a usable GPU,
//! loading on `cuda:N` fails with a message that says which.

use std::fmt;
use std::path::Path;

use kernels::CpuBackend;
#[cfg(feature = "cuda")]
use kernels::cuda::CudaBackend;
use kernels::sharded::{HostCollective, Sharded};
use thiserror::Error;

use crate::engine::{Engine, EngineOptions};
use crate::error::EngineError;

/// Where an engine computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA device ordinal.
    Cuda(usize),
}

impl Device {
    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("`{other}` is not a device; use cpu or cuda:N (e.g. cuda:0)")),
        }
    }

    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// `--devices`: a comma-separated list of one kind, `cuda:0,cuda:1,…` (each GPU once)
/// or `cpu,cpu,…` (several CPU "devices" sharing the host: the multi-GPU layout without
/// GPUs, for tests and trials).
pub fn parse_devices(s: &str) -> Result<Vec<Device>, String> {
    let devices = s.split(',').map(Device::parse).collect::<Result<Vec<_>, _>>()?;
    if devices.is_empty() {
        return Err("--devices needs at least one device, e.g. cuda:0,cuda:1".into());
    }
    if devices.iter().any(|d| d.is_cuda()) != devices.iter().all(|d| d.is_cuda()) {
        return Err(format!("--devices {s}: all of one kind, cpu or cuda:N"));
    }
    let mut gpus: Vec<usize> =
        devices.iter().filter_map(|d| if let Device::Cuda(n) = d { Some(*n) } else { None }).collect();
    gpus.sort_unstable();
    if let Some(w) = gpus.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("--devices {s}: cuda:{} is listed twice; name each GPU once", w[0]));
    }
    Ok(devices)
}

/// A `--devices` value (a newtype so clap parses the whole list as one value).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceList(pub Vec<Device>);

impl std::str::FromStr for DeviceList {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_devices(s).map(DeviceList)
    }
}

impl fmt::Display for DeviceList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&devices_label(&self.0))
    }
}

/// The devices a service computes on: `--devices` when given, else `--device`.
pub fn chosen(device: Device, devices: Option<&DeviceList>) -> Vec<Device> {
    devices.map(|d| d.0.clone()).unwrap_or_else(|| vec![device])
}

/// Checks of a service's device flags: `--gpu-memory` needs GPUs, and KV pools split
/// evenly over several devices.
pub fn check_pools(devices: &[Device], gpu_memory: bool, max_pages: usize, max_sequences: usize) -> Result<(), String> {
    if gpu_memory && !devices.iter().all(|d| d.is_cuda()) {
        return Err("--gpu-memory plans GPU memory; it needs --device cuda:N (or --devices)".into());
    }
    let n = devices.len();
    for (flag, v) in [("--max-pages", max_pages), ("--max-sequences", max_sequences)] {
        if !v.is_multiple_of(n) {
            return Err(format!(
                "{flag} {v} does not split over {n} devices (each holds an equal share): use a multiple of {n}"
            ));
        }
    }
    Ok(())
}

/// Devices as `--devices` writes them.
pub fn devices_label(devices: &[Device]) -> String {
    devices.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",")
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Device::parse(s)
    }
}

#[derive(Debug, Error)]
pub enum DeviceError {
    #[error("this build has no CUDA support (built without the `cuda` feature); use --device cpu")]
    NotBuilt,
    #[error("cannot use {device}: {reason}")]
    Unavailable { device: Device, reason: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// The CUDA backend for device `ordinal` (compiles or loads the cached kernels).
#[cfg(feature = "cuda")]
pub fn cuda_backend(ordinal: usize) -> Result<CudaBackend, DeviceError> {
    CudaBackend::new(ordinal)
        .map_err(|e| DeviceError::Unavailable { device: Device::Cuda(ordinal), reason: e.to_string() })
}

/// CUDA GPUs this process can use (0 without a driver or without the `cuda` feature).
pub fn cuda_device_count() -> usize {
    #[cfg(feature = "cuda")]
    return CudaBackend::device_count();
    #[cfg(not(feature = "cuda"))]
    0
}

/// Bytes of memory of `device`: a GPU's total memory, or the host's (`MemTotal`).
pub fn memory_bytes(device: Device) -> Result<u64, DeviceError> {
    match device {
        Device::Cpu => {
            let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
            let kb = info
                .lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| DeviceError::Unavailable { device, reason: "no MemTotal in /proc/meminfo".into() })?;
            Ok(kb * 1024)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(o) => CudaBackend::device_memory(o)
            .map(|b| b as u64)
            .map_err(|e| DeviceError::Unavailable { device, reason: e.to_string() }),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(DeviceError::NotBuilt),
    }
}

/// The CUDA backends of `ordinals` as one sharded backend (NCCL or peer copies between
/// them), in the process's activation precision.
#[cfg(feature = "cuda")]
pub fn cuda_sharded(ordinals: &[usize]) -> Result<Sharded<CudaBackend>, DeviceError> {
    cuda_sharded_in(ordinals, kernels::Activations::process_default())
}

/// [`cuda_sharded`] whose GPUs take `activations` (tests compare precisions in one process).
#[cfg(feature = "cuda")]
pub fn cuda_sharded_in(
    ordinals: &[usize],
    activations: kernels::Activations,
) -> Result<Sharded<CudaBackend>, DeviceError> {
    let mut ranks = ordinals.iter().map(|&o| cuda_backend(o)).collect::<Result<Vec<_>, _>>()?;
    for r in &mut ranks {
        r.set_activations(activations);
    }
    let comm = kernels::cuda::collective::for_devices(&ranks);
    Ok(Sharded::new(ranks, comm))
}

/// An engine on whichever device (or devices) was chosen at run time.
// One per process and never moved around: boxing the larger variant buys nothing.
#[allow(clippy::large_enum_variant)]
pub enum AnyEngine {
    Cpu(Engine<CpuBackend>),
    /// Several CPU "devices" in the multi-GPU layout (tests and trials).
    CpuSharded(Engine<Sharded<CpuBackend>>),
    #[cfg(feature = "cuda")]
    Cuda(Engine<CudaBackend>),
    /// Several GPUs of this host: data-parallel attention, expert-parallel MoE.
    #[cfg(feature = "cuda")]
    CudaSharded(Engine<Sharded<CudaBackend>>),
}

impl AnyEngine {
    /// Load a model directory onto `device`.
    pub fn load(dir: &Path, device: Device, options: EngineOptions) -> Result<Self, DeviceError> {
        match device {
            Device::Cpu => Ok(AnyEngine::Cpu(Engine::load(dir, CpuBackend::new(), options)?)),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let backend = cuda_backend(n)?;
                tracing::info!(
                    device = %device,
                    kernels = backend.kernel_origin(),
                    activations = %backend.activations(),
                    "CUDA backend ready"
                );
                Ok(AnyEngine::Cuda(Engine::load(dir, backend, options)?))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(DeviceError::NotBuilt),
        }
    }

    /// Load a model directory onto `devices`: one device as [`Self::load`], several as
    /// one sharded engine.
    pub fn load_on(dir: &Path, devices: &[Device], options: EngineOptions) -> Result<Self, DeviceError> {
        match devices {
            [] => Err(DeviceError::Unavailable { device: Device::Cpu, reason: "no device given".into() }),
            [one] => Self::load(dir, *one, options),
            [Device::Cpu, ..] => {
                let ranks = devices.iter().map(|_| CpuBackend::new()).collect();
                let backend = Sharded::new(ranks, Box::new(HostCollective));
                Ok(AnyEngine::CpuSharded(Engine::load(dir, backend, options)?))
            }
            #[cfg(feature = "cuda")]
            [Device::Cuda(_), ..] => {
                let ordinals: Vec<usize> =
                    devices.iter().map(|d| if let Device::Cuda(n) = d { *n } else { usize::MAX }).collect();
                let backend = cuda_sharded(&ordinals)?;
                tracing::info!(
                    devices = %devices_label(devices),
                    collective = backend.collective(),
                    activations = %kernels::Activations::process_default(),
                    "GPUs ready"
                );
                Ok(AnyEngine::CudaSharded(Engine::load(dir, backend, options)?))
            }
            #[cfg(not(feature = "cuda"))]
            [Device::Cuda(_), ..] => Err(DeviceError::NotBuilt),
        }
    }

    /// A worker's engine, with `host` the KV memory transports reach (UCX-registered
    /// regions): on one CPU the engine's KV is that memory itself; on GPUs (or several
    /// CPU devices) the engine keeps its own and `host` becomes its mirror, staged
    /// around transfers (logged, with whether the mirror is pinned for device copies).
    /// Without `host`, a GPU engine's KV is reached in place: the caller registers
    /// [`Engine::device_kv`] and declares it with [`Engine::set_direct`] (GPU-direct).
    pub fn load_for_transport(
        dir: &Path,
        devices: &[Device],
        options: EngineOptions,
        host: Option<crate::mirror::HostMirror>,
    ) -> Result<Self, DeviceError> {
        if devices == [Device::Cpu] {
            let host = host.ok_or_else(|| DeviceError::Unavailable {
                device: Device::Cpu,
                reason: "a CPU engine serves from registered host memory, and none was given".into(),
            })?;
            let provided = crate::engine::ProvidedKv { state: host.state, slot_logits: host.slot_logits };
            return Ok(AnyEngine::Cpu(Engine::load_with_state(dir, CpuBackend::new(), options, Some(provided))?));
        }
        let mut engine = Self::load_on(dir, devices, options)?;
        let Some(host) = host else { return Ok(engine) };
        crate::with_engine!(&mut engine, e => e.set_mirror(host))?;
        let pinned = crate::with_engine!(&engine, e => e.mirror_pinned());
        tracing::info!(
            devices = %devices_label(devices),
            pinned,
            "KV lives in device memory; transfers through this host mirror are staged around them (pinned for the \
             device copies unless pinned=false)"
        );
        Ok(engine)
    }

    /// The first device the engine computes on.
    pub fn device(&self) -> Device {
        self.devices()[0]
    }

    /// Every device the engine computes on, in rank order.
    pub fn devices(&self) -> Vec<Device> {
        match self {
            AnyEngine::Cpu(_) => vec![Device::Cpu],
            AnyEngine::CpuSharded(e) => vec![Device::Cpu; e.model.backend.devices().len()],
            #[cfg(feature = "cuda")]
            AnyEngine::Cuda(e) => vec![Device::Cuda(e.model.backend.ordinal())],
            #[cfg(feature = "cuda")]
            AnyEngine::CudaSharded(e) => e.model.backend.devices().iter().map(|b| Device::Cuda(b.ordinal())).collect(),
        }
    }

    pub fn config(&self) -> &crate::config::ModelConfig {
        crate::with_engine!(self, e => e.config())
    }
}

/// Bind the engine inside an [`AnyEngine`] (or `&`/`&mut` one) to `$e` and evaluate
/// `$body` for whichever backend it has; `$body` is compiled once per backend.
#[cfg(feature = "cuda")]
#[macro_export]
macro_rules! with_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            $crate::device::AnyEngine::Cpu($e) => $body,
            $crate::device::AnyEngine::CpuSharded($e) => $body,
            $crate::device::AnyEngine::Cuda($e) => $body,
            $crate::device::AnyEngine::CudaSharded($e) => $body,
        }
    };
}

/// Bind the engine inside an [`AnyEngine`] (or `&`/`&mut` one) to `$e` and evaluate
/// `$body` for whichever backend it has; `$body` is compiled once per backend.
#[cfg(not(feature = "cuda"))]
#[macro_export]
macro_rules! with_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            $crate::device::AnyEngine::Cpu($e) => $body,
            $crate::device::AnyEngine::CpuSharded($e) => $body,
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices_and_names_bad_ones() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        assert!(Device::parse("cuda:x").unwrap_err().contains("cpu or cuda:N"));
        assert!(Device::parse("tpu").is_err());
    }

    #[test]
    fn device_lists_are_of_one_kind_and_name_each_gpu_once() {
        assert_eq!(parse_devices("cuda:0,cuda:1").unwrap(), vec![Device::Cuda(0), Device::Cuda(1)]);
        assert_eq!(parse_devices("cpu,cpu").unwrap(), vec![Device::Cpu, Device::Cpu]);
        assert!(parse_devices("cpu,cuda:0").unwrap_err().contains("all of one kind"));
        assert!(parse_devices("cuda:1,cuda:0,cuda:1").unwrap_err().contains("cuda:1 is listed twice"));
        assert!(parse_devices("cuda:0,").is_err());
        assert_eq!(devices_label(&[Device::Cuda(2), Device::Cuda(3)]), "cuda:2,cuda:3");
    }

    #[test]
    fn cuda_without_a_gpu_or_build_says_why() {
        let dir = std::env::temp_dir().join("sluice-no-such-model");
        let err = AnyEngine::load(&dir, Device::Cuda(0), EngineOptions::default()).err().expect("no model there");
        #[cfg(not(feature = "cuda"))]
        assert!(matches!(err, DeviceError::NotBuilt), "{err}");
        #[cfg(feature = "cuda")]
        if !kernels::cuda::driver_present() {
            assert!(err.to_string().contains("cannot use cuda:0: no CUDA driver"), "{err}");
        } else {
            // With a GPU the backend comes up and the empty directory is what fails.
            assert!(matches!(err, DeviceError::Engine(_)), "{err}");
        }
    }
}
