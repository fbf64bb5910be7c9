//! The seccomp filter vhostd installs once every device is set up
//! (`--seccomp`, default `enforce`): from then on the process may make only
//! the system calls its dataplane, its vhost-user sessions and its control
//! threads need. Opening files (refused with EACCES), creating sockets
//! other than Unix ones, new processes (threads only), exec, ptrace,
//! mounting, loading BPF, changing credentials and the rest are gone; a
//! guest or VMM that finds a bug in vhostd finds this too.
//!
//! open and openat are refused with EACCES rather than fatal (libraries
//! may probe files and cope). `enforce` kills the process on any other violation (SECCOMP_RET_KILL_PROCESS:
//! the kernel logs it in the audit log); `trap` catches it (SIGSYS), writes
//! `vhostd: seccomp: system call N is not allowed` to stderr and exits with
//! status 159, which says which call to add here when a path was missed;
//! `off` installs nothing.

use std::collections::BTreeMap;
use std::io;

use seccompiler::{
    sock_filter, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// What `--seccomp` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SeccompMode {
    /// Kill the process on a system call outside the list.
    #[default]
    Enforce,
    /// Report the system call on stderr and exit (status 159).
    Trap,
    /// No filter.
    Off,
}

/// System calls allowed with any arguments.
const ALLOWED: &[libc::c_long] = &[
    // Memory: guest memory tables (SET_MEM_TABLE, ADD/REM_MEM_REG), the
    // inflight memory, the allocator.
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_brk,
    libc::SYS_memfd_create,
    libc::SYS_ftruncate,
    // File descriptors the sessions receive and pass on.
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    // The file backend's reads and writes on tmpfs (run in the worker).
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_close,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_fcntl,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_lseek,
    // Waiting: eventfds, epoll, poll, io_uring.
    libc::SYS_eventfd2,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_io_uring_enter,
    libc::SYS_futex,
    libc::SYS_sched_yield,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    // Sockets: vhost-user connections (accept, --client reconnects,
    // SCM_RIGHTS), the control socket, metrics, AF_XDP wake-ups, the
    // host's link events (an rtnetlink socket read with recvfrom; made
    // and bound before the filter: link_events.rs).
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_recvmsg,
    libc::SYS_sendmsg,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    // The socket files go at exit.
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    // Threads, signals, exit.
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_restart_syscall,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_tgkill,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_setaffinity,
    libc::SYS_getrandom,
    libc::SYS_prctl,
];

/// What building a device needs besides (a daemon with a control socket
/// adds devices at runtime, `vhostd ctl add`): the socket file, the image
/// file and its io_uring, a TAP, AF_XDP sockets and the XDP program. With
/// these, open and openat are allowed too.
const BUILD: &[libc::c_long] = &[
    // A new device's thread (and its own workers without a pool).
    libc::SYS_clone3,
    libc::SYS_clone,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_chmod,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_register,
    // The image's file system (a server's, whose requests go async).
    libc::SYS_fstatfs,
    libc::SYS_bpf,
    libc::SYS_fallocate,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getrlimit,
    libc::SYS_prlimit64,
    libc::SYS_uname,
];

/// ioctl requests building a device makes: a TAP's set-up, an interface's
/// index, flags, MTU and queue count, a block device's size.
const BUILD_IOCTLS: &[u64] = &[
    libc::TUNSETIFF,
    libc::TUNGETIFF,
    libc::TUNGETFEATURES,
    libc::TUNSETVNETHDRSZ,
    0x54e3, // TUNGETDEVNETNS
    libc::SIOCGIFINDEX,
    libc::SIOCSIFFLAGS,
    libc::SIOCGIFMTU,
    libc::SIOCGIFHWADDR,
    libc::SIOCETHTOOL,
    0x8008_1272, // BLKGETSIZE64
    0x1268,      // BLKSSZGET
];

/// Socket domains building a device needs: interface ioctls, AF_XDP.
const BUILD_SOCKET_DOMAINS: &[u64] = &[libc::AF_INET as u64, libc::AF_XDP as u64, libc::AF_NETLINK as u64];

/// ioctl requests allowed: the TAP's runtime controls and the interface
/// flags a link-state query reads; FIONBIO/FIOCLEX from std.
const IOCTLS: &[u64] = &[
    0x4004_54d0, // TUNSETOFFLOAD
    0x4004_54d9, // TUNSETQUEUE
    0x8913,      // SIOCGIFFLAGS
    0x5421,      // FIONBIO
    0x541b,      // FIONREAD (has a whole vhost-user message arrived)
    0x5411,      // TIOCOUTQ (replies a frontend left unread)
    0x5451,      // FIOCLEX
    0x5401,      // TCGETS (is stderr a terminal: log colours)
];

/// Socket domains `socket` may create: Unix only (--client reconnects).
const SOCKET_DOMAINS: &[u64] = &[libc::AF_UNIX as u64];

/// The filter; `build`: also what building a device needs (BUILD).
fn filter(mode: SeccompMode, build: bool) -> io::Result<BpfProgram> {
    let bad = |e: seccompiler::BackendError| io::Error::other(format!("seccomp filter: {e}"));
    let extra: &[libc::c_long] = if build { BUILD } else { &[] };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = ALLOWED.iter().chain(extra).map(|&n| (n, vec![])).collect();
    if build {
        rules.insert(libc::SYS_open, vec![]);
        rules.insert(libc::SYS_openat, vec![]);
    }
    let extra_ioctls: &[u64] = if build { BUILD_IOCTLS } else { &[] };
    let extra_domains: &[u64] = if build { BUILD_SOCKET_DOMAINS } else { &[] };
    let ioctl: Vec<SeccompRule> = IOCTLS
        .iter()
        .chain(extra_ioctls)
        .map(|&req| {
            SeccompRule::new(vec![
                SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, req).map_err(bad)?
            ])
            .map_err(bad)
        })
        .collect::<io::Result<_>>()?;
    rules.insert(libc::SYS_ioctl, ioctl);
    let socket: Vec<SeccompRule> = SOCKET_DOMAINS
        .iter()
        .chain(extra_domains)
        .map(|&d| {
            SeccompRule::new(vec![SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, d).map_err(bad)?])
                .map_err(bad)
        })
        .collect::<io::Result<_>>()?;
    rules.insert(libc::SYS_socket, socket);
    if !build {
        // Threads only (a message that may wait on a disk gets one:
        // frontends.rs), not processes: clone with CLONE_THREAD. clone3's
        // flags are behind a pointer the filter cannot read; it answers
        // ENOSYS (below) and the C library falls back to clone.
        let thread = libc::CLONE_THREAD as u64;
        rules.insert(
            libc::SYS_clone,
            vec![SeccompRule::new(vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(thread),
                thread,
            )
            .map_err(bad)?])
            .map_err(bad)?],
        );
    }
    let mismatch = match mode {
        SeccompMode::Trap => SeccompAction::Trap,
        _ => SeccompAction::KillProcess,
    };
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| io::Error::other(format!("seccomp: unsupported architecture: {e:?}")))?;
    let f = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, arch).map_err(bad)?;
    let prog: BpfProgram = f.try_into().map_err(|e: seccompiler::BackendError| bad(e))?;
    if build {
        return Ok(prog);
    }
    // open and openat fail with EACCES instead of killing: libraries may
    // try to read a file (glibc reads /proc/sys/vm/overcommit_memory when
    // it first trims a thread's heap) and cope with not being allowed.
    // clone3 fails with ENOSYS: glibc then creates threads with clone,
    // whose flags the rule above can check.
    let ins = |code: u16, jt: u8, jf: u8, k: u32| sock_filter { code, jt, jf, k };
    let mut out = vec![
        ins(0x20, 0, 0, 0),                                 // A = seccomp_data.nr
        ins(0x15, 1, 0, libc::SYS_openat as u32),           // A == openat: to the return
        ins(0x15, 0, 1, libc::SYS_open as u32),             // A == open: to the return, else on
        ins(0x06, 0, 0, 0x0005_0000 | libc::EACCES as u32), // SECCOMP_RET_ERRNO | EACCES
        ins(0x15, 0, 1, libc::SYS_clone3 as u32),           // A == clone3: to the return, else on
        ins(0x06, 0, 0, 0x0005_0000 | libc::ENOSYS as u32), // SECCOMP_RET_ERRNO | ENOSYS
    ];
    out.extend(prog);
    Ok(out)
}

/// Installs the filter on every thread of the process (`mode` Off: none);
/// `build`: devices are added at runtime, so what building one needs stays
/// allowed (BUILD).
pub fn install(mode: SeccompMode, build: bool) -> io::Result<()> {
    if mode == SeccompMode::Off {
        tracing::warn!("--seccomp off: no system call filter");
        return Ok(());
    }
    let prog = filter(mode, build)?;
    apply(mode, &prog)?;
    let n = ALLOWED.len() + 2 + if build { BUILD.len() } else { 1 };
    tracing::info!(
        "seccomp filter installed ({mode:?}): {n} system calls allowed{}",
        if build { ", with what adding a device needs (--control)" } else { "" }
    );
    Ok(())
}

/// Installs a compiled filter (no allocation: callable after fork).
fn apply(mode: SeccompMode, prog: &BpfProgram) -> io::Result<()> {
    if mode == SeccompMode::Trap {
        // SAFETY: installs an async-signal-safe handler (see on_sigsys).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigsys as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    seccompiler::apply_filter_all_threads(prog).map_err(|e| io::Error::other(format!("seccomp: {e}")))
}

/// SIGSYS in trap mode: says which system call and exits. Only
/// async-signal-safe calls (write, _exit).
extern "C" fn on_sigsys(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t; for SIGSYS its
    // _sigsys._syscall (an int) follows si_signo, si_errno, si_code, the
    // padding and the call address: offset 24 on 64-bit Linux.
    let nr = unsafe { *((info as *const u8).add(24) as *const i32) };
    let mut buf = [0u8; 96];
    let mut n = 0;
    for &b in b"vhostd: seccomp: system call ".iter() {
        buf[n] = b;
        n += 1;
    }
    let mut digits = [0u8; 12];
    let mut d = 0;
    let mut v = nr.unsigned_abs();
    loop {
        digits[d] = b'0' + (v % 10) as u8;
        d += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    while d > 0 {
        d -= 1;
        buf[n] = digits[d];
        n += 1;
    }
    for &b in b" is not allowed (exiting)\n".iter() {
        buf[n] = b;
        n += 1;
    }
    // SAFETY: write(2) and _exit(2) are async-signal-safe; buf is valid.
    unsafe {
        libc::write(2, buf.as_ptr() as *const libc::c_void, n);
        libc::_exit(159);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_compiles() {
        assert!(filter(SeccompMode::Enforce, false).unwrap().len() > ALLOWED.len());
        assert!(filter(SeccompMode::Trap, false).is_ok());
        assert!(filter(SeccompMode::Enforce, true).unwrap().len() > ALLOWED.len() + BUILD.len());
    }

    /// Forks a child that installs the filter, opens a file (refused, not
    /// fatal) and calls getppid (not allowed); returns its
    /// wait status and what it wrote to stderr.
    fn child_making_forbidden_calls(mode: SeccompMode) -> (libc::c_int, String) {
        let prog = filter(mode, false).unwrap();
        let mut p = [0; 2];
        // SAFETY: pipe(2) into a local array.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        // SAFETY: the child only makes async-signal-safe calls (dup2,
        // prctl, seccomp, sigaction, open, _exit): no allocation.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: in the child, as above.
            unsafe {
                libc::dup2(p[1], 2);
                if apply(mode, &prog).is_err() {
                    libc::_exit(2);
                }
                // Allowed: still alive afterwards.
                libc::getpid();
                // Refused but not fatal.
                if libc::open(c"/etc/hostname".as_ptr(), libc::O_RDONLY) >= 0 {
                    libc::_exit(3);
                }
                // Not allowed at all.
                libc::syscall(libc::SYS_getppid);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: close our write end; waitpid on our child.
        unsafe {
            libc::close(p[1]);
            libc::waitpid(pid, &mut status, 0);
        }
        let mut out = vec![0u8; 256];
        // SAFETY: read into a local buffer.
        let n = unsafe { libc::read(p[0], out.as_mut_ptr() as *mut libc::c_void, out.len()) };
        // SAFETY: our fd.
        unsafe { libc::close(p[0]) };
        (status, String::from_utf8_lossy(&out[..n.max(0) as usize]).into_owned())
    }

    #[test]
    fn enforce_refuses_open_and_kills_on_other_calls() {
        let (status, _) = child_making_forbidden_calls(SeccompMode::Enforce);
        assert!(libc::WIFSIGNALED(status), "status {status:#x}");
        assert_eq!(libc::WTERMSIG(status), libc::SIGSYS);
    }

    /// Threads yes, processes no: clone3 answers ENOSYS (so the C library
    /// uses clone), clone with CLONE_THREAD gets past the filter (the
    /// kernel then refuses these flags: EINVAL), and a fork is fatal.
    #[test]
    fn threads_are_allowed_and_processes_are_not() {
        let prog = filter(SeccompMode::Enforce, false).unwrap();
        // SAFETY: the child makes only async-signal-safe calls (prctl,
        // seccomp, syscall, _exit): no allocation.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: in the child, as above.
            unsafe {
                if apply(SeccompMode::Enforce, &prog).is_err() {
                    libc::_exit(2);
                }
                let errno = || *libc::__errno_location();
                if libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize) != -1 || errno() != libc::ENOSYS {
                    libc::_exit(3);
                }
                // CLONE_THREAD without CLONE_SIGHAND: the kernel's EINVAL.
                if libc::syscall(libc::SYS_clone, libc::CLONE_THREAD, 0usize, 0usize, 0usize, 0usize) != -1
                    || errno() != libc::EINVAL
                {
                    libc::_exit(4);
                }
                // A new process: killed.
                libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0usize, 0usize, 0usize, 0usize);
                libc::_exit(0);
            }
        }
        let mut status = 0;
        // SAFETY: waitpid on our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFSIGNALED(status), "status {status:#x} (exit {})", libc::WEXITSTATUS(status));
        assert_eq!(libc::WTERMSIG(status), libc::SIGSYS);
    }

    #[test]
    fn trap_names_the_system_call() {
        let (status, err) = child_making_forbidden_calls(SeccompMode::Trap);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 159, "status {status:#x}, stderr {err}");
        assert_eq!(err, format!("vhostd: seccomp: system call {} is not allowed (exiting)\n", libc::SYS_getppid));
    }
}
