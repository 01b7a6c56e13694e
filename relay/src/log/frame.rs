//! Byte layout of segment headers and record frames (see
//! `docs/LOG_FORMAT.md`, which is normative; this file must agree with it).
//!
//! Invariants:
//! * Every multi-byte integer is little-endian; headers have fixed sizes.
//! * A frame is valid only if its magic matches, its checksum (xxh3_64, seed
//!   0, over header bytes `0..32` then the payload) matches, and its version,
//!   flags and reserved bytes are ones this code writes. Decoding never
//!   panics and never allocates more than the caller asked for: lengths read
//!   from disk are checked by the caller against the bytes actually present.

use xxhash_rust::xxh3::Xxh3;

/// `TRLS`: first bytes of every segment file.
pub const SEGMENT_MAGIC: [u8; 4] = *b"TRLS";
/// `TRLF`: first bytes of every record frame.
pub const FRAME_MAGIC: [u8; 4] = *b"TRLF";
/// The only format version this code reads or writes.
pub const FORMAT_VERSION: u16 = 1;
/// Bytes in a segment file header.
pub const SEGMENT_HEADER_LEN: usize = 32;
/// Bytes in a frame header; the payload follows immediately.
pub const FRAME_HEADER_LEN: usize = 40;
/// Seed of every xxh3_64 checksum in the log's files.
pub const CHECKSUM_SEED: u64 = 0;

/// Byte offset of the checksum inside a frame header.
pub(crate) const FRAME_CHECKSUM_AT: usize = 32;

/// Why bytes on disk are not a valid header or frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Corruption {
    #[error("only {available} of {needed} bytes are present")]
    Truncated { needed: u64, available: u64 },
    #[error("bad magic {found:02x?}")]
    BadMagic { found: [u8; 4] },
    #[error("checksum mismatch (stored {stored:#018x}, computed {computed:#018x})")]
    ChecksumMismatch { stored: u64, computed: u64 },
    #[error("unsupported format version {0}")]
    UnsupportedVersion(u16),
    #[error("unknown flag bits {0:#06x}")]
    UnknownFlags(u16),
    #[error("reserved header bytes are not zero")]
    ReservedNotZero,
    #[error("record offset {found} where {expected} was expected")]
    OffsetMismatch { expected: u64, found: u64 },
    #[error("payload length {len} exceeds the configured maximum of {max} bytes")]
    TooLarge { len: u64, max: u64 },
    #[error("segment header says base offset {found}, the file name says {expected}")]
    BaseMismatch { expected: u64, found: u64 },
}

/// Reads fixed-size little-endian fields front to back without indexing.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], Corruption> {
        let available = self.0.len() as u64;
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(Corruption::Truncated {
                needed: N as u64,
                available,
            })?;
        self.0 = rest;
        Ok(*head)
    }

    fn u16(&mut self) -> Result<u16, Corruption> {
        self.take().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, Corruption> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, Corruption> {
        self.take().map(u64::from_le_bytes)
    }
}

/// Copies `parts` back to back into a fixed array (panic-free concat).
fn concat<const N: usize>(parts: &[&[u8]]) -> [u8; N] {
    let mut out = [0u8; N];
    for (dst, src) in out.iter_mut().zip(parts.iter().flat_map(|p| p.iter())) {
        *dst = *src;
    }
    out
}

fn check_magic(found: [u8; 4], expected: [u8; 4]) -> Result<(), Corruption> {
    if found == expected {
        Ok(())
    } else {
        Err(Corruption::BadMagic { found })
    }
}

fn check_checksum(stored: u64, computed: u64) -> Result<(), Corruption> {
    if stored == computed {
        Ok(())
    } else {
        Err(Corruption::ChecksumMismatch { stored, computed })
    }
}

/// The header at the start of every segment file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Offset of the first record the segment holds (or will hold).
    pub base_offset: u64,
    /// Wall-clock creation time, milliseconds since the Unix epoch. Age-based
    /// retention reads the *next* segment's value as this one's seal time.
    pub created_unix_ms: u64,
}

impl SegmentHeader {
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_LEN] {
        let body: [u8; 24] = concat(&[
            &SEGMENT_MAGIC,
            &FORMAT_VERSION.to_le_bytes(),
            &0u16.to_le_bytes(),
            &self.base_offset.to_le_bytes(),
            &self.created_unix_ms.to_le_bytes(),
        ]);
        let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&body, CHECKSUM_SEED);
        concat(&[&body, &sum.to_le_bytes()])
    }

    pub fn decode(bytes: &[u8]) -> Result<SegmentHeader, Corruption> {
        let mut f = Fields(bytes);
        let body: [u8; 24] = f.take()?;
        let stored = f.u64()?;
        let mut f = Fields(&body);
        check_magic(f.take()?, SEGMENT_MAGIC)?;
        check_checksum(
            stored,
            xxhash_rust::xxh3::xxh3_64_with_seed(&body, CHECKSUM_SEED),
        )?;
        let version = f.u16()?;
        if version != FORMAT_VERSION {
            return Err(Corruption::UnsupportedVersion(version));
        }
        let flags = f.u16()?;
        if flags != 0 {
            return Err(Corruption::UnknownFlags(flags));
        }
        Ok(SegmentHeader {
            base_offset: f.u64()?,
            created_unix_ms: f.u64()?,
        })
    }
}

/// A decoded frame header; the checksum is verified separately, against the
/// payload, by [`FrameHeader::verify`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub payload_len: u32,
    pub offset: u64,
    pub commit_lsn: u64,
    pub checksum: u64,
}

impl FrameHeader {
    /// The checksummed part of the header (bytes `0..32`).
    pub fn fields(payload_len: u32, offset: u64, commit_lsn: u64) -> [u8; FRAME_CHECKSUM_AT] {
        concat(&[
            &FRAME_MAGIC,
            &FORMAT_VERSION.to_le_bytes(),
            &0u16.to_le_bytes(),
            &payload_len.to_le_bytes(),
            &0u32.to_le_bytes(),
            &offset.to_le_bytes(),
            &commit_lsn.to_le_bytes(),
        ])
    }

    /// A complete header for `payload`.
    pub fn for_payload(offset: u64, commit_lsn: u64, payload: &[u8]) -> Result<Self, Corruption> {
        let payload_len = u32::try_from(payload.len()).map_err(|_| Corruption::TooLarge {
            len: payload.len() as u64,
            max: u64::from(u32::MAX),
        })?;
        let mut hasher = Self::hasher(payload_len, offset, commit_lsn);
        hasher.update(payload);
        Ok(FrameHeader {
            payload_len,
            offset,
            commit_lsn,
            checksum: hasher.digest(),
        })
    }

    /// A hasher primed with the header fields; feed it the payload.
    pub fn hasher(payload_len: u32, offset: u64, commit_lsn: u64) -> Xxh3 {
        let mut hasher = Xxh3::with_seed(CHECKSUM_SEED);
        hasher.update(&Self::fields(payload_len, offset, commit_lsn));
        hasher
    }

    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        concat(&[
            &Self::fields(self.payload_len, self.offset, self.commit_lsn),
            &self.checksum.to_le_bytes(),
        ])
    }

    /// Parses a header. Checks everything that does not need the payload;
    /// version, flags and reserved bytes are checked too, since a frame this
    /// code did not write cannot be read correctly whatever its checksum.
    pub fn decode(bytes: &[u8]) -> Result<FrameHeader, Corruption> {
        let mut f = Fields(bytes);
        check_magic(f.take()?, FRAME_MAGIC)?;
        let version = f.u16()?;
        let flags = f.u16()?;
        let payload_len = f.u32()?;
        let reserved = f.u32()?;
        let header = FrameHeader {
            payload_len,
            offset: f.u64()?,
            commit_lsn: f.u64()?,
            checksum: f.u64()?,
        };
        if version != FORMAT_VERSION {
            return Err(Corruption::UnsupportedVersion(version));
        }
        if flags != 0 {
            return Err(Corruption::UnknownFlags(flags));
        }
        if reserved != 0 {
            return Err(Corruption::ReservedNotZero);
        }
        Ok(header)
    }

    /// Frame bytes: header plus payload.
    pub fn frame_len(&self) -> u64 {
        FRAME_HEADER_LEN as u64 + u64::from(self.payload_len)
    }

    /// Checks the stored checksum against the header fields and `payload`.
    pub fn verify(&self, payload: &[u8]) -> Result<(), Corruption> {
        let mut hasher = Self::hasher(self.payload_len, self.offset, self.commit_lsn);
        hasher.update(payload);
        check_checksum(self.checksum, hasher.digest())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn frame_header_round_trips_and_verifies() {
        let payload = b"an encoded envelope";
        let header = FrameHeader::for_payload(42, 0x16_B374_2A08, payload).unwrap();
        let bytes = header.encode();
        assert_eq!(&bytes[..4], b"TRLF");
        assert_eq!(u64::from_le_bytes(bytes[16..24].try_into().unwrap()), 42);
        let decoded = FrameHeader::decode(&bytes).unwrap();
        assert_eq!(decoded, header);
        decoded.verify(payload).unwrap();
        assert!(matches!(
            decoded.verify(b"another envelope..."),
            Err(Corruption::ChecksumMismatch { .. })
        ));
    }

    #[test]
    fn checksum_is_one_shot_xxh3_over_fields_then_payload() {
        // A third-party reader computes it in one call; keep that true.
        let payload = b"payload";
        let header = FrameHeader::for_payload(7, 9, payload).unwrap();
        let mut covered = FrameHeader::fields(payload.len() as u32, 7, 9).to_vec();
        covered.extend_from_slice(payload);
        assert_eq!(
            header.checksum,
            xxhash_rust::xxh3::xxh3_64_with_seed(&covered, CHECKSUM_SEED)
        );
    }

    #[test]
    fn every_single_byte_flip_of_a_header_is_detected() {
        let payload = b"xyz";
        let header = FrameHeader::for_payload(1, 2, payload).unwrap();
        let bytes = header.encode();
        for i in 0..FRAME_HEADER_LEN {
            let mut bad = bytes;
            bad[i] ^= 0x01;
            let outcome = FrameHeader::decode(&bad).and_then(|h| h.verify(payload));
            assert!(outcome.is_err(), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn short_input_is_truncated_not_a_panic() {
        let bytes = FrameHeader::for_payload(1, 2, b"").unwrap().encode();
        for len in 0..FRAME_HEADER_LEN {
            assert!(FrameHeader::decode(&bytes[..len]).is_err());
        }
        assert!(matches!(
            SegmentHeader::decode(&[0u8; 5]),
            Err(Corruption::Truncated { .. })
        ));
    }

    #[test]
    fn segment_header_round_trips_and_rejects_flips() {
        let header = SegmentHeader {
            base_offset: 1_000,
            created_unix_ms: 1_700_000_000_000,
        };
        let bytes = header.encode();
        assert_eq!(SegmentHeader::decode(&bytes).unwrap(), header);
        for i in 0..SEGMENT_HEADER_LEN {
            let mut bad = bytes;
            bad[i] ^= 0x80;
            assert!(SegmentHeader::decode(&bad).is_err(), "flip at {i}");
        }
    }
}
