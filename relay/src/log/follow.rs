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
use super::watermark::{self, WATERMARK_FILE};
use super::writer::WriterState;
use super::{CURSOR_DIR, Counters, Log, LogConfig, SPILL_DIR, Shared, relock};

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
        let file = match storage.open(&path, OpenMode::Existing) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotWritten { dir });
            }
            Err(e) => return Err(Error::io("open watermark file", &path)(e)),
        };
        let mark = watermark::read(&file, &path)?;
        let (segments, _) = open_segments(&storage, &dir, &config, None, mark.next_offset)?;
        let active = segments
            .last()
            .cloned()
            .ok_or_else(|| Error::NotWritten { dir: dir.clone() })?;
        if let Some((base, pos)) = mark.hint
            && base == active.base
        {
            active.index_mut().observe(mark.next_offset, pos);
        }
        let cursors = CursorStore::follow(storage, &dir.join(CURSOR_DIR))?;
        let shared = Shared {
            storage,
            spill_dir: dir.join(SPILL_DIR),
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
            spill_seq: AtomicU64::new(0),
            follower: Some(Follower {
                watermark: file,
                path,
                log_id: mark.log_id,
                checked: Mutex::new(Instant::now()),
            }),
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
        let mark = watermark::read(&follower.watermark, &follower.path)?;
        if mark.log_id != follower.log_id {
            return Err(Error::Replaced {
                dir: shared.dir.clone(),
            });
        }
        if mark.next_offset <= shared.durable_next() {
            let mut checked = relock(&follower.checked);
            if checked.elapsed() >= REPLACED_CHECK {
                *checked = Instant::now();
                follower.check_same(&shared.storage, &shared.dir)?;
            }
            return Ok(false);
        }
        let last = shared.segments().last().cloned();
        let last_base = last.as_ref().map_or(0, |s| s.base);
        if mark.hint.is_none_or(|(base, _)| base != last_base) {
            let (fresh, present) = open_segments(
                &shared.storage,
                &shared.dir,
                &shared.config,
                Some(last_base),
                mark.next_offset,
            )?;
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
        let active = shared.segments().last().cloned();
        if let Some(active) = active {
            active.set_len(file_len(&active)?);
            if let Some((base, pos)) = mark.hint
                && base == active.base
            {
                active.index_mut().observe(mark.next_offset, pos);
            }
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
    /// past `offset` durable, looking every `poll`; false when none came.
    pub async fn follow_past(
        &self,
        offset: u64,
        patience: Duration,
        poll: Duration,
    ) -> Result<bool, Error> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            self.refresh()?;
            if self.written_end() > offset {
                return Ok(true);
            }
            if tokio::time::Instant::now() + poll > deadline {
                return Ok(false);
            }
            tokio::time::sleep(poll).await;
        }
    }
}

impl<F: StorageFile> Follower<F> {
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
            Ok(_) | Err(Error::Corrupt { .. }) => Err(replaced()),
            Err(e) => Err(e),
        }
    }
}

fn file_len<F: StorageFile>(segment: &Segment<F>) -> Result<u64, Error> {
    segment
        .file
        .len()
        .map_err(Error::io("stat segment", &segment.path))
}

/// The segments of `dir` after base `after` with records below `upto`
/// (the one starting at `upto` too, once its header is written), and the
/// bases found on the disk.
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
        let Some(header) = header.filter(|h| h.base_offset == base) else {
            if base == upto {
                // Being created by its writer: it holds nothing durable.
                break;
            }
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
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |e: nix::Error| Error::Io {
            op,
            path,
            source: std::io::Error::from(e),
        }
    };
    let fd = openat(
        dir.as_fd(),
        temp,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    // A removed directory takes no new entry: ENOENT.
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
