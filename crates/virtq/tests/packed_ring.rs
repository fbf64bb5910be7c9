//! The packed ring's device side: exact outcomes for well-formed and hostile
//! rings (written raw, as any driver could), event suppression, set-up
//! refusals, and the device against the project's own packed driver side.

use proptest::prelude::*;
use std::sync::Arc;
use virtq::ring::*;
use virtq::{Access, Batch, GuestMemory, Mapping, PackedConfig, PackedQueue, Region, SetupError};
use virtq_driver::{Buf, DriverError, DriverMemory, PackedDriver, RingLayout, SharedMemory};

const MEM: u64 = 1 << 20;
const BUFS: u64 = 0x40000;
const RING: u64 = 0x1000;
const NEXT: u16 = VRING_DESC_F_NEXT;
const WRITE: u16 = VRING_DESC_F_WRITE;
const INDIRECT: u16 = VRING_DESC_F_INDIRECT;
const FEATURES: u64 = features::VERSION_1 | features::RING_PACKED | features::INDIRECT_DESC | features::EVENT_IDX;

/// One region of guest memory (gpa = offset), a packed ring at RING with its
/// driver and device areas after it, and a raw writer for descriptors.
/// The memory is a memfd: the device side maps it as guest memory (`map`,
/// `mem`), the driver side maps it again with its own type (`shared`).
struct Ring {
    map: Arc<Mapping>,
    mem: Arc<GuestMemory>,
    shared: Arc<SharedMemory>,
    layout: RingLayout,
}

impl Ring {
    fn new(size: u16) -> Ring {
        let file = virtq_driver::memfd("packed-ring-test", MEM, true).unwrap();
        let map = Arc::new(Mapping::map(&file, 0, MEM).unwrap());
        let region = Region::new(0, MEM, map.clone(), 0).unwrap();
        let mem = Arc::new(GuestMemory::from_regions(vec![region]).unwrap());
        let shared = Arc::new(SharedMemory::map(&file, 0, MEM).unwrap());
        Ring { map, mem, shared, layout: RingLayout::packed_at(RING, size) }
    }

    /// The driver's view of the same memory (gpa = offset).
    fn driver_memory(&self) -> DriverMemory {
        DriverMemory::new(self.shared.clone(), 0)
    }

    /// Where guest-physical `gpa` lies in this process (a number).
    fn host(&self, gpa: u64) -> usize {
        assert!(gpa < MEM);
        self.map.host_range().0 + gpa as usize
    }

    fn w16(&self, gpa: u64, v: u16) {
        assert!(self.mem.write(gpa, &v.to_le_bytes()));
    }

    fn r16(&self, gpa: u64) -> u16 {
        let mut b = [0u8; 2];
        assert!(self.mem.read(gpa, &mut b));
        u16::from_le_bytes(b)
    }

    fn r32(&self, gpa: u64) -> u32 {
        let mut b = [0u8; 4];
        assert!(self.mem.read(gpa, &mut b));
        u32::from_le_bytes(b)
    }

    /// Writes a descriptor at `gpa` (ring slot or indirect table entry).
    fn desc_at(&self, gpa: u64, addr: u64, len: u32, id: u16, flags: u16) {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&id.to_le_bytes());
        b[14..16].copy_from_slice(&flags.to_le_bytes());
        assert!(self.mem.write(gpa, &b));
    }

    /// Makes ring slot `slot` available in lap `wrap` with extra `flags`.
    fn avail(&self, slot: u16, wrap: bool, addr: u64, len: u32, id: u16, flags: u16) {
        let bits = PackedDriver::avail_bits(wrap);
        self.desc_at(self.layout.desc + 16 * slot as u64, addr, len, id, flags | bits);
    }

    /// The used descriptor at `slot` if it is marked used in lap `wrap`: (id, len, flags).
    fn used(&self, slot: u16, wrap: bool) -> Option<(u16, u32, u16)> {
        let base = self.layout.desc + 16 * slot as u64;
        let flags = self.r16(base + 14);
        let want = if wrap { VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED } else { 0 };
        (flags & (VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED) == want)
            .then(|| (self.r16(base + 12), self.r32(base + 8), flags))
    }

    fn set_driver_event(&self, flags: u16, off_wrap: u16) {
        self.w16(self.layout.avail, off_wrap);
        self.w16(self.layout.avail + 2, flags);
    }

    fn device_event_flags(&self) -> u16 {
        self.r16(self.layout.used + 2)
    }

    fn config(&self, base: u32) -> PackedConfig {
        PackedConfig {
            size: self.layout.size,
            desc: self.layout.desc,
            driver: self.layout.avail,
            device: self.layout.used,
            features: FEATURES,
            base,
        }
    }

    fn device(&self) -> PackedQueue {
        self.device_with(FEATURES)
    }

    fn device_with(&self, features: u64) -> PackedQueue {
        let cfg = PackedConfig { features, ..self.config(PACKED_BASE) };
        PackedQueue::new(self.mem.clone(), cfg).unwrap()
    }
}

const PACKED_BASE: u32 = virtq::PACKED_BASE_INITIAL;

fn buf(i: u64) -> u64 {
    BUFS + i * 0x1000
}

#[test]
fn single_descriptors_pop_in_order_and_used_ones_appear_at_once_on_publish() {
    let r = Ring::new(8);
    let mut q = r.device();
    for i in 0..3u16 {
        r.avail(i, true, buf(i as u64), 100 + i as u32, 40 + i, WRITE);
    }
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 32, Access::WriteOnly), 3);
    let heads: Vec<u16> = b.chains.iter().map(|c| c.head).collect();
    assert_eq!(heads, [40, 41, 42], "the head is the buffer id");
    assert_eq!(b.writable(&b.chains[1]).segs()[0].len(), 101);
    assert_eq!(b.writable(&b.chains[1]).segs()[0].host_addr(), r.host(buf(1)));
    for (k, c) in b.chains.clone().iter().enumerate() {
        q.add_used(c.head, 10 * k as u32);
    }
    // Nothing visible before the publish: the first slot still looks available.
    assert_eq!(r.used(0, true), None);
    q.publish_used();
    assert_eq!(r.used(0, true).map(|u| (u.0, u.1)), Some((40, 0)));
    assert_eq!(r.used(1, true).map(|u| (u.0, u.1)), Some((41, 10)));
    assert_eq!(r.used(2, true).map(|u| (u.0, u.1)), Some((42, 20)));
    assert_eq!(r.used(0, true).unwrap().2 & WRITE, 0, "no WRITE flag when nothing was written");
    assert_ne!(r.used(1, true).unwrap().2 & WRITE, 0, "WRITE flag when bytes were written");
    assert_eq!(q.stats.used_publishes, 1, "one publishing store for the batch");
    assert_eq!(q.pop_batch(&mut b, 32, Access::WriteOnly), 0);
}

#[test]
fn chains_take_several_slots_and_the_used_descriptor_skips_them() {
    let r = Ring::new(8);
    let mut q = r.device();
    // A 3-descriptor chain (readable, readable, writable) with the id in the
    // last descriptor, then a single descriptor.
    r.avail(1, true, buf(1), 20, 0, NEXT);
    r.avail(2, true, buf(2), 30, 7, WRITE);
    r.avail(3, true, buf(3), 40, 8, 0);
    r.avail(0, true, buf(0), 10, 0, NEXT);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 32, Access::ReadThenWrite), 2);
    let c = b.chains[0];
    assert_eq!((c.head, c.read_len, c.write_len), (7, 30, 30));
    assert_eq!(b.readable(&c).segs().len(), 2);
    assert_eq!(b.chains[1].head, 8);
    q.add_used(7, 30);
    q.add_used(8, 0);
    q.publish_used();
    assert_eq!(r.used(0, true).map(|u| (u.0, u.1)), Some((7, 30)));
    assert_eq!(r.used(3, true).map(|u| (u.0, u.1)), Some((8, 0)), "second used descriptor after the chain's 3 slots");
    assert_eq!(q.vring_base(), 4 | 0x8000 | ((4 | 0x8000) << 16));
}

#[test]
fn positions_and_wrap_counters_survive_many_laps() {
    // Size 5 (packed rings need not be powers of two), chains of 1 or 2 slots.
    let r = Ring::new(5);
    let mut q = r.device();
    let mut b = Batch::new();
    let (mut slot, mut wrap) = (0u16, true);
    let (mut dslot, mut dwrap) = (0u16, true);
    for round in 0..40u16 {
        let two = round % 3 == 0;
        let next_slot = |s: u16, w: bool| if s + 1 == 5 { (0, !w) } else { (s + 1, w) };
        let (s1, w1) = next_slot(slot, wrap);
        if two {
            r.avail(s1, w1, buf(1), 8, round, WRITE);
            r.avail(slot, wrap, buf(0), 8, 0, NEXT | WRITE);
            (slot, wrap) = next_slot(s1, w1);
        } else {
            r.avail(slot, wrap, buf(0), 8, round, WRITE);
            (slot, wrap) = (s1, w1);
        }
        assert_eq!(q.pop_batch(&mut b, 8, Access::WriteOnly), 1, "round {round}");
        assert_eq!(b.chains[0].head, round);
        assert_eq!(b.chains[0].write_len, if two { 16 } else { 8 });
        q.add_used(round, 5);
        q.publish_used();
        assert_eq!(r.used(dslot, dwrap).map(|u| u.0), Some(round), "round {round}: used at slot {dslot}");
        (dslot, dwrap) = (slot, wrap);
        assert_eq!(q.vring_base() & 0xffff, slot as u32 | ((wrap as u32) << 15));
    }
}

#[test]
fn bad_chains_are_completed_empty_counted_and_skipped_whole() {
    let r = Ring::new(16);
    let mut q = r.device();
    // Slot: 0 outside memory; 1 straddles the end; 2 writable on a read-only
    // queue; 3-4 a chain whose second descriptor is outside memory (both
    // slots skipped); 5 a 4 GiB length; 6 good.
    r.avail(0, true, 1 << 40, 10, 100, 0);
    r.avail(1, true, MEM - 8, 16, 101, 0);
    r.avail(2, true, buf(0), 10, 102, WRITE);
    r.avail(4, true, MEM + 4096, 10, 103, 0);
    r.avail(3, true, buf(0), 10, 0, NEXT);
    r.avail(5, true, buf(0), u32::MAX, 104, 0);
    r.avail(6, true, buf(0), 10, 105, 0);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 32, Access::ReadOnly), 1);
    assert_eq!(b.chains[0].head, 105);
    assert_eq!((q.stats.bad_chains, q.stats.bad_address, q.stats.bad_direction), (5, 4, 1));
    q.add_used(105, 0);
    q.publish_used();
    for (slot, id) in [(0, 100), (1, 101), (2, 102), (3, 103), (5, 104), (6, 105)] {
        assert_eq!(r.used(slot, true).map(|u| (u.0, u.1)), Some((id, 0)), "slot {slot}");
    }
    assert_eq!(r.used(4, true), None, "the bad chain's second slot is skipped");
    assert!(!q.is_broken());
}

#[test]
fn a_bad_chain_after_good_ones_ends_the_batch_and_leads_the_next() {
    let r = Ring::new(8);
    let mut q = r.device();
    r.avail(0, true, buf(0), 10, 1, 0);
    r.avail(1, true, 1 << 40, 10, 2, 0);
    r.avail(2, true, buf(0), 10, 3, 0);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 32, Access::ReadOnly), 1);
    assert!(b.ended_before_bad);
    assert_eq!(q.stats.bad_chains, 0, "not counted until it is completed");
    q.add_used(1, 0);
    q.publish_used();
    assert_eq!(q.pop_batch(&mut b, 32, Access::ReadOnly), 1);
    assert_eq!(b.chains[0].head, 3);
    assert_eq!(q.stats.bad_chains, 1);
    q.add_used(3, 0);
    q.publish_used();
    let ids: Vec<u16> = (0..3).map(|s| r.used(s, true).unwrap().0).collect();
    assert_eq!(ids, [1, 2, 3], "used in ring order");
}

#[test]
fn indirect_tables_are_read_and_their_abuses_refused() {
    let r = Ring::new(16);
    let mut q = r.device();
    let t = buf(8);
    r.desc_at(t, buf(0), 10, 0, 0);
    r.desc_at(t + 16, buf(1), 20, 0, WRITE);
    r.avail(0, true, t, 32, 50, INDIRECT);
    let nested = buf(9);
    r.desc_at(nested, t, 32, 0, INDIRECT);
    r.avail(1, true, nested, 16, 51, INDIRECT); // indirect inside indirect
    r.avail(2, true, t, 24, 52, INDIRECT); // length not a multiple of 16
    r.avail(3, true, t, 0, 53, INDIRECT); // empty table
    r.avail(5, true, buf(0), 10, 54, 0);
    r.avail(4, true, t, 32, 0, INDIRECT | NEXT); // indirect linked by NEXT
    r.avail(6, true, MEM - 16, 32, 55, INDIRECT); // table straddles the end
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 32, Access::ReadThenWrite), 1);
    let c = b.chains[0];
    assert_eq!((c.head, c.read_len, c.write_len), (50, 10, 20));
    q.add_used(50, 20);
    assert_eq!(q.pop_batch(&mut b, 32, Access::ReadThenWrite), 0);
    assert_eq!((q.stats.bad_indirect, q.stats.bad_address), (4, 1));
    q.publish_used();
    assert_eq!(r.used(4, true).map(|u| u.0), Some(54), "the NEXT-linked pair is completed as one (id of its last)");
    assert_eq!(r.used(6, true).map(|u| u.0), Some(55));
    // Without the feature, an indirect descriptor is refused.
    let r2 = Ring::new(4);
    let mut q2 = r2.device_with(FEATURES & !features::INDIRECT_DESC);
    r2.desc_at(t, buf(0), 10, 0, 0);
    r2.avail(0, true, t, 16, 9, INDIRECT);
    assert_eq!(q2.pop_batch(&mut b, 4, Access::ReadOnly), 0);
    assert_eq!(q2.stats.bad_indirect, 1);
}

#[test]
fn a_chain_longer_than_the_ring_or_cut_short_breaks_the_queue() {
    let r = Ring::new(4);
    let mut q = r.device();
    for s in 0..4 {
        r.avail(s, true, buf(0), 10, 0, NEXT);
    }
    let mut b = Batch::new();
    assert_eq!(q.pending(), 1, "a chain cut short still counts, so it gets rejected");
    assert_eq!(q.available(8), 8, "an upper bound");
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 0);
    assert!(q.is_broken());
    assert_eq!(q.stats.bad_loop, 1);
    assert_eq!((q.available(8), q.pending()), (0, 0));

    let r = Ring::new(8);
    let mut q = r.device();
    r.avail(0, true, buf(0), 10, 0, NEXT); // slot 1 never made available
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 0);
    assert!(q.is_broken());
    // A descriptor from the previous lap (wrong wrap counter) is not available.
    let r = Ring::new(8);
    let mut q = r.device();
    r.avail(0, false, buf(0), 10, 1, 0);
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 0);
    assert!(!q.is_broken());
}

/// A driver reuses a slot only after the device used it. Slot 0 offered
/// again (next lap's bits) while its chain is still in flight would put more
/// than `size` slots in flight (chains of several descriptors leave room in
/// the device's list of popped chains): the ring breaks, counted as a loop,
/// whether the offer comes alone, inside four simple descriptors, or at the
/// end of a chain that starts before the ring's end. Once used, it is fine.
#[test]
fn a_slot_offered_again_while_its_chain_is_in_flight_breaks_the_ring() {
    let mut b = Batch::new();
    // Seven chains over all eight slots in flight, then slot 0 alone.
    let r = Ring::new(8);
    let mut q = r.device();
    r.avail(1, true, buf(1), 10, 0, 0);
    r.avail(0, true, buf(0), 10, 0, NEXT);
    for s in 2..8u16 {
        r.avail(s, true, buf(s as u64), 10, s, 0);
    }
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 7);
    r.avail(0, false, buf(0), 10, 0, 0);
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 0);
    assert!(q.is_broken());
    assert_eq!(q.stats.bad_loop, 1);

    // A chain over slots 0..3, used, and one over 3..8, in flight; slots
    // 0..4 of the next lap offered as four simple descriptors: the three
    // that were used are taken, then the ring breaks at slot 3.
    let r = Ring::new(8);
    let mut q = r.device();
    for s in (0..8u16).rev() {
        let last = s == 2 || s == 7;
        r.avail(s, true, buf(s as u64), 10, s, if last { 0 } else { NEXT });
    }
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 2);
    q.add_used(2, 0);
    q.publish_used();
    for s in 0..4u16 {
        r.avail(s, false, buf(s as u64), 10, 10 + s, 0);
    }
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 3);
    assert_eq!(b.chains.iter().map(|c| c.head).collect::<Vec<_>>(), [10, 11, 12]);
    assert!(q.is_broken());
    assert_eq!(q.stats.bad_loop, 1);

    // Slots 0..6 in flight; a chain over slots 6, 7 and slot 0 of the next lap.
    let r = Ring::new(8);
    let mut q = r.device();
    for s in 0..6u16 {
        r.avail(s, true, buf(s as u64), 10, s, 0);
    }
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 6);
    r.avail(0, false, buf(0), 10, 9, 0);
    r.avail(7, true, buf(7), 10, 0, NEXT);
    r.avail(6, true, buf(6), 10, 0, NEXT);
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 0);
    assert!(q.is_broken());
    assert_eq!(q.stats.bad_loop, 1);

    // A well-behaved driver: slot 0 offered again after its chain was used.
    let r = Ring::new(8);
    let mut q = r.device();
    for s in 0..8u16 {
        r.avail(s, true, buf(s as u64), 10, s, 0);
    }
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 8);
    q.add_used(0, 0);
    q.publish_used();
    r.avail(0, false, buf(0), 10, 0, 0);
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1);
    assert!(!q.is_broken());
    assert_eq!(q.stats.bad_loop, 0);
}

#[test]
fn unpop_gives_chains_back_to_be_popped_again() {
    let r = Ring::new(8);
    let mut q = r.device();
    r.avail(1, true, buf(1), 10, 2, WRITE);
    r.avail(0, true, buf(0), 10, 1, WRITE | NEXT);
    r.avail(2, true, buf(2), 10, 3, WRITE);
    r.avail(3, true, buf(3), 10, 4, WRITE);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 8, Access::WriteOnly), 3);
    q.add_used(2, 20);
    q.unpop(2);
    assert_eq!(q.pop_batch(&mut b, 8, Access::WriteOnly), 2);
    assert_eq!(b.chains.iter().map(|c| c.head).collect::<Vec<_>>(), [3, 4]);
    q.add_used(3, 1);
    q.add_used(4, 1);
    q.publish_used();
    assert_eq!(r.used(0, true).map(|u| u.0), Some(2));
    assert_eq!(r.used(2, true).map(|u| u.0), Some(3));
    assert_eq!(r.used(3, true).map(|u| u.0), Some(4));
}

#[test]
fn driver_event_suppression_decides_interrupts() {
    let r = Ring::new(8);
    let mut q = r.device();
    let mut b = Batch::new();
    let mut one = |q: &mut PackedQueue, slot: u16, wrap: bool| {
        r.avail(slot, wrap, buf(0), 10, slot, WRITE);
        assert_eq!(q.pop_batch(&mut b, 8, Access::WriteOnly), 1);
        q.add_used(slot, 1);
        q.publish_used();
        q.needs_notify()
    };
    r.set_driver_event(RING_EVENT_FLAGS_ENABLE, 0);
    assert!(one(&mut q, 0, true));
    assert!(!q.needs_notify(), "nothing new since the last decision");
    r.set_driver_event(RING_EVENT_FLAGS_DISABLE, 0);
    assert!(!one(&mut q, 1, true));
    // Descriptor mode: an event for slot 4 of this lap.
    r.set_driver_event(RING_EVENT_FLAGS_DESC, 4 | 0x8000);
    assert!(!one(&mut q, 2, true));
    assert!(!one(&mut q, 3, true));
    assert!(one(&mut q, 4, true), "slot 4 used: the event fires");
    assert!(!one(&mut q, 5, true));
    // An event for slot 1 of the next lap (wrap 0) fires only there.
    r.set_driver_event(RING_EVENT_FLAGS_DESC, 1);
    assert!(!one(&mut q, 6, true));
    assert!(!one(&mut q, 7, true));
    assert!(!one(&mut q, 0, false));
    assert!(one(&mut q, 1, false));
}

#[test]
fn device_event_suppression_asks_for_kicks_and_rechecks() {
    let r = Ring::new(8);
    let mut q = r.device();
    q.disable_notifications();
    assert_eq!(r.device_event_flags(), RING_EVENT_FLAGS_DISABLE);
    assert!(!q.enable_notifications(), "nothing available");
    assert_eq!(r.device_event_flags(), RING_EVENT_FLAGS_ENABLE);
    r.avail(0, true, buf(0), 10, 0, 0);
    q.disable_notifications();
    assert!(q.enable_notifications(), "a buffer arrived: do not sleep");
}

#[test]
fn set_up_refuses_bad_rings_and_reads_the_base() {
    let r = Ring::new(8);
    let mk = |cfg: PackedConfig| PackedQueue::new(r.mem.clone(), cfg).err();
    let c = r.config(PACKED_BASE);
    assert_eq!(mk(PackedConfig { size: 0, ..c }), Some(SetupError::BadSize));
    assert_eq!(mk(PackedConfig { size: 32769, ..c }), Some(SetupError::BadSize));
    assert_eq!(mk(PackedConfig { size: 3, ..c }), None, "any size up to 32768");
    assert_eq!(mk(PackedConfig { desc: c.desc + 8, ..c }), Some(SetupError::Misaligned));
    assert_eq!(mk(PackedConfig { driver: c.driver + 2, ..c }), Some(SetupError::Misaligned));
    assert_eq!(mk(PackedConfig { device: c.desc + 16, ..c }), Some(SetupError::Overlap));
    assert_eq!(mk(PackedConfig { device: c.driver, ..c }), Some(SetupError::Overlap));
    assert_eq!(mk(PackedConfig { desc: MEM - 64, ..c }), Some(SetupError::NotMapped));
    assert_eq!(mk(PackedConfig { base: 8 | 0x8000, ..c }), Some(SetupError::BadBase));
    assert_eq!(mk(PackedConfig { base: 0x8000 | (9 << 16), ..c }), Some(SetupError::BadBase));
    // Upper half zero: used position = avail position.
    let q = PackedQueue::new(r.mem.clone(), PackedConfig { base: 5, ..c }).unwrap();
    assert_eq!(q.vring_base(), 5 | (5 << 16));
    let q = PackedQueue::new(r.mem.clone(), PackedConfig { base: 5 | 0x8000 | (3 << 16) | (1 << 31), ..c }).unwrap();
    assert_eq!(q.vring_base(), 5 | 0x8000 | ((3 | 0x8000) << 16));
    // Used ahead of avail (avail in the second lap, used still in the
    // first, more than a ring apart): no driver can be there.
    assert_eq!(mk(PackedConfig { base: 5 | (3 << 16) | (1 << 31), ..c }), Some(SetupError::BadBase));
}

/// Our driver side against our device side: chains of 1 to 4 buffers (or one
/// indirect table) with readable then writable parts, random batches on
/// both sides, many laps; the device "copies" readable bytes into the
/// writable part, and the driver checks every completion.
fn run_driver_against_device(size: u16, ops: &[(u8, u8, bool, u8)], in_order: bool) {
    let r = Ring::new(size);
    let features = FEATURES | if in_order { features::IN_ORDER } else { 0 };
    let dmem = r.driver_memory();
    let mut drv = PackedDriver::new(dmem, r.layout, features).unwrap();
    drv.set_indirect_pool(0x20000, 4).unwrap();
    let mut q = PackedQueue::new(r.mem.clone(), PackedConfig { features, ..r.config(PACKED_BASE) }).unwrap();
    let mut b = Batch::new();
    let mut expect = std::collections::VecDeque::new();
    let mut token = 0u64;
    for &(nbufs, batch, indirect, dev_batch) in ops {
        // Post up to `batch` chains.
        for _ in 0..batch {
            let n = 1 + nbufs as usize % 4;
            let nread = n / 2;
            let bufs: Vec<Buf> =
                (0..n).map(|k| Buf { addr: BUFS + ((token % 32) * 8 + k as u64) * 64, len: 8 + k as u32 }).collect();
            let res = if indirect {
                drv.add_indirect(&bufs[..nread], &bufs[nread..], token)
            } else {
                drv.add(&bufs[..nread], &bufs[nread..], token)
            };
            match res {
                Ok(_) => {
                    let wl: u32 = bufs[nread..].iter().map(|b| b.len).sum();
                    expect.push_back((token, wl));
                    token += 1;
                }
                Err(DriverError::NoSpace) => break,
                // More buffers than the ring has slots: refused, as it must be.
                Err(DriverError::BadChain) if !indirect && n > size as usize => break,
                Err(e) => panic!("{e}"),
            }
        }
        drv.publish();
        // The device completes up to `dev_batch` chains, writing all it may.
        let n = q.pop_batch(&mut b, dev_batch as usize, Access::ReadThenWrite);
        for c in b.chains.clone() {
            q.add_used(c.head, c.write_len);
        }
        q.publish_used();
        assert!(!q.is_broken());
        assert_eq!(q.stats.bad_chains, 0);
        let mut got = 0;
        while let Some(u) = drv.pop_used().unwrap() {
            let (t, wl) = expect.pop_front().expect("a completion for a chain in flight");
            assert_eq!((u.token, u.len), (t, wl), "completions come back in order with their lengths");
            got += 1;
        }
        assert_eq!(got, n);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn our_driver_and_device_agree(size in 1u16..40, in_order in any::<bool>(),
                                   ops in prop::collection::vec((any::<u8>(), 0u8..12, any::<bool>(), 0u8..12), 1..200)) {
        run_driver_against_device(size, &ops, in_order);
    }

    /// Whatever the ring holds: no panic, segments inside guest memory, and
    /// every chain either returned or completed and counted.
    #[test]
    fn hostile_rings_never_panic(size in 1u16..32,
                                 descs in prop::collection::vec((prop_oneof![8 => BUFS..MEM - 0x1000, 1 => any::<u64>()],
                                                                 prop_oneof![8 => 0u32..2048, 1 => any::<u32>()],
                                                                 any::<u16>(), any::<u16>()), 32),
                                 rounds in 1usize..6, access in 0u8..3) {
        let r = Ring::new(size);
        let mut q = r.device();
        let access = [Access::ReadOnly, Access::WriteOnly, Access::ReadThenWrite][access as usize];
        let mut b = Batch::new();
        for round in 0..rounds {
            for (s, &(addr, len, id, flags)) in descs.iter().take(size as usize).enumerate() {
                // Flip the lap bits every other round so later laps see new descriptors.
                let f = if round % 2 == 1 { flags ^ 0x8080 } else { flags };
                r.desc_at(r.layout.desc + 16 * s as u64, addr, len, id, f);
            }
            let before = q.stats.chains + q.stats.bad_chains;
            let n = q.pop_batch(&mut b, 64, access);
            for c in &b.chains {
                for s in b.readable(c).segs().iter().chain(b.writable(c).segs()) {
                    let (p, base) = (s.host_addr() as u64, r.map.host_range().0 as u64);
                    prop_assert!(p >= base && p + s.len() as u64 <= base + MEM);
                }
            }
            let heads: Vec<u16> = b.chains.iter().map(|c| c.head).collect();
            for h in heads {
                q.add_used(h, 0);
            }
            q.publish_used();
            prop_assert_eq!(q.stats.chains + q.stats.bad_chains - before >= n as u64, true);
            let _ = q.needs_notify();
            let _ = q.enable_notifications();
        }
    }
}

#[test]
fn with_in_order_the_driver_takes_one_used_descriptor_for_a_whole_batch() {
    // The spec lets an IN_ORDER device write one used descriptor, with the
    // id of the batch's last buffer, and skip the rest.
    let r = Ring::new(8);
    let dmem = r.driver_memory();
    let mut drv = PackedDriver::new(dmem, r.layout, FEATURES | features::IN_ORDER).unwrap();
    let mut ids = Vec::new();
    for t in 0..3u64 {
        ids.push(drv.add(&[], &[Buf { addr: buf(t), len: 100 + t as u32 }], t).unwrap());
    }
    // A two-buffer chain next: slots 3 and 4.
    ids.push(drv.add(&[], &[Buf { addr: buf(3), len: 10 }, Buf { addr: buf(4), len: 10 }], 3).unwrap());
    drv.publish();
    // Device: one used descriptor at slot 0 naming the third buffer.
    let used = VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED | WRITE;
    r.desc_at(r.layout.desc, 0, 7, ids[2], used);
    let got: Vec<(u64, u32)> = std::iter::from_fn(|| drv.pop_used().unwrap()).map(|u| (u.token, u.len)).collect();
    assert_eq!(got, [(0, 100), (1, 101), (2, 7)], "skipped buffers count as wholly used");
    // The next used descriptor goes at slot 3 (after the skipped ones).
    r.desc_at(r.layout.desc + 3 * 16, 0, 20, ids[3], used);
    assert_eq!(drv.pop_used().unwrap().map(|u| (u.token, u.len)), Some((3, 20)));
    assert_eq!(drv.in_flight(), 0);
    assert_eq!(drv.used_position(), (5, true));
}

#[test]
fn the_driver_refuses_a_used_id_that_is_not_in_flight() {
    let r = Ring::new(4);
    let dmem = r.driver_memory();
    let mut drv = PackedDriver::new(dmem, r.layout, FEATURES).unwrap();
    drv.add(&[], &[Buf { addr: buf(0), len: 10 }], 0).unwrap();
    drv.publish();
    let used = VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED;
    r.desc_at(r.layout.desc, 0, 0, 3, used);
    assert_eq!(drv.pop_used(), Err(DriverError::UsedNotInFlight));
    r.desc_at(r.layout.desc, 0, 0, 999, used);
    assert_eq!(drv.pop_used(), Err(DriverError::BadUsedId));
}

#[test]
fn four_simple_descriptors_are_taken_together_and_anything_else_falls_back() {
    let r = Ring::new(16);
    let mut q = r.device();
    // Slots 0-3 simple; 4-7 with a bad address at 6; 8-11 simple; 12-13 a chain.
    for s in 0..12u16 {
        let addr = if s == 6 { 1 << 40 } else { buf(s as u64) };
        r.avail(s, true, addr, 64, 100 + s, WRITE);
    }
    r.avail(13, true, buf(13), 64, 113, WRITE);
    r.avail(12, true, buf(12), 64, 0, WRITE | NEXT);
    let mut b = Batch::new();
    // Slots 4, 5 come before the bad chain: the batch ends there.
    assert_eq!(q.pop_batch(&mut b, 32, Access::WriteOnly), 6);
    assert!(b.ended_before_bad);
    assert_eq!(q.stats.batch4, 1, "slots 0-3 as one group; 4-7 fell back");
    let heads: Vec<u16> = b.chains.iter().map(|c| c.head).collect();
    assert_eq!(heads, [100, 101, 102, 103, 104, 105]);
    assert_eq!(b.writable(&b.chains[2]).segs()[0].host_addr(), r.host(buf(2)));
    for c in b.chains.clone() {
        q.add_used(c.head, 64);
    }
    // Slot 6 is completed empty; 7-10 form a group; 11 alone; 12-13 a chain.
    assert_eq!(q.pop_batch(&mut b, 32, Access::WriteOnly), 6);
    assert_eq!(q.stats.bad_address, 1);
    assert_eq!(q.stats.batch4, 2);
    let heads: Vec<u16> = b.chains.iter().map(|c| c.head).collect();
    assert_eq!(heads, [107, 108, 109, 110, 111, 113]);
    assert_eq!(b.writable(&b.chains[5]).segs().len(), 2);
    // Read-only access on a writable group: no group, and each is refused.
    let r = Ring::new(8);
    let mut q = r.device();
    for s in 0..4u16 {
        r.avail(s, true, buf(s as u64), 64, s, WRITE);
    }
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 0);
    assert_eq!((q.stats.batch4, q.stats.bad_direction), (0, 4));
}
