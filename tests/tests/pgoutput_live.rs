//! The pgoutput decoder against real servers: every message kind a v2
//! session with streaming produces, read through
//! `pg_logical_slot_get_binary_changes` on each major, decodes to what the
//! SQL did - including unchanged TOAST kept distinct from NULL, key-changing
//! updates with the old key, and a large transaction streamed in blocks.

use bytes::Bytes;
use trellara_external_relay::pgoutput::{
    Column, DecodeContext, Message, OldKind, ProtoVersion, decode,
};
use trellara_tests::{Cluster, ClusterOptions, Major, test_cluster};

#[test]
fn pgoutput_v2_pg15() {
    live(Major::Pg15);
}

#[test]
fn pgoutput_v2_pg16() {
    live(Major::Pg16);
}

#[test]
fn pgoutput_v2_pg17() {
    live(Major::Pg17);
}

#[test]
fn pgoutput_v2_pg18() {
    live(Major::Pg18);
}

/// Reads the slot and decodes every message, tracking stream blocks.
fn read_slot(cluster: &Cluster) -> Vec<Message> {
    let mut client = cluster.connect();
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, \
             'proto_version', '2', 'publication_names', 'p', 'messages', 'true', 'streaming', 'on')",
            &[],
        )
        .unwrap_or_else(|err| panic!("reading the slot failed: {err:?}\n{}", cluster.log_contents()));
    let mut in_stream_block = false;
    rows.iter()
        .map(|row| {
            let data: Vec<u8> = row.get(0);
            let ctx = DecodeContext {
                version: ProtoVersion::V2,
                in_stream_block,
            };
            let message = decode(&Bytes::from(data), ctx).expect("real pgoutput bytes decode");
            match message {
                Message::StreamStart(_) => in_stream_block = true,
                Message::StreamStop => in_stream_block = false,
                _ => {}
            }
            message
        })
        .collect()
}

fn text(s: &str) -> Column {
    Column::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn live(major: Major) {
    let options = ClusterOptions::new().setting("logical_decoding_work_mem", "64kB");
    let Some(cluster) = test_cluster(major, &options) else {
        return;
    };
    cluster.psql(
        "CREATE TABLE sales (id bigint PRIMARY KEY, amount numeric, note text);
         ALTER TABLE sales ALTER COLUMN note SET STORAGE EXTERNAL;
         CREATE TABLE audit (id int);
         CREATE PUBLICATION p FOR TABLE sales, audit;",
    );
    cluster.psql("SELECT pg_create_logical_replication_slot('s', 'pgoutput')");
    let big = "t".repeat(10_000);
    cluster.psql(&format!(
        "BEGIN;
         INSERT INTO sales VALUES (1, 9.99, '{big}');
         UPDATE sales SET amount = 10.00 WHERE id = 1;
         UPDATE sales SET id = 2 WHERE id = 1;
         SELECT pg_logical_emit_message(true, 'app', 'hello');
         DELETE FROM sales WHERE id = 2;
         COMMIT;
         TRUNCATE sales, audit RESTART IDENTITY;"
    ));
    let messages = read_slot(&cluster);
    let kinds: String = messages
        .iter()
        .map(|m| match m {
            Message::Begin(_) => 'B',
            Message::Commit(_) => 'C',
            Message::Relation(_) => 'R',
            Message::Insert(_) => 'I',
            Message::Update(_) => 'U',
            Message::Delete(_) => 'D',
            Message::Truncate(_) => 'T',
            Message::Message(_) => 'M',
            other => panic!("{major}: unexpected {other:?}"),
        })
        .collect();
    assert_eq!(kinds, "BRIUUMDCBRRTC", "{major}: message sequence");

    let Message::Begin(begin) = &messages[0] else {
        unreachable!()
    };
    let Message::Commit(commit) = &messages[7] else {
        unreachable!()
    };
    assert_eq!(
        begin.final_lsn, commit.commit_lsn,
        "{major}: Begin carries the commit LSN"
    );
    assert!(commit.end_lsn > commit.commit_lsn);

    let Message::Relation(rel) = &messages[1] else {
        unreachable!()
    };
    assert_eq!(
        (
            rel.namespace.as_str(),
            rel.name.as_str(),
            rel.replica_identity
        ),
        ("public", "sales", b'd')
    );
    let keys: Vec<bool> = rel.columns.iter().map(|c| c.key).collect();
    assert_eq!(keys, [true, false, false]);

    let Message::Insert(insert) = &messages[2] else {
        unreachable!()
    };
    assert_eq!(insert.new[..2], [text("1"), text("9.99")]);
    assert_eq!(insert.new[2], text(&big));

    // Only amount changed: the out-of-line note is unchanged TOAST, not NULL.
    let Message::Update(update) = &messages[3] else {
        unreachable!()
    };
    assert_eq!(update.old, None);
    assert_eq!(
        update.new,
        [text("1"), text("10.00"), Column::UnchangedToast]
    );

    // The key changed: the old key comes along so the target row can be found.
    let Message::Update(rekey) = &messages[4] else {
        unreachable!()
    };
    assert_eq!(
        rekey.old,
        Some((OldKind::Key, vec![text("1"), Column::Null, Column::Null]))
    );
    assert_eq!(rekey.new[0], text("2"));

    let Message::Message(msg) = &messages[5] else {
        unreachable!()
    };
    assert!(msg.transactional);
    assert_eq!(
        (msg.prefix.as_str(), &msg.content[..]),
        ("app", &b"hello"[..])
    );

    let Message::Delete(delete) = &messages[6] else {
        unreachable!()
    };
    assert_eq!(delete.old_kind, OldKind::Key);
    assert_eq!(delete.old[0], text("2"));

    let Message::Truncate(truncate) = &messages[11] else {
        unreachable!()
    };
    assert!(truncate.restart_identity && !truncate.cascade);
    assert_eq!(truncate.relations.len(), 2);

    // Past logical_decoding_work_mem the transaction is streamed in blocks
    // before it commits; every change carries its xid.
    cluster.psql("INSERT INTO sales SELECT g, g, repeat('x', 200) FROM generate_series(1, 5000) g");
    let streamed = read_slot(&cluster);
    let starts = streamed
        .iter()
        .filter(|m| matches!(m, Message::StreamStart(_)))
        .count();
    let stops = streamed
        .iter()
        .filter(|m| matches!(m, Message::StreamStop))
        .count();
    let inserts: Vec<_> = streamed
        .iter()
        .filter_map(|m| match m {
            Message::Insert(i) => Some(i),
            _ => None,
        })
        .collect();
    assert!(
        starts >= 1,
        "{major}: expected the large transaction to stream"
    );
    assert_eq!(starts, stops);
    assert_eq!(inserts.len(), 5000);
    assert!(
        inserts.iter().all(|i| i.xid.is_some()),
        "{major}: streamed changes carry their xid"
    );
    let Some(Message::StreamCommit(sc)) = streamed.last() else {
        panic!(
            "{major}: streamed transaction ends with Stream Commit: {:?}",
            streamed.last()
        );
    };
    assert_eq!(Some(sc.xid), inserts[0].xid);
}
