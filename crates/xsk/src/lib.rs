//! A thin AF_XDP layer, written here rather than taken from a crate: none
//! can adopt a socket another (privileged) process created, or register a
//! UMEM the caller places, and unprivileged operation needs both. The rings
//! are the hot path, so they are plain loads and stores on the shared
//! producer/consumer words with cached copies, nothing more.
//!
//! - [`Umem`]: the packet memory, fixed-size frames.
//! - [`Xsk`]: one socket bound to one device queue, with its fill,
//!   completion, RX and TX rings.
//! - [`bpf`]: the XSKMAP, the redirect program and its attachment.

#![deny(missing_docs)]

pub mod bpf;
mod ring;
mod socket;
mod umem;

pub use ring::{ConsRing, ProdRing};
pub use socket::{queue_count, BindMode, Statistics, Xsk, XskConfig};
pub use umem::Umem;

/// Frame size of the UMEM: one page, the size every driver handles.
pub const FRAME_SIZE: usize = 4096;

/// The index of a network interface, by name.
pub fn ifindex(name: &str) -> std::io::Result<u32> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "interface name has a NUL byte"))?;
    // SAFETY: c is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(i)
}
