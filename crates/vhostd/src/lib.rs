//! vhostd as a library: the modules of the `vhostd` binary, public so that
//! fuzz targets (fuzz/) and tests can reach the vhost-user session and the
//! configuration parser. Not a stable API.

pub mod cli;
pub mod config;
pub mod control;
pub mod man;
pub mod memory;
pub mod metrics;
pub mod notify;
pub mod sandbox;
pub mod server;
pub mod session;
pub mod stats;
pub mod worker;
pub mod xdp_helper;
