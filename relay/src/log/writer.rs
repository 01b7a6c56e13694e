//! The append path and group commit.
//!
//! Appenders take the writer mutex, frame their records and write them to
//! the active segment (small frames are coalesced in a scratch buffer and
//! written with one call), then wait until the durable watermark covers
//! their last offset. The first waiter that finds no fsync in flight becomes
//! the *leader*: it notes how far the file has been written, releases the
//! mutex, fsyncs, and on success moves the watermark to that point, waking
//! everyone. Appenders that arrive during an fsync write their frames and
//! wait for the next one, so N concurrent appenders cost far fewer than N
//! fsyncs (measured by `LogStats::fsyncs`, asserted in `log_group_commit`).
//!
//! Invariants:
//! * Offsets are assigned and bytes written under the writer mutex, so file
//!   order is offset order.
//! * The watermark moves only after an fsync covering it returned `Ok`, and
//!   only forward.
//! * Rolling fsyncs the old segment, then creates, fsyncs and
//!   directory-fsyncs the new one before writing into it, so a sealed
//!   segment is always complete on disk.
//! * Any write, truncate or fsync error on this path poisons the log; see
//!   [`Error::Poisoned`].

use std::io::{self, Read};
use std::ops::{Deref, DerefMut, Range};
use std::path::PathBuf;
use std::sync::{Arc, MutexGuard};

use super::error::Error;
use super::frame::{
    FRAME_CHECKSUM_AT, FRAME_HEADER_LEN, FrameHeader, SEGMENT_HEADER_LEN, SegmentHeader,
};
use super::index::{self, SealedSummary, SparseIndex};
use super::segment::Segment;
use super::storage::{OpenMode, Storage, StorageFile, SyncMode};
use super::watermark::WatermarkFile;
use super::{Counters, Durable, MAX_PAYLOAD_LEN, Shared};

/// Payloads at least this big are written directly instead of being copied
/// into the scratch buffer.
const DIRECT_WRITE_BYTES: usize = 64 * 1024;
/// The scratch buffer is written out once it holds this much.
const SCRATCH_FLUSH_BYTES: usize = 1024 * 1024;

/// Everything the writer mutex protects.
#[derive(Debug)]
pub(crate) struct WriterState<F> {
    active: Arc<Segment<F>>,
    /// Bytes of the active segment including frames still in `scratch`.
    active_len: u64,
    /// The offset the next record gets.
    next_offset: u64,
    last_written: Option<Durable>,
    /// One past the last record known durable.
    synced_next: u64,
    sync_in_progress: bool,
    /// Set by the first failed write or fsync; the file it happened on.
    poisoned: Option<PathBuf>,
    /// Encoded frames not yet written to the active segment.
    scratch: Vec<u8>,
    /// Tells followers in other processes what is durable; None in a
    /// follower's own handle.
    watermark: Option<WatermarkFile<F>>,
}

impl<F: StorageFile> WriterState<F> {
    pub fn new(
        active: Arc<Segment<F>>,
        active_len: u64,
        next_offset: u64,
        last: Option<Durable>,
        watermark: Option<WatermarkFile<F>>,
    ) -> Self {
        WriterState {
            watermark,
            active,
            active_len,
            next_offset,
            last_written: last,
            synced_next: next_offset,
            sync_in_progress: false,
            poisoned: None,
            scratch: Vec::new(),
        }
    }

    fn check_poisoned(&self) -> Result<(), Error> {
        match &self.poisoned {
            Some(path) => Err(Error::Poisoned { path: path.clone() }),
            None => Ok(()),
        }
    }
}

/// A borrowed buffer that is emptied when dropped, whatever happened.
struct Scratch<'a>(&'a mut Vec<u8>);

impl Deref for Scratch<'_> {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        self.0
    }
}

impl DerefMut for Scratch<'_> {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        self.0
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        self.0.clear();
    }
}

type Guard<'a, F> = MutexGuard<'a, WriterState<F>>;

impl<S: Storage> Shared<S> {
    fn lock_writer(&self) -> Result<Guard<'_, S::File>, Error> {
        if self.follower.is_some() {
            return Err(Error::ReadOnly {
                dir: self.dir.clone(),
            });
        }
        // A panic while holding the writer mutex may have left offsets and
        // bytes out of step: refuse to write rather than guess.
        self.writer.lock().map_err(|_| Error::Poisoned {
            path: self.dir.clone(),
        })
    }

    pub(crate) fn is_poisoned(&self) -> bool {
        self.follower.is_none() && self.lock_writer().map_or(true, |w| w.poisoned.is_some())
    }

    /// Records the first I/O failure on the append path and wakes waiters.
    fn poison(
        &self,
        w: &mut WriterState<S::File>,
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    ) -> Error {
        tracing::error!(path = %path.display(), op, error = %source, "segment log poisoned");
        if w.poisoned.is_none() {
            w.poisoned = Some(path.clone());
        }
        self.synced.notify_all();
        self.moved.send_replace(());
        Error::Io { op, path, source }
    }

    fn mark_synced(
        &self,
        w: &mut WriterState<S::File>,
        upto: u64,
        last: Option<Durable>,
        end: (u64, u64),
    ) -> Result<(), Error> {
        if upto > w.synced_next {
            w.synced_next = upto;
            self.publish_durable(upto, last);
            if let Some(Err(e)) = w.watermark.as_ref().map(|m| m.publish(upto, end)) {
                let path = self.dir.join(super::watermark::WATERMARK_FILE);
                return Err(self.poison(w, "write watermark file", path, e));
            }
        }
        Ok(())
    }

    /// Writes the scratch buffer out; afterwards every record below
    /// `next_offset` is in its segment file.
    fn flush_scratch(&self, w: &mut WriterState<S::File>) -> Result<(), Error> {
        if !w.scratch.is_empty() {
            let active = Arc::clone(&w.active);
            if let Err(e) = active.file.append(&w.scratch) {
                return Err(self.poison(w, "write segment", active.path.clone(), e));
            }
            w.scratch.clear();
            active.set_len(w.active_len);
        }
        self.publish_written(w.next_offset);
        Ok(())
    }

    /// Seals the active segment and starts a new one at `next_offset`.
    fn roll(&self, w: &mut WriterState<S::File>) -> Result<(), Error> {
        self.flush_scratch(w)?;
        let old = Arc::clone(&w.active);
        if let Err(e) = old.file.sync(SyncMode::Data) {
            return Err(self.poison(w, "fsync segment", old.path.clone(), e));
        }
        Counters::add(&self.counters.fsyncs, 1);
        let (upto, last) = (w.next_offset, w.last_written);
        self.mark_synced(w, upto, last, (old.base, w.active_len))?;
        self.synced.notify_all();

        // Persist the sealed segment's index; it is a cache, so failing is
        // only worth a warning (the next open rebuilds it).
        let summary = SealedSummary {
            next_offset: w.next_offset,
            segment_len: w.active_len,
            last_commit_lsn: w
                .last_written
                .filter(|d| d.offset >= old.base)
                .map(|d| d.commit_lsn),
        };
        let bytes = index::encode(old.base, &summary, &old.index());
        let written = self
            .storage
            .open(&old.index_path, OpenMode::Truncate)
            .and_then(|f| f.append(&bytes));
        if let Err(error) = written {
            tracing::warn!(path = %old.index_path.display(), %error, "could not write segment index");
        }

        let segment = match self.create_segment(w.next_offset) {
            Ok(segment) => segment,
            Err((op, path, e)) => return Err(self.poison(w, op, path, e)),
        };
        let segment = Arc::new(segment);
        self.segments_mut().push(Arc::clone(&segment));
        w.active = segment;
        w.active_len = SEGMENT_HEADER_LEN as u64;
        Counters::add(&self.counters.segments_rolled, 1);
        tracing::debug!(base_offset = w.next_offset, "rolled to new segment");
        Ok(())
    }

    /// Creates segment `base` durably: header written and fsynced, directory
    /// entry fsynced.
    fn create_segment(
        &self,
        base: u64,
    ) -> Result<Segment<S::File>, (&'static str, PathBuf, io::Error)> {
        let path = self.dir.join(super::segment::segment_name(base));
        let created_unix_ms = self.config.clock.now_unix_ms();
        let header = SegmentHeader {
            base_offset: base,
            created_unix_ms,
        };
        let file = self
            .storage
            .open(&path, OpenMode::Truncate)
            .map_err(|e| ("create segment", path.clone(), e))?;
        file.append(&header.encode())
            .map_err(|e| ("write segment header", path.clone(), e))?;
        file.sync(SyncMode::All)
            .map_err(|e| ("fsync segment", path.clone(), e))?;
        self.storage
            .sync_dir(&self.dir)
            .map_err(|e| ("fsync log directory", self.dir.clone(), e))?;
        Ok(Segment::new(
            &self.dir,
            base,
            Arc::new(file),
            created_unix_ms,
            SEGMENT_HEADER_LEN as u64,
            SparseIndex::new(self.config.index_interval_bytes),
        ))
    }

    /// Rolls first if a frame of `frame_len` bytes would overflow a
    /// non-empty active segment.
    fn make_room(&self, w: &mut WriterState<S::File>, frame_len: u64) -> Result<(), Error> {
        let has_records = w.active_len > SEGMENT_HEADER_LEN as u64;
        if has_records && w.active_len + frame_len > self.config.max_segment_bytes {
            self.roll(w)?;
        }
        Ok(())
    }

    /// Bookkeeping after the frame of `offset` was placed at `pos`.
    fn note_frame(
        &self,
        w: &mut WriterState<S::File>,
        offset: u64,
        commit_lsn: u64,
        pos: u64,
        frame_len: u64,
    ) {
        w.active.index_mut().observe(offset, pos);
        w.active_len = pos + frame_len;
        w.next_offset = offset + 1;
        w.last_written = Some(Durable { offset, commit_lsn });
        Counters::add(&self.counters.records, 1);
        Counters::add(&self.counters.bytes, frame_len);
    }

    fn write_frame(
        &self,
        w: &mut WriterState<S::File>,
        commit_lsn: u64,
        payload: &[u8],
    ) -> Result<(), Error> {
        let frame_len = (FRAME_HEADER_LEN + payload.len()) as u64;
        self.make_room(w, frame_len)?;
        let offset = w.next_offset;
        let pos = w.active_len;
        let header = FrameHeader::for_payload(offset, commit_lsn, payload).map_err(|_| {
            Error::PayloadTooLarge {
                len: payload.len() as u64,
                max: MAX_PAYLOAD_LEN,
            }
        })?;
        if payload.len() >= DIRECT_WRITE_BYTES {
            self.flush_scratch(w)?;
            let active = Arc::clone(&w.active);
            let written = active
                .file
                .append(&header.encode())
                .and_then(|()| active.file.append(payload));
            if let Err(e) = written {
                return Err(self.poison(w, "write segment", active.path.clone(), e));
            }
            self.note_frame(w, offset, commit_lsn, pos, frame_len);
            active.set_len(w.active_len);
            self.publish_written(w.next_offset);
        } else {
            w.scratch.extend_from_slice(&header.encode());
            w.scratch.extend_from_slice(payload);
            self.note_frame(w, offset, commit_lsn, pos, frame_len);
            if w.scratch.len() >= SCRATCH_FLUSH_BYTES {
                self.flush_scratch(w)?;
            }
        }
        Ok(())
    }

    /// Writes `records`; with `wait`, returns only once they are durable.
    pub(crate) fn append_records<P: AsRef<[u8]>>(
        &self,
        records: &[(u64, P)],
        wait: bool,
    ) -> Result<Range<u64>, Error> {
        // Check every size first so a rejected batch writes nothing.
        if let Some((_, p)) = records
            .iter()
            .find(|(_, p)| p.as_ref().len() as u64 > MAX_PAYLOAD_LEN)
        {
            return Err(Error::PayloadTooLarge {
                len: p.as_ref().len() as u64,
                max: MAX_PAYLOAD_LEN,
            });
        }
        let mut w = self.lock_writer()?;
        w.check_poisoned()?;
        Counters::add(&self.counters.append_calls, 1);
        let start = w.next_offset;
        for (commit_lsn, payload) in records {
            self.write_frame(&mut w, *commit_lsn, payload.as_ref())?;
        }
        self.flush_scratch(&mut w)?;
        let end = w.next_offset;
        if wait && end > start {
            self.wait_durable(w, end)?;
        }
        Ok(start..end)
    }

    /// Appends one record of `len` bytes read from `source` through `chunk`
    /// (whose capacity sets the copy size; it is left empty).
    pub(crate) fn append_stream(
        &self,
        commit_lsn: u64,
        len: u64,
        source: &mut dyn Read,
        chunk: &mut Vec<u8>,
    ) -> Result<u64, Error> {
        let payload_len = u32::try_from(len).map_err(|_| Error::PayloadTooLarge {
            len,
            max: MAX_PAYLOAD_LEN,
        })?;
        let mut chunk = Scratch(chunk);
        let copy = chunk.capacity().max(1);
        chunk.resize(copy, 0);

        let mut w = self.lock_writer()?;
        w.check_poisoned()?;
        Counters::add(&self.counters.append_calls, 1);
        let frame_len = FRAME_HEADER_LEN as u64 + len;
        self.make_room(&mut w, frame_len)?;
        self.flush_scratch(&mut w)?;
        let offset = w.next_offset;
        let pos = w.active_len;
        let active = Arc::clone(&w.active);

        // The checksum precedes the payload but covers it: write the header
        // with a zero checksum, stream the payload through the hasher, then
        // patch the checksum in. A crash before the patch leaves a frame
        // that fails its checksum at the tail: a torn tail, cut on open.
        let mut hasher = FrameHeader::hasher(payload_len, offset, commit_lsn);
        let placeholder = FrameHeader {
            payload_len,
            offset,
            commit_lsn,
            checksum: 0,
        };
        if let Err(e) = active.file.append(&placeholder.encode()) {
            return Err(self.poison(&mut w, "write segment", active.path.clone(), e));
        }
        let mut read = 0u64;
        let mut source_error = None;
        while read < len {
            let want = usize::try_from(len - read).unwrap_or(usize::MAX).min(copy);
            let buf = chunk.get_mut(..want).unwrap_or_default();
            match source.read(buf) {
                Ok(0) => {
                    source_error = Some(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "payload source ended early",
                    ));
                    break;
                }
                Ok(n) => {
                    let bytes = buf.get(..n).unwrap_or_default();
                    hasher.update(bytes);
                    if let Err(e) = active.file.append(bytes) {
                        return Err(self.poison(&mut w, "write segment", active.path.clone(), e));
                    }
                    read += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    source_error = Some(e);
                    break;
                }
            }
        }
        if let Some(source) = source_error {
            // Cut the partial frame so the next record starts cleanly.
            if let Err(e) = active.file.truncate(pos) {
                return Err(self.poison(&mut w, "truncate segment", active.path.clone(), e));
            }
            return Err(Error::Source {
                expected: len,
                read,
                source,
            });
        }
        let checksum = hasher.digest().to_le_bytes();
        if let Err(e) = active
            .file
            .write_at(&checksum, pos + FRAME_CHECKSUM_AT as u64)
        {
            return Err(self.poison(&mut w, "write segment", active.path.clone(), e));
        }
        self.note_frame(&mut w, offset, commit_lsn, pos, frame_len);
        active.set_len(w.active_len);
        self.publish_written(w.next_offset);
        self.wait_durable(w, offset + 1)?;
        Ok(offset)
    }

    /// Waits until every record below `end` (or everything written, if
    /// less) is durable.
    pub(crate) fn sync_through(&self, end: u64) -> Result<(), Error> {
        let mut w = self.lock_writer()?;
        if w.synced_next >= end {
            return Ok(());
        }
        w.check_poisoned()?;
        self.flush_scratch(&mut w)?;
        let target = end.min(w.next_offset);
        self.wait_durable(w, target)
    }

    /// Whether an fsync is in flight; an error once the log is poisoned.
    pub(crate) fn sync_in_flight(&self) -> Result<bool, Error> {
        let w = self.lock_writer()?;
        w.check_poisoned()?;
        Ok(w.sync_in_progress)
    }

    /// Waits until everything written so far is durable.
    pub(crate) fn sync_all(&self) -> Result<(), Error> {
        self.sync_through(u64::MAX)
    }

    /// Group commit: returns once `synced_next >= target`, fsyncing as the
    /// leader if no fsync is in flight.
    fn wait_durable<'a>(&'a self, mut w: Guard<'a, S::File>, target: u64) -> Result<(), Error> {
        loop {
            if w.synced_next >= target {
                return Ok(());
            }
            w.check_poisoned()?;
            if w.sync_in_progress {
                w = self.synced.wait(w).map_err(|_| Error::Poisoned {
                    path: self.dir.clone(),
                })?;
                continue;
            }
            w.sync_in_progress = true;
            // Every caller wrote its frames out first, and earlier segments
            // were fsynced when they rolled: the bytes below `end` are all
            // this fsync has to cover.
            let upto = w.next_offset;
            let last = w.last_written;
            let active = Arc::clone(&w.active);
            debug_assert!(
                w.scratch.is_empty(),
                "frames left unwritten before an fsync"
            );
            let end = (active.base, w.active_len);
            drop(w);
            let result = active.file.sync(SyncMode::Data);
            w = self.lock_writer()?;
            w.sync_in_progress = false;
            match result {
                Ok(()) => {
                    Counters::add(&self.counters.fsyncs, 1);
                    let marked = self.mark_synced(&mut w, upto, last, end);
                    self.synced.notify_all();
                    // Async waiters watch for the fsync's end too, not only
                    // for a moved watermark: a segment roll during it may
                    // already have covered `upto`, and then nothing moved.
                    self.moved.send_replace(());
                    marked?;
                }
                Err(e) => return Err(self.poison(&mut w, "fsync segment", active.path.clone(), e)),
            }
        }
    }
}
