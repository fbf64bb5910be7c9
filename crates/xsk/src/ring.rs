//! The four AF_XDP rings. Each is a power-of-two array of descriptors plus
//! a producer and a consumer word shared with the kernel. A side keeps a
//! cached copy of the other side's word and re-reads it (acquire) only when
//! the cache says the ring is full (producer) or empty (consumer); its own
//! word is published with a release store once per batch.

use std::io;
use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};

/// The mapping of one ring.
struct Mapping {
    base: *mut u8,
    len: usize,
    producer: *const AtomicU32,
    consumer: *const AtomicU32,
    flags: *const AtomicU32,
}

impl Mapping {
    /// Maps a ring of `size` descriptors of `T` at page offset `pgoff` of
    /// the socket, laid out as `off` says.
    fn new<T>(fd: RawFd, pgoff: u64, off: &libc::xdp_ring_offset, size: u32) -> io::Result<Mapping> {
        let len = off.desc as usize + size as usize * std::mem::size_of::<T>();
        // SAFETY: maps the ring the kernel set up for this socket; the
        // result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd,
                pgoff as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = p.cast::<u8>();
        // SAFETY: the kernel's offsets lie inside the mapping it sized
        // (desc is last); the words are 4-byte aligned u32s.
        unsafe {
            Ok(Mapping {
                base,
                len,
                producer: base.add(off.producer as usize).cast(),
                consumer: base.add(off.consumer as usize).cast(),
                flags: base.add(off.flags as usize).cast(),
            })
        }
    }

    fn descs<T>(&self, off: &libc::xdp_ring_offset) -> *mut T {
        // SAFETY: desc is inside the mapping (see new).
        unsafe { self.base.add(off.desc as usize).cast() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: base/len are exactly the mapping made in new().
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// A ring userspace produces into (fill, TX).
pub struct ProdRing<T> {
    map: Mapping,
    descs: *mut T,
    mask: u32,
    size: u32,
    /// Our producer index (published on submit).
    prod: u32,
    /// The kernel's consumer index, as last read.
    cached_cons: u32,
}

/// A ring userspace consumes from (RX, completion).
pub struct ConsRing<T> {
    map: Mapping,
    descs: *const T,
    mask: u32,
    /// Our consumer index (published on release).
    cons: u32,
    /// The kernel's producer index, as last read.
    cached_prod: u32,
}

// SAFETY: a ring is used by one thread at a time (its owner); the mapping
// moves with it.
unsafe impl<T: Send> Send for ProdRing<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for ConsRing<T> {}

impl<T: Copy> ProdRing<T> {
    /// Maps a producer ring (see `Mapping::new`).
    pub(crate) fn map(fd: RawFd, pgoff: u64, off: &libc::xdp_ring_offset, size: u32) -> io::Result<Self> {
        let map = Mapping::new::<T>(fd, pgoff, off, size)?;
        let descs = map.descs::<T>(off);
        // SAFETY: the words are inside the live mapping.
        let (prod, cons) =
            unsafe { ((*map.producer).load(Ordering::Relaxed), (*map.consumer).load(Ordering::Acquire)) };
        Ok(ProdRing { map, descs, mask: size - 1, size, prod, cached_cons: cons })
    }

    /// Free slots, re-reading the kernel's consumer only if fewer than `want`.
    #[inline]
    pub fn free(&mut self, want: u32) -> u32 {
        let free = self.size - self.prod.wrapping_sub(self.cached_cons);
        if free >= want {
            return free;
        }
        // SAFETY: the consumer word is inside the live mapping.
        self.cached_cons = unsafe { (*self.map.consumer).load(Ordering::Acquire) };
        self.size - self.prod.wrapping_sub(self.cached_cons)
    }

    /// Writes descriptor `i` (0-based) past the producer index. The caller
    /// has checked `i < free()`.
    #[inline]
    pub fn write(&mut self, i: u32, d: T) {
        let idx = (self.prod.wrapping_add(i) & self.mask) as usize;
        // SAFETY: idx <= mask < size: inside the descriptor array; the slot
        // is free (the kernel consumed it), so the kernel does not read it.
        unsafe { self.descs.add(idx).write(d) };
    }

    /// Publishes `n` written descriptors.
    #[inline]
    pub fn submit(&mut self, n: u32) {
        self.prod = self.prod.wrapping_add(n);
        // SAFETY: the producer word is inside the live mapping. Release:
        // the descriptors written before are visible first.
        unsafe { (*self.map.producer).store(self.prod, Ordering::Release) };
    }

    /// The kernel asks to be woken (a syscall) to process this ring.
    #[inline]
    pub fn needs_wakeup(&self) -> bool {
        // SAFETY: the flags word is inside the live mapping.
        unsafe { (*self.map.flags).load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0 }
    }

    /// Ring size.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The kernel's consumer word: for tests that stand in for a kernel
    /// which has not yet published what it consumed.
    #[cfg(feature = "test-hooks")]
    pub fn shared_consumer(&self) -> &AtomicU32 {
        // SAFETY: an aligned u32 inside the mapping, which lives as long as self.
        unsafe { &*self.map.consumer }
    }
}

impl<T: Copy> ConsRing<T> {
    /// Maps a consumer ring (see `Mapping::new`).
    pub(crate) fn map(fd: RawFd, pgoff: u64, off: &libc::xdp_ring_offset, size: u32) -> io::Result<Self> {
        let map = Mapping::new::<T>(fd, pgoff, off, size)?;
        let descs = map.descs::<T>(off);
        // SAFETY: the words are inside the live mapping.
        let (prod, cons) =
            unsafe { ((*map.producer).load(Ordering::Acquire), (*map.consumer).load(Ordering::Relaxed)) };
        Ok(ConsRing { map, descs, mask: size - 1, cons, cached_prod: prod })
    }

    /// Descriptors ready, re-reading the kernel's producer only if fewer than `want`.
    #[inline]
    pub fn ready(&mut self, want: u32) -> u32 {
        let n = self.cached_prod.wrapping_sub(self.cons);
        if n >= want {
            return n;
        }
        // SAFETY: the producer word is inside the live mapping. Acquire:
        // the descriptors it covers are visible after.
        self.cached_prod = unsafe { (*self.map.producer).load(Ordering::Acquire) };
        self.cached_prod.wrapping_sub(self.cons)
    }

    /// Descriptor `i` (0-based) past the consumer index; `i < ready()`.
    #[inline]
    pub fn read(&self, i: u32) -> T {
        let idx = (self.cons.wrapping_add(i) & self.mask) as usize;
        // SAFETY: idx <= mask: inside the descriptor array; the kernel
        // produced it and does not write it until we release it.
        unsafe { self.descs.add(idx).read() }
    }

    /// Gives `n` descriptors back to the kernel.
    #[inline]
    pub fn release(&mut self, n: u32) {
        self.cons = self.cons.wrapping_add(n);
        // SAFETY: the consumer word is inside the live mapping. Release:
        // our reads of the descriptors happen before the kernel reuses them.
        unsafe { (*self.map.consumer).store(self.cons, Ordering::Release) };
    }
}
