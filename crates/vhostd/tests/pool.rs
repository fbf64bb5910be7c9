//! One daemon as a host runs it: a shared pool of dataplane workers,
//! devices added, removed and pinned at runtime with `vhostd ctl`, while
//! others carry traffic and lose nothing; the balancer moving a queue off a
//! loaded worker.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{frame, tempdir, wait_until, HangingDisk};
use serde_json::Value;
use vhostd_user::blk::workload::{self, Mode, Workload};
use vhostd_user::{Options, VirtioUser};

const VHOSTD: &str = env!("CARGO_BIN_EXE_vhostd");
const T: Duration = Duration::from_secs(10);

/// The tests here run one at a time: the balancer's needs real load on
/// the workers, and the idle one measures CPU time; on two CPUs, tests
/// running beside them would starve or disturb them.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A pool daemon in a directory of its own; killed and removed on drop.
struct PoolDaemon {
    child: Option<Child>,
    err: Arc<Mutex<String>>,
    dir: PathBuf,
}

impl PoolDaemon {
    /// `vhostd --control DIR/ctl --seccomp trap ARGS` with no devices; waits
    /// (bounded) for the control socket. `trap`: a system call adding a
    /// device needs that the filter refuses ends the test with its number.
    fn start(args: &[&str]) -> PoolDaemon {
        let dir = tempdir();
        let ctl = dir.join("ctl");
        let mut child = Command::new(VHOSTD)
            .args(["--control", ctl.to_str().unwrap(), "--seccomp", "trap"])
            // The balancer's samples, for a failure's message.
            .env("VHOSTD_LOG", "info,vhostd::balance=debug")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn vhostd");
        let err = common::collect_stderr(&mut child);
        let d = PoolDaemon { child: Some(child), err, dir };
        assert!(wait_until(T, || ctl.exists()), "no control socket; stderr:\n{}", d.stderr());
        d
    }

    fn stderr(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// `vhostd ctl ARGS`: exit status, stdout, stderr.
    fn ctl(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(VHOSTD)
            .args(["ctl", "--control", self.path("ctl").to_str().unwrap()])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `vhostd ctl ARGS`, which must succeed.
    fn ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.ctl(args);
        assert_eq!(code, 0, "vhostd ctl {args:?}: {err}\ndaemon:\n{}", self.stderr());
        out
    }

    /// `vhostd ctl ARGS`, which must fail: its message.
    fn refused(&self, args: &[&str]) -> String {
        let (code, out, err) = self.ctl(args);
        assert_ne!(code, 0, "vhostd ctl {args:?} succeeded: {out}");
        assert!(self.alive(), "vhostd died; stderr:\n{}", self.stderr());
        err
    }

    /// Adds a net device NAME on DIR/NAME.sock.
    fn add_net(&self, name: &str, extra: &[&str]) -> PathBuf {
        let sock = self.path(&format!("{name}.sock"));
        let mut args = vec!["add", "net", "--name", name, "--socket-path", sock.to_str().unwrap()];
        args.extend(extra);
        self.ok(&args);
        sock
    }

    /// `vhostd ctl --json list`.
    fn list(&self) -> Value {
        serde_json::from_str(&self.ok(&["--json", "list"])).unwrap()
    }

    /// The worker each queue of device `name` runs on.
    fn workers_of(&self, name: &str) -> Vec<u64> {
        let l = self.list();
        let d = l["devices"].as_array().unwrap().iter().find(|d| d["name"] == name).unwrap().clone();
        d["queues"].as_array().unwrap().iter().map(|q| q["worker"].as_u64().unwrap()).collect()
    }

    /// Still running (not exited, not a zombie).
    fn alive(&self) -> bool {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        stat.rsplit(')').next().and_then(|s| s.split_whitespace().next()).is_some_and(|st| st != "Z")
    }

    /// The names of the daemon's threads.
    fn threads(&self) -> Vec<String> {
        let dir = format!("/proc/{}/task", self.pid());
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|s| s.trim().to_string())
            .collect()
    }
}

impl Drop for PoolDaemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Loops `total` frames through a loopback device on `sock`, each back
/// exactly once and in order; stops early (returning what came back) once
/// `stop` is set.
fn loop_frames(sock: &Path, total: u32, stop: &AtomicBool) -> u32 {
    let mut dev = VirtioUser::connect(Options::new(sock)).expect("connect");
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    let (mut sent, mut got) = (0u32, 0u32);
    let ok = wait_until(Duration::from_secs(60), || {
        tx.reclaim().unwrap();
        let mut n = 0;
        // At most a ring's worth in flight: loopback drops what finds no RX buffer.
        while sent < total && sent - got < 128 && tx.send_frame(&frame(sent, 64)).unwrap() {
            sent += 1;
            n += 1;
        }
        if n > 0 {
            tx.flush().unwrap();
        }
        rx.recv_burst(64, |f| {
            assert_eq!(f.len(), 64, "frame {got} length");
            assert_eq!(f, frame(got, 64).as_slice(), "frame {got} out of order or changed");
            got += 1;
        })
        .unwrap();
        got == total || stop.load(Ordering::Relaxed)
    });
    assert!(ok, "{got} of {total} frames came back");
    got
}

#[test]
fn devices_come_and_go_at_runtime_while_others_carry_traffic() {
    let _one = serial();
    let d = PoolDaemon::start(&["--workers", "2", "--rebalance-interval", "0"]);
    // The pool's threads are there before any device.
    let workers = |d: &PoolDaemon| d.threads().iter().filter(|t| t.starts_with("vhostd-w")).count();
    assert_eq!(workers(&d), 2, "threads: {:?}", d.threads());

    let n1 = d.add_net("n1", &["--backend", "loopback"]);
    let n2 = d.add_net("n2", &["--backend", "loopback", "--queues", "2"]);
    let img = d.path("disk.img");
    std::fs::write(&img, vec![0u8; 4 << 20]).unwrap();
    let b1 = d.path("b1.sock");
    d.ok(&[
        "add",
        "blk",
        "--name",
        "b1",
        "--socket-path",
        b1.to_str().unwrap(),
        "--backend",
        &format!("file,path={}", img.display()),
    ]);
    let b2 = d.path("b2.sock");
    d.ok(&["add", "blk", "--name", "b2", "--socket-path", b2.to_str().unwrap(), "--backend", "null,size=64M"]);
    for s in [&n1, &n2, &b1, &b2] {
        assert!(s.exists(), "{} not created", s.display());
    }
    // Every device's queues on the pool's two workers, spread: n1 and n2's
    // first pairs on different workers, n2's two pairs on both.
    let (w1, w2) = (d.workers_of("n1"), d.workers_of("n2"));
    assert_eq!(w1.len(), 2, "n1: a pair and the control queue");
    assert_eq!(w2.len(), 3, "n2: two pairs and the control queue");
    assert!(w1.iter().chain(&w2).all(|&w| w < 2));
    assert_ne!(w2[0], w2[1], "n2's pairs on the same worker: {w2:?}");
    assert_eq!(workers(&d), 2, "the pool does not grow with devices: {:?}", d.threads());

    // Traffic through n1 (exact, in order) while n2 is removed and n3
    // added, and n1's pair is moved between workers twice.
    let stop = Arc::new(AtomicBool::new(false));
    let total = 200_000;
    let t = {
        let (n1, stop) = (n1.clone(), stop.clone());
        std::thread::spawn(move || loop_frames(&n1, total, &stop))
    };
    let mut blk = VirtioUser::connect(Options::blk(&b1)).unwrap();
    let cap = blk.blk_config().unwrap().capacity;
    let mut qs = vec![blk.blk_queue(0, 16, 4096).unwrap()];
    let w = Workload { seed: 7, ..Workload::new(Mode::Verify, 4096) };
    assert!(workload::run(&mut qs, cap, &w, None).unwrap().passed(), "b1 verify");

    // n2 has a frontend, which sees the socket close on removal.
    let mut f2 = VirtioUser::connect(Options::new(&n2)).unwrap();
    let _pair = f2.net_queue_pair(0, 256).unwrap();
    assert!(d.ok(&["remove", "n2"]).contains("removed n2"));
    assert!(!n2.exists(), "n2's socket left behind");
    assert!(wait_until(T, || f2.backend_gone()), "n2's frontend did not see the socket close");
    assert!(f2.get_vring_base(0).is_err(), "n2 still answers after its removal");
    let n3 = d.add_net("n3", &["--backend", "loopback"]);
    let from = d.workers_of("n1")[0];
    d.ok(&["pin", "n1", "0", &(1 - from).to_string()]);
    assert_eq!(d.workers_of("n1")[0], 1 - from);
    d.ok(&["pin", "n1", "0", &from.to_string()]);
    let got = t.join().unwrap();
    assert_eq!(got, total, "n1 lost frames while devices came and went");
    let stop3 = AtomicBool::new(false);
    assert_eq!(loop_frames(&n3, 10_000, &stop3), 10_000, "n3 added at runtime");
    let w = Workload { seed: 8, count: Some(256), ..Workload::new(Mode::Verify, 4096) };
    assert!(workload::run(&mut qs, cap, &w, None).unwrap().passed(), "b1 after the changes");
    drop(qs);
    drop(blk);

    // Exact counters of the device that stayed, from the control socket.
    let s = d.ok(&["--json", "list"]);
    assert!(!s.contains("\"n2\""), "n2 still listed: {s}");
    let stats: Value = {
        let out = Command::new(VHOSTD)
            .args(["stats", "--json", "--control", d.path("ctl").to_str().unwrap()])
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let n1s = stats["devices"].as_array().unwrap().iter().find(|x| x["name"] == "n1").unwrap().clone();
    let q = |i: u64| n1s["queues"].as_array().unwrap().iter().find(|q| q["queue"] == i).unwrap()["packets"].clone();
    assert_eq!((q(0), q(1)), (Value::from(total), Value::from(total)), "n1 rx/tx packets");
    assert_eq!(workers(&d), 2, "threads: {:?}", d.threads());
}

#[test]
fn ctl_errors_name_the_key_and_leave_nothing() {
    let _one = serial();
    let d = PoolDaemon::start(&["--workers", "2"]);
    d.add_net("n1", &["--backend", "sink"]);
    let other = d.path("x.sock");
    let x = other.to_str().unwrap();
    let e = d.refused(&["add", "net", "--name", "n1", "--socket-path", x, "--backend", "sink"]);
    assert!(e.contains("--name n1: a device of that name exists"), "{e}");
    let n1 = d.path("n1.sock");
    let e = d.refused(&["add", "net", "--name", "n2", "--socket-path", n1.to_str().unwrap(), "--backend", "sink"]);
    assert!(e.contains("--socket-path") && e.contains("device `n1` serves it"), "{e}");
    let e = d.refused(&["add", "net", "--name", "n2", "--socket-path", x, "--backend", "sink", "--mode", "poll"]);
    assert!(e.contains("--mode") && e.contains("--worker-mode"), "{e}");
    let e = d.refused(&["add", "net", "--name", "n2", "--socket-path", x, "--backend", "sink", "--cpus", "0"]);
    assert!(e.contains("--cpus") && e.contains("--worker-cpus"), "{e}");
    let e = d.refused(&["add", "net", "--name", "n2", "--socket-path", x, "--backend", "nope"]);
    assert!(e.contains("--backend") && e.contains("unknown backend 'nope'"), "{e}");
    let e = d.refused(&["add", "net", "--socket-path", x, "--backend", "sink"]);
    assert!(e.contains("--name: required"), "{e}");
    let e = d.refused(&["add", "disk", "--name", "n2"]);
    assert!(e.contains("expected net, blk or scsi"), "{e}");
    // Descriptor numbers would name the daemon's own descriptors.
    let e = d.refused(&["add", "net", "--name", "n2", "--socket-path", x, "--backend", "tap,fd=4"]);
    assert!(e.contains("tap,fd=") && e.contains("ifname="), "{e}");
    let e = d.refused(&[
        "add",
        "net",
        "--name",
        "n2",
        "--socket-path",
        x,
        "--backend",
        "af-xdp,ifname=lo,inhibit=on,sock-fds=4",
    ]);
    assert!(e.contains("sock-fds"), "{e}");
    let e = d.refused(&["add", "net", "--name", "n2", "--socket-path", x, "--backend", "sink", "--workers", "4"]);
    assert!(e.contains("--workers: an option of the daemon"), "{e}");
    // A raw request with a CPU range no machine has: refused, the daemon lives.
    let raw = serde_json::json!({"command": "add", "args": ["net", "--name", "n2", "--socket-path", x, "--backend", "sink", "--cpus", "0-2000000000000"]});
    let mut c = std::os::unix::net::UnixStream::connect(d.path("ctl")).unwrap();
    std::io::Write::write_all(&mut c, format!("{raw}\n").as_bytes()).unwrap();
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut c, &mut answer).unwrap();
    assert!(answer.contains("\"error\"") && answer.contains("not available"), "{answer}");
    assert!(d.alive());
    // A backend that cannot be opened: nothing of the device stays.
    let e = d.refused(&["add", "blk", "--name", "b1", "--socket-path", x, "--backend", "file,path=/nonexistent/img"]);
    assert!(e.contains("/nonexistent/img"), "{e}");
    assert!(!other.exists(), "socket of a device that failed to build left behind");
    let e = d.refused(&["remove", "b1"]);
    assert!(e.contains("no such device"), "{e}");
    let e = d.refused(&["pin", "n1", "5", "0"]);
    assert!(e.contains("queue 5: expected 0 to 1"), "{e}");
    let e = d.refused(&["pin", "n1", "0", "2"]);
    assert!(e.contains("worker 2: expected 0 to 1"), "{e}");
    let l = d.list();
    assert_eq!(l["devices"].as_array().unwrap().len(), 1, "{l}");
    // The control socket is the owner's and the group's only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(d.path("ctl")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
}

#[test]
fn the_balancer_moves_a_queue_off_a_loaded_worker() {
    let _one = serial();
    let d = PoolDaemon::start(&["--workers", "2", "--rebalance-interval", "1"]);
    // Sources: vhostd writes every frame (1500 bytes) into the guest's
    // buffers, so each queue costs its worker a good part of a CPU.
    let s1 = d.add_net("s1", &["--backend", "source", "--pkt-size", "1500"]);
    let s2 = d.add_net("s2", &["--backend", "source", "--pkt-size", "1500"]);
    // Both queues on one worker, free to move.
    let w = d.workers_of("s1")[0];
    d.ok(&["pin", "s2", "0", &w.to_string()]);
    d.ok(&["unpin", "s2", "0"]);
    assert_eq!((d.workers_of("s1")[0], d.workers_of("s2")[0]), (w, w));
    let stop = Arc::new(AtomicBool::new(false));
    let receivers: Vec<_> = [s1, s2]
        .into_iter()
        .map(|sock| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut dev = VirtioUser::connect(Options::new(&sock)).expect("connect");
                let (mut rx, _tx) = dev.net_queue_pair(0, 256).unwrap();
                let mut got = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    if rx.recv_burst(64, |_| got += 1).unwrap() == 0 {
                        std::thread::yield_now();
                    }
                }
                got
            })
        })
        .collect();
    // Three steady samples a second apart, then the move.
    let moved = wait_until(Duration::from_secs(20), || d.workers_of("s1")[0] != d.workers_of("s2")[0]);
    stop.store(true, Ordering::Relaxed);
    for r in receivers {
        assert!(r.join().unwrap() > 0, "a source sent nothing");
    }
    assert!(moved, "the queues stayed on one worker; stderr:\n{}", d.stderr());
    assert!(d.stderr().contains("balancer: queue moved"), "{}", d.stderr());
    // A pinned queue stays where it was put.
    let before = d.workers_of("s1")[0];
    d.ok(&["pin", "s1", "0", &before.to_string()]);
    let l = d.list();
    let s1 = l["devices"].as_array().unwrap().iter().find(|x| x["name"] == "s1").unwrap().clone();
    assert_eq!(s1["queues"][0]["pinned"], true);
}

/// The daemon's user and system CPU time, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = stat.rsplit(')').next().unwrap().split_whitespace().collect();
    // Fields 14 and 15 (utime, stime), counted from the state (field 3).
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn eighty_connected_idle_devices_take_under_one_percent_of_a_cpu() {
    let _one = serial();
    let d = PoolDaemon::start(&["--workers", "2", "--rebalance-interval", "0"]);
    let mut socks = vec![(true, d.add_net("n0", &["--backend", "sink"]))];
    // One device served: main, the frontends and control threads, 2 workers.
    let (threads0, rss0) = (d.threads().len(), rss_kib(d.pid()));
    assert_eq!(threads0, 5, "{:?}", d.threads());
    for i in 1..64 {
        socks.push((true, d.add_net(&format!("n{i}"), &["--backend", "sink"])));
    }
    for i in 0..16 {
        let sock = d.path(&format!("b{i}.sock"));
        d.ok(&[
            "add",
            "blk",
            "--name",
            &format!("b{i}"),
            "--socket-path",
            sock.to_str().unwrap(),
            "--backend",
            "null,size=1M",
        ]);
        socks.push((false, sock));
    }
    // Every device with a frontend and running rings, and no traffic.
    let mut frontends = Vec::new();
    for (net, sock) in &socks {
        let mut opts = if *net { Options::new(sock) } else { Options::blk(sock) };
        opts.mem_size = 4 << 20;
        let mut dev = VirtioUser::connect(opts).expect("connect");
        if *net {
            let pair = dev.net_queue_pair(0, 64).unwrap();
            frontends.push((dev, Some(pair), None));
        } else {
            let q = dev.blk_queue(0, 16, 4096).unwrap();
            frontends.push((dev, None, Some(q)));
        }
    }
    let l = d.list();
    let connected = l["devices"].as_array().unwrap().iter().filter(|x| x["connected"] == true).count();
    assert_eq!(connected, 80, "{l}");
    // Adaptive workers spin 100 us after the last work, then sleep.
    std::thread::sleep(Duration::from_millis(500));
    let (t0, c0) = (std::time::Instant::now(), cpu_ticks(d.pid()));
    std::thread::sleep(Duration::from_secs(3));
    let ticks = cpu_ticks(d.pid()) - c0;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let pct = ticks as f64 / hz / t0.elapsed().as_secs_f64() * 100.0;
    let (threads, rss) = (d.threads().len(), rss_kib(d.pid()));
    eprintln!(
        "80 connected idle devices: {pct:.2} % of a CPU; {threads} threads; RSS {rss0} KiB -> {rss} KiB, {} KiB per device",
        rss.saturating_sub(rss0) / 79
    );
    assert!(pct < 1.0, "80 idle devices took {pct:.2} % of a CPU");
    assert_eq!(threads, threads0, "threads grew with devices: {:?}", d.threads());
    drop(frontends);
}

/// Times threads whose names start with `prefix` went to sleep and woke
/// (their voluntary context switches), summed.
fn wakeups(pid: u32, prefix: &str) -> u64 {
    let mut n = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let v = status.lines().find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"));
        n += v.map_or(0, |v| v.trim().parse::<u64>().unwrap());
    }
    n
}

/// The balancer (on by default) does not wake an idle pool's workers: its
/// once-a-second sample is skipped while none has worked since one that
/// found no load. (It used to ask every worker for its counters each
/// second: a wake-up per worker per second on an idle host.)
#[test]
fn the_balancer_leaves_an_idle_pool_asleep() {
    let _one = serial();
    let d = PoolDaemon::start(&["--workers", "2"]);
    let sock = d.path("b0.sock");
    d.ok(&["add", "blk", "--name", "b0", "--socket-path", sock.to_str().unwrap(), "--backend", "null,size=1M"]);
    let mut opts = Options::blk(&sock);
    opts.mem_size = 4 << 20;
    let mut dev = VirtioUser::connect(opts).expect("connect");
    let q = dev.blk_queue(0, 16, 4096).unwrap();
    // A sample or two to find the pool idle.
    std::thread::sleep(Duration::from_millis(2500));
    let w0 = wakeups(d.pid(), "vhostd-w");
    std::thread::sleep(Duration::from_secs(4));
    let woke = wakeups(d.pid(), "vhostd-w") - w0;
    assert!(woke <= 1, "idle workers woke {woke} times in 4 s; stderr:\n{}", d.stderr());
    drop(q);
    drop(dev);
}

/// Frames device `name` has taken from its guest (TX queue 1), from the
/// control socket; None if the daemon did not answer within its timeout.
fn tx_packets(d: &PoolDaemon, name: &str) -> Option<u64> {
    let out =
        Command::new(VHOSTD).args(["stats", "--json", "--control", d.path("ctl").to_str().unwrap()]).output().ok()?;
    let v: Value = serde_json::from_slice(&out.stdout).ok()?;
    let dev = v["devices"].as_array()?.iter().find(|x| x["name"] == name)?.clone();
    dev["queues"].as_array()?.iter().find(|q| q["queue"] == 1)?["packets"].as_u64()
}

/// A blk device whose disk hangs while its ring stops (its frontend went,
/// as when QEMU stops a VM) must not hold the worker it shares, nor the
/// thread serving every device's socket: the other devices on the worker
/// keep moving frames, a device added meanwhile is served, and the stop
/// completes once the disk answers again. (A worker that waited for the
/// disk would move nothing and not answer the stats request; a frontends
/// thread that waited would never answer the new device's frontend.)
#[test]
fn a_hung_disk_stopping_holds_up_no_other_device_on_its_worker() {
    let _one = serial();
    let dir = tempdir();
    let disk = HangingDisk::mount(&dir, 16 << 20);
    let d = PoolDaemon::start(&["--workers", "1", "--rebalance-interval", "0"]);
    let n1 = d.add_net("n1", &["--backend", "loopback"]);
    let b1 = d.path("b1.sock");
    let backend = format!("file,path={}", disk.disk().display());
    d.ok(&["add", "blk", "--name", "b1", "--socket-path", b1.to_str().unwrap(), "--backend", &backend]);

    let stop = Arc::new(AtomicBool::new(false));
    // Stops the traffic however the test ends (before the daemon goes).
    struct SetOnDrop(Arc<AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let _stop_traffic = SetOnDrop(stop.clone());
    let traffic = {
        let (n1, stop) = (n1.clone(), stop.clone());
        std::thread::spawn(move || loop_frames(&n1, u32::MAX, &stop))
    };
    assert!(wait_until(T, || tx_packets(&d, "n1").is_some_and(|p| p > 0)), "no traffic through n1");

    // Reads that hang in the disk; the frontend gives up on them and goes,
    // leaving them in flight while b1's ring stops.
    let held = disk.hold();
    {
        let mut blk = VirtioUser::connect(Options::blk(&b1)).unwrap();
        let cap = blk.blk_config().unwrap().capacity;
        let mut qs = vec![blk.blk_queue(0, 64, 4096).unwrap()];
        // More than the kernel's default io-wq workers (4 per CPU) hang.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let depth = (4 * cpus + 8).min(64) as u16;
        let w = Workload {
            count: Some(depth as u64 * 2),
            iodepth: depth,
            stall_timeout: Duration::from_secs(1),
            ..Workload::new(Mode::RandRead, 4096)
        };
        assert!(workload::run(&mut qs, cap, &w, None).is_err(), "reads completed on a held disk");
    }
    assert!(
        wait_until(T, || d.stderr().contains("waiting for its requests in flight")),
        "b1's ring did not start stopping; stderr:\n{}",
        d.stderr()
    );
    let before = tx_packets(&d, "n1").expect("stats while b1's disk hangs");
    assert!(
        wait_until(T, || tx_packets(&d, "n1").is_some_and(|p| p >= before + 10_000)),
        "n1 stopped moving frames while b1's disk hung (at {before})"
    );
    // The control socket answers: b1 is listed; pinning its stopping
    // queue is refused, to be tried again.
    let l = d.list();
    assert!(l["devices"].as_array().unwrap().iter().any(|x| x["name"] == "b1"), "{l}");
    let err = d.refused(&["pin", "b1", "0", "0"]);
    assert!(err.contains("stopping"), "{err}");
    // The frontends thread is not waiting either: a device added now is
    // served (its socket, its messages) while b1's ring still stops.
    let n2 = d.add_net("n2", &["--backend", "loopback"]);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let never = AtomicBool::new(false);
        let _ = tx.send(loop_frames(&n2, 1000, &never));
    });
    assert_eq!(rx.recv_timeout(T), Ok(1000), "a device added while b1's disk hung was not served");
    // Nor the other disks on the worker: b2 (a local file) writes,
    // flushes and reads back while more of b1's reads hang than the
    // kernel's default io-wq workers (4 per CPU) could carry, were each to
    // hold one (FUSE's do not: they wait for the server without one).
    let img = dir.join("b2.img");
    std::fs::write(&img, vec![0u8; 4 << 20]).unwrap();
    let b2 = d.path("b2.sock");
    let b2_backend = format!("file,path={}", img.display());
    d.ok(&["add", "blk", "--name", "b2", "--socket-path", b2.to_str().unwrap(), "--backend", &b2_backend]);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let passed = (|| {
            let mut blk = VirtioUser::connect(Options::blk(&b2)).ok()?;
            let cap = blk.blk_config().ok()?.capacity;
            let mut qs = vec![blk.blk_queue(0, 16, 4096).ok()?];
            let w = Workload { seed: 5, count: Some(64), ..Workload::new(Mode::Verify, 4096) };
            Some(workload::run(&mut qs, cap, &w, None).ok()?.passed())
        })();
        let _ = tx.send(passed);
    });
    assert_eq!(rx.recv_timeout(T), Ok(Some(true)), "b2 did not write and read back while b1's disk hung");
    assert!(d.stderr().contains("waiting for its requests in flight") && !d.stderr().contains("ring stopped"));

    // The disk answers again: the stop completes and b1 serves the next
    // frontend.
    held.release();
    assert!(wait_until(T, || d.stderr().contains("ring stopped")), "b1's ring never stopped:\n{}", d.stderr());
    let mut blk = VirtioUser::connect(Options::blk(&b1)).unwrap();
    let cap = blk.blk_config().unwrap().capacity;
    let mut qs = vec![blk.blk_queue(0, 16, 4096).unwrap()];
    let w = Workload { seed: 3, count: Some(64), ..Workload::new(Mode::Verify, 4096) };
    assert!(workload::run(&mut qs, cap, &w, None).unwrap().passed(), "b1 after its disk came back");

    // Removed while its disk hangs: answered once the disk is, with the
    // device gone and the daemon serving the rest.
    let held = disk.hold();
    let w = Workload {
        count: Some(8),
        iodepth: 4,
        stall_timeout: Duration::from_secs(1),
        ..Workload::new(Mode::RandRead, 4096)
    };
    assert!(workload::run(&mut qs, cap, &w, None).is_err(), "reads completed on a held disk");
    drop(qs);
    drop(blk);
    let stopping = |d: &PoolDaemon| d.stderr().matches("waiting for its requests in flight").count();
    assert!(wait_until(T, || stopping(&d) == 2), "b1's ring did not start stopping again:\n{}", d.stderr());
    let ctl = d.path("ctl");
    let remove = std::thread::spawn(move || {
        Command::new(VHOSTD).args(["ctl", "--control", ctl.to_str().unwrap(), "remove", "b1"]).output().unwrap()
    });
    assert!(tx_packets(&d, "n1").is_some(), "stats while b1's removal waits");
    assert!(d.list()["devices"].as_array().is_some(), "list while b1's removal waits");
    held.release();
    let out = remove.join().unwrap();
    assert!(out.status.success(), "ctl remove b1: {}", String::from_utf8_lossy(&out.stderr));
    assert!(!b1.exists(), "b1's socket left after its removal");
    assert!(!d.list()["devices"].as_array().unwrap().iter().any(|x| x["name"] == "b1"));
    assert!(d.alive(), "vhostd died; stderr:\n{}", d.stderr());
    stop.store(true, Ordering::Relaxed);
    assert!(traffic.join().unwrap() > 10_000);
    drop(d);
    drop(disk);
    let _ = std::fs::remove_dir_all(&dir);
}
