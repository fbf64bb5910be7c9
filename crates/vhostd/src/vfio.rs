//! The vfio-user transport: one connection of a VMM's `vfio-user-pci`
//! client, served by the vhostd-vfio-user `Server`, in front of a
//! virtio-pci device model (vhostd-virtio-pci) of the device. It drives the
//! device through the `Device` trait and hands rings to the same workers as
//! the vhost-user session, with the same `Start` (kick eventfd in, call
//! eventfd out).
//!
//! - DMA_MAP with a descriptor becomes a guest memory region at IOVA =
//!   guest physical address; maps without one (QEMU's ROMs and BAR pages)
//!   are accepted and never reached.
//! - queue_enable (once DRIVER_OK is set) attaches the ring; the call
//!   descriptor is the MSI-X vector's eventfd from SET_IRQS. A vector's
//!   eventfd that changes under a running ring (or the ring's vector) is
//!   swapped in place on its worker: the ring does not stop.
//! - Rings run only while Bus Master Enable (PCI command bit 2) is set:
//!   clearing it stops them (parked with their state, as for an unmap),
//!   setting it starts the enabled ones again, or for the first time (a
//!   driver may set it after DRIVER_OK).
//! - Doorbells: trapped (REGION_WRITE) in interrupt and adaptive modes:
//!   the write becomes a write to the ring's kick eventfd, and the device's
//!   event suppression keeps those messages rare while it is busy. In poll
//!   mode the doorbell page is a sparse mmap area of BAR0: the guest's
//!   kicks land in memory nobody reads, and the polling worker finds the
//!   work by itself.
//! - DEVICE_RESET and device status 0 stop every ring and reset the device;
//!   so does the end of the connection, which also drops every DMA map and
//!   MSI-X eventfd (the next client starts afresh). DEVICE_RESET, a
//!   function-level reset, also puts the PCI config space back to its
//!   power-on values; status 0 leaves it alone.
//! - Configuration changes: net's link status follows a host interface
//!   (`Device::link_up`). The frontends thread hears the host's link
//!   events (rtnetlink) and calls [`VfioConn::link_event`]: when the
//!   state differs from the last seen, config_generation moves on, the
//!   ISR's configuration bit is set and the msix_config vector's eventfd
//!   is signalled (a driver that is DRIVER_OK, acked VIRTIO_NET_F_STATUS
//!   and set the vector): the guest's driver reads the status again.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhostd_device::RingPlace;
use vhostd_vfio_user::{
    wire, DeviceInfo, DmaMap, Errno, Event, IrqAction, IrqData, IrqInfo, IrqSet, RegionInfo, Server, ServerConfig,
    SparseArea, VfioDevice,
};
use vhostd_virtio_pci::{self as vpci, Effect, VirtioPci};
use virtq::ring::features as ring_features;
use virtq::{GuestMemory, PackedConfig, PackedQueue, Queue, RingAddrs, SplitConfig, SplitQueue};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::connection::Step;
use crate::session::Served;
use crate::worker::{Mode, Start};

/// vfio-pci's region indexes (linux/vfio.h).
const BAR0: u32 = 0;
const BAR1: u32 = 1;
const CONFIG_REGION: u32 = 7;
const NUM_REGIONS: u32 = 9;
/// vfio-pci's interrupt indexes: INTx, MSI, MSI-X, ERR, REQ.
const MSIX_IRQ: u32 = 2;
const NUM_IRQS: u32 = 5;

/// The most messages answered in one go (as for vhost-user).
const BURST: usize = 64;

/// One ring's transport state.
#[derive(Default)]
struct Ring {
    /// Where it runs while it runs.
    running: Option<RingPlace>,
    /// A ring stopped to change something (its vector, the memory) keeps
    /// its state here until it starts again.
    parked: Option<Queue>,
    /// The kick eventfd the worker waits on (while stopped), and our
    /// handle on it (doorbell writes).
    kick: Option<EventFd>,
    kick_tx: Option<EventFd>,
}

/// The device side of a connection: the model, the guest memory, the
/// interrupts and the rings.
struct Dev {
    served: Arc<Served>,
    pci: VirtioPci,
    mem: Arc<GuestMemory>,
    /// DMA maps: iova -> (size, in the memory table).
    maps: BTreeMap<u64, (u64, bool)>,
    /// MSI-X vector -> the client's eventfd.
    msix: Vec<Option<EventFd>>,
    rings: Vec<Ring>,
    features: u64,
    /// Poll mode: BAR0's backing memory, of which the doorbell page is
    /// offered to the client to map.
    bar0_fd: Option<OwnedFd>,
    /// The device's link state as last seen (None: it follows none).
    link_seen: Option<bool>,
}

/// One vfio-user connection being served.
pub struct VfioConn {
    server: Server,
    dev: Dev,
    refused: u64,
}

/// The doorbell page, as the sparse mmap area the client may map.
const DOORBELLS: [SparseArea; 1] = [SparseArea { offset: vpci::NOTIFY_OFF, size: vpci::NOTIFY_LEN }];

impl VfioConn {
    /// Serves a new connection to `served` on `stream`.
    pub fn new(stream: UnixStream, served: &Arc<Served>) -> io::Result<VfioConn> {
        stream.set_nonblocking(true)?;
        // No more maps than guest memory holds regions: a refused map after
        // start-up is fatal to QEMU, so it must know the limit.
        let config = ServerConfig { max_dma_maps: virtq::MAX_REGIONS as u32, ..ServerConfig::default() };
        let server = Server::new(stream, config)?;
        let bar0_fd = if served.pool.mode == Mode::Poll { Some(bar0_memory()?) } else { None };
        let pci = VirtioPci::new(served.device.clone());
        let nq = served.device.queues() as usize;
        let dev = Dev {
            served: served.clone(),
            msix: (0..pci.vectors()).map(|_| None).collect(),
            pci,
            mem: Arc::new(GuestMemory::new()),
            maps: BTreeMap::new(),
            rings: (0..nq).map(|_| Ring::default()).collect(),
            features: 0,
            bar0_fd,
            link_seen: served.device.link_up(),
        };
        Ok(VfioConn { server, dev, refused: 0 })
    }

    /// Its socket.
    pub fn stream(&self) -> &UnixStream {
        self.server.stream()
    }

    /// Whether ending the connection may wait on the backend (a ring of a
    /// device whose requests complete asynchronously runs).
    pub fn finish_may_wait(&self) -> bool {
        self.dev.served.device.tracks_inflight() && self.dev.rings.iter().any(|r| r.running.is_some())
    }

    /// Answers the whole messages waiting, at most `BURST`. (A message that
    /// stops a ring waits here for its requests in flight: not yet handed
    /// to a thread of its own as vhost-user's are.)
    pub fn serve_ready(&mut self, hup: bool) -> Step {
        for _ in 0..BURST {
            match self.server.handle(&mut self.dev) {
                Ok(Event::Idle) if self.server.wants_write() => {
                    // Replies are small and the client reads each before
                    // its next request: one that does not would stall us.
                    tracing::warn!("closing vfio-user connection: the client does not read vhostd's replies");
                    return Step::End;
                }
                Ok(Event::Idle) if hup => {
                    tracing::info!("vfio-user client disconnected");
                    return Step::End;
                }
                Ok(Event::Idle) => return Step::Wait,
                Ok(Event::Handled { header, result: Err(e) }) => {
                    self.refused += 1;
                    if self.refused <= 10 || self.refused.is_power_of_two() {
                        tracing::warn!(count = self.refused, command = header.command, "request refused: {e}");
                    }
                }
                Ok(Event::Handled { .. }) => {}
                Err(vhostd_vfio_user::Error::PeerClosed) => {
                    tracing::info!("vfio-user client disconnected");
                    return Step::End;
                }
                Err(e) => {
                    tracing::warn!("closing vfio-user connection: {e}");
                    return Step::End;
                }
            }
        }
        Step::More
    }

    /// The host's links changed (an rtnetlink event, any interface): if
    /// the device's link state is not the one last seen, its config
    /// changed and the driver hears of it (config_generation, ISR, the
    /// msix_config vector). True if it changed.
    pub fn link_event(&mut self) -> bool {
        let d = &mut self.dev;
        let now = d.served.device.link_up();
        if now == d.link_seen {
            return false;
        }
        d.link_seen = now;
        let vector = d.pci.config_changed();
        let reported = d.served.device.link_reported(d.features);
        let irq = vector.filter(|_| reported).and_then(|v| d.msix.get(v as usize)?.as_ref());
        tracing::info!(
            up = now.unwrap_or(false),
            interrupt = irq.is_some(),
            "link state changed: config generation {}",
            d.pci.generation()
        );
        if let Some(e) = irq {
            let _ = e.write(1);
        }
        true
    }

    /// Ends the connection: every ring stopped, the device reset, every
    /// DMA map and interrupt eventfd dropped.
    pub fn finish(mut self) {
        let _ = self.server.stream().shutdown(std::net::Shutdown::Both);
        self.dev.reset_all();
        self.dev.mem = Arc::new(GuestMemory::new());
        self.dev.maps.clear();
        self.dev.msix.iter_mut().for_each(|v| *v = None);
    }
}

/// BAR0's backing memory for poll mode: a memfd the client maps the
/// doorbell page of.
fn bar0_memory() -> io::Result<OwnedFd> {
    // SAFETY: memfd_create with a static C name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vhostd-vfio-bar0".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a new descriptor we own.
    let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(vpci::BAR0_SIZE)?;
    Ok(file.into())
}

fn errno(e: &io::Error) -> Errno {
    match (e.raw_os_error(), e.kind()) {
        (Some(n), _) => Errno(n),
        // memory::map_shared: the SIGBUS handler's table is full.
        (None, io::ErrorKind::StorageFull) => Errno::ENOSPC,
        (None, _) => Errno::EIO,
    }
}

impl Dev {
    fn queue_count(&self) -> usize {
        self.rings.len()
    }

    /// Acts on what a register write asked for.
    fn apply(&mut self, fx: Vec<Effect>) {
        for e in fx {
            match e {
                Effect::Reset => self.reset_all(),
                Effect::FeaturesOk(f) => {
                    self.features = f;
                    self.served.device.set_features(f);
                    tracing::info!(
                        "features acked: {}",
                        crate::session::describe_acked(f, self.served.device.as_ref())
                    );
                }
                Effect::DriverOk => {
                    for i in 0..self.queue_count() {
                        self.start_ring(i);
                    }
                }
                Effect::BusMaster(false) => {
                    // No DMA without Bus Master Enable: every ring stops,
                    // parked with its state, until the bit is set again.
                    tracing::debug!("bus master disabled: rings stop");
                    for i in 0..self.queue_count() {
                        self.stop_ring(i);
                    }
                }
                Effect::BusMaster(true) => {
                    for i in 0..self.queue_count() {
                        self.start_ring(i);
                    }
                }
                Effect::QueueEnabled(q) => self.start_ring(q as usize),
                Effect::QueueVector(q) => self.update_call(q as usize),
                Effect::Notify(q) => {
                    if let Some(k) = self.rings.get(q as usize).and_then(|r| r.kick_tx.as_ref()) {
                        let _ = k.write(1);
                    }
                }
            }
        }
    }

    /// Queue `i`'s call eventfd: its MSI-X vector's (a copy), if any.
    fn call_of(&self, i: usize) -> Option<EventFd> {
        let vector = self.pci.queue(i as u16)?.vector;
        self.msix.get(vector as usize)?.as_ref()?.try_clone().ok()
    }

    /// Gives running ring `i` its vector's eventfd as call, in place: the
    /// worker swaps it between two passes; the ring does not stop (nothing
    /// waits here for a blk ring's requests in flight).
    fn update_call(&mut self, i: usize) {
        let Some(place) = self.rings.get(i).and_then(|r| r.running) else { return };
        let call = self.call_of(i);
        if !self.served.set_call(place.group, place.slot, call) {
            // Not on its worker after all (a bug): start it afresh.
            tracing::warn!(ring = i, "running ring not found on its worker: restarting it");
            self.stop_ring(i);
            self.start_ring(i);
        }
    }

    /// Takes ring `i` off its worker, keeping its state parked.
    fn stop_ring(&mut self, i: usize) {
        let Some(place) = self.rings[i].running.take() else { return };
        if let Some((q, kick, _call)) = self.served.detach(place.group, place.slot) {
            self.rings[i].parked = Some(q);
            self.rings[i].kick = kick;
        }
    }

    /// Puts ring `i` on its worker if the driver has it enabled, the
    /// device is DRIVER_OK and Bus Master Enable is set (else it waits for
    /// that: a ring the driver set up before it set the bit starts then).
    /// A new ring whose addresses are outside guest memory is refused
    /// (NEEDS_RESET); a stopped one whose memory went waits for it.
    fn start_ring(&mut self, i: usize) {
        if self.rings[i].running.is_some() || self.pci.status() & vpci::status::DRIVER_OK == 0 || !self.pci.bus_master()
        {
            return;
        }
        let Some(regs) = self.pci.queue(i as u16).copied().filter(|r| r.enabled) else { return };
        let Some(place) = self.served.device.place(i as u16, self.features) else { return };
        let at = RingAddrs { desc: regs.desc, driver: regs.driver, device: regs.device };
        let queue = match self.rings[i].parked.take() {
            // A stopped ring resumes where it stopped, on today's memory.
            Some(q) => match q.remap(self.mem.clone(), at) {
                Ok(q) => Ok(q),
                Err(e) => {
                    // Its memory is unmapped (QEMU remaps guest memory
                    // while the firmware's rings run): it waits, parked,
                    // for the memory to come back.
                    tracing::debug!(ring = i, "ring waits for its memory: {e}");
                    self.rings[i].parked = Some(q);
                    return;
                }
            },
            None if self.features & ring_features::RING_PACKED != 0 => {
                let cfg = PackedConfig {
                    size: regs.size,
                    desc: regs.desc,
                    driver: regs.driver,
                    device: regs.device,
                    features: self.features,
                    base: virtq::PACKED_BASE_INITIAL,
                };
                PackedQueue::new(self.mem.clone(), cfg).map(Queue::Packed)
            }
            None => {
                let cfg = SplitConfig {
                    size: regs.size,
                    desc: regs.desc,
                    avail: regs.driver,
                    used: regs.device,
                    features: self.features,
                    next_avail: 0,
                };
                SplitQueue::new(self.mem.clone(), cfg).map(Queue::Split)
            }
        };
        let queue = match queue {
            Ok(q) => q,
            Err(e) => {
                tracing::warn!(ring = i, "cannot start ring: {e}");
                self.pci.set_needs_reset();
                return;
            }
        };
        let r = &mut self.rings[i];
        if r.kick.is_none() {
            match EventFd::new(EFD_NONBLOCK).and_then(|k| Ok((k.try_clone()?, k))) {
                Ok((tx, k)) => {
                    r.kick = Some(k);
                    r.kick_tx = Some(tx);
                }
                Err(e) => {
                    tracing::warn!(ring = i, "cannot start ring: no eventfd: {e}");
                    r.parked = Some(queue);
                    return;
                }
            }
        }
        let kick = r.kick.take();
        let call = self.call_of(i);
        let start = Start { queue, kick, call, err: None, features: self.features, inflight: None };
        self.served.attach(place.group, place.slot, start);
        self.rings[i].running = Some(place);
    }

    /// Every ring stopped and forgotten, the device reset; memory and
    /// interrupts stay (the client's, not the driver's).
    fn reset_all(&mut self) {
        for i in 0..self.queue_count() {
            self.stop_ring(i);
        }
        // Whatever the features said, no ring stays on a worker.
        for i in 0..self.queue_count() {
            for features in [self.features, 0] {
                if let Some(p) = self.served.device.place(i as u16, features) {
                    let _ = self.served.detach(p.group, p.slot);
                }
            }
        }
        for r in self.rings.iter_mut() {
            *r = Ring::default();
        }
        self.features = 0;
        self.pci.reset();
        self.served.run.needs_reset.store(false, Ordering::Release);
        self.served.device.reset();
    }

    /// Moves every ring onto `mem`: running ones stop (their requests in
    /// flight complete first) and start again on it; a ring outside it
    /// stays stopped, with its state, until a map brings its memory back.
    fn replace_memory(&mut self, mem: GuestMemory) {
        let running: Vec<usize> = (0..self.queue_count()).filter(|&i| self.rings[i].running.is_some()).collect();
        for &i in &running {
            self.stop_ring(i);
        }
        self.mem = Arc::new(mem);
        for i in 0..self.queue_count() {
            if self.rings[i].parked.is_some() {
                self.start_ring(i);
            }
        }
    }
}

impl VfioDevice for Dev {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            flags: wire::DEVICE_FLAG_RESET | wire::DEVICE_FLAG_PCI,
            num_regions: NUM_REGIONS,
            num_irqs: NUM_IRQS,
        }
    }

    fn region_info(&self, index: u32) -> Option<RegionInfo<'_>> {
        let rw = wire::REGION_FLAG_READ | wire::REGION_FLAG_WRITE;
        Some(match index {
            BAR0 => match &self.bar0_fd {
                Some(fd) => RegionInfo {
                    flags: rw | wire::REGION_FLAG_MMAP,
                    size: vpci::BAR0_SIZE,
                    mmap_offset: 0,
                    sparse: &DOORBELLS,
                    fd: Some(fd.as_fd()),
                },
                None => RegionInfo { flags: rw, size: vpci::BAR0_SIZE, ..RegionInfo::default() },
            },
            BAR1 => RegionInfo { flags: rw, size: vpci::BAR1_SIZE, ..RegionInfo::default() },
            CONFIG_REGION => RegionInfo { flags: rw, size: vpci::CONFIG_SPACE_SIZE, ..RegionInfo::default() },
            // The other BARs, the ROM and VGA: none.
            _ => RegionInfo::default(),
        })
    }

    fn irq_info(&self, index: u32) -> Option<IrqInfo> {
        Some(match index {
            MSIX_IRQ => IrqInfo { flags: wire::IRQ_INFO_EVENTFD, count: u32::from(self.pci.vectors()) },
            // ERR and REQ: QEMU wants them (it warns without); never signalled.
            3 | 4 => IrqInfo { flags: wire::IRQ_INFO_EVENTFD, count: 1 },
            // No INTx (interrupt pin 0), no MSI.
            _ => IrqInfo { flags: wire::IRQ_INFO_EVENTFD, count: 0 },
        })
    }

    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> Result<(), Errno> {
        if self.served.run.needs_reset.load(Ordering::Acquire) {
            self.pci.set_needs_reset();
        }
        match index {
            BAR0 | BAR1 => self.pci.bar_read(index, offset, data),
            CONFIG_REGION => self.pci.config_read(offset, data),
            _ => return Err(Errno::EINVAL),
        }
        Ok(())
    }

    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<(), Errno> {
        if data.is_empty() {
            // Writes nothing: no register changes, no doorbell rings.
            return Ok(());
        }
        match index {
            BAR0 | BAR1 => {
                let fx = self.pci.bar_write(index, offset, data);
                self.apply(fx);
            }
            CONFIG_REGION => {
                // The PCI cfg access window reaches the BARs: a status
                // write or a doorbell through it acts as one on the BAR.
                let fx = self.pci.config_write(offset, data);
                self.apply(fx);
            }
            _ => return Err(Errno::EINVAL),
        }
        Ok(())
    }

    fn set_irqs(&mut self, set: IrqSet<'_>) -> Result<(), Errno> {
        if set.index != MSIX_IRQ {
            // ERR and REQ: their eventfds are dropped (never signalled);
            // for INTx and MSI only "disable all" gets here.
            return Ok(());
        }
        let (start, count) = (set.start as usize, set.count as usize);
        let mut changed = Vec::new();
        match (set.action, set.data) {
            (IrqAction::Trigger, IrqData::Eventfds(fds)) if fds.is_empty() => {
                for v in start..start + count {
                    self.msix[v] = None;
                    changed.push(v);
                }
            }
            (IrqAction::Trigger, IrqData::Eventfds(fds)) => {
                // All checked before any is taken: a refused SET_IRQS changes nothing.
                let mut checked = Vec::with_capacity(fds.len());
                for fd in fds {
                    match crate::session::eventfd_from_peer(fd) {
                        Ok(e) => checked.push(e),
                        Err(e) => {
                            tracing::warn!("SET_IRQS refused: an MSI-X descriptor: {e}");
                            return Err(Errno::EINVAL);
                        }
                    }
                }
                for (k, e) in checked.into_iter().enumerate() {
                    self.msix[start + k] = Some(e);
                    changed.push(start + k);
                }
            }
            (IrqAction::Trigger, IrqData::None) if count == 0 => {
                for (v, e) in self.msix.iter_mut().enumerate() {
                    if e.take().is_some() {
                        changed.push(v);
                    }
                }
            }
            (IrqAction::Trigger, IrqData::None) => {
                for e in self.msix[start..start + count].iter().flatten() {
                    let _ = e.write(1);
                }
            }
            (IrqAction::Trigger, IrqData::Bool(b)) => {
                for (e, &on) in self.msix[start..start + count].iter().zip(b) {
                    if let (Some(e), true) = (e, on != 0) {
                        let _ = e.write(1);
                    }
                }
            }
            // MSI-X is not MASKABLE: the server refuses masking.
            _ => return Err(Errno::EINVAL),
        }
        // Running rings on a changed vector take the new eventfd (in place).
        for i in 0..self.queue_count() {
            let v = self.pci.queue(i as u16).map_or(vpci::NO_VECTOR, |q| q.vector) as usize;
            if changed.contains(&v) {
                self.update_call(i);
            }
        }
        Ok(())
    }

    fn dma_map(&mut self, map: DmaMap) -> Result<(), Errno> {
        let Some(fd) = map.fd else {
            // QEMU's ROMs and other devices' BAR pages: never DMA targets here.
            self.maps.insert(map.iova, (map.size, false));
            return Ok(());
        };
        if !(map.read && map.write) {
            // virtio writes used rings and read data: read-only memory is
            // no use to it; accepted, never reached.
            self.maps.insert(map.iova, (map.size, false));
            return Ok(());
        }
        let file = File::from(fd);
        let region = crate::memory::map_region(&file, map.iova, map.size, map.offset).map_err(|e| {
            tracing::warn!("DMA_MAP at {:#x}: cannot map: {e}", map.iova);
            errno(&e)
        })?;
        let mem = self.mem.with_region(region).map_err(|e| {
            tracing::warn!("DMA_MAP at {:#x}: {e}", map.iova);
            match e {
                virtq::MemoryError::TooManyRegions => Errno::ENOSPC,
                _ => Errno::EEXIST,
            }
        })?;
        tracing::debug!(iova = map.iova, size = map.size, "DMA map");
        self.replace_memory(mem);
        self.maps.insert(map.iova, (map.size, true));
        Ok(())
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) -> Result<(), Errno> {
        let Some(&(_, mapped)) = self.maps.get(&iova) else { return Err(Errno::ENOENT) };
        if mapped {
            // As with an IOMMU, an unmap always succeeds: rings (and
            // requests in flight) there stop before the reply, and the
            // rings wait for their memory to come back.
            let mem = self.mem.without_region(iova, size).map_err(|_| Errno::ENOENT)?;
            self.replace_memory(mem);
        }
        self.maps.remove(&iova);
        Ok(())
    }

    fn reset(&mut self) -> Result<(), Errno> {
        // DEVICE_RESET is a function-level reset: unlike a virtio reset
        // (status 0), the config space goes back to power-on as well, so
        // nothing the previous owner programmed (bus master, MSI-X
        // enable, BARs) outlives it. QEMU clears bus master and disables
        // MSI-X before it, and zeroes the BARs after.
        tracing::info!("the client reset the device (DEVICE_RESET)");
        self.reset_all();
        self.pci.function_reset();
        Ok(())
    }
}
