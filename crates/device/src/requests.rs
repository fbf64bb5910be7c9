//! What a device whose requests complete in any order (blk, scsi) does
//! around its own parsing of them: pop chains, keep the vhost-user
//! inflight log of what is in flight, give used entries back one by one
//! and publish them once per pass, and, when a ring starts on a log a
//! previous backend left, pop again what it never answered.

use virtq::{Access, Batch, GuestBufs, Queue};

use crate::InflightLog;

/// Most chains one `pop` takes. A pass starts at most this many new
/// requests, then completes and publishes whatever has finished; the next
/// pass takes more. (Recovering a previous backend's requests in flight
/// still takes them all at once.)
///
/// Why: the driver overlaps with the device only once it sees used
/// entries. A device that took a whole queue depth at once answered
/// nothing until it had parsed all of it, while the driver, having
/// published its whole depth, waited; the two CPUs took turns. In 16s the
/// driver resubmits the first 16 while the device works on the next.
/// vhostd-user busy-polling, null backend, poll mode, Zen 4: 1.8-2.1x the
/// IOPS at queue depth 32 (blk and scsi), 1.3-1.7x at 128, at 0.95-1.08x
/// the busy cycles an I/O; 8 a pass was slower (more passes, each
/// publishing), and so was 32 at depth 128 for scsi. On io_uring each
/// pass submits on its own, a few percent more cycles a request from the
/// page cache. BENCHMARKS.md has the runs.
pub const MAX_POP: usize = 16;

/// A request ring's bookkeeping beside the device's own request slots.
#[derive(Default)]
pub struct RequestRing {
    /// The shared log of requests in flight (split rings, when the
    /// frontend gave one).
    log: Option<InflightLog>,
    /// Heads completed since the last publish (for the log).
    heads: Vec<u16>,
}

impl RequestRing {
    /// Bookkeeping for up to `depth` requests in flight.
    pub fn new(depth: usize) -> RequestRing {
        RequestRing { log: None, heads: Vec::with_capacity(depth) }
    }

    /// Pops up to `room` chains (at most `MAX_POP`) into `batch`, each
    /// logged as in flight.
    /// Chains the ring rejected already have a used entry (length 0): they
    /// are published now, or an otherwise idle driver would wait for ever.
    /// Returns (chains popped, chains rejected).
    #[inline]
    pub fn pop(&mut self, q: &mut Queue, batch: &mut Batch, room: usize) -> (usize, usize) {
        let bad_before = q.stats().bad_chains;
        let n = q.pop_batch(batch, room.min(MAX_POP), Access::ReadThenWrite);
        let rejected = (q.stats().bad_chains - bad_before) as usize;
        if rejected > 0 {
            q.publish_used();
            // The log's used_idx follows used.idx (these were never in flight).
            if let (Some(log), Queue::Split(sq)) = (&mut self.log, &*q) {
                log.batch_done(std::iter::empty(), sq.next_used());
            }
        }
        if let Some(log) = &mut self.log {
            for c in &batch.chains {
                log.start(c.head);
            }
        }
        (n, rejected)
    }

    /// A finished request's used entry (published by `publish`).
    #[inline]
    pub fn complete(&mut self, q: &mut Queue, head: u16, len: u32) {
        q.add_used_id(head, len);
        if let Some(log) = &mut self.log {
            log.batch_add(head);
            self.heads.push(head);
        }
    }

    /// Publishes the used entries `complete` added (one store), then the
    /// log's record of them.
    #[inline]
    pub fn publish(&mut self, q: &mut Queue) {
        q.publish_used();
        if let (Some(log), Queue::Split(sq)) = (&mut self.log, &*q) {
            log.batch_done(self.heads.drain(..), sq.next_used());
        }
        self.heads.clear();
    }

    /// Starts logging in `log` (a ring just attached; split layout only:
    /// the packed layout of the log is not implemented, so nothing is
    /// tracked there). The requests a previous backend left in flight
    /// are popped again, up to `room`, and handed to `start`; the ring
    /// resumes after every chain taken so far (used entries + those in
    /// flight). Returns the requests handed to `start`.
    pub fn recover(
        &mut self,
        mut log: InflightLog,
        q: &mut Queue,
        batch: &mut Batch,
        room: usize,
        mut start: impl FnMut(u16, GuestBufs<'_>, GuestBufs<'_>),
    ) -> usize {
        let Queue::Split(sq) = q else { return 0 };
        let used = sq.used_idx_in_memory();
        let heads = log.recover(used);
        sq.set_next_avail(used.wrapping_add(heads.len() as u16));
        let mut n = 0;
        let mut rejected = Vec::new();
        for h in heads {
            if n == room {
                break;
            }
            batch.clear();
            if !sq.repop(h, batch, Access::ReadThenWrite) {
                // Completed with length 0 by the ring: published below.
                rejected.push(h);
                continue;
            }
            log.start(h);
            let chain = batch.chains[0];
            start(chain.head, batch.readable(&chain), batch.writable(&chain));
            n += 1;
        }
        if !rejected.is_empty() {
            q.publish_used();
            if let Queue::Split(sq) = &*q {
                log.batch_done(rejected.into_iter(), sq.next_used());
            }
        }
        self.log = Some(log);
        n
    }

    /// Stops logging (the ring is handed back).
    pub fn detach(&mut self) {
        self.log = None;
    }
}
