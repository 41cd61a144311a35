//! What the guard has done ([`Counters`], for the status line and `run --metrics`) and how
//! much of it the log takes ([`LogBudget`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::core::policy::Rate;

use super::{Context, Rules};

/// What the guard has done since it started, for the status line and `run --metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    pub answered: AtomicU64,
    pub refused: AtomicU64,
    pub failed: AtomicU64,
    /// How long answered queries took, from the question to the released answer (the
    /// upstream's answer and the kernel's acknowledgement of its addresses).
    pub answer_latency: Latency,
}

/// The upper bounds, in seconds, of [`Latency`]'s buckets (Prometheus' `le`).
pub const LATENCY_BOUNDS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// A latency histogram made of atomics: observing costs a few relaxed additions, and reading
/// it (a scrape) never waits for the guard, nor the guard for it.
#[derive(Debug, Default)]
pub struct Latency {
    /// Observations at most each bound of [`LATENCY_BOUNDS`] (not cumulative).
    buckets: [AtomicU64; LATENCY_BOUNDS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

/// What a [`Latency`] holds at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencySnapshot {
    /// `(bound, observations at most bound and above the bound before)`: not cumulative
    /// (the encoder adds them up); what exceeds every bound is in `count` only.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum_seconds: f64,
}

impl Latency {
    pub fn observe(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        if let Some(i) = LATENCY_BOUNDS.iter().position(|b| seconds <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> LatencySnapshot {
        // Read the count last: a concurrent observation may then show in it and not in a
        // bucket (it lands in +Inf for this scrape), never the other way round.
        let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS
            .iter()
            .zip(&self.buckets)
            .map(|(bound, n)| (*bound, n.load(Ordering::Relaxed)))
            .collect();
        let in_buckets = buckets.iter().map(|(_, n)| n).sum();
        let sum_seconds = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let count = self.count.load(Ordering::Relaxed).max(in_buckets);
        LatencySnapshot {
            buckets,
            count,
            sum_seconds,
        }
    }
}

/// A token bucket for log lines: an agent asking thousands of random names a second must not
/// flood the journal.
#[derive(Debug)]
pub struct LogBudget {
    tokens: f64,
    last: Instant,
    /// Lines not written since the last one that was.
    suppressed: u64,
}

impl Default for LogBudget {
    fn default() -> Self {
        LogBudget {
            tokens: f64::MAX,
            last: Instant::now(),
            suppressed: 0,
        }
    }
}

impl LogBudget {
    /// `Some(n)` if a line may be written now, `n` being how many were held back before it.
    pub fn take(&mut self, rate: Rate, burst: u32, now: Instant) -> Option<u64> {
        let per_second = rate.count as f64 / rate.unit.seconds() as f64;
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        let cap = f64::from(burst.max(1));
        self.tokens = (self.tokens.min(cap) + elapsed * per_second).min(cap);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Some(std::mem::take(&mut self.suppressed))
        } else {
            self.suppressed += 1;
            None
        }
    }
}

/// Whether a line about one query may be logged now (see [`LogBudget::take`]).
pub(super) fn may_log(context: &Context, rules: &Rules) -> Option<u64> {
    context
        .log_budget
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take(rules.log_rate, rules.log_burst, Instant::now())
}

#[cfg(test)]
mod tests {

    use std::time::Duration;

    use super::*;

    #[test]
    fn latency_buckets_hold_each_observation_once_and_the_slowest_go_to_inf_only() {
        let latency = Latency::default();
        latency.observe(Duration::from_micros(500));
        latency.observe(Duration::from_millis(30));
        latency.observe(Duration::from_secs(9));
        let s = latency.snapshot();
        assert_eq!(s.count, 3);
        assert!((s.sum_seconds - 9.0305).abs() < 1e-9, "{s:?}");
        let at = |bound: f64| s.buckets.iter().find(|(b, _)| *b == bound).unwrap().1;
        assert_eq!(at(0.001), 1);
        assert_eq!(at(0.025), 0);
        assert_eq!(at(0.05), 1);
        let in_buckets: u64 = s.buckets.iter().map(|(_, n)| n).sum();
        assert_eq!(
            in_buckets, 2,
            "9 s is past every bound: +Inf (the count) only"
        );
    }

    #[test]
    fn the_log_budget_keeps_the_policys_rate_and_counts_what_it_held_back() {
        let rate: Rate = "10/second".parse().unwrap();
        let mut budget = LogBudget::default();
        let t0 = Instant::now();
        let burst: Vec<Option<u64>> = (0..5).map(|_| budget.take(rate, 3, t0)).collect();
        assert_eq!(burst, [Some(0), Some(0), Some(0), None, None]);
        // A tenth of a second brings one line back, which says how many were held back.
        let t1 = t0 + Duration::from_millis(100);
        assert_eq!(budget.take(rate, 3, t1), Some(2));
        assert_eq!(budget.take(rate, 3, t1), None);
        // A long pause refills no more than the burst.
        let t2 = t1 + Duration::from_secs(60);
        let refilled = (0..5)
            .filter(|_| budget.take(rate, 3, t2).is_some())
            .count();
        assert_eq!(refilled, 3);
    }
}
