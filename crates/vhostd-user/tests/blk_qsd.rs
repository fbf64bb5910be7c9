//! vhostd-user's blk mode against a real vhost-user-blk backend: QEMU's
//! `qemu-storage-daemon` exporting a temporary file (or a null-co node).
//! Skipped (passing, with a note) when qemu-storage-daemon is not installed.
//!
//! Every daemon, socket and file belongs to a guard that kills and reaps
//! the daemon and removes its directory on drop, failures included; every
//! wait is bounded.

use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use vhostd_user::blk::workload::{self, check_pattern, fill_pattern, Mode, Workload};
use vhostd_user::blk::{self, status, types, BlkOp, RawSeg, SECTOR};
use vhostd_user::{features, Options, VirtioUser};

const QSD: &str = "qemu-storage-daemon";
const TIMEOUT: Duration = Duration::from_secs(10);

fn qsd_installed() -> bool {
    let ok = Command::new(QSD)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("note: {QSD} is not installed; skipping");
    }
    ok
}

/// A private directory removed (with everything in it) on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "vhostd-user-qsd-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A running qemu-storage-daemon exporting one vhost-user-blk socket.
/// Field order matters: the daemon dies before its directory goes.
struct Qsd {
    child: Child,
    sock: PathBuf,
    log: PathBuf,
    dir: TempDir,
}

impl Drop for Qsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the export serves.
enum Disk {
    /// A file of this many bytes (zeros).
    File(u64),
    /// A null-co node of this many bytes.
    Null(u64),
}

impl Qsd {
    /// Starts the daemon (`extra` goes at the end of the export option)
    /// and waits up to 10 s for its socket to accept connections.
    fn start(disk: Disk, extra: &str) -> Qsd {
        let dir = TempDir::new();
        let sock = dir.0.join("blk.sock");
        let log = dir.0.join("qsd.log");
        let (blockdev, node) = match disk {
            Disk::File(size) => {
                let img = dir.0.join("disk.img");
                File::create(&img).unwrap().set_len(size).unwrap();
                (format!("driver=file,node-name=f,filename={}", img.display()), "f")
            }
            Disk::Null(size) => (format!("driver=null-co,node-name=n,size={size},read-zeroes=on"), "n"),
        };
        let export = format!(
            "type=vhost-user-blk,id=e,node-name={node},addr.type=unix,addr.path={},writable=on{extra}",
            sock.display()
        );
        let logf = File::create(&log).unwrap();
        let child = Command::new(QSD)
            .args(["--blockdev", &blockdev, "--export", &export])
            .stdin(Stdio::null())
            .stdout(logf.try_clone().unwrap())
            .stderr(logf)
            .spawn()
            .unwrap();
        let mut q = Qsd { child, sock, log, dir };
        let deadline = Instant::now() + TIMEOUT;
        loop {
            if let Ok(Some(st)) = q.child.try_wait() {
                panic!("{QSD} exited with {st}: {}", q.log_text());
            }
            // Connecting may still be refused for a moment: `open` retries.
            if q.sock.exists() {
                break;
            }
            assert!(Instant::now() < deadline, "{QSD} socket did not appear: {}", q.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        q
    }

    fn image(&self) -> PathBuf {
        self.dir.0.join("disk.img")
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A blk connection, asking for a packed ring if `packed` (not required).
    fn open(&self, packed: bool) -> VirtioUser {
        open(&self.sock, packed, |_| {})
    }
}

fn open(sock: &Path, packed: bool, edit: impl FnOnce(&mut Options)) -> VirtioUser {
    let mut o = Options::blk(sock);
    o.mem_size = 32 << 20;
    if packed {
        o.features |= features::RING_PACKED;
    }
    edit(&mut o);
    // The socket may exist before qsd listens on it: retry briefly.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match VirtioUser::connect(o.clone()) {
            Ok(d) => return d,
            Err(e) if Instant::now() < deadline => {
                eprintln!("connect: {e}; retrying");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("connect: {e}"),
        }
    }
}

#[test]
fn config_capacity_matches_the_file_and_the_null_node() {
    if !qsd_installed() {
        return;
    }
    // Not a whole number of MiB, so nothing rounds it by accident.
    let size = (8 << 20) + 3 * 512;
    let q = Qsd::start(Disk::File(size), "");
    let dev = q.open(false);
    let cfg = dev.blk_config().unwrap();
    assert_eq!(cfg.capacity, size / SECTOR);
    assert_eq!(cfg.capacity_bytes(), size);
    let f = dev.features();
    assert_ne!(f & features::VERSION_1, 0);
    assert_eq!(f & features::BLK_RO, 0, "exported writable");
    eprintln!(
        "qsd offers {:#x}, negotiated {:#x}, protocol {:#x}; config {cfg:?}",
        dev.offered_features(),
        f,
        dev.protocol_features().bits()
    );

    let n = Qsd::start(Disk::Null(1 << 30), "");
    let mut dev = n.open(false);
    assert_eq!(dev.blk_config().unwrap().capacity, (1 << 30) / SECTOR);
    let mut qs = vec![dev.blk_queue(0, 16, 4096).unwrap()];
    let w = Workload { count: Some(2000), ..Workload::new(Mode::RandRead, 4096) };
    let r = workload::run(&mut qs, (1 << 30) / SECTOR, &w, None).unwrap();
    eprintln!("{}", r.summary());
    assert!(r.passed(), "{:?}", r.first_error);
    assert_eq!(r.ios, 2000);
}

fn verify_on(q: &Qsd, packed: bool) {
    let mut dev = q.open(packed);
    if packed && !dev.packed() {
        assert_eq!(dev.offered_features() & features::RING_PACKED, 0);
        eprintln!("note: {QSD} does not offer VIRTIO_F_RING_PACKED: the ring fell back to split");
    }
    assert_eq!(dev.packed(), packed && dev.offered_features() & features::RING_PACKED != 0);
    let cap = dev.blk_config().unwrap().capacity;
    let mut qs = vec![dev.blk_queue(0, 16, 64 << 10).unwrap()];
    for (bs, seed) in [(4096, 11), (64 << 10, 12), (512, 13)] {
        let w =
            Workload { seed, count: Some(if bs == 512 { 600 } else { u64::MAX }), ..Workload::new(Mode::Verify, bs) };
        let r = workload::run(&mut qs, cap, &w, None).unwrap();
        eprintln!("{} ring: {}", if dev.packed() { "packed" } else { "split" }, r.summary());
        assert!(r.passed(), "errors {:?} mismatch {:?}", r.first_error, r.mismatch);
        assert_eq!(r.flush, Some(status::OK));
        assert_eq!(r.verified_blocks, if bs == 512 { 600 } else { cap * SECTOR / bs as u64 });
    }
    // The file holds the last pattern (seed 13) over its first 600 sectors,
    // and seed 12's beyond.
    let img = fs::read(q.image()).unwrap();
    assert_eq!(check_pattern(&img[..600 * 512], 0, 13), None);
    assert_eq!(check_pattern(&img[600 * 512..], 600 * 512, 12), None);
    dev.disconnect().unwrap();
}

#[test]
fn verify_split_ring() {
    if !qsd_installed() {
        return;
    }
    let q = Qsd::start(Disk::File(4 << 20), "");
    verify_on(&q, false);
}

#[test]
fn verify_packed_ring_or_fallback() {
    if !qsd_installed() {
        return;
    }
    let q = Qsd::start(Disk::File(4 << 20), "");
    verify_on(&q, true);
}

#[test]
fn requests_of_every_type() {
    if !qsd_installed() {
        return;
    }
    let size = 4u64 << 20;
    let q = Qsd::start(Disk::File(size), "");
    let mut dev = q.open(false);
    let f = dev.features();
    let cap = dev.blk_config().unwrap().capacity;
    let mut bq = dev.blk_queue(0, 4, 8192).unwrap();

    // A write lands in the file at its offset.
    let mut data = vec![0u8; 8192];
    fill_pattern(&mut data, 24 * 512, 99);
    let r = bq.request(BlkOp::Write { sector: 24, len: 8192 }, &data, TIMEOUT).unwrap();
    assert_eq!(r.status, status::OK);
    assert_eq!(r.used_len, 1);
    assert_ne!(f & features::BLK_FLUSH, 0);
    assert_eq!(bq.run_one(BlkOp::Flush).unwrap().0, status::OK);
    let mut on_disk = vec![0u8; 8192];
    File::open(q.image()).unwrap().read_exact_at(&mut on_disk, 24 * 512).unwrap();
    assert_eq!(on_disk, data);
    // And reads back, with the used length covering data and status.
    let r = bq.request(BlkOp::Read { sector: 24, len: 8192 }, &[], TIMEOUT).unwrap();
    assert_eq!((r.status, r.used_len), (status::OK, 8193));
    assert!(r.completion.ok());
    assert_eq!(r.data, data);

    // Past the end: IOERR, whether it starts there or crosses it.
    assert_eq!(bq.run_one(BlkOp::Read { sector: cap, len: 512 }).unwrap().0, status::IOERR);
    assert_eq!(bq.run_one(BlkOp::Read { sector: cap - 1, len: 1024 }).unwrap().0, status::IOERR);
    assert_eq!(bq.run_one(BlkOp::Write { sector: cap, len: 512 }).unwrap().0, status::IOERR);

    // GET_ID: a 20-byte id, or UNSUPP.
    let r = bq.request(BlkOp::GetId, &[], TIMEOUT).unwrap();
    assert!(r.status == status::OK || r.status == status::UNSUPP, "GET_ID status {}", r.status);
    if r.status == status::OK {
        assert_eq!(r.data.len(), blk::ID_LEN);
        assert!(r.used_len as usize <= blk::ID_LEN + 1);
    }
    eprintln!("GET_ID: status {} used {} id {:?}", r.status, r.used_len, String::from_utf8_lossy(&r.data));

    // An unknown type: UNSUPP.
    let op = BlkOp::Other { req_type: 0x7777, sector: 0, len: 512, writable: true };
    assert_eq!(bq.run_one(op).unwrap().0, status::UNSUPP);

    // WRITE_ZEROES (and DISCARD) over part of what was written.
    if f & features::BLK_WRITE_ZEROES != 0 {
        let op = BlkOp::WriteZeroes { sector: 26, sectors: 4, flags: 0 };
        assert_eq!(bq.run_one(op).unwrap().0, status::OK);
        File::open(q.image()).unwrap().read_exact_at(&mut on_disk, 24 * 512).unwrap();
        assert_eq!(on_disk[..1024], data[..1024]);
        assert!(on_disk[1024..3072].iter().all(|&b| b == 0));
        assert_eq!(on_disk[3072..], data[3072..]);
    }
    if f & features::BLK_DISCARD != 0 {
        let op = BlkOp::Discard { sector: 0, sectors: 8, flags: 0 };
        assert_eq!(bq.run_one(op).unwrap().0, status::OK);
    }

    // A well-formed request built raw: header, data, status.
    let hdr = blk::header(types::IN, 24);
    let r = bq.request_raw(&[RawSeg::Readable(&hdr), RawSeg::Writable(512), RawSeg::Writable(1)], TIMEOUT).unwrap();
    assert_eq!((r.status, r.used_len, r.data.len()), (status::OK, 513, 513));
    assert_eq!(r.data[..512], data[..512]);
    assert_eq!(r.completion.req_type, types::IN);
    // Raw chains need readable buffers first.
    assert!(bq.submit_raw(&[RawSeg::Writable(1), RawSeg::Readable(&hdr)], 0).is_err());
    assert_eq!(bq.in_flight(), 0);
    dev.disconnect().unwrap();
}

#[test]
fn two_queues_out_of_order() {
    if !qsd_installed() {
        return;
    }
    let q = Qsd::start(Disk::File(4 << 20), ",num-queues=2");
    let mut dev = q.open(false);
    let cfg = dev.blk_config().unwrap();
    assert_ne!(dev.features() & features::BLK_MQ, 0);
    assert_eq!(cfg.num_queues, 2);
    assert!(dev.max_queues() >= 2, "GET_QUEUE_NUM {}", dev.max_queues());
    let mut qs = vec![dev.blk_queue(0, 32, 4096).unwrap(), dev.blk_queue(1, 32, 4096).unwrap()];
    let w = Workload { count: Some(4000), seed: 5, ..Workload::new(Mode::RandWrite, 4096) };
    let r = workload::run(&mut qs, cfg.capacity, &w, None).unwrap();
    eprintln!("{}", r.summary());
    assert!(r.passed(), "{:?}", r.first_error);
    let w = Workload { seed: 6, ..Workload::new(Mode::Verify, 4096) };
    let r = workload::run(&mut qs, cfg.capacity, &w, None).unwrap();
    eprintln!("{}", r.summary());
    assert!(r.passed(), "{:?} {:?}", r.first_error, r.mismatch);
    assert_eq!(qs[0].in_flight() + qs[1].in_flight(), 0);
    // Both queues carried requests.
    assert!(qs.iter().all(|q| q.queue.ring.stats().used > 100));
    dev.disconnect().unwrap();
}

/// Runs the vhostd-user binary (60 s at most; killed after that) and
/// returns its exit code, stdout and stderr.
fn run_cli(dir: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let (out, err) = (dir.join("cli.out"), dir.join("cli.err"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_vhostd-user"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(File::create(&out).unwrap())
        .stderr(File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("vhostd-user {args:?} did not finish in 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| fs::read_to_string(p).unwrap_or_default();
    (status.code(), read(&out), read(&err))
}

#[test]
fn cli_verify_prints_one_summary_line() {
    if !qsd_installed() {
        return;
    }
    let q = Qsd::start(Disk::File(4 << 20), "");
    let sock = q.sock.to_str().unwrap();
    let (code, out, err) =
        run_cli(&q.dir.0, &["blk", "--socket-path", sock, "--mode", "verify", "--size", "2m", "--bs", "8k"]);
    assert_eq!(code, Some(0), "stdout {out} stderr {err}");
    let line = out.trim();
    assert_eq!(line.lines().count(), 1, "{out}");
    assert!(line.starts_with("blk mode=verify bs=8192 iodepth=32 queues=1 ios=513 errors=0 "), "{line}");
    for key in [
        "iops=",
        "mbps=",
        " lat_us p50=",
        " p90=",
        " p99=",
        " p999=",
        " max=",
        " verify=ok",
        " blocks=256",
        " flush=ok",
    ] {
        assert!(line.contains(key), "{key} missing in {line}");
    }

    let (code, out, err) = run_cli(
        &q.dir.0,
        &["blk", "--socket-path", sock, "--mode", "randread", "--count", "300", "--iodepth", "4", "--poll", "on"],
    );
    assert_eq!(code, Some(0), "stdout {out} stderr {err}");
    assert!(out.starts_with("blk mode=randread bs=4096 iodepth=4 queues=1 ios=300 errors=0 "), "{out}");

    // A region larger than the disk: refused, exit 1.
    let (code, _, err) = run_cli(&q.dir.0, &["blk", "--socket-path", sock, "--mode", "read", "--size", "1g"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("exceeds the disk"), "{err}");
    // A packed ring the backend does not offer: refused, exit 1.
    let (code, out, err) =
        run_cli(&q.dir.0, &["blk", "--socket-path", sock, "--mode", "read", "--packed", "on", "--count", "10"]);
    if code == Some(0) {
        assert!(err.contains("packed rings"), "{err}");
    } else {
        assert_eq!(code, Some(1), "stdout {out} stderr {err}");
        assert!(err.contains("does not support required features"), "{err}");
    }
}
