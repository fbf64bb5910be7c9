//! The host's link events: an rtnetlink socket in the RTMGRP_LINK group,
//! readable when an interface's state changes (up/down, carrier, a new or
//! removed interface). The frontends thread watches it in its epoll set
//! (no polling, no timer: an idle host sends nothing) and has each
//! vfio-user connection check its device's link (`VfioConn::link_event`).
//!
//! Made before the seccomp filter is installed (socket and bind are
//! building calls); reading it afterwards needs only recvfrom.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The rtnetlink socket.
pub struct LinkEvents {
    sock: OwnedFd,
}

/// struct nlmsghdr's size, and netlink's alignment.
const NLMSG_HDR: usize = 16;
const NLMSG_ALIGN: usize = 4;

impl LinkEvents {
    /// A non-blocking socket subscribed to the link group.
    pub fn new() -> io::Result<LinkEvents> {
        // SAFETY: socket(2) with constant arguments; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a new socket nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = libc::RTMGRP_LINK as u32;
        // SAFETY: addr is a valid sockaddr_nl of the size given.
        let r = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(LinkEvents { sock })
    }

    /// The descriptor to wait on.
    pub fn fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    /// Reads every message waiting; true if one was about a link (or some
    /// were lost: the socket overran), so links may have changed.
    pub fn drain(&self) -> bool {
        let mut buf = [0u8; 8192];
        let mut links = false;
        loop {
            // SAFETY: buf is writable for its length.
            let n = unsafe { libc::recv(self.fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // Messages were dropped: any of them may have been ours.
                    Some(libc::ENOBUFS) => {
                        links = true;
                        continue;
                    }
                    Some(libc::EAGAIN) => {}
                    _ => tracing::debug!("link events: {e}"),
                }
                return links;
            }
            if n == 0 {
                return links;
            }
            links |= has_link_message(&buf[..n as usize]);
        }
    }
}

/// Whether a datagram of netlink messages holds a link message
/// (RTM_NEWLINK, RTM_DELLINK); anything else is ignored.
fn has_link_message(mut b: &[u8]) -> bool {
    while b.len() >= NLMSG_HDR {
        let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let ty = u16::from_ne_bytes([b[4], b[5]]);
        if ty == libc::RTM_NEWLINK || ty == libc::RTM_DELLINK {
            return true;
        }
        if len < NLMSG_HDR {
            return false;
        }
        let next = len.div_ceil(NLMSG_ALIGN) * NLMSG_ALIGN;
        b = b.get(next..).unwrap_or(&[]);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(ty: u16, payload: usize) -> Vec<u8> {
        let len = (NLMSG_HDR + payload) as u32;
        let mut m = Vec::new();
        m.extend_from_slice(&len.to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.resize(NLMSG_HDR + payload.div_ceil(NLMSG_ALIGN) * NLMSG_ALIGN, 0);
        m
    }

    #[test]
    fn only_link_messages_count() {
        assert!(has_link_message(&msg(libc::RTM_NEWLINK, 32)));
        assert!(has_link_message(&msg(libc::RTM_DELLINK, 0)));
        assert!(!has_link_message(&msg(libc::RTM_NEWADDR, 32)));
        // The second message of a datagram, after an unaligned one.
        let mut two = msg(libc::RTM_NEWROUTE, 5);
        two.extend(msg(libc::RTM_NEWLINK, 8));
        assert!(has_link_message(&two));
        // Truncated or malformed: nothing, and no panic.
        assert!(!has_link_message(&msg(libc::RTM_NEWLINK, 0)[..8]));
        let mut bad = msg(libc::RTM_NEWADDR, 0);
        bad[..4].copy_from_slice(&3u32.to_ne_bytes());
        bad.extend(msg(libc::RTM_NEWLINK, 0));
        assert!(!has_link_message(&bad));
    }

    #[test]
    fn the_socket_opens_unprivileged_and_never_blocks() {
        // (Other tests may be changing links meanwhile: what it reads is
        // not checked here.)
        let l = LinkEvents::new().unwrap();
        let t = std::time::Instant::now();
        let _ = l.drain();
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
    }
}
