//! tun and tap devices: whether this process may attach one, and so write packets that the
//! host takes as received from outside, which the output hook never judges as sent.

use nix::errno::Errno;

use super::report::{Check, Outcome};

/// The check's name in the report.
pub const TUN_CHECK: &str = "tun/tap devices (packets written as received)";

/// linux/if_tun.h.
const IFF_TUN: u32 = 0x0001;
const IFF_TAP: u32 = 0x0002;
const IFF_MULTI_QUEUE: u32 = 0x0100;
const IFF_NO_PI: u32 = 0x1000;

/// The flags that attach to a device whose `tun_flags` (sysfs) are `tun_flags`: its type and
/// whether it is multi-queue must match, or the driver refuses with EINVAL before it asks
/// whose the device is.
pub(super) fn attach_flags(tun_flags: u32) -> i16 {
    (tun_flags & (IFF_TUN | IFF_TAP | IFF_MULTI_QUEUE | IFF_NO_PI)) as i16
}

/// The tun and tap devices of this network namespace (those with `tun_flags` in sysfs) and
/// their flags.
fn tun_devices() -> Vec<(String, u32)> {
    let Ok(entries) = std::fs::read_dir("/sys/class/net") else {
        return Vec::new();
    };
    let mut devices: Vec<(String, u32)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_string();
            let text = std::fs::read_to_string(e.path().join("tun_flags")).ok()?;
            let flags = u32::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()?;
            Some((name, flags))
        })
        .collect();
    devices.sort();
    devices
}

/// Each device's name and the outcome of attaching to it; `Err` when `/dev/net/tun` itself
/// does not open.
pub(super) type TunAccess = Result<Vec<(String, Result<(), Errno>)>, Errno>;

/// What this process may do with the namespace's tun and tap devices: `Err` when it cannot
/// open `/dev/net/tun` at all, else each device with the outcome of attaching a fresh
/// descriptor to it (closed at once, which detaches it).
pub(super) fn tun_access() -> TunAccess {
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))
    };
    let devices = tun_devices();
    if devices.is_empty() {
        return Ok(Vec::new());
    }
    drop(open()?);
    Ok(devices
        .into_iter()
        .map(|(name, flags)| {
            let attached = open().and_then(|file| {
                use std::os::fd::AsFd;
                crate::nft::sys::tun_set_iff(file.as_fd(), &name, attach_flags(flags))
            });
            (name, attached)
        })
        .collect())
}

/// A process that may attach a tun or tap device writes packets that the host takes as
/// received on it: from an outside address X to its own socket, which then answers X as
/// `established` (the fence lets out the replies to connections made to the host), or, on a
/// host that forwards, to any address, routed out past the output hook. The table cannot
/// tell them from real traffic, so the device must not be the fenced process's: the kernel
/// lets any user attach a persistent device made with no user and no group. EBUSY counts:
/// the device is the process's to attach once its holder lets go.
pub(super) fn tun_check(access: &TunAccess, net_admin: Option<bool>) -> Check {
    let remedy = "give every persistent tun/tap device a user or group the fenced processes are \
                  not (ip tuntap add ... user U group G), delete the ones nothing uses, or keep \
                  /dev/net/tun from them (a container without the device; systemd \
                  PrivateDevices=yes)";
    let access = match access {
        Err(e) => {
            return Check::new(
                Outcome::Pass,
                TUN_CHECK,
                format!("cannot open /dev/net/tun ({e}): no tun/tap device is this process's"),
            );
        }
        Ok(access) => access,
    };
    let open: Vec<String> = access
        .iter()
        .filter_map(|(name, r)| match r {
            Ok(()) => Some(name.clone()),
            Err(Errno::EBUSY) => Some(format!("{name} (held now: EBUSY)")),
            Err(_) => None,
        })
        .collect();
    let unclear: Vec<String> = access
        .iter()
        .filter_map(|(name, r)| match r {
            Ok(()) | Err(Errno::EBUSY | Errno::EPERM | Errno::EACCES | Errno::ENODEV) => None,
            Err(e) => Some(format!("{name}: {e}")),
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
            .filter_map(|(name, r)| r.err().map(|e| format!("{name}: {e}")))
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
    fn attach_flags_keep_the_type_and_queues_of_the_device() {
        // tun, persistent, no packet information: as `ip tuntap add mode tun` makes it.
        assert_eq!(attach_flags(0x1801), 0x1001);
        assert_eq!(attach_flags(0x1901), 0x1101);
        assert_eq!(attach_flags(0x5802), 0x1002);
    }

    #[test]
    fn a_device_this_process_may_attach_fails_the_probe_only_without_cap_net_admin() {
        let one = |r| Ok(vec![("tun0".to_string(), r)]);
        let fail = tun_check(&one(Ok(())), Some(false));
        assert_eq!(fail.outcome, Outcome::Fail, "{fail}");
        assert_eq!(fail.check, TUN_CHECK);
        assert!(fail.reason.starts_with("may attach tun0:"), "{fail}");
        assert!(fail.reason.contains("user U group G"), "{fail}");
        // Held by another descriptor: the permission check passed before the attach.
        let busy = tun_check(&one(Err(Errno::EBUSY)), None);
        assert_eq!(busy.outcome, Outcome::Fail, "{busy}");
        assert!(busy.reason.contains("tun0 (held now: EBUSY)"), "{busy}");
        let admin = tun_check(&one(Ok(())), Some(true));
        assert_eq!(admin.outcome, Outcome::Skip, "{admin}");

        let theirs = tun_check(&one(Err(Errno::EPERM)), Some(false));
        assert_eq!(theirs.outcome, Outcome::Pass, "{theirs}");
        assert!(theirs.reason.contains("tun0: EPERM"), "{theirs}");
        let closed = tun_check(&Err(Errno::EACCES), Some(false));
        assert_eq!(closed.outcome, Outcome::Pass, "{closed}");
        assert!(closed.reason.contains("/dev/net/tun"), "{closed}");
        assert_eq!(tun_check(&Ok(Vec::new()), None).outcome, Outcome::Pass);
        let odd = tun_check(&one(Err(Errno::EMFILE)), Some(false));
        assert_eq!(odd.outcome, Outcome::Warn, "{odd}");
    }
}
