//! External capture for managed PostgreSQL, where no extension can be
//! installed. It produces exactly the envelope the native path produces.
//!
//! ```text
//!  XLogData ─▶ pgoutput::decode ─▶ Assembler ─▶ Envelope(s) per commit
//!                                   │ spills large / streamed txns (Spool)
//! ```

pub mod assembler;
pub mod pgoutput;
pub mod pgwire;
mod spool;

pub use assembler::{AssembleOrSink, Assembler, AssemblerConfig, AssemblerStats, AssemblyError};
