//! TCP and UDP listeners in the net namespace, served by threads of the test process, that
//! record what reaches them.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sched::CloneFlags;
use nix::sys::socket;

use super::world::World;

/// A TCP or UDP listener in the net namespace, served by a thread of the test process.
/// It stops when dropped (or when its world drops); what it recorded stays readable.
pub struct Listener {
    shared: Arc<ListenerShared>,
    thread: Option<JoinHandle<()>>,
}

/// One TCP connection or UDP datagram a [`Listener`] received.
#[derive(Clone, Debug)]
pub struct Hit {
    /// The client's address: the sandbox's address for traffic from the sandbox.
    pub peer: SocketAddr,
    /// The listener's own address.
    pub local: SocketAddr,
    /// When the connection was accepted or the datagram received.
    pub at: Instant,
    /// UDP: the payload. TCP: the request read (filled in once read, before the answer).
    pub data: Vec<u8>,
}

impl Listener {
    /// The address it listens on (with the real port when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.local
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.shared.local.port()
    }

    /// Everything received so far.
    pub fn hits(&self) -> Vec<Hit> {
        self.shared.lock_hits().clone()
    }

    /// Number of connections/datagrams so far.
    pub fn count(&self) -> usize {
        self.shared.lock_hits().len()
    }

    /// The client addresses so far.
    pub fn peers(&self) -> Vec<IpAddr> {
        self.shared
            .lock_hits()
            .iter()
            .map(|h| h.peer.ip())
            .collect()
    }

    /// Waits until at least `n` hits arrived; false after `timeout`. For non-arrival, check
    /// `!wait_for(1, short)` after the client gave up.
    pub fn wait_for(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut hits = self.shared.lock_hits();
        while hits.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            hits = self
                .shared
                .arrived
                .wait_timeout(hits, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Stops listening now (new connections are refused); hits stay readable.
    pub fn stop(&mut self) {
        self.shared.request_stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop();
    }
}

#[derive(Clone, Copy, Debug)]
enum Proto {
    Tcp,
    Udp,
    /// TCP, one thread per connection, echo or HTTP ([`World::listen_tcp_any`]).
    TcpAny,
}

enum Socket {
    Tcp(TcpListener),
    Udp(UdpSocket),
}

pub(super) struct ListenerShared {
    /// Owned here (not by the thread) so `request_stop` can never touch a reused fd.
    socket: Socket,
    local: SocketAddr,
    stop: AtomicBool,
    hits: Mutex<Vec<Hit>>,
    arrived: Condvar,
    /// Each connection is served by a thread of its own ([`handle_tcp_threaded`]).
    threaded: bool,
}

impl ListenerShared {
    fn fd(&self) -> BorrowedFd<'_> {
        match &self.socket {
            Socket::Tcp(l) => l.as_fd(),
            Socket::Udp(u) => u.as_fd(),
        }
    }

    fn lock_hits(&self) -> MutexGuard<'_, Vec<Hit>> {
        self.hits.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, hit: Hit) -> usize {
        let mut hits = self.lock_hits();
        hits.push(hit);
        self.arrived.notify_all();
        hits.len() - 1
    }

    pub(super) fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes a thread blocked in poll at once (for UDP too, although it returns ENOTCONN);
        // the poll timeout in `serve` is the fallback.
        // The fd is `self`'s own socket, open for as long as `self` lives.
        let _ = socket::shutdown(self.fd().as_raw_fd(), socket::Shutdown::Both);
    }
}

fn serve(shared: &Arc<ListenerShared>) {
    let fd = shared.fd();
    let mut buf = vec![0u8; 65536];
    while !shared.stop.load(Ordering::SeqCst) {
        if !poll_readable(fd, PollTimeout::from(100u16)) || shared.stop.load(Ordering::SeqCst) {
            continue;
        }
        match &shared.socket {
            Socket::Tcp(l) => match l.accept() {
                Ok((stream, peer)) if shared.threaded => {
                    let shared = shared.clone();
                    // The thread inherits this thread's network namespace (it opens nothing).
                    let spawned = thread::Builder::new()
                        .name("eft-tcp-conn".into())
                        .spawn(move || handle_tcp_threaded(&shared, stream, peer));
                    if spawned.is_err() {
                        thread::sleep(Duration::from_millis(10));
                    }
                }
                Ok((stream, peer)) => handle_tcp(shared, stream, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => thread::sleep(Duration::from_millis(10)),
            },
            Socket::Udp(u) => match u.recv_from(&mut buf) {
                Ok((n, peer)) => {
                    shared.record(Hit {
                        peer,
                        local: shared.local,
                        at: Instant::now(),
                        data: buf[..n].to_vec(),
                    });
                    let _ = u.send_to(&buf[..n], peer);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(_) => thread::sleep(Duration::from_millis(10)),
            },
        }
    }
}

fn handle_tcp(shared: &ListenerShared, mut stream: std::net::TcpStream, peer: SocketAddr) {
    let index = shared.record(Hit {
        peer,
        local: shared.local,
        at: Instant::now(),
        data: Vec::new(),
    });
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    while !data.windows(4).any(|w| w == b"\r\n\r\n") && data.len() < 65536 {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => data.extend_from_slice(&buf[..n]),
        }
    }
    shared.lock_hits()[index].data = data;
    let body = format!("HTTP/1.0 200 OK\r\n\r\nhello from {}\n", shared.local);
    if stream.write_all(body.as_bytes()).is_ok() {
        let _ = stream.shutdown(Shutdown::Write);
        // Let the client close first so it never sees a reset.
        let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
        while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// A connection of a [`World::listen_tcp_any`] listener: records it (with the address the
/// client actually connected to), then answers an HTTP request (first bytes `GET `, `HEAD`,
/// `POST`) like [`handle_tcp`] does, or echoes everything else back until the client closes
/// it or the listener stops.
fn handle_tcp_threaded(shared: &ListenerShared, mut stream: std::net::TcpStream, peer: SocketAddr) {
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let local = stream.local_addr().map_or(shared.local, canonical);
    let index = shared.record(Hit {
        peer: canonical(peer),
        local,
        at: Instant::now(),
        data: Vec::new(),
    });
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let mut data = Vec::new();
    let mut buf = [0u8; 4096];
    let mut http = None;
    // Bytes received before the kind of client was known: echoed once it is.
    let mut undecided = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        let n = match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        let fresh = &buf[..n];
        if data.len() < 65536 {
            data.extend_from_slice(fresh);
        }
        if http.is_none() {
            undecided.extend_from_slice(fresh);
            if undecided.len() >= 4 || fresh.contains(&b'\n') {
                let methods = [&b"GET "[..], b"HEAD", b"POST"];
                http = Some(methods.iter().any(|m| undecided.starts_with(m)));
            }
        }
        match http {
            Some(true) if data.windows(4).any(|w| w == b"\r\n\r\n") => {
                let body = format!("HTTP/1.0 200 OK\r\n\r\nhello from {local}\n");
                if stream.write_all(body.as_bytes()).is_ok() {
                    let _ = stream.shutdown(Shutdown::Write);
                    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
                    while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
                }
                break;
            }
            Some(false) => {
                let echo = if undecided.is_empty() {
                    fresh
                } else {
                    &undecided[..]
                };
                if stream.write_all(echo).is_err() {
                    break;
                }
                undecided.clear();
            }
            _ => {}
        }
    }
    shared.lock_hits()[index].data = data;
}

fn poll_readable(fd: BorrowedFd<'_>, timeout: PollTimeout) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    matches!(poll(&mut fds, timeout), Ok(n) if n > 0)
}

impl World {
    /// Listens on `ip:port` in the net namespace (port 0: any free port, see
    /// [`Listener::local_addr`]). Every accepted connection is recorded; the listener reads
    /// the request (up to an empty line, EOF or 1 s) and answers
    /// `HTTP/1.0 200 OK\r\n\r\nhello from ADDR:PORT\n` (ADDR:PORT as `SocketAddr` prints it,
    /// so IPv6 is bracketed). `ip` must be a host of the world.
    pub fn listen_tcp(&self, ip: IpAddr, port: u16) -> Listener {
        self.listen(ip, port, Proto::Tcp)
    }

    /// Listens for UDP datagrams on `ip:port` in the net namespace; records each one and
    /// echoes its payload back to the sender.
    pub fn listen_udp(&self, ip: IpAddr, port: u16) -> Listener {
        self.listen(ip, port, Proto::Udp)
    }

    fn listen(&self, ip: IpAddr, port: u16, proto: Proto) -> Listener {
        let fd = self
            .net_fd
            .as_ref()
            .expect("net namespace exists")
            .try_clone()
            .expect("dup the net namespace fd");
        let (tx, rx) = mpsc::channel::<Result<Arc<ListenerShared>, String>>();
        let thread = thread::Builder::new()
            .name(format!("eft-{proto:?}-{port}"))
            .spawn(move || {
                let bound = (|| -> std::io::Result<Arc<ListenerShared>> {
                    // setns affects only this thread, ours, which ends with the listener.
                    nix::sched::setns(&fd, CloneFlags::CLONE_NEWNET)?;
                    let (socket, local) = match proto {
                        Proto::Tcp | Proto::TcpAny => {
                            let l = TcpListener::bind((ip, port))?;
                            l.set_nonblocking(true)?;
                            let local = l.local_addr()?;
                            (Socket::Tcp(l), local)
                        }
                        Proto::Udp => {
                            let u = UdpSocket::bind((ip, port))?;
                            u.set_nonblocking(true)?;
                            let local = u.local_addr()?;
                            (Socket::Udp(u), local)
                        }
                    };
                    Ok(Arc::new(ListenerShared {
                        socket,
                        local,
                        stop: AtomicBool::new(false),
                        hits: Mutex::new(Vec::new()),
                        arrived: Condvar::new(),
                        threaded: matches!(proto, Proto::TcpAny),
                    }))
                })();
                drop(fd);
                match bound {
                    Ok(shared) => {
                        let _ = tx.send(Ok(shared.clone()));
                        serve(&shared);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string()));
                    }
                }
            })
            .expect("spawn a listener thread");
        let shared = match rx.recv() {
            Ok(Ok(shared)) => shared,
            Ok(Err(e)) => {
                let _ = thread.join();
                panic!(
                    "cannot listen on {proto:?} {ip}:{port} in {}: {e} \
                     (is {ip} a host of this world? see add_host)",
                    self.net
                )
            }
            Err(_) => panic!("the listener thread for {ip}:{port} died"),
        };
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&shared));
        Listener {
            shared,
            thread: Some(thread),
        }
    }

    /// A TCP listener on `[::]:port` in the net namespace (dual stack: every IPv4 and IPv6
    /// host of the world, e.g. a whole [`World::rotating_pool`]). Each connection is served
    /// by a thread of its own: it is recorded with the address the client really connected
    /// to ([`Hit::local`], IPv4 without the `::ffff:` mapping, like [`Hit::peer`]), then an
    /// HTTP request (first bytes `GET `, `HEAD` or `POST`) is answered like
    /// [`World::listen_tcp`] does, and anything else is echoed back until the client closes
    /// (a long-lived connection). Do not combine it with another listener on the same port.
    pub fn listen_tcp_any(&self, port: u16) -> Listener {
        self.listen(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port, Proto::TcpAny)
    }
}
