//! The Kafka transport against a real broker (`tansu`, memory storage, from
//! scripts/setup): the publisher forwards the log in order and moves its
//! cursor only after the broker acknowledged; a crash in between publishes
//! the tail again (duplicates, never a gap); a feed resumes from its group's
//! committed offset.

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use trellara_common::{envelope, sample};
use trellara_relay::crash::{CrashHooks, CrashPoint};
use trellara_relay::log::{Log, LogConfig, storage::FsStorage};
use trellara_relay::transport::TransportError;
use trellara_relay::transport::kafka::{Feed, KafkaTarget, Publisher, publisher_cursor};
use trellara_tests::Broker;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Appends `n` transactions committing from `first` (0x100 apart).
fn append(log: &Log<FsStorage>, first: u64, n: u64) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let mut env = sample::insert_transaction(1 + (i % 3) as usize, 20);
            let lsn = first + i * 0x100;
            env.begin_lsn = lsn - 0x10;
            env.commit_lsn = lsn;
            env.end_lsn = lsn + 0x10;
            let bytes = envelope::encode(&env).expect("valid");
            log.append(lsn, &bytes).expect("append");
            bytes
        })
        .collect()
}

#[derive(Debug)]
struct CrashAfterPublish;

impl CrashHooks for CrashAfterPublish {
    fn crash_at(&self, point: CrashPoint) -> bool {
        point == CrashPoint::PublishedCursorNotMoved
    }
}

#[test]
fn publisher_forwards_the_log_in_order_and_feeds_resume_from_their_offset() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let rt = runtime();
    let target = KafkaTarget {
        brokers: broker.bootstrap(),
        topic: "trellara-shop".into(),
    };
    rt.block_on(target.ensure_topic()).expect("topic");
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("log");
    let sent = append(&log, 0x1000_0000, 50);
    let publisher = Publisher::new(target.clone(), "shop").expect("publisher");
    let stats = rt.block_on(publisher.publish(&log)).expect("publish");
    assert_eq!(stats.records, 50);
    assert_eq!(
        log.cursor(&publisher_cursor("shop")).map(|c| c.next_offset),
        Some(50),
        "the cursor moved past every acknowledged record"
    );
    assert_eq!(
        rt.block_on(publisher.publish(&log)).expect("again").records,
        0,
        "nothing is published twice without a crash"
    );

    // In log order, whole, with the commit LSN in the key.
    let feed = Feed::new(target.clone(), "applier-shop").expect("feed");
    let read = feed.read(1_000).expect("read");
    assert_eq!(read.len(), 50);
    for (i, (record, payload)) in read.iter().zip(&sent).enumerate() {
        assert_eq!(record.offset, i as i64);
        assert_eq!(record.commit_lsn, 0x1000_0000 + i as u64 * 0x100);
        assert_eq!(&record.payload, payload);
    }
    // A new consumer of the group resumes where the group committed.
    feed.commit(20).expect("commit");
    drop(feed);
    let feed = Feed::new(target.clone(), "applier-shop").expect("feed again");
    assert_eq!(feed.committed().expect("committed"), 20);
    let rest = feed.read(1_000).expect("read rest");
    assert_eq!(rest.first().map(|r| r.offset), Some(20));
    assert_eq!(rest.len(), 30);

    // Acknowledged by the broker, then the process dies before the cursor
    // moved: the tail goes out again. Duplicates, never a gap.
    let more = append(&log, 0x2000_0000, 10);
    let crashed = rt.block_on(publisher.publish_with(&log, &CrashAfterPublish));
    assert!(
        matches!(
            crashed,
            Err(TransportError::Crashed(CrashPoint::PublishedCursorNotMoved))
        ),
        "{crashed:?}"
    );
    assert_eq!(
        log.cursor(&publisher_cursor("shop")).map(|c| c.next_offset),
        Some(50)
    );
    let restarted = Publisher::new(target.clone(), "shop").expect("restart");
    assert_eq!(
        rt.block_on(restarted.publish(&log))
            .expect("replay")
            .records,
        10
    );
    let tail = feed.read(1_000).expect("tail");
    let lsns: Vec<u64> = tail.iter().map(|r| r.commit_lsn).collect();
    let expected: Vec<u64> = (0..10).map(|i| 0x2000_0000 + i * 0x100).collect();
    assert_eq!(tail.len(), 20, "the 10 records, then the same 10 again");
    assert_eq!(lsns[..10], expected[..]);
    assert_eq!(lsns[10..], expected[..]);
    assert_eq!(tail[0].payload, more[0]);
}

#[test]
fn a_topic_with_several_partitions_is_refused() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let rt = runtime();
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .expect("admin");
    let topic = NewTopic::new("wide", 3, TopicReplication::Fixed(1));
    rt.block_on(admin.create_topics([&topic], &AdminOptions::new()))
        .expect("create");
    let target = KafkaTarget {
        brokers: broker.bootstrap(),
        topic: "wide".into(),
    };
    let err = rt.block_on(target.ensure_topic()).expect_err("refused");
    assert!(
        matches!(err, TransportError::Partitions { partitions: 3, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("exactly 1"), "{err}");
}

/// A one-row insert into public.sales (id `id`) committing at `commit`.
fn sale(log: &Log<FsStorage>, commit: u64, id: i64) {
    let mut env = sample::chunk(commit, 0, 1);
    if let Some(envelope::change::Body::Row(row)) = env.changes[0].body.as_mut() {
        row.after[0] = sample::text(id.to_string());
    }
    let bytes = envelope::encode(&env).expect("valid");
    log.append(commit, &bytes).expect("append");
}

#[test]
fn the_applier_reads_the_topic_and_moves_the_group_offset_after_the_target() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let Some(target) = trellara_tests::test_cluster(
        trellara_tests::Major::Pg17,
        &trellara_tests::ClusterOptions::new(),
    ) else {
        return;
    };
    target.psql("CREATE TABLE public.sales (id bigint PRIMARY KEY, amount numeric, note text)");
    let rt = runtime();
    let topic = KafkaTarget {
        brokers: broker.bootstrap(),
        topic: "trellara-k".into(),
    };
    rt.block_on(topic.ensure_topic()).expect("topic");
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("log");
    for id in 1..=30 {
        sale(&log, 0x3000_0000 + id as u64 * 0x100, id);
    }
    let publisher = Publisher::new(topic.clone(), "k").expect("publisher");
    rt.block_on(publisher.publish(&log)).expect("publish");

    let url = target.connection_string("postgres");
    let mut applier = rt.block_on(async {
        let client = trellara_relay::flow::connect(&url, "target")
            .await
            .expect("connect");
        trellara_relay::state::ensure(&client).await.expect("state");
        trellara_relay::apply::Applier::new(client, "k", "orders-primary", "trellara.yml")
    });
    let feed = Feed::new(topic.clone(), "applier-k").expect("feed");
    let hooks = trellara_relay::crash::NoCrash;
    let stats = rt
        .block_on(applier.apply_log_with(&feed, &hooks))
        .expect("apply");
    assert_eq!(stats.transactions, 30);
    assert_eq!(target.psql_value("SELECT count(*) FROM public.sales"), "30");
    assert_eq!(
        feed.committed().expect("committed"),
        30,
        "offset after apply"
    );
    assert_eq!(
        target.psql_value("SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = 'k'"),
        "0/30001E00"
    );

    // A crash after the broker acknowledged, before the publisher's cursor
    // moved: the topic holds the tail twice; the checkpoint skips the copy.
    for id in 31..=35 {
        sale(&log, 0x3000_0000 + id as u64 * 0x100, id);
    }
    assert!(
        rt.block_on(publisher.publish_with(&log, &CrashAfterPublish))
            .is_err()
    );
    rt.block_on(publisher.publish(&log)).expect("republish");
    let stats = rt
        .block_on(applier.apply_log_with(&feed, &hooks))
        .expect("apply the tail");
    assert_eq!((stats.transactions, stats.duplicates_skipped), (5, 5));
    assert_eq!(target.psql_value("SELECT count(*) FROM public.sales"), "35");
    assert_eq!(feed.committed().expect("committed"), 40);
}

/// A transaction still being appended (its chunk run incomplete at the
/// log's end) goes out once, whole, when it is complete.
#[test]
fn an_incomplete_chunk_run_is_published_once_complete() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let rt = runtime();
    let topic = KafkaTarget {
        brokers: broker.bootstrap(),
        topic: "trellara-runs".into(),
    };
    rt.block_on(topic.ensure_topic()).expect("topic");
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("log");
    let chunk = |index| envelope::encode(&sample::chunk(0x4000_0000, index, 2)).expect("valid");
    log.append(0x4000_0000, &chunk(0)).expect("append");
    let publisher = Publisher::new(topic.clone(), "runs").expect("publisher");
    let first = rt.block_on(publisher.publish(&log)).expect("publish");
    assert_eq!(first.records, 0, "half a transaction is not published");
    log.append(0x4000_0000, &chunk(1)).expect("append");
    let second = rt.block_on(publisher.publish(&log)).expect("publish");
    assert_eq!(second.records, 2, "the whole run, once");
    let feed = Feed::new(topic, "g").expect("feed");
    assert_eq!(feed.read(100).expect("read").len(), 2);
}

/// An envelope far over Kafka's 1 MB default goes through whole.
#[test]
fn records_larger_than_a_megabyte_go_through() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let rt = runtime();
    let topic = KafkaTarget {
        brokers: broker.bootstrap(),
        topic: "trellara-big".into(),
    };
    rt.block_on(topic.ensure_topic()).expect("topic");
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("log");
    let mut env = sample::insert_transaction(1, 3 << 20);
    env.begin_lsn = 0x5000_0000 - 0x10;
    env.commit_lsn = 0x5000_0000;
    env.end_lsn = 0x5000_0010;
    let bytes = envelope::encode(&env).expect("valid");
    assert!(bytes.len() > 3 << 20);
    log.append(0x5000_0000, &bytes).expect("append");
    let publisher = Publisher::new(topic.clone(), "big").expect("publisher");
    assert_eq!(
        rt.block_on(publisher.publish(&log))
            .expect("publish")
            .records,
        1
    );
    let read = Feed::new(topic, "g").expect("feed").read(10).expect("read");
    assert_eq!(read.len(), 1);
    assert_eq!(read[0].payload, bytes);
}

#[test]
fn a_record_over_the_limit_is_refused_and_the_cursor_stays() {
    let Some(broker) = Broker::start() else {
        return;
    };
    let rt = runtime();
    let topic = KafkaTarget {
        brokers: broker.bootstrap(),
        topic: "trellara-huge".into(),
    };
    rt.block_on(topic.ensure_topic()).expect("topic");
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("log");
    let mut env = sample::insert_transaction(1, 65 << 20);
    env.begin_lsn = 0x6000_0000 - 0x10;
    env.commit_lsn = 0x6000_0000;
    env.end_lsn = 0x6000_0010;
    log.append(0x6000_0000, &envelope::encode(&env).expect("valid"))
        .expect("append");
    let publisher = Publisher::new(topic, "huge").expect("publisher");
    let err = rt
        .block_on(publisher.publish(&log))
        .expect_err("over the limit");
    assert!(
        matches!(err, TransportError::TooLarge { .. }) && err.to_string().contains("0/60000000"),
        "{err}"
    );
    assert_eq!(
        log.cursor(&publisher_cursor("huge"))
            .map_or(0, |c| c.next_offset),
        0,
        "the cursor did not move past the record"
    );
}

#[test]
fn a_record_without_trellaras_key_is_refused_not_skipped() {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};
    let Some(broker) = Broker::start() else {
        return;
    };
    let topic = KafkaTarget {
        brokers: broker.bootstrap(),
        topic: "trellara-shared".into(),
    };
    runtime().block_on(topic.ensure_topic()).expect("topic");
    // Another producer writes to the flow's topic.
    let other: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .create()
        .expect("producer");
    other
        .send(BaseRecord::<(), [u8]>::to("trellara-shared").payload(&b"not an envelope"[..]))
        .map_err(|(e, _)| e)
        .expect("send");
    other
        .flush(std::time::Duration::from_secs(10))
        .expect("flush");
    let err = Feed::new(topic, "g")
        .expect("feed")
        .read(10)
        .expect_err("a record without the commit LSN key");
    assert!(
        matches!(err, TransportError::BadKey { offset: 0, .. })
            && err.to_string().contains("missing"),
        "{err}"
    );
}
