use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// Exponential retry delay with jitter.
///
/// The jitter matters after an etcd outage: every worker of the cluster lost its lease at the same
/// moment, and without it they would all hammer the recovering server in lockstep.
#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(crate) const fn new(min: Duration, max: Duration) -> Self {
        Self { min, max, next: min }
    }

    /// The retry policy of every discovery task: from 200 ms up to 2 s, so that recovery after an
    /// outage takes at most about 2 s longer than the outage itself.
    pub(crate) const fn standard() -> Self {
        Self::new(Duration::from_millis(200), Duration::from_secs(2))
    }

    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }

    /// A delay in `[d/2, d]` where `d` doubles on every call until it reaches the maximum.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (base * 2).min(self.max);
        let half = base / 2;
        half + half.mul_f64(random_unit())
    }
}

/// A uniformly distributed number in `[0, 1)`; the standard library's randomly keyed hasher is
/// random enough for spreading retries and saves a dependency.
pub(crate) fn random_u64() -> u64 {
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}

fn random_unit() -> f64 {
    (random_u64() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_maximum_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
        let delays: Vec<Duration> = (0..8).map(|_| b.next_delay()).collect();
        for (d, base_ms) in delays.iter().zip([200u64, 400, 800, 1600, 2000, 2000, 2000, 2000]) {
            let base = Duration::from_millis(base_ms);
            assert!(*d >= base / 2 && *d <= base, "{d:?} outside [{:?}, {base:?}]", base / 2);
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(200));
    }
}
