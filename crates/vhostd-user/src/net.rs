//! virtio-net queues over fixed buffers: each descriptor owns one buffer of
//! `buf_size` bytes for its whole life, so the hot path only recycles head
//! indexes (no descriptor writes for RX, one length store for TX).

use crate::queue::VirtQueue;
use crate::Error;
use virtq_driver::{Buf, SharedBytes, SharedBytesMut, Used};

/// Largest frame we reassemble from mergeable buffers (64 KiB + Ethernet).
const MAX_MERGED: usize = 65536 + 14;
/// virtio_net_hdr with num_buffers (VERSION_1, or MRG_RXBUF); legacy's is 10.
const MAX_HDR_LEN: usize = 12;

/// Per-queue counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Frames (completed sends on TX, delivered frames on RX).
    pub packets: u64,
    /// Frame bytes, virtio-net header excluded.
    pub bytes: u64,
    /// Frames the device returned malformed (RX) or we had no room for (TX).
    pub dropped: u64,
    /// RX: used entries with an impossible length or num_buffers.
    pub bad: u64,
}

impl NetStats {
    /// Adds another queue's counters.
    pub fn add(&mut self, o: &NetStats) {
        self.packets += o.packets;
        self.bytes += o.bytes;
        self.dropped += o.dropped;
        self.bad += o.bad;
    }
}

/// A virtio-net transmit queue (odd index) with one fixed buffer per descriptor.
pub struct TxQueue {
    /// The queue (public for raw ring access in tests).
    pub queue: VirtQueue,
    hdr_len: usize,
    buf_size: u32,
    /// Host address of slot 0; slot `s` is at `base + s * buf_size`.
    base: *mut u8,
    /// head -> slot.
    slot_of: Vec<u16>,
    /// head -> frame length in flight.
    frame_len: Vec<u32>,
    /// Heads free to send.
    free: Vec<u16>,
    template_len: u32,
    scratch: Vec<Used>,
    /// Counters (packets/bytes count completed sends).
    pub stats: NetStats,
}

// SAFETY: `base` points into the guest memory that `queue.ring` keeps mapped
// (its DriverMemory holds the Arc); one thread owns the queue at a time.
unsafe impl Send for TxQueue {}

impl TxQueue {
    /// Prepares one read-only descriptor per slot of the `size * buf_size`
    /// bytes at guest-physical `bufs`.
    pub fn new(mut queue: VirtQueue, bufs: u64, buf_size: u32, hdr_len: usize) -> Result<TxQueue, Error> {
        if hdr_len > MAX_HDR_LEN || hdr_len > buf_size as usize {
            return Err(Error::Config(format!("a {hdr_len}-byte virtio_net_hdr in {buf_size}-byte buffers")));
        }
        let size = queue.ring.size();
        let base = queue
            .ring
            .memory()
            .host(bufs, size as u64 * buf_size as u64)
            .ok_or_else(|| Error::Config("TX buffers outside guest memory".into()))?;
        let mut slot_of = vec![0u16; size as usize];
        let mut free = Vec::with_capacity(size as usize);
        for s in 0..size {
            let gpa = bufs + s as u64 * buf_size as u64;
            let head = queue.ring.prepare(&[Buf { addr: gpa, len: hdr_len as u32 }], &[], s as u64)?;
            slot_of[head as usize] = s;
            free.push(head);
        }
        free.reverse();
        Ok(TxQueue {
            queue,
            hdr_len,
            buf_size,
            base,
            slot_of,
            frame_len: vec![0; size as usize],
            free,
            template_len: 0,
            scratch: vec![Used::default(); size as usize],
            stats: NetStats::default(),
        })
    }

    #[inline]
    fn slot_ptr(&self, head: u16) -> *mut u8 {
        let s = self.slot_of[head as usize] as usize;
        // SAFETY: s < size and the buffer area holds size * buf_size bytes
        // (checked in `new`).
        unsafe { self.base.add(s * self.buf_size as usize) }
    }

    /// Largest frame a slot holds.
    pub fn max_frame(&self) -> usize {
        self.buf_size as usize - self.hdr_len
    }

    /// Slots free to send now.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Takes completed sends back (busy-poll this). Returns how many completed.
    #[inline]
    pub fn reclaim(&mut self) -> Result<usize, Error> {
        let mut out = std::mem::take(&mut self.scratch);
        let r = self.queue.ring.pop_used_batch(&mut out, true);
        let n = *r.as_ref().unwrap_or(&0);
        for u in &out[..n] {
            self.stats.packets += 1;
            self.stats.bytes += self.frame_len[u.id as usize] as u64;
            self.free.push(u.id);
        }
        self.scratch = out;
        r.map_err(Error::Ring)
    }

    /// Queues one frame (header zeroed, frame copied into a free slot);
    /// visible to the backend after `flush`. Ok(false) when no slot is free.
    #[inline]
    pub fn send_frame(&mut self, frame: &[u8]) -> Result<bool, Error> {
        self.send_frame_with_header(&[], frame)
    }

    /// As `send_frame`, with the virtio_net_hdr starting with `hdr` (the
    /// rest zero): e.g. checksum or segmentation offload requests.
    #[inline]
    pub fn send_frame_with_header(&mut self, hdr: &[u8], frame: &[u8]) -> Result<bool, Error> {
        self.send(hdr, frame.into())
    }

    /// As `send_frame`, from shared memory: a frame received (echo).
    #[inline]
    pub fn send_shared(&mut self, frame: SharedBytes) -> Result<bool, Error> {
        self.send(&[], frame)
    }

    #[inline]
    fn send(&mut self, hdr: &[u8], frame: SharedBytes) -> Result<bool, Error> {
        let hdr = &hdr[..hdr.len().min(self.hdr_len)];
        if frame.len() > self.max_frame() {
            return Err(Error::Config(format!("frame of {} bytes exceeds {}", frame.len(), self.max_frame())));
        }
        let Some(head) = self.free.pop() else {
            return Ok(false);
        };
        // SAFETY: the slot's buf_size >= hdr_len + frame.len() bytes, in the
        // frontend's memory, which outlives `b`; nothing borrows them.
        let mut b = unsafe { SharedBytesMut::new(self.slot_ptr(head), self.hdr_len + frame.len()) };
        b.write_at(0, &[0; MAX_HDR_LEN][..self.hdr_len]);
        b.write_at(0, hdr);
        b.write_shared_at(self.hdr_len, frame);
        let len = (self.hdr_len + frame.len()) as u32;
        self.queue.ring.set_kept_len(head, len)?;
        self.frame_len[head as usize] = frame.len() as u32;
        self.queue.ring.repost(head)?;
        Ok(true)
    }

    /// Writes `frame` into every free slot, for `send_template`.
    pub fn set_template(&mut self, frame: &[u8]) -> Result<(), Error> {
        if frame.len() > self.max_frame() {
            return Err(Error::Config(format!("frame of {} bytes exceeds {}", frame.len(), self.max_frame())));
        }
        for i in 0..self.free.len() {
            let head = self.free[i];
            let p = self.slot_ptr(head);
            // SAFETY: as in send_frame.
            unsafe {
                std::ptr::write_bytes(p, 0, self.hdr_len);
                std::ptr::copy_nonoverlapping(frame.as_ptr(), p.add(self.hdr_len), frame.len());
            }
            self.queue.ring.set_kept_len(head, (self.hdr_len + frame.len()) as u32)?;
            self.frame_len[head as usize] = frame.len() as u32;
        }
        self.template_len = frame.len() as u32;
        Ok(())
    }

    /// Queues up to `n` copies of the template without touching the buffers
    /// (the fastest send: one avail ring store per frame). Call after
    /// `set_template` with all slots free; visible after `flush`.
    #[inline]
    pub fn send_template(&mut self, n: usize) -> Result<usize, Error> {
        let n = n.min(self.free.len());
        for _ in 0..n {
            if let Some(head) = self.free.pop() {
                self.queue.ring.repost(head)?;
            }
        }
        Ok(n)
    }

    /// Publishes queued frames (one avail.idx store) and kicks if needed.
    #[inline]
    pub fn flush(&mut self) -> Result<bool, Error> {
        self.queue.publish_and_kick()
    }
}

/// A virtio-net receive queue (even index) with one fixed device-writable
/// buffer per descriptor, all kept posted.
pub struct RxQueue {
    /// The queue (public for raw ring access in tests).
    pub queue: VirtQueue,
    hdr_len: usize,
    buf_size: u32,
    base: *mut u8,
    slot_of: Vec<u16>,
    mrg: bool,
    /// Reassembly of a frame spread over several buffers.
    merged: Vec<u8>,
    merged_hdr: Vec<u8>,
    merge_left: u16,
    /// A frame copied out of shared memory (`recv_burst_with_header`).
    copy: Vec<u8>,
    scratch: Vec<Used>,
    /// Counters (packets/bytes count delivered frames).
    pub stats: NetStats,
}

// SAFETY: as for TxQueue.
unsafe impl Send for RxQueue {}

impl RxQueue {
    /// Prepares and posts one writable descriptor per slot (published, no kick:
    /// the backend has not started the queue yet).
    pub fn new(mut queue: VirtQueue, bufs: u64, buf_size: u32, hdr_len: usize, mrg: bool) -> Result<RxQueue, Error> {
        if hdr_len > MAX_HDR_LEN || hdr_len > buf_size as usize || (mrg && hdr_len < MAX_HDR_LEN) {
            return Err(Error::Config(format!("a {hdr_len}-byte virtio_net_hdr in {buf_size}-byte buffers")));
        }
        let size = queue.ring.size();
        let base = queue
            .ring
            .memory()
            .host(bufs, size as u64 * buf_size as u64)
            .ok_or_else(|| Error::Config("RX buffers outside guest memory".into()))?;
        let mut slot_of = vec![0u16; size as usize];
        for s in 0..size {
            let gpa = bufs + s as u64 * buf_size as u64;
            let head = queue.ring.prepare(&[], &[Buf { addr: gpa, len: buf_size }], s as u64)?;
            slot_of[head as usize] = s;
            queue.ring.repost(head)?;
        }
        queue.ring.publish();
        Ok(RxQueue {
            queue,
            hdr_len,
            buf_size,
            base,
            slot_of,
            mrg,
            merged: Vec::new(),
            merged_hdr: Vec::new(),
            merge_left: 0,
            copy: Vec::with_capacity(buf_size as usize),
            scratch: vec![Used::default(); size as usize],
            stats: NetStats::default(),
        })
    }

    /// Receives up to `max` used buffers, calling `f` with each complete
    /// frame (header stripped), reposting every buffer, then publishing once
    /// and kicking if the backend wants it. Returns frames delivered.
    /// Malformed used entries are counted in `stats.bad` and dropped; a ring
    /// the device broke is an error.
    #[inline]
    pub fn recv_burst(&mut self, max: usize, mut f: impl FnMut(&[u8])) -> Result<usize, Error> {
        self.recv_burst_with_header(max, |_, frame| f(frame))
    }

    /// As `recv_burst`, also passing each frame's virtio_net_hdr (the first
    /// buffer's; num_buffers included when mergeable).
    #[inline]
    pub fn recv_burst_with_header(&mut self, max: usize, mut f: impl FnMut(&[u8], &[u8])) -> Result<usize, Error> {
        let mut copy = std::mem::take(&mut self.copy);
        let r = self.recv_burst_shared(max, |hdr, frame| {
            // Out of the device's reach before anyone reads it.
            copy.clear();
            frame.append_to(&mut copy);
            f(hdr, &copy)
        });
        self.copy = copy;
        r
    }

    /// As `recv_burst_with_header`, with the frame where it lies (the
    /// device's buffer, or the reassembly buffer): nothing is copied for a
    /// caller that only counts frames or reads a few bytes.
    #[inline]
    pub fn recv_burst_shared(&mut self, max: usize, mut f: impl FnMut(&[u8], SharedBytes)) -> Result<usize, Error> {
        let max = max.min(self.scratch.len());
        let mut out = std::mem::take(&mut self.scratch);
        let r = self.queue.ring.pop_used_batch(&mut out[..max], true);
        let n = *r.as_ref().unwrap_or(&0);
        // Start the cache misses on every header of the batch at once (the
        // device just wrote them from another core) before reading any.
        for u in &out[..n] {
            if let Some(&s) = self.slot_of.get(u.id as usize) {
                // SAFETY: s < size: inside the buffer area.
                virtq_driver::prefetch(unsafe { self.base.add(s as usize * self.buf_size as usize) });
            }
        }
        let mut frames = 0;
        for u in &out[..n] {
            frames += self.handle(u, &mut f);
            // Buffers go back at once; the backend sees them at the publish below.
            self.queue.ring.repost(u.id)?;
        }
        self.scratch = out;
        if n > 0 {
            self.queue.publish_and_kick()?;
        }
        r.map_err(Error::Ring)?;
        Ok(frames)
    }

    #[inline]
    fn handle(&mut self, u: &Used, f: &mut impl FnMut(&[u8], SharedBytes)) -> usize {
        let len = u.len as usize;
        if len > self.buf_size as usize {
            self.stats.bad += 1;
            self.abort_merge();
            return 0;
        }
        let s = self.slot_of[u.id as usize] as usize;
        // SAFETY: s < size, len <= buf_size: inside the buffer area, in
        // the frontend's memory, which outlives this call.
        let data = unsafe { SharedBytes::new(self.base.add(s * self.buf_size as usize), len) };
        if self.merge_left > 0 {
            // Continuation buffers carry no header.
            if self.merged.len() + len > MAX_MERGED {
                self.stats.bad += 1;
                self.abort_merge();
                return 0;
            }
            data.append_to(&mut self.merged);
            self.merge_left -= 1;
            if self.merge_left == 0 {
                self.stats.packets += 1;
                self.stats.bytes += self.merged.len() as u64;
                f(&self.merged_hdr, SharedBytes::from(&self.merged[..]));
                return 1;
            }
            return 0;
        }
        let Some(frame) = data.slice(self.hdr_len..len) else {
            self.stats.bad += 1;
            return 0;
        };
        // The header copied once: what the device writes meanwhile cannot
        // change it between the checks below and `f`.
        let mut hdr = [0u8; MAX_HDR_LEN];
        let hdr = &mut hdr[..self.hdr_len];
        data.copy_to(hdr);
        let nbufs = match (self.mrg, hdr.get(10..12)) {
            (false, _) => 1,
            (true, Some(b)) => u16::from_le_bytes([b[0], b[1]]),
            (true, None) => 0,
        };
        if nbufs == 0 || nbufs > self.queue.ring.size() {
            self.stats.bad += 1;
            return 0;
        }
        if nbufs == 1 {
            self.stats.packets += 1;
            self.stats.bytes += frame.len() as u64;
            f(hdr, frame);
            return 1;
        }
        self.merged_hdr.clear();
        self.merged_hdr.extend_from_slice(hdr);
        self.merged.clear();
        frame.append_to(&mut self.merged);
        self.merge_left = nbufs - 1;
        0
    }

    fn abort_merge(&mut self) {
        if self.merge_left > 0 {
            self.merge_left = 0;
            self.stats.dropped += 1;
        }
    }
}

/// An Ethernet/IPv4/UDP frame of exactly `len` bytes (at least 42), from
/// `src` to `dst` MAC, 198.18.0.1:9 -> 198.18.0.2:9 (benchmark range),
/// payload bytes counting up.
pub fn build_udp_frame(len: usize, src: [u8; 6], dst: [u8; 6]) -> Vec<u8> {
    let len = len.max(42);
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip_len = (len - 14).min(0xffff) as u16;
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&ip_len.to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&[198, 18, 0, 1]);
    ip[16..20].copy_from_slice(&[198, 18, 0, 2]);
    let mut sum: u32 = 0;
    for c in ip.chunks(2) {
        sum += u16::from_be_bytes([c[0], c[1]]) as u32;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    let udp_len = ip_len.saturating_sub(20);
    f[34..36].copy_from_slice(&9u16.to_be_bytes());
    f[36..38].copy_from_slice(&9u16.to_be_bytes());
    f[38..40].copy_from_slice(&udp_len.to_be_bytes());
    for (i, b) in f[42..].iter_mut().enumerate() {
        *b = i as u8;
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_frame_has_valid_ip_checksum() {
        let f = build_udp_frame(64, [2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        assert_eq!(f.len(), 64);
        let mut sum: u32 = 0;
        for c in f[14..34].chunks(2) {
            sum += u16::from_be_bytes([c[0], c[1]]) as u32;
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        assert_eq!(sum, 0xffff);
        assert_eq!(u16::from_be_bytes([f[16], f[17]]), 50);
        assert_eq!(build_udp_frame(10, [0; 6], [0; 6]).len(), 42);
    }
}
