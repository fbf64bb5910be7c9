//! What a device is to be, in plain terms: the command line and the
//! configuration file both come down to these (cli.rs converts), and the
//! device builder (build.rs) takes nothing else, so it knows nothing of
//! clap or TOML.

use std::os::unix::io::RawFd;
use std::path::PathBuf;
use std::time::Duration;

use vhostd_backends::BackendKind;
use vhostd_block_backends::BlockSpec;

/// One device to serve.
#[derive(Debug)]
pub struct DeviceSpec {
    /// Its name in logs, stats and metrics.
    pub name: String,
    /// Where it meets its frontend.
    pub endpoint: EndpointSpec,
    /// How many queues and how they run.
    pub dataplane: DataplaneSpec,
    /// What kind of device, with its backend.
    pub device: DeviceKind,
    /// The protocol its frontend speaks.
    pub transport: Transport,
}

/// The protocol a device's frontend speaks on its socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// vhost-user: the VMM keeps the virtio device, vhostd the rings.
    #[default]
    VhostUser,
    /// vfio-user: vhostd is the whole virtio-pci device (vhostd::vfio).
    VfioUser,
}

/// Where a device meets its frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointSpec {
    /// Listen on a Unix socket (created; removed on exit).
    Listen(PathBuf),
    /// Connect to a listening frontend, again after each disconnect.
    Connect(PathBuf),
    /// An already-connected socket handed in (exits when it closes).
    Fd(RawFd),
}

/// How a dataplane thread waits for work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitSpec {
    /// Sleep on kicks when idle.
    Interrupt,
    /// Spin, kicks suppressed.
    Poll,
    /// Spin while busy and for `idle` after the last work, then sleep.
    Adaptive {
        /// Spinning without work lasts this long.
        idle: Duration,
    },
}

/// A device's queues and the threads that run them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataplaneSpec {
    /// Queue pairs (net) or request queues (blk): one worker each unless
    /// the daemon has a shared pool.
    pub queues: u16,
    /// The largest ring a frontend may set up.
    pub queue_size: u16,
    /// How its own workers wait.
    pub wait: WaitSpec,
    /// The option that set `wait` (None: the default), for errors.
    pub wait_given: Option<&'static str>,
    /// CPUs to pin its own workers to (worker i gets the i-th, round robin).
    pub cpus: Option<Vec<usize>>,
}

impl DataplaneSpec {
    /// A device on the daemon's shared pool runs in the pool's mode on the
    /// pool's CPUs: its own mode or CPUs would be silently ignored, so
    /// they are refused, naming the option.
    pub fn check_pooled(&self) -> Result<(), String> {
        if let Some(opt) = self.wait_given {
            return Err(format!(
                "--{opt}: devices on the worker pool wait as the pool does: set --worker-mode (or [dataplane] mode)"
            ));
        }
        if self.cpus.is_some() {
            return Err("--cpus: devices on the worker pool run on its workers' CPUs: set --worker-cpus \
                        (or [dataplane] cpus), and `vhostd ctl pin` a queue to a worker"
                .into());
        }
        Ok(())
    }
}

/// The daemon-wide pool of dataplane workers (`--workers`,
/// `--worker-cpus`, `--worker-mode`, or a `[dataplane]` table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    /// How many workers.
    pub workers: usize,
    /// CPUs to pin them to (worker i gets the i-th, round robin).
    pub cpus: Option<Vec<usize>>,
    /// How they wait.
    pub wait: WaitSpec,
    /// Least time between two moves of the balancer (zero: no balancer).
    pub rebalance: Duration,
}

/// The device kinds and what each needs.
#[derive(Debug)]
pub enum DeviceKind {
    /// virtio-net.
    Net {
        /// The packet backend.
        backend: BackendKind,
        /// MAC address in the config space.
        mac: [u8; 6],
    },
    /// virtio-blk.
    Blk {
        /// The block backend.
        backend: BlockSpec,
        /// GET_ID's answer.
        serial: String,
        /// The option that named the backend (for errors).
        option: &'static str,
    },
    /// virtio-scsi: one target with these units (number, backend).
    Scsi {
        /// The units, as --lun gave them.
        luns: Vec<(u16, BlockSpec)>,
    },
}

impl DeviceKind {
    /// `net`, `blk` or `scsi`.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceKind::Net { .. } => "net",
            DeviceKind::Blk { .. } => "blk",
            DeviceKind::Scsi { .. } => "scsi",
        }
    }
}

impl EndpointSpec {
    /// The socket path, if it has one.
    pub fn path(&self) -> Option<&std::path::Path> {
        match self {
            EndpointSpec::Listen(p) | EndpointSpec::Connect(p) => Some(p),
            EndpointSpec::Fd(_) => None,
        }
    }

    /// How logs and counters name it.
    pub fn describe(&self) -> String {
        match self {
            EndpointSpec::Listen(p) => p.display().to_string(),
            EndpointSpec::Connect(p) => format!("client of {}", p.display()),
            EndpointSpec::Fd(fd) => format!("fd {fd}"),
        }
    }
}

/// A block backend for the log.
pub fn describe_block(spec: &BlockSpec) -> String {
    match spec {
        BlockSpec::File { path, direct, discard, .. } => format!(
            "file {}{}{}",
            path.display(),
            if *direct { ", O_DIRECT" } else { "" },
            if *discard { ", discard=on" } else { "" }
        ),
        BlockSpec::Null { .. } => "null".into(),
    }
}
