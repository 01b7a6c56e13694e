//! A small PostgreSQL client (replication sessions and plain read-only
//! ones) on `postgres-protocol`'s
//! codecs: TLS (rustls, ring), SCRAM-SHA-256, `replication=database`
//! sessions, replication commands, and the CopyBoth stream of
//! `START_REPLICATION`. tokio-postgres has no replication mode, and the
//! crates that do either hard-code protocol v1 or acknowledge positions on
//! their own; this one only ever reports what its caller declared durable.
//!
//! Invariants:
//! * Standby status updates carry write = flush = apply = the durable
//!   position the caller set ([`ReplicationStream::set_durable`]), never a
//!   position merely received.
//! * Reads are cancel-safe: bytes accumulate in a buffer and only whole
//!   messages are parsed, so a `select!` may drop a pending read.
//! * Messages are size-capped before they are buffered.

mod config;
mod connection;
mod replication;
mod sql_tls;
mod tls;

pub use config::{ConnectOptions, SslMode};
pub use connection::{Connection, PgError, Row, SESSION_OPTIONS};
pub use replication::{
    IdentifySystem, ReplicationEvent, ReplicationStream, SlotCreated, SlotInfo, quote_literal,
    validate_slot_name,
};
pub use sql_tls::{MakeTls, TlsStream, sql_config};

/// Errors of the replication client. `Server` carries the server's own
/// message and SQLSTATE.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection string: {0}")]
    Config(String),
    /// `to`: `host:port`, or the Unix socket's path.
    #[error("connect to {to}")]
    Connect {
        to: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(String),
    #[error("authentication: {0}")]
    Auth(String),
    #[error("connection I/O")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Server(#[from] PgError),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("the server closed the connection")]
    Closed,
}

impl WireError {
    /// Transient errors are retried with backoff; the rest stop capture.
    /// Unknown counts as transient.
    pub fn is_transient(&self) -> bool {
        match self {
            WireError::Config(_) | WireError::Auth(_) | WireError::Tls(_) => false,
            WireError::Server(e) => trellara_common::retry::transient(&e.code),
            _ => true,
        }
    }
}
