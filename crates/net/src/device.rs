//! virtio-net as a vhostd device: the device as a whole ([`NetDevice`]:
//! features, config space, the control state its groups share) and its
//! queue groups: one per queue pair ([`PairGroup`]: RX and TX rings and the
//! pair's backend) and the control queue ([`CtrlGroup`]).

use std::os::unix::io::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

use vhostd_backends::{Backends, Link, NetBackend, TapControl};
use vhostd_device::{
    tsc, value_of, Built, Counter, Counters, Device, InflightLog, Metric, Pass, QueueGroup, Ring, RingPlace,
    RingTotals, Sleep, Waker,
};
use virtq::ring::features as ring;
use virtq::QueueStats;

use crate::{
    features, guest_offloads, offload_features, process_ctrl, process_rx, process_tx, CtrlState, DirStats, Layout,
    NetConfig, DEVICE_FEATURES, STATUS_LINK_UP,
};

/// What the device and its groups share.
struct Shared {
    pairs: u16,
    mac: [u8; 6],
    /// Queue pairs the driver uses (VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET).
    active_pairs: AtomicU16,
    /// The control queue's state (MAC, active pairs, offloads).
    ctrl: Mutex<CtrlState>,
    /// The TAP's device-wide controls, if the backend is a TAP.
    tap: Option<TapControl>,
    /// The interface whose link state the device reports, if any.
    link: Option<Link>,
    /// Wakes the worker of each pair group (a change of active pairs must
    /// reach sleeping workers, whose TAP queues attach or detach).
    wakers: Mutex<Vec<Option<Waker>>>,
    /// A MAC to announce with a RARP frame (SEND_RARP), which the first
    /// pair's group sends at its next pass; `announce_pending` says one
    /// waits, so the pass reads only an atomic.
    announce_mac: Mutex<Option<[u8; 6]>>,
    announce_pending: AtomicBool,
}

impl Shared {
    /// Lets the TAP hand the guest frames that need the receive offloads in
    /// `bits` (GUEST_* features).
    fn apply_guest_offloads(&self, bits: u64) {
        if let Some(tap) = &self.tap {
            if let Err(e) = tap.set_offloads(guest_offloads(bits)) {
                tracing::warn!("TAP {}: cannot set offloads {bits:#x}: {e}", tap.name());
            }
        }
    }
}

/// The virtio-net device.
pub struct NetDevice {
    max_queue_size: u16,
    /// Offload features the backend supports (a TAP's), offered on top.
    offload_features: u64,
    shared: Arc<Shared>,
}

/// The device for `backends` (one per queue pair) with MAC `mac`: the
/// device, then a group per queue pair and one for the control queue (the
/// last). Keeps the backends' device-wide sides (TAP controls, link state);
/// the caller keeps what must live as long as the device (an AF_XDP
/// program's attachment).
pub fn build(backends: Backends, mac: [u8; 6], max_queue_size: u16) -> Built {
    let pairs = backends.queues.len() as u16;
    let offload_features = backends.tap.as_ref().map_or(0, |t| offload_features(t.caps()));
    let shared = Arc::new(Shared {
        pairs,
        mac,
        active_pairs: AtomicU16::new(pairs),
        ctrl: Mutex::new(CtrlState::new(pairs, mac)),
        tap: backends.tap,
        link: backends.link,
        wakers: Mutex::new((0..pairs).map(|_| None).collect()),
        announce_mac: Mutex::new(None),
        announce_pending: AtomicBool::new(false),
    });
    let mut groups: Vec<Box<dyn QueueGroup>> = backends
        .queues
        .into_iter()
        .enumerate()
        .map(|(pair, backend)| {
            Box::new(PairGroup {
                pair: pair as u16,
                backend,
                layout: Layout::from_features(0),
                rx: DirStats::default(),
                tx: DirStats::default(),
                shared: shared.clone(),
                backend_active: true,
                tx_blocked: false,
                rx_filled: false,
            }) as Box<dyn QueueGroup>
        })
        .collect();
    groups.push(Box::new(CtrlGroup { shared: shared.clone(), offloads: 0 }));
    Built { device: Arc::new(NetDevice { max_queue_size, offload_features, shared }), groups }
}

impl Device for NetDevice {
    fn kind(&self) -> &'static str {
        "net"
    }

    fn announces(&self) -> bool {
        self.shared.pairs > 0
    }

    fn announce(&self, mac: [u8; 6]) -> bool {
        let Ok(mut m) = self.shared.announce_mac.lock() else { return false };
        *m = Some(mac);
        drop(m);
        self.shared.announce_pending.store(true, Ordering::Release);
        if let Ok(w) = self.shared.wakers.lock() {
            if let Some(Some(w)) = w.first() {
                w.wake();
            }
        }
        true
    }

    /// IN_ORDER costs nothing: every path completes chains in the order it
    /// popped them.
    fn features(&self) -> u64 {
        ring::VERSION_1
            | ring::IN_ORDER
            | ring::EVENT_IDX
            | ring::INDIRECT_DESC
            | ring::RING_PACKED
            | DEVICE_FEATURES
            | self.offload_features
    }

    /// The pairs plus the control queue, as the spec and libvhost-user
    /// count them.
    fn queues(&self) -> u16 {
        2 * self.shared.pairs + 1
    }

    fn max_queue_size(&self) -> u16 {
        self.max_queue_size
    }

    fn place(&self, index: u16, features: u64) -> Option<RingPlace> {
        let (i, pairs) = (index as usize, self.shared.pairs as usize);
        let mq = features & features::MQ != 0;
        let ctrl_index = if mq { 2 * pairs } else { 2 };
        if features & features::CTRL_VQ != 0 && i == ctrl_index {
            return Some(RingPlace { group: pairs, slot: 0 });
        }
        let in_use = if mq { pairs } else { 1 };
        // Before SET_FEATURES the frontend may still set up every pair.
        if i < 2 * in_use || (i < 2 * pairs && features == 0) {
            return Some(RingPlace { group: i / 2, slot: i % 2 });
        }
        None
    }

    fn read_config(&self, offset: u32, len: u32) -> Option<Vec<u8>> {
        let mac = self.shared.ctrl.lock().map(|c| c.mac).unwrap_or(self.shared.mac);
        let link_up = self.shared.link.as_ref().is_none_or(|l| l.up());
        let status = if link_up { STATUS_LINK_UP } else { 0 };
        let bytes = NetConfig { mac, status, max_queue_pairs: self.shared.pairs, mtu: 1500 }.bytes();
        let (off, len) = (offset as usize, len as usize);
        let end = off.checked_add(len).filter(|&e| e <= bytes.len())?;
        Some(bytes[off..end].to_vec())
    }

    fn link_up(&self) -> Option<bool> {
        self.shared.link.as_ref().map(Link::up)
    }

    fn link_reported(&self, features: u64) -> bool {
        features & features::STATUS != 0
    }

    /// The virtio-net config space is read-only for the driver.
    fn write_config(&self, _offset: u32, _data: &[u8], _features: u64) -> bool {
        false
    }

    fn set_features(&self, features: u64) {
        let offloads = features & features::GUEST_OFFLOADS;
        if let Ok(mut c) = self.shared.ctrl.lock() {
            c.offloads_allowed = offloads;
            c.offloads = offloads;
        }
        self.shared.apply_guest_offloads(offloads);
    }

    fn reset(&self) {
        let s = &self.shared;
        s.active_pairs.store(s.pairs, Ordering::Release);
        if let Ok(mut c) = s.ctrl.lock() {
            *c = CtrlState { errors: c.errors, ..CtrlState::new(s.pairs, s.mac) };
        }
        // No guest, no offloaded frames.
        s.apply_guest_offloads(0);
        // An announcement not sent yet was for that guest.
        s.announce_pending.store(false, Ordering::Release);
        if let Ok(mut m) = s.announce_mac.lock() {
            *m = None;
        }
    }

    fn describe_features(&self, features: u64) -> String {
        if features & features::MRG_RXBUF != 0 {
            "mergeable rx".into()
        } else {
            String::new()
        }
    }

    fn ring_label(&self, place: RingPlace) -> (u16, Option<&'static str>) {
        let pairs = self.shared.pairs;
        if place.group == pairs as usize {
            return (2 * pairs, Some("ctrl"));
        }
        (2 * place.group as u16 + place.slot as u16, Some(if place.slot == 0 { "rx" } else { "tx" }))
    }

    /// The control queue shows once the driver used it.
    fn ring_shown(&self, place: RingPlace, queue: &QueueStats) -> bool {
        place.group < self.shared.pairs as usize || queue.chains > 0 || queue.bad_chains > 0
    }

    fn totals(&self, rings: &[RingTotals<'_>]) -> Vec<(&'static str, String)> {
        let pairs = self.shared.pairs as usize;
        let sum = |slot: usize, k: &str| {
            rings
                .iter()
                .filter(|r| r.place.group < pairs && r.place.slot == slot)
                .map(|r| value_of(r.counters, k))
                .sum()
        };
        let (txp, txb, rxp, rxb): (u64, u64, u64, u64) =
            (sum(1, "packets"), sum(1, "bytes"), sum(0, "packets"), sum(0, "bytes"));
        let dropped: u64 = rings.iter().map(|r| value_of(r.counters, "dropped")).sum();
        let bad: u64 = rings.iter().map(|r| r.bad_chains).sum();
        let cycles: u64 = rings.iter().map(|r| r.busy_cycles).sum();
        let per_packet = if txp + rxp > 0 { cycles as f64 / (txp + rxp) as f64 } else { 0.0 };
        vec![
            ("guest_tx_packets", txp.to_string()),
            ("guest_tx_bytes", txb.to_string()),
            ("guest_rx_packets", rxp.to_string()),
            ("guest_rx_bytes", rxb.to_string()),
            ("dropped", dropped.to_string()),
            ("bad_chains", bad.to_string()),
            ("busy_cycles", cycles.to_string()),
            ("cycles_per_packet", format!("{per_packet:.1}")),
        ]
    }
}

/// Ring slots of a pair group.
const RX: usize = 0;
const TX: usize = 1;

/// A queue pair: its RX and TX rings and its backend.
pub struct PairGroup {
    pair: u16,
    backend: Box<dyn NetBackend>,
    layout: Layout,
    rx: DirStats,
    tx: DirStats,
    shared: Arc<Shared>,
    /// The backend was last told someone reads its RX side (a multi-queue
    /// TAP then steers frames only to queues in use).
    backend_active: bool,
    /// The guest has frames to send but the backend took none (every AF_XDP
    /// TX frame awaits its completion, or the interface is down).
    tx_blocked: bool,
    /// The last pass put frames in the RX ring: this one fetches the RX
    /// ring's next lines while TX runs.
    rx_filled: bool,
}

impl PairGroup {
    /// SEND_RARP's frame waits to go out: pair 0's, while the device runs
    /// (its TX ring attached), as QEMU sends it; a reset drops it.
    #[inline(always)]
    fn announce_waits(&self, rings: &[Option<Ring>]) -> bool {
        self.pair == 0 && rings[TX].is_some() && self.shared.announce_pending.load(Ordering::Relaxed)
    }

    /// Sends the RARP frame SEND_RARP asked for, if the backend takes a
    /// frame now (else at a later pass).
    fn send_announcement(&mut self) {
        if !self.shared.announce_pending.swap(false, Ordering::Acquire) {
            return;
        }
        let Some(mac) = self.shared.announce_mac.lock().ok().and_then(|mut m| m.take()) else { return };
        let frame = crate::rarp_frame(mac);
        match self.backend.tx_buffers(1).first_mut() {
            Some(b) if b.room() >= frame.len() => {
                b.storage()[..frame.len()].copy_from_slice(&frame);
                b.len = frame.len();
                b.vnet_hdr = Default::default();
                self.backend.tx_commit(1);
                tracing::info!("RARP sent for {}", crate::mac_string(mac));
            }
            _ => {
                // No room now: the next pass tries again.
                if let Ok(mut m) = self.shared.announce_mac.lock() {
                    m.get_or_insert(mac);
                }
                self.shared.announce_pending.store(true, Ordering::Release);
            }
        }
    }
}

impl QueueGroup for PairGroup {
    fn ring_slots(&self) -> usize {
        2
    }

    fn attach(&mut self, _slot: usize, _ring: &mut Ring, features: u64, _inflight: Option<InflightLog>) {
        self.layout = Layout::from_features(features);
    }

    /// TX, then RX (only while the driver uses this pair).
    fn poll(&mut self, rings: &mut [Option<Ring>]) -> Pass {
        if self.announce_waits(rings) {
            self.send_announcement();
        }
        let mut moved = 0;
        let mut tx_moved = 0;
        let t0 = tsc();
        self.tx_blocked = false;
        if self.rx_filled {
            // The driver has likely refilled its RX ring too: that line's
            // miss overlaps the TX ring's rather than following it (a loop,
            // a reply).
            if let Some(rx) = rings[RX].as_ref() {
                rx.queue.prefetch_next();
            }
        }
        if let Some(tx) = rings[TX].as_mut() {
            let n = process_tx(&mut tx.queue, &mut tx.batch, self.backend.as_mut(), self.layout, &mut self.tx);
            tx_moved = n;
            if n > 0 {
                tx.notify();
                moved += n;
            } else {
                self.tx_blocked = tx.queue.pending() > 0;
            }
        }
        let t1 = tsc();
        if moved > 0 {
            if let Some(tx) = rings[TX].as_mut() {
                tx.counters.busy_cycles += t1 - t0;
            }
        }
        let active = self.pair < self.shared.active_pairs.load(Ordering::Relaxed);
        let reading = active && rings[RX].is_some();
        if reading != self.backend_active {
            self.backend_active = reading;
            self.backend.set_active(reading);
        }
        self.rx_filled = false;
        if let (Some(rx), true) = (rings[RX].as_mut(), active) {
            let sending = tx_moved > 0;
            let n = process_rx(&mut rx.queue, &mut rx.batch, self.backend.as_mut(), self.layout, &mut self.rx, sending);
            self.rx_filled = n > 0;
            if n > 0 {
                rx.notify();
                rx.counters.busy_cycles += tsc() - t1;
                moved += n;
            }
        }
        if moved > 0 {
            // One-way only: frames going back to the guest in the same
            // pass may be what it waits for (a loop, a reply).
            return Pass { streaming: tx_moved >= crate::BURST && moved == tx_moved, ..Pass::did(moved) };
        }
        // An announcement the backend had no room for is retried soon,
        // not at the next kick.
        let deferred = self.backend.retry_deferred() | self.announce_waits(rings);
        Pass { deferred, stalled: self.tx_blocked, ..Pass::default() }
    }

    fn event_fd(&self) -> Option<RawFd> {
        self.backend.rx_fd()
    }

    /// Posted RX buffers are work only when the backend has frames for
    /// them; otherwise the RX ring stays quiet (no kicks) and the worker
    /// sleeps until a TX kick or the backend has something. The backend's
    /// descriptor wakes the worker only while the guest reads and nothing
    /// is already waiting for RX room (then the guest's RX kick is what is
    /// needed, not a busy descriptor).
    fn prepare_sleep(&mut self, rings: &mut [Option<Ring>]) -> Sleep {
        let rx_has_frames = !self.backend.rx_frames(1).is_empty();
        let mut work = false;
        for (slot, r) in rings.iter_mut().enumerate() {
            if let Some(r) = r {
                if slot == RX && !rx_has_frames {
                    continue;
                }
                work |= r.queue.enable_notifications();
            }
        }
        Sleep { work, watch_event_fd: self.backend_active && !rx_has_frames }
    }

    fn placed(&mut self, waker: &Waker) {
        if let (Ok(mut w), Ok(waker)) = (self.shared.wakers.lock(), waker.try_clone()) {
            if let Some(slot) = w.get_mut(self.pair as usize) {
                *slot = Some(waker);
            }
        }
    }

    fn counters(&self, queues: &[QueueStats]) -> Counters {
        let b = self.backend.stats();
        let bad = |slot: usize| queues.get(slot).map_or(0, |q| q.bad_chains);
        Counters {
            rings: vec![dir_counters(&self.rx, b.rx_dropped, bad(RX)), dir_counters(&self.tx, b.tx_dropped, bad(TX))],
            group: vec![],
        }
    }
}

const DROPPED: Metric = Metric::counter("vhostd_queue_dropped_total", "Frames dropped, by reason.");

/// One direction's counters (the backend's own drops count in).
fn dir_counters(d: &DirStats, backend_dropped: u64, bad_chains: u64) -> Vec<Counter> {
    vec![
        Counter::new(
            "packets",
            d.packets,
            Metric::counter("vhostd_queue_packets_total", "Frames moved (tx: guest to backend, rx: backend to guest)."),
        ),
        Counter::new(
            "bytes",
            d.bytes,
            Metric::counter("vhostd_queue_bytes_total", "Frame bytes moved, virtio-net headers excluded."),
        ),
        Counter::plain("dropped", d.dropped + backend_dropped),
        Counter::new("drops.short_header", d.short_header, DROPPED.with("reason", "short_header")),
        Counter::new("drops.too_big", d.too_big, DROPPED.with("reason", "too_big")),
        Counter::new("drops.backend", backend_dropped, DROPPED.with("reason", "backend")),
        Counter::new("drops.bad_chain", bad_chains, DROPPED.with("reason", "bad_chain")),
        Counter::new(
            "batches",
            d.batches,
            Metric::counter("vhostd_queue_batches_total", "Batches that moved at least one frame or request."),
        ),
    ]
}

/// The control queue: reads the driver's commands and changes the state
/// the pairs share (active pairs, MAC, receive offloads).
pub struct CtrlGroup {
    shared: Arc<Shared>,
    /// Receive offloads last applied from the control queue.
    offloads: u64,
}

impl QueueGroup for CtrlGroup {
    fn ring_slots(&self) -> usize {
        1
    }

    fn attach(&mut self, _slot: usize, _ring: &mut Ring, _features: u64, _inflight: Option<InflightLog>) {}

    fn poll(&mut self, rings: &mut [Option<Ring>]) -> Pass {
        let Some(Some(ctrl)) = rings.first_mut() else { return Pass::default() };
        let Ok(mut state) = self.shared.ctrl.lock().map(|s| *s) else { return Pass::default() };
        let t0 = tsc();
        let n = process_ctrl(&mut ctrl.queue, &mut ctrl.batch, &mut state);
        if n == 0 {
            return Pass::default();
        }
        if state.offloads != self.offloads {
            // VIRTIO_NET_CTRL_GUEST_OFFLOADS_SET (e.g. the guest attached XDP).
            self.offloads = state.offloads;
            if let Some(tap) = &self.shared.tap {
                let _ = tap.set_offloads(guest_offloads(state.offloads));
            }
        }
        let before = self.shared.active_pairs.swap(state.active_pairs, Ordering::Relaxed);
        if before != state.active_pairs {
            for w in self.shared.wakers.lock().iter().flat_map(|w| w.iter()).flatten() {
                w.wake();
            }
        }
        if let Ok(mut s) = self.shared.ctrl.lock() {
            *s = state;
        }
        ctrl.notify();
        ctrl.counters.busy_cycles += tsc() - t0;
        Pass::did(n)
    }

    fn counters(&self, queues: &[QueueStats]) -> Counters {
        let bad = queues.first().map_or(0, |q| q.bad_chains);
        Counters { rings: vec![dir_counters(&DirStats::default(), 0, bad)], group: vec![] }
    }
}
