//! An interface's link state by name (SIOCGIFFLAGS), and the struct ifreq
//! the TAP ioctls share.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// struct ifreq, as far as TUNSETIFF / TUNGETIFF / SIOCGIFFLAGS use it.
#[repr(C)]
pub(crate) struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    pub(crate) flags: libc::c_short,
    _pad: [u8; 22],
}

impl IfReq {
    pub(crate) fn new(name: &str, flags: libc::c_int) -> IfReq {
        let mut r = IfReq { name: [0; libc::IFNAMSIZ], flags: flags as libc::c_short, _pad: [0; 22] };
        for (d, s) in r.name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
            *d = s as libc::c_char;
        }
        r
    }

    pub(crate) fn name(&self) -> String {
        // SAFETY: name is NUL-terminated: the kernel writes at most
        // IFNAMSIZ-1 characters, and new() leaves the last byte 0.
        unsafe { CStr::from_ptr(self.name.as_ptr()) }.to_string_lossy().into_owned()
    }
}

pub(crate) fn ioctl_ifreq(fd: RawFd, req: libc::Ioctl, ifr: &mut IfReq) -> io::Result<()> {
    // SAFETY: ifr is a valid, writable ifreq-sized buffer for the call.
    if unsafe { libc::ioctl(fd, req, ifr as *mut IfReq) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Watches whether an interface in our network namespace is up.
pub struct Link {
    sock: OwnedFd,
    name: String,
}

impl Link {
    /// A watch on interface `name`.
    pub fn new(name: &str) -> io::Result<Link> {
        // SAFETY: socket() with constant arguments; the result is checked.
        let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if s < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: s was just created and is owned by nothing else.
        Ok(Link { sock: unsafe { OwnedFd::from_raw_fd(s) }, name: name.to_string() })
    }

    /// Administratively up and with carrier (IFF_UP and IFF_RUNNING).
    pub fn up(&self) -> bool {
        let mut ifr = IfReq::new(&self.name, 0);
        match ioctl_ifreq(self.sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) {
            Ok(()) => {
                let f = ifr.flags as libc::c_int;
                f & libc::IFF_UP != 0 && f & libc::IFF_RUNNING != 0
            }
            Err(_) => false,
        }
    }

    /// The interface watched.
    pub fn name(&self) -> &str {
        &self.name
    }
}
