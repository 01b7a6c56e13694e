//! One transaction's encoded changes in bounded memory, and the envelopes
//! they will be cut into: the spool and chunk planner both capture paths
//! share (the extension's output plugin and the external relay).
//!
//! ```text
//!  push(change, relation) ─▶ plan: does it fit the open chunk? ─▶ record
//!                            (size, two versions of one relation)   [u32 len][u32 tag][bytes]
//!                                                                    memory ≤ budget, then an
//!  finish() ─▶ Planned { chunks, reader } ─▶ per chunk: its relations, unlinked 0600 file
//!                                             its records in order
//! ```
//!
//! Invariants:
//! - Memory held is at most the budget (and, once spilled, the file's 128 KiB
//!   buffer), however large the transaction: past it every record goes to
//!   an unlinked scratch file (never fsynced: a
//!   crash loses the transaction, which the source sends again because it
//!   was never acknowledged). The file disappears when the spool is dropped,
//!   when the process exits, and after a crash.
//! - A chunk's relations and changes fit `chunk_bytes` of envelope unless a
//!   single change alone is larger: it then gets a chunk of its own.
//! - Two versions of one relation (a schema change inside the transaction)
//!   never share a chunk, since an envelope carries one schema per relation.
//! - A truncate back to a mark (a subtransaction abort) forgets exactly the
//!   records after it; the chunk left open may keep a relation only the
//!   forgotten records used: an extra schema, never a missing one.
//! - Pure Rust, no server calls: `Drop` is safe during a backend's error
//!   cleanup.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;

/// Tag of a record that refers to no relation (a logical message).
pub const NO_RELATION: u32 = u32::MAX;

const RECORD_HEADER: usize = 8;
const FILE_BUFFER: usize = 128 * 1024;

/// A position in the spool: bytes and records before it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mark {
    pub bytes: u64,
    pub records: u64,
}

/// The relation a row change belongs to, as the planner needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelationUse {
    /// The record's tag: names one relation schema within the transaction.
    pub key: u32,
    /// The relation's id: two keys of one id are two versions of it.
    pub id: u32,
    /// Encoded length of the schema the envelope will carry.
    pub encoded_len: usize,
}

/// One planned envelope: where its records start and the relations they use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub start: Mark,
    /// `(key, id)` of each relation, in order of first use in the chunk.
    relations: Vec<(u32, u32)>,
    relation_bytes: usize,
}

impl Chunk {
    fn at(start: Mark) -> Chunk {
        Chunk {
            start,
            relations: Vec::new(),
            relation_bytes: 0,
        }
    }

    /// The keys of the relations its records use, in order of first use.
    pub fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.relations.iter().map(|(key, _)| *key)
    }
}

/// Bytes a length-delimited protobuf field of `len` bytes takes (1-byte key).
pub fn field_len(len: usize) -> usize {
    1 + prost::encoding::encoded_len_varint(len as u64) + len
}

/// `relation`, unless `chunk` already carries its schema.
fn new_to(chunk: &Chunk, relation: Option<RelationUse>) -> Option<RelationUse> {
    relation.filter(|r| !chunk.relations.iter().any(|(key, _)| *key == r.key))
}

/// A transaction's changes as they arrive, planned into chunks on the way.
#[derive(Debug)]
pub struct Spool {
    budget: usize,
    dir: PathBuf,
    chunk_bytes: usize,
    mem: Vec<u8>,
    /// Once spilled, every record is in the file and `mem` is empty.
    file: Option<BufWriter<File>>,
    spilled: u64,
    records: u64,
    peak_memory: usize,
    chunks: Vec<Chunk>,
    /// Envelope bytes the open chunk's changes and relations take.
    open_bytes: usize,
    /// A write to the file failed.
    broken: bool,
}

impl Spool {
    /// A spool keeping up to `budget` bytes in memory and the rest in a
    /// scratch file in `dir` (created 0700 on first spill), cutting chunks
    /// of at most `chunk_bytes` of relations and changes.
    pub fn new(budget: usize, dir: impl Into<PathBuf>, chunk_bytes: usize) -> Spool {
        Spool {
            budget,
            dir: dir.into(),
            chunk_bytes,
            mem: Vec::new(),
            file: None,
            spilled: 0,
            records: 0,
            peak_memory: 0,
            chunks: vec![Chunk::at(Mark::default())],
            open_bytes: 0,
            broken: false,
        }
    }

    pub fn mark(&self) -> Mark {
        Mark {
            bytes: self.spilled + self.mem.len() as u64,
            records: self.records,
        }
    }

    /// Records pushed and not truncated.
    pub fn records(&self) -> u64 {
        self.records
    }

    pub fn is_spilled(&self) -> bool {
        self.file.is_some()
    }

    /// Most bytes ever held in memory at once.
    pub fn peak_memory(&self) -> usize {
        self.peak_memory
    }

    /// Appends one encoded change, a row of `relation` or none.
    pub fn push(&mut self, change: &[u8], relation: Option<RelationUse>) -> io::Result<()> {
        self.usable()?;
        let len = u32::try_from(change.len()).map_err(|_| {
            io::Error::new(io::ErrorKind::InvalidInput, "an encoded change over 4 GiB")
        })?;
        let at = self.mark();
        let tag = relation.map_or(NO_RELATION, |r| r.key);
        let mut header = [0u8; RECORD_HEADER];
        header[..4].copy_from_slice(&len.to_le_bytes());
        header[4..].copy_from_slice(&tag.to_le_bytes());
        if self.file.is_none() && self.mem.len() + RECORD_HEADER + change.len() > self.budget {
            self.spill().inspect_err(|_| self.broken = true)?;
        }
        match &mut self.file {
            Some(file) => {
                // A failed write may leave part of the record buffered.
                let written = file
                    .write_all(&header)
                    .and_then(|()| file.write_all(change));
                written.inspect_err(|_| self.broken = true)?;
                self.spilled += (RECORD_HEADER + change.len()) as u64;
            }
            None => {
                // Grow geometrically, but never past the budget.
                let needed = self.mem.len() + RECORD_HEADER + change.len();
                if needed > self.mem.capacity() {
                    let target = (self.mem.capacity() * 2).clamp(needed, self.budget.max(needed));
                    self.mem.reserve_exact(target - self.mem.len());
                }
                self.mem.extend_from_slice(&header);
                self.mem.extend_from_slice(change);
                self.peak_memory = self.peak_memory.max(self.mem.capacity());
            }
        }
        self.plan(at, change.len(), relation);
        self.records += 1;
        Ok(())
    }

    /// Refuses to go on once a write failed: what the file holds past the
    /// last whole record is then unknown.
    fn usable(&self) -> io::Result<()> {
        if self.broken {
            return Err(io::Error::other(
                "the transaction's spool file failed earlier",
            ));
        }
        Ok(())
    }

    /// Places the change pushed at `at` in the open chunk, or opens one.
    fn plan(&mut self, at: Mark, len: usize, relation: Option<RelationUse>) {
        let open = self
            .chunks
            .last()
            .expect("a spool always has an open chunk");
        let new = new_to(open, relation);
        let conflict = new.is_some_and(|r| open.relations.iter().any(|(_, id)| *id == r.id));
        let cost = field_len(len) + new.map_or(0, |r| field_len(r.encoded_len));
        if at.records > open.start.records
            && (conflict || self.open_bytes.saturating_add(cost) > self.chunk_bytes)
        {
            self.chunks.push(Chunk::at(at));
            self.open_bytes = 0;
        }
        let open = self
            .chunks
            .last_mut()
            .expect("a spool always has an open chunk");
        self.open_bytes += field_len(len);
        if let Some(r) = new_to(open, relation) {
            open.relations.push((r.key, r.id));
            open.relation_bytes += field_len(r.encoded_len);
            self.open_bytes += field_len(r.encoded_len);
        }
    }

    fn spill(&mut self) -> io::Result<()> {
        crate::owner_only::create_dir_all(&self.dir)?;
        // Unlinked from the start (O_TMPFILE where it exists): nothing to
        // clean up after a crash.
        let mut file = BufWriter::with_capacity(FILE_BUFFER, tempfile::tempfile_in(&self.dir)?);
        file.write_all(&self.mem)?;
        self.spilled = self.mem.len() as u64;
        self.mem = Vec::new();
        self.file = Some(file);
        Ok(())
    }

    /// Forgets every record after `mark`, and the chunks that started at
    /// or after it (the first chunk stays, perhaps empty).
    pub fn truncate(&mut self, mark: Mark) -> io::Result<()> {
        self.usable()?;
        match &mut self.file {
            Some(file) => {
                let cut = file
                    .flush()
                    .and_then(|()| file.get_mut().set_len(mark.bytes))
                    .and_then(|()| file.seek(SeekFrom::Start(mark.bytes)).map(drop));
                cut.inspect_err(|_| self.broken = true)?;
                self.spilled = mark.bytes;
            }
            None => self.mem.truncate(mark.bytes as usize),
        }
        self.records = mark.records;
        let kept = 1 + self
            .chunks
            .iter()
            .skip(1)
            .take_while(|c| c.start.records < mark.records)
            .count();
        self.chunks.truncate(kept);
        let open = self
            .chunks
            .last_mut()
            .expect("the first chunk is never dropped");
        if open.start.records == mark.records {
            // Nothing of the open chunk is left, so neither are its schemas.
            open.relations.clear();
            open.relation_bytes = 0;
        }
        // Spooled bytes over-count a change's framing (an 8-byte header
        // against at most 6), so the open chunk never grows past its target.
        self.open_bytes = (mark.bytes - open.start.bytes) as usize + open.relation_bytes;
        Ok(())
    }

    /// Ends the transaction: its chunks, and a reader of its records.
    pub fn finish(mut self) -> io::Result<Planned> {
        self.usable()?;
        let end = self.mark();
        let source = match self.file.take() {
            Some(file) => {
                let mut f = file.into_inner().map_err(|e| e.into_error())?;
                f.seek(SeekFrom::Start(0))?;
                Source::File(BufReader::with_capacity(FILE_BUFFER, f).take(self.spilled))
            }
            None => Source::Mem {
                buf: std::mem::take(&mut self.mem),
                at: 0,
            },
        };
        Ok(Planned {
            chunks: std::mem::take(&mut self.chunks),
            end,
            reader: Reader {
                source,
                buf: Vec::new(),
            },
        })
    }
}

/// A finished transaction: its chunks, read in order.
#[derive(Debug)]
pub struct Planned {
    chunks: Vec<Chunk>,
    end: Mark,
    reader: Reader,
}

/// One chunk of a finished transaction, as its envelope needs it.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub index: u32,
    pub count: u32,
    /// Sequence of its first change (its position in the transaction).
    pub first_sequence: u64,
    pub changes: u64,
    /// Spooled bytes of its records: a reserve hint, over the encoded size.
    pub bytes: u64,
}

impl Planned {
    /// How many envelopes the transaction takes: at least one, which holds
    /// no change when the transaction has none.
    pub fn count(&self) -> usize {
        self.chunks.len()
    }

    /// Changes in the transaction.
    pub fn total(&self) -> u64 {
        self.end.records
    }

    /// Chunk `index`, with the keys of the relations it uses.
    pub fn chunk(&self, index: usize) -> Option<(Span, &Chunk)> {
        let chunk = self.chunks.get(index)?;
        let end = self
            .chunks
            .get(index + 1)
            .map_or(self.end, |next| next.start);
        let span = Span {
            index: u32::try_from(index).ok()?,
            count: u32::try_from(self.chunks.len()).ok()?,
            first_sequence: chunk.start.records,
            changes: end.records - chunk.start.records,
            bytes: end.bytes - chunk.start.bytes,
        };
        Some((span, chunk))
    }

    /// The next record in transaction order and its tag; `None` at the end.
    /// The slice is valid until the next call.
    pub fn next_record(&mut self) -> io::Result<Option<(u32, &[u8])>> {
        self.reader.next_record()
    }
}

#[derive(Debug)]
enum Source {
    Mem { buf: Vec<u8>, at: usize },
    File(io::Take<BufReader<File>>),
}

#[derive(Debug)]
struct Reader {
    source: Source,
    buf: Vec<u8>,
}

fn truncated() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "a spooled record is truncated")
}

impl Reader {
    fn next_record(&mut self) -> io::Result<Option<(u32, &[u8])>> {
        let mut header = [0u8; RECORD_HEADER];
        match &mut self.source {
            Source::Mem { buf, at } => {
                if *at == buf.len() {
                    return Ok(None);
                }
                let bytes = buf.get(*at..*at + RECORD_HEADER).ok_or_else(truncated)?;
                header.copy_from_slice(bytes);
                *at += RECORD_HEADER;
            }
            Source::File(f) => {
                // The end is where the spool ended; a header cut short
                // there is an error, not an end.
                if f.limit() == 0 {
                    return Ok(None);
                }
                f.read_exact(&mut header)?;
            }
        }
        let [a, b, c, d, e, f, g, h] = header;
        let len = u32::from_le_bytes([a, b, c, d]) as usize;
        let tag = u32::from_le_bytes([e, f, g, h]);
        match &mut self.source {
            Source::Mem { buf, at } => {
                let start = *at;
                let bytes = buf.get(start..start + len).ok_or_else(truncated)?;
                *at += len;
                Ok(Some((tag, bytes)))
            }
            Source::File(f) => {
                // Exactly: a wide value would otherwise double the buffer.
                self.buf.clear();
                self.buf.reserve_exact(len);
                self.buf.resize(len, 0);
                f.read_exact(&mut self.buf)?;
                Ok(Some((tag, &self.buf)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(key: u32, id: u32, encoded_len: usize) -> Option<RelationUse> {
        Some(RelationUse {
            key,
            id,
            encoded_len,
        })
    }

    fn drain(planned: &mut Planned) -> Vec<(u32, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some((tag, r)) = planned.next_record().expect("read") {
            out.push((tag, r.to_vec()));
        }
        out
    }

    fn spans(planned: &Planned) -> Vec<(u64, u64)> {
        (0..planned.count())
            .map(|i| {
                let (span, _) = planned.chunk(i).expect("chunk");
                (span.first_sequence, span.changes)
            })
            .collect()
    }

    #[test]
    fn a_spilled_spool_reads_back_as_a_memory_one_within_its_budget() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records: Vec<(u32, Vec<u8>)> = (0..200u32)
            .map(|i| (i % 3, vec![i as u8; (i as usize * 7) % 300]))
            .collect();
        let mut read = Vec::new();
        for budget in [usize::MAX, 1000] {
            let mut spool = Spool::new(budget, dir.path(), usize::MAX);
            for (tag, r) in &records {
                spool.push(r, rel(*tag, *tag, 10)).expect("push");
            }
            assert_eq!(spool.is_spilled(), budget == 1000);
            assert!(spool.peak_memory() <= 1000 || budget == usize::MAX);
            read.push(drain(&mut spool.finish().expect("finish")));
        }
        assert_eq!(read[0], records);
        assert_eq!(read[1], records);
        // The scratch file was never linked into the directory.
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0);
    }

    #[test]
    fn truncate_forgets_after_the_mark_in_memory_and_on_disk() {
        let dir = tempfile::tempdir().expect("tempdir");
        for budget in [1 << 20, 16] {
            let mut spool = Spool::new(budget, dir.path(), usize::MAX);
            spool.push(b"a", None).expect("push");
            let mark = spool.mark();
            spool.push(b"bb", None).expect("push");
            spool.push(b"ccc", None).expect("push");
            spool.truncate(mark).expect("truncate");
            assert_eq!(spool.records(), 1);
            spool.push(b"d", None).expect("push");
            let mut planned = spool.finish().expect("finish");
            assert_eq!(planned.total(), 2);
            assert_eq!(
                drain(&mut planned),
                vec![(NO_RELATION, b"a".to_vec()), (NO_RELATION, b"d".to_vec())],
                "budget {budget}"
            );
        }
    }

    fn plan(records: &[(Option<RelationUse>, usize)], chunk_bytes: usize) -> Vec<(u64, u64)> {
        let mut spool = Spool::new(64, std::env::temp_dir(), chunk_bytes);
        for (relation, len) in records {
            spool.push(&vec![0u8; *len], *relation).expect("push");
        }
        spans(&spool.finish().expect("finish"))
    }

    #[test]
    fn chunks_respect_the_size_target() {
        // A relation of (1+1+20) and n changes of (1+1+50).
        let r = rel(0, 7, 20);
        let records = vec![(r, 50usize); 10];
        assert_eq!(plan(&records, 10_000), [(0, 10)]);
        // 22 + 3 * 52 = 178 <= 200 < 230.
        assert_eq!(plan(&records, 200), [(0, 3), (3, 3), (6, 3), (9, 1)]);
        // A change bigger than the target still gets its own envelope.
        assert_eq!(
            plan(&[(r, 50), (r, 5000), (r, 50)], 200),
            [(0, 1), (1, 1), (2, 1)]
        );
        // Messages need no relation.
        assert_eq!(plan(&[(None, 50); 4], 10_000), [(0, 4)]);
        assert_eq!(plan(&[], 10_000), [(0, 0)]);
    }

    #[test]
    fn two_versions_of_a_relation_never_share_a_chunk() {
        let (v0, other, v1) = (rel(0, 7, 20), rel(1, 8, 20), rel(2, 7, 24));
        let records = [
            (v0, 10),
            (other, 10),
            (v0, 10),
            (v1, 10),
            (other, 10),
            (v1, 10),
        ];
        assert_eq!(plan(&records, 10_000), [(0, 3), (3, 3)]);
    }

    #[test]
    fn a_chunk_lists_the_relations_its_records_use() {
        let mut spool = Spool::new(1 << 20, std::env::temp_dir(), 100);
        for key in [3, 1, 3, 2] {
            spool.push(&[0u8; 30], rel(key, key, 10)).expect("push");
        }
        let planned = spool.finish().expect("finish");
        let keys: Vec<Vec<u32>> = (0..planned.count())
            .map(|i| planned.chunk(i).expect("chunk").1.keys().collect())
            .collect();
        // (12 + 32) + (12 + 32) = 88 <= 100; a third change would not fit.
        assert_eq!(keys, [vec![3, 1], vec![3, 2]]);
    }

    #[test]
    fn a_subtransaction_abort_drops_the_chunks_it_opened() {
        let dir = tempfile::tempdir().expect("tempdir");
        for budget in [1 << 20, 16] {
            // Two changes with their relation (54 bytes each) fit, a third
            // (42) does not; after the abort the over-counted 72 bytes and
            // one more change (42) still fit one chunk.
            let mut spool = Spool::new(budget, dir.path(), 120);
            spool.push(&[1u8; 40], rel(0, 7, 10)).expect("push");
            let mark = spool.mark();
            for _ in 0..6 {
                spool.push(&[2u8; 40], rel(1, 8, 10)).expect("push");
            }
            spool.truncate(mark).expect("truncate");
            spool.push(&[3u8; 40], rel(0, 7, 10)).expect("push");
            let mut planned = spool.finish().expect("finish");
            assert_eq!(spans(&planned), [(0, 2)], "budget {budget}");
            assert_eq!(
                drain(&mut planned),
                vec![(0, vec![1u8; 40]), (0, vec![3u8; 40])]
            );
        }
    }

    #[test]
    fn an_abort_back_to_the_start_leaves_no_empty_chunk_and_no_stale_schema() {
        let mut spool = Spool::new(1 << 20, std::env::temp_dir(), 100);
        spool.push(&[1u8; 40], rel(0, 7, 10)).expect("push");
        spool.truncate(Mark::default()).expect("truncate");
        // Alone larger than the target: it must still open no second chunk.
        spool.push(&[2u8; 500], rel(1, 8, 10)).expect("push");
        let mut planned = spool.finish().expect("finish");
        assert_eq!(spans(&planned), [(0, 1)]);
        let keys: Vec<u32> = planned.chunk(0).expect("chunk").1.keys().collect();
        assert_eq!(keys, [1]);
        assert_eq!(drain(&mut planned), vec![(1, vec![2u8; 500])]);
    }

    #[test]
    fn an_abort_back_to_a_chunk_start_reopens_the_chunk_before_it() {
        let mut spool = Spool::new(1 << 20, std::env::temp_dir(), 120);
        spool.push(&[1u8; 40], rel(0, 7, 10)).expect("push");
        spool.push(&[1u8; 40], rel(0, 7, 10)).expect("push");
        // 54 + 42 fill the first chunk: the next change (42) starts the
        // second. Back at the mark the first counts 108 (spooled bytes
        // over-count) and a 1-byte message (3) still fits it.
        let mark = spool.mark();
        spool.push(&[2u8; 40], rel(0, 7, 10)).expect("push");
        spool.truncate(mark).expect("truncate");
        spool.push(&[3u8; 1], None).expect("push");
        let planned = spool.finish().expect("finish");
        assert_eq!(spans(&planned), [(0, 3)]);
    }

    #[test]
    fn a_spool_whose_file_failed_refuses_to_go_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("file-not-dir");
        std::fs::write(&missing, b"").expect("write");
        // The scratch directory is a file: the first spill fails.
        let mut spool = Spool::new(0, missing.join("spill"), 100);
        assert!(spool.push(b"x", None).is_err());
        assert!(spool.push(b"y", None).is_err());
        assert!(spool.truncate(Mark::default()).is_err());
        assert!(spool.finish().is_err());
    }

    #[test]
    fn field_len_counts_the_varint() {
        assert_eq!(field_len(0), 2);
        assert_eq!(field_len(127), 129);
        assert_eq!(field_len(128), 131);
        assert_eq!(field_len(16_384), 16_388);
    }
}
