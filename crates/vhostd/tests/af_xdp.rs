//! The AF_XDP backend against the real kernel: each test makes a network
//! namespace with a veth pair, vhostd's sockets on one end (`vx0`) and a
//! packet socket on the peer (`vx1`) standing for the wire. The guest side
//! is the project's frontend. Covers frames both ways byte for byte in
//! native and skb mode, two queue pairs with start-queue, the program
//! detached on exit, the peer's link going down and up, sockets and maps
//! handed in (inhibit=on), and start-up errors.

mod common;

use common::*;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::Command;
use std::time::Duration;
use vhostd_user::{RxQueue, TxQueue};

const T: Duration = Duration::from_secs(20);

/// A namespace with veth pair vx0 <-> vx1 (both up, `queues` queues each).
fn veth_ns(queues: u32) -> NetNs {
    let ns = NetNs::new();
    let q = queues.to_string();
    ns.ip(&[
        "link",
        "add",
        "vx0",
        "numtxqueues",
        &q,
        "numrxqueues",
        &q,
        "type",
        "veth",
        "peer",
        "name",
        "vx1",
        "numtxqueues",
        &q,
        "numrxqueues",
        &q,
    ]);
    for i in ["vx0", "vx1"] {
        // No IPv6 chatter (router solicitations) on the test's wire.
        ns.ip(&["link", "set", i, "addrgenmode", "none"]);
        ns.ip(&["link", "set", i, "up"]);
    }
    ns
}

/// Whether `ifname` in `ns` has an XDP program attached.
fn has_xdp(ns: &NetNs, ifname: &str) -> bool {
    let out = Command::new("ip").args(["-n", &ns.name, "-d", "link", "show", ifname]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).contains("prog/xdp")
}

/// Sends `frames` from the guest's TX queue, waiting for room.
fn guest_send(tx: &mut TxQueue, frames: &[Vec<u8>]) {
    for (i, fr) in frames.iter().enumerate() {
        assert!(
            wait_until(T, || {
                tx.reclaim().unwrap();
                tx.send_frame(fr).unwrap()
            }),
            "guest TX ring stuck at frame {i}"
        );
        if i % 32 == 31 {
            tx.flush().unwrap();
        }
    }
    tx.flush().unwrap();
}

/// Test frames (EtherType 0x88b5) the guest receives, until `n` arrived or `T` passed.
fn guest_recv(rx: &mut RxQueue, n: usize) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    wait_until(T, || {
        got.extend(guest_recv_now(rx, ETH_P_TEST));
        got.len() >= n
    });
    got
}

/// The sequence numbers of test frames, for failure messages.
fn seqs(frames: &[Vec<u8>]) -> Vec<u32> {
    frames.iter().map(|f| f.get(14..18).map_or(u32::MAX, |b| u32::from_le_bytes(b.try_into().unwrap()))).collect()
}

/// Frames both ways through one queue pair, byte for byte and in order.
fn both_ways(mode: &str) {
    both_ways_with(mode, "")
}

fn both_ways_with(mode: &str, extra: &str) {
    let ns = veth_ns(1);
    let wire = Packet::open(&ns, "vx1", ETH_P_TEST, false);
    let backend = format!("af-xdp,ifname=vx0,mode={mode}{extra}");
    let d = Daemon::start_in(Some(&ns), &["--backend", &backend]);
    assert!(has_xdp(&ns, "vx0"), "vhostd attached its program");
    let mut dev = d.connect();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    assert_eq!(dev.read_net_config().unwrap().status & 1, 1, "vx0 is up: link up");

    // Guest to wire: sizes from the minimum to a full 1500-byte MTU frame.
    let n = 600u32;
    let sent: Vec<Vec<u8>> = (0..n).map(|s| frame(s, 60 + (s as usize * 41) % 1455)).collect();
    guest_send(&mut tx, &sent);
    for (i, want) in sent.iter().enumerate() {
        let got = wire.recv(T).unwrap_or_else(|| panic!("{mode}: the peer got only {i} of {n} frames"));
        assert_eq!(&got, want, "{mode}: frame {i} differs on the wire");
    }

    // Wire to guest, in bursts the 256-entry RX ring can absorb.
    let mut got = Vec::new();
    let sent: Vec<Vec<u8>> = (0..n).map(|s| frame(5000 + s, 60 + (s as usize * 53) % 1455)).collect();
    for chunk in sent.chunks(100) {
        for fr in chunk {
            wire.send(fr);
        }
        let want = got.len() + chunk.len();
        got.extend(guest_recv(&mut rx, chunk.len()));
        assert_eq!(got.len(), want, "{mode}: the guest got {} of {want} frames: {:?}", got.len(), seqs(&got));
    }
    assert_eq!(got, sent, "{mode}: frames from the wire differ in the guest");

    let s = d.stop();
    assert_eq!(s.total("guest_tx_packets"), n as u64);
    assert_eq!(s.total("guest_rx_packets"), n as u64);
    assert_eq!(s.total("bad_chains"), 0);
    assert!(!has_xdp(&ns, "vx0"), "{mode}: the program is detached after SIGTERM");
}

#[test]
fn frames_cross_both_ways_in_native_mode() {
    both_ways("native");
}

#[test]
fn frames_cross_both_ways_in_skb_mode() {
    both_ways("skb");
}

#[test]
fn frames_cross_both_ways_busy_polling_with_small_rings() {
    // Rings far smaller than the 600 frames each way: fill-ring frames and
    // TX frames must be recycled as the test goes (bursts of 100 fit the
    // 128-entry RX ring).
    both_ways_with("native", ",busy-poll=on,rx-ring=128,tx-ring=64");
}

#[test]
fn no_mode_tries_native_first_and_force_copy_binds_in_copy_mode() {
    let ns = veth_ns(1);
    let d = Daemon::start_in(Some(&ns), &["--backend", "af-xdp,ifname=vx0,force-copy=on"]);
    let out = Command::new("ip").args(["-n", &ns.name, "-d", "link", "show", "vx0"]).output().unwrap();
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    // veth has native XDP: `xdp` (driver), not `xdpgeneric`.
    assert!(out.contains("xdp ") || out.contains("xdp/id") || out.contains("prog/xdp id"), "{out}");
    assert!(!out.contains("xdpgeneric"), "native XDP tried first: {out}");
    let log = d.log();
    d.stop();
    assert!(log.contains("native (driver) XDP, copy mode"), "log says what was chosen: {log}");
}

#[test]
fn two_queue_pairs_from_start_queue() {
    // Three queues; vhostd takes 1 and 2. Queue 0 stays with the kernel.
    let ns = veth_ns(3);
    let wire = Packet::open(&ns, "vx1", ETH_P_TEST, false);
    let d = Daemon::start_in(
        Some(&ns),
        &["--backend", "af-xdp,ifname=vx0,mode=native,queues=2,start-queue=1", "--queues", "2"],
    );
    let mut dev = d.connect();
    let (mut rx0, mut tx0) = dev.net_queue_pair(0, 256).unwrap();
    let (mut rx1, mut tx1) = dev.net_queue_pair(1, 256).unwrap();
    // TX: each pair's frames reach the wire.
    let a: Vec<Vec<u8>> = (0..100).map(|s| frame(s, 100)).collect();
    let b: Vec<Vec<u8>> = (100..200).map(|s| frame(s, 200)).collect();
    guest_send(&mut tx0, &a);
    guest_send(&mut tx1, &b);
    let mut on_wire = Vec::new();
    while on_wire.len() < 200 {
        on_wire.push(wire.recv(T).unwrap_or_else(|| panic!("the wire got {} of 200", on_wire.len())));
    }
    on_wire.sort();
    let mut want: Vec<Vec<u8>> = a.iter().chain(&b).cloned().collect();
    want.sort();
    assert_eq!(on_wire, want);
    // RX: the peer spreads flows over vx0's queues by hash; frames on
    // queues 1 and 2 reach pairs 0 and 1, frames on queue 0 the kernel.
    // UDP flows (source ports) so the peer's flow hash spreads them.
    let ip_wire = Packet::open(&ns, "vx1", ETH_P_IP, false);
    let sent: Vec<Vec<u8>> = (0..300u16).map(|s| udp4_frame(10000 + s, 128, s as u32)).collect();
    for fr in &sent {
        ip_wire.send(fr);
    }
    let mut got0 = Vec::new();
    let mut got1 = Vec::new();
    let per_queue = |q: u32, what: &str| veth_queue_stat(&ns, q, what);
    // Done when XDP has seen all 300 and each pair holds what its queue redirected.
    let all_in = wait_until(T, || {
        got0.extend(guest_recv_now(&mut rx0, ETH_P_IP));
        got1.extend(guest_recv_now(&mut rx1, ETH_P_IP));
        (0..3).map(|q| per_queue(q, "xdp_packets")).sum::<u64>() == 300
            && got0.len() as u64 == per_queue(1, "xdp_redirect")
            && got1.len() as u64 == per_queue(2, "xdp_redirect")
    });
    assert!(
        all_in,
        "pair 0 got {} (queue 1 redirected {}), pair 1 got {} (queue 2 redirected {})",
        got0.len(),
        per_queue(1, "xdp_redirect"),
        got1.len(),
        per_queue(2, "xdp_redirect")
    );
    assert_eq!(per_queue(0, "xdp_redirect"), 0, "queue 0 has no socket: its frames go to the kernel");
    for f in got0.iter().chain(&got1) {
        assert!(sent.contains(f), "a frame the wire did not send");
    }
    assert!(!got0.is_empty() && !got1.is_empty(), "both pairs received ({} / {})", got0.len(), got1.len());
    let s = d.stop();
    assert_eq!(s.total("bad_chains"), 0);
}

/// Frames of EtherType `proto` waiting in the guest's RX ring now.
fn guest_recv_now(rx: &mut RxQueue, proto: u16) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    rx.recv_burst(256, |fr| {
        if fr.len() >= 14 && fr[12..14] == proto.to_be_bytes() {
            got.push(fr.to_vec())
        }
    })
    .unwrap();
    got
}

/// A per-queue XDP counter of vx0 (ethtool -S), e.g. (1, "xdp_redirect").
fn veth_queue_stat(ns: &NetNs, q: u32, what: &str) -> u64 {
    let out = Command::new("ip").args(["netns", "exec", &ns.name, "ethtool", "-S", "vx0"]).output().expect("ethtool");
    let key = format!("rx_queue_{q}_{what}:");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix(&key).map(|v| v.trim().parse().unwrap()))
        .unwrap_or_else(|| panic!("no {key} in ethtool -S vx0"))
}

#[test]
fn traffic_resumes_after_the_peer_link_goes_down_and_up() {
    let ns = veth_ns(1);
    let wire = Packet::open(&ns, "vx1", ETH_P_TEST, false);
    let d = Daemon::start_in(Some(&ns), &["--backend", "af-xdp,ifname=vx0"]);
    let mut dev = d.connect();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    guest_send(&mut tx, &[frame(1, 100)]);
    assert_eq!(wire.recv(T).unwrap(), frame(1, 100));

    ns.ip(&["link", "set", "vx1", "down"]);
    // The kernel reports the carrier change asynchronously (linkwatch).
    assert!(wait_until(T, || dev.read_net_config().unwrap().status & 1 == 0), "no carrier: link down");
    // Frames sent meanwhile are dropped by the kernel or wait on the TX
    // ring; either way vhostd takes them and goes on.
    let lost: Vec<Vec<u8>> = (0..50).map(|s| frame(100 + s, 100)).collect();
    guest_send(&mut tx, &lost);
    ns.ip(&["link", "set", "vx1", "up"]);
    assert!(wait_until(T, || dev.read_net_config().unwrap().status & 1 == 1), "link up again");
    let wire = Packet::open(&ns, "vx1", ETH_P_TEST, false);

    let again: Vec<Vec<u8>> = (0..100).map(|s| frame(1000 + s, 300)).collect();
    guest_send(&mut tx, &again);
    let mut i = 0;
    while i < again.len() {
        let got = wire.recv(T).unwrap_or_else(|| panic!("after up: {i} of 100 on the wire"));
        if got != again[i] {
            assert!(lost.contains(&got), "after up: frame {i} differs, and is not one sent while down");
            continue;
        }
        i += 1;
    }
    for fr in &again {
        wire.send(fr);
    }
    assert_eq!(guest_recv(&mut rx, 100), again, "after up: the guest receives again");
}

#[test]
fn the_program_is_detached_even_when_vhostd_is_killed() {
    let ns = veth_ns(1);
    let d = Daemon::start_in(Some(&ns), &["--backend", "af-xdp,ifname=vx0,mode=skb"]);
    assert!(has_xdp(&ns, "vx0"));
    // SAFETY: kill on the child's pid.
    unsafe { libc::kill(d.pid(), libc::SIGKILL) };
    assert!(wait_until(T, || !has_xdp(&ns, "vx0")), "the BPF link died with the process");
}

/// A privileged manager's work, done by the test: sockets, map, program.
/// Returns (socket fds, map fd, link fd), all inheritable.
fn manager_setup(ns: &NetNs, queues: u32, insert: bool) -> (Vec<OwnedFd>, OwnedFd, OwnedFd) {
    ns.run(move || {
        let map = xsk::bpf::XskMap::create(queues).unwrap();
        let prog = xsk::bpf::load_redirect_program(&map).unwrap();
        let link = xsk::bpf::attach(&prog, xsk::ifindex("vx0").unwrap(), xsk::bpf::XdpMode::Native).unwrap();
        let socks: Vec<OwnedFd> = (0..queues).map(|_| xsk::Xsk::socket().unwrap()).collect();
        if insert {
            for (i, s) in socks.iter().enumerate() {
                map.insert(i as u32, s.as_raw_fd()).unwrap();
            }
        }
        let all: Vec<OwnedFd> = socks.into_iter().chain([map.into_fd(), link]).collect();
        for fd in &all {
            // SAFETY: clearing FD_CLOEXEC on descriptors we own.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) };
        }
        let mut all = all;
        let link = all.pop().unwrap();
        let map = all.pop().unwrap();
        (all, map, link)
    })
}

fn echo_check(d: &Daemon, ns: &NetNs) {
    let wire = Packet::open(ns, "vx1", ETH_P_TEST, false);
    let mut dev = d.connect();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    guest_send(&mut tx, &[frame(3, 333)]);
    assert_eq!(wire.recv(T).expect("frame on the wire"), frame(3, 333));
    wire.send(&frame(4, 444));
    assert_eq!(guest_recv(&mut rx, 1), vec![frame(4, 444)]);
}

#[test]
fn inhibit_with_sockets_handed_in() {
    let ns = veth_ns(1);
    let (socks, _map, _link) = manager_setup(&ns, 1, true);
    let backend = format!("af-xdp,ifname=vx0,inhibit=on,sock-fds={}", socks[0].as_raw_fd());
    let d = Daemon::start_in(Some(&ns), &["--backend", &backend]);
    drop(socks);
    echo_check(&d, &ns);
}

#[test]
fn inhibit_with_a_map_handed_in() {
    let ns = veth_ns(1);
    let (socks, map, _link) = manager_setup(&ns, 1, false);
    drop(socks);
    let backend = format!("af-xdp,ifname=vx0,inhibit=on,xsks-map-fd={}", map.as_raw_fd());
    let d = Daemon::start_in(Some(&ns), &["--backend", &backend]);
    drop(map);
    echo_check(&d, &ns);
}

#[test]
fn bad_af_xdp_arguments_are_refused_before_anything_is_set_up() {
    let ns = veth_ns(1);
    let e = refused(Some(&ns), &["--backend", "af-xdp,ifname=nosuch0"], 1);
    assert!(e.contains("no interface 'nosuch0'"), "{e}");
    let e = refused(Some(&ns), &["--backend", "af-xdp,ifname=vx0,start-queue=1"], 1);
    assert!(e.contains("has 1 queue(s)"), "{e}");
    assert!(!has_xdp(&ns, "vx0"), "nothing attached after a refusal");
    let e = refused(Some(&ns), &["--backend", "af-xdp,ifname=vx0,inhibit=on,xsks-map-fd=77"], 1);
    assert!(e.contains("xsks-map-fd=77: not an open descriptor"), "{e}");
    let e = refused(Some(&ns), &["--backend", "af-xdp,ifname=vx0,inhibit=on,map-path=/sys/fs/bpf/vhostd-nosuch"], 1);
    assert!(e.contains("cannot open the pinned map"), "{e}");
    let e = refused(Some(&ns), &["--backend", "af-xdp,ifname=vx0,inhibit=on,sock-fds=0"], 1);
    assert!(e.contains("not an AF_XDP socket"), "{e}");
    let e = refused(Some(&ns), &["--backend", "af-xdp,ifname=vx0,queues=2"], 2);
    assert!(e.contains("--queues"), "{e}");
    let e = refused(Some(&ns), &["--backend", "af-xdp,ifname=vx0,sock-fds=3"], 2);
    assert!(e.contains("need inhibit=on"), "{e}");
    // Somebody else's program on the interface.
    let (_s, _m, _link) = manager_setup(&ns, 1, false);
    let e = refused(Some(&ns), &["--backend", "af-xdp,ifname=vx0"], 1);
    assert!(e.contains("already has an XDP program"), "{e}");
}

/// What /proc says of a process: (uid, effective capabilities).
fn uid_and_caps(pid: i32) -> (u32, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).unwrap().trim().to_string();
    let uid = field("Uid:").split_whitespace().nth(1).unwrap().parse().unwrap();
    let caps = u64::from_str_radix(&field("CapEff:"), 16).unwrap();
    (uid, caps)
}

#[test]
fn an_unprivileged_vhostd_moves_traffic_through_xdp_helper_sockets() {
    let ns = veth_ns(2);
    let vhostd = env!("CARGO_BIN_EXE_vhostd").to_string();
    let d = Daemon::start_with(Some(&ns), |sock| {
        [
            "xdp-helper",
            "--ifname",
            "vx0",
            "--queues",
            "2",
            "--",
            // nobody, no capabilities at all, none to regain.
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            &vhostd,
            "net",
            "--socket-path",
            &sock.display().to_string(),
            "--queues",
            "2",
            // Small rings: 2 x 2 MiB of UMEM fits the default 8 MiB
            // RLIMIT_MEMLOCK, which a helper without CAP_SYS_RESOURCE
            // cannot raise.
            "--backend",
            "af-xdp,ifname=vx0,queues=2,inhibit=on,sock-fds={sock-fds},rx-ring=256,tx-ring=256",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    });
    let (uid, caps) = uid_and_caps(d.pid());
    assert_eq!((uid, caps), (65534, 0), "vhostd runs as nobody with no capabilities");
    assert!(has_xdp(&ns, "vx0"), "the helper's program is attached");
    let wire = Packet::open(&ns, "vx1", ETH_P_TEST, false);
    let mut dev = d.connect();
    let (mut rx0, mut tx0) = dev.net_queue_pair(0, 64).unwrap();
    let (mut rx1, mut tx1) = dev.net_queue_pair(1, 64).unwrap();
    guest_send(&mut tx0, &[frame(8, 88)]);
    assert_eq!(wire.recv(T).expect("pair 0 to the wire"), frame(8, 88));
    guest_send(&mut tx1, &[frame(9, 99)]);
    assert_eq!(wire.recv(T).expect("pair 1 to the wire"), frame(9, 99));
    // The wire's frames land on whichever queue the peer's hash picks.
    wire.send(&frame(10, 100));
    let mut got = Vec::new();
    wait_until(T, || {
        for rx in [&mut rx0, &mut rx1] {
            got.extend(guest_recv_now(rx, ETH_P_TEST));
        }
        !got.is_empty()
    });
    assert_eq!(got, vec![frame(10, 100)], "the wire's frame reached the guest");
    let s = d.stop();
    assert_eq!(s.total("guest_tx_packets"), 2);
    assert!(wait_until(T, || !has_xdp(&ns, "vx0")), "the program went with vhostd");
}
