//! A connected but idle frontend (`vhostd-user blk --idle SECS`, what
//! bench/idle-cpu measures) against `vhostd blk` on the null backend, over
//! vhost-user and vfio-user, in each dataplane mode: the device is set up
//! and its queue runs, nothing is submitted, no interrupt comes, and the
//! frontend tears down normally. The worker's own counters say whether it
//! slept: in interrupt and adaptive modes it passes over its rings once
//! each time it is woken (a handful of times), in poll mode it spins the
//! whole time.
//!
//! Every daemon is killed on drop (failures included); every wait is
//! bounded.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// The tests here run one at a time: they measure how much a worker spins,
/// and the poll-mode ones spin a CPU each.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn vhostd_user() -> PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_vhostd")).with_file_name("vhostd-user");
    assert!(bin.exists(), "{} is not built (cargo build --workspace builds it)", bin.display());
    bin
}

fn start(mode: &str, transport: &str) -> Daemon {
    Daemon::start_with(None, |sock| {
        ["blk", "--transport", transport, "--backend", "null,size=64M", "--mode", mode, "--socket-path"]
            .iter()
            .map(|s| s.to_string())
            .chain([sock.display().to_string()])
            .collect()
    })
}

/// Runs `vhostd-user blk` with `args` on `d`: (stdout, stderr), exit 0.
fn frontend(d: &Daemon, transport: &str, args: &[&str]) -> (String, String) {
    let out = Command::new(vhostd_user())
        .args(["blk", "--socket-path", d.sock.to_str().unwrap(), "--transport", transport])
        .args(["--connect-timeout", "10", "--stall-timeout", "10"])
        .args(args)
        .output()
        .unwrap();
    let (o, e) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert_eq!(out.status.code(), Some(0), "vhostd-user {args:?}: {o}{e}");
    (o, e)
}

/// The value of `key=` in `line`.
fn field(line: &str, key: &str) -> f64 {
    let k = format!("{key}=");
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&k))
        .unwrap_or_else(|| panic!("no {key} in {line}"))
        .parse()
        .unwrap()
}

/// The worker's passes over its rings that found nothing.
fn idle_iters(s: &Stats) -> u64 {
    let w = s.workers.get(&0).unwrap_or_else(|| panic!("no worker 0 line: {s:?}"));
    w.get("idle_iters").expect("idle_iters").parse().unwrap()
}

fn idle_only(transport: &str) {
    let _one = serial();
    // Interrupt and adaptive: a few wake-ups (the set-up's commands, the
    // teardown's) of one pass each (adaptive used to spin 100 µs after
    // each: about 140 passes in all); a worker that spun while idle would
    // make hundreds of thousands of passes in 1.5 s. (Measured: 6 to 10
    // passes in both modes, 235,000 to 640,000 a second in poll mode.)
    const SLEEPING: u64 = 10_000;
    for mode in ["interrupt", "adaptive", "poll"] {
        let d = start(mode, transport);
        let (out, err) = frontend(&d, transport, &["--idle", "1.5"]);
        assert!(err.contains("vhostd-user: idle for 1.5 s"), "{err}");
        let line = out.lines().find(|l| l.starts_with("idle ")).unwrap_or_else(|| panic!("no idle line: {out}"));
        assert!(!out.contains("blk mode="), "no workload without --mode: {out}");
        assert!((1.5..3.0).contains(&field(line, "seconds")), "{line}");
        assert_eq!(field(line, "calls"), 0.0, "{mode}: no interrupt while nothing is in flight: {line}");
        let s = d.stop();
        for k in ["reads", "writes", "kicks", "bad_chains"] {
            assert_eq!(s.queue(0, k), 0, "{mode} {transport}: {k}");
        }
        let iters = idle_iters(&s);
        if mode == "poll" {
            // What the bound tells apart (a loaded machine slows the spin).
            assert!(iters > 4 * SLEEPING, "poll mode spins while idle: {iters} idle passes");
        } else {
            assert!(iters < SLEEPING, "{mode} mode over {transport} spun while idle: {iters} idle passes");
        }
    }
}

#[test]
fn an_idle_frontend_over_vhost_user_costs_a_sleeping_worker_nothing() {
    idle_only("vhost-user");
}

#[test]
fn an_idle_frontend_over_vfio_user_costs_a_sleeping_worker_nothing() {
    idle_only("vfio-user");
}

/// `--mode` with `--idle`: the workload's line, then the idle line; the
/// requests all reach vhostd, none during the idle period.
#[test]
fn idle_after_a_burst() {
    let _one = serial();
    for transport in ["vhost-user", "vfio-user"] {
        let d = start("adaptive", transport);
        let (out, err) =
            frontend(&d, transport, &["--mode", "randread", "--count", "5000", "--iodepth", "8", "--idle", "0.5"]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}{err}");
        assert!(lines[0].starts_with("blk mode=randread bs=4096 iodepth=8 queues=1 ios=5000 errors=0 "), "{out}");
        assert!(lines[1].starts_with("idle seconds=") && field(lines[1], "calls") == 0.0, "{out}");
        let s = d.stop();
        assert_eq!(s.queue(0, "reads"), 5000, "{transport}");
    }
}

/// vhostd's thread `name`'s time on a CPU so far (schedstat), in ns.
fn thread_cpu_ns(pid: i32, name: &str) -> Option<u64> {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
        if std::fs::read_to_string(t.path().join("comm")).ok()?.trim() == name {
            let s = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            return s.split_whitespace().next()?.parse().ok();
        }
    }
    None
}

/// After the last request an adaptive worker spins its idle window once,
/// then sleeps. The first request after the rings start always kicks; the
/// worker, spinning since the set-up, takes the request without reading
/// the kick, which then wakes it the moment it tries to sleep. That wake-up
/// finds no work and must not spin the window a second time (it did: 0.8 s
/// of spinning for a 0.4 s window).
#[test]
fn an_adaptive_worker_spins_its_idle_window_once() {
    let _one = serial();
    let d = Daemon::start_with(None, |sock| {
        ["blk", "--backend", "null,size=64M", "--mode", "adaptive", "--poll-idle-us", "400000", "--socket-path"]
            .iter()
            .map(|s| s.to_string())
            .chain([sock.display().to_string()])
            .collect()
    });
    let mut child = Command::new(vhostd_user())
        .args(["blk", "--socket-path", d.sock.to_str().unwrap(), "--mode", "randread", "--count", "1"])
        .args(["--iodepth", "1", "--idle", "1.6"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let err = collect_stderr(&mut child);
    // (wall-clock time, the worker's CPU time) every 10 ms.
    let mut samples = Vec::new();
    while child.try_wait().unwrap().is_none() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        samples.push((now, thread_cpu_ns(d.pid(), "vhostd-q0").unwrap_or(0)));
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let said = || err.lock().unwrap().contains(" s from ");
    assert!(wait_until(std::time::Duration::from_secs(5), said), "{}", err.lock().unwrap());
    let log = err.lock().unwrap().clone();
    let from: f64 = log.split(" s from ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap().parse().unwrap();
    // The worker's CPU time from 0.5 s to 1.5 s after the request completed.
    let at = |t: f64| samples.iter().find(|s| s.0 >= t).unwrap_or_else(|| panic!("no sample at {t}: {log}")).1;
    let spun_ms = at(from + 1.5).saturating_sub(at(from + 0.5)) / 1_000_000;
    let s = d.stop();
    assert_eq!(s.queue(0, "reads"), 1);
    assert!(spun_ms < 20, "the worker spun {spun_ms} ms between 0.5 and 1.5 s after the last request");
}

/// The idle period ends early, with an error, when vhostd goes away.
#[test]
fn idle_ends_when_vhostd_goes() {
    for transport in ["vhost-user", "vfio-user"] {
        let d = start("interrupt", transport);
        let mut child = Command::new(vhostd_user())
            .args(["blk", "--socket-path", d.sock.to_str().unwrap(), "--transport", transport, "--idle", "30"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let err = collect_stderr(&mut child);
        assert!(wait_until(std::time::Duration::from_secs(10), || err.lock().unwrap().contains("idle for 30 s")));
        let t = std::time::Instant::now();
        drop(d);
        let status = child.wait().unwrap();
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the frontend waited out its idle period");
        assert_eq!(status.code(), Some(1), "{}", err.lock().unwrap());
        let said = || err.lock().unwrap().contains("idle: the device closed the connection");
        assert!(wait_until(std::time::Duration::from_secs(5), said), "{}", err.lock().unwrap());
    }
}
