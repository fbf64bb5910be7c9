//! virtio-blk as a vhostd device: the disk as a whole ([`BlkDevice`]
//! implements [`Device`]) and one queue group per request queue
//! ([`BlkGroup`]: the ring, its requests in flight and its backend).

use std::os::unix::io::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use vhostd_block_backends::BlockBackend;
use vhostd_device::{
    tsc, value_of, Built, Counter, Counters, Device, InflightLog, Metric, Pass, QueueGroup, Ring, RingPlace,
    RingTotals, Sleep,
};
use virtq::ring::features as ring;
use virtq::QueueStats;

use crate::{features, BlkDevice, BlkQueue, CONFIG_LEN};

/// Requests in flight per request queue, at most.
pub const DEPTH: usize = 256;

/// The device over `disk` (with `dev`'s shape) and one group per backend,
/// each with at most `depth` requests in flight.
pub fn build(dev: BlkDevice, backends: Vec<Box<dyn BlockBackend>>, depth: usize) -> Built {
    let dev = Arc::new(dev);
    let groups = backends
        .into_iter()
        .enumerate()
        .map(|(i, b)| {
            Box::new(BlkGroup { index: i as u16, queue: BlkQueue::new(b, depth), dev: dev.clone(), stopping: false })
                as Box<dyn QueueGroup>
        })
        .collect();
    Built { device: dev, groups }
}

impl Device for BlkDevice {
    fn kind(&self) -> &'static str {
        "blk"
    }

    /// No IN_ORDER: requests complete in any order.
    fn features(&self) -> u64 {
        ring::VERSION_1 | ring::EVENT_IDX | ring::INDIRECT_DESC | ring::RING_PACKED | self.blk_features()
    }

    fn queues(&self) -> u16 {
        self.queues
    }

    fn max_queue_size(&self) -> u16 {
        self.max_queue_size
    }

    fn place(&self, index: u16, _features: u64) -> Option<RingPlace> {
        (index < self.queues).then_some(RingPlace { group: index as usize, slot: 0 })
    }

    /// QEMU asks for its whole struct: bytes past ours read as zero.
    fn read_config(&self, offset: u32, len: u32) -> Option<Vec<u8>> {
        let bytes: [u8; CONFIG_LEN] = self.config();
        let (off, len) = (offset as usize, len as usize);
        let end = off.checked_add(len)?;
        if len > 4096 {
            return None;
        }
        let mut out = vec![0u8; len];
        if off < bytes.len() {
            let n = end.min(bytes.len()) - off;
            out[..n].copy_from_slice(&bytes[off..off + n]);
        }
        Some(out)
    }

    fn write_config(&self, offset: u32, data: &[u8], features: u64) -> bool {
        if features & features::CONFIG_WCE == 0 || !self.set_config(offset as usize, data) {
            return false;
        }
        let mode = if self.writeback.load(Ordering::Relaxed) { "write-back" } else { "write-through" };
        tracing::info!("guest set the cache to {mode}");
        true
    }

    fn set_features(&self, _features: u64) {}

    fn reset(&self) {}

    /// Requests in flight survive a backend restart (split rings).
    fn tracks_inflight(&self) -> bool {
        true
    }

    fn ring_label(&self, place: RingPlace) -> (u16, Option<&'static str>) {
        (place.group as u16, None)
    }

    fn totals(&self, rings: &[RingTotals<'_>]) -> Vec<(&'static str, String)> {
        let sum = |k: &str| rings.iter().map(|r| value_of(r.counters, k)).sum::<u64>();
        let bad: u64 = rings.iter().map(|r| r.bad_chains).sum();
        let cycles: u64 = rings.iter().map(|r| r.busy_cycles).sum();
        let ios = sum("reads") + sum("writes");
        let per_io = if ios > 0 { cycles as f64 / ios as f64 } else { 0.0 };
        vec![
            ("reads", sum("reads").to_string()),
            ("writes", sum("writes").to_string()),
            ("bytes_read", sum("bytes_read").to_string()),
            ("bytes_written", sum("bytes_written").to_string()),
            ("errors", (sum("ioerr") + bad).to_string()),
            ("unsupp", sum("unsupp").to_string()),
            ("no_status", sum("no_status").to_string()),
            ("busy_cycles", cycles.to_string()),
            ("cycles_per_io", format!("{per_io:.1}")),
        ]
    }
}

/// One request queue: its requests in flight, its backend, the device.
pub struct BlkGroup {
    index: u16,
    queue: BlkQueue,
    dev: Arc<BlkDevice>,
    /// The ring is stopping: requests in flight complete, none start.
    stopping: bool,
}

const REQUESTS: Metric = Metric::counter("vhostd_blk_requests_total", "virtio-blk requests, by type.");
const BYTES: Metric = Metric::counter("vhostd_blk_bytes_total", "Bytes read and written for the guest.");
const ERRORS: Metric = Metric::counter(
    "vhostd_blk_errors_total",
    "Requests answered with an error (or not at all: no_status, bad_chain), by reason.",
);

impl QueueGroup for BlkGroup {
    fn ring_slots(&self) -> usize {
        1
    }

    fn attach(&mut self, _slot: usize, ring: &mut Ring, features: u64, inflight: Option<InflightLog>) {
        self.stopping = false;
        self.queue.set_features(features);
        if let Some(log) = inflight {
            // Requests a crashed backend left unanswered run again.
            let n = self.queue.attach_inflight(log, &mut ring.queue, &mut ring.batch, &self.dev);
            if n > 0 {
                tracing::info!(queue = self.index, "resubmitted {n} request(s) left in flight by a previous backend");
            }
            ring.notify();
        }
    }

    fn stop(&mut self, _slot: usize, ring: &mut Ring) -> bool {
        self.stopping = true;
        if self.queue.finish(&mut ring.queue) > 0 {
            ring.notify();
        }
        self.queue.in_flight() == 0
    }

    fn detach(&mut self, _slot: usize, ring: &mut Ring) {
        // The backend may still write into the ring's buffers (not after
        // `stop` said none are in flight: then this waits for nothing).
        self.queue.drain(&mut ring.queue, &self.dev);
        self.queue.detach_inflight();
        self.stopping = false;
    }

    fn poll(&mut self, rings: &mut [Option<Ring>]) -> Pass {
        let Some(Some(ring)) = rings.first_mut() else { return Pass::default() };
        let t0 = tsc();
        let n = if self.stopping {
            self.queue.finish(&mut ring.queue)
        } else {
            self.queue.process(&mut ring.queue, &mut ring.batch, &self.dev)
        };
        if n > 0 {
            ring.notify();
            ring.counters.busy_cycles += tsc() - t0;
            return Pass::did(n);
        }
        // The kernel finishes file requests, often on an io_uring worker
        // thread of this CPU (tmpfs, buffered I/O): let it run.
        Pass { yields: self.queue.in_flight() > 0 && self.queue.completes_elsewhere(), ..Pass::default() }
    }

    fn event_fd(&self) -> Option<RawFd> {
        self.queue.completion_fd()
    }

    /// Completions arrive whether or not the guest kicks: the completion
    /// descriptor always wakes the worker. A backend without one must be
    /// polled until its requests are done.
    fn prepare_sleep(&mut self, rings: &mut [Option<Ring>]) -> Sleep {
        let mut work = self.queue.in_flight() > 0 && self.queue.completion_fd().is_none();
        // A stopping ring takes no new requests: its kicks mean nothing.
        if let (Some(Some(ring)), false) = (rings.first_mut(), self.stopping) {
            work |= ring.queue.enable_notifications();
        }
        Sleep { work, watch_event_fd: true }
    }

    fn on_event(&mut self) {
        self.queue.ack_completion_event();
    }

    fn counters(&self, queues: &[QueueStats]) -> Counters {
        let b = &self.queue.stats;
        let bad = queues.first().map_or(0, |q| q.bad_chains);
        let ring = vec![
            Counter::new("reads", b.reads, REQUESTS.with("type", "read")),
            Counter::new("writes", b.writes, REQUESTS.with("type", "write")),
            Counter::new("flushes", b.flushes, REQUESTS.with("type", "flush")),
            Counter::new("discards", b.discards, REQUESTS.with("type", "discard")),
            Counter::new("write_zeroes", b.write_zeroes, REQUESTS.with("type", "write_zeroes")),
            Counter::new("get_ids", b.get_ids, REQUESTS.with("type", "get_id")),
            Counter::new("bytes_read", b.bytes_read, BYTES.with("dir", "read")),
            Counter::new("bytes_written", b.bytes_written, BYTES.with("dir", "write")),
            Counter::plain("ioerr", b.ioerr),
            Counter::plain("unsupp", b.unsupp),
            Counter::plain("no_status", b.no_status),
            Counter::plain("out_of_range", b.out_of_range),
            Counter::plain("read_only", b.read_only),
            Counter::plain("misaligned", b.misaligned),
            Counter::plain("backend_errors", b.backend_errors),
            Counter::new("errors.ioerr", b.ioerr, ERRORS.with("reason", "ioerr")),
            Counter::new("errors.unsupp", b.unsupp, ERRORS.with("reason", "unsupp")),
            Counter::new("errors.no_status", b.no_status, ERRORS.with("reason", "no_status")),
            Counter::new("errors.out_of_range", b.out_of_range, ERRORS.with("reason", "out_of_range")),
            Counter::new("errors.read_only", b.read_only, ERRORS.with("reason", "read_only")),
            Counter::new("errors.misaligned", b.misaligned, ERRORS.with("reason", "misaligned")),
            Counter::new("errors.backend", b.backend_errors, ERRORS.with("reason", "backend")),
            Counter::new("errors.bad_chain", bad, ERRORS.with("reason", "bad_chain")),
            Counter::new(
                "batches",
                b.batches,
                Metric::counter("vhostd_queue_batches_total", "Batches that moved at least one frame or request."),
            ),
            Counter::new(
                "max_in_flight",
                b.max_in_flight,
                Metric::gauge("vhostd_blk_max_in_flight", "Most requests in flight at once."),
            ),
        ];
        let backend = self.queue.backend_stats();
        let group = vec![
            Counter::plain("submit_calls", backend.submit_calls),
            Counter::new(
                "mapped_copies",
                backend.mapped,
                Metric::counter(
                    "vhostd_blk_mapped_copies_total",
                    "Reads and writes copied through a mapping of the image, with no system call.",
                ),
            ),
        ];
        Counters { rings: vec![ring], group }
    }
}
