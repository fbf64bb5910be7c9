//! Ring layout constants shared by the device and driver sides
//! (virtio 1.2, sections 2.7 split and 2.8 packed). Numbers come from
//! `virtio-bindings` (the kernel's uapi headers).

use virtio_bindings::virtio_config as config;
use virtio_bindings::virtio_ring as ring;

/// Feature bits this crate understands (the transport-independent ones).
pub mod features {
    use super::{config, ring};

    /// VIRTIO_F_INDIRECT_DESC
    pub const INDIRECT_DESC: u64 = 1 << ring::VIRTIO_RING_F_INDIRECT_DESC;
    /// VIRTIO_F_EVENT_IDX
    pub const EVENT_IDX: u64 = 1 << ring::VIRTIO_RING_F_EVENT_IDX;
    /// VIRTIO_F_VERSION_1
    pub const VERSION_1: u64 = 1 << config::VIRTIO_F_VERSION_1;
    /// VIRTIO_F_IN_ORDER: buffers are used in the order they were made available.
    pub const IN_ORDER: u64 = 1 << config::VIRTIO_F_IN_ORDER;
    /// VIRTIO_F_RING_PACKED
    pub const RING_PACKED: u64 = 1 << config::VIRTIO_F_RING_PACKED;
}

/// Descriptor flag: the chain continues in `next`.
pub const VRING_DESC_F_NEXT: u16 = ring::VRING_DESC_F_NEXT as u16;
/// Descriptor flag: the buffer is device-writable.
pub const VRING_DESC_F_WRITE: u16 = ring::VRING_DESC_F_WRITE as u16;
/// Descriptor flag: the buffer holds an indirect descriptor table.
pub const VRING_DESC_F_INDIRECT: u16 = ring::VRING_DESC_F_INDIRECT as u16;
/// avail.flags: the driver asks for no interrupt (only meaningful without EVENT_IDX).
pub const VRING_AVAIL_F_NO_INTERRUPT: u16 = ring::VRING_AVAIL_F_NO_INTERRUPT as u16;
/// used.flags: the device asks for no kick (only meaningful without EVENT_IDX).
pub const VRING_USED_F_NO_NOTIFY: u16 = ring::VRING_USED_F_NO_NOTIFY as u16;

/// Packed ring descriptor flag: available when equal to the driver's wrap counter.
pub const VRING_PACKED_DESC_F_AVAIL: u16 = 1 << ring::VRING_PACKED_DESC_F_AVAIL;
/// Packed ring descriptor flag: used when equal to the device's wrap counter.
pub const VRING_PACKED_DESC_F_USED: u16 = 1 << ring::VRING_PACKED_DESC_F_USED;
/// Packed event suppression: events enabled.
pub const RING_EVENT_FLAGS_ENABLE: u16 = ring::VRING_PACKED_EVENT_FLAG_ENABLE as u16;
/// Packed event suppression: events disabled.
pub const RING_EVENT_FLAGS_DISABLE: u16 = ring::VRING_PACKED_EVENT_FLAG_DISABLE as u16;
/// Packed event suppression: an event only for the descriptor at off_wrap (EVENT_IDX).
pub const RING_EVENT_FLAGS_DESC: u16 = ring::VRING_PACKED_EVENT_FLAG_DESC as u16;

/// Size in bytes of one descriptor.
pub const DESC_SIZE: u64 = 16;
/// Largest queue size the split ring allows.
pub const MAX_QUEUE_SIZE: u16 = 32768;

/// Descriptor table size for a queue of `n` entries.
pub fn desc_table_size(n: u16) -> u64 {
    DESC_SIZE * n as u64
}
/// Available ring size (flags, idx, ring\[n\], used_event).
pub fn avail_ring_size(n: u16) -> u64 {
    6 + 2 * n as u64
}
/// Used ring size (flags, idx, ring\[n\] of {id,len}, avail_event).
pub fn used_ring_size(n: u16) -> u64 {
    6 + 8 * n as u64
}

/// The spec's `vring_need_event`: should an event be sent given the other
/// side asked to hear about index `event`, and the index moved from `old` to `new`?
#[inline]
pub fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}
