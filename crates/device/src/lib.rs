//! The seam between vhostd's devices and everything else. A device (net,
//! blk, ...) implements two traits and knows nothing of transports or
//! threads:
//!
//! - [`Device`]: what the device is as a whole: its features, its config
//!   space, how many virtqueues it has and which queue group each runs in,
//!   what acking features and a reset do. A transport (the vhost-user
//!   session) drives it.
//! - [`QueueGroup`]: rings that run together (a net queue pair and its
//!   backend, a blk request queue and its backend, a control queue). A
//!   dataplane worker runs any group: it attaches and detaches the group's
//!   rings, calls [`QueueGroup::poll`] for one pass of work, and sleeps on the
//!   kicks and on the group's event descriptor when there is none.
//!
//! Rings reach a group as [`Ring`]s: the queue, its batch, and the call
//! descriptor the group signals after publishing used entries. Kicks, errors,
//! modes and sleeping stay with the worker.

pub mod inflight;
pub mod requests;
pub use inflight::InflightLog;
pub use requests::RequestRing;

use std::os::unix::io::RawFd;

use virtq::{Batch, Queue, QueueStats};
use vmm_sys_util::eventfd::EventFd;

/// Where a virtqueue runs: its queue group and its ring slot in the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingPlace {
    /// Index of the group among the device's groups.
    pub group: usize,
    /// The ring's slot in the group.
    pub slot: usize,
}

/// A device as a whole, as a transport sees it.
pub trait Device: Send + Sync {
    /// What the device is ("net", "blk"): logs and counters.
    fn kind(&self) -> &'static str;
    /// The virtio feature bits offered: the device's, and the ring features
    /// (VERSION_1, EVENT_IDX, RING_PACKED, ...) it supports.
    fn features(&self) -> u64;
    /// Virtqueues the device has at most.
    fn queues(&self) -> u16;
    /// The largest ring a driver may set up.
    fn max_queue_size(&self) -> u16;
    /// Where virtqueue `index` runs once the driver acked `features`; None
    /// if there is no such queue. Before features are acked (0) every data
    /// queue the device may have is placed; a queue that only a feature
    /// brings (net's control queue) is placed once that feature is acked.
    fn place(&self, index: u16, features: u64) -> Option<RingPlace>;
    /// The config space bytes [offset, offset + len); None when the range
    /// is not one the device serves.
    fn read_config(&self, offset: u32, len: u32) -> Option<Vec<u8>>;
    /// A driver's write to the config space; false if refused.
    fn write_config(&self, offset: u32, data: &[u8], features: u64) -> bool;
    /// The driver acked `features` (a subset of `features()`).
    fn set_features(&self, features: u64);
    /// The driver went away or reset the device: back to how it started.
    fn reset(&self);
    /// Requests in flight survive a backend restart when the transport
    /// keeps a log of them (vhost-user's INFLIGHT_SHMFD).
    fn tracks_inflight(&self) -> bool {
        false
    }
    /// Whether the device can announce a MAC on its wire ([`Device::announce`]).
    fn announces(&self) -> bool {
        false
    }
    /// Sends a RARP frame from `mac` out through the backend soon (vhost-
    /// user's SEND_RARP: after a live migration, for a guest that cannot
    /// announce itself, so switches learn its new port). False if the
    /// device cannot.
    fn announce(&self, _mac: [u8; 6]) -> bool {
        false
    }
    /// The link state the device's config reports, when it follows a
    /// host interface's (net over a TAP or AF_XDP): a transport that keeps
    /// the config itself notices a change (the host's link events) and
    /// tells the driver. None: nothing to follow.
    fn link_up(&self) -> Option<bool> {
        None
    }
    /// Whether a driver that acked `features` reads the link state (net:
    /// VIRTIO_NET_F_STATUS), so that a change is worth an interrupt.
    fn link_reported(&self, _features: u64) -> bool {
        false
    }
    /// The negotiated features that matter, for the log ("mergeable rx").
    fn describe_features(&self, _features: u64) -> String {
        String::new()
    }
    /// The virtqueue index of the ring at `place`, and its role among the
    /// device's rings ("rx", "tx", "ctrl"; None when all are alike).
    fn ring_label(&self, place: RingPlace) -> (u16, Option<&'static str>);
    /// Whether the ring at `place` shows in the counters (a device may
    /// leave out a ring the driver never used, such as a control queue).
    fn ring_shown(&self, _place: RingPlace, _queue: &QueueStats) -> bool {
        true
    }
    /// The device's summary of its rings' counters: the `stats total` line
    /// (key, value) in the order it prints.
    fn totals(&self, rings: &[RingTotals<'_>]) -> Vec<(&'static str, String)>;
}

/// One ring of a running queue group: the queue, the batch its chains are
/// popped into, and the descriptor that interrupts the driver.
pub struct Ring {
    /// The virtqueue.
    pub queue: Queue,
    /// Chains popped in the current pass (reused; holds the ring's memory).
    pub batch: Batch,
    call: Option<EventFd>,
    /// Counters the worker and the group keep for this ring.
    pub counters: RingCounters,
}

/// What the dataplane counts of a ring, whatever the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingCounters {
    /// Kick wake-ups.
    pub kicks: u64,
    /// Interrupts sent (call descriptor writes), besides the one the worker
    /// sends as the ring starts.
    pub notifies: u64,
    /// TSC cycles of passes that did work on this ring.
    pub busy_cycles: u64,
}

impl std::ops::AddAssign for RingCounters {
    fn add_assign(&mut self, b: RingCounters) {
        self.kicks += b.kicks;
        self.notifies += b.notifies;
        self.busy_cycles += b.busy_cycles;
    }
}

impl Ring {
    /// A ring over `queue`, interrupting the driver through `call` (None:
    /// the driver polls).
    pub fn new(queue: Queue, batch: Batch, call: Option<EventFd>) -> Ring {
        Ring { queue, batch, call, counters: RingCounters::default() }
    }

    /// Replaces the call descriptor (the driver's interrupt moved) and
    /// returns the old one; the ring runs on.
    pub fn set_call(&mut self, call: Option<EventFd>) -> Option<EventFd> {
        std::mem::replace(&mut self.call, call)
    }

    /// Takes the ring apart (it stops): the queue, the batch, the call descriptor.
    pub fn into_parts(self) -> (Queue, Batch, Option<EventFd>) {
        (self.queue, self.batch, self.call)
    }

    /// Tells the driver about published used entries if it wants to hear.
    /// Inlined into the groups' passes, like the rest of the ring's hot path.
    #[inline(always)]
    pub fn notify(&mut self) {
        if self.queue.needs_notify() {
            if let Some(call) = &self.call {
                let _ = call.write(1);
            }
            self.counters.notifies += 1;
        }
    }
}

/// What one pass over a group's rings did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Work done (frames, requests); 0 when the pass was idle. The fields
    /// below matter only then.
    pub work: usize,
    /// Work the backend put off remains and no event will announce when it
    /// can go on: a sleeping worker wakes again soon to retry it.
    pub deferred: bool,
    /// The driver has work the group cannot take now and no event will say
    /// when it can (every AF_XDP TX frame awaits its completion): the worker
    /// keeps looking, briefly spinning, then every millisecond.
    pub stalled: bool,
    /// Requests are in flight that the kernel finishes, often on this CPU:
    /// a polling worker yields its CPU instead of spinning.
    pub yields: bool,
    /// A full burst came from a driver that does not wait for it to be
    /// used, and nothing went back (one-way net TX): the next burst is a
    /// gap away, and polling the ring in that gap only pulls lines the
    /// driver is writing. Set on a pass with work; the worker then backs
    /// off longer while idle.
    pub streaming: bool,
}

impl Pass {
    /// A pass that did `work`, with nothing to say if it was idle.
    pub fn did(work: usize) -> Pass {
        Pass { work, ..Pass::default() }
    }

    /// Adds another group's pass to this one (a worker's pass over all).
    pub fn and(self, b: Pass) -> Pass {
        Pass {
            work: self.work + b.work,
            deferred: self.deferred | b.deferred,
            stalled: self.stalled | b.stalled,
            yields: self.yields | b.yields,
            streaming: self.streaming | b.streaming,
        }
    }
}

/// What a group says before its worker sleeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sleep {
    /// Work arrived meanwhile: do not sleep.
    pub work: bool,
    /// Wake up when the group's event descriptor becomes readable.
    pub watch_event_fd: bool,
}

/// One counter of a device's, with what the Prometheus exposition calls it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counter {
    /// Key in the key=value and JSON renderings; dotted to nest
    /// ("drops.too_big" is `too_big` inside `drops`; key=value lines show
    /// only keys without a dot).
    pub key: &'static str,
    /// The value.
    pub value: u64,
    /// The metric it is a sample of (None: not exported, e.g. a sum of
    /// others).
    pub metric: Option<Metric>,
}

/// A Prometheus metric family and, optionally, the label that tells this
/// counter from the family's others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Metric {
    /// Family name (`vhostd_queue_packets_total`).
    pub name: &'static str,
    /// Its HELP text.
    pub help: &'static str,
    /// A gauge (else a counter).
    pub gauge: bool,
    /// (label, value) of this sample, e.g. ("reason", "too_big").
    pub label: Option<(&'static str, &'static str)>,
}

impl Counter {
    /// A counter exported as a sample of `metric`.
    pub const fn new(key: &'static str, value: u64, metric: Metric) -> Counter {
        Counter { key, value, metric: Some(metric) }
    }

    /// A counter the exposition leaves out.
    pub const fn plain(key: &'static str, value: u64) -> Counter {
        Counter { key, value, metric: None }
    }
}

impl Metric {
    /// A counter family.
    pub const fn counter(name: &'static str, help: &'static str) -> Metric {
        Metric { name, help, gauge: false, label: None }
    }

    /// A gauge family.
    pub const fn gauge(name: &'static str, help: &'static str) -> Metric {
        Metric { name, help, gauge: true, label: None }
    }

    /// This family's sample with `label` = `value`.
    pub const fn with(self, label: &'static str, value: &'static str) -> Metric {
        Metric { label: Some((label, value)), ..self }
    }
}

/// Counters of a queue group: per ring slot, and for the group as a whole
/// (its backend), in the order they print.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Per ring slot.
    pub rings: Vec<Vec<Counter>>,
    /// The group's own.
    pub group: Vec<Counter>,
}

/// A ring's counters as a device sums them into its totals.
pub struct RingTotals<'a> {
    /// Where the ring runs.
    pub place: RingPlace,
    /// The device's counters of the ring.
    pub counters: &'a [Counter],
    /// Chains the ring rejected.
    pub bad_chains: u64,
    /// TSC cycles of passes that did work on it.
    pub busy_cycles: u64,
}

/// Looks a counter up by key.
pub fn value_of(counters: &[Counter], key: &str) -> u64 {
    counters.iter().find(|c| c.key == key).map_or(0, |c| c.value)
}

/// Wakes the worker a group runs on (a group that changes what another
/// group of its device should do, e.g. the net control queue enabling
/// queue pairs, wakes their workers).
pub struct Waker(EventFd);

impl Waker {
    /// A waker writing to `fd`.
    pub fn new(fd: EventFd) -> Waker {
        Waker(fd)
    }

    /// Wakes the worker.
    pub fn wake(&self) {
        let _ = self.0.write(1);
    }

    /// Another handle on the same worker.
    pub fn try_clone(&self) -> std::io::Result<Waker> {
        self.0.try_clone().map(Waker)
    }
}

/// Rings that run together on one worker, and the device's work on them.
pub trait QueueGroup: Send {
    /// Ring slots the group has.
    fn ring_slots(&self) -> usize;
    /// Ring `slot` starts with the driver's `features`; `inflight` is a log
    /// of its requests in flight kept by the transport (split rings of a
    /// device that `tracks_inflight`): requests a previous backend left
    /// there run again.
    fn attach(&mut self, slot: usize, ring: &mut Ring, features: u64, inflight: Option<InflightLog>);
    /// Ring `slot` is to stop: take no new work from it, and say whether
    /// nothing of it is still in flight (then `detach` follows at once).
    /// Until it says so, `poll` goes on completing what is in flight and
    /// this is asked again after each pass: a backend that is slow to
    /// finish (a hung disk) holds up this ring's stop, not the worker's
    /// other groups.
    fn stop(&mut self, _slot: usize, _ring: &mut Ring) -> bool {
        true
    }
    /// Ring `slot` stops: nothing of it may be in flight when this returns
    /// (a backend could still write into its buffers). After `stop` said
    /// so, this waits for nothing.
    fn detach(&mut self, _slot: usize, _ring: &mut Ring) {}
    /// One pass of work over the running rings (`rings[slot]`; None: not
    /// running): the work done and, when there was none, how the worker
    /// should wait. A pass that found no work also retries what the
    /// backend put off. (The idle state comes back from `poll` rather than
    /// from calls of its own: at queue depth 1 half the passes are idle,
    /// and three more calls each cost blk 4% of its IOPS.)
    fn poll(&mut self, rings: &mut [Option<Ring>]) -> Pass;
    /// A descriptor that becomes readable when the group has work without
    /// a kick (a backend's frames or completions).
    fn event_fd(&self) -> Option<RawFd> {
        None
    }
    /// The worker is about to sleep: ask for kicks on the rings where a kick
    /// means work, and say whether work arrived meanwhile and whether the
    /// event descriptor should wake the worker. By default every running
    /// ring asks for kicks and the event descriptor is watched.
    fn prepare_sleep(&mut self, rings: &mut [Option<Ring>]) -> Sleep {
        let mut work = false;
        for r in rings.iter_mut().flatten() {
            work |= r.queue.enable_notifications();
        }
        Sleep { work, watch_event_fd: true }
    }
    /// The worker woke on the event descriptor.
    fn on_event(&mut self) {}
    /// The group now runs on the worker `waker` wakes.
    fn placed(&mut self, _waker: &Waker) {}
    /// The group's counters; `queues[slot]` are the chain counters of its
    /// rings so far (a device may fold them into its own, e.g. chains
    /// dropped as malformed).
    fn counters(&self, queues: &[QueueStats]) -> Counters;
}

/// A device and its queue groups, as a device builder makes them: the
/// groups go to workers, the device to the transport.
pub struct Built {
    /// The device.
    pub device: std::sync::Arc<dyn Device>,
    /// Its queue groups (`RingPlace::group` indexes them).
    pub groups: Vec<Box<dyn QueueGroup>>,
}

/// The time-stamp counter: what busy cycles are counted in.
#[inline]
pub fn tsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86_64.
        #[allow(unused_unsafe)]
        unsafe {
            core::arch::x86_64::_rdtsc()
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}
