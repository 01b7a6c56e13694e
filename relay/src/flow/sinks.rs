//! A flow's sinks after the first (`sinks:` in the config): each applies
//! the flow's one log, written from its one slot, through a cursor of its
//! own into a target of its own, with its own lock, boundary, checkpoint,
//! quarantine, health entry and metrics series. The first sink is the
//! flow's round itself (its target holds the flow's boundary, and a first
//! run copies into it); the others run beside it, one task each.
//!
//! Invariants:
//! * A sink never stops the flow or another sink: its error ends its own
//!   round only. Following, a retryable one is retried after a backoff; a
//!   permanent one (a quarantine, a refused check) leaves it stopped, in
//!   /healthz and the run's closing lines, until the next start. One held
//!   at a schema change waits, `held` in /healthz, until `schema accept`
//!   (or a new snapshot) releases it, then goes on from that transaction:
//!   capture and the log go on meanwhile.
//! * A sink's cursor exists before its boundary is taken, so every
//!   transaction committing after the boundary is in the log past it.
//! * A sink whose cursor is missing (a new log, or one dropped past the
//!   log's cap, [`delivery::over_cap`]) is copied again at a new boundary of its
//!   own, never resumed across what the log no longer holds. The flow's
//!   slot is never dropped or moved for it.

use super::delivery::{self, Delivery, Signals};
use super::{Boundary, FlowError, Start, connect, gate_sink, joins_and_leaves, sink_url};
use crate::apply::{Applier, ApplyStats};
use crate::config::{Flow, SinkRef};
use crate::log::{Log, storage::FsStorage};
use crate::plan::Tuning;
use crate::role::Role;
use crate::service::{FlowState, Observer};
use crate::{snapshot, state};

/// What every sink of one round shares.
#[derive(Debug)]
pub struct Shared<'a> {
    pub flow: &'a Flow,
    pub index: usize,
    pub config_path: &'a str,
    pub role: Role,
    pub source_url: &'a str,
    pub log: &'a Log<FsStorage>,
    pub begun: &'a tokio::sync::Notify,
    pub tuning: &'a Tuning,
    pub follow: bool,
    /// The cursors retention may drop past the log's cap.
    pub droppable: &'a delivery::Droppable,
}

/// The parts of the flow's sinks after the first, each on its own target
/// session, until capture ended and each took what it needs.
pub async fn run_others(
    shared: &Shared<'_>,
    observe: Option<&Observer>,
    captured: &tokio::sync::watch::Receiver<bool>,
) -> Vec<SinkOutcome> {
    let flow = shared.flow;
    futures_util::future::join_all(flow.sinks().into_iter().skip(1).map(|sink| {
        let observe = observe.map(|o| o.sink(&flow.name, &flow.source_id(), sink.name));
        run(shared, sink, observe, captured.clone(), false)
    }))
    .await
}

/// How one sink's part of a round ended.
#[derive(Debug)]
pub struct SinkOutcome {
    pub sink: String,
    pub applied: ApplyStats,
    /// Each boundary of its own it copied at.
    pub seeded: Vec<snapshot::SnapshotReport>,
    /// What stopped it, when something did.
    pub error: Option<FlowError>,
}

/// Runs one sink until capture has ended and it applied everything, or
/// until it stops.
/// `locked`: the round holds the flow's lock on this sink's target
/// already (the first sink, retrying after its stage failed).
pub async fn run(
    shared: &Shared<'_>,
    sink: SinkRef<'_>,
    observe: Option<Observer>,
    captured: tokio::sync::watch::Receiver<bool>,
    locked: bool,
) -> SinkOutcome {
    let mut outcome = SinkOutcome {
        sink: sink.name.to_owned(),
        applied: ApplyStats::default(),
        seeded: Vec::new(),
        error: None,
    };
    let health = |state: FlowState, error: Option<&FlowError>| {
        if let Some(o) = &observe {
            match error {
                Some(e) => o.health.failed(state, crate::errors::chain_of(e)),
                None => o.health.state(state),
            }
        }
    };
    let mut delay = shared.tuning.retry_first;
    let mut unknown = 0u32;
    let cursor = crate::apply::sink_cursor(&shared.flow.name, sink.name);
    let mut started_once = !locked;
    loop {
        let started = std::time::Instant::now();
        // The first sink retries after its stage failed: wait first.
        if !started_once {
            let mut captured = captured.clone();
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = captured.wait_for(|done| *done) => {}
            }
        }
        started_once = true;
        let result = round(
            shared,
            (sink, locked),
            observe.as_ref(),
            captured.clone(),
            &mut outcome,
        )
        .await;
        let e = match result {
            Ok(()) => {
                health(FlowState::Stopped, None);
                return outcome;
            }
            Err(e) => e,
        };
        if started.elapsed() >= shared.tuning.retry_reset {
            delay = shared.tuning.retry_first;
            unknown = 0;
        }
        if shared.follow
            && !*captured.borrow()
            && let Some(at) = e.held_at()
        {
            tracing::warn!(flow = %shared.flow.name, sink = %sink.name, error = %crate::errors::chain_of(&e), "the sink holds at a schema change until it is accepted; capture and the flow's other sinks go on");
            health(FlowState::Held, Some(&e));
            let Ok(url) = sink_url(shared.flow, shared.index, sink) else {
                outcome.error = Some(e);
                return outcome;
            };
            if !released(&url, &shared.flow.name, at, captured.clone()).await {
                outcome.error = Some(e);
                return outcome;
            }
            tracing::info!(flow = %shared.flow.name, sink = %sink.name, commit_lsn = %at, "the schema change was released: the sink goes on from its transaction");
            delay = shared.tuning.retry_first;
            continue;
        }
        unknown = if e.unknown() { unknown + 1 } else { 0 };
        // Dropped past the cap while it applied: the next round copies.
        let dropped = shared.log.cursor(&cursor).is_none();
        let retry = (e.retryable() && unknown < super::UNKNOWN_ROUNDS) || dropped;
        if !shared.follow || !retry || *captured.borrow() {
            tracing::error!(flow = %shared.flow.name, sink = %sink.name, error = %crate::errors::chain_of(&e), "the sink stopped; the flow's other sinks go on");
            health(FlowState::Stopped, Some(&e));
            outcome.error = Some(e);
            return outcome;
        }
        tracing::warn!(flow = %shared.flow.name, sink = %sink.name, error = %crate::errors::chain_of(&e), retry_in_s = delay.as_secs(), "the sink's round ended; it follows again after the wait, the others go on");
        health(FlowState::Retrying, Some(&e));
        let mut captured = captured.clone();
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = captured.wait_for(|done| *done) => {}
        }
        delay = (delay * 2).min(shared.tuning.retry_max);
    }
}

/// Waits until `flow`'s hold at `at` is released on the target at `url`
/// (true), or `stop` is set (false). The target is asked every two
/// seconds, on a session of its own; one that cannot be reached is asked
/// again.
pub(super) async fn released(
    url: &str,
    flow: &str,
    at: trellara_common::Lsn,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> bool {
    let mut target = None;
    loop {
        tokio::select! {
            () = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
            _ = stop.wait_for(|done| *done) => return false,
        }
        if target
            .as_ref()
            .is_none_or(tokio_postgres::Client::is_closed)
        {
            target = connect(url, "target").await.ok();
        }
        if let Some(client) = &target {
            match state::quarantine::released(client, flow, at).await {
                Ok(true) => return true,
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "could not read the hold; asked again");
                    target = None;
                }
            }
        }
    }
}

/// One sink round: connect and lock its target, pass the flow's checks
/// against it, copy at a boundary of its own when it has none it can
/// resume from, then apply.
async fn round(
    shared: &Shared<'_>,
    (sink, locked): (SinkRef<'_>, bool),
    observe: Option<&Observer>,
    captured: tokio::sync::watch::Receiver<bool>,
    outcome: &mut SinkOutcome,
) -> Result<(), FlowError> {
    let flow = shared.flow;
    let health = |state: FlowState| {
        if let Some(o) = observe {
            o.health.state(state);
        }
    };
    health(FlowState::Starting);
    let say = |line: &str| tracing::info!(flow = %flow.name, sink = %sink.name, "{line}");
    let target = connect(&sink_url(flow, shared.index, sink)?, "target").await?;
    // Held by this session: two sinks that name one database meet here.
    if !locked && let Some(holder) = state::lock_flow(&target, &flow.name, shared.role).await? {
        return Err(FlowError::SinkBusy {
            flow: flow.name.clone(),
            sink: sink.name.to_owned(),
            holder,
        });
    }
    // The first sink's target claimed the slot itself.
    // A source session of its own: its copy runs a snapshot transaction
    // on it, which another sink's copy or check must not share.
    let source = connect(shared.source_url, "source").await?;
    gate_sink(
        flow,
        (shared.source_url, &source),
        &target,
        shared.config_path,
        !locked,
        &mut |line| say(line),
    )
    .await?;
    state::ensure(&target).await?;
    let cursor = crate::apply::sink_cursor(&flow.name, sink.name);
    let stop = Some(captured.clone()).filter(|_| shared.follow);
    let current = snapshot::load(&target, &flow.name).await?;
    let resumable = shared.log.cursor(&cursor).is_some()
        && !snapshot::needs_snapshot(current.as_ref().map(|r| r.state));
    if resumable {
        let joining = Boundary {
            flow,
            source_url: shared.source_url,
            log_dir: std::path::Path::new(""),
            stop,
            follow: shared.follow,
        };
        let start = joins_and_leaves(joining, &source, &target, &health, &mut |line| {
            say(line);
        })
        .await?;
        if matches!(start, Start::Stopped) {
            return Ok(());
        }
    } else {
        health(FlowState::Snapshotting);
        // Before the boundary: everything after it is past this cursor.
        // Held against the cap while it copies: the log grows meanwhile.
        let _copying = shared.droppable.copying(&cursor);
        shared.log.register_consumer_at_end(&cursor)?;
        match snapshot::seed_sink(
            flow,
            shared.source_url,
            &source,
            &target,
            &mut |line| say(line),
            stop,
        )
        .await
        {
            Ok(copied) => {
                say(&format!(
                    "copied at a boundary of its own, {}",
                    copied.consistent_lsn
                ));
                outcome.seeded.push(copied);
            }
            Err(snapshot::SnapshotError::Stopped) if shared.follow => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
    target
        .batch_execute("SET statement_timeout = 0")
        .await
        .map_err(FlowError::Target)?;
    let mut applier = Applier::new(target, &flow.name, &flow.source_id(), shared.config_path)
        .with_consumer(cursor)
        .with_patience(shared.tuning.chunk_patience)
        .with_cursor_every(shared.tuning.cursor_every)
        .with_open_after_commit();
    if let Some(o) = observe {
        applier = applier.with_metrics(o.metrics.clone());
    }
    health(FlowState::Following);
    let signals = Signals {
        captured,
        begun: shared.begun,
        observe,
        tuning: shared.tuning,
        droppable: shared.droppable,
        hooks: &crate::crash::NoCrash,
    };
    let applied = delivery::apply_stage(
        &mut applier,
        &Delivery::Local,
        shared.log,
        &flow.name,
        signals,
    )
    .await;
    applier.close_opened().await;
    crate::apply::accumulate(&mut outcome.applied, applied?);
    // pgoutput carries no sequences: a cutover to this sink must not
    // reuse a key either.
    if let Err(e) = crate::sequences::bring_forward(flow, &source, applier.client()).await {
        say(&format!(
            "warning: the flow's sequences were not brought forward on this sink: {}",
            crate::errors::chain_of(&e)
        ));
    }
    Ok(())
}
