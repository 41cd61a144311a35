//! The boundary check: `egress-fence probe` tries, from inside the boundary, what the policy
//! promises, with real sockets, and says for each attempt whether the promise holds.
//!
//! - Every allowed name resolves through the allowed resolvers, and each of its address/port
//!   pairs accepts a TCP connection (UDP: is not refused by this host's rules).
//! - The metadata service (`cloud-metadata` preset) and every `probe.blocked` target are
//!   refused, over TCP and UDP, on every address they have.
//! - DNS to `probe.rogue_resolvers` is refused, over UDP and TCP.
//! - A random name under `probe.exfil_domain` does not resolve through the allowed resolvers
//!   (if it does, DNS can carry data out: a warning in resolve mode, which cannot filter
//!   names).
//!
//! In `dns.mode: guard` the guard is the resolver, and the checks follow it:
//!
//! - resolv.conf names the guard, and the guard answers on each `listen` address over UDP and
//!   TCP; allowed names are resolved by asking the guard itself (a small client here, so that
//!   REFUSED and NXDOMAIN stay apart), and their addresses then connect, since the guard added
//!   them to the table before it answered;
//! - DNS straight to each upstream resolver (UDP and TCP 53, TCP and UDP 853) is refused. The
//!   table lets through only sockets of the guard's uid that carry the guard's mark (`meta
//!   mark M meta skuid U`); the probe never marks its sockets, so it is refused whatever its
//!   uid, the guard's included. Only a table of an older version, which knows the guard by its
//!   uid alone, lets a probe of that uid through: it cannot tell, and says so (WARN) instead
//!   of trying. The uid and mark come from the installed table, or, when this probe may not
//!   read it (an unprivileged user), from the owner of the guard's listening socket and the
//!   policy;
//! - a random name under `probe.exfil_domain` (else under `egress-fence-probe.invalid`) is
//!   asked of the guard: answered REFUSED or NXDOMAIN and covered by no allow entry, it was
//!   refused without being forwarded (PASS); any address in the answer, or an allow entry (a
//!   wildcard) that covers the name, means the guard forwards such names, so DNS questions can
//!   carry data to whoever serves that zone (FAIL);
//! - the `dns-over-https` preset (implied by guard mode) is checked in the installed table's
//!   deny sets, never with traffic: its addresses are public resolvers.
//!
//! In both modes every element of the installed resolved sets must be one the policy explains
//! (an allowed name's, on that name's ports, within the lifetime cap where the service keeps
//! the table); each other one is a FAIL.
//!
//! Last, in both modes: whether this process can open a packet socket (`AF_PACKET`) or an XDP
//! socket (`AF_XDP`), both of which take CAP_NET_RAW. Frames written to them never meet the
//! output hook and nftables cannot refuse them (README, "What the fence cannot stop"), so
//! either is a FAIL for a process without CAP_NET_ADMIN, and skipped, with the reason, for
//! one that holds it.
//!
//! And whether this process may open a socket of a family whose packets leave from a socket
//! the kernel makes (SMC, RDS, RxRPC, TIPC: `kernel_sockets.rs`): no owner and, made on a
//! workqueue, no cgroup of the fenced process's, so a scope of users, groups or cgroups does
//! not see them (a FAIL under such a scope; with no scope the table judges their
//! destinations as any packet's).
//!
//! Everything runs in the caller's network namespace: the CLI enters `--netns` first, and the
//! probe's threads inherit the namespace of the thread that calls [`run`].
//!
//! How a refusal is recognised (Linux, observed in the integration tests):
//! - UDP: a datagram the output hook refuses fails in `send` with EPERM, for `action: drop`
//!   and `action: reject` alike (reject's verdict is a drop after the ICMP error is sent). The
//!   ICMP error of `reject` then arrives on the socket: EHOSTUNREACH over IPv4 (admin
//!   prohibited), EACCES over IPv6. A `send` that succeeds means the datagram left this host,
//!   whatever comes back afterwards.
//! - TCP: the SYN's EPERM is not reported by `connect`. With `reject` the fence answers this
//!   host's TCP connections with a reset, except those of sockets of priority
//!   [`ICMP_ANSWER_PRIORITY`](crate::core::ruleset::ICMP_ANSWER_PRIORITY), which the probe's
//!   are: they get the ICMP error, which fails the connect (EHOSTUNREACH or EACCES; over IPv6
//!   only at the first SYN retransmission, after about a second) and names its sender. With
//!   `drop` the connect times out. A timeout therefore counts as refused, a TCP reset
//!   (ECONNREFUSED) as proof that the SYN got through: a reset names no sender, and the
//!   fence's would look like a closed port's beyond it.
//! - Whose ICMP error: a far host or a router sends the same errors. The socket's error
//!   queue (IP_RECVERR, IPV6_RECVERR) names the sender; only an error sent from an address
//!   of this host (the stack answering the fence's `reject`) is this host's refusal
//!   (`origin.rs`). Without the error queue entry, it is not.
//! - The other transports (`other_protocols.rs`): UDP-Lite and ICMP echo as UDP, except that
//!   an IPv6 ping socket is never told of the drop of its request (silence is a WARN); SCTP
//!   and DCCP as TCP, except that an ICMP error the kernel does not queue with its sender
//!   cannot be traced (a WARN).
//!
//! Every refused destination is tried over TCP, UDP, UDP-Lite, ICMP echo, SCTP and DCCP; a
//! transport the kernel lacks, or a ping socket the kernel refuses this process, is a SKIP
//! that says so. The installed allow sets must hold only what the policy's `cidr:` entries
//! write, the DNS sets only the resolvers on DNS ports, and no set an element egress-fence
//! never writes.

mod attempt;
mod checks;
mod forward_ns;
mod guard_checks;
mod guard_lookup;
mod judge;
mod kernel_sockets;
mod link_layer;
mod options;
mod origin;
mod other_protocols;
mod plan;
mod report;
mod run_as;
mod scope;
#[cfg(test)]
mod testing;
mod tun;

pub use attempt::MAX_UDP_WAIT;
pub use forward_ns::{ForwardNs, ForwardNsError, FromBridge, interface_addrs};
pub use kernel_sockets::KERNEL_SOCKETS_CHECK;
pub use link_layer::LINK_LAYER_CHECK;
pub use options::{ProbeOptions, SystemResolvers, TableFacts, TableView};
pub use plan::DEFAULT_EXFIL_ZONE;
pub use report::{Check, Outcome, ProbeError, Report};
pub use run_as::{RunAs, RunAsError};
pub use scope::Prober;
pub use tun::TUN_CHECK;

use crate::core::policy::{DomainName, Policy, ProbeHost};
use crate::dns::resolve::resolve_names;

use attempt::{Ctx, run_concurrently};
use guard_lookup::{GuardLookup, guard_lookups};
use plan::{Attempt, Plan, Step, random_name_under};

/// Runs every check of `policy` from the current network namespace.
pub fn run(policy: &Policy, options: &ProbeOptions) -> Result<Report, ProbeError> {
    if options.resolvers.is_empty() {
        return Err(ProbeError::NoResolvers);
    }
    if options.timeout.is_zero() {
        return Err(ProbeError::ZeroTimeout);
    }
    let ctx = Ctx {
        timeout: options.timeout,
        udp_wait: options.timeout.min(MAX_UDP_WAIT),
        fence_router: options.fence_router.clone(),
    };
    let guard = policy.dns.guard.as_ref();
    // The guard refuses every name outside the policy, so it can always be checked: under a
    // zone that cannot exist when the policy names none.
    let exfil_name = match (&policy.probe.exfil_domain, guard) {
        (Some(domain), _) => Some(random_name_under(domain)),
        (None, Some(_)) => Some(
            DEFAULT_EXFIL_ZONE
                .parse::<DomainName>()
                .and_then(|zone| random_name_under(&zone)),
        ),
        (None, None) => None,
    };

    // Every name at once: allowed, blocked and the exfiltration test name.
    let mut names: Vec<&DomainName> = policy.domains().into_iter().collect();
    names.extend(policy.probe.blocked.iter().filter_map(|t| match &t.host {
        ProbeHost::Name(n) => Some(n),
        ProbeHost::Addr(_) => None,
    }));
    if let Some(Ok(name)) = &exfil_name {
        names.push(name);
    }
    names.sort();
    names.dedup();
    let (hosts, lookups) = match guard {
        None => (resolve_names(names, &options.resolvers)?, Vec::new()),
        Some(g) => {
            let lookups = guard_lookups(&names, &g.listen, &ctx)?;
            (lookups.iter().map(GuardLookup::host).collect(), lookups)
        }
    };

    let mut plan = Plan::new(policy, options, &hosts, &lookups);
    if let Some(line) = &options.outside_scope {
        plan.done(Check::new(Outcome::Skip, "scope", line.clone()));
    }
    match guard {
        None => {
            plan.resolvers();
            plan.allowed();
            plan.denied();
            plan.blocked();
            plan.rogue_resolvers();
            plan.exfiltration(exfil_name);
            plan.resolved_elements();
            plan.table_elements();
            plan.link_layer();
            plan.tun_devices();
            plan.kernel_sockets();
        }
        Some(g) => {
            plan.system_resolver(g);
            plan.guard_servers(g);
            plan.upstream();
            plan.allowed();
            plan.denied();
            plan.blocked();
            plan.rogue_resolvers();
            plan.guarded_exfiltration(exfil_name);
            plan.resolved_elements();
            plan.table_elements();
            plan.link_layer();
            plan.tun_devices();
            plan.kernel_sockets();
        }
    }

    let attempts: Vec<&Attempt> = plan
        .steps
        .iter()
        .filter_map(|s| match s {
            Step::Attempt(a) => Some(a),
            Step::Done(_) => None,
        })
        .collect();
    let mut results = run_concurrently(&attempts, &ctx)?.into_iter();
    let checks = plan
        .steps
        .into_iter()
        .filter_map(|s| match s {
            Step::Done(c) => Some(c),
            Step::Attempt(_) => results.next(),
        })
        .collect();
    Ok(Report { checks })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::probe::testing::*;

    #[test]
    fn setup_errors_come_before_any_traffic() {
        let p = policy("version: 1\n");
        let none = options(&[], TableView::NotRead);
        assert!(matches!(run(&p, &none), Err(ProbeError::NoResolvers)));
        let zero = ProbeOptions {
            timeout: Duration::ZERO,
            ..options(&["192.0.2.53"], TableView::NotRead)
        };
        assert!(matches!(run(&p, &zero), Err(ProbeError::ZeroTimeout)));
    }
}
