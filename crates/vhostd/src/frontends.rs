//! The one thread that serves every device's frontend: it listens on each
//! device's socket (or connects, or holds the socket handed in), and
//! answers each connection's vhost-user messages as they arrive, whole.
//! A host daemon's thread count is then its workers plus a few, whatever
//! the number of devices.
//!
//! One frontend at a time per device, as before: while a device has a
//! connection its listening socket is left out of the epoll set (the next
//! frontend waits in the backlog). A frontend that stops mid-message holds
//! only its own connection (`connection::Conn` answers whole messages
//! only); one that floods its socket is answered a burst at a time, in
//! turn with the others; one that leaves its replies unread is dropped
//! before a reply could block. Listening sockets are non-blocking, and
//! `--client` connects without waiting on a full backlog: nothing here
//! waits on one frontend. A panic while serving a device marks that device
//! failed and drops it; the others go on.
//!
//! Nor on a backend: a message that may stop a ring with requests in
//! flight (blk: GET_VRING_BASE, a reset, a memory change, the connection's
//! end) waits until they complete, which on a hung disk is as long as it
//! hangs. Such a message goes, with its connection, to a thread of its own
//! (`vhostd-fe-wait`) that brings the connection back when done; the
//! device's other events wait for it, every other device is served.
//!
//! It also hears the host's link events (`link_events`: an rtnetlink
//! socket in its epoll set, no timer): on one, each vfio-user connection
//! checks its device's link state and, if it changed, tells the driver
//! (a configuration change interrupt; `VfioConn::link_event`).

use std::collections::VecDeque;
use std::io;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::connection::{Conn, Step};
use crate::endpoint::Endpoint;
use crate::link_events::LinkEvents;
use crate::registry::DeviceEntry;
use crate::spec::Transport;
use crate::vfio::VfioConn;

/// A connection of either transport, as this loop serves it.
pub enum Link {
    /// vhost-user.
    Vhost(Conn),
    /// vfio-user (boxed: the device model is large).
    Vfio(Box<VfioConn>),
}

impl Link {
    fn new(stream: UnixStream, entry: &DeviceEntry) -> io::Result<Link> {
        Ok(match entry.transport {
            Transport::VhostUser => Link::Vhost(Conn::new(stream, &entry.served)?),
            Transport::VfioUser => Link::Vfio(Box::new(VfioConn::new(stream, &entry.served)?)),
        })
    }

    fn stream(&self) -> &UnixStream {
        match self {
            Link::Vhost(c) => c.stream(),
            Link::Vfio(c) => c.stream(),
        }
    }

    fn finish_may_wait(&self) -> bool {
        match self {
            Link::Vhost(c) => c.finish_may_wait(),
            Link::Vfio(c) => c.finish_may_wait(),
        }
    }

    fn serve_ready(&mut self, hup: bool, hold_slow: bool) -> Step {
        match self {
            Link::Vhost(c) => c.serve_ready(hup, hold_slow),
            Link::Vfio(c) => c.serve_ready(hup),
        }
    }

    fn finish(self) {
        match self {
            Link::Vhost(c) => c.finish(),
            Link::Vfio(c) => (*c).finish(),
        }
    }
}

/// How long a `--client` device waits between attempts to connect.
const RETRY: Duration = Duration::from_secs(1);

enum Cmd {
    /// Serve a device's endpoint.
    Add(Arc<DeviceEntry>, Endpoint),
    /// Stop serving a device (its connection ended, its socket file
    /// removed); answered once done.
    Remove(String, Sender<()>),
    /// Stop serving every device and end the thread; answered once done.
    Stop(Sender<()>),
}

/// The handle on the thread.
pub struct Frontends {
    tx: Mutex<Sender<Cmd>>,
    wake: EventFd,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Frontends {
    /// Starts the thread; `done` is written (1) whenever a device ends by
    /// itself (its --fd connection closed, or it failed).
    pub fn start(done: Arc<EventFd>) -> io::Result<Frontends> {
        let (tx, rx) = channel();
        let wake = EventFd::new(EFD_NONBLOCK)?;
        let (back_tx, back_rx) = channel();
        // Made here, before the seccomp filter (socket and bind are
        // building calls). Without it (netlink refused) links are still
        // read live, but a guest over vfio-user hears of no change.
        let links = LinkEvents::new()
            .inspect_err(|e| tracing::warn!("no link events (vfio-user guests miss link changes): {e}"))
            .ok();
        let lp = Loop {
            epoll: Epoll::new()?,
            wake: wake.try_clone()?,
            rx,
            done,
            devs: Vec::new(),
            ready: VecDeque::new(),
            back_tx,
            back_rx,
            next_id: 0,
            stopping: false,
            links,
        };
        lp.epoll.ctl(ControlOperation::Add, lp.wake.as_raw_fd(), EpollEvent::new(EventSet::IN, WAKE))?;
        if let Some(l) = &lp.links {
            lp.epoll.ctl(ControlOperation::Add, l.fd(), EpollEvent::new(EventSet::IN, LINKS))?;
        }
        let thread = std::thread::Builder::new().name("vhostd-frontends".into()).spawn(move || lp.run())?;
        Ok(Frontends { tx: Mutex::new(tx), wake, thread: Mutex::new(Some(thread)) })
    }

    fn send(&self, cmd: Cmd) {
        if let Ok(tx) = self.tx.lock() {
            let _ = tx.send(cmd);
        }
        let _ = self.wake.write(1);
    }

    /// Starts serving a device.
    pub fn add(&self, entry: Arc<DeviceEntry>, endpoint: Endpoint) {
        self.send(Cmd::Add(entry, endpoint));
    }

    /// Stops serving device `name` and waits until it is done.
    pub fn remove(&self, name: &str) {
        let (reply, rx) = channel();
        self.send(Cmd::Remove(name.to_string(), reply));
        let _ = rx.recv();
    }

    /// Stops serving every device and ends the thread.
    pub fn stop(&self) {
        let (reply, rx) = channel();
        self.send(Cmd::Stop(reply));
        let _ = rx.recv();
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

const WAKE: u64 = u64::MAX;
/// The link events socket.
const LINKS: u64 = u64::MAX - 1;
/// Tokens: a device's slot, shifted, and which of its descriptors.
const LISTENER: u64 = 0;
const CONNECTION: u64 = 1;

fn token(slot: usize, kind: u64) -> u64 {
    ((slot as u64) << 1) | kind
}

/// Connects to a listening frontend without waiting: a peer whose backlog
/// is full (EAGAIN) is tried again later, like one not listening yet.
fn connect_now(path: &std::path::Path) -> io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "socket path too long"));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a socket we just made and now own.
    let stream = unsafe { <UnixStream as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len();
    // SAFETY: addr is a valid sockaddr_un of at least `len` bytes.
    let r = unsafe {
        libc::connect(fd, &addr as *const libc::sockaddr_un as *const libc::sockaddr, len as libc::socklen_t)
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// A device being served.
struct Dev {
    entry: Arc<DeviceEntry>,
    endpoint: Endpoint,
    conn: Option<Link>,
    /// A --client device's next attempt to connect.
    retry_at: Option<Instant>,
    /// Unique per device added (a slot is reused after a removal).
    id: u64,
    /// Its connection is with a thread that may wait (`Back` returns it).
    away: bool,
    /// A removal asked for while away: done on return.
    remove_after: Option<Removal>,
}

/// A device to drop once its rings have stopped.
#[derive(Default)]
struct Removal {
    /// `ctl remove`s waiting for it.
    replies: Vec<Sender<()>>,
    /// It failed (a panic): the main loop hears of it when it is gone.
    by_itself: bool,
}

/// What a thread that may wait brings back.
enum Back {
    /// Messages answered: the connection, and what it came to (Err: a panic).
    Served { slot: usize, id: u64, conn: Link, step: Result<Step, ()> },
    /// A connection ended (its rings stopped); whether that panicked.
    Finished { slot: usize, id: u64, panicked: bool },
}

struct Loop {
    epoll: Epoll,
    wake: EventFd,
    rx: Receiver<Cmd>,
    done: Arc<EventFd>,
    devs: Vec<Option<Dev>>,
    /// Connections with whole messages possibly waiting (a burst was cut).
    ready: VecDeque<usize>,
    back_tx: Sender<Back>,
    back_rx: Receiver<Back>,
    next_id: u64,
    /// Shutting down: nothing more goes away.
    stopping: bool,
    /// The host's link events, if netlink could be had.
    links: Option<LinkEvents>,
}

impl Loop {
    fn run(mut self) {
        let mut events = vec![EpollEvent::default(); 64];
        loop {
            let timeout = if !self.ready.is_empty() { 0 } else { self.next_retry_ms() };
            let n = match self.epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => {
                    tracing::error!("serving frontends: epoll: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    0
                }
            };
            for ev in &events[..n] {
                let t = ev.data();
                if t == WAKE {
                    let _ = self.wake.read();
                    self.returned();
                    if self.commands() {
                        return;
                    }
                    continue;
                }
                if t == LINKS {
                    self.link_events();
                    continue;
                }
                let slot = (t >> 1) as usize;
                if t & 1 == LISTENER {
                    self.accept(slot);
                } else {
                    let hup = ev.event_set().intersects(EventSet::HANG_UP | EventSet::READ_HANG_UP | EventSet::ERROR);
                    self.serve(slot, hup);
                }
            }
            // Bursts cut short get their turn after everyone else's.
            for _ in 0..self.ready.len() {
                if let Some(slot) = self.ready.pop_front() {
                    self.serve(slot, false);
                }
            }
            self.retry_clients();
        }
    }

    /// The host's links changed: each vfio-user connection checks its
    /// device's (vhost-user frontends keep the net config themselves).
    fn link_events(&mut self) {
        if !self.links.as_ref().is_some_and(LinkEvents::drain) {
            return;
        }
        for slot in 0..self.devs.len() {
            // A connection away (ending) is not told.
            if !matches!(self.devs[slot], Some(Dev { conn: Some(Link::Vfio(_)), .. })) {
                continue;
            }
            let _span = self.span(slot);
            if let Some(Some(Dev { conn: Some(Link::Vfio(c)), .. })) = self.devs.get_mut(slot) {
                c.link_event();
            }
        }
    }

    /// Handles queued commands; true when the thread is to end.
    fn commands(&mut self) -> bool {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                Cmd::Add(entry, endpoint) => self.add(entry, endpoint),
                Cmd::Remove(name, reply) => {
                    match self.devs.iter().position(|d| d.as_ref().is_some_and(|d| d.entry.name == name)) {
                        Some(slot) => self.remove(slot, reply),
                        None => {
                            let _ = reply.send(());
                        }
                    }
                }
                Cmd::Stop(reply) => {
                    // Connections away come back first (however long
                    // their backends take: a shutdown waits for them).
                    self.stopping = true;
                    while self.devs.iter().flatten().any(|d| d.away) {
                        match self.back_rx.recv() {
                            Ok(b) => self.handle_back(b),
                            Err(_) => break,
                        }
                    }
                    for slot in 0..self.devs.len() {
                        self.drop_dev(slot);
                    }
                    let _ = reply.send(());
                    return true;
                }
            }
        }
        false
    }

    fn add(&mut self, entry: Arc<DeviceEntry>, endpoint: Endpoint) {
        let slot = self.devs.iter().position(Option::is_none).unwrap_or_else(|| {
            self.devs.push(None);
            self.devs.len() - 1
        });
        self.next_id += 1;
        let dev =
            Dev { entry, endpoint, conn: None, retry_at: None, id: self.next_id, away: false, remove_after: None };
        let handed = match &dev.endpoint {
            Endpoint::Conn(s) => s.try_clone().ok(),
            _ => None,
        };
        let client = matches!(dev.endpoint, Endpoint::Client(_));
        self.devs[slot] = Some(dev);
        match handed {
            Some(stream) => {
                let _span = self.span(slot);
                tracing::info!(
                    "serving the frontend on {}",
                    self.devs[slot].as_ref().map_or("", |d| &d.entry.endpoint)
                );
                self.connected(slot, stream);
            }
            None if client => self.connect(slot),
            None => {
                if let Some(Some(Dev { endpoint: Endpoint::Listen(l, _), .. })) = self.devs.get(slot) {
                    let _ = l.set_nonblocking(true);
                }
                self.listen(slot, true)
            }
        }
    }

    fn span(&self, slot: usize) -> tracing::span::EnteredSpan {
        let name = self.devs.get(slot).and_then(|d| d.as_ref()).map(|d| d.entry.name.clone()).unwrap_or_default();
        tracing::info_span!("dev", device = %name).entered()
    }

    /// Puts a device's listening socket in the epoll set (`on`) or takes it out.
    fn listen(&mut self, slot: usize, on: bool) {
        let Some(Some(d)) = self.devs.get(slot) else { return };
        if let Endpoint::Listen(l, _) = &d.endpoint {
            let (op, ev) = if on {
                (ControlOperation::Add, EpollEvent::new(EventSet::IN, token(slot, LISTENER)))
            } else {
                (ControlOperation::Delete, EpollEvent::default())
            };
            let _ = self.epoll.ctl(op, l.as_raw_fd(), ev);
        }
    }

    fn accept(&mut self, slot: usize) {
        let _span = self.span(slot);
        let Some(Some(d)) = self.devs.get(slot) else { return };
        let Endpoint::Listen(l, _) = &d.endpoint else { return };
        match l.accept() {
            Ok((stream, _)) => {
                tracing::info!("frontend connected");
                let _ = stream.set_nonblocking(false);
                self.listen(slot, false);
                self.connected(slot, stream);
            }
            // The frontend left the backlog already (or an event of a
            // device since removed).
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::warn!("accept failed: {e}"),
        }
    }

    /// A --client device tries to connect now.
    fn connect(&mut self, slot: usize) {
        let _span = self.span(slot);
        let Some(Some(d)) = self.devs.get_mut(slot) else { return };
        let Endpoint::Client(path) = &d.endpoint else { return };
        match connect_now(path) {
            Ok(stream) => {
                tracing::info!("connected to {}", path.display());
                d.retry_at = None;
                self.connected(slot, stream);
            }
            Err(e) => {
                tracing::debug!("connect to {}: {e}", path.display());
                d.retry_at = Some(Instant::now() + RETRY);
            }
        }
    }

    /// Until the next --client attempt, in ms (-1: none).
    fn next_retry_ms(&self) -> i32 {
        let now = Instant::now();
        self.devs
            .iter()
            .flatten()
            .filter_map(|d| d.retry_at)
            .map(|t| t.saturating_duration_since(now).as_millis().min(i32::MAX as u128) as i32 + 1)
            .min()
            .unwrap_or(-1)
    }

    /// --client devices due to try again connect.
    fn retry_clients(&mut self) {
        let now = Instant::now();
        let due: Vec<usize> = (0..self.devs.len())
            .filter(|&s| self.devs[s].as_ref().is_some_and(|d| d.retry_at.is_some_and(|t| t <= now)))
            .collect();
        for slot in due {
            self.connect(slot);
        }
    }

    /// A frontend is connected to device `slot`: its messages are served.
    fn connected(&mut self, slot: usize, stream: UnixStream) {
        let Some(Some(d)) = self.devs.get_mut(slot) else { return };
        let conn = match Link::new(stream, &d.entry) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("cannot serve the connection: {e}");
                self.ended(slot);
                return;
            }
        };
        d.entry.connected();
        let fd = conn.stream().as_raw_fd();
        d.conn = Some(conn);
        let ev = EventSet::IN | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED;
        let _ = self.epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(ev, token(slot, CONNECTION)));
        // Messages may have arrived before the socket joined the set.
        self.serve(slot, false);
    }

    /// Answers what device `slot`'s frontend sent.
    fn serve(&mut self, slot: usize, hup: bool) {
        let _span = self.span(slot);
        let hold_slow = !self.stopping;
        let Some(Some(d)) = self.devs.get_mut(slot) else { return };
        // Away: its events wait (it is served again on return).
        let Some(conn) = d.conn.as_mut() else { return };
        let hup = hup || crate::connection::hung_up(conn.stream());
        let step = serve_caught(conn, hup, hold_slow);
        self.stepped(slot, step, hup);
    }

    /// Acts on what serving device `slot`'s connection came to.
    fn stepped(&mut self, slot: usize, step: Result<Step, ()>, hup: bool) {
        let Some(Some(d)) = self.devs.get_mut(slot) else { return };
        let entry = d.entry.clone();
        match step {
            Ok(Step::Wait) => {}
            Ok(Step::More) => {
                if !self.ready.contains(&slot) {
                    self.ready.push_back(slot);
                }
            }
            Ok(Step::End) => self.ended(slot),
            Ok(Step::Slow) => self.send_away(slot, hup),
            Err(()) => {
                tracing::error!("device stopped serving: internal error (panic); see the log");
                entry.fail("internal error (panic); see the log".into());
                self.remove_with(slot, Removal { replies: Vec::new(), by_itself: true });
            }
        }
    }

    /// Runs `job` on a thread that may wait, with device `slot`'s
    /// connection (taken out of the device meanwhile); what it returns comes
    /// back through `returned`. None: no thread could start, and the
    /// connection is handed back to be served here.
    fn go_away(&mut self, slot: usize, job: impl FnOnce(Link, usize, u64) -> Back + Send + 'static) -> Option<Link> {
        let Some(Some(d)) = self.devs.get_mut(slot) else { return None };
        let conn = d.conn.take()?;
        let (id, tx) = (d.id, self.back_tx.clone());
        let Ok(wake) = self.wake.try_clone() else { return Some(conn) };
        // Held here too, so a thread that cannot start gives it back.
        let held = Arc::new(Mutex::new(Some(conn)));
        let theirs = held.clone();
        let name = d.entry.name.clone();
        let spawned = std::thread::Builder::new().name("vhostd-fe-wait".into()).spawn(move || {
            let _span = tracing::info_span!("dev", device = %name).entered();
            let conn = theirs.lock().ok().and_then(|mut c| c.take());
            if let Some(conn) = conn {
                let _ = tx.send(job(conn, slot, id));
                let _ = wake.write(1);
            }
        });
        if let Err(e) = spawned {
            tracing::warn!("no thread to wait on the backend ({e}): waiting here");
            return held.lock().ok().and_then(|mut c| c.take());
        }
        d.away = true;
        None
    }

    /// Device `slot`'s next message may wait on the backend: it and the rest
    /// of the burst are answered on a thread that may wait.
    fn send_away(&mut self, slot: usize, hup: bool) {
        let back = self.go_away(slot, move |mut conn, slot, id| {
            let step = serve_caught(&mut conn, hup, false);
            Back::Served { slot, id, conn, step }
        });
        if let Some(mut conn) = back {
            let step = serve_caught(&mut conn, hup, false);
            if let Some(Some(d)) = self.devs.get_mut(slot) {
                d.conn = Some(conn);
            }
            self.stepped(slot, step, hup);
        }
    }

    /// Handles what threads that may wait brought back.
    fn returned(&mut self) {
        while let Ok(b) = self.back_rx.try_recv() {
            self.handle_back(b);
        }
    }

    fn handle_back(&mut self, b: Back) {
        let (slot, id) = match &b {
            Back::Served { slot, id, .. } | Back::Finished { slot, id, .. } => (*slot, *id),
        };
        let _span = self.span(slot);
        let Some(Some(d)) = self.devs.get_mut(slot).filter(|d| d.as_ref().is_some_and(|d| d.id == id)) else {
            // Cannot happen: a device away is never removed. Stop its rings.
            if let Back::Served { conn, .. } = b {
                finish_here(conn, None);
            }
            return;
        };
        d.away = false;
        let removals = d.remove_after.take();
        match b {
            Back::Served { conn, step, .. } => {
                d.conn = Some(conn);
                if let Some(r) = removals {
                    // Its rings may still run (a GET_VRING_BASE stops one):
                    // the finish may wait again, on a thread again.
                    return self.remove_with(slot, r);
                }
                match step {
                    // Events that came while it was away were not acted on.
                    Ok(Step::Wait) | Ok(Step::More) | Ok(Step::Slow) => {
                        if !self.ready.contains(&slot) {
                            self.ready.push_back(slot);
                        }
                    }
                    other => self.stepped(slot, other, false),
                }
            }
            Back::Finished { panicked, .. } => {
                if panicked {
                    d.entry.fail("internal error (panic) ending a connection; see the log".into());
                }
                match removals {
                    Some(r) => self.remove_now(slot, r),
                    None => self.after_end(slot),
                }
            }
        }
    }

    /// `vhostd ctl remove`: device `slot` goes, answered once it has (its
    /// rings stopped: on a thread that may wait, if they may).
    fn remove(&mut self, slot: usize, reply: Sender<()>) {
        self.remove_with(slot, Removal { replies: vec![reply], by_itself: false });
    }

    /// Drops device `slot` once its rings have stopped (on a thread that
    /// may wait, if they may), then answers `r`.
    fn remove_with(&mut self, slot: usize, mut r: Removal) {
        let Some(Some(d)) = self.devs.get_mut(slot) else {
            for reply in r.replies {
                let _ = reply.send(());
            }
            return;
        };
        if d.away {
            let later = d.remove_after.get_or_insert_with(Removal::default);
            later.replies.append(&mut r.replies);
            later.by_itself |= r.by_itself;
            return;
        }
        if self.end_conn(slot) {
            self.remove_now(slot, r);
        } else if let Some(Some(d)) = self.devs.get_mut(slot) {
            d.remove_after = Some(r);
        }
    }

    fn remove_now(&mut self, slot: usize, r: Removal) {
        self.drop_dev(slot);
        for reply in r.replies {
            let _ = reply.send(());
        }
        if r.by_itself {
            self.device_ended_by_itself();
        }
    }

    /// Device `slot`'s connection ended: its rings stop; it waits for the
    /// next frontend (listening), connects again (--client), or ends (--fd).
    fn ended(&mut self, slot: usize) {
        // Else it finishes on a thread: after_end on its return.
        if self.end_conn(slot) {
            self.after_end(slot);
        }
    }

    /// Ends device `slot`'s connection, if it has one: here, or, when
    /// stopping its rings may wait on the backend, on a thread that may
    /// wait (`Back::Finished` follows). True if done here.
    fn end_conn(&mut self, slot: usize) -> bool {
        let Some(Some(d)) = self.devs.get_mut(slot) else { return true };
        let Some(fd) = d.conn.as_ref().map(|c| c.stream().as_raw_fd()) else { return true };
        let _ = self.epoll.ctl(ControlOperation::Delete, fd, EpollEvent::default());
        self.ready.retain(|&s| s != slot);
        let wait = !self.stopping && d.conn.as_ref().is_some_and(Link::finish_may_wait);
        let here = if wait { self.go_away(slot, finish_job) } else { d.conn.take() };
        match here {
            None => !wait,
            Some(conn) => {
                finish_here(conn, self.devs[slot].as_ref());
                true
            }
        }
    }

    /// Device `slot` after its connection ended and its rings stopped.
    fn after_end(&mut self, slot: usize) {
        let Some(Some(d)) = self.devs.get_mut(slot) else { return };
        d.entry.disconnected();
        let (listen, client) = (matches!(d.endpoint, Endpoint::Listen(..)), matches!(d.endpoint, Endpoint::Client(_)));
        if listen {
            self.listen(slot, true);
        } else if client {
            // Again at once, from the loop (not from here: a peer that
            // closes every connection must not recurse).
            d.retry_at = Some(Instant::now());
        } else {
            self.drop_dev(slot);
            self.device_ended_by_itself();
        }
    }

    /// Tells the main loop a device ended by itself (`drop_dev` marked it).
    fn device_ended_by_itself(&mut self) {
        let _ = self.done.write(1);
    }

    /// Stops serving device `slot`: its connection ends (rings stopped,
    /// waiting here), its endpoint goes (the socket file is removed).
    fn drop_dev(&mut self, slot: usize) {
        let Some(mut d) = self.devs.get_mut(slot).and_then(Option::take) else { return };
        self.ready.retain(|&s| s != slot);
        if let Some(c) = d.conn.take() {
            let _ = self.epoll.ctl(ControlOperation::Delete, c.stream().as_raw_fd(), EpollEvent::default());
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.finish()));
        }
        if let Endpoint::Listen(l, _) = &d.endpoint {
            let _ = self.epoll.ctl(ControlOperation::Delete, l.as_raw_fd(), EpollEvent::default());
        }
        d.entry.disconnected();
        d.entry.ended.store(true, Ordering::Release);
    }
}

/// Serves `conn` (`Conn::serve_ready`); Err: it panicked.
fn serve_caught(conn: &mut Link, hup: bool, hold_slow: bool) -> Result<Step, ()> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.serve_ready(hup, hold_slow))).map_err(|_| ())
}

/// Ends a connection on a thread that may wait (its rings stop).
fn finish_job(conn: Link, slot: usize, id: u64) -> Back {
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.finish())).is_err();
    Back::Finished { slot, id, panicked }
}

/// Ends a connection here (its rings stop); a panic marks the device failed.
fn finish_here(conn: Link, dev: Option<&Dev>) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| conn.finish())).is_err() {
        if let Some(d) = dev {
            d.entry.fail("internal error (panic) ending a connection; see the log".into());
        }
    }
}
