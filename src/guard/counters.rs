//! What the guard has done ([`Counters`], for the status line) and how much of it the log
//! takes ([`LogBudget`]).

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use crate::core::policy::Rate;

use super::{Context, Rules};

/// What the guard has done since it started, for the status line.
#[derive(Debug, Default)]
pub struct Counters {
    pub answered: AtomicU64,
    pub refused: AtomicU64,
    pub failed: AtomicU64,
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
