//! Segment files: naming, the open-segment handle shared by the writer and
//! readers, and the bounded, panic-free frame reader used by recovery and by
//! [`super::Reader`].
//!
//! Invariants:
//! * A segment is named after its base offset, zero-padded to 20 digits
//!   (`00000000000000000042.seg`), so lexical order is log order.
//! * `Segment::len` covers only complete frames the writer finished; bytes
//!   inside it are never rewritten, so readers may cache them.
//! * Lengths read from disk are checked against the bytes present before any
//!   buffer is sized by them.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::error::Error;
use super::frame::{Corruption, FRAME_HEADER_LEN, FRAME_MAGIC, FrameHeader, SEGMENT_HEADER_LEN};
use super::index::SparseIndex;
use super::storage::StorageFile;

const SEGMENT_SUFFIX: &str = ".seg";
const INDEX_SUFFIX: &str = ".idx";
const NAME_DIGITS: usize = 20;

pub(crate) fn segment_name(base: u64) -> String {
    format!("{base:020}{SEGMENT_SUFFIX}")
}

pub(crate) fn index_name(base: u64) -> String {
    format!("{base:020}{INDEX_SUFFIX}")
}

fn parse_name(name: &str, suffix: &str) -> Option<u64> {
    let digits = name.strip_suffix(suffix)?;
    if digits.len() != NAME_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The base offset of a segment file name, if it is one.
pub(crate) fn parse_segment_name(name: &str) -> Option<u64> {
    parse_name(name, SEGMENT_SUFFIX)
}

/// The base offset of an index file name, if it is one.
pub(crate) fn parse_index_name(name: &str) -> Option<u64> {
    parse_name(name, INDEX_SUFFIX)
}

/// An open segment.
#[derive(Debug)]
pub(crate) struct Segment<F> {
    pub base: u64,
    pub path: PathBuf,
    pub index_path: PathBuf,
    pub file: Arc<F>,
    pub created_unix_ms: u64,
    len: AtomicU64,
    index: RwLock<SparseIndex>,
}

impl<F: StorageFile> Segment<F> {
    pub fn new(
        dir: &Path,
        base: u64,
        file: Arc<F>,
        created_unix_ms: u64,
        len: u64,
        index: SparseIndex,
    ) -> Self {
        Segment {
            base,
            path: dir.join(segment_name(base)),
            index_path: dir.join(index_name(base)),
            file,
            created_unix_ms,
            len: AtomicU64::new(len),
            index: RwLock::new(index),
        }
    }

    /// Bytes of header plus complete frames.
    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }

    pub fn set_len(&self, len: u64) {
        self.len.store(len, Ordering::Release);
    }

    pub fn index(&self) -> RwLockReadGuard<'_, SparseIndex> {
        // The index is a cache rebuilt from the segment, and every update is
        // a single push; a poisoned lock still guards a usable value.
        self.index.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn index_mut(&self) -> RwLockWriteGuard<'_, SparseIndex> {
        self.index.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum FrameFault {
    Io(io::Error),
    Corrupt(Corruption),
}

impl From<Corruption> for FrameFault {
    fn from(c: Corruption) -> Self {
        FrameFault::Corrupt(c)
    }
}

impl FrameFault {
    /// The log error for this fault at byte `pos` of `path`.
    pub fn at(self, path: &Path, pos: u64) -> Error {
        match self {
            FrameFault::Io(source) => Error::Io {
                op: "read",
                path: path.to_path_buf(),
                source,
            },
            FrameFault::Corrupt(reason) => Error::Corrupt {
                path: path.to_path_buf(),
                pos,
                reason,
            },
        }
    }
}

/// Reads frames through a read-ahead buffer of `chunk` bytes.
#[derive(Debug)]
pub(crate) struct FrameReader<F> {
    file: Arc<F>,
    chunk: usize,
    buf: Vec<u8>,
    buf_pos: u64,
}

impl<F: StorageFile> FrameReader<F> {
    pub fn new(file: Arc<F>, chunk: usize) -> Self {
        FrameReader {
            file,
            chunk: chunk.max(FRAME_HEADER_LEN),
            buf: Vec::new(),
            buf_pos: 0,
        }
    }

    /// Up to `len` bytes at `pos` (fewer only if `limit` or the file ends
    /// first); `len` must not exceed the chunk size.
    fn window(&mut self, pos: u64, len: usize, limit: u64) -> Result<&[u8], FrameFault> {
        let buf_end = self.buf_pos + self.buf.len() as u64;
        if pos < self.buf_pos || pos + len as u64 > buf_end {
            let want = usize::try_from(limit.saturating_sub(pos))
                .unwrap_or(usize::MAX)
                .min(self.chunk);
            self.buf.resize(want, 0);
            let mut filled = 0;
            while filled < want {
                let dst = self.buf.get_mut(filled..).unwrap_or_default();
                match self.file.read_at(dst, pos + filled as u64) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                    Err(err) => {
                        self.buf.clear();
                        return Err(FrameFault::Io(err));
                    }
                }
            }
            self.buf.truncate(filled);
            self.buf_pos = pos;
        }
        let start = usize::try_from(pos - self.buf_pos).unwrap_or(usize::MAX);
        let available = self.buf.get(start..).unwrap_or_default();
        Ok(available.get(..len).unwrap_or(available))
    }

    /// The header of the frame at `pos`, checked to lie wholly below `limit`.
    pub fn header(&mut self, pos: u64, limit: u64) -> Result<FrameHeader, FrameFault> {
        let bytes = self.window(pos, FRAME_HEADER_LEN, limit)?;
        if bytes.len() < FRAME_HEADER_LEN {
            return Err(Corruption::Truncated {
                needed: FRAME_HEADER_LEN as u64,
                available: bytes.len() as u64,
            }
            .into());
        }
        let header = FrameHeader::decode(bytes)?;
        let available = limit.saturating_sub(pos);
        if header.frame_len() > available {
            return Err(Corruption::Truncated {
                needed: header.frame_len(),
                available,
            }
            .into());
        }
        Ok(header)
    }

    /// Reads the payload of the frame at `pos` into `out` and verifies it.
    pub fn payload(
        &mut self,
        header: &FrameHeader,
        pos: u64,
        limit: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), FrameFault> {
        let len = header.payload_len as usize;
        let at = pos + FRAME_HEADER_LEN as u64;
        out.clear();
        if len <= self.chunk {
            let bytes = self.window(at, len, limit)?;
            if bytes.len() < len {
                return Err(Corruption::Truncated {
                    needed: len as u64,
                    available: bytes.len() as u64,
                }
                .into());
            }
            out.extend_from_slice(bytes);
        } else {
            out.resize(len, 0);
            self.file.read_exact_at(out, at).map_err(FrameFault::Io)?;
        }
        header.verify(out)?;
        Ok(())
    }

    /// Verifies the frame at `pos` without keeping its payload, reading at
    /// most one chunk at a time.
    pub fn verify(&mut self, header: &FrameHeader, pos: u64, limit: u64) -> Result<(), FrameFault> {
        let mut hasher = FrameHeader::hasher(header.payload_len, header.offset, header.commit_lsn);
        let mut at = pos + FRAME_HEADER_LEN as u64;
        let end = at + u64::from(header.payload_len);
        while at < end {
            let step = usize::try_from(end - at)
                .unwrap_or(usize::MAX)
                .min(self.chunk);
            let bytes = self.window(at, step, limit)?;
            if bytes.is_empty() {
                return Err(Corruption::Truncated {
                    needed: end - at,
                    available: 0,
                }
                .into());
            }
            hasher.update(bytes);
            at += bytes.len() as u64;
        }
        let computed = hasher.digest();
        if computed != header.checksum {
            return Err(Corruption::ChecksumMismatch {
                stored: header.checksum,
                computed,
            }
            .into());
        }
        Ok(())
    }
}

/// Result of scanning a segment's frames from its header to the first byte
/// that is not a valid frame.
#[derive(Debug)]
pub(crate) struct Scan {
    pub next_offset: u64,
    /// End of the last valid frame.
    pub valid_len: u64,
    pub last_commit_lsn: Option<u64>,
    pub index: SparseIndex,
    /// Where and why the scan stopped before the end of the file.
    pub stop: Option<(u64, Corruption)>,
}

/// Scans (and checksums) every frame of `file` from the segment header on.
pub(crate) fn scan<F: StorageFile>(
    file: &Arc<F>,
    path: &Path,
    base: u64,
    file_len: u64,
    index_interval: u64,
    chunk: usize,
) -> Result<Scan, Error> {
    let mut reader = FrameReader::new(Arc::clone(file), chunk);
    let mut scan = Scan {
        next_offset: base,
        valid_len: SEGMENT_HEADER_LEN as u64,
        last_commit_lsn: None,
        index: SparseIndex::new(index_interval),
        stop: None,
    };
    let mut pos = SEGMENT_HEADER_LEN as u64;
    while pos < file_len {
        let step = reader.header(pos, file_len).and_then(|header| {
            reader.verify(&header, pos, file_len)?;
            if header.offset != scan.next_offset {
                return Err(Corruption::OffsetMismatch {
                    expected: scan.next_offset,
                    found: header.offset,
                }
                .into());
            }
            Ok(header)
        });
        match step {
            Ok(header) => {
                scan.index.observe(header.offset, pos);
                scan.next_offset += 1;
                scan.last_commit_lsn = Some(header.commit_lsn);
                pos += header.frame_len();
                scan.valid_len = pos;
            }
            Err(FrameFault::Corrupt(reason)) => {
                scan.stop = Some((pos, reason));
                break;
            }
            Err(fault @ FrameFault::Io(_)) => return Err(fault.at(path, pos)),
        }
    }
    Ok(scan)
}

/// The position of the first valid frame with offset `>= min_offset` that
/// starts after `from`, if any. Used to tell a torn tail (nothing valid
/// follows) from corruption in the middle of the log (something does).
pub(crate) fn find_valid_frame_after<F: StorageFile>(
    file: &Arc<F>,
    path: &Path,
    from: u64,
    file_len: u64,
    min_offset: u64,
    chunk: usize,
) -> Result<Option<u64>, Error> {
    let mut probe = FrameReader::new(Arc::clone(file), chunk);
    let mut chunk_buf = vec![0u8; chunk.max(FRAME_HEADER_LEN)];
    let mut start = from + 1;
    while start + (FRAME_MAGIC.len() as u64) <= file_len {
        let want = usize::try_from(file_len - start)
            .unwrap_or(usize::MAX)
            .min(chunk_buf.len());
        let window = chunk_buf.get_mut(..want).unwrap_or_default();
        file.read_exact_at(window, start)
            .map_err(Error::io("read", path))?;
        for (i, candidate) in window.windows(FRAME_MAGIC.len()).enumerate() {
            if candidate != FRAME_MAGIC {
                continue;
            }
            let pos = start + i as u64;
            let valid = probe
                .header(pos, file_len)
                .and_then(|h| probe.verify(&h, pos, file_len).map(|()| h));
            match valid {
                Ok(h) if h.offset >= min_offset => return Ok(Some(pos)),
                Ok(_) | Err(FrameFault::Corrupt(_)) => {}
                Err(fault @ FrameFault::Io(_)) => return Err(fault.at(path, pos)),
            }
        }
        // Overlap by magic-1 bytes so a magic split across chunks is seen.
        start += (want.saturating_sub(FRAME_MAGIC.len() - 1)).max(1) as u64;
    }
    Ok(None)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn names_sort_in_log_order_and_parse_back() {
        let names: Vec<String> = [0u64, 9, 10, 1_000_000, u64::MAX]
            .iter()
            .map(|b| segment_name(*b))
            .collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted);
        assert_eq!(names[0], "00000000000000000000.seg");
        for (name, base) in names.iter().zip([0u64, 9, 10, 1_000_000, u64::MAX]) {
            assert_eq!(parse_segment_name(name), Some(base));
        }
        assert_eq!(parse_index_name(&index_name(42)), Some(42));
        for bad in [
            "1.seg",
            "0000000000000000000x.seg",
            "00000000000000000000.idx.tmp",
            "x",
        ] {
            assert_eq!(parse_segment_name(bad), None, "{bad}");
        }
    }
}
