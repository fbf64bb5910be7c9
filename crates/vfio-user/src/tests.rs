//! Server and client over socketpairs, with a small fake device: every
//! message round-trips, and hostile requests get exact outcomes.
//!
//! Every test here holds `LOCK`, so descriptor counts of /proc/self/fd are
//! not disturbed by another test opening or closing descriptors meanwhile.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::thread::JoinHandle;

use crate::wire::{self, cmd, Header, HEADER_SIZE};
use crate::*;

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn memfd(size: u64) -> OwnedFd {
    // SAFETY: a valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vfio-user-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: memfd_create returned a new descriptor that nothing owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fd is a valid memfd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) }, 0);
    fd
}

fn eventfd() -> OwnedFd {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: eventfd returned a new descriptor that nothing owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// A pipe: (read end, non-blocking; write end).
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut p = [0; 2];
    // SAFETY: p has room for the two descriptors; the result is checked.
    assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, 0);
    // SAFETY: pipe2 returned two new descriptors that nothing owns.
    unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) }
}

/// Whether every copy of the pipe's write end is closed (a read gives EOF
/// rather than EAGAIN).
fn writers_gone(r: &OwnedFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: reads into a 1-byte buffer from a valid descriptor.
    let n = unsafe { libc::read(r.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
    n == 0
}

fn inode(fd: BorrowedFd<'_>) -> u64 {
    // SAFETY: all-zero is a valid stat; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor and a stat to fill.
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
    st.st_ino
}

const SPARSE: [SparseArea; 1] = [SparseArea { offset: 0x1000, size: 0x1000 }];

#[derive(Debug, PartialEq, Eq)]
struct SetRecord {
    index: u32,
    start: u32,
    count: u32,
    action: IrqAction,
    kind: &'static str,
    bools: Vec<u8>,
    nfds: usize,
}

/// Regions: 0 BAR-like (RW, mmap, one sparse area, a memfd), 1 RW not
/// mappable, 2 read-only, 3 empty. IRQs: 0 INTx-like (1, maskable), 1
/// MSI-X-like (4, not maskable).
struct Fake {
    bar: OwnedFd,
    data: Vec<Vec<u8>>,
    maps: Vec<(u64, u64, u64, bool, bool, Option<OwnedFd>)>,
    sets: Vec<SetRecord>,
    irq_fds: Vec<OwnedFd>,
    resets: u32,
    busy_iova: Option<u64>,
}

impl Fake {
    fn new() -> Fake {
        Fake {
            bar: memfd(0x4000),
            data: vec![vec![0; 0x4000], vec![0; 0x100], (0..16).collect(), vec![]],
            maps: Vec::new(),
            sets: Vec::new(),
            irq_fds: Vec::new(),
            resets: 0,
            busy_iova: None,
        }
    }
}

impl VfioDevice for Fake {
    fn info(&self) -> DeviceInfo {
        DeviceInfo { flags: wire::DEVICE_FLAG_PCI | wire::DEVICE_FLAG_RESET, num_regions: 4, num_irqs: 2 }
    }

    fn region_info(&self, index: u32) -> Option<RegionInfo<'_>> {
        let rw = wire::REGION_FLAG_READ | wire::REGION_FLAG_WRITE;
        Some(match index {
            0 => RegionInfo {
                flags: rw | wire::REGION_FLAG_MMAP,
                size: 0x4000,
                mmap_offset: 0,
                sparse: &SPARSE,
                fd: Some(self.bar.as_fd()),
            },
            1 => RegionInfo { flags: rw, size: 0x100, ..Default::default() },
            2 => RegionInfo { flags: wire::REGION_FLAG_READ, size: 16, ..Default::default() },
            3 => RegionInfo::default(),
            _ => return None,
        })
    }

    fn irq_info(&self, index: u32) -> Option<IrqInfo> {
        match index {
            0 => Some(IrqInfo { flags: wire::IRQ_INFO_EVENTFD | wire::IRQ_INFO_MASKABLE, count: 1 }),
            1 => Some(IrqInfo { flags: wire::IRQ_INFO_EVENTFD | wire::IRQ_INFO_NORESIZE, count: 4 }),
            _ => None,
        }
    }

    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> Result<(), Errno> {
        let o = offset as usize;
        data.copy_from_slice(&self.data[index as usize][o..o + data.len()]);
        Ok(())
    }

    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let o = offset as usize;
        self.data[index as usize][o..o + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn set_irqs(&mut self, set: IrqSet<'_>) -> Result<(), Errno> {
        let (kind, bools, nfds) = match set.data {
            IrqData::None => ("none", vec![], 0),
            IrqData::Bool(b) => ("bool", b.to_vec(), 0),
            IrqData::Eventfds(fds) => {
                let n = fds.len();
                self.irq_fds.extend(fds);
                ("eventfd", vec![], n)
            }
        };
        self.sets.push(SetRecord {
            index: set.index,
            start: set.start,
            count: set.count,
            action: set.action,
            kind,
            bools,
            nfds,
        });
        Ok(())
    }

    fn dma_map(&mut self, m: DmaMap) -> Result<(), Errno> {
        self.maps.push((m.iova, m.size, m.offset, m.read, m.write, m.fd));
        Ok(())
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) -> Result<(), Errno> {
        if self.busy_iova == Some(iova) {
            return Err(Errno::EBUSY);
        }
        let i = self.maps.iter().position(|m| m.0 == iova && m.1 == size).expect("server unmaps only what it mapped");
        self.maps.remove(i);
        Ok(())
    }

    fn reset(&mut self) -> Result<(), Errno> {
        self.resets += 1;
        Ok(())
    }
}

/// What the server thread returns when its connection ends.
struct Ended {
    dev: Fake,
    events: Vec<Event>,
    error: Error,
    dma_maps: Vec<(u64, u64)>,
}

fn spawn_with(dev: Fake, config: ServerConfig) -> (Client, JoinHandle<Ended>) {
    let (a, b) = UnixStream::pair().unwrap();
    let mut server = Server::new(a, config).unwrap();
    let h = std::thread::spawn(move || {
        let mut dev = dev;
        let mut events = Vec::new();
        loop {
            match server.handle(&mut dev) {
                Ok(Event::Idle) => panic!("a blocking server returned Idle"),
                Ok(e) => events.push(e),
                Err(error) => return Ended { dev, events, error, dma_maps: server.dma_maps().collect() },
            }
        }
    });
    (Client::new(b), h)
}

fn spawn() -> (Client, JoinHandle<Ended>) {
    spawn_with(Fake::new(), ServerConfig::default())
}

/// QEMU 11.1's proposal.
fn qemu_caps() -> wire::Capabilities {
    wire::Capabilities { max_msg_fds: 16, max_data_xfer_size: 1 << 20, pgsizes: 4096, max_dma_maps: 65535 }
}

fn connected() -> (Client, JoinHandle<Ended>) {
    let (mut c, h) = spawn();
    c.version(&qemu_caps()).unwrap();
    (c, h)
}

fn finish(c: Client, h: JoinHandle<Ended>) -> Ended {
    drop(c);
    let e = h.join().unwrap();
    assert!(matches!(e.error, Error::PeerClosed), "{}", e.error);
    e
}

#[track_caller]
fn errno<T: std::fmt::Debug>(r: Result<T, ClientError>) -> Errno {
    match r {
        Err(ClientError::Errno(e)) => e,
        other => panic!("expected an errno reply, got {other:?}"),
    }
}

/// The connection was closed by the server: its thread ended with an error
/// matching `check`, and the client sees EOF.
#[track_caller]
fn closed_by_server(mut c: Client, h: JoinHandle<Ended>, check: impl Fn(&Error) -> bool) {
    let e = h.join().unwrap();
    assert!(check(&e.error), "unexpected end: {:?}", e.error);
    assert!(matches!(c.recv(), Err(ClientError::Io(_))));
}

fn raw_msg(command: u16, flags: u32, size: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = Header { id: 77, command, size, flags, error: 0 }.encode().to_vec();
    m.extend_from_slice(payload);
    m
}

#[test]
fn version_exchange() {
    let _g = lock();
    let (mut c, h) = spawn();
    let (minor, caps) = c.version(&qemu_caps()).unwrap();
    assert_eq!(minor, 0);
    let d = ServerConfig::default();
    assert_eq!(
        caps,
        wire::Capabilities {
            max_msg_fds: d.max_msg_fds,
            max_data_xfer_size: d.max_data_xfer_size,
            pgsizes: 4096,
            max_dma_maps: d.max_dma_maps,
        }
    );
    let e = finish(c, h);
    assert_eq!(e.events.len(), 1);
}

#[test]
fn version_reply_as_qemu_reads_it() {
    let _g = lock();
    let (mut c, h) = spawn();
    // QEMU proposes minor 0 with its JSON; a larger minor must come back
    // as ours (0).
    let json = b"{\"capabilities\":{\"migration\":{\"pgsize\":4096,\"max_bitmap_size\":268435456},\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,\"max_dma_maps\":65535,\"write_multiple\":true}}\0";
    let mut p = vec![0, 0, 3, 0];
    p.extend_from_slice(json);
    let m = c.call(cmd::VERSION, &p, &[]).unwrap();
    // QEMU reads the reply into a buffer the size of its request.
    assert!(m.header.size as usize <= HEADER_SIZE + p.len());
    assert_eq!(&m.payload[..4], &[0, 0, 0, 0]);
    assert_eq!(*m.payload.last().unwrap(), 0, "NUL-terminated");
    let text = std::str::from_utf8(&m.payload[4..m.payload.len() - 1]).unwrap();
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    let caps = v["capabilities"].as_object().unwrap();
    assert!(!caps.contains_key("migration"));
    assert!(!caps.contains_key("write_multiple"));
    assert!(!caps.contains_key("twin_socket"));
    assert_eq!(caps["max_msg_fds"], 16);
    assert_eq!(caps["pgsizes"], 4096);
    finish(c, h);
}

#[test]
fn every_message_round_trips() {
    let _g = lock();
    let (mut c, h) = connected();

    let info = c.device_info().unwrap();
    assert_eq!(
        info,
        DeviceInfo { flags: wire::DEVICE_FLAG_PCI | wire::DEVICE_FLAG_RESET, num_regions: 4, num_irqs: 2 }
    );

    // Region 0: mmap with a sparse area and the memfd.
    let r0 = c.region_info(0).unwrap();
    assert_eq!(
        r0.flags,
        wire::REGION_FLAG_READ | wire::REGION_FLAG_WRITE | wire::REGION_FLAG_MMAP | wire::REGION_FLAG_CAPS
    );
    assert_eq!(r0.size, 0x4000);
    assert_eq!(r0.sparse, SPARSE.to_vec());
    let bar_fd = r0.fd.expect("region fd");
    // Region 1: plain.
    let r1 = c.region_info(1).unwrap();
    assert_eq!(r1.flags, wire::REGION_FLAG_READ | wire::REGION_FLAG_WRITE);
    assert!(r1.fd.is_none() && r1.sparse.is_empty());
    assert_eq!(c.region_info(3).unwrap().size, 0);

    assert_eq!(c.irq_info(1).unwrap(), IrqInfo { flags: wire::IRQ_INFO_EVENTFD | wire::IRQ_INFO_NORESIZE, count: 4 });

    // Region I/O.
    c.region_write(1, 0x10, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let mut b = [0u8; 8];
    c.region_read(1, 0x10, &mut b).unwrap();
    assert_eq!(b, [1, 2, 3, 4, 5, 6, 7, 8]);
    c.region_write_posted(1, 0xfc, &[9, 9, 9, 9]).unwrap();
    let mut b = [0u8; 4];
    c.region_read(1, 0xfc, &mut b).unwrap();
    assert_eq!(b, [9; 4]);
    let mut ro = [0u8; 16];
    c.region_read(2, 0, &mut ro).unwrap();
    assert_eq!(ro.to_vec(), (0..16).collect::<Vec<u8>>());
    // Through the sparse area of region 0 too (messages always work).
    c.region_write(0, 0x1000, &[0xaa; 4]).unwrap();

    // IRQs: four MSI-X eventfds, de-assign two, bools, trigger, disable all.
    let efds: Vec<OwnedFd> = (0..4).map(|_| eventfd()).collect();
    let bfds: Vec<BorrowedFd<'_>> = efds.iter().map(|f| f.as_fd()).collect();
    let ev = wire::IRQ_SET_DATA_EVENTFD | wire::IRQ_SET_ACTION_TRIGGER;
    c.set_irqs(1, ev, 0, 4, &[], &bfds).unwrap();
    c.set_irqs(1, ev, 2, 2, &[], &[]).unwrap();
    c.set_irqs(0, wire::IRQ_SET_DATA_BOOL | wire::IRQ_SET_ACTION_MASK, 0, 1, &[1], &[]).unwrap();
    c.set_irqs(1, wire::IRQ_SET_DATA_NONE | wire::IRQ_SET_ACTION_TRIGGER, 3, 1, &[], &[]).unwrap();
    c.set_irqs(1, wire::IRQ_SET_DATA_NONE | wire::IRQ_SET_ACTION_TRIGGER, 0, 0, &[], &[]).unwrap();

    // DMA: with a descriptor, without one, unmap one, unmap all.
    let guest = memfd(0x10_0000);
    let rw = wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE;
    c.dma_map(0, 0x8_0000, 0, rw, Some(guest.as_fd())).unwrap();
    c.dma_map(0x10_0000, 0x8_0000, 0x8_0000, wire::DMA_MAP_FLAG_READ, Some(guest.as_fd())).unwrap();
    c.dma_map(0x20_0000, 0x1000, 0, rw, None).unwrap();
    c.dma_unmap(0x10_0000, 0x8_0000, 0).unwrap();

    c.reset().unwrap();
    let e = finish(c, h);
    let d = &e.dev;

    // The region descriptor is the device's memfd.
    assert_eq!(inode(bar_fd.as_fd()), inode(d.bar.as_fd()));
    assert_eq!(&d.data[0][0x1000..0x1004], &[0xaa; 4]);
    assert_eq!(
        d.sets,
        vec![
            SetRecord {
                index: 1,
                start: 0,
                count: 4,
                action: IrqAction::Trigger,
                kind: "eventfd",
                bools: vec![],
                nfds: 4
            },
            SetRecord {
                index: 1,
                start: 2,
                count: 2,
                action: IrqAction::Trigger,
                kind: "eventfd",
                bools: vec![],
                nfds: 0
            },
            SetRecord { index: 0, start: 0, count: 1, action: IrqAction::Mask, kind: "bool", bools: vec![1], nfds: 0 },
            SetRecord {
                index: 1,
                start: 3,
                count: 1,
                action: IrqAction::Trigger,
                kind: "none",
                bools: vec![],
                nfds: 0
            },
            SetRecord {
                index: 1,
                start: 0,
                count: 0,
                action: IrqAction::Trigger,
                kind: "none",
                bools: vec![],
                nfds: 0
            },
        ]
    );
    // The eventfds the device holds are the ones sent.
    for (sent, held) in efds.iter().zip(&d.irq_fds) {
        assert_eq!(inode(sent.as_fd()), inode(held.as_fd()));
    }
    assert_eq!(d.maps.len(), 2);
    let (iova, size, off, r, w, fd) = &d.maps[0];
    assert_eq!((*iova, *size, *off, *r, *w), (0, 0x8_0000, 0, true, true));
    assert_eq!(inode(fd.as_ref().unwrap().as_fd()), inode(guest.as_fd()));
    assert!(d.maps[1].5.is_none());
    assert_eq!(e.dma_maps, vec![(0, 0x8_0000), (0x20_0000, 0x1000)]);
    assert_eq!(d.resets, 1);
}

#[test]
fn unmap_all() {
    let _g = lock();
    let (mut c, h) = connected();
    let rw = wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE;
    for i in 0..3u64 {
        c.dma_map(i << 20, 0x1000, 0, rw, None).unwrap();
    }
    // As QEMU sends it: flag ALL, iova and size 0.
    c.dma_unmap(0, 0, wire::DMA_UNMAP_FLAG_ALL).unwrap();
    assert_eq!(errno(c.dma_unmap(0, 0x1000, wire::DMA_UNMAP_FLAG_ALL)), Errno::EINVAL);
    let e = finish(c, h);
    assert!(e.dev.maps.is_empty() && e.dma_maps.is_empty());
}

#[test]
fn region_info_too_short_for_caps() {
    let _g = lock();
    let (mut c, h) = connected();
    // argsz 32: the fixed part only, the size needed, no CAPS, no fd.
    let m = c.region_info_raw(0, 32).unwrap();
    let r = wire::RegionInfoMsg::decode(&m.payload).unwrap();
    assert_eq!(m.payload.len(), 32);
    assert_eq!(r.argsz as usize, 32 + wire::sparse_mmap_cap_size(1));
    assert_eq!(r.flags & wire::REGION_FLAG_CAPS, 0);
    assert_eq!(r.cap_offset, 0);
    assert!(m.fds.is_empty());
    // With room: CAPS at 32, and the descriptor.
    let m = c.region_info_raw(0, r.argsz).unwrap();
    let r2 = wire::RegionInfoMsg::decode(&m.payload).unwrap();
    assert_eq!(m.payload.len(), r.argsz as usize);
    assert_eq!(r2.cap_offset, 32);
    assert_ne!(r2.flags & wire::REGION_FLAG_CAPS, 0);
    assert_eq!(m.fds.len(), 1);
    // argsz below the fixed part, and a bad index.
    assert_eq!(errno(c.region_info_raw(0, 31)), Errno::EINVAL);
    assert_eq!(errno(c.region_info_raw(4, 64)), Errno::EINVAL);
    finish(c, h);
}

#[test]
fn region_info_for_a_client_taking_no_fds() {
    let _g = lock();
    let (mut c, h) = spawn();
    c.version(&wire::Capabilities { max_msg_fds: 0, ..qemu_caps() }).unwrap();
    let r = c.region_info(0).unwrap();
    assert_eq!(r.flags, wire::REGION_FLAG_READ | wire::REGION_FLAG_WRITE);
    assert!(r.fd.is_none() && r.sparse.is_empty());
    finish(c, h);
}

#[test]
fn header_size_below_16_closes() {
    let _g = lock();
    let (mut c, h) = connected();
    c.send_raw(&raw_msg(cmd::DEVICE_GET_INFO, 0, 15, &[]), &[]).unwrap();
    closed_by_server(c, h, |e| matches!(e, Error::MessageTooSmall(h) if h.size == 15));
}

#[test]
fn header_size_above_max_closes() {
    let _g = lock();
    let config = ServerConfig { max_data_xfer_size: 256, ..Default::default() };
    let (mut c, h) = spawn_with(Fake::new(), config);
    c.version(&qemu_caps()).unwrap();
    // The largest message taken: a REGION_WRITE of 256 bytes.
    c.region_write(1, 0, &[7; 256]).unwrap();
    // One byte more is refused before it is read.
    c.send_raw(&raw_msg(cmd::REGION_WRITE, 0, 16 + 16 + 257, &[]), &[]).unwrap();
    closed_by_server(c, h, |e| matches!(e, Error::MessageTooLarge { header, max: 288 } if header.size == 289));
}

#[test]
fn truncated_message_closes() {
    let _g = lock();
    let (mut c, h) = connected();
    // A GET_REGION_INFO announcing 48 bytes, 26 sent, then EOF.
    c.send_raw(&raw_msg(cmd::DEVICE_GET_REGION_INFO, 0, 48, &[0; 10]), &[]).unwrap();
    c.stream().shutdown(std::net::Shutdown::Write).unwrap();
    closed_by_server(c, h, |e| matches!(e, Error::Truncated { got: 26, want: 48 }));

    // Inside the header.
    let (mut c, h) = connected();
    c.send_raw(&[1, 0, 4], &[]).unwrap();
    c.stream().shutdown(std::net::Shutdown::Write).unwrap();
    closed_by_server(c, h, |e| matches!(e, Error::Truncated { got: 3, want: 16 }));
}

#[test]
fn reply_from_client_closes() {
    let _g = lock();
    let (mut c, h) = connected();
    c.send_raw(&raw_msg(cmd::DEVICE_GET_INFO, wire::FLAG_TYPE_REPLY, 16, &[]), &[]).unwrap();
    closed_by_server(c, h, |e| matches!(e, Error::NotACommand(_)));
}

#[test]
fn commands_before_version() {
    let _g = lock();
    let (mut c, h) = spawn();
    assert_eq!(errno(c.device_info()), Errno::EINVAL);
    assert_eq!(errno(c.dma_map(0, 0x1000, 0, wire::DMA_MAP_FLAG_READ, None)), Errno::EINVAL);
    assert_eq!(errno(c.reset()), Errno::EINVAL);
    // Even unknown ones: VERSION first.
    assert_eq!(errno(c.call(99, &[], &[])), Errno::EINVAL);
    c.version(&qemu_caps()).unwrap();
    c.device_info().unwrap();
    let e = finish(c, h);
    assert!(e.dev.maps.is_empty());
    assert_eq!(e.dev.resets, 0);
}

#[test]
fn bad_versions() {
    let _g = lock();
    let (mut c, h) = spawn();
    let bad: [&[u8]; 6] = [
        b"\0\0",                                               // too short
        b"\0\0\0\0{\"capabilities\":{}}",                      // no NUL
        b"\0\0\0\0{\"capabilities\":\0",                       // not JSON
        b"\0\0\0\0\"str\"\0",                                  // not an object
        b"\0\0\0\0{\"capabilities\":{\"pgsizes\":\"4k\"}}\0",  // wrong type
        b"\0\0\0\0{\"capabilities\":{\"max_msg_fds\":1.5}}\0", // not an integer
    ];
    for p in bad {
        assert_eq!(errno(c.call(cmd::VERSION, p, &[])), Errno::EINVAL, "{p:?}");
    }
    // pgsizes without 4 KiB.
    assert_eq!(errno(c.version(&wire::Capabilities { pgsizes: 1 << 21, ..qemu_caps() })), Errno::ENOTSUP);
    // Then a good one, and no second one.
    c.version(&qemu_caps()).unwrap();
    assert_eq!(errno(c.version(&qemu_caps())), Errno::EINVAL);
    finish(c, h);

    // Major 1: closed.
    let (mut c, h) = spawn();
    c.send(cmd::VERSION, 0, &[1, 0, 0, 0], &[]).unwrap();
    closed_by_server(c, h, |e| matches!(e, Error::UnsupportedVersion { major: 1, minor: 0 }));
}

#[test]
fn dma_map_rules() {
    let _g = lock();
    let config = ServerConfig { max_dma_maps: 3, ..Default::default() };
    let (mut c, h) = spawn_with(Fake::new(), config);
    c.version(&qemu_caps()).unwrap();
    let rw = wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE;
    let m = |c: &mut Client, iova, size| c.dma_map(iova, size, 0, rw, None);
    m(&mut c, 0x10_0000, 0x10_0000).unwrap();
    // Overlaps: the same, inside, across the start, across the end, around.
    for (iova, size) in
        [(0x10_0000, 0x10_0000), (0x18_0000, 0x1000), (0xf_f000, 0x2000), (0x1f_f000, 0x2000), (0, 0x100_0000)]
    {
        assert_eq!(errno(m(&mut c, iova, size)), Errno::EEXIST, "{iova:#x}+{size:#x}");
    }
    // Adjacent on both sides is fine.
    m(&mut c, 0xf_f000, 0x1000).unwrap();
    m(&mut c, 0x20_0000, 0x1000).unwrap();
    // Limit of 3 mappings.
    assert_eq!(errno(m(&mut c, 0x100_0000, 0x1000)), Errno::ENOSPC);
    // Alignment, zero size, wrap-around.
    assert_eq!(errno(m(&mut c, 0x100_0800, 0x1000)), Errno::EINVAL);
    assert_eq!(errno(m(&mut c, 0x100_0000, 0x800)), Errno::EINVAL);
    assert_eq!(errno(m(&mut c, 0x100_0000, 0)), Errno::EINVAL);
    assert_eq!(errno(m(&mut c, u64::MAX - 0xfff, 0x2000)), Errno::EINVAL);
    let fd = memfd(0x1000);
    assert_eq!(errno(c.dma_map(0x100_0000, 0x1000, 0x800, rw, Some(fd.as_fd()))), Errno::EINVAL);
    // Flags: unknown bit, mmap mode without fd, file I/O mode, both modes.
    assert_eq!(errno(c.dma_map(0x100_0000, 0x1000, 0, 1 << 4, None)), Errno::EINVAL);
    assert_eq!(errno(c.dma_map(0x100_0000, 0x1000, 0, wire::DMA_MAP_FLAG_MMAP, None)), Errno::EINVAL);
    assert_eq!(errno(c.dma_map(0x100_0000, 0x1000, 0, wire::DMA_MAP_FLAG_FILE_IO, Some(fd.as_fd()))), Errno::ENOTSUP);
    assert_eq!(
        errno(c.dma_map(0x100_0000, 0x1000, 0, wire::DMA_MAP_FLAG_FILE_IO | wire::DMA_MAP_FLAG_MMAP, Some(fd.as_fd()))),
        Errno::EINVAL
    );
    // A wrong payload size and a short argsz.
    let mut p = Vec::new();
    wire::DmaMapMsg { argsz: 32, flags: rw, offset: 0, iova: 0x100_0000, size: 0x1000 }.encode(&mut p);
    p.push(0);
    assert_eq!(errno(c.call(cmd::DMA_MAP, &p, &[])), Errno::EINVAL);
    p.pop();
    p[0] = 31;
    assert_eq!(errno(c.call(cmd::DMA_MAP, &p, &[])), Errno::EINVAL);
    let e = finish(c, h);
    assert_eq!(e.dma_maps, vec![(0xf_f000, 0x1000), (0x10_0000, 0x10_0000), (0x20_0000, 0x1000)]);
    assert_eq!(e.dev.maps.len(), 3);
}

#[test]
fn dma_unmap_rules() {
    let _g = lock();
    let mut dev = Fake::new();
    dev.busy_iova = Some(0x40_0000);
    let (mut c, h) = spawn_with(dev, ServerConfig::default());
    c.version(&qemu_caps()).unwrap();
    let rw = wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE;
    c.dma_map(0x10_0000, 0x10_0000, 0, rw, None).unwrap();
    c.dma_map(0x40_0000, 0x1000, 0, rw, None).unwrap();
    // Not mapped, part of a mapping, more than a mapping.
    assert_eq!(errno(c.dma_unmap(0x80_0000, 0x1000, 0)), Errno::ENOENT);
    assert_eq!(errno(c.dma_unmap(0x10_0000, 0x1000, 0)), Errno::ENOENT);
    assert_eq!(errno(c.dma_unmap(0x18_0000, 0x1000, 0)), Errno::ENOENT);
    assert_eq!(errno(c.dma_unmap(0x10_0000, 0x20_0000, 0)), Errno::ENOENT);
    // Unknown flags (the dirty bitmap, VADDR).
    assert_eq!(errno(c.dma_unmap(0x10_0000, 0x10_0000, 1)), Errno::EINVAL);
    assert_eq!(errno(c.dma_unmap(0x10_0000, 0x10_0000, 4)), Errno::EINVAL);
    // The device refuses memory in use: it stays mapped.
    assert_eq!(errno(c.dma_unmap(0x40_0000, 0x1000, 0)), Errno::EBUSY);
    // Unmap-all takes what it can and reports the refusal.
    assert_eq!(errno(c.dma_unmap(0, 0, wire::DMA_UNMAP_FLAG_ALL)), Errno::EBUSY);
    let e = finish(c, h);
    assert_eq!(e.dma_maps, vec![(0x40_0000, 0x1000)]);
    assert_eq!(e.dev.maps.len(), 1);
}

#[test]
fn region_access_rules() {
    let _g = lock();
    let config = ServerConfig { max_data_xfer_size: 0x1000, ..Default::default() };
    let (mut c, h) = spawn_with(Fake::new(), config);
    // The client takes at most 64 bytes per transfer.
    c.version(&wire::Capabilities { max_data_xfer_size: 64, ..qemu_caps() }).unwrap();
    let mut b = [0u8; 8];
    // Past the end, straddling it, offset wrapping, bad index.
    assert_eq!(errno(c.region_read(1, 0x100, &mut b)), Errno::EINVAL);
    assert_eq!(errno(c.region_read(1, 0xfc, &mut b)), Errno::EINVAL);
    assert_eq!(errno(c.region_read(1, u64::MAX - 3, &mut b)), Errno::EINVAL);
    assert_eq!(errno(c.region_read(4, 0, &mut b)), Errno::EINVAL);
    assert_eq!(errno(c.region_read(u32::MAX, 0, &mut b)), Errno::EINVAL);
    assert_eq!(errno(c.region_write(1, 0xf9, &b)), Errno::EINVAL);
    assert_eq!(errno(c.region_write(3, 0, &[1])), Errno::EINVAL);
    // Read-only region.
    assert_eq!(errno(c.region_write(2, 0, &[1])), Errno::EINVAL);
    c.region_read(2, 8, &mut b).unwrap();
    // A read bigger than the client takes; a write up to ours is fine.
    let mut big = [0u8; 65];
    assert_eq!(errno(c.region_read(1, 0, &mut big)), Errno::EINVAL);
    c.region_read(1, 0, &mut big[..64]).unwrap();
    c.region_write(1, 0, &[5; 0x100]).unwrap();
    // A write whose count and data disagree; a read with trailing bytes.
    let mut p = Vec::new();
    wire::RegionAccessMsg { offset: 0, region: 1, count: 8 }.encode(&mut p);
    p.extend_from_slice(&[1, 2, 3, 4]);
    assert_eq!(errno(c.call(cmd::REGION_WRITE, &p, &[])), Errno::EINVAL);
    assert_eq!(errno(c.call(cmd::REGION_READ, &p, &[])), Errno::EINVAL);
    let e = finish(c, h);
    assert_eq!(e.dev.data[1], vec![5; 0x100]);
}

#[test]
fn irq_rules() {
    let _g = lock();
    let (mut c, h) = connected();
    let trig = wire::IRQ_SET_ACTION_TRIGGER;
    let none = wire::IRQ_SET_DATA_NONE;
    let ev = wire::IRQ_SET_DATA_EVENTFD;
    assert_eq!(errno(c.irq_info(2)), Errno::EINVAL);
    // Index, range, wrap.
    assert_eq!(errno(c.set_irqs(2, none | trig, 0, 1, &[], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(1, none | trig, 0, 5, &[], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(1, none | trig, 4, 1, &[], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(1, none | trig, u32::MAX, 2, &[], &[])), Errno::EINVAL);
    // Flags: two data bits, no action, two actions, unknown bit.
    assert_eq!(errno(c.set_irqs(1, none | ev | trig, 0, 1, &[], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(1, none, 0, 1, &[], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(0, none | trig | wire::IRQ_SET_ACTION_MASK, 0, 1, &[], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(1, none | trig | 1 << 6, 0, 1, &[], &[])), Errno::EINVAL);
    // Mask on a type that is not maskable.
    assert_eq!(errno(c.set_irqs(1, none | wire::IRQ_SET_ACTION_MASK, 0, 1, &[], &[])), Errno::EINVAL);
    // Count 0 only as "disable all".
    assert_eq!(errno(c.set_irqs(1, ev | trig, 0, 0, &[], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(1, none | trig, 1, 0, &[], &[])), Errno::EINVAL);
    // Eventfds not matching count.
    let efds: Vec<OwnedFd> = (0..3).map(|_| eventfd()).collect();
    let bfds: Vec<BorrowedFd<'_>> = efds.iter().map(|f| f.as_fd()).collect();
    assert_eq!(errno(c.set_irqs(1, ev | trig, 0, 2, &[], &bfds)), Errno::EINVAL);
    // Bools not matching count; data with DATA_NONE.
    let b = wire::IRQ_SET_DATA_BOOL;
    assert_eq!(errno(c.set_irqs(1, b | trig, 0, 2, &[1], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(1, b | trig, 0, 1, &[1, 1], &[])), Errno::EINVAL);
    assert_eq!(errno(c.set_irqs(1, none | trig, 0, 1, &[1], &[])), Errno::EINVAL);
    // Short payload.
    assert_eq!(errno(c.call(cmd::DEVICE_SET_IRQS, &[0; 19], &[])), Errno::EINVAL);
    let e = finish(c, h);
    assert!(e.dev.sets.is_empty() && e.dev.irq_fds.is_empty());
}

#[test]
fn unknown_and_unserved_commands() {
    let _g = lock();
    let (mut c, h) = connected();
    for command in [
        0,
        cmd::DEVICE_GET_REGION_IO_FDS,
        cmd::DMA_READ,
        cmd::DMA_WRITE,
        14,
        cmd::REGION_WRITE_MULTI,
        cmd::DEVICE_FEATURE,
        17,
        18,
        0xffff,
    ] {
        assert_eq!(errno(c.call(command, &[0; 8], &[])), Errno::ENOSYS, "{command}");
    }
    c.device_info().unwrap();
    finish(c, h);
}

#[test]
fn fixed_size_payloads_are_exact() {
    let _g = lock();
    let (mut c, h) = connected();
    assert_eq!(errno(c.call(cmd::DEVICE_GET_INFO, &[16, 0, 0, 0], &[])), Errno::EINVAL);
    let mut p = vec![0; 17];
    p[0] = 16;
    assert_eq!(errno(c.call(cmd::DEVICE_GET_INFO, &p, &[])), Errno::EINVAL);
    assert_eq!(errno(c.call(cmd::DEVICE_GET_IRQ_INFO, &p, &[])), Errno::EINVAL);
    assert_eq!(errno(c.call(cmd::DMA_UNMAP, &p, &[])), Errno::EINVAL);
    assert_eq!(errno(c.call(cmd::DEVICE_RESET, &[0], &[])), Errno::EINVAL);
    // argsz below the structure.
    p.truncate(16);
    p[0] = 15;
    assert_eq!(errno(c.call(cmd::DEVICE_GET_INFO, &p, &[])), Errno::EINVAL);
    finish(c, h);
}

#[test]
fn no_reply_errors_are_not_answered() {
    let _g = lock();
    let (mut c, h) = connected();
    // A posted write out of range: no reply; the next request's reply is
    // the next message.
    c.region_write_posted(1, 0x200, &[1; 4]).unwrap();
    let req = c
        .send(
            cmd::DEVICE_GET_INFO,
            0,
            &{
                let mut p = Vec::new();
                wire::DeviceInfoMsg { argsz: 16, ..Default::default() }.encode(&mut p);
                p
            },
            &[],
        )
        .unwrap();
    let m = c.reply_to(&req).unwrap();
    assert_eq!(m.payload.len(), 16);
    let e = finish(c, h);
    match &e.events[1] {
        Event::Handled { header, result } => {
            assert_eq!(header.command, cmd::REGION_WRITE);
            assert!(header.no_reply());
            assert_eq!(*result, Err(Errno::EINVAL));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn descriptors_on_commands_taking_none_are_closed() {
    let _g = lock();
    let (mut c, h) = connected();
    let before = open_fds();
    let (r, w) = pipe();
    let mut p = Vec::new();
    wire::DeviceInfoMsg { argsz: 16, ..Default::default() }.encode(&mut p);
    assert_eq!(errno(c.call(cmd::DEVICE_GET_INFO, &p, &[w.as_fd()])), Errno::EINVAL);
    // Unknown command with a descriptor: ENOSYS, closed as well.
    assert_eq!(errno(c.call(0x4242, &[], &[w.as_fd()])), Errno::ENOSYS);
    // DMA_MAP takes one; two are refused.
    let rw = wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE;
    let mut m = Vec::new();
    wire::DmaMapMsg { argsz: 32, flags: rw, offset: 0, iova: 0, size: 0x1000 }.encode(&mut m);
    assert_eq!(errno(c.call(cmd::DMA_MAP, &m, &[w.as_fd(), w.as_fd()])), Errno::EINVAL);
    // A refused DMA_MAP closes its one descriptor too.
    assert_eq!(errno(c.dma_map(0x800, 0x1000, 0, rw, Some(w.as_fd()))), Errno::EINVAL);
    // VERSION (repeated) with a descriptor.
    assert_eq!(errno(c.call(cmd::VERSION, &[0; 4], &[w.as_fd()])), Errno::EINVAL);
    drop(w);
    assert!(writers_gone(&r), "the server kept a copy of the pipe");
    drop(r);
    assert_eq!(open_fds(), before);
    let e = finish(c, h);
    assert!(e.dev.maps.is_empty());
}

#[test]
fn more_descriptors_than_allowed_are_closed() {
    let _g = lock();
    // Counted before the sockets and the device's memfd: all are closed at
    // the end.
    let before = open_fds();
    let config = ServerConfig { max_msg_fds: 4, ..Default::default() };
    let (mut c, h) = spawn_with(Fake::new(), config);
    c.version(&qemu_caps()).unwrap();
    let (r, w) = pipe();
    let ev = wire::IRQ_SET_DATA_EVENTFD | wire::IRQ_SET_ACTION_TRIGGER;
    // 5 > max_msg_fds 4 (and the IRQ type holds only 4): refused.
    let five = [w.as_fd(); 5];
    assert_eq!(errno(c.set_irqs(1, ev, 0, 4, &[], &five)), Errno::EINVAL);
    // 100 descriptors on one message (more than any limit).
    let many = vec![w.as_fd(); 100];
    assert_eq!(errno(c.set_irqs(1, ev, 0, 4, &[], &many)), Errno::EINVAL);
    // The limit itself is fine.
    let efds: Vec<OwnedFd> = (0..4).map(|_| eventfd()).collect();
    let bfds: Vec<BorrowedFd<'_>> = efds.iter().map(|f| f.as_fd()).collect();
    c.set_irqs(1, ev, 0, 4, &[], &bfds).unwrap();
    drop(w);
    assert!(writers_gone(&r), "the server kept a copy of the pipe");
    drop(r);
    let e = finish(c, h);
    assert_eq!(e.dev.irq_fds.len(), 4);
    drop(e);
    drop(efds);
    assert_eq!(open_fds(), before);
}

#[test]
fn descriptors_sent_apart_from_the_header_count_too() {
    let _g = lock();
    let (mut c, h) = connected();
    let (r, w) = pipe();
    // A GET_INFO whose header goes alone and whose payload carries a
    // descriptor: still a message that takes none.
    let mut p = Vec::new();
    wire::DeviceInfoMsg { argsz: 16, ..Default::default() }.encode(&mut p);
    let msg = raw_msg(cmd::DEVICE_GET_INFO, 0, 32, &p);
    c.send_raw(&msg[..16], &[]).unwrap();
    c.send_raw(&msg[16..], &[w.as_fd()]).unwrap();
    let m = c.recv().unwrap();
    assert!(m.header.is_error());
    assert_eq!(m.header.error, libc::EINVAL as u32);
    drop(w);
    assert!(writers_gone(&r));
    finish(c, h);
}

#[test]
fn nonblocking_server_resumes_inside_messages_and_replies() {
    let _g = lock();
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    // A small send buffer, so that the replies below fill it whatever the
    // host's default.
    let size: libc::c_int = 64 << 10;
    // SAFETY: a valid socket and a c_int option of its true size.
    let rc = unsafe {
        libc::setsockopt(
            a.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    let mut s = Server::new(a, ServerConfig::default()).unwrap();
    let mut dev = Fake::new();
    let mut c = Client::new(b);

    assert_eq!(s.handle(&mut dev).unwrap(), Event::Idle);
    // VERSION in three pieces.
    let mut p = Vec::new();
    wire::VersionMsg { major: 0, minor: 0, caps: qemu_caps() }.encode(&mut p);
    let msg = raw_msg(cmd::VERSION, 0, (16 + p.len()) as u32, &p);
    c.send_raw(&msg[..7], &[]).unwrap();
    assert_eq!(s.handle(&mut dev).unwrap(), Event::Idle);
    c.send_raw(&msg[7..20], &[]).unwrap();
    assert_eq!(s.handle(&mut dev).unwrap(), Event::Idle);
    c.send_raw(&msg[20..], &[]).unwrap();
    assert!(matches!(s.handle(&mut dev).unwrap(), Event::Handled { result: Ok(()), .. }));
    assert!(s.negotiated().is_some());
    let v = c.recv().unwrap();
    assert_eq!(v.header.id, 77);

    // Reads of 64 KiB that the client does not collect: the server stops
    // reading requests while a reply is unsent.
    let mut req = Vec::new();
    wire::RegionAccessMsg { offset: 0, region: 0, count: 0x4000 }.encode(&mut req);
    for _ in 0..64 {
        c.send(cmd::REGION_READ, 0, &req, &[]).unwrap();
    }
    let mut handled = 0;
    loop {
        match s.handle(&mut dev).unwrap() {
            Event::Idle => break,
            Event::Handled { result, .. } => {
                assert_eq!(result, Ok(()));
                handled += 1;
            }
        }
    }
    assert!(s.wants_write(), "the socket buffer should have filled");
    assert!(handled < 64);
    // Collect the replies as the server goes on.
    let mut got = 0;
    while got < 64 {
        while let Ok(Event::Handled { .. }) = s.handle(&mut dev) {
            handled += 1;
        }
        let m = c.recv().unwrap();
        assert_eq!(m.payload.len(), 16 + 0x4000);
        got += 1;
    }
    assert_eq!(handled, 64);
    assert_eq!(s.handle(&mut dev).unwrap(), Event::Idle);
    drop(c);
    assert!(matches!(s.handle(&mut dev), Err(Error::PeerClosed)));
}

#[test]
fn config_limits_are_checked() {
    let _g = lock();
    for cfg in [
        ServerConfig { max_msg_fds: 17, ..Default::default() },
        ServerConfig { max_msg_fds: 0, ..Default::default() },
        ServerConfig { max_data_xfer_size: (64 << 20) + 1, ..Default::default() },
        ServerConfig { max_dma_maps: 65536, ..Default::default() },
    ] {
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(Server::new(a, cfg).is_err(), "{cfg:?}");
    }
}

#[test]
fn client_refuses_a_hostile_server() {
    let _g = lock();
    let (a, b) = UnixStream::pair().unwrap();
    let mut c = Client::new(b);
    let mut srv = a;
    // A reply of 100 MiB announced: refused without allocating it.
    let t = std::thread::spawn(move || {
        let mut h = [0u8; 16 + 16];
        srv.read_exact(&mut h).unwrap();
        let hdr =
            Header { id: 0, command: cmd::DEVICE_GET_INFO, size: 100 << 20, flags: wire::FLAG_TYPE_REPLY, error: 0 };
        srv.write_all(&hdr.encode()).unwrap();
        srv
    });
    assert!(matches!(c.device_info(), Err(ClientError::Protocol(_))));
    let mut srv = t.join().unwrap();
    // A reply with another id.
    let t = std::thread::spawn(move || {
        let mut h = [0u8; 16 + 16];
        srv.read_exact(&mut h).unwrap();
        let mut reply =
            Header { id: 999, command: cmd::DEVICE_GET_INFO, size: 32, flags: wire::FLAG_TYPE_REPLY, error: 0 }
                .encode()
                .to_vec();
        reply.extend_from_slice(&[0; 16]);
        srv.write_all(&reply).unwrap();
    });
    assert!(matches!(c.device_info(), Err(ClientError::Protocol(_))));
    t.join().unwrap();
    assert_eq!(HEADER_SIZE, 16);
}
