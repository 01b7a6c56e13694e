//! The durable segment log: the relay publishes encoded envelopes here and
//! acknowledges the source only after [`Log::append`] returned.
//!
//! ```text
//!  appenders (threads)             Log                           disk (Storage)
//!  ──────────────────   ┌──────────────────────────┐   ┌──────────────────────────────┐
//!  append(lsn, bytes) ─▶│ writer mutex: assign     │──▶│ 00000000000000000000.seg     │
//!  append_batch(..)   ─▶│ offset, frame, write     │   │ 00000000000000000000.idx     │
//!  append_from(..)    ─▶│ ── one fsync per group ──│   │ 00000000000000004096.seg ◀── active
//!        ▲              │ (leader syncs, followers │   │ cursors/<consumer>.cursor    │
//!        └─ Ok(offset) ─│  wait on a condvar)      │   │ durable (watermark)          │
//!           = durable   └────────────┬─────────────┘   └──────────────────────────────┘
//!                                    │ durable watermark
//!  consumers: read_from(offset) ◀────┘   commit_cursor(name, pos) ─▶ temp, fsync, rename, fsync dir
//!  early:     read_written_from(offset) ◀── written end; act durably only after sync_through(end)
//! ```
//!
//! Invariants (each has a test in `relay/tests/log_*.rs`):
//! * **Publish durably, then acknowledge.** `append*` returns `Ok` only after
//!   an fsync that covers the record returned. [`Log::read_from`] readers and
//!   [`Log::last_durable`] see only such records, so nothing a consumer saw
//!   can vanish in a crash. A crash between fsync and the caller's
//!   acknowledgement costs a duplicate, never a gap.
//! * **Early readers wait before they commit.** A [`Log::read_written_from`]
//!   reader also sees records written but not yet durable, so a consumer
//!   can start on a record while its fsync runs; it must make nothing of
//!   it durable elsewhere before [`Log::sync_through`] covers the record.
//! * **Offsets are dense.** Records are numbered 0, 1, 2, ... across
//!   segments with no holes; retention deletes only whole segments from the
//!   front.
//! * **No silent skipping.** On open, an incomplete or corrupt tail of the
//!   *last* segment is truncated (and reported in [`OpenReport::torn_tail`]);
//!   any other bad frame is [`Error::Corrupt`] naming the file and byte.
//! * **fsync failure poisons.** After a failed write or fsync every append
//!   and [`Log::sync`] fails with [`Error::Poisoned`] until the log is
//!   reopened, because what reached the disk is unknown.
//! * **Segment N+1 exists only once segment N is durable**, so only the last
//!   segment can ever have a torn tail.
//!
//! The on-disk format is specified in `docs/LOG_FORMAT.md`.
//!
//! Benchmarks: `cargo bench -p trellara-relay --bench log`.

// Bytes read back from disk must never panic the relay.
#![deny(clippy::unwrap_used, clippy::indexing_slicing)]

mod clock;
mod cursor;
mod error;
mod follow;
mod frame;
mod index;
mod meta;
mod reader;
mod recovery;
mod retention;
mod segment;
pub mod storage;
mod watermark;
mod writer;

use std::fmt;
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub use clock::{Clock, ManualClock, SystemClock};
pub use cursor::{CURSOR_FILE_LEN, CURSOR_MAGIC, CursorPosition};
pub use error::Error;
pub use follow::{remove_log_dir, sweep_removed};
pub use frame::{
    CHECKSUM_SEED, Corruption, FORMAT_VERSION, FRAME_HEADER_LEN, FRAME_MAGIC, SEGMENT_HEADER_LEN,
    SEGMENT_MAGIC,
};
pub use index::{INDEX_ENTRY_LEN, INDEX_HEADER_LEN, INDEX_MAGIC};
pub use reader::{Reader, Record};
pub use retention::{ConsumerPressure, DeletedSegment, RetentionPolicy, RetentionReport};
pub use watermark::{WATERMARK_FILE_LEN, WATERMARK_MAGIC};

use cursor::CursorStore;
use reader::Horizon;
use segment::Segment;
use storage::{FsStorage, Storage};
use writer::WriterState;

/// Largest payload a frame can carry (the length field is a `u32`).
pub const MAX_PAYLOAD_LEN: u64 = u32::MAX as u64;

const CURSOR_DIR: &str = "cursors";
/// Where builds before stop 36 kept scratch files of large appends; a log
/// opened by this build empties it and never writes there again.
const LEGACY_SPILL_DIR: &str = "spill";

/// Tuning of a [`Log`]; `LogConfig::default()` suits production.
#[derive(Clone, Debug)]
pub struct LogConfig {
    /// Roll to a new segment before a record would push the active one past
    /// this size. A record larger than this gets a segment of its own.
    pub max_segment_bytes: u64,
    /// Distance in bytes between sparse index entries.
    pub index_interval_bytes: u64,
    /// Read-ahead of readers and recovery scans.
    pub read_buffer_bytes: usize,
    /// What [`Log::enforce_retention`] may delete.
    pub retention: RetentionPolicy,
    /// Stamps segments; judges their age for retention.
    pub clock: Arc<dyn Clock>,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            max_segment_bytes: 64 * 1024 * 1024,
            index_interval_bytes: 64 * 1024,
            read_buffer_bytes: 256 * 1024,
            retention: RetentionPolicy::default(),
            clock: Arc::new(SystemClock),
        }
    }
}

/// A durable record's position and source commit LSN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Durable {
    pub offset: u64,
    pub commit_lsn: u64,
}

/// Counters since the log was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Records appended.
    pub records: u64,
    /// Calls to `append`, `append_batch` and `append_from`.
    pub append_calls: u64,
    /// Segment fsyncs (group commits plus one per segment roll).
    pub fsyncs: u64,
    /// Frame bytes written (headers included).
    pub bytes: u64,
    pub segments_rolled: u64,
    /// A follower's looks at its writer's watermark file.
    pub looks: u64,
}

#[derive(Debug, Default)]
struct Counters {
    records: AtomicU64,
    append_calls: AtomicU64,
    fsyncs: AtomicU64,
    bytes: AtomicU64,
    segments_rolled: AtomicU64,
    looks: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// What [`Log::open`] found and repaired.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    pub segments: usize,
    pub first_offset: u64,
    pub next_offset: u64,
    pub last_durable: Option<Durable>,
    /// Set when the last segment ended in a partial or corrupt frame that
    /// was cut off.
    pub torn_tail: Option<TornTail>,
    /// Index files that were missing or invalid and were rebuilt.
    pub rebuilt_indexes: Vec<PathBuf>,
    /// Leftovers removed: orphan index files, cursor temp files, files in
    /// the `spill/` directory of an older build.
    pub removed_files: Vec<PathBuf>,
}

/// A torn tail cut off the last segment on open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TornTail {
    pub segment: PathBuf,
    /// Where valid data now ends (the file's new length).
    pub valid_len: u64,
    /// Bytes removed.
    pub truncated_bytes: u64,
    /// Offset the next record will get.
    pub next_offset: u64,
    /// What was wrong with the first removed frame.
    pub reason: Corruption,
}

/// One segment, for inspection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    pub path: PathBuf,
    pub base_offset: u64,
    pub bytes: u64,
    /// `false` for the active (last) segment.
    pub sealed: bool,
}

/// The durable segment log. Cheap to clone; clones share one log.
pub struct Log<S: Storage = FsStorage> {
    shared: Arc<Shared<S>>,
}

impl<S: Storage> Clone for Log<S> {
    fn clone(&self) -> Self {
        Log {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: Storage> fmt::Debug for Log<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Log")
            .field("dir", &self.shared.dir)
            .field("durable_next", &self.next_offset())
            .finish_non_exhaustive()
    }
}

/// State shared by the handles, writer and readers of one log.
#[derive(Debug)]
pub(crate) struct Shared<S: Storage> {
    storage: S,
    dir: PathBuf,
    config: LogConfig,
    /// Oldest first; the last one is active. Writer pushes, retention pops
    /// from the front; readers clone `Arc`s out.
    segments: RwLock<Vec<Arc<Segment<S::File>>>>,
    /// One past the last durable record.
    durable_next: AtomicU64,
    /// One past the last record whose bytes are in its segment file,
    /// durable or not (`>= durable_next`).
    written_next: AtomicU64,
    /// Bumped whenever `written_next` or `durable_next` moves or the log is
    /// poisoned: async waiters subscribe to it (threads use `synced`).
    moved: tokio::sync::watch::Sender<()>,
    last_durable: Mutex<Option<Durable>>,
    writer: Mutex<WriterState<S::File>>,
    /// Signalled whenever the durable watermark moves or the log is poisoned.
    synced: Condvar,
    cursors: Mutex<CursorStore<S>>,
    pressure: Mutex<Vec<ConsumerPressure>>,
    counters: Counters,
    /// Set when this handle follows a log another process writes
    /// ([`Log::follow`]): it never appends, deletes or recovers.
    follower: Option<follow::Follower<S::File>>,
}

/// Locks a mutex whose data stays consistent even if a holder panicked
/// (plain values replaced whole). The writer mutex is not one of them.
fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<S: Storage> Shared<S> {
    fn segments(&self) -> RwLockReadGuard<'_, Vec<Arc<Segment<S::File>>>> {
        // Mutations are single push/drain calls; the list stays consistent.
        self.segments.read().unwrap_or_else(|p| p.into_inner())
    }

    fn segments_mut(&self) -> RwLockWriteGuard<'_, Vec<Arc<Segment<S::File>>>> {
        self.segments.write().unwrap_or_else(|p| p.into_inner())
    }

    fn first_offset(&self) -> u64 {
        self.segments().first().map_or(0, |s| s.base)
    }

    fn durable_next(&self) -> u64 {
        self.durable_next.load(Ordering::Acquire)
    }

    fn written_next(&self) -> u64 {
        self.written_next.load(Ordering::Acquire)
    }

    /// One past the last record a reader up to `horizon` may yield.
    fn end(&self, horizon: Horizon) -> u64 {
        match horizon {
            Horizon::Durable => self.durable_next(),
            Horizon::Written => self.written_next(),
        }
    }

    /// Publishes a new durable watermark (called under the writer mutex, so
    /// it only moves forward).
    fn publish_durable(&self, next: u64, last: Option<Durable>) {
        *relock(&self.last_durable) = last;
        self.durable_next.store(next, Ordering::Release);
        self.moved.send_replace(());
    }

    /// Publishes how far records are in their segment files (called under
    /// the writer mutex once nothing is left in the scratch buffer).
    fn publish_written(&self, next: u64) {
        if next > self.written_next.load(Ordering::Relaxed) {
            self.written_next.store(next, Ordering::Release);
            self.moved.send_replace(());
        }
    }
}

impl<S: Storage> Log<S> {
    /// Opens (creating if needed) the log in `dir`, recovering from whatever
    /// a crash left: see [`OpenReport`] for what was repaired.
    pub fn open(
        storage: S,
        dir: impl Into<PathBuf>,
        config: LogConfig,
    ) -> Result<(Log<S>, OpenReport), Error> {
        let dir = dir.into();
        storage
            .create_dir_all(&dir)
            .map_err(Error::io("create log directory", &dir))?;
        let mut removed_files = Vec::new();

        let legacy = dir.join(LEGACY_SPILL_DIR);
        match storage.list(&legacy) {
            Ok(names) => {
                for name in names {
                    // Scratch of transactions that were never appended,
                    // hence never acknowledged: the source sends them again.
                    let path = legacy.join(name);
                    storage
                        .remove(&path)
                        .map_err(Error::io("remove stale spill file", &path))?;
                    removed_files.push(path);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("list spill directory", &legacy)(e)),
        }

        let recovered = recovery::recover(&storage, &dir, &config)?;
        removed_files.extend(recovered.removed_files);
        let (cursors, removed_temps) = CursorStore::load(storage.clone(), &dir.join(CURSOR_DIR))?;
        removed_files.extend(removed_temps);

        let first = recovered.segments.first().map_or(0, |s| s.base);
        let next = recovered.next_offset;
        for (consumer, position) in cursors.all() {
            if position.next_offset < first || position.next_offset > next {
                return Err(Error::CursorOutOfRange {
                    consumer: consumer.clone(),
                    cursor: position.next_offset,
                    first,
                    next,
                });
            }
        }

        let report = OpenReport {
            segments: recovered.segments.len(),
            first_offset: first,
            next_offset: next,
            last_durable: recovered.last,
            torn_tail: recovered.torn_tail,
            rebuilt_indexes: recovered.rebuilt_indexes,
            removed_files,
        };
        let active = recovered
            .segments
            .last()
            .cloned()
            .ok_or_else(|| Error::Io {
                op: "find the active segment in",
                path: dir.clone(),
                source: std::io::Error::other("recovery returned no segments"),
            })?;
        let watermark = watermark::WatermarkFile::open(&storage, &dir)?;
        // What recovery found is durable (it fsynced the last segment).
        watermark
            .publish(next, (active.base, recovered.active_len))
            .map_err(Error::io(
                "write watermark file",
                dir.join(watermark::WATERMARK_FILE),
            ))?;
        let shared = Shared {
            storage,
            config,
            segments: RwLock::new(recovered.segments),
            durable_next: AtomicU64::new(next),
            written_next: AtomicU64::new(next),
            moved: tokio::sync::watch::Sender::new(()),
            last_durable: Mutex::new(recovered.last),
            writer: Mutex::new(WriterState::new(
                active,
                recovered.active_len,
                next,
                recovered.last,
                Some(watermark),
            )),
            follower: None,
            synced: Condvar::new(),
            cursors: Mutex::new(cursors),
            pressure: Mutex::new(Vec::new()),
            counters: Counters::default(),
            dir,
        };
        tracing::info!(
            dir = %shared.dir.display(),
            segments = report.segments,
            first_offset = first,
            next_offset = next,
            torn_tail = report.torn_tail.is_some(),
            "opened segment log"
        );
        Ok((
            Log {
                shared: Arc::new(shared),
            },
            report,
        ))
    }

    /// Appends one record and returns its offset once it is durable.
    pub fn append(&self, commit_lsn: u64, payload: &[u8]) -> Result<u64, Error> {
        self.shared
            .append_records(&[(commit_lsn, payload)], true)
            .map(|range| range.start)
    }

    /// Appends records in order with a single durability wait; returns their
    /// offsets. If it fails, any prefix of the batch may be durable (the
    /// caller re-sends: a duplicate, never a gap).
    pub fn append_batch<P: AsRef<[u8]>>(
        &self,
        records: impl IntoIterator<Item = (u64, P)>,
    ) -> Result<Range<u64>, Error> {
        let records: Vec<(u64, P)> = records.into_iter().collect();
        self.shared.append_records(&records, true)
    }

    /// Writes records in order without waiting for them to be durable:
    /// [`Log::read_written_from`] readers see them at once, nothing else
    /// does until [`Log::sync_through`] (or any later append) covered them.
    pub fn write_batch<P: AsRef<[u8]>>(
        &self,
        records: impl IntoIterator<Item = (u64, P)>,
    ) -> Result<Range<u64>, Error> {
        let records: Vec<(u64, P)> = records.into_iter().collect();
        self.shared.append_records(&records, false)
    }

    /// [`append_batch`](Log::append_batch) for async callers: the records
    /// are written at once (and readable by [`Log::read_written_from`]
    /// readers), then the fsync runs as in [`Log::sync_through`].
    pub async fn append_batch_async<P: AsRef<[u8]>>(
        &self,
        records: impl IntoIterator<Item = (u64, P)>,
    ) -> Result<Range<u64>, Error> {
        let written = self.write_batch(records)?;
        self.sync_through(written.end).await?;
        Ok(written)
    }

    /// Returns once every record below `end` is durable, fsyncing (group
    /// commit) if no fsync covering it is in flight. On real storage the
    /// fsync runs on a blocking thread, so other tasks of the caller's
    /// runtime (an applier working on the records just written) run
    /// meanwhile, and a caller that finds one in flight awaits its outcome
    /// instead of parking a thread on it; on the simulator's storage it
    /// runs inline, deterministically.
    pub async fn sync_through(&self, end: u64) -> Result<(), Error> {
        // Subscribed before looking, so no move between the two is missed.
        let mut moved = self.subscribe();
        loop {
            if self.shared.durable_next() >= end {
                return Ok(());
            }
            if !self.shared.storage.sync_blocks() {
                return self.shared.sync_through(end);
            }
            if !self.shared.sync_in_flight()? {
                break;
            }
            if moved.changed().await.is_err() {
                break;
            }
        }
        let shared = Arc::clone(&self.shared);
        tokio::task::spawn_blocking(move || shared.sync_through(end))
            .await
            .map_err(|e| Error::Io {
                op: "wait for the fsync of",
                path: self.shared.dir.clone(),
                source: std::io::Error::other(e),
            })?
    }

    /// Appends one record whose `len`-byte payload is read from `source`,
    /// in bounded chunks, and returns its offset once it is durable. If
    /// `source` fails or ends early, nothing is appended.
    pub fn append_from(
        &self,
        commit_lsn: u64,
        len: u64,
        source: &mut dyn Read,
    ) -> Result<u64, Error> {
        let mut chunk = Vec::with_capacity(64 * 1024);
        self.shared
            .append_stream(commit_lsn, len, source, &mut chunk)
    }

    /// Waits until everything appended so far is durable. Fails with
    /// [`Error::Poisoned`] once the log is poisoned.
    pub fn sync(&self) -> Result<(), Error> {
        self.shared.sync_all()
    }

    /// Reads durable records from `offset` on, across segments. The reader
    /// returns `None` when it has caught up with the durable end; calling
    /// it again later yields records appended since.
    pub fn read_from(&self, offset: u64) -> Result<Reader<S>, Error> {
        self.reader(offset, Horizon::Durable)
    }

    /// Like [`read_from`](Log::read_from), but up to the written end: records
    /// may not be durable yet, and may vanish in a crash together with
    /// whatever the reader did with them that was not made durable. A
    /// consumer acts on them durably only after [`Log::sync_through`].
    pub fn read_written_from(&self, offset: u64) -> Result<Reader<S>, Error> {
        self.reader(offset, Horizon::Written)
    }

    fn reader(&self, offset: u64, horizon: Horizon) -> Result<Reader<S>, Error> {
        let first = self.shared.first_offset();
        let next = self.shared.end(horizon);
        if offset < first {
            return Err(Error::OffsetTruncated {
                requested: offset,
                first,
            });
        }
        if offset > next {
            return Err(Error::OffsetBeyondEnd {
                requested: offset,
                next,
            });
        }
        Ok(Reader::new(Arc::clone(&self.shared), offset, horizon))
    }

    /// The last durable record, if any.
    pub fn last_durable(&self) -> Option<Durable> {
        *relock(&self.shared.last_durable)
    }

    /// One past the last durable record: the offset the next append gets
    /// (once everything in flight is durable).
    pub fn next_offset(&self) -> u64 {
        self.shared.durable_next()
    }

    /// One past the last written record, durable or not.
    pub fn written_end(&self) -> u64 {
        self.shared.written_next()
    }

    /// Changes whenever the written or durable end moves or the log is
    /// poisoned; check the condition after subscribing, then await
    /// `changed()`, and no move is missed.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<()> {
        self.shared.moved.subscribe()
    }

    /// The oldest offset still in the log.
    pub fn first_offset(&self) -> u64 {
        self.shared.first_offset()
    }

    pub fn stats(&self) -> LogStats {
        let c = &self.shared.counters;
        LogStats {
            records: c.records.load(Ordering::Relaxed),
            append_calls: c.append_calls.load(Ordering::Relaxed),
            fsyncs: c.fsyncs.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            segments_rolled: c.segments_rolled.load(Ordering::Relaxed),
            looks: c.looks.load(Ordering::Relaxed),
        }
    }

    /// Whether a failed write or fsync poisoned this handle's log.
    pub fn is_poisoned(&self) -> bool {
        self.shared.is_poisoned()
    }

    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Durably replaces the metadata blob `name` kept with the log
    /// (`meta/<name>`).
    pub fn write_meta(&self, name: &str, bytes: &[u8]) -> Result<(), Error> {
        meta::write(&self.shared.storage, &self.shared.dir, name, bytes)
    }

    /// The metadata blob `name`, if one was written.
    pub fn read_meta(&self, name: &str) -> Result<Option<Vec<u8>>, Error> {
        meta::read(&self.shared.storage, &self.shared.dir, name)
    }

    pub fn segments(&self) -> Vec<SegmentInfo> {
        let segments = self.shared.segments();
        let last = segments.len().saturating_sub(1);
        segments
            .iter()
            .enumerate()
            .map(|(i, s)| SegmentInfo {
                path: s.path.clone(),
                base_offset: s.base,
                bytes: s.len(),
                sealed: i < last,
            })
            .collect()
    }

    /// Registers `consumer` (durably) starting at the oldest retained
    /// offset, or returns its position if it is already registered.
    pub fn register_consumer(&self, consumer: &str) -> Result<CursorPosition, Error> {
        self.register_at(consumer, self.shared.first_offset())
    }

    /// Registers `consumer` at the end of what is durable now (an existing
    /// cursor stays where it is): a sink about to take a boundary of its
    /// own, whose transactions all come after this point.
    pub fn register_consumer_at_end(&self, consumer: &str) -> Result<CursorPosition, Error> {
        self.register_at(consumer, self.shared.durable_next())
    }

    fn register_at(&self, consumer: &str, offset: u64) -> Result<CursorPosition, Error> {
        cursor::validate_name(consumer)?;
        let mut cursors = relock(&self.shared.cursors);
        if let Some(position) = cursors.get(consumer) {
            return Ok(position);
        }
        let position = CursorPosition::start_at(offset);
        cursors.persist(consumer, position)?;
        Ok(position)
    }

    /// Durably moves `consumer`'s cursor; the position must lie within the
    /// durable records (`first_offset()..=next_offset()`).
    pub fn commit_cursor(&self, consumer: &str, position: CursorPosition) -> Result<(), Error> {
        let mut cursors = relock(&self.shared.cursors);
        if cursors.get(consumer).is_none() {
            return Err(Error::UnknownConsumer {
                consumer: consumer.to_owned(),
            });
        }
        let first = self.shared.first_offset();
        let next = self.shared.durable_next();
        if position.next_offset < first || position.next_offset > next {
            return Err(Error::CursorOutOfRange {
                consumer: consumer.to_owned(),
                cursor: position.next_offset,
                first,
                next,
            });
        }
        cursors.persist(consumer, position)
    }

    pub fn cursor(&self, consumer: &str) -> Option<CursorPosition> {
        relock(&self.shared.cursors).get(consumer)
    }

    /// Every registered consumer and its position, by name.
    pub fn cursors(&self) -> Vec<(String, CursorPosition)> {
        relock(&self.shared.cursors)
            .all()
            .iter()
            .map(|(name, position)| (name.clone(), *position))
            .collect()
    }

    /// Reads every cursor again from the disk: a consumer in another
    /// process ([`Log::follow`]) commits its own there, and retention
    /// must keep what it still needs.
    pub fn reload_cursors(&self) -> Result<(), Error> {
        relock(&self.shared.cursors).reload()
    }

    /// Durably forgets `consumer`; it no longer holds back retention.
    pub fn unregister_consumer(&self, consumer: &str) -> Result<(), Error> {
        relock(&self.shared.cursors).remove(consumer)
    }

    /// Applies [`LogConfig::retention`]: deletes the sealed segments it allows
    /// and every cursor has passed; reports consumers holding the rest.
    pub fn enforce_retention(&self) -> Result<RetentionReport, Error> {
        self.enforce_retention_with(&self.shared.config.retention)
    }

    /// [`Log::enforce_retention`] with another policy: one a reload changed
    /// since the log was opened.
    pub fn enforce_retention_with(
        &self,
        policy: &RetentionPolicy,
    ) -> Result<RetentionReport, Error> {
        let shared = &self.shared;
        if shared.follower.is_some() {
            return Err(Error::ReadOnly {
                dir: shared.dir.clone(),
            });
        }
        // Held throughout, so no cursor can move back into a segment while
        // it is being deleted.
        let cursors = relock(&shared.cursors);
        let snapshot: Vec<Arc<Segment<S::File>>> = shared.segments().clone();
        let sealed: Vec<retention::SealedFacts> = snapshot
            .iter()
            .zip(snapshot.iter().skip(1))
            .map(|(segment, following)| retention::SealedFacts {
                path: segment.path.clone(),
                base_offset: segment.base,
                next_offset: following.base,
                bytes: segment.len(),
                sealed_unix_ms: following.created_unix_ms,
            })
            .collect();
        let total_bytes = snapshot.iter().map(|s| s.len()).sum();
        let plan = retention::plan(
            policy,
            &sealed,
            total_bytes,
            snapshot.len(),
            shared.config.clock.now_unix_ms(),
            cursors.all(),
        );
        let mut report = RetentionReport {
            deleted: Vec::new(),
            pressure: plan.pressure,
        };
        for (facts, segment) in sealed.iter().zip(&snapshot).take(plan.delete) {
            // Out of the reader-visible list first, then off the disk,
            // oldest first with a directory fsync each, so a crash leaves a
            // contiguous log.
            shared.segments_mut().retain(|s| !Arc::ptr_eq(s, segment));
            shared
                .storage
                .remove(&segment.path)
                .map_err(Error::io("remove segment", &segment.path))?;
            if let Err(error) = shared.storage.remove(&segment.index_path)
                && error.kind() != std::io::ErrorKind::NotFound
            {
                // The index is a cache; an orphan is removed on next open.
                tracing::warn!(path = %segment.index_path.display(), %error, "could not remove index");
            }
            shared
                .storage
                .sync_dir(&shared.dir)
                .map_err(Error::io("fsync log directory", &shared.dir))?;
            tracing::info!(
                segment = %segment.path.display(),
                base_offset = facts.base_offset,
                bytes = facts.bytes,
                "retention deleted segment"
            );
            report.deleted.push(DeletedSegment {
                path: facts.path.clone(),
                base_offset: facts.base_offset,
                next_offset: facts.next_offset,
                bytes: facts.bytes,
            });
        }
        for held in &report.pressure {
            tracing::warn!(
                consumer = %held.consumer,
                held_segments = held.held_segments,
                held_bytes = held.held_bytes,
                "retention blocked by consumer cursor"
            );
        }
        *relock(&shared.pressure) = report.pressure.clone();
        Ok(report)
    }

    /// Consumers that held back the last retention pass.
    pub fn retention_pressure(&self) -> Vec<ConsumerPressure> {
        relock(&self.shared.pressure).clone()
    }
}
