//! Judging an attempt: what was seen, against what was expected, as a verdict and a reason
//! a human understands.

use super::attempt::{Ctx, Seen, fmt_duration};
use super::plan::{Expect, Kind};
use super::report::Outcome;

/// Turns what was seen into a verdict and a reason a human understands.
pub(super) fn judge(seen: &Seen, expect: Expect, kind: Kind, ctx: &Ctx) -> (Outcome, String) {
    use Outcome::{Fail, Pass, Skip, Warn};
    let through = "the boundary let it through";
    let (t, w) = (fmt_duration(ctx.timeout), fmt_duration(ctx.udp_wait));
    match expect {
        Expect::Refuse => match seen {
            Seen::RefusedHere(d) => (Pass, format!("refused: {d}")),
            Seen::TimedOut => (Pass, format!("no answer within {t} (dropped)")),
            Seen::NotSent(d) => (Pass, format!("cannot leave this host: {d}")),
            Seen::Unavailable(d) => (Skip, d.clone()),
            Seen::Unconfirmed(d) => (Warn, d.clone()),
            Seen::Connected => (Fail, format!("connected: {through}")),
            Seen::Answered(d) => (Fail, format!("{d}: {through}")),
            Seen::RefusedRemotely(d) => (Fail, format!("{d}: {through}")),
            // From behind a bridge (`probe --from`) the fence is another host's: its drop
            // is silent, and its reject's ICMP errors are rate-limited.
            Seen::Silent if !ctx.fence_router.is_empty() => (
                Warn,
                format!(
                    "sent, no answer within {w}: the router's fence dropped it, or its ICMP \
                     error was rate-limited (net.ipv4.icmp_ratelimit), or it left unanswered; \
                     from behind a bridge these look the same"
                ),
            ),
            Seen::Silent => (
                Fail,
                format!(
                    "not refused: the datagram left this host (no answer within {w}); {through}"
                ),
            ),
        },
        // A prober outside the scope: any refusal by this host is the fence reaching too far.
        Expect::Untouched => {
            let outside = "outside the scope, the fence must not touch it";
            match seen {
                Seen::Connected => (Pass, "connected: not touched by the fence".into()),
                Seen::Answered(d) | Seen::RefusedRemotely(d) => {
                    (Pass, format!("{d}: not touched by the fence"))
                }
                Seen::Silent => (
                    Pass,
                    format!("sent, no answer within {w}: not touched by the fence"),
                ),
                Seen::RefusedHere(d) => (Fail, format!("refused here: {d}; {outside}")),
                // A drop and a host that does not answer look the same to TCP.
                Seen::TimedOut => (
                    Warn,
                    format!("no answer within {t}: dropped here, or nothing answers there"),
                ),
                Seen::NotSent(d) | Seen::Unconfirmed(d) => (Warn, format!("cannot tell: {d}")),
                Seen::Unavailable(d) => (Skip, d.clone()),
            }
        }
        Expect::Reach { strict } => match seen {
            Seen::Connected => (Pass, "connected".into()),
            Seen::Answered(d) => (Pass, d.clone()),
            Seen::Silent => (
                Pass,
                format!(
                    "sent, no answer within {w}: not refused by the boundary (UDP confirms \
                     nothing more)"
                ),
            ),
            Seen::RefusedRemotely(d) if kind == Kind::Udp || !strict => {
                (Pass, format!("{d}: {through}"))
            }
            Seen::RefusedRemotely(d) => (
                Fail,
                format!("{d}: {through}, but nothing accepts connections there (service down?)"),
            ),
            Seen::RefusedHere(d) => (Fail, format!("refused: {d}")),
            Seen::TimedOut => (
                Fail,
                format!(
                    "timed out after {t}: dropped by the boundary, or the host does not answer"
                ),
            ),
            Seen::NotSent(d) | Seen::Unavailable(d) | Seen::Unconfirmed(d) => (Fail, d.clone()),
        },
        Expect::Answer => match seen {
            Seen::Answered(d) => (Pass, d.clone()),
            Seen::Connected => (Fail, format!("connected, but no DNS answer within {t}")),
            Seen::Silent => (Fail, format!("no answer within {w}")),
            other => judge(other, Expect::Reach { strict: true }, kind, ctx),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::L4Proto;
    use crate::probe::testing::*;

    #[test]
    fn refusals_pass_only_when_this_host_refused() {
        let refuse = |seen| judge(&seen, Expect::Refuse, Kind::Udp, &ctx()).0;
        assert_eq!(refuse(Seen::RefusedHere("x".into())), Outcome::Pass);
        assert_eq!(refuse(Seen::TimedOut), Outcome::Pass);
        assert_eq!(refuse(Seen::NotSent("no route".into())), Outcome::Pass);
        assert_eq!(refuse(Seen::Connected), Outcome::Fail);
        assert_eq!(refuse(Seen::Answered("answered".into())), Outcome::Fail);
        assert_eq!(refuse(Seen::RefusedRemotely("reset".into())), Outcome::Fail);
        // Our rules fail the send itself, so a datagram that left unanswered got through.
        let (outcome, reason) = judge(&Seen::Silent, Expect::Refuse, Kind::Udp, &ctx());
        assert_eq!(outcome, Outcome::Fail);
        assert!(reason.contains("left this host"), "{reason}");
        // From behind a bridge, silence cannot be told from the router's drop.
        let forwarded = Ctx {
            fence_router: vec!["198.18.0.1".parse().unwrap()],
            ..ctx()
        };
        let (outcome, reason) = judge(&Seen::Silent, Expect::Refuse, Kind::Udp, &forwarded);
        assert_eq!(outcome, Outcome::Warn, "{reason}");
    }

    #[test]
    fn outside_the_scope_only_a_refusal_here_fails() {
        let untouched = |seen| judge(&seen, Expect::Untouched, Kind::Tcp, &ctx()).0;
        assert_eq!(untouched(Seen::Connected), Outcome::Pass);
        assert_eq!(untouched(Seen::Silent), Outcome::Pass);
        assert_eq!(
            untouched(Seen::RefusedRemotely("reset".into())),
            Outcome::Pass
        );
        assert_eq!(untouched(Seen::RefusedHere("EPERM".into())), Outcome::Fail);
        assert_eq!(untouched(Seen::TimedOut), Outcome::Warn);
        assert_eq!(untouched(Seen::NotSent("no route".into())), Outcome::Warn);
        assert_eq!(
            untouched(Seen::Unavailable("no sctp".into())),
            Outcome::Skip
        );
    }

    #[test]
    fn a_transport_nothing_here_can_send_is_skipped_and_an_unconfirmed_echo_warns() {
        let unavailable = Seen::Unavailable("not available on this kernel".into());
        let (o, reason) = judge(&unavailable, Expect::Refuse, Kind::Udp, &ctx());
        assert_eq!(o, Outcome::Skip);
        assert!(reason.contains("not available on this kernel"), "{reason}");
        let unconfirmed = Seen::Unconfirmed("cannot tell".into());
        assert_eq!(
            judge(&unconfirmed, Expect::Refuse, Kind::Udp, &ctx()).0,
            Outcome::Warn
        );
        // Where traffic must pass, neither is a pass.
        let reach = Expect::Reach { strict: true };
        assert_eq!(
            judge(&unavailable, reach, Kind::Tcp, &ctx()).0,
            Outcome::Fail
        );
        assert_eq!(
            judge(&unconfirmed, reach, Kind::Tcp, &ctx()).0,
            Outcome::Fail
        );
    }

    #[test]
    fn a_reset_fails_a_single_allowed_port_but_not_a_range_end_or_udp() {
        let reset = Seen::RefusedRemotely("connection refused (TCP reset)".into());
        let (o, reason) = judge(&reset, Expect::Reach { strict: true }, Kind::Tcp, &ctx());
        assert_eq!(o, Outcome::Fail);
        assert!(reason.contains("the boundary let it through"), "{reason}");
        let lenient = Expect::Reach { strict: false };
        assert_eq!(judge(&reset, lenient, Kind::Tcp, &ctx()).0, Outcome::Pass);
        let strict = Expect::Reach { strict: true };
        assert_eq!(judge(&reset, strict, Kind::Udp, &ctx()).0, Outcome::Pass);
        assert_eq!(
            judge(&Seen::Silent, strict, Kind::Udp, &ctx()).0,
            Outcome::Pass
        );
        assert_eq!(
            judge(&Seen::TimedOut, strict, Kind::Tcp, &ctx()).0,
            Outcome::Fail
        );
        let dns = Kind::Dns(L4Proto::Tcp);
        assert_eq!(
            judge(&Seen::Connected, Expect::Answer, dns, &ctx()).0,
            Outcome::Fail
        );
    }
}
