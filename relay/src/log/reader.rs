//! Reading records by offset.
//!
//! Invariants:
//! * A reader yields only records below its [`Horizon`] (the durable
//!   watermark, or the written end for a consumer that waits for
//!   durability before it commits), in offset order, each
//!   checksum-verified; a bad frame is [`Error::Corrupt`] naming the
//!   segment and byte, after which the reader yields nothing more.
//! * Seeking uses the sparse index only as a hint: the frame it points at
//!   must carry the expected offset, else the reader falls back to scanning
//!   the segment from its header.

use std::sync::Arc;

use super::Shared;
use super::error::Error;
use super::frame::{Corruption, SEGMENT_HEADER_LEN};
use super::index::IndexEntry;
use super::segment::{FrameFault, FrameReader, Segment};
use super::storage::Storage;

/// One record read back from the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub offset: u64,
    pub commit_lsn: u64,
    pub payload: Vec<u8>,
}

/// How far a reader reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Horizon {
    /// Durable records only ([`super::Log::read_from`]).
    Durable,
    /// Written records, durable or not ([`super::Log::read_written_from`]).
    Written,
}

/// An iterator over records up to a [`Horizon`].
pub struct Reader<S: Storage> {
    shared: Arc<Shared<S>>,
    horizon: Horizon,
    next: u64,
    at: Option<Cursor<S::File>>,
    failed: bool,
}

impl<S: Storage> std::fmt::Debug for Reader<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("next", &self.next)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

/// Where in which segment the next frame starts.
struct Cursor<F> {
    segment: Arc<Segment<F>>,
    pos: u64,
    frames: FrameReader<F>,
}

impl<S: Storage> Reader<S> {
    pub(crate) fn new(shared: Arc<Shared<S>>, offset: u64, horizon: Horizon) -> Self {
        Reader {
            shared,
            horizon,
            next: offset,
            at: None,
            failed: false,
        }
    }

    /// The offset of the next record this reader will yield.
    pub fn next_offset(&self) -> u64 {
        self.next
    }

    fn seek(&self) -> Result<Cursor<S::File>, Error> {
        let segment = {
            let segments = self.shared.segments();
            let first = segments.first().map_or(0, |s| s.base);
            if self.next < first {
                return Err(Error::OffsetTruncated {
                    requested: self.next,
                    first,
                });
            }
            let i = segments.partition_point(|s| s.base <= self.next);
            let found = i.checked_sub(1).and_then(|i| segments.get(i)).cloned();
            found.ok_or(Error::OffsetTruncated {
                requested: self.next,
                first,
            })?
        };
        let start = IndexEntry {
            offset: segment.base,
            pos: SEGMENT_HEADER_LEN as u64,
        };
        let hint = segment.index().lookup(self.next).unwrap_or(start);
        match self.walk(&segment, hint) {
            Ok(cursor) => Ok(cursor),
            // The index is a cache: if it led astray, trust the segment.
            Err(_) if hint != start => self
                .walk(&segment, start)
                .map_err(|(fault, pos)| fault.at(&segment.path, pos)),
            Err((fault, pos)) => Err(fault.at(&segment.path, pos)),
        }
    }

    /// Steps frame headers from `from` to the frame of `self.next`, checking
    /// that every header on the way (the target's included) carries the
    /// offset the walk expects.
    fn walk(
        &self,
        segment: &Arc<Segment<S::File>>,
        from: IndexEntry,
    ) -> Result<Cursor<S::File>, (FrameFault, u64)> {
        let mut frames = FrameReader::new(
            Arc::clone(&segment.file),
            self.shared.config.read_buffer_bytes,
        );
        let limit = segment.len();
        let (mut offset, mut pos) = (from.offset, from.pos);
        loop {
            let header = frames.header(pos, limit).map_err(|f| (f, pos))?;
            if header.offset != offset {
                let reason = Corruption::OffsetMismatch {
                    expected: offset,
                    found: header.offset,
                };
                return Err((reason.into(), pos));
            }
            if offset >= self.next {
                break;
            }
            pos += header.frame_len();
            offset += 1;
        }
        Ok(Cursor {
            segment: Arc::clone(segment),
            pos,
            frames,
        })
    }

    fn read_one(&mut self) -> Result<Record, Error> {
        let exhausted = self.at.as_ref().is_none_or(|c| c.pos >= c.segment.len());
        if exhausted {
            self.at = Some(self.seek()?);
        }
        let Some(cursor) = self.at.as_mut() else {
            return Err(Error::OffsetTruncated {
                requested: self.next,
                first: self.shared.first_offset(),
            });
        };
        let limit = cursor.segment.len();
        let pos = cursor.pos;
        let path = &cursor.segment.path;
        let header = cursor
            .frames
            .header(pos, limit)
            .map_err(|f| f.at(path, pos))?;
        if header.offset != self.next {
            return Err(Error::Corrupt {
                path: path.clone(),
                pos,
                reason: Corruption::OffsetMismatch {
                    expected: self.next,
                    found: header.offset,
                },
            });
        }
        let mut payload = Vec::new();
        cursor
            .frames
            .payload(&header, pos, limit, &mut payload)
            .map_err(|f| f.at(path, pos))?;
        cursor.pos += header.frame_len();
        self.next += 1;
        Ok(Record {
            offset: header.offset,
            commit_lsn: header.commit_lsn,
            payload,
        })
    }
}

impl<S: Storage> Iterator for Reader<S> {
    type Item = Result<Record, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.next >= self.shared.end(self.horizon) {
            return None;
        }
        let record = self.read_one();
        self.failed = record.is_err();
        Some(record)
    }
}
