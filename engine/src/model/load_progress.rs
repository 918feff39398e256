//! What loading a checkpoint shows: a progress bar (bytes, GB/s, ETA) when stderr is a
//! terminal, and one log line with the totals either way: bytes, time, rate and the
//! most anonymous host memory the process held above where it started (the streamed
//! loader's promise: mapped checkpoint pages are page cache, not counted; staging
//! buffers and conversions are).

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Anonymous resident memory of this process in bytes (`RssAnon`, Linux), if known.
pub fn anon_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Samples [`anon_rss_bytes`] every few milliseconds until dropped, keeping the peak.
struct PeakSampler {
    peak: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PeakSampler {
    fn start() -> Option<Self> {
        let first = anon_rss_bytes()?;
        let peak = Arc::new(AtomicU64::new(first));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peak.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("load-rss".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    if let Some(v) = anon_rss_bytes() {
                        p.fetch_max(v, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
            .ok()?;
        Some(PeakSampler { peak, stop, thread: Some(thread) })
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(v) = anon_rss_bytes() {
            self.peak.fetch_max(v, Ordering::Relaxed);
        }
        self.peak.load(Ordering::Relaxed)
    }
}

/// Totals of one load, for logs and benchmarks.
#[derive(Clone, Copy, Debug)]
pub struct LoadStats {
    pub bytes: u64,
    pub seconds: f64,
    /// Peak anonymous host memory above the level at the start of the load, if known.
    pub peak_extra_host_bytes: Option<u64>,
}

impl LoadStats {
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.seconds.max(1e-9) / 1e9
    }
}

pub(crate) struct LoadProgress {
    bar: ProgressBar,
    done: AtomicU64,
    started: Instant,
    base_rss: Option<u64>,
    sampler: Option<PeakSampler>,
}

impl LoadProgress {
    /// `total`: bytes the load will read (the bar's end).
    pub fn new(total: u64, device: &str) -> Self {
        let bar = if std::io::stderr().is_terminal() {
            let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr_with_hz(4));
            b.set_style(
                ProgressStyle::with_template("{msg} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            b.set_message(format!("loading weights to {device}"));
            b
        } else {
            ProgressBar::hidden()
        };
        let base_rss = anon_rss_bytes();
        LoadProgress { bar, done: AtomicU64::new(0), started: Instant::now(), base_rss, sampler: PeakSampler::start() }
    }

    pub fn add(&self, bytes: usize) {
        self.done.fetch_add(bytes as u64, Ordering::Relaxed);
        self.bar.inc(bytes as u64);
    }

    pub fn finish(self) -> LoadStats {
        self.bar.finish_and_clear();
        let peak = self.sampler.map(PeakSampler::finish);
        LoadStats {
            bytes: self.done.load(Ordering::Relaxed),
            seconds: self.started.elapsed().as_secs_f64(),
            peak_extra_host_bytes: peak.zip(self.base_rss).map(|(p, b)| p.saturating_sub(b)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_sampler_sees_a_large_allocation() {
        let Some(before) = anon_rss_bytes() else {
            eprintln!("SKIPPED: no /proc/self/status RssAnon here");
            return;
        };
        let p = LoadProgress::new(1, "test");
        let v = vec![1u8; 256 << 20];
        std::thread::sleep(Duration::from_millis(50));
        assert!(v.iter().step_by(4096).all(|&b| b == 1));
        drop(v);
        p.add(1);
        let s = p.finish();
        let extra = s.peak_extra_host_bytes.expect("sampled");
        assert!(extra >= 200 << 20, "peak {extra} above {before} should include the 256 MiB vector");
        assert_eq!(s.bytes, 1);
    }
}
