//! Device side of a packed virtqueue (virtio 1.2, section 2.8).
//!
//! One descriptor ring shared both ways: the driver marks descriptors
//! available by setting AVAIL = its wrap counter and USED = its inverse; the
//! device writes one used descriptor per chain (AVAIL = USED = its wrap
//! counter) over the chain's first slot and skips the rest. Two 4-byte event
//! suppression areas replace the split ring's flags and event indexes.
//!
//! Batching: used descriptors of a batch are written with their flags
//! straight away except the first one and those after it in its cache line;
//! `publish_used` stores those and then the first one's flag word last, so
//! the driver, which only ever polls the next slot, sees the whole batch at
//! once (one publishing store per batch, as with used.idx).
//!
//! The queue remembers each popped chain's descriptor count in a FIFO,
//! which is what its used descriptor skips. `add_used` completes the oldest
//! chain (the net paths complete in pop order); `add_used_id` completes the
//! chain with a given buffer id wherever it is (virtio-blk requests finish
//! in any order). The driver's buffer ids are only echoed back and compared,
//! never used as indexes.
//!
//! Everything read from the ring is hostile, as in `split.rs`: a bad chain is
//! completed with length 0 and counted; a chain whose later descriptors are
//! not available, or that is longer than the ring, leaves no way to find
//! where the next chain starts, so it marks the queue broken.

use crate::chain::{check_indirect, overlaps, take_single, ChainWalk};
use crate::guest::{DescTable, GuestMemory, PackedRing, Seg};
use crate::ring::*;
use crate::{Access, Batch, Chain, ChainError, QueueStats, RingAddrs, SetupError};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

/// Where a packed ring lives and where processing resumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackedConfig {
    /// Queue size (1..=32768, not necessarily a power of two).
    pub size: u16,
    /// Descriptor ring address (guest-physical).
    pub desc: u64,
    /// Driver event suppression area (SET_VRING_ADDR's avail address).
    pub driver: u64,
    /// Device event suppression area (SET_VRING_ADDR's used address).
    pub device: u64,
    /// Negotiated device features (INDIRECT_DESC and EVENT_IDX matter here).
    pub features: u64,
    /// The vhost-user vring base: bits 0-14 next avail index, bit 15 avail
    /// wrap counter, bits 16-30 used index, bit 31 used wrap counter. When
    /// bits 16-31 are zero the used position equals the avail position (a
    /// frontend that only knows the avail half; nothing in flight).
    pub base: u32,
}

/// Initial vring base of a fresh packed ring: index 0, wrap counters 1.
pub const PACKED_BASE_INITIAL: u32 = 0x8000_8000;

/// A ring position: slot index and the wrap counter that goes with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pos {
    idx: u16,
    wrap: bool,
}

impl Pos {
    #[inline]
    fn advance(self, n: u16, size: u16) -> Pos {
        let i = self.idx as u32 + n as u32;
        if i >= size as u32 {
            Pos { idx: (i - size as u32) as u16, wrap: !self.wrap }
        } else {
            Pos { idx: i as u16, wrap: self.wrap }
        }
    }

    /// Position as a counter modulo 2 * size (what event offsets compare in).
    #[inline]
    fn linear(self, size: u16) -> u32 {
        self.idx as u32 + if self.wrap { 0 } else { size as u32 }
    }

    /// The 16-bit encoding of the vring base and event offsets.
    #[inline]
    fn encode(self) -> u16 {
        self.idx | ((self.wrap as u16) << 15)
    }

    fn decode(v: u16) -> Pos {
        Pos { idx: v & 0x7fff, wrap: v & 0x8000 != 0 }
    }
}

/// `i` modulo `n` for `i < 2n` (no division in the hot path).
#[inline]
fn wrap_index(i: usize, n: usize) -> usize {
    if i >= n {
        i - n
    } else {
        i
    }
}

/// A popped chain not yet used: where it starts and how many ring slots it takes.
#[derive(Clone, Copy, Debug, Default)]
struct Popped {
    start: u16,
    start_wrap: bool,
    ndesc: u16,
    /// The chain's buffer id.
    id: u16,
}

/// A used descriptor not yet stored in the ring.
#[derive(Clone, Copy, Debug, Default)]
struct UsedDesc {
    slot: u16,
    flags: u16,
    len: u32,
    id: u16,
}

/// The device side of one packed virtqueue.
pub struct PackedQueue {
    mem: Arc<GuestMemory>,
    cfg: PackedConfig,
    ring: PackedRing,
    event_idx: bool,
    indirect: bool,
    in_order: bool,
    next_avail: Pos,
    next_used: Pos,
    /// Popped, not yet used chains, oldest first (a ring of `size` entries).
    popped: Vec<Popped>,
    popped_head: usize,
    popped_len: usize,
    /// The first used descriptor of the unpublished batch, stored whole
    /// at publish.
    pending_first: Option<UsedDesc>,
    /// Used descriptors after it in its cache line, stored at publish too.
    line_mates: [UsedDesc; 3],
    n_line_mates: u8,
    /// next_used as of the last notify decision.
    signalled_used: Pos,
    signalled_valid: bool,
    notifications_disabled: bool,
    region_hint: usize,
    broken: bool,
    /// Counters.
    pub stats: QueueStats,
}

#[derive(Clone, Copy)]
struct PDesc {
    addr: u64,
    len: u32,
    id: u16,
    flags: u16,
}

impl PDesc {
    #[inline(always)]
    fn read(table: &DescTable, i: u16) -> PDesc {
        PDesc::from_words(table.read(i))
    }

    #[inline(always)]
    fn from_words((addr, rest): (u64, u64)) -> PDesc {
        PDesc { addr, len: rest as u32, id: (rest >> 32) as u16, flags: (rest >> 48) as u16 }
    }
}

/// `GuestMemory::seg` out of line: `pop4`'s rare miss of the region hint,
/// kept from growing the four-descriptor path (and its register use).
#[cold]
#[inline(never)]
fn seg_searched(mem: &GuestMemory, gpa: u64, len: u32, hint: &mut usize) -> Option<Seg> {
    mem.seg(gpa, len, hint)
}

/// How a chain walk ended.
enum Walk {
    /// The chain (or its error) and how many ring slots it spans.
    Done(Result<Chain, ChainError>, u16, u16),
    /// The ring is corrupt: no way to find the next chain.
    Broken(ChainError),
}

impl PackedQueue {
    /// Sets up a ring: checks the size and alignment, translates the
    /// descriptor ring and both event areas once, positions from `cfg.base`.
    pub fn new(mem: Arc<GuestMemory>, cfg: PackedConfig) -> Result<PackedQueue, SetupError> {
        let n = cfg.size;
        if n == 0 || n > MAX_QUEUE_SIZE {
            return Err(SetupError::BadSize);
        }
        if !cfg.desc.is_multiple_of(16) || !cfg.driver.is_multiple_of(4) || !cfg.device.is_multiple_of(4) {
            return Err(SetupError::Misaligned);
        }
        let dlen = desc_table_size(n);
        if overlaps(cfg.device, 4, cfg.desc, dlen) || overlaps(cfg.device, 4, cfg.driver, 4) {
            return Err(SetupError::Overlap);
        }
        let avail = Pos::decode(cfg.base as u16);
        let used = if cfg.base >> 16 == 0 { avail } else { Pos::decode((cfg.base >> 16) as u16) };
        if avail.idx >= n || used.idx >= n {
            return Err(SetupError::BadBase);
        }
        // Positions on a cycle of two laps (the wrap counter starts at 1):
        // avail is ahead of used by less than a ring (exactly a ring apart
        // reads the same as used a lap ahead: refused too), never behind.
        let lap = |p: Pos| p.idx as u32 + if p.wrap { 0 } else { n as u32 };
        if (lap(avail) + 2 * n as u32 - lap(used)) % (2 * n as u32) >= n as u32 {
            return Err(SetupError::BadBase);
        }
        let ring = PackedRing::new(&mem, cfg.desc, cfg.driver, cfg.device, n)?;
        Ok(PackedQueue {
            mem,
            cfg,
            ring,
            event_idx: cfg.features & features::EVENT_IDX != 0,
            indirect: cfg.features & features::INDIRECT_DESC != 0,
            in_order: cfg.features & features::IN_ORDER != 0,
            next_avail: avail,
            next_used: used,
            popped: vec![Popped::default(); n as usize],
            popped_head: 0,
            popped_len: 0,
            pending_first: None,
            line_mates: [UsedDesc::default(); 3],
            n_line_mates: 0,
            signalled_used: used,
            signalled_valid: false,
            notifications_disabled: false,
            region_hint: 0,
            broken: false,
            stats: QueueStats::default(),
        })
    }

    /// The same ring over a new memory table, at `at` in it, keeping
    /// position, counters and chains in flight.
    pub fn remap(&self, mem: Arc<GuestMemory>, at: RingAddrs) -> Result<PackedQueue, SetupError> {
        let mut cfg = self.cfg;
        cfg.base = self.vring_base();
        (cfg.desc, cfg.driver, cfg.device) = (at.desc, at.driver, at.device);
        let mut q = PackedQueue::new(mem, cfg)?;
        // Positions and chains in flight carry over as they are (the base
        // encoding cannot say "used at slot 0 of the second lap").
        q.next_avail = self.next_avail;
        q.next_used = self.next_used;
        q.popped.clone_from(&self.popped);
        q.popped_head = self.popped_head;
        q.popped_len = self.popped_len;
        q.stats = self.stats;
        q.broken = self.broken;
        // An unpublished batch is published through the new mapping.
        q.pending_first = self.pending_first;
        q.line_mates = self.line_mates;
        q.n_line_mates = self.n_line_mates;
        Ok(q)
    }

    /// Where the ring's areas sit in guest-physical memory.
    pub fn addrs(&self) -> RingAddrs {
        RingAddrs { desc: self.cfg.desc, driver: self.cfg.driver, device: self.cfg.device }
    }

    /// Queue size.
    pub fn size(&self) -> u16 {
        self.ring.desc.len()
    }

    /// The memory table this ring reads.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        &self.mem
    }

    /// What GET_VRING_BASE returns: next avail index and wrap counter in the
    /// low half, next used index and wrap counter in the high half.
    pub fn vring_base(&self) -> u32 {
        self.next_avail.encode() as u32 | (self.next_used.encode() as u32) << 16
    }

    /// True once the driver broke the ring (the device should ask for reset).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    #[inline(always)]
    fn slot_flags(&self, idx: u16) -> u16 {
        self.ring.flags(idx)
    }

    #[inline]
    fn is_avail(flags: u16, wrap: bool) -> bool {
        let a = flags & VRING_PACKED_DESC_F_AVAIL != 0;
        let u = flags & VRING_PACKED_DESC_F_USED != 0;
        a == wrap && u != wrap
    }

    /// How many chains to plan for: `want` if the next slot is available,
    /// else 0. Only an upper bound (counting chains means reading every flag
    /// word, which `pop_batch` does anyway); callers pop what is there.
    #[inline]
    pub fn available(&mut self, want: u16) -> u16 {
        if self.broken || !Self::is_avail(self.slot_flags(self.next_avail.idx), self.next_avail.wrap) {
            return 0;
        }
        want
    }

    /// Counts the available chains by their flags. A chain cut short (its
    /// head available, a later slot not: impossible from a correct driver)
    /// counts too, so that `pop_batch` gets to reject it.
    pub fn pending(&mut self) -> u16 {
        if self.broken {
            return 0;
        }
        let want = self.ring.desc.len();
        let mut pos = self.next_avail;
        let mut chains = 0;
        let mut seen = 0u16;
        let mut in_chain = false;
        while chains < want && seen < self.ring.desc.len() {
            let f = self.slot_flags(pos.idx);
            if !Self::is_avail(f, pos.wrap) {
                break;
            }
            seen += 1;
            in_chain = f & VRING_DESC_F_NEXT != 0;
            if !in_chain {
                chains += 1;
            }
            pos = pos.advance(1, self.ring.desc.len());
        }
        if in_chain && chains < want {
            chains += 1;
        }
        chains
    }

    /// Pops up to `max` chains into `batch` (cleared first). Bad chains are
    /// completed with length 0, counted and not returned; like the split
    /// ring, a bad chain after good ones ends the batch and is handled first
    /// in the next. Returns the number of chains in `batch`.
    pub fn pop_batch(&mut self, batch: &mut Batch, max: usize, access: Access) -> usize {
        batch.start(&self.mem);
        if self.broken {
            return 0;
        }
        // Ring slots not popped or popped and used. A driver reuses a slot
        // only after it is used, so a chain that needs more than these wrote
        // over descriptors still in flight. Counted down here rather than
        // recomputed per chain.
        let mut room = (self.ring.desc.len() as u32).saturating_sub(self.slots_in_flight());
        self.prefetch_next();
        // At most `size` chains can be popped and not yet used.
        while batch.chains.len() < max && self.popped_len < self.popped.len() {
            let pos = self.next_avail;
            let flags = self.slot_flags(pos.idx);
            if !Self::is_avail(flags, pos.wrap) {
                break;
            }
            if room == 0 {
                self.stats.count(ChainError::TooLong);
                self.broken = true;
                break;
            }
            // Four simple descriptors in a row (one cache line when the ring
            // is 64-aligned): check their flags together, take them together.
            if max - batch.chains.len() >= 4 && room >= 4 && self.pop4(pos, batch, access) {
                room -= 4;
                continue;
            }
            // Read the descriptor only after seeing its flags.
            fence(Ordering::Acquire);
            let seg_start = batch.segs.len();
            let d = PDesc::read(&self.ring.desc, pos.idx);
            if take_single(batch, &self.mem, &mut self.region_hint, d.id, d.addr, d.len, d.flags, access) {
                self.push_popped(pos, 1, d.id);
                self.next_avail = pos.advance(1, self.ring.desc.len());
                self.stats.fast_chains += 1;
                room -= 1;
                continue;
            }
            let walk = match self.walk_chain(pos, batch, access) {
                Walk::Done(_, ndesc, _) if ndesc as u32 > room => Walk::Broken(ChainError::TooLong),
                w => w,
            };
            match walk {
                Walk::Broken(e) => {
                    batch.segs.truncate(seg_start);
                    self.stats.count(e);
                    self.broken = true;
                    break;
                }
                Walk::Done(Ok(chain), ndesc, _) => {
                    let id = chain.head;
                    batch.chains.push(chain);
                    self.push_popped(pos, ndesc, id);
                    self.next_avail = pos.advance(ndesc, self.ring.desc.len());
                    room -= ndesc as u32;
                }
                Walk::Done(Err(_), _, _) if !batch.chains.is_empty() || self.popped_len != 0 => {
                    // Used descriptors go out in pop order: complete this one
                    // when everything before it is used (next batch).
                    batch.segs.truncate(seg_start);
                    batch.ended_before_bad = true;
                    break;
                }
                Walk::Done(Err(e), ndesc, id) => {
                    batch.segs.truncate(seg_start);
                    self.stats.count(e);
                    // Popped and used at once (nothing was in flight): no
                    // change to `room`.
                    self.push_popped(pos, ndesc, id);
                    self.next_avail = pos.advance(ndesc, self.ring.desc.len());
                    self.add_used(id, 0);
                }
            }
        }
        if !batch.chains.is_empty() {
            self.stats.chains += batch.chains.len() as u64;
            self.stats.batches += 1;
        }
        batch.chains.len()
    }

    /// Ring slots between the used and the avail position: those of the
    /// chains popped and not yet used.
    #[inline]
    fn slots_in_flight(&self) -> u32 {
        let (a, u) = (self.next_avail.linear(self.ring.desc.len()), self.next_used.linear(self.ring.desc.len()));
        // Positions on a cycle of 2 x size; no division on this path.
        if a >= u {
            a - u
        } else {
            a + 2 * self.ring.desc.len() as u32 - u
        }
    }

    /// Takes four single-descriptor chains at `pos` if all four are
    /// available, simple (no NEXT or INDIRECT, not empty), of the direction
    /// `access` wants and inside guest memory; otherwise takes nothing.
    #[inline]
    fn pop4(&mut self, pos: Pos, batch: &mut Batch, access: Access) -> bool {
        if pos.idx as u32 + 4 > self.ring.desc.len() as u32 || self.popped.len() - self.popped_len < 4 {
            return false;
        }
        let want_dir = match access {
            Access::ReadOnly => 0,
            Access::WriteOnly => VRING_DESC_F_WRITE,
            Access::ReadThenWrite => return false,
        };
        let avail = if pos.wrap { VRING_PACKED_DESC_F_AVAIL } else { VRING_PACKED_DESC_F_USED };
        let mask = VRING_PACKED_DESC_F_AVAIL
            | VRING_PACKED_DESC_F_USED
            | VRING_DESC_F_NEXT
            | VRING_DESC_F_INDIRECT
            | VRING_DESC_F_WRITE;
        let want = avail | want_dir;
        let Some(next) = self.ring.flags_after(pos.idx) else { return false };
        if next.iter().any(|&f| f & mask != want) {
            return false;
        }
        fence(Ordering::Acquire);
        let Some(words) = self.ring.desc.read4(pos.idx) else { return false };
        let d = words.map(PDesc::from_words);
        let mut segs = [Seg::default(); 4];
        // The region of the last hit holds nearly every buffer: looked up
        // without a store to the hint, and with the search out of line,
        // its bounds stay in registers across the four.
        let mut hint = self.region_hint;
        for k in 0..4 {
            if d[k].len == 0 || d[k].flags & mask != want {
                return false;
            }
            segs[k] = match self.mem.seg_at_hint(d[k].addr, d[k].len, hint) {
                Some(s) => s,
                None => match seg_searched(&self.mem, d[k].addr, d[k].len, &mut hint) {
                    Some(s) => s,
                    None => return false,
                },
            };
        }
        self.region_hint = hint;
        let write = want_dir != 0;
        if !write {
            // Buffers to read; buffers to write are the caller's to
            // prefetch, a few at a time (see vhostd-net's RX).
            for s in &segs {
                s.prefetch();
            }
        }
        // Four at once: one capacity check per array, not one per push.
        let (seg_start, first) = (batch.segs.len(), batch.chains.len());
        batch.segs.reserve(4);
        batch.chains.reserve(4);
        let (n_read, n_write) = (!write as u16, write as u16);
        // SAFETY: `reserve(4)` made room for four more elements in each
        // vector; all four are written before the lengths cover them.
        unsafe {
            let (sp, cp) = (batch.segs.as_mut_ptr().add(seg_start), batch.chains.as_mut_ptr().add(first));
            for k in 0..4 {
                sp.add(k).write(segs[k]);
                cp.add(k).write(Chain {
                    head: d[k].id,
                    seg_start: (seg_start + k) as u32,
                    n_read,
                    n_write,
                    read_len: if write { 0 } else { d[k].len },
                    write_len: if write { d[k].len } else { 0 },
                });
            }
            batch.segs.set_len(seg_start + 4);
            batch.chains.set_len(first + 4);
        }
        // pos.idx + 4 <= size (checked above): the four slots do not wrap.
        let tail = self.popped_head + self.popped_len;
        let n = self.popped.len();
        if tail + 4 <= n {
            for (k, p) in self.popped[tail..tail + 4].iter_mut().enumerate() {
                *p = Popped { start: pos.idx + k as u16, start_wrap: pos.wrap, ndesc: 1, id: d[k].id };
            }
            self.popped_len += 4;
        } else {
            for (k, dk) in d.iter().enumerate() {
                self.push_popped(Pos { idx: pos.idx + k as u16, wrap: pos.wrap }, 1, dk.id);
            }
        }
        self.next_avail = pos.advance(4, self.ring.desc.len());
        self.stats.fast_chains += 4;
        self.stats.batch4 += 1;
        // The next group's line, while this one is copied.
        self.prefetch_next();
        true
    }

    /// Starts fetching the ring line of the next slot to pop, for writing:
    /// the used descriptors go back into the slots read, and a line fetched
    /// for reading costs a second cross-CPU transfer, from the driver, at
    /// the first used write. No effect on correctness.
    #[inline]
    pub fn prefetch_next(&self) {
        self.ring.desc.prefetch_write(self.next_avail.idx);
    }

    #[inline]
    fn push_popped(&mut self, start: Pos, ndesc: u16, id: u16) {
        let n = self.popped.len();
        let i = wrap_index(self.popped_head + self.popped_len, n);
        self.popped[i] = Popped { start: start.idx, start_wrap: start.wrap, ndesc, id };
        self.popped_len += 1;
    }

    /// Walks the chain starting at `start` (whose flags showed it available),
    /// appending segments to `batch.segs`. After an error it keeps walking
    /// (without collecting) to find where the chain ends.
    fn walk_chain(&mut self, start: Pos, batch: &mut Batch, access: Access) -> Walk {
        let mut walk = ChainWalk::new(batch);
        let mut result: Result<(), ChainError> = Ok(());
        let mut pos = start;
        let mut n = 0u16;
        loop {
            if n == self.ring.desc.len() {
                // Every slot carries NEXT: a chain longer than the ring.
                return Walk::Broken(ChainError::TooLong);
            }
            let d = PDesc::read(&self.ring.desc, pos.idx);
            if n > 0 && !Self::is_avail(d.flags, pos.wrap) {
                // The driver makes a chain's first descriptor available last;
                // a later one that is not available means a corrupt ring.
                return Walk::Broken(ChainError::IndexOutOfRange);
            }
            n += 1;
            if result.is_ok() {
                result = self.take_desc(&d, n == 1, &mut walk, batch, access);
            }
            if d.flags & VRING_DESC_F_NEXT == 0 {
                let id = d.id;
                return Walk::Done(result.and_then(|_| walk.finish(id)), n, id);
            }
            pos = pos.advance(1, self.ring.desc.len());
        }
    }

    /// Adds one ring descriptor (direct or an indirect table) to the walk.
    fn take_desc(
        &mut self,
        d: &PDesc,
        first: bool,
        walk: &mut ChainWalk,
        batch: &mut Batch,
        access: Access,
    ) -> Result<(), ChainError> {
        let write = |flags: u16| flags & VRING_DESC_F_WRITE != 0;
        if d.flags & VRING_DESC_F_INDIRECT == 0 {
            return walk.add(batch, &self.mem, &mut self.region_hint, d.addr, d.len, write(d.flags), access);
        }
        // An indirect descriptor must be the whole chain (not linked by NEXT).
        check_indirect(self.indirect, !first, d.flags, d.addr, d.len)?;
        let table =
            DescTable::indirect(&self.mem, d.addr, d.len, &mut self.region_hint).ok_or(ChainError::BadAddress)?;
        for i in 0..table.len() {
            let e = PDesc::read(&table, i);
            // Only WRITE is meaningful in a table; an indirect inside one is
            // never what a driver meant.
            if e.flags & VRING_DESC_F_INDIRECT != 0 {
                return Err(ChainError::BadIndirect);
            }
            walk.add(batch, &self.mem, &mut self.region_hint, e.addr, e.len, write(e.flags), access)?;
        }
        Ok(())
    }

    /// Gives back the last `n` chains popped and not yet used; they will be
    /// popped again.
    pub fn unpop(&mut self, n: u16) {
        let n = (n as usize).min(self.popped_len);
        if n == 0 {
            return;
        }
        self.popped_len -= n;
        let i = wrap_index(self.popped_head + self.popped_len, self.popped.len());
        let p = self.popped[i];
        self.next_avail = Pos { idx: p.start, wrap: p.start_wrap };
    }

    /// Completes the oldest popped chain with buffer id `id` and `len` bytes
    /// written; invisible to the driver until `publish_used`.
    #[inline(always)]
    pub fn add_used(&mut self, id: u16, len: u32) {
        if self.popped_len == 0 {
            return;
        }
        let p = self.popped[self.popped_head];
        self.popped_head = wrap_index(self.popped_head + 1, self.popped.len());
        self.popped_len -= 1;
        let slot = self.next_used.idx;
        let mut flags = if self.next_used.wrap { VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED } else { 0 };
        if len != 0 {
            flags |= VRING_DESC_F_WRITE;
        }
        let used = UsedDesc { slot, flags, len, id };
        match self.pending_first {
            None => self.pending_first = Some(used),
            // A driver waiting for this batch polls the first descriptor's
            // line. Each store into that line while it polls takes the
            // line back from the driver's CPU, so the batch's stores into
            // it wait for publish and go together.
            Some(first) if self.n_line_mates < 3 && self.ring.same_line(first.slot, slot) => {
                self.line_mates[self.n_line_mates as usize] = used;
                self.n_line_mates += 1;
            }
            // The driver reaches this slot only after the batch's first,
            // which is published last. len, id and flags go in one aligned
            // 8-byte store, which the driver sees whole: one store per used
            // descriptor instead of three.
            Some(_) => self.ring.set_len_id_flags(slot, len, id, flags),
        }
        self.next_used = self.next_used.advance(p.ndesc, self.ring.desc.len());
    }

    /// Completes the popped chain with buffer id `id` (the oldest such, if a
    /// driver reuses ids), wherever it is in pop order; its used descriptor
    /// goes in the next used slot and skips that chain's descriptor count,
    /// as the driver expects of out-of-order completions (virtio 1.2,
    /// 2.8.21.2). Does nothing if no popped chain has that id.
    pub fn add_used_id(&mut self, id: u16, len: u32) {
        let n = self.popped.len();
        let Some(k) = (0..self.popped_len).find(|&k| self.popped[wrap_index(self.popped_head + k, n)].id == id) else {
            return;
        };
        // Move it to the front: the ones before it keep their order.
        let found = self.popped[wrap_index(self.popped_head + k, n)];
        for j in (0..k).rev() {
            self.popped[wrap_index(self.popped_head + j + 1, n)] = self.popped[wrap_index(self.popped_head + j, n)];
        }
        self.popped[self.popped_head] = found;
        self.add_used(id, len);
    }

    /// Completes `chains`, the oldest popped and not yet used, as read with
    /// nothing written. With IN_ORDER that is one used descriptor with the
    /// last chain's id, skipping the slots of all of them (virtio 1.2, 2.8.9).
    #[inline]
    pub fn add_used_read_only(&mut self, chains: &[Chain]) {
        match chains {
            [] => {}
            [.., last] if self.in_order && self.popped_len >= chains.len() => {
                // Fold the batch's slot counts into the last one: add_used
                // then writes one descriptor and skips them all.
                let k = chains.len() - 1;
                let slots = self.oldest_popped_slots(k);
                self.popped_head = wrap_index(self.popped_head + k, self.popped.len());
                self.popped_len -= k;
                let p = &mut self.popped[self.popped_head];
                // A batch never exceeds the ring, so the sum fits.
                p.ndesc = (slots + p.ndesc as u32).min(self.ring.desc.len() as u32) as u16;
                self.add_used(last.head, 0);
                self.stats.used_skipped += chains.len() as u64 - 1;
            }
            _ => self.add_used_each(chains, |_| 0),
        }
    }

    /// The ring slots of the `k` oldest popped chains (`k <= popped_len`),
    /// summed over one or two plain slices of the FIFO: a loop stepping
    /// popped_head one entry at a time, a wrap check per chain each
    /// depending on the last, was 20 % of process_tx's samples in the
    /// packed loop benchmark.
    #[inline]
    fn oldest_popped_slots(&self, k: usize) -> u32 {
        let (n, h) = (self.popped.len(), self.popped_head);
        let sum = |s: &[Popped]| s.iter().map(|p| p.ndesc as u32).sum::<u32>();
        if h + k <= n {
            sum(&self.popped[h..h + k])
        } else {
            sum(&self.popped[h..]) + sum(&self.popped[..h + k - n])
        }
    }

    /// Completes `chains`, the oldest popped, in pop order: chain `j` with
    /// `lens[j]` bytes written (`lens` as long as `chains`); what `add_used`
    /// per chain does, in one pass where it can.
    #[inline]
    pub fn add_used_batch(&mut self, chains: &[Chain], lens: &[u32]) {
        let n = chains.len().min(lens.len());
        let (chains, lens) = (&chains[..n], &lens[..n]);
        self.add_used_each(chains, |j| lens[j]);
    }

    /// `add_used(chains[j].head, len(j))` for each chain: in one pass
    /// (`add_used_singles`) when the batch has that shape, else one by one.
    #[inline(always)]
    fn add_used_each(&mut self, chains: &[Chain], len: impl Fn(usize) -> u32) {
        if self.add_used_singles(chains, &len) {
            return;
        }
        for (j, c) in chains.iter().enumerate() {
            self.add_used(c.head, len(j));
        }
    }

    /// `add_used(chains[j].head, len(j))` for each chain in one pass, when
    /// they are the oldest popped, each one slot long, and their used
    /// descriptors neither wrap the ring nor join an unpublished batch: a
    /// common TX or RX batch of single-descriptor buffers. The same stores
    /// as the calls (the first descriptor and its line mates at publish, the
    /// rest at once), without the FIFO and line checks per chain. False,
    /// having done nothing, when the batch is not of that shape.
    #[inline(always)]
    fn add_used_singles(&mut self, chains: &[Chain], len: impl Fn(usize) -> u32) -> bool {
        let (k, start) = (chains.len(), self.next_used);
        if k == 0
            || self.pending_first.is_some()
            || k > self.popped_len
            || start.idx as usize + k > self.ring.desc.len() as usize
            // Every chain takes a slot at least: k slots means one each.
            || self.oldest_popped_slots(k) != k as u32
        {
            return false;
        }
        let lap = if start.wrap { VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED } else { 0 };
        let used = |j: usize| {
            let len = len(j);
            // As in add_used: WRITE says the buffer was written.
            let flags = if len != 0 { lap | VRING_DESC_F_WRITE } else { lap };
            UsedDesc { slot: start.idx + j as u16, flags, len, id: chains[j].head }
        };
        self.pending_first = Some(used(0));
        let mut j = 1;
        while j < k && j <= 3 && self.ring.same_line(start.idx, start.idx + j as u16) {
            self.line_mates[j - 1] = used(j);
            j += 1;
        }
        self.n_line_mates = (j - 1) as u8;
        for o in j..k {
            let u = used(o);
            self.ring.set_len_id_flags(u.slot, u.len, u.id, u.flags);
        }
        self.popped_head = wrap_index(self.popped_head + k, self.popped.len());
        self.popped_len -= k;
        self.next_used = start.advance(k as u16, self.ring.desc.len());
        true
    }

    /// Makes the used descriptors written so far visible: one flags store.
    #[inline]
    pub fn publish_used(&mut self) {
        if let Some(first) = self.pending_first.take() {
            self.ring.set_len_id(first.slot, first.len, first.id);
            for m in &self.line_mates[..self.n_line_mates as usize] {
                self.ring.set_len_id_flags(m.slot, m.len, m.id, m.flags);
            }
            self.n_line_mates = 0;
            fence(Ordering::Release);
            self.ring.set_flags(first.slot, first.flags);
            self.stats.used_publishes += 1;
        }
    }

    /// Publishes used descriptors if any are unpublished; returns whether it did.
    #[inline]
    pub fn flush_used(&mut self) -> bool {
        let any = self.pending_first.is_some();
        self.publish_used();
        any
    }

    /// Whether the driver wants an interrupt for what was published since
    /// the last call (its event suppression area: enable, disable, or the
    /// descriptor offset with EVENT_IDX).
    pub fn needs_notify(&mut self) -> bool {
        let new = self.next_used;
        let old = self.signalled_used;
        let valid = self.signalled_valid;
        self.signalled_used = new;
        self.signalled_valid = true;
        if valid && old == new {
            return false;
        }
        // Our used flags must be visible before we read the driver's
        // suppression state, or both sides may decide to sleep.
        fence(Ordering::SeqCst);
        match self.ring.driver_event_flags() & 3 {
            RING_EVENT_FLAGS_DISABLE => false,
            RING_EVENT_FLAGS_DESC if self.event_idx => {
                if !valid {
                    return true;
                }
                let ev = Pos::decode(self.ring.driver_event_off_wrap());
                if ev.idx >= self.ring.desc.len() {
                    return true;
                }
                let m = 2 * self.ring.desc.len() as u32;
                let (e, n, o) = (
                    ev.linear(self.ring.desc.len()),
                    new.linear(self.ring.desc.len()),
                    old.linear(self.ring.desc.len()),
                );
                // The event position lies in [old, new): it was just used.
                (n + m - e - 1) % m < (n + m - o) % m
            }
            _ => true,
        }
    }

    /// Asks the driver not to kick.
    pub fn disable_notifications(&mut self) {
        if self.notifications_disabled {
            return;
        }
        self.notifications_disabled = true;
        self.ring.set_device_event_flags(RING_EVENT_FLAGS_DISABLE);
    }

    /// Asks the driver to kick on new buffers. Returns true if buffers
    /// arrived meanwhile: the caller must process them rather than sleep.
    pub fn enable_notifications(&mut self) -> bool {
        self.notifications_disabled = false;
        self.ring.set_device_event_flags(RING_EVENT_FLAGS_ENABLE);
        // The driver must see our request before we re-check the ring.
        fence(Ordering::SeqCst);
        !self.broken && Self::is_avail(self.slot_flags(self.next_avail.idx), self.next_avail.wrap)
    }
}

#[cfg(test)]
mod tests {
    //! The ring's own accessors over memory the test writes as a driver
    //! would; small enough to run under Miri. The driver-side and hostile
    //! cases are in tests/packed_ring.rs.
    use super::*;
    use crate::{Mapping, Region};

    const RING: u64 = 0x1000;
    const DRIVER: u64 = 0x2000;
    const DEVICE: u64 = 0x2010;
    const BUFS: u64 = 0x4000;

    fn memory() -> Arc<GuestMemory> {
        let m = Arc::new(Mapping::anonymous(0x8000).unwrap());
        Arc::new(GuestMemory::from_regions(vec![Region::new(0, 0x8000, m, 0).unwrap()]).unwrap())
    }

    /// A fresh 8-entry ring at RING / DRIVER / DEVICE.
    fn ring_of_8(features: u64) -> PackedConfig {
        PackedConfig { size: 8, desc: RING, driver: DRIVER, device: DEVICE, features, base: PACKED_BASE_INITIAL }
    }

    /// Makes slot `i` available in the first lap.
    fn avail(mem: &GuestMemory, i: u16, addr: u64, len: u32, id: u16, flags: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&id.to_le_bytes());
        d[14..16].copy_from_slice(&(flags | VRING_PACKED_DESC_F_AVAIL).to_le_bytes());
        assert!(mem.write(RING + 16 * i as u64, &d));
    }

    fn slot(mem: &GuestMemory, i: u16) -> (u32, u16, u16) {
        let mut d = [0u8; 16];
        assert!(mem.read(RING + 16 * i as u64, &mut d));
        let u16_at = |o: usize| u16::from_le_bytes([d[o], d[o + 1]]);
        (u32::from_le_bytes([d[8], d[9], d[10], d[11]]), u16_at(12), u16_at(14))
    }

    /// Four buffers alternating between two regions: the group of four
    /// misses the region hint three times and still takes each buffer from
    /// its own region. A group with a buffer outside memory, or one running
    /// past its region's end, is not taken as a group: its chains go one by
    /// one, and the bad one is refused.
    #[test]
    fn a_group_of_four_across_two_regions() {
        let low = Arc::new(Mapping::anonymous(0x8000).unwrap());
        let high = Arc::new(Mapping::anonymous(0x1000).unwrap());
        let regions = vec![Region::new(0, 0x8000, low, 0).unwrap(), Region::new(0x10000, 0x1000, high, 0).unwrap()];
        let mem = Arc::new(GuestMemory::from_regions(regions).unwrap());
        let addr = |i: u16| if i.is_multiple_of(2) { BUFS + 0x100 * i as u64 } else { 0x10000 + 0x100 * i as u64 };
        // Past the high region's end: starting there, or running over it.
        for bad in [0x10000 + 0x1000, 0x10000 + 0x1000 - 8] {
            let mut q = PackedQueue::new(mem.clone(), ring_of_8(0)).unwrap();
            for i in 0..4 {
                assert!(mem.write(addr(i), &[i as u8 + 1; 16]));
                avail(&mem, i, addr(i), 16, 10 + i, 0);
            }
            let mut b = Batch::new();
            assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 4);
            assert_eq!(q.stats.batch4, 1);
            for (i, c) in b.chains.iter().enumerate() {
                assert_eq!(c.head, 10 + i as u16);
                let mut got = [0u8; 16];
                assert_eq!(b.readable(c).read(0, &mut got), 16);
                assert_eq!(got, [i as u8 + 1; 16], "chain {i} read another region's bytes");
            }
            for c in b.chains.clone() {
                q.add_used(c.head, 0);
            }
            q.publish_used();
            // Slots 4-7: the third buffer is bad.
            for i in 4..8 {
                avail(&mem, i, if i == 6 { bad } else { addr(i) }, 16, 10 + i, 0);
            }
            assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 2, "the two chains before the bad one");
            assert_eq!(q.stats.batch4, 1, "not taken as a group");
            assert!(b.ended_before_bad);
            assert_eq!(b.chains.iter().map(|c| c.head).collect::<Vec<_>>(), [14, 15]);
            for c in b.chains.clone() {
                q.add_used(c.head, 0);
            }
            q.publish_used();
            // The bad chain is refused (used with length 0), the last taken.
            assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1);
            assert_eq!(b.chains[0].head, 17);
            assert_eq!(q.stats.bad_address, 1, "buffer at {bad:#x}");
        }
    }

    #[test]
    fn groups_of_four_chains_and_used_descriptors_through_the_fence() {
        let mem = memory();
        let cfg = ring_of_8(features::EVENT_IDX);
        let mut q = PackedQueue::new(mem.clone(), cfg).unwrap();
        for i in 0..4 {
            avail(&mem, i, BUFS + 0x100 * i as u64, 60, 10 + i, VRING_DESC_F_WRITE);
        }
        // A two-slot chain after them.
        avail(&mem, 4, BUFS + 0x400, 8, 0, VRING_DESC_F_NEXT | VRING_DESC_F_WRITE);
        avail(&mem, 5, BUFS + 0x500, 8, 20, VRING_DESC_F_WRITE);
        // A prefetch changes nothing the pop sees.
        q.prefetch_next();
        let mut b = Batch::new();
        assert_eq!(q.pop_batch(&mut b, 8, Access::WriteOnly), 5);
        assert_eq!(q.stats.batch4, 1);
        let heads: Vec<u16> = b.chains.iter().map(|c| c.head).collect();
        assert_eq!(heads, [10, 11, 12, 13, 20]);
        assert_eq!(b.writable(&b.chains[4]).bytes(), 16);
        for c in b.chains.clone() {
            b.writable(&c).write(0, &[c.head as u8; 4]);
            q.add_used(c.head, 4);
        }
        let used = VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED | VRING_DESC_F_WRITE;
        assert_ne!(slot(&mem, 0).2 & VRING_PACKED_DESC_F_USED, VRING_PACKED_DESC_F_USED, "first flags stored last");
        q.publish_used();
        assert_eq!(slot(&mem, 0), (4, 10, used));
        assert_eq!(slot(&mem, 3), (4, 13, used));
        assert_eq!(slot(&mem, 4), (4, 20, used), "the chain's used descriptor sits at its first slot");
        let mut got = [0u8; 4];
        assert!(mem.read(BUFS + 0x100, &mut got));
        assert_eq!(got, [11; 4]);
        q.disable_notifications();
        let mut flags = [0u8; 2];
        assert!(mem.read(DEVICE + 2, &mut flags));
        assert_eq!(u16::from_le_bytes(flags), RING_EVENT_FLAGS_DISABLE);
        assert!(!q.enable_notifications(), "slot 6 is not available");
        assert_eq!(q.vring_base(), 6 | 0x8000 | ((6 | 0x8000) << 16));
    }

    #[test]
    fn an_unpublished_batch_survives_a_remap() {
        let mem = memory();
        let cfg = ring_of_8(0);
        let mut q = PackedQueue::new(mem.clone(), cfg).unwrap();
        for i in 0..6u16 {
            avail(&mem, i, BUFS + 0x100 * i as u64, 60, 20 + i, VRING_DESC_F_WRITE);
        }
        let mut b = Batch::new();
        assert_eq!(q.pop_batch(&mut b, 6, Access::WriteOnly), 6);
        for i in 0..6u16 {
            q.add_used(20 + i, 8 + i as u32);
        }
        // Slots 0-3 wait for the publish; 4 and 5 were stored at once.
        let avail_flags = VRING_DESC_F_WRITE | VRING_PACKED_DESC_F_AVAIL;
        assert_eq!(slot(&mem, 0), (60, 20, avail_flags));
        let mut q = q.remap(mem.clone(), q.addrs()).unwrap();
        q.publish_used();
        let used_flags = avail_flags | VRING_PACKED_DESC_F_USED;
        for i in 0..6u16 {
            assert_eq!(slot(&mem, i), (8 + i as u32, 20 + i, used_flags), "slot {i}");
        }
    }

    /// Two rings fed the same chains: one completes each batch in one or
    /// two calls (one pass where it can), the other with add_used chain by
    /// chain; every ring byte compared before and after each publish. Each
    /// round: the chains' slot counts, how many the first call completes
    /// (the rest go in a second call, on top of an unpublished batch), and
    /// whether it ends with a publish. Run on an 8-slot ring at a 64-byte
    /// line start and on a 7-slot ring 16 bytes into a line.
    fn batch_stores_what_add_used_per_chain_would(access: Access, complete: fn(&mut PackedQueue, &[Chain])) {
        let rounds: [(&[u16], usize, bool); 7] = [
            (&[1, 1, 1, 1], 4, true),
            // Half a batch (more popped than completed), then the other
            // half on top of it.
            (&[1, 1], 1, true),
            (&[1, 1], 2, true),
            // Left unpublished: the next round joins it.
            (&[1, 1, 1], 3, false),
            (&[1, 1, 1], 3, true),
            (&[1, 1, 1], 3, true),
            // A two-slot chain (the per-chain path).
            (&[1, 2], 2, true),
        ];
        for (size, desc) in [(8u16, RING), (7, RING + 16)] {
            let (mem_a, mem_b) = (memory(), memory());
            let cfg = PackedConfig { size, desc, ..ring_of_8(0) };
            let mut qa = PackedQueue::new(mem_a.clone(), cfg).unwrap();
            let mut qb = PackedQueue::new(mem_b.clone(), cfg).unwrap();
            let (mut ba, mut bb) = (Batch::new(), Batch::new());
            let ring = |mem: &GuestMemory| {
                let mut r = vec![0u8; size as usize * 16];
                assert!(mem.read(desc, &mut r));
                r
            };
            let write = if access == Access::WriteOnly { VRING_DESC_F_WRITE } else { 0 };
            let mut next = 0u16;
            for (round, &(chains, first, publish)) in rounds.iter().enumerate() {
                for (c, &len) in chains.iter().enumerate() {
                    for s in 0..len {
                        let slot = (next + s) % size;
                        // The driver's flags: AVAIL = its wrap counter, USED its inverse.
                        let lap = if ((next + s) / size).is_multiple_of(2) {
                            VRING_PACKED_DESC_F_AVAIL
                        } else {
                            VRING_PACKED_DESC_F_USED
                        };
                        let flags = lap | write | if s + 1 < len { VRING_DESC_F_NEXT } else { 0 };
                        let id = 10 * round as u16 + c as u16;
                        let mut d = [0u8; 16];
                        d[0..8].copy_from_slice(&(BUFS + 0x100 * slot as u64).to_le_bytes());
                        d[8..12].copy_from_slice(&60u32.to_le_bytes());
                        d[12..14].copy_from_slice(&id.to_le_bytes());
                        d[14..16].copy_from_slice(&flags.to_le_bytes());
                        for mem in [&mem_a, &mem_b] {
                            assert!(mem.write(desc + 16 * slot as u64, &d));
                        }
                    }
                    next += len;
                }
                assert_eq!(qa.pop_batch(&mut ba, 8, access), chains.len());
                assert_eq!(qb.pop_batch(&mut bb, 8, access), chains.len());
                complete(&mut qa, &ba.chains[..first]);
                complete(&mut qa, &ba.chains[first..]);
                for c in &bb.chains {
                    qb.add_used(c.head, used_len(access, c.head));
                }
                let at = format!("ring of {size}, round {round}");
                assert_eq!(ring(&mem_a), ring(&mem_b), "{at}, before the publish");
                if publish {
                    qa.publish_used();
                    qb.publish_used();
                    assert_eq!(ring(&mem_a), ring(&mem_b), "{at}");
                }
                assert_eq!(qa.vring_base(), qb.vring_base(), "{at}");
            }
            // Chains already used again (none in flight): nothing changes.
            complete(&mut qa, &ba.chains);
            for c in &bb.chains {
                qb.add_used(c.head, used_len(access, c.head));
            }
            qa.publish_used();
            assert_eq!(ring(&mem_a), ring(&mem_b), "ring of {size}, completed twice");
            // 20 slots: both positions there, on the lap after it.
            let pos = (20 % size) | if (20 / size).is_multiple_of(2) { 0x8000 } else { 0 };
            assert_eq!(qa.vring_base(), pos as u32 | (pos as u32) << 16, "ring of {size}");
        }
    }

    /// Bytes written into buffer `id` in these tests: none when read only;
    /// else some, except every third id (a buffer returned empty has no
    /// WRITE flag).
    fn used_len(access: Access, id: u16) -> u32 {
        if access == Access::ReadOnly || id.is_multiple_of(3) {
            0
        } else {
            40 + id as u32
        }
    }

    #[test]
    fn a_read_only_batch_stores_what_add_used_per_chain_would() {
        batch_stores_what_add_used_per_chain_would(Access::ReadOnly, |q, chains| q.add_used_read_only(chains));
    }

    #[test]
    fn a_written_batch_stores_what_add_used_per_chain_would() {
        batch_stores_what_add_used_per_chain_would(Access::WriteOnly, |q, chains| {
            let lens: Vec<u32> = chains.iter().map(|c| used_len(Access::WriteOnly, c.head)).collect();
            q.add_used_batch(chains, &lens)
        });
    }

    #[test]
    fn an_in_order_batch_skips_every_slot_across_both_wraps() {
        let mem = memory();
        let mut q = PackedQueue::new(mem.clone(), ring_of_8(features::IN_ORDER)).unwrap();
        let mut b = Batch::new();
        // Six chains used at once: the FIFO of popped chains starts at 6.
        for i in 0..6u16 {
            avail(&mem, i, BUFS + 0x100 * i as u64, 60, i, 0);
        }
        assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 6);
        q.add_used_read_only(&b.chains);
        q.publish_used();
        assert_eq!(q.vring_base(), 6 | 0x8000 | ((6 | 0x8000) << 16));
        // Slots 6 and 7, then 0-2 of the second lap (AVAIL clear, USED
        // set): four chains, the second two slots long, so the batch's
        // FIFO entries wrap (6, 7, 0, 1) and its slots wrap the ring.
        let lap2 = |i: u16, id: u16| {
            avail(&mem, i, BUFS + 0x100 * i as u64, 60, id, 0);
            assert!(mem.write(RING + 16 * i as u64 + 14, &VRING_PACKED_DESC_F_USED.to_le_bytes()));
        };
        avail(&mem, 6, BUFS + 0x600, 60, 30, 0);
        avail(&mem, 7, BUFS + 0x700, 60, 0, VRING_DESC_F_NEXT);
        lap2(0, 31);
        lap2(1, 32);
        lap2(2, 33);
        assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 4);
        q.add_used_read_only(&b.chains);
        q.publish_used();
        // One used descriptor, at slot 6 with the last chain's id; all five
        // slots skipped: both positions are at 3 of the second lap.
        let used = VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED;
        assert_eq!(slot(&mem, 6), (0, 33, used));
        assert_eq!(q.vring_base(), 3 | (3 << 16));
        assert_eq!(q.stats.used_skipped, 5 + 3);
    }

    #[test]
    fn each_store_marks_its_page_at_the_time_it_is_made() {
        // The log is cleared between the stores of one used descriptor: a
        // migration may copy the page in between, so each store must mark
        // it again (a page-level check at the end could not tell).
        let logmap = Arc::new(Mapping::anonymous(4096).unwrap());
        let log = Arc::new(crate::DirtyLog::new(logmap.clone(), 0, 4096).unwrap());
        let mem = Arc::new(memory().with_log(Some(log.clone())));
        let cfg = ring_of_8(0);
        let mut q = PackedQueue::new(mem.clone(), cfg).unwrap();
        avail(&mem, 0, BUFS, 60, 10, VRING_DESC_F_WRITE);
        avail(&mem, 1, BUFS + 0x100, 60, 11, VRING_DESC_F_WRITE);
        avail(&mem, 2, BUFS + 0x200, 60, 12, VRING_DESC_F_WRITE);
        let page = |gpa: u64| gpa / crate::LOG_PAGE;
        let clear = || logmap.fill(0, 4096, 0);
        let mut b = Batch::new();
        assert_eq!(q.pop_batch(&mut b, 1, Access::WriteOnly), 1);
        clear();
        q.add_used(10, 4);
        assert!(!log.is_marked(page(RING)), "the batch's first used descriptor waits for the publish");
        q.publish_used();
        assert!(log.is_marked(page(RING)), "the batch's first used descriptor, stored at the publish");
        avail(&mem, 3, BUFS + 0x300, 60, 13, VRING_DESC_F_WRITE);
        avail(&mem, 4, BUFS + 0x400, 60, 14, VRING_DESC_F_WRITE);
        assert_eq!(q.pop_batch(&mut b, 4, Access::WriteOnly), 4);
        // Slots 1-3 share the first's line and wait for the publish.
        clear();
        for id in 11..14 {
            q.add_used(id, 4);
        }
        assert!(!log.is_marked(page(RING)), "nothing in the first's line is stored before the publish");
        let avail_flags = VRING_DESC_F_WRITE | VRING_PACKED_DESC_F_AVAIL;
        assert_eq!(slot(&mem, 2), (60, 12, avail_flags), "nothing in the first's line before the publish");
        clear();
        q.add_used(14, 4);
        assert!(log.is_marked(page(RING + 64)), "a used descriptor past the first's line: one store, at once");
        clear();
        q.publish_used();
        assert!(log.is_marked(page(RING)), "the first's line, at the publish");
        let used_flags = VRING_DESC_F_WRITE | VRING_PACKED_DESC_F_AVAIL | VRING_PACKED_DESC_F_USED;
        for i in 1..5 {
            assert_eq!(slot(&mem, i), (4, 10 + i, used_flags), "slot {i}");
        }
        clear();
        q.disable_notifications();
        assert!(log.is_marked(page(DEVICE)), "the device event area");
    }
}
