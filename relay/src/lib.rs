//! The relay: the `trellara` CLI ([`cli`]) and the durable segment log
//! ([`log`]) the relay publishes into before acknowledging the source.
//! Transports, the applier and verification arrive with their issues.

pub mod apply;
pub mod capture;
pub mod cli;
pub mod config;
pub mod crash;
pub mod delivery;
pub mod errors;
pub mod flow;
pub mod horizon;
pub mod identity;

pub mod lock;
pub mod log;
pub mod metrics;
pub mod native;
pub mod plan;
pub mod preflight;
pub mod semantics;
pub mod sequences;
pub mod service;
pub mod sim;
pub mod snapshot;
pub mod state;
pub mod teardown;
pub mod throwaway;
pub mod transport;
pub mod verify;
