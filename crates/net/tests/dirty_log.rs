//! Every store the virtio-net device makes into guest memory is marked in
//! the dirty-page log (what live migration copies again), on split and
//! packed rings.
//!
//! The device side runs over a memfd it maps as guest memory with a
//! `DirtyLog` set; the project's own driver (`virtq-driver`) maps the same
//! memfd and posts the chains. Guest memory is snapshotted after the driver
//! posted and again after the device ran (before the driver reads anything
//! back), so only the device's stores differ. The tests assert:
//!
//! - the property: every 4 KiB page whose bytes changed is marked;
//! - that it is not vacuous: the pages the device is known to write (used
//!   ring header, elements and avail_event, packed used descriptors and the
//!   device event area, RX buffers, control acks) did change and are marked,
//!   each ring area on a page of its own so one missing hook shows;
//! - that the device changed nothing outside what it may write;
//! - that the workload ran: the RX buffers hold the TX frames after the
//!   12-byte header, the control commands took effect;
//! - the converse: with the log cleared (`with_log(None)`) the same workload
//!   marks nothing in the bitmap that was set before.

use std::collections::BTreeSet;
use std::sync::Arc;

use vhostd_backends::Loopback;
use vhostd_net::{features::MRG_RXBUF, process_ctrl, process_rx, process_tx, CtrlState, DirStats, Layout, HDR_LEN};
use virtio_bindings::virtio_net as vn;
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
/// What device-writable memory holds before the device runs; frame bytes
/// and headers are below 0x80, so every byte the device stores differs.
const POISON: u8 = 0xa5;

/// Where each queue's rings live (a window of 8 pages each).
const TX_RING: u64 = GPA;
const RX_RING: u64 = GPA + 0x8000;
const CTRL_RING: u64 = GPA + 0x1_0000;
const TX_BUFS: u64 = GPA + 0x4_0000;
const RX_BUFS: u64 = GPA + 0x10_0000;
const CTRL_BUFS: u64 = GPA + 0x20_0000;

const FEATURES: u64 = VERSION_1 | EVENT_IDX | MRG_RXBUF;

/// TX frame lengths: small, MTU-sized, jumbo, and odd ones.
const FRAME_LENS: [usize; 20] =
    [60, 1514, 64, 3000, 128, 9000, 42, 2048, 500, 4096, 1400, 77, 6000, 256, 1000, 4500, 90, 1500, 3333, 700];

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

    /// All of guest memory, as the driver sees it.
    fn snapshot(&self) -> Vec<u8> {
        let mut v = vec![0u8; MEM as usize];
        assert!(self.drv.read(GPA, &mut v));
        v
    }

    /// The first `len` bytes of a chain's buffers.
    fn read_chain(&self, bufs: &[Buf], mut len: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for b in bufs {
            let n = len.min(b.len as usize);
            let mut part = vec![0u8; n];
            assert!(self.drv.read(b.addr, &mut part));
            out.extend_from_slice(&part);
            len -= n;
        }
        assert_eq!(len, 0, "used length past the chain's buffers");
        out
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

/// Pages of the first `len` bytes of a chain's buffers.
fn chain_pages(bufs: &[Buf], mut len: u64, out: &mut BTreeSet<u64>) {
    for b in bufs {
        let n = len.min(b.len as u64);
        out.extend(pages(b.addr, n));
        len -= n;
    }
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
    fn driver(&self, g: &Guest, ring_features: u64) -> DriverRing {
        let mem = g.drv.clone();
        if self.packed {
            DriverRing::Packed(PackedDriver::new(mem, self.layout, ring_features).unwrap())
        } else {
            let d = SplitDriver::new(mem, self.layout, ring_features).unwrap();
            g.fill(self.layout.used + 4, 8 * QSIZE as u64 + 2, POISON);
            DriverRing::Split(d)
        }
    }

    /// The device side over `mem`.
    fn device(&self, mem: &Arc<GuestMemory>, ring_features: u64) -> Queue {
        let l = self.layout;
        if self.packed {
            let cfg = PackedConfig {
                size: l.size,
                desc: l.desc,
                driver: l.avail,
                device: l.used,
                features: ring_features | RING_PACKED,
                base: PACKED_BASE_INITIAL,
            };
            Queue::Packed(PackedQueue::new(mem.clone(), cfg).unwrap())
        } else {
            let cfg = SplitConfig {
                size: l.size,
                desc: l.desc,
                avail: l.avail,
                used: l.used,
                features: ring_features,
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
    /// elements' and (EVENT_IDX) avail_event's; packed, the first used
    /// descriptor's, the next ones' and the device area's.
    fn written_pages(&self, ring_features: u64) -> BTreeSet<u64> {
        let l = self.layout;
        let mut s = BTreeSet::new();
        if self.packed {
            s.extend(pages(l.desc, 32));
            s.extend(pages(l.used, 4));
        } else {
            s.extend(pages(l.used, 4));
            s.extend(pages(l.used + 4, 8));
            if ring_features & EVENT_IDX != 0 {
                s.extend(pages(l.used + 4 + 8 * QSIZE as u64, 2));
            }
        }
        s
    }
}

/// Notification suppression stores: avail_event or used.flags (split), the
/// device event area (packed).
fn toggle_notifications(q: &mut Queue) {
    q.needs_notify();
    q.enable_notifications();
    q.disable_notifications();
}

fn pop_all(d: &mut DriverRing) -> Vec<Used> {
    let mut v = Vec::new();
    while let Some(u) = d.pop_used().unwrap() {
        v.push(u);
    }
    v
}

/// Bytes of frame `i`: below 0x80, never the poison.
fn frame_bytes(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| ((i * 37 + j * 11 + 1) % 127) as u8).collect()
}

/// A bump allocator of guest buffers.
struct Alloc(u64);

impl Alloc {
    /// `len` bytes, 8-aligned, `gap` bytes after the previous buffer.
    fn take(&mut self, len: u32, gap: u64) -> Buf {
        let addr = (self.0 + gap + 7) & !7;
        self.0 = addr + len as u64;
        Buf { addr, len }
    }
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

fn assert_log_empty(log: &DirtyLog, what: &str) {
    let marked: Vec<u64> = (0..LOG_BYTES as u64 * 8).filter(|&p| log.is_marked(p)).collect();
    assert!(marked.is_empty(), "{what}: pages marked with no log set: {:?}", hex_pages(marked));
}

/// TX then RX through the loopback backend, then notification toggles on
/// both rings, with the memory table `table` makes of the guest's.
fn net_workload(packed: bool, features: u64, table: &dyn Fn(&GuestMemory) -> GuestMemory) -> Outcome {
    let what = format!("{} ring, features {features:#x}", if packed { "packed" } else { "split" });
    let g = Guest::new("vhostd-net-dirty-log");
    let ring_features = features & (VERSION_1 | EVENT_IDX);
    let mergeable = features & MRG_RXBUF != 0;
    let (tx_ring, rx_ring) = (Ring::at(TX_RING, packed), Ring::at(RX_RING, packed));
    let mut tx_drv = tx_ring.driver(&g, ring_features);
    let mut rx_drv = rx_ring.driver(&g, ring_features);

    // TX: header and frame in one buffer, or split across two (some
    // buffers crossing page boundaries).
    let frames: Vec<Vec<u8>> = FRAME_LENS.iter().enumerate().map(|(i, &n)| frame_bytes(i, n)).collect();
    let mut alloc = Alloc(TX_BUFS);
    for (i, f) in frames.iter().enumerate() {
        let mut bytes = vec![0u8; HDR_LEN];
        bytes.extend_from_slice(f);
        let cut = if i % 2 == 1 { bytes.len() / 3 } else { bytes.len() };
        let mut bufs = vec![alloc.take(cut as u32, 100 + 13 * i as u64)];
        if cut < bytes.len() {
            bufs.push(alloc.take((bytes.len() - cut) as u32, 333));
        }
        let mut off = 0;
        for b in &bufs {
            assert!(g.drv.write(b.addr, &bytes[off..off + b.len as usize]));
            off += b.len as usize;
        }
        tx_drv.add(&bufs, &[], i as u64).unwrap();
    }
    tx_drv.publish();

    // RX: mergeable, single buffers of mixed sizes (many smaller than a
    // frame) and some chains of two; simple, chains of two buffers that
    // together hold the largest frame. All poisoned.
    let mut rx_chains: Vec<Vec<Buf>> = Vec::new();
    let mut alloc = Alloc(RX_BUFS);
    let chains = if mergeable { 96 } else { FRAME_LENS.len() + 4 };
    for i in 0..chains {
        let bufs = if mergeable {
            let len = [1536, 256, 64, 2048, 128, 4000, 512, 100, 3000, 700][i % 10];
            if i % 7 == 3 {
                vec![alloc.take(len / 2, 64), alloc.take(len - len / 2, 200)]
            } else {
                vec![alloc.take(len, 40 + 7 * i as u64)]
            }
        } else {
            vec![alloc.take(1000 + 10 * i as u32, 50), alloc.take(9100, 300)]
        };
        for b in &bufs {
            g.fill(b.addr, b.len as u64, POISON);
        }
        assert!(bufs.iter().all(|b| b.addr + b.len as u64 <= CTRL_BUFS), "RX buffers past their area");
        rx_drv.add(&[], &bufs, i as u64).unwrap();
        rx_chains.push(bufs);
    }
    rx_drv.publish();

    // Only the device runs from here to the second snapshot.
    let before = g.snapshot();
    let mem = Arc::new(table(&g.mem));
    let mut tx = tx_ring.device(&mem, ring_features);
    let mut rx = rx_ring.device(&mem, ring_features);
    let layout = Layout::from_features(features);
    let mut backend = Loopback::new(256);
    let mut batch = Batch::new();
    let (mut tx_stats, mut rx_stats) = (DirStats::default(), DirStats::default());
    assert_eq!(process_tx(&mut tx, &mut batch, &mut backend, layout, &mut tx_stats), frames.len(), "{what}");
    for _ in 0..16 {
        if rx_stats.packets + rx_stats.dropped >= frames.len() as u64
            || process_rx(&mut rx, &mut batch, &mut backend, layout, &mut rx_stats, false) == 0
        {
            break;
        }
    }
    toggle_notifications(&mut tx);
    toggle_notifications(&mut rx);
    drop(batch);
    let after = g.snapshot();

    assert_eq!((tx_stats.packets, tx_stats.dropped), (frames.len() as u64, 0), "{what}: TX");
    assert_eq!((rx_stats.packets, rx_stats.dropped), (frames.len() as u64, 0), "{what}: RX");

    // The frames arrived: each RX frame is a header (num_buffers, else
    // zero), then the TX frame's bytes.
    let tx_used = pop_all(&mut tx_drv);
    assert_eq!(tx_used.len(), frames.len(), "{what}: TX used entries");
    assert!(tx_used.iter().all(|u| u.len == 0));
    let rx_used = pop_all(&mut rx_drv);
    let mut rx_written = BTreeSet::new();
    let mut got = Vec::new();
    let mut most_buffers = 0;
    let mut k = 0;
    while k < rx_used.len() {
        let u = rx_used[k];
        let bufs = &rx_chains[u.token as usize];
        let data = g.read_chain(bufs, u.len as usize);
        assert!(data.len() >= HDR_LEN, "{what}: RX entry {k} of {} bytes", data.len());
        assert_eq!(data[..10], [0; 10], "{what}: RX header");
        let nb = u16::from_le_bytes([data[10], data[11]]) as usize;
        assert!(nb >= 1 && (mergeable || nb == 1) && k + nb <= rx_used.len(), "{what}: num_buffers {nb}");
        let mut frame = data[HDR_LEN..].to_vec();
        for (j, u) in rx_used[k..k + nb].iter().enumerate() {
            let bufs = &rx_chains[u.token as usize];
            if j > 0 {
                frame.extend(g.read_chain(bufs, u.len as usize));
            }
            chain_pages(bufs, u.len as u64, &mut rx_written);
        }
        got.push(frame);
        most_buffers = most_buffers.max(nb);
        k += nb;
    }
    assert!(got == frames, "{what}: the RX buffers do not hold the TX frames");
    assert_eq!(most_buffers > 1, mergeable, "{what}: mergeable frames span several chains");

    let mut known = tx_ring.written_pages(ring_features);
    known.extend(rx_ring.written_pages(ring_features));
    known.extend(rx_written.iter().copied());
    let mut allowed = tx_ring.device_pages();
    allowed.extend(rx_ring.device_pages());
    allowed.extend(rx_written);
    Outcome { before, after, known, allowed }
}

fn net_logged(packed: bool, features: u64) {
    let log = new_log();
    let out = net_workload(packed, features, &|m| m.with_log(Some(log.clone())));
    out.check_logged(&log, &format!("{} ring, features {features:#x}", if packed { "packed" } else { "split" }));
}

#[test]
fn split_mergeable_rx_tx_and_notifications_are_logged() {
    net_logged(false, FEATURES);
}

#[test]
fn split_simple_rx_tx_and_notifications_are_logged() {
    net_logged(false, FEATURES & !MRG_RXBUF);
}

#[test]
fn split_used_flags_without_event_idx_are_logged() {
    net_logged(false, FEATURES & !EVENT_IDX);
}

#[test]
fn packed_mergeable_rx_tx_and_notifications_are_logged() {
    net_logged(true, FEATURES);
}

#[test]
fn packed_simple_rx_tx_and_notifications_are_logged() {
    net_logged(true, FEATURES & !MRG_RXBUF);
}

#[test]
fn packed_without_event_idx_is_logged() {
    net_logged(true, FEATURES & !EVENT_IDX);
}

/// The log set on the table and then cleared (`with_log(None)`): the same
/// workload changes the same pages, and its bitmap stays empty.
#[test]
fn no_log_marks_nothing() {
    for packed in [false, true] {
        let what = format!("{} ring, no log", if packed { "packed" } else { "split" });
        let aside = new_log();
        let out = net_workload(packed, FEATURES, &|m| {
            let cleared = m.with_log(Some(aside.clone())).with_log(None);
            assert!(cleared.log().is_none());
            cleared
        });
        assert!(!out.check_changes(&what).is_empty());
        assert_log_empty(&aside, &what);
    }
}

/// VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET and an unknown class: both ack bytes
/// (on two pages) are stored and logged, with the used ring.
fn ctrl_logged(packed: bool) {
    let what = format!("{} control queue", if packed { "packed" } else { "split" });
    let g = Guest::new("vhostd-net-dirty-log-ctrl");
    let ring_features = VERSION_1 | EVENT_IDX;
    let ring = Ring::at(CTRL_RING, packed);
    let mut drv = ring.driver(&g, ring_features);
    let class_cmd = [vn::VIRTIO_NET_CTRL_MQ as u8, vn::VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET as u8];
    assert_eq!(class_cmd, [4, 0]);
    let cmd = Buf { addr: CTRL_BUFS, len: 2 };
    let pairs = Buf { addr: CTRL_BUFS + 0x100, len: 2 };
    let bad = Buf { addr: CTRL_BUFS + 0x200, len: 2 };
    // The two ack bytes: the last of one page, the first of the next.
    let acks = [Buf { addr: CTRL_BUFS + 0x1fff, len: 1 }, Buf { addr: CTRL_BUFS + 0x2000, len: 1 }];
    assert!(g.drv.write(cmd.addr, &class_cmd));
    assert!(g.drv.write(pairs.addr, &2u16.to_le_bytes()));
    assert!(g.drv.write(bad.addr, &[0x7f, 0]));
    for a in &acks {
        g.fill(a.addr, 1, POISON);
    }
    drv.add(&[cmd, pairs], &acks[..1], 0).unwrap();
    drv.add(&[bad], &acks[1..], 1).unwrap();
    drv.publish();

    let before = g.snapshot();
    let log = new_log();
    let mem = Arc::new(g.mem.with_log(Some(log.clone())));
    let mut q = ring.device(&mem, ring_features);
    let mut batch = Batch::new();
    let mut state = CtrlState::new(4, [2, 0, 0, 0, 0, 1]);
    assert_eq!(process_ctrl(&mut q, &mut batch, &mut state), 2, "{what}");
    toggle_notifications(&mut q);
    drop(batch);
    let after = g.snapshot();

    assert_eq!((state.active_pairs, state.errors), (2, 1), "{what}");
    let mut ack = [0u8; 2];
    assert!(g.drv.read(acks[0].addr, &mut ack[..1]) && g.drv.read(acks[1].addr, &mut ack[1..]));
    assert_eq!(ack, [vn::VIRTIO_NET_OK as u8, vn::VIRTIO_NET_ERR as u8], "{what}: acks");
    let used = pop_all(&mut drv);
    assert_eq!(used.iter().map(|u| (u.token, u.len)).collect::<Vec<_>>(), [(0, 1), (1, 1)], "{what}");

    let mut known = ring.written_pages(ring_features);
    known.extend(acks.iter().flat_map(|a| pages(a.addr, 1)));
    assert_eq!(known.len(), 5, "{what}: three ring pages, two ack pages");
    let mut allowed = ring.device_pages();
    allowed.extend(known.iter().copied());
    Outcome { before, after, known, allowed }.check_logged(&log, &what);
}

#[test]
fn split_ctrl_ack_is_logged() {
    ctrl_logged(false);
}

#[test]
fn packed_ctrl_ack_is_logged() {
    ctrl_logged(true);
}
