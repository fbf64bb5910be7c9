//! Host-side packet backends. A backend lends host frame buffers: the device
//! copies each guest frame into one (`tx_buffers` / `tx_commit`) and copies
//! frames the backend has for the guest out of them (`rx_frames` /
//! `rx_consume`). That is one copy each way, and the shape an AF_XDP UMEM
//! needs. Backends know nothing of virtqueues.

use std::ptr::NonNull;

mod afxdp;
mod link;
mod loopback;
mod sink;
mod source;
mod tap;

pub use afxdp::{AfXdp, AfXdpControl, AfXdpSpec};
pub use link::Link;
pub use loopback::Loopback;
pub use sink::Sink;
pub use source::Source;
pub use tap::{Offloads, Tap, TapControl, TapSpec};
pub use xsk::bpf::XdpMode;

/// Largest frame a host buffer holds (a 64 KiB GSO frame plus an Ethernet header).
pub const FRAME_ROOM: usize = 65536 + 14;

/// Bytes of the offload header (struct virtio_net_hdr without num_buffers)
/// that travels with each frame: what a TAP with IFF_VNET_HDR reads and writes.
pub const VNET_HDR_LEN: usize = 10;

/// A host frame buffer: storage of its own (`new`), or a window onto memory
/// the backend owns, such as an AF_XDP UMEM frame (`borrowed`), so frames
/// are copied once between guest memory and where the kernel reads them.
pub struct FrameBuf {
    ptr: NonNull<u8>,
    room: usize,
    owned: bool,
    /// Bytes in use.
    pub len: usize,
    /// The frame's offload header (checksum and segmentation requests);
    /// all zero for a plain frame.
    pub vnet_hdr: [u8; VNET_HDR_LEN],
}

// SAFETY: a FrameBuf is the only handle on its storage (owned, or a frame
// its backend lent it and does not touch meanwhile); moving it to another
// thread moves that exclusive access with it.
unsafe impl Send for FrameBuf {}

impl FrameBuf {
    /// An empty buffer of `FRAME_ROOM` bytes of its own.
    pub fn new() -> FrameBuf {
        let storage: Box<[u8]> = vec![0u8; FRAME_ROOM].into_boxed_slice();
        let ptr = NonNull::new(Box::into_raw(storage).cast::<u8>()).expect("Box is never null");
        FrameBuf { ptr, room: FRAME_ROOM, owned: true, len: 0, vnet_hdr: [0; VNET_HDR_LEN] }
    }

    /// An empty buffer over `room` bytes at `ptr`, owned by someone else.
    ///
    /// # Safety
    /// `ptr..ptr+room` must be valid for reads and writes, and nothing else
    /// may access it, for as long as this buffer points there (until it is
    /// dropped or `repoint`ed).
    pub unsafe fn borrowed(ptr: NonNull<u8>, room: usize) -> FrameBuf {
        FrameBuf { ptr, room, owned: false, len: 0, vnet_hdr: [0; VNET_HDR_LEN] }
    }

    /// Points a borrowed buffer at other storage, empty.
    ///
    /// # Safety
    /// As for `borrowed`; the buffer must not be one with storage of its own.
    pub unsafe fn repoint(&mut self, ptr: NonNull<u8>, room: usize) {
        debug_assert!(!self.owned);
        self.ptr = ptr;
        self.room = room;
        self.len = 0;
    }

    /// Bytes the storage holds at most.
    pub fn room(&self) -> usize {
        self.room
    }

    /// The whole storage, to fill (then set `len`).
    pub fn storage(&mut self) -> &mut [u8] {
        // SAFETY: ptr..ptr+room is valid and exclusively ours (new/borrowed).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.room) }
    }

    /// The frame bytes.
    pub fn frame(&self) -> &[u8] {
        // SAFETY: as in storage(); len <= room is kept by every writer
        // (checked here so a wrong len cannot read past the storage).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len.min(self.room)) }
    }
}

impl Drop for FrameBuf {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: ptr/room came from Box::into_raw of a boxed slice of
            // exactly room bytes in new(), and are released only here.
            unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.room))) }
        }
    }
}

impl Default for FrameBuf {
    fn default() -> Self {
        FrameBuf::new()
    }
}

/// Counters a backend keeps of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Frames the backend took from the guest.
    pub tx_frames: u64,
    /// Frames the backend handed to the guest.
    pub rx_frames: u64,
    /// Frames for the guest the backend dropped (e.g. loopback with no
    /// guest RX buffer, a TAP frame larger than a host buffer).
    pub rx_dropped: u64,
    /// Frames from the guest the backend could not pass on (e.g. the
    /// kernel refused a TAP write: link down, bad offload header).
    pub tx_dropped: u64,
}

/// A packet backend for one queue pair.
pub trait NetBackend: Send {
    /// Up to `want` empty buffers to copy guest frames into. May return fewer
    /// (or none, when the backend cannot take frames now).
    fn tx_buffers(&mut self, want: usize) -> &mut [FrameBuf];
    /// The first `n` buffers of the last `tx_buffers` hold frames (`len` set).
    fn tx_commit(&mut self, n: usize);
    /// Up to `max` frames waiting for the guest, oldest first.
    fn rx_frames(&mut self, max: usize) -> &[FrameBuf];
    /// The first `n` frames of the last `rx_frames` were delivered (or dropped
    /// by the device, e.g. too big for the guest's buffers).
    fn rx_consume(&mut self, n: usize);
    /// Retries work the kernel put off (AF_XDP: delivered frames the fill
    /// ring has no room for yet, a TX wake-up it refused); true while some
    /// remains. No event says when the room appears, so the dataplane keeps
    /// looking (sleeping only briefly) while this says true.
    fn retry_deferred(&mut self) -> bool {
        false
    }
    /// True when `rx_frames` may return frames without a guest TX first
    /// (a generator): the dataplane then polls RX even without TX activity.
    fn generates(&self) -> bool {
        false
    }
    /// A descriptor that polls readable when `rx_frames` may have frames
    /// (a TAP queue), for a dataplane that sleeps between kicks.
    fn rx_fd(&self) -> Option<std::os::unix::io::RawFd> {
        None
    }
    /// The guest enabled (or disabled) this queue pair; a multi-queue TAP
    /// stops steering frames to a queue nobody reads.
    fn set_active(&mut self, _active: bool) {}
    /// The backend's own counters.
    fn stats(&self) -> BackendStats;
}

/// Which backend, from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Guest TX comes back on guest RX.
    Loopback,
    /// Guest TX is counted and dropped.
    Sink,
    /// Generated frames of this many bytes fill guest RX.
    Source {
        /// Frame length in bytes (Ethernet header included, no FCS).
        pkt_size: usize,
    },
    /// A TAP interface, one TAP queue per queue pair.
    Tap(TapSpec),
    /// AF_XDP sockets on an interface, one per queue pair.
    AfXdp(AfXdpSpec),
}

/// The backends of a device: one per queue pair, and the device-wide sides
/// (a TAP's offloads, an AF_XDP program's attachment, the link state).
pub struct Backends {
    /// Queue pair i's backend is `queues[i]`.
    pub queues: Vec<Box<dyn NetBackend>>,
    /// The TAP's device-wide side, if the backend is a TAP.
    pub tap: Option<TapControl>,
    /// The AF_XDP program and choices, if the backend is AF_XDP; the
    /// program stays attached while this lives.
    pub af_xdp: Option<AfXdpControl>,
    /// The interface whose link state the device reports, if any.
    pub link: Option<Link>,
}

/// Builds the backends of `pairs` queue pairs. Fails (with a message naming
/// the bad part of the backend description) before anything is left set up.
pub fn build(kind: &BackendKind, mac: [u8; 6], pairs: usize) -> std::io::Result<Backends> {
    let one = |_| -> Box<dyn NetBackend> {
        match kind {
            BackendKind::Loopback => Box::new(Loopback::new(256)),
            BackendKind::Sink => Box::new(Sink::new(64)),
            BackendKind::Source { pkt_size } => Box::new(Source::new(*pkt_size, mac, 64)),
            BackendKind::Tap(_) | BackendKind::AfXdp(_) => unreachable!("opened together below"),
        }
    };
    match kind {
        BackendKind::Tap(spec) => {
            let (queues, control, link) = tap::open(spec, pairs)?;
            let queues = queues.into_iter().map(|q| Box::new(q) as Box<dyn NetBackend>).collect();
            Ok(Backends { queues, tap: Some(control), af_xdp: None, link })
        }
        BackendKind::AfXdp(spec) => {
            let (queues, control, link) = afxdp::open(spec, pairs)?;
            let queues = queues.into_iter().map(|q| Box::new(q) as Box<dyn NetBackend>).collect();
            Ok(Backends { queues, tap: None, af_xdp: Some(control), link: Some(link) })
        }
        _ => Ok(Backends { queues: (0..pairs).map(one).collect(), tap: None, af_xdp: None, link: None }),
    }
}
