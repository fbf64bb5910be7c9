//! What both ring layouts share: popped chains and the batch holding them,
//! the counters, the errors, and the walk that turns descriptors into
//! segments (the single-descriptor fast path and the general case).

use std::sync::Arc;

use crate::guest::{GuestBufs, GuestMemory, Seg};
use crate::ring::{MAX_QUEUE_SIZE, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};

/// One popped descriptor chain; its segments live in the owning `Batch`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Chain {
    /// What goes back in the used ring: the head index (split) or the
    /// buffer id (packed).
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
/// the hot path does not allocate. Holds the memory table the segments lie
/// in, so they stay mapped while the batch lives.
pub struct Batch {
    /// The chains, in the order they were popped.
    pub chains: Vec<Chain>,
    pub(crate) segs: Vec<Seg>,
    pub(crate) mem: Arc<GuestMemory>,
    /// The batch ended before a bad chain (which the next batch starts with).
    pub ended_before_bad: bool,
}

// SAFETY: the segments point into memory the batch's own table keeps
// mapped; nothing in a batch is tied to a thread.
unsafe impl Send for Batch {}

impl Default for Batch {
    fn default() -> Batch {
        Batch::new()
    }
}

impl Batch {
    /// Calls `f` with each chain in pop order, having called `fetch` (which
    /// starts cache-line fetches) for the chain FETCH_AHEAD places further
    /// on, and first for the first FETCH_AHEAD chains: the misses overlap
    /// the work on the chains before them, and at most FETCH_AHEAD chains'
    /// lines are in flight (a whole deep batch at once is more misses than
    /// a core keeps in flight). A batch of one chain fetches nothing.
    #[inline(always)]
    pub fn each_fetching_ahead(&self, fetch: impl Fn(&Chain), mut f: impl FnMut(&Chain)) {
        /// Requests ahead of the one being decoded whose lines are fetched.
        const FETCH_AHEAD: usize = 8;
        let ahead = if self.chains.len() > 1 { FETCH_AHEAD } else { 0 };
        self.chains.iter().take(ahead).for_each(&fetch);
        for (i, chain) in self.chains.iter().enumerate() {
            if let Some(c) = self.chains.get(i + ahead).filter(|_| ahead > 0) {
                fetch(c);
            }
            f(chain);
        }
    }

    /// An empty batch.
    pub fn new() -> Batch {
        Batch {
            chains: Vec::with_capacity(256),
            segs: Vec::with_capacity(1024),
            mem: Arc::new(GuestMemory::new()),
            ended_before_bad: false,
        }
    }

    /// Forgets all chains.
    pub fn clear(&mut self) {
        self.chains.clear();
        self.segs.clear();
        self.ended_before_bad = false;
    }

    /// Forgets all chains and lets go of the memory table they lay in (a
    /// ring handed back: its memory may be unmapped once nobody holds it).
    pub fn release(&mut self) {
        self.clear();
        if !self.mem.regions().is_empty() {
            self.mem = Arc::new(GuestMemory::new());
        }
    }

    /// Clears the batch for chains popped from `mem`.
    #[inline]
    pub(crate) fn start(&mut self, mem: &Arc<GuestMemory>) {
        self.clear();
        if !Arc::ptr_eq(&self.mem, mem) {
            self.mem = mem.clone();
        }
    }

    /// Makes sure the batch holds `mem` before segments of it are added to
    /// the chains already there: false (nothing changed) when those lie in
    /// another table, which the batch would stop holding.
    #[inline]
    pub(crate) fn hold(&mut self, mem: &Arc<GuestMemory>) -> bool {
        if Arc::ptr_eq(&self.mem, mem) {
            return true;
        }
        if !self.segs.is_empty() {
            return false;
        }
        self.mem = mem.clone();
        true
    }

    /// Number of chains.
    pub fn len(&self) -> usize {
        self.chains.len()
    }

    /// True when no chain was popped.
    pub fn is_empty(&self) -> bool {
        self.chains.is_empty()
    }

    /// Device-readable buffers of chain `c`.
    #[inline]
    pub fn readable(&self, c: &Chain) -> GuestBufs<'_> {
        let s = c.seg_start as usize;
        GuestBufs::new(&self.segs[s..s + c.n_read as usize], &self.mem)
    }

    /// Device-writable buffers of chain `c`.
    #[inline]
    pub fn writable(&self, c: &Chain) -> GuestBufs<'_> {
        let s = c.seg_start as usize + c.n_read as usize;
        GuestBufs::new(&self.segs[s..s + c.n_write as usize], &self.mem)
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

impl std::ops::AddAssign for QueueStats {
    fn add_assign(&mut self, b: QueueStats) {
        self.chains += b.chains;
        self.bad_chains += b.bad_chains;
        self.bad_index += b.bad_index;
        self.bad_loop += b.bad_loop;
        self.bad_address += b.bad_address;
        self.bad_direction += b.bad_direction;
        self.bad_indirect += b.bad_indirect;
        self.batches += b.batches;
        self.used_publishes += b.used_publishes;
        self.fast_chains += b.fast_chains;
        self.batch4 += b.batch4;
        self.used_skipped += b.used_skipped;
    }
}

/// Why a ring could not be set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetupError {
    /// Size zero, above 32768 or (split) not a power of two.
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

/// Whether two byte ranges overlap (ring set-up checks).
pub(crate) fn overlaps(a: u64, alen: u64, b: u64, blen: u64) -> bool {
    a < b.saturating_add(blen) && b < a.saturating_add(alen)
}

/// The single-descriptor fast path both layouts take first: one direct
/// descriptor (no NEXT, no INDIRECT), not empty, of a direction `access`
/// allows, inside one region (what network drivers post almost always).
/// Appends it to `batch` as chain `id` and, if the device will read it,
/// starts fetching its first line (the driver touched it last, so the line
/// is in the other core's cache, and fetching it while the rest of the
/// batch is popped overlaps those misses; buffers the device writes are
/// fetched by the caller, a few at a time). Returns false, having taken
/// nothing, for anything else.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn take_single(
    batch: &mut Batch,
    mem: &GuestMemory,
    hint: &mut usize,
    id: u16,
    addr: u64,
    len: u32,
    flags: u16,
    access: Access,
) -> bool {
    if flags & (VRING_DESC_F_NEXT | VRING_DESC_F_INDIRECT) != 0 || len == 0 {
        return false;
    }
    let write = flags & VRING_DESC_F_WRITE != 0;
    let direction_ok = match access {
        Access::ReadOnly => !write,
        Access::WriteOnly => write,
        Access::ReadThenWrite => true,
    };
    if !direction_ok {
        return false;
    }
    let Some(seg) = mem.seg(addr, len, hint) else { return false };
    if !write {
        // As in the packed ring's pop4: buffers to write are the caller's
        // to prefetch.
        seg.prefetch();
    }
    let seg_start = batch.segs.len() as u32;
    batch.segs.push(seg);
    batch.chains.push(Chain {
        head: id,
        seg_start,
        n_read: !write as u16,
        n_write: write as u16,
        read_len: if write { 0 } else { len },
        write_len: if write { len } else { 0 },
    });
    true
}

/// A chain being walked descriptor by descriptor (the general case):
/// checks each buffer's direction and address and appends its segments.
pub(crate) struct ChainWalk {
    chain: Chain,
    read_len: u64,
    write_len: u64,
}

impl ChainWalk {
    /// A walk whose segments start at the batch's current end.
    pub(crate) fn new(batch: &Batch) -> ChainWalk {
        ChainWalk { chain: Chain { seg_start: batch.segs.len() as u32, ..Chain::default() }, read_len: 0, write_len: 0 }
    }

    /// Adds one buffer (a direct descriptor, or an entry of an indirect table).
    /// Inlined into each ring's walk: a call per descriptor costs a blk
    /// request (three descriptors) ~5% of its cycles.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add(
        &mut self,
        batch: &mut Batch,
        mem: &GuestMemory,
        hint: &mut usize,
        addr: u64,
        len: u32,
        write: bool,
        access: Access,
    ) -> Result<(), ChainError> {
        match (access, write) {
            (Access::ReadOnly, true) | (Access::WriteOnly, false) => return Err(ChainError::WrongDirection),
            // Readable after writable breaks the spec's ordering rule.
            (Access::ReadThenWrite, false) if self.chain.n_write > 0 => return Err(ChainError::WrongDirection),
            _ => {}
        }
        if len == 0 {
            return Ok(());
        }
        let segs = &mut batch.segs;
        let mut pieces = 0u16;
        if let Some(s) = mem.seg_at_hint(addr, len, *hint) {
            segs.push(s);
            pieces = 1;
        } else if !mem.for_each_seg(addr, len as u64, hint, |s| {
            segs.push(s);
            pieces = pieces.saturating_add(1);
        }) {
            return Err(ChainError::BadAddress);
        }
        if write {
            self.chain.n_write = self.chain.n_write.checked_add(pieces).ok_or(ChainError::TooLong)?;
            self.write_len += len as u64;
        } else {
            self.chain.n_read = self.chain.n_read.checked_add(pieces).ok_or(ChainError::TooLong)?;
            self.read_len += len as u64;
        }
        Ok(())
    }

    /// The chain, answered with `head`; refused when a total does not fit
    /// 32 bits.
    pub(crate) fn finish(self, head: u16) -> Result<Chain, ChainError> {
        if self.read_len > u32::MAX as u64 || self.write_len > u32::MAX as u64 {
            return Err(ChainError::TooBig);
        }
        Ok(Chain { head, read_len: self.read_len as u32, write_len: self.write_len as u32, ..self.chain })
    }
}

/// Checks an indirect descriptor's table: the feature negotiated, not
/// linked by NEXT (or inside another table), a length that is a non-zero
/// multiple of 16 and at most 32768 entries, 16-aligned as the spec
/// requires (reading copes with any alignment; sloppiness is refused).
#[inline]
pub(crate) fn check_indirect(
    negotiated: bool,
    nested: bool,
    flags: u16,
    addr: u64,
    len: u32,
) -> Result<(), ChainError> {
    if !negotiated || nested || flags & VRING_DESC_F_NEXT != 0 {
        return Err(ChainError::BadIndirect);
    }
    if len == 0 || !len.is_multiple_of(16) || len / 16 > MAX_QUEUE_SIZE as u32 || !addr.is_multiple_of(16) {
        return Err(ChainError::BadIndirect);
    }
    Ok(())
}
