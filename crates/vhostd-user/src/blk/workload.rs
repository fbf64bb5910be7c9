//! fio-like workloads over blk queues, for the CLI and tests: sequential or
//! random reads and writes of `bs` bytes with `iodepth` requests in flight
//! per queue, and `verify` (write a pattern derived from each block's
//! offset and a seed, flush, read it all back and compare). One thread
//! drives every queue; nothing is allocated per request.
//!
//! The engine drives any request queue that implements [`IoQueue`]: blk's
//! [`BlkQueue`] (`run`) and scsi's (`crate::scsi::workload`).

use super::{status, types, BlkCompletion, BlkOp, BlkQueue, SECTOR};
use crate::queue::VirtQueue;
use crate::{features, Error};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use virtq_driver::{SharedBytes, SharedBytesMut};

/// A completed request as the workload engine sees it.
pub trait IoCompletion {
    /// The tag given at submission.
    fn user(&self) -> u64;
    /// From submission to the poll that found it.
    fn latency(&self) -> Duration;
    /// What went wrong (a bad status, an impossible used length), if anything.
    fn problem(&self) -> Option<String>;
    /// A read that succeeded: its data is what the device read.
    fn read_ok(&self) -> bool;
}

/// A request queue the workload engine drives (blk's, scsi's): reads and
/// writes of whole blocks at byte offsets, completed in any order.
pub trait IoQueue {
    /// What `poll_io` reports.
    type Completion: IoCompletion;
    /// The device, as the summary line names it ("blk", "scsi").
    const KIND: &'static str;
    /// The virtqueue (notifications).
    fn virtqueue(&mut self) -> &mut VirtQueue;
    /// Most requests in flight.
    fn depth(&self) -> u16;
    /// Largest data length of a request.
    fn max_data(&self) -> u32;
    /// Requests submitted and not yet completed.
    fn in_flight(&self) -> u16;
    /// Completions that overtook requests submitted before them.
    fn reordered(&self) -> u64;
    /// The device refuses writes.
    fn read_only(&self) -> bool;
    /// Queues a read (or a write) of `len` bytes at byte `offset` of the
    /// disk in a free slot; `fill` gets its data area first. Ok(false)
    /// when every slot is in flight; `user` comes back in the completion.
    fn submit_io(
        &mut self,
        write: bool,
        offset: u64,
        len: u32,
        user: u64,
        fill: impl FnOnce(&mut SharedBytesMut),
    ) -> Result<bool, Error>;
    /// Publishes what was submitted and kicks if the device wants it.
    fn post(&mut self) -> Result<bool, Error>;
    /// Takes every completion the device has made, calling `f` with each
    /// and its data-in bytes. Returns how many.
    fn poll_io(&mut self, f: impl FnMut(&Self::Completion, SharedBytes)) -> Result<usize, Error>;
    /// Makes completed writes durable with one synchronous request (nothing
    /// else in flight): its status and completion, or None when the device
    /// has no such request.
    fn sync_cache(&mut self, timeout: Duration) -> Result<Option<(u8, Self::Completion)>, Error>;
    /// A status `sync_cache` returned, as a word.
    fn status_name(s: u8) -> String;
}

impl IoCompletion for BlkCompletion {
    #[inline]
    fn user(&self) -> u64 {
        self.user
    }
    #[inline]
    fn latency(&self) -> Duration {
        self.latency
    }
    #[inline]
    fn problem(&self) -> Option<String> {
        BlkCompletion::problem(self)
    }
    #[inline]
    fn read_ok(&self) -> bool {
        self.req_type == types::IN && self.status == status::OK
    }
}

impl IoQueue for BlkQueue {
    type Completion = BlkCompletion;
    const KIND: &'static str = "blk";
    fn virtqueue(&mut self) -> &mut VirtQueue {
        &mut self.queue
    }
    fn depth(&self) -> u16 {
        BlkQueue::depth(self)
    }
    fn max_data(&self) -> u32 {
        BlkQueue::max_data(self)
    }
    #[inline]
    fn in_flight(&self) -> u16 {
        BlkQueue::in_flight(self)
    }
    fn reordered(&self) -> u64 {
        BlkQueue::reordered(self)
    }
    fn read_only(&self) -> bool {
        self.features() & features::BLK_RO != 0
    }
    #[inline]
    fn submit_io(
        &mut self,
        write: bool,
        offset: u64,
        len: u32,
        user: u64,
        fill: impl FnOnce(&mut SharedBytesMut),
    ) -> Result<bool, Error> {
        let sector = offset / SECTOR;
        let op = if write { BlkOp::Write { sector, len } } else { BlkOp::Read { sector, len } };
        self.submit(op, user, fill)
    }
    #[inline]
    fn post(&mut self) -> Result<bool, Error> {
        self.flush()
    }
    #[inline]
    fn poll_io(&mut self, f: impl FnMut(&BlkCompletion, SharedBytes)) -> Result<usize, Error> {
        self.poll(f)
    }
    fn sync_cache(&mut self, timeout: Duration) -> Result<Option<(u8, BlkCompletion)>, Error> {
        if self.features() & features::BLK_FLUSH == 0 {
            return Ok(None);
        }
        let reply = self.request(BlkOp::Flush, &[], timeout)?;
        Ok(Some((reply.status, reply.completion)))
    }
    fn status_name(s: u8) -> String {
        super::status_name(s)
    }
}

/// What to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Reads at random bs-aligned offsets.
    RandRead,
    /// Writes at random bs-aligned offsets.
    RandWrite,
    /// Write a pattern, flush, read back and compare.
    Verify,
}

impl Mode {
    /// The CLI's name.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Read => "read",
            Mode::Write => "write",
            Mode::RandRead => "randread",
            Mode::RandWrite => "randwrite",
            Mode::Verify => "verify",
        }
    }

    fn writes(self) -> bool {
        matches!(self, Mode::Write | Mode::RandWrite | Mode::Verify)
    }
}

/// A workload.
#[derive(Clone, Debug)]
pub struct Workload {
    /// What to do.
    pub mode: Mode,
    /// Bytes per request (a multiple of 512).
    pub bs: u32,
    /// Requests in flight per queue (at most the queue's depth).
    pub iodepth: u16,
    /// Bytes of the disk used, from offset 0 (None: all of it).
    pub size: Option<u64>,
    /// Requests to make (verify: blocks to write and read back). Without
    /// it and without `duration`: one pass over the area.
    pub count: Option<u64>,
    /// Stop submitting after this long (verify ignores it).
    pub duration: Option<Duration>,
    /// Seeds random offsets and the verify pattern.
    pub seed: u64,
    /// Busy-poll the used rings (calls disabled) instead of sleeping on the
    /// call eventfds.
    pub poll: bool,
    /// Fail when requests are in flight and none completes for this long.
    pub stall_timeout: Duration,
}

impl Workload {
    /// `mode` with `bs`-byte requests, 32 in flight per queue, the whole
    /// disk once, seed 1, sleeping on calls, 30 s stall timeout.
    pub fn new(mode: Mode, bs: u32) -> Workload {
        Workload {
            mode,
            bs,
            iodepth: 32,
            size: None,
            count: None,
            duration: None,
            seed: 1,
            poll: false,
            stall_timeout: Duration::from_secs(30),
        }
    }
}

/// Latency histogram: exact below 32 ns, then 32 buckets per power of two
/// (at most ~3% error), fixed size, no allocation per sample.
#[derive(Clone, Debug)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
    max: u64,
}

const SUB_BITS: u32 = 5;
const SUB: u64 = 1 << SUB_BITS;

impl Default for Histogram {
    fn default() -> Self {
        Histogram { counts: vec![0; (64 - SUB_BITS as usize + 1) * SUB as usize], total: 0, max: 0 }
    }
}

impl Histogram {
    fn index(v: u64) -> usize {
        if v < SUB {
            return v as usize;
        }
        let shift = 63 - v.leading_zeros() - SUB_BITS;
        (((shift + 1) as u64) << SUB_BITS | ((v >> shift) & (SUB - 1))) as usize
    }

    /// Highest value of bucket `i`.
    fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            return i;
        }
        let shift = (i >> SUB_BITS) - 1;
        let sub = i & (SUB - 1);
        (((SUB + sub) << shift) - 1).saturating_add(1 << shift)
    }

    /// Adds one sample.
    #[inline]
    pub fn record(&mut self, v: u64) {
        self.counts[Self::index(v)] += 1;
        self.total += 1;
        self.max = self.max.max(v);
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Largest sample.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// The value at quantile `q` (0..=1): the top of its bucket, at most the max.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let want = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Self::upper(i).min(self.max);
            }
        }
        self.max
    }
}

/// What a workload did.
#[derive(Clone, Debug)]
pub struct Report {
    /// The device driven ("blk", "scsi": `IoQueue::KIND`).
    pub kind: &'static str,
    /// Names the flush status in the summary (`IoQueue::status_name`).
    flush_name: fn(u8) -> String,
    /// The workload's mode.
    pub mode: Mode,
    /// Bytes per request.
    pub bs: u32,
    /// Requests in flight per queue.
    pub iodepth: u16,
    /// Queues driven.
    pub queues: usize,
    /// Requests completed (verify: writes, reads and the flush).
    pub ios: u64,
    /// Completions with a bad status or used length.
    pub errors: u64,
    /// Data bytes of successful reads and writes.
    pub bytes: u64,
    /// From the first submission to the last completion.
    pub seconds: f64,
    /// Submission-to-completion latency in nanoseconds.
    pub latency: Histogram,
    /// The first error, described.
    pub first_error: Option<String>,
    /// Verify: the lowest byte offset that read back wrong.
    pub mismatch: Option<u64>,
    /// Verify: blocks written and read back.
    pub verified_blocks: u64,
    /// Verify: the FLUSH status (None: FLUSH not negotiated, not sent).
    pub flush: Option<u8>,
    /// Stopped early by the stop flag.
    pub interrupted: bool,
    /// Completions that overtook earlier requests (see `BlkQueue::reordered`).
    pub reordered: u64,
}

impl Report {
    /// No errors and (verify) no mismatch.
    pub fn passed(&self) -> bool {
        self.errors == 0 && self.mismatch.is_none()
    }

    /// One line for scripts: `KIND mode=.. bs=.. iodepth=.. queues=.. ios=..
    /// errors=.. bytes=.. seconds=.. iops=.. mbps=.. lat_us p50=.. p90=..
    /// p99=.. p999=.. max=..` (mbps: 10^6 bytes per second), then for
    /// verify `verify=ok|mismatch [first_mismatch=OFFSET] blocks=N flush=..`,
    /// then `reordered=N` (completions that overtook earlier requests) and
    /// `interrupted=1` if stopped by the stop flag.
    pub fn summary(&self) -> String {
        let secs = self.seconds.max(1e-9);
        let us = |ns: u64| ns as f64 / 1000.0;
        let l = &self.latency;
        let mut s = format!(
            "{} mode={} bs={} iodepth={} queues={} ios={} errors={} bytes={} seconds={:.3} iops={:.0} mbps={:.1} lat_us p50={:.1} p90={:.1} p99={:.1} p999={:.1} max={:.1}",
            self.kind,
            self.mode.name(),
            self.bs,
            self.iodepth,
            self.queues,
            self.ios,
            self.errors,
            self.bytes,
            self.seconds,
            self.ios as f64 / secs,
            self.bytes as f64 / secs / 1e6,
            us(l.quantile(0.50)),
            us(l.quantile(0.90)),
            us(l.quantile(0.99)),
            us(l.quantile(0.999)),
            us(l.max()),
        );
        if self.mode == Mode::Verify {
            match self.mismatch {
                None => s.push_str(" verify=ok"),
                Some(o) => s.push_str(&format!(" verify=mismatch first_mismatch={o}")),
            }
            s.push_str(&format!(" blocks={} flush=", self.verified_blocks));
            s.push_str(&self.flush.map_or("none".to_string(), self.flush_name));
        }
        s.push_str(&format!(" reordered={}", self.reordered));
        if self.interrupted {
            s.push_str(" interrupted=1");
        }
        s
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[inline]
fn pattern_word(seed: u64, pos: u64) -> [u8; 8] {
    splitmix64(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ pos).to_le_bytes()
}

/// Fills `buf` with the verify pattern of the bytes at disk offset `offset`
/// (a function of each 8-byte word's position and `seed` only).
pub fn fill_pattern(buf: &mut [u8], offset: u64, seed: u64) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        let w = pattern_word(seed, offset + 8 * i as u64);
        c.copy_from_slice(&w[..c.len()]);
    }
}

/// The index of the first byte of `buf` that is not the pattern of `offset`.
pub fn check_pattern(buf: &[u8], offset: u64, seed: u64) -> Option<usize> {
    for (i, c) in buf.chunks(8).enumerate() {
        let w = pattern_word(seed, offset + 8 * i as u64);
        if c != &w[..c.len()] {
            let j = c.iter().zip(w.iter()).position(|(a, b)| a != b).unwrap_or(0);
            return Some(8 * i + j);
        }
    }
    None
}

/// `fill_pattern` into shared memory (a request's data area).
pub fn fill_pattern_shared(buf: &mut SharedBytesMut, offset: u64, seed: u64) {
    let mut w = [0u8; 512];
    for at in (0..buf.len()).step_by(w.len()) {
        let n = (buf.len() - at).min(w.len());
        fill_pattern(&mut w[..n], offset + at as u64, seed);
        buf.write_at(at, &w[..n]);
    }
}

/// `check_pattern` of shared memory (a read's data as the device left it).
pub fn check_pattern_shared(buf: SharedBytes, offset: u64, seed: u64) -> Option<usize> {
    let mut w = [0u8; 512];
    for at in (0..buf.len()).step_by(w.len()) {
        let n = buf.slice(at..buf.len()).map_or(0, |b| b.copy_to(&mut w));
        if let Some(i) = check_pattern(&w[..n], offset + at as u64, seed) {
            return Some(at + i);
        }
    }
    None
}

/// What verify reads find in their buffers before the device writes them
/// (no 8-byte pattern word is all 0xa5 but by a 2^-64 chance).
const POISON: u8 = 0xa5;

struct Phase {
    write: bool,
    random: bool,
    /// Compare reads with the pattern / write the full pattern.
    verify: bool,
    total: u64,
    deadline: Option<Instant>,
}

struct Run<'a> {
    w: &'a Workload,
    blocks: u64,
    rng: u64,
    stop: Option<&'a AtomicBool>,
    rep: Report,
}

/// Runs `w` over `queues` of a disk of `capacity` sectors. `stop` (e.g. set
/// by a signal handler) ends it early, letting requests in flight finish.
/// Request errors and mismatches are in the report; a broken ring, a
/// stalled device or bad parameters are errors.
pub fn run(queues: &mut [BlkQueue], capacity: u64, w: &Workload, stop: Option<&AtomicBool>) -> Result<Report, Error> {
    run_queues(queues, capacity.saturating_mul(SECTOR), w, stop)
}

/// `run` over any device's request queues, on a disk of `cap_bytes` bytes.
pub fn run_queues<Q: IoQueue>(
    queues: &mut [Q],
    cap_bytes: u64,
    w: &Workload,
    stop: Option<&AtomicBool>,
) -> Result<Report, Error> {
    if queues.is_empty() {
        return Err(Error::Config("no queues".into()));
    }
    if w.bs == 0 || !(w.bs as u64).is_multiple_of(SECTOR) {
        return Err(Error::Config(format!("bs {} is not a positive multiple of 512", w.bs)));
    }
    if let Some(q) = queues.iter().find(|q| q.max_data() < w.bs) {
        return Err(Error::Config(format!("bs {} exceeds the queue's {} bytes", w.bs, q.max_data())));
    }
    if w.iodepth == 0 {
        return Err(Error::Config("iodepth must not be zero".into()));
    }
    if w.mode.writes() && queues[0].read_only() {
        return Err(Error::Unsupported("writes (the disk is read-only)".into()));
    }
    let area = match w.size {
        Some(s) if s > cap_bytes => {
            return Err(Error::Config(format!("size {s} exceeds the disk's {cap_bytes} bytes")))
        }
        Some(s) => s,
        None => cap_bytes,
    };
    let blocks = area / w.bs as u64;
    if blocks == 0 {
        return Err(Error::Config(format!("an area of {area} bytes holds no block of {}", w.bs)));
    }
    let iodepth = queues.iter().map(|q| q.depth()).min().unwrap_or(0).min(w.iodepth);
    let mut r = Run {
        w,
        blocks,
        rng: splitmix64(w.seed),
        stop,
        rep: Report {
            kind: Q::KIND,
            flush_name: Q::status_name,
            mode: w.mode,
            bs: w.bs,
            iodepth,
            queues: queues.len(),
            ios: 0,
            errors: 0,
            bytes: 0,
            seconds: 0.0,
            latency: Histogram::default(),
            first_error: None,
            mismatch: None,
            verified_blocks: 0,
            flush: None,
            interrupted: false,
            reordered: 0,
        },
    };
    for q in queues.iter_mut() {
        if w.poll {
            q.virtqueue().ring.disable_notifications();
        } else {
            q.virtqueue().ring.enable_notifications();
        }
    }
    let reordered0: u64 = queues.iter().map(|q| q.reordered()).sum();
    let start = Instant::now();
    if w.mode == Mode::Verify {
        let total = w.count.unwrap_or(blocks).min(blocks);
        let ph = Phase { write: true, random: false, verify: true, total, deadline: None };
        let written = r.phase(queues, &ph)?;
        if !r.rep.interrupted {
            if let Some((st, c)) = queues[0].sync_cache(w.stall_timeout)? {
                r.record_other(&c);
                r.rep.flush = Some(st);
                if w.poll {
                    queues[0].virtqueue().ring.disable_notifications();
                }
            }
        }
        if !r.rep.interrupted {
            let ph = Phase { write: false, random: false, verify: true, total: written, deadline: None };
            r.rep.verified_blocks = r.phase(queues, &ph)?;
        }
    } else {
        let total = match (w.count, w.duration) {
            (Some(c), _) => c,
            (None, Some(_)) => u64::MAX,
            (None, None) => blocks,
        };
        let ph = Phase {
            write: w.mode.writes(),
            random: matches!(w.mode, Mode::RandRead | Mode::RandWrite),
            verify: false,
            total,
            deadline: w.duration.map(|d| start + d),
        };
        r.phase(queues, &ph)?;
    }
    r.rep.seconds = start.elapsed().as_secs_f64();
    r.rep.reordered = queues.iter().map(|q| q.reordered()).sum::<u64>() - reordered0;
    Ok(r.rep)
}

impl Run<'_> {
    fn next_block(&mut self, random: bool, seq: &mut u64) -> u64 {
        if random {
            // xorshift64*: cheap, and seeded reproducibly.
            self.rng ^= self.rng >> 12;
            self.rng ^= self.rng << 25;
            self.rng ^= self.rng >> 27;
            self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % self.blocks
        } else {
            let b = *seq % self.blocks;
            *seq += 1;
            b
        }
    }

    fn record_other(&mut self, c: &impl IoCompletion) {
        self.rep.ios += 1;
        self.rep.latency.record(c.latency().as_nanos() as u64);
        if let Some(p) = c.problem() {
            self.rep.errors += 1;
            self.rep.first_error.get_or_insert(p);
        }
    }

    /// Submits `ph.total` requests (fewer if stopped or past the deadline)
    /// and waits for all of them. Returns how many were submitted.
    fn phase<Q: IoQueue>(&mut self, queues: &mut [Q], ph: &Phase) -> Result<u64, Error> {
        let bs = self.w.bs;
        let seed = self.w.seed;
        let depth = self.rep.iodepth;
        let mut submitted = 0u64;
        let mut seq = 0u64;
        let mut stopping = false;
        let mut last_progress = Instant::now();
        let mut progressed = false;
        let mut pass = 0u64;
        loop {
            if !stopping {
                for q in queues.iter_mut() {
                    let mut n = 0;
                    while submitted < ph.total && q.in_flight() < depth {
                        let blk = self.next_block(ph.random, &mut seq);
                        let off = blk * bs as u64;
                        let posted = match (ph.write, ph.verify) {
                            (true, true) => q.submit_io(true, off, bs, blk, |b| fill_pattern_shared(b, off, seed))?,
                            // Benchmark writes only stamp the block's offset.
                            (true, false) => q.submit_io(true, off, bs, blk, |b| {
                                b.write_at(0, &off.to_le_bytes());
                                b.write_at(8, &seed.to_le_bytes());
                            })?,
                            // Verify poisons the buffer first: a device that
                            // leaves it alone must not pass on stale data.
                            (false, true) => q.submit_io(false, off, bs, blk, |b| b.fill(POISON))?,
                            (false, false) => q.submit_io(false, off, bs, blk, |_| {})?,
                        };
                        if !posted {
                            break;
                        }
                        submitted += 1;
                        n += 1;
                    }
                    if n > 0 {
                        q.post()?;
                    }
                }
            }
            let mut got = 0;
            let rep = &mut self.rep;
            for q in queues.iter_mut() {
                got += q.poll_io(|c, data| {
                    rep.ios += 1;
                    rep.latency.record(c.latency().as_nanos() as u64);
                    if let Some(p) = c.problem() {
                        rep.errors += 1;
                        rep.first_error.get_or_insert(p);
                        return;
                    }
                    rep.bytes += bs as u64;
                    if ph.verify && !ph.write && c.read_ok() {
                        let off = c.user() * bs as u64;
                        if let Some(i) = check_pattern_shared(data, off, seed) {
                            let at = off + i as u64;
                            rep.mismatch = Some(rep.mismatch.map_or(at, |m| m.min(at)));
                        }
                    }
                })?;
            }
            let in_flight: u32 = queues.iter().map(|q| q.in_flight() as u32).sum();
            if in_flight == 0 && (stopping || submitted >= ph.total) {
                return Ok(submitted);
            }
            progressed |= got > 0;
            pass += 1;
            // A clock read costs as much as a request here: a polling run
            // looks at the clock every 256 passes (a few microseconds).
            if self.w.poll && !pass.is_multiple_of(256) {
                continue;
            }
            let now = Instant::now();
            if progressed {
                last_progress = now;
                progressed = false;
            } else if in_flight > 0 && now - last_progress > self.w.stall_timeout {
                return Err(Error::Timeout(format!(
                    "{in_flight} requests in flight and none completed in {:?}",
                    self.w.stall_timeout
                )));
            }
            if !stopping
                && (ph.deadline.is_some_and(|d| now >= d) || self.stop.is_some_and(|s| s.load(Ordering::Relaxed)))
            {
                stopping = true;
                self.rep.interrupted = ph.deadline.is_none_or(|d| now < d);
            }
            if self.w.poll {
                if pass.is_multiple_of(4096) {
                    for q in queues.iter_mut() {
                        q.virtqueue().ring.refresh_disabled();
                    }
                }
            } else if got == 0 && in_flight > 0 {
                wait_any(queues, Duration::from_millis(20))?;
            }
        }
    }
}

/// Sleeps until a call comes on any of `queues` or `timeout` passes
/// (returns at once if completions are already waiting).
pub fn wait_any<Q: IoQueue>(queues: &mut [Q], timeout: Duration) -> Result<(), Error> {
    use std::os::unix::io::AsRawFd;
    let mut fds = [libc::pollfd { fd: -1, events: libc::POLLIN, revents: 0 }; 64];
    for (i, q) in queues.iter_mut().enumerate() {
        if q.virtqueue().ring.enable_notifications() {
            return Ok(());
        }
        if let Some(p) = fds.get_mut(i) {
            p.fd = q.virtqueue().call_fd().as_raw_fd();
        }
    }
    let n = queues.len().min(fds.len());
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: `fds` holds n valid pollfds for the duration of the call.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), n as libc::nfds_t, ms) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Io(e));
        }
    }
    for q in queues.iter_mut() {
        q.virtqueue().take_calls();
    }
    Ok(())
}

/// What an idle period (`idle`) saw.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct IdleReport {
    /// How long it lasted.
    pub seconds: f64,
    /// Calls (interrupts) that came meanwhile: none is expected, as nothing
    /// was in flight.
    pub calls: u64,
    /// Ended early by the stop flag.
    pub interrupted: bool,
}

impl IdleReport {
    /// One line for scripts: `idle seconds=.. calls=..`, then
    /// `interrupted=1` if stopped by the stop flag.
    pub fn summary(&self) -> String {
        let mut s = format!("idle seconds={:.3} calls={}", self.seconds, self.calls);
        if self.interrupted {
            s.push_str(" interrupted=1");
        }
        s
    }
}

/// Keeps `queues` set up and running with nothing in flight for `duration`
/// (or until `stop` is set), as an idle guest does: calls enabled, the
/// thread asleep in poll(2) on the call eventfds and on `peer` (the
/// connection's socket: the device closing it ends the wait with an
/// error), with no timer but the end of the period. Calls that come are
/// counted; a completion is an error, as nothing was submitted. For
/// measuring what the device costs while its driver does nothing.
pub fn idle<Q: IoQueue>(
    queues: &mut [Q],
    duration: Duration,
    stop: Option<&AtomicBool>,
    peer: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<IdleReport, Error> {
    use std::os::unix::io::AsRawFd;
    if queues.len() > 63 {
        return Err(Error::Config(format!("{} queues: idle watches at most 63", queues.len())));
    }
    if let Some(q) = queues.iter().find(|q| q.in_flight() != 0) {
        return Err(Error::Config(format!("{} requests in flight: idle needs idle queues", q.in_flight())));
    }
    let completed = |queues: &mut [Q]| -> Result<usize, Error> {
        let mut n = 0;
        for q in queues.iter_mut() {
            n += q.poll_io(|_, _| {})?;
        }
        Ok(n)
    };
    for q in queues.iter_mut() {
        q.virtqueue().ring.enable_notifications();
    }
    // Calls from before (the one a device sends as a ring starts, the
    // workload's last ones) are not the idle period's.
    for q in queues.iter_mut() {
        q.virtqueue().take_calls();
    }
    let unexpected = |n: usize| Error::Config(format!("{n} completions while nothing was in flight"));
    match completed(queues)? {
        0 => {}
        n => return Err(unexpected(n)),
    }
    let mut fds = [libc::pollfd { fd: -1, events: libc::POLLIN, revents: 0 }; 64];
    for (p, q) in fds.iter_mut().zip(queues.iter_mut()) {
        p.fd = q.virtqueue().call_fd().as_raw_fd();
    }
    let nq = queues.len();
    let n = match peer {
        Some(fd) => {
            fds[nq] = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
            nq + 1
        }
        None => nq,
    };
    let start = Instant::now();
    let deadline = start + duration;
    let mut rep = IdleReport::default();
    loop {
        if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
            rep.interrupted = true;
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        // Rounded up: waking a millisecond early would only wake again.
        let ms = (deadline - now).as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        for p in fds[..n].iter_mut() {
            p.revents = 0;
        }
        // SAFETY: `fds` holds n valid pollfds for the duration of the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), n as libc::nfds_t, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Io(e));
        }
        if n > nq && fds[nq].revents != 0 {
            // Nothing is sent unasked: readable means closed (or broken).
            return Err(Error::Config(format!(
                "the device closed the connection {:.3} s into the idle period",
                start.elapsed().as_secs_f64()
            )));
        }
        for q in queues.iter_mut() {
            rep.calls += q.virtqueue().take_calls();
        }
        match completed(queues)? {
            0 => {}
            n => return Err(unexpected(n)),
        }
    }
    rep.seconds = start.elapsed().as_secs_f64();
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_close() {
        let mut h = Histogram::default();
        for v in 1..=10_000u64 {
            h.record(v * 1000);
        }
        let p50 = h.quantile(0.5) as f64;
        assert!((p50 / 5_000_000.0 - 1.0).abs() < 0.04, "{p50}");
        let p99 = h.quantile(0.99) as f64;
        assert!((p99 / 9_900_000.0 - 1.0).abs() < 0.04, "{p99}");
        assert_eq!(h.quantile(1.0), 10_000_000);
        assert_eq!(h.max(), 10_000_000);
        let mut small = Histogram::default();
        small.record(7);
        assert_eq!(small.quantile(0.5), 7);
        small.record(u64::MAX);
        assert_eq!(small.quantile(1.0), u64::MAX);
        assert_eq!(Histogram::default().quantile(0.5), 0);
    }

    #[test]
    fn pattern_depends_on_offset_and_seed() {
        let mut a = vec![0u8; 4096];
        fill_pattern(&mut a, 8192, 7);
        assert_eq!(check_pattern(&a, 8192, 7), None);
        assert_eq!(check_pattern(&a, 4096, 7), Some(0));
        assert!(check_pattern(&a, 8192, 8).is_some());
        a[100] ^= 1;
        assert_eq!(check_pattern(&a, 8192, 7), Some(100));
        // The second half of one block is the first half of the block at +2048.
        let mut b = vec![0u8; 2048];
        fill_pattern(&mut b, 8192 + 2048, 7);
        assert_eq!(&a[2048..], &b[..]);
    }

    #[test]
    fn the_shared_pattern_is_the_same_pattern() {
        let mut a = vec![0u8; 1500];
        fill_pattern(&mut a, 4096, 3);
        let mut b = vec![0u8; 1500];
        // SAFETY: `b`, private and alive meanwhile, and not otherwise used.
        fill_pattern_shared(&mut unsafe { SharedBytesMut::new(b.as_mut_ptr(), b.len()) }, 4096, 3);
        assert_eq!(a, b);
        assert_eq!(check_pattern_shared((&b[..]).into(), 4096, 3), None);
        b[1100] ^= 1;
        assert_eq!(check_pattern_shared((&b[..]).into(), 4096, 3), Some(1100));
        assert_eq!(check_pattern_shared((&b[..0]).into(), 4096, 3), None);
    }
}
