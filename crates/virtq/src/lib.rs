//! virtq: the device side of virtio split and packed virtqueues living in
//! shared guest memory. (The driver side, for tests and the project's own
//! frontend, is the `virtq-driver` crate.)
//!
//! This is the hot path of vhostd, written here rather than taken from
//! `virtio-queue` (see `split.rs` for why). It knows nothing of vhost-user,
//! devices or backends.

pub mod memory;
pub mod packed;
pub mod queue;
pub mod ring;
pub mod split;

pub use memory::{GuestMemory, Mapping, MemoryError, Region};
pub use packed::{PackedConfig, PackedQueue, PACKED_BASE_INITIAL};
pub use queue::Queue;
pub use split::{
    copy_from_segs, copy_to_segs, Access, AddrSpace, Batch, Chain, ChainError, QueueStats, Seg, SetupError,
    SplitConfig, SplitQueue,
};
