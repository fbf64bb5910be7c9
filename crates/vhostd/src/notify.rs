//! systemd's readiness protocol (sd_notify(3)) without libsystemd: one
//! datagram to $NOTIFY_SOCKET. Nothing happens when it is not set.

use std::os::unix::net::UnixDatagram;

/// Every socket is listening: `READY=1`.
pub fn ready(devices: usize) {
    send(&format!("READY=1\nSTATUS=serving {devices} device(s)\nMAINPID={}\n", std::process::id()));
}

/// Shutting down: `STOPPING=1`.
pub fn stopping() {
    send("STOPPING=1\n");
}

fn send(msg: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let r = UnixDatagram::unbound().and_then(|s| {
        let bytes = path.as_encoded_bytes();
        if let Some(name) = bytes.strip_prefix(b"@") {
            // An abstract socket address.
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            s.send_to_addr(msg.as_bytes(), &addr)
        } else {
            s.send_to(msg.as_bytes(), &path)
        }
    });
    if let Err(e) = r {
        tracing::warn!("sd_notify to {}: {e}", path.to_string_lossy());
    }
}
