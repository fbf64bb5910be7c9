use crate::{BackendStats, FrameBuf, NetBackend};

/// Guest TX frames are copied into host buffers and delivered back to the
/// guest's RX queue. Frames wait at most until the next TX batch: if the
/// guest posted no RX buffers by then, they are dropped and counted.
pub struct Loopback {
    bufs: Vec<FrameBuf>,
    /// Frames waiting for the guest are bufs[head..tail].
    head: usize,
    tail: usize,
    stats: BackendStats,
}

impl Loopback {
    /// A loopback holding up to `cap` frames in flight.
    pub fn new(cap: usize) -> Loopback {
        Loopback {
            bufs: (0..cap.max(1)).map(|_| FrameBuf::new()).collect(),
            head: 0,
            tail: 0,
            stats: BackendStats::default(),
        }
    }
}

impl NetBackend for Loopback {
    fn tx_buffers(&mut self, want: usize) -> &mut [FrameBuf] {
        if self.head < self.tail {
            // The guest had no room for these since the last TX batch.
            self.stats.rx_dropped += (self.tail - self.head) as u64;
        }
        self.head = 0;
        self.tail = 0;
        let n = want.min(self.bufs.len());
        &mut self.bufs[..n]
    }
    fn tx_commit(&mut self, n: usize) {
        self.tail = n.min(self.bufs.len());
        self.stats.tx_frames += self.tail as u64;
    }
    fn rx_frames(&mut self, max: usize) -> &[FrameBuf] {
        let end = self.tail.min(self.head + max);
        &self.bufs[self.head..end]
    }
    fn rx_consume(&mut self, n: usize) {
        let n = n.min(self.tail - self.head);
        self.head += n;
        self.stats.rx_frames += n as u64;
    }
    fn stats(&self) -> BackendStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn frames_come_back_in_order_and_stale_ones_drop() {
        let mut l = Loopback::new(4);
        let b = l.tx_buffers(3);
        for (i, f) in b.iter_mut().enumerate() {
            f.storage()[0] = i as u8;
            f.len = 60;
        }
        l.tx_commit(3);
        assert_eq!(l.rx_frames(2).iter().map(|f| f.frame()[0]).collect::<Vec<_>>(), vec![0, 1]);
        l.rx_consume(2);
        assert_eq!(l.rx_frames(8).len(), 1);
        // Next TX batch: the undelivered frame is dropped.
        l.tx_buffers(1);
        l.tx_commit(0);
        assert!(l.rx_frames(8).is_empty());
        assert_eq!(l.stats(), BackendStats { tx_frames: 3, rx_frames: 2, rx_dropped: 1, tx_dropped: 0 });
    }
}
