//! The control socket. A client connects, sends one request line and reads
//! one JSON line back:
//! - `stats`: the counters of every device (`vhostd stats`);
//! - a JSON object `{"command": ...}` (`vhostd ctl`): `add` with `args`
//!   (the words after `vhostd ctl add`: `net|blk|scsi --name NAME ...`),
//!   `remove` with `name`, `list`, `pin` with `name`, `queue` and `worker`,
//!   `unpin` with `name` and `queue`, `add-lun` with `name` and `lun`
//!   (`N=BACKEND`), `remove-lun` with `name` and `lun` (a number), or `stats`. The answer is `{"ok": ...}` or `{"error": "..."}`.
//!
//! The socket is created mode 0660: its owner and group may manage the
//! daemon, which is as much as running it (a device added here opens what
//! its backend names, with the daemon's privileges).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::endpoint::SocketFile;
use crate::registry::Registry;
use crate::server::Daemon;

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
            // A bug reached by one request must not end the control socket.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answer(conn, &entries))) {
                Ok(Err(e)) => tracing::debug!("control connection: {e}"),
                Ok(Ok(())) => {}
                Err(_) => tracing::error!("control request: internal error (panic); see the log"),
            }
        }
    })?;
    Ok(SocketFile::new(path.to_path_buf()))
}

/// The longest request line (an `add` with every option fits easily).
const MAX_REQUEST: u64 = 64 * 1024;

fn answer(conn: UnixStream, daemon: &Registry) -> io::Result<()> {
    // A client that sends nothing must not hold the control thread.
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new(conn.try_clone()?.take(MAX_REQUEST)).read_line(&mut line)?;
    let reply = match line.trim() {
        "stats" => serde_json::to_value(crate::snapshot::snapshot(daemon)).map_err(io::Error::other)?,
        l if l.starts_with('{') => match serde_json::from_str::<Value>(l) {
            // A removal waits until the device's rings have stopped, as
            // long as a hung disk takes: on a thread of its own, so the
            // control socket answers the rest meanwhile.
            Ok(req) if req.get("command").and_then(Value::as_str) == Some("remove") => {
                let (d, c) = (daemon.clone(), conn.try_clone()?);
                let job = move || {
                    let _ = reply_to(&c, command_json(&d, &req));
                };
                let spawned = std::thread::Builder::new().name("vhostd-ctl-rm".into()).spawn(job);
                return spawned.map(|_| ());
            }
            Ok(req) => command_json(daemon, &req),
            Err(e) => serde_json::json!({ "error": format!("request: not JSON: {e}") }),
        },
        other => serde_json::json!({ "error": format!("unknown request '{other}' (known: stats, or a JSON command)") }),
    };
    reply_to(&conn, reply)
}

/// A JSON command's answer: `{"ok": ...}` or `{"error": "..."}`.
fn command_json(daemon: &Daemon, req: &Value) -> Value {
    match command(daemon, req) {
        Ok(v) => serde_json::json!({ "ok": v }),
        Err(e) => serde_json::json!({ "error": e }),
    }
}

fn reply_to(conn: &UnixStream, reply: Value) -> io::Result<()> {
    let mut conn = conn;
    conn.write_all(reply.to_string().as_bytes())?;
    conn.write_all(b"\n")
}

/// One `vhostd ctl` command.
fn command(daemon: &Daemon, req: &Value) -> Result<Value, String> {
    let str_of =
        |k: &str| req.get(k).and_then(Value::as_str).ok_or_else(|| format!("request: `{k}` (a string) is missing"));
    let num_of =
        |k: &str| req.get(k).and_then(Value::as_u64).ok_or_else(|| format!("request: `{k}` (a number) is missing"));
    match str_of("command")? {
        "stats" => serde_json::to_value(crate::snapshot::snapshot(daemon)).map_err(|e| e.to_string()),
        "list" => Ok(list(daemon)),
        "add" => {
            let args: Vec<String> = req
                .get("args")
                .and_then(Value::as_array)
                .ok_or("request: `args` (the words after `vhostd ctl add`) is missing")?
                .iter()
                .map(|a| a.as_str().map(str::to_string).ok_or("request: `args` must be strings"))
                .collect::<Result<_, _>>()?;
            let spec = crate::cli::ctl_add_spec(&args)?;
            let name = spec.name.clone();
            daemon.add(&spec).map_err(|e| e.to_string())?;
            Ok(serde_json::json!({ "added": name }))
        }
        "remove" => {
            let name = str_of("name")?;
            daemon.remove(name)?;
            Ok(serde_json::json!({ "removed": name }))
        }
        "pin" => {
            let name = str_of("name")?;
            let (queue, worker) = (num_of("queue")?, num_of("worker")?);
            let e = daemon.devices.find(name).ok_or_else(|| format!("NAME {name}: no such device"))?;
            e.served.move_group(queue as usize, worker as usize, true).map_err(|m| format!("{m} (device `{name}`)"))?;
            Ok(serde_json::json!({ "pinned": name, "queue": queue, "worker": worker }))
        }
        "unpin" => {
            let name = str_of("name")?;
            let queue = num_of("queue")?;
            let e = daemon.devices.find(name).ok_or_else(|| format!("NAME {name}: no such device"))?;
            e.served.unpin(queue as usize).map_err(|m| format!("{m} (device `{name}`)"))?;
            Ok(serde_json::json!({ "unpinned": name, "queue": queue }))
        }
        "add-lun" => {
            let name = str_of("name")?;
            let crate::cli::LunArg(n, backend) =
                crate::cli::parse_lun(str_of("lun")?).map_err(|e| format!("--lun: {e}"))?;
            daemon.add_lun(name, n, &backend)?;
            Ok(serde_json::json!({ "added": name, "lun": n }))
        }
        "remove-lun" => {
            let name = str_of("name")?;
            let n = num_of("lun")?;
            let n = u16::try_from(n).map_err(|_| format!("LUN {n}: expected a number from 0 to 16383"))?;
            daemon.remove_lun(name, n)?;
            Ok(serde_json::json!({ "removed": name, "lun": n }))
        }
        other => {
            Err(format!("command `{other}`: expected add, remove, list, pin, unpin, add-lun, remove-lun or stats"))
        }
    }
}

/// `vhostd ctl list`: the workers, and each device's queues and the worker
/// each runs on.
fn list(daemon: &Daemon) -> Value {
    let entries = daemon.devices.list();
    let devices: Vec<Value> = entries
        .iter()
        .map(|e| {
            let sv = &e.served;
            let queues: Vec<Value> = sv
                .places()
                .iter()
                .enumerate()
                .map(|(g, p)| {
                    serde_json::json!({
                        "queue": g,
                        "role": if g < sv.queues { if e.kind == "net" { "pair" } else { "requests" } } else { "ctrl" },
                        "worker": p.worker,
                        "cpu": sv.pool.cpus.get(p.worker).copied().flatten(),
                        "pinned": p.pinned,
                    })
                })
                .collect();
            serde_json::json!({
                "name": e.name,
                "type": e.kind,
                "endpoint": e.endpoint,
                "connected": e.connected.load(std::sync::atomic::Ordering::Relaxed),
                "failed": e.failure(),
                "pool": if sv.pool.shared { "shared".to_string() } else { format!("own ({} workers)", sv.pool.workers.len()) },
                "queues": queues,
            })
        })
        .collect();
    let workers: Vec<Value> = match &daemon.pool {
        Some(p) => (0..p.workers.len())
            .map(|w| {
                let n: usize =
                    entries.iter().map(|e| e.served.places().iter().filter(|pl| pl.worker == w).count()).sum();
                serde_json::json!({ "worker": w, "cpu": p.cpus[w], "mode": crate::pool::mode_name(p.mode), "queues": n })
            })
            .collect(),
        None => Vec::new(),
    };
    serde_json::json!({ "workers": workers, "devices": devices })
}

/// Sends one request to the daemon at `path` and reads its answer.
fn request(path: &Path, req: &str, timeout: Duration) -> io::Result<Value> {
    let conn = UnixStream::connect(path).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("--control {}: {e} (is vhostd running with --control {}?)", path.display(), path.display()),
        )
    })?;
    conn.set_read_timeout(Some(timeout))?;
    (&conn).write_all(req.as_bytes())?;
    (&conn).write_all(b"\n")?;
    let mut line = String::new();
    BufReader::new(conn).read_line(&mut line)?;
    serde_json::from_str(&line).map_err(|e| io::Error::other(format!("{}: bad answer: {e}", path.display())))
}

/// `vhostd ctl`: one command to a running daemon; the answer as JSON
/// (--json) or in words. An error from the daemon is an error here.
pub fn run_ctl(args: &crate::cli::CtlArgs, control: Option<PathBuf>) -> io::Result<()> {
    use crate::cli::CtlCommand;
    let path = control.unwrap_or_else(|| PathBuf::from(DEFAULT_PATH));
    let req = match &args.command {
        CtlCommand::Add(a) => serde_json::json!({ "command": "add", "args": a.words }),
        CtlCommand::Remove { name } => serde_json::json!({ "command": "remove", "name": name }),
        CtlCommand::List => serde_json::json!({ "command": "list" }),
        CtlCommand::Pin { name, queue, worker } => {
            serde_json::json!({ "command": "pin", "name": name, "queue": queue, "worker": worker })
        }
        CtlCommand::Unpin { name, queue } => serde_json::json!({ "command": "unpin", "name": name, "queue": queue }),
        CtlCommand::AddLun { name, lun } => {
            serde_json::json!({ "command": "add-lun", "name": name, "lun": lun.to_string() })
        }
        CtlCommand::RemoveLun { name, lun } => serde_json::json!({ "command": "remove-lun", "name": name, "lun": lun }),
    };
    // Adding a device may take a while (an AF_XDP set-up, a large file).
    let v = request(&path, &req.to_string(), Duration::from_secs(60))?;
    if let Some(e) = v.get("error") {
        if args.json {
            println!("{v}");
        }
        return Err(io::Error::other(e.as_str().map(str::to_string).unwrap_or_else(|| e.to_string())));
    }
    let ok = v.get("ok").cloned().unwrap_or(Value::Null);
    if args.json {
        println!("{ok}");
        return Ok(());
    }
    match &args.command {
        CtlCommand::List => print!("{}", list_text(&ok)),
        CtlCommand::Add(_) => println!("added {}", ok["added"].as_str().unwrap_or("?")),
        CtlCommand::Remove { name } => println!("removed {name}"),
        CtlCommand::Pin { name, queue, worker } => println!("{name} queue {queue} pinned to worker {worker}"),
        CtlCommand::Unpin { name, queue } => println!("{name} queue {queue} unpinned"),
        CtlCommand::AddLun { name, lun } => println!("{name} LUN {} added", lun.0),
        CtlCommand::RemoveLun { name, lun } => println!("{name} LUN {lun} removed"),
    }
    Ok(())
}

/// `vhostd ctl list` in words: one line per worker, then per device queue.
fn list_text(v: &Value) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let none = Vec::new();
    let workers = v["workers"].as_array().unwrap_or(&none);
    if workers.is_empty() {
        out.push_str("no worker pool: each device runs on workers of its own\n");
    }
    for w in workers {
        let _ = writeln!(
            out,
            "worker {} cpu {} mode {} queues {}",
            w["worker"],
            w["cpu"].as_u64().map_or("any".into(), |c| c.to_string()),
            w["mode"].as_str().unwrap_or("?"),
            w["queues"]
        );
    }
    for d in v["devices"].as_array().unwrap_or(&none) {
        let _ = writeln!(
            out,
            "{} {} {} {}{}",
            d["name"].as_str().unwrap_or("?"),
            d["type"].as_str().unwrap_or("?"),
            d["endpoint"].as_str().unwrap_or("?"),
            if d["connected"].as_bool() == Some(true) { "connected" } else { "waiting" },
            d["failed"].as_str().map(|f| format!(" FAILED: {f}")).unwrap_or_default()
        );
        for q in d["queues"].as_array().unwrap_or(&none) {
            let _ = writeln!(
                out,
                "  queue {} ({}) worker {}{}",
                q["queue"],
                q["role"].as_str().unwrap_or("?"),
                q["worker"],
                if q["pinned"].as_bool() == Some(true) { " pinned" } else { "" }
            );
        }
    }
    out
}

/// Reads one snapshot from the control socket at `path`.
pub fn fetch(path: &Path) -> io::Result<Value> {
    let v = request(path, "stats", Duration::from_secs(10))?;
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
