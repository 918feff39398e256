//! A progress bar for long CLI work that reports bytes through a counter: drawn on a
//! terminal (bytes, rate, ETA when the total is known), nothing otherwise (the command
//! prints its own summary line).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Run `work` while a bar follows `done` (bytes; `total` if known).
pub fn while_counting<R>(what: &str, total: Option<u64>, done: &AtomicU64, work: impl FnOnce() -> R) -> R {
    if !std::io::stderr().is_terminal() {
        return work();
    }
    let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr_with_hz(4));
    let template = if total.is_some() {
        "{msg} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}"
    } else {
        "{msg} {bytes} {binary_bytes_per_sec}"
    };
    bar.set_style(ProgressStyle::with_template(template).expect("valid template").progress_chars("=> "));
    bar.set_message(what.to_string());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                bar.set_position(done.load(Ordering::Relaxed));
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let r = work();
        stop.store(true, Ordering::Relaxed);
        bar.finish_and_clear();
        r
    })
}
