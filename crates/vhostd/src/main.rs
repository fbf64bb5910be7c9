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
    };
    let (devices, globals, format) = match args.command {
        None => {
            // `vhostd --config FILE` (clap requires one or the other).
            let path = args.config.unwrap_or_default();
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
            let globals = server::Globals {
                control: args.control.or(cfg.control),
                metrics,
                seccomp: args.seccomp.or(cfg.seccomp).unwrap_or_default(),
            };
            (cfg.devices, globals, args.log_format.or(cfg.log_format).unwrap_or(LogFormat::Text))
        }
        Some(Command::Net(a)) => single(DeviceArgs::Net(a), cli_globals, args.log_format),
        Some(Command::Blk(a)) => single(DeviceArgs::Blk(a), cli_globals, args.log_format),
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
    (vec![args.to_spec(name)], globals, format.unwrap_or(LogFormat::Text))
}
