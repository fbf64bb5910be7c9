//! Shared helpers: start vhostd as a user would, connect the project's
//! frontend to it, parse its counters. Everything is torn down on drop.
#![allow(dead_code)]

use std::collections::HashMap;
use std::ffi::CString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vhostd_user::{Buf, Options, VirtioUser};

/// vhostd's default MAC: the guest side's address in the tests.
pub const GUEST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
/// The EtherType of `frame`s.
pub const ETH_P_TEST: u16 = 0x88b5;
pub const ETH_P_IP: u16 = 0x0800;

/// A running vhostd with its own socket directory.
pub struct Daemon {
    child: Option<Child>,
    log: std::sync::Arc<std::sync::Mutex<String>>,
    dir: PathBuf,
    pub sock: PathBuf,
}

impl Daemon {
    /// Starts `vhostd net --socket-path <tmp> <args>` and waits (bounded)
    /// until it listens.
    pub fn start(args: &[&str]) -> Daemon {
        Daemon::start_in(None, args)
    }

    /// As `start`, with vhostd in network namespace `netns` (if given).
    pub fn start_in(netns: Option<&NetNs>, args: &[&str]) -> Daemon {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        Daemon::start_with(netns, move |sock| {
            let mut v = vec!["net".to_string(), "--socket-path".to_string(), sock.display().to_string()];
            v.extend(args);
            v
        })
    }

    /// Starts `vhostd <argv(socket path)>` in `netns` (if given) and waits
    /// (bounded) until a vhostd it runs listens; the socket's directory is
    /// open to every user (for a vhostd that drops privileges).
    pub fn start_with(netns: Option<&NetNs>, argv: impl FnOnce(&Path) -> Vec<String>) -> Daemon {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vhostd-it-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let sock = dir.join("net.sock");
        let mut cmd = vhostd_in(netns);
        let mut child =
            cmd.args(argv(&sock)).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn vhostd");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(mut l) = log2.lock() {
                    l.push_str(&line);
                    l.push('\n');
                }
                if line.starts_with("vhostd: listening on") {
                    let _ = tx.send(());
                }
                if std::env::var_os("VHOSTD_TEST_VERBOSE").is_some() {
                    eprintln!("[vhostd] {line}");
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("vhostd did not start listening");
        Daemon { child: Some(child), log, dir, sock }
    }

    /// What vhostd has written to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    /// Frontend options for this daemon's socket.
    pub fn options(&self) -> Options {
        Options::new(&self.sock)
    }

    /// The frontend's default options for this daemon, with a packed or
    /// split ring and mergeable RX buffers or not.
    pub fn ring_options(&self, packed: bool, mrg: bool) -> Options {
        let mut opts = self.options();
        if packed {
            opts.features |= vhostd_user::features::RING_PACKED;
        }
        if !mrg {
            opts.features &= !vhostd_user::features::NET_MRG_RXBUF;
        }
        opts
    }

    /// Connects the project's frontend with default options.
    pub fn connect(&self) -> VirtioUser {
        VirtioUser::connect(self.options()).expect("connect frontend")
    }

    /// SIGTERM, wait (bounded), and return the parsed counters.
    pub fn stop(mut self) -> Stats {
        let mut child = self.child.take().unwrap();
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "vhostd exited with {status}");
                break;
            }
            assert!(Instant::now() < deadline, "vhostd did not stop within 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut out = String::new();
        child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        assert!(!self.sock.exists(), "socket removed on exit");
        Stats::parse(&out)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Collects a child's stderr lines (on a thread) into the returned string.
pub fn collect_stderr(child: &mut Child) -> std::sync::Arc<std::sync::Mutex<String>> {
    let stderr = child.stderr.take().expect("stderr piped");
    let err = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let e2 = err.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            e2.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    err
}

/// vhostd's exit counters: `stats queue=N dir=.. k=v..` and `stats total k=v..`.
#[derive(Debug, Default)]
pub struct Stats {
    pub queues: HashMap<usize, HashMap<String, String>>,
    pub workers: HashMap<usize, HashMap<String, String>>,
    pub total: HashMap<String, String>,
}

impl Stats {
    pub fn parse(out: &str) -> Stats {
        let mut s = Stats::default();
        for line in out.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("stats") {
                continue;
            }
            let rest: Vec<&str> = words.collect();
            let kv: HashMap<String, String> =
                rest.iter().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect();
            if rest.first() == Some(&"total") {
                s.total = kv;
            } else if let Some(q) = kv.get("queue").and_then(|q| q.parse().ok()) {
                s.queues.insert(q, kv);
            } else if let Some(w) = kv.get("worker").and_then(|w| w.parse().ok()) {
                s.workers.insert(w, kv);
            }
        }
        assert!(!s.total.is_empty(), "no total line in vhostd output: {out}");
        s
    }

    pub fn total(&self, k: &str) -> u64 {
        self.total.get(k).unwrap_or_else(|| panic!("no total {k}")).parse().unwrap()
    }

    pub fn queue(&self, q: usize, k: &str) -> u64 {
        self.queues.get(&q).and_then(|m| m.get(k)).unwrap_or_else(|| panic!("no queue {q} {k}")).parse().unwrap()
    }
}

/// A `vhostd` command that runs in `netns` (if given).
pub fn vhostd_in(netns: Option<&NetNs>) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vhostd"));
    if let Some(ns) = netns {
        let f = std::fs::File::open(ns.path()).expect("open netns");
        // SAFETY: between fork and exec the closure only calls setns(2) on
        // a descriptor opened before the fork (async-signal-safe).
        unsafe {
            cmd.pre_exec(move || {
                use std::os::fd::AsRawFd;
                if libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd
}

/// A network namespace of the test's own (removed on drop, with every
/// interface in it).
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new() -> NetNs {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("vhd-it-{}-{n}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).stderr(Stdio::null()).status();
        let ok = Command::new("ip").args(["netns", "add", &name]).status().expect("run ip");
        assert!(ok.success(), "ip netns add {name} (tests need root)");
        let ns = NetNs { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// `ip -n NS ARGS...`, which must succeed.
    pub fn ip(&self, args: &[&str]) {
        let out = Command::new("ip").arg("-n").arg(&self.name).args(args).output().expect("run ip");
        assert!(out.status.success(), "ip -n {} {args:?}: {}", self.name, String::from_utf8_lossy(&out.stderr));
    }

    /// Runs `f` on a thread inside the namespace: sockets and TAPs it
    /// creates belong to the namespace.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let file = std::fs::File::open(self.path()).expect("open netns");
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: setns on this (new, short-lived) thread only.
            assert_eq!(unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
            f()
        })
        .join()
        .expect("thread in netns")
    }

    /// An interface counter, e.g. ("vtap0", "rx_packets").
    pub fn counter(&self, ifname: &str, what: &str) -> u64 {
        // `ip netns exec` mounts the namespace's own /sys.
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "cat"])
            .arg(format!("/sys/class/net/{ifname}/statistics/{what}"))
            .output()
            .expect("run ip netns exec");
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or_else(|_| panic!("no {what} of {ifname}"))
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    f()
}

/// A raw vhost-user request on a stream (for messages the `vhost` crate's
/// frontend does not send). Returns the reply payload if one is expected.
pub fn raw_request(s: &mut UnixStream, code: u32, flags: u32, body: &[u8], reply: bool) -> Option<Vec<u8>> {
    let mut msg = Vec::new();
    msg.extend_from_slice(&code.to_le_bytes());
    msg.extend_from_slice(&(0x1 | flags).to_le_bytes());
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(body);
    s.write_all(&msg).unwrap();
    if !reply {
        return None;
    }
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hdr = [0u8; 12];
    s.read_exact(&mut hdr).unwrap();
    let code_back = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
    assert_eq!(code_back, code, "reply to the request we sent");
    let size = u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize;
    let mut payload = vec![0u8; size];
    s.read_exact(&mut payload).unwrap();
    Some(payload)
}

/// A unique frame: broadcast Ethernet, EtherType 0x88B5, `len` bytes, payload
/// derived from `seq`.
pub fn frame(seq: u32, len: usize) -> Vec<u8> {
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x99]);
    f[12..14].copy_from_slice(&[0x88, 0xb5]);
    for (i, b) in f[14..].iter_mut().enumerate() {
        *b = (seq as usize * 7 + i) as u8;
    }
    if len >= 18 {
        f[14..18].copy_from_slice(&seq.to_le_bytes());
    }
    f
}

pub fn sock_path(d: &Daemon) -> &Path {
    &d.sock
}

/// A packet socket on an interface of a namespace: the host side of a TAP,
/// or the peer of a veth.
pub struct Packet {
    fd: OwnedFd,
}

impl Packet {
    /// Receives frames of EtherType `proto` arriving on `ifname` (not the
    /// ones it sends); with `vnet_hdr` frames carry a virtio_net_hdr.
    pub fn open(ns: &NetNs, ifname: &str, proto: u16, vnet_hdr: bool) -> Packet {
        let ifname = ifname.to_string();
        let fd = ns.run(move || {
            // SAFETY: plain socket calls on a new descriptor; every result
            // is checked; sockaddr_ll is plain data.
            unsafe {
                let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto.to_be() as i32);
                assert!(fd >= 0, "packet socket: {}", std::io::Error::last_os_error());
                let on: libc::c_int = 1;
                if vnet_hdr {
                    let r =
                        libc::setsockopt(fd, libc::SOL_PACKET, libc::PACKET_VNET_HDR, &on as *const _ as *const _, 4);
                    assert_eq!(r, 0, "PACKET_VNET_HDR");
                }
                let rcvbuf: libc::c_int = 8 << 20;
                libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &rcvbuf as *const _ as *const _, 4);
                let name = CString::new(ifname.clone()).unwrap();
                let ifindex = libc::if_nametoindex(name.as_ptr());
                assert!(ifindex > 0, "no interface {ifname}");
                let mut sll: libc::sockaddr_ll = std::mem::zeroed();
                sll.sll_family = libc::AF_PACKET as u16;
                sll.sll_protocol = proto.to_be();
                sll.sll_ifindex = ifindex as i32;
                let r = libc::bind(fd, &sll as *const _ as *const libc::sockaddr, std::mem::size_of_val(&sll) as u32);
                assert_eq!(r, 0, "bind packet socket: {}", std::io::Error::last_os_error());
                fd
            }
        });
        // SAFETY: fd is a new descriptor owned by nothing else.
        Packet { fd: unsafe { OwnedFd::from_raw_fd(fd) } }
    }

    pub fn send(&self, data: &[u8]) {
        // SAFETY: data is a valid buffer of its length.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), data.as_ptr().cast(), data.len(), 0) };
        assert_eq!(n, data.len() as isize, "packet send: {}", std::io::Error::last_os_error());
    }

    /// The next frame, or None after `timeout`.
    pub fn recv(&self, timeout: Duration) -> Option<Vec<u8>> {
        let mut p = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut p, 1, timeout.as_millis() as i32) } != 1 {
            return None;
        }
        let mut buf = vec![0u8; 70000];
        // SAFETY: buf is writable for its length.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            return None;
        }
        buf.truncate(n as usize);
        Some(buf)
    }
}

/// Runs vhostd expecting it to refuse to start; returns its stderr.
pub fn refused(ns: Option<&NetNs>, args: &[&str], code: i32) -> String {
    let dir = tempdir();
    let sock = dir.join("net.sock");
    let out =
        vhostd_in(ns).arg("net").arg("--socket-path").arg(&sock).args(args).stdin(Stdio::null()).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "vhostd {args:?}: {err}");
    assert!(!sock.exists(), "nothing left behind");
    let _ = std::fs::remove_dir_all(&dir);
    err
}

pub fn tempdir() -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("vhostd-it-refused-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// An IPv4 frame to the guest: UDP from port `sport`, `len` bytes.
pub fn udp4_frame(sport: u16, len: usize, seq: u32) -> Vec<u8> {
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&GUEST_MAC);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x02]);
    f[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
    let ip_len = (len - 14) as u16;
    f[14] = 0x45;
    f[16..18].copy_from_slice(&ip_len.to_be_bytes());
    f[22] = 64;
    f[23] = 17;
    f[26..30].copy_from_slice(&[10, 99, 4, 1]);
    f[30..34].copy_from_slice(&[10, 99, 4, 2]);
    let csum = ip_checksum(&f[14..34]);
    f[24..26].copy_from_slice(&csum.to_be_bytes());
    f[34..36].copy_from_slice(&sport.to_be_bytes());
    f[36..38].copy_from_slice(&9u16.to_be_bytes());
    f[38..40].copy_from_slice(&(ip_len - 20).to_be_bytes());
    f[42..46].copy_from_slice(&seq.to_le_bytes());
    f
}

pub fn ip_checksum(h: &[u8]) -> u16 {
    let mut sum: u32 = h.chunks(2).map(|c| u16::from_be_bytes([c[0], c[1]]) as u32).sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Sends VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET on the control queue; returns the ack.
pub fn set_pairs(dev: &mut VirtioUser, ctrl: &mut vhostd_user::VirtQueue, pairs: u16) -> u8 {
    let req = dev.memory().alloc(64, 64).unwrap();
    let ack = dev.memory().alloc(64, 64).unwrap();
    let mut cmd = vec![4u8, 0];
    cmd.extend_from_slice(&pairs.to_le_bytes());
    assert!(dev.memory().driver_memory().write(req, &cmd));
    assert!(dev.memory().driver_memory().write(ack, &[0xee]));
    ctrl.ring.add(&[Buf { addr: req, len: 4 }], &[Buf { addr: ack, len: 1 }], 0).unwrap();
    ctrl.publish_and_kick().unwrap();
    assert!(wait_until(Duration::from_secs(20), || ctrl.ring.pop_used().unwrap().is_some()));
    let mut a = [0u8];
    assert!(dev.memory().driver_memory().read(ack, &mut a));
    a[0]
}

/// One vhost-user message as bytes: request, flags (version 1 is added),
/// size, payload.
pub fn vhost_user_msg(code: u32, flags: u32, body: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(12 + body.len());
    msg.extend_from_slice(&code.to_le_bytes());
    msg.extend_from_slice(&(0x1 | flags).to_le_bytes());
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(body);
    msg
}

/// Sends `bytes` with one sendmsg(2), `fds` attached as SCM_RIGHTS (no
/// ancillary data when empty), MSG_NOSIGNAL. Returns the bytes sent (a
/// stream socket may take fewer than asked).
pub fn send_with_fds(s: &UnixStream, bytes: &[u8], fds: &[std::os::fd::RawFd]) -> std::io::Result<usize> {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    let fd_bytes = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    // u64 elements keep the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds CMSG_SPACE(fd_bytes) bytes, so the
        // first header and its data (CMSG_LEN(fd_bytes)) fit in it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr() as *const u8, libc::CMSG_DATA(c), fd_bytes);
        }
    }
    // SAFETY: msg describes valid buffers (see above).
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Whether the tests run as root. Tests that need root (mounts, namespaces)
/// call `needs_root` first and end early, with a note, when not.
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// True when the test may go on; false (after a note saying why) when it
/// needs root and the tests do not run as root.
pub fn needs_root(what: &str) -> bool {
    if is_root() {
        return true;
    }
    eprintln!("note: {what} needs root; skipping");
    false
}

/// True when /dev/shm is a tmpfs (the file backend then maps an image
/// with no hole); false, after a note, when the test must skip.
pub fn shm_is_tmpfs() -> bool {
    let is_tmpfs = on_tmpfs(std::path::Path::new("/dev/shm"));
    if !is_tmpfs {
        eprintln!("note: /dev/shm is not a tmpfs; skipping");
    }
    is_tmpfs
}

/// A disk that hangs: a FUSE file system (tests/hanging_fs.py) holding one
/// file, `disk` (zeros at first, kept in the file system's memory), whose
/// reads and writes wait while it is held (`hold`), as on an NFS mount
/// whose server went away. Unmounted and stopped on drop (declare it
/// before the daemon, which then goes first). Needs root and
/// python3-fusepy (scripts/setup installs it).
pub struct HangingDisk {
    child: Child,
    mnt: PathBuf,
    hold: PathBuf,
}

impl HangingDisk {
    /// Mounts one at `dir`/hanging holding a disk of `bytes` bytes.
    pub fn mount(dir: &Path, bytes: u64) -> HangingDisk {
        let mnt = dir.join("hanging");
        std::fs::create_dir_all(&mnt).unwrap();
        let hold = dir.join("hold");
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/hanging_fs.py");
        // Debian's python3, which python3-fusepy installs into (not one a
        // version manager put first on PATH).
        let child = Command::new("/usr/bin/python3")
            .arg(script)
            .arg(&mnt)
            .arg(bytes.to_string())
            .arg(&hold)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3 (scripts/setup installs it, with python3-fusepy)");
        let d = HangingDisk { child, mnt, hold };
        assert!(
            wait_until(Duration::from_secs(10), || d.disk().exists()),
            "the FUSE file system did not come up (needs /dev/fuse and python3-fusepy: scripts/setup)"
        );
        d
    }

    /// The disk file.
    pub fn disk(&self) -> PathBuf {
        self.mnt.join("disk")
    }

    /// Holds reads and writes until the guard is released or dropped
    /// (declare it after the daemon: a process waiting on the disk cannot
    /// be reaped until it answers).
    pub fn hold(&self) -> Held {
        std::fs::write(&self.hold, b"").unwrap();
        Held(self.hold.clone())
    }
}

/// Reads and writes of a `HangingDisk` wait while this lives.
pub struct Held(PathBuf);

impl Held {
    /// Lets them go on.
    pub fn release(self) {}
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Drop for HangingDisk {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.hold);
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Image files: their bytes, holes and allocated space.
pub mod image {
    use std::fs::{self, File};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileExt, MetadataExt};
    use std::path::Path;

    /// `len` bytes of `p` at `off`.
    pub fn read(p: &Path, off: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        File::open(p).unwrap().read_exact_at(&mut b, off).unwrap();
        b
    }

    /// `len` bytes of the image at `off` are still the pattern of `seed`
    /// (vhostd_user's `fill_pattern`).
    pub fn assert_pattern(p: &Path, off: u64, len: usize, seed: u64) {
        let b = read(p, off, len);
        assert_eq!(vhostd_user::blk::workload::check_pattern(&b, off, seed), None, "image changed at {off}+{len}");
    }

    /// `len` bytes of the image at `off` are zeros.
    pub fn assert_zero(p: &Path, off: u64, len: usize) {
        let b = read(p, off, len);
        assert_eq!(b.iter().position(|&x| x != 0), None, "image not zero at {off}+{len}");
    }

    /// 512-byte units allocated to the file.
    pub fn allocated(p: &Path) -> u64 {
        fs::metadata(p).unwrap().blocks()
    }

    /// lseek(SEEK_HOLE / SEEK_DATA) from `off`.
    pub fn seek(p: &Path, off: u64, whence: libc::c_int) -> u64 {
        let file = File::open(p).unwrap();
        // SAFETY: lseek on a descriptor we own; the result is checked.
        let r = unsafe { libc::lseek(file.as_raw_fd(), off as libc::off_t, whence) };
        assert!(r >= 0, "lseek: {}", std::io::Error::last_os_error());
        r as u64
    }
}

/// A vfio-user client's accesses to BAR0, the virtio-pci structures (in
/// the layout of vhostd-virtio-pci: common config at 0, device config at
/// 0x2000).
pub mod bar0 {
    use vhostd_vfio_user::Client;

    /// Writes the low `len` bytes of `v` at `off`.
    pub fn w(c: &mut Client, off: u64, v: u64, len: usize) {
        c.region_write(0, off, &v.to_le_bytes()[..len]).unwrap();
    }

    /// Reads `len` bytes at `off`, little-endian.
    pub fn r(c: &mut Client, off: u64, len: usize) -> u64 {
        let mut b = [0u8; 8];
        c.region_read(0, off, &mut b[..len]).unwrap();
        u64::from_le_bytes(b)
    }
}

/// Whether `path` lies on a tmpfs.
pub fn on_tmpfs(path: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
    // SAFETY: statfs is plain data (all zeros is valid); statfs(2) fills
    // it for a valid C path.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type == libc::TMPFS_MAGIC
    }
}
