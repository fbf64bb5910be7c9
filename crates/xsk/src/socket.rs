//! One AF_XDP socket: UMEM registration, ring setup, bind, wake-ups.

use std::io;
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::ring::{ConsRing, ProdRing};
use crate::umem::Umem;

/// How to bind: copy or zero-copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindMode {
    /// Zero-copy where the driver supports it, else copy (the kernel decides).
    Auto,
    /// Always copy (XDP_COPY).
    Copy,
}

/// What a socket is bound to and how.
#[derive(Clone, Copy, Debug)]
pub struct XskConfig {
    /// Interface index.
    pub ifindex: u32,
    /// Device queue.
    pub queue_id: u32,
    /// RX and fill ring size (a power of two).
    pub rx_size: u32,
    /// TX and completion ring size (a power of two).
    pub tx_size: u32,
    /// Copy or zero-copy.
    pub bind: BindMode,
}

/// The kernel's drop counters of one socket (XDP_STATISTICS).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Statistics {
    /// Frames dropped for other reasons than a full ring (e.g. too big for a frame).
    pub rx_dropped: u64,
    /// Invalid descriptors we put on the fill ring.
    pub rx_invalid_descs: u64,
    /// Invalid descriptors we put on the TX ring.
    pub tx_invalid_descs: u64,
    /// Frames dropped because our RX ring was full.
    pub rx_ring_full: u64,
    /// Times the kernel found the fill ring empty.
    pub rx_fill_ring_empty_descs: u64,
    /// Times the kernel found the TX ring empty when woken.
    pub tx_ring_empty_descs: u64,
}

/// An AF_XDP socket bound to one device queue, with its four rings.
pub struct Xsk {
    fd: OwnedFd,
    /// Frames we give the kernel to receive into.
    pub fill: ProdRing<u64>,
    /// Frames the kernel has finished sending.
    pub comp: ConsRing<u64>,
    /// Received frames.
    pub rx: ConsRing<libc::xdp_desc>,
    /// Frames to send.
    pub tx: ProdRing<libc::xdp_desc>,
    zero_copy: bool,
}

fn setsockopt<T>(fd: RawFd, opt: libc::c_int, v: &T) -> io::Result<()> {
    // SAFETY: v is a valid T for the duration of the call; the kernel
    // reads size_of::<T>() bytes.
    let r = unsafe {
        libc::setsockopt(fd, libc::SOL_XDP, opt, (v as *const T).cast(), std::mem::size_of::<T>() as libc::socklen_t)
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Only for plain C structs and integers (all-zero is a valid value).
fn getsockopt<T: Copy>(fd: RawFd, level: libc::c_int, opt: libc::c_int) -> io::Result<(T, usize)> {
    // SAFETY: T is a plain C type for which all-zero bytes are valid.
    let mut v: T = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: v is writable for len bytes; the kernel writes at most len.
    let r = unsafe { libc::getsockopt(fd, level, opt, (&mut v as *mut T).cast(), &mut len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((v, len as usize))
}

fn context(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Xsk {
    /// A new, unbound AF_XDP socket (needs CAP_NET_RAW).
    pub fn socket() -> io::Result<OwnedFd> {
        // SAFETY: socket() with constant arguments; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(if e.raw_os_error() == Some(libc::EPERM) {
                io::Error::new(e.kind(), "cannot create an AF_XDP socket: needs CAP_NET_RAW (or sockets passed in: sock-fds=, vhostd xdp-helper)")
            } else {
                context(e, "cannot create an AF_XDP socket")
            });
        }
        // SAFETY: fd was just created and is owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Whether `fd` is an AF_XDP socket.
    pub fn is_xdp_socket(fd: RawFd) -> bool {
        matches!(getsockopt::<libc::c_int>(fd, libc::SOL_SOCKET, libc::SO_DOMAIN), Ok((d, _)) if d == libc::AF_XDP)
    }

    /// Registers `umem` on socket `fd`, creates and maps the rings, and
    /// binds to the queue. The caller keeps `umem` alive as long as the
    /// socket (it is the memory the kernel reads and writes).
    pub fn setup(fd: OwnedFd, umem: &Umem, cfg: &XskConfig) -> io::Result<Xsk> {
        let raw = fd.as_raw_fd();
        for (what, n) in [("rx ring", cfg.rx_size), ("tx ring", cfg.tx_size)] {
            if !n.is_power_of_two() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{what} size {n} is not a power of two"),
                ));
            }
        }
        let reg = libc::xdp_umem_reg {
            addr: umem.base() as u64,
            len: umem.len() as u64,
            chunk_size: umem.frame_size() as u32,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        setsockopt(raw, libc::XDP_UMEM_REG, &reg).map_err(|e| match e.raw_os_error() {
            Some(libc::EPERM) | Some(libc::ENOMEM) | Some(libc::ENOBUFS) => io::Error::new(
                e.kind(),
                format!(
                    "cannot register the {} MiB UMEM ({e}): it is locked memory; raise RLIMIT_MEMLOCK \
                     (ulimit -l, systemd LimitMEMLOCK=), grant CAP_IPC_LOCK, or use smaller rings",
                    umem.len() >> 20
                ),
            ),
            Some(libc::EBUSY) => io::Error::new(e.kind(), "the socket already has a UMEM: pass fresh, unbound sockets"),
            _ => context(e, "cannot register the UMEM"),
        })?;
        setsockopt(raw, libc::XDP_UMEM_FILL_RING, &cfg.rx_size).map_err(|e| context(e, "fill ring"))?;
        setsockopt(raw, libc::XDP_UMEM_COMPLETION_RING, &cfg.tx_size).map_err(|e| context(e, "completion ring"))?;
        setsockopt(raw, libc::XDP_RX_RING, &cfg.rx_size).map_err(|e| context(e, "rx ring"))?;
        setsockopt(raw, libc::XDP_TX_RING, &cfg.tx_size).map_err(|e| context(e, "tx ring"))?;
        let (off, len) = getsockopt::<libc::xdp_mmap_offsets>(raw, libc::SOL_XDP, libc::XDP_MMAP_OFFSETS)?;
        if len != std::mem::size_of::<libc::xdp_mmap_offsets>() {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "kernel too old: no ring flags (need Linux 5.4+)"));
        }
        let fill = ProdRing::map(raw, libc::XDP_UMEM_PGOFF_FILL_RING, &off.fr, cfg.rx_size)?;
        let comp = ConsRing::map(raw, libc::XDP_UMEM_PGOFF_COMPLETION_RING, &off.cr, cfg.tx_size)?;
        let rx = ConsRing::map(raw, libc::XDP_PGOFF_RX_RING as u64, &off.rx, cfg.rx_size)?;
        let tx = ProdRing::map(raw, libc::XDP_PGOFF_TX_RING as u32 as u64, &off.tx, cfg.tx_size)?;
        let mut flags = libc::XDP_USE_NEED_WAKEUP;
        if cfg.bind == BindMode::Copy {
            flags |= libc::XDP_COPY;
        }
        let sa = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            sxdp_flags: flags,
            sxdp_ifindex: cfg.ifindex,
            sxdp_queue_id: cfg.queue_id,
            sxdp_shared_umem_fd: 0,
        };
        // SAFETY: sa is a valid sockaddr_xdp of the size passed.
        let r = unsafe {
            libc::bind(
                raw,
                (&sa as *const libc::sockaddr_xdp).cast(),
                std::mem::size_of::<libc::sockaddr_xdp>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(context(io::Error::last_os_error(), &format!("cannot bind to queue {}", cfg.queue_id)));
        }
        let zero_copy = getsockopt::<u32>(raw, libc::SOL_XDP, libc::XDP_OPTIONS)
            .map(|(f, _)| f & libc::XDP_OPTIONS_ZEROCOPY != 0)
            .unwrap_or(false);
        Ok(Xsk { fd, fill, comp, rx, tx, zero_copy })
    }

    /// The socket: polls readable when the RX ring has frames.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Bound in zero-copy mode.
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// Asks the kernel to send what is on the TX ring. An error says it
    /// could not now (busy, no buffers, interface down): the frames stay on
    /// the ring for the next kick.
    #[inline]
    pub fn kick_tx(&self) -> io::Result<()> {
        // SAFETY: a zero-length send with no buffer only wakes the socket.
        let r =
            unsafe { libc::sendto(self.fd.as_raw_fd(), std::ptr::null(), 0, libc::MSG_DONTWAIT, std::ptr::null(), 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Wakes the kernel to refill from the fill ring (or, busy polling, to
    /// run the device's receive processing now).
    #[inline]
    pub fn kick_rx(&self) {
        // SAFETY: a zero-length receive with no buffer only wakes the socket.
        unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
    }

    /// The kernel's drop counters.
    pub fn statistics(&self) -> io::Result<Statistics> {
        let (s, _) = getsockopt::<libc::xdp_statistics>(self.fd.as_raw_fd(), libc::SOL_XDP, libc::XDP_STATISTICS)?;
        Ok(Statistics {
            rx_dropped: s.rx_dropped,
            rx_invalid_descs: s.rx_invalid_descs,
            tx_invalid_descs: s.tx_invalid_descs,
            rx_ring_full: s.rx_ring_full,
            rx_fill_ring_empty_descs: s.rx_fill_ring_empty_descs,
            tx_ring_empty_descs: s.tx_ring_empty_descs,
        })
    }

    /// Busy polling: the wake-up syscalls run the device's NAPI directly
    /// for up to `usecs`, `budget` packets at a time, and interrupts stay off
    /// while the application keeps polling (SO_PREFER_BUSY_POLL).
    pub fn set_busy_poll(&self, usecs: u32, budget: u32) -> io::Result<()> {
        const SO_PREFER_BUSY_POLL: libc::c_int = 69;
        const SO_BUSY_POLL_BUDGET: libc::c_int = 70;
        for (opt, v) in [(SO_PREFER_BUSY_POLL, 1u32), (libc::SO_BUSY_POLL, usecs), (SO_BUSY_POLL_BUDGET, budget)] {
            let v = v as libc::c_int;
            // SAFETY: v is a valid int for the call.
            let r = unsafe {
                libc::setsockopt(
                    self.fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&v as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r != 0 {
                return Err(context(io::Error::last_os_error(), "cannot enable busy polling"));
            }
        }
        Ok(())
    }
}

/// Queues of interface `name` an AF_XDP socket can bind to (ETHTOOL_GCHANNELS),
/// if the driver reports them.
pub fn queue_count(name: &str) -> Option<u32> {
    #[repr(C)]
    #[derive(Default)]
    struct Channels {
        cmd: u32,
        max_rx: u32,
        max_tx: u32,
        max_other: u32,
        max_combined: u32,
        rx_count: u32,
        tx_count: u32,
        other_count: u32,
        combined_count: u32,
    }
    #[repr(C)]
    struct IfReq {
        name: [libc::c_char; libc::IFNAMSIZ],
        data: *mut Channels,
        _pad: [u8; 16],
    }
    const ETHTOOL_GCHANNELS: u32 = 0x3c;
    let mut ch = Channels { cmd: ETHTOOL_GCHANNELS, ..Default::default() };
    let mut ifr = IfReq { name: [0; libc::IFNAMSIZ], data: &mut ch, _pad: [0; 16] };
    for (d, s) in ifr.name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *d = s as libc::c_char;
    }
    // SAFETY: socket() with constant arguments; the result is checked.
    let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if s < 0 {
        return None;
    }
    // SAFETY: s was just created and is owned by nothing else.
    let s = unsafe { OwnedFd::from_raw_fd(s) };
    // SAFETY: ifr is a valid ifreq whose data points at a live ethtool_channels.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::SIOCETHTOOL, &mut ifr as *mut IfReq) };
    if r != 0 {
        return None;
    }
    Some(ch.combined_count.max(ch.rx_count.min(ch.tx_count)).max(1))
}
