//! The Kafka transport, store and forward: capture keeps making the local
//! segment log durable and acknowledging the source after its fsync; the
//! [`Publisher`] forwards the log, in order, to one partition of a topic
//! (idempotent producer, `acks=all`) and moves its log cursor only after
//! every record up to it is acknowledged by the broker; consumers read the
//! topic through a [`Feed`] and commit their group's offset only after they
//! have applied what they read.
//!
//! ```text
//!  capture ─▶ log (fsync) ─▶ ack source
//!               └─ cursor publisher-<flow> ─▶ Publisher ─▶ topic/0 (acks=all)
//!                                                             └─▶ Feed (group offset) ─▶ applier
//! ```
//!
//! Invariants:
//! * **Publish, then move the cursor.** A crash between the broker's
//!   acknowledgement and the cursor commit (crash point
//!   `PublishedCursorNotMoved`) publishes the tail again: the topic holds
//!   duplicates, never a gap; the applier's checkpoint skips them.
//! * **One partition, log order.** Records keep the log's order, so the
//!   topic's order is the source's commit order.
//! * **Commit after apply.** A Feed's group offset moves only when its
//!   consumer says the records are applied.
//!
//! A [`Feed`] is also the applier's [`Records`]: the applier reads the topic
//! and the group offset moves only after its target commit.
//!
//! `trellara run` with `transport: kafka` publishes, then applies through a
//! Feed, each round (`flow.rs`).

use super::{RecordReader, Records, TransportError};
use crate::crash::{CrashHooks, CrashPoint, NoCrash};
use crate::log::storage::Storage;
use crate::log::{CursorPosition, Log};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use std::time::Duration;

/// How long a broker round trip may take before it is an error.
const TIMEOUT: Duration = Duration::from_secs(30);
/// Records sent before waiting for their acknowledgements.
const BATCH_RECORDS: usize = 1_000;
const BATCH_BYTES: usize = 8 << 20;
/// The largest record the producer and the topic accept (64 MiB).
const MAX_RECORD_BYTES: &str = "67108864";
/// The producer's queue (KiB): a batch and one largest record fit.
const PRODUCER_QUEUE_KBYTES: &str = "98304";
/// What the consumer fetches ahead of the applier (KiB), and per fetch.
const CONSUMER_QUEUE_KBYTES: &str = "32768";
const FETCH_BYTES: &str = "16777216";
/// The largest fetch response: one largest record and its framing.
const RECEIVE_BYTES: &str = "68157440";
/// [`MAX_RECORD_BYTES`] less room for the record's key and framing.
const RECORD_LIMIT: usize = (64 << 20) - (64 << 10);
/// Bytes one feed read holds at most (besides one record past it).
const READ_BYTES: usize = 32 << 20;
/// How long nothing may arrive before a read returns what it has.
const QUIET: Duration = Duration::from_millis(500);
const PARTITION: i32 = 0;

/// Where a flow's records go.
#[derive(Debug, Clone)]
pub struct KafkaTarget {
    pub brokers: String,
    pub topic: String,
}

impl KafkaTarget {
    fn error(&self, source: KafkaError) -> TransportError {
        TransportError::Kafka {
            brokers: self.brokers.clone(),
            topic: self.topic.clone(),
            source: Box::new(source),
        }
    }

    fn client(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("socket.timeout.ms", "30000");
        config
    }

    /// Creates the topic with one partition if it does not exist, and
    /// refuses one that exists with more.
    pub async fn ensure_topic(&self) -> Result<(), TransportError> {
        let admin: AdminClient<DefaultClientContext> =
            self.client().create().map_err(|e| self.error(e))?;
        // The broker's default replication factor (-1): acks=all means
        // what the cluster says. Brokers before Kafka 2.4 refuse -1; a lone
        // test broker may not have a default: then 1, said in the log.
        for replication in [-1, 1] {
            // Records as large as an envelope; kept until deleted on purpose
            // (never compacted: every chunk of a transaction shares its key).
            let topic = NewTopic::new(&self.topic, 1, TopicReplication::Fixed(replication))
                .set("max.message.bytes", MAX_RECORD_BYTES)
                .set("cleanup.policy", "delete");
            let results = admin
                .create_topics(
                    [&topic],
                    &AdminOptions::new().operation_timeout(Some(TIMEOUT)),
                )
                .await
                .map_err(|e| self.error(e))?;
            let mut refused = false;
            for result in results {
                match result {
                    Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                    Err((_, RDKafkaErrorCode::InvalidReplicationFactor)) if replication == -1 => {
                        refused = true;
                    }
                    Err((_, code)) => return Err(self.error(KafkaError::AdminOp(code))),
                }
            }
            if !refused {
                break;
            }
            tracing::warn!(topic = %self.topic, "the broker has no default replication factor; creating the topic with 1");
        }
        let probe: BaseConsumer = self.client().create().map_err(|e| self.error(e))?;
        let metadata = probe
            .fetch_metadata(Some(&self.topic), TIMEOUT)
            .map_err(|e| self.error(e))?;
        let partitions = metadata
            .topics()
            .iter()
            .find(|t| t.name() == self.topic)
            .map_or(0, |t| t.partitions().len());
        if partitions != 1 {
            return Err(TransportError::Partitions {
                topic: self.topic.clone(),
                partitions,
            });
        }
        Ok(())
    }
}

/// The log consumer name of a flow's publisher.
pub fn publisher_cursor(flow: &str) -> String {
    format!("publisher-{flow}")
}

/// What one publish pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PublishStats {
    pub records: u64,
    pub bytes: u64,
}

/// Where a publisher's records go: the broker, or the simulator's topic.
#[allow(async_fn_in_trait)] // one task; no Send bound needed
pub trait Producer {
    /// Sends `records` (commit LSN, payload) in order and returns once the
    /// broker acknowledged every one of them; an error means some may have
    /// landed (the publisher re-sends from its cursor: duplicates, no gap).
    async fn send_batch(&self, records: &[(u64, Vec<u8>)]) -> Result<(), TransportError>;
}

/// The real broker: idempotent, `acks=all`, partition 0.
pub struct KafkaProducer {
    target: KafkaTarget,
    producer: FutureProducer,
}

impl std::fmt::Debug for KafkaProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaProducer")
            .field("topic", &self.target.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaProducer {
    pub fn new(target: KafkaTarget) -> Result<Self, TransportError> {
        let producer = target
            .client()
            .set("enable.idempotence", "true")
            // A failed record must stop the producer, not let the records
            // queued behind it land first: a gap the applier would skip
            // for good once it arrived late (its checkpoint already past).
            .set("enable.gapless.guarantee", "true")
            .set("acks", "all")
            // Envelopes run to the capture's chunk size (4 MiB) and more.
            .set("message.max.bytes", MAX_RECORD_BYTES)
            // Bounded: one batch (BATCH_BYTES) or one largest record is
            // in flight at a time, so this only caps a runaway.
            .set("queue.buffering.max.kbytes", PRODUCER_QUEUE_KBYTES)
            .set("linger.ms", "1")
            .set("message.timeout.ms", "30000")
            .create()
            .map_err(|e| target.error(e))?;
        Ok(KafkaProducer { target, producer })
    }
}

impl Producer for KafkaProducer {
    async fn send_batch(&self, records: &[(u64, Vec<u8>)]) -> Result<(), TransportError> {
        let mut pending = Vec::with_capacity(records.len());
        for (commit_lsn, payload) in records {
            if payload.len() > RECORD_LIMIT {
                return Err(TransportError::TooLarge {
                    topic: self.target.topic.clone(),
                    commit_lsn: trellara_common::Lsn(*commit_lsn),
                    bytes: payload.len(),
                    limit: RECORD_LIMIT,
                });
            }
            let key = commit_lsn.to_be_bytes();
            let sent = FutureRecord::to(&self.target.topic)
                .partition(PARTITION)
                .key(&key)
                .payload(payload);
            let delivery = self
                .producer
                .send_result(sent)
                .map_err(|(e, _)| self.target.error(e))?;
            pending.push(delivery);
        }
        for delivery in pending {
            match delivery.await {
                Ok(Ok(_)) => {}
                Ok(Err((e, _))) => return Err(self.target.error(e)),
                Err(_) => return Err(self.target.error(KafkaError::Canceled)),
            }
        }
        Ok(())
    }
}

/// Forwards the log to the topic.
#[derive(Debug)]
pub struct Publisher<P: Producer = KafkaProducer> {
    producer: P,
    cursor: String,
    /// Records per batch sent before waiting for the broker.
    batch_records: usize,
}

impl Publisher<KafkaProducer> {
    pub fn new(target: KafkaTarget, flow: &str) -> Result<Self, TransportError> {
        Ok(Publisher::with_producer(KafkaProducer::new(target)?, flow))
    }
}

impl<P: Producer> Publisher<P> {
    pub fn with_producer(producer: P, flow: &str) -> Self {
        Publisher {
            producer,
            cursor: publisher_cursor(flow),
            batch_records: BATCH_RECORDS,
        }
    }

    /// Smaller batches (the simulator's, so runs span batches).
    pub fn with_batch_records(mut self, records: usize) -> Self {
        self.batch_records = records.max(1);
        self
    }

    /// Publishes every durable record past the cursor, then moves it.
    pub async fn publish<S: Storage>(&self, log: &Log<S>) -> Result<PublishStats, TransportError> {
        self.publish_with(log, &NoCrash).await
    }

    /// [`publish`](Self::publish), stopping at the crash points `hooks`
    /// names (the simulator's and tests'). The cursor moves only to the end
    /// of a whole transaction, so whatever is re-sent after a crash or a
    /// failed batch starts at a transaction's first record: the applier
    /// sees a cut chunk run followed by the run again, never a run that
    /// resumes in its middle.
    pub async fn publish_with<S: Storage>(
        &self,
        log: &Log<S>,
        hooks: &dyn CrashHooks,
    ) -> Result<PublishStats, TransportError> {
        let start = log.register_consumer(&self.cursor)?;
        let mut stats = PublishStats::default();
        let mut reader = log.read_from(start.next_offset)?;
        loop {
            let mut batch = Vec::with_capacity(self.batch_records);
            let mut bytes = 0usize;
            // The last record of this batch that ends a transaction.
            let mut complete = None;
            let mut held_back = false;
            while batch.len() < self.batch_records && bytes < BATCH_BYTES {
                let Some(record) = reader.next().transpose()? else {
                    break;
                };
                let boundary = boundary_of(&record.payload);
                // A transaction still being appended (its run not all in
                // the log yet) goes out once, whole, when it is complete,
                // not again and again as it grows.
                if let Some((0, count)) = boundary
                    && count > 1
                    && record.offset + u64::from(count) > log.next_offset()
                {
                    held_back = true;
                    break;
                }
                bytes += record.payload.len();
                #[cfg(test)]
                let ends = ends_transaction(boundary)
                    || mutation::CURSOR_MID_RUN.with(std::cell::Cell::get);
                #[cfg(not(test))]
                let ends = ends_transaction(boundary);
                if ends {
                    complete = Some((record.offset, record.commit_lsn));
                }
                batch.push((record.commit_lsn, record.payload));
            }
            if batch.is_empty() {
                return Ok(stats);
            }
            stats.records += batch.len() as u64;
            stats.bytes += batch.iter().map(|(_, p)| p.len() as u64).sum::<u64>();
            self.producer.send_batch(&batch).await?;
            if hooks.crash_at(CrashPoint::PublishedCursorNotMoved) {
                return Err(TransportError::Crashed(CrashPoint::PublishedCursorNotMoved));
            }
            if let Some((offset, commit_lsn)) = complete {
                log.commit_cursor(&self.cursor, CursorPosition::after(offset, commit_lsn))?;
            }
            if held_back {
                return Ok(stats);
            }
        }
    }
}

/// Test-only switches that break one rule each, for the simulator's
/// mutation checks.
#[cfg(test)]
pub(crate) mod mutation {
    use std::cell::Cell;
    thread_local! {
        /// Move the publisher's cursor in the middle of a chunk run.
        pub(crate) static CURSOR_MID_RUN: Cell<bool> = const { Cell::new(false) };
    }
}

/// A log record's (chunk index, chunk count); None for a whole envelope or
/// one that does not decode (the applier quarantines it).
fn boundary_of(payload: &[u8]) -> Option<(u32, u32)> {
    trellara_common::envelope::decode(payload)
        .ok()
        .and_then(|e| e.boundary)
        .map(|b| (b.chunk_index, b.chunk_count.max(1)))
}

/// Whether a record with `boundary` is the last (or only) of its
/// transaction.
fn ends_transaction(boundary: Option<(u32, u32)>) -> bool {
    boundary.is_none_or(|(index, count)| index + 1 >= count)
}

/// One record read from the topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicRecord {
    /// The topic offset (the Feed's position after it is applied: +1).
    pub offset: i64,
    pub commit_lsn: u64,
    pub payload: Vec<u8>,
}

/// Reads the topic from a consumer group's committed offset.
pub struct Feed {
    target: KafkaTarget,
    consumer: BaseConsumer,
}

impl std::fmt::Debug for Feed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feed")
            .field("topic", &self.target.topic)
            .finish_non_exhaustive()
    }
}

impl Feed {
    /// A consumer in `group`, positioned at the group's committed offset
    /// (the topic's start when the group has none).
    pub fn new(target: KafkaTarget, group: &str) -> Result<Self, TransportError> {
        let consumer: BaseConsumer = target
            .client()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            // A committed offset the topic no longer holds (retention ran
            // past it) is an error, never a silent skip to what is left.
            .set("auto.offset.reset", "error")
            .set("session.timeout.ms", "6000")
            // Fetches return at once when the partition is drained, so a
            // read's quiet period measures the broker, not a fetch wait.
            .set("fetch.wait.max.ms", "10")
            // Bounded read-ahead: librdkafka's defaults prefetch up to
            // 64 MiB of the partition, 50 MB per fetch. Half of that reads
            // a large transaction as fast (bench/memory); a record larger
            // than a fetch still comes, alone, up to the largest record.
            .set("queued.max.messages.kbytes", CONSUMER_QUEUE_KBYTES)
            .set("fetch.max.bytes", FETCH_BYTES)
            .set("max.partition.fetch.bytes", FETCH_BYTES)
            .set("receive.message.max.bytes", RECEIVE_BYTES)
            .create()
            .map_err(|e| target.error(e))?;
        let feed = Feed { target, consumer };
        let start = feed.committed()?;
        feed.seek_to(start)?;
        Ok(feed)
    }

    /// The group's committed offset: the next record to read.
    pub fn committed(&self) -> Result<i64, TransportError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&self.target.topic, PARTITION);
        let committed = self
            .consumer
            .committed_offsets(tpl, TIMEOUT)
            .map_err(|e| self.target.error(e))?;
        Ok(committed
            .find_partition(&self.target.topic, PARTITION)
            .and_then(|p| match p.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            })
            .unwrap_or(0))
    }

    /// Reads from `offset` next.
    pub fn seek_to(&self, offset: i64) -> Result<(), TransportError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.target.topic, PARTITION, Offset::Offset(offset))
            .map_err(|e| self.target.error(e))?;
        self.consumer.assign(&tpl).map_err(|e| self.target.error(e))
    }

    /// Up to `max` records from the current position: everything there is,
    /// read until nothing more arrived for [`QUIET`]. (The partition's end
    /// event cannot decide it: it can be a fetch old, it comes once per
    /// reaching the end, and some brokers' high watermarks are not to be
    /// trusted.) Fewer, possibly none, when that is all there is.
    pub fn read(&self, max: usize) -> Result<Vec<TopicRecord>, TransportError> {
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut last = std::time::Instant::now();
        while out.len() < max && bytes < READ_BYTES && last.elapsed() < QUIET {
            let Some(polled) = self.consumer.poll(Duration::from_millis(20)) else {
                continue;
            };
            match polled {
                Ok(message) => {
                    last = std::time::Instant::now();
                    // A record not of ours would be taken for commit 0, a
                    // duplicate: refused instead.
                    let key: [u8; 8] = match message.key() {
                        Some(k) => k.try_into().map_err(|_| TransportError::BadKey {
                            topic: self.target.topic.clone(),
                            offset: message.offset(),
                            found: format!("{} bytes", k.len()),
                        })?,
                        None => {
                            return Err(TransportError::BadKey {
                                topic: self.target.topic.clone(),
                                offset: message.offset(),
                                found: "missing".into(),
                            });
                        }
                    };
                    bytes += message.payload().map_or(0, <[u8]>::len);
                    out.push(TopicRecord {
                        offset: message.offset(),
                        commit_lsn: u64::from_be_bytes(key),
                        payload: message.payload().unwrap_or_default().to_vec(),
                    });
                }
                Err(KafkaError::PartitionEOF(_)) => {}
                Err(e) => return Err(self.target.error(e)),
            }
        }
        Ok(out)
    }

    /// Commits the group's offset: everything before `next` is applied.
    pub fn commit(&self, next: i64) -> Result<(), TransportError> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.target.topic, PARTITION, Offset::Offset(next))
            .map_err(|e| self.target.error(e))?;
        self.consumer
            .commit(&tpl, CommitMode::Sync)
            .map_err(|e| self.target.error(e))
    }
}

/// The applier's reader over a feed: records in topic order, refilled from
/// the broker until it reports nothing more.
#[derive(Debug)]
pub struct FeedReader<'a> {
    feed: &'a Feed,
    buffer: std::collections::VecDeque<TopicRecord>,
    next: u64,
    done: bool,
}

impl RecordReader for FeedReader<'_> {
    fn next_record(&mut self) -> Result<Option<crate::log::Record>, TransportError> {
        if self.buffer.is_empty() && !self.done {
            let read = self.feed.read(BATCH_RECORDS)?;
            self.done = read.is_empty();
            self.buffer.extend(read);
        }
        Ok(self.buffer.pop_front().map(|r| {
            let offset = u64::try_from(r.offset).unwrap_or(0);
            self.next = offset + 1;
            crate::log::Record {
                offset,
                commit_lsn: r.commit_lsn,
                payload: r.payload,
            }
        }))
    }

    fn next_offset(&self) -> u64 {
        self.next
    }
}

impl Records for Feed {
    type Reader<'a> = FeedReader<'a>;

    /// The group's committed offset (the consumer name is the group's).
    fn start(&self, _consumer: &str) -> Result<u64, TransportError> {
        Ok(u64::try_from(self.committed()?).unwrap_or(0))
    }

    fn read_from(&self, offset: u64) -> Result<FeedReader<'_>, TransportError> {
        self.seek_to(i64::try_from(offset).unwrap_or(i64::MAX))?;
        Ok(FeedReader {
            feed: self,
            buffer: std::collections::VecDeque::new(),
            next: offset,
            done: false,
        })
    }

    fn applied(
        &self,
        _consumer: &str,
        offset: u64,
        _commit_lsn: u64,
    ) -> Result<(), TransportError> {
        self.commit(i64::try_from(offset).unwrap_or(i64::MAX) + 1)
    }
}
