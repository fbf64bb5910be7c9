//! The TAP backend against the real kernel: vhostd runs in a network
//! namespace the test creates, its TAP lives there, and the host side is a
//! packet socket on that TAP. The guest side is the project's frontend.
//! Covers frames both ways, checksum/segmentation offloads (a 64 KiB TCP
//! segment crossing as one frame, and split by the kernel when the guest
//! does not accept it), two queue pairs on a multi-queue TAP with an
//! inactive pair detached, link state in the config space, adopted
//! descriptors, and start-up errors.

mod common;

use common::*;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;
use vhostd_user::features as f;
use vhostd_user::VirtioUser;

const T: Duration = Duration::from_secs(20);

/// A TAP name unique to this test process.
fn tap_name(tag: &str) -> String {
    format!("vt{}{tag}", std::process::id() % 100000)
}

/// A TAP-backed vhostd in a fresh namespace, TAP up.
fn tap_daemon(tag: &str, extra: &[&str]) -> (NetNs, String, Daemon) {
    let ns = NetNs::new();
    let tap = tap_name(tag);
    let backend = format!("tap,ifname={tap}");
    let mut args = vec!["--backend", backend.as_str()];
    args.extend_from_slice(extra);
    let d = Daemon::start_in(Some(&ns), &args);
    ns.ip(&["link", "set", &tap, "up"]);
    (ns, tap, d)
}

/// A TCP/IPv4 frame with `payload` bytes, as a TSO sender hands it down:
/// one large segment, the TCP checksum left to whoever segments it.
fn tcp4_segment(dst: [u8; 6], src: [u8; 6], payload: usize) -> Vec<u8> {
    let len = 14 + 20 + 20 + payload;
    let mut f = vec![0u8; len];
    f[0..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
    f[14] = 0x45;
    f[16..18].copy_from_slice(&((20 + 20 + payload) as u16).to_be_bytes());
    f[20] = 0x40; // DF
    f[22] = 64;
    f[23] = 6;
    f[26..30].copy_from_slice(&[10, 99, 4, 2]);
    f[30..34].copy_from_slice(&[10, 99, 4, 1]);
    let csum = ip_checksum(&f[14..34]);
    f[24..26].copy_from_slice(&csum.to_be_bytes());
    f[34..36].copy_from_slice(&40000u16.to_be_bytes());
    f[36..38].copy_from_slice(&5001u16.to_be_bytes());
    f[46] = 5 << 4;
    f[47] = 0x18; // PSH, ACK
    f[48..50].copy_from_slice(&65535u16.to_be_bytes());
    for (i, b) in f[54..].iter_mut().enumerate() {
        *b = (i * 13) as u8;
    }
    f
}

/// virtio_net_hdr asking for TCPv4 segmentation of `tcp4_segment` frames.
const TSO4_HDR: [u8; 10] = [
    1, // NEEDS_CSUM
    1, // GSO_TCPV4
    54, 0, // hdr_len
    0xa8, 0x05, // gso_size 1448
    34, 0, // csum_start
    16, 0, // csum_offset
];

#[test]
fn frames_cross_the_tap_both_ways_in_order() {
    let (ns, tap, d) = tap_daemon("a", &[]);
    let host = Packet::open(&ns, &tap, ETH_P_TEST, false);
    let mut dev = d.connect();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    // Guest to host.
    let total = 500u32;
    let mut sent = Vec::new();
    for seq in 0..total {
        let fr = frame(seq, 60 + (seq as usize * 37) % 1455);
        assert!(wait_until(T, || {
            tx.reclaim().unwrap();
            tx.send_frame(&fr).unwrap()
        }));
        tx.flush().unwrap();
        sent.push(fr);
    }
    for (i, want) in sent.iter().enumerate() {
        let got = host.recv(T).unwrap_or_else(|| panic!("host got only {i} of {total} frames"));
        assert_eq!(&got, want, "frame {i} differs on the host side");
    }
    // Host to guest (broadcast, so the guest side accepts it whatever its MAC).
    let mut got = Vec::new();
    for seq in 0..total {
        host.send(&frame(1000 + seq, 60 + (seq as usize * 53) % 1455));
        if seq % 64 == 63 {
            // Stay within the TAP's queue: let the guest catch up.
            assert!(wait_until(T, || {
                rx.recv_burst(256, |fr| {
                    if fr[12..14] == ETH_P_TEST.to_be_bytes() {
                        got.push(fr.to_vec())
                    }
                })
                .unwrap();
                got.len() as u32 > seq
            }));
        }
    }
    assert!(wait_until(T, || {
        rx.recv_burst(256, |fr| {
            if fr[12..14] == ETH_P_TEST.to_be_bytes() {
                got.push(fr.to_vec())
            }
        })
        .unwrap();
        got.len() as u32 >= total
    }));
    for (i, fr) in got.iter().enumerate() {
        let seq = 1000 + i as u32;
        assert_eq!(fr, &frame(seq, 60 + (i * 53) % 1455), "frame {i} differs on the guest side");
    }
    assert_eq!(rx.stats.bad, 0);
    let rx_packets = ns.counter(&tap, "rx_packets");
    assert!(rx_packets >= total as u64, "TAP counted {rx_packets} frames from the guest");
    drop(dev);
    let s = d.stop();
    assert_eq!(s.queue(1, "packets"), total as u64);
    assert!(s.queue(0, "packets") >= total as u64);
    assert_eq!(s.total("bad_chains"), 0);
    assert_eq!(s.queue(1, "dropped"), 0);
}

#[test]
fn send_rarp_puts_the_announcement_on_the_wire() {
    // What QEMU sends after a live migration for a guest without
    // GUEST_ANNOUNCE: vhostd must put a RARP from the guest's MAC on the wire.
    let (ns, tap, d) = tap_daemon("r", &[]);
    let host = Packet::open(&ns, &tap, 0x8035, false);
    let sock = std::os::unix::net::UnixStream::connect(&d.sock).unwrap();
    let raw = sock.try_clone().unwrap();
    let mut opts = d.options();
    opts.protocol_features |= vhostd_user::VhostUserProtocolFeatures::RARP;
    let mut dev = VirtioUser::from_stream(sock, opts).unwrap();
    assert!(dev.protocol_features().contains(vhostd_user::VhostUserProtocolFeatures::RARP));
    let (_rx, _tx) = dev.net_queue_pair(0, 256).unwrap();
    let mac = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
    let mut body = mac.to_vec();
    body.extend_from_slice(&[0, 0]);
    // SEND_RARP (19), no reply asked: QEMU's vhost_user_migration_done.
    let msg = vhost_user_msg(19, 0, &body);
    assert_eq!(send_with_fds(&raw, &msg, &[]).unwrap(), msg.len());
    let got = host.recv(T).expect("no RARP frame on the TAP");
    let mut want = vec![0xff; 6];
    want.extend_from_slice(&mac);
    want.extend_from_slice(&[0x80, 0x35, 0, 1, 8, 0, 6, 4, 0, 3]);
    want.extend_from_slice(&mac);
    want.extend_from_slice(&[0; 4]);
    want.extend_from_slice(&mac);
    want.extend_from_slice(&[0; 4]);
    want.resize(60, 0);
    assert_eq!(got, want);
    // Once: nothing more follows.
    assert_eq!(host.recv(Duration::from_millis(200)), None);
    drop(dev);
    d.stop();
}

/// Connects with TSO negotiated (if offered) and buffers big enough for a
/// 64 KiB frame in one descriptor.
fn connect_tso(d: &Daemon) -> VirtioUser {
    let mut opts = d.options();
    opts.features |= f::NET_CSUM | f::NET_GUEST_CSUM | f::NET_HOST_TSO4 | f::NET_GUEST_TSO4;
    opts.buf_size = 66000;
    VirtioUser::connect(opts).unwrap()
}

#[test]
fn a_64k_tcp_segment_crosses_as_one_frame_each_way_with_offloads() {
    let (ns, tap, d) = tap_daemon("b", &[]);
    let mut dev = connect_tso(&d);
    let tso = f::NET_CSUM | f::NET_GUEST_CSUM | f::NET_HOST_TSO4 | f::NET_GUEST_TSO4;
    assert_eq!(dev.features() & tso, tso, "TAP backend offers TSO");
    let (mut rx, mut tx) = dev.net_queue_pair(0, 16).unwrap();
    let host = Packet::open(&ns, &tap, ETH_P_IP, false);
    // Guest to host: the kernel takes the segment whole (as GSO).
    let seg = tcp4_segment([0x02, 0, 0, 0, 0, 0x09], GUEST_MAC, 64000);
    assert!(tx.send_frame_with_header(&TSO4_HDR, &seg).unwrap());
    tx.flush().unwrap();
    let got = host.recv(T).expect("host received the segment");
    assert_eq!(got.len(), seg.len(), "one frame of {} bytes, not segments", seg.len());
    assert_eq!(got[54..], seg[54..]);
    // Host to guest: a GSO frame into the TAP reaches the guest whole, with
    // the segmentation request in its header.
    let host_v = Packet::open(&ns, &tap, ETH_P_IP, true);
    let seg = tcp4_segment(GUEST_MAC, [0x02, 0, 0, 0, 0, 0x09], 60000);
    let mut pkt = TSO4_HDR.to_vec();
    pkt.extend_from_slice(&seg);
    host_v.send(&pkt);
    let mut frames = Vec::new();
    assert!(wait_until(T, || {
        rx.recv_burst_with_header(16, |h, fr| {
            if fr[12..14] == ETH_P_IP.to_be_bytes() {
                frames.push((h.to_vec(), fr.to_vec()))
            }
        })
        .unwrap();
        !frames.is_empty()
    }));
    let (h, fr) = &frames[0];
    assert_eq!(fr.len(), seg.len(), "the guest got the segment whole");
    assert_eq!(fr[54..], seg[54..]);
    assert_eq!(h[1], 1, "gso_type TCPV4 in the guest's header");
    assert_eq!(u16::from_le_bytes([h[4], h[5]]), 1448, "gso_size");
    assert_eq!(h[0] & 1, 1, "NEEDS_CSUM");
    drop(dev);
    let s = d.stop();
    assert_eq!(s.total("bad_chains"), 0);
    assert_eq!(s.total("dropped"), 0);
}

#[test]
fn without_offloads_the_kernel_segments_for_the_guest() {
    // offloads=off: nothing offered, so a GSO frame into the TAP reaches
    // the guest as ordinary frames.
    let ns = NetNs::new();
    let tap = tap_name("c");
    let backend = format!("tap,ifname={tap},offloads=off");
    let d = Daemon::start_in(Some(&ns), &["--backend", &backend]);
    ns.ip(&["link", "set", &tap, "up"]);
    let mut dev = connect_tso(&d);
    assert_eq!(dev.features() & (f::NET_CSUM | f::NET_GUEST_CSUM | f::NET_GUEST_TSO4), 0);
    let (mut rx, _tx) = dev.net_queue_pair(0, 64).unwrap();
    let host_v = Packet::open(&ns, &tap, ETH_P_IP, true);
    let seg = tcp4_segment(GUEST_MAC, [0x02, 0, 0, 0, 0, 0x09], 14480);
    let mut pkt = TSO4_HDR.to_vec();
    pkt.extend_from_slice(&seg);
    host_v.send(&pkt);
    let mut frames = Vec::new();
    assert!(wait_until(T, || {
        rx.recv_burst_with_header(64, |h, fr| {
            if fr[12..14] == ETH_P_IP.to_be_bytes() {
                frames.push((h.to_vec(), fr.len()))
            }
        })
        .unwrap();
        frames.len() >= 10
    }));
    assert_eq!(frames.len(), 10, "14480 bytes in 1448-byte segments");
    for (h, len) in &frames {
        assert_eq!(*len, 54 + 1448);
        assert_eq!(h[..10], [0; 10], "a plain header for a guest without offloads");
    }
}

#[test]
fn two_queue_pairs_share_the_flows_and_an_inactive_pair_is_detached() {
    let (ns, tap, d) = tap_daemon("d", &["--queues", "2"]);
    let host = Packet::open(&ns, &tap, ETH_P_TEST, false);
    let mut opts = d.options();
    opts.features |= f::NET_CTRL_VQ;
    let mut dev = VirtioUser::connect(opts).unwrap();
    let (mut rx0, mut tx0) = dev.net_queue_pair(0, 256).unwrap();
    let (mut rx1, mut tx1) = dev.net_queue_pair(1, 256).unwrap();
    let mut ctrl = dev.create_queue(4, 16, None).unwrap();
    dev.start_queue(&ctrl).unwrap();
    assert_eq!(set_pairs(&mut dev, &mut ctrl, 2), 0);
    // Guest to host on both pairs.
    for (i, tx) in [&mut tx0, &mut tx1].into_iter().enumerate() {
        for k in 0..50 {
            assert!(tx.send_frame(&frame(i as u32 * 100 + k, 100)).unwrap());
        }
        tx.flush().unwrap();
    }
    let mut seen = 0;
    while seen < 100 {
        host.recv(T).unwrap_or_else(|| panic!("host got {seen} of 100 frames"));
        seen += 1;
    }
    // Host to guest: 64 UDP flows; the TAP spreads them over both queues.
    let host_ip = Packet::open(&ns, &tap, ETH_P_IP, false);
    let udp = |rx: &mut vhostd_user::RxQueue| {
        let mut n = 0;
        rx.recv_burst(256, |fr| n += (fr[12..14] == ETH_P_IP.to_be_bytes() && fr[23] == 17) as usize).unwrap();
        n
    };
    let round = |rx0: &mut vhostd_user::RxQueue, rx1: &mut vhostd_user::RxQueue| -> (usize, usize) {
        for flow in 0..64u16 {
            host_ip.send(&udp4_frame(10000 + flow * 7, 200, flow as u32));
        }
        let (mut a, mut b) = (0, 0);
        wait_until(Duration::from_secs(5), || {
            a += udp(rx0);
            b += udp(rx1);
            a + b >= 64
        });
        (a, b)
    };
    let (a, b) = round(&mut rx0, &mut rx1);
    assert_eq!(a + b, 64, "every frame arrived");
    assert!(a > 0 && b > 0, "flows spread over both queues: {a} and {b}");
    // One pair only: the TAP stops steering frames to queue 1.
    assert_eq!(set_pairs(&mut dev, &mut ctrl, 1), 0);
    let mut last = (0, 0);
    assert!(
        wait_until(T, || {
            last = round(&mut rx0, &mut rx1);
            last == (64, 0)
        }),
        "after VQ_PAIRS_SET 1, frames still reached pair 1 or were lost: {last:?}"
    );
    drop(dev);
    let s = d.stop();
    assert!(s.queue(1, "packets") >= 50 && s.queue(3, "packets") >= 50);
    assert!(s.queue(0, "packets") > 0 && s.queue(2, "packets") > 0);
    assert_eq!(s.total("bad_chains"), 0);
}

#[test]
fn the_config_space_link_state_follows_the_tap() {
    let ns = NetNs::new();
    let tap = tap_name("e");
    let backend = format!("tap,ifname={tap}");
    let d = Daemon::start_in(Some(&ns), &["--backend", &backend]);
    let mut dev = d.connect();
    assert_eq!(dev.read_net_config().unwrap().status & 1, 0, "a new TAP is down");
    ns.ip(&["link", "set", &tap, "up"]);
    assert_eq!(dev.read_net_config().unwrap().status & 1, 1, "up");
    ns.ip(&["link", "set", &tap, "down"]);
    assert_eq!(dev.read_net_config().unwrap().status & 1, 0, "down again");
}

/// Opens a TAP queue in `ns` the way a privileged manager would; the
/// descriptor is inheritable (no CLOEXEC).
fn open_tap_fd(ns: &NetNs, name: &str, flags: libc::c_int) -> OwnedFd {
    let name = name.to_string();
    let fd = ns.run(move || {
        // SAFETY: open + TUNSETIFF with a zeroed, named ifreq-sized buffer.
        unsafe {
            let fd = libc::open(c"/dev/net/tun".as_ptr(), libc::O_RDWR);
            assert!(fd >= 0);
            let mut ifr = [0u8; 40];
            ifr[..name.len()].copy_from_slice(name.as_bytes());
            ifr[16..18].copy_from_slice(&(flags as u16).to_ne_bytes());
            assert_eq!(libc::ioctl(fd, libc::TUNSETIFF, ifr.as_mut_ptr()), 0, "TUNSETIFF");
            fd
        }
    });
    // SAFETY: a new descriptor owned by nothing else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

#[test]
fn adopted_tap_descriptors_carry_traffic() {
    let ns = NetNs::new();
    let tap = tap_name("f");
    let fd = open_tap_fd(&ns, &tap, libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR);
    let backend = format!("tap,fd={}", fd.as_raw_fd());
    // The child inherits the descriptor; ours closes after the spawn.
    let d = Daemon::start_in(Some(&ns), &["--backend", &backend]);
    drop(fd);
    ns.ip(&["link", "set", &tap, "up"]);
    let host = Packet::open(&ns, &tap, ETH_P_TEST, false);
    let mut dev = d.connect();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 64).unwrap();
    assert!(tx.send_frame(&frame(7, 300)).unwrap());
    tx.flush().unwrap();
    assert_eq!(host.recv(T).expect("frame from the guest"), frame(7, 300));
    host.send(&frame(8, 400));
    let mut got = None;
    assert!(wait_until(T, || {
        rx.recv_burst(64, |fr| {
            if fr[12..14] == ETH_P_TEST.to_be_bytes() {
                got = Some(fr.to_vec())
            }
        })
        .unwrap();
        got.is_some()
    }));
    assert_eq!(got.unwrap(), frame(8, 400));
    assert!(dev.offered_features() & f::NET_CSUM != 0, "offloads with an IFF_VNET_HDR descriptor");
}

#[test]
fn bad_tap_arguments_are_refused_before_anything_is_set_up() {
    let ns = NetNs::new();
    // Not open.
    let e = refused(Some(&ns), &["--backend", "tap,fd=987"], 1);
    assert!(e.contains("tap,fd=987") && e.contains("not open"), "{e}");
    // Not a TAP.
    let file = std::fs::File::open("/proc/self/stat").unwrap();
    let fd: RawFd = file.as_raw_fd();
    clear_cloexec(fd);
    let e = refused(Some(&ns), &["--backend", &format!("tap,fd={fd}")], 1);
    assert!(e.contains("not an attached TAP queue"), "{e}");
    // A TUN (layer 3) device.
    let tun = open_tap_fd(&ns, &tap_name("g"), libc::IFF_TUN | libc::IFF_NO_PI);
    let e = refused(Some(&ns), &["--backend", &format!("tap,fd={}", tun.as_raw_fd())], 1);
    assert!(e.contains("TUN (layer 3)"), "{e}");
    // One descriptor per queue pair.
    let e = refused(Some(&ns), &["--backend", "tap,fd=3:4:5", "--queues", "2"], 2);
    assert!(e.contains("3 descriptor(s) for --queues 2"), "{e}");
    // An interface that is not a TAP.
    let e = refused(Some(&ns), &["--backend", "tap,ifname=lo"], 1);
    assert!(e.contains("lo exists but is not a single-queue TAP"), "{e}");
    // A single-queue TAP another vhostd holds.
    let tap = tap_name("h");
    let backend = format!("tap,ifname={tap}");
    let _first = Daemon::start_in(Some(&ns), &["--backend", &backend]);
    let e = refused(Some(&ns), &["--backend", &backend], 1);
    assert!(e.contains("busy"), "{e}");
    // The same TAP asked for as multi-queue.
    let e = refused(Some(&ns), &["--backend", &backend, "--queues", "2"], 1);
    assert!(e.contains("not a multi-queue TAP"), "{e}");
    // Syntax errors exit 2 naming the argument.
    let e = refused(None, &["--backend", "tap"], 2);
    assert!(e.contains("--backend") && e.contains("ifname"), "{e}");
}

fn clear_cloexec(fd: RawFd) {
    // SAFETY: fcntl on an open descriptor of ours.
    unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
}
