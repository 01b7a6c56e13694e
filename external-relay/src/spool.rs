//! A transaction's encoded changes, in memory up to a budget and in an
//! unlinked temp file beyond it, so a transaction of any size costs bounded
//! memory.
//!
//! Records are length-prefixed (u32 LE). The spool supports what the
//! assembler needs and nothing else: append, truncate back to an earlier
//! mark (a subtransaction abort), and one sequential read at
//! commit. Spill files are scratch and never fsynced: a crash loses the
//! transaction, which the source re-sends because it was never acknowledged.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

/// A position in the spool: bytes before it and records before it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mark {
    pub bytes: u64,
    pub records: u64,
}

#[derive(Debug)]
pub struct Spool {
    budget: usize,
    mem: Vec<u8>,
    /// Spilled bytes live in the file; `mem` then holds only the tail not yet
    /// flushed to it.
    file: Option<BufWriter<File>>,
    spilled: u64,
    records: u64,
    peak_memory: usize,
}

impl Spool {
    pub fn new(budget: usize) -> Self {
        Spool {
            budget,
            mem: Vec::new(),
            file: None,
            spilled: 0,
            records: 0,
            peak_memory: 0,
        }
    }

    pub fn mark(&self) -> Mark {
        Mark {
            bytes: self.spilled + self.mem.len() as u64,
            records: self.records,
        }
    }

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

    pub fn push(&mut self, record: &[u8], spill_dir: &Path) -> io::Result<()> {
        let len = u32::try_from(record.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "change over 4 GiB"))?;
        if self.mem.len() + 4 + record.len() > self.budget {
            self.spill(spill_dir)?;
        }
        match &mut self.file {
            Some(file) => {
                file.write_all(&len.to_le_bytes())?;
                file.write_all(record)?;
                self.spilled += 4 + record.len() as u64;
            }
            None => {
                // Grow geometrically, but never past the budget.
                let needed = self.mem.len() + 4 + record.len();
                if needed > self.mem.capacity() {
                    let target = (self.mem.capacity() * 2).clamp(needed, self.budget.max(needed));
                    self.mem.reserve_exact(target - self.mem.len());
                }
                self.mem.extend_from_slice(&len.to_le_bytes());
                self.mem.extend_from_slice(record);
                self.peak_memory = self.peak_memory.max(self.mem.capacity());
            }
        }
        self.records += 1;
        Ok(())
    }

    fn spill(&mut self, spill_dir: &Path) -> io::Result<()> {
        if self.file.is_some() {
            return Ok(());
        }
        trellara_common::owner_only::create_dir_all(spill_dir)?;
        // Unlinked at creation: nothing to clean up after a crash.
        let mut file = BufWriter::with_capacity(64 * 1024, tempfile::tempfile_in(spill_dir)?);
        file.write_all(&self.mem)?;
        self.spilled = self.mem.len() as u64;
        self.mem = Vec::new();
        self.file = Some(file);
        Ok(())
    }

    /// Forgets every record after `mark`.
    pub fn truncate(&mut self, mark: Mark) -> io::Result<()> {
        match &mut self.file {
            Some(file) => {
                file.flush()?;
                file.get_mut().set_len(mark.bytes)?;
                file.seek(SeekFrom::Start(mark.bytes))?;
                self.spilled = mark.bytes;
            }
            None => self.mem.truncate(mark.bytes as usize),
        }
        self.records = mark.records;
        Ok(())
    }

    /// Reads every record in order, consuming the spool: the reader owns
    /// what it reads, so it can be kept across calls (a transaction handed
    /// out chunk by chunk).
    pub fn into_reader(mut self) -> io::Result<SpoolReader> {
        let source = match self.file.take() {
            Some(file) => {
                let mut f = file.into_inner().map_err(|e| e.into_error())?;
                f.seek(SeekFrom::Start(0))?;
                Source::File(BufReader::with_capacity(64 * 1024, f).take(self.spilled))
            }
            None => Source::Mem(io::Cursor::new(std::mem::take(&mut self.mem))),
        };
        Ok(SpoolReader {
            source,
            buf: Vec::new(),
        })
    }
}

enum Source {
    Mem(io::Cursor<Vec<u8>>),
    File(io::Take<BufReader<File>>),
}

pub struct SpoolReader {
    source: Source,
    buf: Vec<u8>,
}

impl std::fmt::Debug for SpoolReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpoolReader").finish_non_exhaustive()
    }
}

impl SpoolReader {
    /// The next record, or `None` at the end. The slice is valid until the
    /// next call.
    pub fn next_record(&mut self) -> io::Result<Option<&[u8]>> {
        let mut len = [0u8; 4];
        let read = match &mut self.source {
            Source::Mem(m) => m.read(&mut len)?,
            Source::File(f) => read_full(f, &mut len)?,
        };
        if read == 0 {
            return Ok(None);
        }
        if read < 4 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let len = u32::from_le_bytes(len) as usize;
        // Exactly: a wide value would otherwise double the buffer.
        self.buf.clear();
        self.buf.reserve_exact(len);
        self.buf.resize(len, 0);
        match &mut self.source {
            Source::Mem(m) => m.read_exact(&mut self.buf)?,
            Source::File(f) => f.read_exact(&mut self.buf)?,
        }
        Ok(Some(&self.buf))
    }
}

fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(spool: Spool) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut reader = spool.into_reader().expect("reader");
        while let Some(r) = reader.next_record().expect("read") {
            out.push(r.to_vec());
        }
        out
    }

    #[test]
    fn stays_in_memory_under_budget_and_spills_past_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut spool = Spool::new(1024);
        let records: Vec<Vec<u8>> = (0..200u32)
            .map(|i| vec![i as u8; 1 + (i as usize % 37)])
            .collect();
        for (i, r) in records.iter().enumerate() {
            spool.push(r, dir.path()).expect("push");
            if i == 3 {
                assert!(!spool.is_spilled());
            }
        }
        assert!(spool.is_spilled());
        assert!(spool.peak_memory() <= 1024, "peak {}", spool.peak_memory());
        assert_eq!(drain(spool), records);
    }

    #[test]
    fn truncate_forgets_after_the_mark_in_memory_and_on_disk() {
        let dir = tempfile::tempdir().expect("tempdir");
        for budget in [1 << 20, 16] {
            let mut spool = Spool::new(budget);
            spool.push(b"a", dir.path()).expect("push");
            let mark = spool.mark();
            spool.push(b"bb", dir.path()).expect("push");
            spool.push(b"ccc", dir.path()).expect("push");
            spool.truncate(mark).expect("truncate");
            assert_eq!(spool.records(), 1);
            spool.push(b"d", dir.path()).expect("push");
            assert_eq!(
                drain(spool),
                vec![b"a".to_vec(), b"d".to_vec()],
                "budget {budget}"
            );
        }
    }
}
