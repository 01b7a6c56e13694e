//! The disk edge of the segment log: every byte the log persists goes through
//! [`Storage`] and [`StorageFile`].
//!
//! The trait is deliberately narrow (open, append, write_at, read_at, len,
//! truncate, sync, list, remove, rename, sync_dir) so that two implementations
//! can honour the same contract:
//!
//! * [`FsStorage`]: `std::fs`, `fdatasync`/`fsync`, directory fsync.
//! * [`SimStorage`]: a deterministic in-memory file system that remembers what
//!   was made durable, can lose everything else on a simulated crash (or keep
//!   a torn prefix of it), and can inject I/O errors at named operations.
//!
//! Contract the log relies on (and the simulation enforces):
//! * Bytes written by `append`/`write_at` are visible to `read_at` at once but
//!   survive a crash only after [`StorageFile::sync`] returned `Ok`.
//! * A created, renamed or removed directory entry survives a crash only after
//!   [`Storage::sync_dir`] on its parent returned `Ok`.
//! * After a failed `sync` nothing is known about the unsynced bytes: the
//!   caller must not retry the sync and assume success (the kernel may have
//!   dropped the dirty pages; see Rebello et al., "Can Applications Recover
//!   from fsync Failures?", ATC '20). The log poisons itself instead.

mod fs;
mod sim;

use std::fmt;
use std::io;
use std::path::Path;

pub use fs::{FsFile, FsStorage};
pub use sim::{SimCrash, SimFault, SimFile, SimOp, SimStats, SimStorage};

/// How far a [`StorageFile::sync`] must go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// File data and the metadata needed to read it back (`fdatasync`).
    Data,
    /// Data and all metadata (`fsync`).
    All,
}

/// How [`Storage::open`] treats an existing or missing file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// The file must exist.
    Existing,
    /// Create the file if missing, keep its contents if present.
    Create,
    /// Create the file if missing and truncate it to zero bytes.
    Truncate,
}

/// A directory-structured store of byte files.
pub trait Storage: Clone + Send + Sync + fmt::Debug + 'static {
    /// An open file; shared between the writer and readers.
    type File: StorageFile;

    /// Whether [`StorageFile::sync`] waits on a device, so an async caller
    /// should run it off its thread. The simulator's does not, and runs
    /// inline to stay deterministic.
    fn sync_blocks(&self) -> bool {
        false
    }

    /// Creates `dir` and its parents. Creating is durable once this returns.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Opens `path` for reading and writing.
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Self::File>;
    /// The names (not paths) of the regular files directly inside `dir`,
    /// sorted. A missing directory is an error.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Removes the directory entry `path`; durable after `sync_dir`.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Atomically replaces `to` with `from`; durable after `sync_dir`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes the entries of `dir` (creates, renames, removes) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// An open file of a [`Storage`].
///
/// Methods take `&self`: the log serialises writers itself, readers use
/// positioned reads that never move a shared cursor.
// `len` is a fallible size query, not a collection length.
#[allow(clippy::len_without_is_empty)]
pub trait StorageFile: Send + Sync + fmt::Debug + 'static {
    /// Writes all of `buf` at the current end of the file.
    fn append(&self, buf: &[u8]) -> io::Result<()>;
    /// Writes all of `buf` at byte `pos`, extending the file if needed.
    fn write_at(&self, buf: &[u8], pos: u64) -> io::Result<()>;
    /// Reads up to `buf.len()` bytes at `pos`; fewer only at end of file.
    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<usize>;
    /// The current length in bytes (durable or not).
    fn len(&self) -> io::Result<u64>;
    /// Cuts (or zero-extends) the file to `len` bytes.
    fn truncate(&self, len: u64) -> io::Result<()>;
    /// Makes everything written so far durable.
    fn sync(&self, mode: SyncMode) -> io::Result<()>;

    /// Reads exactly `buf.len()` bytes at `pos`, or fails with
    /// [`io::ErrorKind::UnexpectedEof`].
    fn read_exact_at(&self, mut buf: &mut [u8], mut pos: u64) -> io::Result<()> {
        while !buf.is_empty() {
            match self.read_at(buf, pos) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "file ended before the requested range",
                    ));
                }
                Ok(n) => {
                    buf = buf.get_mut(n..).unwrap_or_default();
                    pos += n as u64;
                }
                Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        Ok(())
    }
}
