//! Following a log that another process writes: the apply service reads
//! the log its relay service appends to, on the same host.
//!
//! ```text
//!  relay process (Log::open)                 apply process (Log::follow)
//!  append ─▶ segments ─ fsync ─▶ durable ──read──▶ refresh(): new segments, new end
//!  retention ◀── reads cursors/*.cursor ◀──commit── its own cursor (openat/renameat)
//! ```
//!
//! Invariants:
//! * A follower sees only what the watermark file ([`super::watermark`])
//!   names durable, so it never applies a record a crash of its writer
//!   could take back. It never truncates, recovers, appends or deletes.
//! * A follower never writes into a log other than the one it opened: its
//!   cursor commits go through a handle on the cursor directory it opened
//!   (`openat`, `renameat`), which fails once that directory is removed,
//!   so a reseed's new log cannot get the old log's positions. A replaced
//!   log (another identity, or none) is [`Error::Replaced`].
//! * The writer owns nothing of the follower's cursor but its file, which
//!   its retention reads from disk ([`super::Log::reload_cursors`]).

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::cursor::CursorStore;
use super::error::Error;
use super::frame::{SEGMENT_HEADER_LEN, SegmentHeader};
use super::index::SparseIndex;
use super::segment::{Segment, parse_segment_name, segment_name};
use super::storage::{FsStorage, OpenMode, Storage, StorageFile};
use super::watermark::{self, WATERMARK_FILE, WATERMARK_FILE_LEN};
use super::writer::WriterState;
use super::{CURSOR_DIR, Counters, Log, LogConfig, Shared, relock};

/// How often an idle follower looks whether its log was replaced (a moving
/// watermark proves it was not).
const REPLACED_CHECK: Duration = Duration::from_millis(100);

/// What a following handle keeps of its writer's log.
#[derive(Debug)]
pub(crate) struct Follower<F> {
    /// The watermark file as opened: a replaced log's never moves again.
    watermark: F,
    path: PathBuf,
    log_id: u64,
    checked: Mutex<Instant>,
}

impl Log<FsStorage> {
    /// Opens the log in `dir` to follow it while another process writes
    /// it: records up to its durable watermark, cursors of its own. Fails
    /// with [`Error::NotWritten`] until a writer has opened the log once.
    pub fn follow(dir: impl Into<PathBuf>, config: LogConfig) -> Result<Log<FsStorage>, Error> {
        let dir = dir.into();
        let storage = FsStorage::new();
        let path = dir.join(WATERMARK_FILE);
        let not_written = || Error::NotWritten { dir: dir.clone() };
        let file = match storage.open(&path, OpenMode::Existing) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(not_written()),
            Err(e) => return Err(Error::io("open watermark file", &path)(e)),
        };
        // Created but not written yet: its writer is opening the log.
        let len = file
            .len()
            .map_err(Error::io("stat watermark file", &path))?;
        if len < WATERMARK_FILE_LEN as u64 {
            return Err(not_written());
        }
        let mark = watermark::read(&file, &path)?;
        let (segments, _) = open_segments(&storage, &dir, &config, None, mark.end.0)?;
        let active = segments.last().cloned().ok_or_else(not_written)?;
        let cursors = CursorStore::follow(storage, &dir.join(CURSOR_DIR))?;
        let follower = Follower {
            watermark: file,
            path,
            log_id: mark.log_id,
            checked: Mutex::new(Instant::now()),
        };
        // Each piece above was opened by path: a reseed that replaced the
        // log meanwhile must not leave this handle holding two logs.
        follower.check_same(&storage, &dir)?;
        if active.base != mark.end.0 {
            return Err(missing_segment(&dir, mark.end.0));
        }
        follower.take_end(&active, &mark);
        let shared = Shared {
            storage,
            config,
            writer: Mutex::new(WriterState::new(
                Arc::clone(&active),
                active.len(),
                mark.next_offset,
                None,
                None,
            )),
            segments: RwLock::new(segments),
            durable_next: AtomicU64::new(mark.next_offset),
            written_next: AtomicU64::new(mark.next_offset),
            moved: tokio::sync::watch::Sender::new(()),
            last_durable: Mutex::new(None),
            synced: Condvar::new(),
            cursors: Mutex::new(cursors),
            pressure: Mutex::new(Vec::new()),
            counters: Counters::default(),
            follower: Some(follower),
            dir,
        };
        Ok(Log {
            shared: Arc::new(shared),
        })
    }
}

impl<S: Storage> Log<S> {
    /// Whether this handle follows a log another process writes.
    pub fn is_follower(&self) -> bool {
        self.shared.follower.is_some()
    }

    /// A follower takes in what its writer made durable since it last
    /// looked: true when the durable end moved. A writer's own handle is
    /// always current (false).
    pub fn refresh(&self) -> Result<bool, Error> {
        let shared = &self.shared;
        let Some(follower) = &shared.follower else {
            return Ok(false);
        };
        super::Counters::add(&shared.counters.looks, 1);
        let mark = watermark::read(&follower.watermark, &follower.path)?;
        if mark.log_id != follower.log_id {
            return Err(Error::Replaced {
                dir: shared.dir.clone(),
            });
        }
        let seen = shared.durable_next();
        if mark.next_offset < seen {
            return Err(Error::WatermarkBack {
                dir: shared.dir.clone(),
                seen,
                now: mark.next_offset,
            });
        }
        if mark.next_offset == seen {
            let mut checked = relock(&follower.checked);
            if checked.elapsed() >= REPLACED_CHECK {
                *checked = Instant::now();
                follower.check_same(&shared.storage, &shared.dir)?;
            }
            return Ok(false);
        }
        let last = shared.segments().last().cloned();
        let last_base = last.as_ref().map_or(0, |s| s.base);
        if last.is_none() || mark.end.0 != last_base {
            let (fresh, present) = open_segments(
                &shared.storage,
                &shared.dir,
                &shared.config,
                last.as_ref().map(|s| s.base),
                mark.end.0,
            )?;
            if fresh.last().is_none_or(|s| s.base != mark.end.0) {
                follower.check_same(&shared.storage, &shared.dir)?;
                return Err(missing_segment(&shared.dir, mark.end.0));
            }
            // Rolled past: sealed, its file is whole and fsynced.
            if let Some(last) = &last {
                last.set_len(file_len(last)?);
            }
            let mut segments = shared.segments_mut();
            // Retention removed these from the disk; their handles go.
            let keep_from = segments.len().saturating_sub(1);
            let mut i = 0;
            segments.retain(|s| {
                i += 1;
                i > keep_from || present.contains(&s.base)
            });
            segments.extend(fresh);
        }
        if let Some(active) = shared.segments().last() {
            follower.take_end(active, &mark);
        }
        shared
            .written_next
            .store(mark.next_offset, Ordering::Release);
        shared
            .durable_next
            .store(mark.next_offset, Ordering::Release);
        shared.moved.send_replace(());
        Ok(true)
    }

    /// A follower waits up to `patience` for its writer to make records
    /// past `offset` durable; false when none came. It wakes as the writer
    /// rewrites the watermark file (inotify), and looks at least every
    /// [`WAKE_FALLBACK`] besides; without inotify it looks every `poll`.
    /// Looking every 1 ms cost an idle apply service 2.8% of a core
    /// (`bench/idle-follow`).
    pub async fn follow_past(
        &self,
        offset: u64,
        patience: Duration,
        poll: Duration,
    ) -> Result<bool, Error> {
        let deadline = tokio::time::Instant::now() + patience;
        // Watched before the first look, so no rewrite between is missed.
        let watch = self
            .shared
            .follower
            .as_ref()
            .and_then(|f| WatermarkWatch::new(&f.path));
        loop {
            self.refresh()?;
            if self.written_end() > offset {
                return Ok(true);
            }
            let now = tokio::time::Instant::now();
            match &watch {
                Some(watch) => {
                    if now >= deadline {
                        return Ok(false);
                    }
                    let look = deadline.min(now + WAKE_FALLBACK);
                    tokio::select! {
                        () = watch.rewritten() => {}
                        () = tokio::time::sleep_until(look) => {}
                    }
                }
                None => {
                    if now + poll > deadline {
                        return Ok(false);
                    }
                    tokio::time::sleep(poll).await;
                }
            }
        }
    }
}

/// How often a follower woken by inotify looks anyway: an event it cannot
/// see (the watermark file replaced by a new log's) is found by then.
const WAKE_FALLBACK: Duration = Duration::from_millis(50);

/// An inotify watch on a log's watermark file: readable when its writer
/// rewrote it. None where inotify cannot be had (the caller polls).
struct WatermarkWatch(tokio::io::unix::AsyncFd<InotifyFd>);

struct InotifyFd(nix::sys::inotify::Inotify);

impl std::os::fd::AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.0.as_fd().as_raw_fd()
    }
}

impl WatermarkWatch {
    fn new(path: &Path) -> Option<WatermarkWatch> {
        use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).ok()?;
        inotify
            .add_watch(
                path,
                AddWatchFlags::IN_MODIFY
                    | AddWatchFlags::IN_DELETE_SELF
                    | AddWatchFlags::IN_MOVE_SELF,
            )
            .ok()?;
        // SAFETY: InotifyFd owns its descriptor, keeps it open while it
        // lives, and always returns that same one.
        unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(
                InotifyFd(inotify),
                tokio::io::Interest::READABLE,
            )
        }
        .ok()
        .map(WatermarkWatch)
    }

    /// Until the file was rewritten (its events read and dropped).
    async fn rewritten(&self) {
        loop {
            let Ok(mut ready) = self.0.readable().await else {
                // The reactor refused it: the fallback look stands in.
                return std::future::pending().await;
            };
            match self.0.get_ref().0.read_events() {
                Ok(_) => return,
                Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
                Err(_) => return std::future::pending().await,
            }
        }
    }
}

impl<F: StorageFile> Follower<F> {
    /// The segment the watermark ends in is read up to its durable end and
    /// no further: bytes past it (a frame written, not yet fsynced) may be
    /// cut and written again by a recovering writer.
    fn take_end(&self, active: &Segment<F>, mark: &watermark::Watermark) {
        active.set_len(mark.end.1);
        active.index_mut().observe(mark.next_offset, mark.end.1);
    }

    /// The log at the path is still the one this follower opened.
    fn check_same<S: Storage<File = F>>(&self, storage: &S, dir: &Path) -> Result<(), Error> {
        let replaced = || Error::Replaced {
            dir: dir.to_path_buf(),
        };
        let file = match storage.open(&self.path, OpenMode::Existing) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(replaced()),
            Err(e) => return Err(Error::io("open watermark file", &self.path)(e)),
        };
        match watermark::read(&file, &self.path) {
            Ok(mark) if mark.log_id == self.log_id => Ok(()),
            // A new log's file before its first write reads as torn.
            Ok(_) | Err(Error::WatermarkUnreadable { .. }) => Err(replaced()),
            Err(e) => Err(e),
        }
    }
}

fn missing_segment(dir: &Path, base: u64) -> Error {
    let path = dir.join(segment_name(base));
    Error::Io {
        op: "open the segment the watermark file names",
        source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such segment"),
        path,
    }
}

fn file_len<F: StorageFile>(segment: &Segment<F>) -> Result<u64, Error> {
    segment
        .file
        .len()
        .map_err(Error::io("stat segment", &segment.path))
}

/// The segments of `dir` after base `after` up to base `upto`, the one the
/// watermark ends in, and the bases found on the disk.
#[allow(clippy::type_complexity)]
fn open_segments<S: Storage>(
    storage: &S,
    dir: &Path,
    config: &LogConfig,
    after: Option<u64>,
    upto: u64,
) -> Result<(Vec<Arc<Segment<S::File>>>, Vec<u64>), Error> {
    let names = storage
        .list(dir)
        .map_err(Error::io("list log directory", dir))?;
    let mut present: Vec<u64> = names.iter().filter_map(|n| parse_segment_name(n)).collect();
    present.sort_unstable();
    let mut out = Vec::new();
    for &base in present
        .iter()
        .filter(|&&b| b <= upto && after.is_none_or(|a| b > a))
    {
        let path = dir.join(segment_name(base));
        let file = match storage.open(&path, OpenMode::Existing) {
            Ok(file) => file,
            // Retention removed it since the listing; records below the
            // next one are gone for every reader.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && out.is_empty() => continue,
            Err(e) => return Err(Error::io("open segment", &path)(e)),
        };
        let len = file.len().map_err(Error::io("stat segment", &path))?;
        let mut bytes = [0u8; SEGMENT_HEADER_LEN];
        let header = if len >= SEGMENT_HEADER_LEN as u64 {
            file.read_exact_at(&mut bytes, 0)
                .map_err(Error::io("read segment header", &path))?;
            SegmentHeader::decode(&bytes).ok()
        } else {
            None
        };
        // Its writer fsynced the header before the watermark named it.
        let Some(header) = header.filter(|h| h.base_offset == base) else {
            return Err(Error::Corrupt {
                path,
                pos: 0,
                reason: super::frame::Corruption::Truncated {
                    needed: SEGMENT_HEADER_LEN as u64,
                    available: len,
                },
            });
        };
        out.push(Arc::new(Segment::new(
            dir,
            base,
            Arc::new(file),
            header.created_unix_ms,
            len,
            SparseIndex::new(config.index_interval_bytes),
        )));
    }
    Ok((out, present))
}

/// A cursor commit of a follower: temp file, fsync, rename, directory
/// fsync, all through `dir`, the cursor directory as it was opened.
pub(crate) fn commit_anchored(
    dir: &std::fs::File,
    dir_path: &Path,
    name: &str,
    temp: &str,
    bytes: &[u8],
) -> Result<(), Error> {
    use nix::fcntl::{OFlag, openat, renameat};
    use nix::sys::stat::Mode;
    let target = dir_path.join(name);
    let temp_path = dir_path.join(temp);
    // The directory removed (a reseed or teardown replaced the log): no
    // entry can be made in it, and this log's positions go nowhere else.
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |e: nix::Error| match e {
            nix::Error::ENOENT => Error::Replaced {
                dir: dir_path.parent().unwrap_or(dir_path).to_path_buf(),
            },
            e => Error::Io {
                op,
                path,
                source: std::io::Error::from(e),
            },
        }
    };
    let fd = openat(
        dir.as_fd(),
        temp,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(io("create cursor temp file", &temp_path))?;
    let file = std::fs::File::from(fd);
    std::os::unix::fs::FileExt::write_all_at(&file, bytes, 0)
        .map_err(Error::io("write cursor temp file", &temp_path))?;
    file.sync_all()
        .map_err(Error::io("fsync cursor temp file", &temp_path))?;
    drop(file);
    renameat(dir.as_fd(), temp, dir.as_fd(), name)
        .map_err(io("rename cursor temp file over", &target))?;
    dir.sync_all()
        .map_err(Error::io("fsync cursor directory", dir_path))
}

/// Removes a log directory that a follower in another process may hold
/// open. It is renamed aside first, in one step, so the path never names a
/// half-removed log and a follower's next cursor commit fails (its anchored
/// directory is gone) instead of racing the removal.
pub fn remove_log_dir(dir: &Path) -> std::io::Result<()> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    sweep_removed(dir);
    // Unique, so a leftover of an earlier process that had this pid (PID 1
    // in a container) never blocks the rename.
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let aside = dir.with_file_name(format!(".{name}.removing-{}-{nonce}", std::process::id()));
    match std::fs::rename(dir, &aside) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    // By name: the sweep lists the parent, which may spell the path
    // otherwise (`./x` for `x`); the nonce makes the name unique.
    let named = aside.file_name().map(std::ffi::OsStr::to_os_string);
    relock(&REMOVING).extend(named.clone());
    let removed = remove_aside(&aside);
    relock(&REMOVING).retain(|a| Some(a) != named.as_ref());
    removed
}

/// The asides this process is removing now, by file name: one of its own
/// pid that is not here was left by an earlier process with that pid, or
/// by a removal here that failed.
static REMOVING: Mutex<Vec<std::ffi::OsString>> = Mutex::new(Vec::new());

/// Removes what a [`remove_log_dir`] of `dir` that did not finish left
/// beside it (a crash or a kill between the rename and the last file):
/// each `.<name>.removing-<pid>-<nonce>` whose process is gone. One whose
/// process still runs is that process's to finish. Best effort: what
/// cannot be removed now is tried again next time, and never fails the
/// caller.
pub fn sweep_removed(dir: &Path) {
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return;
    };
    let prefix = format!(".{}.removing-", name.to_string_lossy());
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(pid) = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<i32>().ok())
        else {
            continue;
        };
        // Another user's process (EPERM) is alive too; a reused pid only
        // keeps it for a later sweep.
        let alive = if pid == std::process::id() as i32 {
            relock(&REMOVING).contains(&file)
        } else {
            !matches!(
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
                Err(nix::errno::Errno::ESRCH)
            )
        };
        if alive {
            continue;
        }
        if let Err(e) = remove_aside(&entry.path()) {
            tracing::warn!(path = %entry.path().display(), error = %e, "could not remove a log left half removed; tried again next time");
        }
    }
}

fn remove_aside(aside: &Path) -> std::io::Result<()> {
    // A follower's commit in flight may add a file while it goes.
    let mut tries = 0;
    loop {
        match std::fs::remove_dir_all(aside) {
            Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty && tries < 10 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}
