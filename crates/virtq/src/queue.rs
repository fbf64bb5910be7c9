//! A device-side virtqueue of either layout, chosen by VIRTIO_F_RING_PACKED.
//! Devices use this type; the match per call is one predictable branch.

use crate::guest::GuestMemory;
use crate::packed::PackedQueue;
use crate::split::SplitQueue;
use crate::{Access, Batch, Chain, QueueStats, SetupError};
use std::sync::Arc;

/// The guest-physical addresses of a ring's three areas: split rings call
/// them descriptor table, available ring and used ring; packed rings
/// descriptor ring, driver and device event suppression.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingAddrs {
    /// Descriptor table or ring.
    pub desc: u64,
    /// Available ring (split) or driver event suppression (packed).
    pub driver: u64,
    /// Used ring (split) or device event suppression (packed).
    pub device: u64,
}

/// A split or packed virtqueue, device side.
pub enum Queue {
    /// Split ring (virtio 1.2, 2.7).
    Split(SplitQueue),
    /// Packed ring (virtio 1.2, 2.8).
    Packed(PackedQueue),
}

macro_rules! each {
    ($self:expr, $q:ident => $e:expr) => {
        match $self {
            Queue::Split($q) => $e,
            Queue::Packed($q) => $e,
        }
    };
}

impl Queue {
    /// True for a packed ring.
    pub fn is_packed(&self) -> bool {
        matches!(self, Queue::Packed(_))
    }

    /// Queue size.
    pub fn size(&self) -> u16 {
        each!(self, q => q.size())
    }

    /// The memory table this ring reads.
    pub fn memory(&self) -> &Arc<GuestMemory> {
        each!(self, q => q.memory())
    }

    /// What GET_VRING_BASE returns (split: next avail index; packed: avail
    /// and used positions with their wrap counters).
    pub fn vring_base(&self) -> u32 {
        match self {
            Queue::Split(q) => q.next_avail() as u32,
            Queue::Packed(q) => q.vring_base(),
        }
    }

    /// True once the driver broke the ring.
    pub fn is_broken(&self) -> bool {
        each!(self, q => q.is_broken())
    }

    /// Counters.
    #[inline]
    pub fn stats(&self) -> &QueueStats {
        each!(self, q => &q.stats)
    }

    /// Counters, to reset them.
    pub fn stats_mut(&mut self) -> &mut QueueStats {
        each!(self, q => &mut q.stats)
    }

    /// Where used-ring stores are logged (vhost-user's log_guest_addr; None:
    /// where the ring is). A split ring's used ring only: a packed ring's
    /// device writes go to its descriptor ring and device event area, logged
    /// where they are.
    pub fn set_used_log(&mut self, gpa: Option<u64>) {
        if let Queue::Split(q) = self {
            q.set_used_log(gpa);
        }
    }

    /// The same ring over a new memory table, at `at` in it (a table change
    /// can move the ring's guest-physical addresses).
    pub fn remap(&self, mem: Arc<GuestMemory>, at: RingAddrs) -> Result<Queue, SetupError> {
        Ok(match self {
            Queue::Split(q) => Queue::Split(q.remap(mem, at)?),
            Queue::Packed(q) => Queue::Packed(q.remap(mem, at)?),
        })
    }

    /// Where the ring's areas sit in guest-physical memory.
    pub fn addrs(&self) -> RingAddrs {
        each!(self, q => q.addrs())
    }

    /// How many chains to plan for, up to `want` (split: at least
    /// min(want, available), reading avail.idx only when needed; packed: an
    /// upper bound from the next slot's flags).
    #[inline]
    pub fn available(&mut self, want: u16) -> u16 {
        each!(self, q => q.available(want))
    }

    /// Starts fetching the ring lines the next pop reads first, so that
    /// their miss overlaps other work (no effect on correctness).
    #[inline]
    pub fn prefetch_next(&self) {
        each!(self, q => q.prefetch_next())
    }

    /// All chains available and not yet popped (split: reads avail.idx;
    /// packed: scans descriptor flags).
    pub fn pending(&mut self) -> u16 {
        match self {
            Queue::Split(q) => q.pending(),
            Queue::Packed(q) => q.pending(),
        }
    }

    /// Pops up to `max` chains into `batch`.
    #[inline]
    pub fn pop_batch(&mut self, batch: &mut Batch, max: usize, access: Access) -> usize {
        each!(self, q => q.pop_batch(batch, max, access))
    }

    /// Gives back the last `n` chains popped.
    #[inline]
    pub fn unpop(&mut self, n: u16) {
        each!(self, q => q.unpop(n))
    }

    /// Completes a chain (in pop order); visible after `publish_used`.
    #[inline]
    pub fn add_used(&mut self, head: u16, len: u32) {
        each!(self, q => q.add_used(head, len))
    }

    /// Completes `chains` (the oldest popped, in pop order), chain `j` with
    /// `lens[j]` bytes written; as `add_used` per chain, in one pass where
    /// the ring can.
    #[inline]
    pub fn add_used_batch(&mut self, chains: &[Chain], lens: &[u32]) {
        each!(self, q => q.add_used_batch(chains, lens))
    }

    /// Completes the popped chain `head` (its buffer id), in whatever order
    /// chains finish; visible after `publish_used`.
    #[inline]
    pub fn add_used_id(&mut self, head: u16, len: u32) {
        each!(self, q => q.add_used_id(head, len))
    }

    /// Completes a popped batch as read, nothing written (one used entry
    /// for it all with IN_ORDER).
    #[inline]
    pub fn add_used_read_only(&mut self, chains: &[Chain]) {
        each!(self, q => q.add_used_read_only(chains))
    }

    /// Publishes the used entries written so far.
    #[inline]
    pub fn publish_used(&mut self) {
        each!(self, q => q.publish_used())
    }

    /// Publishes if anything is unpublished; returns whether it did.
    #[inline]
    pub fn flush_used(&mut self) -> bool {
        each!(self, q => q.flush_used())
    }

    /// Whether the driver wants an interrupt now.
    #[inline]
    pub fn needs_notify(&mut self) -> bool {
        each!(self, q => q.needs_notify())
    }

    /// Asks the driver not to kick.
    pub fn disable_notifications(&mut self) {
        each!(self, q => q.disable_notifications())
    }

    /// Asks the driver to kick; true if buffers arrived meanwhile.
    pub fn enable_notifications(&mut self) -> bool {
        each!(self, q => q.enable_notifications())
    }
}
