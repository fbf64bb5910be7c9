//! The split ring's device side against the project's own split driver
//! (`virtq-driver`) over one memfd: the device maps it as guest memory, the
//! driver maps it with its own type, and both see the same pages.

use std::sync::Arc;
use virtq::ring::features;
use virtq::{Access, Batch, GuestMemory, Mapping, Region, SplitConfig, SplitQueue};
use virtq_driver::{Buf, DriverMemory, RingLayout, SharedMemory, SplitDriver, Used};

const GPA: u64 = 0x10_0000;
const MEM: u64 = 1 << 20;

/// Our driver against the device side over the same memory: chains,
/// lengths, directions, indirect tables and kicks agree.
#[test]
fn round_trip_with_device_side() {
    let file = virtq_driver::memfd("split-driver-test", MEM, true).unwrap();
    let m = Arc::new(Mapping::map(&file, 0, MEM).unwrap());
    let gm = GuestMemory::from_regions(vec![Region::new(GPA, MEM, m, 0).unwrap()]).unwrap();
    let shared = Arc::new(SharedMemory::map(&file, 0, MEM).unwrap());
    let feats = features::EVENT_IDX | features::INDIRECT_DESC;
    let layout = RingLayout::at(GPA, 16);
    let mut drv = SplitDriver::new(DriverMemory::new(shared, GPA), layout, feats).unwrap();
    drv.set_indirect_pool(GPA + 0x4000, 4).unwrap();
    let cfg = SplitConfig {
        size: 16,
        desc: layout.desc,
        avail: layout.avail,
        used: layout.used,
        features: feats,
        next_avail: 0,
    };
    let mut dev = SplitQueue::new(Arc::new(gm), cfg).unwrap();
    let mut batch = Batch::new();
    let mut out = [Used::default(); 16];
    for round in 0..5000u64 {
        let k = (round % 5 + 1) as usize;
        for j in 0..k {
            let r = [Buf { addr: GPA + 0x8000 + 64 * j as u64, len: 12 }];
            let w = [Buf { addr: GPA + 0x9000, len: 100 + j as u32 }, Buf { addr: GPA + 0xa000, len: 7 }];
            if j % 2 == 0 {
                drv.add(&r, &w, round * 10 + j as u64).unwrap();
            } else {
                drv.add_indirect(&r, &w, round * 10 + j as u64).unwrap();
            }
        }
        let kick = drv.publish_and_check_kick();
        assert!(kick, "device re-enabled kicks at the index it had seen");
        assert_eq!(dev.pop_batch(&mut batch, 64, Access::ReadThenWrite), k);
        for c in &batch.chains {
            assert_eq!(c.read_len, 12);
            dev.add_used(c.head, c.write_len);
        }
        dev.publish_used();
        dev.enable_notifications();
        let n = drv.pop_used_batch(&mut out, false).unwrap();
        assert_eq!(n, k);
        for (j, u) in out[..n].iter().enumerate() {
            assert_eq!(u.token, round * 10 + j as u64);
            assert_eq!(u.len, 107 + j as u32);
        }
        assert_eq!(drv.num_free(), 16);
        assert_eq!(dev.stats.bad_chains, 0);
    }
}
