//! Per-consumer cursors, persisted crash-safely.
//!
//! A cursor is the next offset a consumer will read plus the commit LSN of
//! the last record it consumed. Each lives in `cursors/<consumer>.cursor`.
//!
//! Invariants:
//! * A commit writes `<consumer>.cursor.tmp`, fsyncs it, renames it over the
//!   cursor file and fsyncs the directory, in that order; after a crash at
//!   any point the cursor file holds either the old or the new position,
//!   never a mix (the rename is atomic; the data was durable before it).
//! * Temp files left by a crash are ignored and removed on open. A
//!   follower in another process commits through `<consumer>.cursor.ftmp`,
//!   which the writer never removes: it may be that commit in flight.
//! * A cursor file that is torn or fails its checksum is an error
//!   ([`Error::CursorCorrupt`]); it is never read as "start from 0".
//! * The in-memory position changes only after the new file is durable, so
//!   retention (which reads it) can only be more conservative than disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::error::Error;
use super::frame::{CHECKSUM_SEED, Corruption, FORMAT_VERSION};
use super::storage::{OpenMode, Storage, StorageFile, SyncMode};

/// `TRLC`: first bytes of a cursor file.
pub const CURSOR_MAGIC: [u8; 4] = *b"TRLC";
/// Size of a cursor file.
pub const CURSOR_FILE_LEN: usize = 32;

const CURSOR_SUFFIX: &str = ".cursor";
const TEMP_SUFFIX: &str = ".cursor.tmp";
/// A follower's temp files: the writer, opening the log while a follower
/// commits, must not take one from under its rename.
const FOLLOW_TEMP_SUFFIX: &str = ".cursor.ftmp";
const FLAG_HAS_LSN: u16 = 1;
const MAX_NAME_LEN: usize = 64;

/// Where a consumer is in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CursorPosition {
    /// The next offset the consumer will read.
    pub next_offset: u64,
    /// Commit LSN of the last record consumed; `None` before the first.
    pub last_commit_lsn: Option<u64>,
}

impl CursorPosition {
    /// A cursor that has consumed nothing and starts reading at `offset`.
    pub fn start_at(offset: u64) -> Self {
        CursorPosition {
            next_offset: offset,
            last_commit_lsn: None,
        }
    }

    /// The position after consuming the record at `offset`.
    pub fn after(offset: u64, commit_lsn: u64) -> Self {
        CursorPosition {
            next_offset: offset + 1,
            last_commit_lsn: Some(commit_lsn),
        }
    }

    pub(crate) fn encode(&self) -> [u8; CURSOR_FILE_LEN] {
        let flags = if self.last_commit_lsn.is_some() {
            FLAG_HAS_LSN
        } else {
            0
        };
        let mut body = Vec::with_capacity(CURSOR_FILE_LEN);
        body.extend_from_slice(&CURSOR_MAGIC);
        body.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        body.extend_from_slice(&flags.to_le_bytes());
        body.extend_from_slice(&self.next_offset.to_le_bytes());
        body.extend_from_slice(&self.last_commit_lsn.unwrap_or(0).to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&body, CHECKSUM_SEED);
        body.extend_from_slice(&sum.to_le_bytes());
        let mut out = [0u8; CURSOR_FILE_LEN];
        for (dst, src) in out.iter_mut().zip(body) {
            *dst = src;
        }
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<CursorPosition, Corruption> {
        let exact: &[u8; CURSOR_FILE_LEN] =
            bytes.try_into().map_err(|_| Corruption::Truncated {
                needed: CURSOR_FILE_LEN as u64,
                available: bytes.len() as u64,
            })?;
        let (body, sum) = exact.split_at(CURSOR_FILE_LEN - 8);
        let word = |at: usize| -> u64 {
            let mut b = [0u8; 8];
            for (dst, src) in b.iter_mut().zip(body.iter().skip(at)) {
                *dst = *src;
            }
            u64::from_le_bytes(b)
        };
        let mut magic = [0u8; 4];
        for (dst, src) in magic.iter_mut().zip(body) {
            *dst = *src;
        }
        if magic != CURSOR_MAGIC {
            return Err(Corruption::BadMagic { found: magic });
        }
        let mut stored = [0u8; 8];
        for (dst, src) in stored.iter_mut().zip(sum) {
            *dst = *src;
        }
        let stored = u64::from_le_bytes(stored);
        let computed = xxhash_rust::xxh3::xxh3_64_with_seed(body, CHECKSUM_SEED);
        if stored != computed {
            return Err(Corruption::ChecksumMismatch { stored, computed });
        }
        let head = word(4);
        let version = (head & 0xffff) as u16;
        let flags = ((head >> 16) & 0xffff) as u16;
        if version != FORMAT_VERSION {
            return Err(Corruption::UnsupportedVersion(version));
        }
        if flags & !FLAG_HAS_LSN != 0 {
            return Err(Corruption::UnknownFlags(flags));
        }
        Ok(CursorPosition {
            next_offset: word(8),
            last_commit_lsn: (flags & FLAG_HAS_LSN != 0).then(|| word(16)),
        })
    }
}

/// Checks a consumer name: 1-64 characters from `[A-Za-z0-9_-]`, so it is
/// a safe file name on every platform.
pub(crate) fn validate_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidConsumerName {
            name: name.to_owned(),
        })
    }
}

/// The cursors of one log: in memory, mirrored durably on disk.
#[derive(Debug)]
pub(crate) struct CursorStore<S> {
    storage: S,
    dir: PathBuf,
    positions: BTreeMap<String, CursorPosition>,
    /// A follower's handle on the directory it opened: its commits go
    /// there, never into a log that replaced it ([`super::follow`]).
    anchor: Option<std::fs::File>,
}

impl<S: Storage> CursorStore<S> {
    /// Loads every cursor in `dir`, removing leftover temp files (whose paths
    /// are returned).
    pub fn load(storage: S, dir: &Path) -> Result<(Self, Vec<PathBuf>), Error> {
        storage
            .create_dir_all(dir)
            .map_err(Error::io("create cursor directory", dir))?;
        let mut removed = Vec::new();
        let positions = read_all(&storage, dir, Some(&mut removed))?;
        Ok((
            CursorStore {
                storage,
                dir: dir.to_path_buf(),
                positions,
                anchor: None,
            },
            removed,
        ))
    }

    /// The cursors of a log another process writes: its temp files are
    /// its own commits in flight, left alone.
    pub fn follow(storage: S, dir: &Path) -> Result<Self, Error> {
        let anchor = std::fs::File::open(dir).map_err(Error::io("open cursor directory", dir))?;
        Ok(CursorStore {
            positions: read_all(&storage, dir, None)?,
            storage,
            dir: dir.to_path_buf(),
            anchor: Some(anchor),
        })
    }

    /// Reads the positions again from the disk, where a follower in
    /// another process commits its own.
    pub fn reload(&mut self) -> Result<(), Error> {
        self.positions = read_all(&self.storage, &self.dir, None)?;
        Ok(())
    }

    pub fn get(&self, consumer: &str) -> Option<CursorPosition> {
        self.positions.get(consumer).copied()
    }

    pub fn all(&self) -> &BTreeMap<String, CursorPosition> {
        &self.positions
    }

    fn path(&self, consumer: &str) -> PathBuf {
        self.dir.join(format!("{consumer}{CURSOR_SUFFIX}"))
    }

    /// Durably stores `position` for `consumer` (temp, fsync, rename, fsync
    /// directory), then updates memory.
    pub fn persist(&mut self, consumer: &str, position: CursorPosition) -> Result<(), Error> {
        if let Some(anchor) = &self.anchor {
            super::follow::commit_anchored(
                anchor,
                &self.dir,
                &format!("{consumer}{CURSOR_SUFFIX}"),
                &format!("{consumer}{FOLLOW_TEMP_SUFFIX}"),
                &position.encode(),
            )?;
            self.positions.insert(consumer.to_owned(), position);
            return Ok(());
        }
        let target = self.path(consumer);
        let temp = self.dir.join(format!("{consumer}{TEMP_SUFFIX}"));
        let file = self
            .storage
            .open(&temp, OpenMode::Truncate)
            .map_err(Error::io("create cursor temp file", &temp))?;
        file.append(&position.encode())
            .map_err(Error::io("write cursor temp file", &temp))?;
        file.sync(SyncMode::All)
            .map_err(Error::io("fsync cursor temp file", &temp))?;
        drop(file);
        self.storage
            .rename(&temp, &target)
            .map_err(Error::io("rename cursor temp file over", &target))?;
        self.storage
            .sync_dir(&self.dir)
            .map_err(Error::io("fsync cursor directory", &self.dir))?;
        self.positions.insert(consumer.to_owned(), position);
        Ok(())
    }

    /// Durably removes `consumer`'s cursor.
    pub fn remove(&mut self, consumer: &str) -> Result<(), Error> {
        if self.anchor.is_some() {
            return Err(Error::ReadOnly {
                dir: self.dir.clone(),
            });
        }
        if !self.positions.contains_key(consumer) {
            return Err(Error::UnknownConsumer {
                consumer: consumer.to_owned(),
            });
        }
        let path = self.path(consumer);
        self.storage
            .remove(&path)
            .map_err(Error::io("remove cursor file", &path))?;
        self.storage
            .sync_dir(&self.dir)
            .map_err(Error::io("fsync cursor directory", &self.dir))?;
        self.positions.remove(consumer);
        Ok(())
    }
}

/// The positions of the cursor files in `dir`. Temp files are left by
/// commits that crashed before their rename (the cursor file holds the
/// previous position, the truth) or are in flight in another process;
/// with `removed` given they are removed (the log's one writer opening
/// it), else passed over.
fn read_all<S: Storage>(
    storage: &S,
    dir: &Path,
    mut removed: Option<&mut Vec<PathBuf>>,
) -> Result<BTreeMap<String, CursorPosition>, Error> {
    let names = storage
        .list(dir)
        .map_err(Error::io("list cursor directory", dir))?;
    let mut positions = BTreeMap::new();
    for name in names {
        let path = dir.join(&name);
        if name.ends_with(TEMP_SUFFIX) {
            if let Some(removed) = removed.as_deref_mut() {
                storage
                    .remove(&path)
                    .map_err(Error::io("remove stale cursor temp file", &path))?;
                removed.push(path);
            }
            continue;
        }
        let Some(consumer) = name.strip_suffix(CURSOR_SUFFIX) else {
            continue;
        };
        if validate_name(consumer).is_err() {
            continue;
        }
        // Dropped by the writer since the listing: no cursor.
        let Some(bytes) = read_cursor_file(storage, &path)? else {
            continue;
        };
        let position = CursorPosition::decode(&bytes).map_err(|reason| Error::CursorCorrupt {
            consumer: consumer.to_owned(),
            path: path.clone(),
            reason,
        })?;
        positions.insert(consumer.to_owned(), position);
    }
    Ok(positions)
}

/// A cursor file's bytes; None when it no longer exists.
fn read_cursor_file<S: Storage>(storage: &S, path: &Path) -> Result<Option<Vec<u8>>, Error> {
    let file = match storage.open(path, OpenMode::Existing) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("open cursor file", path)(e)),
    };
    let len = file.len().map_err(Error::io("stat cursor file", path))?;
    // Read one byte more than a cursor needs so an over-long file is caught.
    let want = usize::try_from(len)
        .unwrap_or(usize::MAX)
        .min(CURSOR_FILE_LEN + 1);
    let mut bytes = vec![0u8; want];
    file.read_exact_at(&mut bytes, 0)
        .map_err(Error::io("read cursor file", path))?;
    Ok(Some(bytes))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn cursor_round_trips_with_and_without_lsn() {
        for position in [
            CursorPosition::start_at(0),
            CursorPosition::after(41, 0xABCD),
        ] {
            let bytes = position.encode();
            assert_eq!(CursorPosition::decode(&bytes).unwrap(), position);
        }
    }

    #[test]
    fn every_flip_and_cut_is_an_error() {
        let bytes = CursorPosition::after(7, 9).encode();
        for i in 0..CURSOR_FILE_LEN {
            let mut bad = bytes;
            bad[i] ^= 0x10;
            assert!(CursorPosition::decode(&bad).is_err(), "flip at {i}");
            assert!(CursorPosition::decode(&bytes[..i]).is_err(), "cut at {i}");
        }
    }

    #[test]
    fn consumer_names_are_file_safe() {
        for good in ["applier", "lake-writer_2", "A"] {
            validate_name(good).unwrap();
        }
        let long = "x".repeat(65);
        for bad in ["", "../etc", "a.b", "a b", long.as_str()] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }
}
