//! Host-side packet backends. A backend lends host frame buffers: the device
//! copies each guest frame into one (`tx_buffers` / `tx_commit`) and copies
//! frames the backend has for the guest out of them (`rx_frames` /
//! `rx_consume`). That is one copy each way, and the shape an AF_XDP UMEM
//! needs later. Backends know nothing of virtqueues.

mod loopback;
mod sink;
mod source;
mod tap;

pub use loopback::Loopback;
pub use sink::Sink;
pub use source::Source;
pub use tap::{Offloads, Tap, TapControl, TapSpec};

/// Largest frame a host buffer holds (a 64 KiB GSO frame plus an Ethernet header).
pub const FRAME_ROOM: usize = 65536 + 14;

/// Bytes of the offload header (struct virtio_net_hdr without num_buffers)
/// that travels with each frame: what a TAP with IFF_VNET_HDR reads and writes.
pub const VNET_HDR_LEN: usize = 10;

/// A host frame buffer.
pub struct FrameBuf {
    /// Storage, `FRAME_ROOM` bytes.
    pub data: Box<[u8]>,
    /// Bytes in use.
    pub len: usize,
    /// The frame's offload header (checksum and segmentation requests);
    /// all zero for a plain frame.
    pub vnet_hdr: [u8; VNET_HDR_LEN],
}

impl FrameBuf {
    /// An empty buffer of `FRAME_ROOM` bytes.
    pub fn new() -> FrameBuf {
        FrameBuf { data: vec![0u8; FRAME_ROOM].into_boxed_slice(), len: 0, vnet_hdr: [0; VNET_HDR_LEN] }
    }

    /// The frame bytes.
    pub fn frame(&self) -> &[u8] {
        &self.data[..self.len]
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
}

/// The backends of a device: one per queue pair, and for a TAP the
/// device-wide controls (offloads, link state).
pub struct Backends {
    /// Queue pair i's backend is `queues[i]`.
    pub queues: Vec<Box<dyn NetBackend>>,
    /// The TAP's device-wide side, if the backend is a TAP.
    pub tap: Option<TapControl>,
}

/// Builds the backends of `pairs` queue pairs. Fails (with a message naming
/// the bad part of the backend description) before anything is left set up.
pub fn build(kind: &BackendKind, mac: [u8; 6], pairs: usize) -> std::io::Result<Backends> {
    let one = |_| -> Box<dyn NetBackend> {
        match kind {
            BackendKind::Loopback => Box::new(Loopback::new(256)),
            BackendKind::Sink => Box::new(Sink::new(64)),
            BackendKind::Source { pkt_size } => Box::new(Source::new(*pkt_size, mac, 64)),
            BackendKind::Tap(_) => unreachable!("TAP queues are opened together"),
        }
    };
    match kind {
        BackendKind::Tap(spec) => {
            let (queues, control) = tap::open(spec, pairs)?;
            let queues = queues.into_iter().map(|q| Box::new(q) as Box<dyn NetBackend>).collect();
            Ok(Backends { queues, tap: Some(control) })
        }
        _ => Ok(Backends { queues: (0..pairs).map(one).collect(), tap: None }),
    }
}
