//! Netlink attributes (`struct nlattr`): a 4-byte header (length, type) then the value,
//! padded to 4 bytes. The type's top two bits are flags (NLA_F_NESTED, NLA_F_NET_BYTEORDER),
//! which kernels set or not as they please: lookups compare the type without them.

use super::bytes::{align4, ne16};
use super::message::Malformed;

/// Bytes of `struct nlattr`.
pub const NLA_HDRLEN: usize = 4;
pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_F_NET_BYTEORDER: u16 = 0x4000;
pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);

/// One attribute, borrowed from its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    /// The type without its flag bits.
    pub kind: u16,
    /// The type's flag bits as they came.
    pub flags: u16,
    /// The value, without header or padding.
    pub value: &'a [u8],
}

impl<'a> Attr<'a> {
    pub fn is_nested(&self) -> bool {
        self.flags & NLA_F_NESTED != 0
    }

    /// The attributes inside this one. Whether the kernel set NLA_F_NESTED is not checked:
    /// older subsystems (conntrack among them) do not always.
    pub fn nested(&self) -> Attrs<'a> {
        Attrs::new(self.value)
    }

    /// A string value up to its NUL terminator (or its end), invalid UTF-8 replaced.
    pub fn string(&self) -> String {
        let end = self
            .value
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.value.len());
        String::from_utf8_lossy(&self.value[..end]).into_owned()
    }
}

/// The attributes of a message or of a nested attribute, in order. An attribute whose length
/// is shorter than its header or runs past its container yields one error and ends the walk;
/// fewer than [`NLA_HDRLEN`] bytes left over (padding) end it quietly.
#[derive(Debug, Clone)]
pub struct Attrs<'a> {
    rest: &'a [u8],
}

impl<'a> Attrs<'a> {
    pub fn new(bytes: &'a [u8]) -> Attrs<'a> {
        Attrs { rest: bytes }
    }

    /// The first attribute of type `kind`, if one comes before the end or before anything
    /// malformed.
    pub fn find(self, kind: u16) -> Option<Attr<'a>> {
        self.map_while(Result::ok).find(|a| a.kind == kind)
    }

    /// The value of the first attribute of type `kind` (see [`Attrs::find`]).
    pub fn value(self, kind: u16) -> Option<&'a [u8]> {
        self.find(kind).map(|a| a.value)
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<Attr<'a>, Malformed>;

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.rest;
        let (len, kind) = (ne16(rest, 0)?, ne16(rest, 2)?);
        let len = usize::from(len);
        let value = if len >= NLA_HDRLEN {
            rest.get(NLA_HDRLEN..len)
        } else {
            None
        };
        let Some(value) = value else {
            self.rest = &[];
            return Some(Err(Malformed::Attribute {
                kind: kind & NLA_TYPE_MASK,
                len,
                remaining: rest.len(),
            }));
        };
        self.rest = rest.get(align4(len)..).unwrap_or_default();
        Some(Ok(Attr {
            kind: kind & NLA_TYPE_MASK,
            flags: kind & !NLA_TYPE_MASK,
            value,
        }))
    }
}

/// The header of an attribute of `len` bytes (header included).
pub(super) fn header(len: u16, kind: u16) -> [u8; NLA_HDRLEN] {
    let [a, b] = len.to_ne_bytes();
    let [c, d] = kind.to_ne_bytes();
    [a, b, c, d]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(len: u16, kind: u16, value: &[u8]) -> Vec<u8> {
        let mut a = header(len, kind).to_vec();
        a.extend_from_slice(value);
        a.resize(align4(a.len()), 0);
        a
    }

    fn good(kind: u16, value: &[u8]) -> Vec<u8> {
        raw((NLA_HDRLEN + value.len()) as u16, kind, value)
    }

    #[test]
    fn values_flags_and_padding() {
        let bytes = [
            good(1, b"egress_fence\0"),
            good(2 | NLA_F_NET_BYTEORDER, &[0, 80]),
            good(3, &[]),
        ]
        .concat();
        let all: Vec<_> = Attrs::new(&bytes).map(Result::unwrap).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0].string(), "egress_fence");
        assert_eq!((all[1].kind, all[1].flags), (2, NLA_F_NET_BYTEORDER));
        assert_eq!(all[1].value, &[0, 80]);
        assert_eq!(all[2].value, &[] as &[u8]);
        assert_eq!(Attrs::new(&bytes).value(2), Some(&[0, 80][..]));
        assert_eq!(Attrs::new(&bytes).value(9), None);
        // Trailing bytes shorter than a header are padding, not an error.
        let mut padded = bytes.clone();
        padded.extend_from_slice(&[0, 0]);
        assert_eq!(Attrs::new(&padded).filter(Result::is_err).count(), 0);
    }

    #[test]
    fn lengths_shorter_than_the_header_or_past_the_end_are_errors() {
        for len in [0u16, 1, 3] {
            let bytes = [raw(len, 1, &[1, 2, 3, 4]), good(2, &[5])].concat();
            let all: Vec<_> = Attrs::new(&bytes).collect();
            assert!(
                matches!(all.as_slice(), [Err(Malformed::Attribute { .. })]),
                "{len}"
            );
            assert_eq!(Attrs::new(&bytes).value(2), None, "no walking past it");
        }
        let past = raw(9, 1, &[1, 2, 3, 4]);
        assert!(matches!(
            Attrs::new(&past).next(),
            Some(Err(Malformed::Attribute {
                kind: 1,
                len: 9,
                remaining: 8
            }))
        ));
        // The last attribute's padding may be missing: its length is what counts.
        let unpadded = &good(1, &[7])[..5];
        assert_eq!(Attrs::new(unpadded).value(1), Some(&[7][..]));
    }

    #[test]
    fn nested_overruns_stay_inside_their_container() {
        // The inner attribute claims more than its container holds, though the message
        // has more bytes after the container: it must not reach them.
        let inner = raw(12, 2, &[1, 2, 3, 4]);
        let outer = [raw(8, 1 | NLA_F_NESTED, &inner[..4]), good(3, &[9; 8])].concat();
        let first = Attrs::new(&outer).next().unwrap().unwrap();
        assert!(first.is_nested());
        assert!(matches!(
            first.nested().next(),
            Some(Err(Malformed::Attribute { .. }))
        ));
        assert_eq!(Attrs::new(&outer).value(3), Some(&[9; 8][..]));
        // Deep nesting of empty containers ends.
        let mut deep = good(5, &[]);
        for _ in 0..50 {
            deep = good(1 | NLA_F_NESTED, &deep);
        }
        let mut depth = 0;
        let mut attr = Attrs::new(&deep).next().unwrap().unwrap();
        while let Some(Ok(inner)) = attr.nested().next() {
            attr = inner;
            depth += 1;
        }
        assert_eq!((depth, attr.kind), (50, 5));
    }

    #[test]
    fn garbage_never_panics() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..3000 {
            let len = (x % 64) as usize;
            let soup: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            for a in Attrs::new(&soup).map_while(Result::ok) {
                let _ = a.nested().count();
                let _ = a.string();
            }
        }
    }
}
