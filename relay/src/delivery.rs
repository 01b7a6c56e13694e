//! The apply stage of a run: how the applier gets the log's transactions
//! (the [`Delivery`]: the log itself, or a Kafka topic the log is forwarded
//! to) and the loop that applies them while capture writes, until capture
//! has ended and everything it wrote is applied.
//!
//! Invariants:
//! * The applier never commits what is not durable in the log (local), or
//!   not published from it (Kafka): the horizon it waits on is the log's
//!   written end for the local path, its durable end for Kafka.
//! * After capture ends, the stage ends only once everything published is
//!   applied (Kafka: the checkpoint reaches the publisher's cursor, or the
//!   transport error [`TransportError::Undelivered`] after 60 s).
//! * The cursor is persisted when idle (once due) and at the end.

use crate::apply::{Applier, ApplyError, ApplyStats};
use crate::config::{Flow, Transport};
use crate::log::{Log, storage::FsStorage};
use crate::plan::Tuning;
use crate::service::Observer;
use crate::transport::TransportError;
use crate::transport::kafka::{Feed, KafkaTarget, Publisher};
use std::time::Duration;
use trellara_common::Lsn;

/// Where the applier reads the flow's transactions from.
#[derive(Debug)]
pub enum Delivery {
    /// The durable log, through the cursor `applier-<flow>`.
    Local,
    /// Store and forward: a publisher forwards the log to a one-partition
    /// topic, the applier reads it through its consumer group.
    Kafka { publisher: Publisher, feed: Feed },
}

impl Delivery {
    /// The flow's delivery, its topic made ready when it is Kafka.
    pub async fn open(flow: &Flow, progress: &mut dyn FnMut(&str)) -> Result<Self, ApplyError> {
        match &flow.transport {
            Transport::Kafka { brokers, topic, .. } => {
                let target = KafkaTarget {
                    brokers: brokers.clone(),
                    topic: topic.clone(),
                };
                target.ensure_topic().await?;
                let publisher = Publisher::new(target.clone(), &flow.name)?;
                let feed = Feed::new(target, &crate::apply::cursor_name(&flow.name))?;
                progress(&format!("transport: kafka topic {topic} on {brokers}"));
                Ok(Delivery::Kafka { publisher, feed })
            }
            Transport::Local { .. } => Ok(Delivery::Local),
        }
    }

    /// Whether the applier may open its next target transaction as soon as
    /// one commits or a transaction begins: the log hands over each one as
    /// it is written, while the topic delivers later, so a transaction
    /// opened there would mostly wait idle.
    pub fn opens_ahead(&self) -> bool {
        matches!(self, Delivery::Local)
    }

    /// The log position the applier can read up to now: the written end
    /// (it commits only what turned durable), or what is durable (the
    /// publisher forwards only that).
    fn horizon(&self, log: &Log<FsStorage>) -> u64 {
        match self {
            Delivery::Local => log.written_end(),
            Delivery::Kafka { .. } => log.next_offset(),
        }
    }

    /// Forwards what is new (Kafka), then applies what is there.
    async fn pull(
        &self,
        applier: &mut Applier,
        log: &Log<FsStorage>,
    ) -> Result<ApplyStats, ApplyError> {
        match self {
            Delivery::Local => applier.apply_log(log).await,
            Delivery::Kafka { publisher, feed } => {
                publisher.publish(log).await?;
                applier.apply_log_with(feed, &crate::crash::NoCrash).await
            }
        }
    }

    /// Persists the applier's position; `when_due`: only once it is due
    /// (it costs a durable target commit after asynchronous ones).
    async fn persist(
        &self,
        applier: &mut Applier,
        log: &Log<FsStorage>,
        when_due: bool,
    ) -> Result<(), ApplyError> {
        if when_due && !applier.cursor_due() {
            return Ok(());
        }
        match self {
            Delivery::Local => applier.persist_cursor(log).await,
            Delivery::Kafka { feed, .. } => applier.persist_cursor(feed).await,
        }
    }

    /// After capture ended: applies until everything published is applied
    /// (a topic read can end on a quiet broker before it is).
    async fn drain(
        &self,
        applier: &mut Applier,
        log: &Log<FsStorage>,
        flow: &str,
        total: &mut ApplyStats,
    ) -> Result<(), ApplyError> {
        let Delivery::Kafka { feed, .. } = self else {
            return Ok(());
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !applied_all_published(applier, log, flow).await? {
            if std::time::Instant::now() > deadline {
                return Err(TransportError::Undelivered {
                    flow: flow.to_owned(),
                }
                .into());
            }
            let stats = applier.apply_log_with(feed, &crate::crash::NoCrash).await?;
            crate::apply::accumulate(total, stats);
        }
        Ok(())
    }
}

/// Whether the target's checkpoint has reached the last commit the
/// publisher forwarded.
async fn applied_all_published(
    applier: &Applier,
    log: &Log<FsStorage>,
    flow: &str,
) -> Result<bool, ApplyError> {
    let Some(published) = log
        .cursor(&crate::transport::kafka::publisher_cursor(flow))
        .and_then(|c| c.last_commit_lsn)
    else {
        return Ok(true);
    };
    let applied: Option<Lsn> = applier
        .client()
        .query_opt(
            "SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = $1",
            &[&flow],
        )
        .await?
        .and_then(|r| r.get::<_, String>(0).parse().ok());
    Ok(applied.is_some_and(|a| a.0 >= published))
}

/// What the apply stage watches besides the log.
#[derive(Debug)]
pub struct Signals<'a> {
    /// Turns true once capture has ended (nothing more will be written).
    pub captured: tokio::sync::watch::Receiver<bool>,
    /// Notified when capture sees a transaction begin.
    pub begun: &'a tokio::sync::Notify,
    pub observe: Option<&'a Observer>,
    pub tuning: &'a Tuning,
}

/// Applies the log through `delivery` while capture writes it, and what
/// is left once capture has ended; retention runs along.
pub async fn apply_stage(
    applier: &mut Applier,
    delivery: &Delivery,
    log: &Log<FsStorage>,
    flow: &str,
    signals: Signals<'_>,
) -> Result<ApplyStats, ApplyError> {
    let Signals {
        mut captured,
        begun,
        observe,
        tuning,
    } = signals;
    let mut total = ApplyStats::default();
    let mut last_retention = std::time::Instant::now();
    // The applier wakes as soon as capture wrote something (it commits
    // only once that is durable).
    let mut moved = log.subscribe();
    loop {
        let seen = delivery.horizon(log);
        let finished = *captured.borrow();
        let stats = delivery.pull(applier, log).await?;
        // Idle: what the cursor has not persisted yet goes once due.
        if stats.transactions == 0 {
            delivery.persist(applier, log, true).await?;
        }
        if let Some(o) = observe {
            // Idle means applied through everything captured.
            o.health.lag(if stats.transactions == 0 {
                0.0
            } else {
                o.metrics.last_lag_seconds()
            });
        }
        crate::apply::accumulate(&mut total, stats);
        if finished {
            delivery.drain(applier, log, flow, &mut total).await?;
        }
        if finished || last_retention.elapsed() >= tuning.retention_every {
            last_retention = std::time::Instant::now();
            enforce_retention(log, observe);
        }
        if finished {
            delivery.persist(applier, log, false).await?;
            return Ok(total);
        }
        let idle = tokio::time::sleep(tuning.idle_tick);
        tokio::pin!(idle);
        loop {
            tokio::select! {
                biased;
                _ = captured.changed() => break,
                _ = moved.wait_for(|()| delivery.horizon(log) > seen) => break,
                () = begun.notified(), if delivery.opens_ahead() => {
                    applier.open_ahead().await;
                    // Its rows get the whole tick to come.
                    idle.as_mut().reset(tokio::time::Instant::now() + tuning.idle_tick);
                }
                () = &mut idle => {
                    applier.close_opened().await;
                    break;
                }
            }
        }
    }
}

/// Deletes segments every consumer has passed, within the flow's size
/// limit; what a lagging consumer holds is reported, never deleted.
/// A reloaded limit (see [`crate::service::LiveSettings`]) applies here.
fn enforce_retention(log: &Log<FsStorage>, observe: Option<&Observer>) {
    let result = crate::capture::release_source_ack(log).and_then(|()| match observe {
        Some(o) => log.enforce_retention_with(&crate::log::RetentionPolicy {
            max_total_bytes: o.live.retention(),
            ..crate::log::RetentionPolicy::keep_all()
        }),
        None => log.enforce_retention(),
    });
    match result {
        Ok(report) => {
            for p in &report.pressure {
                tracing::warn!(consumer = %p.consumer, held_bytes = p.held_bytes, held_segments = p.held_segments, "retention pressure: a consumer holds log segments past the size limit");
            }
            if !report.deleted.is_empty() {
                tracing::info!(
                    segments = report.deleted.len(),
                    "retention removed consumed log segments"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "log retention failed; the log keeps its segments"),
    }
}
