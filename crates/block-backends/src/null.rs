//! The null backend: every request succeeds at once.

use crate::{BlockBackend, BlockStats, Completion, Request};

/// Completes every request at the next `reap` without touching data.
pub struct NullBackend {
    depth: usize,
    done: Vec<Completion>,
    stats: BlockStats,
}

impl NullBackend {
    /// A backend with at most `depth` requests in flight.
    pub fn new(depth: usize) -> NullBackend {
        NullBackend { depth, done: Vec::with_capacity(depth), stats: BlockStats::default() }
    }
}

impl BlockBackend for NullBackend {
    fn room(&self) -> usize {
        self.depth - self.done.len()
    }
    fn queue(&mut self, req: &Request<'_>) -> Result<(), i64> {
        if self.done.len() >= self.depth {
            return Err(crate::NO_ROOM);
        }
        let bytes = match req.op {
            crate::Op::Read | crate::Op::Write => req.bufs.data_len() as i64,
            _ => 0,
        };
        self.done.push(Completion { tag: req.tag, result: bytes });
        self.stats.submitted += 1;
        Ok(())
    }
    fn submit(&mut self) {}
    fn reap(&mut self, out: &mut Vec<Completion>) {
        self.stats.completed += self.done.len() as u64;
        out.append(&mut self.done);
    }
    fn wait(&mut self) {}
    fn in_flight(&self) -> usize {
        self.done.len()
    }
    fn stats(&self) -> BlockStats {
        self.stats
    }
}
