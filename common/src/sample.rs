//! Deterministic sample envelopes for tests, golden vectors and benches
//! (feature `test-utils`). Every builder returns a valid envelope; tests
//! break one rule at a time from there.

use crate::envelope::{
    BeforeImage, Boundary, Capture, Change, ColumnSchema, DdlEvent, DdlKind, Envelope,
    LogicalMessage, Operation, PROTOCOL_VERSION, RelationSchema, ReplicaIdentity, RowChange,
    SourceIdentity, Value, boundary, capture, change, value,
};
use crate::fingerprint::fingerprint;

const INT8: u32 = 20;
const TEXT: u32 = 25;
const NUMERIC: u32 = 1700;

/// `public.sales (id int8 primary key, amount numeric, note text)`.
pub fn sales_relation() -> RelationSchema {
    let column = |name: &str, type_oid, key| ColumnSchema {
        name: name.into(),
        type_oid,
        type_modifier: -1,
        key,
    };
    let mut relation = RelationSchema {
        relation_id: 16_385,
        namespace: "public".into(),
        name: "sales".into(),
        replica_identity: ReplicaIdentity::Default as i32,
        columns: vec![
            column("id", INT8, true),
            column("amount", NUMERIC, false),
            column("note", TEXT, false),
        ],
        fingerprint: 0,
    };
    relation.fingerprint = fingerprint(&relation);
    relation
}

pub fn text(s: impl Into<String>) -> Value {
    Value {
        kind: Some(value::Kind::Text(s.into())),
    }
}

pub fn null() -> Value {
    Value {
        kind: Some(value::Kind::Null(true)),
    }
}

pub fn unchanged_toast() -> Value {
    Value {
        kind: Some(value::Kind::UnchangedToast(true)),
    }
}

pub fn absent() -> Value {
    Value {
        kind: Some(value::Kind::Absent(true)),
    }
}

/// An envelope around `bodies`, whole-transaction boundary, sequences 0..n.
pub fn envelope(relations: Vec<RelationSchema>, bodies: Vec<change::Body>) -> Envelope {
    let total = bodies.len() as u64;
    Envelope {
        protocol_version: PROTOCOL_VERSION,
        source: Some(SourceIdentity {
            source_id: "orders-primary".into(),
            dataset_id: "sales".into(),
            system_identifier: 7_301_234_567_890_123_456,
            database: "shop".into(),
            timeline: 1,
        }),
        xid: 7_345,
        begin_lsn: 0x16_B374_D000,
        commit_lsn: 0x16_B374_D848,
        end_lsn: 0x16_B374_D878,
        commit_time_micros: 1_796_000_000_000_000,
        relations,
        changes: bodies
            .into_iter()
            .enumerate()
            .map(|(i, body)| Change {
                sequence: i as u64,
                body: Some(body),
            })
            .collect(),
        boundary: Some(Boundary {
            mode: boundary::Mode::Whole as i32,
            chunk_index: 0,
            chunk_count: 1,
            first_sequence: 0,
            total_changes: total,
            partition: 0,
            manifest_partitions: Vec::new(),
        }),
        origin: String::new(),
        capture: Some(Capture {
            path: capture::Path::External as i32,
            server_version_num: 170_009,
            decoder: "pgoutput/2".into(),
            captured_at_micros: 1_796_000_000_001_000,
        }),
        checksum: 0,
    }
}

pub fn row(
    operation: Operation,
    before_kind: BeforeImage,
    before: Vec<Value>,
    after: Vec<Value>,
) -> change::Body {
    change::Body::Row(RowChange {
        relation_id: sales_relation().relation_id,
        operation: operation as i32,
        before_kind: before_kind as i32,
        before,
        after,
        truncate_cascade: false,
        truncate_restart_identity: false,
    })
}

/// `rows` inserts into `public.sales` whose note is `note_len` bytes.
pub fn insert_transaction(rows: usize, note_len: usize) -> Envelope {
    let note: String = "x".repeat(note_len);
    let bodies = (0..rows)
        .map(|i| {
            row(
                Operation::Insert,
                BeforeImage::None,
                Vec::new(),
                vec![
                    text(i.to_string()),
                    text(format!("{}.50", i * 3)),
                    text(note.clone()),
                ],
            )
        })
        .collect();
    envelope(vec![sales_relation()], bodies)
}

/// One of everything: insert, key-changing update with an unchanged TOAST
/// value, delete, truncate, a DDL event and a logical message.
pub fn mixed_transaction() -> Envelope {
    let bodies = vec![
        row(
            Operation::Insert,
            BeforeImage::None,
            Vec::new(),
            vec![text("1"), text("9.99"), null()],
        ),
        row(
            Operation::Update,
            BeforeImage::Key,
            vec![text("1"), absent(), absent()],
            vec![text("2"), text("10.00"), unchanged_toast()],
        ),
        row(
            Operation::Delete,
            BeforeImage::Key,
            vec![text("2"), absent(), absent()],
            Vec::new(),
        ),
        change::Body::Ddl(DdlEvent {
            kind: DdlKind::AddNullableColumn as i32,
            relation_id: sales_relation().relation_id,
            command_tag: "ALTER TABLE".into(),
            statement: "ALTER TABLE public.sales ADD COLUMN region text".into(),
            fingerprint_before: sales_relation().fingerprint,
            fingerprint_after: 0x0123_4567_89ab_cdef,
            ..DdlEvent::default()
        }),
        change::Body::Message(LogicalMessage {
            prefix: "app.audit".into(),
            content: b"\x00binary\xff".to_vec(),
        }),
        change::Body::Row(RowChange {
            relation_id: sales_relation().relation_id,
            operation: Operation::Truncate as i32,
            before_kind: BeforeImage::None as i32,
            before: Vec::new(),
            after: Vec::new(),
            truncate_cascade: true,
            truncate_restart_identity: true,
        }),
    ];
    envelope(vec![sales_relation()], bodies)
}

/// Chunk `index` of a partitioned transaction of `total` changes.
pub fn partitioned_chunk() -> Envelope {
    let mut envelope = insert_transaction(2, 4);
    for change in &mut envelope.changes {
        change.sequence += 3;
    }
    envelope.boundary = Some(Boundary {
        mode: boundary::Mode::Partitioned as i32,
        chunk_index: 1,
        chunk_count: 3,
        first_sequence: 3,
        total_changes: 7,
        partition: 4,
        manifest_partitions: vec![0, 4, 9],
    });
    envelope.capture = Some(Capture {
        path: capture::Path::Native as i32,
        server_version_num: 150_020,
        decoder: "trellara/1".into(),
        captured_at_micros: 1_796_000_000_002_000,
    });
    envelope.origin = "node_b".into();
    envelope
}

/// Chunk `index` of `count` of a one-row-per-chunk transaction committing at
/// `commit_lsn` (whole when `count` is 1).
pub fn chunk(commit_lsn: u64, index: u32, count: u32) -> Envelope {
    let mut envelope = insert_transaction(1, 4);
    envelope.commit_lsn = commit_lsn;
    envelope.end_lsn = commit_lsn + 0x10;
    envelope.begin_lsn = commit_lsn - 0x10;
    for change in &mut envelope.changes {
        change.sequence = u64::from(index);
    }
    envelope.boundary = Some(Boundary {
        mode: if count == 1 {
            boundary::Mode::Whole
        } else {
            boundary::Mode::Chunked
        } as i32,
        chunk_index: index,
        chunk_count: count,
        first_sequence: u64::from(index),
        total_changes: u64::from(count),
        partition: 0,
        manifest_partitions: Vec::new(),
    });
    envelope
}
