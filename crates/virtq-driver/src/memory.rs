//! The driver's own memory: a shared mapping it makes itself (of a memfd, of
//! any file, or anonymous), and the guest-physical view of it the rings and
//! buffers are addressed in.
//!
//! Nothing here belongs to the device side: a device maps the same file
//! (`virtq::Mapping::map`) or is handed it over vhost-user, and sees the
//! same pages at its own addresses.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::os::unix::io::{AsRawFd, FromRawFd};
use std::sync::Arc;

/// One shared, read-write `mmap` owned by the driver. Unmapped on drop.
///
/// Every access goes through raw pointers (the device writes the same pages
/// concurrently), never through references to its bytes.
#[derive(Debug)]
pub struct SharedMemory {
    addr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; `addr` is only used to derive
// pointers into it, and stays valid until drop, which needs ownership.
unsafe impl Send for SharedMemory {}
// SAFETY: as above; concurrent access goes through raw pointers (volatile or
// atomic where the other side may write), never through references.
unsafe impl Sync for SharedMemory {}

/// Creates a memfd of `len` bytes (zeroed) named `name`, close-on-exec; with
/// `sealable` it is made with MFD_ALLOW_SEALING, so whoever it is handed to
/// can seal it against shrinking (QEMU's memfds allow it). Map it with
/// [`SharedMemory::map`]; hand it to the device to map the same pages.
pub fn memfd(name: &str, len: u64, sealable: bool) -> io::Result<File> {
    let name = CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in memfd name"))?;
    let flags = libc::MFD_CLOEXEC | if sealable { libc::MFD_ALLOW_SEALING } else { 0 };
    // SAFETY: `name` is a NUL-terminated string that outlives the call; no
    // other memory is passed.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create just returned this descriptor and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len)?;
    Ok(file)
}

impl SharedMemory {
    /// Maps `len` bytes of `file` from `offset` (a multiple of the page
    /// size), shared and read-write. Refuses a range past the end of a
    /// regular file (touching it would raise SIGBUS).
    pub fn map(file: &File, offset: u64, len: u64) -> io::Result<SharedMemory> {
        if len == 0 || len > isize::MAX as u64 || offset.checked_add(len).is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad mapping size"));
        }
        if !offset.is_multiple_of(page_size()) || offset > libc::off_t::MAX as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "mapping offset not page aligned"));
        }
        let meta = file.metadata()?;
        if meta.is_file() && offset + len > meta.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("[{offset:#x}, +{len:#x}) is past the end of the file ({:#x} bytes)", meta.len()),
            ));
        }
        // SAFETY: a new mapping at an address of the kernel's choice, so no
        // existing memory is affected; the arguments are checked above and
        // the result below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedMemory { addr: addr as *mut u8, len: len as usize })
    }

    /// `len` bytes of zeroed anonymous shared memory (inherited shared
    /// across fork; not shareable with another process otherwise: use a
    /// [`memfd`] for that).
    pub fn anonymous(len: usize) -> io::Result<SharedMemory> {
        if len == 0 || len > isize::MAX as usize {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad mapping size"));
        }
        // SAFETY: a fresh anonymous mapping at an address of the kernel's
        // choice; the result is checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedMemory { addr: addr as *mut u8, len })
    }

    /// Start of the mapping (valid for `len()` bytes while `self` lives).
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping (never built: both constructors refuse length 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: addr and len are exactly what mmap returned, and the
        // mapping is dropped once; pointers derived from it are only used by
        // holders of a reference (or Arc) to it, so none is used after this.
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len);
        }
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf reads a system constant and touches no memory of ours.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

/// Hints the CPU to fetch the cache line at `p` for reading. Never faults,
/// whatever `p` is (an address outside any mapping is simply not fetched).
#[inline(always)]
pub fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it neither faults nor changes any
    // architectural state, whatever the address; SSE is part of the x86_64
    // baseline. (The intrinsic is a safe fn on newer compilers.)
    #[allow(unused_unsafe)]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The memory a driver owns and shares with the device: one mapping whose
/// byte at `offset` the device sees at guest-physical `gpa_base + offset`.
#[derive(Clone, Debug)]
pub struct DriverMemory {
    mapping: Arc<SharedMemory>,
    gpa_base: u64,
}

impl DriverMemory {
    /// `mapping` seen by the device at guest-physical `gpa_base`.
    pub fn new(mapping: Arc<SharedMemory>, gpa_base: u64) -> DriverMemory {
        DriverMemory { mapping, gpa_base }
    }

    /// The mapping.
    pub fn mapping(&self) -> &Arc<SharedMemory> {
        &self.mapping
    }

    /// Guest-physical address of the first byte.
    pub fn gpa_base(&self) -> u64 {
        self.gpa_base
    }

    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.mapping.len() as u64
    }

    /// True for an empty mapping.
    pub fn is_empty(&self) -> bool {
        self.mapping.is_empty()
    }

    /// Host pointer of `len` bytes at `gpa`, if they are all inside.
    #[inline]
    pub fn host(&self, gpa: u64, len: u64) -> Option<*mut u8> {
        let off = gpa.checked_sub(self.gpa_base)?;
        if off > self.len() || len > self.len() - off {
            return None;
        }
        // SAFETY: off <= mapping length (checked above), so the result is
        // inside the mapping or one past its end.
        Some(unsafe { self.mapping.as_ptr().add(off as usize) })
    }

    /// Guest-physical address of a host pointer into the mapping.
    pub fn gpa_of(&self, host: *const u8) -> Option<u64> {
        let off = (host as usize).checked_sub(self.mapping.as_ptr() as usize)?;
        (off < self.mapping.len()).then(|| self.gpa_base + off as u64)
    }

    /// Copies `data` to `gpa`; false if it does not fit.
    pub fn write(&self, gpa: u64, data: &[u8]) -> bool {
        match self.host(gpa, data.len() as u64) {
            Some(p) => {
                // SAFETY: `p` has room for data.len() bytes (checked by
                // `host`); `data` is private memory, so they cannot overlap.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
                true
            }
            None => false,
        }
    }

    /// Copies from `gpa` into `out`; false if the range is not inside.
    pub fn read(&self, gpa: u64, out: &mut [u8]) -> bool {
        match self.host(gpa, out.len() as u64) {
            Some(p) => {
                // SAFETY: `p` has out.len() readable bytes (checked by `host`);
                // `out` is private memory, so they cannot overlap.
                unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
                true
            }
            None => false,
        }
    }
}

/// Bytes of shared memory the device may write at any time: it returned
/// the buffer, but a hostile device can still write it. Not a `&[u8]`,
/// whose bytes the compiler may assume stay put: they are only copied out.
/// Copies are plain `copy_nonoverlapping`, as `DriverMemory::read` and the
/// device side's guest memory copies are: each byte is read once, into
/// memory of our own, so what the device does meanwhile can only change
/// which values arrive.
#[derive(Clone, Copy)]
pub struct SharedBytes<'a> {
    ptr: *const u8,
    len: usize,
    _mem: PhantomData<&'a SharedMemory>,
}

impl<'a> SharedBytes<'a> {
    /// The `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` is non-null and valid for reads of `len` bytes for `'a`: in one
    /// mapping that stays mapped, or private memory that stays allocated
    /// and that nothing in this process writes or borrows mutably meanwhile.
    /// (The device side writing them is why this is not a `&[u8]`.)
    #[inline]
    pub unsafe fn new(ptr: *const u8, len: usize) -> SharedBytes<'a> {
        SharedBytes { ptr, len, _mem: PhantomData }
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes in `range`, if inside.
    #[inline]
    pub fn slice(&self, range: std::ops::Range<usize>) -> Option<SharedBytes<'a>> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        // SAFETY: start <= end <= len: a part of the bytes (see `new`).
        Some(unsafe { SharedBytes::new(self.ptr.add(range.start), range.end - range.start) })
    }

    /// Copies the first `out.len()` bytes (fewer if there are fewer) into
    /// `out`; returns how many.
    #[inline]
    pub fn copy_to(&self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.len);
        // SAFETY: n bytes inside both; `out` is private memory, so they
        // cannot overlap. What the device writes meanwhile only changes
        // which bytes arrive (any value is a valid u8).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), n) };
        n
    }

    /// Appends a copy of the bytes to `v`.
    #[inline]
    pub fn append_to(&self, v: &mut Vec<u8>) {
        v.reserve(self.len);
        let at = v.len();
        // SAFETY: `reserve` made room for len more bytes after `at`, in
        // `v`'s own allocation (private, so no overlap); they are all
        // written before `set_len` counts them, and any value is a valid u8.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr, v.as_mut_ptr().add(at), self.len);
            v.set_len(at + self.len);
        }
    }

    /// A copy of the bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len);
        self.append_to(&mut v);
        v
    }
}

impl<'a> From<&'a [u8]> for SharedBytes<'a> {
    /// Private bytes seen the same way (tests, bounce buffers).
    fn from(b: &'a [u8]) -> SharedBytes<'a> {
        // SAFETY: a live slice, borrowed for 'a.
        unsafe { SharedBytes::new(b.as_ptr(), b.len()) }
    }
}

impl std::fmt::Debug for SharedBytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({} bytes at {:p})", self.len, self.ptr)
    }
}

/// A buffer in shared memory the driver fills before handing it to the
/// device. The device should not touch it meanwhile, but may (a hostile
/// one would): so, like `SharedBytes`, not a `&mut [u8]`; bytes are only
/// copied in.
pub struct SharedBytesMut<'a> {
    ptr: *mut u8,
    len: usize,
    _mem: PhantomData<&'a SharedMemory>,
}

impl<'a> SharedBytesMut<'a> {
    /// The `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` is non-null and valid for writes of `len` bytes for `'a`: in
    /// one mapping that stays mapped and writable, or private memory that
    /// stays allocated; nothing in this process borrows them meanwhile.
    #[inline]
    pub unsafe fn new(ptr: *mut u8, len: usize) -> SharedBytesMut<'a> {
        SharedBytesMut { ptr, len, _mem: PhantomData }
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` in at byte `at`; false (and nothing written) if it
    /// does not fit.
    #[inline]
    pub fn write_at(&mut self, at: usize, src: &[u8]) -> bool {
        if at > self.len || src.len() > self.len - at {
            return false;
        }
        // SAFETY: at + src.len() <= len: inside the bytes (see `new`);
        // `src` is private memory, so they cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(at), src.len()) };
        true
    }

    /// Copies `src`, itself in shared memory, in at byte `at`; false (and
    /// nothing written) if it does not fit.
    #[inline]
    pub fn write_shared_at(&mut self, at: usize, src: SharedBytes) -> bool {
        if at > self.len || src.len > self.len - at {
            return false;
        }
        // SAFETY: at + src.len <= len: inside these bytes; src.len bytes
        // readable at src.ptr (see `SharedBytes::new`). `copy` allows the
        // two ranges to overlap (both may be in the same mapping).
        unsafe { std::ptr::copy(src.ptr, self.ptr.add(at), src.len) };
        true
    }

    /// Sets every byte to `byte`.
    #[inline]
    pub fn fill(&mut self, byte: u8) {
        // SAFETY: len bytes inside (see `new`).
        unsafe { std::ptr::write_bytes(self.ptr, byte, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_bounds() {
        let m = Arc::new(SharedMemory::anonymous(4096).unwrap());
        let mem = DriverMemory::new(m, 0x1000);
        assert!(mem.host(0x1000, 4096).is_some());
        assert!(mem.host(0x1fff, 2).is_none());
        assert!(mem.host(0xfff, 1).is_none());
        assert!(mem.host(u64::MAX, 2).is_none());
        assert!(mem.write(0x1ffe, &[1, 2]));
        let mut b = [0u8; 2];
        assert!(mem.read(0x1ffe, &mut b));
        assert_eq!(b, [1, 2]);
        let p = mem.host(0x1800, 1).unwrap();
        assert_eq!(mem.gpa_of(p), Some(0x1800));
        assert_eq!(mem.gpa_of(mem.mapping().as_ptr().wrapping_add(4096)), None);
    }

    #[test]
    fn two_mappings_of_a_memfd_share_their_pages() {
        let f = memfd("virtq-driver-test", 2 * 4096, true).unwrap();
        let a = DriverMemory::new(Arc::new(SharedMemory::map(&f, 0, 2 * 4096).unwrap()), 0);
        let b = DriverMemory::new(Arc::new(SharedMemory::map(&f, 4096, 4096).unwrap()), 4096);
        assert_ne!(a.host(4096, 1), b.host(4096, 1), "two mappings");
        assert!(a.write(4100, b"shared"));
        let mut out = [0u8; 6];
        assert!(b.read(4100, &mut out));
        assert_eq!(&out, b"shared");
    }

    #[test]
    fn bad_mappings_are_refused() {
        let f = memfd("virtq-driver-test", 4096, false).unwrap();
        assert!(SharedMemory::map(&f, 0, 0).is_err(), "empty");
        assert!(SharedMemory::map(&f, 0, 8192).is_err(), "past the end of the file");
        assert!(SharedMemory::map(&f, 100, 1).is_err(), "offset not page aligned");
        assert!(SharedMemory::map(&f, !4095, 4096).is_err(), "offset + len overflows");
        assert!(SharedMemory::anonymous(0).is_err());
        assert!(memfd("nul\0inside", 4096, false).is_err());
    }

    #[test]
    fn prefetch_takes_any_address() {
        prefetch(std::ptr::null());
        prefetch(usize::MAX as *const u8);
    }

    #[test]
    fn shared_bytes_copy_in_and_out_within_bounds() {
        let m = SharedMemory::anonymous(4096).unwrap();
        // SAFETY: 16 bytes inside the mapping, which outlives both.
        let mut w = unsafe { SharedBytesMut::new(m.as_ptr().add(100), 16) };
        w.fill(0xa5);
        assert!(w.write_at(14, &[1, 2]));
        assert!(!w.write_at(15, &[1, 2]), "past the end");
        assert!(!w.write_at(usize::MAX, &[]), "at past the end");
        assert!(w.write_at(0, &[9]));
        assert!(w.write_shared_at(1, SharedBytes::from(&[0u8; 15][..])));
        assert!(!w.write_shared_at(2, SharedBytes::from(&[0u8; 15][..])), "past the end");
        // SAFETY: as above.
        let r = unsafe { SharedBytes::new(m.as_ptr().add(100), 16) };
        assert_eq!(r.to_vec(), [9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        // SAFETY: as above.
        let r = unsafe { SharedBytes::new(m.as_ptr().add(99), 4) };
        let mut out = [7u8; 8];
        assert_eq!(r.copy_to(&mut out), 4);
        assert_eq!(out, [0, 9, 0, 0, 7, 7, 7, 7]);
        assert_eq!(r.slice(1..3).map(|s| s.to_vec()), Some(vec![9, 0]));
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 3..2;
        assert!(r.slice(3..5).is_none() && r.slice(backwards).is_none());
        let mut v = vec![1];
        SharedBytes::from(&[2u8, 3][..]).append_to(&mut v);
        assert_eq!(v, [1, 2, 3]);
    }
}
