//! The chaos suite's table (docs/reliability.md): per fault, the requests that were in
//! flight or sent while it lasted, and the totals of the run.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

use crate::faults::{Counters, Window};
use crate::load::{Outcome, Verdict};

/// Whether a request overlapped the time from a fault's start to the cluster being whole.
fn during(o: &Outcome, w: &Window) -> bool {
    o.sent <= w.recovered && o.ended >= w.start
}

fn p99(mut v: Vec<Duration>) -> String {
    if v.is_empty() {
        return "—".into();
    }
    v.sort();
    let i = ((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1;
    format!("{:.0} ms", v[i].as_secs_f64() * 1e3)
}

fn failures(outcomes: &[&Outcome]) -> String {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for o in outcomes {
        if let Verdict::Failed(code) = o.verdict {
            *by.entry(format!("{code:?}")).or_default() += 1;
        }
    }
    if by.is_empty() {
        return "0".into();
    }
    by.iter().map(|(c, n)| format!("{n} {c}")).collect::<Vec<_>>().join(", ")
}

fn ttfts<'a>(outcomes: impl Iterator<Item = &'a Outcome>) -> Vec<Duration> {
    outcomes.filter(|o| o.verdict == Verdict::Ok).filter_map(|o| o.ttft).collect()
}

/// What the run found, beyond the requests' outcomes.
pub struct Findings {
    pub counters: Counters,
    pub pages_leaked: u64,
}

/// The markdown table and the totals.
pub fn render(outcomes: &[Outcome], windows: &[Window], f: &Findings) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "| fault | requests during it | succeeded | failed (by code) | p99 TTFT | whole again after |");
    let _ = writeln!(s, "|---|---:|---:|---|---:|---:|");
    for w in windows {
        let hit: Vec<&Outcome> = outcomes.iter().filter(|o| during(o, w)).collect();
        let ok = hit.iter().filter(|o| o.verdict == Verdict::Ok).count();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.1} s |",
            w.fault.name(),
            hit.len(),
            ok,
            failures(&hit),
            p99(ttfts(hit.iter().copied())),
            (w.recovered - w.start).as_secs_f64()
        );
    }
    let all: Vec<&Outcome> = outcomes.iter().collect();
    let ok = all.iter().filter(|o| o.verdict == Verdict::Ok).count();
    let wrong = all.iter().filter(|o| o.verdict == Verdict::WrongOutput).count();
    let calm = ttfts(outcomes.iter().filter(|o| !windows.iter().any(|w| during(o, w))));
    let faulted = ttfts(outcomes.iter().filter(|o| windows.iter().any(|w| during(o, w))));
    let _ = writeln!(s);
    let _ = writeln!(s, "| total | |");
    let _ = writeln!(s, "|---|---:|");
    let _ = writeln!(s, "| requests sent | {} |", all.len());
    let _ = writeln!(s, "| succeeded (tokens equal to the undisturbed run) | {ok} |");
    let _ = writeln!(s, "| failed, by code | {} |", failures(&all));
    let _ = writeln!(s, "| finished with wrong tokens (duplicate, gap, corrupt KV) | {wrong} |");
    let _ = writeln!(s, "| migrated (router counter) | {:.0} |", f.counters.migrations);
    let _ = writeln!(s, "| p99 TTFT, no fault / during faults | {} / {} |", p99(calm), p99(faulted));
    let _ = writeln!(s, "| pages leaked (decode workers, after the load) | {} |", f.pages_leaked);
    let _ = writeln!(
        s,
        "| corrupt records served | {wrong} (wrong outputs); store: {:.0} detected and dropped |",
        f.counters.kv_corrupt
    );
    let _ = writeln!(s, "| kvstore write errors (disk full) | {:.0} |", f.counters.kv_write_errors);
    s
}
