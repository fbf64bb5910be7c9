//! `vhostd stats`: asks a running vhostd for its counters (the control
//! socket's JSON snapshot) twice, and shows the rates between them.

use serde_json::Value;

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
    use serde_json::json;

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
    fn table_shows_rates() {
        let t = table(&sample(1000, 1.0), &sample(2_001_000, 2.0));
        assert!(t.contains("net0 (net, /tmp/x\"y): connected"), "{t}");
        // 2 M packets in one second; 100 cycles each; 20 % of a 1 GHz TSC.
        assert!(t.contains("2.00M"), "{t}");
        assert!(t.contains(" 100 "), "{t}");
        assert!(t.contains("  20%"), "{t}");
    }
}
