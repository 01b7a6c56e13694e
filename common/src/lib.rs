//! Shared by every Trellara crate: the envelope v1 wire contract
//! ([`envelope`]), log sequence numbers ([`lsn`]) and pinned schema
//! fingerprints ([`fingerprint`]).

pub mod envelope;
pub mod fingerprint;
pub mod lsn;
#[cfg(any(test, feature = "test-utils"))]
pub mod sample;

pub use lsn::Lsn;
