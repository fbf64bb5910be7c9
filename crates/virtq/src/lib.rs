//! virtq: the device side of virtio split and packed virtqueues living in
//! shared guest memory, and the fence around that memory. (The driver side,
//! for tests and the project's own frontend, is the `virtq-driver` crate.)
//!
//! This is the hot path of vhostd, written here rather than taken from
//! `virtio-queue` (see `split.rs` for why). It knows nothing of vhost-user,
//! devices or backends. Layout:
//!
//! - `guest`: the one module holding raw pointers into guest memory: the
//!   memory table, chain segments and the views that copy through them,
//!   buffers lent for I/O, the ring accessors, the dirty-page log hook.
//! - `chain`: what both layouts share: chains, batches, counters, errors,
//!   the single-descriptor fast path and the general chain walk.
//! - `split`, `packed`: the two ring layouts (no `unsafe` in either).
//! - `queue`: either layout behind one type, for devices.
//! - `ring`: layout constants and feature bits.
//! - `sigbus`: the SIGBUS handler and its table of mappings a peer may
//!   truncate (guest memory, mapped disk images).

pub mod chain;
pub mod guest;
pub mod packed;
pub mod queue;
pub mod ring;
pub mod sigbus;
pub mod split;

pub use chain::{Access, Batch, Chain, ChainError, QueueStats, SetupError};
pub use guest::{
    fence_streamed_stores, DirtyLog, GuestBufs, GuestMemory, IoBufs, Mapping, MemoryError, MemoryHold, Region, Seg,
    LOG_PAGE, MAX_REGIONS, MAX_REPLY_PIECES,
};
pub use packed::{PackedConfig, PackedQueue, PACKED_BASE_INITIAL};
pub use queue::{Queue, RingAddrs};
pub use split::{SplitConfig, SplitQueue};
