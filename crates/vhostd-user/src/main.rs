//! `vhostd-user`: a virtio-net, virtio-blk and virtio-scsi frontend over
//! vhost-user for benchmarks and smoke tests. One thread drives every
//! queue: `net` busy-polls its queue pairs, `blk` and `scsi` run fio-like
//! workloads (the same engine, so the two devices compare directly).

use clap::{Parser, Subcommand, ValueEnum};
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use vhostd_user::blk::workload::{self, IoQueue, Workload};
use vhostd_user::{
    blk, build_udp_frame, features, scsi, DirtyLog, NetStats, Options, RxQueue, TxQueue, VirtQueue, VirtioUser,
};

#[derive(Parser)]
#[command(name = "vhostd-user", version, about = "vhost-user frontend (virtio-user) for vhostd tests and benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Drive a virtio-net vhost-user backend.
    Net(NetArgs),
    /// Drive a virtio-blk vhost-user backend with a fio-like workload and
    /// print one summary line: `blk mode=.. bs=.. iodepth=.. queues=..
    /// ios=.. errors=.. bytes=.. seconds=.. iops=.. mbps=.. lat_us p50=..
    /// p90=.. p99=.. p999=.. max=..` (mbps: 10^6 bytes/s; verify adds
    /// `verify=ok|mismatch [first_mismatch=OFFSET] blocks=.. flush=..`),
    /// then `reordered=N`: completions that overtook earlier requests.
    /// With --idle, then `idle seconds=.. calls=..`.
    /// Exits 1 on any request error or mismatch.
    Blk(BlkArgs),
    /// Drive one unit of a virtio-scsi vhost-user backend with the same
    /// workloads (READ(16), WRITE(16), SYNCHRONIZE CACHE) and print the
    /// same summary line, starting `scsi mode=..`. Exits 1 on any command
    /// error or mismatch.
    Scsi(ScsiArgs),
}

#[derive(clap::Args)]
struct ScsiArgs {
    #[command(flatten)]
    io: BlkArgs,
    /// The unit (LUN) of target 0 to drive.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=16383))]
    lun: u16,
    /// Entries per request queue's ring (a power of two). Default: the
    /// smallest holding --iodepth commands.
    #[arg(long, value_parser = parse_queue_size)]
    queue_size: Option<u16>,
    /// Put each command's 3 descriptors in an indirect table behind one
    /// ring entry (VIRTIO_RING_F_INDIRECT_DESC, negotiated only then; an
    /// error if the device does not offer it), as Linux's virtio_scsi does
    /// when its ring is short. auto: on only when --queue-size cannot hold
    /// --iodepth commands of 3 descriptors (e.g. --iodepth 128
    /// --queue-size 128 for a device whose rings hold at most 128 entries).
    #[arg(long, value_enum, default_value_t = Indirect::Auto)]
    indirect: Indirect,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Indirect {
    On,
    Off,
    Auto,
}

impl ScsiArgs {
    /// Whether the request queues use indirect descriptors, or why the
    /// options cannot work.
    fn indirect(&self) -> Result<bool, String> {
        let depth = self.io.iodepth as u32;
        let direct_fits = self.queue_size.is_none_or(|n| n as u32 >= depth * scsi::DESCS_PER_CMD as u32);
        match self.indirect {
            Indirect::On => Ok(true),
            Indirect::Auto => Ok(!direct_fits),
            Indirect::Off if direct_fits => Ok(false),
            Indirect::Off => Err(format!(
                "--queue-size {} cannot hold --iodepth {depth} commands of {} descriptors: \
                 --indirect on (or auto), a larger ring, or a smaller depth",
                self.queue_size.unwrap_or(0),
                scsi::DESCS_PER_CMD
            )),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BlkMode {
    /// Reads at random bs-aligned offsets.
    Randread,
    /// Writes at random bs-aligned offsets.
    Randwrite,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Write a pattern (from each block's offset and --seed) over the area
    /// or --count blocks, FLUSH, read it all back and compare.
    Verify,
}

#[derive(clap::Args)]
struct BlkArgs {
    /// The backend's vhost-user socket (vfio-user: the device's socket).
    #[arg(long)]
    socket_path: PathBuf,
    /// vhost-user, or vfio-user (blk only): act as the VMM and the guest's
    /// virtio-pci driver of a vfio-user device (DMA_MAP, the common config
    /// through REGION_WRITEs, MSI-X eventfds, doorbells stored into the
    /// mapped page when offered, else REGION_WRITEs).
    #[arg(long, value_enum, default_value_t = Transport::VhostUser)]
    transport: Transport,
    /// What to do (optional with --idle: then no workload).
    #[arg(long, value_enum, required_unless_present = "idle")]
    mode: Option<BlkMode>,
    /// Bytes per request: a multiple of 512 (suffixes k, m: KiB, MiB).
    #[arg(long, default_value = "4096", value_parser = parse_bs)]
    bs: u32,
    /// Requests in flight per queue.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=4096))]
    iodepth: u16,
    /// Request queues (blk: more than 1 needs VIRTIO_BLK_F_MQ; scsi: at most
    /// the device's num_queues).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    queues: u16,
    /// Stop submitting after this many seconds (not for verify).
    #[arg(long, value_parser = parse_duration)]
    duration: Option<f64>,
    /// Requests to make (verify: blocks). Default without --duration: one
    /// pass over the area.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    count: Option<u64>,
    /// Use packed virtqueues (VIRTIO_F_RING_PACKED; the backend must offer it).
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    packed: Switch,
    /// Bytes of the disk to use from offset 0 (suffixes k, m, g, t); default all.
    #[arg(long, value_parser = parse_bytes)]
    size: Option<u64>,
    /// Seeds random offsets and the verify pattern.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Busy-poll the used rings instead of sleeping on call eventfds.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    poll: Switch,
    /// Negotiate VIRTIO_RING_F_EVENT_IDX (when offered).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    event_idx: Switch,
    /// Pin the thread to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// Guest memory in MiB (default: what the queues need).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=65536))]
    mem_mb: Option<u64>,
    /// Turn on dirty-page logging once the queues run, as QEMU does while
    /// migrating (SET_LOG_BASE, LOG_ALL, VHOST_VRING_F_LOG): its cost.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    dirty_log: Switch,
    /// How long to keep retrying to connect while the backend is not listening yet.
    #[arg(long, default_value = "10", value_parser = parse_duration)]
    connect_timeout: f64,
    /// Fail when no request completes for this many seconds.
    #[arg(long, default_value = "30", value_parser = parse_duration)]
    stall_timeout: f64,
    /// After the workload (without --mode: right after the set-up), keep
    /// the device set up, its queues running and nothing in flight for
    /// this many seconds, asleep on the call eventfds with calls enabled
    /// (an idle guest), then tear down as usual; prints `idle seconds=..
    /// calls=..` (calls: interrupts that came meanwhile). What the device
    /// costs while its driver does nothing (bench/idle-cpu). The line
    /// `vhostd-user: idle for SECS s from T` on stderr marks its start (T:
    /// seconds since the epoch).
    #[arg(long, value_parser = parse_duration)]
    idle: Option<f64>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    /// Send frames as fast as the backend takes them.
    Txonly,
    /// Keep RX buffers posted and count frames received.
    Rxonly,
    /// Send every received frame back.
    Echo,
    /// Send frames as in txonly and count frames received as in rxonly,
    /// on every pair (a loopback backend makes each frame a round trip).
    Txrx,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Transport {
    VhostUser,
    VfioUser,
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
    /// The backend's vhost-user socket. Repeated: one device per socket,
    /// all driven by this one thread (their queue pairs taken in turn),
    /// and the counts are their sums.
    #[arg(long, required = true)]
    socket_path: Vec<PathBuf>,
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
    /// Offer frames at this rate (Mpps, all queue pairs of all devices
    /// together, an equal share each) instead of as fast as the backend
    /// takes them, as a source that does not wait would (a NIC, a guest
    /// forwarding at line rate): a frame due while its ring is full is
    /// dropped and counted in tx_dropped. txonly and txrx.
    #[arg(long, value_parser = parse_rate)]
    rate: Option<f64>,
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
    /// Turn on dirty-page logging once the queues run, as QEMU does while
    /// migrating (SET_LOG_BASE, LOG_ALL, VHOST_VRING_F_LOG): its cost.
    #[arg(long, value_enum, default_value_t = Switch::Off)]
    dirty_log: Switch,
    /// How long to keep retrying to connect while the backend is not listening yet.
    #[arg(long, default_value = "10", value_parser = parse_duration)]
    connect_timeout: f64,
}

/// A log covering the guest memory, handed to the backend and turned on
/// for `queues` (kept alive by the caller while the workload runs).
fn start_dirty_log(dev: &mut VirtioUser, queues: &[&VirtQueue]) -> Result<DirtyLog, String> {
    let end = dev.memory().gpa_base() + dev.memory().size();
    let log = DirtyLog::covering(end).map_err(|e| format!("dirty log: {e}"))?;
    dev.start_dirty_log(&log, queues).map_err(|e| format!("dirty log: {e}"))?;
    eprintln!("vhostd-user: dirty logging on ({} bytes of log)", log.size());
    Ok(log)
}

fn parse_rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 1000.0 => Ok(v),
        _ => Err(format!("expected a rate in Mpps above 0 and at most 1000, not '{s}'")),
    }
}

fn parse_duration(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v < 1e9 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number of seconds")),
    }
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, shift) = match t.as_bytes().last() {
        Some(b'k') => (&t[..t.len() - 1], 10),
        Some(b'm') => (&t[..t.len() - 1], 20),
        Some(b'g') => (&t[..t.len() - 1], 30),
        Some(b't') => (&t[..t.len() - 1], 40),
        _ => (&t[..], 0),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|v| v.checked_mul(1u64 << shift))
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("`{s}` is not a positive byte count"))
}

fn parse_bs(s: &str) -> Result<u32, String> {
    match parse_bytes(s)? {
        v if v.is_multiple_of(512) && v <= 64 << 20 => Ok(v as u32),
        _ => Err(format!("`{s}` is not a multiple of 512 up to 64 MiB")),
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

/// Connects, retrying while the socket is not there yet.
fn connect_retry(opts: Options, timeout: f64) -> Result<VirtioUser, String> {
    let deadline = Instant::now() + Duration::from_secs_f64(timeout);
    loop {
        match VirtioUser::connect(opts.clone()) {
            Ok(d) => return Ok(d),
            Err(vhostd_user::Error::Vhost("connect", _)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(format!("{}: {e}", opts.socket_path.display())),
        }
    }
}

fn connect(a: &NetArgs, path: &std::path::Path) -> Result<VirtioUser, String> {
    let mut opts = Options::new(path);
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
    connect_retry(opts, a.connect_timeout)
}

struct Totals {
    rx: NetStats,
    tx: NetStats,
    tx_dropped: u64,
    kicks: u64,
}

/// One device connected: the frontend, its queue pairs, its dirty log.
type SetUp = (VirtioUser, Vec<(RxQueue, TxQueue)>, Option<DirtyLog>);

/// Connects to one device and sets up its queue pairs (and its dirty log).
fn set_up(a: &NetArgs, path: &std::path::Path) -> Result<SetUp, String> {
    let mut dev = connect(a, path)?;
    let f = dev.features();
    eprintln!(
        "vhostd-user: connected to {}: features {:#x} (offered {:#x}), protocol {:#x}, max queues {}, hdr {} bytes",
        path.display(),
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
    let (mrg, eidx) = (f & features::NET_MRG_RXBUF != 0, f & features::EVENT_IDX != 0);
    if a.mrg_rxbuf.on() != mrg || a.event_idx.on() != eidx {
        eprintln!("vhostd-user: note: mrg_rxbuf={mrg} event_idx={eidx} after negotiation");
    }
    let mut pairs: Vec<(RxQueue, TxQueue)> = Vec::new();
    for p in 0..a.queues {
        let (mut rx, mut tx) = dev.net_queue_pair(p, a.queue_size).map_err(|e| format!("queue pair {p}: {e}"))?;
        // Busy polling: ask the backend not to signal us.
        rx.queue.ring.disable_notifications();
        tx.queue.ring.disable_notifications();
        pairs.push((rx, tx));
    }
    let _log = if a.dirty_log.on() {
        let queues: Vec<&VirtQueue> = pairs.iter().flat_map(|(rx, tx)| [&rx.queue, &tx.queue]).collect();
        Some(start_dirty_log(&mut dev, &queues)?)
    } else {
        None
    };
    let src = dev.net_config().map(|c| c.mac).unwrap_or([0x02, 0, 0, 0, 0, 0x01]);
    let frame = build_udp_frame(a.pkt_size as usize, src, [0x02, 0, 0, 0, 0, 0x02]);
    if matches!(a.mode, Mode::Txonly | Mode::Txrx) {
        for (_, tx) in pairs.iter_mut() {
            tx.set_template(&frame).map_err(|e| e.to_string())?;
        }
    }
    Ok((dev, pairs, _log))
}

fn run(a: &NetArgs) -> Result<(Totals, f64, Option<String>), String> {
    if a.rate.is_some() && !matches!(a.mode, Mode::Txonly | Mode::Txrx) {
        return Err("--rate: only with --mode txonly or txrx".into());
    }
    let mut devs = Vec::with_capacity(a.socket_path.len());
    let mut pairs: Vec<(RxQueue, TxQueue)> = Vec::new();
    let mut _logs = Vec::new();
    for path in &a.socket_path {
        let (dev, p, log) = set_up(a, path)?;
        devs.push(dev);
        pairs.extend(p);
        _logs.push(log);
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
    // --rate: frames each pair has been offered so far (sent or dropped),
    // and the share of the rate each pair gets, in frames per nanosecond.
    let mut offered = vec![0u64; pairs.len()];
    let per_pair_ns = a.rate.map(|r| r * 1e-3 / pairs.len() as f64);
    let mut elapsed_ns = 0f64;
    let mut iter: u64 = 0;
    let mut failure = None;
    let mut saw_rx = false;
    let mut first_rx: Option<Instant> = None;
    let mut last_rx = start;
    let done = |pairs: &Vec<(RxQueue, TxQueue)>| -> u64 {
        pairs.iter().map(|(rx, tx)| if a.mode == Mode::Txonly { tx.stats.packets } else { rx.stats.packets }).sum()
    };
    'outer: loop {
        if per_pair_ns.is_some() {
            elapsed_ns = start.elapsed().as_nanos() as f64;
        }
        for (p, (rx, tx)) in pairs.iter_mut().enumerate() {
            let r = match a.mode {
                Mode::Txonly | Mode::Txrx => (|| {
                    tx.reclaim()?;
                    let mut want = (burst as u64).min(count.saturating_sub(posted)) as usize;
                    let mut due = 0;
                    if let Some(rate) = per_pair_ns {
                        due = ((elapsed_ns * rate) as u64).saturating_sub(offered[p]).min(count.saturating_sub(posted));
                        want = due as usize;
                    }
                    let n = tx.send_template(want)?;
                    posted += n as u64;
                    if per_pair_ns.is_some() {
                        // What did not fit was due now: a source that does not wait loses it.
                        offered[p] += due;
                        tx_dropped += due - n as u64;
                    }
                    if n > 0 {
                        tx.flush()?;
                    }
                    if a.mode == Mode::Txrx && rx.recv_burst_shared(burst, |_, _| {})? > 0 {
                        saw_rx = true;
                    }
                    Ok::<(), vhostd_user::Error>(())
                })(),
                Mode::Rxonly => rx.recv_burst_shared(burst, |_, _| {}).map(|n| {
                    if n > 0 {
                        saw_rx = true;
                    }
                }),
                Mode::Echo => (|| {
                    tx.reclaim()?;
                    let mut err = None;
                    let n = rx.recv_burst_shared(burst, |_, fr| match tx.send_shared(fr) {
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
                if devs.iter().any(|d| d.backend_gone()) {
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
                    .recv_burst_shared(burst, |_, fr| {
                        if a.mode == Mode::Echo && !matches!(tx.send_shared(fr), Ok(true)) {
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
    let mut t = Totals { rx: NetStats::default(), tx: NetStats::default(), tx_dropped, kicks: 0 };
    for (rx, tx) in &pairs {
        t.rx.add(&rx.stats);
        t.tx.add(&tx.stats);
        t.kicks += rx.queue.kicks_sent + tx.queue.kicks_sent;
    }
    for dev in devs {
        if failure.is_none() && !dev.backend_gone() {
            match dev.disconnect() {
                Ok(bases) => {
                    let s: Vec<String> = bases.iter().map(|(q, b)| format!("{q}:{b}")).collect();
                    eprintln!("vhostd-user: vring bases {}", s.join(" "));
                }
                Err(e) => eprintln!("vhostd-user: warning: disconnect: {e}"),
            }
        }
    }
    Ok((t, seconds, failure))
}

/// Options for a blk or scsi workload: memory, EVENT_IDX, packed rings.
fn io_options(a: &BlkArgs, mut opts: Options, mem_needed: u64) -> Options {
    opts.mem_size = match a.mem_mb {
        Some(m) => m << 20,
        None => mem_needed,
    };
    if a.event_idx.on() {
        opts.features |= features::EVENT_IDX;
    } else {
        opts.features &= !features::EVENT_IDX;
    }
    if a.packed.on() {
        opts.features |= features::RING_PACKED;
        opts.required |= features::RING_PACKED;
    }
    opts
}

fn print_connected(a: &BlkArgs, dev: &VirtioUser) {
    eprintln!(
        "vhostd-user: connected to {}: features {:#x} (offered {:#x}), protocol {:#x}, max queues {}, {} rings",
        a.socket_path.display(),
        dev.features(),
        dev.offered_features(),
        dev.protocol_features().bits(),
        dev.max_queues(),
        if dev.packed() { "packed" } else { "split" }
    );
}

/// The workload the options ask for (`mode`: --mode).
fn io_workload(a: &BlkArgs, mode: BlkMode) -> Workload {
    let mode = match mode {
        BlkMode::Randread => workload::Mode::RandRead,
        BlkMode::Randwrite => workload::Mode::RandWrite,
        BlkMode::Read => workload::Mode::Read,
        BlkMode::Write => workload::Mode::Write,
        BlkMode::Verify => workload::Mode::Verify,
    };
    Workload {
        iodepth: a.iodepth,
        size: a.size,
        count: a.count,
        duration: a.duration.map(Duration::from_secs_f64),
        seed: a.seed,
        poll: a.poll.on(),
        stall_timeout: Duration::from_secs_f64(a.stall_timeout),
        ..Workload::new(mode, a.bs)
    }
}

/// Dirty logging (--dirty-log) on `queues`, and the CPU (--cpu), once the
/// queues are set up. The log must live while the workload runs.
fn io_start(a: &BlkArgs, dev: &mut VirtioUser, queues: &[&VirtQueue]) -> Result<Option<DirtyLog>, String> {
    let log = if a.dirty_log.on() { Some(start_dirty_log(dev, queues)?) } else { None };
    if let Some(cpu) = a.cpu {
        pin_to(cpu)?;
    }
    Ok(log)
}

/// Ends the connection as a driver would (GET_VRING_BASE on every ring).
fn io_end(dev: VirtioUser) {
    if !dev.backend_gone() {
        if let Err(e) = dev.disconnect() {
            eprintln!("vhostd-user: warning: disconnect: {e}");
        }
    }
}

/// What a blk or scsi run did: the workload's report (--mode) and the
/// idle period's (--idle).
struct IoOutcome {
    report: Option<workload::Report>,
    idle: Option<workload::IdleReport>,
}

/// Runs the workload with `run` (when --mode is given), then the idle
/// period (--idle) watching `peer`, the connection, on set-up `queues`.
fn io_run<Q: IoQueue>(
    a: &BlkArgs,
    queues: &mut [Q],
    peer: BorrowedFd<'_>,
    run: impl FnOnce(&mut [Q], &Workload) -> Result<workload::Report, vhostd_user::Error>,
) -> Result<IoOutcome, String> {
    let report = match a.mode {
        Some(mode) => Some(run(queues, &io_workload(a, mode)).map_err(|e| e.to_string())?),
        None => None,
    };
    let idle = match a.idle {
        // An interrupted workload (a signal) stops here too.
        Some(secs) if !STOP.load(Ordering::Relaxed) => {
            // The start in wall-clock time, for a script relating its own
            // samples to it (bench/idle-cpu).
            let from = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            eprintln!("vhostd-user: idle for {secs} s from {:.6} (seconds since the epoch)", from.as_secs_f64());
            let d = Duration::from_secs_f64(secs);
            Some(workload::idle(queues, d, Some(&STOP), Some(peer)).map_err(|e| format!("idle: {e}"))?)
        }
        _ => None,
    };
    Ok(IoOutcome { report, idle })
}

/// `run_blk` over vfio-user: the same queues and workload engine, set up
/// through the virtio-pci registers.
fn run_blk_vfio(a: &BlkArgs) -> Result<IoOutcome, String> {
    if a.dirty_log.on() {
        return Err("--dirty-log is vhost-user only".into());
    }
    let mut opts = vhostd_user::vfio::VfioOptions::blk();
    opts.mem_size = match a.mem_mb {
        Some(m) => m << 20,
        None => blk::memory_needed(a.queues, a.iodepth, a.bs),
    };
    if !a.event_idx.on() {
        opts.features &= !features::EVENT_IDX;
    }
    if a.packed.on() {
        opts.features |= features::RING_PACKED;
    }
    let timeout = Duration::from_secs_f64(a.connect_timeout);
    let mut dev = vhostd_user::vfio::VfioBlk::connect(&a.socket_path, &opts, timeout).map_err(|e| e.to_string())?;
    let f = dev.features();
    if a.packed.on() && f & features::RING_PACKED == 0 {
        return Err("--packed on: the device does not offer VIRTIO_F_RING_PACKED".into());
    }
    let cfg = dev.blk_config();
    eprintln!(
        "vhostd-user: vfio-user {}: features {:#x} (offered {:#x}), {} queues, doorbells {}, {} rings; capacity {} sectors",
        a.socket_path.display(),
        f,
        dev.offered_features(),
        dev.num_queues(),
        if dev.doorbells_mapped() { "mapped" } else { "REGION_WRITE" },
        if f & features::RING_PACKED != 0 { "packed" } else { "split" },
        cfg.capacity
    );
    let mut queues = Vec::with_capacity(a.queues as usize);
    for i in 0..a.queues {
        queues.push(dev.blk_queue(i, a.iodepth, a.bs).map_err(|e| format!("queue {i}: {e}"))?);
    }
    dev.driver_ok().map_err(|e| e.to_string())?;
    if let Some(cpu) = a.cpu {
        pin_to(cpu)?;
    }
    let out = io_run(a, &mut queues, dev.socket(), |q, w| workload::run(q, cfg.capacity, w, Some(&STOP)))?;
    if let Err(e) = dev.disconnect() {
        eprintln!("vhostd-user: warning: reset at the end: {e}");
    }
    Ok(out)
}

fn run_blk(a: &BlkArgs) -> Result<IoOutcome, String> {
    if a.transport == Transport::VfioUser {
        return run_blk_vfio(a);
    }
    let opts = io_options(a, Options::blk(&a.socket_path), blk::memory_needed(a.queues, a.iodepth, a.bs));
    let mut dev = connect_retry(opts, a.connect_timeout)?;
    let f = dev.features();
    print_connected(a, &dev);
    let cfg = dev.blk_config().map_err(|e| e.to_string())?;
    eprintln!(
        "vhostd-user: config capacity {} sectors ({} bytes) blk_size {} size_max {} seg_max {} num_queues {} writeback {} read_only {}",
        cfg.capacity,
        cfg.capacity_bytes(),
        cfg.blk_size,
        cfg.size_max,
        cfg.seg_max,
        cfg.num_queues,
        cfg.writeback,
        f & features::BLK_RO != 0
    );
    if a.queues > 1 && (f & features::BLK_MQ == 0 || cfg.num_queues < a.queues) {
        return Err(format!(
            "--queues {}: the device has {} (MQ {})",
            a.queues,
            if f & features::BLK_MQ != 0 { cfg.num_queues } else { 1 },
            if f & features::BLK_MQ != 0 { "negotiated" } else { "not offered" }
        ));
    }
    let mut queues = Vec::with_capacity(a.queues as usize);
    for i in 0..a.queues {
        queues.push(dev.blk_queue(i, a.iodepth, a.bs).map_err(|e| format!("queue {i}: {e}"))?);
    }
    let qs: Vec<&VirtQueue> = queues.iter().map(|q| &q.queue).collect();
    let _log = io_start(a, &mut dev, &qs)?;
    let out = io_run(a, &mut queues, dev.socket(), |q, w| workload::run(q, cfg.capacity, w, Some(&STOP)))?;
    io_end(dev);
    Ok(out)
}

fn run_scsi(s: &ScsiArgs) -> Result<IoOutcome, String> {
    let a = &s.io;
    if a.transport != Transport::VhostUser {
        return Err("--transport vfio-user: blk only".into());
    }
    let indirect = s.indirect()?;
    let mut opts = io_options(a, Options::scsi(&a.socket_path), scsi::memory_needed(a.queues, a.iodepth, a.bs));
    if indirect {
        opts.features |= features::INDIRECT_DESC;
    }
    let mut dev = connect_retry(opts, a.connect_timeout)?;
    print_connected(a, &dev);
    if indirect && dev.features() & features::INDIRECT_DESC == 0 {
        return Err(format!(
            "indirect descriptors: the device does not offer VIRTIO_RING_F_INDIRECT_DESC (offered {:#x}){}",
            dev.offered_features(),
            if s.indirect == Indirect::Auto { "; a larger --queue-size, or a smaller --iodepth" } else { "" }
        ));
    }
    let cfg = dev.scsi_config().map_err(|e| e.to_string())?;
    eprintln!(
        "vhostd-user: config num_queues {} seg_max {} max_sectors {} cmd_per_lun {} max_lun {}",
        cfg.num_queues, cfg.seg_max, cfg.max_sectors, cfg.cmd_per_lun, cfg.max_lun
    );
    eprintln!("vhostd-user: request queues: {} descriptors", if indirect { "indirect" } else { "direct" });
    if a.queues as u32 > cfg.num_queues {
        return Err(format!("--queues {}: the device has {}", a.queues, cfg.num_queues));
    }
    let mut queues = Vec::with_capacity(a.queues as usize);
    for i in 0..a.queues {
        let q = if indirect {
            dev.scsi_queue_indirect(i, a.iodepth, a.bs, s.queue_size)
        } else {
            dev.scsi_queue_sized(i, a.iodepth, a.bs, s.queue_size)
        };
        let mut q = q.map_err(|e| format!("queue {i}: {e}"))?;
        q.set_lun(s.lun);
        queues.push(q);
    }
    let unit =
        queues[0].probe_disk(Duration::from_secs_f64(a.stall_timeout)).map_err(|e| format!("LUN {}: {e}", s.lun))?;
    for q in &mut queues[1..] {
        q.set_disk(unit.block_size, unit.read_only);
    }
    eprintln!(
        "vhostd-user: LUN {} capacity {} blocks of {} bytes ({} bytes) read_only {}",
        s.lun,
        unit.blocks,
        unit.block_size,
        unit.bytes(),
        unit.read_only
    );
    let qs: Vec<&VirtQueue> = queues.iter().map(|q| &q.queue).collect();
    let _log = io_start(a, &mut dev, &qs)?;
    let out = io_run(a, &mut queues, dev.socket(), |q, w| scsi::workload::run(q, unit.bytes(), w, Some(&STOP)))?;
    io_end(dev);
    Ok(out)
}

/// Prints a blk or scsi run's summaries; the exit status.
fn io_main(r: Result<IoOutcome, String>) -> ExitCode {
    match r {
        Ok(IoOutcome { report, idle }) => {
            let mut passed = true;
            if let Some(r) = report {
                println!("{}", r.summary());
                if let Some(e) = &r.first_error {
                    eprintln!("vhostd-user: {} errors, the first: {e}", r.errors);
                }
                if let Some(o) = r.mismatch {
                    eprintln!("vhostd-user: verify: data read back differs, first at byte offset {o}");
                }
                passed = r.passed();
            }
            if let Some(i) = idle {
                println!("{}", i.summary());
            }
            if passed {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("vhostd-user: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    install_signals();
    let a = match cli.cmd {
        Cmd::Net(a) => a,
        Cmd::Blk(a) => return io_main(run_blk(&a)),
        Cmd::Scsi(a) => return io_main(run_scsi(&a)),
    };
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
