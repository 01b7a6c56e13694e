//! Opening a log directory after a clean shutdown or a crash.
//!
//! Rules (also in `docs/LOG_FORMAT.md`, "Recovery"):
//! 1. Segment files must chain: each base offset equals the previous
//!    segment's end, else [`Error::Gap`].
//! 2. A sealed (non-last) segment is trusted structurally if its index file
//!    is valid and agrees with the segment's length and the next segment's
//!    base; otherwise every frame is checksummed and the index rebuilt. Any
//!    bad byte there is [`Error::Corrupt`]: sealed segments were fsynced
//!    whole before the next one was created, so damage is not a crash
//!    artefact.
//! 3. The last segment is always scanned and checksummed. The first bad
//!    frame ends the valid data: if no valid frame follows it, everything
//!    from there is a torn tail, truncated and fsynced; if one does, it is
//!    [`Error::Corrupt`]. A last segment too short for its header is
//!    re-initialised (it can hold no records: the header is fsynced before
//!    any frame is written).
//! 4. The last segment and the directory are fsynced before the log reports
//!    its records durable, since a previous process may have died with
//!    written-but-unsynced frames still in the page cache.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::error::Error;
use super::frame::{Corruption, SEGMENT_HEADER_LEN, SegmentHeader};
use super::index::{self, SealedSummary, SparseIndex};
use super::segment::{
    self, Segment, find_valid_frame_after, index_name, parse_index_name, parse_segment_name,
    segment_name,
};
use super::storage::{OpenMode, Storage, StorageFile, SyncMode};
use super::{Durable, LogConfig, TornTail};

/// The state of a log directory after recovery.
#[derive(Debug)]
pub(crate) struct Recovered<F> {
    pub segments: Vec<Arc<Segment<F>>>,
    pub active_len: u64,
    pub next_offset: u64,
    pub last: Option<Durable>,
    pub torn_tail: Option<TornTail>,
    pub rebuilt_indexes: Vec<PathBuf>,
    pub removed_files: Vec<PathBuf>,
}

pub(crate) fn recover<S: Storage>(
    storage: &S,
    dir: &Path,
    config: &LogConfig,
) -> Result<Recovered<S::File>, Error> {
    let names = storage
        .list(dir)
        .map_err(Error::io("list log directory", dir))?;
    let mut bases: Vec<u64> = names.iter().filter_map(|n| parse_segment_name(n)).collect();
    bases.sort_unstable();
    let known: BTreeSet<u64> = bases.iter().copied().collect();

    let mut out = Recovered {
        segments: Vec::new(),
        active_len: SEGMENT_HEADER_LEN as u64,
        next_offset: 0,
        last: None,
        torn_tail: None,
        rebuilt_indexes: Vec::new(),
        removed_files: Vec::new(),
    };
    for orphan in names
        .iter()
        .filter_map(|n| parse_index_name(n))
        .filter(|b| !known.contains(b))
    {
        // Left behind by retention that crashed between the two removals.
        let path = dir.join(index_name(orphan));
        storage
            .remove(&path)
            .map_err(Error::io("remove orphan index", &path))?;
        out.removed_files.push(path);
    }

    if bases.is_empty() {
        let segment = create_first_segment(storage, dir, config)?;
        out.segments.push(Arc::new(segment));
        return Ok(out);
    }

    for (i, &base) in bases.iter().enumerate() {
        let path = dir.join(segment_name(base));
        if i > 0 && base != out.next_offset {
            return Err(Error::Gap {
                path,
                expected: out.next_offset,
                found: base,
            });
        }
        let file = storage
            .open(&path, OpenMode::Existing)
            .map_err(Error::io("open segment", &path))?;
        let len = file.len().map_err(Error::io("stat segment", &path))?;
        let segment = match bases.get(i + 1) {
            Some(&next_base) => recover_sealed(
                storage, dir, config, &path, base, file, len, next_base, &mut out,
            )?,
            None => recover_last(storage, dir, config, &path, base, file, len, &mut out)?,
        };
        out.segments.push(Arc::new(segment));
    }
    Ok(out)
}

fn read_header<F: StorageFile>(
    file: &F,
    path: &Path,
    len: u64,
) -> Result<Result<SegmentHeader, Corruption>, Error> {
    let mut bytes = [0u8; SEGMENT_HEADER_LEN];
    if len < SEGMENT_HEADER_LEN as u64 {
        return Ok(Err(Corruption::Truncated {
            needed: SEGMENT_HEADER_LEN as u64,
            available: len,
        }));
    }
    file.read_exact_at(&mut bytes, 0)
        .map_err(Error::io("read segment header", path))?;
    Ok(SegmentHeader::decode(&bytes))
}

fn checked_header<F: StorageFile>(
    file: &F,
    path: &Path,
    base: u64,
    len: u64,
) -> Result<SegmentHeader, Error> {
    let header = read_header(file, path, len)?.map_err(|reason| Error::Corrupt {
        path: path.to_path_buf(),
        pos: 0,
        reason,
    })?;
    if header.base_offset != base {
        return Err(Error::Corrupt {
            path: path.to_path_buf(),
            pos: 0,
            reason: Corruption::BaseMismatch {
                expected: base,
                found: header.base_offset,
            },
        });
    }
    Ok(header)
}

/// Loads a sealed segment, from its index if that checks out.
#[allow(clippy::too_many_arguments)]
fn recover_sealed<S: Storage>(
    storage: &S,
    dir: &Path,
    config: &LogConfig,
    path: &Path,
    base: u64,
    file: S::File,
    len: u64,
    next_base: u64,
    out: &mut Recovered<S::File>,
) -> Result<Segment<S::File>, Error> {
    let header = checked_header(&file, path, base, len)?;
    let index_path = dir.join(index_name(base));
    let cached = load_index(storage, &index_path, base, config.index_interval_bytes)
        .filter(|(s, _)| s.segment_len == len && s.next_offset == next_base);
    let file = Arc::new(file);
    let (summary, sparse) = match cached {
        Some(found) => found,
        None => {
            let scan = segment::scan(
                &file,
                path,
                base,
                len,
                config.index_interval_bytes,
                config.read_buffer_bytes,
            )?;
            if let Some((pos, reason)) = scan.stop {
                return Err(Error::Corrupt {
                    path: path.to_path_buf(),
                    pos,
                    reason,
                });
            }
            if scan.next_offset != next_base {
                return Err(Error::Gap {
                    path: dir.join(segment_name(next_base)),
                    expected: scan.next_offset,
                    found: next_base,
                });
            }
            let summary = SealedSummary {
                next_offset: scan.next_offset,
                segment_len: len,
                last_commit_lsn: scan.last_commit_lsn,
            };
            let bytes = index::encode(base, &summary, &scan.index);
            match storage
                .open(&index_path, OpenMode::Truncate)
                .and_then(|f| f.append(&bytes))
            {
                Ok(()) => out.rebuilt_indexes.push(index_path),
                Err(error) => {
                    tracing::warn!(path = %index_path.display(), %error, "could not write rebuilt index");
                }
            }
            (summary, scan.index)
        }
    };
    if let Some(commit_lsn) = summary.last_commit_lsn {
        out.last = Some(Durable {
            offset: summary.next_offset - 1,
            commit_lsn,
        });
    }
    out.next_offset = summary.next_offset;
    Ok(Segment::new(
        dir,
        base,
        file,
        header.created_unix_ms,
        len,
        sparse,
    ))
}

fn load_index<S: Storage>(
    storage: &S,
    path: &Path,
    base: u64,
    interval: u64,
) -> Option<(SealedSummary, SparseIndex)> {
    let file = storage.open(path, OpenMode::Existing).ok()?;
    let len = usize::try_from(file.len().ok()?).ok()?;
    let mut bytes = vec![0u8; len];
    file.read_exact_at(&mut bytes, 0).ok()?;
    match index::decode(&bytes, base, interval) {
        Ok(found) => Some(found),
        Err(reason) => {
            tracing::warn!(path = %path.display(), %reason, "ignoring invalid index file");
            None
        }
    }
}

/// Scans the last segment and cuts a torn tail.
#[allow(clippy::too_many_arguments)]
fn recover_last<S: Storage>(
    storage: &S,
    dir: &Path,
    config: &LogConfig,
    path: &Path,
    base: u64,
    file: S::File,
    len: u64,
    out: &mut Recovered<S::File>,
) -> Result<Segment<S::File>, Error> {
    // `len` becomes the header length if the segment is re-initialised.
    let (header, len) = match read_header(&file, path, len)? {
        Ok(header) if header.base_offset == base => (header, len),
        Ok(header) => {
            return Err(Error::Corrupt {
                path: path.to_path_buf(),
                pos: 0,
                reason: Corruption::BaseMismatch {
                    expected: base,
                    found: header.base_offset,
                },
            });
        }
        Err(reason) if len <= SEGMENT_HEADER_LEN as u64 => {
            // Crash while creating this segment: no frame can follow a
            // header that never became durable, so start it afresh.
            let header = SegmentHeader {
                base_offset: base,
                created_unix_ms: config.clock.now_unix_ms(),
            };
            file.truncate(0)
                .map_err(Error::io("truncate segment", path))?;
            file.append(&header.encode())
                .map_err(Error::io("write segment header", path))?;
            tracing::warn!(segment = %path.display(), %reason, "re-initialised torn segment header");
            out.torn_tail = Some(TornTail {
                segment: path.to_path_buf(),
                valid_len: SEGMENT_HEADER_LEN as u64,
                truncated_bytes: len,
                next_offset: base,
                reason,
            });
            (header, SEGMENT_HEADER_LEN as u64)
        }
        Err(reason) => {
            return Err(Error::Corrupt {
                path: path.to_path_buf(),
                pos: 0,
                reason,
            });
        }
    };
    let file = Arc::new(file);
    let scan = segment::scan(
        &file,
        path,
        base,
        len,
        config.index_interval_bytes,
        config.read_buffer_bytes,
    )?;
    if let Some((pos, reason)) = scan.stop {
        if let Some(valid_at) = find_valid_frame_after(
            &file,
            path,
            pos,
            len,
            scan.next_offset,
            config.read_buffer_bytes,
        )? {
            tracing::error!(segment = %path.display(), pos, valid_at, %reason, "corrupt frame followed by valid data");
            return Err(Error::Corrupt {
                path: path.to_path_buf(),
                pos,
                reason,
            });
        }
        file.truncate(pos)
            .map_err(Error::io("truncate torn tail of", path))?;
        tracing::warn!(
            segment = %path.display(),
            valid_len = pos,
            truncated_bytes = len - pos,
            next_offset = scan.next_offset,
            %reason,
            "truncated torn tail"
        );
        out.torn_tail = Some(TornTail {
            segment: path.to_path_buf(),
            valid_len: pos,
            truncated_bytes: len - pos,
            next_offset: scan.next_offset,
            reason,
        });
    }
    file.sync(SyncMode::All)
        .map_err(Error::io("fsync segment", path))?;
    storage
        .sync_dir(dir)
        .map_err(Error::io("fsync log directory", dir))?;
    if let Some(commit_lsn) = scan.last_commit_lsn {
        out.last = Some(Durable {
            offset: scan.next_offset - 1,
            commit_lsn,
        });
    }
    out.next_offset = scan.next_offset;
    out.active_len = scan.valid_len;
    Ok(Segment::new(
        dir,
        base,
        file,
        header.created_unix_ms,
        scan.valid_len,
        scan.index,
    ))
}

fn create_first_segment<S: Storage>(
    storage: &S,
    dir: &Path,
    config: &LogConfig,
) -> Result<Segment<S::File>, Error> {
    let path = dir.join(segment_name(0));
    let header = SegmentHeader {
        base_offset: 0,
        created_unix_ms: config.clock.now_unix_ms(),
    };
    let file = storage
        .open(&path, OpenMode::Truncate)
        .map_err(Error::io("create segment", &path))?;
    file.append(&header.encode())
        .map_err(Error::io("write segment header", &path))?;
    file.sync(SyncMode::All)
        .map_err(Error::io("fsync segment", &path))?;
    storage
        .sync_dir(dir)
        .map_err(Error::io("fsync log directory", dir))?;
    Ok(Segment::new(
        dir,
        0,
        Arc::new(file),
        header.created_unix_ms,
        SEGMENT_HEADER_LEN as u64,
        SparseIndex::new(config.index_interval_bytes),
    ))
}
