//! A hostile guest against the real `vhostd` binary, driven through the
//! project's own frontend (`vhostd-user`) with hand-written rings: every
//! case builds one kind of malformed ring, chain or request on a split or
//! packed ring of virtio-net or virtio-blk, and asserts its exact outcome
//! (the chain completed with used length 0 and counted under its exact
//! reason, the device marked NEEDS_RESET, a request answered with a given
//! status, a vhost-user request refused), then that vhostd still serves the
//! connection's other queues and, after it goes, the next connection on the
//! same socket. The cases and their outcomes are listed in
//! doc/hostile-guest.md.
//!
//! Per-reason counters come from the control socket (`--control`, the
//! JSON `vhostd stats --json` prints); the exit counters are checked too.
//! Every daemon is killed on drop, every wait is bounded.

mod common;

use common::*;
use serde_json::Value;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;
use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VringConfigData};
use vhostd_user::blk::{self, status, BlkOp, BlkQueue};
use vhostd_user::features as f;
use vhostd_user::{
    Descriptor, Options, PackedDesc, PackedDriver, RingLayout, RxQueue, SplitDriver, TxQueue,
    VhostUserProtocolFeatures, VirtQueue, VirtioUser,
};

const T: Duration = Duration::from_secs(10);
/// VRING_DESC_F_*.
const NEXT: u16 = 1;
const WRITE: u16 = 2;
const INDIRECT: u16 = 4;
/// Packed descriptor AVAIL / USED bits.
const AVAIL: u16 = 1 << 7;
const USED: u16 = 1 << 15;
/// Device status NEEDS_RESET (GET_STATUS).
const NEEDS_RESET: u8 = 0x40;
/// vhost-user GET_STATUS.
const GET_STATUS: u32 = 40;
/// Size of every hostile ring (unless a case says otherwise).
const QSIZE: u16 = 64;
/// virtio_net_hdr_v1 (VERSION_1 is always negotiated here).
const HDR: usize = 12;
/// Largest indirect table vhostd takes, in descriptors (the largest queue).
const MAX_TABLE: u32 = 32768;

// ---------------------------------------------------------------------------
// The daemon, its control socket, its counters.
// ---------------------------------------------------------------------------

/// A vhostd (net: loopback, two queue pairs; blk: a null disk of 4 MiB, two
/// request queues) with a control socket for the per-reason counters.
struct Vd {
    d: Daemon,
    ctl: PathBuf,
    blk: bool,
}

fn start(kind: &'static str, args: &[&str]) -> Vd {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let mut ctl = PathBuf::new();
    let d = Daemon::start_with(None, |sock| {
        ctl = sock.with_file_name("ctl.sock");
        let mut v = vec![kind.to_string(), "--socket-path".into(), sock.display().to_string()];
        v.extend(["--control".to_string(), ctl.display().to_string()]);
        v.extend(args);
        v
    });
    Vd { d, ctl, blk: kind == "blk" }
}

fn net_daemon() -> Vd {
    start("net", &["--backend", "loopback", "--queues", "2"])
}

/// Blk capacity in sectors (null,size=4M).
const BLK_SECTORS: u64 = 8192;

fn blk_daemon() -> Vd {
    start("blk", &["--backend", "null,size=4M", "--queues", "2"])
}

impl Vd {
    /// One snapshot of the control socket (what `vhostd stats --json` prints).
    fn json(&self) -> Value {
        self.try_json().unwrap_or_else(|| panic!("no answer on the control socket; vhostd log:\n{}", self.d.log()))
    }

    fn try_json(&self) -> Option<Value> {
        let mut s = UnixStream::connect(&self.ctl).ok()?;
        s.set_read_timeout(Some(T)).ok()?;
        s.write_all(b"stats\n").ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        serde_json::from_str(out.trim()).ok()
    }

    /// The counters of queue `i`.
    fn q(&self, i: u64) -> Value {
        let v = self.json();
        let qs = v["devices"][0]["queues"].as_array().expect("queues").clone();
        qs.into_iter().find(|q| q["queue"] == i).unwrap_or_else(|| panic!("no queue {i} in {v}"))
    }

    fn needs_reset_reported(&self) -> bool {
        self.json()["devices"][0]["needs_reset"] == true
    }

    /// SIGTERM; the exit counters.
    fn stop(self) -> Stats {
        self.d.stop()
    }
}

/// Bad chains of a queue by reason, as the control socket reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Bad {
    index: u64,
    lp: u64,
    address: u64,
    direction: u64,
    indirect: u64,
}

impl Bad {
    fn of(q: &Value) -> Bad {
        let b = &q["bad_chains"];
        let g = |k: &str| b[k].as_u64().unwrap_or_else(|| panic!("no bad_chains.{k} in {q}"));
        let bad = Bad {
            index: g("index"),
            lp: g("loop"),
            address: g("address"),
            direction: g("direction"),
            indirect: g("indirect"),
        };
        assert_eq!(g("total"), bad.total(), "bad_chains.total is the sum of the reasons: {q}");
        bad
    }

    fn total(&self) -> u64 {
        self.index + self.lp + self.address + self.direction + self.indirect
    }
}

const NONE: Bad = Bad { index: 0, lp: 0, address: 0, direction: 0, indirect: 0 };
const fn index(n: u64) -> Bad {
    Bad { index: n, ..NONE }
}
const fn lp(n: u64) -> Bad {
    Bad { lp: n, ..NONE }
}
const fn address(n: u64) -> Bad {
    Bad { address: n, ..NONE }
}
const fn direction(n: u64) -> Bad {
    Bad { direction: n, ..NONE }
}
const fn indirect(n: u64) -> Bad {
    Bad { indirect: n, ..NONE }
}

/// What a net queue must show: frames moved, drops by reason, bad chains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct NetQ {
    packets: u64,
    short_header: u64,
    too_big: u64,
    /// Dropped by the backend (loopback: a frame the guest had no RX room for).
    backend: u64,
    /// Dropped for another reason (RX: a frame that could not be placed).
    other_drops: u64,
    bad: Bad,
}

impl NetQ {
    fn of(q: &Value) -> NetQ {
        let d = &q["drops"];
        let g = |v: &Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {q}"));
        let bad = Bad::of(q);
        assert_eq!(g(d, "bad_chain"), bad.total(), "{q}");
        let (short_header, too_big, backend) = (g(d, "short_header"), g(d, "too_big"), g(d, "backend"));
        let dropped = g(q, "dropped");
        NetQ {
            packets: g(q, "packets"),
            short_header,
            too_big,
            backend,
            other_drops: dropped - short_header - too_big - backend,
            bad,
        }
    }
}

/// The net queue `i` has exactly these counters.
fn expect_net(vd: &Vd, i: u64, want: NetQ) {
    assert_eq!(NetQ::of(&vd.q(i)), want, "net queue {i}");
}

/// What a blk queue must show (every error counter; requests by type are
/// checked where a case cares).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct BlkQ {
    ioerr: u64,
    unsupp: u64,
    no_status: u64,
    out_of_range: u64,
    misaligned: u64,
    bad: Bad,
}

impl BlkQ {
    fn of(q: &Value) -> BlkQ {
        let e = &q["errors"];
        let g = |k: &str| e[k].as_u64().unwrap_or_else(|| panic!("no errors.{k} in {q}"));
        let bad = Bad::of(q);
        assert_eq!(g("bad_chain"), bad.total(), "{q}");
        assert_eq!((g("read_only"), g("backend")), (0, 0), "{q}");
        BlkQ {
            ioerr: g("ioerr"),
            unsupp: g("unsupp"),
            no_status: g("no_status"),
            out_of_range: g("out_of_range"),
            misaligned: g("misaligned"),
            bad,
        }
    }
}

fn expect_blk(vd: &Vd, i: u64, want: BlkQ) {
    assert_eq!(BlkQ::of(&vd.q(i)), want, "blk queue {i}");
}

// ---------------------------------------------------------------------------
// Connections.
// ---------------------------------------------------------------------------

/// Frontend options with STATUS (for GET_STATUS) and the given extra features.
fn options(vd: &Vd, extra: u64) -> Options {
    let mut o = if vd.blk { Options::blk(&vd.d.sock) } else { vd.d.options() };
    o.protocol_features |= VhostUserProtocolFeatures::STATUS;
    o.features |= extra;
    o.required |= extra;
    o
}

/// A frontend plus a second handle on its socket for raw requests.
struct Conn {
    dev: VirtioUser,
    raw: UnixStream,
}

fn connect(vd: &Vd, extra: u64) -> Conn {
    connect_with(vd, extra, |_| {})
}

/// `connect` with the options edited first.
fn connect_with(vd: &Vd, extra: u64, edit: impl FnOnce(&mut Options)) -> Conn {
    let sock = UnixStream::connect(&vd.d.sock).unwrap();
    let raw = sock.try_clone().unwrap();
    let mut o = options(vd, extra);
    edit(&mut o);
    let dev = VirtioUser::from_stream(sock, o).unwrap_or_else(|e| panic!("connect: {e}; vhostd log:\n{}", vd.d.log()));
    assert_eq!(dev.packed(), extra & f::RING_PACKED != 0);
    Conn { dev, raw }
}

impl Conn {
    /// GET_STATUS.
    fn status(&mut self) -> u8 {
        raw_request(&mut self.raw, GET_STATUS, 0, &[], true).unwrap()[0]
    }

    fn needs_reset(&mut self) -> bool {
        self.status() & NEEDS_RESET != 0
    }

    /// Allocates `len` bytes of guest memory (64-aligned) holding `data`.
    fn put(&mut self, data: &[u8], len: usize) -> u64 {
        let gpa = self.dev.memory().alloc(len.max(data.len()).max(1) as u64, 64).unwrap();
        assert!(self.dev.memory().driver_memory().write(gpa, data));
        gpa
    }

    /// A raw ring `index` of `size` entries, started.
    fn raw_ring(&mut self, index: usize, size: u16) -> Ring {
        let q = self.dev.create_queue(index, size, None).unwrap();
        self.dev.start_queue(&q).unwrap();
        Ring::new(q)
    }

    fn read(&mut self, gpa: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        assert!(self.dev.memory().driver_memory().read(gpa, &mut b));
        b
    }

    /// End of guest memory (guest-physical).
    fn mem_end(&mut self) -> u64 {
        self.dev.memory().gpa_base() + self.dev.memory().size()
    }
}

/// A ring the test writes by hand, split or packed.
struct Ring {
    q: VirtQueue,
    packed: bool,
    /// Split: next descriptor index to hand out (test-managed).
    next_desc: u16,
    /// Split: next used entry to read.
    last_used: u16,
    /// Packed: next slot to write and its wrap counter.
    avail: u16,
    avail_wrap: bool,
    /// Packed: next slot where a used descriptor is expected.
    used: u16,
    used_wrap: bool,
    /// Packed: slots each posted buffer id takes.
    ndesc: HashMap<u16, u16>,
    next_id: u16,
}

/// One buffer of a chain: address, length, VRING_DESC_F_WRITE / INDIRECT.
#[derive(Clone, Copy, Debug)]
struct B(u64, u32, u16);

impl Ring {
    fn new(q: VirtQueue) -> Ring {
        let packed = q.ring.is_packed();
        Ring {
            q,
            packed,
            next_desc: 0,
            last_used: 0,
            avail: 0,
            avail_wrap: true,
            used: 0,
            used_wrap: true,
            ndesc: HashMap::new(),
            next_id: 0,
        }
    }

    fn size(&self) -> u16 {
        self.q.ring.size()
    }

    fn split(&mut self) -> &mut SplitDriver {
        self.q.ring.split().expect("a split ring")
    }

    fn pk(&mut self) -> &mut PackedDriver {
        self.q.ring.packed().expect("a packed ring")
    }

    /// Split: writes descriptor `i` raw.
    fn desc(&mut self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        self.split().write_desc(i, Descriptor { addr, len, flags, next });
    }

    /// Split: makes `heads` available (one avail.idx store) and kicks.
    fn post(&mut self, heads: &[u16]) {
        let r = self.split();
        let mut idx = r.avail_idx();
        for &h in heads {
            r.write_avail_ring(idx, h);
            idx = idx.wrapping_add(1);
        }
        r.set_avail_idx(idx);
        self.kick();
    }

    fn kick(&mut self) {
        self.q.kick().unwrap();
    }

    /// Makes a chain of `bufs` available and kicks; returns its head (split)
    /// or buffer id (packed). Split chains take the next descriptors in
    /// order, linked by NEXT; packed chains the next ring slots, the head's
    /// flags written last.
    fn chain(&mut self, bufs: &[B]) -> u16 {
        let id = self.write_chain(bufs);
        if !self.packed {
            self.post(&[id]);
        } else {
            self.kick();
        }
        id
    }

    /// `chain` without publishing (split) or kicking.
    fn write_chain(&mut self, bufs: &[B]) -> u16 {
        assert!(!bufs.is_empty() && bufs.len() <= self.size() as usize);
        let n = bufs.len() as u16;
        if !self.packed {
            let size = self.size();
            let head = self.next_desc;
            for (k, b) in bufs.iter().enumerate() {
                let i = (head + k as u16) % size;
                let last = k + 1 == bufs.len();
                let flags = b.2 | if last { 0 } else { NEXT };
                self.desc(i, b.0, b.1, flags, (i + 1) % size);
            }
            self.next_desc = (head + n) % size;
            return head;
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let size = self.size();
        // Slots and their laps first, then written back to front.
        let mut slots = Vec::new();
        let (mut s, mut w) = (self.avail, self.avail_wrap);
        for _ in 0..n {
            slots.push((s, w));
            s += 1;
            if s == size {
                s = 0;
                w = !w;
            }
        }
        for (k, b) in bufs.iter().enumerate().rev() {
            let (slot, wrap) = slots[k];
            let last = k + 1 == bufs.len();
            let flags = b.2 | PackedDriver::avail_bits(wrap) | if last { 0 } else { NEXT };
            self.pk().write_desc(slot, PackedDesc { addr: b.0, len: b.1, id, flags });
        }
        self.avail = s;
        self.avail_wrap = w;
        self.ndesc.insert(id, n);
        id
    }

    /// The next used entry, if the device has written it: (head or id, length).
    fn take_used(&mut self) -> Option<(u16, u32)> {
        if !self.packed {
            let used_idx = self.split().used_idx();
            if used_idx == self.last_used {
                return None;
            }
            let last = self.last_used;
            let e = self.split().read_used_ring(last);
            self.last_used = self.last_used.wrapping_add(1);
            return Some(e);
        }
        let at = self.used;
        let d = self.pk().read_desc(at);
        let a = d.flags & AVAIL != 0;
        let u = d.flags & USED != 0;
        if a != self.used_wrap || u != self.used_wrap {
            return None;
        }
        let n = self.ndesc.remove(&d.id).unwrap_or_else(|| panic!("used id {} never posted", d.id));
        let size = self.size();
        self.used += n;
        if self.used >= size {
            self.used -= size;
            self.used_wrap = !self.used_wrap;
        }
        Some((d.id, d.len))
    }

    /// Waits (bounded) for the next `n` used entries.
    fn wait_used(&mut self, n: usize) -> Vec<(u16, u32)> {
        let mut got = Vec::new();
        let ok = wait_until(T, || {
            while let Some(u) = self.take_used() {
                got.push(u);
            }
            got.len() >= n
        });
        assert!(ok, "only {} of {n} used entries came back: {got:?}", got.len());
        assert_eq!(got.len(), n, "more used entries than chains: {got:?}");
        got
    }

    /// No used entry is pending now.
    fn no_used(&mut self) {
        assert_eq!(self.take_used(), None, "an unexpected used entry");
    }
}

fn layout(packed: bool) -> u64 {
    if packed {
        f::RING_PACKED
    } else {
        0
    }
}

// ---------------------------------------------------------------------------
// virtio-net: a raw ring on pair 0, a normal pair 1, the next connection.
// ---------------------------------------------------------------------------

/// Sends `n` (at most 32) distinct frames on `tx` and checks exactly those
/// come back on `rx`, in order, byte for byte.
fn roundtrip(rx: &mut RxQueue, tx: &mut TxQueue, n: u32, seed: u32) {
    assert!(n <= 32);
    let sent: Vec<Vec<u8>> = (0..n).map(|i| frame(seed + i, 60 + ((seed + i) as usize * 37) % 1400)).collect();
    for fr in &sent {
        assert!(wait_until(T, || {
            tx.reclaim().unwrap();
            tx.free_slots() > 0
        }));
        assert!(tx.send_frame(fr).unwrap());
    }
    tx.flush().unwrap();
    let mut got = Vec::new();
    let ok = wait_until(T, || {
        tx.reclaim().unwrap();
        rx.recv_burst(64, |fr| got.push(fr.to_vec())).unwrap();
        got.len() >= n as usize
    });
    assert!(ok, "only {} of {n} frames came back", got.len());
    assert_eq!(got, sent, "frames differ");
    assert_eq!(rx.stats.bad, 0);
}

/// A normal queue pair `pair` (64 entries).
fn pair(c: &mut Conn, pair: u16) -> (RxQueue, TxQueue) {
    c.dev.net_queue_pair(pair, QSIZE).unwrap()
}

/// Ends a net case: the connection's other queue pairs still carry frames,
/// GET_STATUS (and the control socket) say NEEDS_RESET exactly when the
/// guest broke a ring; then the connection goes and the next one on the
/// same socket gets a clean device whose two pairs both work.
fn finish_net(vd: &Vd, mut c: Conn, others: Vec<(RxQueue, TxQueue)>, broken: bool, extra: u64) {
    for (i, (mut rx, mut tx)) in others.into_iter().enumerate() {
        roundtrip(&mut rx, &mut tx, 20, 1000 + 100 * i as u32);
    }
    assert_eq!(c.needs_reset(), broken, "GET_STATUS NEEDS_RESET");
    assert_eq!(vd.needs_reset_reported(), broken, "control socket needs_reset");
    drop(c);
    next_net_connection(vd, extra);
}

/// A fresh connection (same ring layout) gets a working, clean device.
fn next_net_connection(vd: &Vd, extra: u64) {
    let mut c = connect(vd, extra);
    assert!(!c.needs_reset(), "the next connection starts without NEEDS_RESET");
    let (mut rx0, mut tx0) = pair(&mut c, 0);
    let (mut rx1, mut tx1) = pair(&mut c, 1);
    roundtrip(&mut rx0, &mut tx0, 20, 5000);
    roundtrip(&mut rx1, &mut tx1, 20, 6000);
    drop((rx0, tx0, rx1, tx1));
    c.dev.disconnect().unwrap();
    assert!(!vd.needs_reset_reported());
}

/// Exit counters: bad chains per queue as the control socket said (and,
/// for net, in the total line).
fn check_exit(s: &Stats, bad: &[(usize, u64)]) {
    let mut total = 0;
    for &(q, n) in bad {
        assert_eq!(s.queue(q, "bad_chains"), n, "exit counters: queue {q} bad_chains");
        total += n;
    }
    assert_eq!(s.queues.len(), bad.len(), "exit counters: queues {:?}", s.queues.keys());
    if s.total.contains_key("guest_tx_packets") {
        assert_eq!(s.total("bad_chains"), total, "exit counters: total bad_chains");
    }
}

/// Pair 0 with a raw TX ring (queue 1) and a normal RX queue; pair 1 normal.
struct NetTx {
    c: Conn,
    rx: RxQueue,
    tx: Ring,
    other: (RxQueue, TxQueue),
    /// 64 buffers of 2 KiB for hand-made chains.
    area: u64,
    slot: u64,
    seq: u32,
}

fn net_tx(vd: &Vd, extra: u64, qsize: u16, gpa_base: u64) -> NetTx {
    net_tx_opt(vd, extra, qsize, gpa_base, true)
}

/// `net_tx`, the raw TX ring started only if `start`.
fn net_tx_opt(vd: &Vd, extra: u64, qsize: u16, gpa_base: u64, start: bool) -> NetTx {
    let mut c = connect_with(vd, extra, |o| o.gpa_base = gpa_base);
    assert_eq!(c.dev.net_hdr_len(), HDR);
    let mrg = c.dev.features() & f::NET_MRG_RXBUF != 0;
    let rxq = c.dev.create_queue(0, QSIZE, None).unwrap();
    let bufs = c.dev.memory().alloc(QSIZE as u64 * 2048, 64).unwrap();
    let rx = RxQueue::new(rxq, bufs, 2048, HDR, mrg).unwrap();
    c.dev.start_queue(&rx.queue).unwrap();
    let tx = if start { c.raw_ring(1, qsize) } else { Ring::new(c.dev.create_queue(1, qsize, None).unwrap()) };
    let area = c.dev.memory().alloc(64 * 2048, 64).unwrap();
    let other = pair(&mut c, 1);
    NetTx { c, rx, tx, other, area, slot: 0, seq: 0 }
}

impl NetTx {
    /// A fresh 2 KiB buffer of the area.
    fn buf(&mut self) -> u64 {
        let g = self.area + (self.slot % 64) * 2048;
        self.slot += 1;
        g
    }

    /// A buffer holding a zero header and a new 100-byte frame: (buffer, frame).
    fn frame_buf(&mut self) -> (B, Vec<u8>) {
        self.seq += 1;
        let fr = frame(self.seq, 100);
        let g = self.buf();
        let mut data = vec![0u8; HDR];
        data.extend_from_slice(&fr);
        assert!(self.c.dev.memory().driver_memory().write(g, &data));
        (B(g, data.len() as u32, 0), fr)
    }

    /// Waits for `n` used entries of the TX ring, each of length 0 (TX
    /// buffers are only read); returns their ids.
    fn used_empty(&mut self, n: usize) -> Vec<u16> {
        let u = self.tx.wait_used(n);
        for &(id, len) in &u {
            assert_eq!(len, 0, "TX used length of chain {id}");
        }
        u.into_iter().map(|(id, _)| id).collect()
    }

    /// The frames that came back on pair 0's RX queue (waits for `n`).
    fn received(&mut self, n: usize) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        let ok = wait_until(T, || {
            self.rx.recv_burst(64, |fr| got.push(fr.to_vec())).unwrap();
            got.len() >= n
        });
        assert!(ok, "only {} of {n} frames came back", got.len());
        assert_eq!(self.rx.stats.bad, 0);
        got
    }

    /// The TX ring still serves: a good chain goes through, its frame comes back.
    fn still_sends(&mut self) {
        let (b, fr) = self.frame_buf();
        let id = self.tx.chain(&[b]);
        assert_eq!(self.used_empty(1), vec![id]);
        assert_eq!(self.received(1), vec![fr]);
    }

    fn finish(self, vd: &Vd, broken: bool, extra: u64) {
        let NetTx { c, rx, tx, other, .. } = self;
        drop((rx, tx));
        finish_net(vd, c, vec![other], broken, extra);
    }
}

/// Runs a TX case: `body` gets the raw TX ring and returns whether it broke
/// the ring; pair 0's TX queue must end with `want`.
fn tx_case(packed: bool, extra: u64, qsize: u16, want: NetQ, body: impl FnOnce(&mut NetTx, &Vd) -> bool) {
    tx_case_at(packed, extra, qsize, 0, want, body)
}

/// `tx_case` with guest memory at guest-physical `gpa_base`.
fn tx_case_at(
    packed: bool,
    extra: u64,
    qsize: u16,
    gpa_base: u64,
    want: NetQ,
    body: impl FnOnce(&mut NetTx, &Vd) -> bool,
) {
    let vd = net_daemon();
    let extra = extra | layout(packed);
    let mut t = net_tx(&vd, extra, qsize, gpa_base);
    let broken = body(&mut t, &vd);
    if !broken {
        t.still_sends();
    }
    let mut want = want;
    if !broken {
        want.packets += 1;
    }
    expect_net(&vd, 1, want);
    t.finish(&vd, broken, extra);
    let s = vd.stop();
    check_exit(&s, &[(0, 0), (1, want.bad.total()), (2, 0), (3, 0)]);
}

/// Loops through `next`: a descriptor naming itself, and two naming each other.
#[test]
fn tx_descriptor_loops_split() {
    tx_case(false, 0, QSIZE, NetQ { bad: lp(2), ..NetQ::default() }, |t, _| {
        let g = t.buf();
        t.tx.desc(0, g, 50, NEXT, 0);
        t.tx.desc(1, g, 50, NEXT, 2);
        t.tx.desc(2, g, 50, NEXT, 1);
        t.tx.post(&[0, 1]);
        assert_eq!(t.used_empty(2), vec![0, 1]);
        t.tx.next_desc = 3;
        false
    });
}

/// Every descriptor of the table in one chain is fine (64 buffers, one
/// frame); the same chain with the last one pointing back at the first is
/// longer than the queue: a loop.
#[test]
fn tx_chain_longer_than_the_queue_split() {
    tx_case(false, 0, QSIZE, NetQ { packets: 1, bad: lp(1), ..NetQ::default() }, |t, _| {
        // A 12-byte header and 63 pieces of 2 bytes: a 126-byte frame.
        let fr = frame(77, 126);
        let g = t.buf();
        let mut data = vec![0u8; HDR];
        data.extend_from_slice(&fr);
        assert!(t.c.dev.memory().driver_memory().write(g, &data));
        t.tx.desc(0, g, HDR as u32, NEXT, 1);
        for i in 1..64u16 {
            let off = HDR as u64 + 2 * (i as u64 - 1);
            t.tx.desc(i, g + off, 2, if i < 63 { NEXT } else { 0 }, i + 1);
        }
        t.tx.post(&[0]);
        assert_eq!(t.used_empty(1), vec![0]);
        assert_eq!(t.received(1), vec![fr]);
        // Now the 64th links back to the first.
        t.tx.desc(63, g + HDR as u64 + 124, 2, NEXT, 0);
        t.tx.post(&[0]);
        assert_eq!(t.used_empty(1), vec![0]);
        false
    });
}

/// Every slot of a packed ring says NEXT: a chain longer than the ring,
/// which leaves no way to find the next chain: NEEDS_RESET.
#[test]
fn tx_chain_longer_than_the_ring_packed() {
    tx_case(true, 0, QSIZE, NetQ { bad: lp(1), ..NetQ::default() }, |t, _| {
        let g = t.buf();
        let av = PackedDriver::avail_bits(true);
        for i in (0..QSIZE).rev() {
            t.tx.pk().write_desc(i, PackedDesc { addr: g, len: 2, id: i, flags: av | NEXT });
        }
        t.tx.kick();
        assert!(wait_until(T, || t.c.needs_reset()), "NEEDS_RESET");
        t.tx.no_used();
        true
    });
}

/// `next` past the queue (64 of 64, and 0xffff): the chain is rejected, the
/// ring goes on.
#[test]
fn tx_next_index_past_the_queue_split() {
    tx_case(false, 0, QSIZE, NetQ { bad: index(2), ..NetQ::default() }, |t, _| {
        let g = t.buf();
        t.tx.desc(0, g, 50, NEXT, QSIZE);
        t.tx.desc(1, g, 50, NEXT, 0xffff);
        t.tx.post(&[0, 1]);
        assert_eq!(t.used_empty(2), vec![0, 1]);
        t.tx.next_desc = 2;
        false
    });
}

/// A head index past the queue in the avail ring: there is no descriptor to
/// give back, the ring is corrupt: NEEDS_RESET, counted once, nothing used.
#[test]
fn tx_head_index_past_the_queue_split() {
    tx_case(false, 0, QSIZE, NetQ { bad: index(1), ..NetQ::default() }, |t, _| {
        t.tx.post(&[QSIZE]);
        assert!(wait_until(T, || t.c.needs_reset()), "NEEDS_RESET");
        t.tx.no_used();
        assert_eq!(t.tx.split().used_idx(), 0);
        true
    });
}

/// avail.idx exactly a queue size ahead is a full ring (64 chains, all
/// sent); one more than that is impossible: NEEDS_RESET, no chain counted.
#[test]
fn tx_avail_index_running_ahead_split() {
    tx_case(false, 0, QSIZE, NetQ { packets: 64, ..NetQ::default() }, |t, _| {
        // 64 entries naming the same one-buffer chain.
        let (b, fr) = t.frame_buf();
        t.tx.desc(0, b.0, b.1, 0, 0);
        let heads = vec![0u16; QSIZE as usize];
        t.tx.post(&heads);
        assert_eq!(t.used_empty(64), vec![0u16; 64]);
        assert_eq!(t.received(64), vec![fr; 64]);
        let idx = t.tx.split().avail_idx();
        assert_eq!(idx, 64);
        t.tx.split().set_avail_idx(idx.wrapping_add(QSIZE + 1));
        t.tx.kick();
        assert!(wait_until(T, || t.c.needs_reset()), "NEEDS_RESET");
        t.tx.no_used();
        true
    });
}

/// avail.idx moved backwards after the device consumed a chain (it reads
/// as 65535 chains ahead): NEEDS_RESET, nothing counted.
#[test]
fn tx_avail_index_rewound_split() {
    tx_case(false, 0, QSIZE, NetQ { packets: 1, ..NetQ::default() }, |t, _| {
        let (b, fr) = t.frame_buf();
        let id = t.tx.chain(&[b]);
        assert_eq!(t.used_empty(1), vec![id]);
        assert_eq!(t.received(1), vec![fr]);
        t.tx.split().set_avail_idx(0);
        t.tx.kick();
        assert!(wait_until(T, || t.c.needs_reset()), "NEEDS_RESET");
        t.tx.no_used();
        true
    });
}

/// Buffers entirely outside guest memory: far above it, where address +
/// length wraps around 2^64, and one byte just past the end.
fn tx_outside_memory(packed: bool) {
    tx_case(packed, 0, QSIZE, NetQ { bad: address(3), ..NetQ::default() }, |t, _| {
        let end = t.c.mem_end();
        let ids =
            [t.tx.chain(&[B(1 << 40, 112, 0)]), t.tx.chain(&[B(u64::MAX - 15, 112, 0)]), t.tx.chain(&[B(end, 1, 0)])];
        assert_eq!(t.used_empty(3), ids.to_vec());
        false
    });
}

#[test]
fn tx_buffers_outside_memory_split() {
    tx_outside_memory(false);
}

#[test]
fn tx_buffers_outside_memory_packed() {
    tx_outside_memory(true);
}

/// Guest memory at 1 GiB: buffers straddling its end, straddling its start,
/// and just below it are rejected; the very last 112 bytes are a good buffer.
fn tx_straddling_memory_edges(packed: bool) {
    let base = 1u64 << 30;
    tx_case_at(packed, 0, QSIZE, base, NetQ { packets: 1, bad: address(3), ..NetQ::default() }, |t, _| {
        let end = t.c.mem_end();
        assert_eq!(end, base + (64 << 20));
        let ids = [
            t.tx.chain(&[B(end - 50, 112, 0)]),
            t.tx.chain(&[B(base - 16, 112, 0)]),
            t.tx.chain(&[B(base - 112, 112, 0)]),
        ];
        assert_eq!(t.used_empty(3), ids.to_vec());
        let fr = frame(9, 100);
        let mut data = vec![0u8; HDR];
        data.extend_from_slice(&fr);
        assert!(t.c.dev.memory().driver_memory().write(end - 112, &data));
        let id = t.tx.chain(&[B(end - 112, 112, 0)]);
        assert_eq!(t.used_empty(1), vec![id]);
        assert_eq!(t.received(1), vec![fr]);
        false
    });
}

#[test]
fn tx_buffers_straddling_memory_edges_split() {
    tx_straddling_memory_edges(false);
}

#[test]
fn tx_buffers_straddling_memory_edges_packed() {
    tx_straddling_memory_edges(true);
}

/// A zero-length buffer is no buffer: a chain of only that (at a real or a
/// bogus address) is shorter than the header (dropped, counted
/// short_header, not a bad chain); one after a good buffer changes nothing.
fn tx_zero_length(packed: bool) {
    tx_case(packed, 0, QSIZE, NetQ { packets: 1, short_header: 2, ..NetQ::default() }, |t, _| {
        let g = t.buf();
        let ids = [t.tx.chain(&[B(g, 0, 0)]), t.tx.chain(&[B(1 << 40, 0, 0)])];
        assert_eq!(t.used_empty(2), ids.to_vec());
        let (b, fr) = t.frame_buf();
        let id = t.tx.chain(&[b, B(1 << 40, 0, 0)]);
        assert_eq!(t.used_empty(1), vec![id]);
        assert_eq!(t.received(1), vec![fr]);
        false
    });
}

#[test]
fn tx_zero_length_buffers_split() {
    tx_zero_length(false);
}

#[test]
fn tx_zero_length_buffers_packed() {
    tx_zero_length(true);
}

/// 4 GiB: one buffer of 4 GiB - 1 (outside the 64 MiB of memory), and 64
/// buffers each covering all of memory (4 GiB together, over the 32-bit
/// total a chain may have): both rejected as bad addresses. 63 of them
/// (4032 MiB) is a valid chain whose frame is too big for the backend:
/// dropped and counted too_big.
fn tx_4gib(packed: bool) {
    tx_case(packed, 0, 128, NetQ { too_big: 1, bad: address(2), ..NetQ::default() }, |t, _| {
        let (base, size) = (t.c.dev.memory().gpa_base(), t.c.dev.memory().size() as u32);
        assert_eq!(size, 64 << 20);
        let a = t.tx.chain(&[B(base, u32::MAX, 0)]);
        assert_eq!(t.used_empty(1), vec![a]);
        let b = t.tx.chain(&vec![B(base, size, 0); 64]);
        assert_eq!(t.used_empty(1), vec![b]);
        let c = t.tx.chain(&vec![B(base, size, 0); 63]);
        assert_eq!(t.used_empty(1), vec![c]);
        false
    });
}

#[test]
fn tx_4gib_lengths_split() {
    tx_4gib(false);
}

#[test]
fn tx_4gib_lengths_packed() {
    tx_4gib(true);
}

/// Net TX takes only device-readable buffers: a writable one alone, or
/// after a readable header, is a bad chain (direction).
fn tx_writable(packed: bool) {
    tx_case(packed, 0, QSIZE, NetQ { bad: direction(2), ..NetQ::default() }, |t, _| {
        let (b, _) = t.frame_buf();
        let ids =
            [t.tx.chain(&[B(b.0, b.1, WRITE)]), t.tx.chain(&[B(b.0, HDR as u32, 0), B(b.0 + HDR as u64, 100, WRITE)])];
        assert_eq!(t.used_empty(2), ids.to_vec());
        false
    });
}

#[test]
fn tx_writable_buffer_split() {
    tx_writable(false);
}

#[test]
fn tx_writable_buffer_packed() {
    tx_writable(true);
}

/// A header one byte short (11 of 12) is dropped and counted short_header;
/// exactly a header and nothing else is an empty frame, passed on as one
/// (what QEMU does too).
fn tx_short_header(packed: bool) {
    tx_case(packed, 0, QSIZE, NetQ { packets: 1, short_header: 1, ..NetQ::default() }, |t, _| {
        let g = t.buf();
        let id = t.tx.chain(&[B(g, HDR as u32 - 1, 0)]);
        assert_eq!(t.used_empty(1), vec![id]);
        let id = t.tx.chain(&[B(g, HDR as u32, 0)]);
        assert_eq!(t.used_empty(1), vec![id]);
        assert_eq!(t.received(1), vec![Vec::<u8>::new()]);
        false
    });
}

#[test]
fn tx_header_shorter_than_required_split() {
    tx_short_header(false);
}

#[test]
fn tx_header_shorter_than_required_packed() {
    tx_short_header(true);
}

// ---- indirect tables ------------------------------------------------------

/// One indirect table entry: address, length, flags, next.
#[derive(Clone, Copy, Debug)]
struct E(u64, u32, u16, u16);

impl E {
    /// The entry as the ring layout lays it out: split (addr, len, flags,
    /// next); packed (addr, len, id, flags), `next` going in as the id.
    fn bytes(&self, packed: bool) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.0.to_le_bytes());
        b[8..12].copy_from_slice(&self.1.to_le_bytes());
        let (x, y) = if packed { (self.3, self.2) } else { (self.2, self.3) };
        b[12..14].copy_from_slice(&x.to_le_bytes());
        b[14..16].copy_from_slice(&y.to_le_bytes());
        b
    }
}

/// A table's bytes.
fn table_bytes(entries: &[E], packed: bool) -> Vec<u8> {
    entries.iter().flat_map(|e| e.bytes(packed)).collect()
}

impl Conn {
    /// Writes an indirect table (in the negotiated ring layout) into fresh
    /// guest memory (64-aligned); returns its address.
    fn table(&mut self, entries: &[E]) -> u64 {
        let bytes = table_bytes(entries, self.dev.packed());
        self.put(&bytes, bytes.len())
    }
}

impl NetTx {
    /// A table holding a good frame (header and frame in two entries).
    fn good_table(&mut self) -> (u64, u32, Vec<u8>) {
        let (b, fr) = self.frame_buf();
        let t = self.c.table(&[E(b.0, HDR as u32, NEXT, 1), E(b.0 + HDR as u64, 100, 0, 0)]);
        (t, 32, fr)
    }
}

/// INDIRECT without VIRTIO_F_INDIRECT_DESC negotiated: a bad chain
/// (indirect), though the table itself is fine.
fn tx_indirect_without_feature(packed: bool) {
    tx_case(packed, 0, QSIZE, NetQ { bad: indirect(1), ..NetQ::default() }, |t, _| {
        assert_eq!(t.c.dev.features() & f::INDIRECT_DESC, 0);
        let (tb, len, _) = t.good_table();
        let id = t.tx.chain(&[B(tb, len, INDIRECT)]);
        assert_eq!(t.used_empty(1), vec![id]);
        false
    });
}

#[test]
fn tx_indirect_without_the_feature_split() {
    tx_indirect_without_feature(false);
}

#[test]
fn tx_indirect_without_the_feature_packed() {
    tx_indirect_without_feature(true);
}

/// With INDIRECT_DESC: a good table whose descriptor also says WRITE is
/// sent (the spec: the device ignores WRITE on a table descriptor); a
/// table holding an INDIRECT entry, and a table descriptor with NEXT, are
/// bad chains (indirect). A table after direct descriptors: valid on a
/// split ring (virtio 1.2 2.7.5.3.2: the device MUST handle it), refused
/// on a packed ring, where vhostd takes a table only as a whole chain.
fn tx_indirect_rules(packed: bool) {
    let (sent, bad) = if packed { (1, 3) } else { (2, 2) };
    tx_case(packed, f::INDIRECT_DESC, QSIZE, NetQ { packets: sent, bad: indirect(bad), ..NetQ::default() }, |t, _| {
        let (tb, len, fr) = t.good_table();
        let id = t.tx.chain(&[B(tb, len, INDIRECT | WRITE)]);
        assert_eq!(t.used_empty(1), vec![id]);
        assert_eq!(t.received(1), vec![fr]);
        // An indirect entry inside the table (pointing at a good table).
        let (inner, ilen, _) = t.good_table();
        let (b, _) = t.frame_buf();
        let nested = t.c.table(&[E(b.0, HDR as u32, NEXT, 1), E(inner, ilen, INDIRECT, 0)]);
        let id = t.tx.chain(&[B(nested, 32, INDIRECT)]);
        assert_eq!(t.used_empty(1), vec![id]);
        // A table descriptor with NEXT (split: to a good header descriptor;
        // packed: the chain's next slot).
        let (tb, len, _) = t.good_table();
        let g = t.buf();
        let id = t.tx.chain(&[B(tb, len, INDIRECT), B(g, HDR as u32, 0)]);
        assert_eq!(t.used_empty(1), vec![id]);
        // A header descriptor, then a table holding the frame.
        let (b, fr) = t.frame_buf();
        let tail = t.c.table(&[E(b.0 + HDR as u64, 100, 0, 0)]);
        let id = t.tx.chain(&[B(b.0, HDR as u32, 0), B(tail, 16, INDIRECT)]);
        assert_eq!(t.used_empty(1), vec![id]);
        if !packed {
            assert_eq!(t.received(1), vec![fr]);
        }
        false
    });
}

#[test]
fn tx_indirect_rules_split() {
    tx_indirect_rules(false);
}

#[test]
fn tx_indirect_rules_packed() {
    tx_indirect_rules(true);
}

/// Table lengths: zero, not a multiple of 16, and one descriptor more than
/// the largest queue (32769) are bad chains (indirect); exactly 32768
/// descriptors (32767 empty ones and the frame) is a good chain.
fn tx_indirect_lengths(packed: bool) {
    tx_case(packed, f::INDIRECT_DESC, QSIZE, NetQ { packets: 1, bad: indirect(3), ..NetQ::default() }, |t, _| {
        let (b, fr) = t.frame_buf();
        let mut entries: Vec<E> = (0..MAX_TABLE - 1).map(|i| E(0, 0, NEXT, (i + 1) as u16)).collect();
        entries.push(E(b.0, b.1, 0, 0));
        let full = t.c.table(&entries);
        entries.insert(0, E(0, 0, NEXT, 1));
        let over = t.c.table(&entries);
        let ids = [
            t.tx.chain(&[B(full, 0, INDIRECT)]),
            t.tx.chain(&[B(full, 24, INDIRECT)]),
            t.tx.chain(&[B(over, (MAX_TABLE + 1) * 16, INDIRECT)]),
        ];
        assert_eq!(t.used_empty(3), ids.to_vec());
        let id = t.tx.chain(&[B(full, MAX_TABLE * 16, INDIRECT)]);
        assert_eq!(t.used_empty(1), vec![id]);
        assert_eq!(t.received(1), vec![fr]);
        false
    });
}

#[test]
fn tx_indirect_table_lengths_split() {
    tx_indirect_lengths(false);
}

#[test]
fn tx_indirect_table_lengths_packed() {
    tx_indirect_lengths(true);
}

/// Where the table lies: outside memory and straddling its end are bad
/// addresses; 8 bytes off the 16-byte alignment is refused (indirect;
/// stricter than the spec, as rust-vmm's virtio-queue).
fn tx_indirect_placement(packed: bool) {
    let want = NetQ { bad: Bad { address: 2, indirect: 1, ..NONE }, ..NetQ::default() };
    tx_case(packed, f::INDIRECT_DESC, QSIZE, want, |t, _| {
        let end = t.c.mem_end();
        let (b, _) = t.frame_buf();
        let mut bytes = vec![0u8; 8];
        bytes.extend(table_bytes(&[E(b.0, HDR as u32, NEXT, 1), E(b.0 + HDR as u64, 100, 0, 0)], packed));
        let misaligned = t.c.put(&bytes, 48) + 8;
        let ids = [
            t.tx.chain(&[B(1 << 40, 32, INDIRECT)]),
            t.tx.chain(&[B(end - 16, 32, INDIRECT)]),
            t.tx.chain(&[B(misaligned, 32, INDIRECT)]),
        ];
        assert_eq!(t.used_empty(3), ids.to_vec());
        false
    });
}

#[test]
fn tx_indirect_table_placement_split() {
    tx_indirect_placement(false);
}

#[test]
fn tx_indirect_table_placement_packed() {
    tx_indirect_placement(true);
}

/// Inside a split ring's indirect table: entries naming each other (a
/// loop, caught after as many steps as the table has entries) and a `next`
/// past the table's end (index).
#[test]
fn tx_indirect_table_loop_and_next_past_its_end_split() {
    tx_case(
        false,
        f::INDIRECT_DESC,
        QSIZE,
        NetQ { bad: Bad { lp: 1, index: 1, ..NONE }, ..NetQ::default() },
        |t, _| {
            let (b, _) = t.frame_buf();
            let looped = t.c.table(&[E(b.0, 8, NEXT, 1), E(b.0 + 8, 8, NEXT, 2), E(b.0 + 16, 8, NEXT, 1)]);
            let past = t.c.table(&[E(b.0, HDR as u32, NEXT, 1), E(b.0 + HDR as u64, 100, NEXT, 2)]);
            let ids = [t.tx.chain(&[B(looped, 48, INDIRECT)]), t.tx.chain(&[B(past, 32, INDIRECT)])];
            assert_eq!(t.used_empty(2), ids.to_vec());
            false
        },
    );
}

// ---- packed wrap counters, rewritten descriptors, a worker on a broken ring

impl Vd {
    /// Kicks the worker has taken from ring `queue` so far.
    fn kicks(&self, queue: u64) -> u64 {
        self.q(queue)["kicks"].as_u64().unwrap()
    }

    /// Waits until the worker of net ring `queue` has woken for a kick
    /// beyond `before` and has since finished a pass over its rings (it
    /// answers counter requests at the top of its loop, and counts a pass
    /// at the end of one).
    fn settle(&self, queue: u64, before: u64) {
        let w = queue / 2;
        let passes = |v: &Value| {
            let w = &v["devices"][0]["workers"][w as usize];
            w["busy_iters"].as_u64().unwrap() + w["idle_iters"].as_u64().unwrap()
        };
        let mut seen = 0;
        let kicked = wait_until(T, || {
            let v = self.json();
            seen = passes(&v);
            let q = v["devices"][0]["queues"].as_array().unwrap().iter().find(|q| q["queue"] == queue).cloned();
            q.is_some_and(|q| q["kicks"].as_u64().unwrap() > before)
        });
        assert!(kicked, "the worker never took the kick");
        assert!(wait_until(T, || passes(&self.json()) > seen), "the worker never finished its pass");
    }
}

impl NetTx {
    /// Sends `n` good one-buffer chains (in bursts the RX ring holds) and
    /// checks every frame comes back.
    fn send_good(&mut self, n: usize) {
        let mut left = n;
        while left > 0 {
            let k = left.min(30);
            let mut ids = Vec::new();
            let mut frames = Vec::new();
            for _ in 0..k {
                let (b, fr) = self.frame_buf();
                ids.push(self.tx.chain(&[b]));
                frames.push(fr);
            }
            assert_eq!(self.used_empty(k), ids);
            assert_eq!(self.received(k), frames);
            left -= k;
        }
    }
}

/// A head whose AVAIL/USED bits do not say "available in this lap" (both
/// set, both clear) is not available: not taken, not counted, no reset;
/// once the driver writes it properly it is sent.
#[test]
fn tx_head_with_a_wrong_wrap_counter_packed() {
    tx_case(true, 0, QSIZE, NetQ { packets: 1, ..NetQ::default() }, |t, vd| {
        let (b, fr) = t.frame_buf();
        for flags in [AVAIL | USED, 0] {
            let before = vd.kicks(1);
            let d = PackedDesc { addr: b.0, len: b.1, id: 0x55, flags };
            t.tx.pk().write_desc(0, d);
            t.tx.kick();
            vd.settle(1, before);
            assert_eq!(t.tx.pk().read_desc(0), d, "the device wrote over a slot it does not own");
            assert_eq!(NetQ::of(&vd.q(1)), NetQ::default());
            assert!(!t.c.needs_reset());
        }
        let id = t.tx.chain(&[b]);
        assert_eq!(t.used_empty(1), vec![id]);
        assert_eq!(t.received(1), vec![fr]);
        false
    });
}

/// A chain crossing the ring's end: fine when the wrapped slot carries the
/// new lap's bits; when it still carries the old lap's, the rest of the
/// chain is not available, the ring is corrupt: NEEDS_RESET (index).
#[test]
fn tx_chain_across_the_ring_end_with_a_stale_wrap_counter_packed() {
    tx_case(true, 0, QSIZE, NetQ { packets: 62 + 1 + 61, bad: index(1), ..NetQ::default() }, |t, _| {
        t.send_good(62);
        let (b, fr) = t.frame_buf();
        let three = [B(b.0, HDR as u32, 0), B(b.0 + HDR as u64, 50, 0), B(b.0 + 62, 50, 0)];
        assert_eq!((t.tx.avail, t.tx.avail_wrap), (62, true));
        let id = t.tx.chain(&three);
        assert_eq!(t.used_empty(1), vec![id]);
        assert_eq!(t.received(1), vec![fr]);
        t.send_good(61);
        // Slots 62 and 63 in this lap (wrap 0), slot 0 with lap 0's bits again.
        assert_eq!((t.tx.avail, t.tx.avail_wrap), (62, false));
        let stale = PackedDriver::avail_bits(false);
        t.tx.pk().write_desc(0, PackedDesc { addr: b.0 + 62, len: 50, id: 99, flags: stale });
        t.tx.pk().write_desc(63, PackedDesc { addr: b.0 + HDR as u64, len: 50, id: 99, flags: stale | NEXT });
        t.tx.pk().write_desc(62, PackedDesc { addr: b.0, len: HDR as u32, id: 99, flags: stale | NEXT });
        t.tx.kick();
        assert!(wait_until(T, || t.c.needs_reset()), "NEEDS_RESET");
        t.tx.no_used();
        true
    });
}

/// The device reads a descriptor each time its chain is made available,
/// never from an earlier pass: a head sent, rewritten into a loop (a kick
/// without making it available again changes nothing), made available
/// (a loop, counted), rewritten into a new frame and made available (sent).
#[test]
fn tx_descriptor_rewritten_between_uses_split() {
    tx_case(false, 0, QSIZE, NetQ { packets: 2, bad: lp(1), ..NetQ::default() }, |t, vd| {
        let (b, fr) = t.frame_buf();
        t.tx.desc(0, b.0, b.1, 0, 0);
        t.tx.post(&[0]);
        assert_eq!(t.used_empty(1), vec![0]);
        assert_eq!(t.received(1), vec![fr]);
        t.tx.desc(0, b.0, b.1, NEXT, 0);
        let before = vd.kicks(1);
        t.tx.kick();
        vd.settle(1, before);
        t.tx.no_used();
        assert_eq!(NetQ::of(&vd.q(1)), NetQ { packets: 1, ..NetQ::default() });
        t.tx.post(&[0]);
        assert_eq!(t.used_empty(1), vec![0]);
        let (b, fr) = t.frame_buf();
        t.tx.desc(0, b.0, b.1, 0, 0);
        t.tx.post(&[0]);
        assert_eq!(t.used_empty(1), vec![0]);
        assert_eq!(t.received(1), vec![fr]);
        t.tx.next_desc = 1;
        false
    });
}

/// CPU time (user + system, clock ticks) of thread `name` of process `pid`.
fn thread_ticks(pid: i32, name: &str) -> u64 {
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() == name {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap();
            let rest = &stat[stat.rfind(')').unwrap() + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            return f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
        }
    }
    panic!("no thread {name} in process {pid}");
}

/// A head past the queue with another chain behind it: the ring is broken
/// (NEEDS_RESET) and must stay quiet; the worker of pair 0 (the default,
/// adaptive mode) goes back to sleep rather than polling the dead ring.
///
/// (It used not to: `SplitQueue::pending` ignored `broken`, so the worker
/// took the dead ring's chains for TX back-pressure and woke every
/// millisecond.)
#[test]
fn a_worker_sleeps_after_its_split_ring_broke_with_chains_behind_the_bad_head() {
    tx_case(false, 0, QSIZE, NetQ { bad: index(1), ..NetQ::default() }, |t, vd| {
        let (b, _) = t.frame_buf();
        t.tx.desc(0, b.0, b.1, 0, 0);
        t.tx.post(&[QSIZE, 0]);
        assert!(wait_until(T, || t.c.needs_reset()), "NEEDS_RESET");
        let idle = |vd: &Vd| vd.json()["devices"][0]["workers"][0]["idle_iters"].as_u64().unwrap();
        let (i0, c0) = (idle(vd), thread_ticks(vd.d.pid(), "vhostd-q0"));
        // A measurement window, not a synchronisation.
        std::thread::sleep(Duration::from_millis(500));
        let (i1, c1) = (idle(vd), thread_ticks(vd.d.pid(), "vhostd-q0"));
        let (passes, ticks) = (i1 - i0, c1 - c0);
        // Each stats query wakes the worker, which finds no work and goes
        // back to sleep: a pass or two (it used to spin the 100 us idle
        // window first: hundreds). Waking every millisecond, as it did,
        // makes tens of thousands.
        assert!(
            passes < 5000 && ticks <= 5,
            "worker 0 made {passes} idle passes and used {ticks} of 50 CPU ticks in 0.5 s on a broken ring"
        );
        t.tx.no_used();
        true
    });
}

// ---- the receive side -----------------------------------------------------

/// Pair 0 with a raw RX ring (queue 0) and a normal TX queue; pair 1 normal.
struct NetRx {
    c: Conn,
    rx: Ring,
    tx: TxQueue,
    other: (RxQueue, TxQueue),
    area: u64,
    slot: u64,
    seq: u32,
}

fn net_rx(vd: &Vd, extra: u64, mrg: bool, qsize: u16) -> NetRx {
    let mut c = connect_with(vd, extra, |o| {
        if !mrg {
            o.features &= !f::NET_MRG_RXBUF;
        }
    });
    assert_eq!(c.dev.features() & f::NET_MRG_RXBUF != 0, mrg);
    assert_eq!(c.dev.net_hdr_len(), HDR);
    let rx = c.raw_ring(0, qsize);
    let txq = c.dev.create_queue(1, QSIZE, None).unwrap();
    let bufs = c.dev.memory().alloc(QSIZE as u64 * 2048, 64).unwrap();
    let tx = TxQueue::new(txq, bufs, 2048, HDR).unwrap();
    c.dev.start_queue(&tx.queue).unwrap();
    let area = c.dev.memory().alloc(64 * 2048, 64).unwrap();
    let other = pair(&mut c, 1);
    NetRx { c, rx, tx, other, area, slot: 0, seq: 0 }
}

impl NetRx {
    fn buf(&mut self) -> u64 {
        let g = self.area + (self.slot % 64) * 2048;
        self.slot += 1;
        g
    }

    /// Sends a new frame of `len` bytes on pair 0 and waits until the device
    /// took it (the RX pass of the same worker pass has run once the next
    /// counter request is answered).
    fn send(&mut self, vd: &Vd, len: usize) -> Vec<u8> {
        self.seq += 1;
        let fr = frame(self.seq, len);
        let before = self.tx.stats.packets;
        assert!(self.tx.send_frame(&fr).unwrap());
        self.tx.flush().unwrap();
        assert!(wait_until(T, || {
            self.tx.reclaim().unwrap();
            self.tx.stats.packets > before
        }));
        vd.json();
        fr
    }

    /// Sends frames of `lens` bytes on pair 0 in one TX batch (one kick),
    /// so that the device delivers them to RX in one burst, and waits until
    /// it took them all.
    fn send_burst(&mut self, vd: &Vd, lens: &[usize]) -> Vec<Vec<u8>> {
        let before = self.tx.stats.packets;
        let frames: Vec<Vec<u8>> = lens
            .iter()
            .map(|&len| {
                self.seq += 1;
                frame(self.seq, len)
            })
            .collect();
        for fr in &frames {
            assert!(self.tx.send_frame(fr).unwrap());
        }
        self.tx.flush().unwrap();
        let n = frames.len() as u64;
        assert!(wait_until(T, || {
            self.tx.reclaim().unwrap();
            self.tx.stats.packets >= before + n
        }));
        vd.json();
        frames
    }

    /// A buffer the device wrote: its header and the bytes after it.
    fn header_and_data(&mut self, gpa: u64, used: u32) -> (Vec<u8>, Vec<u8>) {
        let b = self.c.read(gpa, used as usize);
        (b[..HDR].to_vec(), b[HDR..].to_vec())
    }

    fn finish(self, vd: &Vd, broken: bool, extra: u64) {
        let NetRx { c, rx, tx, other, .. } = self;
        drop((rx, tx));
        finish_net(vd, c, vec![other], broken, extra);
    }
}

/// num_buffers of a header.
fn num_buffers(h: &[u8]) -> u16 {
    u16::from_le_bytes([h[10], h[11]])
}

/// Runs an RX case; pair 0's RX queue must end with `want`.
fn rx_case(packed: bool, mrg: bool, qsize: u16, want: NetQ, body: impl FnOnce(&mut NetRx, &Vd)) {
    let vd = net_daemon();
    let extra = layout(packed);
    let mut t = net_rx(&vd, extra, mrg, qsize);
    body(&mut t, &vd);
    expect_net(&vd, 0, want);
    t.finish(&vd, false, extra);
    let s = vd.stop();
    check_exit(&s, &[(0, want.bad.total()), (1, 0), (2, 0), (3, 0)]);
}

/// Net RX takes only device-writable buffers: a readable one, and a
/// readable one after a writable one, are bad chains (direction); the
/// frame waits and lands in the next good buffer.
fn rx_readable(packed: bool) {
    rx_case(packed, true, QSIZE, NetQ { packets: 1, bad: direction(2), ..NetQ::default() }, |t, vd| {
        let (g0, g1) = (t.buf(), t.buf());
        let a = t.rx.chain(&[B(g0, 2048, 0)]);
        let b = t.rx.chain(&[B(g1, 1024, WRITE), B(g1 + 1024, 1024, 0)]);
        let fr = t.send(vd, 100);
        assert_eq!(t.rx.wait_used(2), vec![(a, 0), (b, 0)]);
        let g = t.buf();
        let c = t.rx.chain(&[B(g, 2048, WRITE)]);
        assert_eq!(t.rx.wait_used(1), vec![(c, (HDR + 100) as u32)]);
        let (h, data) = t.header_and_data(g, (HDR + 100) as u32);
        assert_eq!((num_buffers(&h), data), (1, fr));
    });
}

#[test]
fn rx_readable_buffer_split() {
    rx_readable(false);
}

#[test]
fn rx_readable_buffer_packed() {
    rx_readable(true);
}

/// Without MRG_RXBUF a frame takes one buffer: 8 bytes (less than the
/// header) and header + frame - 1 are too small: the frame is dropped and
/// counted too_big, the buffer returned empty; a buffer of exactly header
/// + frame takes the next one.
fn rx_small_buffers(packed: bool) {
    rx_case(packed, false, QSIZE, NetQ { packets: 1, too_big: 2, ..NetQ::default() }, |t, vd| {
        let need = (HDR + 100) as u32;
        for len in [8, need - 1] {
            let g = t.buf();
            let id = t.rx.chain(&[B(g, len, WRITE)]);
            t.send(vd, 100);
            assert_eq!(t.rx.wait_used(1), vec![(id, 0)]);
            assert!(t.c.read(g, len as usize).iter().all(|&x| x == 0), "a dropped frame was written");
        }
        let g = t.buf();
        let id = t.rx.chain(&[B(g, need, WRITE)]);
        let fr = t.send(vd, 100);
        assert_eq!(t.rx.wait_used(1), vec![(id, need)]);
        assert_eq!(t.header_and_data(g, need).1, fr);
    });
}

#[test]
fn rx_buffers_smaller_than_the_frame_split() {
    rx_small_buffers(false);
}

#[test]
fn rx_buffers_smaller_than_the_frame_packed() {
    rx_small_buffers(true);
}

/// With MRG_RXBUF, buffers smaller than the virtio-net header (the spec:
/// each buffer MUST be at least a header): the device cannot write the
/// header (and num_buffers) anywhere, so the frame must be dropped and
/// counted too_big, nothing written into those buffers.
fn rx_mergeable_tiny(packed: bool) {
    rx_case(packed, true, QSIZE, NetQ { too_big: 1, ..NetQ::default() }, |t, vd| {
        let g = t.buf();
        let ids: Vec<u16> = (0..40).map(|k| t.rx.chain(&[B(g + 4 * k, 4, WRITE)])).collect();
        t.send(vd, 100);
        let mut used = Vec::new();
        while let Some(u) = t.rx.take_used() {
            used.push(u);
        }
        let all_empty = used.iter().all(|&(id, len)| ids.contains(&id) && len == 0);
        assert!(all_empty, "buffers smaller than a header were used: {used:?}");
        assert!(t.c.read(g, 160).iter().all(|&x| x == 0), "frame bytes written into buffers smaller than a header");
    });
}

#[test]
fn rx_mergeable_buffers_smaller_than_the_header_split() {
    rx_mergeable_tiny(false);
}

#[test]
fn rx_mergeable_buffers_smaller_than_the_header_packed() {
    rx_mergeable_tiny(true);
}

/// With MRG_RXBUF, a frame larger than the whole ring's buffers (8 x 64
/// bytes for 12 + 1000): dropped and counted too_big; the buffers stay
/// available, untouched, and take the next (small) frame.
fn rx_mergeable_too_big_for_the_ring(packed: bool) {
    rx_case(packed, true, 8, NetQ { packets: 1, too_big: 1, ..NetQ::default() }, |t, vd| {
        let g = t.buf();
        let ids: Vec<u16> = (0..8).map(|k| t.rx.chain(&[B(g + 64 * k, 64, WRITE)])).collect();
        t.send(vd, 1000);
        t.rx.no_used();
        assert!(t.c.read(g, 512).iter().all(|&x| x == 0), "a dropped frame was written");
        let fr = t.send(vd, 50);
        assert_eq!(t.rx.wait_used(1), vec![(ids[0], (HDR + 50) as u32)]);
        let (h, data) = t.header_and_data(g, (HDR + 50) as u32);
        assert_eq!((num_buffers(&h), data), (1, fr));
    });
}

#[test]
fn rx_mergeable_frame_larger_than_the_ring_split() {
    rx_mergeable_too_big_for_the_ring(false);
}

#[test]
fn rx_mergeable_frame_larger_than_the_ring_packed() {
    rx_mergeable_too_big_for_the_ring(true);
}

/// With MRG_RXBUF, fewer buffers posted than a frame needs (2 x 256 bytes
/// for 12 + 1200): the frame waits, nothing is used; three more buffers
/// and it lands in all five, num_buffers = 5, used lengths 4 x 256 + 188.
fn rx_mergeable_too_few(packed: bool) {
    rx_case(packed, true, QSIZE, NetQ { packets: 1, ..NetQ::default() }, |t, vd| {
        let g = t.buf();
        let mut ids: Vec<u16> = (0..2).map(|k| t.rx.chain(&[B(g + 256 * k, 256, WRITE)])).collect();
        let fr = t.send(vd, 1200);
        t.rx.no_used();
        ids.extend((2..5).map(|k| t.rx.chain(&[B(g + 256 * k, 256, WRITE)])));
        let lens = [256, 256, 256, 256, 188];
        let want: Vec<(u16, u32)> = ids.iter().copied().zip(lens).collect();
        assert_eq!(t.rx.wait_used(5), want);
        let all = t.c.read(g, 1212);
        assert_eq!(num_buffers(&all[..HDR]), 5);
        assert_eq!(&all[HDR..], &fr[..]);
    });
}

#[test]
fn rx_mergeable_fewer_buffers_than_the_frame_needs_split() {
    rx_mergeable_too_few(false);
}

#[test]
fn rx_mergeable_fewer_buffers_than_the_frame_needs_packed() {
    rx_mergeable_too_few(true);
}

/// With MRG_RXBUF, a bad chain right after a buffer too small for the
/// frame: the frame cannot be placed in order, it is dropped (counted as a
/// drop, not too_big) and the small buffer returned empty; the bad chain
/// is completed and counted with the next frame, which lands in the good
/// buffer behind it.
fn rx_mergeable_bad_chain_between(packed: bool) {
    let want = NetQ { packets: 1, other_drops: 1, bad: direction(1), ..NetQ::default() };
    rx_case(packed, true, QSIZE, want, |t, vd| {
        let g = t.buf();
        let a = t.rx.chain(&[B(g, 64, WRITE)]);
        let b = t.rx.chain(&[B(g + 64, 64, 0)]);
        let g2 = t.buf();
        let c = t.rx.chain(&[B(g2, 2048, WRITE)]);
        t.send(vd, 100);
        assert_eq!(t.rx.wait_used(1), vec![(a, 0)]);
        let fr = t.send(vd, 100);
        assert_eq!(t.rx.wait_used(2), vec![(b, 0), (c, (HDR + 100) as u32)]);
        let (h, data) = t.header_and_data(g2, (HDR + 100) as u32);
        assert_eq!((num_buffers(&h), data), (1, fr));
    });
}

#[test]
fn rx_mergeable_bad_chain_behind_a_small_buffer_split() {
    rx_mergeable_bad_chain_between(false);
}

#[test]
fn rx_mergeable_bad_chain_behind_a_small_buffer_packed() {
    rx_mergeable_bad_chain_between(true);
}

/// With MRG_RXBUF, a bad chain right after buffers that earlier frames of
/// the same burst used up: the pop ends before the bad chain with nothing
/// left over for the next frame, which is no reason to drop it. The next
/// pop completes the bad chain (counted), and the frame lands in the good
/// buffer behind it.
fn rx_mergeable_bad_chain_after_used_buffers(packed: bool) {
    let want = NetQ { packets: 2, bad: direction(1), ..NetQ::default() };
    rx_case(packed, true, QSIZE, want, |t, vd| {
        let (g, g2) = (t.buf(), t.buf());
        let a = t.rx.chain(&[B(g, 2048, WRITE)]);
        let b = t.rx.chain(&[B(g + 1024, 64, 0)]);
        let c = t.rx.chain(&[B(g2, 2048, WRITE)]);
        // No frame waits yet, so nothing is popped before all three are posted.
        t.rx.no_used();
        let frs = t.send_burst(vd, &[100, 200]);
        let (la, lc) = ((HDR + 100) as u32, (HDR + 200) as u32);
        assert_eq!(t.rx.wait_used(3), vec![(a, la), (b, 0), (c, lc)]);
        let (h, data) = t.header_and_data(g, la);
        assert_eq!((num_buffers(&h), data), (1, frs[0].clone()));
        let (h, data) = t.header_and_data(g2, lc);
        assert_eq!((num_buffers(&h), data), (1, frs[1].clone()));
    });
}

#[test]
fn rx_mergeable_bad_chain_after_used_buffers_split() {
    rx_mergeable_bad_chain_after_used_buffers(false);
}

#[test]
fn rx_mergeable_bad_chain_after_used_buffers_packed() {
    rx_mergeable_bad_chain_after_used_buffers(true);
}

/// With MRG_RXBUF, a burst mixing frames that fit one buffer with one that
/// spans five (256-byte buffers; 100, 1200, 100 and 100 bytes): the long
/// frame makes the device pop every posted buffer at once, and the frames
/// after it go into the rest of that pop. Every frame lands in order, the
/// buffers used in ring order with the right lengths and num_buffers.
fn rx_mergeable_mixed_burst(packed: bool) {
    rx_case(packed, true, QSIZE, NetQ { packets: 4, ..NetQ::default() }, |t, vd| {
        let g = t.buf();
        let ids: Vec<u16> = (0..8).map(|k| t.rx.chain(&[B(g + 256 * k, 256, WRITE)])).collect();
        t.rx.no_used();
        let frs = t.send_burst(vd, &[100, 1200, 100, 100]);
        let (short, long_tail) = ((HDR + 100) as u32, (HDR + 1200 - 4 * 256) as u32);
        let lens = [short, 256, 256, 256, 256, long_tail, short, short];
        let want: Vec<(u16, u32)> = ids.iter().copied().zip(lens).collect();
        assert_eq!(t.rx.wait_used(8), want);
        let at = |k: u64| g + 256 * k;
        let (h, data) = t.header_and_data(at(0), short);
        assert_eq!((num_buffers(&h), data), (1, frs[0].clone()));
        let long = t.c.read(at(1), 5 * 256);
        assert_eq!(num_buffers(&long[..HDR]), 5);
        assert_eq!(&long[HDR..HDR + 1200], &frs[1][..]);
        for (k, fr) in [(6, &frs[2]), (7, &frs[3])] {
            let (h, data) = t.header_and_data(at(k), short);
            assert_eq!((num_buffers(&h), &data), (1, fr));
        }
        t.rx.no_used();
    });
}

#[test]
fn rx_mergeable_frames_after_one_over_several_buffers_split() {
    rx_mergeable_mixed_burst(false);
}

#[test]
fn rx_mergeable_frames_after_one_over_several_buffers_packed() {
    rx_mergeable_mixed_burst(true);
}

// ---- IN_ORDER batches with a bad chain inside -----------------------------

/// With IN_ORDER a TX batch is completed with one used entry (its last
/// chain's) that stands for the whole batch. Four chains published at
/// once, the third outside memory: the batch ends before the bad chain
/// (one entry for the first two, then a slot skipped), the bad chain gets
/// its own entry (length 0, counted), the fourth its own; the three good
/// frames arrive in order.
fn tx_in_order_batch_with_a_bad_chain(packed: bool) {
    tx_case(packed, f::IN_ORDER, QSIZE, NetQ { packets: 3, bad: address(1), ..NetQ::default() }, |t, _| {
        assert_ne!(t.c.dev.features() & f::IN_ORDER, 0);
        let (a, fa) = t.frame_buf();
        let (b, fb) = t.frame_buf();
        let (c, fc) = t.frame_buf();
        let x = B(1 << 40, 112, 0);
        if !packed {
            for (i, d) in [a, b, x, c].iter().enumerate() {
                t.tx.desc(i as u16, d.0, d.1, 0, 0);
            }
            t.tx.post(&[0, 1, 2, 3]);
            assert!(wait_until(T, || t.tx.split().used_idx() == 4));
            let r = t.tx.split();
            assert_eq!([r.read_used_ring(0), r.read_used_ring(2), r.read_used_ring(3)], [(1, 0), (2, 0), (3, 0)]);
            (t.tx.next_desc, t.tx.last_used) = (4, 4);
        } else {
            let av = PackedDriver::avail_bits(true);
            for (i, d) in [a, b, x, c].iter().enumerate().rev() {
                t.tx.pk().write_desc(i as u16, PackedDesc { addr: d.0, len: d.1, id: 10 + i as u16, flags: av });
            }
            t.tx.kick();
            let used = |t: &mut NetTx, slot: u16| {
                let d = t.tx.pk().read_desc(slot);
                (d.flags & (AVAIL | USED) == AVAIL | USED).then_some((d.id, d.len))
            };
            assert!(wait_until(T, || used(t, 3).is_some()));
            assert_eq!([used(t, 0), used(t, 2), used(t, 3)], [Some((11, 0)), Some((12, 0)), Some((13, 0))]);
            assert_eq!(used(t, 1), None, "the batch's second slot is skipped, not written");
            (t.tx.avail, t.tx.used, t.tx.next_id) = (4, 4, 14);
        }
        assert_eq!(t.received(3), vec![fa, fb, fc]);
        false
    });
}

#[test]
fn tx_in_order_batch_with_a_bad_chain_split() {
    tx_in_order_batch_with_a_bad_chain(false);
}

#[test]
fn tx_in_order_batch_with_a_bad_chain_packed() {
    tx_in_order_batch_with_a_bad_chain(true);
}

// ---- event suppression with nonsense values -------------------------------

impl Vd {
    /// Interrupts the device decided to send for ring `queue`.
    fn notifies(&self, queue: u64) -> u64 {
        self.q(queue)["notifies"].as_u64().unwrap()
    }
}

/// Split ring with EVENT_IDX: avail.flags full of garbage (meaningless with
/// EVENT_IDX) and used_event half the index space away: chains are still
/// processed, and the device sends no interrupt the driver did not ask
/// for; once used_event names the next entry again, one comes.
#[test]
fn tx_nonsense_event_index_split() {
    tx_case(false, 0, QSIZE, NetQ { packets: 7, ..NetQ::default() }, |t, vd| {
        assert_ne!(t.c.dev.features() & f::EVENT_IDX, 0);
        // The first completion after the ring starts always interrupts
        // (and the start itself sent one, not counted in `notifies`).
        t.send_good(1);
        assert!(wait_until(T, || vd.notifies(1) == 1));
        assert_eq!(t.tx.q.take_calls(), 2);
        t.tx.split().set_avail_flags(0xffff);
        for _ in 0..5 {
            let used = t.tx.split().used_idx();
            t.tx.split().set_used_event(used.wrapping_add(0x8000));
            t.send_good(1);
        }
        assert_eq!(vd.notifies(1), 1, "interrupts the driver did not ask for");
        assert_eq!(t.tx.q.take_calls(), 0);
        let used = t.tx.split().used_idx();
        t.tx.split().set_used_event(used);
        t.send_good(1);
        assert!(wait_until(T, || vd.notifies(1) == 2));
        assert!(t.tx.q.wait_call(T).unwrap(), "the interrupt asked for");
        t.tx.split().set_avail_flags(0);
        false
    });
}

/// Packed ring with EVENT_IDX: the driver event area in DESC mode naming
/// a slot past the ring, then in the reserved mode 3: the device cannot
/// tell what the driver wants and interrupts for every batch; in DISABLE
/// mode it sends none. Chains are processed throughout.
#[test]
fn tx_nonsense_event_area_packed() {
    tx_case(true, 0, QSIZE, NetQ { packets: 7, ..NetQ::default() }, |t, vd| {
        assert_ne!(t.c.dev.features() & f::EVENT_IDX, 0);
        let area = t.tx.q.ring.layout().avail;
        let set = |t: &mut NetTx, off_wrap: u16, flags: u16| {
            let mut b = off_wrap.to_le_bytes().to_vec();
            b.extend_from_slice(&flags.to_le_bytes());
            assert!(t.c.dev.memory().driver_memory().write(area, &b));
        };
        set(t, 0x8000 | 0x7fff, 2);
        t.send_good(1);
        assert!(wait_until(T, || vd.notifies(1) == 1));
        t.send_good(1);
        assert!(wait_until(T, || vd.notifies(1) == 2));
        set(t, 0, 3);
        t.send_good(1);
        assert!(wait_until(T, || vd.notifies(1) == 3));
        set(t, 0, 1);
        for _ in 0..4 {
            t.send_good(1);
        }
        assert_eq!(vd.notifies(1), 3, "interrupts while the driver disabled them");
        set(t, 0, 0);
        false
    });
}

// ---- ring set-up: addresses and sizes (SET_VRING_*) -----------------------

/// SET_VRING_ADDR's addresses (frontend virtual) for a ring laid out at `l`.
fn vring_addrs(c: &mut Conn, l: RingLayout) -> VringConfigData {
    let m = c.dev.memory();
    VringConfigData {
        queue_max_size: l.size,
        queue_size: l.size,
        flags: 0,
        desc_table_addr: m.gpa_to_uaddr(l.desc),
        used_ring_addr: m.gpa_to_uaddr(l.used),
        avail_ring_addr: m.gpa_to_uaddr(l.avail),
        log_addr: None,
    }
}

/// Ring addresses vhostd must refuse for `good` (a ring of QSIZE), by
/// name: overlapping, outside memory, straddling its end.
fn bad_ring_addrs(c: &mut Conn, good: VringConfigData, packed: bool) -> Vec<(&'static str, VringConfigData)> {
    let (base, size) = (c.dev.memory().uaddr_base(), c.dev.memory().size());
    let end = base + size;
    let g = good;
    let mut v = vec![
        ("descriptors outside memory", VringConfigData { desc_table_addr: end + 4096, ..g }),
        ("descriptors straddling the end", VringConfigData { desc_table_addr: end - 512, ..g }),
        ("used ring inside the descriptors", VringConfigData { used_ring_addr: g.desc_table_addr + 64, ..g }),
        ("used ring on the avail ring", VringConfigData { used_ring_addr: g.avail_ring_addr, ..g }),
        ("avail ring below memory", VringConfigData { avail_ring_addr: base - 4096, ..g }),
    ];
    if packed {
        // Event areas: 4 bytes each (the device area must be 4-aligned to
        // get past the `vhost` crate, see misaligned_ring_addresses).
        v.push(("device area just past the end", VringConfigData { used_ring_addr: end, ..g }));
        v.push(("driver area straddling the end", VringConfigData { avail_ring_addr: end - 2, ..g }));
    } else {
        // Used ring: 6 + 8 x 64 bytes.
        v.push(("used ring straddling the end", VringConfigData { used_ring_addr: end - 64, ..g }));
    }
    v
}

/// Misaligned ring addresses for `good`.
fn misaligned_ring_addrs(good: VringConfigData) -> Vec<(&'static str, VringConfigData)> {
    let g = good;
    vec![
        ("descriptors 8 bytes off", VringConfigData { desc_table_addr: g.desc_table_addr + 8, ..g }),
        ("avail ring / driver area 1 byte off", VringConfigData { avail_ring_addr: g.avail_ring_addr + 1, ..g }),
        ("used ring / device area 2 bytes off", VringConfigData { used_ring_addr: g.used_ring_addr + 2, ..g }),
    ]
}

/// Rings that overlap or lie (partly) outside memory. A ring not
/// yet started takes SET_VRING_ADDR (vhostd checks addresses when the ring
/// starts) and refuses the SET_VRING_ENABLE that would start it (an error
/// reply, REPLY_ACK); a running ring refuses SET_VRING_ADDR itself and
/// stops. Either way: nothing counted, no NEEDS_RESET, the connection goes
/// on, and good addresses start the ring where it stopped.
fn ring_addresses(packed: bool) {
    let vd = net_daemon();
    let extra = layout(packed);
    let mut t = net_tx_opt(&vd, extra, QSIZE, 0, false);
    let l = t.tx.q.ring.layout();
    let good = vring_addrs(&mut t.c, l);
    let bad = bad_ring_addrs(&mut t.c, good, packed);
    assert!(t.c.dev.protocol_features().contains(VhostUserProtocolFeatures::REPLY_ACK));
    // Not started: the refusal comes with the request that starts the ring.
    let fe = t.c.dev.frontend();
    fe.set_vring_num(1, QSIZE).unwrap();
    fe.set_vring_base(1, if packed { 0x8000 } else { 0 }).unwrap();
    fe.set_vring_addr(1, &bad[2].1).unwrap();
    fe.set_vring_kick(1, t.tx.q.kick_fd()).unwrap();
    fe.set_vring_call(1, t.tx.q.call_fd()).unwrap();
    assert!(fe.set_vring_enable(1, true).is_err(), "a ring with its used ring inside its descriptors started");
    fe.set_vring_addr(1, &good).unwrap();
    t.still_sends();
    // Running: each bad SET_VRING_ADDR is refused, good ones restart it.
    for (what, cfg) in &bad {
        assert!(t.c.dev.frontend().set_vring_addr(1, cfg).is_err(), "{what}: accepted");
        assert!(!t.c.needs_reset(), "{what}");
        t.c.dev
            .frontend()
            .set_vring_addr(1, &good)
            .unwrap_or_else(|e| panic!("{what}: good addresses refused after: {e}"));
        t.still_sends();
    }
    if packed {
        // A vring base naming a slot past the ring.
        assert!(t.c.dev.frontend().set_vring_base(1, 0x8000 | QSIZE).is_err(), "base past the ring accepted");
        let base = t.tx.avail | if t.tx.avail_wrap { 0x8000 } else { 0 };
        t.c.dev.frontend().set_vring_base(1, base).unwrap();
        t.still_sends();
    }
    expect_net(&vd, 1, NetQ { packets: bad.len() as u64 + 1 + packed as u64, ..NetQ::default() });
    t.finish(&vd, false, extra);
    check_exit(&vd.stop(), &[(0, 0), (1, 0), (2, 0), (3, 0)]);
}

#[test]
fn ring_addresses_overlapping_or_outside_memory_split() {
    ring_addresses(false);
}

#[test]
fn ring_addresses_overlapping_or_outside_memory_packed() {
    ring_addresses(true);
}

/// SET_VRING_NUM of a split ring: zero, not a power of two, 65536 (sent
/// raw: the field is 32 bits), above --queue-size: each refused (an error
/// reply); the connection goes on and a good size works.
#[test]
fn queue_sizes_zero_not_a_power_of_two_or_too_big_split() {
    let vd = start("net", &["--backend", "loopback", "--queues", "2", "--queue-size", "64"]);
    let mut c = connect(&vd, 0);
    for num in [0u16, 48, 63, 65, 128] {
        assert!(c.dev.frontend().set_vring_num(1, num).is_err(), "SET_VRING_NUM {num} accepted");
    }
    // SET_VRING_NUM (8) with NEED_REPLY: index 1, num 65536.
    let mut body = 1u32.to_le_bytes().to_vec();
    body.extend_from_slice(&65536u32.to_le_bytes());
    let r = raw_request(&mut c.raw, 8, 0x8, &body, true).unwrap();
    assert_ne!(u64::from_le_bytes(r[..8].try_into().unwrap()), 0, "SET_VRING_NUM 65536 accepted");
    assert!(!c.needs_reset());
    let others = vec![pair(&mut c, 0), pair(&mut c, 1)];
    finish_net(&vd, c, others, false, 0);
    vd.stop();
}

/// A packed ring's size need not be a power of two (virtio 1.2, 2.8:
/// "The Queue Size value does not have to be a power of 2"): a 48-entry
/// packed ring must be served.
#[test]
fn packed_ring_of_48_entries_is_served() {
    let vd = net_daemon();
    let mut t = net_tx_opt(&vd, f::RING_PACKED, 48, 0, false);
    t.c.dev.start_queue(&t.tx.q).expect("a 48-entry packed ring");
    t.send_good(100);
    t.finish(&vd, false, f::RING_PACKED);
    vd.stop();
}

/// Misaligned ring addresses (a guest writes its queue addresses; QEMU
/// passes them on) must be refused like any other bad address: an error
/// reply to SET_VRING_ADDR, the connection kept.
///
/// (The `vhost` crate's message check would fail them as invalid messages
/// and close the connection: vhostd answers them itself, server.rs
/// `vring_addr_misaligned`.)
fn misaligned_ring_addresses(packed: bool) {
    let vd = net_daemon();
    let extra = layout(packed);
    let mut t = net_tx(&vd, extra, QSIZE, 0);
    let l = t.tx.q.ring.layout();
    let good = vring_addrs(&mut t.c, l);
    for (what, cfg) in misaligned_ring_addrs(good) {
        let r = t.c.dev.frontend().set_vring_addr(1, &cfg);
        assert!(r.is_err(), "{what}: accepted");
        assert!(!t.c.dev.backend_gone(), "{what}: vhostd closed the connection ({r:?})");
        assert!(!t.c.needs_reset(), "{what}");
        t.c.dev
            .frontend()
            .set_vring_addr(1, &good)
            .unwrap_or_else(|e| panic!("{what}: good addresses refused after: {e}"));
        t.still_sends();
    }
    t.finish(&vd, false, extra);
    vd.stop();
}

#[test]
fn misaligned_ring_addresses_are_refused_with_a_reply_split() {
    misaligned_ring_addresses(false);
}

#[test]
fn misaligned_ring_addresses_are_refused_with_a_reply_packed() {
    misaligned_ring_addresses(true);
}

// ---------------------------------------------------------------------------
// virtio-blk: a raw request queue 0, a normal queue 1, the next connection.
// ---------------------------------------------------------------------------

/// Queue 0 raw, queue 1 a normal request queue.
struct BlkT {
    c: Conn,
    q: Ring,
    other: BlkQueue,
    /// 64 buffers of 8 KiB for hand-made requests.
    area: u64,
    slot: u64,
}

/// The status byte's value before the device writes it.
const UNWRITTEN: u8 = blk::STATUS_NOT_WRITTEN;

fn blk_t(vd: &Vd, extra: u64, qsize: u16) -> BlkT {
    let mut c = connect(vd, extra);
    assert_eq!(c.dev.blk_config().unwrap().capacity, BLK_SECTORS);
    let q = c.raw_ring(0, qsize);
    let other = c.dev.blk_queue(1, 4, 4096).unwrap();
    let area = c.dev.memory().alloc(64 * 8192, 4096).unwrap();
    BlkT { c, q, other, area, slot: 0 }
}

impl BlkT {
    /// A fresh 8 KiB buffer, filled with UNWRITTEN.
    fn buf(&mut self) -> u64 {
        let g = self.area + (self.slot % 64) * 8192;
        self.slot += 1;
        assert!(self.c.dev.memory().driver_memory().write(g, &[UNWRITTEN; 8192]));
        g
    }

    /// A readable request header.
    fn hdr(&mut self, req_type: u32, sector: u64) -> B {
        let g = self.buf();
        assert!(self.c.dev.memory().driver_memory().write(g, &blk::header(req_type, sector)));
        B(g, 16, 0)
    }

    fn byte(&mut self, gpa: u64) -> u8 {
        self.c.read(gpa, 1)[0]
    }

    /// Runs one chain; returns its used length.
    fn run(&mut self, bufs: &[B]) -> u32 {
        let id = self.q.chain(bufs);
        let u = self.q.wait_used(1);
        assert_eq!(u[0].0, id);
        u[0].1
    }

    /// The raw queue still serves: a 4 KiB read, answered OK with 4097 bytes.
    fn still_serves(&mut self) {
        let h = self.hdr(blk::types::IN, 8);
        let (d, s) = (self.buf(), self.buf());
        assert_eq!(self.run(&[h, B(d, 4096, WRITE), B(s, 1, WRITE)]), 4097);
        assert_eq!(self.byte(s), status::OK);
    }
}

/// Ends a blk case: queue 1 of the same connection still reads and
/// writes, NEEDS_RESET exactly when the guest broke a ring; then the next
/// connection gets a clean device whose two queues both work.
fn finish_blk(vd: &Vd, t: BlkT, broken: bool, extra: u64) {
    let BlkT { mut c, q, mut other, .. } = t;
    blk_serves(&mut other);
    assert_eq!(c.needs_reset(), broken, "GET_STATUS NEEDS_RESET");
    assert_eq!(vd.needs_reset_reported(), broken, "control socket needs_reset");
    drop((q, other));
    drop(c);
    let mut c = connect(vd, extra);
    assert!(!c.needs_reset(), "the next connection starts without NEEDS_RESET");
    for i in 0..2 {
        let mut bq = c.dev.blk_queue(i, 4, 4096).unwrap();
        blk_serves(&mut bq);
    }
    c.dev.disconnect().unwrap();
    assert!(!vd.needs_reset_reported());
}

/// A normal queue reads and writes.
fn blk_serves(bq: &mut BlkQueue) {
    assert_eq!(bq.run_one(BlkOp::Read { sector: 16, len: 4096 }).unwrap(), (status::OK, 4097));
    let r = bq.request(BlkOp::Write { sector: 16, len: 4096 }, &[0x5a; 4096], T).unwrap();
    assert_eq!((r.status, r.used_len), (status::OK, 1));
}

/// Runs a blk case: `body` gets queue 0 raw and returns whether it broke
/// the ring; queue 0 must end with `want` (the good read that shows it
/// still serves is not an error).
fn blk_case(packed: bool, extra: u64, qsize: u16, want: BlkQ, body: impl FnOnce(&mut BlkT, &Vd) -> bool) {
    let vd = blk_daemon();
    let extra = extra | layout(packed);
    let mut t = blk_t(&vd, extra, qsize);
    let broken = body(&mut t, &vd);
    if !broken {
        t.still_serves();
    }
    expect_blk(&vd, 0, want);
    expect_blk(&vd, 1, BlkQ::default());
    finish_blk(&vd, t, broken, extra);
    let s = vd.stop();
    check_exit(&s, &[(0, want.bad.total()), (1, 0)]);
    assert_eq!(s.queue(0, "ioerr"), want.ioerr);
    assert_eq!(s.queue(0, "no_status"), want.no_status);
}

/// The header must be device-readable: a writable one is no header, the
/// request is answered IOERR (status byte 1, used length 1).
fn blk_header_writable(packed: bool) {
    blk_case(packed, 0, QSIZE, BlkQ { ioerr: 1, ..BlkQ::default() }, |t, _| {
        let h = t.hdr(blk::types::IN, 0);
        let (d, s) = (t.buf(), t.buf());
        assert_eq!(t.run(&[B(h.0, 16, WRITE), B(d, 512, WRITE), B(s, 1, WRITE)]), 1);
        assert_eq!(t.byte(s), status::IOERR);
        assert!(t.c.read(d, 512).iter().all(|&x| x == UNWRITTEN));
        false
    });
}

#[test]
fn blk_header_writable_split() {
    blk_header_writable(false);
}

#[test]
fn blk_header_writable_packed() {
    blk_header_writable(true);
}

/// No writable byte for a status (a read and a write made only of
/// readable buffers): nothing can be answered, the chain comes back with
/// used length 0, counted no_status, nothing written.
fn blk_no_status(packed: bool) {
    blk_case(packed, 0, QSIZE, BlkQ { no_status: 2, ..BlkQ::default() }, |t, _| {
        for ty in [blk::types::IN, blk::types::OUT] {
            let h = t.hdr(ty, 0);
            let d = t.buf();
            assert_eq!(t.run(&[h, B(d, 512, 0)]), 0);
            assert!(t.c.read(d, 512).iter().all(|&x| x == UNWRITTEN));
        }
        false
    });
}

#[test]
fn blk_request_without_a_status_byte_split() {
    blk_no_status(false);
}

#[test]
fn blk_request_without_a_status_byte_packed() {
    blk_no_status(true);
}

/// Sectors past the end: at the capacity, straddling it, and where
/// sector x 512 overflows 64 bits: IOERR, counted out_of_range.
fn blk_past_the_end(packed: bool) {
    blk_case(packed, 0, QSIZE, BlkQ { ioerr: 3, out_of_range: 3, ..BlkQ::default() }, |t, _| {
        for (sector, len) in [(BLK_SECTORS, 512), (BLK_SECTORS - 1, 1024), (u64::MAX / 512 + 1, 512)] {
            let h = t.hdr(blk::types::IN, sector);
            let (d, s) = (t.buf(), t.buf());
            assert_eq!(t.run(&[h, B(d, len, WRITE), B(s, 1, WRITE)]), 1, "sector {sector}");
            assert_eq!(t.byte(s), status::IOERR);
        }
        false
    });
}

#[test]
fn blk_sector_past_the_end_split() {
    blk_past_the_end(false);
}

#[test]
fn blk_sector_past_the_end_packed() {
    blk_past_the_end(true);
}

/// A readable buffer after a writable one breaks the spec's ordering: a
/// bad chain (direction), used length 0, status byte untouched.
fn blk_readable_after_writable(packed: bool) {
    blk_case(packed, 0, QSIZE, BlkQ { bad: direction(1), ..BlkQ::default() }, |t, _| {
        let h = t.hdr(blk::types::IN, 0);
        let (d, x, s) = (t.buf(), t.buf(), t.buf());
        assert_eq!(t.run(&[h, B(d, 512, WRITE), B(x, 16, 0), B(s, 1, WRITE)]), 0);
        assert_eq!(t.byte(s), UNWRITTEN);
        false
    });
}

#[test]
fn blk_readable_buffer_after_a_writable_one_split() {
    blk_readable_after_writable(false);
}

#[test]
fn blk_readable_buffer_after_a_writable_one_packed() {
    blk_readable_after_writable(true);
}

/// Data straddling the end of guest memory: a bad chain (address), used
/// length 0, status byte untouched.
fn blk_data_straddling_the_end(packed: bool) {
    blk_case(packed, 0, QSIZE, BlkQ { bad: address(1), ..BlkQ::default() }, |t, _| {
        let end = t.c.mem_end();
        let h = t.hdr(blk::types::IN, 0);
        let s = t.buf();
        assert_eq!(t.run(&[h, B(end - 256, 512, WRITE), B(s, 1, WRITE)]), 0);
        assert_eq!(t.byte(s), UNWRITTEN);
        false
    });
}

#[test]
fn blk_data_straddling_the_end_of_memory_split() {
    blk_data_straddling_the_end(false);
}

#[test]
fn blk_data_straddling_the_end_of_memory_packed() {
    blk_data_straddling_the_end(true);
}

/// 4 GiB: a read into 64 buffers each covering all of guest memory (4 GiB
/// in all, past the 32-bit total) is a bad chain (address), nothing
/// written; with 63 (4032 MiB) the chain is valid but each data buffer is
/// over size_max: IOERR, nothing written but the status byte.
fn blk_4gib(packed: bool) {
    blk_case(packed, 0, 128, BlkQ { ioerr: 1, bad: address(1), ..BlkQ::default() }, |t, _| {
        let (base, size) = (t.c.dev.memory().gpa_base(), t.c.dev.memory().size() as u32);
        let h = t.hdr(blk::types::IN, 0);
        let s = t.buf();
        let mut bufs = vec![h];
        bufs.extend(std::iter::repeat_n(B(base, size, WRITE), 64));
        bufs.push(B(s, 1, WRITE));
        assert_eq!(t.run(&bufs), 0);
        assert_eq!(t.byte(s), UNWRITTEN);
        bufs.remove(1);
        assert_eq!(t.run(&bufs), 1);
        assert_eq!(t.byte(s), status::IOERR);
        false
    });
}

#[test]
fn blk_4gib_of_data_split() {
    blk_4gib(false);
}

#[test]
fn blk_4gib_of_data_packed() {
    blk_4gib(true);
}

/// Loops on a blk queue: descriptors naming each other, and entries of an
/// indirect table naming each other (loop); a table inside a table
/// (indirect). A good request in a table is served.
///
/// (A loop back from a writable buffer to a readable one is caught
/// earlier, as a direction error: readable after writable.)
#[test]
fn blk_descriptor_loops_and_nested_tables_split() {
    blk_case(
        false,
        f::INDIRECT_DESC,
        QSIZE,
        BlkQ { bad: Bad { lp: 2, indirect: 1, ..NONE }, ..BlkQ::default() },
        |t, _| {
            let h = t.hdr(blk::types::IN, 0);
            let (d, s) = (t.buf(), t.buf());
            // All readable, so that only the loop is wrong.
            t.q.desc(0, h.0, 16, NEXT, 1);
            t.q.desc(1, d, 512, NEXT, 0);
            t.q.post(&[0]);
            assert_eq!(t.q.wait_used(1), vec![(0, 0)]);
            t.q.next_desc = 2;
            let looped = t.c.table(&[E(h.0, 16, NEXT, 1), E(d, 512, NEXT, 0)]);
            assert_eq!(t.run(&[B(looped, 32, INDIRECT)]), 0);
            let good = t.c.table(&[E(h.0, 16, NEXT, 1), E(d, 512, NEXT | WRITE, 2), E(s, 1, WRITE, 0)]);
            let nested = t.c.table(&[E(h.0, 16, NEXT, 1), E(good, 48, INDIRECT, 0)]);
            assert_eq!(t.run(&[B(nested, 32, INDIRECT)]), 0);
            assert_eq!(t.byte(s), UNWRITTEN);
            assert_eq!(t.run(&[B(good, 48, INDIRECT)]), 513);
            assert_eq!(t.byte(s), status::OK);
            false
        },
    );
}

/// Indirect tables on a packed blk queue: a table inside a table, and a
/// table 24 bytes long, are bad chains (indirect); a good request in a
/// table is served.
#[test]
fn blk_indirect_tables_packed() {
    blk_case(true, f::INDIRECT_DESC, QSIZE, BlkQ { bad: indirect(2), ..BlkQ::default() }, |t, _| {
        let h = t.hdr(blk::types::IN, 0);
        let (d, s) = (t.buf(), t.buf());
        let good = t.c.table(&[E(h.0, 16, 0, 0), E(d, 512, WRITE, 0), E(s, 1, WRITE, 0)]);
        let nested = t.c.table(&[E(h.0, 16, 0, 0), E(good, 48, INDIRECT, 0)]);
        assert_eq!(t.run(&[B(nested, 32, INDIRECT)]), 0);
        assert_eq!(t.run(&[B(good, 24, INDIRECT)]), 0);
        assert_eq!(t.byte(s), UNWRITTEN);
        assert_eq!(t.run(&[B(good, 48, INDIRECT)]), 513);
        assert_eq!(t.byte(s), status::OK);
        false
    });
}

/// A head past the queue on a blk queue: NEEDS_RESET (index); queue 1 and
/// the next connection are unaffected.
#[test]
fn blk_head_index_past_the_queue_split() {
    blk_case(false, 0, QSIZE, BlkQ { bad: index(1), ..BlkQ::default() }, |t, _| {
        t.q.post(&[QSIZE + 7]);
        assert!(wait_until(T, || t.c.needs_reset()), "NEEDS_RESET");
        t.q.no_used();
        true
    });
}

/// A packed blk chain whose second slot was never made available: the
/// ring is corrupt (index), NEEDS_RESET; queue 1 and the next connection
/// are unaffected.
#[test]
fn blk_chain_cut_short_packed() {
    blk_case(true, 0, QSIZE, BlkQ { bad: index(1), ..BlkQ::default() }, |t, _| {
        let h = t.hdr(blk::types::IN, 0);
        let av = PackedDriver::avail_bits(true);
        t.q.pk().write_desc(0, PackedDesc { addr: h.0, len: 16, id: 3, flags: av | NEXT });
        t.q.kick();
        assert!(wait_until(T, || t.c.needs_reset()), "NEEDS_RESET");
        t.q.no_used();
        true
    });
}

// ---- the frontend (not the guest): memory shrunk under vhostd -------------

impl Vd {
    /// The daemon process is still running (not a zombie).
    fn alive(&self) -> bool {
        let st = std::fs::read_to_string(format!("/proc/{}/stat", self.d.pid())).unwrap_or_default();
        st.rsplit_once(')').and_then(|(_, r)| r.trim_start().chars().next()).is_some_and(|c| c != 'Z')
    }
}

/// Not a guest: the frontend tries to shrink the memory file it shared
/// after SET_MEM_TABLE. vhostd sealed the memfd against shrinking when it
/// mapped it, so the frontend cannot (EPERM); vhostd goes on and the next
/// connection works. (An unsealable file that does shrink is
/// hostile_vmm.rs's `a_memfd_shrunk_under_running_rings_does_not_kill_vhostd`.)
#[test]
fn a_frontend_shrinking_its_memory_does_not_kill_vhostd() {
    let vd = net_daemon();
    let mut t = net_tx(&vd, 0, QSIZE, 0);
    t.still_sends();
    let (b, _) = t.frame_buf();
    let head = t.tx.write_chain(&[b]);
    let r = t.tx.split();
    let idx = r.avail_idx();
    r.write_avail_ring(idx, head);
    r.set_avail_idx(idx.wrapping_add(1));
    // vhostd sealed the memfd against shrinking when it mapped it.
    let before = vd.kicks(1);
    let e = t.c.dev.memory().file().set_len(0).expect_err("the guest memory file shrank");
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    t.tx.kick();
    let kicked = |vd: &Vd| vd.try_json().is_some_and(|v| v["devices"][0]["queues"][1]["kicks"].as_u64() > Some(before));
    let settled = wait_until(T, || !vd.alive() || kicked(&vd));
    assert!(settled);
    assert!(vd.alive(), "vhostd died:\n{}", vd.d.log());
    drop(t);
    next_net_connection(&vd, 0);
}
