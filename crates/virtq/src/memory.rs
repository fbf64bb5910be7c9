//! The guest memory table: regions mapped once, guest-physical and
//! frontend-virtual addresses translated to host pointers with bounds checks.
//!
//! A `GuestMemory` is immutable once built. A memory-table change builds a new
//! table (sharing the unchanged mappings) and the dataplane switches to it
//! while its queues are stopped, so the hot path takes no lock.

use std::fs::File;
use std::io;
use std::os::unix::io::AsRawFd;
use std::sync::Arc;

/// One `mmap` of a file descriptor the frontend sent. Unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    addr: *mut u8,
    len: usize,
    sealed: bool,
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

// SAFETY: the mapping is a plain shared memory area; the pointer is only used
// to derive addresses and is valid until drop, which needs exclusive ownership.
unsafe impl Send for Mapping {}
// SAFETY: as above; concurrent access goes through raw pointers, never references.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` starting at `offset`, shared, read-write.
    pub fn map(file: &File, offset: u64, len: u64) -> io::Result<Arc<Mapping>> {
        if len == 0 || len > isize::MAX as u64 || offset.checked_add(len).is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad mapping size"));
        }
        let page = page_size();
        if !offset.is_multiple_of(page) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "mapping offset not page aligned"));
        }
        // A frontend that shrinks the file under us would make the next
        // access raise SIGBUS: seal it against shrinking where the file can
        // be sealed (memfds made with MFD_ALLOW_SEALING, as QEMU's are),
        // before checking its size.
        let sealed = seal_shrink(file.as_raw_fd());
        // Refuse mappings past the end of a regular file: touching such pages
        // would raise SIGBUS in the dataplane. (memfds and hugetlbfs files are
        // regular files too.)
        let meta = file.metadata()?;
        if meta.is_file() && offset + len > meta.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("region [{offset:#x}, +{len:#x}) is past the end of its file ({:#x} bytes)", meta.len()),
            ));
        }
        // SAFETY: we ask the kernel for a new mapping at an address of its
        // choice; the arguments are checked above and the result is checked below.
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
        register(addr as usize, len as usize);
        Ok(Arc::new(Mapping { addr: addr as *mut u8, len: len as usize, sealed }))
    }

    /// Whether the file cannot shrink under the mapping (sealed, or
    /// anonymous). A frontend that truncates an unsealed file (a hugetlbfs
    /// or plain file) can still crash the process.
    pub fn sealed(&self) -> bool {
        self.sealed
    }

    /// Anonymous shared memory, for tests and for frontends that own their memory.
    pub fn anonymous(len: usize) -> io::Result<Arc<Mapping>> {
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
        Ok(Arc::new(Mapping { addr: addr as *mut u8, len, sealed: true }))
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping (never built by this module).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        unregister(self.addr as usize);
        // SAFETY: addr/len are exactly what mmap returned; nobody holds the
        // Arc any more, so no pointer into it is used after this.
        unsafe {
            libc::munmap(self.addr as *mut libc::c_void, self.len);
        }
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

/// One region of the memory table.
#[derive(Clone, Debug)]
pub struct Region {
    /// Guest-physical start address.
    pub gpa: u64,
    /// Size in bytes.
    pub size: u64,
    /// The frontend's virtual address of the region start (vhost-user ring
    /// addresses are given in this space).
    pub uaddr: u64,
    host: *mut u8,
    mapping: Arc<Mapping>,
}

// SAFETY: `host` points into `mapping`, which is Send+Sync and kept alive by the Arc.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// A region backed by `mapping` starting `offset` bytes into it.
    pub fn new(gpa: u64, size: u64, uaddr: u64, mapping: Arc<Mapping>, offset: u64) -> io::Result<Region> {
        let fits = offset.checked_add(size).map(|end| end <= mapping.len() as u64).unwrap_or(false);
        if size == 0 || !fits || gpa.checked_add(size).is_none() || uaddr.checked_add(size).is_none() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "region does not fit its mapping"));
        }
        // SAFETY: offset + size <= mapping.len, checked above.
        let host = unsafe { mapping.as_ptr().add(offset as usize) };
        Ok(Region { gpa, size, uaddr, host, mapping })
    }

    /// Host address of the region start.
    pub fn host(&self) -> *mut u8 {
        self.host
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
    /// Two regions overlap in guest-physical or frontend-virtual space.
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
}

impl GuestMemory {
    /// An empty table.
    pub fn new() -> GuestMemory {
        GuestMemory { regions: Vec::new() }
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
        let overlaps = |a: u64, alen: u64, b: u64, blen: u64| a < b + blen && b < a + alen;
        for r in &self.regions {
            if overlaps(r.gpa, r.size, region.gpa, region.size) || overlaps(r.uaddr, r.size, region.uaddr, region.size)
            {
                return Err(MemoryError::Overlap);
            }
        }
        let mut regions = self.regions.clone();
        let pos = regions.partition_point(|r| r.gpa < region.gpa);
        regions.insert(pos, region);
        Ok(GuestMemory { regions })
    }

    /// A copy of the table without the region at `gpa` of `size` bytes.
    pub fn without_region(&self, gpa: u64, size: u64) -> Result<GuestMemory, MemoryError> {
        let pos = self.regions.iter().position(|r| r.gpa == gpa && r.size == size).ok_or(MemoryError::NoSuchRegion)?;
        let mut regions = self.regions.clone();
        regions.remove(pos);
        Ok(GuestMemory { regions })
    }

    /// The regions, sorted by guest-physical address.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Index of the region holding `gpa`, trying `hint` first.
    #[inline]
    pub fn find(&self, gpa: u64, hint: usize) -> Option<usize> {
        if let Some(r) = self.regions.get(hint) {
            if r.contains_gpa(gpa) {
                return Some(hint);
            }
        }
        let pos = self.regions.partition_point(|r| r.gpa <= gpa);
        if pos == 0 {
            return None;
        }
        if self.regions[pos - 1].contains_gpa(gpa) {
            Some(pos - 1)
        } else {
            None
        }
    }

    /// Host pointer for `len` bytes at guest-physical `gpa`, when they lie
    /// within one region. `hint` is a per-caller last-hit cache.
    #[inline]
    pub fn translate(&self, gpa: u64, len: u64, hint: &mut usize) -> Option<*mut u8> {
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

    /// Calls `f(host, len)` for each piece of the guest buffer [gpa, gpa+len)
    /// as it falls into regions. Returns false (having called `f` for a
    /// prefix only) if part of the buffer is not in the table.
    #[inline]
    pub fn for_each_piece(
        &self,
        mut gpa: u64,
        mut len: u64,
        hint: &mut usize,
        mut f: impl FnMut(*mut u8, u64),
    ) -> bool {
        if gpa.checked_add(len).is_none() {
            return false;
        }
        while len > 0 {
            let Some(i) = self.find(gpa, *hint) else { return false };
            *hint = i;
            let r = &self.regions[i];
            let off = gpa - r.gpa;
            let n = len.min(r.size - off);
            // SAFETY: off + n <= size.
            f(unsafe { r.host.add(off as usize) }, n);
            gpa += n;
            len -= n;
        }
        true
    }

    /// Host pointer for `len` bytes at the frontend's virtual address `uaddr`
    /// (how vhost-user gives ring addresses), within one region.
    pub fn translate_uaddr(&self, uaddr: u64, len: u64) -> Option<*mut u8> {
        for r in &self.regions {
            let off = uaddr.wrapping_sub(r.uaddr);
            if off < r.size && len <= r.size - off {
                // SAFETY: off + len <= size.
                return Some(unsafe { r.host.add(off as usize) });
            }
        }
        None
    }

    /// Guest-physical address of a frontend virtual address, if mapped.
    pub fn uaddr_to_gpa(&self, uaddr: u64) -> Option<u64> {
        self.regions.iter().find_map(|r| {
            let off = uaddr.wrapping_sub(r.uaddr);
            (off < r.size).then(|| r.gpa + off)
        })
    }
}

// ---- surviving a frontend that truncates its memory ----------------------
//
// A file the frontend can still shrink (not sealable: hugetlbfs, a plain
// file) makes our next access to the lost pages raise SIGBUS. The handler
// below finds the mapping the fault is in, replaces the whole mapping with
// private zero pages (so the access, retried, reads zeros: the rings then
// look broken and the device asks for a reset) and counts it. Faults
// anywhere else keep their default action.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

const SLOTS: usize = 1024;
static STARTS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static LENS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static LOST: AtomicU64 = AtomicU64::new(0);

fn register(addr: usize, len: usize) {
    for (s, l) in STARTS.iter().zip(LENS.iter()) {
        if s.compare_exchange(0, addr, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            l.store(len, Ordering::Release);
            return;
        }
    }
    // More live mappings than slots: this one is not covered.
}

fn unregister(addr: usize) {
    for (s, l) in STARTS.iter().zip(LENS.iter()) {
        if s.load(Ordering::Acquire) == addr {
            l.store(0, Ordering::Release);
            s.store(0, Ordering::Release);
            return;
        }
    }
}

/// Mappings replaced by zero pages after their file shrank (since start).
pub fn lost_mappings() -> u64 {
    LOST.load(Ordering::Relaxed)
}

/// Installs the SIGBUS handler (once, early; before threads start).
pub fn install_sigbus_handler() -> io::Result<()> {
    // SAFETY: installs an async-signal-safe handler (see on_sigbus).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t; si_addr is the fault
    // address for SIGBUS. Only atomics and async-signal-safe calls follow.
    let addr = unsafe { (*info).si_addr() } as usize;
    for (s, l) in STARTS.iter().zip(LENS.iter()) {
        let start = s.load(Ordering::Acquire);
        let len = l.load(Ordering::Acquire);
        if start != 0 && len != 0 && addr >= start && addr < start + len {
            // SAFETY: replaces exactly our own mapping [start, start+len)
            // with private anonymous memory; nothing else lives there.
            let r = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if r != libc::MAP_FAILED {
                LOST.fetch_add(1, Ordering::Relaxed);
                return;
            }
            break;
        }
    }
    // Not ours: the default action (the fault repeats on return).
    // SAFETY: signal(2) is async-signal-safe.
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> (GuestMemory, Arc<Mapping>) {
        let m = Mapping::anonymous(3 * 4096).unwrap();
        // Two regions adjacent in guest-physical space, reversed in the mapping.
        let a = Region::new(0x1000, 4096, 0x7000_0000, m.clone(), 4096).unwrap();
        let b = Region::new(0x2000, 4096, 0x7100_0000, m.clone(), 0).unwrap();
        (GuestMemory::from_regions(vec![b, a]).unwrap(), m)
    }

    #[test]
    fn translate_inside_and_at_edges() {
        let (mem, m) = table();
        let mut h = 0;
        assert_eq!(mem.translate(0x1000, 4096, &mut h), Some(unsafe { m.as_ptr().add(4096) }));
        assert_eq!(mem.translate(0x1fff, 1, &mut h), Some(unsafe { m.as_ptr().add(8191) }));
        assert_eq!(mem.translate(0x1fff, 2, &mut h), None, "crosses regions");
        assert_eq!(mem.translate(0x3000, 1, &mut h), None, "past the end");
        assert_eq!(mem.translate(0xfff, 1, &mut h), None, "before the start");
        assert_eq!(mem.translate(u64::MAX, 1, &mut h), None);
    }

    #[test]
    fn crossing_buffer_becomes_pieces() {
        let (mem, m) = table();
        let mut pieces = vec![];
        let mut h = 0;
        assert!(mem.for_each_piece(0x1ff0, 0x20, &mut h, |p, n| pieces.push((p, n))));
        assert_eq!(pieces, vec![(unsafe { m.as_ptr().add(4096 + 0xff0) }, 0x10), (m.as_ptr(), 0x10)]);
        assert!(!mem.for_each_piece(0x2ff0, 0x20, &mut h, |_, _| {}));
        assert!(!mem.for_each_piece(u64::MAX - 1, 4, &mut h, |_, _| {}));
    }

    #[test]
    fn overlap_refused_and_removal() {
        let (mem, m) = table();
        let c = Region::new(0x2800, 4096, 0x7200_0000, m.clone(), 0).unwrap();
        assert_eq!(mem.with_region(c).unwrap_err(), MemoryError::Overlap);
        let d = Region::new(0x9000, 4096, 0x7000_0800, m.clone(), 0).unwrap();
        assert_eq!(mem.with_region(d).unwrap_err(), MemoryError::Overlap, "uaddr overlap");
        let mem2 = mem.without_region(0x1000, 4096).unwrap();
        assert_eq!(mem2.regions().len(), 1);
        assert_eq!(mem2.without_region(0x1000, 4096).unwrap_err(), MemoryError::NoSuchRegion);
    }

    #[test]
    fn uaddr_translation() {
        let (mem, m) = table();
        assert_eq!(mem.translate_uaddr(0x7100_0010, 16), Some(unsafe { m.as_ptr().add(16) }));
        assert_eq!(mem.translate_uaddr(0x7100_0ff8, 16), None);
        assert_eq!(mem.uaddr_to_gpa(0x7000_0004), Some(0x1004));
    }

    #[test]
    fn region_must_fit_mapping() {
        let m = Mapping::anonymous(4096).unwrap();
        assert!(Region::new(0, 4097, 0, m.clone(), 0).is_err());
        assert!(Region::new(0, 4096, 0, m.clone(), 1).is_err());
        assert!(Region::new(u64::MAX - 10, 4096, 0, m, 0).is_err());
    }
}
