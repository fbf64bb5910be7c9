//! Ring layout constants shared by the device and driver sides
//! (virtio 1.2, sections 2.7 split and 2.8 packed).

/// Feature bits this crate understands.
pub mod features {
    /// VIRTIO_F_INDIRECT_DESC
    pub const INDIRECT_DESC: u64 = 1 << 28;
    /// VIRTIO_F_EVENT_IDX
    pub const EVENT_IDX: u64 = 1 << 29;
    /// VIRTIO_F_VERSION_1
    pub const VERSION_1: u64 = 1 << 32;
    /// VIRTIO_F_IN_ORDER: buffers are used in the order they were made available.
    pub const IN_ORDER: u64 = 1 << 35;
    /// VIRTIO_F_RING_PACKED
    pub const RING_PACKED: u64 = 1 << 34;
}

/// Descriptor flag: the chain continues in `next`.
pub const VRING_DESC_F_NEXT: u16 = 1;
/// Descriptor flag: the buffer is device-writable.
pub const VRING_DESC_F_WRITE: u16 = 2;
/// Descriptor flag: the buffer holds an indirect descriptor table.
pub const VRING_DESC_F_INDIRECT: u16 = 4;
/// avail.flags: the driver asks for no interrupt (only meaningful without EVENT_IDX).
pub const VRING_AVAIL_F_NO_INTERRUPT: u16 = 1;
/// used.flags: the device asks for no kick (only meaningful without EVENT_IDX).
pub const VRING_USED_F_NO_NOTIFY: u16 = 1;

/// Packed ring descriptor flag: available when equal to the driver's wrap counter.
pub const VRING_PACKED_DESC_F_AVAIL: u16 = 1 << 7;
/// Packed ring descriptor flag: used when equal to the device's wrap counter.
pub const VRING_PACKED_DESC_F_USED: u16 = 1 << 15;
/// Packed event suppression: events enabled.
pub const RING_EVENT_FLAGS_ENABLE: u16 = 0;
/// Packed event suppression: events disabled.
pub const RING_EVENT_FLAGS_DISABLE: u16 = 1;
/// Packed event suppression: an event only for the descriptor at off_wrap (EVENT_IDX).
pub const RING_EVENT_FLAGS_DESC: u16 = 2;

/// Size in bytes of one descriptor.
pub const DESC_SIZE: u64 = 16;
/// Largest queue size the split ring allows.
pub const MAX_QUEUE_SIZE: u16 = 32768;

/// Descriptor table size for a queue of `n` entries.
pub fn desc_table_size(n: u16) -> u64 {
    DESC_SIZE * n as u64
}
/// Available ring size (flags, idx, ring[n], used_event).
pub fn avail_ring_size(n: u16) -> u64 {
    6 + 2 * n as u64
}
/// Used ring size (flags, idx, ring[n] of {id,len}, avail_event).
pub fn used_ring_size(n: u16) -> u64 {
    6 + 8 * n as u64
}

/// The spec's `vring_need_event`: should an event be sent given the other
/// side asked to hear about index `event`, and the index moved from `old` to `new`?
#[inline]
pub fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// Reads the 16 bytes of a descriptor at `p` once, as two little-endian
/// words: (addr, then len | id-or-flags << 32 | flags-or-next << 48).
///
/// The guest may rewrite a descriptor while we read it, so each byte must be
/// read exactly once (volatile). Two 8-byte loads instead of one
/// `[u8; 16]` volatile load, which compiles to sixteen byte loads and the
/// shifts to reassemble them: that cost 10 % of the packed RX pass.
///
/// # Safety
/// `p` must be valid for a 16-byte read.
#[inline(always)]
pub unsafe fn read_desc_words(p: *const u8) -> (u64, u64) {
    if (p as usize).is_multiple_of(8) {
        // SAFETY: 16 readable bytes (caller) and 8-byte alignment (checked).
        unsafe {
            (
                u64::from_le(std::ptr::read_volatile(p as *const u64)),
                u64::from_le(std::ptr::read_volatile(p.add(8) as *const u64)),
            )
        }
    } else {
        // Rings are 16-aligned, and tables are checked to be; this is for
        // callers that cannot know.
        // SAFETY: 16 readable bytes (caller); [u8; 16] has alignment 1.
        let raw = unsafe { std::ptr::read_volatile(p as *const [u8; 16]) };
        let (a, b) = raw.split_at(8);
        (u64::from_le_bytes(a.try_into().unwrap_or_default()), u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
}

/// Writes a descriptor's 16 bytes as two little-endian words, the layout
/// `read_desc_words` reads; the driver side's twin of it, for the same
/// reason (a `[u8; 16]` volatile store compiles to sixteen byte stores).
///
/// # Safety
/// `p` must be valid for a 16-byte write.
#[inline(always)]
pub unsafe fn write_desc_words(p: *mut u8, lo: u64, hi: u64) {
    if (p as usize).is_multiple_of(8) {
        // SAFETY: 16 writable bytes (caller) and 8-byte alignment (checked).
        unsafe {
            std::ptr::write_volatile(p as *mut u64, lo.to_le());
            std::ptr::write_volatile(p.add(8) as *mut u64, hi.to_le());
        }
    } else {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&lo.to_le_bytes());
        raw[8..].copy_from_slice(&hi.to_le_bytes());
        // SAFETY: 16 writable bytes (caller); [u8; 16] has alignment 1.
        unsafe { std::ptr::write_volatile(p as *mut [u8; 16], raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_words_read_the_same_aligned_or_not() {
        // addr 0x1122334455667788, len 0x99aabbcc, flags 0xddee, next 0x0ff0
        let desc: [u8; 16] =
            [0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xcc, 0xbb, 0xaa, 0x99, 0xee, 0xdd, 0xf0, 0x0f];
        let mut buf = [0u64; 4];
        let base = buf.as_mut_ptr() as *mut u8;
        for off in [0usize, 1, 3, 8] {
            // SAFETY: off + 16 <= 32 bytes of `buf`.
            let words = unsafe {
                std::ptr::copy_nonoverlapping(desc.as_ptr(), base.add(off), 16);
                read_desc_words(base.add(off))
            };
            assert_eq!(words, (0x1122_3344_5566_7788, 0x0ff0_ddee_99aa_bbcc), "offset {off}");
        }
    }

    #[test]
    fn descriptor_words_write_the_bytes_they_read_aligned_or_not() {
        let mut buf = [0u64; 4];
        let base = buf.as_mut_ptr() as *mut u8;
        for off in [0usize, 1, 3, 8] {
            // SAFETY: off + 16 <= 32 bytes of `buf`.
            let bytes = unsafe {
                write_desc_words(base.add(off), 0x1122_3344_5566_7788, 0x0ff0_ddee_99aa_bbcc);
                std::slice::from_raw_parts(base.add(off), 16).to_vec()
            };
            assert_eq!(
                bytes,
                [0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xcc, 0xbb, 0xaa, 0x99, 0xee, 0xdd, 0xf0, 0x0f],
                "offset {off}"
            );
        }
    }
}
