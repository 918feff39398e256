//! `--gpu-direct`: whether a GPU worker's KV moves straight between device memory and
//! its peers (UCX with CUDA transports: cuda_ipc between GPUs of one host, GPUDirect
//! RDMA across hosts) or is staged through a registered host mirror.

use std::fmt;
use std::str::FromStr;

/// The operator's choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuDirect {
    /// Straight from and to device memory when the loaded libucx reaches CUDA memory;
    /// otherwise staged through a host mirror, with a log line saying why.
    #[default]
    Auto,
    /// Straight from and to device memory, or refuse to start saying what is missing.
    On,
    /// Always staged through a host mirror.
    Off,
}

impl GpuDirect {
    /// Whether to move KV in device memory, given whether the engine's KV is on GPUs and
    /// whether the loaded libucx reaches CUDA memory; `Err` says what to change when
    /// `on` cannot be honoured.
    pub fn decide(self, on_gpus: bool, ucx_reaches_cuda: bool) -> Result<bool, String> {
        match self {
            GpuDirect::Off => Ok(false),
            GpuDirect::Auto => Ok(on_gpus && ucx_reaches_cuda),
            GpuDirect::On if !on_gpus => {
                Err("--gpu-direct on needs a GPU engine (--device cuda:N or --devices cuda:0,...)".into())
            }
            GpuDirect::On if !ucx_reaches_cuda => {
                Err("--gpu-direct on needs a libucx with CUDA transports; the loaded \
                 one has none: run tools/ucx/fetch_cuda_ucx.sh and put its lib/ first on LD_LIBRARY_PATH (or use \
                 --gpu-direct auto to stage through host memory)"
                    .into())
            }
            GpuDirect::On => Ok(true),
        }
    }
}

impl FromStr for GpuDirect {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(GpuDirect::Auto),
            "on" => Ok(GpuDirect::On),
            "off" => Ok(GpuDirect::Off),
            other => Err(format!("`{other}` is not a --gpu-direct mode; use auto, on or off")),
        }
    }
}

impl fmt::Display for GpuDirect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GpuDirect::Auto => "auto",
            GpuDirect::On => "on",
            GpuDirect::Off => "off",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_follows_the_transports_on_refuses_what_it_cannot_do_off_stages() {
        assert_eq!(GpuDirect::Auto.decide(true, true), Ok(true));
        assert_eq!(GpuDirect::Auto.decide(true, false), Ok(false));
        assert_eq!(GpuDirect::Auto.decide(false, true), Ok(false));
        assert_eq!(GpuDirect::Off.decide(true, true), Ok(false));
        assert_eq!(GpuDirect::On.decide(true, true), Ok(true));
        assert!(GpuDirect::On.decide(true, false).unwrap_err().contains("fetch_cuda_ucx.sh"));
        assert!(GpuDirect::On.decide(false, true).unwrap_err().contains("GPU engine"));
        assert_eq!("on".parse::<GpuDirect>(), Ok(GpuDirect::On));
        assert!("yes".parse::<GpuDirect>().unwrap_err().contains("auto, on or off"));
        assert_eq!(GpuDirect::default().to_string(), "auto");
    }
}
