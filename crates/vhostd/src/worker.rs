//! Dataplane threads: one per queue pair, owning its rings outright (no lock
//! in the hot path). The control thread hands rings over and takes them back
//! through a command channel; a wake eventfd interrupts the worker's sleep.

use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use vhostd_backends::NetBackend;
use vhostd_blk::{BlkDevice, BlkQueue, BlkStats};
use vhostd_net::{process_ctrl, process_rx, process_tx, CtrlState, DirStats, Layout};
use virtq::{Batch, Queue, QueueStats};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Which ring of a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The pair's receive queue (host to guest).
    Rx,
    /// The pair's transmit queue (guest to host).
    Tx,
    /// The control queue (worker 0 only).
    Ctrl,
    /// A virtio-blk request queue (one per worker).
    Req,
}

impl Slot {
    fn index(self) -> usize {
        match self {
            Slot::Rx | Slot::Req => 0,
            Slot::Tx => 1,
            Slot::Ctrl => 2,
        }
    }
}

/// A ring handed back by a worker: its state, kick and call eventfds.
pub type Returned = (Queue, Option<EventFd>, Option<EventFd>);

/// What the control thread asks of a worker. Every command is answered on
/// its reply channel, so the control thread knows the worker has acted.
pub enum Cmd {
    /// Start processing a ring.
    Attach {
        slot: Slot,
        queue: Box<Queue>,
        kick: Option<EventFd>,
        call: Option<EventFd>,
        err: Option<EventFd>,
        layout: Layout,
        /// blk: the shared log of requests in flight for this ring.
        inflight: Option<vhostd_blk::InflightLog>,
        reply: Sender<()>,
    },
    /// Stop processing a ring and give it back.
    Detach { slot: Slot, reply: Sender<Option<Returned>> },
    /// Report counters.
    Stats { reply: Sender<WorkerReport> },
}

/// Counters of one ring.
#[derive(Clone, Copy, Debug, Default)]
pub struct RingReport {
    /// Frames moved, bytes, drops.
    pub dir: DirStats,
    /// Chain validation counters (accumulated over attachments).
    pub queue: QueueStats,
    /// Kick eventfd wake-ups.
    pub kicks: u64,
    /// Call eventfd signals.
    pub notifies: u64,
    /// TSC cycles in iterations of this ring that moved at least one frame.
    pub busy_cycles: u64,
    /// virtio-blk request counters (a blk worker's ring 0).
    pub blk: BlkStats,
}

/// Counters of a worker.
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkerReport {
    /// Queue pair index.
    pub pair: u16,
    /// RX, TX, control.
    pub rings: [RingReport; 3],
    /// Loop iterations that moved nothing / something.
    pub idle_iters: u64,
    /// Loop iterations that moved at least one frame.
    pub busy_iters: u64,
    /// Times the worker slept on its epoll set.
    pub sleeps: u64,
    /// The backend's own counters.
    pub backend: vhostd_backends::BackendStats,
    /// A blk worker's backend counters.
    pub blk_backend: vhostd_block_backends::BlockStats,
}

/// Shared between the control thread and the workers of one device.
pub struct Shared {
    /// Queue pairs the driver enabled through the control queue.
    pub active_pairs: AtomicU16,
    /// The control queue's state (MAC, active pairs), updated by worker 0.
    pub ctrl: std::sync::Mutex<CtrlState>,
    /// Set when a ring broke: the device reports NEEDS_RESET.
    pub needs_reset: AtomicBool,
    /// Set at shutdown.
    pub stop: AtomicBool,
    /// The TAP's device-wide controls, if the backend is a TAP.
    pub tap: Option<Arc<vhostd_backends::TapControl>>,
    /// The interface whose link state the device reports, if any.
    pub link: Option<vhostd_backends::Link>,
    /// Wakes every worker (set once they run): a change of active pairs
    /// must reach sleeping workers, whose TAP queues attach or detach.
    pub wakers: std::sync::OnceLock<Vec<EventFd>>,
}

/// The control thread's handle on a worker.
pub struct WorkerHandle {
    tx: Sender<Cmd>,
    wake: EventFd,
    pending: Arc<AtomicBool>,
    thread: std::sync::Mutex<Option<JoinHandle<WorkerReport>>>,
}

impl WorkerHandle {
    /// Sends a command and wakes the worker.
    pub fn send(&self, cmd: Cmd) {
        // A send fails only if the worker is gone, which happens only at shutdown.
        let _ = self.tx.send(cmd);
        self.pending.store(true, Ordering::Release);
        let _ = self.wake.write(1);
    }

    /// Hands a ring to the worker and waits until it runs.
    #[allow(clippy::too_many_arguments)]
    pub fn attach(
        &self,
        slot: Slot,
        queue: Queue,
        kick: Option<EventFd>,
        call: Option<EventFd>,
        err: Option<EventFd>,
        layout: Layout,
        inflight: Option<vhostd_blk::InflightLog>,
    ) {
        let (reply, rx) = channel();
        self.send(Cmd::Attach { slot, queue: Box::new(queue), kick, call, err, layout, inflight, reply });
        let _ = rx.recv();
    }

    /// Takes a ring back (with its kick and call eventfds).
    pub fn detach(&self, slot: Slot) -> Option<Returned> {
        let (reply, rx) = channel();
        self.send(Cmd::Detach { slot, reply });
        rx.recv().ok().flatten()
    }

    /// A descriptor that wakes this worker.
    pub fn waker(&self) -> std::io::Result<EventFd> {
        self.wake.try_clone()
    }

    /// Current counters.
    pub fn report(&self) -> WorkerReport {
        let (reply, rx) = channel();
        self.send(Cmd::Stats { reply });
        rx.recv().unwrap_or_default()
    }

    /// Waits for the thread to end (the device's `stop` is set) and returns
    /// its final counters; default counters if it already ended.
    pub fn join(&self) -> WorkerReport {
        self.pending.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        let t = self.thread.lock().ok().and_then(|mut t| t.take());
        t.and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

struct Ring {
    queue: Option<Queue>,
    kick: Option<EventFd>,
    call: Option<EventFd>,
    err: Option<EventFd>,
    batch: Batch,
    report: RingReport,
    err_signalled: bool,
    /// Bad chains already logged, and when (guest-triggered warnings are
    /// rate-limited: a hostile guest must not flood the log).
    bad_logged: u64,
    bad_logged_at: Option<std::time::Instant>,
}

/// At most one bad-chain warning per ring per this interval.
const BAD_CHAIN_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

impl Ring {
    fn new() -> Ring {
        Ring {
            queue: None,
            kick: None,
            call: None,
            err: None,
            batch: Batch::new(),
            report: RingReport::default(),
            err_signalled: false,
            bad_logged: 0,
            bad_logged_at: None,
        }
    }

    /// Tells the guest about published used entries if it wants to hear.
    #[inline]
    fn notify(&mut self) {
        if let Some(q) = self.queue.as_mut() {
            if q.needs_notify() {
                if let Some(call) = &self.call {
                    let _ = call.write(1);
                }
                self.report.notifies += 1;
            }
        }
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
    /// suppressed; then ask for kicks, re-check, and sleep.
    Adaptive {
        /// How long to keep spinning without work before sleeping.
        idle: std::time::Duration,
    },
}

/// What a worker moves data for: a net queue pair and its packet backend,
/// or a blk request queue and its block backend.
pub enum Engine {
    Net(Box<dyn NetBackend>),
    Blk { queue: Box<BlkQueue>, dev: Arc<BlkDevice> },
}

struct Worker {
    pair: u16,
    rings: [Ring; 3],
    layout: Layout,
    engine: Engine,
    mode: Mode,
    cmds: Receiver<Cmd>,
    wake: EventFd,
    pending: Arc<AtomicBool>,
    shared: Arc<Shared>,
    epoll: Epoll,
    idle_iters: u64,
    busy_iters: u64,
    /// Times the worker went to sleep on its epoll set (interrupt, adaptive).
    sleeps: u64,
    /// The backend is told whether anyone reads its RX side (a multi-queue
    /// TAP then steers frames only to queues in use).
    backend_active: bool,
    /// The backend's RX descriptor is in the epoll set with EPOLLIN.
    backend_armed: bool,
    /// Receive offloads last applied from the control queue.
    ctrl_offloads: u64,
    /// The guest has frames to send but the backend took none (e.g. every
    /// AF_XDP TX frame awaits its completion, or the interface is down).
    tx_blocked: bool,
    /// Idle passes in a row with TX blocked.
    blocked_passes: u32,
    /// `crate::memory::lost_mappings()` as last logged.
    lost_seen: u64,
}

const WAKE_TOKEN: u64 = u64::MAX;
/// The backend's RX descriptor (a TAP queue) became readable.
const BACKEND_TOKEN: u64 = u64::MAX - 1;
/// Most `pause` instructions between two polls of idle rings (about a microsecond).
const MAX_BACKOFF: u32 = 32;
/// Idle passes with TX blocked before the worker sleeps between looks (a
/// backend's completions normally arrive within microseconds; a downed
/// interface must not cost a spinning CPU).
const BLOCKED_SPINS: u32 = 4096;
/// How long a worker with TX blocked sleeps between looks, and the longest
/// an idle one with backend work deferred sleeps, in milliseconds.
const BLOCKED_SLEEP_MS: i32 = 1;

/// Starts the worker thread of queue pair `pair`, pinned to `cpu` if given.
pub fn spawn(
    device: &str,
    pair: u16,
    engine: Engine,
    mode: Mode,
    cpu: Option<usize>,
    shared: Arc<Shared>,
) -> std::io::Result<WorkerHandle> {
    let (tx, cmds) = channel();
    let wake = EventFd::new(EFD_NONBLOCK)?;
    let pending = Arc::new(AtomicBool::new(false));
    let epoll = Epoll::new()?;
    epoll.ctl(ControlOperation::Add, wake.as_raw_fd(), EpollEvent::new(EventSet::IN, WAKE_TOKEN))?;
    match &engine {
        Engine::Net(backend) => {
            if let Some(fd) = backend.rx_fd() {
                epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::empty(), BACKEND_TOKEN))?;
            }
        }
        Engine::Blk { queue, .. } => {
            // Completions arrive whether or not the guest kicks: always armed.
            if let Some(fd) = queue.completion_fd() {
                epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, BACKEND_TOKEN))?;
            }
        }
    }
    let backend_armed = false;
    let worker = Worker {
        pair,
        rings: [Ring::new(), Ring::new(), Ring::new()],
        layout: Layout::from_features(0),
        engine,
        mode,
        cmds,
        wake: wake.try_clone()?,
        pending: pending.clone(),
        shared,
        epoll,
        idle_iters: 0,
        sleeps: 0,
        busy_iters: 0,
        backend_active: true,
        backend_armed,
        ctrl_offloads: 0,
        tx_blocked: false,
        blocked_passes: 0,
        lost_seen: crate::memory::lost_mappings(),
    };
    let device = device.to_string();
    let thread = std::thread::Builder::new().name(format!("vhostd-q{pair}")).spawn(move || {
        let _span = tracing::info_span!("dev", device = %device, q = pair).entered();
        if let Some(cpu) = cpu {
            pin_to_cpu(cpu);
        }
        worker.run()
    })?;
    Ok(WorkerHandle { tx, wake, pending, thread: std::sync::Mutex::new(Some(thread)) })
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

#[inline]
fn tsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86_64.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

impl Worker {
    fn run(mut self) -> WorkerReport {
        let mut backoff = 1u32;
        // Adaptive mode: when work was last seen (looked up every 64 idle passes).
        let mut last_work = std::time::Instant::now();
        let mut idle_run = 0u32;
        loop {
            if self.pending.load(Ordering::Acquire) {
                self.pending.store(false, Ordering::Relaxed);
                self.handle_cmds();
                if self.shared.stop.load(Ordering::Acquire) {
                    break;
                }
            }
            let moved = self.poll_once();
            if moved > 0 {
                self.busy_iters += 1;
                backoff = 1;
                idle_run = 0;
                self.blocked_passes = 0;
                continue;
            }
            self.idle_iters += 1;
            // Work the backend put off (AF_XDP: fill-ring room, a refused TX
            // wake-up) sends no event when it can go on: look again, and
            // sleep only briefly while some remains.
            let deferred = match &mut self.engine {
                Engine::Net(backend) => backend.retry_deferred(),
                Engine::Blk { .. } => false,
            };
            if self.tx_blocked {
                // Only the backend can unblock TX: no kick would say so.
                self.blocked_passes += 1;
                if self.blocked_passes < BLOCKED_SPINS {
                    std::hint::spin_loop();
                } else {
                    self.sleep(BLOCKED_SLEEP_MS);
                }
                continue;
            }
            self.blocked_passes = 0;
            let attached = self.rings.iter().any(|r| r.queue.is_some());
            // A ring started without a kick fd must be polled.
            let must_poll = self.rings.iter().any(|r| r.queue.is_some() && r.kick.is_none());
            let spin = match self.mode {
                Mode::Poll => true,
                Mode::Interrupt => false,
                Mode::Adaptive { idle } => {
                    if idle_run == 0 {
                        last_work = std::time::Instant::now();
                    }
                    idle_run = idle_run.wrapping_add(1);
                    !(idle_run.is_multiple_of(64) && last_work.elapsed() >= idle)
                }
            };
            if attached && (spin || must_poll) {
                if let Engine::Blk { queue, .. } = &self.engine {
                    if queue.in_flight() > 0 && queue.completion_fd().is_some() {
                        // The kernel finishes these, often on a worker
                        // thread of this CPU: let it run.
                        // SAFETY: sched_yield has no arguments or preconditions.
                        unsafe { libc::sched_yield() };
                        continue;
                    }
                }
                // Re-reading avail.idx in a tight loop steals its cache line
                // from the driver on every store; back off a little while idle.
                for _ in 0..backoff {
                    std::hint::spin_loop();
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            idle_run = 0;
            self.sleeps += 1;
            // Idle: ask for kicks, re-check, then sleep.
            if self.enable_notifications() {
                self.disable_notifications();
                continue;
            }
            self.sleep(if deferred { BLOCKED_SLEEP_MS } else { -1 });
            self.disable_notifications();
        }
        self.report()
    }

    fn report(&self) -> WorkerReport {
        let mut r = WorkerReport { pair: self.pair, ..Default::default() };
        for (i, ring) in self.rings.iter().enumerate() {
            r.rings[i] = ring.report;
            if let Some(q) = &ring.queue {
                r.rings[i].queue = add_queue_stats(ring.report.queue, *q.stats());
            }
        }
        r.idle_iters = self.idle_iters;
        r.busy_iters = self.busy_iters;
        r.sleeps = self.sleeps;
        match &self.engine {
            Engine::Net(backend) => r.backend = backend.stats(),
            Engine::Blk { queue, .. } => {
                r.rings[0].blk = queue.stats;
                r.blk_backend = queue.backend_stats();
            }
        }
        r
    }

    fn handle_cmds(&mut self) {
        while let Ok(cmd) = self.cmds.try_recv() {
            match cmd {
                Cmd::Attach { slot, mut queue, kick, call, err, layout, inflight, reply } => {
                    let ring = &mut self.rings[slot.index()];
                    if let Some(k) = &kick {
                        let _ = self.epoll.ctl(
                            ControlOperation::Add,
                            k.as_raw_fd(),
                            EpollEvent::new(EventSet::IN, slot.index() as u64),
                        );
                    }
                    if self.mode == Mode::Poll {
                        queue.disable_notifications();
                    }
                    ring.queue = Some(*queue);
                    ring.kick = kick;
                    ring.call = call;
                    ring.err = err;
                    ring.err_signalled = false;
                    ring.bad_logged = ring.queue.as_ref().map_or(0, |q| q.stats().bad_chains);
                    if slot != Slot::Ctrl {
                        self.layout = layout;
                    }
                    if let (Engine::Blk { queue: bq, dev }, Some(q), Some(log)) =
                        (&mut self.engine, ring.queue.as_mut(), inflight)
                    {
                        // Requests a crashed backend left unanswered run again.
                        let n = bq.attach_inflight(log, q, &mut ring.batch, dev);
                        if n > 0 {
                            tracing::info!(
                                queue = self.pair,
                                "resubmitted {n} request(s) left in flight by a previous backend"
                            );
                        }
                        ring.notify();
                    }
                    let _ = reply.send(());
                }
                Cmd::Detach { slot, reply } => {
                    let ring = &mut self.rings[slot.index()];
                    if let Some(k) = &ring.kick {
                        let _ = self.epoll.ctl(ControlOperation::Delete, k.as_raw_fd(), EpollEvent::default());
                    }
                    if let (Engine::Blk { queue: bq, dev }, Some(q)) = (&mut self.engine, ring.queue.as_mut()) {
                        // The backend may still write into the ring's buffers.
                        bq.drain(q, dev);
                        bq.detach_inflight();
                    }
                    // The batch holds the ring's memory: let it go with the ring.
                    ring.batch.release();
                    let out = ring.queue.take().map(|mut q| {
                        ring.report.queue = add_queue_stats(ring.report.queue, *q.stats());
                        *q.stats_mut() = QueueStats::default();
                        (q, ring.kick.take(), ring.call.take())
                    });
                    ring.err = None;
                    let _ = reply.send(out);
                }
                Cmd::Stats { reply } => {
                    let _ = reply.send(self.report());
                }
            }
        }
    }

    /// One pass over the rings: TX, then RX, then control. Returns frames moved.
    #[inline]
    fn poll_once(&mut self) -> usize {
        let backend = match &mut self.engine {
            Engine::Net(b) => b,
            Engine::Blk { queue: bq, dev } => {
                let ring = &mut self.rings[0];
                let mut n = 0;
                if let Some(q) = ring.queue.as_mut() {
                    let t0 = tsc();
                    n = bq.process(q, &mut ring.batch, dev);
                    if n > 0 {
                        ring.notify();
                        ring.report.busy_cycles += tsc() - t0;
                    }
                }
                self.check_broken();
                return n;
            }
        };
        let mut moved = 0;
        let t0 = tsc();
        let [rx, tx, ctrl] = &mut self.rings;
        self.tx_blocked = false;
        if let Some(q) = tx.queue.as_mut() {
            let n = process_tx(q, &mut tx.batch, backend.as_mut(), self.layout, &mut tx.report.dir);
            if n > 0 {
                tx.notify();
                moved += n;
            } else {
                self.tx_blocked = q.pending() > 0;
            }
        }
        let t1 = tsc();
        if moved > 0 {
            tx.report.busy_cycles += t1 - t0;
        }
        let active = self.pair < self.shared.active_pairs.load(Ordering::Relaxed);
        let reading = active && rx.queue.is_some();
        if reading != self.backend_active {
            self.backend_active = reading;
            backend.set_active(reading);
        }
        if let (Some(q), true) = (rx.queue.as_mut(), active) {
            let n = process_rx(q, &mut rx.batch, backend.as_mut(), self.layout, &mut rx.report.dir);
            if n > 0 {
                rx.notify();
                rx.report.busy_cycles += tsc() - t1;
                moved += n;
            }
        }
        if let Some(q) = ctrl.queue.as_mut() {
            let mut state = match self.shared.ctrl.lock() {
                Ok(s) => *s,
                Err(_) => return moved,
            };
            let n = process_ctrl(q, &mut ctrl.batch, &mut state);
            if n > 0 {
                if state.offloads != self.ctrl_offloads {
                    // VIRTIO_NET_CTRL_GUEST_OFFLOADS_SET (e.g. the guest attached XDP).
                    self.ctrl_offloads = state.offloads;
                    if let Some(tap) = &self.shared.tap {
                        let _ = tap.set_offloads(vhostd_net::guest_offloads(state.offloads));
                    }
                }
                let before = self.shared.active_pairs.swap(state.active_pairs, Ordering::Relaxed);
                if before != state.active_pairs {
                    for w in self.shared.wakers.get().into_iter().flatten() {
                        let _ = w.write(1);
                    }
                }
                if let Ok(mut s) = self.shared.ctrl.lock() {
                    *s = state;
                }
                ctrl.notify();
                moved += n;
            }
        }
        self.check_broken();
        moved
    }

    /// Signals NEEDS_RESET (once per ring) for rings the guest broke.
    fn check_broken(&mut self) {
        let lost = crate::memory::lost_mappings();
        if lost != self.lost_seen {
            self.lost_seen = lost;
            tracing::error!(
                pair = self.pair,
                "a frontend truncated shared memory under vhostd: it now reads as zeros; the device needs a reset"
            );
        }
        for (i, ring) in self.rings.iter_mut().enumerate() {
            if let Some(q) = &ring.queue {
                let bad = q.stats().bad_chains;
                if bad != ring.bad_logged {
                    let now = std::time::Instant::now();
                    if ring.bad_logged_at.is_none_or(|t| now.duration_since(t) >= BAD_CHAIN_LOG_INTERVAL) {
                        let st = q.stats();
                        tracing::warn!(
                            pair = self.pair,
                            ring = i,
                            new = bad.wrapping_sub(ring.bad_logged),
                            total = bad,
                            index = st.bad_index,
                            r#loop = st.bad_loop,
                            address = st.bad_address,
                            direction = st.bad_direction,
                            indirect = st.bad_indirect,
                            "guest posted malformed descriptor chains (dropped; next report in {}s at the earliest)",
                            BAD_CHAIN_LOG_INTERVAL.as_secs()
                        );
                        ring.bad_logged = bad;
                        ring.bad_logged_at = Some(now);
                    }
                }
                if q.is_broken() && !ring.err_signalled {
                    ring.err_signalled = true;
                    self.shared.needs_reset.store(true, Ordering::Release);
                    tracing::error!(pair = self.pair, "guest broke a ring; device needs reset");
                    if let Some(e) = &ring.err {
                        let _ = e.write(1);
                    }
                }
            }
        }
    }

    /// Before sleeping: asks for kicks where a kick would mean work, and
    /// reports whether work arrived meanwhile. Posted RX buffers are work
    /// only when the backend has frames for them; otherwise the RX ring stays
    /// quiet (no kicks, not counted) and the worker sleeps until a TX kick
    /// or the backend has something.
    fn enable_notifications(&mut self) -> bool {
        let backend = match &mut self.engine {
            Engine::Net(b) => b,
            Engine::Blk { queue: bq, .. } => {
                // Requests in flight complete through the completion fd; a
                // backend without one must be polled until they are done.
                let mut more = bq.in_flight() > 0 && bq.completion_fd().is_none();
                if let Some(q) = self.rings[0].queue.as_mut() {
                    more |= q.enable_notifications();
                }
                return more;
            }
        };
        let rx_has_frames = !backend.rx_frames(1).is_empty();
        // A backend with a descriptor wakes us when it has frames, but only
        // while the guest reads and nothing is already waiting for RX room
        // (then the guest's RX kick is what we need, not a busy descriptor).
        if let Some(fd) = backend.rx_fd() {
            let arm = self.backend_active && !rx_has_frames;
            if arm != self.backend_armed {
                let events = if arm { EventSet::IN } else { EventSet::empty() };
                let _ = self.epoll.ctl(ControlOperation::Modify, fd, EpollEvent::new(events, BACKEND_TOKEN));
                self.backend_armed = arm;
            }
        }
        let mut more = false;
        for (i, ring) in self.rings.iter_mut().enumerate() {
            if let Some(q) = ring.queue.as_mut() {
                if i == Slot::Rx.index() && !rx_has_frames {
                    continue;
                }
                more |= q.enable_notifications();
            }
        }
        more
    }

    fn disable_notifications(&mut self) {
        for ring in self.rings.iter_mut() {
            if let Some(q) = ring.queue.as_mut() {
                q.disable_notifications();
            }
        }
    }

    /// Sleeps until an event, or `timeout_ms` (-1: no timeout).
    fn sleep(&mut self, timeout_ms: i32) {
        let mut events = [EpollEvent::default(); 8];
        let n = match self.epoll.wait(timeout_ms, &mut events) {
            Ok(n) => n,
            Err(_) => return,
        };
        for ev in &events[..n] {
            let token = ev.data();
            if token == WAKE_TOKEN {
                let _ = self.wake.read();
            } else if token == BACKEND_TOKEN {
                // Frames or completions arrived: the next pass takes them.
                if let Engine::Blk { queue, .. } = &self.engine {
                    if let Some(fd) = queue.completion_fd() {
                        let mut v = [0u8; 8];
                        // SAFETY: reads 8 bytes into a local buffer from the
                        // backend's eventfd (readable: epoll said so).
                        unsafe { libc::read(fd, v.as_mut_ptr() as *mut libc::c_void, 8) };
                    }
                }
            } else if let Some(ring) = self.rings.get_mut(token as usize) {
                if let Some(k) = &ring.kick {
                    let _ = k.read();
                }
                ring.report.kicks += 1;
            }
        }
    }
}

fn add_queue_stats(a: QueueStats, b: QueueStats) -> QueueStats {
    QueueStats {
        chains: a.chains + b.chains,
        bad_chains: a.bad_chains + b.bad_chains,
        bad_index: a.bad_index + b.bad_index,
        bad_loop: a.bad_loop + b.bad_loop,
        bad_address: a.bad_address + b.bad_address,
        bad_direction: a.bad_direction + b.bad_direction,
        bad_indirect: a.bad_indirect + b.bad_indirect,
        batches: a.batches + b.batches,
        used_publishes: a.used_publishes + b.used_publishes,
        fast_chains: a.fast_chains + b.fast_chains,
        batch4: a.batch4 + b.batch4,
        used_skipped: a.used_skipped + b.used_skipped,
    }
}
