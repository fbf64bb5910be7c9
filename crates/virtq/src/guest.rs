//! The fence around guest memory. This module owns every raw pointer into
//! memory a guest (or a frontend) shares with vhostd; nothing else on the
//! device side dereferences one (the driver side, crates/virtq-driver, maps
//! its own memory). What leaves it is opaque or checked:
//!
//! - [`GuestMemory`], the memory table: regions mapped once, guest-physical
//!   addresses translated with bounds checks. Immutable once built: a change
//!   builds a new table (sharing the unchanged mappings) and the dataplane
//!   switches to it while its queues are stopped, so the hot path takes no lock.
//! - [`Seg`], a piece of a guest buffer. Only the table makes them (when a
//!   ring pops a chain); their bytes are reached only through [`GuestBufs`],
//!   a view that borrows the [`Batch`](crate::Batch) holding them, and the
//!   batch keeps the table (and so the mappings) alive.
//! - [`IoBufs`], guest buffers a request keeps past its batch: data lent to
//!   the kernel for asynchronous I/O, and a status byte stored when it
//!   completes. It holds the table alive for as long as it holds buffers.
//! - The ring accessors (`DescTable`, `SplitRing`, `PackedRing`) that
//!   the split and packed queues read and write their rings through; their
//!   bounds follow from how they were built, so the hot path pays no check.
//!
//! Every store into guest memory passes `GuestMemory::dirty` (or, for the
//! rings, their own log hook): the one place where a dirty-page log
//! ([`DirtyLog`]) marks what changed, for live migration. With no log set it
//! costs one predictable branch.
//!
//! Guest memory is shared with a guest that may write it at any time: it is
//! outside Rust's memory model. This side touches it only through raw
//! pointers (volatile loads and stores for ring fields, plain copies for
//! buffers), never through references. Concurrent accesses to the same
//! bytes (the guest's, or two threads' through this module) are races in
//! Rust's abstract model that the hardware resolves byte by byte; like
//! vm-memory, this module assumes that, and the devices never rely on the
//! value of bytes a guest changes under them beyond their checks.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use crate::chain::SetupError;
use crate::ring::{avail_ring_size, desc_table_size, used_ring_size};

// ---- mappings --------------------------------------------------------------

/// One shared `mmap` of a file descriptor (or anonymous shared memory).
/// Unmapped on drop, after its unmap guard (if any) is dropped.
pub struct Mapping {
    addr: *mut u8,
    len: usize,
    sealed: bool,
    /// Dropped just before the memory is unmapped (e.g. a registration in a
    /// SIGBUS handler's table that must end first).
    guard: Option<Box<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the mapping is plain shared memory; `addr` is only used to derive
// addresses inside it and stays valid until drop, which needs exclusive
// ownership. The guard is Send + Sync itself.
unsafe impl Send for Mapping {}
// SAFETY: as above; concurrent access goes through raw pointers (volatile or
// atomic for shared fields), never references.
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("sealed", &self.sealed)
            .finish()
    }
}

/// Adds F_SEAL_SHRINK to `fd` if it can be sealed; true if the file is
/// (now) sealed against shrinking.
pub fn seal_shrink(fd: std::os::unix::io::RawFd) -> bool {
    // SAFETY: fcntl on a descriptor we were handed; no memory is passed.
    unsafe {
        if libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) == 0 {
            return true;
        }
        let seals = libc::fcntl(fd, libc::F_GET_SEALS);
        seals >= 0 && seals & libc::F_SEAL_SHRINK != 0
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no memory side effects.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

impl Mapping {
    /// Maps `len` bytes of `file` starting at `offset`, shared, read-write.
    /// A file that can be sealed against shrinking is sealed first; a range
    /// past the end of a regular file is refused (touching it would raise
    /// SIGBUS).
    pub fn map(file: &File, offset: u64, len: u64) -> io::Result<Mapping> {
        if len == 0 || len > isize::MAX as u64 || offset.checked_add(len).is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad mapping size"));
        }
        if !offset.is_multiple_of(page_size()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "mapping offset not page aligned"));
        }
        // A peer that shrinks the file under us would make the next access
        // raise SIGBUS: seal it where the file can be sealed (memfds made
        // with MFD_ALLOW_SEALING, as QEMU's are), before checking its size.
        let sealed = seal_shrink(file.as_raw_fd());
        let meta = file.metadata()?;
        if meta.is_file() && offset + len > meta.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("region [{offset:#x}, +{len:#x}) is past the end of its file ({:#x} bytes)", meta.len()),
            ));
        }
        // SAFETY: a new mapping at an address of the kernel's choice; the
        // arguments are checked above and the result below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { addr: addr as *mut u8, len: len as usize, sealed, guard: None })
    }

    /// Anonymous shared memory of `len` bytes, zeroed (tests, logs). Under
    /// Miri, which cannot map memory, page-aligned heap memory stands in.
    pub fn anonymous(len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad mapping size"));
        }
        #[cfg(miri)]
        {
            let layout = std::alloc::Layout::from_size_align(len, 4096)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "bad mapping size"))?;
            // SAFETY: the layout has a non-zero size (checked above).
            let addr = unsafe { std::alloc::alloc_zeroed(layout) };
            if addr.is_null() {
                return Err(io::Error::from(io::ErrorKind::OutOfMemory));
            }
            Ok(Mapping { addr, len, sealed: true, guard: None })
        }
        #[cfg(not(miri))]
        {
            Self::map_anonymous(len)
        }
    }

    #[cfg(not(miri))]
    fn map_anonymous(len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh anonymous mapping; the result is checked.
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
        Ok(Mapping { addr: addr as *mut u8, len, sealed: true, guard: None })
    }

    /// Keeps `guard` until just before the memory is unmapped.
    pub fn with_unmap_guard(mut self, guard: Box<dyn std::any::Any + Send + Sync>) -> Mapping {
        self.guard = Some(guard);
        self
    }

    /// Whether the file cannot shrink under the mapping (sealed, or
    /// anonymous). A peer that truncates an unsealed file (hugetlbfs, a
    /// plain file) can still make an access fault.
    pub fn sealed(&self) -> bool {
        self.sealed
    }

    /// Where the mapping lies in this process, as numbers (start, length):
    /// for a fault handler's table. Dereferencing goes through this module.
    pub fn host_range(&self) -> (usize, usize) {
        (self.addr as usize, self.len)
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping (never built by this module).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `N` bytes at `off`, read once each (volatile): for shared areas the
    /// peer may write at any time, such as vhost-user's inflight log.
    /// Zeros when the range is not inside the mapping.
    pub fn load<const N: usize>(&self, off: usize) -> [u8; N] {
        if off.checked_add(N).is_none_or(|end| end > self.len) {
            return [0; N];
        }
        // SAFETY: off + N <= len (checked); [u8; N] needs no alignment.
        unsafe { std::ptr::read_volatile(self.addr.add(off) as *const [u8; N]) }
    }

    /// Stores `N` bytes at `off` (volatile); nothing when the range is not
    /// inside the mapping.
    pub fn store<const N: usize>(&self, off: usize, bytes: [u8; N]) {
        if off.checked_add(N).is_none_or(|end| end > self.len) {
            return;
        }
        // SAFETY: off + N <= len (checked); [u8; N] needs no alignment.
        unsafe { std::ptr::write_volatile(self.addr.add(off) as *mut [u8; N], bytes) }
    }

    /// Sets `len` bytes at `off` to `byte`; nothing when the range is not
    /// inside the mapping.
    pub fn fill(&self, off: usize, len: usize, byte: u8) {
        if off.checked_add(len).is_none_or(|end| end > self.len) {
            return;
        }
        // SAFETY: off + len <= self.len (checked).
        unsafe { std::ptr::write_bytes(self.addr.add(off), byte, len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        drop(self.guard.take());
        // SAFETY: addr/len are exactly what mmap returned; nobody holds the
        // mapping any more, so no pointer into it is used after this.
        #[cfg(not(miri))]
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len);
        }
        // SAFETY: under Miri every mapping is `anonymous`'s heap memory,
        // allocated with this layout (`map` needs a file mapping, which Miri
        // cannot make, so it never returns one).
        #[cfg(miri)]
        unsafe {
            std::alloc::dealloc(self.addr, std::alloc::Layout::from_size_align_unchecked(self.len, 4096))
        }
    }
}

// ---- the memory table --------------------------------------------------------

/// One region of the memory table. Its fields are fixed at construction,
/// where they were checked against the mapping.
#[derive(Clone, Debug)]
pub struct Region {
    gpa: u64,
    size: u64,
    host: *mut u8,
    mapping: Arc<Mapping>,
}

// SAFETY: `host` points into `mapping`, which is Send + Sync and kept alive by the Arc.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// A region of `size` bytes at guest-physical `gpa`, backed by `mapping`
    /// starting `offset` bytes into it.
    pub fn new(gpa: u64, size: u64, mapping: Arc<Mapping>, offset: u64) -> io::Result<Region> {
        let fits = offset.checked_add(size).is_some_and(|end| end <= mapping.len() as u64);
        if size == 0 || !fits || gpa.checked_add(size).is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "region does not fit its mapping"));
        }
        // SAFETY: offset + size <= mapping.len, checked above.
        let host = unsafe { mapping.addr.add(offset as usize) };
        Ok(Region { gpa, size, host, mapping })
    }

    /// Guest-physical start address.
    pub fn gpa(&self) -> u64 {
        self.gpa
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The mapping behind the region.
    pub fn mapping(&self) -> &Arc<Mapping> {
        &self.mapping
    }

    #[inline]
    fn contains_gpa(&self, gpa: u64) -> bool {
        gpa.wrapping_sub(self.gpa) < self.size
    }
}

/// Why a memory table was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum MemoryError {
    /// Two regions overlap in guest-physical space.
    Overlap,
    /// More regions than the table may hold.
    TooManyRegions,
    /// A region to remove is not in the table.
    NoSuchRegion,
}

impl std::fmt::Display for MemoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MemoryError::Overlap => write!(f, "memory regions overlap"),
            MemoryError::TooManyRegions => write!(f, "too many memory regions"),
            MemoryError::NoSuchRegion => write!(f, "no such memory region"),
        }
    }
}

impl std::error::Error for MemoryError {}

/// Most regions a table holds (also what vhostd answers to GET_MAX_MEM_SLOTS).
pub const MAX_REGIONS: usize = 509;

/// The memory table. Cheap to clone (regions share their mappings).
#[derive(Clone, Debug, Default)]
pub struct GuestMemory {
    /// Sorted by `gpa`, non-overlapping.
    regions: Vec<Region>,
    /// Marks pages written while set (live migration).
    log: Option<Arc<DirtyLog>>,
}

impl GuestMemory {
    /// An empty table.
    pub fn new() -> GuestMemory {
        GuestMemory::default()
    }

    /// A table of these regions, refused if any two overlap.
    pub fn from_regions(regions: Vec<Region>) -> Result<GuestMemory, MemoryError> {
        let mut m = GuestMemory::new();
        for r in regions {
            m = m.with_region(r)?;
        }
        Ok(m)
    }

    /// A copy of the table with one more region.
    pub fn with_region(&self, region: Region) -> Result<GuestMemory, MemoryError> {
        if self.regions.len() >= MAX_REGIONS {
            return Err(MemoryError::TooManyRegions);
        }
        let overlaps = |a: &Region| a.gpa < region.gpa + region.size && region.gpa < a.gpa + a.size;
        if self.regions.iter().any(overlaps) {
            return Err(MemoryError::Overlap);
        }
        let mut regions = self.regions.clone();
        let pos = regions.partition_point(|r| r.gpa < region.gpa);
        regions.insert(pos, region);
        Ok(GuestMemory { regions, log: self.log.clone() })
    }

    /// A copy of the table without the region at `gpa` of `size` bytes.
    pub fn without_region(&self, gpa: u64, size: u64) -> Result<GuestMemory, MemoryError> {
        let pos = self.regions.iter().position(|r| r.gpa == gpa && r.size == size).ok_or(MemoryError::NoSuchRegion)?;
        let mut regions = self.regions.clone();
        regions.remove(pos);
        Ok(GuestMemory { regions, log: self.log.clone() })
    }

    /// A copy of the table that marks every store in `log` (None: no log).
    pub fn with_log(&self, log: Option<Arc<DirtyLog>>) -> GuestMemory {
        GuestMemory { regions: self.regions.clone(), log }
    }

    /// The dirty-page log in force, if any.
    pub fn log(&self) -> Option<&Arc<DirtyLog>> {
        self.log.as_ref()
    }

    /// The regions, sorted by guest-physical address.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Index of the region holding `gpa`, trying `hint` first.
    #[inline]
    fn find(&self, gpa: u64, hint: usize) -> Option<usize> {
        if let Some(r) = self.regions.get(hint) {
            if r.contains_gpa(gpa) {
                return Some(hint);
            }
        }
        let pos = self.regions.partition_point(|r| r.gpa <= gpa);
        if pos > 0 && self.regions[pos - 1].contains_gpa(gpa) {
            Some(pos - 1)
        } else {
            None
        }
    }

    /// Host address of `len` bytes at `gpa` when they lie within one region.
    /// `hint` is a per-caller last-hit cache.
    #[inline]
    fn host(&self, gpa: u64, len: u64, hint: &mut usize) -> Option<*mut u8> {
        let i = self.find(gpa, *hint)?;
        *hint = i;
        let r = &self.regions[i];
        let off = gpa - r.gpa;
        if len > r.size - off {
            return None;
        }
        // SAFETY: off + len <= size, so the result stays inside the region.
        Some(unsafe { r.host.add(off as usize) })
    }

    /// Where guest-physical `gpa` lies in this process, as a number (for
    /// checks and diagnostics; bytes are reached through this module).
    pub fn host_addr(&self, gpa: u64) -> Option<usize> {
        self.host(gpa, 1, &mut 0).map(|p| p as usize)
    }

    /// Whether `len` bytes at `gpa` lie in one region.
    pub fn contains(&self, gpa: u64, len: u64) -> bool {
        self.host(gpa, len, &mut 0).is_some()
    }

    /// The buffer [gpa, gpa+len) as the segment it is, when it lies within
    /// one region (what a ring's fast path takes).
    #[inline]
    pub(crate) fn seg(&self, gpa: u64, len: u32, hint: &mut usize) -> Option<Seg> {
        self.host(gpa, len as u64, hint).map(|addr| Seg { addr, len })
    }

    /// `seg` for the common case alone: the buffer inside the region `hint`
    /// names, found without a call or a search (chains of several buffers
    /// take this per buffer; the general walk is `for_each_seg`).
    #[inline(always)]
    pub(crate) fn seg_at_hint(&self, gpa: u64, len: u32, hint: usize) -> Option<Seg> {
        let r = self.regions.get(hint)?;
        let off = gpa.wrapping_sub(r.gpa);
        if off >= r.size || len as u64 > r.size - off {
            return None;
        }
        // SAFETY: off + len <= size, so the segment stays inside the region.
        Some(Seg { addr: unsafe { r.host.add(off as usize) }, len })
    }

    /// Calls `f` with each segment of the guest buffer [gpa, gpa+len) as it
    /// falls into regions. Returns false (having called `f` for a prefix
    /// only) if part of the buffer is not in the table.
    #[inline]
    pub(crate) fn for_each_seg(&self, mut gpa: u64, mut len: u64, hint: &mut usize, mut f: impl FnMut(Seg)) -> bool {
        if gpa.checked_add(len).is_none() {
            return false;
        }
        while len > 0 {
            let Some(i) = self.find(gpa, *hint) else { return false };
            *hint = i;
            let r = &self.regions[i];
            let off = gpa - r.gpa;
            // A segment's length is a u32: a longer region piece is split.
            let n = len.min(r.size - off).min(u32::MAX as u64);
            // SAFETY: off + n <= size.
            f(Seg { addr: unsafe { r.host.add(off as usize) }, len: n as u32 });
            gpa += n;
            len -= n;
        }
        true
    }

    /// Copies guest memory at `gpa` into `out`; false (nothing copied) if
    /// the range is not all inside the table.
    pub fn read(&self, gpa: u64, out: &mut [u8]) -> bool {
        let mut segs = Vec::new();
        if !self.for_each_seg(gpa, out.len() as u64, &mut 0, |s| segs.push(s)) {
            return false;
        }
        let mut done = 0;
        for s in segs {
            // SAFETY: the segment lies in a mapped region (for_each_seg);
            // `out` has room for its length (the pieces add up to out.len()).
            unsafe { std::ptr::copy_nonoverlapping(s.addr, out.as_mut_ptr().add(done), s.len as usize) };
            done += s.len as usize;
        }
        true
    }

    /// Copies `data` into guest memory at `gpa`; false (nothing copied) if
    /// the range is not all inside the table.
    pub fn write(&self, gpa: u64, data: &[u8]) -> bool {
        let mut segs = Vec::new();
        if !self.for_each_seg(gpa, data.len() as u64, &mut 0, |s| segs.push(s)) {
            return false;
        }
        let mut done = 0;
        for s in segs {
            // SAFETY: as in `read`; `data` is private memory, never guest memory
            // handed out by this module, so the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(done), s.addr, s.len as usize) };
            self.dirty(s.addr, s.len as usize);
            done += s.len as usize;
        }
        true
    }

    /// Guest buffer [gpa, gpa+len) appended to `out` as data lent for I/O
    /// (tests and callers that hold guest addresses rather than chains).
    /// False if part of it is not in the table, or `out` holds buffers of
    /// another table (`out` is then unchanged).
    pub fn lend(self: &Arc<Self>, gpa: u64, len: u64, out: &mut IoBufs) -> bool {
        if !out.can_hold(self) {
            return false;
        }
        let before = out.data.len();
        if !self.for_each_seg(gpa, len, &mut 0, |s| out.data.push(s)) {
            out.data.truncate(before);
            return false;
        }
        out.hold(self);
        true
    }

    /// The one place every store into guest memory passes: marks the pages
    /// of `len` bytes at host address `host` in the dirty log, if one is set.
    #[inline(always)]
    fn dirty(&self, host: *const u8, len: usize) {
        if let Some(log) = &self.log {
            self.mark_host(log, host, len);
        }
    }

    /// The dirty log's slow path: marks the guest-physical pages of the host
    /// bytes [host, host+len) in every region that maps them (regions may
    /// alias one mapping: a store is then a change at each address).
    #[cold]
    #[inline(never)]
    fn mark_host(&self, log: &DirtyLog, host: *const u8, len: usize) {
        let (start, end) = (host as usize, (host as usize).saturating_add(len));
        for r in &self.regions {
            let (rs, re) = (r.host as usize, (r.host as usize).saturating_add(r.size as usize));
            let (s, e) = (start.max(rs), end.min(re));
            if s < e {
                log.mark(r.gpa + (s - rs) as u64, (e - s) as u64);
            }
        }
    }
}

// ---- the dirty-page log ------------------------------------------------------

/// Size of a page the dirty log tracks.
pub const LOG_PAGE: u64 = 4096;

/// A dirty-page bitmap in shared memory, vhost-user's layout: bit `p % 8`
/// of byte `p / 8` is page `p` (guest-physical address / 4 KiB). Bits are
/// set atomically (the peer clears them concurrently).
pub struct DirtyLog {
    map: Arc<Mapping>,
    off: usize,
    len: usize,
}

impl std::fmt::Debug for DirtyLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyLog").field("len", &self.len).finish()
    }
}

impl DirtyLog {
    /// The `len` bytes of `map` from `off` as a bitmap; None if they do not fit.
    pub fn new(map: Arc<Mapping>, off: usize, len: usize) -> Option<DirtyLog> {
        (off.checked_add(len)? <= map.len()).then_some(DirtyLog { map, off, len })
    }

    /// Marks the pages of `len` bytes at guest-physical `gpa` (nothing for
    /// pages past the bitmap's end).
    pub fn mark(&self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = gpa / LOG_PAGE;
        let last = gpa.saturating_add(len - 1) / LOG_PAGE;
        for page in first..=last {
            let byte = page / 8;
            if byte >= self.len as u64 {
                break;
            }
            // SAFETY: byte < len and off + len <= mapping length (new), so
            // the byte is inside the mapping; an AtomicU8 needs no alignment.
            // The peer reads and clears bits with atomics too.
            let cell = unsafe { AtomicU8::from_ptr(self.map.addr.add(self.off + byte as usize)) };
            cell.fetch_or(1 << (page % 8), Ordering::Relaxed);
        }
    }

    /// Bytes of bitmap (8 pages a byte).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the bitmap has no bytes (never: `new` takes any length, the
    /// transport refuses zero).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether page `page` is marked.
    pub fn is_marked(&self, page: u64) -> bool {
        let byte = page / 8;
        byte < self.len as u64 && self.map.load::<1>(self.off + byte as usize)[0] & (1 << (page % 8)) != 0
    }
}

// ---- chain segments and the views on them ---------------------------------------

/// A piece of a guest buffer, translated to where it lies in this process.
/// Opaque: only the memory table makes one, and its bytes are reached only
/// through the views ([`GuestBufs`], [`IoBufs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    addr: *mut u8,
    len: u32,
}

impl Default for Seg {
    fn default() -> Seg {
        Seg { addr: std::ptr::null_mut(), len: 0 }
    }
}

impl Seg {
    /// Starts fetching the segment's first line for reading (no effect on
    /// correctness).
    #[inline(always)]
    pub(crate) fn prefetch(&self) {
        prefetch(self.addr)
    }

    /// Length in bytes (never 0 in a chain).
    #[inline]
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True for an empty segment (a chain never holds one).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the segment lies in this process, as a number: for checks
    /// (fuzzing, tests). Its bytes are reached through the views.
    pub fn host_addr(&self) -> usize {
        self.addr as usize
    }
}

/// The device-readable or the device-writable buffers of one popped chain,
/// in chain order, borrowed from the batch that popped it (which keeps the
/// memory table alive).
#[derive(Clone, Copy)]
pub struct GuestBufs<'a> {
    segs: &'a [Seg],
    mem: &'a Arc<GuestMemory>,
}

impl<'a> GuestBufs<'a> {
    #[inline]
    pub(crate) fn new(segs: &'a [Seg], mem: &'a Arc<GuestMemory>) -> GuestBufs<'a> {
        GuestBufs { segs, mem }
    }

    /// The segments (their lengths, for planning copies).
    #[inline]
    pub fn segs(&self) -> &'a [Seg] {
        self.segs
    }

    /// True when there are no buffers.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.segs.is_empty()
    }

    /// Total bytes.
    pub fn bytes(&self) -> usize {
        self.segs.iter().map(|s| s.len as usize).sum()
    }

    /// Starts fetching the cache line `off` bytes into the first buffer
    /// (no effect on correctness; an offset past the buffer fetches a line
    /// that is not read).
    #[inline(always)]
    pub fn prefetch(&self, off: usize) {
        if let Some(s) = self.segs.first() {
            prefetch(s.addr.wrapping_add(off));
        }
    }

    /// `prefetch` for writing: the line comes exclusive, ready for a store.
    #[inline(always)]
    pub fn prefetch_write(&self, off: usize) {
        if let Some(s) = self.segs.first() {
            prefetch_write(s.addr.wrapping_add(off));
        }
    }

    /// Stores `body`'s first 16 bytes at `hdr_len`, where
    /// `write_header_and(_, hdr_len, body)` will put them, when the first
    /// buffer holds header and body and the body has 16 bytes; otherwise
    /// nothing. A store, not a prefetch: see vhostd-net's
    /// `store_first_pieces` for why.
    #[inline(always)]
    pub fn store_body_start(&self, hdr_len: usize, body: &[u8]) {
        let Some(s) = self.segs.first() else { return };
        if body.len() >= 16 && hdr_len + body.len() <= s.len as usize {
            // SAFETY: hdr_len + 16 <= hdr_len + body.len() <= s.len: inside
            // the segment, which the batch's memory table keeps mapped;
            // `body` is private memory, so the ranges do not overlap.
            unsafe {
                copy_bytes(body.as_ptr(), s.addr.add(hdr_len), 16);
                self.mem.dirty(s.addr.add(hdr_len), 16);
            }
        }
    }

    /// Starts fetching the first buffer's first two lines for
    /// `write_header_and` with a header of `hdr_len` bytes: for writing,
    /// except, when `share_header_line`, a line the header alone ends,
    /// which `write_header_and` most often only reads (see there) and which
    /// a fetch for writing would take from the driver's CPU for nothing.
    #[inline(always)]
    pub fn prefetch_for_header(&self, hdr_len: usize, share_header_line: bool) {
        let Some(s) = self.segs.first() else { return };
        let in_line = s.addr as usize % 64;
        if share_header_line && hdr_len == 12 && in_line + hdr_len == 64 && s.len as usize >= hdr_len {
            prefetch(s.addr);
        } else {
            prefetch_write(s.addr);
        }
        // The next line, if the buffer reaches into it.
        if in_line + s.len as usize > 64 {
            prefetch_write(s.addr.wrapping_add(64));
        }
    }

    /// `prefetch_write` of the line holding the last byte (a virtio-blk
    /// status byte).
    #[inline(always)]
    pub fn prefetch_write_last(&self) {
        if let Some(s) = self.segs.last() {
            prefetch_write(s.addr.wrapping_add(s.len as usize).wrapping_sub(1));
        }
    }

    /// Copies the bytes from `skip` on into `dst`; returns bytes copied
    /// (fewer when the buffers end first).
    #[inline(always)]
    pub fn read(&self, skip: usize, dst: &mut [u8]) -> usize {
        // Most reads lie in the first buffer (a header before its data).
        if let Some(s) = self.segs.first() {
            if skip <= s.len as usize && dst.len() <= s.len as usize - skip {
                // SAFETY: skip + dst.len() <= s.len: inside the segment,
                // which the batch's memory table keeps mapped; `dst` is
                // private memory, so the ranges do not overlap.
                unsafe { copy_bytes(s.addr.add(skip), dst.as_mut_ptr(), dst.len()) };
                return dst.len();
            }
        }
        self.read_slow(skip, dst)
    }

    fn read_slow(&self, mut skip: usize, dst: &mut [u8]) -> usize {
        let mut copied = 0;
        for s in self.segs {
            let len = s.len as usize;
            if skip >= len {
                skip -= len;
                continue;
            }
            let n = (len - skip).min(dst.len() - copied);
            // SAFETY: skip + n <= len: inside the segment (mapped, see
            // `read`); dst has room for n more bytes.
            unsafe { std::ptr::copy_nonoverlapping(s.addr.add(skip), dst.as_mut_ptr().add(copied), n) };
            copied += n;
            skip = 0;
            if copied == dst.len() {
                break;
            }
        }
        copied
    }

    /// Copies `src` into the buffers from `skip` on; returns bytes copied
    /// (fewer when the buffers end first).
    #[inline(always)]
    pub fn write(&self, skip: usize, src: &[u8]) -> usize {
        if let [s] = self.segs {
            if skip <= s.len as usize && src.len() <= s.len as usize - skip {
                // SAFETY: skip + src.len() <= s.len: inside the mapped
                // segment; `src` is private memory, not overlapping it.
                unsafe {
                    let p = s.addr.add(skip);
                    copy_bytes(src.as_ptr(), p, src.len());
                    self.mem.dirty(p, src.len());
                }
                return src.len();
            }
        }
        self.write_slow(skip, src)
    }

    fn write_slow(&self, mut skip: usize, mut src: &[u8]) -> usize {
        let mut copied = 0;
        for s in self.segs {
            if src.is_empty() {
                break;
            }
            let len = s.len as usize;
            if skip >= len {
                skip -= len;
                continue;
            }
            let n = (len - skip).min(src.len());
            // SAFETY: skip + n <= len: inside the mapped segment; `src` is
            // private memory.
            unsafe {
                let p = s.addr.add(skip);
                std::ptr::copy_nonoverlapping(src.as_ptr(), p, n);
                self.mem.dirty(p, n);
            }
            src = &src[n..];
            copied += n;
            skip = 0;
        }
        copied
    }

    /// Writes a header of `hdr_len` bytes (at most 12), given as its bytes
    /// 0-7 and 8-11 read little-endian, then `body`, from the start of the
    /// buffers. The caller checked that they have room for both.
    ///
    /// The header is stored straight from registers. Copied from a
    /// temporary on the stack instead, the copy's 8-byte load spans the
    /// smaller stores that built it, cannot be forwarded from them, and
    /// waits until they leave the store buffer: behind the previous frame's
    /// stores into guest memory, which miss (the guest wrote those lines
    /// last). That put one cross-CPU miss per frame in series: a third of
    /// the packed loop's cycles.
    ///
    /// A 12-byte header is stored only if it differs from the bytes already
    /// there. A driver reads the header of every buffer it gets back
    /// (num_buffers), so its line is shared with the driver's CPU; a store
    /// takes the line away and the driver's next read brings it back. A
    /// reposted buffer's header mostly holds the same bytes already (the
    /// same num_buffers, no offloads), and where the header alone fills the
    /// end of its line (DPDK's mbufs) the line then stays shared, if it was
    /// fetched for reading (`prefetch_for_header`). Packed
    /// ring, 1024 entries, 64-byte frames, vhostd held behind the driver's
    /// refill: 102-114 busy cycles/packet with the header always stored
    /// (buffers fetched for writing, 8 ahead), 77-83 compared (with the
    /// burst's buffers fetched as `prefetch_for_header` does); with no
    /// header or frame stored at all, 61-62. DPDK's vhost library compares
    /// its header fields the same way.
    #[inline(always)]
    pub fn write_header_and(&self, hdr: (u64, u32), hdr_len: usize, body: &[u8]) {
        debug_assert!(hdr_len <= 12);
        if let [s] = self.segs {
            if hdr_len >= 10 && hdr_len + body.len() <= s.len as usize {
                // SAFETY: the one segment has room for header and body
                // (checked); hdr_len is 10..=12, so the 8-byte load and
                // store and the 4-byte ones (or, for 10 and 11, the 2-byte
                // store plus remainder) stay inside the header; `body` is
                // private memory.
                unsafe {
                    if hdr_len == 12 {
                        let (w0, w1) = (s.addr as *mut u64, s.addr.add(8) as *mut u32);
                        if w0.read_unaligned() != hdr.0.to_le() || w1.read_unaligned() != hdr.1.to_le() {
                            w0.write_unaligned(hdr.0.to_le());
                            w1.write_unaligned(hdr.1.to_le());
                        }
                    } else {
                        (s.addr as *mut u64).write_unaligned(hdr.0.to_le());
                        (s.addr.add(8) as *mut u16).write_unaligned((hdr.1 as u16).to_le());
                        if hdr_len == 11 {
                            *s.addr.add(10) = (hdr.1 >> 16) as u8;
                        }
                    }
                    copy_bytes(body.as_ptr(), s.addr.add(hdr_len), body.len());
                    self.mem.dirty(s.addr, hdr_len + body.len());
                }
                return;
            }
        }
        let mut h = [0u8; 12];
        h[..8].copy_from_slice(&hdr.0.to_le_bytes());
        h[8..].copy_from_slice(&hdr.1.to_le_bytes());
        self.write_slow(0, &h[..hdr_len.min(12)]);
        self.write_slow(hdr_len, body);
    }

    /// Appends the bytes from `skip` on, `limit` at most, to `out` as data
    /// lent for I/O. False (and `out`'s data as it was) if that takes more
    /// than `max_pieces` pieces in all or a piece longer than `max_piece`,
    /// or `out` holds buffers of another memory table.
    pub fn lend(
        &self,
        mut skip: usize,
        mut limit: usize,
        max_pieces: usize,
        max_piece: usize,
        out: &mut IoBufs,
    ) -> bool {
        if !out.can_hold(self.mem) {
            return false;
        }
        let before = out.data.len();
        for s in self.segs {
            if limit == 0 {
                break;
            }
            let len = s.len as usize;
            if skip >= len {
                skip -= len;
                continue;
            }
            let take = (len - skip).min(limit);
            if out.data.len() == max_pieces || take > max_piece {
                out.data.truncate(before);
                return false;
            }
            // SAFETY: skip < len: inside the segment.
            out.data.push(Seg { addr: unsafe { s.addr.add(skip) }, len: take as u32 });
            limit -= take;
            skip = 0;
        }
        out.hold(self.mem);
        true
    }

    /// Makes the last byte of the buffers `out`'s status byte (stored when
    /// the request completes). False when there are no buffers, or `out`
    /// holds buffers of another memory table.
    pub fn lend_last_byte(&self, out: &mut IoBufs) -> bool {
        let Some(s) = self.segs.last() else { return false };
        if !out.can_hold(self.mem) {
            return false;
        }
        // SAFETY: segments in a chain are never empty, so len - 1 is inside.
        out.status = Some(Seg { addr: unsafe { s.addr.add(s.len as usize - 1) }, len: 1 });
        out.hold(self.mem);
        true
    }

    /// Makes the first `len` bytes of the buffers `out`'s reply, stored
    /// when the request completes (`IoBufs::write_reply`; a virtio-scsi
    /// response header). False when the buffers hold fewer bytes, the
    /// reply would take more than [`MAX_REPLY_PIECES`] pieces, or `out`
    /// holds buffers of another memory table.
    #[inline]
    pub fn lend_front(&self, len: usize, out: &mut IoBufs) -> bool {
        // Most often the first buffer holds it all: no sum over the rest.
        match self.segs.first() {
            Some(s) if len != 0 && s.len as usize >= len && out.can_hold(self.mem) => {
                out.reply.clear();
                out.reply.push(Seg { addr: s.addr, len: len as u32 });
                out.hold(self.mem);
                true
            }
            _ => self.lend_front_pieces(len, out),
        }
    }

    fn lend_front_pieces(&self, len: usize, out: &mut IoBufs) -> bool {
        if !out.can_hold(self.mem) || self.bytes() < len {
            return false;
        }
        out.reply.clear();
        let mut left = len;
        for s in self.segs {
            if left == 0 {
                break;
            }
            if out.reply.len() == MAX_REPLY_PIECES {
                out.reply.clear();
                return false;
            }
            let take = (s.len as usize).min(left);
            out.reply.push(Seg { addr: s.addr, len: take as u32 });
            left -= take;
        }
        out.hold(self.mem);
        true
    }
}

/// Pieces a reply lent with [`GuestBufs::lend_front`] may lie in.
pub const MAX_REPLY_PIECES: usize = 8;

/// Guest buffers a request keeps after its batch: the data lent to the
/// kernel for asynchronous I/O, and a status byte the device stores when
/// the request completes. Holds the memory table they lie in (so they stay
/// mapped). `clear` empties it and keeps the table held, so a request slot
/// reused for the next request over the same table changes no reference
/// count (an atomic add and subtract cost ~25% of a null-backend request);
/// `release` lets go of the table too.
#[derive(Default)]
pub struct IoBufs {
    mem: Option<Arc<GuestMemory>>,
    /// `mem` has a dirty log (fixed per table): completing a request then
    /// reads nothing of the table when it has none.
    logged: bool,
    data: Vec<Seg>,
    status: Option<Seg>,
    /// A reply stored at completion (`lend_front`); empty for most devices.
    reply: Vec<Seg>,
}

// SAFETY: the raw pointers in the segments point into memory the held table
// keeps mapped; an IoBufs is one request's, moved with it.
unsafe impl Send for IoBufs {}

/// A hold on a memory table: while it lives, buffers lent from it stay
/// mapped (a backend keeps one per request the kernel still works on).
#[derive(Clone)]
pub struct MemoryHold(#[allow(dead_code)] Arc<GuestMemory>);

impl IoBufs {
    /// Empty (no allocation).
    pub const fn new() -> IoBufs {
        IoBufs { mem: None, logged: false, data: Vec::new(), status: None, reply: Vec::new() }
    }

    /// Empty, with room for `n` data pieces.
    pub fn with_capacity(n: usize) -> IoBufs {
        IoBufs { mem: None, logged: false, data: Vec::with_capacity(n), status: None, reply: Vec::new() }
    }

    /// Whether buffers of `mem` may join: the ones held are of the same
    /// table, or there are none (one hold keeps them all mapped).
    fn can_hold(&self, mem: &Arc<GuestMemory>) -> bool {
        self.mem.as_ref().is_none_or(|m| Arc::ptr_eq(m, mem))
            || (self.data.is_empty() && self.status.is_none() && self.reply.is_empty())
    }

    /// Holds `mem`, for buffers about to be added (`can_hold` said yes).
    fn hold(&mut self, mem: &Arc<GuestMemory>) {
        if !self.mem.as_ref().is_some_and(|m| Arc::ptr_eq(m, mem)) {
            self.mem = Some(mem.clone());
            self.logged = mem.log.is_some();
        }
    }

    /// Lets go of every buffer; the memory table stays held (see above).
    pub fn clear(&mut self) {
        self.data.clear();
        self.status = None;
        self.reply.clear();
    }

    /// Lets go of every buffer and of the memory table.
    pub fn release(&mut self) {
        self.clear();
        self.mem = None;
        self.logged = false;
    }

    /// Data pieces.
    pub fn pieces(&self) -> usize {
        self.data.len()
    }

    /// Data bytes.
    pub fn data_len(&self) -> u64 {
        self.data.iter().map(|s| s.len as u64).sum()
    }

    /// The data pieces as (address, length), for the kernel (an io_uring
    /// READV/WRITEV). The addresses stay valid while a [`MemoryHold`] from
    /// `hold` lives; nothing in this process may dereference them.
    pub fn iovecs(&self) -> impl Iterator<Item = (*mut u8, usize)> + '_ {
        self.data.iter().map(|s| (s.addr, s.len as usize))
    }

    /// A hold on the memory the data lies in (None: no data lent).
    pub fn memory_hold(&self) -> Option<MemoryHold> {
        self.mem.clone().map(MemoryHold)
    }

    /// Makes `hold` a hold on the memory the data lies in, as
    /// `memory_hold` would, without touching a reference count when it
    /// already holds that table (a backend slot reused request after
    /// request).
    pub fn renew_hold(&self, hold: &mut Option<MemoryHold>) {
        match (&self.mem, &*hold) {
            (Some(m), Some(MemoryHold(h))) if Arc::ptr_eq(m, h) => {}
            _ => *hold = self.memory_hold(),
        }
    }

    /// The kernel wrote the data (a read completed): marks it in the dirty log.
    pub fn data_written(&self) {
        if let (true, Some(mem)) = (self.logged, &self.mem) {
            for s in &self.data {
                mem.dirty(s.addr, s.len as usize);
            }
        }
    }

    /// Copies `data_len()` bytes from `src` into the data pieces, in order:
    /// a read served from memory (a mapped disk image) rather than by the
    /// kernel. The device marks the dirty log as for any read
    /// (`data_written`).
    ///
    /// # Safety
    /// `src` must be readable for `data_len()` bytes and overlap no piece.
    pub unsafe fn copy_to_data(&self, src: *const u8) {
        let mut done = 0;
        for s in &self.data {
            // SAFETY: the piece lies in memory the held table keeps mapped
            // (bounds checked when it was lent); the caller vouches for
            // `src` up to `data_len()`, the sum of the pieces.
            unsafe { std::ptr::copy_nonoverlapping(src.add(done), s.addr, s.len as usize) };
            done += s.len as usize;
        }
    }

    /// Copies the data pieces, in order, to `dst`: a write served into
    /// memory (a mapped disk image) rather than by the kernel. `streaming`:
    /// with non-temporal stores (x86-64), which neither read each line
    /// before replacing it nor keep it in the cache; for memory larger than
    /// the cache, written at random.
    ///
    /// # Safety
    /// `dst` must be writable for `data_len()` bytes and overlap no piece.
    /// With `streaming`, the stores are weakly ordered: the caller calls
    /// `fence_streamed_stores`, in the same thread, before anyone else may
    /// read `dst` or learn that the write is done (once for a batch of
    /// copies).
    pub unsafe fn copy_from_data(&self, dst: *mut u8, streaming: bool) {
        let mut done = 0;
        for s in &self.data {
            let (src, to, n) = (s.addr as *const u8, dst.wrapping_add(done), s.len as usize);
            // SAFETY: as in `copy_to_data`, the other way.
            unsafe {
                if streaming {
                    copy_streaming(src, to, n);
                } else {
                    std::ptr::copy_nonoverlapping(src, to, n);
                }
            }
            done += n;
        }
    }

    /// Stores `bytes` at the start of the reply (`lend_front`), as much
    /// as it holds. Returns the bytes stored (0: no reply lent).
    pub fn write_reply(&self, bytes: &[u8]) -> usize {
        let mut done = 0;
        for s in &self.reply {
            if done == bytes.len() {
                break;
            }
            let n = (s.len as usize).min(bytes.len() - done);
            // SAFETY: the reply segments lie inside buffers of the held
            // memory table (lend_front), which keeps them mapped; n is at
            // most the segment's length, and `bytes` is ours, not guest
            // memory, so the two cannot overlap.
            unsafe { copy_bytes(bytes[done..].as_ptr(), s.addr, n) };
            if self.logged {
                if let Some(mem) = &self.mem {
                    mem.dirty(s.addr, n);
                }
            }
            done += n;
        }
        done
    }

    /// Stores a 12-byte reply start (virtio-scsi's response without sense)
    /// like [`IoBufs::write_reply`]: `first` then `second`, little-endian.
    /// Words, not bytes, so the caller builds them in registers: bytes
    /// stored one by one into a buffer and copied out with wide loads make
    /// those loads wait for the store buffer to drain, and with it every
    /// older store into the other CPU's cache lines (a tenth of a
    /// null-backend virtio-scsi command).
    #[inline]
    pub fn write_reply_head(&self, first: u64, second: u32) -> usize {
        match self.reply.first() {
            Some(s) if s.len >= 12 => {
                // SAFETY: the first reply segment lies inside a buffer of the
                // held memory table (lend_front) and holds 12 bytes.
                unsafe {
                    std::ptr::write_unaligned(s.addr as *mut u64, first.to_le());
                    std::ptr::write_unaligned(s.addr.add(8) as *mut u32, second.to_le());
                }
                if self.logged {
                    if let Some(mem) = &self.mem {
                        mem.dirty(s.addr, 12);
                    }
                }
                12
            }
            _ => {
                let mut b = [0u8; 12];
                b[..8].copy_from_slice(&first.to_le_bytes());
                b[8..].copy_from_slice(&second.to_le_bytes());
                self.write_reply(&b)
            }
        }
    }

    /// Stores the status byte; false if none is set.
    pub fn write_status(&self, v: u8) -> bool {
        let Some(s) = self.status else { return false };
        // SAFETY: the status segment is one byte inside a buffer of the held
        // memory table (lend_last_byte), which keeps it mapped.
        unsafe { std::ptr::write_volatile(s.addr, v) };
        if let (true, Some(mem)) = (self.logged, &self.mem) {
            mem.dirty(s.addr, 1);
        }
        true
    }
}

// ---- copies and prefetches ----------------------------------------------------

/// Copies `n` bytes from `src` to `dst`. The sizes small frames and headers
/// have are copied inline with a few overlapping loads and stores (16-byte
/// vector registers from 16 bytes up): a call into `memcpy` and its size
/// dispatch cost more than the copy itself at 64 bytes.
///
/// # Safety
/// `src` must be readable and `dst` writable for `n` bytes, and the two
/// ranges must not overlap.
#[inline(always)]
pub(crate) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    type Chunk = core::arch::x86_64::__m128i;
    #[cfg(not(target_arch = "x86_64"))]
    type Chunk = [u8; 16];
    /// Moves the `T` at `off`.
    ///
    /// # Safety
    /// `off + size_of::<T>() <= n` for the ranges of `copy_bytes`.
    #[inline(always)]
    unsafe fn mv<T: Copy>(src: *const u8, dst: *mut u8, off: usize) {
        // SAFETY: inside both ranges (caller); unaligned accesses.
        unsafe { (dst.add(off) as *mut T).write_unaligned((src.add(off) as *const T).read_unaligned()) }
    }
    // SAFETY: in every arm each offset plus the size moved is at most n;
    // the moves may overlap each other but never the other range.
    unsafe {
        match n {
            8..=15 => {
                mv::<u64>(src, dst, 0);
                mv::<u64>(src, dst, n - 8);
            }
            16..=32 => {
                mv::<Chunk>(src, dst, 0);
                mv::<Chunk>(src, dst, n - 16);
            }
            33..=64 => {
                for off in [0, 16, n - 32, n - 16] {
                    mv::<Chunk>(src, dst, off);
                }
            }
            65..=128 => {
                for off in [0, 16, 32, 48, n - 64, n - 48, n - 32, n - 16] {
                    mv::<Chunk>(src, dst, off);
                }
            }
            _ => std::ptr::copy_nonoverlapping(src, dst, n),
        }
    }
}

/// Copies `n` bytes from `src` to `dst`, the whole 64-byte lines of `dst`
/// with non-temporal stores, the rest with plain ones. The
/// caller fences (`fence_streamed_stores`) before anyone may read `dst`.
///
/// # Safety
/// As `copy_nonoverlapping`.
unsafe fn copy_streaming(src: *const u8, dst: *mut u8, n: usize) {
    // Miri runs no non-temporal stores: there the copy is plain, and the
    // callers' bounds are what it checks.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: every access lies in [src, src+n) or [dst, dst+n), which the
    // caller vouches for; the streamed stores are to 16-byte aligned
    // addresses (in whole lines); SSE2 is baseline on x86_64.
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // Whole lines only: a partly streamed line costs a partial write.
        let head = dst.align_offset(64).min(n);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut i = head;
        if std::arch::is_x86_feature_detected!("avx512f") {
            let lines = (n - head) / 64;
            stream_lines_avx512(src.add(head), dst.add(head), lines);
            i += lines * 64;
        }
        while i + 64 <= n {
            let (s, d) = (src.add(i) as *const __m128i, dst.add(i) as *mut __m128i);
            let v =
                [_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3))];
            for (k, v) in v.into_iter().enumerate() {
                _mm_stream_si128(d.add(k), v);
            }
            i += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
    }
    #[cfg(any(not(target_arch = "x86_64"), miri))]
    // SAFETY: as the caller's.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    }
}

/// Copies `lines` 64-byte lines from `src` to the line-aligned `dst` with
/// one 64-byte non-temporal store each (four with SSE2): a quarter of the
/// store-buffer entries for a block.
///
/// # Safety
/// As `copy_streaming`, for `lines * 64` bytes; `dst` 64-byte aligned; the
/// CPU has AVX-512F.
#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx512f")]
unsafe fn stream_lines_avx512(src: *const u8, dst: *mut u8, lines: usize) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_stream_si512};
    for k in 0..lines {
        // SAFETY: line k lies in both ranges (caller); the store is to a
        // 64-byte aligned address, the load may be unaligned.
        unsafe {
            let v = _mm512_loadu_si512(src.add(k * 64) as *const __m512i);
            _mm512_stream_si512(dst.add(k * 64) as *mut __m512i, v);
        }
    }
}

/// Orders this thread's non-temporal stores of `IoBufs::copy_from_data`
/// before its later stores (such as a used ring's index), and so before
/// any system call it makes after: they are weakly ordered, unlike plain
/// x86 stores. It waits for them to drain, so one fence after a batch of
/// copies costs less than one after each.
pub fn fence_streamed_stores() {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: sfence has no operands; SSE is baseline on x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    // Under Miri (plain copies only) and elsewhere: an ordinary fence.
    #[cfg(any(not(target_arch = "x86_64"), miri))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Hints the CPU to fetch the cache line at `p` (no effect on correctness).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch never faults, whatever the address; SSE is baseline on x86_64.
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Hints the CPU to fetch the cache line at `p` for writing.
#[inline(always)]
fn prefetch_write(p: *const u8) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: prefetchw never faults and changes no architectural state;
    // CPUs without PRFCHW execute it as a no-op.
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly))
    };
    #[cfg(any(not(target_arch = "x86_64"), miri))]
    let _ = p;
}

// ---- the rings ----------------------------------------------------------------

/// Reads the 16 bytes of a descriptor at `p` once, as two little-endian
/// words: (addr, then len | id-or-flags << 32 | flags-or-next << 48).
///
/// The guest may rewrite a descriptor while we read it, so each byte must be
/// read exactly once (volatile). Two 8-byte loads instead of one `[u8; 16]`
/// volatile load, which compiles to sixteen byte loads and the shifts to
/// reassemble them: that cost 10 % of the packed RX pass.
///
/// # Safety
/// `p` must be valid for a 16-byte read.
#[inline(always)]
unsafe fn read_desc_words(p: *const u8) -> (u64, u64) {
    if (p as usize).is_multiple_of(8) {
        // SAFETY: 16 readable bytes (caller) and 8-byte alignment (checked).
        unsafe {
            (
                u64::from_le(std::ptr::read_volatile(p as *const u64)),
                u64::from_le(std::ptr::read_volatile(p.add(8) as *const u64)),
            )
        }
    } else {
        // Ring tables are 16-aligned (checked at set-up); an indirect table
        // may not be where a guest says.
        // SAFETY: 16 readable bytes (caller); [u8; 16] has alignment 1.
        let raw = unsafe { std::ptr::read_volatile(p as *const [u8; 16]) };
        let (a, b) = raw.split_at(8);
        (u64::from_le_bytes(a.try_into().unwrap_or_default()), u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
}

/// Host address of the ring area [gpa, gpa+len): within one region, with
/// the alignment the ring's fields need (the guest address was checked; a
/// region mapped at an odd offset would break it on the host side).
fn ring_area(mem: &GuestMemory, gpa: u64, len: u64, align: usize) -> Result<*mut u8, SetupError> {
    let p = mem.host(gpa, len, &mut 0).ok_or(SetupError::NotMapped)?;
    if !(p as usize).is_multiple_of(align) {
        return Err(SetupError::Misaligned);
    }
    Ok(p)
}

/// The dirty log of a ring's memory and where its stores land, in guest
/// physical addresses.
#[derive(Clone)]
struct RingLog {
    log: Option<Arc<DirtyLog>>,
}

impl RingLog {
    /// Marks the ring bytes just stored: one predictable branch without a
    /// log, the marking itself out of the hot path's way.
    #[inline(always)]
    fn mark(&self, gpa: u64, len: u64) {
        if let Some(log) = &self.log {
            mark_ring(log, gpa, len);
        }
    }
}

#[cold]
#[inline(never)]
fn mark_ring(log: &DirtyLog, gpa: u64, len: u64) {
    log.mark(gpa, len);
}

/// A table of `n` descriptors in guest memory: a ring's own table, or an
/// indirect table a chain points to.
#[derive(Clone, Copy)]
pub(crate) struct DescTable {
    host: *mut u8,
    n: u16,
}

impl DescTable {
    /// The table of `bytes` bytes (a multiple of 16, at most 32768
    /// entries) at `gpa`, within one region.
    pub(crate) fn indirect(mem: &GuestMemory, gpa: u64, bytes: u32, hint: &mut usize) -> Option<DescTable> {
        debug_assert!(bytes.is_multiple_of(16) && bytes / 16 <= crate::ring::MAX_QUEUE_SIZE as u32);
        let host = mem.host(gpa, bytes as u64, hint)?;
        Some(DescTable { host, n: (bytes / 16).min(crate::ring::MAX_QUEUE_SIZE as u32) as u16 })
    }

    /// Entries.
    #[inline(always)]
    pub(crate) fn len(&self) -> u16 {
        self.n
    }

    /// Descriptor `i` as two words (see `read_desc_words`); zeros past the
    /// end (callers check `i` first: only a guard).
    #[inline(always)]
    pub(crate) fn read(&self, i: u16) -> (u64, u64) {
        if i >= self.n {
            return (0, 0);
        }
        // SAFETY: i < n and the table was translated with n * 16 bytes.
        unsafe { read_desc_words(self.host.add(i as usize * 16)) }
    }

    /// Descriptors `i..i + 4` (see `read`), with one bounds check; None
    /// past the end.
    #[inline(always)]
    pub(crate) fn read4(&self, i: u16) -> Option<[(u64, u64); 4]> {
        if i as usize + 4 > self.n as usize {
            return None;
        }
        // SAFETY: i + 4 <= n and the table was translated with n * 16 bytes.
        Some(std::array::from_fn(|k| unsafe { read_desc_words(self.host.add((i as usize + k) * 16)) }))
    }

    /// Starts fetching descriptor `i`'s line (no effect on correctness).
    #[inline(always)]
    pub(crate) fn prefetch(&self, i: u16) {
        prefetch(self.host.wrapping_add(i as usize * 16));
    }

    /// Starts fetching descriptor `i`'s line for writing.
    #[inline(always)]
    pub(crate) fn prefetch_write(&self, i: u16) {
        prefetch_write(self.host.wrapping_add(i as usize * 16));
    }
}

/// A split ring's three areas (virtio 1.2, 2.7): the descriptor table, the
/// available ring (driver-written) and the used ring (device-written).
/// Built with each area's full length for `size` entries (a power of two),
/// so every index, masked, stays inside.
pub(crate) struct SplitRing {
    pub(crate) desc: DescTable,
    avail: *const u8,
    used: *mut u8,
    used_gpa: u64,
    mask: u16,
    size: u16,
    log: RingLog,
}

const AVAIL_FLAGS: usize = 0;
const AVAIL_IDX: usize = 2;
const AVAIL_RING: usize = 4;
const USED_FLAGS: usize = 0;
const USED_IDX: usize = 2;
const USED_RING: usize = 4;

impl SplitRing {
    /// Translates and checks the areas of a ring of `size` entries.
    pub(crate) fn new(mem: &GuestMemory, desc: u64, avail: u64, used: u64, size: u16) -> Result<SplitRing, SetupError> {
        if size == 0 || size > crate::ring::MAX_QUEUE_SIZE || !size.is_power_of_two() {
            return Err(SetupError::BadSize);
        }
        let d = ring_area(mem, desc, desc_table_size(size), 16)?;
        let a = ring_area(mem, avail, avail_ring_size(size), 2)?;
        let u = ring_area(mem, used, used_ring_size(size), 4)?;
        Ok(SplitRing {
            desc: DescTable { host: d, n: size },
            avail: a,
            used: u,
            used_gpa: used,
            mask: size - 1,
            size,
            log: RingLog { log: mem.log.clone() },
        })
    }

    /// Logs used-ring stores at guest-physical `gpa` instead of where the
    /// ring was found (vhost-user's log_guest_addr). The frontend chooses
    /// it: offsets are added wrapping, and the log ignores pages past its end.
    pub(crate) fn log_used_at(&mut self, gpa: u64) {
        self.used_gpa = gpa;
    }

    #[inline(always)]
    fn avail_u16(&self, off: usize) -> u16 {
        debug_assert!(off + 2 <= avail_ring_size(self.size) as usize);
        // SAFETY: callers pass offsets of fields inside the available ring
        // (header, `slot & mask` entries, used_event), which `new` translated
        // with its full length; 2-aligned (checked at set-up).
        u16::from_le(unsafe { std::ptr::read_volatile(self.avail.add(off) as *const u16) })
    }

    #[inline(always)]
    fn used_u16(&self, off: usize) -> u16 {
        debug_assert!(off + 2 <= used_ring_size(self.size) as usize);
        // SAFETY: as avail_u16, for the used ring (4-aligned).
        u16::from_le(unsafe { std::ptr::read_volatile(self.used.add(off) as *const u16) })
    }

    #[inline(always)]
    fn set_used_u16(&self, off: usize, v: u16) {
        debug_assert!(off + 2 <= used_ring_size(self.size) as usize);
        // SAFETY: as used_u16; the used ring is the device's to write.
        unsafe { std::ptr::write_volatile(self.used.add(off) as *mut u16, v.to_le()) };
        self.log.mark(self.used_gpa.wrapping_add(off as u64), 2);
    }

    /// avail.flags.
    #[inline(always)]
    pub(crate) fn avail_flags(&self) -> u16 {
        self.avail_u16(AVAIL_FLAGS)
    }

    /// avail.idx.
    #[inline(always)]
    pub(crate) fn avail_idx(&self) -> u16 {
        self.avail_u16(AVAIL_IDX)
    }

    /// Starts fetching the lines of avail.idx and of avail.ring[idx mod
    /// size] (no effect on correctness).
    #[inline(always)]
    pub(crate) fn prefetch_avail(&self, idx: u16) {
        prefetch(self.avail.wrapping_add(AVAIL_IDX));
        prefetch(self.avail.wrapping_add(AVAIL_RING + 2 * (idx & self.mask) as usize));
    }

    /// avail.ring[idx mod size].
    #[inline(always)]
    pub(crate) fn avail_entry(&self, idx: u16) -> u16 {
        self.avail_u16(AVAIL_RING + 2 * (idx & self.mask) as usize)
    }

    /// used_event (after the available ring's entries; EVENT_IDX).
    #[inline(always)]
    pub(crate) fn used_event(&self) -> u16 {
        self.avail_u16(AVAIL_RING + 2 * self.size as usize)
    }

    /// used.idx as it is in memory.
    #[inline(always)]
    pub(crate) fn used_idx(&self) -> u16 {
        self.used_u16(USED_IDX)
    }

    /// Stores used.idx.
    #[inline(always)]
    pub(crate) fn set_used_idx(&self, v: u16) {
        self.set_used_u16(USED_IDX, v)
    }

    /// Stores used.flags.
    #[inline(always)]
    pub(crate) fn set_used_flags(&self, v: u16) {
        self.set_used_u16(USED_FLAGS, v)
    }

    /// Stores avail_event (after the used ring's entries; EVENT_IDX).
    #[inline(always)]
    pub(crate) fn set_avail_event(&self, v: u16) {
        self.set_used_u16(USED_RING + 8 * self.size as usize, v)
    }

    /// Writes used.ring[idx mod size] = {id, len}.
    #[inline(always)]
    pub(crate) fn set_used_elem(&self, idx: u16, id: u16, len: u32) {
        let off = USED_RING + 8 * (idx & self.mask) as usize;
        // SAFETY: the masked slot is one of `size` 8-byte entries after the
        // 4-byte header, inside the used ring translated with its full
        // length; 4-aligned (the ring is), so written as two u32s.
        unsafe {
            let p = self.used.add(off) as *mut u32;
            std::ptr::write_volatile(p, (id as u32).to_le());
            std::ptr::write_volatile(p.add(1), len.to_le());
        }
        self.log.mark(self.used_gpa.wrapping_add(off as u64), 8);
    }
}

/// A packed ring (virtio 1.2, 2.8): `size` descriptors written both ways,
/// and the driver's and the device's 4-byte event suppression areas.
pub(crate) struct PackedRing {
    pub(crate) desc: DescTable,
    desc_gpa: u64,
    driver_evt: *const u8,
    device_evt: *mut u8,
    device_gpa: u64,
    log: RingLog,
}

const DESC_LEN: usize = 8;
const DESC_ID: usize = 12;
const DESC_FLAGS: usize = 14;
const EVT_OFF_WRAP: usize = 0;
const EVT_FLAGS: usize = 2;

impl PackedRing {
    /// Translates and checks the areas of a ring of `size` entries.
    pub(crate) fn new(
        mem: &GuestMemory,
        desc: u64,
        driver: u64,
        device: u64,
        size: u16,
    ) -> Result<PackedRing, SetupError> {
        if size == 0 || size > crate::ring::MAX_QUEUE_SIZE {
            return Err(SetupError::BadSize);
        }
        let d = ring_area(mem, desc, desc_table_size(size), 16)?;
        let drv = ring_area(mem, driver, 4, 4)?;
        let dev = ring_area(mem, device, 4, 4)?;
        Ok(PackedRing {
            desc: DescTable { host: d, n: size },
            desc_gpa: desc,
            driver_evt: drv,
            device_evt: dev,
            device_gpa: device,
            log: RingLog { log: mem.log.clone() },
        })
    }

    /// The slot's flags word; 0 (not available) past the end.
    #[inline(always)]
    pub(crate) fn flags(&self, slot: u16) -> u16 {
        if slot >= self.desc.n {
            return 0;
        }
        // SAFETY: slot < size: inside the ring (translated with size * 16
        // bytes, 16-aligned, so the 2-byte field is aligned).
        u16::from_le(unsafe {
            std::ptr::read_volatile(self.desc.host.add(slot as usize * 16 + DESC_FLAGS) as *const u16)
        })
    }

    /// The flags words of the three slots after `slot`, with one bounds
    /// check; None past the end.
    #[inline(always)]
    pub(crate) fn flags_after(&self, slot: u16) -> Option<[u16; 3]> {
        if slot as usize + 4 > self.desc.n as usize {
            return None;
        }
        // SAFETY: slot + 3 < size: inside the ring, 2-aligned flags fields.
        Some(std::array::from_fn(|k| unsafe {
            u16::from_le(std::ptr::read_volatile(
                self.desc.host.add((slot as usize + 1 + k) * 16 + DESC_FLAGS) as *const u16
            ))
        }))
    }

    /// Stores the slot's flags word (the store that publishes a used descriptor).
    #[inline(always)]
    pub(crate) fn set_flags(&self, slot: u16, flags: u16) {
        if slot >= self.desc.n {
            return;
        }
        let off = slot as usize * 16 + DESC_FLAGS;
        // SAFETY: as `flags`; the device writes used descriptors into the ring.
        unsafe { std::ptr::write_volatile(self.desc.host.add(off) as *mut u16, flags.to_le()) };
        self.log.mark(self.desc_gpa + off as u64, 2);
    }

    /// Whether two slots' descriptors share a cache line.
    #[inline(always)]
    pub(crate) fn same_line(&self, a: u16, b: u16) -> bool {
        let line = |slot: u16| (self.desc.host as usize + slot as usize * 16) >> 6;
        line(a) == line(b)
    }

    /// Writes the slot's len and id (a used descriptor, flags stored later).
    #[inline(always)]
    pub(crate) fn set_len_id(&self, slot: u16, len: u32, id: u16) {
        if slot >= self.desc.n {
            return;
        }
        let base = slot as usize * 16;
        // SAFETY: slot < size: len (offset 8) and id (offset 12) are inside
        // the ring and aligned (16-aligned slots).
        unsafe {
            let p = self.desc.host.add(base);
            std::ptr::write_volatile(p.add(DESC_LEN) as *mut u32, len.to_le());
            std::ptr::write_volatile(p.add(DESC_ID) as *mut u16, id.to_le());
        }
        self.log.mark(self.desc_gpa + (base + DESC_LEN) as u64, 6);
    }

    /// Writes the slot's len, id and flags as one aligned 8-byte store, which
    /// the driver sees whole: a used descriptor after a batch's first.
    #[inline(always)]
    pub(crate) fn set_len_id_flags(&self, slot: u16, len: u32, id: u16, flags: u16) {
        if slot >= self.desc.n {
            return;
        }
        let off = slot as usize * 16 + DESC_LEN;
        let word = len as u64 | (id as u64) << 32 | (flags as u64) << 48;
        // SAFETY: slot < size: offset 8 of a 16-aligned slot is inside the
        // ring and 8-aligned. The ring is shared with the guest, outside
        // Rust's memory model; this side touches it only through raw-pointer
        // accesses, never references, and an aligned 8-byte store is
        // single-copy atomic on the hardware, which is what the driver relies on.
        unsafe { AtomicU64::from_ptr(self.desc.host.add(off) as *mut u64) }.store(word.to_le(), Ordering::Release);
        self.log.mark(self.desc_gpa + off as u64, 8);
    }

    /// The driver's event suppression flags.
    #[inline(always)]
    pub(crate) fn driver_event_flags(&self) -> u16 {
        // SAFETY: the area was translated with its 4 bytes, 4-aligned.
        u16::from_le(unsafe { std::ptr::read_volatile(self.driver_evt.add(EVT_FLAGS) as *const u16) })
    }

    /// The driver's event offset and wrap counter (EVENT_IDX); read after
    /// the flags, which the driver stores after it.
    #[inline(always)]
    pub(crate) fn driver_event_off_wrap(&self) -> u16 {
        // SAFETY: as driver_event_flags.
        u16::from_le(unsafe { std::ptr::read_volatile(self.driver_evt.add(EVT_OFF_WRAP) as *const u16) })
    }

    /// Stores the device event suppression area's flags.
    #[inline(always)]
    pub(crate) fn set_device_event_flags(&self, flags: u16) {
        // SAFETY: as driver_event, for the device's area (the device's to write).
        unsafe { std::ptr::write_volatile(self.device_evt.add(EVT_FLAGS) as *mut u16, flags.to_le()) };
        self.log.mark(self.device_gpa + EVT_FLAGS as u64, 2);
    }
}

// SAFETY: the ring pointers point into memory the owning queue keeps mapped
// (it holds the table); a ring is owned by one thread at a time.
unsafe impl Send for SplitRing {}
// SAFETY: as SplitRing.
unsafe impl Send for PackedRing {}
// SAFETY: a descriptor table's pointer is kept mapped by the queue that
// translated it (its ring's table, or an indirect table used while the
// queue walks a chain).
unsafe impl Send for DescTable {}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Arc<GuestMemory> {
        let m = Arc::new(Mapping::anonymous(3 * 4096).unwrap());
        // Two regions adjacent in guest-physical space, reversed in the mapping.
        let a = Region::new(0x1000, 4096, m.clone(), 4096).unwrap();
        let b = Region::new(0x2000, 4096, m.clone(), 0).unwrap();
        Arc::new(GuestMemory::from_regions(vec![b, a]).unwrap())
    }

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
    fn reads_and_writes_inside_and_at_edges() {
        let mem = table();
        assert!(mem.write(0x1ff8, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]), "crosses regions");
        let mut out = [0u8; 16];
        assert!(mem.read(0x1ff8, &mut out));
        assert_eq!(out, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);
        // The second half landed at the start of the mapping (region b).
        let mut b = [0u8; 8];
        assert!(mem.read(0x2000, &mut b));
        assert_eq!(b, [9, 10, 11, 12, 13, 14, 15, 16]);
        assert!(!mem.write(0x2ffc, &[0; 8]), "past the end");
        assert!(!mem.read(0xffc, &mut [0; 8]), "before the start");
        assert!(!mem.read(u64::MAX - 2, &mut [0; 8]), "wraps");
        assert!(mem.contains(0x1000, 4096));
        assert!(!mem.contains(0x1000, 4097), "crosses regions: not in one");
    }

    #[test]
    fn crossing_buffer_becomes_pieces() {
        let mem = table();
        let mut pieces = vec![];
        assert!(mem.for_each_seg(0x1ff0, 0x20, &mut 0, |s| pieces.push(s.len)));
        assert_eq!(pieces, vec![0x10, 0x10]);
        assert!(!mem.for_each_seg(0x2ff0, 0x20, &mut 0, |_| {}));
        assert!(!mem.for_each_seg(u64::MAX - 1, 4, &mut 0, |_| {}));
    }

    #[test]
    fn overlap_refused_and_removal() {
        let mem = table();
        let m = mem.regions()[0].mapping().clone();
        let c = Region::new(0x2800, 4096, m.clone(), 0).unwrap();
        assert_eq!(mem.with_region(c).unwrap_err(), MemoryError::Overlap);
        let mem2 = mem.without_region(0x1000, 4096).unwrap();
        assert_eq!(mem2.regions().len(), 1);
        assert_eq!(mem2.without_region(0x1000, 4096).unwrap_err(), MemoryError::NoSuchRegion);
    }

    #[test]
    fn region_must_fit_mapping() {
        let m = Arc::new(Mapping::anonymous(4096).unwrap());
        assert!(Region::new(0, 4097, m.clone(), 0).is_err());
        assert!(Region::new(0, 4096, m.clone(), 1).is_err());
        assert!(Region::new(u64::MAX - 10, 4096, m, 0).is_err());
    }

    #[test]
    fn mapping_accessors_are_bounded() {
        let m = Mapping::anonymous(4096).unwrap();
        m.store(4094, [1u8, 2]);
        assert_eq!(m.load::<2>(4094), [1, 2]);
        m.store(4095, [9u8, 9]);
        assert_eq!(m.load::<2>(4095), [0, 0], "out of range reads as zeros");
        assert_eq!(m.load::<1>(4095), [2], "and the store past the end did nothing");
        m.fill(0, 4097, 7);
        assert_eq!(m.load::<1>(0), [0], "a fill past the end does nothing");
        m.fill(0, 4096, 7);
        assert_eq!(m.load::<1>(4095), [7]);
    }

    #[test]
    fn copy_bytes_copies_exactly_n_bytes_at_every_size_and_alignment() {
        let src: Vec<u8> = (0..400u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in 0..=300 {
            for (so, d_off) in [(0, 0), (1, 3), (5, 17), (31, 1)] {
                let mut dst = vec![0xAAu8; 400];
                // SAFETY: so + n <= 331 < 400 and 8 + d_off + n <= 325 < 400;
                // two separate vectors.
                unsafe { copy_bytes(src.as_ptr().add(so), dst.as_mut_ptr().add(8 + d_off), n) };
                let at = 8 + d_off;
                assert_eq!(&dst[at..at + n], &src[so..so + n], "n {n} src offset {so}");
                assert!(dst[..at].iter().all(|&b| b == 0xAA), "n {n}: wrote before the range");
                assert!(dst[at + n..].iter().all(|&b| b == 0xAA), "n {n}: wrote after the range");
            }
        }
    }

    /// Segments of `lens` bytes laid out in `mem` from gpa 0x1000 with a gap
    /// of 16 between them, filled with 0xEE.
    fn segs_at(mem: &GuestMemory, lens: &[u32]) -> Vec<Seg> {
        let mut gpa = 0x1000;
        lens.iter()
            .map(|&l| {
                // The segment and the gap after it.
                assert!(mem.write(gpa, &vec![0xEE; l as usize + 16]));
                let s = mem.seg(gpa, l, &mut 0).unwrap();
                gpa += l as u64 + 16;
                s
            })
            .collect()
    }

    #[test]
    fn store_body_start_stores_sixteen_bytes_where_the_body_goes_or_nothing() {
        let mem = table();
        let body: Vec<u8> = (0..64u8).map(|i| i ^ 0x5a).collect();
        // The bytes from 0x1000 over the segments and their 16-byte gaps.
        let image = |lens: &[u32]| {
            let mut b = vec![0u8; lens.iter().map(|&l| l as usize + 16).sum()];
            assert!(mem.read(0x1000, &mut b));
            b
        };
        // Room for header and body: bytes 12..28 are the body's first 16.
        let segs = segs_at(&mem, &[12 + 64]);
        GuestBufs::new(&segs, &mem).store_body_start(12, &body);
        let got = image(&[12 + 64]);
        assert!(got[..12].iter().all(|&b| b == 0xEE), "header bytes written");
        assert_eq!(&got[12..28], &body[..16]);
        assert!(got[28..].iter().all(|&b| b == 0xEE), "wrote past the 16 bytes");
        // No room for the whole body, a body under 16 bytes, or a first
        // buffer shorter than header and body: nothing is written.
        for (lens, len) in [(&[12 + 63][..], 64), (&[40][..], 15), (&[5, 40, 60][..], 64)] {
            let segs = segs_at(&mem, lens);
            GuestBufs::new(&segs, &mem).store_body_start(12, &body[..len]);
            assert!(image(lens).iter().all(|&b| b == 0xEE), "segments {lens:?}, body {len}: wrote");
        }
    }

    #[test]
    fn write_header_and_writes_header_and_body_and_nothing_else() {
        let mem = table();
        let hdr = (u64::from_le_bytes([1, 2, 3, 4, 5, 6, 7, 8]), u32::from_le_bytes([9, 10, 11, 12]));
        let long: Vec<u8> = (0..64u8).map(|i| i ^ 0x5a).collect();
        for hdr_len in [10, 12] {
            // An empty body too: nothing past the header may be written.
            for body in [&long[..], &[]] {
                let want: Vec<u8> =
                    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12][..hdr_len].iter().chain(body).copied().collect();
                let check = |segs: &[Seg], how: &str| {
                    let mut got = vec![];
                    for s in segs {
                        let mut b = vec![0u8; s.len as usize + 16];
                        // The segment and the 16-byte gap after it.
                        let gpa = 0x1000 + (s.addr as u64 - segs[0].addr as u64);
                        mem.read(gpa, &mut b);
                        assert!(b[s.len as usize..].iter().all(|&x| x == 0xEE), "{how}: wrote past a segment");
                        got.extend_from_slice(&b[..s.len as usize]);
                    }
                    assert_eq!(&got[..want.len()], &want[..], "{how}, header {hdr_len}, body {}", body.len());
                    assert!(got[want.len()..].iter().all(|&b| b == 0xEE), "{how}: wrote past the body");
                };
                // One buffer (the fast path), exactly the size or with room to spare.
                for spare in [0, 7] {
                    let segs = segs_at(&mem, &[(want.len() + spare) as u32]);
                    GuestBufs::new(&segs, &mem).write_header_and(hdr, hdr_len, body);
                    check(&segs, "one buffer");
                }
                // Three buffers, the first shorter than the header.
                let segs = segs_at(&mem, &[5, 40, 60]);
                GuestBufs::new(&segs, &mem).write_header_and(hdr, hdr_len, body);
                check(&segs, "three buffers");
            }
        }
    }

    #[test]
    fn a_header_in_place_is_kept_and_one_differing_in_any_word_is_stored() {
        let mem = table();
        let segs = segs_at(&mem, &[76]);
        let v = GuestBufs::new(&segs, &mem);
        let nb1 = (0u64, 1u32 << 16);
        // The same header twice, then one differing in num_buffers only,
        // then in the first word only, then back.
        for (k, hdr) in [nb1, nb1, (0, 2 << 16), (0x0102, 2 << 16), (0x0102, 2 << 16), nb1].into_iter().enumerate() {
            let body = [k as u8 + 1; 64];
            v.write_header_and(hdr, 12, &body);
            let mut got = [0u8; 76];
            mem.read(0x1000, &mut got);
            assert_eq!(got[..8], hdr.0.to_le_bytes(), "write {k}: bytes 0-7");
            assert_eq!(got[8..12], hdr.1.to_le_bytes(), "write {k}: bytes 8-11");
            assert_eq!(got[12..], body, "write {k}: body");
        }
    }

    #[test]
    fn views_copy_across_pieces_and_stop_at_the_end() {
        let mem = table();
        let segs = segs_at(&mem, &[3, 5, 8]);
        let v = GuestBufs::new(&segs, &mem);
        assert_eq!(v.bytes(), 16);
        assert_eq!(v.write(2, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]), 14, "ends first");
        let mut out = [0u8; 20];
        assert_eq!(v.read(0, &mut out), 16);
        assert_eq!(&out[..16], &[0xEE, 0xEE, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
        assert_eq!(v.read(15, &mut out[..4]), 1);
        assert_eq!(v.read(16, &mut out[..4]), 0);
        assert_eq!(v.write(99, &[1]), 0);
    }

    #[test]
    fn lent_buffers_follow_the_limits_and_hold_the_memory() {
        let mem = table();
        let segs = segs_at(&mem, &[16, 512, 1024]);
        let v = GuestBufs::new(&segs, &mem);
        let mut io = IoBufs::with_capacity(4);
        assert!(!v.lend(16, usize::MAX, 1, 4096, &mut io), "two pieces, one allowed");
        assert_eq!(io.pieces(), 0, "unchanged after a refusal");
        assert!(!v.lend(16, usize::MAX, 4, 1000, &mut io), "a piece above the largest");
        assert!(v.lend(16, 1023, 4, 4096, &mut io));
        assert_eq!((io.pieces(), io.data_len()), (2, 1023));
        assert!(v.lend_last_byte(&mut io));
        assert!(io.write_status(0x5a));
        let mut last = [0u8; 1];
        mem.read(0x1000 + 16 + 16 + 512 + 16 + 1023, &mut last);
        assert_eq!(last, [0x5a]);
        let held = Arc::strong_count(&mem);
        io.clear();
        assert!(!io.write_status(1));
        assert_eq!((io.pieces(), Arc::strong_count(&mem)), (0, held), "clear keeps the table held");
        let mut hold = None;
        assert!(mem.lend(0x1000, 16, &mut io));
        io.renew_hold(&mut hold);
        assert_eq!(Arc::strong_count(&mem), held + 1, "a hold of its own");
        io.renew_hold(&mut hold);
        assert_eq!(Arc::strong_count(&mem), held + 1, "renewing the same table takes no second hold");
        io.release();
        assert_eq!(Arc::strong_count(&mem), held, "release lets go of the table");
        io.renew_hold(&mut hold);
        assert!(hold.is_none(), "nothing lent: no hold");
    }

    #[test]
    fn data_copied_to_and_from_memory_in_order_streamed_or_not() {
        let m = Arc::new(Mapping::anonymous(7 * 4096).unwrap());
        let mem = Arc::new(GuestMemory::from_regions(vec![Region::new(0x1000, 7 * 4096, m, 0).unwrap()]).unwrap());
        // Pieces of odd lengths and places, one empty, one of whole blocks.
        let pieces: [(u64, u64); 5] = [(0x1003, 5), (0x2000, 0), (0x2011, 200), (0x3000, 4096), (0x5009, 67)];
        let total: usize = pieces.iter().map(|p| p.1 as usize).sum();
        let data: Vec<u8> = (0..total).map(|i| (i * 7 + 3) as u8).collect();
        let mut io = IoBufs::new();
        let mut at = 0;
        for &(gpa, len) in &pieces {
            assert!(mem.write(gpa, &data[at..at + len as usize]));
            assert!(mem.lend(gpa, len, &mut io));
            at += len as usize;
        }
        assert_eq!(io.data_len() as usize, total);
        for streaming in [false, true] {
            // Every alignment of the destination against the 16-byte blocks.
            for skew in 0..17 {
                let mut out = vec![0xeeu8; total + 32];
                // SAFETY: `out` has room for total bytes after skew; it is
                // not guest memory.
                unsafe { io.copy_from_data(out.as_mut_ptr().add(skew), streaming) };
                fence_streamed_stores();
                assert_eq!(&out[skew..skew + total], &data[..], "streaming {streaming}, skew {skew}");
                assert!(out[..skew].iter().chain(&out[skew + total..]).all(|&x| x == 0xee), "nothing around it");
            }
        }
        let back: Vec<u8> = data.iter().map(|x| !x).collect();
        // SAFETY: `back` holds total bytes and is not guest memory.
        unsafe { io.copy_to_data(back.as_ptr()) };
        let mut at = 0;
        for &(gpa, len) in &pieces {
            let mut got = vec![0u8; len as usize];
            assert!(mem.read(gpa, &mut got));
            assert_eq!(got, back[at..at + len as usize], "piece at {gpa:#x}");
            at += len as usize;
        }
        let mut before = [0u8; 3];
        assert!(mem.read(0x1000, &mut before));
        assert_eq!(before, [0; 3], "nothing before the first piece");
    }

    #[test]
    fn a_reply_and_a_header_in_the_first_of_several_buffers() {
        let mem = table();
        let segs = segs_at(&mem, &[16, 64]);
        let v = GuestBufs::new(&segs, &mem);
        let mut io = IoBufs::new();
        assert!(v.lend_front(12, &mut io));
        assert_eq!(io.write_reply(&[7; 16]), 12, "the reply is 12 bytes of the first buffer");
        let mut got = [0u8; 16];
        assert_eq!(v.read(0, &mut got), 16);
        assert_eq!((&got[..12], &got[12..]), (&[7u8; 12][..], &[0xEE; 4][..]));
        // From inside the first buffer, then across into the second.
        assert_eq!(v.read(4, &mut got[..12]), 12);
        assert_eq!(&got[..12], &[7, 7, 7, 7, 7, 7, 7, 7, 0xEE, 0xEE, 0xEE, 0xEE]);
        let mut across = [0u8; 20];
        assert_eq!(v.read(10, &mut across), 20);
        assert_eq!(&across[..2], &[7, 7]);
        assert!(across[2..].iter().all(|&b| b == 0xEE));
        assert_eq!(v.read(70, &mut across), 10, "the buffers end first");
    }

    #[test]
    fn a_reply_lent_across_pieces_is_stored_whole_and_no_further() {
        let mem = table();
        let segs = segs_at(&mem, &[3, 5, 64]);
        let v = GuestBufs::new(&segs, &mem);
        let mut io = IoBufs::new();
        assert!(!v.lend_front(73, &mut io), "more than the buffers hold");
        assert!(v.lend_front(10, &mut io));
        assert!(v.lend(10, usize::MAX, 4, 4096, &mut io));
        assert_eq!(io.data_len(), 62, "data starts after the reply");
        let bytes: Vec<u8> = (1..=12).collect();
        assert_eq!(io.write_reply(&bytes), 10, "cut to the reply's length");
        let mut got = [0u8; 72];
        assert_eq!(v.read(0, &mut got), 72);
        assert_eq!(&got[..10], &bytes[..10]);
        assert_eq!(got[10], 0xEE, "the data is untouched");
        let many: Vec<u32> = vec![1; MAX_REPLY_PIECES + 1];
        let segs = segs_at(&mem, &many);
        let v = GuestBufs::new(&segs, &mem);
        io.clear();
        assert!(v.lend_front(MAX_REPLY_PIECES, &mut io));
        assert!(!v.lend_front(MAX_REPLY_PIECES + 1, &mut io), "too many pieces");
        assert_eq!(io.write_reply(&[1]), 0, "a refused reply is not kept");
    }

    #[test]
    fn a_reply_head_is_stored_in_one_piece_or_across_pieces() {
        let mem = table();
        let head: [u8; 12] = std::array::from_fn(|i| i as u8 + 1);
        let first = u64::from_le_bytes(head[..8].try_into().unwrap());
        let second = u32::from_le_bytes(head[8..].try_into().unwrap());
        for pieces in [&[108u32][..], &[5, 7, 96], &[12], &[3, 4]] {
            let segs = segs_at(&mem, pieces);
            let v = GuestBufs::new(&segs, &mem);
            let total: u32 = pieces.iter().sum();
            let lent = (total as usize).min(108);
            let mut io = IoBufs::new();
            assert!(v.lend_front(lent, &mut io));
            let want = lent.min(12);
            assert_eq!(io.write_reply_head(first, second), want, "pieces {pieces:?}");
            let mut got = vec![0u8; total as usize];
            assert_eq!(v.read(0, &mut got), total as usize);
            assert_eq!(&got[..want], &head[..want], "pieces {pieces:?}");
            assert!(got[want..].iter().all(|&b| b == 0xEE), "nothing past the head: pieces {pieces:?}");
        }
        assert_eq!(IoBufs::new().write_reply_head(first, second), 0, "no reply lent");
    }

    #[test]
    fn every_store_marks_its_pages_when_a_log_is_set() {
        let m = Arc::new(Mapping::anonymous(4 * 4096).unwrap());
        let logmap = Arc::new(Mapping::anonymous(4096).unwrap());
        let log = Arc::new(DirtyLog::new(logmap, 0, 4096).unwrap());
        let plain = GuestMemory::from_regions(vec![Region::new(0x10000, 4 * 4096, m, 0).unwrap()]).unwrap();
        // Without the log nothing is marked.
        let unlogged = Arc::new(plain.clone());
        assert!(unlogged.write(0x10000, &[1; 16]) && unlogged.write(0x10fff, &[1; 2]));
        assert!((0..64).all(|p| !log.is_marked(p)));
        let mem = Arc::new(plain.with_log(Some(log.clone())));
        let page = |gpa: u64| gpa / LOG_PAGE;
        assert!(mem.write(0x10ffe, &[1, 2, 3, 4]), "crosses a page");
        assert!(log.is_marked(page(0x10ffe)) && log.is_marked(page(0x11000)));
        assert!(!log.is_marked(page(0x12000)));
        let segs = vec![mem.seg(0x12010, 64, &mut 0).unwrap()];
        GuestBufs::new(&segs, &mem).write(0, &[7; 8]);
        assert!(log.is_marked(page(0x12010)));
        let mut io = IoBufs::default();
        assert!(mem.lend(0x13000, 16, &mut io));
        assert!(!log.is_marked(page(0x13000)), "lent, not yet written");
        io.data_written();
        assert!(log.is_marked(page(0x13000)));
    }

    #[test]
    fn io_bufs_hold_one_table_only() {
        // One MemoryHold covers all of an IoBufs' pieces: pieces of a second
        // table would stay unheld, so lending them is refused.
        let (a, b) = (table(), table());
        let mut io = IoBufs::default();
        assert!(a.lend(0x1000, 16, &mut io));
        assert!(!b.lend(0x1000, 16, &mut io), "a second table");
        let segs = vec![b.seg(0x1000, 64, &mut 0).unwrap()];
        let v = GuestBufs::new(&segs, &b);
        assert!(!v.lend(0, 16, 4, 4096, &mut io));
        assert!(!v.lend_last_byte(&mut io));
        assert_eq!((io.pieces(), io.data_len()), (1, 16), "unchanged after the refusals");
        assert!(a.lend(0x2000, 16, &mut io), "the same table still joins");
        io.clear();
        assert!(v.lend(0, 16, 4, 4096, &mut io), "an emptied IoBufs takes any table");
        assert!(v.lend_last_byte(&mut io));
    }

    #[test]
    fn a_store_to_aliased_memory_marks_every_address_of_it() {
        // Two regions over the same pages: a write through one changes both.
        let m = Arc::new(Mapping::anonymous(4096).unwrap());
        let logmap = Arc::new(Mapping::anonymous(4096).unwrap());
        let log = Arc::new(DirtyLog::new(logmap, 0, 4096).unwrap());
        let a = Region::new(0x10000, 4096, m.clone(), 0).unwrap();
        let b = Region::new(0x40000, 4096, m, 0).unwrap();
        let mem = Arc::new(GuestMemory::from_regions(vec![a, b]).unwrap().with_log(Some(log.clone())));
        let segs = vec![mem.seg(0x10010, 64, &mut 0).unwrap()];
        GuestBufs::new(&segs, &mem).write(0, &[7; 8]);
        assert!(log.is_marked(0x10000 / LOG_PAGE) && log.is_marked(0x40000 / LOG_PAGE));
    }
}
