//! pgoutput decoder: every message of protocol v1 and v2 from hand-built
//! bytes (layouts from PostgreSQL's proto.c), refusal of v3/v4 messages, and
//! malformed input (every truncation, trailing bytes, bad markers, arbitrary
//! bytes) answered with an error, never a panic.

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;
use trellara_external_relay::pgoutput::{
    Begin, Column, Commit, DecodeContext, DecodeError, Delete, Insert, LogicalMessage, Message,
    OldKind, Origin, ProtoVersion, Relation, RelationColumn, StreamAbort, StreamCommit,
    StreamStart, Truncate, Type, Update, decode,
};

const V1: DecodeContext = DecodeContext {
    version: ProtoVersion::V1,
    in_stream_block: false,
};
const V2: DecodeContext = DecodeContext {
    version: ProtoVersion::V2,
    in_stream_block: false,
};
const V2_STREAM: DecodeContext = DecodeContext {
    version: ProtoVersion::V2,
    in_stream_block: true,
};

/// A tiny big-endian writer mirroring proto.c's pq_send* calls.
struct W(BytesMut);

impl W {
    fn tag(t: u8) -> W {
        let mut b = BytesMut::new();
        b.put_u8(t);
        W(b)
    }
    fn u8(mut self, v: u8) -> W {
        self.0.put_u8(v);
        self
    }
    fn i16(mut self, v: i16) -> W {
        self.0.put_i16(v);
        self
    }
    fn u32(mut self, v: u32) -> W {
        self.0.put_u32(v);
        self
    }
    fn i32(mut self, v: i32) -> W {
        self.0.put_i32(v);
        self
    }
    fn u64(mut self, v: u64) -> W {
        self.0.put_u64(v);
        self
    }
    fn i64(mut self, v: i64) -> W {
        self.0.put_i64(v);
        self
    }
    fn str(mut self, s: &str) -> W {
        self.0.put_slice(s.as_bytes());
        self.0.put_u8(0);
        self
    }
    fn raw(mut self, b: &[u8]) -> W {
        self.0.put_slice(b);
        self
    }
    /// TupleData: 'n', 'u', or 't' + text.
    fn tuple(mut self, cols: &[Option<&str>], toast_at: Option<usize>) -> W {
        self.0.put_i16(cols.len() as i16);
        for (i, c) in cols.iter().enumerate() {
            if toast_at == Some(i) {
                self.0.put_u8(b'u');
            } else if let Some(text) = c {
                self.0.put_u8(b't');
                self.0.put_i32(text.len() as i32);
                self.0.put_slice(text.as_bytes());
            } else {
                self.0.put_u8(b'n');
            }
        }
        self
    }
    fn done(self) -> Bytes {
        self.0.freeze()
    }
}

fn text(s: &str) -> Column {
    Column::Text(Bytes::copy_from_slice(s.as_bytes()))
}

/// Every message of v1 and v2 with what it must decode to and the context
/// it is valid in.
fn corpus() -> Vec<(Bytes, DecodeContext, Message)> {
    vec![
        (
            W::tag(b'B')
                .u64(0x16_B374_D848)
                .i64(800_000_000_000_000)
                .u32(7345)
                .done(),
            V1,
            Message::Begin(Begin {
                final_lsn: 0x16_B374_D848,
                commit_time: 800_000_000_000_000,
                xid: 7345,
            }),
        ),
        (
            W::tag(b'C').u8(0).u64(0x100).u64(0x130).i64(5).done(),
            V1,
            Message::Commit(Commit {
                flags: 0,
                commit_lsn: 0x100,
                end_lsn: 0x130,
                commit_time: 5,
            }),
        ),
        (
            W::tag(b'O').u64(0x42).str("node_b").done(),
            V1,
            Message::Origin(Origin {
                commit_lsn: 0x42,
                name: "node_b".into(),
            }),
        ),
        (
            W::tag(b'R')
                .u32(16385)
                .str("public")
                .str("sales")
                .u8(b'd')
                .i16(2)
                .u8(1)
                .str("id")
                .u32(20)
                .i32(-1)
                .u8(0)
                .str("note")
                .u32(25)
                .i32(-1)
                .done(),
            V1,
            Message::Relation(Relation {
                xid: None,
                oid: 16385,
                namespace: "public".into(),
                name: "sales".into(),
                replica_identity: b'd',
                columns: vec![
                    RelationColumn {
                        key: true,
                        name: "id".into(),
                        type_oid: 20,
                        type_modifier: -1,
                    },
                    RelationColumn {
                        key: false,
                        name: "note".into(),
                        type_oid: 25,
                        type_modifier: -1,
                    },
                ],
            }),
        ),
        (
            W::tag(b'R')
                .u32(99)
                .u32(16385)
                .str("")
                .str("t")
                .u8(b'f')
                .i16(0)
                .done(),
            V2_STREAM,
            Message::Relation(Relation {
                xid: Some(99),
                oid: 16385,
                namespace: String::new(),
                name: "t".into(),
                replica_identity: b'f',
                columns: vec![],
            }),
        ),
        (
            W::tag(b'Y').u32(16400).str("public").str("mood").done(),
            V1,
            Message::Type(Type {
                xid: None,
                oid: 16400,
                namespace: "public".into(),
                name: "mood".into(),
            }),
        ),
        (
            W::tag(b'I')
                .u32(16385)
                .u8(b'N')
                .tuple(&[Some("1"), None], None)
                .done(),
            V1,
            Message::Insert(Insert {
                xid: None,
                relation: 16385,
                new: vec![text("1"), Column::Null],
            }),
        ),
        (
            W::tag(b'I')
                .u32(100)
                .u32(16385)
                .u8(b'N')
                .tuple(&[Some("1")], None)
                .done(),
            V2_STREAM,
            Message::Insert(Insert {
                xid: Some(100),
                relation: 16385,
                new: vec![text("1")],
            }),
        ),
        (
            W::tag(b'U')
                .u32(16385)
                .u8(b'N')
                .tuple(&[Some("1"), None], Some(1))
                .done(),
            V1,
            Message::Update(Update {
                xid: None,
                relation: 16385,
                old: None,
                new: vec![text("1"), Column::UnchangedToast],
            }),
        ),
        (
            W::tag(b'U')
                .u32(16385)
                .u8(b'K')
                .tuple(&[Some("1"), None], None)
                .u8(b'N')
                .tuple(&[Some("2"), Some("x")], None)
                .done(),
            V1,
            Message::Update(Update {
                xid: None,
                relation: 16385,
                old: Some((OldKind::Key, vec![text("1"), Column::Null])),
                new: vec![text("2"), text("x")],
            }),
        ),
        (
            W::tag(b'U')
                .u32(16385)
                .u8(b'O')
                .tuple(&[Some("1"), Some("a")], None)
                .u8(b'N')
                .tuple(&[Some("1"), Some("b")], None)
                .done(),
            V1,
            Message::Update(Update {
                xid: None,
                relation: 16385,
                old: Some((OldKind::Full, vec![text("1"), text("a")])),
                new: vec![text("1"), text("b")],
            }),
        ),
        (
            W::tag(b'D')
                .u32(16385)
                .u8(b'K')
                .tuple(&[Some("1"), None], None)
                .done(),
            V1,
            Message::Delete(Delete {
                xid: None,
                relation: 16385,
                old_kind: OldKind::Key,
                old: vec![text("1"), Column::Null],
            }),
        ),
        (
            W::tag(b'T').i32(2).u8(3).u32(16385).u32(16390).done(),
            V1,
            Message::Truncate(Truncate {
                xid: None,
                cascade: true,
                restart_identity: true,
                relations: vec![16385, 16390],
            }),
        ),
        (
            W::tag(b'M')
                .u8(1)
                .u64(0x77)
                .str("app")
                .i32(3)
                .raw(&[0, 1, 255])
                .done(),
            V1,
            Message::Message(LogicalMessage {
                xid: None,
                transactional: true,
                lsn: 0x77,
                prefix: "app".into(),
                content: Bytes::from_static(&[0, 1, 255]),
            }),
        ),
        (
            W::tag(b'S').u32(500).u8(1).done(),
            V2,
            Message::StreamStart(StreamStart {
                xid: 500,
                first_segment: true,
            }),
        ),
        (W::tag(b'E').done(), V2_STREAM, Message::StreamStop),
        (
            W::tag(b'c')
                .u32(500)
                .u8(0)
                .u64(0x900)
                .u64(0x930)
                .i64(9)
                .done(),
            V2,
            Message::StreamCommit(StreamCommit {
                xid: 500,
                flags: 0,
                commit_lsn: 0x900,
                end_lsn: 0x930,
                commit_time: 9,
            }),
        ),
        (
            W::tag(b'A').u32(500).u32(501).done(),
            V2,
            Message::StreamAbort(StreamAbort {
                xid: 500,
                subxid: 501,
            }),
        ),
    ]
}

#[test]
fn decodes_every_v1_and_v2_message() {
    for (bytes, ctx, want) in corpus() {
        assert_eq!(decode(&bytes, ctx), Ok(want), "bytes {bytes:?}");
    }
}

/// The simulator's walsender writes exactly what a server writes.
#[test]
fn encode_is_the_inverse_of_decode() {
    for (bytes, _, message) in corpus() {
        assert_eq!(
            trellara_external_relay::pgoutput::encode(&message),
            bytes,
            "{message:?}"
        );
    }
}

#[test]
fn every_truncation_is_an_error() {
    for (bytes, ctx, _) in corpus() {
        for len in 0..bytes.len() {
            let cut = bytes.slice(..len);
            assert!(
                decode(&cut, ctx).is_err(),
                "{bytes:?} truncated to {len} decoded"
            );
        }
    }
}

#[test]
fn trailing_bytes_are_an_error() {
    for (bytes, ctx, _) in corpus() {
        let mut longer = BytesMut::from(&bytes[..]);
        longer.put_u8(0);
        assert!(
            matches!(
                decode(&longer.freeze(), ctx),
                Err(DecodeError::TrailingBytes { extra: 1, .. })
            ),
            "{bytes:?} + 1 byte decoded"
        );
    }
}

#[test]
fn v3_and_v4_messages_are_refused_by_name() {
    for (tag, name) in [
        (b'b', "Begin Prepare"),
        (b'P', "Prepare"),
        (b'K', "Commit Prepared"),
        (b'r', "Rollback Prepared"),
        (b'p', "Stream Prepare"),
    ] {
        let err = decode(&W::tag(tag).u64(1).done(), V2).expect_err("refused");
        assert_eq!(
            err,
            DecodeError::UnsupportedVersion {
                tag: char::from(tag),
                name,
                min_version: 3
            }
        );
        assert!(err.to_string().contains("proto_version '2'"));
    }
}

#[test]
fn streaming_messages_need_v2() {
    let start = W::tag(b'S').u32(1).u8(1).done();
    assert_eq!(
        decode(&start, V1),
        Err(DecodeError::StreamingOnV1 {
            name: "Stream Start"
        })
    );
}

#[test]
fn bad_markers_are_named() {
    let bad_update = W::tag(b'U').u32(1).u8(b'X').done();
    assert!(matches!(
        decode(&bad_update, V1),
        Err(DecodeError::InvalidByte {
            field: "tuple_marker",
            value: b'X',
            offset: 5,
            ..
        })
    ));
    let bad_kind = W::tag(b'I').u32(1).u8(b'N').i16(1).u8(b'z').done();
    assert!(matches!(
        decode(&bad_kind, V1),
        Err(DecodeError::InvalidByte {
            field: "column_kind",
            ..
        })
    ));
    let negative = W::tag(b'I').u32(1).u8(b'N').i16(-1).done();
    assert!(matches!(
        decode(&negative, V1),
        Err(DecodeError::NegativeCount { .. })
    ));
    let huge_text = W::tag(b'I')
        .u32(1)
        .u8(b'N')
        .i16(1)
        .u8(b't')
        .i32(i32::MAX)
        .done();
    assert!(matches!(
        decode(&huge_text, V1),
        Err(DecodeError::Truncated {
            field: "text_value",
            ..
        })
    ));
    let unterminated = W::tag(b'O').u64(1).raw(b"abc").done();
    assert!(matches!(
        decode(&unterminated, V1),
        Err(DecodeError::UnterminatedString { .. })
    ));
    let bad_utf8 = W::tag(b'O').u64(1).raw(&[0xff, 0]).done();
    assert!(matches!(
        decode(&bad_utf8, V1),
        Err(DecodeError::InvalidUtf8 { .. })
    ));
    assert_eq!(decode(&Bytes::new(), V1), Err(DecodeError::Empty));
    assert_eq!(
        decode(&Bytes::from_static(b"Z"), V1),
        Err(DecodeError::UnknownTag { tag: b'Z' })
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(tag in prop::sample::select(b"BCORYIUDTMSEcAbPKrpZ".to_vec()), body in prop::collection::vec(any::<u8>(), 0..64), stream in any::<bool>()) {
        let mut bytes = vec![tag];
        bytes.extend(body);
        let ctx = DecodeContext { version: ProtoVersion::V2, in_stream_block: stream };
        let _ = decode(&Bytes::from(bytes), ctx);
    }

    #[test]
    fn mutated_messages_never_panic(index in 0usize..18, pos in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let corpus = corpus();
        let (bytes, ctx, _) = &corpus[index % corpus.len()];
        let mut mutated = bytes.to_vec();
        let at = pos.index(mutated.len());
        mutated[at] = byte;
        let _ = decode(&Bytes::from(mutated), *ctx);
    }
}

fn fuzz_corpus_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/pgoutput_decode")
}

/// The checked-in seed corpus of the cargo-fuzz target is this corpus (one
/// mode byte - bit 0 protocol v2, bit 1 stream block - then the message).
/// Regenerate with TRELLARA_WRITE_FUZZ_CORPUS=1.
#[test]
fn fuzz_seed_corpus_matches() {
    let dir = fuzz_corpus_dir();
    for (i, (bytes, ctx, _)) in corpus().into_iter().enumerate() {
        let mode = u8::from(ctx.version == ProtoVersion::V2) | (u8::from(ctx.in_stream_block) << 1);
        let mut seed = vec![mode];
        seed.extend_from_slice(&bytes);
        let path = dir.join(format!("seed-{i:02}"));
        if std::env::var_os("TRELLARA_WRITE_FUZZ_CORPUS").is_some() {
            std::fs::create_dir_all(&dir).expect("create corpus dir");
            std::fs::write(&path, &seed).expect("write seed");
        }
        let stored = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "seed {} missing ({e}); regenerate with TRELLARA_WRITE_FUZZ_CORPUS=1",
                path.display()
            )
        });
        assert_eq!(stored, seed, "seed {} is stale", path.display());
    }
}
