//! Trellara's PostgreSQL extension (pgrx, PostgreSQL 15-18): the native
//! capture path.
//!
//! ```text
//!  WAL ─▶ logical decoding (reorder buffer) ─▶ plugin.rs: `trellara` output plugin
//!                                               │ one Envelope v1 per committed txn
//!                                               │ (assemble.rs: chunked beyond chunk_bytes;
//!                                               │  trellara_common::spool: memory bounded)
//!                                               ▼
//!                                 native frames (trellara_common::native_frame)
//!                                               │ one OutputPluginWrite per frame
//!              ┌────────────────────────────────┼──────────────────────────┐
//!              ▼                                ▼                          ▼
//!   pg_logical_slot_get_binary_changes    walsender (START_        background worker +
//!   (one row per frame; the tests)        REPLICATION LOGICAL)     16 x 64 KiB shm ring +
//!                                                                   relay socket (worker.rs, shmem.rs)
//! ```
//!
//! Invariants (see `SAFETY.md` for the unsafe ones):
//! - The library is `trellara.so` (control file `module_pathname`), so the
//!   output plugin name, `shared_preload_libraries` and `CREATE EXTENSION`
//!   all say `trellara`.
//! - Only under `shared_preload_libraries` does `_PG_init` define the
//!   `trellara.*` settings, reserve the shared-memory queue and (with
//!   `trellara.enabled`) register the boot-time worker. Loaded any other way
//!   (as an output plugin, by `CREATE EXTENSION`) it has no side effects.
//! - The SQL surface lives in `sql/trellara--<version>.sql` (checked in, not
//!   generated); the Rust functions it binds to are `sql = false`.

use pgrx::prelude::*;

mod assemble;
mod error;
mod options;
mod plugin;
mod relation;
mod shmem;
mod worker;

pgrx::pg_module_magic!();

extension_sql_file!("../../sql/trellara--0.2.0.sql", name = "trellara_install");

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // SAFETY: a postmaster global, set while shared_preload_libraries loads.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    worker::define_gucs();
    shmem::install_hooks();
    worker::register_static_worker();
}

/// `trellara.status_raw()`: the worker's state from shared memory; the SQL
/// wrapper `trellara.status()` turns the LSN into a pg_lsn.
#[allow(clippy::type_complexity)]
#[pg_extern(sql = false)]
fn status_raw() -> TableIterator<
    'static,
    (
        name!(state, String),
        name!(reason, Option<String>),
        name!(pid, Option<i32>),
        name!(queue_occupancy, Option<i32>),
        name!(queue_capacity, Option<i32>),
        name!(last_acknowledged_lsn, Option<i64>),
        name!(frames_sent, Option<i64>),
        name!(acknowledgements, Option<i64>),
    ),
> {
    let row = match shmem::get() {
        None => (
            "not_loaded".to_owned(),
            Some(
                "trellara is not in shared_preload_libraries; add it and restart the server"
                    .to_owned(),
            ),
            None,
            None,
            None,
            None,
            None,
            None,
        ),
        Some(queue) => {
            let s = queue.status();
            let as_i64 = |v: u64| i64::try_from(v).ok();
            (
                s.state.name().to_owned(),
                (!s.reason.is_empty()).then_some(s.reason),
                (s.pid != 0).then_some(s.pid),
                i32::try_from(s.occupancy).ok(),
                i32::try_from(s.capacity).ok(),
                (s.acked_lsn != 0).then(|| as_i64(s.acked_lsn)).flatten(),
                as_i64(s.frames_sent),
                as_i64(s.transactions_acked),
            )
        }
    };
    TableIterator::once(row)
}

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
