//! The UMEM: anonymous memory split into `FRAME_SIZE` frames, addressed by
//! byte offset (what the rings carry).

use std::io;
use std::ptr::NonNull;

/// Packet memory shared with the kernel through a socket's XDP_UMEM_REG.
pub struct Umem {
    base: NonNull<u8>,
    len: usize,
    frame_size: usize,
}

// SAFETY: the mapping is owned by this value alone; the kernel writes frames
// only while userspace has handed them over through the rings.
unsafe impl Send for Umem {}

impl Umem {
    /// Maps `frames` frames of `frame_size` bytes (a power of two, at least
    /// 2048), populated up front so the first packets take no page faults.
    pub fn new(frames: usize, frame_size: usize) -> io::Result<Umem> {
        if !frame_size.is_power_of_two() || frame_size < 2048 || frames == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "UMEM frame size must be a power of two >= 2048"));
        }
        let len = frames
            .checked_mul(frame_size)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "UMEM too large"))?;
        // SAFETY: anonymous private mapping of len bytes; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(Umem { base, len, frame_size })
    }

    /// Start of the memory.
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty (`new` refuses zero frames).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes per frame.
    pub fn frame_size(&self) -> usize {
        self.frame_size
    }

    /// Number of frames.
    pub fn frames(&self) -> usize {
        self.len / self.frame_size
    }

    /// The address (offset) of frame `i`.
    pub fn frame_addr(&self, i: usize) -> u64 {
        (i * self.frame_size) as u64
    }

    /// The start of the frame holding `addr` (descriptors from the kernel
    /// point past the headroom).
    pub fn frame_base(&self, addr: u64) -> u64 {
        addr & !(self.frame_size as u64 - 1)
    }

    /// A pointer to `len` bytes at `addr`, if they lie inside one frame.
    pub fn slice_ptr(&self, addr: u64, len: usize) -> Option<NonNull<u8>> {
        let addr = usize::try_from(addr).ok()?;
        let end = addr.checked_add(len)?;
        let frame_end = (addr & !(self.frame_size - 1)) + self.frame_size;
        if end > self.len || end > frame_end {
            return None;
        }
        // SAFETY: addr < len (end <= len), so the offset stays in the mapping.
        NonNull::new(unsafe { self.base.as_ptr().add(addr) })
    }
}

impl Drop for Umem {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly the mapping made in new().
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_stay_inside_one_frame() {
        let u = Umem::new(4, 4096).unwrap();
        assert_eq!(u.frames(), 4);
        assert!(u.slice_ptr(0, 4096).is_some());
        assert!(u.slice_ptr(4096 + 256, 3840).is_some());
        assert!(u.slice_ptr(4096 + 256, 3841).is_none(), "crosses into the next frame");
        assert!(u.slice_ptr(3 * 4096, 4097).is_none());
        assert!(u.slice_ptr(4 * 4096, 1).is_none());
        assert!(u.slice_ptr(u64::MAX, 1).is_none());
        assert_eq!(u.frame_base(4096 + 300), 4096);
        assert!(Umem::new(4, 3000).is_err());
    }
}
