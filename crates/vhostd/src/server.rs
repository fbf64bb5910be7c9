//! The control threads: one per device listens on its socket and serves one
//! frontend at a time, surviving disconnects; the main thread waits for
//! signals and stops everything cleanly on SIGINT/SIGTERM.

use std::io::{self, Write};
use std::os::unix::io::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::{BackendReqHandler, Error as VuError};
use vhostd_net::CtrlState;

use crate::cli::{BlkArgs, DeviceArgs, NetArgs, WaitMode};
use crate::config::DeviceSpec;
use crate::session::{Device, Session};
use crate::worker::{self, Engine, Mode, Shared, WorkerReport};
use vhostd_blk::{BlkDevice, BlkQueue};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Removes the socket file when dropped (also on error paths).
pub struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl SocketFile {
    /// Removes `path` when dropped.
    pub fn new(path: PathBuf) -> SocketFile {
        SocketFile(path)
    }
}

/// Binds the socket; a stale socket file (nobody listening) is replaced,
/// a live one is an error.
fn bind(path: &Path) -> io::Result<UnixListener> {
    bind_as(path, "--socket-path")
}

/// `bind` for the option `what` (named in errors).
pub fn bind_as(path: &Path, what: &str) -> io::Result<UnixListener> {
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{what} {}: another process is listening there", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
            UnixListener::bind(path).map_err(|e| io::Error::new(e.kind(), format!("{what} {}: {e}", path.display())))
        }
        Err(e) => Err(io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))),
    }
}

/// SIGINT, SIGTERM (stop) and SIGUSR1 (print counters) as a readable fd;
/// blocked for every thread spawned after.
struct Signals(RawFd);

impl Signals {
    fn new() -> io::Result<Signals> {
        // SAFETY: plain libc calls on a local sigset; the fd is checked.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::sigaddset(&mut set, libc::SIGUSR1);
            if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(Signals(fd))
        }
    }
}

/// What a pending signal asks for.
enum SignalAsk {
    Stop,
    PrintStats,
    Nothing,
}

impl Signals {
    fn take(&self) -> SignalAsk {
        // SAFETY: signalfd_siginfo is plain data; read fills at most its size.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let n = unsafe {
            libc::read(self.0, &mut info as *mut _ as *mut libc::c_void, std::mem::size_of::<libc::signalfd_siginfo>())
        };
        if n != std::mem::size_of::<libc::signalfd_siginfo>() as isize {
            return SignalAsk::Nothing;
        }
        match info.ssi_signo as i32 {
            libc::SIGUSR1 => SignalAsk::PrintStats,
            _ => SignalAsk::Stop,
        }
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        // SAFETY: we own the fd.
        unsafe { libc::close(self.0) };
    }
}

/// `wait_readable` for at most `ms` milliseconds: None when none became readable.
fn wait_readable_timeout(fds: &[RawFd], ms: i32) -> io::Result<Option<usize>> {
    let mut pfds: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: pfds is a valid array of pollfd of the given length.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(None) } else { Err(e) };
    }
    Ok(pfds.iter().position(|p| p.revents != 0))
}

/// Waits until one of `fds` is readable (or hung up); returns its position.
fn wait_readable(fds: &[RawFd]) -> io::Result<usize> {
    let mut pfds: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    loop {
        // SAFETY: pfds is a valid array of pollfd of the given length.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if let Some(i) = pfds.iter().position(|p| p.revents != 0) {
            return Ok(i);
        }
    }
}

const SET_VRING_ADDR: u32 = 9;
const SET_VRING_ENABLE: u32 = 18;
const VERSION_MASK: u32 = 0x3;
const SET_STATUS: u32 = 39;
const GET_STATUS: u32 = 40;
const NEED_REPLY: u32 = 0x8;
const REPLY: u32 = 0x4;
const VERSION: u32 = 0x1;

/// The `vhost` crate's handler does not know SET_STATUS / GET_STATUS, and
/// refuses SET_VRING_ENABLE before SET_FEATURES (QEMU sends it earlier), so
/// we peek at each header and answer those three ourselves. Returns true if
/// the message was one of them (and has been consumed).
fn handle_own_msg(conn: &UnixStream, session: &Mutex<Session>) -> io::Result<bool> {
    let mut hdr = [0u8; 12];
    // SAFETY: hdr is a valid buffer of 12 bytes; MSG_PEEK leaves the data
    // (and any passed fds) in the socket.
    let n = unsafe {
        libc::recv(conn.as_raw_fd(), hdr.as_mut_ptr() as *mut libc::c_void, 12, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    if n != 12 {
        return Ok(false);
    }
    let req = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let flags = u32::from_le_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
    let size = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]);
    let expected = match req {
        SET_STATUS | SET_VRING_ENABLE => 8,
        GET_STATUS => 0,
        SET_VRING_ADDR => 40,
        _ => return Ok(false),
    };
    // A bad size or header (version other than 1, the reply bit, reserved
    // bits): let the generic handler refuse it.
    if size != expected || flags & VERSION_MASK != VERSION || flags & !(VERSION_MASK | NEED_REPLY) != 0 {
        return Ok(false);
    }
    if req == SET_VRING_ADDR {
        return vring_addr_misaligned(conn, session, flags);
    }
    let mut msg = [0u8; 20];
    read_exact(conn, &mut msg[..12 + size as usize])?;
    let mut s = session.lock().map_err(|_| io::Error::other("session lock poisoned"))?;
    let body = u64::from_le_bytes(msg[12..20].try_into().unwrap_or_default());
    let reply_value = match req {
        GET_STATUS => s.status() as u64,
        _ => {
            let ok = if req == SET_STATUS {
                s.set_status(body as u8);
                true
            } else {
                let (index, num) = (body as u32, (body >> 32) as u32);
                num <= 1 && s.vring_enable(index, num == 1).is_ok()
            };
            if !(flags & NEED_REPLY != 0 && s.reply_ack()) {
                return Ok(true);
            }
            u64::from(!ok)
        }
    };
    let mut out = [0u8; 20];
    out[0..4].copy_from_slice(&req.to_le_bytes());
    out[4..8].copy_from_slice(&(VERSION | REPLY).to_le_bytes());
    out[8..12].copy_from_slice(&8u32.to_le_bytes());
    out[12..20].copy_from_slice(&reply_value.to_le_bytes());
    (&*conn).write_all(&out)?;
    Ok(true)
}

/// SET_VRING_ADDR with misaligned addresses (a guest chooses them; QEMU
/// passes them on): the `vhost` crate would fail it as a malformed message
/// and the connection would close, so it is refused here with an error
/// reply (when asked for) and the connection goes on. Aligned ones go to
/// the generic handler (returns false, nothing consumed).
fn vring_addr_misaligned(conn: &UnixStream, session: &Mutex<Session>, flags: u32) -> io::Result<bool> {
    let mut msg = [0u8; 52];
    // SAFETY: peek the whole message into a local buffer; nothing consumed.
    let n = unsafe {
        libc::recv(
            conn.as_raw_fd(),
            msg.as_mut_ptr() as *mut libc::c_void,
            msg.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n != msg.len() as isize {
        return Ok(false);
    }
    let u64_at = |o: usize| u64::from_le_bytes(msg[o..o + 8].try_into().unwrap_or_default());
    // struct vhost_vring_addr: index, flags (u32 each), then descriptor,
    // used, avail and log addresses (u64).
    let (desc, used, avail) = (u64_at(20), u64_at(28), u64_at(36));
    if desc % 16 == 0 && used % 4 == 0 && avail % 2 == 0 {
        return Ok(false);
    }
    read_exact(conn, &mut msg)?;
    tracing::warn!(
        "SET_VRING_ADDR refused: misaligned ring addresses (desc {desc:#x}, used {used:#x}, avail {avail:#x})"
    );
    let ack = session.lock().map(|s| s.reply_ack()).unwrap_or(false);
    if flags & NEED_REPLY != 0 && ack {
        let mut out = [0u8; 20];
        out[0..4].copy_from_slice(&SET_VRING_ADDR.to_le_bytes());
        out[4..8].copy_from_slice(&(VERSION | REPLY).to_le_bytes());
        out[8..12].copy_from_slice(&8u32.to_le_bytes());
        out[12..20].copy_from_slice(&1u64.to_le_bytes());
        (&*conn).write_all(&out)?;
    }
    Ok(true)
}

fn read_exact(conn: &UnixStream, buf: &mut [u8]) -> io::Result<()> {
    use std::io::Read;
    (&*conn).read_exact(buf)
}

/// Most descriptors one message may carry (the `vhost` crate's limit).
const MAX_FDS: usize = 32;

/// Whether the next message carries more descriptors than a request may.
/// Peeking installs copies of them here: they are closed at once.
fn too_many_fds(conn: &UnixStream) -> bool {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr() as *mut libc::c_void, iov_len: 1 };
    // Room for twice the limit, so more than the limit is seen as such.
    let mut control = [0u64; 80];
    // SAFETY: msghdr is plain data; every pointer below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg describes valid local buffers; MSG_PEEK consumes nothing.
    let n = unsafe {
        libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC)
    };
    if n <= 0 {
        return false;
    }
    let mut count = 0;
    // SAFETY: walking the control messages the kernel wrote into `control`
    // with the CMSG macros; each descriptor read is one we now own.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const libc::c_int;
                let k = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<libc::c_int>();
                for j in 0..k {
                    libc::close(std::ptr::read_unaligned(data.add(j)));
                }
                count += k;
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    count > MAX_FDS || msg.msg_flags & libc::MSG_CTRUNC != 0
}

/// The header (request code, flags) of the next message, without consuming it.
fn peek_header(conn: &UnixStream) -> Option<(u32, u32)> {
    let mut hdr = [0u8; 8];
    // SAFETY: peek into a local 8-byte buffer; nothing consumed.
    let n = unsafe {
        libc::recv(conn.as_raw_fd(), hdr.as_mut_ptr() as *mut libc::c_void, 8, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    (n == 8).then(|| {
        (u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]), u32::from_le_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]))
    })
}

/// Requests whose answer carries a payload (the `vhost` crate replies only
/// when the handler succeeds).
const REPLYING: &[u32] = &[
    1,  // GET_FEATURES
    11, // GET_VRING_BASE
    15, // GET_PROTOCOL_FEATURES
    17, // GET_QUEUE_NUM
    24, // GET_CONFIG
    31, // GET_INFLIGHT_FD
    36, // GET_MAX_MEM_SLOTS
    40, // GET_STATUS
];

/// Whether a refused request left a frontend waiting: a request that
/// carries a reply (never sent on error), or one asking for an ack that
/// failed before the ack (the crate's own checks: a protocol feature not
/// negotiated, a missing descriptor; the session never returns these).
fn refusal_unanswered(e: &VuError, req: u32, flags: u32, session: &Mutex<Session>) -> bool {
    if REPLYING.contains(&req) {
        return true;
    }
    let pre_ack = matches!(e, VuError::InvalidParam | VuError::InactiveFeature(_) | VuError::InactiveOperation(_));
    let acked = flags & NEED_REPLY != 0 && session.lock().map(|s| s.reply_ack()).unwrap_or(false);
    pre_ack && acked
}

/// Errors after which the byte stream can no longer be trusted.
fn is_fatal(e: &VuError) -> bool {
    !matches!(
        e,
        VuError::InvalidParam
            | VuError::InvalidOperation(_)
            | VuError::InactiveFeature(_)
            | VuError::InactiveOperation(_)
            | VuError::ReqHandlerError(_)
    )
}

/// Serves one connection until it ends. Returns true if `stop` was signalled.
fn serve(conn: UnixStream, dev: &Arc<Device>, stop: RawFd) -> io::Result<bool> {
    let session = Arc::new(Mutex::new(Session::new(dev.clone())));
    let mut handler = BackendReqHandler::from_stream(conn.try_clone()?, session.clone());
    let mut refused = 0u64;
    let stopped = loop {
        if wait_readable(&[conn.as_raw_fd(), stop])? == 1 {
            break true;
        }
        if too_many_fds(&conn) {
            // The `vhost` crate would drop them and lose the message's
            // framing (it retries after the header is consumed).
            tracing::warn!("closing frontend connection: a message with more file descriptors than any request takes");
            break false;
        }
        match handle_own_msg(&conn, &session) {
            Ok(true) => continue,
            Ok(false) => {}
            Err(e) => {
                tracing::info!("frontend connection ended: {e}");
                break false;
            }
        }
        // Which request this is (for deciding whether a refusal was answered).
        let (req, flags) = peek_header(&conn).unwrap_or((0, 0));
        match handler.handle_request() {
            Ok(()) => {}
            Err(VuError::Disconnected) | Err(VuError::PartialMessage) => {
                tracing::info!("frontend disconnected");
                break false;
            }
            Err(e) if is_fatal(&e) => {
                tracing::warn!("closing frontend connection: {e}");
                break false;
            }
            Err(e) if refusal_unanswered(&e, req, flags, &session) => {
                // The frontend waits for a reply the `vhost` crate did not
                // send (a GET_* refused, or a check failed before the ack):
                // closing is the only answer left that does not hang it.
                tracing::warn!("closing frontend connection: request {req} refused without a reply: {e}");
                break false;
            }
            Err(e) => {
                // Refused requests are the frontend's doing: rate-limit the log.
                refused += 1;
                if refused <= 10 || refused.is_power_of_two() {
                    tracing::warn!(count = refused, "request failed: {e}");
                }
            }
        }
    };
    if let Ok(mut s) = session.lock() {
        s.reset();
    }
    Ok(stopped)
}

/// Builds the device `spec` describes, as `run` does (for fuzz targets and
/// tests that drive a session in-process).
pub fn build(spec: &DeviceSpec) -> io::Result<(Arc<Device>, Endpoint)> {
    let r = match &spec.args {
        DeviceArgs::Net(a) => build_net(&spec.name, a),
        DeviceArgs::Blk(a) => build_blk(&spec.name, a),
    };
    r.map(|(d, e, _hold)| (d, e))
}

/// Serves one connection to its end, as a device thread does (for fuzz
/// targets: the frontend's bytes come from the other end of `conn`).
pub fn serve_connection(conn: UnixStream, dev: &Arc<Device>) -> io::Result<()> {
    let never = EventFd::new(EFD_NONBLOCK)?;
    serve(conn, dev, never.as_raw_fd()).map(|_| ())
}

/// Stops a device's workers (after `build`).
pub fn shutdown(dev: &Device) {
    dev.shared.stop.store(true, Ordering::Release);
    for w in &dev.workers {
        w.join();
    }
}

/// Where a device meets its frontend.
pub enum Endpoint {
    /// A listening socket (and its file, removed when this goes).
    Listen(UnixListener, SocketFile),
    /// An already-connected socket (--fd).
    Conn(UnixStream),
    /// A socket to connect to, again after each disconnect (--client).
    Client(PathBuf),
}

/// What a device needs kept alive beside its workers (the AF_XDP program's link).
type Hold = Option<Box<dyn std::any::Any>>;

/// Builds a net device: backend, workers, endpoint. Nothing is left behind
/// on error (the socket file is removed, the XDP program detached).
fn build_net(name: &str, args: &NetArgs) -> io::Result<(Arc<Device>, Endpoint, Hold)> {
    let mac = args.mac.0;
    // Backends first: a TAP that cannot be opened leaves nothing behind.
    let backends = vhostd_backends::build(&args.backend_kind(), mac, args.queues as usize)?;
    let offload_features = backends.tap.as_ref().map_or(0, |t| vhostd_net::offload_features(t.caps()));
    if let Some(t) = &backends.tap {
        tracing::info!(
            "TAP {}: {} queue(s), vnet header {}, offloads {}",
            t.name(),
            args.queues,
            if t.has_vnet_hdr() { "on" } else { "off" },
            t.caps()
        );
    }
    if let Some(x) = &backends.af_xdp {
        tracing::info!("{x}, {} queue pair(s)", args.queues);
    }
    // The XDP program stays attached while this lives.
    let hold: Hold = backends.af_xdp.map(|x| Box::new(x) as Box<dyn std::any::Any>);
    let endpoint = endpoint(args.socket_path.as_deref(), args.fd, args.client)?;
    let shared = Arc::new(Shared {
        active_pairs: AtomicU16::new(args.queues),
        ctrl: Mutex::new(CtrlState::new(args.queues, mac)),
        needs_reset: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        tap: backends.tap.map(Arc::new),
        link: backends.link,
        wakers: std::sync::OnceLock::new(),
    });
    let mode = wait_mode(args.poll, args.mode, args.poll_idle_us);
    let mut workers = Vec::new();
    for (pair, backend) in backends.queues.into_iter().enumerate() {
        let cpu = args.cpus.as_ref().map(|l| l.0[pair % l.0.len()]);
        workers.push(worker::spawn(name, pair as u16, Engine::Net(backend), mode, cpu, shared.clone())?);
    }
    let _ = shared.wakers.set(workers.iter().map(|w| w.waker()).collect::<io::Result<_>>()?);
    let dev = Arc::new(Device {
        pairs: args.queues,
        max_queue_size: args.queue_size,
        mac,
        offload_features,
        blk: None,
        workers,
        shared,
    });
    Ok((dev, endpoint, hold))
}

fn wait_mode(poll: bool, mode: WaitMode, poll_idle_us: u64) -> Mode {
    match (poll, mode) {
        (true, _) | (false, WaitMode::Poll) => Mode::Poll,
        (false, WaitMode::Interrupt) => Mode::Interrupt,
        (false, WaitMode::Adaptive) => Mode::Adaptive { idle: std::time::Duration::from_micros(poll_idle_us) },
    }
}

/// Builds a blk device: the disk, workers, endpoint.
fn build_blk(name: &str, args: &BlkArgs) -> io::Result<(Arc<Device>, Endpoint, Hold)> {
    // The disk first: a path that cannot be opened leaves nothing behind.
    let spec = args.spec();
    let what = if args.backend.is_some() { "--backend" } else { "--blk-file" };
    let (disk, backends) = vhostd_block_backends::open(&spec, args.queues as usize, BACKEND_DEPTH)
        .map_err(|e| io::Error::new(e.kind(), format!("{what} {}: {e}", args.backend_description())))?;
    let serial = args.serial.clone().unwrap_or_else(|| args.default_serial());
    let blk = Arc::new(BlkDevice::new(disk, args.queues, &serial));
    tracing::info!(
        "blk: {}, {} bytes ({} sectors), block size {}, {}{}{}, {} queue(s)",
        args.backend_description(),
        disk.capacity,
        disk.capacity / 512,
        disk.block_size,
        if disk.read_only { "read-only" } else { "read-write" },
        if disk.discard { ", discard" } else { "" },
        if disk.write_zeroes && !disk.read_only { ", write-zeroes" } else { "" },
        args.queues
    );
    let endpoint = endpoint(args.socket_path.as_deref(), args.fd, args.client)?;
    let shared = Arc::new(Shared {
        active_pairs: AtomicU16::new(args.queues),
        ctrl: Mutex::new(CtrlState::new(args.queues, [0; 6])),
        needs_reset: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        tap: None,
        link: None,
        wakers: std::sync::OnceLock::new(),
    });
    let mode = wait_mode(args.poll, args.mode, args.poll_idle_us);
    let mut workers = Vec::new();
    for (i, backend) in backends.into_iter().enumerate() {
        let cpu = args.cpus.as_ref().map(|l| l.0[i % l.0.len()]);
        let engine = Engine::Blk { queue: Box::new(BlkQueue::new(backend, BACKEND_DEPTH)), dev: blk.clone() };
        workers.push(worker::spawn(name, i as u16, engine, mode, cpu, shared.clone())?);
    }
    let dev = Arc::new(Device {
        pairs: args.queues,
        max_queue_size: args.queue_size,
        mac: [0; 6],
        offload_features: 0,
        blk: Some(blk),
        workers,
        shared,
    });
    Ok((dev, endpoint, None))
}

/// Requests in flight per blk queue, at most.
const BACKEND_DEPTH: usize = 256;

/// The listening socket at `path`, or the connected socket `fd` (checked:
/// an open Unix stream socket).
fn endpoint(path: Option<&Path>, fd: Option<RawFd>, client: bool) -> io::Result<Endpoint> {
    match (path, fd) {
        (Some(p), _) if client => Ok(Endpoint::Client(p.to_path_buf())),
        (Some(p), _) => Ok(Endpoint::Listen(bind(p)?, SocketFile(p.to_path_buf()))),
        (None, Some(fd)) => {
            let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("--fd {fd}: {what}"));
            let (mut ty, mut domain) = (0i32, 0i32);
            let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
            // SAFETY: getsockopt writes at most `len` bytes into a local i32.
            let r = unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_TYPE,
                    &mut ty as *mut i32 as *mut libc::c_void,
                    &mut len,
                )
            };
            if r != 0 {
                return Err(bad(&format!("not an open socket ({})", io::Error::last_os_error())));
            }
            let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
            // SAFETY: as above.
            unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_DOMAIN,
                    &mut domain as *mut i32 as *mut libc::c_void,
                    &mut len,
                )
            };
            if ty != libc::SOCK_STREAM || domain != libc::AF_UNIX {
                return Err(bad("not a Unix stream socket"));
            }
            // SAFETY: fd is an open socket we were handed to own (checked above).
            let conn = unsafe { UnixStream::from_raw_fd(fd) };
            // Not inherited by anything we might run.
            // SAFETY: fcntl on an fd we own.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            Ok(Endpoint::Conn(conn))
        }
        (None, None) => Err(io::Error::new(io::ErrorKind::InvalidInput, "--socket-path or --fd is required")),
    }
}

/// A device being served, as the control socket and metrics see it.
pub struct DeviceEntry {
    /// Its name (logs, stats, metrics).
    pub name: String,
    /// `net` or `blk`.
    pub kind: &'static str,
    /// The socket path, or `fd N`.
    pub endpoint: String,
    /// The device.
    pub dev: Arc<Device>,
    /// A frontend is connected.
    pub connected: AtomicBool,
    /// Connections accepted so far.
    pub connections: AtomicU64,
    /// Why the device stopped serving, if it failed.
    pub failed: Mutex<Option<String>>,
    /// A handle on the connection being served: shut down at stop, so a
    /// frontend stalled mid-message (or not reading its replies) cannot
    /// hold the device thread.
    conn: Mutex<Option<UnixStream>>,
    /// Ends the device's thread.
    stop: EventFd,
}

/// Global options of a run.
#[derive(Default)]
pub struct Globals {
    /// Control socket for `vhostd stats`.
    pub control: Option<PathBuf>,
    /// Prometheus endpoint.
    pub metrics: Option<std::net::SocketAddr>,
    /// The system call filter.
    pub seccomp: crate::sandbox::SeccompMode,
}

/// Serves `devices` until SIGINT/SIGTERM (or, for a device on --fd, until
/// its connection closes), then stops the workers and prints the counters.
/// Every device is set up before any is served: one that cannot be set up
/// stops the start, naming it, with nothing left behind. Once running, a
/// device that fails is logged and marked; the others go on.
pub fn run(devices: Vec<DeviceSpec>, globals: Globals) -> io::Result<()> {
    let signals = Signals::new()?;
    // A frontend truncating guest memory under us costs that memory, not the process.
    crate::memory::install_sigbus_handler()?;
    let named = devices.len() > 1;
    let mut built = Vec::new();
    for d in &devices {
        let _span = tracing::info_span!("dev", device = %d.name).entered();
        let r = match &d.args {
            DeviceArgs::Net(a) => build_net(&d.name, a),
            DeviceArgs::Blk(a) => build_blk(&d.name, a),
        };
        let (dev, endpoint, hold) =
            r.map_err(|e| if named { io::Error::new(e.kind(), format!("device `{}`: {e}", d.name)) } else { e })?;
        let where_ = match (d.args.socket_path(), d.args.fd()) {
            (Some(p), _) if d.args.client() => format!("client of {}", p.display()),
            (Some(p), _) => p.display().to_string(),
            (None, fd) => format!("fd {}", fd.unwrap_or(-1)),
        };
        let entry = Arc::new(DeviceEntry {
            name: d.name.clone(),
            kind: d.args.kind(),
            endpoint: where_,
            dev,
            connected: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            failed: Mutex::new(None),
            conn: Mutex::new(None),
            stop: EventFd::new(EFD_NONBLOCK)?,
        });
        built.push((entry, endpoint, hold));
    }
    let entries: Arc<Vec<Arc<DeviceEntry>>> = Arc::new(built.iter().map(|(e, _, _)| e.clone()).collect());
    let _control = match &globals.control {
        Some(p) => Some(crate::control::serve(p, entries.clone())?),
        None => None,
    };
    if let Some(addr) = globals.metrics {
        crate::metrics::serve(addr, entries.clone())?;
    }
    let done = Arc::new(EventFd::new(EFD_NONBLOCK)?);
    let mut threads = Vec::new();
    let mut holds = Vec::new();
    for (entry, endpoint, hold) in built {
        match &endpoint {
            Endpoint::Listen(_, f) => eprintln!("vhostd: listening on {}", f.0.display()),
            Endpoint::Client(p) => eprintln!("vhostd: connecting to {}", p.display()),
            Endpoint::Conn(_) => {}
        }
        holds.push(hold);
        let done = done.clone();
        let e = entry.clone();
        let t = std::thread::Builder::new().name(format!("vhostd-{}", entry.name)).spawn(move || {
            let _span = tracing::info_span!("dev", device = %e.name).entered();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve_endpoint(&e, endpoint)));
            let failure = match r {
                Ok(Ok(())) => None,
                Ok(Err(err)) => Some(err.to_string()),
                Err(_) => Some("internal error (panic); see the log".to_string()),
            };
            if let Some(f) = failure {
                tracing::error!("device stopped serving: {f}");
                if let Ok(mut s) = e.failed.lock() {
                    *s = Some(f);
                }
            }
            let _ = done.write(1);
        })?;
        threads.push(t);
    }
    // Set up: from here on only the system calls serving needs.
    crate::sandbox::install(globals.seccomp)?;
    crate::notify::ready(entries.len());
    let mut ended = 0u64;
    loop {
        if wait_readable(&[signals.0, done.as_raw_fd()])? == 0 {
            match signals.take() {
                SignalAsk::Stop => break,
                SignalAsk::PrintStats => print_all_stats(&entries, false),
                SignalAsk::Nothing => {}
            }
            continue;
        }
        // Each device thread adds 1 as it ends.
        ended += done.read().unwrap_or(0);
        if ended >= threads.len() as u64 {
            break;
        }
    }
    crate::notify::stopping();
    tracing::info!("stopping");
    for e in entries.iter() {
        let _ = e.stop.write(1);
        if let Some(c) = e.conn.lock().ok().and_then(|mut c| c.take()) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
    for t in threads {
        let _ = t.join();
    }
    print_all_stats(&entries, true);
    drop(holds);
    let failed: Vec<String> = entries
        .iter()
        .filter_map(|e| e.failed.lock().ok().and_then(|f| f.clone()).map(|f| format!("{}: {f}", e.name)))
        .collect();
    if !failed.is_empty() && entries.len() == failed.len() {
        return Err(io::Error::other(failed.join("; ")));
    }
    Ok(())
}

/// Serves frontends one after the other (a listening socket) or the one
/// handed in (--fd) until the device is stopped.
fn serve_endpoint(e: &DeviceEntry, endpoint: Endpoint) -> io::Result<()> {
    let stop = e.stop.as_raw_fd();
    match endpoint {
        Endpoint::Conn(conn) => {
            tracing::info!("serving the frontend on {}", e.endpoint);
            serve_tracked(e, conn, stop).map(|_| ())
        }
        Endpoint::Client(path) => loop {
            let conn = match UnixStream::connect(&path) {
                Ok(c) => c,
                Err(err) => {
                    tracing::debug!("connect to {}: {err}", path.display());
                    // Retry in a second, unless stopped meanwhile.
                    if wait_readable_timeout(&[stop], 1000)? == Some(0) {
                        return Ok(());
                    }
                    continue;
                }
            };
            tracing::info!("connected to {}", path.display());
            if serve_tracked(e, conn, stop)? {
                return Ok(());
            }
        },
        Endpoint::Listen(listener, _file) => loop {
            if wait_readable(&[listener.as_raw_fd(), stop])? == 1 {
                return Ok(());
            }
            let (conn, _) = match listener.accept() {
                Ok(c) => c,
                Err(err) => {
                    tracing::warn!("accept failed: {err}");
                    continue;
                }
            };
            tracing::info!("frontend connected");
            if serve_tracked(e, conn, stop)? {
                return Ok(());
            }
        },
    }
}

/// `serve` with the device's bookkeeping: connected, connections, and a
/// handle on the socket for shutdown at stop.
fn serve_tracked(e: &DeviceEntry, conn: UnixStream, stop: RawFd) -> io::Result<bool> {
    e.connected.store(true, Ordering::Relaxed);
    e.connections.fetch_add(1, Ordering::Relaxed);
    if let (Ok(mut slot), Ok(c)) = (e.conn.lock(), conn.try_clone()) {
        *slot = Some(c);
    }
    // A stop that came before the handle was in place.
    let early = wait_readable_timeout(&[stop], 0)? == Some(0);
    let r = if early { Ok(true) } else { serve(conn, &e.dev, stop) };
    if let Ok(mut slot) = e.conn.lock() {
        *slot = None;
    }
    e.connected.store(false, Ordering::Relaxed);
    r
}

/// Every device's counters on stdout. `last`: stop the workers first (at
/// exit). With several devices each block starts with a `device` line.
fn print_all_stats(entries: &[Arc<DeviceEntry>], last: bool) {
    for e in entries {
        if last {
            e.dev.shared.stop.store(true, Ordering::Release);
        }
        let reports: Vec<WorkerReport> =
            e.dev.workers.iter().map(|w| if last { w.join() } else { w.report() }).collect();
        if entries.len() > 1 {
            println!("device name={} type={} endpoint={}", e.name, e.kind, e.endpoint);
        }
        if e.dev.blk.is_some() {
            print_blk_stats(&reports);
        } else {
            print_stats(&reports);
        }
    }
}

/// A blk device's counters: one line per request queue and a total.
fn print_blk_stats(reports: &[WorkerReport]) {
    let mut out = String::new();
    let mut t = vhostd_blk::BlkStats::default();
    let mut cycles = 0;
    for r in reports {
        let ring = &r.rings[0];
        let b = &ring.blk;
        out += &format!(
            "stats queue={} reads={} writes={} flushes={} discards={} write_zeroes={} get_ids={} bytes_read={} bytes_written={} ioerr={} unsupp={} no_status={} out_of_range={} read_only={} misaligned={} backend_errors={} bad_chains={} batches={} max_in_flight={} kicks={} notifies={} busy_cycles={} submit_calls={} sleeps={}\n",
            r.pair, b.reads, b.writes, b.flushes, b.discards, b.write_zeroes, b.get_ids, b.bytes_read, b.bytes_written,
            b.ioerr, b.unsupp, b.no_status, b.out_of_range, b.read_only, b.misaligned, b.backend_errors,
            ring.queue.bad_chains, b.batches, b.max_in_flight, ring.kicks, ring.notifies, ring.busy_cycles,
            r.blk_backend.submit_calls, r.sleeps
        );
        t.reads += b.reads;
        t.writes += b.writes;
        t.ioerr += b.ioerr + ring.queue.bad_chains;
        t.unsupp += b.unsupp;
        t.no_status += b.no_status;
        t.bytes_read += b.bytes_read;
        t.bytes_written += b.bytes_written;
        cycles += ring.busy_cycles;
    }
    let ios = t.reads + t.writes;
    let cpio = if ios > 0 { cycles as f64 / ios as f64 } else { 0.0 };
    out += &format!(
        "stats total reads={} writes={} bytes_read={} bytes_written={} errors={} unsupp={} no_status={} busy_cycles={cycles} cycles_per_io={cpio:.1}\n",
        t.reads, t.writes, t.bytes_read, t.bytes_written, t.ioerr, t.unsupp, t.no_status
    );
    let _ = io::stdout().write_all(out.as_bytes());
    let _ = io::stdout().flush();
}

/// Final counters on stdout, one line per queue and a total (a stable,
/// key=value format that tests and benchmarks parse).
fn print_stats(reports: &[WorkerReport]) {
    let mut out = String::new();
    let (mut txp, mut txb, mut rxp, mut rxb, mut dropped, mut bad, mut cycles) = (0, 0, 0, 0, 0, 0, 0);
    for r in reports {
        out += &format!(
            "stats worker={} busy_iters={} idle_iters={} sleeps={}\n",
            r.pair, r.busy_iters, r.idle_iters, r.sleeps
        );
        for (slot, name) in [(0usize, "rx"), (1, "tx"), (2, "ctrl")] {
            let ring = &r.rings[slot];
            if slot == 2 && ring.queue.chains == 0 && ring.queue.bad_chains == 0 {
                continue;
            }
            let index = if slot == 2 { 2 * reports.len() } else { 2 * r.pair as usize + slot };
            let backend_dropped = match slot {
                0 => r.backend.rx_dropped,
                1 => r.backend.tx_dropped,
                _ => 0,
            };
            let d = ring.dir.dropped + backend_dropped;
            out += &format!(
                "stats queue={index} dir={name} packets={} bytes={} dropped={d} bad_chains={} batches={} kicks={} notifies={} busy_cycles={} fast_chains={} batch4={} used_skipped={}\n",
                ring.dir.packets,
                ring.dir.bytes,
                ring.queue.bad_chains,
                ring.dir.batches,
                ring.kicks,
                ring.notifies,
                ring.busy_cycles,
                ring.queue.fast_chains,
                ring.queue.batch4,
                ring.queue.used_skipped
            );
            dropped += d;
            bad += ring.queue.bad_chains;
            cycles += ring.busy_cycles;
            match slot {
                0 => {
                    rxp += ring.dir.packets;
                    rxb += ring.dir.bytes;
                }
                1 => {
                    txp += ring.dir.packets;
                    txb += ring.dir.bytes;
                }
                _ => {}
            }
        }
    }
    let cpp = if txp + rxp > 0 { cycles as f64 / (txp + rxp) as f64 } else { 0.0 };
    out += &format!(
        "stats total guest_tx_packets={txp} guest_tx_bytes={txb} guest_rx_packets={rxp} guest_rx_bytes={rxb} dropped={dropped} bad_chains={bad} busy_cycles={cycles} cycles_per_packet={cpp:.1}\n"
    );
    let _ = io::stdout().write_all(out.as_bytes());
    let _ = io::stdout().flush();
}
