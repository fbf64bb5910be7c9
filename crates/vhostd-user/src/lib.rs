//! vhostd-user: the project's own vhost-user *frontend* ("virtio-user").
//!
//! It plays the part a VMM plays for a vhost-user backend, from a plain
//! process: it connects to the backend's socket, negotiates features, shares
//! its "guest memory" (a memfd, not hugepages) with SET_MEM_TABLE, lays out
//! split or packed rings in it and drives them with `virtq_driver`, as a
//! virtio-net, virtio-blk or virtio-scsi driver. Used by integration tests
//! (including hostile-ring tests, through the raw ring accessors and `blk`'s
//! and `scsi`'s raw chains) and by the `vhostd-user` benchmark CLI.
//!
//! ```no_run
//! use vhostd_user::{Options, VirtioUser};
//! let mut dev = VirtioUser::connect(Options::new("/tmp/vhost.sock")).unwrap();
//! let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
//! tx.send_frame(&[0u8; 60]).unwrap();
//! tx.flush().unwrap();
//! rx.recv_burst(32, |frame| println!("got {} bytes", frame.len())).unwrap();
//! ```
//!
//! A virtio-blk device is opened the same way with `Options::blk`; see the
//! `blk` module:
//!
//! ```no_run
//! use vhostd_user::{blk, Options, VirtioUser};
//! let mut dev = VirtioUser::connect(Options::blk("/tmp/blk.sock")).unwrap();
//! let cfg = dev.blk_config().unwrap();
//! let mut q = dev.blk_queue(0, 32, 4096).unwrap();
//! let (status, used_len) = q.run_one(blk::BlkOp::Read { sector: 0, len: 4096 }).unwrap();
//! println!("{} sectors; read 0: status {status}, {used_len} bytes", cfg.capacity);
//! ```
//!
//! A virtio-scsi device with `Options::scsi`; see the `scsi` module:
//!
//! ```no_run
//! use vhostd_user::{scsi, Options, VirtioUser};
//! let mut dev = VirtioUser::connect(Options::scsi("/tmp/scsi.sock")).unwrap();
//! let mut q = dev.scsi_queue(0, 32, 4096).unwrap();
//! q.set_lun(0);
//! let r = q.request(scsi::Cmd::inquiry(None, 96), &[], std::time::Duration::from_secs(10)).unwrap();
//! println!("response {} status {}: {:?}", r.resp.response, r.resp.status, &r.data[8..16]);
//! ```
//!
//! A vfio-user device (vhostd `--transport vfio-user`) is driven by
//! `vfio::VfioBlk`, which plays the VMM and the guest's virtio-pci driver
//! and hands out the same `BlkQueue`s:
//!
//! ```no_run
//! use std::time::Duration;
//! use vhostd_user::vfio::{VfioBlk, VfioOptions};
//! let mut dev = VfioBlk::connect("/tmp/vfio.sock".as_ref(), &VfioOptions::blk(), Duration::from_secs(5)).unwrap();
//! let mut q = dev.blk_queue(0, 32, 4096).unwrap();
//! dev.driver_ok().unwrap();
//! let (status, _) = q.run_one(vhostd_user::blk::BlkOp::Read { sector: 0, len: 4096 }).unwrap();
//! println!("read 0: status {status}");
//! ```
//!
//! A backend that tracks requests in flight (INFLIGHT_SHMFD) can be killed
//! and started again under load: `get_inflight_fd` before the rings start,
//! then `reconnect` and `restart_queue`, as QEMU does with `reconnect=1`.
//!
//! Nothing the backend sends (socket replies, used rings) can make this
//! library panic: it returns errors.

#![deny(missing_docs)]

pub mod blk;
pub mod memory;
pub mod net;
pub mod queue;
pub mod scsi;
pub mod vfio;

pub use blk::{BlkConfig, BlkOp, BlkQueue};
pub use memory::FrontendMemory;
pub use net::{build_udp_frame, NetStats, RxQueue, TxQueue};
pub use queue::VirtQueue;
pub use vhost::vhost_user::VhostUserProtocolFeatures;
pub use virtq_driver::{
    Buf, Descriptor, DriverError, DriverMemory, DriverRing, PackedDesc, PackedDriver, RingLayout, SharedBytes,
    SharedBytesMut, SharedMemory, SplitDriver, Used,
};

use std::path::PathBuf;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserInflight};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserDirtyLogRegion, VhostUserMemoryRegionInfo, VringConfigData};

/// Feature bits, named for the device they belong to: the device crates'
/// own definitions (from virtio-bindings), gathered for the frontend.
pub mod features {
    use vhostd_blk::features as blk;
    use vhostd_net::features as net;
    use vhostd_scsi::wire::features as scsi;
    use virtq::ring::features as ring;

    /// VIRTIO_NET_F_CSUM
    pub const NET_CSUM: u64 = net::CSUM;
    /// VIRTIO_NET_F_GUEST_CSUM
    pub const NET_GUEST_CSUM: u64 = net::GUEST_CSUM;
    /// VIRTIO_NET_F_CTRL_GUEST_OFFLOADS
    pub const NET_CTRL_GUEST_OFFLOADS: u64 = net::CTRL_GUEST_OFFLOADS;
    /// VIRTIO_NET_F_GUEST_TSO4
    pub const NET_GUEST_TSO4: u64 = net::GUEST_TSO4;
    /// VIRTIO_NET_F_HOST_TSO4
    pub const NET_HOST_TSO4: u64 = net::HOST_TSO4;
    /// VIRTIO_NET_F_MAC
    pub const NET_MAC: u64 = net::MAC;
    /// VIRTIO_NET_F_GUEST_ANNOUNCE
    pub const NET_GUEST_ANNOUNCE: u64 = net::GUEST_ANNOUNCE;
    /// VIRTIO_NET_F_MRG_RXBUF
    pub const NET_MRG_RXBUF: u64 = net::MRG_RXBUF;
    /// VIRTIO_NET_F_STATUS
    pub const NET_STATUS: u64 = net::STATUS;
    /// VIRTIO_NET_F_CTRL_VQ
    pub const NET_CTRL_VQ: u64 = net::CTRL_VQ;
    /// VIRTIO_NET_F_MQ
    pub const NET_MQ: u64 = net::MQ;
    /// VIRTIO_BLK_F_SIZE_MAX
    pub const BLK_SIZE_MAX: u64 = blk::SIZE_MAX;
    /// VIRTIO_BLK_F_SEG_MAX
    pub const BLK_SEG_MAX: u64 = blk::SEG_MAX;
    /// VIRTIO_BLK_F_GEOMETRY
    pub const BLK_GEOMETRY: u64 = blk::GEOMETRY;
    /// VIRTIO_BLK_F_RO
    pub const BLK_RO: u64 = blk::RO;
    /// VIRTIO_BLK_F_BLK_SIZE
    pub const BLK_BLK_SIZE: u64 = blk::BLK_SIZE;
    /// VIRTIO_BLK_F_FLUSH
    pub const BLK_FLUSH: u64 = blk::FLUSH;
    /// VIRTIO_BLK_F_TOPOLOGY
    pub const BLK_TOPOLOGY: u64 = blk::TOPOLOGY;
    /// VIRTIO_BLK_F_CONFIG_WCE
    pub const BLK_CONFIG_WCE: u64 = blk::CONFIG_WCE;
    /// VIRTIO_BLK_F_MQ
    pub const BLK_MQ: u64 = blk::MQ;
    /// VIRTIO_BLK_F_DISCARD
    pub const BLK_DISCARD: u64 = blk::DISCARD;
    /// VIRTIO_BLK_F_WRITE_ZEROES
    pub const BLK_WRITE_ZEROES: u64 = blk::WRITE_ZEROES;
    /// Every virtio-blk feature the `blk` module understands.
    pub const BLK_ALL: u64 = BLK_SIZE_MAX
        | BLK_SEG_MAX
        | BLK_GEOMETRY
        | BLK_RO
        | BLK_BLK_SIZE
        | BLK_FLUSH
        | BLK_TOPOLOGY
        | BLK_CONFIG_WCE
        | BLK_MQ
        | BLK_DISCARD
        | BLK_WRITE_ZEROES;
    /// VIRTIO_SCSI_F_INOUT
    pub const SCSI_INOUT: u64 = scsi::INOUT;
    /// VIRTIO_SCSI_F_HOTPLUG
    pub const SCSI_HOTPLUG: u64 = scsi::HOTPLUG;
    /// VIRTIO_SCSI_F_CHANGE
    pub const SCSI_CHANGE: u64 = scsi::CHANGE;
    /// VIRTIO_SCSI_F_T10_PI
    pub const SCSI_T10_PI: u64 = scsi::T10_PI;
    /// VIRTIO_RING_F_INDIRECT_DESC
    pub const INDIRECT_DESC: u64 = ring::INDIRECT_DESC;
    /// VIRTIO_RING_F_EVENT_IDX
    pub const EVENT_IDX: u64 = ring::EVENT_IDX;
    /// VHOST_USER_F_PROTOCOL_FEATURES
    pub const PROTOCOL_FEATURES: u64 = vhost::vhost_user::message::VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    /// VHOST_F_LOG_ALL: log every store into guest memory (migration).
    pub const LOG_ALL: u64 = vhost::vhost_user::message::VhostUserVirtioFeatures::LOG_ALL.bits();
    /// VIRTIO_F_VERSION_1
    pub const VERSION_1: u64 = ring::VERSION_1;
    /// VIRTIO_F_RING_PACKED
    pub const RING_PACKED: u64 = ring::RING_PACKED;
    /// VIRTIO_F_IN_ORDER
    pub const IN_ORDER: u64 = ring::IN_ORDER;
}

/// Everything that can go wrong.
#[derive(Debug)]
pub enum Error {
    /// A vhost-user request failed (socket, protocol or backend error).
    Vhost(&'static str, vhost::Error),
    /// A system call failed.
    Io(std::io::Error),
    /// The ring misbehaved or was misused.
    Ring(DriverError),
    /// The backend lacks something we need.
    Unsupported(String),
    /// Bad parameters.
    Config(String),
    /// The backend did not answer in time.
    Timeout(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Vhost(what, e) => write!(f, "{what}: {e}"),
            Error::Io(e) => write!(f, "{e}"),
            Error::Ring(e) => write!(f, "virtqueue: {e}"),
            Error::Unsupported(s) => write!(f, "backend does not support {s}"),
            Error::Config(s) => f.write_str(s),
            Error::Timeout(s) => write!(f, "timed out: {s}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Error {
        Error::Ring(e)
    }
}

fn vh(what: &'static str) -> impl FnOnce(vhost::Error) -> Error {
    move |e| Error::Vhost(what, e)
}

/// The kind of virtio device the backend implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceType {
    /// virtio-net (device type 1).
    Net,
    /// virtio-blk (device type 2).
    Blk,
    /// virtio-scsi (device type 8).
    Scsi,
}

/// How to connect and what to ask for.
#[derive(Clone, Debug)]
pub struct Options {
    /// The backend's Unix socket.
    pub socket_path: PathBuf,
    /// Which device the backend is: decides the config space read at
    /// connect time and the queue count assumed without MQ.
    pub device: DeviceType,
    /// Guest memory size in bytes (a memfd, 4 KiB pages).
    pub mem_size: u64,
    /// Guest-physical address of the memory (0: gpa = offset in the memfd).
    pub gpa_base: u64,
    /// Make the memfd sealable (MFD_ALLOW_SEALING), as QEMU does; false
    /// plays a frontend whose memory the backend cannot seal.
    pub sealable_memory: bool,
    /// Virtio feature bits to request; each is acked only if offered.
    /// VHOST_USER_F_PROTOCOL_FEATURES is added when offered.
    pub features: u64,
    /// Feature bits the backend must offer (else `connect` fails).
    pub required: u64,
    /// Protocol features to ack when offered.
    pub protocol_features: VhostUserProtocolFeatures,
    /// Use ADD_MEM_REG instead of SET_MEM_TABLE when CONFIGURE_MEM_SLOTS is acked.
    pub add_mem_reg: bool,
    /// RX/TX buffer size per descriptor, virtio-net header included.
    pub buf_size: u32,
}

impl Options {
    /// Defaults: 64 MiB, gpa = offset, VERSION_1 + EVENT_IDX + MRG_RXBUF +
    /// MAC + STATUS + MQ requested, VERSION_1 required, protocol features MQ,
    /// REPLY_ACK, CONFIG, CONFIGURE_MEM_SLOTS and LOG_SHMFD, 2 KiB buffers.
    pub fn new(socket_path: impl Into<PathBuf>) -> Options {
        use features::*;
        Options {
            socket_path: socket_path.into(),
            device: DeviceType::Net,
            mem_size: 64 << 20,
            gpa_base: 0,
            sealable_memory: true,
            features: VERSION_1 | EVENT_IDX | NET_MRG_RXBUF | NET_MAC | NET_STATUS | NET_MQ,
            required: VERSION_1,
            protocol_features: VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::REPLY_ACK
                | VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
                | VhostUserProtocolFeatures::LOG_SHMFD,
            add_mem_reg: false,
            buf_size: 2048,
        }
    }
}

impl Options {
    /// A virtio-blk device: VERSION_1 (required), EVENT_IDX and every blk
    /// feature `blk` understands requested (add `features::RING_PACKED` for
    /// a packed ring), 64 MiB of memory, the same protocol features as `new`.
    pub fn blk(socket_path: impl Into<PathBuf>) -> Options {
        Options {
            device: DeviceType::Blk,
            features: features::VERSION_1 | features::EVENT_IDX | features::BLK_ALL,
            ..Options::new(socket_path)
        }
    }

    /// A virtio-scsi device: VERSION_1 (required), EVENT_IDX, HOTPLUG and
    /// CHANGE requested (add `features::RING_PACKED` for packed rings, and
    /// protocol feature INFLIGHT_SHMFD to track requests in flight), 64 MiB
    /// of memory, the same protocol features as `new`.
    pub fn scsi(socket_path: impl Into<PathBuf>) -> Options {
        Options {
            device: DeviceType::Scsi,
            features: features::VERSION_1 | features::EVENT_IDX | features::SCSI_HOTPLUG | features::SCSI_CHANGE,
            ..Options::new(socket_path)
        }
    }
}

/// A dirty-page log as a frontend shares it for live migration
/// (SET_LOG_BASE with protocol feature LOG_SHMFD): bit `p % 8` of byte
/// `p / 8` stands for guest page `p` (guest-physical address / 4 KiB), and
/// the backend sets it when it stores into that page.
pub struct DirtyLog {
    file: std::fs::File,
    mem: DriverMemory,
}

impl DirtyLog {
    /// Bytes of guest memory one bit stands for.
    pub const PAGE: u64 = 4096;

    /// A zeroed log for guest-physical addresses below `end`, in a sealable
    /// memfd (as QEMU's).
    pub fn covering(end: u64) -> Result<DirtyLog, Error> {
        let bytes = end.div_ceil(Self::PAGE * 8).max(1);
        let file = virtq_driver::memfd("vhostd-user-log", bytes, true).map_err(Error::Io)?;
        let map = SharedMemory::map(&file, 0, bytes).map_err(Error::Io)?;
        Ok(DirtyLog { file, mem: DriverMemory::new(std::sync::Arc::new(map), 0) })
    }

    /// The memfd (to hand over, or to hand over wrongly).
    pub fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// Bytes of bitmap.
    pub fn size(&self) -> u64 {
        self.mem.len()
    }

    /// The pages marked dirty (page numbers, ascending).
    pub fn dirty_pages(&self) -> std::collections::BTreeSet<u64> {
        let mut bits = vec![0u8; self.size() as usize];
        self.mem.read(0, &mut bits);
        let mut out = std::collections::BTreeSet::new();
        for (i, &b) in bits.iter().enumerate() {
            for bit in 0..8 {
                if b & (1 << bit) != 0 {
                    out.insert(i as u64 * 8 + bit);
                }
            }
        }
        out
    }

    /// Clears every bit (what QEMU does as it syncs the log).
    pub fn clear(&self) {
        self.mem.write(0, &vec![0u8; self.size() as usize]);
    }
}

/// The start of virtio-net's config space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// MAC address.
    pub mac: [u8; 6],
    /// VIRTIO_NET_S_* bits (1 = link up).
    pub status: u16,
    /// Most queue pairs the device supports.
    pub max_virtqueue_pairs: u16,
}

/// A connected, negotiated vhost-user session with its guest memory.
pub struct VirtioUser {
    fe: Frontend,
    mem: FrontendMemory,
    opts: Options,
    offered: u64,
    features: u64,
    protocol: VhostUserProtocolFeatures,
    max_queues: u64,
    config: Option<NetConfig>,
    blk_config: Option<BlkConfig>,
    scsi_config: Option<scsi::ScsiConfig>,
    config_error: Option<String>,
    started: Vec<usize>,
    /// The inflight memory the backend gave (GET_INFLIGHT_FD), kept for
    /// the next backend (SET_INFLIGHT_FD on `reconnect`).
    inflight: Option<(VhostUserInflight, std::fs::File)>,
}

/// What feature negotiation settled: features acked, protocol features
/// acked, queue count, what the backend offered.
struct Negotiated {
    offered: u64,
    features: u64,
    protocol: VhostUserProtocolFeatures,
    max_queues: u64,
}

/// Queue-count bound used before (or without) GET_QUEUE_NUM.
const DEFAULT_MAX_QUEUES: u64 = 256;

impl VirtioUser {
    /// Connects, negotiates features and protocol features, reads the config
    /// space when CONFIG was acked, and shares the guest memory.
    pub fn connect(opts: Options) -> Result<VirtioUser, Error> {
        let fe = Frontend::connect(&opts.socket_path, DEFAULT_MAX_QUEUES).map_err(vh("connect"))?;
        Self::with_frontend(fe, opts)
    }

    /// Like `connect`, over an already connected stream (e.g. a socketpair).
    pub fn from_stream(sock: std::os::unix::net::UnixStream, opts: Options) -> Result<VirtioUser, Error> {
        Self::with_frontend(Frontend::from_stream(sock, DEFAULT_MAX_QUEUES), opts)
    }

    fn with_frontend(mut fe: Frontend, opts: Options) -> Result<VirtioUser, Error> {
        let n = Self::negotiate(&mut fe, &opts)?;
        let mut dev = VirtioUser {
            fe,
            mem: FrontendMemory::new(opts.mem_size, opts.gpa_base, opts.sealable_memory)?,
            opts,
            offered: n.offered,
            features: n.features,
            protocol: n.protocol,
            max_queues: n.max_queues,
            config: None,
            blk_config: None,
            scsi_config: None,
            config_error: None,
            started: Vec::new(),
            inflight: None,
        };
        dev.read_device_config();
        dev.share_memory()?;
        Ok(dev)
    }

    /// SET_OWNER, features and protocol features, GET_QUEUE_NUM.
    fn negotiate(fe: &mut Frontend, opts: &Options) -> Result<Negotiated, Error> {
        fe.set_owner().map_err(vh("SET_OWNER"))?;
        let offered = fe.get_features().map_err(vh("GET_FEATURES"))?;
        let missing = opts.required & !offered;
        if missing != 0 {
            return Err(Error::Unsupported(format!("required features {missing:#x} (offered {offered:#x})")));
        }
        let mut features = opts.features & offered & !features::PROTOCOL_FEATURES;
        let mut protocol = VhostUserProtocolFeatures::empty();
        // GET_QUEUE_NUM counts virtqueues (the vhost-user spec's reading,
        // and the vhost crate's); without MQ a net device has one pair, a
        // blk device one request queue, a scsi device its control and
        // event queues and one request queue.
        let mut max_queues = match opts.device {
            DeviceType::Net => 2,
            DeviceType::Blk => 1,
            DeviceType::Scsi => 3,
        };
        if offered & features::PROTOCOL_FEATURES != 0 {
            features |= features::PROTOCOL_FEATURES;
            let pf = fe.get_protocol_features().map_err(vh("GET_PROTOCOL_FEATURES"))?;
            protocol = pf & opts.protocol_features;
            fe.set_protocol_features(protocol).map_err(vh("SET_PROTOCOL_FEATURES"))?;
            if protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                // Every request without a reply of its own gets an ack, so a
                // backend's refusal surfaces at the request that caused it.
                fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            if protocol.contains(VhostUserProtocolFeatures::MQ) {
                max_queues = fe.get_queue_num().map_err(vh("GET_QUEUE_NUM"))?;
            }
        }
        fe.set_features(features).map_err(vh("SET_FEATURES"))?;
        Ok(Negotiated { offered, features, protocol, max_queues })
    }

    /// Reads the device's config space when CONFIG was acked; remembers
    /// why not otherwise.
    fn read_device_config(&mut self) {
        self.config_error = None;
        if self.protocol.contains(VhostUserProtocolFeatures::CONFIG) {
            let r = match self.opts.device {
                DeviceType::Net => self.read_net_config().map(|c| self.config = Some(c)),
                DeviceType::Blk => self.read_blk_config().map(|c| self.blk_config = Some(c)),
                DeviceType::Scsi => self.read_scsi_config().map(|c| self.scsi_config = Some(c)),
            };
            if let Err(e) = r {
                self.config_error = Some(e.to_string());
            }
        } else if self.opts.device != DeviceType::Net {
            self.config_error = Some("the backend did not offer protocol feature CONFIG".into());
        }
    }

    /// GET_CONFIG of the first 10 bytes of virtio-net config space.
    pub fn read_net_config(&mut self) -> Result<NetConfig, Error> {
        let buf = [0u8; 10];
        let (_, data) =
            self.fe.get_config(0, buf.len() as u32, VhostUserConfigFlags::empty(), &buf).map_err(vh("GET_CONFIG"))?;
        if data.len() < 10 {
            return Err(Error::Unsupported("a full virtio-net config".into()));
        }
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&data[0..6]);
        Ok(NetConfig {
            mac,
            status: u16::from_le_bytes([data[6], data[7]]),
            max_virtqueue_pairs: u16::from_le_bytes([data[8], data[9]]),
        })
    }

    /// GET_CONFIG of the virtio-blk config space (`blk::CONFIG_LEN` bytes).
    pub fn read_blk_config(&mut self) -> Result<BlkConfig, Error> {
        let buf = [0u8; blk::CONFIG_LEN];
        let (_, data) =
            self.fe.get_config(0, buf.len() as u32, VhostUserConfigFlags::empty(), &buf).map_err(vh("GET_CONFIG"))?;
        BlkConfig::parse(&data).ok_or_else(|| Error::Unsupported("a full virtio-blk config".into()))
    }

    /// GET_CONFIG of the virtio-scsi config space (`scsi::CONFIG_LEN` bytes).
    pub fn read_scsi_config(&mut self) -> Result<scsi::ScsiConfig, Error> {
        let buf = [0u8; scsi::CONFIG_LEN];
        let (_, data) =
            self.fe.get_config(0, buf.len() as u32, VhostUserConfigFlags::empty(), &buf).map_err(vh("GET_CONFIG"))?;
        scsi::ScsiConfig::parse(&data).ok_or_else(|| Error::Unsupported("a full virtio-scsi config".into()))
    }

    fn share_memory(&mut self) -> Result<(), Error> {
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: self.mem.gpa_base(),
            memory_size: self.mem.size(),
            userspace_addr: self.mem.uaddr_base(),
            mmap_offset: 0,
            mmap_handle: self.mem.fd(),
        };
        if self.opts.add_mem_reg && self.protocol.contains(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS) {
            self.fe.add_mem_region(&region).map_err(vh("ADD_MEM_REG"))?;
        } else {
            self.fe.set_mem_table(&[region]).map_err(vh("SET_MEM_TABLE"))?;
        }
        Ok(())
    }

    /// The negotiated virtio features.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// What the backend offered.
    pub fn offered_features(&self) -> u64 {
        self.offered
    }

    /// The acked protocol features.
    pub fn protocol_features(&self) -> VhostUserProtocolFeatures {
        self.protocol
    }

    /// Queues the backend supports (GET_QUEUE_NUM, or 2 without MQ).
    pub fn max_queues(&self) -> u64 {
        self.max_queues
    }

    /// The config space read at connect time, if the backend gave one.
    pub fn net_config(&self) -> Option<NetConfig> {
        self.config
    }

    /// Why GET_CONFIG failed, if it was tried and failed.
    pub fn net_config_error(&self) -> Option<&str> {
        self.config_error.as_deref()
    }

    /// The virtio-blk config space read at connect time (`Options::blk`).
    /// Errors with why it is missing.
    pub fn blk_config(&self) -> Result<BlkConfig, Error> {
        self.blk_config.ok_or_else(|| {
            Error::Unsupported(format!(
                "the virtio-blk config space ({})",
                self.config_error.as_deref().unwrap_or("not a blk connection")
            ))
        })
    }

    /// The virtio-scsi config space read at connect time (`Options::scsi`).
    /// Errors with why it is missing.
    pub fn scsi_config(&self) -> Result<scsi::ScsiConfig, Error> {
        self.scsi_config.ok_or_else(|| {
            Error::Unsupported(format!(
                "the virtio-scsi config space ({})",
                self.config_error.as_deref().unwrap_or("not a scsi connection")
            ))
        })
    }

    /// GET_INFLIGHT_FD (protocol feature INFLIGHT_SHMFD): asks the backend
    /// for memory to log requests in flight in, for `num_queues` virtqueues
    /// of `queue_size` entries (every tracked ring must have that size), and
    /// keeps it for the next backend (`reconnect`). Send it before the
    /// rings start, as QEMU does. Returns the memory's size.
    pub fn get_inflight_fd(&mut self, num_queues: u16, queue_size: u16) -> Result<u64, Error> {
        let ask = VhostUserInflight { mmap_size: 0, mmap_offset: 0, num_queues, queue_size };
        let (info, file) = self.fe.get_inflight_fd(&ask).map_err(vh("GET_INFLIGHT_FD"))?;
        let size = info.mmap_size;
        self.inflight = Some((info, file));
        Ok(size)
    }

    /// The inflight memory kept from `get_inflight_fd`, if any.
    pub fn inflight_file(&self) -> Option<&std::fs::File> {
        self.inflight.as_ref().map(|(_, f)| f)
    }

    /// Connects again to the same socket, keeping the guest memory, the
    /// rings in it and the inflight memory, as QEMU does when its backend
    /// went away (`reconnect=1`): the old connection is closed first (a
    /// backend serves one frontend at a time), the features negotiated
    /// again (they must come out the same), the inflight memory handed
    /// over (SET_INFLIGHT_FD) and the memory shared. Restart each ring with
    /// `restart_queue` afterwards.
    pub fn reconnect(&mut self) -> Result<(), Error> {
        let fe = Frontend::connect(&self.opts.socket_path, DEFAULT_MAX_QUEUES).map_err(vh("connect"))?;
        drop(std::mem::replace(&mut self.fe, fe));
        self.started.clear();
        let n = Self::negotiate(&mut self.fe, &self.opts)?;
        if n.features != self.features || n.protocol != self.protocol {
            return Err(Error::Unsupported(format!(
                "the same features as before ({:#x}, protocol {:#x}; now {:#x}, protocol {:#x})",
                self.features,
                self.protocol.bits(),
                n.features,
                n.protocol.bits()
            )));
        }
        self.offered = n.offered;
        self.max_queues = n.max_queues;
        self.read_device_config();
        if let Some((info, file)) = &self.inflight {
            use std::os::unix::io::AsRawFd;
            self.fe.set_inflight_fd(info, file.as_raw_fd()).map_err(vh("SET_INFLIGHT_FD"))?;
        }
        self.share_memory()
    }

    /// Starts `q` again on a new connection (after `reconnect`) where the
    /// device left it: a split ring at its used index, as QEMU does when
    /// its backend died (a backend with the inflight memory resumes after
    /// the requests it had taken, and runs again those it never answered).
    /// Packed rings are not tracked in flight: refused.
    pub fn restart_queue(&mut self, q: &mut VirtQueue) -> Result<(), Error> {
        let Some(split) = q.ring.split() else {
            return Err(Error::Unsupported("restarting a packed ring on a new connection".into()));
        };
        let base = split.used_idx();
        self.start_queue_at(q, base)
    }

    /// virtio_net_hdr length: 12 with VERSION_1 or MRG_RXBUF, else 10.
    pub fn net_hdr_len(&self) -> usize {
        if self.features & (features::VERSION_1 | features::NET_MRG_RXBUF) != 0 {
            12
        } else {
            10
        }
    }

    /// The guest memory (to allocate buffers or write hostile data).
    pub fn memory(&mut self) -> &mut FrontendMemory {
        &mut self.mem
    }

    /// The underlying `vhost` frontend, for requests this type does not wrap.
    pub fn frontend(&mut self) -> &mut Frontend {
        &mut self.fe
    }

    /// True when the packed ring layout was negotiated.
    pub fn packed(&self) -> bool {
        self.features & features::RING_PACKED != 0
    }

    /// Allocates the rings of queue `index` in guest memory (split or packed,
    /// as negotiated), with kick and call eventfds. Nothing is sent yet: fill
    /// it, then `start_queue`. `indirect_max` adds an indirect-table pool.
    /// Split rings need a power-of-two size; packed rings any size up to 32768.
    pub fn create_queue(&mut self, index: usize, size: u16, indirect_max: Option<u16>) -> Result<VirtQueue, Error> {
        create_queue_in(&mut self.mem, self.features, index, size, indirect_max)
    }

    /// SET_VRING_NUM/BASE/ADDR/KICK/CALL (and SET_VRING_ENABLE when protocol
    /// features are on, `set_vring_enable`) for `q`, starting the backend
    /// at vring base `base` (split: avail index; packed: index | wrap
    /// counter << 15). Once it returns, `q` may be kicked.
    pub fn start_queue_at(&mut self, q: &VirtQueue, base: u16) -> Result<(), Error> {
        let i = q.index();
        let l = q.ring.layout();
        self.fe.set_vring_num(i, l.size).map_err(vh("SET_VRING_NUM"))?;
        self.fe.set_vring_base(i, base).map_err(vh("SET_VRING_BASE"))?;
        self.set_vring_log(q, None)?;
        self.fe.set_vring_kick(i, q.kick_fd()).map_err(vh("SET_VRING_KICK"))?;
        self.fe.set_vring_call(i, q.call_fd()).map_err(vh("SET_VRING_CALL"))?;
        if self.features & features::PROTOCOL_FEATURES != 0 {
            self.set_vring_enable(i, true)?;
        }
        if !self.started.contains(&i) {
            self.started.push(i);
        }
        Ok(())
    }

    /// `start_queue_at` the start of a fresh ring (packed: index 0, wrap counter 1).
    pub fn start_queue(&mut self, q: &VirtQueue) -> Result<(), Error> {
        let base = if q.ring.is_packed() { 0x8000 } else { 0 };
        self.start_queue_at(q, base)
    }

    /// SET_VRING_ENABLE (needs VHOST_USER_F_PROTOCOL_FEATURES), returning
    /// once the backend has taken it: with REPLY_ACK its ack, without it a
    /// GET_FEATURES answered after it (a backend handles requests in
    /// order), as QEMU does ("vhost-user: call VHOST_USER_SET_VRING_ENABLE
    /// synchronously", 2023). A backend may watch kicks on another thread
    /// than requests and drop a kick that finds the ring still disabled
    /// (vhost-user-backend before 0.22, so vhost-device-scsi 0.1): a kick
    /// sent before it read SET_VRING_ENABLE would be lost, and the ring's
    /// first requests never seen.
    pub fn set_vring_enable(&mut self, index: usize, enable: bool) -> Result<(), Error> {
        self.fe.set_vring_enable(index, enable).map_err(vh("SET_VRING_ENABLE"))?;
        if !self.protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
            self.fe.get_features().map_err(vh("GET_FEATURES after SET_VRING_ENABLE"))?;
        }
        Ok(())
    }

    /// GET_VRING_BASE: stops the ring and returns the backend's next avail index.
    pub fn get_vring_base(&mut self, index: usize) -> Result<u32, Error> {
        let r = self.fe.get_vring_base(index).map_err(vh("GET_VRING_BASE"));
        self.started.retain(|&s| s != index);
        r
    }

    /// Sets up virtio-net queue pair `pair` (RX = 2*pair, TX = 2*pair+1) of
    /// `size` entries: buffers allocated, RX buffers posted, both started.
    pub fn net_queue_pair(&mut self, pair: u16, size: u16) -> Result<(RxQueue, TxQueue), Error> {
        let rx_i = 2 * pair as usize;
        if rx_i as u64 + 1 >= self.max_queues {
            return Err(Error::Unsupported(format!("queue pair {pair} (backend has {} queues)", self.max_queues)));
        }
        let hdr = self.net_hdr_len();
        let buf = self.opts.buf_size;
        if (buf as usize) < hdr + 14 {
            return Err(Error::Config(format!("buffer size {buf} is too small")));
        }
        let mrg = self.features & features::NET_MRG_RXBUF != 0;
        let rxq = self.create_queue(rx_i, size, None)?;
        let rx_bufs = self.mem.alloc(size as u64 * buf as u64, 64)?;
        let txq = self.create_queue(rx_i + 1, size, None)?;
        let tx_bufs = self.mem.alloc(size as u64 * buf as u64, 64)?;
        let rx = RxQueue::new(rxq, rx_bufs, buf, hdr, mrg)?;
        let tx = TxQueue::new(txq, tx_bufs, buf, hdr)?;
        self.start_queue(&rx.queue)?;
        self.start_queue(&tx.queue)?;
        Ok((rx, tx))
    }

    /// Starts dirty logging the way QEMU does when a migration starts, with
    /// the rings running: SET_LOG_BASE with `log`, SET_FEATURES with
    /// VHOST_F_LOG_ALL added, then SET_VRING_ADDR with VHOST_VRING_F_LOG for
    /// each of `queues` (log_guest_addr: its used ring or device area).
    pub fn start_dirty_log(&mut self, log: &DirtyLog, queues: &[&VirtQueue]) -> Result<(), Error> {
        self.set_log_base(log)?;
        self.set_logging(queues, true)
    }

    /// SET_LOG_BASE alone: `log`, all of it, from offset 0.
    pub fn set_log_base(&mut self, log: &DirtyLog) -> Result<(), Error> {
        use std::os::unix::io::AsRawFd;
        let region =
            VhostUserDirtyLogRegion { mmap_size: log.size(), mmap_offset: 0, mmap_handle: log.file().as_raw_fd() };
        self.fe.set_log_base(0, Some(region)).map_err(vh("SET_LOG_BASE"))
    }

    /// Ends dirty logging as QEMU does when a migration ends or is
    /// cancelled: SET_FEATURES without LOG_ALL, SET_VRING_ADDR without the
    /// flag (the log itself is then the frontend's to free).
    pub fn stop_dirty_log(&mut self, queues: &[&VirtQueue]) -> Result<(), Error> {
        self.set_logging(queues, false)
    }

    fn set_logging(&mut self, queues: &[&VirtQueue], on: bool) -> Result<(), Error> {
        let f = if on { self.features | features::LOG_ALL } else { self.features };
        self.fe.set_features(f).map_err(vh("SET_FEATURES"))?;
        for q in queues {
            self.set_vring_log(q, on.then_some(q.ring.layout().used))?;
        }
        Ok(())
    }

    /// SET_VRING_ADDR of `q`'s own addresses, with VHOST_VRING_F_LOG and
    /// log_guest_addr `log` (None: without the flag). QEMU gives the used
    /// ring's (or device area's) guest address; a test may give another.
    pub fn set_vring_log(&mut self, q: &VirtQueue, log: Option<u64>) -> Result<(), Error> {
        let l = q.ring.layout();
        let cfg = VringConfigData {
            queue_max_size: l.size,
            queue_size: l.size,
            flags: u32::from(log.is_some()),
            desc_table_addr: self.mem.gpa_to_uaddr(l.desc),
            used_ring_addr: self.mem.gpa_to_uaddr(l.used),
            avail_ring_addr: self.mem.gpa_to_uaddr(l.avail),
            log_addr: log,
        };
        self.fe.set_vring_addr(q.index(), &cfg).map_err(vh("SET_VRING_ADDR"))
    }

    /// The connection's socket (to wait on: readable means the backend
    /// closed it, as nothing is sent unasked).
    pub fn socket(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::unix::io::AsRawFd;
        // SAFETY: the descriptor is `fe`'s, open as long as self is: the
        // borrow cannot outlive it.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fe.as_raw_fd()) }
    }

    /// Whether the backend closed the socket (a non-blocking check).
    pub fn backend_gone(&self) -> bool {
        use std::os::unix::io::AsRawFd;
        let mut p = libc::pollfd { fd: self.fe.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        // Nothing is ever sent unasked, so readability means EOF or an error.
        r > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// GET_VRING_BASE on every started queue (in index order), then closes
    /// the connection. Returns (queue, base) pairs; a failing request ends
    /// the loop with the error.
    pub fn disconnect(mut self) -> Result<Vec<(usize, u32)>, Error> {
        let mut started = std::mem::take(&mut self.started);
        started.sort_unstable();
        let mut out = Vec::with_capacity(started.len());
        for i in started {
            out.push((i, self.get_vring_base(i)?));
        }
        Ok(out)
    }
}

/// `VirtioUser::create_queue` for any transport: the rings of queue
/// `index` in `mem`, laid out as `features` say (split or packed).
pub(crate) fn create_queue_in(
    mem: &mut FrontendMemory,
    features: u64,
    index: usize,
    size: u16,
    indirect_max: Option<u16>,
) -> Result<VirtQueue, Error> {
    let packed = features & features::RING_PACKED != 0;
    if size == 0 || size > virtq::ring::MAX_QUEUE_SIZE || (!packed && !size.is_power_of_two()) {
        return Err(Error::Config(format!(
            "queue size {size} is not {} in 1..=32768",
            if packed { "a size" } else { "a power of two" }
        )));
    }
    let mut ring = if packed {
        let gpa = mem.alloc(RingLayout::packed_footprint(size), 4096)?;
        let layout = RingLayout::packed_at(gpa, size);
        DriverRing::Packed(PackedDriver::new(mem.driver_memory().clone(), layout, features)?)
    } else {
        let gpa = mem.alloc(RingLayout::footprint(size), 4096)?;
        let layout = RingLayout::at(gpa, size);
        DriverRing::Split(SplitDriver::new(mem.driver_memory().clone(), layout, features)?)
    };
    if let Some(max) = indirect_max {
        let pool = mem.alloc(size as u64 * max as u64 * 16, 64)?;
        ring.set_indirect_pool(pool, max)?;
    }
    VirtQueue::new(index, ring)
}
