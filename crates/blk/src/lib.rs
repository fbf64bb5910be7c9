//! The virtio-blk device (virtio 1.2, section 5.2): reads requests from a
//! virtqueue, checks them, runs them on a block backend and writes the
//! status byte back. Requests run asynchronously, many per queue, and each
//! is completed as soon as it finishes, in any order (the device does not
//! offer IN_ORDER): a slow request does not hold back the ones after it.
//!
//! A request is one chain: a 16-byte device-readable header (type,
//! reserved, sector), data (device-readable for OUT, DISCARD and
//! WRITE_ZEROES; device-writable for IN and GET_ID), and a device-writable
//! status byte last. Everything in it comes from the guest and is checked:
//! a chain without a writable byte cannot be answered and is returned with
//! length 0 and counted; every other bad request gets IOERR or UNSUPP.
//!
//! Guest memory is reached only through virtq's fence: the chain's views to
//! read the header and write GET_ID, and `IoBufs` for the data lent to the
//! backend and the status byte stored at completion. No `unsafe` here.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

pub mod device;
pub mod wire;
pub use device::{build, BlkGroup};
use vhostd_device::RequestRing;
pub use vhostd_device::{inflight, InflightLog};
pub use wire::{features, status, types, CONFIG_LEN, HEADER_LEN, ID_LEN, SECTOR};

use vhostd_block_backends::{BlockBackend, Completion, DiskInfo, Op, Request};
use virtq::ring::MAX_QUEUE_SIZE;
use virtq::{Batch, GuestBufs, IoBufs, Queue};

/// Data segments a request may have (advertised as seg_max).
pub const SEG_MAX: u32 = 128;
/// Largest data segment (advertised as size_max). SEG_MAX x SIZE_MAX must
/// stay below 32 MiB: SeaBIOS divides it by 512 into a u16 and, at 0,
/// loops forever on zero-length reads.
pub const SIZE_MAX: u32 = 128 << 10;
/// Largest DISCARD / WRITE_ZEROES range in sectors (1 GiB).
pub const MAX_RANGE_SECTORS: u32 = 1 << 21;

/// What stays across connections: the disk's shape and the cache mode.
pub struct BlkDevice {
    /// The disk behind the backends.
    pub disk: DiskInfo,
    /// Request queues.
    pub queues: u16,
    /// The GET_ID answer.
    pub id: [u8; ID_LEN],
    /// Write-back cache mode (the default); cleared by the driver through
    /// the config space (CONFIG_WCE), writes are then flushed before they
    /// complete.
    pub writeback: AtomicBool,
    /// The largest ring a driver may set up.
    pub max_queue_size: u16,
}

impl BlkDevice {
    /// A device over `disk` with `queues` request queues; `serial` (cut to
    /// 20 bytes) answers GET_ID.
    pub fn new(disk: DiskInfo, queues: u16, serial: &str) -> BlkDevice {
        let mut id = [0u8; ID_LEN];
        let n = serial.len().min(ID_LEN);
        id[..n].copy_from_slice(&serial.as_bytes()[..n]);
        BlkDevice { disk, queues, id, writeback: AtomicBool::new(true), max_queue_size: MAX_QUEUE_SIZE }
    }

    /// virtio-blk feature bits (the ring features are `Device::features`').
    pub fn blk_features(&self) -> u64 {
        let mut f = features::SIZE_MAX
            | features::SEG_MAX
            | features::BLK_SIZE
            | features::FLUSH
            | features::TOPOLOGY
            | features::CONFIG_WCE
            | features::MQ;
        if self.disk.read_only {
            f |= features::RO;
        } else {
            if self.disk.discard {
                f |= features::DISCARD;
            }
            if self.disk.write_zeroes {
                f |= features::WRITE_ZEROES;
            }
        }
        f
    }

    /// The config space (little-endian, as virtio 1.x lays it out).
    pub fn config(&self) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        use wire::config::*;
        let put32 = |c: &mut [u8; CONFIG_LEN], off: usize, v: u32| c[off..off + 4].copy_from_slice(&v.to_le_bytes());
        c[CAPACITY..CAPACITY + 8].copy_from_slice(&(self.disk.capacity / SECTOR).to_le_bytes());
        put32(&mut c, wire::config::SIZE_MAX, crate::SIZE_MAX);
        put32(&mut c, wire::config::SEG_MAX, crate::SEG_MAX);
        // geometry (16..20) stays zero: no legacy CHS.
        put32(&mut c, BLK_SIZE, self.disk.block_size);
        // topology: physical block exponent (physical = logical here),
        // alignment offset 0, min_io_size 1 logical block, opt_io_size 0.
        c[PHYSICAL_BLOCK_EXP] = 0;
        c[MIN_IO_SIZE..MIN_IO_SIZE + 2].copy_from_slice(&1u16.to_le_bytes());
        c[WRITEBACK] = self.writeback.load(Ordering::Relaxed) as u8;
        c[NUM_QUEUES..NUM_QUEUES + 2].copy_from_slice(&self.queues.to_le_bytes());
        let align = (self.disk.block_size as u64 / SECTOR).max(1) as u32;
        put32(&mut c, MAX_DISCARD_SECTORS, MAX_RANGE_SECTORS);
        put32(&mut c, MAX_DISCARD_SEG, 1);
        put32(&mut c, DISCARD_SECTOR_ALIGNMENT, align);
        put32(&mut c, MAX_WRITE_ZEROES_SECTORS, MAX_RANGE_SECTORS);
        put32(&mut c, MAX_WRITE_ZEROES_SEG, 1);
        c[WRITE_ZEROES_MAY_UNMAP] = self.disk.discard as u8;
        c
    }

    /// A driver write to the config space: only `writeback` is writable.
    /// Returns false for anything else.
    pub fn set_config(&self, offset: usize, data: &[u8]) -> bool {
        if offset == wire::config::WRITEBACK && data.len() == 1 && data[0] <= 1 {
            self.writeback.store(data[0] == 1, Ordering::Relaxed);
            return true;
        }
        false
    }
}

/// Counters of one request queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlkStats {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub discards: u64,
    pub write_zeroes: u64,
    pub get_ids: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Requests answered IOERR (bad request, or the backend failed).
    pub ioerr: u64,
    /// Requests answered UNSUPP (unknown type, feature not offered).
    pub unsupp: u64,
    /// Chains with no writable byte for a status: returned with length 0.
    pub no_status: u64,
    /// Requests past the capacity.
    pub out_of_range: u64,
    /// Writes, discards or write-zeroes refused on a read-only disk.
    pub read_only: u64,
    /// Requests whose data length or range is not whole sectors.
    pub misaligned: u64,
    /// Backend completions with an error.
    pub backend_errors: u64,
    /// Passes that popped or completed something.
    pub batches: u64,
    /// Most requests in flight at once.
    pub max_in_flight: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Free,
    /// Handed to the backend.
    Running,
    /// Running a write, then a flush (write-through mode).
    RunningThenFlush,
    /// Finished; waiting for the requests before it.
    Done,
}

/// A request in flight.
struct Slot {
    stage: Stage,
    head: u16,
    status: u8,
    /// Bytes written into the chain (IN data, GET_ID), plus the status byte.
    used_len: u32,
    kind: u32,
    /// Data bytes of a read or write.
    bytes: u64,
    /// The data lent to the backend and the status byte (none: the chain
    /// has no writable byte to answer in).
    io: IoBufs,
}

/// One request queue's in-flight state and its backend.
pub struct BlkQueue {
    backend: Box<dyn BlockBackend>,
    /// One per request in flight at most; a request's tag is its slot.
    slots: Vec<Slot>,
    /// Slots not in use.
    free: Vec<u32>,
    /// Slots whose request has finished, to be completed.
    done: Vec<u32>,
    completions: Vec<Completion>,
    /// Popping, completing and the inflight log.
    ring: RequestRing,
    /// The device's counters.
    pub stats: BlkStats,
    completes_elsewhere: bool,
    /// Largest data segment accepted: SIZE_MAX when the driver negotiated
    /// VIRTIO_BLK_F_SIZE_MAX, otherwise any (QEMU does not pass SIZE_MAX on
    /// to the guest, and Linux then merges contiguous pages into segments
    /// of any size; virtio 1.2, 5.2.3: size_max binds only when negotiated).
    max_piece: usize,
}

impl BlkQueue {
    /// In-flight state for `backend`, with at most `depth` requests.
    pub fn new(backend: Box<dyn BlockBackend>, depth: usize) -> BlkQueue {
        let depth = depth.clamp(1, u32::MAX as usize);
        let slots = (0..depth)
            .map(|_| Slot {
                stage: Stage::Free,
                head: 0,
                status: 0,
                used_len: 0,
                kind: 0,
                bytes: 0,
                io: IoBufs::with_capacity(SEG_MAX as usize),
            })
            .collect();
        BlkQueue {
            completes_elsewhere: backend.completion_fd().is_some(),
            backend,
            slots,
            free: (0..depth as u32).rev().collect(),
            done: Vec::with_capacity(depth),
            completions: Vec::with_capacity(depth),
            ring: RequestRing::new(depth),
            stats: BlkStats::default(),
            max_piece: SIZE_MAX as usize,
        }
    }

    /// Applies the negotiated features (when the ring starts).
    pub fn set_features(&mut self, features: u64) {
        self.max_piece = if features & features::SIZE_MAX != 0 { SIZE_MAX as usize } else { u32::MAX as usize };
    }

    /// Requests popped and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// The backend's completion descriptor (for a sleeping dataplane).
    pub fn completion_fd(&self) -> Option<std::os::unix::io::RawFd> {
        self.backend.completion_fd()
    }

    /// The kernel (not this thread) finishes the backend's requests: it has
    /// a completion descriptor. Known at construction, asked per idle pass.
    pub fn completes_elsewhere(&self) -> bool {
        self.completes_elsewhere
    }

    /// The backend's counters.
    pub fn backend_stats(&self) -> vhostd_block_backends::BlockStats {
        self.backend.stats()
    }

    /// The dataplane woke on the completion descriptor: consume the wake-up.
    pub fn ack_completion_event(&mut self) {
        self.backend.ack_completion_event();
    }

    /// One pass: pops and starts new requests, then completes what the
    /// backend finished (before or during the submit). Returns requests
    /// started or completed.
    pub fn process(&mut self, q: &mut Queue, batch: &mut Batch, dev: &BlkDevice) -> usize {
        let mut work = 0;
        let room = self.free.len().min(self.backend.room());
        if room > 0 && !q.is_broken() {
            let (n, rejected) = self.ring.pop(q, batch, room);
            work += rejected;
            // Request headers and status bytes are fetched a few requests
            // ahead of the decode, so their misses (the driver wrote them
            // last, on its CPU) overlap rather than come one per request.
            let fetch = |chain: &virtq::Chain| {
                batch.readable(chain).prefetch(0);
                batch.writable(chain).prefetch_write_last();
            };
            batch.each_fetching_ahead(fetch, |chain| {
                self.start(chain.head, chain.read_len, batch.readable(chain), batch.writable(chain), dev)
            });
            if n > 0 {
                self.backend.submit();
                work += n;
                // Requests with the backend (those answered at once wait in `done`).
                let at_backend = self.in_flight() - self.done.len();
                self.stats.max_in_flight = self.stats.max_in_flight.max(at_backend as u64);
            }
        }
        // Reaped after the submit: a request the backend finished during it
        // (null; io_uring from the page cache) is answered in this pass
        // rather than the next. At queue depth 1 that is one pass per
        // request instead of two. (Room frees only in complete_done, so
        // reaping before the pop would not let more requests in.)
        work += self.reap();
        work += self.complete_done(q);
        if work > 0 {
            self.stats.batches += 1;
        }
        work
    }

    /// Starts logging requests in flight in `log` (a ring just attached,
    /// split layout only), after resubmitting the ones a previous backend
    /// left there: the ring resumes after every chain taken so far (used
    /// entries + those in flight). Returns the requests resubmitted.
    pub fn attach_inflight(&mut self, log: InflightLog, q: &mut Queue, batch: &mut Batch, dev: &BlkDevice) -> usize {
        // The ring is out of `self` while `start` runs (it borrows all of it).
        let mut ring = std::mem::take(&mut self.ring);
        let room = self.free.len();
        let n = ring.recover(log, q, batch, room, |head, readable, writable| {
            self.start(head, readable.bytes() as u32, readable, writable, dev)
        });
        self.ring = ring;
        if n > 0 {
            self.backend.submit();
        }
        self.complete_done(q);
        n
    }

    /// Stops logging (the ring is handed back).
    pub fn detach_inflight(&mut self) {
        self.ring.detach();
    }

    /// Completes what the backend finished, and starts nothing new (a ring
    /// that is stopping). Returns requests completed.
    pub fn finish(&mut self, q: &mut Queue) -> usize {
        self.reap() + self.complete_done(q)
    }

    /// Waits for every request in flight and completes them (before the
    /// ring is handed back or the memory table changes).
    pub fn drain(&mut self, q: &mut Queue, dev: &BlkDevice) {
        let _ = dev;
        while self.backend.in_flight() > 0 {
            self.backend.wait();
            self.reap();
        }
        self.reap();
        // The backend has nothing left: a request still running was lost
        // (cannot happen with a correct backend); answer it IOERR rather
        // than keep pointers into memory that is about to go.
        let mut lost = 0;
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if matches!(slot.stage, Stage::Running | Stage::RunningThenFlush) {
                slot.stage = Stage::Done;
                slot.status = status::IOERR;
                self.stats.ioerr += 1;
                self.done.push(i as u32);
                lost += 1;
            }
        }
        if lost > 0 {
            tracing::warn!("ring stopped with {lost} request(s) the backend never completed: answered IOERR");
        }
        self.complete_done(q);
        // Idle slots keep the last table held (see IoBufs); the ring is
        // going or its memory changing, so let go of it.
        for slot in &mut self.slots {
            slot.io.release();
        }
        self.backend.release_memory();
    }

    /// Takes the backend's completions into their slots. Returns how many.
    fn reap(&mut self) -> usize {
        self.completions.clear();
        self.backend.reap(&mut self.completions);
        let n = self.completions.len();
        let mut resubmit = false;
        for i in 0..n {
            let c = self.completions[i];
            let Some(slot) = self.slots.get_mut(c.tag as usize) else { continue };
            match slot.stage {
                Stage::Running | Stage::RunningThenFlush if c.result < 0 => {
                    self.stats.backend_errors += 1;
                    self.stats.ioerr += 1;
                    slot.status = status::IOERR;
                    slot.stage = Stage::Done;
                    self.done.push(c.tag as u32);
                }
                Stage::RunningThenFlush => {
                    // The write is in; now make it durable.
                    let req = Request { tag: c.tag, op: Op::Flush, offset: 0, len: 0, bufs: &IoBufs::new() };
                    if self.backend.queue(&req).is_ok() {
                        slot.stage = Stage::Running;
                        resubmit = true;
                    } else {
                        slot.status = status::IOERR;
                        self.stats.ioerr += 1;
                        slot.stage = Stage::Done;
                        self.done.push(c.tag as u32);
                    }
                }
                Stage::Running => {
                    slot.status = status::OK;
                    slot.stage = Stage::Done;
                    self.done.push(c.tag as u32);
                }
                Stage::Free | Stage::Done => {}
            }
        }
        if resubmit {
            self.backend.submit();
        }
        n
    }

    /// Writes status bytes and used entries of the finished requests (in
    /// the order they finished) with one publish. Returns how many.
    fn complete_done(&mut self, q: &mut Queue) -> usize {
        let n = self.done.len();
        for k in 0..n {
            let i = self.done[k] as usize;
            let slot = &mut self.slots[i];
            if slot.kind == types::IN && slot.bytes > 0 {
                // The kernel may have written the data (all of it, or some
                // before an error): the dirty log must hear of it.
                slot.io.data_written();
            }
            let answered = slot.io.write_status(slot.status);
            let used = if answered {
                if slot.status == status::OK {
                    slot.used_len
                } else {
                    1
                }
            } else {
                0
            };
            if slot.status == status::OK {
                match slot.kind {
                    types::IN => self.stats.bytes_read += slot.bytes,
                    types::OUT => self.stats.bytes_written += slot.bytes,
                    _ => {}
                }
            }
            self.ring.complete(q, slot.head, used);
            slot.stage = Stage::Free;
            slot.io.clear();
            self.free.push(i as u32);
        }
        self.done.clear();
        if n > 0 {
            self.ring.publish(q);
        }
        n
    }

    /// Parses one chain and starts it (or finishes it at once).
    fn start(&mut self, head: u16, read_len: u32, readable: GuestBufs<'_>, writable: GuestBufs<'_>, dev: &BlkDevice) {
        // `process` pops no more chains than there are free slots.
        let Some(seq) = self.free.pop() else { return };
        // Finished at once unless handed to the backend below.
        self.done.push(seq);
        let seq = seq as u64;
        let slot = &mut self.slots[seq as usize];
        slot.head = head;
        slot.io.clear();
        slot.used_len = 1;
        slot.bytes = 0;
        slot.stage = Stage::Done;
        // The status byte: the last byte of the last writable segment.
        if !writable.lend_last_byte(&mut slot.io) {
            slot.status = status::IOERR;
            self.stats.no_status += 1;
            return;
        }
        let mut hdr = [0u8; HEADER_LEN];
        if (read_len as usize) < HEADER_LEN || readable.read(0, &mut hdr) < HEADER_LEN {
            slot.status = status::IOERR;
            self.stats.ioerr += 1;
            return;
        }
        let kind = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
        let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap_or([0; 8]));
        slot.kind = kind;
        let disk = &dev.disk;
        let fail = |slot: &mut Slot, st: u8, stats: &mut BlkStats| {
            slot.status = st;
            if st == status::UNSUPP {
                stats.unsupp += 1;
            } else {
                stats.ioerr += 1;
            }
        };
        let op = match kind {
            types::IN | types::OUT => {
                let out = kind == types::OUT;
                if out {
                    self.stats.writes += 1;
                } else {
                    self.stats.reads += 1;
                }
                if out && disk.read_only {
                    self.stats.read_only += 1;
                    return fail(slot, status::IOERR, &mut self.stats);
                }
                // OUT data: readable bytes after the header; IN data:
                // writable bytes before the status byte.
                // Pieces and their sizes are bounded as advertised
                // (seg_max, size_max).
                let (pieces, piece) = (SEG_MAX as usize, self.max_piece);
                let ok = if out {
                    readable.lend(HEADER_LEN, usize::MAX, pieces, piece, &mut slot.io)
                } else {
                    writable.lend(0, writable.bytes() - 1, pieces, piece, &mut slot.io)
                };
                if !ok {
                    return fail(slot, status::IOERR, &mut self.stats);
                }
                let bytes = slot.io.data_len();
                if !bytes.is_multiple_of(SECTOR) {
                    self.stats.misaligned += 1;
                    return fail(slot, status::IOERR, &mut self.stats);
                }
                let Some(offset) = in_range(sector, bytes, disk.capacity) else {
                    self.stats.out_of_range += 1;
                    return fail(slot, status::IOERR, &mut self.stats);
                };
                if bytes == 0 {
                    slot.status = status::OK;
                    return;
                }
                slot.bytes = bytes;
                if !out {
                    slot.used_len = bytes as u32 + 1;
                }
                let write_through = out && !dev.writeback.load(Ordering::Relaxed);
                (if out { Op::Write } else { Op::Read }, offset, bytes, write_through)
            }
            types::FLUSH => {
                self.stats.flushes += 1;
                (Op::Flush, 0, 0, false)
            }
            types::GET_ID => {
                self.stats.get_ids += 1;
                let room = (writable.bytes() - 1).min(ID_LEN);
                let n = writable.write(0, &dev.id[..room]);
                slot.used_len = n as u32 + 1;
                slot.status = status::OK;
                return;
            }
            types::DISCARD | types::WRITE_ZEROES => {
                let discard = kind == types::DISCARD;
                if discard {
                    self.stats.discards += 1;
                } else {
                    self.stats.write_zeroes += 1;
                }
                // Neither is offered on a read-only disk (see `features`):
                // UNSUPP, as for any feature the driver was not given.
                let offered = if discard { disk.discard } else { disk.write_zeroes };
                if !offered || disk.read_only {
                    return fail(slot, status::UNSUPP, &mut self.stats);
                }
                // Exactly one range (max_discard_seg / max_write_zeroes_seg = 1).
                let mut r = [0u8; wire::RANGE_LEN];
                if read_len as usize != HEADER_LEN + wire::RANGE_LEN
                    || readable.read(HEADER_LEN, &mut r) != wire::RANGE_LEN
                {
                    return fail(slot, status::UNSUPP, &mut self.stats);
                }
                let start = u64::from_le_bytes(r[0..8].try_into().unwrap_or([0; 8]));
                let count = u32::from_le_bytes(r[8..12].try_into().unwrap_or([0; 4]));
                let flags = u32::from_le_bytes(r[12..16].try_into().unwrap_or([0; 4]));
                // Discard takes no flags; write-zeroes only UNMAP (bit 0).
                if (discard && flags != 0) || (!discard && flags & !wire::RANGE_F_UNMAP != 0) {
                    return fail(slot, status::UNSUPP, &mut self.stats);
                }
                if count > MAX_RANGE_SECTORS {
                    return fail(slot, status::IOERR, &mut self.stats);
                }
                let bytes = count as u64 * SECTOR;
                let Some(offset) = in_range(start, bytes, disk.capacity) else {
                    self.stats.out_of_range += 1;
                    return fail(slot, status::IOERR, &mut self.stats);
                };
                if bytes == 0 {
                    slot.status = status::OK;
                    return;
                }
                // Unmap only where the config space says it may
                // (write_zeroes_may_unmap follows discard=on).
                let unmap = flags & wire::RANGE_F_UNMAP != 0;
                let op = if discard { Op::Discard } else { Op::WriteZeroes { unmap: unmap && disk.discard } };
                (op, offset, bytes, false)
            }
            _ => return fail(slot, status::UNSUPP, &mut self.stats),
        };
        let (op, offset, bytes, write_through) = op;
        let req = Request { tag: seq, op, offset, len: bytes, bufs: &slot.io };
        match self.backend.queue(&req) {
            Ok(()) => {
                slot.stage = if write_through { Stage::RunningThenFlush } else { Stage::Running };
                self.done.pop();
            }
            Err(_) => {
                self.stats.backend_errors += 1;
                fail(slot, status::IOERR, &mut self.stats);
            }
        }
    }
}

/// Byte offset of `sector` if `bytes` from there stay inside `capacity`.
fn in_range(sector: u64, bytes: u64, capacity: u64) -> Option<u64> {
    let offset = sector.checked_mul(SECTOR)?;
    (offset.checked_add(bytes)? <= capacity).then_some(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(in_range(0, 512, 1024), Some(0));
        assert_eq!(in_range(1, 512, 1024), Some(512));
        assert_eq!(in_range(2, 512, 1024), None);
        assert_eq!(in_range(u64::MAX / 256, 512, u64::MAX), None);
        assert_eq!(in_range(u64::MAX, 0, u64::MAX), None);
    }

    #[test]
    fn largest_request_fits_seabios() {
        // SeaBIOS: (u16)(size_max * seg_max / 512) must not be 0.
        assert!((SIZE_MAX as u64 * SEG_MAX as u64 / 512) < 65536);
    }

    #[test]
    fn config_layout() {
        let disk =
            DiskInfo { capacity: 1 << 20, read_only: false, block_size: 4096, discard: true, write_zeroes: true };
        let dev = BlkDevice::new(disk, 2, "vhostd-test");
        let c = dev.config();
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8);
        assert_eq!(c[32], 1);
        assert!(dev.set_config(32, &[0]));
        assert_eq!(dev.config()[32], 0);
        assert!(!dev.set_config(0, &[0]));
        assert!(!dev.set_config(32, &[2]));
        assert_ne!(dev.blk_features() & features::DISCARD, 0);
        let ro = BlkDevice::new(DiskInfo { read_only: true, ..disk }, 1, "x");
        assert_eq!(ro.blk_features() & (features::DISCARD | features::WRITE_ZEROES), 0);
        assert_ne!(ro.blk_features() & features::RO, 0);
    }
}
