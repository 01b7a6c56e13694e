//! The relay: the `trellara` CLI ([`cli`]), capture ([`capture`],
//! [`native`]), the durable segment log ([`log`]) it writes before
//! acknowledging the source, transports ([`transport`]), the applier
//! ([`apply`]), verification ([`verify`]) and the flow that composes them
//! ([`flow`]). The config model is shared with the grader
//! ([`config`], from `trellara-common`).

pub mod accept;
pub mod apply;
pub mod capture;
pub mod cli;
pub mod contract;
pub use trellara_common::config;
pub mod crash;
pub mod errors;
pub mod fence;
pub mod flow;
pub mod horizon;
pub mod identity;

pub mod lock;
pub mod log;
pub mod metrics;
pub mod native;
pub mod plan;
pub mod preflight;
pub mod reseed;
pub mod role;
pub mod semantics;
pub mod sequences;
pub mod service;
pub mod session;
pub mod sim;
pub mod snapshot;
pub mod state;
pub mod teardown;
pub mod throwaway;
pub mod transport;
pub mod verify;
