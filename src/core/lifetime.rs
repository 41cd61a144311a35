//! The lifetime ledger: how long a resolved element lives, when a name is asked again, and
//! how lifetimes from several sources combine. Pure: durations and deadlines in, durations
//! and deadlines out.
//!
//! Every rule about element lifetimes lives here, so that the planner, the resolve-mode
//! refresh, the guard's answers, the sweep of live connections and the carry-over of a
//! restarted guard all agree:
//!
//! - an answer in resolve mode is asked again after its TTL, clamped to `dns.refresh`
//!   ([`Lifetimes::refresh_after`]), and its addresses live that long plus `dns.grace`
//!   ([`Lifetimes::resolved`]);
//! - an answer the guard forwards lives its TTL (at least `dns.floor`) plus the grace
//!   ([`Lifetimes::guarded`]);
//! - nothing lives longer than [`Lifetimes::cap`], whatever a TTL, a sweep or a carried
//!   element says;
//! - where several sources give the same element a lifetime, the longest wins
//!   ([`keep_longest`], [`longer_timeout`]): a name's refresh never shortens what another name
//!   gave a shared element.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::core::installable::effective_ttl;
use crate::core::policy::Dns;

/// The lifetime settings of one policy (its `dns` section).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetimes {
    pub refresh_min: Duration,
    pub refresh_max: Duration,
    pub grace: Duration,
    /// Guard mode: the shortest time an answered address stays allowed (before the grace).
    /// `None`: resolve mode.
    pub floor: Option<Duration>,
}

/// The longest retry delay after failed lookups.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

impl Lifetimes {
    pub fn of(dns: &Dns) -> Lifetimes {
        Lifetimes {
            refresh_min: dns.refresh_min,
            refresh_max: dns.refresh_max,
            grace: dns.grace,
            floor: dns.guard.as_ref().map(|g| g.floor),
        }
    }

    /// How long after an answer with `ttl` a name is asked again (resolve mode).
    pub fn refresh_after(&self, ttl: u32) -> Duration {
        Duration::from_secs(ttl.into()).clamp(self.refresh_min, self.refresh_max)
    }

    /// When a successful answer is followed up: after its shortest TTL, or after
    /// `dns.refresh.min` when it has no address (NXDOMAIN, no records).
    pub fn next_refresh(&self, ttls: impl IntoIterator<Item = u32>) -> Duration {
        ttls.into_iter()
            .min()
            .map_or(self.refresh_min, |t| self.refresh_after(t))
    }

    /// Retry delay after `failures` failed lookups in a row: 1 s, 2 s, 4 s, 8 s, then every
    /// 10 s (or the refresh floor, if shorter): a host that boots before its network resolves
    /// its names soon after the resolver answers.
    pub fn retry_after(&self, failures: u32) -> Duration {
        Duration::from_secs(1u64 << failures.clamp(1, 16).saturating_sub(1))
            .min(self.refresh_min)
            .min(MAX_BACKOFF)
    }

    /// How long an address answered with `ttl` in resolve mode stays allowed: until the name
    /// is asked again, plus the grace.
    pub fn resolved(&self, ttl: u32) -> Duration {
        self.refresh_after(ttl) + self.grace
    }

    /// How long an address in a guard's answer stays allowed: at least as long as the client
    /// may cache it (its TTL), at least the floor, then the grace; but never longer than
    /// [`Lifetimes::cap`]: an answer under an allowed wildcard is its owner's to write, TTL
    /// included. A client that caches longer than that asks again and renews the element.
    pub fn guarded(&self, ttl: u32) -> Duration {
        let floor = self.floor.unwrap_or(Duration::ZERO);
        let ttl = Duration::from_secs(effective_ttl(ttl).into());
        ttl.max(floor).min(self.refresh_max.max(floor)) + self.grace
    }

    /// The longest lifetime any resolved element may have: `dns.refresh.max` (in guard mode
    /// at least the floor, which the policy may set higher) plus the grace. Whatever an
    /// answer's TTL says, no element outlives this, in either mode.
    pub fn cap(&self) -> Duration {
        self.refresh_max.max(self.floor.unwrap_or(Duration::ZERO)) + self.grace
    }

    /// A guard's answer renews an element only when the element would otherwise expire
    /// within this much: a name asked a thousand times a second costs one batch, not a
    /// thousand, and every released answer still outlives its TTL by half the grace or more.
    pub fn renew_slack(&self) -> Duration {
        self.grace / 2
    }

    /// Guard mode: how often the daemon looks for live connections to addresses about to
    /// expire: a third of the shortest lifetime, between 1 and 10 seconds.
    pub fn sweep_every(&self) -> Option<Duration> {
        let floor = self.floor?;
        Some(((floor + self.grace) / 3).clamp(Duration::from_secs(1), Duration::from_secs(10)))
    }

    /// How long a sweep keeps an element with a live connection: three sweeps, never past
    /// the cap (a sweep cannot outlive what an answer may).
    pub fn kept_connected(&self, sweep: Duration) -> Duration {
        (3 * sweep).min(self.cap())
    }

    /// How much longer an element a restarted guard finds in the running table stays: what
    /// the kernel says is left of it (`expires_ms`), a permanent element (a CLI apply) the
    /// grace, and none past the cap.
    pub fn carried(&self, expires_ms: Option<u64>) -> Duration {
        expires_ms
            .map_or(self.grace, Duration::from_millis)
            .min(self.cap())
    }
}

/// The longest lifetime any resolved element may have under `dns` (see [`Lifetimes::cap`]).
pub fn lifetime_cap(dns: &Dns) -> Duration {
    Lifetimes::of(dns).cap()
}

/// An element's timeout for the kernel, from what is left of its lifetime: whole
/// milliseconds, never zero (zero means "no timeout").
pub fn timeout_ms(remaining: Duration) -> u64 {
    remaining.as_millis().max(1) as u64
}

/// The lifetime of an element two sources give: the longer timeout, and a permanent one
/// (`None`) over any timeout.
pub fn longer_timeout(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        _ => None,
    }
}

/// Records that `key` lives until `expires`, unless it already lives longer: the longest
/// expiry wins. Returns the expiry now recorded.
pub fn keep_longest<K: Ord, T: Ord + Copy>(map: &mut BTreeMap<K, T>, key: K, expires: T) -> T {
    let e = map.entry(key).or_insert(expires);
    *e = (*e).max(expires);
    *e
}

/// The elements to send so the kernel holds every `desired` element at least until its
/// desired expiry: new ones, and those whose expiry would move later by more than `slack`.
/// An element is never shortened: the kernel already holds the later expiry.
pub fn renewals<K: Ord + Copy, T: Ord + Copy + std::ops::Add<Duration, Output = T>>(
    desired: &BTreeMap<K, T>,
    installed: &BTreeMap<K, T>,
    slack: Duration,
) -> Vec<(K, T)> {
    desired
        .iter()
        .filter(|(k, e)| installed.get(k).is_none_or(|i| **e > *i + slack))
        .map(|(k, e)| (*k, *e))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Instant;

    use super::*;
    use crate::core::policy::Policy;

    fn resolve_mode() -> Lifetimes {
        let p = Policy::parse(
            "version: 1\nallow:\n  - domain: a.example\n    ports: [443]\ndns:\n  refresh: { min: 30s, max: 1h }\n  grace: 10m\n",
            Path::new("p.yaml"),
        )
        .expect("valid");
        Lifetimes::of(&p.dns)
    }

    fn guard_mode() -> Lifetimes {
        let p = Policy::parse(
            "version: 1\nallow:\n  - domain: \"*.pool.example\"\n    ports: [443]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  floor: 30s\n  grace: 10m\n  refresh: { min: 30s, max: 1h }\n",
            Path::new("p.yaml"),
        )
        .expect("valid");
        Lifetimes::of(&p.dns)
    }

    #[test]
    fn intervals_follow_the_ttl_within_bounds() {
        let l = resolve_mode();
        assert_eq!(l.refresh_after(5), Duration::from_secs(30));
        assert_eq!(l.refresh_after(300), Duration::from_secs(300));
        assert_eq!(l.refresh_after(86_400), Duration::from_secs(3600));
        assert_eq!(l.resolved(300), Duration::from_secs(300 + 600));
        assert_eq!(l.next_refresh([300, 60, 900]), Duration::from_secs(60));
        assert_eq!(l.next_refresh([]), l.refresh_min, "no address: the floor");
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let l = resolve_mode();
        let got: Vec<u64> = (1..=6).map(|f| l.retry_after(f).as_secs()).collect();
        assert_eq!(got, vec![1, 2, 4, 8, 10, 10]);
        assert_eq!(l.retry_after(100), Duration::from_secs(10));
        let short = Lifetimes {
            refresh_min: Duration::from_secs(3),
            ..l
        };
        assert_eq!(short.retry_after(4), Duration::from_secs(3));
    }

    #[test]
    fn guard_answers_live_for_their_ttl_or_the_floor_plus_grace() {
        let l = guard_mode();
        assert_eq!(l.guarded(5), Duration::from_secs(30 + 600));
        assert_eq!(l.guarded(3600), Duration::from_secs(3600 + 600));
        assert_eq!(l.renew_slack(), Duration::from_secs(300));
    }

    #[test]
    fn no_answer_lives_past_refresh_max_plus_grace_whatever_its_ttl() {
        let l = guard_mode();
        let cap = Duration::from_secs(3600 + 600);
        assert_eq!(l.cap(), cap);
        assert_eq!(l.guarded(86_400), cap);
        assert_eq!(l.guarded(0x7fff_ffff), cap);
        // RFC 2181: the top bit set means zero, so the floor.
        let floor = Duration::from_secs(30 + 600);
        assert_eq!(l.guarded(u32::MAX), floor);
        assert_eq!(l.guarded(0x8000_0000), floor);
        // A floor above refresh.max is the policy's explicit wish: it is the cap then.
        let l = Lifetimes {
            refresh_max: Duration::from_secs(10),
            ..l
        };
        assert_eq!(l.guarded(86_400), floor);
        assert_eq!(l.cap(), floor);
        // Resolve mode: the refresh interval is clamped to refresh.max.
        let l = resolve_mode();
        assert_eq!(l.resolved(u32::MAX >> 1), l.cap());
        assert_eq!(l.cap(), Duration::from_secs(3600 + 600));
    }

    #[test]
    fn sweeps_are_a_third_of_the_shortest_lifetime_and_keep_within_the_cap() {
        assert_eq!(resolve_mode().sweep_every(), None);
        let l = guard_mode();
        assert_eq!(l.sweep_every(), Some(Duration::from_secs(10)));
        let tiny = Lifetimes {
            floor: Some(Duration::ZERO),
            grace: Duration::from_secs(1),
            ..l
        };
        assert_eq!(tiny.sweep_every(), Some(Duration::from_secs(1)));
        assert_eq!(
            l.kept_connected(Duration::from_secs(10)),
            Duration::from_secs(30)
        );
        let small_cap = Lifetimes {
            refresh_max: Duration::from_secs(1),
            floor: Some(Duration::from_secs(1)),
            grace: Duration::from_secs(2),
            ..l
        };
        assert_eq!(
            small_cap.kept_connected(Duration::from_secs(10)),
            Duration::from_secs(3)
        );
    }

    #[test]
    fn carried_elements_keep_what_is_left_of_them_within_the_cap() {
        let l = guard_mode();
        assert_eq!(l.carried(Some(90_000)), Duration::from_secs(90));
        assert_eq!(
            l.carried(None),
            l.grace,
            "a permanent element gets the grace"
        );
        assert_eq!(l.carried(Some(u64::MAX / 2)), l.cap());
    }

    #[test]
    fn timeouts_carry_the_remaining_lifetime_and_are_never_zero() {
        assert_eq!(timeout_ms(Duration::from_secs(90)), 90_000);
        assert_eq!(timeout_ms(Duration::ZERO), 1, "never zero: zero means none");
        assert_eq!(timeout_ms(Duration::from_micros(1500)), 1);
    }

    #[test]
    fn the_longest_expiry_wins() {
        assert_eq!(longer_timeout(Some(10), Some(20)), Some(20));
        assert_eq!(longer_timeout(Some(10), None), None, "permanent wins");
        assert_eq!(longer_timeout(None, Some(10)), None);
        let mut m = BTreeMap::new();
        assert_eq!(keep_longest(&mut m, "a", 5), 5);
        assert_eq!(keep_longest(&mut m, "a", 3), 5, "never shortened");
        assert_eq!(keep_longest(&mut m, "a", 8), 8);
    }

    #[test]
    fn renewals_only_move_forward_and_respect_the_slack() {
        let now = Instant::now();
        let at = |s| now + Duration::from_secs(s);
        let installed = BTreeMap::from([(1, at(630)), (2, at(100))]);
        let desired = BTreeMap::from([(1, at(690)), (2, at(50)), (3, at(10))]);
        assert_eq!(
            renewals(&desired, &installed, Duration::ZERO),
            vec![(1, at(690)), (3, at(10))],
            "later and new elements are sent, never a shorter one"
        );
        // With half the grace as slack: a minute later is not worth a batch.
        let slack = guard_mode().renew_slack();
        assert_eq!(renewals(&desired, &installed, slack), vec![(3, at(10))]);
        let much_later = BTreeMap::from([(1, at(630 + 301))]);
        assert_eq!(renewals(&much_later, &installed, slack).len(), 1);
    }
}
