//! virtio-scsi (virtio 1.2, section 5.6) over vhost-user: the config space,
//! request queues with a bounded number of commands in flight, typed
//! commands (CDBs built here) and raw (hostile) chains, the control queue
//! (task management, asynchronous notification) and the event queue, and
//! the workload engine's adapter (`workload`) for the CLI and tests.
//!
//! Virtqueue 0 is the control queue, 1 the event queue, 2.. the request
//! queues (`scsi_queue(n, ..)` is virtqueue 2 + n). A command is one chain:
//! the device-readable 51-byte request header (LUN, tag, CDB) and any
//! data-out, then the device-writable 108-byte response header (sense
//! length, residual, status, response, sense) and any data-in. The wire
//! format is the device's own (`vhostd_scsi::wire`, re-exported here).
//!
//! Each request queue has `depth` slots; a slot owns a 256-byte control
//! block (request header at 0, response header at 52) and a page-aligned
//! data area in guest memory for its whole life, and keeps its chain's
//! descriptors between commands of the same shape (`DriverRing::prepare` +
//! `repost`), so the steady state writes no descriptors and allocates
//! nothing. Commands complete in any order: each used entry carries its
//! slot back as the chain's token.
//!
//! A queue made with `scsi_queue_indirect` puts each typed command's
//! descriptors in an indirect table (VIRTIO_RING_F_INDIRECT_DESC) behind
//! one ring entry, as Linux's virtio_scsi does when its ring is short: the
//! ring needs `depth` entries instead of `3 * depth`. The slot keeps that
//! one-entry chain and its table as it keeps a direct chain.

pub mod workload;

use crate::blk::RawSeg;
use crate::queue::VirtQueue;
use crate::{features, DeviceType, Error, VirtioUser};
use std::time::{Duration, Instant};
use virtq_driver::{Buf, SharedBytes, SharedBytesMut, Used};

// The wire format is the device's (one definition for both sides).
pub use vhostd_scsi::sense::{key, Sense};
pub use vhostd_scsi::wire::{
    command_lun, ctrl, event, lun_field, response, tmf, CmdReq, CmdResp, Config as ScsiConfig, CtrlReq, AN_REQ_LEN,
    AN_RESP_LEN, CDB_SIZE, CONFIG_LEN, REQ_LEN, RESP_LEN, SENSE_SIZE, TMF_REQ_LEN, TMF_RESP_LEN,
};
pub use vhostd_scsi::{op, status};

/// The response byte before the device writes it (not a valid response).
pub const RESPONSE_NOT_WRITTEN: u8 = 0xff;
/// An event's length on the event queue.
pub const EVENT_LEN: usize = 16;
/// SCSI status TASK SET FULL (the initiator retries).
pub const TASK_SET_FULL: u8 = 0x28;
/// Descriptors a typed command takes at most: the request header, the
/// response header and one data buffer (a direct chain's ring entries, an
/// indirect one's table entries).
pub const DESCS_PER_CMD: u16 = 3;

/// A response byte as a word (for messages).
pub fn response_name(r: u8) -> String {
    match r {
        response::OK => "ok".into(),
        response::OVERRUN => "overrun".into(),
        response::ABORTED => "aborted".into(),
        response::BAD_TARGET => "bad-target".into(),
        response::RESET => "reset".into(),
        response::BUSY => "busy".into(),
        response::TRANSPORT_FAILURE => "transport-failure".into(),
        response::TARGET_FAILURE => "target-failure".into(),
        response::NEXUS_FAILURE => "nexus-failure".into(),
        response::FAILURE => "failure".into(),
        response::FUNCTION_SUCCEEDED => "function-succeeded".into(),
        response::FUNCTION_REJECTED => "function-rejected".into(),
        response::INCORRECT_LUN => "incorrect-lun".into(),
        RESPONSE_NOT_WRITTEN => "unwritten".into(),
        r => format!("bad-response-{r}"),
    }
}

/// A SCSI status as a word (for messages).
pub fn status_name(s: u8) -> String {
    match s {
        status::GOOD => "good".into(),
        status::CHECK_CONDITION => "check-condition".into(),
        TASK_SET_FULL => "task-set-full".into(),
        s => format!("status-{s:#04x}"),
    }
}

/// Sense data in either format (fixed: response code 0x70/0x71;
/// descriptor: 0x72/0x73): its key, ASC and ASCQ. None for anything else
/// or too few bytes.
pub fn parse_sense(b: &[u8]) -> Option<Sense> {
    match b.first()? & 0x7f {
        0x70 | 0x71 if b.len() >= 14 => Some(Sense::new(b[2] & 0x0f, b[12], b[13])),
        0x72 | 0x73 if b.len() >= 4 => Some(Sense::new(b[1] & 0x0f, b[2], b[3])),
        _ => None,
    }
}

/// Where a command's data goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Data {
    /// No data buffer.
    None,
    /// A device-writable data-in buffer of this many bytes.
    In(u32),
    /// A device-readable data-out buffer of this many bytes.
    Out(u32),
}

impl Data {
    /// Bytes of the buffer.
    pub fn len(&self) -> u32 {
        match *self {
            Data::None => 0,
            Data::In(n) | Data::Out(n) => n,
        }
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Data-in bytes.
    pub fn data_in(&self) -> u32 {
        if let Data::In(n) = *self {
            n
        } else {
            0
        }
    }
}

/// One command: its CDB (the rest of the 32-byte field zero) and its data
/// buffer. Built by the constructors below; `with_data` gives the same CDB
/// another buffer (longer: a residual; shorter: an overrun).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cmd {
    /// The CDB field of the request header.
    pub cdb: [u8; CDB_SIZE],
    /// The data buffer.
    pub data: Data,
}

impl Cmd {
    /// Any CDB (cut to 32 bytes) with `data`.
    pub fn raw(cdb: &[u8], data: Data) -> Cmd {
        let mut c = [0u8; CDB_SIZE];
        let n = cdb.len().min(CDB_SIZE);
        c[..n].copy_from_slice(&cdb[..n]);
        Cmd { cdb: c, data }
    }

    /// The same CDB with another data buffer.
    pub fn with_data(self, data: Data) -> Cmd {
        Cmd { data, ..self }
    }

    /// Sets FUA (byte 1, bit 3) of a READ/WRITE(10/16).
    pub fn fua(mut self) -> Cmd {
        self.cdb[1] |= 0x08;
        self
    }

    /// The operation code.
    pub fn opcode(&self) -> u8 {
        self.cdb[0]
    }

    /// TEST UNIT READY.
    pub fn test_unit_ready() -> Cmd {
        Cmd::raw(&[op::TEST_UNIT_READY, 0, 0, 0, 0, 0], Data::None)
    }

    /// REQUEST SENSE, fixed or (`desc`) descriptor format, `alloc` bytes.
    pub fn request_sense(desc: bool, alloc: u8) -> Cmd {
        Cmd::raw(&[op::REQUEST_SENSE, desc as u8, 0, 0, alloc, 0], Data::In(alloc as u32))
    }

    /// INQUIRY: standard data (`None`) or vital product data page `page`
    /// (EVPD), `alloc` bytes.
    pub fn inquiry(page: Option<u8>, alloc: u16) -> Cmd {
        let a = alloc.to_be_bytes();
        Cmd::raw(&[op::INQUIRY, page.is_some() as u8, page.unwrap_or(0), a[0], a[1], 0], Data::In(alloc as u32))
    }

    /// MODE SENSE(6): page control `pc` (0 current, 1 changeable, 2
    /// default, 3 saved), `page`/`subpage`, block descriptors unless `dbd`.
    pub fn mode_sense_6(dbd: bool, pc: u8, page: u8, subpage: u8, alloc: u8) -> Cmd {
        let b2 = (pc << 6) | (page & 0x3f);
        Cmd::raw(&[op::MODE_SENSE_6, (dbd as u8) << 3, b2, subpage, alloc, 0], Data::In(alloc as u32))
    }

    /// MODE SENSE(10), as `mode_sense_6`.
    pub fn mode_sense_10(dbd: bool, pc: u8, page: u8, subpage: u8, alloc: u16) -> Cmd {
        let (b2, a) = ((pc << 6) | (page & 0x3f), alloc.to_be_bytes());
        Cmd::raw(&[op::MODE_SENSE_10, (dbd as u8) << 3, b2, subpage, 0, 0, 0, a[0], a[1], 0], Data::In(alloc as u32))
    }

    /// READ CAPACITY(10): 8 bytes of data-in.
    pub fn read_capacity_10() -> Cmd {
        Cmd::raw(&[op::READ_CAPACITY_10, 0, 0, 0, 0, 0, 0, 0, 0, 0], Data::In(8))
    }

    /// READ CAPACITY(16) (SERVICE ACTION IN(16), action 0x10), `alloc` bytes.
    pub fn read_capacity_16(alloc: u32) -> Cmd {
        let mut c = [0u8; 16];
        c[0] = op::SERVICE_ACTION_IN_16;
        c[1] = op::SA_READ_CAPACITY_16 as u8;
        c[10..14].copy_from_slice(&alloc.to_be_bytes());
        Cmd::raw(&c, Data::In(alloc))
    }

    fn rw10(opcode: u8, lba: u32, blocks: u16, data: Data) -> Cmd {
        let mut c = [0u8; 10];
        c[0] = opcode;
        c[2..6].copy_from_slice(&lba.to_be_bytes());
        c[7..9].copy_from_slice(&blocks.to_be_bytes());
        Cmd::raw(&c, data)
    }

    fn rw16(opcode: u8, lba: u64, blocks: u32, data: Data) -> Cmd {
        let mut c = [0u8; 16];
        c[0] = opcode;
        c[2..10].copy_from_slice(&lba.to_be_bytes());
        c[10..14].copy_from_slice(&blocks.to_be_bytes());
        Cmd::raw(&c, data)
    }

    /// READ(10) of `blocks` blocks of `block_size` bytes from `lba`.
    pub fn read_10(lba: u32, blocks: u16, block_size: u32) -> Cmd {
        Cmd::rw10(op::READ_10, lba, blocks, Data::In(blocks as u32 * block_size))
    }

    /// READ(16), as `read_10`.
    pub fn read_16(lba: u64, blocks: u32, block_size: u32) -> Cmd {
        Cmd::rw16(op::READ_16, lba, blocks, Data::In(blocks.saturating_mul(block_size)))
    }

    /// WRITE(10) of `blocks` blocks of `block_size` bytes at `lba`.
    pub fn write_10(lba: u32, blocks: u16, block_size: u32) -> Cmd {
        Cmd::rw10(op::WRITE_10, lba, blocks, Data::Out(blocks as u32 * block_size))
    }

    /// WRITE(16), as `write_10`.
    pub fn write_16(lba: u64, blocks: u32, block_size: u32) -> Cmd {
        Cmd::rw16(op::WRITE_16, lba, blocks, Data::Out(blocks.saturating_mul(block_size)))
    }

    /// VERIFY(10) of `blocks` from `lba` (BYTCHK 0: no data).
    pub fn verify_10(lba: u32, blocks: u16) -> Cmd {
        Cmd::rw10(op::VERIFY_10, lba, blocks, Data::None)
    }

    /// VERIFY(16), as `verify_10`.
    pub fn verify_16(lba: u64, blocks: u32) -> Cmd {
        Cmd::rw16(op::VERIFY_16, lba, blocks, Data::None)
    }

    /// SYNCHRONIZE CACHE(10) of `blocks` from `lba` (0 blocks: to the end).
    pub fn synchronize_cache_10(lba: u32, blocks: u16) -> Cmd {
        Cmd::rw10(op::SYNCHRONIZE_CACHE_10, lba, blocks, Data::None)
    }

    /// SYNCHRONIZE CACHE(16), as `synchronize_cache_10`.
    pub fn synchronize_cache_16(lba: u64, blocks: u32) -> Cmd {
        Cmd::rw16(op::SYNCHRONIZE_CACHE_16, lba, blocks, Data::None)
    }

    /// UNMAP with a parameter list of `param_len` bytes (data-out: the
    /// bytes of `unmap_parameters`).
    pub fn unmap(param_len: u16) -> Cmd {
        let l = param_len.to_be_bytes();
        Cmd::raw(&[op::UNMAP, 0, 0, 0, 0, 0, 0, l[0], l[1], 0], Data::Out(param_len as u32))
    }

    /// WRITE SAME(16) of `blocks` from `lba`, with UNMAP (`unmap`); the
    /// data-out is one block of `block_size` bytes, or none with NDOB
    /// (`ndob`: no data-out buffer, zeros).
    pub fn write_same_16(lba: u64, blocks: u32, unmap: bool, ndob: bool, block_size: u32) -> Cmd {
        let data = if ndob { Data::None } else { Data::Out(block_size) };
        let mut c = Cmd::rw16(op::WRITE_SAME_16, lba, blocks, data);
        c.cdb[1] = ((unmap as u8) << 3) | ndob as u8;
        c
    }

    /// REPORT LUNS with SELECT REPORT `select`, `alloc` bytes.
    pub fn report_luns(select: u8, alloc: u32) -> Cmd {
        let mut c = [0u8; 12];
        c[0] = op::REPORT_LUNS;
        c[2] = select;
        c[6..10].copy_from_slice(&alloc.to_be_bytes());
        Cmd::raw(&c, Data::In(alloc))
    }

    /// REPORT SUPPORTED OPERATION CODES (MAINTENANCE IN, action 0x0c):
    /// reporting options `options` (0 all, 1 one opcode, 2 one opcode and
    /// service action, 3 either), the requested opcode and action.
    pub fn report_supported_opcodes(options: u8, opcode: u8, action: u16, alloc: u32) -> Cmd {
        let mut c = [0u8; 12];
        c[0] = op::MAINTENANCE_IN;
        c[1] = op::SA_REPORT_SUPPORTED_OPCODES as u8;
        c[2] = options;
        c[3] = opcode;
        c[4..6].copy_from_slice(&action.to_be_bytes());
        c[6..10].copy_from_slice(&alloc.to_be_bytes());
        Cmd::raw(&c, Data::In(alloc))
    }
}

/// UNMAP's parameter list (SBC-3 5.28.2) for these (lba, blocks) ranges.
pub fn unmap_parameters(ranges: &[(u64, u32)]) -> Vec<u8> {
    let descs = 16 * ranges.len();
    let mut v = Vec::with_capacity(8 + descs);
    v.extend_from_slice(&((6 + descs) as u16).to_be_bytes());
    v.extend_from_slice(&(descs as u16).to_be_bytes());
    v.extend_from_slice(&[0; 4]);
    for &(lba, blocks) in ranges {
        v.extend_from_slice(&lba.to_be_bytes());
        v.extend_from_slice(&blocks.to_be_bytes());
        v.extend_from_slice(&[0; 4]);
    }
    v
}

/// A command's response header but its sense bytes: the 12 bytes the
/// device writes for every command (`CmdResp` without `sense`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RespHeader {
    /// Bytes of sense data the device says it wrote.
    pub sense_len: u32,
    /// Bytes of the data buffers not transferred.
    pub residual: u32,
    /// The status qualifier (SAM-5), from the device as it is.
    pub status_qualifier: u16,
    /// The SCSI status (GOOD, CHECK CONDITION...).
    pub status: u8,
    /// The transport's verdict (`response::*`).
    pub response: u8,
}

impl RespHeader {
    /// The fixed part of `r` (the unit tests' completions; the device's
    /// are read from the ring as they are).
    #[cfg(test)]
    fn of(r: &CmdResp) -> RespHeader {
        RespHeader {
            sense_len: r.sense_len,
            residual: r.residual,
            status_qualifier: r.status_qualifier,
            status: r.status,
            response: r.response,
        }
    }
}

/// A completed command, as `ScsiQueue::poll` reports it.
///
/// The sense bytes are copied out of the response only when the device
/// says there are some (`sense_len` > 0), so a good command's completion
/// stays small: no 96-byte array to zero and move per command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScsiCompletion {
    /// The caller's tag given at submission.
    pub user: u64,
    /// The command's tag in the request header (raw: 0).
    pub id: u64,
    /// The LUN field of the request header (raw: zeros).
    pub lun: [u8; 8],
    /// The operation code (raw: the first CDB byte, if the first readable
    /// buffer held it, else 0xff).
    pub opcode: u8,
    /// The data buffer (raw: the writable bytes after the response header).
    pub data: Data,
    /// Device-writable bytes in the chain (response header + data-in).
    pub writable_len: u32,
    /// The used length the device reported.
    pub used_len: u32,
    /// The response header but its sense bytes (`response` is
    /// `RESPONSE_NOT_WRITTEN` when the device left it alone, or the chain
    /// had no room for it); see `sense_bytes` and `cmd_resp`.
    pub resp: RespHeader,
    /// The sense bytes (`sense_len` of them, at most SENSE_SIZE); None
    /// when `sense_len` is 0.
    sense: Option<Box<[u8]>>,
    /// From `submit` to the poll that found it.
    pub latency: Duration,
    /// Submitted with `submit_raw`.
    pub raw: bool,
}

impl ScsiCompletion {
    /// The sense data of the response, parsed (None without sense data).
    pub fn sense(&self) -> Option<Sense> {
        parse_sense(self.sense_bytes())
    }

    /// The sense bytes the response carries.
    pub fn sense_bytes(&self) -> &[u8] {
        self.sense.as_deref().unwrap_or(&[])
    }

    /// The whole response header, sense bytes included (the rest of the
    /// sense field zero).
    pub fn cmd_resp(&self) -> CmdResp {
        let h = &self.resp;
        let mut r = CmdResp::new(h.response, h.status, h.residual, self.sense_bytes());
        r.sense_len = h.sense_len;
        r.status_qualifier = h.status_qualifier;
        r
    }

    /// The same completion with response header `r`.
    #[cfg(test)]
    fn with_resp(self, r: &CmdResp) -> ScsiCompletion {
        let n = (r.sense_len as usize).min(SENSE_SIZE);
        ScsiCompletion { resp: RespHeader::of(r), sense: (n > 0).then(|| r.sense[..n].into()), ..self }
    }

    /// Data-in bytes the device says it transferred (buffer - residual).
    #[inline]
    pub fn transferred_in(&self) -> u32 {
        self.facts().transferred_in()
    }

    /// The used length is possible: at most the writable bytes, and for a
    /// typed command that the device answered OK exactly the response
    /// header plus the data-in it transferred.
    #[inline]
    pub fn len_ok(&self) -> bool {
        self.facts().len_ok()
    }

    /// Response OK, status GOOD and a possible used length.
    #[inline]
    pub fn ok(&self) -> bool {
        self.resp.response == response::OK && self.resp.status == status::GOOD && self.len_ok()
    }

    /// What went wrong, if anything (for messages).
    #[inline]
    pub fn problem(&self) -> Option<String> {
        // The usual case, asked per command in the workloads: inline, and
        // nothing to format.
        if self.ok() {
            return None;
        }
        // The message is built from copies of the fields: a reference to
        // the completion here would keep the whole struct in memory (every
        // field stored) in the workloads' per-command path.
        describe_problem(self.facts(), self.sense_bytes())
    }

    #[inline(always)]
    fn facts(&self) -> Facts {
        Facts {
            opcode: self.opcode,
            id: self.id,
            data: self.data,
            writable_len: self.writable_len,
            used_len: self.used_len,
            resp: self.resp,
            raw: self.raw,
        }
    }
}

/// What `describe_problem` looks at, by value.
#[derive(Clone, Copy)]
struct Facts {
    opcode: u8,
    id: u64,
    data: Data,
    writable_len: u32,
    used_len: u32,
    resp: RespHeader,
    raw: bool,
}

impl Facts {
    /// `ScsiCompletion::transferred_in`.
    #[inline(always)]
    fn transferred_in(&self) -> u32 {
        self.data.data_in().saturating_sub(self.resp.residual)
    }

    /// `ScsiCompletion::len_ok`.
    #[inline(always)]
    fn len_ok(&self) -> bool {
        self.used_len <= self.writable_len
            && (self.raw
                || self.resp.response != response::OK
                || self.used_len == RESP_LEN as u32 + self.transferred_in())
    }
}

#[cold]
#[inline(never)]
fn describe_problem(c: Facts, sense: &[u8]) -> Option<String> {
    let what = format!("command {:#04x} (tag {})", c.opcode, c.id);
    if c.resp.response != response::OK {
        return Some(format!("{what}: response {}", response_name(c.resp.response)));
    }
    if c.resp.status != status::GOOD {
        let sense = match parse_sense(sense) {
            Some(s) => format!(", sense {:#x}/{:#04x}/{:#04x}", s.key, s.asc, s.ascq),
            None => String::new(),
        };
        return Some(format!("{what}: status {}{sense}", status_name(c.resp.status)));
    }
    if !c.len_ok() {
        return Some(format!(
            "{what}: used length {} (data {:?}, residual {}, writable {})",
            c.used_len, c.data, c.resp.residual, c.writable_len
        ));
    }
    None
}

/// The result of a synchronous command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScsiReply {
    /// The whole completion.
    pub completion: ScsiCompletion,
    /// The response header (as in the completion).
    pub resp: CmdResp,
    /// The data buffer after completion (data-in: what the device wrote,
    /// the buffer's whole length; raw: every writable buffer, the response
    /// header included, in chain order).
    pub data: Vec<u8>,
}

impl ScsiReply {
    /// The data-in bytes the device transferred (the buffer less the residual).
    pub fn data_in(&self) -> &[u8] {
        let n = (self.completion.transferred_in() as usize).min(self.data.len());
        &self.data[..n]
    }

    /// The parsed sense, if any.
    pub fn sense(&self) -> Option<Sense> {
        self.completion.sense()
    }
}

/// The shape of a slot's kept chain: commands of the same shape reuse its
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
    id: u64,
    lun: [u8; 8],
    opcode: u8,
    data: Data,
    writable_len: u32,
    /// Raw: offset of the writable bytes in the data area; None for typed.
    raw_writable_at: Option<u32>,
    /// When the device could first see it (set by `flush`), in
    /// nanoseconds after the queue's `epoch`.
    submitted: u64,
    /// Submission number (1, 2, ...), to see completions overtake others.
    seq: u64,
}

/// A command slot's control block: the request header at 0..51, the
/// response header right after it at 52..160, as Linux's virtio_scsi lays
/// out its `virtio_scsi_cmd`: the response's first 12 bytes (all the
/// device writes unless there is sense data) share the request header's
/// cache line, so a command moves one line between the CPUs each way, as
/// a blk request's header and status byte do.
const CTRL_STRIDE: u64 = 256;
const CTRL_RESP: u64 = 52;

/// A virtio-scsi request queue with `depth` command slots.
pub struct ScsiQueue {
    /// The queue (public for raw ring access in tests, and `restart_queue`).
    pub queue: VirtQueue,
    features: u64,
    depth: u16,
    max_data: u32,
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
    /// Typed chains go in indirect tables (`scsi_queue_indirect`).
    indirect: bool,
    used: Vec<Used>,
    /// Slots submitted since the last `flush` (stamped there, one clock read).
    unflushed: Vec<u16>,
    /// What submission and completion times count from: a latency is then
    /// a subtraction of two u64s per command, where one of two Instants
    /// is a call into std, and the registers it costs, per command.
    epoch: Instant,
    seq: u64,
    max_done_seq: u64,
    reordered: u64,
    /// The LUN field `submit` and `request` address.
    lun: [u8; 8],
    next_id: u64,
    /// The unit's block size and write protection, for the workload
    /// engine (`probe_disk` sets them).
    block_size: u32,
    read_only: bool,
}

// SAFETY: `ctrl` and `data` point into the guest memory that `queue.ring`
// keeps mapped (its DriverMemory holds the Arc); one thread owns the queue
// at a time.
unsafe impl Send for ScsiQueue {}

/// Guest memory `queues` scsi request queues of `depth` slots of
/// `max_data` bytes need at most (rings of any size, the control and event
/// queues included), for `Options::mem_size`.
pub fn memory_needed(queues: u16, depth: u16, max_data: u32) -> u64 {
    let stride = (max_data.max(1) as u64).div_ceil(4096) * 4096;
    // A ring of 32768 entries takes under 1 MiB in either layout; an
    // indirect queue's tables 48 bytes per ring entry, for the default
    // ring of at most 2 * depth entries (a larger one's fit the 4 MiB
    // spare up to 65536 entries in all).
    let tables = 2 * depth as u64 * DESCS_PER_CMD as u64 * 16;
    queues as u64 * (depth as u64 * (stride + CTRL_STRIDE) + tables + (1 << 20) + 8192) + (4 << 20)
}

/// What `ScsiQueue::probe_disk` found out about a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskShape {
    /// Logical blocks (READ CAPACITY(16)'s last LBA + 1).
    pub blocks: u64,
    /// Bytes per logical block.
    pub block_size: u32,
    /// MODE SENSE's WP bit.
    pub read_only: bool,
}

impl DiskShape {
    /// Capacity in bytes (saturating).
    pub fn bytes(&self) -> u64 {
        self.blocks.saturating_mul(self.block_size as u64)
    }
}

impl VirtioUser {
    /// Sets up virtio-scsi request queue `n` (virtqueue 2 + n) for up to
    /// `depth` commands in flight of up to `max_data` data bytes each, and
    /// starts it. The ring is the smallest power of two holding `depth`
    /// chains of 3 descriptors; `scsi_queue_sized` picks it.
    pub fn scsi_queue(&mut self, n: u16, depth: u16, max_data: u32) -> Result<ScsiQueue, Error> {
        self.scsi_queue_sized(n, depth, max_data, None)
    }

    /// `scsi_queue` with a chosen ring size (it must hold `depth` chains).
    pub fn scsi_queue_sized(
        &mut self,
        n: u16,
        depth: u16,
        max_data: u32,
        size: Option<u16>,
    ) -> Result<ScsiQueue, Error> {
        self.scsi_request_queue(n, depth, max_data, size, false)
    }

    /// `scsi_queue_sized` with each typed command in an indirect table
    /// behind one ring entry (VIRTIO_RING_F_INDIRECT_DESC, which must have
    /// been negotiated: put `features::INDIRECT_DESC` in
    /// `Options::features`), so the ring holds `depth` commands in `depth`
    /// entries; `size` None: the smallest power of two holding them. Raw
    /// chains (`submit_raw`) stay direct: they need free ring entries.
    pub fn scsi_queue_indirect(
        &mut self,
        n: u16,
        depth: u16,
        max_data: u32,
        size: Option<u16>,
    ) -> Result<ScsiQueue, Error> {
        if self.features & features::INDIRECT_DESC == 0 {
            return Err(Error::Unsupported(if self.offered & features::INDIRECT_DESC == 0 {
                format!(
                    "indirect descriptors: the device does not offer VIRTIO_RING_F_INDIRECT_DESC (offered {:#x})",
                    self.offered
                )
            } else {
                "indirect descriptors: VIRTIO_RING_F_INDIRECT_DESC was not negotiated (not in Options::features)".into()
            }));
        }
        self.scsi_request_queue(n, depth, max_data, size, true)
    }

    fn scsi_request_queue(
        &mut self,
        n: u16,
        depth: u16,
        max_data: u32,
        size: Option<u16>,
        indirect: bool,
    ) -> Result<ScsiQueue, Error> {
        let index = self.scsi_check(2 + n as usize, "request queue")?;
        if depth == 0 {
            return Err(Error::Config("queue depth must not be zero".into()));
        }
        let max_data = max_data.max(512);
        let per_cmd = if indirect { 1 } else { DESCS_PER_CMD };
        let need = depth as u64 * per_cmd as u64;
        let size = match size {
            Some(s) if (s as u64) < need && indirect => {
                return Err(Error::Config(format!("a ring of {s} entries cannot hold {depth} indirect commands")))
            }
            Some(s) if (s as u64) < need => {
                return Err(Error::Config(format!(
                    "a ring of {s} entries cannot hold {depth} commands of {DESCS_PER_CMD} descriptors \
                     (indirect descriptors would need {depth})"
                )))
            }
            Some(s) => s,
            None if need <= virtq::ring::MAX_QUEUE_SIZE as u64 => (need as u16).next_power_of_two(),
            None => return Err(Error::Config(format!("{depth} commands do not fit a ring of 32768"))),
        };
        let stride = (max_data as u64).div_ceil(4096) * 4096;
        if stride > u32::MAX as u64 {
            return Err(Error::Config(format!("{max_data} data bytes per command")));
        }
        let ctrl_gpa = self.mem.alloc(depth as u64 * CTRL_STRIDE, 64)?;
        let data_gpa = self.mem.alloc(depth as u64 * stride, 4096)?;
        let queue = self.create_queue(index, size, indirect.then_some(DESCS_PER_CMD))?;
        let mem = queue.ring.memory();
        let outside = || Error::Config("scsi buffers outside guest memory".into());
        let ctrl = mem.host(ctrl_gpa, depth as u64 * CTRL_STRIDE).ok_or_else(outside)?;
        let data = mem.host(data_gpa, depth as u64 * stride).ok_or_else(outside)?;
        let slots = (0..depth)
            .map(|_| Slot {
                kept: None,
                user: 0,
                id: 0,
                lun: [0; 8],
                opcode: 0,
                data: Data::None,
                writable_len: 0,
                raw_writable_at: None,
                submitted: 0,
                seq: 0,
            })
            .collect();
        let q = ScsiQueue {
            queue,
            features: self.features,
            depth,
            max_data,
            ctrl_gpa,
            ctrl,
            data_gpa,
            data,
            stride: stride as u32,
            slots,
            free: (0..depth).rev().collect(),
            readable: Vec::with_capacity(size as usize),
            writable: Vec::with_capacity(size as usize),
            indirect,
            used: vec![Used::default(); size as usize],
            unflushed: Vec::with_capacity(depth as usize),
            epoch: Instant::now(),
            seq: 0,
            max_done_seq: 0,
            reordered: 0,
            lun: command_lun(0),
            next_id: 1,
            block_size: 512,
            read_only: false,
        };
        self.start_queue(&q.queue)?;
        Ok(q)
    }

    /// Sets up the control queue (virtqueue 0) for up to `depth` requests
    /// in flight, and starts it.
    pub fn scsi_ctrl(&mut self, depth: u16) -> Result<ScsiCtrl, Error> {
        let index = self.scsi_check(0, "control queue")?;
        let depth = depth.max(1);
        let size = (depth as u32 * 2).next_power_of_two().min(32768) as u16;
        let gpa = self.mem.alloc(depth as u64 * CTRL_SLOT, 64)?;
        let queue = self.create_queue(index, size, None)?;
        let buf = queue
            .ring
            .memory()
            .host(gpa, depth as u64 * CTRL_SLOT)
            .ok_or_else(|| Error::Config("control buffers outside guest memory".into()))?;
        let now = Instant::now();
        let q = ScsiCtrl {
            queue,
            gpa,
            buf,
            slots: (0..depth)
                .map(|_| CtrlSlot { user: 0, kind: CtrlKind::Raw, writable_at: 0, writable_len: 0, submitted: now })
                .collect(),
            free: (0..depth).rev().collect(),
            done: Vec::new(),
        };
        self.start_queue(&q.queue)?;
        Ok(q)
    }

    /// Sets up the event queue (virtqueue 1) with `buffers` event buffers
    /// of `EVENT_LEN` bytes (none posted yet: `ScsiEvents::post`), and
    /// starts it.
    pub fn scsi_events(&mut self, buffers: u16) -> Result<ScsiEvents, Error> {
        let index = self.scsi_check(1, "event queue")?;
        let buffers = buffers.max(1);
        let size = (buffers as u32).next_power_of_two().min(32768) as u16;
        let gpa = self.mem.alloc(buffers as u64 * EVENT_LEN as u64, 64)?;
        let queue = self.create_queue(index, size, None)?;
        let q = ScsiEvents { queue, gpa, posted: vec![false; buffers as usize] };
        self.start_queue(&q.queue)?;
        Ok(q)
    }

    fn scsi_check(&self, index: usize, what: &str) -> Result<usize, Error> {
        if self.opts.device != DeviceType::Scsi {
            return Err(Error::Config("not a scsi connection (use Options::scsi)".into()));
        }
        if index as u64 >= self.max_queues {
            return Err(Error::Unsupported(format!(
                "{what} (virtqueue {index}; the backend has {} virtqueues)",
                self.max_queues
            )));
        }
        Ok(index)
    }
}

impl ScsiQueue {
    /// The negotiated features.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// Most commands in flight.
    pub fn depth(&self) -> u16 {
        self.depth
    }

    /// Typed commands go in indirect tables (`scsi_queue_indirect`).
    pub fn indirect(&self) -> bool {
        self.indirect
    }

    /// Largest data buffer of a typed command (and of a raw chain's bytes).
    pub fn max_data(&self) -> u32 {
        self.max_data
    }

    /// Commands submitted and not yet completed.
    pub fn in_flight(&self) -> u16 {
        self.depth - self.free.len() as u16
    }

    /// Slots free for `submit`.
    pub fn free_slots(&self) -> u16 {
        self.free.len() as u16
    }

    /// Completions that came after a command submitted later had completed
    /// (the device completes out of order).
    pub fn reordered(&self) -> u64 {
        self.reordered
    }

    /// Makes `submit` and `request` address unit `unit` of target 0.
    pub fn set_lun(&mut self, unit: u16) {
        self.lun = command_lun(unit);
    }

    /// Makes `submit` and `request` address this LUN field, whatever it holds.
    pub fn set_lun_field(&mut self, lun: [u8; 8]) {
        self.lun = lun;
    }

    /// The LUN field `submit` and `request` address.
    pub fn lun(&self) -> [u8; 8] {
        self.lun
    }

    /// The block size and write protection the workload engine assumes
    /// (`probe_disk` finds them out).
    pub fn set_disk(&mut self, block_size: u32, read_only: bool) {
        self.block_size = block_size.max(1);
        self.read_only = read_only;
    }

    /// The block size the workload engine assumes.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Asks the unit `set_lun` addresses for its capacity (READ
    /// CAPACITY(16)) and write protection (MODE SENSE(6)'s WP bit), and
    /// keeps them (`set_disk`). Needs an idle queue.
    pub fn probe_disk(&mut self, timeout: Duration) -> Result<DiskShape, Error> {
        let refused = |what: &str, r: &ScsiReply| {
            Error::Unsupported(format!(
                "{what} on this unit ({})",
                r.completion.problem().unwrap_or_else(|| format!("{} bytes", r.data_in().len()))
            ))
        };
        let r = self.request(Cmd::read_capacity_16(32), &[], timeout)?;
        let d = r.data_in();
        if !r.completion.ok() || d.len() < 12 {
            return Err(refused("READ CAPACITY(16)", &r));
        }
        let last = u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]);
        let block_size = u32::from_be_bytes([d[8], d[9], d[10], d[11]]);
        let r = self.request(Cmd::mode_sense_6(true, 0, 0x3f, 0, 255), &[], timeout)?;
        if !r.completion.ok() || r.data_in().len() < 4 {
            return Err(refused("MODE SENSE(6)", &r));
        }
        let shape = DiskShape { blocks: last.saturating_add(1), block_size, read_only: r.data_in()[2] & 0x80 != 0 };
        if block_size == 0 {
            return Err(Error::Unsupported("a unit with a block size of 0".into()));
        }
        self.set_disk(block_size, shape.read_only);
        Ok(shape)
    }

    fn ctrl_ptr(&self, slot: u16, off: u64) -> *mut u8 {
        // SAFETY: slot < depth and off < CTRL_STRIDE: inside the control
        // area of depth * CTRL_STRIDE bytes (checked in `scsi_queue_sized`).
        unsafe { self.ctrl.add((slot as u64 * CTRL_STRIDE + off) as usize) }
    }

    fn data_ptr(&self, slot: u16) -> *mut u8 {
        // SAFETY: slot < depth: inside the data area of depth * stride bytes
        // (checked in `scsi_queue_sized`).
        unsafe { self.data.add(slot as usize * self.stride as usize) }
    }

    /// Queues `cmd` for the LUN `set_lun` chose, with the next tag of this
    /// queue (1, 2, ...); see `submit_to`.
    #[inline]
    pub fn submit(&mut self, cmd: &Cmd, user: u64, fill: impl FnOnce(&mut SharedBytesMut)) -> Result<bool, Error> {
        let id = self.next_id;
        let posted = self.submit_to(self.lun, id, cmd, user, fill)?;
        if posted {
            self.next_id += 1;
        }
        Ok(posted)
    }

    /// Queues `cmd` for LUN field `lun` with tag `id` in a free slot;
    /// `fill` gets the slot's data area of the command's data length first
    /// (data-out; for data-in it may poison the buffer). Visible to the
    /// device after `flush`. Ok(false) when every slot is in flight; `user`
    /// comes back in the completion.
    #[inline]
    pub fn submit_to(
        &mut self,
        lun: [u8; 8],
        id: u64,
        cmd: &Cmd,
        user: u64,
        fill: impl FnOnce(&mut SharedBytesMut),
    ) -> Result<bool, Error> {
        let hdr = CmdReq { lun, id, task_attr: 0, prio: 0, crn: 0, cdb: cmd.cdb }.bytes();
        self.submit_slot(lun, id, cmd.cdb[0], cmd.data, user, fill, |p| {
            // SAFETY: the slot's control block holds REQ_LEN bytes at `p`.
            unsafe { std::ptr::copy_nonoverlapping(hdr.as_ptr(), p, REQ_LEN) }
        })
    }

    /// READ(10) or WRITE(10) of `blocks` blocks at `lba` for the LUN
    /// `set_lun` chose, with the next tag: `submit` for the workloads. The
    /// header is stored from registers: built in a buffer and copied, its
    /// wide loads waited for the byte stores before them, and with those
    /// for the store into the line the device last wrote (a miss), so each
    /// command waited out the previous one's.
    #[inline]
    pub fn submit_rw10(
        &mut self,
        write: bool,
        lba: u32,
        blocks: u16,
        user: u64,
        fill: impl FnOnce(&mut SharedBytesMut),
    ) -> Result<bool, Error> {
        let (lun, id, bs) = (self.lun, self.next_id, self.block_size);
        let len = blocks as u32 * bs;
        let (opcode, data) = if write { (op::WRITE_10, Data::Out(len)) } else { (op::READ_10, Data::In(len)) };
        let posted = self.submit_slot(lun, id, opcode, data, user, fill, |p| {
            // SAFETY: the slot's control block holds REQ_LEN bytes at `p`.
            unsafe { store_rw10_header(p, lun, id, opcode, lba, blocks) }
        })?;
        if posted {
            self.next_id += 1;
        }
        Ok(posted)
    }

    /// Takes a free slot, has `header` store the request header at its
    /// control block, marks the response unwritten and posts the chain.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn submit_slot(
        &mut self,
        lun: [u8; 8],
        id: u64,
        opcode: u8,
        data: Data,
        user: u64,
        fill: impl FnOnce(&mut SharedBytesMut),
        header: impl FnOnce(*mut u8),
    ) -> Result<bool, Error> {
        let data_len = data.len();
        if data_len > self.max_data {
            return Err(Error::Config(format!("{data_len} data bytes exceed the queue's {}", self.max_data)));
        }
        let Some(&slot) = self.free.last() else {
            return Ok(false);
        };
        let p = self.ctrl_ptr(slot, 0);
        header(p);
        // SAFETY: the slot's control block is ours (not in flight): request
        // header at 0..51, response header at 52..160, inside its 256 bytes.
        unsafe {
            // The response's sense_len, residual, status qualifier, status
            // and response: not written until the device writes them.
            std::ptr::write_bytes(p.add(CTRL_RESP as usize), RESPONSE_NOT_WRITTEN, 12);
        }
        // SAFETY: data_len <= max_data <= stride: the slot's own data area
        // in the frontend's memory, which outlives this call; nothing here
        // holds a reference to it.
        fill(&mut unsafe { SharedBytesMut::new(self.data_ptr(slot), data_len as usize) });
        let shape = Shape::Typed(data);
        match self.slots[slot as usize].kept {
            Some((h, s)) if s == shape => self.queue.ring.repost(h)?,
            _ => self.post_new_typed(slot, data)?,
        }
        self.free.pop();
        let s = &mut self.slots[slot as usize];
        s.user = user;
        s.id = id;
        s.lun = lun;
        s.opcode = opcode;
        s.data = data;
        s.writable_len = RESP_LEN as u32 + data.data_in();
        s.raw_writable_at = None;
        self.unflushed.push(slot);
        self.seq += 1;
        s.seq = self.seq;
        Ok(true)
    }

    /// Frees `slot`'s kept chain (of another shape), writes the
    /// descriptors of a typed chain for `data` (direct, or in the slot's
    /// chain's indirect table), keeps it and posts it.
    #[cold]
    fn post_new_typed(&mut self, slot: u16, data: Data) -> Result<(), Error> {
        if let Some((h, _)) = self.slots[slot as usize].kept.take() {
            self.queue.ring.free_kept(h)?;
        }
        let shape = Shape::Typed(data);
        if self.indirect {
            // Posted at once; once used, kept (`pop_used_batch` with keep)
            // and reposted as it is, its table unchanged.
            let h = self.build_typed(slot, data, true)?;
            self.slots[slot as usize].kept = Some((h, shape));
        } else {
            let h = self.build_typed(slot, data, false)?;
            self.slots[slot as usize].kept = Some((h, shape));
            self.queue.ring.repost(h)?;
        }
        Ok(())
    }

    /// Writes the descriptors of a typed chain for `slot`: direct, kept
    /// and not posted; or (`indirect`) in an indirect table, posted.
    fn build_typed(&mut self, slot: u16, data: Data, indirect: bool) -> Result<u16, Error> {
        let ctrl = self.ctrl_gpa + slot as u64 * CTRL_STRIDE;
        let dgpa = self.data_gpa + slot as u64 * self.stride as u64;
        let (mut r, mut w) = (std::mem::take(&mut self.readable), std::mem::take(&mut self.writable));
        r.clear();
        w.clear();
        r.push(Buf { addr: ctrl, len: REQ_LEN as u32 });
        w.push(Buf { addr: ctrl + CTRL_RESP, len: RESP_LEN as u32 });
        match data {
            Data::None | Data::In(0) | Data::Out(0) => {}
            Data::Out(n) => r.push(Buf { addr: dgpa, len: n }),
            Data::In(n) => w.push(Buf { addr: dgpa, len: n }),
        }
        let res = if indirect {
            self.queue.ring.add_indirect(&r, &w, slot as u64)
        } else {
            self.queue.ring.prepare(&r, &w, slot as u64)
        };
        self.readable = r;
        self.writable = w;
        Ok(res?)
    }

    /// Queues a raw chain in a free slot: `segs` in order (readable ones
    /// first: the driver side lays out chains that way), their bytes
    /// placed one after another in the slot's data area (at most the
    /// 4 KiB-rounded `max_data` in all). Readable buffers hold the given
    /// bytes, writable ones 0xff. No request or response header is added:
    /// this is for malformed commands. Ok(false) when every slot is in flight.
    pub fn submit_raw(&mut self, segs: &[RawSeg], user: u64) -> Result<bool, Error> {
        check_raw(segs, self.stride as u64)?;
        let Some(&slot) = self.free.last() else {
            return Ok(false);
        };
        if let Some((h, _)) = self.slots[slot as usize].kept.take() {
            self.queue.ring.free_kept(h)?;
        }
        let dgpa = self.data_gpa + slot as u64 * self.stride as u64;
        let (mut r, mut w) = (std::mem::take(&mut self.readable), std::mem::take(&mut self.writable));
        // SAFETY: the slot's data area (stride bytes at data_ptr) is ours,
        // not in flight, and check_raw bounded the chain by stride.
        let (at, end) = unsafe { lay_out_raw(segs, self.data_ptr(slot), dgpa, &mut r, &mut w) };
        let res = self.queue.ring.prepare(&r, &w, slot as u64);
        self.readable = r;
        self.writable = w;
        let head = res?;
        if let Err(e) = self.queue.ring.repost(head) {
            let _ = self.queue.ring.free_kept(head);
            return Err(e.into());
        }
        self.free.pop();
        let opcode = match segs.first() {
            Some(RawSeg::Readable(b)) if b.len() > 19 => b[19],
            _ => 0xff,
        };
        let s = &mut self.slots[slot as usize];
        s.kept = Some((head, Shape::Raw));
        s.user = user;
        s.id = 0;
        s.lun = [0; 8];
        s.opcode = opcode;
        s.writable_len = end - at;
        s.data = Data::In(s.writable_len.saturating_sub(RESP_LEN as u32));
        s.raw_writable_at = Some(at);
        self.unflushed.push(slot);
        self.seq += 1;
        s.seq = self.seq;
        Ok(true)
    }

    /// Publishes what was submitted and kicks if the device wants it.
    #[inline]
    pub fn flush(&mut self) -> Result<bool, Error> {
        if !self.unflushed.is_empty() {
            let now = self.clock();
            for slot in self.unflushed.drain(..) {
                self.slots[slot as usize].submitted = now;
            }
        }
        self.queue.publish_and_kick()
    }

    /// Nanoseconds since the queue's epoch.
    #[inline]
    fn clock(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Takes every completion the device has made (in whatever order it
    /// made them), calling `f` with each and its data buffer (data-in as
    /// the device left it, or the data-out; raw: every writable buffer),
    /// then frees the slots. Returns how many completed. A device that
    /// breaks the ring is an error.
    #[inline]
    pub fn poll(&mut self, mut f: impl FnMut(&ScsiCompletion, SharedBytes)) -> Result<usize, Error> {
        let mut out = std::mem::take(&mut self.used);
        let r = self.queue.ring.pop_used_batch(&mut out, true);
        let n = *r.as_ref().unwrap_or(&0);
        let now = if n > 0 { self.clock() } else { 0 };
        for u in &out[..n] {
            // The token is the slot we gave the chain: private, trusted.
            let slot = u.token as u16;
            let s = &self.slots[slot as usize];
            if s.seq < self.max_done_seq {
                self.reordered += 1;
            }
            self.max_done_seq = self.max_done_seq.max(s.seq);
            let base = self.data_ptr(slot);
            // The response header: in the control block, or for a raw
            // chain the first RESP_LEN writable bytes (contiguous in the
            // data area), if there are that many.
            let resp_at = match s.raw_writable_at {
                None => Some(self.ctrl_ptr(slot, CTRL_RESP) as *const u8),
                // SAFETY: at + RESP_LEN <= at + writable_len <= stride.
                Some(at) if s.writable_len as usize >= RESP_LEN => Some(unsafe { base.add(at as usize) } as *const u8),
                Some(_) => None,
            };
            let (resp, sense) = match resp_at {
                // SAFETY: RESP_LEN bytes at `p` lie inside the slot's
                // control block or data area (above).
                Some(p) => unsafe { read_resp(p) },
                None => not_written(),
            };
            let c = ScsiCompletion {
                user: s.user,
                id: s.id,
                lun: s.lun,
                opcode: s.opcode,
                data: s.data,
                writable_len: s.writable_len,
                used_len: u.len,
                resp,
                sense,
                latency: Duration::from_nanos(now.saturating_sub(s.submitted)),
                raw: s.raw_writable_at.is_some(),
            };
            let (data_off, data_len) = match s.raw_writable_at {
                Some(at) => (at, s.writable_len),
                None => (0, s.data.len()),
            };
            // SAFETY: data_off + data_len <= stride: the slot's data area,
            // in the frontend's memory, which outlives the call.
            let data = unsafe { SharedBytes::new(base.add(data_off as usize), data_len as usize) };
            f(&c, data);
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

    /// Runs one command synchronously on the LUN `set_lun` chose (nothing
    /// else may be in flight): `data_out` goes at the start of the data
    /// buffer (the rest zeroed; a data-in buffer is filled with 0xa5 first);
    /// waits up to `timeout`. On a timeout the slot stays in flight.
    pub fn request(&mut self, cmd: Cmd, data_out: &[u8], timeout: Duration) -> Result<ScsiReply, Error> {
        let (lun, id) = (self.lun, self.next_id);
        self.next_id += 1;
        self.request_to(lun, id, cmd, data_out, timeout)
    }

    /// `request` for LUN field `lun` with tag `id`.
    pub fn request_to(
        &mut self,
        lun: [u8; 8],
        id: u64,
        cmd: Cmd,
        data_out: &[u8],
        timeout: Duration,
    ) -> Result<ScsiReply, Error> {
        self.sync(timeout, |q| {
            q.submit_to(lun, id, &cmd, 0, |buf| match cmd.data {
                Data::In(_) => buf.fill(POISON),
                _ => {
                    let n = data_out.len().min(buf.len());
                    buf.fill(0);
                    buf.write_at(0, &data_out[..n]);
                }
            })
        })
    }

    /// Runs one raw chain synchronously (see `submit_raw`).
    pub fn request_raw(&mut self, segs: &[RawSeg], timeout: Duration) -> Result<ScsiReply, Error> {
        self.sync(timeout, |q| q.submit_raw(segs, 0))
    }

    fn sync(
        &mut self,
        timeout: Duration,
        submit: impl FnOnce(&mut ScsiQueue) -> Result<bool, Error>,
    ) -> Result<ScsiReply, Error> {
        if self.in_flight() != 0 {
            return Err(Error::Config(format!(
                "{} commands in flight: synchronous commands need an idle queue",
                self.in_flight()
            )));
        }
        if !submit(self)? {
            return Err(Error::Config("no free slot".into()));
        }
        self.flush()?;
        let take = |q: &mut ScsiQueue| {
            let mut reply = None;
            q.poll(|c, data| {
                reply = Some(ScsiReply { completion: c.clone(), resp: c.cmd_resp(), data: data.to_vec() })
            })?;
            Ok(reply)
        };
        wait_some(self, |q| &mut q.queue, timeout, take)?
            .ok_or_else(|| Error::Timeout(format!("no completion on queue {} in {timeout:?}", self.queue.index())))
    }
}

/// Refuses a raw chain that is empty, holds more than `cap` bytes, or puts
/// a readable buffer after a writable one (the driver side lays chains
/// out readable first).
fn check_raw(segs: &[RawSeg], cap: u64) -> Result<(), Error> {
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
    if segs.is_empty() || total > cap {
        return Err(Error::Config(format!(
            "a raw chain of {} buffers and {total} bytes (at most {cap} bytes)",
            segs.len()
        )));
    }
    Ok(())
}

/// Places a raw chain's buffers one after another from `host` (guest
/// address `gpa`): readable ones hold their bytes, writable ones 0xff.
/// Fills `r` and `w` (cleared first); returns the offsets of the first
/// writable byte and of the end.
///
/// # Safety
/// `host` must be valid for writes of the chain's bytes (`check_raw`
/// bounded them), memory no one else uses meanwhile.
unsafe fn lay_out_raw(segs: &[RawSeg], host: *mut u8, gpa: u64, r: &mut Vec<Buf>, w: &mut Vec<Buf>) -> (u32, u32) {
    r.clear();
    w.clear();
    let mut off = 0u32;
    let mut writable_at = None;
    for s in segs {
        match *s {
            RawSeg::Readable(b) => {
                // SAFETY: off + len is within the chain's bytes (the caller's promise).
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), host.add(off as usize), b.len()) };
                r.push(Buf { addr: gpa + off as u64, len: b.len() as u32 });
                off += b.len() as u32;
            }
            RawSeg::Writable(n) => {
                writable_at.get_or_insert(off);
                // SAFETY: as above.
                unsafe { std::ptr::write_bytes(host.add(off as usize), RESPONSE_NOT_WRITTEN, n as usize) };
                w.push(Buf { addr: gpa + off as u64, len: n });
                off += n;
            }
        }
    }
    (writable_at.unwrap_or(off), off)
}

/// What a data-in buffer of `request` holds before the device writes it.
pub const POISON: u8 = 0xa5;

/// Stores the request header (`CmdReq`) of a 10-byte READ or WRITE at
/// `p` with word stores: lun 0..8, id 8..16, task attribute, priority and
/// crn 16..19 (0), then the CDB at 19: opcode, flags 0, the LBA
/// (big-endian) at 21..25, group 0, the length at 26..28, control 0, and
/// zeros to 51.
///
/// # Safety
/// `p` is valid for writes of REQ_LEN (51) bytes.
#[inline(always)]
unsafe fn store_rw10_header(p: *mut u8, lun: [u8; 8], id: u64, opcode: u8, lba: u32, blocks: u16) {
    // The CDB's first 8 bytes and the length field, as little-endian words.
    let w0 = opcode as u64 | (lba.swap_bytes() as u64) << 16;
    let w1 = (blocks.swap_bytes() as u64) << 8;
    // SAFETY: every store ends by byte 51 (caller: 51 writable bytes).
    unsafe {
        (p as *mut [u8; 8]).write_unaligned(lun);
        (p.add(8) as *mut u64).write_unaligned(id.to_le());
        (p.add(16) as *mut u64).write_unaligned((w0 << 24).to_le());
        (p.add(24) as *mut u64).write_unaligned((w0 >> 40 | w1 << 8).to_le());
        (p.add(32) as *mut u64).write_unaligned(0);
        (p.add(40) as *mut u64).write_unaligned(0);
        (p.add(43) as *mut u64).write_unaligned(0);
    }
}

/// A response header from the RESP_LEN bytes at `p`: the 12 fixed bytes,
/// and the sense bytes (as many as sense_len says) only if there are any:
/// a good command has none. Raw reads, never a reference: the memory is
/// shared with the device, which may still write it.
///
/// # Safety
/// `p` is valid for reads of RESP_LEN bytes.
#[inline(always)]
unsafe fn read_resp(p: *const u8) -> (RespHeader, Option<Box<[u8]>>) {
    // SAFETY: the first 12 of the RESP_LEN readable bytes (caller).
    let (first, second) = unsafe { ((p as *const u64).read_unaligned(), (p.add(8) as *const u32).read_unaligned()) };
    let (first, second) = (u64::from_le(first), u32::from_le(second));
    let h = RespHeader {
        sense_len: first as u32,
        residual: (first >> 32) as u32,
        status_qualifier: second as u16,
        status: (second >> 16) as u8,
        response: (second >> 24) as u8,
    };
    // SAFETY: as above.
    let sense = if h.sense_len != 0 { Some(unsafe { read_sense(p, h.sense_len) }) } else { None };
    (h, sense)
}

/// The sense bytes of a response header at `p` (at most SENSE_SIZE).
///
/// # Safety
/// `p` is valid for reads of RESP_LEN bytes.
#[cold]
unsafe fn read_sense(p: *const u8, sense_len: u32) -> Box<[u8]> {
    let n = (sense_len as usize).min(SENSE_SIZE);
    let mut v = vec![0u8; n];
    // SAFETY: 12 + n <= 12 + SENSE_SIZE = RESP_LEN bytes at p (caller);
    // `v` is private memory.
    unsafe { std::ptr::copy_nonoverlapping(p.add(12), v.as_mut_ptr(), n) };
    v.into_boxed_slice()
}

/// The response header of a chain the device could not answer in: every
/// fixed field all ones, and (sense_len being u32::MAX) the whole sense
/// field, zeros.
#[cold]
fn not_written() -> (RespHeader, Option<Box<[u8]>>) {
    let h = RespHeader {
        sense_len: u32::MAX,
        residual: u32::MAX,
        status_qualifier: u16::MAX,
        status: RESPONSE_NOT_WRITTEN,
        response: RESPONSE_NOT_WRITTEN,
    };
    (h, Some(vec![0; SENSE_SIZE].into()))
}

/// Calls `take` on `s` until it gives something or `timeout` passes,
/// sleeping on the call eventfd of `s`'s virtqueue in between (in short
/// waits: a lost call costs a little time, never the answer). None on a
/// timeout.
fn wait_some<S, T>(
    s: &mut S,
    queue: impl Fn(&mut S) -> &mut VirtQueue,
    timeout: Duration,
    mut take: impl FnMut(&mut S) -> Result<Option<T>, Error>,
) -> Result<Option<T>, Error> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = take(s)? {
            return Ok(Some(v));
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        let q = queue(s);
        if !q.ring.enable_notifications() {
            q.wait_call((deadline - now).min(Duration::from_millis(20)))?;
        }
    }
}

// ---- the control queue ------------------------------------------------------

/// Bytes of guest memory per control slot: a typed request at 0, its
/// response at 64; a raw chain anywhere in it.
const CTRL_SLOT: u64 = 512;
const CTRL_SLOT_RESP: u64 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CtrlKind {
    Tmf,
    An,
    Raw,
}

struct CtrlSlot {
    user: u64,
    kind: CtrlKind,
    writable_at: u32,
    writable_len: u32,
    submitted: Instant,
}

/// A completed control request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CtrlCompletion {
    /// The caller's tag.
    pub user: u64,
    /// The used length the device reported.
    pub used_len: u32,
    /// The response byte (`RESPONSE_NOT_WRITTEN` if the device left it;
    /// raw: the last writable byte).
    pub response: u8,
    /// AN: the events the device supports of those asked for (raw and
    /// TMF: 0; AN left alone by the device: u32::MAX).
    pub event_actual: u32,
    /// The writable bytes of the chain after completion.
    pub writable: Vec<u8>,
    /// From `submit` to the poll that found it.
    pub latency: Duration,
}

/// The control queue: task management functions and asynchronous
/// notification requests, answered in any order.
pub struct ScsiCtrl {
    /// The queue (public for raw ring access in tests).
    pub queue: VirtQueue,
    gpa: u64,
    buf: *mut u8,
    slots: Vec<CtrlSlot>,
    free: Vec<u16>,
    /// Completions taken from the ring and not yet claimed.
    done: Vec<CtrlCompletion>,
}

// SAFETY: `buf` points into the guest memory `queue.ring` keeps mapped; one
// thread owns the queue at a time.
unsafe impl Send for ScsiCtrl {}

impl ScsiCtrl {
    fn slot_ptr(&self, slot: u16) -> *mut u8 {
        // SAFETY: slot < depth: inside the area of depth * CTRL_SLOT bytes
        // (checked in `scsi_ctrl`).
        unsafe { self.buf.add(slot as usize * CTRL_SLOT as usize) }
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Queues a control request and kicks: a TMF with a 1-byte response,
    /// an AN request with a 5-byte one (poisoned with 0xff). Ok(false) when
    /// every slot is in flight.
    pub fn submit(&mut self, req: &CtrlReq, user: u64) -> Result<bool, Error> {
        let (kind, resp_len) = match req {
            CtrlReq::Tmf { .. } => (CtrlKind::Tmf, TMF_RESP_LEN),
            CtrlReq::An { .. } => (CtrlKind::An, AN_RESP_LEN),
        };
        let bytes = req.bytes();
        let Some(&slot) = self.free.last() else { return Ok(false) };
        let p = self.slot_ptr(slot);
        // SAFETY: the slot's area is ours (not in flight): the request
        // (at most 24 bytes) at 0, the response (at most 5) at 64.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
            std::ptr::write_bytes(p.add(CTRL_SLOT_RESP as usize), RESPONSE_NOT_WRITTEN, resp_len);
        }
        let at = self.gpa + slot as u64 * CTRL_SLOT;
        let r = [Buf { addr: at, len: bytes.len() as u32 }];
        let w = [Buf { addr: at + CTRL_SLOT_RESP, len: resp_len as u32 }];
        self.queue.ring.add(&r, &w, slot as u64)?;
        self.free.pop();
        self.slots[slot as usize] = CtrlSlot {
            user,
            kind,
            writable_at: CTRL_SLOT_RESP as u32,
            writable_len: resp_len as u32,
            submitted: Instant::now(),
        };
        self.queue.publish_and_kick()?;
        Ok(true)
    }

    /// Queues a raw control chain (see `ScsiQueue::submit_raw`; at most 512
    /// bytes in all) and kicks.
    pub fn submit_raw(&mut self, segs: &[RawSeg], user: u64) -> Result<bool, Error> {
        check_raw(segs, CTRL_SLOT)?;
        let Some(&slot) = self.free.last() else { return Ok(false) };
        let (mut r, mut w) = (Vec::new(), Vec::new());
        // SAFETY: the slot (CTRL_SLOT bytes at slot_ptr) is ours, not in
        // flight, and check_raw bounded the chain by CTRL_SLOT.
        let (at, end) =
            unsafe { lay_out_raw(segs, self.slot_ptr(slot), self.gpa + slot as u64 * CTRL_SLOT, &mut r, &mut w) };
        self.queue.ring.add(&r, &w, slot as u64)?;
        self.free.pop();
        self.slots[slot as usize] =
            CtrlSlot { user, kind: CtrlKind::Raw, writable_at: at, writable_len: end - at, submitted: Instant::now() };
        self.queue.publish_and_kick()?;
        Ok(true)
    }

    /// Takes the control completions the device made into the list of
    /// unclaimed ones (`take`, `wait_for`). Returns how many.
    pub fn poll(&mut self) -> Result<usize, Error> {
        let mut n = 0;
        while let Some(u) = self.queue.ring.pop_used()? {
            let slot = u.token as u16;
            let s = &self.slots[slot as usize];
            // SAFETY: writable_at + writable_len <= CTRL_SLOT: inside the
            // slot, in the frontend's memory, which outlives the call.
            let w =
                unsafe { SharedBytes::new(self.slot_ptr(slot).add(s.writable_at as usize), s.writable_len as usize) };
            let w = w.to_vec();
            let (response, event_actual) = match s.kind {
                CtrlKind::Tmf => (w[0], 0),
                CtrlKind::An if w[..4] == [RESPONSE_NOT_WRITTEN; 4] => (w[4], u32::MAX),
                CtrlKind::An => (w[4], u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
                CtrlKind::Raw => (w.last().copied().unwrap_or(RESPONSE_NOT_WRITTEN), 0),
            };
            self.done.push(CtrlCompletion {
                user: s.user,
                used_len: u.len,
                response,
                event_actual,
                writable: w,
                latency: s.submitted.elapsed(),
            });
            self.free.push(slot);
            n += 1;
        }
        Ok(n)
    }

    /// The completion of the request tagged `user`, if it came (polls first).
    pub fn take(&mut self, user: u64) -> Result<Option<CtrlCompletion>, Error> {
        self.poll()?;
        Ok(self.done.iter().position(|c| c.user == user).map(|i| self.done.remove(i)))
    }

    /// Waits up to `timeout` for the completion of the request tagged
    /// `user` (others that complete meanwhile stay for `take`). None on a
    /// timeout (the request stays in flight).
    pub fn wait_for(&mut self, user: u64, timeout: Duration) -> Result<Option<CtrlCompletion>, Error> {
        wait_some(self, |c| &mut c.queue, timeout, |c| c.take(user))
    }

    /// A TMF, synchronously: its response byte, within `timeout`.
    pub fn tmf(&mut self, subtype: u32, lun: [u8; 8], id: u64, timeout: Duration) -> Result<u8, Error> {
        let user = u64::MAX - 1;
        if !self.submit(&CtrlReq::Tmf { subtype, lun, id }, user)? {
            return Err(Error::Config("no free control slot".into()));
        }
        match self.wait_for(user, timeout)? {
            Some(c) => Ok(c.response),
            None => Err(Error::Timeout(format!("no answer to TMF {subtype} in {timeout:?}"))),
        }
    }

    /// An AN query or subscription (`ctrl::AN_QUERY`, `ctrl::AN_SUBSCRIBE`),
    /// synchronously: (event_actual, response).
    pub fn an(&mut self, kind: u32, lun: [u8; 8], event_requested: u32, timeout: Duration) -> Result<(u32, u8), Error> {
        let user = u64::MAX - 2;
        if !self.submit(&CtrlReq::An { kind, lun, event_requested }, user)? {
            return Err(Error::Config("no free control slot".into()));
        }
        match self.wait_for(user, timeout)? {
            Some(c) => Ok((c.event_actual, c.response)),
            None => Err(Error::Timeout(format!("no answer to AN request {kind} in {timeout:?}"))),
        }
    }
}

// ---- the event queue --------------------------------------------------------

/// An event from the event queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// `event::*`, with `event::EVENTS_MISSED` or'ed in if some were lost.
    pub event: u32,
    /// The LUN field it concerns.
    pub lun: [u8; 8],
    /// The reason (`event::RESCAN`, `event::REMOVED`, ...).
    pub reason: u32,
    /// The used length the device reported.
    pub used_len: u32,
}

/// The event queue: buffers of `EVENT_LEN` bytes the device fills with
/// events as they happen.
pub struct ScsiEvents {
    /// The queue (public for raw ring access in tests).
    pub queue: VirtQueue,
    gpa: u64,
    posted: Vec<bool>,
}

impl ScsiEvents {
    /// Buffers posted and not yet returned.
    pub fn posted(&self) -> usize {
        self.posted.iter().filter(|&&p| p).count()
    }

    /// Posts up to `n` of the buffers not posted (poisoned with 0xff) and
    /// kicks. Returns how many.
    pub fn post(&mut self, n: usize) -> Result<usize, Error> {
        let mut done = 0;
        for i in 0..self.posted.len() {
            if done == n {
                break;
            }
            if self.posted[i] {
                continue;
            }
            let gpa = self.gpa + (i * EVENT_LEN) as u64;
            self.queue.ring.memory().write(gpa, &[RESPONSE_NOT_WRITTEN; EVENT_LEN]);
            self.queue.ring.add(&[], &[Buf { addr: gpa, len: EVENT_LEN as u32 }], i as u64)?;
            self.posted[i] = true;
            done += 1;
        }
        if done > 0 {
            self.queue.publish_and_kick()?;
        }
        Ok(done)
    }

    /// The next event the device delivered, if any (its buffer is then
    /// free to post again).
    pub fn take(&mut self) -> Result<Option<Event>, Error> {
        let Some(u) = self.queue.ring.pop_used()? else { return Ok(None) };
        let i = u.token as usize;
        let mut b = [0u8; EVENT_LEN];
        self.queue.ring.memory().read(self.gpa + (i * EVENT_LEN) as u64, &mut b);
        if let Some(p) = self.posted.get_mut(i) {
            *p = false;
        }
        let mut lun = [0u8; 8];
        lun.copy_from_slice(&b[4..12]);
        Ok(Some(Event {
            event: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            lun,
            reason: u32::from_le_bytes([b[12], b[13], b[14], b[15]]),
            used_len: u.len,
        }))
    }

    /// The next event, waiting up to `timeout` for one.
    pub fn next_event(&mut self, timeout: Duration) -> Result<Option<Event>, Error> {
        wait_some(self, |e| &mut e.queue, timeout, ScsiEvents::take)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_stored_rw10_headers_match_the_byte_built_ones() {
        let lun = [1, 0, 0x40, 0x05, 0, 0, 0, 0];
        for (write, lba, blocks) in
            [(false, 0x1122_3344, 0x5566), (true, 0, 1), (true, u32::MAX, u16::MAX), (false, 7, 8)]
        {
            let cmd = if write { Cmd::write_10(lba, blocks, 512) } else { Cmd::read_10(lba, blocks, 512) };
            let id = 0x0102_0304_0506_0708 ^ lba as u64;
            let want = CmdReq { lun, id, task_attr: 0, prio: 0, crn: 0, cdb: cmd.cdb }.bytes();
            // Room past the header shows the stores end at its last byte.
            let mut got = [0xeeu8; REQ_LEN + 8];
            // SAFETY: `got` holds more than REQ_LEN bytes.
            unsafe { store_rw10_header(got.as_mut_ptr(), lun, id, cmd.cdb[0], lba, blocks) };
            assert_eq!(&got[..REQ_LEN], &want[..], "write {write} lba {lba:#x} blocks {blocks}");
            assert!(got[REQ_LEN..].iter().all(|&b| b == 0xee), "nothing past the header");
        }
    }

    #[test]
    fn cdbs_are_laid_out_as_spc_and_sbc_say() {
        let c = Cmd::read_16(0x0102_0304_0506_0708, 0x0a0b_0c0d, 512);
        assert_eq!(&c.cdb[..16], &[0x88, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0x0a, 0x0b, 0x0c, 0x0d, 0, 0]);
        assert!(c.cdb[16..].iter().all(|&b| b == 0));
        assert_eq!(c.data, Data::In(0x0a0b_0c0du32.saturating_mul(512)));
        let c = Cmd::write_10(0x11223344, 8, 512).fua();
        assert_eq!(&c.cdb[..10], &[0x2a, 0x08, 0x11, 0x22, 0x33, 0x44, 0, 0, 8, 0]);
        assert_eq!(c.data, Data::Out(4096));
        assert_eq!(&Cmd::inquiry(Some(0x83), 300).cdb[..6], &[0x12, 1, 0x83, 1, 44, 0]);
        assert_eq!(&Cmd::inquiry(None, 96).cdb[..6], &[0x12, 0, 0, 0, 96, 0]);
        assert_eq!(&Cmd::read_capacity_16(32).cdb[..16], &[0x9e, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 0, 0]);
        assert_eq!(&Cmd::report_luns(0, 4096).cdb[..12], &[0xa0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0]);
        assert_eq!(&Cmd::mode_sense_10(true, 1, 0x08, 0, 512).cdb[..10], &[0x5a, 0x08, 0x48, 0, 0, 0, 0, 2, 0, 0]);
        assert_eq!(&Cmd::mode_sense_6(false, 0, 0x3f, 0xff, 255).cdb[..6], &[0x1a, 0, 0x3f, 0xff, 255, 0]);
        let c = Cmd::write_same_16(7, 16, true, false, 512);
        assert_eq!(&c.cdb[..16], &[0x93, 0x08, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 16, 0, 0]);
        assert_eq!(c.data, Data::Out(512));
        assert_eq!(Cmd::write_same_16(7, 16, false, true, 512).cdb[1], 0x01);
        assert_eq!(Cmd::write_same_16(7, 16, false, true, 512).data, Data::None);
        assert_eq!(&Cmd::unmap(24).cdb[..10], &[0x42, 0, 0, 0, 0, 0, 0, 0, 24, 0]);
        assert_eq!(
            &Cmd::report_supported_opcodes(2, 0x9e, 0x10, 64).cdb[..12],
            &[0xa3, 0x0c, 2, 0x9e, 0, 0x10, 0, 0, 0, 64, 0, 0]
        );
        assert_eq!(&Cmd::request_sense(true, 252).cdb[..6], &[0x03, 1, 0, 0, 252, 0]);
        assert_eq!(&Cmd::synchronize_cache_16(1, 2).cdb[..16], &[0x91, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0]);
        assert_eq!(&Cmd::verify_10(5, 3).cdb[..10], &[0x2f, 0, 0, 0, 0, 5, 0, 0, 3, 0]);
    }

    #[test]
    fn unmap_parameter_list_layout() {
        let p = unmap_parameters(&[(0x10, 8), (0x0102_0304_0506_0708, 0x0a0b_0c0d)]);
        assert_eq!(p.len(), 40);
        assert_eq!(&p[..8], &[0, 38, 0, 32, 0, 0, 0, 0]);
        assert_eq!(&p[8..24], &[0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 8, 0, 0, 0, 0]);
        assert_eq!(&p[24..36], &[1, 2, 3, 4, 5, 6, 7, 8, 0x0a, 0x0b, 0x0c, 0x0d]);
    }

    #[test]
    fn sense_parses_both_formats() {
        let s = Sense::WRITE_PROTECTED;
        assert_eq!(parse_sense(&s.fixed()), Some(s));
        assert_eq!(parse_sense(&s.descriptor()), Some(s));
        assert_eq!(parse_sense(&s.fixed()[..13]), None);
        assert_eq!(parse_sense(&[0x7f, 0, 0, 0]), None);
        assert_eq!(parse_sense(&[]), None);
    }

    #[test]
    fn completion_checks_used_length() {
        let c = ScsiCompletion {
            user: 0,
            id: 1,
            lun: lun_field(0),
            opcode: op::READ_16,
            data: Data::In(4096),
            writable_len: 108 + 4096,
            used_len: 108 + 4096,
            resp: RespHeader::of(&CmdResp::new(response::OK, status::GOOD, 0, &[])),
            sense: None,
            latency: Duration::ZERO,
            raw: false,
        };
        assert!(c.ok());
        assert!(!ScsiCompletion { used_len: 108, ..c.clone() }.ok());
        let short = c.clone().with_resp(&CmdResp::new(response::OK, status::GOOD, 96, &[]));
        assert!(!short.ok());
        assert!(ScsiCompletion { used_len: 108 + 4000, ..short }.ok());
        let check = CmdResp::new(response::OK, status::CHECK_CONDITION, 4096, &Sense::LBA_OUT_OF_RANGE.fixed());
        let c2 = ScsiCompletion { used_len: 108, ..c.clone() }.with_resp(&check);
        assert_eq!(c2.sense(), Some(Sense::LBA_OUT_OF_RANGE));
        assert_eq!(c2.sense_bytes(), &Sense::LBA_OUT_OF_RANGE.fixed()[..]);
        assert_eq!(c2.cmd_resp(), check);
        assert!(c2.problem().unwrap().contains("0x5/0x21/0x00"), "{:?}", c2.problem());
        let (h, sense) = not_written();
        let unwritten = ScsiCompletion { resp: h, sense, ..c };
        assert!(!unwritten.ok());
        assert_eq!((unwritten.sense_bytes(), unwritten.resp.sense_len), (&[0u8; SENSE_SIZE][..], u32::MAX));
    }
}
