//! Building a device from its spec: the backends, the device and its queue
//! groups, the workers that run them, and the endpoint. Nothing is left
//! behind on error (a socket file is removed, an XDP program detached).

use std::io;
use std::sync::Arc;

use vhostd_blk::BlkDevice;
use vhostd_block_backends::BlockSpec;
use vhostd_device::Built;

use crate::endpoint::{self, Endpoint};
use crate::pool::Pool;
use crate::session::Served;
use crate::spec::{describe_block, DataplaneSpec, DeviceKind, DeviceSpec, WaitSpec};
use crate::worker::Mode;

/// What a device needs kept alive beside its workers (an AF_XDP program's
/// attachment), or a handle on it (a scsi device's units).
pub type Hold = Option<Box<dyn std::any::Any + Send>>;

/// Builds the device `spec` describes: backends first (a TAP that cannot be
/// opened leaves nothing behind), then the endpoint, then its groups on
/// `pool` (the daemon's shared pool) or on workers of its own.
pub fn build(spec: &DeviceSpec, pool: Option<&Arc<Pool>>) -> io::Result<(Arc<Served>, Endpoint, Hold)> {
    let dp = &spec.dataplane;
    let (built, hold) = match &spec.device {
        DeviceKind::Net { backend, mac } => {
            let backends = vhostd_backends::build(backend, *mac, dp.queues as usize)?;
            if let Some(t) = &backends.tap {
                tracing::info!(
                    "TAP {}: {} queue(s), vnet header {}, offloads {}",
                    t.name(),
                    dp.queues,
                    if t.has_vnet_hdr() { "on" } else { "off" },
                    t.caps()
                );
            }
            let mut backends = backends;
            if let Some(x) = &backends.af_xdp {
                tracing::info!("{x}, {} queue pair(s)", dp.queues);
            }
            // The XDP program stays attached while this lives.
            let hold: Hold = backends.af_xdp.take().map(|x| Box::new(x) as Box<dyn std::any::Any + Send>);
            (vhostd_net::build(backends, *mac, dp.queue_size), hold)
        }
        DeviceKind::Blk { backend, serial, option } => {
            let (disk, backends) = vhostd_block_backends::open(backend, dp.queues as usize, vhostd_blk::device::DEPTH)
                .map_err(|e| io::Error::new(e.kind(), format!("{option} {}: {e}", describe_block(backend))))?;
            tracing::info!(
                "blk: {}, {} bytes ({} sectors), block size {}, {}{}{}, {} queue(s)",
                describe_block(backend),
                disk.capacity,
                disk.capacity / 512,
                disk.block_size,
                if disk.read_only { "read-only" } else { "read-write" },
                if disk.discard { ", discard" } else { "" },
                if disk.write_zeroes && !disk.read_only { ", write-zeroes" } else { "" },
                dp.queues
            );
            let mut dev = BlkDevice::new(disk, dp.queues, serial);
            dev.max_queue_size = dp.queue_size;
            (vhostd_blk::build(dev, backends, vhostd_blk::device::DEPTH), None)
        }
        DeviceKind::Scsi { luns } => {
            let dev = vhostd_scsi::ScsiDevice::new(&spec.name, dp.queues, dp.queue_size);
            let (dev, built) = vhostd_scsi::build(dev)?;
            for (n, backend) in luns {
                let lun = open_lun(&spec.name, *n, backend, dp.queues)?;
                dev.add_lun(lun).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("--lun {n}: {e}")))?;
            }
            // The hold is the device itself: `ctl add-lun` reaches it there.
            (built, Some(Box::new(dev) as Box<dyn std::any::Any + Send>))
        }
    };
    let endpoint = endpoint::open(&spec.endpoint)?;
    let pool = match pool {
        Some(p) => p.clone(),
        None => own_pool(&spec.name, dp)?,
    };
    let Built { device, groups } = built;
    let served = Served::new(&spec.name, device, groups, dp.queues as usize, pool);
    Ok((Arc::new(served), endpoint, hold))
}

/// Opens unit `n`'s disk with one backend per request queue.
pub fn open_lun(device: &str, n: u16, backend: &BlockSpec, queues: u16) -> io::Result<vhostd_scsi::Lun> {
    let (disk, backends) = vhostd_block_backends::open(backend, queues as usize, vhostd_scsi::device::DEPTH)
        .map_err(|e| io::Error::new(e.kind(), format!("--lun {n}={}: {e}", describe_block(backend))))?;
    tracing::info!(
        "scsi {device} LUN {n}: {}, {} bytes, block size {}, {}{}",
        describe_block(backend),
        disk.capacity,
        disk.block_size.max(512),
        if disk.read_only { "read-only" } else { "read-write" },
        if disk.discard && !disk.read_only { ", unmap" } else { "" },
    );
    Ok(vhostd_scsi::Lun::new(device, n, disk, backends))
}

/// How the spec's wait mode runs on a worker.
pub fn mode(wait: WaitSpec) -> Mode {
    match wait {
        WaitSpec::Interrupt => Mode::Interrupt,
        WaitSpec::Poll => Mode::Poll,
        WaitSpec::Adaptive { idle } => Mode::Adaptive { idle },
    }
}

/// A device's own workers: one per queue, pinned round robin to its CPUs
/// (group i runs on worker i; see `Pool::place_new`).
fn own_pool(name: &str, dp: &DataplaneSpec) -> io::Result<Arc<Pool>> {
    Pool::new(name, (dp.queues as usize).max(1), mode(dp.wait), dp.cpus.as_deref(), false)
}
