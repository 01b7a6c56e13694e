//! The sparse offset index: every ~`interval` bytes of a segment, one entry
//! mapping a record offset to the byte position of its frame.
//!
//! Invariants:
//! * The index is a cache. It is rebuilt from the segment when its file is
//!   missing, fails its checksum or disagrees with the segment's length or
//!   neighbours, and a reader that seeks with it checks the frame it lands on
//!   (magic, checksum-independent header fields, offset) before trusting it.
//! * Entries are strictly increasing in both offset and position; the first
//!   record of a segment always has an entry.
//! * Index files are written only for sealed segments and never fsynced:
//!   losing one costs a rescan, never data.

use super::frame::{CHECKSUM_SEED, Corruption, FORMAT_VERSION, SEGMENT_HEADER_LEN};

/// `TRLI`: first bytes of an index file.
pub const INDEX_MAGIC: [u8; 4] = *b"TRLI";
/// Bytes before the first entry of an index file.
pub const INDEX_HEADER_LEN: usize = 48;
/// Bytes per index entry (offset u64, position u64).
pub const INDEX_ENTRY_LEN: usize = 16;

const FLAG_HAS_LAST_LSN: u16 = 1;

/// One index entry: the frame of record `offset` starts at byte `pos`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IndexEntry {
    pub offset: u64,
    pub pos: u64,
}

/// The in-memory sparse index of one segment.
#[derive(Clone, Debug)]
pub(crate) struct SparseIndex {
    interval: u64,
    entries: Vec<IndexEntry>,
    /// Every one of the last [`RECENT`] frames, never written to the index
    /// file: a consumer keeping up with the writer seeks straight to the
    /// record it needs instead of walking up to `interval` bytes of headers.
    recent: std::collections::VecDeque<IndexEntry>,
}

/// Frames [`SparseIndex`] remembers exactly.
const RECENT: usize = 64;

impl SparseIndex {
    pub fn new(interval: u64) -> Self {
        SparseIndex {
            interval: interval.max(1),
            entries: Vec::new(),
            recent: std::collections::VecDeque::with_capacity(RECENT),
        }
    }

    /// Notes that record `offset` was written at `pos`; keeps it if it is the
    /// segment's first or at least `interval` bytes past the last entry.
    pub fn observe(&mut self, offset: u64, pos: u64) {
        let due = self
            .entries
            .last()
            .is_none_or(|last| pos >= last.pos + self.interval && offset > last.offset);
        if due {
            self.entries.push(IndexEntry { offset, pos });
        }
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(IndexEntry { offset, pos });
    }

    /// The entry with the greatest offset not above `offset`.
    pub fn lookup(&self, offset: u64) -> Option<IndexEntry> {
        let sparse = (self.entries.partition_point(|e| e.offset <= offset))
            .checked_sub(1)
            .and_then(|i| self.entries.get(i));
        let recent = (self.recent.partition_point(|e| e.offset <= offset))
            .checked_sub(1)
            .and_then(|i| self.recent.get(i));
        sparse
            .into_iter()
            .chain(recent)
            .max_by_key(|e| e.offset)
            .copied()
    }
}

/// What an index file records about its sealed segment, checked against the
/// segment before the index is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SealedSummary {
    /// One past the last record of the segment.
    pub next_offset: u64,
    /// Segment file length in bytes.
    pub segment_len: u64,
    /// Commit LSN of the segment's last record, if it has any.
    pub last_commit_lsn: Option<u64>,
}

/// Serialises an index file (layout in `docs/LOG_FORMAT.md`).
pub(crate) fn encode(base_offset: u64, summary: &SealedSummary, index: &SparseIndex) -> Vec<u8> {
    let mut out = Vec::with_capacity(INDEX_HEADER_LEN + index.entries.len() * INDEX_ENTRY_LEN + 8);
    let flags = if summary.last_commit_lsn.is_some() {
        FLAG_HAS_LAST_LSN
    } else {
        0
    };
    out.extend_from_slice(&INDEX_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&base_offset.to_le_bytes());
    out.extend_from_slice(&summary.next_offset.to_le_bytes());
    out.extend_from_slice(&summary.segment_len.to_le_bytes());
    out.extend_from_slice(&summary.last_commit_lsn.unwrap_or(0).to_le_bytes());
    let count = u32::try_from(index.entries.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for entry in index.entries.iter().take(count as usize) {
        out.extend_from_slice(&entry.offset.to_le_bytes());
        out.extend_from_slice(&entry.pos.to_le_bytes());
    }
    let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&out, CHECKSUM_SEED);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

fn le_u16(bytes: &[u8], at: usize) -> Result<u16, Corruption> {
    bytes
        .get(at..at + 2)
        .and_then(|b| b.try_into().ok())
        .map(u16::from_le_bytes)
        .ok_or(Corruption::Truncated {
            needed: (at + 2) as u64,
            available: bytes.len() as u64,
        })
}

fn le_u32(bytes: &[u8], at: usize) -> Result<u32, Corruption> {
    bytes
        .get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(Corruption::Truncated {
            needed: (at + 4) as u64,
            available: bytes.len() as u64,
        })
}

fn le_u64(bytes: &[u8], at: usize) -> Result<u64, Corruption> {
    bytes
        .get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or(Corruption::Truncated {
            needed: (at + 8) as u64,
            available: bytes.len() as u64,
        })
}

/// Parses and fully validates an index file for the segment starting at
/// `base_offset`. Any failure means "rebuild", never "trust partially".
pub(crate) fn decode(
    bytes: &[u8],
    base_offset: u64,
    interval: u64,
) -> Result<(SealedSummary, SparseIndex), Corruption> {
    let body_len = bytes.len().checked_sub(8).ok_or(Corruption::Truncated {
        needed: (INDEX_HEADER_LEN + 8) as u64,
        available: bytes.len() as u64,
    })?;
    let body = bytes.get(..body_len).unwrap_or_default();
    let stored = le_u64(bytes, body_len)?;
    let magic = body.get(..4).unwrap_or_default();
    if magic != INDEX_MAGIC {
        let mut found = [0u8; 4];
        for (dst, src) in found.iter_mut().zip(magic) {
            *dst = *src;
        }
        return Err(Corruption::BadMagic { found });
    }
    let computed = xxhash_rust::xxh3::xxh3_64_with_seed(body, CHECKSUM_SEED);
    if stored != computed {
        return Err(Corruption::ChecksumMismatch { stored, computed });
    }
    let version = le_u16(body, 4)?;
    if version != FORMAT_VERSION {
        return Err(Corruption::UnsupportedVersion(version));
    }
    let flags = le_u16(body, 6)?;
    if flags & !FLAG_HAS_LAST_LSN != 0 {
        return Err(Corruption::UnknownFlags(flags));
    }
    let found_base = le_u64(body, 8)?;
    if found_base != base_offset {
        return Err(Corruption::BaseMismatch {
            expected: base_offset,
            found: found_base,
        });
    }
    let summary = SealedSummary {
        next_offset: le_u64(body, 16)?,
        segment_len: le_u64(body, 24)?,
        last_commit_lsn: (flags & FLAG_HAS_LAST_LSN != 0)
            .then(|| le_u64(body, 32))
            .transpose()?,
    };
    let count = le_u32(body, 40)? as usize;
    let expected_len = INDEX_HEADER_LEN + count * INDEX_ENTRY_LEN;
    if body.len() != expected_len {
        return Err(Corruption::Truncated {
            needed: expected_len as u64,
            available: body.len() as u64,
        });
    }
    let mut index = SparseIndex::new(interval);
    let mut previous: Option<IndexEntry> = None;
    for i in 0..count {
        let at = INDEX_HEADER_LEN + i * INDEX_ENTRY_LEN;
        let entry = IndexEntry {
            offset: le_u64(body, at)?,
            pos: le_u64(body, at + 8)?,
        };
        let ordered = match previous {
            None => entry.offset == base_offset && entry.pos == SEGMENT_HEADER_LEN as u64,
            Some(p) => entry.offset > p.offset && entry.pos > p.pos,
        };
        if !ordered || entry.offset >= summary.next_offset || entry.pos >= summary.segment_len {
            return Err(Corruption::OffsetMismatch {
                expected: previous.map_or(base_offset, |p| p.offset + 1),
                found: entry.offset,
            });
        }
        index.entries.push(entry);
        previous = Some(entry);
    }
    let has_records = summary.next_offset > base_offset;
    if has_records != (count > 0) || has_records != summary.last_commit_lsn.is_some() {
        return Err(Corruption::OffsetMismatch {
            expected: base_offset,
            found: summary.next_offset,
        });
    }
    Ok((summary, index))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn sample() -> (SealedSummary, SparseIndex) {
        let mut index = SparseIndex::new(100);
        let mut pos = SEGMENT_HEADER_LEN as u64;
        for offset in 10..40 {
            index.observe(offset, pos);
            pos += 45;
        }
        let summary = SealedSummary {
            next_offset: 40,
            segment_len: pos,
            last_commit_lsn: Some(99),
        };
        (summary, index)
    }

    #[test]
    fn observe_keeps_first_and_every_interval() {
        let (_, index) = sample();
        assert_eq!(
            index.entries.first(),
            Some(&IndexEntry {
                offset: 10,
                pos: 32
            })
        );
        assert!(index.entries.len() > 1 && index.entries.len() < 30);
        for pair in index.entries.windows(2) {
            assert!(pair[1].pos - pair[0].pos >= 100);
        }
        assert_eq!(index.lookup(9), None);
        assert_eq!(index.lookup(10).unwrap().offset, 10);
        let hit = index.lookup(25).unwrap();
        assert!(hit.offset <= 25);
    }

    #[test]
    fn the_last_frames_are_found_exactly_and_not_written() {
        let mut index = SparseIndex::new(1 << 20);
        let pos = |offset: u64| SEGMENT_HEADER_LEN as u64 + offset * 45;
        for offset in 0..200 {
            index.observe(offset, pos(offset));
        }
        for offset in 200 - RECENT as u64..200 {
            let hit = index.lookup(offset).unwrap();
            assert_eq!((hit.offset, hit.pos), (offset, pos(offset)));
        }
        assert_eq!(index.lookup(500).unwrap().offset, 199);
        // Older ones fall back to the sparse entries (here only the first).
        assert_eq!(index.lookup(100).unwrap().offset, 0);
        let summary = SealedSummary {
            next_offset: 200,
            segment_len: pos(200),
            last_commit_lsn: Some(1),
        };
        let (_, decoded) = decode(&encode(0, &summary, &index), 0, 1 << 20).unwrap();
        assert_eq!(
            decoded.entries.len(),
            1,
            "the file holds the sparse entries only"
        );
    }

    #[test]
    fn round_trip() {
        let (summary, index) = sample();
        let bytes = encode(10, &summary, &index);
        let (s, i) = decode(&bytes, 10, 100).unwrap();
        assert_eq!(s, summary);
        assert_eq!(i.entries, index.entries);
    }

    #[test]
    fn any_flip_or_cut_is_rejected() {
        let (summary, index) = sample();
        let bytes = encode(10, &summary, &index);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x04;
            assert!(decode(&bad, 10, 100).is_err(), "flip at {i}");
            assert!(decode(&bytes[..i], 10, 100).is_err(), "cut at {i}");
        }
        assert!(matches!(
            decode(&bytes, 11, 100),
            Err(Corruption::BaseMismatch { .. })
        ));
    }
}
