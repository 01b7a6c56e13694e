//! Envelope v1: the one wire contract between capture and every sink.
//!
//! The types are generated at build time from `proto/trellara/v1/envelope.proto`.
//! This module adds the rules protobuf cannot state:
//!
//! * [`encode`] validates before it writes and [`decode`] validates after it
//!   reads, so an invalid envelope never reaches disk and never leaves a reader.
//!   [`RawEnvelope`] writes the same bytes from changes encoded earlier, each
//!   checked by [`validate_change`] then; it validates the rest itself.
//! * The checksum is xxh3_64 over the encoding with the checksum zeroed. The
//!   encoder emits fields in tag order, so the checksum field is always the
//!   final 9 bytes (`0x69` + 8 bytes little-endian) and the hash covers
//!   exactly the bytes before it: one pass to encode, one to hash, no clone.
//! * Every violation is a distinct [`EnvelopeError`] variant, so callers can
//!   quarantine with a precise reason rather than a string.

pub mod fingerprint;

use fingerprint::fingerprint;
use prost::Message;
use std::collections::HashMap;
use xxhash_rust::xxh3::xxh3_64;

#[allow(clippy::all, clippy::pedantic, missing_debug_implementations)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/trellara.v1.rs"));
}

pub use generated::{
    BeforeImage, Boundary, Capture, Change, ColumnSchema, DdlEvent, DdlKind, Envelope,
    LogicalMessage, Operation, RelationSchema, ReplicaIdentity, RowChange, SourceIdentity, Value,
    boundary, capture, change, value,
};

/// The protocol version this crate writes and the only one it reads.
pub const PROTOCOL_VERSION: u32 = 1;

/// Field 13 (`checksum`), wire type 1 (fixed64): `(13 << 3) | 1`.
const CHECKSUM_KEY: u8 = 0x69;
/// Key byte plus the 8-byte checksum.
const CHECKSUM_TRAILER_LEN: usize = 9;

/// Why an envelope was refused. Each variant is one broken rule; the message
/// names the offending value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("unknown envelope protocol version {0}; this build reads version {PROTOCOL_VERSION}")]
    UnknownVersion(u32),
    #[error("envelope checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")]
    ChecksumMismatch { stored: u64, computed: u64 },
    #[error("envelope has no checksum trailer (expected field 13 as its last 9 bytes)")]
    MissingChecksum,
    #[error("envelope bytes are not valid protobuf")]
    Malformed(#[from] prost::DecodeError),
    #[error("envelope has no {0}")]
    MissingField(&'static str),
    #[error("envelope source_id is empty")]
    EmptySourceId,
    #[error("envelope dataset_id is empty")]
    EmptyDatasetId,
    #[error("envelope database is empty")]
    EmptyDatabase,
    #[error("envelope timeline is 0; PostgreSQL timelines start at 1")]
    ZeroTimeline,
    #[error("envelope xid is 0 (InvalidTransactionId)")]
    ZeroXid,
    #[error("envelope begin_lsn is 0 (InvalidXLogRecPtr)")]
    ZeroBeginLsn,
    #[error("commit LSN {commit:#x} is before begin LSN {begin:#x}")]
    CommitBeforeBegin { begin: u64, commit: u64 },
    #[error("end LSN {end:#x} is not after commit LSN {commit:#x}")]
    EndNotAfterCommit { commit: u64, end: u64 },
    #[error("commit timestamp {0} is not after the Unix epoch")]
    InvalidCommitTime(i64),
    #[error("boundary mode is unspecified or unknown ({0})")]
    UnknownBoundaryMode(i32),
    #[error("chunk index {index} >= chunk count {count}")]
    ChunkIndexOutOfRange { index: u32, count: u32 },
    #[error(
        "a whole-transaction envelope must be chunk 0 of 1 starting at sequence 0, got chunk {index} of {count} from sequence {first_sequence}"
    )]
    WholeNotSingleChunk {
        index: u32,
        count: u32,
        first_sequence: u64,
    },
    #[error("changes {first_sequence}..{end} exceed the manifest total of {total_changes}")]
    ChangesExceedManifest {
        first_sequence: u64,
        end: u64,
        total_changes: u64,
    },
    #[error(
        "whole-transaction envelope holds {held} changes but its manifest says {total_changes}"
    )]
    ManifestCountMismatch { held: u64, total_changes: u64 },
    #[error("partition {partition} is not in the manifest partitions {manifest:?}")]
    PartitionNotInManifest { partition: u32, manifest: Vec<u32> },
    #[error("change at index {index} has sequence {found}, expected {expected}")]
    OutOfSequence {
        index: usize,
        expected: u64,
        found: u64,
    },
    #[error("change {sequence} has no body")]
    EmptyChange { sequence: u64 },
    #[error(
        "change {sequence} refers to relation {relation_id}, which is not in the relations list"
    )]
    UnknownRelation { sequence: u64, relation_id: u32 },
    #[error("relation {relation_id} is listed twice")]
    DuplicateRelation { relation_id: u32 },
    #[error("relation {relation_id} has an empty namespace or name")]
    UnnamedRelation { relation_id: u32 },
    #[error(
        "relation {namespace}.{name} carries fingerprint {stored:#018x} but its columns give {computed:#018x}"
    )]
    FingerprintMismatch {
        namespace: String,
        name: String,
        stored: u64,
        computed: u64,
    },
    #[error("change {sequence} has an unspecified or unknown operation ({operation})")]
    UnknownOperation { sequence: u64, operation: i32 },
    #[error(
        "change {sequence} ({operation}): {image} image has {found} values, relation has {expected} columns"
    )]
    ImageWidth {
        sequence: u64,
        operation: &'static str,
        image: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("change {sequence} ({operation}) must not carry a {image} image")]
    UnexpectedImage {
        sequence: u64,
        operation: &'static str,
        image: &'static str,
    },
    #[error(
        "change {sequence}: before-image kind {before_kind} does not match a {found}-value before image"
    )]
    BeforeKindMismatch {
        sequence: u64,
        before_kind: i32,
        found: usize,
    },
    #[error("change {sequence} column {column}: value has no kind")]
    EmptyValue { sequence: u64, column: usize },
    #[error(
        "change {sequence} column {column}: {kind} is not allowed in the {image} image of a {operation}"
    )]
    MisplacedValue {
        sequence: u64,
        column: usize,
        kind: &'static str,
        image: &'static str,
        operation: &'static str,
    },
    #[error("change {sequence}: DDL event kind is unspecified or unknown ({kind})")]
    UnknownDdlKind { sequence: u64, kind: i32 },
    #[error("capture path is unspecified or unknown ({0})")]
    UnknownCapturePath(i32),
}

/// Validates `envelope` and encodes it with its checksum. The `checksum`
/// field of the argument is ignored; the returned bytes carry the right one.
pub fn encode(envelope: &Envelope) -> Result<Vec<u8>, EnvelopeError> {
    let mut buf = Vec::with_capacity(envelope.encoded_len() + CHECKSUM_TRAILER_LEN);
    encode_into(envelope, &mut buf)?;
    Ok(buf)
}

/// Like [`encode`], appending to `buf` so a caller can reuse one allocation.
pub fn encode_into(envelope: &Envelope, buf: &mut Vec<u8>) -> Result<(), EnvelopeError> {
    validate(envelope)?;
    let start = buf.len();
    // Encoding into a Vec cannot run out of space.
    envelope
        .encode(buf)
        .map_err(|_| EnvelopeError::MissingField("buffer capacity"))?;
    if envelope.checksum != 0 {
        // prost writes fields in tag order: a non-zero checksum is the tail.
        buf.truncate(buf.len() - CHECKSUM_TRAILER_LEN);
    }
    let checksum = xxh3_64(&buf[start..]);
    buf.push(CHECKSUM_KEY);
    buf.extend_from_slice(&checksum.to_le_bytes());
    Ok(())
}

/// Verifies the checksum, decodes, and validates.
pub fn decode(bytes: &[u8]) -> Result<Envelope, EnvelopeError> {
    let split = bytes
        .len()
        .checked_sub(CHECKSUM_TRAILER_LEN)
        .ok_or(EnvelopeError::MissingChecksum)?;
    let (body, trailer) = bytes.split_at(split);
    let (key, stored) = trailer
        .split_first()
        .ok_or(EnvelopeError::MissingChecksum)?;
    let stored: [u8; 8] = stored
        .try_into()
        .map_err(|_| EnvelopeError::MissingChecksum)?;
    if *key != CHECKSUM_KEY {
        return Err(EnvelopeError::MissingChecksum);
    }
    let stored = u64::from_le_bytes(stored);
    let computed = xxh3_64(body);
    if stored != computed {
        return Err(EnvelopeError::ChecksumMismatch { stored, computed });
    }
    let envelope = Envelope::decode(bytes)?;
    validate(&envelope)?;
    Ok(envelope)
}

/// Checks every rule of envelope v1 except the checksum (which only exists
/// on the wire).
pub fn validate(envelope: &Envelope) -> Result<(), EnvelopeError> {
    let relations = validate_frame(envelope, envelope.changes.len() as u64)?;
    let first = envelope.boundary.as_ref().map_or(0, |b| b.first_sequence);
    for (index, change) in envelope.changes.iter().enumerate() {
        let expected = first + index as u64;
        if change.sequence != expected {
            return Err(EnvelopeError::OutOfSequence {
                index,
                expected,
                found: change.sequence,
            });
        }
        validate_change(change, |id| relations.get(&id).map(|r| r.columns.len()))?;
    }
    Ok(())
}

/// Every rule but those of the changes, for an envelope that will hold
/// `held` changes; returns its relations by id.
fn validate_frame(
    envelope: &Envelope,
    held: u64,
) -> Result<HashMap<u32, &RelationSchema>, EnvelopeError> {
    use EnvelopeError as E;
    if envelope.protocol_version != PROTOCOL_VERSION {
        return Err(E::UnknownVersion(envelope.protocol_version));
    }
    let source = envelope.source.as_ref().ok_or(E::MissingField("source"))?;
    if source.source_id.is_empty() {
        return Err(E::EmptySourceId);
    }
    if source.dataset_id.is_empty() {
        return Err(E::EmptyDatasetId);
    }
    if source.database.is_empty() {
        return Err(E::EmptyDatabase);
    }
    if source.timeline == 0 {
        return Err(E::ZeroTimeline);
    }
    if envelope.xid == 0 {
        return Err(E::ZeroXid);
    }
    if envelope.begin_lsn == 0 {
        return Err(E::ZeroBeginLsn);
    }
    if envelope.commit_lsn < envelope.begin_lsn {
        return Err(E::CommitBeforeBegin {
            begin: envelope.begin_lsn,
            commit: envelope.commit_lsn,
        });
    }
    if envelope.end_lsn <= envelope.commit_lsn {
        return Err(E::EndNotAfterCommit {
            commit: envelope.commit_lsn,
            end: envelope.end_lsn,
        });
    }
    if envelope.commit_time_micros <= 0 {
        return Err(E::InvalidCommitTime(envelope.commit_time_micros));
    }
    let capture = envelope
        .capture
        .as_ref()
        .ok_or(E::MissingField("capture"))?;
    if !matches!(
        capture::Path::try_from(capture.path),
        Ok(capture::Path::Native | capture::Path::External)
    ) {
        return Err(E::UnknownCapturePath(capture.path));
    }
    let boundary = envelope
        .boundary
        .as_ref()
        .ok_or(E::MissingField("boundary"))?;
    validate_boundary(boundary, held)?;

    let mut relations = HashMap::with_capacity(envelope.relations.len());
    for relation in &envelope.relations {
        if relations.insert(relation.relation_id, relation).is_some() {
            return Err(E::DuplicateRelation {
                relation_id: relation.relation_id,
            });
        }
        if relation.namespace.is_empty() || relation.name.is_empty() {
            return Err(E::UnnamedRelation {
                relation_id: relation.relation_id,
            });
        }
        let computed = fingerprint(relation);
        if computed != relation.fingerprint {
            return Err(E::FingerprintMismatch {
                namespace: relation.namespace.clone(),
                name: relation.name.clone(),
                stored: relation.fingerprint,
                computed,
            });
        }
    }
    Ok(relations)
}

/// The rules of one change (its sequence aside); `width` gives the column
/// count of a relation the envelope carries, `None` for one it does not.
pub fn validate_change(
    change: &Change,
    width: impl Fn(u32) -> Option<usize>,
) -> Result<(), EnvelopeError> {
    use EnvelopeError as E;
    let sequence = change.sequence;
    match &change.body {
        None => Err(E::EmptyChange { sequence }),
        Some(change::Body::Row(row)) => {
            let width = width(row.relation_id).ok_or(E::UnknownRelation {
                sequence,
                relation_id: row.relation_id,
            })?;
            validate_row(sequence, row, width)
        }
        Some(change::Body::Ddl(ddl)) => {
            if matches!(DdlKind::try_from(ddl.kind), Ok(k) if k != DdlKind::Unspecified) {
                Ok(())
            } else {
                Err(E::UnknownDdlKind {
                    sequence,
                    kind: ddl.kind,
                })
            }
        }
        Some(change::Body::Message(_)) => Ok(()),
    }
}

/// Builds an envelope's bytes from its changes already encoded, one
/// `Change` each (their sequences set): the same bytes [`encode`] writes
/// for the whole envelope, without decoding and re-encoding every change.
/// The frame (every rule but those of the changes) is validated up front;
/// each change must have passed [`validate_change`] when it was encoded,
/// and [`RawEnvelope::finish`] checks that `held` of them came.
#[derive(Debug)]
pub struct RawEnvelope {
    buf: Vec<u8>,
    tail: Vec<u8>,
    held: u64,
    pushed: u64,
    next_sequence: u64,
}

impl RawEnvelope {
    /// `frame` holds every field but `changes`; `held` is how many follow.
    pub fn new(mut frame: Envelope, held: u64) -> Result<RawEnvelope, EnvelopeError> {
        validate_frame(&frame, held)?;
        let next_sequence = frame.boundary.as_ref().map_or(0, |b| b.first_sequence);
        // prost writes fields in tag order: 1-8 precede `changes` (9),
        // 10-12 follow it.
        let tail = Envelope {
            boundary: frame.boundary.take(),
            origin: std::mem::take(&mut frame.origin),
            capture: frame.capture.take(),
            ..Envelope::default()
        };
        frame.changes.clear();
        frame.checksum = 0;
        Ok(RawEnvelope {
            buf: frame.encode_to_vec(),
            tail: tail.encode_to_vec(),
            held,
            pushed: 0,
            next_sequence,
        })
    }

    /// Makes room, once, for `changes` encoded changes of at most `bytes`
    /// in all: a chunk holding one wide value is then built without growing
    /// (and doubling) its buffer change by change.
    pub fn reserve(&mut self, changes: u64, bytes: u64) {
        // Each change adds its key (1 byte) and length (at most 10).
        let more = bytes as usize + 11 * changes as usize + self.tail.len() + 9;
        self.buf.reserve_exact(more);
    }

    /// Appends one encoded `Change`; its sequence must be the next one.
    pub fn push(&mut self, change: &[u8]) -> Result<(), EnvelopeError> {
        // prost writes `sequence` (field 1, varint: key 0x08) first, and
        // omits it when 0.
        let sequence = match change.split_first() {
            Some((0x08, mut rest)) => prost::encoding::decode_varint(&mut rest)?,
            _ => 0,
        };
        if sequence != self.next_sequence {
            return Err(EnvelopeError::OutOfSequence {
                index: self.pushed as usize,
                expected: self.next_sequence,
                found: sequence,
            });
        }
        prost::encoding::encode_key(9, prost::encoding::WireType::LengthDelimited, &mut self.buf);
        prost::encoding::encode_varint(change.len() as u64, &mut self.buf);
        self.buf.extend_from_slice(change);
        self.pushed += 1;
        self.next_sequence += 1;
        Ok(())
    }

    /// The envelope's bytes, checksum last.
    pub fn finish(mut self) -> Result<Vec<u8>, EnvelopeError> {
        if self.pushed != self.held {
            return Err(EnvelopeError::ManifestCountMismatch {
                held: self.pushed,
                total_changes: self.held,
            });
        }
        self.buf.extend_from_slice(&self.tail);
        let checksum = xxh3_64(&self.buf);
        self.buf.push(CHECKSUM_KEY);
        self.buf.extend_from_slice(&checksum.to_le_bytes());
        Ok(self.buf)
    }
}

fn validate_boundary(boundary: &Boundary, held: u64) -> Result<(), EnvelopeError> {
    use EnvelopeError as E;
    let mode = match boundary::Mode::try_from(boundary.mode) {
        Ok(boundary::Mode::Unspecified) | Err(_) => {
            return Err(E::UnknownBoundaryMode(boundary.mode));
        }
        Ok(mode) => mode,
    };
    if boundary.chunk_index >= boundary.chunk_count {
        return Err(E::ChunkIndexOutOfRange {
            index: boundary.chunk_index,
            count: boundary.chunk_count,
        });
    }
    let end = boundary.first_sequence.saturating_add(held);
    if end > boundary.total_changes {
        return Err(E::ChangesExceedManifest {
            first_sequence: boundary.first_sequence,
            end,
            total_changes: boundary.total_changes,
        });
    }
    match mode {
        boundary::Mode::Whole => {
            if boundary.chunk_count != 1 || boundary.first_sequence != 0 {
                return Err(E::WholeNotSingleChunk {
                    index: boundary.chunk_index,
                    count: boundary.chunk_count,
                    first_sequence: boundary.first_sequence,
                });
            }
            if held != boundary.total_changes {
                return Err(E::ManifestCountMismatch {
                    held,
                    total_changes: boundary.total_changes,
                });
            }
        }
        boundary::Mode::Partitioned => {
            if !boundary.manifest_partitions.contains(&boundary.partition) {
                return Err(E::PartitionNotInManifest {
                    partition: boundary.partition,
                    manifest: boundary.manifest_partitions.clone(),
                });
            }
        }
        boundary::Mode::Chunked | boundary::Mode::Unspecified => {}
    }
    Ok(())
}

/// Which images an operation carries, and which value kinds each may hold.
fn validate_row(sequence: u64, row: &RowChange, width: usize) -> Result<(), EnvelopeError> {
    use EnvelopeError as E;
    let operation = match Operation::try_from(row.operation) {
        Ok(Operation::Insert) => "insert",
        Ok(Operation::Update) => "update",
        Ok(Operation::Delete) => "delete",
        Ok(Operation::Truncate) => "truncate",
        Ok(Operation::Unspecified) | Err(_) => {
            return Err(E::UnknownOperation {
                sequence,
                operation: row.operation,
            });
        }
    };
    let before_required = operation == "delete";
    let before_allowed = matches!(operation, "update" | "delete");
    let after_required = matches!(operation, "insert" | "update");

    let image_width = |image: &'static str, values: &[Value], required: bool, allowed: bool| {
        if values.is_empty() && !required {
            return Ok(());
        }
        if !allowed {
            return Err(E::UnexpectedImage {
                sequence,
                operation,
                image,
            });
        }
        if values.len() != width {
            return Err(E::ImageWidth {
                sequence,
                operation,
                image,
                expected: width,
                found: values.len(),
            });
        }
        Ok(())
    };
    image_width("before", &row.before, before_required, before_allowed)?;
    image_width("after", &row.after, after_required, after_required)?;

    let kind_matches = match BeforeImage::try_from(row.before_kind) {
        Ok(BeforeImage::None) => row.before.is_empty(),
        Ok(BeforeImage::Key | BeforeImage::Full) => !row.before.is_empty(),
        Err(_) => false,
    };
    if !kind_matches {
        return Err(E::BeforeKindMismatch {
            sequence,
            before_kind: row.before_kind,
            found: row.before.len(),
        });
    }
    let key_only = row.before_kind == BeforeImage::Key as i32;
    for (image, values) in [("before", &row.before), ("after", &row.after)] {
        for (column, value) in values.iter().enumerate() {
            let kind = match &value.kind {
                None => return Err(E::EmptyValue { sequence, column }),
                Some(value::Kind::UnchangedToast(_)) => "unchanged_toast",
                Some(value::Kind::Absent(_)) => "absent",
                Some(_) => continue,
            };
            // Unchanged TOAST only makes sense for a new image that keeps an
            // old value; "absent" only for a key-only old image.
            let allowed = match kind {
                "unchanged_toast" => image == "after" && operation == "update",
                _ => image == "before" && key_only,
            };
            if !allowed {
                return Err(E::MisplacedValue {
                    sequence,
                    column,
                    kind,
                    image,
                    operation,
                });
            }
        }
    }
    Ok(())
}
