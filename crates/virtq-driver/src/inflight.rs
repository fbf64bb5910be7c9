//! What both ring layouts share on the driver side: the bookkeeping of
//! chains by id (split: head descriptor; packed: buffer id), written once,
//! and the one loop that takes used elements, checking what the device
//! returns.
//!
//! A layout only says how it reads its used ring ([`UsedRing`]): how many
//! used elements are ready, what the next one says, how to step past a
//! chain taken, and what to free. Everything else (in-flight and kept
//! chains, tokens, IN_ORDER batches, the checks against a hostile device,
//! batch popping) is here, monomorphized per layout: no dynamic dispatch and
//! no allocation per element.

use crate::{DriverError, DriverStats, Used};
use std::collections::VecDeque;

/// One id's chain, in private memory (never in the shared ring).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ChainState {
    /// Descriptors (split) or ring slots (packed) the chain takes; 0: the id
    /// holds no chain.
    pub(crate) ndesc: u16,
    /// Made available and not yet returned by the device.
    pub(crate) in_flight: bool,
    /// The length reported for this chain when an IN_ORDER device skips over
    /// it (its used element names a later chain).
    pub(crate) skip_len: u32,
    /// The caller's token, returned with the completion.
    pub(crate) token: u64,
}

/// The chains of one queue by id, those in flight, and the IN_ORDER state.
pub(crate) struct InFlight {
    chains: Vec<ChainState>,
    /// Chains in flight.
    count: u16,
    in_order: bool,
    /// Ids in flight in the order they were made available (IN_ORDER only).
    order: VecDeque<u16>,
    /// IN_ORDER: the used element (id, len) that ends the batch being taken;
    /// the chains made available before `id` come back first.
    batch_end: Option<(u16, u32)>,
}

impl InFlight {
    /// Room for ids `0..size`, none allocated.
    pub(crate) fn new(size: u16, in_order: bool) -> InFlight {
        InFlight {
            chains: vec![ChainState::default(); size as usize],
            count: 0,
            in_order,
            order: VecDeque::with_capacity(if in_order { size as usize } else { 0 }),
            batch_end: None,
        }
    }

    /// Chains in flight.
    #[inline]
    pub(crate) fn count(&self) -> u16 {
        self.count
    }

    /// Whether an IN_ORDER batch is partly taken: its remaining chains are
    /// known to be used without reading the ring again.
    #[inline]
    pub(crate) fn batch_pending(&self) -> bool {
        self.batch_end.is_some()
    }

    /// Descriptors (ring slots) of the chains left in the pending IN_ORDER
    /// batch, the one its used element names included.
    pub(crate) fn pending_ndesc(&self) -> u32 {
        let Some((end, _)) = self.batch_end else { return 0 };
        let mut n = 0;
        for &id in &self.order {
            n += self.chains[id as usize].ndesc as u32;
            if id == end {
                break;
            }
        }
        n
    }

    /// Records a new chain (not yet available) under `id` (< size).
    #[inline]
    pub(crate) fn allocate(&mut self, id: u16, ndesc: u16, skip_len: u32, token: u64) {
        self.chains[id as usize] = ChainState { ndesc, in_flight: false, skip_len, token };
    }

    /// `id`'s chain if it is kept: allocated and not in flight.
    #[inline]
    pub(crate) fn kept(&self, id: u16) -> Result<ChainState, DriverError> {
        match self.chains.get(id as usize) {
            Some(c) if c.ndesc != 0 && !c.in_flight => Ok(*c),
            _ => Err(DriverError::NotKept),
        }
    }

    /// Sets the in-order skip length of a kept chain.
    #[inline]
    pub(crate) fn set_skip_len(&mut self, id: u16, len: u32) {
        self.chains[id as usize].skip_len = len;
    }

    /// `id`'s allocated chain (< size) was made available.
    #[inline]
    pub(crate) fn posted(&mut self, id: u16) {
        self.chains[id as usize].in_flight = true;
        if self.in_order {
            self.order.push_back(id);
        }
        self.count += 1;
    }

    /// `id` (< size) holds no chain any more.
    #[inline]
    pub(crate) fn free(&mut self, id: u16) {
        self.chains[id as usize] = ChainState::default();
    }

    /// Checks a used element's id: a chain of this queue, in flight.
    #[inline]
    fn check_used(&self, id: u16) -> Result<(), DriverError> {
        match self.chains.get(id as usize) {
            None => Err(DriverError::BadUsedId),
            Some(c) if !c.in_flight => Err(DriverError::UsedNotInFlight),
            Some(_) => Ok(()),
        }
    }

    /// IN_ORDER (virtio 1.2, 2.7.9 and 2.8.20): a used element stands for
    /// every chain made available up to the one it names. Returns the oldest
    /// chain in flight, with the element's length if it is the one named,
    /// else its skip length.
    #[inline]
    fn next_in_order(&mut self, id: u16, len: u32) -> Result<(u16, u32), DriverError> {
        self.batch_end = Some((id, len));
        let front = self.order.pop_front().ok_or(DriverError::UsedIdxAhead)?;
        if front == id {
            self.batch_end = None;
            Ok((id, len))
        } else {
            Ok((front, self.chains[front as usize].skip_len))
        }
    }
}

/// How one ring layout reads the device's used elements; the rest of taking
/// them is [`take_used`], written once for both.
pub(crate) trait UsedRing {
    /// The queue's chains.
    fn chains(&mut self) -> &mut InFlight;

    /// Counters.
    fn stats_mut(&mut self) -> &mut DriverStats;

    /// How many chains the device has returned that were not taken yet (at
    /// least one, if any): `in_flight` chains are out, and `batch_pending`
    /// says an IN_ORDER batch is partly taken. An error if the ring claims
    /// more than is in flight.
    fn used_count(&mut self, in_flight: u16, batch_pending: bool) -> Result<u16, DriverError>;

    /// The next used element, (id, len), raw; called after `used_count`
    /// found one, with any fence the layout needs before reading it.
    fn read_used(&self) -> (u16, u32);

    /// Steps the used position past one chain taken, of `ndesc` descriptors.
    fn step_used(&mut self, ndesc: u16);

    /// The chain `id` of `ndesc` descriptors came back: give back what the
    /// layout holds for it (ring slots, descriptors; its id too unless
    /// `keep`). The shared bookkeeping is already updated, and freed unless
    /// `keep`.
    fn retire(&mut self, id: u16, ndesc: u16, keep: bool);
}

/// Used chains ready to take (see [`UsedRing::used_count`]).
#[inline]
pub(crate) fn used_ready<R: UsedRing>(q: &mut R) -> Result<u16, DriverError> {
    let t = q.chains();
    let (count, pending) = (t.count, t.batch_end.is_some());
    q.used_count(count, pending)
}

/// Takes the next used chain, checking what the device wrote: an id past
/// the queue (`BadUsedId`) or not in flight (`UsedNotInFlight`) is an error
/// and changes nothing. With `keep` the chain stays allocated for a repost.
#[inline(always)]
pub(crate) fn take_used<R: UsedRing>(q: &mut R, keep: bool) -> Result<Option<Used>, DriverError> {
    if used_ready(q)? == 0 {
        return Ok(None);
    }
    let (id, len) = match q.chains().batch_end {
        Some(e) => e,
        None => {
            let (id, len) = q.read_used();
            q.chains().check_used(id)?;
            (id, len)
        }
    };
    let t = q.chains();
    // Either checked above or taken from `order`, which holds only ids in flight.
    let (id, len) = if t.in_order { t.next_in_order(id, len)? } else { (id, len) };
    let c = &mut t.chains[id as usize];
    c.in_flight = false;
    let (ndesc, token) = (c.ndesc, c.token);
    t.count -= 1;
    if !keep {
        t.free(id);
    }
    q.step_used(ndesc);
    q.stats_mut().used += 1;
    q.retire(id, ndesc, keep);
    Ok(Some(Used { id, len, token }))
}

/// Takes up to `out.len()` used chains (keeping or freeing them). On a
/// device error the chains taken so far are in `out[..n]`, taken for good,
/// and the error is returned.
#[inline]
pub(crate) fn pop_used_batch<R: UsedRing>(q: &mut R, out: &mut [Used], keep: bool) -> Result<usize, DriverError> {
    let mut n = 0;
    while n < out.len() {
        match take_used(q, keep)? {
            Some(u) => {
                out[n] = u;
                n += 1;
            }
            None => break,
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring whose device returns the elements queued in `elems`, each
    /// standing for one used index (split-like).
    struct Fake {
        chains: InFlight,
        stats: DriverStats,
        elems: VecDeque<(u16, u32)>,
        steps: Vec<u16>,
        retired: Vec<(u16, bool)>,
    }

    impl UsedRing for Fake {
        fn chains(&mut self) -> &mut InFlight {
            &mut self.chains
        }
        fn stats_mut(&mut self) -> &mut DriverStats {
            &mut self.stats
        }
        fn used_count(&mut self, in_flight: u16, _: bool) -> Result<u16, DriverError> {
            let n = self.elems.len() as u16;
            if n > in_flight {
                return Err(DriverError::UsedIdxAhead);
            }
            Ok(n)
        }
        fn read_used(&self) -> (u16, u32) {
            self.elems[0]
        }
        fn step_used(&mut self, ndesc: u16) {
            self.elems.pop_front();
            self.steps.push(ndesc);
        }
        fn retire(&mut self, id: u16, _: u16, keep: bool) {
            self.retired.push((id, keep));
        }
    }

    fn fake(size: u16, in_order: bool) -> Fake {
        let mut chains = InFlight::new(size, in_order);
        for id in 0..size {
            chains.allocate(id, id + 1, 100 + id as u32, 1000 + id as u64);
        }
        Fake { chains, stats: DriverStats::default(), elems: VecDeque::new(), steps: vec![], retired: vec![] }
    }

    #[test]
    fn a_hostile_element_changes_nothing() {
        let mut q = fake(4, false);
        q.chains.posted(2);
        q.elems.push_back((9, 1));
        assert_eq!(take_used(&mut q, false), Err(DriverError::BadUsedId));
        q.elems[0] = (1, 1);
        assert_eq!(take_used(&mut q, false), Err(DriverError::UsedNotInFlight));
        assert_eq!((q.chains.count(), q.stats.used, q.steps.len()), (1, 0, 0));
        q.elems.push_back((2, 5));
        assert_eq!(take_used(&mut q, false), Err(DriverError::UsedIdxAhead));
        q.elems.pop_front();
        assert_eq!(take_used(&mut q, true), Ok(Some(Used { id: 2, len: 5, token: 1002 })));
        assert_eq!(q.chains.kept(2).map(|c| c.ndesc), Ok(3), "kept");
        assert_eq!((q.steps.as_slice(), q.retired.as_slice()), (&[3u16][..], &[(2u16, true)][..]));
        assert_eq!(take_used(&mut q, false), Ok(None));
    }

    #[test]
    fn an_in_order_element_stands_for_the_chains_before_it() {
        let mut q = fake(8, true);
        for id in [5, 1, 6, 2] {
            q.chains.posted(id);
        }
        // One element naming the third chain; used.idx moved by three.
        q.elems.extend([(6, 7), (0xffff, 0), (0xffff, 0)]);
        assert!(!q.chains.batch_pending());
        assert_eq!(take_used(&mut q, false).unwrap().map(|u| (u.id, u.len)), Some((5, 105)));
        assert!(q.chains.batch_pending());
        assert_eq!(q.chains.pending_ndesc(), 2 + 7);
        let mut out = [Used::default(); 8];
        assert_eq!(pop_used_batch(&mut q, &mut out, false), Ok(2));
        assert_eq!(out[..2].iter().map(|u| (u.id, u.len, u.token)).collect::<Vec<_>>(), [(1, 101, 1001), (6, 7, 1006)]);
        assert!(!q.chains.batch_pending());
        assert_eq!(q.chains.kept(5), Err(DriverError::NotKept), "freed");
        assert_eq!((q.chains.count(), q.stats.used), (1, 3));
    }
}
