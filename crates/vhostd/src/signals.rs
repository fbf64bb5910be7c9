//! The signals vhostd acts on, read from a signalfd by the main loop.

use std::io;
use std::os::unix::io::{AsRawFd, RawFd};

/// SIGINT, SIGTERM (stop) and SIGUSR1 (print counters) as a readable fd;
/// blocked for every thread spawned after.
pub struct Signals(RawFd);

impl Signals {
    /// Blocks the three signals in this thread (and the ones it starts
    /// after) and opens a signalfd for them.
    pub fn new() -> io::Result<Signals> {
        // SAFETY: plain libc calls on a local sigset; the fd is checked.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::sigaddset(&mut set, libc::SIGUSR1);
            if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
            let fd = libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK);
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(Signals(fd))
        }
    }
}

/// What a pending signal asks for.
pub enum SignalAsk {
    /// SIGINT or SIGTERM: stop.
    Stop,
    /// SIGUSR1: print the counters.
    PrintStats,
    /// Nothing was pending.
    Nothing,
}

impl Signals {
    /// Takes one pending signal.
    pub fn take(&self) -> SignalAsk {
        // SAFETY: signalfd_siginfo is plain data; all zeroes is a valid value.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        // SAFETY: read fills at most the size of `info`, a local.
        let n = unsafe {
            libc::read(self.0, &mut info as *mut _ as *mut libc::c_void, std::mem::size_of::<libc::signalfd_siginfo>())
        };
        if n != std::mem::size_of::<libc::signalfd_siginfo>() as isize {
            return SignalAsk::Nothing;
        }
        match info.ssi_signo as i32 {
            libc::SIGUSR1 => SignalAsk::PrintStats,
            _ => SignalAsk::Stop,
        }
    }
}

impl AsRawFd for Signals {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        // SAFETY: we own the fd.
        unsafe { libc::close(self.0) };
    }
}
