//! `vhostd net --transport vfio-user` on a TAP: the host's link changes
//! reach the driver as configuration change interrupts. The test is the
//! VMM and the driver at once (the protocol crate's `Client`): it sets
//! msix_config to a vector with an eventfd, then takes the TAP down and up
//! in vhostd's network namespace. Each change fires the vector within a
//! bound, moves config_generation on and sets the ISR's configuration bit;
//! the config's status follows. Another interface's changes fire nothing.
//!
//! Needs root (a network namespace): scripts/check's root_targets.
//! Every daemon is killed on drop; every wait is bounded.

mod common;

use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::bar0::{r, w};
use common::*;
use vhostd_vfio_user::{wire, Client};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const CONFIG: u32 = 7;
const MSIX: u32 = 2;
/// virtio-net's status field, in the device config (BAR0 0x2000).
const NET_STATUS: u64 = 0x2000 + 6;
const ISR: u64 = 0x1000;
const GENERATION: u64 = 0x15;
/// A net device with one queue pair has 3 queues: vectors 0..=3.
const CONFIG_VECTOR: u16 = 3;
/// How long a link change may take to reach the driver.
const BOUND_MS: i32 = 5000;
/// How long to wait for an interrupt that must not come.
const QUIET_MS: i32 = 700;

fn fired(e: &EventFd, ms: i32) -> bool {
    let mut p = libc::pollfd { fd: e.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut p, 1, ms) } == 1;
    if ready {
        let _ = e.read();
    }
    ready
}

/// vhostd in a fresh namespace serving a TAP-backed net device over
/// vfio-user, the TAP up.
fn start(tag: &str) -> (NetNs, String, Daemon) {
    let ns = NetNs::new();
    let tap = format!("vl{}{tag}", std::process::id() % 100000);
    let backend = format!("tap,ifname={tap}");
    let d = Daemon::start_with(Some(&ns), |sock| {
        ["net", "--transport", "vfio-user", "--backend", &backend, "--socket-path", &sock.display().to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect()
    });
    ns.ip(&["link", "set", &tap, "up"]);
    (ns, tap, d)
}

/// A client past VERSION, as a VMM.
fn client(d: &Daemon) -> Client {
    let s = UnixStream::connect(&d.sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut c = Client::new(s);
    let caps = wire::Capabilities { max_msg_fds: 8, max_data_xfer_size: 1 << 20, pgsizes: 4096, max_dma_maps: 64 };
    c.version(&caps).unwrap();
    c
}

/// The driver's set-up with `features` (low word; VERSION_1 added), bus
/// master on, msix_config = CONFIG_VECTOR with `irq` as its eventfd, up to
/// DRIVER_OK (no queue is needed for config interrupts).
fn driver_setup(c: &mut Client, irq: &EventFd, features: u32) {
    // SAFETY: the descriptor stays open while `irq` lives (this call).
    let fd = unsafe { BorrowedFd::borrow_raw(irq.as_raw_fd()) };
    let trig = wire::IRQ_SET_DATA_EVENTFD | wire::IRQ_SET_ACTION_TRIGGER;
    c.set_irqs(MSIX, trig, u32::from(CONFIG_VECTOR), 1, &[], &[fd]).unwrap();
    c.region_write(CONFIG, 4, &6u16.to_le_bytes()).unwrap(); // memory, bus master
    w(c, 0x14, 0, 1);
    w(c, 0x14, 3, 1); // ACKNOWLEDGE | DRIVER
    w(c, 0x08, 0, 4);
    w(c, 0x0c, u64::from(features), 4);
    w(c, 0x08, 1, 4);
    w(c, 0x0c, 1, 4); // VERSION_1
    w(c, 0x14, 0xb, 1);
    assert_eq!(r(c, 0x14, 1), 0xb, "FEATURES_OK accepted");
    w(c, 0x10, u64::from(CONFIG_VECTOR), 2);
    assert_eq!(r(c, 0x10, 2), u64::from(CONFIG_VECTOR), "msix_config taken");
    w(c, 0x14, 0xf, 1); // DRIVER_OK
}

/// VIRTIO_NET_F_STATUS.
const F_STATUS: u32 = 1 << 16;

#[test]
fn a_tap_going_down_and_up_fires_the_config_vector() {
    let (ns, tap, d) = start("a");
    let mut c = client(&d);
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    driver_setup(&mut c, &irq, F_STATUS);
    assert_eq!(r(&mut c, NET_STATUS, 2), 1, "the TAP is up");
    let g0 = r(&mut c, GENERATION, 1);
    assert!(!fired(&irq, QUIET_MS), "no change, no interrupt");

    // Another interface in the namespace comes and goes: nothing.
    let other = format!("vo{}a", std::process::id() % 100000);
    ns.ip(&["tuntap", "add", "mode", "tap", "name", &other]);
    ns.ip(&["link", "set", &other, "up"]);
    ns.ip(&["link", "set", &other, "down"]);
    ns.ip(&["link", "del", &other]);
    assert!(!fired(&irq, QUIET_MS), "another interface's changes fire nothing");
    assert_eq!(r(&mut c, GENERATION, 1), g0);
    assert_eq!(r(&mut c, ISR, 1), 0);

    ns.ip(&["link", "set", &tap, "down"]);
    assert!(fired(&irq, BOUND_MS), "link down: no config interrupt within {BOUND_MS} ms\n{}", d.log());
    let g1 = r(&mut c, GENERATION, 1);
    assert_ne!(g1, g0, "config_generation moved on");
    assert_eq!(r(&mut c, ISR, 1), 2, "the ISR's configuration bit");
    assert_eq!(r(&mut c, ISR, 1), 0, "cleared by the read");
    assert_eq!(r(&mut c, NET_STATUS, 2), 0, "status: link down");

    ns.ip(&["link", "set", &tap, "up"]);
    assert!(fired(&irq, BOUND_MS), "link up: no config interrupt within {BOUND_MS} ms\n{}", d.log());
    // Up may come as two events (IFF_UP, then the carrier): wait for the
    // status rather than for one more interrupt.
    assert!(wait_until(Duration::from_secs(5), || r(&mut c, NET_STATUS, 2) == 1), "status: link up");
    let _ = fired(&irq, QUIET_MS);
    assert_ne!(r(&mut c, GENERATION, 1), g1);
    assert!(!fired(&irq, QUIET_MS), "settled: no more interrupts");
}

#[test]
fn without_virtio_net_f_status_the_change_shows_but_fires_nothing() {
    let (ns, tap, d) = start("b");
    let mut c = client(&d);
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    driver_setup(&mut c, &irq, 0);
    let g0 = r(&mut c, GENERATION, 1);
    ns.ip(&["link", "set", &tap, "down"]);
    assert!(
        wait_until(Duration::from_secs(5), || r(&mut c, GENERATION, 1) != g0),
        "config_generation moves on anyway\n{}",
        d.log()
    );
    assert!(!fired(&irq, QUIET_MS), "a driver that does not read the status gets no interrupt");
}
