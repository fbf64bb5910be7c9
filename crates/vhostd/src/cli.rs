//! The command line. Every value is checked here, so a bad argument exits
//! with status 2 and a message naming it before anything is set up.
// Doc comments here are clap's --help texts (and the man page), written in
// the option syntax users type: brackets mean optional, not doc links.
#![allow(rustdoc::broken_intra_doc_links)]

use crate::spec;
use clap::{Args, CommandFactory, Parser, Subcommand};
use std::path::PathBuf;
use vhostd_backends::{AfXdpSpec, BackendKind, TapSpec, XdpMode};
use vhostd_block_backends::BlockSpec;

/// vhost-user device daemon: serves virtio-net and virtio-blk devices to a
/// VMM (QEMU, cloud-hypervisor, DPDK virtio-user) over vhost-user sockets,
/// moving packets and block requests on its own dataplane threads.
///
/// One device: `vhostd net ...` or `vhostd blk ...`. Several devices in one
/// daemon: `vhostd --config FILE`. A host daemon whose devices come and go:
/// `vhostd --control PATH --workers N`, then `vhostd ctl add|remove|list|pin`.
/// Watch a running daemon: `vhostd stats`.
#[derive(Parser, Debug)]
#[command(
    name = "vhostd",
    version,
    about,
    long_about,
    args_conflicts_with_subcommands = true,
    arg_required_else_help = true
)]
pub struct Cli {
    /// Serve every device of a TOML configuration file ([[net]], [[blk]] and [[scsi]]
    /// tables with the keys of `vhostd net|blk|scsi`'s options; see the README).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Control socket for `vhostd stats` (created; removed on exit). For
    /// `vhostd stats`: the socket to read (default /run/vhostd/control.sock).
    #[arg(long, global = true, value_name = "PATH")]
    pub control: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP at ADDR (`PORT` means 127.0.0.1:PORT).
    #[arg(long, global = true, value_name = "ADDR", value_parser = parse_metrics_addr)]
    pub metrics: Option<std::net::SocketAddr>,
    /// Log lines as text (default) or JSON objects, on stderr.
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormat>,
    /// System call filter once the devices are set up: enforce (kill on a
    /// call outside vhostd's list), trap (say which call, exit 159), off.
    #[arg(long, global = true, value_enum)]
    pub seccomp: Option<crate::sandbox::SeccompMode>,
    /// Run every device's queues on one pool of N dataplane workers
    /// (default: one per --worker-cpus CPU) instead of a thread per queue.
    #[arg(long, global = true, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub workers: Option<u16>,
    /// CPUs to pin the pool's workers to, e.g. "2,3" or "2-5" (worker i
    /// gets the i-th, round robin). Implies a pool.
    #[arg(long, global = true, value_name = "LIST", value_parser = parse_cpus)]
    pub worker_cpus: Option<CpuList>,
    /// How the pool's workers wait (as `vhostd net --mode`). Implies a
    /// pool. [default: adaptive]
    #[arg(long, global = true, value_enum, value_name = "MODE")]
    pub worker_mode: Option<WaitMode>,
    /// The pool's adaptive mode: microseconds without work before sleeping
    /// (1..=1000000). [default: 100]
    #[arg(long, global = true, value_name = "US", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub worker_idle_us: Option<u64>,
    /// The pool's balancer moves a queue from a loaded worker to a less
    /// loaded one at most once per SECONDS (0: never; pinned queues never
    /// move). Implies a pool. [default: 10]
    #[arg(long, global = true, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(0..=86400))]
    pub rebalance_interval: Option<u64>,
    #[command(subcommand)]
    pub command: Option<Command>,
}

impl Cli {
    /// Parses `argv` (first element: the program) without exiting.
    pub fn try_parse_args(argv: &[String]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(argv)
    }

    /// The shared worker pool these options ask for, if any.
    pub fn pool(&self) -> Option<spec::PoolSpec> {
        let asked = self.workers.is_some()
            || self.worker_cpus.is_some()
            || self.worker_mode.is_some()
            || self.worker_idle_us.is_some()
            || self.rebalance_interval.is_some();
        asked.then(|| {
            pool_spec(
                self.workers.map(usize::from),
                self.worker_cpus.as_ref().map(|c| c.0.clone()),
                self.worker_mode,
                self.worker_idle_us,
                self.rebalance_interval,
            )
        })
    }
}

/// The pool these options describe, defaults filled in: `workers` one per
/// CPU given, else 1; a balancer move at most every 10 s.
pub fn pool_spec(
    workers: Option<usize>,
    cpus: Option<Vec<usize>>,
    mode: Option<WaitMode>,
    idle_us: Option<u64>,
    rebalance_s: Option<u64>,
) -> spec::PoolSpec {
    let workers = workers.unwrap_or_else(|| cpus.as_ref().map_or(1, |c| c.len().max(1)));
    let rebalance = std::time::Duration::from_secs(rebalance_s.unwrap_or(10));
    spec::PoolSpec { workers, cpus, wait: wait_spec(mode, idle_us), rebalance }
}

/// How log lines look.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `PORT` (on 127.0.0.1) or `HOST:PORT`.
pub fn parse_metrics_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    }
    use std::net::ToSocketAddrs;
    s.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| format!("expected PORT or HOST:PORT (e.g. 9480 or 127.0.0.1:9480), got '{s}'"))
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve a virtio-net device.
    Net(NetArgs),
    /// Serve a virtio-blk device.
    Blk(BlkArgs),
    /// Serve a virtio-scsi device: one target with units (--lun).
    Scsi(ScsiArgs),
    /// Show a running vhostd's devices and queues: rates and totals, read
    /// from its control socket (--control).
    Stats(StatsArgs),
    /// Manage a running vhostd (--control): add and remove devices, list
    /// where their queues run, pin a queue to a worker.
    Ctl(CtlArgs),
    /// Do the privileged AF_XDP set-up (sockets, XDP program, XSKMAP), then
    /// run COMMAND (e.g. setpriv ... vhostd net ...) with the sockets
    /// inherited: `{sock-fds}` in its arguments becomes their numbers.
    XdpHelper(XdpHelperArgs),
    /// Print the man page (roff) generated from these options.
    #[command(hide = true)]
    Man,
}

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// Refresh the table every --interval until interrupted.
    #[arg(long)]
    pub watch: bool,
    /// Seconds between the two samples rates are taken from.
    #[arg(long, default_value = "1", value_parser = parse_interval)]
    pub interval: f64,
    /// Print the daemon's raw counters as one JSON object instead.
    #[arg(long, conflicts_with = "watch")]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CtlArgs {
    /// Print the daemon's answer as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Subcommand, Debug)]
pub enum CtlCommand {
    /// Add a device: `net|blk|scsi --name NAME` and the options of `vhostd
    /// net|blk|scsi` (a --socket-path; no --fd). Nothing is left of a device
    /// that cannot be built.
    Add(CtlAdd),
    /// Remove a device: its frontend sees the socket close; every other
    /// device keeps running.
    Remove {
        /// The device's name.
        name: String,
    },
    /// The workers, and each device's queues with the worker each runs on.
    List,
    /// Move a device's queue (as `list` numbers them) to a worker and keep
    /// it there.
    Pin {
        /// The device's name.
        name: String,
        /// The queue.
        queue: u32,
        /// The worker.
        worker: u32,
    },
    /// Let the balancer move a pinned queue again (it stays where it is).
    Unpin {
        /// The device's name.
        name: String,
        /// The queue.
        queue: u32,
    },
    /// Add a unit to a scsi device while it runs: N=BACKEND as `vhostd scsi
    /// --lun` takes it. A guest that negotiated hotplug sees it appear.
    AddLun {
        /// The scsi device's name.
        name: String,
        /// N=file,path=IMG[,readonly=on][,direct=on][,discard=on] or N=null,size=SIZE.
        #[arg(value_parser = parse_lun, value_name = "N=BACKEND")]
        lun: LunArg,
    },
    /// Remove a unit of a scsi device: new commands to it are refused, those
    /// in flight finish. A guest that negotiated hotplug sees it go.
    RemoveLun {
        /// The scsi device's name.
        name: String,
        /// The unit's number.
        lun: u16,
    },
}

#[derive(Args, Debug)]
pub struct CtlAdd {
    /// net|blk|scsi --name NAME --socket-path PATH ... (see `vhostd net --help`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true, value_name = "DEVICE")]
    pub words: Vec<String>,
}

/// A device from `vhostd ctl add`'s words: `net|blk|scsi`, `--name NAME`, and
/// the options of `vhostd net|blk|scsi`, checked as the command line checks them.
pub fn ctl_add_spec(words: &[String]) -> Result<spec::DeviceSpec, String> {
    let kind = words.first().map(String::as_str).unwrap_or("");
    if !["net", "blk", "scsi"].contains(&kind) {
        return Err(format!("DEVICE '{kind}': expected net, blk or scsi, then --name NAME and its options"));
    }
    let mut name = None;
    let mut argv = vec!["vhostd".to_string(), kind.to_string()];
    let mut rest = words[1..].iter();
    while let Some(w) = rest.next() {
        if w == "--name" {
            name = Some(rest.next().cloned().ok_or("--name: expected a name")?);
        } else if let Some(n) = w.strip_prefix("--name=") {
            name = Some(n.to_string());
        } else {
            argv.push(w.clone());
        }
    }
    let mut parsed = Cli::try_parse_args(&argv).map_err(|e| match e.kind() {
        clap::error::ErrorKind::DisplayHelp => e.render().to_string(),
        _ => format!("vhostd ctl add {kind}: {}", crate::config::clap_message(&e)),
    })?;
    let args = DeviceArgs::from_command(parsed.command.take())
        .ok_or_else(|| format!("DEVICE '{kind}': expected net, blk or scsi"))?;
    let name = name.ok_or("--name: required (the device's name in `vhostd ctl list`, stats and metrics)")?;
    if !crate::config::valid_name(&name) {
        return Err(format!("--name '{name}': expected 1 to 32 letters, digits, '-', '_' or '.'"));
    }
    if args.fd().is_some() {
        return Err("--fd: a device added at runtime listens on (or connects to) a --socket-path".into());
    }
    // Descriptor numbers would name the daemon's own descriptors: nothing
    // can be handed over the control socket.
    if let DeviceArgs::Net(n) = &args {
        match &n.backend {
            BackendArg::Tap(t) if !t.fds.is_empty() => {
                return Err(
                    "--backend tap,fd=...: descriptors cannot be handed to a running daemon; give ifname=".into()
                )
            }
            BackendArg::AfXdp(x) if !x.sock_fds.is_empty() || x.xsks_map_fd.is_some() => {
                return Err("--backend af-xdp,sock-fds=/xsks-map-fd=...: descriptors cannot be handed to a running \
                            daemon; give map-path= or let vhostd set up the interface"
                    .into())
            }
            _ => {}
        }
    }
    let daemon_option = [
        (parsed.config.is_some(), "--config"),
        (parsed.control.is_some(), "--control"),
        (parsed.metrics.is_some(), "--metrics"),
        (parsed.log_format.is_some(), "--log-format"),
        (parsed.seccomp.is_some(), "--seccomp"),
        (parsed.workers.is_some(), "--workers"),
        (parsed.worker_cpus.is_some(), "--worker-cpus"),
        (parsed.worker_mode.is_some(), "--worker-mode"),
        (parsed.worker_idle_us.is_some(), "--worker-idle-us"),
        (parsed.rebalance_interval.is_some(), "--rebalance-interval"),
    ];
    if let Some((_, opt)) = daemon_option.iter().find(|(given, _)| *given) {
        return Err(format!("{opt}: an option of the daemon, not of a device"));
    }
    if matches!(&args, DeviceArgs::Net(a) if a.print_capabilities)
        || matches!(&args, DeviceArgs::Blk(a) if a.print_capabilities)
        || matches!(&args, DeviceArgs::Scsi(a) if a.print_capabilities)
    {
        return Err("--print-capabilities: run `vhostd net|blk|scsi --print-capabilities` instead".into());
    }
    args.check()?;
    Ok(args.to_spec(name))
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("expected seconds from 0.1 to 3600, got '{s}'")),
    }
}

/// A device's options, from the command line or a configuration file.
#[derive(Debug)]
pub enum DeviceArgs {
    Net(NetArgs),
    Blk(BlkArgs),
    Scsi(ScsiArgs),
}

impl DeviceArgs {
    /// The device options a parsed command line holds, if it names a device.
    pub fn from_command(command: Option<Command>) -> Option<DeviceArgs> {
        match command {
            Some(Command::Net(a)) => Some(DeviceArgs::Net(a)),
            Some(Command::Blk(a)) => Some(DeviceArgs::Blk(a)),
            Some(Command::Scsi(a)) => Some(DeviceArgs::Scsi(a)),
            _ => None,
        }
    }

    /// `net`, `blk` or `scsi`.
    pub fn kind(&self) -> &'static str {
        match self {
            DeviceArgs::Net(_) => "net",
            DeviceArgs::Blk(_) => "blk",
            DeviceArgs::Scsi(_) => "scsi",
        }
    }

    /// The listening socket (None with --fd).
    pub fn socket_path(&self) -> Option<&std::path::Path> {
        match self {
            DeviceArgs::Net(a) => a.socket_path.as_deref(),
            DeviceArgs::Blk(a) => a.socket_path.as_deref(),
            DeviceArgs::Scsi(a) => a.socket_path.as_deref(),
        }
    }

    /// The protocol on the socket (--transport).
    pub fn transport(&self) -> spec::Transport {
        let t = match self {
            DeviceArgs::Net(a) => a.transport,
            DeviceArgs::Blk(a) => a.transport,
            DeviceArgs::Scsi(a) => a.transport,
        };
        match t {
            Some(TransportArg::VfioUser) => spec::Transport::VfioUser,
            Some(TransportArg::VhostUser) | None => spec::Transport::VhostUser,
        }
    }

    /// --client: connect to the socket path instead of listening.
    pub fn client(&self) -> bool {
        match self {
            DeviceArgs::Net(a) => a.client,
            DeviceArgs::Blk(a) => a.client,
            DeviceArgs::Scsi(a) => a.client,
        }
    }

    /// The connected socket handed in (--fd).
    pub fn fd(&self) -> Option<i32> {
        match self {
            DeviceArgs::Net(a) => a.fd,
            DeviceArgs::Blk(a) => a.fd,
            DeviceArgs::Scsi(a) => a.fd,
        }
    }

    /// The device these options describe, named `name`, in the plain terms
    /// the builder takes.
    pub fn to_spec(&self, name: String) -> spec::DeviceSpec {
        let (endpoint, dataplane) = match self {
            DeviceArgs::Net(a) => (
                endpoint(&a.socket_path, a.fd, a.client),
                dataplane(a.queues, a.queue_size, a.poll, a.mode, a.poll_idle_us, &a.cpus),
            ),
            DeviceArgs::Blk(a) => (
                endpoint(&a.socket_path, a.fd, a.client),
                dataplane(a.queues, a.queue_size, a.poll, a.mode, a.poll_idle_us, &a.cpus),
            ),
            DeviceArgs::Scsi(a) => (
                endpoint(&a.socket_path, a.fd, a.client),
                dataplane(a.queues, a.queue_size, a.poll, a.mode, a.poll_idle_us, &a.cpus),
            ),
        };
        let device = match self {
            DeviceArgs::Net(a) => spec::DeviceKind::Net { backend: a.backend_kind(), mac: a.mac.0 },
            DeviceArgs::Blk(a) => spec::DeviceKind::Blk {
                backend: a.spec(),
                serial: a.serial.clone().unwrap_or_else(|| a.default_serial()),
                option: if a.backend.is_some() { "--backend" } else { "--blk-file" },
            },
            DeviceArgs::Scsi(a) => spec::DeviceKind::Scsi { luns: a.luns.iter().map(|l| (l.0, l.1.clone())).collect() },
        };
        spec::DeviceSpec { name, endpoint, dataplane, device, transport: self.transport() }
    }

    /// Checks across options that clap cannot express.
    pub fn check(&self) -> Result<(), String> {
        let (transport, client) = match self {
            DeviceArgs::Net(a) => (a.transport, a.client),
            DeviceArgs::Blk(a) => (a.transport, a.client),
            DeviceArgs::Scsi(a) => (a.transport, a.client),
        };
        transport_check(transport, client)?;
        match self {
            DeviceArgs::Net(net) => net_check(net),
            DeviceArgs::Blk(_) => Ok(()),
            DeviceArgs::Scsi(a) => scsi_check(a),
        }
    }
}

/// --transport vfio-user serves as a listener only (the VMM is the
/// vfio-user client).
fn transport_check(transport: Option<TransportArg>, client: bool) -> Result<(), String> {
    if transport != Some(TransportArg::VfioUser) {
        return Ok(());
    }
    if client {
        return Err(
            "--client: with --transport vfio-user the VMM (the vfio-user client) connects to vhostd; leave --client out"
                .into(),
        );
    }
    Ok(())
}

fn endpoint(path: &Option<PathBuf>, fd: Option<i32>, client: bool) -> spec::EndpointSpec {
    match (path, fd) {
        (Some(p), _) if client => spec::EndpointSpec::Connect(p.clone()),
        (Some(p), _) => spec::EndpointSpec::Listen(p.clone()),
        // clap requires one of them.
        (None, fd) => spec::EndpointSpec::Fd(fd.unwrap_or(-1)),
    }
}

fn dataplane(
    queues: u16,
    queue_size: u16,
    poll: bool,
    mode: Option<WaitMode>,
    idle_us: Option<u64>,
    cpus: &Option<CpuList>,
) -> spec::DataplaneSpec {
    let wait_given = if poll {
        Some("poll")
    } else if mode.is_some() {
        Some("mode")
    } else {
        idle_us.map(|_| "poll-idle-us")
    };
    let wait = wait_spec(if poll { Some(WaitMode::Poll) } else { mode }, idle_us);
    spec::DataplaneSpec { queues, queue_size, wait, wait_given, cpus: cpus.as_ref().map(|c| c.0.clone()) }
}

/// A wait mode and adaptive mode's idle time, defaults filled in.
pub fn wait_spec(mode: Option<WaitMode>, idle_us: Option<u64>) -> spec::WaitSpec {
    match mode.unwrap_or(WaitMode::Adaptive) {
        WaitMode::Poll => spec::WaitSpec::Poll,
        WaitMode::Interrupt => spec::WaitSpec::Interrupt,
        WaitMode::Adaptive => {
            spec::WaitSpec::Adaptive { idle: std::time::Duration::from_micros(idle_us.unwrap_or(100)) }
        }
    }
}

/// A net device's checks across options that clap cannot express.
fn net_check(net: &NetArgs) -> Result<(), String> {
    {
        if let BackendArg::Tap(spec) = &net.backend {
            if !spec.fds.is_empty() && spec.fds.len() != net.queues as usize {
                return Err(format!(
                    "--backend tap,fd=...: {} descriptor(s) for --queues {}; give one TAP queue descriptor per queue pair",
                    spec.fds.len(),
                    net.queues
                ));
            }
        }
        if let BackendArg::AfXdp(spec) = &net.backend {
            spec.check(net.queues as usize).map_err(|e| format!("--backend af-xdp: {e}"))?;
        }
        Ok(())
    }
}

#[derive(Args, Debug)]
pub struct XdpHelperArgs {
    /// The interface.
    #[arg(long, value_name = "NAME", value_parser = |s: &str| check_ifname("--ifname", s).map(|_| s.to_string()))]
    pub ifname: String,
    /// Sockets (queue pairs), on device queues start-queue.. .
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub queues: u32,
    /// The first device queue.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=4095))]
    pub start_queue: u32,
    /// Where the program runs: native or skb (default: native, falling back to skb).
    #[arg(long, value_parser = parse_xdp_mode)]
    pub mode: Option<XdpMode>,
    /// RLIMIT_MEMLOCK for COMMAND, in MiB, so it can register its UMEMs
    /// without CAP_IPC_LOCK (default: 8 MiB per queue, the default rings' UMEM, plus 8).
    #[arg(long, value_name = "MIB")]
    pub memlock_mib: Option<u64>,
    /// The command to run with the sockets, and its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

fn parse_xdp_mode(s: &str) -> Result<XdpMode, String> {
    match s {
        "native" => Ok(XdpMode::Native),
        "skb" => Ok(XdpMode::Skb),
        _ => Err(format!("expected native or skb, got '{s}'")),
    }
}

/// Which backend moves the device's packets, as given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// Frames the guest sends come back to it.
    Loopback,
    /// Frames the guest sends are counted and dropped.
    Sink,
    /// Generated frames fill the guest's receive buffers.
    Source,
    /// A TAP interface.
    Tap(TapSpec),
    /// AF_XDP sockets on an interface.
    AfXdp(AfXdpSpec),
}

const BACKEND_HELP: &str = "expected loopback, sink, source, tap,ifname=NAME[,offloads=on|off], \
                            tap,fd=N[:M...][,offloads=on|off] or af-xdp,ifname=NAME[,...]";

/// An interface name as the kernel accepts it (dev_valid_name).
fn check_ifname(what: &str, value: &str) -> Result<(), String> {
    // IFNAMSIZ - 1; no '/', ':' or whitespace.
    if value.is_empty()
        || value.len() > 15
        || value == "."
        || value == ".."
        || value.chars().any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        return Err(format!(
            "{what} ifname '{value}': expected an interface name of 1 to 15 characters without '/', ':' or spaces"
        ));
    }
    Ok(())
}

fn parse_fd_list(what: &str, value: &str) -> Result<Vec<i32>, String> {
    let mut fds = Vec::new();
    for f in value.split(':') {
        let fd: i32 = f.parse().map_err(|_| format!("{what} '{value}': expected descriptor numbers like 3 or 3:4"))?;
        if fd < 0 {
            return Err(format!("{what} '{value}': expected descriptor numbers like 3 or 3:4"));
        }
        if fds.contains(&fd) {
            return Err(format!("{what} '{value}': descriptor {fd} given twice"));
        }
        fds.push(fd);
    }
    Ok(fds)
}

/// A backend's `key=value` options, each key at most once.
fn key_values<'a>(backend: &str, rest: &[&'a str]) -> Result<Vec<(&'a str, &'a str)>, String> {
    let mut out: Vec<(&str, &str)> = Vec::with_capacity(rest.len());
    for opt in rest {
        let (key, value) = opt.split_once('=').ok_or_else(|| format!("{backend} option '{opt}' is not key=value"))?;
        if out.iter().any(|(k, _)| *k == key) {
            return Err(format!("{backend} option '{key}' given twice"));
        }
        out.push((key, value));
    }
    Ok(out)
}

fn on_off(what: &str, value: &str) -> Result<bool, String> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{what} '{value}': expected on or off")),
    }
}

fn parse_af_xdp(rest: &[&str]) -> Result<BackendArg, String> {
    let mut spec = AfXdpSpec::new("");
    let num = |key: &str, value: &str, max: u32| -> Result<u32, String> {
        match value.parse::<u32>() {
            Ok(n) if n <= max => Ok(n),
            _ => Err(format!("af-xdp {key} '{value}': expected a number from 0 to {max}")),
        }
    };
    for (key, value) in key_values("af-xdp", rest)? {
        match key {
            "ifname" => {
                check_ifname("af-xdp", value)?;
                spec.ifname = value.to_string();
            }
            "mode" => spec.mode = Some(parse_xdp_mode(value).map_err(|e| format!("af-xdp mode: {e}"))?),
            "force-copy" => spec.force_copy = on_off("af-xdp force-copy", value)?,
            "queues" => {
                let n = num(key, value, 64)?;
                if n == 0 {
                    return Err("af-xdp queues '0': expected 1 to 64".into());
                }
                spec.queues = Some(n);
            }
            "start-queue" => spec.start_queue = num(key, value, 4095)?,
            "inhibit" => spec.inhibit = on_off("af-xdp inhibit", value)?,
            "xsks-map-fd" => {
                let fds = parse_fd_list("af-xdp xsks-map-fd", value)?;
                if fds.len() != 1 {
                    return Err(format!("af-xdp xsks-map-fd '{value}': expected one descriptor number"));
                }
                spec.xsks_map_fd = Some(fds[0]);
            }
            "sock-fds" => spec.sock_fds = parse_fd_list("af-xdp sock-fds", value)?,
            "map-path" => {
                if value.is_empty() {
                    return Err("af-xdp map-path: expected the path of a pinned XSKMAP".into());
                }
                spec.map_path = Some(PathBuf::from(value));
            }
            "map-start-index" => spec.map_start_index = num(key, value, u32::MAX / 2)?,
            "rx-ring" => spec.rx_ring = num(key, value, 16384)?,
            "tx-ring" => spec.tx_ring = num(key, value, 16384)?,
            "busy-poll" => spec.busy_poll = on_off("af-xdp busy-poll", value)?,
            _ => {
                return Err(format!(
                    "unknown af-xdp option '{key}' (known: ifname, mode, force-copy, queues, start-queue, inhibit, \
                     xsks-map-fd, sock-fds, map-path, map-start-index, rx-ring, tx-ring, busy-poll)"
                ))
            }
        }
    }
    if spec.ifname.is_empty() {
        return Err("af-xdp needs ifname=NAME".into());
    }
    // Checks that do not depend on --queues; the rest after parsing.
    spec.check_options().map_err(|e| format!("af-xdp: {e}"))?;
    Ok(BackendArg::AfXdp(spec))
}

fn parse_backend(s: &str) -> Result<BackendArg, String> {
    let mut parts = s.split(',');
    let kind = parts.next().unwrap_or_default();
    let rest: Vec<&str> = parts.collect();
    let simple = match kind {
        "loopback" => Some(BackendArg::Loopback),
        "sink" => Some(BackendArg::Sink),
        "source" => Some(BackendArg::Source),
        "tap" => None,
        "af-xdp" => return parse_af_xdp(&rest),
        _ => return Err(format!("unknown backend '{kind}': {BACKEND_HELP}")),
    };
    if let Some(b) = simple {
        if !rest.is_empty() {
            return Err(format!("backend '{kind}' takes no options, got '{}'", rest.join(",")));
        }
        return Ok(b);
    }
    let mut spec = TapSpec { ifname: None, fds: vec![], offloads: true };
    for (key, value) in key_values("tap", &rest)? {
        match key {
            "ifname" => {
                check_ifname("tap", value)?;
                spec.ifname = Some(value.to_string());
            }
            "fd" => spec.fds = parse_fd_list("tap fd", value)?,
            "offloads" => spec.offloads = on_off("tap offloads", value)?,
            _ => return Err(format!("unknown tap option '{key}' (known: ifname, fd, offloads)")),
        }
    }
    match (&spec.ifname, spec.fds.is_empty()) {
        (None, true) => Err("tap needs ifname=NAME or fd=N[:M...]".into()),
        (Some(_), false) => Err("tap takes ifname= or fd=, not both".into()),
        _ => Ok(BackendArg::Tap(spec)),
    }
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("endpoint").required(true).args(["socket_path", "fd"])))]
pub struct NetArgs {
    /// Unix socket to listen on for the vhost-user frontend (created; removed
    /// on exit). vhostd serves one frontend at a time, and the next after a
    /// disconnect.
    #[arg(long, value_name = "PATH")]
    pub socket_path: Option<PathBuf>,
    /// An already-connected vhost-user socket (e.g. one end of a socketpair
    /// from libvirt); vhostd serves it and exits when it closes.
    #[arg(long, value_name = "FDNUM", value_parser = parse_fd)]
    pub fd: Option<i32>,
    /// Print the vhost-user backend capabilities (JSON) and exit.
    #[arg(long)]
    pub print_capabilities: bool,
    /// Connect to --socket-path (a VMM listening there, e.g. QEMU's
    /// `-chardev socket,server=on`) instead of listening; reconnect every
    /// second while it is not there or after it closes.
    #[arg(long, requires = "socket_path")]
    pub client: bool,
    /// The protocol on the socket: vhost-user (the VMM keeps the virtio
    /// device; QEMU's vhost-user-*-pci) or vfio-user (vhostd is the whole
    /// virtio-pci device; QEMU's vfio-user-pci).
    /// [default: vhost-user]
    #[arg(long, value_enum, value_name = "PROTOCOL")]
    pub transport: Option<TransportArg>,
    /// Packet backend: loopback, sink, source, tap,ifname=NAME[,offloads=on|off]
    /// (creates or attaches to TAP NAME; one TAP queue per queue pair) or
    /// tap,fd=N[:M...][,offloads=on|off] (already-open TAP queues, one per
    /// queue pair, e.g. from a privileged manager), or
    /// af-xdp,ifname=NAME[,mode=native|skb][,force-copy=on][,queues=N]
    /// [,start-queue=M][,inhibit=on][,xsks-map-fd=N][,sock-fds=A:B...]
    /// [,map-path=PATH][,map-start-index=I][,rx-ring=N][,tx-ring=N]
    /// [,busy-poll=on] (QEMU's -netdev af-xdp options; see the README).
    #[arg(long, value_parser = parse_backend, value_name = "BACKEND")]
    pub backend: BackendArg,
    /// Queue pairs (one dataplane thread each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub queues: u16,
    /// Largest ring size the frontend may set (a power of two, 1..=32768).
    #[arg(long, default_value_t = 32768, value_parser = parse_queue_size)]
    pub queue_size: u16,
    /// How dataplane threads wait for work: interrupt (sleep on kicks when
    /// idle), poll (spin, kicks suppressed), adaptive (spin while busy and
    /// for --poll-idle-us after the last packet, then sleep on kicks). With
    /// a worker pool, the pool's (--worker-mode). [default: adaptive]
    #[arg(long, value_enum)]
    pub mode: Option<WaitMode>,
    /// Same as --mode poll.
    #[arg(long, conflicts_with = "mode")]
    pub poll: bool,
    /// Adaptive mode: microseconds without work before sleeping
    /// (1..=1000000). [default: 100]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub poll_idle_us: Option<u64>,
    /// CPUs to pin the dataplane threads to, e.g. "0", "0,1" or "0-3" (thread i gets the i-th, round robin).
    #[arg(long, value_name = "LIST", value_parser = parse_cpus)]
    pub cpus: Option<CpuList>,
    /// MAC address in the device's config space.
    #[arg(long, default_value = "02:00:00:00:00:01", value_parser = parse_mac)]
    pub mac: Mac,
    /// Frame size of the source backend in bytes (Ethernet header included, 14..=65550).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(14..=65550))]
    pub pkt_size: u32,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("endpoint").required(true).args(["socket_path", "fd"])))]
pub struct BlkArgs {
    /// Unix socket to listen on for the vhost-user frontend (created; removed
    /// on exit).
    #[arg(long, value_name = "PATH")]
    pub socket_path: Option<PathBuf>,
    /// An already-connected vhost-user socket; vhostd serves it and exits
    /// when it closes.
    #[arg(long, value_name = "FDNUM", value_parser = parse_fd)]
    pub fd: Option<i32>,
    /// Print the vhost-user backend capabilities (JSON) and exit.
    #[arg(long)]
    pub print_capabilities: bool,
    /// Connect to --socket-path (a VMM listening there, e.g. QEMU's
    /// `-chardev socket,server=on`) instead of listening; reconnect every
    /// second while it is not there or after it closes.
    #[arg(long, requires = "socket_path")]
    pub client: bool,
    /// The protocol on the socket: vhost-user (the VMM keeps the virtio
    /// device; QEMU's vhost-user-*-pci) or vfio-user (vhostd is the whole
    /// virtio-pci device; QEMU's vfio-user-pci).
    /// [default: vhost-user]
    #[arg(long, value_enum, value_name = "PROTOCOL")]
    pub transport: Option<TransportArg>,
    /// Block backend: file,path=IMG[,readonly=on][,direct=on][,discard=on]
    /// (an image file or block device through io_uring; direct: O_DIRECT;
    /// discard: pass discards on as hole punching) or null,size=SIZE (no
    /// storage: every request succeeds; SIZE in bytes or with K, M, G, T).
    #[arg(long, value_parser = parse_blk_backend, value_name = "BACKEND", required_unless_present = "blk_file", conflicts_with = "blk_file")]
    pub backend: Option<BlockSpec>,
    /// The image file, as QEMU's vhost-user-blk convention names it: the same
    /// as --backend file,path=IMG.
    #[arg(long, value_name = "IMG")]
    pub blk_file: Option<PathBuf>,
    /// With --blk-file: serve it read-only (--backend file,...,readonly=on).
    #[arg(long, requires = "blk_file")]
    pub read_only: bool,
    /// Request queues (one dataplane thread each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub queues: u16,
    /// Largest ring size the frontend may set (a power of two, 1..=32768).
    #[arg(long, default_value_t = 1024, value_parser = parse_queue_size)]
    pub queue_size: u16,
    /// How dataplane threads wait for work (see `vhostd net --help`).
    /// [default: adaptive]
    #[arg(long, value_enum)]
    pub mode: Option<WaitMode>,
    /// Same as --mode poll.
    #[arg(long, conflicts_with = "mode")]
    pub poll: bool,
    /// Adaptive mode: microseconds without work before sleeping
    /// (1..=1000000). [default: 100]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub poll_idle_us: Option<u64>,
    /// CPUs to pin the dataplane threads to, e.g. "0", "0,1" or "0-3".
    #[arg(long, value_name = "LIST", value_parser = parse_cpus)]
    pub cpus: Option<CpuList>,
    /// Serial number the guest reads with GET_ID (up to 20 bytes; default:
    /// the image's file name, or "vhostd-null").
    #[arg(long, value_parser = parse_serial)]
    pub serial: Option<String>,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("endpoint").required(true).args(["socket_path", "fd"])))]
pub struct ScsiArgs {
    /// Unix socket to listen on for the vhost-user frontend (created; removed
    /// on exit).
    #[arg(long, value_name = "PATH")]
    pub socket_path: Option<PathBuf>,
    /// An already-connected vhost-user socket; vhostd serves it and exits
    /// when it closes.
    #[arg(long, value_name = "FDNUM", value_parser = parse_fd)]
    pub fd: Option<i32>,
    /// Print the vhost-user backend capabilities (JSON) and exit.
    #[arg(long)]
    pub print_capabilities: bool,
    /// Connect to --socket-path instead of listening; reconnect every
    /// second while it is not there or after it closes.
    #[arg(long, requires = "socket_path")]
    pub client: bool,
    /// The protocol on the socket: vhost-user (the VMM keeps the virtio
    /// device; QEMU's vhost-user-*-pci) or vfio-user (vhostd is the whole
    /// virtio-pci device; QEMU's vfio-user-pci).
    /// [default: vhost-user]
    #[arg(long, value_enum, value_name = "PROTOCOL")]
    pub transport: Option<TransportArg>,
    /// A logical unit: N=file,path=IMG[,readonly=on][,direct=on][,discard=on]
    /// or N=null,size=SIZE, N from 0 to 16383 (the backends of `vhostd blk
    /// --backend`). Give it once per unit.
    #[arg(long = "lun", value_parser = parse_lun, value_name = "N=BACKEND", required_unless_present = "print_capabilities")]
    pub luns: Vec<LunArg>,
    /// Request queues (one dataplane thread each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub queues: u16,
    /// Largest ring size the frontend may set (a power of two, 1..=32768).
    #[arg(long, default_value_t = 1024, value_parser = parse_queue_size)]
    pub queue_size: u16,
    /// How dataplane threads wait for work (see `vhostd net --help`).
    /// [default: adaptive]
    #[arg(long, value_enum)]
    pub mode: Option<WaitMode>,
    /// Same as --mode poll.
    #[arg(long, conflicts_with = "mode")]
    pub poll: bool,
    /// Adaptive mode: microseconds without work before sleeping
    /// (1..=1000000). [default: 100]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub poll_idle_us: Option<u64>,
    /// CPUs to pin the dataplane threads to, e.g. "0", "0,1" or "0-3".
    #[arg(long, value_name = "LIST", value_parser = parse_cpus)]
    pub cpus: Option<CpuList>,
}

/// One `--lun N=BACKEND`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LunArg(pub u16, pub BlockSpec);

impl std::fmt::Display for LunArg {
    /// As `parse_lun` reads it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.1 {
            BlockSpec::Null { size } => write!(f, "{}=null,size={size}", self.0),
            BlockSpec::File { path, readonly, direct, discard } => {
                write!(f, "{}=file,path={}", self.0, path.display())?;
                for (on, k) in [(readonly, "readonly"), (direct, "direct"), (discard, "discard")] {
                    if *on {
                        write!(f, ",{k}=on")?;
                    }
                }
                Ok(())
            }
        }
    }
}

pub fn parse_lun(s: &str) -> Result<LunArg, String> {
    let Some((n, backend)) = s.split_once('=') else {
        return Err(format!("expected N=BACKEND (e.g. 0=file,path=disk.img or 1=null,size=1G), got '{s}'"));
    };
    let n = match n.parse::<u16>() {
        Ok(n) if n <= vhostd_scsi::device::MAX_LUN => n,
        _ => return Err(format!("LUN '{n}': expected a number from 0 to {}", vhostd_scsi::device::MAX_LUN)),
    };
    Ok(LunArg(n, parse_blk_backend(backend).map_err(|e| format!("LUN {n}: {e}"))?))
}

fn scsi_check(a: &ScsiArgs) -> Result<(), String> {
    for (i, l) in a.luns.iter().enumerate() {
        if a.luns[..i].iter().any(|m| m.0 == l.0) {
            return Err(format!("--lun {}: LUN {} is given twice", l.0, l.0));
        }
    }
    Ok(())
}

/// A descriptor number handed to us (0, 1 and 2 are stdio).
fn parse_fd(s: &str) -> Result<i32, String> {
    match s.parse::<i32>() {
        Ok(fd) if fd >= 3 => Ok(fd),
        _ => Err(format!("expected an open descriptor number of 3 or more, got '{s}'")),
    }
}

impl BlkArgs {
    /// The backend, from --backend or --blk-file [--read-only].
    pub fn spec(&self) -> BlockSpec {
        match (&self.backend, &self.blk_file) {
            (Some(b), _) => b.clone(),
            (None, Some(path)) => {
                BlockSpec::File { path: path.clone(), readonly: self.read_only, direct: false, discard: false }
            }
            // clap requires one of them.
            (None, None) => BlockSpec::Null { size: 512 },
        }
    }

    /// GET_ID's answer when --serial is not given.
    pub fn default_serial(&self) -> String {
        match &self.spec() {
            BlockSpec::File { path, .. } => {
                let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                name.chars().take(20).collect()
            }
            BlockSpec::Null { .. } => "vhostd-null".into(),
        }
    }
}

fn parse_serial(s: &str) -> Result<String, String> {
    if s.len() > 20 || !s.chars().all(|c| c.is_ascii_graphic()) {
        return Err(format!("expected up to 20 printable ASCII characters without spaces, got '{s}'"));
    }
    Ok(s.to_string())
}

/// A size in bytes: a number with an optional K, M, G or T suffix (powers of 1024).
fn parse_size(what: &str, s: &str) -> Result<u64, String> {
    let bad = || format!("{what} '{s}': expected a size in bytes like 1048576, 512K, 64M or 1G, a multiple of 512");
    let (num, shift) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(bad()),
            };
            (&s[..i], shift)
        }
        _ => (s, 0),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let bytes = n.checked_mul(1u64 << shift).ok_or_else(bad)?;
    if bytes == 0 || !bytes.is_multiple_of(512) {
        return Err(bad());
    }
    Ok(bytes)
}

fn parse_blk_backend(s: &str) -> Result<BlockSpec, String> {
    let mut parts = s.split(',');
    let kind = parts.next().unwrap_or_default();
    let rest: Vec<&str> = parts.collect();
    match kind {
        "null" => {
            let mut size = None;
            for (key, value) in key_values("null", &rest)? {
                match key {
                    "size" => size = Some(parse_size("null size", value)?),
                    _ => return Err(format!("unknown null option '{key}' (known: size)")),
                }
            }
            let size = size.ok_or("null needs size=SIZE")?;
            Ok(BlockSpec::Null { size })
        }
        "file" => {
            let (mut path, mut readonly, mut direct, mut discard) = (None, false, false, false);
            for (key, value) in key_values("file", &rest)? {
                match key {
                    "path" if !value.is_empty() => path = Some(PathBuf::from(value)),
                    "path" => return Err("file path: expected the image's path".into()),
                    "readonly" => readonly = on_off("file readonly", value)?,
                    "direct" => direct = on_off("file direct", value)?,
                    "discard" => discard = on_off("file discard", value)?,
                    _ => return Err(format!("unknown file option '{key}' (known: path, readonly, direct, discard)")),
                }
            }
            let path = path.ok_or("file needs path=IMG")?;
            Ok(BlockSpec::File { path, readonly, direct, discard })
        }
        _ => Err(format!(
            "unknown blk backend '{kind}': expected file,path=IMG[,readonly=on][,direct=on][,discard=on] or null,size=SIZE"
        )),
    }
}

/// The protocol on a device's socket (`--transport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    /// vhost-user.
    VhostUser,
    /// vfio-user.
    VfioUser,
}

/// How dataplane threads wait for work (`--mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WaitMode {
    /// Sleep on the kick eventfds when idle.
    Interrupt,
    /// Busy-poll while rings are attached.
    Poll,
    /// Busy-poll while busy and for a short idle window, then sleep.
    Adaptive,
}

/// A parsed CPU list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(pub Vec<usize>);

/// A parsed MAC address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mac(pub [u8; 6]);

fn parse_queue_size(s: &str) -> Result<u16, String> {
    let n: u32 = s.parse().map_err(|_| format!("expected a power of two from 1 to 32768, got '{s}'"))?;
    if n == 0 || n > 32768 || !n.is_power_of_two() {
        return Err(format!("expected a power of two from 1 to 32768, got {n}"));
    }
    Ok(n as u16)
}

fn online_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data, filled by the kernel for this process.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return vec![];
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

pub fn parse_cpus(s: &str) -> Result<CpuList, String> {
    let bad = || format!("expected a CPU list like '0', '0,1' or '0-3', got '{s}'");
    let mut cpus = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().map_err(|_| bad())?, b.parse::<usize>().map_err(|_| bad())?),
            None => {
                let c = part.parse::<usize>().map_err(|_| bad())?;
                (c, c)
            }
        };
        if a > b {
            return Err(bad());
        }
        // Checked before the range is made: a huge one must not exhaust memory.
        if b >= libc::CPU_SETSIZE as usize {
            return Err(format!("CPU {b} is not available to this process (available: {:?})", online_cpus()));
        }
        cpus.extend(a..=b);
    }
    let allowed = online_cpus();
    if let Some(c) = cpus.iter().find(|c| !allowed.contains(c)) {
        return Err(format!("CPU {c} is not available to this process (available: {allowed:?})"));
    }
    Ok(CpuList(cpus))
}

fn parse_mac(s: &str) -> Result<Mac, String> {
    let bad = || format!("expected a MAC address like 02:00:00:00:00:01, got '{s}'");
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        if p.len() != 2 {
            return Err(bad());
        }
        mac[i] = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if mac[0] & 1 != 0 {
        return Err(format!("'{s}' is a multicast address; a device needs a unicast MAC"));
    }
    Ok(Mac(mac))
}

impl NetArgs {
    /// The backend to build.
    pub fn backend_kind(&self) -> BackendKind {
        match &self.backend {
            BackendArg::Loopback => BackendKind::Loopback,
            BackendArg::Sink => BackendKind::Sink,
            BackendArg::Source => BackendKind::Source { pkt_size: self.pkt_size as usize },
            BackendArg::Tap(spec) => BackendKind::Tap(spec.clone()),
            BackendArg::AfXdp(spec) => BackendKind::AfXdp(spec.clone()),
        }
    }
}

/// Parses the process arguments; exits with status 2 on a bad one.
///
/// Called as `vhostd-net` or `vhostd-blk` (a link to vhostd, as QEMU's
/// vhost-user backend descriptors name a program per device type) it is
/// `vhostd net` / `vhostd blk`. `--print-capabilities` prints the backend's
/// capabilities (vhost-user.rst, "Backend program conventions") before any
/// other option is looked at, as a VMM manager probing it expects.
pub fn parse() -> Cli {
    let mut argv: Vec<String> = std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect();
    if argv.is_empty() {
        argv.push("vhostd".into());
    }
    let prog = std::path::Path::new(&argv[0]).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match prog.as_str() {
        "vhostd-net" => argv.insert(1, "net".into()),
        "vhostd-blk" => argv.insert(1, "blk".into()),
        "vhostd-scsi" => argv.insert(1, "scsi".into()),
        _ => {}
    }
    if argv.iter().skip(2).any(|a| a == "--print-capabilities") {
        match argv.get(1).map(String::as_str) {
            Some("net") => print_and_exit(r#"{"type":"net"}"#),
            Some("blk") => print_and_exit(r#"{"type":"block","features":["read-only","blk-file"]}"#),
            Some("scsi") => print_and_exit(r#"{"type":"scsi"}"#),
            _ => {}
        }
    }
    let cli = Cli::parse_from(&argv);
    let check = match &cli.command {
        Some(Command::Net(a)) => net_check(a).and(transport_check(a.transport, a.client)),
        Some(Command::Blk(a)) => transport_check(a.transport, a.client),
        Some(Command::Scsi(a)) => scsi_check(a).and(transport_check(a.transport, a.client)),
        _ => Ok(()),
    };
    if let Err(e) = check {
        Cli::command().error(clap::error::ErrorKind::ArgumentConflict, e).exit();
    }
    cli
}

fn print_and_exit(s: &str) -> ! {
    println!("{s}");
    std::process::exit(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpus("0").unwrap(), CpuList(vec![0]));
        assert!(parse_cpus("1-0").is_err());
        assert!(parse_cpus("x").is_err());
        assert!(parse_cpus("100000").unwrap_err().contains("not available"));
    }

    #[test]
    fn macs() {
        assert_eq!(parse_mac("02:00:00:00:00:0a").unwrap(), Mac([2, 0, 0, 0, 0, 10]));
        assert!(parse_mac("02:00:00:00:00").is_err());
        assert!(parse_mac("01:00:00:00:00:00").unwrap_err().contains("multicast"));
        assert!(parse_mac("zz:00:00:00:00:00").is_err());
    }

    #[test]
    fn backends() {
        assert_eq!(parse_backend("sink").unwrap(), BackendArg::Sink);
        assert!(parse_backend("sink,x=1").unwrap_err().contains("no options"));
        assert!(parse_backend("nope").unwrap_err().contains("unknown backend"));
        let t = parse_backend("tap,ifname=vtap0").unwrap();
        assert_eq!(t, BackendArg::Tap(TapSpec { ifname: Some("vtap0".into()), fds: vec![], offloads: true }));
        let t = parse_backend("tap,fd=3:4,offloads=off").unwrap();
        assert_eq!(t, BackendArg::Tap(TapSpec { ifname: None, fds: vec![3, 4], offloads: false }));
        assert!(parse_backend("tap").unwrap_err().contains("needs ifname"));
        assert!(parse_backend("tap,ifname=a,fd=3").unwrap_err().contains("not both"));
        assert!(parse_backend("tap,ifname=0123456789abcdef").unwrap_err().contains("15 characters"));
        assert!(parse_backend("tap,ifname=a/b").is_err());
        assert!(parse_backend("tap,fd=3:3").unwrap_err().contains("twice"));
        assert!(parse_backend("tap,fd=x").is_err());
        assert!(parse_backend("tap,ifname=a,offloads=maybe").unwrap_err().contains("on or off"));
        assert!(parse_backend("tap,ifname=a,mtu=9000").unwrap_err().contains("unknown tap option"));
    }

    #[test]
    fn af_xdp_options() {
        let BackendArg::AfXdp(s) = parse_backend("af-xdp,ifname=veth0").unwrap() else { panic!() };
        assert_eq!(s, AfXdpSpec::new("veth0"));
        let BackendArg::AfXdp(s) =
            parse_backend("af-xdp,ifname=v,mode=skb,force-copy=on,queues=2,start-queue=1,rx-ring=256,busy-poll=on")
                .unwrap()
        else {
            panic!()
        };
        assert_eq!(
            (s.mode, s.force_copy, s.queues, s.start_queue, s.rx_ring, s.busy_poll),
            (Some(XdpMode::Skb), true, Some(2), 1, 256, true)
        );
        let BackendArg::AfXdp(s) = parse_backend("af-xdp,ifname=v,inhibit=on,sock-fds=5:6").unwrap() else { panic!() };
        assert_eq!(s.sock_fds, vec![5, 6]);
        let BackendArg::AfXdp(s) =
            parse_backend("af-xdp,ifname=v,inhibit=on,map-path=/sys/fs/bpf/m,map-start-index=4").unwrap()
        else {
            panic!()
        };
        assert_eq!((s.map_path.as_deref(), s.map_start_index), (Some(std::path::Path::new("/sys/fs/bpf/m")), 4));
        let err = |a: &str| parse_backend(a).unwrap_err();
        assert!(err("af-xdp").contains("needs ifname"));
        assert!(err("af-xdp,ifname=v,mode=fast").contains("native or skb, got 'fast'"));
        assert!(err("af-xdp,ifname=v,sock-fds=3").contains("need inhibit=on"));
        assert!(err("af-xdp,ifname=v,map-path=/x").contains("need inhibit=on"));
        assert!(err("af-xdp,ifname=v,inhibit=on").contains("needs sock-fds"));
        assert!(err("af-xdp,ifname=v,inhibit=on,sock-fds=3,map-path=/x").contains("exclude"));
        assert!(err("af-xdp,ifname=v,inhibit=on,xsks-map-fd=3,map-path=/x").contains("give one"));
        assert!(err("af-xdp,ifname=v,map-start-index=2,inhibit=on,sock-fds=3").contains("map-start-index needs"));
        assert!(err("af-xdp,ifname=v,rx-ring=1000").contains("power of two"));
        assert!(err("af-xdp,ifname=v,queues=0").contains("1 to 64"));
        assert!(err("af-xdp,ifname=v,start-queue=x").contains("expected a number"));
        assert!(err("af-xdp,ifname=v,zerocopy=on").contains("unknown af-xdp option"));
        assert!(err("af-xdp,ifname=v,force-copy=yes").contains("on or off"));
        assert!(err("af-xdp,ifname=v,inhibit=on,sock-fds=3:3").contains("twice"));
        assert!(err("af-xdp,ifname=v,ifname=w").contains("af-xdp option 'ifname' given twice"));
        assert!(err("af-xdp,ifname=v,busy-poll").contains("af-xdp option 'busy-poll' is not key=value"));
        assert!(err("tap,ifname=v,ifname=w").contains("tap option 'ifname' given twice"));
        assert!(err("tap,offloads").contains("tap option 'offloads' is not key=value"));
        assert!(AfXdpSpec { queues: Some(2), ..AfXdpSpec::new("v") }.check(1).unwrap_err().contains("--queues"));
    }

    #[test]
    fn blk_backends() {
        assert_eq!(parse_blk_backend("null,size=1G").unwrap(), BlockSpec::Null { size: 1 << 30 });
        assert_eq!(parse_blk_backend("null,size=4096").unwrap(), BlockSpec::Null { size: 4096 });
        let f = parse_blk_backend("file,path=/tmp/x.img,readonly=on,direct=on,discard=on").unwrap();
        assert_eq!(f, BlockSpec::File { path: "/tmp/x.img".into(), readonly: true, direct: true, discard: true });
        let err = |a: &str| parse_blk_backend(a).unwrap_err();
        assert!(err("null").contains("needs size"));
        assert!(err("null,size=1000").contains("multiple of 512"));
        assert!(err("null,size=0").contains("multiple of 512"));
        assert!(err("null,size=1X").contains("null size '1X'"));
        assert!(err("null,size=99999999999T").contains("expected a size"));
        assert!(err("file").contains("needs path"));
        assert!(err("file,path=").contains("image's path"));
        assert!(err("file,path=a,readonly=yes").contains("on or off"));
        assert!(err("file,path=a,path=b").contains("given twice"));
        assert!(err("file,path=a,cache=none").contains("unknown file option"));
        assert!(err("disk").contains("unknown blk backend"));
        assert!(parse_serial("abc").is_ok());
        assert!(parse_serial("a b").is_err());
        assert!(parse_serial("123456789012345678901").is_err());
    }

    #[test]
    fn queue_sizes() {
        assert_eq!(parse_queue_size("256").unwrap(), 256);
        assert!(parse_queue_size("0").is_err());
        assert!(parse_queue_size("300").is_err());
        assert!(parse_queue_size("65536").is_err());
    }
}
