//! Bounded-memory accumulation of one large payload (an oversized
//! transaction's encoded bytes) before it is appended to the log.
//!
//! Invariants:
//! * The in-memory buffer never holds more than the memory budget: its
//!   capacity is grown with `reserve_exact` up to the budget only, and the
//!   high-water mark is observable ([`SpillBuffer::peak_memory`]).
//! * Beyond the budget, bytes go to a temp file in the spill directory. Spill
//!   files are scratch: never fsynced (a crash loses the transaction, which the
//!   source re-sends since it was never acknowledged), removed on drop, and
//!   cleared from the log's spill directory when the log opens.
//! * [`super::Log::append_spill`] streams the file into the log using the
//!   same buffer, so appending does not raise memory above the budget either.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use super::error::Error;
use super::storage::{OpenMode, Storage, StorageFile};

/// Smallest growth step of the memory buffer, to avoid tiny reallocations.
const MIN_GROWTH: usize = 4096;

/// Accumulates bytes in memory up to a budget, then in a spill file.
#[derive(Debug)]
pub struct SpillBuffer<S: Storage> {
    storage: S,
    path: PathBuf,
    budget: usize,
    mem: Vec<u8>,
    file: Option<S::File>,
    /// Bytes already in the spill file.
    spilled: u64,
    peak_memory: usize,
}

impl<S: Storage> SpillBuffer<S> {
    /// A buffer keeping at most `memory_budget` bytes in memory and spilling
    /// the rest to `spill_path` (created on first spill, whose parent must
    /// exist). A budget of 0 spills everything.
    pub fn new(storage: S, spill_path: impl Into<PathBuf>, memory_budget: usize) -> Self {
        SpillBuffer {
            storage,
            path: spill_path.into(),
            budget: memory_budget,
            mem: Vec::new(),
            file: None,
            spilled: 0,
            peak_memory: 0,
        }
    }

    /// Total bytes written so far.
    pub fn len(&self) -> u64 {
        self.spilled + self.mem.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether any bytes went to the spill file.
    pub fn is_spilled(&self) -> bool {
        self.file.is_some()
    }

    pub fn memory_budget(&self) -> usize {
        self.budget
    }

    /// The largest memory buffer capacity this buffer ever held.
    pub fn peak_memory(&self) -> usize {
        self.peak_memory
    }

    pub fn spill_path(&self) -> &Path {
        &self.path
    }

    /// Adds `bytes`; errors name the spill file.
    pub fn push(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.write_all(bytes)
            .map_err(Error::io("write spill file", &self.path))
    }

    /// Empties the buffer for the next payload, keeping its allocations.
    pub fn clear(&mut self) -> Result<(), Error> {
        self.mem.clear();
        self.spilled = 0;
        if let Some(file) = &self.file {
            file.truncate(0)
                .map_err(Error::io("truncate spill file", &self.path))?;
        }
        Ok(())
    }

    fn note_peak(&mut self) {
        self.peak_memory = self.peak_memory.max(self.mem.capacity());
    }

    /// Grows the memory buffer to hold `extra` more bytes, never past the
    /// budget (the caller checked that it fits).
    fn reserve_within_budget(&mut self, extra: usize) {
        let needed = self.mem.len() + extra;
        if needed > self.mem.capacity() {
            let target = needed
                .max(self.mem.capacity() * 2)
                .max(MIN_GROWTH)
                .min(self.budget);
            self.mem.reserve_exact(target - self.mem.len());
        }
        self.note_peak();
    }

    fn spill_file(&mut self) -> io::Result<&S::File> {
        if self.file.is_none() {
            self.file = Some(self.storage.open(&self.path, OpenMode::Truncate)?);
        }
        self.file
            .as_ref()
            .ok_or_else(|| io::Error::other("spill file vanished"))
    }

    /// Moves the memory buffer's bytes to the spill file.
    fn drain_to_file(&mut self) -> io::Result<()> {
        if self.mem.is_empty() {
            return Ok(());
        }
        let mem = std::mem::take(&mut self.mem);
        let result = self.spill_file().and_then(|f| f.append(&mem));
        self.mem = mem;
        result?;
        self.spilled += self.mem.len() as u64;
        self.mem.clear();
        Ok(())
    }

    /// The accumulated bytes: either in memory, or (once spilled) a reader
    /// over the spill file plus the (empty) memory buffer to copy through, so
    /// the caller stays within budget. The caller must leave `scratch` empty.
    pub(crate) fn contents(&mut self) -> Result<Contents<'_, S::File>, Error> {
        if self.file.is_none() {
            return Ok(Contents::Memory(&self.mem));
        }
        self.drain_to_file()
            .map_err(Error::io("write spill file", &self.path))?;
        if self.mem.capacity() == 0 {
            self.mem.reserve_exact(self.budget.clamp(1, 64 * 1024));
            self.note_peak();
        }
        let file = self
            .file
            .as_ref()
            .ok_or_else(|| io::Error::other("spill file vanished"))
            .map_err(Error::io("read spill file", &self.path))?;
        Ok(Contents::Spilled {
            reader: SpillReader {
                file,
                pos: 0,
                end: self.spilled,
            },
            len: self.spilled,
            scratch: &mut self.mem,
        })
    }
}

/// The accumulated bytes, for appending.
pub(crate) enum Contents<'a, F> {
    Memory(&'a [u8]),
    Spilled {
        reader: SpillReader<'a, F>,
        len: u64,
        scratch: &'a mut Vec<u8>,
    },
}

/// Sequential reads of a spill file.
pub(crate) struct SpillReader<'a, F> {
    file: &'a F,
    pos: u64,
    end: u64,
}

impl<F: StorageFile> Read for SpillReader<'_, F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = usize::try_from(self.end - self.pos).unwrap_or(usize::MAX);
        let want = buf.len().min(left);
        let dst = buf.get_mut(..want).unwrap_or_default();
        let n = self.file.read_at(dst, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<S: Storage> Write for SpillBuffer<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.mem.len() + buf.len() <= self.budget {
            self.reserve_within_budget(buf.len());
            self.mem.extend_from_slice(buf);
            return Ok(buf.len());
        }
        self.drain_to_file()?;
        if buf.len() <= self.budget {
            self.reserve_within_budget(buf.len());
            self.mem.extend_from_slice(buf);
        } else {
            // Bigger than the whole budget: straight to the file.
            self.spill_file()?.append(buf)?;
            self.spilled += buf.len() as u64;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<S: Storage> Drop for SpillBuffer<S> {
    fn drop(&mut self) {
        if self.file.take().is_some()
            && let Err(error) = self.storage.remove(&self.path)
        {
            // Scratch only: the log clears its spill directory on open.
            tracing::warn!(path = %self.path.display(), %error, "could not remove spill file");
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::log::storage::SimStorage;

    #[test]
    fn small_payloads_stay_in_memory() {
        let sim = SimStorage::new(0);
        sim.create_dir_all(Path::new("/spill")).unwrap();
        let mut spill = SpillBuffer::new(sim.clone(), "/spill/a", 1024);
        spill.push(b"hello").unwrap();
        assert!(!spill.is_spilled());
        assert_eq!(spill.len(), 5);
        assert!(sim.file_names(Path::new("/spill")).is_empty());
    }

    #[test]
    fn large_payloads_spill_and_memory_stays_within_budget() {
        let sim = SimStorage::new(0);
        sim.create_dir_all(Path::new("/spill")).unwrap();
        let mut spill = SpillBuffer::new(sim.clone(), "/spill/a", 1000);
        let mut expected = Vec::new();
        for i in 0..500u32 {
            let piece = vec![i as u8; (i as usize * 7) % 1500];
            spill.push(&piece).unwrap();
            expected.extend_from_slice(&piece);
        }
        assert!(spill.is_spilled());
        assert_eq!(spill.len(), expected.len() as u64);
        assert!(spill.peak_memory() <= 1000, "peak {}", spill.peak_memory());
        let mut read_back = Vec::new();
        match spill.contents().unwrap() {
            Contents::Spilled {
                mut reader,
                len,
                scratch,
            } => {
                assert!(scratch.is_empty() && scratch.capacity() <= 1000);
                reader.read_to_end(&mut read_back).unwrap();
                assert_eq!(len, expected.len() as u64);
            }
            Contents::Memory(_) => panic!("expected spilled contents"),
        }
        assert_eq!(read_back, expected);
        drop(spill);
        assert!(
            sim.file_names(Path::new("/spill")).is_empty(),
            "removed on drop"
        );
    }
}
