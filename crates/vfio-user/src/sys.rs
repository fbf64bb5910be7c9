//! recvmsg / sendmsg with SCM_RIGHTS over a Unix stream socket.

use std::io::{self, IoSlice};
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Most descriptors one sendmsg can carry on Linux (SCM_MAX_FD). The
/// control buffer holds that many, so the kernel never truncates it and
/// every descriptor that arrives is counted (and then owned and closed).
pub(crate) const MAX_FDS_PER_CALL: usize = 253;

/// Control buffer words: CMSG_SPACE(253 * 4) = 16 + 1016 bytes, in u64s so
/// the buffer is aligned for `cmsghdr`.
const CMSG_WORDS: usize = (16 + (MAX_FDS_PER_CALL * size_of::<RawFd>()).div_ceil(8) * 8) / 8;

/// What one `recv_with_fds` returned.
pub(crate) struct Received {
    /// Bytes read; 0 means the peer closed its end.
    pub bytes: usize,
    /// The kernel truncated the control data (descriptors were lost; the
    /// kernel closed them).
    pub ctrunc: bool,
}

/// Reads into `buf`, appending the descriptors that came with the bytes to
/// `fds` (owned from here on, close-on-exec). Blocks or not as the socket
/// does; EINTR is retried.
pub(crate) fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<Received> {
    let mut cbuf = [0u64; CMSG_WORDS];
    loop {
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        // SAFETY: msghdr is a plain C struct for which all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = size_of::<[u64; CMSG_WORDS]>() as _;
        // SAFETY: msg points at one iovec over `buf` and at `cbuf`, both
        // alive and writable for the call, with their true lengths.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: msg was filled by a successful recvmsg; the CMSG_* walk
        // stays inside msg_control / msg_controllen as the kernel set them.
        let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        while !cmsg.is_null() {
            // SAFETY: cmsg is non-null and points inside cbuf (CMSG_FIRSTHDR
            // / CMSG_NXTHDR check it against msg_controllen).
            let hdr = unsafe { &*cmsg };
            if hdr.cmsg_level == libc::SOL_SOCKET && hdr.cmsg_type == libc::SCM_RIGHTS {
                // SAFETY: CMSG_LEN is arithmetic only.
                let base = unsafe { libc::CMSG_LEN(0) } as usize;
                let len = (hdr.cmsg_len as usize).saturating_sub(base);
                let count = len / size_of::<RawFd>();
                // SAFETY: CMSG_DATA points just past this cmsghdr, inside
                // cbuf; the kernel wrote `count` descriptors there.
                let data = unsafe { libc::CMSG_DATA(cmsg) } as *const RawFd;
                for i in 0..count {
                    // SAFETY: i < count, inside the data the kernel wrote;
                    // the buffer may be unaligned for RawFd, so read_unaligned.
                    let fd = unsafe { data.add(i).read_unaligned() };
                    // SAFETY: SCM_RIGHTS just installed `fd` in this process
                    // for us; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
            // SAFETY: as for CMSG_FIRSTHDR above.
            cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
        }
        return Ok(Received { bytes: n as usize, ctrunc: msg.msg_flags & libc::MSG_CTRUNC != 0 });
    }
}

/// Writes `bufs` with `fds` attached (none if empty), without SIGPIPE.
/// Returns the bytes written (possibly short). Blocks or not as the socket
/// does; EINTR is retried.
pub(crate) fn send_with_fds(sock: BorrowedFd<'_>, bufs: &[IoSlice<'_>], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    if fds.len() > MAX_FDS_PER_CALL {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut cbuf = [0u64; CMSG_WORDS];
    loop {
        // SAFETY: msghdr is a plain C struct for which all-zero is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is ABI-compatible with iovec; sendmsg only reads them.
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = bufs.len() as _;
        if !fds.is_empty() {
            let data_len = (fds.len() * size_of::<RawFd>()) as u32;
            msg.msg_control = cbuf.as_mut_ptr().cast();
            // SAFETY: CMSG_SPACE is arithmetic only.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(data_len) } as _;
            // SAFETY: msg_control / msg_controllen describe cbuf, large
            // enough for MAX_FDS_PER_CALL descriptors, so the first header
            // and its data lie inside it.
            unsafe {
                let cmsg = libc::CMSG_FIRSTHDR(&msg);
                (*cmsg).cmsg_level = libc::SOL_SOCKET;
                (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as _;
                let data = libc::CMSG_DATA(cmsg) as *mut RawFd;
                for (i, fd) in fds.iter().enumerate() {
                    data.add(i).write_unaligned(fd.as_raw_fd());
                }
            }
        }
        // SAFETY: msg describes live buffers (bufs, cbuf) of their true
        // lengths; sendmsg does not write to them.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(n as usize);
    }
}
