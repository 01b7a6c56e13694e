//! Files and directories only their owner may read: the config `init`
//! writes, log directories, segments, cursors, spill and quarantine files
//! hold connection strings or row data. The modes are set at creation, so
//! no umask opens them and there is no window in which they are readable.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Mode of every file Trellara creates.
pub const FILE_MODE: u32 = 0o600;
/// Mode of every directory Trellara creates.
pub const DIR_MODE: u32 = 0o700;

/// `create_dir_all` whose new directories are 0700; existing ones are left
/// as they are (an operator's `/var/lib/trellara` is theirs to set).
pub fn create_dir_all(path: &Path) -> io::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
}

/// Options that create a file 0600 (`read`/`write`/`create` still to choose).
pub fn options() -> OpenOptions {
    let mut options = OpenOptions::new();
    options.mode(FILE_MODE);
    options
}

/// Writes `bytes` to `path`, replacing what it held, as a 0600 file (an
/// existing file is narrowed to 0600 first).
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut file: File = options()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
    file.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn modes_hold_whatever_the_umask() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Each test runs in its own process under nextest; the mask is
        // put back before the assertions.
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
        let nested = dir.path().join("a/b");
        create_dir_all(&nested).expect("dirs");
        let file = nested.join("f");
        std::fs::write(&file, b"open").expect("a world-readable file");
        write(&file, b"secret").expect("write");
        nix::sys::stat::umask(old);
        assert_eq!(
            std::fs::metadata(dir.path().join("a")).expect("a").mode() & 0o777,
            DIR_MODE
        );
        assert_eq!(
            std::fs::metadata(&nested).expect("b").mode() & 0o777,
            DIR_MODE
        );
        assert_eq!(
            std::fs::metadata(&file).expect("f").mode() & 0o777,
            FILE_MODE
        );
    }
}
