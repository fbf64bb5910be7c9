//! The control socket: `vhostd stats` (and anyone else) connects, sends
//! `stats`, and reads the counters of every device as one JSON line.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::endpoint::SocketFile;
use crate::registry::{DeviceEntry, Registry};

/// Default control socket of `vhostd stats`.
pub const DEFAULT_PATH: &str = "/run/vhostd/control.sock";

/// Listens on `path` (owner and group may connect) and answers on a thread
/// of its own. The socket file goes when the returned guard does.
pub fn serve(path: &Path, entries: Registry) -> io::Result<SocketFile> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| io::Error::new(e.kind(), format!("--control {}: {e}", path.display())))?;
    }
    let listener = crate::endpoint::bind_as(path, "--control")?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    crate::snapshot::init();
    std::thread::Builder::new().name("vhostd-control".into()).spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            if let Err(e) = answer(conn, &entries) {
                tracing::debug!("control connection: {e}");
            }
        }
    })?;
    Ok(SocketFile::new(path.to_path_buf()))
}

fn answer(conn: UnixStream, entries: &[Arc<DeviceEntry>]) -> io::Result<()> {
    // A client that sends nothing must not hold the control thread.
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new(conn.try_clone()?.take(256)).read_line(&mut line)?;
    let reply = match line.trim() {
        "stats" => serde_json::to_string(&crate::snapshot::snapshot(entries)).map_err(io::Error::other)?,
        other => serde_json::json!({ "error": format!("unknown command '{other}' (known: stats)") }).to_string(),
    };
    (&conn).write_all(reply.as_bytes())?;
    (&conn).write_all(b"\n")
}

/// Reads one snapshot from the control socket at `path`.
pub fn fetch(path: &Path) -> io::Result<Value> {
    let conn = UnixStream::connect(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("--control {}: {e} (is vhostd running with --control {}?)", path.display(), path.display()),
        )
    })?;
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    (&conn).write_all(b"stats\n")?;
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line)?;
    let v: Value =
        serde_json::from_str(&line).map_err(|e| io::Error::other(format!("{}: bad answer: {e}", path.display())))?;
    if let Some(e) = v.get("error") {
        return Err(io::Error::other(format!("{}: {e}", path.display())));
    }
    Ok(v)
}

/// `vhostd stats`: one table (rates between two samples), a refreshing one
/// (--watch), or the raw JSON.
pub fn run_stats(args: &crate::cli::StatsArgs, control: Option<PathBuf>) -> io::Result<()> {
    let path = control.unwrap_or_else(|| PathBuf::from(DEFAULT_PATH));
    let mut prev = fetch(&path)?;
    if args.json {
        println!("{prev}");
        return Ok(());
    }
    let interval = Duration::from_secs_f64(args.interval);
    loop {
        std::thread::sleep(interval);
        let now = fetch(&path)?;
        let t = crate::stats::table(&prev, &now);
        let mut out = io::stdout().lock();
        if args.watch {
            // Home and clear, like watch(1).
            write!(out, "\x1b[H\x1b[2J")?;
        }
        out.write_all(t.as_bytes())?;
        out.flush()?;
        if !args.watch {
            return Ok(());
        }
        prev = now;
    }
}
