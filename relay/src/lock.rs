//! One writer per log directory, across processes: the capture stage and
//! `trellara run` hold an exclusive `flock` on `<log dir>.lock` for as long
//! as they write; tools that only look (`verify`, `status`, `stream
//! locate-local`, `log inspect`) take it too and, when it is held, say the
//! log is in use instead of opening it - opening runs recovery, which must
//! never cut a frame a live writer is still writing.
//!
//! The lock file sits beside the directory, not in it, so a re-planned
//! snapshot can remove and recreate the directory while holding it.

use nix::fcntl::{Flock, FlockArg};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// Held while alive; released on drop (and by the kernel if the process dies).
#[derive(Debug)]
pub struct LogLock {
    _lock: Flock<File>,
}

pub fn lock_path(log_dir: &Path) -> PathBuf {
    let mut name = log_dir
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".lock");
    log_dir.with_file_name(name)
}

/// Takes the lock, or `Ok(None)` when another process holds it.
pub fn try_lock(log_dir: &Path) -> io::Result<Option<LogLock>> {
    let path = lock_path(log_dir);
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        trellara_common::owner_only::create_dir_all(parent)?;
    }
    let file = trellara_common::owner_only::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(LogLock { _lock: lock })),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, errno)) => Err(io::Error::from(errno)),
    }
}

/// Takes the lock or fails naming the directory and the fix.
pub fn lock(log_dir: &Path) -> io::Result<LogLock> {
    try_lock(log_dir)?.ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::WouldBlock,
            format!(
                "log {} is in use by another trellara process (relay or run); one writer per log\nhint: stop the other process, or give this flow its own log_dir",
                log_dir.display()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let held = lock(&log).expect("first");
        assert!(
            try_lock(&log).expect("try").is_none(),
            "a second lock is refused while the first is held"
        );
        let err = lock(&log).expect_err("busy");
        assert!(err.to_string().contains("in use"));
        drop(held);
        assert!(try_lock(&log).expect("try").is_some(), "released on drop");
        assert_eq!(lock_path(&log), dir.path().join("log.lock"));
    }
}
