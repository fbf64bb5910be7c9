//! The shared pool's balancer: moves a queue group from the busiest worker
//! to the least busy one when the first stays loaded and the move narrows
//! the spread, as OVS-DPDK's `pmd-auto-lb` does. Load is what the workers
//! measure: TSC cycles of passes that did work, per group, sampled once a
//! second and smoothed (each sample half the estimate). No flapping: a
//! move needs the same imbalance (between the same two workers) in
//! `STEADY` samples in a row, a margin on both sides (hysteresis), and the
//! configured interval since the last move. Pinned groups stay. Asking
//! for a sample wakes every worker, so while none has done any work since
//! a sample that left no load, the balancer skips it (`slept_through`):
//! an idle pool's workers sleep undisturbed.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::server::Daemon;

/// One group's measured load and place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLoad {
    /// Index of the device in the sample.
    pub device: usize,
    /// The group.
    pub group: usize,
    /// Its worker.
    pub worker: usize,
    /// Busy cycles per second.
    pub load: u64,
    /// Pinned: never moved.
    pub pinned: bool,
}

/// Samples in a row that must show the same imbalance before a move.
const STEADY: u32 = 3;

/// The move that most narrows the gap between the busiest and the least
/// busy worker, if the gap is over a fifth of a CPU (`cpu_hz` cycles per
/// second) and the move brings the busiest down by a tenth of one:
/// (index in `groups`, destination worker).
pub fn choose_move(groups: &[GroupLoad], workers: usize, cpu_hz: u64) -> Option<(usize, usize)> {
    if workers < 2 {
        return None;
    }
    let load = worker_loads(groups, workers);
    let hi = (0..workers).max_by_key(|&w| (load[w], std::cmp::Reverse(w)))?;
    let lo = (0..workers).min_by_key(|&w| (load[w], w))?;
    if load[hi].saturating_sub(load[lo]) <= cpu_hz / 5 {
        return None;
    }
    groups
        .iter()
        .enumerate()
        .filter(|(_, g)| g.worker == hi && !g.pinned && g.load > 0)
        .map(|(i, g)| (i, (load[hi] - g.load).max(load[lo] + g.load)))
        .filter(|&(_, new_max)| new_max + cpu_hz / 10 <= load[hi])
        .min_by_key(|&(i, new_max)| (new_max, i))
        .map(|(i, _)| (i, lo))
}

/// Whether no worker did any work between two readings of the workers'
/// `WorkerHandle::rest`, `seen` then `now`: each is asleep now, with the
/// busy passes it had then. One awake now may be working: it is asked.
fn slept_through(seen: &[u64], now: &[u64]) -> bool {
    seen.len() == now.len() && seen.iter().zip(now).all(|(&s, &n)| n & 1 == 1 && s >> 1 == n >> 1)
}

/// Each worker's load: its groups' summed.
fn worker_loads(groups: &[GroupLoad], workers: usize) -> Vec<u64> {
    let mut load = vec![0u64; workers];
    for g in groups {
        if let Some(l) = load.get_mut(g.worker) {
            *l += g.load;
        }
    }
    load
}

/// Runs the balancer of `daemon`'s pool on a thread of its own: a sample a
/// second, a move at most every `every`. Ends with the daemon.
pub fn spawn(daemon: &Arc<Daemon>, every: Duration) -> std::io::Result<()> {
    let weak: Weak<Daemon> = Arc::downgrade(daemon);
    std::thread::Builder::new().name("vhostd-balance".into()).spawn(move || run(weak, every))?;
    Ok(())
}

fn run(daemon: Weak<Daemon>, every: Duration) {
    let hz = crate::snapshot::tsc_hz().max(1);
    // Busy cycles of each group (device id, group) at the last sample.
    let mut last: HashMap<(u64, usize), u64> = HashMap::new();
    let mut at = Instant::now();
    let mut last_move: Option<Instant> = None;
    let mut steady = 0u32;
    // The (from, to) workers of the move the last samples asked for: the
    // imbalance must hold, whichever of similar groups each sample picks.
    let mut wanted: Option<(usize, usize)> = None;
    // Smoothed busy cycles per second of each group: one sample's dip or
    // spike (a frontend descheduled) does not decide a move.
    let mut smooth: HashMap<(u64, usize), u64> = HashMap::new();
    // The workers' `rest` after the last sample, and whether that sample
    // left no load anywhere (every smoothed load 0).
    let mut rest_seen: Vec<u64> = Vec::new();
    let mut quiet = false;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let Some(d) = daemon.upgrade() else { return };
        let Some(pool) = d.pool.clone() else { return };
        // No worker did any work since a sample that found no load: this
        // one would find none either (no load to decay, no move), and
        // asking for it wakes every worker, once a second, on an idle host.
        let rest: Vec<u64> = pool.workers.iter().map(|w| w.rest()).collect();
        if quiet && slept_through(&rest_seen, &rest) {
            at = Instant::now();
            continue;
        }
        let entries = d.devices.list();
        let reports = d.reports(&entries, false);
        let secs = at.elapsed().as_secs_f64().max(0.001);
        at = Instant::now();
        let mut now: HashMap<(u64, usize), u64> = HashMap::new();
        let mut smooth_now: HashMap<(u64, usize), u64> = HashMap::new();
        let mut groups = Vec::new();
        for (i, (e, reps)) in entries.iter().zip(&reports).enumerate() {
            let places = e.served.places();
            for r in reps {
                for g in &r.groups {
                    let busy: u64 = g.rings.iter().map(|x| x.ring.busy_cycles).sum();
                    let key = (e.served.id, g.group);
                    now.insert(key, busy);
                    let delta = busy.saturating_sub(last.get(&key).copied().unwrap_or(busy));
                    let rate = (delta as f64 / secs) as u64;
                    let load = smooth.get(&key).map_or(rate, |&old| old / 2 + rate / 2);
                    smooth_now.insert(key, load);
                    let pinned = places.get(g.group).is_some_and(|p| p.pinned);
                    groups.push(GroupLoad { device: i, group: g.group, worker: r.worker, load, pinned });
                }
            }
        }
        last = now;
        smooth = smooth_now;
        quiet = smooth.values().all(|&l| l == 0);
        // After the reports: the workers' waking to answer them is seen.
        rest_seen = pool.workers.iter().map(|w| w.rest()).collect();
        let per_worker = worker_loads(&groups, pool.workers.len());
        tracing::debug!(
            load = ?per_worker,
            groups = ?groups.iter().map(|g| (g.worker, g.load)).collect::<Vec<_>>(),
            "balancer sample (busy cycles per second per worker; per group: worker, load)"
        );
        pool.set_load(per_worker);
        let choice = choose_move(&groups, pool.workers.len(), hz);
        let between = choice.map(|(i, to)| (groups[i].worker, to));
        if between.is_some() && between == wanted {
            steady += 1;
        } else {
            steady = u32::from(between.is_some());
            wanted = between;
        }
        let rested = last_move.is_none_or(|t| t.elapsed() >= every);
        if let (Some((i, to)), true, true) = (choice, steady >= STEADY, rested) {
            let g = groups[i];
            let e = &entries[g.device];
            match e.served.move_group(g.group, to, false) {
                Ok(()) => tracing::info!(
                    device = %e.name,
                    group = g.group,
                    from = g.worker,
                    to,
                    "balancer: queue moved to a less loaded worker"
                ),
                Err(m) => tracing::warn!(device = %e.name, "balancer: {m}"),
            }
            last_move = Some(Instant::now());
            steady = 0;
            wanted = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HZ: u64 = 1_000_000;

    fn g(device: usize, worker: usize, load: u64) -> GroupLoad {
        GroupLoad { device, group: 0, worker, load, pinned: false }
    }

    #[test]
    fn moves_the_group_that_best_evens_two_workers() {
        // Worker 0 carries 0.9 CPU in three groups, worker 1 nothing: moving
        // the 0.4 one leaves 0.5 / 0.4, the best split.
        let groups = [g(0, 0, 300_000), g(1, 0, 400_000), g(2, 0, 200_000)];
        assert_eq!(choose_move(&groups, 2, HZ), Some((1, 1)));
    }

    #[test]
    fn leaves_a_small_gap_alone() {
        // 0.25 against 0.1: a gap under a fifth of a CPU.
        let groups = [g(0, 0, 150_000), g(1, 0, 100_000), g(2, 1, 100_000)];
        assert_eq!(choose_move(&groups, 2, HZ), None);
    }

    #[test]
    fn does_not_move_a_lone_heavy_group() {
        // One group of 0.9 CPU: moving it only moves the hot spot.
        let groups = [g(0, 0, 900_000), g(1, 1, 100_000)];
        assert_eq!(choose_move(&groups, 2, HZ), None);
    }

    #[test]
    fn pinned_groups_stay() {
        let mut groups = [g(0, 0, 400_000), g(1, 0, 400_000)];
        groups[0].pinned = true;
        assert_eq!(choose_move(&groups, 2, HZ), Some((1, 1)));
        groups[1].pinned = true;
        assert_eq!(choose_move(&groups, 2, HZ), None);
    }

    #[test]
    fn a_sample_is_skipped_only_while_every_worker_slept_without_work() {
        // Worker 0 asleep after 5 busy passes, worker 1 awake after 7.
        let seen = [5 * 2 + 1, 7 * 2];
        // Both asleep, no pass since: nothing to sample.
        assert!(slept_through(&seen, &[5 * 2 + 1, 7 * 2 + 1]));
        // Worker 1 worked before it slept again.
        assert!(!slept_through(&seen, &[5 * 2 + 1, 9 * 2 + 1]));
        // Worker 0 is awake: it may be working (no pass stored yet).
        assert!(!slept_through(&seen, &[5 * 2, 7 * 2 + 1]));
        // The pool changed size.
        assert!(!slept_through(&seen, &[5 * 2 + 1]));
        assert!(slept_through(&[], &[]));
    }

    #[test]
    fn picks_the_least_loaded_destination() {
        let groups = [g(0, 0, 500_000), g(1, 0, 500_000), g(2, 1, 300_000), g(3, 2, 0)];
        assert_eq!(choose_move(&groups, 3, HZ), Some((0, 2)));
        assert_eq!(choose_move(&groups, 1, HZ), None);
    }
}
