//! Which devices each worker of `sluice up` computes on (pure).

use engine::device::{Device, devices_label};

/// What `sluice up --device / --devices / --gpus-per-worker` asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    /// Spread the workers over this machine's GPUs, `per_worker` GPUs each.
    Gpus {
        per_worker: usize,
    },
    /// Every worker on exactly these devices.
    Fixed(Vec<Device>),
}

impl DeviceChoice {
    /// From the flags: `--devices` wins; `--device cuda` spreads; `cuda:N` pins.
    pub fn from_flags(device: &str, devices: Option<&str>, per_worker: usize) -> Result<Self, String> {
        if let Some(list) = devices {
            return engine::device::parse_devices(list).map(DeviceChoice::Fixed);
        }
        match device.trim() {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Gpus { per_worker: per_worker.max(1) }),
            other => Ok(DeviceChoice::Fixed(vec![Device::parse(other)?])),
        }
    }
}

/// The devices of each of `workers` workers, given `gpus` GPUs on the machine: spread
/// round-robin in blocks of `per_worker` consecutive GPUs, so a machine with as many GPUs
/// as the workers need gives every worker its own.
pub fn assign(choice: &DeviceChoice, gpus: usize, workers: usize) -> Result<Vec<Vec<Device>>, String> {
    match choice {
        DeviceChoice::Cpu => Ok(vec![vec![Device::Cpu]; workers]),
        DeviceChoice::Fixed(d) => Ok(vec![d.clone(); workers]),
        DeviceChoice::Gpus { per_worker } => {
            if gpus == 0 {
                return Err("--device cuda: this machine has no usable CUDA GPU (use --device cpu)".into());
            }
            if *per_worker > gpus {
                return Err(format!("--gpus-per-worker {per_worker}, but this machine has {gpus} GPU(s)"));
            }
            Ok((0..workers)
                .map(|w| (0..*per_worker).map(|j| Device::Cuda((w * per_worker + j) % gpus)).collect())
                .collect())
        }
    }
}

/// The devices of each worker in start order (the `decode` decode workers, then the
/// `prefill` prefill workers). With `--prefill-devices` / `--decode-devices` every worker
/// of a role gets that role's list — how a disaggregated pair is put on disjoint GPUs of
/// one host (prefill on cuda:0,cuda:1, decode on cuda:2,cuda:3); otherwise as [`assign`].
pub fn assign_roles(
    choice: &DeviceChoice,
    by_role: Option<(&[Device], &[Device])>,
    gpus: usize,
    decode: usize,
    prefill: usize,
) -> Result<Vec<Vec<Device>>, String> {
    let Some((decode_devices, prefill_devices)) = by_role else {
        return assign(choice, gpus, decode + prefill);
    };
    Ok(std::iter::repeat_n(decode_devices.to_vec(), decode)
        .chain(std::iter::repeat_n(prefill_devices.to_vec(), prefill))
        .collect())
}

/// The worker flags for `devices`.
pub fn flags(devices: &[Device]) -> Vec<String> {
    match devices {
        [one] => vec!["--device".into(), one.to_string()],
        several => vec!["--devices".into(), devices_label(several)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_spread_over_workers_in_blocks() {
        let two = DeviceChoice::from_flags("cuda", None, 1).unwrap();
        assert_eq!(assign(&two, 2, 2).unwrap(), vec![vec![Device::Cuda(0)], vec![Device::Cuda(1)]]);
        let spans = DeviceChoice::from_flags("cuda", None, 2).unwrap();
        let got = assign(&spans, 4, 2).unwrap();
        assert_eq!(got[1], vec![Device::Cuda(2), Device::Cuda(3)]);
        assert_eq!(flags(&got[1]), vec!["--devices", "cuda:2,cuda:3"]);
        assert_eq!(flags(&[Device::Cuda(1)]), vec!["--device", "cuda:1"]);
        assert!(assign(&spans, 1, 2).unwrap_err().contains("--gpus-per-worker 2"));
        assert!(assign(&two, 0, 2).unwrap_err().contains("no usable CUDA GPU"));
    }

    #[test]
    fn roles_get_their_own_devices() {
        let (p, d) = (
            engine::device::parse_devices("cuda:0,cuda:1").unwrap(),
            engine::device::parse_devices("cuda:2,cuda:3").unwrap(),
        );
        let got = assign_roles(&DeviceChoice::Cpu, Some((&d, &p)), 4, 1, 2).unwrap();
        assert_eq!(got, vec![d.clone(), p.clone(), p.clone()], "decode workers first, as they start");
        assert_eq!(flags(&got[0]), vec!["--devices", "cuda:2,cuda:3"]);
        assert_eq!(flags(&got[1]), vec!["--devices", "cuda:0,cuda:1"]);
        let spread = DeviceChoice::from_flags("cuda", None, 1).unwrap();
        assert_eq!(assign_roles(&spread, None, 2, 1, 1).unwrap(), assign(&spread, 2, 2).unwrap());
    }

    #[test]
    fn fixed_devices_and_cpu_go_to_every_worker() {
        let both = DeviceChoice::from_flags("cpu", Some("cuda:0,cuda:1"), 1).unwrap();
        assert_eq!(assign(&both, 2, 3).unwrap().len(), 3);
        assert_eq!(DeviceChoice::from_flags("cuda:3", None, 1).unwrap(), DeviceChoice::Fixed(vec![Device::Cuda(3)]));
        assert_eq!(assign(&DeviceChoice::Cpu, 8, 1).unwrap(), vec![vec![Device::Cpu]]);
        assert!(DeviceChoice::from_flags("tpu", None, 1).is_err());
    }
}
