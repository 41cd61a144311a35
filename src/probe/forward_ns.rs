//! `probe --from IFACE=ADDRESS`: a throwaway "container" on a bridge of the current network
//! namespace ([`ForwardNs`]), made with iproute2 and removed when dropped, so that the probe's
//! attempts take the forward path as a container's would.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Command;

use ipnet::IpNet;

/// Why the throwaway namespace could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ForwardNsError {
    #[error("--from {0}: write IFACE=ADDRESS/PREFIX, such as efbr0=198.18.0.250/24")]
    Syntax(String),
    #[error("--from: {iface} has no {family} address to route through")]
    NoGateway { iface: String, family: &'static str },
    #[error("--from: cannot read this namespace's interfaces: {0}")]
    Interfaces(nix::Error),
    #[error("--from: `ip {args}` failed: {error}")]
    Ip { args: String, error: String },
}

/// `IFACE=ADDRESS/PREFIX` as `--from` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FromBridge {
    pub iface: String,
    pub addr: IpNet,
}

impl std::str::FromStr for FromBridge {
    type Err = ForwardNsError;

    fn from_str(s: &str) -> Result<FromBridge, ForwardNsError> {
        let bad = || ForwardNsError::Syntax(s.to_string());
        let (iface, addr) = s.split_once('=').ok_or_else(bad)?;
        let fine = |c: char| c.is_ascii_alphanumeric() || "._-@".contains(c);
        if iface.is_empty() || iface.len() > 15 || !iface.chars().all(fine) {
            return Err(bad());
        }
        let addr = match addr.parse::<IpNet>() {
            Ok(net) => net,
            Err(_) => IpNet::from(addr.parse::<IpAddr>().map_err(|_| bad())?),
        };
        Ok(FromBridge {
            iface: iface.to_string(),
            addr,
        })
    }
}

/// The throwaway namespace: removed (with its veth pair) on drop.
#[derive(Debug)]
pub struct ForwardNs {
    name: String,
    veth: String,
    /// The bridge's addresses, where a guard listens for its containers.
    pub bridge_addrs: Vec<IpAddr>,
}

impl ForwardNs {
    /// Makes the namespace for `from`, attached to the bridge in the calling thread's
    /// network namespace.
    pub fn create(from: &FromBridge) -> Result<ForwardNs, ForwardNsError> {
        let bridge_addrs = interface_addrs(&from.iface)?;
        let gateway = bridge_addrs
            .iter()
            .copied()
            .find(|a| a.is_ipv4() == from.addr.addr().is_ipv4())
            .ok_or_else(|| ForwardNsError::NoGateway {
                iface: from.iface.clone(),
                family: if from.addr.addr().is_ipv4() {
                    "IPv4"
                } else {
                    "IPv6"
                },
            })?;
        let pid = std::process::id();
        let ns = ForwardNs {
            name: format!("ef-probe-{pid}"),
            veth: format!("efp{pid:x}"),
            bridge_addrs,
        };
        // A first `ip netns add` on the host mounts /run/netns, and two at once can race:
        // another try then finds it mounted.
        let mut added = ip(&["netns", "add", &ns.name]);
        for _ in 0..3 {
            if added.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
            let _ = ip(&["netns", "del", &ns.name]);
            added = ip(&["netns", "add", &ns.name]);
        }
        added?;
        // From here on, dropping `ns` removes whatever was made.
        let n = ns.name.as_str();
        let peer = [
            "link", "add", &ns.veth, "type", "veth", "peer", "name", "eth0",
        ];
        ip(&[&peer[..], &["netns", n]].concat())?;
        ip(&["link", "set", &ns.veth, "master", &from.iface])?;
        ip(&["link", "set", &ns.veth, "up"])?;
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        let addr = from.addr.to_string();
        let mut add = vec!["-n", n, "addr", "add", &addr, "dev", "eth0"];
        if from.addr.addr().is_ipv6() {
            add.push("nodad");
        }
        ip(&add)?;
        ip(&["-n", n, "link", "set", "eth0", "up"])?;
        let via = gateway.to_string();
        let family = if gateway.is_ipv4() { "-4" } else { "-6" };
        let route = [
            "route", "add", "default", "via", &via, "dev", "eth0", "onlink",
        ];
        ip(&[&[family, "-n", n][..], &route[..]].concat())?;
        Ok(ns)
    }

    /// The namespace's file, for `setns`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }
}

impl Drop for ForwardNs {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it ours; ours is
        // deleted by name too in case the namespace never got it.
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            tracing::warn!(error = %e, "removing the probe's namespace");
        }
        let _gone_already = ip(&["link", "del", &self.veth]);
    }
}

fn ip(args: &[&str]) -> Result<(), ForwardNsError> {
    let failed = |error: String| ForwardNsError::Ip {
        args: args.join(" "),
        error,
    };
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| failed(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(failed(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

/// The addresses of interface `iface` (link-local IPv6 ones left out), IPv4 first.
pub fn interface_addrs(iface: &str) -> Result<Vec<IpAddr>, ForwardNsError> {
    let mut found = Vec::new();
    for i in nix::ifaddrs::getifaddrs().map_err(ForwardNsError::Interfaces)? {
        if i.interface_name != iface {
            continue;
        }
        let Some(addr) = i.address else { continue };
        if let Some(v4) = addr.as_sockaddr_in() {
            found.push(IpAddr::V4(v4.ip()));
        } else if let Some(v6) = addr.as_sockaddr_in6()
            && v6.ip().segments()[0] & 0xffc0 != 0xfe80
        {
            found.push(IpAddr::V6(v6.ip()));
        }
    }
    found.sort_by_key(|a| a.is_ipv6());
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_takes_an_interface_and_an_address() {
        let f: FromBridge = "efbr0=198.18.0.250/24".parse().expect("valid");
        assert_eq!(f.iface, "efbr0");
        assert_eq!(f.addr.to_string(), "198.18.0.250/24");
        let bare: FromBridge = "br-1=2001:db8::2".parse().expect("valid");
        assert_eq!(bare.addr.prefix_len(), 128);
        for bad in ["efbr0", "=198.18.0.2", "efbr0=nowhere", "a b=198.18.0.2"] {
            assert!(bad.parse::<FromBridge>().is_err(), "{bad}");
        }
    }
}
