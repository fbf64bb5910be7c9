//! A hostile VMM: the real vhostd binary (net on the loopback backend, blk
//! on the null backend) fed hand-made vhost-user messages that are
//! truncated, oversized, of the wrong size, short of or over-supplied with
//! file descriptors, out of order, about memory that is not there or
//! overlaps, about queues that do not exist, or simply unknown; frontends
//! that vanish mid-message, connect and leave by the hundred, shrink the
//! guest memory under the rings, or stop reading.
//!
//! Every case asserts the exact outcome on its own connection (an error
//! acknowledgement — REPLY_ACK negotiated and NEED_REPLY set — a reply, or
//! vhostd closing that connection), then that vhostd is still running,
//! holds exactly the descriptors, guest-memory mappings and threads it had
//! before (no leak), that the next frontend on the same socket moves
//! traffic byte for byte, and that vhostd stops cleanly on SIGTERM with
//! exact counters. The case list with the expected outcomes is
//! doc/hostile-vmm.md (with the bugs these cases found, all fixed).
//!
//! Every wait is bounded: replies are read with timeouts, and the frontend
//! that proves the next connection works runs under a watchdog, so a hung
//! vhostd fails the test instead of stalling it. Daemons are killed on drop.

mod common;

use common::*;
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use vhost::vhost_user::message::VhostUserInflight;
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vhostd_user::blk::status;
use vhostd_user::features as f;
use vhostd_user::{BlkOp, Options, VhostUserProtocolFeatures, VirtioUser};

/// Bound of every wait for traffic, a settled daemon or a whole frontend.
const T: Duration = Duration::from_secs(10);
/// How long a request may go unanswered before it counts as ignored.
const REPLY_T: Duration = Duration::from_secs(3);

// Front-end request codes (vhost-user.rst).
const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const SET_MEM_TABLE: u32 = 5;
const SET_LOG_BASE: u32 = 6;
const SET_LOG_FD: u32 = 7;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const GET_VRING_BASE: u32 = 11;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const SET_VRING_ERR: u32 = 14;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const GET_QUEUE_NUM: u32 = 17;
const SET_VRING_ENABLE: u32 = 18;
const SEND_RARP: u32 = 19;
const NET_SET_MTU: u32 = 20;
const IOTLB_MSG: u32 = 22;
const SET_VRING_ENDIAN: u32 = 23;
const GET_CONFIG: u32 = 24;
const SET_CONFIG: u32 = 25;
const POSTCOPY_ADVISE: u32 = 28;
const GET_INFLIGHT_FD: u32 = 31;
const SET_INFLIGHT_FD: u32 = 32;
const RESET_DEVICE: u32 = 34;
const VRING_KICK: u32 = 35;
const GET_MAX_MEM_SLOTS: u32 = 36;
const ADD_MEM_REG: u32 = 37;
const REM_MEM_REG: u32 = 38;
const SET_STATUS: u32 = 39;
const GET_STATUS: u32 = 40;

/// Header flags.
const REPLY: u32 = 0x4;
const NEED_REPLY: u32 = 0x8;
/// The flags of every reply: version 1 | reply.
const REPLY_FLAGS: u32 = 0x1 | REPLY;
/// SET_VRING_KICK/CALL/ERR: no file descriptor (poll).
const NO_FD: u64 = 0x100;

// Protocol feature bits.
const PF_MQ: u64 = 1 << 0;
const PF_LOG_SHMFD: u64 = 1 << 1;
const PF_RARP: u64 = 1 << 2;
const PF_BACKEND_REQ: u64 = 1 << 5;
const PF_REPLY_ACK: u64 = 1 << 3;
const PF_CONFIG: u64 = 1 << 9;
const PF_INFLIGHT_SHMFD: u64 = 1 << 12;
const PF_RESET_DEVICE: u64 = 1 << 13;
const PF_MEM_SLOTS: u64 = 1 << 15;
const PF_STATUS: u64 = 1 << 16;
/// What vhostd offers (session.rs `protocol_features`).
const COMMON_PROTOCOL: u64 =
    PF_MQ | PF_LOG_SHMFD | PF_REPLY_ACK | PF_CONFIG | PF_RESET_DEVICE | PF_MEM_SLOTS | PF_STATUS;
const NET_PROTOCOL: u64 = COMMON_PROTOCOL | PF_RARP;
/// VHOST_F_LOG_ALL: offered on every device.
const LOG_ALL: u64 = f::LOG_ALL;
const BLK_PROTOCOL: u64 = COMMON_PROTOCOL | PF_INFLIGHT_SHMFD;

/// Virtio features vhostd offers on the loopback backend.
const NET_OFFERED: u64 = f::VERSION_1
    | f::IN_ORDER
    | f::EVENT_IDX
    | f::INDIRECT_DESC
    | f::RING_PACKED
    | f::NET_MAC
    | f::NET_MRG_RXBUF
    | f::NET_STATUS
    | f::NET_CTRL_VQ
    | (1 << 18) // CTRL_RX
    | f::NET_GUEST_ANNOUNCE
    | f::NET_MQ
    | (1 << 23) // CTRL_MAC_ADDR
    | LOG_ALL
    | f::PROTOCOL_FEATURES;
/// What the null blk backend offers.
const BLK_OFFERED: u64 = f::VERSION_1
    | f::EVENT_IDX
    | f::INDIRECT_DESC
    | f::RING_PACKED
    | f::BLK_SIZE_MAX
    | f::BLK_SEG_MAX
    | f::BLK_BLK_SIZE
    | f::BLK_FLUSH
    | f::BLK_TOPOLOGY
    | f::BLK_CONFIG_WCE
    | f::BLK_MQ
    | f::BLK_DISCARD
    | f::BLK_WRITE_ZEROES
    | LOG_ALL
    | f::PROTOCOL_FEATURES;

/// The frontend-virtual address raw tests give their memory.
const UADDR: u64 = 0x7f00_0000_0000;
const MIB: u64 = 1 << 20;
/// Regions GET_MAX_MEM_SLOTS promises (virtq::memory::MAX_REGIONS).
const MAX_MEM_SLOTS: u64 = 509;
/// The null blk disk: 64 MiB.
const BLK_SECTORS: u64 = (64 << 20) / 512;

// ---- payloads ---------------------------------------------------------------

fn u64b(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// Vring state description: index, num.
fn state(index: u32, num: u32) -> Vec<u8> {
    let mut b = index.to_le_bytes().to_vec();
    b.extend_from_slice(&num.to_le_bytes());
    b
}

/// Vring address description (all addresses suitably aligned).
fn vring_addr(index: u32, desc: u64, used: u64, avail: u64) -> Vec<u8> {
    let mut b = index.to_le_bytes().to_vec();
    b.extend_from_slice(&0u32.to_le_bytes());
    for a in [desc, used, avail, 0u64] {
        b.extend_from_slice(&a.to_le_bytes());
    }
    b
}

/// Vring address description with VHOST_VRING_F_LOG and log_guest_addr.
fn vring_addr_logged(index: u32, desc: u64, used: u64, avail: u64, log: u64) -> Vec<u8> {
    let mut b = vring_addr(index, desc, used, avail);
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    b[32..40].copy_from_slice(&log.to_le_bytes());
    b
}

/// SET_LOG_BASE payload: mmap size, mmap offset.
fn log_base(size: u64, offset: u64) -> Vec<u8> {
    [size, offset].iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// One region: guest address, size, frontend address, mmap offset.
#[derive(Clone, Copy)]
struct Reg {
    gpa: u64,
    size: u64,
    uaddr: u64,
    offset: u64,
}

fn reg(gpa: u64, size: u64, uaddr: u64, offset: u64) -> Reg {
    Reg { gpa, size, uaddr, offset }
}

fn reg_bytes(r: Reg) -> Vec<u8> {
    [r.gpa, r.size, r.uaddr, r.offset].iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// SET_MEM_TABLE payload.
fn mem_table(regions: &[Reg]) -> Vec<u8> {
    let mut b = (regions.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(&0u32.to_le_bytes());
    for r in regions {
        b.extend_from_slice(&reg_bytes(*r));
    }
    b
}

/// ADD_MEM_REG / REM_MEM_REG payload.
fn single_region(r: Reg) -> Vec<u8> {
    let mut b = 0u64.to_le_bytes().to_vec();
    b.extend_from_slice(&reg_bytes(r));
    b
}

/// GET_CONFIG / SET_CONFIG payload: offset, size, flags, then the bytes.
fn config(offset: u32, size: u32, flags: u32, data: &[u8]) -> Vec<u8> {
    let mut b = offset.to_le_bytes().to_vec();
    b.extend_from_slice(&size.to_le_bytes());
    b.extend_from_slice(&flags.to_le_bytes());
    b.extend_from_slice(data);
    b
}

/// Inflight description: mmap size, offset 0, queues, queue size.
fn inflight(size: u64, queues: u16, queue_size: u16) -> Vec<u8> {
    let mut b = u64b(size);
    b.extend_from_slice(&u64b(0));
    b.extend_from_slice(&queues.to_le_bytes());
    b.extend_from_slice(&queue_size.to_le_bytes());
    b.extend_from_slice(&[0; 4]);
    b
}

/// A memfd of `size` bytes (the test's "guest memory").
fn memfd(size: u64) -> File {
    // SAFETY: memfd_create with a static C name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"hostile".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor owned by nothing else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).unwrap();
    file
}

fn eventfd() -> OwnedFd {
    // SAFETY: eventfd(2); the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor owned by nothing else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

// ---- a raw frontend ---------------------------------------------------------

/// What came back on a raw connection.
#[derive(Debug, PartialEq, Eq)]
enum Got {
    /// One whole message.
    Msg { code: u32, flags: u32, body: Vec<u8> },
    /// vhostd closed the connection (EOF or reset).
    Closed,
    /// Nothing within the timeout, connection still open.
    Nothing,
}

/// A hand-driven vhost-user connection.
struct Raw {
    s: UnixStream,
}

/// How a read of `buf.len()` bytes ended: all read, or n bytes then EOF /
/// timeout.
enum Fill {
    Full,
    Eof(usize),
    Timeout(usize),
}

fn fill(s: &mut UnixStream, buf: &mut [u8]) -> Fill {
    let mut n = 0;
    while n < buf.len() {
        match s.read(&mut buf[n..]) {
            Ok(0) => return Fill::Eof(n),
            Ok(k) => n += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return Fill::Timeout(n),
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Fill::Eof(n),
            Err(e) => panic!("read from vhostd: {e}"),
        }
    }
    Fill::Full
}

impl Raw {
    fn connect(d: &Daemon) -> Raw {
        Raw { s: UnixStream::connect(&d.sock).expect("connect to vhostd") }
    }

    /// Sends raw bytes (a whole or partial message) with `fds` attached.
    /// A connection vhostd already closed takes nothing; the next `recv`
    /// says so.
    fn send_bytes(&mut self, bytes: &[u8], fds: &[RawFd]) {
        match send_with_fds(&self.s, bytes, fds) {
            Ok(n) => assert_eq!(n, bytes.len(), "short send"),
            Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {}
            Err(e) => panic!("send to vhostd: {e}"),
        }
    }

    /// Sends one message (version 1 in the flags).
    fn send(&mut self, code: u32, flags: u32, body: &[u8]) {
        self.send_bytes(&vhost_user_msg(code, flags, body), &[]);
    }

    fn send_fds(&mut self, code: u32, flags: u32, body: &[u8], fds: &[RawFd]) {
        self.send_bytes(&vhost_user_msg(code, flags, body), fds);
    }

    /// The next message, EOF, or nothing within `timeout`.
    fn recv(&mut self, timeout: Duration) -> Got {
        self.s.set_read_timeout(Some(timeout)).unwrap();
        let mut hdr = [0u8; 12];
        match fill(&mut self.s, &mut hdr) {
            Fill::Full => {}
            Fill::Eof(0) => return Got::Closed,
            Fill::Timeout(0) => return Got::Nothing,
            Fill::Eof(n) | Fill::Timeout(n) => panic!("vhostd sent {n} bytes of a header"),
        }
        let word = |i: usize| u32::from_le_bytes(hdr[i..i + 4].try_into().unwrap());
        let (code, flags, size) = (word(0), word(4), word(8) as usize);
        assert!(size <= 4096, "reply of {size} bytes");
        let mut body = vec![0u8; size];
        self.s.set_read_timeout(Some(T)).unwrap();
        match fill(&mut self.s, &mut body) {
            Fill::Full => Got::Msg { code, flags, body },
            Fill::Eof(n) | Fill::Timeout(n) => panic!("vhostd sent {n} of {size} payload bytes"),
        }
    }

    /// A reply to `code` (version 1 | REPLY): its payload.
    fn reply(&mut self, code: u32, what: &str) -> Vec<u8> {
        match self.recv(REPLY_T) {
            Got::Msg { code: c, flags, body } if c == code && flags == REPLY_FLAGS => body,
            g => panic!("{what}: expected a reply to request {code}, got {g:?}"),
        }
    }

    fn reply_u64(&mut self, code: u32, what: &str) -> u64 {
        let b = self.reply(code, what);
        assert_eq!(b.len(), 8, "{what}: u64 reply");
        u64::from_le_bytes(b.try_into().unwrap())
    }

    /// A REPLY_ACK acknowledgement of `code` with exactly `want` (vhostd
    /// and the vhost crate acknowledge success with 0, an error with 1).
    fn expect_ack(&mut self, code: u32, want: u64, what: &str) {
        let got = self.reply_u64(code, what);
        assert_eq!(got, want, "{what}: acknowledged with {got} ({})", if got == 0 { "success" } else { "error" });
    }

    /// vhostd closes the connection, sending nothing first.
    fn expect_closed(&mut self, what: &str) {
        let g = self.recv(REPLY_T);
        assert_eq!(g, Got::Closed, "{what}: vhostd should close the connection");
    }

    /// The connection still serves requests (one GET_FEATURES round trip).
    fn expect_alive(&mut self, offered: u64, what: &str) {
        self.send(GET_FEATURES, 0, &[]);
        assert_eq!(self.reply_u64(GET_FEATURES, what), offered, "{what}: GET_FEATURES after it");
    }

    /// SET_OWNER, GET_FEATURES, GET/SET_PROTOCOL_FEATURES (`protocol`,
    /// acknowledged if it holds REPLY_ACK), SET_FEATURES (`features` |
    /// PROTOCOL_FEATURES). Returns what vhostd offered.
    fn handshake(&mut self, features: u64, protocol: u64) -> u64 {
        self.send(SET_OWNER, 0, &[]);
        self.send(GET_FEATURES, 0, &[]);
        let offered = self.reply_u64(GET_FEATURES, "GET_FEATURES");
        assert_ne!(offered & f::PROTOCOL_FEATURES, 0);
        self.send(GET_PROTOCOL_FEATURES, 0, &[]);
        let pf = self.reply_u64(GET_PROTOCOL_FEATURES, "GET_PROTOCOL_FEATURES");
        assert_eq!(pf & protocol, protocol, "protocol features {protocol:#x} offered (got {pf:#x})");
        let ack = protocol & PF_REPLY_ACK != 0;
        self.send(SET_PROTOCOL_FEATURES, if ack { NEED_REPLY } else { 0 }, &u64b(protocol));
        if ack {
            self.expect_ack(SET_PROTOCOL_FEATURES, 0, "SET_PROTOCOL_FEATURES");
        }
        self.send(SET_FEATURES, if ack { NEED_REPLY } else { 0 }, &u64b(features | f::PROTOCOL_FEATURES));
        if ack {
            self.expect_ack(SET_FEATURES, 0, "SET_FEATURES");
        }
        offered
    }

    /// `handshake` for a net device with REPLY_ACK and everything offered.
    fn net(d: &Daemon) -> Raw {
        let mut r = Raw::connect(d);
        assert_eq!(r.handshake(f::VERSION_1, NET_PROTOCOL), NET_OFFERED);
        r
    }

    /// The same for a blk device (CONFIG_WCE acked).
    fn blk(d: &Daemon) -> Raw {
        let mut r = Raw::connect(d);
        assert_eq!(r.handshake(f::VERSION_1 | f::BLK_CONFIG_WCE, BLK_PROTOCOL), BLK_OFFERED);
        r
    }

    /// A request with NEED_REPLY, acknowledged as an error (1).
    fn refused(&mut self, code: u32, body: &[u8], what: &str) {
        self.send(code, NEED_REPLY, body);
        self.expect_ack(code, 1, what);
    }

    /// A request with NEED_REPLY, acknowledged as a success (0).
    fn accepted(&mut self, code: u32, body: &[u8], what: &str) {
        self.send(code, NEED_REPLY, body);
        self.expect_ack(code, 0, what);
    }
}

// ---- the daemon's side ------------------------------------------------------

fn net_daemon() -> Daemon {
    Daemon::start(&["--backend", "loopback"])
}

fn blk_daemon() -> Daemon {
    Daemon::start_with(None, |sock| {
        ["blk", "--socket-path", &sock.display().to_string(), "--backend", "null,size=64M"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    })
}

/// How process `pid` (our child) ended, if it has. WNOWAIT: the child is
/// left for `Daemon` to reap.
fn ended(pid: i32) -> Option<String> {
    // SAFETY: siginfo_t is plain data; waitid fills it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on our own child with a valid siginfo_t.
    let r = unsafe {
        libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT)
    };
    assert_eq!(r, 0, "waitid({pid}): {}", std::io::Error::last_os_error());
    // SAFETY: waitid filled the SIGCHLD fields (si_pid stays 0 if nothing ended).
    let (p, st) = unsafe { (info.si_pid(), info.si_status()) };
    if p == 0 {
        return None;
    }
    Some(match info.si_code {
        libc::CLD_EXITED => format!("exited with status {st}"),
        libc::CLD_KILLED | libc::CLD_DUMPED => {
            format!("killed by signal {st}{}", if st == libc::SIGBUS { " (SIGBUS)" } else { "" })
        }
        c => format!("ended (si_code {c}, status {st})"),
    })
}

fn count_dir(p: String) -> usize {
    std::fs::read_dir(&p).unwrap_or_else(|e| panic!("{p}: {e}")).count()
}

/// Mappings of memfds (guest memory) in the process.
fn memfd_maps(pid: i32) -> usize {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    maps.lines().filter(|l| l.contains("/memfd:")).count()
}

/// A daemon's resources at the start of a test: every hostile connection
/// must leave them exactly so.
struct Watch {
    pid: i32,
    fds: usize,
    maps: usize,
    threads: usize,
}

impl Watch {
    fn new(d: &Daemon) -> Watch {
        let pid = d.pid();
        let (fds, maps) = (count_dir(format!("/proc/{pid}/fd")), memfd_maps(pid));
        // One round trip: the device thread is up (it starts after the
        // socket listens) and creates nothing that outlives a connection.
        let mut r = Raw::connect(d);
        r.send(GET_FEATURES, 0, &[]);
        r.reply_u64(GET_FEATURES, "GET_FEATURES");
        drop(r);
        let threads = count_dir(format!("/proc/{pid}/task"));
        assert!(wait_until(T, || count_dir(format!("/proc/{pid}/fd")) == fds), "vhostd's descriptors did not settle");
        Watch { pid, fds, maps, threads }
    }

    fn now(&self) -> (usize, usize, usize) {
        let pid = self.pid;
        (count_dir(format!("/proc/{pid}/fd")), memfd_maps(pid), count_dir(format!("/proc/{pid}/task")))
    }

    /// vhostd is running.
    fn alive(&self) {
        if let Some(how) = ended(self.pid) {
            panic!("vhostd {how}");
        }
    }

    /// vhostd is running and, once the last connection is torn down, holds
    /// exactly the descriptors, memfd mappings and threads it started with.
    fn settled(&self) {
        self.alive();
        let want = (self.fds, self.maps, self.threads);
        let ok = wait_until(T, || self.now() == want);
        self.alive();
        assert!(ok, "vhostd (fds, memfd mappings, threads) = {:?}, started with {want:?}", self.now());
    }

    /// Exactly `extra` more memfd mappings than at the start (the guest
    /// memory of the connection being served).
    fn maps_now(&self, extra: usize) {
        let want = self.maps + extra;
        assert!(wait_until(T, || memfd_maps(self.pid) == want), "memfd mappings {} != {want}", memfd_maps(self.pid));
    }
}

/// Runs `f` on a thread and waits for it at most T: a frontend blocked on
/// a hung vhostd fails the test (the daemon is killed on drop, which
/// releases the thread).
fn within<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(T) {
        Ok(Ok(r)) => r,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("{what}: not done within {T:?} (vhostd hung?)"),
    }
}

/// Frames the net check moves each time.
const NET_FRAMES: u32 = 64;

/// The next frontend on `sock` works: `NET_FRAMES` distinct frames go out
/// on pair 0's TX queue and come back through the loopback, byte for byte
/// and in order; then a clean disconnect.
fn net_traffic(sock: PathBuf, first_seq: u32) {
    let mut dev = VirtioUser::connect(Options::new(&sock)).expect("the next frontend connects");
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).expect("queue pair 0 starts");
    let sent: Vec<Vec<u8>> =
        (0..NET_FRAMES).map(|i| frame(first_seq + i, 60 + ((first_seq + i) as usize * 37) % 1400)).collect();
    for fr in &sent {
        assert!(tx.send_frame(fr).unwrap());
    }
    tx.flush().unwrap();
    let mut got: Vec<Vec<u8>> = Vec::new();
    let ok = wait_until(T, || {
        tx.reclaim().unwrap();
        rx.recv_burst(64, |fr| got.push(fr.to_vec())).unwrap();
        got.len() >= sent.len()
    });
    assert!(ok, "only {} of {} frames came back", got.len(), sent.len());
    assert_eq!(got, sent, "frames came back changed");
    assert_eq!(rx.stats.bad, 0);
    drop((rx, tx));
    dev.disconnect().expect("clean disconnect");
}

/// `net_traffic` under the watchdog, then the daemon is back to its start.
fn net_works(d: &Daemon, w: &Watch, first_seq: u32) {
    w.alive();
    let sock = d.sock.clone();
    within("the next net frontend", move || net_traffic(sock, first_seq));
    w.settled();
}

/// The next blk frontend works: the config space reads right, reads at
/// both ends of the disk succeed, one past the end is IOERR, GET_ID answers.
fn blk_traffic(sock: PathBuf) {
    let mut dev = VirtioUser::connect(Options::blk(&sock)).expect("the next blk frontend connects");
    let cfg = dev.blk_config().unwrap();
    assert_eq!((cfg.capacity, cfg.writeback, cfg.num_queues), (BLK_SECTORS, 1, 1));
    let mut q = dev.blk_queue(0, 4, 4096).expect("request queue 0 starts");
    assert_eq!(q.run_one(BlkOp::Read { sector: 0, len: 4096 }).unwrap(), (status::OK, 4097));
    assert_eq!(q.run_one(BlkOp::Read { sector: BLK_SECTORS - 8, len: 4096 }).unwrap(), (status::OK, 4097));
    assert_eq!(q.run_one(BlkOp::Read { sector: BLK_SECTORS, len: 512 }).unwrap().0, status::IOERR);
    let id = q.request(BlkOp::GetId, &[], T).unwrap();
    assert_eq!(id.status, status::OK);
    assert_eq!(&id.data[..11], b"vhostd-null");
    drop(q);
    dev.disconnect().expect("clean disconnect");
}

fn blk_works(d: &Daemon, w: &Watch) {
    w.alive();
    let sock = d.sock.clone();
    within("the next blk frontend", move || blk_traffic(sock));
    w.settled();
}

/// SIGTERM; true if vhostd ends within `t` (not reaped: `Daemon::stop`
/// checks the status).
fn sigterm_ends_within(d: &Daemon, t: Duration) -> bool {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(d.pid(), libc::SIGTERM) };
    wait_until(t, || ended(d.pid()).is_some())
}

/// Stops a net daemon that moved `frames` frames in `net_works` checks (and
/// nothing else): exit status 0, socket removed, counters exact.
fn stop_net(d: Daemon, frames: u64) {
    let s = d.stop();
    assert_eq!(s.total("guest_tx_packets"), frames);
    assert_eq!(s.total("guest_rx_packets"), frames);
    assert_eq!(s.total("dropped"), 0);
    assert_eq!(s.total("bad_chains"), 0);
}

/// Stops a blk daemon after `checks` `blk_works`: three reads (one of
/// them out of range) and a GET_ID each.
fn stop_blk(d: Daemon, checks: u64) {
    let s = d.stop();
    assert_eq!(s.queue(0, "reads"), 3 * checks);
    assert_eq!(s.queue(0, "out_of_range"), checks);
    assert_eq!(s.queue(0, "get_ids"), checks);
    assert_eq!(s.queue(0, "bad_chains"), 0);
}

/// How most cases end: the hostile connection went without leaving fds,
/// mappings or threads behind, the next net frontend works, and vhostd's
/// totals hold only that frontend's frames.
fn net_serves_next(d: Daemon, w: &Watch) {
    w.settled();
    net_works(&d, w, 0);
    stop_net(d, NET_FRAMES as u64);
}

/// `net_serves_next` for blk: one `blk_works` after the hostile connection.
fn blk_serves_next(d: Daemon, w: &Watch) {
    w.settled();
    blk_works(&d, w);
    stop_blk(d, 1);
}

// ---- truncated, oversized and mis-sized messages ---------------------------

#[test]
fn truncated_messages_then_close() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let set_features = vhost_user_msg(SET_FEATURES, NEED_REPLY, &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES));
    let enable = vhost_user_msg(SET_VRING_ENABLE, NEED_REPLY, &state(0, 1));
    let table = vhost_user_msg(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[reg(0, MIB, UADDR, 0)]));
    let mem = memfd(MIB);
    let cases: [(&str, &[u8], &[RawFd], bool); 6] = [
        ("5 bytes of a header, before any handshake", &set_features[..5], &[], false),
        ("5 bytes of a header", &set_features[..5], &[], true),
        ("SET_FEATURES header without its payload", &set_features[..12], &[], true),
        ("SET_FEATURES with 4 of its 8 payload bytes", &set_features[..16], &[], true),
        ("SET_VRING_ENABLE (vhostd's own parser) with 4 of 8 payload bytes", &enable[..16], &[], true),
        ("SET_MEM_TABLE with its fd and 20 of its 40 payload bytes", &table[..32], &[mem.as_raw_fd()], true),
    ];
    for (what, bytes, fds, handshake) in cases {
        let mut r = Raw::connect(&d);
        if handshake {
            r.handshake(f::VERSION_1, NET_PROTOCOL);
        }
        r.send_bytes(bytes, fds);
        r.s.shutdown(std::net::Shutdown::Write).unwrap();
        r.expect_closed(what);
        w.alive();
    }
    net_serves_next(d, &w);
}

#[test]
fn a_size_past_the_payload_limit_closes_the_connection_at_once() {
    let d = net_daemon();
    let w = Watch::new(&d);
    // The payload limit is 4096 bytes; vhostd must not wait for (or
    // allocate) the announced payload: the connection stays open on our side.
    for (code, size) in [
        (SET_FEATURES, 4097u32),
        (SET_FEATURES, 1 << 20),
        (SET_FEATURES, u32::MAX),
        (SET_VRING_ENABLE, 4097),
        (SET_MEM_TABLE, u32::MAX),
    ] {
        let mut r = Raw::net(&d);
        let mut msg = vhost_user_msg(code, NEED_REPLY, &[0u8; 8]);
        msg[8..12].copy_from_slice(&size.to_le_bytes());
        r.send_bytes(&msg, &[]);
        r.expect_closed(&format!("request {code} announcing {size} payload bytes"));
        w.alive();
    }
    // A size within the limit but larger than what follows: the payload
    // arrives short in one piece.
    let mut r = Raw::net(&d);
    let mut msg = vhost_user_msg(SET_FEATURES, NEED_REPLY, &u64b(f::VERSION_1));
    msg[8..12].copy_from_slice(&4096u32.to_le_bytes());
    r.send_bytes(&msg, &[]);
    r.expect_closed("SET_FEATURES announcing 4096 bytes, sending 8");
    net_serves_next(d, &w);
}

#[test]
fn wrong_sizes_for_fixed_size_messages_close_the_connection() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mem = memfd(MIB);
    // (what, request, payload length, attach the memfd)
    let cases: &[(&str, u32, usize, bool)] = &[
        ("SET_FEATURES with 4 bytes", SET_FEATURES, 4, false),
        ("SET_FEATURES with 12 bytes", SET_FEATURES, 12, false),
        ("SET_PROTOCOL_FEATURES with 4 bytes", SET_PROTOCOL_FEATURES, 4, false),
        ("SET_OWNER with 8 bytes", SET_OWNER, 8, false),
        ("GET_FEATURES with 8 bytes", GET_FEATURES, 8, false),
        ("GET_QUEUE_NUM with 4 bytes", GET_QUEUE_NUM, 4, false),
        ("SET_VRING_NUM with 4 bytes", SET_VRING_NUM, 4, false),
        ("SET_VRING_BASE with 12 bytes", SET_VRING_BASE, 12, false),
        ("GET_VRING_BASE with 4 bytes", GET_VRING_BASE, 4, false),
        ("SET_VRING_ADDR short (32 of 40 bytes)", SET_VRING_ADDR, 32, false),
        ("SET_VRING_ADDR long (48 bytes)", SET_VRING_ADDR, 48, false),
        ("SET_VRING_KICK with 4 bytes", SET_VRING_KICK, 4, false),
        ("SET_VRING_CALL with 16 bytes", SET_VRING_CALL, 16, false),
        ("SET_VRING_ENABLE with 4 bytes", SET_VRING_ENABLE, 4, false),
        ("SET_VRING_ENABLE with 16 bytes", SET_VRING_ENABLE, 16, false),
        ("SET_STATUS with 4 bytes", SET_STATUS, 4, false),
        ("GET_STATUS with 8 bytes", GET_STATUS, 8, false),
        ("GET_MAX_MEM_SLOTS with 8 bytes", GET_MAX_MEM_SLOTS, 8, false),
        ("ADD_MEM_REG with 32 of 40 bytes", ADD_MEM_REG, 32, true),
        ("REM_MEM_REG with 48 bytes", REM_MEM_REG, 48, false),
        ("GET_CONFIG with 8 bytes (no header)", GET_CONFIG, 8, false),
    ];
    for &(what, code, len, with_fd) in cases {
        let mut r = Raw::net(&d);
        // SET_VRING_KICK's 4 bytes say "no fd" so the size alone is wrong.
        let mut body = vec![0u8; len];
        if code == SET_VRING_KICK {
            body[1] = 1;
        }
        let fds: &[RawFd] = if with_fd { &[mem.as_raw_fd()] } else { &[] };
        r.send_fds(code, NEED_REPLY, &body, fds);
        r.expect_closed(what);
        w.alive();
    }
    // SET_MEM_TABLE whose size does not match its region count: the error
    // is acknowledged, then the connection is closed.
    for (what, len) in
        [("SET_MEM_TABLE with 1 region in 24 bytes", 24usize), ("SET_MEM_TABLE with 1 region in 72 bytes", 72)]
    {
        let mut r = Raw::net(&d);
        let mut body = mem_table(&[reg(0, MIB, UADDR, 0)]);
        body.resize(len, 0);
        r.send_fds(SET_MEM_TABLE, NEED_REPLY, &body, &[mem.as_raw_fd()]);
        r.expect_ack(SET_MEM_TABLE, 1, what);
        r.expect_closed(what);
    }
    net_serves_next(d, &w);
}

// ---- file descriptors ---------------------------------------------------------

#[test]
fn missing_file_descriptors() {
    let d = net_daemon();
    let w = Watch::new(&d);
    // SET_MEM_TABLE without its fd: acknowledged as an error, then closed.
    let mut r = Raw::net(&d);
    r.send(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[reg(0, MIB, UADDR, 0)]));
    r.expect_ack(SET_MEM_TABLE, 1, "SET_MEM_TABLE without its fd");
    r.expect_closed("SET_MEM_TABLE without its fd");
    // Two regions, one fd.
    let mem = memfd(2 * MIB);
    let mut r = Raw::net(&d);
    r.send_fds(
        SET_MEM_TABLE,
        NEED_REPLY,
        &mem_table(&[reg(0, MIB, UADDR, 0), reg(MIB, MIB, UADDR + MIB, MIB)]),
        &[mem.as_raw_fd()],
    );
    r.expect_ack(SET_MEM_TABLE, 1, "SET_MEM_TABLE with 2 regions and 1 fd");
    r.expect_closed("SET_MEM_TABLE with 2 regions and 1 fd");
    // Ring eventfds announced (bit 8 clear) but not attached: closed.
    for (what, code) in
        [("SET_VRING_KICK", SET_VRING_KICK), ("SET_VRING_CALL", SET_VRING_CALL), ("SET_VRING_ERR", SET_VRING_ERR)]
    {
        let mut r = Raw::net(&d);
        r.send(code, NEED_REPLY, &u64b(0));
        r.expect_closed(&format!("{what} without the fd it announces"));
        w.alive();
    }
    // The same with bit 8 set (no fd, poll) is fine.
    let mut r = Raw::net(&d);
    r.accepted(SET_VRING_KICK, &u64b(NO_FD), "SET_VRING_KICK, no fd, bit 8 set");
    r.accepted(SET_VRING_CALL, &u64b(NO_FD), "SET_VRING_CALL, no fd, bit 8 set");
    r.expect_alive(NET_OFFERED, "after SET_VRING_KICK/CALL without fds");
    drop(r);
    net_serves_next(d, &w);

    // blk: SET_INFLIGHT_FD without its memfd: closed.
    let d = blk_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::blk(&d);
    r.send(SET_INFLIGHT_FD, NEED_REPLY, &inflight(4096, 1, 128));
    r.expect_closed("SET_INFLIGHT_FD without its fd");
    // With it, but smaller than its queues need: refused, connection lives.
    let small = memfd(4096);
    let mut r = Raw::blk(&d);
    r.send_fds(SET_INFLIGHT_FD, NEED_REPLY, &inflight(64, 1, 128), &[small.as_raw_fd()]);
    r.expect_ack(SET_INFLIGHT_FD, 1, "SET_INFLIGHT_FD of 64 bytes for a 128-entry queue");
    r.send_fds(SET_INFLIGHT_FD, NEED_REPLY, &inflight(1 << 20, 1, 128), &[small.as_raw_fd()]);
    r.expect_ack(SET_INFLIGHT_FD, 1, "SET_INFLIGHT_FD of 1 MiB of a 4 KiB memfd");
    r.expect_alive(BLK_OFFERED, "after refused SET_INFLIGHT_FD");
    drop(r);
    blk_serves_next(d, &w);
}

#[test]
fn ring_descriptors_that_are_not_eventfds_are_refused() {
    // A pipe nobody reads, or a memfd, as a kick, call or error eventfd: a
    // write to it could block the worker (or never be seen). Refused, and
    // the connection lives on.
    let d = net_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::net(&d);
    let mut pipe = [0; 2];
    // SAFETY: pipe() writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let mem = memfd(4096);
    for (what, code) in
        [("SET_VRING_KICK", SET_VRING_KICK), ("SET_VRING_CALL", SET_VRING_CALL), ("SET_VRING_ERR", SET_VRING_ERR)]
    {
        for (kind, fd) in [("a pipe", pipe[1]), ("a memfd", mem.as_raw_fd())] {
            r.send_fds(code, NEED_REPLY, &u64b(0), &[fd]);
            r.expect_ack(code, 1, &format!("{what} with {kind}"));
        }
    }
    r.expect_alive(NET_OFFERED, "after refused ring descriptors");
    // A real eventfd is taken, and made non-blocking (the flag is on the
    // open file both ends share).
    let e = eventfd();
    // SAFETY: F_GETFL on our own descriptor.
    let flags = || unsafe { libc::fcntl(e.as_raw_fd(), libc::F_GETFL) };
    assert_eq!(flags() & libc::O_NONBLOCK, 0, "the test's eventfd starts blocking");
    r.send_fds(SET_VRING_CALL, NEED_REPLY, &u64b(0), &[e.as_raw_fd()]);
    r.expect_ack(SET_VRING_CALL, 0, "SET_VRING_CALL with an eventfd");
    assert_ne!(flags() & libc::O_NONBLOCK, 0, "vhostd makes a call eventfd non-blocking");
    // SAFETY: closing the pipe's two descriptors, ours.
    unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
    }
    drop(r);
    net_serves_next(d, &w);
}

#[test]
fn bad_dirty_logs_close_the_connection() {
    // QEMU waits for SET_LOG_BASE's reply, which comes only once the log is
    // mapped: a log that cannot be used leaves closing as the answer.
    let d = net_daemon();
    let w = Watch::new(&d);
    let mem = memfd(MIB);
    // 1 MiB from guest address 1 MiB: the log needs 64 bytes (512 pages).
    let table = mem_table(&[reg(MIB, MIB, UADDR, 0)]);
    let log = memfd(4096);
    let e = eventfd();
    let cases: [(&str, Vec<u8>, &[RawFd]); 6] = [
        ("SET_LOG_BASE without its fd", log_base(4096, 0), &[]),
        ("SET_LOG_BASE with an eventfd for a log", log_base(4096, 0), &[e.as_raw_fd()]),
        ("SET_LOG_BASE of 32 bytes for 2 MiB of guest addresses", log_base(32, 0), &[log.as_raw_fd()]),
        ("SET_LOG_BASE past the end of its file", log_base(4096, 4096), &[log.as_raw_fd()]),
        ("SET_LOG_BASE of 0 bytes", log_base(0, 0), &[log.as_raw_fd()]),
        ("SET_LOG_BASE of 2 GiB", log_base(2 << 30, 0), &[log.as_raw_fd()]),
    ];
    for (what, body, fds) in cases {
        let mut r = Raw::net(&d);
        r.send_fds(SET_MEM_TABLE, NEED_REPLY, &table, &[mem.as_raw_fd()]);
        r.expect_ack(SET_MEM_TABLE, 0, "SET_MEM_TABLE");
        r.send_fds(SET_LOG_BASE, 0, &body, fds);
        r.expect_closed(what);
        w.alive();
    }
    // LOG_SHMFD not negotiated: the request is not one this connection has.
    let mut r = Raw::connect(&d);
    r.handshake(f::VERSION_1, NET_PROTOCOL & !PF_LOG_SHMFD);
    r.send_fds(SET_LOG_BASE, 0, &log_base(4096, 0), &[log.as_raw_fd()]);
    r.expect_closed("SET_LOG_BASE without LOG_SHMFD");
    w.alive();

    // VHOST_VRING_F_LOG before any log: accepted (QEMU sends a device
    // started mid-migration its ring addresses first, the log after).
    let mut r = Raw::net(&d);
    r.send_fds(SET_MEM_TABLE, NEED_REPLY, &table, &[mem.as_raw_fd()]);
    r.expect_ack(SET_MEM_TABLE, 0, "SET_MEM_TABLE");
    r.accepted(SET_FEATURES, &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES | LOG_ALL), "SET_FEATURES with LOG_ALL");
    r.accepted(SET_VRING_NUM, &state(0, 256), "SET_VRING_NUM");
    let addr = vring_addr_logged(0, MIB, MIB + 0x3000, MIB + 0x1000, MIB + 0x3000);
    r.accepted(SET_VRING_ADDR, &addr, "SET_VRING_ADDR with VHOST_VRING_F_LOG and no log");
    // A log that fits is answered with a reply of its own, twice (QEMU
    // 7.2 sends it once per queue pair).
    for n in ["first", "second"] {
        r.send_fds(SET_LOG_BASE, 0, &log_base(64, 0), &[log.as_raw_fd()]);
        let body = r.reply(SET_LOG_BASE, &format!("the {n} SET_LOG_BASE"));
        assert!(body.len() <= 16, "SET_LOG_BASE reply of {} bytes", body.len());
    }
    // Turning the log off and on again while nothing runs.
    r.accepted(SET_FEATURES, &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES), "SET_FEATURES without LOG_ALL");
    r.accepted(SET_FEATURES, &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES | LOG_ALL), "SET_FEATURES with LOG_ALL again");
    r.expect_alive(NET_OFFERED, "after the dirty log requests");
    drop(r);
    net_serves_next(d, &w);
}

#[test]
fn send_rarp_is_served_only_when_negotiated() {
    let d = net_daemon();
    let w = Watch::new(&d);
    // Without protocol feature RARP it is not a request this connection has.
    let mut r = Raw::connect(&d);
    r.handshake(f::VERSION_1, NET_PROTOCOL & !PF_RARP);
    r.send(SEND_RARP, NEED_REPLY, &u64b(0x5634_1200_5452));
    r.expect_closed("SEND_RARP without RARP negotiated");
    w.alive();
    // With it: acknowledged, also before any ring runs; a short payload closes.
    let mut r = Raw::net(&d);
    r.accepted(SEND_RARP, &u64b(0x5634_1200_5452), "SEND_RARP");
    r.accepted(SEND_RARP, &u64b(u64::MAX), "SEND_RARP of ff:ff:ff:ff:ff:ff");
    r.expect_alive(NET_OFFERED, "after SEND_RARP");
    r.send(SEND_RARP, NEED_REPLY, &[0x52, 0x54, 0, 0x12]);
    r.expect_closed("SEND_RARP with 4 payload bytes");
    w.alive();
    drop(r);
    net_serves_next(d, &w);
    // blk has no wire: the feature is not offered there.
    let d = blk_daemon();
    let mut r = Raw::connect(&d);
    r.send(GET_PROTOCOL_FEATURES, 0, &[]);
    assert_eq!(r.reply_u64(GET_PROTOCOL_FEATURES, "blk GET_PROTOCOL_FEATURES") & PF_RARP, 0);
}

#[test]
fn add_mem_reg_without_its_fd_is_answered() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::net(&d);
    r.send(ADD_MEM_REG, NEED_REPLY, &single_region(reg(0, MIB, UADDR, 0)));
    match r.recv(REPLY_T) {
        Got::Msg { code: ADD_MEM_REG, flags: REPLY_FLAGS, body } => {
            assert_ne!(body, u64b(0), "acknowledged as a success")
        }
        Got::Closed => {}
        g => panic!("ADD_MEM_REG without its fd: expected an error ack or a close, got {g:?}"),
    }
    drop(r);
    net_serves_next(d, &w);
}

#[test]
fn extra_file_descriptors() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let e1 = eventfd();
    let e2 = eventfd();
    let mem = memfd(MIB);
    // Messages that take no fd, with one: closed, nothing sent.
    let one = [e1.as_raw_fd()];
    let cases: &[(&str, u32, Vec<u8>)] = &[
        ("SET_OWNER", SET_OWNER, vec![]),
        ("GET_FEATURES", GET_FEATURES, vec![]),
        ("SET_FEATURES", SET_FEATURES, u64b(f::VERSION_1 | f::PROTOCOL_FEATURES)),
        ("SET_PROTOCOL_FEATURES", SET_PROTOCOL_FEATURES, u64b(NET_PROTOCOL)),
        ("GET_QUEUE_NUM", GET_QUEUE_NUM, vec![]),
        ("SET_VRING_NUM", SET_VRING_NUM, state(0, 64)),
        ("SET_VRING_BASE", SET_VRING_BASE, state(0, 0)),
        ("GET_VRING_BASE", GET_VRING_BASE, state(0, 0)),
        ("SET_VRING_ADDR", SET_VRING_ADDR, vring_addr(0, UADDR, UADDR + 8192, UADDR + 4096)),
        ("GET_CONFIG", GET_CONFIG, config(0, 12, 0, &[0; 12])),
        ("GET_MAX_MEM_SLOTS", GET_MAX_MEM_SLOTS, vec![]),
    ];
    for (what, code, body) in cases {
        let mut r = Raw::net(&d);
        r.send_fds(*code, NEED_REPLY, body, &one);
        r.expect_closed(&format!("{what} with an fd"));
        w.alive();
    }
    // 32 fds (as many as vhostd receives) on GET_FEATURES: closed.
    let many: Vec<OwnedFd> = (0..32).map(|_| eventfd()).collect();
    let raw: Vec<RawFd> = many.iter().map(|e| e.as_raw_fd()).collect();
    let mut r = Raw::net(&d);
    r.send_fds(GET_FEATURES, 0, &[], &raw);
    r.expect_closed("GET_FEATURES with 32 fds");
    // A kick that says "no fd" but brings one; one with two fds.
    let mut r = Raw::net(&d);
    r.send_fds(SET_VRING_KICK, NEED_REPLY, &u64b(NO_FD), &one);
    r.expect_closed("SET_VRING_KICK with bit 8 set and an fd");
    let mut r = Raw::net(&d);
    r.send_fds(SET_VRING_KICK, NEED_REPLY, &u64b(0), &[e1.as_raw_fd(), e2.as_raw_fd()]);
    r.expect_closed("SET_VRING_KICK with two fds");
    // SET_MEM_TABLE: one region, two fds: error ack, then closed.
    let mut r = Raw::net(&d);
    r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[reg(0, MIB, UADDR, 0)]), &[mem.as_raw_fd(), e1.as_raw_fd()]);
    r.expect_ack(SET_MEM_TABLE, 1, "SET_MEM_TABLE with 1 region and 2 fds");
    r.expect_closed("SET_MEM_TABLE with 1 region and 2 fds");
    // vhostd answers SET_VRING_ENABLE itself (server.rs handle_own_msg):
    // an fd sent with it is discarded unused (closed: see `settled`) and
    // the request is served, as the spec allows for REM_MEM_REG.
    let mut r = Raw::net(&d);
    r.send_fds(SET_VRING_ENABLE, NEED_REPLY, &state(0, 1), &one);
    r.expect_ack(SET_VRING_ENABLE, 0, "SET_VRING_ENABLE with an fd");
    r.expect_alive(NET_OFFERED, "SET_VRING_ENABLE with an fd");
    drop(r);
    // Every descriptor sent was closed by vhostd.
    net_serves_next(d, &w);
}

#[test]
fn a_message_with_more_fds_than_vhostd_takes_is_refused() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let many: Vec<OwnedFd> = (0..40).map(|_| eventfd()).collect();
    let raw: Vec<RawFd> = many.iter().map(|e| e.as_raw_fd()).collect();
    let mut wrong = Vec::new();
    // GET_FEATURES with 40 fds: it must be answered or the connection
    // closed, not ignored.
    let mut r = Raw::net(&d);
    r.send_fds(GET_FEATURES, 0, &[], &raw);
    let g = r.recv(REPLY_T);
    if g == Got::Nothing {
        wrong.push("GET_FEATURES with 40 fds: neither answered nor closed".to_string());
    }
    drop(r);
    // SET_FEATURES with 40 fds and a 12-byte payload that is itself a
    // GET_FEATURES header: a refusal closes the connection; vhostd must
    // not run the payload as a request.
    let mut r = Raw::net(&d);
    r.send_fds(SET_FEATURES, 0, &vhost_user_msg(GET_FEATURES, 0, &[]), &raw);
    let g = r.recv(REPLY_T);
    if g != Got::Closed {
        wrong.push(format!("SET_FEATURES with 40 fds whose payload is a GET_FEATURES header: got {g:?}"));
    }
    drop(r);
    net_serves_next(d, &w);
    assert!(wrong.is_empty(), "{wrong:#?}");
}

// ---- the memory table -------------------------------------------------------

#[test]
fn overlapping_memory_regions_are_refused() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mem = memfd(4 * MIB);
    let fd = mem.as_raw_fd();
    let mut r = Raw::net(&d);
    let a = reg(0, 2 * MIB, UADDR, 0);
    let tables: [(&str, [Reg; 2]); 3] = [
        ("guest addresses overlap", [a, reg(MIB, 2 * MIB, UADDR + 16 * MIB, 2 * MIB)]),
        ("frontend addresses overlap", [a, reg(16 * MIB, 2 * MIB, UADDR + MIB, 2 * MIB)]),
        ("the same region twice", [a, a]),
    ];
    for (what, regions) in tables {
        r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&regions), &[fd, fd]);
        r.expect_ack(SET_MEM_TABLE, 1, what);
        r.expect_alive(NET_OFFERED, what);
    }
    w.maps_now(0);
    // ADD_MEM_REG: the first fits, overlapping ones are refused.
    r.send_fds(ADD_MEM_REG, NEED_REPLY, &single_region(a), &[fd]);
    r.expect_ack(ADD_MEM_REG, 0, "ADD_MEM_REG of a first region");
    for (what, b) in [
        ("ADD_MEM_REG overlapping in guest addresses", reg(MIB, 2 * MIB, UADDR + 16 * MIB, 2 * MIB)),
        ("ADD_MEM_REG overlapping in frontend addresses", reg(16 * MIB, 2 * MIB, UADDR + MIB, 2 * MIB)),
        ("ADD_MEM_REG of a region inside the first", reg(MIB, MIB / 2, UADDR + MIB, MIB)),
    ] {
        r.send_fds(ADD_MEM_REG, NEED_REPLY, &single_region(b), &[fd]);
        r.expect_ack(ADD_MEM_REG, 1, what);
    }
    w.maps_now(1);
    // A good table replaces it all.
    r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[a, reg(2 * MIB, 2 * MIB, UADDR + 2 * MIB, 2 * MIB)]), &[fd, fd]);
    r.expect_ack(SET_MEM_TABLE, 0, "two adjacent regions");
    w.maps_now(2);
    drop(r);
    net_serves_next(d, &w);
}

#[test]
fn regions_past_the_end_of_their_memfd_or_of_zero_size_are_refused() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mem = memfd(MIB);
    let fd = mem.as_raw_fd();
    let mut r = Raw::net(&d);
    let past_end = [
        ("a 2 MiB region of a 1 MiB memfd", reg(0, 2 * MIB, UADDR, 0)),
        ("offset one page, size the whole memfd", reg(0, MIB, UADDR, 4096)),
        ("offset 100 (not page aligned), size the whole memfd", reg(0, MIB - 4096, UADDR, 4096 + 100)),
        ("offset past the end", reg(0, 4096, UADDR, 2 * MIB)),
    ];
    for (what, g) in past_end {
        r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[g]), &[fd]);
        r.expect_ack(SET_MEM_TABLE, 1, &format!("SET_MEM_TABLE: {what}"));
        r.send_fds(ADD_MEM_REG, NEED_REPLY, &single_region(g), &[fd]);
        r.expect_ack(ADD_MEM_REG, 1, &format!("ADD_MEM_REG: {what}"));
    }
    // A zero-size region through ADD_MEM_REG: refused, the connection lives.
    r.send_fds(ADD_MEM_REG, NEED_REPLY, &single_region(reg(0, 0, UADDR, 0)), &[fd]);
    r.expect_ack(ADD_MEM_REG, 1, "ADD_MEM_REG of 0 bytes");
    w.maps_now(0);
    // The exact end is fine.
    r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[reg(0, MIB - 4096, UADDR, 4096)]), &[fd]);
    r.expect_ack(SET_MEM_TABLE, 0, "a region ending at the end of its memfd");
    w.maps_now(1);
    // A zero-size region in SET_MEM_TABLE: refused and closed.
    r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[reg(0, 0, UADDR, 0)]), &[fd]);
    r.expect_ack(SET_MEM_TABLE, 1, "SET_MEM_TABLE with a 0-byte region");
    r.expect_closed("SET_MEM_TABLE with a 0-byte region");
    net_serves_next(d, &w);
}

/// Fills every memory slot vhostd declares, then one more.
fn mem_slots_case(d: Daemon) {
    let w = Watch::new(&d);
    let pages = MAX_MEM_SLOTS + 1;
    let mem = memfd(pages * 4096);
    let fd = mem.as_raw_fd();
    let page = |i: u64| reg(i * 8192, 4096, UADDR + i * 8192, i * 4096);
    let mut r = Raw::net(&d);
    r.send(GET_MAX_MEM_SLOTS, 0, &[]);
    assert_eq!(r.reply_u64(GET_MAX_MEM_SLOTS, "GET_MAX_MEM_SLOTS"), MAX_MEM_SLOTS);
    for i in 0..MAX_MEM_SLOTS {
        r.send_fds(ADD_MEM_REG, NEED_REPLY, &single_region(page(i)), &[fd]);
        r.expect_ack(ADD_MEM_REG, 0, &format!("region {i} of {MAX_MEM_SLOTS}"));
    }
    w.maps_now(MAX_MEM_SLOTS as usize);
    r.send_fds(ADD_MEM_REG, NEED_REPLY, &single_region(page(MAX_MEM_SLOTS)), &[fd]);
    r.expect_ack(ADD_MEM_REG, 1, "one region more than GET_MAX_MEM_SLOTS");
    w.maps_now(MAX_MEM_SLOTS as usize);
    // Freeing a slot makes room for exactly one.
    r.accepted(REM_MEM_REG, &single_region(page(7)), "REM_MEM_REG of region 7");
    r.send_fds(ADD_MEM_REG, NEED_REPLY, &single_region(page(MAX_MEM_SLOTS)), &[fd]);
    r.expect_ack(ADD_MEM_REG, 0, "the region again after a REM_MEM_REG");
    r.refused(REM_MEM_REG, &single_region(page(7)), "REM_MEM_REG of a region already removed");
    w.maps_now(MAX_MEM_SLOTS as usize);
    // SET_MEM_TABLE carries at most 32 regions (the fds one message holds).
    let regions: Vec<Reg> = (0..33).map(page).collect();
    let fds = vec![fd; 32];
    r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&regions), &fds);
    r.expect_ack(SET_MEM_TABLE, 1, "SET_MEM_TABLE with 33 regions");
    r.expect_closed("SET_MEM_TABLE with 33 regions");
    // All 509 mappings went with the connection.
    net_serves_next(d, &w);
}

#[test]
fn more_regions_than_the_slots_vhostd_declared() {
    // Without the seccomp filter: see the next test for why.
    mem_slots_case(Daemon::start(&["--backend", "loopback", "--seccomp", "off"]));
}

#[test]
fn more_regions_than_the_slots_vhostd_declared_under_seccomp() {
    mem_slots_case(net_daemon());
}

// ---- rings --------------------------------------------------------------------

#[test]
fn vring_requests_for_queues_that_do_not_exist() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mem = memfd(MIB);
    let mut r = Raw::net(&d);
    r.send(GET_QUEUE_NUM, 0, &[]);
    assert_eq!(r.reply_u64(GET_QUEUE_NUM, "GET_QUEUE_NUM"), 3, "one pair and the control queue");
    r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[reg(0, MIB, UADDR, 0)]), &[mem.as_raw_fd()]);
    r.expect_ack(SET_MEM_TABLE, 0, "SET_MEM_TABLE");
    let addr = |i| vring_addr(i, UADDR, UADDR + 8192, UADDR + 4096);
    for index in [3u32, 4, 255, 256, 0x8000_0000, u32::MAX] {
        r.refused(SET_VRING_NUM, &state(index, 64), &format!("SET_VRING_NUM {index}"));
        r.refused(SET_VRING_ADDR, &addr(index), &format!("SET_VRING_ADDR {index}"));
        r.refused(SET_VRING_BASE, &state(index, 0), &format!("SET_VRING_BASE {index}"));
        r.refused(SET_VRING_ENABLE, &state(index, 1), &format!("SET_VRING_ENABLE {index}"));
    }
    // KICK/CALL/ERR carry an 8-bit index.
    for index in [3u64, 4, 255] {
        for (what, code) in
            [("SET_VRING_KICK", SET_VRING_KICK), ("SET_VRING_CALL", SET_VRING_CALL), ("SET_VRING_ERR", SET_VRING_ERR)]
        {
            let e = eventfd();
            r.send_fds(code, NEED_REPLY, &u64b(index), &[e.as_raw_fd()]);
            r.expect_ack(code, 1, &format!("{what} {index} with an fd"));
            r.refused(code, &u64b(index | NO_FD), &format!("{what} {index} without an fd"));
        }
    }
    // Queue 2 exists (GET_QUEUE_NUM counts the control queue) though
    // CTRL_VQ was not acked: accepted, never run.
    r.accepted(SET_VRING_NUM, &state(2, 64), "SET_VRING_NUM 2");
    r.accepted(SET_VRING_ENABLE, &state(2, 1), "SET_VRING_ENABLE 2");
    r.expect_alive(NET_OFFERED, "after requests for missing queues");
    drop(r);
    net_serves_next(d, &w);

    // blk: one request queue.
    let d = blk_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::blk(&d);
    r.send(GET_QUEUE_NUM, 0, &[]);
    assert_eq!(r.reply_u64(GET_QUEUE_NUM, "GET_QUEUE_NUM"), 1);
    for index in [1u32, 2, 255, u32::MAX] {
        r.refused(SET_VRING_NUM, &state(index, 64), &format!("blk SET_VRING_NUM {index}"));
        r.refused(SET_VRING_ADDR, &addr(index), &format!("blk SET_VRING_ADDR {index}"));
        r.refused(SET_VRING_BASE, &state(index, 0), &format!("blk SET_VRING_BASE {index}"));
        r.refused(SET_VRING_ENABLE, &state(index, 1), &format!("blk SET_VRING_ENABLE {index}"));
    }
    for index in [1u64, 255] {
        let e = eventfd();
        r.send_fds(SET_VRING_CALL, NEED_REPLY, &u64b(index), &[e.as_raw_fd()]);
        r.expect_ack(SET_VRING_CALL, 1, &format!("blk SET_VRING_CALL {index}"));
        r.refused(SET_VRING_KICK, &u64b(index | NO_FD), &format!("blk SET_VRING_KICK {index}"));
    }
    r.expect_alive(BLK_OFFERED, "blk after requests for missing queues");
    drop(r);
    blk_serves_next(d, &w);
}

#[test]
fn get_vring_base_of_a_queue_that_does_not_exist_is_answered() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::net(&d);
    r.send(GET_VRING_BASE, 0, &state(3, 0));
    let g = r.recv(REPLY_T);
    assert_ne!(g, Got::Nothing, "GET_VRING_BASE 3: neither answered nor closed");
    drop(r);
    net_serves_next(d, &w);
}

#[test]
fn refused_requests_that_expect_a_reply_are_answered_or_closed() {
    let d = net_daemon();
    let w = Watch::new(&d);
    // Protocol features: REPLY_ACK only.
    let cases: &[(&str, u32, u32, Vec<u8>)] = &[
        ("GET_QUEUE_NUM without MQ", GET_QUEUE_NUM, 0, vec![]),
        ("GET_CONFIG without CONFIG", GET_CONFIG, 0, config(0, 12, 0, &[0; 12])),
        ("GET_MAX_MEM_SLOTS without CONFIGURE_MEM_SLOTS", GET_MAX_MEM_SLOTS, 0, vec![]),
        ("RESET_DEVICE (NEED_REPLY) without RESET_DEVICE", RESET_DEVICE, NEED_REPLY, vec![]),
        ("SET_CONFIG (NEED_REPLY) without CONFIG", SET_CONFIG, NEED_REPLY, config(0, 6, 0, &[0; 6])),
        ("GET_INFLIGHT_FD on net (INFLIGHT_SHMFD not offered)", GET_INFLIGHT_FD, 0, vec![0; 24]),
    ];
    let mut hung = Vec::new();
    for (what, code, flags, body) in cases {
        let mut r = Raw::connect(&d);
        r.handshake(f::VERSION_1, PF_REPLY_ACK);
        r.send(*code, *flags, body);
        if r.recv(REPLY_T) == Got::Nothing {
            hung.push(*what);
        }
    }
    net_serves_next(d, &w);
    // blk: GET_INFLIGHT_FD for more queues than the device has.
    let d = blk_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::blk(&d);
    r.send(GET_INFLIGHT_FD, 0, &inflight(0, 2, 128));
    if r.recv(REPLY_T) == Got::Nothing {
        hung.push("blk GET_INFLIGHT_FD for 2 queues of a 1-queue device");
    }
    drop(r);
    blk_serves_next(d, &w);
    assert!(hung.is_empty(), "neither answered nor closed: {hung:?}");
}

/// A connection with pair 0 running on a split or packed ring, and a raw
/// handle on the same stream (the frontend waits for each ack, so raw
/// requests in between are answered in order).
fn pair_with_raw(d: &Daemon, packed: bool) -> (VirtioUser, Raw, vhostd_user::RxQueue, vhostd_user::TxQueue) {
    let sock = UnixStream::connect(&d.sock).unwrap();
    let raw = Raw { s: sock.try_clone().unwrap() };
    let mut opts = d.options();
    if packed {
        opts.features |= f::RING_PACKED;
        opts.required |= f::RING_PACKED;
    }
    let mut dev = VirtioUser::from_stream(sock, opts).unwrap();
    assert_eq!(dev.packed(), packed);
    let (rx, tx) = dev.net_queue_pair(0, 64).unwrap();
    (dev, raw, rx, tx)
}

/// Sends `n` frames on `tx` and waits until the device took them all.
fn send_frames(tx: &mut vhostd_user::TxQueue, first: u32, n: u32) {
    let done = tx.stats.packets + n as u64;
    for i in 0..n {
        assert!(tx.send_frame(&frame(first + i, 100)).unwrap());
    }
    tx.flush().unwrap();
    assert!(
        wait_until(T, || {
            tx.reclaim().unwrap();
            tx.stats.packets == done
        }),
        "the device took {} of {done} frames",
        tx.stats.packets
    );
}

#[test]
fn nonsense_vring_bases_are_refused() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let (dev, mut r, mut rx, mut tx) = pair_with_raw(&d, true);
    send_frames(&mut tx, 0, 10);
    let mut back = 0;
    assert!(wait_until(T, || {
        rx.recv_burst(64, |_| back += 1).unwrap();
        back == 10
    }));
    // The ring's position: avail = used = slot 10, wrap counters 1.
    const GOOD: u32 = 0x800a_800a;
    r.send(GET_VRING_BASE, 0, &state(1, 0));
    assert_eq!(r.reply(GET_VRING_BASE, "GET_VRING_BASE"), state(1, GOOD));
    r.accepted(SET_VRING_KICK, &u64b(1 | NO_FD), "restarting the ring");
    // Indexes past the ring (64 slots) in either half.
    for (what, base) in [
        ("avail index 64 of a 64-slot ring", 0x8040u32),
        ("avail index 0x7fff", 0xffff),
        ("used index 64", 0x8040_8000),
        ("used index 0x7fff, wrap 0", 0x7fff_8000),
    ] {
        // On the running ring: refused, the ring stops.
        r.refused(SET_VRING_BASE, &state(1, base), what);
        r.send(GET_VRING_BASE, 0, &state(1, 0));
        assert_eq!(r.reply(GET_VRING_BASE, what), state(1, base), "{what}: the base is kept as sent");
        // On a stopped ring: accepted, refused when the ring starts.
        r.accepted(SET_VRING_BASE, &state(1, base), what);
        r.refused(SET_VRING_KICK, &u64b(1 | NO_FD), &format!("starting the ring at {what}"));
        // A good base lets it start again.
        r.accepted(SET_VRING_BASE, &state(1, GOOD), "the good base again");
    }
    drop((rx, tx, dev, r));
    w.settled();
    // A split ring takes 16 bits of base.
    let (dev, mut r, rx, tx) = pair_with_raw(&d, false);
    r.refused(SET_VRING_BASE, &state(1, 0x1_0000), "split ring base 0x10000");
    r.refused(SET_VRING_BASE, &state(1, 0x8000_0005), "split ring base 0x80000005");
    r.accepted(SET_VRING_BASE, &state(1, 5), "split ring base 5");
    drop((rx, tx, dev, r));
    w.settled();
    net_works(&d, &w, 100);
    stop_net(d, 10 + NET_FRAMES as u64);
}

#[test]
fn a_packed_base_with_used_ahead_of_avail_is_refused() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let (dev, mut r, rx, tx) = pair_with_raw(&d, true);
    // avail: slot 0, wrap 1; used: slot 5, wrap 1 -> 123 chains "in flight"
    // in a ring of 64.
    r.refused(SET_VRING_BASE, &state(1, 0x8005_8000), "used 5 ahead of avail 0 in the same lap");
    // avail: slot 3, wrap 0; used: slot 3, wrap 1 -> -64 in flight.
    r.refused(SET_VRING_BASE, &state(1, 0x8003_0003), "used a lap ahead of avail");
    drop((rx, tx, dev, r));
    net_serves_next(d, &w);
}

#[test]
fn renegotiating_features_does_not_strand_running_rings() {
    let d = Daemon::start(&["--backend", "loopback", "--queues", "2"]);
    let w = Watch::new(&d);
    let mut dev = d.connect();
    assert_ne!(dev.features() & f::NET_MQ, 0);
    let (mut rx, mut tx) = dev.net_queue_pair(1, 64).unwrap();
    send_frames(&mut tx, 0, 10);
    // Features again, without MQ: pair 1 no longer exists.
    let without_mq = dev.features() & !f::NET_MQ;
    dev.frontend().set_features(without_mq).expect("SET_FEATURES without MQ");
    // GET_VRING_BASE stops ring 3 where it is...
    assert_eq!(dev.get_vring_base(3).unwrap(), 10, "GET_VRING_BASE 3 after SET_FEATURES without MQ");
    // ... so frames made available afterwards are not taken.
    for i in 0..5 {
        assert!(tx.send_frame(&frame(100 + i, 100)).unwrap());
    }
    tx.flush().unwrap();
    assert!(
        !wait_until(Duration::from_millis(500), || {
            tx.reclaim().unwrap();
            tx.stats.packets > 10
        }),
        "a stopped ring was processed"
    );
    drop(dev);
    // The session is gone: nothing of it may stay mapped.
    let sock = d.sock.clone();
    within("the next frontend", move || net_traffic(sock, 1000));
    w.maps_now(0);
    rx.recv_burst(64, |_| {}).unwrap();
    drop((rx, tx));
    w.settled();
    stop_net(d, 10 + NET_FRAMES as u64);
}

// ---- order, codes and headers ------------------------------------------------

#[test]
fn messages_before_set_owner_are_served() {
    // SET_OWNER is a "session start" hint in vhost-user.rst; vhostd serves
    // a frontend that never sends it (Session::owner is not consulted).
    let d = net_daemon();
    let w = Watch::new(&d);
    let mem = memfd(MIB);
    let mut r = Raw::connect(&d);
    r.send(GET_FEATURES, 0, &[]);
    assert_eq!(r.reply_u64(GET_FEATURES, "GET_FEATURES before SET_OWNER"), NET_OFFERED);
    r.send(GET_PROTOCOL_FEATURES, 0, &[]);
    assert_eq!(r.reply_u64(GET_PROTOCOL_FEATURES, "GET_PROTOCOL_FEATURES before SET_OWNER"), NET_PROTOCOL);
    r.accepted(SET_PROTOCOL_FEATURES, &u64b(NET_PROTOCOL), "SET_PROTOCOL_FEATURES before SET_OWNER");
    r.accepted(SET_FEATURES, &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES), "SET_FEATURES before SET_OWNER");
    r.send_fds(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[reg(0, MIB, UADDR, 0)]), &[mem.as_raw_fd()]);
    r.expect_ack(SET_MEM_TABLE, 0, "SET_MEM_TABLE before SET_OWNER");
    r.send(GET_QUEUE_NUM, 0, &[]);
    assert_eq!(r.reply_u64(GET_QUEUE_NUM, "GET_QUEUE_NUM before SET_OWNER"), 3);
    r.accepted(SET_VRING_NUM, &state(0, 64), "SET_VRING_NUM before SET_OWNER");
    w.maps_now(1);
    drop(r);
    net_serves_next(d, &w);
}

#[test]
fn unknown_and_unserved_request_codes_close_the_connection() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let e = eventfd();
    let cases: &[(&str, u32, Vec<u8>, bool)] = &[
        ("request 0", 0, vec![], false),
        ("request 45", 45, vec![], false),
        ("request 46", 46, u64b(0), false),
        ("request 1000", 1000, vec![], false),
        ("request 0xffffffff", u32::MAX, vec![], false),
        ("SET_LOG_FD", SET_LOG_FD, vec![], true),
        ("NET_SET_MTU", NET_SET_MTU, u64b(9000), false),
        ("IOTLB_MSG", IOTLB_MSG, vec![0; 40], false),
        ("SET_VRING_ENDIAN", SET_VRING_ENDIAN, state(0, 1), false),
        ("POSTCOPY_ADVISE", POSTCOPY_ADVISE, vec![], false),
        ("VRING_KICK (in-band, not negotiated)", VRING_KICK, state(0, 0), false),
    ];
    for (what, code, body, with_fd) in cases {
        let mut r = Raw::net(&d);
        let fds: &[RawFd] = if *with_fd { &[e.as_raw_fd()] } else { &[] };
        r.send_fds(*code, NEED_REPLY, body, fds);
        r.expect_closed(what);
        w.alive();
    }
    // Headers the generic parser refuses: version 0, 2, 3, the reply
    // flag on a request, reserved flag bits.
    for (what, flags) in [
        ("version 0", 0u32),
        ("version 2", 2),
        ("version 3", 3),
        ("reply flag", 1 | REPLY),
        ("reserved flag bit 4", 1 | 0x10),
        ("reserved flag bit 31", 1 | 1 << 31),
    ] {
        let mut r = Raw::net(&d);
        let mut msg = vhost_user_msg(GET_FEATURES, 0, &[]);
        msg[4..8].copy_from_slice(&flags.to_le_bytes());
        r.send_bytes(&msg, &[]);
        r.expect_closed(&format!("GET_FEATURES with {what}"));
    }
    net_serves_next(d, &w);
}

#[test]
fn vhostds_own_requests_check_their_headers() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mut accepted = Vec::new();
    for (name, code, body) in [
        ("SET_STATUS", SET_STATUS, u64b(1)),
        ("GET_STATUS", GET_STATUS, vec![]),
        ("SET_VRING_ENABLE", SET_VRING_ENABLE, state(0, 1)),
    ] {
        for (what, flags) in
            [("version 0", 0u32), ("version 2", 2), ("reply flag", 1 | REPLY), ("reserved flag bit 4", 1 | 0x10)]
        {
            let mut r = Raw::net(&d);
            let mut msg = vhost_user_msg(code, 0, &body);
            msg[4..8].copy_from_slice(&flags.to_le_bytes());
            r.send_bytes(&msg, &[]);
            if code == GET_STATUS {
                if r.recv(REPLY_T) != Got::Closed {
                    accepted.push(format!("{name} with {what}"));
                }
                continue;
            }
            // Followed by GET_FEATURES: a refusing vhostd has closed.
            r.send(GET_FEATURES, 0, &[]);
            if r.recv(REPLY_T) != Got::Closed {
                accepted.push(format!("{name} with {what}"));
            }
        }
    }
    net_serves_next(d, &w);
    assert!(accepted.is_empty(), "served despite a bad header: {accepted:?}");
}

// ---- frontends that vanish, or come by the hundred --------------------------------

#[test]
fn a_frontend_that_disconnects_mid_message_while_rings_run() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mem = memfd(MIB);
    let mut seq = 0;
    // Partial SET_MEM_TABLE (with its fd), partial SET_VRING_ADDR, 7 bytes of
    // a header: each time with traffic flowing on a running pair.
    let table = vhost_user_msg(SET_MEM_TABLE, NEED_REPLY, &mem_table(&[reg(0, MIB, UADDR, 0)]));
    let addr = vhost_user_msg(SET_VRING_ADDR, NEED_REPLY, &vring_addr(1, UADDR, UADDR + 8192, UADDR + 4096));
    let cases: [(&str, &[u8], &[RawFd]); 3] = [
        ("SET_MEM_TABLE", &table[..30], &[mem.as_raw_fd()]),
        ("SET_VRING_ADDR", &addr[..20], &[]),
        ("a header", &addr[..7], &[]),
    ];
    for (_what, bytes, fds) in cases {
        let sock = UnixStream::connect(&d.sock).unwrap();
        let mut r = Raw { s: sock.try_clone().unwrap() };
        let mut dev = VirtioUser::from_stream(sock, d.options()).unwrap();
        let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
        send_frames(&mut tx, seq, 20);
        let mut back = 0;
        assert!(wait_until(T, || {
            rx.recv_burst(64, |_| back += 1).unwrap();
            back == 20
        }));
        seq += 20;
        w.maps_now(1);
        r.send_bytes(bytes, fds);
        drop((rx, tx, dev, r));
        w.settled();
    }
    net_works(&d, &w, 1000);
    stop_net(d, seq as u64 + NET_FRAMES as u64);
}

#[test]
fn many_connections_opened_and_closed_quickly() {
    let d = net_daemon();
    let w = Watch::new(&d);
    for i in 0..300u32 {
        let mut r = Raw::connect(&d);
        match i % 4 {
            0 => {}
            1 => r.send_bytes(&vhost_user_msg(GET_FEATURES, 0, &[])[..7], &[]),
            2 => {
                r.send(SET_OWNER, 0, &[]);
                r.send(GET_FEATURES, 0, &[]);
                assert_eq!(r.reply_u64(GET_FEATURES, "GET_FEATURES"), NET_OFFERED);
            }
            _ => {
                let e = eventfd();
                r.send(SET_OWNER, 0, &[]);
                r.send_fds(SET_VRING_CALL, 0, &u64b(0), &[e.as_raw_fd()]);
            }
        }
    }
    // Fifty at once, then all gone.
    let held: Vec<Raw> = (0..50).map(|_| Raw::connect(&d)).collect();
    drop(held);
    net_serves_next(d, &w);
}

// ---- the config space ---------------------------------------------------------

/// GET_CONFIG of `size` bytes at `offset`: the reply's payload (after the
/// 12-byte config header, which must echo offset, the returned size, flags 0).
fn get_config(r: &mut Raw, offset: u32, size: u32) -> Vec<u8> {
    r.send(GET_CONFIG, 0, &config(offset, size, 0, &vec![0; size as usize]));
    let body = r.reply(GET_CONFIG, &format!("GET_CONFIG {offset}+{size}"));
    assert!(body.len() >= 12);
    let n = u32::from_le_bytes(body[4..8].try_into().unwrap()) as usize;
    assert_eq!(body[..12], config(offset, n as u32, 0, &[])[..], "GET_CONFIG {offset}+{size}: header");
    assert_eq!(body.len(), 12 + n);
    body[12..].to_vec()
}

#[test]
fn get_config_past_the_config_space() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::net(&d);
    // mac, status (link up), max_virtqueue_pairs 1, mtu 1500.
    let full = [GUEST_MAC.to_vec(), vec![1, 0, 1, 0], 1500u16.to_le_bytes().to_vec()].concat();
    assert_eq!(get_config(&mut r, 0, 12), full);
    assert_eq!(get_config(&mut r, 6, 6), full[6..]);
    // Past the 12 bytes: the error reply (no payload).
    for (offset, size) in [(8, 8), (12, 4), (0, 13), (100, 4), (4092, 4)] {
        assert_eq!(get_config(&mut r, offset, size), Vec::<u8>::new(), "GET_CONFIG {offset}+{size}");
    }
    r.expect_alive(NET_OFFERED, "GET_CONFIG out of range");
    drop(r);
    // Past the protocol's 4 KiB config limit, empty, overflowing, or a size
    // field that disagrees with the payload: closed.
    for (what, body) in [
        ("offset 4094, size 4", config(4094, 4, 0, &[0; 4])),
        ("size 0", config(0, 0, 0, &[])),
        ("offset + size overflowing", config(u32::MAX - 3, 8, 0, &[0; 8])),
        ("size 12, 4 bytes of payload", config(0, 12, 0, &[0; 4])),
        ("flags 4 (undefined)", config(0, 12, 4, &[0; 12])),
    ] {
        let mut r = Raw::net(&d);
        r.send(GET_CONFIG, 0, &body);
        r.expect_closed(&format!("GET_CONFIG: {what}"));
    }
    net_serves_next(d, &w);

    // blk: 60 bytes of config; reads past them within 4 KiB are zeros
    // (QEMU asks for its own, larger struct).
    let d = blk_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::blk(&d);
    let cfg = get_config(&mut r, 0, 60);
    assert_eq!(cfg[0..8], BLK_SECTORS.to_le_bytes());
    assert_eq!(cfg[32], 1, "writeback");
    assert_eq!(get_config(&mut r, 56, 8), [cfg[56..60].to_vec(), vec![0; 4]].concat());
    assert_eq!(get_config(&mut r, 60, 4), vec![0; 4]);
    assert_eq!(get_config(&mut r, 4000, 96), vec![0; 96]);
    drop(r);
    let mut r = Raw::blk(&d);
    r.send(GET_CONFIG, 0, &config(4095, 2, 0, &[0; 2]));
    r.expect_closed("blk GET_CONFIG offset 4095, size 2");
    blk_serves_next(d, &w);
}

#[test]
fn set_config_writes_other_than_the_cache_mode_are_refused() {
    let d = blk_daemon();
    let w = Watch::new(&d);
    let pristine = {
        let mut r = Raw::blk(&d);
        get_config(&mut r, 0, 60)
    };
    let mut r = Raw::blk(&d);
    for (what, offset, data) in [
        ("capacity", 0u32, vec![0xffu8; 8]),
        ("size_max", 8, vec![0; 4]),
        ("num_queues", 34, vec![4, 0]),
        ("writeback = 2", 32, vec![2]),
        ("writeback and its neighbour", 32, vec![0, 0]),
        ("the byte after writeback", 33, vec![0]),
        ("past the config space", 60, vec![0; 4]),
    ] {
        r.refused(SET_CONFIG, &config(offset, data.len() as u32, 0, &data), &format!("SET_CONFIG {what}"));
    }
    assert_eq!(get_config(&mut r, 0, 60), pristine, "the config space is unchanged");
    // The cache mode is the writable field: write-through, then back.
    r.accepted(SET_CONFIG, &config(32, 1, 0, &[0]), "SET_CONFIG writeback = 0");
    assert_eq!(get_config(&mut r, 32, 1), vec![0]);
    r.accepted(SET_CONFIG, &config(32, 1, 0, &[1]), "SET_CONFIG writeback = 1");
    assert_eq!(get_config(&mut r, 0, 60), pristine);
    drop(r);
    // Without CONFIG_WCE acked, not even the cache mode.
    let mut r = Raw::connect(&d);
    r.handshake(f::VERSION_1, BLK_PROTOCOL);
    r.refused(SET_CONFIG, &config(32, 1, 0, &[0]), "SET_CONFIG writeback without CONFIG_WCE");
    assert_eq!(get_config(&mut r, 0, 60), pristine);
    drop(r);
    // Past 4 KiB: an error ack, then closed.
    let mut r = Raw::blk(&d);
    r.send(SET_CONFIG, NEED_REPLY, &config(4095, 2, 0, &[0; 2]));
    r.expect_ack(SET_CONFIG, 1, "SET_CONFIG at 4095+2");
    r.expect_closed("SET_CONFIG at 4095+2");
    blk_serves_next(d, &w);

    // virtio-net's config space is read-only for the driver.
    let d = net_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::net(&d);
    r.refused(SET_CONFIG, &config(0, 6, 0, &[2, 0, 0, 0, 0, 0x66]), "net SET_CONFIG of the MAC");
    r.refused(SET_CONFIG, &config(6, 2, 1, &[0, 0]), "net SET_CONFIG of the status (migration flag)");
    assert_eq!(get_config(&mut r, 0, 6), GUEST_MAC.to_vec());
    drop(r);
    net_serves_next(d, &w);
}

// ---- features ---------------------------------------------------------------

#[test]
fn set_features_with_features_not_offered_is_refused() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::connect(&d);
    r.send(SET_OWNER, 0, &[]);
    r.send(GET_FEATURES, 0, &[]);
    assert_eq!(r.reply_u64(GET_FEATURES, "GET_FEATURES"), NET_OFFERED);
    r.accepted(SET_PROTOCOL_FEATURES, &u64b(NET_PROTOCOL), "SET_PROTOCOL_FEATURES");
    for (what, bits) in [
        ("every bit", u64::MAX),
        ("bit 63", NET_OFFERED | 1 << 63),
        ("GUEST_TSO4 (loopback offers no offloads)", f::VERSION_1 | f::PROTOCOL_FEATURES | f::NET_GUEST_TSO4),
        ("HOST_TSO4", f::VERSION_1 | f::PROTOCOL_FEATURES | f::NET_HOST_TSO4),
        ("CSUM", f::VERSION_1 | f::PROTOCOL_FEATURES | f::NET_CSUM),
    ] {
        r.refused(SET_FEATURES, &u64b(bits), &format!("SET_FEATURES with {what}"));
    }
    // The connection goes on with a good set.
    r.accepted(SET_FEATURES, &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES), "SET_FEATURES offered");
    r.expect_alive(NET_OFFERED, "after refused SET_FEATURES");
    drop(r);
    net_serves_next(d, &w);

    let d = blk_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::blk(&d);
    for (what, bits) in [("IN_ORDER", f::IN_ORDER), ("BLK_RO", f::BLK_RO), ("NET_MRG_RXBUF (bit 15)", 1 << 15)] {
        r.refused(
            SET_FEATURES,
            &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES | bits),
            &format!("blk SET_FEATURES with {what}"),
        );
    }
    r.expect_alive(BLK_OFFERED, "blk after refused SET_FEATURES");
    drop(r);
    blk_serves_next(d, &w);
}

#[test]
fn set_protocol_features_with_unknown_bits_is_refused() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let mut r = Raw::connect(&d);
    r.send(SET_OWNER, 0, &[]);
    r.send(GET_FEATURES, 0, &[]);
    assert_eq!(r.reply_u64(GET_FEATURES, "GET_FEATURES"), NET_OFFERED);
    r.send(GET_PROTOCOL_FEATURES, 0, &[]);
    assert_eq!(r.reply_u64(GET_PROTOCOL_FEATURES, "GET_PROTOCOL_FEATURES"), NET_PROTOCOL);
    // REPLY_ACK in each set, so the refusal is acknowledged.
    for (what, bits) in [
        ("bit 40", PF_REPLY_ACK | 1 << 40),
        ("bit 63", PF_REPLY_ACK | 1 << 63),
        ("every bit", u64::MAX),
        ("BACKEND_REQ (not offered)", PF_REPLY_ACK | PF_BACKEND_REQ),
        ("INFLIGHT_SHMFD on net", PF_REPLY_ACK | PF_INFLIGHT_SHMFD),
    ] {
        r.refused(SET_PROTOCOL_FEATURES, &u64b(bits), &format!("SET_PROTOCOL_FEATURES with {what}"));
    }
    r.accepted(SET_PROTOCOL_FEATURES, &u64b(NET_PROTOCOL), "SET_PROTOCOL_FEATURES offered");
    r.accepted(SET_FEATURES, &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES), "SET_FEATURES");
    r.send(GET_STATUS, 0, &[]);
    assert_eq!(r.reply_u64(GET_STATUS, "GET_STATUS"), 0);
    r.accepted(SET_STATUS, &u64b(0x0f), "SET_STATUS");
    r.send(GET_STATUS, 0, &[]);
    assert_eq!(r.reply_u64(GET_STATUS, "GET_STATUS"), 0x0f);
    drop(r);
    net_serves_next(d, &w);
}

// ---- guest memory that goes away, frontends that stall -------------------------

#[test]
fn a_memfd_shrunk_under_running_rings_does_not_kill_vhostd() {
    let d = net_daemon();
    let w = Watch::new(&d);
    // A memfd vhostd cannot seal (made without MFD_ALLOW_SEALING), so the
    // shrink goes through: vhostd replaces the mapping with zero pages when
    // it faults, the ring breaks, the daemon lives.
    let mut dev = VirtioUser::connect(Options { sealable_memory: false, ..d.options() }).unwrap();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    send_frames(&mut tx, 0, 16);
    let mut back = 0;
    assert!(wait_until(T, || {
        rx.recv_burst(64, |_| back += 1).unwrap();
        back == 16
    }));
    // From here on this process must not touch the guest memory either.
    dev.memory().file().set_len(0).unwrap();
    tx.queue.kick().unwrap();
    if wait_until(Duration::from_secs(2), || ended(d.pid()).is_some()) {
        panic!("vhostd {} after the guest memory shrank", ended(d.pid()).unwrap());
    }
    drop((rx, tx, dev));
    w.settled();
    net_works(&d, &w, 1000);
    let s = d.stop();
    assert_eq!(s.total("guest_tx_packets"), 16 + NET_FRAMES as u64);
}

#[test]
fn a_shrunk_inflight_memfd_does_not_kill_vhostd() {
    let d = blk_daemon();
    let w = Watch::new(&d);
    let sock = d.sock.clone();
    let pid = d.pid();
    within("blk frontend with a shrunk inflight memfd", move || {
        let mut opts = Options::blk(&sock);
        opts.protocol_features |= VhostUserProtocolFeatures::INFLIGHT_SHMFD;
        let mut dev = VirtioUser::connect(opts).unwrap();
        let ask = VhostUserInflight { mmap_size: 0, mmap_offset: 0, num_queues: 1, queue_size: 128 };
        let (info, file) = dev.frontend().get_inflight_fd(&ask).expect("GET_INFLIGHT_FD");
        assert!(info.mmap_size > 0);
        // vhostd sealed it: the shrink is refused.
        let e = file.set_len(0).expect_err("the inflight memfd shrank");
        assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
        // The ring starts with the (now empty) inflight region; a request
        // marks its head there.
        let r =
            dev.blk_queue_sized(0, 4, 4096, Some(128)).and_then(|mut q| q.run_one(BlkOp::Read { sector: 0, len: 512 }));
        if let Some(how) = ended(pid) {
            panic!("vhostd {how} after the inflight memfd shrank (request: {r:?})");
        }
        assert_eq!(r.unwrap(), (0, 513), "the read through the (intact) inflight log");
    });
    w.settled();
    blk_works(&d, &w);
    let s = d.stop();
    // blk_works' three reads, one out of range, and the read above.
    assert_eq!((s.queue(0, "reads"), s.queue(0, "out_of_range"), s.queue(0, "get_ids")), (4, 1, 1));
}

#[test]
fn a_frontend_stalled_mid_message_does_not_block_sigterm() {
    // A whole header announcing 8 bytes of payload that never come, and
    // 5 bytes of a header: vhostd waits for the rest in both.
    let msg = vhost_user_msg(SET_FEATURES, NEED_REPLY, &u64b(f::VERSION_1 | f::PROTOCOL_FEATURES));
    let mut stuck = Vec::new();
    for (what, len) in [("a header without its payload", 12), ("5 bytes of a header", 5)] {
        let d = net_daemon();
        let mut r = Raw::net(&d);
        r.send_bytes(&msg[..len], &[]);
        // The connection is still open (vhostd is waiting for the rest).
        assert_eq!(r.recv(Duration::from_millis(200)), Got::Nothing, "{what}");
        if !sigterm_ends_within(&d, Duration::from_secs(5)) {
            stuck.push(what);
            continue;
        }
        drop(r);
        d.stop();
    }
    assert!(stuck.is_empty(), "vhostd did not stop within 5 s of SIGTERM with a frontend stalled after {stuck:?}");
}

#[test]
fn a_frontend_that_never_reads_is_dropped() {
    let d = net_daemon();
    let w = Watch::new(&d);
    let r = Raw::net(&d);
    r.s.set_nonblocking(true).unwrap();
    // GET_FEATURES, never reading the replies: one thread serves every
    // device's frontend, so vhostd must not wait for room to reply. It
    // closes the connection once replies pile up unread (64 KiB).
    let req = vhost_user_msg(GET_FEATURES, 0, &[]);
    let mut sent = 0u64;
    let closed = wait_until(T, || loop {
        match send_with_fds(&r.s, &req, &[]) {
            Ok(12) => sent += 1,
            Ok(n) => panic!("partial send of {n} bytes"),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => return true,
            Err(e) => panic!("send: {e}"),
        }
    });
    assert!(closed, "vhostd kept the connection of a frontend that never reads after {sent} requests");
    // The log is read from vhostd's output by another thread: the line may
    // land a little after the close the test saw.
    assert!(wait_until(T, || d.log().contains("does not read vhostd's replies")), "{}", d.log());
    // The device serves the next frontend, and stops on SIGTERM.
    drop(r);
    net_works(&d, &w, 0);
    assert!(sigterm_ends_within(&d, Duration::from_secs(5)), "vhostd did not stop within 5 s of SIGTERM");
    d.stop();
}
