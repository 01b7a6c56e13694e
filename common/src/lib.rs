//! Shared by every Trellara crate: the envelope v1 wire contract
//! ([`envelope`]), log sequence numbers ([`lsn`]), pinned schema
//! fingerprints ([`fingerprint`]), the native extension's frames
//! ([`native_frame`]) and socket protocol ([`native_wire`]), files only
//! their owner may read ([`owner_only`]), and table names as SQL spells
//! them ([`table_name`]).

#[cfg(feature = "envelope")]
pub mod envelope;
#[cfg(feature = "envelope")]
pub mod fingerprint;
pub mod lsn;
#[cfg(feature = "envelope")]
pub mod native_frame;
#[cfg(feature = "envelope")]
pub mod native_wire;
pub mod owner_only;
#[cfg(any(test, feature = "test-utils"))]
pub mod sample;
pub mod table_name;

pub use lsn::Lsn;
