//! A test ring: one anonymous mapping used as guest memory (gpa = offset),
//! a split ring in it written with raw stores (so tests can write anything
//! a hostile driver could), and the device-side queue over it.
#![allow(dead_code)]

use std::sync::Arc;
use virtq::ring::*;
use virtq::{GuestMemory, Mapping, Region, SplitConfig, SplitQueue};
use virtq_driver::RingLayout;

pub const MEM: u64 = 1 << 20;
/// Where test buffers start (rings sit below).
pub const BUFS: u64 = 0x40000;

pub struct Ring {
    pub map: Arc<Mapping>,
    pub mem: Arc<GuestMemory>,
    pub layout: RingLayout,
    pub avail_idx: u16,
}

impl Ring {
    /// A ring of `size` entries at gpa 0x1000, in one 1 MiB region.
    pub fn new(size: u16) -> Ring {
        let map = Arc::new(Mapping::anonymous(MEM as usize).unwrap());
        let region = Region::new(0, MEM, map.clone(), 0).unwrap();
        let mem = Arc::new(GuestMemory::from_regions(vec![region]).unwrap());
        Ring { map, mem, layout: RingLayout::at(0x1000, size), avail_idx: 0 }
    }

    /// Memory made of two regions that are adjacent in guest-physical space
    /// but not in the mapping: [0, MEM/2) maps to the second half, [MEM/2, MEM)
    /// to the first, so a buffer crossing MEM/2 becomes two host pieces.
    pub fn new_two_regions(size: u16) -> Ring {
        let map = Arc::new(Mapping::anonymous(MEM as usize).unwrap());
        let half = MEM / 2;
        let a = Region::new(0, half, map.clone(), half).unwrap();
        let b = Region::new(half, half, map.clone(), 0).unwrap();
        let mem = Arc::new(GuestMemory::from_regions(vec![a, b]).unwrap());
        Ring { map, mem, layout: RingLayout::at(0x1000, size), avail_idx: 0 }
    }

    /// Where guest-physical `gpa` lies in this process, through the memory table.
    pub fn host(&self, gpa: u64) -> u64 {
        self.mem.host_addr(gpa).expect("test address inside guest memory") as u64
    }

    /// The mapping offset of a host address (the guest-physical address in
    /// one-region memory).
    pub fn gpa_of(&self, host: usize) -> u64 {
        (host - self.map.host_range().0) as u64
    }

    /// Where the mapping starts in this process.
    pub fn base(&self) -> u64 {
        self.map.host_range().0 as u64
    }

    fn w16(&self, gpa: u64, v: u16) {
        assert!(self.mem.write(gpa, &v.to_le_bytes()));
    }
    fn r16(&self, gpa: u64) -> u16 {
        let mut b = [0u8; 2];
        assert!(self.mem.read(gpa, &mut b));
        u16::from_le_bytes(b)
    }
    fn r32(&self, gpa: u64) -> u32 {
        let mut b = [0u8; 4];
        assert!(self.mem.read(gpa, &mut b));
        u32::from_le_bytes(b)
    }

    /// Writes descriptor `i` of the table at `table` (gpa).
    pub fn desc_at(&self, table: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..16].copy_from_slice(&next.to_le_bytes());
        assert!(self.mem.write(table + 16 * i as u64, &b));
    }

    /// Writes descriptor `i` of the ring's own table.
    pub fn desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        self.desc_at(self.layout.desc, i, addr, len, flags, next);
    }

    /// Makes `heads` available and publishes avail.idx.
    pub fn publish(&mut self, heads: &[u16]) {
        for &h in heads {
            let slot = self.avail_idx % self.layout.size;
            self.w16(self.layout.avail + 4 + 2 * slot as u64, h);
            self.avail_idx = self.avail_idx.wrapping_add(1);
        }
        self.set_avail_idx(self.avail_idx);
    }

    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        self.w16(self.layout.avail + 2, idx);
    }

    pub fn set_avail_flags(&self, f: u16) {
        self.w16(self.layout.avail, f);
    }

    /// used_event (the last avail ring slot).
    pub fn set_used_event(&self, v: u16) {
        self.w16(self.layout.avail + 4 + 2 * self.layout.size as u64, v);
    }

    pub fn used_idx(&self) -> u16 {
        self.r16(self.layout.used + 2)
    }

    pub fn used_flags(&self) -> u16 {
        self.r16(self.layout.used)
    }

    /// avail_event (after the last used ring element).
    pub fn avail_event(&self) -> u16 {
        self.r16(self.layout.used + 4 + 8 * self.layout.size as u64)
    }

    /// Used element in slot `i` (mod size): (id, len).
    pub fn used(&self, i: u16) -> (u32, u32) {
        let slot = (i % self.layout.size) as u64;
        let base = self.layout.used + 4 + 8 * slot;
        (self.r32(base), self.r32(base + 4))
    }

    pub fn config(&self, features: u64, next_avail: u16) -> SplitConfig {
        SplitConfig {
            size: self.layout.size,
            desc: self.layout.desc,
            avail: self.layout.avail,
            used: self.layout.used,
            features,
            next_avail,
        }
    }

    /// The device side over this ring.
    pub fn device(&self, features: u64) -> SplitQueue {
        SplitQueue::new(self.mem.clone(), self.config(features, self.avail_idx)).expect("ring set-up")
    }
}

pub const NEXT: u16 = VRING_DESC_F_NEXT;
pub const WRITE: u16 = VRING_DESC_F_WRITE;
pub const INDIRECT: u16 = VRING_DESC_F_INDIRECT;
pub const ALL: u64 = features::VERSION_1 | features::INDIRECT_DESC;
pub const ALL_EVENT_IDX: u64 = ALL | features::EVENT_IDX;
