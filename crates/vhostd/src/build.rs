//! Building a device from its spec: the backends, the device and its queue
//! groups, the workers that run them, and the endpoint. Nothing is left
//! behind on error (a socket file is removed, an XDP program detached).

use std::io;
use std::sync::Arc;

use vhostd_blk::BlkDevice;
use vhostd_device::{Built, QueueGroup};

use crate::endpoint::{self, Endpoint};
use crate::session::Served;
use crate::spec::{describe_block, DataplaneSpec, DeviceKind, DeviceSpec, WaitSpec};
use crate::worker::{self, Mode, RunState};

/// What a device needs kept alive beside its workers (an AF_XDP program's
/// attachment).
pub type Hold = Option<Box<dyn std::any::Any + Send>>;

/// Builds the device `spec` describes: backends first (a TAP that cannot be
/// opened leaves nothing behind), then the endpoint, then the workers.
pub fn build(spec: &DeviceSpec) -> io::Result<(Arc<Served>, Endpoint, Hold)> {
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
    };
    let endpoint = endpoint::open(&spec.endpoint)?;
    let served = spawn(&spec.name, built, dp)?;
    Ok((Arc::new(served), endpoint, hold))
}

/// How the spec's wait mode runs on a worker.
fn mode(wait: WaitSpec) -> Mode {
    match wait {
        WaitSpec::Interrupt => Mode::Interrupt,
        WaitSpec::Poll => Mode::Poll,
        WaitSpec::Adaptive { idle } => Mode::Adaptive { idle },
    }
}

/// Starts one worker per queue: group i on worker i; a device's groups
/// beyond its queues (the net control queue) go on worker 0.
fn spawn(name: &str, built: Built, dp: &DataplaneSpec) -> io::Result<Served> {
    let run = Arc::new(RunState::default());
    let workers_n = (dp.queues as usize).max(1);
    let mut per_worker: Vec<Vec<(usize, Box<dyn QueueGroup>)>> = (0..workers_n).map(|_| Vec::new()).collect();
    let mut placement = Vec::with_capacity(built.groups.len());
    for (g, group) in built.groups.into_iter().enumerate() {
        let w = if g < workers_n { g } else { 0 };
        per_worker[w].push((g, group));
        placement.push(w);
    }
    let mut workers = Vec::with_capacity(workers_n);
    for (i, groups) in per_worker.into_iter().enumerate() {
        let cpu = dp.cpus.as_ref().filter(|c| !c.is_empty()).map(|c| c[i % c.len()]);
        workers.push(worker::spawn(name, i, groups, mode(dp.wait), cpu, run.clone())?);
    }
    Ok(Served { device: built.device, workers, placement, run })
}

/// Stops a device's workers and returns their final counters.
pub fn shutdown(served: &Served) -> Vec<worker::WorkerReport> {
    served.run.stop.store(true, std::sync::atomic::Ordering::Release);
    served.workers.iter().map(|w| w.join()).collect()
}
