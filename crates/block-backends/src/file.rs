//! The file backend: an image file (or block device) served through io_uring.
//!
//! Design:
//! - **One ring per queue.** `open` opens the file once and builds one
//!   [`FileBackend`] per request queue; they share the file (`Arc<File>`)
//!   but each has its own io_uring, so a dataplane thread owns its ring
//!   outright and no lock is taken for reads and writes (a tmpfs image's
//!   discards take its `ImageState`'s, below).
//! - **A slab of in-flight slots.** Each backend preallocates `depth` slots
//!   and, for each slot, room for [`MAX_SEGS`] iovecs. A request takes a free
//!   slot; the SQE's `user_data` is the slot index, and the slot holds the
//!   device's tag, what is left to do and the iovecs the kernel reads. The
//!   slot is freed when its completion is reaped, so the iovecs outlive the
//!   request; so does the slot's hold on the guest memory they point into.
//!   Nothing is allocated after construction (but a tmpfs image's look
//!   for holes, below, which runs on a thread of its own).
//! - **One submit per batch.** `queue` only fills SQEs; `submit` hands them
//!   all to the kernel with one `io_uring_enter`. The ring has at least
//!   `depth` entries and every in-flight slot has at most one SQE, so the
//!   submission queue never fills and the completion queue (twice the size)
//!   never overflows.
//! - **Short transfers are finished.** A read or write that moved fewer
//!   bytes than asked is resubmitted for the rest from `reap` (which then
//!   makes its own `submit` call); a 0-byte transfer is reported as -EIO.
//! - **Write-zeroes without unmap** is `FALLOC_FL_ZERO_RANGE`. Where the
//!   file system lacks it (EOPNOTSUPP, e.g. tmpfs) the backend falls back,
//!   from then on, to punching a hole and allocating the range again
//!   (zeroes, and the space stays allocated as the request demands).
//! - **tmpfs and ramfs: reads and writes in the calling thread.** Their
//!   buffered I/O never waits on a device (only on swap, if pages were
//!   swapped out), yet the kernel offers them no non-blocking attempt
//!   (RWF_NOWAIT is EOPNOTSUPP there), so io_uring would hand every request
//!   to an io-wq worker: a thread hop and a wake-up per request, for a
//!   copy. Instead `queue` runs them with preadv/pwritev (short transfers
//!   finished as below) and the next `reap` returns their completions;
//!   nothing signals the completion fd for them, and the devices reap
//!   after every submit. Flush, discard, write-zeroes, O_DIRECT and block
//!   devices (whose /dev node is on devtmpfs) still go through io_uring.
//! - **A fully allocated tmpfs image: copies through a mapping.** Most of
//!   a preadv's cost on tmpfs is the call and the page-cache lookup (a
//!   random 4 KiB read here: 2250 cycles against 1000 for a copy from a
//!   mapping). So a tmpfs image is mapped once, shared by the queues, and
//!   while it has no hole (st_blocks cover its size and SEEK_HOLE finds
//!   none before the end) its reads and writes are plain copies between
//!   the mapping and the guest's buffers; write-zeroes without unmap of
//!   up to 1 MiB stores zeros there. Only while nothing can allocate: a
//!   mapping's read of a hole allocates the page (a preadv does not), and
//!   a write into one that cannot be allocated faults rather than failing
//!   with ENOSPC. Every open of the file in this process (two devices, or
//!   two LUNs) shares one `ImageState`. The copies start when an open
//!   finds the image fully allocated, and stop (logged) at the first
//!   discard or write-zeroes with unmap queued through any open, at a
//!   larger write-zeroes whose hole the kernel fails to allocate again, or
//!   at an open that finds a hole nobody here made; meanwhile
//!   preadv/pwritev as above. They resume (logged) once the holes are
//!   written again (fallocate alone leaves the tmpfs pages it allocates
//!   unwritten, which SEEK_HOLE reports as holes): while they are stopped,
//!   every 64th request that misses the mapping looks at the clock, and at
//!   most once a second (`LOOK_EVERY`) fstats the image; if its blocks
//!   cover it, a thread of its own (unpinned) runs the SEEK_HOLE walk (14
//!   ms for a 1 GiB image, too long for a dataplane), and the copies
//!   resume if it found no hole and nothing that makes one (a discard, a
//!   write-zeroes punching its hole, a stop) ran or started meanwhile. A
//!   copy already past its check when another thread punches an
//!   overlapping range is the guest's race, as with preadv.
//!   The mapping needs virtq's SIGBUS handler installed (vhostd installs
//!   it at start). If someone truncates the image, the access past the new
//!   end raises SIGBUS; the handler replaces the mapping with zero pages
//!   and marks it lost. The request that saw the mark fails with -EIO and
//!   the copies end. (A write through the mapping may not update the
//!   file's mtime, and raises no inotify event; a truncation to a size
//!   that is not a page multiple leaves the last page's tail writable
//!   without a fault.) On ramfs, whose SEEK_HOLE finds no hole in any
//!   file, st_blocks alone tells.
//!   Writes into an image larger than the last-level cache use
//!   non-temporal stores: a random 4 KiB write then costs no read of the
//!   64 lines it replaces, and the stores after it stop waiting for those
//!   reads (vhostd blk 3.0-3.3M to 3.5-4.1M IOPS, scsi 2.2-2.8M to
//!   3.1-3.7M, randwrite QD 32 on a 1 GiB image). Those stores are
//!   fenced once a batch (at `submit`, and before any completion, any
//!   request to the kernel and `zero`'s stores), not after each copy: a
//!   fence waits for them to reach memory, and the commands after it
//!   waited too (blk 1.32x, scsi 1.42x IOPS, randwrite QD 32, on an
//!   Emerald Rapids VM).
//! - Requests run concurrently and complete in any order: a flush covers the
//!   writes completed before it was queued, not those still in flight.

use crate::{BlockBackend, BlockStats, Completion, DiskInfo, MemoryHold, Op, Request};
use io_uring::{opcode, squeue, types, IoUring};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;
use virtq::sigbus;

/// Most data buffers one Read or Write may have; more is refused with -EINVAL.
pub const MAX_SEGS: usize = 256;

/// Largest write-zeroes a mapped image zeroes in the dataplane thread.
const ZERO_INLINE: u64 = 1 << 20;

/// Largest `depth` accepted (io_uring's own limit on ring entries).
const MAX_DEPTH: usize = 32768;

/// `_IOR(0x12, 114, u64)`: the size of a block device in bytes (the
/// encoding of x86-64, aarch64, riscv64 and the other "generic" ioctl
/// architectures).
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// What an in-flight slot is doing, which decides what its completion means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Slot is free.
    Free,
    /// Read or write: `left` bytes at `offset` through `iov_first..iov_end`.
    Read,
    Write,
    /// Flush, discard, write-zeroes with unmap, or an empty request: the
    /// kernel's result is the request's result.
    Simple,
    /// Write-zeroes without unmap through FALLOC_FL_ZERO_RANGE.
    ZeroRange,
    /// Fallback for ZERO_RANGE: punching the hole, then allocating it.
    ZeroPunch,
    ZeroAlloc,
}

/// A fully allocated tmpfs image, mapped for copies (see the module docs),
/// shared by the queues' backends. Unmapped when the last one drops it.
struct ImageMap {
    addr: *mut u8,
    len: u64,
    /// In virtq's SIGBUS table while mapped (None only in drop): a
    /// truncation marks it lost.
    registration: Option<sigbus::Registration>,
    /// Whether copies may go on, shared with the image's other opens.
    state: Arc<ImageState>,
    /// Writes use non-temporal stores: the image is larger than the
    /// last-level cache, so a line written at random is evicted before it
    /// is read again, and a plain store first reads the line it replaces.
    streaming: bool,
}

/// How often, at most, a stopped image is looked at for holes.
const LOOK_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Requests a backend sends to the kernel between two looks at the clock
/// while its image's copies are stopped.
const LOOK_CHECK_EVERY: u32 = 64;

/// What every open of one image on a memory file system shares in this
/// process (devices and LUNs on the same file; `state_of`): whether its
/// mappings may serve copies. A hole punched through any open stops them
/// for all; a look that finds the image fully allocated again, with no
/// hole-making request run meanwhile, resumes them.
struct ImageState {
    /// Copies may go on. Read on every copy; changed under `holes`.
    /// False until a mapping's open finds the image fully allocated.
    usable: AtomicBool,
    holes: Mutex<Holes>,
    /// The image's path, for the log.
    name: String,
}

struct Holes {
    /// Requests that may leave a hole while they run: discards,
    /// write-zeroes with unmap, and write-zeroes punching a hole to
    /// allocate it again (tmpfs has no zero-range). No look while any is.
    making: u32,
    /// Bumped at each of those and at each stop: a look counts only if
    /// it did not move while the look ran.
    epoch: u64,
    /// A mapping of it was lost (it shrank): no copies from then on.
    lost: bool,
    /// A look is running on its own thread.
    looking: bool,
    /// When the copies stopped or the last look began.
    last_look: Instant,
}

/// An open image's file: its device and inode numbers.
type FileId = (u64, u64);

/// The images on memory file systems this process has open; dead
/// entries are dropped as new ones come.
static IMAGES: Mutex<Vec<(FileId, Weak<ImageState>)>> = Mutex::new(Vec::new());

/// The state every open of `file` (on a memory file system) shares.
fn state_of(file: &File, name: &dyn std::fmt::Display) -> io::Result<Arc<ImageState>> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata()?;
    let key = (meta.dev(), meta.ino());
    let mut images = IMAGES.lock().unwrap_or_else(|e| e.into_inner());
    images.retain(|(_, w)| w.strong_count() > 0);
    if let Some(state) = images.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) {
        return Ok(state);
    }
    let state = Arc::new(ImageState::new(name.to_string()));
    images.push((key, Arc::downgrade(&state)));
    Ok(state)
}

/// Whether `file` has no hole in its first `len` bytes: its blocks cover
/// them and SEEK_HOLE finds none before `len`. The reason if not.
fn fully_allocated(file: &File, len: u64) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    // Both: st_blocks can count blocks past the end (fallocate
    // --keep-size), and ramfs answers SEEK_HOLE with the end for any
    // file. tmpfs takes pages fallocated but never written for a hole
    // (they would be safe, but are refused with it).
    let allocated = file.metadata().map_err(|e| format!("fstat: {e}"))?.blocks().saturating_mul(512);
    if allocated < len {
        return Err(format!("not fully allocated ({allocated} of {len} bytes)"));
    }
    // SAFETY: lseek on a descriptor `file` owns; no memory is passed.
    let hole = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_HOLE) };
    match u64::try_from(hole) {
        Ok(at) if at >= len => Ok(()),
        _ => Err(format!("not fully allocated (the first hole at {hole} of {len} bytes)")),
    }
}

impl ImageState {
    fn new(name: String) -> ImageState {
        ImageState {
            usable: AtomicBool::new(false),
            holes: Mutex::new(Holes { making: 0, epoch: 0, lost: false, looking: false, last_look: Instant::now() }),
            name,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Holes> {
        self.holes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request that may leave a hole is queued (`stops`: a discard or
    /// write-zeroes with unmap, which stop the copies; else the punch of
    /// a write-zeroes, during which no look runs).
    fn hole_started(&self, stops: Option<&str>) {
        let mut h = self.lock();
        h.making += 1;
        h.epoch += 1;
        if let Some(why) = stops {
            h.last_look = Instant::now();
            self.stop_locked(why);
        }
    }

    fn hole_finished(&self) {
        let mut h = self.lock();
        h.making = h.making.saturating_sub(1);
    }

    /// Stops the copies (a hole the kernel left; a mapping lost, `lose`),
    /// saying why the first time.
    fn stop(&self, why: &str, lose: bool) {
        let mut h = self.lock();
        h.lost |= lose;
        h.epoch += 1;
        h.last_look = Instant::now();
        self.stop_locked(why);
    }

    fn stop_locked(&self, why: &str) {
        if self.usable.swap(false, Ordering::Relaxed) {
            tracing::info!(
                "{}: {why}: reads and writes go through preadv/pwritev until it is fully allocated again",
                self.name
            );
        }
    }

    /// Whether a look may begin now (copies stopped, none lost, no look
    /// running, nothing making a hole, the last look `every` ago); the
    /// epoch it begins at.
    fn look_begins(&self, every: std::time::Duration) -> Option<u64> {
        let mut h = self.lock();
        if self.usable.load(Ordering::Relaxed) || h.lost || h.looking || h.making > 0 {
            return None;
        }
        if h.last_look.elapsed() < every {
            return None;
        }
        h.last_look = Instant::now();
        Some(h.epoch)
    }

    /// A look begun at `epoch` ended, having found the image `full` (or
    /// not): the copies resume if nothing could have made a hole since.
    /// Whether they did.
    fn look_ends(&self, epoch: u64, full: bool) -> bool {
        let h = self.lock();
        if !full || h.epoch != epoch || h.making > 0 || h.lost || self.usable.load(Ordering::Relaxed) {
            return false;
        }
        self.usable.store(true, Ordering::Relaxed);
        true
    }

    /// While the copies are stopped, looks (at most every `LOOK_EVERY`)
    /// whether `file` is fully allocated up to `len`: an fstat here, and
    /// if its blocks cover the image, the SEEK_HOLE walk on a thread of
    /// its own, on any CPU but this dataplane's pinned one.
    fn look(self: &Arc<Self>, file: &Arc<File>, len: u64) {
        let Some(epoch) = self.look_begins(LOOK_EVERY) else { return };
        use std::os::unix::fs::MetadataExt;
        // Most looks end here: the holes are still there.
        if file.metadata().map_or(true, |m| m.blocks().saturating_mul(512) < len) {
            return;
        }
        self.lock().looking = true;
        let (state, file) = (self.clone(), file.clone());
        let walk = move || {
            unpin();
            let full = fully_allocated(&file, len).is_ok();
            let resumed = state.look_ends(epoch, full);
            state.lock().looking = false;
            if resumed {
                tracing::info!(
                    "{}: fully allocated again: reads and writes are copies through its mapping",
                    state.name
                );
            }
        };
        if let Err(e) = std::thread::Builder::new().name("image-look".into()).spawn(walk) {
            tracing::debug!("{}: no thread to look for holes: {e}", self.name);
            self.lock().looking = false;
        }
    }
}

/// Lets the calling thread run where the process's main thread may (the
/// CPUs it was started on, e.g. by taskset): a thread spawned by a pinned
/// dataplane inherits its one CPU.
fn unpin() {
    // SAFETY: cpu_set_t is plain data: the kernel fills it with the main
    // thread's CPUs (its thread id is the process id), then reads it back
    // for this thread. On failure the thread stays where it is.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        if libc::sched_getaffinity(libc::getpid(), size, &mut set) == 0 {
            libc::sched_setaffinity(0, size, &set);
        }
    }
}

// SAFETY: the mapping is shared file memory, reached only through raw
// pointers in `copy`; it stays mapped until drop, which owns it alone.
unsafe impl Send for ImageMap {}
// SAFETY: as above; concurrent copies of the same bytes are races the
// image's users own, as with concurrent preadv/pwritev.
unsafe impl Sync for ImageMap {}

impl ImageMap {
    /// Maps `file` (of `len` bytes) for reading, and writing unless
    /// `read_only`, and looks whether it is fully allocated: if so the
    /// copies start (or resume, for the image's other opens), else they
    /// wait for a later look. None where copies could never be safe or
    /// the mapping cannot be set up (the reason logged): the image then
    /// goes through preadv.
    fn new(file: &File, len: u64, read_only: bool, state: &Arc<ImageState>) -> Option<ImageMap> {
        let no = |why: &str| tracing::info!("{}: {why}: no copies through a mapping", state.name);
        if !sigbus::installed() {
            no("no SIGBUS handler to survive a truncation");
            return None;
        }
        if state.lock().lost {
            no("a mapping of it was lost (it shrank)");
            return None;
        }
        let size = usize::try_from(len).ok()?;
        let prot = if read_only { libc::PROT_READ } else { libc::PROT_READ | libc::PROT_WRITE };
        // SAFETY: a new shared mapping of the whole file at an address of
        // the kernel's choice; the result is checked.
        let addr = unsafe { libc::mmap(std::ptr::null_mut(), size, prot, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if addr == libc::MAP_FAILED {
            no(&format!("cannot map it ({})", io::Error::last_os_error()));
            return None;
        }
        // Not counted as guest memory lost: `copy` reports it, by name.
        let Some(registration) = sigbus::register(sigbus::image_slots(), (addr as usize, size), false) else {
            // SAFETY: the mapping made just above, used by nobody.
            unsafe { libc::munmap(addr, size) };
            no("the SIGBUS table's slots for images are all taken");
            return None;
        };
        // A look like any other, but now and in this thread (the open
        // is not a dataplane's).
        let epoch = state.lock().epoch;
        match fully_allocated(file, len) {
            Ok(()) if state.usable.load(Ordering::Relaxed) || state.look_ends(epoch, true) => {
                tracing::info!("{}: fully allocated: reads and writes are copies through a mapping of it", state.name)
            }
            Ok(()) => tracing::info!("{}: mapped; copies once no discard is running on it", state.name),
            Err(why) => {
                // A hole nobody here made (another process, or a sparse
                // image): none of the image's opens may copy.
                state.stop(&format!("{why} when opened again"), false);
                tracing::info!("{}: {why}: mapped; copies once it is fully allocated", state.name);
            }
        }
        let streaming = len > last_level_cache();
        Some(ImageMap { addr: addr as *mut u8, len, registration: Some(registration), state: state.clone(), streaming })
    }

    /// Whether copies may serve `len` bytes at `offset`.
    fn serves(&self, offset: u64, len: u64) -> bool {
        self.state.usable.load(Ordering::Relaxed) && offset.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// A read or a write of `bufs` at `offset`, copied, and its result;
    /// None when the copies do not serve it (the kernel then does). A
    /// streamed write is not yet fenced (`FileBackend::unfenced`).
    fn copy(&self, op: Op, offset: u64, bufs: &virtq::IoBufs) -> Option<i64> {
        let len = bufs.data_len();
        if !self.serves(offset, len) {
            return None;
        }
        let at = self.addr.wrapping_add(offset as usize);
        // SAFETY: [offset, offset + len) lies inside the mapping (checked
        // just above), which lives as long as self; the guest's buffers
        // are not in it.
        unsafe {
            if op == Op::Read {
                bufs.copy_to_data(at);
            } else {
                bufs.copy_from_data(at, self.streaming);
            }
        }
        Some(self.result(len as i64))
    }

    /// Write-zeroes without unmap of at most `ZERO_INLINE` bytes: stores
    /// zeros, so the pages stay allocated (the kernel's way on tmpfs
    /// punches a hole and allocates it again). None when the copies do not
    /// serve it; a larger range goes to the kernel too, so as not to hold
    /// the dataplane thread.
    fn zero(&self, offset: u64, len: u64) -> Option<i64> {
        if len > ZERO_INLINE || !self.serves(offset, len) {
            return None;
        }
        // SAFETY: [offset, offset + len) lies inside the mapping (checked
        // just above), which lives as long as self and is writable (a
        // read-only image refuses write-zeroes before this).
        unsafe { std::ptr::write_bytes(self.addr.wrapping_add(offset as usize), 0, len as usize) };
        Some(self.result(0))
    }

    /// `ok`, or -EIO if a truncation replaced the mapping (zeros read, or
    /// a write gone nowhere) before or while it was used.
    fn result(&self, ok: i64) -> i64 {
        if self.registration.as_ref().is_some_and(|r| r.lost()) {
            if self.state.usable.load(Ordering::Relaxed) {
                tracing::warn!(
                    "{}: the image shrank under its mapping (truncated by another process?)",
                    self.state.name
                );
            }
            self.state.stop("lost its mapping", true);
            return -(libc::EIO as i64);
        }
        ok
    }
}

impl Drop for ImageMap {
    fn drop(&mut self) {
        // Out of the table before the range is unmapped (and could be
        // mapped again by someone else).
        self.registration = None;
        // SAFETY: our own mapping, with no copy running (we are its last
        // owner).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}

/// One in-flight request.
#[derive(Clone, Copy, Debug)]
struct Slot {
    tag: u64,
    stage: Stage,
    /// Where the rest of the request starts.
    offset: u64,
    /// Bytes still to transfer (Read/Write) or the range (ZeroRange & co).
    left: u64,
    /// Bytes of the whole request, the result on success (Read/Write).
    total: u64,
    /// The unfinished iovecs: this slot's storage `[iov_first, iov_end)`.
    iov_first: usize,
    iov_end: usize,
    /// A discard or write-zeroes with unmap: the image's copies wait for
    /// its completion (`ImageState::hole_finished`).
    hole: bool,
}

const FREE_SLOT: Slot =
    Slot { tag: 0, stage: Stage::Free, offset: 0, left: 0, total: 0, iov_first: 0, iov_end: 0, hole: false };

/// The in-flight slots, their iovecs and the free list. Kept apart from the
/// ring so both can be borrowed at once.
struct Slab {
    slots: Vec<Slot>,
    /// `MAX_SEGS` iovecs per slot; never resized, so addresses handed to the
    /// kernel stay put.
    iovecs: Vec<libc::iovec>,
    /// Free slot indices (a stack).
    free: Vec<u32>,
    /// Per slot: the guest memory its iovecs point into, held until the
    /// slot completes so it stays mapped while the kernel works on it.
    holds: Vec<Option<MemoryHold>>,
}

impl Slab {
    fn new(depth: usize) -> Slab {
        let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        Slab {
            slots: vec![FREE_SLOT; depth],
            iovecs: vec![empty; depth * MAX_SEGS],
            // Reversed so slot 0 is taken first (easier to read in a debugger).
            free: (0..depth as u32).rev().collect(),
            holds: vec![None; depth],
        }
    }

    fn iovecs_of(&self, idx: usize) -> &[libc::iovec] {
        let slot = &self.slots[idx];
        let base = idx * MAX_SEGS;
        &self.iovecs[base + slot.iov_first..base + slot.iov_end]
    }

    /// Drops the first `n` bytes of the slot's unfinished iovecs after a
    /// short transfer.
    fn advance(&mut self, idx: usize, mut n: u64) {
        let base = idx * MAX_SEGS;
        let slot = &mut self.slots[idx];
        slot.offset += n;
        slot.left -= n;
        while n > 0 && slot.iov_first < slot.iov_end {
            let iov = &mut self.iovecs[base + slot.iov_first];
            if (iov.iov_len as u64) <= n {
                n -= iov.iov_len as u64;
                slot.iov_first += 1;
            } else {
                // Only the address changes; nothing is dereferenced here.
                iov.iov_base = (iov.iov_base as *mut u8).wrapping_add(n as usize) as *mut libc::c_void;
                iov.iov_len -= n as usize;
                n = 0;
            }
        }
        // Zero-length buffers left at the front would only cost the kernel time.
        while slot.iov_first < slot.iov_end && self.iovecs[base + slot.iov_first].iov_len == 0 {
            slot.iov_first += 1;
        }
    }

    /// The SQE for what slot `idx` has to do next.
    fn entry(&self, idx: usize, fd: types::Fd) -> squeue::Entry {
        let slot = &self.slots[idx];
        let entry = match slot.stage {
            Stage::Read | Stage::Write => {
                let iov = self.iovecs_of(idx);
                let single = iov.len() == 1 && iov[0].iov_len <= u32::MAX as usize;
                match (slot.stage, single) {
                    (Stage::Read, true) => opcode::Read::new(fd, iov[0].iov_base as *mut u8, iov[0].iov_len as u32)
                        .offset(slot.offset)
                        .build(),
                    (Stage::Read, false) => {
                        opcode::Readv::new(fd, iov.as_ptr(), iov.len() as u32).offset(slot.offset).build()
                    }
                    (_, true) => opcode::Write::new(fd, iov[0].iov_base as *const u8, iov[0].iov_len as u32)
                        .offset(slot.offset)
                        .build(),
                    (_, false) => opcode::Writev::new(fd, iov.as_ptr(), iov.len() as u32).offset(slot.offset).build(),
                }
            }
            Stage::ZeroRange => fallocate(fd, slot, libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE),
            Stage::ZeroPunch => fallocate(fd, slot, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE),
            Stage::ZeroAlloc => fallocate(fd, slot, libc::FALLOC_FL_KEEP_SIZE),
            // Simple requests build their own entry in `queue`; never resubmitted.
            Stage::Simple | Stage::Free => opcode::Nop::new().build(),
        };
        entry.user_data(idx as u64)
    }
}

fn fallocate(fd: types::Fd, slot: &Slot, mode: i32) -> squeue::Entry {
    opcode::Fallocate::new(fd, slot.left).offset(slot.offset).mode(mode).build()
}

/// An image file served through io_uring, one per request queue.
pub struct FileBackend {
    ring: IoUring,
    file: Arc<File>,
    /// Wakes a sleeping dataplane when completions are posted.
    eventfd: OwnedFd,
    /// The eventfd the ring signals: `eventfd`, or the caller's
    /// (`signal_completions_to`).
    signalled: RawFd,
    slab: Slab,
    depth: usize,
    read_only: bool,
    discard: bool,
    /// ZERO_RANGE failed with EOPNOTSUPP once: go straight to the fallback.
    zero_range_unsupported: bool,
    /// SQEs queued since the last submit (new requests only).
    unsubmitted: usize,
    stats: BlockStats,
    /// Every request goes to the kernel's io-wq workers (IOSQE_ASYNC)
    /// rather than being tried in the submitting thread first.
    punt: bool,
    /// Reads and writes run in `queue` (tmpfs, ramfs; see the module docs).
    inline: bool,
    /// A fully allocated tmpfs image, mapped: reads and writes are copies.
    image: Option<Arc<ImageMap>>,
    /// An image on a memory file system: the state its opens share (its
    /// holes stop the copies of every mapping of it).
    state: Option<Arc<ImageState>>,
    /// Requests sent to the kernel since the last look at the clock while
    /// the image's copies are stopped (`LOOK_CHECK_EVERY`).
    uncopied: u32,
    /// Completions of requests run inline, for the next `reap`. With the
    /// ring's in-flight slots at most `depth` (never reallocated).
    ready: Vec<Completion>,
    /// A copy into the image streamed stores no fence has ordered yet.
    /// They are fenced once, in this thread, before anything leaves the
    /// backend: a completion (`reap`), a request to the kernel (`queue`'s
    /// other paths, `submit`, `enter`), the backend itself (`submit` ends
    /// every batch, so it is fenced before it can move to another worker;
    /// drop).
    unfenced: bool,
}

// SAFETY: the only fields that are not Send are the iovecs' raw pointers.
// They point at guest buffers the backend never dereferences (only the
// kernel does, while the slot holds their memory), and the backend is moved
// between threads whole, with its ring, slots and holds.
unsafe impl Send for FileBackend {}

impl FileBackend {
    #[allow(clippy::too_many_arguments)]
    fn new(
        file: Arc<File>,
        read_only: bool,
        discard: bool,
        depth: usize,
        punt: bool,
        inline: bool,
        image: Option<Arc<ImageMap>>,
        state: Option<Arc<ImageState>>,
    ) -> io::Result<FileBackend> {
        let entries = depth.next_power_of_two().max(8) as u32;
        let ring = IoUring::new(entries)?;
        // SAFETY: eventfd() takes no pointers; the result is checked below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(raw) };
        ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        Ok(FileBackend {
            ring,
            file,
            signalled: eventfd.as_raw_fd(),
            eventfd,
            slab: Slab::new(depth),
            depth,
            read_only,
            discard,
            zero_range_unsupported: false,
            unsubmitted: 0,
            stats: BlockStats::default(),
            punt,
            inline,
            image,
            state,
            uncopied: 0,
            ready: Vec::with_capacity(if inline { depth } else { 0 }),
            unfenced: false,
        })
    }

    fn fd(&self) -> types::Fd {
        types::Fd(self.file.as_raw_fd())
    }

    /// Requests in the ring's slots (handed to the kernel or queued for it).
    fn ring_in_flight(&self) -> usize {
        self.depth - self.slab.free.len()
    }

    /// Runs slot `idx`'s read or write to the end with preadv/pwritev in
    /// this thread; its result, as its CQEs would have made it.
    fn transfer_inline(&mut self, idx: usize) -> i64 {
        let fd = self.file.as_raw_fd();
        loop {
            let slot = self.slab.slots[idx];
            if slot.left == 0 {
                return slot.total as i64;
            }
            let iov = self.slab.iovecs_of(idx);
            // At most MAX_SEGS (256) iovecs, below IOV_MAX.
            let cnt = iov.len() as libc::c_int;
            // Past i64::MAX it turns negative and the kernel says EINVAL.
            let off = slot.offset as libc::off_t;
            // SAFETY: the iovecs are this slot's, describing guest buffers
            // the fence made from mapped memory; the request's IoBufs (and
            // the hold this slot took) keep that memory mapped for the call.
            // The kernel checks every address it touches (EFAULT).
            let n = unsafe {
                if slot.stage == Stage::Read {
                    libc::preadv(fd, iov.as_ptr(), cnt, off)
                } else {
                    libc::pwritev(fd, iov.as_ptr(), cnt, off)
                }
            };
            let res = if n < 0 {
                let e = io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
                if e == libc::EINTR {
                    continue;
                }
                -e
            } else {
                // One call moves at most MAX_RW_COUNT (< 2 GiB) bytes.
                i32::try_from(n).unwrap_or(i32::MAX)
            };
            if let Some(result) = self.step(idx, res) {
                return result;
            }
        }
    }

    /// Fences the streamed stores of this backend's copies, if any.
    fn fence_copies(&mut self) {
        if self.unfenced {
            virtq::fence_streamed_stores();
            self.unfenced = false;
        }
    }

    /// A request finished in `queue` (inline; `mapped`: by the image's
    /// mapping): its completion waits for the next `reap`.
    fn done_now(&mut self, tag: u64, result: i64, mapped: bool) {
        self.ready.push(Completion { tag, result });
        self.stats.submitted += 1;
        self.stats.mapped += mapped as u64;
    }

    /// `entry`, handed to the kernel's workers at once where the file
    /// system could hold the submitting thread (`SERVER_FS`).
    fn flagged(&self, entry: squeue::Entry) -> squeue::Entry {
        if self.punt {
            entry.flags(squeue::Flags::ASYNC)
        } else {
            entry
        }
    }

    /// Hands queued SQEs to the kernel, waiting for `want` completions.
    /// Interrupted calls are retried; other errors leave the SQEs queued
    /// for the next call.
    fn enter(&mut self, want: usize) {
        self.fence_copies();
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => {
                    self.stats.submit_calls += 1;
                    self.stats.submitted += self.unsubmitted as u64;
                    self.unsubmitted = 0;
                    return;
                }
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    tracing::warn!("io_uring submit: {e}");
                    return;
                }
            }
        }
    }

    /// Frees slot `idx` and reports its completion.
    fn finish(&mut self, idx: usize, result: i64, out: &mut Vec<Completion>) {
        let slot = &mut self.slab.slots[idx];
        if slot.hole {
            if let Some(state) = &self.state {
                state.hole_finished();
            }
        }
        out.push(Completion { tag: slot.tag, result });
        *slot = FREE_SLOT;
        // The hold stays for the slot's next request (most often over the
        // same table: no reference count to change); `release_memory`
        // drops it.
        self.slab.free.push(idx as u32);
        self.stats.completed += 1;
        if result < 0 {
            self.stats.errors += 1;
        }
    }

    /// What one CQE means for its slot: finished (the result), or more to
    /// do (None: the slot's next SQE must be pushed).
    fn step(&mut self, idx: usize, res: i32) -> Option<i64> {
        let slot = &mut self.slab.slots[idx];
        match slot.stage {
            Stage::Read | Stage::Write => {
                if res < 0 {
                    Some(res as i64)
                } else if res == 0 && slot.left > 0 {
                    // Past the end of the file, or the device gave up.
                    Some(-(libc::EIO as i64))
                } else if res as u64 >= slot.left {
                    Some(slot.total as i64)
                } else {
                    self.slab.advance(idx, res as u64);
                    None
                }
            }
            Stage::ZeroRange if res == -libc::EOPNOTSUPP => {
                self.zero_range_unsupported = true;
                slot.stage = Stage::ZeroPunch;
                // A hole until it is allocated again: no look meanwhile
                // (the copies go on; it reads as zeros either way).
                if let Some(state) = &self.state {
                    state.hole_started(None);
                    slot.hole = true;
                }
                None
            }
            Stage::ZeroPunch if res >= 0 => {
                slot.stage = Stage::ZeroAlloc;
                None
            }
            Stage::ZeroAlloc if res < 0 => {
                if let Some(state) = &self.state {
                    state.stop("write-zeroes left a hole (allocating it again failed)", false);
                }
                Some(res as i64)
            }
            _ => Some(if res < 0 { res as i64 } else { 0 }),
        }
    }
}

impl BlockBackend for FileBackend {
    fn room(&self) -> usize {
        // Unreaped inline completions count as in flight.
        self.slab.free.len().saturating_sub(self.ready.len())
    }

    fn queue(&mut self, req: &Request<'_>) -> Result<(), i64> {
        let Some(&idx) = self.slab.free.last() else {
            return Err(crate::NO_ROOM);
        };
        if self.room() == 0 {
            return Err(crate::NO_ROOM);
        }
        let idx = idx as usize;
        let writes = matches!(req.op, Op::Write | Op::Discard | Op::WriteZeroes { .. });
        if writes && self.read_only {
            return Err(-(libc::EROFS as i64));
        }
        if req.op == Op::Discard && !self.discard {
            return Err(-(libc::EOPNOTSUPP as i64));
        }
        let fd = self.fd();
        if !matches!(req.op, Op::Read | Op::Write) {
            // The kernel, or `zero`'s plain stores, may touch what earlier
            // copies streamed (as below, for reads and writes the copies
            // do not serve).
            self.fence_copies();
        }
        let mut slot = Slot { tag: req.tag, offset: req.offset, left: req.len, ..FREE_SLOT };
        let entry = match req.op {
            Op::Read | Op::Write => {
                if req.bufs.pieces() > MAX_SEGS {
                    return Err(-(libc::EINVAL as i64));
                }
                // Each piece is at most 4 GiB and there are at most MAX_SEGS.
                let total = req.bufs.data_len();
                // The kernel refuses iovecs summing past isize::MAX anyway.
                if total > i64::MAX as u64 {
                    return Err(-(libc::EINVAL as i64));
                }
                if let Some(result) = self.image.as_ref().and_then(|m| m.copy(req.op, req.offset, req.bufs)) {
                    // Done now, as below, with no system call.
                    self.unfenced |= req.op == Op::Write && self.image.as_ref().is_some_and(|m| m.streaming);
                    req.bufs.renew_hold(&mut self.slab.holds[idx]);
                    self.done_now(req.tag, result, true);
                    return Ok(());
                }
                // The kernel may touch what earlier copies streamed.
                self.fence_copies();
                if let Some(image) = &self.image {
                    // Stopped (or past its end): now and then, look whether
                    // the copies may resume.
                    self.uncopied += 1;
                    if self.uncopied >= LOOK_CHECK_EVERY {
                        self.uncopied = 0;
                        image.state.look(&self.file, image.len);
                    }
                }
                let base = idx * MAX_SEGS;
                for (iov, (addr, len)) in self.slab.iovecs[base..].iter_mut().zip(req.bufs.iovecs()) {
                    *iov = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len };
                }
                slot.left = total;
                slot.total = total;
                slot.iov_end = req.bufs.pieces();
                req.bufs.renew_hold(&mut self.slab.holds[idx]);
                if self.inline {
                    // Done now; the slot stays free (its hold too, as for
                    // a slot whose completion was reaped).
                    slot.stage = if req.op == Op::Read { Stage::Read } else { Stage::Write };
                    self.slab.slots[idx] = slot;
                    let result = self.transfer_inline(idx);
                    self.slab.slots[idx] = FREE_SLOT;
                    self.done_now(req.tag, result, false);
                    return Ok(());
                }
                if total == 0 {
                    // Nothing to move; a 0-byte result would read as -EIO.
                    slot.stage = Stage::Simple;
                    self.slab.slots[idx] = slot;
                    opcode::Nop::new().build().user_data(idx as u64)
                } else {
                    slot.stage = if req.op == Op::Read { Stage::Read } else { Stage::Write };
                    self.slab.slots[idx] = slot;
                    self.slab.entry(idx, fd)
                }
            }
            Op::Flush => {
                slot.stage = Stage::Simple;
                self.slab.slots[idx] = slot;
                opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build().user_data(idx as u64)
            }
            // fallocate refuses an empty range; there is nothing to do.
            Op::Discard | Op::WriteZeroes { .. } if req.len == 0 => {
                slot.stage = Stage::Simple;
                self.slab.slots[idx] = slot;
                opcode::Nop::new().build().user_data(idx as u64)
            }
            Op::Discard | Op::WriteZeroes { unmap: true } => {
                // A hole: a mapping's read of it would allocate it.
                if let Some(state) = &self.state {
                    state.hole_started(Some("a discard or write-zeroes with unmap punched a hole"));
                    slot.hole = true;
                }
                slot.stage = Stage::Simple;
                self.slab.slots[idx] = slot;
                fallocate(fd, &slot, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE).user_data(idx as u64)
            }
            Op::WriteZeroes { unmap: false } => {
                if let Some(image) = &self.image {
                    if let Some(result) = image.zero(req.offset, req.len) {
                        self.done_now(req.tag, result, true);
                        return Ok(());
                    }
                    // The kernel punches a hole and allocates it again
                    // (tmpfs has no zero-range); `step` stops the copies
                    // if the hole stays.
                }
                slot.stage = if self.zero_range_unsupported { Stage::ZeroPunch } else { Stage::ZeroRange };
                if let (Stage::ZeroPunch, Some(state)) = (slot.stage, &self.state) {
                    // As in `step`: no look until it is allocated again.
                    state.hole_started(None);
                    slot.hole = true;
                }
                self.slab.slots[idx] = slot;
                self.slab.entry(idx, fd)
            }
        };
        let entry = self.flagged(entry);
        // SAFETY: the entry points at this slot's iovecs (kept until the
        // slot is freed at its completion) and at the guest buffers they
        // describe, which the fence made from mapped memory and which stay
        // mapped while the slot holds that memory (until it completes).
        if unsafe { self.ring.submission().push(&entry) }.is_err() {
            // Cannot happen (the ring holds `depth` entries), but if it did
            // the slot stays free and nothing is queued.
            if self.slab.slots[idx].hole {
                if let Some(state) = &self.state {
                    state.hole_finished();
                }
            }
            self.slab.slots[idx] = FREE_SLOT;
            self.slab.holds[idx] = None;
            return Err(crate::NO_ROOM);
        }
        self.slab.free.pop();
        self.unsubmitted += 1;
        Ok(())
    }

    fn release_memory(&mut self) {
        // A free slot's hold is a past request's: nothing uses its memory.
        for &idx in &self.slab.free {
            self.slab.holds[idx as usize] = None;
        }
    }

    fn submit(&mut self) {
        // The batch's copies are done: fenced here, in the thread that
        // streamed them, even when there is nothing to reap before the
        // queue moves (attach_inflight).
        self.fence_copies();
        // The SQ check catches entries a previous enter left behind (the
        // kernel stops at an entry it cannot take; rare, but they must go).
        if self.unsubmitted > 0 || !self.ring.submission().is_empty() {
            self.enter(0);
        }
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        // A completion tells the guest its data is in the image.
        self.fence_copies();
        for c in self.ready.drain(..) {
            self.stats.completed += 1;
            if c.result < 0 {
                self.stats.errors += 1;
            }
            out.push(c);
        }
        let mut resubmitted = false;
        loop {
            let Some(cqe) = self.ring.completion().next() else { break };
            let idx = cqe.user_data() as usize;
            if idx >= self.depth || self.slab.slots[idx].stage == Stage::Free {
                continue; // not ours (cannot happen)
            }
            match self.step(idx, cqe.result()) {
                Some(result) => self.finish(idx, result, out),
                None => {
                    let entry = self.flagged(self.slab.entry(idx, self.fd()));
                    // SAFETY: as in `queue`: the slot's iovecs and the guest
                    // memory it holds stay valid until this slot completes.
                    if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                        resubmitted = true;
                    } else {
                        self.finish(idx, -(libc::EIO as i64), out);
                    }
                }
            }
        }
        // The rest of a short transfer must start now: the dataplane may go
        // to sleep on the completion fd next.
        if resubmitted {
            self.enter(0);
        }
    }

    fn wait(&mut self) {
        // Inline completions are ready: the ring may have nothing to wait for.
        if self.ready.is_empty() && self.ring_in_flight() > 0 {
            self.enter(1);
        }
    }

    fn in_flight(&self) -> usize {
        self.ring_in_flight() + self.ready.len()
    }

    fn completion_fd(&self) -> Option<RawFd> {
        Some(self.signalled)
    }

    fn ack_completion_event(&mut self) {
        let mut v = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a local buffer from the
        // eventfd the ring signals (non-blocking: ours, or one the caller
        // keeps open and made non-blocking); an empty one returns EAGAIN.
        unsafe { libc::read(self.signalled, v.as_mut_ptr() as *mut libc::c_void, 8) };
    }

    fn signal_completions_to(&mut self, fd: RawFd) -> bool {
        // The ring holds its own reference to the eventfd it signals, so
        // the caller closing `fd` early cannot leave it signalling another file.
        let submitter = self.ring.submitter();
        if submitter.unregister_eventfd().is_err() {
            return false;
        }
        if submitter.register_eventfd(fd).is_ok() {
            self.signalled = fd;
            return true;
        }
        // Back to our own, so completions still wake someone.
        if let Err(e) = submitter.register_eventfd(self.eventfd.as_raw_fd()) {
            tracing::warn!("io_uring: cannot register its completion eventfd again ({e})");
        }
        false
    }

    fn stats(&self) -> BlockStats {
        self.stats
    }
}

impl Drop for FileBackend {
    /// Waits for requests in flight: the kernel may still use their iovecs
    /// and buffers. Completions reaped here are dropped.
    fn drop(&mut self) {
        self.fence_copies();
        let mut out = Vec::new();
        while self.ring_in_flight() > 0 {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() != Some(libc::EINTR) {
                    tracing::warn!("io_uring: {} requests still in flight at close: {e}", self.in_flight());
                    // The kernel may still write into their buffers: keep
                    // their memory mapped (and the iovecs it reads) for good
                    // rather than let it be unmapped under it. Holes they
                    // may still punch stay counted: the image's copies
                    // never resume.
                    std::mem::forget(std::mem::take(&mut self.slab.holds));
                    std::mem::forget(std::mem::take(&mut self.slab.iovecs));
                    return;
                }
            }
            self.reap(&mut out);
            out.clear();
        }
    }
}

/// Opens the image and builds `queues` backends of `depth` slots each.
pub(crate) fn open(
    path: &Path,
    readonly: bool,
    direct: bool,
    discard: bool,
    queues: usize,
    depth: usize,
) -> io::Result<(DiskInfo, Vec<Box<dyn BlockBackend>>)> {
    let name = path.display();
    let fail = |kind: io::ErrorKind, what: String| io::Error::new(kind, format!("{name}: {what}"));
    if queues == 0 || depth == 0 || depth > MAX_DEPTH {
        return Err(fail(
            io::ErrorKind::InvalidInput,
            format!("{queues} queues of depth {depth} (need at least 1 queue, depth 1 to {MAX_DEPTH})"),
        ));
    }
    // Look before opening: opening a FIFO would block.
    let meta = std::fs::metadata(path).map_err(|e| fail(e.kind(), format!("cannot open: {e}")))?;
    check_type(&meta.file_type()).map_err(|what| fail(io::ErrorKind::InvalidInput, what))?;
    let mut flags = libc::O_CLOEXEC;
    if direct {
        flags |= libc::O_DIRECT;
    }
    let file = std::fs::OpenOptions::new().read(true).write(!readonly).custom_flags(flags).open(path).map_err(|e| {
        fail(e.kind(), format!("cannot open {}: {e}", if readonly { "read-only" } else { "read-write" }))
    })?;
    // And again on what was opened, in case the path changed meanwhile.
    let meta = file.metadata().map_err(|e| fail(e.kind(), format!("fstat: {e}")))?;
    check_type(&meta.file_type()).map_err(|what| fail(io::ErrorKind::InvalidInput, what))?;
    let is_blockdev = meta.file_type().is_block_device();
    let size = if is_blockdev {
        blockdev_size(&file).map_err(|e| fail(e.kind(), format!("BLKGETSIZE64: {e}")))?
    } else {
        meta.len()
    };
    if size == 0 || size % 512 != 0 {
        return Err(fail(io::ErrorKind::InvalidInput, format!("size {size} bytes is not a positive multiple of 512")));
    }
    let block_size = if direct { direct_block_size(&file, is_blockdev) } else { 512 };
    let info = DiskInfo { capacity: size, read_only: readonly, block_size, discard, write_zeroes: true };
    let server_fs = server_fs(&file);
    if let Some(fs) = server_fs {
        tracing::info!("{name}: on {fs}, whose server may stop answering: every request goes to io_uring's workers, never waiting in the dataplane's thread");
    }
    let punt = server_fs.is_some();
    // A block device's node lies on devtmpfs, which says TMPFS_MAGIC.
    let memory_fs = if direct || punt || is_blockdev { None } else { memory_fs(&file) };
    if let Some(fs) = memory_fs {
        tracing::info!("{name}: on {fs}: reads and writes run in the dataplane's thread, not through io_uring");
    }
    let inline = memory_fs.is_some();
    // Shared with the image's other opens: a discard through any of them
    // stops every mapping's copies.
    let state = if is_blockdev || self::memory_fs(&file).is_none() {
        None
    } else {
        Some(state_of(&file, &name).map_err(|e| fail(e.kind(), format!("fstat: {e}")))?)
    };
    let image = match &state {
        Some(state) if inline => ImageMap::new(&file, size, readonly, state).map(Arc::new),
        _ => None,
    };
    let file = Arc::new(file);
    let mut backends: Vec<Box<dyn BlockBackend>> = Vec::with_capacity(queues);
    for _ in 0..queues {
        let backend =
            FileBackend::new(file.clone(), readonly, discard, depth, punt, inline, image.clone(), state.clone())
                .map_err(|e| fail(e.kind(), format!("io_uring set-up: {e}")))?;
        backends.push(Box::new(backend));
    }
    Ok((info, backends))
}

/// File systems (statfs f_type) on which io_uring may run a request in
/// the submitting thread and block it there: the kernel (6.1) takes a file
/// with no block device under it as able to answer without waiting, and
/// FUSE and NFS direct I/O then wait for their server in the submit call.
/// A hung server would hold the worker, and every device sharing it.
const SERVER_FS: &[(u32, &str)] = &[
    (0x6573_5546, "fuse"),
    (0x6969, "nfs"),
    (0xfe53_4d42, "smb2"),
    (0xff53_4d42, "cifs"),
    (0x0102_1997, "9p"),
    (0x00c3_6400, "ceph"),
];

/// File systems kept in memory (statfs f_type), whose buffered reads and
/// writes run inline (see the module docs).
const MEMORY_FS: &[(u32, &str)] = &[(0x0102_1994, "tmpfs"), (0x8584_58f6, "ramfs")];

/// The file system magic of `file` (statfs f_type), if fstatfs answers.
fn fs_magic(file: &File) -> Option<u32> {
    // SAFETY: an all-zero statfs is a valid value of the plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs through the pointer, which points
    // at the local above; the descriptor is the open file's.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    // The magic numbers are 32 bits; f_type is a signed word, which on a
    // 32-bit target holds the SMB ones negative: compare the low 32 bits.
    Some(st.f_type as u32)
}

/// The `SERVER_FS` file system `file` lies on, if any (unknown: none).
fn server_fs(file: &File) -> Option<&'static str> {
    let magic = fs_magic(file)?;
    SERVER_FS.iter().find(|&&(m, _)| m == magic).map(|&(_, fs)| fs)
}

/// The `MEMORY_FS` file system `file` lies on, if any (unknown: none).
fn memory_fs(file: &File) -> Option<&'static str> {
    let magic = fs_magic(file)?;
    MEMORY_FS.iter().find(|&&(m, _)| m == magic).map(|&(_, fs)| fs)
}

/// The last-level cache's size in bytes, as the C library reports it (32
/// MiB when it does not).
fn last_level_cache() -> u64 {
    // SAFETY: sysconf has no memory side effects.
    let (l3, l2) = unsafe { (libc::sysconf(libc::_SC_LEVEL3_CACHE_SIZE), libc::sysconf(libc::_SC_LEVEL2_CACHE_SIZE)) };
    match (l3, l2) {
        (l3, _) if l3 > 0 => l3 as u64,
        (_, l2) if l2 > 0 => l2 as u64,
        _ => 32 << 20,
    }
}

fn check_type(t: &std::fs::FileType) -> Result<(), String> {
    if t.is_file() || t.is_block_device() {
        Ok(())
    } else if t.is_dir() {
        Err("is a directory, not a regular file or block device".into())
    } else {
        Err("not a regular file or block device".into())
    }
}

fn blockdev_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points
    // at a live local.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64 as _, &mut size as *mut u64) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// The alignment O_DIRECT needs for offsets and lengths: the logical block
/// size of a block device, else what statx reports (STATX_DIOALIGN, Linux
/// 6.1), else 512.
fn direct_block_size(file: &File, is_blockdev: bool) -> u32 {
    if is_blockdev {
        let mut ssz: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through the pointer, which points
        // at a live local.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET as _, &mut ssz as *mut libc::c_int) };
        if r == 0 && ssz >= 512 {
            return ssz as u32;
        }
        return 512;
    }
    // SAFETY: statx is plain old data; all zeroes is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a valid C string, AT_EMPTY_PATH makes statx look at
    // the descriptor itself, and `stx` is a live, writable statx.
    let r = unsafe { libc::statx(file.as_raw_fd(), c"".as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if r == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 && stx.stx_dio_offset_align > 512 {
        return stx.stx_dio_offset_align;
    }
    512
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iov(addr: usize, len: usize) -> libc::iovec {
        libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: len }
    }

    /// A look's verdict counts only if nothing that makes a hole ran or
    /// started while it walked the file.
    #[test]
    fn a_look_counts_only_if_no_hole_was_made_meanwhile() {
        let now = std::time::Duration::ZERO;
        let state = ImageState::new("img".into());
        let usable = |s: &ImageState| s.usable.load(Ordering::Relaxed);
        // A clean look: the copies resume, and none begins while they go on.
        let e = state.look_begins(now).unwrap();
        assert!(state.look_ends(e, true) && usable(&state));
        assert_eq!(state.look_begins(now), None, "a look while copying");
        // A discard stops them; none begins while it runs.
        state.hole_started(Some("test"));
        assert!(!usable(&state));
        assert_eq!(state.look_begins(now), None, "a look while a discard runs");
        state.hole_finished();
        // A look that found holes, or ran past a discard, a write-zeroes'
        // punch or a stop (whole or still running), changes nothing.
        let e = state.look_begins(now).unwrap();
        assert!(!state.look_ends(e, false));
        for made in [
            |s: &ImageState| {
                s.hole_started(Some("test"));
                s.hole_finished()
            },
            |s: &ImageState| {
                s.hole_started(None);
                s.hole_finished()
            },
            |s: &ImageState| s.hole_started(None),
            |s: &ImageState| s.stop("test", false),
        ] {
            let e = state.look_begins(now).unwrap();
            made(&state);
            assert!(!state.look_ends(e, true) && !usable(&state));
            let mut h = state.lock();
            h.making = 0;
        }
        // Not more often than asked, and never after a mapping was lost.
        assert_eq!(state.look_begins(std::time::Duration::from_secs(3600)), None);
        state.stop("test", true);
        assert_eq!(state.look_begins(now), None, "a look after a lost mapping");
    }

    /// A batch of streamed writes into a mapped image is fenced once, at
    /// `submit`, or before whatever else leaves the backend first; reads,
    /// and writes into an image that does not stream, need no fence.
    #[test]
    fn streamed_writes_are_fenced_before_anything_leaves_the_backend() {
        use virtq::{GuestMemory, IoBufs, Mapping, Region};
        let shm = Path::new("/dev/shm");
        if memory_fs(&File::open(shm).unwrap()) != Some("tmpfs") {
            println!("note: /dev/shm is not a tmpfs; not checked");
            return;
        }
        virtq::sigbus::install_handler().unwrap();
        const SIZE: usize = 64 << 10;
        let path = shm.join(format!("vhostd-bb-fence-{}", std::process::id()));
        std::fs::write(&path, vec![0x5au8; SIZE]).unwrap();
        struct Remove<'a>(&'a Path);
        impl Drop for Remove<'_> {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(self.0);
            }
        }
        let _remove = Remove(&path);
        let mem = Arc::new(Mapping::anonymous(4 * 4096).unwrap());
        let mem = Arc::new(GuestMemory::from_regions(vec![Region::new(0x1000, 4 * 4096, mem, 0).unwrap()]).unwrap());
        assert!(mem.write(0x1000, &[0xa7; 4096]));
        let mut bufs = IoBufs::new();
        assert!(mem.lend(0x1000, 4096, &mut bufs));
        let backend = |streaming: bool| {
            let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
            let state = state_of(&file, &"fence").unwrap();
            let mut image = ImageMap::new(&file, SIZE as u64, false, &state).expect("a mapped image");
            // The image is smaller than the cache; as a larger one would.
            image.streaming = streaming;
            FileBackend::new(Arc::new(file), false, true, 8, false, true, Some(Arc::new(image)), Some(state)).unwrap()
        };
        let req = |tag: u64, op: Op, offset: u64| Request { tag, op, offset, len: 4096, bufs: &bufs };
        let mut b = backend(true);
        let mut out = Vec::new();
        // Two writes, one fence: at submit.
        b.queue(&req(1, Op::Write, 0)).unwrap();
        assert!(b.unfenced);
        b.queue(&req(2, Op::Write, 8192)).unwrap();
        assert!(b.unfenced);
        b.submit();
        assert!(!b.unfenced, "submit fences the batch");
        b.reap(&mut out);
        assert_eq!(out.len(), 2);
        assert_eq!(std::fs::read(&path).unwrap()[8192..12288], [0xa7; 4096]);
        // Before a completion, a request to the kernel, or zero's stores.
        b.queue(&req(3, Op::Write, 4096)).unwrap();
        b.reap(&mut out);
        assert!(!b.unfenced && out.len() == 3, "reap fences before handing out completions");
        b.queue(&req(4, Op::Write, 4096)).unwrap();
        b.queue(&Request { tag: 5, op: Op::Flush, offset: 0, len: 0, bufs: &IoBufs::new() }).unwrap();
        assert!(!b.unfenced, "fenced before a flush goes to the kernel");
        b.queue(&req(6, Op::Write, 4096)).unwrap();
        b.queue(&Request { tag: 7, op: Op::WriteZeroes { unmap: false }, offset: 0, len: 512, bufs: &IoBufs::new() })
            .unwrap();
        assert!(!b.unfenced, "fenced before zero's plain stores");
        // Reads stream nothing.
        b.queue(&req(8, Op::Read, 0)).unwrap();
        assert!(!b.unfenced);
        b.submit();
        while b.in_flight() > 0 {
            b.wait();
            b.reap(&mut out);
        }
        // An image that does not stream: nothing to fence.
        let mut plain = backend(false);
        plain.queue(&req(9, Op::Write, 0)).unwrap();
        assert!(!plain.unfenced);
        plain.reap(&mut out);
        assert_eq!(out.len(), 9);
    }

    #[test]
    fn advance_after_short_transfers() {
        let mut slab = Slab::new(2);
        let base = MAX_SEGS; // slot 1
        slab.iovecs[base] = iov(0x1000, 100);
        slab.iovecs[base + 1] = iov(0x2000, 0);
        slab.iovecs[base + 2] = iov(0x3000, 50);
        slab.iovecs[base + 3] = iov(0x4000, 10);
        slab.slots[1] = Slot {
            tag: 5,
            stage: Stage::Read,
            offset: 4096,
            left: 160,
            total: 160,
            iov_first: 0,
            iov_end: 4,
            hole: false,
        };
        // Part of the first buffer.
        slab.advance(1, 30);
        assert_eq!((slab.slots[1].offset, slab.slots[1].left), (4126, 130));
        assert_eq!(slab.iovecs_of(1).len(), 4);
        assert_eq!(slab.iovecs_of(1)[0].iov_base as usize, 0x1000 + 30);
        assert_eq!(slab.iovecs_of(1)[0].iov_len, 70);
        // The rest of it: the empty buffer after it is skipped too.
        slab.advance(1, 70);
        assert_eq!(slab.iovecs_of(1).len(), 2);
        assert_eq!(slab.iovecs_of(1)[0].iov_base as usize, 0x3000);
        // Across a boundary.
        slab.advance(1, 55);
        assert_eq!(slab.iovecs_of(1).len(), 1);
        assert_eq!((slab.iovecs_of(1)[0].iov_base as usize, slab.iovecs_of(1)[0].iov_len), (0x4005, 5));
        assert_eq!((slab.slots[1].offset, slab.slots[1].left), (4096 + 155, 5));
        // One buffer left: a plain READ is built for it, at the new offset.
        let e = slab.entry(1, types::Fd(3));
        assert_eq!(e.get_opcode(), opcode::Read::CODE as u32);
        assert_eq!(e.get_user_data(), 1);
        // Slot 0 is untouched.
        assert_eq!(slab.slots[0].stage, Stage::Free);
    }
}
