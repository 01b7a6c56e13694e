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

use super::{FlowError, RunReport};
use crate::apply::{Applier, ApplyError, ApplyStats, Target};
use crate::config::{Flow, Transport};
use crate::crash::CrashHooks;
use crate::log::Log;
use crate::log::storage::{FsStorage, Storage};
use crate::plan::Tuning;
use crate::service::FlowState;
use crate::service::Observer;
use crate::transport::TransportError;
use crate::transport::kafka::{Feed, KafkaTarget, Publisher};
use std::time::Duration;

/// Where the applier reads the flow's transactions from.
#[derive(Debug)]
pub enum Delivery {
    /// The durable log, through the cursor `applier-<flow>`.
    Local,
    /// Store and forward: a publisher forwards the log to a one-partition
    /// topic, the applier reads it through its consumer group.
    Kafka { publisher: Publisher, feed: Feed },
}

/// The flow's topic, made ready (created when missing); None for a
/// local transport.
async fn ready_topic(
    flow: &Flow,
    progress: &mut dyn FnMut(&str),
) -> Result<Option<KafkaTarget>, ApplyError> {
    let Transport::Kafka { brokers, topic, .. } = &flow.transport else {
        return Ok(None);
    };
    let target = KafkaTarget {
        brokers: brokers.clone(),
        topic: topic.clone(),
    };
    target.ensure_topic().await?;
    progress(&format!("transport: kafka topic {topic} on {brokers}"));
    Ok(Some(target))
}

/// The relay role's publisher of the flow's log to its topic.
pub async fn open_publisher(
    flow: &Flow,
    progress: &mut dyn FnMut(&str),
) -> Result<Publisher, FlowError> {
    let target = ready_topic(flow, progress)
        .await?
        .ok_or_else(|| FlowError::Unsupported(flow.name.clone()))?;
    Ok(Publisher::new(target, &flow.name).map_err(ApplyError::from)?)
}

impl Delivery {
    /// The flow's delivery, its topic made ready when it is Kafka.
    pub async fn open(flow: &Flow, progress: &mut dyn FnMut(&str)) -> Result<Self, ApplyError> {
        Ok(match ready_topic(flow, progress).await? {
            Some(target) => Delivery::Kafka {
                publisher: Publisher::new(target.clone(), &flow.name)?,
                feed: Feed::new(target, &crate::apply::first_cursor(flow))?,
            },
            None => Delivery::Local,
        })
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
    fn horizon<S: Storage>(&self, log: &Log<S>) -> u64 {
        match self {
            Delivery::Local => log.written_end(),
            Delivery::Kafka { .. } => log.next_offset(),
        }
    }

    /// Forwards what is new (Kafka), then applies what is there.
    async fn pull<T: Target, S: Storage>(
        &self,
        applier: &mut Applier<T>,
        log: &Log<S>,
        hooks: &dyn CrashHooks,
    ) -> Result<ApplyStats, ApplyError> {
        match self {
            Delivery::Local => applier.apply_log_with(log, hooks).await,
            Delivery::Kafka { publisher, feed } => {
                publisher.publish(log).await?;
                applier.apply_log_with(feed, hooks).await
            }
        }
    }

    /// Persists the applier's position; `when_due`: only once it is due
    /// (it costs a durable target commit after asynchronous ones).
    async fn persist<T: Target, S: Storage>(
        &self,
        applier: &mut Applier<T>,
        log: &Log<S>,
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
    async fn drain<T: Target, S: Storage>(
        &self,
        applier: &mut Applier<T>,
        log: &Log<S>,
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
async fn applied_all_published<T: Target, S: Storage>(
    applier: &Applier<T>,
    log: &Log<S>,
    flow: &str,
) -> Result<bool, ApplyError> {
    let Some(published) = log
        .cursor(&crate::transport::kafka::publisher_cursor(flow))
        .and_then(|c| c.last_commit_lsn)
    else {
        return Ok(true);
    };
    let applied = applier.target().applied(flow).await?;
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
    /// Cursors retention may drop past the log's cap.
    pub droppable: &'a Droppable,
    /// Where the applier stops as if the process died (the simulator's;
    /// [`crate::crash::NoCrash`] otherwise).
    pub hooks: &'a dyn CrashHooks,
}

/// The cursors retention may drop past the log's cap: those of a flow's
/// sinks after the first ([`super::sinks`]; none for one sink), but not
/// while the sink copies at a boundary of its own: its cursor waits at
/// the boundary then, and the log grows by the changes of the copy's
/// time, which would drop it again for ever.
#[derive(Debug, Default)]
pub struct Droppable {
    /// Each droppable cursor, with its sink's name.
    cursors: Vec<(String, String)>,
    copying: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Droppable {
    pub fn of(flow: &Flow) -> Self {
        Droppable {
            cursors: flow
                .sinks()
                .iter()
                .skip(1)
                .map(|s| {
                    (
                        crate::apply::sink_cursor(&flow.name, s.name),
                        s.name.to_owned(),
                    )
                })
                .collect(),
            copying: std::sync::Mutex::default(),
        }
    }

    fn copying_now(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.copying
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn may_drop(&self, cursor: &str) -> bool {
        self.cursors.iter().any(|(c, _)| c == cursor) && !self.copying_now().contains(cursor)
    }

    fn any_held(&self, pressure: &[crate::log::ConsumerPressure]) -> bool {
        pressure.iter().any(|p| self.may_drop(&p.consumer))
    }

    fn sink_of<'a>(&'a self, cursor: &'a str) -> &'a str {
        self.cursors
            .iter()
            .find(|(c, _)| c == cursor)
            .map_or(cursor, |(_, sink)| sink)
    }

    /// Keeps `cursor` from being dropped until the guard goes.
    pub fn copying(&self, cursor: &str) -> Copying<'_> {
        self.copying_now().insert(cursor.to_owned());
        Copying {
            of: self,
            cursor: cursor.to_owned(),
        }
    }
}

/// A sink copying: see [`Droppable::copying`].
#[derive(Debug)]
pub struct Copying<'a> {
    of: &'a Droppable,
    cursor: String,
}

impl Drop for Copying<'_> {
    fn drop(&mut self) {
        self.of.copying_now().remove(&self.cursor);
    }
}

/// Applies the log through `delivery` while capture writes it, and what
/// is left once capture has ended; retention runs along.
pub async fn apply_stage<T: Target, S: Storage>(
    applier: &mut Applier<T>,
    delivery: &Delivery,
    log: &Log<S>,
    flow: &str,
    signals: Signals<'_>,
) -> Result<ApplyStats, ApplyError> {
    let Signals {
        mut captured,
        begun,
        observe,
        tuning,
        droppable,
        hooks,
    } = signals;
    let mut total = ApplyStats::default();
    let mut last_retention = std::time::Instant::now();
    // The applier wakes as soon as capture wrote something (it commits
    // only once that is durable).
    let mut moved = log.subscribe();
    loop {
        let seen = delivery.horizon(log);
        let finished = *captured.borrow();
        let stats = delivery.pull(applier, log, hooks).await?;
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
            enforce_retention(log, observe, droppable);
        }
        if finished {
            delivery.persist(applier, log, false).await?;
            return Ok(total);
        }
        // Held at a verify's fence, it looks again soon, whatever the log
        // does: the fence moves on the target.
        let held = applier.held();
        let idle = tokio::time::sleep(if held {
            crate::fence::HELD_POLL
        } else {
            tuning.idle_tick
        });
        tokio::pin!(idle);
        loop {
            tokio::select! {
                biased;
                _ = captured.changed() => break,
                _ = moved.wait_for(|()| delivery.horizon(log) > seen), if !held => break,
                () = begun.notified(), if delivery.opens_ahead() && !held => {
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

/// The relay role's stage: forwards what capture makes durable to the
/// topic as it comes, and what is left once capture has ended. Its lag is
/// 0 after each pass that reached the log's end: a publisher stuck on its
/// broker ages into lag on /readyz.
pub async fn publish_stage(
    publisher: Option<&Publisher>,
    log: &Log<FsStorage>,
    signals: Signals<'_>,
) -> Result<(), ApplyError> {
    let Signals {
        mut captured,
        observe,
        tuning,
        droppable,
        ..
    } = signals;
    let mut last_retention = std::time::Instant::now();
    let mut moved = log.subscribe();
    loop {
        let seen = log.next_offset();
        let finished = *captured.borrow();
        if let Some(publisher) = publisher {
            publisher.publish(log).await?;
        }
        if let Some(o) = observe {
            o.health.lag(0.0);
        }
        if finished || last_retention.elapsed() >= tuning.retention_every {
            last_retention = std::time::Instant::now();
            enforce_retention(log, observe, droppable);
        }
        if finished {
            return Ok(());
        }
        tokio::select! {
            _ = captured.changed() => {}
            _ = moved.wait_for(|()| log.next_offset() > seen) => {}
            () = tokio::time::sleep(tuning.idle_tick) => {}
        }
    }
}

/// How often the apply role looks again for a target the relay has not
/// made ready yet.
const READY_POLL: Duration = Duration::from_secs(1);

/// What the apply role reads: the flow's topic, or the local log its
/// relay writes in another process on this host.
enum Followed {
    Topic(Feed),
    Log(Log<FsStorage>),
}

impl Followed {
    async fn apply(&self, applier: &mut Applier) -> Result<ApplyStats, ApplyError> {
        match self {
            Followed::Topic(feed) => applier.apply_log_with(feed, &crate::crash::NoCrash).await,
            Followed::Log(log) => {
                log.refresh().map_err(TransportError::from)?;
                applier.apply_log_with(log, &crate::crash::NoCrash).await
            }
        }
    }

    async fn persist(&self, applier: &mut Applier) -> Result<(), ApplyError> {
        match self {
            Followed::Topic(feed) => applier.persist_cursor(feed).await,
            Followed::Log(log) => applier.persist_cursor(log).await,
        }
    }

    /// Idle: a topic read waited already; the log is looked at until its
    /// relay makes more durable, for up to `patience`.
    async fn wait(&self, patience: Duration) -> Result<(), ApplyError> {
        if let Followed::Log(log) = self {
            let end = log.written_end();
            log.follow_past(end, patience, crate::transport::FOLLOW_POLL)
                .await
                .map_err(TransportError::from)?;
        }
        Ok(())
    }

    /// Where it reads, for messages.
    fn describe(&self, flow: &Flow) -> String {
        match (self, &flow.transport) {
            (Followed::Topic(_), Transport::Kafka { topic, .. }) => format!("topic {topic}"),
            _ => format!(
                "the log {}",
                flow.log_dir()
                    .map_or_else(String::new, |d| d.display().to_string())
            ),
        }
    }
}

/// How long an idle apply service waits for its relay before it looks at
/// its target again (the boundary, the cursor): the log wakes it as soon
/// as something is durable, so this bounds only the idle round trips (at
/// the 50 ms idle tick they cost the idle service 1.5% of a core).
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// The local log of the flow, once its relay has opened it and placed
/// this sink's cursor there; None when `stop` came first.
async fn follow_log(
    flow: &Flow,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    progress: &mut dyn FnMut(&str),
) -> Result<Option<Log<FsStorage>>, FlowError> {
    let dir = flow.log_dir().ok_or_else(|| FlowError::SplitNeedsOneSink {
        flow: flow.name.clone(),
    })?;
    let cursor = crate::apply::first_cursor(flow);
    let mut said = None;
    loop {
        let waiting = match Log::follow(dir, crate::log::LogConfig::default()) {
            Ok(log) if log.cursor(&cursor).is_some() => return Ok(Some(log)),
            Ok(_) => format!(
                "apply: waiting for the relay to place cursor {cursor} in the log {}",
                dir.display()
            ),
            // Replaced while it was opened: the next look finds the new one.
            Err(crate::log::Error::NotWritten { .. } | crate::log::Error::Replaced { .. }) => {
                format!(
                    "apply: waiting for the relay to open the log {} (on this host)",
                    dir.display()
                )
            }
            Err(e) => return Err(e.into()),
        };
        if said.as_ref() != Some(&waiting) {
            progress(&waiting);
            said = Some(waiting);
        }
        tokio::select! {
            () = tokio::time::sleep(READY_POLL) => {}
            _ = stop.wait_for(|s| *s) => return Ok(None),
        }
    }
}

/// The apply role (`trellara apply`): one round that applies the flow's
/// topic, or the local log its relay writes on this host, to its target
/// until `shutdown`, from the target's checkpoint. It needs only the
/// target and the topic or log: the relay role owns the source, the log,
/// the snapshot and the target's `trellara` schema, so this waits until
/// the relay has a boundary ready. A relay that snapshots again later is
/// safe beside it: each transaction locks the checkpoint row, and what
/// the topic or the old log still holds from before the new boundary is
/// skipped as applied; a log the relay replaced ends the round
/// ([`crate::log::Error::Replaced`]) and the next follows the new one.
pub async fn apply_round(
    flow: &Flow,
    (index, config_path): (usize, &str),
    shutdown: &tokio::sync::watch::Receiver<bool>,
    lock: Option<&crate::state::FlowLock>,
    observe: Option<Observer>,
    progress: &mut dyn FnMut(&str),
) -> Result<RunReport, FlowError> {
    let health = |state: FlowState| {
        if let Some(o) = &observe {
            o.health.state(state);
        }
    };
    health(FlowState::Starting);
    let mut report = RunReport {
        flow: flow.name.clone(),
        ..RunReport::default()
    };
    let target = super::connect(&super::target_url(flow, index)?, "target").await?;
    if lock.is_none()
        && let Some(holder) =
            crate::state::lock_flow(&target, &flow.name, crate::service::Role::Apply).await?
    {
        return Err(FlowError::Busy {
            flow: flow.name.clone(),
            holder,
        });
    }
    // A newer build's columns (the applier reads snapshot_tables), before
    // the first record.
    crate::state::ensure(&target).await?;
    let mut stop = shutdown.clone();
    let mut said = false;
    while !boundary_ready(&target, &flow.name).await? {
        if !said {
            progress("apply: waiting for the relay to make the target ready (its snapshot)");
            said = true;
        }
        tokio::select! {
            () = tokio::time::sleep(READY_POLL) => {}
            _ = stop.wait_for(|s| *s) => return Ok(report),
        }
    }
    let followed = match ready_topic(flow, progress).await? {
        Some(topic) => Followed::Topic(
            Feed::new(topic, &crate::apply::first_cursor(flow)).map_err(ApplyError::from)?,
        ),
        None => match follow_log(flow, &mut stop, progress).await? {
            Some(log) => Followed::Log(log),
            None => return Ok(report),
        },
    };
    target
        .batch_execute("SET statement_timeout = 0")
        .await
        .map_err(FlowError::Target)?;
    let tuning = Tuning::DEFAULT;
    let mut applier = Applier::new(target, &flow.name, &flow.source_id(), config_path)
        .with_patience(tuning.chunk_patience)
        .with_cursor_every(tuning.cursor_every);
    if matches!(followed, Followed::Log(_)) {
        // The relay placed it: a missing one is an error, never a start
        // from the log's beginning.
        applier = applier.with_consumer(crate::apply::first_cursor(flow));
    }
    if let Some(o) = &observe {
        applier = applier.with_metrics(o.metrics.clone());
    }
    health(FlowState::Following);
    progress(&format!(
        "apply: following {} until SIGTERM",
        followed.describe(flow)
    ));
    let applied = async {
        loop {
            let finished = *stop.borrow();
            // A relay that went back to a snapshot: wait for its new
            // boundary rather than apply under its copy.
            if !boundary_ready(applier.client(), &flow.name).await? {
                health(FlowState::Starting);
                tokio::select! {
                    () = tokio::time::sleep(READY_POLL) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
                continue;
            }
            let stats = followed.apply(&mut applier).await?;
            let idle = stats.transactions == 0;
            if idle {
                followed.persist(&mut applier).await?;
            }
            if let Some(o) = &observe {
                o.health.state(FlowState::Following);
                o.health.lag(if idle {
                    0.0
                } else {
                    o.metrics.last_lag_seconds()
                });
            }
            crate::apply::accumulate(&mut report.apply, stats);
            if finished {
                // Drained what the topic or log held when the signal came.
                followed.persist(&mut applier).await?;
                return Ok::<(), FlowError>(());
            }
            if applier.held() {
                // The fence moves on the target, not in the log.
                tokio::select! {
                    () = tokio::time::sleep(crate::fence::HELD_POLL) => {}
                    _ = stop.wait_for(|s| *s) => {}
                }
            } else if idle {
                tokio::select! {
                    waited = followed.wait(IDLE_WAIT) => waited?,
                    _ = stop.wait_for(|s| *s) => {}
                }
            }
        }
    };
    applied.await?;
    progress(&format!(
        "applied {} transactions ({} rows), {} duplicates skipped",
        report.apply.transactions, report.apply.rows, report.apply.duplicates_skipped
    ));
    Ok(report)
}

/// Whether the flow's target holds a boundary to stream from: its state
/// tables exist and the snapshot run is ready or verified.
async fn boundary_ready(target: &tokio_postgres::Client, flow: &str) -> Result<bool, FlowError> {
    if !crate::state::present(target).await? {
        return Ok(false);
    }
    let run = crate::snapshot::load(target, flow).await?;
    Ok(!crate::snapshot::needs_snapshot(run.map(|r| r.state)))
}

/// Deletes segments every consumer has passed, within the flow's size
/// limit; what a lagging consumer holds is reported, never deleted, unless
/// it is one of `droppable` (see [`over_cap`]).
/// A reloaded limit (see [`crate::service::LiveSettings`]) applies here.
fn enforce_retention<S: Storage>(log: &Log<S>, observe: Option<&Observer>, droppable: &Droppable) {
    // An apply service in another process commits its cursor on the disk.
    // Positions left unread are older, never newer: what the source and
    // retention release on them is released later, never too early.
    if let Err(e) = log.reload_cursors() {
        tracing::warn!(error = %e, "could not read the consumers' cursors; releasing on the last ones read");
    }
    let result = crate::capture::release_source_ack(log);
    let result = result.and_then(|()| match observe {
        Some(o) => log.enforce_retention_with(&crate::log::RetentionPolicy {
            max_total_bytes: o.live.retention(),
            ..crate::log::RetentionPolicy::keep_all()
        }),
        None => log.enforce_retention(),
    });
    match result {
        Ok(report) if droppable.any_held(&report.pressure) => {
            for sink in over_cap(log, &report.pressure, droppable) {
                if let Some(o) = observe {
                    o.health.sink_needs_copy(&sink);
                }
            }
            // What the dropped cursors held goes at once.
            enforce_retention(log, observe, &Droppable::default());
        }
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

/// Past the log's cap, drops the cursors in `droppable` that hold what
/// retention would delete, so the log stays within its cap instead of
/// growing for a sink that stalled: such a sink is copied again at a
/// boundary of its own when it is back ([`super::sinks`]). The flow's
/// slot follows the log's durability either way. Returns the sinks whose
/// cursors were dropped.
pub fn over_cap<S: Storage>(
    log: &Log<S>,
    pressure: &[crate::log::ConsumerPressure],
    droppable: &Droppable,
) -> Vec<String> {
    let mut dropped = Vec::new();
    for held in pressure.iter().filter(|p| droppable.may_drop(&p.consumer)) {
        match log.unregister_consumer(&held.consumer) {
            Ok(()) => {
                tracing::warn!(cursor = %held.consumer, held_bytes = held.held_bytes, "a sink held the log past its cap (transport.retention_mib): its cursor is dropped, and the sink is copied again at a boundary of its own when it is back");
                dropped.push(droppable.sink_of(&held.consumer).to_owned());
            }
            Err(e) => {
                tracing::warn!(cursor = %held.consumer, error = %e, "could not drop a sink's cursor past the log's cap");
            }
        }
    }
    dropped
}
