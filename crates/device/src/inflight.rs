//! A log of the requests in flight on a split ring, kept in memory the
//! frontend shares and keeps across backend restarts (vhost-user's
//! "Inflight I/O tracking", VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD). A backend
//! that crashes with requests in flight leaves them marked here; the next
//! one resubmits them, so a write the guest was never answered is not lost.
//!
//! Layout of one queue's region (little-endian, packed): u64 features,
//! u16 version, u16 desc_num, u16 last_batch_head, u16 used_idx, then
//! desc_num entries of 16 bytes: u8 inflight, 5 bytes padding, u16 next,
//! u64 counter. The entry of a request is its head descriptor's.
//!
//! The region is shared with the frontend (and any process it hands the
//! fd to), so everything read from it is checked like guest input: heads
//! outside the ring are ignored, list walks are bounded. It is reached
//! through virtq's `Mapping` (bounded volatile loads and stores).

use std::sync::Arc;
use virtq::Mapping;

const HDR: usize = 16;
const ENTRY: usize = 16;
const OFF_VERSION: usize = 8;
const OFF_DESC_NUM: usize = 10;
const OFF_LAST_BATCH: usize = 12;
const OFF_USED_IDX: usize = 14;

/// Bytes one queue's region takes for a ring of `queue_size` (rounded up
/// to 64, as libvhost-user and DPDK lay it out).
pub fn region_size(queue_size: u16) -> usize {
    (HDR + ENTRY * queue_size as usize).div_ceil(64) * 64
}

/// One queue's region.
pub struct InflightLog {
    map: Arc<Mapping>,
    off: usize,
    desc_num: u16,
    counter: u64,
}

impl InflightLog {
    /// The region of queue `index` of rings of `queue_size` in `map`, or
    /// None if it does not fit.
    pub fn new(map: Arc<Mapping>, index: usize, queue_size: u16) -> Option<InflightLog> {
        let off = index.checked_mul(region_size(queue_size))?;
        if off.checked_add(region_size(queue_size))? > map.len() {
            return None;
        }
        Some(InflightLog { map, off, desc_num: queue_size, counter: 0 })
    }

    fn read_u16(&self, off: usize) -> u16 {
        u16::from_le_bytes(self.map.load(self.off + off))
    }

    fn write_u16(&self, off: usize, v: u16) {
        self.map.store(self.off + off, v.to_le_bytes())
    }

    fn entry(&self, head: u16) -> usize {
        HDR + ENTRY * head as usize
    }

    fn inflight(&self, head: u16) -> bool {
        self.map.load::<1>(self.off + self.entry(head))[0] == 1
    }

    fn set_inflight(&self, head: u16, v: bool) {
        self.map.store(self.off + self.entry(head), [v as u8])
    }

    fn counter_of(&self, head: u16) -> u64 {
        u64::from_le_bytes(self.map.load(self.off + self.entry(head) + 8))
    }

    /// A request with head `head` was taken from the avail ring.
    #[inline]
    pub fn start(&mut self, head: u16) {
        if head >= self.desc_num {
            return;
        }
        // The counter comes back from shared memory on recovery: wrap, never overflow.
        self.counter = self.counter.wrapping_add(1);
        self.map.store(self.off + self.entry(head) + 8, self.counter.to_le_bytes());
        self.set_inflight(head, true);
    }

    /// `head` is part of the batch of used entries about to be published.
    #[inline]
    pub fn batch_add(&mut self, head: u16) {
        if head >= self.desc_num {
            return;
        }
        let last = self.read_u16(OFF_LAST_BATCH);
        self.write_u16(self.entry(head) + 6, last);
        self.write_u16(OFF_LAST_BATCH, head);
    }

    /// The batch's used entries are published and used.idx is `used_idx`:
    /// the batch's requests are no longer in flight.
    pub fn batch_done(&mut self, heads: impl Iterator<Item = u16>, used_idx: u16) {
        for h in heads {
            if h < self.desc_num {
                self.set_inflight(h, false);
            }
        }
        self.write_u16(OFF_USED_IDX, used_idx);
    }

    /// At ring start: brings the region up to date with the ring's used.idx
    /// (a crash between publishing a batch and clearing its entries leaves
    /// them marked; the batch list says which), and returns the heads still
    /// in flight, oldest first. A fresh (zeroed) region is initialized.
    pub fn recover(&mut self, used_idx: u16) -> Vec<u16> {
        if self.read_u16(OFF_VERSION) == 0 {
            self.map.fill(self.off, region_size(self.desc_num), 0);
            self.write_u16(OFF_VERSION, 1);
            self.write_u16(OFF_DESC_NUM, self.desc_num);
            self.write_u16(OFF_USED_IDX, used_idx);
            self.counter = 0;
            return Vec::new();
        }
        let logged = self.read_u16(OFF_USED_IDX);
        let mut unlogged = used_idx.wrapping_sub(logged);
        if unlogged > self.desc_num {
            // Not a batch this ring can have had: trust nothing in the list.
            unlogged = 0;
        }
        let mut h = self.read_u16(OFF_LAST_BATCH);
        for _ in 0..unlogged {
            if h >= self.desc_num {
                break;
            }
            self.set_inflight(h, false);
            h = self.read_u16(self.entry(h) + 6);
        }
        self.write_u16(OFF_USED_IDX, used_idx);
        let mut heads: Vec<(u64, u16)> =
            (0..self.desc_num).filter(|&h| self.inflight(h)).map(|h| (self.counter_of(h), h)).collect();
        heads.sort_unstable();
        self.counter = heads.last().map_or(0, |(c, _)| *c);
        heads.into_iter().map(|(_, h)| h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(len: usize) -> Arc<Mapping> {
        Arc::new(Mapping::anonymous(len).unwrap())
    }

    #[test]
    fn layout_sizes() {
        assert_eq!(region_size(128), 2112);
        assert_eq!(region_size(256), 4160);
        let m = map(2 * region_size(128));
        assert!(InflightLog::new(m.clone(), 1, 128).is_some());
        assert!(InflightLog::new(m, 2, 128).is_none());
    }

    #[test]
    fn recovers_in_flight_requests_in_order() {
        let m = map(region_size(8));
        let mut log = InflightLog::new(m.clone(), 0, 8).unwrap();
        assert!(log.recover(5).is_empty(), "fresh region");
        for h in [3, 1, 6, 2] {
            log.start(h);
        }
        // 1 and 6 complete (used.idx 5 -> 7).
        log.batch_add(1);
        log.batch_add(6);
        log.batch_done([1, 6].into_iter(), 7);
        // A new backend on the same memory.
        let mut again = InflightLog::new(m.clone(), 0, 8).unwrap();
        assert_eq!(again.recover(7), vec![3, 2]);
        // A crash after publishing 3 (used.idx 8) but before clearing it.
        again.start(5);
        again.batch_add(3);
        let mut third = InflightLog::new(m, 0, 8).unwrap();
        assert_eq!(third.recover(8), vec![2, 5], "3 was in the published batch");
    }

    #[test]
    fn hostile_region_is_bounded() {
        let m = map(region_size(8));
        let mut log = InflightLog::new(m.clone(), 0, 8).unwrap();
        log.recover(0);
        // A frontend scribbles: last_batch_head and links past the ring, a
        // used_idx far behind.
        m.fill(HDR, 8 * ENTRY, 1);
        m.store(OFF_LAST_BATCH, 0xffffu16.to_le_bytes());
        let heads = log.recover(1000);
        assert_eq!(heads.len(), 8, "every entry marked, none outside the ring");
        assert!(heads.iter().all(|&h| h < 8));
    }
}
