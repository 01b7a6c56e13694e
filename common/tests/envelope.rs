//! Envelope v1 contract: round trips, one test per broken rule, the
//! checksum trailer, and golden vectors that pin the wire format.
//!
//! Golden vectors live in tests/golden/*.bin. A wire change fails
//! `golden_vectors_are_stable` until the vectors are regenerated on purpose:
//! `TRELLARA_REGENERATE_GOLDEN=1 cargo test -p trellara-common --test envelope`.

use proptest::prelude::*;
use prost::Message;
use std::path::PathBuf;
use trellara_common::envelope::{
    BeforeImage, Envelope, EnvelopeError, Operation, RawEnvelope, boundary, change, decode, encode,
    validate, validate_change, value,
};
use trellara_common::sample;

#[test]
fn round_trip_preserves_every_field() {
    for original in [
        sample::mixed_transaction(),
        sample::partitioned_chunk(),
        sample::insert_transaction(50, 100),
    ] {
        let bytes = encode(&original).expect("valid sample");
        let mut decoded = decode(&bytes).expect("decodes");
        assert_ne!(decoded.checksum, 0);
        decoded.checksum = 0;
        assert_eq!(decoded, original);
    }
}

/// Changes encoded one by one and framed raw give exactly the bytes of the
/// whole envelope encoded at once.
#[test]
fn an_envelope_framed_from_encoded_changes_is_the_same_bytes() {
    for original in [
        sample::mixed_transaction(),
        sample::partitioned_chunk(),
        sample::insert_transaction(50, 100),
    ] {
        let frame = Envelope {
            changes: Vec::new(),
            ..original.clone()
        };
        let mut raw = RawEnvelope::new(frame, original.changes.len() as u64).expect("frame");
        for change in &original.changes {
            let width = |id| {
                original
                    .relations
                    .iter()
                    .find(|r| r.relation_id == id)
                    .map(|r| r.columns.len())
            };
            validate_change(change, width).expect("valid change");
            raw.push(&change.encode_to_vec()).expect("in sequence");
        }
        assert_eq!(
            raw.finish().expect("all held"),
            encode(&original).expect("valid")
        );
    }
    let original = sample::insert_transaction(3, 4);
    let frame = Envelope {
        changes: Vec::new(),
        ..original.clone()
    };
    let encoded: Vec<Vec<u8>> = original.changes.iter().map(|c| c.encode_to_vec()).collect();
    let mut short = RawEnvelope::new(frame.clone(), 3).expect("frame");
    short.push(&encoded[0]).expect("first");
    assert!(
        matches!(
            short.push(&encoded[2]),
            Err(EnvelopeError::OutOfSequence {
                expected: 1,
                found: 2,
                ..
            })
        ),
        "a gap in sequence is refused"
    );
    assert!(
        matches!(
            short.finish(),
            Err(EnvelopeError::ManifestCountMismatch {
                held: 1,
                total_changes: 3
            })
        ),
        "fewer changes than framed are refused"
    );
    assert!(
        matches!(
            RawEnvelope::new(frame, 2),
            Err(EnvelopeError::ManifestCountMismatch { .. })
        ),
        "the frame is validated against the count it will hold"
    );
}

#[test]
fn checksum_is_xxh3_of_the_encoding_with_checksum_zeroed() {
    let envelope = sample::mixed_transaction();
    let bytes = encode(&envelope).expect("valid");
    let zeroed = envelope.encode_to_vec();
    assert_eq!(&bytes[..zeroed.len()], &zeroed[..]);
    let stored = decode(&bytes).expect("decodes").checksum;
    assert_eq!(stored, xxhash_rust::xxh3::xxh3_64(&zeroed));
    assert_eq!(bytes.len(), zeroed.len() + 9);
}

#[test]
fn encode_ignores_a_stale_checksum_in_the_input() {
    let mut envelope = sample::mixed_transaction();
    let clean = encode(&envelope).expect("valid");
    envelope.checksum = 0xdead_beef;
    assert_eq!(encode(&envelope).expect("valid"), clean);
}

#[test]
fn every_flipped_byte_is_detected() {
    let bytes = encode(&sample::mixed_transaction()).expect("valid");
    for i in 0..bytes.len() {
        for bit in [0x01u8, 0x80] {
            let mut corrupt = bytes.clone();
            corrupt[i] ^= bit;
            assert!(
                decode(&corrupt).is_err(),
                "flip of bit {bit:#x} at byte {i} went unnoticed"
            );
        }
    }
}

#[test]
fn truncation_is_detected() {
    let bytes = encode(&sample::mixed_transaction()).expect("valid");
    for len in 0..bytes.len() {
        assert!(
            decode(&bytes[..len]).is_err(),
            "truncation to {len} bytes went unnoticed"
        );
    }
}

#[test]
fn checksum_mismatch_is_named() {
    let mut bytes = encode(&sample::mixed_transaction()).expect("valid");
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    assert!(matches!(
        decode(&bytes),
        Err(EnvelopeError::ChecksumMismatch { .. })
    ));
    assert!(matches!(decode(&[]), Err(EnvelopeError::MissingChecksum)));
}

/// Encodes an envelope that breaks a rule, bypassing `encode`'s validation,
/// with a correct checksum, so the decoder's own validation is exercised.
fn encode_unchecked(envelope: &Envelope) -> Vec<u8> {
    let mut bytes = envelope.encode_to_vec();
    let sum = xxhash_rust::xxh3::xxh3_64(&bytes);
    bytes.push(0x69);
    bytes.extend_from_slice(&sum.to_le_bytes());
    bytes
}

fn assert_refused(mutate: impl Fn(&mut Envelope), expect: impl Fn(&EnvelopeError) -> bool) {
    let mut envelope = sample::mixed_transaction();
    mutate(&mut envelope);
    let on_encode = encode(&envelope).expect_err("encode must refuse");
    assert!(expect(&on_encode), "encode gave {on_encode:?}");
    let on_decode = decode(&encode_unchecked(&envelope)).expect_err("decode must refuse");
    assert!(expect(&on_decode), "decode gave {on_decode:?}");
    assert!(!on_encode.to_string().is_empty());
}

#[test]
fn unknown_version() {
    assert_refused(
        |e| e.protocol_version = 2,
        |e| matches!(e, EnvelopeError::UnknownVersion(2)),
    );
    assert_refused(
        |e| e.protocol_version = 0,
        |e| matches!(e, EnvelopeError::UnknownVersion(0)),
    );
}

#[test]
fn identity_rules() {
    assert_refused(
        |e| e.source = None,
        |e| matches!(e, EnvelopeError::MissingField("source")),
    );
    assert_refused(
        |e| e.source.as_mut().unwrap().source_id.clear(),
        |e| matches!(e, EnvelopeError::EmptySourceId),
    );
    assert_refused(
        |e| e.source.as_mut().unwrap().dataset_id.clear(),
        |e| matches!(e, EnvelopeError::EmptyDatasetId),
    );
    assert_refused(
        |e| e.source.as_mut().unwrap().database.clear(),
        |e| matches!(e, EnvelopeError::EmptyDatabase),
    );
    assert_refused(
        |e| e.source.as_mut().unwrap().timeline = 0,
        |e| matches!(e, EnvelopeError::ZeroTimeline),
    );
    assert_refused(|e| e.xid = 0, |e| matches!(e, EnvelopeError::ZeroXid));
}

#[test]
fn lsn_and_time_rules() {
    assert_refused(
        |e| e.begin_lsn = 0,
        |e| matches!(e, EnvelopeError::ZeroBeginLsn),
    );
    assert_refused(
        |e| e.commit_lsn = e.begin_lsn - 1,
        |e| matches!(e, EnvelopeError::CommitBeforeBegin { .. }),
    );
    assert_refused(
        |e| e.end_lsn = e.commit_lsn,
        |e| matches!(e, EnvelopeError::EndNotAfterCommit { .. }),
    );
    assert_refused(
        |e| e.commit_time_micros = 0,
        |e| matches!(e, EnvelopeError::InvalidCommitTime(0)),
    );
    assert_refused(
        |e| e.capture = None,
        |e| matches!(e, EnvelopeError::MissingField("capture")),
    );
    assert_refused(
        |e| e.capture.as_mut().unwrap().path = 0,
        |e| matches!(e, EnvelopeError::UnknownCapturePath(0)),
    );
}

#[test]
fn boundary_rules() {
    assert_refused(
        |e| e.boundary = None,
        |e| matches!(e, EnvelopeError::MissingField("boundary")),
    );
    assert_refused(
        |e| e.boundary.as_mut().unwrap().mode = 0,
        |e| matches!(e, EnvelopeError::UnknownBoundaryMode(0)),
    );
    assert_refused(
        |e| {
            let b = e.boundary.as_mut().unwrap();
            b.mode = boundary::Mode::Chunked as i32;
            b.chunk_index = 3;
            b.chunk_count = 3;
        },
        |e| {
            matches!(
                e,
                EnvelopeError::ChunkIndexOutOfRange { index: 3, count: 3 }
            )
        },
    );
    assert_refused(
        |e| e.boundary.as_mut().unwrap().chunk_count = 2,
        |e| matches!(e, EnvelopeError::WholeNotSingleChunk { .. }),
    );
    assert_refused(
        |e| e.boundary.as_mut().unwrap().total_changes += 1,
        |e| matches!(e, EnvelopeError::ManifestCountMismatch { .. }),
    );
    assert_refused(
        |e| e.boundary.as_mut().unwrap().total_changes -= 1,
        |e| matches!(e, EnvelopeError::ChangesExceedManifest { .. }),
    );
    let mut chunk = sample::partitioned_chunk();
    chunk.boundary.as_mut().unwrap().partition = 5;
    assert!(matches!(
        encode(&chunk),
        Err(EnvelopeError::PartitionNotInManifest { partition: 5, .. })
    ));
}

#[test]
fn sequence_rules() {
    assert_refused(
        |e| e.changes.swap(1, 2),
        |e| {
            matches!(
                e,
                EnvelopeError::OutOfSequence {
                    index: 1,
                    expected: 1,
                    found: 2
                }
            )
        },
    );
    assert_refused(
        |e| e.changes[0].body = None,
        |e| matches!(e, EnvelopeError::EmptyChange { sequence: 0 }),
    );
}

fn first_row(e: &mut Envelope, index: usize) -> &mut trellara_common::envelope::RowChange {
    match e.changes[index].body.as_mut() {
        Some(change::Body::Row(row)) => row,
        other => panic!("change {index} is not a row: {other:?}"),
    }
}

#[test]
fn relation_rules() {
    assert_refused(
        |e| first_row(e, 0).relation_id = 1,
        |e| {
            matches!(
                e,
                EnvelopeError::UnknownRelation {
                    sequence: 0,
                    relation_id: 1
                }
            )
        },
    );
    assert_refused(
        |e| e.relations.push(e.relations[0].clone()),
        |e| matches!(e, EnvelopeError::DuplicateRelation { .. }),
    );
    assert_refused(
        |e| e.relations[0].columns[1].type_oid = 701,
        |e| matches!(e, EnvelopeError::FingerprintMismatch { .. }),
    );
    assert_refused(
        |e| e.relations[0].name.clear(),
        |e| matches!(e, EnvelopeError::UnnamedRelation { .. }),
    );
}

#[test]
fn row_image_rules() {
    assert_refused(
        |e| first_row(e, 0).operation = 0,
        |e| matches!(e, EnvelopeError::UnknownOperation { sequence: 0, .. }),
    );
    assert_refused(
        |e| {
            first_row(e, 0).after.pop();
        },
        |e| {
            matches!(
                e,
                EnvelopeError::ImageWidth {
                    sequence: 0,
                    image: "after",
                    expected: 3,
                    found: 2,
                    ..
                }
            )
        },
    );
    // A delete without an old image cannot be applied.
    assert_refused(
        |e| {
            let row = first_row(e, 2);
            row.before.clear();
            row.before_kind = BeforeImage::None as i32;
        },
        |e| {
            matches!(
                e,
                EnvelopeError::ImageWidth {
                    sequence: 2,
                    image: "before",
                    ..
                }
            )
        },
    );
    // An insert never carries an old image.
    assert_refused(
        |e| {
            let row = first_row(e, 0);
            row.before = row.after.clone();
            row.before_kind = BeforeImage::Full as i32;
        },
        |e| {
            matches!(
                e,
                EnvelopeError::UnexpectedImage {
                    sequence: 0,
                    image: "before",
                    ..
                }
            )
        },
    );
    assert_refused(
        |e| first_row(e, 1).before_kind = BeforeImage::None as i32,
        |e| matches!(e, EnvelopeError::BeforeKindMismatch { sequence: 1, .. }),
    );
    assert_refused(
        |e| first_row(e, 0).after[2].kind = None,
        |e| {
            matches!(
                e,
                EnvelopeError::EmptyValue {
                    sequence: 0,
                    column: 2
                }
            )
        },
    );
    // Unchanged TOAST is only meaningful in an update's new image.
    assert_refused(
        |e| first_row(e, 0).after[2] = sample::unchanged_toast(),
        |e| {
            matches!(
                e,
                EnvelopeError::MisplacedValue {
                    sequence: 0,
                    column: 2,
                    kind: "unchanged_toast",
                    ..
                }
            )
        },
    );
    // A full old image has every column.
    assert_refused(
        |e| first_row(e, 1).before_kind = BeforeImage::Full as i32,
        |e| {
            matches!(
                e,
                EnvelopeError::MisplacedValue {
                    sequence: 1,
                    column: 1,
                    kind: "absent",
                    ..
                }
            )
        },
    );
    assert_refused(
        |e| first_row(e, 5).after = vec![sample::null(); 3],
        |e| {
            matches!(
                e,
                EnvelopeError::UnexpectedImage {
                    sequence: 5,
                    image: "after",
                    ..
                }
            )
        },
    );
    assert_refused(
        |e| {
            if let Some(change::Body::Ddl(ddl)) = e.changes[3].body.as_mut() {
                ddl.kind = 99;
            }
        },
        |e| {
            matches!(
                e,
                EnvelopeError::UnknownDdlKind {
                    sequence: 3,
                    kind: 99
                }
            )
        },
    );
}

#[test]
fn unchanged_toast_is_not_null() {
    let bytes = encode(&sample::mixed_transaction()).expect("valid");
    let decoded = decode(&bytes).expect("decodes");
    let Some(change::Body::Row(update)) = &decoded.changes[1].body else {
        panic!("change 1 is the update");
    };
    assert_eq!(update.operation, Operation::Update as i32);
    assert_eq!(
        update.after[2].kind,
        Some(value::Kind::UnchangedToast(true))
    );
    let Some(change::Body::Row(insert)) = &decoded.changes[0].body else {
        panic!("change 0 is the insert");
    };
    assert_eq!(insert.after[2].kind, Some(value::Kind::Null(true)));
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

#[test]
fn golden_vectors_are_stable() {
    let vectors = [
        ("mixed_transaction", sample::mixed_transaction()),
        ("partitioned_chunk", sample::partitioned_chunk()),
        ("insert_transaction_3", sample::insert_transaction(3, 8)),
    ];
    let regenerate = std::env::var_os("TRELLARA_REGENERATE_GOLDEN").is_some();
    for (name, envelope) in vectors {
        let path = golden_dir().join(format!("{name}.bin"));
        let bytes = encode(&envelope).expect("valid sample");
        if regenerate {
            std::fs::write(&path, &bytes).expect("write golden vector");
            continue;
        }
        let golden = std::fs::read(&path).unwrap_or_else(|e| {
            panic!("missing golden vector {} ({e}); regenerate deliberately with TRELLARA_REGENERATE_GOLDEN=1", path.display())
        });
        assert!(
            golden == bytes,
            "the wire encoding of {name} changed; if that is intended, bump the protocol as needed and regenerate with TRELLARA_REGENERATE_GOLDEN=1"
        );
        let mut decoded = decode(&golden).expect("golden vector decodes");
        decoded.checksum = 0;
        assert_eq!(decoded, envelope);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Arbitrary bytes never panic the decoder and are never accepted unless
    /// their checksum holds.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn round_trip_any_insert_transaction(rows in 0usize..40, note in 0usize..300, xid in 1u64..u64::MAX, begin in 1u64..u64::MAX / 2, span in 0u64..1_000_000) {
        let mut envelope = sample::insert_transaction(rows, note);
        envelope.xid = xid;
        envelope.begin_lsn = begin;
        envelope.commit_lsn = begin + span;
        envelope.end_lsn = begin + span + 1;
        validate(&envelope).expect("valid");
        let mut decoded = decode(&encode(&envelope).expect("valid")).expect("decodes");
        decoded.checksum = 0;
        prop_assert_eq!(decoded, envelope);
    }
}
