//! The inverse of [`decode`](super::decode): one [`Message`] as the bytes a
//! walsender sends. Capture never encodes; the deterministic simulator's
//! walsender does, so the simulated stream goes through the real decoder.

use super::{Column, Message, OldKind};
use bytes::{BufMut, Bytes, BytesMut};

/// The XLogData payload of `message` (a data message with `xid: Some(_)`
/// is written as inside a stream block).
pub fn encode(message: &Message) -> Bytes {
    let mut b = BytesMut::with_capacity(64);
    let xid = |b: &mut BytesMut, xid: Option<u32>| {
        if let Some(xid) = xid {
            b.put_u32(xid);
        }
    };
    match message {
        Message::Begin(m) => {
            b.put_u8(b'B');
            b.put_u64(m.final_lsn);
            b.put_i64(m.commit_time);
            b.put_u32(m.xid);
        }
        Message::Commit(m) => {
            b.put_u8(b'C');
            b.put_u8(m.flags);
            b.put_u64(m.commit_lsn);
            b.put_u64(m.end_lsn);
            b.put_i64(m.commit_time);
        }
        Message::Origin(m) => {
            b.put_u8(b'O');
            b.put_u64(m.commit_lsn);
            string(&mut b, &m.name);
        }
        Message::Relation(m) => {
            b.put_u8(b'R');
            xid(&mut b, m.xid);
            b.put_u32(m.oid);
            string(&mut b, &m.namespace);
            string(&mut b, &m.name);
            b.put_u8(m.replica_identity);
            b.put_u16(m.columns.len() as u16);
            for c in &m.columns {
                b.put_u8(u8::from(c.key));
                string(&mut b, &c.name);
                b.put_u32(c.type_oid);
                b.put_i32(c.type_modifier);
            }
        }
        Message::Type(m) => {
            b.put_u8(b'Y');
            xid(&mut b, m.xid);
            b.put_u32(m.oid);
            string(&mut b, &m.namespace);
            string(&mut b, &m.name);
        }
        Message::Insert(m) => {
            b.put_u8(b'I');
            xid(&mut b, m.xid);
            b.put_u32(m.relation);
            b.put_u8(b'N');
            tuple(&mut b, &m.new);
        }
        Message::Update(m) => {
            b.put_u8(b'U');
            xid(&mut b, m.xid);
            b.put_u32(m.relation);
            if let Some((kind, old)) = &m.old {
                b.put_u8(marker(*kind));
                tuple(&mut b, old);
            }
            b.put_u8(b'N');
            tuple(&mut b, &m.new);
        }
        Message::Delete(m) => {
            b.put_u8(b'D');
            xid(&mut b, m.xid);
            b.put_u32(m.relation);
            b.put_u8(marker(m.old_kind));
            tuple(&mut b, &m.old);
        }
        Message::Truncate(m) => {
            b.put_u8(b'T');
            xid(&mut b, m.xid);
            b.put_u32(m.relations.len() as u32);
            b.put_u8(u8::from(m.cascade) | u8::from(m.restart_identity) << 1);
            for oid in &m.relations {
                b.put_u32(*oid);
            }
        }
        Message::Message(m) => {
            b.put_u8(b'M');
            xid(&mut b, m.xid);
            b.put_u8(u8::from(m.transactional));
            b.put_u64(m.lsn);
            string(&mut b, &m.prefix);
            b.put_u32(m.content.len() as u32);
            b.put_slice(&m.content);
        }
        Message::StreamStart(m) => {
            b.put_u8(b'S');
            b.put_u32(m.xid);
            b.put_u8(u8::from(m.first_segment));
        }
        Message::StreamStop => b.put_u8(b'E'),
        Message::StreamCommit(m) => {
            b.put_u8(b'c');
            b.put_u32(m.xid);
            b.put_u8(m.flags);
            b.put_u64(m.commit_lsn);
            b.put_u64(m.end_lsn);
            b.put_i64(m.commit_time);
        }
        Message::StreamAbort(m) => {
            b.put_u8(b'A');
            b.put_u32(m.xid);
            b.put_u32(m.subxid);
        }
    }
    b.freeze()
}

fn marker(kind: OldKind) -> u8 {
    match kind {
        OldKind::Key => b'K',
        OldKind::Full => b'O',
    }
}

fn string(b: &mut BytesMut, s: &str) {
    b.put_slice(s.as_bytes());
    b.put_u8(0);
}

fn tuple(b: &mut BytesMut, columns: &[Column]) {
    b.put_u16(columns.len() as u16);
    for c in columns {
        match c {
            Column::Null => b.put_u8(b'n'),
            Column::UnchangedToast => b.put_u8(b'u'),
            Column::Text(v) => {
                b.put_u8(b't');
                b.put_u32(v.len() as u32);
                b.put_slice(v);
            }
            Column::Binary(v) => {
                b.put_u8(b'b');
                b.put_u32(v.len() as u32);
                b.put_slice(v);
            }
        }
    }
}
