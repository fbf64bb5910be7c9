//! One vhost-user connection, served until it ends: the `vhost` crate's
//! request handler does the protocol, in front of it a shim answers what
//! the crate does not (or not the way frontends need), and refusals that
//! would leave a frontend waiting close the connection instead.
//!
//! The shim peeks at each message header (MSG_PEEK: nothing is consumed
//! unless the shim answers) and looks the request up in `OWN`, a table on
//! the crate's own request codes.

use std::io::{self, Read, Write};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::{FrontendReq, VhostUserHeaderFlag};
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

use crate::endpoint::wait_readable;
use crate::session::{Served, Session};

/// A request the shim answers, given the connection, the session, the
/// header flags and the message peeked (header and as much of the payload
/// as had arrived), of `len` bytes in all. Returns true if it answered (and
/// consumed) the message, false to leave it to the `vhost` crate.
type Own = fn(&UnixStream, &Mutex<Session>, u32, &[u8], usize) -> io::Result<bool>;

/// Requests the shim answers: the request, its payload size, its handler.
///
/// - SET_STATUS / GET_STATUS: the crate does not know them.
/// - SET_VRING_ENABLE: the crate refuses it before SET_FEATURES, and QEMU
///   sends it that early.
/// - SET_VRING_ADDR with misaligned addresses (a guest chooses them; QEMU
///   passes them on): the crate fails it as a malformed message and the
///   connection would close; it is refused with an error reply instead.
/// - SEND_RARP: the crate does not know it.
const OWN: &[(FrontendReq, u32, Own)] = &[
    (FrontendReq::SET_STATUS, 8, set_status),
    (FrontendReq::GET_STATUS, 0, get_status),
    (FrontendReq::SET_VRING_ENABLE, 8, set_vring_enable),
    (FrontendReq::SET_VRING_ADDR, 40, set_vring_addr_misaligned),
    (FrontendReq::SEND_RARP, 8, send_rarp),
];

/// Requests whose answer carries a payload (the `vhost` crate replies only
/// when the handler succeeds).
const REPLYING: &[FrontendReq] = &[
    FrontendReq::GET_FEATURES,
    FrontendReq::GET_VRING_BASE,
    FrontendReq::GET_PROTOCOL_FEATURES,
    FrontendReq::GET_QUEUE_NUM,
    FrontendReq::GET_CONFIG,
    FrontendReq::GET_INFLIGHT_FD,
    FrontendReq::GET_MAX_MEM_SLOTS,
    FrontendReq::GET_STATUS,
    // Answered with its own reply once the log is mapped (LOG_SHMFD).
    FrontendReq::SET_LOG_BASE,
];

const HEADER: usize = 12;
/// The header's version field (bits 0-1) and the only version there is.
const VERSION_MASK: u32 = 0x3;
const VERSION: u32 = 0x1;
const REPLY: u32 = VhostUserHeaderFlag::REPLY.bits();
const NEED_REPLY: u32 = VhostUserHeaderFlag::NEED_REPLY.bits();
/// Most descriptors one message may carry (the `vhost` crate's limit).
const MAX_FDS: usize = 32;
/// The longest message the shim answers (SET_VRING_ADDR).
const LONGEST: usize = HEADER + 40;

/// The most messages answered in one go: a frontend flooding its socket
/// must let the other devices' frontends be served in between.
const BURST: usize = 64;

/// Bytes of replies a frontend may leave unread before its connection is
/// closed. vhost-user is request and reply: a frontend reads each reply
/// before the next request wanting one, so more than a few unread is a
/// frontend that never reads. Checked before each message, so a reply
/// never waits for room: the `vhost` crate retries a full socket forever,
/// which would hold the thread serving every device's frontend.
const MAX_UNREAD: libc::c_int = 64 * 1024;

/// One vhost-user connection being served: answered a message at a time,
/// only once a whole message has arrived, so a frontend that stops
/// mid-message holds nothing but its own connection.
pub struct Conn {
    stream: UnixStream,
    session: Arc<Mutex<Session>>,
    handler: BackendReqHandler<Mutex<Session>>,
    refused: u64,
}

/// What serving a connection's waiting messages came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing whole is waiting: wait for more bytes.
    Wait,
    /// More whole messages may be waiting (a burst was answered).
    More,
    /// The connection is over (closed, or closed by us).
    End,
    /// The next message may wait on the backend (`serve_ready` with
    /// `hold_slow`): left unanswered, for a thread that may wait.
    Slow,
}

/// Requests that never stop a ring: answered at once whatever runs.
const NEVER_STOP: &[FrontendReq] = &[
    FrontendReq::GET_FEATURES,
    FrontendReq::GET_PROTOCOL_FEATURES,
    FrontendReq::SET_PROTOCOL_FEATURES,
    FrontendReq::GET_QUEUE_NUM,
    FrontendReq::GET_CONFIG,
    FrontendReq::SET_CONFIG,
    FrontendReq::GET_MAX_MEM_SLOTS,
    FrontendReq::GET_STATUS,
    FrontendReq::SET_OWNER,
    FrontendReq::SEND_RARP,
];

/// The next message in the socket, as far as it has arrived.
enum Next {
    Empty,
    /// Part of a header, or a whole header and none of its payload yet.
    Partial,
    /// A whole header and part of its payload: frontends send a message
    /// in one piece, so the rest is not coming (the `vhost` crate's short
    /// read refused it too).
    Short,
    /// A whole message, of this request code.
    Whole(u32),
    Closed,
}

impl Conn {
    /// A new connection to `dev` over `stream`.
    pub fn new(stream: UnixStream, dev: &Arc<Served>) -> io::Result<Conn> {
        let session = Arc::new(Mutex::new(Session::new(dev.clone())));
        let handler = BackendReqHandler::from_stream(stream.try_clone()?, session.clone());
        Ok(Conn { stream, session, handler, refused: 0 })
    }

    /// Its socket.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Whether ending the connection now may wait on the backend (see
    /// `Session::may_wait_on_backend`; also after a panic in the session).
    pub fn finish_may_wait(&self) -> bool {
        self.session.lock().unwrap_or_else(|e| e.into_inner()).may_wait_on_backend()
    }

    /// Answers the whole messages waiting, at most `BURST`; `hup`: the
    /// frontend hung up (what it sent whole is still answered).
    /// `hold_slow`: stop before a message that may wait on the backend
    /// (`Step::Slow`). (Ending the connection may wait too: the caller
    /// asks `finish_may_wait`.)
    pub fn serve_ready(&mut self, hup: bool, hold_slow: bool) -> Step {
        for _ in 0..BURST {
            match next(&self.stream) {
                Next::Closed => {
                    tracing::info!("frontend disconnected");
                    return Step::End;
                }
                Next::Empty | Next::Partial if hup => {
                    tracing::info!("frontend disconnected");
                    return Step::End;
                }
                Next::Empty | Next::Partial => return Step::Wait,
                Next::Short => {
                    tracing::warn!("closing frontend connection: a message shorter than its header says");
                    return Step::End;
                }
                Next::Whole(req) => {
                    if hold_slow && self.may_wait_on(req) {
                        return Step::Slow;
                    }
                    if unread(&self.stream) > MAX_UNREAD {
                        tracing::warn!("closing frontend connection: it does not read vhostd's replies");
                        return Step::End;
                    }
                    if !self.one() {
                        return Step::End;
                    }
                }
            }
        }
        Step::More
    }

    /// Whether request `req` may wait on the backend: a ring that can wait
    /// to stop runs, and `req` is one that can stop a ring.
    fn may_wait_on(&self, req: u32) -> bool {
        self.finish_may_wait() && !NEVER_STOP.iter().any(|r| *r as u32 == req)
    }

    /// Answers one whole message; false: the connection is over.
    fn one(&mut self) -> bool {
        let conn = &self.stream;
        if too_many_fds(conn) {
            // The `vhost` crate would drop them and lose the message's
            // framing (it retries after the header is consumed).
            tracing::warn!("closing frontend connection: a message with more file descriptors than any request takes");
            return false;
        }
        match answer_own(conn, &self.session) {
            Ok(true) => return true,
            Ok(false) => {}
            Err(e) => {
                tracing::info!("frontend connection ended: {e}");
                return false;
            }
        }
        // Which request this is (for deciding whether a refusal was answered).
        let (req, flags) = peek(conn, &mut [0u8; HEADER]).map(|h| (h.0, h.1)).unwrap_or((0, 0));
        match self.handler.handle_request() {
            Ok(()) => true,
            Err(VuError::Disconnected) | Err(VuError::PartialMessage) => {
                tracing::info!("frontend disconnected");
                false
            }
            Err(e) if is_fatal(&e) => {
                tracing::warn!("closing frontend connection: {e}");
                false
            }
            Err(e) if refusal_unanswered(&e, req, flags, &self.session) => {
                // The frontend waits for a reply the `vhost` crate did not
                // send (a GET_* refused, or a check failed before the ack):
                // closing is the only answer left that does not hang it.
                tracing::warn!("closing frontend connection: request {req} refused without a reply: {e}");
                false
            }
            Err(e) => {
                // Refused requests are the frontend's doing: rate-limit the log.
                self.refused += 1;
                if self.refused <= 10 || self.refused.is_power_of_two() {
                    tracing::warn!(count = self.refused, "request failed: {e}");
                }
                true
            }
        }
    }

    /// Ends the connection: every ring stopped, the memory table dropped.
    pub fn finish(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        // Also after a panic in the session (a poisoned lock): its rings
        // must stop, whatever state it was left in.
        self.session.lock().unwrap_or_else(|e| e.into_inner()).reset();
    }
}

/// Bytes this side has sent that the frontend has not read (with the
/// kernel's per-message overhead).
fn unread(conn: &UnixStream) -> libc::c_int {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int.
    if unsafe { libc::ioctl(conn.as_raw_fd(), libc::TIOCOUTQ, &mut n) } != 0 {
        return 0;
    }
    n
}

/// How much of the next message has arrived. A size past any request's
/// (the `vhost` crate's limit) counts as whole: the crate refuses it at once.
fn next(conn: &UnixStream) -> Next {
    let mut h = [0u8; HEADER];
    // SAFETY: a valid local buffer; MSG_PEEK consumes nothing.
    let n = unsafe {
        libc::recv(conn.as_raw_fd(), h.as_mut_ptr() as *mut libc::c_void, HEADER, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    if n == 0 {
        return Next::Closed;
    }
    if n < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::WouldBlock { Next::Empty } else { Next::Closed };
    }
    if (n as usize) < HEADER {
        return Next::Partial;
    }
    let size = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    let req = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    if size > vhost::vhost_user::message::MAX_MSG_SIZE {
        return Next::Whole(req);
    }
    let mut avail: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int, the bytes waiting in the socket.
    if unsafe { libc::ioctl(conn.as_raw_fd(), libc::FIONREAD, &mut avail) } != 0 {
        return Next::Closed;
    }
    match avail as usize {
        n if n >= HEADER + size => Next::Whole(req),
        n if n > HEADER => Next::Short,
        _ => Next::Partial,
    }
}

/// Whether the frontend shut its end of the socket (a poll, no waiting).
pub fn hung_up(conn: &UnixStream) -> bool {
    let mut p = libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Serves one connection until it ends (blocking; for fuzz targets and
/// in-process tests). Returns true if `stop` (a descriptor) became readable.
pub fn serve(conn: UnixStream, dev: &Arc<Served>, stop: RawFd) -> io::Result<bool> {
    let mut c = Conn::new(conn, dev)?;
    let stopped = loop {
        if wait_readable(&[c.stream.as_raw_fd(), stop])? == 1 {
            break true;
        }
        match c.serve_ready(hung_up(&c.stream), false) {
            Step::End | Step::Slow => break false,
            // Only part of a message: sleep a little for the rest
            // (readability holds while any byte waits).
            Step::Wait => std::thread::sleep(std::time::Duration::from_millis(1)),
            Step::More => {}
        }
    };
    c.finish();
    Ok(stopped)
}

/// Peeks up to `buf.len()` bytes of the next message (nothing consumed);
/// the header's request code, flags and payload size if a whole header came.
fn peek(conn: &UnixStream, buf: &mut [u8]) -> Option<(u32, u32, u32, usize)> {
    // SAFETY: `buf` is a valid local buffer of buf.len() bytes; MSG_PEEK
    // leaves the data (and any passed descriptors) in the socket.
    let n = unsafe {
        libc::recv(
            conn.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < HEADER as isize {
        return None;
    }
    let u32_at = |o: usize| u32::from_le_bytes([buf[o], buf[o + 1], buf[o + 2], buf[o + 3]]);
    Some((u32_at(0), u32_at(4), u32_at(8), n as usize))
}

/// Answers the next message if it is one of `OWN`'s with a well-formed
/// header and its whole payload peeked; else leaves it (false).
fn answer_own(conn: &UnixStream, session: &Mutex<Session>) -> io::Result<bool> {
    let mut msg = [0u8; LONGEST];
    let Some((req, flags, size, got)) = peek(conn, &mut msg) else { return Ok(false) };
    // The whole conversation, by request number, for VHOSTD_LOG=debug.
    tracing::debug!(req, flags, size, "request");
    let Some(&(_, expected, handler)) = OWN.iter().find(|(r, _, _)| u32::from(*r) == req) else { return Ok(false) };
    // A bad size or header (version other than 1, the reply bit, reserved
    // bits): let the generic handler refuse it.
    if size != expected || flags & VERSION_MASK != VERSION || flags & !(VERSION_MASK | NEED_REPLY) != 0 {
        return Ok(false);
    }
    handler(conn, session, flags, &msg[..got], HEADER + size as usize)
}

/// Reads the whole message peeked (`len` bytes; waits for a payload that
/// has not all arrived yet).
fn consume(conn: &UnixStream, len: usize) -> io::Result<[u8; LONGEST]> {
    let mut buf = [0u8; LONGEST];
    (&*conn).read_exact(&mut buf[..len])?;
    Ok(buf)
}

/// Replies to `req` with a u64 payload.
fn reply(conn: &UnixStream, req: FrontendReq, value: u64) -> io::Result<()> {
    let mut out = [0u8; HEADER + 8];
    out[0..4].copy_from_slice(&u32::from(req).to_le_bytes());
    out[4..8].copy_from_slice(&(VERSION | REPLY).to_le_bytes());
    out[8..12].copy_from_slice(&8u32.to_le_bytes());
    out[12..20].copy_from_slice(&value.to_le_bytes());
    (&*conn).write_all(&out)
}

fn body_u64(msg: &[u8]) -> u64 {
    u64::from_le_bytes(msg[HEADER..HEADER + 8].try_into().unwrap_or_default())
}

fn locked(session: &Mutex<Session>) -> io::Result<std::sync::MutexGuard<'_, Session>> {
    session.lock().map_err(|_| io::Error::other("session lock poisoned"))
}

/// Answers the ack of a request that asked for one (REPLY_ACK negotiated):
/// 0 for success.
fn ack(conn: &UnixStream, s: &Session, req: FrontendReq, flags: u32, ok: bool) -> io::Result<bool> {
    if flags & NEED_REPLY != 0 && s.reply_ack() {
        reply(conn, req, u64::from(!ok))?;
    }
    Ok(true)
}

fn set_status(conn: &UnixStream, session: &Mutex<Session>, flags: u32, _: &[u8], len: usize) -> io::Result<bool> {
    let msg = consume(conn, len)?;
    let mut s = locked(session)?;
    s.set_status(body_u64(&msg) as u8);
    ack(conn, &s, FrontendReq::SET_STATUS, flags, true)
}

fn get_status(conn: &UnixStream, session: &Mutex<Session>, _: u32, _: &[u8], len: usize) -> io::Result<bool> {
    consume(conn, len)?;
    let status = locked(session)?.status();
    reply(conn, FrontendReq::GET_STATUS, status as u64)?;
    Ok(true)
}

fn set_vring_enable(conn: &UnixStream, session: &Mutex<Session>, flags: u32, _: &[u8], len: usize) -> io::Result<bool> {
    let body = body_u64(&consume(conn, len)?);
    let (index, num) = (body as u32, (body >> 32) as u32);
    let mut s = locked(session)?;
    let ok = num <= 1 && s.vring_enable(index, num == 1).is_ok();
    ack(conn, &s, FrontendReq::SET_VRING_ENABLE, flags, ok)
}

/// The MAC is the payload's first 6 bytes (QEMU's vhost_user_migration_done).
/// Without protocol feature RARP the request is not one this connection
/// has: it closes, as unknown requests do.
fn send_rarp(conn: &UnixStream, session: &Mutex<Session>, flags: u32, _: &[u8], len: usize) -> io::Result<bool> {
    let msg = consume(conn, len)?;
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&msg[HEADER..HEADER + 6]);
    let s = locked(session)?;
    let Some(ok) = s.send_rarp(mac) else {
        return Err(io::Error::other("SEND_RARP without protocol feature RARP"));
    };
    ack(conn, &s, FrontendReq::SEND_RARP, flags, ok)
}

/// Aligned addresses go to the generic handler (false, nothing consumed),
/// and so does a message not all arrived yet.
fn set_vring_addr_misaligned(
    conn: &UnixStream,
    session: &Mutex<Session>,
    flags: u32,
    msg: &[u8],
    len: usize,
) -> io::Result<bool> {
    if msg.len() < len {
        return Ok(false);
    }
    let u64_at = |o: usize| u64::from_le_bytes(msg[o..o + 8].try_into().unwrap_or_default());
    // struct vhost_vring_addr: index, flags (u32 each), then descriptor,
    // used, avail and log addresses (u64).
    let (desc, used, avail) = (u64_at(HEADER + 8), u64_at(HEADER + 16), u64_at(HEADER + 24));
    if desc % 16 == 0 && used % 4 == 0 && avail % 2 == 0 {
        return Ok(false);
    }
    consume(conn, len)?;
    tracing::warn!(
        "SET_VRING_ADDR refused: misaligned ring addresses (desc {desc:#x}, used {used:#x}, avail {avail:#x})"
    );
    let s = locked(session)?;
    ack(conn, &s, FrontendReq::SET_VRING_ADDR, flags, false)
}

/// Whether the next message carries more descriptors than a request may.
/// Peeking installs copies of them here: they are closed at once.
fn too_many_fds(conn: &UnixStream) -> bool {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr() as *mut libc::c_void, iov_len: 1 };
    // Room for twice the limit, so more than the limit is seen as such.
    let mut control = [0u64; 80];
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg describes valid local buffers that outlive the call;
    // MSG_PEEK consumes nothing.
    let n = unsafe {
        libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC)
    };
    if n <= 0 {
        return false;
    }
    let mut count = 0;
    // SAFETY: walking the control messages the kernel wrote into `control`
    // with the CMSG macros; each descriptor read is one we now own.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const libc::c_int;
                let k = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<libc::c_int>();
                for j in 0..k {
                    libc::close(std::ptr::read_unaligned(data.add(j)));
                }
                count += k;
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    count > MAX_FDS || msg.msg_flags & libc::MSG_CTRUNC != 0
}

/// Whether a refused request left a frontend waiting: a request that
/// carries a reply (never sent on error), or one asking for an ack that
/// failed before the ack (the crate's own checks: a protocol feature not
/// negotiated, a missing descriptor; the session never returns these).
fn refusal_unanswered(e: &VuError, req: u32, flags: u32, session: &Mutex<Session>) -> bool {
    if REPLYING.iter().any(|&r| u32::from(r) == req) {
        return true;
    }
    let pre_ack = matches!(e, VuError::InvalidParam | VuError::InactiveFeature(_) | VuError::InactiveOperation(_));
    let acked = flags & NEED_REPLY != 0 && session.lock().map(|s| s.reply_ack()).unwrap_or(false);
    pre_ack && acked
}

/// Errors after which the byte stream can no longer be trusted.
fn is_fatal(e: &VuError) -> bool {
    !matches!(
        e,
        VuError::InvalidParam
            | VuError::InvalidOperation(_)
            | VuError::InactiveFeature(_)
            | VuError::InactiveOperation(_)
            | VuError::ReqHandlerError(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tables_name_the_requests_they_mean() {
        // The numbers of docs/interop/vhost-user.rst.
        let own: Vec<(u32, u32)> = OWN.iter().map(|(r, size, _)| (u32::from(*r), *size)).collect();
        assert_eq!(own, [(39, 8), (40, 0), (18, 8), (9, 40), (19, 8)]);
        let replying: Vec<u32> = REPLYING.iter().map(|&r| u32::from(r)).collect();
        assert_eq!(replying, [1, 11, 15, 17, 24, 31, 36, 40, 6]);
        assert_eq!((REPLY, NEED_REPLY), (0x4, 0x8));
    }

    #[test]
    fn fatal_errors_are_the_ones_that_break_framing() {
        assert!(!is_fatal(&VuError::InvalidParam));
        assert!(!is_fatal(&VuError::InvalidOperation("x")));
        assert!(is_fatal(&VuError::PartialMessage));
        assert!(is_fatal(&VuError::InvalidMessage));
    }
}
