//! Transport: how committed transactions travel from the durable log to the
//! sinks. A sink reads through [`Records`] with its own cursor: the local
//! segment log itself (cursor `applier-<flow>` in the log), or a Kafka topic
//! ([`kafka`]: the log is forwarded by a publisher, each sink reads through a
//! consumer group). Either way a record's position moves only after the sink
//! says it is applied, and a record is committed only once it is durable.
//!
//! ```text
//!  capture ─▶ log ─┬─ local: Records for Log ───────────────▶ sink
//!                  └─ kafka: Publisher ─▶ topic ─▶ Feed ─────▶ sink
//! ```

pub mod kafka;

use crate::crash::CrashPoint;
use crate::log::storage::Storage;
use crate::log::{CursorPosition, Log};
use rdkafka::error::KafkaError;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error(
        "kafka ({brokers}, topic {topic})\nhint: check transport.brokers and that the broker is up"
    )]
    Kafka {
        brokers: String,
        topic: String,
        #[source]
        source: Box<KafkaError>,
    },
    #[error(transparent)]
    Log(#[from] crate::log::Error),
    #[error(
        "topic {topic}: the record of commit {commit_lsn} is {bytes} bytes, over the {limit}-byte record limit\nhint: use the local transport for this flow, or lower the value sizes; the record stays in the log"
    )]
    TooLarge {
        topic: String,
        commit_lsn: trellara_common::Lsn,
        bytes: usize,
        limit: usize,
    },
    #[error(
        "topic {topic}, offset {offset}: the record's key is {found}, not the 8-byte commit LSN Trellara writes (another producer writes to this topic?)\nhint: give the flow a topic of its own (transport.topic), then reseed"
    )]
    BadKey {
        topic: String,
        offset: i64,
        found: String,
    },
    #[error(
        "topic {topic} has {partitions} partitions; strict order needs exactly 1\nhint: create it with one partition, or name another topic"
    )]
    Partitions { topic: String, partitions: usize },
    /// Only the simulator's crash hooks produce this.
    #[error("simulated crash at {0:?}")]
    Crashed(CrashPoint),
    #[error(
        "flow {flow}: the topic did not deliver everything published within 60 s\nhint: check the broker, then rerun"
    )]
    Undelivered { flow: String },
    /// A simulated broker failed (simulator only).
    #[error("simulated failure: {0}")]
    Simulated(String),
}

/// Where the applier reads committed transactions from: the local log (the
/// cursor `applier-<flow>`), or a Kafka feed (its consumer group's offset).
/// Offsets are the source's own; `applied` is called only after the target
/// committed everything up to the offset. A source may hand out records
/// before they are durable (the local log does, so the target works while
/// the fsync runs); the applier commits them only after `durable`.
#[allow(async_fn_in_trait)] // used on one task; no Send bound needed
pub trait Records {
    type Reader<'a>: RecordReader
    where
        Self: 'a;
    /// The offset of the next record to apply for `consumer`.
    fn start(&self, consumer: &str) -> Result<u64, TransportError>;
    /// The offset of the next record for `consumer`, whose cursor must
    /// exist already.
    fn resume(&self, consumer: &str) -> Result<u64, TransportError> {
        self.start(consumer)
    }
    fn read_from(&self, offset: u64) -> Result<Self::Reader<'_>, TransportError>;
    /// Everything up to and including `offset` (of commit `commit_lsn`) is
    /// applied.
    fn applied(&self, consumer: &str, offset: u64, commit_lsn: u64) -> Result<(), TransportError>;
    /// Returns once every record up to and including `offset` is durable.
    async fn durable(&self, offset: u64) -> Result<(), TransportError> {
        let _ = offset;
        Ok(())
    }
    /// Waits up to `patience` for records past `offset` (the rest of a
    /// chunk run still being appended); false when none came. A source
    /// that cannot wait says false at once, and the run is read again
    /// whole next time.
    async fn wait_for_more(&self, offset: u64, patience: Duration) -> bool {
        let _ = (offset, patience);
        false
    }
    /// Whether the applier may read its next batch while the current one
    /// commits: only where a read never blocks. A topic's read waits for
    /// its broker (up to 500 ms of quiet), and the commit in flight beside
    /// it would wait as long, its rows locked.
    fn reads_ahead(&self) -> bool {
        false
    }
}

/// How often a log followed from another process is looked at for what
/// its writer made durable where no inotify watch can be had (with one,
/// the follower wakes as the writer rewrites its watermark file).
pub const FOLLOW_POLL: Duration = Duration::from_millis(1);

/// Records in order from one position.
pub trait RecordReader {
    /// The next record; None at the end of what is there now.
    fn next_record(&mut self) -> Result<Option<crate::log::Record>, TransportError>;
    /// The offset of the record `next_record` returns next.
    fn next_offset(&self) -> u64;
}

impl<S: Storage> Records for Log<S> {
    type Reader<'a> = crate::log::Reader<S>;

    fn start(&self, consumer: &str) -> Result<u64, TransportError> {
        Ok(self.register_consumer(consumer)?.next_offset)
    }

    fn resume(&self, consumer: &str) -> Result<u64, TransportError> {
        Ok(self
            .cursor(consumer)
            .ok_or_else(|| crate::log::Error::UnknownConsumer {
                consumer: consumer.to_owned(),
            })?
            .next_offset)
    }

    /// Records as soon as they are written: the applier sends their rows
    /// while capture's fsync runs, and commits after [`Records::durable`].
    fn read_from(&self, offset: u64) -> Result<Self::Reader<'_>, TransportError> {
        Ok(Log::read_written_from(self, offset)?)
    }

    fn applied(&self, consumer: &str, offset: u64, commit_lsn: u64) -> Result<(), TransportError> {
        Ok(self.commit_cursor(consumer, CursorPosition::after(offset, commit_lsn))?)
    }

    async fn durable(&self, offset: u64) -> Result<(), TransportError> {
        #[cfg(test)]
        if mutation::COMMIT_BEFORE_DURABLE.with(std::cell::Cell::get) {
            return Ok(());
        }
        Ok(self.sync_through(offset + 1).await?)
    }

    async fn wait_for_more(&self, offset: u64, patience: Duration) -> bool {
        if self.is_follower() {
            return self
                .follow_past(offset, patience, FOLLOW_POLL)
                .await
                .unwrap_or(false);
        }
        let mut moved = self.subscribe();
        let more = async {
            while self.written_end() <= offset {
                if moved.changed().await.is_err() {
                    return false;
                }
            }
            true
        };
        tokio::time::timeout(patience, more).await.unwrap_or(false)
    }

    /// Its reads are of files already written: they never wait.
    fn reads_ahead(&self) -> bool {
        true
    }
}

impl<S: Storage> RecordReader for crate::log::Reader<S> {
    fn next_record(&mut self) -> Result<Option<crate::log::Record>, TransportError> {
        Ok(self.next().transpose()?)
    }

    fn next_offset(&self) -> u64 {
        crate::log::Reader::next_offset(self)
    }
}

/// Test-only switches that break one ordering rule each, for the
/// simulator's mutation checks (the matrix must be able to fail).
#[cfg(test)]
pub(crate) mod mutation {
    use std::cell::Cell;
    thread_local! {
        /// Commit records read early without waiting until they are durable.
        pub(crate) static COMMIT_BEFORE_DURABLE: Cell<bool> = const { Cell::new(false) };
    }
}
