//! Whether the policy's `scope:` fences the probe's traffic: who sends it ([`Prober`]), and,
//! when the scope leaves that sender out, the line the report opens with.
//!
//! The table decides by the socket's uid and gid (`meta skuid`, `meta skgid`), the cgroup of
//! the process that made it (`socket cgroupv2`), or, for forwarded packets, the interface they
//! came in on (`iifname`). The probe asks the same questions of the identity it sends from.

use std::fmt;

use crate::core::policy::Policy;

/// Who the probe's attempts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prober {
    /// A process of this host: its effective uid and gid (what its sockets carry), its user's
    /// name when it has one, and its cgroup v2 path below the hierarchy's root (`agent.slice/x`,
    /// `None` when it cannot be read).
    Local {
        uid: u32,
        gid: u32,
        name: Option<String>,
        cgroup: Option<String>,
    },
    /// A namespace behind a bridge of this host: its packets are forwarded in from `iface`.
    Forwarded { iface: String, addr: String },
}

impl Prober {
    /// This process as it is now.
    pub fn current() -> Prober {
        let uid = nix::unistd::geteuid();
        Prober::Local {
            uid: uid.as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            name: nix::unistd::User::from_uid(uid)
                .ok()
                .flatten()
                .map(|u| u.name),
            cgroup: std::fs::read_to_string("/proc/self/cgroup")
                .ok()
                .and_then(|text| own_cgroup(&text)),
        }
    }

    /// The text of the report's opening line when `policy`'s scope does not fence this
    /// prober: "nobody (uid 65534) is not in the scope: expect everything to pass". `None`
    /// when it is fenced (always, without a `scope:`, for a local process).
    pub fn outside_scope(&self, policy: &Policy) -> Option<String> {
        if self.fenced(policy) {
            return None;
        }
        let mut line = format!("{self} is not in the scope: expect everything to pass");
        if policy.dns.guard.is_some() {
            // The guard's rules (only it reaches the upstream resolvers) apply to everyone.
            line.push_str(
                " (except DNS straight to the upstream resolvers, which only the guard may reach)",
            );
        }
        Some(line)
    }

    /// Whether the table sends this prober's packets through the fence.
    pub fn fenced(&self, policy: &Policy) -> bool {
        match (self, &policy.scope) {
            // An unscoped table fences every local socket, and nothing forwarded.
            (Prober::Local { .. }, None) => true,
            (Prober::Forwarded { .. }, None) => false,
            (
                Prober::Local {
                    uid, gid, cgroup, ..
                },
                Some(scope),
            ) => {
                scope.uids().contains(uid)
                    || scope.gids().contains(gid)
                    || cgroup.as_deref().is_some_and(|own| {
                        scope.cgroups.iter().any(|listed| {
                            let listed = listed.as_str();
                            own == listed
                                || own
                                    .strip_prefix(listed)
                                    .is_some_and(|rest| rest.starts_with('/'))
                        })
                    })
            }
            (Prober::Forwarded { iface, .. }, Some(scope)) => {
                scope.forward.iter().any(|p| p.matches(iface))
            }
        }
    }
}

impl fmt::Display for Prober {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Prober::Local {
                uid,
                name: Some(name),
                ..
            } => write!(f, "{name} (uid {uid})"),
            Prober::Local { uid, .. } => write!(f, "uid {uid}"),
            Prober::Forwarded { iface, addr } => write!(f, "{addr} behind {iface}"),
        }
    }
}

/// The cgroup v2 path of /proc/self/cgroup (its `0::/path` line), without the leading `/`;
/// `Some("")` for the root.
fn own_cgroup(text: &str) -> Option<String> {
    text.lines()
        .find_map(|line| line.strip_prefix("0::"))
        .map(|path| path.trim().trim_matches('/').to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::testing::policy;

    fn local(uid: u32, gid: u32, cgroup: &str) -> Prober {
        Prober::Local {
            uid,
            gid,
            name: None,
            cgroup: Some(cgroup.into()),
        }
    }

    const SCOPED: &str = "version: 1\nscope:\n  users: [1001]\n  groups: [2000]\n  cgroups: [agent.slice]\n  forward: [\"br-*\"]\n";

    #[test]
    fn without_a_scope_every_local_process_is_fenced_and_nothing_forwarded() {
        let p = policy("version: 1\n");
        assert!(local(0, 0, "").fenced(&p));
        assert_eq!(local(1234, 1234, "x").outside_scope(&p), None);
        let container = Prober::Forwarded {
            iface: "docker0".into(),
            addr: "172.17.0.2".into(),
        };
        assert!(!container.fenced(&p));
    }

    #[test]
    fn a_scope_fences_its_uids_gids_cgroup_subtrees_and_interfaces() {
        let p = policy(SCOPED);
        assert!(local(1001, 100, "").fenced(&p));
        assert!(local(1002, 2000, "").fenced(&p));
        assert!(local(0, 0, "agent.slice").fenced(&p));
        assert!(local(0, 0, "agent.slice/run-1.scope").fenced(&p));
        assert!(
            !local(0, 0, "agent.slicex").fenced(&p),
            "a sibling by prefix"
        );
        assert!(!local(0, 0, "system.slice").fenced(&p));
        let bridge = |iface: &str| Prober::Forwarded {
            iface: iface.into(),
            addr: "198.18.0.2".into(),
        };
        assert!(bridge("br-1234").fenced(&p));
        assert!(!bridge("docker0").fenced(&p));
    }

    #[test]
    fn outside_the_scope_the_report_says_so() {
        let p = policy(SCOPED);
        let nobody = Prober::Local {
            uid: 65534,
            gid: 65534,
            name: Some("nobody".into()),
            cgroup: None,
        };
        assert_eq!(
            nobody.outside_scope(&p).as_deref(),
            Some("nobody (uid 65534) is not in the scope: expect everything to pass")
        );
        let guarded = policy(&format!(
            "{SCOPED}dns:\n  mode: guard\n  upstream: [192.0.2.53]\n"
        ));
        let line = nobody.outside_scope(&guarded).expect("outside");
        assert!(
            line.contains("except DNS straight to the upstream"),
            "{line}"
        );
    }

    #[test]
    fn the_cgroup_v2_line_gives_the_own_cgroup() {
        let text = "12:cpu,cpuacct:/x\n0::/agent.slice/run-1.scope\n";
        assert_eq!(own_cgroup(text).as_deref(), Some("agent.slice/run-1.scope"));
        assert_eq!(own_cgroup("0::/\n").as_deref(), Some(""));
        assert_eq!(own_cgroup("1:name=systemd:/\n"), None);
    }
}
