//! The file backend against real temporary files (and the null backend).

use std::os::unix::fs::MetadataExt;
use std::os::unix::io::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use vhostd_block_backends::{open, BlockBackend, BlockSpec, Completion, DiskInfo, IoBufs, Op, Request, MAX_SEGS};
use virtq::{GuestMemory, Mapping, Region};

const EROFS: i64 = -(libc::EROFS as i64);
const EBUSY: i64 = -(libc::EBUSY as i64);
const EINVAL: i64 = -(libc::EINVAL as i64);
const EIO: i64 = -(libc::EIO as i64);

/// A file (or directory) under `dir` removed when the test ends, passed or not.
struct Temp {
    path: PathBuf,
}

impl Temp {
    fn name_in(dir: &Path, what: &str) -> PathBuf {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        dir.join(format!("vhostd-bb-{}-{}-{what}", std::process::id(), n))
    }

    /// A file of `size` bytes, all zero, in the temporary directory.
    fn file(what: &str, size: u64) -> Temp {
        Temp::file_in(&std::env::temp_dir(), what, size)
    }

    fn file_in(dir: &Path, what: &str, size: u64) -> Temp {
        let t = Temp { path: Temp::name_in(dir, what) };
        std::fs::File::create(&t.path).unwrap().set_len(size).unwrap();
        t
    }

    /// A file of `size` bytes filled with `byte` and written out, so its
    /// blocks are allocated.
    fn filled(dir: &Path, what: &str, size: usize, byte: u8) -> Temp {
        let t = Temp { path: Temp::name_in(dir, what) };
        std::fs::write(&t.path, vec![byte; size]).unwrap();
        std::fs::File::open(&t.path).unwrap().sync_all().unwrap();
        t
    }

    fn dir(what: &str) -> Temp {
        let t = Temp { path: Temp::name_in(&std::env::temp_dir(), what) };
        std::fs::create_dir(&t.path).unwrap();
        t
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(&self.path);
    }
}

fn open_file(
    path: &Path,
    readonly: bool,
    direct: bool,
    queues: usize,
    depth: usize,
) -> std::io::Result<(DiskInfo, Vec<Box<dyn BlockBackend>>)> {
    open(&BlockSpec::File { path: path.to_path_buf(), readonly, direct, discard: true }, queues, depth)
}

fn one(path: &Path, depth: usize) -> Box<dyn BlockBackend> {
    open_file(path, false, false, 1, depth).unwrap().1.pop().unwrap()
}

/// Guest memory for the requests' buffers: one anonymous mapping at
/// guest-physical 0, handed out page-aligned (as O_DIRECT needs).
struct Guest {
    mem: Arc<GuestMemory>,
    next: u64,
}

const GUEST: u64 = 8 << 20;

impl Guest {
    fn new() -> Guest {
        let map = Arc::new(Mapping::anonymous(GUEST as usize).unwrap());
        let mem = GuestMemory::from_regions(vec![Region::new(0, GUEST, map, 0).unwrap()]).unwrap();
        Guest { mem: Arc::new(mem), next: 0 }
    }

    /// `len` bytes of fresh memory filled with `byte`; their address.
    fn alloc(&mut self, len: usize, byte: u8) -> u64 {
        let gpa = self.next;
        self.next = (gpa + len as u64).next_multiple_of(4096);
        assert!(self.next <= GUEST, "test guest memory exhausted");
        assert!(self.mem.write(gpa, &vec![byte; len]));
        gpa
    }

    /// Fresh memory holding `data`; its address.
    fn with(&mut self, data: &[u8]) -> u64 {
        let gpa = self.alloc(data.len(), 0);
        assert!(self.mem.write(gpa, data));
        gpa
    }

    fn get(&self, gpa: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        assert!(self.mem.read(gpa, &mut v));
        v
    }

    /// The pieces (address, length) lent as a request's data.
    fn io(&self, pieces: &[(u64, usize)]) -> IoBufs {
        let mut io = IoBufs::with_capacity(pieces.len());
        for &(gpa, len) in pieces {
            assert!(self.mem.lend(gpa, len as u64, &mut io));
        }
        io
    }
}

fn req(tag: u64, op: Op, offset: u64, len: u64, bufs: &IoBufs) -> Request<'_> {
    Request { tag, op, offset, len, bufs }
}

/// No buffers (flush, discard, write-zeroes).
const NONE: &IoBufs = &IoBufs::new();

/// Waits (bounded) until `n` completions have been reaped.
fn collect(b: &mut dyn BlockBackend, n: usize) -> Vec<Completion> {
    let mut out = Vec::new();
    for _ in 0..10_000 {
        b.reap(&mut out);
        if out.len() >= n {
            break;
        }
        b.wait();
    }
    assert_eq!(out.len(), n, "completions");
    assert_eq!(b.in_flight(), 0);
    out
}

/// Runs one request to completion and returns its result.
fn run(b: &mut dyn BlockBackend, r: &Request<'_>) -> i64 {
    b.queue(r).unwrap();
    b.submit();
    let c = collect(b, 1);
    assert_eq!(c[0].tag, r.tag);
    c[0].result
}

fn read_all(b: &mut dyn BlockBackend, offset: u64, len: usize) -> Vec<u8> {
    let mut g = Guest::new();
    let at = g.alloc(len, 0xee);
    assert_eq!(run(b, &req(99, Op::Read, offset, len as u64, &g.io(&[(at, len)]))), len as i64);
    g.get(at, len)
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn writev_then_read_with_other_boundaries() {
    let t = Temp::file("rw", 1 << 20);
    let (info, mut bs) = open_file(&t.path, false, false, 2, 16).unwrap();
    assert_eq!(
        info,
        DiskInfo { capacity: 1 << 20, read_only: false, block_size: 512, discard: true, write_zeroes: true }
    );
    assert_eq!(bs.len(), 2);
    let data = pattern(3 * 4096 + 1024, 1);
    let mut g = Guest::new();
    // Write in odd pieces, each in memory of its own: 100, 4000, 1, the rest.
    let cuts = [0, 100, 4100, 4101, data.len()];
    let pieces: Vec<(u64, usize)> = cuts.windows(2).map(|w| (g.with(&data[w[0]..w[1]]), w[1] - w[0])).collect();
    let io = g.io(&pieces);
    assert_eq!(run(bs[0].as_mut(), &req(1, Op::Write, 8192, data.len() as u64, &io)), data.len() as i64);
    // Read back through the other queue (same file, its own ring) in
    // different pieces: one sector, 7 bytes, the rest.
    let cuts = [0, 512, 519, data.len()];
    let pieces: Vec<(u64, usize)> = cuts.windows(2).map(|w| (g.alloc(w[1] - w[0], 0), w[1] - w[0])).collect();
    let io = g.io(&pieces);
    assert_eq!(run(bs[1].as_mut(), &req(2, Op::Read, 8192, data.len() as u64, &io)), data.len() as i64);
    let dst: Vec<u8> = pieces.iter().flat_map(|&(gpa, len)| g.get(gpa, len)).collect();
    assert_eq!(dst, data);
    // A single buffer reads the same.
    assert_eq!(read_all(bs[0].as_mut(), 8192, data.len()), data);
    // And the file has it where it belongs.
    let on_disk = std::fs::read(&t.path).unwrap();
    assert_eq!(&on_disk[8192..8192 + data.len()], &data[..]);
    assert!(on_disk[..8192].iter().all(|&x| x == 0));
    let s = bs[0].stats();
    assert_eq!((s.submitted, s.completed, s.errors), (2, 2, 0));
}

#[test]
fn memory_stays_held_until_released() {
    // The kernel may write a request's buffers until it completes: the
    // backend holds their memory table that long, and after, until
    // release_memory (a slot reused over the same table takes no new hold).
    let t = Temp::file("hold", 1 << 20);
    let mut b = one(&t.path, 4);
    let mut g = Guest::new();
    let at = g.alloc(4096, 0);
    let io = g.io(&[(at, 4096)]);
    let base = Arc::strong_count(&g.mem);
    b.queue(&req(1, Op::Read, 0, 4096, &io)).unwrap();
    assert_eq!(Arc::strong_count(&g.mem), base + 1, "held while in flight");
    b.submit();
    collect(&mut *b, 1);
    for tag in 2..10 {
        assert_eq!(run(&mut *b, &req(tag, Op::Read, 0, 4096, &io)), 4096);
    }
    assert!(Arc::strong_count(&g.mem) <= base + 4, "at most one hold per slot");
    b.release_memory();
    assert_eq!(Arc::strong_count(&g.mem), base, "released");
    drop(io);
}

#[test]
fn many_requests_in_flight() {
    const N: usize = 64;
    const BLOCK: usize = 4096;
    let t = Temp::file("many", (4 * N * BLOCK) as u64);
    let mut b = one(&t.path, N);
    // N distinct blocks in a random order, each with its own pattern.
    let mut blocks: Vec<usize> = (0..4 * N).collect();
    let mut x = 12345u64;
    for i in (1..blocks.len()).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        blocks.swap(i, (x >> 33) as usize % (i + 1));
    }
    let blocks = &blocks[..N];
    let data: Vec<Vec<u8>> = blocks.iter().map(|&blk| pattern(BLOCK, blk as u64 + 7)).collect();
    let mut g = Guest::new();
    let bufs: Vec<IoBufs> = data
        .iter()
        .map(|d| {
            let at = g.with(d);
            g.io(&[(at, BLOCK)])
        })
        .collect();
    for (i, &blk) in blocks.iter().enumerate() {
        assert_eq!(b.room(), N - i);
        b.queue(&req(i as u64, Op::Write, (blk * BLOCK) as u64, BLOCK as u64, &bufs[i])).unwrap();
    }
    assert_eq!(b.room(), 0);
    assert_eq!(b.in_flight(), N);
    // Full: refused, nothing queued.
    assert_eq!(b.queue(&req(999, Op::Flush, 0, 0, NONE)), Err(EBUSY));
    b.submit();
    assert_eq!(b.stats().submit_calls, 1, "one system call for the whole batch");
    assert_eq!(b.stats().submitted, N as u64);
    let mut done = collect(b.as_mut(), N);
    done.sort_by_key(|c| c.tag);
    for (i, c) in done.iter().enumerate() {
        assert_eq!(*c, Completion { tag: i as u64, result: BLOCK as i64 });
    }
    // Read them all back at once.
    let back: Vec<u64> = (0..N).map(|_| g.alloc(BLOCK, 0)).collect();
    let bufs: Vec<IoBufs> = back.iter().map(|&at| g.io(&[(at, BLOCK)])).collect();
    for (i, &blk) in blocks.iter().enumerate() {
        b.queue(&req(1000 + i as u64, Op::Read, (blk * BLOCK) as u64, BLOCK as u64, &bufs[i])).unwrap();
    }
    let calls = b.stats().submit_calls;
    b.submit();
    assert_eq!(b.stats().submit_calls, calls + 1);
    let done = collect(b.as_mut(), N);
    assert!(done.iter().all(|c| c.result == BLOCK as i64));
    assert_eq!(back.iter().map(|&at| g.get(at, BLOCK)).collect::<Vec<_>>(), data);
    let s = b.stats();
    assert_eq!((s.submitted, s.completed, s.errors), (2 * N as u64, 2 * N as u64, 0));
}

#[test]
fn flush() {
    let t = Temp::file("flush", 65536);
    let mut b = one(&t.path, 4);
    let mut g = Guest::new();
    let at = g.with(&pattern(4096, 3));
    assert_eq!(run(b.as_mut(), &req(1, Op::Write, 0, 4096, &g.io(&[(at, 4096)]))), 4096);
    assert_eq!(run(b.as_mut(), &req(2, Op::Flush, 0, 0, NONE)), 0);
    assert_eq!(b.stats().errors, 0);
}

/// Discard punches a hole: the blocks go and the range reads as zeroes.
fn discard_in(dir: &Path) {
    const SIZE: usize = 1 << 20;
    let t = Temp::filled(dir, "discard", SIZE, 0xab);
    let mut b = one(&t.path, 4);
    let before = std::fs::metadata(&t.path).unwrap().blocks();
    let r = run(b.as_mut(), &req(1, Op::Discard, 256 << 10, 512 << 10, NONE));
    if r == -(libc::EOPNOTSUPP as i64) {
        println!("note: {} does not support punch-hole; discard not checked", dir.display());
        return;
    }
    assert_eq!(r, 0);
    let after = std::fs::metadata(&t.path).unwrap().blocks();
    assert!(after < before, "st_blocks {before} -> {after} after discard in {}", dir.display());
    let back = read_all(b.as_mut(), 0, SIZE);
    assert!(back[..256 << 10].iter().all(|&x| x == 0xab));
    assert!(back[256 << 10..768 << 10].iter().all(|&x| x == 0));
    assert!(back[768 << 10..].iter().all(|&x| x == 0xab));
    assert_eq!(std::fs::metadata(&t.path).unwrap().len(), SIZE as u64, "size kept");
}

#[test]
fn discard_punches_a_hole() {
    discard_in(&std::env::temp_dir());
    if Path::new("/dev/shm").is_dir() {
        discard_in(Path::new("/dev/shm"));
    }
}

/// Write-zeroes with and without unmap; run twice so a backend that found
/// ZERO_RANGE unsupported (tmpfs) also takes its fallback from the start.
fn write_zeroes_in(dir: &Path) {
    const SIZE: usize = 256 << 10;
    let t = Temp::filled(dir, "wz", SIZE, 0x5a);
    let mut b = one(&t.path, 4);
    for round in 0..2u64 {
        let base = round * (128 << 10);
        let r = run(b.as_mut(), &req(1, Op::WriteZeroes { unmap: false }, base, 32 << 10, NONE));
        assert_eq!(r, 0, "write-zeroes without unmap in {}", dir.display());
        let r = run(b.as_mut(), &req(2, Op::WriteZeroes { unmap: true }, base + (64 << 10), 32 << 10, NONE));
        assert_eq!(r, 0, "write-zeroes with unmap in {}", dir.display());
    }
    let back = read_all(b.as_mut(), 0, SIZE);
    for (i, &x) in back.iter().enumerate() {
        let in_block = i % (128 << 10);
        let zero = in_block < 32 << 10 || (64 << 10..96 << 10).contains(&in_block);
        assert_eq!(x, if zero { 0 } else { 0x5a }, "byte {i} in {}", dir.display());
    }
    assert_eq!(std::fs::metadata(&t.path).unwrap().len(), SIZE as u64, "size kept");
    // An empty range is fine too.
    assert_eq!(run(b.as_mut(), &req(3, Op::WriteZeroes { unmap: false }, 0, 0, NONE)), 0);
}

#[test]
fn write_zeroes_read_back_as_zeroes() {
    write_zeroes_in(&std::env::temp_dir());
    // tmpfs has no ZERO_RANGE: exercises the punch-and-allocate fallback.
    if Path::new("/dev/shm").is_dir() {
        write_zeroes_in(Path::new("/dev/shm"));
    }
}

#[test]
fn read_only_refuses_writes() {
    let t = Temp::file("ro", 8192);
    std::fs::write(&t.path, pattern(8192, 9)).unwrap();
    let (info, mut bs) = open_file(&t.path, true, false, 1, 4).unwrap();
    assert!(info.read_only);
    let b = bs[0].as_mut();
    let mut g = Guest::new();
    let at = g.alloc(512, 0);
    let io = g.io(&[(at, 512)]);
    for op in [Op::Write, Op::Discard, Op::WriteZeroes { unmap: false }, Op::WriteZeroes { unmap: true }] {
        assert_eq!(b.queue(&req(1, op, 0, 512, &io)), Err(EROFS), "{op:?}");
    }
    assert_eq!((b.room(), b.in_flight()), (4, 0));
    b.submit();
    assert_eq!(b.stats().submit_calls, 0, "nothing to submit");
    // Reads and flushes work.
    assert_eq!(read_all(b, 512, 512), pattern(8192, 9)[512..1024]);
    assert_eq!(run(b, &req(2, Op::Flush, 0, 0, NONE)), 0);
}

#[test]
fn too_many_segments_refused() {
    let t = Temp::file("segs", 1 << 20);
    let mut b = one(&t.path, 4);
    let mut g = Guest::new();
    // Pieces apart from each other (every other 512 bytes).
    let at = g.alloc((MAX_SEGS + 1) * 1024, 0);
    let mut pieces: Vec<(u64, usize)> = (0..MAX_SEGS as u64 + 1).map(|i| (at + 1024 * i, 512)).collect();
    let len = (MAX_SEGS as u64 + 1) * 512;
    assert_eq!(b.queue(&req(1, Op::Read, 0, len, &g.io(&pieces))), Err(EINVAL));
    assert_eq!(b.in_flight(), 0);
    // MAX_SEGS is fine.
    pieces.pop();
    assert_eq!(run(b.as_mut(), &req(2, Op::Read, 0, 0, &g.io(&pieces))), (MAX_SEGS * 512) as i64);
}

#[test]
fn read_past_end_is_an_error() {
    // The device never does this, but the file may have shrunk under us:
    // the first read is short, the rest reads nothing, and that is -EIO.
    let t = Temp::file("eof", 8192);
    let mut b = one(&t.path, 4);
    let mut g = Guest::new();
    let (x, y) = (g.alloc(2048, 0), g.alloc(6144, 0));
    assert_eq!(run(b.as_mut(), &req(1, Op::Read, 4096, 8192, &g.io(&[(x, 2048), (y, 6144)]))), EIO);
    assert_eq!(b.stats().errors, 1);
    assert!(b.stats().submit_calls >= 2, "the rest was resubmitted");
}

#[test]
fn open_errors_name_the_path() {
    let missing = Temp::name_in(&std::env::temp_dir(), "missing");
    let dir = Temp::dir("dir");
    let odd = Temp::file("odd", 1000);
    let empty = Temp::file("empty", 0);
    for (path, kind) in [
        (missing.as_path(), std::io::ErrorKind::NotFound),
        (dir.path.as_path(), std::io::ErrorKind::InvalidInput),
        (odd.path.as_path(), std::io::ErrorKind::InvalidInput),
        (empty.path.as_path(), std::io::ErrorKind::InvalidInput),
    ] {
        for readonly in [false, true] {
            let e = open_file(path, readonly, false, 1, 4).err().expect("open must fail");
            assert_eq!(e.kind(), kind, "{e}");
            assert!(e.to_string().contains(&*path.to_string_lossy()), "message names the path: {e}");
        }
    }
    let e = open_file(Path::new("/dev/null"), true, false, 1, 4).err().expect("a character device is refused");
    assert!(e.to_string().contains("/dev/null"), "{e}");
    let e = open_file(&odd.path, false, false, 1, 0).err().expect("depth 0 is refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
}

#[test]
fn direct_io_with_aligned_buffers() {
    let t = Temp::file("direct", 1 << 20);
    let (info, mut bs) = match open_file(&t.path, false, true, 1, 8) {
        Ok(x) => x,
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
            println!("note: {} refuses O_DIRECT ({e}); not checked", std::env::temp_dir().display());
            return;
        }
        Err(e) => panic!("{e}"),
    };
    assert!(info.block_size >= 512 && info.block_size.is_power_of_two(), "block size {}", info.block_size);
    let b = bs[0].as_mut();
    // Guest memory is page-aligned as O_DIRECT needs.
    let mut g = Guest::new();
    let data = pattern(3 * 4096, 11);
    let w = g.with(&data);
    let io = g.io(&[(w, 4096), (w + 4096, 2 * 4096)]);
    assert_eq!(run(b, &req(1, Op::Write, 65536, data.len() as u64, &io)), data.len() as i64);
    let r = g.alloc(3 * 4096, 0);
    assert_eq!(run(b, &req(2, Op::Read, 65536, data.len() as u64, &g.io(&[(r, 3 * 4096)]))), data.len() as i64);
    assert_eq!(g.get(r, 3 * 4096), data);
}

#[test]
fn completion_fd_wakes_after_submit() {
    let t = Temp::file("efd", 65536);
    let mut b = one(&t.path, 4);
    let fd = b.completion_fd().expect("file backend has a completion fd");
    let mut g = Guest::new();
    let at = g.alloc(4096, 0);
    let io = g.io(&[(at, 4096)]);
    b.queue(&req(7, Op::Read, 0, 4096, &io)).unwrap();
    b.submit();
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, bounded timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
    assert_eq!(n, 1, "completion fd readable within 5 s");
    assert!(pfd.revents & libc::POLLIN != 0);
    let mut v = [0u8; 8];
    // SAFETY: reads 8 bytes into a local buffer.
    assert_eq!(unsafe { libc::read(fd, v.as_mut_ptr() as *mut libc::c_void, 8) }, 8);
    // The completion is there without waiting.
    let mut out = Vec::new();
    b.reap(&mut out);
    assert_eq!(out, vec![Completion { tag: 7, result: 4096 }]);
}

#[test]
fn two_backends_signal_one_shared_eventfd() {
    let t = Temp::file("shared-efd", 65536);
    let (mut a, mut b) = (one(&t.path, 4), one(&t.path, 4));
    // SAFETY: eventfd() takes no pointers; checked below.
    let shared = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(shared >= 0);
    let own = a.completion_fd().unwrap();
    assert!(a.signal_completions_to(shared) && b.signal_completions_to(shared));
    assert_eq!((a.completion_fd(), b.completion_fd()), (Some(shared), Some(shared)));
    let mut g = Guest::new();
    let at = g.alloc(2 * 4096, 0);
    let (ia, ib) = (g.io(&[(at, 4096)]), g.io(&[(at + 4096, 4096)]));
    let wait = |fd: RawFd, ms: i32| {
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, bounded timeout.
        unsafe { libc::poll(&mut pfd, 1, ms) }
    };
    for (k, (backend, io)) in [(&mut a, &ia), (&mut b, &ib)].into_iter().enumerate() {
        backend.queue(&req(k as u64, Op::Read, 0, 4096, io)).unwrap();
        backend.submit();
        assert_eq!(wait(shared, 5000), 1, "backend {k}'s completion signals the shared eventfd");
        backend.ack_completion_event();
        let mut out = Vec::new();
        backend.reap(&mut out);
        assert_eq!(out, vec![Completion { tag: k as u64, result: 4096 }]);
    }
    assert_eq!(wait(own, 0), 0, "the backend's own eventfd is no longer signalled");
    drop((a, b));
    // SAFETY: our descriptor, closed once.
    unsafe { libc::close(shared) };
}

#[test]
fn drop_with_requests_in_flight() {
    let t = Temp::file("drop", 1 << 20);
    std::fs::write(&t.path, vec![0x3c; 1 << 20]).unwrap();
    let mut b = one(&t.path, 8);
    let mut g = Guest::new();
    let at = g.alloc(1 << 20, 0);
    let io = g.io(&[(at, 1 << 20)]);
    b.queue(&req(1, Op::Read, 0, 1 << 20, &io)).unwrap();
    b.submit();
    // The request holds the memory: the test's own handles on it can go
    // while the kernel writes into it.
    let weak = Arc::downgrade(&g.mem);
    drop((io, g));
    assert!(weak.upgrade().is_some(), "the backend holds the memory of a request in flight");
    // The backend's drop waits for the request; then nothing holds the memory.
    drop(b);
    assert!(weak.upgrade().is_none(), "the memory is let go once the request is done");
}

#[test]
fn null_backend() {
    let (info, mut bs) = open(&BlockSpec::Null { size: 1 << 30 }, 2, 4).unwrap();
    assert_eq!(info.capacity, 1 << 30);
    assert_eq!(bs.len(), 2);
    let b = bs[0].as_mut();
    let mut g = Guest::new();
    let at = g.alloc(1024, 0x77);
    assert_eq!(b.room(), 4);
    b.queue(&req(1, Op::Read, 0, 1024, &g.io(&[(at, 1024)]))).unwrap();
    b.queue(&req(2, Op::Flush, 0, 0, NONE)).unwrap();
    assert_eq!((b.room(), b.in_flight()), (2, 2));
    b.submit();
    let mut out = Vec::new();
    b.reap(&mut out);
    assert_eq!(out, vec![Completion { tag: 1, result: 1024 }, Completion { tag: 2, result: 0 }]);
    assert_eq!((b.room(), b.in_flight()), (4, 0));
    assert!(g.get(at, 1024).iter().all(|&x| x == 0x77), "reads leave buffers alone");
}

#[test]
fn block_device_read_only() {
    // Any block device with a size and a node we can open; only read.
    let found = std::fs::read_dir("/sys/block").into_iter().flatten().flatten().find_map(|e| {
        let name = e.file_name().into_string().ok()?;
        let sectors: u64 = std::fs::read_to_string(e.path().join("size")).ok()?.trim().parse().ok()?;
        let lbs: u32 = std::fs::read_to_string(e.path().join("queue/logical_block_size")).ok()?.trim().parse().ok()?;
        let dev = PathBuf::from("/dev").join(&name);
        (sectors > 0 && std::fs::File::open(&dev).is_ok()).then_some((dev, sectors * 512, lbs))
    });
    let Some((dev, size, lbs)) = found else {
        println!("note: no readable block device; not checked");
        return;
    };
    let (info, mut bs) = open_file(&dev, true, true, 1, 4).unwrap();
    assert_eq!((info.capacity, info.block_size, info.read_only), (size, lbs, true), "{}", dev.display());
    let mut g = Guest::new();
    let at = g.alloc(4096, 0);
    assert_eq!(run(bs[0].as_mut(), &req(1, Op::Read, 0, 4096, &g.io(&[(at, 4096)]))), 4096);
}

/// The file system magic of `dir` (statfs f_type), if statfs answers.
fn fs_magic(dir: &Path) -> Option<u32> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statfs is plain data (all zeros is valid); statfs(2) fills it
    // for a valid C path.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        (libc::statfs(c.as_ptr(), &mut st) == 0).then_some(st.f_type as u32)
    }
}

/// /dev/shm if it is a tmpfs (else the test says so and is not checked).
fn shm() -> Option<&'static Path> {
    let shm = Path::new("/dev/shm");
    if fs_magic(shm) == Some(libc::TMPFS_MAGIC as u32) {
        Some(shm)
    } else {
        println!("note: /dev/shm is not a tmpfs; not checked");
        None
    }
}

/// Whether `fd` polls readable within `ms` milliseconds.
fn readable(fd: RawFd, ms: i32) -> bool {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, bounded timeout.
    unsafe { libc::poll(&mut pfd, 1, ms) == 1 }
}

/// Reaps once, without waiting.
fn reap_now(b: &mut dyn BlockBackend) -> Vec<Completion> {
    let mut out = Vec::new();
    b.reap(&mut out);
    out
}

#[test]
fn tmpfs_reads_and_writes_complete_inline() {
    let Some(shm) = shm() else { return };
    let t = Temp::file_in(shm, "inline", 1 << 20);
    let mut b = one(&t.path, 4);
    let fd = b.completion_fd().unwrap();
    let mut g = Guest::new();
    let bare = Arc::strong_count(&g.mem);
    // Several segments, not sector-sized, one of them empty.
    let data = pattern(3 * 4096 + 1536, 21);
    let w = g.with(&data);
    let pieces = [(w, 1000), (w + 1000, 0), (w + 1000, 7000), (w + 8000, data.len() - 8000)];
    let io_w = g.io(&pieces);
    let base = Arc::strong_count(&g.mem);
    b.queue(&req(1, Op::Write, 8192 + 512, data.len() as u64, &io_w)).unwrap();
    // Finished, and counted in flight until reaped.
    assert_eq!((b.in_flight(), b.room()), (1, 3));
    assert_eq!(Arc::strong_count(&g.mem), base + 1, "the slot holds the memory as a reaped slot does");
    b.submit();
    assert_eq!(reap_now(b.as_mut()), vec![Completion { tag: 1, result: data.len() as i64 }]);
    assert_eq!(b.in_flight(), 0);
    let on_file = std::fs::read(&t.path).unwrap();
    assert_eq!(&on_file[8192 + 512..8192 + 512 + data.len()], &data[..]);
    assert!(on_file[..8192 + 512].iter().all(|&x| x == 0));
    assert!(on_file[8192 + 512 + data.len()..].iter().all(|&x| x == 0));
    // Read back with other boundaries, 512 bytes before and after.
    let r = g.alloc(data.len() + 1024, 0xee);
    let io_r = g.io(&[(r, 3000), (r + 3000, 5000), (r + 8000, data.len() + 1024 - 8000)]);
    b.queue(&req(2, Op::Read, 8192, data.len() as u64 + 1024, &io_r)).unwrap();
    b.submit();
    assert_eq!(reap_now(b.as_mut()), vec![Completion { tag: 2, result: data.len() as i64 + 1024 }]);
    let got = g.get(r, data.len() + 1024);
    assert!(got[..512].iter().all(|&x| x == 0) && got[512 + data.len()..].iter().all(|&x| x == 0));
    assert_eq!(&got[512..512 + data.len()], &data[..]);
    // No io_uring_enter, and no wake-up to consume. A sparse image is not
    // mapped (a mapping's read of a hole would allocate it).
    let s = b.stats();
    assert_eq!((s.submitted, s.completed, s.errors, s.submit_calls, s.mapped), (2, 2, 0, 0, 0));
    assert!(!readable(fd, 0), "nothing signals the completion fd for inline requests");
    // A flush still goes through the ring, and wakes the completion fd.
    b.queue(&req(3, Op::Flush, 0, 0, NONE)).unwrap();
    b.submit();
    assert!(readable(fd, 5000), "a flush's completion wakes the fd");
    assert_eq!(collect(b.as_mut(), 1), vec![Completion { tag: 3, result: 0 }]);
    assert_eq!(b.stats().submit_calls, 1);
    drop((io_w, io_r));
    assert!(Arc::strong_count(&g.mem) > bare, "held after completion, until released");
    b.release_memory();
    assert_eq!(Arc::strong_count(&g.mem), bare, "released");
}

#[test]
fn tmpfs_short_read_at_eof_and_past_it() {
    let Some(shm) = shm() else { return };
    let t = Temp::file_in(shm, "inline-eof", 8192);
    let content = pattern(8192, 5);
    std::fs::write(&t.path, &content).unwrap();
    let mut b = one(&t.path, 4);
    let mut g = Guest::new();
    // Half of it lies past the end: the first preadv moves 4096 bytes (the
    // second buffer's start), the rest reads nothing, and that is -EIO.
    let (x, y) = (g.alloc(2048, 0xee), g.alloc(6144, 0xee));
    b.queue(&req(1, Op::Read, 4096, 8192, &g.io(&[(x, 2048), (y, 6144)]))).unwrap();
    b.submit();
    assert_eq!(reap_now(b.as_mut()), vec![Completion { tag: 1, result: EIO }]);
    assert_eq!(g.get(x, 2048), &content[4096..6144]);
    let rest = g.get(y, 6144);
    assert_eq!(&rest[..2048], &content[6144..]);
    assert!(rest[2048..].iter().all(|&v| v == 0xee), "nothing past the end");
    // Wholly past the end.
    let z = g.alloc(4096, 0);
    b.queue(&req(2, Op::Read, 8192, 4096, &g.io(&[(z, 4096)]))).unwrap();
    b.submit();
    assert_eq!(reap_now(b.as_mut()), vec![Completion { tag: 2, result: EIO }]);
    let s = b.stats();
    assert_eq!((s.completed, s.errors, s.submit_calls), (2, 2, 0));
}

#[test]
fn tmpfs_inline_completions_fill_the_depth() {
    let Some(shm) = shm() else { return };
    let t = Temp::file_in(shm, "inline-depth", 65536);
    let mut b = one(&t.path, 2);
    let mut g = Guest::new();
    let at = g.alloc(3 * 4096, 0);
    let ios: Vec<IoBufs> = (0..3).map(|k| g.io(&[(at + k * 4096, 4096)])).collect();
    b.queue(&req(1, Op::Read, 0, 4096, &ios[0])).unwrap();
    b.queue(&req(2, Op::Write, 4096, 4096, &ios[1])).unwrap();
    // Unreaped, they still take the room.
    assert_eq!((b.in_flight(), b.room()), (2, 0));
    assert_eq!(b.queue(&req(3, Op::Read, 0, 4096, &ios[2])), Err(EBUSY));
    assert_eq!(b.queue(&req(3, Op::Flush, 0, 0, NONE)), Err(EBUSY));
    // Waiting returns at once: they are done.
    b.wait();
    let mut tags: Vec<u64> = reap_now(b.as_mut()).iter().map(|c| c.tag).collect();
    tags.sort();
    assert_eq!(tags, vec![1, 2]);
    // A request left unreaped does not hold up the drop.
    b.queue(&req(4, Op::Read, 0, 4096, &ios[2])).unwrap();
    drop(b);
}

/// Blocks (512 bytes) the file at `path` has allocated.
fn blocks(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks()
}

/// An image in /dev/shm of `size` bytes of `byte`, written out (so the file
/// backend maps it), with the SIGBUS handler installed, as vhostd does
/// (images are mapped only with it); None if /dev/shm is not a tmpfs.
fn shm_image(what: &str, size: usize, byte: u8) -> Option<Temp> {
    let shm = shm()?;
    virtq::sigbus::install_handler().unwrap();
    Some(Temp::filled(shm, what, size, byte))
}

#[test]
fn a_fully_allocated_tmpfs_image_is_copied_through_a_mapping() {
    const SIZE: usize = 256 << 10;
    let Some(t) = shm_image("mapped", SIZE, 0x3c) else { return };
    let mut b = one(&t.path, 4);
    let fd = b.completion_fd().unwrap();
    let mut g = Guest::new();
    let data = pattern(2 * 4096 + 1536, 33);
    let w = g.with(&data);
    let pieces = [(w, 1000), (w + 1000, 0), (w + 1000, 5000), (w + 6000, data.len() - 6000)];
    b.queue(&req(1, Op::Write, 4096 + 512, data.len() as u64, &g.io(&pieces))).unwrap();
    assert_eq!((b.in_flight(), b.room()), (1, 3), "done, in flight until reaped");
    b.submit();
    assert_eq!(reap_now(b.as_mut()), vec![Completion { tag: 1, result: data.len() as i64 }]);
    // In the file, as other processes read it.
    let on_file = std::fs::read(&t.path).unwrap();
    assert_eq!(&on_file[4096 + 512..4096 + 512 + data.len()], &data[..]);
    assert!(on_file[..4096 + 512].iter().all(|&x| x == 0x3c));
    assert!(on_file[4096 + 512 + data.len()..].iter().all(|&x| x == 0x3c));
    // Read back across other boundaries, ending at the last byte.
    let back = read_all(b.as_mut(), 4096, SIZE - 4096);
    assert_eq!(&back[512..512 + data.len()], &data[..]);
    assert!(back[..512].iter().all(|&x| x == 0x3c) && back[512 + data.len()..].iter().all(|&x| x == 0x3c));
    let s = b.stats();
    assert_eq!((s.submitted, s.completed, s.errors, s.submit_calls, s.mapped), (2, 2, 0, 0, 2));
    assert!(!readable(fd, 0), "nothing signals the completion fd");
    // Past the end: not the mapping's (the kernel answers, as before).
    let z = g.alloc(8192, 0xee);
    assert_eq!(run(b.as_mut(), &req(3, Op::Read, SIZE as u64 - 4096, 8192, &g.io(&[(z, 8192)]))), EIO);
    assert!(g.get(z, 4096).iter().all(|&x| x == 0x3c), "the part before the end");
    assert_eq!(b.stats().mapped, 2);
    // Read-only: reads copied, writes refused.
    let (_, mut ro) = open_file(&t.path, true, false, 1, 4).unwrap();
    let mut r = ro.pop().unwrap();
    assert!(read_all(r.as_mut(), 4096 + 512, data.len()) == data, "read-only copy");
    assert_eq!(r.queue(&req(4, Op::Write, 0, 4096, &g.io(&[(z, 4096)]))), Err(EROFS));
    assert_eq!(r.stats().mapped, 1);
}

#[test]
fn a_discard_ends_the_copies_for_every_queue() {
    const SIZE: usize = 1 << 20;
    let Some(t) = shm_image("mapped-discard", SIZE, 0x77) else { return };
    let (_, mut queues) = open_file(&t.path, false, false, 2, 4).unwrap();
    let (mut q1, mut q0) = (queues.pop().unwrap(), queues.pop().unwrap());
    assert!(read_all(q1.as_mut(), 0, 4096).iter().all(|&x| x == 0x77));
    assert_eq!(q1.stats().mapped, 1);
    let full = blocks(&t.path);
    assert_eq!(run(q0.as_mut(), &req(1, Op::Discard, 256 << 10, 512 << 10, NONE)), 0);
    let holed = blocks(&t.path);
    assert!(holed < full, "st_blocks {full} -> {holed}");
    // The other queue reads the hole with preadv: zeros, nothing allocated.
    let back = read_all(q1.as_mut(), 0, SIZE);
    assert!(back[..256 << 10].iter().all(|&x| x == 0x77) && back[768 << 10..].iter().all(|&x| x == 0x77));
    assert!(back[256 << 10..768 << 10].iter().all(|&x| x == 0));
    assert_eq!(blocks(&t.path), holed, "reading the hole allocated it");
    assert_eq!((q0.stats().mapped, q1.stats().mapped), (0, 1), "no copies after the discard");
}

/// Writes `len` bytes of `byte` at `offset` of the file at `path` (from
/// outside, as another process would).
fn fill(path: &Path, offset: u64, len: usize, byte: u8) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&vec![byte; len], offset).unwrap();
}

/// Reads 4 KiB at 0 through `b` until one is copied through the mapping
/// (the copies resumed), for at most `within`. Whether one was.
fn copies_resume(b: &mut dyn BlockBackend, within: std::time::Duration) -> bool {
    let mut g = Guest::new();
    let at = g.alloc(4096, 0);
    let (before, start) = (b.stats().mapped, std::time::Instant::now());
    while start.elapsed() < within {
        assert_eq!(run(b, &req(7, Op::Read, 0, 4096, &g.io(&[(at, 4096)]))), 4096);
        if b.stats().mapped > before {
            return true;
        }
    }
    false
}

#[test]
fn a_discard_stops_every_open_of_the_image_until_it_is_full_again() {
    const SIZE: usize = 1 << 20;
    let Some(t) = shm_image("mapped-shared", SIZE, 0x5a) else { return };
    // Two opens of one file: two devices, or two LUNs, on the same image.
    let (mut a, mut b) = (one(&t.path, 4), one(&t.path, 4));
    assert!(read_all(b.as_mut(), 0, 4096).iter().all(|&x| x == 0x5a));
    assert_eq!(b.stats().mapped, 1);
    let full = blocks(&t.path);
    assert_eq!(run(a.as_mut(), &req(1, Op::Discard, 256 << 10, 256 << 10, NONE)), 0);
    let holed = blocks(&t.path);
    assert!(holed < full, "st_blocks {full} -> {holed}");
    // The other open reads the hole with preadv: zeros, nothing allocated.
    assert!(read_all(b.as_mut(), 256 << 10, 256 << 10).iter().all(|&x| x == 0));
    assert_eq!(blocks(&t.path), holed, "reading the hole allocated it");
    assert_eq!((a.stats().mapped, b.stats().mapped), (0, 1), "no copies after the discard");
    // A third open, made now: mapped, but no copies either.
    let mut c = one(&t.path, 4);
    assert!(read_all(c.as_mut(), 256 << 10, 4096).iter().all(|&x| x == 0));
    assert_eq!((c.stats().mapped, blocks(&t.path)), (0, holed));
    // Still holed, though blocks past the end make up the count (so
    // st_blocks alone would say full): the looks find the hole.
    let f = std::fs::OpenOptions::new().write(true).open(&t.path).unwrap();
    // SAFETY: fallocate on a descriptor we own; no memory is passed.
    let r = unsafe {
        libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), libc::FALLOC_FL_KEEP_SIZE, SIZE as i64, 512 << 10)
    };
    assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
    assert!(blocks(&t.path) >= full);
    assert!(!copies_resume(b.as_mut(), std::time::Duration::from_millis(1500)), "copies with a hole");
    // The guest writes the range again (the kernel's path, which allocates
    // it): the next look resumes the copies, for both opens.
    let mut g = Guest::new();
    let again = pattern(256 << 10, 9);
    let w = g.with(&again);
    assert_eq!(run(a.as_mut(), &req(2, Op::Write, 256 << 10, 256 << 10, &g.io(&[(w, 256 << 10)]))), 256 << 10);
    assert_eq!(a.stats().mapped, 0);
    assert!(copies_resume(b.as_mut(), std::time::Duration::from_secs(10)), "the copies did not resume");
    assert!(read_all(a.as_mut(), 256 << 10, 256 << 10) == again);
    assert_eq!(a.stats().mapped, 1, "the discarding open copies again too");
    assert!(read_all(c.as_mut(), 256 << 10, 4096) == again[..4096]);
    assert_eq!(c.stats().mapped, 1, "an open made while the image had a hole copies too");
}

#[test]
fn an_image_with_a_hole_is_not_copied_even_with_blocks_past_its_end() {
    const SIZE: usize = 64 << 10;
    // Blocks past the end make up for a hole inside: st_blocks alone would
    // say fully allocated.
    let Some(t) = shm_image("mapped-holed", SIZE, 0x42) else { return };
    let f = std::fs::OpenOptions::new().write(true).open(&t.path).unwrap();
    // SAFETY: fallocate on a descriptor we own; no memory is passed.
    unsafe {
        assert_eq!(
            libc::fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                8192,
                4096
            ),
            0
        );
        assert_eq!(
            libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), libc::FALLOC_FL_KEEP_SIZE, SIZE as i64, 64 << 10),
            0
        );
    }
    assert!(blocks(&t.path) * 512 >= SIZE as u64);
    let mut b = one(&t.path, 4);
    let got = read_all(b.as_mut(), 8192, 4096);
    assert!(got.iter().all(|&x| x == 0), "the hole reads as zeros");
    assert_eq!(b.stats().mapped, 0, "copied through the mapping");
    let holed = blocks(&t.path);
    assert!(read_all(b.as_mut(), 0, SIZE)[..8192].iter().all(|&x| x == 0x42));
    assert_eq!(blocks(&t.path), holed, "reading the hole allocated nothing");
}

#[test]
fn write_zeroes_on_a_mapped_image() {
    const SIZE: usize = 4 << 20;
    let Some(t) = shm_image("mapped-wz", SIZE, 0x99) else { return };
    let mut b = one(&t.path, 4);
    let full = blocks(&t.path);
    // Without unmap, up to 1 MiB: zeros stored through the mapping; the
    // pages stay allocated.
    assert_eq!(run(b.as_mut(), &req(1, Op::WriteZeroes { unmap: false }, 4096 + 512, 8192, NONE)), 0);
    assert_eq!(b.stats().mapped, 1);
    assert_eq!(blocks(&t.path), full, "still fully allocated");
    let on_file = std::fs::read(&t.path).unwrap();
    assert!(on_file[4096 + 512..4096 + 512 + 8192].iter().all(|&x| x == 0));
    assert!(
        on_file[..4096 + 512].iter().all(|&x| x == 0x99) && on_file[4096 + 512 + 8192..].iter().all(|&x| x == 0x99)
    );
    // Larger: the kernel's (punch, then allocate again); the copies go on.
    assert_eq!(run(b.as_mut(), &req(2, Op::WriteZeroes { unmap: false }, 1 << 20, 2 << 20, NONE)), 0);
    assert_eq!(blocks(&t.path), full, "allocated again");
    assert!(read_all(b.as_mut(), 1 << 20, 2 << 20).iter().all(|&x| x == 0));
    assert_eq!(b.stats().mapped, 2, "still copied");
    // With unmap: a hole, and the copies end.
    assert_eq!(run(b.as_mut(), &req(3, Op::WriteZeroes { unmap: true }, 0, 4096, NONE)), 0);
    let holed = blocks(&t.path);
    assert!(holed < full);
    assert!(read_all(b.as_mut(), 0, 4096).iter().all(|&x| x == 0));
    assert_eq!((blocks(&t.path), b.stats().mapped), (holed, 2), "read by the kernel, nothing allocated");
}

#[test]
fn a_truncated_image_fails_the_request_and_ends_the_copies() {
    const SIZE: usize = 64 << 10;
    let Some(t) = shm_image("mapped-truncated", SIZE, 0x11) else { return };
    let mut b = one(&t.path, 4);
    let mut g = Guest::new();
    let (at, w) = (g.alloc(4096, 0), g.alloc(4096, 0xee));
    assert_eq!(run(b.as_mut(), &req(1, Op::Read, 32 << 10, 4096, &g.io(&[(at, 4096)]))), 4096);
    let lost = virtq::sigbus::lost_mappings();
    // Someone else shrinks it: the next copy faults, and the request fails.
    std::fs::OpenOptions::new().write(true).open(&t.path).unwrap().set_len(16 << 10).unwrap();
    assert_eq!(run(b.as_mut(), &req(2, Op::Write, 32 << 10, 4096, &g.io(&[(w, 4096)]))), EIO);
    assert_eq!(virtq::sigbus::lost_mappings(), lost, "an image lost is not guest memory lost");
    assert_eq!(b.stats().mapped, 2);
    // From then on the kernel answers: short of the end, and past it.
    assert!(read_all(b.as_mut(), 0, 4096).iter().all(|&x| x == 0x11));
    assert_eq!(run(b.as_mut(), &req(3, Op::Read, 32 << 10, 4096, &g.io(&[(at, 4096)]))), EIO);
    assert_eq!(b.stats().mapped, 2, "no copies after the fault");
    // Even once it has grown back, fully allocated: the mapping's pages
    // past the cut are zero pages now, for good.
    std::fs::OpenOptions::new().write(true).open(&t.path).unwrap().set_len(SIZE as u64).unwrap();
    fill(&t.path, 16 << 10, SIZE - (16 << 10), 0x22);
    assert_eq!(run(b.as_mut(), &req(4, Op::Write, 32 << 10, 4096, &g.io(&[(w, 4096)]))), 4096);
    let on_file = std::fs::read(&t.path).unwrap();
    assert!(on_file[32 << 10..36 << 10].iter().all(|&x| x == 0xee), "written after growing back");
    assert_eq!(b.stats().mapped, 2);
    // Longer than a look takes to come (LOOK_EVERY, 1 s): none resumes them.
    assert!(!copies_resume(b.as_mut(), std::time::Duration::from_millis(1500)), "copies through a lost mapping");
}

#[test]
fn ext4_still_goes_through_io_uring() {
    let dir = Path::new("/var/tmp");
    if fs_magic(dir) != Some(0xef53) {
        println!("note: /var/tmp is not ext2/3/4; not checked");
        return;
    }
    let t = Temp::file_in(dir, "uring", 65536);
    let mut b = one(&t.path, 4);
    let fd = b.completion_fd().unwrap();
    let mut g = Guest::new();
    let at = g.alloc(4096, 0);
    b.queue(&req(1, Op::Read, 0, 4096, &g.io(&[(at, 4096)]))).unwrap();
    b.submit();
    assert!(readable(fd, 5000), "the completion wakes the fd");
    assert_eq!(collect(b.as_mut(), 1), vec![Completion { tag: 1, result: 4096 }]);
    assert_eq!(b.stats().submit_calls, 1, "submitted with io_uring_enter");
}
