//! Shared helpers: start vhostd as a user would, connect the project's
//! frontend to it, parse its counters. Everything is torn down on drop.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vhostd_user::{Options, VirtioUser};

/// A running vhostd with its own socket directory.
pub struct Daemon {
    child: Option<Child>,
    dir: PathBuf,
    pub sock: PathBuf,
}

impl Daemon {
    /// Starts `vhostd net --socket-path <tmp> <args>` and waits (bounded)
    /// until it listens.
    pub fn start(args: &[&str]) -> Daemon {
        Daemon::start_in(None, args)
    }

    /// As `start`, with vhostd in network namespace `netns` (if given).
    pub fn start_in(netns: Option<&NetNs>, args: &[&str]) -> Daemon {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vhostd-it-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("net.sock");
        let mut cmd = vhostd_in(netns);
        let mut child = cmd
            .arg("net")
            .arg("--socket-path")
            .arg(&sock)
            .args(args)
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
                if std::env::var_os("VHOSTD_TEST_VERBOSE").is_some() {
                    eprintln!("[vhostd] {line}");
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("vhostd did not start listening");
        Daemon { child: Some(child), dir, sock }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    /// Frontend options for this daemon's socket.
    pub fn options(&self) -> Options {
        Options::new(&self.sock)
    }

    /// Connects the project's frontend with default options.
    pub fn connect(&self) -> VirtioUser {
        VirtioUser::connect(self.options()).expect("connect frontend")
    }

    /// SIGTERM, wait (bounded), and return the parsed counters.
    pub fn stop(mut self) -> Stats {
        let mut child = self.child.take().unwrap();
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "vhostd exited with {status}");
                break;
            }
            assert!(Instant::now() < deadline, "vhostd did not stop within 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut out = String::new();
        child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        assert!(!self.sock.exists(), "socket removed on exit");
        Stats::parse(&out)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// vhostd's exit counters: `stats queue=N dir=.. k=v..` and `stats total k=v..`.
#[derive(Debug, Default)]
pub struct Stats {
    pub queues: HashMap<usize, HashMap<String, String>>,
    pub total: HashMap<String, String>,
}

impl Stats {
    pub fn parse(out: &str) -> Stats {
        let mut s = Stats::default();
        for line in out.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("stats") {
                continue;
            }
            let rest: Vec<&str> = words.collect();
            let kv: HashMap<String, String> = rest
                .iter()
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            if rest.first() == Some(&"total") {
                s.total = kv;
            } else if let Some(q) = kv.get("queue").and_then(|q| q.parse().ok()) {
                s.queues.insert(q, kv);
            }
        }
        assert!(!s.total.is_empty(), "no total line in vhostd output: {out}");
        s
    }

    pub fn total(&self, k: &str) -> u64 {
        self.total.get(k).unwrap_or_else(|| panic!("no total {k}")).parse().unwrap()
    }

    pub fn queue(&self, q: usize, k: &str) -> u64 {
        self.queues
            .get(&q)
            .and_then(|m| m.get(k))
            .unwrap_or_else(|| panic!("no queue {q} {k}"))
            .parse()
            .unwrap()
    }
}

/// A `vhostd` command that runs in `netns` (if given).
pub fn vhostd_in(netns: Option<&NetNs>) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vhostd"));
    if let Some(ns) = netns {
        let f = std::fs::File::open(ns.path()).expect("open netns");
        // SAFETY: between fork and exec the closure only calls setns(2) on
        // a descriptor opened before the fork (async-signal-safe).
        unsafe {
            cmd.pre_exec(move || {
                use std::os::fd::AsRawFd;
                if libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd
}

/// A network namespace of the test's own (removed on drop, with every
/// interface in it).
pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new() -> NetNs {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("vhd-it-{}-{n}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).stderr(Stdio::null()).status();
        let ok = Command::new("ip").args(["netns", "add", &name]).status().expect("run ip");
        assert!(ok.success(), "ip netns add {name} (tests need root)");
        let ns = NetNs { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// `ip -n NS ARGS...`, which must succeed.
    pub fn ip(&self, args: &[&str]) {
        let out = Command::new("ip").arg("-n").arg(&self.name).args(args).output().expect("run ip");
        assert!(out.status.success(), "ip -n {} {args:?}: {}", self.name, String::from_utf8_lossy(&out.stderr));
    }

    /// Runs `f` on a thread inside the namespace: sockets and TAPs it
    /// creates belong to the namespace.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let file = std::fs::File::open(self.path()).expect("open netns");
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: setns on this (new, short-lived) thread only.
            assert_eq!(unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
            f()
        })
        .join()
        .expect("thread in netns")
    }

    /// An interface counter, e.g. ("vtap0", "rx_packets").
    pub fn counter(&self, ifname: &str, what: &str) -> u64 {
        // `ip netns exec` mounts the namespace's own /sys.
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "cat"])
            .arg(format!("/sys/class/net/{ifname}/statistics/{what}"))
            .output()
            .expect("run ip netns exec");
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or_else(|_| panic!("no {what} of {ifname}"))
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// Polls `f` until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    f()
}

/// A raw vhost-user request on a stream (for messages the `vhost` crate's
/// frontend does not send). Returns the reply payload if one is expected.
pub fn raw_request(s: &mut UnixStream, code: u32, flags: u32, body: &[u8], reply: bool) -> Option<Vec<u8>> {
    let mut msg = Vec::new();
    msg.extend_from_slice(&code.to_le_bytes());
    msg.extend_from_slice(&(0x1 | flags).to_le_bytes());
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(body);
    s.write_all(&msg).unwrap();
    if !reply {
        return None;
    }
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hdr = [0u8; 12];
    s.read_exact(&mut hdr).unwrap();
    let code_back = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
    assert_eq!(code_back, code, "reply to the request we sent");
    let size = u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize;
    let mut payload = vec![0u8; size];
    s.read_exact(&mut payload).unwrap();
    Some(payload)
}

/// A unique frame: broadcast Ethernet, EtherType 0x88B5, `len` bytes, payload
/// derived from `seq`.
pub fn frame(seq: u32, len: usize) -> Vec<u8> {
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x99]);
    f[12..14].copy_from_slice(&[0x88, 0xb5]);
    for (i, b) in f[14..].iter_mut().enumerate() {
        *b = (seq as usize * 7 + i) as u8;
    }
    if len >= 18 {
        f[14..18].copy_from_slice(&seq.to_le_bytes());
    }
    f
}

pub fn sock_path(d: &Daemon) -> &Path {
    &d.sock
}
