//! The main loop: builds every device, serves each on a thread of its own
//! (one frontend at a time, surviving disconnects), and waits for signals;
//! SIGINT/SIGTERM stop everything cleanly and print the counters. The
//! `Daemon` holds the devices and the shared worker pool, and adds and
//! removes devices while it runs (`vhostd ctl`, through control.rs).

use std::io::{self, Write};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::build;
use crate::endpoint::{wait_readable, Endpoint};
use crate::pool::Pool;
use crate::registry::{DeviceEntry, Devices};
use crate::session::Served;
use crate::signals::{SignalAsk, Signals};
use crate::spec::{DeviceSpec, PoolSpec};
use crate::worker::WorkerReport;

/// Global options of a run.
#[derive(Default)]
pub struct Globals {
    /// Control socket for `vhostd stats` and `vhostd ctl`.
    pub control: Option<PathBuf>,
    /// Prometheus endpoint.
    pub metrics: Option<std::net::SocketAddr>,
    /// The system call filter.
    pub seccomp: crate::sandbox::SeccompMode,
    /// The daemon-wide worker pool, if one is asked for.
    pub pool: Option<PoolSpec>,
}

/// A running daemon: its devices, its shared worker pool if it has one,
/// and how devices are added and removed while it runs (`vhostd ctl`).
pub struct Daemon {
    /// The devices.
    pub devices: Devices,
    /// The shared pool (None: each device runs on workers of its own).
    pub pool: Option<Arc<Pool>>,
    /// Written (1) whenever a device ends by itself.
    done: Arc<EventFd>,
    /// The thread serving every device's frontend.
    frontends: crate::frontends::Frontends,
    /// Adds and removes go one at a time.
    manage: Mutex<()>,
}

impl Daemon {
    /// A daemon with no devices yet.
    pub fn new(pool: Option<&PoolSpec>) -> io::Result<Daemon> {
        let pool = match pool {
            Some(p) => Some(Pool::new("pool", p.workers, build::mode(p.wait), p.cpus.as_deref(), true)?),
            None => None,
        };
        let done = Arc::new(EventFd::new(EFD_NONBLOCK)?);
        let frontends = crate::frontends::Frontends::start(done.clone())?;
        Ok(Daemon { devices: Devices::default(), pool, done, frontends, manage: Mutex::new(()) })
    }

    /// Checks `spec` against the devices already there and the pool.
    fn check(&self, spec: &DeviceSpec) -> Result<(), String> {
        if self.devices.find(&spec.name).is_some() {
            return Err(format!("--name {}: a device of that name exists", spec.name));
        }
        if let Some(p) = spec.endpoint.path() {
            if let Some(e) = self.devices.list().into_iter().find(|e| e.socket_path.as_deref() == Some(p)) {
                return Err(format!("--socket-path {}: device `{}` serves it", p.display(), e.name));
            }
        }
        if self.pool.is_some() {
            spec.dataplane.check_pooled()?;
        }
        Ok(())
    }

    /// Builds a device and lists it, not yet serving.
    fn build(&self, spec: &DeviceSpec) -> io::Result<(Arc<DeviceEntry>, Endpoint)> {
        self.check(spec).map_err(io::Error::other)?;
        let _span = tracing::info_span!("dev", device = %spec.name).entered();
        let (served, endpoint, hold) = build::build(spec, self.pool.as_ref())?;
        let mut entry =
            DeviceEntry::new(spec.name.clone(), spec.device.name(), spec.endpoint.describe(), served.clone())
                .inspect_err(|_| {
                    // Nothing half-built stays on the workers.
                    served.retire();
                })?;
        entry.socket_path = spec.endpoint.path().map(|p| p.to_path_buf());
        entry.transport = spec.transport;
        *entry.hold.get_mut().unwrap_or_else(|e| e.into_inner()) = hold;
        let entry = Arc::new(entry);
        self.devices.push(entry.clone());
        Ok((entry, endpoint))
    }

    /// Serves an entry's endpoint (on the frontends thread).
    fn start(&self, entry: &Arc<DeviceEntry>, endpoint: Endpoint) {
        match &endpoint {
            Endpoint::Listen(_, f) => eprintln!("vhostd: listening on {}", f.0.display()),
            Endpoint::Client(p) => eprintln!("vhostd: connecting to {}", p.display()),
            Endpoint::Conn(_) => {}
        }
        self.frontends.add(entry.clone(), endpoint);
    }

    /// Serves a start-up device, unless `vhostd ctl remove` took it out of
    /// the list meanwhile (then its endpoint goes, and its socket file).
    fn start_listed(&self, entry: &Arc<DeviceEntry>, endpoint: Endpoint) {
        let _one = self.manage.lock().unwrap_or_else(|e| e.into_inner());
        if self.devices.find(&entry.name).is_some_and(|e| Arc::ptr_eq(&e, entry)) {
            self.start(entry, endpoint);
        }
    }

    /// Adds a device while the daemon runs: built, listed and serving, or
    /// nothing of it left (`vhostd ctl add`).
    pub fn add(&self, spec: &DeviceSpec) -> io::Result<Arc<DeviceEntry>> {
        let _one = self.manage.lock().unwrap_or_else(|e| e.into_inner());
        let (entry, endpoint) = self.build(spec)?;
        self.start(&entry, endpoint);
        tracing::info!(device = %spec.name, "device added");
        Ok(entry)
    }

    /// Removes a device while the daemon runs: its frontend sees the
    /// socket close, its groups leave their workers, its socket file goes
    /// (`vhostd ctl remove`). Returns its final counters.
    pub fn remove(&self, name: &str) -> Result<Vec<WorkerReport>, String> {
        let _one = self.manage.lock().unwrap_or_else(|e| e.into_inner());
        if self.devices.find(name).is_none() {
            return Err(format!("NAME {name}: no such device"));
        }
        let reports = self.unlist(name);
        tracing::info!(device = %name, "device removed");
        Ok(reports)
    }

    /// Adds unit `lun` to scsi device `name` while it runs (`vhostd ctl
    /// add-lun`): its disk opened, one backend per request queue; a guest
    /// that negotiated hotplug is told. Nothing is left of a unit that
    /// cannot be opened.
    pub fn add_lun(&self, name: &str, lun: u16, backend: &vhostd_block_backends::BlockSpec) -> Result<(), String> {
        let _one = self.manage.lock().unwrap_or_else(|e| e.into_inner());
        let dev = self.scsi_device(name)?;
        if dev.lun_numbers().contains(&lun) {
            return Err(format!("LUN {lun}: device `{name}` has a unit {lun}"));
        }
        let _span = tracing::info_span!("dev", device = %name).entered();
        let unit = build::open_lun(name, lun, backend, dev.request_queues()).map_err(|e| e.to_string())?;
        dev.add_lun(unit).map_err(|e| format!("LUN {lun}: {e}"))?;
        tracing::info!(lun, "unit added");
        Ok(())
    }

    /// Removes unit `lun` of scsi device `name` (`vhostd ctl remove-lun`):
    /// new commands to it are refused at once, those in flight finish, and
    /// a guest that negotiated hotplug is told.
    pub fn remove_lun(&self, name: &str, lun: u16) -> Result<(), String> {
        let _one = self.manage.lock().unwrap_or_else(|e| e.into_inner());
        let dev = self.scsi_device(name)?;
        if !dev.remove_lun(lun) {
            return Err(format!("LUN {lun}: device `{name}` has no unit {lun}"));
        }
        tracing::info!(device = %name, lun, "unit removed");
        Ok(())
    }

    fn scsi_device(&self, name: &str) -> Result<Arc<vhostd_scsi::ScsiDevice>, String> {
        let e = self.devices.find(name).ok_or_else(|| format!("NAME {name}: no such device"))?;
        e.scsi().ok_or_else(|| format!("NAME {name}: a {} device has no units (a scsi device has)", e.kind))
    }

    /// Stops serving a device (its connection ends, its socket file goes),
    /// takes its groups off the workers and drops it.
    fn unlist(&self, name: &str) -> Vec<WorkerReport> {
        let Some(e) = self.devices.take(name) else { return Vec::new() };
        self.frontends.remove(name);
        let reports = e.served.retire();
        drop(e.hold.lock().unwrap_or_else(|e| e.into_inner()).take());
        reports
    }

    /// Every device's counters, each pool asked once (`last`: the final
    /// ones, the pools stopped).
    pub fn reports(&self, entries: &[Arc<DeviceEntry>], last: bool) -> Vec<Vec<WorkerReport>> {
        let mut pools: Vec<(Arc<Pool>, Vec<WorkerReport>)> = Vec::new();
        entries
            .iter()
            .map(|e| {
                let pool = &e.served.pool;
                let i = match pools.iter().position(|(p, _)| Arc::ptr_eq(p, pool)) {
                    Some(i) => i,
                    None => {
                        pools.push((pool.clone(), if last { pool.shutdown() } else { pool.reports() }));
                        pools.len() - 1
                    }
                };
                crate::pool::of_device(&pools[i].1, e.served.id)
            })
            .collect()
    }
}

/// Serves `devices` until SIGINT/SIGTERM (or, without a control socket,
/// until every device ended by itself: failed, or its --fd closed), then
/// stops the workers and prints the counters. Every device is set up
/// before any is served: one that cannot be set up stops the start, naming
/// it, with nothing left behind. Once running, a device that fails is
/// logged and marked; the others go on. With a control socket, devices
/// come and go at runtime (`vhostd ctl`), and the daemon may start with none.
pub fn run(devices: Vec<DeviceSpec>, globals: Globals) -> io::Result<()> {
    let signals = Signals::new()?;
    // A file truncated under a mapping (guest memory, a tmpfs image) costs
    // that mapping, not the process.
    virtq::sigbus::install_handler()?;
    let named = devices.len() > 1;
    let daemon = Arc::new(Daemon::new(globals.pool.as_ref())?);
    if let (Some(p), Some(spec)) = (&daemon.pool, &globals.pool) {
        let cpus: Vec<String> = p.cpus.iter().map(|c| c.map_or("any".into(), |c| c.to_string())).collect();
        let mode = crate::pool::mode_name(p.mode);
        tracing::info!("worker pool: {} worker(s), {mode}, CPUs {}", p.workers.len(), cpus.join(","));
        if p.workers.len() > 1 && !spec.rebalance.is_zero() {
            crate::balance::spawn(&daemon, spec.rebalance)?;
        }
    }
    let mut endpoints = Vec::new();
    for d in &devices {
        match daemon.build(d) {
            Ok(built) => endpoints.push(built),
            Err(e) => {
                drop(endpoints);
                for d in daemon.devices.list() {
                    daemon.unlist(&d.name);
                }
                if let Some(p) = &daemon.pool {
                    p.shutdown();
                }
                return Err(if named { io::Error::new(e.kind(), format!("device `{}`: {e}", d.name)) } else { e });
            }
        }
    }
    // The control socket is there before "listening on" is printed (what
    // tests and managers wait for, then ask it).
    let _control = match &globals.control {
        Some(p) => Some(crate::control::serve(p, daemon.clone())?),
        None => None,
    };
    if let Some(addr) = globals.metrics {
        crate::metrics::serve(addr, daemon.clone())?;
    }
    for (entry, endpoint) in endpoints {
        daemon.start_listed(&entry, endpoint);
    }
    let managed = globals.control.is_some();
    // Set up: from here on only the system calls serving needs (and, with
    // a control socket, those building a device needs).
    crate::sandbox::install(globals.seccomp, managed)?;
    crate::notify::ready(daemon.devices.list().len());
    loop {
        if wait_readable(&[signals.as_raw_fd(), daemon.done.as_raw_fd()])? == 0 {
            match signals.take() {
                SignalAsk::Stop => break,
                SignalAsk::PrintStats => print_stats(&daemon, false),
                SignalAsk::Nothing => {}
            }
            continue;
        }
        let _ = daemon.done.read();
        let list = daemon.devices.list();
        if !managed && list.iter().all(|e| e.ended.load(Ordering::Acquire)) {
            break;
        }
    }
    crate::notify::stopping();
    tracing::info!("stopping");
    let entries = daemon.devices.list();
    daemon.frontends.stop();
    print_stats(&daemon, true);
    if let Some(p) = &daemon.pool {
        p.shutdown();
    }
    for e in &entries {
        drop(e.hold.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
    let failed: Vec<String> = entries.iter().filter_map(|e| e.failure().map(|f| format!("{}: {f}", e.name))).collect();
    if !failed.is_empty() && entries.len() == failed.len() {
        return Err(io::Error::other(failed.join("; ")));
    }
    Ok(())
}

/// Every device's counters on stdout. `last`: stop the workers first (at
/// exit) and print their final counters.
fn print_stats(daemon: &Daemon, last: bool) {
    let entries = daemon.devices.list();
    let reports = daemon.reports(&entries, last);
    let devices: Vec<_> = entries.iter().zip(&reports).map(|(e, r)| crate::snapshot::device(e, r)).collect();
    let mut out = io::stdout().lock();
    let _ = out.write_all(crate::snapshot::key_value(&devices).as_bytes());
    let _ = out.flush();
}

/// Builds the device `spec` describes on workers of its own, as `run`
/// does without a pool (for fuzz targets and tests that drive a session
/// in-process).
pub fn build(spec: &DeviceSpec) -> io::Result<(Arc<Served>, Endpoint)> {
    build::build(spec, None).map(|(s, e, _hold)| (s, e))
}

/// Serves one connection to its end, as a device thread does (for fuzz
/// targets: the frontend's bytes come from the other end of `conn`).
pub fn serve_connection(conn: UnixStream, served: &Arc<Served>) -> io::Result<()> {
    let never = EventFd::new(EFD_NONBLOCK)?;
    crate::connection::serve(conn, served, never.as_raw_fd()).map(|_| ())
}

/// Stops a device's workers (after `build`).
pub fn shutdown(served: &Served) {
    served.retire();
}
