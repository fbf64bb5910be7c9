//! virtq-driver: the *driver* side of virtio split and packed virtqueues
//! (virtio 1.2, sections 2.7 and 2.8), what a guest's virtio driver does, for
//! vhostd's own vhost-user frontend (`vhostd-user`, the benchmark frontend)
//! and as the test peer of the device side in `virtq`.
//!
//! The driver owns its memory: a [`SharedMemory`] (an mmap of a memfd or of
//! anonymous shared memory) seen by the device at a guest-physical base,
//! wrapped by [`DriverMemory`]. From `virtq` it takes only the ring layout
//! constants and pure functions of `virtq::ring`; it never touches the device
//! side's guest-memory types.
//!
//! [`SplitDriver`] and [`PackedDriver`] differ in how they write chains into
//! their rings and in how they read the next used element; the bookkeeping of
//! chains in flight, the checks of what the device returns and the pop loop
//! are written once (the private `inflight` module). [`DriverRing`] holds
//! either, for code that drives both.
//!
//! Built for speed: descriptors for fixed-size buffers can be built once and
//! then only recycled (`pop_used_keep` + `repost`), a batch is made visible
//! with one store (`publish`), and used elements are taken in batches
//! (`pop_used_batch`) without allocating or dispatching per element.
//!
//! The bookkeeping lives in private memory, never in the shared rings, so a
//! misbehaving device can only make `pop_used` return an error, never corrupt
//! the driver or make it panic. The raw accessors (`write_desc`,
//! `set_avail_idx`, ...) let tests build hostile rings on purpose.

#![deny(missing_docs)]

mod driver_ring;
mod inflight;
mod memory;
mod packed;
mod raw;
mod split;

pub use driver_ring::DriverRing;
pub use memory::{memfd, prefetch, DriverMemory, SharedBytes, SharedBytesMut, SharedMemory};
pub use packed::{PackedDesc, PackedDriver};
pub use split::{Descriptor, SplitDriver};

use virtq::ring::{avail_ring_size, desc_table_size, used_ring_size};

/// Where the parts of a ring live (guest-physical addresses).
///
/// For a split ring: the descriptor table, the available ring and the used
/// ring. For a packed ring: the descriptor ring, the driver event area
/// (`avail`) and the device event area (`used`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    /// Queue size.
    pub size: u16,
    /// Descriptor table (split) or descriptor ring (packed).
    pub desc: u64,
    /// Available ring (split) or driver event area (packed).
    pub avail: u64,
    /// Used ring (split) or device event area (packed).
    pub used: u64,
}

impl RingLayout {
    /// A compact split layout starting at `base` (aligned up to 64):
    /// descriptor table, available ring, then the used ring on its own cache
    /// lines so the device's used writes do not bounce the driver's avail line.
    pub fn at(base: u64, size: u16) -> RingLayout {
        let desc = align_up(base, 64);
        let avail = desc + desc_table_size(size);
        let used = align_up(avail + avail_ring_size(size), 64);
        RingLayout { size, desc, avail, used }
    }

    /// First byte after the split rings of `at` (64-aligned).
    pub fn end(&self) -> u64 {
        align_up(self.used + used_ring_size(self.size), 64)
    }

    /// Bytes the layout from `RingLayout::at` takes, at most.
    pub fn footprint(size: u16) -> u64 {
        RingLayout::at(0, size).end() + 64
    }

    /// A packed layout at `base` (aligned up to 64): the descriptor ring,
    /// then the driver and device event areas on their own cache lines.
    /// (`avail` is the driver area, `used` the device area.)
    pub fn packed_at(base: u64, size: u16) -> RingLayout {
        let desc = align_up(base, 64);
        let avail = align_up(desc + desc_table_size(size), 64);
        let used = avail + 64;
        RingLayout { size, desc, avail, used }
    }

    /// Bytes `packed_at` takes, at most.
    pub fn packed_footprint(size: u16) -> u64 {
        RingLayout::packed_at(0, size).used + 128
    }
}

fn align_up(v: u64, a: u64) -> u64 {
    (v + a - 1) & !(a - 1)
}

/// Why a driver queue could not be built or an operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverError {
    /// Queue size zero, above 32768 or (split) not a power of two.
    BadSize,
    /// A ring outside the driver memory.
    NotMapped,
    /// A ring address not aligned as the spec requires.
    Misaligned,
    /// Not enough free descriptors (or ring slots, or ids) for the chain.
    NoSpace,
    /// A chain with no buffer, or more buffers than the queue or indirect table holds.
    BadChain,
    /// Indirect descriptors were asked for without an indirect pool.
    NoIndirect,
    /// The head is not a kept chain (not allocated, or still in flight).
    NotKept,
    /// The device moved used.idx by more than the number of chains in flight.
    UsedIdxAhead,
    /// The device returned a head (or buffer id) past the queue size.
    BadUsedId,
    /// The device returned a head (or buffer id) that was not in flight.
    UsedNotInFlight,
}

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            DriverError::BadSize => "queue size is zero, above 32768 or not a power of two",
            DriverError::NotMapped => "ring outside the driver memory",
            DriverError::Misaligned => "ring address misaligned",
            DriverError::NoSpace => "not enough free descriptors",
            DriverError::BadChain => "empty or oversized chain",
            DriverError::NoIndirect => "no indirect descriptor pool",
            DriverError::NotKept => "head is not a kept chain",
            DriverError::UsedIdxAhead => "device moved used.idx past the chains in flight",
            DriverError::BadUsedId => "device returned a head past the queue size",
            DriverError::UsedNotInFlight => "device returned a head that was not in flight",
        };
        f.write_str(s)
    }
}

impl std::error::Error for DriverError {}

/// A buffer of a chain: guest-physical address and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buf {
    /// Guest-physical address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

/// A completed chain taken from the used ring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Used {
    /// Head descriptor index (split) or buffer id (packed).
    pub id: u16,
    /// Bytes the device wrote.
    pub len: u32,
    /// The token given to `add` or `prepare`.
    pub token: u64,
}

/// Driver counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverStats {
    /// Chains made available (add + repost).
    pub added: u64,
    /// Used entries taken.
    pub used: u64,
    /// avail.idx stores (split) or batch flag stores (packed).
    pub publishes: u64,
    /// Kicks the notification logic asked for.
    pub kicks: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_layout_is_aligned_and_disjoint() {
        let l = RingLayout::at(0x1003, 256);
        assert_eq!(l.desc % 64, 0);
        assert!(l.avail >= l.desc + 256 * 16);
        assert_eq!(l.used % 64, 0);
        assert!(l.used >= l.avail + 6 + 512);
        assert!(l.end() >= l.used + 6 + 8 * 256);
        assert!(RingLayout::footprint(256) >= l.end() - l.desc);
    }

    #[test]
    fn packed_layout_is_aligned_and_disjoint() {
        let l = RingLayout::packed_at(0x1003, 100);
        assert_eq!(l.desc % 64, 0);
        assert_eq!(l.avail % 64, 0);
        assert!(l.avail >= l.desc + 100 * 16);
        assert!(l.used >= l.avail + 4);
        assert!(RingLayout::packed_footprint(100) >= l.used + 4 - l.desc);
    }
}
