//! The control thread: listens on the socket, serves one frontend at a
//! time, survives disconnects, and stops cleanly on SIGINT/SIGTERM.

use std::io::{self, Write};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::{BackendReqHandler, Error as VuError};
use vhostd_net::CtrlState;

use crate::cli::{BlkArgs, NetArgs, WaitMode};
use crate::session::{Device, Session};
use crate::worker::{self, Engine, Mode, Shared, WorkerReport};
use vhostd_blk::{BlkDevice, BlkQueue};

/// Removes the socket file when dropped (also on error paths).
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Binds the socket; a stale socket file (nobody listening) is replaced,
/// a live one is an error.
fn bind(path: &Path) -> io::Result<UnixListener> {
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("--socket-path {}: another process is listening there", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
            UnixListener::bind(path)
        }
        Err(e) => Err(io::Error::new(e.kind(), format!("--socket-path {}: {e}", path.display()))),
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

const SET_VRING_ENABLE: u32 = 18;
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
        _ => return Ok(false),
    };
    if size != expected {
        // Let the generic handler refuse it.
        return Ok(false);
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

fn read_exact(conn: &UnixStream, buf: &mut [u8]) -> io::Result<()> {
    use std::io::Read;
    (&*conn).read_exact(buf)
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

/// Serves one connection until it ends. Returns true if a signal asked us to stop.
fn serve(conn: UnixStream, dev: &Arc<Device>, signals: &Signals) -> io::Result<bool> {
    let session = Arc::new(Mutex::new(Session::new(dev.clone())));
    let mut handler = BackendReqHandler::from_stream(conn.try_clone()?, session.clone());
    let mut refused = 0u64;
    let stop = loop {
        if wait_readable(&[conn.as_raw_fd(), signals.0])? == 1 {
            match signals.take() {
                SignalAsk::Stop => break true,
                SignalAsk::PrintStats => print_any_stats(dev),
                SignalAsk::Nothing => {}
            }
            continue;
        }
        match handle_own_msg(&conn, &session) {
            Ok(true) => continue,
            Ok(false) => {}
            Err(e) => {
                tracing::info!("frontend connection ended: {e}");
                break false;
            }
        }
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
    Ok(stop)
}

/// Runs the net device until SIGINT/SIGTERM.
pub fn run_net(args: NetArgs) -> io::Result<()> {
    let signals = Signals::new()?;
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
    // The XDP program stays attached while this lives: until we return.
    let _af_xdp = backends.af_xdp;
    let listener = bind(&args.socket_path)?;
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
        workers.push(worker::spawn(pair as u16, Engine::Net(backend), mode, cpu, shared.clone())?);
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
    run_device(listener, &args.socket_path, dev, signals)
}

fn wait_mode(poll: bool, mode: WaitMode, poll_idle_us: u64) -> Mode {
    match (poll, mode) {
        (true, _) | (false, WaitMode::Poll) => Mode::Poll,
        (false, WaitMode::Interrupt) => Mode::Interrupt,
        (false, WaitMode::Adaptive) => Mode::Adaptive { idle: std::time::Duration::from_micros(poll_idle_us) },
    }
}

/// Runs the blk device until SIGINT/SIGTERM.
pub fn run_blk(args: BlkArgs) -> io::Result<()> {
    let signals = Signals::new()?;
    // The disk first: a path that cannot be opened leaves nothing behind.
    let (disk, backends) = vhostd_block_backends::open(&args.backend, args.queues as usize, BACKEND_DEPTH)
        .map_err(|e| io::Error::new(e.kind(), format!("--backend {}: {e}", args.backend_description())))?;
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
        if disk.write_zeroes { ", write-zeroes" } else { "" },
        args.queues
    );
    let listener = bind(&args.socket_path)?;
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
        workers.push(worker::spawn(i as u16, engine, mode, cpu, shared.clone())?);
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
    run_device(listener, &args.socket_path, dev, signals)
}

/// Requests in flight per blk queue, at most.
const BACKEND_DEPTH: usize = 256;

/// Serves frontends one after the other until SIGINT/SIGTERM, then stops
/// the workers and prints their counters. The socket file goes on return.
fn run_device(listener: UnixListener, socket_path: &Path, dev: Arc<Device>, signals: Signals) -> io::Result<()> {
    let _socket_file = SocketFile(socket_path.to_path_buf());
    eprintln!("vhostd: listening on {}", socket_path.display());
    loop {
        if wait_readable(&[listener.as_raw_fd(), signals.0])? == 1 {
            match signals.take() {
                SignalAsk::Stop => break,
                SignalAsk::PrintStats => print_any_stats(&dev),
                SignalAsk::Nothing => {}
            }
            continue;
        }
        let (conn, _) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                continue;
            }
        };
        tracing::info!("frontend connected");
        if serve(conn, &dev, &signals)? {
            break;
        }
    }
    tracing::info!("stopping");
    dev.shared.stop.store(true, Ordering::Release);
    let dev = Arc::try_unwrap(dev).map_err(|_| io::Error::other("device still in use at shutdown"))?;
    let blk = dev.blk.is_some();
    let reports: Vec<WorkerReport> = dev.workers.into_iter().map(|w| w.join()).collect();
    if blk {
        print_blk_stats(&reports);
    } else {
        print_stats(&reports);
    }
    Ok(())
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

fn print_any_stats(dev: &Device) {
    let reports: Vec<WorkerReport> = dev.workers.iter().map(|w| w.report()).collect();
    if dev.blk.is_some() {
        print_blk_stats(&reports);
    } else {
        print_stats(&reports);
    }
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
