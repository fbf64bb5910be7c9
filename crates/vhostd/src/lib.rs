//! vhostd as a library: the modules of the `vhostd` binary, public so that
//! fuzz targets (fuzz/) and tests can reach the vhost-user session and the
//! configuration parser. Not a stable API.
//!
//! From the command line down: `cli` and `config` parse into `spec` (plain
//! device specs); `build` makes devices and endpoints from them and places
//! their queue groups on a `pool` of `worker`s (`balance` moves them);
//! `server` is the main loop and the `Daemon` that adds and removes
//! devices; `frontends` serves every device's `endpoint` on one thread
//! (and hears the host's `link_events` for vfio-user net devices);
//! `connection` serves one vhost-user connection (the `vhost` crate's
//! handler and a shim), driving a `session`, which drives the device (the
//! `vhostd_device::Device` trait) and its rings on the workers; `vfio`
//! serves one vfio-user connection instead (`--transport vfio-user`), a
//! virtio-pci model of the same device on the same workers.
//! `registry` lists the devices for `control` (`vhostd stats`, `vhostd
//! ctl`) and `metrics`, which render `snapshot`s.

pub mod balance;
pub mod build;
pub mod cli;
pub mod config;
pub mod connection;
pub mod control;
pub mod endpoint;
pub mod frontends;
pub mod link_events;
pub mod man;
pub mod memory;
pub mod metrics;
pub mod notify;
pub mod pool;
pub mod registry;
pub mod sandbox;
pub mod server;
pub mod session;
pub mod signals;
pub mod snapshot;
pub mod spec;
pub mod stats;
pub mod vfio;
pub mod worker;
pub mod xdp_helper;
