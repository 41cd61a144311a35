//! DNS over TCP: each message behind its two-byte length (RFC 1035 4.2.2), for async streams
//! (the guard) and blocking ones (the probe, the test harness).
//!
//! A length over the reader's limit ends the read before the message is read: a peer cannot
//! make the reader buffer more than it takes. Timeouts belong to the caller's stream (a
//! socket timeout) or future (`tokio::time::timeout`); [`round_trip`] sets them for a
//! blocking exchange.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// `message` behind its length, in one buffer: written with one call, so it leaves in as few
/// segments as the stack makes.
pub fn frame(message: &[u8]) -> io::Result<Vec<u8>> {
    let len = u16::try_from(message.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a DNS message over 64 KiB"))?;
    let mut framed = Vec::with_capacity(message.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(message);
    Ok(framed)
}

fn too_long(len: usize, max: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("a DNS message of {len} bytes, longer than the {max} taken"),
    )
}

/// Reads one framed message of at most `max` bytes.
pub async fn read<R: AsyncRead + Unpin>(stream: &mut R, max: usize) -> io::Result<Vec<u8>> {
    let len = usize::from(stream.read_u16().await?);
    if len > max {
        return Err(too_long(len, max));
    }
    let mut message = vec![0u8; len];
    stream.read_exact(&mut message).await?;
    Ok(message)
}

/// Writes one framed message.
pub async fn write<W: AsyncWrite + Unpin>(stream: &mut W, message: &[u8]) -> io::Result<()> {
    stream.write_all(&frame(message)?).await
}

/// Reads one framed message of at most `max` bytes from a blocking stream.
pub fn read_blocking<R: Read>(stream: &mut R, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len)?;
    let len = usize::from(u16::from_be_bytes(len));
    if len > max {
        return Err(too_long(len, max));
    }
    let mut message = vec![0u8; len];
    stream.read_exact(&mut message)?;
    Ok(message)
}

/// Writes one framed message to a blocking stream.
pub fn write_blocking<W: Write>(stream: &mut W, message: &[u8]) -> io::Result<()> {
    stream.write_all(&frame(message)?)
}

/// One exchange on an open connection: `query` out, one message of at most `max` bytes back,
/// each direction within `timeout` of socket inactivity.
pub fn round_trip(
    stream: &mut TcpStream,
    query: &[u8],
    max: usize,
    timeout: Duration,
) -> io::Result<Vec<u8>> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write_blocking(stream, query)?;
    read_blocking(stream, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_the_length_then_the_message() {
        assert_eq!(frame(b"abc").unwrap(), [0, 3, b'a', b'b', b'c']);
        assert_eq!(frame(&[]).unwrap(), [0, 0]);
        assert_eq!(frame(&[0u8; 65_535]).unwrap().len(), 65_537);
        let over = frame(&vec![0u8; 65_536]).unwrap_err();
        assert_eq!(over.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn blocking_reads_take_whole_frames_up_to_the_limit() {
        let mut two = frame(b"first").unwrap();
        two.extend(frame(b"second").unwrap());
        let mut stream = &two[..];
        assert_eq!(read_blocking(&mut stream, 6).unwrap(), b"first");
        assert_eq!(read_blocking(&mut stream, 6).unwrap(), b"second");
        let eof = read_blocking(&mut stream, 6).unwrap_err();
        assert_eq!(eof.kind(), io::ErrorKind::UnexpectedEof);
        // Cut short in the length and in the message.
        for cut in [&[0u8][..], &[0, 5, b'a', b'b'][..]] {
            let mut stream = cut;
            let e = read_blocking(&mut stream, 512).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        }
        // Over the limit: refused from the length alone, nothing after it is read.
        let long = frame(&[7u8; 600]).unwrap();
        let mut stream = &long[..];
        let e = read_blocking(&mut stream, 512).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert_eq!(stream.len(), 600, "the message was left unread");
        let mut out = Vec::new();
        write_blocking(&mut out, b"q").unwrap();
        assert_eq!(out, [0, 1, b'q']);
    }

    #[tokio::test]
    async fn async_reads_take_whole_frames_up_to_the_limit() {
        let mut out = Vec::new();
        write(&mut out, b"query").await.unwrap();
        let mut stream = &out[..];
        assert_eq!(read(&mut stream, 5).await.unwrap(), b"query");
        let mut stream = &out[..];
        let e = read(&mut stream, 4).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert_eq!(stream.len(), 5, "the message was left unread");
        let mut cut = &out[..4];
        let e = read(&mut cut, 512).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    /// A peer that sends part of a frame and then nothing: the read ends at the timeout.
    #[test]
    fn a_round_trip_ends_at_the_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut peer, _) = listener.accept().unwrap();
            let query = read_blocking(&mut peer, 512).unwrap();
            peer.write_all(&[0, 12]).unwrap();
            peer.write_all(&query[..1]).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        });
        let mut stream = TcpStream::connect(addr).unwrap();
        let started = std::time::Instant::now();
        let e = round_trip(&mut stream, b"hello", 512, Duration::from_millis(100)).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            "{e}"
        );
        assert!(started.elapsed() < Duration::from_millis(290));
        server.join().unwrap();
    }
}
