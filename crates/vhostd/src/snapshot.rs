//! The counters of every device as one type, [`Snapshot`], and its three
//! renderings: JSON (serde: the control socket's answer, what `vhostd
//! stats` reads), key=value lines (what vhostd prints at exit and on
//! SIGUSR1, which tests and benchmarks parse), and the Prometheus text
//! exposition. Devices describe their own counters (with the metric each
//! belongs to, see `vhostd_device::Counter`), so a new device needs no
//! change here. Counters only grow (per process); rates are the reader's job.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::Instant;

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use vhostd_device::{Counter, Metric, RingPlace, RingTotals};
use virtq::QueueStats;

use crate::registry::DeviceEntry;
use crate::worker::WorkerReport;

/// Every device's counters at one moment.
#[derive(Serialize)]
pub struct Snapshot {
    /// Schema version.
    pub version: u32,
    /// The daemon's process id.
    pub pid: u32,
    /// Seconds since the daemon started counting.
    pub uptime_s: f64,
    /// TSC ticks per second (busy cycles to seconds).
    pub tsc_hz: u64,
    /// The devices, in configuration order.
    pub devices: Vec<DeviceSnapshot>,
}

/// One device's counters.
#[derive(Serialize)]
pub struct DeviceSnapshot {
    /// Its name.
    pub name: String,
    /// `net`, `blk`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Where it meets its frontend.
    pub endpoint: String,
    /// A frontend is connected.
    pub connected: bool,
    /// Connections accepted.
    pub connections: u64,
    /// A ring broke: the device asks for a reset.
    pub needs_reset: bool,
    /// Why it stopped serving, if it failed.
    pub failed: Option<String>,
    /// Its workers.
    pub workers: Vec<WorkerSnapshot>,
    /// Its rings, by virtqueue index.
    pub queues: Vec<QueueSnapshot>,
    /// The device's summary line (key=value rendering only).
    #[serde(skip)]
    pub totals: Vec<(&'static str, String)>,
}

/// One worker's loop counters.
#[derive(Serialize)]
pub struct WorkerSnapshot {
    /// Its index.
    pub worker: usize,
    /// Passes that moved something.
    pub busy_iters: u64,
    /// Passes that moved nothing.
    pub idle_iters: u64,
    /// Times it slept.
    pub sleeps: u64,
}

/// One ring's counters: the device's own, then what every ring has.
pub struct QueueSnapshot {
    /// Virtqueue index.
    pub queue: u16,
    /// Role among the device's rings ("rx", "tx", "ctrl").
    pub dir: Option<&'static str>,
    /// The worker it runs on.
    pub worker: usize,
    /// The device's counters of it.
    pub counters: Vec<Counter>,
    /// Chain counters.
    pub chains: QueueStats,
    /// Kicks received.
    pub kicks: u64,
    /// Interrupts sent.
    pub notifies: u64,
    /// TSC cycles of passes that did work on it.
    pub busy_cycles: u64,
}

/// Rejected chains by reason, as they are exported.
fn bad_chains(q: &QueueStats) -> [(&'static str, u64); 5] {
    [
        ("index", q.bad_index),
        ("loop", q.bad_loop),
        ("address", q.bad_address),
        ("direction", q.bad_direction),
        ("indirect", q.bad_indirect),
    ]
}

/// A map of counters whose dotted keys nest ("drops.too_big" is `too_big`
/// in `drops`), in first-seen order.
struct Nested<'a>(&'a [Counter]);

impl Serialize for Nested<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        let mut seen: Vec<&str> = Vec::new();
        for c in self.0 {
            match c.key.split_once('.') {
                None => map.serialize_entry(c.key, &c.value)?,
                Some((outer, _)) if !seen.contains(&outer) => {
                    seen.push(outer);
                    let inner: Vec<Counter> = self
                        .0
                        .iter()
                        .filter_map(|d| {
                            let (o, rest) = d.key.split_once('.')?;
                            (o == outer).then_some(Counter { key: rest, ..*d })
                        })
                        .collect();
                    map.serialize_entry(outer, &Nested(&inner))?;
                }
                Some(_) => {}
            }
        }
        map.end()
    }
}

impl Serialize for QueueSnapshot {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("queue", &self.queue)?;
        if let Some(d) = self.dir {
            map.serialize_entry("dir", d)?;
        }
        map.serialize_entry("worker", &self.worker)?;
        let nested = serde_json::to_value(Nested(&self.counters)).map_err(serde::ser::Error::custom)?;
        for (k, v) in nested.as_object().into_iter().flatten() {
            map.serialize_entry(k, v)?;
        }
        let mut bad: serde_json::Map<String, serde_json::Value> = serde_json::Map::new();
        bad.insert("total".into(), self.chains.bad_chains.into());
        for (k, v) in bad_chains(&self.chains) {
            bad.insert(k.into(), v.into());
        }
        map.serialize_entry("bad_chains", &bad)?;
        map.serialize_entry("kicks", &self.kicks)?;
        map.serialize_entry("notifies", &self.notifies)?;
        map.serialize_entry("busy_cycles", &self.busy_cycles)?;
        map.serialize_entry("fast_chains", &self.chains.fast_chains)?;
        map.serialize_entry("batch4", &self.chains.batch4)?;
        map.serialize_entry("used_skipped", &self.chains.used_skipped)?;
        map.end()
    }
}

/// When the process started counting (for `uptime_s`), and the TSC rate.
fn started() -> &'static (Instant, u64) {
    static S: OnceLock<(Instant, u64)> = OnceLock::new();
    S.get_or_init(|| (Instant::now(), measure_tsc_hz()))
}

/// Starts the clock the snapshots count from (call early).
pub fn init() {
    started();
}

/// TSC ticks per second (measured once per process, over 20 ms); 0 where
/// there is no TSC.
pub fn tsc_hz() -> u64 {
    started().1
}

/// TSC ticks per second, measured over 20 ms (the busy-cycle counters are
/// TSC ticks; readers turn them into CPU shares with this).
fn measure_tsc_hz() -> u64 {
    let (t0, i0) = (vhostd_device::tsc(), Instant::now());
    std::thread::sleep(std::time::Duration::from_millis(20));
    (vhostd_device::tsc().wrapping_sub(t0) as f64 / i0.elapsed().as_secs_f64()) as u64
}

/// One device's counters from its workers' reports.
pub fn device(e: &DeviceEntry, reports: &[WorkerReport]) -> DeviceSnapshot {
    let dev = &e.served.device;
    let mut queues = Vec::new();
    let mut totals_in: Vec<(RingPlace, Vec<Counter>, u64, u64)> = Vec::new();
    for r in reports {
        for g in &r.groups {
            for (slot, ring) in g.rings.iter().enumerate() {
                let place = RingPlace { group: g.group, slot };
                let mut counters = g.counters.rings.get(slot).cloned().unwrap_or_default();
                if slot == 0 {
                    counters.extend(g.counters.group.iter().copied());
                }
                totals_in.push((place, counters.clone(), ring.queue.bad_chains, ring.ring.busy_cycles));
                if !dev.ring_shown(place, &ring.queue) {
                    continue;
                }
                let (queue, dir) = dev.ring_label(place);
                queues.push(QueueSnapshot {
                    queue,
                    dir,
                    worker: r.worker,
                    counters,
                    chains: ring.queue,
                    kicks: ring.ring.kicks,
                    notifies: ring.ring.notifies,
                    busy_cycles: ring.ring.busy_cycles,
                });
            }
        }
    }
    queues.sort_by_key(|q| q.queue);
    let rings: Vec<RingTotals<'_>> = totals_in
        .iter()
        .map(|(place, counters, bad, busy)| RingTotals {
            place: *place,
            counters,
            bad_chains: *bad,
            busy_cycles: *busy,
        })
        .collect();
    DeviceSnapshot {
        name: e.name.clone(),
        kind: e.kind,
        endpoint: e.endpoint.clone(),
        connected: e.connected.load(Ordering::Relaxed),
        connections: e.connections.load(Ordering::Relaxed),
        needs_reset: e.served.run.needs_reset.load(Ordering::Relaxed),
        failed: e.failure(),
        workers: reports
            .iter()
            .map(|r| WorkerSnapshot {
                worker: r.worker,
                busy_iters: r.busy_iters,
                idle_iters: r.idle_iters,
                sleeps: r.sleeps,
            })
            .collect(),
        totals: dev.totals(&rings),
        queues,
    }
}

/// The counters of every device of `daemon`, now.
pub fn snapshot(daemon: &crate::server::Daemon) -> Snapshot {
    let entries = daemon.devices.list();
    let reports = daemon.reports(&entries, false);
    let devices = entries.iter().zip(&reports).map(|(e, r)| device(e, r)).collect();
    let (t0, hz) = *started();
    Snapshot { version: 1, pid: std::process::id(), uptime_s: t0.elapsed().as_secs_f64(), tsc_hz: hz, devices }
}

/// The key=value lines of the devices: per worker, per ring and a total
/// (with several devices each block starts with a `device` line).
pub fn key_value(devices: &[DeviceSnapshot]) -> String {
    let mut out = String::new();
    for d in devices {
        if devices.len() > 1 {
            let _ = writeln!(out, "device name={} type={} endpoint={}", d.name, d.kind, d.endpoint);
        }
        for w in &d.workers {
            let _ = writeln!(
                out,
                "stats worker={} busy_iters={} idle_iters={} sleeps={}",
                w.worker, w.busy_iters, w.idle_iters, w.sleeps
            );
        }
        for q in &d.queues {
            let _ = write!(out, "stats queue={}", q.queue);
            if let Some(dir) = q.dir {
                let _ = write!(out, " dir={dir}");
            }
            for c in q.counters.iter().filter(|c| !c.key.contains('.')) {
                let _ = write!(out, " {}={}", c.key, c.value);
            }
            let _ = writeln!(
                out,
                " bad_chains={} kicks={} notifies={} busy_cycles={} fast_chains={} batch4={} used_skipped={}",
                q.chains.bad_chains,
                q.kicks,
                q.notifies,
                q.busy_cycles,
                q.chains.fast_chains,
                q.chains.batch4,
                q.chains.used_skipped
            );
        }
        out.push_str("stats total");
        for (k, v) in &d.totals {
            let _ = write!(out, " {k}={v}");
        }
        out.push('\n');
    }
    out
}

/// The Prometheus text exposition (format 0.0.4) of a snapshot.
pub fn prometheus(s: &Snapshot) -> String {
    let mut m = Families::default();
    for d in &s.devices {
        let dev = d.name.as_str();
        m.add(
            Metric::gauge("vhostd_device_info", "A device vhostd serves (value 1)."),
            &[("device", dev), ("type", d.kind), ("endpoint", &d.endpoint)],
            1,
        );
        let per_device = |m: &mut Families, metric: Metric, v: u64| m.add(metric, &[("device", dev)], v);
        per_device(
            &mut m,
            Metric::gauge("vhostd_device_connected", "1 while a frontend is connected."),
            d.connected as u64,
        );
        per_device(
            &mut m,
            Metric::counter("vhostd_device_connections_total", "Frontend connections accepted."),
            d.connections,
        );
        per_device(
            &mut m,
            Metric::gauge("vhostd_device_needs_reset", "1 when the guest broke a ring (NEEDS_RESET)."),
            d.needs_reset as u64,
        );
        per_device(
            &mut m,
            Metric::gauge("vhostd_device_failed", "1 when the device stopped serving after an error."),
            d.failed.is_some() as u64,
        );
        for w in &d.workers {
            let wk = w.worker.to_string();
            let iters = Metric::counter(
                "vhostd_worker_poll_iterations_total",
                "Dataplane loop passes that moved something (busy) or nothing (idle).",
            );
            m.add(iters.with("state", "busy"), &[("device", dev), ("worker", &wk)], w.busy_iters);
            m.add(iters.with("state", "idle"), &[("device", dev), ("worker", &wk)], w.idle_iters);
            m.add(
                Metric::counter(
                    "vhostd_worker_sleeps_total",
                    "Times a dataplane thread went to sleep waiting for a kick.",
                ),
                &[("device", dev), ("worker", &wk)],
                w.sleeps,
            );
        }
        for q in &d.queues {
            let qi = q.queue.to_string();
            let mut l: Vec<(&str, &str)> = vec![("device", dev), ("queue", &qi)];
            if let Some(dir) = q.dir {
                l.push(("dir", dir));
            }
            for c in &q.counters {
                if let Some(metric) = c.metric {
                    m.add(metric, &l, c.value);
                }
            }
            let bad =
                Metric::counter("vhostd_queue_bad_chains_total", "Malformed descriptor chains dropped, by reason.");
            for (reason, v) in bad_chains(&q.chains) {
                m.add(bad.with("reason", reason), &l, v);
            }
            m.add(Metric::counter("vhostd_queue_kicks_total", "Kicks (guest notifications) received."), &l, q.kicks);
            m.add(
                Metric::counter(
                    "vhostd_queue_notifications_total",
                    "Interrupts (call eventfd signals) sent to the guest.",
                ),
                &l,
                q.notifies,
            );
            m.add(
                Metric::counter(
                    "vhostd_queue_busy_cycles_total",
                    "TSC cycles of dataplane passes that moved something.",
                ),
                &l,
                q.busy_cycles,
            );
        }
    }
    m.add(Metric::gauge("vhostd_tsc_hz", "TSC ticks per second (busy cycles to seconds)."), &[], s.tsc_hz);
    m.text()
}

/// Metric families in first-seen order, each with its samples.
#[derive(Default)]
struct Families {
    families: Vec<(&'static str, &'static str, &'static str, Vec<String>)>,
}

impl Families {
    fn add(&mut self, metric: Metric, labels: &[(&str, &str)], v: u64) {
        let mut l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        if let Some((k, v)) = metric.label {
            l.push(format!("{k}=\"{}\"", escape(v)));
        }
        let name = metric.name;
        let sample = if l.is_empty() { format!("{name} {v}") } else { format!("{name}{{{}}} {v}", l.join(",")) };
        match self.families.iter_mut().find(|f| f.0 == name) {
            Some(f) => f.3.push(sample),
            None => {
                let kind = if metric.gauge { "gauge" } else { "counter" };
                self.families.push((name, kind, metric.help, vec![sample]))
            }
        }
    }

    fn text(&self) -> String {
        let mut out = String::new();
        for (name, kind, help, samples) in &self.families {
            let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n");
            for s in samples {
                out += s;
                out.push('\n');
            }
        }
        out
    }
}

/// A label value as the exposition format quotes it.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const PACKETS: Metric = Metric::counter("vhostd_queue_packets_total", "Frames moved.");
    const DROPPED: Metric = Metric::counter("vhostd_queue_dropped_total", "Frames dropped, by reason.");

    fn sample() -> Snapshot {
        let counters = vec![
            Counter::new("packets", 640, PACKETS),
            Counter::plain("dropped", 3),
            Counter::new("drops.too_big", 2, DROPPED.with("reason", "too_big")),
            Counter::new("drops.backend", 1, DROPPED.with("reason", "backend")),
        ];
        let chains = QueueStats { bad_chains: 4, bad_loop: 4, fast_chains: 600, ..Default::default() };
        Snapshot {
            version: 1,
            pid: 7,
            uptime_s: 1.0,
            tsc_hz: 1_000_000_000,
            devices: vec![DeviceSnapshot {
                name: "net0".into(),
                kind: "net",
                endpoint: "/tmp/x\"y".into(),
                connected: true,
                connections: 1,
                needs_reset: false,
                failed: None,
                workers: vec![WorkerSnapshot { worker: 0, busy_iters: 10, idle_iters: 5, sleeps: 1 }],
                queues: vec![QueueSnapshot {
                    queue: 1,
                    dir: Some("tx"),
                    worker: 0,
                    counters,
                    chains,
                    kicks: 3,
                    notifies: 4,
                    busy_cycles: 64000,
                }],
                totals: vec![("guest_tx_packets", "640".into()), ("cycles_per_packet", "100.0".into())],
            }],
        }
    }

    #[test]
    fn json_nests_dotted_keys_and_keeps_the_schema() {
        let v = serde_json::to_value(sample()).unwrap();
        let q = &v["devices"][0]["queues"][0];
        assert_eq!(v["devices"][0]["type"], "net");
        assert_eq!((q["queue"].as_u64(), q["dir"].as_str(), q["packets"].as_u64()), (Some(1), Some("tx"), Some(640)));
        assert_eq!(q["drops"]["too_big"], 2);
        assert_eq!(q["drops"]["backend"], 1);
        assert_eq!(q["bad_chains"]["total"], 4);
        assert_eq!(q["bad_chains"]["loop"], 4);
        assert_eq!(q["busy_cycles"], 64000);
        assert!(v["devices"][0].get("totals").is_none(), "totals are for the key=value lines");
    }

    #[test]
    fn key_value_lines_carry_plain_keys_only() {
        let s = sample();
        let kv = key_value(&s.devices);
        assert!(kv.contains("stats worker=0 busy_iters=10 idle_iters=5 sleeps=1\n"), "{kv}");
        assert!(kv.contains("stats queue=1 dir=tx packets=640 dropped=3 bad_chains=4 kicks=3"), "{kv}");
        assert!(!kv.contains("too_big"), "nested counters are not on the line: {kv}");
        assert!(kv.ends_with("stats total guest_tx_packets=640 cycles_per_packet=100.0\n"), "{kv}");
    }

    #[test]
    fn exposition_follows_the_format() {
        let t = prometheus(&sample());
        assert!(t.contains("# TYPE vhostd_queue_packets_total counter\n"), "{t}");
        assert!(t.contains("vhostd_queue_packets_total{device=\"net0\",queue=\"1\",dir=\"tx\"} 640\n"), "{t}");
        assert!(t.contains("endpoint=\"/tmp/x\\\"y\""), "label values escaped: {t}");
        assert!(t.contains("vhostd_queue_dropped_total{device=\"net0\",queue=\"1\",dir=\"tx\",reason=\"too_big\"} 2\n"));
        assert!(t.contains("vhostd_queue_bad_chains_total{device=\"net0\",queue=\"1\",dir=\"tx\",reason=\"loop\"} 4\n"));
        assert!(t.contains("vhostd_worker_poll_iterations_total{device=\"net0\",worker=\"0\",state=\"idle\"} 5\n"));
        assert!(!t.contains("dropped{"), "a counter without a metric is not exported");
        // One HELP and TYPE per family.
        assert_eq!(t.matches("# TYPE vhostd_queue_dropped_total").count(), 1);
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(value.parse::<u64>().is_ok(), "{line}");
            assert!(name.starts_with("vhostd_"), "{line}");
        }
    }
}
