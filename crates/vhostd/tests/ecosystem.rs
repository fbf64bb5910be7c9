//! vhostd as operators run it: QEMU's backend-program conventions
//! (--print-capabilities, --fd, the JSON descriptors, launched the way
//! libvirt launches a backend), one daemon for several devices from a
//! configuration file, the control socket and `vhostd stats`, Prometheus
//! metrics, JSON logs, systemd readiness and units, the man page.

mod common;

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{frame, tempdir, wait_until};
use serde_json::Value;
use vhostd_user::blk::workload::{self, Mode, Workload};
use vhostd_user::{Descriptor, Options, VirtioUser};

const VHOSTD: &str = env!("CARGO_BIN_EXE_vhostd");
const T: Duration = Duration::from_secs(10);

/// A directory removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        Dir(tempdir())
    }
    fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A vhostd child with its stderr collected; killed on drop.
struct Proc {
    child: Option<Child>,
    err: Arc<Mutex<String>>,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn vhostd");
        let err = common::collect_stderr(&mut child);
        Proc { child: Some(child), err }
    }

    fn stderr(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    fn wait_log(&self, what: &str) -> bool {
        wait_until(T, || self.stderr().contains(what))
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// SIGTERM, then the exit status and stdout (bounded).
    fn stop(&mut self) -> (i32, String) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        self.wait()
    }

    fn wait(&mut self) -> (i32, String) {
        let deadline = Instant::now() + T;
        let status = loop {
            // The child stays ours until it has exited: Drop kills it if this panics.
            if let Some(s) = self.child.as_mut().unwrap().try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "vhostd did not exit in time; stderr:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut c = self.child.take().unwrap();
        let mut out = String::new();
        c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        // Already reaped by try_wait; this returns the same status.
        let _ = c.wait();
        (status.code().unwrap_or(-1), out)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(VHOSTD).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A link to vhostd under `name` in `dir` (the multi-call names).
fn link(dir: &Dir, name: &str) -> PathBuf {
    let p = dir.join(name);
    std::os::unix::fs::symlink(VHOSTD, &p).unwrap();
    p
}

#[test]
fn print_capabilities_as_the_convention_says() {
    let d = Dir::new();
    for (argv0, args, ty) in [
        (PathBuf::from(VHOSTD), vec!["net", "--print-capabilities"], "net"),
        (PathBuf::from(VHOSTD), vec!["blk", "--print-capabilities"], "block"),
        (link(&d, "vhostd-net"), vec!["--print-capabilities"], "net"),
        (link(&d, "vhostd-blk"), vec!["--print-capabilities"], "block"),
    ] {
        let out = Command::new(&argv0).args(&args).output().unwrap();
        assert!(out.status.success(), "{argv0:?} {args:?}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
        assert_eq!(v["type"], ty, "{argv0:?} {args:?}");
        if ty == "block" {
            let f: Vec<&str> = v["features"].as_array().unwrap().iter().map(|x| x.as_str().unwrap()).collect();
            assert_eq!(f, ["read-only", "blk-file"]);
        }
    }
}

/// The descriptors QEMU and libvirt discover backends by
/// (docs/interop/vhost-user.json: VHostUserBackend).
#[test]
fn descriptors_are_valid_and_installable() {
    for (file, ty, prog) in [("50-vhostd-net.json", "net", "vhostd-net"), ("50-vhostd-blk.json", "block", "vhostd-blk")]
    {
        let text = std::fs::read_to_string(repo().join("contrib/vhost-user").join(file)).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        let o = v.as_object().unwrap();
        for k in o.keys() {
            assert!(["description", "type", "binary", "tags"].contains(&k.as_str()), "{file}: unknown member {k}");
        }
        assert!(v["description"].is_string());
        assert_eq!(v["type"], ty);
        assert!(v["binary"].as_str().unwrap().ends_with(&format!("/{prog}")));
        assert!(v["tags"].as_array().unwrap().iter().all(Value::is_string));
    }
    // contrib/install puts the program where the descriptor says.
    let d = Dir::new();
    let dest = d.join("root");
    let st = Command::new(repo().join("contrib/install"))
        .args(["--prefix", "/opt/vhostd", "--destdir", dest.to_str().unwrap()])
        .env("VHOSTD_BIN", VHOSTD)
        .status()
        .unwrap();
    assert!(st.success());
    for t in ["net", "blk"] {
        let v: Value = serde_json::from_str(
            &std::fs::read_to_string(dest.join(format!("etc/qemu/vhost-user/50-vhostd-{t}.json"))).unwrap(),
        )
        .unwrap();
        let bin = v["binary"].as_str().unwrap();
        assert_eq!(bin, format!("/opt/vhostd/libexec/vhostd/vhostd-{t}"));
        let target = std::fs::read_link(dest.join(bin.trim_start_matches('/'))).unwrap();
        assert_eq!(target, Path::new("/opt/vhostd/bin/vhostd"));
    }
    assert!(dest.join("opt/vhostd/bin/vhostd").is_file());
    assert!(dest.join("etc/systemd/system/vhostd.service").is_file());
    assert!(dest.join("etc/vhostd/vhostd.toml").is_file());
    assert!(dest.join("opt/vhostd/share/man/man1/vhostd.1").is_file());
}

/// A socketpair, one end inherited by the child as descriptor `at`.
fn launch_with_fd(program: &Path, args: &[String], at: i32) -> (Proc, UnixStream) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fd = theirs.as_raw_fd();
    let mut cmd = Command::new(program);
    cmd.args(args);
    // SAFETY: between fork and exec only async-signal-safe calls: dup2
    // puts the socket at `at` (without CLOEXEC).
    unsafe {
        cmd.pre_exec(move || {
            // dup2 onto itself keeps FD_CLOEXEC: clear it then.
            let r = if fd == at { libc::fcntl(fd, libc::F_SETFD, 0) } else { libc::dup2(fd, at) };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let p = Proc::spawn(cmd);
    drop(theirs);
    (p, ours)
}

/// What libvirt does with a descriptor: run its program with `--fd=N` on one
/// end of a socketpair (plus options its features allow) and speak
/// vhost-user on the other end.
#[test]
fn launched_like_libvirt_with_fd() {
    let d = Dir::new();
    let img = d.join("disk.img");
    std::fs::write(&img, vec![0u8; 4 << 20]).unwrap();
    let prog = link(&d, "vhostd-blk");
    let (p, sock) = launch_with_fd(&prog, &["--fd=7".into(), format!("--blk-file={}", img.display())], 7);
    let mut dev = VirtioUser::from_stream(sock, Options::blk("unused")).expect("vhost-user over the socketpair");
    let cap = dev.blk_config().unwrap().capacity;
    assert_eq!(cap, (4 << 20) / 512);
    let mut qs = vec![dev.blk_queue(0, 16, 4096).unwrap()];
    let w = Workload { seed: 5, ..Workload::new(Mode::Verify, 4096) };
    let r = workload::run(&mut qs, cap, &w, None).unwrap();
    assert!(r.passed(), "{:?} {:?}", r.first_error, r.mismatch);
    drop(qs);
    // Closing our end ends the connection: vhostd exits by itself, status 0.
    drop(dev);
    let mut p = p;
    let (code, out) = p.wait();
    assert_eq!(code, 0, "stderr:\n{}", p.stderr());
    assert!(out.contains("stats total reads="), "{out}");

    // Read-only, as the `read-only` feature promises; and a net device.
    let (p, sock) =
        launch_with_fd(&prog, &["--fd=9".into(), format!("--blk-file={}", img.display()), "--read-only".into()], 9);
    let dev = VirtioUser::from_stream(sock, Options::blk("unused")).unwrap();
    assert_ne!(dev.features() & vhostd_user::features::BLK_RO, 0);
    drop(dev);
    let mut p = p;
    assert_eq!(p.wait().0, 0);

    let (p, sock) = launch_with_fd(&link(&d, "vhostd-net"), &["--fd=8".into(), "--backend=loopback".into()], 8);
    let mut dev = VirtioUser::from_stream(sock, Options::new("unused")).unwrap();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    let f = frame(1, 60);
    assert!(tx.send_frame(&f).unwrap());
    tx.flush().unwrap();
    let mut got = Vec::new();
    assert!(wait_until(T, || {
        rx.recv_burst(8, |b| got.push(b.to_vec())).unwrap();
        !got.is_empty()
    }));
    assert_eq!(got[0], f);
    drop((rx, tx));
    drop(dev);
    let mut p = p;
    assert_eq!(p.wait().0, 0);
}

#[test]
fn fd_that_is_not_a_socket_is_refused() {
    let (code, _, err) = run(&["blk", "--fd", "1", "--backend", "null,size=1M"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--fd"), "{err}");
    let d = Dir::new();
    let f = std::fs::File::create(d.join("f")).unwrap();
    let mut cmd = Command::new(VHOSTD);
    let fd = f.as_raw_fd();
    cmd.args(["blk", "--fd", "5", "--backend", "null,size=1M"]);
    // SAFETY: dup2 between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if fd == 5 {
                libc::fcntl(fd, libc::F_SETFD, 0);
            } else {
                libc::dup2(fd, 5);
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--fd 5: not an open socket") || err.contains("--fd 5: not a Unix stream socket"), "{err}");
}

fn fetch_stats(control: &Path) -> Value {
    let (code, out, err) = run(&["stats", "--json", "--control", control.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).unwrap()
}

fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    let (head, body) = r.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

/// The value of the sample `name{labels}` in an exposition.
fn metric(text: &str, name_labels: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(name_labels).and_then(|v| v.trim().parse().ok()))
}

#[test]
fn one_daemon_many_devices_with_stats_and_metrics() {
    let d = Dir::new();
    let img = d.join("disk.img");
    std::fs::write(&img, vec![0u8; 2 << 20]).unwrap();
    let (net_sock, blk_sock, ctl) = (d.join("n0.sock"), d.join("b0.sock"), d.join("ctl.sock"));
    let cfg = d.join("vhostd.toml");
    std::fs::write(
        &cfg,
        format!(
            "control = \"{}\"\nmetrics = \"127.0.0.1:0\"\n\n[[net]]\nname = \"n0\"\nsocket-path = \"{}\"\nbackend = \"loopback\"\nqueues = 2\n\n[[blk]]\nname = \"b0\"\nsocket-path = \"{}\"\nbackend = \"file,path={}\"\nmode = \"adaptive\"\n",
            ctl.display(),
            net_sock.display(),
            blk_sock.display(),
            img.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(VHOSTD);
    cmd.args(["--config", cfg.to_str().unwrap()]);
    let mut p = Proc::spawn(cmd);
    assert!(p.wait_log(&format!("vhostd: listening on {}", blk_sock.display())), "{}", p.stderr());
    assert!(p.stderr().contains(&format!("vhostd: listening on {}", net_sock.display())));
    // The metrics address (port 0: the kernel chose) from the log.
    assert!(p.wait_log("metrics on http://"));
    let log = p.stderr();
    let addr = log.split("metrics on http://").nth(1).unwrap().split('/').next().unwrap().to_string();

    // Traffic on both devices.
    let mut net = VirtioUser::connect(Options::new(&net_sock)).unwrap();
    let (mut rx, mut tx) = net.net_queue_pair(0, 256).unwrap();
    let frames: Vec<Vec<u8>> = (0..100).map(|i| frame(i, 100)).collect();
    for f in &frames {
        assert!(tx.send_frame(f).unwrap());
    }
    tx.flush().unwrap();
    let mut got = 0;
    assert!(wait_until(T, || {
        rx.recv_burst(64, |_| got += 1).unwrap();
        got == 100
    }));
    let mut blk = VirtioUser::connect(Options::blk(&blk_sock)).unwrap();
    let cap = blk.blk_config().unwrap().capacity;
    let mut qs = vec![blk.blk_queue(0, 8, 4096).unwrap()];
    let w = Workload { seed: 3, ..Workload::new(Mode::Verify, 4096) };
    assert!(workload::run(&mut qs, cap, &w, None).unwrap().passed());
    let blocks = cap * 512 / 4096;

    // The control socket: every device, its queues, exact counters.
    let s = fetch_stats(&ctl);
    assert_eq!(s["pid"], p.pid());
    let devs = s["devices"].as_array().unwrap();
    assert_eq!(devs.len(), 2);
    let n0 = &devs[0];
    assert_eq!(
        (n0["name"].as_str(), n0["type"].as_str(), n0["connected"].as_bool()),
        (Some("n0"), Some("net"), Some(true))
    );
    let q = |d: &Value, i: u64| d["queues"].as_array().unwrap().iter().find(|q| q["queue"] == i).unwrap().clone();
    assert_eq!(q(n0, 1)["packets"], 100, "tx queue 1");
    assert_eq!(q(n0, 0)["packets"], 100, "rx queue 0");
    assert_eq!(q(n0, 1)["bytes"], 100 * 100);
    assert_eq!(q(n0, 3)["packets"], 0, "pair 1 idle");
    let b0 = &devs[1];
    assert_eq!(b0["name"], "b0");
    assert_eq!(b0["queues"][0]["writes"], blocks);
    assert_eq!(b0["queues"][0]["reads"], blocks);

    // `vhostd stats`: a table with both devices and rates.
    let (code, table, err) = run(&["stats", "--control", ctl.to_str().unwrap(), "--interval", "0.2"]);
    assert_eq!(code, 0, "{err}");
    assert!(table.contains("n0 (net, ") && table.contains("b0 (blk, "), "{table}");
    assert!(table.contains("pkts/s") && table.contains("reads/s"), "{table}");
    assert!(table.contains("rates over 0.2 s"), "{table}");

    // Prometheus: the same counters.
    let (head, body) = http_get(&addr, "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert_eq!(metric(&body, "vhostd_queue_packets_total{device=\"n0\",queue=\"1\",dir=\"tx\"}"), Some(100), "{body}");
    assert_eq!(metric(&body, "vhostd_blk_requests_total{device=\"b0\",queue=\"0\",type=\"write\"}"), Some(blocks));
    assert_eq!(metric(&body, "vhostd_device_connected{device=\"b0\"}"), Some(1));
    assert!(http_get(&addr, "/nope").0.starts_with("HTTP/1.1 404"));

    // A frontend that breaks n0's ring (avail.idx runs ahead of the ring):
    // n0 needs a reset, b0 goes on.
    drop((rx, tx));
    drop(net);
    let mut hostile = VirtioUser::connect(Options::new(&net_sock)).unwrap();
    let txq = hostile.create_queue(1, 64, None).unwrap();
    hostile.start_queue(&txq).unwrap();
    let mut txq = txq;
    let ring = txq.ring.split().unwrap();
    let idx = ring.avail_idx();
    ring.set_avail_idx(idx.wrapping_add(200));
    txq.kick().unwrap();
    assert!(wait_until(T, || fetch_stats(&ctl)["devices"][0]["needs_reset"] == true));
    let w = Workload { seed: 4, count: Some(64), ..Workload::new(Mode::Verify, 4096) };
    assert!(workload::run(&mut qs, cap, &w, None).unwrap().passed(), "b0 after n0 broke");
    drop(txq);
    drop(hostile);
    // And n0 takes the next frontend.
    let mut net = VirtioUser::connect(Options::new(&net_sock)).unwrap();
    let (mut rx, mut tx) = net.net_queue_pair(0, 256).unwrap();
    assert!(tx.send_frame(&frames[0]).unwrap());
    tx.flush().unwrap();
    let mut again = 0;
    assert!(wait_until(T, || {
        rx.recv_burst(8, |_| again += 1).unwrap();
        again == 1
    }));
    drop((rx, tx, qs));
    drop(net);
    drop(blk);

    let (code, out) = p.stop();
    assert_eq!(code, 0);
    assert!(out.contains("device name=n0 type=net") && out.contains("device name=b0 type=blk"), "{out}");
    for f in [&net_sock, &blk_sock, &ctl] {
        assert!(!f.exists(), "{} left behind", f.display());
    }
}

#[test]
fn config_errors_name_file_line_and_key_and_leave_nothing() {
    let d = Dir::new();
    let cfg = d.join("bad.toml");
    let sock = d.join("a.sock");
    std::fs::write(
        &cfg,
        format!("[[blk]]\nsocket-path = \"{}\"\nbackend = \"null,size=1M\"\n\n[[net]]\nsocket-path = \"{}/b.sock\"\nbackend = \"tap,ifname=x\"\nqueues = 99\n", sock.display(), d.0.display()),
    )
    .unwrap();
    let (code, _, err) = run(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("{}:8: [[net]] `net0`: key `queues`", cfg.display())), "{err}");
    assert!(!sock.exists(), "nothing created");
    // A device that cannot be set up stops the start, naming it; the other
    // device's socket is gone again.
    std::fs::write(
        &cfg,
        format!("[[blk]]\nname = \"ok\"\nsocket-path = \"{}\"\nbackend = \"null,size=1M\"\n\n[[blk]]\nname = \"missing\"\nsocket-path = \"{}/b.sock\"\nbackend = \"file,path=/nonexistent/x.img\"\n", sock.display(), d.0.display()),
    )
    .unwrap();
    let (code, _, err) = run(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("device `missing`: --backend file /nonexistent/x.img"), "{err}");
    assert!(!sock.exists() && !d.join("b.sock").exists(), "nothing left behind");
    let (code, _, err) = run(&["--config", d.join("none.toml").to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("none.toml: cannot read"), "{err}");
    let (code, _, err) = run(&["--config", cfg.to_str().unwrap(), "net"]);
    assert_eq!(code, 2, "--config and a subcommand: {err}");
}

#[test]
fn systemd_readiness_after_listening_and_clean_stop() {
    let d = Dir::new();
    let ns = d.join("notify");
    let notify = UnixDatagram::bind(&ns).unwrap();
    notify.set_read_timeout(Some(T)).unwrap();
    let sock = d.join("n.sock");
    let mut cmd = Command::new(VHOSTD);
    cmd.args(["net", "--socket-path", sock.to_str().unwrap(), "--backend", "sink"]).env("NOTIFY_SOCKET", &ns);
    let mut p = Proc::spawn(cmd);
    let mut buf = [0u8; 512];
    let n = notify.recv(&mut buf).expect("READY=1 within 10 s");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.starts_with("READY=1\n"), "{msg}");
    assert!(msg.contains(&format!("MAINPID={}", p.pid())), "{msg}");
    // Ready means a frontend can connect now.
    VirtioUser::connect(Options::new(&sock)).expect("connect right after READY=1");
    let (code, out) = p.stop();
    let n = notify.recv(&mut buf).expect("STOPPING=1");
    assert_eq!(&buf[..n], b"STOPPING=1\n");
    assert_eq!(code, 0);
    assert!(out.contains("stats total"));
    assert!(!sock.exists());
}

#[test]
fn unit_files_verify() {
    if Command::new("systemd-analyze").arg("--version").output().is_err() {
        eprintln!("note: no systemd-analyze; skipping");
        return;
    }
    let d = Dir::new();
    for u in ["vhostd.service", "vhostd@.service"] {
        let text = std::fs::read_to_string(repo().join("contrib/systemd").join(u)).unwrap();
        assert!(text.contains("Type=notify"), "{u}");
        // Point ExecStart at the binary under test so verify can check it.
        let name = if u.contains('@') { "vhostd@disk0.service" } else { u };
        let p = d.join(name);
        std::fs::write(&p, text.replace("/usr/local/bin/vhostd", VHOSTD)).unwrap();
        let out = Command::new("systemd-analyze").args(["verify", "--man=no"]).arg(&p).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let bad: Vec<&str> = err
            .lines()
            .filter(|l| l.contains(name) || l.contains("vhostd"))
            .filter(|l| {
                !l.contains("Failed to prepare filename")
                    && !l.contains("No such file")
                    && !l.contains("Unknown key name 'Before'")
            })
            .collect();
        assert!(bad.is_empty(), "systemd-analyze verify {name}:\n{err}");
    }
    // The example configuration parses (its TAP and image need not exist to be checked).
    let (code, _, err) = run(&["--config", repo().join("contrib/vhostd.toml").to_str().unwrap(), "--metrics", "nope"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--metrics"), "{err}");
}

#[test]
fn json_log_lines_parse() {
    let d = Dir::new();
    let sock = d.join("n.sock");
    let mut cmd = Command::new(VHOSTD);
    cmd.args(["net", "--socket-path", sock.to_str().unwrap(), "--backend", "sink", "--log-format", "json"]);
    let mut p = Proc::spawn(cmd);
    assert!(p.wait_log("vhostd: listening on"));
    drop(VirtioUser::connect(Options::new(&sock)).unwrap());
    assert!(p.wait_log("frontend disconnected"));
    let log = p.stderr();
    let (code, _) = p.stop();
    assert_eq!(code, 0);
    let json: Vec<Value> =
        log.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).expect(l)).collect();
    assert!(json.len() >= 2, "{log}");
    let conn = json.iter().find(|v| v["message"] == "frontend connected").expect("a 'frontend connected' record");
    assert_eq!(conn["level"], "INFO");
    assert_eq!(conn["span"]["device"], "net0", "the device's name on its records: {conn}");
    assert!(conn["timestamp"].is_string());
}

#[test]
fn man_page_is_current() {
    let (code, page, err) = run(&["man"]);
    assert_eq!(code, 0, "{err}");
    let committed = std::fs::read_to_string(repo().join("doc/vhostd.1")).unwrap();
    assert!(page == committed, "doc/vhostd.1 is stale: run `target/release/vhostd man > doc/vhostd.1`");
    for want in [
        ".TH vhostd 1",
        "\\-\\-config",
        ".SH \"VHOSTD NET\"",
        ".SH \"VHOSTD BLK\"",
        "\\-\\-socket\\-path",
        "\\-\\-print\\-capabilities",
        "CONFIGURATION FILE",
    ] {
        assert!(page.contains(want), "man page lacks {want}");
    }
}

#[test]
fn guest_errors_are_rate_limited_in_the_log() {
    let d = Dir::new();
    let (sock, ctl) = (d.join("n.sock"), d.join("ctl.sock"));
    let mut cmd = Command::new(VHOSTD);
    cmd.args(["net", "--socket-path", sock.to_str().unwrap(), "--backend", "sink", "--control", ctl.to_str().unwrap()]);
    let mut p = Proc::spawn(cmd);
    assert!(p.wait_log("vhostd: listening on"));
    let mut dev = VirtioUser::connect(Options::new(&sock)).unwrap();
    let mut txq = dev.create_queue(1, 64, None).unwrap();
    dev.start_queue(&txq).unwrap();
    // 64 chains outside guest memory, posted 30 times: 1920 bad chains.
    for i in 0..64 {
        txq.ring.split().unwrap().write_desc(i, Descriptor { addr: 1 << 40, len: 100, flags: 0, next: 0 });
    }
    for round in 1..=30u16 {
        let ring = txq.ring.split().unwrap();
        let mut idx = ring.avail_idx();
        for h in 0..64u16 {
            ring.write_avail_ring(idx % ring.size(), h);
            idx = idx.wrapping_add(1);
        }
        ring.set_avail_idx(idx);
        txq.kick().unwrap();
        assert!(wait_until(T, || txq.ring.split().unwrap().used_idx() == round.wrapping_mul(64)), "round {round}");
    }
    let s = fetch_stats(&ctl);
    assert_eq!(s["devices"][0]["queues"][1]["bad_chains"]["total"], 1920);
    assert_eq!(s["devices"][0]["queues"][1]["bad_chains"]["address"], 1920);
    drop(txq);
    drop(dev);
    let (code, out) = p.stop();
    assert_eq!(code, 0);
    assert!(out.contains("bad_chains=1920"), "{out}");
    // 1920 bad chains in well under 5 s: one warning, with the count so far.
    let warnings = p.stderr().matches("malformed descriptor chains").count();
    assert!((1..=2).contains(&warnings), "{warnings} warnings:\n{}", p.stderr());
}

/// The field `key` of /proc/PID/status.
fn proc_status(pid: i32, key: &str) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines().find_map(|l| l.strip_prefix(&format!("{key}:"))).unwrap_or("").trim().to_string()
}

#[test]
fn seccomp_filter_is_on_once_serving() {
    let d = Dir::new();
    for (mode, want) in [(None, "2"), (Some("trap"), "2"), (Some("off"), "0")] {
        let sock = d.join("s.sock");
        let mut cmd = Command::new(VHOSTD);
        cmd.args(["net", "--socket-path", sock.to_str().unwrap(), "--backend", "loopback"]);
        if let Some(m) = mode {
            cmd.args(["--seccomp", m]);
        }
        let mut p = Proc::spawn(cmd);
        assert!(p.wait_log("vhostd: listening on"));
        // The filter goes on right after the listening line: wait for it.
        assert!(
            wait_until(T, || proc_status(p.pid(), "Seccomp") == want),
            "{mode:?}: Seccomp {}",
            proc_status(p.pid(), "Seccomp")
        );
        if want == "2" {
            assert_eq!(proc_status(p.pid(), "NoNewPrivs"), "1");
            // Serving works under the filter: a frame round trip.
            let mut dev = VirtioUser::connect(Options::new(&sock)).unwrap();
            let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
            assert!(tx.send_frame(&frame(9, 80)).unwrap());
            tx.flush().unwrap();
            let mut n = 0;
            assert!(wait_until(T, || {
                rx.recv_burst(8, |_| n += 1).unwrap();
                n == 1
            }));
        }
        let (code, _) = p.stop();
        assert_eq!(code, 0, "{}", p.stderr());
    }
}

/// Handed its socket and image, vhostd needs no privileges: as `nobody`
/// with no capabilities at all it serves a disk.
#[test]
fn unprivileged_with_handed_in_socket() {
    let d = Dir::new();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&d.0, std::fs::Permissions::from_mode(0o777)).unwrap();
    let img = d.join("disk.img");
    std::fs::write(&img, vec![0u8; 1 << 20]).unwrap();
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o666)).unwrap();
    let args: Vec<String> = [
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        VHOSTD,
        "blk",
        "--fd=7",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("--blk-file={}", img.display())])
    .collect();
    let (mut p, sock) = launch_with_fd(Path::new("/usr/bin/setpriv"), &args, 7);
    let mut dev = VirtioUser::from_stream(sock, Options::blk("unused")).expect("vhost-user over the socketpair");
    let pid = p.pid();
    assert_eq!(proc_status(pid, "Uid").split_whitespace().next(), Some("65534"));
    assert_eq!(proc_status(pid, "CapEff"), "0000000000000000");
    assert_eq!(proc_status(pid, "CapPrm"), "0000000000000000");
    let cap = dev.blk_config().unwrap().capacity;
    let mut qs = vec![dev.blk_queue(0, 16, 4096).unwrap()];
    let w = Workload { seed: 8, ..Workload::new(Mode::Verify, 4096) };
    let r = workload::run(&mut qs, cap, &w, None).unwrap();
    assert!(r.passed(), "{:?} {:?}", r.first_error, r.mismatch);
    drop(qs);
    drop(dev);
    assert_eq!(p.wait().0, 0, "{}", p.stderr());
}
