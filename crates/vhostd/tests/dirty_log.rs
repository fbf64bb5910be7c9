//! Live migration's dirty-page log, through the vhost-user socket as QEMU
//! drives it: the real vhostd binary, rings running with traffic, then
//! SET_LOG_BASE, SET_FEATURES with VHOST_F_LOG_ALL and SET_VRING_ADDR with
//! VHOST_VRING_F_LOG (vhostd-user's `start_dirty_log`).
//!
//! Each exchange is set up so that only the device writes guest memory
//! between two snapshots: once vhostd's dataplane thread sleeps (its
//! default interrupt mode: in epoll_wait until kicked), the driver queues
//! its chains and publishes them without a kick, the first snapshot is
//! taken, the kick sent, and completions are awaited with reads only. Every 4 KiB page whose bytes differ between the
//! snapshots must be marked in the log (changed ⊆ dirty). The cases:
//!
//! - net on the loopback backend (TX frames come back on RX): split and
//!   packed rings, with and without mergeable RX buffers;
//! - blk reads from a file (data, status bytes, used ring);
//! - a second, larger log sent while logging (QEMU resizes the log when
//!   guest memory grows): stores go to the new log only;
//! - logging turned off (LOG_ALL cleared): the same exchange marks nothing.
//!
//! Not vacuous: each exchange must change the RX buffers' (or read
//! buffers') pages and the used ring's page, and the frames or data that
//! arrived are checked.
mod common;
use common::*;
use std::collections::BTreeSet;
use std::time::Duration;
use vhostd_user::features as f;
use vhostd_user::{BlkOp, DirtyLog, Options, RxQueue, TxQueue, Used, VirtioUser};

const T: Duration = Duration::from_secs(10);
const PAGE: u64 = DirtyLog::PAGE;
/// Guest memory of the frontend: small, so snapshots are cheap.
const MEM: u64 = 8 << 20;
const QSIZE: u16 = 256;

/// Every dataplane thread of vhostd `pid` (`vhostd-q*`) sleeps in
/// epoll_wait: it will not look at a ring again until kicked.
fn dataplane_asleep(pid: i32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    let mut workers = 0;
    for t in tasks.flatten() {
        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
        if !read("comm").starts_with("vhostd-q") {
            continue;
        }
        workers += 1;
        // The state follows the parenthesised name in /proc/.../stat.
        let stat = read("stat");
        let state = stat.rsplit(") ").next().and_then(|r| r.split(' ').next()).unwrap_or("");
        if state != "S" || read("wchan").trim() != "do_epoll_wait" {
            return false;
        }
    }
    workers > 0
}

fn wait_asleep(pid: i32) {
    assert!(wait_until(T, || dataplane_asleep(pid)), "vhostd's dataplane thread did not go to sleep");
}

fn snapshot(dev: &mut VirtioUser) -> Vec<u8> {
    let m = dev.memory().driver_memory();
    let mut v = vec![0u8; m.len() as usize];
    assert!(m.read(m.gpa_base(), &mut v));
    v
}

/// Guest pages (guest-physical address / 4 KiB) whose bytes differ.
fn changed_pages(gpa_base: u64, a: &[u8], b: &[u8]) -> BTreeSet<u64> {
    a.chunks(PAGE as usize)
        .zip(b.chunks(PAGE as usize))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| gpa_base / PAGE + i as u64)
        .collect()
}

/// Asserts changed ⊆ dirty, naming the pages that escaped the log.
fn assert_logged(what: &str, changed: &BTreeSet<u64>, dirty: &BTreeSet<u64>) {
    let missed: Vec<String> = changed.difference(dirty).map(|p| format!("{:#x}", p * PAGE)).collect();
    assert!(missed.is_empty(), "{what}: pages the device changed but did not log: {missed:?}");
}

/// Frame lengths of an exchange: small, MTU-sized and in between.
fn frame_len(i: u32) -> usize {
    [60, 1514, 64, 700, 1000, 128, 1400, 300][i as usize % 8]
}

/// One net exchange of `n` frames whose only guest-memory writer between
/// the snapshots is the device. Returns the pages that changed; checks
/// the frames that came back.
fn net_exchange(pid: i32, dev: &mut VirtioUser, rx: &mut RxQueue, tx: &mut TxQueue, seq: u32, n: u32) -> BTreeSet<u64> {
    let gpa_base = dev.memory().gpa_base();
    wait_asleep(pid);
    let sent: Vec<Vec<u8>> = (seq..seq + n).map(|s| frame(s, frame_len(s))).collect();
    for fr in &sent {
        assert!(tx.send_frame(fr).unwrap(), "a free TX slot");
    }
    tx.queue.ring.publish();
    let before = snapshot(dev);
    tx.queue.kick().unwrap();
    // Reads only until the device is done: TX completions and RX used entries.
    let mut used = vec![Used::default(); QSIZE as usize];
    let mut rx_used: Vec<Used> = Vec::new();
    let mut tx_done = 0;
    let ok = wait_until(T, || {
        tx_done += tx.reclaim().unwrap();
        let k = rx.queue.ring.pop_used_batch(&mut used, true).unwrap();
        rx_used.extend_from_slice(&used[..k]);
        tx_done == n as usize && rx_used.len() >= n as usize
    });
    assert!(ok, "{tx_done} of {n} frames sent, {} of {n} received", rx_used.len());
    let after = snapshot(dev);
    let changed = changed_pages(gpa_base, &before, &after);
    // The frames arrived whole: each used length is header + frame.
    let hdr = dev.net_hdr_len() as u32;
    let lens: Vec<u32> = rx_used.iter().map(|u| u.len).collect();
    let want: Vec<u32> = sent.iter().map(|fr| hdr + fr.len() as u32).collect();
    assert_eq!(lens, want, "RX used lengths");
    // Now the driver may write again: the buffers go back.
    for u in &rx_used {
        rx.queue.ring.repost(u.id).unwrap();
    }
    rx.queue.ring.publish();
    changed
}

fn net_case(packed: bool, mrg: bool) {
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut opts = d.ring_options(packed, mrg);
    opts.mem_size = MEM;
    let mut dev = VirtioUser::connect(opts).unwrap();
    assert_eq!(dev.packed(), packed);
    let (mut rx, mut tx) = dev.net_queue_pair(0, QSIZE).unwrap();
    let end = dev.memory().gpa_base() + MEM;
    let pid = d.pid();

    // Traffic with no log yet.
    net_exchange(pid, &mut dev, &mut rx, &mut tx, 0, 64);

    // Logging on, rings running.
    let log = DirtyLog::covering(end).unwrap();
    dev.start_dirty_log(&log, &[&rx.queue, &tx.queue]).unwrap();
    let changed = net_exchange(pid, &mut dev, &mut rx, &mut tx, 1000, 64);
    // Where used entries go: the used ring, or a packed ring's descriptors.
    let used_page = |l: vhostd_user::RingLayout| if packed { l.desc / PAGE } else { l.used / PAGE };
    let rx_used_page = used_page(rx.queue.ring.layout());
    let tx_used_page = used_page(tx.queue.ring.layout());
    assert!(changed.contains(&rx_used_page) && changed.contains(&tx_used_page), "used rings unchanged: {changed:?}");
    assert!(changed.len() >= 10, "only {} pages changed: the RX buffers were not written?", changed.len());
    assert_logged("log on", &changed, &log.dirty_pages());

    // A bigger log replaces it: stores go there, the old one sees none.
    let log2 = DirtyLog::covering(2 * end).unwrap();
    dev.set_log_base(&log2).unwrap();
    log.clear();
    let changed = net_exchange(pid, &mut dev, &mut rx, &mut tx, 2000, 64);
    assert_logged("after the log was replaced", &changed, &log2.dirty_pages());
    assert_eq!(log.dirty_pages(), BTreeSet::new(), "stores marked in the replaced log");

    // Logging off: the same exchange marks nothing.
    dev.stop_dirty_log(&[&rx.queue, &tx.queue]).unwrap();
    log2.clear();
    let changed = net_exchange(pid, &mut dev, &mut rx, &mut tx, 3000, 64);
    assert!(!changed.is_empty());
    assert_eq!(log2.dirty_pages(), BTreeSet::new(), "pages marked with LOG_ALL cleared");

    drop((rx, tx));
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.total("guest_rx_packets"), 4 * 64);
    assert_eq!(s.total("bad_chains"), 0);
}

#[test]
fn net_split_mergeable_stores_are_logged() {
    net_case(false, true);
}

#[test]
fn net_split_without_mergeable_stores_are_logged() {
    net_case(false, false);
}

#[test]
fn net_packed_mergeable_stores_are_logged() {
    net_case(true, true);
}

#[test]
fn net_packed_without_mergeable_stores_are_logged() {
    net_case(true, false);
}

#[test]
fn split_used_rings_are_logged_at_log_guest_addr() {
    // VHOST_VRING_F_LOG's log_guest_addr says where used-ring stores are
    // logged (QEMU gives the used ring's guest address; the spec allows
    // any). Here: a page of its own, and then an address near the top of
    // the 64-bit space (hostile; nothing may overflow).
    let d = Daemon::start(&["--backend", "loopback"]);
    let mut opts = d.ring_options(false, true);
    opts.mem_size = MEM;
    let mut dev = VirtioUser::connect(opts).unwrap();
    let (mut rx, mut tx) = dev.net_queue_pair(0, QSIZE).unwrap();
    let pid = d.pid();
    let end = dev.memory().gpa_base() + MEM;
    let elsewhere = dev.memory().alloc(2 * PAGE, PAGE).unwrap();
    let log = DirtyLog::covering(end).unwrap();
    dev.start_dirty_log(&log, &[&rx.queue, &tx.queue]).unwrap();
    for q in [&rx.queue, &tx.queue] {
        dev.set_vring_log(q, Some(elsewhere)).unwrap();
    }
    log.clear();
    let changed = net_exchange(pid, &mut dev, &mut rx, &mut tx, 0, 64);
    let dirty = log.dirty_pages();
    let used = [rx.queue.ring.layout().used / PAGE, tx.queue.ring.layout().used / PAGE];
    assert!(used.iter().all(|p| changed.contains(p)), "the used rings did not change");
    assert!(dirty.contains(&(elsewhere / PAGE)), "log_guest_addr's page not marked: {dirty:?}");
    // The TX used ring's page holds nothing else the device writes (the RX
    // one may share a page with the first RX buffers).
    assert!(!dirty.contains(&used[1]), "TX used ring page {:#x} marked: not logged at log_guest_addr", used[1] * PAGE);
    // RX buffers are still logged where they are.
    let rest: BTreeSet<u64> = changed.iter().copied().filter(|p| !used.contains(p)).collect();
    assert_logged("RX buffers", &rest, &dirty);
    for q in [&rx.queue, &tx.queue] {
        dev.set_vring_log(q, Some(u64::MAX - 1)).unwrap();
    }
    net_exchange(pid, &mut dev, &mut rx, &mut tx, 100, 64);
    drop((rx, tx));
    dev.disconnect().unwrap();
    let s = d.stop();
    assert_eq!(s.total("guest_rx_packets"), 128);
}

/// A byte of the disk image: distinct per sector and offset, never 0xa5.
fn image_byte(off: u64) -> u8 {
    let b = ((off / 512) * 31 + off % 251) as u8;
    if b == 0xa5 {
        0x5a
    } else {
        b
    }
}

/// Removes a directory when dropped, passed or failed.
struct RemoveDir(std::path::PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `shm`: the image in /dev/shm, written out, so vhostd maps it and
/// copies reads through the mapping rather than the kernel writing them.
fn blk_case(packed: bool, shm: bool) {
    let dir = if shm {
        let d = std::path::Path::new("/dev/shm").join(format!("vhostd-it-dirty-{}-{packed}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    } else {
        tempdir()
    };
    let _remove = shm.then(|| RemoveDir(dir.clone()));
    let mapped = on_tmpfs(&dir);
    assert!(mapped || !shm, "/dev/shm is not a tmpfs");
    let img = dir.join("disk.img");
    let size = 4u64 << 20;
    let data: Vec<u8> = (0..size).map(image_byte).collect();
    std::fs::write(&img, &data).unwrap();
    let backend = format!("file,path={}", img.display());
    let d = Daemon::start_with(None, |sock| {
        ["blk", "--socket-path", &sock.display().to_string(), "--backend", &backend]
            .iter()
            .map(|s| s.to_string())
            .collect()
    });
    let mut opts = Options::blk(&d.sock);
    opts.mem_size = MEM;
    if packed {
        opts.features |= f::RING_PACKED;
    }
    let mut dev = VirtioUser::connect(opts).unwrap();
    let mut q = dev.blk_queue(0, 32, 16 << 10).unwrap();
    let end = dev.memory().gpa_base() + MEM;
    let gpa_base = dev.memory().gpa_base();
    let pid = d.pid();

    // One batch of reads, the device alone writing between the snapshots.
    let exchange = |dev: &mut VirtioUser, q: &mut vhostd_user::BlkQueue, first: u64| {
        let lens = [4096u32, 16384, 512, 8192, 1024, 12288, 2048, 4096];
        let mut off = first;
        let mut want = Vec::new();
        for (i, &len) in lens.iter().cycle().take(32).enumerate() {
            let sector = (off / 512) % (size / 512 - 32);
            assert!(q.submit(BlkOp::Read { sector, len }, i as u64, |buf| buf.fill(0xa5)).unwrap());
            want.push((sector, len));
            off += 40_960;
        }
        wait_asleep(pid);
        q.queue.ring.publish();
        let before = snapshot(dev);
        q.queue.kick().unwrap();
        let mut done = Vec::new();
        let ok = wait_until(T, || {
            q.poll(|c, bytes| done.push((c.user, c.status, bytes.to_vec()))).unwrap();
            done.len() == want.len()
        });
        assert!(ok, "{} of {} reads completed", done.len(), want.len());
        let after = snapshot(dev);
        for (user, st, bytes) in &done {
            let (sector, len) = want[*user as usize];
            let at = (sector * 512) as usize;
            assert_eq!(*st, 0, "read {user} status");
            assert!(bytes[..] == data[at..at + len as usize], "read {user} data");
        }
        changed_pages(gpa_base, &before, &after)
    };

    exchange(&mut dev, &mut q, 0);
    let log = DirtyLog::covering(end).unwrap();
    dev.start_dirty_log(&log, &[&q.queue]).unwrap();
    let changed = exchange(&mut dev, &mut q, 4096);
    let l = q.queue.ring.layout();
    assert!(changed.contains(&(if packed { l.desc } else { l.used } / PAGE)), "used entries' page unchanged");
    assert!(changed.len() >= 20, "only {} pages changed: read data not written?", changed.len());
    assert_logged("blk reads, log on", &changed, &log.dirty_pages());

    if shm {
        assert!(d.log().contains("copies through a mapping of it"), "the image was not mapped:\n{}", d.log());
    }
    dev.stop_dirty_log(&[&q.queue]).unwrap();
    log.clear();
    let changed = exchange(&mut dev, &mut q, 8192);
    assert!(!changed.is_empty());
    assert_eq!(log.dirty_pages(), BTreeSet::new(), "pages marked with LOG_ALL cleared");
    drop(q);
    dev.disconnect().unwrap();
    let s = d.stop();
    // Three exchanges of 32 reads: on tmpfs (always with `shm`) every one
    // a copy through the mapping, elsewhere none.
    assert_eq!(s.queue(0, "mapped_copies"), if mapped { 96 } else { 0 }, "reads copied through the mapping");
}

#[test]
fn blk_split_read_stores_are_logged() {
    blk_case(false, false);
}

#[test]
fn blk_packed_read_stores_are_logged() {
    blk_case(true, false);
}

#[test]
fn blk_reads_copied_from_a_mapped_tmpfs_image_are_logged() {
    blk_case(false, true);
}
