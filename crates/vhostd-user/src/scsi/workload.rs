//! The blk workload engine (`crate::blk::workload`) over scsi request
//! queues: reads and writes are READ(16) and WRITE(16) of whole blocks of
//! the unit each queue addresses (`ScsiQueue::set_lun`), the verify flush
//! is SYNCHRONIZE CACHE(10) of the whole unit.

use super::{response, status, Cmd, Data, ScsiCompletion, ScsiQueue};
use crate::blk::workload::{run_queues, IoCompletion, IoQueue, Report, Workload};
use crate::queue::VirtQueue;
use crate::Error;
use std::sync::atomic::AtomicBool;
use std::time::Duration;
use virtq_driver::{SharedBytes, SharedBytesMut};

pub use crate::blk::workload::{
    check_pattern, check_pattern_shared, fill_pattern, fill_pattern_shared, Histogram, Mode,
};

/// Runs `w` over `queues` (each addressing the unit `set_lun` chose, whose
/// block size `set_disk` or `probe_disk` gave) of a unit of `cap_bytes`
/// bytes. `stop` ends it early, letting commands in flight finish.
/// Command errors and mismatches are in the report; a broken ring, a
/// stalled device or bad parameters are errors.
pub fn run(queues: &mut [ScsiQueue], cap_bytes: u64, w: &Workload, stop: Option<&AtomicBool>) -> Result<Report, Error> {
    if let Some(q) = queues.iter().find(|q| !w.bs.is_multiple_of(q.block_size())) {
        return Err(Error::Config(format!(
            "bs {} is not a multiple of the unit's {}-byte blocks",
            w.bs,
            q.block_size()
        )));
    }
    run_queues(queues, cap_bytes, w, stop)
}

/// `IoQueue::sync_cache`'s status: the SCSI status when the response is
/// OK, else 0x80 | the response.
fn flush_status(c: &ScsiCompletion) -> u8 {
    if c.resp.response == response::OK {
        c.resp.status
    } else {
        0x80 | c.resp.response
    }
}

#[cold]
#[inline(never)]
fn residual_problem(opcode: u8, id: u64, residual: u32, data: Data) -> String {
    format!("command {opcode:#04x} (tag {id}): residual {residual} of {data:?}")
}

impl IoCompletion for ScsiCompletion {
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
        if let Some(p) = ScsiCompletion::problem(self) {
            return Some(p);
        }
        // A READ or WRITE moves its whole buffer.
        if self.resp.residual == 0 {
            return None;
        }
        // Copies, not references: see `ScsiCompletion::problem`.
        Some(residual_problem(self.opcode, self.id, self.resp.residual, self.data))
    }
    #[inline]
    fn read_ok(&self) -> bool {
        matches!(self.data, Data::In(_)) && self.resp.response == response::OK && self.resp.status == status::GOOD
    }
}

impl IoQueue for ScsiQueue {
    type Completion = ScsiCompletion;
    const KIND: &'static str = "scsi";
    fn virtqueue(&mut self) -> &mut VirtQueue {
        &mut self.queue
    }
    fn depth(&self) -> u16 {
        ScsiQueue::depth(self)
    }
    fn max_data(&self) -> u32 {
        ScsiQueue::max_data(self)
    }
    #[inline]
    fn in_flight(&self) -> u16 {
        ScsiQueue::in_flight(self)
    }
    fn reordered(&self) -> u64 {
        ScsiQueue::reordered(self)
    }
    fn read_only(&self) -> bool {
        self.read_only
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
        let bs = self.block_size;
        // Shifts for the usual power-of-two block size: a 64-bit divide
        // costs tens of cycles, per command.
        let (lba, blocks) = if bs.is_power_of_two() {
            (offset >> bs.trailing_zeros(), len >> bs.trailing_zeros())
        } else {
            (offset / bs as u64, len / bs)
        };
        // As Linux's sd does: the 10-byte commands while they can say it
        // (some targets, vhost-device-scsi among them, take no READ(16)).
        let cmd = match (u32::try_from(lba), u16::try_from(blocks)) {
            (Ok(l), Ok(b)) => return self.submit_rw10(write, l, b, user, fill),
            _ if write => Cmd::write_16(lba, blocks, bs),
            _ => Cmd::read_16(lba, blocks, bs),
        };
        self.submit(&cmd, user, fill)
    }
    #[inline]
    fn post(&mut self) -> Result<bool, Error> {
        self.flush()
    }
    #[inline]
    fn poll_io(&mut self, f: impl FnMut(&ScsiCompletion, SharedBytes)) -> Result<usize, Error> {
        self.poll(f)
    }
    fn sync_cache(&mut self, timeout: Duration) -> Result<Option<(u8, ScsiCompletion)>, Error> {
        let r = self.request(Cmd::synchronize_cache_10(0, 0), &[], timeout)?;
        Ok(Some((flush_status(&r.completion), r.completion)))
    }
    fn status_name(s: u8) -> String {
        match s {
            status::GOOD => "ok".into(),
            0xff => "unwritten".into(),
            s if s & 0x80 != 0 => super::response_name(s & 0x7f),
            s => super::status_name(s),
        }
    }
}
