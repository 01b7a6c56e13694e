//! pgoutput logical replication messages, protocol versions 1 and 2.
//!
//! [`decode`] turns one XLogData payload into one [`Message`] ([`encode`]
//! is its inverse, for the simulator's walsender). It never panics
//! on malformed input (the module denies `unwrap` and slice indexing; a fuzz
//! target drives it) and rejects trailing bytes, as PostgreSQL's own
//! `pq_getmsgend` does. Messages that only exist in protocol 3 and 4
//! (two-phase, parallel streaming) are refused by name: a v2 session never
//! receives them, so seeing one means the session was set up wrongly.
//!
//! The decoder is stateless except for one bit the caller tracks: whether the
//! message arrived inside a Stream Start/Stream Stop block, where every
//! data-carrying message is prefixed by the (sub)transaction id.

mod decode;
mod encode;

pub use decode::{DecodeError, decode};
pub use encode::encode;

use bytes::Bytes;

/// Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
pub const POSTGRES_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// The negotiated `proto_version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProtoVersion {
    V1 = 1,
    V2 = 2,
}

/// What the caller knows about where the message sits in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeContext {
    pub version: ProtoVersion,
    /// Between Stream Start and Stream Stop.
    pub in_stream_block: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Begin(Begin),
    Commit(Commit),
    Origin(Origin),
    Relation(Relation),
    Type(Type),
    Insert(Insert),
    Update(Update),
    Delete(Delete),
    Truncate(Truncate),
    Message(LogicalMessage),
    StreamStart(StreamStart),
    StreamStop,
    StreamCommit(StreamCommit),
    StreamAbort(StreamAbort),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the commit record.
    pub final_lsn: u64,
    /// Microseconds since the PostgreSQL epoch.
    pub commit_time: i64,
    pub xid: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    pub flags: u8,
    pub commit_lsn: u64,
    /// Just past the commit record: what the slot may be confirmed to.
    pub end_lsn: u64,
    pub commit_time: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub commit_lsn: u64,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// Subtransaction id, inside a stream block only.
    pub xid: Option<u32>,
    pub oid: u32,
    /// Empty means pg_catalog.
    pub namespace: String,
    pub name: String,
    /// `d`efault, `n`othing, `f`ull or `i`ndex.
    pub replica_identity: u8,
    pub columns: Vec<RelationColumn>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// Part of the replica identity key.
    pub key: bool,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Type {
    pub xid: Option<u32>,
    pub oid: u32,
    pub namespace: String,
    pub name: String,
}

/// One column of a TupleData.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Column {
    Null,
    /// `'u'`: an unchanged TOASTed value that was not sent. Not NULL.
    UnchangedToast,
    Text(Bytes),
    Binary(Bytes),
}

/// Which old image an update or delete carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OldKind {
    /// `'K'`: replica identity key columns only (others are sent as NULL).
    Key,
    /// `'O'`: the whole old row (REPLICA IDENTITY FULL).
    Full,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    pub xid: Option<u32>,
    pub relation: u32,
    pub new: Vec<Column>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub xid: Option<u32>,
    pub relation: u32,
    pub old: Option<(OldKind, Vec<Column>)>,
    pub new: Vec<Column>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    pub xid: Option<u32>,
    pub relation: u32,
    pub old_kind: OldKind,
    pub old: Vec<Column>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    pub xid: Option<u32>,
    pub cascade: bool,
    pub restart_identity: bool,
    pub relations: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalMessage {
    pub xid: Option<u32>,
    pub transactional: bool,
    pub lsn: u64,
    pub prefix: String,
    pub content: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStart {
    /// Top-level transaction id.
    pub xid: u32,
    pub first_segment: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamCommit {
    pub xid: u32,
    pub flags: u8,
    pub commit_lsn: u64,
    pub end_lsn: u64,
    pub commit_time: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamAbort {
    /// Top-level transaction id.
    pub xid: u32,
    /// The aborted subtransaction; equal to `xid` when the whole transaction
    /// aborted.
    pub subxid: u32,
}
