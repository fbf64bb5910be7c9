//! Driver side of a packed virtqueue (virtio 1.2, section 2.8), with the
//! same calls as `SplitDriver`.
//!
//! Buffer ids are the driver's own (0..size); a chain's buffers are kept in
//! private memory so `repost` can write its descriptors again into the next
//! ring slots. As on the device side, a batch of chains becomes visible with
//! one store: the flags of its first descriptor, written last by `publish`.
//! Whatever the device writes is checked: a used id that is not in flight is
//! an error, never a panic.

use crate::inflight::{self, InFlight, UsedRing};
use crate::{Buf, DriverError, DriverMemory, DriverStats, RingLayout, Used};
use std::sync::atomic::{fence, Ordering};
use virtq::ring::{
    desc_table_size, features, DESC_SIZE, MAX_QUEUE_SIZE, RING_EVENT_FLAGS_DESC, RING_EVENT_FLAGS_DISABLE,
    RING_EVENT_FLAGS_ENABLE, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_PACKED_DESC_F_AVAIL,
    VRING_PACKED_DESC_F_USED,
};

/// A packed descriptor as laid out in the ring (host order here).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackedDesc {
    /// Guest-physical buffer address.
    pub addr: u64,
    /// Buffer length.
    pub len: u32,
    /// Buffer id.
    pub id: u16,
    /// VRING_DESC_F_* and the AVAIL/USED bits.
    pub flags: u16,
}

/// What an id's chain is made of, to write it into the ring at each post
/// (its in-flight state is in the shared `InFlight`).
#[derive(Clone, Default)]
struct Contents {
    /// The buffers (device-writable flag with each); empty for indirect.
    bufs: Vec<(Buf, bool)>,
    /// Indirect table address and length, when the chain is indirect.
    table: Option<(u64, u32)>,
}

#[derive(Clone, Copy)]
struct IndirectPool {
    gpa: u64,
    host: *mut u8,
    max: u16,
}

/// The driver side of one packed virtqueue.
pub struct PackedDriver {
    mem: DriverMemory,
    layout: RingLayout,
    size: u16,
    ring: *mut u8,
    driver_evt: *mut u8,
    device_evt: *mut u8,
    event_idx: bool,
    /// Chains by buffer id: in flight, kept, tokens, IN_ORDER batches.
    chains: InFlight,
    contents: Vec<Contents>,
    free_ids: Vec<u16>,
    /// Free ring slots.
    num_free: u16,
    next_avail: u16,
    avail_wrap: bool,
    /// First descriptor of the unpublished batch and its flags.
    pending_first: Option<(u16, u16)>,
    /// Avail position (linear, mod 2 * size) as last published / kicked.
    published: u32,
    kicked_at: u32,
    /// Ring slot of the next used descriptor to read, past the chains taken.
    next_used: u16,
    used_wrap: bool,
    indirect: Option<IndirectPool>,
    /// Counters.
    pub stats: DriverStats,
}

// SAFETY: the ring pointers point into `mem`'s mapping, kept alive by its
// Arc for as long as the driver lives; a driver queue is used by one thread
// at a time (it is not Sync), so moving it to another thread is sound.
unsafe impl Send for PackedDriver {}

const DESC_LEN: usize = 8;
const DESC_ID: usize = 12;
const DESC_FLAGS: usize = 14;
const EVT_OFF_WRAP: usize = 0;
const EVT_FLAGS: usize = 2;

impl PackedDriver {
    /// A driver queue over a packed ring at `layout` in `mem`, which it
    /// zeroes. `features` are the negotiated features (EVENT_IDX, IN_ORDER).
    pub fn new(mem: DriverMemory, layout: RingLayout, features: u64) -> Result<PackedDriver, DriverError> {
        let n = layout.size;
        if n == 0 || n > MAX_QUEUE_SIZE {
            return Err(DriverError::BadSize);
        }
        if !layout.desc.is_multiple_of(16) || !layout.avail.is_multiple_of(4) || !layout.used.is_multiple_of(4) {
            return Err(DriverError::Misaligned);
        }
        let dl = desc_table_size(n);
        let ring = mem.host(layout.desc, dl).ok_or(DriverError::NotMapped)?;
        let driver_evt = mem.host(layout.avail, 4).ok_or(DriverError::NotMapped)?;
        let device_evt = mem.host(layout.used, 4).ok_or(DriverError::NotMapped)?;
        // The accesses below assume the host addresses are as aligned as the
        // guest-physical ones (a gpa_base at an odd offset breaks that).
        if !(ring as usize).is_multiple_of(16)
            || !(driver_evt as usize).is_multiple_of(4)
            || !(device_evt as usize).is_multiple_of(4)
        {
            return Err(DriverError::Misaligned);
        }
        // SAFETY: the three ranges were bounds-checked against the mapping
        // above; the driver owns the ring, nobody else writes it yet.
        unsafe {
            std::ptr::write_bytes(ring, 0, dl as usize);
            std::ptr::write_bytes(driver_evt, 0, 4);
            std::ptr::write_bytes(device_evt, 0, 4);
        }
        Ok(PackedDriver {
            mem,
            layout,
            size: n,
            ring,
            driver_evt,
            device_evt,
            event_idx: features & features::EVENT_IDX != 0,
            chains: InFlight::new(n, features & features::IN_ORDER != 0),
            contents: vec![Contents::default(); n as usize],
            free_ids: (0..n).rev().collect(),
            num_free: n,
            next_avail: 0,
            avail_wrap: true,
            pending_first: None,
            published: 0,
            kicked_at: 0,
            next_used: 0,
            used_wrap: true,
            indirect: None,
            stats: DriverStats::default(),
        })
    }

    /// Gives the queue indirect tables (`size * max_per_chain * 16` bytes at `gpa`).
    pub fn set_indirect_pool(&mut self, gpa: u64, max_per_chain: u16) -> Result<(), DriverError> {
        if max_per_chain == 0 {
            return Err(DriverError::BadChain);
        }
        if !gpa.is_multiple_of(16) {
            return Err(DriverError::Misaligned);
        }
        let bytes = self.size as u64 * max_per_chain as u64 * DESC_SIZE;
        let host = self.mem.host(gpa, bytes).ok_or(DriverError::NotMapped)?;
        self.indirect = Some(IndirectPool { gpa, host, max: max_per_chain });
        Ok(())
    }

    /// The ring layout (`avail` = driver area, `used` = device area).
    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    /// Queue size.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// The driver memory.
    pub fn memory(&self) -> &DriverMemory {
        &self.mem
    }

    /// Free ring slots.
    pub fn num_free(&self) -> u16 {
        self.num_free
    }

    /// Chains made available and not yet returned by the device.
    pub fn in_flight(&self) -> u16 {
        self.chains.count()
    }

    /// Next ring slot the driver will write and its wrap counter.
    pub fn avail_position(&self) -> (u16, bool) {
        (self.next_avail, self.avail_wrap)
    }

    /// Next ring slot where the device's used descriptor is expected (past
    /// the whole batch an IN_ORDER used descriptor stood for, even while
    /// some of its chains are still to be taken).
    pub fn used_position(&self) -> (u16, bool) {
        let next = self.next_used as u32 + self.chains.pending_ndesc();
        if next >= self.size as u32 {
            ((next - self.size as u32) as u16, !self.used_wrap)
        } else {
            (next as u16, self.used_wrap)
        }
    }

    /// Host pointers of the descriptor ring, driver area and device area.
    pub fn ring_ptrs(&self) -> (*mut u8, *mut u8, *mut u8) {
        (self.ring, self.driver_evt, self.device_evt)
    }

    /// Writes ring slot `i` (modulo the size) raw, flags last (for tests
    /// that build hostile rings).
    pub fn write_desc(&mut self, i: u16, d: PackedDesc) {
        let slot = i % self.size;
        self.write_body(slot, d.addr, d.len, d.id);
        fence(Ordering::Release);
        self.store16(self.ring, slot as usize * 16 + DESC_FLAGS, d.flags);
    }

    /// Reads ring slot `i` (modulo the size).
    pub fn read_desc(&self, i: u16) -> PackedDesc {
        let base = (i % self.size) as usize * 16;
        // SAFETY: base + 16 <= size * 16, the ring's translated length; the
        // ring is 16-aligned (checked at set-up), so every field is aligned.
        unsafe {
            PackedDesc {
                addr: u64::from_le(std::ptr::read_volatile(self.ring.add(base) as *const u64)),
                len: u32::from_le(std::ptr::read_volatile(self.ring.add(base + DESC_LEN) as *const u32)),
                id: u16::from_le(std::ptr::read_volatile(self.ring.add(base + DESC_ID) as *const u16)),
                flags: u16::from_le(std::ptr::read_volatile(self.ring.add(base + DESC_FLAGS) as *const u16)),
            }
        }
    }

    /// AVAIL/USED bits that mark a descriptor available in the current lap.
    pub fn avail_bits(wrap: bool) -> u16 {
        if wrap {
            VRING_PACKED_DESC_F_AVAIL
        } else {
            VRING_PACKED_DESC_F_USED
        }
    }

    #[inline]
    fn load16(&self, base: *mut u8, off: usize) -> u16 {
        // SAFETY: callers pass a base translated with its length at set-up and
        // an in-range, 2-aligned offset (bases are at least 4-aligned).
        u16::from_le(unsafe { std::ptr::read_volatile(base.add(off) as *const u16) })
    }

    #[inline]
    fn store16(&self, base: *mut u8, off: usize, v: u16) {
        // SAFETY: as load16.
        unsafe { std::ptr::write_volatile(base.add(off) as *mut u16, v.to_le()) }
    }

    fn linear(&self, idx: u16, wrap: bool) -> u32 {
        idx as u32 + if wrap { 0 } else { self.size as u32 }
    }

    // ---- adding chains ----------------------------------------------------

    /// Takes a free id for a chain of `readable` then `writable` buffers
    /// (direct, or behind the indirect `table`).
    fn alloc_id(
        &mut self,
        readable: &[Buf],
        writable: &[Buf],
        table: Option<(u64, u32)>,
        token: u64,
    ) -> Result<u16, DriverError> {
        let id = self.free_ids.pop().ok_or(DriverError::NoSpace)?;
        let c = &mut self.contents[id as usize];
        c.bufs.clear();
        c.bufs.extend(readable.iter().map(|b| (*b, false)).chain(writable.iter().map(|b| (*b, true))));
        c.table = table;
        let write_len = writable.iter().map(|b| b.len).fold(0u32, u32::wrapping_add);
        let ndesc = if table.is_some() { 1 } else { c.bufs.len() as u16 };
        // A skipped in-order chain counts as wholly used: its writable bytes.
        self.chains.allocate(id, ndesc, write_len, token);
        Ok(id)
    }

    /// Gives `id` back (its bookkeeping is freed separately).
    fn release_id(&mut self, id: u16) {
        let c = &mut self.contents[id as usize];
        c.bufs.clear();
        c.table = None;
        self.free_ids.push(id);
    }

    fn free_id(&mut self, id: u16) {
        self.chains.free(id);
        self.release_id(id);
    }

    /// Makes a chain of `readable` then `writable` buffers available (not yet
    /// published: call `publish`). Returns its buffer id.
    pub fn add(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        let id = self.prepare(readable, writable, token)?;
        if let Err(e) = self.post(id) {
            self.free_id(id);
            return Err(e);
        }
        Ok(id)
    }

    /// Keeps a chain aside for `repost` (fixed buffers), like `SplitDriver::prepare`.
    pub fn prepare(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        let total = readable.len() + writable.len();
        if total == 0 || total > self.size as usize {
            return Err(DriverError::BadChain);
        }
        self.alloc_id(readable, writable, None, token)
    }

    /// Like `add`, with the buffers in this id's indirect table (one ring slot).
    pub fn add_indirect(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        let pool = self.indirect.ok_or(DriverError::NoIndirect)?;
        let total = readable.len() + writable.len();
        if total == 0 || total > pool.max as usize {
            return Err(DriverError::BadChain);
        }
        let id = *self.free_ids.last().ok_or(DriverError::NoSpace)?;
        let base = id as usize * pool.max as usize * 16;
        for (i, (b, w)) in readable.iter().map(|b| (b, false)).chain(writable.iter().map(|b| (b, true))).enumerate() {
            // SAFETY: id < size and i < max: the entry lies inside the pool
            // (size * max * 16 bytes, checked in set_indirect_pool), and is
            // 16-aligned (the pool is), so every field is aligned.
            unsafe {
                let p = pool.host.add(base + i * 16);
                std::ptr::write_volatile(p as *mut u64, b.addr.to_le());
                std::ptr::write_volatile(p.add(8) as *mut u32, b.len.to_le());
                std::ptr::write_volatile(p.add(12) as *mut u16, 0);
                std::ptr::write_volatile(p.add(14) as *mut u16, if w { VRING_DESC_F_WRITE } else { 0 }.to_le());
            }
        }
        let table = (pool.gpa + base as u64, (total * 16) as u32);
        let id = self.alloc_id(readable, writable, Some(table), token)?;
        if let Err(e) = self.post(id) {
            self.free_id(id);
            return Err(e);
        }
        Ok(id)
    }

    /// Writes chain `id` into the next ring slots.
    fn post(&mut self, id: u16) -> Result<(), DriverError> {
        let c = &self.contents[id as usize];
        let (table, n) = (c.table, c.bufs.len());
        let ndesc = if table.is_some() { 1 } else { n as u16 };
        if ndesc > self.num_free {
            return Err(DriverError::NoSpace);
        }
        let bits = Self::avail_bits(self.avail_wrap);
        let first = self.next_avail;
        let first_flags;
        if let Some((addr, len)) = table {
            first_flags = bits | VRING_DESC_F_INDIRECT;
            self.write_body(first, addr, len, id);
            self.next_avail += 1;
            if self.next_avail == self.size {
                self.next_avail = 0;
                self.avail_wrap = !self.avail_wrap;
            }
        } else {
            let mut ff = 0;
            for k in 0..n {
                let (b, w) = self.contents[id as usize].bufs[k];
                let mut f = Self::avail_bits(self.avail_wrap);
                if w {
                    f |= VRING_DESC_F_WRITE;
                }
                if k + 1 < n {
                    f |= VRING_DESC_F_NEXT;
                }
                let slot = self.next_avail;
                self.write_body(slot, b.addr, b.len, id);
                if k == 0 {
                    ff = f;
                } else {
                    fence(Ordering::Release);
                    self.store16(self.ring, slot as usize * 16 + DESC_FLAGS, f);
                }
                self.next_avail += 1;
                if self.next_avail == self.size {
                    self.next_avail = 0;
                    self.avail_wrap = !self.avail_wrap;
                }
            }
            first_flags = ff;
        }
        // The batch's first chain head is published by `publish`; later heads
        // can be written now (the device reaches them only through it).
        if self.pending_first.is_none() {
            self.pending_first = Some((first, first_flags));
        } else {
            fence(Ordering::Release);
            self.store16(self.ring, first as usize * 16 + DESC_FLAGS, first_flags);
        }
        self.num_free -= ndesc;
        self.chains.posted(id);
        self.stats.added += 1;
        Ok(())
    }

    #[inline]
    fn write_body(&mut self, slot: u16, addr: u64, len: u32, id: u16) {
        let base = slot as usize * 16;
        // SAFETY: slot < size, so the 14 bytes lie inside the ring; the ring
        // is 16-aligned (checked at set-up), so every field is aligned.
        unsafe {
            std::ptr::write_volatile(self.ring.add(base) as *mut u64, addr.to_le());
            std::ptr::write_volatile(self.ring.add(base + DESC_LEN) as *mut u32, len.to_le());
            std::ptr::write_volatile(self.ring.add(base + DESC_ID) as *mut u16, id.to_le());
        }
    }

    /// Makes a kept chain available again.
    #[inline]
    pub fn repost(&mut self, id: u16) -> Result<(), DriverError> {
        self.chains.kept(id)?;
        self.post(id)
    }

    /// Changes the length of a kept single-buffer chain before reposting it.
    #[inline]
    pub fn set_kept_len(&mut self, id: u16, len: u32) -> Result<(), DriverError> {
        self.chains.kept(id)?;
        let c = &mut self.contents[id as usize];
        if c.bufs.len() != 1 || c.table.is_some() {
            return Err(DriverError::NotKept);
        }
        c.bufs[0].0.len = len;
        if c.bufs[0].1 {
            self.chains.set_skip_len(id, len);
        }
        Ok(())
    }

    /// Returns a kept chain's id.
    pub fn free_kept(&mut self, id: u16) -> Result<(), DriverError> {
        self.chains.kept(id)?;
        self.free_id(id);
        Ok(())
    }

    /// Makes everything added since the last publish visible with one flags
    /// store. Returns whether there was anything.
    #[inline]
    pub fn publish(&mut self) -> u16 {
        match self.pending_first.take() {
            Some((slot, flags)) => {
                fence(Ordering::Release);
                self.store16(self.ring, slot as usize * 16 + DESC_FLAGS, flags);
                self.published = self.linear(self.next_avail, self.avail_wrap);
                self.stats.publishes += 1;
                1
            }
            None => 0,
        }
    }

    /// Should the device be kicked for what was published since the last call?
    #[inline]
    pub fn needs_kick(&mut self) -> bool {
        let new = self.published;
        let old = self.kicked_at;
        if new == old {
            return false;
        }
        // Our flags store must be visible before we read the device's area.
        fence(Ordering::SeqCst);
        self.kicked_at = new;
        let kick = match self.load16(self.device_evt, EVT_FLAGS) & 3 {
            RING_EVENT_FLAGS_DISABLE => false,
            RING_EVENT_FLAGS_DESC if self.event_idx => {
                let ow = self.load16(self.device_evt, EVT_OFF_WRAP);
                let (idx, wrap) = (ow & 0x7fff, ow & 0x8000 != 0);
                let m = 2 * self.size as u32;
                let e = self.linear(idx.min(self.size - 1), wrap);
                (new + m - e - 1) % m < (new + m - old) % m
            }
            _ => true,
        };
        if kick {
            self.stats.kicks += 1;
        }
        kick
    }

    /// `publish` then `needs_kick`.
    #[inline]
    pub fn publish_and_check_kick(&mut self) -> bool {
        self.publish();
        self.needs_kick()
    }

    // ---- taking used descriptors ----------------------------------------------

    /// Whether the descriptor at the used position is marked used in the
    /// current lap.
    #[inline]
    fn used_visible(&self) -> bool {
        let f = self.load16(self.ring, self.next_used as usize * 16 + DESC_FLAGS);
        let a = f & VRING_PACKED_DESC_F_AVAIL != 0;
        let u = f & VRING_PACKED_DESC_F_USED != 0;
        a == self.used_wrap && u == self.used_wrap
    }

    /// Whether a used descriptor is ready (1) or not (0).
    pub fn used_ready(&mut self) -> Result<u16, DriverError> {
        inflight::used_ready(self)
    }

    /// Takes the next completion and frees its id.
    pub fn pop_used(&mut self) -> Result<Option<Used>, DriverError> {
        inflight::take_used(self, false)
    }

    /// Takes the next completion, keeping the chain for `repost`.
    pub fn pop_used_keep(&mut self) -> Result<Option<Used>, DriverError> {
        inflight::take_used(self, true)
    }

    /// Takes up to `out.len()` completions. On a device error the ones taken
    /// so far are still in `out[..n]` and the error is returned.
    #[inline]
    pub fn pop_used_batch(&mut self, out: &mut [Used], keep: bool) -> Result<usize, DriverError> {
        inflight::pop_used_batch(self, out, keep)
    }

    // ---- interrupt suppression ----------------------------------------------

    /// Asks the device for a call on the next completion; true if one is
    /// already there.
    pub fn enable_notifications(&mut self) -> bool {
        self.store16(self.driver_evt, EVT_FLAGS, RING_EVENT_FLAGS_ENABLE);
        fence(Ordering::SeqCst);
        self.chains.batch_pending() || (self.chains.count() != 0 && self.used_visible())
    }

    /// Asks the device not to call.
    pub fn disable_notifications(&mut self) {
        self.store16(self.driver_evt, EVT_FLAGS, RING_EVENT_FLAGS_DISABLE);
    }

    /// Nothing to refresh: DISABLE does not expire on a packed ring.
    #[inline]
    pub fn refresh_disabled(&mut self) {}
}

/// The packed used ring: the device writes a used descriptor over the slot
/// of the chain's first descriptor (with IN_ORDER, one for a whole batch,
/// in the first slot of the batch) and marks it used in its lap; the chains
/// taken move the used position by their ring slots.
impl UsedRing for PackedDriver {
    #[inline(always)]
    fn chains(&mut self) -> &mut InFlight {
        &mut self.chains
    }

    #[inline(always)]
    fn stats_mut(&mut self) -> &mut DriverStats {
        &mut self.stats
    }

    #[inline(always)]
    fn used_count(&mut self, in_flight: u16, batch_pending: bool) -> Result<u16, DriverError> {
        // The rest of a batch is known to be used; otherwise one descriptor
        // at a time.
        Ok((batch_pending || (in_flight != 0 && self.used_visible())) as u16)
    }

    #[inline(always)]
    fn read_used(&self) -> (u16, u32) {
        // The id and length are read after the flags that said "used".
        fence(Ordering::Acquire);
        let base = self.next_used as usize * 16;
        // SAFETY: next_used < size, so the fields lie inside the ring, which
        // is 16-aligned (checked at set-up): both are aligned.
        let (len, id) = unsafe {
            (
                std::ptr::read_volatile(self.ring.add(base + DESC_LEN) as *const u32),
                std::ptr::read_volatile(self.ring.add(base + DESC_ID) as *const u16),
            )
        };
        (u16::from_le(id), u32::from_le(len))
    }

    #[inline(always)]
    fn step_used(&mut self, ndesc: u16) {
        let next = self.next_used as u32 + ndesc as u32;
        if next >= self.size as u32 {
            self.used_wrap = !self.used_wrap;
            self.next_used = (next - self.size as u32) as u16;
        } else {
            self.next_used = next as u16;
        }
    }

    #[inline(always)]
    fn retire(&mut self, id: u16, ndesc: u16, keep: bool) {
        self.num_free += ndesc;
        if !keep {
            self.release_id(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SharedMemory;
    use std::sync::Arc;

    fn setup(size: u16, features: u64) -> PackedDriver {
        let mem = DriverMemory::new(Arc::new(SharedMemory::anonymous(1 << 16).unwrap()), 0);
        PackedDriver::new(mem, RingLayout::packed_at(0, size), features).unwrap()
    }

    /// Marks ring slot `slot` used in lap `wrap` for buffer `id`, as a device would.
    fn device_used(q: &mut PackedDriver, slot: u16, wrap: bool, id: u16, len: u32) {
        let bits = if wrap { VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED } else { 0 };
        q.write_desc(slot, PackedDesc { addr: 0, len, id, flags: bits });
    }

    #[test]
    fn chains_take_their_slots_and_come_back_across_laps() {
        let mut q = setup(4, 0);
        let a = q.add(&[Buf { addr: 0x1000, len: 8 }], &[Buf { addr: 0x2000, len: 16 }], 1).unwrap();
        let b = q.add(&[], &[Buf { addr: 0x3000, len: 32 }], 2).unwrap();
        assert_eq!((q.num_free(), q.in_flight()), (1, 2));
        assert_eq!(q.add(&[Buf { addr: 0, len: 1 }, Buf { addr: 0, len: 1 }], &[], 3), Err(DriverError::NoSpace));
        assert_eq!(q.publish(), 1);
        assert_eq!(q.used_ready(), Ok(0));
        // Out of order: b (slot 2) first, at the used position.
        device_used(&mut q, 0, true, b, 5);
        assert_eq!(q.pop_used(), Ok(Some(Used { id: b, len: 5, token: 2 })));
        assert_eq!((q.used_position(), q.num_free()), ((1, true), 2));
        device_used(&mut q, 1, true, a, 7);
        assert_eq!(q.pop_used_keep(), Ok(Some(Used { id: a, len: 7, token: 1 })));
        assert_eq!((q.used_position(), q.num_free(), q.in_flight()), ((3, true), 4, 0));
        // The kept chain goes again, across the end of the ring.
        q.repost(a).unwrap();
        assert_eq!(q.repost(a), Err(DriverError::NotKept), "in flight");
        q.publish();
        assert_eq!(q.avail_position(), (1, false));
        device_used(&mut q, 3, true, a, 9);
        assert_eq!(q.pop_used(), Ok(Some(Used { id: a, len: 9, token: 1 })));
        assert_eq!(q.used_position(), (1, false));
        assert_eq!(q.free_kept(a), Err(DriverError::NotKept), "freed by pop_used");
    }

    #[test]
    fn an_in_order_batch_keeps_its_used_position_while_taken() {
        let mut q = setup(8, features::IN_ORDER);
        for t in 0..3u64 {
            q.add(&[], &[Buf { addr: 0x1000, len: 10 }, Buf { addr: 0x2000, len: 20 }], t).unwrap();
        }
        q.publish();
        // One used descriptor for the first two chains (slots 0..4).
        device_used(&mut q, 0, true, 1, 3);
        assert_eq!(q.pop_used().unwrap().map(|u| (u.id, u.len)), Some((0, 30)));
        assert_eq!(q.used_position(), (4, true), "past the whole batch");
        assert_eq!(q.used_ready(), Ok(1));
        assert!(q.enable_notifications(), "the rest of the batch is there");
        assert_eq!(q.pop_used().unwrap().map(|u| (u.id, u.len)), Some((1, 3)));
        assert_eq!((q.used_position(), q.used_ready()), ((4, true), Ok(0)));
    }
}
