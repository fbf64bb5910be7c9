//! The virtio-blk device.
