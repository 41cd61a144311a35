//! Link-layer frames: whether this process can open a packet or XDP socket, whose frames
//! never meet the output hook.

use super::report::{Check, Outcome};

/// The check's name in the report.
pub const LINK_LAYER_CHECK: &str = "link-layer frames (packet and XDP sockets)";

/// Capability numbers (linux/capability.h).
pub(super) const CAP_NET_ADMIN: u32 = 12;

/// Whether capability `cap` is in this process's effective set (`CapEff` of
/// /proc/self/status); `None` when that cannot be read.
pub(super) fn capability_effective(cap: u32) -> Option<bool> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    let mask = u64::from_str_radix(hex.trim(), 16).ok()?;
    Some(mask & (1 << cap) != 0)
}

/// The socket families that write frames below the output hook, each tried once: opened (and
/// closed at once; protocol 0, so nothing is received) or the reason it could not be.
pub(super) fn link_layer_access() -> Vec<(&'static str, Result<(), nix::errno::Errno>)> {
    [("AF_PACKET", libc::AF_PACKET), ("AF_XDP", libc::AF_XDP)]
        .into_iter()
        .map(|(name, family)| {
            let opened = crate::nft::sys::open_socket(family, libc::SOCK_RAW).map(drop);
            (name, opened)
        })
        .collect()
}

/// A frame written to a packet socket (`AF_PACKET`) or an XDP socket (`AF_XDP`), both opened
/// with CAP_NET_RAW (root in a Docker container has it by default), goes straight to the
/// device: it never meets the output hook, so no rule of the table sees it, and it can carry
/// any packet to any address. nftables cannot refuse it at the device either (README, "What
/// the fence cannot stop"): only taking CAP_NET_RAW from the fenced processes closes it, so the
/// probe reports whether this process could open either.
pub(super) fn link_layer_check(
    access: &[(&'static str, Result<(), nix::errno::Errno>)],
    net_admin: Option<bool>,
) -> Check {
    use nix::errno::Errno;
    let remedy = "drop CAP_NET_RAW for the fenced processes (docker run --cap-drop NET_RAW; \
                  Kubernetes securityContext.capabilities.drop [NET_RAW]; systemd \
                  CapabilityBoundingSet=~CAP_NET_RAW)";
    let opened: Vec<&str> = access
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(name, _)| *name)
        .collect();
    let unclear: Vec<String> = access
        .iter()
        .filter_map(|(name, r)| match r {
            Ok(()) | Err(Errno::EPERM | Errno::EACCES | Errno::EAFNOSUPPORT) => None,
            Err(e) => Some(format!("{name}: {e}")),
        })
        .collect();
    let refused: Vec<String> = access
        .iter()
        .filter_map(|(name, r)| r.err().map(|e| format!("{name}: {e}")))
        .collect();
    let (outcome, reason) = if !opened.is_empty() {
        let which = opened.join(" and ");
        if net_admin == Some(true) {
            (
                Outcome::Skip,
                format!(
                    "this probe holds CAP_NET_ADMIN, so it is not what the fence confines (it \
                     could remove the table); it opened {which}, as any process with \
                     CAP_NET_RAW can, and frames written there never meet nftables' output \
                     hook: run the probe as the fenced user (root in a container: setpriv \
                     --bounding-set=-net_admin) to check them, and {remedy}"
                ),
            )
        } else {
            (
                Outcome::Fail,
                format!(
                    "opened {which} (this process has CAP_NET_RAW): frames written there never \
                     meet nftables' output hook, so it can send any packet to any address past \
                     the fence; {remedy}"
                ),
            )
        }
    } else if !unclear.is_empty() {
        (
            Outcome::Warn,
            format!("could not tell: {}", unclear.join(", ")),
        )
    } else {
        (
            Outcome::Pass,
            format!(
                "cannot open a packet or XDP socket ({}): every packet it sends meets the \
                 output hook",
                refused.join(", ")
            ),
        )
    };
    Check::new(outcome, LINK_LAYER_CHECK, reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_layer_socket_fails_the_probe_only_without_cap_net_admin() {
        use nix::errno::Errno;
        let denied = [
            ("AF_PACKET", Err(Errno::EPERM)),
            ("AF_XDP", Err(Errno::EPERM)),
        ];
        let packet = [("AF_PACKET", Ok(())), ("AF_XDP", Err(Errno::EPERM))];
        let xdp = [("AF_PACKET", Err(Errno::EAFNOSUPPORT)), ("AF_XDP", Ok(()))];

        let fail = link_layer_check(&packet, Some(false));
        assert_eq!(fail.outcome, Outcome::Fail, "{fail}");
        assert_eq!(fail.check, LINK_LAYER_CHECK);
        assert!(fail.reason.starts_with("opened AF_PACKET "), "{fail}");
        assert!(fail.reason.contains("--cap-drop NET_RAW"), "{fail}");
        // Either family is a way out; capabilities unreadable: opening is what counts.
        let fail = link_layer_check(&xdp, None);
        assert_eq!(fail.outcome, Outcome::Fail, "{fail}");
        assert!(fail.reason.starts_with("opened AF_XDP "), "{fail}");
        // The administrator is outside the threat model: told, not failed.
        let admin = link_layer_check(&packet, Some(true));
        assert_eq!(admin.outcome, Outcome::Skip, "{admin}");

        let pass = link_layer_check(&denied, Some(false));
        assert_eq!(pass.outcome, Outcome::Pass, "{pass}");
        assert!(pass.reason.contains("AF_PACKET: EPERM"), "{pass}");
        let absent = [
            ("AF_PACKET", Err(Errno::EAFNOSUPPORT)),
            ("AF_XDP", Err(Errno::EAFNOSUPPORT)),
        ];
        assert_eq!(link_layer_check(&absent, None).outcome, Outcome::Pass);
        let odd = [
            ("AF_PACKET", Err(Errno::EMFILE)),
            ("AF_XDP", Err(Errno::EPERM)),
        ];
        assert_eq!(link_layer_check(&odd, Some(false)).outcome, Outcome::Warn);
    }
}
