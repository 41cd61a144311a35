//! tun and tap devices: whether this process may attach one, and so write packets that the
//! host takes as received from outside, which the output hook never judges as sent.

use nix::errno::Errno;

use super::report::{Check, Outcome};

/// The check's name in the report.
pub const TUN_CHECK: &str = "tun/tap devices (packets written as received)";

/// linux/if_tun.h.
const IFF_TUN: i16 = 0x0001;
const IFF_TAP: i16 = 0x0002;
const IFF_MULTI_QUEUE: i16 = 0x0100;
const IFF_NO_PI: i16 = 0x1000;

/// The flags tried, in turn, to attach to a device: its type and whether it is multi-queue
/// must match, or the driver refuses with EINVAL before it asks whose the device is.
const ATTACH_FLAGS: [i16; 4] = [
    IFF_TUN | IFF_NO_PI,
    IFF_TAP | IFF_NO_PI,
    IFF_TUN | IFF_MULTI_QUEUE | IFF_NO_PI,
    IFF_TAP | IFF_MULTI_QUEUE | IFF_NO_PI,
];

/// What this process may do with the namespace's tun and tap devices.
#[derive(Debug)]
pub(super) enum TunAccess {
    /// The interfaces could not be listed.
    Unlisted(String),
    /// `/dev/net/tun` does not open (there is a device to attach, but not for this process).
    Closed(Errno),
    /// Each device (link type `tun`: tun and tap alike) with the outcome of attaching a fresh
    /// descriptor to it.
    Tried(Vec<Device>),
    /// The devices, not attached: this process holds CAP_NET_ADMIN and may attach every one,
    /// which would tell nothing, and attaching an idle device rewrites its flags (a VM's tap
    /// loses `vnet_hdr` until its owner attaches it again) and blinks its carrier.
    Listed(Vec<String>),
}

/// One tun or tap device and what attaching it gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Device {
    pub name: String,
    /// Whether the device outlives its last descriptor (IFLA_TUN_PERSIST): one held now
    /// (EBUSY) is then the next attacher's once its holder lets go.
    pub persist: bool,
    pub attached: Result<(), Errno>,
}

fn open_tun() -> Result<std::fs::File, Errno> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))
}

/// Attaches a fresh descriptor to the device `name` (closed at once, which detaches it).
fn attach(name: &str) -> Result<(), Errno> {
    use std::os::fd::AsFd;
    let file = open_tun()?;
    for flags in ATTACH_FLAGS {
        match crate::nft::sys::tun_set_iff(file.as_fd(), name, flags) {
            Err(Errno::EINVAL) => continue,
            other => return other,
        }
    }
    Err(Errno::EINVAL)
}

/// Tries every tun and tap device of the calling thread's network namespace (listed over
/// rtnetlink: sysfs shows the namespace it was mounted in); only lists them when `net_admin`
/// (this process holds CAP_NET_ADMIN).
pub(super) fn tun_access(net_admin: bool) -> TunAccess {
    let links = match crate::netlink::link::links() {
        Ok(links) => links,
        Err(e) => return TunAccess::Unlisted(e.to_string()),
    };
    let mut devices: Vec<(String, bool)> = links
        .into_iter()
        .filter(|l| l.kind.as_deref() == Some("tun"))
        .map(|l| (l.name, l.tun.is_some_and(|t| t.persist)))
        .collect();
    devices.sort();
    if devices.is_empty() {
        return TunAccess::Tried(Vec::new());
    }
    if net_admin {
        return TunAccess::Listed(devices.into_iter().map(|(name, _)| name).collect());
    }
    if let Err(e) = open_tun() {
        return TunAccess::Closed(e);
    }
    TunAccess::Tried(
        devices
            .into_iter()
            .map(|(name, persist)| {
                let attached = attach(&name);
                Device {
                    name,
                    persist,
                    attached,
                }
            })
            .collect(),
    )
}

/// A process that may attach a tun or tap device writes packets that the host takes as
/// received on it: from an outside address X to its own socket, which then answers X as
/// `established` (the fence lets out the replies to connections made to the host), or, on a
/// host that forwards, to any address, routed out past the output hook. The table cannot
/// tell them from real traffic, so the device must not be the fenced process's: the kernel
/// lets any user attach a persistent device made with no user and no group. EBUSY (another
/// descriptor holds a single-queue device; the driver asked whose it is first) fails too when
/// the device persists: it is the process's to attach once its holder lets go, and the
/// holder may be the fenced process itself, which hides nothing by holding it through the
/// probe. A held device that does not persist (a VPN's, which goes with its holder) is a
/// warning: any process that attached a device may clear its persistence without privilege
/// (`TUNSETPERSIST`), so the probe cannot tell such a holder from a VPN.
pub(super) fn tun_check(access: &TunAccess, net_admin: Option<bool>) -> Check {
    let remedy = "give every persistent tun/tap device a user or group the fenced processes are \
                  not (ip tuntap add ... user U group G), delete the ones nothing uses, or keep \
                  /dev/net/tun from them (a container without the device; systemd \
                  PrivateDevices=yes)";
    let access = match access {
        TunAccess::Unlisted(e) => {
            return Check::new(Outcome::Warn, TUN_CHECK, format!("could not tell: {e}"));
        }
        TunAccess::Closed(e) => {
            return Check::new(
                Outcome::Pass,
                TUN_CHECK,
                format!("cannot open /dev/net/tun ({e}): no tun/tap device is this process's"),
            );
        }
        TunAccess::Listed(names) => {
            return Check::new(
                Outcome::Skip,
                TUN_CHECK,
                format!(
                    "this probe holds CAP_NET_ADMIN, so it is not what the fence confines (it \
                     may attach every device, and does not try: attaching rewrites an idle \
                     device's flags); run it as the fenced user (root in a container: setpriv \
                     --bounding-set=-net_admin) to check {}",
                    names.join(", ")
                ),
            );
        }
        TunAccess::Tried(access) => access,
    };
    // Attached, or held now and the next attacher's once its holder lets go.
    let open: Vec<String> = access
        .iter()
        .filter_map(|d| match d.attached {
            Ok(()) => Some(d.name.clone()),
            Err(Errno::EBUSY) if d.persist => Some(format!(
                "{} (held by another descriptor now, and persistent: this process's once \
                 its holder lets go)",
                d.name
            )),
            Err(_) => None,
        })
        .collect();
    let held: Vec<&str> = access
        .iter()
        .filter(|d| d.attached == Err(Errno::EBUSY) && !d.persist)
        .map(|d| d.name.as_str())
        .collect();
    let unclear: Vec<String> = access
        .iter()
        .filter_map(|d| match d.attached {
            Ok(()) | Err(Errno::EBUSY | Errno::EPERM | Errno::EACCES | Errno::ENODEV) => None,
            Err(e) => Some(format!("{}: {e}", d.name)),
        })
        .collect();
    let (outcome, reason) = if !open.is_empty() {
        let which = open.join(", ");
        if net_admin == Some(true) {
            (
                Outcome::Skip,
                format!(
                    "this probe holds CAP_NET_ADMIN, so it is not what the fence confines (it \
                     may attach every device); run it as the fenced user (root in a \
                     container: setpriv --bounding-set=-net_admin) to check {which}"
                ),
            )
        } else {
            (
                Outcome::Fail,
                format!(
                    "may attach {which}: a packet written there arrives as if from outside, \
                     so this process forges a flow from any address and its answer leaves as \
                     established, and a forwarding host routes what it writes to any \
                     address, past the fence; {remedy}"
                ),
            )
        }
    } else if !held.is_empty() && net_admin != Some(true) {
        (
            Outcome::Warn,
            format!(
                "{} held by another descriptor now (EBUSY) and not persistent, but this \
                 process passed the driver's check of whose it is: a device that goes with its \
                 holder (a VPN's) is no way out, but a fenced process that holds a device made \
                 persistent for anyone may have cleared its persistence itself (no privilege \
                 needed) and writes packets as received, past the fence: check that the \
                 holder is a service you know; {remedy}",
                held.join(", ")
            ),
        )
    } else if !unclear.is_empty() {
        (
            Outcome::Warn,
            format!("could not tell: {}", unclear.join(", ")),
        )
    } else if access.is_empty() {
        (Outcome::Pass, "no tun or tap device".to_string())
    } else {
        let refused: Vec<String> = access
            .iter()
            .filter_map(|d| d.attached.err().map(|e| format!("{}: {e}", d.name)))
            .collect();
        (
            Outcome::Pass,
            format!("may attach no tun or tap device ({})", refused.join(", ")),
        )
    };
    Check::new(outcome, TUN_CHECK, reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_this_process_may_attach_fails_the_probe_only_without_cap_net_admin() {
        let one = |attached| {
            TunAccess::Tried(vec![Device {
                name: "tun0".to_string(),
                persist: false,
                attached,
            }])
        };
        let fail = tun_check(&one(Ok(())), Some(false));
        assert_eq!(fail.outcome, Outcome::Fail, "{fail}");
        assert_eq!(fail.check, TUN_CHECK);
        assert!(fail.reason.starts_with("may attach tun0:"), "{fail}");
        assert!(fail.reason.contains("user U group G"), "{fail}");
        // Held by another descriptor: the permission check passed before the attach, but a
        // device that goes with its holder is no way out.
        let busy = tun_check(&one(Err(Errno::EBUSY)), None);
        assert_eq!(busy.outcome, Outcome::Warn, "{busy}");
        assert!(busy.reason.starts_with("tun0 held by another"), "{busy}");
        // One that persists is the next attacher's: its holder (the fenced process itself,
        // holding it through the probe) turns no failure into a warning.
        let persistent_busy = |net_admin| {
            tun_check(
                &TunAccess::Tried(vec![Device {
                    name: "tun0".to_string(),
                    persist: true,
                    attached: Err(Errno::EBUSY),
                }]),
                net_admin,
            )
        };
        let held = persistent_busy(Some(false));
        assert_eq!(held.outcome, Outcome::Fail, "{held}");
        assert!(
            held.reason
                .starts_with("may attach tun0 (held by another descriptor now, and persistent"),
            "{held}"
        );
        assert_eq!(persistent_busy(None).outcome, Outcome::Fail);
        assert_eq!(persistent_busy(Some(true)).outcome, Outcome::Skip);
        let admin = tun_check(&one(Ok(())), Some(true));
        assert_eq!(admin.outcome, Outcome::Skip, "{admin}");
        // Listed, not attached, with CAP_NET_ADMIN.
        let listed = tun_check(&TunAccess::Listed(vec!["tap0".into()]), Some(true));
        assert_eq!(listed.outcome, Outcome::Skip, "{listed}");
        assert!(listed.reason.ends_with("to check tap0"), "{listed}");

        let theirs = tun_check(&one(Err(Errno::EPERM)), Some(false));
        assert_eq!(theirs.outcome, Outcome::Pass, "{theirs}");
        assert!(theirs.reason.contains("tun0: EPERM"), "{theirs}");
        let closed = tun_check(&TunAccess::Closed(Errno::EACCES), Some(false));
        assert_eq!(closed.outcome, Outcome::Pass, "{closed}");
        assert!(closed.reason.contains("/dev/net/tun"), "{closed}");
        assert_eq!(
            tun_check(&TunAccess::Tried(Vec::new()), None).outcome,
            Outcome::Pass
        );
        let unlisted = TunAccess::Unlisted("interface dump: EPERM".into());
        assert_eq!(tun_check(&unlisted, None).outcome, Outcome::Warn);
        let odd = tun_check(&one(Err(Errno::EMFILE)), Some(false));
        assert_eq!(odd.outcome, Outcome::Warn, "{odd}");
    }
}
