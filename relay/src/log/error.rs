//! The segment log's error type.
//!
//! Each variant names the file, offset or consumer involved and says what
//! recovers it; the underlying cause is attached as `#[source]`, never
//! flattened into the message.

use std::io;
use std::path::PathBuf;

use super::frame::Corruption;

/// Everything that can go wrong in [`crate::log`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O call failed. If it was on the append path the log is now
    /// poisoned (see [`Error::Poisoned`]).
    #[error("could not {op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// Bytes that must be a valid header or frame are not. Raised for any
    /// sealed segment, and for the last segment when a valid frame follows
    /// the bad one (so it is not a torn tail). Records are never skipped.
    #[error(
        "corrupt data in segment {} at byte {pos}; the log will not skip records: \
         restore the segment from a replica or backup, or, accepting the loss of \
         everything from here on, truncate the file to {pos} bytes and remove every \
         later segment",
        path.display()
    )]
    Corrupt {
        path: PathBuf,
        pos: u64,
        #[source]
        reason: Corruption,
    },

    /// Segment files do not chain: offsets `expected..found` are missing.
    #[error(
        "segment {} starts at offset {found} but the previous segment ends at {expected}; \
         records {expected}..{found} are missing: restore the missing segment from a backup",
        path.display()
    )]
    Gap {
        path: PathBuf,
        expected: u64,
        found: u64,
    },

    /// An earlier write or fsync failed, so which bytes reached the disk is
    /// unknown. Appends and flushes fail until the log is reopened, which
    /// recovers from what is actually durable.
    #[error(
        "the log is poisoned by an earlier failed write or fsync of {}; \
         reopen the log to recover from what is durable",
        path.display()
    )]
    Poisoned { path: PathBuf },

    /// A cursor file is torn or corrupt; it is never silently reset.
    #[error(
        "cursor file {} of consumer {consumer:?} is unreadable; it is not reset to 0: \
         restore the file, or remove it and register the consumer again at a chosen offset",
        path.display()
    )]
    CursorCorrupt {
        consumer: String,
        path: PathBuf,
        #[source]
        reason: Corruption,
    },

    /// A cursor points outside the durable records of the log.
    #[error(
        "consumer {consumer:?} is at offset {cursor}, outside the log's records {first}..{next}; \
         the records it needs are gone or the cursor belongs to another log: \
         re-register the consumer at an offset inside that range"
    )]
    CursorOutOfRange {
        consumer: String,
        cursor: u64,
        first: u64,
        next: u64,
    },

    /// [`super::Log::follow`] found no log its writer opened yet.
    #[error(
        "the log {} has not been opened by its relay yet (no watermark file in it); start the flow's relay",
        dir.display()
    )]
    NotWritten { dir: PathBuf },

    /// The followed log was removed or replaced (a reseed or teardown).
    #[error(
        "the log {} was replaced or removed while this process followed it; follow the new one from its own cursor",
        dir.display()
    )]
    Replaced { dir: PathBuf },

    /// The watermark file a follower reads cannot be decoded. Nothing of
    /// the log is lost: the relay rewrites the file whenever it opens it.
    #[error(
        "the watermark file {} of the log is unreadable; no record was read past it: \
         restart the flow's relay, which rewrites the file from the segments when it opens the log",
        path.display()
    )]
    WatermarkUnreadable {
        path: PathBuf,
        #[source]
        reason: Corruption,
    },

    /// The log's writer now names fewer records durable than a follower
    /// already read: records it had called durable are gone.
    #[error(
        "the log {} now names records below {now} durable, but this process already read up to {seen}; \
         records the relay had called durable are gone (a restored or edited log directory?): \
         reseed the flow",
        dir.display()
    )]
    WatermarkBack { dir: PathBuf, seen: u64, now: u64 },

    /// A follower asked to write what only the log's writer writes.
    #[error(
        "the log {} is followed from another process: only its relay appends to it, deletes from it or drops cursors",
        dir.display()
    )]
    ReadOnly { dir: PathBuf },

    #[error("no consumer named {consumer:?} is registered; register it first")]
    UnknownConsumer { consumer: String },

    #[error("consumer name {name:?} is invalid: use 1 to 64 characters from A-Z a-z 0-9 _ -")]
    InvalidConsumerName { name: String },

    #[error("offset {requested} was removed by retention; the log now starts at {first}")]
    OffsetTruncated { requested: u64, first: u64 },

    #[error("offset {requested} is past the durable end of the log ({next})")]
    OffsetBeyondEnd { requested: u64, next: u64 },

    #[error("a payload of {len} bytes does not fit a frame (at most {max}); split it into chunks")]
    PayloadTooLarge { len: u64, max: u64 },

    /// The caller's payload source failed; the partial frame was removed.
    #[error("the payload source failed after {read} of {expected} bytes; nothing was appended")]
    Source {
        expected: u64,
        read: u64,
        #[source]
        source: io::Error,
    },
}

impl Error {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}
