//! The native socket protocol: what the extension's background worker and
//! the local relay say to each other over the 0600 Unix socket, around the
//! frames of [`crate::native_frame`].
//!
//! ```text
//!  worker                                             relay
//!    │── Hello (slot, system identifier) ────────────────▶│
//!    │◀──────────────── Welcome (durable end LSN of log) ──│ worker refuses to decode
//!    │── frame, frame, … (native_frame, 40-byte header) ─▶│ if its slot is confirmed past it
//!    │── Progress (idle: decoded to LSN, nothing open) ──▶│ recorded durably
//!    │◀───────── Ack (end LSN now durable in the log) ─────│ → LogicalConfirmReceivedLocation
//!    │◀───────── Reject (why; frame kept in quarantine) ───│ then the relay closes
//! ```
//!
//! Every relay → worker message starts with a 16-byte header: a 4-byte magic,
//! a u32 (the protocol version in a Welcome, the text length of a Reject,
//! zero in an Ack) and a u64 (an LSN, or zero). Hello is `TRNH`, version
//! u8, a zero byte, the slot name's length (u16), the system identifier
//! (u64), then the name. All integers are little-endian.
//!
//! Invariants:
//! - An Ack's LSN is the end LSN of a transaction whose every envelope was
//!   appended and fsynced; acks never go backwards on one connection.
//! - Parsing never panics on arbitrary bytes; an unknown magic is an error,
//!   never skipped.
#![deny(clippy::unwrap_used, clippy::indexing_slicing)]

/// The protocol version both sides speak.
pub const VERSION: u8 = 1;
/// Worker → relay, once, first: `b"TRNH"`.
pub const HELLO_MAGIC: [u8; 4] = *b"TRNH";
/// Worker → relay, between frames: decoding reached this LSN with no
/// transaction open and every frame before it sent; the relay records it
/// durably and acknowledges it, so an idle slot keeps up with the WAL.
pub const PROGRESS_MAGIC: [u8; 4] = *b"TRNP";
/// Relay → worker, once, answering Hello.
pub const WELCOME_MAGIC: [u8; 4] = *b"TRNW";
/// Relay → worker: everything up to this end LSN is durable.
pub const ACK_MAGIC: [u8; 4] = *b"TRNK";
/// Relay → worker: the last frame was refused; the text says why.
pub const REJECT_MAGIC: [u8; 4] = *b"TRNR";
/// Length of every relay → worker header and of the fixed part of Hello.
pub const HEADER_LEN: usize = 16;
/// Longest slot name PostgreSQL allows (NAMEDATALEN - 1).
pub const MAX_SLOT_NAME: usize = 63;
/// Longest Reject text a reader accepts.
pub const MAX_REJECT_TEXT: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("native socket message has magic {0:02x?}, which this protocol does not define")]
    BadMagic([u8; 4]),
    #[error("native socket protocol version {0} is not supported (this build speaks {VERSION})")]
    UnknownVersion(u8),
    #[error("native socket reserved bytes are not zero")]
    ReservedNotZero,
    #[error("slot name of {0} bytes is empty, too long (max {MAX_SLOT_NAME}) or not UTF-8")]
    BadSlotName(usize),
    #[error("reject text of {0} bytes exceeds {MAX_REJECT_TEXT}")]
    RejectTooLong(usize),
}

/// The worker's opening message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub system_identifier: u64,
    pub slot: String,
}

impl Hello {
    /// `magic, version, reserved, name length (u16), system identifier, name`.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let name = self.slot.as_bytes();
        if name.is_empty() || name.len() > MAX_SLOT_NAME {
            return Err(WireError::BadSlotName(name.len()));
        }
        let mut out = Vec::with_capacity(HEADER_LEN + name.len());
        out.extend_from_slice(&HELLO_MAGIC);
        out.push(VERSION);
        out.push(0);
        // Bounded by MAX_SLOT_NAME above.
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.system_identifier.to_le_bytes());
        out.extend_from_slice(name);
        Ok(out)
    }

    /// The slot name's length, from the fixed part (to know how much more
    /// to read).
    pub fn name_len(header: &[u8; HEADER_LEN]) -> Result<usize, WireError> {
        let [m0, m1, m2, m3, version, reserved, l0, l1, ..] = *header;
        if [m0, m1, m2, m3] != HELLO_MAGIC {
            return Err(WireError::BadMagic([m0, m1, m2, m3]));
        }
        if version != VERSION {
            return Err(WireError::UnknownVersion(version));
        }
        if reserved != 0 {
            return Err(WireError::ReservedNotZero);
        }
        let len = usize::from(u16::from_le_bytes([l0, l1]));
        if len == 0 || len > MAX_SLOT_NAME {
            return Err(WireError::BadSlotName(len));
        }
        Ok(len)
    }

    /// Parses the fixed part and the name that follows it.
    pub fn decode(header: &[u8; HEADER_LEN], name: &[u8]) -> Result<Hello, WireError> {
        let len = Hello::name_len(header)?;
        if name.len() != len {
            return Err(WireError::BadSlotName(name.len()));
        }
        let slot = std::str::from_utf8(name)
            .map_err(|_| WireError::BadSlotName(len))?
            .to_owned();
        let mut id = [0u8; 8];
        id.copy_from_slice(header.get(8..16).unwrap_or(&[0; 8]));
        Ok(Hello {
            system_identifier: u64::from_le_bytes(id),
            slot,
        })
    }
}

/// Encodes a Progress message (16 bytes: magic, zero u32, LSN).
pub fn encode_progress(lsn: u64) -> [u8; HEADER_LEN] {
    let [m0, m1, m2, m3] = PROGRESS_MAGIC;
    let [l0, l1, l2, l3, l4, l5, l6, l7] = lsn.to_le_bytes();
    [m0, m1, m2, m3, 0, 0, 0, 0, l0, l1, l2, l3, l4, l5, l6, l7]
}

/// The LSN of a Progress message, or `None` when `bytes` is not one.
pub fn decode_progress(bytes: &[u8; HEADER_LEN]) -> Result<Option<u64>, WireError> {
    let [m0, m1, m2, m3, r0, r1, r2, r3, ..] = *bytes;
    if [m0, m1, m2, m3] != PROGRESS_MAGIC {
        return Ok(None);
    }
    if [r0, r1, r2, r3] != [0; 4] {
        return Err(WireError::ReservedNotZero);
    }
    let mut lsn = [0u8; 8];
    lsn.copy_from_slice(bytes.get(8..16).unwrap_or(&[0; 8]));
    Ok(Some(u64::from_le_bytes(lsn)))
}

/// A relay → worker message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayMessage {
    /// The end LSN of the last transaction durable in the relay's log
    /// (0 when the log is empty).
    Welcome {
        durable_end: u64,
    },
    Ack {
        end_lsn: u64,
    },
    Reject {
        reason: String,
    },
}

impl RelayMessage {
    pub fn encode(&self) -> Vec<u8> {
        let (magic, len, lsn, text): ([u8; 4], u32, u64, &[u8]) = match self {
            RelayMessage::Welcome { durable_end } => {
                (WELCOME_MAGIC, u32::from(VERSION), *durable_end, &[])
            }
            RelayMessage::Ack { end_lsn } => (ACK_MAGIC, 0, *end_lsn, &[]),
            RelayMessage::Reject { reason } => {
                let text = reason.as_bytes();
                let text = text.get(..MAX_REJECT_TEXT).unwrap_or(text);
                // Bounded by MAX_REJECT_TEXT.
                (REJECT_MAGIC, text.len() as u32, 0, text)
            }
        };
        let mut out = Vec::with_capacity(HEADER_LEN + text.len());
        out.extend_from_slice(&magic);
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&lsn.to_le_bytes());
        out.extend_from_slice(text);
        out
    }

    /// Parses one message from the front of `buf`: `Ok(None)` when more
    /// bytes are needed, else the message and how many bytes it used.
    pub fn decode(buf: &[u8]) -> Result<Option<(RelayMessage, usize)>, WireError> {
        let Some(header) = buf.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let [m0, m1, m2, m3, l0, l1, l2, l3, ..] = *header;
        let mut lsn = [0u8; 8];
        lsn.copy_from_slice(header.get(8..16).unwrap_or(&[0; 8]));
        let lsn = u64::from_le_bytes(lsn);
        let len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
        match [m0, m1, m2, m3] {
            // A Welcome's second field is the relay's protocol version.
            WELCOME_MAGIC if len == usize::from(VERSION) => Ok(Some((
                RelayMessage::Welcome { durable_end: lsn },
                HEADER_LEN,
            ))),
            WELCOME_MAGIC => Err(WireError::UnknownVersion(
                u8::try_from(len).unwrap_or(u8::MAX),
            )),
            ACK_MAGIC if len == 0 => Ok(Some((RelayMessage::Ack { end_lsn: lsn }, HEADER_LEN))),
            ACK_MAGIC => Err(WireError::ReservedNotZero),
            REJECT_MAGIC => {
                if len > MAX_REJECT_TEXT {
                    return Err(WireError::RejectTooLong(len));
                }
                let Some(text) = buf.get(HEADER_LEN..HEADER_LEN + len) else {
                    return Ok(None);
                };
                Ok(Some((
                    RelayMessage::Reject {
                        reason: String::from_utf8_lossy(text).into_owned(),
                    },
                    HEADER_LEN + len,
                )))
            }
            other => Err(WireError::BadMagic(other)),
        }
    }
}

#[cfg(test)]
#[allow(clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_refuses_bad_names() {
        let hello = Hello {
            system_identifier: 0x0123_4567_89ab_cdef,
            slot: "orders_slot".into(),
        };
        let bytes = hello.encode().expect("encode");
        let header: [u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().expect("header");
        assert_eq!(Hello::name_len(&header), Ok(11));
        assert_eq!(Hello::decode(&header, &bytes[HEADER_LEN..]), Ok(hello));

        let long = Hello {
            system_identifier: 1,
            slot: "x".repeat(64),
        };
        assert_eq!(long.encode(), Err(WireError::BadSlotName(64)));
        let mut bad = header;
        bad[4] = 2;
        assert_eq!(Hello::name_len(&bad), Err(WireError::UnknownVersion(2)));
        bad = header;
        bad[0] = b'X';
        assert!(matches!(Hello::name_len(&bad), Err(WireError::BadMagic(_))));
    }

    #[test]
    fn relay_messages_round_trip_and_need_whole_input() {
        for message in [
            RelayMessage::Welcome { durable_end: 0 },
            RelayMessage::Welcome {
                durable_end: 0x1_0000_0028,
            },
            RelayMessage::Ack { end_lsn: 42 },
            RelayMessage::Reject {
                reason: "frame checksum mismatch".into(),
            },
        ] {
            let bytes = message.encode();
            for cut in 0..bytes.len() {
                assert_eq!(
                    RelayMessage::decode(&bytes[..cut]),
                    Ok(None),
                    "{message:?} cut at {cut}"
                );
            }
            let mut two = bytes.clone();
            two.extend_from_slice(&bytes);
            assert_eq!(RelayMessage::decode(&two), Ok(Some((message, bytes.len()))));
        }
    }

    #[test]
    fn progress_round_trips_and_is_told_apart_from_frames() {
        let bytes = encode_progress(0x0177_1860);
        assert_eq!(decode_progress(&bytes), Ok(Some(0x0177_1860)));
        let mut frame_start = [0u8; HEADER_LEN];
        frame_start[..4].copy_from_slice(b"TRNF");
        assert_eq!(decode_progress(&frame_start), Ok(None));
        let mut bad = bytes;
        bad[5] = 1;
        assert_eq!(decode_progress(&bad), Err(WireError::ReservedNotZero));
    }

    #[test]
    fn unknown_or_malformed_relay_messages_are_errors() {
        let mut ack = RelayMessage::Ack { end_lsn: 1 }.encode();
        ack[4] = 1;
        assert_eq!(RelayMessage::decode(&ack), Err(WireError::ReservedNotZero));
        let mut other = ack.clone();
        other[..4].copy_from_slice(b"ZZZZ");
        assert_eq!(
            RelayMessage::decode(&other),
            Err(WireError::BadMagic(*b"ZZZZ"))
        );
        let mut welcome = RelayMessage::Welcome { durable_end: 1 }.encode();
        welcome[4] = 9;
        assert_eq!(
            RelayMessage::decode(&welcome),
            Err(WireError::UnknownVersion(9))
        );
        let mut reject = RelayMessage::Reject { reason: "x".into() }.encode();
        reject[4..8].copy_from_slice(&(MAX_REJECT_TEXT as u32 + 1).to_le_bytes());
        assert_eq!(
            RelayMessage::decode(&reject),
            Err(WireError::RejectTooLong(MAX_REJECT_TEXT + 1))
        );
    }
}
