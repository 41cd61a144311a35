//! Connecting the run's namespace to the host's network with pasta (Debian's `passt`): a
//! user-mode network stack that reads the namespace's packets from a tap device and opens
//! ordinary sockets on the host for them, as rootless Podman does. Nothing of the host
//! changes: no interface, route, table or sysctl; the namespace gets a copy of the host's
//! address and default route.
//!
//! Everything that would reach past the fence is turned off: no port of the host is
//! forwarded into the namespace (`-t none -u none`), no port of the namespace's loopback is
//! forwarded to the host's (`-T none -U none`: with `auto` a process inside would reach the
//! host's loopback services through its own 127.0.0.1), and the gateway address is not
//! mapped to the host (`--no-map-gw`). Pasta runs as root (`--runas 0`): dropped to nobody it
//! can no longer enter the namespace it was given.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::ExecError;

/// The pasta binary (package `passt`).
const PASTA: &str = "pasta";
/// How long pasta may take to configure the namespace.
const READY_TIMEOUT: Duration = Duration::from_secs(5);

/// Starts pasta for the namespace named at `netns_path`; the calling thread must be in the
/// host's namespace. Pasta stays in the foreground, as a child of this process.
pub fn start_pasta(
    netns_path: &Path,
    pid_file: &Path,
    capture: Option<&Path>,
) -> Result<Child, ExecError> {
    let mut pasta = Command::new(PASTA);
    if let Some(path) = capture {
        // Every frame of the tap device (the canary looks for its token in what left).
        pasta.arg("--pcap").arg(path);
    }
    pasta
        .args(["--runas", "0", "--config-net", "--foreground", "--quiet"])
        // The namespace's name is removed once pasta holds it: pasta must outlive that.
        .arg("--no-netns-quit")
        .args([
            "-t",
            "none",
            "-u",
            "none",
            "-T",
            "none",
            "-U",
            "none",
            "--no-map-gw",
        ])
        .arg("--netns")
        .arg(netns_path)
        // Written as pasta enters its loop: only then does it read the namespace's packets.
        .arg("--pid")
        .arg(pid_file)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        // pasta also complains on stderr when it finds no syslog: only its failures matter,
        // and those show in the namespace never getting a route.
        .stderr(Stdio::null())
        .env_clear()
        .spawn()
        .map_err(|source| ExecError::Pasta {
            reason: format!("cannot start {PASTA} (install Debian's `passt` package): {source}"),
        })
}

/// Waits until pasta serves the namespace: it wrote its pid file, and the calling thread's
/// namespace has an IPv4 default route (pasta copies the host's); or pasta ends.
pub fn wait_until_connected(pasta: &mut Child, pid_file: &Path) -> Result<(), ExecError> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let serving = fs::metadata(pid_file).map(|m| m.len() > 0).unwrap_or(false);
        if serving && has_default_route() {
            return Ok(());
        }
        if let Ok(Some(status)) = pasta.try_wait() {
            return Err(ExecError::Pasta {
                reason: format!(
                    "pasta ended ({status}) before the namespace was connected; does the \
                     host have a default route?"
                ),
            });
        }
        if Instant::now() >= deadline {
            return Err(ExecError::Pasta {
                reason: format!("the namespace got no default route within {READY_TIMEOUT:?}"),
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn has_default_route() -> bool {
    fs::read_to_string("/proc/thread-self/net/route")
        .map(|routes| default_route_in(&routes))
        .unwrap_or(false)
}

/// Whether /proc/net/route's text holds a default route (destination and mask 0).
fn default_route_in(routes: &str) -> bool {
    routes.lines().skip(1).any(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields.get(1) == Some(&"00000000") && fields.get(7) == Some(&"00000000")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_route_is_found_in_proc_net_route() {
        let header =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n";
        let default = "eth0\t00000000\t010012AC\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        let link = "eth0\t000012AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n";
        assert!(default_route_in(&format!("{header}{link}{default}")));
        assert!(!default_route_in(&format!("{header}{link}")));
        assert!(!default_route_in(header));
    }
}
