//! Socket families whose packets leave from sockets the kernel makes for the caller: SMC's
//! TCP connection (`AF_SMC`, and `IPPROTO_SMC` over `AF_INET`), RDS over TCP, RxRPC's UDP
//! endpoint and TIPC's UDP bearer. Such a socket has no file, so `meta skuid`/`skgid` match
//! nothing on its packets, and one made on a workqueue is in the root cgroup: a scope of
//! users, groups or cgroups does not see what a fenced process sends through it. With no
//! scope every IP packet is judged by its destination, so they are no way out then, but for
//! TIPC's Ethernet and InfiniBand bearers and RDS over InfiniBand or RoCE, which send past
//! the IP stack (a WARN: whether such a bearer or device is set up is not looked at).

use nix::errno::Errno;

use super::report::{Check, Outcome};

/// The check's name in the report.
pub const KERNEL_SOCKETS_CHECK: &str = "socket families that send from the kernel's sockets";

/// One family the probe tries to open a socket of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Family {
    /// As the report and the modprobe remedy name it.
    pub name: &'static str,
    /// Its kernel module, for the remedy.
    pub module: &'static str,
    /// How its traffic may leave past the IP stack, as frames no rule of an `inet` table
    /// sees (so not even a fence of the whole host judges it), if it may.
    past_ip: Option<&'static str>,
    domain: libc::c_int,
    ty: libc::c_int,
    protocol: libc::c_int,
}

/// linux/socket.h and linux/in.h values the libc crate does not define for every target.
const AF_RDS: libc::c_int = 21;
const AF_TIPC: libc::c_int = 30;
const AF_RXRPC: libc::c_int = 33;
const AF_SMC: libc::c_int = 43;
const IPPROTO_SMC: libc::c_int = 256;

pub(super) const FAMILIES: [Family; 5] = [
    Family {
        name: "AF_SMC",
        module: "smc",
        domain: AF_SMC,
        ty: libc::SOCK_STREAM,
        protocol: 0,
        past_ip: None,
    },
    Family {
        name: "IPPROTO_SMC",
        module: "smc",
        domain: libc::AF_INET,
        ty: libc::SOCK_STREAM,
        protocol: IPPROTO_SMC,
        past_ip: None,
    },
    Family {
        name: "AF_RDS",
        module: "rds",
        domain: AF_RDS,
        ty: libc::SOCK_SEQPACKET,
        protocol: 0,
        past_ip: Some("over InfiniBand or RoCE (rds_rdma) through the RDMA device"),
    },
    Family {
        name: "AF_RXRPC",
        module: "rxrpc",
        domain: AF_RXRPC,
        ty: libc::SOCK_DGRAM,
        protocol: libc::AF_INET,
        past_ip: None,
    },
    Family {
        name: "AF_TIPC",
        module: "tipc",
        domain: AF_TIPC,
        ty: libc::SOCK_RDM,
        protocol: 0,
        past_ip: Some("over an Ethernet or InfiniBand bearer as frames of its own type"),
    },
];

/// Opens (and closes) a socket of each family as this process, which loads its module where
/// the kernel loads modules on demand, as it would for the fenced process.
pub(super) fn try_families() -> Vec<(Family, Result<(), Errno>)> {
    FAMILIES
        .iter()
        .map(|&family| {
            let opened = socket2::Socket::new(
                socket2::Domain::from(family.domain),
                socket2::Type::from(family.ty),
                Some(socket2::Protocol::from(family.protocol)),
            );
            let opened = opened
                .map(drop)
                .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)));
            (family, opened)
        })
        .collect()
}

/// Whether the scope judges sockets by their owner or cgroup, which these families' packets
/// do not carry (`fenced_by_socket`), and what opening each gave.
pub(super) fn kernel_sockets_check(
    opened: &[(Family, Result<(), Errno>)],
    fenced_by_socket: bool,
) -> Check {
    let open: Vec<&Family> = opened
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(f, _)| f)
        .collect();
    let unclear: Vec<String> = opened
        .iter()
        .filter_map(|(f, r)| match r {
            Ok(())
            | Err(
                Errno::EAFNOSUPPORT
                | Errno::EPROTONOSUPPORT
                | Errno::ESOCKTNOSUPPORT
                | Errno::EPROTOTYPE
                | Errno::EPERM
                | Errno::EACCES,
            ) => None,
            Err(e) => Some(format!("{}: {e}", f.name)),
        })
        .collect();
    let names = |families: &[&Family]| {
        families
            .iter()
            .map(|f| f.name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if open.is_empty() {
        let all: Vec<&Family> = opened.iter().map(|(f, _)| f).collect();
        return match unclear.is_empty() {
            true => Check::new(
                Outcome::Pass,
                KERNEL_SOCKETS_CHECK,
                format!(
                    "none of {} opens here (not in this kernel, or refused)",
                    names(&all)
                ),
            ),
            false => Check::new(
                Outcome::Warn,
                KERNEL_SOCKETS_CHECK,
                format!("could not tell: {}", unclear.join("; ")),
            ),
        };
    }
    let past_ip: Vec<String> = open
        .iter()
        .filter_map(|f| f.past_ip.map(|how| format!("{} {how}", f.name)))
        .collect();
    if !fenced_by_socket && !past_ip.is_empty() {
        return Check::new(
            Outcome::Warn,
            KERNEL_SOCKETS_CHECK,
            format!(
                "{} open here; the table judges IP packets only, and {} leaves the host past \
                 the IP stack where such a device or bearer is set up, fenced by nothing; keep \
                 their modules from loading (`install MOD /bin/false` in /etc/modprobe.d)",
                names(&open),
                past_ip.join("; ")
            ),
        );
    }
    if !fenced_by_socket {
        return Check::new(
            Outcome::Pass,
            KERNEL_SOCKETS_CHECK,
            format!(
                "{} open here; their packets carry no owner, but without a scope of users, \
                 groups or cgroups the table judges every packet by its destination",
                names(&open)
            ),
        );
    }
    let mut modules: Vec<&str> = open.iter().map(|f| f.module).collect();
    modules.dedup();
    let remedy = modules
        .iter()
        .map(|m| format!("`install {m} /bin/false`"))
        .collect::<Vec<_>>()
        .join(", ");
    Check::new(
        Outcome::Fail,
        KERNEL_SOCKETS_CHECK,
        format!(
            "this process may open {}: their packets leave from a socket the kernel makes, \
             with no owner (and, made on a workqueue, in the root cgroup), which no rule of a \
             scope of users, groups or cgroups matches, so what it sends through them is not \
             fenced; keep the modules from loading ({remedy} in /etc/modprobe.d, then unload \
             them), or fence the whole host",
            names(&open)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tried(open: &[&str], error: Errno) -> Vec<(Family, Result<(), Errno>)> {
        FAMILIES
            .iter()
            .map(|&f| {
                let r = if open.contains(&f.name) {
                    Ok(())
                } else {
                    Err(error)
                };
                (f, r)
            })
            .collect()
    }

    #[test]
    fn a_family_that_opens_fails_a_scope_and_passes_the_whole_host() {
        let opened = tried(&["AF_SMC", "IPPROTO_SMC"], Errno::EAFNOSUPPORT);
        let scoped = kernel_sockets_check(&opened, true);
        assert_eq!(scoped.outcome, Outcome::Fail, "{}", scoped.reason);
        assert!(
            scoped.reason.contains("AF_SMC, IPPROTO_SMC")
                && scoped.reason.contains("`install smc /bin/false`")
                && !scoped.reason.contains("rds"),
            "{}",
            scoped.reason
        );
        let whole_host = kernel_sockets_check(&opened, false);
        assert_eq!(whole_host.outcome, Outcome::Pass, "{}", whole_host.reason);
    }

    /// The table judges IP packets only: TIPC over an Ethernet or InfiniBand bearer and RDS
    /// over InfiniBand or RoCE leave the host as frames that never meet it, so that one of
    /// them opens is no pass for the whole host either.
    #[test]
    fn a_family_with_a_path_past_ip_is_no_pass_for_the_whole_host() {
        for name in ["AF_TIPC", "AF_RDS"] {
            let check = kernel_sockets_check(&tried(&[name], Errno::EAFNOSUPPORT), false);
            assert_eq!(check.outcome, Outcome::Warn, "{name}: {}", check.reason);
            assert!(check.reason.contains(name), "{}", check.reason);
        }
        let rxrpc = kernel_sockets_check(&tried(&["AF_RXRPC"], Errno::EAFNOSUPPORT), false);
        assert_eq!(rxrpc.outcome, Outcome::Pass, "{}", rxrpc.reason);
    }

    #[test]
    fn none_open_passes_and_an_odd_error_is_said() {
        let none = kernel_sockets_check(&tried(&[], Errno::EAFNOSUPPORT), true);
        assert_eq!(none.outcome, Outcome::Pass, "{}", none.reason);
        let odd = kernel_sockets_check(&tried(&[], Errno::EMFILE), true);
        assert_eq!(odd.outcome, Outcome::Warn, "{}", odd.reason);
        assert!(odd.reason.contains("AF_RDS: EMFILE"), "{}", odd.reason);
    }

    /// On this kernel: each family opens, or fails with an error the check knows (absent,
    /// refused), never one it cannot judge.
    #[test]
    fn trying_the_families_here_gives_an_answer_for_each() {
        let opened = try_families();
        assert_eq!(opened.len(), FAMILIES.len());
        let check = kernel_sockets_check(&opened, true);
        assert!(!check.reason.contains("could not tell"), "{}", check.reason);
    }
}
