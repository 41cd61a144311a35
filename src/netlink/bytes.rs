//! Bounds-checked reads of fixed-width integers from untrusted bytes: `None` when the bytes
//! end before the integer does. Netlink headers and attribute headers are in host order
//! (`ne`); most netfilter attribute values and every packet header are big-endian (`be`).

fn array<const N: usize>(b: &[u8], at: usize) -> Option<[u8; N]> {
    b.get(at..at.checked_add(N)?)?.try_into().ok()
}

pub fn ne16(b: &[u8], at: usize) -> Option<u16> {
    array(b, at).map(u16::from_ne_bytes)
}

pub fn ne32(b: &[u8], at: usize) -> Option<u32> {
    array(b, at).map(u32::from_ne_bytes)
}

pub fn be16(b: &[u8], at: usize) -> Option<u16> {
    array(b, at).map(u16::from_be_bytes)
}

pub fn be32(b: &[u8], at: usize) -> Option<u32> {
    array(b, at).map(u32::from_be_bytes)
}

pub fn be64(b: &[u8], at: usize) -> Option<u64> {
    array(b, at).map(u64::from_be_bytes)
}

/// Netlink pads every message and attribute to 4 bytes.
pub fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_stop_at_the_end_of_the_bytes() {
        let b = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(be16(&b, 0), Some(0x0102));
        assert_eq!(be32(&b, 4), Some(0x0506_0708));
        assert_eq!(be64(&b, 0), Some(0x0102_0304_0506_0708));
        assert_eq!(ne16(&b, 6), Some(u16::from_ne_bytes([7, 8])));
        assert_eq!(ne32(&b, 5), None);
        assert_eq!(be16(&b, 7), None);
        assert_eq!(be64(&b, 1), None);
        assert_eq!(ne16(&b, usize::MAX), None);
        assert_eq!(be16(&[], 0), None);
    }

    #[test]
    fn alignment() {
        assert_eq!([0, 1, 3, 4, 5, 8].map(align4), [0, 4, 4, 4, 8, 8]);
        assert_eq!(align4(usize::MAX), usize::MAX & !3);
    }
}
