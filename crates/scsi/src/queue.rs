//! One virtio-scsi request queue: commands popped from its ring, answered
//! by the target (crate root) or run on the backend of the unit they
//! address, and completed as they finish, in any order.
//!
//! A request is one chain: the 51-byte request header and any data-out
//! (device-readable), then the 108-byte response header and any data-in
//! (device-writable). Everything in it comes from the guest and is
//! checked; a chain with no room for a response is returned with length 0
//! and counted.
//!
//! Each request queue has a backend of its own for every unit (an
//! io_uring per unit per queue, as blk has one per queue), so no lock is
//! taken in the data path. A request's backend tag is its slot; an UNMAP
//! with several ranges queues one backend request per range under the same
//! tag and completes when the last one does.

use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhostd_block_backends::{BlockBackend, BlockStats, Completion, Op, Request, NO_ROOM};
use vhostd_device::{InflightLog, RequestRing};
use virtq::{Batch, GuestBufs, IoBufs, Queue};
use vmm_sys_util::eventfd::EventFd;

use crate::device::{Board, ScsiDevice, TmfState};
use crate::wire::{response, CDB_SIZE, REQ_LEN, RESP_LEN};
use crate::Lun;
use crate::{execute, op, parse_virtio_lun, report_luns, status, Action, Sense, Transfer};

/// Data pieces a request may have (advertised as seg_max, with room for
/// an unaligned buffer's extra page: the file backend takes 256).
pub const SEG_MAX: u32 = 254;
/// The most bytes one READ or WRITE may move (VPD 0xb0 and max_sectors):
/// 128 pages, so a buffer of them spans at most SEG_MAX pieces.
pub const MAX_TRANSFER: u32 = 512 << 10;
/// SCSI status TASK SET FULL: the unit's backend has no room now (the
/// initiator retries).
const TASK_SET_FULL: u8 = 0x28;

/// Counters of one request queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScsiStats {
    /// Commands answered (every opcode).
    pub commands: u64,
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub unmaps: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Commands answered CHECK CONDITION.
    pub check_conditions: u64,
    /// Commands for a LUN the target does not have, or another target.
    pub bad_lun: u64,
    /// Responses OVERRUN: data buffers smaller than the command's transfer.
    pub overruns: u64,
    /// Chains with no room for a response: returned with length 0.
    pub no_response: u64,
    /// Backend completions with an error.
    pub backend_errors: u64,
    /// Requests answered ABORTED or RESET by task management.
    pub aborted: u64,
    /// Passes that popped or completed something.
    pub batches: u64,
    /// Most requests in flight at once.
    pub max_in_flight: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Free,
    /// With the backend: `pending` backend requests left.
    Running,
    /// Finished; its response is stored at the end of the pass.
    Done,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Other,
    Read,
    Write,
}

/// A request in flight.
struct Slot {
    cmd: Cmd,
    /// The response header (reply) and the data lent to the backend.
    io: IoBufs,
}

/// A slot's command state, set afresh for each command with one store of
/// [`Cmd::NEW`] (field by field, the resets took 17 stores).
#[derive(Clone, Copy)]
struct Cmd {
    stage: Stage,
    head: u16,
    /// The unit addressed and the command's tag, for task management.
    unit: u16,
    /// Which unit's backend runs it (a number may be removed and added
    /// again while the old unit still finishes requests).
    uid: u64,
    /// That unit's index in `units`, kept up to date while it runs here
    /// (`follow_units`).
    k: u32,
    id: u64,
    kind: Kind,
    /// Backend requests not yet completed.
    pending: u32,
    /// A flush follows the write (FUA).
    then_flush: bool,
    failed: bool,
    /// Task management's verdict: answered with this response instead
    /// (ABORTED, RESET), whatever the backend did.
    aborted: Option<u8>,
    response: u8,
    status: u8,
    sense: Option<Sense>,
    descriptor_sense: bool,
    residual: u32,
    /// Bytes written into the chain: the response header and data-in.
    used_len: u32,
    bytes: u64,
}

impl Cmd {
    /// A command just popped: finished at once, GOOD, nothing moved.
    const NEW: Cmd = Cmd {
        stage: Stage::Done,
        head: 0,
        unit: u16::MAX,
        uid: 0,
        k: u32::MAX,
        id: 0,
        kind: Kind::Other,
        pending: 0,
        then_flush: false,
        failed: false,
        aborted: None,
        response: response::OK,
        status: status::GOOD,
        sense: None,
        descriptor_sense: false,
        residual: 0,
        used_len: 0,
        bytes: 0,
    };
}

/// A unit as one request queue runs it: the target's view, this queue's
/// backend for it, and its requests in flight here.
struct Unit {
    lun: Arc<Lun>,
    backend: Box<dyn BlockBackend>,
    in_flight: usize,
    /// Gone from the device's table: finishing its requests here.
    removed: bool,
    /// Its backend signals the queue's `wake` when it finishes
    /// requests (a file; a null backend finishes them as they are queued).
    wakes: bool,
}

/// One request queue's units, requests in flight and counters.
pub struct ScsiQueue {
    /// The queue's index among the request queues (task management).
    index: usize,
    units: Vec<Unit>,
    /// The device's unit table generation this queue's `units` follow.
    units_gen: u64,
    /// The last LUN field that found a unit, with its number and index in
    /// `units`: a run of commands to one unit skips the decode and the
    /// search. Forgotten whenever `units` may change.
    lun_seen: Option<([u8; 8], u16, usize)>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    done: Vec<u32>,
    completions: Vec<Completion>,
    /// Popping, completing and the inflight log.
    ring: RequestRing,
    /// The task-management generation last looked at.
    tmf_seen: u64,
    /// Task management this queue has yet to report done.
    tmf_waiting: bool,
    /// Bytes of UNMAP or WRITE SAME parameter data (a reused buffer).
    param: Vec<u8>,
    /// Signalled by every unit's backend when it has completions: the
    /// queue's one event descriptor, whatever units come and go.
    wake: Arc<EventFd>,
    pub stats: ScsiStats,
}

/// The byte offset of `lba` if `blocks` from it fit (the target checked
/// the range; this only keeps the arithmetic from overflowing).
fn offset_of(lba: u64, blocks: u64, block_size: u32) -> Option<(u64, u64)> {
    let off = lba.checked_mul(block_size as u64)?;
    let len = blocks.checked_mul(block_size as u64)?;
    off.checked_add(len)?;
    Some((off, len))
}

impl ScsiQueue {
    /// Request queue `index` with at most `depth` requests in flight; its
    /// units' backends signal `wake` (`ScsiDevice::add_lun`).
    pub fn new(index: usize, depth: usize, wake: Arc<EventFd>) -> ScsiQueue {
        let depth = depth.clamp(1, u16::MAX as usize);
        let slots = (0..depth)
            .map(|_| Slot { cmd: Cmd { stage: Stage::Free, ..Cmd::NEW }, io: IoBufs::with_capacity(SEG_MAX as usize) })
            .collect();
        ScsiQueue {
            index,
            units: Vec::new(),
            units_gen: u64::MAX,
            lun_seen: None,
            slots,
            free: (0..depth as u32).rev().collect(),
            done: Vec::with_capacity(depth),
            completions: Vec::with_capacity(depth),
            ring: RequestRing::new(depth),
            tmf_seen: 0,
            tmf_waiting: false,
            param: Vec::new(),
            wake,
            stats: ScsiStats::default(),
        }
    }

    /// The descriptor that wakes a sleeping worker for completions.
    pub fn event_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// Requests popped and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether every request in flight here is finished by the kernel and
    /// wakes the queue's event descriptor when it is.
    pub fn completes_elsewhere(&self) -> bool {
        self.units.iter().all(|u| u.in_flight == 0 || u.wakes)
    }

    /// Consumes the backends' wake-ups.
    pub fn ack_completion_events(&mut self) {
        // A counter read to zero; empty, it answers EAGAIN.
        let _ = self.wake.read();
    }

    /// The units' backends' statistics, summed.
    pub fn backend_stats(&self) -> BlockStats {
        let mut sum = BlockStats::default();
        for u in &self.units {
            // Every field named: one added to BlockStats must be summed here.
            let BlockStats { submitted, completed, errors, submit_calls, mapped } = u.backend.stats();
            sum.submitted += submitted;
            sum.completed += completed;
            sum.errors += errors;
            sum.submit_calls += submit_calls;
            sum.mapped += mapped;
        }
        sum
    }

    /// Takes the device's units that are new since the last look (their
    /// backends for this queue), and lets go of removed ones once nothing
    /// of theirs is in flight here. True if the units changed.
    pub fn follow_units(&mut self, dev: &ScsiDevice) -> bool {
        let gen = dev.units_gen.load(Ordering::Acquire);
        if gen == self.units_gen {
            return false;
        }
        let mut changed = false;
        let table = dev.units.lock().unwrap_or_else(|e| e.into_inner());
        let present = |u: &Unit| table.iter().any(|l| Arc::ptr_eq(l, &u.lun));
        // A removed unit stays while requests of its own run here.
        let before = self.units.len();
        self.units.retain(|u| present(u) || u.in_flight > 0);
        changed |= self.units.len() != before;
        for u in &mut self.units {
            u.removed = !present(u);
        }
        let lingering = self.units.iter().any(|u| u.removed);
        for lun in table.iter() {
            if self.units.iter().any(|u| Arc::ptr_eq(&u.lun, lun)) {
                continue;
            }
            if let Some(backend) = lun.take_backend(self.index) {
                // Not signalling `wake` (see `add_lun`): its requests are polled for.
                let wakes = backend.completion_fd() == Some(self.event_fd());
                self.units.push(Unit { lun: lun.clone(), backend, in_flight: 0, removed: false, wakes });
                changed = true;
            }
        }
        drop(table);
        self.units.sort_by_key(|u| u.lun.number);
        // Indexes into `units` may have moved.
        self.lun_seen = None;
        for s in &mut self.slots {
            if s.cmd.stage == Stage::Running {
                let k = self.units.iter().position(|u| u.lun.uid == s.cmd.uid);
                s.cmd.k = k.map_or(u32::MAX, |k| k as u32);
            }
        }
        // Look again next pass while a removed unit still has requests.
        if !lingering {
            self.units_gen = gen;
        }
        changed
    }

    /// One pass: pops and starts new requests, then completes what the
    /// backends finished. Returns requests started or completed.
    pub fn process(&mut self, q: &mut Queue, batch: &mut Batch, dev: &ScsiDevice) -> usize {
        let mut work = 0;
        let room = self.free.len();
        if room > 0 && !q.is_broken() {
            let (n, rejected) = self.ring.pop(q, batch, room);
            work += rejected;
            // Request headers and responses are fetched a few commands
            // ahead of the decode, so their misses overlap (as blk does).
            let fetch = |chain: &virtq::Chain| {
                batch.readable(chain).prefetch(0);
                batch.writable(chain).prefetch_write(0);
            };
            batch.each_fetching_ahead(fetch, |chain| {
                let lens = (chain.read_len as usize, chain.write_len as usize);
                self.start(chain.head, &batch.readable(chain), &batch.writable(chain), lens, dev);
            });
            if n > 0 {
                self.submit();
                work += n;
                let at_backend = self.in_flight() - self.done.len();
                self.stats.max_in_flight = self.stats.max_in_flight.max(at_backend as u64);
            }
        }
        work += self.reap();
        if !self.done.is_empty() {
            work += self.complete_done(q);
        }
        if self.tmf_waiting || dev.board.gen.load(Ordering::Acquire) != self.tmf_seen {
            self.task_management(&dev.board);
        }
        if work > 0 {
            self.stats.batches += 1;
        }
        work
    }

    /// Completes what the backends finished and starts nothing (a ring
    /// that is stopping). Returns requests completed.
    pub fn finish(&mut self, q: &mut Queue, dev: &ScsiDevice) -> usize {
        let n = self.reap() + self.complete_done(q);
        if self.tmf_waiting || dev.board.gen.load(Ordering::Acquire) != self.tmf_seen {
            self.task_management(&dev.board);
        }
        n
    }

    /// Task management while no ring runs: nothing is in flight, so every
    /// request names nothing here.
    pub fn idle_task_management(&mut self, dev: &ScsiDevice) {
        if self.tmf_waiting || dev.board.gen.load(Ordering::Acquire) != self.tmf_seen {
            self.task_management(&dev.board);
        }
    }

    fn submit(&mut self) {
        for u in &mut self.units {
            if u.in_flight > 0 {
                u.backend.submit();
            }
        }
    }

    /// Starts logging requests in flight in `log` after resubmitting the
    /// ones a previous backend left there (as blk does). Returns how many.
    pub fn attach_inflight(&mut self, log: InflightLog, q: &mut Queue, batch: &mut Batch, dev: &ScsiDevice) -> usize {
        // The ring is out of `self` while `start` runs (it borrows all of it).
        let mut ring = std::mem::take(&mut self.ring);
        let room = self.free.len();
        let n = ring.recover(log, q, batch, room, |head, readable, writable| {
            let lens = (readable.bytes(), writable.bytes());
            self.start(head, &readable, &writable, lens, dev)
        });
        self.ring = ring;
        if n > 0 {
            self.submit();
        }
        self.complete_done(q);
        n
    }

    /// Stops logging (the ring is handed back).
    pub fn detach_inflight(&mut self) {
        self.ring.detach();
    }

    /// Waits for every request in flight and completes them (before the
    /// ring is handed back or the memory table changes).
    pub fn drain(&mut self, q: &mut Queue) {
        for u in &mut self.units {
            while u.backend.in_flight() > 0 {
                u.backend.wait();
                u.backend.reap(&mut self.completions);
            }
        }
        self.reap_collected();
        let mut lost = 0;
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if slot.cmd.stage == Stage::Running {
                slot.cmd.stage = Stage::Done;
                slot.cmd.failed = true;
                self.done.push(i as u32);
                lost += 1;
            }
        }
        if lost > 0 {
            tracing::warn!("ring stopped with {lost} request(s) the backend never completed: answered with an error");
        }
        self.complete_done(q);
        for slot in &mut self.slots {
            slot.io.release();
        }
        for u in &mut self.units {
            u.in_flight = 0;
            u.backend.release_memory();
        }
    }

    /// Takes the backends' completions into their slots. Returns how many.
    fn reap(&mut self) -> usize {
        for u in &mut self.units {
            if u.in_flight > 0 {
                u.backend.reap(&mut self.completions);
            }
        }
        // An idle pass (most of them, polling) skips the call.
        if self.completions.is_empty() {
            return 0;
        }
        self.reap_collected()
    }

    fn reap_collected(&mut self) -> usize {
        let n = self.completions.len();
        let mut resubmit = false;
        for i in 0..n {
            let c = self.completions[i];
            let Some(slot) = self.slots.get_mut(c.tag as usize) else { continue };
            if slot.cmd.stage != Stage::Running {
                continue;
            }
            if c.result < 0 {
                self.stats.backend_errors += 1;
                slot.cmd.failed = true;
            }
            slot.cmd.pending = slot.cmd.pending.saturating_sub(1);
            if slot.cmd.pending > 0 {
                continue;
            }
            if slot.cmd.then_flush && !slot.cmd.failed {
                slot.cmd.then_flush = false;
                let req = Request { tag: c.tag, op: Op::Flush, offset: 0, len: 0, bufs: &IoBufs::new() };
                if let Some(u) = unit_of(&mut self.units, &slot.cmd) {
                    if u.backend.queue(&req).is_ok() {
                        slot.cmd.pending = 1;
                        resubmit = true;
                        continue;
                    }
                }
                slot.cmd.failed = true;
            }
            slot.cmd.stage = Stage::Done;
            if let Some(u) = unit_of(&mut self.units, &slot.cmd) {
                u.in_flight = u.in_flight.saturating_sub(1);
            }
            self.done.push(c.tag as u32);
        }
        self.completions.clear();
        if resubmit {
            self.submit();
        }
        n
    }

    /// Stores the responses and used entries of the finished requests with
    /// one publish. Returns how many.
    fn complete_done(&mut self, q: &mut Queue) -> usize {
        let n = self.done.len();
        for k in 0..n {
            let i = self.done[k] as usize;
            let slot = &mut self.slots[i];
            if slot.cmd.kind == Kind::Read && slot.cmd.bytes > 0 {
                slot.io.data_written();
            }
            let c = &slot.cmd;
            let good = c.response == response::OK && c.status == status::GOOD && c.sense.is_none();
            let used = if good && !c.failed && c.aborted.is_none() && c.used_len != 0 {
                // Most commands: GOOD, no sense, two word stores (as
                // `write_response` would, with its checks already made).
                match c.kind {
                    Kind::Read => self.stats.bytes_read += c.bytes,
                    Kind::Write => self.stats.bytes_written += c.bytes,
                    Kind::Other => {}
                }
                let second = (status::GOOD as u32) << 16 | (response::OK as u32) << 24;
                slot.io.write_reply_head((c.residual as u64) << 32, second);
                c.used_len
            } else {
                finish_unusual(slot, &mut self.stats)
            };
            self.ring.complete(q, slot.cmd.head, used);
            slot.cmd.stage = Stage::Free;
            slot.io.clear();
            self.free.push(i as u32);
        }
        self.done.clear();
        if n > 0 {
            self.ring.publish(q);
        }
        n
    }

    /// Parses one chain (of `lens`: readable and writable bytes) and
    /// starts it (or finishes it at once). The buffers come by reference:
    /// by value, both were copied through the stack, 12 instructions a
    /// command (callgrind).
    fn start(
        &mut self,
        head: u16,
        readable: &GuestBufs<'_>,
        writable: &GuestBufs<'_>,
        lens: (usize, usize),
        dev: &ScsiDevice,
    ) {
        let Some(seq) = self.free.pop() else { return };
        self.done.push(seq);
        self.stats.commands += 1;
        let slot = &mut self.slots[seq as usize];
        slot.cmd = Cmd { head, ..Cmd::NEW };
        slot.io.clear();
        // The response header: the first RESP_LEN writable bytes.
        if !writable.lend_front(RESP_LEN, &mut slot.io) {
            self.stats.no_response += 1;
            return;
        }
        slot.cmd.used_len = RESP_LEN as u32;
        let (read_len, write_len) = lens;
        let data_in = write_len.saturating_sub(RESP_LEN);
        let mut hdr = [0u8; REQ_LEN];
        if read_len < REQ_LEN || readable.read(0, &mut hdr) < REQ_LEN {
            // No whole request header: nothing to answer but the failure.
            slot.cmd.response = response::FAILURE;
            return;
        }
        // The header's fields in place (`wire::CmdReq`): lun, id, task
        // attribute, priority, crn, cdb.
        // REQ_LEN is 19 + CDB_SIZE (wire.rs), so the header ends with the
        // whole field and this never falls back.
        let Some(cdb_field) = hdr.last_chunk::<CDB_SIZE>() else { return };
        let (lun, cdb) = (&hdr[0..8], &cdb_field[..]);
        let data_out = read_len - REQ_LEN;
        slot.cmd.id = u64::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15]]);
        // Every data byte is a residual until something moves it.
        slot.cmd.residual = (data_in.max(data_out)).min(u32::MAX as usize) as u32;
        let lun: [u8; 8] = lun.try_into().unwrap_or([0; 8]);
        let (unit, found) = match self.lun_seen {
            Some((field, unit, k)) if field == lun => (unit, Some(k)),
            _ => {
                let unit = match parse_virtio_lun(&lun) {
                    Some((0, unit)) => unit,
                    _ => {
                        // Another target, or a LUN field not in virtio's form.
                        self.stats.bad_lun += 1;
                        slot.cmd.response = response::BAD_TARGET;
                        return;
                    }
                };
                // A unit removed but still finishing requests here takes no new ones.
                let found = self.units.iter().position(|u| u.lun.number == unit && !u.removed);
                if let Some(k) = found {
                    self.lun_seen = Some((lun, unit, k));
                }
                (unit, found)
            }
        };
        slot.cmd.unit = unit;
        let data = (data_out, data_in);
        if let Some(k) = found {
            let u = &mut self.units[k];
            slot.cmd.uid = u.lun.uid;
            slot.cmd.k = k as u32;
            if cdb[0] != op::REPORT_LUNS {
                slot.cmd.descriptor_sense = u.lun.disk.descriptor_sense;
                // The data path: READ and WRITE, decoded without an Action.
                if let Some(t) = crate::transfer(&u.lun.disk, cdb_field) {
                    start_transfer(slot, seq, u, t, (readable, writable), data, &mut self.stats, &mut self.done);
                    return;
                }
            }
        }
        let action = if cdb[0] == op::REPORT_LUNS {
            let numbers = dev.lun_numbers();
            report_luns(&numbers, cdb)
        } else if let Some(k) = found {
            let disk = &self.units[k].lun.disk;
            if matches!(cdb[0], op::UNMAP | op::WRITE_SAME_10 | op::WRITE_SAME_16) {
                // Parameter data (UNMAP's list, WRITE SAME's block), bounded.
                let n = data_out.min(8 + 16 * crate::MAX_UNMAP_DESCRIPTORS as usize).max(disk.block_size as usize);
                self.param.resize(n.min(data_out), 0);
                let got = readable.read(REQ_LEN, &mut self.param);
                self.param.truncate(got);
            } else {
                self.param.clear();
            }
            execute(disk, cdb, &self.param)
        } else {
            self.stats.bad_lun += 1;
            crate::no_such_unit(cdb)
        };
        let slot = &mut self.slots[seq as usize];
        match action {
            Action::Data(v) => {
                if v.len() > data_in {
                    self.stats.overruns += 1;
                    slot.cmd.response = response::OVERRUN;
                    return;
                }
                let n = writable.write(RESP_LEN, &v);
                slot.cmd.residual = (data_in - n).min(u32::MAX as usize) as u32;
                slot.cmd.used_len += n as u32;
            }
            Action::Check(s) => {
                slot.cmd.status = status::CHECK_CONDITION;
                slot.cmd.sense = Some(s);
            }
            Action::Read { .. } | Action::Write { .. } => {
                let Some(k) = found else { return };
                let t = match action {
                    Action::Write { lba, blocks, fua } => Transfer::Write { lba, blocks, fua },
                    Action::Read { lba, blocks } => Transfer::Read { lba, blocks },
                    _ => return,
                };
                let u = &mut self.units[k];
                start_transfer(slot, seq, u, t, (readable, writable), data, &mut self.stats, &mut self.done);
            }
            action => {
                let Some(k) = found else { return };
                let u = &mut self.units[k];
                let bs = u.lun.disk.block_size;
                // The data-out UNMAP and WRITE SAME take (the parameter
                // list, the block): the rest of their buffers is residual.
                let taken = match cdb[0] {
                    op::UNMAP => u16::from_be_bytes([cdb[7], cdb[8]]) as usize,
                    _ => bs as usize,
                };
                let unused = if data_out > 0 { data_out - taken.min(data_out) } else { data_in };
                let unused = unused.min(u32::MAX as usize) as u32;
                // Backend requests it takes: one, or one per UNMAP range.
                let needed = match &action {
                    Action::Unmap(r) => r.iter().filter(|r| r.1 > 0).count(),
                    _ => 1,
                };
                if needed == 0 {
                    slot.cmd.residual = unused;
                    return;
                }
                if needed > u.backend.room() {
                    // The unit's backend is full now: the initiator retries.
                    slot.cmd.status = TASK_SET_FULL;
                    return;
                }
                let empty = IoBufs::new();
                let mut queued = 0u32;
                let mut queue = |op: Op, offset: u64, len: u64| {
                    let req = Request { tag: seq as u64, op, offset, len, bufs: &empty };
                    if u.backend.queue(&req).is_ok() {
                        queued += 1;
                    }
                };
                match action {
                    Action::Flush => {
                        self.stats.flushes += 1;
                        queue(Op::Flush, 0, 0);
                    }
                    Action::WriteZeroes { lba, blocks } => {
                        self.stats.unmaps += 1;
                        slot.cmd.residual = unused;
                        let Some((off, len)) = offset_of(lba, blocks as u64, bs) else { return };
                        queue(Op::WriteZeroes { unmap: false }, off, len);
                    }
                    Action::Unmap(ranges) => {
                        self.stats.unmaps += 1;
                        slot.cmd.residual = unused;
                        for (lba, blocks) in ranges {
                            if let Some((off, len)) = offset_of(lba, blocks as u64, bs) {
                                if len > 0 {
                                    queue(Op::Discard, off, len);
                                }
                            }
                        }
                    }
                    // Answered above.
                    Action::Data(_) | Action::Check(_) | Action::Read { .. } | Action::Write { .. } => {}
                }
                if queued > 0 {
                    // Ranges the backend refused fail the command once the rest are done.
                    slot.cmd.failed = (queued as usize) < needed;
                    slot.cmd.pending = queued;
                    slot.cmd.stage = Stage::Running;
                    u.in_flight += 1;
                    self.done.pop();
                } else {
                    self.stats.backend_errors += 1;
                    slot.cmd.failed = true;
                }
            }
        }
    }

    /// Looks at the task-management board: marks this queue's requests a
    /// new TMF names, and reports each TMF done here once none of them is
    /// still in flight.
    fn task_management(&mut self, board: &Board) {
        self.tmf_seen = board.gen.load(Ordering::Acquire);
        let mut tmfs = board.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut waiting = false;
        let mut finished_any = false;
        for t in tmfs.tmfs.iter_mut() {
            if t.queues.get(self.index).is_none_or(|s| *s == TmfState::Done) {
                continue;
            }
            let mut matching = 0;
            for s in &mut self.slots {
                if s.cmd.stage == Stage::Free || !t.names(s.cmd.unit, s.cmd.id) {
                    continue;
                }
                if t.is_query() {
                    t.found = true;
                } else {
                    if s.cmd.aborted.is_none() {
                        s.cmd.aborted = Some(t.verdict());
                    }
                    if s.cmd.stage == Stage::Running {
                        matching += 1;
                    }
                }
            }
            t.queues[self.index] = if matching == 0 {
                finished_any = true;
                TmfState::Done
            } else {
                waiting = true;
                TmfState::Waiting
            };
        }
        self.tmf_waiting = waiting;
        if finished_any {
            tmfs.wake_control();
        }
    }
}

/// Starts a READ or WRITE the target checked (`transfer`) on unit `u`'s
/// backend: the chain's data buffers (`bufs`: readable, writable; `data`:
/// data-out and data-in bytes) are lent to it. Takes the queue's parts it
/// needs, not the queue: indexing `units` and `slots` again cost their
/// bounds checks.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn start_transfer(
    slot: &mut Slot,
    seq: u32,
    u: &mut Unit,
    t: Transfer,
    bufs: (&GuestBufs<'_>, &GuestBufs<'_>),
    data: (usize, usize),
    stats: &mut ScsiStats,
    done: &mut Vec<u32>,
) {
    let ((readable, writable), (data_out, data_in)) = (bufs, data);
    let (write, lba, blocks, fua) = match t {
        Transfer::Read { lba, blocks } => (false, lba, blocks, false),
        Transfer::Write { lba, blocks, fua } => (true, lba, blocks, fua),
        Transfer::Nothing => {
            // GOOD with no data: every data-in byte is residual.
            slot.cmd.residual = data_in.min(u32::MAX as usize) as u32;
            return;
        }
        Transfer::Check(s) => {
            slot.cmd.status = status::CHECK_CONDITION;
            slot.cmd.sense = Some(s);
            return;
        }
    };
    let counter = if write { &mut stats.writes } else { &mut stats.reads };
    *counter += 1;
    let Some((off, len)) = offset_of(lba, blocks as u64, u.lun.disk.block_size) else { return };
    // Data-out follows the request header; data-in the response.
    let (bufs, skip, avail) = if write { (readable, REQ_LEN, data_out) } else { (writable, RESP_LEN, data_in) };
    if (avail as u64) < len {
        stats.overruns += 1;
        slot.cmd.response = response::OVERRUN;
        return;
    }
    if !bufs.lend(skip, len as usize, SEG_MAX as usize + 2, usize::MAX, &mut slot.io) {
        slot.cmd.status = status::CHECK_CONDITION;
        slot.cmd.sense = Some(Sense::INVALID_FIELD_IN_CDB);
        return;
    }
    let op = if write { Op::Write } else { Op::Read };
    let req = Request { tag: seq as u64, op, offset: off, len, bufs: &slot.io };
    // A backend with no room refuses it (asking `room` first cost a
    // call a command), so a command with buffers too short or too many
    // pieces got its answer above, whatever the backend's load.
    let queued = u.backend.queue(&req);
    if queued == Err(NO_ROOM) {
        // The unit's backend is full now: the initiator retries.
        *counter -= 1;
        slot.cmd.status = TASK_SET_FULL;
        return;
    }
    slot.cmd.bytes = len;
    slot.cmd.residual = (avail as u64 - len).min(u32::MAX as u64) as u32;
    if write {
        slot.cmd.kind = Kind::Write;
        slot.cmd.then_flush = fua || !u.lun.disk.write_cache;
    } else {
        slot.cmd.kind = Kind::Read;
        slot.cmd.used_len += len as u32;
    }
    if queued.is_ok() {
        slot.cmd.pending = 1;
        slot.cmd.stage = Stage::Running;
        u.in_flight += 1;
        done.pop();
    } else {
        stats.backend_errors += 1;
        slot.cmd.failed = true;
    }
}

/// The unit whose backend runs `cmd`: at its index `k` (kept up to date
/// by `follow_units`), else found by its uid.
#[inline(always)]
fn unit_of<'a>(units: &'a mut [Unit], cmd: &Cmd) -> Option<&'a mut Unit> {
    let k = match units.get(cmd.k as usize) {
        Some(u) if u.lun.uid == cmd.uid => cmd.k as usize,
        _ => units.iter().position(|u| u.lun.uid == cmd.uid)?,
    };
    units.get_mut(k)
}

/// Completes a request that is not simply GOOD: failed, aborted, with a
/// response other than OK (OVERRUN, BAD_TARGET, FAILURE), another status
/// or sense, or no response header. Stores its response, counts it, and
/// returns the used length.
fn finish_unusual(slot: &mut Slot, stats: &mut ScsiStats) -> u32 {
    if slot.cmd.failed && slot.cmd.aborted.is_none() {
        // The backend failed: MEDIUM ERROR, nothing transferred.
        slot.cmd.status = status::CHECK_CONDITION;
        slot.cmd.sense = Some(match slot.cmd.kind {
            Kind::Read => Sense::UNRECOVERED_READ_ERROR,
            Kind::Write => Sense::WRITE_ERROR,
            Kind::Other => Sense::INTERNAL_TARGET_FAILURE,
        });
        slot.cmd.residual = slot.cmd.residual.saturating_add(slot.cmd.bytes.min(u32::MAX as u64) as u32);
    }
    if let Some(r) = slot.cmd.aborted {
        slot.cmd.response = r;
        stats.aborted += 1;
    }
    if slot.cmd.response == response::OK && slot.cmd.status == status::GOOD {
        match slot.cmd.kind {
            Kind::Read => stats.bytes_read += slot.cmd.bytes,
            Kind::Write => stats.bytes_written += slot.cmd.bytes,
            Kind::Other => {}
        }
    }
    if slot.cmd.status == status::CHECK_CONDITION {
        stats.check_conditions += 1;
    }
    if slot.cmd.used_len == 0 {
        0
    } else {
        write_response(slot)
    }
}

/// Writes a finished request's response header; returns the used length.
/// Only the header's first 12 bytes and the sense data are stored: the
/// driver reads no more (sense_len says how much sense there is).
fn write_response(slot: &mut Slot) -> u32 {
    // The response's layout (`wire::CmdResp`): sense_len, residual,
    // status_qualifier, status, response, then sense (at most 18 bytes here).
    if slot.cmd.response != response::OK {
        // A transport failure or abort: the command did not run as asked.
        slot.cmd.status = status::GOOD;
        slot.cmd.used_len = RESP_LEN as u32;
    }
    // sense_len and residual; status_qualifier (0), status and response.
    let first = (slot.cmd.residual as u64) << 32;
    let second = (slot.cmd.status as u32) << 16 | (slot.cmd.response as u32) << 24;
    match slot.cmd.sense {
        Some(s) if slot.cmd.response == response::OK => {
            let mut b = [0u8; 12 + 18];
            let sense_len = s.write(slot.cmd.descriptor_sense, &mut b[12..]);
            b[..8].copy_from_slice(&(first | sense_len as u64).to_le_bytes());
            b[8..12].copy_from_slice(&second.to_le_bytes());
            slot.io.write_reply(&b[..12 + sense_len]);
        }
        // No sense (aborted, OVERRUN, TASK SET FULL, ...): two word stores.
        _ => {
            slot.io.write_reply_head(first, second);
        }
    }
    if slot.cmd.status != status::GOOD {
        // Data-in was not (all) delivered.
        slot.cmd.used_len = RESP_LEN as u32;
    }
    slot.cmd.used_len
}
