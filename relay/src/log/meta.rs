//! Small named metadata blobs kept with the log (`meta/<name>`): state that
//! describes what the log holds and must live and die with it - today
//! capture's pinned relation fingerprints, so schema drift stops capture
//! on every rerun, not only in the session that saw it. Each blob is
//! replaced durably (temp file, fsync, rename, fsync of the directory), so
//! a crash leaves the old or the new blob, never a torn one.

use super::Error;
use super::storage::{OpenMode, Storage, StorageFile, SyncMode};
use std::path::Path;

pub(super) const META_DIR: &str = "meta";
const TEMP_SUFFIX: &str = ".tmp";
/// Metadata is small; a larger file is not ours.
const MAX_META_BYTES: u64 = 1 << 20;

pub(super) fn write<S: Storage>(
    storage: &S,
    dir: &Path,
    name: &str,
    bytes: &[u8],
) -> Result<(), Error> {
    let dir = dir.join(META_DIR);
    storage
        .create_dir_all(&dir)
        .map_err(Error::io("create metadata directory", &dir))?;
    let target = dir.join(name);
    let temp = dir.join(format!("{name}{TEMP_SUFFIX}"));
    let file = storage
        .open(&temp, OpenMode::Truncate)
        .map_err(Error::io("create metadata temp file", &temp))?;
    file.append(bytes)
        .map_err(Error::io("write metadata temp file", &temp))?;
    file.sync(SyncMode::All)
        .map_err(Error::io("fsync metadata temp file", &temp))?;
    drop(file);
    storage
        .rename(&temp, &target)
        .map_err(Error::io("rename metadata temp file over", &target))?;
    storage
        .sync_dir(&dir)
        .map_err(Error::io("fsync metadata directory", &dir))
}

pub(super) fn read<S: Storage>(
    storage: &S,
    dir: &Path,
    name: &str,
) -> Result<Option<Vec<u8>>, Error> {
    let dir = dir.join(META_DIR);
    // Only "no such directory" means "no metadata": any other error must
    // not pass for absent pins.
    match storage.list(&dir) {
        Ok(names) if names.iter().any(|n| n == name) => {}
        Ok(_) => return Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("list metadata directory", &dir)(e)),
    }
    let path = dir.join(name);
    let file = storage
        .open(&path, OpenMode::Existing)
        .map_err(Error::io("open metadata file", &path))?;
    let len = file.len().map_err(Error::io("stat metadata file", &path))?;
    if len > MAX_META_BYTES {
        return Err(Error::io("read metadata file", &path)(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{len} bytes, more than metadata ever holds"),
        )));
    }
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, 0)
        .map_err(Error::io("read metadata file", &path))?;
    Ok(Some(bytes))
}
