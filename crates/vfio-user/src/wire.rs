//! The wire format: the 16-byte header, the command numbers and flags, and
//! the fixed-size payloads of the messages a server answers, each with its
//! size, a `decode` that refuses a short buffer and an `encode` that appends.
//!
//! Byte order: the spec says "the endianness of the host system"; vhostd
//! runs on little-endian hosts only, so everything here is little-endian
//! (and the same as the host's, as QEMU's client writes it).
//!
//! Names follow QEMU's `docs/interop/vfio-user.rst` and `<linux/vfio.h>`.

use std::fmt;

/// Size of the header that starts every message, request or reply.
pub const HEADER_SIZE: usize = 16;

/// The protocol version this crate speaks (QEMU's client proposes 0.0 and
/// refuses a reply with another major or a larger minor).
pub const VERSION_MAJOR: u16 = 0;
/// See [`VERSION_MAJOR`].
pub const VERSION_MINOR: u16 = 0;

/// The only DMA page size supported: 4 KiB (`pgsizes` = 4096).
pub const PAGE_SIZE: u64 = 4096;

/// Command numbers (the header's `command` field).
pub mod cmd {
    /// VFIO_USER_VERSION: the first message of a connection.
    pub const VERSION: u16 = 1;
    /// VFIO_USER_DMA_MAP.
    pub const DMA_MAP: u16 = 2;
    /// VFIO_USER_DMA_UNMAP.
    pub const DMA_UNMAP: u16 = 3;
    /// VFIO_USER_DEVICE_GET_INFO.
    pub const DEVICE_GET_INFO: u16 = 4;
    /// VFIO_USER_DEVICE_GET_REGION_INFO.
    pub const DEVICE_GET_REGION_INFO: u16 = 5;
    /// VFIO_USER_DEVICE_GET_REGION_IO_FDS (not served: ENOSYS).
    pub const DEVICE_GET_REGION_IO_FDS: u16 = 6;
    /// VFIO_USER_DEVICE_GET_IRQ_INFO.
    pub const DEVICE_GET_IRQ_INFO: u16 = 7;
    /// VFIO_USER_DEVICE_SET_IRQS.
    pub const DEVICE_SET_IRQS: u16 = 8;
    /// VFIO_USER_REGION_READ.
    pub const REGION_READ: u16 = 9;
    /// VFIO_USER_REGION_WRITE.
    pub const REGION_WRITE: u16 = 10;
    /// VFIO_USER_DMA_READ (server to client; never sent by this crate).
    pub const DMA_READ: u16 = 11;
    /// VFIO_USER_DMA_WRITE (server to client; never sent by this crate).
    pub const DMA_WRITE: u16 = 12;
    /// VFIO_USER_DEVICE_RESET.
    pub const DEVICE_RESET: u16 = 13;
    /// VFIO_USER_REGION_WRITE_MULTI (not advertised, so not served: ENOSYS).
    pub const REGION_WRITE_MULTI: u16 = 15;
    /// VFIO_USER_DEVICE_FEATURE (migration only; not served: ENOSYS).
    pub const DEVICE_FEATURE: u16 = 16;
}

/// Header `flags`: the message type (bits 0-3).
pub const FLAG_TYPE_MASK: u32 = 0xf;
/// Message type: a command.
pub const FLAG_TYPE_COMMAND: u32 = 0x0;
/// Message type: a reply.
pub const FLAG_TYPE_REPLY: u32 = 0x1;
/// Header `flags`: no reply wanted.
pub const FLAG_NO_REPLY: u32 = 0x10;
/// Header `flags`: the reply reports an error; `error` holds the errno.
pub const FLAG_ERROR: u32 = 0x20;

/// VFIO_DEVICE_FLAGS_RESET: the device takes DEVICE_RESET.
pub const DEVICE_FLAG_RESET: u32 = 1 << 0;
/// VFIO_DEVICE_FLAGS_PCI: the device is a PCI device.
pub const DEVICE_FLAG_PCI: u32 = 1 << 1;

/// VFIO_REGION_INFO_FLAG_READ.
pub const REGION_FLAG_READ: u32 = 1 << 0;
/// VFIO_REGION_INFO_FLAG_WRITE.
pub const REGION_FLAG_WRITE: u32 = 1 << 1;
/// VFIO_REGION_INFO_FLAG_MMAP: the reply carries a descriptor to mmap.
pub const REGION_FLAG_MMAP: u32 = 1 << 2;
/// VFIO_REGION_INFO_FLAG_CAPS: a capability list follows the region info.
pub const REGION_FLAG_CAPS: u32 = 1 << 3;

/// VFIO_REGION_INFO_CAP_SPARSE_MMAP.
pub const CAP_SPARSE_MMAP: u16 = 1;
/// The sparse-mmap capability's version.
pub const CAP_SPARSE_MMAP_VERSION: u16 = 1;

/// VFIO_IRQ_INFO_EVENTFD.
pub const IRQ_INFO_EVENTFD: u32 = 1 << 0;
/// VFIO_IRQ_INFO_MASKABLE.
pub const IRQ_INFO_MASKABLE: u32 = 1 << 1;
/// VFIO_IRQ_INFO_AUTOMASKED.
pub const IRQ_INFO_AUTOMASKED: u32 = 1 << 2;
/// VFIO_IRQ_INFO_NORESIZE.
pub const IRQ_INFO_NORESIZE: u32 = 1 << 3;

/// VFIO_IRQ_SET_DATA_NONE.
pub const IRQ_SET_DATA_NONE: u32 = 1 << 0;
/// VFIO_IRQ_SET_DATA_BOOL.
pub const IRQ_SET_DATA_BOOL: u32 = 1 << 1;
/// VFIO_IRQ_SET_DATA_EVENTFD.
pub const IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
/// VFIO_IRQ_SET_ACTION_MASK.
pub const IRQ_SET_ACTION_MASK: u32 = 1 << 3;
/// VFIO_IRQ_SET_ACTION_UNMASK.
pub const IRQ_SET_ACTION_UNMASK: u32 = 1 << 4;
/// VFIO_IRQ_SET_ACTION_TRIGGER.
pub const IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;
/// The data bits of a SET_IRQS `flags`.
pub const IRQ_SET_DATA_MASK: u32 = IRQ_SET_DATA_NONE | IRQ_SET_DATA_BOOL | IRQ_SET_DATA_EVENTFD;
/// The action bits of a SET_IRQS `flags`.
pub const IRQ_SET_ACTION_MASK_ALL: u32 = IRQ_SET_ACTION_MASK | IRQ_SET_ACTION_UNMASK | IRQ_SET_ACTION_TRIGGER;

/// DMA_MAP `flags`: readable.
pub const DMA_MAP_FLAG_READ: u32 = 1 << 0;
/// DMA_MAP `flags`: writeable.
pub const DMA_MAP_FLAG_WRITE: u32 = 1 << 1;
/// DMA_MAP `flags`: access mode mmap (needs a descriptor).
pub const DMA_MAP_FLAG_MMAP: u32 = 1 << 2;
/// DMA_MAP `flags`: access mode file I/O (needs a descriptor; not served).
pub const DMA_MAP_FLAG_FILE_IO: u32 = 1 << 3;

/// DMA_UNMAP `flags`: VFIO_DMA_UNMAP_FLAG_ALL, which QEMU sends (with
/// address and size 0) when the whole address space goes away. The spec
/// says the field is unused; QEMU's client uses the kernel's bit.
pub const DMA_UNMAP_FLAG_ALL: u32 = 1 << 1;

/// Reads a little-endian u16 at `off`; the caller has checked the length.
fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

/// The header of every message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Message id, chosen by the sender of a command, echoed in its reply.
    pub id: u16,
    /// The command (see [`cmd`]).
    pub command: u16,
    /// Size of the whole message, header included.
    pub size: u32,
    /// Type, no-reply and error bits.
    pub flags: u32,
    /// In a reply with [`FLAG_ERROR`]: the errno (may be 0).
    pub error: u32,
}

impl Header {
    /// Decodes the first [`HEADER_SIZE`] bytes of `b`, or `None` if shorter.
    pub fn decode(b: &[u8]) -> Option<Header> {
        let b = b.get(..HEADER_SIZE)?;
        Some(Header {
            id: u16_at(b, 0),
            command: u16_at(b, 2),
            size: u32_at(b, 4),
            flags: u32_at(b, 8),
            error: u32_at(b, 12),
        })
    }

    /// The 16 bytes on the wire.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..2].copy_from_slice(&self.id.to_le_bytes());
        b[2..4].copy_from_slice(&self.command.to_le_bytes());
        b[4..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.error.to_le_bytes());
        b
    }

    /// The message type bits.
    pub fn msg_type(&self) -> u32 {
        self.flags & FLAG_TYPE_MASK
    }

    /// Whether the sender wants no reply.
    pub fn no_reply(&self) -> bool {
        self.flags & FLAG_NO_REPLY != 0
    }

    /// Whether this (reply) reports an error.
    pub fn is_error(&self) -> bool {
        self.flags & FLAG_ERROR != 0
    }
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "id {} command {} size {} flags {:#x} error {}",
            self.id, self.command, self.size, self.flags, self.error
        )
    }
}

macro_rules! put {
    ($out:expr, $($v:expr),+) => {
        $( $out.extend_from_slice(&$v.to_le_bytes()); )+
    };
}

/// DMA_MAP request payload (`struct vfio_iommu_type1_dma_map` with `vaddr`
/// replaced by the descriptor offset).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaMapMsg {
    /// Size of this structure (32).
    pub argsz: u32,
    /// `DMA_MAP_FLAG_*`.
    pub flags: u32,
    /// Offset of the region in the passed descriptor.
    pub offset: u64,
    /// The DMA address (IOVA) of the region.
    pub iova: u64,
    /// Size of the region.
    pub size: u64,
}

impl DmaMapMsg {
    /// Payload size.
    pub const SIZE: usize = 32;

    /// Decodes a payload; `None` if shorter than [`Self::SIZE`].
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::SIZE)?;
        Some(Self {
            argsz: u32_at(b, 0),
            flags: u32_at(b, 4),
            offset: u64_at(b, 8),
            iova: u64_at(b, 16),
            size: u64_at(b, 24),
        })
    }

    /// Appends the payload to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put!(out, self.argsz, self.flags, self.offset, self.iova, self.size);
    }
}

/// DMA_UNMAP request payload, echoed as the reply's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmaUnmapMsg {
    /// Maximum size of the reply payload (at least 24).
    pub argsz: u32,
    /// 0, or [`DMA_UNMAP_FLAG_ALL`].
    pub flags: u32,
    /// The DMA address of a mapped region.
    pub iova: u64,
    /// Its size.
    pub size: u64,
}

impl DmaUnmapMsg {
    /// Payload size.
    pub const SIZE: usize = 24;

    /// Decodes a payload; `None` if shorter than [`Self::SIZE`].
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::SIZE)?;
        Some(Self { argsz: u32_at(b, 0), flags: u32_at(b, 4), iova: u64_at(b, 8), size: u64_at(b, 16) })
    }

    /// Appends the payload to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put!(out, self.argsz, self.flags, self.iova, self.size);
    }
}

/// DEVICE_GET_INFO payload (`struct vfio_device_info`), request and reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceInfoMsg {
    /// Request: the reply's maximum size; reply: its full size (16).
    pub argsz: u32,
    /// `DEVICE_FLAG_*`.
    pub flags: u32,
    /// Number of regions.
    pub num_regions: u32,
    /// Number of interrupt types.
    pub num_irqs: u32,
}

impl DeviceInfoMsg {
    /// Payload size.
    pub const SIZE: usize = 16;

    /// Decodes a payload; `None` if shorter than [`Self::SIZE`].
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::SIZE)?;
        Some(Self { argsz: u32_at(b, 0), flags: u32_at(b, 4), num_regions: u32_at(b, 8), num_irqs: u32_at(b, 12) })
    }

    /// Appends the payload to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put!(out, self.argsz, self.flags, self.num_regions, self.num_irqs);
    }
}

/// DEVICE_GET_REGION_INFO payload (`struct vfio_region_info`), request and
/// the fixed part of the reply (capabilities follow it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionInfoMsg {
    /// Request: the reply's maximum size; reply: the size of the full
    /// reply, capabilities included.
    pub argsz: u32,
    /// `REGION_FLAG_*`.
    pub flags: u32,
    /// The region's index.
    pub index: u32,
    /// Offset of the first capability from the start of this structure.
    pub cap_offset: u32,
    /// Size of the region.
    pub size: u64,
    /// Offset to give mmap() for the region's descriptor.
    pub offset: u64,
}

impl RegionInfoMsg {
    /// Payload size.
    pub const SIZE: usize = 32;

    /// Decodes a payload; `None` if shorter than [`Self::SIZE`].
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::SIZE)?;
        Some(Self {
            argsz: u32_at(b, 0),
            flags: u32_at(b, 4),
            index: u32_at(b, 8),
            cap_offset: u32_at(b, 12),
            size: u64_at(b, 16),
            offset: u64_at(b, 24),
        })
    }

    /// Appends the payload to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put!(out, self.argsz, self.flags, self.index, self.cap_offset, self.size, self.offset);
    }
}

/// One area of a sparse-mmap capability: a part of a region the client may
/// mmap, at `offset` from the region's mmap offset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SparseArea {
    /// Offset of the area in the region.
    pub offset: u64,
    /// Size of the area.
    pub size: u64,
}

/// Size of a capability header (`struct vfio_info_cap_header`).
pub const CAP_HEADER_SIZE: usize = 8;

/// Size of a sparse-mmap capability with `n` areas, header included.
pub fn sparse_mmap_cap_size(n: usize) -> usize {
    CAP_HEADER_SIZE + 8 + 16 * n
}

/// Appends a sparse-mmap capability (`struct
/// vfio_region_info_cap_sparse_mmap`) whose `next` is `next`.
pub fn encode_sparse_mmap_cap(out: &mut Vec<u8>, next: u32, areas: &[SparseArea]) {
    put!(out, CAP_SPARSE_MMAP, CAP_SPARSE_MMAP_VERSION, next);
    put!(out, areas.len() as u32, 0u32);
    for a in areas {
        put!(out, a.offset, a.size);
    }
}

/// Why a region-info reply's capability list was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapError {
    /// A capability starts inside the fixed part or runs past the payload.
    OutOfBounds,
    /// The list does not move forward (a loop).
    Loop,
    /// A sparse-mmap capability's areas run past its payload.
    BadSparse,
}

/// Walks the capability list of a region-info reply `payload` (the fixed
/// part included, as offsets count from its start) and returns the areas of
/// its sparse-mmap capabilities; other capabilities are skipped. Bounded by
/// the payload: every `next` must move forward.
pub fn parse_sparse_areas(payload: &[u8], cap_offset: u32) -> Result<Vec<SparseArea>, CapError> {
    let mut areas = Vec::new();
    let mut off = cap_offset as usize;
    while off != 0 {
        if off < RegionInfoMsg::SIZE || off.saturating_add(CAP_HEADER_SIZE) > payload.len() {
            return Err(CapError::OutOfBounds);
        }
        let id = u16_at(payload, off);
        let next = u32_at(payload, off + 4) as usize;
        if id == CAP_SPARSE_MMAP {
            let body = off + CAP_HEADER_SIZE;
            if body + 8 > payload.len() {
                return Err(CapError::BadSparse);
            }
            let n = u32_at(payload, body) as usize;
            let start = body + 8;
            let avail = (payload.len() - start) / 16;
            if n > avail {
                return Err(CapError::BadSparse);
            }
            for i in 0..n {
                let a = start + 16 * i;
                areas.push(SparseArea { offset: u64_at(payload, a), size: u64_at(payload, a + 8) });
            }
        }
        if next != 0 && next <= off {
            return Err(CapError::Loop);
        }
        off = next;
    }
    Ok(areas)
}

/// DEVICE_GET_IRQ_INFO payload (`struct vfio_irq_info`), request and reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqInfoMsg {
    /// Request: the reply's maximum size; reply: 16.
    pub argsz: u32,
    /// `IRQ_INFO_*`.
    pub flags: u32,
    /// The interrupt type's index.
    pub index: u32,
    /// Number of interrupts of that type.
    pub count: u32,
}

impl IrqInfoMsg {
    /// Payload size.
    pub const SIZE: usize = 16;

    /// Decodes a payload; `None` if shorter than [`Self::SIZE`].
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::SIZE)?;
        Some(Self { argsz: u32_at(b, 0), flags: u32_at(b, 4), index: u32_at(b, 8), count: u32_at(b, 12) })
    }

    /// Appends the payload to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put!(out, self.argsz, self.flags, self.index, self.count);
    }
}

/// DEVICE_SET_IRQS request payload (`struct vfio_irq_set` without its
/// data; a DATA_BOOL request has `count` bytes after it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqSetMsg {
    /// Size of the request payload, data included.
    pub argsz: u32,
    /// One `IRQ_SET_DATA_*` and one `IRQ_SET_ACTION_*`.
    pub flags: u32,
    /// The interrupt type's index.
    pub index: u32,
    /// First interrupt of the range.
    pub start: u32,
    /// Number of interrupts in the range.
    pub count: u32,
}

impl IrqSetMsg {
    /// Payload size, without data.
    pub const SIZE: usize = 20;

    /// Decodes a payload; `None` if shorter than [`Self::SIZE`].
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::SIZE)?;
        Some(Self {
            argsz: u32_at(b, 0),
            flags: u32_at(b, 4),
            index: u32_at(b, 8),
            start: u32_at(b, 12),
            count: u32_at(b, 16),
        })
    }

    /// Appends the payload (without data) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put!(out, self.argsz, self.flags, self.index, self.start, self.count);
    }
}

/// REGION_READ / REGION_WRITE payload, request and reply (data follows in
/// a write request and a read reply).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionAccessMsg {
    /// Offset in the region.
    pub offset: u64,
    /// The region's index.
    pub region: u32,
    /// Number of bytes.
    pub count: u32,
}

impl RegionAccessMsg {
    /// Payload size, without data.
    pub const SIZE: usize = 16;

    /// Decodes a payload; `None` if shorter than [`Self::SIZE`].
    pub fn decode(b: &[u8]) -> Option<Self> {
        let b = b.get(..Self::SIZE)?;
        Some(Self { offset: u64_at(b, 0), region: u32_at(b, 8), count: u32_at(b, 12) })
    }

    /// Appends the payload (without data) to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put!(out, self.offset, self.region, self.count);
    }
}

/// Size of the VERSION payload before its JSON (major, minor).
pub const VERSION_FIXED_SIZE: usize = 4;

/// The capabilities of a VERSION message: what its sender accepts. Members
/// this crate does not use (`migration`, `twin_socket`, `write_multiple`)
/// are ignored when read and never written, which declines them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Most descriptors the sender takes in one message (default 1).
    pub max_msg_fds: u32,
    /// Most data bytes the sender takes in one REGION/DMA READ/WRITE
    /// (default 1 MiB).
    pub max_data_xfer_size: u32,
    /// DMA page sizes, or'ed together (default 4096).
    pub pgsizes: u64,
    /// Most DMA mappings valid at once (default 65535).
    pub max_dma_maps: u32,
}

impl Default for Capabilities {
    /// The spec's values for members that are left out.
    fn default() -> Self {
        Capabilities { max_msg_fds: 1, max_data_xfer_size: 1 << 20, pgsizes: PAGE_SIZE, max_dma_maps: 65535 }
    }
}

/// Why a VERSION message's JSON was refused.
#[derive(Debug)]
pub enum VersionError {
    /// The payload is shorter than major and minor.
    Short,
    /// The JSON does not end with the NUL the spec requires.
    NoNul,
    /// Not JSON, or not an object where one is required.
    BadJson(String),
    /// A member has the wrong type.
    BadMember(&'static str),
}

impl fmt::Display for VersionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VersionError::Short => write!(f, "VERSION payload shorter than 4 bytes"),
            VersionError::NoNul => write!(f, "VERSION data not NUL-terminated"),
            VersionError::BadJson(e) => write!(f, "VERSION data: {e}"),
            VersionError::BadMember(m) => write!(f, "VERSION capability {m:?} malformed"),
        }
    }
}

/// A decoded VERSION payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VersionMsg {
    /// Major version.
    pub major: u16,
    /// Minor version.
    pub minor: u16,
    /// Capabilities (the spec's defaults for what is left out).
    pub caps: Capabilities,
}

fn json_u64(v: &serde_json::Value, name: &'static str) -> Result<u64, VersionError> {
    v.as_u64().ok_or(VersionError::BadMember(name))
}

fn saturate_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

impl VersionMsg {
    /// Decodes a VERSION payload: major, minor, and optional JSON ending
    /// with a NUL. Integers are checked for type (non-negative integers),
    /// values that do not fit 32 bits saturate.
    pub fn decode(b: &[u8]) -> Result<Self, VersionError> {
        if b.len() < VERSION_FIXED_SIZE {
            return Err(VersionError::Short);
        }
        let major = u16_at(b, 0);
        let minor = u16_at(b, 2);
        let data = &b[VERSION_FIXED_SIZE..];
        let mut caps = Capabilities::default();
        if !data.is_empty() {
            let Some((&0, json)) = data.split_last() else {
                return Err(VersionError::NoNul);
            };
            let v: serde_json::Value =
                serde_json::from_slice(json).map_err(|e| VersionError::BadJson(e.to_string()))?;
            let obj = v.as_object().ok_or_else(|| VersionError::BadJson("not an object".into()))?;
            if let Some(c) = obj.get("capabilities") {
                let c = c.as_object().ok_or(VersionError::BadMember("capabilities"))?;
                if let Some(v) = c.get("max_msg_fds") {
                    caps.max_msg_fds = saturate_u32(json_u64(v, "max_msg_fds")?);
                }
                if let Some(v) = c.get("max_data_xfer_size") {
                    caps.max_data_xfer_size = saturate_u32(json_u64(v, "max_data_xfer_size")?);
                }
                if let Some(v) = c.get("pgsizes") {
                    caps.pgsizes = json_u64(v, "pgsizes")?;
                }
                if let Some(v) = c.get("max_dma_maps") {
                    caps.max_dma_maps = saturate_u32(json_u64(v, "max_dma_maps")?);
                }
            }
        }
        Ok(VersionMsg { major, minor, caps })
    }

    /// Appends the payload: major, minor, the JSON and its NUL.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put!(out, self.major, self.minor);
        let c = &self.caps;
        let json = format!(
            "{{\"capabilities\":{{\"max_msg_fds\":{},\"max_data_xfer_size\":{},\"pgsizes\":{},\"max_dma_maps\":{}}}}}",
            c.max_msg_fds, c.max_data_xfer_size, c.pgsizes, c.max_dma_maps
        );
        out.extend_from_slice(json.as_bytes());
        out.push(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h =
            Header { id: 0x1234, command: cmd::REGION_READ, size: 48, flags: FLAG_TYPE_REPLY | FLAG_ERROR, error: 22 };
        let b = h.encode();
        assert_eq!(&b[..4], &[0x34, 0x12, 9, 0]);
        assert_eq!(Header::decode(&b), Some(h));
        assert_eq!(Header::decode(&b[..15]), None);
    }

    #[test]
    fn payloads_round_trip() {
        let mut out = Vec::new();
        let m = DmaMapMsg { argsz: 32, flags: 3, offset: 0x1000, iova: 0x2000, size: 0x3000 };
        m.encode(&mut out);
        assert_eq!(out.len(), DmaMapMsg::SIZE);
        assert_eq!(DmaMapMsg::decode(&out), Some(m));
        assert_eq!(DmaMapMsg::decode(&out[..31]), None);

        out.clear();
        let r = RegionInfoMsg { argsz: 80, flags: 0xf, index: 2, cap_offset: 32, size: 0x4000, offset: 0x10000 };
        r.encode(&mut out);
        encode_sparse_mmap_cap(&mut out, 0, &[SparseArea { offset: 0x1000, size: 0x1000 }]);
        assert_eq!(out.len(), 32 + sparse_mmap_cap_size(1));
        assert_eq!(RegionInfoMsg::decode(&out), Some(r));
        assert_eq!(parse_sparse_areas(&out, 32), Ok(vec![SparseArea { offset: 0x1000, size: 0x1000 }]));
    }

    #[test]
    fn hostile_capability_lists() {
        let mut out = Vec::new();
        RegionInfoMsg::default().encode(&mut out);
        // A capability pointing into the fixed part.
        assert_eq!(parse_sparse_areas(&out, 8), Err(CapError::OutOfBounds));
        // Past the end.
        assert_eq!(parse_sparse_areas(&out, 32), Err(CapError::OutOfBounds));
        // A list pointing back at itself.
        encode_sparse_mmap_cap(&mut out, 32, &[]);
        assert_eq!(parse_sparse_areas(&out, 32), Err(CapError::Loop));
        // More areas than the payload holds.
        let mut out2 = Vec::new();
        RegionInfoMsg::default().encode(&mut out2);
        encode_sparse_mmap_cap(&mut out2, 0, &[SparseArea::default()]);
        out2[40..44].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(parse_sparse_areas(&out2, 32), Err(CapError::BadSparse));
    }

    #[test]
    fn version_json() {
        let mut out = Vec::new();
        let v = VersionMsg {
            major: 0,
            minor: 0,
            caps: Capabilities { max_msg_fds: 16, max_data_xfer_size: 1 << 20, pgsizes: 4096, max_dma_maps: 100 },
        };
        v.encode(&mut out);
        assert_eq!(*out.last().unwrap(), 0);
        assert_eq!(VersionMsg::decode(&out).unwrap(), v);

        // What QEMU 11.1's client sends.
        let qemu = b"{\"capabilities\":{\"migration\":{\"pgsize\":4096,\"max_bitmap_size\":268435456},\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,\"max_dma_maps\":65535,\"write_multiple\":true}}\0";
        let mut b = vec![0, 0, 0, 0];
        b.extend_from_slice(qemu);
        let d = VersionMsg::decode(&b).unwrap();
        assert_eq!(d.caps.max_msg_fds, 16);
        assert_eq!(d.caps.max_dma_maps, 65535);

        // No JSON: the spec's defaults.
        assert_eq!(VersionMsg::decode(&[0, 0, 1, 0]).unwrap().caps, Capabilities::default());
        assert!(matches!(VersionMsg::decode(&[0, 0, 0]), Err(VersionError::Short)));
        assert!(matches!(VersionMsg::decode(b"\0\0\0\0{}"), Err(VersionError::NoNul)));
        assert!(matches!(VersionMsg::decode(b"\0\0\0\0{\0"), Err(VersionError::BadJson(_))));
        assert!(matches!(VersionMsg::decode(b"\0\0\0\0[1]\0"), Err(VersionError::BadJson(_))));
        assert!(matches!(
            VersionMsg::decode(b"\0\0\0\0{\"capabilities\":{\"max_msg_fds\":-1}}\0"),
            Err(VersionError::BadMember("max_msg_fds"))
        ));
        assert!(matches!(
            VersionMsg::decode(b"\0\0\0\0{\"capabilities\":7}\0"),
            Err(VersionError::BadMember("capabilities"))
        ));
    }
}
