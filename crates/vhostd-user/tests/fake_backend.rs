//! vhostd-user against an in-process fake vhost-user net backend (the
//! `vhost` crate's backend request handler plus `virtq`'s device side) that
//! loops every TX frame back to RX. No DPDK, no vhostd needed.

use std::fs::File;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::*;
use vhost::vhost_user::{
    Backend, BackendReqHandler, GpuBackend, VhostUserBackendReqHandlerMut, VhostUserProtocolFeatures,
};
use vhost::VhostUserMemoryRegionBase;
use virtq::{Access, Batch, SplitConfig, SplitQueue};
use virtq::{GuestMemory, Mapping, Region};

use vhostd_user::{build_udp_frame, features, Error, Options, VirtioUser};

type VResult<T> = vhost::vhost_user::Result<T>;

const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];

#[derive(Default)]
struct RingCfg {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    base: u16,
    call: Option<Arc<File>>,
    kick: bool,
    enabled: bool,
}

/// A region's frontend address, guest-physical address and size.
type Addrs = (u64, u64, u64);

/// The guest-physical address of the frontend's virtual address `uaddr`
/// (vhost-user gives ring addresses in that space); an odd address, which
/// ring set-up refuses, if unmapped.
fn to_gpa(table: &[Addrs], uaddr: u64) -> u64 {
    table.iter().find(|&&(u, _, size)| uaddr.wrapping_sub(u) < size).map_or(1, |&(u, gpa, _)| gpa + (uaddr - u))
}

#[derive(Default)]
struct Fake {
    acked: u64,
    proto: u64,
    /// The memory table and its regions as (frontend address, gpa, size).
    mem: Option<(Arc<GuestMemory>, Vec<Addrs>)>,
    rings: [RingCfg; 2],
    worker: Option<(Arc<AtomicBool>, JoinHandle<[u16; 2]>)>,
}

impl Fake {
    fn offered() -> u64 {
        features::VERSION_1
            | features::EVENT_IDX
            | features::NET_MRG_RXBUF
            | features::NET_MAC
            | features::NET_STATUS
            | features::PROTOCOL_FEATURES
    }

    fn maybe_start(&mut self) {
        let ready = |r: &RingCfg| r.size != 0 && r.desc != 0 && r.kick && r.enabled;
        if self.worker.is_some() || !self.rings.iter().all(ready) {
            return;
        }
        let Some((mem, table)) = self.mem.clone() else { return };
        let cfg = |r: &RingCfg| SplitConfig {
            size: r.size,
            desc: to_gpa(&table, r.desc),
            avail: to_gpa(&table, r.avail),
            used: to_gpa(&table, r.used),
            features: self.acked,
            next_avail: r.base,
        };
        let mut rxq = SplitQueue::new(mem.clone(), cfg(&self.rings[0])).unwrap();
        let mut txq = SplitQueue::new(mem, cfg(&self.rings[1])).unwrap();
        let calls = [self.rings[0].call.clone(), self.rings[1].call.clone()];
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let h = std::thread::spawn(move || {
            let (mut tb, mut rb) = (Batch::new(), Batch::new());
            let mut frame = vec![0u8; 65536];
            let signal = |f: &Option<Arc<File>>| {
                if let Some(f) = f {
                    let _ = (&**f).write(&1u64.to_ne_bytes());
                }
            };
            while !s.load(Ordering::Relaxed) {
                let n = txq.pop_batch(&mut tb, 32, Access::ReadOnly);
                if n == 0 {
                    std::thread::yield_now();
                    continue;
                }
                let m = rxq.pop_batch(&mut rb, n, Access::WriteOnly);
                for (i, c) in tb.chains.iter().enumerate() {
                    let len = tb.readable(c).read(12, &mut frame);
                    if let Some(rc) = rb.chains.get(i).filter(|_| i < m) {
                        let mut hdr = [0u8; 12];
                        hdr[10] = 1; // num_buffers
                        let a = rb.writable(rc).write(0, &hdr);
                        let b = rb.writable(rc).write(12, &frame[..len]);
                        rxq.add_used(rc.head, (a + b) as u32);
                    }
                    txq.add_used(c.head, 0);
                }
                txq.publish_used();
                rxq.publish_used();
                if rxq.needs_notify() {
                    signal(&calls[0]);
                }
                if txq.needs_notify() {
                    signal(&calls[1]);
                }
            }
            [rxq.next_avail(), txq.next_avail()]
        });
        self.worker = Some((stop, h));
    }

    fn stop(&mut self) {
        if let Some((stop, h)) = self.worker.take() {
            stop.store(true, Ordering::Relaxed);
            let bases = h.join().unwrap();
            self.rings[0].base = bases[0];
            self.rings[1].base = bases[1];
        }
    }

    fn ring(&mut self, index: u32) -> VResult<&mut RingCfg> {
        self.rings.get_mut(index as usize).ok_or(vhost::vhost_user::Error::InvalidParam)
    }
}

fn unsupported<T>() -> VResult<T> {
    Err(vhost::vhost_user::Error::InvalidOperation("not supported by the fake"))
}

impl VhostUserBackendReqHandlerMut for Fake {
    fn set_owner(&mut self) -> VResult<()> {
        Ok(())
    }
    fn reset_owner(&mut self) -> VResult<()> {
        Ok(())
    }
    fn reset_device(&mut self) -> VResult<()> {
        unsupported()
    }
    fn get_features(&mut self) -> VResult<u64> {
        Ok(Fake::offered())
    }
    fn set_features(&mut self, f: u64) -> VResult<()> {
        if f & !Fake::offered() != 0 {
            return Err(vhost::vhost_user::Error::InvalidParam);
        }
        self.acked = f;
        Ok(())
    }
    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _pl: Option<bool>,
    ) -> VResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        let (mut regions, mut table) = (Vec::new(), Vec::new());
        for (r, f) in ctx.iter().zip(files.iter()) {
            let m =
                Mapping::map(f, r.mmap_offset, r.memory_size).map_err(|_| vhost::vhost_user::Error::InvalidParam)?;
            regions.push(Region::new(r.guest_phys_addr, r.memory_size, Arc::new(m), 0).unwrap());
            table.push((r.user_addr, r.guest_phys_addr, r.memory_size));
        }
        self.mem = Some((Arc::new(GuestMemory::from_regions(regions).unwrap()), table));
        Ok(None)
    }
    fn set_vring_num(&mut self, index: u32, num: u32) -> VResult<()> {
        self.ring(index)?.size = num as u16;
        Ok(())
    }
    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VResult<()> {
        let r = self.ring(index)?;
        (r.desc, r.used, r.avail) = (descriptor, used, available);
        Ok(())
    }
    fn set_vring_base(&mut self, index: u32, base: u32) -> VResult<()> {
        self.ring(index)?.base = base as u16;
        Ok(())
    }
    fn get_vring_base(&mut self, index: u32) -> VResult<VhostUserVringState> {
        self.stop();
        let r = self.ring(index)?;
        r.kick = false;
        Ok(VhostUserVringState::new(index, r.base as u32))
    }
    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VResult<()> {
        self.ring(index as u32)?.kick = fd.is_some();
        self.maybe_start();
        Ok(())
    }
    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VResult<()> {
        self.ring(index as u32)?.call = fd.map(Arc::new);
        Ok(())
    }
    fn set_vring_err(&mut self, _index: u8, _fd: Option<File>) -> VResult<()> {
        Ok(())
    }
    fn get_protocol_features(&mut self) -> VResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::CONFIG)
    }
    fn set_protocol_features(&mut self, f: u64) -> VResult<()> {
        self.proto = f;
        Ok(())
    }
    fn get_queue_num(&mut self) -> VResult<u64> {
        Ok(2)
    }
    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VResult<()> {
        self.ring(index)?.enabled = enable;
        self.maybe_start();
        Ok(())
    }
    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> VResult<Vec<u8>> {
        let mut cfg = [0u8; 10];
        cfg[..6].copy_from_slice(&MAC);
        cfg[6] = 1; // link up
        cfg[8] = 1; // one queue pair
        let (o, s) = (offset as usize, size as usize);
        Ok(cfg.get(o..o + s).map(|c| c.to_vec()).unwrap_or_default())
    }
    fn set_config(&mut self, _o: u32, _b: &[u8], _f: VhostUserConfigFlags) -> VResult<()> {
        unsupported()
    }
    fn set_backend_req_fd(&mut self, _backend: Backend) {}
    fn set_gpu_socket(&mut self, _g: GpuBackend) -> VResult<()> {
        unsupported()
    }
    fn get_shared_object(&mut self, _u: VhostUserSharedMsg) -> VResult<File> {
        unsupported()
    }
    fn get_inflight_fd(&mut self, _i: &VhostUserInflight) -> VResult<(VhostUserInflight, File)> {
        unsupported()
    }
    fn set_inflight_fd(&mut self, _i: &VhostUserInflight, _f: File) -> VResult<()> {
        unsupported()
    }
    fn get_max_mem_slots(&mut self) -> VResult<u64> {
        unsupported()
    }
    fn add_mem_region(
        &mut self,
        _r: &VhostUserSingleMemoryRegion,
        _f: File,
        _pl: Option<bool>,
    ) -> VResult<Option<VhostUserMemoryRegionBase>> {
        unsupported()
    }
    fn remove_mem_region(&mut self, _r: &VhostUserSingleMemoryRegion) -> VResult<()> {
        unsupported()
    }
    fn set_device_state_fd(
        &mut self,
        _d: VhostTransferStateDirection,
        _p: VhostTransferStatePhase,
        _f: File,
    ) -> VResult<Option<File>> {
        unsupported()
    }
    fn check_device_state(&mut self) -> VResult<()> {
        unsupported()
    }
    fn get_shmem_config(&mut self) -> VResult<VhostUserShMemConfig> {
        unsupported()
    }
    fn set_log_base(&mut self, _l: &VhostUserLog, _f: File) -> VResult<()> {
        unsupported()
    }
}

/// Serves one connection until the frontend hangs up.
fn serve(sock: UnixStream) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let backend = Arc::new(Mutex::new(Fake::default()));
        let mut h = BackendReqHandler::from_stream(sock, backend.clone());
        while h.handle_request().is_ok() {}
        backend.lock().unwrap().stop();
    })
}

fn connected() -> (VirtioUser, JoinHandle<()>) {
    let (a, b) = UnixStream::pair().unwrap();
    let server = serve(b);
    let mut opts = Options::new("unused");
    opts.mem_size = 4 << 20;
    (VirtioUser::from_stream(a, opts).unwrap(), server)
}

#[test]
fn negotiation_and_config() {
    let (dev, server) = connected();
    let f = dev.features();
    for bit in [features::VERSION_1, features::EVENT_IDX, features::NET_MRG_RXBUF, features::PROTOCOL_FEATURES] {
        assert_ne!(f & bit, 0, "feature {bit:#x} negotiated");
    }
    assert_eq!(f & features::NET_MQ, 0, "MQ not offered, so not acked");
    let p = dev.protocol_features();
    assert!(p.contains(VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::CONFIG));
    assert_eq!(dev.max_queues(), 2);
    assert_eq!(dev.net_hdr_len(), 12);
    let c = dev.net_config().expect("config read");
    assert_eq!((c.mac, c.status, c.max_virtqueue_pairs), (MAC, 1, 1));
    drop(dev);
    server.join().unwrap();
}

#[test]
fn frames_round_trip_through_loopback_backend() {
    let (mut dev, server) = connected();
    assert!(dev.net_queue_pair(1, 64).is_err(), "only one pair without MQ");
    let (mut rx, mut tx) = dev.net_queue_pair(0, 64).unwrap();
    let total = 3000usize;
    let (mut sent, mut got) = (0usize, 0usize);
    let deadline = Instant::now() + Duration::from_secs(20);
    while got < total {
        assert!(Instant::now() < deadline, "stalled at {got}/{total}");
        // At most 32 in flight, so the backend never finds the RX ring empty.
        if sent == got {
            for _ in 0..32.min(total - sent) {
                let mut fr = build_udp_frame(60 + sent % 1400, [2, 0, 0, 0, 0, 1], MAC);
                fr[42..50].copy_from_slice(&(sent as u64).to_le_bytes());
                assert!(tx.send_frame(&fr).unwrap());
                sent += 1;
            }
            tx.flush().unwrap();
        }
        tx.reclaim().unwrap();
        rx.recv_burst(64, |frame| {
            assert_eq!(frame.len(), 60 + got % 1400);
            assert_eq!(u64::from_le_bytes(frame[42..50].try_into().unwrap()), got as u64);
            got += 1;
        })
        .unwrap();
    }
    let t0 = Instant::now();
    while tx.queue.ring.in_flight() > 0 && t0.elapsed() < Duration::from_secs(5) {
        tx.reclaim().unwrap();
    }
    assert_eq!(tx.stats.packets, total as u64);
    assert_eq!(rx.stats.packets, total as u64);
    assert_eq!(rx.stats.bad, 0);

    // Interrupt path: ask for a call, send one frame, wait for it.
    tx.queue.ring.disable_notifications();
    assert!(!rx.queue.ring.enable_notifications());
    rx.queue.take_calls();
    assert!(tx.send_frame(&build_udp_frame(64, [2, 0, 0, 0, 0, 1], MAC)).unwrap());
    tx.flush().unwrap();
    assert!(rx.queue.wait_call(Duration::from_secs(5)).unwrap(), "backend called after RX");
    assert_eq!(rx.recv_burst(8, |_| {}).unwrap(), 1);

    let bases = dev.disconnect().unwrap();
    assert_eq!(bases, vec![(0, total as u32 + 1), (1, total as u32 + 1)]);
    server.join().unwrap();
}

#[test]
fn hostile_used_entries_are_errors_not_panics() {
    let (mut dev, server) = connected();
    let (mut rx, _tx) = dev.net_queue_pair(0, 16).unwrap();
    // Stop the backend so only we touch the rings from here on.
    dev.get_vring_base(0).unwrap();
    let (_, _, used) = rx.queue.ring.split().unwrap().ring_ptrs();
    let put = |slot: usize, id: u32, len: u32, idx: u16| {
        // SAFETY: callers pass slot < 16, so every offset stays inside the
        // 16-entry used ring, which is 4-aligned.
        unsafe {
            std::ptr::write_volatile(used.add(4 + 8 * slot) as *mut u32, id);
            std::ptr::write_volatile(used.add(8 + 8 * slot) as *mut u32, len);
            std::ptr::write_volatile(used.add(2) as *mut u16, idx);
        }
    };
    // Length beyond the buffer: counted and dropped, buffer reposted.
    put(0, 0, 1 << 20, 1);
    assert_eq!(rx.recv_burst(16, |_| panic!("no frame")).unwrap(), 0);
    assert_eq!(rx.stats.bad, 1);
    // num_buffers 0 in the header: bad.
    dev.memory().driver_memory().write(rx.queue.ring.split().unwrap().read_desc(1).addr, &[0u8; 12]);
    put(1, 1, 20, 2);
    assert_eq!(rx.recv_burst(16, |_| panic!("no frame")).unwrap(), 0);
    assert_eq!(rx.stats.bad, 2);
    // A head past the queue.
    put(2, 999, 20, 3);
    assert!(matches!(rx.recv_burst(16, |_| {}), Err(Error::Ring(vhostd_user::DriverError::BadUsedId))));
    // used.idx far ahead of what is in flight.
    put(2, 2, 20, 3000);
    assert!(matches!(rx.recv_burst(16, |_| {}), Err(Error::Ring(vhostd_user::DriverError::UsedIdxAhead))));
    drop(dev);
    server.join().unwrap();
}

/// Runs `vhostd-user net` with `args` (after --socket-path) against the
/// fake backend; its stdout, once it exited 0.
fn cli_against_fake_backend(tag: &str, args: &[&str]) -> String {
    let dir = std::env::temp_dir().join(format!("vhostd-user-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let server = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        serve(s).join().unwrap();
    });
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vhostd-user"))
        .args(["net", "--socket-path", path.to_str().unwrap()])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "stdout {stdout} stderr {}", String::from_utf8_lossy(&out.stderr));
    server.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    stdout
}

#[test]
fn cli_txonly_count_against_fake_backend() {
    let stdout = cli_against_fake_backend(
        "test",
        &["--mode", "txonly", "--count", "20000", "--queue-size", "128", "--pkt-size", "100"],
    );
    assert!(stdout.starts_with("report packets=20000 bytes=2000000 seconds="), "{stdout}");
}

/// `--rate` offers that many frames per second, sent or (ring full)
/// counted dropped, not as many as the backend would take.
#[test]
fn cli_rate_offers_frames_at_that_rate() {
    let stdout = cli_against_fake_backend("rate", &["--mode", "txrx", "--rate", "0.05", "--duration", "1"]);
    let val = |k: &str| -> u64 {
        let kv = stdout
            .split_whitespace()
            .find(|w| w.starts_with(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k}: {stdout}"));
        kv[k.len() + 1..].parse().unwrap()
    };
    // 50,000 frames due over the second (a little more or less as the
    // run's end is checked every 256 passes).
    let offered = val("tx_packets") + val("tx_dropped");
    assert!((45_000..=55_000).contains(&offered), "offered {offered}: {stdout}");
}

#[test]
fn cli_bad_arguments_exit_2_naming_the_argument() {
    let bin = env!("CARGO_BIN_EXE_vhostd-user");
    for (args, name) in [
        (vec!["net", "--socket-path", "/x", "--mode", "txonly", "--queue-size", "100"], "--queue-size"),
        (vec!["net", "--socket-path", "/x", "--mode", "sideways"], "--mode"),
        (vec!["net", "--socket-path", "/x", "--mode", "echo", "--pkt-size", "9"], "--pkt-size"),
        (vec!["net", "--socket-path", "/x", "--mode", "echo", "--mrg-rxbuf", "maybe"], "--mrg-rxbuf"),
        (vec!["net", "--mode", "echo"], "--socket-path"),
        (vec!["net", "--socket-path", "/x", "--mode", "txrx", "--rate", "0"], "--rate"),
    ] {
        let out = std::process::Command::new(bin).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(name), "{args:?}: {err}");
    }
}
