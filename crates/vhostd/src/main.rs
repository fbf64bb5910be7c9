//! vhostd: a vhost-user device daemon. See README.md and ARCHITECTURE.md.

mod cli;
mod server;
mod session;
mod worker;
mod xdp_helper;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args = cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("VHOSTD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let result = match args.command {
        cli::Command::Net(net) => server::run_net(net),
        cli::Command::Blk(blk) => server::run_blk(blk),
        // Returns only if it could not run the command.
        cli::Command::XdpHelper(h) => xdp_helper::run(h),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vhostd: {e}");
            ExitCode::from(1)
        }
    }
}
