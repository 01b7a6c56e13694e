//! Test harness for real PostgreSQL clusters, majors 15 to 18.
//!
//! ```text
//!  env TRELLARA_PG{NN}_BINDIR ─┐
//!  /opt/trellara/pg.env ───────┼─> Major::locate() ─> Install (bin dir)
//!  default paths ──────────────┘         │
//!                                        v
//!  majors_for_test() / test_cluster() ─> Cluster::start(major, &options)
//!                                        │  temp dir, initdb (as `trellara` when root),
//!                                        │  free 127.0.0.1 port, pg_ctl start -w,
//!                                        │  output_plugin_libraries where present
//!                                        v
//!                                  Cluster ──Drop──> pg_ctl stop -m immediate, rm -rf
//! ```
//!
//! Invariants:
//! - Binaries come from `scripts/setup`; a missing major fails tests under `CI=true`
//!   and is skipped (loudly) elsewhere.
//! - A [`Cluster`] never outlives its value: it is stopped and its directory removed on
//!   drop, on panic, and (by a watchdog) when the test process dies.
//! - Clusters are isolated: own temp dir, own port, trust auth for `postgres` on
//!   127.0.0.1 only.
//!
//! Typical use:
//! ```no_run
//! use trellara_tests::{ClusterOptions, Major, for_each_major, test_cluster};
//!
//! for_each_major(|cluster| {
//!     cluster.psql("CREATE TABLE t (id int PRIMARY KEY)");
//! });
//! if let Some(cluster) = test_cluster(Major::Pg17, &ClusterOptions::new()) {
//!     assert_eq!(cluster.psql_value("SELECT 1"), "1");
//! }
//! ```

mod broker;
mod cluster;
pub mod endpoints;
mod major;
mod matrix;

pub use broker::Broker;
pub use cluster::{Cluster, ClusterError, ClusterOptions, HOST, OS_USER, SUPERUSER, error_chain};
pub use major::{
    BindirOrigin, DEFAULT_PG_ENV_FILE, Install, Major, MissingMajor, PG_ENV_FILE_VAR,
    available_majors,
};
pub use matrix::{
    MAJORS_VAR, REQUIRE_ALL_MAJORS_VAR, all_majors_required, for_each_major, for_each_major_with,
    majors_for_test, selected_majors, test_cluster,
};
/// The client crate the harness hands out, so tests use the same version.
pub use postgres;
