//! One virtqueue as the frontend sees it: the driver-side ring plus its
//! kick and call eventfds.

use crate::Error;
use std::io;
use std::os::unix::io::AsRawFd;
use std::time::Duration;
use virtq_driver::DriverRing;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// How a queue tells the device it has work, when that is not its kick
/// eventfd (vhost-user's): vfio-user writes a doorbell register, by a
/// store into a mapped page or by a REGION_WRITE message.
pub trait Notifier: Send {
    /// Rings the doorbell once.
    fn notify(&mut self) -> Result<(), Error>;
}

/// A virtqueue: ring, kick eventfd (we write, the backend waits) and call
/// eventfd (the backend writes, we wait).
pub struct VirtQueue {
    index: usize,
    /// The driver side of the ring; its raw accessors let tests write
    /// arbitrary descriptors and indexes.
    pub ring: DriverRing,
    kick: EventFd,
    /// Rings the doorbell instead of `kick` when set.
    notifier: Option<Box<dyn Notifier>>,
    call: EventFd,
    /// Kicks actually sent.
    pub kicks_sent: u64,
}

impl VirtQueue {
    /// Wraps `ring` as queue `index` with fresh non-blocking eventfds.
    pub fn new(index: usize, ring: DriverRing) -> Result<VirtQueue, Error> {
        Ok(VirtQueue {
            index,
            ring,
            kick: EventFd::new(EFD_NONBLOCK).map_err(Error::Io)?,
            notifier: None,
            call: EventFd::new(EFD_NONBLOCK).map_err(Error::Io)?,
            kicks_sent: 0,
        })
    }

    /// The vhost-user queue index.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The kick eventfd.
    pub fn kick_fd(&self) -> &EventFd {
        &self.kick
    }

    /// The call eventfd.
    pub fn call_fd(&self) -> &EventFd {
        &self.call
    }

    /// Kicks through `n` from now on instead of the kick eventfd (the
    /// transport's doorbell).
    pub fn set_notifier(&mut self, n: Box<dyn Notifier>) {
        self.notifier = Some(n);
    }

    /// Kicks the backend unconditionally.
    pub fn kick(&mut self) -> Result<(), Error> {
        self.kicks_sent += 1;
        match &mut self.notifier {
            Some(n) => n.notify(),
            None => self.kick.write(1).map_err(Error::Io),
        }
    }

    /// Publishes avail.idx and kicks if the backend's suppression state asks
    /// for it. Returns whether it kicked.
    #[inline]
    pub fn publish_and_kick(&mut self) -> Result<bool, Error> {
        if self.ring.publish_and_check_kick() {
            self.kick()?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Consumes pending calls without waiting; returns how many were counted.
    pub fn take_calls(&self) -> u64 {
        self.call.read().unwrap_or(0)
    }

    /// Waits up to `timeout` for a call. Returns true if one came (and
    /// consumes it).
    pub fn wait_call(&self, timeout: Duration) -> Result<bool, Error> {
        let mut p = libc::pollfd { fd: self.call.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(Error::Io(e));
        }
        Ok(r > 0 && self.take_calls() > 0)
    }
}
