use crate::{BackendStats, FrameBuf, NetBackend, FRAME_ROOM};

/// Fills the guest's RX buffers with generated frames as fast as the guest
/// takes them; guest TX is dropped. The frames are built once: a broadcast
/// Ethernet frame of a local experimental EtherType (0x88B5) with a counter
/// pattern, so they mean nothing to any real network stack.
pub struct Source {
    frames: Vec<FrameBuf>,
    sink: Vec<FrameBuf>,
    stats: BackendStats,
}

impl Source {
    /// A source of `pkt_size`-byte frames (clamped to 14..=FRAME_ROOM) from `mac`.
    pub fn new(pkt_size: usize, mac: [u8; 6], burst: usize) -> Source {
        let len = pkt_size.clamp(14, FRAME_ROOM);
        let frames = (0..burst.max(1))
            .map(|i| {
                let mut f = FrameBuf::new();
                f.storage()[0..6].copy_from_slice(&[0xff; 6]);
                f.storage()[6..12].copy_from_slice(&mac);
                f.storage()[12..14].copy_from_slice(&[0x88, 0xb5]);
                for (j, b) in f.storage()[14..len].iter_mut().enumerate() {
                    *b = (i + j) as u8;
                }
                f.len = len;
                f
            })
            .collect();
        Source { frames, sink: vec![FrameBuf::new()], stats: BackendStats::default() }
    }
}

impl NetBackend for Source {
    fn tx_buffers(&mut self, want: usize) -> &mut [FrameBuf] {
        let n = want.min(self.sink.len());
        &mut self.sink[..n]
    }
    fn tx_commit(&mut self, n: usize) {
        self.stats.tx_frames += n as u64;
    }
    fn rx_frames(&mut self, max: usize) -> &[FrameBuf] {
        let n = max.min(self.frames.len());
        &self.frames[..n]
    }
    fn rx_consume(&mut self, n: usize) {
        self.stats.rx_frames += n as u64;
    }
    fn generates(&self) -> bool {
        true
    }
    fn stats(&self) -> BackendStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn frames_have_requested_size_and_never_run_out() {
        let mut s = Source::new(64, [2, 0, 0, 0, 0, 1], 8);
        for _ in 0..3 {
            let f = s.rx_frames(100);
            assert_eq!(f.len(), 8);
            assert!(f.iter().all(|f| f.len == 64 && f.frame()[12..14] == [0x88, 0xb5]));
            s.rx_consume(8);
        }
        assert_eq!(s.stats().rx_frames, 24);
        assert_eq!(Source::new(1, [0; 6], 1).rx_frames(1)[0].len, 14);
    }
}
