use std::sync::Mutex;

use vhostd_device::{RingPlace, RingTotals};

use super::*;

/// A blk-like device with two queues and an 8-byte config space.
struct Fake {
    config: Mutex<[u8; 8]>,
}

const FEATURES: u64 = ring_features::VERSION_1 | ring_features::EVENT_IDX | 1 << 9;

impl Device for Fake {
    fn kind(&self) -> &'static str {
        "blk"
    }
    fn features(&self) -> u64 {
        FEATURES
    }
    fn queues(&self) -> u16 {
        2
    }
    fn max_queue_size(&self) -> u16 {
        256
    }
    fn place(&self, index: u16, _features: u64) -> Option<RingPlace> {
        (index < 2).then_some(RingPlace { group: index as usize, slot: 0 })
    }
    fn read_config(&self, offset: u32, len: u32) -> Option<Vec<u8>> {
        let c = self.config.lock().unwrap();
        let end = offset.checked_add(len)? as usize;
        (end <= c.len()).then(|| c[offset as usize..end].to_vec())
    }
    fn write_config(&self, offset: u32, data: &[u8], _features: u64) -> bool {
        if offset != 4 || data.len() != 1 {
            return false;
        }
        self.config.lock().unwrap()[4] = data[0];
        true
    }
    fn set_features(&self, _features: u64) {}
    fn reset(&self) {}
    fn ring_label(&self, place: RingPlace) -> (u16, Option<&'static str>) {
        (place.group as u16, None)
    }
    fn totals(&self, _rings: &[RingTotals<'_>]) -> Vec<(&'static str, String)> {
        Vec::new()
    }
}

fn model() -> VirtioPci {
    VirtioPci::new(Arc::new(Fake { config: Mutex::new([1, 2, 3, 4, 5, 6, 7, 8]) }))
}

fn cfg32(p: &VirtioPci, off: u64) -> u32 {
    let mut b = [0u8; 4];
    p.config_read(off, &mut b);
    u32::from_le_bytes(b)
}

fn rd(p: &VirtioPci, off: u64, len: usize) -> u64 {
    let mut b = [0u8; 8];
    p.bar_read(0, off, &mut b[..len]);
    u64::from_le_bytes(b)
}

fn wr(p: &mut VirtioPci, off: u64, len: usize, v: u64) -> Vec<Effect> {
    p.bar_write(0, off, &v.to_le_bytes()[..len])
}

/// Drives the driver's set-up up to FEATURES_OK with `features`.
fn negotiate(p: &mut VirtioPci, features: u64) -> Vec<Effect> {
    wr(p, 0x14, 1, 1);
    wr(p, 0x14, 1, 3);
    wr(p, 0x08, 4, 0);
    wr(p, 0x0c, 4, features & 0xffff_ffff);
    wr(p, 0x08, 4, 1);
    wr(p, 0x0c, 4, features >> 32);
    wr(p, 0x14, 1, 0xb)
}

#[test]
fn config_space_identifies_a_modern_virtio_device_with_its_capabilities() {
    let p = model();
    assert_eq!(cfg32(&p, 0), 0x1042_1af4);
    assert_eq!(cfg32(&p, 8) & 0xff, 1, "revision 1");
    assert_eq!(cfg32(&p, 8) >> 8, 0x010000, "mass storage class");
    assert_eq!(cfg32(&p, 4) >> 16 & 0x10, 0x10, "capability list");
    // Walk the list: four virtio caps of types 1, 2, 3, 4, MSI-X, then
    // the PCI cfg access cap (type 5). Each lies inside config space, past
    // the header, dword aligned, and ends before the next one starts.
    let mut at = cfg32(&p, 0x34) & 0xff;
    let mut seen = Vec::new();
    let mut end = 0x40;
    while at != 0 {
        assert!(
            at >= end && at.is_multiple_of(4),
            "cap at {at:#x} overlaps the one before (ends {end:#x}) or is unaligned"
        );
        let head = cfg32(&p, at as u64);
        let (id, next) = (head & 0xff, head >> 8 & 0xff);
        let len = if id == 0x09 {
            let (ty, bar) = (head >> 24, cfg32(&p, at as u64 + 4) & 0xff);
            let (off, len) = (cfg32(&p, at as u64 + 8), cfg32(&p, at as u64 + 12));
            assert_eq!(bar, 0);
            assert!(u64::from(off) + u64::from(len) <= BAR0_SIZE);
            seen.push((ty, off, len));
            head >> 16 & 0xff
        } else {
            assert_eq!(id, 0x11);
            assert_eq!(head >> 16 & 0x7ff, 2, "3 vectors: 2 queues and config");
            assert_eq!(cfg32(&p, at as u64 + 4), 1, "table in BAR1 at 0");
            seen.push((0x11, 0, 0));
            12
        };
        end = at + len;
        assert!(end <= CONFIG_SPACE_SIZE as u32);
        at = next;
    }
    assert_eq!(
        seen,
        vec![(1, 0, 0x40), (2, 0x3000, 0x1000), (3, 0x1000, 4), (4, 0x2000, 0x100), (0x11, 0, 0), (5, 0, 0)]
    );
    assert_eq!(cfg32(&p, CAP_NOTIFY as u64 + 16), 4, "notify_off_multiplier");
    assert_eq!(cfg32(&p, CAP_NOTIFY as u64) >> 16 & 0xff, 20, "the notify cap has the multiplier");
    assert_eq!(cfg32(&p, CAP_PCI_CFG as u64) >> 16 & 0xff, 20, "the PCI cfg cap has pci_cfg_data");
}

/// Points the PCI cfg access window at `len` bytes at `off` of BAR `bar`
/// (as a driver does: cap.bar, cap.offset, cap.length).
fn window(p: &mut VirtioPci, bar: u8, off: u32, len: u32) {
    assert_eq!(p.config_write(PCI_CFG_BAR as u64, &[bar]), vec![]);
    assert_eq!(p.config_write(PCI_CFG_OFFSET as u64, &off.to_le_bytes()), vec![]);
    assert_eq!(p.config_write(PCI_CFG_LENGTH as u64, &len.to_le_bytes()), vec![]);
}

const DATA: u64 = PCI_CFG_DATA as u64;

#[test]
fn the_pci_cfg_window_reaches_bar0_with_the_same_effects() {
    let mut p = model();
    // Reads: num_queues (2 bytes), the device config (4), a byte of it.
    window(&mut p, 0, 0x12, 2);
    assert_eq!(cfg32(&p, DATA) & 0xffff, 2);
    window(&mut p, 0, DEVICE_OFF as u32, 4);
    assert_eq!(cfg32(&p, DATA), 0x0403_0201);
    let mut b = [0u8; 1];
    p.config_read(DATA, &mut b);
    assert_eq!(b, [1]);
    window(&mut p, 0, DEVICE_OFF as u32 + 5, 1);
    p.config_read(DATA, &mut b);
    assert_eq!(b, [6]);
    // The window's fields read back as written.
    assert_eq!(cfg32(&p, PCI_CFG_OFFSET as u64), DEVICE_OFF as u32 + 5);
    assert_eq!(cfg32(&p, PCI_CFG_LENGTH as u64), 1);
    // The whole set-up through the window: status, features, a queue.
    window(&mut p, 0, 0x14, 1);
    assert_eq!(p.config_write(DATA, &[1]), vec![]);
    assert_eq!(p.config_write(DATA, &[3]), vec![]);
    window(&mut p, 0, 0x08, 4);
    p.config_write(DATA, &1u32.to_le_bytes());
    window(&mut p, 0, 0x0c, 4);
    p.config_write(DATA, &1u32.to_le_bytes()); // VERSION_1 (bit 32)
    window(&mut p, 0, 0x14, 1);
    assert_eq!(p.config_write(DATA, &[0xb]), vec![Effect::FeaturesOk(ring_features::VERSION_1)]);
    assert_eq!(p.status(), 0xb);
    window(&mut p, 0, 0x16, 2);
    p.config_write(DATA, &1u16.to_le_bytes());
    window(&mut p, 0, 0x18, 2);
    p.config_write(DATA, &64u16.to_le_bytes());
    window(&mut p, 0, 0x1c, 2);
    assert_eq!(p.config_write(DATA, &1u16.to_le_bytes()), vec![Effect::QueueEnabled(1)]);
    assert_eq!(p.queue(1).unwrap().size, 64);
    window(&mut p, 0, 0x14, 1);
    assert_eq!(p.config_write(DATA, &[0xf]), vec![Effect::DriverOk]);
    // A doorbell (2 bytes, as SeaBIOS writes it), in a 4-byte config
    // write: the first cap.length bytes go to the BAR.
    window(&mut p, 0, NOTIFY_OFF as u32 + 4, 2);
    assert_eq!(p.config_write(DATA, &[1, 0, 0xff, 0xff]), vec![Effect::Notify(1)]);
    // Writing the device config through it.
    window(&mut p, 0, DEVICE_OFF as u32 + 4, 1);
    assert_eq!(p.config_write(DATA, &[0x77]), vec![]);
    assert_eq!(rd(&p, DEVICE_OFF + 4, 1), 0x77);
    // A write to the cap's fields alone touches no BAR.
    window(&mut p, 0, 0x14, 1);
    assert_eq!(p.status(), 0xf);
    // Status 0 through the window resets.
    assert_eq!(p.config_write(DATA, &[0]), vec![Effect::Reset]);
    assert_eq!(p.status(), 0);
}

#[test]
fn a_pci_cfg_window_the_spec_forbids_is_ignored() {
    let mut p = model();
    wr(&mut p, 0x14, 1, 1);
    // Each would reach the status byte (a 0 written there resets) or
    // another BAR: unaligned, a length other than 1, 2 or 4, past BAR0,
    // BAR1 (the MSI-X table, not a virtio structure), a BAR that does not
    // exist, an offset that wraps.
    let bad = [
        (0u8, 0x13u32, 2u32),
        (0, 0x12, 4),
        (0, 0x14, 3),
        (0, 0x14, 0),
        (0, 0x10, 8),
        (0, BAR0_SIZE as u32, 4),
        (0, BAR0_SIZE as u32 - 2, 4),
        (1, 0x14, 1),
        (2, 0x14, 1),
        (0xff, 0x14, 1),
        (0, 0xffff_fffc, 4),
    ];
    for (bar, off, len) in bad {
        window(&mut p, bar, off, len);
        assert_eq!(p.config_write(DATA, &[0; 4]), vec![], "window {bar}/{off:#x}/{len}");
        assert_eq!(p.status(), 1, "window {bar}/{off:#x}/{len}");
        // A read gives the bytes last written, not the BAR's.
        p.config_write(DATA, &0xa5a5_a5a5u32.to_le_bytes());
        assert_eq!(cfg32(&p, DATA), 0xa5a5_a5a5, "window {bar}/{off:#x}/{len}");
    }
    // The capability's read-only bytes stay.
    p.config_write(CAP_PCI_CFG as u64, &[0xff; 4]);
    assert_eq!(cfg32(&p, CAP_PCI_CFG as u64), 0x0514_0009);
}

#[test]
fn bars_size_like_hardware_and_read_only_registers_ignore_writes() {
    let mut p = model();
    p.config_write(0x10, &[0xff; 4]);
    assert_eq!(cfg32(&p, 0x10), !(BAR0_SIZE as u32 - 1));
    p.config_write(0x14, &[0xff; 4]);
    assert_eq!(cfg32(&p, 0x14), !(BAR1_SIZE as u32 - 1));
    p.config_write(0x10, &0xfebf_0000u32.to_le_bytes());
    assert_eq!(cfg32(&p, 0x10), 0xfebf_0000);
    // Ids, the cap list and unused BARs do not change.
    p.config_write(0, &[0; 64]);
    assert_eq!(cfg32(&p, 0), 0x1042_1af4);
    assert_eq!(cfg32(&p, 0x18), 0);
    assert_eq!(cfg32(&p, 0x34) & 0xff, 0x40);
    // Past the end: ignored, reads 0.
    p.config_write(250, &[0xff; 10]);
    let mut b = [0xaau8; 10];
    p.config_read(250, &mut b);
    assert_eq!(b, [0; 10]);
}

#[test]
fn feature_negotiation_checks_what_the_driver_acks() {
    let mut p = model();
    wr(&mut p, 0x00, 4, 0);
    assert_eq!(rd(&p, 0x04, 4), FEATURES & 0xffff_ffff);
    wr(&mut p, 0x00, 4, 1);
    assert_eq!(rd(&p, 0x04, 4), FEATURES >> 32);
    wr(&mut p, 0x00, 4, 7);
    assert_eq!(rd(&p, 0x04, 4), 0);
    // Without VERSION_1: FEATURES_OK does not stick.
    assert_eq!(negotiate(&mut p, ring_features::EVENT_IDX), vec![]);
    assert_eq!(rd(&p, 0x14, 1), 3);
    // A bit not offered: refused too.
    wr(&mut p, 0x14, 1, 0);
    assert_eq!(negotiate(&mut p, ring_features::VERSION_1 | 1 << 5), vec![]);
    assert_eq!(rd(&p, 0x14, 1), 3);
    // DRIVER_OK without FEATURES_OK: refused.
    assert_eq!(wr(&mut p, 0x14, 1, 7), vec![]);
    assert_eq!(rd(&p, 0x14, 1), 3);
    // A subset with VERSION_1: accepted, and fixed from then on.
    assert_eq!(wr(&mut p, 0x14, 1, 0), vec![Effect::Reset]);
    let f = ring_features::VERSION_1 | 1 << 9;
    assert_eq!(negotiate(&mut p, f), vec![Effect::FeaturesOk(f)]);
    assert_eq!(rd(&p, 0x14, 1), 0xb);
    wr(&mut p, 0x08, 4, 0);
    wr(&mut p, 0x0c, 4, 0xffff_ffff);
    assert_eq!(p.driver_features(), f);
    assert_eq!(wr(&mut p, 0x14, 1, 0xf), vec![Effect::DriverOk]);
}

#[test]
fn queues_are_set_up_through_queue_select_and_enabled_once_valid() {
    let mut p = model();
    assert_eq!(rd(&p, 0x12, 2), 2, "num_queues");
    wr(&mut p, 0x16, 2, 1);
    assert_eq!(rd(&p, 0x18, 2), 256, "max size");
    assert_eq!(rd(&p, 0x1e, 2), 1, "notify off");
    // Enabling before FEATURES_OK does nothing.
    assert_eq!(wr(&mut p, 0x1c, 2, 1), vec![]);
    negotiate(&mut p, ring_features::VERSION_1);
    // A size that is not a power of two (split ring), or above the max.
    wr(&mut p, 0x18, 2, 100);
    assert_eq!(wr(&mut p, 0x1c, 2, 1), vec![]);
    wr(&mut p, 0x18, 2, 512);
    assert_eq!(wr(&mut p, 0x1c, 2, 1), vec![]);
    wr(&mut p, 0x18, 2, 64);
    // 64-bit addresses written as two halves, and as one 8-byte write.
    wr(&mut p, 0x20, 4, 0x1000);
    wr(&mut p, 0x24, 4, 0x1);
    wr(&mut p, 0x28, 8, 0x2_0000_2000);
    wr(&mut p, 0x30, 8, 0x3000);
    assert_eq!(wr(&mut p, 0x1a, 2, 1), vec![Effect::QueueVector(1)]);
    assert_eq!(wr(&mut p, 0x1c, 2, 1), vec![Effect::QueueEnabled(1)]);
    let q = *p.queue(1).unwrap();
    assert_eq!(
        q,
        QueueRegs { size: 64, vector: 1, enabled: true, desc: 0x1_0000_1000, driver: 0x2_0000_2000, device: 0x3000 }
    );
    // Fixed once enabled.
    wr(&mut p, 0x20, 8, 0);
    wr(&mut p, 0x18, 2, 16);
    assert_eq!(*p.queue(1).unwrap(), q);
    // A vector past the table reads back as NO_VECTOR.
    wr(&mut p, 0x1a, 2, 3);
    assert_eq!(rd(&p, 0x1a, 2), u64::from(NO_VECTOR));
    wr(&mut p, 0x10, 2, 2);
    assert_eq!(rd(&p, 0x10, 2), 2);
    wr(&mut p, 0x10, 2, 9);
    assert_eq!(rd(&p, 0x10, 2), u64::from(NO_VECTOR));
    // A queue that does not exist: size 0, writes ignored.
    wr(&mut p, 0x16, 2, 7);
    assert_eq!(rd(&p, 0x18, 2), 0);
    assert_eq!(wr(&mut p, 0x1c, 2, 1), vec![]);
    // Reset clears every queue.
    assert_eq!(wr(&mut p, 0x14, 1, 0), vec![Effect::Reset]);
    assert!(!p.queue(1).unwrap().enabled);
    assert_eq!(p.status(), 0);
}

#[test]
fn doorbells_name_existing_queues_only() {
    let mut p = model();
    assert_eq!(p.bar_write(0, NOTIFY_OFF, &[0, 0]), vec![Effect::Notify(0)]);
    assert_eq!(p.bar_write(0, NOTIFY_OFF + 4, &1u32.to_le_bytes()), vec![Effect::Notify(1)]);
    assert_eq!(p.bar_write(0, NOTIFY_OFF + 8, &2u32.to_le_bytes()), vec![]);
    assert_eq!(p.bar_write(0, NOTIFY_OFF + NOTIFY_LEN - 2, &[0; 4]), vec![]);
    assert_eq!(p.bar_write(0, u64::MAX - 1, &[0; 4]), vec![]);
    assert_eq!(p.bar_write(1, 0, &[0; 4]), vec![]);
}

#[test]
fn device_config_goes_to_the_device() {
    let mut p = model();
    assert_eq!(rd(&p, DEVICE_OFF, 4), 0x0403_0201);
    assert_eq!(rd(&p, DEVICE_OFF + 4, 4), 0x0807_0605);
    // The device refuses what it does not serve: reads 0.
    assert_eq!(rd(&p, DEVICE_OFF + 6, 4), 0);
    p.bar_write(0, DEVICE_OFF + 4, &[0x55]);
    assert_eq!(rd(&p, DEVICE_OFF + 4, 1), 0x55);
    p.bar_write(0, DEVICE_OFF, &[0x66]);
    assert_eq!(rd(&p, DEVICE_OFF, 1), 1);
    assert_eq!(rd(&p, ISR_OFF, 1), 0);
    assert_eq!(rd(&p, 0x3ffc, 4), 0);
}

#[test]
fn needs_reset_shows_only_on_a_running_device_until_reset() {
    let mut p = model();
    p.set_needs_reset();
    assert_eq!(p.status(), 0);
    negotiate(&mut p, ring_features::VERSION_1);
    wr(&mut p, 0x14, 1, 0xf);
    p.set_needs_reset();
    assert_eq!(rd(&p, 0x14, 1), 0x4f);
    wr(&mut p, 0x14, 1, 0);
    assert_eq!(rd(&p, 0x14, 1), 0);
}

#[test]
fn bus_master_enable_changes_are_reported() {
    let mut p = model();
    assert!(!p.bus_master(), "clear at power-on");
    // Memory space alone: no change.
    assert_eq!(p.config_write(0x04, &[0x02, 0]), vec![]);
    // pci_set_master: set (a 2-byte write, and the status register's
    // read-only bytes in a 4-byte one change nothing more).
    assert_eq!(p.config_write(0x04, &[0x06, 0]), vec![Effect::BusMaster(true)]);
    assert!(p.bus_master());
    assert_eq!(p.config_write(0x04, &[0x06, 0x04, 0xff, 0xff]), vec![]);
    assert_eq!(cfg32(&p, 0x04) & 0xffff, 0x0406);
    // Cleared (QEMU's reset, Linux's pci_disable_device), in a byte write.
    assert_eq!(p.config_write(0x04, &[0x02]), vec![Effect::BusMaster(false)]);
    assert!(!p.bus_master());
    // Neither a virtio reset nor the registers' writes touch it.
    p.config_write(0x04, &[0x06]);
    assert_eq!(wr(&mut p, 0x14, 1, 0), vec![Effect::Reset]);
    assert!(p.bus_master());
}

#[test]
fn a_function_reset_restores_config_space_and_a_virtio_reset_keeps_it() {
    let mut p = model();
    let space = |p: &VirtioPci| {
        let mut b = [0u8; CONFIG_SPACE_SIZE as usize];
        p.config_read(0, &mut b);
        b
    };
    let power_on = space(&p);
    // What a VMM and its guest program: memory space, bus master and
    // INTx disable, the BARs, the interrupt line, MSI-X enabled and
    // masked, the PCI cfg access window.
    p.config_write(0x04, &[0x06, 0x04]);
    p.config_write(0x10, &0xfebf_0000u32.to_le_bytes());
    p.config_write(0x14, &0xfebf_4000u32.to_le_bytes());
    p.config_write(0x3c, &[0x0b]);
    p.config_write(CAP_MSIX as u64 + 3, &[0xc0]);
    window(&mut p, 0, DEVICE_OFF as u32, 4);
    negotiate(&mut p, ring_features::VERSION_1);
    wr(&mut p, 0x14, 1, 0xf);
    let programmed = space(&p);
    assert_ne!(programmed, power_on);
    // A virtio reset (status 0) leaves config space alone.
    assert_eq!(wr(&mut p, 0x14, 1, 0), vec![Effect::Reset]);
    assert_eq!(space(&p), programmed);
    assert!(p.bus_master());
    // A function-level reset: registers and config space as at power-on.
    negotiate(&mut p, ring_features::VERSION_1);
    wr(&mut p, 0x14, 1, 0xf);
    p.function_reset();
    assert_eq!(space(&p), power_on);
    assert!(!p.bus_master());
    assert_eq!((p.status(), p.driver_features(), rd(&p, 0x14, 1)), (0, 0, 0));
    // And it works as at power-on: BAR sizing, bus master.
    p.config_write(0x10, &[0xff; 4]);
    assert_eq!(cfg32(&p, 0x10), !(BAR0_SIZE as u32 - 1));
    assert_eq!(p.config_write(0x04, &[0x06]), vec![Effect::BusMaster(true)]);
}

#[test]
fn a_config_change_moves_the_generation_sets_the_isr_and_names_the_vector() {
    let mut p = model();
    let generation = |p: &VirtioPci| rd(p, 0x15, 1) as u8;
    assert_eq!(generation(&p), 0);
    // Before the driver is ready: no vector to signal, but the change
    // shows (generation, ISR).
    assert_eq!(p.config_changed(), None);
    assert_eq!(generation(&p), 1);
    assert_eq!(p.generation(), 1);
    assert_eq!(rd(&p, ISR_OFF, 1) as u8, ISR_CONFIG);
    assert_eq!(rd(&p, ISR_OFF, 1), 0, "reading the ISR clears it");
    // A driver with msix_config set, DRIVER_OK but no bus master: none.
    negotiate(&mut p, ring_features::VERSION_1);
    wr(&mut p, 0x10, 2, 2);
    assert_eq!(rd(&p, 0x10, 2), 2);
    assert_eq!(wr(&mut p, 0x14, 1, 0xf), vec![Effect::DriverOk]);
    assert_eq!(p.config_changed(), None);
    p.config_write(0x04, &[0x06]);
    assert_eq!(p.config_changed(), Some(2));
    assert_eq!(generation(&p), 3);
    // A 4-byte read over the ISR (through the PCI cfg window too) clears it.
    window(&mut p, 0, ISR_OFF as u32, 4);
    assert_eq!(cfg32(&p, 0xa0), u32::from(ISR_CONFIG));
    assert_eq!(rd(&p, ISR_OFF, 4), 0);
    // No vector (NO_VECTOR, or one past the table): nothing to signal.
    wr(&mut p, 0x10, 2, u64::from(NO_VECTOR));
    assert_eq!(p.config_changed(), None);
    wr(&mut p, 0x10, 2, 3);
    assert_eq!(rd(&p, 0x10, 2), u64::from(NO_VECTOR), "3 vectors: 0..=2");
    assert_eq!(p.config_changed(), None);
    // The generation wraps; a reset keeps it (it only ever moves on) and
    // clears the ISR.
    for _ in 0..300 {
        p.config_changed();
    }
    assert_eq!(generation(&p), ((5 + 300) % 256) as u8);
    wr(&mut p, 0x14, 1, 0);
    assert_eq!(rd(&p, ISR_OFF, 1), 0);
    assert_eq!(generation(&p), ((5 + 300) % 256) as u8);
    assert_eq!(p.config_changed(), None, "msix_config reset to NO_VECTOR");
}
