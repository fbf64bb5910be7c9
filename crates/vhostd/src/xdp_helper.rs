//! `vhostd xdp-helper`: the privileged half of unprivileged AF_XDP. It
//! creates the sockets (CAP_NET_RAW), the XSKMAP and the redirect program
//! (CAP_BPF, CAP_NET_ADMIN), puts socket i in the map at queue start+i,
//! raises RLIMIT_MEMLOCK for the UMEMs, and execs the given command with the
//! sockets and the program's BPF link inherited. The command (typically
//! `setpriv ... vhostd net --backend af-xdp,...,inhibit=on,sock-fds={sock-fds}`)
//! registers its UMEMs on the sockets and binds them, needing no privilege.
//! The program stays attached while the link descriptor is open: until the
//! command exits, however it exits.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;

use xsk::bpf;

use crate::cli::XdpHelperArgs;

fn inheritable(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: F_SETFD on a descriptor we own; clears FD_CLOEXEC only.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets everything up and execs the command; returns only on failure.
pub fn run(args: XdpHelperArgs) -> io::Result<()> {
    let name = &args.ifname;
    let ctx = |e: io::Error| io::Error::new(e.kind(), format!("xdp-helper: {name}: {e}"));
    let ifindex = xsk::ifindex(name).map_err(|_| {
        io::Error::new(io::ErrorKind::NotFound, format!("xdp-helper: no interface '{name}' in this network namespace"))
    })?;
    let end = args.start_queue + args.queues;
    let device_queues = xsk::queue_count(name);
    if let Some(n) = device_queues {
        if end > n {
            return Err(ctx(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("queues {}..{} but the device has {n} queue(s)", args.start_queue, end - 1),
            )));
        }
    }
    let bpf::Redirect { map, link, mode, .. } =
        bpf::redirect(ifindex, device_queues.unwrap_or(0).max(end), args.mode).map_err(ctx)?;
    let mut socks = Vec::new();
    for i in 0..args.queues {
        let s = xsk::Xsk::socket().map_err(ctx)?;
        map.insert(args.start_queue + i, s.as_raw_fd()).map_err(ctx)?;
        inheritable(&s)?;
        socks.push(s);
    }
    inheritable(&link)?;
    let fds = socks.iter().map(|s| s.as_raw_fd().to_string()).collect::<Vec<_>>().join(":");
    // The default rings (1024 + 1024 frames of 4 KiB) per queue, and room to spare.
    let mib = args.memlock_mib.unwrap_or(8 * args.queues as u64 + 8);
    let lim = libc::rlimit { rlim_cur: mib << 20, rlim_max: mib << 20 };
    // SAFETY: setrlimit with a valid rlimit; raising needs CAP_SYS_RESOURCE,
    // which a helper run as root has. Failure is reported, not fatal: the
    // command may hold CAP_IPC_LOCK instead.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        let e = io::Error::last_os_error();
        let mut cur = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit fills a valid rlimit.
        unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut cur) };
        eprintln!(
            "vhostd xdp-helper: cannot raise RLIMIT_MEMLOCK to {mib} MiB ({e}; needs CAP_SYS_RESOURCE): the command \
             may lock {} KiB, each queue's UMEM is (rx-ring + tx-ring) x 4 KiB",
            cur.rlim_cur >> 10
        );
    }
    let argv: Vec<String> = args.command.iter().map(|a| a.replace("{sock-fds}", &fds)).collect();
    eprintln!(
        "vhostd xdp-helper: {name}: {mode} XDP program attached, sockets {fds} for queues {}..{}; running {}",
        args.start_queue,
        end - 1,
        argv[0]
    );
    // The map lives on in the program; our descriptor of it is not
    // needed by the command.
    drop(map);
    let err = std::process::Command::new(&argv[0]).args(&argv[1..]).exec();
    // exec returned: the command did not start; dropping link detaches.
    drop(link);
    Err(io::Error::new(err.kind(), format!("xdp-helper: cannot run '{}': {err}", argv[0])))
}
