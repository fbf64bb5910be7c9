//! vhostd's virtio-blk device (`vhostd blk`) driven through the project's
//! own vhost-user frontend (`vhostd-user`'s blk mode): data written and
//! read back byte for byte over split and packed rings and several queues
//! (checked in the image file itself), the config space and features,
//! every request type, bad requests (each answered and counted exactly),
//! the null backend, reconnects with requests in flight, and the
//! dataplane modes.
//!
//! Every daemon is killed and every image removed on drop, failures
//! included; every wait is bounded.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use vhost::vhost_user::message::VhostUserConfigFlags;
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vhostd_user::blk::workload::{self, check_pattern, fill_pattern, fill_pattern_shared, Mode, Workload};
use vhostd_user::blk::{self, status, types, BlkConfig, BlkOp, BlkQueue, BlkReply, RawSeg, SECTOR, STATUS_NOT_WRITTEN};
use vhostd_user::{features as f, Options, VhostUserProtocolFeatures, VirtioUser};

const T: Duration = Duration::from_secs(10);
/// Seed of the pattern every image starts with ("untouched" means this).
const BG: u64 = 0xb6;
/// What vhostd advertises (crates/blk/src/lib.rs: SIZE_MAX, SEG_MAX,
/// MAX_RANGE_SECTORS).
const SIZE_MAX: u32 = 128 << 10;
const SEG_MAX: u32 = 128;
const MAX_RANGE_SECTORS: u32 = 1 << 21;
/// Device features every blk disk offers; DISCARD, WRITE_ZEROES and RO vary.
const BLK_BASE: u64 =
    f::BLK_SIZE_MAX | f::BLK_SEG_MAX | f::BLK_BLK_SIZE | f::BLK_FLUSH | f::BLK_TOPOLOGY | f::BLK_CONFIG_WCE | f::BLK_MQ;
/// Ring and vhost-user features a blk device offers (no IN_ORDER: requests
/// may complete in any order).
const RING_OFFERED: u64 =
    f::VERSION_1 | f::EVENT_IDX | f::INDIRECT_DESC | f::RING_PACKED | f::LOG_ALL | f::PROTOCOL_FEATURES;

/// A scratch directory (common's `tempdir`) removed with its contents on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        Scratch(tempdir())
    }

    /// A scratch directory under `base` (another file system).
    fn under(base: &Path) -> Scratch {
        let d = tempdir();
        let _ = fs::remove_dir_all(&d);
        let p = base.join(d.file_name().unwrap());
        fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }

    /// An image of `size` bytes holding the background pattern, on disk.
    fn image(&self, size: u64) -> PathBuf {
        let p = self.0.join("disk.img");
        let mut buf = vec![0u8; size as usize];
        fill_pattern(&mut buf, 0, BG);
        fs::write(&p, &buf).unwrap();
        // Allocated for real (not delayed), so block counts are stable.
        File::open(&p).unwrap().sync_all().unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// `vhostd blk --socket-path <tmp> --backend <backend> <extra>`, listening.
fn start_blk(backend: &str, extra: &[&str]) -> Daemon {
    let mut args = vec!["--backend".to_string(), backend.to_string()];
    args.extend(extra.iter().map(|a| a.to_string()));
    Daemon::start_with(None, move |sock| {
        let mut v = vec!["blk".to_string(), "--socket-path".to_string(), sock.display().to_string()];
        v.extend(args);
        v
    })
}

fn file_backend(img: &Path, opts: &str) -> String {
    format!("file,path={}{opts}", img.display())
}

/// A blk connection with a split or (required) packed ring.
fn connect(d: &Daemon, packed: bool) -> VirtioUser {
    connect_with(d, packed, |_| {})
}

/// `connect` with the options edited first.
fn connect_with(d: &Daemon, packed: bool, edit: impl FnOnce(&mut Options)) -> VirtioUser {
    let mut o = Options::blk(&d.sock);
    if packed {
        o.features |= f::RING_PACKED;
        o.required |= f::RING_PACKED;
    }
    edit(&mut o);
    let dev = VirtioUser::connect(o).unwrap_or_else(|e| panic!("connect: {e}; vhostd log:\n{}", d.log()));
    assert_eq!(dev.packed(), packed);
    dev
}

/// The config space vhostd serves for a writable or read-only disk.
fn expected_config(capacity: u64, queues: u16, discard: bool) -> BlkConfig {
    BlkConfig {
        capacity,
        size_max: SIZE_MAX,
        seg_max: SEG_MAX,
        geometry: Default::default(),
        blk_size: 512,
        physical_block_exp: 0,
        alignment_offset: 0,
        min_io_size: 1,
        opt_io_size: 0,
        writeback: 1,
        num_queues: queues,
        max_discard_sectors: MAX_RANGE_SECTORS,
        max_discard_seg: 1,
        discard_sector_alignment: 1,
        max_write_zeroes_sectors: MAX_RANGE_SECTORS,
        max_write_zeroes_seg: 1,
        write_zeroes_may_unmap: discard as u8,
    }
}

fn read_file(p: &Path, off: u64, len: usize) -> Vec<u8> {
    image::read(p, off, len)
}

/// `len` bytes of the image at `off` are still the background pattern.
fn assert_bg(p: &Path, off: u64, len: usize) {
    image::assert_pattern(p, off, len, BG)
}

use image::allocated as blocks;
use image::{assert_zero, seek};

/// Every per-queue request counter vhostd prints.
const COUNTERS: &[&str] = &[
    "reads",
    "writes",
    "flushes",
    "discards",
    "write_zeroes",
    "get_ids",
    "bytes_read",
    "bytes_written",
    "ioerr",
    "unsupp",
    "no_status",
    "out_of_range",
    "read_only",
    "misaligned",
    "backend_errors",
    "bad_chains",
];

/// Queue `q`'s counters are exactly `want`; every counter not named is 0.
fn expect_counters(s: &Stats, q: usize, want: &BTreeMap<&'static str, u64>) {
    for k in want.keys() {
        assert!(COUNTERS.contains(k), "unknown counter {k}");
    }
    let got: Vec<(&str, u64)> = COUNTERS.iter().map(|&k| (k, s.queue(q, k))).collect();
    let exp: Vec<(&str, u64)> = COUNTERS.iter().map(|&k| (k, want.get(k).copied().unwrap_or(0))).collect();
    assert_eq!(got, exp, "queue {q} counters");
}

fn sum(s: &Stats, k: &str) -> u64 {
    s.queues.keys().map(|&q| s.queue(q, k)).sum()
}

/// The `stats total` line agrees with the queue lines.
fn check_totals(s: &Stats) {
    for k in ["reads", "writes", "bytes_read", "bytes_written", "unsupp", "no_status"] {
        assert_eq!(s.total(k), sum(s, k), "total {k}");
    }
    assert_eq!(s.total("errors"), sum(s, "ioerr") + sum(s, "bad_chains"), "total errors");
}

/// A request queue and the counters vhostd must end up with for it.
struct Q {
    bq: BlkQueue,
    want: BTreeMap<&'static str, u64>,
}

impl Q {
    fn new(bq: BlkQueue) -> Q {
        Q { bq, want: BTreeMap::new() }
    }

    fn count(&mut self, keys: &[&'static str]) {
        for k in keys {
            *self.want.entry(k).or_default() += 1;
        }
    }

    fn add(&mut self, key: &'static str, n: u64) {
        *self.want.entry(key).or_default() += n;
    }

    /// A request answered with exactly `st` and used length `used`,
    /// counted in `keys`.
    fn expect(&mut self, op: BlkOp, data: &[u8], st: u8, used: u32, keys: &[&'static str]) -> BlkReply {
        let r = self.bq.request(op, data, T).unwrap();
        assert_eq!((r.status, r.used_len), (st, used), "{op:?}");
        self.count(keys);
        r
    }

    /// A raw chain answered with `st` (its last writable byte) and `used`.
    fn raw(&mut self, segs: &[RawSeg], st: u8, used: u32, keys: &[&'static str]) -> BlkReply {
        let r = self.bq.request_raw(segs, T).unwrap();
        assert_eq!((r.status, r.used_len), (st, used), "raw chain of {} buffers", segs.len());
        self.count(keys);
        r
    }

    fn read(&mut self, sector: u64, len: u32) -> Vec<u8> {
        let r = self.expect(BlkOp::Read { sector, len }, &[], status::OK, len + 1, &["reads"]);
        self.add("bytes_read", len as u64);
        assert!(r.completion.ok());
        r.data
    }

    fn write(&mut self, sector: u64, data: &[u8]) {
        let len = data.len() as u32;
        self.expect(BlkOp::Write { sector, len }, data, status::OK, 1, &["writes"]);
        self.add("bytes_written", len as u64);
    }

    /// The queue still serves a normal read correctly (4 KiB of the
    /// untouched background at sector 8).
    fn still_serves(&mut self) {
        let d = self.read(8, 4096);
        assert_eq!(check_pattern(&d, 8 * 512, BG), None, "a normal read after a bad request");
    }

    /// A verify workload, which must pass; the counters it adds to vhostd's
    /// are tallied.
    fn verify(&mut self, capacity: u64, w: &Workload) -> workload::Report {
        let r = workload::run(std::slice::from_mut(&mut self.bq), capacity, w, None).unwrap();
        assert!(r.passed(), "{}: {:?} {:?}", r.summary(), r.first_error, r.mismatch);
        let n = r.verified_blocks;
        self.add("reads", n);
        self.add("writes", n);
        self.add("bytes_read", n * w.bs as u64);
        self.add("bytes_written", n * w.bs as u64);
        self.add("flushes", 1);
        r
    }
}

/// The 20-byte GET_ID answer for `serial`.
fn id_of(serial: &str) -> Vec<u8> {
    let mut id = vec![0u8; blk::ID_LEN];
    id[..serial.len()].copy_from_slice(serial.as_bytes());
    id
}

/// The scheduler state ('R', 'S', ...) of vhostd's thread `name`.
fn thread_state(pid: i32, name: &str) -> Option<char> {
    for t in fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        let comm = fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() == name {
            let stat = fs::read_to_string(t.path().join("stat")).ok()?;
            // "tid (comm) S ...": the state follows the last ')'.
            return stat.rsplit_once(')')?.1.trim_start().chars().next();
        }
    }
    None
}

// ---------------------------------------------------------------------------
// 1. Verify: pattern written, flushed, read back and compared, and found in
//    the image file, over split and packed rings, one and two queues.
// ---------------------------------------------------------------------------

/// Runs three verify passes over the first 3 MiB of a 4 MiB image (256 KiB
/// requests in two segments, 4 KiB, then 600 single sectors), then checks
/// the file byte for byte and vhostd's counters exactly. Returns the stats.
fn verify_case(extra: &[&str], queues: u16, packed: bool) -> Stats {
    verify_case_with(extra, queues, packed, |_| {})
}

fn verify_case_with(extra: &[&str], queues: u16, packed: bool, edit: impl FnOnce(&mut Options)) -> Stats {
    let dir = Scratch::new();
    let size = 4u64 << 20;
    let img = dir.image(size);
    let nq = queues.to_string();
    let mut args = vec!["--queues", nq.as_str()];
    args.extend_from_slice(extra);
    let d = start_blk(&file_backend(&img, ""), &args);
    let mut dev = connect_with(&d, packed, edit);
    let cfg = dev.blk_config().unwrap();
    assert_eq!(cfg.capacity, size / SECTOR);
    assert_eq!(cfg.num_queues, queues);
    assert_eq!(dev.max_queues(), queues as u64);
    let mut qs: Vec<BlkQueue> = (0..queues).map(|i| dev.blk_queue(i, 16, 256 << 10).unwrap()).collect();
    assert_eq!(qs[0].seg_size(), SIZE_MAX, "256 KiB requests go in two 128 KiB segments");
    let area = 3u64 << 20;
    let runs: [(u32, u64, Option<u64>); 3] = [(256 << 10, 11, None), (4096, 12, None), (512, 13, Some(600))];
    let mut requests = 0;
    let mut blocks_total = 0;
    let mut bytes_total = 0;
    for (bs, seed, count) in runs {
        let w = Workload { seed, size: Some(area), count, ..Workload::new(Mode::Verify, bs) };
        let r = workload::run(&mut qs, cfg.capacity, &w, None).unwrap();
        assert!(r.passed(), "{}: {:?} {:?}", r.summary(), r.first_error, r.mismatch);
        let n = count.unwrap_or(area / bs as u64);
        assert_eq!(r.verified_blocks, n, "{}", r.summary());
        assert_eq!(r.flush, Some(status::OK));
        assert_eq!((r.ios, r.errors, r.bytes), (2 * n + 1, 0, 2 * n * bs as u64), "{}", r.summary());
        requests += 2 * n + 1;
        blocks_total += n;
        bytes_total += n * bs as u64;
    }
    assert!(qs.iter().all(|q| q.in_flight() == 0));
    // vhostd writes each used ring in pop order.
    assert_eq!(qs.iter().map(|q| q.reordered()).collect::<Vec<_>>(), vec![0; queues as usize]);
    drop(qs);
    let bases = dev.disconnect().unwrap();
    assert_eq!(bases.len(), queues as usize);
    if !packed {
        // Split: GET_VRING_BASE is the next avail index, so together the
        // queues consumed exactly the requests made.
        let consumed: u64 = bases.iter().map(|&(_, b)| b as u64 & 0xffff).sum();
        assert_eq!(consumed, requests, "vring bases {bases:?}");
    }

    // The file: the last pattern over the first 600 sectors, the 4 KiB
    // run's beyond that up to 3 MiB, the background after.
    let data = fs::read(&img).unwrap();
    assert_eq!(data.len() as u64, size);
    assert_eq!(check_pattern(&data[..600 * 512], 0, 13), None);
    assert_eq!(check_pattern(&data[600 * 512..area as usize], 600 * 512, 12), None);
    assert_eq!(check_pattern(&data[area as usize..], area, BG), None, "bytes past the area changed");

    let s = d.stop();
    check_totals(&s);
    assert_eq!(s.queues.len(), queues as usize);
    assert_eq!(sum(&s, "writes"), blocks_total);
    assert_eq!(sum(&s, "reads"), blocks_total);
    assert_eq!(sum(&s, "bytes_written"), bytes_total);
    assert_eq!(sum(&s, "bytes_read"), bytes_total);
    for q in 0..queues as usize {
        // Everything but the data counters is exact per queue: the verify
        // flushes go on queue 0, nothing failed.
        let mut want = BTreeMap::new();
        for k in ["reads", "writes", "bytes_read", "bytes_written"] {
            want.insert(k, s.queue(q, k));
        }
        if q == 0 {
            want.insert("flushes", runs.len() as u64);
        }
        expect_counters(&s, q, &want);
        if queues > 1 {
            assert!(s.queue(q, "writes") > 0 && s.queue(q, "reads") > 0, "queue {q} carried no requests");
        }
        // The 4 KiB run published 16 requests on each queue at once: the
        // device took them all in one pass (16 is MAX_POP), and never had
        // more than the frontend's 16.
        assert_eq!(s.queue(q, "max_in_flight"), 16, "queue {q}");
    }
    s
}

#[test]
fn verify_split_ring_one_queue() {
    let s = verify_case(&[], 1, false);
    // Interrupt mode: the worker slept and was kicked.
    assert!(s.queue(0, "kicks") > 0);
}

#[test]
fn verify_packed_ring_one_queue() {
    verify_case(&[], 1, true);
}

#[test]
fn verify_split_ring_two_queues() {
    verify_case(&[], 2, false);
}

#[test]
fn verify_packed_ring_two_queues() {
    verify_case(&[], 2, true);
}

#[test]
fn verify_without_event_idx() {
    // Notifications through the ring flags instead of event indexes.
    let off = |o: &mut Options| o.features &= !f::EVENT_IDX;
    verify_case_with(&[], 1, false, off);
    verify_case_with(&[], 2, true, off);
}

#[test]
fn verify_with_o_direct() {
    let dir = Scratch::new();
    let size = 4u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ",direct=on"), &[]);
    let mut dev = connect(&d, false);
    let cfg = dev.blk_config().unwrap();
    // The block size O_DIRECT needs here (512, or the file system's).
    let bsz = cfg.blk_size;
    assert!(bsz >= 512 && bsz.is_power_of_two(), "blk_size {bsz}");
    assert_eq!(cfg.discard_sector_alignment, bsz / 512);
    let mut q = Q::new(dev.blk_queue(0, 16, 64 << 10).unwrap());
    let w = Workload { seed: 21, size: Some(2 << 20), ..Workload::new(Mode::Verify, 64 << 10) };
    q.verify(cfg.capacity, &w);
    let w = Workload { seed: 22, count: Some(300), ..Workload::new(Mode::Verify, bsz.max(4096)) };
    let r = q.verify(cfg.capacity, &w);
    drop(q.bq);
    dev.disconnect().unwrap();
    let split = 300 * r.bs as usize;
    let data = fs::read(&img).unwrap();
    assert_eq!(check_pattern(&data[..split], 0, 22), None);
    assert_eq!(check_pattern(&data[split..2 << 20], split as u64, 21), None);
    assert_eq!(check_pattern(&data[2 << 20..], 2 << 20, BG), None);
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
}

// ---------------------------------------------------------------------------
// 2. Config space and features.
// ---------------------------------------------------------------------------

#[test]
fn config_space_and_features_of_a_writable_file() {
    let dir = Scratch::new();
    // Not a whole number of MiB, so nothing rounds it by accident.
    let size = (8u64 << 20) + 3 * 512;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, false);
    assert_eq!(dev.offered_features(), RING_OFFERED | BLK_BASE | f::BLK_WRITE_ZEROES);
    assert_eq!(dev.features(), (f::VERSION_1 | f::EVENT_IDX | f::PROTOCOL_FEATURES | BLK_BASE | f::BLK_WRITE_ZEROES));
    assert_eq!(
        dev.protocol_features(),
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::LOG_SHMFD
    );
    assert_eq!(dev.blk_config().unwrap(), expected_config(size / 512, 1, false));
    assert_eq!(dev.max_queues(), 1);
    // There is no queue 1.
    assert!(dev.blk_queue(1, 4, 4096).is_err());
    assert!(dev.frontend().set_vring_num(1, 16).is_err(), "vhostd set up ring 1 of a 1-queue disk");
    // The driver may only write `writeback`; everything else is refused.
    assert!(dev.frontend().set_config(0, VhostUserConfigFlags::empty(), &[0u8; 8]).is_err());
    assert!(dev.frontend().set_config(34, VhostUserConfigFlags::empty(), &[4, 0]).is_err());
    assert_eq!(dev.read_blk_config().unwrap(), expected_config(size / 512, 1, false));
    // A config read past the fields served reads zeros (QEMU asks for more).
    let (_, tail) = dev.frontend().get_config(40, 64, VhostUserConfigFlags::empty(), &[0u8; 64]).unwrap();
    let mut want = vec![0u8; 64];
    want[..20].copy_from_slice(&expected_config_bytes(size / 512, 1, false)[40..60]);
    assert_eq!(tail, want);
    dev.disconnect().unwrap();
    expect_counters(&d.stop(), 0, &BTreeMap::new());
}

/// crates/blk's config layout for the same disk (for raw GET_CONFIG reads).
fn expected_config_bytes(capacity: u64, queues: u16, discard: bool) -> [u8; 60] {
    let mut c = [0u8; 60];
    c[0..8].copy_from_slice(&capacity.to_le_bytes());
    c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
    c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
    c[20..24].copy_from_slice(&512u32.to_le_bytes());
    c[26..28].copy_from_slice(&1u16.to_le_bytes());
    c[32] = 1;
    c[34..36].copy_from_slice(&queues.to_le_bytes());
    c[36..40].copy_from_slice(&MAX_RANGE_SECTORS.to_le_bytes());
    c[40..44].copy_from_slice(&1u32.to_le_bytes());
    c[44..48].copy_from_slice(&1u32.to_le_bytes());
    c[48..52].copy_from_slice(&MAX_RANGE_SECTORS.to_le_bytes());
    c[52..56].copy_from_slice(&1u32.to_le_bytes());
    c[56] = discard as u8;
    assert_eq!(BlkConfig::parse(&c), Some(expected_config(capacity, queues, discard)));
    c
}

#[test]
fn config_space_with_discard_and_two_queues() {
    let dir = Scratch::new();
    let size = 4u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ",discard=on"), &["--queues", "2"]);
    let mut dev = connect(&d, true);
    assert_eq!(dev.offered_features(), RING_OFFERED | BLK_BASE | f::BLK_DISCARD | f::BLK_WRITE_ZEROES);
    assert_ne!(dev.features() & f::BLK_DISCARD, 0);
    assert_eq!(dev.blk_config().unwrap(), expected_config(size / 512, 2, true));
    assert_eq!(dev.max_queues(), 2);
    assert!(dev.blk_queue(2, 4, 4096).is_err());
    assert!(dev.frontend().set_vring_num(2, 16).is_err(), "vhostd set up ring 2 of a 2-queue disk");
    dev.disconnect().unwrap();
    d.stop();
}

#[test]
fn config_space_of_a_readonly_file() {
    let dir = Scratch::new();
    let size = 4u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ",readonly=on"), &[]);
    let dev = connect(&d, false);
    // RO, and neither DISCARD nor WRITE_ZEROES.
    assert_eq!(dev.offered_features(), RING_OFFERED | BLK_BASE | f::BLK_RO);
    assert_ne!(dev.features() & f::BLK_RO, 0);
    assert_eq!(dev.blk_config().unwrap(), expected_config(size / 512, 1, false));
    dev.disconnect().unwrap();
    d.stop();
}

#[test]
fn write_through_through_config_wce() {
    let dir = Scratch::new();
    let size = 4u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, false);
    assert_ne!(dev.features() & f::BLK_CONFIG_WCE, 0);
    assert_eq!(dev.blk_config().unwrap().writeback, 1);
    // Only 0 and 1 are cache modes.
    assert!(dev.frontend().set_config(32, VhostUserConfigFlags::empty(), &[2]).is_err());
    assert_eq!(dev.read_blk_config().unwrap().writeback, 1);
    dev.frontend().set_config(32, VhostUserConfigFlags::empty(), &[0]).unwrap();
    let cfg = dev.read_blk_config().unwrap();
    assert_eq!(cfg, BlkConfig { writeback: 0, ..expected_config(size / 512, 1, false) });
    // Writes (each now write + fdatasync) still land and read back.
    let mut q = Q::new(dev.blk_queue(0, 8, 64 << 10).unwrap());
    let w = Workload { seed: 31, size: Some(1 << 20), ..Workload::new(Mode::Verify, 16 << 10) };
    q.verify(cfg.capacity, &w);
    dev.frontend().set_config(32, VhostUserConfigFlags::empty(), &[1]).unwrap();
    assert_eq!(dev.read_blk_config().unwrap().writeback, 1);
    drop(q.bq);
    dev.disconnect().unwrap();
    let data = fs::read(&img).unwrap();
    assert_eq!(check_pattern(&data[..1 << 20], 0, 31), None);
    assert_eq!(check_pattern(&data[1 << 20..], 1 << 20, BG), None);
    expect_counters(&d.stop(), 0, &q.want);
}

// ---------------------------------------------------------------------------
// 3. Every request type.
// ---------------------------------------------------------------------------

#[test]
fn every_request_type_on_a_file() {
    let dir = Scratch::new();
    let size = 4u64 << 20;
    let img = dir.image(size);
    let serial = "vhostd-serial-01";
    let d = start_blk(&file_backend(&img, ",discard=on"), &["--serial", serial]);
    let mut dev = connect(&d, false);
    let cap = dev.blk_config().unwrap().capacity;
    let mut q = Q::new(dev.blk_queue(0, 4, 64 << 10).unwrap());

    // OUT, then FLUSH: the data is in the file at its offset, nothing around it moved.
    let mut data = vec![0u8; 8192];
    fill_pattern(&mut data, 24 * 512, 99);
    q.write(24, &data);
    q.expect(BlkOp::Flush, &[], status::OK, 1, &["flushes"]);
    assert_eq!(read_file(&img, 24 * 512, 8192), data);
    assert_bg(&img, 0, 24 * 512);
    assert_bg(&img, 40 * 512, 64 << 10);
    // IN: the same bytes, used length data + status.
    assert_eq!(q.read(24, 8192), data);
    // IN of zero bytes: nothing to do, OK.
    q.expect(BlkOp::Read { sector: 0, len: 0 }, &[], status::OK, 1, &["reads"]);

    // GET_ID: --serial, zero-padded to 20 bytes; and cut to a shorter buffer.
    let r = q.expect(BlkOp::GetId, &[], status::OK, 21, &["get_ids"]);
    assert_eq!(r.data, id_of(serial));
    let op = BlkOp::Other { req_type: types::GET_ID, sector: 0, len: 8, writable: true };
    let r = q.expect(op, &[], status::OK, 9, &["get_ids"]);
    assert_eq!(r.data, b"vhostd-s");
    let hdr = blk::header(types::GET_ID, 0);
    let r = q.raw(
        &[RawSeg::Readable(&hdr), RawSeg::Writable(7), RawSeg::Writable(13), RawSeg::Writable(1)],
        status::OK,
        21,
        &["get_ids"],
    );
    assert_eq!(r.data[..20], id_of(serial)[..]);

    // DISCARD of 1 MiB at 1 MiB: a hole exactly there, space freed, zeros.
    let (mib, mib_sectors) = (1u64 << 20, (1u32 << 20) / 512);
    let before = blocks(&img);
    q.expect(BlkOp::Discard { sector: mib / 512, sectors: mib_sectors, flags: 0 }, &[], status::OK, 1, &["discards"]);
    let after = blocks(&img);
    // 2048 units freed (give or take one extent-tree block).
    assert!(before >= after + 2048 - 8, "st_blocks {before} -> {after} after discarding 1 MiB");
    assert_eq!(seek(&img, mib, libc::SEEK_HOLE), mib);
    assert_eq!(seek(&img, mib, libc::SEEK_DATA), 2 * mib);
    assert_zero(&img, mib, mib as usize);
    assert_bg(&img, mib - 4096, 4096);
    assert_bg(&img, 2 * mib, 4096);
    assert!(q.read(mib / 512, 64 << 10).iter().all(|&b| b == 0));
    assert!(q.read(2 * mib / 512 - 128, 64 << 10).iter().all(|&b| b == 0));

    // WRITE_ZEROES without unmap at 2 MiB: zeros, the space stays allocated.
    let wz = 64u64 << 10;
    let before = blocks(&img);
    let op = BlkOp::WriteZeroes { sector: 2 * mib / 512, sectors: (wz / 512) as u32, flags: 0 };
    q.expect(op, &[], status::OK, 1, &["write_zeroes"]);
    assert!(blocks(&img) >= before, "write-zeroes without unmap freed space");
    assert_zero(&img, 2 * mib, wz as usize);
    assert_bg(&img, 2 * mib + wz, 4096);
    assert!(q.read(2 * mib / 512, wz as u32).iter().all(|&b| b == 0));

    // WRITE_ZEROES with unmap at 3 MiB: zeros, and a hole exactly there.
    let before = blocks(&img);
    let op = BlkOp::WriteZeroes { sector: 3 * mib / 512, sectors: (wz / 512) as u32, flags: blk::RANGE_F_UNMAP };
    q.expect(op, &[], status::OK, 1, &["write_zeroes"]);
    let after = blocks(&img);
    assert!(before >= after + wz / 512 - 8, "st_blocks {before} -> {after} after write-zeroes with unmap");
    assert_eq!(seek(&img, 3 * mib, libc::SEEK_HOLE), 3 * mib);
    assert_eq!(seek(&img, 3 * mib, libc::SEEK_DATA), 3 * mib + wz);
    assert_zero(&img, 3 * mib, wz as usize);
    assert_bg(&img, 3 * mib - 4096, 4096);
    assert_bg(&img, 3 * mib + wz, 4096);
    assert!(q.read(3 * mib / 512, wz as u32).iter().all(|&b| b == 0));

    // Range flags: DISCARD takes none (the spec: UNSUPP with unmap),
    // WRITE_ZEROES only unmap. Ranges must fit the disk.
    let bad = [
        (
            BlkOp::Discard { sector: 0, sectors: 8, flags: blk::RANGE_F_UNMAP },
            status::UNSUPP,
            &["discards", "unsupp"][..],
        ),
        (BlkOp::WriteZeroes { sector: 0, sectors: 8, flags: 2 }, status::UNSUPP, &["write_zeroes", "unsupp"][..]),
        (
            BlkOp::Discard { sector: cap - 4, sectors: 8, flags: 0 },
            status::IOERR,
            &["discards", "ioerr", "out_of_range"][..],
        ),
        (
            BlkOp::WriteZeroes { sector: cap, sectors: 1, flags: 0 },
            status::IOERR,
            &["write_zeroes", "ioerr", "out_of_range"][..],
        ),
    ];
    for (op, st, keys) in bad {
        q.expect(op, &[], st, 1, keys);
        q.still_serves();
    }
    // Two ranges (max_discard_seg is 1): UNSUPP, and neither is discarded.
    let mut two = blk::header(types::DISCARD, 0).to_vec();
    two.extend_from_slice(&blk::range(0, 8, 0));
    two.extend_from_slice(&blk::range(16, 8, 0));
    q.raw(&[RawSeg::Readable(&two), RawSeg::Writable(1)], status::UNSUPP, 1, &["discards", "unsupp"]);
    q.still_serves();
    assert_bg(&img, 0, 24 * 512);
    assert_bg(&img, size - 4096, 4096);
    assert_eq!(fs::metadata(&img).unwrap().len(), size);

    drop(q.bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
    check_totals(&s);
}

/// Without discard=on vhostd advertises write_zeroes_may_unmap = 0 (and
/// no DISCARD), yet a WRITE_ZEROES with the unmap flag punches a hole in
/// the image: crates/block-backends/src/file.rs maps every
/// `WriteZeroes { unmap: true }` to FALLOC_FL_PUNCH_HOLE whatever the
/// backend's `discard`. Ignored until that is fixed (see the report).
#[test]
fn write_zeroes_with_unmap_keeps_space_without_discard() {
    let dir = Scratch::new();
    let size = 4u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, false);
    let cfg = dev.blk_config().unwrap();
    assert_eq!(dev.features() & f::BLK_DISCARD, 0);
    assert_eq!(cfg.write_zeroes_may_unmap, 0, "the device says it will not unmap");
    let mut q = Q::new(dev.blk_queue(0, 4, 64 << 10).unwrap());
    let mib = 1u64 << 20;
    let before = blocks(&img);
    let op = BlkOp::WriteZeroes { sector: mib / 512, sectors: 128, flags: blk::RANGE_F_UNMAP };
    q.expect(op, &[], status::OK, 1, &["write_zeroes"]);
    assert_zero(&img, mib, 64 << 10);
    assert!(q.read(mib / 512, 64 << 10).iter().all(|&b| b == 0));
    // Zeros, but the space stays allocated: no hole, no blocks freed.
    assert_eq!(seek(&img, 0, libc::SEEK_HOLE), size, "a hole appeared in the image");
    assert!(blocks(&img) >= before, "st_blocks {before} -> {}", blocks(&img));
    drop(q.bq);
    dev.disconnect().unwrap();
    expect_counters(&d.stop(), 0, &q.want);
}

#[test]
fn default_serial_is_the_image_name() {
    let dir = Scratch::new();
    let img = dir.image(1 << 20);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, true);
    let mut bq = dev.blk_queue(0, 2, 4096).unwrap();
    let r = bq.request(BlkOp::GetId, &[], T).unwrap();
    assert_eq!((r.status, r.used_len, r.data), (status::OK, 21, id_of("disk.img")));
    drop(bq);
    dev.disconnect().unwrap();
    assert_eq!(d.stop().queue(0, "get_ids"), 1);
}

// ---------------------------------------------------------------------------
// 4. Bad requests: each answered and counted exactly; the queue keeps working.
// ---------------------------------------------------------------------------

fn bad_requests(packed: bool) {
    let dir = Scratch::new();
    let size = 4u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, packed);
    let cap = dev.blk_config().unwrap().capacity;
    assert_eq!(cap, size / 512);
    // A ring long enough for chains of 131 descriptors.
    let mut q = Q::new(dev.blk_queue_sized(0, 4, 256 << 10, Some(256)).unwrap());
    q.still_serves();
    let (out_of_range_read, out_of_range_write) =
        (&["reads", "ioerr", "out_of_range"][..], &["writes", "ioerr", "out_of_range"][..]);

    // Past the capacity: at the end, straddling it, and where sector x 512
    // or offset + length overflow 64 bits.
    for (sector, len) in
        [(cap, 512), (cap - 1, 1024), (u64::MAX / 512 + 1, 512), (u64::MAX, 512), (u64::MAX / 512, 1024)]
    {
        q.expect(BlkOp::Read { sector, len }, &[], status::IOERR, 1, out_of_range_read);
        q.still_serves();
    }
    let junk = vec![0xeeu8; 4096];
    for (sector, len) in [(cap, 512), (cap - 2, 4096), (u64::MAX / 512 + 1, 512)] {
        q.expect(BlkOp::Write { sector, len }, &junk, status::IOERR, 1, out_of_range_write);
        q.still_serves();
    }
    assert_eq!(fs::metadata(&img).unwrap().len(), size, "a write past the end grew the image");
    assert_bg(&img, size - 8192, 8192);

    // Data not in whole sectors.
    q.expect(BlkOp::Read { sector: 0, len: 1000 }, &[], status::IOERR, 1, &["reads", "ioerr", "misaligned"]);
    q.still_serves();
    q.expect(BlkOp::Write { sector: 16, len: 100 }, &junk, status::IOERR, 1, &["writes", "ioerr", "misaligned"]);
    q.still_serves();
    q.expect(BlkOp::Write { sector: 16, len: 513 }, &junk, status::IOERR, 1, &["writes", "ioerr", "misaligned"]);
    q.still_serves();
    assert_bg(&img, 0, 64 << 10);

    // Unknown types, and DISCARD on a disk without discard=on: UNSUPP.
    for req_type in [2, 3, 5, 7, 10, 14, 0x7777, u32::MAX] {
        let op = BlkOp::Other { req_type, sector: 0, len: 512, writable: true };
        let r = q.expect(op, &[], status::UNSUPP, 1, &["unsupp"]);
        assert!(r.data.iter().all(|&b| b == 0), "type {req_type}: data written");
        q.still_serves();
    }
    let before = blocks(&img);
    q.expect(BlkOp::Discard { sector: 0, sectors: 8, flags: 0 }, &[], status::UNSUPP, 1, &["discards", "unsupp"]);
    q.still_serves();
    assert_eq!(blocks(&img), before);
    assert_bg(&img, 0, 4096);

    // No writable byte for a status: returned untouched with length 0,
    // and a write without one is not performed.
    let hdr_in = blk::header(types::IN, 8);
    let r = q.raw(&[RawSeg::Readable(&hdr_in)], STATUS_NOT_WRITTEN, 0, &["no_status"]);
    assert!(r.data.is_empty());
    q.still_serves();
    let hdr_out = blk::header(types::OUT, 32);
    q.raw(&[RawSeg::Readable(&hdr_out), RawSeg::Readable(&junk[..512])], STATUS_NOT_WRITTEN, 0, &["no_status"]);
    q.still_serves();
    assert_bg(&img, 32 * 512, 512);

    // A header shorter than 16 bytes (or none at all): IOERR, data untouched.
    let r = q.raw(
        &[RawSeg::Readable(&hdr_in[..8]), RawSeg::Writable(512), RawSeg::Writable(1)],
        status::IOERR,
        1,
        &["ioerr"],
    );
    assert!(r.data[..512].iter().all(|&b| b == STATUS_NOT_WRITTEN), "data written for a short header");
    q.still_serves();
    q.raw(&[RawSeg::Readable(&hdr_in[..15]), RawSeg::Writable(1)], status::IOERR, 1, &["ioerr"]);
    q.still_serves();
    q.raw(&[RawSeg::Writable(1)], status::IOERR, 1, &["ioerr"]);
    q.still_serves();

    // Any framing is fine: a header over two buffers, the status byte at the
    // end of the data buffer, header and data in one buffer.
    let r = q.raw(
        &[RawSeg::Readable(&hdr_in[..8]), RawSeg::Readable(&hdr_in[8..]), RawSeg::Writable(512), RawSeg::Writable(1)],
        status::OK,
        513,
        &["reads"],
    );
    q.add("bytes_read", 512);
    assert_eq!(check_pattern(&r.data[..512], 8 * 512, BG), None);
    let r = q.raw(&[RawSeg::Readable(&hdr_in), RawSeg::Writable(4097)], status::OK, 4097, &["reads"]);
    q.add("bytes_read", 4096);
    assert_eq!(check_pattern(&r.data[..4096], 8 * 512, BG), None);
    let mut one = blk::header(types::OUT, 40).to_vec();
    let mut payload = vec![0u8; 1024];
    fill_pattern(&mut payload, 40 * 512, 77);
    one.extend_from_slice(&payload);
    q.raw(&[RawSeg::Readable(&one), RawSeg::Writable(1)], status::OK, 1, &["writes"]);
    q.add("bytes_written", 1024);
    assert_eq!(read_file(&img, 40 * 512, 1024), payload);
    assert_bg(&img, 39 * 512, 512);
    assert_bg(&img, 42 * 512, 512);

    // seg_max: 128 data buffers are fine, 129 are refused; size_max: a
    // data buffer above 128 KiB is refused.
    let hdr0 = blk::header(types::IN, 64);
    let mut segs = vec![RawSeg::Readable(&hdr0)];
    segs.extend(std::iter::repeat_n(RawSeg::Writable(512), SEG_MAX as usize));
    segs.push(RawSeg::Writable(1));
    let r = q.raw(&segs, status::OK, SEG_MAX * 512 + 1, &["reads"]);
    q.add("bytes_read", SEG_MAX as u64 * 512);
    assert_eq!(check_pattern(&r.data[..SEG_MAX as usize * 512], 64 * 512, BG), None);
    segs.insert(1, RawSeg::Writable(512));
    let r = q.raw(&segs, status::IOERR, 1, &["reads", "ioerr"]);
    assert!(r.data[..r.data.len() - 1].iter().all(|&b| b == STATUS_NOT_WRITTEN));
    q.still_serves();
    q.raw(
        &[RawSeg::Readable(&hdr0), RawSeg::Writable(SIZE_MAX + 512), RawSeg::Writable(1)],
        status::IOERR,
        1,
        &["reads", "ioerr"],
    );
    q.still_serves();

    // Bad requests among good ones in flight together: each gets its own
    // answer (completions carry their tag).
    let ops = [
        (BlkOp::Read { sector: 8, len: 4096 }, status::OK),
        (BlkOp::Read { sector: cap, len: 512 }, status::IOERR),
        (BlkOp::Other { req_type: 0x55, sector: 0, len: 0, writable: false }, status::UNSUPP),
        (BlkOp::Read { sector: 16, len: 4096 }, status::OK),
    ];
    for (i, (op, _)) in ops.iter().enumerate() {
        assert!(q.bq.submit(*op, i as u64, |b| b.fill(0)).unwrap());
    }
    q.bq.flush().unwrap();
    let mut got = BTreeMap::new();
    assert!(wait_until(T, || {
        q.bq.poll(|c, data| {
            got.insert(c.user, (c.status, c.used_len, data.to_vec()));
        })
        .unwrap();
        if got.len() < ops.len() {
            q.bq.wait(Duration::from_millis(20)).unwrap();
        }
        got.len() == ops.len()
    }));
    for (i, (op, st)) in ops.iter().enumerate() {
        let (s, used, data) = &got[&(i as u64)];
        assert_eq!(s, st, "{op:?}");
        if let BlkOp::Read { sector, len: 4096 } = op {
            assert_eq!(*used, 4097);
            assert_eq!(check_pattern(data, sector * 512, BG), None);
        } else {
            assert_eq!(*used, 1, "{op:?}");
        }
    }
    q.count(&["reads", "reads", "reads", "ioerr", "out_of_range", "unsupp"]);
    q.add("bytes_read", 8192);

    // And a clean verify after all that.
    let w = Workload { seed: 5, size: Some(256 << 10), ..Workload::new(Mode::Verify, 4096) };
    q.verify(cap, &w);

    drop(q.bq);
    dev.disconnect().unwrap();
    let data = fs::read(&img).unwrap();
    assert_eq!(data.len() as u64, size);
    assert_eq!(check_pattern(&data[..256 << 10], 0, 5), None);
    assert_eq!(check_pattern(&data[256 << 10..], 256 << 10, BG), None, "a bad request changed the image");
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
    check_totals(&s);
}

/// A chain the ring itself rejects (here: its header buffer lies outside
/// guest memory) must come back with used length 0 by itself. vhostd adds
/// its used entry but neither publishes it nor signals the driver while no
/// other request completes, so on an otherwise idle queue the driver waits
/// for ever; the next good request's completion publishes it.
fn rejected_chain_is_returned(packed: bool) {
    let dir = Scratch::new();
    let img = dir.image(1 << 20);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, packed);
    let status_gpa = dev.memory().alloc(64, 64).unwrap();
    let outside = dev.memory().gpa_base() + dev.memory().size() + (1 << 20);
    let mut bq = dev.blk_queue(0, 4, 4096).unwrap();
    let (s0, _) = bq.run_one(BlkOp::Read { sector: 0, len: 4096 }).unwrap();
    assert_eq!(s0, status::OK);
    let hdr = [vhostd_user::Buf { addr: outside, len: 16 }];
    let st = [vhostd_user::Buf { addr: status_gpa, len: 1 }];
    bq.queue.ring.add(&hdr, &st, 999).unwrap();
    bq.queue.publish_and_kick().unwrap();
    let mut used = None;
    let back = wait_until(Duration::from_secs(2), || {
        used = bq.queue.ring.pop_used().unwrap();
        used.is_some()
    });
    assert!(back, "a chain the ring rejected was not returned within 2 s");
    let used = used.unwrap();
    assert_eq!((used.token, used.len), (999, 0));
    let (s1, _) = bq.run_one(BlkOp::Read { sector: 8, len: 4096 }).unwrap();
    assert_eq!(s1, status::OK);
    drop(bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    let want = BTreeMap::from([("reads", 2), ("bytes_read", 8192), ("bad_chains", 1)]);
    expect_counters(&s, 0, &want);
    check_totals(&s);
}

#[test]
fn rejected_chain_is_returned_split_ring() {
    rejected_chain_is_returned(false);
}

#[test]
fn rejected_chain_is_returned_packed_ring() {
    rejected_chain_is_returned(true);
}

#[test]
fn bad_requests_split_ring() {
    bad_requests(false);
}

#[test]
fn bad_requests_packed_ring() {
    bad_requests(true);
}

#[test]
fn segments_above_size_max_are_served_when_size_max_is_not_negotiated() {
    // QEMU's vhost-user-blk does not pass VIRTIO_BLK_F_SIZE_MAX on to the
    // guest, whose Linux driver then merges contiguous pages into segments
    // of any size. size_max binds only when negotiated (virtio 1.2, 5.2.3):
    // a 256 KiB segment must be read, not refused (QEMU 11.1's guest got
    // an I/O error on a 1 MiB buffered write here).
    let dir = Scratch::new();
    let img = dir.image(4 << 20);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect_with(&d, false, |o| o.features &= !f::BLK_SIZE_MAX);
    assert_eq!(dev.features() & f::BLK_SIZE_MAX, 0);
    let mut q = Q::new(dev.blk_queue(0, 4, 512 << 10).unwrap());
    let hdr = blk::header(types::IN, 8);
    let big = 2 * SIZE_MAX;
    let r =
        q.raw(&[RawSeg::Readable(&hdr), RawSeg::Writable(big), RawSeg::Writable(1)], status::OK, big + 1, &["reads"]);
    q.add("bytes_read", big as u64);
    assert_eq!(check_pattern(&r.data[..big as usize], 8 * 512, BG), None);
    q.still_serves();
}

#[test]
fn readonly_disk_refuses_writes() {
    let dir = Scratch::new();
    let size = 2u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ",readonly=on"), &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.blk_queue(0, 4, 64 << 10).unwrap());
    q.still_serves();
    let junk = vec![0xeeu8; 4096];
    q.expect(BlkOp::Write { sector: 0, len: 4096 }, &junk, status::IOERR, 1, &["writes", "ioerr", "read_only"]);
    q.still_serves();
    // Out of range too, but read-only is what it is first.
    q.expect(BlkOp::Write { sector: size / 512, len: 512 }, &junk, status::IOERR, 1, &["writes", "ioerr", "read_only"]);
    q.still_serves();
    // Neither is offered on a read-only disk: UNSUPP.
    q.expect(BlkOp::Discard { sector: 0, sectors: 8, flags: 0 }, &[], status::UNSUPP, 1, &["discards", "unsupp"]);
    q.still_serves();
    let op = BlkOp::WriteZeroes { sector: 0, sectors: 8, flags: 0 };
    q.expect(op, &[], status::UNSUPP, 1, &["write_zeroes", "unsupp"]);
    q.still_serves();
    // FLUSH and GET_ID are fine on a read-only disk.
    q.expect(BlkOp::Flush, &[], status::OK, 1, &["flushes"]);
    q.expect(BlkOp::GetId, &[], status::OK, 21, &["get_ids"]);
    drop(q.bq);
    dev.disconnect().unwrap();
    assert_bg(&img, 0, size as usize);
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
    check_totals(&s);
}

/// Reads 0..n of 4 KiB each (read `i` at byte `i * 4096`, its `user`
/// `i`), their buffers filled with `poison`, published with one avail.idx
/// store.
fn publish_reads(bq: &mut BlkQueue, n: u64, poison: u8) {
    for i in 0..n {
        assert!(bq.submit(BlkOp::Read { sector: i * 8, len: 4096 }, i, |b| b.fill(poison)).unwrap());
    }
    bq.flush().unwrap();
}

/// Polls until reads 0..n (the completions' `user`) have each completed
/// once, OK, with 4 KiB that `data_ok` accepts.
fn read_all_once(bq: &mut BlkQueue, n: u64, data_ok: impl Fn(u64, &[u8]) -> bool) {
    let mut got = vec![false; n as usize];
    let mut done = 0;
    assert!(wait_until(T, || {
        done += bq
            .poll(|c, data| {
                assert_eq!((c.status, c.used_len), (status::OK, 4097), "request {}", c.user);
                assert!(data_ok(c.user, &data.to_vec()), "request {}: not the data expected", c.user);
                assert!(!std::mem::replace(&mut got[c.user as usize], true), "request {} twice", c.user);
            })
            .unwrap();
        if done < n as usize {
            bq.wait(Duration::from_millis(20)).unwrap();
        }
        done == n as usize
    }));
}

/// At most 256 requests in flight per queue, and that many taken: 300
/// reads, published at once, of a disk that hangs (tests/hanging_fs.py).
/// vhostd takes them 16 a pass (`MAX_POP`) until its 256 slots are full,
/// which the inflight memory shows (256 entries marked); the other 44 wait
/// in the ring. Once the disk answers, all 300 complete, each once, with
/// the disk's zeros over the poisoned buffers.
#[test]
fn at_most_256_requests_in_flight_per_queue() {
    if !needs_root("mounting a FUSE file system (tests/hanging_fs.py)") {
        return;
    }
    const RING: u16 = 1024;
    let dir = Scratch::new();
    let disk = HangingDisk::mount(&dir.0, 2 << 20);
    let d = start_blk(&file_backend(&disk.disk(), ""), &[]);
    let held = disk.hold();
    let mut dev = connect_with(&d, false, |o| o.protocol_features |= VhostUserProtocolFeatures::INFLIGHT_SHMFD);
    let size = dev.get_inflight_fd(1, RING).unwrap();
    let n = 300u64;
    let mut bq = dev.blk_queue_sized(0, n as u16, 4096, Some(RING)).unwrap();
    publish_reads(&mut bq, n, 0xa5);
    // The inflight region: a 16-byte header, then 16 bytes per ring entry
    // whose first byte is 1 while the request is in flight.
    let marked = || {
        let mut buf = vec![0u8; size as usize];
        dev.inflight_file().unwrap().read_exact_at(&mut buf, 0).unwrap();
        (0..RING as usize).filter(|&e| buf[16 + 16 * e] == 1).count()
    };
    assert!(wait_until(T, || marked() == 256), "{} requests taken, not 256; vhostd log:\n{}", marked(), d.log());
    assert_eq!(bq.poll(|c, _| panic!("request {} answered while the disk hangs", c.user)).unwrap(), 0);
    held.release();
    read_all_once(&mut bq, n, |_, data| data.iter().all(|&b| b == 0));
    // (In any order: the disk's threads answer as they are scheduled.)
    drop(bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    let want = BTreeMap::from([("reads", n), ("bytes_read", n * 4096)]);
    expect_counters(&s, 0, &want);
    assert_eq!(s.queue(0, "max_in_flight"), 256);
}

/// 300 reads published at once, more than the 256 request slots: every
/// one is answered once, with the file's data (without root, what
/// `at_most_256_requests_in_flight_per_queue` checks under a hanging disk).
#[test]
fn more_requests_than_slots_are_all_served() {
    let dir = Scratch::new();
    let img = dir.image(2 << 20);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, false);
    let n = 300u64;
    let mut bq = dev.blk_queue(0, n as u16, 4096).unwrap();
    publish_reads(&mut bq, n, 0);
    read_all_once(&mut bq, n, |user, data| check_pattern(data, user * 4096, BG).is_none());
    assert_eq!(bq.reordered(), 0);
    drop(bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    let want = BTreeMap::from([("reads", n), ("bytes_read", n * 4096)]);
    expect_counters(&s, 0, &want);
    assert!(s.queue(0, "max_in_flight") <= 256, "{} in flight", s.queue(0, "max_in_flight"));
}

/// GET_VRING_BASE with requests in flight: the device finishes every
/// request it took before answering, so the used ring then holds all of
/// them, complete, and their data is in the file; a later frontend finds
/// a working disk. Three frontends in a row, each writing its own 2 MiB.
fn vring_base_after_requests_finish(packed: bool) {
    const ROUNDS: u64 = 3;
    // At most MAX_POP (16): one pass takes them all.
    const N: u64 = 16;
    const BS: u64 = 128 << 10;
    let region = |r: u64| (2 << 20) + r * N * BS;
    let dir = Scratch::new();
    let size = region(ROUNDS) + (1 << 20);
    let img = dir.image(size);
    // O_DIRECT: the writes take the disk's time, so some are usually still
    // running when GET_VRING_BASE comes.
    let d = start_blk(&file_backend(&img, ",direct=on"), &[]);
    let mut unseen = Vec::new();
    for r in 0..ROUNDS {
        let mut dev = connect(&d, packed);
        let mut bq = dev.blk_queue(0, N as u16, BS as u32).unwrap();
        let ring = bq.queue.ring.layout().size as u64;
        for i in 0..N {
            let off = region(r) + i * BS;
            let op = BlkOp::Write { sector: off / 512, len: BS as u32 };
            assert!(bq.submit(op, i, |b| fill_pattern_shared(b, off, 50 + r)).unwrap());
        }
        bq.flush().unwrap();
        // Once one has completed the device has taken all 16 (published
        // with one avail.idx store, popped in one pass). They may finish in
        // any order (no IN_ORDER), each once.
        let mut done = 0u64;
        let mut seen = [false; N as usize];
        let mut check = |c: &blk::BlkCompletion, done: &mut u64| {
            assert_eq!((c.status, c.used_len), (status::OK, 1), "request {}", c.user);
            assert!(c.user < N, "request {}: not one of ours", c.user);
            assert!(!std::mem::replace(&mut seen[c.user as usize], true), "request {} completed twice", c.user);
            *done += 1;
        };
        assert!(wait_until(T, || {
            bq.poll(|c, _| check(c, &mut done)).unwrap();
            if done == 0 {
                bq.wait(Duration::from_millis(20)).unwrap();
            }
            done > 0
        }));
        unseen.push(N - done);
        let base = dev.get_vring_base(0).unwrap();
        // Split: the next avail index. Packed: avail and used positions
        // (3 descriptors a chain) equal, same wrap: all taken, all used.
        if packed {
            assert!(ring >= 3 * N, "ring of {ring}");
            let want = (3 * N as u32) | (1 << 15);
            assert_eq!(base, want | want << 16, "packed base {base:#x}");
        } else {
            assert_eq!(base as u64, N, "split base");
        }
        // Everything taken is complete now: nothing may finish later.
        bq.poll(|c, _| check(c, &mut done)).unwrap();
        assert_eq!(done, N, "completions in the used ring when GET_VRING_BASE answered");
        let data = read_file(&img, region(r), (N * BS) as usize);
        assert_eq!(check_pattern(&data, region(r), 50 + r), None);
        drop(bq);
        drop(dev);
    }

    let mut dev = connect(&d, packed);
    let mut q = Q::new(dev.blk_queue(0, 8, 4096).unwrap());
    let w = Workload { seed: 49, size: Some(1 << 20), ..Workload::new(Mode::Verify, 4096) };
    q.verify(size / 512, &w);
    q.add("writes", ROUNDS * N);
    q.add("bytes_written", ROUNDS * N * BS);
    drop(q.bq);
    dev.disconnect().unwrap();
    let data = fs::read(&img).unwrap();
    assert_eq!(check_pattern(&data[..1 << 20], 0, 49), None);
    assert_eq!(check_pattern(&data[1 << 20..2 << 20], 1 << 20, BG), None);
    assert_eq!(check_pattern(&data[region(ROUNDS) as usize..], region(ROUNDS), BG), None);
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
    eprintln!(
        "{} ring: requests not yet seen complete when GET_VRING_BASE was sent: {unseen:?} of {N}",
        if packed { "packed" } else { "split" }
    );
}

#[test]
fn get_vring_base_waits_for_requests_in_flight_split() {
    vring_base_after_requests_finish(false);
}

#[test]
fn get_vring_base_waits_for_requests_in_flight_packed() {
    vring_base_after_requests_finish(true);
}

#[test]
fn backend_errors_when_the_image_shrinks_underneath() {
    let dir = Scratch::new();
    let size = 1u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.blk_queue(0, 4, 8192).unwrap());
    q.still_serves();
    // The capacity was fixed at start; the file loses its last 64 KiB.
    File::options().write(true).open(&img).unwrap().set_len(size - (64 << 10)).unwrap();
    let end = (size - (64 << 10)) / 512;
    let failed = &["reads", "ioerr", "backend_errors"][..];
    // Wholly past the new end of file: the read returns 0 bytes.
    q.expect(BlkOp::Read { sector: end + 8, len: 4096 }, &[], status::IOERR, 1, failed);
    q.still_serves();
    // Across it: a short read, the rest resubmitted, then 0 bytes.
    q.expect(BlkOp::Read { sector: end - 4, len: 8192 }, &[], status::IOERR, 1, failed);
    q.still_serves();
    drop(q.bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
    check_totals(&s);
}

/// On tmpfs, which has no FALLOC_FL_ZERO_RANGE, write-zeroes without unmap
/// falls back to punching the range and allocating it again: zeros, and
/// the space stays allocated; with unmap the pages go.
#[test]
fn write_zeroes_on_tmpfs() {
    let shm = Path::new("/dev/shm");
    if !shm_is_tmpfs() {
        return;
    }
    let dir = Scratch::under(shm);
    let size = 1u64 << 20;
    let img = dir.image(size);
    // discard=on: write-zeroes may unmap only then.
    let d = start_blk(&file_backend(&img, ",discard=on"), &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.blk_queue(0, 4, 64 << 10).unwrap());
    let wz = 64u64 << 10;
    // Twice without unmap: the first finds ZERO_RANGE unsupported, the
    // second goes to the fallback directly.
    for off in [256u64 << 10, 512 << 10] {
        let before = blocks(&img);
        let op = BlkOp::WriteZeroes { sector: off / 512, sectors: (wz / 512) as u32, flags: 0 };
        q.expect(op, &[], status::OK, 1, &["write_zeroes"]);
        assert_eq!(blocks(&img), before, "write-zeroes without unmap changed the allocation");
        assert_zero(&img, off, wz as usize);
        assert_bg(&img, off - 4096, 4096);
        assert_bg(&img, off + wz, 4096);
        assert!(q.read(off / 512, wz as u32).iter().all(|&b| b == 0));
    }
    let off = 768u64 << 10;
    let before = blocks(&img);
    let op = BlkOp::WriteZeroes { sector: off / 512, sectors: (wz / 512) as u32, flags: blk::RANGE_F_UNMAP };
    q.expect(op, &[], status::OK, 1, &["write_zeroes"]);
    assert_eq!(blocks(&img), before - wz / 512, "write-zeroes with unmap on tmpfs");
    assert_zero(&img, off, wz as usize);
    assert_bg(&img, off + wz, size as usize - (off + wz) as usize);
    drop(q.bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
}

/// On tmpfs the file backend reads and writes in the worker thread
/// (preadv/pwritev, allowed by the default seccomp filter): the data goes
/// where it belongs and comes back, and the worker, with no completion
/// event for them, answers every request.
#[test]
fn reads_and_writes_on_tmpfs() {
    if !shm_is_tmpfs() {
        return;
    }
    let dir = Scratch::under(Path::new("/dev/shm"));
    let size = 1u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ""), &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.blk_queue(0, 4, 64 << 10).unwrap());
    for (k, (sector, len)) in [(24u64, 4096usize), (100, 64 << 10), (size / 512 - 8, 4096)].into_iter().enumerate() {
        let mut a = vec![0u8; len];
        fill_pattern(&mut a, sector * 512, 40 + k as u64);
        q.write(sector, &a);
        assert_eq!(image::read(&img, sector * 512, len), a, "in the image");
        assert_eq!(q.read(sector, len as u32), a, "read back");
    }
    assert_bg(&img, 0, 24 * 512);
    assert_bg(&img, 32 * 512, 68 * 512);
    q.still_serves();
    drop(q.bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
    check_totals(&s);
}

// ---------------------------------------------------------------------------
// 5. The null backend.
// ---------------------------------------------------------------------------

#[test]
fn null_backend_succeeds_and_leaves_read_buffers_untouched() {
    let d = start_blk("null,size=64M", &[]);
    let mut dev = connect(&d, false);
    let cap = 64u64 << 20 >> 9;
    assert_eq!(dev.offered_features(), RING_OFFERED | BLK_BASE | f::BLK_DISCARD | f::BLK_WRITE_ZEROES);
    assert_eq!(dev.blk_config().unwrap(), expected_config(cap, 1, true));
    let mut q = Q::new(dev.blk_queue(0, 4, 4096).unwrap());

    let r = q.expect(BlkOp::GetId, &[], status::OK, 21, &["get_ids"]);
    assert_eq!(r.data, id_of("vhostd-null"));
    q.write(0, &[0x11; 4096]);
    // A read succeeds with the full used length and leaves the buffer as
    // it was (null-co without read-zeroes).
    assert!(q.bq.submit(BlkOp::Read { sector: 0, len: 4096 }, 7, |b| b.fill(0xa5)).unwrap());
    q.bq.flush().unwrap();
    let mut got = None;
    assert!(wait_until(T, || {
        q.bq.poll(|c, data| got = Some((c.user, c.status, c.used_len, data.to_vec()))).unwrap();
        if got.is_none() {
            q.bq.wait(Duration::from_millis(20)).unwrap();
        }
        got.is_some()
    }));
    let (user, st, used, data) = got.unwrap();
    assert_eq!((user, st, used), (7, status::OK, 4097));
    assert!(data.iter().all(|&b| b == 0xa5), "the null backend wrote into a read buffer");
    q.count(&["reads"]);
    q.add("bytes_read", 4096);
    q.expect(BlkOp::Flush, &[], status::OK, 1, &["flushes"]);
    q.expect(BlkOp::Discard { sector: 8, sectors: 8, flags: 0 }, &[], status::OK, 1, &["discards"]);
    let op = BlkOp::WriteZeroes { sector: 8, sectors: 8, flags: blk::RANGE_F_UNMAP };
    q.expect(op, &[], status::OK, 1, &["write_zeroes"]);
    // The device's checks still apply.
    q.expect(BlkOp::Read { sector: cap, len: 512 }, &[], status::IOERR, 1, &["reads", "ioerr", "out_of_range"]);
    q.expect(BlkOp::Write { sector: 0, len: 100 }, &[0; 100], status::IOERR, 1, &["writes", "ioerr", "misaligned"]);

    // Verify, one request at a time: everything succeeds, but verify
    // poisons read buffers and the null backend leaves them so: the first
    // block's first byte already mismatches.
    let (bs, n, seed) = (4096u32, 64u64, 9);
    let w = Workload { seed, count: Some(n), iodepth: 1, ..Workload::new(Mode::Verify, bs) };
    let r = workload::run(std::slice::from_mut(&mut q.bq), cap, &w, None).unwrap();
    assert_eq!((r.errors, r.verified_blocks, r.flush), (0, n, Some(status::OK)), "{}", r.summary());
    assert_eq!(r.mismatch, Some(0), "{}", r.summary());
    assert!(!r.passed());
    q.add("reads", n);
    q.add("writes", n);
    q.add("bytes_read", n * bs as u64);
    q.add("bytes_written", n * bs as u64);
    q.add("flushes", 1);

    drop(q.bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
    check_totals(&s);
}

// ---------------------------------------------------------------------------
// 6. Reconnect after a frontend vanished with requests in flight.
// ---------------------------------------------------------------------------

#[test]
fn reconnect_after_a_frontend_drops_requests_in_flight() {
    let dir = Scratch::new();
    let size = 16u64 << 20;
    let img = dir.image(size);
    let d = start_blk(&file_backend(&img, ""), &[]);
    const ROUNDS: u64 = 4;
    const N: u64 = 32;
    const BS: u64 = 64 << 10;
    let region = |r: u64| (4 << 20) + r * N * BS;
    for r in 0..ROUNDS {
        let mut dev = connect(&d, r % 2 == 1);
        let mut bq = dev.blk_queue(0, N as u16, BS as u32).unwrap();
        for i in 0..N {
            let off = region(r) + i * BS;
            let op = BlkOp::Write { sector: off / 512, len: BS as u32 };
            assert!(bq.submit(op, i, |b| fill_pattern_shared(b, off, 30 + r)).unwrap());
        }
        bq.flush().unwrap();
        if r >= 2 {
            // Let the device get going before the frontend vanishes.
            let mut done = 0;
            assert!(wait_until(T, || {
                done += bq.poll(|c, _| assert_eq!(c.status, status::OK)).unwrap();
                done > 0
            }));
        }
        // No GET_VRING_BASE: the socket just closes.
        drop(bq);
        drop(dev);
    }

    // A new frontend gets a working disk.
    let mut dev = connect(&d, false);
    let cap = dev.blk_config().unwrap().capacity;
    let mut qs = vec![dev.blk_queue(0, 16, 4096).unwrap()];
    let w = Workload { seed: 40, size: Some(4 << 20), ..Workload::new(Mode::Verify, 4096) };
    let rep = workload::run(&mut qs, cap, &w, None).unwrap();
    assert!(rep.passed(), "{}: {:?} {:?}", rep.summary(), rep.first_error, rep.mismatch);
    assert_eq!(rep.verified_blocks, 1024);
    drop(qs);
    dev.disconnect().unwrap();

    // The device pops chains in ring order and finishes every one it
    // popped before giving the ring up: each round left a prefix of its
    // writes, whole, and nothing after it.
    let data = fs::read(&img).unwrap();
    assert_eq!(check_pattern(&data[..4 << 20], 0, 40), None);
    let mut landed = 0;
    for r in 0..ROUNDS {
        let mut k = 0;
        for i in 0..N {
            let off = region(r) + i * BS;
            let b = &data[off as usize..(off + BS) as usize];
            if check_pattern(b, off, 30 + r).is_none() {
                assert_eq!(k, i, "round {r}: write {i} landed after write {k} did not");
                k += 1;
            } else {
                assert_eq!(check_pattern(b, off, BG), None, "round {r}: write {i} is torn");
            }
        }
        landed += k;
    }
    assert_eq!(check_pattern(&data[region(ROUNDS) as usize..], region(ROUNDS), BG), None);

    let s = d.stop();
    let mut want = BTreeMap::new();
    want.insert("writes", landed + 1024);
    want.insert("reads", 1024);
    want.insert("flushes", 1);
    want.insert("bytes_written", landed * BS + (4 << 20));
    want.insert("bytes_read", 4 << 20);
    expect_counters(&s, 0, &want);
    eprintln!("writes of dropped frontends that landed: {landed} of {}", ROUNDS * N);
}

// ---------------------------------------------------------------------------
// 7. Dataplane modes.
// ---------------------------------------------------------------------------

#[test]
fn verify_in_poll_mode() {
    let s = verify_case(&["--mode", "poll"], 1, false);
    // The worker never sleeps with a ring attached, so it never reads a kick.
    assert_eq!(s.queue(0, "kicks"), 0);
}

#[test]
fn verify_in_adaptive_mode() {
    verify_case(&["--mode", "adaptive", "--poll-idle-us", "200"], 2, true);
}

#[test]
fn adaptive_mode_sleeps_when_idle_and_wakes_on_a_kick() {
    let dir = Scratch::new();
    let img = dir.image(1 << 20);
    let d = start_blk(&file_backend(&img, ""), &["--mode", "adaptive", "--poll-idle-us", "1000"]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.blk_queue(0, 4, 4096).unwrap());
    for _ in 0..3 {
        q.still_serves();
        // Idle for longer than --poll-idle-us: the worker goes to sleep...
        assert!(
            wait_until(T, || thread_state(d.pid(), "vhostd-q0") == Some('S')),
            "the worker kept spinning while idle: {:?}",
            thread_state(d.pid(), "vhostd-q0")
        );
    }
    // ... and a kick wakes it for the next request.
    q.still_serves();
    drop(q.bq);
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_counters(&s, 0, &q.want);
    assert!(s.queue(0, "kicks") >= 3, "kicks {}", s.queue(0, "kicks"));
}

/// QEMU sends SET_VRING_CALL whenever the guest masks or moves a ring's
/// MSI-X vector. A running ring takes the new call eventfd in place: with
/// a read in flight on a disk that hangs, the message is handled at once
/// (stopping the ring would wait for the read, on the thread serving every
/// frontend), and the read, once the disk answers, completes on the ring
/// as it was.
#[test]
fn set_vring_call_reaches_a_running_ring_without_stopping_it() {
    if !needs_root("a FUSE disk that hangs") {
        return;
    }
    let dir = tempdir();
    let disk = HangingDisk::mount(&dir, 1 << 20);
    let d = start_blk(&file_backend(&disk.disk(), ""), &["--mode", "interrupt"]);
    let mut dev = connect(&d, false);
    let mut q = dev.blk_queue(0, 4, 4096).unwrap();
    let held = disk.hold();
    assert!(q.submit(BlkOp::Read { sector: 0, len: 4096 }, 7, |_| {}).unwrap());
    q.flush().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(q.poll(|_, _| {}).unwrap(), 0, "the held read completed");

    // SET_VRING_CALL, then GET_FEATURES: its answer shows the session
    // handled the call first. Both from another thread, so that a session
    // stuck on the held read fails the test instead of hanging it.
    let new = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
    let new2 = new.try_clone().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let t0 = std::time::Instant::now();
    let h = std::thread::spawn(move || {
        dev.frontend().set_vring_call(0, &new2).unwrap();
        let r = dev.frontend().get_features();
        let _ = tx.send(t0.elapsed());
        r.map(|_| dev)
    });
    let answered = rx.recv_timeout(Duration::from_secs(3));
    held.release();
    let dev = h.join().unwrap().expect("GET_FEATURES after SET_VRING_CALL");
    let took = answered.expect("SET_VRING_CALL was not handled while a read was in flight");
    assert!(took < Duration::from_secs(1), "SET_VRING_CALL and GET_FEATURES took {took:?}");

    // The read completes on the same ring, and interrupts the new eventfd.
    let mut done = Vec::new();
    assert!(wait_until(T, || {
        q.poll(|c, _| done.push((c.user, c.status))).unwrap();
        !done.is_empty()
    }));
    assert_eq!(done, vec![(7, status::OK)]);
    assert_eq!(new.read().ok().map(|n| n > 0), Some(true), "the new call eventfd was never signalled");
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.queue(0, "reads"), 1);
}
