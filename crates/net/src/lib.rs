//! The virtio-net device (virtio 1.2, section 5.1): the virtio_net_hdr,
//! mergeable RX buffers, the control queue and the config space. It moves
//! frames between a queue pair's rings and a backend; it knows nothing of
//! vhost-user or sockets.

use vhostd_backends::NetBackend;
use virtq::{copy_from_segs, copy_to_segs, Access, Batch, SplitQueue};

/// virtio-net feature bits.
pub mod features {
    /// VIRTIO_NET_F_MTU
    pub const MTU: u64 = 1 << 3;
    /// VIRTIO_NET_F_MAC
    pub const MAC: u64 = 1 << 5;
    /// VIRTIO_NET_F_MRG_RXBUF
    pub const MRG_RXBUF: u64 = 1 << 15;
    /// VIRTIO_NET_F_STATUS
    pub const STATUS: u64 = 1 << 16;
    /// VIRTIO_NET_F_CTRL_VQ
    pub const CTRL_VQ: u64 = 1 << 17;
    /// VIRTIO_NET_F_CTRL_RX
    pub const CTRL_RX: u64 = 1 << 18;
    /// VIRTIO_NET_F_MQ
    pub const MQ: u64 = 1 << 22;
    /// VIRTIO_NET_F_CTRL_MAC_ADDR
    pub const CTRL_MAC_ADDR: u64 = 1 << 23;
}

/// Features the device offers (the transport adds ring features).
pub const DEVICE_FEATURES: u64 = features::MAC
    | features::MRG_RXBUF
    | features::STATUS
    | features::CTRL_VQ
    | features::CTRL_RX
    | features::MQ
    | features::CTRL_MAC_ADDR;

/// virtio_net_hdr_v1 length (VERSION_1 or MRG_RXBUF).
pub const HDR_LEN: usize = 12;
/// The legacy header without num_buffers (neither VERSION_1 nor MRG_RXBUF).
pub const LEGACY_HDR_LEN: usize = 10;

/// What the negotiated features mean for the data path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of virtio_net_hdr before each frame.
    pub hdr_len: usize,
    /// VIRTIO_NET_F_MRG_RXBUF: a received frame may span several chains.
    pub mergeable: bool,
}

impl Layout {
    /// The layout for a negotiated feature set.
    pub fn from_features(features: u64) -> Layout {
        let mergeable = features & features::MRG_RXBUF != 0;
        let version_1 = features & virtq::ring::features::VERSION_1 != 0;
        let hdr_len = if mergeable || version_1 { HDR_LEN } else { LEGACY_HDR_LEN };
        Layout { hdr_len, mergeable }
    }
}
/// VIRTIO_NET_S_LINK_UP
pub const STATUS_LINK_UP: u16 = 1;

/// The device config space (virtio_net_config), as far as we fill it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// MAC address.
    pub mac: [u8; 6],
    /// VIRTIO_NET_S_* bits.
    pub status: u16,
    /// Most queue pairs the device has.
    pub max_queue_pairs: u16,
    /// MTU advertised (only meaningful with VIRTIO_NET_F_MTU).
    pub mtu: u16,
}

impl NetConfig {
    /// The config space bytes, little-endian as the spec lays them out.
    pub fn bytes(&self) -> [u8; 12] {
        let mut b = [0u8; 12];
        b[0..6].copy_from_slice(&self.mac);
        b[6..8].copy_from_slice(&self.status.to_le_bytes());
        b[8..10].copy_from_slice(&self.max_queue_pairs.to_le_bytes());
        b[10..12].copy_from_slice(&self.mtu.to_le_bytes());
        b
    }
}

/// Per-direction counters of one queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirStats {
    /// Frames moved.
    pub packets: u64,
    /// Frame bytes moved (headers excluded).
    pub bytes: u64,
    /// Frames dropped (reasons below).
    pub dropped: u64,
    /// TX chains shorter than the virtio-net header.
    pub short_header: u64,
    /// Frames larger than the backend's buffers (TX) or the guest's (RX).
    pub too_big: u64,
    /// Batches that moved at least one frame.
    pub batches: u64,
}

/// How many frames one batch moves at most.
pub const BURST: usize = 32;

/// Frames from the guest's TX queue to the backend. Returns frames moved
/// (and dropped); the caller signals the guest if `tx.needs_notify()`.
pub fn process_tx(
    tx: &mut SplitQueue,
    batch: &mut Batch,
    backend: &mut dyn NetBackend,
    layout: Layout,
    stats: &mut DirStats,
) -> usize {
    let hdr_len = layout.hdr_len;
    let pending = tx.pending() as usize;
    if pending == 0 {
        return 0;
    }
    // Ask the backend for room first, and pop no more chains than it has.
    let bufs = backend.tx_buffers(pending.min(BURST));
    let bad_before = tx.stats.bad_chains;
    let popped = tx.pop_batch(batch, bufs.len(), Access::ReadOnly);
    let rejected = (tx.stats.bad_chains - bad_before) as usize;
    if popped == 0 {
        backend.tx_commit(0);
        tx.flush_used();
        return rejected;
    }
    // Start fetching every frame before copying the first.
    for chain in &batch.chains {
        if let Some(seg) = batch.readable(chain).first() {
            virtq::split::prefetch(seg.addr);
            virtq::split::prefetch(seg.addr.wrapping_add(64));
        }
    }
    let mut filled = 0;
    for chain in &batch.chains {
        let len = chain.read_len as usize;
        if len < hdr_len {
            stats.short_header += 1;
            stats.dropped += 1;
        } else if len - hdr_len > bufs[filled].data.len() {
            stats.too_big += 1;
            stats.dropped += 1;
        } else {
            let frame = len - hdr_len;
            let buf = &mut bufs[filled];
            let segs = batch.readable(chain);
            match segs {
                // One buffer holding header and frame: what drivers post.
                [seg] => {
                    // SAFETY: seg.len == len >= hdr_len + frame (a single
                    // segment carries the whole chain), so the source range
                    // is inside the translated buffer; buf.data has room for
                    // `frame` bytes (checked above).
                    unsafe {
                        std::ptr::copy_nonoverlapping(seg.addr.add(hdr_len), buf.data.as_mut_ptr(), frame)
                    }
                }
                _ => {
                    copy_from_segs(segs, hdr_len, &mut buf.data[..frame]);
                }
            }
            buf.len = frame;
            stats.bytes += frame as u64;
            filled += 1;
        }
        tx.add_used(chain.head, 0);
    }
    backend.tx_commit(filled);
    tx.publish_used();
    stats.packets += filled as u64;
    stats.batches += 1;
    popped + rejected
}

/// Frames from the backend into the guest's RX queue. Returns frames
/// delivered or dropped; the caller signals the guest if `rx.needs_notify()`.
pub fn process_rx(
    rx: &mut SplitQueue,
    batch: &mut Batch,
    backend: &mut dyn NetBackend,
    layout: Layout,
    stats: &mut DirStats,
) -> usize {
    let frames = backend.rx_frames(BURST);
    if frames.is_empty() {
        return 0;
    }
    let bad_before = rx.stats.bad_chains;
    let done = if layout.mergeable {
        rx_mergeable(rx, batch, frames, stats)
    } else {
        rx_simple(rx, batch, frames, layout.hdr_len, stats)
    };
    if done > 0 {
        backend.rx_consume(done);
        stats.batches += 1;
    }
    rx.flush_used();
    done + (rx.stats.bad_chains - bad_before) as usize
}

/// Writes header then frame into a chain's buffers (which have room for both).
#[inline]
fn write_frame(segs: &[virtq::Seg], hdr: &[u8], frame: &[u8]) {
    match segs {
        [seg] if seg.len as usize >= hdr.len() + frame.len() => {
            // SAFETY: the one buffer has room for header and frame (checked
            // in the pattern guard); sources are host memory, not overlapping.
            unsafe {
                std::ptr::copy_nonoverlapping(hdr.as_ptr(), seg.addr, hdr.len());
                std::ptr::copy_nonoverlapping(frame.as_ptr(), seg.addr.add(hdr.len()), frame.len());
            }
        }
        _ => {
            copy_to_segs(segs, 0, hdr);
            copy_to_segs(segs, hdr.len(), frame);
        }
    }
}

fn header(num_buffers: u16) -> [u8; HDR_LEN] {
    let mut h = [0u8; HDR_LEN];
    h[10..12].copy_from_slice(&num_buffers.to_le_bytes());
    h
}

/// One chain per frame; a frame that does not fit its chain is dropped
/// (the chain goes back to the guest with length 0).
fn rx_simple(
    rx: &mut SplitQueue,
    batch: &mut Batch,
    frames: &[vhostd_backends::FrameBuf],
    hdr_len: usize,
    stats: &mut DirStats,
) -> usize {
    let n = rx.pop_batch(batch, frames.len(), Access::WriteOnly);
    for chain in &batch.chains {
        if let Some(seg) = batch.writable(chain).first() {
            virtq::split::prefetch_write(seg.addr);
            virtq::split::prefetch_write(seg.addr.wrapping_add(64));
        }
    }
    let hdr = header(1);
    let hdr = &hdr[..hdr_len];
    for (chain, f) in batch.chains.iter().zip(frames) {
        let need = hdr_len + f.len;
        let segs = batch.writable(chain);
        if (chain.write_len as usize) < need {
            stats.too_big += 1;
            stats.dropped += 1;
            rx.add_used(chain.head, 0);
            continue;
        }
        write_frame(segs, hdr, f.frame());
        rx.add_used(chain.head, need as u32);
        stats.packets += 1;
        stats.bytes += f.len as u64;
    }
    n
}

/// A frame may span several chains; num_buffers in the first header says
/// how many. Chains popped but not needed go back to the ring.
fn rx_mergeable(
    rx: &mut SplitQueue,
    batch: &mut Batch,
    frames: &[vhostd_backends::FrameBuf],
    stats: &mut DirStats,
) -> usize {
    let mut done = 0;
    let mut want = frames.len();
    'refill: loop {
        if done == frames.len() {
            return done;
        }
        let popped = rx.pop_batch(batch, want, Access::WriteOnly);
        if popped == 0 {
            return done;
        }
        let mut c = 0;
        while done < frames.len() {
            let f = &frames[done];
            let need = HDR_LEN + f.len;
            // Find how many chains this frame needs.
            let mut room = 0usize;
            let mut k = c;
            while room < need && k < popped {
                room += batch.chains[k].write_len as usize;
                k += 1;
            }
            if room < need && batch.ended_before_bad {
                // A bad chain sits right after these: the frame cannot be
                // placed in order. Drop it and return the chains empty; the
                // next pop starts with (and completes) the bad chain.
                for chain in &batch.chains[c..popped] {
                    rx.add_used(chain.head, 0);
                }
                stats.dropped += 1;
                done += 1;
                want = frames.len().saturating_sub(done).max(1);
                continue 'refill;
            }
            if room < need {
                // Not enough chains popped: give back the unused tail and pop
                // again, asking for enough; stop if the ring has no more.
                rx.unpop((popped - c) as u16);
                if c == 0 && popped >= rx.size() as usize {
                    // Even the whole ring cannot hold this frame.
                    stats.too_big += 1;
                    stats.dropped += 1;
                    done += 1;
                    continue 'refill;
                }
                if c == 0 && want >= rx.pending() as usize {
                    return done;
                }
                want = if c == 0 { rx.size() as usize } else { frames.len() - done };
                continue 'refill;
            }
            let nbufs = (k - c) as u16;
            if nbufs == 1 {
                // The common case: the frame fits the next chain.
                let chain = &batch.chains[c];
                write_frame(batch.writable(chain), &header(1), f.frame());
                rx.add_used(chain.head, need as u32);
                stats.packets += 1;
                stats.bytes += f.len as u64;
                done += 1;
                c = k;
                continue;
            }
            let mut off = 0usize;
            let mut first = true;
            for chain in &batch.chains[c..k] {
                let segs = batch.writable(chain);
                let mut used = 0usize;
                if first {
                    // A driver must post buffers of at least a header; one
                    // that did not gets a truncated header, nothing worse.
                    used = copy_to_segs(segs, 0, &header(nbufs));
                    first = false;
                }
                let n = copy_to_segs(segs, used, &f.frame()[off..]);
                off += n;
                used += n;
                rx.add_used(chain.head, used as u32);
            }
            stats.packets += 1;
            stats.bytes += f.len as u64;
            done += 1;
            c = k;
        }
        rx.unpop((popped - c) as u16);
        return done;
    }
}

/// Control queue classes and commands (virtio 1.2, 5.1.6.5).
mod ctrl {
    pub const CLASS_RX: u8 = 0;
    pub const CLASS_MAC: u8 = 1;
    pub const CLASS_ANNOUNCE: u8 = 3;
    pub const CLASS_MQ: u8 = 4;
    pub const MQ_VQ_PAIRS_SET: u8 = 0;
    pub const MAC_ADDR_SET: u8 = 1;
    pub const OK: u8 = 0;
    pub const ERR: u8 = 1;
}

/// State the control queue changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtrlState {
    /// Queue pairs the driver uses (VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET).
    pub active_pairs: u16,
    /// Most pairs the device has.
    pub max_pairs: u16,
    /// MAC set through VIRTIO_NET_CTRL_MAC_ADDR_SET.
    pub mac: [u8; 6],
    /// Commands refused (malformed or unsupported).
    pub errors: u64,
}

/// Handles the control requests in the ring. Returns the number handled.
pub fn process_ctrl(q: &mut SplitQueue, batch: &mut Batch, state: &mut CtrlState) -> usize {
    let n = q.pop_batch(batch, BURST, Access::ReadThenWrite);
    for chain in &batch.chains {
        let mut req = [0u8; 64];
        let got = copy_from_segs(batch.readable(chain), 0, &mut req);
        let ack = if got < 2 || chain.write_len < 1 {
            ctrl::ERR
        } else {
            let (class, cmd, data) = (req[0], req[1], &req[2..got]);
            match (class, cmd) {
                (ctrl::CLASS_MQ, ctrl::MQ_VQ_PAIRS_SET) if data.len() >= 2 => {
                    let pairs = u16::from_le_bytes([data[0], data[1]]);
                    if pairs >= 1 && pairs <= state.max_pairs {
                        state.active_pairs = pairs;
                        ctrl::OK
                    } else {
                        ctrl::ERR
                    }
                }
                (ctrl::CLASS_MAC, ctrl::MAC_ADDR_SET) if data.len() >= 6 => {
                    state.mac.copy_from_slice(&data[..6]);
                    ctrl::OK
                }
                // RX mode and MAC table: every frame goes to the guest anyway.
                (ctrl::CLASS_RX, _) | (ctrl::CLASS_MAC, _) | (ctrl::CLASS_ANNOUNCE, _) => ctrl::OK,
                // VLAN filtering was not offered; anything else is unknown.
                _ => ctrl::ERR,
            }
        };
        if ack != ctrl::OK {
            state.errors += 1;
        }
        if chain.write_len >= 1 {
            copy_to_segs(batch.writable(chain), 0, &[ack]);
            q.add_used(chain.head, 1);
        } else {
            q.add_used(chain.head, 0);
        }
    }
    q.flush_used();
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_layout() {
        let c = NetConfig { mac: [2, 0, 0, 0, 0, 1], status: 1, max_queue_pairs: 4, mtu: 1500 };
        assert_eq!(c.bytes(), [2, 0, 0, 0, 0, 1, 1, 0, 4, 0, 0xdc, 0x05]);
    }

    #[test]
    fn layout_follows_features() {
        let v1 = virtq::ring::features::VERSION_1;
        assert_eq!(Layout::from_features(v1), Layout { hdr_len: 12, mergeable: false });
        assert_eq!(Layout::from_features(features::MRG_RXBUF), Layout { hdr_len: 12, mergeable: true });
        assert_eq!(Layout::from_features(0), Layout { hdr_len: 10, mergeable: false });
    }

    #[test]
    fn header_carries_num_buffers() {
        assert_eq!(header(3)[10..12], [3, 0]);
        assert_eq!(header(3)[..10], [0; 10]);
    }
}
