//! Host-side block backends: where a virtio-blk device's requests go. A
//! backend takes requests tagged by the device, runs them asynchronously
//! and hands back completions by tag, in any order. Data moves straight
//! between the guest's buffers and the backing store: the device lends
//! them as `virtq::IoBufs`, the guest-memory fence's type for buffers the
//! kernel works on, and a backend keeps the `MemoryHold` that comes with
//! them until the request completes, so they stay mapped. Backends know
//! nothing of virtqueues or virtio.

mod file;
mod null;

pub use file::{FileBackend, MAX_SEGS};
pub use null::NullBackend;

pub use virtq::{IoBufs, MemoryHold};

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Read `bufs` from `offset`.
    Read,
    /// Write `bufs` at `offset`.
    Write,
    /// Make completed writes durable.
    Flush,
    /// Deallocate `len` bytes at `offset` (reads may then return zeroes or
    /// the old data; a file backend punches a hole).
    Discard,
    /// Make `len` bytes at `offset` read as zeroes; with `unmap` the backend
    /// may deallocate them.
    WriteZeroes {
        /// The space may be deallocated.
        unmap: bool,
    },
}

/// One request. Offsets and lengths are in bytes; the device has checked
/// them against the capacity and the sector size.
#[derive(Clone, Copy)]
pub struct Request<'a> {
    /// The device's tag, returned in the completion.
    pub tag: u64,
    /// What to do.
    pub op: Op,
    /// Byte offset in the disk.
    pub offset: u64,
    /// Bytes for Discard and WriteZeroes (Read/Write: the sum of `bufs`).
    pub len: u64,
    /// Guest buffers for Read and Write, in order (empty for the others).
    pub bufs: &'a IoBufs,
}

/// A finished request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The request's tag.
    pub tag: u64,
    /// Bytes transferred (Read/Write; 0 for the others), or a negative errno.
    pub result: i64,
}

/// What the device needs to know about the disk behind a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskInfo {
    /// Size in bytes (a multiple of 512).
    pub capacity: u64,
    /// Writes, discards and write-zeroes are refused.
    pub read_only: bool,
    /// Logical block size the backend needs requests aligned to (512, or
    /// the file system's block size with O_DIRECT).
    pub block_size: u32,
    /// Discard is supported (and asked for).
    pub discard: bool,
    /// Write-zeroes is supported.
    pub write_zeroes: bool,
}

/// Counters a block backend keeps of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockStats {
    /// Requests handed to the kernel (or completed at once).
    pub submitted: u64,
    /// Completions reaped.
    pub completed: u64,
    /// Completions with an error.
    pub errors: u64,
    /// Submission system calls (io_uring_enter).
    pub submit_calls: u64,
    /// Reads and writes copied through a mapping of the image (the file
    /// backend on tmpfs; see its docs), with no system call.
    pub mapped: u64,
}

/// `BlockBackend::queue`'s error when there is no room: -EBUSY.
pub const NO_ROOM: i64 = -(libc::EBUSY as i64);

/// A block backend for one request queue.
pub trait BlockBackend: Send {
    /// How many more requests may be queued now (in flight is bounded).
    fn room(&self) -> usize;
    /// Queues a request; it starts at the next `submit`, or runs at once
    /// (the file backend on tmpfs) and then completes at the next `reap`,
    /// with no wake-up on `completion_fd`. Fails (negative errno, nothing
    /// queued) when there is no room ([`NO_ROOM`]) or the request is not
    /// supported by this backend. A backend that hands the buffers to the
    /// kernel keeps `req.bufs.memory_hold()` until the request completes
    /// (it may keep it longer, until `release_memory`).
    fn queue(&mut self, req: &Request<'_>) -> Result<(), i64>;
    /// Lets go of memory held for requests that completed (the memory
    /// table is about to change, or the queue stops).
    fn release_memory(&mut self) {}
    /// Starts everything queued since the last call (one system call).
    fn submit(&mut self);
    /// Appends finished requests to `out` without blocking.
    fn reap(&mut self, out: &mut Vec<Completion>);
    /// Blocks until at least one queued or submitted request has finished
    /// (returns at once when none is in flight).
    fn wait(&mut self);
    /// Requests queued or submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// A descriptor that polls readable when completions may be waiting,
    /// for a dataplane that sleeps between kicks.
    fn completion_fd(&self) -> Option<std::os::unix::io::RawFd> {
        None
    }
    /// The dataplane woke on `completion_fd`: consume the wake-up (the
    /// completions themselves come from `reap`).
    fn ack_completion_event(&mut self) {}
    /// Signals completions on `fd`, an eventfd the caller keeps open and
    /// may share between backends, instead of on its own `completion_fd`
    /// (which then returns `fd`). A dataplane that runs several backends
    /// (virtio-scsi's units) then sleeps on one descriptor: an epoll set of
    /// theirs nested in its own costs the kernel a second wake-up per
    /// completion. False if the backend cannot (it keeps its own), or has
    /// no completion descriptor.
    fn signal_completions_to(&mut self, _fd: std::os::unix::io::RawFd) -> bool {
        false
    }
    /// The backend's own counters.
    fn stats(&self) -> BlockStats;
}

/// Which backend, from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockSpec {
    /// An image file (or block device) through io_uring.
    File {
        /// Path of the image.
        path: std::path::PathBuf,
        /// Open read-only; the device offers VIRTIO_BLK_F_RO.
        readonly: bool,
        /// O_DIRECT (bypass the page cache).
        direct: bool,
        /// Pass discards on (punch holes); else the device does not offer DISCARD.
        discard: bool,
    },
    /// No storage: every request succeeds at once, reads leave the guest's
    /// buffers as they were (like QEMU's null-co).
    Null {
        /// Capacity in bytes.
        size: u64,
    },
}

/// Opens the disk and builds one backend per request queue, each with at
/// most `depth` requests in flight. Fails with a message naming the path
/// (missing, not a regular file or block device, not readable/writable,
/// size not a multiple of 512) before anything is left open.
pub fn open(spec: &BlockSpec, queues: usize, depth: usize) -> std::io::Result<(DiskInfo, Vec<Box<dyn BlockBackend>>)> {
    match spec {
        BlockSpec::Null { size } => {
            let info =
                DiskInfo { capacity: *size, read_only: false, block_size: 512, discard: true, write_zeroes: true };
            Ok((info, (0..queues).map(|_| Box::new(NullBackend::new(depth)) as Box<dyn BlockBackend>).collect()))
        }
        BlockSpec::File { path, readonly, direct, discard } => {
            file::open(path, *readonly, *direct, *discard, queues, depth)
        }
    }
}
