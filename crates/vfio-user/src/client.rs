//! A small vfio-user client: builds each request, sends it with its
//! descriptors, reads and checks the reply. For tests and for vhostd-user's
//! vfio-user mode; blocking, one request at a time. It checks what the
//! server sends (sizes, ids, capability lists) and never trusts a count
//! it has not bounded.

use std::fmt;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use crate::server::{DeviceInfo, IrqInfo};
use crate::sys;
use crate::wire::{self, cmd, Header, HEADER_SIZE};
use crate::Errno;

/// Why a request failed.
#[derive(Debug)]
pub enum ClientError {
    /// The socket failed or closed.
    Io(io::Error),
    /// The server answered with the error flag and this errno.
    Errno(Errno),
    /// The reply does not follow the protocol.
    Protocol(String),
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::Io(e) => write!(f, "socket: {e}"),
            ClientError::Errno(e) => write!(f, "server answered {e}"),
            ClientError::Protocol(s) => write!(f, "bad reply: {s}"),
        }
    }
}

impl std::error::Error for ClientError {}

impl From<io::Error> for ClientError {
    fn from(e: io::Error) -> Self {
        ClientError::Io(e)
    }
}

fn protocol<T>(s: impl Into<String>) -> Result<T, ClientError> {
    Err(ClientError::Protocol(s.into()))
}

/// A message received: its header, the bytes after it and its descriptors.
#[derive(Debug)]
pub struct Message {
    /// The header.
    pub header: Header,
    /// The payload.
    pub payload: Vec<u8>,
    /// Descriptors that came with it.
    pub fds: Vec<OwnedFd>,
}

/// A region as GET_REGION_INFO reports it to the client.
#[derive(Debug)]
pub struct ClientRegion {
    /// `wire::REGION_FLAG_*`.
    pub flags: u32,
    /// Size.
    pub size: u64,
    /// mmap offset in `fd`.
    pub offset: u64,
    /// Sparse-mmap areas (empty: the whole region if MMAP).
    pub sparse: Vec<wire::SparseArea>,
    /// The descriptor to mmap (with MMAP).
    pub fd: Option<OwnedFd>,
}

/// One vfio-user connection, client side.
pub struct Client {
    stream: UnixStream,
    next_id: u16,
    /// The server's capabilities once VERSION is done (else the defaults).
    server: wire::Capabilities,
}

/// The largest reply read: QEMU's own bound on max_data_xfer_size plus
/// the read reply's headers.
const MAX_REPLY: usize = (64 << 20) + HEADER_SIZE + wire::RegionAccessMsg::SIZE;

impl Client {
    /// A client on a connected, blocking `stream`.
    pub fn new(stream: UnixStream) -> Client {
        Client { stream, next_id: 0, server: wire::Capabilities::default() }
    }

    /// The socket.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// The server's capabilities (the spec's defaults before VERSION).
    pub fn server_caps(&self) -> &wire::Capabilities {
        &self.server
    }

    /// Writes raw bytes with descriptors (for hostile-client tests).
    pub fn send_raw(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let mut off = 0;
        let mut first = true;
        while off < bytes.len() || first {
            let f = if first { fds } else { &[] };
            let n = sys::send_with_fds(self.stream.as_fd(), &[IoSlice::new(&bytes[off..])], f)?;
            if n == 0 && off < bytes.len() {
                return Err(io::ErrorKind::WriteZero.into());
            }
            off += n;
            first = false;
        }
        Ok(())
    }

    /// Sends a command: header (with a fresh id and `flags`, the type bits
    /// set to command), `payload`, `fds`. Returns its header.
    pub fn send(&mut self, command: u16, flags: u32, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<Header> {
        let header = Header {
            id: self.next_id,
            command,
            size: (HEADER_SIZE + payload.len()) as u32,
            flags: flags & !wire::FLAG_TYPE_MASK,
            error: 0,
        };
        self.next_id = self.next_id.wrapping_add(1);
        let mut msg = Vec::with_capacity(HEADER_SIZE + payload.len());
        msg.extend_from_slice(&header.encode());
        msg.extend_from_slice(payload);
        self.send_raw(&msg, fds)?;
        Ok(header)
    }

    fn recv_exact(&mut self, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<(), ClientError> {
        let mut off = 0;
        while off < buf.len() {
            let r = sys::recv_with_fds(self.stream.as_fd(), &mut buf[off..], fds)?;
            if r.bytes == 0 {
                return Err(ClientError::Io(io::ErrorKind::UnexpectedEof.into()));
            }
            if r.ctrunc {
                return protocol("descriptors truncated");
            }
            off += r.bytes;
        }
        Ok(())
    }

    /// Receives one message (whatever it is), bounded in size.
    pub fn recv(&mut self) -> Result<Message, ClientError> {
        let mut fds = Vec::new();
        let mut h = [0u8; HEADER_SIZE];
        self.recv_exact(&mut h, &mut fds)?;
        let header = Header::decode(&h).ok_or_else(|| ClientError::Protocol("header".into()))?;
        let size = header.size as usize;
        if !(HEADER_SIZE..=MAX_REPLY).contains(&size) {
            return protocol(format!("message size {size}"));
        }
        let mut payload = vec![0u8; size - HEADER_SIZE];
        self.recv_exact(&mut payload, &mut fds)?;
        Ok(Message { header, payload, fds })
    }

    /// Receives the reply to `req`: checks its id, command and type, and
    /// turns the error flag into [`ClientError::Errno`].
    pub fn reply_to(&mut self, req: &Header) -> Result<Message, ClientError> {
        let m = self.recv()?;
        let h = &m.header;
        if h.msg_type() != wire::FLAG_TYPE_REPLY || h.id != req.id || h.command != req.command {
            return protocol(format!("reply {h} to request {req}"));
        }
        if h.is_error() {
            if h.size as usize != HEADER_SIZE {
                return protocol(format!("error reply with a payload: {h}"));
            }
            return Err(ClientError::Errno(Errno(h.error as i32)));
        }
        Ok(m)
    }

    /// Sends a command and waits for its reply.
    pub fn call(&mut self, command: u16, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<Message, ClientError> {
        let h = self.send(command, 0, payload, fds)?;
        self.reply_to(&h)
    }

    fn call_no_fds(&mut self, command: u16, payload: &[u8]) -> Result<Message, ClientError> {
        let m = self.call(command, payload, &[])?;
        if !m.fds.is_empty() {
            return protocol(format!("{} descriptors on reply to {command}", m.fds.len()));
        }
        Ok(m)
    }

    /// VERSION: proposes 0.0 with `caps`; returns the server's minor and
    /// capabilities (also kept for later requests).
    pub fn version(&mut self, caps: &wire::Capabilities) -> Result<(u16, wire::Capabilities), ClientError> {
        let mut p = Vec::new();
        wire::VersionMsg { major: wire::VERSION_MAJOR, minor: wire::VERSION_MINOR, caps: *caps }.encode(&mut p);
        let m = self.call_no_fds(cmd::VERSION, &p)?;
        let v = wire::VersionMsg::decode(&m.payload).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if v.major != wire::VERSION_MAJOR || v.minor > wire::VERSION_MINOR {
            return protocol(format!("server version {}.{}", v.major, v.minor));
        }
        self.server = v.caps;
        Ok((v.minor, v.caps))
    }

    /// DMA_MAP of `size` bytes at `iova`, from `offset` in `fd` if given;
    /// `flags` are `wire::DMA_MAP_FLAG_*`.
    pub fn dma_map(
        &mut self,
        iova: u64,
        size: u64,
        offset: u64,
        flags: u32,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), ClientError> {
        let mut p = Vec::new();
        wire::DmaMapMsg { argsz: wire::DmaMapMsg::SIZE as u32, flags, offset, iova, size }.encode(&mut p);
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        let m = self.call(cmd::DMA_MAP, &p, &fds)?;
        if !m.payload.is_empty() || !m.fds.is_empty() {
            return protocol("DMA_MAP reply with a payload");
        }
        Ok(())
    }

    /// DMA_UNMAP of the mapping at `iova` of `size` (`flags` 0), or of all
    /// (`wire::DMA_UNMAP_FLAG_ALL`, iova and size 0).
    pub fn dma_unmap(&mut self, iova: u64, size: u64, flags: u32) -> Result<(), ClientError> {
        let req = wire::DmaUnmapMsg { argsz: wire::DmaUnmapMsg::SIZE as u32, flags, iova, size };
        let mut p = Vec::new();
        req.encode(&mut p);
        let m = self.call_no_fds(cmd::DMA_UNMAP, &p)?;
        if wire::DmaUnmapMsg::decode(&m.payload) != Some(req) || m.payload.len() != p.len() {
            return protocol("DMA_UNMAP reply does not echo the request");
        }
        Ok(())
    }

    /// DEVICE_GET_INFO.
    pub fn device_info(&mut self) -> Result<DeviceInfo, ClientError> {
        let mut p = Vec::new();
        wire::DeviceInfoMsg { argsz: wire::DeviceInfoMsg::SIZE as u32, ..Default::default() }.encode(&mut p);
        let m = self.call_no_fds(cmd::DEVICE_GET_INFO, &p)?;
        let r = wire::DeviceInfoMsg::decode(&m.payload)
            .ok_or_else(|| ClientError::Protocol("short GET_INFO reply".into()))?;
        Ok(DeviceInfo { flags: r.flags, num_regions: r.num_regions, num_irqs: r.num_irqs })
    }

    /// One DEVICE_GET_REGION_INFO request with `argsz`; the raw reply.
    pub fn region_info_raw(&mut self, index: u32, argsz: u32) -> Result<Message, ClientError> {
        let mut p = Vec::new();
        wire::RegionInfoMsg { argsz, index, ..Default::default() }.encode(&mut p);
        let m = self.call(cmd::DEVICE_GET_REGION_INFO, &p, &[])?;
        if m.fds.len() > 1 || m.payload.len() > argsz as usize {
            return protocol("GET_REGION_INFO reply larger than asked");
        }
        Ok(m)
    }

    /// DEVICE_GET_REGION_INFO, asking again with the size the server needs
    /// if the first reply had no room for the capabilities (as QEMU does).
    pub fn region_info(&mut self, index: u32) -> Result<ClientRegion, ClientError> {
        let mut argsz = wire::RegionInfoMsg::SIZE as u32;
        for _ in 0..2 {
            let mut m = self.region_info_raw(index, argsz)?;
            let r = wire::RegionInfoMsg::decode(&m.payload)
                .ok_or_else(|| ClientError::Protocol("short GET_REGION_INFO reply".into()))?;
            if r.index != index {
                return protocol("GET_REGION_INFO reply for another region");
            }
            if r.argsz > argsz {
                argsz = r.argsz;
                continue;
            }
            let sparse = if r.flags & wire::REGION_FLAG_CAPS != 0 {
                wire::parse_sparse_areas(&m.payload, r.cap_offset)
                    .map_err(|e| ClientError::Protocol(format!("capabilities: {e:?}")))?
            } else {
                Vec::new()
            };
            return Ok(ClientRegion { flags: r.flags, size: r.size, offset: r.offset, sparse, fd: m.fds.pop() });
        }
        protocol("GET_REGION_INFO: server keeps asking for more room")
    }

    /// DEVICE_GET_IRQ_INFO.
    pub fn irq_info(&mut self, index: u32) -> Result<IrqInfo, ClientError> {
        let mut p = Vec::new();
        wire::IrqInfoMsg { argsz: wire::IrqInfoMsg::SIZE as u32, index, ..Default::default() }.encode(&mut p);
        let m = self.call_no_fds(cmd::DEVICE_GET_IRQ_INFO, &p)?;
        let r = wire::IrqInfoMsg::decode(&m.payload)
            .ok_or_else(|| ClientError::Protocol("short GET_IRQ_INFO reply".into()))?;
        Ok(IrqInfo { flags: r.flags, count: r.count })
    }

    /// DEVICE_SET_IRQS: `flags` one `IRQ_SET_DATA_*` and one
    /// `IRQ_SET_ACTION_*`; `bools` follow the header for DATA_BOOL; `fds`
    /// go as ancillary data for DATA_EVENTFD.
    pub fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        bools: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ClientError> {
        let mut p = Vec::new();
        wire::IrqSetMsg { argsz: (wire::IrqSetMsg::SIZE + bools.len()) as u32, flags, index, start, count }
            .encode(&mut p);
        p.extend_from_slice(bools);
        let m = self.call(cmd::DEVICE_SET_IRQS, &p, fds)?;
        if !m.payload.is_empty() || !m.fds.is_empty() {
            return protocol("SET_IRQS reply with a payload");
        }
        Ok(())
    }

    /// REGION_READ of `buf.len()` bytes at `offset` of region `index`.
    pub fn region_read(&mut self, index: u32, offset: u64, buf: &mut [u8]) -> Result<(), ClientError> {
        let req = wire::RegionAccessMsg { offset, region: index, count: buf.len() as u32 };
        let mut p = Vec::new();
        req.encode(&mut p);
        let m = self.call_no_fds(cmd::REGION_READ, &p)?;
        if wire::RegionAccessMsg::decode(&m.payload) != Some(req)
            || m.payload.len() != wire::RegionAccessMsg::SIZE + buf.len()
        {
            return protocol("REGION_READ reply does not match the request");
        }
        buf.copy_from_slice(&m.payload[wire::RegionAccessMsg::SIZE..]);
        Ok(())
    }

    /// REGION_WRITE of `data` at `offset` of region `index`.
    pub fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        let req = wire::RegionAccessMsg { offset, region: index, count: data.len() as u32 };
        let mut p = Vec::with_capacity(wire::RegionAccessMsg::SIZE + data.len());
        req.encode(&mut p);
        p.extend_from_slice(data);
        let m = self.call_no_fds(cmd::REGION_WRITE, &p)?;
        if wire::RegionAccessMsg::decode(&m.payload) != Some(req) || m.payload.len() != wire::RegionAccessMsg::SIZE {
            return protocol("REGION_WRITE reply does not match the request");
        }
        Ok(())
    }

    /// REGION_WRITE with no reply (a posted write, as QEMU sends them when
    /// no region is mapped).
    pub fn region_write_posted(&mut self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut p = Vec::with_capacity(wire::RegionAccessMsg::SIZE + data.len());
        wire::RegionAccessMsg { offset, region: index, count: data.len() as u32 }.encode(&mut p);
        p.extend_from_slice(data);
        self.send(cmd::REGION_WRITE, wire::FLAG_NO_REPLY, &p, &[])?;
        Ok(())
    }

    /// DEVICE_RESET.
    pub fn reset(&mut self) -> Result<(), ClientError> {
        let m = self.call_no_fds(cmd::DEVICE_RESET, &[])?;
        if !m.payload.is_empty() {
            return protocol("DEVICE_RESET reply with a payload");
        }
        Ok(())
    }
}

impl AsFd for Client {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.stream.as_fd()
    }
}
