//! vhostd's virtio-net device driven through the project's own vhost-user
//! frontend (`vhostd-user`): traffic through each backend, both dataplane
//! modes, mergeable and plain RX buffers, several queue pairs, the control
//! queue, reconnects, ring state hand-back, and hostile rings.

mod common;

use common::*;
use std::os::unix::net::UnixStream;
use std::time::Duration;
use vhostd_user::features as f;
use vhostd_user::{Descriptor, PackedDesc, PackedDriver, RxQueue, TxQueue, VhostUserProtocolFeatures, VirtioUser};

const T: Duration = Duration::from_secs(20);

/// Sends `total` distinct frames of varying sizes and checks that exactly
/// those come back, in order, byte for byte.
fn roundtrip(rx: &mut RxQueue, tx: &mut TxQueue, total: u32, first_seq: u32) {
    let mut sent = Vec::new();
    let mut got: Vec<Vec<u8>> = Vec::new();
    let mut seq = 0u32;
    let ok = wait_until(T, || {
        tx.reclaim().unwrap();
        // Keep fewer frames in flight than the RX ring holds, so the
        // loopback never has to drop one for lack of a guest buffer.
        let mut burst = 0;
        while seq < total && burst < 32 && sent.len() - got.len() < 96 {
            let len = 60 + ((first_seq + seq) as usize * 37) % (tx.max_frame().min(1514) - 59);
            let fr = frame(first_seq + seq, len);
            if !tx.send_frame(&fr).unwrap() {
                break;
            }
            sent.push(fr);
            seq += 1;
            burst += 1;
        }
        if burst > 0 {
            tx.flush().unwrap();
        }
        rx.recv_burst(64, |fr| got.push(fr.to_vec())).unwrap();
        got.len() as u32 >= total
    });
    assert!(ok, "only {} of {total} frames came back", got.len());
    assert_eq!(got.len(), sent.len());
    for (i, (a, b)) in sent.iter().zip(&got).enumerate() {
        assert_eq!(a, b, "frame {i} differs");
    }
    assert_eq!(rx.stats.bad, 0);
}

fn loopback_case(args: &[&str], mrg: bool) {
    loopback_with(args, |o| {
        if !mrg {
            o.features &= !f::NET_MRG_RXBUF;
        }
    });
}

fn loopback_with(args: &[&str], edit: impl FnOnce(&mut vhostd_user::Options)) {
    let mut all = vec!["--backend", "loopback"];
    all.extend_from_slice(args);
    let d = Daemon::start(&all);
    let mut opts = d.options();
    edit(&mut opts);
    let wanted = opts.features;
    let mut dev = VirtioUser::connect(opts).unwrap();
    assert_eq!(dev.features() & !f::PROTOCOL_FEATURES, wanted & !f::NET_CTRL_VQ & dev.offered_features());
    let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    roundtrip(&mut rx, &mut tx, 3000, 0);
    drop((rx, tx));
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.total("guest_tx_packets"), 3000);
    assert_eq!(s.total("guest_rx_packets"), 3000);
    assert_eq!(s.total("dropped"), 0);
    assert_eq!(s.total("bad_chains"), 0);
    assert_eq!(s.queue(1, "packets"), 3000);
}

#[test]
fn loopback_interrupt_mode_mergeable() {
    loopback_case(&[], true);
}

#[test]
fn loopback_interrupt_mode_without_mergeable() {
    loopback_case(&[], false);
}

#[test]
fn loopback_legacy_header_without_version_1() {
    // Neither VERSION_1 nor MRG_RXBUF: the 10-byte header without num_buffers.
    loopback_with(&[], |o| {
        o.required = 0;
        o.features &= !(f::VERSION_1 | f::NET_MRG_RXBUF);
    });
}

#[test]
fn loopback_poll_mode() {
    loopback_case(&["--poll"], true);
}

#[test]
fn sink_counts_every_frame_exactly() {
    let d = Daemon::start(&["--backend", "sink"]);
    let mut dev = d.connect();
    let (_rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
    let total = 10_000u32;
    let mut seq = 0;
    assert!(wait_until(T, || {
        tx.reclaim().unwrap();
        let mut n = 0;
        while seq < total && tx.send_frame(&frame(seq, 64)).unwrap() {
            seq += 1;
            n += 1;
        }
        if n > 0 {
            tx.flush().unwrap();
        }
        tx.stats.packets == total as u64
    }));
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.total("guest_tx_packets"), total as u64);
    assert_eq!(s.total("guest_tx_bytes"), total as u64 * 64);
    assert_eq!(s.total("guest_rx_packets"), 0);
}

#[test]
fn source_fills_rx_with_frames_of_the_requested_size() {
    let d = Daemon::start(&["--backend", "source", "--pkt-size", "200", "--mac", "02:aa:bb:cc:dd:ee"]);
    let mut dev = d.connect();
    let (mut rx, _tx) = dev.net_queue_pair(0, 256).unwrap();
    let mut frames = 0u64;
    assert!(wait_until(T, || {
        rx.recv_burst(64, |fr| {
            assert_eq!(fr.len(), 200);
            assert_eq!(&fr[0..6], &[0xff; 6]);
            assert_eq!(&fr[6..12], &[0x02, 0xaa, 0xbb, 0xcc, 0xdd, 0xee]);
            assert_eq!(&fr[12..14], &[0x88, 0xb5]);
            frames += 1;
        })
        .unwrap();
        frames >= 5000
    }));
    dev.disconnect().unwrap();
    let s = d.stop();
    assert!(s.total("guest_rx_packets") >= frames);
    assert_eq!(s.total("guest_tx_packets"), 0);
}

#[test]
fn mergeable_rx_spreads_a_frame_over_several_buffers() {
    // 1000-byte frames into 256-byte buffers: 5 buffers each, num_buffers set.
    let d = Daemon::start(&["--backend", "source", "--pkt-size", "1000"]);
    let mut opts = d.options();
    opts.buf_size = 256;
    let mut dev = VirtioUser::connect(opts).unwrap();
    let (mut rx, _tx) = dev.net_queue_pair(0, 256).unwrap();
    let mut frames = 0;
    assert!(wait_until(T, || {
        rx.recv_burst(64, |fr| {
            assert_eq!(fr.len(), 1000);
            assert_eq!(&fr[12..14], &[0x88, 0xb5]);
            // The source's payload is a counter pattern: check it survived
            // being split across buffers.
            for w in fr[14..].windows(2) {
                assert_eq!(w[1], w[0].wrapping_add(1));
            }
            frames += 1;
        })
        .unwrap();
        frames >= 500
    }));
    assert_eq!(rx.stats.bad, 0);
}

#[test]
fn without_mergeable_a_frame_too_big_for_the_buffer_is_dropped_and_counted() {
    let d = Daemon::start(&["--backend", "source", "--pkt-size", "1000"]);
    let mut opts = d.options();
    opts.buf_size = 256;
    opts.features &= !f::NET_MRG_RXBUF;
    let mut dev = VirtioUser::connect(opts).unwrap();
    let (mut rx, _tx) = dev.net_queue_pair(0, 64).unwrap();
    let mut delivered = 0;
    // Every buffer comes back empty (length 0): the frontend counts them bad.
    assert!(wait_until(T, || {
        rx.recv_burst(64, |_| delivered += 1).unwrap();
        rx.stats.bad >= 100
    }));
    assert_eq!(delivered, 0);
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.total("guest_rx_packets"), 0);
    assert!(s.queue(0, "dropped") >= 100);
}

#[test]
fn config_space_reports_mac_link_and_queue_pairs() {
    let d = Daemon::start(&["--backend", "sink", "--queues", "3", "--mac", "02:11:22:33:44:55"]);
    let dev = d.connect();
    let cfg = dev.net_config().expect("config read through GET_CONFIG");
    assert_eq!(cfg.mac, [0x02, 0x11, 0x22, 0x33, 0x44, 0x55]);
    assert_eq!(cfg.status, 1, "link up");
    assert_eq!(cfg.max_virtqueue_pairs, 3);
    assert_eq!(dev.max_queues(), 7, "GET_QUEUE_NUM: 3 pairs and the control queue");
}

#[test]
fn two_queue_pairs_each_carry_their_own_traffic() {
    let d = Daemon::start(&["--backend", "loopback", "--queues", "2"]);
    let mut dev = d.connect();
    let (mut rx0, mut tx0) = dev.net_queue_pair(0, 256).unwrap();
    let (mut rx1, mut tx1) = dev.net_queue_pair(1, 256).unwrap();
    roundtrip(&mut rx0, &mut tx0, 500, 0);
    roundtrip(&mut rx1, &mut tx1, 700, 100_000);
    drop((rx0, tx0, rx1, tx1));
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.queue(1, "packets"), 500);
    assert_eq!(s.queue(0, "packets"), 500);
    assert_eq!(s.queue(3, "packets"), 700);
    assert_eq!(s.queue(2, "packets"), 700);
}

#[test]
fn reconnect_serves_the_next_frontend() {
    let d = Daemon::start(&["--backend", "loopback"]);
    for round in 0..3u32 {
        let mut dev = d.connect();
        let (mut rx, mut tx) = dev.net_queue_pair(0, 128).unwrap();
        roundtrip(&mut rx, &mut tx, 200, round * 1000);
        drop((rx, tx));
        if round == 1 {
            // Vanish without GET_VRING_BASE, like a crashed VMM.
            drop(dev);
        } else {
            dev.disconnect().unwrap();
        }
    }
    let s = d.stop();
    assert_eq!(s.total("guest_tx_packets"), 600);
    assert_eq!(s.total("guest_rx_packets"), 600);
}

#[test]
fn get_vring_base_stops_the_ring_and_returns_the_next_avail_index() {
    let d = Daemon::start(&["--backend", "sink"]);
    let mut dev = d.connect();
    let (_rx, mut tx) = dev.net_queue_pair(0, 64).unwrap();
    for i in 0..37 {
        assert!(tx.send_frame(&frame(i, 64)).unwrap());
    }
    tx.flush().unwrap();
    assert!(wait_until(T, || {
        tx.reclaim().unwrap();
        tx.stats.packets == 37
    }));
    assert_eq!(dev.get_vring_base(1).unwrap(), 37);
    // The ring is stopped: frames made available now are not consumed,
    // until the ring is started again from where it stopped.
    for i in 0..5 {
        assert!(tx.send_frame(&frame(100 + i, 64)).unwrap());
    }
    tx.flush().unwrap();
    dev.start_queue_at(&tx.queue, 37).unwrap();
    assert!(wait_until(T, || {
        tx.reclaim().unwrap();
        tx.stats.packets == 42
    }));
    dev.disconnect().unwrap();
    assert_eq!(d.stop().total("guest_tx_packets"), 42);
}

/// A raw TX queue (index 1) next to a normal RX queue, for hostile chains.
struct RawPair {
    dev: VirtioUser,
    raw: UnixStream,
    rx: RxQueue,
    txq: vhostd_user::VirtQueue,
    buf: u64,
}

fn raw_pair(d: &Daemon, extra_features: u64) -> RawPair {
    let sock = UnixStream::connect(&d.sock).unwrap();
    let raw = sock.try_clone().unwrap();
    let mut opts = d.options();
    opts.protocol_features |= VhostUserProtocolFeatures::STATUS;
    opts.features |= extra_features;
    let mut dev = VirtioUser::from_stream(sock, opts).unwrap();
    let hdr = dev.net_hdr_len();
    let rxq = dev.create_queue(0, 64, None).unwrap();
    let bufs = dev.memory().alloc(64 * 2048, 64).unwrap();
    let rx = RxQueue::new(rxq, bufs, 2048, hdr, true).unwrap();
    dev.start_queue(&rx.queue).unwrap();
    let txq = dev.create_queue(1, 64, None).unwrap();
    dev.start_queue(&txq).unwrap();
    let buf = dev.memory().alloc(64 * 2048, 64).unwrap();
    RawPair { dev, raw, rx, txq, buf }
}

impl RawPair {
    /// Makes descriptor `i` available as a chain head and kicks.
    fn post(&mut self, heads: &[u16]) {
        let ring = self.txq.ring.split().unwrap();
        let mut idx = ring.avail_idx();
        for &h in heads {
            ring.write_avail_ring(idx % ring.size(), h);
            idx = idx.wrapping_add(1);
        }
        ring.set_avail_idx(idx);
        self.txq.kick().unwrap();
    }

    /// Writes a good frame (with its header) into slot `slot` and describes it in descriptor `i`.
    fn good_desc(&mut self, i: u16, seq: u32) -> Vec<u8> {
        let fr = frame(seq, 100);
        let gpa = self.buf + i as u64 * 2048;
        let mut data = vec![0u8; 12];
        data.extend_from_slice(&fr);
        assert!(self.dev.memory().driver_memory().write(gpa, &data));
        self.txq
            .ring
            .split()
            .unwrap()
            .write_desc(i, Descriptor { addr: gpa, len: data.len() as u32, flags: 0, next: 0 });
        fr
    }

    fn status(&mut self) -> u8 {
        let r = raw_request(&mut self.raw, 40, 0, &[], true).unwrap();
        r[0]
    }
}

#[test]
fn bad_chains_are_completed_empty_counted_and_the_queue_keeps_serving() {
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut p = raw_pair(&d, 0);
    let mem_end = p.dev.memory().size();
    // 0: outside memory; 1: straddles the end; 2: device-writable on TX;
    // 3 -> 4 -> 3: a loop; 5: next past the queue; then a good one.
    p.txq.ring.split().unwrap().write_desc(0, Descriptor { addr: 1 << 40, len: 100, flags: 0, next: 0 });
    p.txq.ring.split().unwrap().write_desc(1, Descriptor { addr: mem_end - 50, len: 100, flags: 0, next: 0 });
    let g = p.buf;
    p.txq.ring.split().unwrap().write_desc(2, Descriptor { addr: g, len: 100, flags: 2, next: 0 });
    p.txq.ring.split().unwrap().write_desc(3, Descriptor { addr: g, len: 50, flags: 1, next: 4 });
    p.txq.ring.split().unwrap().write_desc(4, Descriptor { addr: g, len: 50, flags: 1, next: 3 });
    p.txq.ring.split().unwrap().write_desc(5, Descriptor { addr: g, len: 50, flags: 1, next: 64 });
    let good = p.good_desc(6, 7);
    p.post(&[0, 1, 2, 3, 5, 6]);
    assert!(wait_until(T, || p.txq.ring.split().unwrap().used_idx() == 6), "every chain completed");
    for slot in 0..6 {
        let (id, len) = p.txq.ring.split().unwrap().read_used_ring(slot);
        assert_eq!(len, 0, "TX used length is 0 (slot {slot}, head {id})");
    }
    let mut got = Vec::new();
    assert!(wait_until(T, || {
        p.rx.recv_burst(8, |fr| got.push(fr.to_vec())).unwrap();
        !got.is_empty()
    }));
    assert_eq!(got, vec![good], "only the good frame came back");
    // The device is not broken by bad chains.
    assert_eq!(p.status() & 0x40, 0);
    drop(p);
    let s = d.stop();
    assert_eq!(s.queue(1, "bad_chains"), 5);
    assert_eq!(s.queue(1, "packets"), 1);
}

#[test]
fn a_short_virtio_net_header_is_dropped_and_counted() {
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut p = raw_pair(&d, 0);
    let g = p.buf;
    p.txq.ring.split().unwrap().write_desc(0, Descriptor { addr: g, len: 8, flags: 0, next: 0 });
    p.post(&[0]);
    assert!(wait_until(T, || p.txq.ring.split().unwrap().used_idx() == 1));
    drop(p);
    let s = d.stop();
    assert_eq!(s.queue(1, "dropped"), 1);
    assert_eq!(s.total("guest_rx_packets"), 0);
}

#[test]
fn avail_index_running_ahead_marks_the_device_needs_reset_and_others_keep_working() {
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut p = raw_pair(&d, 0);
    assert_eq!(p.status() & 0x40, 0);
    let idx = p.txq.ring.split().unwrap().avail_idx();
    p.txq.ring.split().unwrap().set_avail_idx(idx.wrapping_add(65 + 64));
    p.txq.kick().unwrap();
    assert!(wait_until(T, || p.status() & 0x40 != 0), "GET_STATUS reports NEEDS_RESET");
    drop(p);
    // The next frontend gets a fresh device.
    let mut dev = d.connect();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 128).unwrap();
    roundtrip(&mut rx, &mut tx, 100, 0);
}

#[test]
fn set_status_and_get_status() {
    let d = Daemon::start(&["--backend", "sink"]);
    let mut p = raw_pair(&d, 0);
    raw_request(&mut p.raw, 39, 0, &0x0fu64.to_le_bytes(), false);
    assert_eq!(p.status(), 0x0f);
    // With REPLY_ACK negotiated, SET_STATUS with NEED_REPLY is acknowledged.
    let ack = raw_request(&mut p.raw, 39, 0x8, &0x07u64.to_le_bytes(), true).unwrap();
    assert_eq!(ack, 0u64.to_le_bytes());
    assert_eq!(p.status(), 0x07);
}

#[test]
fn control_queue_sets_queue_pairs_and_refuses_too_many() {
    let d = Daemon::start(&["--backend", "loopback", "--queues", "2"]);
    let mut opts = d.options();
    opts.features |= f::NET_CTRL_VQ;
    let mut dev = VirtioUser::connect(opts).unwrap();
    assert!(dev.features() & f::NET_CTRL_VQ != 0);
    let (mut rx1, mut tx1) = dev.net_queue_pair(1, 64).unwrap();
    let mut ctrl = dev.create_queue(4, 16, None).unwrap();
    dev.start_queue(&ctrl).unwrap();
    assert_eq!(set_pairs(&mut dev, &mut ctrl, 3), 1, "3 pairs > max 2: VIRTIO_NET_ERR");
    assert_eq!(set_pairs(&mut dev, &mut ctrl, 2), 0, "VIRTIO_NET_OK");
    roundtrip(&mut rx1, &mut tx1, 50, 0);
    assert_eq!(set_pairs(&mut dev, &mut ctrl, 1), 0);
    // Pair 1 is no longer in use: nothing is delivered to its RX queue.
    for i in 0..10 {
        assert!(tx1.send_frame(&frame(i, 64)).unwrap());
        tx1.flush().unwrap();
        assert!(wait_until(T, || {
            tx1.reclaim().unwrap();
            tx1.stats.packets == 51 + i as u64
        }));
    }
    let mut got = 0;
    rx1.recv_burst(64, |_| got += 1).unwrap();
    assert_eq!(got, 0, "inactive pair received frames");
}

#[test]
fn memory_added_with_add_mem_reg_works_like_set_mem_table() {
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut opts = d.options();
    opts.add_mem_reg = true;
    let mut dev = VirtioUser::connect(opts).unwrap();
    let (mut rx, mut tx) = dev.net_queue_pair(0, 128).unwrap();
    roundtrip(&mut rx, &mut tx, 300, 0);
}

#[test]
fn reset_device_keeps_memory_added_with_add_mem_reg() {
    // QEMU 11 resets the device when the guest's driver resets it, then
    // starts the rings again without resending memory: with ADD_MEM_REG it
    // sends only changes to the table, and after a reset there are none.
    // A backend that dropped the table on RESET_DEVICE refuses the rings
    // ("a ring is not inside the memory table") and the guest hangs.
    use vhost::vhost_user::VhostUserFrontend;
    use vhost::VhostBackend;
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut opts = d.options();
    opts.add_mem_reg = true;
    opts.protocol_features |= vhost::vhost_user::message::VhostUserProtocolFeatures::RESET_DEVICE;
    let mut dev = VirtioUser::connect(opts).unwrap();
    {
        let (mut rx, mut tx) = dev.net_queue_pair(0, 128).unwrap();
        roundtrip(&mut rx, &mut tx, 100, 0);
    }
    dev.get_vring_base(0).unwrap();
    dev.get_vring_base(1).unwrap();
    dev.frontend().reset_device().expect("RESET_DEVICE");
    let features = dev.features();
    dev.frontend().set_features(features).expect("SET_FEATURES after the reset");
    let (mut rx, mut tx) = dev.net_queue_pair(0, 128).expect("rings started on the memory added before the reset");
    roundtrip(&mut rx, &mut tx, 100, 0);
}

#[test]
fn a_region_added_once_per_queue_pair_is_counted_not_refused() {
    // QEMU with queues=N sends ADD_MEM_REG (and later REM_MEM_REG) for the
    // same region once per queue pair; an overlapping different region is
    // still refused.
    use vhost::vhost_user::VhostUserFrontend;
    use vhost::VhostUserMemoryRegionInfo;
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut opts = d.options();
    opts.add_mem_reg = true;
    let mut dev = VirtioUser::connect(opts).unwrap();
    let region = VhostUserMemoryRegionInfo {
        guest_phys_addr: dev.memory().gpa_base(),
        memory_size: dev.memory().size(),
        userspace_addr: dev.memory().uaddr_base(),
        mmap_offset: 0,
        mmap_handle: dev.memory().fd(),
    };
    dev.frontend().add_mem_region(&region).expect("the same region again");
    let mut overlapping = region;
    overlapping.guest_phys_addr += 4096;
    overlapping.userspace_addr += 1 << 40;
    assert!(dev.frontend().add_mem_region(&overlapping).is_err(), "overlap refused");
    dev.frontend().remove_mem_region(&region).expect("first removal");
    // One reference is left: traffic still flows.
    let (mut rx, mut tx) = dev.net_queue_pair(0, 128).unwrap();
    roundtrip(&mut rx, &mut tx, 100, 0);
}

// ---- packed rings ---------------------------------------------------------

#[test]
fn loopback_packed_ring_mergeable() {
    loopback_with(&[], |o| o.features |= f::RING_PACKED);
}

#[test]
fn loopback_packed_ring_without_mergeable() {
    loopback_with(&[], |o| {
        o.features |= f::RING_PACKED;
        o.features &= !f::NET_MRG_RXBUF;
    });
}

#[test]
fn loopback_packed_ring_in_order_poll_mode() {
    loopback_with(&["--poll"], |o| o.features |= f::RING_PACKED | f::IN_ORDER);
}

/// Frames of random sizes in random bursts through the loopback; returns
/// what came back, in order.
fn random_workload(packed: bool, mrg: bool, seed: u64, queue_size: u16) -> Vec<Vec<u8>> {
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut dev = VirtioUser::connect(d.ring_options(packed, mrg)).unwrap();
    assert_eq!(dev.packed(), packed);
    let (mut rx, mut tx) = dev.net_queue_pair(0, queue_size).unwrap();
    let mix = |x: u64| {
        let x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        x ^ (x >> 29)
    };
    // Frame sizes depend on the seed and sequence number only; burst sizes
    // (which depend on timing too) come from a second stream.
    let span = (tx.max_frame().min(1514) - 59) as u64;
    let len_of = |seq: u32| 60 + (mix(mix(seed) ^ seq as u64) >> 7) as usize % span as usize;
    let mut rng = seed;
    let mut next = move |n: u64| {
        rng = mix(rng);
        (rng >> 33) % n
    };
    let total = 1500u32;
    let (mut seq, mut got) = (0u32, Vec::new());
    let ok = wait_until(T, || {
        tx.reclaim().unwrap();
        let burst = 1 + next(40) as u32;
        let mut sent = 0;
        while seq < total && sent < burst && seq as usize - got.len() < queue_size as usize / 2 {
            if !tx.send_frame(&frame(seq, len_of(seq))).unwrap() {
                break;
            }
            seq += 1;
            sent += 1;
        }
        if sent > 0 {
            tx.flush().unwrap();
        }
        rx.recv_burst(1 + next(64) as usize, |fr| got.push(fr.to_vec())).unwrap();
        got.len() as u32 >= total
    });
    assert!(ok, "only {} of {total} frames came back", got.len());
    drop((rx, tx));
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.total("bad_chains"), 0);
    assert_eq!(s.total("dropped"), 0);
    got
}

#[test]
fn split_and_packed_rings_deliver_the_same_frames() {
    for (seed, mrg, qsize) in [(1, true, 256), (2, false, 64), (3, true, 32)] {
        let split = random_workload(false, mrg, seed, qsize);
        let packed = random_workload(true, mrg, seed, qsize);
        assert_eq!(split.len(), packed.len());
        for (i, (a, b)) in split.iter().zip(&packed).enumerate() {
            assert_eq!(a, b, "seed {seed}: frame {i} differs between split and packed");
        }
        // And both are what was sent: frame i carries sequence number i.
        for (i, fr) in packed.iter().enumerate() {
            assert_eq!(fr, &frame(i as u32, fr.len()), "seed {seed}: frame {i}");
        }
    }
}

#[test]
fn get_vring_base_on_a_packed_ring_carries_both_wrap_counters() {
    let d = Daemon::start(&["--backend", "sink"]);
    let mut opts = d.options();
    opts.features |= f::RING_PACKED;
    let mut dev = VirtioUser::connect(opts).unwrap();
    let (_rx, mut tx) = dev.net_queue_pair(0, 64).unwrap();
    // 100 one-slot chains on a 64-slot ring: both positions at slot 36 on
    // the second lap, where the wrap counters are 0.
    let mut seq = 0;
    assert!(wait_until(T, || {
        tx.reclaim().unwrap();
        while seq < 100 && tx.send_frame(&frame(seq, 64)).unwrap() {
            seq += 1;
        }
        tx.flush().unwrap();
        tx.stats.packets == 100
    }));
    let base = dev.get_vring_base(1).unwrap();
    assert_eq!(base, 36 | (36 << 16), "avail 36 wrap 0, used 36 wrap 0: {base:#x}");
    for i in 0..5 {
        assert!(tx.send_frame(&frame(200 + i, 64)).unwrap());
    }
    tx.flush().unwrap();
    // Restart with only the avail half (as DPDK sends): used = avail.
    dev.start_queue_at(&tx.queue, 36).unwrap();
    assert!(wait_until(T, || {
        tx.reclaim().unwrap();
        tx.stats.packets == 105
    }));
    dev.disconnect().unwrap();
    assert_eq!(d.stop().total("guest_tx_packets"), 105);
}

impl RawPair {
    fn packed(&mut self) -> &mut PackedDriver {
        self.txq.ring.packed().unwrap()
    }

    /// Writes a good frame at buffer `i` and returns (gpa, len, frame).
    fn good_buf(&mut self, i: u64, seq: u32) -> (u64, u32, Vec<u8>) {
        let fr = frame(seq, 100);
        let gpa = self.buf + i * 2048;
        let mut data = vec![0u8; 12];
        data.extend_from_slice(&fr);
        assert!(self.dev.memory().driver_memory().write(gpa, &data));
        (gpa, data.len() as u32, fr)
    }
}

#[test]
fn bad_chains_on_a_packed_ring_are_completed_empty_and_a_broken_one_needs_reset() {
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut p = raw_pair(&d, f::RING_PACKED);
    let mem_end = p.dev.memory().size();
    let av = PackedDriver::avail_bits(true);
    let (g, glen, good) = p.good_buf(0, 7);
    // Slot 0: outside memory (id 10); 1: device-writable on TX (id 11);
    // 2+3: a two-descriptor chain straddling the end of memory (id 12);
    // 4: a good frame (id 13). Heads written last.
    let q = p.packed();
    q.write_desc(3, PackedDesc { addr: mem_end - 10, len: 100, id: 12, flags: av });
    q.write_desc(4, PackedDesc { addr: g, len: glen, id: 13, flags: av });
    q.write_desc(2, PackedDesc { addr: g, len: 12, id: 0, flags: av | 1 });
    q.write_desc(1, PackedDesc { addr: g, len: 100, id: 11, flags: av | 2 });
    q.write_desc(0, PackedDesc { addr: 1 << 40, len: 100, id: 10, flags: av });
    p.txq.kick().unwrap();
    let used = |p: &mut RawPair, slot: u16| {
        let d = p.packed().read_desc(slot);
        (d.flags & 0x8080 == 0x8080).then_some((d.id, d.len))
    };
    assert!(wait_until(T, || used(&mut p, 4).is_some()), "every chain completed");
    assert_eq!(used(&mut p, 0), Some((10, 0)));
    assert_eq!(used(&mut p, 1), Some((11, 0)));
    assert_eq!(used(&mut p, 2), Some((12, 0)), "a two-slot chain's used descriptor sits at its first slot");
    assert_eq!(used(&mut p, 3), None, "and its second slot is skipped");
    let mut got = Vec::new();
    assert!(wait_until(T, || {
        p.rx.recv_burst(8, |fr| got.push(fr.to_vec())).unwrap();
        !got.is_empty()
    }));
    assert_eq!(got, vec![good], "only the good frame came back");
    assert_eq!(p.status() & 0x40, 0, "bad chains do not break the device");
    // Slot 5 says NEXT but slot 6 was never made available: the ring is
    // corrupt (a driver makes a chain's head available last).
    p.packed().write_desc(5, PackedDesc { addr: g, len: glen, id: 14, flags: av | 1 });
    p.txq.kick().unwrap();
    assert!(wait_until(T, || p.status() & 0x40 != 0), "GET_STATUS reports NEEDS_RESET");
    drop(p);
    let s = d.stop();
    assert_eq!(s.queue(1, "bad_chains"), 4);
    assert_eq!(s.queue(1, "packets"), 1);
}

#[test]
fn loopback_split_ring_in_order() {
    loopback_with(&[], |o| o.features |= f::IN_ORDER);
}

#[test]
fn with_in_order_a_tx_batch_takes_one_used_entry_on_both_ring_layouts() {
    for packed in [false, true] {
        let d = Daemon::start(&["--backend", "sink", "--poll"]);
        let mut opts = d.options();
        opts.features |= f::IN_ORDER | if packed { f::RING_PACKED } else { 0 };
        let mut dev = VirtioUser::connect(opts).unwrap();
        let (_rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
        let mut seq = 0;
        // Bursts of up to 200 frames: the backend takes them 32 at a time.
        assert!(wait_until(T, || {
            tx.reclaim().unwrap();
            while seq < 5000 && tx.send_frame(&frame(seq, 64)).unwrap() {
                seq += 1;
            }
            tx.flush().unwrap();
            tx.stats.packets == 5000
        }));
        dev.disconnect().unwrap();
        let s = d.stop();
        assert_eq!(s.queue(1, "packets"), 5000);
        let skipped = s.queue(1, "used_skipped");
        assert!(
            skipped > 0 && skipped < 5000,
            "packed={packed}: {skipped} chains completed without their own used entry"
        );
        assert!(s.queue(1, "fast_chains") > 0);
    }
}

// ---- adaptive polling ----------------------------------------------------

#[test]
fn loopback_adaptive_mode() {
    loopback_case(&["--mode", "adaptive"], true);
}

/// CPU time (user + system, in clock ticks of 10 ms) of process `pid`.
fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn adaptive_mode_spins_while_busy_and_sleeps_when_idle() {
    for (args, idle_busy) in
        [(&["--mode", "adaptive", "--poll-idle-us", "200"][..], false), (&["--mode", "poll"][..], true)]
    {
        let d = Daemon::start(&[&["--backend", "loopback"], args].concat());
        let mut dev = d.connect();
        let (mut rx, mut tx) = dev.net_queue_pair(0, 256).unwrap();
        roundtrip(&mut rx, &mut tx, 500, 0);
        // Connected, rings attached, no traffic: measure the CPU it burns.
        let t0 = cpu_ticks(d.pid());
        std::thread::sleep(Duration::from_secs(1));
        let used = cpu_ticks(d.pid()) - t0;
        if idle_busy {
            assert!(used >= 50, "{args:?}: a polling worker spins when idle (used {used} of 100 ticks)");
        } else {
            assert!(used <= 5, "{args:?}: an idle adaptive worker sleeps (used {used} of 100 ticks)");
        }
        // And it still wakes for traffic.
        roundtrip(&mut rx, &mut tx, 500, 1000);
        drop((rx, tx));
        dev.disconnect().unwrap();
        // (A worker also sleeps before any ring is attached, in every mode.)
        let sleeps: u64 = d.stop().workers[&0]["sleeps"].parse().unwrap();
        if !idle_busy {
            assert!(sleeps >= 2, "the adaptive worker slept between the two bursts ({sleeps})");
        }
    }
}
