//! vhostd-user's vfio-user mode (`vhostd_user::vfio::VfioBlk`, the
//! frontend of `vhostd-user blk --transport vfio-user`) against `vhostd
//! blk --transport vfio-user` with a file: the virtio-pci init sequence,
//! DMA_MAP, MSI-X eventfds and doorbells, then the workload engine's verify
//! (pattern written, flushed, read back and compared) and the pattern
//! found in the file, in poll mode (doorbells stored into the mapped page,
//! the frontend polling) and interrupt mode (doorbells as REGION_WRITEs,
//! the frontend sleeping on the MSI-X eventfd), split and packed.
//!
//! Every daemon is killed on drop (failures included); every wait is
//! bounded (connect timeout, the workload's stall timeout).

mod common;

use std::time::Duration;

use common::*;
use vhostd_user::blk::workload::{self, check_pattern, Mode, Workload};
use vhostd_user::blk::{memory_needed, status, SECTOR};
use vhostd_user::features as f;
use vhostd_user::vfio::{VfioBlk, VfioOptions};

const SIZE: u64 = 8 << 20;
const AREA: u64 = 4 << 20;

fn verify_over_vfio(mode: &str, packed: bool) {
    let dir = tempdir();
    let img = dir.join("disk.img");
    // A background that is not the pattern, to see the area's bounds.
    std::fs::write(&img, vec![0x5a; SIZE as usize]).unwrap();
    let backend = format!("file,path={}", img.display());
    let d = Daemon::start_with(None, |sock| {
        ["blk", "--transport", "vfio-user", "--backend", &backend, "--mode", mode, "--socket-path"]
            .iter()
            .map(|s| s.to_string())
            .chain([sock.display().to_string()])
            .collect()
    });
    let mut opts = VfioOptions::blk();
    opts.mem_size = memory_needed(1, 32, 16 << 10);
    if packed {
        opts.features |= f::RING_PACKED;
    }
    let mut dev = VfioBlk::connect(&d.sock, &opts, Duration::from_secs(10)).unwrap();
    let poll = mode == "poll";
    assert_eq!(dev.doorbells_mapped(), poll, "the doorbell page is offered to map in poll mode only");
    assert_eq!(dev.features() & f::RING_PACKED != 0, packed);
    assert_ne!(dev.features() & f::BLK_FLUSH, 0);
    let cfg = dev.blk_config();
    assert_eq!((cfg.capacity, dev.num_queues()), (SIZE / SECTOR, 1));
    assert!(dev.blk_queue(1, 32, 16 << 10).is_err(), "a queue the device does not have");
    let mut q = dev.blk_queue(0, 32, 16 << 10).unwrap();
    dev.driver_ok().unwrap();

    let seed = 7 + packed as u64;
    let w = Workload { seed, size: Some(AREA), poll, ..Workload::new(Mode::Verify, 16 << 10) };
    let r = workload::run(std::slice::from_mut(&mut q), cfg.capacity, &w, None).unwrap();
    assert!(r.passed(), "{}: {:?} {:?}", r.summary(), r.first_error, r.mismatch);
    let n = AREA / (16 << 10);
    assert_eq!((r.verified_blocks, r.flush, r.ios, r.errors), (n, Some(status::OK), 2 * n + 1, 0), "{}", r.summary());
    // And at iodepth 1, where every request is a doorbell.
    let w1 = Workload { seed: seed + 10, count: Some(64), iodepth: 1, poll, ..Workload::new(Mode::Verify, 4096) };
    let r1 = workload::run(std::slice::from_mut(&mut q), cfg.capacity, &w1, None).unwrap();
    assert!(r1.passed() && r1.verified_blocks == 64, "{}", r1.summary());
    let kicks_sent = q.queue.kicks_sent;
    assert!(kicks_sent > 0);
    drop(q);
    dev.disconnect().unwrap();

    let data = std::fs::read(&img).unwrap();
    assert_eq!(check_pattern(&data[..64 * 4096], 0, seed + 10), None);
    assert_eq!(check_pattern(&data[64 * 4096..AREA as usize], 64 * 4096, seed), None);
    assert!(data[AREA as usize..].iter().all(|&b| b == 0x5a), "bytes past the area changed");

    let s = d.stop();
    assert_eq!(s.queue(0, "writes"), n + 64);
    assert_eq!(s.queue(0, "reads"), n + 64);
    assert_eq!(s.queue(0, "flushes"), 2);
    assert_eq!(s.queue(0, "bad_chains"), 0);
    if poll {
        // Doorbells land in the mapped page: no message, no kick.
        assert_eq!(s.queue(0, "kicks"), 0);
    } else {
        // Each REGION_WRITE doorbell becomes a kick of the ring.
        assert!(
            s.queue(0, "kicks") > 0 && s.queue(0, "kicks") <= kicks_sent,
            "kicks {} of {kicks_sent}",
            s.queue(0, "kicks")
        );
    }
}

#[test]
fn verify_in_poll_mode_through_the_mapped_doorbell() {
    verify_over_vfio("poll", false);
}

#[test]
fn verify_in_interrupt_mode_through_region_writes_and_msix() {
    verify_over_vfio("interrupt", false);
}

#[test]
fn verify_with_packed_rings_in_interrupt_mode() {
    verify_over_vfio("interrupt", true);
}
