//! virtio-scsi as a vhostd device (virtio 1.2, section 5.6): one target
//! with units, [`ScsiDevice`] as a whole (implements [`Device`]), a
//! [`ReqGroup`] per request queue and a [`CtrlGroup`] for the control and
//! event queues.
//!
//! Virtqueue 0 is the control queue, 1 the event queue, 2.. the request
//! queues. Task management crosses groups through the [`Board`]: the
//! control group posts a TMF there and wakes the request queues' workers;
//! each marks its requests the TMF names (answered ABORTED or RESET when
//! they finish: a request the kernel runs cannot be taken back) and says
//! when none of them is in flight; the control group then answers.

use std::collections::VecDeque;
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vhostd_block_backends::{BlockBackend, DiskInfo};
use vhostd_device::{
    tsc, value_of, Built, Counter, Counters, Device, InflightLog, Metric, Pass, QueueGroup, Ring, RingPlace,
    RingTotals, Sleep, Waker,
};
use virtq::ring::features as ring;
use virtq::{Access, IoBufs, QueueStats};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::queue::{ScsiQueue, MAX_TRANSFER, SEG_MAX};
use crate::wire::{self, event, features, response, tmf, CtrlReq, CDB_SIZE, CONFIG_LEN, SENSE_SIZE};
use crate::{naa_bits, parse_virtio_lun, Disk};

/// Requests in flight per request queue, at most (all units together).
pub const DEPTH: usize = 256;
/// The highest LUN number the target may have (single-level flat space).
pub const MAX_LUN: u16 = 16383;

/// A logical unit of the target: its number, what the initiator sees, and
/// the backends not yet taken by a request queue (one per queue).
pub struct Lun {
    pub number: u16,
    pub disk: Disk,
    /// Unique for the life of the process (a number can be reused).
    pub(crate) uid: u64,
    backends: Mutex<Vec<Option<Box<dyn BlockBackend>>>>,
}

impl Lun {
    /// Unit `number` of device `device` over a disk shaped `info`, with one
    /// backend per request queue. Its identifiers (VPD 0x80 and 0x83) come
    /// from the device's name and the number, so they stay the same across
    /// restarts.
    pub fn new(device: &str, number: u16, info: DiskInfo, backends: Vec<Box<dyn BlockBackend>>) -> Lun {
        let block_size = info.block_size.max(512);
        let name = format!("{device}:{number}");
        let disk = Disk {
            blocks: info.capacity / block_size as u64,
            block_size,
            read_only: info.read_only,
            discard: info.discard && !info.read_only,
            write_cache: true,
            serial: format!("{device}-{number}"),
            naa: naa_bits(&name),
            descriptor_sense: false,
            max_transfer_blocks: MAX_TRANSFER / block_size,
        };
        static UIDS: AtomicU64 = AtomicU64::new(1);
        let uid = UIDS.fetch_add(1, Ordering::Relaxed);
        Lun { number, disk, uid, backends: Mutex::new(backends.into_iter().map(Some).collect()) }
    }

    /// Request queue `queue`'s backend, once.
    pub(crate) fn take_backend(&self, queue: usize) -> Option<Box<dyn BlockBackend>> {
        self.backends.lock().unwrap_or_else(|e| e.into_inner()).get_mut(queue)?.take()
    }
}

/// Where a TMF stands on one request queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TmfState {
    /// Not looked at yet.
    New,
    /// Requests it names are still in flight here.
    Waiting,
    /// None is.
    Done,
}

/// A task management function posted to the request queues.
pub(crate) struct Tmf {
    key: u64,
    subtype: u32,
    unit: u16,
    id: u64,
    pub(crate) queues: Vec<TmfState>,
    /// QUERY TASK / QUERY TASK SET: a named request was in flight.
    pub(crate) found: bool,
}

impl Tmf {
    /// Whether the request of `unit` with tag `id` is one this TMF names.
    pub(crate) fn names(&self, unit: u16, id: u64) -> bool {
        match self.subtype {
            tmf::ABORT_TASK | tmf::QUERY_TASK => unit == self.unit && id == self.id,
            tmf::I_T_NEXUS_RESET => true,
            _ => unit == self.unit,
        }
    }

    pub(crate) fn is_query(&self) -> bool {
        matches!(self.subtype, tmf::QUERY_TASK | tmf::QUERY_TASK_SET)
    }

    /// What the requests it names are answered.
    pub(crate) fn verdict(&self) -> u8 {
        match self.subtype {
            tmf::LOGICAL_UNIT_RESET | tmf::I_T_NEXUS_RESET => response::RESET,
            _ => response::ABORTED,
        }
    }
}

/// Task management in progress, shared by the device's groups.
pub struct Board {
    /// Bumped when a TMF is posted: request queues look at the board only
    /// when it moved (one load per pass otherwise).
    pub(crate) gen: AtomicU64,
    pub(crate) inner: Mutex<BoardInner>,
}

pub(crate) struct BoardInner {
    pub(crate) tmfs: Vec<Tmf>,
    next_key: u64,
    /// The workers of the request queues (by index) and of the control group.
    queue_wakers: Vec<Option<Waker>>,
    control_waker: Option<Waker>,
}

impl BoardInner {
    pub(crate) fn wake_control(&self) {
        if let Some(w) = &self.control_waker {
            w.wake();
        }
    }
}

/// Events for the event queue, and whether one was lost.
struct Events {
    queue: VecDeque<[u8; 16]>,
    missed: bool,
}

/// The device as a whole: its units, the board, pending events.
pub struct ScsiDevice {
    name: String,
    queues: u16,
    pub max_queue_size: u16,
    /// The units, in number order. Request queues follow it through
    /// `units_gen`.
    pub(crate) units: Mutex<Vec<Arc<Lun>>>,
    pub(crate) units_gen: AtomicU64,
    pub(crate) board: Board,
    events: Mutex<Events>,
    /// `events` has something to deliver (an event, or the missed flag):
    /// set and cleared under its lock, read without it, so the control
    /// group's every pass takes no lock while there is nothing.
    events_due: AtomicBool,
    /// One eventfd per request queue (made by `build`), which every unit's
    /// backend for that queue signals when it has completions.
    wakes: Vec<Arc<EventFd>>,
    /// The features the driver acked (HOTPLUG decides events).
    acked: AtomicU64,
}

impl ScsiDevice {
    /// A device named `name` (its units' identifiers derive from it) with
    /// `queues` request queues.
    pub fn new(name: &str, queues: u16, max_queue_size: u16) -> ScsiDevice {
        ScsiDevice {
            name: name.to_string(),
            queues,
            max_queue_size,
            units: Mutex::new(Vec::new()),
            units_gen: AtomicU64::new(1),
            board: Board {
                gen: AtomicU64::new(0),
                inner: Mutex::new(BoardInner {
                    tmfs: Vec::new(),
                    next_key: 1,
                    queue_wakers: (0..queues).map(|_| None).collect(),
                    control_waker: None,
                }),
            },
            events: Mutex::new(Events { queue: VecDeque::new(), missed: false }),
            events_due: AtomicBool::new(false),
            wakes: Vec::new(),
            acked: AtomicU64::new(0),
        }
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Request queues (each unit has a backend per queue).
    pub fn request_queues(&self) -> u16 {
        self.queues
    }

    /// The units' numbers, ascending (REPORT LUNS).
    pub fn lun_numbers(&self) -> Vec<u16> {
        self.units.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|l| l.number).collect()
    }

    /// Adds a unit (at start-up, or hot-added): the request queues take
    /// their backends on their next pass, and a driver that negotiated
    /// HOTPLUG hears of it. Fails if the number is in use or too high.
    pub fn add_lun(&self, lun: Lun) -> Result<(), String> {
        let n = lun.number;
        if n > MAX_LUN {
            return Err(format!("LUN {n} is above the highest, {MAX_LUN}"));
        }
        {
            let mut units = self.units.lock().unwrap_or_else(|e| e.into_inner());
            if units.iter().any(|l| l.number == n) {
                return Err(format!("LUN {n} is already in use"));
            }
            self.route_completions(&lun);
            units.push(Arc::new(lun));
            units.sort_by_key(|l| l.number);
        }
        self.units_changed(n, event::RESCAN);
        Ok(())
    }

    /// Has each of `lun`'s backends signal its request queue's eventfd.
    /// Done here, as the unit is added (io_uring_register is a system call
    /// the sandbox allows only where devices are built), not on a worker.
    fn route_completions(&self, lun: &Lun) {
        let mut backends = lun.backends.lock().unwrap_or_else(|e| e.into_inner());
        for (b, wake) in backends.iter_mut().zip(&self.wakes) {
            if let Some(b) = b {
                if b.completion_fd().is_some() && !b.signal_completions_to(wake.as_raw_fd()) {
                    tracing::warn!(unit = lun.number, "a backend cannot signal its queue: its requests are polled for");
                }
            }
        }
    }

    /// Removes unit `n`: new commands to it are refused at once, those in
    /// flight finish. False if there is no such unit.
    pub fn remove_lun(&self, n: u16) -> bool {
        {
            let mut units = self.units.lock().unwrap_or_else(|e| e.into_inner());
            let before = units.len();
            units.retain(|l| l.number != n);
            if units.len() == before {
                return false;
            }
        }
        self.units_changed(n, event::REMOVED);
        true
    }

    fn units_changed(&self, n: u16, reason: u32) {
        self.units_gen.fetch_add(1, Ordering::AcqRel);
        let board = self.board.inner.lock().unwrap_or_else(|e| e.into_inner());
        for w in board.queue_wakers.iter().flatten() {
            w.wake();
        }
        if self.acked.load(Ordering::Acquire) & features::HOTPLUG != 0 {
            let mut ev = self.events.lock().unwrap_or_else(|e| e.into_inner());
            ev.queue.push_back(wire::event_bytes(event::TRANSPORT_RESET, wire::lun_field(n), reason));
            self.events_due.store(true, Ordering::Release);
            board.wake_control();
        }
    }

    /// The config space.
    pub fn config(&self) -> [u8; CONFIG_LEN] {
        wire::Config {
            num_queues: self.queues as u32,
            seg_max: SEG_MAX,
            max_sectors: MAX_TRANSFER / 512,
            cmd_per_lun: (DEPTH / 2) as u32,
            max_lun: MAX_LUN as u32,
        }
        .bytes()
    }
}

/// The device with `queues` request queues; its units are added with
/// [`ScsiDevice::add_lun`] (before or after it is served).
pub fn build(mut dev: ScsiDevice) -> std::io::Result<(Arc<ScsiDevice>, Built)> {
    dev.wakes = (0..dev.queues).map(|_| EventFd::new(EFD_NONBLOCK).map(Arc::new)).collect::<Result<_, _>>()?;
    for lun in dev.units.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        dev.route_completions(lun);
    }
    let dev = Arc::new(dev);
    let mut groups: Vec<Box<dyn QueueGroup>> = vec![Box::new(CtrlGroup::new(dev.clone()))];
    for i in 0..dev.queues {
        groups.push(Box::new(ReqGroup {
            index: i,
            queue: ScsiQueue::new(i as usize, DEPTH, dev.wakes[i as usize].clone()),
            dev: dev.clone(),
            stopping: false,
        }));
    }
    Ok((dev.clone(), Built { device: dev, groups }))
}

impl Device for ScsiDevice {
    fn kind(&self) -> &'static str {
        "scsi"
    }

    /// No IN_ORDER: commands complete in any order. CHANGE (parameter
    /// change events) is offered because QEMU's vhost-user-scsi acks it
    /// whatever the backend offers; this device sends none.
    fn features(&self) -> u64 {
        ring::VERSION_1
            | ring::EVENT_IDX
            | ring::INDIRECT_DESC
            | ring::RING_PACKED
            | features::HOTPLUG
            | features::CHANGE
    }

    fn queues(&self) -> u16 {
        2 + self.queues
    }

    fn max_queue_size(&self) -> u16 {
        self.max_queue_size
    }

    fn place(&self, index: u16, _features: u64) -> Option<RingPlace> {
        match index {
            0 | 1 => Some(RingPlace { group: 0, slot: index as usize }),
            i if i - 2 < self.queues => Some(RingPlace { group: (i - 1) as usize, slot: 0 }),
            _ => None,
        }
    }

    fn read_config(&self, offset: u32, len: u32) -> Option<Vec<u8>> {
        let bytes = self.config();
        let (off, len) = (offset as usize, len as usize);
        if len > 4096 {
            return None;
        }
        off.checked_add(len)?;
        let mut out = vec![0u8; len];
        if off < bytes.len() {
            let n = (off + len).min(bytes.len()) - off;
            out[..n].copy_from_slice(&bytes[off..off + n]);
        }
        Some(out)
    }

    /// The driver may write sense_size and cdb_size; this device keeps
    /// the sizes it offers, so only those values are taken.
    fn write_config(&self, offset: u32, data: &[u8], _features: u64) -> bool {
        let Ok(v) = <[u8; 4]>::try_from(data) else { return false };
        let v = u32::from_le_bytes(v);
        matches!((offset, v), (20, v) if v == SENSE_SIZE as u32)
            || matches!((offset, v), (24, v) if v == CDB_SIZE as u32)
    }

    fn set_features(&self, features: u64) {
        self.acked.store(features, Ordering::Release);
    }

    fn reset(&self) {
        self.acked.store(0, Ordering::Release);
        let mut ev = self.events.lock().unwrap_or_else(|e| e.into_inner());
        ev.queue.clear();
        ev.missed = false;
        self.events_due.store(false, Ordering::Release);
    }

    fn tracks_inflight(&self) -> bool {
        true
    }

    fn describe_features(&self, features: u64) -> String {
        if features & features::HOTPLUG != 0 {
            "hotplug".into()
        } else {
            String::new()
        }
    }

    fn ring_label(&self, place: RingPlace) -> (u16, Option<&'static str>) {
        match (place.group, place.slot) {
            (0, 0) => (0, Some("ctrl")),
            (0, _) => (1, Some("event")),
            (g, _) => (g as u16 + 1, Some("req")),
        }
    }

    fn totals(&self, rings: &[RingTotals<'_>]) -> Vec<(&'static str, String)> {
        let sum = |k: &str| rings.iter().map(|r| value_of(r.counters, k)).sum::<u64>();
        let bad: u64 = rings.iter().map(|r| r.bad_chains).sum();
        let cycles: u64 = rings.iter().map(|r| r.busy_cycles).sum();
        let ios = sum("reads") + sum("writes");
        let per_io = if ios > 0 { cycles as f64 / ios as f64 } else { 0.0 };
        vec![
            ("luns", self.lun_numbers().len().to_string()),
            ("commands", sum("commands").to_string()),
            ("reads", sum("reads").to_string()),
            ("writes", sum("writes").to_string()),
            ("bytes_read", sum("bytes_read").to_string()),
            ("bytes_written", sum("bytes_written").to_string()),
            ("check_conditions", sum("check_conditions").to_string()),
            ("errors", (sum("backend_errors") + sum("no_response") + bad).to_string()),
            ("tmfs", sum("tmfs").to_string()),
            ("busy_cycles", cycles.to_string()),
            ("cycles_per_io", format!("{per_io:.1}")),
        ]
    }
}

/// One request queue.
pub struct ReqGroup {
    index: u16,
    queue: ScsiQueue,
    dev: Arc<ScsiDevice>,
    stopping: bool,
}

const COMMANDS: Metric = Metric::counter("vhostd_scsi_commands_total", "SCSI commands, by kind.");
const BYTES: Metric = Metric::counter("vhostd_scsi_bytes_total", "Bytes read and written for the guest.");
const ERRORS: Metric =
    Metric::counter("vhostd_scsi_errors_total", "Commands answered with an error, or not at all, by reason.");

impl QueueGroup for ReqGroup {
    fn ring_slots(&self) -> usize {
        1
    }

    fn attach(&mut self, _slot: usize, ring: &mut Ring, _features: u64, inflight: Option<InflightLog>) {
        self.stopping = false;
        self.queue.follow_units(&self.dev);
        if let Some(log) = inflight {
            let n = self.queue.attach_inflight(log, &mut ring.queue, &mut ring.batch, &self.dev);
            if n > 0 {
                tracing::info!(queue = self.index, "resubmitted {n} command(s) left in flight by a previous backend");
            }
            ring.notify();
        }
    }

    fn stop(&mut self, _slot: usize, ring: &mut Ring) -> bool {
        self.stopping = true;
        if self.queue.finish(&mut ring.queue, &self.dev) > 0 {
            ring.notify();
        }
        self.queue.in_flight() == 0
    }

    fn detach(&mut self, _slot: usize, ring: &mut Ring) {
        self.queue.drain(&mut ring.queue);
        self.queue.detach_inflight();
        self.stopping = false;
    }

    fn poll(&mut self, rings: &mut [Option<Ring>]) -> Pass {
        self.queue.follow_units(&self.dev);
        let Some(Some(ring)) = rings.first_mut() else {
            self.queue.idle_task_management(&self.dev);
            return Pass::default();
        };
        let t0 = tsc();
        let n = if self.stopping {
            self.queue.finish(&mut ring.queue, &self.dev)
        } else {
            self.queue.process(&mut ring.queue, &mut ring.batch, &self.dev)
        };
        if n > 0 {
            ring.notify();
            ring.counters.busy_cycles += tsc() - t0;
            return Pass::did(n);
        }
        Pass { yields: self.queue.in_flight() > 0 && self.queue.completes_elsewhere(), ..Pass::default() }
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.queue.event_fd())
    }

    fn prepare_sleep(&mut self, rings: &mut [Option<Ring>]) -> Sleep {
        let mut work = self.queue.in_flight() > 0 && !self.queue.completes_elsewhere();
        if let (Some(Some(ring)), false) = (rings.first_mut(), self.stopping) {
            work |= ring.queue.enable_notifications();
        }
        Sleep { work, watch_event_fd: true }
    }

    fn on_event(&mut self) {
        self.queue.ack_completion_events();
    }

    fn placed(&mut self, waker: &Waker) {
        let mut board = self.dev.board.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = board.queue_wakers.get_mut(self.index as usize) {
            *w = waker.try_clone().ok();
        }
    }

    fn counters(&self, queues: &[QueueStats]) -> Counters {
        let s = &self.queue.stats;
        let bad = queues.first().map_or(0, |q| q.bad_chains);
        let ring = vec![
            Counter::new("commands", s.commands, COMMANDS.with("kind", "all")),
            Counter::new("reads", s.reads, COMMANDS.with("kind", "read")),
            Counter::new("writes", s.writes, COMMANDS.with("kind", "write")),
            Counter::new("flushes", s.flushes, COMMANDS.with("kind", "flush")),
            Counter::new("unmaps", s.unmaps, COMMANDS.with("kind", "unmap")),
            Counter::new("bytes_read", s.bytes_read, BYTES.with("dir", "read")),
            Counter::new("bytes_written", s.bytes_written, BYTES.with("dir", "write")),
            Counter::new("check_conditions", s.check_conditions, ERRORS.with("reason", "check_condition")),
            Counter::new("bad_lun", s.bad_lun, ERRORS.with("reason", "bad_lun")),
            Counter::new("overruns", s.overruns, ERRORS.with("reason", "overrun")),
            Counter::new("no_response", s.no_response, ERRORS.with("reason", "no_response")),
            Counter::new("backend_errors", s.backend_errors, ERRORS.with("reason", "backend")),
            Counter::new("aborted", s.aborted, ERRORS.with("reason", "aborted")),
            Counter::new("errors.bad_chain", bad, ERRORS.with("reason", "bad_chain")),
            Counter::new(
                "batches",
                s.batches,
                Metric::counter("vhostd_queue_batches_total", "Batches that moved at least one frame or request."),
            ),
            Counter::new(
                "max_in_flight",
                s.max_in_flight,
                Metric::gauge("vhostd_scsi_max_in_flight", "Most commands in flight at once."),
            ),
        ];
        let b = self.queue.backend_stats();
        let group = vec![
            Counter::plain("submit_calls", b.submit_calls),
            Counter::new(
                "mapped_copies",
                b.mapped,
                Metric::counter(
                    "vhostd_scsi_mapped_copies_total",
                    "Reads and writes copied through a mapping of the image, with no system call.",
                ),
            ),
        ];
        Counters { rings: vec![ring], group }
    }
}

/// A TMF the control group waits on: its chain and the response byte.
struct PendingTmf {
    key: u64,
    head: u16,
    io: IoBufs,
}

/// The control queue (slot 0) and the event queue (slot 1).
pub struct CtrlGroup {
    dev: Arc<ScsiDevice>,
    pending: Vec<PendingTmf>,
    tmfs: u64,
    an: u64,
    bad_requests: u64,
    events_sent: u64,
    events_missed: u64,
}

impl CtrlGroup {
    fn new(dev: Arc<ScsiDevice>) -> CtrlGroup {
        CtrlGroup { dev, pending: Vec::new(), tmfs: 0, an: 0, bad_requests: 0, events_sent: 0, events_missed: 0 }
    }

    /// Pops control requests: AN answered at once, TMFs posted to the board.
    fn control(&mut self, ring: &mut Ring) -> usize {
        let q = &mut ring.queue;
        let batch = &mut ring.batch;
        let bad_before = q.stats().bad_chains;
        let n = q.pop_batch(batch, 32, Access::ReadThenWrite);
        // Chains the ring rejected already have their used entry.
        let mut done = (q.stats().bad_chains - bad_before) as usize;
        for chain in &batch.chains {
            let (readable, writable) = (batch.readable(chain), batch.writable(chain));
            let mut b = [0u8; wire::TMF_REQ_LEN];
            let got = readable.read(0, &mut b);
            match CtrlReq::parse(&b[..got]) {
                Some(CtrlReq::Tmf { subtype, lun, id }) => {
                    self.tmfs += 1;
                    let mut io = IoBufs::new();
                    if !writable.lend_front(wire::TMF_RESP_LEN, &mut io) {
                        self.bad_requests += 1;
                        q.add_used_id(chain.head, 0);
                        done += 1;
                        continue;
                    }
                    match self.post(subtype, &lun, id) {
                        Ok(key) => self.pending.push(PendingTmf { key, head: chain.head, io }),
                        Err(r) => {
                            io.write_reply(&[r]);
                            q.add_used_id(chain.head, 1);
                            done += 1;
                        }
                    }
                }
                Some(CtrlReq::An { lun, .. }) => {
                    // No asynchronous notification classes are supported:
                    // event_actual 0 (virtio 1.2, 5.6.6.2).
                    self.an += 1;
                    let r = match parse_virtio_lun(&lun) {
                        Some((0, _)) => response::OK,
                        _ => response::BAD_TARGET,
                    };
                    let w = writable.write(0, &wire::an_resp(0, r));
                    q.add_used_id(chain.head, w as u32);
                    done += 1;
                }
                None => {
                    self.bad_requests += 1;
                    q.add_used_id(chain.head, 0);
                    done += 1;
                }
            }
        }
        if done > 0 {
            q.publish_used();
        }
        n + done
    }

    /// Posts a TMF to the board; Err(response) when it is answered at once.
    fn post(&mut self, subtype: u32, lun: &[u8; 8], id: u64) -> Result<u64, u8> {
        let unit = match parse_virtio_lun(lun) {
            Some((0, unit)) => unit,
            _ => return Err(response::BAD_TARGET),
        };
        match subtype {
            tmf::ABORT_TASK
            | tmf::ABORT_TASK_SET
            | tmf::CLEAR_TASK_SET
            | tmf::LOGICAL_UNIT_RESET
            | tmf::QUERY_TASK
            | tmf::QUERY_TASK_SET => {
                if !self.dev.lun_numbers().contains(&unit) {
                    return Err(response::INCORRECT_LUN);
                }
            }
            tmf::I_T_NEXUS_RESET => {}
            // No ACA here; unknown functions are rejected.
            _ => return Err(response::FUNCTION_REJECTED),
        }
        let mut board = self.dev.board.inner.lock().unwrap_or_else(|e| e.into_inner());
        let key = board.next_key;
        board.next_key += 1;
        board.tmfs.push(Tmf {
            key,
            subtype,
            unit,
            id,
            queues: vec![TmfState::New; self.dev.queues as usize],
            found: false,
        });
        self.dev.board.gen.fetch_add(1, Ordering::AcqRel);
        for w in board.queue_wakers.iter().flatten() {
            w.wake();
        }
        Ok(key)
    }

    /// Answers the TMFs every request queue is done with.
    fn answer(&mut self, ring: &mut Ring) -> usize {
        if self.pending.is_empty() {
            return 0;
        }
        let mut board = self.dev.board.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut n = 0;
        let mut k = 0;
        while k < self.pending.len() {
            let key = self.pending[k].key;
            let Some(i) = board.tmfs.iter().position(|t| t.key == key) else {
                k += 1;
                continue;
            };
            if board.tmfs[i].queues.iter().any(|s| *s != TmfState::Done) {
                k += 1;
                continue;
            }
            let t = board.tmfs.remove(i);
            let r = if t.is_query() && t.found { response::FUNCTION_SUCCEEDED } else { response::FUNCTION_COMPLETE };
            let p = self.pending.swap_remove(k);
            p.io.write_reply(&[r]);
            ring.queue.add_used_id(p.head, 1);
            n += 1;
        }
        drop(board);
        if n > 0 {
            ring.queue.publish_used();
        }
        n
    }

    /// Delivers pending events into the event queue's buffers; with none
    /// posted, drops them and flags the next event EVENTS_MISSED.
    fn events(&mut self, ring: Option<&mut Ring>) -> usize {
        if !self.dev.events_due.load(Ordering::Acquire) {
            return 0;
        }
        let dev = self.dev.clone();
        let mut ev = dev.events.lock().unwrap_or_else(|e| e.into_inner());
        let n = self.deliver(&mut ev, ring);
        dev.events_due.store(!ev.queue.is_empty() || ev.missed, Ordering::Release);
        n
    }

    fn deliver(&mut self, ev: &mut Events, ring: Option<&mut Ring>) -> usize {
        let Some(ring) = ring else {
            if !ev.queue.is_empty() {
                self.events_missed += ev.queue.len() as u64;
                ev.queue.clear();
                ev.missed = true;
            }
            return 0;
        };
        if ev.queue.is_empty() && !ev.missed {
            return 0;
        }
        let mut n = 0;
        let bad_before = ring.queue.stats().bad_chains;
        loop {
            let due = ev.queue.front().copied().or_else(|| {
                // Only the loss to report: an empty event carries the flag.
                ev.missed.then(|| wire::event_bytes(event::NO_EVENT, [0; 8], 0))
            });
            let Some(mut bytes) = due else { break };
            let q = &mut ring.queue;
            if q.pop_batch(&mut ring.batch, 1, Access::WriteOnly) == 0 {
                if !ev.queue.is_empty() {
                    self.events_missed += ev.queue.len() as u64;
                    ev.queue.clear();
                    ev.missed = true;
                }
                break;
            }
            if ev.missed {
                let e = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) | event::EVENTS_MISSED;
                bytes[0..4].copy_from_slice(&e.to_le_bytes());
            }
            let chain = ring.batch.chains[0];
            let w = ring.batch.writable(&chain).write(0, &bytes);
            q.add_used_id(chain.head, w as u32);
            ev.queue.pop_front();
            ev.missed = false;
            self.events_sent += 1;
            n += 1;
        }
        // Chains the ring rejected (not write-only) have their used entry too.
        let rejected = (ring.queue.stats().bad_chains - bad_before) as usize;
        if n + rejected > 0 {
            ring.queue.publish_used();
        }
        n + rejected
    }
}

impl QueueGroup for CtrlGroup {
    fn ring_slots(&self) -> usize {
        2
    }

    fn attach(&mut self, _slot: usize, _ring: &mut Ring, _features: u64, _inflight: Option<InflightLog>) {}

    fn detach(&mut self, slot: usize, _ring: &mut Ring) {
        if slot == 0 {
            // The TMFs' chains go with the ring; the queues forget them.
            let keys: Vec<u64> = self.pending.drain(..).map(|p| p.key).collect();
            let mut board = self.dev.board.inner.lock().unwrap_or_else(|e| e.into_inner());
            board.tmfs.retain(|t| !keys.contains(&t.key));
        }
    }

    fn poll(&mut self, rings: &mut [Option<Ring>]) -> Pass {
        let mut work = 0;
        if let Some(Some(ring)) = rings.get_mut(0) {
            // Nearly every pass finds nothing here, and the worker makes
            // one between any two of the request queue's: look before
            // reading the TSC (an rdtsc is tens of cycles).
            if !self.pending.is_empty() || ring.queue.available(1) > 0 {
                let t0 = tsc();
                let n = self.control(ring) + self.answer(ring);
                if n > 0 {
                    ring.notify();
                    ring.counters.busy_cycles += tsc() - t0;
                }
                work += n;
            }
        }
        let ev_ring = rings.get_mut(1).and_then(|r| r.as_mut());
        let n = self.events(ev_ring);
        if n > 0 {
            if let Some(Some(ring)) = rings.get_mut(1) {
                ring.notify();
            }
        }
        Pass::did(work + n)
    }

    /// The event queue's kicks matter only while an event waits for a
    /// buffer; the control queue's always.
    fn prepare_sleep(&mut self, rings: &mut [Option<Ring>]) -> Sleep {
        let mut work = false;
        if let Some(Some(r)) = rings.get_mut(0) {
            work |= r.queue.enable_notifications();
        }
        if let Some(Some(r)) = rings.get_mut(1) {
            work |= r.queue.enable_notifications() && {
                let ev = self.dev.events.lock().unwrap_or_else(|e| e.into_inner());
                !ev.queue.is_empty() || ev.missed
            };
        }
        Sleep { work, watch_event_fd: false }
    }

    fn placed(&mut self, waker: &Waker) {
        let mut board = self.dev.board.inner.lock().unwrap_or_else(|e| e.into_inner());
        board.control_waker = waker.try_clone().ok();
    }

    fn counters(&self, _queues: &[QueueStats]) -> Counters {
        let ctrl = vec![
            Counter::new("tmfs", self.tmfs, Metric::counter("vhostd_scsi_tmf_total", "Task management functions.")),
            Counter::plain("an", self.an),
            Counter::plain("bad_requests", self.bad_requests),
        ];
        let ev = vec![
            Counter::plain("events", self.events_sent),
            Counter::new(
                "events_missed",
                self.events_missed,
                Metric::counter("vhostd_scsi_events_missed_total", "Events lost for want of an event buffer."),
            ),
        ];
        Counters { rings: vec![ctrl, ev], group: Vec::new() }
    }
}
