//! Helpers shared by the fuzz targets: a guest memory fenced by PROT_NONE
//! guard pages, a byte reader over the fuzz input, and the invariant checks
//! every ring target makes on what the device side returns.
//!
//! Guest memory (one anonymous mapping, 4 KiB pages):
//!
//! ```text
//! page 0      guard (PROT_NONE)
//! pages 1-8   R0, 32 KiB
//! page 9      guard
//! pages 10-13 R1, 16 KiB
//! page 14     guard
//! ```
//!
//! and four memory tables over it (the input picks one):
//!
//! 0. R0 at gpa 0
//! 1. R0 at gpa 0, R1 at gpa 0x8000: adjacent in guest-physical space, not
//!    in the host mapping, so a buffer crossing 0x8000 becomes two pieces
//! 2. R0 at gpa 0, R1 at gpa 0x10000: a hole between them
//! 3. R1 at gpa 0, R0 at gpa 0x4000: the rings live in the smaller region
//!
//! Whatever the device reads or writes outside a region lands on a guard
//! page (within 4 KiB of it) and faults, which libFuzzer reports as a crash;
//! every segment the queue hands out is also checked against the regions.

use std::sync::{Arc, OnceLock};
use virtq::ring::{VRING_PACKED_DESC_F_AVAIL, VRING_PACKED_DESC_F_USED};
use virtq::{Access, Batch, Chain, GuestMemory, Mapping, Region, Seg};

pub const PAGE: usize = 4096;
const R0_PAGE: usize = 1;
const R0_LEN: usize = 8 * PAGE;
const R1_PAGE: usize = 10;
const R1_LEN: usize = 4 * PAGE;
const TOTAL_PAGES: usize = 15;
/// The fenced guest memory and its memory tables.
pub struct Guest {
    map: Arc<Mapping>,
    tables: Vec<Arc<GuestMemory>>,
}

// SAFETY: the mapping is plain shared memory; each fuzz target touches it
// from one thread at a time.
unsafe impl Sync for Guest {}
unsafe impl Send for Guest {}

impl Guest {
    fn build() -> Guest {
        let map = Arc::new(Mapping::anonymous(TOTAL_PAGES * PAGE).expect("anonymous mapping"));
        let base = map.host_range().0;
        for page in [0, 9, 14] {
            // SAFETY: a page inside our own mapping (an address, never
            // dereferenced here); a guard that faults any access.
            let r = unsafe { libc::mprotect((base + page * PAGE) as *mut libc::c_void, PAGE, libc::PROT_NONE) };
            assert_eq!(r, 0, "mprotect guard page");
        }
        let r0 = |gpa: u64| Region::new(gpa, R0_LEN as u64, map.clone(), (R0_PAGE * PAGE) as u64).unwrap();
        let r1 = |gpa: u64| Region::new(gpa, R1_LEN as u64, map.clone(), (R1_PAGE * PAGE) as u64).unwrap();
        let tables = vec![vec![r0(0)], vec![r0(0), r1(0x8000)], vec![r0(0), r1(0x10000)], vec![r1(0), r0(0x4000)]]
            .into_iter()
            .map(|regions| Arc::new(GuestMemory::from_regions(regions).expect("memory table")))
            .collect();
        Guest { map, tables }
    }

    /// The process-wide guest memory (built once, cleared per input).
    pub fn get() -> &'static Guest {
        static G: OnceLock<Guest> = OnceLock::new();
        G.get_or_init(Guest::build)
    }

    /// Memory table `i % 4`.
    pub fn table(&self, i: usize) -> Arc<GuestMemory> {
        self.tables[i % self.tables.len()].clone()
    }

    /// Zeroes both regions.
    pub fn clear(&self) {
        self.map.fill(R0_PAGE * PAGE, R0_LEN, 0);
        self.map.fill(R1_PAGE * PAGE, R1_LEN, 0);
    }

    /// Writes `bytes` at guest-physical `gpa` of table `mem`, as far as
    /// they fall inside it (the driver's view of memory).
    pub fn write(mem: &GuestMemory, gpa: u64, bytes: &[u8]) {
        if !mem.write(gpa, bytes) {
            for (i, b) in bytes.iter().enumerate() {
                if !mem.write(gpa.wrapping_add(i as u64), &[*b]) {
                    break;
                }
            }
        }
    }

    /// Reads `N` bytes at `gpa` (zeroes where unmapped).
    pub fn read<const N: usize>(mem: &GuestMemory, gpa: u64) -> [u8; N] {
        let mut out = [0u8; N];
        for (i, o) in out.iter_mut().enumerate() {
            let mut b = [0u8];
            if mem.read(gpa.wrapping_add(i as u64), &mut b) {
                *o = b[0];
            }
        }
        out
    }

    pub fn r16(mem: &GuestMemory, gpa: u64) -> u16 {
        u16::from_le_bytes(Self::read::<2>(mem, gpa))
    }

    pub fn r32(mem: &GuestMemory, gpa: u64) -> u32 {
        u32::from_le_bytes(Self::read::<4>(mem, gpa))
    }

    pub fn w16(mem: &GuestMemory, gpa: u64, v: u16) {
        Self::write(mem, gpa, &v.to_le_bytes())
    }
}

/// Asserts that `seg` is non-empty and lies wholly inside one region of
/// `mem` (host addresses).
pub fn check_seg(mem: &GuestMemory, seg: &Seg) {
    assert!(!seg.is_empty(), "empty segment handed out");
    let start = seg.host_addr();
    let end = start.checked_add(seg.len() as usize).expect("segment end overflows");
    let inside = mem.regions().iter().any(|r| {
        let h = mem.host_addr(r.gpa()).expect("a region's start is in the table");
        start >= h && end <= h + r.size() as usize
    });
    assert!(inside, "segment {:#x}+{:#x} outside every region of the memory table", start, seg.len());
}

/// Checks every chain of a popped batch: segments inside memory, lengths
/// adding up, directions as `access` demands, at most `max` chains.
pub fn check_batch(mem: &GuestMemory, batch: &Batch, max: usize, access: virtq::Access) {
    assert!(batch.len() <= max, "popped {} chains, asked for at most {max}", batch.len());
    for c in &batch.chains {
        check_chain(mem, batch, c, access);
    }
}

/// See `check_batch`.
pub fn check_chain(mem: &GuestMemory, batch: &Batch, c: &Chain, access: virtq::Access) {
    let (r, w) = (batch.readable(c), batch.writable(c));
    let mut rl = 0u64;
    for s in r.segs() {
        check_seg(mem, s);
        rl += s.len() as u64;
    }
    let mut wl = 0u64;
    for s in w.segs() {
        check_seg(mem, s);
        wl += s.len() as u64;
    }
    // Every byte read through the fence (faults on a guard page, and
    // AddressSanitizer sees the accesses).
    let mut all = vec![0u8; (rl + wl) as usize];
    assert_eq!(r.read(0, &mut all[..rl as usize]) as u64, rl);
    assert_eq!(w.read(0, &mut all[rl as usize..]) as u64, wl);
    assert_eq!(rl, c.read_len as u64, "read_len differs from its segments");
    assert_eq!(wl, c.write_len as u64, "write_len differs from its segments");
    match access {
        virtq::Access::ReadOnly => assert!(w.is_empty(), "writable segment in a ReadOnly chain"),
        virtq::Access::WriteOnly => assert!(r.is_empty(), "readable segment in a WriteOnly chain"),
        virtq::Access::ReadThenWrite => {}
    }
}

/// Takes bytes off the front of the fuzz input; zeroes once it runs out.
pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data }
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    pub fn u64(&mut self) -> u64 {
        self.u32() as u64 | (self.u32() as u64) << 32
    }
    /// Up to `n` bytes (fewer at the end of the input).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (a, b) = self.data.split_at(n);
        self.data = b;
        a
    }
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }
    /// A packed descriptor as a driver makes it available in lap `lap`
    /// (AVAIL and USED set for it): slot (u8, modulo `size`), addr (u16),
    /// len (u16), id (u8), NEXT/WRITE/INDIRECT (low 3 bits of a u8).
    /// Returns the slot and the descriptor's 16 bytes.
    pub fn packed_desc(&mut self, size: u16, lap: bool) -> (u16, [u8; 16]) {
        let slot = self.u8() as u16 % size;
        let addr = self.u16() as u64;
        let len = self.u16() as u32;
        let id = self.u8() as u16;
        let flags = (self.u8() as u16 & 7) | if lap { VRING_PACKED_DESC_F_AVAIL } else { VRING_PACKED_DESC_F_USED };
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&id.to_le_bytes());
        d[14..16].copy_from_slice(&flags.to_le_bytes());
        (slot, d)
    }
}

/// The access a pop asks for, from a nibble of the input.
pub fn access_of(v: u8) -> Access {
    match v % 3 {
        0 => Access::ReadOnly,
        1 => Access::WriteOnly,
        _ => Access::ReadThenWrite,
    }
}

/// `v` rounded up to a multiple of `a` (a power of two).
pub fn align_up(v: u64, a: u64) -> u64 {
    (v + a - 1) & !(a - 1)
}

/// A split ring packed tightly from `base`: descriptor table, avail ring,
/// used ring (each aligned as the spec requires). Returns (desc, avail,
/// used, end).
pub fn split_layout(base: u64, size: u16) -> (u64, u64, u64, u64) {
    let n = size as u64;
    let desc = align_up(base, 16);
    let avail = desc + 16 * n;
    let used = align_up(avail + 6 + 2 * n, 4);
    let end = used + 6 + 8 * n;
    (desc, avail, used, end)
}

/// A packed ring from `base`: descriptor ring, driver event area, device
/// event area. Returns (desc, driver, device, end).
pub fn packed_layout(base: u64, size: u16) -> (u64, u64, u64, u64) {
    let desc = align_up(base, 16);
    let driver = desc + 16 * size as u64;
    let device = driver + 4;
    (desc, driver, device, device + 4)
}

/// Position of a packed ring in a counter modulo 2 x size (vring_base half).
pub fn packed_linear(half: u16, size: u16) -> u32 {
    let idx = (half & 0x7fff) as u32;
    let wrap = half & 0x8000 != 0;
    idx + if wrap { 0 } else { size as u32 }
}
