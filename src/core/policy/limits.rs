//! The limits the kernel puts on what a policy asks of it, checked while the policy is read
//! so that an apply never fails on them.

use super::values::Rate;

/// The kernel keeps at most 127 bytes of a log prefix (NF_LOG_PREFIXLEN with its NUL); a
/// longer one is refused with ERANGE (measured: 127 bytes pass, 128 do not).
pub(super) const MAX_LOG_PREFIX: usize = 127;

/// Fault injection for tests: with this set to 1 the parser does not check the log limit
/// against the kernel's, so a test can hand the daemon a policy the kernel refuses, standing
/// for a kernel limit this build does not know (the daemon must still never adopt it).
pub const UNCHECKED_KERNEL_LIMITS_ENV: &str = "EGRESS_FENCE_TEST_UNCHECKED_KERNEL_LIMITS";

/// Whether the kernel accepts a packet limit of `rate` per `unit_seconds` with `burst`, as
/// nft_limit_init (net/netfilter/nft_limit.c) checks it: the unit in nanoseconds, the rate
/// plus the burst, and the bucket's size, nanoseconds per packet times the burst, must each
/// fit in 64 bits, or the rule is refused with EOVERFLOW. Measured on 6.18: `1/day burst
/// 213503` passes and `213504` does not; `18446744073709551595/second burst 20` passes and
/// one more does not. A burst of 0 would silently become the kernel's default of 5.
pub fn kernel_accepts_limit(rate: u64, unit_seconds: u64, burst: u32) -> bool {
    let Some(nsecs) = unit_seconds.checked_mul(1_000_000_000) else {
        return false;
    };
    rate > 0
        && burst > 0
        && rate.checked_add(u64::from(burst)).is_some()
        && (nsecs / rate).checked_mul(u64::from(burst)).is_some()
}

/// The largest burst the kernel accepts at `rate` (0 when none does).
pub(super) fn max_burst(rate: Rate) -> u64 {
    let nsecs = rate.unit.seconds() * 1_000_000_000;
    let by_bucket = u64::MAX / (nsecs / rate.count).max(1);
    let by_sum = u64::MAX - rate.count;
    by_bucket.min(by_sum).min(u64::from(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::test_support::*;

    #[test]
    fn log_limits_mirror_nft_limit_init_at_and_past_the_boundary() {
        // Measured with nft on 6.18: each first value is taken, each second refused.
        for (ok, refused, key) in [
            (
                "rate: 1/day\n  burst: 213503",
                "rate: 1/day\n  burst: 213504",
                "burst",
            ),
            (
                "rate: 18446744073709551595/second\n  burst: 20",
                "rate: 18446744073709551596/second\n  burst: 20",
                "burst",
            ),
            (
                "rate: 18446744073709551594/second",
                "rate: 18446744073709551615/second",
                "rate",
            ),
            (
                "rate: 1/second\n  burst: 4294967295",
                "rate: 1/day\n  burst: 4294967295",
                "burst",
            ),
            ("burst: 1", "burst: 0", "burst"),
        ] {
            let p = parse(&with_log(ok)).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(kernel_accepts_limit(
                p.log.rate.count,
                p.log.rate.unit.seconds(),
                p.log.burst
            ));
            let (line, column, message) = err(&with_log(refused));
            let want_line = if key == "rate" {
                5
            } else {
                with_log(refused).lines().count()
            };
            assert_eq!((line, column), (want_line, 3), "{refused}: {message}");
            assert!(message.contains("kernel"), "{message}");
        }
        let (_, _, message) = err(&with_log("rate: 1/day\n  burst: 213504"));
        assert!(message.contains("213503"), "{message}");
        assert!(!kernel_accepts_limit(1, 1, 0));
        assert!(kernel_accepts_limit(10, 1, 20));
    }
}
