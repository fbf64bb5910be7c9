//! `vhostd blk --transport vfio-user` driven by the protocol crate's
//! `Client` acting as the VMM and the guest's driver at once: the PCI
//! device it shows, a request through a split ring (doorbell in, MSI-X
//! eventfd out), what a hostile client gets back (exact errnos), DMA
//! unmaps under a running ring, reset, the next client, poll mode's mapped
//! doorbells, and the CLI's refusals; `vhostd scsi --transport vfio-user`:
//! its PCI identity, vectors and config, and hotplug events through the
//! event queue and its MSI-X vector.
//!
//! Every daemon is killed on drop (failures included); every wait is
//! bounded.

mod common;

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::time::Duration;

use common::bar0::{r, w};
use common::*;
use vhostd_vfio_user::{wire, Client, ClientError, Errno, SparseArea};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const BAR0: u32 = 0;
const CONFIG: u32 = 7;
const MSIX: u32 = 2;
const NOTIFY: u64 = 0x3000;
const MEM: u64 = 1 << 20;
/// Ring layout in the test's guest memory (guest physical addresses).
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
const HDR: u64 = 0x3000;
const DATA: u64 = 0x4000;
const STATUS: u64 = 0x5000;

fn start(extra: &[&str]) -> Daemon {
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    Daemon::start_with(None, move |sock| {
        let mut v: Vec<String> = [
            "blk",
            "--transport",
            "vfio-user",
            "--backend",
            "null,size=1M",
            "--serial",
            "vfio-serial",
            "--socket-path",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.push(sock.display().to_string());
        v.extend(extra);
        v
    })
}

fn client(d: &Daemon) -> Client {
    let s = UnixStream::connect(&d.sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut c = Client::new(s);
    let caps = wire::Capabilities { max_msg_fds: 8, max_data_xfer_size: 1 << 20, pgsizes: 4096, max_dma_maps: 64 };
    c.version(&caps).unwrap();
    c
}

fn errno<T: std::fmt::Debug>(r: Result<T, ClientError>) -> Errno {
    match r {
        Err(ClientError::Errno(e)) => e,
        other => panic!("expected an errno, got {other:?}"),
    }
}

/// Guest memory the test writes as the driver: a memfd, mapped here.
struct Memory {
    fd: OwnedFd,
    ptr: *mut u8,
}

impl Memory {
    fn new() -> Memory {
        // SAFETY: memfd_create with a static name; checked.
        let raw = unsafe { libc::memfd_create(c"vfio-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a new descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our memfd.
        assert_eq!(unsafe { libc::ftruncate(raw, MEM as i64) }, 0);
        // SAFETY: a fresh shared mapping of the memfd's MEM bytes, checked.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), MEM as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, raw, 0)
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        Memory { fd, ptr: ptr as *mut u8 }
    }

    fn write(&self, at: u64, data: &[u8]) {
        assert!(at + data.len() as u64 <= MEM);
        for (i, b) in data.iter().enumerate() {
            // SAFETY: inside the mapping (checked); volatile: vhostd reads it.
            unsafe { self.ptr.add(at as usize + i).write_volatile(*b) };
        }
    }

    fn read(&self, at: u64, len: usize) -> Vec<u8> {
        assert!(at + len as u64 <= MEM);
        // SAFETY: inside the mapping (checked); volatile: vhostd writes it.
        (0..len).map(|i| unsafe { self.ptr.add(at as usize + i).read_volatile() }).collect()
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, MEM as usize) };
    }
}

/// Maps all of `m` at IOVA 0, readable and writable (as QEMU maps RAM).
fn map_all(c: &mut Client, m: &Memory) {
    c.dma_map(0, MEM, 0, wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE, Some(m.fd.as_fd())).unwrap();
}

/// Makes `irq` MSI-X vector 0's eventfd.
fn set_vector0(c: &mut Client, irq: &EventFd) {
    c.set_irqs(MSIX, wire::IRQ_SET_DATA_EVENTFD | wire::IRQ_SET_ACTION_TRIGGER, 0, 1, &[], &[bfd(irq)]).unwrap();
}

/// PCI command register bits: memory space, bus master.
const CMD_MEMORY: u16 = 0x2;
const CMD_MASTER: u16 = 0x4;

/// Writes the PCI command register (as the guest's PCI core does:
/// pci_enable_device, pci_set_master, pci_disable_device).
fn command(c: &mut Client, v: u16) {
    c.region_write(CONFIG, 4, &v.to_le_bytes()).unwrap();
}

/// The driver's set-up of queue 0 (16 entries, vector 0) up to DRIVER_OK,
/// after memory space and bus master are enabled (as Linux's virtio_pci
/// probe does before the virtio driver runs).
fn driver_setup(c: &mut Client) {
    command(c, CMD_MEMORY | CMD_MASTER);
    driver_setup_until_enabled(c);
    w(c, 0x14, 0xf, 1); // DRIVER_OK
}

/// The driver's set-up of queue 0 up to queue_enable (no DRIVER_OK yet).
fn driver_setup_until_enabled(c: &mut Client) {
    w(c, 0x14, 0, 1); // reset
    w(c, 0x14, 3, 1); // ACKNOWLEDGE | DRIVER
    w(c, 0x08, 1, 4);
    w(c, 0x0c, 1, 4); // VERSION_1
    w(c, 0x14, 0xb, 1); // FEATURES_OK
    assert_eq!(r(c, 0x14, 1), 0xb, "FEATURES_OK accepted");
    w(c, 0x16, 0, 2);
    w(c, 0x18, 16, 2);
    w(c, 0x20, DESC, 8);
    w(c, 0x28, AVAIL, 8);
    w(c, 0x30, USED, 8);
    w(c, 0x1a, 0, 2);
    assert_eq!(r(c, 0x1a, 2), 0, "vector 0 taken");
    w(c, 0x1c, 1, 2);
}

/// Posts a GET_ID request as avail entry `n` (a chain of header, 20-byte
/// data, status), rings the doorbell and waits for the interrupt.
fn get_id(c: &mut Client, m: &Memory, irq: &EventFd, n: u16) -> (u16, Vec<u8>, u8) {
    post_get_id(m, n);
    w(c, NOTIFY, 0, 2);
    wait_used(m, irq, n + 1)
}

/// Posts a GET_ID request as avail entry `n` (no doorbell).
fn post_get_id(m: &Memory, n: u16) {
    post_request(m, n, 8, 0, 20); // VIRTIO_BLK_T_GET_ID
}

/// Posts a request of type `ty` at `sector` with `len` bytes of data the
/// device writes (GET_ID, a read) as avail entry `n` (no doorbell): a
/// chain of header, data, status.
fn post_request(m: &Memory, n: u16, ty: u32, sector: u64, len: u32) {
    let desc = |i: u64, addr: u64, len: u32, flags: u16, next: u16| {
        let mut d = Vec::new();
        d.extend_from_slice(&addr.to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        m.write(DESC + 16 * i, &d);
    };
    let mut hdr = ty.to_le_bytes().to_vec();
    hdr.extend_from_slice(&[0; 4]);
    hdr.extend_from_slice(&sector.to_le_bytes());
    m.write(HDR, &hdr);
    m.write(STATUS, &[0xff]);
    desc(0, HDR, 16, 1, 1);
    desc(1, DATA, len, 3, 2);
    desc(2, STATUS, 1, 2, 0);
    m.write(AVAIL + 4 + 2 * u64::from(n % 16), &0u16.to_le_bytes());
    m.write(AVAIL + 2, &(n + 1).to_le_bytes());
}

/// The used ring's index.
fn used_idx(m: &Memory) -> u16 {
    u16::from_le_bytes(m.read(USED + 2, 2).try_into().unwrap())
}

/// Waits (10 s at most) for the used index to reach `n`, taking the
/// interrupts that come meanwhile (the worker also signals once as the
/// ring starts); returns it with the GET_ID data and status.
fn wait_used(m: &Memory, irq: &EventFd, n: u16) -> (u16, Vec<u8>, u8) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while used_idx(m) != n {
        let left = deadline.saturating_duration_since(std::time::Instant::now()).as_millis() as i32;
        assert!(left > 0 && wait_readable(irq.as_raw_fd(), left), "no used entry with its MSI-X interrupt within 10 s");
        let _ = irq.read();
    }
    (used_idx(m), m.read(DATA, 20), m.read(STATUS, 1)[0])
}

/// Where the PCI cfg access capability (virtio type 5) is, found the way
/// a driver finds it: walking the capability list.
fn pci_cfg_cap(c: &mut Client) -> u64 {
    let mut space = [0u8; 256];
    c.region_read(CONFIG, 0, &mut space).unwrap();
    let mut at = space[0x34] as usize;
    for _ in 0..48 {
        assert!((0x40..=252).contains(&at), "no PCI cfg access capability");
        if space[at] == 0x09 && space[at + 3] == 5 {
            assert_eq!(space[at + 2], 20, "cap_len: the cap and pci_cfg_data");
            return at as u64;
        }
        at = space[at + 1] as usize;
    }
    panic!("the capability list loops");
}

/// Writes `v` (`len` bytes) at `off` of BAR0 through the PCI cfg access
/// window at `cap`: cap.bar, cap.offset, cap.length, then pci_cfg_data.
fn w_cfg(c: &mut Client, cap: u64, off: u64, v: u64, len: usize) {
    c.region_write(CONFIG, cap + 4, &[0]).unwrap();
    c.region_write(CONFIG, cap + 8, &(off as u32).to_le_bytes()).unwrap();
    c.region_write(CONFIG, cap + 12, &(len as u32).to_le_bytes()).unwrap();
    c.region_write(CONFIG, cap + 16, &v.to_le_bytes()[..len]).unwrap();
}

/// Reads `len` bytes at `off` of BAR0 through the window at `cap`.
fn r_cfg(c: &mut Client, cap: u64, off: u64, len: usize) -> u64 {
    c.region_write(CONFIG, cap + 4, &[0]).unwrap();
    c.region_write(CONFIG, cap + 8, &(off as u32).to_le_bytes()).unwrap();
    c.region_write(CONFIG, cap + 12, &(len as u32).to_le_bytes()).unwrap();
    let mut b = [0u8; 8];
    c.region_read(CONFIG, cap + 16, &mut b[..len]).unwrap();
    u64::from_le_bytes(b)
}

/// The eventfd's descriptor, borrowed for as long as it lives.
fn bfd(e: &EventFd) -> BorrowedFd<'_> {
    // SAFETY: the descriptor stays open while `e` lives, and the borrow
    // cannot outlive `e`.
    unsafe { BorrowedFd::borrow_raw(e.as_raw_fd()) }
}

fn wait_readable(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, ms) == 1 }
}

#[test]
fn shows_a_virtio_blk_pci_device_with_msix() {
    let d = start(&[]);
    let mut c = client(&d);
    let info = c.device_info().unwrap();
    assert_eq!((info.flags, info.num_regions, info.num_irqs), (wire::DEVICE_FLAG_RESET | wire::DEVICE_FLAG_PCI, 9, 5));
    let mut id = [0u8; 4];
    c.region_read(CONFIG, 0, &mut id).unwrap();
    assert_eq!(u32::from_le_bytes(id), 0x1042_1af4);
    let bar0 = c.region_info(BAR0).unwrap();
    assert_eq!((bar0.size, bar0.flags & wire::REGION_FLAG_MMAP, bar0.fd.is_none()), (0x4000, 0, true));
    assert_eq!(c.irq_info(MSIX).unwrap().count, 2, "one vector for the queue, one for config");
    // The device config is blk's: capacity 1 MiB in sectors.
    assert_eq!(r(&mut c, 0x2000, 8), 2048);
}

#[test]
fn a_request_goes_through_doorbell_and_msix_vector() {
    let d = start(&["--mode", "interrupt"]);
    let mut c = client(&d);
    let m = Memory::new();
    map_all(&mut c, &m);
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    set_vector0(&mut c, &irq);
    driver_setup(&mut c);
    let (used, serial, status) = get_id(&mut c, &m, &irq, 0);
    assert_eq!((used, status), (1, 0));
    assert_eq!(&serial[..11], b"vfio-serial");

    // The client moves vector 0 to another eventfd under the running
    // ring: the next completion interrupts through that one.
    let irq2 = EventFd::new(EFD_NONBLOCK).unwrap();
    set_vector0(&mut c, &irq2);
    let (used, _, status) = get_id(&mut c, &m, &irq2, 1);
    assert_eq!((used, status), (2, 0));
    // And back (the rest of the test waits on `irq`).
    set_vector0(&mut c, &irq);

    // Unmapping the ring's memory succeeds (as under an IOMMU): the ring
    // stops, keeps its place, and resumes when the memory is back.
    c.dma_unmap(0, MEM, 0).unwrap();
    map_all(&mut c, &m);
    let (used, _, status) = get_id(&mut c, &m, &irq, 2);
    assert_eq!((used, status), (3, 0), "the ring resumed where it stopped");

    // Status 0 resets: the queue is disabled, the status reads 0.
    w(&mut c, 0x14, 0, 1);
    assert_eq!(r(&mut c, 0x14, 1), 0);
    assert_eq!(r(&mut c, 0x1c, 2), 0);

    // The next client gets a fresh device on the same daemon.
    drop(c);
    let mut c = client(&d);
    assert_eq!(r(&mut c, 0x14, 1), 0);
    assert_eq!(c.dma_unmap(0, MEM, 0).map_err(|e| e.to_string()), Err(errno_text(Errno::ENOENT)), "maps dropped");
    let stats = d.stop();
    assert_eq!(stats.queue(0, "get_ids"), 3);
}

#[test]
fn the_pci_cfg_access_window_drives_the_device_like_bar0() {
    let d = start(&["--mode", "interrupt"]);
    let mut c = client(&d);
    let m = Memory::new();
    map_all(&mut c, &m);
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    set_vector0(&mut c, &irq);
    let cap = pci_cfg_cap(&mut c);
    // Reads: num_queues, the device config (capacity 1 MiB in sectors).
    assert_eq!(r_cfg(&mut c, cap, 0x12, 2), 1);
    assert_eq!(r_cfg(&mut c, cap, 0x2000, 4), 2048);
    driver_setup(&mut c);
    // Status 0 through the window resets the device (the queue goes).
    w_cfg(&mut c, cap, 0x14, 0, 1);
    assert_eq!(r(&mut c, 0x14, 1), 0);
    assert_eq!(r(&mut c, 0x1c, 2), 0);
    // Set up again, DRIVER_OK through the window: the ring starts.
    driver_setup_until_enabled(&mut c);
    w_cfg(&mut c, cap, 0x14, 0xf, 1);
    assert_eq!(r(&mut c, 0x14, 1), 0xf);
    // A request whose doorbell goes through the window (2 bytes, as
    // SeaBIOS writes it).
    post_get_id(&m, 0);
    w_cfg(&mut c, cap, NOTIFY, 0, 2);
    let (used, serial, status) = wait_used(&m, &irq, 1);
    assert_eq!((used, status), (1, 0));
    assert_eq!(&serial[..11], b"vfio-serial");
    drop(c);
    let stats = d.stop();
    assert_eq!(stats.queue(0, "get_ids"), 1);
}

/// Whether the used index stays `n` for 200 ms (a device that must not
/// touch guest memory).
fn used_stays(m: &Memory, n: u16) -> bool {
    let until = std::time::Instant::now() + Duration::from_millis(200);
    while std::time::Instant::now() < until {
        if used_idx(m) != n {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

#[test]
fn rings_run_only_while_bus_master_is_enabled() {
    let d = start(&["--mode", "interrupt"]);
    let mut c = client(&d);
    let m = Memory::new();
    map_all(&mut c, &m);
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    set_vector0(&mut c, &irq);
    // The driver sets the device up to DRIVER_OK with memory space on but
    // bus master off: the ring waits, a request stays untouched.
    command(&mut c, CMD_MEMORY);
    driver_setup_until_enabled(&mut c);
    w(&mut c, 0x14, 0xf, 1);
    assert_eq!(r(&mut c, 0x14, 1), 0xf);
    post_get_id(&m, 0);
    w(&mut c, NOTIFY, 0, 2);
    assert!(used_stays(&m, 0), "a request was served before bus master was enabled");
    // Bus master on: the ring the driver set up before starts, and serves
    // the request (its doorbell was not lost).
    command(&mut c, CMD_MEMORY | CMD_MASTER);
    let (used, serial, status) = wait_used(&m, &irq, 1);
    assert_eq!((used, status), (1, 0));
    assert_eq!(&serial[..11], b"vfio-serial");
    // Off again (QEMU's reset, Linux's pci_disable_device): the ring stops.
    command(&mut c, CMD_MEMORY);
    post_get_id(&m, 1);
    w(&mut c, NOTIFY, 0, 2);
    assert!(used_stays(&m, 1), "a request was served with bus master disabled");
    // On: it resumes where it stopped.
    command(&mut c, CMD_MEMORY | CMD_MASTER);
    let (used, _, status) = wait_used(&m, &irq, 2);
    assert_eq!((used, status), (2, 0));
    let (used, _, status) = get_id(&mut c, &m, &irq, 2);
    assert_eq!((used, status), (3, 0));
    drop(c);
    let stats = d.stop();
    assert_eq!(stats.queue(0, "get_ids"), 3);
}

/// The whole PCI config space.
fn config_space(c: &mut Client) -> [u8; 256] {
    let mut b = [0u8; 256];
    c.region_read(CONFIG, 0, &mut b).unwrap();
    b
}

/// The offset of the first capability with id `id` (0x11: MSI-X).
fn find_cap(space: &[u8; 256], id: u8) -> usize {
    let mut at = space[0x34] as usize;
    while at != 0 {
        if space[at] == id {
            return at;
        }
        at = space[at + 1] as usize;
    }
    panic!("no capability {id:#x}");
}

#[test]
fn device_reset_puts_config_space_back_to_power_on() {
    let d = start(&["--mode", "interrupt"]);
    let mut c = client(&d);
    let power_on = config_space(&mut c);
    let m = Memory::new();
    map_all(&mut c, &m);
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    set_vector0(&mut c, &irq);
    // The previous owner: BARs placed, interrupt line, MSI-X enabled, the
    // PCI cfg access window set, bus master on, a request served.
    c.region_write(CONFIG, 0x10, &0xfebf_0000u32.to_le_bytes()).unwrap();
    c.region_write(CONFIG, 0x14, &0xfebf_4000u32.to_le_bytes()).unwrap();
    c.region_write(CONFIG, 0x3c, &[11]).unwrap();
    let msix = find_cap(&power_on, 0x11);
    c.region_write(CONFIG, msix as u64 + 3, &[0x80]).unwrap();
    let cap = pci_cfg_cap(&mut c);
    assert_eq!(r_cfg(&mut c, cap, 0x12, 2), 1);
    driver_setup(&mut c);
    assert_eq!(get_id(&mut c, &m, &irq, 0).2, 0);
    let programmed = config_space(&mut c);
    assert_ne!(programmed, power_on);
    // A virtio reset (status 0) keeps the config space.
    w(&mut c, 0x14, 0, 1);
    assert_eq!(config_space(&mut c), programmed, "status 0 changed the PCI config space");
    // DEVICE_RESET (a function-level reset) of a running device (its
    // rings fresh): as at power-on.
    m.write(0, &vec![0; STATUS as usize]);
    driver_setup(&mut c);
    c.reset().unwrap();
    assert_eq!(config_space(&mut c), power_on, "DEVICE_RESET left the PCI config space as programmed");
    assert_eq!((r(&mut c, 0x14, 1), r(&mut c, 0x1c, 2)), (0, 0));
    // The next owner (a rebooted guest) sets it up afresh and is served.
    m.write(0, &vec![0; STATUS as usize]);
    driver_setup(&mut c);
    let (used, _, status) = get_id(&mut c, &m, &irq, 0);
    assert_eq!((used, status), (1, 0));
    drop(c);
    let stats = d.stop();
    assert_eq!(stats.queue(0, "get_ids"), 2);
}

/// Moving a running ring's MSI-X vector to another eventfd does not stop
/// the ring: with a read in flight on a disk that hangs, SET_IRQS is
/// answered at once (a stop would wait for the read, on the thread that
/// serves every connection), and the read's completion interrupts through
/// the new eventfd once the disk answers.
#[test]
fn a_new_msix_eventfd_reaches_a_running_ring_without_stopping_it() {
    if !needs_root("a FUSE disk that hangs") {
        return;
    }
    let dir = tempdir();
    let disk = HangingDisk::mount(&dir, 1 << 20);
    let backend = format!("file,path={}", disk.disk().display());
    let d = Daemon::start_with(None, |sock| {
        ["blk", "--transport", "vfio-user", "--mode", "interrupt", "--backend", &backend, "--socket-path"]
            .iter()
            .map(|s| s.to_string())
            .chain([sock.display().to_string()])
            .collect()
    });
    let mut c = client(&d);
    let m = Memory::new();
    map_all(&mut c, &m);
    let old = EventFd::new(EFD_NONBLOCK).unwrap();
    let trig = wire::IRQ_SET_DATA_EVENTFD | wire::IRQ_SET_ACTION_TRIGGER;
    c.set_irqs(MSIX, trig, 0, 1, &[], &[bfd(&old)]).unwrap();
    driver_setup(&mut c);
    // A read (VIRTIO_BLK_T_IN) of 4 KiB the disk holds.
    let held = disk.hold();
    post_request(&m, 0, 0, 8, 4096);
    w(&mut c, NOTIFY, 0, 2);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(used_idx(&m), 0, "the held read completed");
    let new = EventFd::new(EFD_NONBLOCK).unwrap();
    c.stream().set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let t = std::time::Instant::now();
    let r = c.set_irqs(MSIX, trig, 0, 1, &[], &[bfd(&new)]);
    assert!(r.is_ok(), "SET_IRQS not answered while a read is in flight: {r:?}");
    assert!(t.elapsed() < Duration::from_secs(1), "SET_IRQS took {:?}", t.elapsed());
    assert_eq!(used_idx(&m), 0, "the held read completed");
    let _ = (old.read(), new.read());
    held.release();
    let (used, _, status) = wait_used(&m, &new, 1);
    assert_eq!((used, status), (1, 0));
    assert!(!wait_readable(old.as_raw_fd(), 0), "the replaced eventfd was signalled");
    drop(c);
    let stats = d.stop();
    assert_eq!(stats.queue(0, "reads"), 1);
}

fn errno_text(e: Errno) -> String {
    ClientError::Errno(e).to_string()
}

#[test]
fn a_hostile_client_gets_exact_errors_and_the_connection_lives_on() {
    let d = start(&[]);
    let mut c = client(&d);
    let m = Memory::new();
    let rw = wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE;
    // Region accesses out of range, and regions that do not exist.
    assert_eq!(errno(c.region_read(CONFIG, 252, &mut [0; 8])), Errno::EINVAL);
    assert_eq!(errno(c.region_read(BAR0, 0x3ffc, &mut [0; 8])), Errno::EINVAL);
    assert_eq!(errno(c.region_write(BAR0, u64::MAX - 2, &[0; 4])), Errno::EINVAL);
    assert_eq!(errno(c.region_read(9, 0, &mut [0; 4])), Errno::EINVAL);
    assert_eq!(errno(c.region_read(3, 0, &mut [0; 4])), Errno::EINVAL, "an absent BAR has size 0");
    // Bad interrupt indexes and ranges.
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    let trig = wire::IRQ_SET_DATA_EVENTFD | wire::IRQ_SET_ACTION_TRIGGER;
    assert_eq!(errno(c.set_irqs(5, trig, 0, 1, &[], &[bfd(&irq)])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(MSIX, trig, 2, 1, &[], &[bfd(&irq)])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(0, trig, 0, 1, &[], &[bfd(&irq)])), Errno::EINVAL, "no INTx");
    let mask = wire::IRQ_SET_DATA_NONE | wire::IRQ_SET_ACTION_MASK;
    assert_eq!(errno(c.set_irqs(MSIX, mask, 0, 1, &[], &[])), Errno::EINVAL, "MSI-X is not maskable here");
    // A trigger that is not an eventfd (a pipe nobody reads would block
    // the thread that signals it): refused, with nothing taken.
    let (pipe_r, pipe_w) = std::io::pipe().unwrap();
    let pipe_fd = pipe_w.as_fd();
    assert_eq!(errno(c.set_irqs(MSIX, trig, 0, 2, &[], &[bfd(&irq), pipe_fd])), Errno::EINVAL, "a pipe as MSI-X");
    drop((pipe_r, pipe_w));
    // A blocking eventfd is taken and made non-blocking.
    let blocking = EventFd::new(0).unwrap();
    // SAFETY: F_GETFL on our own descriptor.
    let nonblock = |e: &EventFd| unsafe { libc::fcntl(e.as_raw_fd(), libc::F_GETFL) } & libc::O_NONBLOCK != 0;
    assert!(!nonblock(&blocking));
    c.set_irqs(MSIX, trig, 0, 1, &[], &[bfd(&blocking)]).unwrap();
    assert!(nonblock(&blocking), "vhostd makes an MSI-X eventfd non-blocking");
    // Overlapping DMA maps, and unmaps that match nothing.
    c.dma_map(0x10_0000, MEM, 0, rw, Some(m.fd.as_fd())).unwrap();
    assert_eq!(errno(c.dma_map(0x18_0000, MEM, 0, rw, Some(m.fd.as_fd()))), Errno::EEXIST);
    assert_eq!(errno(c.dma_map(0x0f_f000, 0x2000, 0, rw, Some(m.fd.as_fd()))), Errno::EEXIST);
    assert_eq!(errno(c.dma_unmap(0x10_0000, 0x1000, 0)), Errno::ENOENT);
    // A map without a descriptor (a ROM) is taken; never a DMA target.
    c.dma_map(0x30_0000, 0x1000, 0, wire::DMA_MAP_FLAG_READ, None).unwrap();
    // A queue enabled before FEATURES_OK stays disabled.
    w(&mut c, 0x1c, 1, 2);
    assert_eq!(r(&mut c, 0x1c, 2), 0);
    // Features not offered: FEATURES_OK does not stick.
    w(&mut c, 0x08, 0, 4);
    w(&mut c, 0x0c, 1 << 5, 4);
    w(&mut c, 0x14, 0xb, 1);
    assert_eq!(r(&mut c, 0x14, 1), 0x3);
    // Still served.
    c.dma_unmap(0, 0, wire::DMA_UNMAP_FLAG_ALL).unwrap();
    c.reset().unwrap();
    assert_eq!(c.device_info().unwrap().num_regions, 9);
}

#[test]
fn poll_mode_offers_the_doorbell_page_to_map() {
    let d = start(&["--mode", "poll"]);
    let mut c = client(&d);
    let bar0 = c.region_info(BAR0).unwrap();
    assert_ne!(bar0.flags & wire::REGION_FLAG_MMAP, 0);
    assert_eq!(bar0.sparse, vec![SparseArea { offset: NOTIFY, size: 0x1000 }]);
    assert!(bar0.fd.is_some());
}

#[test]
fn vfio_user_with_client_is_refused() {
    let dir = tempdir();
    let sock = dir.join("s.sock");
    let run = |args: &[&str]| {
        let out = vhostd_in(None).args(args).stdin(Stdio::null()).output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let s = sock.display().to_string();
    for args in [
        &["blk", "--transport", "vfio-user", "--client", "--socket-path", &s, "--backend", "null,size=1M"][..],
        &["scsi", "--transport", "vfio-user", "--client", "--socket-path", &s, "--lun", "0=null,size=1M"][..],
    ] {
        let (code, err) = run(args);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("--client"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `vhostd scsi --transport vfio-user --queues 2` with a control socket.
fn start_scsi(ctl: &std::path::Path) -> Daemon {
    let ctl = ctl.display().to_string();
    Daemon::start_with(None, move |sock| {
        let mut v: Vec<String> =
            ["scsi", "--transport", "vfio-user", "--queues", "2", "--lun", "0=null,size=1M", "--control", &ctl]
                .iter()
                .map(|s| s.to_string())
                .collect();
        v.push("--socket-path".into());
        v.push(sock.display().to_string());
        v
    })
}

fn ctl(ctl: &std::path::Path, args: &[&str]) {
    let out = vhostd_in(None).args(["ctl", "--control", ctl.to_str().unwrap()]).args(args).output().unwrap();
    assert!(out.status.success(), "vhostd ctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn shows_a_virtio_scsi_pci_device_with_a_vector_per_queue() {
    let dir = tempdir();
    let d = start_scsi(&dir.join("ctl"));
    let mut c = client(&d);
    let mut b = [0u8; 4];
    c.region_read(CONFIG, 0, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b), 0x1048_1af4, "virtio 1.0 device 0x1040 + 8 (scsi)");
    c.region_read(CONFIG, 8, &mut b).unwrap();
    assert_eq!(u32::from_le_bytes(b), 0x0100_0001, "class mass storage / SCSI (as QEMU's virtio-scsi-pci), revision 1");
    // Control, event, 2 request queues, and config.
    assert_eq!(c.irq_info(MSIX).unwrap().count, 5);
    assert_eq!(r(&mut c, 0x12, 2), 4, "num_queues in the common config");
    // The device config is scsi's: num_queues, event_info_size, sense and
    // CDB sizes, max_lun.
    assert_eq!(r(&mut c, 0x2000, 4), 2);
    assert_eq!(r(&mut c, 0x2000 + 16, 4), 16);
    assert_eq!(r(&mut c, 0x2000 + 20, 4), 96);
    assert_eq!(r(&mut c, 0x2000 + 24, 4), 32);
    drop(c);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn scsi_hotplug_events_reach_the_event_queue_and_its_vector() {
    const HOTPLUG: u64 = 1 << 1;
    let dir = tempdir();
    let sock_ctl = dir.join("ctl");
    let d = start_scsi(&sock_ctl);
    let mut c = client(&d);
    let m = Memory::new();
    map_all(&mut c, &m);
    // Vector 1 is the event queue's.
    let none = EventFd::new(EFD_NONBLOCK).unwrap();
    let irq = EventFd::new(EFD_NONBLOCK).unwrap();
    c.set_irqs(MSIX, wire::IRQ_SET_DATA_EVENTFD | wire::IRQ_SET_ACTION_TRIGGER, 0, 2, &[], &[bfd(&none), bfd(&irq)])
        .unwrap();
    command(&mut c, CMD_MEMORY | CMD_MASTER);
    w(&mut c, 0x14, 0, 1);
    w(&mut c, 0x14, 3, 1);
    w(&mut c, 0x08, 0, 4);
    w(&mut c, 0x0c, HOTPLUG, 4);
    w(&mut c, 0x08, 1, 4);
    w(&mut c, 0x0c, 1, 4); // VERSION_1
    w(&mut c, 0x14, 0xb, 1);
    assert_eq!(r(&mut c, 0x14, 1), 0xb, "FEATURES_OK accepted");
    // The event queue (1): 16 entries, two 16-byte event buffers posted.
    w(&mut c, 0x16, 1, 2);
    w(&mut c, 0x18, 16, 2);
    w(&mut c, 0x20, DESC, 8);
    w(&mut c, 0x28, AVAIL, 8);
    w(&mut c, 0x30, USED, 8);
    w(&mut c, 0x1a, 1, 2);
    w(&mut c, 0x1c, 1, 2);
    for i in 0..2u64 {
        let mut desc = Vec::new();
        desc.extend_from_slice(&(DATA + 16 * i).to_le_bytes());
        desc.extend_from_slice(&16u32.to_le_bytes());
        desc.extend_from_slice(&2u16.to_le_bytes()); // WRITE
        desc.extend_from_slice(&0u16.to_le_bytes());
        m.write(DESC + 16 * i, &desc);
        m.write(AVAIL + 4 + 2 * i, &(i as u16).to_le_bytes());
    }
    m.write(AVAIL + 2, &2u16.to_le_bytes());
    w(&mut c, 0x14, 0xf, 1); // DRIVER_OK

    let used_idx = || u16::from_le_bytes(m.read(USED + 2, 2).try_into().unwrap());
    let wait_used = |n: u16| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while used_idx() != n {
            let left = deadline.saturating_duration_since(std::time::Instant::now()).as_millis() as i32;
            assert!(left > 0 && wait_readable(irq.as_raw_fd(), left), "no event with its MSI-X interrupt within 10 s");
            let _ = irq.read();
        }
    };
    // event TRANSPORT_RESET (1), LUN 3 of target 0, reason RESCAN (1),
    // then REMOVED (2).
    let event = |reason: u32| {
        let mut e = 1u32.to_le_bytes().to_vec();
        e.extend_from_slice(&[1, 0, 0, 3, 0, 0, 0, 0]);
        e.extend_from_slice(&reason.to_le_bytes());
        e
    };
    ctl(&sock_ctl, &["add-lun", "scsi0", "3=null,size=1M"]);
    wait_used(1);
    assert_eq!(m.read(DATA, 16), event(1));
    assert_eq!(m.read(USED + 4, 8), [0, 0, 0, 0, 16, 0, 0, 0], "buffer 0 used, 16 bytes");
    ctl(&sock_ctl, &["remove-lun", "scsi0", "3"]);
    wait_used(2);
    assert_eq!(m.read(DATA + 16, 16), event(2));
    drop(c);
    let stats = d.stop();
    assert_eq!(stats.queue(1, "events"), 2);
    let _ = std::fs::remove_dir_all(&dir);
}
