//! `vhostd-user`: a virtio-net frontend over vhost-user for benchmarks and
//! smoke tests. One busy-polling thread drives every queue pair.

use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use vhostd_user::{build_udp_frame, features, NetStats, Options, RxQueue, TxQueue, VirtioUser};

#[derive(Parser)]
#[command(
    name = "vhostd-user",
    version,
    about = "vhost-user frontend (virtio-user) for vhostd tests and benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Drive a virtio-net vhost-user backend.
    Net(NetArgs),
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Send frames as fast as the backend takes them.
    Txonly,
    /// Keep RX buffers posted and count frames received.
    Rxonly,
    /// Send every received frame back.
    Echo,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

impl Switch {
    fn on(self) -> bool {
        self == Switch::On
    }
}

#[derive(clap::Args)]
struct NetArgs {
    /// The backend's vhost-user socket.
    #[arg(long)]
    socket_path: PathBuf,
    /// What to do with the queues.
    #[arg(long, value_enum)]
    mode: Mode,
    /// Frame size in bytes (Ethernet header to payload end, no FCS, no virtio header).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(42..=2036))]
    pkt_size: u32,
    /// Stop after this many seconds.
    #[arg(long, value_parser = parse_duration)]
    duration: Option<f64>,
    /// Stop after this many packets (sent in txonly, received otherwise).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    count: Option<u64>,
    /// Queue pairs.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=128))]
    queues: u16,
    /// Entries per queue (a power of two up to 32768).
    #[arg(long, default_value_t = 256, value_parser = parse_queue_size)]
    queue_size: u16,
    /// Negotiate VIRTIO_NET_F_MRG_RXBUF (when offered).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    mrg_rxbuf: Switch,
    /// Negotiate VIRTIO_RING_F_EVENT_IDX (when offered).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    event_idx: Switch,
    /// Use packed virtqueues (VIRTIO_F_RING_PACKED; the backend must offer it).
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    packed: Switch,
    /// Negotiate VIRTIO_F_IN_ORDER (when offered).
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    in_order: Switch,
    /// Pin the polling thread to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// Frames per ring operation.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=4096))]
    burst: u16,
    /// Guest memory in MiB (a memfd, not hugepages).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    mem_mb: u64,
    /// How long to keep retrying to connect while the backend is not listening yet.
    #[arg(long, default_value = "10", value_parser = parse_duration)]
    connect_timeout: f64,
}

fn parse_duration(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number of seconds")),
    }
}

fn parse_queue_size(s: &str) -> Result<u16, String> {
    match s.parse::<u32>() {
        Ok(v) if v > 0 && v <= 32768 && v.is_power_of_two() => Ok(v as u16),
        _ => Err(format!("`{s}` is not a power of two in 1..=32768")),
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn install_signals() {
    let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, h);
        libc::signal(libc::SIGTERM, h);
    }
}

fn pin_to(cpu: usize) -> Result<(), String> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(format!("--cpu {cpu} is out of range"));
    }
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it (cpu checked
    // above); sched_setaffinity reads it for the calling thread.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r != 0 {
        return Err(format!("--cpu {cpu}: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn connect(a: &NetArgs) -> Result<VirtioUser, String> {
    let mut opts = Options::new(&a.socket_path);
    opts.mem_size = a.mem_mb << 20;
    opts.features = features::VERSION_1 | features::NET_MAC | features::NET_STATUS;
    if a.mrg_rxbuf.on() {
        opts.features |= features::NET_MRG_RXBUF;
    }
    if a.event_idx.on() {
        opts.features |= features::EVENT_IDX;
    }
    if a.queues > 1 {
        opts.features |= features::NET_MQ;
    }
    if a.packed.on() {
        opts.features |= features::RING_PACKED;
        opts.required |= features::RING_PACKED;
    }
    if a.in_order.on() {
        opts.features |= features::IN_ORDER;
    }
    let deadline = Instant::now() + Duration::from_secs_f64(a.connect_timeout);
    loop {
        match VirtioUser::connect(opts.clone()) {
            Ok(d) => return Ok(d),
            Err(vhostd_user::Error::Vhost("connect", e)) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(format!("{}: {e}", a.socket_path.display())),
        }
    }
}

struct Totals {
    rx: NetStats,
    tx: NetStats,
    tx_dropped: u64,
    kicks: u64,
}

fn run(a: &NetArgs) -> Result<(Totals, f64, Option<String>), String> {
    let mut dev = connect(a)?;
    let f = dev.features();
    eprintln!(
        "vhostd-user: connected to {}: features {:#x} (offered {:#x}), protocol {:#x}, max queues {}, hdr {} bytes",
        a.socket_path.display(),
        f,
        dev.offered_features(),
        dev.protocol_features().bits(),
        dev.max_queues(),
        dev.net_hdr_len()
    );
    if let Some(c) = dev.net_config() {
        let m = c.mac;
        eprintln!(
            "vhostd-user: config mac {:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x} status {} max_virtqueue_pairs {}",
            m[0], m[1], m[2], m[3], m[4], m[5], c.status, c.max_virtqueue_pairs
        );
    } else if let Some(e) = dev.net_config_error() {
        eprintln!("vhostd-user: no config space: {e}");
    }
    let (mrg, eidx) = (
        f & features::NET_MRG_RXBUF != 0,
        f & features::EVENT_IDX != 0,
    );
    if a.mrg_rxbuf.on() != mrg || a.event_idx.on() != eidx {
        eprintln!("vhostd-user: note: mrg_rxbuf={mrg} event_idx={eidx} after negotiation");
    }
    let mut pairs: Vec<(RxQueue, TxQueue)> = Vec::new();
    for p in 0..a.queues {
        let (mut rx, mut tx) = dev
            .net_queue_pair(p, a.queue_size)
            .map_err(|e| format!("queue pair {p}: {e}"))?;
        // Busy polling: ask the backend not to signal us.
        rx.queue.ring.disable_notifications();
        tx.queue.ring.disable_notifications();
        pairs.push((rx, tx));
    }
    let src = dev
        .net_config()
        .map(|c| c.mac)
        .unwrap_or([0x02, 0, 0, 0, 0, 0x01]);
    let frame = build_udp_frame(a.pkt_size as usize, src, [0x02, 0, 0, 0, 0, 0x02]);
    if a.mode == Mode::Txonly {
        for (_, tx) in pairs.iter_mut() {
            tx.set_template(&frame).map_err(|e| e.to_string())?;
        }
    }
    if let Some(cpu) = a.cpu {
        pin_to(cpu)?;
    }

    let burst = a.burst as usize;
    let count = a.count.unwrap_or(u64::MAX);
    let start = Instant::now();
    let deadline = a.duration.map(|d| start + Duration::from_secs_f64(d));
    let mut posted: u64 = 0;
    let mut tx_dropped = 0u64;
    let mut iter: u64 = 0;
    let mut failure = None;
    let mut saw_rx = false;
    let mut first_rx: Option<Instant> = None;
    let mut last_rx = start;
    let done = |pairs: &Vec<(RxQueue, TxQueue)>| -> u64 {
        pairs
            .iter()
            .map(|(rx, tx)| {
                if a.mode == Mode::Txonly {
                    tx.stats.packets
                } else {
                    rx.stats.packets
                }
            })
            .sum()
    };
    'outer: loop {
        for (rx, tx) in pairs.iter_mut() {
            let r = match a.mode {
                Mode::Txonly => (|| {
                    tx.reclaim()?;
                    let want = (burst as u64).min(count - posted) as usize;
                    let n = tx.send_template(want)?;
                    posted += n as u64;
                    if n > 0 {
                        tx.flush()?;
                    }
                    Ok::<(), vhostd_user::Error>(())
                })(),
                Mode::Rxonly => rx.recv_burst(burst, |_| {}).map(|n| {
                    if n > 0 {
                        saw_rx = true;
                    }
                }),
                Mode::Echo => (|| {
                    tx.reclaim()?;
                    let mut err = None;
                    let n = rx.recv_burst(burst, |fr| match tx.send_frame(fr) {
                        Ok(true) => {}
                        Ok(false) => tx_dropped += 1,
                        Err(e) => {
                            tx_dropped += 1;
                            err.get_or_insert(e);
                        }
                    })?;
                    if n > 0 {
                        saw_rx = true;
                        tx.flush()?;
                    }
                    // Oversized frames are counted as dropped, not fatal.
                    drop(err);
                    Ok(())
                })(),
            };
            if let Err(e) = r {
                failure = Some(format!("queue pair {}: {e}", rx.queue.index() / 2));
                break 'outer;
            }
        }
        if saw_rx {
            // The receive rate counts from the first frame to the last one,
            // not the time spent waiting for the peer to start or after it stopped.
            saw_rx = false;
            let now = Instant::now();
            first_rx.get_or_insert(now);
            last_rx = now;
        }
        iter += 1;
        if iter.is_multiple_of(256) {
            if done(&pairs) >= count || STOP.load(Ordering::Relaxed) {
                break;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            if iter.is_multiple_of(65536) {
                if dev.backend_gone() {
                    failure = Some("backend closed the connection".into());
                    break;
                }
                for (rx, tx) in pairs.iter_mut() {
                    rx.queue.ring.refresh_disabled();
                    tx.queue.ring.refresh_disabled();
                }
            }
        }
    }
    let mut seconds = match first_rx {
        Some(f) if a.mode != Mode::Txonly && last_rx > f => (last_rx - f).as_secs_f64(),
        _ => start.elapsed().as_secs_f64(),
    };
    // Let frames already handed over complete, so they count.
    if a.mode == Mode::Txonly && failure.is_none() {
        let until = Instant::now() + Duration::from_millis(200);
        while Instant::now() < until && pairs.iter().any(|(_, tx)| tx.queue.ring.in_flight() > 0) {
            for (_, tx) in pairs.iter_mut() {
                let _ = tx.reclaim();
            }
        }
        seconds = start.elapsed().as_secs_f64();
    }
    // Stopped by time or signal: take what the backend already put in the
    // RX rings (its sender may have been stopped first), so counts compare
    // exactly with the peer's. The rate keeps the measured window.
    let by_count = done(&pairs) >= count;
    if a.mode != Mode::Txonly && failure.is_none() && !by_count {
        let mut idle_since = Instant::now();
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until && idle_since.elapsed() < Duration::from_millis(50) {
            let mut got = 0;
            for (rx, tx) in pairs.iter_mut() {
                let _ = tx.reclaim();
                got += rx
                    .recv_burst(burst, |fr| {
                        if a.mode == Mode::Echo && !matches!(tx.send_frame(fr), Ok(true)) {
                            tx_dropped += 1;
                        }
                    })
                    .unwrap_or(0);
                let _ = tx.flush();
            }
            if got > 0 {
                idle_since = Instant::now();
            }
        }
    }
    let mut t = Totals {
        rx: NetStats::default(),
        tx: NetStats::default(),
        tx_dropped,
        kicks: 0,
    };
    for (rx, tx) in &pairs {
        t.rx.add(&rx.stats);
        t.tx.add(&tx.stats);
        t.kicks += rx.queue.kicks_sent + tx.queue.kicks_sent;
    }
    if failure.is_none() && !dev.backend_gone() {
        match dev.disconnect() {
            Ok(bases) => {
                let s: Vec<String> = bases.iter().map(|(q, b)| format!("{q}:{b}")).collect();
                eprintln!("vhostd-user: vring bases {}", s.join(" "));
            }
            Err(e) => eprintln!("vhostd-user: warning: disconnect: {e}"),
        }
    }
    Ok((t, seconds, failure))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Cmd::Net(a) = cli.cmd;
    install_signals();
    match run(&a) {
        Ok((t, secs, failure)) => {
            let main = if a.mode == Mode::Txonly { t.tx } else { t.rx };
            let secs = secs.max(1e-9);
            println!(
                "report packets={} bytes={} seconds={:.3} mpps={:.3}",
                main.packets,
                main.bytes,
                secs,
                main.packets as f64 / secs / 1e6
            );
            println!(
                "report_detail rx_packets={} rx_bytes={} tx_packets={} tx_bytes={} rx_bad={} rx_dropped={} tx_dropped={} kicks={} rx_mpps={:.3} tx_mpps={:.3}",
                t.rx.packets,
                t.rx.bytes,
                t.tx.packets,
                t.tx.bytes,
                t.rx.bad,
                t.rx.dropped,
                t.tx_dropped,
                t.kicks,
                t.rx.packets as f64 / secs / 1e6,
                t.tx.packets as f64 / secs / 1e6
            );
            match failure {
                Some(e) => {
                    eprintln!("vhostd-user: {e}");
                    ExitCode::from(1)
                }
                None => ExitCode::SUCCESS,
            }
        }
        Err(e) => {
            eprintln!("vhostd-user: {e}");
            ExitCode::from(1)
        }
    }
}
