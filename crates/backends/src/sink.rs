use crate::{BackendStats, FrameBuf, NetBackend};

/// Copies each guest frame into a host buffer, counts it and drops it.
pub struct Sink {
    bufs: Vec<FrameBuf>,
    stats: BackendStats,
}

impl Sink {
    /// A sink taking up to `burst` frames per call.
    pub fn new(burst: usize) -> Sink {
        Sink { bufs: (0..burst.max(1)).map(|_| FrameBuf::new()).collect(), stats: BackendStats::default() }
    }
}

impl NetBackend for Sink {
    fn tx_buffers(&mut self, want: usize) -> &mut [FrameBuf] {
        let n = want.min(self.bufs.len());
        &mut self.bufs[..n]
    }
    fn tx_commit(&mut self, n: usize) {
        self.stats.tx_frames += n as u64;
    }
    fn rx_frames(&mut self, _max: usize) -> &[FrameBuf] {
        &[]
    }
    fn rx_consume(&mut self, _n: usize) {}
    fn stats(&self) -> BackendStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn counts_and_never_returns_frames() {
        let mut s = Sink::new(4);
        assert_eq!(s.tx_buffers(10).len(), 4);
        s.tx_commit(3);
        assert!(s.rx_frames(8).is_empty());
        assert_eq!(s.stats().tx_frames, 3);
    }
}
