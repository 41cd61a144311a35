//! A plain netlink socket to the kernel, in the network namespace of the thread that opens
//! it: the calls every family here needs, in the widths nix takes them.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::Duration;

use nix::sys::socket::{
    self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, sockopt,
};
use nix::sys::time::TimeVal;

#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
}

impl Socket {
    /// A netlink socket of `protocol` (NETLINK_NETFILTER, NETLINK_SOCK_DIAG, ...), not yet
    /// bound: the kernel binds it to a port of its choosing at the first send.
    pub fn open(protocol: SockProtocol) -> nix::Result<Socket> {
        let fd = socket::socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            protocol,
        )?;
        Ok(Socket { fd })
    }

    /// Binds to a port the kernel picks, subscribed to the multicast `groups` (a bit mask).
    pub fn bind(&self, groups: u32) -> nix::Result<()> {
        socket::bind(self.fd.as_raw_fd(), &NetlinkAddr::new(0, groups))
    }

    /// Sends one datagram to the kernel.
    pub fn send(&self, datagram: &[u8]) -> nix::Result<usize> {
        send(self.fd.as_fd(), datagram)
    }

    /// Receives one datagram into `buf`; with MSG_TRUNC the datagram's real length, which may
    /// exceed `buf`.
    pub fn recv(&self, buf: &mut [u8], flags: MsgFlags) -> nix::Result<usize> {
        recv(self.fd.as_fd(), buf, flags)
    }

    /// How long a blocking receive waits (`None`: for ever). A wait shorter than a
    /// microsecond becomes one, since a zero SO_RCVTIMEO means for ever.
    pub fn set_recv_timeout(&self, timeout: Option<Duration>) -> nix::Result<()> {
        set_recv_timeout(self.fd.as_fd(), timeout)
    }

    /// Raises the receive buffer past the sysctl cap (needs CAP_NET_ADMIN).
    pub fn force_recv_buffer(&self, bytes: usize) -> nix::Result<()> {
        socket::setsockopt(&self.fd, sockopt::RcvBufForce, &bytes)
    }

    /// Has the kernel drop, before they are queued, the datagrams whose first message was
    /// sent from netlink port `portid` (a multicast notification carries its sender's port).
    /// Replaces any filter set before.
    pub fn drop_from_port(&self, portid: u32) -> std::io::Result<()> {
        socket2::SockRef::from(&self.fd).attach_filter(&port_filter(portid))
    }
}

/// A classic BPF program: datagrams whose first `nlmsg_pid` is `portid` are dropped, all
/// others kept whole. `BPF_LD|BPF_W|BPF_ABS` reads a word in network byte order and netlink
/// headers are in the host's, so the port is compared as those bytes read big-endian.
fn port_filter(portid: u32) -> [socket2::SockFilter; 4] {
    const NLMSG_PID_OFFSET: u32 = 12;
    let as_loaded = u32::from_be_bytes(portid.to_ne_bytes());
    let op = |code: u32| code as u16;
    [
        // A = nlmsg_pid (a datagram too short to hold one ends the program: dropped; every
        // netlink message has a whole header).
        socket2::SockFilter::new(
            op(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS),
            0,
            0,
            NLMSG_PID_OFFSET,
        ),
        socket2::SockFilter::new(
            op(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K),
            0,
            1,
            as_loaded,
        ),
        socket2::SockFilter::new(op(libc::BPF_RET | libc::BPF_K), 0, 0, 0),
        socket2::SockFilter::new(op(libc::BPF_RET | libc::BPF_K), 0, 0, u32::MAX),
    ]
}

impl AsFd for Socket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Sends one datagram to the kernel on any netlink socket (also one `mnl` opened).
pub fn send(fd: BorrowedFd<'_>, datagram: &[u8]) -> nix::Result<usize> {
    socket::sendto(
        fd.as_raw_fd(),
        datagram,
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )
}

/// Receives one datagram on any netlink socket.
pub fn recv(fd: BorrowedFd<'_>, buf: &mut [u8], flags: MsgFlags) -> nix::Result<usize> {
    socket::recv(fd.as_raw_fd(), buf, flags)
}

/// See [`Socket::set_recv_timeout`].
pub fn set_recv_timeout(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> nix::Result<()> {
    let tv = match timeout.map(|t| t.max(Duration::from_micros(1))) {
        None => TimeVal::new(0, 0),
        Some(t) => TimeVal::new(
            t.as_secs().try_into().unwrap_or(i64::MAX as _),
            t.subsec_micros().into(),
        ),
    };
    socket::setsockopt(&fd, sockopt::ReceiveTimeout, &tv)
}

/// Why a dump over [`dump`] ended without its answer.
#[derive(Debug, thiserror::Error)]
pub enum DumpFailed {
    #[error("{doing}: {source}")]
    Io {
        doing: &'static str,
        source: nix::errno::Errno,
    },
    #[error("refused by the kernel: {0}")]
    Refused(nix::errno::Errno),
}

/// What one datagram of a dump's answer said.
pub enum DumpStep {
    More,
    Done,
    Refused(nix::errno::Errno),
}

/// A dump that takes longer than this is abandoned.
const DUMP_TIMEOUT: Duration = Duration::from_secs(2);

/// Sends the dump `request` on a fresh socket of `protocol` in the calling thread's network
/// namespace, and gives each datagram of the answer to `datagram` until it says the dump is
/// done or refused, or [`DUMP_TIMEOUT`] passes without one.
pub fn dump(
    protocol: SockProtocol,
    request: &[u8],
    mut datagram: impl FnMut(&[u8]) -> DumpStep,
) -> Result<(), DumpFailed> {
    let io = |doing| move |source| DumpFailed::Io { doing, source };
    let socket = Socket::open(protocol).map_err(io("socket"))?;
    socket.bind(0).map_err(io("bind"))?;
    socket
        .set_recv_timeout(Some(DUMP_TIMEOUT))
        .map_err(io("timeout"))?;
    socket.send(request).map_err(io("send"))?;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = socket
            .recv(&mut buf, MsgFlags::empty())
            .map_err(io("receive"))?;
        match datagram(&buf[..n.min(buf.len())]) {
            DumpStep::More => {}
            DumpStep::Done => return Ok(()),
            DumpStep::Refused(errno) => return Err(DumpFailed::Refused(errno)),
        }
    }
}
