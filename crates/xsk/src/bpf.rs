//! The XDP side, through the bpf() syscall (no libbpf): an XSKMAP, the
//! redirect program (five instructions, assembled here), and attaching it to
//! an interface as a BPF link, so it is detached when the last descriptor of
//! the link closes, however the process ends.

use std::ffi::CString;
use std::io;
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_CREATE: libc::c_long = 28;

const BPF_MAP_TYPE_XSKMAP: u32 = 17;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// Where the XDP program runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpMode {
    /// In the driver (native XDP).
    Native,
    /// On the socket buffer (generic XDP): works on every interface.
    Skb,
}

impl std::fmt::Display for XdpMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            XdpMode::Native => "native",
            XdpMode::Skb => "skb",
        })
    }
}

/// The bpf() attribute union, large enough for every command used here;
/// fields are written at their offsets in `union bpf_attr`.
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Attr {
        Attr([0; 128])
    }
    fn u32(&mut self, off: usize, v: u32) -> &mut Self {
        self.0[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(&mut self, off: usize, v: u64) -> &mut Self {
        self.0[off..off + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn bytes(&mut self, off: usize, v: &[u8]) -> &mut Self {
        self.0[off..off + v.len()].copy_from_slice(v);
        self
    }
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<i64> {
    // SAFETY: attr is a valid, zero-padded bpf_attr of the size passed; every
    // pointer inside it points at memory that lives across the call.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), attr.0.len() as libc::c_uint) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

fn new_fd(r: i64) -> OwnedFd {
    // SAFETY: the bpf() call returned a new descriptor owned by nothing else.
    unsafe { OwnedFd::from_raw_fd(r as RawFd) }
}

fn bpf_perm(e: io::Error, what: &str) -> io::Error {
    if e.raw_os_error() == Some(libc::EPERM) {
        io::Error::new(
            e.kind(),
            format!("{what}: needs CAP_BPF and CAP_NET_ADMIN (or run `vhostd xdp-helper`, or inhibit=on)"),
        )
    } else {
        io::Error::new(e.kind(), format!("{what}: {e}"))
    }
}

/// An XSKMAP: socket descriptors by index, for bpf_redirect_map.
pub struct XskMap {
    fd: OwnedFd,
    entries: u32,
}

impl XskMap {
    /// A new map of `entries` slots.
    pub fn create(entries: u32) -> io::Result<XskMap> {
        let mut a = Attr::new();
        a.u32(0, BPF_MAP_TYPE_XSKMAP).u32(4, 4).u32(8, 4).u32(12, entries).bytes(28, b"vhostd_xsks");
        let fd = bpf(BPF_MAP_CREATE, &mut a).map_err(|e| bpf_perm(e, "cannot create the XSKMAP"))?;
        Ok(XskMap { fd: new_fd(fd), entries })
    }

    /// A map pinned at `path` (bpffs).
    pub fn open_pinned(path: &Path) -> io::Result<XskMap> {
        let c = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "map path has a NUL byte"))?;
        let mut a = Attr::new();
        a.u64(0, c.as_ptr() as u64);
        let fd = bpf(BPF_OBJ_GET, &mut a)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot open the pinned map {}: {e}", path.display())))?;
        XskMap::adopt(new_fd(fd)).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
    }

    /// A map descriptor handed to us; checked to be an XSKMAP.
    pub fn adopt(fd: OwnedFd) -> io::Result<XskMap> {
        // struct bpf_map_info starts: type, id, key_size, value_size, max_entries.
        let mut info = [0u32; 20];
        let mut a = Attr::new();
        a.u32(0, fd.as_raw_fd() as u32).u32(4, std::mem::size_of_val(&info) as u32).u64(8, info.as_mut_ptr() as u64);
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut a)
            .map_err(|e| io::Error::new(e.kind(), format!("not a BPF map descriptor ({e})")))?;
        if info[0] != BPF_MAP_TYPE_XSKMAP {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a BPF map of type {}, not an XSKMAP", info[0]),
            ));
        }
        Ok(XskMap { fd, entries: info[4] })
    }

    /// Puts socket `sock` at `index`.
    pub fn insert(&self, index: u32, sock: RawFd) -> io::Result<()> {
        if index >= self.entries {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("XSKMAP index {index} is past its {} entries", self.entries),
            ));
        }
        let key = index;
        let value = sock as u32;
        let mut a = Attr::new();
        a.u32(0, self.fd.as_raw_fd() as u32).u64(8, &key as *const u32 as u64).u64(16, &value as *const u32 as u64);
        bpf(BPF_MAP_UPDATE_ELEM, &mut a)
            .map(|_| ())
            .map_err(|e| io::Error::new(e.kind(), format!("cannot put the socket in XSKMAP slot {index}: {e}")))
    }

    /// Slots.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// The map's descriptor.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Gives up the descriptor (e.g. to pass it to another process).
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }
}

/// One eBPF instruction.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> u64 {
    (code as u64) | ((dst as u64 | (src as u64) << 4) << 8) | ((off as u16 as u64) << 16) | ((imm as u32 as u64) << 32)
}

/// Loads the redirect program: every frame goes to the socket in `map` at
/// the index of the queue it arrived on, and to the kernel stack when that
/// slot is empty (the low bits of bpf_redirect_map's flags are the action
/// on a miss).
pub fn load_redirect_program(map: &XskMap) -> io::Result<OwnedFd> {
    const XDP_PASS: i32 = 2;
    const BPF_FUNC_REDIRECT_MAP: i32 = 51;
    const BPF_PSEUDO_MAP_FD: u8 = 1;
    let prog = [
        insn(0x61, 2, 1, 16, 0),                       // r2 = ctx->rx_queue_index (u32 at 16)
        insn(0x18, 1, BPF_PSEUDO_MAP_FD, 0, map.fd()), // r1 = map (ld_imm64, two slots)
        insn(0, 0, 0, 0, 0),
        insn(0xb7, 3, 0, 0, XDP_PASS),              // r3 = XDP_PASS
        insn(0x85, 0, 0, 0, BPF_FUNC_REDIRECT_MAP), // r0 = bpf_redirect_map(r1, r2, r3)
        insn(0x95, 0, 0, 0, 0),                     // exit
    ];
    let license = c"Apache-2.0";
    let mut log = vec![0u8; 4096];
    let mut a = Attr::new();
    a.u32(0, BPF_PROG_TYPE_XDP)
        .u32(4, prog.len() as u32)
        .u64(8, prog.as_ptr() as u64)
        .u64(16, license.as_ptr() as u64)
        .u32(24, 1)
        .u32(28, log.len() as u32)
        .u64(32, log.as_mut_ptr() as u64)
        .bytes(48, b"vhostd_xsk");
    match bpf(BPF_PROG_LOAD, &mut a) {
        Ok(fd) => Ok(new_fd(fd)),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let log = String::from_utf8_lossy(&log[..end]);
            Err(bpf_perm(
                e,
                &format!(
                    "cannot load the XDP program{}",
                    if log.is_empty() { String::new() } else { format!(" ({})", log.trim()) }
                ),
            ))
        }
    }
}

/// Attaches `prog` to interface `ifindex` in `mode`, as a BPF link: the
/// program stays attached while the returned descriptor (or a copy of it,
/// e.g. in a process it was passed to) is open.
pub fn attach(prog: &OwnedFd, ifindex: u32, mode: XdpMode) -> io::Result<OwnedFd> {
    let flags = match mode {
        XdpMode::Native => XDP_FLAGS_DRV_MODE,
        XdpMode::Skb => XDP_FLAGS_SKB_MODE,
    };
    let mut a = Attr::new();
    a.u32(0, prog.as_raw_fd() as u32).u32(4, ifindex).u32(8, BPF_XDP).u32(12, flags);
    bpf(BPF_LINK_CREATE, &mut a).map(new_fd).map_err(|e| match e.raw_os_error() {
        Some(libc::EBUSY) | Some(libc::EEXIST) => io::Error::new(
            e.kind(),
            "the interface already has an XDP program: detach it, or use inhibit=on with that program's XSKMAP",
        ),
        _ => bpf_perm(e, &format!("cannot attach the XDP program in {mode} mode")),
    })
}

/// The redirect program on an interface: its map and its attachment.
pub struct Redirect {
    /// The XSKMAP; slot i steers device queue i.
    pub map: XskMap,
    /// The BPF link: the program is attached while this (or a copy) is open.
    pub link: OwnedFd,
    /// Where the program runs.
    pub mode: XdpMode,
    /// Why native mode was refused, when no mode was asked for and skb is used.
    pub native_refused: Option<io::Error>,
}

/// Creates an XSKMAP of `entries` slots, loads the redirect program and
/// attaches it to `ifindex` in `mode`, or with no mode natively, falling
/// back to skb mode.
pub fn redirect(ifindex: u32, entries: u32, mode: Option<XdpMode>) -> io::Result<Redirect> {
    let map = XskMap::create(entries)?;
    // The link holds the program; our descriptor of it can go.
    let prog = load_redirect_program(&map)?;
    let (link, mode, native_refused) = match mode {
        Some(m) => (attach(&prog, ifindex, m)?, m, None),
        None => match attach(&prog, ifindex, XdpMode::Native) {
            Ok(l) => (l, XdpMode::Native, None),
            Err(native) => (attach(&prog, ifindex, XdpMode::Skb)?, XdpMode::Skb, Some(native)),
        },
    };
    Ok(Redirect { map, link, mode, native_refused })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_encode_as_the_kernel_lays_them_out() {
        // struct bpf_insn { u8 code; u8 dst:4, src:4; s16 off; s32 imm; } little-endian.
        assert_eq!(insn(0x61, 2, 1, 16, 0).to_le_bytes(), [0x61, 0x12, 16, 0, 0, 0, 0, 0]);
        assert_eq!(insn(0xb7, 3, 0, 0, 2).to_le_bytes(), [0xb7, 0x03, 0, 0, 2, 0, 0, 0]);
        assert_eq!(insn(0x85, 0, 0, -1, -1).to_le_bytes(), [0x85, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
    }
}
