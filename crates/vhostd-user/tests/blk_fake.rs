//! vhostd-user's blk mode against an in-process fake vhost-user-blk backend
//! (the `vhost` crate's request handler plus `virtq`'s device side over a
//! RAM disk) that completes every batch of requests in REVERSE order, on
//! split and packed rings, with a small size_max so data is split over
//! several descriptors. qemu-storage-daemon (blk_qsd.rs) has no packed
//! rings; this covers out-of-order completion there, and the raw and
//! timeout paths.

use std::fs::File;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vhost::vhost_user::message::*;
use vhost::vhost_user::{
    Backend, BackendReqHandler, GpuBackend, VhostUserBackendReqHandlerMut, VhostUserProtocolFeatures,
};
use vhost::VhostUserMemoryRegionBase;
use virtq::{Access, Batch, Chain, SplitConfig, SplitQueue};
use virtq::{GuestMemory, Mapping, PackedConfig, PackedQueue, Queue, Region};

use vhostd_user::blk::workload::{self, check_pattern, Mode, Workload};
use vhostd_user::blk::{self, status, types, BlkOp, RawSeg, SECTOR, STATUS_NOT_WRITTEN};
use vhostd_user::{features, Error, Options, VirtioUser};

type VResult<T> = vhost::vhost_user::Result<T>;

const DISK: usize = 1 << 20;
const SIZE_MAX: u32 = 8192;
const ID: &[u8; 20] = b"fake-blk-0123456789x";
/// A request type the fake never completes.
const T_DROP: u32 = 0xdead;
/// The disk byte reads get wrong while `Shared::corrupt` is set.
const CORRUPT_AT: usize = 300_001;

#[derive(Default)]
struct RingCfg {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    base: u32,
    call: Option<Arc<File>>,
    kick: bool,
    enabled: bool,
}

/// What the test and the fake's worker share.
#[derive(Default)]
struct Shared {
    disk: Mutex<Vec<u8>>,
    corrupt: AtomicBool,
}

/// A region's frontend address, guest-physical address and size.
type Addrs = (u64, u64, u64);

/// The guest-physical address of the frontend's virtual address `uaddr`
/// (vhost-user gives ring addresses in that space); an odd address, which
/// ring set-up refuses, if unmapped.
fn to_gpa(table: &[Addrs], uaddr: u64) -> u64 {
    table.iter().find(|&&(u, _, size)| uaddr.wrapping_sub(u) < size).map_or(1, |&(u, gpa, _)| gpa + (uaddr - u))
}

struct Fake {
    acked: u64,
    /// The memory table and its regions as (frontend address, gpa, size).
    mem: Option<(Arc<GuestMemory>, Vec<Addrs>)>,
    ring: RingCfg,
    shared: Arc<Shared>,
    worker: Option<(Arc<AtomicBool>, JoinHandle<u32>)>,
}

fn offered() -> u64 {
    features::VERSION_1
        | features::EVENT_IDX
        | features::RING_PACKED
        | features::PROTOCOL_FEATURES
        | features::BLK_SIZE_MAX
        | features::BLK_SEG_MAX
        | features::BLK_FLUSH
}

/// Runs one request on `disk`; returns the used length, or None to drop it.
fn handle(b: &Batch, c: &Chain, disk: &mut [u8], corrupt: bool) -> Option<u32> {
    let (r, w) = (b.readable(c), b.writable(c));
    if c.write_len == 0 {
        return Some(0); // nowhere to put a status
    }
    let mut hdr = [0u8; 16];
    let mut st = status::IOERR;
    let mut used = 1;
    if r.read(0, &mut hdr) == 16 {
        let t = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
        let off = u64::from_le_bytes(hdr[8..16].try_into().unwrap()).saturating_mul(SECTOR) as usize;
        let inside = |len: usize| off.checked_add(len).is_some_and(|e| e <= disk.len());
        match t {
            types::IN if inside(c.write_len as usize - 1) => {
                let len = c.write_len as usize - 1;
                w.write(0, &disk[off..off + len]);
                if corrupt && (off..off + len).contains(&CORRUPT_AT) {
                    w.write(CORRUPT_AT - off, &[!disk[CORRUPT_AT]]);
                }
                (st, used) = (status::OK, len as u32 + 1);
            }
            types::OUT if inside(c.read_len as usize - 16) => {
                let len = c.read_len as usize - 16;
                r.read(16, &mut disk[off..off + len]);
                st = status::OK;
            }
            types::IN | types::OUT => {}
            types::FLUSH => st = status::OK,
            types::GET_ID => {
                used += w.write(0, &ID[..ID.len().min(c.write_len as usize - 1)]) as u32;
                st = status::OK;
            }
            T_DROP => return None,
            _ => st = status::UNSUPP,
        }
    }
    w.write(c.write_len as usize - 1, &[st]);
    Some(used)
}

impl Fake {
    fn maybe_start(&mut self) {
        let r = &self.ring;
        if self.worker.is_some() || r.size == 0 || r.desc == 0 || !r.kick || !r.enabled {
            return;
        }
        let Some((mem, table)) = self.mem.clone() else { return };
        let mut q = if self.acked & features::RING_PACKED != 0 {
            let cfg = PackedConfig {
                size: r.size,
                desc: to_gpa(&table, r.desc),
                driver: to_gpa(&table, r.avail),
                device: to_gpa(&table, r.used),
                features: self.acked,
                base: r.base,
            };
            Queue::Packed(PackedQueue::new(mem, cfg).unwrap())
        } else {
            let cfg = SplitConfig {
                size: r.size,
                desc: to_gpa(&table, r.desc),
                avail: to_gpa(&table, r.avail),
                used: to_gpa(&table, r.used),
                features: self.acked,
                next_avail: r.base as u16,
            };
            Queue::Split(SplitQueue::new(mem, cfg).unwrap())
        };
        let call = r.call.clone();
        let shared = self.shared.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let h = std::thread::spawn(move || {
            let mut b = Batch::new();
            let mut done: Vec<(u16, u32, usize)> = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let n = q.pop_batch(&mut b, 64, Access::ReadThenWrite);
                if n == 0 {
                    std::thread::sleep(Duration::from_micros(50));
                    continue;
                }
                done.clear();
                let corrupt = shared.corrupt.load(Ordering::Relaxed);
                let mut d = shared.disk.lock().unwrap();
                for c in &b.chains[..n] {
                    if let Some(len) = handle(&b, c, &mut d, corrupt) {
                        done.push((c.head, len, b.readable(c).segs().len() + b.writable(c).segs().len()));
                    }
                }
                drop(d);
                // Reverse order, within runs of chains of the same length: a
                // packed ring's used slots must still add up (each used
                // descriptor skips the slots of the chain it names).
                let mut i = 0;
                while i < done.len() {
                    let j = i + done[i..].iter().take_while(|e| e.2 == done[i].2).count();
                    for &(head, len, _) in done[i..j].iter().rev() {
                        q.add_used(head, len);
                    }
                    i = j;
                }
                q.publish_used();
                if q.needs_notify() {
                    if let Some(f) = &call {
                        let _ = (&**f).write(&1u64.to_ne_bytes());
                    }
                }
            }
            q.vring_base()
        });
        self.worker = Some((stop, h));
    }

    fn stop(&mut self) {
        if let Some((stop, h)) = self.worker.take() {
            stop.store(true, Ordering::Relaxed);
            self.ring.base = h.join().unwrap();
        }
    }

    fn ring(&mut self, index: u32) -> VResult<&mut RingCfg> {
        if index != 0 {
            return Err(vhost::vhost_user::Error::InvalidParam);
        }
        Ok(&mut self.ring)
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
        Ok(offered())
    }
    fn set_features(&mut self, f: u64) -> VResult<()> {
        if f & !offered() != 0 {
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
        self.ring(index)?.base = base;
        Ok(())
    }
    fn get_vring_base(&mut self, index: u32) -> VResult<VhostUserVringState> {
        self.stop();
        let r = self.ring(index)?;
        r.kick = false;
        Ok(VhostUserVringState::new(index, r.base))
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
        Ok(VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::CONFIG)
    }
    fn set_protocol_features(&mut self, _f: u64) -> VResult<()> {
        Ok(())
    }
    fn get_queue_num(&mut self) -> VResult<u64> {
        Ok(1)
    }
    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VResult<()> {
        self.ring(index)?.enabled = enable;
        self.maybe_start();
        Ok(())
    }
    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> VResult<Vec<u8>> {
        let mut cfg = [0u8; blk::CONFIG_LEN];
        cfg[0..8].copy_from_slice(&(DISK as u64 / SECTOR).to_le_bytes());
        cfg[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        cfg[12..16].copy_from_slice(&64u32.to_le_bytes());
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

/// A connected frontend, what it shares with the fake, and the fake's thread.
fn connected(packed: bool) -> (VirtioUser, Arc<Shared>, JoinHandle<()>) {
    let (a, b) = UnixStream::pair().unwrap();
    let shared = Arc::new(Shared { disk: Mutex::new(vec![0u8; DISK]), corrupt: AtomicBool::new(false) });
    let fake = Fake { acked: 0, mem: None, ring: RingCfg::default(), shared: shared.clone(), worker: None };
    let server = std::thread::spawn(move || {
        let backend = Arc::new(Mutex::new(fake));
        let mut h = BackendReqHandler::from_stream(b, backend.clone());
        while h.handle_request().is_ok() {}
        backend.lock().unwrap().stop();
    });
    let mut opts = Options::blk("unused");
    opts.mem_size = 16 << 20;
    if packed {
        opts.features |= features::RING_PACKED;
    }
    (VirtioUser::from_stream(a, opts).unwrap(), shared, server)
}

#[test]
fn verify_with_reversed_completions_on_split_and_packed_rings() {
    for packed in [false, true] {
        let (mut dev, shared, server) = connected(packed);
        assert_eq!(dev.packed(), packed);
        let cfg = dev.blk_config().unwrap();
        assert_eq!((cfg.capacity, cfg.size_max, cfg.seg_max), (DISK as u64 / SECTOR, SIZE_MAX, 64));
        let mut qs = vec![dev.blk_queue(0, 16, 64 << 10).unwrap()];
        // 64 KiB requests go out as 8 data descriptors of size_max.
        assert_eq!(qs[0].seg_size(), SIZE_MAX);
        for (bs, seed, poll) in [(4096, 1, false), (64 << 10, 2, true), (1536, 3, false)] {
            let w = Workload { seed, poll, iodepth: 16, ..Workload::new(Mode::Verify, bs) };
            let r = workload::run(&mut qs, cfg.capacity, &w, None).unwrap();
            eprintln!("packed={packed}: {}", r.summary());
            assert!(r.passed(), "{:?} {:?}", r.first_error, r.mismatch);
            assert_eq!(r.flush, Some(status::OK));
            assert!(r.reordered > 0, "the fake reverses every batch");
            let blocks = DISK as u64 / bs as u64;
            assert_eq!(r.verified_blocks, blocks);
            let d = shared.disk.lock().unwrap();
            assert_eq!(check_pattern(&d[..(blocks * bs as u64) as usize], 0, seed), None);
        }
        let w = Workload { count: Some(3000), ..Workload::new(Mode::RandRead, 4096) };
        let r = workload::run(&mut qs, cfg.capacity, &w, None).unwrap();
        assert!(r.passed() && r.ios == 3000, "{}", r.summary());
        let q = &mut qs[0];
        let r = q.request(BlkOp::GetId, &[], Duration::from_secs(5)).unwrap();
        assert_eq!((r.status, r.used_len, &r.data[..]), (status::OK, 21, &ID[..]));
        let bases = dev.disconnect().unwrap();
        assert_eq!(bases.len(), 1);
        server.join().unwrap();
    }
}

#[test]
fn raw_chains_and_timeouts() {
    let (mut dev, _shared, server) = connected(false);
    let mut q = dev.blk_queue(0, 4, 4096).unwrap();
    let t = Duration::from_secs(5);
    let hdr = blk::header(types::OUT, 2);
    // No status byte at all: the device can only return the chain, length 0.
    let r = q.request_raw(&[RawSeg::Readable(&hdr), RawSeg::Readable(&[7; 512])], t).unwrap();
    assert_eq!((r.status, r.used_len, r.data.len()), (STATUS_NOT_WRITTEN, 0, 0));
    // The "status" in a read-only buffer: the same.
    let r = q.request_raw(&[RawSeg::Readable(&blk::header(types::FLUSH, 0)), RawSeg::Readable(&[0xff])], t).unwrap();
    assert_eq!((r.status, r.used_len), (STATUS_NOT_WRITTEN, 0));
    // A header cut short.
    let r = q.request_raw(&[RawSeg::Readable(&hdr[..8]), RawSeg::Writable(1)], t).unwrap();
    assert_eq!((r.status, r.used_len), (status::IOERR, 1));
    // Typed requests still work after raw ones took the slots' chains.
    assert_eq!(q.run_one(BlkOp::Read { sector: 0, len: 4096 }).unwrap(), (status::OK, 4097));
    assert_eq!(q.run_one(BlkOp::Other { req_type: 99, sector: 0, len: 0, writable: false }).unwrap().0, status::UNSUPP);
    // A request the device never completes: a bounded wait, then an error;
    // the slot stays in flight, so synchronous requests refuse to start.
    let e = q.request(
        BlkOp::Other { req_type: T_DROP, sector: 0, len: 0, writable: false },
        &[],
        Duration::from_millis(200),
    );
    assert!(matches!(e, Err(Error::Timeout(_))), "{e:?}");
    assert_eq!(q.in_flight(), 1);
    assert!(matches!(q.run_one(BlkOp::Flush), Err(Error::Config(_))));
    // Asynchronous requests still flow around it.
    assert!(q.submit(BlkOp::Flush, 42, |_| {}).unwrap());
    q.flush().unwrap();
    let mut got = None;
    for _ in 0..250 {
        q.poll(|c, _| got = Some((c.user, c.status))).unwrap();
        if got.is_some() {
            break;
        }
        q.wait(Duration::from_millis(20)).unwrap();
    }
    assert_eq!(got, Some((42, status::OK)));
    drop(dev);
    drop(q);
    server.join().unwrap();
}

#[test]
fn verify_names_the_first_mismatch() {
    let (mut dev, shared, server) = connected(true);
    let cap = dev.blk_config().unwrap().capacity;
    let mut qs = vec![dev.blk_queue(0, 8, 4096).unwrap()];
    shared.corrupt.store(true, Ordering::Relaxed);
    let w = Workload { seed: 9, ..Workload::new(Mode::Verify, 4096) };
    let r = workload::run(&mut qs, cap, &w, None).unwrap();
    eprintln!("{}", r.summary());
    assert_eq!(r.errors, 0);
    assert_eq!(r.mismatch, Some(CORRUPT_AT as u64));
    assert!(!r.passed());
    assert!(r.summary().contains(&format!("verify=mismatch first_mismatch={CORRUPT_AT}")));
    // The disk itself holds the pattern: only the reads were wrong.
    assert_eq!(check_pattern(&shared.disk.lock().unwrap(), 0, 9), None);
    dev.disconnect().unwrap();
    server.join().unwrap();
}
