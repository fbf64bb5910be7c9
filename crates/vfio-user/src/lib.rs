//! vhostd-vfio-user: the vfio-user protocol (QEMU's
//! `docs/interop/vfio-user.rst`, as shipped with QEMU 11.1, whose
//! `vfio-user-pci` client is the peer), without any device model. It knows
//! nothing of virtio or vhostd.
//!
//! - [`wire`]: the little-endian wire format: the 16-byte header, the
//!   command numbers and flags, the payloads of every message a server
//!   answers, the sparse-mmap capability and the VERSION JSON.
//! - [`Server`]: one connection, server side. It receives one message at a
//!   time with its descriptors (recvmsg + SCM_RIGHTS), checks every length,
//!   count, offset and flag against the message's size, the negotiated
//!   limits and what the device reported, and calls a [`VfioDevice`]; it
//!   never allocates more than its configured limits, answers a bad request
//!   with the error flag and an errno, and ends the connection with an
//!   [`Error`] that says why when the stream itself cannot be trusted.
//!   It works on a blocking socket or, for a polling thread, on a
//!   non-blocking one (see [`Server`]).
//! - [`Client`]: a small blocking client: builds each request, reads and
//!   checks each reply; for tests and for vhostd-user's vfio-user mode.
//!
//! # The rules a server keeps (from the spec, and QEMU's client)
//!
//! - VERSION comes first; anything else before it is answered EINVAL; a
//!   second VERSION too. A major other than 0 closes the connection; the
//!   minor answered is the smaller of the client's and ours (0); bad JSON
//!   (not NUL-terminated, not an object, wrong member types) is EINVAL;
//!   pgsizes without 4 KiB is ENOTSUP. The reply advertises max_msg_fds,
//!   max_data_xfer_size, pgsizes (4096) and max_dma_maps, and leaves out
//!   `migration`, `twin_socket` and `write_multiple`, which declines them
//!   (no migration, no server-to-client commands, no REGION_WRITE_MULTI).
//!   The reply (about 100 bytes of JSON) stays shorter than QEMU's request,
//!   whose size QEMU uses as its receive buffer for the reply.
//! - A header's size below 16 or above the largest message taken (a
//!   REGION_WRITE of max_data_xfer_size), a message that is not a command,
//!   or a message cut short by the client closing: the connection ends.
//! - More descriptors than max_msg_fds, or descriptors on a command that
//!   takes none: all are closed, EINVAL. DMA_MAP takes one; SET_IRQS with
//!   DATA_EVENTFD takes none (de-assign) or exactly `count`.
//! - DMA_MAP: iova, size (non-zero) and, with a descriptor, offset are
//!   4 KiB-aligned and do not wrap; a map overlapping another is EEXIST;
//!   past max_dma_maps ENOSPC; the mmap access bit without a descriptor
//!   EINVAL; file-I/O access ENOTSUP. DMA_UNMAP must match a mapping
//!   exactly (else ENOENT) or be VFIO_DMA_UNMAP_FLAG_ALL with iova and size
//!   0 (QEMU sends it); its reply echoes the request.
//! - GET_REGION_INFO: a reply too short for the sparse-mmap capability
//!   carries the needed argsz, no CAPS and no descriptor (QEMU asks again);
//!   the region's descriptor goes with the full reply.
//! - REGION_READ/WRITE: region index below num_regions, the region readable
//!   / writable, count within max_data_xfer_size (reads also within the
//!   client's, which bounds the reply), `offset + count` inside the region,
//!   a write's data exactly `count` bytes.
//! - SET_IRQS: index below num_irqs, exactly one data and one action bit,
//!   `start + count` inside the type's count (count 0 only as DATA_NONE
//!   start 0: disable all), MASK/UNMASK only on a MASKABLE type, eventfds
//!   only on an EVENTFD type, DATA_BOOL with exactly `count` bytes.
//! - Unknown commands, and those not served (GET_REGION_IO_FDS,
//!   DMA_READ/WRITE, REGION_WRITE_MULTI, DEVICE_FEATURE, migration): ENOSYS.
//! - NO_REPLY is honoured for every command, errors included (QEMU takes
//!   a reply nobody waits for as a protocol error).
//!
//! # Against QEMU 11.1
//!
//! Checked once by hand (a throwaway server with a fake PCI device, not
//! kept): QEMU's `vfio-user-pci` negotiates, maps guest RAM (a memfd
//! backend: with descriptors; its ROMs and the device's own mapped BAR
//! page: without), reads the region and IRQ infos (retrying region 0 for
//! its sparse capability), takes the BAR's descriptor, walks config space
//! with REGION_READ/WRITE, sets the INTx eventfd, resets the device, and
//! unmaps exactly what it mapped; no request was refused. So a device
//! model must accept DMA_MAPs without a descriptor (and never DMA there).
//!
//! # Why not rust-vmm's `vfio-user` crate
//!
//! We read `vfio_user` 0.1.7 (crates.io, the rust-vmm repository). Its
//! client is usable, but its server is not what vhostd needs:
//!
//! - `Server::run` accepts on its own listener and then loops blocking on
//!   one connection until it closes: there is no way to handle a message
//!   when a poller says the socket is readable, nor to keep a partly
//!   received message; vhostd serves every endpoint from one thread.
//! - Regions and IRQs are fixed at construction, and `GET_REGION_INFO`
//!   sends the region's descriptor only together with a sparse-mmap
//!   capability: a region mappable whole never gets one.
//! - It trusts the client: `header.message_size - size_of::<Version>()`
//!   underflows on a short VERSION (a panic in debug, a huge allocation in
//!   release), a VERSION without its NUL panics on `unwrap`, REGION_READ /
//!   WRITE allocate `count` bytes as the client says (up to 4 GiB) with no
//!   check against max_data_xfer_size or the region's size, DMA_MAP checks
//!   neither alignment nor overlap, SET_IRQS checks neither start nor
//!   count, and a payload shorter or longer than the command's structure
//!   desynchronises the stream instead of being refused. Nothing is
//!   refused before VERSION.
//! - Errors: a device error is answered with errno 0, and an error is
//!   answered even to a NO_REPLY message (which QEMU takes as a protocol
//!   error).
//! - Descriptors: more than 16 in one message end the connection; they are
//!   received without close-on-exec.
//! - It pulls in vm-memory, vfio-bindings, serde derive, thiserror and log.
//!
//! Fixing that would be a rewrite of its server, so this crate is our own:
//! written from the spec text and QEMU's client behaviour, sharing no code
//! with it.

#![deny(missing_docs)]

mod client;
mod server;
mod sys;
pub mod wire;

#[cfg(test)]
mod tests;

use std::fmt;

pub use client::{Client, ClientError, ClientRegion, Message};
pub use server::{
    DeviceInfo, DmaMap, Error, Event, IrqAction, IrqData, IrqInfo, IrqSet, Negotiated, RegionInfo, Server,
    ServerConfig, VfioDevice,
};
pub use wire::SparseArea;

/// An errno the server answers with (in the reply header's `error`), or a
/// device model returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// Invalid argument: the request breaks a rule.
    pub const EINVAL: Errno = Errno(libc::EINVAL);
    /// A DMA map overlaps an existing one.
    pub const EEXIST: Errno = Errno(libc::EEXIST);
    /// No DMA mapping matches an unmap.
    pub const ENOENT: Errno = Errno(libc::ENOENT);
    /// Too many DMA mappings.
    pub const ENOSPC: Errno = Errno(libc::ENOSPC);
    /// Command not served.
    pub const ENOSYS: Errno = Errno(libc::ENOSYS);
    /// A mode or feature not supported.
    pub const ENOTSUP: Errno = Errno(libc::ENOTSUP);
    /// The device is using what the client wants to take away.
    pub const EBUSY: Errno = Errno(libc::EBUSY);
    /// An I/O error in the device.
    pub const EIO: Errno = Errno(libc::EIO);
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "errno {} ({})", self.0, std::io::Error::from_raw_os_error(self.0))
    }
}

impl std::error::Error for Errno {}
