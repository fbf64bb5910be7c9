//! Prometheus metrics over HTTP (`--metrics ADDR`): `GET /metrics` answers
//! the text exposition of every device's counters. A minimal HTTP/1.1
//! server on one thread: scrapes are rare and small.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use crate::registry::Registry;
use crate::server::Daemon;

/// Listens on `addr` and serves scrapes on a thread of its own.
pub fn serve(addr: SocketAddr, entries: Registry) -> io::Result<()> {
    let listener = TcpListener::bind(addr).map_err(|e| io::Error::new(e.kind(), format!("--metrics {addr}: {e}")))?;
    if !addr.ip().is_loopback() {
        tracing::warn!("metrics on {addr}: reachable from other hosts");
    }
    crate::snapshot::init();
    tracing::info!("metrics on http://{}/metrics", listener.local_addr().unwrap_or(addr));
    std::thread::Builder::new().name("vhostd-metrics".into()).spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            if let Err(e) = answer(conn, &entries) {
                tracing::debug!("metrics connection: {e}");
            }
        }
    })?;
    Ok(())
}

fn answer(conn: TcpStream, entries: &Daemon) -> io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(conn.try_clone()?.take(8192));
    let mut request = String::new();
    reader.read_line(&mut request)?;
    // Skip the headers (bounded by `take`).
    let mut h = String::new();
    while reader.read_line(&mut h)? > 2 {
        h.clear();
    }
    let mut parts = request.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, ctype, body) = match (method, path) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            crate::snapshot::prometheus(&crate::snapshot::snapshot(entries)),
        ),
        ("GET", "/") => ("200 OK", "text/plain; charset=utf-8", "vhostd: metrics at /metrics\n".to_string()),
        ("GET", _) => ("404 Not Found", "text/plain; charset=utf-8", "not found: try /metrics\n".to_string()),
        _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "GET only\n".to_string()),
    };
    let mut out = &conn;
    write!(
        out,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    out.flush()
}
