//! The split ring's device side (virtq::SplitQueue) over a guest memory
//! whose descriptor table, avail ring, used ring and buffers come from the
//! input, driven by a script of pops (every Access), completions in and out
//! of order, unpops, repops, remaps, notification calls and driver writes.
//!
//! Input: size (1 << (b % 9)), feature/layout byte (bit 0 INDIRECT_DESC,
//! bit 1 EVENT_IDX, bit 2 IN_ORDER, bits 3-4 memory table, bit 5 ring
//! addresses in frontend-virtual space), next_avail (u16), script length
//! (u8), the script, then the memory image written at guest-physical 0
//! (the ring sits at 0: desc table, avail ring, used ring, packed tightly).
//!
//! Invariants: no panic; every segment inside a region of the table;
//! lengths add up; directions as asked; each consumed avail entry is either
//! returned or completed with length 0 (a broken ring aside); used elements
//! hold exactly what was added; used.idx, flags and avail_event as written.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vhostd_fuzz::{access_of, check_batch, split_layout, Guest, Reader};
use virtq::ring::{features, VRING_USED_F_NO_NOTIFY};
use virtq::{Access, Batch, SplitConfig, SplitQueue};

struct Run {
    q: SplitQueue,
    mem: std::sync::Arc<virtq::GuestMemory>,
    size: u16,
    used_ring: u64,
    event_idx: bool,
    in_order: bool,
    /// Popped, not completed: (head, write_len), oldest first.
    outstanding: Vec<(u16, u32)>,
    /// How many chains at the end of `outstanding` came from the last
    /// pop_batch (what `unpop` may give back).
    last_pop: usize,
    published: u16,
    /// used.idx in memory is what was last published (not so after a
    /// remap onto other memory, until the next publish).
    idx_valid: bool,
}

impl Run {
    fn used_elem(&self, idx: u16) -> (u32, u32) {
        let slot = (idx & (self.size - 1)) as u64;
        let at = self.used_ring + 4 + 8 * slot;
        (Guest::r32(&self.mem, at), Guest::r32(&self.mem, at + 4))
    }

    fn pop(&mut self, batch: &mut Batch, max: usize, access: Access) {
        let (avail0, used0) = (self.q.next_avail(), self.q.next_used());
        let (bad0, broken0) = (self.q.stats.bad_chains, self.q.is_broken());
        let n = self.q.pop_batch(batch, max, access);
        assert_eq!(n, batch.len());
        check_batch(&self.mem, batch, max, access);
        // A bad chain ends a batch only after good ones (else it is
        // completed at once).
        assert!(!batch.ended_before_bad || n > 0, "ended_before_bad on an empty batch");
        let d_avail = self.q.next_avail().wrapping_sub(avail0);
        let d_used = self.q.next_used().wrapping_sub(used0);
        let d_bad = self.q.stats.bad_chains - bad0;
        // Every avail entry consumed was returned or completed with length
        // 0; only a head past the queue (which breaks the ring) is neither.
        let lost = d_avail.wrapping_sub(n as u16).wrapping_sub(d_used);
        assert!(
            lost == 0 || (lost == 1 && !broken0 && self.q.is_broken()),
            "consumed {d_avail} avail entries, returned {n}, completed {d_used}"
        );
        assert_eq!(d_bad, d_used as u64 + lost as u64, "bad chains vs their used entries");
        if broken0 {
            assert_eq!((n, d_avail, d_used), (0, 0, 0), "a broken ring moved");
        }
        for k in 0..d_used {
            let (id, len) = self.used_elem(used0.wrapping_add(k));
            assert!(id < self.size as u32 && len == 0, "rejected chain's used element ({id}, {len})");
        }
        for c in &batch.chains {
            assert!(c.head < self.size, "head {} past the queue", c.head);
            self.outstanding.push((c.head, c.write_len));
        }
        self.last_pop = n;
    }

    fn add_used(&mut self, head: u16, len: u32) {
        let before = self.q.next_used();
        self.q.add_used(head, len);
        assert_eq!(self.q.next_used(), before.wrapping_add(1));
        assert_eq!(self.used_elem(before), (head as u32, len), "used element as added");
    }

    /// Completes the outstanding chains at positions `order`, in that order.
    fn complete(&mut self, order: &[usize], mode: u8) {
        let mut done: Vec<usize> = Vec::new();
        for &i in order {
            let (head, wl) = self.outstanding[i];
            let len = match mode {
                0 => wl,
                1 => 0,
                _ => wl / 2,
            };
            self.add_used(head, len);
            done.push(i);
        }
        done.sort_unstable();
        for i in done.into_iter().rev() {
            self.outstanding.remove(i);
        }
        // The oldest completed first (what rx_mergeable does before
        // unpopping the rest) leaves the last pop's remaining chains at
        // the end; anything else may have completed one of them.
        let oldest_first = order.iter().enumerate().all(|(k, &i)| k == i);
        self.last_pop = if oldest_first { self.last_pop.min(self.outstanding.len()) } else { 0 };
    }

    fn publish(&mut self) {
        self.q.publish_used();
        self.published = self.q.next_used();
        self.idx_valid = true;
        assert_eq!(Guest::r16(&self.mem, self.used_ring + 2), self.q.next_used(), "used.idx as published");
    }
}

fuzz_target!(|data: &[u8]| {
    let g = Guest::get();
    g.clear();
    let mut r = Reader::new(data);
    let size = 1u16 << (r.u8() % 9);
    let f = r.u8();
    let next_avail = r.u16();
    let nops = r.u8() as usize;
    let ops = r.bytes(nops);
    let image = r.rest();
    let mem = g.table((f >> 3) as usize & 3);
    Guest::write(&mem, 0, image);

    let mut feats = features::VERSION_1;
    if f & 1 != 0 {
        feats |= features::INDIRECT_DESC;
    }
    if f & 2 != 0 {
        feats |= features::EVENT_IDX;
    }
    if f & 4 != 0 {
        feats |= features::IN_ORDER;
    }
    let (desc, avail, used, _) = split_layout(0, size);
    let cfg = SplitConfig { size, desc, avail, used, features: feats, next_avail };
    let Ok(q) = SplitQueue::new(mem.clone(), cfg) else { return };
    let published = q.next_used();
    assert_eq!(published, Guest::r16(&mem, used + 2), "resumes from used.idx");
    let mut run = Run {
        q,
        mem,
        size,
        used_ring: used,
        event_idx: feats & features::EVENT_IDX != 0,
        in_order: feats & features::IN_ORDER != 0,
        outstanding: Vec::new(),
        last_pop: 0,
        published,
        idx_valid: true,
    };
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
            1 | 2 => {
                let c = ops.u8();
                let n = run.outstanding.len();
                let k = match (c & 0x3f) as usize {
                    0 => n,
                    k => k.min(n),
                };
                let order: Vec<usize> = if b & 15 == 1 { (0..k).collect() } else { (n - k..n).rev().collect() };
                run.complete(&order, c >> 6);
            }
            3 => {
                let chains: Vec<virtq::Chain> = run
                    .outstanding
                    .iter()
                    .map(|&(head, _)| {
                        let mut c = virtq::Chain::default();
                        c.head = head;
                        c
                    })
                    .collect();
                let before = run.q.next_used();
                run.q.add_used_read_only(&chains);
                assert_eq!(run.q.next_used(), before.wrapping_add(chains.len() as u16));
                if let Some(last) = chains.last() {
                    if run.in_order {
                        assert_eq!(run.used_elem(before), (last.head as u32, 0));
                    } else {
                        // A hostile driver can have more chains out than
                        // the ring holds: only the last lap is still there.
                        let skip = chains.len().saturating_sub(size as usize);
                        for (k, c) in chains.iter().enumerate().skip(skip) {
                            assert_eq!(run.used_elem(before.wrapping_add(k as u16)), (c.head as u32, 0));
                        }
                    }
                }
                run.outstanding.clear();
                run.last_pop = 0;
            }
            4 => {
                let k = a as usize % (run.last_pop + 1);
                let before = run.q.next_avail();
                run.q.unpop(k as u16);
                assert_eq!(run.q.next_avail(), before.wrapping_sub(k as u16));
                let n = run.outstanding.len();
                run.outstanding.truncate(n - k);
                run.last_pop -= k;
            }
            5 => {
                let idx = Guest::r16(&run.mem, avail + 2).wrapping_add(a as u16);
                Guest::w16(&run.mem, avail + 2, idx);
            }
            6 => Guest::w16(&run.mem, avail + 2, ops.u16()),
            7 => {
                // The driver writes anything but the used ring (whose
                // contents the checks compare with what the device wrote).
                let at = ops.u16() as u64;
                let bytes = ops.bytes(a as usize + 1);
                let used_end = used + 6 + 8 * size as u64;
                for (k, b) in bytes.iter().enumerate() {
                    let p = at + k as u64;
                    if p < used || p >= used_end {
                        Guest::write(&run.mem, p, &[*b]);
                    }
                }
            }
            8 => {
                run.q.enable_notifications();
                if run.event_idx {
                    let ev = Guest::r16(&run.mem, used + 4 + 8 * size as u64);
                    assert_eq!(ev, run.q.next_avail(), "avail_event");
                } else {
                    assert_eq!(Guest::r16(&run.mem, used), 0, "used.flags after enable");
                }
            }
            9 => {
                run.q.disable_notifications();
                if !run.event_idx {
                    assert_eq!(Guest::r16(&run.mem, used), VRING_USED_F_NO_NOTIFY, "used.flags after disable");
                }
            }
            10 => {
                run.q.needs_notify();
            }
            11 => {
                if a & 1 == 0 {
                    let pending = run.q.next_used() != run.published;
                    assert_eq!(run.q.flush_used(), pending, "flush_used");
                    if pending {
                        run.published = run.q.next_used();
                    }
                    if run.idx_valid {
                        assert_eq!(Guest::r16(&run.mem, used + 2), run.published);
                    }
                } else {
                    run.publish();
                }
            }
            12 => {
                if a & 1 == 0 {
                    // Not bounded by the size: after an unpop, the avail.idx
                    // cached by an earlier read may count chains a hostile
                    // driver published on top of ones in flight (harmless:
                    // slots are masked; see fuzz/README.md).
                    run.q.available(a as u16 * 4);
                } else {
                    let n = run.q.pending();
                    assert!(n <= size, "{n} chains pending in a ring of {size}");
                }
            }
            13 => {
                let head = ops.u16() % (2 * size);
                let (used0, bad0, broken) = (run.q.next_used(), run.q.stats.bad_chains, run.q.is_broken());
                let access = access_of(a);
                let mut one = Batch::new();
                let ok = run.q.repop(head, &mut one, access);
                if ok {
                    assert_eq!(one.len(), 1);
                    check_batch(&run.mem, &one, 1, access);
                    assert_eq!(one.chains[0].head, head);
                    run.outstanding.push((head, one.chains[0].write_len));
                    assert_eq!(run.q.next_used(), used0);
                } else if broken || head >= size {
                    assert_eq!(run.q.next_used(), used0);
                } else {
                    assert_eq!(run.q.next_used(), used0.wrapping_add(1), "bad repop completed");
                    assert_eq!(run.q.stats.bad_chains, bad0 + 1);
                    assert_eq!(run.used_elem(used0), (head as u32, 0));
                }
                run.last_pop = 0;
            }
            14 => {
                let mem = g.table(a as usize);
                if let Ok(q) = run.q.remap(mem.clone(), run.q.addrs()) {
                    assert_eq!((q.next_avail(), q.next_used()), (run.q.next_avail(), run.q.next_used()));
                    run.q = q;
                    run.mem = mem;
                    run.idx_valid = false;
                }
            }
            _ => {
                run.q.set_next_avail(ops.u16());
                run.last_pop = 0;
            }
        }
    }
    // Complete what is left and publish: every chain gets its used element.
    let n = run.outstanding.len();
    let order: Vec<usize> = (0..n).collect();
    run.complete(&order, 0);
    run.publish();
    assert!(!run.q.flush_used(), "nothing left to publish");
});
