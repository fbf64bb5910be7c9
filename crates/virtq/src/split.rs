//! Device side of a split virtqueue (virtio 1.2, section 2.7).
//!
//! We do not use the `virtio-queue` crate here: it has no batched used
//! publish, ignores NO_INTERRUPT and binary-searches the region table on every
//! access. This queue translates the three ring addresses once at set-up,
//! reads `avail.idx` once per batch, keeps a last-hit region cache for
//! buffers, and stores `used.idx` once per batch. It reaches the rings only
//! through the guest-memory fence (`guest::SplitRing`): no raw pointer here.
//!
//! Everything read from guest memory is hostile: indexes, lengths, addresses,
//! flags and chains are validated; a bad chain is completed with length 0 and
//! counted, a broken ring (avail.idx running ahead by more than the queue
//! size, a head index past the queue) marks the queue broken so the device
//! can ask for a reset. Nothing here panics on guest input.

use crate::chain::{check_indirect, overlaps, take_single, ChainWalk};
use crate::guest::{DescTable, GuestMemory, SplitRing};
use crate::ring::*;
use crate::{Access, Batch, Chain, ChainError, QueueStats, RingAddrs, SetupError};
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

/// Where a split ring lives (guest-physical addresses) and where processing resumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SplitConfig {
    /// Queue size (power of two, 1..=32768).
    pub size: u16,
    /// Descriptor table address.
    pub desc: u64,
    /// Available ring address.
    pub avail: u64,
    /// Used ring address.
    pub used: u64,
    /// Negotiated device features (INDIRECT_DESC, EVENT_IDX and IN_ORDER matter here).
    pub features: u64,
    /// Next available index to process (SET_VRING_BASE).
    pub next_avail: u16,
}

/// The device side of one split virtqueue.
pub struct SplitQueue {
    mem: Arc<GuestMemory>,
    cfg: SplitConfig,
    ring: SplitRing,
    /// Where used-ring stores are logged, if not at the used ring.
    used_log: Option<u64>,
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

#[derive(Clone, Copy)]
struct Desc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

impl Desc {
    #[inline(always)]
    fn read(table: &DescTable, i: u16) -> Desc {
        let (addr, rest) = table.read(i);
        Desc { addr, len: rest as u32, flags: (rest >> 32) as u16, next: (rest >> 48) as u16 }
    }
}

impl SplitQueue {
    /// Sets up a ring: checks the size, the alignment and overlap of the
    /// three areas, translates them once, and reads used.idx to resume from.
    pub fn new(mem: Arc<GuestMemory>, cfg: SplitConfig) -> Result<SplitQueue, SetupError> {
        let n = cfg.size;
        if n == 0 || n > MAX_QUEUE_SIZE || !n.is_power_of_two() {
            return Err(SetupError::BadSize);
        }
        if !cfg.desc.is_multiple_of(16) || !cfg.avail.is_multiple_of(2) || !cfg.used.is_multiple_of(4) {
            return Err(SetupError::Misaligned);
        }
        let (dlen, alen, ulen) = (desc_table_size(n), avail_ring_size(n), used_ring_size(n));
        if overlaps(cfg.used, ulen, cfg.desc, dlen) || overlaps(cfg.used, ulen, cfg.avail, alen) {
            return Err(SetupError::Overlap);
        }
        let ring = SplitRing::new(&mem, cfg.desc, cfg.avail, cfg.used, n)?;
        let used = ring.used_idx();
        Ok(SplitQueue {
            mem,
            cfg,
            ring,
            used_log: None,
            event_idx: cfg.features & features::EVENT_IDX != 0,
            indirect: cfg.features & features::INDIRECT_DESC != 0,
            in_order: cfg.features & features::IN_ORDER != 0,
            next_avail: cfg.next_avail,
            avail_seen: cfg.next_avail,
            next_used: used,
            published_used: used,
            signalled_used: 0,
            signalled_valid: false,
            notifications_disabled: false,
            region_hint: 0,
            broken: false,
            stats: QueueStats::default(),
        })
    }

    /// The same ring over a new memory table (after SET_MEM_TABLE or
    /// ADD/REM_MEM_REG), at `at` in it, keeping its position and counters.
    pub fn remap(&self, mem: Arc<GuestMemory>, at: RingAddrs) -> Result<SplitQueue, SetupError> {
        let mut cfg = self.cfg;
        cfg.next_avail = self.next_avail;
        (cfg.desc, cfg.avail, cfg.used) = (at.desc, at.driver, at.device);
        let mut q = SplitQueue::new(mem, cfg)?;
        q.next_used = self.next_used;
        q.published_used = self.published_used;
        q.stats = self.stats;
        q.broken = self.broken;
        q.set_used_log(self.used_log);
        Ok(q)
    }

    /// Logs used-ring stores at guest-physical `gpa` (vhost-user's
    /// log_guest_addr, given with VHOST_VRING_F_LOG), or, with None, where
    /// the used ring is. Matters only while the memory has a dirty log.
    pub fn set_used_log(&mut self, gpa: Option<u64>) {
        self.used_log = gpa;
        self.ring.log_used_at(gpa.unwrap_or(self.cfg.used));
    }

    /// Where the ring's areas sit in guest-physical memory.
    pub fn addrs(&self) -> RingAddrs {
        RingAddrs { desc: self.cfg.desc, driver: self.cfg.avail, device: self.cfg.used }
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
        self.ring.used_idx()
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
    /// False too, taking nothing, when `batch` holds chains of another
    /// memory table.
    pub fn repop(&mut self, head: u16, batch: &mut Batch, access: Access) -> bool {
        if self.broken || head >= self.cfg.size || !batch.hold(&self.mem) {
            return false;
        }
        let seg_start = batch.segs.len();
        match self.parse_chain(head, batch, access) {
            Ok(chain) => {
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

    /// Starts fetching the lines the next pop reads first: avail.idx and
    /// the next avail entry (no effect on correctness).
    #[inline]
    pub fn prefetch_next(&self) {
        self.ring.prefetch_avail(self.next_avail);
    }

    /// How many chains the driver has made available and we have not popped
    /// (reads avail.idx). Marks the ring broken if avail.idx ran ahead by
    /// more than the queue size.
    pub fn pending(&mut self) -> u16 {
        // A broken ring offers nothing (its worker may sleep).
        if self.broken {
            return 0;
        }
        let idx = self.ring.avail_idx();
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
        batch.start(&self.mem);
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
                *h = self.ring.avail_entry(self.next_avail.wrapping_add(k as u16));
                // A prefetch never faults: no need to check `h` first.
                self.ring.desc.prefetch(*h);
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
            let d = Desc::read(&self.ring.desc, head);
            if take_single(batch, &self.mem, &mut self.region_hint, head, d.addr, d.len, d.flags, access) {
                self.stats.fast_chains += 1;
                continue;
            }
            match self.parse_chain(head, batch, access) {
                Ok(chain) => batch.chains.push(chain),
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
        let mut walk = ChainWalk::new(batch);
        let mut table = self.ring.desc;
        let mut in_indirect = false;
        let mut idx = head;
        let mut budget = self.cfg.size as u32;
        loop {
            if budget == 0 {
                return Err(ChainError::TooLong);
            }
            budget -= 1;
            let d = Desc::read(&table, idx);
            if d.flags & VRING_DESC_F_INDIRECT != 0 {
                check_indirect(self.indirect, in_indirect, d.flags, d.addr, d.len)?;
                // An indirect table must be contiguous in host memory.
                table = DescTable::indirect(&self.mem, d.addr, d.len, &mut self.region_hint)
                    .ok_or(ChainError::BadAddress)?;
                in_indirect = true;
                budget = table.len() as u32;
                idx = 0;
                continue;
            }
            let write = d.flags & VRING_DESC_F_WRITE != 0;
            walk.add(batch, &self.mem, &mut self.region_hint, d.addr, d.len, write, access)?;
            if d.flags & VRING_DESC_F_NEXT == 0 {
                break;
            }
            if d.next >= table.len() {
                return Err(ChainError::IndexOutOfRange);
            }
            idx = d.next;
        }
        walk.finish(head)
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
        self.ring.set_used_elem(self.next_used, head, len);
        self.next_used = self.next_used.wrapping_add(1);
    }

    /// `add_used` for each chain, chain `j` with `lens[j]` bytes written.
    #[inline]
    pub fn add_used_batch(&mut self, chains: &[Chain], lens: &[u32]) {
        for (c, &len) in chains.iter().zip(lens) {
            self.add_used(c.head, len);
        }
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
        self.ring.set_used_idx(self.next_used);
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
            let used_event = self.ring.used_event();
            !valid || need_event(used_event, new, old)
        } else {
            self.ring.avail_flags() & VRING_AVAIL_F_NO_INTERRUPT == 0
        }
    }

    /// Asks the driver not to kick (while we busy-poll or are processing).
    pub fn disable_notifications(&mut self) {
        if self.notifications_disabled {
            return;
        }
        self.notifications_disabled = true;
        if !self.event_idx {
            self.ring.set_used_flags(VRING_USED_F_NO_NOTIFY);
        }
        // With EVENT_IDX, leaving avail_event behind suppresses kicks.
    }

    /// Asks the driver to kick on new buffers. Returns true if buffers
    /// arrived meanwhile: the caller must process them rather than sleep.
    pub fn enable_notifications(&mut self) -> bool {
        self.notifications_disabled = false;
        if self.event_idx {
            self.ring.set_avail_event(self.next_avail);
        } else {
            self.ring.set_used_flags(0);
        }
        // The driver must see our request before we re-check the ring.
        fence(Ordering::SeqCst);
        // A broken ring has nothing more to give: sleep on it.
        !self.broken && self.ring.avail_idx() != self.next_avail
    }
}

#[cfg(test)]
mod tests {
    //! The ring's own accessors over memory the test writes as a driver
    //! would; small enough to run under Miri (which checks every access the
    //! fence makes). The driver-side and hostile cases are in tests/.
    use super::*;
    use crate::{Mapping, Region};

    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const BUFS: u64 = 0x4000;

    fn memory() -> Arc<GuestMemory> {
        let m = Arc::new(Mapping::anonymous(0x8000).unwrap());
        Arc::new(GuestMemory::from_regions(vec![Region::new(0, 0x8000, m, 0).unwrap()]).unwrap())
    }

    fn desc(mem: &GuestMemory, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        assert!(mem.write(DESC + 16 * i as u64, &d));
    }

    fn r16(mem: &GuestMemory, gpa: u64) -> u16 {
        let mut b = [0u8; 2];
        assert!(mem.read(gpa, &mut b));
        u16::from_le_bytes(b)
    }

    #[test]
    fn chains_pop_complete_and_publish_through_the_fence() {
        let mem = memory();
        let cfg =
            SplitConfig { size: 8, desc: DESC, avail: AVAIL, used: USED, features: features::EVENT_IDX, next_avail: 0 };
        let mut q = SplitQueue::new(mem.clone(), cfg).unwrap();
        // Chain 0: one readable buffer; chain 3: readable then writable.
        desc(&mem, 0, BUFS, 64, 0, 0);
        desc(&mem, 3, BUFS + 0x100, 16, VRING_DESC_F_NEXT, 5);
        desc(&mem, 5, BUFS + 0x200, 32, VRING_DESC_F_WRITE, 0);
        assert!(mem.write(BUFS, &[7u8; 64]));
        for (slot, head) in [0u16, 3].iter().enumerate() {
            assert!(mem.write(AVAIL + 4 + 2 * slot as u64, &head.to_le_bytes()));
        }
        assert!(mem.write(AVAIL + 2, &2u16.to_le_bytes()));
        // A prefetch changes nothing the pop sees.
        q.prefetch_next();
        let mut b = Batch::new();
        assert_eq!(q.pop_batch(&mut b, 8, Access::ReadThenWrite), 2);
        let (c0, c1) = (b.chains[0], b.chains[1]);
        assert_eq!((c0.head, c0.read_len, c0.write_len), (0, 64, 0));
        assert_eq!((c1.head, c1.read_len, c1.write_len), (3, 16, 32));
        let mut got = [0u8; 64];
        assert_eq!(b.readable(&c0).read(0, &mut got), 64);
        assert_eq!(got, [7u8; 64]);
        assert_eq!(b.writable(&c1).write(0, &[9u8; 40]), 32, "the buffer ends first");
        q.add_used(c0.head, 0);
        q.add_used(c1.head, 32);
        assert_eq!(r16(&mem, USED + 2), 0, "not visible before the publish");
        q.publish_used();
        assert_eq!(r16(&mem, USED + 2), 2);
        assert_eq!((r16(&mem, USED + 4 + 8), r16(&mem, USED + 4 + 8 + 4)), (3, 32), "second used element");
        assert!(q.needs_notify(), "first decision with EVENT_IDX");
        assert!(!q.enable_notifications(), "nothing new");
        assert_eq!(r16(&mem, USED + 4 + 8 * 8), 2, "avail_event");
        // A head past the ring breaks it.
        assert!(mem.write(AVAIL + 4 + 2 * 2, &9u16.to_le_bytes()));
        assert!(mem.write(AVAIL + 2, &3u16.to_le_bytes()));
        assert_eq!(q.pop_batch(&mut b, 8, Access::ReadThenWrite), 0);
        assert!(q.is_broken());
    }

    #[test]
    fn each_store_marks_its_page_at_the_time_it_is_made() {
        // The log is cleared between stores: a migration may copy a page in
        // between, so each store must mark it again.
        let logmap = Arc::new(Mapping::anonymous(4096).unwrap());
        let log = Arc::new(crate::DirtyLog::new(logmap.clone(), 0, 4096).unwrap());
        let mem = Arc::new(memory().with_log(Some(log.clone())));
        let cfg = SplitConfig { size: 8, desc: DESC, avail: AVAIL, used: USED, features: 0, next_avail: 0 };
        let mut q = SplitQueue::new(mem, cfg).unwrap();
        let page = |gpa: u64| gpa / crate::LOG_PAGE;
        let clear = || logmap.fill(0, 4096, 0);
        clear();
        q.add_used(0, 0);
        assert!(log.is_marked(page(USED)), "the used element");
        clear();
        q.publish_used();
        assert!(log.is_marked(page(USED)), "used.idx");
        clear();
        q.disable_notifications();
        assert!(log.is_marked(page(USED)), "used.flags");
        clear();
        let mut ev = SplitQueue::new(
            q.memory().clone(),
            SplitConfig { size: 8, desc: DESC, avail: AVAIL, used: USED, features: features::EVENT_IDX, next_avail: 0 },
        )
        .unwrap();
        ev.enable_notifications();
        assert!(log.is_marked(page(USED + 4 + 8 * 8)), "avail_event");
    }
}
