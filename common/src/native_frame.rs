//! Native frames: how the extension cuts encoded envelopes into bounded,
//! self-checking pieces, and how a reader puts them back together.
//!
//! ```text
//!  output plugin (commit)                       reader (SQL test, relay socket)
//!  envelope::encode ─▶ encode_frames ─▶ frame ─▶ … ─▶ Reassembler::push ─▶ envelope::decode
//!                        ≤ max_frame_bytes each       (order, continuity, size checked)
//! ```
//!
//! A frame is a 40-byte little-endian header followed by a slice of one
//! encoded envelope:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `b"TRNF"` |
//! | 4 | 1 | version, 1 |
//! | 5 | 1 | flags: bit 0 = last frame of this envelope; other bits 0 |
//! | 6 | 2 | reserved, 0 |
//! | 8 | 8 | commit LSN of the transaction |
//! | 16 | 4 | envelope index (chunk index within the transaction) |
//! | 20 | 4 | frame index within the envelope, from 0 |
//! | 24 | 4 | payload length |
//! | 28 | 4 | reserved, 0 |
//! | 32 | 8 | xxh3_64 over header bytes 0..32 followed by the payload |
//!
//! Invariants:
//! - A frame is never longer than [`MAX_FRAME_BYTES`] (64 KiB, one slot of the
//!   extension's shared-memory ring) and never carries an empty payload.
//! - Every byte of a frame is covered: the fixed fields are checked by value
//!   and everything else by the checksum, so any single corrupted byte is
//!   refused with a typed [`FrameError`].
//! - [`Reassembler`] accepts frames only in order (frame 0, 1, … with the last
//!   flag on the final one), for one `(commit_lsn, envelope_index)` at a time,
//!   with envelope indexes consecutive within a transaction and commit LSNs
//!   strictly increasing across transactions. It bounds the envelope size it
//!   will buffer. Any violation is a [`ReassemblyError`] naming what broke, and
//!   poisons the reassembler until [`Reassembler::reset`].
//! - Bytes from shared memory or a socket never panic this module.
#![deny(clippy::unwrap_used, clippy::indexing_slicing)]

use xxhash_rust::xxh3::Xxh3;

/// `b"TRNF"`: Trellara native frame.
pub const MAGIC: [u8; 4] = *b"TRNF";
/// The frame format version this module writes and the only one it reads.
pub const VERSION: u8 = 1;
/// Length of the fixed header.
pub const HEADER_LEN: usize = 40;
/// Largest frame: one 64 KiB slot of the extension's shared-memory ring.
pub const MAX_FRAME_BYTES: usize = 64 * 1024;
/// Smallest useful frame: a header and one payload byte.
pub const MIN_FRAME_BYTES: usize = HEADER_LEN + 1;
/// Largest payload a frame may carry.
pub const MAX_PAYLOAD_BYTES: usize = MAX_FRAME_BYTES - HEADER_LEN;
/// Flag bit 0: this is the last frame of its envelope.
pub const FLAG_LAST: u8 = 0x01;
/// Header bytes covered by the checksum (everything before it).
const CHECKED_HEADER_LEN: usize = 32;

/// Why a single frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame is truncated: {len} bytes, need {needed}")]
    Truncated { len: usize, needed: usize },
    #[error("frame has {extra} bytes after its {payload_len}-byte payload")]
    TrailingBytes { payload_len: u32, extra: usize },
    #[error("frame magic is {found:02x?}, expected \"TRNF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unknown frame version {0}; this build reads version {VERSION}")]
    UnknownVersion(u8),
    #[error("frame flags {0:#04x} set bits this version does not define")]
    UnknownFlags(u8),
    #[error("frame reserved field at offset {offset} is {value:#x}, must be 0")]
    ReservedNotZero { offset: usize, value: u32 },
    #[error("frame payload of {len} bytes exceeds the maximum of {MAX_PAYLOAD_BYTES}")]
    PayloadTooLong { len: u32 },
    #[error("frame has an empty payload")]
    EmptyPayload,
    #[error("frame checksum mismatch: stored {stored:#018x}, computed {computed:#018x}")]
    ChecksumMismatch { stored: u64, computed: u64 },
    #[error(
        "frame size {0} is outside {MIN_FRAME_BYTES}..={MAX_FRAME_BYTES} (header {HEADER_LEN} + at least one payload byte)"
    )]
    InvalidFrameSize(usize),
    #[error("cannot frame an empty envelope")]
    EmptyEnvelope,
    #[error("an envelope of {0} bytes needs more than u32::MAX frames")]
    TooManyFrames(usize),
}

/// The decoded fixed header of one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub flags: u8,
    pub commit_lsn: u64,
    pub envelope_index: u32,
    pub frame_index: u32,
    pub payload_len: u32,
    pub checksum: u64,
}

impl FrameHeader {
    /// Whether this is the last frame of its envelope.
    pub fn is_last(&self) -> bool {
        self.flags & FLAG_LAST != 0
    }

    /// Parses and verifies one whole frame (header and payload, nothing
    /// more), returning its header and payload.
    pub fn parse(frame: &[u8]) -> Result<(FrameHeader, &[u8]), FrameError> {
        let (header, rest) = frame.split_first_chunk::<HEADER_LEN>().ok_or({
            FrameError::Truncated {
                len: frame.len(),
                needed: HEADER_LEN,
            }
        })?;
        let field = |at: usize| -> [u8; 8] {
            let mut out = [0u8; 8];
            for (i, byte) in out.iter_mut().enumerate() {
                *byte = header.get(at + i).copied().unwrap_or(0);
            }
            out
        };
        let u32_at = |at: usize| {
            let b = field(at);
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        };
        let u64_at = |at: usize| u64::from_le_bytes(field(at));

        let [m0, m1, m2, m3, version, flags, r0, r1, ..] = *header;
        let magic = [m0, m1, m2, m3];
        if magic != MAGIC {
            return Err(FrameError::BadMagic { found: magic });
        }
        if version != VERSION {
            return Err(FrameError::UnknownVersion(version));
        }
        if flags & !FLAG_LAST != 0 {
            return Err(FrameError::UnknownFlags(flags));
        }
        let reserved16 = u16::from_le_bytes([r0, r1]);
        if reserved16 != 0 {
            return Err(FrameError::ReservedNotZero {
                offset: 6,
                value: u32::from(reserved16),
            });
        }
        let reserved32 = u32_at(28);
        if reserved32 != 0 {
            return Err(FrameError::ReservedNotZero {
                offset: 28,
                value: reserved32,
            });
        }
        let payload_len = u32_at(24);
        let len = payload_len as usize;
        if len > MAX_PAYLOAD_BYTES {
            return Err(FrameError::PayloadTooLong { len: payload_len });
        }
        if len == 0 {
            return Err(FrameError::EmptyPayload);
        }
        if rest.len() < len {
            return Err(FrameError::Truncated {
                len: frame.len(),
                needed: HEADER_LEN + len,
            });
        }
        if rest.len() > len {
            return Err(FrameError::TrailingBytes {
                payload_len,
                extra: rest.len() - len,
            });
        }
        let stored = u64_at(32);
        let computed = checksum(header.get(..CHECKED_HEADER_LEN).unwrap_or(&[]), rest);
        if stored != computed {
            return Err(FrameError::ChecksumMismatch { stored, computed });
        }
        Ok((
            FrameHeader {
                flags,
                commit_lsn: u64_at(8),
                envelope_index: u32_at(16),
                frame_index: u32_at(20),
                payload_len,
                checksum: stored,
            },
            rest,
        ))
    }
}

fn checksum(checked_header: &[u8], payload: &[u8]) -> u64 {
    let mut hasher = Xxh3::new();
    hasher.update(checked_header);
    hasher.update(payload);
    hasher.digest()
}

/// Appends one frame to `out`. `payload` must be 1..=[`MAX_PAYLOAD_BYTES`]
/// bytes (callers go through [`encode_frames`] or [`FrameWriter`], which
/// guarantee it).
fn write_frame(
    out: &mut Vec<u8>,
    commit_lsn: u64,
    envelope_index: u32,
    frame_index: u32,
    last: bool,
    payload: &[u8],
) {
    let start = out.len();
    out.reserve(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(if last { FLAG_LAST } else { 0 });
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&commit_lsn.to_le_bytes());
    out.extend_from_slice(&envelope_index.to_le_bytes());
    out.extend_from_slice(&frame_index.to_le_bytes());
    // payload.len() <= MAX_PAYLOAD_BYTES < u32::MAX.
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    let sum = checksum(out.get(start..).unwrap_or(&[]), payload);
    out.extend_from_slice(&sum.to_le_bytes());
    out.extend_from_slice(payload);
}

/// Cuts one encoded envelope into frames of at most `max_frame_bytes`.
#[derive(Debug)]
pub struct FrameWriter<'a> {
    commit_lsn: u64,
    envelope_index: u32,
    chunks: std::slice::Chunks<'a, u8>,
    next_index: u32,
    count: usize,
}

impl<'a> FrameWriter<'a> {
    /// Checks the frame size and the envelope, and prepares the frames.
    pub fn new(
        commit_lsn: u64,
        envelope_index: u32,
        envelope_bytes: &'a [u8],
        max_frame_bytes: usize,
    ) -> Result<Self, FrameError> {
        if !(MIN_FRAME_BYTES..=MAX_FRAME_BYTES).contains(&max_frame_bytes) {
            return Err(FrameError::InvalidFrameSize(max_frame_bytes));
        }
        if envelope_bytes.is_empty() {
            return Err(FrameError::EmptyEnvelope);
        }
        let payload = max_frame_bytes - HEADER_LEN;
        let count = envelope_bytes.len().div_ceil(payload);
        if u32::try_from(count).is_err() {
            return Err(FrameError::TooManyFrames(envelope_bytes.len()));
        }
        Ok(FrameWriter {
            commit_lsn,
            envelope_index,
            chunks: envelope_bytes.chunks(payload),
            next_index: 0,
            count,
        })
    }

    /// How many frames the envelope takes in total.
    pub fn frame_count(&self) -> usize {
        self.count
    }

    /// Appends the next frame to `out` (which the caller may reuse); returns
    /// false once every frame has been written.
    pub fn write_next(&mut self, out: &mut Vec<u8>) -> bool {
        let Some(payload) = self.chunks.next() else {
            return false;
        };
        let index = self.next_index;
        let last = self.chunks.len() == 0;
        write_frame(
            out,
            self.commit_lsn,
            self.envelope_index,
            index,
            last,
            payload,
        );
        self.next_index = self.next_index.saturating_add(1);
        true
    }
}

impl Iterator for FrameWriter<'_> {
    type Item = Vec<u8>;

    fn next(&mut self) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        self.write_next(&mut out).then_some(out)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.chunks.len();
        (left, Some(left))
    }
}

/// The frames of one encoded envelope, each at most `max_frame_bytes`
/// (41..=65536) long.
pub fn encode_frames(
    commit_lsn: u64,
    envelope_index: u32,
    envelope_bytes: &[u8],
    max_frame_bytes: usize,
) -> Result<FrameWriter<'_>, FrameError> {
    FrameWriter::new(commit_lsn, envelope_index, envelope_bytes, max_frame_bytes)
}

/// Why a frame sequence was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReassemblyError {
    #[error("frame refused")]
    Frame(#[from] FrameError),
    #[error(
        "frame {found} of envelope {envelope_index} (commit {commit_lsn:#x}) arrived, expected frame {expected}: frames missing or out of order"
    )]
    FrameOutOfOrder {
        commit_lsn: u64,
        envelope_index: u32,
        expected: u32,
        found: u32,
    },
    #[error(
        "frame for commit {found:#x} arrived while envelope {envelope_index} of commit {expected:#x} was incomplete"
    )]
    CommitLsnChanged {
        envelope_index: u32,
        expected: u64,
        found: u64,
    },
    #[error(
        "frame of envelope {found} arrived while envelope {expected} of commit {commit_lsn:#x} was incomplete"
    )]
    EnvelopeIndexChanged {
        commit_lsn: u64,
        expected: u32,
        found: u32,
    },
    #[error(
        "envelope {found} of commit {commit_lsn:#x} follows envelope {previous}: envelopes missing or out of order"
    )]
    EnvelopeOutOfOrder {
        commit_lsn: u64,
        previous: u32,
        found: u32,
    },
    #[error(
        "commit {commit_lsn:#x} starts at envelope {found}, expected 0: its earlier envelopes are missing"
    )]
    FirstEnvelopeMissing { commit_lsn: u64, found: u32 },
    #[error("commit {found:#x} arrived after commit {previous:#x}: commit LSNs must increase")]
    CommitLsnWentBackwards { previous: u64, found: u64 },
    #[error(
        "envelope {envelope_index} of commit {commit_lsn:#x} exceeds the maximum envelope size of {max} bytes"
    )]
    EnvelopeTooLarge {
        commit_lsn: u64,
        envelope_index: u32,
        max: usize,
    },
    #[error(
        "envelope {envelope_index} of commit {commit_lsn:#x} is incomplete: {frames} frame(s), no last frame"
    )]
    Incomplete {
        commit_lsn: u64,
        envelope_index: u32,
        frames: u32,
    },
    #[error("reassembler refused an earlier frame; reset it before reuse")]
    Poisoned,
}

#[derive(Debug)]
struct Partial {
    commit_lsn: u64,
    envelope_index: u32,
    next_frame: u32,
    bytes: Vec<u8>,
}

/// Puts frames back together into encoded envelopes (see the module docs for
/// the rules it enforces). Decode each result with
/// [`crate::envelope::decode`], which validates it.
#[derive(Debug)]
pub struct Reassembler {
    max_envelope_bytes: usize,
    partial: Option<Partial>,
    /// `(commit_lsn, envelope_index)` of the last complete envelope.
    last: Option<(u64, u32)>,
    poisoned: bool,
}

impl Reassembler {
    /// A reassembler that refuses envelopes longer than `max_envelope_bytes`.
    pub fn new(max_envelope_bytes: usize) -> Self {
        Reassembler {
            max_envelope_bytes,
            partial: None,
            last: None,
            poisoned: false,
        }
    }

    /// Forgets all state (partial envelope, ordering, poison).
    pub fn reset(&mut self) {
        self.partial = None;
        self.last = None;
        self.poisoned = false;
    }

    /// Takes the next frame; returns the envelope bytes when `frame` was its
    /// last frame.
    pub fn push(&mut self, frame: &[u8]) -> Result<Option<Vec<u8>>, ReassemblyError> {
        if self.poisoned {
            return Err(ReassemblyError::Poisoned);
        }
        let result = self.accept(frame);
        if result.is_err() {
            self.poisoned = true;
            self.partial = None;
        }
        result
    }

    /// Errors if an envelope was left incomplete (call at end of input).
    pub fn finish(&self) -> Result<(), ReassemblyError> {
        if self.poisoned {
            return Err(ReassemblyError::Poisoned);
        }
        match &self.partial {
            None => Ok(()),
            Some(p) => Err(ReassemblyError::Incomplete {
                commit_lsn: p.commit_lsn,
                envelope_index: p.envelope_index,
                frames: p.next_frame,
            }),
        }
    }

    fn accept(&mut self, frame: &[u8]) -> Result<Option<Vec<u8>>, ReassemblyError> {
        let (header, payload) = FrameHeader::parse(frame)?;
        let partial = match self.partial.take() {
            Some(partial) => {
                if header.commit_lsn != partial.commit_lsn {
                    return Err(ReassemblyError::CommitLsnChanged {
                        envelope_index: partial.envelope_index,
                        expected: partial.commit_lsn,
                        found: header.commit_lsn,
                    });
                }
                if header.envelope_index != partial.envelope_index {
                    return Err(ReassemblyError::EnvelopeIndexChanged {
                        commit_lsn: partial.commit_lsn,
                        expected: partial.envelope_index,
                        found: header.envelope_index,
                    });
                }
                if header.frame_index != partial.next_frame {
                    return Err(ReassemblyError::FrameOutOfOrder {
                        commit_lsn: partial.commit_lsn,
                        envelope_index: partial.envelope_index,
                        expected: partial.next_frame,
                        found: header.frame_index,
                    });
                }
                partial
            }
            None => {
                if header.frame_index != 0 {
                    return Err(ReassemblyError::FrameOutOfOrder {
                        commit_lsn: header.commit_lsn,
                        envelope_index: header.envelope_index,
                        expected: 0,
                        found: header.frame_index,
                    });
                }
                self.check_envelope_order(&header)?;
                Partial {
                    commit_lsn: header.commit_lsn,
                    envelope_index: header.envelope_index,
                    next_frame: 0,
                    bytes: Vec::new(),
                }
            }
        };
        let mut partial = partial;
        if partial.bytes.len().saturating_add(payload.len()) > self.max_envelope_bytes {
            return Err(ReassemblyError::EnvelopeTooLarge {
                commit_lsn: partial.commit_lsn,
                envelope_index: partial.envelope_index,
                max: self.max_envelope_bytes,
            });
        }
        partial.bytes.extend_from_slice(payload);
        partial.next_frame = partial.next_frame.saturating_add(1);
        if header.is_last() {
            self.last = Some((partial.commit_lsn, partial.envelope_index));
            Ok(Some(partial.bytes))
        } else {
            self.partial = Some(partial);
            Ok(None)
        }
    }

    fn check_envelope_order(&self, header: &FrameHeader) -> Result<(), ReassemblyError> {
        match self.last {
            Some((lsn, index)) if lsn == header.commit_lsn => {
                if Some(header.envelope_index) != index.checked_add(1) {
                    return Err(ReassemblyError::EnvelopeOutOfOrder {
                        commit_lsn: lsn,
                        previous: index,
                        found: header.envelope_index,
                    });
                }
            }
            Some((lsn, _)) if header.commit_lsn < lsn => {
                return Err(ReassemblyError::CommitLsnWentBackwards {
                    previous: lsn,
                    found: header.commit_lsn,
                });
            }
            _ => {
                if header.envelope_index != 0 {
                    return Err(ReassemblyError::FirstEnvelopeMissing {
                        commit_lsn: header.commit_lsn,
                        found: header.envelope_index,
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn frames(lsn: u64, index: u32, bytes: &[u8], size: usize) -> Vec<Vec<u8>> {
        encode_frames(lsn, index, bytes, size).unwrap().collect()
    }

    #[test]
    fn header_layout_is_pinned() {
        let f = frames(0x0102_0304_0506_0708, 3, b"abc", MAX_FRAME_BYTES);
        assert_eq!(f.len(), 1);
        let f = &f[0];
        assert_eq!(f.len(), HEADER_LEN + 3);
        assert_eq!(&f[0..4], b"TRNF");
        assert_eq!(f[4], 1);
        assert_eq!(f[5], FLAG_LAST);
        assert_eq!(&f[6..8], &[0, 0]);
        assert_eq!(&f[8..16], &0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(&f[16..20], &3u32.to_le_bytes());
        assert_eq!(&f[20..24], &0u32.to_le_bytes());
        assert_eq!(&f[24..28], &3u32.to_le_bytes());
        assert_eq!(&f[28..32], &[0, 0, 0, 0]);
        let mut concat = f[..32].to_vec();
        concat.extend_from_slice(b"abc");
        assert_eq!(
            &f[32..40],
            &xxhash_rust::xxh3::xxh3_64(&concat).to_le_bytes()
        );
        assert_eq!(&f[40..], b"abc");
    }

    #[test]
    fn splits_at_the_frame_size() {
        let bytes: Vec<u8> = (0..100u8).collect();
        let f = frames(9, 0, &bytes, MIN_FRAME_BYTES + 9); // 10-byte payloads
        assert_eq!(f.len(), 10);
        for (i, frame) in f.iter().enumerate() {
            let (h, p) = FrameHeader::parse(frame).unwrap();
            assert_eq!(h.frame_index as usize, i);
            assert_eq!(h.is_last(), i == 9);
            assert_eq!(p, &bytes[i * 10..i * 10 + 10]);
        }
        let f = frames(9, 0, &bytes, MAX_FRAME_BYTES);
        assert_eq!(f.len(), 1);
    }

    #[test]
    fn refuses_bad_sizes_and_empty_envelopes() {
        assert_eq!(
            encode_frames(1, 0, b"x", HEADER_LEN).unwrap_err(),
            FrameError::InvalidFrameSize(HEADER_LEN)
        );
        assert_eq!(
            encode_frames(1, 0, b"x", MAX_FRAME_BYTES + 1).unwrap_err(),
            FrameError::InvalidFrameSize(MAX_FRAME_BYTES + 1)
        );
        assert_eq!(
            encode_frames(1, 0, b"", MAX_FRAME_BYTES).unwrap_err(),
            FrameError::EmptyEnvelope
        );
    }

    #[test]
    fn typed_errors_for_each_broken_field() {
        let good = frames(7, 0, b"payload", MAX_FRAME_BYTES).remove(0);
        let parse = |f: &[u8]| FrameHeader::parse(f).unwrap_err();
        assert!(matches!(
            parse(&good[..10]),
            FrameError::Truncated { needed: 40, .. }
        ));
        assert!(matches!(
            parse(&good[..good.len() - 1]),
            FrameError::Truncated { .. }
        ));
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(
            parse(&long),
            FrameError::TrailingBytes { extra: 1, .. }
        ));
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(matches!(parse(&bad), FrameError::BadMagic { .. }));
        let mut bad = good.clone();
        bad[4] = 2;
        assert_eq!(parse(&bad), FrameError::UnknownVersion(2));
        let mut bad = good.clone();
        bad[5] = 0x03;
        assert_eq!(parse(&bad), FrameError::UnknownFlags(0x03));
        let mut bad = good.clone();
        bad[7] = 1;
        assert!(matches!(
            parse(&bad),
            FrameError::ReservedNotZero { offset: 6, .. }
        ));
        let mut bad = good.clone();
        bad[24..28].copy_from_slice(&(MAX_PAYLOAD_BYTES as u32 + 1).to_le_bytes());
        assert!(matches!(parse(&bad), FrameError::PayloadTooLong { .. }));
        let mut bad = good.clone();
        bad[12] ^= 0x40; // commit LSN
        assert!(matches!(parse(&bad), FrameError::ChecksumMismatch { .. }));
    }

    #[test]
    fn reassembles_a_transaction_of_several_envelopes() {
        let mut r = Reassembler::new(1 << 20);
        let mut out = Vec::new();
        for (lsn, index, body) in [(100, 0, vec![1u8; 150]), (100, 1, vec![2u8; 3])] {
            for f in frames(lsn, index, &body, 64) {
                if let Some(bytes) = r.push(&f).unwrap() {
                    out.push(bytes);
                }
            }
        }
        for f in frames(200, 0, b"next", 64) {
            if let Some(bytes) = r.push(&f).unwrap() {
                out.push(bytes);
            }
        }
        r.finish().unwrap();
        assert_eq!(out, [vec![1u8; 150], vec![2u8; 3], b"next".to_vec()]);
    }

    #[test]
    fn refuses_missing_reordered_and_mixed_frames() {
        let f = frames(100, 0, &[5u8; 100], 60); // 5 frames of 20 bytes
        assert_eq!(f.len(), 5);

        let mut r = Reassembler::new(1 << 20);
        r.push(&f[0]).unwrap();
        assert_eq!(
            r.push(&f[2]).unwrap_err(),
            ReassemblyError::FrameOutOfOrder {
                commit_lsn: 100,
                envelope_index: 0,
                expected: 1,
                found: 2
            }
        );
        assert_eq!(r.push(&f[1]).unwrap_err(), ReassemblyError::Poisoned);
        r.reset();

        assert!(matches!(
            r.push(&f[1]).unwrap_err(),
            ReassemblyError::FrameOutOfOrder { expected: 0, .. }
        ));
        r.reset();

        let other = frames(101, 0, b"x", 60).remove(0);
        r.push(&f[0]).unwrap();
        assert!(matches!(
            r.push(&other).unwrap_err(),
            ReassemblyError::CommitLsnChanged { .. }
        ));
        r.reset();

        let sibling = frames(100, 1, &[1u8; 100], 60);
        r.push(&f[0]).unwrap();
        assert!(matches!(
            r.push(&sibling[1]).unwrap_err(),
            ReassemblyError::EnvelopeIndexChanged { .. }
        ));
        r.reset();

        // Envelope 1 without envelope 0; then 2 after 0; then backwards.
        assert!(matches!(
            r.push(&sibling[0]).unwrap_err(),
            ReassemblyError::FirstEnvelopeMissing { .. }
        ));
        r.reset();
        let single0 = frames(100, 0, b"a", 60).remove(0);
        let single2 = frames(100, 2, b"a", 60).remove(0);
        let earlier = frames(50, 0, b"a", 60).remove(0);
        r.push(&single0).unwrap();
        assert!(matches!(
            r.push(&single2).unwrap_err(),
            ReassemblyError::EnvelopeOutOfOrder { .. }
        ));
        r.reset();
        r.push(&single0).unwrap();
        assert!(matches!(
            r.push(&earlier).unwrap_err(),
            ReassemblyError::CommitLsnWentBackwards { .. }
        ));

        let mut r = Reassembler::new(1 << 20);
        r.push(&f[0]).unwrap();
        assert!(matches!(
            r.finish().unwrap_err(),
            ReassemblyError::Incomplete { frames: 1, .. }
        ));
    }

    #[test]
    fn enforces_the_envelope_size_limit() {
        let mut r = Reassembler::new(50);
        let f = frames(1, 0, &[0u8; 60], 60);
        r.push(&f[0]).unwrap();
        r.push(&f[1]).unwrap();
        assert!(matches!(
            r.push(&f[2]).unwrap_err(),
            ReassemblyError::EnvelopeTooLarge { max: 50, .. }
        ));
    }
}
