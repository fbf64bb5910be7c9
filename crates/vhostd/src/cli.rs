//! The command line. Every value is checked here, so a bad argument exits
//! with status 2 and a message naming it before anything is set up.

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// vhost-user device daemon: serves virtio devices to a VMM over a
/// vhost-user socket, moving packets on its own dataplane threads.
#[derive(Parser, Debug)]
#[command(name = "vhostd", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve a virtio-net device.
    Net(NetArgs),
}

/// Which backend moves the device's packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendArg {
    /// Frames the guest sends come back to it.
    Loopback,
    /// Frames the guest sends are counted and dropped.
    Sink,
    /// Generated frames fill the guest's receive buffers.
    Source,
}

#[derive(Args, Debug)]
pub struct NetArgs {
    /// Unix socket to listen on for the vhost-user frontend (created; removed on exit).
    #[arg(long, value_name = "PATH")]
    pub socket_path: PathBuf,
    /// Packet backend.
    #[arg(long, value_enum)]
    pub backend: BackendArg,
    /// Queue pairs (one dataplane thread each).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub queues: u16,
    /// Largest ring size the frontend may set (a power of two, 1..=32768).
    #[arg(long, default_value_t = 32768, value_parser = parse_queue_size)]
    pub queue_size: u16,
    /// Busy-poll the rings instead of sleeping on kicks.
    #[arg(long)]
    pub poll: bool,
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

fn parse_cpus(s: &str) -> Result<CpuList, String> {
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

/// Parses the process arguments; exits with status 2 on a bad one.
pub fn parse() -> Cli {
    Cli::parse()
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
    fn queue_sizes() {
        assert_eq!(parse_queue_size("256").unwrap(), 256);
        assert!(parse_queue_size("0").is_err());
        assert!(parse_queue_size("300").is_err());
        assert!(parse_queue_size("65536").is_err());
    }
}
