//! Byte-level decoding of pgoutput messages. Input is untrusted network data:
//! every read is bounds-checked and returns [`DecodeError`], never panics.
#![deny(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use super::{
    Begin, Column, Commit, DecodeContext, Delete, Insert, LogicalMessage, Message, OldKind, Origin,
    ProtoVersion, Relation, RelationColumn, StreamAbort, StreamCommit, StreamStart, Truncate, Type,
    Update,
};
use bytes::Bytes;

/// Why a payload could not be decoded. Offsets are from the start of the
/// pgoutput message (its tag byte is offset 0).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty pgoutput message")]
    Empty,
    #[error(
        "pgoutput {message} message ends at byte {offset}: needed {needed} more bytes for {field}"
    )]
    Truncated {
        message: &'static str,
        field: &'static str,
        offset: usize,
        needed: usize,
    },
    #[error("pgoutput {message} message has {extra} trailing bytes at offset {offset}")]
    TrailingBytes {
        message: &'static str,
        offset: usize,
        extra: usize,
    },
    #[error("unknown pgoutput message tag {tag:#04x}")]
    UnknownTag { tag: u8 },
    #[error(
        "pgoutput {name} message (tag {tag:?}) needs protocol version {min_version}; this relay speaks versions 1 and 2. \
         hint: start replication with proto_version '2' and without two_phase or streaming 'parallel'"
    )]
    UnsupportedVersion {
        tag: char,
        name: &'static str,
        min_version: u8,
    },
    #[error(
        "pgoutput {name} message arrived on a protocol version 1 session, which has no streaming"
    )]
    StreamingOnV1 { name: &'static str },
    #[error(
        "pgoutput {message} message: {field} string has no NUL terminator (starts at offset {offset})"
    )]
    UnterminatedString {
        message: &'static str,
        field: &'static str,
        offset: usize,
    },
    #[error("pgoutput {message} message: {field} is not valid UTF-8 (offset {offset})")]
    InvalidUtf8 {
        message: &'static str,
        field: &'static str,
        offset: usize,
    },
    #[error("pgoutput {message} message: invalid {field} {value:#04x} at offset {offset}")]
    InvalidByte {
        message: &'static str,
        field: &'static str,
        value: u8,
        offset: usize,
    },
    #[error("pgoutput {message} message: negative {field} {value} at offset {offset}")]
    NegativeCount {
        message: &'static str,
        field: &'static str,
        value: i64,
        offset: usize,
    },
}

/// Decodes one pgoutput message (the XLogData payload, tag byte first).
pub fn decode(payload: &Bytes, ctx: DecodeContext) -> Result<Message, DecodeError> {
    let tag = *payload.first().ok_or(DecodeError::Empty)?;
    let name = match tag {
        b'B' => "Begin",
        b'C' => "Commit",
        b'O' => "Origin",
        b'R' => "Relation",
        b'Y' => "Type",
        b'I' => "Insert",
        b'U' => "Update",
        b'D' => "Delete",
        b'T' => "Truncate",
        b'M' => "Message",
        b'S' => "Stream Start",
        b'E' => "Stream Stop",
        b'c' => "Stream Commit",
        b'A' => "Stream Abort",
        b'b' | b'P' | b'K' | b'r' | b'p' => {
            let name = match tag {
                b'b' => "Begin Prepare",
                b'P' => "Prepare",
                b'K' => "Commit Prepared",
                b'r' => "Rollback Prepared",
                _ => "Stream Prepare",
            };
            return Err(DecodeError::UnsupportedVersion {
                tag: char::from(tag),
                name,
                min_version: 3,
            });
        }
        _ => return Err(DecodeError::UnknownTag { tag }),
    };
    if matches!(tag, b'S' | b'E' | b'c' | b'A') && ctx.version == ProtoVersion::V1 {
        return Err(DecodeError::StreamingOnV1 { name });
    }
    let mut r = Reader {
        buf: payload,
        pos: 1,
        message: name,
    };
    // Inside a stream block every data message leads with the subxact id.
    let xid = |r: &mut Reader| -> Result<Option<u32>, DecodeError> {
        if ctx.in_stream_block {
            r.u32("xid").map(Some)
        } else {
            Ok(None)
        }
    };
    let message = match tag {
        b'B' => Message::Begin(Begin {
            final_lsn: r.u64("final_lsn")?,
            commit_time: r.i64("commit_time")?,
            xid: r.u32("xid")?,
        }),
        b'C' => Message::Commit(Commit {
            flags: r.u8("flags")?,
            commit_lsn: r.u64("commit_lsn")?,
            end_lsn: r.u64("end_lsn")?,
            commit_time: r.i64("commit_time")?,
        }),
        b'O' => Message::Origin(Origin {
            commit_lsn: r.u64("origin_lsn")?,
            name: r.string("origin_name")?,
        }),
        b'R' => {
            let xid = xid(&mut r)?;
            let oid = r.u32("relation_oid")?;
            let namespace = r.string("namespace")?;
            let name = r.string("relation_name")?;
            let replica_identity = r.u8("replica_identity")?;
            if !matches!(replica_identity, b'd' | b'n' | b'f' | b'i') {
                return Err(r.invalid("replica_identity", replica_identity, 1));
            }
            let count = r.count16("column_count")?;
            let mut columns = Vec::with_capacity(count.min(1600));
            for _ in 0..count {
                columns.push(RelationColumn {
                    key: r.u8("column_flags")? & 1 != 0,
                    name: r.string("column_name")?,
                    type_oid: r.u32("column_type_oid")?,
                    type_modifier: r.i32("column_type_modifier")?,
                });
            }
            Message::Relation(Relation {
                xid,
                oid,
                namespace,
                name,
                replica_identity,
                columns,
            })
        }
        b'Y' => Message::Type(Type {
            xid: xid(&mut r)?,
            oid: r.u32("type_oid")?,
            namespace: r.string("type_namespace")?,
            name: r.string("type_name")?,
        }),
        b'I' => {
            let xid = xid(&mut r)?;
            let relation = r.u32("relation_oid")?;
            r.expect_byte("new_tuple_marker", b'N')?;
            Message::Insert(Insert {
                xid,
                relation,
                new: r.tuple()?,
            })
        }
        b'U' => {
            let xid = xid(&mut r)?;
            let relation = r.u32("relation_oid")?;
            let marker = r.u8("tuple_marker")?;
            let old = match marker {
                b'K' | b'O' => {
                    let kind = if marker == b'K' {
                        OldKind::Key
                    } else {
                        OldKind::Full
                    };
                    let old = r.tuple()?;
                    r.expect_byte("new_tuple_marker", b'N')?;
                    Some((kind, old))
                }
                b'N' => None,
                other => return Err(r.invalid("tuple_marker", other, 1)),
            };
            Message::Update(Update {
                xid,
                relation,
                old,
                new: r.tuple()?,
            })
        }
        b'D' => {
            let xid = xid(&mut r)?;
            let relation = r.u32("relation_oid")?;
            let old_kind = match r.u8("tuple_marker")? {
                b'K' => OldKind::Key,
                b'O' => OldKind::Full,
                other => return Err(r.invalid("tuple_marker", other, 1)),
            };
            Message::Delete(Delete {
                xid,
                relation,
                old_kind,
                old: r.tuple()?,
            })
        }
        b'T' => {
            let xid = xid(&mut r)?;
            let count = r.count32("relation_count")?;
            let flags = r.u8("truncate_flags")?;
            if flags & !3 != 0 {
                return Err(r.invalid("truncate_flags", flags, 1));
            }
            let mut relations = Vec::with_capacity(count.min(r.remaining() / 4));
            for _ in 0..count {
                relations.push(r.u32("relation_oid")?);
            }
            Message::Truncate(Truncate {
                xid,
                cascade: flags & 1 != 0,
                restart_identity: flags & 2 != 0,
                relations,
            })
        }
        b'M' => {
            let xid = xid(&mut r)?;
            let flags = r.u8("message_flags")?;
            if flags & !1 != 0 {
                return Err(r.invalid("message_flags", flags, 1));
            }
            let lsn = r.u64("message_lsn")?;
            let prefix = r.string("prefix")?;
            let len = r.count32("content_length")?;
            Message::Message(LogicalMessage {
                xid,
                transactional: flags & 1 != 0,
                lsn,
                prefix,
                content: r.bytes("content", len)?,
            })
        }
        b'S' => {
            let xid = r.u32("xid")?;
            let first = r.u8("first_segment")?;
            if first > 1 {
                return Err(r.invalid("first_segment", first, 1));
            }
            Message::StreamStart(StreamStart {
                xid,
                first_segment: first == 1,
            })
        }
        b'E' => Message::StreamStop,
        b'c' => Message::StreamCommit(StreamCommit {
            xid: r.u32("xid")?,
            flags: r.u8("flags")?,
            commit_lsn: r.u64("commit_lsn")?,
            end_lsn: r.u64("end_lsn")?,
            commit_time: r.i64("commit_time")?,
        }),
        b'A' => Message::StreamAbort(StreamAbort {
            xid: r.u32("xid")?,
            subxid: r.u32("subxid")?,
        }),
        _ => return Err(DecodeError::UnknownTag { tag }),
    };
    r.finish()?;
    Ok(message)
}

/// A bounds-checked big-endian cursor over one message.
struct Reader<'a> {
    buf: &'a Bytes,
    pos: usize,
    message: &'static str,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let bytes = self
            .buf
            .get(self.pos..self.pos.saturating_add(N))
            .and_then(|s| <[u8; N]>::try_from(s).ok())
            .ok_or_else(|| DecodeError::Truncated {
                message: self.message,
                field,
                offset: self.buf.len(),
                needed: N.saturating_sub(self.remaining()),
            })?;
        self.pos += N;
        Ok(bytes)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        self.take::<1>(field).map(|[b]| b)
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        self.take(field).map(u32::from_be_bytes)
    }

    fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        self.take(field).map(i32::from_be_bytes)
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        self.take(field).map(u64::from_be_bytes)
    }

    fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        self.take(field).map(i64::from_be_bytes)
    }

    fn count16(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let value = self.take(field).map(i16::from_be_bytes)?;
        usize::try_from(value).map_err(|_| self.negative(field, value.into(), 2))
    }

    fn count32(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let value = self.i32(field)?;
        usize::try_from(value).map_err(|_| self.negative(field, value.into(), 4))
    }

    fn negative(&self, field: &'static str, value: i64, width: usize) -> DecodeError {
        DecodeError::NegativeCount {
            message: self.message,
            field,
            value,
            offset: self.pos - width,
        }
    }

    fn invalid(&self, field: &'static str, value: u8, width: usize) -> DecodeError {
        DecodeError::InvalidByte {
            message: self.message,
            field,
            value,
            offset: self.pos - width,
        }
    }

    fn expect_byte(&mut self, field: &'static str, want: u8) -> Result<(), DecodeError> {
        let got = self.u8(field)?;
        if got == want {
            Ok(())
        } else {
            Err(self.invalid(field, got, 1))
        }
    }

    fn bytes(&mut self, field: &'static str, len: usize) -> Result<Bytes, DecodeError> {
        if len > self.remaining() {
            return Err(DecodeError::Truncated {
                message: self.message,
                field,
                offset: self.buf.len(),
                needed: len - self.remaining(),
            });
        }
        let out = self.buf.slice(self.pos..self.pos + len);
        self.pos += len;
        Ok(out)
    }

    fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let start = self.pos;
        let rest = self.buf.get(start..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::UnterminatedString {
                message: self.message,
                field,
                offset: start,
            })?;
        let text = rest.get(..len).unwrap_or_default();
        let text = std::str::from_utf8(text).map_err(|_| DecodeError::InvalidUtf8 {
            message: self.message,
            field,
            offset: start,
        })?;
        self.pos = start + len + 1;
        Ok(text.to_owned())
    }

    fn tuple(&mut self) -> Result<Vec<Column>, DecodeError> {
        let count = self.count16("tuple_column_count")?;
        let mut columns = Vec::with_capacity(count.min(self.remaining()));
        for _ in 0..count {
            columns.push(match self.u8("column_kind")? {
                b'n' => Column::Null,
                b'u' => Column::UnchangedToast,
                b't' => {
                    let len = self.count32("text_length")?;
                    Column::Text(self.bytes("text_value", len)?)
                }
                b'b' => {
                    let len = self.count32("binary_length")?;
                    Column::Binary(self.bytes("binary_value", len)?)
                }
                other => return Err(self.invalid("column_kind", other, 1)),
            });
        }
        Ok(columns)
    }

    fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(DecodeError::TrailingBytes {
                message: self.message,
                offset: self.pos,
                extra,
            }),
        }
    }
}
