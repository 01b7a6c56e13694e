//! The transaction assembler: commit order, one envelope per transaction,
//! streamed transactions held until Stream Commit and discarded on Stream
//! Abort (only the aborted subtransaction onwards), bounded memory with
//! spill and chunking, schema drift, and fail-closed on missing metadata.

use bytes::Bytes;
use std::collections::HashMap;
use std::convert::Infallible;
use trellara_common::envelope::{
    self, BeforeImage, Envelope, Operation, SourceIdentity, boundary, change, value,
};
use trellara_external_relay::pgoutput::{
    Begin, Column, Commit, Delete, Insert, LogicalMessage, Message, OldKind, Origin, Relation,
    RelationColumn, StreamAbort, StreamCommit, StreamStart, Truncate, Update,
};
use trellara_external_relay::{
    AssembleOrSink, Assembled, Assembler, AssemblerConfig, AssemblyError,
};

fn config(dir: &std::path::Path) -> AssemblerConfig {
    AssemblerConfig {
        source: SourceIdentity {
            source_id: "src".into(),
            dataset_id: "ds".into(),
            system_identifier: 1,
            database: "db".into(),
            timeline: 1,
        },
        server_version_num: 170009,
        decoder: "pgoutput/2".into(),
        memory_budget: 1 << 20,
        chunk_bytes: 1 << 20,
        spill_dir: dir.to_path_buf(),
        pinned: HashMap::new(),
        schemas: HashMap::new(),
    }
}

fn relation(oid: u32, name: &str, extra_column: bool) -> Message {
    let mut columns = vec![
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
    ];
    if extra_column {
        columns.push(RelationColumn {
            key: false,
            name: "extra".into(),
            type_oid: 25,
            type_modifier: -1,
        });
    }
    Message::Relation(Relation {
        xid: None,
        oid,
        namespace: "public".into(),
        name: name.into(),
        replica_identity: b'd',
        columns,
    })
}

fn t(s: &str) -> Column {
    Column::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn insert(xid: Option<u32>, id: &str) -> Message {
    Message::Insert(Insert {
        xid,
        relation: 16385,
        new: vec![t(id), t("n")],
    })
}

fn begin(xid: u32, lsn: u64) -> Message {
    Message::Begin(Begin {
        final_lsn: lsn,
        commit_time: 1_000,
        xid,
    })
}

fn commit(lsn: u64) -> Message {
    Message::Commit(Commit {
        flags: 0,
        commit_lsn: lsn,
        end_lsn: lsn + 0x28,
        commit_time: 1_000,
    })
}

/// An emitted envelope's bytes decode and validate, and agree with what
/// the publisher is told of them.
fn decoded(e: &Assembled) -> Envelope {
    let env = e.decode().expect("every emitted envelope is valid");
    let boundary = env.boundary.clone().expect("boundary");
    assert_eq!(
        (e.commit_lsn, e.end_lsn, e.last),
        (
            env.commit_lsn,
            env.end_lsn,
            boundary.chunk_index + 1 == boundary.chunk_count
        )
    );
    env
}

/// Feeds messages and collects what was emitted.
fn run(asm: &mut Assembler, messages: Vec<Message>) -> Result<Vec<Envelope>, AssemblyError> {
    let mut out = Vec::new();
    for (i, m) in messages.into_iter().enumerate() {
        let mut sink = |e: Assembled| -> Result<(), Infallible> {
            out.push(decoded(&e));
            Ok(())
        };
        asm.handle(m, 0x1000 + i as u64, &mut sink)
            .map_err(|e| match e {
                AssembleOrSink::Assembly(a) => a,
                AssembleOrSink::Sink(never) => match never {},
            })?;
    }
    Ok(out)
}

fn ids(envelope: &Envelope) -> Vec<String> {
    envelope
        .changes
        .iter()
        .filter_map(|c| match &c.body {
            Some(change::Body::Row(r)) => match r.after.first().and_then(|v| v.kind.as_ref()) {
                Some(value::Kind::Text(s)) => Some(s.clone()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn one_valid_envelope_per_committed_transaction() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let out = run(
        &mut asm,
        vec![
            relation(16385, "sales", false),
            begin(700, 0x5000),
            Message::Origin(Origin {
                commit_lsn: 1,
                name: "node_b".into(),
            }),
            insert(None, "1"),
            Message::Update(Update {
                xid: None,
                relation: 16385,
                old: Some((OldKind::Key, vec![t("1"), Column::Null])),
                new: vec![t("2"), Column::UnchangedToast],
            }),
            Message::Message(LogicalMessage {
                xid: None,
                transactional: true,
                lsn: 1,
                prefix: "p".into(),
                content: Bytes::from_static(b"c"),
            }),
            Message::Message(LogicalMessage {
                xid: None,
                transactional: false,
                lsn: 1,
                prefix: "p".into(),
                content: Bytes::new(),
            }),
            Message::Delete(Delete {
                xid: None,
                relation: 16385,
                old_kind: OldKind::Key,
                old: vec![t("2"), Column::Null],
            }),
            Message::Truncate(Truncate {
                xid: None,
                cascade: false,
                restart_identity: true,
                relations: vec![16385],
            }),
            commit(0x5000),
            begin(701, 0x6000),
            insert(None, "3"),
            commit(0x6000),
        ],
    )
    .expect("assembles");
    assert_eq!(out.len(), 2);
    let first = &out[0];
    assert_eq!(
        (first.xid, first.commit_lsn, first.end_lsn),
        (700, 0x5000, 0x5028)
    );
    assert_eq!(first.origin, "node_b");
    assert!(first.begin_lsn <= first.commit_lsn && first.begin_lsn != 0);
    assert_eq!(first.commit_time_micros, 1_000 + 946_684_800_000_000);
    assert_eq!(
        first.changes.len(),
        5,
        "the non-transactional message is not part of the transaction"
    );
    assert_eq!(asm.stats().skipped_nontransactional_messages, 1);
    let Some(change::Body::Row(update)) = &first.changes[1].body else {
        panic!("update")
    };
    assert_eq!(update.before_kind, BeforeImage::Key as i32);
    assert_eq!(
        update.before[1].kind,
        Some(value::Kind::Absent(true)),
        "non-key column of a key image is absent, not NULL"
    );
    assert_eq!(
        update.after[1].kind,
        Some(value::Kind::UnchangedToast(true)),
        "unchanged TOAST is not NULL"
    );
    let Some(change::Body::Row(trunc)) = &first.changes[4].body else {
        panic!("truncate")
    };
    assert_eq!(trunc.operation, Operation::Truncate as i32);
    assert!(trunc.truncate_restart_identity);
    // Every emitted envelope survives encode/decode (full validation).
    for e in &out {
        let bytes = envelope::encode(e).expect("valid");
        envelope::decode(&bytes).expect("decodes");
    }
    assert_eq!(ids(&out[1]), ["3"]);
}

#[test]
fn streamed_transactions_appear_only_at_stream_commit_and_stay_apart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let out = run(
        &mut asm,
        vec![
            relation(16385, "sales", false),
            Message::StreamStart(StreamStart {
                xid: 900,
                first_segment: true,
            }),
            insert(Some(900), "a1"),
            Message::StreamStop,
            Message::StreamStart(StreamStart {
                xid: 901,
                first_segment: true,
            }),
            insert(Some(901), "b1"),
            Message::StreamStop,
            // An ordinary transaction between stream blocks commits first.
            begin(950, 0x7000),
            insert(None, "plain"),
            commit(0x7000),
            Message::StreamStart(StreamStart {
                xid: 900,
                first_segment: false,
            }),
            insert(Some(900), "a2"),
            Message::StreamStop,
        ],
    )
    .expect("assembles");
    assert_eq!(out.len(), 1, "only the plain transaction committed");
    assert_eq!(ids(&out[0]), ["plain"]);
    assert!(asm.in_transaction(), "streams still open");

    let out = run(
        &mut asm,
        vec![
            Message::StreamCommit(StreamCommit {
                xid: 901,
                flags: 0,
                commit_lsn: 0x8000,
                end_lsn: 0x8028,
                commit_time: 5,
            }),
            Message::StreamCommit(StreamCommit {
                xid: 900,
                flags: 0,
                commit_lsn: 0x9000,
                end_lsn: 0x9028,
                commit_time: 6,
            }),
        ],
    )
    .expect("assembles");
    assert_eq!(
        out.iter().map(ids).collect::<Vec<_>>(),
        [vec!["b1"], vec!["a1", "a2"]]
    );
    assert_eq!((out[1].xid, out[1].commit_lsn), (900, 0x9000));
    assert!(!asm.in_transaction());
}

#[test]
fn stream_abort_discards_only_the_aborted_subtransaction_onwards() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let out = run(
        &mut asm,
        vec![
            relation(16385, "sales", false),
            Message::StreamStart(StreamStart {
                xid: 900,
                first_segment: true,
            }),
            insert(Some(900), "top"),
            insert(Some(901), "sub1"),
            insert(Some(902), "sub2"),
            Message::StreamStop,
            // ROLLBACK TO a savepoint taken before sub2.
            Message::StreamAbort(StreamAbort {
                xid: 900,
                subxid: 902,
            }),
            Message::StreamStart(StreamStart {
                xid: 900,
                first_segment: false,
            }),
            insert(Some(903), "sub3"),
            Message::StreamStop,
            // An abort of a subtransaction that wrote nothing changes nothing.
            Message::StreamAbort(StreamAbort {
                xid: 900,
                subxid: 999,
            }),
            Message::StreamCommit(StreamCommit {
                xid: 900,
                flags: 0,
                commit_lsn: 0x9000,
                end_lsn: 0x9028,
                commit_time: 6,
            }),
            Message::StreamStart(StreamStart {
                xid: 910,
                first_segment: true,
            }),
            insert(Some(910), "doomed"),
            Message::StreamStop,
            Message::StreamAbort(StreamAbort {
                xid: 910,
                subxid: 910,
            }),
        ],
    )
    .expect("assembles");
    assert_eq!(out.len(), 1, "the wholly aborted transaction never appears");
    assert_eq!(ids(&out[0]), ["top", "sub1", "sub3"]);
    assert!(!asm.in_transaction());
}

/// A subtransaction aborted across chunk boundaries: its rows and the
/// chunks planned for them go; the run stays contiguous and within size.
#[test]
fn a_subtransaction_abort_in_a_chunked_stream_replans_its_chunks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(dir.path());
    cfg.chunk_bytes = 2 * 1024;
    let mut asm = Assembler::new(cfg);
    let segment = |first: bool, rows: Vec<Message>| {
        let mut m = vec![Message::StreamStart(StreamStart {
            xid: 900,
            first_segment: first,
        })];
        m.extend(rows);
        m.push(Message::StreamStop);
        m
    };
    let mut messages = vec![relation(16385, "sales", false)];
    messages.extend(segment(
        true,
        (0..100)
            .map(|i| insert(Some(900), &format!("top{i}")))
            .collect(),
    ));
    messages.extend(segment(
        false,
        (0..300)
            .map(|i| insert(Some(901), &format!("sub{i}")))
            .collect(),
    ));
    messages.push(Message::StreamAbort(StreamAbort {
        xid: 900,
        subxid: 901,
    }));
    messages.extend(segment(
        false,
        (0..100)
            .map(|i| insert(Some(902), &format!("after{i}")))
            .collect(),
    ));
    messages.push(Message::StreamCommit(StreamCommit {
        xid: 900,
        flags: 0,
        commit_lsn: 0x9000,
        end_lsn: 0x9028,
        commit_time: 6,
    }));
    let mut out = run(&mut asm, messages).expect("assembles");
    let mut sink = |e: Assembled| -> Result<(), Infallible> {
        out.push(decoded(&e));
        Ok(())
    };
    while asm.emit_next(&mut sink).expect("next chunk") {}
    let mut expected: Vec<String> = (0..100).map(|i| format!("top{i}")).collect();
    expected.extend((0..100).map(|i| format!("after{i}")));
    assert_eq!(out.iter().flat_map(ids).collect::<Vec<_>>(), expected);
    assert!(out.len() >= 3, "several chunks: {}", out.len());
    for (i, e) in out.iter().enumerate() {
        let b = e.boundary.as_ref().expect("boundary");
        assert_eq!(
            (b.chunk_index as usize, b.chunk_count as usize),
            (i, out.len())
        );
        assert_eq!(b.total_changes, 200);
        assert!(!e.changes.is_empty(), "no empty chunk left by the abort");
        assert!(
            envelope::encode(e).expect("valid").len() < 3 * 1024,
            "chunk {i} within its size"
        );
    }
}

#[test]
fn large_transactions_spill_and_arrive_as_ordered_chunks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(dir.path());
    cfg.memory_budget = 4 * 1024;
    cfg.chunk_bytes = 16 * 1024;
    let mut asm = Assembler::new(cfg);
    let rows = 5_000;
    let mut messages = vec![relation(16385, "sales", false), begin(42, 0xA000)];
    messages.extend((0..rows).map(|i| insert(None, &i.to_string())));
    messages.push(commit(0xA000));
    let mut out = run(&mut asm, messages.clone()).expect("assembles");
    // The commit hands over the first chunk; each later one is built when
    // asked for, so the caller writes one before the next exists.
    assert_eq!(out.len(), 1, "only the first chunk at the commit");
    assert!(asm.finishing() && asm.in_transaction(), "the rest waits");
    let mut sink = |e: Assembled| -> Result<(), Infallible> {
        out.push(decoded(&e));
        Ok(())
    };
    while asm.emit_next(&mut sink).expect("next chunk") {}
    assert!(!asm.finishing() && !asm.in_transaction());
    assert!(out.len() > 3, "expected several chunks, got {}", out.len());
    assert!(asm.stats().spilled_transactions == 1);
    assert!(
        asm.stats().peak_memory <= 4 * 1024,
        "peak {}",
        asm.stats().peak_memory
    );
    let mut all = Vec::new();
    for (i, e) in out.iter().enumerate() {
        let b = e.boundary.as_ref().expect("boundary");
        assert_eq!(b.mode, boundary::Mode::Chunked as i32);
        assert_eq!(
            (
                b.chunk_index as usize,
                b.chunk_count as usize,
                b.total_changes
            ),
            (i, out.len(), rows as u64)
        );
        assert_eq!(b.first_sequence as usize, all.len());
        assert!(envelope::encode(e).expect("valid").len() < 20 * 1024);
        assert_eq!(
            e.relations.len(),
            1,
            "each chunk carries the schema its rows need"
        );
        all.extend(ids(e));
    }
    assert_eq!(all, (0..rows).map(|i| i.to_string()).collect::<Vec<_>>());

    // Chunks not asked for are emitted, in order, before the next message
    // is handled: none is lost by a caller that does not drain.
    let mut again = messages;
    again.remove(0);
    again[0] = begin(43, 0xB000);
    *again.last_mut().expect("commit") = commit(0xB000);
    again.push(begin(44, 0xC000));
    let next = run(&mut asm, again).expect("assembles");
    assert_eq!(next.len(), out.len(), "the whole run, before Begin 44");
    assert!(
        next.iter().enumerate().all(|(i, e)| e.commit_lsn == 0xB000
            && e.boundary
                .as_ref()
                .is_some_and(|b| b.chunk_index as usize == i)),
        "in order"
    );
    assert!(asm.in_transaction(), "44 is open");
}

#[test]
fn schema_drift_stops_capture_naming_both_fingerprints() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    run(&mut asm, vec![relation(16385, "sales", false)]).expect("first sight pins");
    let pinned = asm.pinned()["public.sales"];
    let err = run(&mut asm, vec![relation(16385, "sales", true)]).expect_err("drift");
    match &err {
        AssemblyError::SchemaDrift {
            relation,
            pinned: p,
            found,
        } => {
            assert_eq!(relation, "public.sales");
            assert_eq!(*p, pinned);
            assert_ne!(*found, pinned);
        }
        other => panic!("expected drift, got {other:?}"),
    }
    assert!(err.to_string().contains("public.sales"));

    // A pin given at start is enforced on first sight too.
    let mut cfg = config(dir.path());
    cfg.pinned.insert("public.sales".into(), 0x1234);
    let mut fresh = Assembler::new(cfg);
    assert!(matches!(
        run(&mut fresh, vec![relation(16385, "sales", false)]),
        Err(AssemblyError::SchemaDrift { pinned: 0x1234, .. })
    ));
}

/// A relation renamed inside a transaction is drift (its id is pinned
/// under its old name), not a fresh pin its rows could slip through under.
#[test]
fn a_renamed_relation_is_drift_naming_its_old_name() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let err = run(
        &mut asm,
        vec![
            relation(16385, "sales", false),
            begin(42, 0xA000),
            insert(None, "1"),
            relation(16385, "sales_renamed", true),
        ],
    )
    .expect_err("refused");
    assert!(
        matches!(&err, AssemblyError::SchemaDrift { relation, .. } if relation == "public.sales"),
        "{err}"
    );
}

/// Rows wider than the description they arrive under stop assembly.
#[test]
fn rows_that_do_not_fit_their_relation_stop_assembly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let err = run(
        &mut asm,
        vec![
            relation(16385, "sales", false),
            begin(42, 0xA000),
            Message::Insert(Insert {
                xid: None,
                relation: 16385,
                new: vec![t("2"), t("n"), t("x")],
            }),
        ],
    )
    .expect_err("refused");
    assert!(
        matches!(
            err,
            AssemblyError::TupleWidth {
                expected: 2,
                found: 3,
                ..
            }
        ),
        "{err}"
    );
}

fn added_column(relation_id: u32) -> envelope::DdlEvent {
    envelope::DdlEvent {
        kind: envelope::DdlKind::AddNullableColumn as i32,
        relation_id,
        command_tag: "ALTER TABLE".into(),
        statement: "ALTER TABLE public.sales ADD COLUMN extra text".into(),
        column: "extra".into(),
        type_name: "text".into(),
        type_modifier: -1,
        ..envelope::DdlEvent::default()
    }
}

/// Feeds `messages`; a drifted Relation message is accepted with `event`
/// instead of being handled, as capture does with a change it explained.
fn run_accepting(
    asm: &mut Assembler,
    messages: Vec<Message>,
) -> Result<Vec<Envelope>, AssemblyError> {
    let mut out = Vec::new();
    for m in messages {
        if let Message::Relation(rel) = &m
            && let Some(drift) = asm.drift(rel)
        {
            let id = drift.now.relation_id;
            asm.accept(drift, vec![(added_column(id), false)])?;
            continue;
        }
        out.extend(run(asm, vec![m])?);
    }
    Ok(out)
}

fn insert3(xid: Option<u32>, id: &str) -> Message {
    Message::Insert(Insert {
        xid,
        relation: 16385,
        new: vec![t(id), t("n"), t("x")],
    })
}

#[test]
fn an_accepted_change_precedes_the_rows_under_it_in_an_envelope_of_their_own() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let out = run_accepting(
        &mut asm,
        vec![
            relation(16385, "sales", false),
            begin(42, 0xA000),
            insert(None, "1"),
            relation(16385, "sales", true),
            insert3(None, "2"),
            commit(0xA000),
            begin(43, 0xB000),
            insert3(None, "3"),
            commit(0xB000),
        ],
    )
    .expect("assembles");
    // Two versions of one relation never share an envelope: the first
    // transaction is two chunks, the change leading the second.
    assert_eq!(out.len(), 3, "{out:?}");
    assert_eq!(out[0].relations[0].columns.len(), 2);
    assert_eq!(ids(&out[0]), ["1"]);
    assert_eq!(out[1].relations[0].columns.len(), 3);
    assert!(
        matches!(&out[1].changes[0].body, Some(change::Body::Ddl(d)) if d.column == "extra"),
        "{:?}",
        out[1].changes
    );
    assert_eq!(ids(&out[1]), ["2"]);
    assert_eq!(ids(&out[2]), ["3"]);
    let pinned = asm.pinned()["public.sales"];
    assert_eq!(pinned, out[1].relations[0].fingerprint, "re-pinned");
    assert_eq!(asm.schemas()["public.sales"].columns.len(), 3);
}

#[test]
fn a_change_in_an_aborted_subtransaction_goes_back_with_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let narrow = asm.pinned().get("public.sales").copied();
    assert_eq!(narrow, None);
    let with_xid = |m: Message, xid: u32| match m {
        Message::Relation(mut r) => {
            r.xid = Some(xid);
            Message::Relation(r)
        }
        other => other,
    };
    let out = run_accepting(
        &mut asm,
        vec![
            relation(16385, "sales", false),
            Message::StreamStart(StreamStart {
                xid: 900,
                first_segment: true,
            }),
            insert(Some(900), "top"),
            with_xid(relation(16385, "sales", true), 901),
            insert3(Some(901), "sub"),
            Message::StreamStop,
            // ROLLBACK TO the savepoint before the ALTER.
            Message::StreamAbort(StreamAbort {
                xid: 900,
                subxid: 901,
            }),
            Message::StreamStart(StreamStart {
                xid: 900,
                first_segment: false,
            }),
            // No fresh description: the rows are as wide as before.
            insert(Some(900), "after"),
            Message::StreamStop,
            Message::StreamCommit(StreamCommit {
                xid: 900,
                flags: 0,
                commit_lsn: 0x9000,
                end_lsn: 0x9028,
                commit_time: 6,
            }),
        ],
    )
    .expect("assembles");
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(ids(&out[0]), ["top", "after"]);
    assert!(
        out[0]
            .changes
            .iter()
            .all(|c| matches!(c.body, Some(change::Body::Row(_)))),
        "the rolled-back change is gone with its rows"
    );
    assert_eq!(
        asm.schemas()["public.sales"].columns.len(),
        2,
        "pin restored"
    );
    assert_eq!(
        asm.pinned()["public.sales"],
        out[0].relations[0].fingerprint
    );
}

#[test]
fn rows_without_relation_metadata_fail_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let err = run(&mut asm, vec![begin(1, 0x100), insert(None, "1")]).expect_err("fails closed");
    assert!(matches!(
        err,
        AssemblyError::UnknownRelation {
            operation: "Insert",
            relation_id: 16385
        }
    ));
    let err =
        run(&mut Assembler::new(config(dir.path())), vec![commit(0x100)]).expect_err("no begin");
    assert!(matches!(
        err,
        AssemblyError::OutsideTransaction { message: "Commit" }
    ));
}

#[test]
fn a_stream_without_its_first_segment_or_nested_blocks_fail_closed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut asm = Assembler::new(config(dir.path()));
    let err = run(
        &mut asm,
        vec![Message::StreamStart(StreamStart {
            xid: 77,
            first_segment: false,
        })],
    )
    .expect_err("a later segment of an unknown stream");
    assert!(matches!(err, AssemblyError::UnknownStream { xid: 77 }));
    let mut asm = Assembler::new(config(dir.path()));
    let err = run(
        &mut asm,
        vec![
            Message::StreamStart(StreamStart {
                xid: 1,
                first_segment: true,
            }),
            Message::StreamStart(StreamStart {
                xid: 2,
                first_segment: true,
            }),
        ],
    )
    .expect_err("stream blocks never nest");
    assert!(matches!(
        err,
        AssemblyError::NestedTransaction {
            message: "Stream Start",
            xid: 1
        }
    ));
}
