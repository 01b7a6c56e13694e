//! External capture for managed PostgreSQL, where no extension can be
//! installed. It produces exactly the envelope the native path produces.
//!
//! ```text
//!  XLogData ─▶ pgoutput::decode ─▶ Assembler ─▶ Envelope(s) per commit
//!                                   │ spills large / streamed txns (Spool)
//! ```

pub mod assembler;
pub mod pgoutput;
/// The replication client lives in its own small crate (the read-only
/// grader uses it too); re-exported here where capture expects it.
pub use trellara_pgwire as pgwire;

pub use assembler::{
    AssembleOrSink, Assembled, Assembler, AssemblerConfig, AssemblerStats, AssemblyError,
};
