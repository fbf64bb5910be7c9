//! A driver-side ring of either layout behind one type, for code (the
//! frontend) that drives both. It dispatches once per call (a match), so a
//! batch call costs one branch, not one per element.

use crate::{Buf, DriverError, DriverMemory, DriverStats, PackedDriver, RingLayout, SplitDriver, Used};

/// A driver-side ring of either layout, for code that drives both.
pub enum DriverRing {
    /// Split ring.
    Split(SplitDriver),
    /// Packed ring.
    Packed(PackedDriver),
}

macro_rules! each_driver {
    ($self:expr, $q:ident => $e:expr) => {
        match $self {
            DriverRing::Split($q) => $e,
            DriverRing::Packed($q) => $e,
        }
    };
}

impl DriverRing {
    /// The split ring, for tests that write raw split-ring state.
    pub fn split(&mut self) -> Option<&mut SplitDriver> {
        match self {
            DriverRing::Split(q) => Some(q),
            DriverRing::Packed(_) => None,
        }
    }

    /// The packed ring, for tests that write raw packed-ring state.
    pub fn packed(&mut self) -> Option<&mut PackedDriver> {
        match self {
            DriverRing::Packed(q) => Some(q),
            DriverRing::Split(_) => None,
        }
    }

    /// True for a packed ring.
    pub fn is_packed(&self) -> bool {
        matches!(self, DriverRing::Packed(_))
    }

    /// The layout.
    pub fn layout(&self) -> RingLayout {
        each_driver!(self, q => q.layout())
    }

    /// Queue size.
    pub fn size(&self) -> u16 {
        each_driver!(self, q => q.size())
    }

    /// The driver memory.
    pub fn memory(&self) -> &DriverMemory {
        each_driver!(self, q => q.memory())
    }

    /// Chains in flight.
    pub fn in_flight(&self) -> u16 {
        each_driver!(self, q => q.in_flight())
    }

    /// Counters.
    pub fn stats(&self) -> DriverStats {
        each_driver!(self, q => q.stats)
    }

    /// See `SplitDriver::set_indirect_pool`.
    pub fn set_indirect_pool(&mut self, gpa: u64, max_per_chain: u16) -> Result<(), DriverError> {
        each_driver!(self, q => q.set_indirect_pool(gpa, max_per_chain))
    }

    /// See `SplitDriver::add`.
    pub fn add(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        each_driver!(self, q => q.add(readable, writable, token))
    }

    /// See `SplitDriver::add_indirect`.
    pub fn add_indirect(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        each_driver!(self, q => q.add_indirect(readable, writable, token))
    }

    /// See `SplitDriver::prepare`.
    pub fn prepare(&mut self, readable: &[Buf], writable: &[Buf], token: u64) -> Result<u16, DriverError> {
        each_driver!(self, q => q.prepare(readable, writable, token))
    }

    /// See `SplitDriver::repost`.
    #[inline]
    pub fn repost(&mut self, head: u16) -> Result<(), DriverError> {
        each_driver!(self, q => q.repost(head))
    }

    /// See `SplitDriver::set_kept_len`.
    #[inline]
    pub fn set_kept_len(&mut self, head: u16, len: u32) -> Result<(), DriverError> {
        each_driver!(self, q => q.set_kept_len(head, len))
    }

    /// See `SplitDriver::free_kept`.
    pub fn free_kept(&mut self, head: u16) -> Result<(), DriverError> {
        each_driver!(self, q => q.free_kept(head))
    }

    /// See `SplitDriver::publish`.
    #[inline]
    pub fn publish(&mut self) -> u16 {
        each_driver!(self, q => q.publish())
    }

    /// See `SplitDriver::publish_and_check_kick`.
    #[inline]
    pub fn publish_and_check_kick(&mut self) -> bool {
        each_driver!(self, q => q.publish_and_check_kick())
    }

    /// See `SplitDriver::pop_used`.
    pub fn pop_used(&mut self) -> Result<Option<Used>, DriverError> {
        each_driver!(self, q => q.pop_used())
    }

    /// See `SplitDriver::pop_used_batch`.
    #[inline]
    pub fn pop_used_batch(&mut self, out: &mut [Used], keep: bool) -> Result<usize, DriverError> {
        each_driver!(self, q => q.pop_used_batch(out, keep))
    }

    /// See `SplitDriver::enable_notifications`.
    pub fn enable_notifications(&mut self) -> bool {
        each_driver!(self, q => q.enable_notifications())
    }

    /// See `SplitDriver::disable_notifications`.
    pub fn disable_notifications(&mut self) {
        each_driver!(self, q => q.disable_notifications())
    }

    /// See `SplitDriver::refresh_disabled`.
    #[inline]
    pub fn refresh_disabled(&mut self) {
        each_driver!(self, q => q.refresh_disabled())
    }
}
