//! c2c: round-trip time of one cache line between two CPUs, in nanoseconds.
//!
//! The benchmarks' frontend and backend trade ring cache lines between CPU
//! 1 and CPU 0 millions of times a second, so this round trip bounds what
//! either can do. On these VMs it is not fixed: the host moves the vCPUs,
//! and the round trip goes from ~70 ns to ~420 ns for minutes at a time.
//! net-bench measures it around every run to tell those phases apart.
//!
//! usage: c2c CPU_A CPU_B [ROUND_TRIPS]   (prints the mean round trip in ns)
//! Built by bench/net-bench with plain rustc (no crates).
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The bounced word, alone on its cache line (and the adjacent-line prefetcher's pair).
#[repr(align(128))]
struct Line(AtomicU64);

extern "C" {
    fn sched_setaffinity(pid: i32, cpusetsize: usize, mask: *const u64) -> i32;
}

fn pin(cpu: usize) {
    let mut mask = [0u64; 16];
    if cpu >= mask.len() * 64 {
        eprintln!("c2c: CPU {cpu} out of range");
        std::process::exit(2);
    }
    mask[cpu / 64] |= 1 << (cpu % 64);
    // SAFETY: the declaration matches glibc's `int sched_setaffinity(pid_t,
    // size_t, const cpu_set_t *)`; `mask` is a live array of exactly
    // `cpusetsize` bytes that the kernel only reads during the call; pid 0
    // is the calling thread.
    if unsafe { sched_setaffinity(0, std::mem::size_of_val(&mask), mask.as_ptr()) } != 0 {
        eprintln!("c2c: cannot pin to CPU {cpu}: {}", std::io::Error::last_os_error());
        std::process::exit(1);
    }
}

fn arg(args: &[String], i: usize, default: Option<u64>) -> u64 {
    match (args.get(i).map(|a| a.parse::<u64>()), default) {
        (Some(Ok(v)), _) => v,
        (None, Some(d)) => d,
        _ => {
            eprintln!("usage: c2c CPU_A CPU_B [ROUND_TRIPS]");
            std::process::exit(2);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (a, b, n) = (arg(&args, 0, None) as usize, arg(&args, 1, None) as usize, arg(&args, 2, Some(20000)).max(1));
    // A few hundred untimed round trips first: thread start and pinning
    // stay out of the mean.
    let warm = 500;
    let line = Arc::new(Line(AtomicU64::new(0)));
    let peer = line.clone();
    // The peer answers each odd value with the next even one.
    let t = std::thread::spawn(move || {
        pin(b);
        for i in 0..warm + n {
            while peer.0.load(Ordering::Acquire) != 2 * i + 1 {
                std::hint::spin_loop();
            }
            peer.0.store(2 * i + 2, Ordering::Release);
        }
    });
    pin(a);
    let bounce = |i: u64| {
        line.0.store(2 * i + 1, Ordering::Release);
        while line.0.load(Ordering::Acquire) != 2 * i + 2 {
            std::hint::spin_loop();
        }
    };
    (0..warm).for_each(bounce);
    let t0 = std::time::Instant::now();
    (warm..warm + n).for_each(bounce);
    let ns = t0.elapsed().as_nanos() as f64 / n as f64;
    let _ = t.join();
    println!("{ns:.0}");
}
