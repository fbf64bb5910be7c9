//! Raw 16-byte descriptor accesses in the driver's own shared memory.
//!
//! The device may read (and, for used descriptors, write) a descriptor while
//! the driver touches it, so every access is volatile and each byte is
//! accessed once. An aligned descriptor (the usual case: tables and rings
//! are 16-aligned) is moved as two little-endian 8-byte words, not as
//! sixteen byte accesses.

use std::ptr::{read_volatile, write_volatile};

/// Reads the descriptor at `p` as (bytes 0..8, bytes 8..16), each a
/// little-endian word.
///
/// # Safety
/// `p` must be valid for a 16-byte read.
#[inline(always)]
pub(crate) unsafe fn read16(p: *const u8) -> (u64, u64) {
    if (p as usize) & 7 == 0 {
        // SAFETY: 16 readable bytes (caller's guarantee), and `p` is 8-aligned
        // (checked), so both u64 loads are aligned and in bounds.
        unsafe { (u64::from_le(read_volatile(p as *const u64)), u64::from_le(read_volatile(p.add(8) as *const u64))) }
    } else {
        // SAFETY: 16 readable bytes (caller's guarantee); a byte array has
        // alignment 1.
        let b = unsafe { read_volatile(p as *const [u8; 16]) };
        let mut lo = [0u8; 8];
        let mut hi = [0u8; 8];
        lo.copy_from_slice(&b[..8]);
        hi.copy_from_slice(&b[8..]);
        (u64::from_le_bytes(lo), u64::from_le_bytes(hi))
    }
}

/// Writes the descriptor at `p` as two little-endian words, the layout
/// `read16` reads.
///
/// # Safety
/// `p` must be valid for a 16-byte write.
#[inline(always)]
pub(crate) unsafe fn write16(p: *mut u8, lo: u64, hi: u64) {
    if (p as usize) & 7 == 0 {
        // SAFETY: 16 writable bytes (caller's guarantee), and `p` is
        // 8-aligned (checked), so both u64 stores are aligned and in bounds.
        unsafe {
            write_volatile(p as *mut u64, lo.to_le());
            write_volatile(p.add(8) as *mut u64, hi.to_le());
        }
    } else {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&lo.to_le_bytes());
        b[8..].copy_from_slice(&hi.to_le_bytes());
        // SAFETY: 16 writable bytes (caller's guarantee); a byte array has
        // alignment 1.
        unsafe { write_volatile(p as *mut [u8; 16], b) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BYTES: [u8; 16] =
        [0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xcc, 0xbb, 0xaa, 0x99, 0xee, 0xdd, 0xf0, 0x0f];
    const WORDS: (u64, u64) = (0x1122_3344_5566_7788, 0x0ff0_ddee_99aa_bbcc);

    #[test]
    fn aligned_or_not_the_words_are_the_little_endian_bytes() {
        let mut buf = [0u64; 4];
        let base = buf.as_mut_ptr() as *mut u8;
        for off in [0usize, 1, 3, 8] {
            // SAFETY: off + 16 <= the 32 bytes of `buf`.
            let (read, written) = unsafe {
                std::ptr::copy_nonoverlapping(BYTES.as_ptr(), base.add(off), 16);
                let read = read16(base.add(off));
                std::ptr::write_bytes(base, 0, 32);
                write16(base.add(off), WORDS.0, WORDS.1);
                (read, std::slice::from_raw_parts(base.add(off), 16).to_vec())
            };
            assert_eq!(read, WORDS, "read at offset {off}");
            assert_eq!(written, BYTES, "written at offset {off}");
        }
    }
}
