//! The AF_XDP backend: one socket per queue pair, each with a UMEM of its
//! own. Guest frames are copied straight into UMEM frames and handed to the
//! TX ring; received frames are lent to the device in place (it copies them
//! into guest buffers) and go back on the fill ring once delivered. One
//! copy each way, one ring publish and at most one wake-up syscall per batch.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use xsk::bpf::{self, XdpMode, XskMap};
use xsk::{BindMode, Umem, Xsk, XskConfig, FRAME_SIZE};

use crate::link::Link;
use crate::{BackendStats, FrameBuf, NetBackend};

/// Everything `--backend af-xdp,...` can say (QEMU's `-netdev af-xdp` options).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AfXdpSpec {
    /// The interface.
    pub ifname: String,
    /// Where the XDP program runs; None: native, falling back to skb.
    pub mode: Option<XdpMode>,
    /// Bind with XDP_COPY even where zero-copy is possible.
    pub force_copy: bool,
    /// Sockets (queue pairs) asked for; must match `--queues` when given.
    pub queues: Option<u32>,
    /// The first device queue.
    pub start_queue: u32,
    /// Load no program: sockets come from `sock_fds`, or go into a map
    /// given by `xsks_map_fd` / `map_path`.
    pub inhibit: bool,
    /// An XSKMAP descriptor to insert our sockets into.
    pub xsks_map_fd: Option<RawFd>,
    /// Open AF_XDP sockets, one per queue pair, not yet bound.
    pub sock_fds: Vec<RawFd>,
    /// A pinned XSKMAP to insert our sockets into.
    pub map_path: Option<PathBuf>,
    /// The map slot of the first socket.
    pub map_start_index: u32,
    /// RX (and fill) ring size.
    pub rx_ring: u32,
    /// TX (and completion) ring size.
    pub tx_ring: u32,
    /// SO_PREFER_BUSY_POLL / SO_BUSY_POLL / SO_BUSY_POLL_BUDGET.
    pub busy_poll: bool,
}

impl AfXdpSpec {
    /// Defaults for interface `ifname`.
    pub fn new(ifname: &str) -> AfXdpSpec {
        AfXdpSpec {
            ifname: ifname.to_string(),
            mode: None,
            force_copy: false,
            queues: None,
            start_queue: 0,
            inhibit: false,
            xsks_map_fd: None,
            sock_fds: Vec::new(),
            map_path: None,
            map_start_index: 0,
            rx_ring: 1024,
            tx_ring: 1024,
            busy_poll: false,
        }
    }

    /// Checks the options against each other and `pairs` (QEMU's rules).
    pub fn check(&self, pairs: usize) -> Result<(), String> {
        self.check_options()?;
        if let Some(q) = self.queues {
            if q as usize != pairs {
                return Err(format!(
                    "queues={q} but --queues {pairs}: one socket per queue pair, give the same number"
                ));
            }
        }
        if !self.sock_fds.is_empty() && self.sock_fds.len() != pairs {
            return Err(format!(
                "sock-fds has {} descriptor(s) for {pairs} queue pair(s): give one per queue pair",
                self.sock_fds.len()
            ));
        }
        Ok(())
    }

    /// Checks the options against each other.
    pub fn check_options(&self) -> Result<(), String> {
        let has_map = self.xsks_map_fd.is_some() || self.map_path.is_some();
        if !self.inhibit && (has_map || !self.sock_fds.is_empty()) {
            return Err("sock-fds, xsks-map-fd and map-path need inhibit=on (vhostd loads no program then)".into());
        }
        if self.inhibit && !has_map && self.sock_fds.is_empty() {
            return Err(
                "inhibit=on needs sock-fds=, xsks-map-fd= or map-path= (who else steers frames to our sockets?)".into(),
            );
        }
        if self.xsks_map_fd.is_some() && self.map_path.is_some() {
            return Err("xsks-map-fd and map-path both name a map: give one".into());
        }
        if !self.sock_fds.is_empty() && self.map_path.is_some() {
            return Err(
                "sock-fds and map-path exclude each other (as in QEMU): sockets passed in are already in their map"
                    .into(),
            );
        }
        if self.map_start_index != 0 && !has_map {
            return Err("map-start-index needs xsks-map-fd= or map-path=".into());
        }
        for (what, n) in [("rx-ring", self.rx_ring), ("tx-ring", self.tx_ring)] {
            if !n.is_power_of_two() || !(64..=16384).contains(&n) {
                return Err(format!("{what}={n}: want a power of two from 64 to 16384"));
            }
        }
        Ok(())
    }
}

/// The device-wide side: the attached program (detached when this drops,
/// or when the process ends however it ends) and what was chosen.
pub struct AfXdpControl {
    /// The interface.
    pub ifname: String,
    /// Where our program runs; None when another program steers (inhibit).
    pub mode: Option<XdpMode>,
    /// The sockets are bound in zero-copy mode.
    pub zero_copy: bool,
    /// Device queues used.
    pub queues: std::ops::Range<u32>,
    _link: Option<OwnedFd>,
    _map: Option<XskMap>,
}

impl std::fmt::Display for AfXdpControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let prog = match self.mode {
            Some(XdpMode::Native) => "native (driver) XDP",
            Some(XdpMode::Skb) => "skb (generic) XDP",
            None => "program not ours (inhibit=on)",
        };
        write!(
            f,
            "AF_XDP {}: {prog}, {} mode, device queues {}..{}",
            self.ifname,
            if self.zero_copy { "zero-copy" } else { "copy" },
            self.queues.start,
            self.queues.end - 1
        )
    }
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("--backend af-xdp: {msg}"))
}

fn with(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("--backend af-xdp: {what}: {e}"))
}

/// Takes ownership of an inherited descriptor after checking it is open.
fn adopt_fd(fd: RawFd, what: &str) -> io::Result<OwnedFd> {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(bad(format!("{what}={fd}: not an open descriptor")));
    }
    // SAFETY: fd is open and, by the command line's word, ours to own.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: F_SETFD with FD_CLOEXEC on a descriptor we own.
    unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(owned)
}

/// Opens the sockets of `pairs` queue pairs, with the program and map
/// unless `inhibit`. On error nothing stays attached.
pub fn open(spec: &AfXdpSpec, pairs: usize) -> io::Result<(Vec<AfXdp>, AfXdpControl, Link)> {
    spec.check(pairs).map_err(bad)?;
    let name = &spec.ifname;
    let ifindex = xsk::ifindex(name).map_err(|_| bad(format!("no interface '{name}' in this network namespace")))?;
    let queues = spec.start_queue..spec.start_queue + pairs as u32;
    if let Some(n) = xsk::queue_count(name) {
        if queues.end > n {
            return Err(bad(format!(
                "queues {}..{} (start-queue={}, {pairs} pair(s)) but {name} has {n} queue(s)",
                queues.start,
                queues.end - 1,
                spec.start_queue
            )));
        }
    }
    let mut seen = std::collections::HashSet::new();
    let given: Vec<OwnedFd> = spec
        .sock_fds
        .iter()
        .map(|&fd| {
            if !seen.insert(fd) {
                return Err(bad(format!("sock-fds: descriptor {fd} given twice")));
            }
            let owned = adopt_fd(fd, "sock-fds")?;
            if !Xsk::is_xdp_socket(fd) {
                return Err(bad(format!("sock-fds: descriptor {fd} is not an AF_XDP socket")));
            }
            Ok(owned)
        })
        .collect::<io::Result<_>>()?;
    // The map our sockets go into, at which slot, and the program.
    let (map, first_slot, link, mode) = if spec.inhibit {
        let map = match (&spec.map_path, spec.xsks_map_fd) {
            (Some(p), _) => Some(XskMap::open_pinned(p).map_err(|e| with(e, "map-path"))?),
            (None, Some(fd)) => {
                Some(XskMap::adopt(adopt_fd(fd, "xsks-map-fd")?).map_err(|e| with(e, &format!("xsks-map-fd={fd}")))?)
            }
            (None, None) => None,
        };
        (map, spec.map_start_index, None, None)
    } else {
        let entries = xsk::queue_count(name).unwrap_or(0).max(queues.end);
        let r = bpf::redirect(ifindex, entries, spec.mode).map_err(|e| with(e, name))?;
        if let Some(native) = &r.native_refused {
            tracing::info!("{name}: native XDP refused ({native}); using skb mode");
        }
        (Some(r.map), queues.start, Some(r.link), Some(r.mode))
    };
    if let Some(m) = &map {
        let last = first_slot as u64 + pairs as u64 - 1;
        if last >= m.entries() as u64 {
            return Err(bad(format!("map slots {first_slot}..{last} but the XSKMAP has {} entries", m.entries())));
        }
    }
    let mut sockets = Vec::with_capacity(pairs);
    let mut given = given.into_iter();
    for i in 0..pairs as u32 {
        let fd = match given.next() {
            Some(fd) => fd,
            None => Xsk::socket().map_err(|e| bad(e.to_string()))?,
        };
        let q = AfXdp::new(fd, ifindex, queues.start + i, spec)
            .map_err(|e| with(e, &format!("{name} queue {}", queues.start + i)))?;
        if let Some(m) = &map {
            m.insert(first_slot + i, q.xsk.fd()).map_err(|e| with(e, name))?;
        }
        sockets.push(q);
    }
    let zero_copy = sockets.iter().all(|s| s.xsk.zero_copy());
    let link_watch = Link::new(name)?;
    let control = AfXdpControl { ifname: name.clone(), mode, zero_copy, queues, _link: link, _map: map };
    Ok((sockets, control, link_watch))
}

/// Frames handed to the device per call at most.
const BATCH: usize = 64;

/// One AF_XDP socket: the backend of one queue pair.
pub struct AfXdp {
    // Field order matters: the socket (and its rings) goes before the UMEM
    // the kernel may still reference.
    xsk: Xsk,
    umem: Umem,
    /// UMEM frames free for TX.
    free: Vec<u64>,
    /// How many of the last free frames the last tx_buffers lent out.
    lent: usize,
    tx_bufs: Vec<FrameBuf>,
    rx_bufs: Vec<FrameBuf>,
    /// RX descriptors lent out by the last rx_frames.
    rx_lent: u32,
    /// Delivered RX frames not yet back on the fill ring. The kernel
    /// publishes the RX producer before the fill consumer (xsk_flush), so
    /// just after we read frames the fill ring can still look full.
    fill_backlog: Vec<u64>,
    /// A TX wake-up failed: frames wait on the TX ring for the next one
    /// (the next batch's, or `retry_deferred`'s).
    tx_stalled: bool,
    /// It failed for a passing reason (busy, no buffers), not a downed
    /// interface: `retry_deferred` asks to be called again soon.
    tx_retry_soon: bool,
    busy_poll: bool,
    /// A TX wake-up ran since the last RX poll: with busy polling it also
    /// ran the device's receive processing (the kernel busy-loops in sendmsg).
    napi_driven: bool,
    stats: BackendStats,
}

impl AfXdp {
    fn new(fd: OwnedFd, ifindex: u32, queue_id: u32, spec: &AfXdpSpec) -> io::Result<AfXdp> {
        let rx = spec.rx_ring as usize;
        let tx = spec.tx_ring as usize;
        // RX frames: exactly what the fill ring holds; TX frames: what the
        // TX ring holds. Frames 0..rx start on the fill ring.
        let umem = Umem::new(rx + tx, FRAME_SIZE)?;
        let bind = if spec.force_copy { BindMode::Copy } else { BindMode::Auto };
        let cfg = XskConfig { ifindex, queue_id, rx_size: spec.rx_ring, tx_size: spec.tx_ring, bind };
        let mut xsk = Xsk::setup(fd, &umem, &cfg)?;
        if spec.busy_poll {
            xsk.set_busy_poll(20, BATCH as u32)?;
        }
        for i in 0..rx {
            xsk.fill.write(i as u32, umem.frame_addr(i));
        }
        xsk.fill.submit(rx as u32);
        if xsk.fill.needs_wakeup() {
            xsk.kick_rx();
        }
        let free = (rx..rx + tx).rev().map(|i| umem.frame_addr(i)).collect();
        let base = std::ptr::NonNull::new(umem.base()).expect("mapped");
        // SAFETY: placeholders over the first byte of the UMEM; every use
        // repoints them at a frame first.
        let lend = || unsafe { FrameBuf::borrowed(base, 0) };
        Ok(AfXdp {
            xsk,
            umem,
            free,
            lent: 0,
            tx_bufs: (0..BATCH).map(|_| lend()).collect(),
            rx_bufs: (0..BATCH).map(|_| lend()).collect(),
            rx_lent: 0,
            fill_backlog: Vec::with_capacity(rx),
            tx_stalled: false,
            tx_retry_soon: false,
            busy_poll: spec.busy_poll,
            napi_driven: false,
            stats: BackendStats::default(),
        })
    }

    /// Frames the kernel finished sending go back to the free list.
    #[inline]
    fn reap_completions(&mut self) {
        let n = self.xsk.comp.ready(self.xsk.tx.size());
        for i in 0..n {
            let addr = self.xsk.comp.read(i);
            // Only frames of our TX range come back; anything else would be
            // a kernel bug, and is not reused.
            if self.umem.slice_ptr(addr, 1).is_some() {
                self.free.push(self.umem.frame_base(addr));
            }
        }
        if n > 0 {
            self.xsk.comp.release(n);
        }
    }

    /// Puts backlogged RX frames on the fill ring, as many as it has room
    /// for, and wakes the kernel if it asks; `submitted` more went on just
    /// before.
    fn refill(&mut self, submitted: u32) {
        let want = self.fill_backlog.len() as u32;
        let n = if want > 0 { self.xsk.fill.free(want).min(want) } else { 0 };
        if n > 0 {
            for (i, &addr) in self.fill_backlog[..n as usize].iter().enumerate() {
                self.xsk.fill.write(i as u32, addr);
            }
            self.xsk.fill.submit(n);
            self.fill_backlog.drain(..n as usize);
        }
        if submitted + n > 0 && self.xsk.fill.needs_wakeup() {
            self.xsk.kick_rx();
        }
    }

    fn kick_tx(&mut self) {
        let r = self.xsk.kick_tx();
        self.tx_stalled = r.is_err();
        self.tx_retry_soon = r
            .is_err_and(|e| matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY | libc::ENOBUFS | libc::EINTR)));
        self.napi_driven = true;
    }

    /// Retries a failed TX wake-up; a kernel that no longer asks for one
    /// takes the frames on its own.
    fn retry_tx_wakeup(&mut self) {
        if self.xsk.tx.needs_wakeup() {
            self.kick_tx();
        } else {
            self.tx_stalled = false;
        }
    }
}

impl NetBackend for AfXdp {
    fn tx_buffers(&mut self, want: usize) -> &mut [FrameBuf] {
        self.reap_completions();
        if self.tx_stalled {
            self.retry_tx_wakeup();
        }
        let n = want.min(BATCH).min(self.free.len()).min(self.xsk.tx.free(want as u32) as usize);
        let start = self.free.len() - n;
        for (buf, &addr) in self.tx_bufs.iter_mut().zip(&self.free[start..]) {
            let ptr = self.umem.slice_ptr(addr, FRAME_SIZE).expect("free frames are UMEM frames");
            // SAFETY: a free TX frame is neither on a ring nor lent elsewhere:
            // ours alone until committed.
            unsafe { buf.repoint(ptr, FRAME_SIZE) };
        }
        self.lent = n;
        &mut self.tx_bufs[..n]
    }

    fn tx_commit(&mut self, n: usize) {
        let n = n.min(self.lent);
        let start = self.free.len() - self.lent;
        // Frames to send go on the TX ring; frames not used (and any too
        // short to be Ethernet) stay free, compacted to the front.
        let mut sent = 0u32;
        let mut kept = start;
        for i in 0..self.lent {
            let addr = self.free[start + i];
            let len = self.tx_bufs[i].len;
            if i < n && (14..=FRAME_SIZE).contains(&len) {
                self.xsk.tx.write(sent, libc::xdp_desc { addr, len: len as u32, options: 0 });
                sent += 1;
            } else {
                if i < n {
                    // Too short to be Ethernet: dropped and counted.
                    self.stats.tx_dropped += 1;
                }
                self.free[kept] = addr;
                kept += 1;
            }
        }
        self.free.truncate(kept);
        self.lent = 0;
        if sent > 0 {
            self.xsk.tx.submit(sent);
            self.stats.tx_frames += sent as u64;
            if self.xsk.tx.needs_wakeup() {
                self.kick_tx();
            }
        }
    }

    fn rx_frames(&mut self, max: usize) -> &[FrameBuf] {
        if !self.fill_backlog.is_empty() {
            self.refill(0);
        }
        let max = max.min(BATCH) as u32;
        let mut n = self.xsk.rx.ready(max).min(max);
        // Busy polling: an empty ring costs a syscall that runs the device's
        // receive processing here, unless a TX wake-up just did.
        if n == 0 && self.busy_poll && !std::mem::take(&mut self.napi_driven) {
            self.xsk.kick_rx();
            n = self.xsk.rx.ready(max).min(max);
        }
        for i in 0..n {
            let d = self.xsk.rx.read(i);
            let buf = &mut self.rx_bufs[i as usize];
            // The kernel writes frames inside the UMEM; checked anyway so a
            // bad descriptor becomes an empty frame, not a wild read.
            let (ptr, len) = match self.umem.slice_ptr(d.addr, d.len as usize) {
                Some(p) => (p, d.len as usize),
                None => {
                    (self.umem.slice_ptr(self.umem.frame_base(d.addr), 0).unwrap_or(std::ptr::NonNull::dangling()), 0)
                }
            };
            // SAFETY: an RX descriptor's frame is ours until put on the fill
            // ring (rx_consume, or a later refill); the device only reads it.
            unsafe { buf.repoint(ptr, len) };
            buf.len = len;
        }
        self.rx_lent = n;
        &self.rx_bufs[..n as usize]
    }

    fn rx_consume(&mut self, n: usize) {
        let n = (n as u32).min(self.rx_lent);
        if n == 0 {
            return;
        }
        // All n leave the RX ring now: they were delivered, and an RX
        // descriptor kept back would be handed out again. The fill ring
        // takes what it has room for (usually all); the rest waits in the
        // backlog, behind anything already there. Fill before release, so
        // the kernel never sees RX room before frames to receive into.
        let room = if self.fill_backlog.is_empty() { self.xsk.fill.free(n).min(n) } else { 0 };
        for i in 0..n {
            let addr = self.umem.frame_base(self.xsk.rx.read(i).addr);
            if i < room {
                self.xsk.fill.write(i, addr);
            } else {
                self.fill_backlog.push(addr);
            }
        }
        if room > 0 {
            self.xsk.fill.submit(room);
        }
        self.xsk.rx.release(n);
        self.rx_lent = 0;
        self.stats.rx_frames += n as u64;
        self.refill(room);
    }

    fn retry_deferred(&mut self) -> bool {
        if !self.fill_backlog.is_empty() {
            self.refill(0);
        }
        // Frames on the TX ring whose wake-up failed go out with the next
        // one: not only when the guest sends again. A downed interface asks
        // for no early call back; the next batch or idle pass tries again.
        if self.tx_stalled {
            self.retry_tx_wakeup();
        }
        !self.fill_backlog.is_empty() || (self.tx_stalled && self.tx_retry_soon)
    }

    fn rx_fd(&self) -> Option<RawFd> {
        Some(self.xsk.fd())
    }

    fn stats(&self) -> BackendStats {
        let k = self.xsk.statistics().unwrap_or_default();
        BackendStats {
            rx_dropped: self.stats.rx_dropped + k.rx_dropped + k.rx_ring_full,
            tx_dropped: self.stats.tx_dropped + k.tx_invalid_descs,
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    fn ip(args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("ip");
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    const ETH_P_TEST: u16 = 0x88b5;

    /// Runs `f` with an AF_XDP socket on vx0 (native mode, 64-entry rings)
    /// and a packet socket on its peer vx1, in a network namespace of a
    /// thread of its own: it goes when the thread ends, however it ends.
    fn on_veth(f: impl FnOnce(&mut AfXdp, &OwnedFd) + Send + 'static) {
        std::thread::spawn(|| {
            // SAFETY: unshare affects only this thread (CLONE_NEWNET).
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare: {}", io::Error::last_os_error());
            ip(&["link", "add", "vx0", "type", "veth", "peer", "name", "vx1"]);
            for i in ["vx0", "vx1"] {
                ip(&["link", "set", i, "addrgenmode", "none"]);
                ip(&["link", "set", i, "up"]);
            }
            let mut spec = AfXdpSpec::new("vx0");
            spec.mode = Some(XdpMode::Native);
            spec.rx_ring = 64;
            spec.tx_ring = 64;
            let (mut qs, _control, _link) = open(&spec, 1).expect("AF_XDP on vx0");
            let wire = packet_socket("vx1");
            f(&mut qs[0], &wire);
        })
        .join()
        .unwrap();
    }

    /// A packet socket on `ifname` sending, and receiving test frames.
    fn packet_socket(ifname: &str) -> OwnedFd {
        // SAFETY: plain socket calls; results checked; sockaddr_ll is plain data.
        unsafe {
            let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, ETH_P_TEST.to_be() as i32);
            assert!(fd >= 0, "packet socket: {}", io::Error::last_os_error());
            let fd = OwnedFd::from_raw_fd(fd);
            let mut sll: libc::sockaddr_ll = std::mem::zeroed();
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = ETH_P_TEST.to_be();
            sll.sll_ifindex = xsk::ifindex(ifname).unwrap() as i32;
            let r = libc::bind(
                fd.as_raw_fd(),
                &sll as *const _ as *const libc::sockaddr,
                std::mem::size_of_val(&sll) as u32,
            );
            assert_eq!(r, 0, "bind: {}", io::Error::last_os_error());
            fd
        }
    }

    /// A 64-byte test frame whose payload bytes are all `seq`.
    fn test_frame(seq: u8) -> [u8; 64] {
        let mut f = [seq; 64];
        f[..6].copy_from_slice(&[0xff; 6]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        f[12..14].copy_from_slice(&ETH_P_TEST.to_be_bytes());
        f
    }

    fn send_frames(fd: &OwnedFd, seqs: std::ops::Range<u8>) {
        for s in seqs {
            let f = test_frame(s);
            // SAFETY: f is readable for its length.
            let n = unsafe { libc::send(fd.as_raw_fd(), f.as_ptr().cast(), f.len(), 0) };
            assert_eq!(n, 64, "send: {}", io::Error::last_os_error());
        }
    }

    /// The frames' sequence bytes `rx_frames` lends now, once `n` are ready
    /// (or 5 s passed).
    fn lend(q: &mut AfXdp, n: usize) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while q.xsk.rx.ready(n as u32) < n as u32 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        q.rx_frames(BATCH).iter().map(|f| f.frame()[14]).collect()
    }

    /// Whether the fill ring's consumer word reads `want` within 5 s (the
    /// kernel stores it just after the RX producer).
    fn fill_consumer_reaches(q: &AfXdp, want: u32) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while q.xsk.fill.shared_consumer().load(Ordering::Acquire) != want {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    /// The kernel publishes the RX producer before the fill consumer: a
    /// frame can be on the RX ring while the fill ring still looks full.
    /// Delivered frames must then leave the RX ring anyway (not be lent
    /// again) and reach the fill ring once it shows room.
    #[test]
    fn delivered_frames_leave_the_rx_ring_when_the_fill_ring_looks_full() {
        on_veth(|q, wire| {
            send_frames(wire, 0..3);
            assert_eq!(lend(q, 3), [0, 1, 2]);
            assert!(fill_consumer_reaches(q, 3), "the kernel took three fill entries");
            // Stand in for the kernel between its two stores: the fill
            // consumer word back by the three frames it took.
            let set_back = |q: &AfXdp, v: u32| q.xsk.fill.shared_consumer().store(v, Ordering::Release);
            set_back(q, 0);
            q.rx_consume(3);
            assert_eq!(q.rx_frames(BATCH).len(), 0, "delivered frames are not lent again");
            assert!(q.retry_deferred(), "the fill ring still looks full: the frames wait");
            // Room for two of the three: one waits, and frames delivered
            // meanwhile queue behind it.
            set_back(q, 2);
            assert!(q.retry_deferred(), "one of three still waits");
            assert_eq!(q.fill_backlog.len(), 1);
            send_frames(wire, 3..6);
            assert_eq!(lend(q, 3), [3, 4, 5]);
            // The kernel stores its own count (6) when it publishes again.
            assert!(fill_consumer_reaches(q, 6), "the kernel took three more");
            q.rx_consume(3);
            assert!(q.fill_backlog.is_empty(), "room for all four waiting");
            assert!(!q.retry_deferred());

            // Every one of the 64 RX frames is on the fill ring again: a
            // full ring's worth arrives, none dropped for want of a frame.
            send_frames(wire, 10..74);
            let mut got = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(5);
            while got.len() < 64 && Instant::now() < deadline {
                let f = lend(q, 1);
                let n = f.len();
                got.extend(f);
                q.rx_consume(n);
            }
            assert_eq!(got, (10..74).collect::<Vec<u8>>());
            assert_eq!(q.stats().rx_frames, 70);
        });
    }

    /// Frames whose TX wake-up the kernel refused (here: vx0 down) go out
    /// on a later retry, without the guest sending anything more. A downed
    /// interface is not a reason to poll soon.
    #[test]
    fn frames_whose_tx_wakeup_failed_go_out_on_retry() {
        on_veth(|q, wire| {
            ip(&["link", "set", "vx0", "down"]);
            let bufs = q.tx_buffers(3);
            assert_eq!(bufs.len(), 3);
            for (i, b) in bufs.iter_mut().enumerate() {
                b.storage()[..64].copy_from_slice(&test_frame(i as u8));
                b.len = 64;
            }
            q.tx_commit(3);
            assert!(q.tx_stalled, "the wake-up fails while vx0 is down");
            assert!(!q.retry_deferred(), "a downed interface: no call back soon");
            assert!(q.tx_stalled, "still down: the frames wait");
            ip(&["link", "set", "vx0", "up"]);
            assert!(!q.retry_deferred());
            assert!(!q.tx_stalled, "vx0 is up: the retried wake-up went through");
            let mut got = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(5);
            while got.len() < 3 && Instant::now() < deadline {
                let mut p = libc::pollfd { fd: wire.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd.
                if unsafe { libc::poll(&mut p, 1, 100) } != 1 {
                    continue;
                }
                let mut buf = [0u8; 2048];
                // SAFETY: buf is writable for its length.
                let n = unsafe { libc::recv(wire.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                assert_eq!(n, 64, "recv: {}", io::Error::last_os_error());
                got.push(buf[14]);
            }
            assert_eq!(got, [0, 1, 2], "the wire got the frames once each, in order");
        });
    }
}
