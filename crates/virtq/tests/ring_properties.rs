//! Property tests: the spec's invariants hold on random rings, hostile or not.

mod support;

use proptest::prelude::*;
use support::*;
use virtq::{Access, Batch};

#[derive(Clone, Debug)]
struct RawDesc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn raw_desc(size: u16) -> impl Strategy<Value = RawDesc> {
    (
        prop_oneof![
            8 => BUFS..MEM - 0x1000,
            1 => any::<u64>(),
            1 => MEM - 64..MEM + 64,
        ],
        prop_oneof![8 => 0u32..2048, 1 => any::<u32>()],
        0u16..8,
        prop_oneof![8 => 0..size, 1 => any::<u16>()],
    )
        .prop_map(|(addr, len, flags, next)| RawDesc { addr, len, flags, next })
}

fn ring_case() -> impl Strategy<Value = (u16, Vec<RawDesc>, Vec<u16>, u16, u8)> {
    (2u32..=6).prop_flat_map(|log| {
        let size = 1u16 << log;
        (
            Just(size),
            prop::collection::vec(raw_desc(size), size as usize),
            prop::collection::vec(prop_oneof![9 => 0..size, 1 => any::<u16>()], 0..(2 * size as usize)),
            any::<u16>(),
            0u8..3,
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// Whatever the ring holds: no panic, every segment inside guest memory,
    /// lengths add up, every consumed entry is either returned or completed
    /// empty and counted, and used.idx counts exactly the used elements.
    #[test]
    fn invariants_hold_on_random_rings((size, descs, heads, start, access) in ring_case()) {
        let mut r = Ring::new(size);
        r.set_avail_idx(start);
        let mut q = r.device(ALL_EVENT_IDX);
        for (i, d) in descs.iter().enumerate() {
            r.desc(i as u16, d.addr, d.len, d.flags, d.next);
        }
        // Publish at most `size` entries (more breaks the ring, tested elsewhere).
        let heads = &heads[..heads.len().min(size as usize)];
        r.publish(heads);
        let access = [Access::ReadOnly, Access::WriteOnly, Access::ReadThenWrite][access as usize];
        let lo = r.base();
        let hi = lo + MEM;
        let mut b = Batch::new();
        let mut returned = 0u64;
        let mut used_elems = 0u64;
        for _ in 0..(2 * size as usize + 2) {
            let n = q.pop_batch(&mut b, 1 + (start as usize % 7), access);
            if n == 0 && (q.pending() == 0 || q.is_broken()) {
                q.flush_used();
                break;
            }
            for c in &b.chains {
                let (rd, wr) = (b.readable(c), b.writable(c));
                for s in rd.segs().iter().chain(wr.segs()) {
                    let p = s.host_addr() as u64;
                    prop_assert!(!s.is_empty());
                    prop_assert!(p >= lo && p + s.len() as u64 <= hi, "segment outside memory");
                }
                prop_assert_eq!(rd.bytes() as u64, c.read_len as u64);
                prop_assert_eq!(wr.bytes() as u64, c.write_len as u64);
                match access {
                    Access::ReadOnly => prop_assert_eq!(c.write_len, 0),
                    Access::WriteOnly => prop_assert_eq!(c.read_len, 0),
                    Access::ReadThenWrite => {}
                }
                prop_assert!(c.head < size);
                q.add_used(c.head, 0);
                returned += 1;
                used_elems += 1;
            }
            q.flush_used();
        }
        // Every bad chain was completed empty, except a head index past the
        // queue, which breaks the ring (nothing to give back) and ends it.
        used_elems += q.stats.bad_chains - u64::from(q.is_broken());
        let consumed = q.next_avail().wrapping_sub(start) as u64;
        prop_assert_eq!(q.stats.chains, returned);
        if !q.is_broken() {
            prop_assert_eq!(consumed, heads.len() as u64, "every entry consumed");
            prop_assert_eq!(returned + q.stats.bad_chains, consumed);
        }
        prop_assert_eq!(r.used_idx() as u64, used_elems);
    }

    /// Well-formed chains come back exactly as written: same buffers, same
    /// order, readable before writable, across 16-bit index wrap-around.
    #[test]
    fn wellformed_chains_come_back_as_written(
        chains in prop::collection::vec((1usize..4, 0usize..4, any::<bool>()), 1..12),
        start in prop_oneof![Just(65530u16), any::<u16>()],
    ) {
        let size = 64u16;
        let mut r = Ring::new(size);
        r.set_avail_idx(start);
        let mut q = r.device(ALL);
        let mut next_desc = 0u16;
        let mut next_buf = BUFS;
        let mut want = vec![];
        let mut heads = vec![];
        for (ci, &(nr, nw, indirect)) in chains.iter().enumerate() {
            let n = nr + nw;
            let bufs: Vec<(u64, u32, bool)> = (0..n)
                .map(|i| {
                    let len = 1 + ((ci * 31 + i * 17) % 1500) as u32;
                    let b = (next_buf, len, i >= nr);
                    next_buf += 2048;
                    b
                })
                .collect();
            let head;
            if indirect {
                let table = next_buf;
                next_buf += 16 * n as u64 + 16;
                for (i, &(a, l, w)) in bufs.iter().enumerate() {
                    let flags = if w { WRITE } else { 0 } | if i + 1 < n { NEXT } else { 0 };
                    r.desc_at(table, i as u16, a, l, flags, i as u16 + 1);
                }
                head = next_desc;
                r.desc(head, table, 16 * n as u32, INDIRECT, 0);
                next_desc += 1;
            } else {
                head = next_desc;
                for (i, &(a, l, w)) in bufs.iter().enumerate() {
                    let flags = if w { WRITE } else { 0 } | if i + 1 < n { NEXT } else { 0 };
                    r.desc(next_desc, a, l, flags, next_desc + 1);
                    next_desc += 1;
                }
            }
            heads.push(head);
            want.push((head, bufs));
        }
        r.publish(&heads);
        let mut b = Batch::new();
        let mut got = vec![];
        while q.pending() > 0 {
            q.pop_batch(&mut b, 5, Access::ReadThenWrite);
            for c in &b.chains {
                let segs: Vec<(u64, u32, bool)> = b
                    .readable(c)
                    .segs()
                    .iter()
                    .map(|s| (r.gpa_of(s.host_addr()), s.len(), false))
                    .chain(b.writable(c).segs().iter().map(|s| (r.gpa_of(s.host_addr()), s.len(), true)))
                    .collect();
                got.push((c.head, segs));
            }
        }
        prop_assert_eq!(got, want);
        prop_assert_eq!(q.stats.bad_chains, 0);
        prop_assert_eq!(q.next_avail(), start.wrapping_add(chains.len() as u16));
    }
}
