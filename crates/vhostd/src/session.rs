//! One vhost-user connection: the backend side of the protocol, on the
//! `vhost` crate's request handler. It owns the memory table and the ring
//! configuration, and starts and stops rings on the workers that run the
//! device's queue groups. It knows devices only through the `Device` trait.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::*;
use vhost::vhost_user::{Backend, GpuBackend, VhostUserBackendReqHandlerMut};
use vhost::vhost_user::{Error as VuError, Result as VuResult};
use vhost::VhostUserMemoryRegionBase;
use vhostd_device::{Device, InflightLog, RingPlace};
use virtq::ring::features as ring_features;
use virtq::{
    DirtyLog, GuestMemory, Mapping, PackedConfig, PackedQueue, Queue, Region, RingAddrs, SplitConfig, SplitQueue,
    LOG_PAGE,
};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::{FrontendAddrs, FrontendRegion};
use crate::pool::{Place, Pool};
use crate::worker::{GroupKey, Returned, RunState, Start, WorkerReport};

/// VHOST_USER_F_PROTOCOL_FEATURES
const PROTOCOL_FEATURES: u64 = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
/// VHOST_F_LOG_ALL: the frontend wants every store into guest memory
/// logged (live migration), in the log SET_LOG_BASE gives.
const LOG_ALL: u64 = VhostUserVirtioFeatures::LOG_ALL.bits();
/// The largest dirty log accepted: 1 GiB of bits covers 32 TiB of guest memory.
const MAX_LOG_BYTES: u64 = 1 << 30;

/// A device and where its queue groups run: what a session serves, and
/// what stays across connections.
pub struct Served {
    /// The device.
    pub device: Arc<dyn Device>,
    /// The workers its groups run on (shared, or its own).
    pub pool: Arc<Pool>,
    /// Its number on the pool's workers.
    pub id: u64,
    /// Its queues (its first groups; groups past them: the net control queue).
    pub queues: usize,
    /// Group `g` runs on `pool.workers[places[g].worker]`. Held while a
    /// ring is attached, and while a detach is sent (the group is then
    /// marked stopping until its answer), so a group never moves under it.
    places: Mutex<Vec<Place>>,
    /// State shared with the workers (NEEDS_RESET).
    pub run: Arc<RunState>,
}

impl Served {
    /// Places a device's `groups` on `pool` (the first `queues` are its
    /// queues: see `Pool::place_new`) and starts running them.
    pub fn new(
        name: &str,
        device: Arc<dyn Device>,
        groups: Vec<Box<dyn vhostd_device::QueueGroup>>,
        queues: usize,
        pool: Arc<Pool>,
    ) -> Served {
        let id = Pool::new_device();
        let run = Arc::new(RunState { name: name.to_string(), ..RunState::default() });
        let places = pool.place_new(groups.len(), queues);
        for (g, (group, p)) in groups.into_iter().zip(&places).enumerate() {
            pool.workers[p.worker].add(GroupKey { device: id, group: g }, group, run.clone());
        }
        Served { device, pool, id, queues, places: Mutex::new(places), run }
    }

    fn key(&self, group: usize) -> GroupKey {
        GroupKey { device: self.id, group }
    }

    fn lock_places(&self) -> std::sync::MutexGuard<'_, Vec<Place>> {
        self.places.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where each group runs now.
    pub fn places(&self) -> Vec<Place> {
        self.lock_places().clone()
    }

    /// Starts ring `slot` of group `group` on the group's worker.
    pub(crate) fn attach(&self, group: usize, slot: usize, start: Start) {
        let places = self.lock_places();
        if let Some(p) = places.get(group) {
            self.pool.workers[p.worker].attach(self.key(group), slot, start);
        }
    }

    /// Gives running ring `slot` of group `group` a new call descriptor in
    /// place (see `WorkerHandle::set_call`); false if it is not running.
    pub(crate) fn set_call(&self, group: usize, slot: usize, call: Option<EventFd>) -> bool {
        let places = self.lock_places();
        places.get(group).is_some_and(|p| self.pool.workers[p.worker].set_call(self.key(group), slot, call))
    }

    /// Takes ring `slot` of group `group` back from its worker. The wait
    /// (for the ring's requests in flight: as long as a hung disk takes)
    /// is made without the places lock, so `ctl list` and the balancer's
    /// looks go on; the group is marked stopping, and does not move.
    pub(crate) fn detach(&self, group: usize, slot: usize) -> Option<Returned> {
        let worker = {
            let mut places = self.lock_places();
            let p = places.get_mut(group)?;
            p.stopping = true;
            p.worker
        };
        let back = self.pool.workers[worker].detach(self.key(group), slot);
        if let Some(p) = self.lock_places().get_mut(group) {
            p.stopping = false;
        }
        back
    }

    /// Moves group `group` to worker `to` with its rings running (pinned
    /// there if `pin`; a pinned group moves only by another pin). Errors
    /// name what is out of range.
    pub fn move_group(&self, group: usize, to: usize, pin: bool) -> Result<(), String> {
        let mut places = self.lock_places();
        let n = places.len();
        let Some(p) = places.get_mut(group) else {
            return Err(format!("queue {group}: expected 0 to {}", n.saturating_sub(1)));
        };
        if to >= self.pool.workers.len() {
            return Err(format!("worker {to}: expected 0 to {}", self.pool.workers.len().saturating_sub(1)));
        }
        if p.pinned && !pin {
            return Ok(());
        }
        if p.stopping {
            return Err(format!("queue {group}: a ring of it is stopping (requests in flight); try again"));
        }
        if p.worker != to {
            let key = self.key(group);
            let _moving = self.pool.moving.write().unwrap_or_else(|e| e.into_inner());
            let Some(unit) = self.pool.workers[p.worker].take(key) else {
                return Err(format!("queue {group}: not found on worker {}", p.worker));
            };
            self.pool.workers[to].put(unit);
            self.pool.moved(p.worker, Some(to));
            tracing::info!(device = %self.run.name, group, from = p.worker, to, pin, "queue moved");
            p.worker = to;
        }
        p.pinned |= pin;
        Ok(())
    }

    /// Lets the balancer move group `group` again.
    pub fn unpin(&self, group: usize) -> Result<(), String> {
        let mut places = self.lock_places();
        let n = places.len();
        let p = places.get_mut(group).ok_or_else(|| format!("queue {group}: expected 0 to {}", n.saturating_sub(1)))?;
        p.pinned = false;
        Ok(())
    }

    /// This device's part of its pool's counters.
    pub fn reports(&self) -> Vec<WorkerReport> {
        crate::pool::of_device(&self.pool.reports(), self.id)
    }

    /// Takes every group off its worker (the device is going away; its
    /// rings were stopped with its last session) and, for a device's own
    /// pool, stops the workers. Returns the final counters.
    pub fn retire(&self) -> Vec<WorkerReport> {
        let mut reports = self.reports();
        let places = self.lock_places();
        for (g, p) in places.iter().enumerate() {
            // Its session reset the rings; after a panic in the session
            // some may still run: they stop (drained) before the group goes.
            if let Some(unit) = self.pool.workers[p.worker].take(self.key(g)) {
                unit.stop_rings();
            }
            self.pool.moved(p.worker, None);
        }
        if !self.pool.shared {
            let last = crate::pool::of_device(&self.pool.shutdown(), self.id);
            if !last.is_empty() {
                reports = last;
            }
        }
        reports
    }
    /// Features offered to the frontend: the device's, vhost-user's
    /// protocol features bit, and dirty logging.
    pub fn features(&self) -> u64 {
        self.device.features() | PROTOCOL_FEATURES | LOG_ALL
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        let f = VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::STATUS
            | VhostUserProtocolFeatures::LOG_SHMFD;
        // A net device announces a migrated guest's MAC (SEND_RARP).
        let f = if self.device.announces() { f | VhostUserProtocolFeatures::RARP } else { f };
        if self.device.tracks_inflight() {
            // Requests in flight survive a backend restart (split rings).
            f | VhostUserProtocolFeatures::INFLIGHT_SHMFD
        } else {
            f
        }
    }
}

#[derive(Default)]
struct Vring {
    num: u16,
    desc: u64,
    avail: u64,
    used: u64,
    addr_set: bool,
    /// SET_VRING_BASE as sent (packed rings use all 32 bits).
    base: u32,
    kick: Option<EventFd>,
    /// SET_VRING_KICK arrived (with or without an fd): the ring is started.
    started: bool,
    call: Option<EventFd>,
    err: Option<EventFd>,
    enabled: bool,
    /// A started ring that is not running (disabled) keeps its state here.
    parked: Option<Queue>,
    /// Where the ring runs while it runs.
    running: Option<RingPlace>,
    /// SET_VRING_ADDR's log_guest_addr when VHOST_VRING_F_LOG was set:
    /// where used-ring stores are logged.
    log_addr: Option<u64>,
}

/// The state of one connection.
pub struct Session {
    dev: Arc<Served>,
    owner: bool,
    features: u64,
    protocol: u64,
    mem: Arc<GuestMemory>,
    /// The table's regions in the frontend's address space (ring addresses).
    addrs: FrontendAddrs,
    /// How many times each region (gpa, size, uaddr) was added: QEMU sends
    /// ADD_MEM_REG / REM_MEM_REG once per queue pair for the same region.
    region_refs: std::collections::HashMap<(u64, u64, u64), u32>,
    vrings: Vec<Vring>,
    status: u8,
    /// The frontend's inflight memory (SET_INFLIGHT_FD) and its queue size,
    /// for a device that tracks requests in flight.
    inflight: Option<(Arc<Mapping>, u16)>,
    /// The dirty log of the last SET_LOG_BASE, and what it was (device,
    /// inode, size, offset: the same log sent again is kept). Stores are
    /// logged in it while LOG_ALL is acked.
    log: Option<(Arc<DirtyLog>, LogId)>,
}

/// What a SET_LOG_BASE log is: the file's device and inode, size, offset.
type LogId = (u64, u64, u64, u64);

/// Maps `size` bytes of the inflight file at `offset`, shared (sealed
/// against shrinking where it can be; refused past the end of the file).
fn map_inflight(file: &File, size: usize, offset: u64) -> VuResult<Arc<Mapping>> {
    let m = Mapping::map(file, offset, size as u64).map_err(|e| {
        tracing::warn!("cannot map the inflight memory: {e}");
        VuError::InvalidOperation("cannot map the inflight memory")
    })?;
    if !m.sealed() {
        tracing::warn!("the inflight memory file cannot be sealed against shrinking");
    }
    Ok(Arc::new(m))
}

fn err(msg: &'static str) -> VuError {
    tracing::warn!("refused frontend request: {msg}");
    VuError::InvalidOperation(msg)
}

/// A descriptor a peer sent to be an eventfd (a kick, call or error
/// eventfd over vhost-user; an MSI-X trigger over vfio-user), checked:
/// an anonymous inode (what eventfd, epoll and timerfd are; a write to any
/// but an eventfd fails at once), made non-blocking. A pipe nobody reads,
/// or an eventfd at its maximum count in blocking mode, would otherwise
/// block the worker or the frontends thread that writes it, and with it
/// every device there. The flag is on the peer's open file too; QEMU and
/// DPDK make theirs non-blocking anyway.
pub(crate) fn eventfd_from_peer(fd: std::os::fd::OwnedFd) -> std::io::Result<EventFd> {
    use std::os::unix::io::{AsRawFd, FromRawFd, IntoRawFd};
    let raw = fd.as_raw_fd();
    // SAFETY: a plain C struct, valid zeroed.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into `st`, ours; `raw` is open (owned by `fd`).
    if unsafe { libc::fstat(raw, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if st.st_mode & libc::S_IFMT != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("not an eventfd (file type {:#o})", st.st_mode & libc::S_IFMT),
        ));
    }
    // SAFETY: F_GETFL on a descriptor we own; no pointers.
    let flags = unsafe { libc::fcntl(raw, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: F_SETFL on a descriptor we own; no pointers.
    if unsafe { libc::fcntl(raw, libc::F_SETFL, flags | libc::O_NONBLOCK) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` owned a valid descriptor, handed over whole to the EventFd.
    Ok(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) })
}

/// `eventfd_from_peer` for a vhost-user message's descriptor.
fn to_eventfd(f: Option<File>) -> VuResult<Option<EventFd>> {
    match f.map(|f| eventfd_from_peer(f.into())) {
        None => Ok(None),
        Some(Ok(e)) => Ok(Some(e)),
        Some(Err(e)) => {
            tracing::warn!("a vring descriptor: {e}");
            Err(err("a vring descriptor that is not an eventfd"))
        }
    }
}

impl Session {
    /// A fresh session for the device.
    pub fn new(dev: Arc<Served>) -> Session {
        let nrings = dev.device.queues() as usize;
        Session {
            dev,
            owner: false,
            features: 0,
            protocol: 0,
            mem: Arc::new(GuestMemory::new()),
            addrs: FrontendAddrs::default(),
            region_refs: std::collections::HashMap::new(),
            vrings: (0..nrings).map(|_| Vring::default()).collect(),
            status: 0,
            inflight: None,
            log: None,
        }
    }

    /// Where ring `i` runs under the acked features, or None if the ring
    /// does not exist.
    fn locate(&self, i: usize) -> Option<RingPlace> {
        self.dev.device.place(u16::try_from(i).ok()?, self.features)
    }

    fn check_index(&self, i: u32) -> VuResult<()> {
        if (i as usize) < self.vrings.len() {
            Ok(())
        } else {
            Err(err("no such ring"))
        }
    }

    /// Whether ring `i` should be on its worker now.
    fn should_run(&self, i: usize) -> bool {
        let v = &self.vrings[i];
        // Without VHOST_USER_F_PROTOCOL_FEATURES rings start enabled.
        let enabled = v.enabled || self.features & PROTOCOL_FEATURES == 0;
        v.started && enabled && v.addr_set && self.locate(i).is_some()
    }

    /// Takes ring `i` off its worker (if running), keeping it parked.
    fn stop_ring(&mut self, i: usize) {
        let Some(place) = self.vrings[i].running.take() else { return };
        if let Some((q, kick, call)) = self.dev.detach(place.group, place.slot) {
            let v = &mut self.vrings[i];
            v.base = q.vring_base();
            v.parked = Some(q);
            v.kick = kick;
            v.call = call;
        }
    }

    /// Puts ring `i` on its worker if it should run; builds the queue on
    /// first start. A ring whose addresses are bad is refused and left stopped.
    fn start_ring(&mut self, i: usize) -> VuResult<()> {
        if self.vrings[i].running.is_some() || !self.should_run(i) {
            return Ok(());
        }
        let Some(place) = self.locate(i) else { return Ok(()) };
        let mut queue = match self.vrings[i].parked.take() {
            Some(q) => q,
            None => {
                let v = &self.vrings[i];
                // Ring addresses come in the frontend's address space.
                let gpa = |uaddr| self.addrs.to_gpa(uaddr).ok_or(virtq::SetupError::NotMapped);
                let made = if self.features & ring_features::RING_PACKED != 0 {
                    (|| {
                        let cfg = PackedConfig {
                            size: v.num,
                            desc: gpa(v.desc)?,
                            driver: gpa(v.avail)?,
                            device: gpa(v.used)?,
                            features: self.features,
                            base: v.base,
                        };
                        PackedQueue::new(self.mem.clone(), cfg).map(Queue::Packed)
                    })()
                } else if v.base > u16::MAX as u32 {
                    Err(virtq::SetupError::BadBase)
                } else {
                    (|| {
                        let cfg = SplitConfig {
                            size: v.num,
                            desc: gpa(v.desc)?,
                            avail: gpa(v.avail)?,
                            used: gpa(v.used)?,
                            features: self.features,
                            next_avail: v.base as u16,
                        };
                        SplitQueue::new(self.mem.clone(), cfg).map(Queue::Split)
                    })()
                };
                made.map_err(|e| {
                    tracing::warn!(ring = i, "cannot start ring: {e}");
                    VuError::InvalidOperation("cannot start the ring")
                })?
            }
        };
        queue.set_used_log(self.vrings[i].log_addr);
        let v = &mut self.vrings[i];
        // The worker gives kick and call back when the ring stops.
        let (kick, call) = (v.kick.take(), v.call.take());
        let err = v.err.as_ref().and_then(|c| c.try_clone().ok());
        // The inflight log covers split rings only.
        let inflight = match (&self.inflight, &queue) {
            (Some((map, qsize)), Queue::Split(_)) => InflightLog::new(map.clone(), i, *qsize),
            _ => None,
        };
        self.dev.attach(place.group, place.slot, Start { queue, kick, call, err, features: self.features, inflight });
        self.vrings[i].running = Some(place);
        Ok(())
    }

    /// Applies a change to ring `i`: stop it, let `f` edit it, restart.
    fn with_ring_stopped(&mut self, i: usize, f: impl FnOnce(&mut Vring)) -> VuResult<()> {
        self.stop_ring(i);
        f(&mut self.vrings[i]);
        self.start_ring(i)
    }

    /// The connection ended: drops every ring and the memory table.
    pub fn reset(&mut self) {
        self.reset_device_state();
        self.mem = Arc::new(GuestMemory::new());
        self.addrs = FrontendAddrs::default();
        self.region_refs.clear();
    }

    /// RESET_DEVICE and RESET_OWNER: every ring, the features and the
    /// device state go back to their initial state; the memory table stays.
    /// A frontend using ADD_MEM_REG (QEMU 8 and later with
    /// CONFIGURE_MEM_SLOTS) sends only changes to the table it believes we
    /// hold, so after a guest driver's reset it restarts the rings without
    /// resending the memory (DPDK and libvhost-user keep it too).
    fn reset_device_state(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop_ring(i);
        }
        // Whatever the features said, no ring outlives its connection.
        for i in 0..self.vrings.len() {
            for features in [self.features, 0] {
                if let Some(p) = self.dev.device.place(i as u16, features) {
                    let _ = self.dev.detach(p.group, p.slot);
                }
            }
        }
        for v in self.vrings.iter_mut() {
            *v = Vring::default();
        }
        self.features = 0;
        self.status = 0;
        self.inflight = None;
        // Logging ends with the features that asked for it.
        self.log = None;
        self.mem = Arc::new(self.mem.with_log(None));
        self.dev.run.needs_reset.store(false, Ordering::Release);
        self.dev.device.reset();
    }

    /// Installs a new memory table: running and parked rings are moved onto it.
    fn replace_memory(&mut self, mem: GuestMemory, addrs: FrontendAddrs) -> VuResult<()> {
        let running: Vec<usize> = (0..self.vrings.len()).filter(|&i| self.vrings[i].running.is_some()).collect();
        for &i in &running {
            self.stop_ring(i);
        }
        self.mem = Arc::new(mem);
        self.addrs = addrs;
        for v in self.vrings.iter_mut() {
            if let Some(q) = v.parked.take() {
                // Ring addresses are the frontend's: the new table may put
                // them at other guest-physical addresses.
                let at = (|| {
                    let gpa = |uaddr| self.addrs.to_gpa(uaddr).ok_or(virtq::SetupError::NotMapped);
                    Ok(RingAddrs { desc: gpa(v.desc)?, driver: gpa(v.avail)?, device: gpa(v.used)? })
                })();
                match at.and_then(|at| q.remap(self.mem.clone(), at)) {
                    Ok(q) => v.parked = Some(q),
                    Err(e) => {
                        // The ring now points outside memory: it stays stopped.
                        tracing::warn!("ring dropped after memory change: {e}");
                        v.base = q.vring_base();
                        v.started = false;
                    }
                }
            }
        }
        for i in running {
            let _ = self.start_ring(i);
        }
        Ok(())
    }

    /// The log stores must go to now: the last SET_LOG_BASE's while LOG_ALL
    /// is acked, else none.
    fn wanted_log(&self) -> Option<Arc<DirtyLog>> {
        (self.features & LOG_ALL != 0).then(|| self.log.as_ref().map(|(l, _)| l.clone())).flatten()
    }

    /// Moves the memory table, and every ring on it, under the log now
    /// wanted, if that changed. Rings stop and restart on the new table; a
    /// blk ring first completes its requests in flight, so nothing the
    /// device writes after this returns escapes the log (or, logging off,
    /// lands in a log the frontend has freed).
    fn apply_log(&mut self) -> VuResult<()> {
        let want = self.wanted_log();
        let same = match (self.mem.log(), &want) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if same {
            return Ok(());
        }
        tracing::info!("dirty logging {}", if want.is_some() { "on" } else { "off" });
        let mem = self.mem.with_log(want);
        let addrs = self.addrs.clone();
        self.replace_memory(mem, addrs)
    }

    /// The end of the highest region's guest-physical range.
    fn memory_end(&self) -> u64 {
        self.mem.regions().iter().map(|r| r.gpa().saturating_add(r.size())).max().unwrap_or(0)
    }

    /// Bytes of dirty log the memory table needs: a bit per page.
    fn log_bytes_needed(&self) -> u64 {
        self.memory_end().div_ceil(LOG_PAGE * 8)
    }

    /// Warns when the table reaches past the log: those pages cannot be
    /// marked. (QEMU grows the log before it grows the table.)
    fn check_log_covers(&self) {
        if let Some(log) = self.mem.log() {
            if self.log_bytes_needed() > log.len() as u64 {
                tracing::warn!(
                    "guest memory ends at {:#x}, past what the dirty log covers: stores there go unlogged",
                    self.memory_end()
                );
            }
        }
    }

    fn map_region(gpa: u64, size: u64, uaddr: u64, offset: u64, file: &File) -> VuResult<Region> {
        // Rings are read with aligned loads: a region must keep guest and
        // frontend addresses aligned in our mapping (every VMM uses pages).
        if !gpa.is_multiple_of(16) || !uaddr.is_multiple_of(16) || !offset.is_multiple_of(16) {
            return Err(err("memory region not 16-byte aligned (guest address, user address or mmap offset)"));
        }
        if uaddr.checked_add(size).is_none() {
            return Err(err("memory region past the end of the frontend's address space"));
        }
        let region = crate::memory::map_region(file, gpa, size, offset).map_err(|e| {
            tracing::warn!("cannot map memory region: {e}");
            VuError::InvalidOperation("cannot map the memory region")
        })?;
        if !region.mapping().sealed() {
            tracing::warn!(
                "memory region at {gpa:#x} is a file that cannot be sealed against shrinking (not a memfd): \
                 if the frontend truncates it, vhostd turns the region into zeros and the device asks for a reset"
            );
        }
        Ok(region)
    }

    /// Whether handling a message may wait on the backend: a ring runs on
    /// a device whose requests complete asynchronously (blk), and stopping
    /// it waits for the ones in flight (a hung disk: for as long as it hangs).
    pub fn may_wait_on_backend(&self) -> bool {
        self.dev.device.tracks_inflight() && self.vrings.iter().any(|v| v.running.is_some())
    }

    /// Device status as GET_STATUS reports it (NEEDS_RESET once a ring broke).
    pub fn status(&self) -> u8 {
        let mut s = self.status;
        if self.dev.run.needs_reset.load(Ordering::Acquire) {
            s |= 0x40;
        }
        s
    }

    /// SET_STATUS: status 0 resets the device.
    pub fn set_status(&mut self, status: u8) {
        if status == 0 {
            for i in 0..self.vrings.len() {
                self.stop_ring(i);
            }
            self.dev.run.needs_reset.store(false, Ordering::Release);
        }
        self.status = status;
    }

    /// Whether the frontend negotiated REPLY_ACK (we always offer
    /// VHOST_USER_F_PROTOCOL_FEATURES, so SET_PROTOCOL_FEATURES decides).
    pub fn reply_ack(&self) -> bool {
        self.protocol & VhostUserProtocolFeatures::REPLY_ACK.bits() != 0
    }

    /// SEND_RARP (QEMU, after a migration, for a guest without
    /// GUEST_ANNOUNCE): the device sends a RARP frame from `mac`. None when
    /// the protocol feature was not negotiated; else whether it will send.
    pub fn send_rarp(&self, mac: [u8; 6]) -> Option<bool> {
        if self.protocol & VhostUserProtocolFeatures::RARP.bits() == 0 {
            return None;
        }
        tracing::info!("SEND_RARP for {}", vhostd_net::mac_string(mac));
        Some(self.dev.device.announce(mac))
    }

    /// SET_VRING_ENABLE, answered here rather than by the `vhost` crate,
    /// which refuses it before SET_FEATURES; QEMU sends it that early.
    pub fn vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        self.set_vring_enable(index, enable)
    }
}

impl VhostUserBackendReqHandlerMut for Session {
    fn set_owner(&mut self) -> VuResult<()> {
        // QEMU sends SET_OWNER once per queue pair on the same connection;
        // libvhost-user and DPDK accept that, so do we.
        self.owner = true;
        Ok(())
    }

    fn reset_owner(&mut self) -> VuResult<()> {
        self.reset_device_state();
        self.owner = false;
        Ok(())
    }

    fn reset_device(&mut self) -> VuResult<()> {
        self.reset_device_state();
        Ok(())
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(self.dev.features())
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !self.dev.features() != 0 {
            tracing::warn!("SET_FEATURES {features:#x}: bits {:#x} were not offered", features & !self.dev.features());
            return Err(err("SET_FEATURES with features we did not offer"));
        }
        // A change (QEMU sends SET_FEATURES again, a hostile frontend drops
        // MQ under running rings): take every ring off its worker while the
        // old features still say where it runs, and rebuild them for the new
        // ones from where they stopped.
        // LOG_ALL alone (QEMU sets and clears it while rings run) changes
        // only where stores are logged: rings keep their state.
        let running: Vec<usize> = (0..self.vrings.len()).filter(|&i| self.vrings[i].running.is_some()).collect();
        let changed = (features ^ self.features) & !LOG_ALL != 0;
        if changed {
            for &i in &running {
                self.stop_ring(i);
            }
            for v in self.vrings.iter_mut() {
                v.parked = None;
            }
        }
        self.features = features;
        if !changed {
            return self.apply_log();
        }
        // Every ring is stopped: the table changes its log under none.
        self.mem = Arc::new(self.mem.with_log(self.wanted_log()));
        tracing::info!("features acked: {}", describe_acked(features, self.dev.device.as_ref()));
        for i in running {
            // A ring that cannot run under the new features stays stopped.
            let _ = self.start_ring(i);
        }
        self.dev.device.set_features(features & !LOG_ALL);
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        if ctx.len() != files.len() {
            return Err(err("SET_MEM_TABLE region and fd counts differ"));
        }
        let mut regions = Vec::with_capacity(ctx.len());
        let mut addrs = FrontendAddrs::default();
        for (r, f) in ctx.iter().zip(files.iter()) {
            let (gpa, size, uaddr, offset) = (r.guest_phys_addr, r.memory_size, r.user_addr, r.mmap_offset);
            tracing::debug!(gpa, size, uaddr, offset, "memory region");
            regions.push(Self::map_region(gpa, size, uaddr, offset, f)?);
            let fr = FrontendRegion { gpa, size, uaddr };
            addrs = addrs.with(fr).map_err(|_| err("memory regions overlap"))?;
        }
        // A dirty log set before stays on: the table changes, the log does not.
        let mem = GuestMemory::from_regions(regions).map_err(|_| err("memory regions overlap"))?;
        let mem = mem.with_log(self.mem.log().cloned());
        self.region_refs = addrs.regions().iter().map(|r| ((r.gpa, r.size, r.uaddr), 1)).collect();
        self.replace_memory(mem, addrs)?;
        self.check_log_covers();
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        // Split rings must be a power of two; packed rings may be any size
        // (virtio 1.2, 2.8). Without RING_PACKED acked this is a split ring.
        let packed = self.features & ring_features::RING_PACKED != 0;
        if num == 0 || num > self.dev.device.max_queue_size() as u32 || (!packed && !num.is_power_of_two()) {
            return Err(err("ring size is zero, above --queue-size, or (split ring) not a power of two"));
        }
        let i = index as usize;
        self.check_index(index)?;
        self.with_ring_stopped(i, |v| {
            v.num = num as u16;
            v.parked = None;
        })
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> VuResult<()> {
        self.check_index(index)?;
        // VHOST_VRING_F_LOG may come before any SET_LOG_BASE: QEMU's
        // vhost_dev_start sends the ring addresses of a device started
        // while migrating first, and the log after them. It takes effect
        // once a log is set.
        let log_addr = flags.contains(VhostUserVringAddrFlags::VHOST_VRING_F_LOG).then_some(log);
        tracing::debug!(ring = index, descriptor, used, available, ?log_addr, "ring addresses");
        let i = index as usize;
        self.with_ring_stopped(i, |v| {
            // The same addresses again (QEMU turning logging on or off for
            // a running ring): the ring keeps its state.
            if !(v.addr_set && v.desc == descriptor && v.used == used && v.avail == available) {
                v.parked = None;
            }
            v.desc = descriptor;
            v.used = used;
            v.avail = available;
            v.addr_set = true;
            v.log_addr = log_addr;
        })
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VuResult<()> {
        // Bits 16-31 only mean something on a packed ring (used position);
        // a split ring with them set is refused when it starts.
        self.check_index(index)?;
        self.with_ring_stopped(index as usize, |v| {
            v.base = base;
            v.parked = None;
        })
    }

    fn get_vring_base(&mut self, index: u32) -> VuResult<VhostUserVringState> {
        self.check_index(index)?;
        let i = index as usize;
        self.stop_ring(i);
        let v = &mut self.vrings[i];
        let base = match v.parked.take() {
            Some(q) => q.vring_base(),
            None => v.base,
        };
        // The ring is stopped until the next SET_VRING_KICK.
        v.base = base;
        v.started = false;
        v.kick = None;
        Ok(VhostUserVringState::new(index, base))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        self.check_index(index as u32)?;
        let kick = to_eventfd(fd)?;
        self.with_ring_stopped(index as usize, |v| {
            v.kick = kick;
            v.started = true;
        })
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        self.check_index(index as u32)?;
        let call = to_eventfd(fd)?;
        let i = index as usize;
        // A running ring takes it in place, between two passes: QEMU sends
        // one whenever the guest masks or moves the ring's MSI-X vector,
        // and stopping the ring would wait for its requests in flight (as
        // long as a hung disk takes) on the thread serving every frontend.
        if let Some(place) = self.vrings[i].running {
            let spare = call.as_ref().and_then(|c| c.try_clone().ok());
            if call.is_none() || spare.is_some() {
                if self.dev.set_call(place.group, place.slot, call) {
                    return Ok(());
                }
                return self.with_ring_stopped(i, |v| v.call = spare);
            }
        }
        self.with_ring_stopped(i, |v| v.call = call)
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        self.check_index(index as u32)?;
        let e = to_eventfd(fd)?;
        self.with_ring_stopped(index as usize, |v| v.err = e)
    }

    fn get_protocol_features(&mut self) -> VuResult<VhostUserProtocolFeatures> {
        Ok(self.dev.protocol_features())
    }

    fn set_protocol_features(&mut self, features: u64) -> VuResult<()> {
        if features & !self.dev.protocol_features().bits() != 0 {
            return Err(err("SET_PROTOCOL_FEATURES with features we did not offer"));
        }
        self.protocol = features;
        Ok(())
    }

    fn get_queue_num(&mut self) -> VuResult<u64> {
        // Virtqueues, as the spec and libvhost-user count them (QEMU reads
        // it as an upper bound on queue pairs, which this also satisfies).
        Ok(self.dev.device.queues() as u64)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        self.check_index(index)?;
        self.with_ring_stopped(index as usize, |v| v.enabled = enable)
    }

    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> VuResult<Vec<u8>> {
        self.dev.device.read_config(offset, size).ok_or_else(|| err("GET_CONFIG outside the config space"))
    }

    fn set_config(&mut self, offset: u32, buf: &[u8], _flags: VhostUserConfigFlags) -> VuResult<()> {
        if self.dev.device.write_config(offset, buf, self.features) {
            Ok(())
        } else {
            Err(err("SET_CONFIG of a field the driver may not write"))
        }
    }

    fn set_backend_req_fd(&mut self, _backend: Backend) {}

    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> VuResult<()> {
        Err(err("GPU_SET_SOCKET"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VuResult<File> {
        Err(err("GET_SHARED_OBJECT"))
    }

    fn get_inflight_fd(&mut self, inflight: &VhostUserInflight) -> VuResult<(VhostUserInflight, File)> {
        let (nq, qs) = (inflight.num_queues, inflight.queue_size);
        if !self.dev.device.tracks_inflight() || nq == 0 || nq > self.dev.device.queues() || qs == 0 || qs > 32768 {
            return Err(err("GET_INFLIGHT_FD: the device keeps no inflight log, or bad num_queues / queue_size"));
        }
        let size = nq as usize * vhostd_device::inflight::region_size(qs);
        // SAFETY: memfd_create with a static C name; the fd is checked.
        let fd =
            unsafe { libc::memfd_create(c"vhostd-inflight".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(VuError::ReqHandlerError(std::io::Error::last_os_error()));
        }
        // SAFETY: fd is a memfd we just created and now own.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(size as u64).map_err(VuError::ReqHandlerError)?;
        let map = map_inflight(&file, size, 0)?;
        self.inflight = Some((map, qs));
        tracing::info!("inflight memory created: {nq} queue(s) of {qs}, {size} bytes");
        Ok((VhostUserInflight { mmap_size: size as u64, mmap_offset: 0, num_queues: nq, queue_size: qs }, file))
    }

    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> VuResult<()> {
        let (nq, qs) = (inflight.num_queues, inflight.queue_size);
        if !self.dev.device.tracks_inflight() || nq == 0 || qs == 0 || qs > 32768 {
            return Err(err("SET_INFLIGHT_FD: the device keeps no inflight log, or bad num_queues / queue_size"));
        }
        let need = nq as u64 * vhostd_device::inflight::region_size(qs) as u64;
        let len = file.metadata().map_err(VuError::ReqHandlerError)?.len();
        let (size, off) = (inflight.mmap_size, inflight.mmap_offset);
        if size < need || off % 4096 != 0 || off.checked_add(size).is_none_or(|end| end > len) || size > 1 << 30 {
            return Err(err("SET_INFLIGHT_FD: region smaller than its queues or past the end of the file"));
        }
        let map = map_inflight(&file, size as usize, off)?;
        // Rings already running pick it up at their next start.
        self.inflight = Some((map, qs));
        tracing::info!("inflight memory from the frontend: {nq} queue(s) of {qs}, {size} bytes");
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VuResult<u64> {
        Ok(virtq::MAX_REGIONS as u64)
    }

    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        _postcopy_listening: Option<bool>,
    ) -> VuResult<Option<VhostUserMemoryRegionBase>> {
        let key = (region.guest_phys_addr, region.memory_size, region.user_addr);
        if let Some(n) = self.region_refs.get_mut(&key) {
            // The same region again (QEMU: once per queue pair).
            *n += 1;
            return Ok(None);
        }
        let r =
            Self::map_region(region.guest_phys_addr, region.memory_size, region.user_addr, region.mmap_offset, &fd)?;
        let refused = |e: &dyn std::fmt::Display| {
            tracing::warn!("ADD_MEM_REG refused: {e}");
            VuError::InvalidOperation("ADD_MEM_REG refused")
        };
        let fr = FrontendRegion { gpa: region.guest_phys_addr, size: region.memory_size, uaddr: region.user_addr };
        let addrs = self.addrs.with(fr).map_err(|_| refused(&"memory regions overlap"))?;
        let mem = self.mem.with_region(r).map_err(|e| refused(&e))?;
        self.region_refs.insert(key, 1);
        self.replace_memory(mem, addrs)?;
        self.check_log_covers();
        Ok(None)
    }

    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> VuResult<()> {
        let key = (region.guest_phys_addr, region.memory_size, region.user_addr);
        match self.region_refs.get_mut(&key) {
            Some(n) if *n > 1 => {
                *n -= 1;
                return Ok(());
            }
            Some(_) => {}
            None => return Err(err("REM_MEM_REG of a region not in the table")),
        }
        let mem = self
            .mem
            .without_region(region.guest_phys_addr, region.memory_size)
            .map_err(|_| err("REM_MEM_REG of a region not in the table"))?;
        let addrs = self
            .addrs
            .without(region.guest_phys_addr, region.memory_size)
            .map_err(|_| err("REM_MEM_REG of a region not in the table"))?;
        self.region_refs.remove(&key);
        self.replace_memory(mem, addrs)
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VuResult<Option<File>> {
        Err(err("SET_DEVICE_STATE_FD"))
    }

    fn check_device_state(&mut self) -> VuResult<()> {
        Err(err("CHECK_DEVICE_STATE"))
    }

    fn get_shmem_config(&mut self) -> VuResult<VhostUserShMemConfig> {
        Err(err("GET_SHMEM_CONFIG"))
    }

    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> VuResult<()> {
        use std::os::unix::fs::MetadataExt;
        let (size, offset) = (log.mmap_size, log.mmap_offset);
        if size == 0 || size > MAX_LOG_BYTES {
            return Err(err("SET_LOG_BASE: log size zero or above 1 GiB"));
        }
        // Every page of the memory table needs its bit.
        if self.log_bytes_needed() > size {
            return Err(err("SET_LOG_BASE: the log is smaller than the guest memory it must cover"));
        }
        let meta = file.metadata().map_err(VuError::ReqHandlerError)?;
        let id = (meta.dev(), meta.ino(), size, offset);
        if self.log.as_ref().is_some_and(|(_, was)| *was == id) {
            // QEMU 7.2 sends the same log once per queue pair.
            return Ok(());
        }
        let (map, skip) = crate::memory::map_shared(&file, size, offset).map_err(|e| {
            tracing::warn!("cannot map the dirty log: {e}");
            VuError::InvalidOperation("cannot map the dirty log")
        })?;
        let dirty =
            DirtyLog::new(map, skip as usize, size as usize).ok_or_else(|| err("SET_LOG_BASE: bad log size"))?;
        tracing::info!("dirty log set: {size} bytes at offset {offset}, pages below {:#x}", size * 8 * LOG_PAGE);
        // The previous log stays mapped until nothing holds it.
        self.log = Some((Arc::new(dirty), id));
        self.apply_log()
    }
}

/// Acked features as the log shows them (both transports): the hex value,
/// then the ring layout and what the device makes of them, e.g.
/// `0x... (packed ring, hotplug)`.
pub(crate) fn describe_acked(features: u64, device: &dyn vhostd_device::Device) -> String {
    let more = device.describe_features(features);
    format!(
        "{features:#x} ({} ring{}{}{})",
        if features & ring_features::RING_PACKED != 0 { "packed" } else { "split" },
        if features & ring_features::IN_ORDER != 0 { ", in-order" } else { "" },
        if more.is_empty() { "" } else { ", " },
        more,
    )
}
