//! The virtio-blk device (crates/blk: BlkQueue::process, drain, inflight
//! recovery) with the null backend, over a split or packed ring of requests
//! whose headers (type, sector), data lengths, segment layout and status
//! placement come from the input; the disk's capacity, read-only flag,
//! discard / write-zeroes support, block size, the cache mode and the
//! depths vary too. On split rings the input may also hand the queue an
//! inflight log (the memory a frontend shares for VHOST_USER_PROTOCOL_F_
//! INFLIGHT_SHMFD) with hostile contents.
//!
//! Input: ring byte (bit 7 packed; split size 1 << (b % 8), packed 1 +
//! (b & 127)), disk byte (bit 0 INDIRECT_DESC, bit 1 EVENT_IDX, bit 2
//! read-only, bit 3 no discard, bit 4 no write-zeroes, bit 5 4 KiB blocks,
//! bits 6-7 memory table), queue depth (1 + b), backend depth (1 + b),
//! capacity (u64: top bit set = raw bytes, else sectors mod 2^21),
//! inflight byte (bit 0: attach a log; then u16 length and that many bytes
//! of its contents), script length (u8), the script, then the memory image
//! at guest-physical 0 (the ring at 0, tightly packed).
//!
//! Invariants: no panic; nothing written outside guest memory (guard
//! pages); after every pass all used elements are published; after the
//! final drain nothing is in flight and every chain taken from the ring has
//! its used element.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use vhostd_blk::{types, BlkDevice, BlkQueue, InflightLog};
use vhostd_block_backends::BlockSpec;
use vhostd_fuzz::{packed_layout, packed_linear, split_layout, Guest, Reader};
use virtq::ring::*;
use virtq::{Batch, Mapping, PackedConfig, PackedQueue, Queue, SplitConfig, SplitQueue};

const TYPES: [u32; 8] =
    [types::IN, types::OUT, types::FLUSH, types::GET_ID, types::DISCARD, types::WRITE_ZEROES, 2, 0xffff_ffff];

fn lag(q: &Queue, size: u16) -> u32 {
    match q {
        Queue::Split(q) => q.next_avail().wrapping_sub(q.next_used()) as u32,
        Queue::Packed(q) => {
            let b = q.vring_base();
            let m = 2 * size as u32;
            (packed_linear(b as u16, size) + m - packed_linear((b >> 16) as u16, size)) % m
        }
    }
}

/// A shared anonymous mapping for the inflight log, filled with `bytes`.
fn inflight_map(qsize: u16, bytes: &[u8]) -> Arc<Mapping> {
    let len = vhostd_blk::inflight::region_size(qsize);
    let m = Mapping::anonymous(len).expect("anonymous mapping");
    for (i, b) in bytes.iter().take(len).enumerate() {
        m.store(i, [*b]);
    }
    Arc::new(m)
}

fuzz_target!(|data: &[u8]| {
    let g = Guest::get();
    g.clear();
    let mut r = Reader::new(data);
    let (rb, db) = (r.u8(), r.u8());
    let qdepth = 1 + r.u8() as usize;
    let bdepth = 1 + r.u8() as usize;
    let cap_raw = r.u64();
    let capacity = if cap_raw >> 63 != 0 { cap_raw & !(1 << 63) } else { (cap_raw % (1 << 21)) * 512 };
    let ib = r.u8();
    let inflight_bytes = if ib & 1 != 0 {
        let n = r.u16() as usize;
        Some(r.bytes(n))
    } else {
        None
    };
    let nops = r.u8() as usize;
    let ops = r.bytes(nops);
    let image = r.rest();
    let mem = g.table((db >> 6) as usize);
    Guest::write(&mem, 0, image);

    let packed = rb & 0x80 != 0;
    let size = if packed { 1 + (rb & 127) as u16 } else { 1 << (rb % 8) };
    let mut feats = features::VERSION_1;
    if db & 1 != 0 {
        feats |= features::INDIRECT_DESC;
    }
    if db & 2 != 0 {
        feats |= features::EVENT_IDX;
    }
    let (desc, avail, mut q) = if packed {
        feats |= features::RING_PACKED;
        let (desc, driver, device, _) = packed_layout(0, size);
        let cfg = PackedConfig { size, desc, driver, device, features: feats, base: virtq::PACKED_BASE_INITIAL };
        let Ok(q) = PackedQueue::new(mem.clone(), cfg) else { return };
        (desc, driver, Queue::Packed(q))
    } else {
        let (desc, avail, used, _) = split_layout(0, size);
        let cfg = SplitConfig { size, desc, avail, used, features: feats, next_avail: 0 };
        let Ok(q) = SplitQueue::new(mem.clone(), cfg) else { return };
        (desc, avail, Queue::Split(q))
    };

    let (mut disk, mut backends) =
        vhostd_block_backends::open(&BlockSpec::Null { size: capacity }, 1, bdepth).expect("null backend");
    disk.read_only = db & 4 != 0;
    disk.discard = db & 8 == 0;
    disk.write_zeroes = db & 16 == 0;
    if db & 32 != 0 {
        disk.block_size = 4096;
    }
    let dev = BlkDevice::new(disk, 1, "vhostd-fuzz");
    let mut bq = BlkQueue::new(backends.pop().expect("one backend"), qdepth);
    let mut batch = Batch::new();

    let mut lag0 = lag(&q, size);
    let mut tracked = false;
    if let (Some(bytes), false) = (inflight_bytes, packed) {
        // Requests a previous backend left in flight are resubmitted; the
        // ring resumes after them, so the avail/used accounting restarts.
        let log = InflightLog::new(inflight_map(size, bytes), 0, size).expect("log fits");
        bq.attach_inflight(log, &mut q, &mut batch, &dev);
        tracked = true;
        lag0 = lag(&q, size);
    }
    let mut driver_idx = if packed { 0 } else { Guest::r16(&mem, avail + 2) };

    let mut ops = Reader::new(ops);
    while !ops.is_empty() {
        let b = ops.u8();
        let a = b >> 4;
        match b & 7 {
            0 => {
                bq.process(&mut q, &mut batch, &dev);
                assert!(!q.flush_used(), "process left used elements unpublished");
                assert!(bq.in_flight() <= qdepth);
            }
            1 => {
                let at = ops.u16() as u64;
                let bytes = ops.bytes(a as usize + 1);
                Guest::write(&mem, at, bytes);
            }
            2 => {
                // The driver posts a chain (split: a head; packed: a
                // descriptor made available in lap a & 1).
                if packed {
                    let (slot, d) = ops.packed_desc(size, a & 1 != 0);
                    Guest::write(&mem, desc + 16 * slot as u64, &d);
                } else {
                    let head = ops.u8() as u16 % size;
                    let slot = (driver_idx & (size - 1)) as u64;
                    Guest::w16(&mem, avail + 4 + 2 * slot, head);
                    driver_idx = driver_idx.wrapping_add(1);
                    Guest::w16(&mem, avail + 2, driver_idx);
                }
            }
            3 => {
                // The config space: writeback (CONFIG_WCE), or anything.
                if a & 8 == 0 {
                    dev.set_config(32, &[a & 1]);
                } else {
                    let off = ops.u8() as usize;
                    let bytes = ops.bytes((a & 7) as usize);
                    dev.set_config(off, bytes);
                }
            }
            4 => {
                // A request header: type, reserved, sector.
                let at = ops.u16() as u64;
                let sector = if a & 8 != 0 { ops.u64() } else { ops.u16() as u64 };
                let mut h = [0u8; 16];
                h[0..4].copy_from_slice(&TYPES[(a & 7) as usize].to_le_bytes());
                h[8..16].copy_from_slice(&sector.to_le_bytes());
                Guest::write(&mem, at, &h);
            }
            5 => {
                // A discard / write-zeroes range: sector, count, flags.
                let at = ops.u16() as u64;
                let mut s = [0u8; 16];
                s[0..8].copy_from_slice(&(ops.u16() as u64).to_le_bytes());
                s[8..12].copy_from_slice(&(ops.u16() as u32).to_le_bytes());
                s[12..16].copy_from_slice(&(a as u32 & 3).to_le_bytes());
                Guest::write(&mem, at, &s);
            }
            6 => match a % 3 {
                0 => {
                    q.needs_notify();
                }
                1 => q.disable_notifications(),
                _ => {
                    q.enable_notifications();
                }
            },
            _ => {
                bq.drain(&mut q, &dev);
                assert_eq!(bq.in_flight(), 0, "drain left requests in flight");
                assert!(!q.flush_used(), "drain left used elements unpublished");
            }
        }
    }
    // Finish: one more pass, then wait for everything.
    let broken0 = q.is_broken();
    bq.process(&mut q, &mut batch, &dev);
    bq.drain(&mut q, &dev);
    assert_eq!(bq.in_flight(), 0, "requests still in flight after drain");
    assert!(!q.flush_used(), "used elements left unpublished");
    if !tracked {
        let l = lag(&q, size);
        // A split ring broken by a head past the queue consumed that avail
        // entry without a used element (it may have broken any time).
        let ok = l == lag0
            || (!packed && q.is_broken() && l == (lag0 + 1) & 0xffff)
            || (broken0 && l == (lag0 + 1) & 0xffff);
        assert!(ok, "chains taken but never used: lag {l}, at set-up {lag0}");
    }
});
