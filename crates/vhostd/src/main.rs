//! vhostd: a vhost-user device daemon. See README.md and ARCHITECTURE.md.

use std::process::ExitCode;

use vhostd::cli::{self, Command, DeviceArgs, LogFormat};
use vhostd::config;
use vhostd::spec::DeviceSpec;
use vhostd::{control, man, server, xdp_helper};

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("VHOSTD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().flatten_event(true).with_current_span(true).init(),
    }
}

fn main() -> ExitCode {
    let args = cli::parse();
    let cli_globals = server::Globals {
        control: args.control.clone(),
        metrics: args.metrics,
        seccomp: args.seccomp.unwrap_or_default(),
        pool: args.pool(),
    };
    let (devices, globals, format) = match args.command {
        None if args.config.is_none() => {
            // `vhostd --control PATH [--workers N ...]`: devices come at runtime.
            if args.control.is_none() {
                eprintln!("vhostd: nothing to serve: give `net`, `blk` or `scsi`, --config FILE, or --control PATH to add devices with `vhostd ctl add`");
                return ExitCode::from(2);
            }
            (Vec::new(), cli_globals, args.log_format.unwrap_or(LogFormat::Text))
        }
        None => {
            // `vhostd --config FILE`.
            let path = args.config.clone().unwrap_or_default();
            let cfg = match config::load(&path) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("vhostd: {e}");
                    return ExitCode::from(2);
                }
            };
            let metrics = match (args.metrics, cfg.metrics.as_deref()) {
                (Some(m), _) => Some(m),
                // Checked by config::load.
                (None, Some(m)) => cli::parse_metrics_addr(m).ok(),
                (None, None) => None,
            };
            // The command line's pool options replace the file's table.
            let pool = args.pool().or(cfg.pool);
            let refused = cfg.devices.iter().find_map(|d| d.dataplane.check_pooled().err().map(|e| (d, e)));
            if let (Some((d, e)), true) = (refused, pool.is_some()) {
                eprintln!("vhostd: {}: device `{}` (with --workers/--worker-*): {e}", path.display(), d.name);
                return ExitCode::from(2);
            }
            let globals = server::Globals {
                control: args.control.or(cfg.control),
                metrics,
                seccomp: args.seccomp.or(cfg.seccomp).unwrap_or_default(),
                pool,
            };
            (cfg.devices, globals, args.log_format.or(cfg.log_format).unwrap_or(LogFormat::Text))
        }
        Some(Command::Net(a)) => single(DeviceArgs::Net(a), cli_globals, args.log_format),
        Some(Command::Blk(a)) => single(DeviceArgs::Blk(a), cli_globals, args.log_format),
        Some(Command::Scsi(a)) => single(DeviceArgs::Scsi(a), cli_globals, args.log_format),
        Some(Command::Ctl(c)) => {
            // Checked here first, so a mistake is shown with the options' help.
            if let cli::CtlCommand::Add(a) = &c.command {
                if let Err(e) = cli::ctl_add_spec(&a.words) {
                    eprintln!("{e}");
                    let help = a.words.iter().any(|w| w == "--help" || w == "-h");
                    return if help { ExitCode::SUCCESS } else { ExitCode::from(2) };
                }
            }
            return match control::run_ctl(&c, args.control) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("vhostd ctl: {e}");
                    ExitCode::from(1)
                }
            };
        }
        Some(Command::Stats(s)) => {
            return match control::run_stats(&s, args.control) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("vhostd stats: {e}");
                    ExitCode::from(1)
                }
            };
        }
        Some(Command::Man) => {
            print!("{}", man::render());
            return ExitCode::SUCCESS;
        }
        Some(Command::XdpHelper(h)) => {
            init_logging(args.log_format.unwrap_or(LogFormat::Text));
            // Returns only if it could not run the command.
            let e = xdp_helper::run(h).err().map(|e| e.to_string()).unwrap_or_default();
            eprintln!("vhostd: {e}");
            return ExitCode::from(1);
        }
    };
    init_logging(format);
    match server::run(devices, globals) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vhostd: {e}");
            ExitCode::from(1)
        }
    }
}

/// One device from the command line.
fn single(
    args: DeviceArgs,
    globals: server::Globals,
    format: Option<LogFormat>,
) -> (Vec<DeviceSpec>, server::Globals, LogFormat) {
    let name = format!("{}0", args.kind());
    let spec = args.to_spec(name);
    if globals.pool.is_some() {
        if let Err(e) = spec.dataplane.check_pooled() {
            eprintln!("vhostd {}: {e}", args.kind());
            std::process::exit(2);
        }
    }
    (vec![spec], globals, format.unwrap_or(LogFormat::Text))
}
