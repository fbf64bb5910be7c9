//! The configuration file (`vhostd --config FILE`): several devices in one
//! daemon. Each `[[net]]`, `[[blk]]` or `[[scsi]]` table holds the same keys as that
//! device's command line options (`socket-path`, `backend`, `queues`,
//! `mode`, `cpus`, ...) and goes through the same parser, so a file and a
//! command line mean the same thing. Errors name the file, the line and the
//! key.
//!
//! A `[dataplane]` table (`workers`, `cpus`, `mode`, `poll-idle-us`,
//! `rebalance-interval`: the global `--worker-*` options) runs every device on one shared pool of
//! workers; its devices then take no `mode` or `cpus` of their own. With
//! a control socket a file may hold no devices: they come with `vhostd ctl add`.
//!
//! ```toml
//! control = "/run/vhostd/control.sock"
//! metrics = "127.0.0.1:9480"
//!
//! [dataplane]
//! cpus = "2-3"
//!
//! [[net]]
//! name = "net0"
//! socket-path = "/run/vhostd/net0.sock"
//! backend = "tap,ifname=vtap0"
//! queues = 2
//! mode = "adaptive"
//!
//! [[blk]]
//! name = "disk0"
//! socket-path = "/run/vhostd/disk0.sock"
//! backend = "file,path=/var/lib/vhostd/disk0.img,discard=on"
//!
//! [[scsi]]
//! name = "scsi0"
//! socket-path = "/run/vhostd/scsi0.sock"
//! lun = ["0=file,path=/var/lib/vhostd/a.img", "1=null,size=1G"]
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::error::{ContextKind, ContextValue};
use serde::Deserialize;
use toml::Spanned;

use crate::cli::{self, DeviceArgs, LogFormat};
use crate::spec::DeviceSpec;

/// A whole configuration.
#[derive(Debug)]
pub struct Config {
    /// The control socket (`vhostd stats`).
    pub control: Option<PathBuf>,
    /// The Prometheus endpoint.
    pub metrics: Option<String>,
    /// Log format.
    pub log_format: Option<LogFormat>,
    /// The system call filter.
    pub seccomp: Option<crate::sandbox::SeccompMode>,
    /// The shared worker pool (`[dataplane]`).
    pub pool: Option<crate::spec::PoolSpec>,
    /// The devices, in file order.
    pub devices: Vec<DeviceSpec>,
}

type Table = BTreeMap<Spanned<String>, Spanned<toml::Value>>;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    control: Option<Spanned<String>>,
    metrics: Option<Spanned<String>>,
    #[serde(rename = "log-format")]
    log_format: Option<Spanned<String>>,
    seccomp: Option<Spanned<String>>,
    dataplane: Option<Spanned<Table>>,
    #[serde(default)]
    net: Vec<Spanned<Table>>,
    #[serde(default)]
    blk: Vec<Spanned<Table>>,
    #[serde(default)]
    scsi: Vec<Spanned<Table>>,
}

/// Keys a device table may not have, and why.
const NOT_IN_FILE: &[(&str, &str)] = &[
    ("fd", "a configuration file gives each device a socket-path (--fd is for one device started by a manager)"),
    ("print-capabilities", "run `vhostd net|blk|scsi --print-capabilities` instead"),
    ("help", "not an option"),
];

/// Reads and checks `path`. Errors are one line: `FILE:LINE: ...`.
pub fn load(path: &Path) -> Result<Config, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    parse(path, &text)
}

/// Checks `text`, read from `path` (named in errors).
pub fn parse(path: &Path, text: &str) -> Result<Config, String> {
    let at = |offset: usize| format!("{}:{}", path.display(), line_of(text, offset));
    let raw: RawFile = toml::from_str(text).map_err(|e| {
        let line = e.span().map(|s| line_of(text, s.start)).unwrap_or(1);
        format!("{}:{line}: {}", path.display(), e.message())
    })?;
    let log_format = match &raw.log_format {
        None => None,
        Some(v) => Some(match v.get_ref().as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                return Err(format!(
                    "{}: key `log-format`: expected \"text\" or \"json\", got \"{other}\"",
                    at(v.span().start)
                ))
            }
        }),
    };
    let seccomp = match &raw.seccomp {
        None => None,
        Some(v) => Some(match v.get_ref().as_str() {
            "enforce" => crate::sandbox::SeccompMode::Enforce,
            "trap" => crate::sandbox::SeccompMode::Trap,
            "off" => crate::sandbox::SeccompMode::Off,
            other => {
                return Err(format!(
                    "{}: key `seccomp`: expected \"enforce\", \"trap\" or \"off\", got \"{other}\"",
                    at(v.span().start)
                ))
            }
        }),
    };
    if let Some(m) = &raw.metrics {
        cli::parse_metrics_addr(m.get_ref()).map_err(|e| format!("{}: key `metrics`: {e}", at(m.span().start)))?;
    }
    if let Some(c) = &raw.control {
        if c.get_ref().is_empty() {
            return Err(format!("{}: key `control`: expected a socket path", at(c.span().start)));
        }
    }
    let pool = match &raw.dataplane {
        Some(t) => Some(dataplane(path, text, t)?),
        None => None,
    };
    let mut devices: Vec<(DeviceSpec, usize)> = Vec::new();
    for (kind, tables) in [("net", &raw.net), ("blk", &raw.blk), ("scsi", &raw.scsi)] {
        for (i, table) in tables.iter().enumerate() {
            let dev = device(path, text, kind, i, table)?;
            devices.push((dev, table.span().start));
        }
    }
    if devices.is_empty() && raw.control.is_none() {
        return Err(format!(
            "{}: no devices: add a [[net]], [[blk]] or [[scsi]] table (or a `control` socket to add them at runtime)",
            path.display()
        ));
    }
    if pool.is_some() {
        for (d, off) in &devices {
            d.dataplane
                .check_pooled()
                .map_err(|e| format!("{}: device `{}` (with [dataplane]): {e}", at(*off), d.name))?;
        }
    }
    devices.sort_by_key(|(_, at)| *at);
    for (i, (d, off)) in devices.iter().enumerate() {
        for (e, _) in &devices[..i] {
            if e.name == d.name {
                return Err(format!("{}: device name `{}` is used twice", at(*off), d.name));
            }
            if let Some(path) = d.endpoint.path().filter(|&p| e.endpoint.path() == Some(p)) {
                return Err(format!(
                    "{}: device `{}`: socket-path {} is also device `{}`'s",
                    at(*off),
                    d.name,
                    path.display(),
                    e.name
                ));
            }
        }
    }
    Ok(Config {
        control: raw.control.map(|c| PathBuf::from(c.into_inner())),
        metrics: raw.metrics.map(|m| m.into_inner()),
        log_format,
        seccomp,
        pool,
        devices: devices.into_iter().map(|(d, _)| d).collect(),
    })
}

/// The `[dataplane]` table: the shared worker pool.
fn dataplane(path: &Path, text: &str, table: &Spanned<Table>) -> Result<crate::spec::PoolSpec, String> {
    let (mut workers, mut cpus, mut mode, mut idle, mut rebalance) = (None, None, None, None, None);
    for (key, value) in table.get_ref() {
        let k = key.get_ref().as_str();
        let here =
            |msg: &str| format!("{}:{}: [dataplane] key `{k}`: {msg}", path.display(), line_of(text, key.span().start));
        match (k, value.get_ref()) {
            ("workers", toml::Value::Integer(n)) if (1..=256).contains(n) => workers = Some(*n as usize),
            ("workers", _) => return Err(here("expected a number of workers from 1 to 256")),
            ("cpus", toml::Value::String(s)) => cpus = Some(cli::parse_cpus(s).map_err(|e| here(&e))?.0),
            ("cpus", toml::Value::Integer(n)) => cpus = Some(cli::parse_cpus(&n.to_string()).map_err(|e| here(&e))?.0),
            ("cpus", _) => return Err(here("expected a CPU list like \"2\", \"2,3\" or \"2-5\"")),
            ("mode", toml::Value::String(s)) => {
                // The values of --worker-mode, parsed as clap parses them.
                let m = <cli::WaitMode as clap::ValueEnum>::from_str(s, false);
                mode = Some(
                    m.map_err(|_| here(&format!("expected \"adaptive\", \"poll\" or \"interrupt\", got \"{s}\"")))?,
                )
            }
            ("mode", _) => return Err(here("expected \"adaptive\", \"poll\" or \"interrupt\"")),
            ("poll-idle-us", toml::Value::Integer(n)) if (1..=1_000_000).contains(n) => idle = Some(*n as u64),
            ("poll-idle-us", _) => return Err(here("expected microseconds from 1 to 1000000")),
            ("rebalance-interval", toml::Value::Integer(n)) if (0..=86400).contains(n) => rebalance = Some(*n as u64),
            ("rebalance-interval", _) => return Err(here("expected seconds from 0 (never) to 86400")),
            _ => return Err(here("unknown key (known: workers, cpus, mode, poll-idle-us, rebalance-interval)")),
        }
    }
    // An empty [dataplane] still asks for a pool: one worker.
    Ok(cli::pool_spec(workers, cpus, mode, idle, rebalance))
}

fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}

/// One `[[kind]]` table as a device: its keys become `--key value`
/// arguments of `vhostd KIND`.
fn device(path: &Path, text: &str, kind: &str, index: usize, table: &Spanned<Table>) -> Result<DeviceSpec, String> {
    let file = path.display();
    let table_line = line_of(text, table.span().start);
    let mut name = format!("{kind}{index}");
    let mut argv = vec!["vhostd".to_string(), kind.to_string()];
    for (key, value) in table.get_ref() {
        let line = line_of(text, key.span().start);
        let k = key.get_ref().as_str();
        let here = |msg: String| format!("{file}:{line}: [[{kind}]] key `{k}`: {msg}");
        if let Some((_, why)) = NOT_IN_FILE.iter().find(|(n, _)| *n == k) {
            return Err(here((*why).to_string()));
        }
        if k == "name" {
            match value.get_ref() {
                toml::Value::String(s) if valid_name(s) => name = s.clone(),
                _ => return Err(here("expected a name of 1 to 32 letters, digits, '-', '_' or '.'".into())),
            }
            continue;
        }
        if k.starts_with('-') || k.contains(char::is_whitespace) || k.is_empty() {
            return Err(here("not a key of this device".into()));
        }
        match value.get_ref() {
            toml::Value::String(s) => argv.extend([format!("--{k}"), s.clone()]),
            toml::Value::Integer(n) => argv.extend([format!("--{k}"), n.to_string()]),
            toml::Value::Boolean(true) => argv.push(format!("--{k}")),
            toml::Value::Boolean(false) => {}
            // A repeated option (scsi's `lun = ["0=file,path=a.img", ...]`).
            toml::Value::Array(items) => {
                for item in items {
                    match item {
                        toml::Value::String(s) => argv.extend([format!("--{k}"), s.clone()]),
                        _ => return Err(here("expected a string, or an array of strings".into())),
                    }
                }
            }
            _ => return Err(here("expected a string, an integer or a boolean".into())),
        }
    }
    let fail = |e: clap::Error| -> String {
        // Which key clap refused, to point at its line.
        let arg = match e.get(ContextKind::InvalidArg) {
            Some(ContextValue::String(s)) => Some(s.clone()),
            Some(ContextValue::Strings(v)) => v.first().cloned(),
            _ => None,
        };
        let key = arg.as_deref().map(|a| a.trim_start_matches('-').split([' ', '=']).next().unwrap_or("").to_string());
        let line = key
            .as_deref()
            .and_then(|k| table.get_ref().keys().find(|s| s.get_ref() == k))
            .map(|s| line_of(text, s.span().start))
            .unwrap_or(table_line);
        let msg = clap_message(&e);
        match (key, e.kind()) {
            (Some(k), clap::error::ErrorKind::MissingRequiredArgument) => {
                format!("{file}:{line}: [[{kind}]] `{name}`: key `{k}` is required")
            }
            (Some(k), clap::error::ErrorKind::UnknownArgument) => {
                format!("{file}:{line}: [[{kind}]] `{name}`: unknown key `{k}` (see `vhostd {kind} --help`)")
            }
            (Some(k), _) => format!("{file}:{line}: [[{kind}]] `{name}`: key `{k}`: {msg}"),
            (None, _) => format!("{file}:{line}: [[{kind}]] `{name}`: {msg}"),
        }
    };
    let parsed = cli::Cli::try_parse_args(&argv).map_err(fail)?;
    let args = DeviceArgs::from_command(parsed.command).expect("argv names net, blk or scsi");
    args.check().map_err(|e| format!("{file}:{table_line}: [[{kind}]] `{name}`: {e}"))?;
    if args.socket_path().is_none() {
        return Err(format!("{file}:{table_line}: [[{kind}]] `{name}`: key `socket-path` is required"));
    }
    Ok(args.to_spec(name))
}

/// Names in stats and metrics labels: short and plain.
pub fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// clap's message without its "error: " prefix and usage lines.
pub fn clap_message(e: &clap::Error) -> String {
    let s = e.render().to_string();
    let first = s.lines().next().unwrap_or("").trim();
    first.strip_prefix("error: ").unwrap_or(first).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        parse(Path::new("/etc/vhostd/x.toml"), text).unwrap_err()
    }

    #[test]
    fn two_devices() {
        let c = parse(
            Path::new("c.toml"),
            r#"
metrics = "9480"
log-format = "json"
[[net]]
name = "n"
socket-path = "/tmp/n.sock"
backend = "loopback"
queues = 2
poll = true
[[blk]]
socket-path = "/tmp/b.sock"
backend = "null,size=1G"
"#,
        )
        .unwrap();
        assert_eq!(c.devices.len(), 2);
        assert_eq!(c.devices[0].name, "n");
        assert_eq!(c.devices[1].name, "blk0");
        assert_eq!(c.log_format, Some(LogFormat::Json));
        assert_eq!(c.devices[0].device.name(), "net");
        assert_eq!((c.devices[0].dataplane.queues, c.devices[0].dataplane.wait), (2, crate::spec::WaitSpec::Poll));
    }

    #[test]
    fn dataplane_asks_for_a_shared_pool() {
        let c = parse(
            Path::new("c.toml"),
            "control = \"/tmp/c\"\n[dataplane]\nworkers = 3\nmode = \"poll\"\nrebalance-interval = 0\n",
        )
        .unwrap();
        let p = c.pool.unwrap();
        assert_eq!((p.workers, p.wait, p.rebalance), (3, crate::spec::WaitSpec::Poll, std::time::Duration::ZERO));
        assert!(c.devices.is_empty(), "devices may come at runtime with a control socket");
        // One worker per CPU given; an empty table is one adaptive worker.
        let cpus = parse(Path::new("c.toml"), "control = \"/tmp/c\"\n[dataplane]\ncpus = \"0\"\n").unwrap();
        assert_eq!(cpus.pool.unwrap().workers, 1);
        let empty = parse(Path::new("c.toml"), "control = \"/tmp/c\"\n[dataplane]\n").unwrap().pool.unwrap();
        assert_eq!((empty.workers, empty.rebalance.as_secs()), (1, 10));
        assert!(matches!(empty.wait, crate::spec::WaitSpec::Adaptive { .. }));
        let e = err("control = \"/tmp/c\"\n[dataplane]\nmode = \"fast\"\n");
        assert!(e.starts_with("/etc/vhostd/x.toml:3: [dataplane] key `mode`: expected"), "{e}");
        let e = err("control = \"/tmp/c\"\n[dataplane]\nthreads = 2\n");
        assert!(e.contains("key `threads`: unknown key"), "{e}");
        // A device on the pool cannot wait its own way.
        let e = err("[dataplane]\n[[net]]\nsocket-path = \"/tmp/a\"\nbackend = \"sink\"\nmode = \"poll\"\n");
        assert!(e.contains("device `net0` (with [dataplane]): --mode"), "{e}");
        // No devices and no control socket: nothing to serve.
        assert!(err("[dataplane]\n").contains("no devices"));
    }

    #[test]
    fn scsi_units_are_an_array_of_lun_options() {
        let c = parse(
            Path::new("c.toml"),
            "[[scsi]]\nsocket-path = \"/tmp/s.sock\"\nqueues = 2\nlun = [\"0=null,size=1M\", \"7=file,path=/tmp/a.img,readonly=on\"]\n",
        )
        .unwrap();
        let d = &c.devices[0];
        assert_eq!((d.name.as_str(), d.dataplane.queues), ("scsi0", 2));
        match &d.device {
            crate::spec::DeviceKind::Scsi { luns } => {
                assert_eq!(luns.len(), 2);
                assert_eq!(luns[0], (0, vhostd_block_backends::BlockSpec::Null { size: 1 << 20 }));
                assert_eq!(luns[1].0, 7);
            }
            other => panic!("not scsi: {other:?}"),
        }
        assert_eq!(d.transport, crate::spec::Transport::VhostUser);
        // Over vfio-user too, as blk and net.
        let c = parse(
            Path::new("c.toml"),
            "[[scsi]]\nsocket-path = \"/tmp/s.sock\"\ntransport = \"vfio-user\"\nlun = [\"0=null,size=1M\"]\n",
        )
        .unwrap();
        assert_eq!(c.devices[0].transport, crate::spec::Transport::VfioUser);
        let e = err("[[scsi]]\nsocket-path = \"/tmp/s\"\nlun = [\"0=null,size=1M\", \"0=null,size=2M\"]\n");
        assert!(e.contains("[[scsi]] `scsi0`") && e.contains("LUN 0 is given twice"), "{e}");
        let e = err("[[scsi]]\nsocket-path = \"/tmp/s\"\nlun = [0]\n");
        assert!(e.contains(":3: [[scsi]] key `lun`: expected a string"), "{e}");
        let e = err("[[scsi]]\nsocket-path = \"/tmp/s\"\nlun = \"16384=null,size=1M\"\n");
        assert!(e.contains("key `lun`") && e.contains("from 0 to 16383"), "{e}");
        let e = err("[[scsi]]\nsocket-path = \"/tmp/s\"\n");
        assert!(e.contains("key `lun` is required"), "{e}");
    }

    #[test]
    fn errors_name_file_line_and_key() {
        let e = err("[[net]]\nsocket-path = \"/tmp/a\"\nbackend = \"bogus\"\n");
        assert!(e.starts_with("/etc/vhostd/x.toml:3: [[net]] `net0`: key `backend`: "), "{e}");
        assert!(e.contains("unknown backend 'bogus'"), "{e}");
        let e = err("[[net]]\nsocket-path = \"/tmp/a\"\nbackend = \"sink\"\nqueues = 0\n");
        assert!(e.starts_with("/etc/vhostd/x.toml:4: [[net]] `net0`: key `queues`: "), "{e}");
        let e = err("[[blk]]\nsocket-path = \"/tmp/a\"\n");
        assert!(
            e.contains(":1: [[blk]] `blk0`: key `backend` is required") || e.contains("key `backend` is required"),
            "{e}"
        );
        let e = err("[[net]]\nsocket-path = \"/tmp/a\"\nbackend = \"sink\"\nspeed = 10\n");
        assert!(e.starts_with("/etc/vhostd/x.toml:4: [[net]] `net0`: unknown key `speed`"), "{e}");
        let e = err("[[net]]\nsocket-path = \"/tmp/a\"\nbackend = \"sink\"\nfd = 3\n");
        assert!(e.starts_with("/etc/vhostd/x.toml:4: [[net]] key `fd`:"), "{e}");
        let e = err("[[net]]\nsocket-path = \"/tmp/a\"\nbackend = [1]\n");
        assert!(e.contains(":3: [[net]] key `backend`: expected a string"), "{e}");
        let e = err("bogus = 1\n");
        assert!(e.starts_with("/etc/vhostd/x.toml:1: unknown field `bogus`"), "{e}");
        let e = err("[[net]]\nsocket-path = \"/tmp/a\"\nbackend = \"sink\"\n[[net]]\nsocket-path = \"/tmp/a\"\nbackend = \"sink\"\n");
        assert!(e.contains(":4: device `net1`: socket-path /tmp/a is also device `net0`'s"), "{e}");
        let e = err("[[net]]\nname = \"x\"\nsocket-path = \"/tmp/a\"\nbackend = \"sink\"\n[[blk]]\nname = \"x\"\nsocket-path = \"/tmp/b\"\nbackend = \"null,size=1M\"\n");
        assert!(e.contains(":5: device name `x` is used twice"), "{e}");
        let e = err("[[net]]\nname = \"a b\"\n");
        assert!(e.contains(":2: [[net]] key `name`: expected a name"), "{e}");
        let e = err("log-format = \"xml\"\n[[net]]\n");
        assert!(e.contains(":1: key `log-format`"), "{e}");
        let e = err("metrics = \"nope\"\n[[net]]\n");
        assert!(e.contains(":1: key `metrics`"), "{e}");
        assert!(err("").contains("no devices"));
        let e = err("[[net]]\nsocket-path = \"/tmp/a\"\nbackend = \"tap,fd=3:4\"\n");
        assert!(e.contains("[[net]] `net0`: --backend tap,fd=...: 2 descriptor(s) for --queues 1"), "{e}");
    }
}
