//! One vhost-user connection: the backend side of the protocol, on the
//! `vhost` crate's request handler. It owns the memory table and the ring
//! configuration, and starts and stops rings on the dataplane workers.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhost::vhost_user::message::*;
use vhost::vhost_user::{Backend, GpuBackend, VhostUserBackendReqHandlerMut};
use vhost::vhost_user::{Error as VuError, Result as VuResult};
use vhost::VhostUserMemoryRegionBase;
use vhostd_net::{CtrlState, NetConfig, STATUS_LINK_UP};
use virtq::ring::features as ring_features;
use virtq::{GuestMemory, Mapping, PackedConfig, PackedQueue, Queue, Region, SplitConfig, SplitQueue};

use crate::memory::{FrontendAddrs, FrontendRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::worker::{Shared, Slot, WorkerHandle};

/// VHOST_USER_F_PROTOCOL_FEATURES
const PROTOCOL_FEATURES: u64 = 1 << 30;

/// The device a session serves: what stays across connections.
pub struct Device {
    /// Queue pairs.
    pub pairs: u16,
    /// Largest ring size accepted.
    pub max_queue_size: u16,
    /// MAC address in the config space.
    pub mac: [u8; 6],
    /// Offload features the backend supports (a TAP's checksum and
    /// segmentation offloads), offered on top of the rest.
    pub offload_features: u64,
    /// A virtio-blk device (then `pairs` counts its request queues and the
    /// net fields are unused); None for virtio-net.
    pub blk: Option<Arc<vhostd_blk::BlkDevice>>,
    /// Dataplane workers, one per queue pair (blk: per request queue).
    pub workers: Vec<WorkerHandle>,
    /// State shared with the workers.
    pub shared: Arc<Shared>,
}

impl Device {
    /// Features offered to the frontend. IN_ORDER costs nothing: every
    /// path completes chains in the order it popped them, one used element
    /// each (the spec's per-batch single element is an optional shortcut).
    pub fn features(&self) -> u64 {
        if let Some(blk) = &self.blk {
            // No IN_ORDER: requests may finish in any order (the used ring
            // is written in pop order today, but that is ours to change).
            return ring_features::VERSION_1
                | ring_features::EVENT_IDX
                | ring_features::INDIRECT_DESC
                | ring_features::RING_PACKED
                | blk.features()
                | PROTOCOL_FEATURES;
        }
        ring_features::VERSION_1
            | ring_features::IN_ORDER
            | ring_features::EVENT_IDX
            | ring_features::INDIRECT_DESC
            | ring_features::RING_PACKED
            | vhostd_net::DEVICE_FEATURES
            | self.offload_features
            | PROTOCOL_FEATURES
    }

    /// Lets the TAP hand the guest frames that need the receive offloads
    /// in `bits` (GUEST_* features).
    pub fn apply_guest_offloads(&self, bits: u64) {
        if let Some(tap) = &self.shared.tap {
            if let Err(e) = tap.set_offloads(vhostd_net::guest_offloads(bits)) {
                tracing::warn!("TAP {}: cannot set offloads {bits:#x}: {e}", tap.name());
            }
        }
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        let f = VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::RESET_DEVICE
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::STATUS;
        if self.blk.is_some() {
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
    running: bool,
}

/// The state of one connection.
pub struct Session {
    dev: Arc<Device>,
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
    /// blk: the frontend's inflight memory (SET_INFLIGHT_FD) and its
    /// queue size.
    inflight: Option<(Arc<Mapping>, u16)>,
}

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

fn to_eventfd(f: Option<File>) -> Option<EventFd> {
    use std::os::unix::io::{FromRawFd, IntoRawFd};
    // SAFETY: the File owns a valid descriptor which we hand over to the
    // EventFd; nothing else keeps it.
    f.map(|f| unsafe { EventFd::from_raw_fd(f.into_raw_fd()) })
}

impl Session {
    /// A fresh session for the device.
    pub fn new(dev: Arc<Device>) -> Session {
        let nrings = if dev.blk.is_some() { dev.pairs as usize } else { 2 * dev.pairs as usize + 1 };
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
        }
    }

    fn ctrl_index(&self) -> usize {
        if self.features & vhostd_net::features::MQ != 0 {
            2 * self.dev.pairs as usize
        } else {
            2
        }
    }

    /// Worker and slot of ring `i`, or None if the ring does not exist.
    fn locate(&self, i: usize) -> Option<(usize, Slot)> {
        if self.dev.blk.is_some() {
            return (i < self.dev.pairs as usize).then_some((i, Slot::Req));
        }
        let has_ctrl = self.features & vhostd_net::features::CTRL_VQ != 0;
        if has_ctrl && i == self.ctrl_index() {
            return Some((0, Slot::Ctrl));
        }
        let pairs = if self.features & vhostd_net::features::MQ != 0 { self.dev.pairs as usize } else { 1 };
        if i < 2 * pairs {
            Some((i / 2, if i.is_multiple_of(2) { Slot::Rx } else { Slot::Tx }))
        } else if i < 2 * self.dev.pairs as usize && self.features == 0 {
            // Before SET_FEATURES the frontend may still set up every ring.
            Some((i / 2, if i.is_multiple_of(2) { Slot::Rx } else { Slot::Tx }))
        } else {
            None
        }
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
        let Some((w, slot)) = self.locate(i) else { return };
        if !self.vrings[i].running {
            return;
        }
        if let Some((q, kick, call)) = self.dev.workers[w].detach(slot) {
            let v = &mut self.vrings[i];
            v.base = q.vring_base();
            v.parked = Some(q);
            v.kick = kick;
            v.call = call;
        }
        self.vrings[i].running = false;
    }

    /// Puts ring `i` on its worker if it should run; builds the queue on
    /// first start. A ring whose addresses are bad is refused and left stopped.
    fn start_ring(&mut self, i: usize) -> VuResult<()> {
        if self.vrings[i].running || !self.should_run(i) {
            return Ok(());
        }
        let Some((w, slot)) = self.locate(i) else { return Ok(()) };
        let queue = match self.vrings[i].parked.take() {
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
        let layout = vhostd_net::Layout::from_features(self.features);
        let v = &mut self.vrings[i];
        let kick = v.kick.take();
        // The worker gives kick and call back when the ring stops.
        let call = v.call.take();
        let errfd = v.err.as_ref().and_then(|c| c.try_clone().ok());
        let inflight = match (&self.inflight, slot) {
            (Some((map, qsize)), Slot::Req) => vhostd_blk::InflightLog::new(map.clone(), i, *qsize),
            _ => None,
        };
        self.dev.workers[w].attach(slot, queue, kick, call, errfd, layout, inflight);
        self.vrings[i].running = true;
        Ok(())
    }

    /// Applies a change to ring `i`: stop it, let `f` edit it, restart.
    fn with_ring_stopped(&mut self, i: usize, f: impl FnOnce(&mut Vring)) -> VuResult<()> {
        self.stop_ring(i);
        f(&mut self.vrings[i]);
        self.start_ring(i)
    }

    /// Drops every ring and the memory table (disconnect, reset).
    pub fn reset(&mut self) {
        for i in 0..self.vrings.len() {
            self.stop_ring(i);
        }
        // Whatever the features said, no ring outlives its connection.
        let slots: &[Slot] = if self.dev.blk.is_some() { &[Slot::Req] } else { &[Slot::Rx, Slot::Tx, Slot::Ctrl] };
        for w in &self.dev.workers {
            for &slot in slots {
                let _ = w.detach(slot);
            }
        }
        for v in self.vrings.iter_mut() {
            *v = Vring::default();
        }
        self.mem = Arc::new(GuestMemory::new());
        self.addrs = FrontendAddrs::default();
        self.region_refs.clear();
        self.features = 0;
        self.status = 0;
        self.inflight = None;
        self.dev.shared.needs_reset.store(false, Ordering::Release);
        self.dev.shared.active_pairs.store(self.dev.pairs, Ordering::Release);
        if let Ok(mut c) = self.dev.shared.ctrl.lock() {
            *c = CtrlState { errors: c.errors, ..CtrlState::new(self.dev.pairs, self.dev.mac) };
        }
        // No guest, no offloaded frames.
        self.dev.apply_guest_offloads(0);
    }

    /// Installs a new memory table: running and parked rings are moved onto it.
    fn replace_memory(&mut self, mem: GuestMemory, addrs: FrontendAddrs) -> VuResult<()> {
        let running: Vec<usize> = (0..self.vrings.len()).filter(|&i| self.vrings[i].running).collect();
        for &i in &running {
            self.stop_ring(i);
        }
        self.mem = Arc::new(mem);
        self.addrs = addrs;
        for v in self.vrings.iter_mut() {
            if let Some(q) = v.parked.take() {
                match q.remap(self.mem.clone()) {
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
                 a frontend that truncates it would crash vhostd"
            );
        }
        Ok(region)
    }

    /// Device status as GET_STATUS reports it (NEEDS_RESET once a ring broke).
    pub fn status(&self) -> u8 {
        let mut s = self.status;
        if self.dev.shared.needs_reset.load(Ordering::Acquire) {
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
            self.dev.shared.needs_reset.store(false, Ordering::Release);
        }
        self.status = status;
    }

    /// Whether the frontend negotiated REPLY_ACK (we always offer
    /// VHOST_USER_F_PROTOCOL_FEATURES, so SET_PROTOCOL_FEATURES decides).
    pub fn reply_ack(&self) -> bool {
        self.protocol & VhostUserProtocolFeatures::REPLY_ACK.bits() != 0
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
        self.reset();
        self.owner = false;
        Ok(())
    }

    fn reset_device(&mut self) -> VuResult<()> {
        self.reset();
        Ok(())
    }

    fn get_features(&mut self) -> VuResult<u64> {
        Ok(self.dev.features())
    }

    fn set_features(&mut self, features: u64) -> VuResult<()> {
        if features & !self.dev.features() != 0 {
            return Err(err("SET_FEATURES with features we did not offer"));
        }
        // A change (QEMU sends SET_FEATURES again, a hostile frontend drops
        // MQ under running rings): take every ring off its worker while the
        // old features still say where it runs, and rebuild them for the new
        // ones from where they stopped.
        let running: Vec<usize> = (0..self.vrings.len()).filter(|&i| self.vrings[i].running).collect();
        if features != self.features {
            for &i in &running {
                self.stop_ring(i);
            }
            for v in self.vrings.iter_mut() {
                v.parked = None;
            }
        }
        self.features = features;
        tracing::info!(
            "features acked: {features:#x} ({} ring{}{})",
            if features & ring_features::RING_PACKED != 0 { "packed" } else { "split" },
            if features & ring_features::IN_ORDER != 0 { ", in-order" } else { "" },
            if self.dev.blk.is_none() && features & vhostd_net::features::MRG_RXBUF != 0 {
                ", mergeable rx"
            } else {
                ""
            },
        );
        for i in running {
            // A ring that cannot run under the new features stays stopped.
            let _ = self.start_ring(i);
        }
        if self.dev.blk.is_some() {
            return Ok(());
        }
        let offloads = features & vhostd_net::features::GUEST_OFFLOADS;
        if let Ok(mut c) = self.dev.shared.ctrl.lock() {
            c.offloads_allowed = offloads;
            c.offloads = offloads;
        }
        self.dev.apply_guest_offloads(offloads);
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
            regions.push(Self::map_region(r.guest_phys_addr, r.memory_size, r.user_addr, r.mmap_offset, f)?);
            let fr = FrontendRegion { gpa: r.guest_phys_addr, size: r.memory_size, uaddr: r.user_addr };
            addrs = addrs.with(fr).map_err(|_| err("memory regions overlap"))?;
        }
        let mem = GuestMemory::from_regions(regions).map_err(|_| err("memory regions overlap"))?;
        self.region_refs = addrs.regions().iter().map(|r| ((r.gpa, r.size, r.uaddr), 1)).collect();
        self.replace_memory(mem, addrs)?;
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VuResult<()> {
        // Split rings must be a power of two; packed rings may be any size
        // (virtio 1.2, 2.8). Without RING_PACKED acked this is a split ring.
        let packed = self.features & ring_features::RING_PACKED != 0;
        if num == 0 || num > self.dev.max_queue_size as u32 || (!packed && !num.is_power_of_two()) {
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
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VuResult<()> {
        self.check_index(index)?;
        let i = index as usize;
        self.with_ring_stopped(i, |v| {
            v.desc = descriptor;
            v.used = used;
            v.avail = available;
            v.addr_set = true;
            v.parked = None;
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
        let kick = to_eventfd(fd);
        self.with_ring_stopped(index as usize, |v| {
            v.kick = kick;
            v.started = true;
        })
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        self.check_index(index as u32)?;
        let call = to_eventfd(fd);
        self.with_ring_stopped(index as usize, |v| v.call = call)
    }

    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> VuResult<()> {
        self.check_index(index as u32)?;
        let e = to_eventfd(fd);
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
        // it as an upper bound on queue pairs, which this also satisfies):
        // the pairs plus the control queue.
        if self.dev.blk.is_some() {
            return Ok(self.dev.pairs as u64);
        }
        Ok(2 * self.dev.pairs as u64 + 1)
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VuResult<()> {
        self.check_index(index)?;
        self.with_ring_stopped(index as usize, |v| v.enabled = enable)
    }

    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> VuResult<Vec<u8>> {
        let (off, len) = (offset as usize, size as usize);
        if let Some(blk) = &self.dev.blk {
            let bytes = blk.config();
            // QEMU asks for its whole struct; bytes past ours read as zero.
            return match off.checked_add(len) {
                Some(end) if len <= 4096 => {
                    let mut out = vec![0u8; len];
                    if off < bytes.len() {
                        let n = end.min(bytes.len()) - off;
                        out[..n].copy_from_slice(&bytes[off..off + n]);
                    }
                    Ok(out)
                }
                _ => Err(err("GET_CONFIG outside the config space")),
            };
        }
        let mac = self.dev.shared.ctrl.lock().map(|c| c.mac).unwrap_or(self.dev.mac);
        let link_up = self.dev.shared.link.as_ref().is_none_or(|l| l.up());
        let status = if link_up { STATUS_LINK_UP } else { 0 };
        let cfg = NetConfig { mac, status, max_queue_pairs: self.dev.pairs, mtu: 1500 };
        let bytes = cfg.bytes();
        match off.checked_add(len) {
            Some(end) if end <= bytes.len() => Ok(bytes[off..end].to_vec()),
            _ => Err(err("GET_CONFIG outside the config space")),
        }
    }

    fn set_config(&mut self, offset: u32, buf: &[u8], _flags: VhostUserConfigFlags) -> VuResult<()> {
        if let Some(blk) = &self.dev.blk {
            if self.features & vhostd_blk::features::CONFIG_WCE != 0 && blk.set_config(offset as usize, buf) {
                tracing::info!("guest set the cache to {}", if buf[0] == 1 { "write-back" } else { "write-through" });
                return Ok(());
            }
            return Err(err("SET_CONFIG of a read-only config field"));
        }
        // The virtio-net config space is read-only for the driver.
        Err(err("SET_CONFIG on virtio-net"))
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
        if self.dev.blk.is_none() || nq == 0 || nq > self.dev.pairs || qs == 0 || qs > 32768 {
            return Err(err("GET_INFLIGHT_FD: not a blk device, or bad num_queues / queue_size"));
        }
        let size = nq as usize * vhostd_blk::inflight::region_size(qs);
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
        if self.dev.blk.is_none() || nq == 0 || qs == 0 || qs > 32768 {
            return Err(err("SET_INFLIGHT_FD: not a blk device, or bad num_queues / queue_size"));
        }
        let need = nq as u64 * vhostd_blk::inflight::region_size(qs) as u64;
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

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VuResult<()> {
        Err(err("SET_LOG_BASE"))
    }
}
