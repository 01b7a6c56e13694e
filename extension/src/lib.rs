//! Trellara's PostgreSQL extension (pgrx, PostgreSQL 15-18): the native
//! capture path.
//!
//! ```text
//!  WAL ─▶ logical decoding (reorder buffer) ─▶ plugin.rs: `trellara` output plugin
//!                                               │ one Envelope v1 per committed txn
//!                                               │ (assemble.rs: chunked beyond chunk_bytes;
//!                                               │  spill.rs: memory bounded by a budget)
//!                                               ▼
//!                                 native frames (trellara_common::native_frame)
//!                                               │ one OutputPluginWrite per frame
//!              ┌────────────────────────────────┼──────────────────────────┐
//!              ▼                                ▼                          ▼
//!   pg_logical_slot_get_binary_changes    walsender (START_        background worker +
//!   (one row per frame; the tests)        REPLICATION LOGICAL)     16 x 64 KiB shm ring +
//!                                                                   relay socket [issue 3 part 2]
//! ```
//!
//! Invariants (see `SAFETY.md` for the unsafe ones):
//! - The library is `trellara.so` (control file `module_pathname`), so the
//!   output plugin name, `shared_preload_libraries` and `CREATE EXTENSION`
//!   all say `trellara`.
//! - `_PG_init` registers nothing yet: no GUCs, shared memory or worker
//!   until part 2. Loading the plugin in any backend is side-effect free.
//! - The SQL surface lives in `sql/trellara--<version>.sql` (checked in, not
//!   generated); the Rust functions it binds to are `sql = false`.

use pgrx::prelude::*;

mod assemble;
mod error;
mod options;
mod plugin;
mod relation;
mod spill;

pgrx::pg_module_magic!();

extension_sql_file!("../../sql/trellara--0.1.0.sql", name = "trellara_install");

/// `trellara.extension_version()`: the version of the loaded library.
#[pg_extern(sql = false, immutable, parallel_safe)]
fn extension_version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// `trellara.protocol_version()`: the envelope protocol the plugin emits.
#[pg_extern(sql = false, immutable, parallel_safe)]
fn protocol_version() -> i32 {
    // PROTOCOL_VERSION is 1; it fits in an int.
    i32::try_from(trellara_common::envelope::PROTOCOL_VERSION).unwrap_or(i32::MAX)
}

/// Required by `cargo pgrx test` (not used: the tests live in trellara-tests
/// and start their own clusters).
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
