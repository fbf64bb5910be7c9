//! Live counters of every device as one JSON document (the control socket's
//! answer, and what the Prometheus exposition and `vhostd stats` are made
//! from). Counters only grow (per process); rates are the reader's job.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use serde_json::{json, Value};

use crate::server::DeviceEntry;
use crate::worker::{RingReport, WorkerReport};

/// When the process started (for `uptime_s`), and the TSC rate.
fn started() -> &'static (Instant, u64) {
    static S: OnceLock<(Instant, u64)> = OnceLock::new();
    S.get_or_init(|| (Instant::now(), tsc_hz()))
}

/// Starts the clock the snapshots count from (call early).
pub fn init() {
    started();
}

/// TSC ticks per second, measured over 20 ms (the busy-cycle counters are
/// TSC ticks; readers turn them into CPU shares with this).
fn tsc_hz() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86_64.
        let t0 = unsafe { core::arch::x86_64::_rdtsc() };
        let i0 = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        // SAFETY: as above.
        let t1 = unsafe { core::arch::x86_64::_rdtsc() };
        (t1.wrapping_sub(t0) as f64 / i0.elapsed().as_secs_f64()) as u64
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

fn bad_chains(r: &RingReport) -> Value {
    let q = &r.queue;
    json!({
        "total": q.bad_chains, "index": q.bad_index, "loop": q.bad_loop, "address": q.bad_address,
        "direction": q.bad_direction, "indirect": q.bad_indirect,
    })
}

fn net_queues(reports: &[WorkerReport]) -> Vec<Value> {
    let mut out = Vec::new();
    for r in reports {
        for (slot, dir) in [(0usize, "rx"), (1, "tx"), (2, "ctrl")] {
            let ring = &r.rings[slot];
            if slot == 2 && ring.queue.chains == 0 && ring.queue.bad_chains == 0 {
                continue;
            }
            let index = if slot == 2 { 2 * reports.len() } else { 2 * r.pair as usize + slot };
            let backend = match slot {
                0 => r.backend.rx_dropped,
                1 => r.backend.tx_dropped,
                _ => 0,
            };
            out.push(json!({
                "queue": index, "dir": dir, "worker": r.pair,
                "packets": ring.dir.packets, "bytes": ring.dir.bytes,
                "dropped": ring.dir.dropped + backend,
                "drops": {
                    "short_header": ring.dir.short_header, "too_big": ring.dir.too_big,
                    "backend": backend, "bad_chain": ring.queue.bad_chains,
                },
                "bad_chains": bad_chains(ring),
                "batches": ring.dir.batches, "kicks": ring.kicks, "notifies": ring.notifies,
                "busy_cycles": ring.busy_cycles,
            }));
        }
    }
    out
}

fn blk_queues(reports: &[WorkerReport]) -> Vec<Value> {
    reports
        .iter()
        .map(|r| {
            let ring = &r.rings[0];
            let b = &ring.blk;
            json!({
                "queue": r.pair, "worker": r.pair,
                "reads": b.reads, "writes": b.writes, "flushes": b.flushes, "discards": b.discards,
                "write_zeroes": b.write_zeroes, "get_ids": b.get_ids,
                "bytes_read": b.bytes_read, "bytes_written": b.bytes_written,
                "errors": {
                    "ioerr": b.ioerr, "unsupp": b.unsupp, "no_status": b.no_status,
                    "out_of_range": b.out_of_range, "read_only": b.read_only, "misaligned": b.misaligned,
                    "backend": b.backend_errors, "bad_chain": ring.queue.bad_chains,
                },
                "bad_chains": bad_chains(ring),
                "batches": b.batches, "max_in_flight": b.max_in_flight,
                "kicks": ring.kicks, "notifies": ring.notifies, "busy_cycles": ring.busy_cycles,
                "submit_calls": r.blk_backend.submit_calls,
            })
        })
        .collect()
}

/// The counters of every device, now.
pub fn snapshot(entries: &[Arc<DeviceEntry>]) -> Value {
    let (t0, hz) = *started();
    let devices: Vec<Value> = entries
        .iter()
        .map(|e| {
            let reports: Vec<WorkerReport> = e.dev.workers.iter().map(|w| w.report()).collect();
            let workers: Vec<Value> = reports
                .iter()
                .map(|r| json!({"worker": r.pair, "busy_iters": r.busy_iters, "idle_iters": r.idle_iters, "sleeps": r.sleeps}))
                .collect();
            let queues = if e.dev.blk.is_some() { blk_queues(&reports) } else { net_queues(&reports) };
            json!({
                "name": e.name, "type": e.kind, "endpoint": e.endpoint,
                "connected": e.connected.load(Ordering::Relaxed),
                "connections": e.connections.load(Ordering::Relaxed),
                "needs_reset": e.dev.shared.needs_reset.load(Ordering::Relaxed),
                "failed": e.failed.lock().ok().and_then(|f| f.clone()),
                "workers": workers, "queues": queues,
            })
        })
        .collect();
    json!({
        "version": 1,
        "pid": std::process::id(),
        "uptime_s": t0.elapsed().as_secs_f64(),
        "tsc_hz": hz,
        "devices": devices,
    })
}

/// Prometheus text exposition (format 0.0.4) of a snapshot.
pub fn prometheus(s: &Value) -> String {
    let mut m = Metrics::default();
    let empty = vec![];
    for d in s["devices"].as_array().unwrap_or(&empty) {
        let dev = d["name"].as_str().unwrap_or("");
        let ty = d["type"].as_str().unwrap_or("");
        m.add(
            "vhostd_device_info",
            "gauge",
            "A device vhostd serves (value 1).",
            &[("device", dev), ("type", ty), ("endpoint", d["endpoint"].as_str().unwrap_or(""))],
            1,
        );
        m.add(
            "vhostd_device_connected",
            "gauge",
            "1 while a frontend is connected.",
            &[("device", dev)],
            d["connected"].as_bool().unwrap_or(false) as u64,
        );
        m.add(
            "vhostd_device_connections_total",
            "counter",
            "Frontend connections accepted.",
            &[("device", dev)],
            d["connections"].as_u64().unwrap_or(0),
        );
        m.add(
            "vhostd_device_needs_reset",
            "gauge",
            "1 when the guest broke a ring (NEEDS_RESET).",
            &[("device", dev)],
            d["needs_reset"].as_bool().unwrap_or(false) as u64,
        );
        m.add(
            "vhostd_device_failed",
            "gauge",
            "1 when the device stopped serving after an error.",
            &[("device", dev)],
            !d["failed"].is_null() as u64,
        );
        for w in d["workers"].as_array().unwrap_or(&empty) {
            let wk = w["worker"].to_string();
            for (state, k) in [("busy", "busy_iters"), ("idle", "idle_iters")] {
                m.add(
                    "vhostd_worker_poll_iterations_total",
                    "counter",
                    "Dataplane loop passes that moved something (busy) or nothing (idle).",
                    &[("device", dev), ("worker", &wk), ("state", state)],
                    w[k].as_u64().unwrap_or(0),
                );
            }
            m.add(
                "vhostd_worker_sleeps_total",
                "counter",
                "Times a dataplane thread went to sleep waiting for a kick.",
                &[("device", dev), ("worker", &wk)],
                w["sleeps"].as_u64().unwrap_or(0),
            );
        }
        for q in d["queues"].as_array().unwrap_or(&empty) {
            let qi = q["queue"].to_string();
            let u = |k: &str| q[k].as_u64().unwrap_or(0);
            let mut l: Vec<(&str, &str)> = vec![("device", dev), ("queue", &qi)];
            let dir = q["dir"].as_str().unwrap_or("").to_string();
            if ty == "net" {
                l.push(("dir", &dir));
                m.add(
                    "vhostd_queue_packets_total",
                    "counter",
                    "Frames moved (tx: guest to backend, rx: backend to guest).",
                    &l,
                    u("packets"),
                );
                m.add(
                    "vhostd_queue_bytes_total",
                    "counter",
                    "Frame bytes moved, virtio-net headers excluded.",
                    &l,
                    u("bytes"),
                );
                for (reason, v) in q["drops"].as_object().into_iter().flatten() {
                    let mut lr = l.clone();
                    lr.push(("reason", reason));
                    m.add(
                        "vhostd_queue_dropped_total",
                        "counter",
                        "Frames dropped, by reason.",
                        &lr,
                        v.as_u64().unwrap_or(0),
                    );
                }
            } else {
                for (ty, k) in [
                    ("read", "reads"),
                    ("write", "writes"),
                    ("flush", "flushes"),
                    ("discard", "discards"),
                    ("write_zeroes", "write_zeroes"),
                    ("get_id", "get_ids"),
                ] {
                    let mut lr = l.clone();
                    lr.push(("type", ty));
                    m.add("vhostd_blk_requests_total", "counter", "virtio-blk requests, by type.", &lr, u(k));
                }
                for (d2, k) in [("read", "bytes_read"), ("write", "bytes_written")] {
                    let mut lr = l.clone();
                    lr.push(("dir", d2));
                    m.add("vhostd_blk_bytes_total", "counter", "Bytes read and written for the guest.", &lr, u(k));
                }
                for (reason, v) in q["errors"].as_object().into_iter().flatten() {
                    let mut lr = l.clone();
                    lr.push(("reason", reason));
                    m.add(
                        "vhostd_blk_errors_total",
                        "counter",
                        "Requests answered with an error (or not at all: no_status, bad_chain), by reason.",
                        &lr,
                        v.as_u64().unwrap_or(0),
                    );
                }
                m.add("vhostd_blk_max_in_flight", "gauge", "Most requests in flight at once.", &l, u("max_in_flight"));
            }
            for (reason, v) in q["bad_chains"].as_object().into_iter().flatten() {
                if reason == "total" {
                    continue;
                }
                let mut lr = l.clone();
                lr.push(("reason", reason));
                m.add(
                    "vhostd_queue_bad_chains_total",
                    "counter",
                    "Malformed descriptor chains dropped, by reason.",
                    &lr,
                    v.as_u64().unwrap_or(0),
                );
            }
            m.add(
                "vhostd_queue_batches_total",
                "counter",
                "Batches that moved at least one frame or request.",
                &l,
                u("batches"),
            );
            m.add("vhostd_queue_kicks_total", "counter", "Kicks (guest notifications) received.", &l, u("kicks"));
            m.add(
                "vhostd_queue_notifications_total",
                "counter",
                "Interrupts (call eventfd signals) sent to the guest.",
                &l,
                u("notifies"),
            );
            m.add(
                "vhostd_queue_busy_cycles_total",
                "counter",
                "TSC cycles of dataplane passes that moved something.",
                &l,
                u("busy_cycles"),
            );
        }
    }
    m.add(
        "vhostd_tsc_hz",
        "gauge",
        "TSC ticks per second (busy cycles to seconds).",
        &[],
        s["tsc_hz"].as_u64().unwrap_or(0),
    );
    m.text()
}

/// Metric families in first-seen order, each with its samples.
#[derive(Default)]
struct Metrics {
    families: Vec<(String, String, String, Vec<String>)>,
}

impl Metrics {
    fn add(&mut self, name: &str, kind: &str, help: &str, labels: &[(&str, &str)], v: u64) {
        let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        let sample = if l.is_empty() { format!("{name} {v}") } else { format!("{name}{{{}}} {v}", l.join(",")) };
        match self.families.iter_mut().find(|f| f.0 == name) {
            Some(f) => f.3.push(sample),
            None => self.families.push((name.into(), kind.into(), help.into(), vec![sample])),
        }
    }

    fn text(&self) -> String {
        let mut out = String::new();
        for (name, kind, help, samples) in &self.families {
            out += &format!("# HELP {name} {help}\n# TYPE {name} {kind}\n");
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

/// `vhostd stats`'s table: per device and queue, rates between two
/// snapshots `dt` seconds apart, and totals.
pub fn table(a: &Value, b: &Value) -> String {
    let dt = (b["uptime_s"].as_f64().unwrap_or(0.0) - a["uptime_s"].as_f64().unwrap_or(0.0)).max(1e-9);
    let hz = b["tsc_hz"].as_f64().unwrap_or(0.0);
    let empty = vec![];
    let mut out =
        format!("vhostd pid {}, up {:.0} s; rates over {:.1} s\n", b["pid"], b["uptime_s"].as_f64().unwrap_or(0.0), dt);
    for (i, d) in b["devices"].as_array().unwrap_or(&empty).iter().enumerate() {
        let da = &a["devices"][i];
        let state = if !d["failed"].is_null() {
            format!("FAILED: {}", d["failed"].as_str().unwrap_or(""))
        } else if d["needs_reset"].as_bool() == Some(true) {
            "NEEDS_RESET".into()
        } else if d["connected"].as_bool() == Some(true) {
            "connected".into()
        } else {
            "waiting for a frontend".into()
        };
        out += &format!(
            "\n{} ({}, {}): {}, {} connection(s)\n",
            d["name"].as_str().unwrap_or(""),
            d["type"].as_str().unwrap_or(""),
            d["endpoint"].as_str().unwrap_or(""),
            state,
            d["connections"]
        );
        let delta =
            |q: &Value, qa: &Value, k: &str| q[k].as_u64().unwrap_or(0).saturating_sub(qa[k].as_u64().unwrap_or(0));
        let rate = |n: u64| si(n as f64 / dt);
        let net = d["type"] == "net";
        if net {
            out += "  queue dir    pkts/s   Mbit/s  drops/s  batch  kicks/s  irqs/s cyc/pkt busy%   packets     bytes   dropped  bad\n";
        } else {
            out += "  queue  reads/s writes/s    MB/s  errs/s  batch  kicks/s  irqs/s  cyc/IO busy%     reads    writes    errors  bad\n";
        }
        for (j, q) in d["queues"].as_array().unwrap_or(&empty).iter().enumerate() {
            let qa = &da["queues"][j];
            let busy = delta(q, qa, "busy_cycles");
            let busy_pct = if hz > 0.0 { 100.0 * busy as f64 / (hz * dt) } else { 0.0 };
            let batches = delta(q, qa, "batches");
            if net {
                let p = delta(q, qa, "packets");
                let bytes = delta(q, qa, "bytes");
                out += &format!(
                    "  {:>5} {:<4} {:>8} {:>8.1} {:>8} {:>6} {:>8} {:>7} {:>7} {:>4.0}% {:>9} {:>9} {:>9} {:>4}\n",
                    q["queue"],
                    q["dir"].as_str().unwrap_or(""),
                    rate(p),
                    bytes as f64 * 8.0 / dt / 1e6,
                    rate(delta(q, qa, "dropped")),
                    if batches > 0 { format!("{:.1}", p as f64 / batches as f64) } else { "-".into() },
                    rate(delta(q, qa, "kicks")),
                    rate(delta(q, qa, "notifies")),
                    if p > 0 { format!("{:.0}", busy as f64 / p as f64) } else { "-".into() },
                    busy_pct,
                    si(q["packets"].as_f64().unwrap_or(0.0)),
                    si(q["bytes"].as_f64().unwrap_or(0.0)),
                    si(q["dropped"].as_f64().unwrap_or(0.0)),
                    q["bad_chains"]["total"],
                );
            } else {
                let (r, w) = (delta(q, qa, "reads"), delta(q, qa, "writes"));
                let bytes = delta(q, qa, "bytes_read") + delta(q, qa, "bytes_written");
                let errs = |v: &Value| -> u64 {
                    v["errors"].as_object().map_or(0, |o| o.values().filter_map(Value::as_u64).sum())
                };
                out += &format!(
                    "  {:>5} {:>8} {:>8} {:>7.1} {:>7} {:>6} {:>8} {:>7} {:>7} {:>4.0}% {:>9} {:>9} {:>9} {:>4}\n",
                    q["queue"],
                    rate(r),
                    rate(w),
                    bytes as f64 / dt / 1e6,
                    rate(errs(q).saturating_sub(errs(qa))),
                    if batches > 0 { format!("{:.1}", (r + w) as f64 / batches as f64) } else { "-".into() },
                    rate(delta(q, qa, "kicks")),
                    rate(delta(q, qa, "notifies")),
                    if r + w > 0 { format!("{:.0}", busy as f64 / (r + w) as f64) } else { "-".into() },
                    busy_pct,
                    si(q["reads"].as_f64().unwrap_or(0.0)),
                    si(q["writes"].as_f64().unwrap_or(0.0)),
                    si(errs(q) as f64),
                    q["bad_chains"]["total"],
                );
            }
        }
        for (j, w) in d["workers"].as_array().unwrap_or(&empty).iter().enumerate() {
            let wa = &da["workers"][j];
            let busy = delta(w, wa, "busy_iters");
            let idle = delta(w, wa, "idle_iters");
            out += &format!(
                "  worker {}: poll iterations {} busy / {} idle per s, {} sleeps/s\n",
                w["worker"],
                rate(busy),
                rate(idle),
                rate(delta(w, wa, "sleeps"))
            );
        }
    }
    out
}

/// 1234567 -> "1.23M".
fn si(v: f64) -> String {
    let (v, s) = if v >= 1e9 {
        (v / 1e9, "G")
    } else if v >= 1e6 {
        (v / 1e6, "M")
    } else if v >= 1e4 {
        (v / 1e3, "k")
    } else {
        return format!("{v:.0}");
    };
    format!("{v:.2}{s}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(packets: u64, uptime: f64) -> Value {
        json!({
            "version": 1, "pid": 7, "uptime_s": uptime, "tsc_hz": 1_000_000_000u64,
            "devices": [{
                "name": "net0", "type": "net", "endpoint": "/tmp/x\"y", "connected": true, "connections": 1,
                "needs_reset": false, "failed": null,
                "workers": [{"worker": 0, "busy_iters": 10, "idle_iters": 5, "sleeps": 1}],
                "queues": [{"queue": 1, "dir": "tx", "worker": 0, "packets": packets, "bytes": packets * 64,
                    "dropped": 0, "drops": {"short_header": 0, "too_big": 0, "backend": 0, "bad_chain": 0},
                    "bad_chains": {"total": 0, "index": 0, "loop": 0, "address": 0, "direction": 0, "indirect": 0},
                    "batches": packets / 32, "kicks": 3, "notifies": 4, "busy_cycles": packets * 100}],
            }],
        })
    }

    #[test]
    fn exposition_follows_the_format() {
        let t = prometheus(&sample(640, 1.0));
        assert!(t.contains("# TYPE vhostd_queue_packets_total counter\n"), "{t}");
        assert!(t.contains("vhostd_queue_packets_total{device=\"net0\",queue=\"1\",dir=\"tx\"} 640\n"), "{t}");
        assert!(t.contains("endpoint=\"/tmp/x\\\"y\""), "label values escaped: {t}");
        assert!(t.contains("vhostd_queue_dropped_total{device=\"net0\",queue=\"1\",dir=\"tx\",reason=\"too_big\"} 0\n"));
        assert!(t.contains("vhostd_worker_poll_iterations_total{device=\"net0\",worker=\"0\",state=\"idle\"} 5\n"));
        // One HELP and TYPE per family.
        assert_eq!(t.matches("# TYPE vhostd_queue_bad_chains_total").count(), 1);
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(value.parse::<u64>().is_ok(), "{line}");
            assert!(name.starts_with("vhostd_"), "{line}");
        }
    }

    #[test]
    fn table_shows_rates() {
        let t = table(&sample(1000, 1.0), &sample(2_001_000, 2.0));
        assert!(t.contains("net0 (net, /tmp/x\"y): connected"), "{t}");
        // 2 M packets in one second; 100 cycles each; 20 % of a 1 GHz TSC.
        assert!(t.contains("2.00M"), "{t}");
        assert!(t.contains(" 100 "), "{t}");
        assert!(t.contains("  20%"), "{t}");
    }
}
