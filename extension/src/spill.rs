//! A transaction's encoded changes, in order, in bounded memory.
//!
//! Each change is appended as a record `[u32 LE length][u32 LE relation
//! version][encoded Change]` (the relation version indexes the transaction's
//! relation schemas; [`NO_RELATION`] for logical messages). Records stay in a
//! `Vec` until it would exceed the memory budget; then the whole log moves to
//! an unlinked temp file under `$PGDATA/base/pgsql_tmp` and later records are
//! appended there through a buffered writer.
//!
//! Invariants:
//! - Memory held is at most the budget plus one record and the writer's
//!   buffer, however large the transaction.
//! - The spill file is unlinked right after it is created, so it disappears
//!   when the log is dropped, when the backend exits and after a crash; the
//!   log is dropped with the decoding context, also when decoding fails.
//! - Pure Rust: no PostgreSQL calls, so `Drop` is safe during error cleanup.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Relation version of a record that refers to no relation.
pub const NO_RELATION: u32 = u32::MAX;
const RECORD_HEADER: usize = 8;

#[derive(Debug)]
enum Store {
    Memory(Vec<u8>),
    File(BufWriter<File>),
}

#[derive(Debug)]
pub struct ChangeLog {
    store: Store,
    budget: usize,
    spill_dir: PathBuf,
    records: u64,
    bytes: u64,
}

/// A spill file name unique within this server: pid and a per-process counter.
fn spill_file(dir: &Path) -> io::Result<File> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("trellara_spill.{}.{n}", std::process::id()));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    fs::remove_file(&path)?;
    Ok(file)
}

impl ChangeLog {
    /// An empty log that keeps up to `budget` bytes in memory and spills to a
    /// file in `spill_dir` beyond that.
    pub fn new(budget: usize, spill_dir: PathBuf) -> Self {
        ChangeLog {
            store: Store::Memory(Vec::new()),
            budget,
            spill_dir,
            records: 0,
            bytes: 0,
        }
    }

    /// Number of records appended.
    pub fn len(&self) -> u64 {
        self.records
    }

    /// Whether the log has spilled to disk.
    pub fn spilled(&self) -> bool {
        matches!(self.store, Store::File(_))
    }

    /// Total bytes appended (records and their headers).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn push(&mut self, relation_version: u32, change: &[u8]) -> io::Result<()> {
        let len = u32::try_from(change.len())
            .map_err(|_| io::Error::other("encoded change exceeds 4 GiB"))?;
        let mut header = [0u8; RECORD_HEADER];
        header[..4].copy_from_slice(&len.to_le_bytes());
        header[4..].copy_from_slice(&relation_version.to_le_bytes());
        if let Store::Memory(buf) = &self.store
            && buf.len() + RECORD_HEADER + change.len() > self.budget
        {
            let file = spill_file(&self.spill_dir)?;
            let mut writer = BufWriter::with_capacity(256 * 1024, file);
            writer.write_all(buf)?;
            self.store = Store::File(writer);
        }
        match &mut self.store {
            Store::Memory(buf) => {
                buf.extend_from_slice(&header);
                buf.extend_from_slice(change);
            }
            Store::File(writer) => {
                writer.write_all(&header)?;
                writer.write_all(change)?;
            }
        }
        self.records += 1;
        self.bytes += (RECORD_HEADER + change.len()) as u64;
        Ok(())
    }

    /// A reader over every record from the start (flushes a spill file
    /// first). May be called repeatedly; each reader starts over.
    pub fn reader(&mut self) -> io::Result<RecordReader<'_>> {
        let source = match &mut self.store {
            Store::Memory(buf) => Source::Memory { buf, at: 0 },
            Store::File(writer) => {
                writer.flush()?;
                let mut file = writer.get_ref().try_clone()?;
                file.seek(SeekFrom::Start(0))?;
                Source::File(BufReader::with_capacity(256 * 1024, file))
            }
        };
        Ok(RecordReader {
            source,
            left: self.records,
        })
    }
}

#[derive(Debug)]
enum Source<'a> {
    Memory { buf: &'a [u8], at: usize },
    File(BufReader<File>),
}

/// Reads records in order; `payload` is reused between records.
#[derive(Debug)]
pub struct RecordReader<'a> {
    source: Source<'a>,
    left: u64,
}

fn corrupt() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "change log record is truncated")
}

impl RecordReader<'_> {
    fn header(&mut self) -> io::Result<(usize, u32)> {
        let mut header = [0u8; RECORD_HEADER];
        match &mut self.source {
            Source::Memory { buf, at } => {
                let bytes = buf.get(*at..*at + RECORD_HEADER).ok_or_else(corrupt)?;
                header.copy_from_slice(bytes);
                *at += RECORD_HEADER;
            }
            Source::File(reader) => reader.read_exact(&mut header)?,
        }
        let [a, b, c, d, e, f, g, h] = header;
        Ok((
            u32::from_le_bytes([a, b, c, d]) as usize,
            u32::from_le_bytes([e, f, g, h]),
        ))
    }

    /// The next record's relation version and length, skipping its bytes;
    /// `None` at the end.
    pub fn skip(&mut self) -> io::Result<Option<(u32, usize)>> {
        if self.left == 0 {
            return Ok(None);
        }
        let (len, version) = self.header()?;
        match &mut self.source {
            Source::Memory { buf, at } => {
                if *at + len > buf.len() {
                    return Err(corrupt());
                }
                *at += len;
            }
            Source::File(reader) => reader.seek_relative(len as i64)?,
        }
        self.left -= 1;
        Ok(Some((version, len)))
    }

    /// The next record's relation version, with its bytes in `payload`;
    /// `None` at the end.
    pub fn next_into(&mut self, payload: &mut Vec<u8>) -> io::Result<Option<u32>> {
        if self.left == 0 {
            return Ok(None);
        }
        let (len, version) = self.header()?;
        payload.clear();
        match &mut self.source {
            Source::Memory { buf, at } => {
                let bytes = buf.get(*at..*at + len).ok_or_else(corrupt)?;
                payload.extend_from_slice(bytes);
                *at += len;
            }
            Source::File(reader) => {
                payload.resize(len, 0);
                reader.read_exact(payload)?;
            }
        }
        self.left -= 1;
        Ok(Some(version))
    }
}

/// One envelope's worth of consecutive changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlan {
    pub first_sequence: u64,
    pub count: u64,
}

/// Bytes a length-delimited field of `len` bytes takes (1-byte key).
pub fn field_len(len: usize) -> usize {
    1 + prost::encoding::encoded_len_varint(len as u64) + len
}

/// Splits the log into envelopes of at most `chunk_bytes` each, given the
/// encoded size of an envelope with no relations and no changes (`base`),
/// each relation version's `(relation_id, encoded length)`, and each
/// record's relation version and length. A change that alone exceeds the
/// target gets an envelope of its own. Two versions of one relation never
/// share an envelope (a mid-transaction schema change forces a cut).
pub fn plan_chunks(
    reader: &mut RecordReader<'_>,
    base: usize,
    chunk_bytes: usize,
    versions: &[(u32, usize)],
) -> io::Result<Vec<ChunkPlan>> {
    let mut plans = Vec::new();
    let mut current = ChunkPlan {
        first_sequence: 0,
        count: 0,
    };
    let mut size = base;
    let mut in_chunk: Vec<u32> = Vec::new();
    let mut sequence = 0u64;
    while let Some((version, len)) = reader.skip()? {
        let relation = versions.get(version as usize).copied();
        let mut cost = field_len(len);
        let mut conflict = false;
        if let Some((relation_id, rel_len)) = relation
            && !in_chunk.contains(&version)
        {
            cost += field_len(rel_len);
            conflict = in_chunk.iter().any(|v| {
                versions
                    .get(*v as usize)
                    .is_some_and(|(id, _)| *id == relation_id)
            });
        }
        if current.count > 0 && (conflict || size + cost > chunk_bytes) {
            plans.push(current);
            current = ChunkPlan {
                first_sequence: sequence,
                count: 0,
            };
            size = base;
            in_chunk.clear();
            cost = field_len(len) + relation.map_or(0, |(_, rel_len)| field_len(rel_len));
        }
        if relation.is_some() && !in_chunk.contains(&version) {
            in_chunk.push(version);
        }
        size += cost;
        current.count += 1;
        sequence += 1;
    }
    if current.count > 0 {
        plans.push(current);
    }
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(budget: usize, records: &[(u32, usize)]) -> (ChangeLog, tempfile_dir::Dir) {
        let dir = tempfile_dir::Dir::new();
        let mut log = ChangeLog::new(budget, dir.path.clone());
        for (i, (version, len)) in records.iter().enumerate() {
            let bytes = vec![i as u8; *len];
            log.push(*version, &bytes).unwrap_or_else(|e| panic!("{e}"));
        }
        (log, dir)
    }

    /// A scratch directory without extra dependencies.
    mod tempfile_dir {
        use std::path::PathBuf;
        pub struct Dir {
            pub path: PathBuf,
        }
        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let path = std::env::temp_dir().join(format!(
                    "trellara-spill-test-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                Dir { path }
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.path);
            }
        }
    }

    fn read_all(log: &mut ChangeLog) -> Vec<(u32, Vec<u8>)> {
        let mut reader = log.reader().unwrap_or_else(|e| panic!("{e}"));
        let mut out = Vec::new();
        let mut payload = Vec::new();
        while let Some(v) = reader
            .next_into(&mut payload)
            .unwrap_or_else(|e| panic!("{e}"))
        {
            out.push((v, payload.clone()));
        }
        out
    }

    #[test]
    fn memory_and_spilled_logs_read_back_identically() {
        let records: Vec<(u32, usize)> = (0..200u32)
            .map(|i| (i % 3, (i as usize * 7) % 300))
            .collect();
        let (mut memory, _d1) = log(usize::MAX, &records);
        let (mut spilled, d2) = log(1000, &records);
        assert!(!memory.spilled());
        assert!(spilled.spilled());
        let a = read_all(&mut memory);
        assert_eq!(a.len(), 200);
        assert_eq!(a, read_all(&mut spilled));
        // Twice: each reader starts over.
        assert_eq!(a, read_all(&mut spilled));
        // The spill file is unlinked: the directory is empty.
        let left = std::fs::read_dir(&d2.path).map(|d| d.count()).unwrap_or(0);
        assert_eq!(left, 0);
    }

    fn plan(
        records: &[(u32, usize)],
        base: usize,
        chunk: usize,
        versions: &[(u32, usize)],
    ) -> Vec<(u64, u64)> {
        let (mut log, _d) = log(64, records);
        let mut reader = log.reader().unwrap_or_else(|e| panic!("{e}"));
        plan_chunks(&mut reader, base, chunk, versions)
            .unwrap_or_else(|e| panic!("{e}"))
            .iter()
            .map(|p| (p.first_sequence, p.count))
            .collect()
    }

    #[test]
    fn chunks_respect_the_size_target() {
        // base 100 + relation (1+1+20) + n changes of (1+1+50).
        let versions = [(7u32, 20usize)];
        let records = vec![(0u32, 50usize); 10];
        assert_eq!(plan(&records, 100, 10_000, &versions), [(0, 10)]);
        // 100 + 22 + 3 * 52 = 278 <= 300 < 330.
        assert_eq!(
            plan(&records, 100, 300, &versions),
            [(0, 3), (3, 3), (6, 3), (9, 1)]
        );
        // A change bigger than the target still gets its own envelope.
        assert_eq!(
            plan(&[(0, 50), (0, 5000), (0, 50)], 100, 300, &versions),
            [(0, 1), (1, 1), (2, 1)]
        );
        // Messages need no relation.
        assert_eq!(
            plan(&[(NO_RELATION, 50); 4], 100, 10_000, &versions),
            [(0, 4)]
        );
    }

    #[test]
    fn two_versions_of_a_relation_never_share_a_chunk() {
        let versions = [(7u32, 20usize), (8, 20), (7, 24)];
        let records = [(0u32, 10usize), (1, 10), (0, 10), (2, 10), (1, 10), (2, 10)];
        assert_eq!(plan(&records, 100, 10_000, &versions), [(0, 3), (3, 3)]);
    }
}
