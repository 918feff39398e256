//! Timing on the device for the benchmarks and tests: a closure between two events, the
//! stream held behind a sleeping kernel (the device's own time for what queues behind
//! it), a kernel's per-call time both ways, and the device-to-device copy bandwidth.

use super::CudaBackend;
use super::runtime::{self, launch};

/// A kernel's time per call, microseconds ([`CudaBackend::time_kernel_us`]).
#[derive(Clone, Copy, Debug)]
pub struct KernelTime {
    /// Back to back on the device (the kernels' own time).
    pub gpu_us: f64,
    /// Issued and waited for alone (host launch work included).
    pub issued_us: f64,
}

impl CudaBackend {
    /// Time `f` with device events on the backend's stream, in milliseconds.
    pub fn time_ms<R>(&self, f: impl FnOnce() -> R) -> (R, f32) {
        let g = &self.gpu;
        let start = g
            .stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap_or_else(|e| runtime::fail("event record", e));
        let r = f();
        let end = g
            .stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .unwrap_or_else(|e| runtime::fail("event record", e));
        end.synchronize().unwrap_or_else(|e| runtime::fail("event synchronize", e));
        (r, start.elapsed_ms(&end).unwrap_or_else(|e| runtime::fail("event timing", e)))
    }

    /// Holds the stream for `ns` nanoseconds: work issued next queues behind it, so a
    /// caller that times issue + wait and subtracts `ns` gets the device's own time for
    /// that work, free of the host's issue rate (as long as issuing takes less than `ns`).
    pub fn hold_stream(&self, ns: u64) {
        let g = &self.gpu;
        launch!(g, "gpu_sleep", runtime::cfg((1, 1, 1), 1, 0), ns);
    }

    /// Per-call time of `f` in microseconds two ways: `issued`, the median of `reps`
    /// single calls each timed by events around it (what a caller that issues it alone
    /// waits, the host's launch work included), and `gpu`, `reps` calls queued behind a
    /// sleeping kernel so the device runs them back to back (the kernels' own time, the
    /// GPU's launch gaps included). One warm-up call first.
    pub fn time_kernel_us(&self, reps: usize, mut f: impl FnMut()) -> KernelTime {
        let g = &self.gpu;
        f();
        let mut issued = Vec::with_capacity(reps);
        for _ in 0..reps {
            issued.push(self.time_ms(&mut f).1 as f64 * 1e3);
        }
        issued.sort_by(f64::total_cmp);
        // The gate must outlast the host's issuing of all calls, or the device would wait
        // on the host again: doubled until it does.
        let mut gate_ns = 2_000_000u64;
        loop {
            g.sync();
            self.hold_stream(gate_ns);
            let t = std::time::Instant::now();
            let ((), ms) = self.time_ms(|| {
                for _ in 0..reps {
                    f();
                }
            });
            let host_ns = t.elapsed().as_nanos() as u64;
            if host_ns < gate_ns || gate_ns >= 1_000_000_000 {
                return KernelTime { issued_us: issued[issued.len() / 2], gpu_us: ms as f64 * 1e3 / reps as f64 };
            }
            gate_ns *= 4;
        }
    }

    /// Device-to-device copy bandwidth over `bytes`-sized buffers (bytes read plus bytes
    /// written per second, median of `reps` timed copies after a warm-up), GB/s.
    pub fn copy_bandwidth_gbs(&self, bytes: usize, reps: usize) -> f64 {
        let g = &self.gpu;
        let src = g.zeros_owned::<u8>(bytes);
        let mut dst = g.alloc_owned::<u8>(bytes);
        let mut times = Vec::with_capacity(reps);
        for i in 0..reps + 1 {
            let ((), ms) = self.time_ms(|| {
                g.stream.memcpy_dtod(&src, &mut dst).unwrap_or_else(|e| runtime::fail("device-to-device copy", e))
            });
            if i > 0 {
                times.push(ms as f64);
            }
        }
        times.sort_by(f64::total_cmp);
        2.0 * bytes as f64 / (times[times.len() / 2] / 1e3) / 1e9
    }
}
