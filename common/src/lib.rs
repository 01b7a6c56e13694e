//! Shared by every Trellara crate: the envelope v1 wire contract
//! ([`envelope`]), log sequence numbers ([`lsn`]), pinned schema
//! fingerprints ([`fingerprint`]), the native extension's frames
//! ([`native_frame`]) and socket protocol ([`native_wire`]), the
//! `trellara.yml` model ([`config`]), files only their owner may read
//! ([`owner_only`]), secrets kept out of messages ([`redact`]), table
//! names as SQL spells them ([`table_name`]), replication slot names
//! ([`slot_name`]), one transaction's changes spooled and cut into
//! envelopes by both capture paths ([`spool`]), whether a server's error may pass on a retry
//! ([`retry`]), schema contracts: how a schema change is classified and
//! propagated ([`ddl`]), and the one way a failure prints with its causes
//! ([`errors`]).

#[cfg(feature = "config")]
pub mod config;
#[cfg(all(feature = "config", feature = "envelope"))]
pub mod ddl;
#[cfg(feature = "envelope")]
pub mod envelope;
pub mod errors;
#[cfg(feature = "envelope")]
pub use envelope::fingerprint;
pub mod lsn;
#[cfg(feature = "envelope")]
pub mod native_frame;
#[cfg(feature = "envelope")]
pub mod native_wire;
pub mod owner_only;
pub mod redact;
pub mod retry;
#[cfg(any(test, feature = "test-utils"))]
pub mod sample;
pub mod slot_name;
#[cfg(feature = "envelope")]
pub mod spool;
pub mod table_name;

pub use lsn::Lsn;
