//! The packed ring's device side (virtq::PackedQueue) over a guest memory
//! whose descriptor ring, event suppression areas and buffers come from the
//! input, driven by a script of pops (every Access), in-order completions
//! (add_used), out-of-order completions (add_used_id), batched read-only
//! completions, in-order completions in one call (add_used_batch), unpops,
//! remaps, notification calls and driver writes (descriptors made
//! available in either lap, raw bytes, event areas).
//!
//! Input: size (1 + b, 1..=256), feature/layout byte (bit 0 INDIRECT_DESC,
//! bit 1 EVENT_IDX, bit 2 IN_ORDER, bits 3-4 memory table, bit 5 ring
//! addresses in frontend-virtual space, bit 6 vring base taken raw instead
//! of reduced into the ring), vring base (u32: avail index and wrap
//! counter, used index and wrap counter), script length (u8), the script,
//! then the memory image written at guest-physical 0 (descriptor ring at 0,
//! driver area and device area right after it).
//!
//! Invariants: no panic; every segment inside a region of the table;
//! lengths add up; directions as asked; a completion of a chain in flight
//! moves the used position and writes id, len and (once published) flags
//! with the used wrap counter; with nothing in flight the used position
//! trails the avail position by what it did at set-up; DISABLE/ENABLE as
//! asked in the device area; no call when the driver disabled them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::collections::{HashMap, HashSet};
use vhostd_fuzz::{access_of, check_batch, packed_layout, packed_linear, Guest, Reader};
use virtq::ring::*;
use virtq::{Access, Batch, PackedConfig, PackedQueue};

struct Run {
    q: PackedQueue,
    mem: std::sync::Arc<virtq::GuestMemory>,
    size: u16,
    desc: u64,
    driver: u64,
    device: u64,
    /// Avail position minus used position (mod 2 x size) at set-up.
    lag0: u32,
    /// Popped, not used: (id, write_len, ring slots), oldest first (the
    /// queue's FIFO).
    outstanding: Vec<(u16, u32, u16)>,
    /// Chains at the end of `outstanding` from the last pop, none of them
    /// completed since (what unpop may give back).
    last_pop: usize,
    /// Used descriptors written since the last publish: slot -> (wrap, id, len).
    unpublished: HashMap<u16, (bool, u16, u32)>,
    /// Slots the used position moved since the last publish. From a lap
    /// on, the batch's first slot (whose flags the publish writes) may
    /// have been written again, so its final flags are not checked.
    moved: u32,
    /// The device wrote a used descriptor since the last publish (so the
    /// queue holds back the first one's flags).
    pending: bool,
    /// Unpublished used descriptors of rejected chains whose id is not
    /// known here (stored at the publish): only their length is checked.
    any_id: HashSet<u16>,
}

impl Run {
    fn used_pos(&self) -> (u16, bool) {
        let half = (self.q.vring_base() >> 16) as u16;
        (half & 0x7fff, half & 0x8000 != 0)
    }

    fn avail_pos(&self) -> (u16, bool) {
        let half = self.q.vring_base() as u16;
        (half & 0x7fff, half & 0x8000 != 0)
    }

    /// Slots from used position `a` to `b`.
    fn dist(&self, a: (u16, bool), b: (u16, bool)) -> u32 {
        let m = 2 * self.size as u32;
        (packed_linear(b.0 | (b.1 as u16) << 15, self.size) + m - packed_linear(a.0 | (a.1 as u16) << 15, self.size))
            % m
    }

    fn lag(&self) -> u32 {
        let b = self.q.vring_base();
        let m = 2 * self.size as u32;
        (packed_linear(b as u16, self.size) + m - packed_linear((b >> 16) as u16, self.size)) % m
    }

    fn slot(&self, i: u16) -> (u64, u32, u16, u16) {
        let at = self.desc + 16 * i as u64;
        let b = Guest::read::<16>(&self.mem, at);
        (
            u64::from_le_bytes(b[0..8].try_into().unwrap()),
            u32::from_le_bytes(b[8..12].try_into().unwrap()),
            u16::from_le_bytes([b[12], b[13]]),
            u16::from_le_bytes([b[14], b[15]]),
        )
    }

    /// Forgets expectations for `n` slots from `from` (rewritten since).
    fn forget(&mut self, from: u16, n: u32) {
        for k in 0..n.min(self.size as u32) {
            let s = ((from as u32 + k) % self.size as u32) as u16;
            self.unpublished.remove(&s);
            self.any_id.remove(&s);
        }
    }

    fn check_quiet(&self) {
        if self.outstanding.is_empty() {
            assert_eq!(self.lag(), self.lag0, "with nothing in flight every chain taken was used");
        }
    }

    fn pop(&mut self, batch: &mut Batch, max: usize, access: Access) {
        let (u0, a0) = (self.used_pos(), self.avail_pos());
        let broken0 = self.q.is_broken();
        let n = self.q.pop_batch(batch, max, access);
        assert_eq!(n, batch.len());
        check_batch(&self.mem, batch, max, access);
        // A bad chain waits (ends the batch) only behind chains not yet
        // used: returned now, or in flight from before.
        assert!(
            !batch.ended_before_bad || n > 0 || !self.outstanding.is_empty(),
            "ended_before_bad with nothing ahead of the bad chain"
        );
        let u1 = self.used_pos();
        if u1 != u0 {
            // Bad chains are completed at once, and only with nothing in
            // flight (used descriptors go out in pop order).
            assert!(self.outstanding.is_empty(), "bad chain completed past chains in flight");
            let moved = self.dist(u0, u1);
            self.moved += moved;
            self.forget(u0.0, moved);
            self.pending = true;
            // Length 0, marked used in their lap, checked at the publish:
            // the first used line of a batch is stored only then, and the
            // id echoed is not known here.
            self.any_id.insert(u0.0);
            self.unpublished.insert(u0.0, (u0.1, 0, 0));
        }
        if broken0 {
            assert_eq!((n, self.avail_pos(), u1), (0, a0, u0), "a broken ring moved");
        }
        // Each chain's ring slots, for completions in one call: the chains
        // returned follow the bad ones completed at once, and each ends at
        // its first slot without NEXT (an indirect head has none).
        let mut at = (a0.0 as u32 + self.dist(u0, u1)) % self.size as u32;
        for c in &batch.chains {
            let mut n = 1u16;
            while n < self.size && self.slot(at as u16).3 & VRING_DESC_F_NEXT != 0 {
                n += 1;
                at = (at + 1) % self.size as u32;
            }
            at = (at + 1) % self.size as u32;
            self.outstanding.push((c.head, c.write_len, n));
        }
        self.last_pop = n;
        self.check_quiet();
    }

    /// Completes outstanding chain `i` with add_used (i == 0) or add_used_id.
    fn complete(&mut self, i: usize, len_mode: u8, by_id: bool) {
        let (id, wl, _) = self.outstanding[i];
        let len = match len_mode {
            0 => wl,
            1 => 0,
            _ => wl / 2,
        };
        let u0 = self.used_pos();
        if by_id {
            self.q.add_used_id(id, len);
            // The oldest chain with this id is the one completed.
            let k = self.outstanding.iter().position(|&(x, _, _)| x == id).unwrap();
            self.outstanding.remove(k);
            if k != 0 {
                self.last_pop = 0;
            }
        } else {
            assert_eq!(i, 0);
            self.q.add_used(id, len);
            self.outstanding.remove(0);
        }
        self.last_pop = self.last_pop.min(self.outstanding.len());
        let u1 = self.used_pos();
        assert_ne!(u1, u0, "completing a chain in flight did not move the used position");
        self.moved += self.dist(u0, u1);
        // The batch's first used descriptor, and those in its cache line,
        // are stored at the publish, the others at once. Which is which
        // depends on the host's cache lines, so all are checked at the
        // publish, which is what the driver may rely on.
        self.pending = true;
        self.unpublished.insert(u0.0, (u0.1, id, len));
        self.check_quiet();
    }

    /// Completes the oldest `k` chains with one add_used_batch: the same
    /// used descriptors as add_used for each in turn (written at the used
    /// position, which moves by the chain's slots). Lengths: as written,
    /// or every other one 0 (`len_mode` 1).
    fn complete_batch(&mut self, k: usize, len_mode: u8) {
        let chains = chains_of(&self.outstanding[..k]);
        let lens: Vec<u32> = self.outstanding[..k]
            .iter()
            .enumerate()
            .map(|(j, &(_, wl, _))| if len_mode == 0 || j % 2 == 1 { wl } else { 0 })
            .collect();
        let mut u = self.used_pos();
        self.q.add_used_batch(&chains, &lens);
        for (j, &(id, _, ndesc)) in self.outstanding[..k].iter().enumerate() {
            self.unpublished.insert(u.0, (u.1, id, lens[j]));
            let next = u.0 as u32 + ndesc as u32;
            u = if next >= self.size as u32 { ((next - self.size as u32) as u16, !u.1) } else { (next as u16, u.1) };
            self.moved += ndesc as u32;
        }
        assert_eq!(self.used_pos(), u, "add_used_batch moved the used position unlike add_used per chain");
        self.outstanding.drain(..k);
        self.last_pop = self.last_pop.min(self.outstanding.len());
        self.pending = true;
        self.check_quiet();
    }

    fn check_flags(&self, slot: u16, wrap: bool, len: u32, flags: u16) {
        let want = if wrap { VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED } else { 0 };
        assert_eq!(
            flags & (VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED),
            want,
            "used descriptor at slot {slot}: flags {flags:#x}, wrap {wrap}"
        );
        assert_eq!(flags & VRING_DESC_F_WRITE != 0, len != 0, "WRITE flag vs length at slot {slot}");
    }

    fn published(&mut self) {
        let lapped = self.moved >= self.size as u32;
        self.moved = 0;
        self.pending = false;
        for (&slot, &(wrap, id, len)) in &self.unpublished {
            if lapped {
                break;
            }
            let (_, l, i, flags) = self.slot(slot);
            let i = if self.any_id.contains(&slot) { id } else { i };
            assert_eq!((i, l), (id, len), "used descriptor at slot {slot} changed before publish");
            self.check_flags(slot, wrap, len, flags);
        }
        self.unpublished.clear();
        self.any_id.clear();
    }

    /// Driver writes: anything but the device area; used descriptors not
    /// yet published that it overwrites are no longer checked.
    fn poke(&mut self, at: u64, bytes: &[u8]) {
        for (k, b) in bytes.iter().enumerate() {
            let p = at + k as u64;
            if p >= self.device && p < self.device + 4 {
                continue;
            }
            if p >= self.desc && p < self.driver {
                self.forget(((p - self.desc) / 16) as u16, 1);
            }
            Guest::write(&self.mem, p, &[*b]);
        }
    }
}

/// Chains carrying only the heads of `outstanding` entries: all a
/// completion reads of them.
fn chains_of(outstanding: &[(u16, u32, u16)]) -> Vec<virtq::Chain> {
    outstanding
        .iter()
        .map(|&(head, _, _)| {
            let mut c = virtq::Chain::default();
            c.head = head;
            c
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let g = Guest::get();
    g.clear();
    let mut r = Reader::new(data);
    let size = 1 + r.u8() as u16;
    let f = r.u8();
    let mut base = r.u32();
    let nops = r.u8() as usize;
    let ops = r.bytes(nops);
    let image = r.rest();
    let mem = g.table((f >> 3) as usize & 3);
    Guest::write(&mem, 0, image);
    if f & 0x40 == 0 {
        // Keep the positions inside the ring (the raw form mostly tests
        // the BadBase refusal).
        let fix = |h: u16| ((h & 0x7fff) % size) | (h & 0x8000);
        let hi = (base >> 16) as u16;
        base = fix(base as u16) as u32 | if hi == 0 { 0 } else { (fix(hi) as u32) << 16 };
    }

    let mut feats = features::VERSION_1 | features::RING_PACKED;
    if f & 1 != 0 {
        feats |= features::INDIRECT_DESC;
    }
    if f & 2 != 0 {
        feats |= features::EVENT_IDX;
    }
    if f & 4 != 0 {
        feats |= features::IN_ORDER;
    }
    let in_order = f & 4 != 0;
    let (desc, driver, device, _) = packed_layout(0, size);
    let cfg = PackedConfig { size, desc, driver, device, features: feats, base };
    let Ok(q) = PackedQueue::new(mem.clone(), cfg) else { return };
    let mut run = Run {
        q,
        mem,
        size,
        desc,
        driver,
        device,
        lag0: 0,
        outstanding: Vec::new(),
        last_pop: 0,
        unpublished: HashMap::new(),
        moved: 0,
        pending: false,
        any_id: HashSet::new(),
    };
    run.lag0 = run.lag();
    let mut batch = Batch::new();
    let mut ops = Reader::new(ops);
    while !ops.is_empty() {
        let b = ops.u8();
        let a = b >> 4;
        match b & 15 {
            0 => {
                let max = 1 + ops.u8() as usize % 64;
                run.pop(&mut batch, max, access_of(a));
            }
            1 => {
                // In order: the oldest first.
                let k = 1 + (a & 7) as usize;
                for _ in 0..k.min(run.outstanding.len()) {
                    run.complete(0, a >> 3, false);
                }
            }
            2 => {
                // Out of order, by buffer id.
                let c = ops.u8();
                if !run.outstanding.is_empty() {
                    let i = c as usize % run.outstanding.len();
                    run.complete(i, a % 3, true);
                }
            }
            3 => {
                let chains = chains_of(&run.outstanding);
                let u0 = run.used_pos();
                run.q.add_used_read_only(&chains);
                if !chains.is_empty() {
                    assert_ne!(run.used_pos(), u0, "read-only completion did not move the used position");
                    // Slots written are not tracked further here; the next
                    // publish must still leave consistent flags on the
                    // earlier entries, which stay recorded.
                    let moved = run.dist(u0, run.used_pos());
                    run.moved += moved;
                    run.forget(u0.0, moved);
                    if in_order {
                        // One used descriptor, checked at the publish.
                        run.unpublished.insert(u0.0, (u0.1, chains.last().unwrap().head, 0));
                    }
                    run.pending = true;
                }
                run.outstanding.clear();
                run.last_pop = 0;
                run.check_quiet();
            }
            4 => {
                let k = a as usize % (run.last_pop + 1);
                run.q.unpop(k as u16);
                let n = run.outstanding.len();
                run.outstanding.truncate(n - k);
                run.last_pop -= k;
                run.check_quiet();
            }
            5 => {
                // Make a descriptor available: slot, buffer, id, NEXT /
                // WRITE / INDIRECT, in lap a & 1.
                let (slot, d) = ops.packed_desc(size, a & 1 != 0);
                run.poke(desc + 16 * slot as u64, &d);
            }
            6 => {
                let at = ops.u16() as u64;
                let bytes = ops.bytes(a as usize + 1);
                run.poke(at, bytes);
            }
            7 => {
                // Driver event suppression area: off_wrap and flags.
                let v = ops.u32();
                run.poke(driver, &v.to_le_bytes());
            }
            8 => {
                run.q.enable_notifications();
                assert_eq!(Guest::r16(&run.mem, device + 2), RING_EVENT_FLAGS_ENABLE, "device area after enable");
            }
            9 => {
                run.q.disable_notifications();
                assert_eq!(Guest::r16(&run.mem, device + 2), RING_EVENT_FLAGS_DISABLE, "device area after disable");
            }
            10 => {
                let disabled = Guest::r16(&run.mem, driver + 2) & 3 == RING_EVENT_FLAGS_DISABLE;
                let call = run.q.needs_notify();
                assert!(!(disabled && call), "call while the driver disabled them");
            }
            11 => {
                let had = run.pending;
                let did = if a & 1 == 0 {
                    run.q.flush_used()
                } else {
                    run.q.publish_used();
                    had
                };
                assert_eq!(did, had, "flush_used vs unpublished used descriptors");
                run.published();
            }
            12 => {
                if a & 1 == 0 {
                    run.q.available(a as u16 * 4);
                } else {
                    let n = run.q.pending();
                    assert!(n <= size, "{n} chains pending in a ring of {size}");
                }
            }
            13 => {
                // A memory-table change: only with nothing in flight.
                if run.outstanding.is_empty() {
                    run.q.flush_used();
                    run.published();
                    let mem = g.table(a as usize);
                    if let Ok(q) = run.q.remap(mem.clone(), run.q.addrs()) {
                        let (old, new) = (run.q.vring_base(), q.vring_base());
                        assert_eq!(new, old, "vring base kept across a remap");
                        run.q = q;
                        run.mem = mem;
                    }
                }
            }
            14 => {
                // In order, in one call: the oldest 1-8.
                let k = (1 + (a & 7) as usize).min(run.outstanding.len());
                if k > 0 {
                    run.complete_batch(k, a >> 3);
                }
            }
            _ => {
                // Complete everything, oldest first, and publish.
                while !run.outstanding.is_empty() {
                    run.complete(0, a % 3, false);
                }
                run.q.publish_used();
                run.published();
            }
        }
    }
    while !run.outstanding.is_empty() {
        run.complete(0, 0, false);
    }
    run.q.publish_used();
    run.published();
    assert!(!run.q.flush_used(), "nothing left to publish");
    run.check_quiet();
});
