//! From the file as written to a policy: the checks that relate two parts of it, each
//! located in the source text.

use std::net::{IpAddr, SocketAddr};

use super::errors::{Located, locate, locate_value};
use super::includes::expand;
use super::limits::{MAX_LOG_PREFIX, UNCHECKED_KERNEL_LIMITS_ENV, kernel_accepts_limit, max_burst};
use super::presets::Preset;
use super::raw::{DnsMode, RawPolicy};
use super::schema::*;
use super::scope::SystemAccounts;

impl Policy {
    /// The policy `raw` describes, once the checks that relate two parts of it pass; `source`
    /// is the text it was read from, for locating what fails.
    pub(super) fn from_raw(raw: RawPolicy, source: &str) -> Result<Policy, Located> {
        let prefix = raw.log.prefix.unwrap_or_else(|| DEFAULT_LOG_PREFIX.into());
        if prefix.len() > MAX_LOG_PREFIX || prefix.contains(['"', '\0', '\n']) {
            return Err((
                locate(source, "prefix"),
                format!(
                    "the log prefix must be at most {MAX_LOG_PREFIX} bytes without quotes or \
                     line breaks"
                ),
            ));
        }

        let rate = raw.log.rate.unwrap_or(DEFAULT_RATE);
        let burst = raw.log.burst.unwrap_or(DEFAULT_BURST);
        let unchecked = std::env::var_os(UNCHECKED_KERNEL_LIMITS_ENV).is_some_and(|v| v == "1");
        if !unchecked && !kernel_accepts_limit(rate.count, rate.unit.seconds(), burst) {
            let max = max_burst(rate);
            let (key, message) = if burst == 0 {
                (
                    "burst:",
                    "`burst: 0` would silently become the kernel's default of 5; write a \
                     burst of at least 1"
                        .to_string(),
                )
            } else if max == 0 {
                (
                    "rate:",
                    format!(
                        "the kernel refuses the log rate {rate}: the rate plus the burst must \
                         fit in 64 bits; write a lower rate"
                    ),
                )
            } else {
                (
                    "burst:",
                    format!(
                        "the kernel refuses a burst of {burst} at {rate}: its token bucket would \
                         overflow 64 bits; the largest burst it takes at this rate is {max}"
                    ),
                )
            };
            let at = match locate(source, key) {
                (0, _) => locate(source, "log:"),
                at => at,
            };
            return Err((at, message));
        }

        let guard = match raw.dns.mode {
            Some(DnsMode::Guard) => {
                if raw.dns.resolvers.is_some() {
                    return Err((
                        locate(source, "resolvers"),
                        "in `dns.mode: guard` the guard forwards to `dns.upstream`, and nothing \
                         else may ask any resolver; rename `resolvers` to `upstream`"
                            .into(),
                    ));
                }
                let upstream: Vec<IpAddr> = raw
                    .dns
                    .upstream
                    .unwrap_or_default()
                    .into_iter()
                    .map(|r| r.0)
                    .collect();
                if upstream.is_empty() {
                    return Err((
                        locate(source, "mode"),
                        "`dns.mode: guard` forwards allowed names to `dns.upstream`: list at \
                         least one resolver, e.g. `upstream: [192.0.2.53]`"
                            .into(),
                    ));
                }
                let listen: Vec<SocketAddr> = match raw.dns.listen {
                    Some(l) => l.into_iter().map(|l| l.0).collect(),
                    None => vec![DEFAULT_GUARD_LISTEN.parse().expect("valid literal")],
                };
                if listen.is_empty() {
                    return Err((
                        locate(source, "listen"),
                        "`listen: []` leaves the guard deaf; list an address such as \
                         127.0.0.53:53, or leave the key out for that default"
                            .into(),
                    ));
                }
                let mark = raw.dns.mark.unwrap_or(DEFAULT_GUARD_MARK);
                if mark == 0 {
                    return Err((
                        locate(source, "mark"),
                        "`mark: 0` is the mark of every unmarked socket, so it would let \
                         any process of the guard's uid ask the upstream resolvers; choose \
                         a mark no other tool on this host uses, or leave the key out"
                            .into(),
                    ));
                }
                Some(GuardSettings {
                    listen,
                    upstream,
                    refuse_with: raw.dns.refuse_with.unwrap_or(RefuseWith::Refused),
                    floor: raw.dns.floor.map_or(DEFAULT_FLOOR, |i| i.0),
                    mark,
                })
            }
            Some(DnsMode::Resolve) | None => {
                let guard_only = [
                    ("listen", raw.dns.listen.is_some()),
                    ("upstream", raw.dns.upstream.is_some()),
                    ("refuse_with", raw.dns.refuse_with.is_some()),
                    ("floor", raw.dns.floor.is_some()),
                    ("mark", raw.dns.mark.is_some()),
                ];
                if let Some((key, _)) = guard_only.iter().find(|(_, given)| *given) {
                    return Err((
                        locate(source, key),
                        format!(
                            "`dns.{key}` belongs to the DNS guard; add `mode: guard` to `dns:` \
                             or remove `{key}`"
                        ),
                    ));
                }
                None
            }
        };
        let mut deny: Vec<Deny> = raw.deny.into_iter().map(|d| d.0).collect();
        // The guard is only a boundary if no other resolver answers: DNS over HTTPS to the
        // public resolvers would look like any HTTPS.
        let doh = DenyOrigin::Preset(Preset::DnsOverHttps);
        if guard.is_some() && !deny.iter().any(|d| d.origin == doh) {
            deny.push(Deny {
                networks: Preset::DnsOverHttps.networks(),
                origin: doh,
                comment: Some("implied by dns.mode: guard".into()),
            });
        }

        let scope = match raw.scope {
            None => None,
            Some(scope) => Some(scope.resolve(&SystemAccounts).map_err(|(message, at)| {
                let at = match locate_value(source, "scope", |t| t == at) {
                    (0, _) => locate(source, "scope"),
                    at => at,
                };
                (at, message)
            })?),
        };
        let policy = Policy {
            action: raw.action,
            allow: expand(raw.allow.into_iter().map(|a| a.0).collect(), &raw.include),
            include: raw.include,
            deny,
            dns: Dns {
                resolvers: raw
                    .dns
                    .resolvers
                    .map(|r| r.into_iter().map(|r| r.0).collect()),
                refresh_min: raw.dns.refresh.min.map_or(DEFAULT_REFRESH_MIN, |i| i.0),
                refresh_max: raw.dns.refresh.max.map_or(DEFAULT_REFRESH_MAX, |i| i.0),
                grace: raw.dns.grace.map_or(DEFAULT_GRACE, |i| i.0),
                guard,
            },
            log: Log {
                prefix,
                group: raw.log.group,
                rate,
                burst,
            },
            probe: ProbeSettings {
                blocked: raw.probe.blocked,
                rogue_resolvers: raw.probe.rogue_resolvers.map_or_else(
                    || {
                        DEFAULT_ROGUE_RESOLVERS
                            .iter()
                            .map(|r| r.parse().expect("valid literal"))
                            .collect()
                    },
                    |r| r.into_iter().map(|r| r.0).collect(),
                ),
                exfil_domain: raw.probe.exfil_domain,
            },
            essentials: raw.essentials.map_or_else(
                || Essential::ALL.into_iter().collect(),
                |e| e.into_iter().collect(),
            ),
            scope,
        };

        if policy.dns.guard.is_none()
            && let Some(w) = policy.allow.iter().find_map(|a| match &a.target {
                Target::Wildcard(w) => Some(w),
                _ => None,
            })
        {
            return Err((
                locate(source, &w.to_string()),
                format!(
                    "the wildcard `{w}` can only be followed by the DNS guard, which sees every \
                     name asked: set `dns.mode: guard` (with `upstream:`), or list the names"
                ),
            ));
        }
        // A fenced process may ask the guard only where it listens, and an unspecified address
        // names no one place: the rule would have to accept port 53 of every local address,
        // where another resolver of this host (unfenced) may listen on a specific one.
        if let (Some(_), Some(g)) = (&policy.scope, &policy.dns.guard)
            && let Some(any) = g.listen.iter().find(|l| l.ip().is_unspecified())
        {
            return Err((
                locate_value(source, "listen", |t| t.contains(&any.ip().to_string())),
                format!(
                    "with a `scope:` the guard listens on named addresses, not `{any}`: fenced \
                     processes may ask it only where it listens; write 127.0.0.53:53 or the \
                     addresses to listen on"
                ),
            ));
        }
        if policy.dns.refresh_min > policy.dns.refresh_max {
            return Err((
                locate(source, "refresh"),
                "`dns.refresh.min` is longer than `dns.refresh.max`; swap them".into(),
            ));
        }
        if policy.dns.resolvers.as_ref().is_some_and(Vec::is_empty) {
            return Err((
                locate(source, "resolvers"),
                "`resolvers: []` would leave no way to resolve names; list at least one \
                 resolver or leave the key out to use /etc/resolv.conf"
                    .into(),
            ));
        }
        Ok(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::test_support::*;
    use std::time::Duration;

    #[test]
    fn a_scoped_guard_listens_on_named_addresses() {
        let (line, col, msg) = err(
            "version: 1\nscope:\n  users: [1001]\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  \
             listen: [\"0.0.0.0:53\"]\n",
        );
        assert_eq!((line, col), (7, 13), "{msg}");
        assert!(msg.contains("named addresses"), "{msg}");
        assert!(
            parse("version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  listen: [\"0.0.0.0:53\"]\n")
                .is_ok()
        );
    }

    #[test]
    fn empty_resolver_and_port_lists_are_refused() {
        let (_, _, msg) = err("version: 1\ndns:\n  resolvers: []\n");
        assert!(msg.contains("at least one"), "{msg}");
        let (_, _, msg) = err("version: 1\nallow:\n  - cidr: 192.0.2.1\n    ports: []\n");
        assert!(msg.contains("allows nothing"), "{msg}");
    }

    #[test]
    fn guard_mode_reads_its_settings_with_defaults() {
        let p = parse(GUARD).expect("valid");
        let g = p.dns.guard.as_ref().expect("guard mode");
        assert_eq!(g.listen, vec!["127.0.0.53:53".parse().unwrap()]);
        assert_eq!(g.upstream, vec!["192.0.2.53".parse::<IpAddr>().unwrap()]);
        assert_eq!(g.refuse_with, RefuseWith::Refused);
        assert_eq!(g.floor, DEFAULT_FLOOR);
        assert_eq!(g.mark, DEFAULT_GUARD_MARK);
        // DNS over HTTPS to public resolvers is denied without being asked for.
        let doh = p.denied_by("1.1.1.1".parse().unwrap()).expect("denied");
        assert_eq!(doh.origin, DenyOrigin::Preset(Preset::DnsOverHttps));

        let p = parse(&GUARD.replace(
            "  upstream: [192.0.2.53]\n",
            "  upstream: [192.0.2.53]\n  listen: [\"[::1]:5353\", 127.0.0.1]\n  refuse_with: nxdomain\n  floor: 2m\n  mark: 0x1e00\n",
        ))
        .expect("valid");
        let g = p.dns.guard.expect("guard mode");
        assert_eq!(g.mark, 0x1e00);
        assert_eq!(
            g.listen,
            vec![
                "[::1]:5353".parse().unwrap(),
                "127.0.0.1:53".parse().unwrap()
            ]
        );
        assert_eq!(g.refuse_with, RefuseWith::Nxdomain);
        assert_eq!(g.floor, Duration::from_secs(120));
        assert!(parse(FULL).expect("valid").dns.guard.is_none());
    }

    #[test]
    fn guard_mode_settings_are_checked() {
        let (line, _, msg) = err("version: 1\ndns:\n  mode: guard\n");
        assert_eq!(line, 3);
        assert!(msg.contains("upstream: [192.0.2.53]"), "{msg}");
        let (line, _, msg) = err(
            "version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  resolvers: [192.0.2.53]\n",
        );
        assert_eq!(line, 5);
        assert!(msg.contains("rename `resolvers` to `upstream`"), "{msg}");
        let (line, _, msg) = err("version: 1\ndns:\n  upstream: [192.0.2.53]\n");
        assert_eq!(line, 3);
        assert!(msg.contains("add `mode: guard`"), "{msg}");
        let (line, col, msg) = err(
            "version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  listen: [localhost]\n",
        );
        assert_eq!((line, col), (5, 12), "{msg}");
        assert!(msg.contains("127.0.0.53:53"), "{msg}");
        let (line, _, msg) = err("version: 1\ndns:\n  mode: proxy\n");
        assert_eq!(line, 3, "{msg}");
        let (line, _, msg) =
            err("version: 1\ndns:\n  mode: guard\n  upstream: [192.0.2.53]\n  mark: 0\n");
        assert_eq!(line, 5, "{msg}");
        assert!(msg.contains("unmarked socket"), "{msg}");
    }

    #[test]
    fn log_prefix_and_group_limits_are_the_kernels() {
        let prefix = |n: usize| with_log(&format!("prefix: \"{}\"", "a".repeat(n)));
        assert_eq!(parse(&prefix(127)).expect("valid").log.prefix.len(), 127);
        let (line, column, message) = err(&prefix(128));
        assert_eq!((line, column), (5, 3));
        assert!(message.contains("127 bytes"), "{message}");
        assert!(parse(&with_log("prefix: \"\"")).is_ok());
        // NFLOG groups are 16-bit; every one of them is taken.
        assert_eq!(
            parse(&with_log("group: 65535")).expect("valid").log.group,
            Some(65535)
        );
        assert_eq!(
            parse(&with_log("group: 0")).expect("valid").log.group,
            Some(0)
        );
        let (line, _, _) = err(&with_log("group: 65536"));
        assert_eq!(line, 5);
    }
}
