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

/// An engine on whichever device was chosen at run time.
// One per process and never moved around: boxing the larger variant buys nothing.
#[allow(clippy::large_enum_variant)]
pub enum AnyEngine {
    Cpu(Engine<CpuBackend>),
    #[cfg(feature = "cuda")]
    Cuda(Engine<CudaBackend>),
}

impl AnyEngine {
    /// Load a model directory onto `device`.
    pub fn load(dir: &Path, device: Device, options: EngineOptions) -> Result<Self, DeviceError> {
        match device {
            Device::Cpu => Ok(AnyEngine::Cpu(Engine::load(dir, CpuBackend::new(), options)?)),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let backend = cuda_backend(n)?;
                tracing::info!(device = %device, kernels = backend.kernel_origin(), "CUDA backend ready");
                Ok(AnyEngine::Cuda(Engine::load(dir, backend, options)?))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(DeviceError::NotBuilt),
        }
    }

    pub fn device(&self) -> Device {
        match self {
            AnyEngine::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            AnyEngine::Cuda(e) => Device::Cuda(e.model.backend.ordinal()),
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
            $crate::device::AnyEngine::Cuda($e) => $body,
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
