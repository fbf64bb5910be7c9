//! virtio-blk (virtio 1.2, section 5.2) over vhost-user: the config space,
//! request queues with a bounded number of requests in flight, typed and
//! raw (hostile) requests, and a workload engine (`workload`) for the CLI
//! and tests.
//!
//! A request is one chain: a device-readable 16-byte header {le32 type,
//! le32 reserved, le64 sector}, data buffers (device-readable for OUT,
//! DISCARD and WRITE_ZEROES, device-writable for IN and GET_ID), then one
//! device-writable status byte.
//!
//! Each queue has `depth` request slots; a slot owns a 64-byte control
//! block (header, status byte, discard range) and a page-aligned data area
//! in guest memory for its whole life, and keeps its chain's descriptors
//! between requests of the same shape (`DriverRing::prepare` + `repost`), so
//! the steady state writes no descriptors and allocates nothing. Requests
//! complete in any order: each used entry carries its slot back as the
//! chain's token, whatever its position in the used ring.

pub mod workload;

use crate::queue::VirtQueue;
use crate::{features, DeviceType, Error, FrontendMemory, VirtioUser};
use std::time::{Duration, Instant};
use virtq_driver::{Buf, SharedBytes, SharedBytesMut, Used};

// The wire format is the device's (one definition for both sides).
pub use vhostd_blk::wire::{status, types, CONFIG_LEN, HEADER_LEN, ID_LEN, RANGE_F_UNMAP, SECTOR};

/// The status byte before the device writes it (not a valid status).
pub const STATUS_NOT_WRITTEN: u8 = 0xff;

/// A status byte as a word (for messages).
pub fn status_name(s: u8) -> String {
    match s {
        status::OK => "ok".into(),
        status::IOERR => "ioerr".into(),
        status::UNSUPP => "unsupp".into(),
        STATUS_NOT_WRITTEN => "unwritten".into(),
        s => format!("bad-status-{s}"),
    }
}

/// Legacy CHS geometry (VIRTIO_BLK_F_GEOMETRY).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Geometry {
    /// Cylinders.
    pub cylinders: u16,
    /// Heads.
    pub heads: u8,
    /// Sectors per track.
    pub sectors: u8,
}

/// The virtio-blk config space. Fields guarded by a feature the device did
/// not offer hold whatever it sent (usually 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlkConfig {
    /// Capacity in 512-byte sectors.
    pub capacity: u64,
    /// Largest data segment in bytes (SIZE_MAX).
    pub size_max: u32,
    /// Most data segments per request (SEG_MAX).
    pub seg_max: u32,
    /// CHS geometry (GEOMETRY).
    pub geometry: Geometry,
    /// Logical block size in bytes (BLK_SIZE).
    pub blk_size: u32,
    /// log2(physical block / logical block) (TOPOLOGY).
    pub physical_block_exp: u8,
    /// Offset of the first aligned logical block (TOPOLOGY).
    pub alignment_offset: u8,
    /// Suggested minimum I/O size in logical blocks (TOPOLOGY).
    pub min_io_size: u16,
    /// Optimal I/O size in logical blocks (TOPOLOGY).
    pub opt_io_size: u32,
    /// Write-back cache on (CONFIG_WCE).
    pub writeback: u8,
    /// Request queues (MQ).
    pub num_queues: u16,
    /// Largest DISCARD range in sectors (DISCARD).
    pub max_discard_sectors: u32,
    /// Most DISCARD ranges per request (DISCARD).
    pub max_discard_seg: u32,
    /// DISCARD alignment in sectors (DISCARD).
    pub discard_sector_alignment: u32,
    /// Largest WRITE_ZEROES range in sectors (WRITE_ZEROES).
    pub max_write_zeroes_sectors: u32,
    /// Most WRITE_ZEROES ranges per request (WRITE_ZEROES).
    pub max_write_zeroes_seg: u32,
    /// WRITE_ZEROES may unmap (WRITE_ZEROES).
    pub write_zeroes_may_unmap: u8,
}

impl BlkConfig {
    /// Parses the little-endian config space; None if shorter than the 57
    /// bytes up to `write_zeroes_may_unmap`.
    pub fn parse(b: &[u8]) -> Option<BlkConfig> {
        if b.len() < 57 {
            return None;
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut cap = [0u8; 8];
        cap.copy_from_slice(&b[0..8]);
        Some(BlkConfig {
            capacity: u64::from_le_bytes(cap),
            size_max: u32_at(8),
            seg_max: u32_at(12),
            geometry: Geometry { cylinders: u16_at(16), heads: b[18], sectors: b[19] },
            blk_size: u32_at(20),
            physical_block_exp: b[24],
            alignment_offset: b[25],
            min_io_size: u16_at(26),
            opt_io_size: u32_at(28),
            writeback: b[32],
            num_queues: u16_at(34),
            max_discard_sectors: u32_at(36),
            max_discard_seg: u32_at(40),
            discard_sector_alignment: u32_at(44),
            max_write_zeroes_sectors: u32_at(48),
            max_write_zeroes_seg: u32_at(52),
            write_zeroes_may_unmap: b[56],
        })
    }

    /// Capacity in bytes (saturating).
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity.saturating_mul(SECTOR)
    }
}

/// A request header: {le32 type, le32 reserved (0), le64 sector}.
pub fn header(req_type: u32, sector: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&req_type.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    h
}

/// A DISCARD / WRITE_ZEROES range: {le64 sector, le32 num_sectors, le32 flags}.
pub fn range(sector: u64, sectors: u32, flags: u32) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[0..8].copy_from_slice(&sector.to_le_bytes());
    r[8..12].copy_from_slice(&sectors.to_le_bytes());
    r[12..16].copy_from_slice(&flags.to_le_bytes());
    r
}

/// One well-formed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlkOp {
    /// IN: read `len` bytes at `sector` into the slot's data area.
    Read {
        /// First sector.
        sector: u64,
        /// Bytes.
        len: u32,
    },
    /// OUT: write `len` bytes of the slot's data area at `sector`.
    Write {
        /// First sector.
        sector: u64,
        /// Bytes.
        len: u32,
    },
    /// FLUSH (no data).
    Flush,
    /// GET_ID: 20 device-writable bytes.
    GetId,
    /// DISCARD of one range.
    Discard {
        /// First sector.
        sector: u64,
        /// Sectors.
        sectors: u32,
        /// Range flags (`RANGE_F_UNMAP` is not allowed for DISCARD by the spec).
        flags: u32,
    },
    /// WRITE_ZEROES of one range.
    WriteZeroes {
        /// First sector.
        sector: u64,
        /// Sectors.
        sectors: u32,
        /// Range flags (`RANGE_F_UNMAP`).
        flags: u32,
    },
    /// Any type number, with `len` data bytes (device-writable if
    /// `writable`, none if `len` is 0): unknown types, GET_ID with another
    /// length, and so on.
    Other {
        /// The header's type.
        req_type: u32,
        /// The header's sector.
        sector: u64,
        /// Data bytes.
        len: u32,
        /// Data direction.
        writable: bool,
    },
}

/// Where a request's data goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Data {
    None,
    /// The slot's data area, device-readable.
    Out(u32),
    /// The slot's data area, device-writable.
    In(u32),
    /// The range in the control block, device-readable.
    Range,
}

impl BlkOp {
    /// (type, sector, data).
    fn parts(&self) -> (u32, u64, Data) {
        match *self {
            BlkOp::Read { sector, len } => (types::IN, sector, Data::In(len)),
            BlkOp::Write { sector, len } => (types::OUT, sector, Data::Out(len)),
            BlkOp::Flush => (types::FLUSH, 0, Data::None),
            BlkOp::GetId => (types::GET_ID, 0, Data::In(ID_LEN as u32)),
            BlkOp::Discard { .. } => (types::DISCARD, 0, Data::Range),
            BlkOp::WriteZeroes { .. } => (types::WRITE_ZEROES, 0, Data::Range),
            BlkOp::Other { req_type, sector, len: 0, .. } => (req_type, sector, Data::None),
            BlkOp::Other { req_type, sector, len, writable: true } => (req_type, sector, Data::In(len)),
            BlkOp::Other { req_type, sector, len, writable: false } => (req_type, sector, Data::Out(len)),
        }
    }

    /// The request type number.
    pub fn req_type(&self) -> u32 {
        self.parts().0
    }
}

/// One buffer of a raw chain.
#[derive(Clone, Copy, Debug)]
pub enum RawSeg<'a> {
    /// A device-readable buffer holding these bytes.
    Readable(&'a [u8]),
    /// A device-writable buffer of this many bytes (filled with 0xff first).
    Writable(u32),
}

/// A completed request, as `BlkQueue::poll` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlkCompletion {
    /// The caller's tag given at submission.
    pub user: u64,
    /// The request type (raw: as read from the first readable buffer, or
    /// `u32::MAX` when it held fewer than 4 bytes).
    pub req_type: u32,
    /// The header's sector (raw: 0).
    pub sector: u64,
    /// Data bytes of the request (raw: device-writable bytes).
    pub data_len: u32,
    /// Device-writable bytes in the chain (data + status).
    pub writable_len: u32,
    /// The status byte (raw: the last device-writable byte), or
    /// `STATUS_NOT_WRITTEN` when the device left it alone or there is none.
    pub status: u8,
    /// The used length the device reported.
    pub used_len: u32,
    /// From `submit` to the poll that found it.
    pub latency: Duration,
    /// Submitted with `submit_raw`.
    pub raw: bool,
}

impl BlkCompletion {
    /// The used length is possible: at most the writable bytes, and for a
    /// successful read exactly the data plus the status byte.
    pub fn len_ok(&self) -> bool {
        self.used_len <= self.writable_len
            && (self.raw
                || self.req_type != types::IN
                || self.status != status::OK
                || self.used_len == self.data_len + 1)
    }

    /// Status OK and a possible used length.
    pub fn ok(&self) -> bool {
        self.status == status::OK && self.len_ok()
    }

    /// What went wrong, if anything (for messages).
    pub fn problem(&self) -> Option<String> {
        if self.status != status::OK {
            return Some(format!("type {} sector {}: status {}", self.req_type, self.sector, status_name(self.status)));
        }
        if !self.len_ok() {
            return Some(format!(
                "type {} sector {}: used length {} (data {}, writable {})",
                self.req_type, self.sector, self.used_len, self.data_len, self.writable_len
            ));
        }
        None
    }
}

/// The result of a synchronous request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkReply {
    /// The status byte (`STATUS_NOT_WRITTEN` if the device did not write it).
    pub status: u8,
    /// The used length.
    pub used_len: u32,
    /// Device-writable data after completion (read data, the id; raw: every
    /// writable buffer, status included, in chain order).
    pub data: Vec<u8>,
    /// The whole completion.
    pub completion: BlkCompletion,
}

/// The shape of a slot's kept chain: requests of the same shape reuse its
/// descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Typed(Data),
    /// Raw chains are built afresh each time.
    Raw,
}

struct Slot {
    /// The kept chain (head / buffer id) and its shape.
    kept: Option<(u16, Shape)>,
    user: u64,
    req_type: u32,
    sector: u64,
    data_len: u32,
    writable_len: u32,
    /// Raw: offset of the writable bytes in the data area, or None for typed.
    raw_writable_at: Option<u32>,
    /// When the device could first see it (set by `flush`).
    submitted: Instant,
    /// Submission number (1, 2, ...), to see completions overtake others.
    seq: u64,
}

const CTRL_STRIDE: u64 = 64;
const CTRL_STATUS: u64 = 16;
const CTRL_RANGE: u64 = 32;

/// A virtio-blk request queue with `depth` request slots.
pub struct BlkQueue {
    /// The queue (public for raw ring access in tests).
    pub queue: VirtQueue,
    features: u64,
    depth: u16,
    max_data: u32,
    /// Largest data descriptor (size_max, or max_data).
    seg_size: u32,
    ctrl_gpa: u64,
    ctrl: *mut u8,
    data_gpa: u64,
    data: *mut u8,
    /// Bytes of data area per slot (max_data rounded up to 4 KiB).
    stride: u32,
    slots: Vec<Slot>,
    free: Vec<u16>,
    readable: Vec<Buf>,
    writable: Vec<Buf>,
    used: Vec<Used>,
    /// Slots submitted since the last `flush`: stamped there with one
    /// clock read (a clock read per request costs the frontend ~15 %).
    unflushed: Vec<u16>,
    seq: u64,
    max_done_seq: u64,
    reordered: u64,
}

// SAFETY: `ctrl` and `data` point into the guest memory that `queue.ring`
// keeps mapped (its DriverMemory holds the Arc); one thread owns the queue
// at a time.
unsafe impl Send for BlkQueue {}

/// Guest memory `queues` blk queues of `depth` slots of `max_data` bytes
/// need at most (rings of any size included), for `Options::mem_size`.
pub fn memory_needed(queues: u16, depth: u16, max_data: u32) -> u64 {
    let stride = (max_data.max(1) as u64).div_ceil(4096) * 4096;
    // A ring of 32768 entries takes under 1 MiB in either layout.
    queues as u64 * (depth as u64 * (stride + CTRL_STRIDE) + (1 << 20) + 8192) + (1 << 20)
}

impl VirtioUser {
    /// Sets up virtio-blk request queue `index` for up to `depth` requests
    /// in flight of up to `max_data` data bytes each, and starts it. The
    /// ring is the smallest power of two holding `depth` chains (data split
    /// at the device's size_max); `blk_queue_sized` picks it.
    pub fn blk_queue(&mut self, index: u16, depth: u16, max_data: u32) -> Result<BlkQueue, Error> {
        self.blk_queue_sized(index, depth, max_data, None)
    }

    /// `blk_queue` with a chosen ring size (it must hold `depth` chains).
    pub fn blk_queue_sized(
        &mut self,
        index: u16,
        depth: u16,
        max_data: u32,
        size: Option<u16>,
    ) -> Result<BlkQueue, Error> {
        if self.opts.device != DeviceType::Blk {
            return Err(Error::Config("not a blk connection (use Options::blk)".into()));
        }
        if index as u64 >= self.max_queues {
            return Err(Error::Unsupported(format!("request queue {index} (backend has {} queues)", self.max_queues)));
        }
        let cfg = self.blk_config.unwrap_or_default();
        let bq = BlkQueue::create_in(&mut self.mem, self.features, &cfg, index, depth, max_data, size)?;
        self.start_queue(&bq.queue)?;
        Ok(bq)
    }
}

impl BlkQueue {
    /// The request queue `index` of a blk device with `features`
    /// negotiated and config `cfg`, laid out in `mem` (ring, control
    /// blocks, data), as `VirtioUser::blk_queue_sized` describes; not
    /// started: that is the transport's part.
    pub(crate) fn create_in(
        mem: &mut FrontendMemory,
        features: u64,
        cfg: &BlkConfig,
        index: u16,
        depth: u16,
        max_data: u32,
        size: Option<u16>,
    ) -> Result<BlkQueue, Error> {
        if depth == 0 {
            return Err(Error::Config("queue depth must not be zero".into()));
        }
        let max_data = max_data.max(ID_LEN as u32);
        let f = features;
        let seg_size =
            if f & features::BLK_SIZE_MAX != 0 && cfg.size_max >= 512 { cfg.size_max.min(max_data) } else { max_data };
        let segs = max_data.div_ceil(seg_size);
        if f & features::BLK_SEG_MAX != 0 && cfg.seg_max != 0 && segs > cfg.seg_max {
            return Err(Error::Unsupported(format!(
                "requests of {max_data} bytes ({segs} segments of at most {seg_size}; seg_max {})",
                cfg.seg_max
            )));
        }
        let need = depth as u64 * (2 + segs as u64);
        let size = match size {
            Some(s) if (s as u64) < need => {
                return Err(Error::Config(format!(
                    "a ring of {s} entries cannot hold {depth} requests of {} descriptors",
                    2 + segs
                )))
            }
            Some(s) => s,
            None if need <= virtq::ring::MAX_QUEUE_SIZE as u64 => (need as u16).next_power_of_two(),
            None => {
                return Err(Error::Config(format!(
                    "{depth} requests of {} descriptors do not fit a ring of 32768",
                    2 + segs
                )))
            }
        };
        let stride = (max_data as u64).div_ceil(4096) * 4096;
        let ctrl_gpa = mem.alloc(depth as u64 * CTRL_STRIDE, 64)?;
        let data_gpa = mem.alloc(depth as u64 * stride, 4096)?;
        let queue = crate::create_queue_in(mem, f, index as usize, size, None)?;
        let mem = queue.ring.memory();
        let outside = || Error::Config("blk buffers outside guest memory".into());
        let ctrl = mem.host(ctrl_gpa, depth as u64 * CTRL_STRIDE).ok_or_else(outside)?;
        let data = mem.host(data_gpa, depth as u64 * stride).ok_or_else(outside)?;
        let now = Instant::now();
        let slots = (0..depth)
            .map(|_| Slot {
                kept: None,
                user: 0,
                req_type: 0,
                sector: 0,
                data_len: 0,
                writable_len: 0,
                raw_writable_at: None,
                submitted: now,
                seq: 0,
            })
            .collect();
        let bq = BlkQueue {
            queue,
            features: f,
            depth,
            max_data,
            seg_size,
            ctrl_gpa,
            ctrl,
            data_gpa,
            data,
            stride: stride as u32,
            slots,
            free: (0..depth).rev().collect(),
            readable: Vec::with_capacity(size as usize),
            writable: Vec::with_capacity(size as usize),
            used: vec![Used::default(); size as usize],
            unflushed: Vec::with_capacity(depth as usize),
            seq: 0,
            max_done_seq: 0,
            reordered: 0,
        };
        Ok(bq)
    }
}

impl BlkQueue {
    /// The negotiated features.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Most requests in flight.
    pub fn depth(&self) -> u16 {
        self.depth
    }

    /// Largest data length of a typed request.
    pub fn max_data(&self) -> u32 {
        self.max_data
    }

    /// Largest data descriptor (the device's size_max, if smaller than max_data).
    pub fn seg_size(&self) -> u32 {
        self.seg_size
    }

    /// Requests submitted and not yet completed.
    pub fn in_flight(&self) -> u16 {
        self.depth - self.free.len() as u16
    }

    /// Completions that came after a request submitted later had completed
    /// (the device completes out of order).
    pub fn reordered(&self) -> u64 {
        self.reordered
    }

    /// Slots free for `submit`.
    pub fn free_slots(&self) -> u16 {
        self.free.len() as u16
    }

    fn ctrl_ptr(&self, slot: u16, off: u64) -> *mut u8 {
        // SAFETY: slot < depth and off < CTRL_STRIDE: inside the control
        // area of depth * CTRL_STRIDE bytes (checked in `blk_queue_sized`).
        unsafe { self.ctrl.add((slot as u64 * CTRL_STRIDE + off) as usize) }
    }

    fn data_ptr(&self, slot: u16) -> *mut u8 {
        // SAFETY: slot < depth: inside the data area of depth * stride bytes
        // (checked in `blk_queue_sized`).
        unsafe { self.data.add(slot as usize * self.stride as usize) }
    }

    /// Queues one request in a free slot; `fill` gets the slot's data area
    /// of the request's data length first (write data; for reads it may
    /// poison the buffer). Visible to the device after `flush`. Ok(false)
    /// when every slot is in flight; `user` comes back in the completion.
    #[inline]
    pub fn submit(&mut self, op: BlkOp, user: u64, fill: impl FnOnce(&mut SharedBytesMut)) -> Result<bool, Error> {
        let (req_type, sector, data) = op.parts();
        let data_len = match data {
            Data::In(n) | Data::Out(n) => n,
            Data::None | Data::Range => 0,
        };
        if data_len > self.max_data {
            return Err(Error::Config(format!("{data_len} data bytes exceed the queue's {}", self.max_data)));
        }
        let Some(&slot) = self.free.last() else {
            return Ok(false);
        };
        let p = self.ctrl_ptr(slot, 0);
        // SAFETY: the slot's control block is ours (not in flight): header at
        // 0..16, status at 16, range at 32..48, all inside its 64 bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(header(req_type, sector).as_ptr(), p, HEADER_LEN);
            *p.add(CTRL_STATUS as usize) = STATUS_NOT_WRITTEN;
            if let BlkOp::Discard { sector, sectors, flags } | BlkOp::WriteZeroes { sector, sectors, flags } = op {
                std::ptr::copy_nonoverlapping(range(sector, sectors, flags).as_ptr(), p.add(CTRL_RANGE as usize), 16);
            }
        }
        // SAFETY: data_len <= max_data <= stride: the slot's own data area
        // in the frontend's memory, which outlives this call; nothing here
        // holds a reference to it.
        fill(&mut unsafe { SharedBytesMut::new(self.data_ptr(slot), data_len as usize) });
        let shape = Shape::Typed(data);
        let head = match self.slots[slot as usize].kept {
            Some((h, s)) if s == shape => h,
            kept => {
                if let Some((h, _)) = kept {
                    self.slots[slot as usize].kept = None;
                    self.queue.ring.free_kept(h)?;
                }
                let h = self.build_typed(slot, data)?;
                self.slots[slot as usize].kept = Some((h, shape));
                h
            }
        };
        self.queue.ring.repost(head)?;
        self.free.pop();
        let s = &mut self.slots[slot as usize];
        s.user = user;
        s.req_type = req_type;
        s.sector = sector;
        s.data_len = data_len;
        s.writable_len = 1 + if let Data::In(n) = data { n } else { 0 };
        s.raw_writable_at = None;
        self.unflushed.push(slot);
        self.seq += 1;
        s.seq = self.seq;
        Ok(true)
    }

    /// Writes the descriptors of a typed chain for `slot` (kept, not posted).
    fn build_typed(&mut self, slot: u16, data: Data) -> Result<u16, Error> {
        let ctrl = self.ctrl_gpa + slot as u64 * CTRL_STRIDE;
        let dgpa = self.data_gpa + slot as u64 * self.stride as u64;
        let (seg, mut r, mut w) =
            (self.seg_size, std::mem::take(&mut self.readable), std::mem::take(&mut self.writable));
        r.clear();
        w.clear();
        r.push(Buf { addr: ctrl, len: HEADER_LEN as u32 });
        let split = |v: &mut Vec<Buf>, len: u32| {
            let mut off = 0;
            while off < len {
                let n = seg.min(len - off);
                v.push(Buf { addr: dgpa + off as u64, len: n });
                off += n;
            }
        };
        match data {
            Data::None => {}
            Data::Out(n) => split(&mut r, n),
            Data::In(n) => split(&mut w, n),
            Data::Range => r.push(Buf { addr: ctrl + CTRL_RANGE, len: 16 }),
        }
        w.push(Buf { addr: ctrl + CTRL_STATUS, len: 1 });
        let res = self.queue.ring.prepare(&r, &w, slot as u64);
        self.readable = r;
        self.writable = w;
        Ok(res?)
    }

    /// Queues a raw chain in a free slot: `segs` in order (readable ones
    /// first: the driver side lays out chains that way), their bytes
    /// placed one after another in the slot's data area (at most 4 KiB-
    /// rounded `max_data` in all). Readable buffers hold the given bytes,
    /// writable ones 0xff. No header or status byte is added: this is for
    /// malformed requests. Ok(false) when every slot is in flight.
    pub fn submit_raw(&mut self, segs: &[RawSeg], user: u64) -> Result<bool, Error> {
        let mut total = 0u64;
        let mut seen_writable = false;
        for s in segs {
            match s {
                RawSeg::Readable(_) if seen_writable => {
                    return Err(Error::Config("raw chains put readable buffers before writable ones".into()));
                }
                RawSeg::Readable(b) => total += b.len() as u64,
                RawSeg::Writable(n) => {
                    seen_writable = true;
                    total += *n as u64;
                }
            }
        }
        if segs.is_empty() || total > self.stride as u64 {
            return Err(Error::Config(format!(
                "a raw chain of {} buffers and {total} bytes (at most {} bytes)",
                segs.len(),
                self.stride
            )));
        }
        let Some(&slot) = self.free.last() else {
            return Ok(false);
        };
        if let Some((h, _)) = self.slots[slot as usize].kept.take() {
            self.queue.ring.free_kept(h)?;
        }
        let dgpa = self.data_gpa + slot as u64 * self.stride as u64;
        let base = self.data_ptr(slot);
        let (mut r, mut w) = (std::mem::take(&mut self.readable), std::mem::take(&mut self.writable));
        r.clear();
        w.clear();
        let mut off = 0u32;
        let mut writable_at = None;
        let mut req_type = u32::MAX;
        for s in segs {
            match *s {
                RawSeg::Readable(b) => {
                    if off == 0 && b.len() >= 4 {
                        req_type = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                    // SAFETY: off + len <= total <= stride: inside the
                    // slot's data area, which is not in flight.
                    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), base.add(off as usize), b.len()) };
                    r.push(Buf { addr: dgpa + off as u64, len: b.len() as u32 });
                    off += b.len() as u32;
                }
                RawSeg::Writable(n) => {
                    writable_at.get_or_insert(off);
                    // SAFETY: as above.
                    unsafe { std::ptr::write_bytes(base.add(off as usize), STATUS_NOT_WRITTEN, n as usize) };
                    w.push(Buf { addr: dgpa + off as u64, len: n });
                    off += n;
                }
            }
        }
        let res = self.queue.ring.prepare(&r, &w, slot as u64);
        self.readable = r;
        self.writable = w;
        let head = res?;
        if let Err(e) = self.queue.ring.repost(head) {
            let _ = self.queue.ring.free_kept(head);
            return Err(e.into());
        }
        self.free.pop();
        let s = &mut self.slots[slot as usize];
        s.kept = Some((head, Shape::Raw));
        s.user = user;
        s.req_type = req_type;
        s.sector = 0;
        s.writable_len = off - writable_at.unwrap_or(off);
        s.data_len = s.writable_len;
        s.raw_writable_at = Some(writable_at.unwrap_or(off));
        self.unflushed.push(slot);
        self.seq += 1;
        s.seq = self.seq;
        Ok(true)
    }

    /// Publishes what was submitted and kicks if the device wants it.
    #[inline]
    pub fn flush(&mut self) -> Result<bool, Error> {
        if !self.unflushed.is_empty() {
            let now = Instant::now();
            for slot in self.unflushed.drain(..) {
                self.slots[slot as usize].submitted = now;
            }
        }
        self.queue.publish_and_kick()
    }

    /// Takes every completion the device has made (in whatever order it
    /// made them), calling `f` with each and its device-writable data (read
    /// data, the id; raw: the writable buffers), then frees the slots.
    /// Returns how many completed. A device that breaks the ring is an error.
    #[inline]
    pub fn poll(&mut self, mut f: impl FnMut(&BlkCompletion, SharedBytes)) -> Result<usize, Error> {
        let mut out = std::mem::take(&mut self.used);
        let r = self.queue.ring.pop_used_batch(&mut out, true);
        let n = *r.as_ref().unwrap_or(&0);
        let now = if n > 0 { Some(Instant::now()) } else { None };
        for u in &out[..n] {
            // The token is the slot we gave the chain: private, trusted.
            let slot = u.token as u16;
            let s = &self.slots[slot as usize];
            if s.seq < self.max_done_seq {
                self.reordered += 1;
            }
            self.max_done_seq = self.max_done_seq.max(s.seq);
            let (data_off, status_at) = match s.raw_writable_at {
                Some(at) if s.writable_len > 0 => (at, Some(at + s.writable_len - 1)),
                Some(at) => (at, None),
                None => (0, None),
            };
            let c = BlkCompletion {
                user: s.user,
                req_type: s.req_type,
                sector: s.sector,
                data_len: s.data_len,
                writable_len: s.writable_len,
                status: STATUS_NOT_WRITTEN,
                used_len: u.len,
                latency: now.map(|t| t.saturating_duration_since(s.submitted)).unwrap_or_default(),
                raw: s.raw_writable_at.is_some(),
            };
            let base = self.data_ptr(slot);
            // SAFETY: the status byte lies in the slot's control block, or
            // for raw chains inside its data area (at < stride).
            let status = unsafe {
                match (c.raw, status_at) {
                    (false, _) => std::ptr::read_volatile(self.ctrl_ptr(slot, CTRL_STATUS)),
                    (true, Some(at)) => std::ptr::read_volatile(base.add(at as usize)),
                    (true, None) => STATUS_NOT_WRITTEN,
                }
            };
            // SAFETY: data_off + data_len <= stride: the slot's data area,
            // in the frontend's memory, which outlives the call.
            let data = unsafe { SharedBytes::new(base.add(data_off as usize), c.data_len as usize) };
            f(&BlkCompletion { status, ..c }, data);
            self.free.push(slot);
        }
        self.used = out;
        r?;
        Ok(n)
    }

    /// Asks for a call and waits up to `timeout` for one (returns at once
    /// if completions are already there). Poll afterwards. Returns whether
    /// something may have completed.
    pub fn wait(&mut self, timeout: Duration) -> Result<bool, Error> {
        if self.queue.ring.enable_notifications() {
            return Ok(true);
        }
        self.queue.wait_call(timeout)
    }

    /// Runs one request synchronously (nothing else may be in flight):
    /// `write_data` goes at the start of the data area (the rest zeroed);
    /// waits up to `timeout`. On a timeout the slot stays in flight.
    pub fn request(&mut self, op: BlkOp, write_data: &[u8], timeout: Duration) -> Result<BlkReply, Error> {
        self.sync(timeout, |q| {
            q.submit(op, 0, |buf| {
                let n = write_data.len().min(buf.len());
                buf.fill(0);
                buf.write_at(0, &write_data[..n]);
            })
        })
    }

    /// `request` with no data, 10 seconds at most: (status, used length).
    pub fn run_one(&mut self, op: BlkOp) -> Result<(u8, u32), Error> {
        let r = self.request(op, &[], Duration::from_secs(10))?;
        Ok((r.status, r.used_len))
    }

    /// Runs one raw chain synchronously (see `submit_raw`); the reply's
    /// status is the last writable byte.
    pub fn request_raw(&mut self, segs: &[RawSeg], timeout: Duration) -> Result<BlkReply, Error> {
        self.sync(timeout, |q| q.submit_raw(segs, 0))
    }

    fn sync(
        &mut self,
        timeout: Duration,
        submit: impl FnOnce(&mut BlkQueue) -> Result<bool, Error>,
    ) -> Result<BlkReply, Error> {
        if self.in_flight() != 0 {
            return Err(Error::Config(format!(
                "{} requests in flight: synchronous requests need an idle queue",
                self.in_flight()
            )));
        }
        if !submit(self)? {
            return Err(Error::Config("no free slot".into()));
        }
        self.flush()?;
        let deadline = Instant::now() + timeout;
        let mut reply = None;
        loop {
            self.poll(|c, data| {
                reply = Some(BlkReply { status: c.status, used_len: c.used_len, data: data.to_vec(), completion: *c })
            })?;
            if let Some(r) = reply {
                return Ok(r);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(format!("no completion on queue {} in {timeout:?}", self.queue.index())));
            }
            // Short waits: a lost call costs a little time, never the request.
            self.wait((deadline - now).min(Duration::from_millis(20)))?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_every_field() {
        let mut b = [0u8; CONFIG_LEN];
        b[0..8].copy_from_slice(&2048u64.to_le_bytes());
        b[8..12].copy_from_slice(&65536u32.to_le_bytes());
        b[12..16].copy_from_slice(&126u32.to_le_bytes());
        b[16..18].copy_from_slice(&100u16.to_le_bytes());
        b[18] = 16;
        b[19] = 63;
        b[20..24].copy_from_slice(&4096u32.to_le_bytes());
        b[24] = 3;
        b[25] = 1;
        b[26..28].copy_from_slice(&8u16.to_le_bytes());
        b[28..32].copy_from_slice(&64u32.to_le_bytes());
        b[32] = 1;
        b[34..36].copy_from_slice(&4u16.to_le_bytes());
        for (i, o) in [36, 40, 44, 48, 52].iter().enumerate() {
            b[*o..*o + 4].copy_from_slice(&(10 + i as u32).to_le_bytes());
        }
        b[56] = 1;
        let c = BlkConfig::parse(&b).unwrap();
        assert_eq!(c.capacity, 2048);
        assert_eq!(c.capacity_bytes(), 2048 * 512);
        assert_eq!((c.size_max, c.seg_max), (65536, 126));
        assert_eq!(c.geometry, Geometry { cylinders: 100, heads: 16, sectors: 63 });
        assert_eq!(c.blk_size, 4096);
        assert_eq!((c.physical_block_exp, c.alignment_offset, c.min_io_size, c.opt_io_size), (3, 1, 8, 64));
        assert_eq!((c.writeback, c.num_queues), (1, 4));
        assert_eq!((c.max_discard_sectors, c.max_discard_seg, c.discard_sector_alignment), (10, 11, 12));
        assert_eq!((c.max_write_zeroes_sectors, c.max_write_zeroes_seg, c.write_zeroes_may_unmap), (13, 14, 1));
        assert!(BlkConfig::parse(&b[..56]).is_none());
    }

    #[test]
    fn header_and_range_layout() {
        assert_eq!(header(types::OUT, 0x0102), [1, 0, 0, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(range(3, 8, RANGE_F_UNMAP), [3, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 1, 0, 0, 0]);
    }

    #[test]
    fn completion_checks_read_length() {
        let c = BlkCompletion {
            user: 0,
            req_type: types::IN,
            sector: 0,
            data_len: 4096,
            writable_len: 4097,
            status: status::OK,
            used_len: 4097,
            latency: Duration::ZERO,
            raw: false,
        };
        assert!(c.ok());
        assert!(!BlkCompletion { used_len: 1, ..c }.ok());
        assert!(!BlkCompletion { used_len: 4098, ..c }.ok());
        assert!(BlkCompletion { status: status::IOERR, used_len: 1, ..c }.len_ok());
        assert!(!BlkCompletion { status: STATUS_NOT_WRITTEN, ..c }.ok());
        assert!(BlkCompletion { req_type: types::GET_ID, data_len: 20, writable_len: 21, used_len: 1, ..c }.ok());
    }
}
