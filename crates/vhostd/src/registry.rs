//! The devices a daemon serves, as the main loop, the control socket and
//! the metrics endpoint see them: each device's name, endpoint, connection
//! state and the device itself.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::session::Served;

/// A device being served.
pub struct DeviceEntry {
    /// Its name (logs, stats, metrics).
    pub name: String,
    /// `net`, `blk` or `scsi`.
    pub kind: &'static str,
    /// The socket path, or `fd N`.
    pub endpoint: String,
    /// The socket path, if it has one (no two devices share one).
    pub socket_path: Option<std::path::PathBuf>,
    /// The device and its workers.
    pub served: Arc<Served>,
    /// A frontend is connected.
    pub connected: AtomicBool,
    /// Connections accepted so far.
    pub connections: AtomicU64,
    /// Why the device stopped serving, if it failed.
    pub failed: Mutex<Option<String>>,
    /// What must live as long as the device (an XDP program's attachment).
    pub hold: Mutex<crate::build::Hold>,
    /// No longer served (failed, its --fd closed, or removed).
    pub ended: AtomicBool,
    /// The protocol its frontend speaks.
    pub transport: crate::spec::Transport,
}

impl DeviceEntry {
    /// The scsi device, if this is one (its units change at runtime).
    pub fn scsi(&self) -> Option<Arc<vhostd_scsi::ScsiDevice>> {
        let hold = self.hold.lock().unwrap_or_else(|e| e.into_inner());
        hold.as_ref()?.downcast_ref::<Arc<vhostd_scsi::ScsiDevice>>().cloned()
    }

    /// An entry for a device not yet serving.
    pub fn new(
        name: String,
        kind: &'static str,
        endpoint: String,
        served: Arc<Served>,
    ) -> std::io::Result<DeviceEntry> {
        Ok(DeviceEntry {
            name,
            kind,
            endpoint,
            socket_path: None,
            served,
            connected: AtomicBool::new(false),
            connections: AtomicU64::new(0),
            failed: Mutex::new(None),
            hold: Mutex::new(None),
            ended: AtomicBool::new(false),
            transport: crate::spec::Transport::VhostUser,
        })
    }

    /// A connection is being served.
    pub fn connected(&self) {
        self.connected.store(true, Ordering::Relaxed);
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    /// The connection ended.
    pub fn disconnected(&self) {
        self.connected.store(false, Ordering::Relaxed);
    }

    /// Marks the device failed (it stopped serving).
    pub fn fail(&self, why: String) {
        if let Ok(mut f) = self.failed.lock() {
            *f = Some(why);
        }
    }

    /// Why the device failed, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().ok().and_then(|f| f.clone())
    }
}

/// Every device of the daemon, in the order they were added.
#[derive(Default)]
pub struct Devices {
    list: RwLock<Vec<Arc<DeviceEntry>>>,
}

impl Devices {
    /// The devices now.
    pub fn list(&self) -> Vec<Arc<DeviceEntry>> {
        self.list.read().map(|l| l.clone()).unwrap_or_default()
    }

    /// The device named `name`.
    pub fn find(&self, name: &str) -> Option<Arc<DeviceEntry>> {
        self.list.read().ok()?.iter().find(|e| e.name == name).cloned()
    }

    /// Adds a device (its name is checked unique by the caller).
    pub fn push(&self, e: Arc<DeviceEntry>) {
        if let Ok(mut l) = self.list.write() {
            l.push(e);
        }
    }

    /// Takes the device named `name` out of the list.
    pub fn take(&self, name: &str) -> Option<Arc<DeviceEntry>> {
        let mut l = self.list.write().ok()?;
        let i = l.iter().position(|e| e.name == name)?;
        Some(l.remove(i))
    }
}

/// The daemon's devices, as the control socket and metrics see them.
pub type Registry = Arc<crate::server::Daemon>;
