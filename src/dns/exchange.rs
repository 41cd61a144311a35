//! One DNS round trip over UDP or TCP, async (the guard) or blocking (the probe, the test
//! harness), on a socket the caller opened: the caller decides what the socket carries (the
//! guard's mark) and where it goes; this module only moves messages.
//!
//! A UDP socket must be connected: datagrams from any other address never reach it. Of what
//! does arrive, only a datagram with a whole header of a response with the query's id is taken
//! (see [`message::response_code`]); others are skipped, and the caller checks the question
//! of what was taken ([`message::parse_reply`]).

use std::io;
use std::net::{TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use super::frame;
use super::message::{self, MAX_MESSAGE};

/// Whether `datagram` may be the response to query `id`.
fn is_response_to(datagram: &[u8], id: u16) -> bool {
    message::response_code(datagram, id).is_some()
}

thread_local! {
    /// Where [`udp`] receives: a datagram may be as long as a message, and zeroing (and
    /// faulting in) 64 KiB for every exchange cost more than the exchange itself.
    static RECEIVED: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; MAX_MESSAGE]);
}

/// Sends `query` (whose id is `id`) on the connected `socket` and returns the first response
/// with that id. Never returns on its own without one: bound it with `tokio::time::timeout`.
pub async fn udp(socket: &tokio::net::UdpSocket, query: &[u8], id: u16) -> io::Result<Vec<u8>> {
    socket.send(query).await?;
    loop {
        socket.readable().await?;
        // Received and copied out within one step of the task: the buffer is never held
        // across an await, so every exchange of the thread can use it.
        let taken = RECEIVED.with_borrow_mut(|buf| match socket.try_recv(buf) {
            Ok(len) => Ok(is_response_to(&buf[..len], id).then(|| buf[..len].to_vec())),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        })?;
        if let Some(reply) = taken {
            return Ok(reply);
        }
    }
}

/// Sends `query` on `stream` and returns the message that comes back (its id and question
/// are the caller's to check). Bound it with `tokio::time::timeout`.
pub async fn tcp(stream: &mut tokio::net::TcpStream, query: &[u8]) -> io::Result<Vec<u8>> {
    frame::write(stream, query).await?;
    frame::read(stream, MAX_MESSAGE).await
}

/// Sends `query` (whose id is `id`) on the connected `socket` and returns the first response
/// with that id that comes within `timeout`; an error of kind `TimedOut` when none does.
pub fn udp_blocking(
    socket: &UdpSocket,
    query: &[u8],
    id: u16,
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    socket.send(query)?;
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        socket.set_read_timeout(Some(left))?;
        let len = socket.recv(&mut buf)?;
        if is_response_to(&buf[..len], id) {
            buf.truncate(len);
            return Ok(buf);
        }
    }
}

/// Sends `query` on the connected `stream` and returns the message that comes back, each
/// direction within `timeout` (see [`frame::round_trip`]).
pub fn tcp_blocking(
    stream: &mut TcpStream,
    query: &[u8],
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    frame::round_trip(stream, query, MAX_MESSAGE, timeout)
}

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use hickory_proto::op::{Message, MessageType, Query};
    use hickory_proto::rr::{Name, RecordType};

    use super::*;

    fn question(name: &str) -> Query {
        Query::query(Name::from_str(name).unwrap(), RecordType::A)
    }

    /// A server on loopback that answers each query with what `answers` makes of it, each
    /// datagram in turn.
    fn udp_server(answers: fn(&Message) -> Vec<Vec<u8>>) -> std::net::SocketAddr {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = socket.recv_from(&mut buf) {
                let Ok(query) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                for datagram in answers(&query) {
                    let _ = socket.send_to(&datagram, from);
                }
            }
        });
        addr
    }

    fn response(query: &Message) -> Message {
        let mut reply = query.clone();
        reply.metadata.message_type = MessageType::Response;
        reply
    }

    /// Stray datagrams before the answer: another id, a header cut short, the query echoed
    /// (no QR bit). Each is skipped; the answer is taken.
    #[test]
    fn udp_skips_what_is_not_the_response_to_the_id() {
        let server = udp_server(|q| {
            let mut other = response(q);
            other.metadata.id = q.metadata.id.wrapping_add(1);
            let good = response(q).to_vec().unwrap();
            vec![
                other.to_vec().unwrap(),
                good[..11].to_vec(),
                q.to_vec().unwrap(),
                good,
            ]
        });
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.connect(server).unwrap();
        let questions = [question("api.example.")];
        let query = message::query(0x4242, questions.clone(), true, None);
        let bytes = query.to_vec().unwrap();
        let reply = udp_blocking(&socket, &bytes, 0x4242, Duration::from_secs(2)).unwrap();
        let parsed = message::parse_reply(&reply, MAX_MESSAGE, 0x4242, &questions).unwrap();
        assert_eq!(parsed.queries, questions);
    }

    /// Only wrong answers: the exchange ends at its timeout, with `TimedOut`.
    #[test]
    fn udp_without_a_matching_response_times_out() {
        let server = udp_server(|q| {
            let mut other = response(q);
            other.metadata.id = q.metadata.id.wrapping_add(1);
            vec![other.to_vec().unwrap()]
        });
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.connect(server).unwrap();
        let bytes = message::query(9, [question("api.example.")], true, None)
            .to_vec()
            .unwrap();
        let e = udp_blocking(&socket, &bytes, 9, Duration::from_millis(200)).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
            ),
            "{e}"
        );
    }

    /// The async exchange over both transports, against one server that answers a wrong
    /// question: the bytes come back, and the question check refuses them.
    #[tokio::test]
    async fn async_round_trips_return_the_answer_for_the_caller_to_check() {
        let server = udp_server(|q| {
            let mut wrong = response(q);
            wrong.queries[0].set_name(Name::from_str("evil.example.").unwrap());
            vec![wrong.to_vec().unwrap()]
        });
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        socket.connect(server).await.unwrap();
        let questions = [question("api.example.")];
        let bytes = message::query(5, questions.clone(), true, None)
            .to_vec()
            .unwrap();
        let reply = udp(&socket, &bytes, 5).await.unwrap();
        assert!(matches!(
            message::parse_reply(&reply, MAX_MESSAGE, 5, &questions),
            Err(message::ReplyError::Mismatch)
        ));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut peer, _) = listener.accept().await.unwrap();
            let query = frame::read(&mut peer, 512).await.unwrap();
            let reply = response(&Message::from_vec(&query).unwrap());
            frame::write(&mut peer, &reply.to_vec().unwrap())
                .await
                .unwrap();
        });
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let reply = tcp(&mut stream, &bytes).await.unwrap();
        assert!(message::parse_reply(&reply, MAX_MESSAGE, 5, &questions).is_ok());
    }
}
