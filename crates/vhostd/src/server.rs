//! The main loop: builds every device, serves each on a thread of its own
//! (one frontend at a time, surviving disconnects), and waits for signals;
//! SIGINT/SIGTERM stop everything cleanly and print the counters.

use std::io::{self, Write};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::build::{self, Hold};
use crate::endpoint::{wait_readable, wait_readable_timeout, Endpoint};
use crate::registry::{DeviceEntry, Registry};
use crate::session::Served;
use crate::signals::{SignalAsk, Signals};
use crate::spec::DeviceSpec;

/// Global options of a run.
#[derive(Default)]
pub struct Globals {
    /// Control socket for `vhostd stats`.
    pub control: Option<PathBuf>,
    /// Prometheus endpoint.
    pub metrics: Option<std::net::SocketAddr>,
    /// The system call filter.
    pub seccomp: crate::sandbox::SeccompMode,
}

/// Serves `devices` until SIGINT/SIGTERM (or, for a device on --fd, until
/// its connection closes), then stops the workers and prints the counters.
/// Every device is set up before any is served: one that cannot be set up
/// stops the start, naming it, with nothing left behind. Once running, a
/// device that fails is logged and marked; the others go on.
pub fn run(devices: Vec<DeviceSpec>, globals: Globals) -> io::Result<()> {
    let signals = Signals::new()?;
    // A frontend truncating guest memory under us costs that memory, not the process.
    crate::memory::install_sigbus_handler()?;
    let named = devices.len() > 1;
    let mut built: Vec<(Arc<DeviceEntry>, Endpoint, Hold)> = Vec::new();
    for d in &devices {
        let _span = tracing::info_span!("dev", device = %d.name).entered();
        let (served, endpoint, hold) = build::build(d).map_err(|e| {
            if named {
                io::Error::new(e.kind(), format!("device `{}`: {e}", d.name))
            } else {
                e
            }
        })?;
        let entry = DeviceEntry::new(d.name.clone(), d.device.name(), d.endpoint.describe(), served)?;
        built.push((Arc::new(entry), endpoint, hold));
    }
    let entries: Registry = Arc::new(built.iter().map(|(e, _, _)| e.clone()).collect());
    let _control = match &globals.control {
        Some(p) => Some(crate::control::serve(p, entries.clone())?),
        None => None,
    };
    if let Some(addr) = globals.metrics {
        crate::metrics::serve(addr, entries.clone())?;
    }
    let done = Arc::new(EventFd::new(EFD_NONBLOCK)?);
    let mut threads = Vec::new();
    let mut holds = Vec::new();
    for (entry, endpoint, hold) in built {
        match &endpoint {
            Endpoint::Listen(_, f) => eprintln!("vhostd: listening on {}", f.0.display()),
            Endpoint::Client(p) => eprintln!("vhostd: connecting to {}", p.display()),
            Endpoint::Conn(_) => {}
        }
        holds.push(hold);
        let done = done.clone();
        let e = entry.clone();
        let t = std::thread::Builder::new().name(format!("vhostd-{}", entry.name)).spawn(move || {
            let _span = tracing::info_span!("dev", device = %e.name).entered();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve_endpoint(&e, endpoint)));
            let failure = match r {
                Ok(Ok(())) => None,
                Ok(Err(err)) => Some(err.to_string()),
                Err(_) => Some("internal error (panic); see the log".to_string()),
            };
            if let Some(f) = failure {
                tracing::error!("device stopped serving: {f}");
                e.fail(f);
            }
            let _ = done.write(1);
        })?;
        threads.push(t);
    }
    // Set up: from here on only the system calls serving needs.
    crate::sandbox::install(globals.seccomp)?;
    crate::notify::ready(entries.len());
    let mut ended = 0u64;
    loop {
        if wait_readable(&[signals.as_raw_fd(), done.as_raw_fd()])? == 0 {
            match signals.take() {
                SignalAsk::Stop => break,
                SignalAsk::PrintStats => print_stats(&entries, false),
                SignalAsk::Nothing => {}
            }
            continue;
        }
        // Each device thread adds 1 as it ends.
        ended += done.read().unwrap_or(0);
        if ended >= threads.len() as u64 {
            break;
        }
    }
    crate::notify::stopping();
    tracing::info!("stopping");
    for e in entries.iter() {
        e.stop();
    }
    for t in threads {
        let _ = t.join();
    }
    print_stats(&entries, true);
    drop(holds);
    let failed: Vec<String> = entries.iter().filter_map(|e| e.failure().map(|f| format!("{}: {f}", e.name))).collect();
    if !failed.is_empty() && entries.len() == failed.len() {
        return Err(io::Error::other(failed.join("; ")));
    }
    Ok(())
}

/// Serves frontends one after the other (a listening socket) or the one
/// handed in (--fd) until the device is stopped.
fn serve_endpoint(e: &DeviceEntry, endpoint: Endpoint) -> io::Result<()> {
    let stop = e.stop.as_raw_fd();
    match endpoint {
        Endpoint::Conn(conn) => {
            tracing::info!("serving the frontend on {}", e.endpoint);
            serve_tracked(e, conn, stop).map(|_| ())
        }
        Endpoint::Client(path) => loop {
            let conn = match UnixStream::connect(&path) {
                Ok(c) => c,
                Err(err) => {
                    tracing::debug!("connect to {}: {err}", path.display());
                    // Retry in a second, unless stopped meanwhile.
                    if wait_readable_timeout(&[stop], 1000)? == Some(0) {
                        return Ok(());
                    }
                    continue;
                }
            };
            tracing::info!("connected to {}", path.display());
            if serve_tracked(e, conn, stop)? {
                return Ok(());
            }
        },
        Endpoint::Listen(listener, _file) => loop {
            if wait_readable(&[listener.as_raw_fd(), stop])? == 1 {
                return Ok(());
            }
            let (conn, _) = match listener.accept() {
                Ok(c) => c,
                Err(err) => {
                    tracing::warn!("accept failed: {err}");
                    continue;
                }
            };
            tracing::info!("frontend connected");
            if serve_tracked(e, conn, stop)? {
                return Ok(());
            }
        },
    }
}

/// Serves one connection with the device's bookkeeping: connected,
/// connections, and a handle on the socket for shutdown at stop.
fn serve_tracked(e: &DeviceEntry, conn: UnixStream, stop: RawFd) -> io::Result<bool> {
    e.connected(conn.try_clone().ok());
    // A stop that came before the handle was in place.
    let early = wait_readable_timeout(&[stop], 0)? == Some(0);
    let r = if early { Ok(true) } else { crate::connection::serve(conn, &e.served, stop) };
    e.disconnected();
    r
}

/// Every device's counters on stdout. `last`: stop the workers first (at
/// exit) and print their final counters.
fn print_stats(entries: &[Arc<DeviceEntry>], last: bool) {
    let devices: Vec<_> = entries
        .iter()
        .map(|e| {
            let reports =
                if last { build::shutdown(&e.served) } else { e.served.workers.iter().map(|w| w.report()).collect() };
            crate::snapshot::device(e, &reports)
        })
        .collect();
    let mut out = io::stdout().lock();
    let _ = out.write_all(crate::snapshot::key_value(&devices).as_bytes());
    let _ = out.flush();
}

/// Builds the device `spec` describes, as `run` does (for fuzz targets and
/// tests that drive a session in-process).
pub fn build(spec: &DeviceSpec) -> io::Result<(Arc<Served>, Endpoint)> {
    build::build(spec).map(|(s, e, _hold)| (s, e))
}

/// Serves one connection to its end, as a device thread does (for fuzz
/// targets: the frontend's bytes come from the other end of `conn`).
pub fn serve_connection(conn: UnixStream, served: &Arc<Served>) -> io::Result<()> {
    let never = EventFd::new(EFD_NONBLOCK)?;
    crate::connection::serve(conn, served, never.as_raw_fd()).map(|_| ())
}

/// Stops a device's workers (after `build`).
pub fn shutdown(served: &Served) {
    build::shutdown(served);
}
