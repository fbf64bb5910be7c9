//! The device side of the split ring against hand-written rings: what a
//! well-formed chain yields, and the exact outcome of each malformed one
//! (not returned, completed with length 0, counted under its reason).

mod support;

use support::*;
use virtq::{Access, Batch, SetupError, SplitQueue};

type Popped = Vec<(u16, Vec<(u64, u32)>, Vec<(u64, u32)>)>;

/// Pops a batch and lists each chain's head, readable and writable segments.
fn pop(q: &mut SplitQueue, max: usize, access: Access) -> (Batch, Popped) {
    let mut b = Batch::new();
    q.pop_batch(&mut b, max, access);
    let chains = b.chains.clone();
    let out = chains
        .iter()
        .map(|c| {
            let r = b.readable(c).segs().iter().map(|s| (s.host_addr() as u64, s.len())).collect();
            let w = b.writable(c).segs().iter().map(|s| (s.host_addr() as u64, s.len())).collect();
            (c.head, r, w)
        })
        .collect();
    (b, out)
}

fn h(r: &Ring, gpa: u64) -> u64 {
    r.host(gpa)
}

#[test]
fn single_readable_descriptor() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.desc(3, BUFS, 100, 0, 0);
    r.publish(&[3]);
    let (b, got) = pop(&mut q, 32, Access::ReadOnly);
    assert_eq!(got, vec![(3, vec![(h(&r, BUFS), 100)], vec![])]);
    assert_eq!(b.chains[0].read_len, 100);
    assert_eq!(q.stats.chains, 1);
    assert_eq!(q.stats.bad_chains, 0);
}

#[test]
fn readable_then_writable_chain() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.desc(0, BUFS, 16, NEXT, 5);
    r.desc(5, BUFS + 100, 1, NEXT | WRITE, 2);
    r.desc(2, BUFS + 200, 7, WRITE, 0);
    r.publish(&[0]);
    let (b, got) = pop(&mut q, 32, Access::ReadThenWrite);
    assert_eq!(got, vec![(0, vec![(h(&r, BUFS), 16)], vec![(h(&r, BUFS + 100), 1), (h(&r, BUFS + 200), 7)])]);
    assert_eq!((b.chains[0].read_len, b.chains[0].write_len), (16, 8));
}

#[test]
fn indirect_table() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    let table = BUFS + 0x10000;
    r.desc_at(table, 0, BUFS, 10, NEXT, 1);
    r.desc_at(table, 1, BUFS + 64, 20, WRITE, 0);
    r.desc(4, table, 32, INDIRECT, 0);
    r.publish(&[4]);
    let (_, got) = pop(&mut q, 32, Access::ReadThenWrite);
    assert_eq!(got, vec![(4, vec![(h(&r, BUFS), 10)], vec![(h(&r, BUFS + 64), 20)])]);
}

#[test]
fn a_buffer_crossing_regions_becomes_two_pieces() {
    let mut r = Ring::new_two_regions(8);
    let mut q = r.device(ALL);
    let half = MEM / 2;
    r.desc(0, half - 10, 30, 0, 0);
    r.publish(&[0]);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1);
    let segs = b.readable(&b.chains[0]).segs();
    assert_eq!(segs.len(), 2);
    let base = r.base();
    // [0, half) is the mapping's second half; [half, MEM) its first.
    assert_eq!((segs[0].host_addr() as u64 - base, segs[0].len()), (half + half - 10, 10));
    assert_eq!((segs[1].host_addr() as u64 - base, segs[1].len()), (0, 20));
    assert_eq!(b.chains[0].read_len, 30);
}

/// Publishes one bad chain (written by `setup` at head 0) and checks it is
/// not returned, completed with len 0, and counted by `counter`.
fn rejected(setup: impl FnOnce(&Ring), features: u64, access: Access, counter: fn(&virtq::QueueStats) -> u64) {
    let mut r = Ring::new(8);
    let mut q = r.device(features);
    setup(&r);
    // A good chain after the bad one still gets through (in the next batch).
    r.desc(7, BUFS + 0x800, 64, if access == Access::WriteOnly { WRITE } else { 0 }, 0);
    r.publish(&[0, 7]);
    let mut b = Batch::new();
    let mut heads = vec![];
    for _ in 0..2 {
        q.pop_batch(&mut b, 32, access);
        heads.extend(b.chains.iter().map(|c| c.head));
        for c in &b.chains {
            q.add_used(c.head, 1);
        }
        q.flush_used();
    }
    assert_eq!(heads, vec![7], "only the good chain is returned");
    assert_eq!(q.stats.bad_chains, 1);
    assert_eq!(counter(&q.stats), 1, "counted under its reason: {:?}", q.stats);
    assert_eq!(r.used_idx(), 2);
    assert_eq!(r.used(0), (0, 0), "bad chain completed with length 0");
    assert_eq!(r.used(1), (7, 1));
    assert!(!q.is_broken());
}

#[test]
fn loop_is_rejected() {
    rejected(
        |r| {
            r.desc(0, BUFS, 8, NEXT, 1);
            r.desc(1, BUFS, 8, NEXT, 0);
        },
        ALL,
        Access::ReadOnly,
        |s| s.bad_loop,
    );
}

#[test]
fn chain_longer_than_the_queue_is_rejected() {
    // 8 descriptors all chained in a cycle 0->1->..->6->0: never ends.
    rejected(
        |r| {
            for i in 0..7u16 {
                r.desc(i, BUFS, 8, NEXT, (i + 1) % 7);
            }
        },
        ALL,
        Access::ReadOnly,
        |s| s.bad_loop,
    );
}

#[test]
fn next_past_the_queue_is_rejected() {
    rejected(|r| r.desc(0, BUFS, 8, NEXT, 8), ALL, Access::ReadOnly, |s| s.bad_index);
}

#[test]
fn address_outside_memory_is_rejected() {
    rejected(|r| r.desc(0, MEM + 4096, 8, 0, 0), ALL, Access::ReadOnly, |s| s.bad_address);
}

#[test]
fn buffer_straddling_the_end_of_memory_is_rejected() {
    rejected(|r| r.desc(0, MEM - 4, 8, 0, 0), ALL, Access::ReadOnly, |s| s.bad_address);
}

#[test]
fn four_gib_length_is_rejected() {
    rejected(|r| r.desc(0, BUFS, u32::MAX, 0, 0), ALL, Access::ReadOnly, |s| s.bad_address);
}

#[test]
fn address_that_wraps_u64_is_rejected() {
    rejected(|r| r.desc(0, u64::MAX - 2, 8, 0, 0), ALL, Access::ReadOnly, |s| s.bad_address);
}

#[test]
fn writable_where_readable_is_required_is_rejected() {
    rejected(|r| r.desc(0, BUFS, 8, WRITE, 0), ALL, Access::ReadOnly, |s| s.bad_direction);
}

#[test]
fn readable_where_writable_is_required_is_rejected() {
    rejected(|r| r.desc(0, BUFS, 8, 0, 0), ALL, Access::WriteOnly, |s| s.bad_direction);
}

#[test]
fn readable_after_writable_is_rejected() {
    rejected(
        |r| {
            r.desc(0, BUFS, 8, WRITE | NEXT, 1);
            r.desc(1, BUFS, 8, 0, 0);
        },
        ALL,
        Access::ReadThenWrite,
        |s| s.bad_direction,
    );
}

#[test]
fn indirect_without_the_feature_is_rejected() {
    rejected(
        |r| {
            r.desc_at(BUFS + 0x1000, 0, BUFS, 8, 0, 0);
            r.desc(0, BUFS + 0x1000, 16, INDIRECT, 0);
        },
        virtq::ring::features::VERSION_1,
        Access::ReadOnly,
        |s| s.bad_indirect,
    );
}

#[test]
fn indirect_inside_indirect_is_rejected() {
    rejected(
        |r| {
            r.desc_at(BUFS + 0x2000, 0, BUFS, 8, 0, 0);
            r.desc_at(BUFS + 0x1000, 0, BUFS + 0x2000, 16, INDIRECT, 0);
            r.desc(0, BUFS + 0x1000, 16, INDIRECT, 0);
        },
        ALL,
        Access::ReadOnly,
        |s| s.bad_indirect,
    );
}

#[test]
fn indirect_length_not_a_multiple_of_16_is_rejected() {
    rejected(|r| r.desc(0, BUFS + 0x1000, 24, INDIRECT, 0), ALL, Access::ReadOnly, |s| s.bad_indirect);
}

#[test]
fn indirect_of_length_zero_is_rejected() {
    rejected(|r| r.desc(0, BUFS + 0x1000, 0, INDIRECT, 0), ALL, Access::ReadOnly, |s| s.bad_indirect);
}

#[test]
fn indirect_with_next_is_rejected() {
    rejected(
        |r| {
            r.desc_at(BUFS + 0x1000, 0, BUFS, 8, 0, 0);
            r.desc(0, BUFS + 0x1000, 16, INDIRECT | NEXT, 1);
            r.desc(1, BUFS, 8, 0, 0);
        },
        ALL,
        Access::ReadOnly,
        |s| s.bad_indirect,
    );
}

#[test]
fn loop_inside_an_indirect_table_is_rejected() {
    rejected(
        |r| {
            let t = BUFS + 0x1000;
            r.desc_at(t, 0, BUFS, 8, NEXT, 1);
            r.desc_at(t, 1, BUFS, 8, NEXT, 0);
            r.desc(0, t, 32, INDIRECT, 0);
        },
        ALL,
        Access::ReadOnly,
        |s| s.bad_loop,
    );
}

#[test]
fn indirect_table_outside_memory_is_rejected() {
    rejected(|r| r.desc(0, MEM - 16, 32, INDIRECT, 0), ALL, Access::ReadOnly, |s| s.bad_address);
}

#[test]
fn zero_length_descriptor_is_allowed_and_adds_no_segment() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.desc(0, BUFS, 0, NEXT, 1);
    r.desc(1, BUFS, 8, 0, 0);
    r.publish(&[0]);
    let (_, got) = pop(&mut q, 8, Access::ReadOnly);
    assert_eq!(got, vec![(0, vec![(h(&r, BUFS), 8)], vec![])]);
}

#[test]
fn head_past_the_queue_breaks_the_ring() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.publish(&[8]);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 0);
    assert!(q.is_broken());
    assert_eq!(q.stats.bad_index, 1);
    assert_eq!(r.used_idx(), 0, "nothing to give back");
}

#[test]
fn avail_index_running_ahead_breaks_the_ring() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.desc(0, BUFS, 8, 0, 0);
    r.set_avail_idx(9);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 32, Access::ReadOnly), 0);
    assert!(q.is_broken());
    // Once broken it stays so: nothing more is popped.
    r.set_avail_idx(1);
    assert_eq!(q.pop_batch(&mut b, 32, Access::ReadOnly), 0);
}

#[test]
fn a_bad_chain_after_good_ones_ends_the_batch_before_it() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.desc(0, BUFS, 8, 0, 0);
    r.desc(1, MEM + 1, 8, 0, 0);
    r.desc(2, BUFS, 8, 0, 0);
    r.publish(&[0, 1, 2]);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1);
    assert!(b.ended_before_bad);
    assert_eq!(q.next_avail(), 1, "the bad chain is not consumed yet");
    q.unpop(1);
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1, "the good chain again, then the bad ends it");
    q.add_used(0, 0);
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1);
    assert_eq!(b.chains[0].head, 2);
    assert!(!b.ended_before_bad);
    assert_eq!(q.stats.bad_address, 1);
}

#[test]
fn batch_respects_max_and_reads_avail_once() {
    let mut r = Ring::new(16);
    let mut q = r.device(ALL);
    for i in 0..16 {
        r.desc(i, BUFS + 64 * i as u64, 64, 0, 0);
    }
    r.publish(&[0, 1, 2, 3, 4]);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 3, Access::ReadOnly), 3);
    // Published after the pop: the next pop still sees what the first read
    // showed (2 more) without re-reading, since it asks for no more than that.
    r.publish(&[5, 6]);
    assert_eq!(q.pop_batch(&mut b, 2, Access::ReadOnly), 2);
    assert_eq!(b.chains.iter().map(|c| c.head).collect::<Vec<_>>(), vec![3, 4]);
    // Asking for more re-reads avail.idx and finds the new ones.
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 2);
    assert_eq!(b.chains.iter().map(|c| c.head).collect::<Vec<_>>(), vec![5, 6]);
}

#[test]
fn used_index_moves_only_at_publish() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    q.add_used(3, 10);
    q.add_used(1, 20);
    assert_eq!(r.used_idx(), 0);
    q.publish_used();
    assert_eq!(r.used_idx(), 2);
    assert_eq!((r.used(0), r.used(1)), ((3, 10), (1, 20)));
    assert!(!q.flush_used(), "nothing new to publish");
    let _ = &mut r;
}

#[test]
fn indexes_wrap_at_16_bits() {
    let mut r = Ring::new(4);
    r.set_avail_idx(65534);
    let mut q = r.device(ALL);
    for i in 0..4 {
        r.desc(i, BUFS + 64 * i as u64, 64, 0, 0);
    }
    r.publish(&[0, 1, 2, 3]);
    assert_eq!(r.avail_idx, 2);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 4);
    assert_eq!(b.chains.iter().map(|c| c.head).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert_eq!(q.next_avail(), 2);
    assert!(!q.is_broken());
}

#[test]
fn notify_with_event_idx_follows_used_event() {
    let r = Ring::new(8);
    let mut q = r.device(ALL_EVENT_IDX);
    // First decision after set-up: always notify.
    q.add_used(0, 0);
    q.publish_used();
    assert!(q.needs_notify());
    // used_event = 5: the driver wants to hear when used.idx passes 5.
    r.set_used_event(5);
    q.add_used(1, 0);
    q.add_used(2, 0);
    q.publish_used(); // used.idx 1 -> 3: 5 not crossed
    assert!(!q.needs_notify());
    for i in 3..7 {
        q.add_used(i, 0);
    }
    q.publish_used(); // 3 -> 7: crosses 5
    assert!(q.needs_notify());
    assert!(!q.needs_notify(), "nothing new since");
}

#[test]
fn notify_without_event_idx_follows_no_interrupt() {
    let r = Ring::new(8);
    let mut q = r.device(ALL);
    r.set_avail_flags(virtq::ring::VRING_AVAIL_F_NO_INTERRUPT);
    q.add_used(0, 0);
    q.publish_used();
    assert!(!q.needs_notify());
    r.set_avail_flags(0);
    q.add_used(1, 0);
    q.publish_used();
    assert!(q.needs_notify());
}

#[test]
fn kick_suppression_without_event_idx() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    q.disable_notifications();
    assert_eq!(r.used_flags(), virtq::ring::VRING_USED_F_NO_NOTIFY);
    assert!(!q.enable_notifications(), "nothing pending");
    assert_eq!(r.used_flags(), 0);
    r.desc(0, BUFS, 8, 0, 0);
    r.publish(&[0]);
    q.disable_notifications();
    assert!(q.enable_notifications(), "a chain arrived: do not sleep");
}

#[test]
fn kick_suppression_with_event_idx_writes_avail_event() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL_EVENT_IDX);
    r.desc(0, BUFS, 8, 0, 0);
    r.publish(&[0, 0]);
    let mut b = Batch::new();
    q.pop_batch(&mut b, 1, Access::ReadOnly);
    assert!(q.enable_notifications(), "one still pending");
    assert_eq!(r.avail_event(), 1, "avail_event = next avail index");
    assert_eq!(r.used_flags(), 0, "flags are not used with EVENT_IDX");
}

#[test]
fn ring_set_up_refuses_bad_rings() {
    let r = Ring::new(8);
    let new = |cfg| SplitQueue::new(r.mem.clone(), cfg).err();
    let mut c = r.config(ALL, 0);
    c.size = 0;
    assert_eq!(new(c), Some(SetupError::BadSize));
    c.size = 6;
    assert_eq!(new(c), Some(SetupError::BadSize));
    let mut c = r.config(ALL, 0);
    c.desc += 8;
    assert_eq!(new(c), Some(SetupError::Misaligned));
    let mut c = r.config(ALL, 0);
    c.used = MEM - 16;
    assert_eq!(new(c), Some(SetupError::NotMapped));
    let mut c = r.config(ALL, 0);
    c.used = c.desc;
    assert_eq!(new(c), Some(SetupError::Overlap));
    let mut c = r.config(ALL, 0);
    c.used = c.avail;
    assert_eq!(new(c), Some(SetupError::Overlap));
}

#[test]
fn remap_keeps_the_position() {
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.desc(0, BUFS, 8, 0, 0);
    r.publish(&[0, 0, 0]);
    let mut b = Batch::new();
    q.pop_batch(&mut b, 2, Access::ReadOnly);
    q.add_used(0, 0);
    q.add_used(0, 0);
    let mut q2 = q.remap(r.mem.clone(), q.addrs()).unwrap();
    assert_eq!(q2.next_avail(), 2);
    assert_eq!(q2.next_used(), 2);
    assert_eq!(q2.pop_batch(&mut b, 8, Access::ReadOnly), 1);
}

#[test]
fn remap_follows_a_ring_that_moved() {
    // A new memory table can put the same frontend addresses at other
    // guest-physical addresses: the ring continues where it now is.
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.desc(0, BUFS, 8, 0, 0);
    r.publish(&[0]);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1);
    q.add_used(0, 0);
    q.flush_used();
    let (old, new) = (r.layout.desc, 0x20000);
    let mut bytes = vec![0u8; 0x1000];
    assert!(r.mem.read(old, &mut bytes));
    assert!(r.mem.write(new, &bytes));
    r.layout = virtq_driver::RingLayout::at(new, 8);
    let at = virtq::RingAddrs { desc: r.layout.desc, driver: r.layout.avail, device: r.layout.used };
    let mut q = q.remap(r.mem.clone(), at).unwrap();
    assert_eq!(q.addrs(), at);
    r.publish(&[0]);
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1);
    q.add_used(0, 0);
    q.flush_used();
    assert_eq!(r.used_idx(), 2, "used index written at the new place");
    let out = virtq::RingAddrs { desc: MEM, ..at };
    assert_eq!(q.remap(r.mem.clone(), out).err(), Some(SetupError::NotMapped));
}

#[test]
fn repop_refuses_a_batch_holding_another_table() {
    // A batch keeps one memory table mapped for all its chains: a chain of
    // another table may not join chains already there.
    let mut r = Ring::new(8);
    let mut q = r.device(ALL);
    r.desc(0, BUFS, 8, 0, 0);
    r.desc(1, BUFS + 64, 8, 0, 0);
    r.publish(&[0]);
    let mut b = Batch::new();
    assert_eq!(q.pop_batch(&mut b, 8, Access::ReadOnly), 1);
    let other = std::sync::Arc::new((*r.mem).clone());
    let mut q2 = q.remap(other, q.addrs()).unwrap();
    assert!(!q2.repop(1, &mut b, Access::ReadOnly));
    assert_eq!(b.chains.len(), 1, "the batch is as it was");
    assert!(q.repop(1, &mut b, Access::ReadOnly), "the batch's own table still joins");
    assert_eq!(b.chains.len(), 2);
    b.clear();
    assert!(q2.repop(1, &mut b, Access::ReadOnly), "an emptied batch takes any table");
}
