//! Device side of a split virtqueue (virtio 1.2, section 2.7).
//!
//! We do not use the `virtio-queue` crate here: it has no batched used
//! publish, ignores NO_INTERRUPT and binary-searches the region table on every
//! access. This queue translates the three ring addresses once at set-up,
//! reads `avail.idx` once per batch, keeps a last-hit region cache for
//! buffers, and stores `used.idx` once per batch.
//!
//! Everything read from guest memory is hostile: indexes, lengths, addresses,
//! flags and chains are validated; a bad chain is completed with length 0 and
//! counted, a broken ring (avail.idx running ahead by more than the queue
//! size, a head index past the queue) marks the queue broken so the device
//! can ask for a reset. Nothing here panics on guest input.

use crate::memory::GuestMemory;
use crate::ring::*;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

/// A piece of a guest buffer, already translated to a host address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    /// Host address.
    pub addr: *mut u8,
    /// Length in bytes (never 0).
    pub len: u32,
}

/// One popped descriptor chain; its segments live in the owning `Batch`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Chain {
    /// Head descriptor index: what goes back in the used ring.
    pub head: u16,
    pub(crate) seg_start: u32,
    pub(crate) n_read: u16,
    pub(crate) n_write: u16,
    /// Total device-readable bytes.
    pub read_len: u32,
    /// Total device-writable bytes.
    pub write_len: u32,
}

/// Popped chains and their segments in flat arrays, reused across batches so
/// the hot path does not allocate.
#[derive(Default)]
pub struct Batch {
    /// The chains, in avail order.
    pub chains: Vec<Chain>,
    pub(crate) segs: Vec<Seg>,
    /// The batch ended before a bad chain (which the next batch starts with).
    pub ended_before_bad: bool,
}

// SAFETY: the raw pointers in `segs` point into guest memory that the queue's
// `GuestMemory` keeps mapped; a Batch is only moved between threads together
// with its queue.
unsafe impl Send for Batch {}

impl Batch {
    /// An empty batch.
    pub fn new() -> Batch {
        Batch { chains: Vec::with_capacity(256), segs: Vec::with_capacity(1024), ended_before_bad: false }
    }

    /// Forgets all chains.
    pub fn clear(&mut self) {
        self.chains.clear();
        self.segs.clear();
        self.ended_before_bad = false;
    }

    /// Number of chains.
    pub fn len(&self) -> usize {
        self.chains.len()
    }

    /// True when no chain was popped.
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty()
    }

    /// Device-readable segments of chain `c`.
    #[inline]
    pub fn readable(&self, c: &Chain) -> &[Seg] {
        let s = c.seg_start as usize;
        &self.segs[s..s + c.n_read as usize]
    }

    /// Device-writable segments of chain `c`.
    #[inline]
    pub fn writable(&self, c: &Chain) -> &[Seg] {
        let s = c.seg_start as usize + c.n_read as usize;
        &self.segs[s..s + c.n_write as usize]
    }
}

/// Which buffers a queue's chains must carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Only device-readable buffers (e.g. a net TX queue).
    ReadOnly,
    /// Only device-writable buffers (e.g. a net RX queue).
    WriteOnly,
    /// Readable buffers followed by writable ones (e.g. control or block queues).
    ReadThenWrite,
}

/// Why a chain was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainError {
    /// A `next` index or head past the queue size.
    IndexOutOfRange,
    /// More descriptors than the queue (or indirect table) holds: a loop.
    TooLong,
    /// A buffer outside the memory table.
    BadAddress,
    /// A writable buffer where a readable one is required, or the reverse.
    WrongDirection,
    /// INDIRECT without the feature, inside an indirect table, with NEXT, or
    /// with a length that is zero or not a multiple of 16.
    BadIndirect,
    /// Total length does not fit in 32 bits.
    TooBig,
}

/// Counters owned by the queue (read by whoever owns the queue).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Chains popped and handed to the device.
    pub chains: u64,
    /// Chains rejected, by any reason.
    pub bad_chains: u64,
    /// Chains rejected for an index past the queue size.
    pub bad_index: u64,
    /// Chains rejected for looping or being too long.
    pub bad_loop: u64,
    /// Chains rejected for an address outside the memory table.
    pub bad_address: u64,
    /// Chains rejected for a buffer of the wrong direction.
    pub bad_direction: u64,
    /// Chains rejected for a malformed indirect descriptor.
    pub bad_indirect: u64,
    /// Batches popped (non-empty).
    pub batches: u64,
    /// used.idx stores (split) or publishing flag stores (packed).
    pub used_publishes: u64,
    /// Chains taken by the single-descriptor fast path.
    pub fast_chains: u64,
    /// Packed rings: groups of four simple descriptors taken at once.
    pub batch4: u64,
    /// Chains completed without a used entry of their own (IN_ORDER batches).
    pub used_skipped: u64,
}

impl QueueStats {
    pub(crate) fn count(&mut self, e: ChainError) {
        self.bad_chains += 1;
        match e {
            ChainError::IndexOutOfRange => self.bad_index += 1,
            ChainError::TooLong => self.bad_loop += 1,
            ChainError::BadAddress | ChainError::TooBig => self.bad_address += 1,
            ChainError::WrongDirection => self.bad_direction += 1,
            ChainError::BadIndirect => self.bad_indirect += 1,
        }
    }
}

/// Where a split ring lives and where processing resumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SplitConfig {
    /// Queue size (power of two, 1..=32768).
    pub size: u16,
    /// Descriptor table address (frontend virtual address for vhost-user).
    pub desc: u64,
    /// Available ring address.
    pub avail: u64,
    /// Used ring address.
    pub used: u64,
    /// Negotiated device features (INDIRECT_DESC and EVENT_IDX matter here).
    pub features: u64,
    /// Next available index to process (SET_VRING_BASE).
    pub next_avail: u16,
}

/// Why a ring could not be set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetupError {
    /// Size zero, above 32768 or not a power of two.
    BadSize,
    /// A ring outside the memory table (or not within one region).
    NotMapped,
    /// A ring address not aligned as the spec requires.
    Misaligned,
    /// The used ring overlaps the descriptor table or the available ring
    /// (packed: the device area overlaps the descriptor ring or driver area).
    Overlap,
    /// A packed ring's vring base names an index past the queue size.
    BadBase,
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            SetupError::BadSize => "queue size is zero, above 32768 or not a power of two",
            SetupError::NotMapped => "a ring is not inside the memory table",
            SetupError::Misaligned => "a ring address is misaligned",
            SetupError::Overlap => "the used ring overlaps another ring",
            SetupError::BadBase => "the ring base index is past the queue size",
        };
        f.write_str(s)
    }
}

impl std::error::Error for SetupError {}

/// Which translation of the ring addresses to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrSpace {
    /// Frontend virtual addresses (vhost-user).
    FrontendVirtual,
    /// Guest-physical addresses (our own driver side, tests).
    GuestPhysical,
}

/// The device side of one split virtqueue.
pub struct SplitQueue {
    mem: Arc<GuestMemory>,
    cfg: SplitConfig,
    space: AddrSpace,
    mask: u16,
    desc: *const u8,
    avail: *const u8,
    used: *mut u8,
    event_idx: bool,
    indirect: bool,
    in_order: bool,
    next_avail: u16,
    /// avail.idx as last read (entries up to it are published and fenced).
    avail_seen: u16,
    /// Shadow of used.idx: entries written but maybe not yet published.
    next_used: u16,
    /// used.idx as last stored.
    published_used: u16,
    /// used.idx as of the last notify decision.
    signalled_used: u16,
    signalled_valid: bool,
    notifications_disabled: bool,
    region_hint: usize,
    broken: bool,
    /// Counters.
    pub stats: QueueStats,
}

// SAFETY: the ring pointers point into `mem`, which the queue keeps alive;
// the queue is owned by one thread at a time.
unsafe impl Send for SplitQueue {}

const AVAIL_FLAGS: usize = 0;
const AVAIL_IDX: usize = 2;
const AVAIL_RING: usize = 4;
const USED_FLAGS: usize = 0;
const USED_IDX: usize = 2;
const USED_RING: usize = 4;

#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

impl SplitQueue {
    /// Sets up a ring: checks the size, translates and checks the three ring
    /// addresses once, and reads used.idx to resume from.
    pub fn new(mem: Arc<GuestMemory>, cfg: SplitConfig, space: AddrSpace) -> Result<SplitQueue, SetupError> {
        let n = cfg.size;
        if n == 0 || n > MAX_QUEUE_SIZE || !n.is_power_of_two() {
            return Err(SetupError::BadSize);
        }
        if !cfg.desc.is_multiple_of(16) || !cfg.avail.is_multiple_of(2) || !cfg.used.is_multiple_of(4) {
            return Err(SetupError::Misaligned);
        }
        let (dlen, alen, ulen) = (desc_table_size(n), avail_ring_size(n), used_ring_size(n));
        let overlaps = |a: u64, al: u64, b: u64, bl: u64| a < b.saturating_add(bl) && b < a.saturating_add(al);
        if overlaps(cfg.used, ulen, cfg.desc, dlen) || overlaps(cfg.used, ulen, cfg.avail, alen) {
            return Err(SetupError::Overlap);
        }
        let tr = |addr: u64, len: u64| -> Option<*mut u8> {
            match space {
                AddrSpace::FrontendVirtual => mem.translate_uaddr(addr, len),
                AddrSpace::GuestPhysical => mem.translate(addr, len, &mut 0),
            }
        };
        let desc = tr(cfg.desc, dlen).ok_or(SetupError::NotMapped)?;
        let avail = tr(cfg.avail, alen).ok_or(SetupError::NotMapped)?;
        let used = tr(cfg.used, ulen).ok_or(SetupError::NotMapped)?;
        // The rings are read with aligned loads: the host addresses must be
        // aligned too (a region mapped at an odd offset would break that).
        if !(desc as usize).is_multiple_of(16)
            || !(avail as usize).is_multiple_of(2)
            || !(used as usize).is_multiple_of(4)
        {
            return Err(SetupError::Misaligned);
        }
        let mut q = SplitQueue {
            mem,
            cfg,
            space,
            mask: n - 1,
            desc,
            avail,
            used,
            event_idx: cfg.features & features::EVENT_IDX != 0,
            indirect: cfg.features & features::INDIRECT_DESC != 0,
            in_order: cfg.features & features::IN_ORDER != 0,
            next_avail: cfg.next_avail,
            avail_seen: cfg.next_avail,
            next_used: 0,
            published_used: 0,
            signalled_used: 0,
            signalled_valid: false,
            notifications_disabled: false,
            region_hint: 0,
            broken: false,
            stats: QueueStats::default(),
        };
        q.next_used = q.read_u16(q.used, USED_IDX);
        q.published_used = q.next_used;
        Ok(q)
    }

    /// The same ring over a new memory table (after SET_MEM_TABLE or
    /// ADD/REM_MEM_REG), keeping its position and counters.
    pub fn remap(&self, mem: Arc<GuestMemory>) -> Result<SplitQueue, SetupError> {
        let mut cfg = self.cfg;
        cfg.next_avail = self.next_avail;
        let mut q = SplitQueue::new(mem, cfg, self.space)?;
        q.next_used = self.next_used;
        q.published_used = self.published_used;
        q.stats = self.stats;
        q.broken = self.broken;
        Ok(q)
    }

    /// Queue size.
    pub fn size(&self) -> u16 {
        self.cfg.size
    }

    /// The memory table this ring reads.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.mem
    }

    /// Next available index to process: what GET_VRING_BASE returns.
    pub fn next_avail(&self) -> u16 {
        self.next_avail
    }

    /// Shadow used index (entries written so far).
    pub fn next_used(&self) -> u16 {
        self.next_used
    }

    /// True once the driver broke the ring (the device should ask for reset).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// used.idx as it is in guest memory now.
    pub fn used_idx_in_memory(&self) -> u16 {
        self.read_u16(self.used, USED_IDX)
    }

    /// Moves the next available index (inflight recovery: a restarted
    /// backend resumes after the chains it had already taken).
    pub fn set_next_avail(&mut self, idx: u16) {
        self.next_avail = idx;
        self.avail_seen = idx;
    }

    /// Takes the chain at `head` again, without the avail ring: a request a
    /// previous backend took and never completed (vhost-user inflight
    /// tracking). Appends it to `batch` (not cleared) and returns true; a
    /// bad chain is completed with length 0 and counted, and false returned.
    pub fn repop(&mut self, head: u16, batch: &mut Batch, access: Access) -> bool {
        if self.broken || head >= self.cfg.size {
            return false;
        }
        let seg_start = batch.segs.len();
        match self.parse_chain(head, batch, access) {
            Ok(mut chain) => {
                chain.seg_start = seg_start as u32;
                batch.chains.push(chain);
                self.stats.chains += 1;
                true
            }
            Err(e) => {
                batch.segs.truncate(seg_start);
                self.stats.count(e);
                self.add_used(head, 0);
                false
            }
        }
    }

    #[inline]
    fn read_u16(&self, base: *const u8, off: usize) -> u16 {
        // SAFETY: every caller passes a ring base translated at set-up with its
        // full length, and an offset inside that length; u16 fields are
        // 2-aligned because ring bases were checked for alignment.
        u16::from_le(unsafe { std::ptr::read_volatile(base.add(off) as *const u16) })
    }

    #[inline]
    fn write_u16(&self, base: *mut u8, off: usize, v: u16) {
        // SAFETY: as read_u16; only the used ring (device-owned) is written.
        unsafe { std::ptr::write_volatile(base.add(off) as *mut u16, v.to_le()) }
    }

    #[inline]
    fn avail_idx(&self) -> u16 {
        self.read_u16(self.avail, AVAIL_IDX)
    }

    #[inline]
    fn read_desc(table: *const u8, i: u16) -> Desc {
        // SAFETY: callers check i against the table's entry count, and the
        // table was translated with its full length.
        let (addr, rest) = unsafe { crate::ring::read_desc_words(table.add(i as usize * 16)) };
        Desc { addr, len: rest as u32, flags: (rest >> 32) as u16, next: (rest >> 48) as u16 }
    }

    /// How many chains the driver has made available and we have not popped
    /// (reads avail.idx). Marks the ring broken if avail.idx ran ahead by
    /// more than the queue size.
    pub fn pending(&mut self) -> u16 {
        // A broken ring offers nothing (its worker may sleep).
        if self.broken {
            return 0;
        }
        let idx = self.avail_idx();
        let n = idx.wrapping_sub(self.next_avail);
        if n > self.cfg.size {
            self.broken = true;
            return 0;
        }
        // Read descriptors only after seeing the index that published them.
        fence(Ordering::Acquire);
        self.avail_seen = idx;
        n
    }

    /// At least min(`want`, chains available) chains are available: reads
    /// avail.idx only if the last read showed fewer than `want`.
    pub fn available(&mut self, want: u16) -> u16 {
        if self.broken {
            return 0;
        }
        let seen = self.avail_seen.wrapping_sub(self.next_avail);
        if seen >= want {
            seen
        } else {
            self.pending()
        }
    }

    /// Pops up to `max` chains into `batch` (cleared first), reading
    /// avail.idx at most once (not at all if a previous read already showed
    /// `max` chains). Bad chains are completed with length 0, counted, and
    /// not returned; they only ever precede the good chains of a batch, so
    /// `unpop` never rewinds over one. Returns the number of chains in `batch`.
    pub fn pop_batch(&mut self, batch: &mut Batch, max: usize, access: Access) -> usize {
        batch.clear();
        if self.broken || max == 0 {
            return 0;
        }
        let mut avail = self.avail_seen.wrapping_sub(self.next_avail);
        if (avail as usize) < max {
            avail = self.pending();
        }
        if avail == 0 {
            return 0;
        }
        let n = (avail as usize).min(max);
        // Read the heads of a group first and prefetch their descriptors, so
        // the cache misses on lines the driver just wrote overlap.
        const GROUP: usize = 32;
        let mut heads = [0u16; GROUP];
        let mut done = 0;
        while done < n {
            let g = (n - done).min(GROUP);
            for (k, h) in heads[..g].iter_mut().enumerate() {
                let slot = (self.next_avail.wrapping_add(k as u16) & self.mask) as usize;
                *h = self.read_u16(self.avail, AVAIL_RING + 2 * slot);
                if *h < self.cfg.size {
                    // SAFETY: h < size, so the address is inside the descriptor table.
                    prefetch(unsafe { self.desc.add(*h as usize * 16) });
                }
            }
            if !self.pop_group(batch, &heads[..g], access) {
                break;
            }
            done += g;
        }
        if !batch.chains.is_empty() {
            self.stats.chains += batch.chains.len() as u64;
            self.stats.batches += 1;
        }
        batch.chains.len()
    }

    /// Parses the chains of `heads` (already read from the avail ring).
    /// Returns false if the batch must end here.
    fn pop_group(&mut self, batch: &mut Batch, heads: &[u16], access: Access) -> bool {
        for &head in heads {
            self.next_avail = self.next_avail.wrapping_add(1);
            if head >= self.cfg.size {
                // No descriptor to give back: the ring itself is corrupt.
                self.stats.count(ChainError::IndexOutOfRange);
                self.broken = true;
                return false;
            }
            let seg_start = batch.segs.len();
            // Fast path: one direct descriptor inside one region (what
            // network drivers post almost always).
            let d = Self::read_desc(self.desc, head);
            if d.flags & (VRING_DESC_F_NEXT | VRING_DESC_F_INDIRECT) == 0 && d.len != 0 {
                let write = d.flags & VRING_DESC_F_WRITE != 0;
                let direction_ok = match access {
                    Access::ReadOnly => !write,
                    Access::WriteOnly => write,
                    Access::ReadThenWrite => true,
                };
                if direction_ok {
                    if let Some(addr) = self.mem.translate(d.addr, d.len as u64, &mut self.region_hint) {
                        prefetch_buffer(addr, write);
                        batch.segs.push(Seg { addr, len: d.len });
                        let (n_read, n_write) = if write { (0, 1) } else { (1, 0) };
                        batch.chains.push(Chain {
                            head,
                            seg_start: seg_start as u32,
                            n_read,
                            n_write,
                            read_len: if write { 0 } else { d.len },
                            write_len: if write { d.len } else { 0 },
                        });
                        self.stats.fast_chains += 1;
                        continue;
                    }
                }
            }
            match self.parse_chain(head, batch, access) {
                Ok(mut chain) => {
                    chain.seg_start = seg_start as u32;
                    batch.chains.push(chain);
                }
                Err(_) if !batch.chains.is_empty() => {
                    // End the batch before a bad chain so that good chains
                    // stay contiguous at its end; the next batch starts with
                    // this one and completes it.
                    batch.segs.truncate(seg_start);
                    self.next_avail = self.next_avail.wrapping_sub(1);
                    batch.ended_before_bad = true;
                    return false;
                }
                Err(e) => {
                    batch.segs.truncate(seg_start);
                    self.stats.count(e);
                    self.add_used(head, 0);
                }
            }
        }
        true
    }

    /// Walks one chain from `head`, appending its segments to `batch.segs`.
    fn parse_chain(&mut self, head: u16, batch: &mut Batch, access: Access) -> Result<Chain, ChainError> {
        let mut chain = Chain { head, ..Chain::default() };
        let (mut read_len, mut write_len) = (0u64, 0u64);
        let mut table = self.desc;
        let mut table_len = self.cfg.size;
        let mut in_indirect = false;
        let mut idx = head;
        let mut budget = self.cfg.size as u32;
        loop {
            if budget == 0 {
                return Err(ChainError::TooLong);
            }
            budget -= 1;
            let d = Self::read_desc(table, idx);
            if d.flags & VRING_DESC_F_INDIRECT != 0 {
                if !self.indirect || in_indirect || d.flags & VRING_DESC_F_NEXT != 0 {
                    return Err(ChainError::BadIndirect);
                }
                if d.len == 0 || !d.len.is_multiple_of(16) || d.len / 16 > MAX_QUEUE_SIZE as u32 {
                    return Err(ChainError::BadIndirect);
                }
                // An indirect table must be contiguous in host memory.
                let t =
                    self.mem.translate(d.addr, d.len as u64, &mut self.region_hint).ok_or(ChainError::BadAddress)?;
                if !d.addr.is_multiple_of(16) {
                    // read_desc copes with any alignment (read_desc_words),
                    // but the spec requires 16-byte alignment; refuse sloppiness.
                    return Err(ChainError::BadIndirect);
                }
                table = t;
                table_len = (d.len / 16) as u16;
                in_indirect = true;
                budget = table_len as u32;
                idx = 0;
                continue;
            }
            let write = d.flags & VRING_DESC_F_WRITE != 0;
            match (access, write) {
                (Access::ReadOnly, true) | (Access::WriteOnly, false) => return Err(ChainError::WrongDirection),
                // Readable after writable breaks the spec's ordering rule.
                (Access::ReadThenWrite, false) if chain.n_write > 0 => return Err(ChainError::WrongDirection),
                _ => {}
            }
            if d.len > 0 {
                let mem = &*self.mem;
                let segs = &mut batch.segs;
                let mut pieces = 0u16;
                let ok = mem.for_each_piece(d.addr, d.len as u64, &mut self.region_hint, |p, n| {
                    segs.push(Seg { addr: p, len: n as u32 });
                    pieces += 1;
                });
                if !ok {
                    return Err(ChainError::BadAddress);
                }
                if write {
                    chain.n_write = chain.n_write.checked_add(pieces).ok_or(ChainError::TooLong)?;
                    write_len += d.len as u64;
                } else {
                    chain.n_read = chain.n_read.checked_add(pieces).ok_or(ChainError::TooLong)?;
                    read_len += d.len as u64;
                }
            }
            if d.flags & VRING_DESC_F_NEXT == 0 {
                break;
            }
            if d.next >= table_len {
                return Err(ChainError::IndexOutOfRange);
            }
            idx = d.next;
        }
        if read_len > u32::MAX as u64 || write_len > u32::MAX as u64 {
            return Err(ChainError::TooBig);
        }
        chain.read_len = read_len as u32;
        chain.write_len = write_len as u32;
        Ok(chain)
    }

    /// Gives back the last `n` chains of the last `pop_batch` unprocessed
    /// (the device could not use them now); they will be popped again.
    /// `n` must not exceed the number of chains that batch returned.
    pub fn unpop(&mut self, n: u16) {
        self.next_avail = self.next_avail.wrapping_sub(n);
    }

    /// Writes one used element; invisible to the driver until `publish_used`.
    #[inline]
    pub fn add_used(&mut self, head: u16, len: u32) {
        let slot = (self.next_used & self.mask) as usize;
        let elem = (head as u64) | ((len as u64) << 32);
        // SAFETY: slot < size and the used ring was translated with room for
        // `size` 8-byte elements after its 4-byte header; 4-byte alignment of
        // the ring makes the element 4-aligned, so write it as two u32s.
        unsafe {
            let p = self.used.add(USED_RING + 8 * slot) as *mut u32;
            std::ptr::write_volatile(p, (elem as u32).to_le());
            std::ptr::write_volatile(p.add(1), ((elem >> 32) as u32).to_le());
        }
        self.next_used = self.next_used.wrapping_add(1);
    }

    /// `add_used`: a split ring takes used elements in any order.
    #[inline]
    pub fn add_used_id(&mut self, head: u16, len: u32) {
        self.add_used(head, len)
    }

    /// Completes every chain in `chains` (popped in this order, the oldest
    /// first) as read with nothing written. With IN_ORDER that is one used
    /// element, the last chain's, and used.idx moves by the whole batch
    /// (virtio 1.2, 2.7.9): the driver takes the ones before it as used.
    #[inline]
    pub fn add_used_read_only(&mut self, chains: &[Chain]) {
        match chains {
            [] => {}
            [.., last] if self.in_order => {
                self.add_used(last.head, 0);
                let skipped = chains.len() as u16 - 1;
                self.next_used = self.next_used.wrapping_add(skipped);
                self.stats.used_skipped += skipped as u64;
            }
            _ => {
                for c in chains {
                    self.add_used(c.head, 0);
                }
            }
        }
    }

    /// Makes all used elements written so far visible with one used.idx store.
    #[inline]
    pub fn publish_used(&mut self) {
        // Used elements must be visible before the index that publishes them.
        fence(Ordering::Release);
        self.write_u16(self.used, USED_IDX, self.next_used);
        self.published_used = self.next_used;
        self.stats.used_publishes += 1;
    }

    /// Publishes used elements if any are unpublished; returns whether it did.
    #[inline]
    pub fn flush_used(&mut self) -> bool {
        if self.next_used == self.published_used {
            return false;
        }
        self.publish_used();
        true
    }

    /// Whether the driver wants an interrupt for what was published since
    /// the last call (EVENT_IDX's used_event, or NO_INTERRUPT without it).
    pub fn needs_notify(&mut self) -> bool {
        let new = self.next_used;
        let old = self.signalled_used;
        let valid = self.signalled_valid;
        self.signalled_used = new;
        self.signalled_valid = true;
        if valid && old == new {
            return false;
        }
        // Our used.idx store must be visible before we read the driver's
        // suppression state, or both sides may decide to sleep.
        fence(Ordering::SeqCst);
        if self.event_idx {
            let used_event = self.read_u16(self.avail, AVAIL_RING + 2 * self.cfg.size as usize);
            !valid || need_event(used_event, new, old)
        } else {
            self.read_u16(self.avail, AVAIL_FLAGS) & VRING_AVAIL_F_NO_INTERRUPT == 0
        }
    }

    /// Asks the driver not to kick (while we busy-poll or are processing).
    pub fn disable_notifications(&mut self) {
        if self.notifications_disabled {
            return;
        }
        self.notifications_disabled = true;
        if !self.event_idx {
            self.write_u16(self.used, USED_FLAGS, VRING_USED_F_NO_NOTIFY);
        }
        // With EVENT_IDX, leaving avail_event behind suppresses kicks.
    }

    /// Asks the driver to kick on new buffers. Returns true if buffers
    /// arrived meanwhile: the caller must process them rather than sleep.
    pub fn enable_notifications(&mut self) -> bool {
        self.notifications_disabled = false;
        if self.event_idx {
            let off = USED_RING + 8 * self.cfg.size as usize;
            self.write_u16(self.used, off, self.next_avail);
        } else {
            self.write_u16(self.used, USED_FLAGS, 0);
        }
        // The driver must see our request before we re-check the ring.
        fence(Ordering::SeqCst);
        // A broken ring has nothing more to give: sleep on it.
        !self.broken && self.avail_idx() != self.next_avail
    }
}

/// Hints the CPU to fetch the cache line at `p` (no effect on correctness).
#[inline(always)]
pub fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch never faults, whatever the address; SSE is baseline on x86_64.
    #[allow(unused_unsafe)]
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Hints the CPU to fetch the cache line at `p` for writing.
#[inline(always)]
pub fn prefetch_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetchw never faults and changes no architectural state;
    // CPUs without PRFCHW execute it as a no-op.
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly))
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Starts fetching the first line of a buffer just popped, for writing if
/// the device will write it: the driver touched it last, so the line is in
/// the other core's cache, and fetching it while the rest of the batch is
/// popped overlaps those misses instead of paying them one by one at the
/// first copy (the single largest cost of the RX pass in `perf`).
#[inline(always)]
pub fn prefetch_buffer(p: *const u8, write: bool) {
    if write {
        prefetch_write(p)
    } else {
        prefetch(p)
    }
}

/// Copies `src` into the segments starting `skip` bytes in; returns bytes copied.
#[inline]
pub fn copy_to_segs(segs: &[Seg], mut skip: usize, mut src: &[u8]) -> usize {
    let mut copied = 0;
    for s in segs {
        let len = s.len as usize;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(src.len());
        // SAFETY: the segment is guest memory translated with its length;
        // skip + n <= len. The guest may write concurrently; a byte copy of
        // shared memory is what every virtio device does.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), s.addr.add(skip), n) };
        src = &src[n..];
        copied += n;
        skip = 0;
        if src.is_empty() {
            break;
        }
    }
    copied
}

/// Copies from the segments, starting `skip` bytes in, into `dst`; returns bytes copied.
#[inline]
pub fn copy_from_segs(segs: &[Seg], mut skip: usize, dst: &mut [u8]) -> usize {
    let mut copied = 0;
    for s in segs {
        let len = s.len as usize;
        if skip >= len {
            skip -= len;
            continue;
        }
        let n = (len - skip).min(dst.len() - copied);
        // SAFETY: as copy_to_segs; dst has room for n more bytes.
        unsafe { std::ptr::copy_nonoverlapping(s.addr.add(skip), dst.as_mut_ptr().add(copied), n) };
        copied += n;
        skip = 0;
        if copied == dst.len() {
            break;
        }
    }
    copied
}
