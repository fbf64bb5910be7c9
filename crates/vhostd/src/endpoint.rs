//! Where devices meet their frontends: Unix sockets vhostd listens on (and
//! removes on exit), sockets it connects to, and sockets handed in (--fd);
//! and waiting on descriptors.

use std::io;
use std::os::unix::io::{FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use crate::spec::EndpointSpec;

/// Removes the socket file when dropped (also on error paths).
pub struct SocketFile(pub PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl SocketFile {
    /// Removes `path` when dropped.
    pub fn new(path: PathBuf) -> SocketFile {
        SocketFile(path)
    }
}

/// Binds the socket; a stale socket file (nobody listening) is replaced,
/// a live one is an error.
fn bind(path: &Path) -> io::Result<UnixListener> {
    bind_as(path, "--socket-path")
}

/// `bind` for the option `what` (named in errors).
pub fn bind_as(path: &Path, what: &str) -> io::Result<UnixListener> {
    match UnixListener::bind(path) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("{what} {}: another process is listening there", path.display()),
                ));
            }
            std::fs::remove_file(path)?;
            UnixListener::bind(path).map_err(|e| io::Error::new(e.kind(), format!("{what} {}: {e}", path.display())))
        }
        Err(e) => Err(io::Error::new(e.kind(), format!("{what} {}: {e}", path.display()))),
    }
}

/// Where a device meets its frontend.
pub enum Endpoint {
    /// A listening socket (and its file, removed when this goes).
    Listen(UnixListener, SocketFile),
    /// An already-connected socket (--fd).
    Conn(UnixStream),
    /// A socket to connect to, again after each disconnect (--client).
    Client(PathBuf),
}

/// The endpoint `spec` names: a listening socket (bound; a stale socket
/// file is replaced), a path to connect to, or the connected socket handed
/// in (checked: an open Unix stream socket).
pub fn open(spec: &EndpointSpec) -> io::Result<Endpoint> {
    match spec {
        EndpointSpec::Connect(p) => Ok(Endpoint::Client(p.clone())),
        EndpointSpec::Listen(p) => Ok(Endpoint::Listen(bind(p)?, SocketFile(p.clone()))),
        &EndpointSpec::Fd(fd) => {
            let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("--fd {fd}: {what}"));
            let (mut ty, mut domain) = (0i32, 0i32);
            let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
            // SAFETY: getsockopt writes at most `len` bytes into a local i32.
            let r = unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_TYPE,
                    &mut ty as *mut i32 as *mut libc::c_void,
                    &mut len,
                )
            };
            if r != 0 {
                return Err(bad(&format!("not an open socket ({})", io::Error::last_os_error())));
            }
            let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
            // SAFETY: as above.
            unsafe {
                libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_DOMAIN,
                    &mut domain as *mut i32 as *mut libc::c_void,
                    &mut len,
                )
            };
            if ty != libc::SOCK_STREAM || domain != libc::AF_UNIX {
                return Err(bad("not a Unix stream socket"));
            }
            // SAFETY: fd is an open socket we were handed to own (checked above).
            let conn = unsafe { UnixStream::from_raw_fd(fd) };
            // Not inherited by anything we might run.
            // SAFETY: fcntl on an fd we own.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            Ok(Endpoint::Conn(conn))
        }
    }
}

/// `wait_readable` for at most `ms` milliseconds: None when none became readable.
pub fn wait_readable_timeout(fds: &[RawFd], ms: i32) -> io::Result<Option<usize>> {
    let mut pfds: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: pfds is a valid array of pollfd of the given length.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted { Ok(None) } else { Err(e) };
    }
    Ok(pfds.iter().position(|p| p.revents != 0))
}

/// Waits until one of `fds` is readable (or hung up); returns its position.
pub fn wait_readable(fds: &[RawFd]) -> io::Result<usize> {
    let mut pfds: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    loop {
        // SAFETY: pfds is a valid array of pollfd of the given length.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if let Some(i) = pfds.iter().position(|p| p.revents != 0) {
            return Ok(i);
        }
    }
}
