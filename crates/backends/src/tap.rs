//! The TAP backend: one TAP queue per queue pair. The TAP is opened with
//! IFF_VNET_HDR, so each frame carries its virtio_net_hdr through the kernel
//! unchanged: checksum and segmentation offloads work end to end, and a
//! 64 KiB TCP segment crosses as one frame. Frames are read and written with
//! one readv/writev each (a TAP has no batched I/O); the dataplane drains a
//! batch per iteration.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::link::{ioctl_ifreq, IfReq, Link};
use crate::{BackendStats, FrameBuf, NetBackend, FRAME_ROOM, VNET_HDR_LEN};

/// How the command line describes the TAP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TapSpec {
    /// Interface to create or attach to (`ifname=`).
    pub ifname: Option<String>,
    /// Already-open TAP queue descriptors, one per queue pair (`fd=`).
    pub fds: Vec<RawFd>,
    /// Negotiate checksum and segmentation offloads (`offloads=on`, the default).
    pub offloads: bool,
}

/// Checksum and segmentation offloads: what a TAP can do, or what the guest
/// accepts on receive (then the TAP hands it frames that need them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offloads {
    /// Partial checksums (NEEDS_CSUM); every other offload needs it.
    pub csum: bool,
    /// TCP segmentation over IPv4.
    pub tso4: bool,
    /// TCP segmentation over IPv6.
    pub tso6: bool,
    /// TCP segmentation with ECN.
    pub ecn: bool,
    /// UDP fragmentation (legacy UFO).
    pub ufo: bool,
    /// UDP segmentation over IPv4 (USO).
    pub uso4: bool,
    /// UDP segmentation over IPv6 (USO).
    pub uso6: bool,
}

impl Offloads {
    /// The TUN_F_* flags for TUNSETOFFLOAD.
    fn tun_flags(self) -> libc::c_uint {
        if !self.csum {
            return 0;
        }
        let mut f = libc::TUN_F_CSUM;
        for (on, flag) in [
            (self.tso4, libc::TUN_F_TSO4),
            (self.tso6, libc::TUN_F_TSO6),
            (self.ecn, libc::TUN_F_TSO_ECN),
            (self.ufo, libc::TUN_F_UFO),
            (self.uso4, libc::TUN_F_USO4),
            (self.uso6, libc::TUN_F_USO6),
        ] {
            if on {
                f |= flag;
            }
        }
        f
    }

    /// Only what both allow.
    pub fn and(self, o: Offloads) -> Offloads {
        Offloads {
            csum: self.csum && o.csum,
            tso4: self.tso4 && o.tso4,
            tso6: self.tso6 && o.tso6,
            ecn: self.ecn && o.ecn,
            ufo: self.ufo && o.ufo,
            uso4: self.uso4 && o.uso4,
            uso6: self.uso6 && o.uso6,
        }
    }
}

impl std::fmt::Display for Offloads {
    /// e.g. "csum,tso4,tso6,ecn,ufo,uso4,uso6", or "none".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = [
            (self.csum, "csum"),
            (self.tso4, "tso4"),
            (self.tso6, "tso6"),
            (self.ecn, "ecn"),
            (self.ufo, "ufo"),
            (self.uso4, "uso4"),
            (self.uso6, "uso6"),
        ];
        let on: Vec<&str> = names.iter().filter(|(on, _)| *on).map(|(_, n)| *n).collect();
        if on.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&on.join(","))
        }
    }
}

fn ioctl_int(fd: RawFd, req: libc::Ioctl, arg: libc::c_ulong) -> io::Result<()> {
    // SAFETY: these TUN ioctls take an integer argument by value.
    if unsafe { libc::ioctl(fd, req, arg) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, plain integer flags.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Opens (creating if needed) one queue of TAP `name`.
fn open_queue(name: &str, multi_queue: bool) -> io::Result<OwnedFd> {
    // SAFETY: open with a constant NUL-terminated path; the result is checked.
    let fd = unsafe { libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("--backend tap: cannot open /dev/net/tun: {e}")));
    }
    // SAFETY: fd was just opened and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut flags = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;
    if multi_queue {
        flags |= libc::IFF_MULTI_QUEUE;
    }
    let mut ifr = IfReq::new(name, flags);
    if let Err(e) = ioctl_ifreq(fd.as_raw_fd(), libc::TUNSETIFF, &mut ifr) {
        let why = match e.raw_os_error() {
            Some(libc::EPERM) => format!(
                "not permitted to create or attach TAP {name}: needs CAP_NET_ADMIN, or a TAP made for this user \
                 (ip tuntap add {name} mode tap vnet_hdr{} user $USER), or descriptors a manager opened (tap,fd=N)",
                if multi_queue { " multi_queue" } else { "" }
            ),
            Some(libc::EBUSY) => format!(
                "TAP {name} is busy: another process has {} open",
                if multi_queue { "all the queues it allows" } else { "its only queue" }
            ),
            Some(libc::EINVAL) => format!(
                "{name} exists but is not a {} TAP device (--queues > 1 needs a multi_queue TAP, --queues 1 a single-queue one)",
                if multi_queue { "multi-queue" } else { "single-queue" }
            ),
            _ => format!("cannot attach TAP {name}: {e}"),
        };
        return Err(io::Error::new(e.kind(), format!("--backend tap,ifname={name}: {why}")));
    }
    Ok(fd)
}

/// Checks a descriptor handed to us (`fd=N`); returns its interface name
/// and whether it carries virtio_net_hdr.
fn adopt_queue(fd: RawFd) -> io::Result<(OwnedFd, String, bool)> {
    let what = format!("--backend tap,fd={fd}");
    // SAFETY: F_GETFD only asks whether the descriptor is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(bad(format!("{what}: descriptor {fd} is not open in this process")));
    }
    let mut ifr = IfReq::new("", 0);
    if ioctl_ifreq(fd, libc::TUNGETIFF, &mut ifr).is_err() {
        return Err(bad(format!(
            "{what}: descriptor {fd} is not an attached TAP queue (open /dev/net/tun and TUNSETIFF first)"
        )));
    }
    let flags = ifr.flags as libc::c_int;
    let name = ifr.name();
    if flags & libc::IFF_TAP == 0 {
        return Err(bad(format!("{what}: {name} is a TUN (layer 3) device; a virtio-net device needs a TAP")));
    }
    if flags & libc::IFF_NO_PI == 0 {
        return Err(bad(format!(
            "{what}: TAP {name} was opened without IFF_NO_PI (packet information headers are not supported)"
        )));
    }
    // SAFETY: the descriptor is open (checked above) and from now on ours:
    // the caller handed it over on the command line.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // The process may have received the fd without FD_CLOEXEC.
    // SAFETY: fcntl on a descriptor we own.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    set_nonblocking(fd).map_err(|e| bad(format!("{what}: cannot make it non-blocking: {e}")))?;
    Ok((owned, name, flags & libc::IFF_VNET_HDR != 0))
}

/// Opens the TAP queues of `pairs` queue pairs and the device-wide control.
pub fn open(spec: &TapSpec, pairs: usize) -> io::Result<(Vec<Tap>, TapControl, Option<Link>)> {
    let multi_queue = pairs > 1;
    let (fds, name, vnet_hdr) = if let Some(name) = &spec.ifname {
        let mut fds = Vec::with_capacity(pairs);
        for _ in 0..pairs {
            fds.push(open_queue(name, multi_queue)?);
        }
        (fds, name.clone(), true)
    } else {
        if spec.fds.len() != pairs {
            return Err(bad(format!(
                "--backend tap,fd=...: {} descriptor(s) given for {pairs} queue pair(s) (--queues); give one per queue pair",
                spec.fds.len()
            )));
        }
        let mut fds = Vec::new();
        let mut names = Vec::new();
        let mut vnet = true;
        for &fd in &spec.fds {
            let (owned, name, v) = adopt_queue(fd)?;
            fds.push(owned);
            names.push(name);
            vnet &= v;
        }
        if names.iter().any(|n| n != &names[0]) {
            return Err(bad(format!("--backend tap,fd=...: the descriptors belong to different TAPs ({names:?})")));
        }
        (fds, names.swap_remove(0), vnet)
    };
    let control = TapControl::new(&fds[0], &name, vnet_hdr, spec.offloads)?;
    let link = link_watch(fds[0].as_raw_fd(), &name);
    let queues = fds.into_iter().map(|fd| Tap::new(fd, multi_queue, vnet_hdr)).collect();
    Ok((queues, control, link))
}

/// The device-wide side of a TAP: its offloads. TUNSETOFFLOAD on
/// any queue applies to the whole device, so this keeps a duplicate of
/// queue 0's descriptor (the queue stays attached while any copy is open).
pub struct TapControl {
    fd: OwnedFd,
    name: String,
    vnet_hdr: bool,
    caps: Offloads,
}

impl TapControl {
    fn new(queue0: &OwnedFd, name: &str, vnet_hdr: bool, want_offloads: bool) -> io::Result<TapControl> {
        let fd = queue0.try_clone()?;
        let raw = fd.as_raw_fd();
        let what = format!("--backend tap ({name})");
        // virtio_net_hdr without num_buffers, whatever a previous user set.
        if vnet_hdr {
            let sz: libc::c_int = VNET_HDR_LEN as libc::c_int;
            // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer.
            if unsafe { libc::ioctl(raw, libc::TUNSETVNETHDRSZ, &sz as *const libc::c_int) } < 0 {
                let e = io::Error::last_os_error();
                return Err(io::Error::new(e.kind(), format!("{what}: TUNSETVNETHDRSZ: {e}")));
            }
        }
        // What the kernel accepts, probed flag group by flag group.
        let mut caps = Offloads::default();
        if vnet_hdr && want_offloads {
            let base = Offloads { csum: true, tso4: true, tso6: true, ecn: true, ..Default::default() };
            if ioctl_int(raw, libc::TUNSETOFFLOAD, base.tun_flags() as libc::c_ulong).is_ok() {
                caps = base;
                let ufo = Offloads { ufo: true, ..base };
                caps.ufo = ioctl_int(raw, libc::TUNSETOFFLOAD, ufo.tun_flags() as libc::c_ulong).is_ok();
                let uso = Offloads { uso4: true, uso6: true, ..base };
                let has_uso = ioctl_int(raw, libc::TUNSETOFFLOAD, uso.tun_flags() as libc::c_ulong).is_ok();
                caps.uso4 = has_uso;
                caps.uso6 = has_uso;
            }
        }
        // Nothing is offloaded to the reader until a guest accepts it.
        if vnet_hdr {
            ioctl_int(raw, libc::TUNSETOFFLOAD, 0)
                .map_err(|e| io::Error::new(e.kind(), format!("{what}: TUNSETOFFLOAD: {e}")))?;
        }
        Ok(TapControl { fd, name: name.to_string(), vnet_hdr, caps })
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Offloads the TAP can do (none with `offloads=off` or without IFF_VNET_HDR).
    pub fn caps(&self) -> Offloads {
        self.caps
    }

    /// Frames carry a virtio_net_hdr through the TAP.
    pub fn has_vnet_hdr(&self) -> bool {
        self.vnet_hdr
    }

    /// Lets the kernel hand the guest frames that need these offloads
    /// (partial checksums, large segments); limited to what the TAP can do.
    pub fn set_offloads(&self, guest_accepts: Offloads) -> io::Result<()> {
        if !self.vnet_hdr {
            return Ok(());
        }
        let flags = guest_accepts.and(self.caps).tun_flags();
        ioctl_int(self.fd.as_raw_fd(), libc::TUNSETOFFLOAD, flags as libc::c_ulong)
    }
}

/// A watch on the TAP's link state, if the TAP is in our network namespace
/// (a descriptor may come from a TAP in another one, where the same name
/// may mean a different interface).
fn link_watch(tap: RawFd, name: &str) -> Option<Link> {
    // TUNGETDEVNETNS (needs CAP_NET_ADMIN) names the TAP's namespace.
    // SAFETY: TUNGETDEVNETNS takes no argument and returns a new descriptor.
    let ns = unsafe { libc::ioctl(tap, libc::TUNGETDEVNETNS) };
    if ns >= 0 {
        // SAFETY: ns is a new descriptor owned by nothing else.
        let ns = unsafe { OwnedFd::from_raw_fd(ns) };
        let same = match (std::fs::metadata("/proc/self/ns/net"), fd_inode(&ns)) {
            (Ok(ours), Some(theirs)) => {
                use std::os::unix::fs::MetadataExt;
                (ours.dev(), ours.ino()) == theirs
            }
            _ => true,
        };
        if !same {
            tracing::warn!("TAP {name} is in another network namespace: its link state is not tracked (reported up)");
            return None;
        }
    }
    Link::new(name).ok()
}

fn fd_inode(fd: &OwnedFd) -> Option<(u64, u64)> {
    // SAFETY: stat is plain data filled by fstat on an open descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open; st is a valid stat buffer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    Some((st.st_dev, st.st_ino))
}

/// Frames read ahead of the guest per queue.
const RX_FRAMES: usize = 64;
/// Frames written per batch at most.
const TX_FRAMES: usize = 32;

/// One TAP queue: the backend of one queue pair.
pub struct Tap {
    fd: OwnedFd,
    multi_queue: bool,
    vnet_hdr: bool,
    attached: bool,
    /// Frames read for the guest are rx[..rx_ready], oldest first.
    rx: Vec<FrameBuf>,
    rx_ready: usize,
    tx: Vec<FrameBuf>,
    stats: BackendStats,
}

impl Tap {
    fn new(fd: OwnedFd, multi_queue: bool, vnet_hdr: bool) -> Tap {
        Tap {
            fd,
            multi_queue,
            vnet_hdr,
            attached: true,
            rx: (0..RX_FRAMES).map(|_| FrameBuf::new()).collect(),
            rx_ready: 0,
            tx: (0..TX_FRAMES).map(|_| FrameBuf::new()).collect(),
            stats: BackendStats::default(),
        }
    }

    /// Reads one frame into rx[rx_ready]. False when the TAP is empty.
    fn read_one(&mut self) -> bool {
        let buf = &mut self.rx[self.rx_ready];
        let iov = [
            libc::iovec { iov_base: buf.vnet_hdr.as_mut_ptr().cast(), iov_len: VNET_HDR_LEN },
            libc::iovec { iov_base: buf.storage().as_mut_ptr().cast(), iov_len: buf.room() },
        ];
        let (iov, hdr) = if self.vnet_hdr { (&iov[..], VNET_HDR_LEN) } else { (&iov[1..], 0) };
        // SAFETY: the iovecs point at this buffer's header and data, with
        // their lengths; the kernel writes at most that much.
        let n = unsafe { libc::readv(self.fd.as_raw_fd(), iov.as_ptr(), iov.len() as libc::c_int) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::WouldBlock && e.kind() != io::ErrorKind::Interrupted {
                // A detached queue or a frame the kernel could not copy.
                self.stats.rx_dropped += 1;
            }
            return false;
        }
        let n = n as usize;
        if n < hdr || n - hdr >= FRAME_ROOM {
            // Short, or filled the whole buffer (so possibly truncated): drop.
            self.stats.rx_dropped += 1;
            return true;
        }
        if !self.vnet_hdr {
            buf.vnet_hdr = [0; VNET_HDR_LEN];
        }
        buf.len = n - hdr;
        self.rx_ready += 1;
        true
    }
}

impl NetBackend for Tap {
    fn tx_buffers(&mut self, want: usize) -> &mut [FrameBuf] {
        let n = want.min(self.tx.len());
        &mut self.tx[..n]
    }

    fn tx_commit(&mut self, n: usize) {
        let fd = self.fd.as_raw_fd();
        for buf in &self.tx[..n.min(self.tx.len())] {
            let iov = [
                libc::iovec { iov_base: buf.vnet_hdr.as_ptr() as *mut libc::c_void, iov_len: VNET_HDR_LEN },
                libc::iovec { iov_base: buf.frame().as_ptr() as *mut libc::c_void, iov_len: buf.frame().len() },
            ];
            let iov = if self.vnet_hdr { &iov[..] } else { &iov[1..] };
            // SAFETY: the iovecs point at this buffer's header and frame
            // bytes; the kernel only reads them.
            let r = unsafe { libc::writev(fd, iov.as_ptr(), iov.len() as libc::c_int) };
            if r < 0 {
                // Link down (EIO), an offload header the kernel rejects
                // (EINVAL), or no memory: the frame is lost, and counted.
                self.stats.tx_dropped += 1;
            } else {
                self.stats.tx_frames += 1;
            }
        }
    }

    fn rx_frames(&mut self, max: usize) -> &[FrameBuf] {
        let want = max.min(self.rx.len());
        while self.rx_ready < want && self.read_one() {}
        &self.rx[..self.rx_ready.min(want)]
    }

    fn rx_consume(&mut self, n: usize) {
        let n = n.min(self.rx_ready);
        // Moves buffer handles, not frame bytes.
        self.rx[..self.rx_ready].rotate_left(n);
        self.rx_ready -= n;
        self.stats.rx_frames += n as u64;
    }

    fn rx_fd(&self) -> Option<RawFd> {
        Some(self.fd.as_raw_fd())
    }

    fn set_active(&mut self, active: bool) {
        if !self.multi_queue || active == self.attached {
            return;
        }
        if !active {
            // Nobody will read what was read ahead for this queue.
            self.stats.rx_dropped += self.rx_ready as u64;
            self.rx_ready = 0;
        }
        let mut ifr = IfReq::new("", if active { libc::IFF_ATTACH_QUEUE } else { libc::IFF_DETACH_QUEUE });
        match ioctl_ifreq(self.fd.as_raw_fd(), libc::TUNSETQUEUE, &mut ifr) {
            Ok(()) => self.attached = active,
            Err(e) => tracing::warn!("TUNSETQUEUE ({}): {e}", if active { "attach" } else { "detach" }),
        }
    }

    fn stats(&self) -> BackendStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offload_flags() {
        assert_eq!(Offloads::default().tun_flags(), 0);
        // Nothing without checksum offload.
        assert_eq!(Offloads { tso4: true, ..Default::default() }.tun_flags(), 0);
        let all = Offloads { csum: true, tso4: true, tso6: true, ecn: true, ufo: true, uso4: true, uso6: true };
        assert_eq!(all.tun_flags(), 0x7f);
        let some = Offloads { csum: true, tso4: true, ..Default::default() };
        assert_eq!(all.and(some), some);
    }

    #[test]
    fn ifreq_name_round_trips_and_is_bounded() {
        assert_eq!(IfReq::new("tap0", 0).name(), "tap0");
        assert_eq!(IfReq::new("a-very-long-interface-name", 0).name().len(), libc::IFNAMSIZ - 1);
    }
}
