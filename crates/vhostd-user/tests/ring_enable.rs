//! A ring may be kicked once `start_queue` returns, and the backend must
//! have taken SET_VRING_ENABLE by then even without REPLY_ACK: a backend
//! may watch kicks on another thread than the one reading requests and
//! drop a kick that finds its ring still disabled (vhost-user-backend
//! before 0.22 does, so vhost-device-scsi 0.1 lost the first command of
//! about 2 runs in 3). Here REPLY_ACK is not negotiated; the fake reads
//! requests and the kick eventfd on one thread, and fails a kick that
//! comes before it answered anything sent after SET_VRING_ENABLE.

use std::fs::File;
use std::io::Read;
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use vhost::vhost_user::message::*;
use vhost::vhost_user::{
    Backend, BackendReqHandler, GpuBackend, VhostUserBackendReqHandlerMut, VhostUserProtocolFeatures,
};
use vhost::VhostUserMemoryRegionBase;

use vhostd_user::{features, Options, VirtioUser};

type VResult<T> = vhost::vhost_user::Result<T>;

#[derive(Default)]
struct Fake {
    acked: u64,
    /// Ring 0's kick eventfd.
    kick: Option<File>,
    /// SET_VRING_ENABLE(0, 1) taken.
    enabled: bool,
    /// Something answered after it: the frontend knows it was taken.
    answered: bool,
    enables: u32,
}

const OFFERED: u64 = features::VERSION_1 | features::PROTOCOL_FEATURES;

fn unsupported<T>() -> VResult<T> {
    Err(vhost::vhost_user::Error::InvalidOperation("not supported by the fake"))
}

impl VhostUserBackendReqHandlerMut for Fake {
    fn set_owner(&mut self) -> VResult<()> {
        Ok(())
    }
    fn reset_owner(&mut self) -> VResult<()> {
        Ok(())
    }
    fn reset_device(&mut self) -> VResult<()> {
        unsupported()
    }
    fn get_features(&mut self) -> VResult<u64> {
        self.answered |= self.enabled;
        Ok(OFFERED)
    }
    fn set_features(&mut self, f: u64) -> VResult<()> {
        self.acked = f;
        Ok(())
    }
    fn set_mem_table(
        &mut self,
        _ctx: &[VhostUserMemoryRegion],
        _files: Vec<File>,
        _pl: Option<bool>,
    ) -> VResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        Ok(None)
    }
    fn set_vring_num(&mut self, _index: u32, _num: u32) -> VResult<()> {
        Ok(())
    }
    fn set_vring_addr(
        &mut self,
        _index: u32,
        _flags: VhostUserVringAddrFlags,
        _descriptor: u64,
        _used: u64,
        _available: u64,
        _log: u64,
    ) -> VResult<()> {
        Ok(())
    }
    fn set_vring_base(&mut self, _index: u32, _base: u32) -> VResult<()> {
        Ok(())
    }
    fn get_vring_base(&mut self, index: u32) -> VResult<VhostUserVringState> {
        self.answered |= self.enabled;
        Ok(VhostUserVringState::new(index, 0))
    }
    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VResult<()> {
        if index == 0 {
            self.kick = fd;
        }
        Ok(())
    }
    fn set_vring_call(&mut self, _index: u8, _fd: Option<File>) -> VResult<()> {
        Ok(())
    }
    fn set_vring_err(&mut self, _index: u8, _fd: Option<File>) -> VResult<()> {
        Ok(())
    }
    fn get_protocol_features(&mut self) -> VResult<VhostUserProtocolFeatures> {
        // The `vhost` crate adds REPLY_ACK; the frontend leaves it out.
        Ok(VhostUserProtocolFeatures::MQ)
    }
    fn set_protocol_features(&mut self, _f: u64) -> VResult<()> {
        Ok(())
    }
    fn get_queue_num(&mut self) -> VResult<u64> {
        Ok(2)
    }
    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VResult<()> {
        if index == 0 && enable {
            self.enabled = true;
            self.enables += 1;
        }
        Ok(())
    }
    fn get_config(&mut self, _offset: u32, _size: u32, _flags: VhostUserConfigFlags) -> VResult<Vec<u8>> {
        unsupported()
    }
    fn set_config(&mut self, _o: u32, _b: &[u8], _f: VhostUserConfigFlags) -> VResult<()> {
        unsupported()
    }
    fn set_backend_req_fd(&mut self, _backend: Backend) {}
    fn set_gpu_socket(&mut self, _g: GpuBackend) -> VResult<()> {
        unsupported()
    }
    fn get_shared_object(&mut self, _u: VhostUserSharedMsg) -> VResult<File> {
        unsupported()
    }
    fn get_inflight_fd(&mut self, _i: &VhostUserInflight) -> VResult<(VhostUserInflight, File)> {
        unsupported()
    }
    fn set_inflight_fd(&mut self, _i: &VhostUserInflight, _f: File) -> VResult<()> {
        unsupported()
    }
    fn get_max_mem_slots(&mut self) -> VResult<u64> {
        unsupported()
    }
    fn add_mem_region(
        &mut self,
        _r: &VhostUserSingleMemoryRegion,
        _f: File,
        _pl: Option<bool>,
    ) -> VResult<Option<VhostUserMemoryRegionBase>> {
        unsupported()
    }
    fn remove_mem_region(&mut self, _r: &VhostUserSingleMemoryRegion) -> VResult<()> {
        unsupported()
    }
    fn set_device_state_fd(
        &mut self,
        _d: VhostTransferStateDirection,
        _p: VhostTransferStatePhase,
        _f: File,
    ) -> VResult<Option<File>> {
        unsupported()
    }
    fn check_device_state(&mut self) -> VResult<()> {
        unsupported()
    }
    fn get_shmem_config(&mut self) -> VResult<VhostUserShMemConfig> {
        unsupported()
    }
    fn set_log_base(&mut self, _l: &VhostUserLog, _f: File) -> VResult<()> {
        unsupported()
    }
}

/// Polls `fds` (negative ones ignored) for input, up to `ms` (-1: no limit).
fn poll_in(fds: &[RawFd], ms: i32) -> Vec<bool> {
    let mut p: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // SAFETY: `p` is a valid array of p.len() pollfds for the call.
    let r = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    assert!(r >= 0, "poll: {}", std::io::Error::last_os_error());
    p.iter().map(|p| p.revents != 0).collect()
}

/// Serves one connection until the frontend hangs up: requests, and after
/// each request (and each wake-up) the kick eventfd. Returns the kicks
/// seen, or an error for a kick that came before SET_VRING_ENABLE was
/// taken and something answered after it (then the frontend cannot have
/// known the ring was enabled: a kick sent right after SET_VRING_ENABLE
/// shows here before or after it is read, never after an answer).
fn serve(sock: UnixStream) -> JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || {
        let fake = Arc::new(Mutex::new(Fake::default()));
        let mut h = BackendReqHandler::from_stream(sock, fake.clone());
        let mut kicks = 0u64;
        loop {
            let kick_fd = fake.lock().unwrap().kick.as_ref().map_or(-1, |f| f.as_raw_fd());
            let ready = poll_in(&[h.as_raw_fd(), kick_fd], -1);
            let done = ready[0] && h.handle_request().is_err();
            let mut guard = fake.lock().unwrap();
            let f = &mut *guard;
            if let Some(k) = f.kick.as_mut() {
                if poll_in(&[k.as_raw_fd()], 0)[0] {
                    if !(f.enabled && f.answered) {
                        return Err(format!(
                            "ring 0 kicked before the backend answered anything after SET_VRING_ENABLE (enabled {})",
                            f.enabled
                        ));
                    }
                    let mut v = [0u8; 8];
                    k.read_exact(&mut v).map_err(|e| format!("reading the kick: {e}"))?;
                    kicks += u64::from_ne_bytes(v);
                }
            }
            if done {
                return if f.enables == 1 { Ok(kicks) } else { Err(format!("{} SET_VRING_ENABLEs", f.enables)) };
            }
        }
    })
}

#[test]
fn no_kick_before_the_backend_took_set_vring_enable() {
    let (a, b) = UnixStream::pair().unwrap();
    let server = serve(b);
    let mut opts = Options::new("unused");
    opts.mem_size = 4 << 20;
    // As with vhost-device-scsi 0.1, which offers MQ and CONFIG only.
    opts.protocol_features = VhostUserProtocolFeatures::MQ;
    let mut dev = VirtioUser::from_stream(a, opts).unwrap();
    assert!(!dev.protocol_features().contains(VhostUserProtocolFeatures::REPLY_ACK));
    assert_ne!(dev.features() & features::PROTOCOL_FEATURES, 0);
    let mut q = dev.create_queue(0, 16, None).unwrap();
    dev.start_queue(&q).unwrap();
    q.kick().unwrap();
    drop(dev);
    assert_eq!(server.join().unwrap(), Ok(1));
}
