//! The durable watermark file (`<log dir>/durable`): how a process that
//! follows the log without writing it (the apply service beside a relay
//! service, [`super::Log::follow`]) learns which records are durable.
//!
//! Invariants:
//! * The writer rewrites it in place after every fsync that moved the
//!   watermark, never before, so it never names a record that is not
//!   durable. It is never fsynced itself: after a machine crash it may
//!   name less than is durable (the reopening writer rewrites it), never
//!   more, because the segment bytes it covers were fsynced first.
//! * It carries the log's identity, drawn when the directory is first
//!   opened: a follower that finds another identity (a reseed replaced
//!   the log) or no file stops following that log rather than read the
//!   new one with the old one's positions.
//! * A read that fails its checksum (a rewrite seen half done) is retried;
//!   it is never taken as a position.

use std::path::Path;

use super::error::Error;
use super::frame::{CHECKSUM_SEED, Corruption, FORMAT_VERSION};
use super::storage::{OpenMode, Storage, StorageFile};

/// The file's name in the log directory.
pub(crate) const WATERMARK_FILE: &str = "durable";
/// `TRLW`: the file's first bytes.
pub const WATERMARK_MAGIC: [u8; 4] = *b"TRLW";
/// Size of the file.
pub const WATERMARK_FILE_LEN: usize = 48;

/// What the file says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Watermark {
    /// The log's identity.
    pub log_id: u64,
    /// One past the last durable record.
    pub next_offset: u64,
    /// Where the durable bytes end: the base of the segment holding
    /// record `next_offset - 1` or, once rolled, the new segment record
    /// `next_offset` goes to, and that segment's durable length. A follower
    /// reads that segment up to there and no further, so it never holds a
    /// byte a crash of its writer could have taken back.
    pub end: (u64, u64),
}

impl Watermark {
    pub fn encode(&self) -> [u8; WATERMARK_FILE_LEN] {
        let (base, pos) = self.end;
        let flags = 0u16;
        let mut out = [0u8; WATERMARK_FILE_LEN];
        let fields: [&[u8]; 7] = [
            &WATERMARK_MAGIC,
            &FORMAT_VERSION.to_le_bytes(),
            &flags.to_le_bytes(),
            &self.log_id.to_le_bytes(),
            &self.next_offset.to_le_bytes(),
            &base.to_le_bytes(),
            &pos.to_le_bytes(),
        ];
        let body = fields.concat();
        let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&body, CHECKSUM_SEED);
        for (dst, src) in out.iter_mut().zip(body.iter().chain(&sum.to_le_bytes())) {
            *dst = *src;
        }
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Watermark, Corruption> {
        if bytes.len() != WATERMARK_FILE_LEN {
            return Err(Corruption::Truncated {
                needed: WATERMARK_FILE_LEN as u64,
                available: bytes.len() as u64,
            });
        }
        let word = |at: usize| -> u64 {
            let mut b = [0u8; 8];
            for (dst, src) in b.iter_mut().zip(bytes.iter().skip(at)) {
                *dst = *src;
            }
            u64::from_le_bytes(b)
        };
        let mut magic = [0u8; 4];
        for (dst, src) in magic.iter_mut().zip(bytes) {
            *dst = *src;
        }
        if magic != WATERMARK_MAGIC {
            return Err(Corruption::BadMagic { found: magic });
        }
        let body = bytes.get(..WATERMARK_FILE_LEN - 8).unwrap_or_default();
        let (stored, computed) = (
            word(WATERMARK_FILE_LEN - 8),
            xxhash_rust::xxh3::xxh3_64_with_seed(body, CHECKSUM_SEED),
        );
        if stored != computed {
            return Err(Corruption::ChecksumMismatch { stored, computed });
        }
        let head = word(4);
        let (version, flags) = ((head & 0xffff) as u16, ((head >> 16) & 0xffff) as u16);
        if version != FORMAT_VERSION {
            return Err(Corruption::UnsupportedVersion(version));
        }
        if flags != 0 {
            return Err(Corruption::UnknownFlags(flags));
        }
        Ok(Watermark {
            log_id: word(8),
            next_offset: word(16),
            end: (word(24), word(32)),
        })
    }
}

/// The writer's handle on the file.
#[derive(Debug)]
pub(crate) struct WatermarkFile<F> {
    file: F,
    pub log_id: u64,
}

impl<F: StorageFile> WatermarkFile<F> {
    /// Opens the file of the log in `dir`, keeping the identity it holds
    /// (a reopened log is the same log) or drawing one.
    pub fn open<S: Storage<File = F>>(storage: &S, dir: &Path) -> Result<Self, Error> {
        let path = dir.join(WATERMARK_FILE);
        let file = storage
            .open(&path, OpenMode::Create)
            .map_err(Error::io("open watermark file", &path))?;
        let log_id = match read_once(&file) {
            Some(Ok(found)) => found.log_id,
            _ => fresh_id(dir),
        };
        Ok(WatermarkFile { file, log_id })
    }

    /// Rewrites it in place (no fsync: see the module's invariants).
    pub fn publish(&self, next_offset: u64, end: (u64, u64)) -> std::io::Result<()> {
        let mark = Watermark {
            log_id: self.log_id,
            next_offset,
            end,
        };
        self.file.write_at(&mark.encode(), 0)
    }
}

/// One read of the file: None when it is empty (not written yet).
fn read_once<F: StorageFile>(file: &F) -> Option<Result<Watermark, Corruption>> {
    let mut bytes = [0u8; WATERMARK_FILE_LEN];
    match file.read_exact_at(&mut bytes, 0) {
        Ok(()) => Some(Watermark::decode(&bytes)),
        Err(_) => None,
    }
}

/// Reads the file of an open handle, retrying a read that caught a rewrite
/// half done; an error names the file once reads keep failing.
pub(crate) fn read<F: StorageFile>(file: &F, path: &Path) -> Result<Watermark, Error> {
    let mut last = Corruption::Truncated {
        needed: WATERMARK_FILE_LEN as u64,
        available: 0,
    };
    for _ in 0..8 {
        match read_once(file) {
            Some(Ok(mark)) => return Ok(mark),
            Some(Err(reason)) => last = reason,
            None => {}
        }
        std::thread::yield_now();
    }
    Err(Error::WatermarkUnreadable {
        path: path.to_path_buf(),
        reason: last,
    })
}

/// An identity no other log directory is likely to draw: the clock, the
/// process and the path, hashed.
fn fresh_id(dir: &Path) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seed = format!("{nanos}:{}:{}", std::process::id(), dir.display());
    xxhash_rust::xxh3::xxh3_64(seed.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_any_flip_is_refused() {
        let mark = Watermark {
            log_id: 0xfeed_beef,
            next_offset: 4242,
            end: (4096, 123_456),
        };
        let bytes = mark.encode();
        assert_eq!(Watermark::decode(&bytes), Ok(mark));
        for i in 0..WATERMARK_FILE_LEN {
            let mut flipped = bytes;
            if let Some(b) = flipped.get_mut(i) {
                *b ^= 0x10;
            }
            assert!(Watermark::decode(&flipped).is_err(), "flip at byte {i}");
        }
        assert!(Watermark::decode(bytes.get(..40).unwrap_or_default()).is_err());
    }
}
