//! vfio-user mode: the frontend as both the VMM and the guest's virtio-pci
//! driver of a vfio-user device (vhostd `--transport vfio-user`).
//!
//! `VfioBlk::connect` does what a VMM and a guest driver do between them:
//! VERSION, DMA_MAP of the memfd (IOVA = guest-physical address),
//! DEVICE_GET_INFO, the PCI config space's virtio capabilities (common,
//! notify, device config), GET_REGION_INFO of the notify BAR (mapping the
//! doorbells when a sparse mmap area covers them), GET_IRQ_INFO and
//! SET_IRQS for MSI-X (vector 0: config, vector q + 1: queue q), memory
//! space and bus master in the PCI command register, then the virtio init
//! sequence through REGION_WRITEs to the common config: reset,
//! ACKNOWLEDGE, DRIVER, features, FEATURES_OK. `blk_queue` lays out a
//! queue exactly as vhost-user does (`BlkQueue::create_in`) and programs
//! its registers; `driver_ok` starts the device.
//!
//! The rings and requests do not know the transport: a queue's doorbell is
//! a [`Notifier`] (a store into the mapped page, or a posted REGION_WRITE),
//! and its call eventfd is its MSI-X vector's eventfd.
//!
//! Nothing the device sends can make this panic: a config space whose
//! capabilities are missing, out of range or looping is an error.

use crate::blk::{BlkConfig, BlkQueue};
use crate::queue::Notifier;
use crate::{features, Error, FrontendMemory};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vhostd_vfio_user::{wire, Client, ClientError};
use virtq_driver::SharedMemory;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// VFIO_PCI_CONFIG_REGION_INDEX.
const CONFIG_REGION: u32 = 7;
/// VFIO_PCI_MSIX_IRQ_INDEX.
const MSIX_IRQ: u32 = 2;
/// The PCI command register, and its memory space and bus master bits.
const PCI_COMMAND: u64 = 0x04;
const COMMAND_ENABLE: u16 = 0x2 | 0x4;
/// The highest BAR region index.
const LAST_BAR: u8 = 5;

/// Common config field offsets (virtio 1.2, 4.1.4.3).
mod common {
    pub const DEVICE_FEATURE_SELECT: u64 = 0x00;
    pub const DEVICE_FEATURE: u64 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u64 = 0x08;
    pub const DRIVER_FEATURE: u64 = 0x0c;
    pub const MSIX_CONFIG: u64 = 0x10;
    pub const NUM_QUEUES: u64 = 0x12;
    pub const DEVICE_STATUS: u64 = 0x14;
    pub const QUEUE_SELECT: u64 = 0x16;
    pub const QUEUE_SIZE: u64 = 0x18;
    pub const QUEUE_MSIX_VECTOR: u64 = 0x1a;
    pub const QUEUE_ENABLE: u64 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u64 = 0x1e;
    pub const QUEUE_DESC: u64 = 0x20;
    pub const QUEUE_DRIVER: u64 = 0x28;
    pub const QUEUE_DEVICE: u64 = 0x30;
}

/// Device status bits.
mod status {
    pub const ACKNOWLEDGE: u8 = 1;
    pub const DRIVER: u8 = 2;
    pub const DRIVER_OK: u8 = 4;
    pub const FEATURES_OK: u8 = 8;
}

const NO_VECTOR: u16 = 0xffff;

fn vf(what: &'static str) -> impl FnOnce(ClientError) -> Error {
    move |e| Error::Config(format!("vfio-user {what}: {e}"))
}

/// A structure a virtio vendor capability points at.
#[derive(Clone, Copy, Debug, Default)]
struct Place {
    bar: u8,
    offset: u64,
    length: u64,
}

/// Where the virtio structures are, from the PCI capabilities.
#[derive(Clone, Copy, Debug, Default)]
struct Layout {
    common: Place,
    notify: Place,
    notify_multiplier: u32,
    device: Place,
}

/// Walks the capability list of `cfg` (256 bytes of config space) for the
/// virtio vendor capabilities; bounded: at most 48 capabilities, each
/// inside the space.
fn parse_caps(cfg: &[u8]) -> Result<Layout, Error> {
    let bad = |s: &str| Error::Config(format!("device config space: {s}"));
    let at = |o: usize, n: usize| cfg.get(o..o + n).ok_or_else(|| bad("capability out of range"));
    let u32_at = |o: usize| at(o, 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    if cfg.len() < 64 || u16::from_le_bytes([cfg[6], cfg[7]]) & 0x10 == 0 {
        return Err(bad("no capability list"));
    }
    let (mut common, mut notify, mut device) = (None, None, None);
    let mut mult = 0;
    let mut next = cfg[0x34] as usize & !3;
    let mut seen = 0;
    while next != 0 {
        seen += 1;
        if seen > 48 || next < 0x40 {
            return Err(bad("capability list loops or points into the header"));
        }
        let h = at(next, 2)?;
        let (id, link) = (h[0], h[1] as usize & !3);
        if id == 0x09 {
            // virtio_pci_cap: len, cfg_type, bar, id, padding, offset, length.
            let c = at(next, 16)?;
            let place = Place { bar: c[4], offset: u32_at(next + 8)? as u64, length: u32_at(next + 12)? as u64 };
            match c[3] {
                1 if common.is_none() => common = Some(place),
                2 if notify.is_none() => {
                    mult = u32_at(next + 16)?;
                    notify = Some(place);
                }
                4 if device.is_none() => device = Some(place),
                _ => {}
            }
        }
        next = link;
    }
    let need = |p: Option<Place>, what: &str| {
        let p = p.ok_or_else(|| bad(&format!("no {what} capability")))?;
        if p.bar > LAST_BAR {
            return Err(bad(&format!("{what} in BAR {}", p.bar)));
        }
        Ok(p)
    };
    Ok(Layout {
        common: need(common, "common config")?,
        notify: need(notify, "notify")?,
        notify_multiplier: mult,
        device: need(device, "device config")?,
    })
}

/// A doorbell stored into the page the server let us map.
struct MappedDoorbell {
    page: Arc<SharedMemory>,
    /// Offset of the doorbell in the mapping (checked: 2 bytes fit).
    at: usize,
    queue: u16,
}

impl Notifier for MappedDoorbell {
    #[inline]
    fn notify(&mut self) -> Result<(), Error> {
        // SAFETY: `at + 2 <= page.len()` and `at` even (checked when made;
        // the mapping is page aligned, so the u16 is aligned); the mapping
        // lives as long as `page`. Volatile: the device side reads it.
        unsafe { (self.page.as_ptr().add(self.at) as *mut u16).write_volatile(self.queue.to_le()) };
        Ok(())
    }
}

/// A doorbell written with a posted REGION_WRITE (no reply) on the
/// connection's socket.
struct MessageDoorbell {
    client: Client,
    region: u32,
    offset: u64,
    queue: u16,
}

impl Notifier for MessageDoorbell {
    fn notify(&mut self) -> Result<(), Error> {
        self.client.region_write_posted(self.region, self.offset, &self.queue.to_le_bytes()).map_err(Error::Io)
    }
}

/// What `VfioBlk::connect` asks for.
#[derive(Clone, Debug)]
pub struct VfioOptions {
    /// Guest memory in bytes.
    pub mem_size: u64,
    /// Guest-physical (IOVA) base of the memory.
    pub gpa_base: u64,
    /// Features to ack when offered (VERSION_1 is required).
    pub features: u64,
    /// Use the mapped doorbell page when the device offers it (else every
    /// doorbell is a REGION_WRITE).
    pub map_doorbells: bool,
}

impl VfioOptions {
    /// 64 MiB at IOVA 0, the blk features `blk` understands with EVENT_IDX.
    pub fn blk() -> VfioOptions {
        VfioOptions {
            mem_size: 64 << 20,
            gpa_base: 0,
            features: features::VERSION_1 | features::EVENT_IDX | features::BLK_ALL,
            map_doorbells: true,
        }
    }
}

/// A virtio-blk device over vfio-user, driven from this process.
pub struct VfioBlk {
    client: Client,
    mem: FrontendMemory,
    layout: Layout,
    /// The mapped doorbell page (its offset in the notify BAR), if offered.
    doorbells: Option<(Arc<SharedMemory>, u64)>,
    vectors: u32,
    config_irq: EventFd,
    offered: u64,
    features: u64,
    cfg: BlkConfig,
    num_queues: u16,
}

impl VfioBlk {
    /// Connects to `path`, retrying for up to `timeout` while nobody
    /// listens, and initialises the device up to FEATURES_OK.
    pub fn connect(path: &Path, opts: &VfioOptions, timeout: Duration) -> Result<VfioBlk, Error> {
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::Config(format!("connect {}: {e}", path.display())))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(Error::Io)?;
        VfioBlk::from_stream(stream, opts)
    }

    /// `connect` on a connected socket.
    pub fn from_stream(stream: UnixStream, opts: &VfioOptions) -> Result<VfioBlk, Error> {
        let mut client = Client::new(stream);
        let caps = wire::Capabilities { max_msg_fds: 8, max_data_xfer_size: 1 << 20, pgsizes: 4096, max_dma_maps: 64 };
        client.version(&caps).map_err(vf("VERSION"))?;
        let info = client.device_info().map_err(vf("DEVICE_GET_INFO"))?;
        if info.flags & wire::DEVICE_FLAG_PCI == 0 || info.num_regions <= CONFIG_REGION || info.num_irqs <= MSIX_IRQ {
            return Err(Error::Unsupported(format!(
                "a PCI device with config space and MSI-X (flags {:#x}, {} regions, {} irqs)",
                info.flags, info.num_regions, info.num_irqs
            )));
        }
        let mut cfg_space = [0u8; 256];
        client.region_read(CONFIG_REGION, 0, &mut cfg_space).map_err(vf("config space read"))?;
        let ids = (u16::from_le_bytes([cfg_space[0], cfg_space[1]]), u16::from_le_bytes([cfg_space[2], cfg_space[3]]));
        if ids != (0x1af4, 0x1042) {
            return Err(Error::Unsupported(format!("a virtio-blk device (ids {:04x}:{:04x})", ids.0, ids.1)));
        }
        let layout = parse_caps(&cfg_space)?;
        if layout.notify_multiplier % 2 != 0 {
            return Err(Error::Config(format!("notify multiplier {} is odd", layout.notify_multiplier)));
        }
        let region = client.region_info(layout.notify.bar as u32).map_err(vf("GET_REGION_INFO"))?;
        let n = layout.notify;
        let doorbells = match (&region.fd, opts.map_doorbells && region.flags & wire::REGION_FLAG_MMAP != 0) {
            (Some(fd), true) => {
                // The sparse area that holds the whole notify structure.
                let area = region.sparse.iter().find(|a| {
                    a.offset <= n.offset && n.offset.saturating_add(n.length) <= a.offset.saturating_add(a.size)
                });
                match area {
                    Some(a) => {
                        let file = std::fs::File::from(fd.try_clone().map_err(Error::Io)?);
                        let off =
                            region.offset.checked_add(a.offset).ok_or_else(|| Error::Config("mmap offset".into()))?;
                        let page = SharedMemory::map(&file, off, a.size).map_err(Error::Io)?;
                        Some((Arc::new(page), a.offset))
                    }
                    None => None,
                }
            }
            _ => None,
        };
        let irq = client.irq_info(MSIX_IRQ).map_err(vf("GET_IRQ_INFO"))?;
        if irq.flags & wire::IRQ_INFO_EVENTFD == 0 || irq.count < 2 {
            return Err(Error::Unsupported(format!("MSI-X with eventfds ({} vectors)", irq.count)));
        }
        let mem = FrontendMemory::new(opts.mem_size, opts.gpa_base, true)?;
        client
            .dma_map(
                mem.gpa_base(),
                mem.size(),
                0,
                wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE,
                Some(mem.file().as_fd()),
            )
            .map_err(vf("DMA_MAP"))?;
        // Memory space and bus master on, as the guest's PCI core does
        // before the virtio driver runs (pci_enable_device,
        // pci_set_master): without bus master the device runs no ring.
        client.region_write(CONFIG_REGION, PCI_COMMAND, &COMMAND_ENABLE.to_le_bytes()).map_err(vf("PCI command"))?;
        let config_irq = EventFd::new(EFD_NONBLOCK).map_err(Error::Io)?;
        let mut d = VfioBlk {
            client,
            mem,
            layout,
            doorbells,
            vectors: irq.count,
            config_irq,
            offered: 0,
            features: 0,
            cfg: BlkConfig::default(),
            num_queues: 0,
        };
        d.set_vector(0, d.config_irq.as_raw_fd())?;
        d.init(opts.features)?;
        Ok(d)
    }

    fn set_vector(&mut self, vector: u32, fd: i32) -> Result<(), Error> {
        // SAFETY: `fd` is an eventfd of ours, open for the call.
        let b = unsafe { BorrowedFd::borrow_raw(fd) };
        self.client
            .set_irqs(MSIX_IRQ, wire::IRQ_SET_DATA_EVENTFD | wire::IRQ_SET_ACTION_TRIGGER, vector, 1, &[], &[b])
            .map_err(vf("SET_IRQS"))
    }

    fn write(&mut self, p: Place, off: u64, v: u64, len: usize) -> Result<(), Error> {
        self.client.region_write(p.bar as u32, p.offset + off, &v.to_le_bytes()[..len]).map_err(vf("REGION_WRITE"))
    }

    fn read(&mut self, p: Place, off: u64, len: usize) -> Result<u64, Error> {
        let mut b = [0u8; 8];
        self.client.region_read(p.bar as u32, p.offset + off, &mut b[..len]).map_err(vf("REGION_READ"))?;
        Ok(u64::from_le_bytes(b))
    }

    fn common_w(&mut self, off: u64, v: u64, len: usize) -> Result<(), Error> {
        self.write(self.layout.common, off, v, len)
    }

    fn common_r(&mut self, off: u64, len: usize) -> Result<u64, Error> {
        self.read(self.layout.common, off, len)
    }

    /// Reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK, device config.
    fn init(&mut self, want: u64) -> Result<(), Error> {
        use common::*;
        self.common_w(DEVICE_STATUS, 0, 1)?;
        self.common_w(DEVICE_STATUS, status::ACKNOWLEDGE as u64, 1)?;
        self.common_w(DEVICE_STATUS, (status::ACKNOWLEDGE | status::DRIVER) as u64, 1)?;
        let mut offered = 0u64;
        for half in 0..2u64 {
            self.common_w(DEVICE_FEATURE_SELECT, half, 4)?;
            offered |= self.common_r(DEVICE_FEATURE, 4)? << (32 * half);
        }
        self.offered = offered;
        if offered & features::VERSION_1 == 0 {
            return Err(Error::Unsupported("VIRTIO_F_VERSION_1".into()));
        }
        let f = offered & (want | features::VERSION_1);
        for half in 0..2u64 {
            self.common_w(DRIVER_FEATURE_SELECT, half, 4)?;
            self.common_w(DRIVER_FEATURE, (f >> (32 * half)) & 0xffff_ffff, 4)?;
        }
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        self.common_w(DEVICE_STATUS, s as u64, 1)?;
        if self.common_r(DEVICE_STATUS, 1)? as u8 & status::FEATURES_OK == 0 {
            return Err(Error::Unsupported(format!("features {f:#x} (FEATURES_OK refused)")));
        }
        self.features = f;
        self.common_w(MSIX_CONFIG, 0, 2)?;
        self.num_queues = self.common_r(NUM_QUEUES, 2)? as u16;
        let dev = self.layout.device;
        let len = dev.length.min(64) as usize;
        let mut b = vec![0u8; len];
        self.client.region_read(dev.bar as u32, dev.offset, &mut b).map_err(vf("device config read"))?;
        self.cfg = BlkConfig::parse(&b).ok_or_else(|| Error::Config(format!("device config of {len} bytes")))?;
        Ok(())
    }

    /// The negotiated features.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// The features the device offered.
    pub fn offered_features(&self) -> u64 {
        self.offered
    }

    /// The device config read at FEATURES_OK.
    pub fn blk_config(&self) -> BlkConfig {
        self.cfg
    }

    /// The device's queue count (common config num_queues).
    pub fn num_queues(&self) -> u16 {
        self.num_queues
    }

    /// True when the doorbells are stores into a mapped page (no message).
    pub fn doorbells_mapped(&self) -> bool {
        self.doorbells.is_some()
    }

    /// The guest memory.
    pub fn memory(&mut self) -> &mut FrontendMemory {
        &mut self.mem
    }

    /// The connection's socket (to wait on).
    pub fn socket(&self) -> BorrowedFd<'_> {
        self.client.stream().as_fd()
    }

    /// The connection (for requests this type does not wrap).
    pub fn client(&mut self) -> &mut Client {
        &mut self.client
    }

    /// Lays out request queue `index` (as `VirtioUser::blk_queue`) and
    /// programs it: size, areas, MSI-X vector `index + 1` with the queue's
    /// call eventfd, queue_enable. It runs once `driver_ok` is written.
    pub fn blk_queue(&mut self, index: u16, depth: u16, max_data: u32) -> Result<BlkQueue, Error> {
        use common::*;
        if index >= self.num_queues {
            return Err(Error::Unsupported(format!("request queue {index} (device has {})", self.num_queues)));
        }
        let vector = index as u32 + 1;
        if vector >= self.vectors {
            return Err(Error::Unsupported(format!("MSI-X vector {vector} ({} vectors)", self.vectors)));
        }
        let cfg = self.cfg;
        let mut q = BlkQueue::create_in(&mut self.mem, self.features, &cfg, index, depth, max_data, None)?;
        self.common_w(QUEUE_SELECT, index as u64, 2)?;
        let max = self.common_r(QUEUE_SIZE, 2)? as u16;
        let l = q.queue.ring.layout();
        if max == 0 || l.size > max {
            return Err(Error::Unsupported(format!("a ring of {} entries on queue {index} (at most {max})", l.size)));
        }
        self.common_w(QUEUE_SIZE, l.size as u64, 2)?;
        self.common_w(QUEUE_DESC, l.desc, 8)?;
        self.common_w(QUEUE_DRIVER, l.avail, 8)?;
        self.common_w(QUEUE_DEVICE, l.used, 8)?;
        self.set_vector(vector, q.queue.call_fd().as_raw_fd())?;
        self.common_w(QUEUE_MSIX_VECTOR, vector as u64, 2)?;
        if self.common_r(QUEUE_MSIX_VECTOR, 2)? as u16 == NO_VECTOR {
            return Err(Error::Unsupported(format!("MSI-X vector {vector} for queue {index}")));
        }
        let notify_off = self.common_r(QUEUE_NOTIFY_OFF, 2)?;
        let n = self.layout.notify;
        let at = notify_off * self.layout.notify_multiplier as u64;
        if at.saturating_add(2) > n.length {
            return Err(Error::Config(format!("queue {index}'s doorbell at {at:#x} is outside the notify area")));
        }
        let offset = n.offset + at;
        let mapped = self.doorbells.as_ref().and_then(|(page, base)| {
            offset.checked_sub(*base).filter(|at| at % 2 == 0 && at + 2 <= page.len() as u64).map(|at| (page, at))
        });
        match mapped {
            Some((page, at)) => {
                q.queue.set_notifier(Box::new(MappedDoorbell { page: page.clone(), at: at as usize, queue: index }))
            }
            _ => {
                let stream = self.client.stream().try_clone().map_err(Error::Io)?;
                q.queue.set_notifier(Box::new(MessageDoorbell {
                    client: Client::new(stream),
                    region: n.bar as u32,
                    offset,
                    queue: index,
                }))
            }
        }
        self.common_w(QUEUE_ENABLE, 1, 2)?;
        Ok(q)
    }

    /// DRIVER_OK: the device starts the enabled queues.
    pub fn driver_ok(&mut self) -> Result<(), Error> {
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;
        self.common_w(common::DEVICE_STATUS, s as u64, 1)?;
        let got = self.common_r(common::DEVICE_STATUS, 1)? as u8;
        if got != s {
            return Err(Error::Config(format!("device status {got:#x} after DRIVER_OK")));
        }
        Ok(())
    }

    /// Resets the device (status 0: the rings stop) and closes the connection.
    pub fn disconnect(mut self) -> Result<(), Error> {
        self.common_w(common::DEVICE_STATUS, 0, 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space() -> [u8; 256] {
        let mut c = [0u8; 256];
        c[6] = 0x10;
        c[0x34] = 0x40;
        let mut cap = |at: usize, ty: u8, next: u8, bar: u8, off: u32, len: u32| {
            c[at] = 0x09;
            c[at + 1] = next;
            c[at + 2] = 20;
            c[at + 3] = ty;
            c[at + 4] = bar;
            c[at + 8..at + 12].copy_from_slice(&off.to_le_bytes());
            c[at + 12..at + 16].copy_from_slice(&len.to_le_bytes());
        };
        cap(0x40, 1, 0x54, 0, 0, 0x40);
        cap(0x54, 2, 0x6c, 0, 0x3000, 0x1000);
        cap(0x6c, 4, 0, 0, 0x2000, 0x100);
        c[0x54 + 16..0x54 + 20].copy_from_slice(&4u32.to_le_bytes());
        c
    }

    #[test]
    fn finds_the_virtio_structures() {
        let l = parse_caps(&space()).unwrap();
        assert_eq!((l.common.offset, l.notify.offset, l.notify_multiplier, l.device.offset), (0, 0x3000, 4, 0x2000));
    }

    #[test]
    fn a_hostile_capability_list_is_an_error() {
        let mut c = space();
        c[0x6c + 1] = 0x40; // loops
        assert!(parse_caps(&c).is_err());
        let mut c = space();
        c[0x54 + 1] = 0xfc; // runs off the end
        assert!(parse_caps(&c).is_err());
        let mut c = space();
        c[0x40 + 4] = 6; // not a BAR
        assert!(parse_caps(&c).is_err());
        let mut c = space();
        c[0x40 + 1] = 0; // no notify, no device config
        assert!(parse_caps(&c).is_err());
    }
}
