//! vhostd's virtio-scsi device (`vhostd scsi`) driven through the project's
//! own vhost-user frontend (`vhostd-user`'s scsi mode): every command on
//! file-backed and null units with its exact data, sense and residual
//! (data written checked in the image file itself, UNMAP and WRITE SAME
//! checked as holes in it), hostile chains and CDBs (each answered and
//! counted exactly, the device serving on), task management on commands
//! hung in a FUSE disk (root only), hotplug events, reconnects with
//! inflight tracking under writes, and the workload engine over split and
//! packed rings, one and two request queues.
//!
//! Every daemon is killed, every mount unmounted and every file removed on
//! drop, failures included; every wait is bounded.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use vhostd_user::blk::workload::{check_pattern, fill_pattern, fill_pattern_shared, Mode, Workload};
use vhostd_user::blk::RawSeg;
use vhostd_user::scsi::{
    self, ctrl, event, key, lun_field, op, response, status, tmf, Cmd, CmdReq, Data, ScsiCompletion, ScsiCtrl,
    ScsiQueue, ScsiReply, POISON, RESPONSE_NOT_WRITTEN, RESP_LEN,
};
use vhostd_user::{features as f, Options, VhostUserProtocolFeatures, VirtioUser};

const T: Duration = Duration::from_secs(10);
/// Seed of the pattern every image starts with ("untouched" means this).
const BG: u64 = 0xb6;
/// crates/scsi: 512 KiB per READ or WRITE, in 512-byte blocks.
const MAX_TRANSFER_BLOCKS: u32 = 1024;
/// The device's name on vhostd's command line (units' serials and NAAs
/// derive from it).
const DEV: &str = "scsi0";
const RESP: u32 = RESP_LEN as u32;

// ---------------------------------------------------------------------------
// Helpers.
// ---------------------------------------------------------------------------

/// A scratch directory removed with its contents on drop.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        Dir(tempdir())
    }

    /// A directory in /dev/shm; None (said) if that is not a tmpfs.
    fn in_shm() -> Option<Dir> {
        if !shm_is_tmpfs() {
            return None;
        }
        let t = tempdir();
        let _ = fs::remove_dir_all(&t);
        let p = Path::new("/dev/shm").join(t.file_name().unwrap());
        fs::create_dir_all(&p).unwrap();
        Some(Dir(p))
    }

    /// An image `name` of `size` bytes holding the background pattern.
    fn image(&self, name: &str, size: u64) -> PathBuf {
        let p = self.0.join(name);
        let mut buf = vec![0u8; size as usize];
        fill_pattern(&mut buf, 0, BG);
        fs::write(&p, &buf).unwrap();
        // Allocated for real (not delayed), so block counts are stable.
        File::open(&p).unwrap().sync_all().unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn file_lun(n: u16, img: &Path, opts: &str) -> String {
    format!("{n}=file,path={}{opts}", img.display())
}

/// `vhostd scsi --socket-path <tmp> --lun L... <extra>`, listening.
fn start(luns: &[String], extra: &[&str]) -> Daemon {
    start_at(None, luns, extra)
}

/// `start` on socket `sock` (one that outlives the daemon, for restarts).
fn start_at(sock: Option<&Path>, luns: &[String], extra: &[&str]) -> Daemon {
    let mut args = Vec::new();
    for l in luns {
        args.push("--lun".to_string());
        args.push(l.clone());
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    let fixed = sock.map(Path::to_path_buf);
    Daemon::start_with(None, move |own| {
        let sock = fixed.unwrap_or_else(|| own.to_path_buf());
        let mut v = vec!["scsi".to_string(), "--socket-path".to_string(), sock.display().to_string()];
        v.extend(args);
        v
    })
}

fn options(sock: &Path, packed: bool) -> Options {
    let mut o = Options::scsi(sock);
    if packed {
        o.features |= f::RING_PACKED;
        o.required |= f::RING_PACKED;
    }
    o
}

/// A scsi connection with split or (required) packed rings.
fn connect(d: &Daemon, packed: bool) -> VirtioUser {
    let dev = VirtioUser::connect(options(&d.sock, packed))
        .unwrap_or_else(|e| panic!("connect: {e}; vhostd log:\n{}", d.log()));
    assert_eq!(dev.packed(), packed);
    dev
}

fn read_file(p: &Path, off: u64, len: usize) -> Vec<u8> {
    image::read(p, off, len)
}

/// `len` bytes of the image at `off` are still the background pattern.
fn assert_bg(p: &Path, off: u64, len: usize) {
    image::assert_pattern(p, off, len, BG)
}

use image::allocated;
use image::{assert_zero, seek};

/// Fixed-format sense data (SPC-4 4.5.3), current error: 18 bytes.
fn fixed_sense(s: (u8, u8, u8)) -> Vec<u8> {
    let mut v = vec![0u8; 18];
    v[0] = 0x70;
    v[2] = s.0;
    v[7] = 10;
    v[12] = s.1;
    v[13] = s.2;
    v
}

/// Descriptor-format sense data (SPC-4 4.5.2), no descriptors: 8 bytes.
fn descriptor_sense(s: (u8, u8, u8)) -> Vec<u8> {
    vec![0x72, s.0, s.1, s.2, 0, 0, 0, 0]
}

const INVALID_OPCODE: (u8, u8, u8) = (key::ILLEGAL_REQUEST, 0x20, 0x00);
const LBA_OUT_OF_RANGE: (u8, u8, u8) = (key::ILLEGAL_REQUEST, 0x21, 0x00);
const INVALID_FIELD_IN_CDB: (u8, u8, u8) = (key::ILLEGAL_REQUEST, 0x24, 0x00);
const LUN_NOT_SUPPORTED: (u8, u8, u8) = (key::ILLEGAL_REQUEST, 0x25, 0x00);
const INVALID_FIELD_IN_PARAMETER_LIST: (u8, u8, u8) = (key::ILLEGAL_REQUEST, 0x26, 0x00);
const PARAMETER_LIST_LENGTH_ERROR: (u8, u8, u8) = (key::ILLEGAL_REQUEST, 0x1a, 0x00);
const SAVING_PARAMETERS_NOT_SUPPORTED: (u8, u8, u8) = (key::ILLEGAL_REQUEST, 0x39, 0x00);
const WRITE_PROTECTED: (u8, u8, u8) = (key::DATA_PROTECT, 0x27, 0x00);

/// The standard INQUIRY data vhostd's units answer (SPC-4 6.6.2):
/// direct-access block device, SPC-4, HISUP, response format 2, CMDQUE.
fn standard_inquiry() -> Vec<u8> {
    let mut v = vec![0x00, 0x00, 0x06, 0x12, 31, 0, 0, 0x02];
    v.extend_from_slice(b"VHOSTD  ");
    v.extend_from_slice(b"vhostd disk     ");
    v.extend_from_slice(b"0001");
    v
}

/// The unit's NAA identifier: NAA 3 (locally assigned) over the 60 low
/// bits of FNV-1a of "DEVICE:LUN" (crates/scsi: stable for the same name).
fn naa_of(device: &str, lun: u16) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in format!("{device}:{lun}").bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (3 << 60) | (h & ((1 << 60) - 1))
}

/// VPD page 0x83 as vhostd answers it for unit `lun` of `device`: the NAA
/// designator and a T10 vendor designator (vendor + serial).
fn device_identification(device: &str, lun: u16) -> Vec<u8> {
    let serial = format!("{device}-{lun}");
    let mut body = vec![0x01, 0x03, 0x00, 8];
    body.extend_from_slice(&naa_of(device, lun).to_be_bytes());
    body.extend_from_slice(&[0x02, 0x01, 0x00, 8 + serial.len() as u8]);
    body.extend_from_slice(b"VHOSTD  ");
    body.extend_from_slice(serial.as_bytes());
    vpd(0x83, &body)
}

fn vpd(page: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![0, page];
    v.extend_from_slice(&(body.len() as u16).to_be_bytes());
    v.extend_from_slice(body);
    v
}

/// Every per-queue counter a request queue prints that a test can know
/// exactly.
const REQ_COUNTERS: &[&str] = &[
    "commands",
    "reads",
    "writes",
    "flushes",
    "unmaps",
    "bytes_read",
    "bytes_written",
    "check_conditions",
    "bad_lun",
    "overruns",
    "no_response",
    "backend_errors",
    "aborted",
    "bad_chains",
];

/// The counters a request queue must end up with.
#[derive(Clone, Debug, Default)]
struct Tally(BTreeMap<&'static str, u64>);

impl Tally {
    fn add(&mut self, k: &'static str, n: u64) {
        assert!(REQ_COUNTERS.contains(&k), "unknown counter {k}");
        *self.0.entry(k).or_default() += n;
    }

    fn count(&mut self, keys: &[&'static str]) {
        for k in keys {
            self.add(k, 1);
        }
    }

    fn get(&self, k: &str) -> u64 {
        self.0.get(k).copied().unwrap_or(0)
    }
}

/// Request queue `q` (virtqueue number) counted exactly `want`; every
/// counter not named is 0.
fn expect_queue(s: &Stats, q: usize, want: &Tally) {
    let got: Vec<(&str, u64)> = REQ_COUNTERS.iter().map(|&k| (k, s.queue(q, k))).collect();
    let exp: Vec<(&str, u64)> = REQ_COUNTERS.iter().map(|&k| (k, want.get(k))).collect();
    assert_eq!(got, exp, "queue {q} counters");
}

/// The `stats total` line agrees with the request queues' lines.
fn check_totals(s: &Stats) {
    let sum = |k: &str| {
        s.queues
            .iter()
            .filter(|(_, m)| m.get("dir").map(String::as_str) == Some("req"))
            .map(|(&q, _)| s.queue(q, k))
            .sum::<u64>()
    };
    for k in ["commands", "reads", "writes", "bytes_read", "bytes_written", "check_conditions"] {
        assert_eq!(s.total(k), sum(k), "total {k}");
    }
    let bad = sum("bad_chains");
    assert_eq!(s.total("errors"), sum("backend_errors") + sum("no_response") + bad, "total errors");
}

/// A request queue, the image behind LUN 0 (if a file) and the counters
/// vhostd must end up with for the queue.
struct Q {
    q: ScsiQueue,
    t: Tally,
    img: Option<PathBuf>,
}

impl Q {
    fn new(q: ScsiQueue, img: Option<&Path>) -> Q {
        Q { q, t: Tally::default(), img: img.map(Path::to_path_buf) }
    }

    /// One command on unit `lun`, synchronously (counted in `commands`).
    fn run(&mut self, lun: u16, cmd: Cmd, out: &[u8]) -> ScsiReply {
        self.q.set_lun(lun);
        let r = self.q.request(cmd, out, T).unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        self.t.count(&["commands"]);
        r
    }

    /// A command answered GOOD, with the used length its transfer gives
    /// and `residual` bytes of its buffer left; returns the data-in moved.
    fn good_resid(&mut self, lun: u16, cmd: Cmd, out: &[u8], residual: u32, keys: &[&'static str]) -> Vec<u8> {
        let r = self.run(lun, cmd, out);
        let c = &r.completion;
        assert_eq!(
            (c.resp.response, c.resp.status, c.resp.sense_len, c.resp.residual),
            (response::OK, status::GOOD, 0, residual),
            "LUN {lun} {cmd:?}: {:?}",
            c.problem()
        );
        assert_eq!(c.used_len, RESP + c.transferred_in(), "LUN {lun} {cmd:?}");
        self.t.count(keys);
        r.data_in().to_vec()
    }

    /// `good_resid` for a command whose data buffer it fills exactly (data
    /// commands answered here: pass the expected length as the buffer).
    fn good(&mut self, lun: u16, cmd: Cmd, out: &[u8], keys: &[&'static str]) -> Vec<u8> {
        self.good_resid(lun, cmd, out, 0, keys)
    }

    /// A command answered CHECK CONDITION with exactly `sense` (fixed
    /// format), nothing transferred: used length 108, the whole buffer a
    /// residual, a data-in buffer untouched.
    fn check(&mut self, lun: u16, cmd: Cmd, out: &[u8], sense: (u8, u8, u8), keys: &[&'static str]) {
        let r = self.run(lun, cmd, out);
        let c = &r.completion;
        assert_eq!(
            (c.resp.response, c.resp.status, c.resp.residual, c.used_len),
            (response::OK, status::CHECK_CONDITION, cmd.data.len(), RESP),
            "LUN {lun} {cmd:?}"
        );
        assert_eq!(c.sense_bytes(), &fixed_sense(sense)[..], "LUN {lun} {cmd:?}: sense");
        if let Data::In(_) = cmd.data {
            assert!(r.data.iter().all(|&b| b == POISON), "LUN {lun} {cmd:?}: data-in written on CHECK CONDITION");
        }
        self.t.count(&["check_conditions"]);
        self.t.count(keys);
    }

    /// A transport response other than OK (OVERRUN, BAD_TARGET, FAILURE):
    /// status 0, no sense, used length 108, `residual`.
    fn refused(&mut self, lun: u16, cmd: Cmd, out: &[u8], resp: u8, residual: u32, keys: &[&'static str]) {
        let r = self.run(lun, cmd, out);
        let c = &r.completion;
        assert_eq!(
            (c.resp.response, c.resp.status, c.resp.sense_len, c.resp.residual, c.used_len),
            (resp, status::GOOD, 0, residual, RESP),
            "LUN {lun} {cmd:?}"
        );
        if let Data::In(_) = cmd.data {
            assert!(r.data.iter().all(|&b| b == POISON), "LUN {lun} {cmd:?}: data-in written");
        }
        self.t.count(keys);
    }

    /// READ(16) of `blocks` from `lba` of unit `lun`.
    fn read(&mut self, lun: u16, lba: u64, blocks: u32) -> Vec<u8> {
        let d = self.good(lun, Cmd::read_16(lba, blocks, 512), &[], &["reads"]);
        self.t.add("bytes_read", blocks as u64 * 512);
        d
    }

    /// WRITE(16) of `data` at `lba` of unit `lun`.
    fn write(&mut self, lun: u16, lba: u64, data: &[u8]) {
        let blocks = (data.len() / 512) as u32;
        self.good(lun, Cmd::write_16(lba, blocks, 512), data, &["writes"]);
        self.t.add("bytes_written", data.len() as u64);
    }

    /// The queue still serves a normal READ of LUN 0 correctly: 4 KiB at
    /// LBA 8, as the image holds them now.
    fn still_serves(&mut self) {
        let img = self.img.clone().expect("LUN 0 is a file");
        let d = self.read(0, 8, 8);
        assert_eq!(d, read_file(&img, 8 * 512, 4096), "a normal READ after a bad command");
    }

    /// A raw chain (counted in `commands` and `keys`).
    fn raw(&mut self, segs: &[RawSeg], keys: &[&'static str]) -> ScsiReply {
        let r = self.q.request_raw(segs, T).unwrap();
        self.t.count(&["commands"]);
        self.t.count(keys);
        r
    }
}

/// Ends the connection as a driver would (GET_VRING_BASE on every ring)
/// and stops the daemon; request queue 0 (virtqueue 2) must have counted
/// exactly `q`'s tally, and the totals agree. Returns the counters.
fn finish(q: Q, dev: VirtioUser, d: Daemon) -> Stats {
    let t = q.t.clone();
    drop(q.q);
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_queue(&s, 2, &t);
    check_totals(&s);
    s
}

/// Takes completions from `queues` until `n` came (bounded), keyed by the
/// caller's tag.
fn collect(queues: &mut [&mut ScsiQueue], n: usize) -> BTreeMap<u64, (ScsiCompletion, Vec<u8>)> {
    let mut got = BTreeMap::new();
    let deadline = Instant::now() + T;
    while got.len() < n {
        for q in queues.iter_mut() {
            q.poll(|c, data| {
                assert!(got.insert(c.user, (c.clone(), data.to_vec())).is_none(), "tag {} completed twice", c.user);
            })
            .unwrap();
        }
        assert!(Instant::now() < deadline, "{} of {n} completions in {T:?}", got.len());
        if got.len() < n {
            queues[0].wait(Duration::from_millis(5)).unwrap();
        }
    }
    got
}

// ---------------------------------------------------------------------------
// 1. INQUIRY and vital product data.
// ---------------------------------------------------------------------------

#[test]
fn inquiry_and_vital_product_data_are_exact() {
    let dir = Dir::new();
    let img0 = dir.image("lun0.img", 4 << 20);
    let img1 = dir.image("lun1.img", 1 << 20);
    let luns = vec![file_lun(0, &img0, ",discard=on"), file_lun(1, &img1, ",readonly=on"), "300=null,size=1G".into()];
    let d = start(&luns, &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.scsi_queue(0, 4, 64 << 10).unwrap(), Some(&img0));
    let mut ids = BTreeMap::new();
    for (lun, discard) in [(0u16, true), (1, false), (300, true)] {
        // Standard data, cut to the allocation length; the rest of a
        // larger buffer is a residual.
        assert_eq!(q.good_resid(lun, Cmd::inquiry(None, 96), &[], 60, &[]), standard_inquiry());
        assert_eq!(q.good(lun, Cmd::inquiry(None, 5), &[], &[]), standard_inquiry()[..5]);
        // The pages offered.
        let pages = vpd(0x00, &[0x00, 0x80, 0x83, 0xb0, 0xb1, 0xb2]);
        assert_eq!(q.good_resid(lun, Cmd::inquiry(Some(0x00), 255), &[], 255 - 10, &[]), pages);
        let serial = format!("{DEV}-{lun}");
        let want = vpd(0x80, serial.as_bytes());
        assert_eq!(q.good_resid(lun, Cmd::inquiry(Some(0x80), 255), &[], 255 - want.len() as u32, &[]), want);
        let id = device_identification(DEV, lun);
        assert_eq!(q.good_resid(lun, Cmd::inquiry(Some(0x83), 255), &[], 255 - id.len() as u32, &[]), id);
        assert_eq!(id[8] >> 4, 3, "NAA 3: locally assigned");
        ids.insert(lun, id[8..16].to_vec());
        // Block limits: WSNZ, granularity 1, 1024 blocks per transfer; the
        // UNMAP limits with discard; the WRITE SAME limit.
        let mut b0 = vec![0u8; 0x3c];
        b0[0] = 0x01;
        b0[2..4].copy_from_slice(&1u16.to_be_bytes());
        b0[4..8].copy_from_slice(&MAX_TRANSFER_BLOCKS.to_be_bytes());
        if discard {
            b0[16..20].copy_from_slice(&0x40_0000u32.to_be_bytes());
            b0[20..24].copy_from_slice(&256u32.to_be_bytes());
            b0[24..28].copy_from_slice(&1u32.to_be_bytes());
        }
        b0[32..40].copy_from_slice(&0x40_0000u64.to_be_bytes());
        assert_eq!(q.good_resid(lun, Cmd::inquiry(Some(0xb0), 255), &[], 255 - 64, &[]), vpd(0xb0, &b0));
        // Block device characteristics: non-rotating.
        let mut b1 = vec![0u8; 0x3c];
        b1[1] = 1;
        assert_eq!(q.good_resid(lun, Cmd::inquiry(Some(0xb1), 255), &[], 255 - 64, &[]), vpd(0xb1, &b1));
        // Logical block provisioning: LBPU, LBPWS, LBPWS10, LBPRZ, thin.
        let b2 = if discard { vec![0, 0xe4, 0x02, 0] } else { vec![0; 4] };
        assert_eq!(q.good_resid(lun, Cmd::inquiry(Some(0xb2), 255), &[], 255 - 8, &[]), vpd(0xb2, &b2));
        // A page not offered, a page code without EVPD, CMDDT: refused.
        q.check(lun, Cmd::inquiry(Some(0x81), 255), &[], INVALID_FIELD_IN_CDB, &[]);
        let mut c = Cmd::inquiry(None, 96);
        c.cdb[2] = 0x80;
        q.check(lun, c, &[], INVALID_FIELD_IN_CDB, &[]);
        c.cdb[2] = 0;
        c.cdb[1] = 0x02;
        q.check(lun, c, &[], INVALID_FIELD_IN_CDB, &[]);
    }
    // Each unit has an identifier of its own.
    assert_ne!(ids[&0], ids[&1]);
    assert_ne!(ids[&0], ids[&300]);
    assert_ne!(ids[&1], ids[&300]);
    // A unit that is not there: peripheral qualifier 3, no VPD.
    let mut none = standard_inquiry();
    none[0] = 0x7f;
    assert_eq!(q.good_resid(7, Cmd::inquiry(None, 96), &[], 60, &["bad_lun"]), none);
    q.check(7, Cmd::inquiry(Some(0x83), 255), &[], LUN_NOT_SUPPORTED, &["bad_lun"]);
    q.still_serves();
    finish(q, dev, d);

    // The same device name and unit: the same identifiers after a restart.
    let d = start(&luns, &[]);
    let mut dev = connect(&d, true);
    let mut q = Q::new(dev.scsi_queue(0, 4, 4096).unwrap(), Some(&img0));
    for lun in [0u16, 1, 300] {
        let want = device_identification(DEV, lun);
        let id = q.good_resid(lun, Cmd::inquiry(Some(0x83), 255), &[], 255 - want.len() as u32, &[]);
        assert_eq!(id, want, "LUN {lun} after a restart");
    }
    drop(q.q);
    dev.disconnect().unwrap();
    d.stop();

    // Another device name (a configuration file's): other identifiers and serials.
    let conf = dir.0.join("vhostd.toml");
    let lun0 = file_lun(0, &img0, "");
    let d = Daemon::start_with(None, |sock| {
        let text =
            format!("[[scsi]]\nname = \"vm7-disks\"\nsocket-path = \"{}\"\nlun = [\"{lun0}\"]\n", sock.display());
        fs::write(&conf, text).unwrap();
        vec!["--config".to_string(), conf.display().to_string()]
    });
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.scsi_queue(0, 4, 4096).unwrap(), Some(&img0));
    let want = device_identification("vm7-disks", 0);
    let id = q.good_resid(0, Cmd::inquiry(Some(0x83), 255), &[], 255 - want.len() as u32, &[]);
    assert_eq!(id, want);
    assert_ne!(id[8..16], ids[&0][..], "two devices' LUN 0 share an identifier");
    let serial = q.good_resid(0, Cmd::inquiry(Some(0x80), 255), &[], 255 - 15, &[]);
    assert_eq!(serial, vpd(0x80, b"vm7-disks-0"));
    drop(q.q);
    dev.disconnect().unwrap();
    d.stop();
}

// ---------------------------------------------------------------------------
// 2. READ CAPACITY, MODE SENSE, REPORT LUNS, REPORT SUPPORTED OPERATION
//    CODES, TEST UNIT READY, REQUEST SENSE.
// ---------------------------------------------------------------------------

/// MODE SENSE's mode pages (caching, control) as vhostd answers them:
/// current values, or the changeable ones (none).
fn mode_pages(changeable: bool) -> (Vec<u8>, Vec<u8>) {
    let mut caching = vec![0u8; 20];
    caching[0] = 0x08;
    caching[1] = 0x12;
    let mut control = vec![0u8; 12];
    control[0] = 0x0a;
    control[1] = 0x0a;
    if !changeable {
        caching[2] = 0x04; // WCE
        control[3] = 0x10; // queue algorithm modifier 1
    }
    (caching, control)
}

#[test]
fn capacity_mode_pages_and_unit_lists_are_exact() {
    let dir = Dir::new();
    let size0 = (4u64 << 20) + 3 * 512;
    let img0 = dir.image("lun0.img", size0);
    let img1 = dir.image("lun1.img", 1 << 20);
    let luns = vec![
        file_lun(0, &img0, ",discard=on"),
        file_lun(1, &img1, ",readonly=on"),
        "300=null,size=1G".into(),
        // More blocks than READ CAPACITY(10) can say.
        "2=null,size=4T".into(),
    ];
    let d = start(&luns, &[]);
    let mut dev = connect(&d, false);
    let cfg = dev.scsi_config().unwrap();
    assert_eq!(
        (cfg.num_queues, cfg.seg_max, cfg.max_sectors, cfg.cmd_per_lun, cfg.max_lun),
        (1, 254, 1024, 128, 16383)
    );
    let mut q = Q::new(dev.scsi_queue(0, 4, 64 << 10).unwrap(), Some(&img0));
    let units: [(u16, u64, bool, bool); 4] =
        [(0, size0 / 512, false, true), (1, 2048, true, false), (2, 1 << 33, false, true), (300, 1 << 21, false, true)];
    for &(lun, blocks, ro, discard) in &units {
        q.good(lun, Cmd::test_unit_ready(), &[], &[]);
        let mut rc10 = ((blocks - 1).min(u32::MAX as u64) as u32).to_be_bytes().to_vec();
        rc10.extend_from_slice(&512u32.to_be_bytes());
        assert_eq!(q.good(lun, Cmd::read_capacity_10(), &[], &[]), rc10, "LUN {lun}");
        let mut rc16 = vec![0u8; 32];
        rc16[0..8].copy_from_slice(&(blocks - 1).to_be_bytes());
        rc16[8..12].copy_from_slice(&512u32.to_be_bytes());
        if discard {
            rc16[14] = 0xc0; // LBPME, LBPRZ
        }
        assert_eq!(q.good(lun, Cmd::read_capacity_16(32), &[], &[]), rc16, "LUN {lun}");
        // Cut to the allocation length.
        assert_eq!(q.good(lun, Cmd::read_capacity_16(12), &[], &[]), rc16[..12]);
        // An LBA without PMI is refused.
        let mut c = Cmd::read_capacity_16(32);
        c.cdb[9] = 1;
        q.check(lun, c, &[], INVALID_FIELD_IN_CDB, &[]);

        // MODE SENSE: WP on the read-only unit; DPOFUA everywhere.
        let dev_specific = if ro { 0x90 } else { 0x10 };
        let (caching, control) = mode_pages(false);
        let mut blockdesc = (blocks.min(u32::MAX as u64) as u32).to_be_bytes().to_vec();
        blockdesc.extend_from_slice(&[0, 0, 2, 0]);
        let mut ms6 = vec![43, 0, dev_specific, 8];
        ms6.extend_from_slice(&blockdesc);
        ms6.extend_from_slice(&caching);
        ms6.extend_from_slice(&control);
        assert_eq!(q.good_resid(lun, Cmd::mode_sense_6(false, 0, 0x3f, 0, 255), &[], 255 - 44, &[]), ms6);
        let mut ms10 = vec![0, 38, 0, dev_specific, 0, 0, 0, 0];
        ms10.extend_from_slice(&caching);
        ms10.extend_from_slice(&control);
        assert_eq!(q.good_resid(lun, Cmd::mode_sense_10(true, 0, 0x3f, 0xff, 512), &[], 512 - 40, &[]), ms10);
        // One page; the changeable values (none are); cut to 4 bytes.
        let mut one = vec![23, 0, dev_specific, 0];
        one.extend_from_slice(&caching);
        assert_eq!(q.good_resid(lun, Cmd::mode_sense_6(true, 0, 0x08, 0, 64), &[], 40, &[]), one);
        let (ch_caching, ch_control) = mode_pages(true);
        let mut want = vec![15, 0, dev_specific, 0];
        want.extend_from_slice(&ch_control);
        assert_eq!(q.good_resid(lun, Cmd::mode_sense_6(true, 1, 0x0a, 0, 64), &[], 48, &[]), want);
        let mut want = vec![0, 26, 0, dev_specific, 0, 0, 0, 0];
        want.extend_from_slice(&ch_caching);
        assert_eq!(q.good_resid(lun, Cmd::mode_sense_10(true, 1, 0x08, 0, 64), &[], 36, &[]), want);
        assert_eq!(q.good(lun, Cmd::mode_sense_6(false, 0, 0x3f, 0, 4), &[], &[]), ms6[..4]);
        // Saved values: not supported; a page that is not there: refused.
        q.check(lun, Cmd::mode_sense_6(true, 3, 0x3f, 0, 255), &[], SAVING_PARAMETERS_NOT_SUPPORTED, &[]);
        q.check(lun, Cmd::mode_sense_10(true, 0, 0x1c, 0, 255), &[], INVALID_FIELD_IN_CDB, &[]);

        // REPORT SUPPORTED OPERATION CODES: every command (UNMAP only
        // with discard), each in 8 bytes.
        let n = if discard { 24 } else { 23 };
        let list = q.good_resid(lun, Cmd::report_supported_opcodes(0, 0, 0, 4096), &[], 4096 - 4 - 8 * n, &[]);
        assert_eq!(list[..4], (8 * n).to_be_bytes());
        let descs: Vec<&[u8]> = list[4..].chunks(8).collect();
        assert_eq!(descs[0], &[op::TEST_UNIT_READY, 0, 0, 0, 0, 0, 0, 6]);
        assert!(descs.contains(&&[op::SERVICE_ACTION_IN_16, 0, 0, 0x10, 0, 0x01, 0, 16][..]), "LUN {lun}");
        assert!(descs.contains(&&[op::READ_16, 0, 0, 0, 0, 0, 0, 16][..]));
        assert_eq!(descs.iter().any(|d| d[0] == op::UNMAP), discard, "LUN {lun}: UNMAP listed");
    }
    // One command: READ(16) with its usage map; READ CAPACITY(16) by its
    // service action; one that is not supported; a command with service
    // actions asked for without one; timeout descriptors (not reported).
    let mut want = vec![0, 0x03, 0, 16, 0x88, 0xe8];
    want.extend_from_slice(&[0xff; 12]);
    want.extend_from_slice(&[0x00, 0x04]);
    assert_eq!(q.good_resid(0, Cmd::report_supported_opcodes(1, op::READ_16, 0, 64), &[], 44, &[]), want);
    let mut want = vec![0, 0x03, 0, 16, 0x9e, 0x1f];
    want.extend_from_slice(&[0xff; 12]);
    want.extend_from_slice(&[0x01, 0x04]);
    assert_eq!(q.good_resid(0, Cmd::report_supported_opcodes(2, 0x9e, 0x10, 64), &[], 44, &[]), want);
    assert_eq!(q.good_resid(0, Cmd::report_supported_opcodes(1, 0xc0, 0, 64), &[], 60, &[]), [0, 0x01, 0, 0]);
    assert_eq!(q.good_resid(1, Cmd::report_supported_opcodes(1, op::UNMAP, 0, 64), &[], 60, &[]), [0, 0x01, 0, 0]);
    q.check(0, Cmd::report_supported_opcodes(1, 0x9e, 0, 64), &[], INVALID_FIELD_IN_CDB, &[]);
    q.check(0, Cmd::report_supported_opcodes(0x80, 0, 0, 64), &[], INVALID_FIELD_IN_CDB, &[]);

    // REPORT LUNS: exactly the units given, ascending, single-level (flat
    // space addressing above 255), whichever unit it is sent to (one that
    // is not there, the REPORT LUNS well-known unit too).
    let mut all = vec![0, 0, 0, 32, 0, 0, 0, 0];
    for e in [[0u8, 0], [0, 1], [0, 2], [0x41, 0x2c]] {
        all.extend_from_slice(&e);
        all.extend_from_slice(&[0; 6]);
    }
    for lun in [0u16, 300, 7] {
        let keys: &[&'static str] = &[];
        assert_eq!(q.good_resid(lun, Cmd::report_luns(0, 4096), &[], 4096 - 40, keys), all, "sent to LUN {lun}");
    }
    assert_eq!(q.good_resid(0, Cmd::report_luns(2, 4096), &[], 4096 - 40, &[]), all);
    q.q.set_lun_field([1, 0, 0xc1, 0x01, 0, 0, 0, 0]);
    let r = q.q.request(Cmd::report_luns(0, 4096), &[], T).unwrap();
    q.t.count(&["commands"]);
    assert_eq!((r.resp.response, r.resp.status, r.data_in()), (response::OK, status::GOOD, &all[..]));
    // Well-known units only: none. Cut to the allocation length.
    assert_eq!(q.good_resid(0, Cmd::report_luns(1, 64), &[], 56, &[]), [0u8; 8]);
    assert_eq!(q.good(0, Cmd::report_luns(0, 16), &[], &[]), all[..16]);
    q.check(0, Cmd::report_luns(3, 4096), &[], INVALID_FIELD_IN_CDB, &[]);
    q.check(0, Cmd::report_luns(0, 15), &[], INVALID_FIELD_IN_CDB, &[]);

    // REQUEST SENSE: nothing pending on a unit (each CHECK CONDITION
    // carries its sense), in either format; LOGICAL UNIT NOT SUPPORTED for
    // a unit that is not there.
    let no_sense = (key::NO_SENSE, 0, 0);
    assert_eq!(q.good_resid(0, Cmd::request_sense(false, 252), &[], 234, &[]), fixed_sense(no_sense));
    assert_eq!(q.good_resid(0, Cmd::request_sense(true, 252), &[], 244, &[]), descriptor_sense(no_sense));
    assert_eq!(q.good_resid(7, Cmd::request_sense(false, 252), &[], 234, &["bad_lun"]), fixed_sense(LUN_NOT_SUPPORTED));
    assert_eq!(
        q.good_resid(7, Cmd::request_sense(true, 252), &[], 244, &["bad_lun"]),
        descriptor_sense(LUN_NOT_SUPPORTED)
    );
    assert_eq!(q.good(7, Cmd::request_sense(false, 3), &[], &["bad_lun"]), [0x70, 0, 0x05]);
    // The sense of a CHECK CONDITION stays in fixed format (D_SENSE 0)
    // after a REQUEST SENSE asked for descriptors.
    q.check(7, Cmd::test_unit_ready(), &[], LUN_NOT_SUPPORTED, &["bad_lun"]);
    q.still_serves();
    finish(q, dev, d);
}

// ---------------------------------------------------------------------------
// 3. Data: READ, WRITE, VERIFY, SYNCHRONIZE CACHE on a file and a null unit.
// ---------------------------------------------------------------------------

#[test]
fn data_written_reads_back_and_is_in_the_image() {
    let dir = Dir::new();
    let mapped = on_tmpfs(&dir.0);
    data_written_reads_back_in(dir, mapped);
}

/// The same on tmpfs, where the file backend maps the image (written out,
/// so with no hole) and copies each read and write through the mapping.
#[test]
fn data_written_reads_back_on_tmpfs() {
    let Some(dir) = Dir::in_shm() else { return };
    data_written_reads_back_in(dir, true);
}

/// Two LUNs on one tmpfs image share whether its mapping may serve them:
/// an UNMAP through one stops the other's copies (a read of the hole
/// through a mapping would allocate it), and once the range is written
/// again a look, made on a thread of its own under the seccomp filter,
/// resumes them.
#[test]
fn two_luns_on_one_tmpfs_image_share_its_holes() {
    let Some(dir) = Dir::in_shm() else { return };
    let mib = 1u64 << 20;
    let img = dir.image("shared.img", 4 * mib);
    let d = start(&[file_lun(0, &img, ",discard=on"), file_lun(1, &img, "")], &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.scsi_queue(0, 4, 64 << 10).unwrap(), Some(&img));
    assert_eq!(q.read(1, mib / 512, 8), read_file(&img, mib, 4096));
    let full = allocated(&img);
    let params = scsi::unmap_parameters(&[(mib / 512, (mib / 512) as u32)]);
    q.good(0, Cmd::unmap(params.len() as u16), &params, &["unmaps"]);
    let holed = allocated(&img);
    assert!(holed < full, "st_blocks {full} -> {holed}");
    // LUN 1 reads the hole with preadv: zeros, nothing allocated.
    for k in 0..16 {
        assert!(q.read(1, (mib + k * (64 << 10)) / 512, 128).iter().all(|&b| b == 0));
    }
    assert_eq!(allocated(&img), holed, "LUN 1 read the hole through the mapping");
    // LUN 0 writes the range again; LUN 1's reads then find the copies
    // resumed within a look or two.
    let mut data = vec![0u8; mib as usize];
    fill_pattern(&mut data, mib, 77);
    for (k, chunk) in data.chunks(64 << 10).enumerate() {
        q.write(0, (mib + k as u64 * (64 << 10)) / 512, chunk);
    }
    assert!(allocated(&img) >= full);
    let resumed = wait_until(Duration::from_secs(10), || {
        assert_eq!(q.read(1, mib / 512, 8), data[..4096]);
        d.log().contains("fully allocated again: reads and writes are copies")
    });
    assert!(resumed, "the copies did not resume: {}", d.log());
    let copies_at_resume = q.t.get("reads");
    assert_eq!(q.read(1, 2 * mib / 512 - 8, 8), data[data.len() - 4096..]);
    let s = finish(q, dev, d);
    // The first read and the last were copies; those between, not all.
    let copies = s.queue(2, "mapped_copies");
    assert!(copies >= 2 && copies < copies_at_resume, "{copies} copies of {copies_at_resume} reads");
}

/// `mapped`: the image is on tmpfs, so LUN 0's reads and writes are
/// copies through its mapping.
fn data_written_reads_back_in(dir: Dir, mapped: bool) {
    let size = 4u64 << 20;
    let img = dir.image("lun0.img", size);
    let d = start(&[file_lun(0, &img, ""), "5=null,size=64M".into()], &["--queues", "2"]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.scsi_queue(0, 8, 128 << 10).unwrap(), Some(&img));
    let mut q2 = Q::new(dev.scsi_queue(1, 8, 128 << 10).unwrap(), Some(&img));
    let blocks = size / 512;

    // WRITE(10), then READ(10) and READ(16): the same bytes, in the file at
    // their offset, nothing around them moved.
    let mut a = vec![0u8; 8192];
    fill_pattern(&mut a, 24 * 512, 91);
    q.good(0, Cmd::write_10(24, 16, 512), &a, &["writes"]);
    q.t.add("bytes_written", 8192);
    assert_eq!(read_file(&img, 24 * 512, 8192), a);
    assert_bg(&img, 0, 24 * 512);
    assert_bg(&img, 40 * 512, 64 << 10);
    assert_eq!(q.good(0, Cmd::read_10(24, 16, 512), &[], &["reads"]), a);
    q.t.add("bytes_read", 8192);
    assert_eq!(q.read(0, 24, 16), a);
    // WRITE(16) with FUA on the other queue, at the last blocks; READ(10)
    // of it from the first queue.
    let mut b = vec![0u8; 64 << 10];
    fill_pattern(&mut b, (blocks - 128) * 512, 92);
    q2.good(0, Cmd::write_16(blocks - 128, 128, 512).fua(), &b, &["writes"]);
    q2.t.add("bytes_written", 64 << 10);
    assert_eq!(read_file(&img, (blocks - 128) * 512, 64 << 10), b);
    assert_eq!(q.good(0, Cmd::read_10((blocks - 128) as u32, 128, 512), &[], &["reads"]), b);
    q.t.add("bytes_read", 64 << 10);
    // The most one command may move: 1024 blocks (512 KiB) in 4 commands
    // of 128 KiB here (the queue's buffers); zero blocks: nothing to do.
    q.good(0, Cmd::read_16(0, 0, 512), &[], &[]);
    q.good(0, Cmd::write_10(0, 0, 512), &[], &[]);
    assert_bg(&img, 0, 4096);

    // VERIFY (BYTCHK 0): the medium is fine; out of range and BYTCHK refused.
    q.good(0, Cmd::verify_10(0, 100), &[], &[]);
    q.good(0, Cmd::verify_16(blocks - 8, 8), &[], &[]);
    q.check(0, Cmd::verify_16(blocks - 8, 9), &[], LBA_OUT_OF_RANGE, &[]);
    let mut c = Cmd::verify_10(0, 8);
    c.cdb[1] = 0x02;
    q.check(0, c, &[], INVALID_FIELD_IN_CDB, &[]);
    // SYNCHRONIZE CACHE, the whole disk or a range; past the end refused.
    q.good(0, Cmd::synchronize_cache_10(0, 0), &[], &["flushes"]);
    q2.good(0, Cmd::synchronize_cache_16(100, 8), &[], &["flushes"]);
    q.check(0, Cmd::synchronize_cache_16(blocks + 1, 0), &[], LBA_OUT_OF_RANGE, &[]);
    q.check(0, Cmd::synchronize_cache_10(blocks as u32 - 4, 8), &[], LBA_OUT_OF_RANGE, &[]);

    // Commands in flight together on both queues, each answered with its
    // own data (completions carry their tag), in any order.
    let mut want = BTreeMap::new();
    for i in 0..8u64 {
        let lba = 200 + 16 * i;
        let (qq, user) = if i % 2 == 0 { (&mut q, i) } else { (&mut q2, i) };
        qq.q.set_lun(0);
        assert!(qq.q.submit(&Cmd::read_16(lba, 16, 512), user, |b| b.fill(POISON)).unwrap());
        qq.t.count(&["commands", "reads"]);
        qq.t.add("bytes_read", 8192);
        want.insert(user, read_file(&img, lba * 512, 8192));
    }
    q.q.flush().unwrap();
    q2.q.flush().unwrap();
    let got = collect(&mut [&mut q.q, &mut q2.q], 8);
    for (user, (c, data)) in got {
        assert!(c.ok(), "tag {user}: {:?}", c.problem());
        assert_eq!(c.used_len, RESP + 8192);
        assert_eq!(data, want[&user], "tag {user}");
    }

    // The null unit: writes succeed, reads succeed and leave the buffer
    // as it was (null-co without read-zeroes).
    let junk = vec![0x11u8; 4096];
    q.good(5, Cmd::write_16(0, 8, 512), &junk, &["writes"]);
    q.t.add("bytes_written", 4096);
    let r = q.good(5, Cmd::read_16(0, 8, 512), &[], &["reads"]);
    q.t.add("bytes_read", 4096);
    assert!(r.iter().all(|&b| b == POISON), "the null backend wrote into a read buffer");
    q.good(5, Cmd::write_10(8, 8, 512), &junk, &["writes"]);
    q.t.add("bytes_written", 4096);
    let r = q.good(5, Cmd::read_10(8, 8, 512), &[], &["reads"]);
    q.t.add("bytes_read", 4096);
    assert!(r.iter().all(|&b| b == POISON));
    q.good(5, Cmd::synchronize_cache_10(0, 0), &[], &["flushes"]);
    q.good(5, Cmd::synchronize_cache_16(8, 8), &[], &["flushes"]);
    q.good(5, Cmd::verify_10(0, 8), &[], &[]);
    q.good(5, Cmd::verify_16(0, 8), &[], &[]);
    // The null unit offers UNMAP (and LBPRZ): every form is accepted.
    let params = scsi::unmap_parameters(&[(0, 8), (64, 64)]);
    q.good(5, Cmd::unmap(params.len() as u16), &params, &["unmaps"]);
    q.good(5, Cmd::write_same_16(0, 8, true, false, 512), &[0; 512], &["unmaps"]);
    q.good(5, Cmd::write_same_16(0, 8, true, true, 512), &[], &["unmaps"]);
    q.good(5, Cmd::write_same_16(0, 8, false, false, 512), &[0; 512], &["unmaps"]);
    let no_sense = (key::NO_SENSE, 0, 0);
    assert_eq!(q.good_resid(5, Cmd::request_sense(false, 32), &[], 14, &[]), fixed_sense(no_sense));
    q.check(5, Cmd::read_16((64 << 20) / 512, 1, 512), &[], LBA_OUT_OF_RANGE, &[]);
    q.check(5, Cmd::write_10(((64 << 20) / 512 - 4) as u32, 8, 512), &junk, LBA_OUT_OF_RANGE, &[]);
    q.still_serves();
    assert_eq!(fs::metadata(&img).unwrap().len(), size);
    drop((q.q, q2.q));
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_queue(&s, 2, &q.t);
    expect_queue(&s, 3, &q2.t);
    check_totals(&s);
    // LUN 0's reads and writes that moved data: 9 on the first queue, 5 on
    // the second (the null unit's are not copies, nor is the FUA flush).
    let copies = (s.queue(2, "mapped_copies"), s.queue(3, "mapped_copies"));
    assert_eq!(copies, if mapped { (9, 5) } else { (0, 0) }, "copies through the mapping");
}

// ---------------------------------------------------------------------------
// 4. UNMAP and WRITE SAME: holes in the image.
// ---------------------------------------------------------------------------

#[test]
fn unmap_and_write_same_punch_holes() {
    let dir = Dir::new();
    let size = 8u64 << 20;
    let img = dir.image("lun0.img", size);
    let img1 = dir.image("lun1.img", 1 << 20);
    let d = start(&[file_lun(0, &img, ",discard=on"), file_lun(1, &img1, "")], &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.scsi_queue(0, 4, 64 << 10).unwrap(), Some(&img));
    let mib = 1u64 << 20;
    let (blocks, mib_blocks) = (size / 512, (mib / 512) as u32);

    // UNMAP of two ranges: a hole exactly at each, space freed, zeros read.
    let before = allocated(&img);
    let params = scsi::unmap_parameters(&[(mib / 512, mib_blocks), (3 * mib / 512, 128)]);
    q.good(0, Cmd::unmap(params.len() as u16), &params, &["unmaps"]);
    let after = allocated(&img);
    assert!(before >= after + 2048 + 128 - 16, "st_blocks {before} -> {after} after unmapping 1 MiB + 64 KiB");
    assert_eq!(seek(&img, mib, libc::SEEK_HOLE), mib);
    assert_eq!(seek(&img, mib, libc::SEEK_DATA), 2 * mib);
    assert_eq!(seek(&img, 3 * mib, libc::SEEK_HOLE), 3 * mib);
    assert_eq!(seek(&img, 3 * mib, libc::SEEK_DATA), 3 * mib + (64 << 10));
    assert_zero(&img, mib, mib as usize);
    assert_zero(&img, 3 * mib, 64 << 10);
    assert_bg(&img, mib - 4096, 4096);
    assert_bg(&img, 2 * mib, 4096);
    assert_bg(&img, 3 * mib + (64 << 10), 4096);
    assert!(q.read(0, mib / 512, 128).iter().all(|&b| b == 0));

    // WRITE SAME(16) with UNMAP of a zero block: a hole.
    let zero = vec![0u8; 512];
    let wz = 64u64 << 10;
    q.good(0, Cmd::write_same_16(4 * mib / 512, 128, true, false, 512), &zero, &["unmaps"]);
    assert_eq!(seek(&img, 4 * mib, libc::SEEK_HOLE), 4 * mib);
    assert_eq!(seek(&img, 4 * mib, libc::SEEK_DATA), 4 * mib + wz);
    assert_zero(&img, 4 * mib, wz as usize);
    assert_bg(&img, 4 * mib + wz, 4096);
    // With NDOB (no data-out buffer) and UNMAP: a hole too.
    q.good(0, Cmd::write_same_16(5 * mib / 512, 128, true, true, 512), &[], &["unmaps"]);
    assert_eq!(seek(&img, 5 * mib, libc::SEEK_HOLE), 5 * mib);
    assert_eq!(seek(&img, 5 * mib, libc::SEEK_DATA), 5 * mib + wz);
    assert_zero(&img, 5 * mib, wz as usize);
    // Without UNMAP: zeros, the space stays allocated (a zeroed range may
    // read as a hole to SEEK_HOLE: ext4 reports its unwritten extents so).
    let before = allocated(&img);
    q.good(0, Cmd::write_same_16(6 * mib / 512, 128, false, false, 512), &zero, &["unmaps"]);
    assert!(allocated(&img) >= before, "WRITE SAME without UNMAP freed space");
    assert_zero(&img, 6 * mib, wz as usize);
    assert_bg(&img, 6 * mib + wz, 4096);
    assert!(q.read(0, 6 * mib / 512, 128).iter().all(|&b| b == 0));

    // Refused, the image untouched: a block that is not zeros, zero
    // blocks (WSNZ), past the end, a parameter list too short, a range past
    // the end; an empty list does nothing.
    let mut ones = vec![0u8; 512];
    ones[7] = 1;
    let at = 7 * mib / 512;
    q.check(0, Cmd::write_same_16(at, 8, true, false, 512), &ones, INVALID_FIELD_IN_PARAMETER_LIST, &[]);
    q.check(0, Cmd::write_same_16(at, 0, true, false, 512), &zero, INVALID_FIELD_IN_CDB, &[]);
    q.check(0, Cmd::write_same_16(blocks - 4, 8, true, false, 512), &zero, LBA_OUT_OF_RANGE, &[]);
    let params = scsi::unmap_parameters(&[(at, 8)]);
    q.check(0, Cmd::unmap(4), &params[..4], PARAMETER_LIST_LENGTH_ERROR, &[]);
    let past = scsi::unmap_parameters(&[(at, 8), (blocks - 4, 8)]);
    q.check(0, Cmd::unmap(past.len() as u16), &past, LBA_OUT_OF_RANGE, &[]);
    q.good(0, Cmd::unmap(0), &[], &[]);
    assert_bg(&img, 7 * mib, mib as usize);
    assert_eq!(fs::metadata(&img).unwrap().len(), size);

    // A unit without discard=on: no UNMAP; WRITE SAME with UNMAP zeroes
    // without a hole.
    q.check(1, Cmd::unmap(params.len() as u16), &params, INVALID_OPCODE, &[]);
    let before = allocated(&img1);
    q.good(1, Cmd::write_same_16(256, 128, true, false, 512), &zero, &["unmaps"]);
    assert_zero(&img1, 256 * 512, wz as usize);
    assert!(allocated(&img1) >= before, "space freed on a unit without discard=on");
    assert_bg(&img1, 0, 256 * 512);
    q.still_serves();
    finish(q, dev, d);
}

// ---------------------------------------------------------------------------
// 5. Sense data, residuals and overruns.
// ---------------------------------------------------------------------------

#[test]
fn refused_commands_carry_exact_sense() {
    let dir = Dir::new();
    let size = 2u64 << 20;
    let img = dir.image("lun0.img", size);
    let img1 = dir.image("lun1.img", 1 << 20);
    let d = start(&[file_lun(0, &img, ""), file_lun(1, &img1, ",readonly=on")], &[]);
    let mut dev = connect(&d, true);
    let mut q = Q::new(dev.scsi_queue(0, 4, 1 << 20).unwrap(), Some(&img));
    let blocks = size / 512;
    let junk = vec![0xeeu8; 64 << 10];

    // The read-only unit: DATA PROTECT, WRITE PROTECTED; reads are fine.
    q.check(1, Cmd::write_10(0, 8, 512), &junk, WRITE_PROTECTED, &[]);
    q.check(1, Cmd::write_16(16, 128, 512).fua(), &junk, WRITE_PROTECTED, &[]);
    q.check(1, Cmd::write_same_16(0, 8, false, false, 512), &[0; 512], WRITE_PROTECTED, &[]);
    // Read-only comes before the range.
    q.check(1, Cmd::write_16(2048, 8, 512), &junk, WRITE_PROTECTED, &[]);
    // No discard on a read-only unit: no UNMAP.
    q.check(1, Cmd::unmap(24), &scsi::unmap_parameters(&[(0, 8)]), INVALID_OPCODE, &[]);
    let r = q.good(1, Cmd::read_16(0, 8, 512), &[], &["reads"]);
    q.t.add("bytes_read", 4096);
    assert_eq!(check_pattern(&r, 0, BG), None);
    assert_bg(&img1, 0, 1 << 20);

    // LBA OUT OF RANGE: at the end, straddling it, where LBA + blocks
    // overflows 64 bits; a write past the end does not grow the image.
    for (lba, n) in [(blocks, 1u32), (blocks - 1, 2), (u64::MAX, 1), (u64::MAX - 3, 8)] {
        q.check(0, Cmd::read_16(lba, n, 512), &[], LBA_OUT_OF_RANGE, &[]);
        q.check(0, Cmd::write_16(lba, n, 512), &junk, LBA_OUT_OF_RANGE, &[]);
    }
    q.check(0, Cmd::read_10(blocks as u32, 1, 512), &[], LBA_OUT_OF_RANGE, &[]);
    assert_eq!(fs::metadata(&img).unwrap().len(), size);
    assert_bg(&img, size - 4096, 4096);

    // INVALID COMMAND OPERATION CODE: unknown in every group, MODE SELECT,
    // SERVICE ACTION IN(16) with another action.
    for opcode in [0x01u8, 0x15, 0x3b, 0x5f, 0x7f, 0x80, 0xa5, 0xc0, 0xe0, 0xff] {
        q.check(0, Cmd::raw(&[opcode], Data::None), &[], INVALID_OPCODE, &[]);
    }
    let mut c = Cmd::read_capacity_16(32);
    c.cdb[1] = 0x12;
    q.check(0, c, &[], INVALID_OPCODE, &[]);

    // INVALID FIELD IN CDB: NACA in the control byte, RDPROTECT, more
    // blocks than one command may move, INQUIRY's CMDDT.
    let mut c = Cmd::test_unit_ready();
    c.cdb[5] = 0x04;
    q.check(0, c, &[], INVALID_FIELD_IN_CDB, &[]);
    let mut c = Cmd::read_10(0, 8, 512);
    c.cdb[1] = 0x20;
    q.check(0, c, &[], INVALID_FIELD_IN_CDB, &[]);
    q.check(0, Cmd::read_16(0, MAX_TRANSFER_BLOCKS + 1, 512), &[], INVALID_FIELD_IN_CDB, &[]);
    q.check(0, Cmd::write_16(0, MAX_TRANSFER_BLOCKS + 1, 512), &junk, INVALID_FIELD_IN_CDB, &[]);
    // (The most it may move is fine.)
    let r = q.good(0, Cmd::read_16(0, MAX_TRANSFER_BLOCKS, 512), &[], &["reads"]);
    q.t.add("bytes_read", 512 << 10);
    assert_eq!(check_pattern(&r, 0, BG), None);

    // LOGICAL UNIT NOT SUPPORTED for a unit that is not there, whatever
    // the command (INQUIRY and REQUEST SENSE answer instead).
    for cmd in [Cmd::test_unit_ready(), Cmd::read_16(0, 8, 512), Cmd::read_capacity_10(), Cmd::inquiry(Some(0), 64)] {
        q.check(9, cmd, &[], LUN_NOT_SUPPORTED, &["bad_lun"]);
    }
    q.check(9, Cmd::write_10(0, 8, 512), &junk, LUN_NOT_SUPPORTED, &["bad_lun"]);
    assert_eq!(
        q.good_resid(9, Cmd::request_sense(true, 64), &[], 56, &["bad_lun"]),
        descriptor_sense(LUN_NOT_SUPPORTED)
    );
    q.still_serves();
    assert_bg(&img, 0, size as usize);
    finish(q, dev, d);
}

#[test]
fn longer_buffers_leave_residuals_shorter_ones_overrun() {
    let dir = Dir::new();
    let img = dir.image("lun0.img", 2 << 20);
    let d = start(&[file_lun(0, &img, "")], &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.scsi_queue(0, 4, 64 << 10).unwrap(), Some(&img));

    // Longer: the data, and the rest of the buffer is the residual.
    let r = q.good_resid(0, Cmd::inquiry(None, 96).with_data(Data::In(4096)), &[], 4060, &[]);
    assert_eq!(r, standard_inquiry());
    let r = q.good_resid(0, Cmd::read_10(8, 8, 512).with_data(Data::In(8192)), &[], 4096, &["reads"]);
    q.t.add("bytes_read", 4096);
    assert_eq!(r, read_file(&img, 4096, 4096));
    let mut data = vec![0u8; 8192];
    fill_pattern(&mut data, 64 * 512, 33);
    q.good_resid(0, Cmd::write_10(64, 8, 512).with_data(Data::Out(8192)), &data, 4096, &["writes"]);
    q.t.add("bytes_written", 4096);
    // Only the command's 8 blocks were written.
    assert_eq!(read_file(&img, 64 * 512, 4096), data[..4096]);
    assert_bg(&img, 72 * 512, 4096);
    q.good_resid(0, Cmd::test_unit_ready().with_data(Data::In(512)), &[], 512, &[]);
    q.good_resid(0, Cmd::read_capacity_10().with_data(Data::In(100)), &[], 92, &[]);

    // Shorter: OVERRUN, nothing transferred (the buffer is the residual).
    q.refused(0, Cmd::inquiry(None, 96).with_data(Data::In(20)), &[], response::OVERRUN, 20, &["overruns"]);
    q.refused(0, Cmd::read_capacity_10().with_data(Data::In(4)), &[], response::OVERRUN, 4, &["overruns"]);
    q.refused(
        0,
        Cmd::read_10(8, 8, 512).with_data(Data::In(2048)),
        &[],
        response::OVERRUN,
        2048,
        &["reads", "overruns"],
    );
    q.refused(0, Cmd::read_16(8, 8, 512).with_data(Data::None), &[], response::OVERRUN, 0, &["reads", "overruns"]);
    q.refused(
        0,
        Cmd::write_10(80, 8, 512).with_data(Data::Out(2048)),
        &data,
        response::OVERRUN,
        2048,
        &["writes", "overruns"],
    );
    q.refused(0, Cmd::write_16(80, 8, 512).with_data(Data::None), &[], response::OVERRUN, 0, &["writes", "overruns"]);
    assert_bg(&img, 80 * 512, 4096);
    q.still_serves();
    finish(q, dev, d);
}

// ---------------------------------------------------------------------------
// 6. Hostile commands and chains: each answered and counted exactly, the
//    device serving on.
// ---------------------------------------------------------------------------

/// xorshift64*: reproducible random bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.next() as u8;
        }
    }
}

/// The target's view of a unit vhostd serves (for the CDB oracle).
fn disk_of(lun: u16, blocks: u64, read_only: bool, discard: bool) -> vhostd_scsi::Disk {
    vhostd_scsi::Disk {
        blocks,
        block_size: 512,
        read_only,
        discard: discard && !read_only,
        write_cache: true,
        serial: format!("{DEV}-{lun}"),
        naa: vhostd_scsi::naa_bits(&format!("{DEV}:{lun}")),
        descriptor_sense: false,
        max_transfer_blocks: MAX_TRANSFER_BLOCKS,
    }
}

/// What a command with a 4096-byte data-in buffer and no data-out must
/// come back as, given the target's answer for its CDB (crates/scsi's
/// `execute`, the oracle of the transport around it): (response, status,
/// residual, sense, data-in), and the counters it moves.
fn expected(
    action: vhostd_scsi::Action,
    read: impl FnOnce(u64, u32) -> Vec<u8>,
    t: &mut Tally,
) -> (u8, u8, u32, Vec<u8>, Vec<u8>) {
    use vhostd_scsi::Action;
    const BUF: u32 = 4096;
    match action {
        Action::Data(v) if v.len() > BUF as usize => {
            t.count(&["overruns"]);
            (response::OVERRUN, 0, BUF, vec![], vec![])
        }
        Action::Data(v) => (response::OK, status::GOOD, BUF - v.len() as u32, vec![], v),
        Action::Check(s) => {
            t.count(&["check_conditions"]);
            (response::OK, status::CHECK_CONDITION, BUF, fixed_sense((s.key, s.asc, s.ascq)), vec![])
        }
        Action::Read { lba, blocks } => {
            t.count(&["reads"]);
            let len = blocks as u64 * 512;
            if len > BUF as u64 {
                t.count(&["overruns"]);
                return (response::OVERRUN, 0, BUF, vec![], vec![]);
            }
            t.add("bytes_read", len);
            (response::OK, status::GOOD, BUF - len as u32, vec![], read(lba, blocks))
        }
        // No data-out at all: every write of a block or more is short.
        Action::Write { .. } => {
            t.count(&["writes", "overruns"]);
            (response::OVERRUN, 0, BUF, vec![], vec![])
        }
        Action::Flush => {
            t.count(&["flushes"]);
            (response::OK, status::GOOD, BUF, vec![], vec![])
        }
        // No data-out: the data-in buffer is all residual.
        Action::Unmap(r) => {
            if r.iter().any(|r| r.1 > 0) {
                t.count(&["unmaps"]);
            }
            (response::OK, status::GOOD, BUF, vec![], vec![])
        }
        Action::WriteZeroes { .. } => {
            t.count(&["unmaps"]);
            (response::OK, status::GOOD, BUF, vec![], vec![])
        }
    }
}

/// Checks a command with a 4096-byte data-in buffer and no data-out,
/// sent to unit `lun` (one of `disks`, numbered from 0), against the
/// target's answer for its CDB (`expected`), and tallies it. `read` gives
/// what a READ of the unit finds.
fn as_the_target_says(
    disks: &[vhostd_scsi::Disk],
    lun: u16,
    cdb: &[u8],
    c: &ScsiCompletion,
    data_in: &[u8],
    read: impl FnOnce(u64, u32) -> Vec<u8>,
    t: &mut Tally,
) {
    let action = if cdb[0] == op::REPORT_LUNS {
        let units: Vec<u16> = (0..disks.len() as u16).collect();
        vhostd_scsi::report_luns(&units, cdb)
    } else {
        vhostd_scsi::execute(&disks[lun as usize], cdb, &[])
    };
    let what = format!("LUN {lun} CDB {:02x?}: the target says {action:?}", &cdb[..16]);
    let (resp, st, residual, sense, data) = expected(action, read, t);
    assert_eq!((c.resp.response, c.resp.status, c.resp.residual), (resp, st, residual), "{what}");
    assert_eq!(c.sense_bytes(), &sense[..], "{what}");
    let moved = if (resp, st) == (response::OK, status::GOOD) { data.len() as u32 } else { 0 };
    assert_eq!(c.used_len, RESP + moved, "{what}");
    assert!(data_in[..data.len()] == data[..], "{what}: data-in differs");
}

#[test]
fn random_cdbs_of_every_opcode_are_each_answered() {
    let dir = Dir::new();
    let size = 4u64 << 20;
    let img = dir.image("lun0.img", size);
    let d = start(&[file_lun(0, &img, ",discard=on"), "1=null,size=64M".into()], &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.scsi_queue(0, 64, 64 << 10).unwrap(), Some(&img));
    let disks = [disk_of(0, size / 512, false, true), disk_of(1, (64 << 20) / 512, false, true)];
    let mut rng = Rng(0x5c51_0001);
    let mut answered = 0;
    for opcode in 0..=255u8 {
        for variant in 0..4 {
            for lun in [0u16, 1] {
                let mut cdb = [0u8; 32];
                match variant {
                    // All zeros but the opcode: many commands are valid so.
                    0 => {}
                    // Random.
                    1 => rng.bytes(&mut cdb),
                    // Random, with small LBAs and lengths (in range more often).
                    2 => {
                        rng.bytes(&mut cdb);
                        cdb[1..10].fill(0);
                        cdb[5] = rng.next() as u8 & 0x3f;
                        cdb[8] = rng.next() as u8 & 0x07;
                        cdb[13] = rng.next() as u8 & 0x07;
                        cdb[10..13].fill(0);
                    }
                    // Random, the control byte of every length clear.
                    _ => {
                        rng.bytes(&mut cdb);
                        for i in [5, 9, 11, 15] {
                            cdb[i] &= !0x04;
                        }
                    }
                }
                cdb[0] = opcode;
                let read = |lba: u64, blocks: u32| {
                    let n = blocks as usize * 512;
                    if lun == 0 {
                        read_file(&img, lba * 512, n)
                    } else {
                        // The null unit leaves the buffer as it was (raw
                        // chains' writable buffers start as 0xff).
                        vec![RESPONSE_NOT_WRITTEN; n]
                    }
                };
                let mut hdr =
                    CmdReq { lun: lun_field(lun), id: rng.next(), task_attr: 0, prio: 0, crn: 0, cdb }.bytes();
                // The task attribute, priority and CRN: anything.
                rng.bytes(&mut hdr[16..19]);
                let r = q.raw(&[RawSeg::Readable(&hdr), RawSeg::Writable(RESP), RawSeg::Writable(4096)], &[]);
                let data_in = &r.data[RESP_LEN..];
                as_the_target_says(&disks, lun, &cdb, &r.completion, data_in, read, &mut q.t);
                if lun == 0 && r.completion.transferred_in() == 0 {
                    assert!(
                        data_in.iter().all(|&b| b == RESPONSE_NOT_WRITTEN),
                        "CDB {:02x?}: data-in written",
                        &cdb[..16]
                    );
                }
                answered += 1;
            }
        }
        if opcode % 64 == 63 {
            q.still_serves();
        }
    }
    assert_eq!(answered, 256 * 4 * 2);

    // 64 random commands in flight at once on the null unit: each
    // answered, as the target says.
    let mut cdbs = Vec::new();
    for i in 0..64u64 {
        let mut cdb = [0u8; 32];
        rng.bytes(&mut cdb);
        cdb[0] = (i * 4) as u8;
        assert!(q.q.submit_to(lun_field(1), 1000 + i, &Cmd::raw(&cdb, Data::In(4096)), i, |b| b.fill(POISON)).unwrap());
        cdbs.push(cdb);
    }
    q.q.flush().unwrap();
    let got = collect(&mut [&mut q.q], 64);
    for (i, cdb) in cdbs.iter().enumerate() {
        let (c, buf) = &got[&(i as u64)];
        assert_eq!(c.id, 1000 + i as u64);
        as_the_target_says(&disks, 1, cdb, c, buf, |_, n| vec![POISON; n as usize * 512], &mut q.t);
        q.t.count(&["commands"]);
    }
    q.still_serves();
    finish(q, dev, d);
}

/// The unit a LUN field addresses by virtio's rules (5.6.6: byte 0 is 1,
/// byte 1 the target, bytes 2-3 a single-level LUN, 4-7 zero), with its
/// target: peripheral addressing (bus 0), flat space, or the REPORT LUNS
/// well-known unit.
fn virtio_lun(l: &[u8; 8]) -> Option<(u8, u16)> {
    if l[0] != 1 || l[4..] != [0; 4] {
        return None;
    }
    let unit = match (l[2], l[2] >> 6) {
        (0, _) => l[3] as u16,
        (_, 1) => ((l[2] as u16 & 0x3f) << 8) | l[3] as u16,
        (0xc1, _) if l[3] == 0x01 => 0xc101,
        _ => return None,
    };
    Some((l[1], unit))
}

#[test]
fn lun_fields_of_every_form() {
    let dir = Dir::new();
    let img = dir.image("lun0.img", 1 << 20);
    let d = start(&[file_lun(0, &img, ""), "300=null,size=16M".into()], &[]);
    let mut dev = connect(&d, true);
    let mut q = Q::new(dev.scsi_queue(0, 4, 4096).unwrap(), Some(&img));
    let mut fields: Vec<[u8; 8]> = vec![
        [1, 0, 0, 0, 0, 0, 0, 0],         // unit 0
        [1, 0, 0x40, 0, 0, 0, 0, 0],      // unit 0, flat space
        [1, 0, 0x41, 0x2c, 0, 0, 0, 0],   // unit 300, flat space
        [1, 0, 0, 5, 0, 0, 0, 0],         // unit 5: not there
        [1, 0, 0x7f, 0xff, 0, 0, 0, 0],   // unit 16383: not there
        [1, 0, 0xc1, 0x01, 0, 0, 0, 0],   // the REPORT LUNS well-known unit
        [1, 1, 0, 0, 0, 0, 0, 0],         // target 1
        [1, 255, 0x41, 0x2c, 0, 0, 0, 0], // target 255
        [0, 0, 0, 0, 0, 0, 0, 0],         // not virtio's form
        [2, 0, 0, 0, 0, 0, 0, 0],
        [0xff; 8],
        [1, 0, 0, 0, 1, 0, 0, 0], // a second level
        [1, 0, 0, 0, 0, 0, 0, 1],
        [1, 0, 0x01, 0, 0, 0, 0, 0],    // peripheral addressing, bus 1
        [1, 0, 0x80, 0x01, 0, 0, 0, 0], // logical unit addressing
        [1, 0, 0xc0, 0x00, 0, 0, 0, 0], // another extended address
        [1, 0, 0xc1, 0x02, 0, 0, 0, 0],
    ];
    let mut rng = Rng(0x1a7);
    for i in 0..300 {
        let mut l = [0u8; 8];
        rng.bytes(&mut l);
        if i % 2 == 0 {
            // Mostly well-formed: target and single-level LUN random.
            l[0] = 1;
            l[4..].fill(0);
            if i % 4 == 0 {
                l[1] = 0;
            }
        }
        fields.push(l);
    }
    let mut none = standard_inquiry();
    none[0] = 0x7f;
    for l in &fields {
        q.q.set_lun_field(*l);
        let r = q.q.request(Cmd::inquiry(None, 96), &[], T).unwrap();
        q.t.count(&["commands"]);
        let c = &r.completion;
        match virtio_lun(l) {
            Some((0, unit)) => {
                assert_eq!(
                    (c.resp.response, c.resp.status, c.resp.residual, c.used_len),
                    (0, 0, 60, RESP + 36),
                    "{l:02x?}"
                );
                if unit == 0 || unit == 300 {
                    assert_eq!(r.data_in(), standard_inquiry(), "{l:02x?}");
                } else {
                    assert_eq!(r.data_in(), none, "{l:02x?}: unit {unit} is not there");
                    q.t.count(&["bad_lun"]);
                }
            }
            _ => {
                assert_eq!(
                    (c.resp.response, c.resp.status, c.resp.sense_len, c.resp.residual, c.used_len),
                    (response::BAD_TARGET, 0, 0, 96, RESP),
                    "{l:02x?}"
                );
                assert!(r.data.iter().all(|&b| b == POISON), "{l:02x?}: data-in written");
                q.t.count(&["bad_lun"]);
            }
        }
    }
    // A data command to another target does not reach the unit.
    q.q.set_lun_field([1, 1, 0, 0, 0, 0, 0, 0]);
    let r = q.q.request(Cmd::write_16(0, 8, 512), &[0xee; 4096], T).unwrap();
    q.t.count(&["commands", "bad_lun"]);
    assert_eq!((r.resp.response, r.completion.used_len), (response::BAD_TARGET, RESP));
    assert_bg(&img, 0, 4096);
    q.still_serves();
    finish(q, dev, d);
}

#[test]
fn hostile_chains_are_each_answered_and_counted() {
    let dir = Dir::new();
    let size = 4u64 << 20;
    let img = dir.image("lun0.img", size);
    let d = start(&[file_lun(0, &img, "")], &[]);
    let mut dev = connect(&d, false);
    // A ring long enough for chains of 260 descriptors.
    let mut q = Q::new(dev.scsi_queue_sized(0, 4, 256 << 10, Some(1024)).unwrap(), Some(&img));
    q.still_serves();
    let hdr = |cmd: &Cmd| CmdReq { lun: lun_field(0), id: 7, task_attr: 0, prio: 0, crn: 0, cdb: cmd.cdb }.bytes();
    let inquiry = hdr(&Cmd::inquiry(None, 96));
    let read8 = hdr(&Cmd::read_10(8, 8, 512));
    let write8 = hdr(&Cmd::write_10(32, 8, 512));
    let junk = vec![0xeeu8; 4096];

    // No room for the 108-byte response: returned untouched, used length 0,
    // and a write without one is not performed.
    let no_room: Vec<Vec<RawSeg>> = vec![
        vec![RawSeg::Readable(&inquiry)],
        vec![RawSeg::Readable(&inquiry), RawSeg::Writable(1)],
        vec![RawSeg::Readable(&inquiry), RawSeg::Writable(107)],
        vec![RawSeg::Readable(&inquiry), RawSeg::Writable(50), RawSeg::Writable(57)],
        vec![RawSeg::Readable(&write8), RawSeg::Readable(&junk), RawSeg::Writable(100)],
        // 108 bytes, but in more pieces than the device stores a response in (8).
        std::iter::once(RawSeg::Readable(&inquiry)).chain(std::iter::repeat_n(RawSeg::Writable(12), 9)).collect(),
    ];
    for segs in &no_room {
        let r = q.raw(segs, &["no_response"]);
        assert_eq!(r.completion.used_len, 0, "{} buffers", segs.len());
        assert!(r.data.iter().all(|&b| b == RESPONSE_NOT_WRITTEN), "response written into a chain without room");
        q.still_serves();
    }
    assert_bg(&img, 32 * 512, 4096);

    // A request header shorter than 51 bytes (of every length, none at
    // all): response FAILURE, nothing else written.
    for n in 0..scsi::REQ_LEN {
        let mut segs = Vec::new();
        if n > 0 {
            segs.push(RawSeg::Readable(&inquiry[..n]));
        }
        segs.push(RawSeg::Writable(RESP));
        segs.push(RawSeg::Writable(96));
        let r = q.raw(&segs, &[]);
        let c = &r.completion;
        assert_eq!(
            (c.resp.response, c.resp.status, c.resp.sense_len, c.resp.residual, c.used_len),
            (response::FAILURE, 0, 0, 0, RESP),
            "a header of {n} bytes"
        );
        assert!(r.data[RESP_LEN..].iter().all(|&b| b == RESPONSE_NOT_WRITTEN), "data-in written for a short header");
    }
    q.still_serves();

    // Any framing of what is there is fine: the header in 51 one-byte
    // buffers; the response in 2 and in 8 pieces; response and data-in in
    // one buffer; the data-in starting inside the response's last buffer;
    // data-in in 64-byte pieces; header and data-out in one buffer.
    let inquiry_ok = |r: &ScsiReply| {
        let c = &r.completion;
        assert_eq!((c.resp.response, c.resp.status, c.resp.residual, c.used_len), (0, 0, 60, RESP + 36));
        assert_eq!(&r.data[RESP_LEN..RESP_LEN + 36], &standard_inquiry()[..]);
    };
    let mut bytewise: Vec<RawSeg> = inquiry.chunks(1).map(RawSeg::Readable).collect();
    bytewise.push(RawSeg::Writable(RESP));
    bytewise.push(RawSeg::Writable(96));
    inquiry_ok(&q.raw(&bytewise, &[]));
    inquiry_ok(
        &q.raw(&[RawSeg::Readable(&inquiry), RawSeg::Writable(60), RawSeg::Writable(48), RawSeg::Writable(96)], &[]),
    );
    let mut eight = vec![RawSeg::Readable(&inquiry)];
    eight.extend(std::iter::repeat_n(RawSeg::Writable(14), 7));
    eight.push(RawSeg::Writable(10));
    eight.push(RawSeg::Writable(96));
    inquiry_ok(&q.raw(&eight, &[]));
    inquiry_ok(&q.raw(&[RawSeg::Readable(&inquiry), RawSeg::Writable(RESP + 96)], &[]));
    inquiry_ok(&q.raw(&[RawSeg::Readable(&inquiry), RawSeg::Writable(100), RawSeg::Writable(8 + 96)], &[]));
    let mut pieces = vec![RawSeg::Readable(&read8), RawSeg::Writable(RESP)];
    pieces.extend(std::iter::repeat_n(RawSeg::Writable(64), 64));
    let r = q.raw(&pieces, &["reads"]);
    q.t.add("bytes_read", 4096);
    assert!(r.completion.ok() && r.completion.used_len == RESP + 4096, "{:?}", r.completion.problem());
    assert_eq!(&r.data[RESP_LEN..], &read_file(&img, 8 * 512, 4096)[..]);
    let mut one = write8.to_vec();
    let mut payload = vec![0u8; 4096];
    fill_pattern(&mut payload, 32 * 512, 71);
    one.extend_from_slice(&payload);
    let r = q.raw(&[RawSeg::Readable(&one), RawSeg::Writable(RESP)], &["writes"]);
    q.t.add("bytes_written", 4096);
    assert!(r.completion.ok(), "{:?}", r.completion.problem());
    assert_eq!(read_file(&img, 32 * 512, 4096), payload);

    // Data in up to 256 pieces is moved; in 257 it is refused (INVALID
    // FIELD IN CDB), nothing transferred either way.
    for (n, ok) in [(254u32, true), (256, true), (257, false)] {
        let rd = hdr(&Cmd::read_10(64, n as u16, 512));
        let mut segs = vec![RawSeg::Readable(&rd), RawSeg::Writable(RESP)];
        segs.extend(std::iter::repeat_n(RawSeg::Writable(512), n as usize));
        let r = if ok { q.raw(&segs, &["reads"]) } else { q.raw(&segs, &["reads", "check_conditions"]) };
        let c = &r.completion;
        if ok {
            q.t.add("bytes_read", n as u64 * 512);
            assert!(c.ok() && c.used_len == RESP + n * 512, "{n} pieces: {:?}", c.problem());
            assert_eq!(&r.data[RESP_LEN..], &read_file(&img, 64 * 512, n as usize * 512)[..]);
        } else {
            assert_eq!((c.resp.status, c.used_len, c.resp.residual), (status::CHECK_CONDITION, RESP, n * 512));
            assert_eq!(c.sense_bytes(), &fixed_sense(INVALID_FIELD_IN_CDB)[..]);
            assert!(r.data[RESP_LEN..].iter().all(|&b| b == RESPONSE_NOT_WRITTEN));
        }
        let wr = hdr(&Cmd::write_10(1024, n as u16, 512));
        let mut data = vec![0u8; n as usize * 512];
        fill_pattern(&mut data, 1024 * 512, 72 + n as u64);
        let mut segs = vec![RawSeg::Readable(&wr)];
        segs.extend(data.chunks(512).map(RawSeg::Readable));
        segs.push(RawSeg::Writable(RESP));
        let r = if ok { q.raw(&segs, &["writes"]) } else { q.raw(&segs, &["writes", "check_conditions"]) };
        let c = &r.completion;
        if ok {
            q.t.add("bytes_written", n as u64 * 512);
            assert!(c.ok(), "{n} pieces: {:?}", c.problem());
            assert_eq!(read_file(&img, 1024 * 512, data.len()), data);
        } else {
            assert_eq!((c.resp.status, c.used_len), (status::CHECK_CONDITION, RESP));
            assert_eq!(c.sense_bytes(), &fixed_sense(INVALID_FIELD_IN_CDB)[..]);
            // The 256-piece write before it is what the image holds.
            let mut prev = vec![0u8; 256 * 512];
            fill_pattern(&mut prev, 1024 * 512, 72 + 256);
            assert_eq!(read_file(&img, 1024 * 512, prev.len()), prev);
            assert_bg(&img, (1024 + 256) * 512, 512);
        }
        q.still_serves();
    }

    // A chain the ring itself rejects (its header outside guest memory):
    // returned with length 0 and counted, the queue going on.
    let outside = dev.memory().gpa_base() + dev.memory().size() + (1 << 20);
    let resp_gpa = dev.memory().alloc(128, 64).unwrap();
    q.q.queue
        .ring
        .add(&[vhostd_user::Buf { addr: outside, len: 51 }], &[vhostd_user::Buf { addr: resp_gpa, len: RESP }], 999)
        .unwrap();
    q.q.queue.publish_and_kick().unwrap();
    let mut used = None;
    assert!(wait_until(T, || {
        used = q.q.queue.ring.pop_used().unwrap();
        used.is_some()
    }));
    assert_eq!(used.map(|u| (u.token, u.len)), Some((999, 0)));
    q.t.count(&["bad_chains"]);
    q.still_serves();

    finish(q, dev, d);
}

/// UNMAP and WRITE SAME count their unused buffers as residual: a
/// data-out longer than UNMAP's parameter list, or than the one block
/// WRITE SAME replicates, leaves the rest unused, and the residual must
/// say so (virtio 1.2, 5.6.6.1: the data length less what was
/// transferred), as it does for every other command.
#[test]
fn residual_of_unmap_and_write_same_counts_unused_buffers() {
    let dir = Dir::new();
    let img = dir.image("lun0.img", 2 << 20);
    let d = start(&[file_lun(0, &img, ",discard=on")], &[]);
    let mut dev = connect(&d, false);
    let mut q = Q::new(dev.scsi_queue(0, 4, 64 << 10).unwrap(), Some(&img));
    let mut params = scsi::unmap_parameters(&[(1024, 8)]);
    assert_eq!(params.len(), 24);
    params.resize(512, 0);
    q.good_resid(0, Cmd::unmap(24).with_data(Data::Out(512)), &params, 512 - 24, &["unmaps"]);
    let zeros = vec![0u8; 4096];
    let ws = Cmd::write_same_16(2048, 8, true, false, 512).with_data(Data::Out(4096));
    q.good_resid(0, ws, &zeros, 4096 - 512, &["unmaps"]);
    let ws = Cmd::write_same_16(3072, 8, true, true, 512).with_data(Data::In(4096));
    q.good_resid(0, ws, &[], 4096, &["unmaps"]);
}

// ---------------------------------------------------------------------------
// 7. Task management and asynchronous notification.
// ---------------------------------------------------------------------------

/// TMFs answered at once (nothing they name is in flight, or they are
/// refused), AN requests, and malformed control requests, each counted.
#[test]
fn task_management_answered_at_once_and_an_requests() {
    let dir = Dir::new();
    let img = dir.image("lun0.img", 1 << 20);
    let d = start(&[file_lun(0, &img, ""), "300=null,size=16M".into()], &["--queues", "2"]);
    let mut dev = connect(&d, false);
    let mut c = dev.scsi_ctrl(8).unwrap();
    let mut q = Q::new(dev.scsi_queue(0, 4, 4096).unwrap(), Some(&img));
    q.still_serves();
    let l0 = lun_field(0);
    // Nothing in flight: every function is complete at once; a query
    // finds nothing.
    for (f, lun) in [
        (tmf::ABORT_TASK, l0),
        (tmf::ABORT_TASK_SET, l0),
        (tmf::CLEAR_TASK_SET, lun_field(300)),
        (tmf::LOGICAL_UNIT_RESET, l0),
        (tmf::I_T_NEXUS_RESET, l0),
        (tmf::QUERY_TASK, l0),
        (tmf::QUERY_TASK_SET, lun_field(300)),
        // I_T NEXUS RESET names no unit: any unit of target 0 will do.
        (tmf::I_T_NEXUS_RESET, lun_field(9)),
    ] {
        assert_eq!(c.tmf(f, lun, 12345, T).unwrap(), response::FUNCTION_COMPLETE, "TMF {f} on {lun:02x?}");
    }
    // A unit that is not there; no ACA here, nor unknown functions;
    // another target, a LUN field not in virtio's form.
    for f in [
        tmf::ABORT_TASK,
        tmf::ABORT_TASK_SET,
        tmf::CLEAR_TASK_SET,
        tmf::LOGICAL_UNIT_RESET,
        tmf::QUERY_TASK,
        tmf::QUERY_TASK_SET,
    ] {
        assert_eq!(c.tmf(f, lun_field(9), 1, T).unwrap(), response::INCORRECT_LUN, "TMF {f} on unit 9");
    }
    assert_eq!(c.tmf(tmf::CLEAR_ACA, l0, 0, T).unwrap(), response::FUNCTION_REJECTED);
    assert_eq!(c.tmf(99, l0, 0, T).unwrap(), response::FUNCTION_REJECTED);
    for lun in [[1, 1, 0, 0, 0, 0, 0, 0], [0u8; 8], [1, 0, 0x80, 0, 0, 0, 0, 0]] {
        assert_eq!(c.tmf(tmf::ABORT_TASK, lun, 1, T).unwrap(), response::BAD_TARGET, "{lun:02x?}");
        assert_eq!(c.tmf(tmf::I_T_NEXUS_RESET, lun, 1, T).unwrap(), response::BAD_TARGET, "{lun:02x?}");
    }
    // AN: no notification class is supported (event_actual 0), asked of a
    // unit, of one that is not there; another target is BAD_TARGET.
    for kind in [ctrl::AN_QUERY, ctrl::AN_SUBSCRIBE] {
        assert_eq!(c.an(kind, l0, 0xffff_ffff, T).unwrap(), (0, response::OK));
        assert_eq!(c.an(kind, lun_field(9), 0x10, T).unwrap(), (0, response::OK));
        assert_eq!(c.an(kind, [1, 3, 0, 0, 0, 0, 0, 0], 0x10, T).unwrap(), (0, response::BAD_TARGET));
    }
    // Malformed requests: too short, an unknown type, a TMF without room
    // for its response: returned with length 0. An AN response cut short
    // keeps what fits.
    let tmf_req = scsi::CtrlReq::Tmf { subtype: tmf::ABORT_TASK, lun: l0, id: 1 }.bytes();
    let mut unknown = tmf_req.clone();
    unknown[0] = 9;
    let an_req = scsi::CtrlReq::An { kind: ctrl::AN_QUERY, lun: l0, event_requested: 1 }.bytes();
    let bad: [(&[RawSeg], u32); 5] = [
        (&[RawSeg::Readable(&tmf_req[..2]), RawSeg::Writable(1)], 0),
        (&[RawSeg::Readable(&tmf_req[..23]), RawSeg::Writable(1)], 0),
        (&[RawSeg::Readable(&unknown), RawSeg::Writable(1)], 0),
        (&[RawSeg::Readable(&tmf_req)], 0),
        (&[RawSeg::Readable(&an_req), RawSeg::Writable(4)], 4),
    ];
    for (i, (segs, used)) in bad.iter().enumerate() {
        assert!(c.submit_raw(segs, 100 + i as u64).unwrap());
        let got = c.wait_for(100 + i as u64, T).unwrap().expect("a malformed control request was not returned");
        assert_eq!(got.used_len, *used, "malformed control request {i}");
        if *used == 0 {
            assert!(got.writable.iter().all(|&b| b == RESPONSE_NOT_WRITTEN), "request {i}: response written");
        } else {
            assert_eq!(got.writable, [0, 0, 0, 0], "the AN response's first 4 bytes");
        }
    }
    // The TMF's response split over two buffers is fine.
    assert!(c
        .submit_raw(&[RawSeg::Readable(&tmf_req[..10]), RawSeg::Readable(&tmf_req[10..]), RawSeg::Writable(1)], 200)
        .unwrap());
    assert_eq!(c.wait_for(200, T).unwrap().map(|g| (g.used_len, g.response)), Some((1, response::FUNCTION_COMPLETE)));
    q.still_serves();
    drop(c);
    let s = finish(q, dev, d);
    expect_queue(&s, 3, &Tally::default());
    // 8 + 6 + 2 + 6 TMFs, the one without room for its response and the
    // split one; 6 AN requests and the short one; the four malformed ones.
    assert_eq!((s.queue(0, "tmfs"), s.queue(0, "an"), s.queue(0, "bad_requests")), (23 + 1, 6 + 1, 4));
}

/// A READ the task-management tests leave hanging: (request queue, unit, tag).
type Hung = (usize, u16, u64);

/// Holds the disk, starts `reads` (4 KiB each, data-in poisoned), waits
/// until the device has each in flight (QUERY TASK answers FUNCTION
/// SUCCEEDED), posts TMF `f` for unit `lun` naming tag `id`, checks that
/// it is not answered while they hang (and that the control queue answers
/// other requests meanwhile), runs `meanwhile`, releases the disk, and
/// returns the TMF's response and every read's completion, by tag.
#[allow(clippy::too_many_arguments)]
fn tmf_on_hung_reads(
    disk: &HangingDisk,
    c: &mut ScsiCtrl,
    qs: &mut [Q],
    reads: &[Hung],
    f: u32,
    lun: u16,
    id: u64,
    meanwhile: impl FnOnce(&mut ScsiCtrl),
) -> (u8, BTreeMap<u64, (ScsiCompletion, Vec<u8>)>) {
    let held = disk.hold();
    for &(qi, unit, tag) in reads {
        let q = &mut qs[qi];
        assert!(q.q.submit_to(lun_field(unit), tag, &Cmd::read_16(tag * 8, 8, 512), tag, |b| b.fill(POISON)).unwrap());
        q.q.flush().unwrap();
        q.t.count(&["commands", "reads"]);
    }
    for &(_, unit, tag) in reads {
        assert!(
            wait_until(T, || c.tmf(tmf::QUERY_TASK, lun_field(unit), tag, T).unwrap() == response::FUNCTION_SUCCEEDED),
            "READ {tag} of unit {unit} never in flight"
        );
    }
    const USER: u64 = 7777;
    assert!(c.submit(&scsi::CtrlReq::Tmf { subtype: f, lun: lun_field(lun), id }, USER).unwrap());
    assert_eq!(
        c.wait_for(USER, Duration::from_millis(500)).unwrap(),
        None,
        "TMF {f} answered while the commands it names hang"
    );
    // The control queue is not held up: a query of a tag not in flight.
    assert_eq!(c.tmf(tmf::QUERY_TASK, lun_field(lun), 999_999, T).unwrap(), response::FUNCTION_COMPLETE);
    meanwhile(c);
    for q in qs.iter_mut() {
        assert_eq!(q.q.poll(|c, _| panic!("tag {} completed while the disk hangs", c.id)).unwrap(), 0);
    }
    held.release();
    let answer = c.wait_for(USER, T).unwrap().unwrap_or_else(|| panic!("TMF {f} not answered once the disk answered"));
    let mut got = BTreeMap::new();
    let deadline = Instant::now() + T;
    while got.len() < reads.len() {
        for q in qs.iter_mut() {
            q.q.poll(|c, data| {
                got.insert(c.id, (c.clone(), data.to_vec()));
            })
            .unwrap();
        }
        assert!(Instant::now() < deadline, "{} of {} reads completed", got.len(), reads.len());
        qs[0].q.wait(Duration::from_millis(5)).unwrap();
    }
    (answer.response, got)
}

/// Checks each hung READ's answer: `aborted` ones with that response (no
/// status, no sense, used length 108), the others GOOD with the disk's
/// data (zeros); tallies them.
fn check_hung(qs: &mut [Q], reads: &[Hung], got: &BTreeMap<u64, (ScsiCompletion, Vec<u8>)>, aborted: &[u64], how: u8) {
    for &(qi, unit, tag) in reads {
        let (c, data) = &got[&tag];
        let r = &c.resp;
        if aborted.contains(&tag) {
            assert_eq!(
                (r.response, r.status, r.sense_len, c.used_len),
                (how, status::GOOD, 0, RESP),
                "READ {tag} of unit {unit}"
            );
            qs[qi].t.count(&["aborted"]);
        } else {
            assert!(c.ok() && c.used_len == RESP + 4096, "READ {tag} of unit {unit}: {:?}", c.problem());
            assert!(data.iter().all(|&b| b == 0), "READ {tag}: the disk's zeros");
            qs[qi].t.add("bytes_read", 4096);
        }
    }
}

/// Task management on commands in flight: READs hang in a FUSE disk (the
/// kernel holds them) while TMFs name them; each TMF is answered only once
/// none of the commands it names is in flight, and those are answered
/// ABORTED (RESET for the resets) when they finish; the others as usual.
#[test]
fn task_management_on_commands_hung_in_the_disk() {
    if !needs_root("mounting a FUSE file system (tests/hanging_fs.py)") {
        return;
    }
    let dir = Dir::new();
    let img = dir.image("lun2.img", 1 << 20);
    let disk = HangingDisk::mount(&dir.0, 16 << 20);
    let fuse = disk.disk();
    // Units 0 and 1 on the hanging disk, 2 on a local file.
    let d = start(&[file_lun(0, &fuse, ""), file_lun(1, &fuse, ""), file_lun(2, &img, "")], &["--queues", "2"]);
    let mut dev = connect(&d, false);
    let mut c = dev.scsi_ctrl(8).unwrap();
    let mut qs =
        [Q::new(dev.scsi_queue(0, 16, 4096).unwrap(), None), Q::new(dev.scsi_queue(1, 16, 4096).unwrap(), None)];

    // ABORT TASK of one of three: the others are not aborted; naming it on
    // another unit names nothing.
    let reads = [(0, 0, 1), (0, 0, 2), (1, 0, 3)];
    let (r, got) = tmf_on_hung_reads(&disk, &mut c, &mut qs, &reads, tmf::ABORT_TASK, 0, 1, |c| {
        assert_eq!(c.tmf(tmf::ABORT_TASK, lun_field(1), 2, T).unwrap(), response::FUNCTION_COMPLETE);
        assert_eq!(c.tmf(tmf::QUERY_TASK, lun_field(0), 2, T).unwrap(), response::FUNCTION_SUCCEEDED);
    });
    assert_eq!(r, response::FUNCTION_COMPLETE);
    check_hung(&mut qs, &reads, &got, &[1], response::ABORTED);

    // LOGICAL UNIT RESET of unit 0, on both queues: RESET; unit 1's READ
    // is not touched.
    let reads = [(0, 0, 11), (1, 0, 12), (0, 1, 13)];
    let (r, got) = tmf_on_hung_reads(&disk, &mut c, &mut qs, &reads, tmf::LOGICAL_UNIT_RESET, 0, 0, |_| {});
    assert_eq!(r, response::FUNCTION_COMPLETE);
    check_hung(&mut qs, &reads, &got, &[11, 12], response::RESET);

    // ABORT TASK SET and CLEAR TASK SET: the unit's commands ABORTED.
    let reads = [(0, 1, 21), (1, 1, 22), (1, 0, 23)];
    let (r, got) = tmf_on_hung_reads(&disk, &mut c, &mut qs, &reads, tmf::ABORT_TASK_SET, 1, 0, |_| {});
    assert_eq!(r, response::FUNCTION_COMPLETE);
    check_hung(&mut qs, &reads, &got, &[21, 22], response::ABORTED);
    let reads = [(0, 0, 31), (1, 0, 32)];
    let (r, got) = tmf_on_hung_reads(&disk, &mut c, &mut qs, &reads, tmf::CLEAR_TASK_SET, 0, 0, |_| {});
    assert_eq!(r, response::FUNCTION_COMPLETE);
    check_hung(&mut qs, &reads, &got, &[31, 32], response::ABORTED);

    // I_T NEXUS RESET: every unit's commands RESET; a READ of the local
    // unit meanwhile is answered at once, as usual.
    let reads = [(0, 0, 41), (1, 1, 42)];
    let (r, got) = tmf_on_hung_reads(&disk, &mut c, &mut qs, &reads, tmf::I_T_NEXUS_RESET, 0, 0, |_| {});
    assert_eq!(r, response::FUNCTION_COMPLETE);
    check_hung(&mut qs, &reads, &got, &[41, 42], response::RESET);

    // Answered at once while commands hang: QUERY TASK SET (SUCCEEDED for
    // the unit with one in flight, COMPLETE for the other), TMFs for a
    // unit that is not there, CLEAR ACA, another target, AN; and commands
    // of the local unit.
    let held = disk.hold();
    assert!(qs[1].q.submit_to(lun_field(1), 51, &Cmd::read_16(0, 8, 512), 51, |b| b.fill(POISON)).unwrap());
    qs[1].q.flush().unwrap();
    qs[1].t.count(&["commands", "reads"]);
    assert!(wait_until(T, || c.tmf(tmf::QUERY_TASK_SET, lun_field(1), 0, T).unwrap() == response::FUNCTION_SUCCEEDED));
    assert_eq!(c.tmf(tmf::QUERY_TASK_SET, lun_field(2), 0, T).unwrap(), response::FUNCTION_COMPLETE);
    assert_eq!(c.tmf(tmf::QUERY_TASK, lun_field(1), 52, T).unwrap(), response::FUNCTION_COMPLETE);
    assert_eq!(c.tmf(tmf::ABORT_TASK, lun_field(7), 51, T).unwrap(), response::INCORRECT_LUN);
    assert_eq!(c.tmf(tmf::LOGICAL_UNIT_RESET, lun_field(7), 0, T).unwrap(), response::INCORRECT_LUN);
    assert_eq!(c.tmf(tmf::CLEAR_ACA, lun_field(1), 0, T).unwrap(), response::FUNCTION_REJECTED);
    assert_eq!(c.tmf(tmf::ABORT_TASK, [1, 1, 0, 1, 0, 0, 0, 0], 51, T).unwrap(), response::BAD_TARGET);
    assert_eq!(c.an(ctrl::AN_QUERY, lun_field(1), 0x10, T).unwrap(), (0, response::OK));
    assert_eq!(c.an(ctrl::AN_SUBSCRIBE, lun_field(1), 0x10, T).unwrap(), (0, response::OK));
    let r = qs[0].good(2, Cmd::read_16(0, 8, 512), &[], &["reads"]);
    qs[0].t.add("bytes_read", 4096);
    assert_eq!(check_pattern(&r, 0, BG), None);
    held.release();
    let got = collect(&mut [&mut qs[1].q], 1);
    assert!(got[&51].0.ok(), "{:?}", got[&51].0.problem());
    qs[1].t.add("bytes_read", 4096);

    // The hanging disk's units work once it answers: written, read back,
    // in the disk.
    let mut data = vec![0u8; 4096];
    fill_pattern(&mut data, 4096, 61);
    qs[0].write(0, 8, &data);
    assert_eq!(qs[1].read(1, 8, 8), data, "written on unit 0, read on unit 1 (the same file)");
    assert_eq!(read_file(&fuse, 4096, 4096), data);
    let tallies: Vec<Tally> = qs.iter().map(|q| q.t.clone()).collect();
    drop(qs);
    drop(c);
    dev.disconnect().unwrap();
    let s = d.stop();
    expect_queue(&s, 2, &tallies[0]);
    expect_queue(&s, 3, &tallies[1]);
    assert_eq!(tallies[0].get("aborted") + tallies[1].get("aborted"), 9);
}

// ---------------------------------------------------------------------------
// 8. Hotplug events on the event queue.
// ---------------------------------------------------------------------------

/// `vhostd ctl --control CTL ARGS`, which must succeed.
fn ctl(ctl: &Path, args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_vhostd"))
        .args(["ctl", "--control", ctl.to_str().unwrap()])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "vhostd ctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn hotplug_events_on_the_event_queue() {
    let dir = Dir::new();
    let img = dir.image("lun0.img", 1 << 20);
    let img3 = dir.image("lun3.img", 1 << 20);
    let sock_ctl = dir.0.join("ctl");
    let d = start(&[file_lun(0, &img, "")], &["--control", sock_ctl.to_str().unwrap()]);
    let mut dev = connect(&d, false);
    assert_ne!(dev.features() & f::SCSI_HOTPLUG, 0, "HOTPLUG negotiated");
    let mut ev = dev.scsi_events(4).unwrap();
    let mut q = Q::new(dev.scsi_queue(0, 4, 4096).unwrap(), Some(&img));
    assert_eq!(ev.post(4).unwrap(), 4);
    let next = |ev: &mut scsi::ScsiEvents| ev.next_event(T).unwrap().expect("no event within 10 s");
    let reset = event::TRANSPORT_RESET;

    // A unit added: RESCAN, and it is served at once.
    let lun3 = file_lun(3, &img3, "");
    ctl(&sock_ctl, &["add-lun", DEV, &lun3]);
    let e = next(&mut ev);
    assert_eq!((e.event, e.lun, e.reason, e.used_len), (reset, lun_field(3), event::RESCAN, 16));
    let mut luns = vec![0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0];
    assert_eq!(q.good_resid(0, Cmd::report_luns(0, 64), &[], 40, &[]), luns);
    assert_eq!(check_pattern(&q.read(3, 0, 8), 0, BG), None);
    // A unit added below the one just used moves it in the queue's list
    // (which the queue remembers its last unit by): LUN 3's commands still
    // reach LUN 3's image, LUN 1's LUN 1's.
    let img1 = dir.image("lun1.img", 1 << 20);
    q.write(3, 0, &[0x5a; 4096]);
    // (A buffer for each of the two events this adds, as room allows.)
    assert_eq!(ev.post(1).unwrap(), 1);
    ctl(&sock_ctl, &["add-lun", DEV, &file_lun(1, &img1, "")]);
    let e = next(&mut ev);
    assert_eq!((e.event, e.lun, e.reason), (reset, lun_field(1), event::RESCAN));
    assert_eq!(ev.post(1).unwrap(), 1);
    assert_eq!(q.read(3, 0, 8), vec![0x5a; 4096]);
    assert_eq!(check_pattern(&q.read(1, 0, 8), 0, BG), None);
    assert_eq!(q.read(3, 0, 8), vec![0x5a; 4096]);
    assert_bg(&img1, 0, 1 << 20);
    ctl(&sock_ctl, &["remove-lun", DEV, "1"]);
    let e = next(&mut ev);
    assert_eq!((e.event, e.lun, e.reason), (reset, lun_field(1), event::REMOVED));
    // Removed: REMOVED, and the unit is gone.
    ctl(&sock_ctl, &["remove-lun", DEV, "3"]);
    let e = next(&mut ev);
    assert_eq!((e.event, e.lun, e.reason, e.used_len), (reset, lun_field(3), event::REMOVED, 16));
    q.check(3, Cmd::read_16(0, 8, 512), &[], LUN_NOT_SUPPORTED, &["bad_lun"]);
    luns.truncate(16);
    luns[3] = 8;
    assert_eq!(q.good_resid(0, Cmd::report_luns(0, 64), &[], 48, &[]), luns);
    // Units above 255 are named in flat space.
    ctl(&sock_ctl, &["add-lun", DEV, "4000=null,size=1M"]);
    let e = next(&mut ev);
    assert_eq!((e.event, e.lun, e.reason), (reset, [1, 0, 0x4f, 0xa0, 0, 0, 0, 0], event::RESCAN));
    ctl(&sock_ctl, &["remove-lun", DEV, "4000"]);
    let e = next(&mut ev);
    assert_eq!((e.event, e.lun, e.reason), (reset, lun_field(4000), event::REMOVED));
    // No buffer posted: the event is lost; the next buffer posted carries
    // an empty event flagged EVENTS_MISSED, the one after the next event.
    assert_eq!(ev.posted(), 0);
    ctl(&sock_ctl, &["add-lun", DEV, "5=null,size=1M"]);
    assert!(wait_until(T, || {
        let s = q.q.request(Cmd::report_luns(0, 64), &[], T).unwrap();
        q.t.count(&["commands"]);
        s.data_in().len() == 24
    }));
    assert_eq!(ev.post(1).unwrap(), 1);
    let e = next(&mut ev);
    assert_eq!((e.event, e.lun, e.reason, e.used_len), (event::NO_EVENT | event::EVENTS_MISSED, [0; 8], 0, 16));
    assert_eq!(ev.post(1).unwrap(), 1);
    ctl(&sock_ctl, &["add-lun", DEV, "6=null,size=1M"]);
    let e = next(&mut ev);
    assert_eq!((e.event, e.lun, e.reason), (reset, lun_field(6), event::RESCAN));
    q.still_serves();
    drop((q.q, ev));
    dev.disconnect().unwrap();

    // A driver without HOTPLUG hears of nothing.
    let mut o = options(&d.sock, false);
    o.features &= !f::SCSI_HOTPLUG;
    let mut dev = VirtioUser::connect(o).unwrap();
    assert_eq!(dev.features() & f::SCSI_HOTPLUG, 0);
    let mut ev = dev.scsi_events(4).unwrap();
    ev.post(4).unwrap();
    let mut q2 = Q::new(dev.scsi_queue(0, 4, 4096).unwrap(), Some(&img));
    ctl(&sock_ctl, &["add-lun", DEV, "7=null,size=1M"]);
    assert!(wait_until(T, || {
        let s = q2.q.request(Cmd::report_luns(0, 64), &[], T).unwrap();
        q2.t.count(&["commands"]);
        s.data_in().len() == 40
    }));
    assert_eq!(ev.next_event(Duration::from_millis(300)).unwrap(), None, "an event without HOTPLUG");
    drop((q2.q, ev));
    dev.disconnect().unwrap();
    let s = d.stop();
    // The two connections' commands, on the one request queue.
    let mut t = q.t.clone();
    for (k, v) in q2.t.0 {
        t.add(k, v);
    }
    expect_queue(&s, 2, &t);
    assert_eq!((s.queue(1, "events"), s.queue(1, "events_missed")), (8, 1));
}

// ---------------------------------------------------------------------------
// 9. Reconnects with inflight tracking under writes.
// ---------------------------------------------------------------------------

/// A frontend that tracks commands in flight (INFLIGHT_SHMFD): the
/// inflight memory for the control, event and one request queue of 128
/// entries, and that request queue (32 commands of up to `max_data`).
fn tracked(sock: &Path, max_data: u32) -> (VirtioUser, ScsiQueue) {
    let mut o = Options::scsi(sock);
    o.protocol_features |= VhostUserProtocolFeatures::INFLIGHT_SHMFD;
    let mut dev = VirtioUser::connect(o).unwrap();
    assert!(dev.protocol_features().contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD));
    assert!(dev.get_inflight_fd(3, 128).unwrap() > 0);
    let q = dev.scsi_queue_sized(0, 32, max_data, Some(128)).unwrap();
    (dev, q)
}

/// Writes of numbered 4 KiB blocks, 32 in flight, while the connection
/// breaks `ROUNDS` times at a random moment: vhostd killed with SIGKILL
/// and started again (`kill`), or the frontend closing its socket; the
/// frontend then reconnects with its memory, rings and inflight memory
/// and restarts the ring at its used index (as QEMU does). Every write
/// must complete GOOD exactly once, and be in the image afterwards.
fn reconnect_under_writes(kill: bool) {
    const ROUNDS: u64 = 6;
    const PER_ROUND: u64 = 200;
    const BS: u64 = 4096;
    let dir = Dir::new();
    let size = 16u64 << 20;
    let img = dir.image("lun0.img", size);
    let sock = dir.0.join("scsi.sock");
    let luns = [file_lun(0, &img, "")];
    let mut d = start_at(Some(&sock), &luns, &[]);
    let (mut dev, mut q) = tracked(&sock, BS as u32);
    let mut rng = Rng(0x4ec0 + kill as u64);
    let seed = |b: u64| 0x100 + b % 7;
    let mut done = vec![false; (ROUNDS * PER_ROUND) as usize];
    let mut next = 0u64;
    let mut resumed = Vec::new();
    let mut logs = String::new();
    for round in 0..ROUNDS {
        let end = (round + 1) * PER_ROUND;
        let break_at = round * PER_ROUND + PER_ROUND / 4 + rng.next() % (PER_ROUND / 2);
        let mut broken = false;
        let deadline = Instant::now() + T;
        while done[(round * PER_ROUND) as usize..end as usize].iter().any(|&x| !x) {
            let mut n = 0;
            while next < end && q.in_flight() < 32 && (broken || next < break_at) {
                let off = next * BS;
                let cmd = Cmd::write_16(off / 512, (BS / 512) as u32, 512);
                assert!(q.submit(&cmd, next, |b| fill_pattern_shared(b, off, seed(next))).unwrap());
                next += 1;
                n += 1;
            }
            if n > 0 {
                q.flush().unwrap();
            }
            if !broken && next == break_at {
                // The connection breaks right after a batch went out, with
                // commands in the ring, taken or not.
                broken = true;
                if kill {
                    // SAFETY: kill(2) on our own child.
                    unsafe { libc::kill(d.pid(), libc::SIGKILL) };
                    logs.push_str(&d.log());
                    drop(d);
                    d = start_at(Some(&sock), &luns, &[]);
                }
                dev.reconnect().unwrap_or_else(|e| panic!("reconnect: {e}"));
                dev.restart_queue(&mut q.queue).unwrap();
                q.queue.kick().unwrap();
                resumed.push(q.in_flight());
            }
            q.poll(|c, _| {
                assert!(c.ok(), "write {}: {:?}", c.user, c.problem());
                assert!(!std::mem::replace(&mut done[c.user as usize], true), "write {} completed twice", c.user);
            })
            .unwrap();
            assert!(
                Instant::now() < deadline,
                "round {round}: writes not completed within {T:?}; vhostd log:\n{}",
                d.log()
            );
            q.wait(Duration::from_millis(5)).unwrap();
        }
    }
    assert!(done.iter().all(|&x| x));
    // The image: every block its write's pattern, the rest untouched.
    let data = fs::read(&img).unwrap();
    for b in 0..ROUNDS * PER_ROUND {
        let off = (b * BS) as usize;
        assert_eq!(check_pattern(&data[off..off + BS as usize], off as u64, seed(b)), None, "block {b}");
    }
    let end = (ROUNDS * PER_ROUND * BS) as usize;
    assert_eq!(check_pattern(&data[end..], end as u64, BG), None);
    drop(q);
    dev.disconnect().unwrap();
    logs.push_str(&d.log());
    let resubmitted: Vec<u64> =
        logs.lines().filter_map(|l| l.split("resubmitted ").nth(1)?.split(' ').next()?.parse().ok()).collect();
    eprintln!("commands in flight at each break: {resumed:?}; vhostd resubmitted: {resubmitted:?}");
    let s = d.stop();
    if !kill {
        // One daemon saw it all: each write taken once, none twice (the
        // old connection's were finished before the new one began).
        let mut t = Tally::default();
        t.add("commands", ROUNDS * PER_ROUND);
        t.add("writes", ROUNDS * PER_ROUND);
        t.add("bytes_written", ROUNDS * PER_ROUND * BS);
        expect_queue(&s, 2, &t);
        assert!(resubmitted.is_empty(), "{resubmitted:?}");
    }
}

#[test]
fn reconnect_after_vhostd_is_killed_under_writes() {
    reconnect_under_writes(true);
}

#[test]
fn frontend_reconnects_with_its_inflight_memory_under_writes() {
    reconnect_under_writes(false);
}

/// vhostd killed while writes hang in the disk (so they are surely in
/// flight, taken and unanswered): the next vhostd, handed the inflight
/// memory, runs exactly those again, and each completes once.
#[test]
fn killed_with_writes_hung_in_the_disk_resubmits_them() {
    if !needs_root("mounting a FUSE file system (tests/hanging_fs.py)") {
        return;
    }
    let dir = Dir::new();
    let disk = HangingDisk::mount(&dir.0, 16 << 20);
    let fuse = disk.disk();
    let sock = dir.0.join("scsi.sock");
    let luns = [file_lun(0, &fuse, "")];
    let d = start_at(Some(&sock), &luns, &[]);
    let (mut dev, q) = tracked(&sock, 4096);
    let mut c = dev.scsi_ctrl(4).unwrap();
    let mut q = Q::new(q, None);
    let block = |b: u64| {
        let mut v = vec![0u8; 4096];
        fill_pattern(&mut v, b * 4096, 0x51);
        v
    };
    for b in 0..8 {
        q.write(0, b * 8, &block(b));
    }
    let held = disk.hold();
    for b in 100..116u64 {
        assert!(q
            .q
            .submit_to(lun_field(0), b, &Cmd::write_16(b * 8, 8, 512), b, |buf| assert!(
                buf.len() == 4096 && buf.write_at(0, &block(b))
            ))
            .unwrap());
    }
    q.q.flush().unwrap();
    for b in 100..116u64 {
        assert!(
            wait_until(T, || c.tmf(tmf::QUERY_TASK, lun_field(0), b, T).unwrap() == response::FUNCTION_SUCCEEDED),
            "write {b} never in flight"
        );
    }
    // SIGKILL: the process ends once the disk lets its writes go.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(d.pid(), libc::SIGKILL) };
    held.release();
    drop(d);
    let d = start_at(Some(&sock), &luns, &[]);
    dev.reconnect().unwrap();
    dev.restart_queue(&mut q.q.queue).unwrap();
    q.q.queue.kick().unwrap();
    let got = collect(&mut [&mut q.q], 16);
    for (b, (c, _)) in &got {
        assert!(c.ok(), "write {b}: {:?}", c.problem());
    }
    assert!(
        wait_until(T, || d.log().contains("resubmitted 16 command(s) left in flight by a previous backend")),
        "vhostd log:\n{}",
        d.log()
    );
    // On the next vhostd: the 16 it ran again, and reads of everything.
    let mut t = Tally::default();
    t.add("commands", 16);
    t.add("writes", 16);
    t.add("bytes_written", 16 * 4096);
    q.t = t;
    for b in (0..8).chain(100..116) {
        assert_eq!(q.read(0, b * 8, 8), block(b), "block {b}");
        assert_eq!(read_file(&fuse, b * 4096, 4096), block(b), "block {b} in the disk");
    }
    drop(c);
    finish(q, dev, d);
}

// ---------------------------------------------------------------------------
// 10. The workload engine over split and packed rings, one and two
//     request queues; the CLI.
// ---------------------------------------------------------------------------

fn verify_case(queues: u16, packed: bool) {
    let dir = Dir::new();
    let size = 4u64 << 20;
    let img = dir.image("lun0.img", size);
    let nq = queues.to_string();
    let d = start(&[file_lun(0, &img, ""), "1=null,size=64M".into()], &["--queues", &nq]);
    let mut dev = connect(&d, packed);
    assert_eq!(dev.scsi_config().unwrap().num_queues, queues as u32);
    assert_eq!(dev.max_queues(), 2 + queues as u64);
    assert!(dev.scsi_queue(queues, 4, 4096).is_err(), "a request queue past num_queues");
    let mut qs: Vec<ScsiQueue> = (0..queues).map(|i| dev.scsi_queue(i, 16, 256 << 10).unwrap()).collect();
    let unit = qs[0].probe_disk(T).unwrap();
    assert_eq!(unit, scsi::DiskShape { blocks: size / 512, block_size: 512, read_only: false });
    for q in &mut qs[1..] {
        q.set_disk(512, false);
    }
    let area = 3u64 << 20;
    let runs: [(u32, u64, Option<u64>); 3] = [(256 << 10, 11, None), (4096, 12, None), (512, 13, Some(600))];
    let (mut blocks_total, mut bytes_total) = (0, 0);
    for (bs, seed, count) in runs {
        let w = Workload { seed, size: Some(area), count, ..Workload::new(Mode::Verify, bs) };
        let r = scsi::workload::run(&mut qs, unit.bytes(), &w, None).unwrap();
        assert!(r.passed(), "{}: {:?} {:?}", r.summary(), r.first_error, r.mismatch);
        let n = count.unwrap_or(area / bs as u64);
        assert_eq!(r.verified_blocks, n, "{}", r.summary());
        assert_eq!(r.flush, Some(status::GOOD));
        assert_eq!((r.ios, r.errors, r.bytes), (2 * n + 1, 0, 2 * n * bs as u64), "{}", r.summary());
        assert!(r.summary().starts_with(&format!("scsi mode=verify bs={bs} iodepth=16 queues={queues} ")));
        assert!(r.summary().contains(" verify=ok ") && r.summary().contains(" flush=ok "), "{}", r.summary());
        blocks_total += n;
        bytes_total += n * bs as u64;
    }
    // Random reads of the null unit for a while, every queue.
    for q in qs.iter_mut() {
        q.set_lun(1);
    }
    let w = Workload { duration: Some(Duration::from_millis(300)), ..Workload::new(Mode::RandRead, 4096) };
    let r = scsi::workload::run(&mut qs, 64 << 20, &w, None).unwrap();
    assert!(r.passed() && r.ios > 0, "{}", r.summary());
    assert!(qs.iter().all(|q| q.in_flight() == 0));
    drop(qs);
    dev.disconnect().unwrap();
    let data = fs::read(&img).unwrap();
    assert_eq!(check_pattern(&data[..600 * 512], 0, 13), None);
    assert_eq!(check_pattern(&data[600 * 512..area as usize], 600 * 512, 12), None);
    assert_eq!(check_pattern(&data[area as usize..], area, BG), None, "bytes past the area changed");
    let s = d.stop();
    check_totals(&s);
    let req: Vec<usize> = (2..2 + queues as usize).collect();
    let sum = |k: &str| req.iter().map(|&q| s.queue(q, k)).sum::<u64>();
    assert_eq!(sum("writes"), blocks_total);
    assert_eq!(sum("bytes_written"), bytes_total);
    assert_eq!(sum("reads"), blocks_total + r.ios);
    assert_eq!(sum("bytes_read"), bytes_total + r.bytes);
    // The probe (READ CAPACITY, MODE SENSE) and the three flushes went on
    // the first queue.
    assert_eq!(sum("commands"), 2 * blocks_total + r.ios + 2 + 3);
    assert_eq!(s.queue(2, "flushes"), 3);
    for k in ["check_conditions", "bad_lun", "overruns", "no_response", "backend_errors", "aborted", "bad_chains"] {
        assert_eq!(sum(k), 0, "{k}");
    }
    if queues > 1 {
        assert!(req.iter().all(|&q| s.queue(q, "writes") > 0), "a queue carried no writes");
    }
}

#[test]
fn verify_split_ring_one_queue() {
    verify_case(1, false);
}

#[test]
fn verify_packed_ring_one_queue() {
    verify_case(1, true);
}

#[test]
fn verify_split_ring_two_queues() {
    verify_case(2, false);
}

#[test]
fn verify_packed_ring_two_queues() {
    verify_case(2, true);
}

// ---------------------------------------------------------------------------
// 11. Indirect descriptors: more commands in flight than a ring holds
//     direct 3-descriptor chains.
// ---------------------------------------------------------------------------

/// The ring the indirect tests use (vhostd takes no larger one), and the
/// commands in flight on it: all 32, where direct chains fit 10.
const IND_RING: u16 = 32;

/// Submits `cmds` (tag = index) on `q` all at once, checks the ring held
/// every one of them, takes every completion (each good, with the used
/// length of its data-in) and returns the data buffers by tag. Counted.
fn all_in_flight(q: &mut Q, cmds: &[(Cmd, Vec<u8>)]) -> BTreeMap<u64, Vec<u8>> {
    q.q.set_lun(0);
    for (i, (cmd, out)) in cmds.iter().enumerate() {
        let posted =
            q.q.submit(cmd, i as u64, |b| match cmd.data {
                Data::Out(_) => assert!(b.write_at(0, out) && b.len() == out.len()),
                _ => b.fill(POISON),
            })
            .unwrap();
        assert!(posted, "command {i} of {}: no free slot", cmds.len());
        q.t.count(&["commands"]);
        match cmd.data {
            Data::In(n) => {
                q.t.count(&["reads"]);
                q.t.add("bytes_read", n as u64);
            }
            Data::Out(n) => {
                q.t.count(&["writes"]);
                q.t.add("bytes_written", n as u64);
            }
            Data::None => q.t.count(&["flushes"]),
        }
    }
    assert_eq!(q.q.in_flight() as usize, cmds.len());
    q.q.flush().unwrap();
    let got = collect(&mut [&mut q.q], cmds.len());
    got.into_iter()
        .map(|(user, (c, data))| {
            assert!(c.ok(), "tag {user}: {:?}", c.problem());
            assert_eq!(c.used_len, RESP + c.data.data_in(), "tag {user}");
            (user, data)
        })
        .collect()
}

/// Writes and reads, IND_RING commands in flight in a ring of IND_RING
/// entries, the data checked byte for byte in the image and read back; the
/// workload engine's verify at that depth; vhostd counts every command
/// exactly and no bad chain.
fn indirect_case(packed: bool) {
    let dir = Dir::new();
    let size = 4u64 << 20;
    let img = dir.image("lun0.img", size);
    let d = start(&[file_lun(0, &img, "")], &["--queue-size", &IND_RING.to_string()]);
    let mut o = options(&d.sock, packed);
    o.features |= f::INDIRECT_DESC;
    let mut dev = VirtioUser::connect(o).unwrap_or_else(|e| panic!("connect: {e}; vhostd log:\n{}", d.log()));
    assert_eq!(dev.packed(), packed);
    assert_ne!(dev.features() & f::INDIRECT_DESC, 0, "INDIRECT_DESC negotiated");
    let depth = IND_RING;
    let e = dev.scsi_queue_sized(0, depth, 4096, Some(IND_RING)).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("cannot hold 32 commands of 3 descriptors"), "{e}");
    let q = dev.scsi_queue_indirect(0, depth, 64 << 10, Some(IND_RING)).unwrap();
    assert!(q.indirect());
    assert_eq!(q.queue.ring.size(), IND_RING);
    let mut q = Q::new(q, Some(&img));

    // Writes of 4, 8 and 12 KiB, 10 and 16-byte CDBs, 32 KiB apart.
    let lba = |i: usize| i as u64 * 64;
    let len = |i: usize| 4096 * (1 + i % 3);
    let writes = |seed: u64, len: &dyn Fn(usize) -> usize| -> Vec<(Cmd, Vec<u8>)> {
        (0..depth as usize)
            .map(|i| {
                let mut b = vec![0u8; len(i)];
                fill_pattern(&mut b, lba(i) * 512, seed);
                let blocks = (b.len() / 512) as u32;
                let cmd = if i % 2 == 0 {
                    Cmd::write_10(lba(i) as u32, blocks as u16, 512)
                } else {
                    Cmd::write_16(lba(i), blocks, 512)
                };
                (cmd, b)
            })
            .collect()
    };
    let reads = |len: &dyn Fn(usize) -> usize| -> Vec<(Cmd, Vec<u8>)> {
        (0..depth as usize)
            .map(|i| {
                let blocks = (len(i) / 512) as u32;
                let cmd = if i % 2 == 1 {
                    Cmd::read_10(lba(i) as u32, blocks as u16, 512)
                } else {
                    Cmd::read_16(lba(i), blocks, 512)
                };
                (cmd, Vec::new())
            })
            .collect()
    };
    // Each command's bytes in the image; the first time, nothing else
    // of its 32 KiB moved.
    let check_image = |w: &[(Cmd, Vec<u8>)], first: bool| {
        for (i, (_, b)) in w.iter().enumerate() {
            assert_eq!(read_file(&img, lba(i) * 512, b.len()), *b, "command {i}'s bytes in the image");
            if first {
                assert_bg(&img, lba(i) * 512 + b.len() as u64, 32768 - b.len());
            }
        }
    };
    let check_read = |got: &BTreeMap<u64, Vec<u8>>, w: &[(Cmd, Vec<u8>)], len: &dyn Fn(usize) -> usize| {
        for (i, (_, b)) in w.iter().enumerate() {
            assert_eq!(got[&(i as u64)][..], b[..len(i)], "command {i}: data read back");
        }
    };

    let w1 = writes(41, &len);
    all_in_flight(&mut q, &w1);
    check_image(&w1, true);
    // Read back with the same shapes, then twice as 4 KiB reads (the
    // second time every slot's kept indirect chain is posted again as is).
    let got = all_in_flight(&mut q, &reads(&len));
    check_read(&got, &w1, &len);
    for _ in 0..2 {
        let got = all_in_flight(&mut q, &reads(&|_| 4096));
        check_read(&got, &w1, &|_| 4096);
    }
    // Overwritten with 8 KiB each, flushed (a 2-descriptor chain), read.
    let w2 = writes(42, &|_| 8192);
    all_in_flight(&mut q, &w2);
    check_image(&w2, false);
    all_in_flight(&mut q, &[(Cmd::synchronize_cache_10(0, 0), Vec::new())]);
    let got = all_in_flight(&mut q, &reads(&|_| 8192));
    check_read(&got, &w2, &|_| 8192);
    q.still_serves();

    // The workload engine at that depth: write, flush, read back, compare.
    q.q.set_lun(0);
    q.q.set_disk(512, false);
    let area = 1u64 << 20;
    let w = Workload { iodepth: depth, seed: 43, size: Some(area), ..Workload::new(Mode::Verify, 4096) };
    let r = scsi::workload::run(std::slice::from_mut(&mut q.q), size, &w, None).unwrap();
    assert!(r.passed(), "{}: {:?} {:?}", r.summary(), r.first_error, r.mismatch);
    let n = area / 4096;
    assert_eq!((r.verified_blocks, r.ios, r.errors), (n, 2 * n + 1, 0), "{}", r.summary());
    assert_eq!(check_pattern(&fs::read(&img).unwrap()[..area as usize], 0, 43), None);
    q.t.add("commands", 2 * n + 1);
    q.t.add("writes", n);
    q.t.add("reads", n);
    q.t.add("flushes", 1);
    q.t.add("bytes_written", area);
    q.t.add("bytes_read", area);
    let s = finish(q, dev, d);
    assert_eq!(s.queue(2, "bad_chains"), 0);
}

#[test]
fn indirect_descriptors_split_ring() {
    indirect_case(false);
}

#[test]
fn indirect_descriptors_packed_ring() {
    indirect_case(true);
}

/// An indirect queue needs INDIRECT_DESC negotiated: refused, not posted.
#[test]
fn indirect_descriptors_refused_without_the_feature() {
    let d = start(&["0=null,size=64M".into()], &[]);
    let mut dev = connect(&d, false);
    assert_eq!(dev.features() & f::INDIRECT_DESC, 0, "asked for only when used");
    let e = dev.scsi_queue_indirect(0, 64, 4096, Some(64)).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("VIRTIO_RING_F_INDIRECT_DESC was not negotiated"), "{e}");
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.total("commands"), 0);
}

/// `vhostd-user scsi` as bench/ runs it: the summary line, exit 0; and
/// exit 1 with a reason for a unit that is not there and for writes to a
/// read-only one.
#[test]
fn the_vhostd_user_cli_drives_a_unit() {
    let bin = Path::new(env!("CARGO_BIN_EXE_vhostd")).with_file_name("vhostd-user");
    assert!(bin.exists(), "{} is not built (cargo build --release builds it)", bin.display());
    let dir = Dir::new();
    let img = dir.image("lun0.img", 4 << 20);
    let img2 = dir.image("lun2.img", 1 << 20);
    let luns = [file_lun(0, &img, ""), "1=null,size=1G".into(), file_lun(2, &img2, ",readonly=on")];
    let d = start(&luns, &["--queues", "2"]);
    let run = |args: &[&str]| {
        let out = Command::new(&bin)
            .args(["scsi", "--socket-path", d.sock.to_str().unwrap(), "--stall-timeout", "10"])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) =
        run(&["--lun", "0", "--mode", "verify", "--bs", "4096", "--iodepth", "8", "--queues", "2", "--packed", "on"]);
    assert_eq!(code, Some(0), "{out}{err}");
    let line = out.trim();
    assert!(
        line.starts_with("scsi mode=verify bs=4096 iodepth=8 queues=2 ios=2049 errors=0 bytes=8388608 seconds="),
        "{line}"
    );
    for k in [
        "iops=",
        "mbps=",
        "lat_us p50=",
        " p90=",
        " p99=",
        " p999=",
        " max=",
        " verify=ok blocks=1024 flush=ok",
        " reordered=",
    ] {
        assert!(line.contains(k), "{k} in {line}");
    }
    assert_eq!(check_pattern(&fs::read(&img).unwrap(), 0, 1), None, "the verify pattern (seed 1) in the image");
    let (code, out, err) = run(&["--lun", "1", "--mode", "randread", "--duration", "0.3", "--iodepth", "32"]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with("scsi mode=randread bs=4096 iodepth=32 queues=1 ios="), "{out}");
    // 64 commands in a ring of 64: indirect descriptors, chosen (auto) or
    // asked for; refused with a reason when turned off.
    for ind in ["auto", "on"] {
        let args = ["--lun", "0", "--mode", "verify", "--iodepth", "64", "--queue-size", "64", "--indirect", ind];
        let (code, out, err) = run(&args);
        assert_eq!(code, Some(0), "{out}{err}");
        assert!(err.contains("request queues: indirect descriptors"), "{err}");
        assert!(out.contains(" verify=ok blocks=1024 flush=ok"), "{out}");
    }
    let (code, _, err) = run(&["--lun", "1", "--mode", "randread", "--count", "100", "--iodepth", "8"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("request queues: direct descriptors"), "{err}");
    let (code, _, err) =
        run(&["--lun", "0", "--mode", "read", "--iodepth", "64", "--queue-size", "64", "--indirect", "off"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--queue-size 64 cannot hold --iodepth 64 commands of 3 descriptors"), "{err}");
    let (code, _, err) = run(&["--lun", "7", "--mode", "read", "--count", "10"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("LUN 7") && err.contains("0x25"), "{err}");
    let (code, _, err) = run(&["--lun", "2", "--mode", "write", "--count", "10"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("read-only"), "{err}");
    let (code, _, err) = run(&["--lun", "0", "--mode", "read", "--queues", "3"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--queues 3: the device has 2"), "{err}");
    assert_bg(&img2, 0, 1 << 20);
    d.stop();
}
