//! Dataplane workers. A worker runs queue groups of any number of devices
//! (it only knows the `QueueGroup` trait), each group owning its rings
//! outright (no lock in the hot path). Control threads add and take away
//! groups (a device added, removed or moved to another worker) and hand
//! rings over and take them back through a command channel; a wake eventfd
//! interrupts the worker's sleep.
//! What the worker itself decides: how it waits (modes, backoff, sleeping on
//! every kick and group descriptor at once), and what it counts and reports
//! of any ring (kicks, broken rings, malformed chains).

use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use vhostd_device::{Counters, InflightLog, Pass, QueueGroup, Ring, RingCounters, Waker};
use virtq::{Batch, Queue, QueueStats};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// A ring handed back by a worker: its state, kick and call eventfds.
pub type Returned = (Queue, Option<EventFd>, Option<EventFd>);

/// What a ring needs to start on a worker.
pub struct Start {
    /// The queue.
    pub queue: Queue,
    /// Kick descriptor (None: the driver does not kick; the ring is polled).
    pub kick: Option<EventFd>,
    /// Call descriptor (None: the driver does not want interrupts).
    pub call: Option<EventFd>,
    /// Error descriptor, signalled when the ring breaks.
    pub err: Option<EventFd>,
    /// Negotiated features.
    pub features: u64,
    /// The transport's log of requests in flight on this ring.
    pub inflight: Option<InflightLog>,
}

/// A queue group's name on a worker: its device (a daemon-wide number) and
/// its index among that device's groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupKey {
    /// The device's number (`Pool::new_device`).
    pub device: u64,
    /// The group's index among its device's groups.
    pub group: usize,
}

/// What a control thread asks of a worker. Every command is answered on
/// its reply channel, so the caller knows the worker has acted.
enum Cmd {
    /// Run a new group (no ring attached yet).
    Add { key: GroupKey, group: Box<dyn QueueGroup>, run: Arc<RunState>, reply: Sender<()> },
    /// Stop running a group and give it back with its rings (to move it, or
    /// to drop it with its device).
    Take { key: GroupKey, reply: Sender<Option<Unit>> },
    /// Run a group another worker gave back, rings and all.
    Put { unit: Unit, reply: Sender<()> },
    /// Start processing ring `slot` of a group.
    Attach { key: GroupKey, slot: usize, start: Box<Start>, reply: Sender<()> },
    /// Stop processing a ring and give it back.
    Detach { key: GroupKey, slot: usize, reply: Sender<Option<Returned>> },
    /// Give a running ring another call descriptor; replies whether the
    /// ring was there.
    SetCall { key: GroupKey, slot: usize, call: Option<EventFd>, reply: Sender<bool> },
    /// Report counters.
    Stats { reply: Sender<WorkerReport> },
}

/// Counters of one ring slot (accumulated over attachments).
#[derive(Clone, Copy, Debug, Default)]
pub struct RingReport {
    /// Chain validation counters.
    pub queue: QueueStats,
    /// Kicks, interrupts, busy cycles.
    pub ring: RingCounters,
}

/// Counters of one queue group.
#[derive(Clone, Debug, Default)]
pub struct GroupReport {
    /// The group's device number.
    pub device: u64,
    /// The group's index among its device's groups.
    pub group: usize,
    /// Per ring slot.
    pub rings: Vec<RingReport>,
    /// The device's own counters of the group.
    pub counters: Counters,
}

/// Counters of a worker.
#[derive(Clone, Debug, Default)]
pub struct WorkerReport {
    /// The worker's index.
    pub worker: usize,
    /// Its groups.
    pub groups: Vec<GroupReport>,
    /// Loop iterations that moved nothing.
    pub idle_iters: u64,
    /// Loop iterations that moved something.
    pub busy_iters: u64,
    /// Times the worker slept on its epoll set.
    pub sleeps: u64,
}

/// Shared between a device's session and the workers running its groups.
#[derive(Default)]
pub struct RunState {
    /// The device's name (log lines of a worker running many devices).
    pub name: String,
    /// Set when a ring broke: the device reports NEEDS_RESET.
    pub needs_reset: AtomicBool,
}

/// The control thread's handle on a worker.
pub struct WorkerHandle {
    tx: Sender<Cmd>,
    wake: EventFd,
    pending: Arc<AtomicBool>,
    /// See `rest`.
    rest: Arc<AtomicU64>,
    thread: std::sync::Mutex<Option<JoinHandle<WorkerReport>>>,
}

impl WorkerHandle {
    fn send(&self, cmd: Cmd) {
        // A send fails only if the worker is gone, which happens only at shutdown.
        let _ = self.tx.send(cmd);
        self.pending.store(true, Ordering::Release);
        let _ = self.wake.write(1);
    }

    /// Gives the worker a new group to run and waits until it has it.
    pub fn add(&self, key: GroupKey, group: Box<dyn QueueGroup>, run: Arc<RunState>) {
        let (reply, rx) = channel();
        self.send(Cmd::Add { key, group, run, reply });
        let _ = rx.recv();
    }

    /// Takes a group away, with its rings still attached (None: not here).
    pub fn take(&self, key: GroupKey) -> Option<Unit> {
        let (reply, rx) = channel();
        self.send(Cmd::Take { key, reply });
        rx.recv().ok().flatten()
    }

    /// Runs a group taken from another worker.
    pub fn put(&self, unit: Unit) {
        let (reply, rx) = channel();
        self.send(Cmd::Put { unit, reply });
        let _ = rx.recv();
    }

    /// Hands ring `slot` of a group to the worker and waits until it runs.
    pub fn attach(&self, key: GroupKey, slot: usize, start: Start) {
        let (reply, rx) = channel();
        self.send(Cmd::Attach { key, slot, start: Box::new(start), reply });
        let _ = rx.recv();
    }

    /// Takes a ring back (with its kick and call eventfds), once nothing of
    /// it is in flight.
    pub fn detach(&self, key: GroupKey, slot: usize) -> Option<Returned> {
        let (reply, rx) = channel();
        self.send(Cmd::Detach { key, slot, reply });
        rx.recv().ok().flatten()
    }

    /// Gives running ring `slot` of a group a new call descriptor in
    /// place, between two passes: nothing stops, nothing waits for its
    /// requests in flight. False if no ring is attached there.
    pub fn set_call(&self, key: GroupKey, slot: usize, call: Option<EventFd>) -> bool {
        let (reply, rx) = channel();
        self.send(Cmd::SetCall { key, slot, call, reply });
        rx.recv().unwrap_or(false)
    }

    /// Whether the worker has done work, read without waking it: its busy
    /// passes so far times two, plus one while it sleeps. The worker
    /// stores it as it falls asleep and as it wakes, never per pass. The
    /// same odd value read twice means it did no work in between: it slept
    /// throughout, or woke only for commands or spurious events.
    pub fn rest(&self) -> u64 {
        self.rest.load(Ordering::Acquire)
    }

    /// Current counters.
    pub fn report(&self) -> WorkerReport {
        let (reply, rx) = channel();
        self.send(Cmd::Stats { reply });
        rx.recv().unwrap_or_default()
    }

    /// Waits for the thread to end (the pool's `stop` is set) and returns its final
    /// counters; default counters if it already ended.
    pub fn join(&self) -> WorkerReport {
        self.pending.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        let t = self.thread.lock().ok().and_then(|mut t| t.take());
        t.and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

/// How the worker waits for work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Sleep on the kick eventfds when idle.
    Interrupt,
    /// Spin while rings are attached (kicks suppressed with NO_NOTIFY).
    Poll,
    /// Spin while there is work and for `idle` after the last work, kicks
    /// suppressed; then ask for kicks, re-check, and sleep. A wake-up that
    /// finds no work goes back to sleep at once.
    Adaptive {
        /// How long to keep spinning without work before sleeping.
        idle: std::time::Duration,
    },
}

/// Adaptive mode's clock. Under load the worker reads it once per gap
/// between bursts, every few hundred nanoseconds: the TSC (one `rdtsc`, 24
/// cycles here) rather than `Instant::now` (a vDSO clock_gettime, 55).
/// Nanoseconds where there is no TSC.
struct IdleClock {
    /// TSC ticks per second; 0 without a TSC.
    tsc_hz: u64,
    epoch: std::time::Instant,
}

impl IdleClock {
    /// The clock, and how many of its ticks the worker spins idle before
    /// sleeping. Only adaptive mode reads it: the others skip measuring the
    /// TSC rate (20 ms, once per process) and get the nanosecond clock.
    fn for_mode(mode: Mode) -> (IdleClock, u64) {
        let epoch = std::time::Instant::now();
        match mode {
            Mode::Adaptive { idle } => {
                let clock = IdleClock { tsc_hz: crate::snapshot::tsc_hz(), epoch };
                let ticks = clock.ticks(idle);
                (clock, ticks)
            }
            _ => (IdleClock { tsc_hz: 0, epoch }, 0),
        }
    }

    fn now(&self) -> u64 {
        if self.tsc_hz != 0 {
            vhostd_device::tsc()
        } else {
            self.epoch.elapsed().as_nanos() as u64
        }
    }

    fn ticks(&self, d: std::time::Duration) -> u64 {
        if self.tsc_hz != 0 {
            (d.as_nanos().saturating_mul(self.tsc_hz as u128) / 1_000_000_000).min(u64::MAX as u128) as u64
        } else {
            d.as_nanos().min(u64::MAX as u128) as u64
        }
    }
}

/// What the worker keeps of a ring slot besides the ring.
#[derive(Default)]
struct SlotState {
    kick: Option<EventFd>,
    err: Option<EventFd>,
    err_signalled: bool,
    /// The batch of the last attachment, reused by the next.
    spare: Option<Batch>,
    /// Counters of past attachments.
    past: RingReport,
    /// Bad chains already logged, and when (guest-triggered warnings are
    /// rate-limited: a hostile guest must not flood the log).
    bad_logged: u64,
    bad_logged_at: Option<std::time::Instant>,
}

/// A queue group on a worker, with its rings (moved whole between workers).
pub struct Unit {
    key: GroupKey,
    run: Arc<RunState>,
    group: Box<dyn QueueGroup>,
    rings: Vec<Option<Ring>>,
    slots: Vec<SlotState>,
    /// The group's event descriptor is in the epoll set with EPOLLIN.
    armed: bool,
}

impl Unit {
    /// Stops the rings still attached (nothing of them in flight after:
    /// the group drains them), for a unit that is being dropped.
    pub fn stop_rings(mut self) {
        for (slot, r) in self.rings.iter_mut().enumerate() {
            if let Some(mut ring) = r.take() {
                self.group.detach(slot, &mut ring);
                let (_queue, mut batch, _call) = ring.into_parts();
                batch.release();
            }
        }
    }
}

/// At most one bad-chain warning per ring per this interval.
const BAD_CHAIN_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

struct Worker {
    index: usize,
    units: Vec<Unit>,
    mode: Mode,
    cmds: Receiver<Cmd>,
    wake: EventFd,
    /// Handed to groups placed here: wakes this worker.
    waker: Waker,
    pending: Arc<AtomicBool>,
    /// `WorkerHandle::rest`.
    rest: Arc<AtomicU64>,
    /// The pool's: set at shutdown.
    stop: Arc<AtomicBool>,
    epoll: Epoll,
    idle_iters: u64,
    busy_iters: u64,
    sleeps: u64,
    /// Idle passes in a row with a group stalled.
    blocked_passes: u32,
    /// Rings asked to stop that still have requests in flight, with the
    /// reply their detach waits for.
    stopping: Vec<(GroupKey, usize, Sender<Option<Returned>>)>,
    /// Some ring is attached; some attached ring has no kick fd (it must be
    /// polled). Kept from attach and detach, not recomputed per idle pass.
    attached: bool,
    must_poll: bool,
    /// `virtq::sigbus::lost_mappings()` (guest memory) as last logged.
    lost_seen: u64,
}

const WAKE_TOKEN: u64 = u64::MAX;
/// Tokens of a group's event descriptor: this bit and the unit's position.
const EVENT_TOKEN: u64 = 1 << 62;
/// `idle_run` of an adaptive worker that has found no work since it woke.
/// (A run of idle passes cannot reach it: it ends within the idle window.)
const WOKE_IDLE: u32 = u32::MAX;
/// Most `pause` instructions between two polls of idle rings (about a microsecond).
const MAX_BACKOFF: u32 = 32;
/// The cap after a pass that moved a full burst from a driver that does not
/// wait for it and nothing back (`Pass::streaming`: one-way net TX): the
/// frontend is sending as fast as it can and the next burst is a gap away.
/// Polling its ring every microsecond in that gap cost a DPDK virtio-user
/// frontend 40 % of its rate on a 1024-entry split ring (net-ab, 64 B
/// guest->host: 14.4 against 23.2 Mpps with this cap). Any pass with less
/// work brings back the short cap, so after sparse traffic a lone frame
/// still waits about a microsecond; the first one after a stream may wait
/// up to this cap (about 6 us at 60 cycles a pause). Not for closed loops
/// (blk, whose driver waits for the burst's completions; frames looped
/// back), where the longer wait is lost rate.
const STREAMING_BACKOFF: u32 = 256;
/// Idle passes with a group stalled before the worker sleeps between looks
/// (a backend's completions normally arrive within microseconds; a downed
/// interface must not cost a spinning CPU).
const BLOCKED_SPINS: u32 = 4096;
/// How long a worker with a group stalled sleeps between looks, and the
/// longest an idle one with backend work deferred sleeps, in milliseconds.
const BLOCKED_SLEEP_MS: i32 = 1;

/// A kick descriptor's token: the unit's position and the ring slot.
fn kick_token(unit: usize, slot: usize) -> u64 {
    ((unit as u64) << 16) | slot as u64
}

/// Starts worker `index` (no groups yet), pinned to `cpu` if given; it
/// ends when `stop` is set and it is woken (`WorkerHandle::join`). `name`
/// names its thread and its log lines.
pub fn spawn(
    name: &str,
    index: usize,
    mode: Mode,
    cpu: Option<usize>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<WorkerHandle> {
    let (tx, cmds) = channel();
    let wake = EventFd::new(EFD_NONBLOCK)?;
    let pending = Arc::new(AtomicBool::new(false));
    let rest = Arc::new(AtomicU64::new(0));
    let epoll = Epoll::new()?;
    epoll.ctl(ControlOperation::Add, wake.as_raw_fd(), EpollEvent::new(EventSet::IN, WAKE_TOKEN))?;
    let waker = Waker::new(wake.try_clone()?);
    let worker = Worker {
        index,
        units: Vec::new(),
        mode,
        cmds,
        wake: wake.try_clone()?,
        waker,
        pending: pending.clone(),
        rest: rest.clone(),
        stop,
        epoll,
        idle_iters: 0,
        busy_iters: 0,
        sleeps: 0,
        blocked_passes: 0,
        stopping: Vec::new(),
        attached: false,
        must_poll: false,
        lost_seen: virtq::sigbus::lost_mappings(),
    };
    let span_name = name.to_string();
    // Thread names are at most 15 bytes: "vhostd-q3", "vhostd-w12".
    let thread_name = if name == "pool" { format!("vhostd-w{index}") } else { format!("vhostd-q{index}") };
    let thread = std::thread::Builder::new().name(thread_name).spawn(move || {
        let _span = tracing::info_span!("dev", device = %span_name, worker = index).entered();
        if let Some(cpu) = cpu {
            pin_to_cpu(cpu);
        }
        worker.run()
    })?;
    Ok(WorkerHandle { tx, wake, pending, rest, thread: std::sync::Mutex::new(Some(thread)) })
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET bounds-checks against the
    // set's size; sched_setaffinity(0, ..) affects only this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::warn!(cpu, "could not pin worker: {}", std::io::Error::last_os_error());
        }
    }
}

impl Worker {
    fn run(mut self) -> WorkerReport {
        let mut backoff = 1u32;
        // The back-off's cap: longer after a streaming burst (STREAMING_BACKOFF).
        let mut backoff_cap = MAX_BACKOFF;
        // Adaptive mode: how long to spin, and when work was last seen
        // (taken on the first idle pass after work), in the clock's ticks.
        let (clock, idle_ticks) = IdleClock::for_mode(self.mode);
        let mut last_work = 0u64;
        // Idle passes in a row, or WOKE_IDLE: none since the worker woke.
        let mut idle_run = 0u32;
        loop {
            if self.pending.load(Ordering::Acquire) {
                self.pending.store(false, Ordering::Relaxed);
                self.handle_cmds();
                self.recount();
                if self.stop.load(Ordering::Acquire) {
                    break;
                }
            }
            let pass = self.poll_once();
            if !self.stopping.is_empty() {
                self.check_stops();
            }
            if pass.work > 0 {
                self.busy_iters += 1;
                backoff = 1;
                backoff_cap = if pass.streaming { STREAMING_BACKOFF } else { MAX_BACKOFF };
                idle_run = 0;
                self.blocked_passes = 0;
                continue;
            }
            self.idle_iters += 1;
            // Work a backend put off (AF_XDP: fill-ring room, a refused TX
            // wake-up) sends no event when it can go on: look again, and
            // sleep only briefly while some remains.
            let deferred = pass.deferred;
            if pass.stalled {
                // Only the backend can unblock it: no kick would say so.
                self.blocked_passes += 1;
                if self.blocked_passes < BLOCKED_SPINS {
                    std::hint::spin_loop();
                } else {
                    self.sleep(BLOCKED_SLEEP_MS);
                }
                continue;
            }
            self.blocked_passes = 0;
            let (attached, must_poll) = (self.attached, self.must_poll);
            let spin = match self.mode {
                Mode::Poll => true,
                Mode::Interrupt => false,
                // Woken, and no work since: back to sleep without spinning
                // the idle window. What woke it was a command, a spurious
                // event, or a kick whose work it had taken while spinning
                // (the kick waits in its eventfd): none says more is coming.
                Mode::Adaptive { .. } if idle_run == WOKE_IDLE => false,
                Mode::Adaptive { .. } => {
                    if idle_run == 0 {
                        last_work = clock.now();
                    }
                    idle_run = idle_run.wrapping_add(1);
                    // Every 64 passes while they are quick; every pass once
                    // each backs off at least MAX_BACKOFF pauses (up to
                    // STREAMING_BACKOFF, 64 of which would overshoot the
                    // idle time severalfold), where one rdtsc is lost in it.
                    let check = idle_run.is_multiple_of(64) || backoff >= MAX_BACKOFF;
                    !(check && clock.now().wrapping_sub(last_work) >= idle_ticks)
                }
            };
            if attached && (spin || must_poll) {
                if pass.yields {
                    // SAFETY: sched_yield has no arguments or preconditions.
                    unsafe { libc::sched_yield() };
                    continue;
                }
                // Re-reading avail.idx in a tight loop steals its cache line
                // from the driver on every store; back off a little while idle.
                for _ in 0..backoff {
                    std::hint::spin_loop();
                }
                backoff = (backoff * 2).min(backoff_cap);
                continue;
            }
            idle_run = 0;
            self.sleeps += 1;
            // Idle: ask for kicks, re-check, then sleep.
            if self.prepare_sleep() {
                self.disable_notifications();
                continue;
            }
            self.sleep(if deferred { BLOCKED_SLEEP_MS } else { -1 });
            self.disable_notifications();
            idle_run = WOKE_IDLE;
        }
        self.report()
    }

    fn report(&self) -> WorkerReport {
        let groups = self
            .units
            .iter()
            .map(|u| {
                let rings: Vec<RingReport> = u
                    .slots
                    .iter()
                    .zip(&u.rings)
                    .map(|(s, r)| {
                        let mut rep = s.past;
                        if let Some(r) = r {
                            rep.queue += *r.queue.stats();
                            rep.ring += r.counters;
                        }
                        rep
                    })
                    .collect();
                let queues: Vec<QueueStats> = rings.iter().map(|r| r.queue).collect();
                GroupReport { device: u.key.device, group: u.key.group, counters: u.group.counters(&queues), rings }
            })
            .collect();
        WorkerReport {
            worker: self.index,
            groups,
            idle_iters: self.idle_iters,
            busy_iters: self.busy_iters,
            sleeps: self.sleeps,
        }
    }

    fn unit_of(&self, key: GroupKey) -> Option<usize> {
        self.units.iter().position(|u| u.key == key)
    }

    fn handle_cmds(&mut self) {
        while let Ok(cmd) = self.cmds.try_recv() {
            match cmd {
                Cmd::Add { key, group, run, reply } => {
                    let n = group.ring_slots();
                    let unit = Unit {
                        key,
                        run,
                        group,
                        rings: (0..n).map(|_| None).collect(),
                        slots: (0..n).map(|_| SlotState::default()).collect(),
                        armed: false,
                    };
                    self.put(unit);
                    let _ = reply.send(());
                }
                Cmd::Take { key, reply } => {
                    // (Not reached with a stop pending: a stopping group does
                    // not move, and a device retires after its rings stopped.)
                    self.finish_stops(key);
                    let _ = reply.send(self.take(key));
                }
                Cmd::Put { unit, reply } => {
                    self.put(unit);
                    let _ = reply.send(());
                }
                Cmd::Attach { key, slot, start, reply } => {
                    // (Never while the slot stops: the session waits for it.)
                    self.finish_stops(key);
                    self.attach(key, slot, *start);
                    let _ = reply.send(());
                }
                Cmd::Detach { key, slot, reply } => self.start_detach(key, slot, reply),
                Cmd::SetCall { key, slot, call, reply } => {
                    let _ = reply.send(self.set_call(key, slot, call));
                }
                Cmd::Stats { reply } => {
                    let _ = reply.send(self.report());
                }
            }
        }
    }

    /// Registers unit `k`'s descriptors (its running rings' kicks, its
    /// event descriptor) in the epoll set under its position's tokens:
    /// `add` for a unit just placed, else a change after positions shifted.
    fn register(&self, k: usize, add: bool) {
        let op = || if add { ControlOperation::Add } else { ControlOperation::Modify };
        let u = &self.units[k];
        for (slot, (r, s)) in u.rings.iter().zip(&u.slots).enumerate() {
            if let (Some(_), Some(fd)) = (r, &s.kick) {
                let _ = self.epoll.ctl(op(), fd.as_raw_fd(), EpollEvent::new(EventSet::IN, kick_token(k, slot)));
            }
        }
        if let Some(fd) = u.group.event_fd() {
            // Armed before each sleep, as the group asks.
            let events = if u.armed { EventSet::IN } else { EventSet::empty() };
            let _ = self.epoll.ctl(op(), fd, EpollEvent::new(events, EVENT_TOKEN | k as u64));
        }
    }

    /// Runs a unit here: its descriptors join the epoll set, its group
    /// learns how to wake this worker.
    fn put(&mut self, mut unit: Unit) {
        if self.unit_of(unit.key).is_some() {
            // The pool never places a group twice.
            tracing::error!(group = unit.key.group, "group placed twice on a worker; the older copy is dropped");
            drop(self.take(unit.key));
        }
        unit.group.placed(&self.waker);
        self.units.push(unit);
        self.register(self.units.len() - 1, true);
    }

    /// Takes a unit out with its rings still attached (a move keeps their
    /// state), its descriptors out of the epoll set.
    fn take(&mut self, key: GroupKey) -> Option<Unit> {
        let k = self.unit_of(key)?;
        let u = self.units.remove(k);
        for (r, s) in u.rings.iter().zip(&u.slots) {
            if let (Some(_), Some(fd)) = (r, &s.kick) {
                let _ = self.epoll.ctl(ControlOperation::Delete, fd.as_raw_fd(), EpollEvent::default());
            }
        }
        if let Some(fd) = u.group.event_fd() {
            let _ = self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
        }
        // The units after it moved down one place: their tokens follow.
        for j in k..self.units.len() {
            self.register(j, false);
        }
        self.recount();
        Some(u)
    }

    fn attach(&mut self, key: GroupKey, slot: usize, start: Start) {
        // The device placed the ring here: a group or slot the worker does
        // not have is a bug in the device's `place`, not guest input.
        let group = key.group;
        let Some(k) = self.unit_of(key) else {
            tracing::error!(group, slot, "ring placed in a group this worker does not run; left stopped");
            return;
        };
        if slot >= self.units[k].rings.len() {
            tracing::error!(group, slot, "ring placed in a slot its group does not have; left stopped");
            return;
        }
        // A ring already there goes first (the session never does this).
        let _ = self.detach(key, slot);
        let Start { mut queue, kick, call, err, features, inflight } = start;
        let u = &mut self.units[k];
        if let Some(fd) = &kick {
            let _ = self.epoll.ctl(
                ControlOperation::Add,
                fd.as_raw_fd(),
                EpollEvent::new(EventSet::IN, kick_token(k, slot)),
            );
        }
        // Poll and adaptive modes start out spinning: no kicks wanted until
        // an adaptive worker goes to sleep (prepare_sleep asks for them).
        if self.mode != Mode::Interrupt {
            queue.disable_notifications();
        }
        let s = &mut u.slots[slot];
        s.kick = kick;
        s.err = err;
        s.err_signalled = false;
        s.bad_logged = s.past.queue.bad_chains + queue.stats().bad_chains;
        let batch = s.spare.take().unwrap_or_default();
        // One interrupt as the ring starts: a driver may be waiting for one
        // that was lost with the previous backend (QEMU 11.1 with MSI-X
        // stopped the rings of a killed vhostd and its guest never heard
        // of the last used entries). A spurious interrupt costs the driver
        // a look at its used ring (virtio 1.2, 2.7.10 / 2.8.14).
        if let Some(c) = &call {
            let _ = c.write(1);
        }
        let mut ring = Ring::new(queue, batch, call);
        u.group.attach(slot, &mut ring, features, inflight);
        u.rings[slot] = Some(ring);
    }

    /// Gives ring `slot` of a group `call` in place of its call descriptor.
    fn set_call(&mut self, key: GroupKey, slot: usize, call: Option<EventFd>) -> bool {
        let Some(k) = self.unit_of(key) else { return false };
        let Some(Some(ring)) = self.units[k].rings.get_mut(slot) else { return false };
        // An interrupt sent since the driver moved it went to the old
        // descriptor: one on the new covers it (as attach sends one).
        if let Some(c) = &call {
            let _ = c.write(1);
        }
        drop(ring.set_call(call));
        true
    }

    /// Asks ring `slot` of a group to stop and replies with it once nothing
    /// of it is in flight: at once, or after the passes that complete what
    /// is (`check_stops`); the other groups run meanwhile.
    fn start_detach(&mut self, key: GroupKey, slot: usize, reply: Sender<Option<Returned>>) {
        if self.try_stop(key, slot) {
            let _ = reply.send(self.detach(key, slot));
            return;
        }
        if let Some(k) = self.unit_of(key) {
            tracing::info!(device = %self.units[k].run.name, group = key.group, slot, "ring stopping: waiting for its requests in flight");
        }
        self.stopping.push((key, slot, reply));
    }

    /// Asks ring `slot` of a group to stop: true once nothing of it is in
    /// flight (or there is no such ring).
    fn try_stop(&mut self, key: GroupKey, slot: usize) -> bool {
        let Some(k) = self.unit_of(key) else { return true };
        let u = &mut self.units[k];
        match u.rings.get_mut(slot) {
            Some(Some(ring)) => u.group.stop(slot, ring),
            _ => true,
        }
    }

    /// Whether any ring is attached, and whether one has no kick fd (and
    /// must be polled): after rings came or went.
    fn recount(&mut self) {
        self.attached = self.units.iter().any(|u| u.rings.iter().any(Option::is_some));
        self.must_poll =
            self.units.iter().any(|u| u.rings.iter().zip(&u.slots).any(|(r, s)| r.is_some() && s.kick.is_none()));
    }

    /// Replies to the stops whose rings have nothing in flight any more.
    fn check_stops(&mut self) {
        let before = self.stopping.len();
        let mut i = 0;
        while i < self.stopping.len() {
            let (key, slot) = (self.stopping[i].0, self.stopping[i].1);
            if self.try_stop(key, slot) {
                if let Some(k) = self.unit_of(key) {
                    tracing::info!(device = %self.units[k].run.name, group = key.group, slot, "ring stopped");
                }
                self.end_stop(i);
            } else {
                i += 1;
            }
        }
        if self.stopping.len() != before {
            self.recount();
        }
    }

    /// Ends the stops of group `key` now, waiting for their requests in
    /// flight.
    fn finish_stops(&mut self, key: GroupKey) {
        let mut i = 0;
        while i < self.stopping.len() {
            if self.stopping[i].0 == key {
                self.end_stop(i);
            } else {
                i += 1;
            }
        }
    }

    /// Detaches the ring of pending stop `i` (waiting for anything of it
    /// still in flight) and replies with it.
    fn end_stop(&mut self, i: usize) {
        let (key, slot, reply) = self.stopping.swap_remove(i);
        let _ = reply.send(self.detach(key, slot));
    }

    fn detach(&mut self, key: GroupKey, slot: usize) -> Option<Returned> {
        let k = self.unit_of(key)?;
        let u = &mut self.units[k];
        let mut ring = u.rings.get_mut(slot)?.take()?;
        let s = &mut u.slots[slot];
        if let Some(fd) = &s.kick {
            let _ = self.epoll.ctl(ControlOperation::Delete, fd.as_raw_fd(), EpollEvent::default());
        }
        u.group.detach(slot, &mut ring);
        s.past.queue += *ring.queue.stats();
        s.past.ring += ring.counters;
        let (mut queue, mut batch, call) = ring.into_parts();
        *queue.stats_mut() = QueueStats::default();
        // The batch holds the ring's memory: let it go with the ring.
        batch.release();
        s.spare = Some(batch);
        s.err = None;
        Some((queue, s.kick.take(), call))
    }

    /// One pass over every group.
    #[inline]
    fn poll_once(&mut self) -> Pass {
        let mut pass = Pass::default();
        for k in 0..self.units.len() {
            let u = &mut self.units[k];
            let p = u.group.poll(&mut u.rings);
            // A ring gains bad chains or breaks only in a pass that popped;
            // an idle pass checks now and then (and before sleeping).
            if p.work > 0 || self.idle_iters.is_multiple_of(64) {
                self.check_rings(k);
            }
            pass = pass.and(p);
        }
        pass
    }

    /// Signals NEEDS_RESET (once per ring) for rings the guest broke, and
    /// logs malformed chains (rate-limited).
    fn check_rings(&mut self, k: usize) {
        let lost = virtq::sigbus::lost_mappings();
        if lost != self.lost_seen {
            self.lost_seen = lost;
            tracing::error!(
                worker = self.index,
                "a frontend truncated shared memory under vhostd: it now reads as zeros; the device needs a reset"
            );
        }
        let u = &mut self.units[k];
        for (slot, (r, s)) in u.rings.iter().zip(u.slots.iter_mut()).enumerate() {
            let Some(r) = r else { continue };
            let st = r.queue.stats();
            let bad = s.past.queue.bad_chains + st.bad_chains;
            if bad != s.bad_logged {
                let now = std::time::Instant::now();
                if s.bad_logged_at.is_none_or(|t| now.duration_since(t) >= BAD_CHAIN_LOG_INTERVAL) {
                    tracing::warn!(
                        device = %u.run.name,
                        group = u.key.group,
                        ring = slot,
                        new = bad.wrapping_sub(s.bad_logged),
                        total = bad,
                        index = st.bad_index,
                        r#loop = st.bad_loop,
                        address = st.bad_address,
                        direction = st.bad_direction,
                        indirect = st.bad_indirect,
                        "guest posted malformed descriptor chains (dropped; next report in {}s at the earliest)",
                        BAD_CHAIN_LOG_INTERVAL.as_secs()
                    );
                    s.bad_logged = bad;
                    s.bad_logged_at = Some(now);
                }
            }
            if r.queue.is_broken() && !s.err_signalled {
                s.err_signalled = true;
                u.run.needs_reset.store(true, Ordering::Release);
                tracing::error!(device = %u.run.name, group = u.key.group, ring = slot, "guest broke a ring; device needs reset");
                if let Some(e) = &s.err {
                    let _ = e.write(1);
                }
            }
        }
    }

    /// Before sleeping: every group asks for kicks where a kick means work
    /// and says whether its descriptor should wake us; true if work arrived
    /// meanwhile.
    fn prepare_sleep(&mut self) -> bool {
        for k in 0..self.units.len() {
            self.check_rings(k);
        }
        let mut work = false;
        for (k, u) in self.units.iter_mut().enumerate() {
            let s = u.group.prepare_sleep(&mut u.rings);
            work |= s.work;
            if let Some(fd) = u.group.event_fd() {
                if s.watch_event_fd != u.armed {
                    arm(&self.epoll, fd, k, s.watch_event_fd);
                    u.armed = s.watch_event_fd;
                }
            }
        }
        work
    }

    fn disable_notifications(&mut self) {
        for r in self.units.iter_mut().flat_map(|u| u.rings.iter_mut()).flatten() {
            r.queue.disable_notifications();
        }
    }

    /// Sleeps until an event, or `timeout_ms` (-1: no timeout).
    fn sleep(&mut self, timeout_ms: i32) {
        let mut events = [EpollEvent::default(); 16];
        self.rest.store(self.busy_iters * 2 + 1, Ordering::Release);
        let r = self.epoll.wait(timeout_ms, &mut events);
        self.rest.store(self.busy_iters * 2, Ordering::Release);
        let n = match r {
            Ok(n) => n,
            Err(_) => return,
        };
        for ev in &events[..n] {
            let token = ev.data();
            if token == WAKE_TOKEN {
                let _ = self.wake.read();
            } else if token & EVENT_TOKEN != 0 {
                // Frames or completions arrived: the next pass takes them.
                if let Some(u) = self.units.get_mut((token & !EVENT_TOKEN) as usize) {
                    u.group.on_event();
                }
            } else {
                let (k, slot) = ((token >> 16) as usize, (token & 0xffff) as usize);
                if let Some(u) = self.units.get_mut(k) {
                    if let (Some(Some(r)), Some(s)) = (u.rings.get_mut(slot), u.slots.get(slot)) {
                        if let Some(kick) = &s.kick {
                            let _ = kick.read();
                        }
                        r.counters.kicks += 1;
                    }
                }
            }
        }
    }
}

/// Sets whether a group's descriptor wakes the worker.
fn arm(epoll: &Epoll, fd: RawFd, unit: usize, on: bool) {
    let events = if on { EventSet::IN } else { EventSet::empty() };
    let _ = epoll.ctl(ControlOperation::Modify, fd, EpollEvent::new(events, EVENT_TOKEN | unit as u64));
}
