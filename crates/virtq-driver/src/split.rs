//! Driver side of a split virtqueue (virtio 1.2, section 2.7), over memory
//! the driver owns.
//!
//! Chains are linked through a private copy of the descriptors' `next`
//! fields (the free list lives there too); a chain's head is its id. The
//! used ring is read through used.idx, once per batch.

use crate::inflight::{self, InFlight, UsedRing};
use crate::raw;
use crate::{Buf, DriverError, DriverMemory, DriverStats, RingLayout, Used};
use std::sync::atomic::{fence, AtomicU16, Ordering};
use virtq::ring::{
    avail_ring_size, desc_table_size, features, need_event, used_ring_size, DESC_SIZE, MAX_QUEUE_SIZE,
    VRING_AVAIL_F_NO_INTERRUPT, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
};

/// A split-ring descriptor as the spec lays it out (values in host order here).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// Guest-physical buffer address.
    pub addr: u64,
    /// Buffer length.
    pub len: u32,
    /// VRING_DESC_F_* flags.
    pub flags: u16,
    /// Next descriptor when flags has NEXT.
    pub next: u16,
}

const AVAIL_FLAGS: usize = 0;
const AVAIL_IDX: usize = 2;
const AVAIL_RING: usize = 4;
const USED_FLAGS: usize = 0;
const USED_IDX: usize = 2;
const USED_RING: usize = 4;

/// Pool of per-head indirect tables: head `h` owns the `max` descriptors at
/// `gpa + h * max * 16`.
#[derive(Clone, Copy)]
struct IndirectPool {
    gpa: u64,
    host: *mut u8,
    max: u16,
}

/// The driver side of one split virtqueue.
pub struct SplitDriver {
    mem: DriverMemory,
    layout: RingLayout,
    mask: u16,
    desc: *mut u8,
    avail: *mut u8,
    used: *mut u8,
    event_idx: bool,
    /// Chains by head: in flight, kept, tokens, IN_ORDER batches.
    chains: InFlight,
    /// Private copy of the `next` links of allocated chains and the free list.
    next: Vec<u16>,
    /// Last descriptor of each allocated chain, by head (to splice it back
    /// into the free list).
    tails: Vec<u16>,
    free_head: u16,
    num_free: u16,
    /// Shadow avail.idx: entries written, maybe not yet published.
    avail_shadow: u16,
    /// avail.idx as last stored.
    avail_published: u16,
    /// avail.idx as of the last kick decision.
    kicked_at: u16,
    /// Next used entry to take.
    last_used: u16,
    /// used.idx as last read (entries below it are visible).
    used_seen: u16,
    avail_flags: u16,
    calls_disabled: bool,
    indirect: Option<IndirectPool>,
    /// Counters.
    pub stats: DriverStats,
}

// SAFETY: the ring pointers point into `mem`'s mapping, kept alive by its
// Arc for as long as the driver lives; a driver queue is used by one thread
// at a time (it is not Sync), so moving it to another thread is sound.
unsafe impl Send for SplitDriver {}

impl SplitDriver {
    /// A driver queue over rings at `layout` in `mem`, which it zeroes
    /// (a fresh ring: all indexes 0). `features` are the negotiated device
    /// features (EVENT_IDX and IN_ORDER matter here).
    pub fn new(mem: DriverMemory, layout: RingLayout, features: u64) -> Result<SplitDriver, DriverError> {
        let n = layout.size;
        if n == 0 || n > MAX_QUEUE_SIZE || !n.is_power_of_two() {
            return Err(DriverError::BadSize);
        }
        if !layout.desc.is_multiple_of(16) || !layout.avail.is_multiple_of(2) || !layout.used.is_multiple_of(4) {
            return Err(DriverError::Misaligned);
        }
        let (dl, al, ul) = (desc_table_size(n), avail_ring_size(n), used_ring_size(n));
        let desc = mem.host(layout.desc, dl).ok_or(DriverError::NotMapped)?;
        let avail = mem.host(layout.avail, al).ok_or(DriverError::NotMapped)?;
        let used = mem.host(layout.used, ul).ok_or(DriverError::NotMapped)?;
        // The accesses below assume the host addresses are as aligned as the
        // guest-physical ones (a gpa_base at an odd offset breaks that).
        if !(desc as usize).is_multiple_of(16)
            || !(avail as usize).is_multiple_of(2)
            || !(used as usize).is_multiple_of(4)
        {
            return Err(DriverError::Misaligned);
        }
        // SAFETY: the three ranges were bounds-checked against the mapping
        // above; the driver owns the rings, nobody else writes them yet.
        unsafe {
            std::ptr::write_bytes(desc, 0, dl as usize);
            std::ptr::write_bytes(avail, 0, al as usize);
            std::ptr::write_bytes(used, 0, ul as usize);
        }
        Ok(SplitDriver {
            mem,
            layout,
            mask: n - 1,
            desc,
            avail,
            used,
            event_idx: features & features::EVENT_IDX != 0,
            chains: InFlight::new(n, features & features::IN_ORDER != 0),
            next: (0..n).map(|i| i.wrapping_add(1)).collect(),
            tails: vec![0; n as usize],
            free_head: 0,
            num_free: n,
            avail_shadow: 0,
            avail_published: 0,
            kicked_at: 0,
            last_used: 0,
            used_seen: 0,
            avail_flags: 0,
            calls_disabled: false,
            indirect: None,
            stats: DriverStats::default(),
        })
    }

    /// Gives the queue indirect tables: `size * max_per_chain * 16` bytes at
    /// `gpa` (16-aligned), so `add_indirect` can put chains of up to
    /// `max_per_chain` buffers behind one main-table descriptor.
    pub fn set_indirect_pool(&mut self, gpa: u64, max_per_chain: u16) -> Result<(), DriverError> {
        if max_per_chain == 0 {
            return Err(DriverError::BadChain);
        }
        if !gpa.is_multiple_of(16) {
            return Err(DriverError::Misaligned);
        }
        let bytes = self.layout.size as u64 * max_per_chain as u64 * DESC_SIZE;
        let host = self.mem.host(gpa, bytes).ok_or(DriverError::NotMapped)?;
        self.indirect = Some(IndirectPool { gpa, host, max: max_per_chain });
        Ok(())
    }

    /// The ring layout.
    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    /// Queue size.
    pub fn size(&self) -> u16 {
        self.layout.size
    }

    /// The driver memory.
    pub fn memory(&self) -> &DriverMemory {
        &self.mem
    }

    /// Free descriptors in the main table.
    pub fn num_free(&self) -> u16 {
        self.num_free
    }

    /// Chains made available and not yet returned by the device.
    pub fn in_flight(&self) -> u16 {
        self.chains.count()
    }

    /// Shadow avail index (including entries not yet published).
    pub fn avail_shadow(&self) -> u16 {
        self.avail_shadow
    }

    /// Next used index the driver will take.
    pub fn last_used(&self) -> u16 {
        self.last_used
    }

    // ---- raw ring access (bounds fixed at set-up) -------------------------

    #[inline]
    fn atomic16(&self, base: *mut u8, off: usize) -> &AtomicU16 {
        // SAFETY: callers pass a ring base translated with its full length at
        // set-up and an offset inside it; ring bases are at least 2-aligned
        // (checked at set-up) and offsets even, so the u16 is aligned. The
        // mapping outlives `self`, and every access to it is atomic or volatile.
        unsafe { AtomicU16::from_ptr(base.add(off) as *mut u16) }
    }

    #[inline]
    fn load16(&self, base: *mut u8, off: usize, o: Ordering) -> u16 {
        u16::from_le(self.atomic16(base, off).load(o))
    }

    #[inline]
    fn store16(&self, base: *mut u8, off: usize, v: u16, o: Ordering) {
        self.atomic16(base, off).store(v.to_le(), o)
    }

    /// Writes descriptor `i` (masked to the queue size) of the main table.
    #[inline]
    pub fn write_desc(&mut self, i: u16, d: Descriptor) {
        let i = (i & self.mask) as usize;
        // SAFETY: i < size and the table was translated with size * 16 bytes.
        unsafe { write_desc_raw(self.desc.add(i * 16), d) }
    }

    /// Reads descriptor `i` (masked) of the main table.
    pub fn read_desc(&self, i: u16) -> Descriptor {
        let i = (i & self.mask) as usize;
        // SAFETY: as `write_desc`.
        unsafe { read_desc_raw(self.desc.add(i * 16)) }
    }

    /// Writes avail.ring[slot & mask] (no index change).
    #[inline]
    pub fn write_avail_ring(&mut self, slot: u16, head: u16) {
        let off = AVAIL_RING + 2 * (slot & self.mask) as usize;
        self.store16(self.avail, off, head, Ordering::Relaxed)
    }

    /// Reads avail.ring[slot & mask].
    pub fn read_avail_ring(&self, slot: u16) -> u16 {
        self.load16(self.avail, AVAIL_RING + 2 * (slot & self.mask) as usize, Ordering::Relaxed)
    }

    /// Stores avail.idx directly (release), bypassing all bookkeeping: for
    /// hostile tests. The shadow index follows so later `add`s continue from it.
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.store16(self.avail, AVAIL_IDX, idx, Ordering::Release);
        self.avail_shadow = idx;
        self.avail_published = idx;
    }

    /// avail.idx as stored in the ring.
    pub fn avail_idx(&self) -> u16 {
        self.load16(self.avail, AVAIL_IDX, Ordering::Relaxed)
    }

    /// Writes avail.flags.
    pub fn set_avail_flags(&mut self, flags: u16) {
        self.avail_flags = flags;
        self.store16(self.avail, AVAIL_FLAGS, flags, Ordering::Relaxed)
    }

    /// Writes used_event (the avail ring's trailing field).
    pub fn set_used_event(&mut self, v: u16) {
        self.store16(self.avail, AVAIL_RING + 2 * self.layout.size as usize, v, Ordering::Relaxed)
    }

    /// Reads used_event.
    pub fn used_event(&self) -> u16 {
        self.load16(self.avail, AVAIL_RING + 2 * self.layout.size as usize, Ordering::Relaxed)
    }

    /// used.idx (acquire: entries below it may be read afterwards).
    pub fn used_idx(&self) -> u16 {
        self.load16(self.used, USED_IDX, Ordering::Acquire)
    }

    /// used.flags.
    pub fn used_flags(&self) -> u16 {
        self.load16(self.used, USED_FLAGS, Ordering::Relaxed)
    }

    /// avail_event (the used ring's trailing field).
    pub fn avail_event(&self) -> u16 {
        self.load16(self.used, USED_RING + 8 * self.layout.size as usize, Ordering::Relaxed)
    }

    /// used.ring[slot & mask] as (id, len), raw.
    #[inline]
    pub fn read_used_ring(&self, slot: u16) -> (u16, u32) {
        let off = USED_RING + 8 * (slot & self.mask) as usize;
        // SAFETY: off + 8 <= used ring length; the ring is 4-aligned (checked
        // at set-up), so the two u32 are aligned.
        let (id, len) = unsafe {
            let p = self.used.add(off) as *const u32;
            (std::ptr::read_volatile(p), std::ptr::read_volatile(p.add(1)))
        };
        (u32::from_le(id) as u16, u32::from_le(len))
    }

    /// Host pointers of the descriptor table, avail ring and used ring.
    pub fn ring_ptrs(&self) -> (*mut u8, *mut u8, *mut u8) {
        (self.desc, self.avail, self.used)
    }

    // ---- adding chains ----------------------------------------------------

    /// Makes a chain of `readable` then `writable` buffers available (not yet
    /// published: call `publish`). Returns the head.
    pub fn add(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        let head = self.prepare(readable, writable, token)?;
        self.push_avail(head);
        Ok(head)
    }

    /// Builds a chain like `add` but keeps it aside (a kept chain) instead of
    /// making it available: `repost` posts it, as often as it comes back.
    /// This is how fixed buffers get their descriptors written once.
    pub fn prepare(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        let total = readable.len() + writable.len();
        if total == 0 || total > self.layout.size as usize {
            return Err(DriverError::BadChain);
        }
        if total > self.num_free as usize {
            return Err(DriverError::NoSpace);
        }
        let head = self.free_head;
        let mut cur = head;
        let mut i = 0;
        for (b, w) in readable.iter().map(|b| (b, false)).chain(writable.iter().map(|b| (b, true))) {
            i += 1;
            let nxt = self.next[cur as usize];
            let mut flags = if w { VRING_DESC_F_WRITE } else { 0 };
            if i < total {
                flags |= VRING_DESC_F_NEXT;
            }
            self.write_desc(cur, Descriptor { addr: b.addr, len: b.len, flags, next: nxt });
            if i < total {
                cur = nxt;
            }
        }
        self.free_head = self.next[cur as usize];
        self.num_free -= total as u16;
        self.tails[head as usize] = cur;
        // A skipped in-order chain reports length 0.
        self.chains.allocate(head, total as u16, 0, token);
        Ok(head)
    }

    /// Like `add`, but the buffers go in this head's indirect table and the
    /// chain takes one main-table descriptor.
    pub fn add_indirect(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        let pool = self.indirect.ok_or(DriverError::NoIndirect)?;
        let total = readable.len() + writable.len();
        if total == 0 || total > pool.max as usize {
            return Err(DriverError::BadChain);
        }
        if self.num_free == 0 {
            return Err(DriverError::NoSpace);
        }
        let head = self.free_head;
        let base = head as usize * pool.max as usize * 16;
        for (i, (b, w)) in readable.iter().map(|b| (b, false)).chain(writable.iter().map(|b| (b, true))).enumerate() {
            let mut flags = if w { VRING_DESC_F_WRITE } else { 0 };
            if i + 1 < total {
                flags |= VRING_DESC_F_NEXT;
            }
            // SAFETY: head < size and i < max, so the slot lies inside the
            // pool (size * max * 16 bytes, checked in set_indirect_pool).
            unsafe {
                write_desc_raw(
                    pool.host.add(base + i * 16),
                    Descriptor { addr: b.addr, len: b.len, flags, next: (i + 1) as u16 },
                )
            };
        }
        let table = pool.gpa + base as u64;
        self.write_desc(
            head,
            Descriptor { addr: table, len: (total * 16) as u32, flags: VRING_DESC_F_INDIRECT, next: 0 },
        );
        self.free_head = self.next[head as usize];
        self.num_free -= 1;
        self.tails[head as usize] = head;
        self.chains.allocate(head, 1, 0, token);
        self.push_avail(head);
        Ok(head)
    }

    #[inline]
    fn push_avail(&mut self, head: u16) {
        self.write_avail_ring(self.avail_shadow, head);
        self.avail_shadow = self.avail_shadow.wrapping_add(1);
        self.chains.posted(head);
        self.stats.added += 1;
    }

    /// Makes a kept chain (see `pop_used_keep`) available again, descriptors
    /// unchanged: the fast path for fixed buffers.
    #[inline]
    pub fn repost(&mut self, head: u16) -> Result<(), DriverError> {
        self.chains.kept(head)?;
        self.push_avail(head);
        Ok(())
    }

    /// Changes the length of a kept single-descriptor chain's buffer before
    /// reposting it (e.g. a TX frame of another size).
    #[inline]
    pub fn set_kept_len(&mut self, head: u16, len: u32) -> Result<(), DriverError> {
        self.chains.kept(head)?;
        let off = (head as usize) * 16 + 8;
        // SAFETY: head < size (kept checked it against the table); the len
        // field lies inside the descriptor table and is 4-aligned.
        unsafe { std::ptr::write_volatile(self.desc.add(off) as *mut u32, len.to_le()) };
        Ok(())
    }

    /// Returns a kept chain's descriptors to the free list.
    pub fn free_kept(&mut self, head: u16) -> Result<(), DriverError> {
        let c = self.chains.kept(head)?;
        self.chains.free(head);
        self.release_descs(head, c.ndesc);
        Ok(())
    }

    /// Splices the `ndesc` descriptors of the chain at `head` back into the
    /// free list.
    #[inline]
    fn release_descs(&mut self, head: u16, ndesc: u16) {
        self.next[self.tails[head as usize] as usize] = self.free_head;
        self.free_head = head;
        self.num_free += ndesc;
    }

    /// Stores avail.idx once for everything added since the last publish,
    /// after a release fence so the device sees the descriptors and ring
    /// entries first. Returns how many entries it published.
    #[inline]
    pub fn publish(&mut self) -> u16 {
        let n = self.avail_shadow.wrapping_sub(self.avail_published);
        if n != 0 {
            self.store16(self.avail, AVAIL_IDX, self.avail_shadow, Ordering::Release);
            self.avail_published = self.avail_shadow;
            self.stats.publishes += 1;
        }
        n
    }

    /// Should the device be kicked for what was published since the last
    /// call? Uses avail_event with EVENT_IDX, used.flags NO_NOTIFY without.
    #[inline]
    pub fn needs_kick(&mut self) -> bool {
        let new = self.avail_published;
        let old = self.kicked_at;
        if new == old {
            return false;
        }
        // The avail.idx store must be visible before we read the device's
        // suppression state, or we could miss the device going to sleep.
        fence(Ordering::SeqCst);
        self.kicked_at = new;
        let kick = if self.event_idx {
            need_event(self.avail_event(), new, old)
        } else {
            self.used_flags() & VRING_USED_F_NO_NOTIFY == 0
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

    // ---- taking used entries ------------------------------------------------

    /// Number of used entries ready to take (reads used.idx once, acquire).
    /// Errors when the device claims more completions than chains in flight.
    #[inline]
    pub fn used_ready(&mut self) -> Result<u16, DriverError> {
        inflight::used_ready(self)
    }

    /// Takes the next used entry and frees its descriptors.
    #[inline]
    pub fn pop_used(&mut self) -> Result<Option<Used>, DriverError> {
        inflight::take_used(self, false)
    }

    /// Takes the next used entry but keeps its descriptors allocated, for
    /// `repost` (fixed buffers) or a later `free_kept`.
    #[inline]
    pub fn pop_used_keep(&mut self) -> Result<Option<Used>, DriverError> {
        inflight::take_used(self, true)
    }

    /// Takes up to `out.len()` used entries (keeping or freeing their
    /// chains), reading used.idx once. On a device error the entries taken
    /// so far are still in `out[..n]` and the error is returned.
    #[inline]
    pub fn pop_used_batch(&mut self, out: &mut [Used], keep: bool) -> Result<usize, DriverError> {
        inflight::pop_used_batch(self, out, keep)
    }

    // ---- interrupt suppression ----------------------------------------------

    /// Asks the device for a call after the next completion (used_event =
    /// last_used with EVENT_IDX, clears NO_INTERRUPT without). Returns true
    /// if completions are already pending (re-check them before sleeping).
    pub fn enable_notifications(&mut self) -> bool {
        self.calls_disabled = false;
        if self.event_idx {
            self.set_used_event(self.last_used);
        } else if self.avail_flags & VRING_AVAIL_F_NO_INTERRUPT != 0 {
            self.set_avail_flags(self.avail_flags & !VRING_AVAIL_F_NO_INTERRUPT);
        }
        // Order the request before re-reading used.idx (pairs with the
        // device's fence between its used.idx store and reading our request).
        fence(Ordering::SeqCst);
        self.used_idx() != self.last_used
    }

    /// Asks the device not to call (busy polling). With EVENT_IDX, parks
    /// used_event half a ring-index space away so no completion crosses it
    /// soon, and leaves avail.flags alone (the spec wants 0 there then);
    /// without it, sets NO_INTERRUPT.
    pub fn disable_notifications(&mut self) {
        self.calls_disabled = true;
        if self.event_idx {
            self.set_used_event(self.last_used.wrapping_add(0x8000));
        } else {
            self.set_avail_flags(self.avail_flags | VRING_AVAIL_F_NO_INTERRUPT);
        }
    }

    /// Re-parks used_event ahead while busy polling with EVENT_IDX notifications
    /// disabled (call now and then: a parked event is reached after 32768 completions).
    #[inline]
    pub fn refresh_disabled(&mut self) {
        if self.event_idx && self.calls_disabled {
            self.set_used_event(self.last_used.wrapping_add(0x8000));
        }
    }
}

/// The split used ring: one used index per chain (an IN_ORDER device moves
/// used.idx past every chain of a batch, writing one element for it), read
/// through used.idx, which is loaded once per batch.
impl UsedRing for SplitDriver {
    #[inline(always)]
    fn chains(&mut self) -> &mut InFlight {
        &mut self.chains
    }

    #[inline(always)]
    fn stats_mut(&mut self) -> &mut DriverStats {
        &mut self.stats
    }

    #[inline(always)]
    fn used_count(&mut self, in_flight: u16, _batch_pending: bool) -> Result<u16, DriverError> {
        let n = self.used_seen.wrapping_sub(self.last_used);
        if n != 0 {
            return Ok(n);
        }
        let idx = self.used_idx();
        let n = idx.wrapping_sub(self.last_used);
        if n > in_flight {
            return Err(DriverError::UsedIdxAhead);
        }
        self.used_seen = idx;
        Ok(n)
    }

    #[inline(always)]
    fn read_used(&self) -> (u16, u32) {
        // used.idx was loaded with acquire: the elements below it are visible.
        self.read_used_ring(self.last_used)
    }

    #[inline(always)]
    fn step_used(&mut self, _ndesc: u16) {
        self.last_used = self.last_used.wrapping_add(1);
    }

    #[inline(always)]
    fn retire(&mut self, id: u16, ndesc: u16, keep: bool) {
        if !keep {
            self.release_descs(id, ndesc);
        }
    }
}

/// # Safety
/// `p` must be valid for a 16-byte write.
#[inline]
unsafe fn write_desc_raw(p: *mut u8, d: Descriptor) {
    let hi = d.len as u64 | (d.flags as u64) << 32 | (d.next as u64) << 48;
    // SAFETY: the caller guarantees 16 writable bytes.
    unsafe { raw::write16(p, d.addr, hi) }
}

/// # Safety
/// `p` must be valid for a 16-byte read.
#[inline]
unsafe fn read_desc_raw(p: *const u8) -> Descriptor {
    // SAFETY: the caller guarantees 16 readable bytes.
    let (addr, rest) = unsafe { raw::read16(p) };
    Descriptor { addr, len: rest as u32, flags: (rest >> 32) as u16, next: (rest >> 48) as u16 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SharedMemory;
    use std::sync::Arc;

    const GPA: u64 = 0x10_0000;

    fn setup(size: u16, features: u64) -> SplitDriver {
        let m = Arc::new(SharedMemory::anonymous(1 << 20).unwrap());
        let mem = DriverMemory::new(m, GPA);
        SplitDriver::new(mem, RingLayout::at(GPA, size), features).unwrap()
    }

    /// Stores into the used ring as a (possibly hostile) device would.
    fn dev16(q: &SplitDriver, off: usize, v: u16) {
        let (_, _, used) = q.ring_ptrs();
        assert!(off.is_multiple_of(2) && off + 2 <= used_ring_size(q.size()) as usize);
        // SAFETY: inside the used ring (asserted), which is 4-aligned, so the u16 is aligned.
        unsafe { std::ptr::write_volatile(used.add(off) as *mut u16, v) }
    }

    fn dev32(q: &SplitDriver, off: usize, v: u32) {
        let (_, _, used) = q.ring_ptrs();
        assert!(off.is_multiple_of(4) && off + 4 <= used_ring_size(q.size()) as usize);
        // SAFETY: inside the used ring (asserted), 4-aligned.
        unsafe { std::ptr::write_volatile(used.add(off) as *mut u32, v) }
    }

    fn indirect_entry(q: &SplitDriver, table_gpa: u64, i: usize) -> Descriptor {
        let p = q.memory().host(table_gpa + 16 * i as u64, 16).unwrap();
        // SAFETY: `host` checked that 16 bytes are mapped there.
        unsafe { read_desc_raw(p) }
    }

    /// A minimal device: completes `n` chains from the avail ring in order
    /// (or in the order given), as a device would.
    fn device_complete(q: &SplitDriver, dev_next_avail: &mut u16, dev_used: &mut u16, n: u16, len: u32) {
        for _ in 0..n {
            let head = q.read_avail_ring(*dev_next_avail);
            *dev_next_avail = dev_next_avail.wrapping_add(1);
            let off = USED_RING + 8 * (*dev_used & q.mask) as usize;
            dev32(q, off, head as u32);
            dev32(q, off + 4, len);
            *dev_used = dev_used.wrapping_add(1);
        }
        fence(Ordering::Release);
        dev16(q, USED_IDX, *dev_used);
    }

    #[test]
    fn bad_setup_refused() {
        let m = Arc::new(SharedMemory::anonymous(1 << 16).unwrap());
        let mem = DriverMemory::new(m, 0);
        let mut l = RingLayout::at(0, 256);
        l.size = 3;
        assert_eq!(SplitDriver::new(mem.clone(), l, 0).err(), Some(DriverError::BadSize));
        let l = RingLayout::at(0, 4096);
        assert_eq!(SplitDriver::new(mem.clone(), l, 0).err(), Some(DriverError::NotMapped));
        let mut l = RingLayout::at(0, 16);
        l.desc += 8;
        assert_eq!(SplitDriver::new(mem, l, 0).err(), Some(DriverError::Misaligned));
    }

    #[test]
    fn chain_is_written_as_the_spec_says() {
        let mut q = setup(8, 0);
        let r = [Buf { addr: 0x1000, len: 10 }, Buf { addr: 0x2000, len: 20 }];
        let w = [Buf { addr: 0x3000, len: 30 }];
        let head = q.add(&r, &w, 77).unwrap();
        assert_eq!(q.num_free(), 5);
        let d0 = q.read_desc(head);
        assert_eq!((d0.addr, d0.len, d0.flags), (0x1000, 10, VRING_DESC_F_NEXT));
        let d1 = q.read_desc(d0.next);
        assert_eq!((d1.addr, d1.len, d1.flags), (0x2000, 20, VRING_DESC_F_NEXT));
        let d2 = q.read_desc(d1.next);
        assert_eq!((d2.addr, d2.len, d2.flags), (0x3000, 30, VRING_DESC_F_WRITE));
        assert_eq!(q.avail_idx(), 0, "not published yet");
        assert_eq!(q.publish(), 1);
        assert_eq!(q.avail_idx(), 1);
        assert_eq!(q.read_avail_ring(0), head);
        assert_eq!(q.stats.publishes, 1);
        assert_eq!(q.publish(), 0, "nothing new");
    }

    #[test]
    fn used_entries_free_descriptors_and_return_tokens() {
        let mut q = setup(4, 0);
        let (mut na, mut nu) = (0u16, 0u16);
        let h1 = q.add(&[Buf { addr: 0x1000, len: 1 }, Buf { addr: 0x1001, len: 1 }], &[], 1).unwrap();
        let h2 = q.add(&[], &[Buf { addr: 0x2000, len: 1 }, Buf { addr: 0x2001, len: 1 }], 2).unwrap();
        assert_eq!(q.add(&[Buf { addr: 0, len: 1 }], &[], 3), Err(DriverError::NoSpace));
        q.publish();
        assert_eq!(q.pop_used().unwrap(), None);
        device_complete(&q, &mut na, &mut nu, 2, 5);
        assert_eq!(q.pop_used().unwrap(), Some(Used { id: h1, len: 5, token: 1 }));
        assert_eq!(q.pop_used().unwrap(), Some(Used { id: h2, len: 5, token: 2 }));
        assert_eq!(q.pop_used().unwrap(), None);
        assert_eq!(q.num_free(), 4);
        assert_eq!(q.in_flight(), 0);
        // The freed descriptors are reusable for a chain of the full size.
        let bufs: Vec<Buf> = (0..4).map(|i| Buf { addr: i * 16, len: 16 }).collect();
        q.add(&bufs, &[], 9).unwrap();
        assert_eq!(q.num_free(), 0);
    }

    #[test]
    fn fixed_buffers_repost_across_wraparound() {
        let mut q = setup(8, 0);
        for i in 0..8 {
            q.add(&[], &[Buf { addr: 0x1000 * i, len: 64 }], i).unwrap();
        }
        q.publish();
        let (mut na, mut nu) = (0u16, 0u16);
        let mut out = [Used::default(); 8];
        // Many laps of the 16-bit indexes.
        for round in 0..20_000u32 {
            let n = (round % 8 + 1) as u16;
            device_complete(&q, &mut na, &mut nu, n, 64);
            let got = q.pop_used_batch(&mut out, true).unwrap();
            assert_eq!(got, n as usize);
            for u in &out[..got] {
                assert_eq!(q.read_desc(u.id).addr, 0x1000 * u.token);
                q.repost(u.id).unwrap();
            }
            assert_eq!(q.repost(out[0].id), Err(DriverError::NotKept), "already in flight");
            q.publish();
        }
        assert_eq!(q.in_flight(), 8);
        assert_eq!(q.num_free(), 0);
    }

    #[test]
    fn prepared_chains_wait_for_repost() {
        let mut q = setup(4, 0);
        let h = q.prepare(&[Buf { addr: 0x100, len: 10 }], &[], 4).unwrap();
        assert_eq!(q.num_free(), 3);
        assert_eq!(q.publish(), 0, "prepare does not post");
        q.repost(h).unwrap();
        assert_eq!(q.publish(), 1);
        assert_eq!(q.read_avail_ring(0), h);
    }

    #[test]
    fn set_kept_len_changes_only_len() {
        let mut q = setup(4, 0);
        let h = q.add(&[Buf { addr: 0x100, len: 10 }], &[], 0).unwrap();
        assert_eq!(q.set_kept_len(h, 5), Err(DriverError::NotKept));
        q.publish();
        let (mut na, mut nu) = (0, 0);
        device_complete(&q, &mut na, &mut nu, 1, 0);
        q.pop_used_keep().unwrap().unwrap();
        q.set_kept_len(h, 5).unwrap();
        assert_eq!(q.read_desc(h), Descriptor { addr: 0x100, len: 5, flags: 0, next: q.read_desc(h).next });
        q.free_kept(h).unwrap();
        assert_eq!(q.num_free(), 4);
        assert_eq!(q.free_kept(h), Err(DriverError::NotKept));
    }

    #[test]
    fn hostile_device_is_an_error_not_a_panic() {
        let mut q = setup(4, 0);
        q.add(&[Buf { addr: 0x100, len: 10 }], &[], 0).unwrap();
        q.publish();
        // used.idx far ahead of what is in flight.
        dev16(&q, USED_IDX, 3);
        assert_eq!(q.pop_used(), Err(DriverError::UsedIdxAhead));
        // A head past the queue size.
        dev32(&q, USED_RING, 1000);
        dev16(&q, USED_IDX, 1);
        assert_eq!(q.pop_used(), Err(DriverError::BadUsedId));
        // A head that is not in flight.
        dev32(&q, USED_RING, 2);
        assert_eq!(q.pop_used(), Err(DriverError::UsedNotInFlight));
        // Repaired: the real head completes.
        dev32(&q, USED_RING, 0);
        assert_eq!(q.pop_used().unwrap().map(|u| u.id), Some(0));
        // The same head again (a duplicate completion).
        dev32(&q, USED_RING + 8, 0);
        dev16(&q, USED_IDX, 2);
        assert_eq!(q.pop_used(), Err(DriverError::UsedIdxAhead));
    }

    #[test]
    fn an_in_order_entry_stands_for_the_chains_before_it() {
        let mut q = setup(8, features::IN_ORDER);
        let h: Vec<u16> = (0..4).map(|t| q.add(&[], &[Buf { addr: 0x1000 * t, len: 64 }], t).unwrap()).collect();
        q.publish();
        // One entry, in the batch's first slot, naming its third chain;
        // used.idx first moved by one only, then by the whole batch.
        dev32(&q, USED_RING, h[2] as u32);
        dev32(&q, USED_RING + 4, 9);
        dev16(&q, USED_IDX, 1);
        assert_eq!(q.pop_used().unwrap(), Some(Used { id: h[0], len: 0, token: 0 }), "skipped: length 0");
        assert_eq!(q.pop_used().unwrap(), None, "used.idx covers one chain");
        dev16(&q, USED_IDX, 3);
        let mut out = [Used::default(); 8];
        assert_eq!(q.pop_used_batch(&mut out, false), Ok(2));
        assert_eq!(out[..2], [Used { id: h[1], len: 0, token: 1 }, Used { id: h[2], len: 9, token: 2 }]);
        // A hostile entry for the last chain: a head no longer in flight.
        dev32(&q, USED_RING + 8 * 3, h[1] as u32);
        dev16(&q, USED_IDX, 4);
        assert_eq!(q.pop_used(), Err(DriverError::UsedNotInFlight));
        dev32(&q, USED_RING + 8 * 3, h[3] as u32);
        assert_eq!(q.pop_used().unwrap().map(|u| u.id), Some(h[3]));
        assert_eq!((q.in_flight(), q.num_free(), q.last_used()), (0, 8, 4));
    }

    #[test]
    fn kick_decision_without_event_idx() {
        let mut q = setup(8, 0);
        assert!(!q.needs_kick(), "nothing published");
        q.add(&[Buf { addr: 0, len: 1 }], &[], 0).unwrap();
        assert!(q.publish_and_check_kick());
        dev16(&q, USED_FLAGS, VRING_USED_F_NO_NOTIFY);
        q.add(&[Buf { addr: 0, len: 1 }], &[], 0).unwrap();
        assert!(!q.publish_and_check_kick());
    }

    #[test]
    fn kick_decision_with_event_idx() {
        let mut q = setup(8, features::EVENT_IDX);
        let set_avail_event = |q: &SplitDriver, v: u16| dev16(q, USED_RING + 8 * 8, v);
        // Device wants to hear when idx passes 0: the first publish kicks.
        set_avail_event(&q, 0);
        q.add(&[Buf { addr: 0, len: 1 }], &[], 0).unwrap();
        assert!(q.publish_and_check_kick());
        // avail_event still 0: moving 1 -> 3 does not cross it.
        q.add(&[Buf { addr: 0, len: 1 }], &[], 0).unwrap();
        q.add(&[Buf { addr: 0, len: 1 }], &[], 0).unwrap();
        assert!(!q.publish_and_check_kick());
        // Device asks for index 4 (it has seen up to 3): 3 -> 5 crosses it.
        set_avail_event(&q, 4);
        q.add(&[Buf { addr: 0, len: 1 }], &[], 0).unwrap();
        q.add(&[Buf { addr: 0, len: 1 }], &[], 0).unwrap();
        assert!(q.publish_and_check_kick());
        assert_eq!(q.stats.kicks, 2);
    }

    #[test]
    fn interrupt_suppression_fields() {
        let mut q = setup(8, features::EVENT_IDX);
        q.disable_notifications();
        assert_eq!(q.used_event(), 0x8000);
        assert_eq!(q.load16(q.avail, AVAIL_FLAGS, Ordering::Relaxed), 0, "0 with EVENT_IDX");
        assert!(!q.enable_notifications());
        assert_eq!(q.used_event(), 0);

        let mut q = setup(8, 0);
        q.disable_notifications();
        assert_eq!(q.load16(q.avail, AVAIL_FLAGS, Ordering::Relaxed), VRING_AVAIL_F_NO_INTERRUPT);
        q.enable_notifications();
        assert_eq!(q.load16(q.avail, AVAIL_FLAGS, Ordering::Relaxed), 0);
    }

    #[test]
    fn indirect_chain_uses_one_slot() {
        let mut q = setup(4, features::INDIRECT_DESC);
        assert_eq!(q.add_indirect(&[Buf { addr: 0, len: 1 }], &[], 0), Err(DriverError::NoIndirect));
        let pool = GPA + 0x8000;
        q.set_indirect_pool(pool, 8).unwrap();
        let r = [Buf { addr: 0x1000, len: 12 }];
        let w: Vec<Buf> = (0..7).map(|i| Buf { addr: 0x2000 + i * 0x100, len: 0x100 }).collect();
        let head = q.add_indirect(&r, &w, 5).unwrap();
        assert_eq!(q.num_free(), 3);
        let d = q.read_desc(head);
        assert_eq!(d.flags, VRING_DESC_F_INDIRECT);
        assert_eq!(d.len, 8 * 16);
        let t0 = indirect_entry(&q, d.addr, 0);
        assert_eq!((t0.addr, t0.len, t0.flags, t0.next), (0x1000, 12, VRING_DESC_F_NEXT, 1));
        let t7 = indirect_entry(&q, d.addr, 7);
        assert_eq!((t7.addr, t7.flags), (0x2600, VRING_DESC_F_WRITE));
        assert_eq!(q.add_indirect(&w, &w, 0), Err(DriverError::BadChain), "more than the pool holds");
        q.publish();
        let (mut na, mut nu) = (0, 0);
        device_complete(&q, &mut na, &mut nu, 1, 3);
        assert_eq!(q.pop_used().unwrap(), Some(Used { id: head, len: 3, token: 5 }));
        assert_eq!(q.num_free(), 4);
    }

    #[test]
    fn hostile_raw_writes_are_bounded() {
        let mut q = setup(4, 0);
        // Indexes are masked: no write past the tables whatever the caller passes.
        q.write_desc(0xffff, Descriptor { addr: u64::MAX, len: u32::MAX, flags: 0xffff, next: 0xffff });
        assert_eq!(q.read_desc(3).addr, u64::MAX);
        q.write_avail_ring(0xfffe, 0xabcd);
        assert_eq!(q.read_avail_ring(2), 0xabcd);
        q.set_avail_idx(0x1234);
        assert_eq!(q.avail_idx(), 0x1234);
        assert_eq!(q.avail_shadow(), 0x1234);
    }
}
