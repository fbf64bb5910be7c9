//! vhostd's vhost-user message handler (server::serve_connection over a
//! Session and the `vhost` crate's request parser) fed a frontend's byte
//! stream from the input, with memfd and eventfd descriptors attached
//! (SCM_RIGHTS) where the input says, against a blk device (null backend)
//! and a net device (loopback, two queue pairs), each built once. The
//! device's dataplane workers run for real: rings the input sets up in
//! the memfds it passes are processed, kicks included.
//!
//! Input: a selector byte (bit 0: net device instead of blk), then records:
//!
//! ```text
//! 00ffffnn len:u16 bytes       raw bytes, sent in one sendmsg with nn descriptors
//! 01xxxxxx len:u16 bytes       contents (at offset 0) of the memfds made from now on
//! 10xxxxxs                     kick: write 1 to every eventfd sent so far (s: then sleep 1 ms)
//! 11rfffnn req:u8 len:u16 body a message with its header made here: request
//!                              `req`, flags VERSION (| NEED_REPLY if r), size len
//! ```
//!
//! nn: descriptors to attach (0-3); bit i of fff: descriptor i is an
//! eventfd (1) or a 1 MiB memfd (0). Then the stream is shut down and the
//! connection must end (Ok or Err) without a panic or a hang.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};
use vhostd::cli::{Cli, DeviceArgs};
use vhostd::endpoint::Endpoint;
use vhostd::session::Served;
use vhostd_fuzz::Reader;

struct Devices {
    blk: Arc<Served>,
    net: Arc<Served>,
    _endpoints: Vec<Endpoint>,
}

// SAFETY (Sync): the devices are shared by the server threads of vhostd
// itself; the endpoints are only kept alive here.
unsafe impl Sync for Devices {}
unsafe impl Send for Devices {}

fn build(kind: &str, extra: &[&str]) -> (Arc<Served>, Endpoint) {
    let path = std::env::temp_dir().join(format!("vhostd-fuzz-{}-{kind}.sock", std::process::id()));
    let mut argv: Vec<String> = vec!["vhostd".into(), kind.into(), "--socket-path".into(), path.display().to_string()];
    argv.extend(extra.iter().map(|s| s.to_string()));
    let cli = Cli::try_parse_args(&argv).expect("device arguments");
    let args = DeviceArgs::from_command(cli.command).expect("argv names net or blk");
    let spec = args.to_spec(format!("fuzz-{kind}"));
    let (dev, ep) = vhostd::server::build(&spec).expect("build the device");
    // Nobody connects there: the listening socket needs no name.
    let _ = std::fs::remove_file(&path);
    (dev, ep)
}

fn devices() -> &'static Devices {
    static D: OnceLock<Devices> = OnceLock::new();
    D.get_or_init(|| {
        let (blk, e1) = build("blk", &["--backend", "null,size=1M"]);
        let (net, e2) = build("net", &["--backend", "loopback", "--queues", "2"]);
        Devices { blk, net, _endpoints: vec![e1, e2] }
    })
}

/// A 1 MiB memfd holding `contents` at offset 0.
fn memfd(contents: &[u8]) -> OwnedFd {
    // SAFETY: memfd_create with a static name; checked.
    let fd = unsafe { libc::memfd_create(c"vhostd-fuzz-mem".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: fd is ours.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain calls on our fd; contents is a valid buffer.
    unsafe {
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), 1 << 20), 0);
        let n = contents.len().min(1 << 20);
        libc::pwrite(fd.as_raw_fd(), contents.as_ptr() as *const libc::c_void, n, 0);
    }
    fd
}

fn eventfd() -> OwnedFd {
    // SAFETY: plain call; checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd");
    // SAFETY: fd is ours.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Reads whatever the server wrote (replies), without blocking. Returns
/// false at end of stream.
fn drain(fd: RawFd) -> bool {
    let mut buf = [0u8; 65536];
    loop {
        // SAFETY: buf is valid for its length. Descriptors the server
        // attaches (GET_INFLIGHT_FD) are discarded by the kernel, as no
        // control buffer is given.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), libc::MSG_DONTWAIT) };
        if n > 0 {
            continue;
        }
        return n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock;
    }
}

fn wait(fd: RawFd, events: i16) {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, 100) };
}

/// Sends `bytes` with `fds` attached to the first chunk, reading replies
/// meanwhile so neither side blocks on a full socket.
fn send(fd: RawFd, mut bytes: &[u8], fds: &[RawFd]) {
    let mut fds = fds;
    while !bytes.is_empty() || !fds.is_empty() {
        let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
        let mut cbuf = [0u64; 8];
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
            msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space;
            // SAFETY: the control buffer (64 bytes) holds one cmsg of up to
            // 3 descriptors; CMSG_* compute offsets inside it.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
                std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c) as *mut RawFd, fds.len());
            }
        }
        if bytes.is_empty() {
            // Descriptors need at least one byte to travel with.
            return;
        }
        // SAFETY: msg points at live buffers; MSG_NOSIGNAL: a closed peer
        // is an error, not SIGPIPE.
        let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if n > 0 {
            bytes = &bytes[n as usize..];
            fds = &[];
            continue;
        }
        let e = std::io::Error::last_os_error();
        if n < 0 && e.kind() == std::io::ErrorKind::WouldBlock {
            if !drain(fd) {
                return;
            }
            wait(fd, libc::POLLIN | libc::POLLOUT);
            continue;
        }
        // The server closed the connection (a fatal message): stop sending.
        return;
    }
}

/// What the input asks for, in order.
enum Action<'a> {
    /// Bytes to send, and the descriptors to attach: (is eventfd, memfd contents).
    Send(Vec<u8>, Vec<(bool, &'a [u8])>),
    /// Write 1 to every eventfd sent so far; then sleep 1 ms if true.
    Kick(bool),
}

fn parse<'a>(r: &mut Reader<'a>) -> Vec<Action<'a>> {
    let mut template: &[u8] = &[];
    let mut actions = Vec::new();
    while !r.is_empty() {
        let tag = r.u8();
        match tag >> 6 {
            1 => {
                let n = r.u16() as usize;
                template = r.bytes(n);
            }
            2 => actions.push(Action::Kick(tag & 1 != 0)),
            kind => {
                let mut msg = Vec::new();
                if kind == 3 {
                    let req = r.u8() as u32;
                    let len = r.u16() as usize;
                    let body = r.bytes(len);
                    let flags = 1u32 | if tag & 0x20 != 0 { 0x8 } else { 0 };
                    msg.extend_from_slice(&req.to_le_bytes());
                    msg.extend_from_slice(&flags.to_le_bytes());
                    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
                    msg.extend_from_slice(body);
                } else {
                    let len = r.u16() as usize;
                    msg.extend_from_slice(r.bytes(len));
                }
                let kinds = if kind == 3 { (tag >> 2) & 7 } else { (tag >> 2) & 15 };
                let fds = (0..(tag & 3)).map(|i| (kinds & (1 << i) != 0, template)).collect();
                actions.push(Action::Send(msg, fds));
            }
        }
    }
    actions
}

fuzz_target!(|data: &[u8]| {
    let devs = devices();
    let mut r = Reader::new(data);
    let dev = if r.u8() & 1 != 0 { devs.net.clone() } else { devs.blk.clone() };
    let actions = parse(&mut r);
    let (front, back) = UnixStream::pair().expect("socketpair");
    let server = std::thread::spawn(move || vhostd::server::serve_connection(back, &dev));
    let fd = front.as_raw_fd();
    let mut kicks: Vec<OwnedFd> = Vec::new();
    for a in actions {
        match a {
            Action::Kick(sleep) => {
                for k in &kicks {
                    let one = 1u64.to_ne_bytes();
                    // SAFETY: an 8-byte write to our eventfd.
                    unsafe { libc::write(k.as_raw_fd(), one.as_ptr() as *const libc::c_void, 8) };
                }
                if sleep {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            Action::Send(msg, fds) => {
                let mut owned = Vec::new();
                for (is_eventfd, contents) in fds {
                    if is_eventfd {
                        let e = eventfd();
                        kicks.push(e.try_clone().expect("dup eventfd"));
                        owned.push(e);
                    } else {
                        owned.push(memfd(contents));
                    }
                }
                let raw: Vec<RawFd> = owned.iter().map(|f| f.as_raw_fd()).collect();
                send(fd, &msg, &raw);
                drain(fd);
            }
        }
    }
    // End of the frontend's stream: the server must notice and return.
    let _ = front.shutdown(std::net::Shutdown::Write);
    loop {
        if !drain(fd) {
            break;
        }
        wait(fd, libc::POLLIN);
        if server.is_finished() {
            drain(fd);
            break;
        }
    }
    let result = server.join().expect("server thread");
    if std::env::var_os("VHOSTD_FUZZ_DEBUG").is_some() {
        // What the input made the device do (for writing seeds).
        eprintln!("serve_connection: {result:?}");
        for (name, d) in [("blk", &devs.blk), ("net", &devs.net)] {
            for r in d.reports() {
                for g in &r.groups {
                    for (i, ring) in g.rings.iter().enumerate() {
                        if ring.queue.chains + ring.queue.bad_chains > 0 {
                            let c = g.counters.rings.get(i);
                            eprintln!(
                                "{name} worker {} group {} ring {i}: {:?} {:?}",
                                r.worker, g.group, ring.queue, c
                            );
                        }
                    }
                }
            }
        }
    }
});
