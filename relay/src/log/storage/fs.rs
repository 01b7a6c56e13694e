//! [`Storage`] over `std::fs`: what production runs.
//!
//! Durability follows the usual POSIX recipe (see neon
//! `libs/utils/src/crashsafe.rs`): `fdatasync` for appended data, `fsync` of
//! the parent directory after a create, rename or remove.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::{OpenMode, Storage, StorageFile, SyncMode};

/// The real file system.
#[derive(Clone, Copy, Debug, Default)]
pub struct FsStorage;

impl FsStorage {
    pub fn new() -> Self {
        FsStorage
    }
}

/// An open `std::fs::File`.
#[derive(Debug)]
pub struct FsFile {
    file: File,
    path: PathBuf,
    // Where the next append goes. Positioned writes (`pwrite`) are used for
    // appends too, because `O_APPEND` makes Linux ignore the position of
    // `pwrite`, which `write_at` needs.
    end: Mutex<u64>,
}

impl FsFile {
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn end(&self) -> std::sync::MutexGuard<'_, u64> {
        // The guarded value is a plain integer that is never left half
        // updated, so a poisoned mutex still holds a valid position.
        self.end.lock().unwrap_or_else(|poison| poison.into_inner())
    }
}

impl Storage for FsStorage {
    type File = FsFile;

    fn sync_blocks(&self) -> bool {
        true
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        trellara_common::owner_only::create_dir_all(dir)?;
        // The new directory's own entry lives in its parent.
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            self.sync_dir(parent)?;
        }
        Ok(())
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<FsFile> {
        // Records are row data: owner-only whatever the umask.
        let mut options = trellara_common::owner_only::options();
        options.read(true).write(true);
        match mode {
            OpenMode::Existing => {}
            OpenMode::Create => {
                options.create(true);
            }
            OpenMode::Truncate => {
                options.create(true).truncate(true);
            }
        }
        let file = options.open(path)?;
        let end = file.metadata()?.len();
        Ok(FsFile {
            file,
            path: path.to_path_buf(),
            end: Mutex::new(end),
        })
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            if !entry.file_type()?.is_file() {
                continue;
            }
            // Names the log writes are ASCII; anything else is not ours.
            if let Ok(name) = entry.file_name().into_string() {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

impl StorageFile for FsFile {
    fn append(&self, buf: &[u8]) -> io::Result<()> {
        let mut end = self.end();
        self.file.write_all_at(buf, *end)?;
        *end += buf.len() as u64;
        Ok(())
    }

    fn write_at(&self, buf: &[u8], pos: u64) -> io::Result<()> {
        let mut end = self.end();
        self.file.write_all_at(buf, pos)?;
        *end = (*end).max(pos + buf.len() as u64);
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<usize> {
        self.file.read_at(buf, pos)
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        let mut end = self.end();
        self.file.set_len(len)?;
        *end = len;
        Ok(())
    }

    fn sync(&self, mode: SyncMode) -> io::Result<()> {
        match mode {
            SyncMode::Data => self.file.sync_data(),
            SyncMode::All => self.file.sync_all(),
        }
    }
}
