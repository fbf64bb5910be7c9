//! The frontend's "guest memory": one memfd (plain pages, not hugepages)
//! mapped shared, handed to the backend with SET_MEM_TABLE, and carved into
//! rings and buffers by a bump allocator.

use crate::Error;
use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::sync::Arc;
use virtq_driver::{DriverMemory, SharedMemory};

/// The shared memory and its allocator.
pub struct FrontendMemory {
    file: File,
    mem: DriverMemory,
    next: u64,
}

impl FrontendMemory {
    /// A zeroed memfd of `size` bytes (rounded up to 4 KiB), seen by the
    /// device at guest-physical `gpa_base`; `sealable`: made with
    /// MFD_ALLOW_SEALING (a backend can then seal it against shrinking, as
    /// QEMU's memfds allow; false plays a frontend whose memory cannot be).
    pub fn new(size: u64, gpa_base: u64, sealable: bool) -> Result<FrontendMemory, Error> {
        let size = size.checked_add(4095).ok_or(Error::Config("memory size too large".into()))? & !4095;
        if size == 0 {
            return Err(Error::Config("memory size must not be zero".into()));
        }
        if !gpa_base.is_multiple_of(4096) || gpa_base.checked_add(size).is_none() {
            return Err(Error::Config("guest-physical base must be page aligned and fit".into()));
        }
        let file = virtq_driver::memfd("vhostd-user", size, sealable).map_err(Error::Io)?;
        let mapping = Arc::new(SharedMemory::map(&file, 0, size).map_err(Error::Io)?);
        Ok(FrontendMemory { file, mem: DriverMemory::new(mapping, gpa_base), next: 0 })
    }

    /// The memfd.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Raw fd of the memfd (for SET_MEM_TABLE).
    pub fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// The mapping with its guest-physical base.
    pub fn driver_memory(&self) -> &DriverMemory {
        &self.mem
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.mem.len()
    }

    /// Guest-physical base.
    pub fn gpa_base(&self) -> u64 {
        self.mem.gpa_base()
    }

    /// The frontend's virtual address of the start (vhost-user `userspace_addr`).
    pub fn uaddr_base(&self) -> u64 {
        self.mem.mapping().as_ptr() as u64
    }

    /// Frontend virtual address of a guest-physical address.
    pub fn gpa_to_uaddr(&self, gpa: u64) -> u64 {
        gpa.wrapping_sub(self.gpa_base()).wrapping_add(self.uaddr_base())
    }

    /// Reserves `len` bytes aligned to `align` (a power of two); returns the
    /// guest-physical address.
    pub fn alloc(&mut self, len: u64, align: u64) -> Result<u64, Error> {
        let align = if align.is_power_of_two() { align } else { 1 };
        let start = self.next.checked_add(align - 1).map(|v| v & !(align - 1));
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(s), Some(e)) if e <= self.size() => {
                self.next = e;
                Ok(self.gpa_base() + s)
            }
            _ => Err(Error::Config(format!(
                "guest memory of {} bytes is too small for {} more bytes (raise the memory size)",
                self.size(),
                len
            ))),
        }
    }

    /// Bytes not yet allocated.
    pub fn remaining(&self) -> u64 {
        self.size() - self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_is_aligned_and_bounded() {
        let mut m = FrontendMemory::new(8192, 0x10000, true).unwrap();
        let a = m.alloc(10, 64).unwrap();
        assert_eq!(a, 0x10000);
        let b = m.alloc(10, 64).unwrap();
        assert_eq!(b, 0x10040);
        assert!(m.alloc(8192, 1).is_err());
        assert!(m.driver_memory().write(b, b"hello"));
        assert_eq!(m.gpa_to_uaddr(0x10000), m.uaddr_base());
    }
}
