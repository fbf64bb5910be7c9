//! The virtio-blk wire format (virtio 1.2, section 5.2): request types,
//! status values, feature bits, and the layout of the request header, the
//! DISCARD / WRITE_ZEROES range and the config space. Numbers come from
//! `virtio-bindings`; the device and the project's own frontend
//! (vhostd-user) both use this module.

use virtio_bindings::virtio_blk as b;

/// Request types.
pub mod types {
    use super::b;

    /// VIRTIO_BLK_T_IN: read.
    pub const IN: u32 = b::VIRTIO_BLK_T_IN;
    /// VIRTIO_BLK_T_OUT: write.
    pub const OUT: u32 = b::VIRTIO_BLK_T_OUT;
    /// VIRTIO_BLK_T_FLUSH.
    pub const FLUSH: u32 = b::VIRTIO_BLK_T_FLUSH;
    /// VIRTIO_BLK_T_GET_ID: a 20-byte device id.
    pub const GET_ID: u32 = b::VIRTIO_BLK_T_GET_ID;
    /// VIRTIO_BLK_T_DISCARD.
    pub const DISCARD: u32 = b::VIRTIO_BLK_T_DISCARD;
    /// VIRTIO_BLK_T_WRITE_ZEROES.
    pub const WRITE_ZEROES: u32 = b::VIRTIO_BLK_T_WRITE_ZEROES;
}

/// Status byte values.
pub mod status {
    use super::b;

    /// VIRTIO_BLK_S_OK
    pub const OK: u8 = b::VIRTIO_BLK_S_OK as u8;
    /// VIRTIO_BLK_S_IOERR
    pub const IOERR: u8 = b::VIRTIO_BLK_S_IOERR as u8;
    /// VIRTIO_BLK_S_UNSUPP
    pub const UNSUPP: u8 = b::VIRTIO_BLK_S_UNSUPP as u8;
}

/// Feature bits.
pub mod features {
    use super::b;

    /// VIRTIO_BLK_F_SIZE_MAX
    pub const SIZE_MAX: u64 = 1 << b::VIRTIO_BLK_F_SIZE_MAX;
    /// VIRTIO_BLK_F_SEG_MAX
    pub const SEG_MAX: u64 = 1 << b::VIRTIO_BLK_F_SEG_MAX;
    /// VIRTIO_BLK_F_GEOMETRY
    pub const GEOMETRY: u64 = 1 << b::VIRTIO_BLK_F_GEOMETRY;
    /// VIRTIO_BLK_F_RO
    pub const RO: u64 = 1 << b::VIRTIO_BLK_F_RO;
    /// VIRTIO_BLK_F_BLK_SIZE
    pub const BLK_SIZE: u64 = 1 << b::VIRTIO_BLK_F_BLK_SIZE;
    /// VIRTIO_BLK_F_FLUSH
    pub const FLUSH: u64 = 1 << b::VIRTIO_BLK_F_FLUSH;
    /// VIRTIO_BLK_F_TOPOLOGY
    pub const TOPOLOGY: u64 = 1 << b::VIRTIO_BLK_F_TOPOLOGY;
    /// VIRTIO_BLK_F_CONFIG_WCE
    pub const CONFIG_WCE: u64 = 1 << b::VIRTIO_BLK_F_CONFIG_WCE;
    /// VIRTIO_BLK_F_MQ
    pub const MQ: u64 = 1 << b::VIRTIO_BLK_F_MQ;
    /// VIRTIO_BLK_F_DISCARD
    pub const DISCARD: u64 = 1 << b::VIRTIO_BLK_F_DISCARD;
    /// VIRTIO_BLK_F_WRITE_ZEROES
    pub const WRITE_ZEROES: u64 = 1 << b::VIRTIO_BLK_F_WRITE_ZEROES;
}

/// Sectors are 512 bytes whatever the block size.
pub const SECTOR: u64 = 512;
/// Request header bytes (type, reserved, sector).
pub const HEADER_LEN: usize = 16;
/// Bytes of a GET_ID answer.
pub const ID_LEN: usize = 20;
/// Bytes of one DISCARD / WRITE_ZEROES range (sector, num_sectors, flags).
pub const RANGE_LEN: usize = 16;
/// WRITE_ZEROES range flag: the device may unmap.
pub const RANGE_F_UNMAP: u32 = b::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;
/// Config space bytes served (up to write_zeroes_may_unmap and its padding,
/// the size QEMU's `struct virtio_blk_config` had before zoned devices).
pub const CONFIG_LEN: usize = 60;
/// Offsets in the config space (virtio 1.2, 5.2.4).
pub mod config {
    /// capacity (u64, sectors).
    pub const CAPACITY: usize = 0;
    /// size_max (u32).
    pub const SIZE_MAX: usize = 8;
    /// seg_max (u32).
    pub const SEG_MAX: usize = 12;
    /// blk_size (u32).
    pub const BLK_SIZE: usize = 20;
    /// topology: physical_block_exp (u8).
    pub const PHYSICAL_BLOCK_EXP: usize = 24;
    /// topology: min_io_size (u16).
    pub const MIN_IO_SIZE: usize = 26;
    /// writeback (u8, CONFIG_WCE).
    pub const WRITEBACK: usize = 32;
    /// num_queues (u16, MQ).
    pub const NUM_QUEUES: usize = 34;
    /// max_discard_sectors (u32).
    pub const MAX_DISCARD_SECTORS: usize = 36;
    /// max_discard_seg (u32).
    pub const MAX_DISCARD_SEG: usize = 40;
    /// discard_sector_alignment (u32).
    pub const DISCARD_SECTOR_ALIGNMENT: usize = 44;
    /// max_write_zeroes_sectors (u32).
    pub const MAX_WRITE_ZEROES_SECTORS: usize = 48;
    /// max_write_zeroes_seg (u32).
    pub const MAX_WRITE_ZEROES_SEG: usize = 52;
    /// write_zeroes_may_unmap (u8).
    pub const WRITE_ZEROES_MAY_UNMAP: usize = 56;
}
