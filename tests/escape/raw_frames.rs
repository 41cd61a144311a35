//! Link-layer frames: root in a container keeps CAP_NET_RAW (Docker's default), opens an
//! `AF_PACKET` or `AF_XDP` socket and writes whole Ethernet frames, which go straight to the
//! device and never meet the output hook. nftables cannot refuse them (README, "What the fence
//! cannot stop"), so the tool cannot close this way out; `probe`, run as the fenced user, must
//! say that it is open (it said nothing before) and that dropping CAP_NET_RAW closes it.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::common::*;

/// Allows TCP 7000 to one host; the gateway's UDP port below is not allowed.
const POLICY: &str = r#"
version: 1
action: reject
allow:
  - cidr: 192.0.2.10/32          # HOST_V4
    ports: [7000]
    protocol: tcp
deny:
  - preset: cloud-metadata
dns:
  resolvers: [192.0.2.53]
"#;

/// A UDP port on the net side of the veth that the policy does not allow.
const REFUSED_PORT: u16 = 9999;

/// Writes one Ethernet frame carrying a UDP datagram from the sandbox to the net side of the
/// veth, below the IP stack: `python3 -c SEND_FRAME HOW IFNAME DST_MAC SRC DST DPORT`, HOW
/// being `packet` (an `AF_PACKET` socket), `bypass` (the same with PACKET_QDISC_BYPASS) or
/// `xdp` (an `AF_XDP` socket in copy mode, no XDP program). Prints `sent` or `refused ERRNO`
/// (the socket could not be opened). Run after [`REFUSE_CAP_NET_ADMIN_PY`].
const SEND_FRAME: &str = concat!(
    crate::inet_checksum_py!(),
    r#"
import ctypes, mmap, socket, struct, sys
how, ifname, dmac, src, dst, dport = sys.argv[1:7]
payload = ('frame past the fence (%s)' % how).encode()
udp = struct.pack('!HHHH', 40000, int(dport), 8 + len(payload), 0) + payload
ip = struct.pack('!BBHHHBBH4s4s', 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                 socket.inet_aton(src), socket.inet_aton(dst))
ip = ip[:10] + struct.pack('!H', checksum(ip)) + ip[12:]
smac = bytes.fromhex(open('/sys/class/net/%s/address' % ifname).read().strip().replace(':', ''))
frame = bytes.fromhex(dmac.replace(':', '')) + smac + struct.pack('!H', 0x0800) + ip + udp
family = 44 if how == 'xdp' else socket.AF_PACKET  # AF_XDP
try:
    s = socket.socket(family, socket.SOCK_RAW, 0)
except PermissionError as e:
    print('refused', e.errno)
    sys.exit(0)
if how in ('packet', 'bypass'):
    if how == 'bypass':
        s.setsockopt(263, 20, 1)  # SOL_PACKET, PACKET_QDISC_BYPASS
    s.bind((ifname, 0))
    s.send(frame)
    print('sent')
    sys.exit(0)
# AF_XDP: a 64 KiB UMEM, fill, completion and TX rings of 64, bound in copy mode to queue 0.
SOL_XDP, MMAP_OFFSETS, TX_RING, UMEM_REG, FILL_RING, COMPLETION_RING = 283, 1, 3, 4, 5, 6
umem = mmap.mmap(-1, 16 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
base = ctypes.addressof(ctypes.c_char.from_buffer(umem))
s.setsockopt(SOL_XDP, UMEM_REG, struct.pack('=QQII', base, 16 * 4096, 4096, 0))
for ring in (FILL_RING, COMPLETION_RING, TX_RING):
    s.setsockopt(SOL_XDP, ring, struct.pack('=I', 64))
offsets = struct.unpack('=16Q', s.getsockopt(SOL_XDP, MMAP_OFFSETS, 128))
producer, descs = offsets[4], offsets[6]
tx = mmap.mmap(s.fileno(), descs + 64 * 16, mmap.MAP_SHARED,
               mmap.PROT_READ | mmap.PROT_WRITE, offset=0x80000000)
class SockaddrXdp(ctypes.Structure):
    _fields_ = [('family', ctypes.c_uint16), ('flags', ctypes.c_uint16),
                ('ifindex', ctypes.c_uint32), ('queue', ctypes.c_uint32),
                ('shared_umem_fd', ctypes.c_uint32)]
addr = SockaddrXdp(44, 2, socket.if_nametoindex(ifname), 0, 0)  # XDP_COPY
libc = ctypes.CDLL(None, use_errno=True)
if libc.bind(s.fileno(), ctypes.byref(addr), ctypes.sizeof(addr)) != 0:
    sys.exit('binding the XDP socket failed: errno %d' % ctypes.get_errno())
umem[0:len(frame)] = frame
struct.pack_into('=QII', tx, descs, 0, len(frame), 0)
struct.pack_into('=I', tx, producer, 1)
s.send(b'', socket.MSG_DONTWAIT)
print('sent')
"#
);

/// How [`SEND_FRAME`] writes its frame.
#[derive(Debug, Clone, Copy)]
enum Way {
    Packet,
    PacketQdiscBypass,
    Xdp,
}

impl Way {
    const ALL: [Way; 3] = [Way::Packet, Way::PacketQdiscBypass, Way::Xdp];

    fn arg(self) -> &'static str {
        match self {
            Way::Packet => "packet",
            Way::PacketQdiscBypass => "bypass",
            Way::Xdp => "xdp",
        }
    }
}

/// Sends [`SEND_FRAME`] as `who` (root without CAP_NET_ADMIN, with or without CAP_NET_RAW)
/// to the gateway's [`REFUSED_PORT`]; its output line.
fn send_frame(w: &World, who: Adversary, way: Way) -> String {
    let mac = w.net_cmd(&["cat", "/sys/class/net/veth0/address"]);
    assert!(mac.success(), "{mac}");
    let (src, dst, port) = (
        SANDBOX_V4.to_string(),
        GATEWAY_V4.to_string(),
        REFUSED_PORT.to_string(),
    );
    let script = format!("{REFUSE_CAP_NET_ADMIN_PY}{SEND_FRAME}");
    let out = w.adversary_cmd(
        who,
        &[
            PYTHON,
            "-c",
            &script,
            way.arg(),
            "eth0",
            mac.stdout.trim(),
            &src,
            &dst,
            &port,
        ],
    );
    assert!(out.success(), "sending a frame ({way:?}): {out}");
    out.stdout.trim().to_string()
}

/// `egress-fence probe --json` in the sandbox as `who` (root without CAP_NET_ADMIN): the exit
/// code and the link-layer check's outcome and reason.
fn probe_link_layer(w: &World, policy: &str, who: Adversary) -> (i32, String, String) {
    let out = w.adversary_cmd(who, &[EGRESS_FENCE_BIN, "probe", policy, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("probe --json is not JSON ({e}): {out}"));
    let checks = v["checks"].as_array().cloned().unwrap_or_default();
    let check = checks
        .iter()
        .find(|c| c["check"] == egress_fence::probe::LINK_LAYER_CHECK)
        .unwrap_or_else(|| panic!("no link-layer check: {out}"));
    let field = |k: &str| check[k].as_str().unwrap_or_default().to_string();
    let failed: Vec<String> = checks
        .iter()
        .filter(|c| c["outcome"] == "fail")
        .map(|c| format!("{}: {}", c["check"], c["reason"]))
        .collect();
    let reason = format!("{} (failed checks: {failed:?})", field("reason"));
    (out.code(), field("outcome"), reason)
}

#[test]
fn frames_from_packet_and_xdp_sockets_pass_the_table_and_the_probe_says_so() {
    let w = World::new();
    let listener = w.listen_udp(GATEWAY_V4, REFUSED_PORT);
    // The allowed service, so that every other check of the probe passes.
    let _service = w.listen_tcp(HOST_V4, 7000);
    let path: PathBuf = w.write_file("policy.yaml", POLICY);
    let path = path.to_str().expect("utf-8 path");
    let applied = w.egress_fence(&["apply", path]);
    assert!(applied.success(), "apply: {applied}");

    // The table refuses the port to the IP stack...
    let stack = w.udp_send(GATEWAY_V4, REFUSED_PORT, b"through the IP stack");
    assert!(
        !listener.wait_for(1, Duration::from_millis(500)),
        "the table let UDP {REFUSED_PORT} through ({stack}): {:?}",
        listener.hits()
    );
    // ...but a frame written below it, through a packet socket (plain or past the qdisc) or an
    // XDP socket, arrives: nftables cannot refuse it (the limitation the README states).
    for way in Way::ALL {
        assert_eq!(
            send_frame(&w, Adversary::RootWithoutNetAdmin, way),
            "sent",
            "{way:?}"
        );
    }
    assert!(
        listener.wait_for(Way::ALL.len(), Duration::from_secs(3)),
        "every frame was expected to arrive; if one does not, the fence now stops it: update \
         the README and this test ({:?})",
        listener.hits()
    );
    let peers: Vec<IpAddr> = listener.peers();
    assert!(peers.iter().all(|p| *p == SANDBOX_V4), "{peers:?}");

    // So the probe, run as such a process, fails and names the remedy.
    let (code, outcome, reason) = probe_link_layer(&w, path, Adversary::RootWithoutNetAdmin);
    assert_eq!(outcome, "fail", "{reason}");
    assert_eq!(code, 5, "a failed check fails the probe: {reason}");
    assert!(reason.contains("CAP_NET_RAW"), "{reason}");

    // Without CAP_NET_RAW neither socket opens, no frame leaves, and the probe passes.
    let before = listener.count();
    for way in Way::ALL {
        let refused = send_frame(&w, Adversary::RootWithoutNetAdminOrNetRaw, way);
        assert_eq!(refused, format!("refused {}", libc::EPERM), "{way:?}");
    }
    assert!(
        !listener.wait_for(before + 1, Duration::from_millis(500)),
        "a frame arrived from a process without CAP_NET_RAW"
    );
    let (code, outcome, reason) =
        probe_link_layer(&w, path, Adversary::RootWithoutNetAdminOrNetRaw);
    assert_eq!(outcome, "pass", "{reason}");
    assert_eq!(code, 0, "every check passes without CAP_NET_RAW: {reason}");
}
