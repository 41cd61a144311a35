//! Netlink messages: the header (`struct nlmsghdr`), the walk over a datagram's messages,
//! acknowledgements and errors, the nfnetlink header (`struct nfgenmsg`), multi-part dumps,
//! and requests built from their parts.
//!
//! Every parser here reads kernel bytes as untrusted: lengths are checked against what is
//! there before anything is sliced, and a message that does not fit ends the walk with a
//! [`Malformed`] error rather than a guess.

use nix::errno::Errno;

use super::attr::{self, Attrs, NLA_F_NESTED, NLA_HDRLEN};
use super::bytes::{align4, ne16, ne32};

/// Bytes of `struct nlmsghdr`.
pub const NLMSG_HDRLEN: usize = 16;
/// Bytes of `struct nfgenmsg`, which every nfnetlink message carries after its header.
pub const NFGENMSG_LEN: usize = 4;

pub const NLMSG_NOOP: u16 = 1;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;

pub const NLM_F_REQUEST: u16 = 1;
pub const NLM_F_ACK: u16 = 4;
/// NLM_F_ROOT | NLM_F_MATCH.
pub const NLM_F_DUMP: u16 = 0x300;

/// nfnetlink subsystems (linux/netfilter/nfnetlink.h): the high byte of a message's type.
pub const NFNL_SUBSYS_CTNETLINK: u8 = 1;
pub const NFNL_SUBSYS_ULOG: u8 = 4;
pub const NFNL_SUBSYS_NFTABLES: u8 = 10;
/// `NFNETLINK_V0`, the only nfgenmsg version.
pub const NFNETLINK_V0: u8 = 0;

/// The message type of nfnetlink message `msg` of subsystem `subsys`.
pub const fn nfnl_type(subsys: u8, msg: u8) -> u16 {
    ((subsys as u16) << 8) | msg as u16
}

/// Bytes that are not the netlink the kernel would send.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// A message's length field is missing, shorter than its header, or longer than the
    /// bytes that are left; nothing after it can be located.
    #[error("netlink header of {claimed:?} bytes in {remaining} remaining bytes")]
    Header {
        claimed: Option<usize>,
        remaining: usize,
    },
    /// An attribute's length is shorter than its header or runs past its container.
    #[error("attribute {kind} of {len} bytes in {remaining} remaining bytes")]
    Attribute {
        kind: u16,
        len: usize,
        remaining: usize,
    },
    #[error("short netlink error message")]
    ShortError,
    #[error("netfilter message without nfgenmsg")]
    NoNfgenmsg,
}

/// One netlink message, borrowed from the datagram it came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
    /// The sending port (0: the kernel), or for notifications the port that caused them.
    pub portid: u32,
    /// What follows the header, up to the message's own length (padding excluded).
    pub payload: &'a [u8],
    /// The whole message, header included (padding excluded).
    pub bytes: &'a [u8],
}

impl<'a> Message<'a> {
    /// The message at the start of `bytes`; bytes past its length are not looked at.
    pub fn parse(bytes: &'a [u8]) -> Result<Message<'a>, Malformed> {
        let claimed = ne32(bytes, 0).and_then(|l| usize::try_from(l).ok());
        let header = || Malformed::Header {
            claimed,
            remaining: bytes.len(),
        };
        let len = claimed
            .filter(|&l| l >= NLMSG_HDRLEN && l <= bytes.len())
            .ok_or_else(header)?;
        Ok(Message {
            kind: ne16(bytes, 4).ok_or_else(header)?,
            flags: ne16(bytes, 6).ok_or_else(header)?,
            seq: ne32(bytes, 8).ok_or_else(header)?,
            portid: ne32(bytes, 12).ok_or_else(header)?,
            payload: bytes.get(NLMSG_HDRLEN..len).ok_or_else(header)?,
            bytes: bytes.get(..len).ok_or_else(header)?,
        })
    }

    /// For an NLMSG_ERROR message: `Ok(None)` for an acknowledgement, `Ok(Some(errno))` for
    /// a refusal. `None` for any other message.
    pub fn error(&self) -> Option<Result<Option<Errno>, Malformed>> {
        (self.kind == NLMSG_ERROR).then(|| {
            let code = ne32(self.payload, 0).ok_or(Malformed::ShortError)? as i32;
            Ok((code != 0).then(|| Errno::from_raw(code.wrapping_neg())))
        })
    }

    /// The nfgenmsg of a netfilter message and the attributes after it.
    pub fn nfgenmsg(&self) -> Result<(Nfgenmsg, Attrs<'a>), Malformed> {
        let header = self
            .payload
            .get(..NFGENMSG_LEN)
            .ok_or(Malformed::NoNfgenmsg)?;
        let attrs = self.payload.get(NFGENMSG_LEN..).unwrap_or_default();
        Ok((
            Nfgenmsg {
                family: header[0],
                version: header[1],
                res_id: u16::from_be_bytes([header[2], header[3]]),
            },
            Attrs::new(attrs),
        ))
    }
}

/// `struct nfgenmsg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nfgenmsg {
    /// The NFPROTO_* (or AF_*) family the message is about.
    pub family: u8,
    pub version: u8,
    /// Big-endian on the wire: the NFLOG group, the nf_tables generation, ...
    pub res_id: u16,
}

/// The messages of one datagram, in order. A message that does not fit yields one error and
/// ends the walk.
pub fn messages(datagram: &[u8]) -> Messages<'_> {
    Messages { rest: datagram }
}

#[derive(Debug, Clone)]
pub struct Messages<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<Message<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        match Message::parse(self.rest) {
            Ok(msg) => {
                self.rest = self.rest.get(align4(msg.bytes.len())..).unwrap_or_default();
                Some(Ok(msg))
            }
            Err(e) => {
                self.rest = &[];
                Some(Err(e))
            }
        }
    }
}

/// Where a multi-part answer (a dump) stands after one datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DumpProgress {
    More,
    Done,
}

/// How a dump ended other than with NLMSG_DONE.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DumpError {
    #[error("refused: {0}")]
    Refused(Errno),
    #[error(transparent)]
    Malformed(#[from] Malformed),
}

/// Reads one datagram of a dump's answer: hands every message that is not a control message
/// to `each`, skips acknowledgements, and stops at NLMSG_DONE or at the kernel's error.
pub fn read_dump<'a>(
    datagram: &'a [u8],
    mut each: impl FnMut(Message<'a>),
) -> Result<DumpProgress, DumpError> {
    for msg in messages(datagram) {
        let msg = msg?;
        match msg.kind {
            NLMSG_DONE => return Ok(DumpProgress::Done),
            NLMSG_NOOP => {}
            _ => match msg.error() {
                Some(Ok(None)) => {}
                Some(Ok(Some(errno))) => return Err(DumpError::Refused(errno)),
                Some(Err(e)) => return Err(e.into()),
                None => each(msg),
            },
        }
    }
    Ok(DumpProgress::More)
}

/// A message too large for netlink's length fields (an attribute over 64 KiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("netlink message or attribute too large for its length field")]
pub struct Oversize;

/// A message under construction: header, then the family's fixed header, then attributes.
/// The lengths are filled in as parts close; [`Request::finish`] says whether they fit.
#[derive(Debug, Clone)]
pub struct Request {
    buf: Vec<u8>,
    oversize: bool,
}

impl Request {
    pub fn new(kind: u16, flags: u16, seq: u32) -> Request {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_len, set by finish
        buf.extend_from_slice(&kind.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_pid: the kernel fills in ours
        Request {
            buf,
            oversize: false,
        }
    }

    /// Appends a `struct nfgenmsg`.
    pub fn nfgenmsg(self, family: u8, res_id: u16) -> Request {
        let [hi, lo] = res_id.to_be_bytes();
        self.raw(&[family, NFNETLINK_V0, hi, lo])
    }

    /// Appends a fixed structure as it is (a family header such as `inet_diag_req_v2`).
    pub fn raw(mut self, bytes: &[u8]) -> Request {
        self.buf.extend_from_slice(bytes);
        self
    }

    /// Appends one attribute, padded to 4 bytes.
    pub fn attr(mut self, kind: u16, value: &[u8]) -> Request {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; NLA_HDRLEN]);
        self.buf.extend_from_slice(value);
        self.close_attr(start, kind)
    }

    /// Appends a nested attribute (NLA_F_NESTED set) holding the attributes `build` adds.
    pub fn nested(mut self, kind: u16, build: impl FnOnce(Request) -> Request) -> Request {
        let start = self.buf.len();
        self.buf.extend_from_slice(&[0; NLA_HDRLEN]);
        build(self).close_attr(start, kind | NLA_F_NESTED)
    }

    fn close_attr(mut self, start: usize, kind: u16) -> Request {
        let len = self.buf.len() - start;
        let len16 = u16::try_from(len).unwrap_or_else(|_| {
            self.oversize = true;
            0
        });
        let header = attr::header(len16, kind);
        self.buf[start..start + NLA_HDRLEN].copy_from_slice(&header);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    /// The message's bytes, its length set.
    pub fn finish(mut self) -> Result<Vec<u8>, Oversize> {
        let len = u32::try_from(self.buf.len()).map_err(|_| Oversize)?;
        if self.oversize {
            return Err(Oversize);
        }
        self.buf[..4].copy_from_slice(&len.to_ne_bytes());
        Ok(self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(len: u32, kind: u16, seq: u32) -> Vec<u8> {
        let mut m = len.to_ne_bytes().to_vec();
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m
    }

    fn error(seq: u32, code: i32) -> Vec<u8> {
        Request::new(NLMSG_ERROR, 0, seq)
            .raw(&code.to_ne_bytes())
            .raw(&[0; 16])
            .finish()
            .unwrap()
    }

    fn done() -> Vec<u8> {
        Request::new(NLMSG_DONE, 2, 0)
            .raw(&[0; 4])
            .finish()
            .unwrap()
    }

    #[test]
    fn a_request_round_trips() {
        let bytes = Request::new(nfnl_type(NFNL_SUBSYS_ULOG, 1), NLM_F_REQUEST, 9)
            .nfgenmsg(2, 100)
            .attr(1, &[7])
            .nested(2, |r| r.attr(3, &[1, 2, 3, 4]).attr(4, &[]))
            .finish()
            .unwrap();
        assert_eq!(bytes.len(), 16 + 4 + 8 + 4 + 8 + 4);
        assert_eq!(ne32(&bytes, 0), Some(bytes.len() as u32));
        let msgs: Vec<_> = messages(&bytes).collect();
        assert_eq!(msgs.len(), 1);
        let msg = msgs[0].clone().unwrap();
        assert_eq!((msg.kind, msg.flags, msg.seq), (0x0401, NLM_F_REQUEST, 9));
        let (nfgen, attrs) = msg.nfgenmsg().unwrap();
        assert_eq!((nfgen.family, nfgen.version, nfgen.res_id), (2, 0, 100));
        let all: Vec<_> = attrs.map(Result::unwrap).collect();
        assert_eq!((all[0].kind, all[0].value), (1, &[7][..]));
        assert!(all[1].is_nested());
        let inner: Vec<_> = all[1].nested().map(Result::unwrap).collect();
        assert_eq!((inner[0].kind, inner[0].value), (3, &[1, 2, 3, 4][..]));
        assert_eq!((inner[1].kind, inner[1].value), (4, &[][..]));
    }

    #[test]
    fn oversize_attributes_are_refused_not_wrapped() {
        let big = vec![0u8; 70_000];
        assert_eq!(
            Request::new(0x10, 0, 0).attr(1, &big).finish(),
            Err(Oversize)
        );
        let nested = Request::new(0x10, 0, 0)
            .nested(1, |r| r.attr(2, &big[..40_000]).attr(3, &big[..40_000]))
            .finish();
        assert_eq!(nested, Err(Oversize));
        // A plain fixed part may be large: only attributes have 16-bit lengths.
        assert!(Request::new(0x10, 0, 0).raw(&big).finish().is_ok());
    }

    #[test]
    fn truncated_and_lying_headers_end_the_walk() {
        let good = done();
        for cut in 1..good.len() {
            let all: Vec<_> = messages(&good[..cut]).collect();
            assert!(
                matches!(all.as_slice(), [Err(Malformed::Header { .. })]),
                "{cut}"
            );
        }
        // length shorter than the header, zero, past the end
        for len in [0u32, 4, 15, 21, u32::MAX] {
            let mut m = header(len, NLMSG_DONE, 0);
            m.extend_from_slice(&[0; 4]);
            let all: Vec<_> = messages(&m).collect();
            assert!(matches!(all.as_slice(), [Err(_)]), "{len}");
        }
        // a good message then garbage: the good one, then one error
        let mut two = good.clone();
        two.extend_from_slice(&[1, 2, 3]);
        let all: Vec<_> = messages(&two).collect();
        assert!(matches!(all.as_slice(), [Ok(_), Err(_)]));
        assert_eq!(messages(&[]).count(), 0);
    }

    #[test]
    fn padding_between_messages_is_skipped() {
        let odd = Request::new(0x20, 0, 1).raw(&[9]).finish().unwrap(); // 17 bytes
        let mut datagram = odd.clone();
        datagram.extend_from_slice(&[0; 3]);
        datagram.extend_from_slice(&odd);
        let seqs: Vec<_> = messages(&datagram).map(|m| m.unwrap().payload).collect();
        assert_eq!(seqs, vec![&[9][..], &[9][..]]);
    }

    #[test]
    fn acks_refusals_and_short_errors() {
        let ack = error(5, 0);
        let msg = Message::parse(&ack).unwrap();
        assert_eq!((msg.seq, msg.error()), (5, Some(Ok(None))));
        let refused = error(6, -libc::EEXIST);
        assert_eq!(
            Message::parse(&refused).unwrap().error(),
            Some(Ok(Some(Errno::EEXIST)))
        );
        // i32::MIN cannot be negated: no overflow, an unknown errno
        let weird = error(7, i32::MIN);
        assert!(matches!(
            Message::parse(&weird).unwrap().error(),
            Some(Ok(Some(_)))
        ));
        let short = header(18, NLMSG_ERROR, 1)
            .into_iter()
            .chain([0, 0])
            .collect::<Vec<_>>();
        assert_eq!(
            Message::parse(&short).unwrap().error(),
            Some(Err(Malformed::ShortError))
        );
        assert_eq!(Message::parse(&done()).unwrap().error(), None);
    }

    #[test]
    fn nfgenmsg_must_be_whole() {
        let m = Request::new(0x0100, 0, 0).raw(&[2, 0, 1]).finish().unwrap();
        assert_eq!(
            Message::parse(&m).unwrap().nfgenmsg().err(),
            Some(Malformed::NoNfgenmsg)
        );
        let m = Request::new(0x0100, 0, 0).nfgenmsg(2, 1).finish().unwrap();
        let (_, mut attrs) = Message::parse(&m).unwrap().nfgenmsg().unwrap();
        assert!(attrs.next().is_none());
    }

    #[test]
    fn dumps_end_at_done_or_at_the_kernels_error() {
        let entry = Request::new(0x0100, 2, 1).nfgenmsg(0, 0).finish().unwrap();
        let mut datagram = entry.clone();
        datagram.extend(error(1, 0)); // an ack inside a dump is skipped
        datagram.extend(&entry);
        let mut seen = 0;
        assert_eq!(read_dump(&datagram, |_| seen += 1), Ok(DumpProgress::More));
        assert_eq!(seen, 2);
        datagram.extend(done());
        datagram.extend(&entry); // after DONE: not read
        seen = 0;
        assert_eq!(read_dump(&datagram, |_| seen += 1), Ok(DumpProgress::Done));
        assert_eq!(seen, 2);
        let refused = [entry.clone(), error(1, -libc::EPERM)].concat();
        assert_eq!(
            read_dump(&refused, |_| {}),
            Err(DumpError::Refused(Errno::EPERM))
        );
        assert!(matches!(
            read_dump(&entry[..10], |_| {}),
            Err(DumpError::Malformed(_))
        ));
    }
}
