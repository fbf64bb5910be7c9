//! Dataplane workers and where each device's queue groups run on them.
//!
//! A daemon started with `--workers`/`--worker-cpus` (or a `[dataplane]`
//! table) has one shared pool: every device's groups run on its workers,
//! as many groups per worker as there are devices, placed on the least
//! loaded worker and moved (`Served::move_group`) by `vhostd ctl pin` or
//! by the balancer. Without one, each device gets a private pool of one
//! worker per queue, as before pools existed (`--queues`/`--cpus` keep
//! their meaning). Both are the same code: a private pool is a pool with
//! one device.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::worker::{self, Mode, WorkerHandle, WorkerReport};

/// Device numbers, unique in the process (groups of many devices share a
/// worker and are told apart by them).
static NEXT_DEVICE: AtomicU64 = AtomicU64::new(1);

/// A set of dataplane workers.
pub struct Pool {
    /// "pool" for the daemon's shared pool; a device's name for its own.
    pub name: String,
    /// The workers, by index.
    pub workers: Vec<WorkerHandle>,
    /// How they wait.
    pub mode: Mode,
    /// The CPU each is pinned to.
    pub cpus: Vec<Option<usize>>,
    /// Shared by every device of the daemon (not a device's own).
    pub shared: bool,
    stop: Arc<AtomicBool>,
    /// Groups placed on each worker (placement tie-breaks).
    groups: Mutex<Vec<usize>>,
    /// Busy TSC cycles per second of each worker, as the balancer last
    /// measured them (placement of new groups).
    load: Mutex<Vec<u64>>,
    /// Held (write) while a group moves between workers and (read) while
    /// the workers' reports are gathered one by one: a group moving in
    /// between would be counted twice, or not at all.
    pub moving: RwLock<()>,
}

/// Where a group runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    /// The worker's index in its pool.
    pub worker: usize,
    /// Pinned there (`vhostd ctl pin`): the balancer leaves it.
    pub pinned: bool,
    /// A ring of it is stopping (waiting for its requests in flight): it
    /// does not move until that is done.
    pub stopping: bool,
}

impl Pool {
    /// Starts `n` workers waiting in `mode`; worker i is pinned to
    /// `cpus[i % len]` when CPUs are given. If one cannot start, those
    /// started are stopped again.
    pub fn new(name: &str, n: usize, mode: Mode, cpus: Option<&[usize]>, shared: bool) -> io::Result<Arc<Pool>> {
        let stop = Arc::new(AtomicBool::new(false));
        let cpus: Vec<Option<usize>> = (0..n).map(|i| cpus.filter(|c| !c.is_empty()).map(|c| c[i % c.len()])).collect();
        let mut workers = Vec::with_capacity(n);
        for (i, cpu) in cpus.iter().enumerate() {
            match worker::spawn(name, i, mode, *cpu, stop.clone()) {
                Ok(w) => workers.push(w),
                Err(e) => {
                    stop.store(true, Ordering::Release);
                    for w in &workers {
                        w.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(Arc::new(Pool {
            name: name.to_string(),
            workers,
            mode,
            cpus,
            shared,
            stop,
            groups: Mutex::new(vec![0; n]),
            load: Mutex::new(vec![0; n]),
            moving: RwLock::new(()),
        }))
    }

    /// A new device's number.
    pub fn new_device() -> u64 {
        NEXT_DEVICE.fetch_add(1, Ordering::Relaxed)
    }

    /// Where a new device's `n` groups go. Its first `queues` groups are
    /// its queues: in a device's own pool, group i on worker i (one worker
    /// per queue); in the shared pool each on the least loaded worker
    /// (measured busy cycles, within 5 % of a CPU counting as equal; then
    /// the fewest of this device's groups, so its queues spread; then the
    /// fewest groups). Groups past them (the net control queue, which
    /// carries a few commands at start-up) go where group 0 goes.
    pub fn place_new(&self, n: usize, queues: usize) -> Vec<Place> {
        let workers = self.workers.len().max(1);
        let mut counts = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        let load = self.load.lock().map(|l| l.clone()).unwrap_or_default();
        let slack = crate::snapshot::tsc_hz() / 20;
        let mut out = Vec::with_capacity(n);
        let mut mine = vec![0usize; workers];
        for g in 0..n {
            let w = if g >= queues && g > 0 {
                out.first().map(|p: &Place| p.worker).unwrap_or(0)
            } else if !self.shared {
                g % workers
            } else {
                let least = load.iter().copied().min().unwrap_or(0);
                (0..workers)
                    .filter(|&w| load.get(w).copied().unwrap_or(0) <= least.saturating_add(slack))
                    .min_by_key(|&w| (mine[w], counts.get(w).copied().unwrap_or(0), w))
                    .unwrap_or(0)
            };
            if let Some(c) = counts.get_mut(w) {
                *c += 1;
            }
            if g < queues {
                mine[w] += 1;
            }
            out.push(Place { worker: w, pinned: false, stopping: false });
        }
        out
    }

    /// A group moved from worker `from` to `to`, or left (`to` None).
    pub fn moved(&self, from: usize, to: Option<usize>) {
        let mut counts = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = counts.get_mut(from) {
            *c = c.saturating_sub(1);
        }
        if let Some(c) = to.and_then(|t| counts.get_mut(t)) {
            *c += 1;
        }
    }

    /// Records each worker's measured busy cycles per second.
    pub fn set_load(&self, load: Vec<u64>) {
        if let Ok(mut l) = self.load.lock() {
            *l = load;
        }
    }

    /// Every worker's counters (all its devices' groups).
    pub fn reports(&self) -> Vec<WorkerReport> {
        let _still = self.moving.read().unwrap_or_else(|e| e.into_inner());
        self.workers.iter().map(|w| w.report()).collect()
    }

    /// Stops the workers and returns their final counters (empty reports
    /// from a second call).
    pub fn shutdown(&self) -> Vec<WorkerReport> {
        self.stop.store(true, Ordering::Release);
        self.workers.iter().map(|w| w.join()).collect()
    }
}

/// A mode as `vhostd ctl list` and the log name it.
pub fn mode_name(mode: Mode) -> String {
    match mode {
        Mode::Poll => "poll".into(),
        Mode::Interrupt => "interrupt".into(),
        Mode::Adaptive { idle } => format!("adaptive ({} us)", idle.as_micros()),
    }
}

/// The part of `reports` about device `device`: each worker running one of
/// its groups, with only those groups.
pub fn of_device(reports: &[WorkerReport], device: u64) -> Vec<WorkerReport> {
    reports
        .iter()
        .filter_map(|r| {
            let groups: Vec<_> = r.groups.iter().filter(|g| g.device == device).cloned().collect();
            (!groups.is_empty()).then(|| WorkerReport { groups, ..r.clone() })
        })
        .collect()
}
