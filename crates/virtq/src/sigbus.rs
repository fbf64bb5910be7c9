//! Surviving a peer that truncates a file under a mapping of it.
//!
//! A file someone else can still shrink (guest memory on hugetlbfs or in a
//! plain file; a disk image on tmpfs) makes the next access to the lost
//! pages raise SIGBUS. The handler here finds the registered mapping the
//! fault is in, marks it lost, replaces the whole mapping with private zero
//! pages (so the access, retried, goes on: reads see zeros, writes go
//! nowhere) and, for guest memory, counts it ([`lost_mappings`]). The
//! mapping's owner reads the mark ([`Registration::lost`]) and stops
//! trusting what it copied. Faults anywhere else keep their default action.
//!
//! One table for the process, as there is one handler: vhostd registers
//! guest memory and block-backends registers mapped images in it.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Mappings the handler covers at once.
pub const SLOTS: usize = 4096;

/// Of those, the ones mapped disk images may take (the last ones), so that
/// images never leave guest memory without a slot: a memory region the
/// handler cannot cover is refused, an image is only read with preadv.
pub const IMAGE_SLOTS: usize = 1024;

/// One live mapping the handler covers: its start and length (start 0: a
/// free slot), whether a fault replaced it, and whether that counts in
/// [`lost_mappings`].
pub struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    lost: AtomicBool,
    counted: AtomicBool,
}

impl Slot {
    /// A free slot (for a table of one's own: tests).
    pub const fn new() -> Slot {
        Slot {
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            lost: AtomicBool::new(false),
            counted: AtomicBool::new(false),
        }
    }

    /// Whether the slot covers a mapping starting at `addr`.
    pub fn holds(&self, addr: usize) -> bool {
        self.start.load(Ordering::Acquire) == addr && addr != 0
    }
}

impl Default for Slot {
    fn default() -> Slot {
        Slot::new()
    }
}

/// The handler's table.
pub static TABLE: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];
static LOST: AtomicU64 = AtomicU64::new(0);

/// The part of [`TABLE`] for guest memory.
pub fn guest_memory_slots() -> &'static [Slot] {
    &TABLE[..SLOTS - IMAGE_SLOTS]
}

/// The part of [`TABLE`] for mapped disk images.
pub fn image_slots() -> &'static [Slot] {
    &TABLE[SLOTS - IMAGE_SLOTS..]
}

/// A mapping's slot in a table, given up on drop (which the mapping's
/// owner does just before it unmaps).
pub struct Registration(&'static Slot);

impl Registration {
    /// Whether a fault replaced the mapping with zero pages: what was read
    /// from it since may be zeros, what was written went nowhere.
    pub fn lost(&self) -> bool {
        self.0.lost.load(Ordering::Acquire)
    }
}

/// Takes a free slot of `table` for the mapping at `addr` of `len` bytes;
/// None when every slot is taken. Only [`TABLE`]'s slots are covered by the
/// handler. `counted`: a loss counts in [`lost_mappings`] (guest memory,
/// which the frontend shrank); otherwise its owner reports it.
pub fn register(table: &'static [Slot], (addr, len): (usize, usize), counted: bool) -> Option<Registration> {
    for slot in table {
        if slot.start.compare_exchange(0, addr, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            slot.lost.store(false, Ordering::Release);
            slot.counted.store(counted, Ordering::Release);
            // Last: the handler matches a slot only once its length is set.
            slot.len.store(len, Ordering::Release);
            return Some(Registration(slot));
        }
    }
    None
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.0.len.store(0, Ordering::Release);
        self.0.start.store(0, Ordering::Release);
    }
}

/// Counted mappings (guest memory) replaced by zero pages after their
/// file shrank (since start).
pub fn lost_mappings() -> u64 {
    LOST.load(Ordering::Relaxed)
}

/// Whether the handler is installed: without it, a truncated mapping's
/// next access kills the process.
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Acquire)
}

/// Installs the SIGBUS handler (once, early; before threads start).
pub fn install_handler() -> io::Result<()> {
    // SAFETY: installs an async-signal-safe handler (see on_sigbus); the
    // sigaction struct is plain data, zeroed then filled.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigbus as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    INSTALLED.store(true, Ordering::Release);
    Ok(())
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t; si_addr is the fault
    // address for SIGBUS. Only atomics and async-signal-safe calls follow.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in &TABLE {
        let start = slot.start.load(Ordering::Acquire);
        let len = slot.len.load(Ordering::Acquire);
        if start != 0 && len != 0 && addr >= start && addr < start + len {
            // Marked before the zeros appear: whoever then reads zeros from
            // the mapping (this thread or another) also sees the mark.
            slot.lost.store(true, Ordering::Release);
            // SAFETY: replaces exactly our own mapping [start, start+len)
            // with private anonymous memory; nothing else lives there.
            let r = unsafe {
                libc::mmap(
                    start as *mut libc::c_void,
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if r != libc::MAP_FAILED {
                if slot.counted.load(Ordering::Acquire) {
                    LOST.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            break;
        }
    }
    // Not ours: the default action (the fault repeats on return).
    // SAFETY: signal(2) is async-signal-safe.
    unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_marked_lost_only_for_its_own_life() {
        static SMALL: [Slot; 1] = [const { Slot::new() }; 1];
        let r = register(&SMALL, (0x1000, 0x1000), true).unwrap();
        assert!(SMALL[0].holds(0x1000) && !r.lost());
        assert!(register(&SMALL, (0x3000, 0x1000), true).is_none(), "full");
        SMALL[0].lost.store(true, Ordering::Release);
        assert!(r.lost());
        drop(r);
        assert!(!SMALL[0].holds(0x1000));
        // The next owner starts unmarked.
        let r = register(&SMALL, (0x5000, 0x1000), false).unwrap();
        assert!(SMALL[0].holds(0x5000) && !r.lost());
    }

    #[test]
    // Safe code only, and 1024 registrations scanning up to 1024 slots
    // each: half a million compare-exchanges, minutes under Miri.
    #[cfg_attr(miri, ignore = "half a million atomics, minutes under Miri; no unsafe code")]
    fn images_never_take_guest_memory_slots() {
        // The handler's own table (no test here registers anything else in
        // it). The addresses are made up: nothing faults.
        let base = 0x7e00_0000_0000usize;
        let images: Vec<Registration> = (0..IMAGE_SLOTS)
            .map(|i| register(image_slots(), (base + i * 0x1000, 0x1000), false).expect("an image slot"))
            .collect();
        assert!(register(image_slots(), (base - 0x1000, 0x1000), false).is_none(), "image slots all taken");
        let guest = base + 0x1000_0000;
        let memory = register(guest_memory_slots(), (guest, 0x1000), true).expect("guest memory keeps its slots");
        assert!(guest_memory_slots().iter().any(|s| s.holds(guest)));
        assert!(!image_slots().iter().any(|s| s.holds(guest)));
        assert_eq!(guest_memory_slots().len() + image_slots().len(), SLOTS);
        drop(memory);
        drop(images);
        assert!(!TABLE.iter().any(|s| s.holds(base) || s.holds(guest)), "slots given back");
    }
}
