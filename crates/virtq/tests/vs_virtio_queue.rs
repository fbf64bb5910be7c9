//! Differential test: our split-ring device side and rust-vmm's
//! `virtio-queue` read the same random rings and must agree on which chains
//! are valid, their heads, and each valid chain's descriptors.
//!
//! The generator writes well-formed chains (direct and indirect, readable
//! then writable) and two kinds of broken ones that both engines must refuse:
//! a `next` past the table, and a loop. virtio-queue does not refuse a chain
//! outright: its iterator stops early, so a chain it "refuses" is one whose
//! last yielded descriptor still has NEXT set. (Checks that only we make,
//! such as direction order or buffers outside memory, are left out here:
//! virtio-queue leaves them to the device.)

mod support;

use proptest::prelude::*;
use support::*;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use virtq::{Access, Batch};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryMmap};

#[derive(Clone, Debug)]
enum Kind {
    Good,
    NextPastTable,
    Loop,
}

#[derive(Clone, Debug)]
struct ChainSpec {
    readable: usize,
    writable: usize,
    indirect: bool,
    kind: Kind,
}

fn chain_spec() -> impl Strategy<Value = ChainSpec> {
    (
        0usize..3,
        0usize..3,
        any::<bool>(),
        prop_oneof![6 => Just(Kind::Good), 1 => Just(Kind::NextPastTable), 1 => Just(Kind::Loop)],
    )
        .prop_map(|(r, w, indirect, kind)| ChainSpec { readable: r.max(1), writable: w, indirect, kind })
}

/// (head, descriptors as (gpa, len, writable)) of each chain an engine accepts,
/// or None for a refused one, in avail order.
type Outcome = Vec<Option<(u16, Vec<(u64, u32, bool)>)>>;

fn split_hi_lo(a: u64) -> (Option<u32>, Option<u32>) {
    (Some(a as u32), Some((a >> 32) as u32))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn both_engines_agree(specs in prop::collection::vec(chain_spec(), 1..16), start in any::<u16>()) {
        let size = 64u16;
        let mut r = Ring::new(size);
        r.set_avail_idx(start);
        let mut ours_q = r.device(ALL);

        // Write the chains.
        let mut next_desc = 0u16;
        let mut next_buf = BUFS;
        let mut heads = vec![];
        for (ci, s) in specs.iter().enumerate() {
            let n = s.readable + s.writable;
            let bufs: Vec<(u64, u32, bool)> = (0..n)
                .map(|i| {
                    let b = (next_buf, 1 + ((ci * 13 + i * 7) % 1000) as u32, i >= s.readable);
                    next_buf += 1024;
                    b
                })
                .collect();
            let (table, first, table_len) = if s.indirect {
                let t = next_buf;
                next_buf += 16 * (n as u64 + 1);
                (t, 0u16, n as u16)
            } else {
                let f = next_desc;
                next_desc += n as u16;
                (r.layout.desc, f, size)
            };
            for (i, &(a, l, w)) in bufs.iter().enumerate() {
                let last = i + 1 == n;
                let mut flags = if w { WRITE } else { 0 };
                let mut next = first + i as u16 + 1;
                if last {
                    match s.kind {
                        Kind::Good => {}
                        Kind::NextPastTable => {
                            flags |= NEXT;
                            next = table_len + 3;
                        }
                        Kind::Loop => {
                            flags |= NEXT;
                            next = first;
                        }
                    }
                } else {
                    flags |= NEXT;
                }
                r.desc_at(table, first + i as u16, a, l, flags, next);
            }
            let head = if s.indirect {
                let h = next_desc;
                next_desc += 1;
                r.desc(h, table, 16 * n as u32, INDIRECT, 0);
                h
            } else {
                first
            };
            heads.push(head);
        }
        r.publish(&heads);

        // Ours, one avail entry at a time.
        let mut ours: Outcome = vec![];
        let mut b = Batch::new();
        for _ in 0..heads.len() {
            let before = ours_q.next_avail();
            let n = ours_q.pop_batch(&mut b, 1, Access::ReadThenWrite);
            prop_assert_eq!(ours_q.next_avail(), before.wrapping_add(1));
            if n == 1 {
                let c = &b.chains[0];
                let descs = b
                    .readable(c)
                    .segs()
                    .iter()
                    .map(|s| (r.gpa_of(s.host_addr()), s.len(), false))
                    .chain(b.writable(c).segs().iter().map(|s| (r.gpa_of(s.host_addr()), s.len(), true)))
                    .collect();
                ours.push(Some((c.head, descs)));
            } else {
                ours.push(None);
            }
        }

        // virtio-queue over a copy of the same bytes.
        let gm = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
        let mut bytes = vec![0u8; MEM as usize];
        assert!(r.mem.read(0, &mut bytes));
        gm.write_slice(&bytes, GuestAddress(0)).unwrap();
        let mut vq = Queue::new(size).unwrap();
        vq.set_size(size);
        let (l, h) = split_hi_lo(r.layout.desc);
        vq.set_desc_table_address(l, h);
        let (l, h) = split_hi_lo(r.layout.avail);
        vq.set_avail_ring_address(l, h);
        let (l, h) = split_hi_lo(r.layout.used);
        vq.set_used_ring_address(l, h);
        vq.set_next_avail(start);
        vq.set_ready(true);
        let mut theirs: Outcome = vec![];
        for chain in vq.iter(&gm).unwrap() {
            let head = chain.head_index();
            let descs: Vec<_> = chain.collect();
            let complete = descs.last().map(|d| !d.has_next()).unwrap_or(false);
            if complete {
                theirs.push(Some((
                    head,
                    descs.iter().map(|d| (d.addr().raw_value(), d.len(), d.is_write_only())).collect(),
                )));
            } else {
                theirs.push(None);
            }
        }
        prop_assert_eq!(&ours, &theirs);
        // And both agree with what was written.
        for (o, s) in ours.iter().zip(&specs) {
            prop_assert_eq!(o.is_some(), matches!(s.kind, Kind::Good), "spec {:?}", s);
        }
    }
}
