//! Every store the virtio-blk device makes into guest memory is marked in
//! the dirty-page log (what live migration copies again), on split and
//! packed rings: status bytes, GET_ID data, used rings and event areas, and
//! the read data the kernel writes through io_uring (marked on completion).
//!
//! The device (`BlkQueue` over the io_uring file backend, on a temporary
//! file of known bytes) runs over a memfd it maps as guest memory with a
//! `DirtyLog` set; the project's own driver (`virtq-driver`) maps the same
//! memfd and posts the requests. Guest memory is snapshotted after the
//! driver posted and again after every request completed (before the driver
//! reads anything back), so only the device's stores differ. The tests
//! assert:
//!
//! - the property: every 4 KiB page whose bytes changed is marked;
//! - that it is not vacuous: the pages the device is known to write (used
//!   ring, event area, status bytes, GET_ID, read data, each on pages of
//!   their own) did change and are marked;
//! - that the device changed nothing outside what it may write (a failed
//!   read leaves its buffer alone);
//! - that the workload ran: read data equals the file's bytes, written data
//!   reached the file, every status is the one expected;
//! - the converse: with the log cleared (`with_log(None)`) the same workload
//!   marks nothing in the bitmap that was set before.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use vhostd_blk::{status, types, BlkDevice, BlkQueue, HEADER_LEN, ID_LEN, SECTOR};
use vhostd_block_backends::{open, BlockSpec};
use virtq::ring::features::{EVENT_IDX, RING_PACKED, VERSION_1};
use virtq::{
    Batch, DirtyLog, GuestMemory, Mapping, PackedConfig, PackedQueue, Queue, Region, SplitConfig, SplitQueue, LOG_PAGE,
    PACKED_BASE_INITIAL,
};
use virtq_driver::{Buf, DriverMemory, DriverRing, PackedDriver, RingLayout, SharedMemory, SplitDriver, Used};

const GPA: u64 = 0x10_0000;
const MEM: u64 = 4 << 20;
/// Queue size: 512 split used elements fill exactly one page.
const QSIZE: u16 = 512;
/// Bitmap bytes: pages up to 128 MiB, well past the memory.
const LOG_BYTES: usize = 4096;
/// What device-writable memory holds before the device runs; disk bytes
/// and ids are below 0x80, so every byte the device stores differs.
const POISON: u8 = 0xa5;
const RING_FEATURES: u64 = VERSION_1 | EVENT_IDX;

const RING: u64 = GPA;
const HEADERS: u64 = GPA + 0x1_0000;
const STATUS: u64 = GPA + 0x2_0000;
/// The GET_ID buffer straddles a page boundary.
const ID_BUF: u64 = GPA + 0x3_0ff0;
/// Read buffers: 128 KiB per request.
const IN_DATA: u64 = GPA + 0x10_0000;
const IN_REGION: u64 = 0x2_0000;
const OUT_DATA: u64 = GPA + 0x20_0000;

const DISK: u64 = 1 << 20;
const SERIAL: &str = "dirty-log-serial";

/// Reads: first sector and pieces (offset in the request's region, length),
/// most crossing page boundaries; the last one is past the disk's end.
const READS: [(u64, &[(u64, u32)]); 7] = [
    (0, &[(0xe00, 4096)]),
    (8, &[(0xf00, 1000), (0x2ff0, 2072), (0x4f00, 1024)]),
    (100, &[(0x200, 16384)]),
    (DISK / SECTOR - 1, &[(0xf00, 512)]),
    (300, &[(0xffe, 512), (0x1ffe, 7680)]),
    (1000, &[(0x10, 65536)]),
    (DISK / SECTOR, &[(0xa00, 512)]),
];
/// Writes: first sector and piece lengths (none overlaps a read).
const WRITES: [(u64, &[u32]); 3] = [(1500, &[4096]), (1600, &[1024, 3072]), (1700, &[512])];

/// The byte at `offset` of the disk image.
fn disk_byte(offset: u64) -> u8 {
    ((offset * 7 + offset / SECTOR * 3 + 5) % 127) as u8
}

/// A temporary disk image, removed when the test ends, passed or not.
struct TempFile {
    path: PathBuf,
}

impl TempFile {
    fn new(tag: &str) -> TempFile {
        let path = std::env::temp_dir().join(format!("vhostd-blk-dirty-log-{}-{tag}", std::process::id()));
        let t = TempFile { path };
        std::fs::write(&t.path, (0..DISK).map(disk_byte).collect::<Vec<u8>>()).unwrap();
        t
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One memfd seen by the device (`GuestMemory`, no log yet) and the driver.
struct Guest {
    mem: GuestMemory,
    drv: DriverMemory,
}

impl Guest {
    fn new(name: &str) -> Guest {
        let file = virtq_driver::memfd(name, MEM, true).unwrap();
        let m = Arc::new(Mapping::map(&file, 0, MEM).unwrap());
        let mem = GuestMemory::from_regions(vec![Region::new(GPA, MEM, m, 0).unwrap()]).unwrap();
        let drv = DriverMemory::new(Arc::new(SharedMemory::map(&file, 0, MEM).unwrap()), GPA);
        Guest { mem, drv }
    }

    fn fill(&self, gpa: u64, len: u64, byte: u8) {
        assert!(self.drv.write(gpa, &vec![byte; len as usize]));
    }

    fn read(&self, gpa: u64, len: u64) -> Vec<u8> {
        let mut v = vec![0u8; len as usize];
        assert!(self.drv.read(gpa, &mut v));
        v
    }

    /// All of guest memory, as the driver sees it.
    fn snapshot(&self) -> Vec<u8> {
        self.read(GPA, MEM)
    }
}

fn new_log() -> Arc<DirtyLog> {
    Arc::new(DirtyLog::new(Arc::new(Mapping::anonymous(LOG_BYTES).unwrap()), 0, LOG_BYTES).unwrap())
}

/// Pages of [gpa, gpa + len).
fn pages(gpa: u64, len: u64) -> std::ops::Range<u64> {
    if len == 0 {
        return 0..0;
    }
    gpa / LOG_PAGE..(gpa + len - 1) / LOG_PAGE + 1
}

fn hex_pages(p: impl IntoIterator<Item = u64>) -> Vec<String> {
    p.into_iter().map(|p| format!("{:#x}", p * LOG_PAGE)).collect()
}

/// A ring for both sides: the driver's layout, and its pages by role.
#[derive(Clone, Copy)]
struct Ring {
    layout: RingLayout,
    packed: bool,
}

impl Ring {
    /// Split: descriptor table (2 pages), avail ring (1 page), then the used
    /// ring placed so its header ends a page, its 512 elements fill the next
    /// one and avail_event starts the one after. Packed: the descriptor ring
    /// placed so slot 0 (the first used descriptor, stored as len/id then
    /// flags) ends a page and the slots after it (stored whole) start the
    /// next; then the driver and device areas, a page each.
    fn at(base: u64, packed: bool) -> Ring {
        let layout = if packed {
            RingLayout { size: QSIZE, desc: base + 0x1000 - 16, avail: base + 0x3000, used: base + 0x4000 }
        } else {
            RingLayout { size: QSIZE, desc: base, avail: base + 0x2000, used: base + 0x4000 - 4 }
        };
        Ring { layout, packed }
    }

    /// The driver side over fresh (zeroed) rings; the split used ring's
    /// elements and avail_event are then poisoned, so every device store
    /// into them changes bytes.
    fn driver(&self, g: &Guest) -> DriverRing {
        let mem = g.drv.clone();
        if self.packed {
            DriverRing::Packed(PackedDriver::new(mem, self.layout, RING_FEATURES).unwrap())
        } else {
            let d = SplitDriver::new(mem, self.layout, RING_FEATURES).unwrap();
            g.fill(self.layout.used + 4, 8 * QSIZE as u64 + 2, POISON);
            DriverRing::Split(d)
        }
    }

    /// The device side over `mem`.
    fn device(&self, mem: &Arc<GuestMemory>) -> Queue {
        let l = self.layout;
        if self.packed {
            let cfg = PackedConfig {
                size: l.size,
                desc: l.desc,
                driver: l.avail,
                device: l.used,
                features: RING_FEATURES | RING_PACKED,
                base: PACKED_BASE_INITIAL,
            };
            Queue::Packed(PackedQueue::new(mem.clone(), cfg).unwrap())
        } else {
            let cfg = SplitConfig {
                size: l.size,
                desc: l.desc,
                avail: l.avail,
                used: l.used,
                features: RING_FEATURES,
                next_avail: 0,
            };
            Queue::Split(SplitQueue::new(mem.clone(), cfg).unwrap())
        }
    }

    /// Pages the device may store into.
    fn device_pages(&self) -> BTreeSet<u64> {
        let l = self.layout;
        if self.packed {
            pages(l.desc, 16 * QSIZE as u64).chain(pages(l.used, 4)).collect()
        } else {
            pages(l.used, 6 + 8 * QSIZE as u64).collect()
        }
    }

    /// Pages a device that used at least two chains and called enable then
    /// disable notifications must have changed: split, used.idx's, the
    /// elements' and avail_event's; packed, the first used descriptor's, the
    /// next ones' and the device area's.
    fn written_pages(&self) -> BTreeSet<u64> {
        let l = self.layout;
        if self.packed {
            pages(l.desc, 32).chain(pages(l.used, 4)).collect()
        } else {
            pages(l.used, 4).chain(pages(l.used + 4, 8)).chain(pages(l.used + 4 + 8 * QSIZE as u64, 2)).collect()
        }
    }
}

/// A request as posted, and what must come back.
struct Req {
    what: String,
    /// Device-writable data expected after completion (reads, GET_ID).
    expect_data: Option<(Vec<Buf>, Vec<u8>)>,
    status: u64,
    expect_status: u8,
    expect_len: u32,
}

/// What a workload left for the checks: memory before and after the device
/// ran, the pages it must have changed, and the pages it may change.
struct Outcome {
    before: Vec<u8>,
    after: Vec<u8>,
    known: BTreeSet<u64>,
    allowed: BTreeSet<u64>,
}

impl Outcome {
    fn changed(&self) -> BTreeSet<u64> {
        let page = LOG_PAGE as usize;
        self.before
            .chunks(page)
            .zip(self.after.chunks(page))
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(i, _)| GPA / LOG_PAGE + i as u64)
            .collect()
    }

    /// The known pages changed, and nothing outside the allowed ones did.
    fn check_changes(&self, what: &str) -> BTreeSet<u64> {
        let changed = self.changed();
        let unchanged: Vec<u64> = self.known.difference(&changed).copied().collect();
        assert!(unchanged.is_empty(), "{what}: pages the device writes did not change: {:?}", hex_pages(unchanged));
        let stray: Vec<u64> = changed.difference(&self.allowed).copied().collect();
        assert!(stray.is_empty(), "{what}: the device changed pages it should not: {:?}", hex_pages(stray));
        changed
    }

    /// The property: every changed page is marked (and so every known one).
    fn check_logged(&self, log: &DirtyLog, what: &str) {
        let changed = self.check_changes(what);
        let missed: Vec<u64> = changed.iter().copied().filter(|&p| !log.is_marked(p)).collect();
        assert!(
            missed.is_empty(),
            "{what}: pages the device changed are not in the dirty log: {:?}",
            hex_pages(missed)
        );
    }
}

/// Reads (one past the disk's end), writes, GET_ID, FLUSH and an unknown
/// type, run to completion on the file backend, with the memory table
/// `table` makes of the guest's.
fn blk_workload(packed: bool, tag: &str, table: &dyn Fn(&GuestMemory) -> GuestMemory) -> Outcome {
    let what = if packed { "packed ring" } else { "split ring" };
    let disk_file = TempFile::new(tag);
    let spec = BlockSpec::File { path: disk_file.path.clone(), readonly: false, direct: false, discard: true };
    let (disk, mut backends) = open(&spec, 1, 256).unwrap();
    assert_eq!(disk.capacity, DISK);
    let dev = BlkDevice::new(disk, 1, SERIAL);
    let mut bq = BlkQueue::new(backends.pop().unwrap(), 256);

    let g = Guest::new("vhostd-blk-dirty-log");
    let ring = Ring::at(RING, packed);
    let mut drv = ring.driver(&g);
    let mut reqs: Vec<Req> = Vec::new();
    let mut known = BTreeSet::new();
    // Posts header, data (readable for writes, writable otherwise) and a
    // poisoned status byte on the status pages.
    let mut post = |kind: u32, sector: u64, data: &[Buf], req: Req| {
        let k = reqs.len() as u64;
        let hdr = Buf { addr: HEADERS + 32 * k, len: HEADER_LEN as u32 };
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&kind.to_le_bytes());
        h[8..].copy_from_slice(&sector.to_le_bytes());
        assert!(g.drv.write(hdr.addr, &h));
        let status = Buf { addr: req.status, len: 1 };
        g.fill(status.addr, 1, POISON);
        let mut readable = vec![hdr];
        let mut writable = Vec::new();
        if kind == types::OUT {
            readable.extend_from_slice(data);
        } else {
            for b in data {
                g.fill(b.addr, b.len as u64, POISON);
            }
            writable.extend_from_slice(data);
        }
        writable.push(status);
        drv.add(&readable, &writable, k).unwrap();
        reqs.push(req);
    };
    let status_at = |k: usize| STATUS + 0x171 * k as u64;

    for (i, &(sector, pieces)) in READS.iter().enumerate() {
        let region = IN_DATA + IN_REGION * i as u64;
        let bufs: Vec<Buf> = pieces.iter().map(|&(off, len)| Buf { addr: region + off, len }).collect();
        let bytes: u64 = pieces.iter().map(|p| p.1 as u64).sum();
        let in_range = (sector + bytes / SECTOR) * SECTOR <= DISK;
        let req = if in_range {
            for b in &bufs {
                known.extend(pages(b.addr, b.len as u64));
            }
            let expect = (sector * SECTOR..sector * SECTOR + bytes).map(disk_byte).collect();
            Req {
                what: format!("read of sector {sector}"),
                expect_data: Some((bufs.clone(), expect)),
                status: status_at(i),
                expect_status: status::OK,
                expect_len: bytes as u32 + 1,
            }
        } else {
            // Refused: its buffer must stay as it was.
            let poison = vec![POISON; bytes as usize];
            Req {
                what: format!("read past the end at sector {sector}"),
                expect_data: Some((bufs.clone(), poison)),
                status: status_at(i),
                expect_status: status::IOERR,
                expect_len: 1,
            }
        };
        post(types::IN, sector, &bufs, req);
    }
    let mut written = Vec::new();
    let mut next = OUT_DATA;
    for (i, &(sector, lens)) in WRITES.iter().enumerate() {
        let mut bufs = Vec::new();
        let mut all = Vec::new();
        for (j, &len) in lens.iter().enumerate() {
            let bytes: Vec<u8> = (0..len as usize).map(|b| ((i * 13 + j * 5 + b + 64) % 127) as u8).collect();
            let buf = Buf { addr: next + 0x321, len };
            assert!(g.drv.write(buf.addr, &bytes));
            next = (buf.addr + len as u64 + 0xfff) & !0xfff;
            bufs.push(buf);
            all.extend(bytes);
        }
        written.push((sector, all));
        let k = READS.len() + i;
        let req = Req {
            what: format!("write of sector {sector}"),
            expect_data: None,
            status: status_at(k),
            expect_status: status::OK,
            expect_len: 1,
        };
        post(types::OUT, sector, &bufs, req);
    }
    let k = READS.len() + WRITES.len();
    let id_buf = Buf { addr: ID_BUF, len: ID_LEN as u32 };
    let mut id = SERIAL.as_bytes().to_vec();
    id.resize(ID_LEN, 0);
    known.extend(pages(id_buf.addr, id_buf.len as u64));
    let get_id = Req {
        what: "GET_ID".into(),
        expect_data: Some((vec![id_buf], id)),
        status: status_at(k),
        expect_status: status::OK,
        expect_len: ID_LEN as u32 + 1,
    };
    post(types::GET_ID, 0, &[id_buf], get_id);
    let only_status = |what: &str, k: usize, st: u8| Req {
        what: what.into(),
        expect_data: None,
        status: status_at(k),
        expect_status: st,
        expect_len: 1,
    };
    post(types::FLUSH, 0, &[], only_status("FLUSH", k + 1, status::OK));
    post(0x7777, 0, &[], only_status("unknown type", k + 2, status::UNSUPP));
    drv.publish();
    let statuses: BTreeSet<u64> = reqs.iter().flat_map(|r| pages(r.status, 1)).collect();
    assert!(statuses.len() >= 2, "status bytes on several pages");
    known.extend(statuses);
    known.extend(ring.written_pages());

    // Only the device runs from here to the second snapshot. `drain` waits
    // for the backend; no request may be left.
    let before = g.snapshot();
    let mem = Arc::new(table(&g.mem));
    let mut q = ring.device(&mem);
    let mut batch = Batch::new();
    for _ in 0..8 {
        bq.process(&mut q, &mut batch, &dev);
        bq.drain(&mut q, &dev);
        if q.pending() == 0 && bq.in_flight() == 0 {
            break;
        }
    }
    assert_eq!(bq.in_flight(), 0, "{what}: requests left in flight");
    q.needs_notify();
    q.enable_notifications();
    q.disable_notifications();
    drop(batch);
    let after = g.snapshot();

    // Every request came back with its status, length and data.
    let mut used: Vec<Used> = Vec::new();
    while let Some(u) = drv.pop_used().unwrap() {
        used.push(u);
    }
    used.sort_by_key(|u| u.token);
    assert_eq!(used.iter().map(|u| u.token).collect::<Vec<_>>(), (0..reqs.len() as u64).collect::<Vec<_>>());
    for (r, u) in reqs.iter().zip(&used) {
        assert_eq!(g.read(r.status, 1)[0], r.expect_status, "{what}: {} status", r.what);
        assert_eq!(u.len, r.expect_len, "{what}: {} used length", r.what);
        if let Some((bufs, expect)) = &r.expect_data {
            let got: Vec<u8> = bufs.iter().flat_map(|b| g.read(b.addr, b.len as u64)).collect();
            assert!(&got == expect, "{what}: {} data", r.what);
        }
    }
    let image = std::fs::read(&disk_file.path).unwrap();
    for (sector, bytes) in &written {
        let at = (sector * SECTOR) as usize;
        assert!(image[at..at + bytes.len()] == bytes[..], "{what}: write of sector {sector} not in the file");
    }
    drop(disk_file);

    let mut allowed = ring.device_pages();
    allowed.extend(known.iter().copied());
    Outcome { before, after, known, allowed }
}

fn blk_logged(packed: bool, tag: &str) {
    let log = new_log();
    let out = blk_workload(packed, tag, &|m| m.with_log(Some(log.clone())));
    out.check_logged(&log, if packed { "packed ring" } else { "split ring" });
}

#[test]
fn split_requests_are_logged() {
    blk_logged(false, "split");
}

#[test]
fn packed_requests_are_logged() {
    blk_logged(true, "packed");
}

/// The log set on the table and then cleared (`with_log(None)`): the same
/// workload changes the same pages, and its bitmap stays empty.
#[test]
fn no_log_marks_nothing() {
    for packed in [false, true] {
        let what = if packed { "packed ring, no log" } else { "split ring, no log" };
        let aside = new_log();
        let out = blk_workload(packed, if packed { "nolog-packed" } else { "nolog-split" }, &|m| {
            let cleared = m.with_log(Some(aside.clone())).with_log(None);
            assert!(cleared.log().is_none());
            cleared
        });
        assert!(!out.check_changes(what).is_empty());
        let marked: Vec<u64> = (0..LOG_BYTES as u64 * 8).filter(|&p| aside.is_marked(p)).collect();
        assert!(marked.is_empty(), "{what}: pages marked with no log set: {:?}", hex_pages(marked));
    }
}
