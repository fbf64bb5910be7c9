//! The server side of one connection: [`Server`] reads one message at a
//! time with its descriptors, checks it, calls the [`VfioDevice`] and
//! answers.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::sys;
use crate::wire::{self, cmd, Header, HEADER_SIZE};
use crate::Errno;

/// What GET_INFO reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `wire::DEVICE_FLAG_*` (RESET, PCI).
    pub flags: u32,
    /// Number of regions; indexes below it are asked with `region_info`.
    pub num_regions: u32,
    /// Number of interrupt types; indexes below it are asked with
    /// `irq_info`.
    pub num_irqs: u32,
}

/// What GET_REGION_INFO reports of one region.
#[derive(Clone, Copy, Debug, Default)]
pub struct RegionInfo<'a> {
    /// `wire::REGION_FLAG_READ | WRITE | MMAP`; the server adds CAPS.
    /// Without READ (WRITE) the server refuses REGION_READ (WRITE).
    pub flags: u32,
    /// Size of the region: every access must lie inside it.
    pub size: u64,
    /// The offset to give mmap() for `fd` (with MMAP).
    pub mmap_offset: u64,
    /// With MMAP: the parts the client may mmap (a sparse-mmap
    /// capability); empty means the whole region.
    pub sparse: &'a [wire::SparseArea],
    /// With MMAP: the descriptor the client maps. The server sends a
    /// duplicate; MMAP without a descriptor is reported without MMAP.
    pub fd: Option<BorrowedFd<'a>>,
}

/// What GET_IRQ_INFO reports of one interrupt type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqInfo {
    /// `wire::IRQ_INFO_*`. The server refuses eventfds without EVENTFD and
    /// MASK / UNMASK without MASKABLE.
    pub flags: u32,
    /// Number of interrupts of this type.
    pub count: u32,
}

/// A DMA mapping the server has checked: page-aligned, not overlapping any
/// other, within the limit of mappings.
#[derive(Debug)]
pub struct DmaMap {
    /// DMA address (guest physical address for QEMU without a vIOMMU).
    pub iova: u64,
    /// Size in bytes (non-zero).
    pub size: u64,
    /// Offset of the region in `fd` (page-aligned).
    pub offset: u64,
    /// The client may let the device read it.
    pub read: bool,
    /// The client may let the device write it.
    pub write: bool,
    /// The memory to mmap, or `None`: the client offers only DMA_READ /
    /// DMA_WRITE messages, which this crate does not send (a device that
    /// needs direct access answers such a map with an error).
    pub fd: Option<OwnedFd>,
}

/// What a SET_IRQS does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrqAction {
    /// VFIO_IRQ_SET_ACTION_MASK.
    Mask,
    /// VFIO_IRQ_SET_ACTION_UNMASK.
    Unmask,
    /// VFIO_IRQ_SET_ACTION_TRIGGER.
    Trigger,
}

/// The data of a SET_IRQS.
#[derive(Debug)]
pub enum IrqData<'a> {
    /// Act on every interrupt of the range. With count 0 (and start 0) and
    /// `Trigger`: disable every interrupt of the type.
    None,
    /// One byte per interrupt of the range: act where non-zero.
    Bool(&'a [u8]),
    /// One eventfd per interrupt of the range (signal it for the action),
    /// or none: take the range's eventfds away.
    Eventfds(Vec<OwnedFd>),
}

/// A checked SET_IRQS: `index` is below `num_irqs`, the range is inside
/// the type's `count`, data matches the range.
#[derive(Debug)]
pub struct IrqSet<'a> {
    /// The interrupt type.
    pub index: u32,
    /// First interrupt.
    pub start: u32,
    /// Number of interrupts.
    pub count: u32,
    /// The action.
    pub action: IrqAction,
    /// The data.
    pub data: IrqData<'a>,
}

/// What the device model implements; the server calls it only with
/// requests it has checked against what the device reported and the
/// spec's rules.
///
/// When the connection ends the device must drop every DMA mapping and
/// interrupt eventfd it holds and keep the rest of its state (the spec's
/// "Client Disconnection"); the server does not call it for that.
pub trait VfioDevice {
    /// Flags and counts, for GET_INFO and for every index check.
    fn info(&self) -> DeviceInfo;
    /// Region `index` (below `num_regions`); `None` answers EINVAL.
    fn region_info(&self, index: u32) -> Option<RegionInfo<'_>>;
    /// Interrupt type `index` (below `num_irqs`); `None` answers EINVAL.
    fn irq_info(&self, index: u32) -> Option<IrqInfo>;
    /// Reads `data.len()` bytes at `offset` of region `index`; the range is
    /// inside the region and the region readable.
    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> Result<(), Errno>;
    /// Writes `data` at `offset` of region `index`; the range is inside the
    /// region and the region writable.
    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<(), Errno>;
    /// Applies a checked SET_IRQS.
    fn set_irqs(&mut self, set: IrqSet<'_>) -> Result<(), Errno>;
    /// Adds a checked mapping. On error the server does not record it.
    fn dma_map(&mut self, map: DmaMap) -> Result<(), Errno>;
    /// Removes the mapping that `dma_map` added at `iova` with `size`; the
    /// device must release every reference to it before returning (or
    /// refuse, e.g. with EBUSY, and keep it).
    fn dma_unmap(&mut self, iova: u64, size: u64) -> Result<(), Errno>;
    /// Resets the device (only called if `info` has DEVICE_FLAG_RESET).
    fn reset(&mut self) -> Result<(), Errno>;
}

/// The server's limits, advertised in its VERSION reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// Most data bytes in one REGION_WRITE (and REGION_READ), 1..=64 MiB;
    /// it bounds every message: 32 bytes more is the largest taken.
    pub max_data_xfer_size: u32,
    /// Most descriptors in one message, 1..=16 (QEMU refuses more).
    pub max_msg_fds: u32,
    /// Most DMA mappings at once, 1..=65535 (QEMU refuses more).
    pub max_dma_maps: u32,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig { max_data_xfer_size: 1 << 20, max_msg_fds: 16, max_dma_maps: 4096 }
    }
}

/// Why the connection is over. Every variant but `PeerClosed` is a client
/// fault or an I/O error; the caller closes the socket (drops the server).
#[derive(Debug)]
pub enum Error {
    /// The client closed its end between two messages.
    PeerClosed,
    /// The client closed its end inside a message.
    Truncated {
        /// Bytes of the message received.
        got: usize,
        /// Bytes expected (16 while the header is incomplete).
        want: usize,
    },
    /// A header's size is below 16.
    MessageTooSmall(Header),
    /// A header's size is above the largest message taken.
    MessageTooLarge {
        /// The header.
        header: Header,
        /// The largest message taken.
        max: usize,
    },
    /// A message that is not a command (the server sends no commands, so
    /// it expects no replies).
    NotACommand(Header),
    /// A VERSION proposing a major version other than 0 (the spec: the
    /// server closes the connection).
    UnsupportedVersion {
        /// Proposed major.
        major: u16,
        /// Proposed minor.
        minor: u16,
    },
    /// A socket error.
    Io(io::Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::PeerClosed => write!(f, "client closed the connection"),
            Error::Truncated { got, want } => {
                write!(f, "client closed the connection inside a message ({got} of {want} bytes)")
            }
            Error::MessageTooSmall(h) => write!(f, "message size below the header's ({h})"),
            Error::MessageTooLarge { header, max } => {
                write!(f, "message larger than {max} bytes ({header})")
            }
            Error::NotACommand(h) => write!(f, "message is not a command ({h})"),
            Error::UnsupportedVersion { major, minor } => {
                write!(f, "client proposes version {major}.{minor}; only 0.x is served")
            }
            Error::Io(e) => write!(f, "socket: {e}"),
        }
    }
}

impl std::error::Error for Error {}

/// What one [`Server::handle`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    /// Nothing complete: the socket had no (more) data, or the last reply
    /// could not be written whole yet ([`Server::wants_write`]). What was
    /// read is kept for the next call.
    Idle,
    /// One message was handled: answered (unless it asked for no reply)
    /// with `result`, or, for an error reply to a no-reply message, only
    /// reported here.
    Handled {
        /// The message's header.
        header: Header,
        /// The answer.
        result: Result<(), Errno>,
    },
}

/// The client's side of the VERSION exchange, once done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// The minor version agreed (0).
    pub minor: u16,
    /// The client's capabilities.
    pub client: wire::Capabilities,
}

/// One vfio-user connection, server side.
///
/// The socket may be blocking (each [`handle`](Self::handle) then returns
/// one handled message) or non-blocking, for a thread polling many: then
/// `handle` returns [`Event::Idle`] when it would block and resumes where
/// it stopped, inside a message or inside a reply, on the next call. It
/// reads no further than the current message, so a message's descriptors
/// are never mixed with the next one's, and reads no new message while a
/// reply is still unsent (a client that does not read its replies only
/// stalls itself).
pub struct Server {
    stream: UnixStream,
    config: ServerConfig,
    negotiated: Option<Negotiated>,
    /// The message being received; grows up to `max_msg_size`.
    rx: Vec<u8>,
    rx_len: usize,
    rx_fds: Vec<OwnedFd>,
    /// More descriptors came with the message than `max_msg_fds`.
    rx_fds_excess: bool,
    /// The reply being sent, from `tx_pos`; its descriptor goes with the
    /// first byte.
    tx: Vec<u8>,
    tx_pos: usize,
    tx_fd: Option<OwnedFd>,
    /// The DMA mappings: iova -> size.
    dma: BTreeMap<u64, u64>,
}

/// The largest QEMU takes for max_data_xfer_size.
const MAX_XFER_LIMIT: u32 = 64 << 20;
/// The most descriptors QEMU takes for max_msg_fds.
const MAX_FDS_LIMIT: u32 = 16;
/// The most mappings QEMU takes for max_dma_maps.
const MAX_DMA_MAPS_LIMIT: u32 = 65535;

impl Server {
    /// A server on `stream` (connected; blocking or not) with `config`'s
    /// limits; refuses limits outside their ranges.
    pub fn new(stream: UnixStream, config: ServerConfig) -> io::Result<Server> {
        let ok = (1..=MAX_XFER_LIMIT).contains(&config.max_data_xfer_size)
            && (1..=MAX_FDS_LIMIT).contains(&config.max_msg_fds)
            && (1..=MAX_DMA_MAPS_LIMIT).contains(&config.max_dma_maps);
        if !ok {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("vfio-user server limits out of range: {config:?}"),
            ));
        }
        Ok(Server {
            stream,
            config,
            negotiated: None,
            rx: vec![0; HEADER_SIZE],
            rx_len: 0,
            rx_fds: Vec::new(),
            rx_fds_excess: false,
            tx: Vec::new(),
            tx_pos: 0,
            tx_fd: None,
            dma: BTreeMap::new(),
        })
    }

    /// The socket (to poll it).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// The limits.
    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// The VERSION exchange's result, once done.
    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.negotiated.as_ref()
    }

    /// Whether a reply is waiting for the socket to take it (poll for
    /// writable, then call [`handle`](Self::handle)).
    pub fn wants_write(&self) -> bool {
        self.tx_pos < self.tx.len()
    }

    /// The DMA mappings recorded (iova, size), in iova order.
    pub fn dma_maps(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.dma.iter().map(|(&iova, &size)| (iova, size))
    }

    /// The largest message taken: a REGION_WRITE of `max_data_xfer_size`.
    pub fn max_msg_size(&self) -> usize {
        HEADER_SIZE + wire::RegionAccessMsg::SIZE + self.config.max_data_xfer_size as usize
    }

    /// Finishes the pending reply, then receives and handles at most one
    /// message. An `Err` ends the connection.
    pub fn handle<D: VfioDevice + ?Sized>(&mut self, dev: &mut D) -> Result<Event, Error> {
        if !self.flush()? {
            return Ok(Event::Idle);
        }
        // The header.
        while self.rx_len < HEADER_SIZE {
            if !self.recv_some(HEADER_SIZE)? {
                return Ok(Event::Idle);
            }
        }
        let header = Header::decode(&self.rx).ok_or(Error::MessageTooSmall(Header::default()))?;
        let size = header.size as usize;
        if size < HEADER_SIZE {
            return Err(Error::MessageTooSmall(header));
        }
        if size > self.max_msg_size() {
            return Err(Error::MessageTooLarge { header, max: self.max_msg_size() });
        }
        if header.msg_type() != wire::FLAG_TYPE_COMMAND {
            return Err(Error::NotACommand(header));
        }
        // The rest of the message.
        if self.rx.len() < size {
            self.rx.resize(size, 0);
        }
        while self.rx_len < size {
            if !self.recv_some(size)? {
                return Ok(Event::Idle);
            }
        }

        let rx = std::mem::take(&mut self.rx);
        let fds = std::mem::take(&mut self.rx_fds);
        let excess = std::mem::replace(&mut self.rx_fds_excess, false);
        self.rx_len = 0;
        self.tx.clear();
        self.tx.extend_from_slice(&[0; HEADER_SIZE]);
        self.tx_pos = 0;
        self.tx_fd = None;

        let outcome = if excess {
            // Every descriptor of the message is closed (dropped here).
            drop(fds);
            Ok(Err(Errno::EINVAL))
        } else {
            self.dispatch(dev, &header, &rx[HEADER_SIZE..size], fds)
        };
        self.rx = rx;
        let result = outcome?;

        if header.no_reply() {
            self.tx.clear();
            self.tx_fd = None;
        } else {
            let mut reply =
                Header { id: header.id, command: header.command, size: 0, flags: wire::FLAG_TYPE_REPLY, error: 0 };
            if let Err(e) = result {
                self.tx.truncate(HEADER_SIZE);
                self.tx_fd = None;
                reply.flags |= wire::FLAG_ERROR;
                reply.error = e.0 as u32;
            }
            reply.size = self.tx.len() as u32;
            self.tx[..HEADER_SIZE].copy_from_slice(&reply.encode());
            // Written now if the socket takes it, else on the next call.
            self.flush()?;
        }
        Ok(Event::Handled { header, result })
    }

    /// Reads into the message buffer, up to `upto` bytes of the message.
    /// Returns false if the socket would block.
    fn recv_some(&mut self, upto: usize) -> Result<bool, Error> {
        let sock = self.stream.as_fd();
        let r = match sys::recv_with_fds(sock, &mut self.rx[self.rx_len..upto], &mut self.rx_fds) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(Error::Io(e)),
        };
        if r.ctrunc || self.rx_fds.len() > self.config.max_msg_fds as usize {
            // Close them now: the message will be refused whatever it is.
            self.rx_fds.clear();
            self.rx_fds_excess = true;
        }
        if r.bytes == 0 {
            if self.rx_len == 0 && self.rx_fds.is_empty() && !self.rx_fds_excess {
                return Err(Error::PeerClosed);
            }
            let want = match Header::decode(&self.rx[..self.rx_len]) {
                Some(h) => h.size as usize,
                None => HEADER_SIZE,
            };
            return Err(Error::Truncated { got: self.rx_len, want });
        }
        self.rx_len += r.bytes;
        Ok(true)
    }

    /// Writes what is left of the reply. Returns false if the socket would
    /// block before the end.
    fn flush(&mut self) -> Result<bool, Error> {
        while self.tx_pos < self.tx.len() {
            let fd = self.tx_fd.as_ref().map(|f| f.as_fd());
            let fds: &[BorrowedFd<'_>] = match &fd {
                Some(f) => std::slice::from_ref(f),
                None => &[],
            };
            let bufs = [IoSlice::new(&self.tx[self.tx_pos..])];
            match sys::send_with_fds(self.stream.as_fd(), &bufs, fds) {
                Ok(0) => return Err(Error::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => {
                    self.tx_pos += n;
                    // The descriptor went with the first byte.
                    self.tx_fd = None;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(Error::Io(e)),
            }
        }
        Ok(true)
    }

    /// Checks and carries out one command; the reply payload goes to
    /// `self.tx` after the header. `Err` closes the connection.
    fn dispatch<D: VfioDevice + ?Sized>(
        &mut self,
        dev: &mut D,
        header: &Header,
        payload: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<Result<(), Errno>, Error> {
        let command = header.command;
        if command == cmd::VERSION {
            if !fds.is_empty() {
                return Ok(Err(Errno::EINVAL));
            }
            return self.version(payload);
        }
        if self.negotiated.is_none() {
            // The spec: VERSION comes first.
            return Ok(Err(Errno::EINVAL));
        }
        // Descriptors a command may carry; the rest are refused (and closed
        // when `fds` drops).
        let allowed = match command {
            cmd::DMA_MAP => 1,
            cmd::DEVICE_SET_IRQS => self.config.max_msg_fds as usize,
            cmd::DMA_UNMAP
            | cmd::DEVICE_GET_INFO
            | cmd::DEVICE_GET_REGION_INFO
            | cmd::DEVICE_GET_IRQ_INFO
            | cmd::REGION_READ
            | cmd::REGION_WRITE
            | cmd::DEVICE_RESET => 0,
            _ => return Ok(Err(Errno::ENOSYS)),
        };
        if fds.len() > allowed {
            return Ok(Err(Errno::EINVAL));
        }
        Ok(match command {
            cmd::DMA_MAP => self.dma_map(dev, payload, fds),
            cmd::DMA_UNMAP => self.dma_unmap(dev, payload),
            cmd::DEVICE_GET_INFO => self.get_info(dev, payload),
            cmd::DEVICE_GET_REGION_INFO => self.get_region_info(dev, payload),
            cmd::DEVICE_GET_IRQ_INFO => self.get_irq_info(dev, payload),
            cmd::DEVICE_SET_IRQS => self.set_irqs(dev, payload, fds),
            cmd::REGION_READ => self.region_read(dev, payload),
            cmd::REGION_WRITE => self.region_write(dev, payload),
            _ => self.reset(dev, payload),
        })
    }

    fn version(&mut self, payload: &[u8]) -> Result<Result<(), Errno>, Error> {
        if self.negotiated.is_some() {
            // Limits, and the mappings made under them, stay as agreed.
            return Ok(Err(Errno::EINVAL));
        }
        let v = match wire::VersionMsg::decode(payload) {
            Ok(v) => v,
            Err(_) => return Ok(Err(Errno::EINVAL)),
        };
        if v.major != wire::VERSION_MAJOR {
            return Err(Error::UnsupportedVersion { major: v.major, minor: v.minor });
        }
        if v.caps.pgsizes & wire::PAGE_SIZE == 0 {
            // Our only page size is not among the client's.
            return Ok(Err(Errno::ENOTSUP));
        }
        // The smaller of the client's minor and ours (0 today, so always 0;
        // kept as the rule for when ours grows).
        #[allow(clippy::unnecessary_min_or_max)]
        let minor = v.minor.min(wire::VERSION_MINOR);
        self.negotiated = Some(Negotiated { minor, client: v.caps });
        wire::VersionMsg {
            major: wire::VERSION_MAJOR,
            minor,
            caps: wire::Capabilities {
                max_msg_fds: self.config.max_msg_fds,
                max_data_xfer_size: self.config.max_data_xfer_size,
                pgsizes: wire::PAGE_SIZE,
                max_dma_maps: self.config.max_dma_maps,
            },
        }
        .encode(&mut self.tx);
        Ok(Ok(()))
    }

    fn dma_map<D: VfioDevice + ?Sized>(
        &mut self,
        dev: &mut D,
        payload: &[u8],
        mut fds: Vec<OwnedFd>,
    ) -> Result<(), Errno> {
        if payload.len() != wire::DmaMapMsg::SIZE {
            return Err(Errno::EINVAL);
        }
        let m = wire::DmaMapMsg::decode(payload).ok_or(Errno::EINVAL)?;
        let known =
            wire::DMA_MAP_FLAG_READ | wire::DMA_MAP_FLAG_WRITE | wire::DMA_MAP_FLAG_MMAP | wire::DMA_MAP_FLAG_FILE_IO;
        if (m.argsz as usize) < wire::DmaMapMsg::SIZE || m.flags & !known != 0 {
            return Err(Errno::EINVAL);
        }
        let fd = fds.pop();
        let mode = m.flags & (wire::DMA_MAP_FLAG_MMAP | wire::DMA_MAP_FLAG_FILE_IO);
        if mode != 0 && fd.is_none() {
            // The spec: an access mode that needs a descriptor, without one.
            return Err(Errno::EINVAL);
        }
        if mode == wire::DMA_MAP_FLAG_MMAP | wire::DMA_MAP_FLAG_FILE_IO {
            return Err(Errno::EINVAL);
        }
        if mode == wire::DMA_MAP_FLAG_FILE_IO {
            return Err(Errno::ENOTSUP);
        }
        let page = wire::PAGE_SIZE;
        if m.size == 0
            || !m.iova.is_multiple_of(page)
            || !m.size.is_multiple_of(page)
            || (fd.is_some() && !m.offset.is_multiple_of(page))
        {
            return Err(Errno::EINVAL);
        }
        let last = m.iova.checked_add(m.size - 1).ok_or(Errno::EINVAL)?;
        if fd.is_some() && m.offset.checked_add(m.size).is_none() {
            return Err(Errno::EINVAL);
        }
        // Overlap: the mapping at or below iova must end before it, the
        // next one above must start after `last`.
        if let Some((&b, &bsize)) = self.dma.range(..=m.iova).next_back() {
            if b + (bsize - 1) >= m.iova {
                return Err(Errno::EEXIST);
            }
        }
        if let Some((&a, _)) = self.dma.range(m.iova..).next() {
            if a <= last {
                return Err(Errno::EEXIST);
            }
        }
        if self.dma.len() >= self.config.max_dma_maps as usize {
            return Err(Errno::ENOSPC);
        }
        dev.dma_map(DmaMap {
            iova: m.iova,
            size: m.size,
            offset: m.offset,
            read: m.flags & wire::DMA_MAP_FLAG_READ != 0,
            write: m.flags & wire::DMA_MAP_FLAG_WRITE != 0,
            fd,
        })?;
        self.dma.insert(m.iova, m.size);
        Ok(())
    }

    fn dma_unmap<D: VfioDevice + ?Sized>(&mut self, dev: &mut D, payload: &[u8]) -> Result<(), Errno> {
        if payload.len() != wire::DmaUnmapMsg::SIZE {
            return Err(Errno::EINVAL);
        }
        let m = wire::DmaUnmapMsg::decode(payload).ok_or(Errno::EINVAL)?;
        if (m.argsz as usize) < wire::DmaUnmapMsg::SIZE {
            return Err(Errno::EINVAL);
        }
        match m.flags {
            0 => {
                // The spec: address and size match a mapping exactly.
                if self.dma.get(&m.iova) != Some(&m.size) {
                    return Err(Errno::ENOENT);
                }
                dev.dma_unmap(m.iova, m.size)?;
                self.dma.remove(&m.iova);
            }
            wire::DMA_UNMAP_FLAG_ALL => {
                if m.iova != 0 || m.size != 0 {
                    return Err(Errno::EINVAL);
                }
                // Each one the device lets go; the first refusal is the
                // answer, and what it refused stays mapped.
                let mut first_err = None;
                let all: Vec<(u64, u64)> = self.dma_maps().collect();
                for (iova, size) in all {
                    match dev.dma_unmap(iova, size) {
                        Ok(()) => {
                            self.dma.remove(&iova);
                        }
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
                if let Some(e) = first_err {
                    return Err(e);
                }
            }
            _ => return Err(Errno::EINVAL),
        }
        m.encode(&mut self.tx);
        Ok(())
    }

    fn get_info<D: VfioDevice + ?Sized>(&mut self, dev: &mut D, payload: &[u8]) -> Result<(), Errno> {
        if payload.len() != wire::DeviceInfoMsg::SIZE {
            return Err(Errno::EINVAL);
        }
        let m = wire::DeviceInfoMsg::decode(payload).ok_or(Errno::EINVAL)?;
        if (m.argsz as usize) < wire::DeviceInfoMsg::SIZE {
            return Err(Errno::EINVAL);
        }
        let info = dev.info();
        wire::DeviceInfoMsg {
            argsz: wire::DeviceInfoMsg::SIZE as u32,
            flags: info.flags,
            num_regions: info.num_regions,
            num_irqs: info.num_irqs,
        }
        .encode(&mut self.tx);
        Ok(())
    }

    fn get_region_info<D: VfioDevice + ?Sized>(&mut self, dev: &mut D, payload: &[u8]) -> Result<(), Errno> {
        if payload.len() != wire::RegionInfoMsg::SIZE {
            return Err(Errno::EINVAL);
        }
        let m = wire::RegionInfoMsg::decode(payload).ok_or(Errno::EINVAL)?;
        if (m.argsz as usize) < wire::RegionInfoMsg::SIZE || m.index >= dev.info().num_regions {
            return Err(Errno::EINVAL);
        }
        let r = dev.region_info(m.index).ok_or(Errno::EINVAL)?;
        let mut flags = r.flags & (wire::REGION_FLAG_READ | wire::REGION_FLAG_WRITE);
        // MMAP needs a descriptor, and a client that takes descriptors
        // (max_msg_fds 0 would leave it unable to map).
        let client_fds = self.negotiated.map_or(0, |n| n.client.max_msg_fds);
        let mmap = r.flags & wire::REGION_FLAG_MMAP != 0 && r.fd.is_some() && client_fds > 0;
        let sparse: &[wire::SparseArea] = if mmap { r.sparse } else { &[] };
        if mmap {
            flags |= wire::REGION_FLAG_MMAP;
        }
        let full =
            wire::RegionInfoMsg::SIZE + if sparse.is_empty() { 0 } else { wire::sparse_mmap_cap_size(sparse.len()) };
        let fits = m.argsz as usize >= full;
        // A reply too short for the capabilities carries neither CAPS nor
        // a descriptor, only the size it needs (QEMU asks again with it;
        // it refuses CAPS with a cap_offset outside the reply).
        let caps = fits && !sparse.is_empty();
        if caps {
            flags |= wire::REGION_FLAG_CAPS;
        }
        wire::RegionInfoMsg {
            argsz: full as u32,
            flags,
            index: m.index,
            cap_offset: if caps { wire::RegionInfoMsg::SIZE as u32 } else { 0 },
            size: r.size,
            offset: if mmap { r.mmap_offset } else { 0 },
        }
        .encode(&mut self.tx);
        if caps {
            wire::encode_sparse_mmap_cap(&mut self.tx, 0, sparse);
        }
        if mmap && fits {
            if let Some(fd) = r.fd {
                self.tx_fd = Some(fd.try_clone_to_owned().map_err(|e| Errno(e.raw_os_error().unwrap_or(libc::EIO)))?);
            }
        }
        Ok(())
    }

    fn get_irq_info<D: VfioDevice + ?Sized>(&mut self, dev: &mut D, payload: &[u8]) -> Result<(), Errno> {
        if payload.len() != wire::IrqInfoMsg::SIZE {
            return Err(Errno::EINVAL);
        }
        let m = wire::IrqInfoMsg::decode(payload).ok_or(Errno::EINVAL)?;
        if (m.argsz as usize) < wire::IrqInfoMsg::SIZE || m.index >= dev.info().num_irqs {
            return Err(Errno::EINVAL);
        }
        let irq = dev.irq_info(m.index).ok_or(Errno::EINVAL)?;
        wire::IrqInfoMsg { argsz: wire::IrqInfoMsg::SIZE as u32, flags: irq.flags, index: m.index, count: irq.count }
            .encode(&mut self.tx);
        Ok(())
    }

    fn set_irqs<D: VfioDevice + ?Sized>(
        &mut self,
        dev: &mut D,
        payload: &[u8],
        fds: Vec<OwnedFd>,
    ) -> Result<(), Errno> {
        let m = wire::IrqSetMsg::decode(payload).ok_or(Errno::EINVAL)?;
        let data_bits = m.flags & wire::IRQ_SET_DATA_MASK;
        let action_bits = m.flags & wire::IRQ_SET_ACTION_MASK_ALL;
        if (m.argsz as usize) < wire::IrqSetMsg::SIZE
            || m.flags & !(wire::IRQ_SET_DATA_MASK | wire::IRQ_SET_ACTION_MASK_ALL) != 0
            || data_bits.count_ones() != 1
            || action_bits.count_ones() != 1
            || m.index >= dev.info().num_irqs
        {
            return Err(Errno::EINVAL);
        }
        let irq = dev.irq_info(m.index).ok_or(Errno::EINVAL)?;
        let action = match action_bits {
            wire::IRQ_SET_ACTION_MASK => IrqAction::Mask,
            wire::IRQ_SET_ACTION_UNMASK => IrqAction::Unmask,
            _ => IrqAction::Trigger,
        };
        if action != IrqAction::Trigger && irq.flags & wire::IRQ_INFO_MASKABLE == 0 {
            return Err(Errno::EINVAL);
        }
        if m.count == 0 {
            // Only "disable every interrupt of the type": DATA_NONE, start 0.
            if data_bits != wire::IRQ_SET_DATA_NONE || m.start != 0 {
                return Err(Errno::EINVAL);
            }
        } else {
            let end = m.start.checked_add(m.count).ok_or(Errno::EINVAL)?;
            if end > irq.count {
                return Err(Errno::EINVAL);
            }
        }
        let rest = &payload[wire::IrqSetMsg::SIZE..];
        let data = match data_bits {
            wire::IRQ_SET_DATA_NONE => {
                if !rest.is_empty() || !fds.is_empty() {
                    return Err(Errno::EINVAL);
                }
                IrqData::None
            }
            wire::IRQ_SET_DATA_BOOL => {
                if rest.len() != m.count as usize || !fds.is_empty() {
                    return Err(Errno::EINVAL);
                }
                IrqData::Bool(rest)
            }
            _ => {
                if irq.flags & wire::IRQ_INFO_EVENTFD == 0
                    || !rest.is_empty()
                    || !(fds.is_empty() || fds.len() == m.count as usize)
                {
                    return Err(Errno::EINVAL);
                }
                IrqData::Eventfds(fds)
            }
        };
        dev.set_irqs(IrqSet { index: m.index, start: m.start, count: m.count, action, data })
    }

    /// The region and range of a REGION_READ/WRITE, checked: index, the
    /// access flag, count within the transfer limit, range inside the
    /// region.
    fn check_access<D: VfioDevice + ?Sized>(
        &self,
        dev: &D,
        m: &wire::RegionAccessMsg,
        need: u32,
        max: u32,
    ) -> Result<(), Errno> {
        if m.count > max || m.region >= dev.info().num_regions {
            return Err(Errno::EINVAL);
        }
        let r = dev.region_info(m.region).ok_or(Errno::EINVAL)?;
        let end = m.offset.checked_add(u64::from(m.count)).ok_or(Errno::EINVAL)?;
        if r.flags & need == 0 || end > r.size {
            return Err(Errno::EINVAL);
        }
        Ok(())
    }

    fn region_read<D: VfioDevice + ?Sized>(&mut self, dev: &mut D, payload: &[u8]) -> Result<(), Errno> {
        if payload.len() != wire::RegionAccessMsg::SIZE {
            return Err(Errno::EINVAL);
        }
        let m = wire::RegionAccessMsg::decode(payload).ok_or(Errno::EINVAL)?;
        // The reply must fit both our limit and the client's.
        let client_max = self.negotiated.map_or(0, |n| n.client.max_data_xfer_size);
        let max = self.config.max_data_xfer_size.min(client_max);
        self.check_access(dev, &m, wire::REGION_FLAG_READ, max)?;
        m.encode(&mut self.tx);
        let start = self.tx.len();
        self.tx.resize(start + m.count as usize, 0);
        dev.region_read(m.region, m.offset, &mut self.tx[start..])
    }

    fn region_write<D: VfioDevice + ?Sized>(&mut self, dev: &mut D, payload: &[u8]) -> Result<(), Errno> {
        let m = wire::RegionAccessMsg::decode(payload).ok_or(Errno::EINVAL)?;
        let data = &payload[wire::RegionAccessMsg::SIZE..];
        if data.len() != m.count as usize {
            return Err(Errno::EINVAL);
        }
        self.check_access(dev, &m, wire::REGION_FLAG_WRITE, self.config.max_data_xfer_size)?;
        dev.region_write(m.region, m.offset, data)?;
        m.encode(&mut self.tx);
        Ok(())
    }

    fn reset<D: VfioDevice + ?Sized>(&mut self, dev: &mut D, payload: &[u8]) -> Result<(), Errno> {
        if !payload.is_empty() {
            return Err(Errno::EINVAL);
        }
        if dev.info().flags & wire::DEVICE_FLAG_RESET == 0 {
            return Err(Errno::ENOTSUP);
        }
        dev.reset()
    }
}

impl AsFd for Server {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}
