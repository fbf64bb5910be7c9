//! The daemon's command line and lifecycle, driven as a user would.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn vhostd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vhostd"))
}

/// A socket path in a fresh directory that is removed when dropped.
struct TmpSock(PathBuf);

impl TmpSock {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TmpSock {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn tmp_sock(name: &str) -> TmpSock {
    let dir = std::env::temp_dir().join(format!("vhostd-cli-{}-{name}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    TmpSock(dir.join("s.sock"))
}

fn run(args: &[&str]) -> Output {
    vhostd().args(args).output().expect("run vhostd")
}

fn assert_usage_error(args: &[&str], names: &str) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "args {args:?}: stderr {err}");
    assert!(err.contains(names), "args {args:?}: stderr should name {names}: {err}");
}

#[test]
fn bad_arguments_exit_2_and_name_the_argument() {
    let s = tmp_sock("bad");
    let sp = s.path().to_str().unwrap();
    assert_usage_error(&["net", "--backend", "sink"], "--socket-path");
    assert_usage_error(&["net", "--socket-path", sp, "--backend", "nope"], "--backend");
    assert_usage_error(&["net", "--socket-path", sp, "--backend", "sink", "--queue-size", "300"], "--queue-size");
    assert_usage_error(&["net", "--socket-path", sp, "--backend", "sink", "--queues", "0"], "--queues");
    assert_usage_error(&["net", "--socket-path", sp, "--backend", "sink", "--cpus", "4096"], "--cpus");
    assert_usage_error(&["net", "--socket-path", sp, "--backend", "sink", "--cpus", "1-0"], "--cpus");
    assert_usage_error(&["net", "--socket-path", sp, "--backend", "sink", "--mac", "02:00:00"], "--mac");
    assert_usage_error(&["net", "--socket-path", sp, "--backend", "sink", "--mac", "03:00:00:00:00:01"], "--mac");
    assert_usage_error(&["net", "--socket-path", sp, "--backend", "source", "--pkt-size", "10"], "--pkt-size");
    assert!(!s.path().exists(), "nothing half-configured left behind");
}

#[test]
fn unusable_socket_path_is_a_clear_error() {
    let out = run(&["net", "--socket-path", "/nonexistent-dir/x.sock", "--backend", "sink"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--socket-path /nonexistent-dir/x.sock"), "{err}");
}

/// Starts vhostd and waits (bounded) for its "listening" line.
fn start(sock: &Path, extra: &[&str]) -> Child {
    let mut child = vhostd()
        .args(["net", "--socket-path", sock.to_str().unwrap(), "--backend", "sink"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vhostd");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.starts_with("vhostd: listening on") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(10)).expect("vhostd did not start listening");
    child
}

fn terminate(child: Child) -> Output {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = child.wait_with_output().expect("wait");
    assert!(Instant::now() < deadline, "vhostd took too long to stop");
    out
}

#[test]
fn sigterm_stops_cleanly_removes_socket_and_prints_counters() {
    let s = tmp_sock("term");
    let child = start(s.path(), &[]);
    assert!(s.path().exists());
    let out = terminate(child);
    assert!(out.status.success(), "{out:?}");
    assert!(!s.path().exists(), "socket removed on exit");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("stats queue=0 dir=rx "), "{stdout}");
    assert!(stdout.contains("stats queue=1 dir=tx "), "{stdout}");
    assert!(stdout.contains("stats total guest_tx_packets=0 "), "{stdout}");
}

#[test]
fn a_live_socket_is_not_stolen_but_a_stale_one_is_replaced() {
    let s = tmp_sock("live");
    let first = start(s.path(), &[]);
    let out = run(&["net", "--socket-path", s.path().to_str().unwrap(), "--backend", "sink"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("another process is listening"));
    // SIGKILL leaves a stale socket file behind; the next start replaces it.
    let mut first = first;
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(s.path().exists());
    let second = start(s.path(), &[]);
    assert!(terminate(second).status.success());
}
