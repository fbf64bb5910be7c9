//! The virtio-net data path (crates/net: process_tx, process_rx,
//! process_ctrl) over split or packed rings whose chains, virtio_net_hdr
//! bytes (short headers, GSO and checksum fields, num_buffers) and frames
//! come from the input, with the loopback backend (guest TX comes back on
//! guest RX, offload header included) or the sink backend.
//!
//! Input: TX ring size byte (bit 7: packed rings; split size 1 << (b % 6),
//! packed 1 + (b & 31)), RX ring size byte (same), feature byte (bit 0
//! MRG_RXBUF, bit 1 VERSION_1, bit 2 CSUM, bit 3 GUEST_CSUM, bit 4
//! IN_ORDER, bit 5 INDIRECT_DESC, bit 6 EVENT_IDX, bit 7 sink instead of
//! loopback), memory table byte, script length (u8), the script, then the
//! memory image at guest-physical 0. TX ring at 0, RX ring and a 4-entry
//! control ring after it (64-aligned, tightly packed).
//!
//! Invariants: no panic and nothing touched outside guest memory (guard
//! pages); after every call each chain taken from the ring has its used
//! element and all of them are published; TX drops add up; the backend got
//! exactly the frames counted.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::Mutex;
use vhostd_backends::{Loopback, NetBackend, Sink};
use vhostd_fuzz::{align_up, packed_layout, packed_linear, split_layout, Guest, Reader};
use vhostd_net::{process_ctrl, process_rx, process_tx, CtrlState, DirStats, Layout};
use virtq::ring::*;
use virtq::{Batch, PackedConfig, PackedQueue, Queue, SplitConfig, SplitQueue};

static LOOPBACK: Mutex<Option<Loopback>> = Mutex::new(None);
static SINK: Mutex<Option<Sink>> = Mutex::new(None);

/// One ring and what the checks need to know about it.
struct Ring {
    q: Queue,
    packed: bool,
    desc: u64,
    /// Split: avail ring; packed: driver area.
    avail: u64,
    size: u16,
    /// Split: next_avail - next_used at set-up; packed: avail - used lag.
    lag0: u32,
    /// Split: avail.idx the driver side publishes next.
    driver_idx: u16,
}

impl Ring {
    fn new(
        mem: &std::sync::Arc<virtq::GuestMemory>,
        base: u64,
        packed: bool,
        size: u16,
        feats: u64,
    ) -> Option<(Ring, u64)> {
        if packed {
            let (desc, driver, device, end) = packed_layout(base, size);
            let cfg = PackedConfig { size, desc, driver, device, features: feats, base: virtq::PACKED_BASE_INITIAL };
            let q = PackedQueue::new(mem.clone(), cfg).ok()?;
            let r = Ring { q: Queue::Packed(q), packed, desc, avail: driver, size, lag0: 0, driver_idx: 0 };
            Some((r, end))
        } else {
            let (desc, avail, used, end) = split_layout(base, size);
            let cfg = SplitConfig { size, desc, avail, used, features: feats, next_avail: 0 };
            let q = SplitQueue::new(mem.clone(), cfg).ok()?;
            let lag0 = 0u16.wrapping_sub(q.next_used()) as u32;
            let driver_idx = Guest::r16(mem, avail + 2);
            let r = Ring { q: Queue::Split(q), packed, desc, avail, size, lag0, driver_idx };
            Some((r, end))
        }
    }

    fn lag(&self) -> u32 {
        match &self.q {
            Queue::Split(q) => q.next_avail().wrapping_sub(q.next_used()) as u32,
            Queue::Packed(q) => {
                let b = q.vring_base();
                let m = 2 * self.size as u32;
                (packed_linear(b as u16, self.size) + m - packed_linear((b >> 16) as u16, self.size)) % m
            }
        }
    }

    /// After a device call: every chain taken has been used and published.
    fn check(&mut self, what: &str, broken_before: bool) {
        assert!(!self.q.flush_used(), "{what}: used elements left unpublished");
        let lag = self.lag();
        // A split ring broken by a head past the queue consumed that entry
        // without a used element.
        let broke_on_head =
            !self.packed && !broken_before && self.q.is_broken() && lag == self.lag0.wrapping_add(1) & 0xffff;
        if broke_on_head {
            self.lag0 = lag;
        }
        assert_eq!(lag, self.lag0, "{what}: chains taken but not used");
    }

    /// The driver posts one more chain: split, `head` in the next avail
    /// slot and avail.idx + 1; packed, descriptor `d` made available at
    /// `slot` in lap `wrap`.
    fn post(&mut self, mem: &virtq::GuestMemory, ops: &mut Reader, a: u8) {
        if self.packed {
            let (slot, d) = ops.packed_desc(self.size, a & 1 != 0);
            Guest::write(mem, self.desc + 16 * slot as u64, &d);
        } else {
            let head = ops.u8() as u16 % self.size.max(1);
            let slot = (self.driver_idx & (self.size - 1)) as u64;
            Guest::w16(mem, self.avail + 4 + 2 * slot, head);
            self.driver_idx = self.driver_idx.wrapping_add(1);
            Guest::w16(mem, self.avail + 2, self.driver_idx);
        }
    }
}

fn ring_size(b: u8, packed: bool) -> u16 {
    if packed {
        1 + (b & 31) as u16
    } else {
        1 << (b % 6)
    }
}

fuzz_target!(|data: &[u8]| {
    let g = Guest::get();
    g.clear();
    let mut r = Reader::new(data);
    let (t, x, f, m) = (r.u8(), r.u8(), r.u8(), r.u8());
    let nops = r.u8() as usize;
    let ops = r.bytes(nops);
    let image = r.rest();
    let mem = g.table(m as usize & 3);
    Guest::write(&mem, 0, image);

    let packed = t & 0x80 != 0;
    let mut feats = 0u64;
    for (bit, feat) in [
        (0, vhostd_net::features::MRG_RXBUF),
        (1, features::VERSION_1),
        (2, vhostd_net::features::CSUM),
        (3, vhostd_net::features::GUEST_CSUM),
        (4, features::IN_ORDER),
        (5, features::INDIRECT_DESC),
        (6, features::EVENT_IDX),
    ] {
        if f & (1 << bit) != 0 {
            feats |= feat;
        }
    }
    if packed {
        feats |= features::RING_PACKED | features::VERSION_1;
    }
    let layout = Layout::from_features(feats);
    let Some((mut tx, end)) = Ring::new(&mem, 0, packed, ring_size(t, packed), feats) else { return };
    let Some((mut rx, end)) = Ring::new(&mem, align_up(end, 64), packed, ring_size(x, packed), feats) else { return };
    let Some((mut ctrl, _)) = Ring::new(&mem, align_up(end, 64), packed, 4, feats) else { return };

    let mut lb = LOOPBACK.lock().unwrap();
    let mut sink = SINK.lock().unwrap();
    let backend: &mut dyn NetBackend = if f & 0x80 != 0 {
        sink.get_or_insert_with(|| Sink::new(32))
    } else {
        lb.get_or_insert_with(|| Loopback::new(32))
    };
    // Nothing left over from the previous input.
    backend.tx_buffers(0);
    backend.tx_commit(0);
    let frames0 = backend.stats().tx_frames;

    let mut batch = Batch::new();
    let (mut txs, mut rxs) = (DirStats::default(), DirStats::default());
    let mut cs = CtrlState::new(1, [2, 0, 0, 0, 0, 1]);
    cs.offloads_allowed = feats & vhostd_net::features::GUEST_OFFLOADS;
    let mut ops = Reader::new(ops);
    while !ops.is_empty() {
        let b = ops.u8();
        let a = b >> 4;
        match b & 7 {
            0 => {
                let broken = tx.q.is_broken();
                process_tx(&mut tx.q, &mut batch, backend, layout, &mut txs);
                tx.check("process_tx", broken);
                assert_eq!(txs.dropped, txs.short_header + txs.too_big, "TX drops add up");
                assert_eq!(backend.stats().tx_frames - frames0, txs.packets, "frames the backend got");
            }
            1 => {
                let broken = rx.q.is_broken();
                // Whether the guest also sent in this pass: only which lines
                // are fetched, for writing or reading.
                process_rx(&mut rx.q, &mut batch, backend, layout, &mut rxs, a & 1 != 0);
                rx.check("process_rx", broken);
            }
            2 => {
                let broken = ctrl.q.is_broken();
                process_ctrl(&mut ctrl.q, &mut batch, &mut cs);
                ctrl.check("process_ctrl", broken);
                assert!(cs.active_pairs >= 1 && cs.active_pairs <= cs.max_pairs);
                assert_eq!(cs.offloads & !cs.offloads_allowed, 0, "offloads beyond those negotiated");
            }
            3 => {
                let at = ops.u16() as u64;
                let bytes = ops.bytes(a as usize + 1);
                Guest::write(&mem, at, bytes);
            }
            4 => match a % 3 {
                0 => tx.post(&mem, &mut ops, a >> 2),
                1 => rx.post(&mem, &mut ops, a >> 2),
                _ => ctrl.post(&mem, &mut ops, a >> 2),
            },
            5 => {
                let q = match a % 3 {
                    0 => &mut tx.q,
                    1 => &mut rx.q,
                    _ => &mut ctrl.q,
                };
                match a / 3 {
                    0 => {
                        q.needs_notify();
                    }
                    1 => q.disable_notifications(),
                    _ => {
                        q.enable_notifications();
                    }
                }
            }
            6 => {
                // A virtio_net_hdr (10 bytes + num_buffers) at a buffer
                // address: flags, gso_type, hdr_len, gso_size, csum_start,
                // csum_offset, num_buffers.
                let at = ops.u16() as u64;
                let hdr = ops.bytes(12);
                Guest::write(&mem, at, hdr);
            }
            _ => {
                let n = tx.q.available(a as u16 * 2);
                let _ = n;
                rx.q.pending();
            }
        }
    }
    // Drain what the guest posted.
    for _ in 0..4 {
        let broken = tx.q.is_broken();
        process_tx(&mut tx.q, &mut batch, backend, layout, &mut txs);
        tx.check("process_tx", broken);
        let broken = rx.q.is_broken();
        process_rx(&mut rx.q, &mut batch, backend, layout, &mut rxs, true);
        rx.check("process_rx", broken);
    }
    assert_eq!(backend.stats().tx_frames - frames0, txs.packets, "frames the backend got");
});
