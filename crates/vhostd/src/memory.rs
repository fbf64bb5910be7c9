//! Guest memory as vhost-user hands it over: regions of files the frontend
//! shares, addressed three ways (guest-physical, the frontend's own virtual
//! addresses, where ring addresses are given, and an offset into the file).
//! The memory table itself (virtq's `GuestMemory`) knows only guest-physical
//! addresses; this module keeps the frontend-virtual side and registers
//! each mapping with virtq's SIGBUS handler, to survive a frontend that
//! truncates a file under it.

use std::fs::File;
use std::io;
use std::sync::Arc;

use virtq::sigbus::{self, Slot};
use virtq::{Mapping, Region};

/// One region as the frontend described it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FrontendRegion {
    /// Guest-physical start.
    pub gpa: u64,
    /// Size in bytes.
    pub size: u64,
    /// The frontend's virtual address of the start.
    pub uaddr: u64,
}

/// The frontend-virtual view of the memory table.
#[derive(Clone, Debug, Default)]
pub struct FrontendAddrs {
    regions: Vec<FrontendRegion>,
}

/// Why a region was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum AddrError {
    /// It overlaps another region in the frontend's address space.
    Overlap,
    /// It is not in the table.
    NoSuchRegion,
}

impl FrontendAddrs {
    /// The regions.
    pub fn regions(&self) -> &[FrontendRegion] {
        &self.regions
    }

    /// A copy with one more region, refused if it overlaps one in the
    /// frontend's address space (guest-physical overlaps are the memory
    /// table's to refuse).
    pub fn with(&self, r: FrontendRegion) -> Result<FrontendAddrs, AddrError> {
        let end = |x: &FrontendRegion| x.uaddr.saturating_add(x.size);
        if self.regions.iter().any(|o| o.uaddr < end(&r) && r.uaddr < end(o)) {
            return Err(AddrError::Overlap);
        }
        let mut regions = self.regions.clone();
        regions.push(r);
        Ok(FrontendAddrs { regions })
    }

    /// A copy without the region at guest-physical `gpa` of `size` bytes.
    pub fn without(&self, gpa: u64, size: u64) -> Result<FrontendAddrs, AddrError> {
        let pos = self.regions.iter().position(|r| r.gpa == gpa && r.size == size).ok_or(AddrError::NoSuchRegion)?;
        let mut regions = self.regions.clone();
        regions.remove(pos);
        Ok(FrontendAddrs { regions })
    }

    /// The guest-physical address of frontend address `uaddr`, if a region
    /// holds it. (Whether a whole ring fits is the ring set-up's check, on
    /// the guest-physical side.)
    pub fn to_gpa(&self, uaddr: u64) -> Option<u64> {
        self.regions.iter().find_map(|r| {
            let off = uaddr.wrapping_sub(r.uaddr);
            (off < r.size).then(|| r.gpa + off)
        })
    }
}

/// Maps a region the frontend sent: `size` bytes of `file` from `offset`,
/// at guest-physical `gpa`.
pub fn map_region(file: &File, gpa: u64, size: u64, offset: u64) -> io::Result<Region> {
    let (mapping, skip) = map_shared(file, size, offset)?;
    Region::new(gpa, size, mapping, skip)
}

/// Maps `size` bytes of a file the frontend sent (a memory region, the
/// dirty log) from `offset`, registered with the SIGBUS handler for as long
/// as the mapping lives. Returns the mapping and where the bytes start in
/// it: an offset that is not page aligned is mapped from the file start,
/// as libvhost-user does.
///
/// With every guest-memory slot of the handler's table taken
/// (`sigbus::SLOTS - sigbus::IMAGE_SLOTS` live mappings), a
/// file sealed against shrinking is mapped all the same (it cannot be
/// truncated under us), but an unsealed one is refused with an error of
/// kind `StorageFull` (a vfio-user DMA_MAP answers ENOSPC, a vhost-user
/// SET_MEM_TABLE or ADD_MEM_REG is refused): its frontend could truncate
/// it and crash vhostd with a SIGBUS nobody handles.
pub fn map_shared(file: &File, size: u64, offset: u64) -> io::Result<(Arc<Mapping>, u64)> {
    map_shared_in(sigbus::guest_memory_slots(), file, size, offset)
}

/// `map_shared`, registering in `table`.
fn map_shared_in(table: &'static [Slot], file: &File, size: u64, offset: u64) -> io::Result<(Arc<Mapping>, u64)> {
    let (map_off, skip) = if offset.is_multiple_of(4096) { (offset, 0) } else { (0, offset) };
    let len = size.checked_add(skip).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "size overflows"))?;
    let mapping = Mapping::map(file, map_off, len)?;
    let mapping = match sigbus::register(table, mapping.host_range(), true) {
        Some(registration) => mapping.with_unmap_guard(Box::new(registration)),
        // Sealed against shrinking: no truncation to survive.
        None if mapping.sealed() => mapping,
        // Refused; `mapping` is unmapped as it drops.
        None => {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                format!(
                    "{} mappings already live, the most the SIGBUS handler covers, and this file cannot be \
                     sealed against shrinking (not a memfd): refused rather than mapped unprotected",
                    table.len()
                ),
            ))
        }
    };
    Ok((Arc::new(mapping), skip))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontend_addresses_translate_and_overlaps_are_refused() {
        let a = FrontendRegion { gpa: 0x1000, size: 0x1000, uaddr: 0x7000_0000 };
        let b = FrontendRegion { gpa: 0x2000, size: 0x1000, uaddr: 0x7100_0000 };
        let t = FrontendAddrs::default().with(a).unwrap().with(b).unwrap();
        assert_eq!(t.to_gpa(0x7100_0010), Some(0x2010));
        assert_eq!(t.to_gpa(0x7000_0fff), Some(0x1fff));
        assert_eq!(t.to_gpa(0x7000_1000), None);
        let c = FrontendRegion { gpa: 0x9000, size: 0x1000, uaddr: 0x7000_0800 };
        assert_eq!(t.with(c).unwrap_err(), AddrError::Overlap);
        let t2 = t.without(0x1000, 0x1000).unwrap();
        assert_eq!(t2.to_gpa(0x7000_0010), None);
        assert_eq!(t2.without(0x1000, 0x1000).unwrap_err(), AddrError::NoSuchRegion);
    }

    #[test]
    fn a_mapping_is_registered_while_it_lives() {
        let f = tempfile();
        f.set_len(8192).unwrap();
        let r = map_region(&f, 0, 8192, 0).unwrap();
        let (start, _) = r.mapping().host_range();
        let registered = || sigbus::TABLE.iter().any(|s| s.holds(start));
        assert!(registered());
        drop(r);
        assert!(!registered(), "unregistered before it is unmapped");
    }

    #[test]
    fn with_the_table_full_an_unsealed_file_is_refused_and_a_sealed_one_mapped() {
        // A table of its own: the process-wide one is shared with the
        // other tests.
        static SMALL: [Slot; 2] = [const { Slot::new() }; 2];
        let in_table = |m: &Arc<Mapping>| SMALL.iter().any(|s| s.holds(m.host_range().0));
        let f = tempfile();
        f.set_len(4 * 4096).unwrap();
        let (a, _) = map_shared_in(&SMALL, &f, 4096, 0).unwrap();
        let (b, skip) = map_shared_in(&SMALL, &f, 4096, 4096 + 512).unwrap();
        assert_eq!(skip, 4096 + 512);
        assert!(!a.sealed() && in_table(&a) && in_table(&b));
        // Full: the unsealed file (it could shrink under the mapping) is
        // refused, with the error a DMA_MAP answers ENOSPC.
        let e = map_shared_in(&SMALL, &f, 4096, 2 * 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull, "{e}");
        assert!(e.to_string().contains("refused"), "{e}");
        // A sealed one cannot shrink: mapped, outside the table.
        let sealed = sealable_tempfile();
        sealed.set_len(4096).unwrap();
        let (s, _) = map_shared_in(&SMALL, &sealed, 4096, 0).unwrap();
        assert!(s.sealed() && !in_table(&s));
        // A slot given up is taken again.
        drop(a);
        let (c, _) = map_shared_in(&SMALL, &f, 4096, 2 * 4096).unwrap();
        assert!(in_table(&c));
        let starts = [b.host_range().0, c.host_range().0];
        drop((b, c, s));
        assert!(SMALL.iter().all(|s| starts.iter().all(|&a| !s.holds(a))), "every slot given up");
    }

    fn tempfile() -> File {
        // SAFETY: memfd_create with a static C name; the fd is checked.
        let fd = unsafe { libc::memfd_create(c"vhostd-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) }
    }

    /// A memfd that can be sealed (as QEMU's are).
    fn sealable_tempfile() -> File {
        // SAFETY: memfd_create with a static C name; the fd is checked.
        let fd = unsafe { libc::memfd_create(c"vhostd-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) }
    }
}
