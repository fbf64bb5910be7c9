//! vhostd-virtio-pci: a virtio-pci modern device (virtio 1.2, 4.1) over
//! vhostd's [`Device`] trait, as registers only: the PCI config space, the
//! BARs' registers, and what a driver's accesses to them mean. It knows no
//! transport: a transport (vhostd's vfio-user server) routes the client's
//! region accesses here and acts on the [`Effect`]s a write returns
//! (attach a ring, reset the device, kick a ring). Guest memory, eventfds
//! and workers stay with the transport.
//!
//! Layout (every offset and length a driver can reach is checked here):
//!
//! ```text
//! config space  256 bytes: ids 0x1af4 / 0x1040 + virtio type, revision 1,
//!               capability list (offset, length):
//!               0x40 (16) common cfg   0x50 (20) notify   0x64 (16) ISR
//!               0x74 (16) device cfg (virtio vendor capabilities, BAR0)
//!               0x84 (12) MSI-X
//!               0x90 (20) PCI cfg access (virtio type 5): cap.bar, offset,
//!                         length and the 4-byte pci_cfg_data window at
//!                         0xa0 are writable; an access to the window is
//!                         an access to the BAR (same effects)
//! BAR0 (16 KiB) 0x0000 common cfg   0x1000 ISR   0x2000 device cfg
//!               0x3000 notify doorbells, 4 bytes per queue (own page, so a
//!               transport may let the client map it)
//! BAR1 (4 KiB)  MSI-X table at 0, PBA at 0x800 (the VMM emulates both;
//!               accesses that reach the device read zeros)
//! ```
//!
//! Interrupts are MSI-X only: the interrupt pin is 0. The ISR holds only
//! the configuration change bit, set by [`VirtioPci::config_changed`]
//! (virtio 1.2, 4.1.4.5.1: set before the notification, MSI-X or not) and
//! cleared by reading it; the queue interrupt bit stays 0 (MSI-X only).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use vhostd_device::Device;
use virtq::ring::features as ring_features;

/// Size of the PCI config space served.
pub const CONFIG_SPACE_SIZE: u64 = 256;
/// BAR0: the virtio structures.
pub const BAR0_SIZE: u64 = 0x4000;
/// BAR1: the MSI-X table and PBA.
pub const BAR1_SIZE: u64 = 0x1000;
/// Common config, in BAR0.
pub const COMMON_OFF: u64 = 0x0000;
/// Bytes of the common config (through queue_reset).
pub const COMMON_LEN: u64 = 0x40;
/// ISR status, in BAR0.
pub const ISR_OFF: u64 = 0x1000;
/// Device-specific config, in BAR0.
pub const DEVICE_OFF: u64 = 0x2000;
/// Bytes of device config the capability announces.
pub const DEVICE_LEN: u64 = 0x100;
/// The doorbells, in BAR0: queue q at NOTIFY_OFF + q * NOTIFY_MULTIPLIER.
pub const NOTIFY_OFF: u64 = 0x3000;
/// The doorbell page's size.
pub const NOTIFY_LEN: u64 = 0x1000;
/// Bytes between two queues' doorbells.
pub const NOTIFY_MULTIPLIER: u32 = 4;
/// MSI-X table offset in BAR1.
pub const MSIX_TABLE_OFF: u32 = 0;
/// MSI-X PBA offset in BAR1.
pub const MSIX_PBA_OFF: u32 = 0x800;
/// Most MSI-X vectors (the table must fit below the PBA).
pub const MAX_VECTORS: u16 = 128;
/// "No vector" in msix_config / queue_msix_vector.
pub const NO_VECTOR: u16 = 0xffff;
/// The ISR's Device Configuration Interrupt bit (virtio 1.2, 4.1.4.5).
pub const ISR_CONFIG: u8 = 0x2;

/// Device status bits (virtio 1.2, 2.1).
pub mod status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u8 = 1;
    /// The guest has a driver for it.
    pub const DRIVER: u8 = 2;
    /// The driver is ready: rings may run.
    pub const DRIVER_OK: u8 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u8 = 8;
    /// The device hit an error it cannot recover from by itself.
    pub const NEEDS_RESET: u8 = 0x40;
    /// The driver gave up.
    pub const FAILED: u8 = 0x80;
}

/// The PCI command register and its Bus Master Enable bit.
const COMMAND: usize = 0x04;
const COMMAND_MASTER: u8 = 0x04;

/// Where the capabilities sit in config space.
const CAP_COMMON: usize = 0x40;
const CAP_NOTIFY: usize = 0x50;
const CAP_ISR: usize = 0x64;
const CAP_DEVICE: usize = 0x74;
const CAP_MSIX: usize = 0x84;
const CAP_PCI_CFG: usize = 0x90;
/// The PCI cfg access capability's fields: cap.bar, cap.offset, cap.length
/// and pci_cfg_data (virtio 1.2, 4.1.4.9).
const PCI_CFG_BAR: usize = CAP_PCI_CFG + 4;
const PCI_CFG_OFFSET: usize = CAP_PCI_CFG + 8;
const PCI_CFG_LENGTH: usize = CAP_PCI_CFG + 12;
const PCI_CFG_DATA: usize = CAP_PCI_CFG + 16;
const PCI_CAP_ID_VNDR: u8 = 0x09;
const PCI_CAP_ID_MSIX: u8 = 0x11;

/// What a register write asks of the transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Status 0 was written: the registers are reset; stop every ring and
    /// reset the device.
    Reset,
    /// FEATURES_OK was accepted with these driver features.
    FeaturesOk(u64),
    /// DRIVER_OK was set: start every enabled queue.
    DriverOk,
    /// The PCI command register's Bus Master Enable changed. Cleared, the
    /// device must not touch guest memory (nor signal MSI-X, a memory
    /// write): stop every ring, keeping its state. Set again: start the
    /// enabled queues again (once DRIVER_OK is set).
    BusMaster(bool),
    /// The driver enabled this queue (its registers are checked: size,
    /// FEATURES_OK set; its addresses are the transport's to check).
    QueueEnabled(u16),
    /// This queue's MSI-X vector changed.
    QueueVector(u16),
    /// The driver wrote this queue's doorbell.
    Notify(u16),
}

/// One queue's registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueRegs {
    /// Ring size.
    pub size: u16,
    /// MSI-X vector (or NO_VECTOR).
    pub vector: u16,
    /// queue_enable was written 1.
    pub enabled: bool,
    /// Descriptor area (guest physical).
    pub desc: u64,
    /// Driver area.
    pub driver: u64,
    /// Device area.
    pub device: u64,
}

/// The device model: config space and registers.
pub struct VirtioPci {
    dev: Arc<dyn Device>,
    cfg: [u8; CONFIG_SPACE_SIZE as usize],
    /// Config space at power-on, for a function-level reset.
    cfg_power_on: [u8; CONFIG_SPACE_SIZE as usize],
    /// Bits of each config byte a write may change.
    wmask: [u8; CONFIG_SPACE_SIZE as usize],
    vectors: u16,
    device_feature_select: u32,
    driver_feature_select: u32,
    driver_features: u64,
    msix_config: u16,
    status: u8,
    generation: u8,
    /// The ISR status byte: read-to-clear, hence atomic (reads take
    /// `&self`).
    isr: AtomicU8,
    queue_select: u16,
    queues: Vec<QueueRegs>,
}

/// virtio device type and PCI class of a device kind.
fn ids(kind: &str) -> (u16, [u8; 3]) {
    // (type, [prog-if, subclass, class])
    match kind {
        "net" => (1, [0, 0, 0x02]),
        "blk" => (2, [0, 0, 0x01]),
        "scsi" => (8, [0, 0, 0x01]),
        _ => (0, [0, 0, 0xff]),
    }
}

/// (offset, size) of the common config fields, in order.
const FIELDS: &[(usize, usize)] = &[
    (0x00, 4), // device_feature_select
    (0x04, 4), // device_feature
    (0x08, 4), // driver_feature_select
    (0x0c, 4), // driver_feature
    (0x10, 2), // msix_config
    (0x12, 2), // num_queues
    (0x14, 1), // device_status
    (0x15, 1), // config_generation
    (0x16, 2), // queue_select
    (0x18, 2), // queue_size
    (0x1a, 2), // queue_msix_vector
    (0x1c, 2), // queue_enable
    (0x1e, 2), // queue_notify_off
    (0x20, 8), // queue_desc
    (0x28, 8), // queue_driver
    (0x30, 8), // queue_device
    (0x38, 2), // queue_notify_data
    (0x3a, 2), // queue_reset
];

impl VirtioPci {
    /// The model of `dev`, with one MSI-X vector per queue and one for
    /// config changes (at most MAX_VECTORS).
    pub fn new(dev: Arc<dyn Device>) -> VirtioPci {
        let nq = dev.queues();
        let vectors = nq.saturating_add(1).min(MAX_VECTORS);
        let (ty, class) = ids(dev.kind());
        let mut p = VirtioPci {
            dev,
            cfg: [0; CONFIG_SPACE_SIZE as usize],
            cfg_power_on: [0; CONFIG_SPACE_SIZE as usize],
            wmask: [0; CONFIG_SPACE_SIZE as usize],
            vectors,
            device_feature_select: 0,
            driver_feature_select: 0,
            driver_features: 0,
            msix_config: NO_VECTOR,
            status: 0,
            generation: 0,
            isr: AtomicU8::new(0),
            queue_select: 0,
            queues: Vec::new(),
        };
        p.reset();
        let c = &mut p.cfg;
        put16(c, 0x00, 0x1af4);
        put16(c, 0x02, 0x1040 + ty);
        put16(c, 0x06, 0x0010); // status: capability list
        c[0x08] = 1; // revision: modern only
        c[0x09..0x0c].copy_from_slice(&class);
        put16(c, 0x2c, 0x1af4); // subsystem vendor
        put16(c, 0x2e, 0x1100); // subsystem
        c[0x34] = CAP_COMMON as u8;
        // BARs: 32-bit memory, not prefetchable (low bits 0).
        vendor_cap(c, CAP_COMMON, CAP_NOTIFY, 1, COMMON_OFF, COMMON_LEN, 16);
        vendor_cap(c, CAP_NOTIFY, CAP_ISR, 2, NOTIFY_OFF, NOTIFY_LEN, 20);
        put32(c, CAP_NOTIFY + 16, NOTIFY_MULTIPLIER);
        vendor_cap(c, CAP_ISR, CAP_DEVICE, 3, ISR_OFF, 4, 16);
        vendor_cap(c, CAP_DEVICE, CAP_MSIX, 4, DEVICE_OFF, DEVICE_LEN, 16);
        c[CAP_MSIX] = PCI_CAP_ID_MSIX;
        c[CAP_MSIX + 1] = CAP_PCI_CFG as u8;
        put16(c, CAP_MSIX + 2, vectors - 1);
        put32(c, CAP_MSIX + 4, MSIX_TABLE_OFF | 1);
        put32(c, CAP_MSIX + 8, MSIX_PBA_OFF | 1);
        // Last: the window into the BARs, pointing nowhere until the
        // driver sets it.
        vendor_cap(c, CAP_PCI_CFG, 0, 5, 0, 0, 20);
        let w = &mut p.wmask;
        // Command: I/O, memory, bus master, INTx disable.
        w[COMMAND] = 0x07;
        w[COMMAND + 1] = 0x04;
        // BARs hold their size's alignment (sizing reads back the size).
        put32(w, 0x10, !(BAR0_SIZE as u32 - 1));
        put32(w, 0x14, !(BAR1_SIZE as u32 - 1));
        w[0x3c] = 0xff; // interrupt line
        w[CAP_MSIX + 3] = 0xc0; // MSI-X enable, function mask
        w[PCI_CFG_BAR] = 0xff;
        w[PCI_CFG_OFFSET..PCI_CFG_DATA + 4].fill(0xff);
        p.cfg_power_on = p.cfg;
        p
    }

    /// The virtio registers back to their state at power-on (status 0
    /// written: a virtio reset). The PCI config space keeps what the VMM
    /// and the driver programmed there (BARs, command, MSI-X enable).
    pub fn reset(&mut self) {
        let max = self.dev.max_queue_size();
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.driver_features = 0;
        self.msix_config = NO_VECTOR;
        self.status = 0;
        self.isr.store(0, Ordering::Relaxed);
        self.queue_select = 0;
        self.queues = (0..self.dev.queues())
            .map(|_| QueueRegs { size: max, vector: NO_VECTOR, enabled: false, desc: 0, driver: 0, device: 0 })
            .collect();
    }

    /// A function-level reset (vfio-user's DEVICE_RESET, a PCI FLR): the
    /// virtio registers as for [`VirtioPci::reset`], and the config space
    /// back to power-on too: command register (bus master off), BARs,
    /// interrupt line, MSI-X enable and function mask, the PCI cfg access
    /// window. The transport stops the rings first (no
    /// [`Effect::BusMaster`] is returned).
    pub fn function_reset(&mut self) {
        self.cfg = self.cfg_power_on;
        self.reset();
    }

    /// MSI-X vectors the device has.
    pub fn vectors(&self) -> u16 {
        self.vectors
    }

    /// The device status.
    pub fn status(&self) -> u8 {
        self.status
    }

    /// Whether Bus Master Enable is set in the PCI command register: the
    /// device may touch guest memory (run rings) only then.
    pub fn bus_master(&self) -> bool {
        self.cfg[COMMAND] & COMMAND_MASTER != 0
    }

    /// The driver features (final once FEATURES_OK is set).
    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    /// Queue `q`'s registers.
    pub fn queue(&self, q: u16) -> Option<&QueueRegs> {
        self.queues.get(q as usize)
    }

    /// Queues the device has.
    pub fn num_queues(&self) -> u16 {
        self.queues.len() as u16
    }

    /// The device broke (a ring the driver set up cannot run): the driver
    /// sees NEEDS_RESET.
    pub fn set_needs_reset(&mut self) {
        if self.status & status::DRIVER_OK != 0 {
            self.status |= status::NEEDS_RESET;
        }
    }

    /// The device configuration changed (net's link status): the
    /// generation moves on (a driver reading the config across it reads
    /// again) and the ISR's configuration bit is set. Returns the MSI-X
    /// vector the transport must signal: msix_config, if the driver set
    /// one, the device is DRIVER_OK and Bus Master Enable is set (MSI-X is
    /// a memory write); else None (a driver not ready yet reads the config
    /// when it is).
    pub fn config_changed(&mut self) -> Option<u16> {
        self.generation = self.generation.wrapping_add(1);
        self.isr.fetch_or(ISR_CONFIG, Ordering::Relaxed);
        let ready = self.status & status::DRIVER_OK != 0 && self.bus_master();
        (ready && self.msix_config != NO_VECTOR).then_some(self.msix_config)
    }

    /// The config_generation register.
    pub fn generation(&self) -> u8 {
        self.generation
    }

    /// Features offered: the device's, VERSION_1 always (a modern device).
    pub fn offered(&self) -> u64 {
        self.dev.features() | ring_features::VERSION_1
    }

    /// Reads config space; `off + data.len()` must lie inside it (bytes
    /// outside read as 0). A read of pci_cfg_data reads the BAR through
    /// the PCI cfg access window (its first cap.length bytes; of BAR
    /// reads only the ISR's has a side effect: it clears it).
    pub fn config_read(&self, off: u64, data: &mut [u8]) {
        let mut window = None;
        for (i, b) in data.iter_mut().enumerate() {
            let Some(o) = off.checked_add(i as u64).map(|o| o as usize).filter(|&o| o < self.cfg.len()) else {
                *b = 0;
                continue;
            };
            *b = self.cfg[o];
            if (PCI_CFG_DATA..PCI_CFG_DATA + 4).contains(&o) {
                let w = window.get_or_insert_with(|| {
                    self.window().map(|(bar, at, len)| {
                        let mut v = [0u8; 4];
                        self.bar_read(bar, at, &mut v[..len]);
                        (v, len)
                    })
                });
                if let Some((v, len)) = w {
                    if o - PCI_CFG_DATA < *len {
                        *b = v[o - PCI_CFG_DATA];
                    }
                }
            }
        }
    }

    /// Writes config space: only the writable bits change (read-only
    /// registers and bits ignore writes, as on hardware). Returns what the
    /// transport must do: [`Effect::BusMaster`] when Bus Master Enable
    /// changes, and, for a write that reaches pci_cfg_data, what writing
    /// its first cap.length bytes to the BAR the PCI cfg access window
    /// names asks for (as from [`VirtioPci::bar_write`]).
    pub fn config_write(&mut self, off: u64, data: &[u8]) -> Vec<Effect> {
        let master = self.bus_master();
        let mut to_window = false;
        for (i, &v) in data.iter().enumerate() {
            let Some(o) = off.checked_add(i as u64).map(|o| o as usize).filter(|&o| o < self.cfg.len()) else {
                break;
            };
            self.cfg[o] = (self.cfg[o] & !self.wmask[o]) | (v & self.wmask[o]);
            to_window |= (PCI_CFG_DATA..PCI_CFG_DATA + 4).contains(&o);
        }
        let mut fx = Vec::new();
        if self.bus_master() != master {
            fx.push(Effect::BusMaster(!master));
        }
        if let Some((bar, at, len)) = self.window().filter(|_| to_window) {
            let mut v = [0u8; 4];
            v[..len].copy_from_slice(&self.cfg[PCI_CFG_DATA..PCI_CFG_DATA + len]);
            fx.extend(self.bar_write(bar, at, &v[..len]));
        }
        fx
    }

    /// Where the PCI cfg access window points: (bar, offset, length), if
    /// the driver set it to an access the spec allows (1, 2 or 4 bytes,
    /// aligned, inside BAR0, where every virtio structure is). Anything
    /// else is ignored (virtio 1.2, 4.1.4.9: the driver MUST NOT use such
    /// a window).
    fn window(&self) -> Option<(u32, u64, usize)> {
        let bar = self.cfg[PCI_CFG_BAR];
        let at = u64::from(get32(&self.cfg, PCI_CFG_OFFSET));
        let len = get32(&self.cfg, PCI_CFG_LENGTH);
        let ok = bar == 0
            && matches!(len, 1 | 2 | 4)
            && at.is_multiple_of(u64::from(len))
            && at + u64::from(len) <= BAR0_SIZE;
        ok.then_some((u32::from(bar), at, len as usize))
    }

    /// Reads `data.len()` bytes at `off` of BAR `bar`. Bytes outside the
    /// structures read as 0. A read covering the ISR byte clears it
    /// (virtio 1.2, 4.1.4.5), as the only read with a side effect.
    pub fn bar_read(&self, bar: u32, off: u64, data: &mut [u8]) {
        data.fill(0);
        if bar != 0 {
            return;
        }
        let len = data.len() as u64;
        let Some(end) = off.checked_add(len) else { return };
        if end <= COMMON_OFF + COMMON_LEN {
            let common = self.common_bytes();
            data.copy_from_slice(&common[off as usize..end as usize]);
        } else if off >= DEVICE_OFF && end <= DEVICE_OFF + DEVICE_LEN {
            if let Some(b) = self.dev.read_config((off - DEVICE_OFF) as u32, len as u32) {
                if b.len() == data.len() {
                    data.copy_from_slice(&b);
                }
            }
        } else if off <= ISR_OFF && end > ISR_OFF {
            data[(ISR_OFF - off) as usize] = self.isr.swap(0, Ordering::Relaxed);
        }
    }

    /// Writes `data` at `off` of BAR `bar`; returns what the transport must
    /// do. Writes outside the structures and to read-only fields are
    /// ignored.
    pub fn bar_write(&mut self, bar: u32, off: u64, data: &[u8]) -> Vec<Effect> {
        let mut fx = Vec::new();
        if bar != 0 {
            return fx;
        }
        let Some(end) = off.checked_add(data.len() as u64) else { return fx };
        if end <= COMMON_OFF + COMMON_LEN {
            self.common_write(off as usize, data, &mut fx);
        } else if off >= DEVICE_OFF && end <= DEVICE_OFF + DEVICE_LEN {
            // A refused write (a read-only field) is ignored, as the spec
            // lets a device do.
            let _ = self.dev.write_config((off - DEVICE_OFF) as u32, data, self.driver_features);
        } else if off >= NOTIFY_OFF && end <= NOTIFY_OFF + NOTIFY_LEN {
            let q = (off - NOTIFY_OFF) / u64::from(NOTIFY_MULTIPLIER);
            if q < self.queues.len() as u64 {
                fx.push(Effect::Notify(q as u16));
            }
        }
        fx
    }

    /// The queue queue_select names, if there is one.
    fn selected(&self) -> Option<&QueueRegs> {
        self.queues.get(self.queue_select as usize)
    }

    fn common_bytes(&self) -> [u8; COMMON_LEN as usize] {
        let mut b = [0u8; COMMON_LEN as usize];
        put32(&mut b, 0x00, self.device_feature_select);
        let offered = self.offered();
        let dfeat = match self.device_feature_select {
            0 => offered as u32,
            1 => (offered >> 32) as u32,
            _ => 0,
        };
        put32(&mut b, 0x04, dfeat);
        put32(&mut b, 0x08, self.driver_feature_select);
        let drv = match self.driver_feature_select {
            0 => self.driver_features as u32,
            1 => (self.driver_features >> 32) as u32,
            _ => 0,
        };
        put32(&mut b, 0x0c, drv);
        put16(&mut b, 0x10, self.msix_config);
        put16(&mut b, 0x12, self.queues.len() as u16);
        b[0x14] = self.status;
        b[0x15] = self.generation;
        put16(&mut b, 0x16, self.queue_select);
        if let Some(q) = self.selected() {
            put16(&mut b, 0x18, q.size);
            put16(&mut b, 0x1a, q.vector);
            put16(&mut b, 0x1c, q.enabled as u16);
            put16(&mut b, 0x1e, self.queue_select);
            put64(&mut b, 0x20, q.desc);
            put64(&mut b, 0x28, q.driver);
            put64(&mut b, 0x30, q.device);
            put16(&mut b, 0x38, self.queue_select);
        } else {
            // No such queue: size 0 tells the driver so.
            put16(&mut b, 0x1a, NO_VECTOR);
        }
        b
    }

    /// A write to the common config: every field it covers takes the
    /// written bytes merged over its current value, in field order (so a
    /// wide write selecting a queue and setting it works as two writes).
    fn common_write(&mut self, off: usize, data: &[u8], fx: &mut Vec<Effect>) {
        let end = off + data.len();
        for &(f, size) in FIELDS {
            if f + size <= off || f >= end {
                continue;
            }
            let mut cur = self.common_bytes();
            for (i, &v) in data.iter().enumerate() {
                let o = off + i;
                if o >= f && o < f + size {
                    cur[o] = v;
                }
            }
            let val = cur[f..f + size].iter().rev().fold(0u64, |a, &b| (a << 8) | u64::from(b));
            self.field_write(f, val, fx);
        }
    }

    fn field_write(&mut self, field: usize, val: u64, fx: &mut Vec<Effect>) {
        let features_ok = self.status & status::FEATURES_OK != 0;
        let q = self.queue_select;
        let vectors = self.vectors;
        let vector = |v: u16| if v < vectors { v } else { NO_VECTOR };
        match field {
            0x00 => self.device_feature_select = val as u32,
            0x08 => self.driver_feature_select = val as u32,
            0x0c if !features_ok => match self.driver_feature_select {
                0 => self.driver_features = (self.driver_features & !0xffff_ffff) | val,
                1 => self.driver_features = (self.driver_features & 0xffff_ffff) | (val << 32),
                _ => {}
            },
            0x10 => self.msix_config = vector(val as u16),
            0x14 => self.status_write(val as u8, fx),
            0x16 => self.queue_select = val as u16,
            0x18 | 0x1a | 0x1c | 0x20 | 0x28 | 0x30 => {
                let max = self.dev.max_queue_size();
                let packed = self.driver_features & ring_features::RING_PACKED != 0;
                let Some(r) = self.queues.get_mut(q as usize) else { return };
                match field {
                    0x1a => {
                        r.vector = vector(val as u16);
                        fx.push(Effect::QueueVector(q));
                    }
                    // Only 1 may be written (a queue stops by reset).
                    0x1c if val == 1 && !r.enabled => {
                        let size_ok = r.size != 0 && r.size <= max && (packed || r.size.is_power_of_two());
                        if features_ok && size_ok {
                            r.enabled = true;
                            fx.push(Effect::QueueEnabled(q));
                        }
                    }
                    // An enabled queue's set-up is fixed.
                    _ if r.enabled => {}
                    0x18 => r.size = val as u16,
                    0x20 => r.desc = val,
                    0x28 => r.driver = val,
                    0x30 => r.device = val,
                    _ => {}
                }
            }
            // Read-only fields (device_feature, num_queues, generation,
            // notify_off and notify_data), queue_reset (not offered), and
            // driver features after FEATURES_OK.
            _ => {}
        }
    }

    fn status_write(&mut self, v: u8, fx: &mut Vec<Effect>) {
        if v == 0 {
            self.reset();
            fx.push(Effect::Reset);
            return;
        }
        let old = self.status;
        // The driver sets bits; only a reset clears them.
        let mut new = old | v;
        if new & status::FEATURES_OK != 0 && old & status::FEATURES_OK == 0 {
            let f = self.driver_features;
            if f & !self.offered() != 0 || f & ring_features::VERSION_1 == 0 {
                // The driver reads FEATURES_OK back and gives up.
                new &= !status::FEATURES_OK;
            } else {
                fx.push(Effect::FeaturesOk(f));
            }
        }
        if new & status::DRIVER_OK != 0 && old & status::DRIVER_OK == 0 {
            if new & status::FEATURES_OK == 0 {
                new &= !status::DRIVER_OK;
            } else {
                fx.push(Effect::DriverOk);
            }
        }
        self.status = new;
    }
}

fn vendor_cap(c: &mut [u8], at: usize, next: usize, cfg_type: u8, off: u64, len: u64, cap_len: u8) {
    c[at] = PCI_CAP_ID_VNDR;
    c[at + 1] = next as u8;
    c[at + 2] = cap_len;
    c[at + 3] = cfg_type;
    c[at + 4] = 0; // BAR0
    put32(c, at + 8, off as u32);
    put32(c, at + 12, len as u32);
}

fn get32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests;
