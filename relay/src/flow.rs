//! Runs one configured flow end to end: snapshot and handoff if needed,
//! capture into the durable log until caught up with the source's WAL
//! position at the start of the round, then apply everything durable to
//! the target.
//!
//! ```text
//!  snapshot (once) ─▶ capture until durable ≥ source WAL position ─▶ apply log
//!                       └──────────── --follow repeats ◀─────────────┘
//! ```

pub mod delivery;
pub mod round;
pub mod sinks;

use crate::apply::{Applier, ApplyError, ApplyStats};
use crate::capture::{self, CaptureConfig};
use crate::config::{CapturePath, Flow};
use crate::log::{Log, LogConfig, storage::FsStorage};
use crate::service::{FlowState, Observer, Role};
use crate::session::{ConnectError, redact};
use crate::snapshot::{self, SnapshotReport};
use crate::state::{self, SnapshotState};
use crate::transport::kafka::Publisher;
use delivery::{Delivery, Signals, apply_stage, publish_stage};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Client;
use trellara_common::Lsn;
use trellara_external_relay::pgoutput::ProtoVersion;

#[derive(Debug, thiserror::Error)]
pub enum FlowError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigIssue),
    #[error("throwaway target")]
    Throwaway(#[from] crate::throwaway::ThrowawayError),
    #[error(transparent)]
    Connect(#[from] crate::session::ConnectError),
    #[error("target database")]
    Target(#[from] tokio_postgres::Error),
    /// A query on the run's source session failed (not its connect).
    #[error("source database ({url})")]
    Source {
        url: String,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error(transparent)]
    Capture(#[from] capture::CaptureError),
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error(transparent)]
    Log(#[from] crate::log::Error),
    #[error(
        "flow {0} uses a transport or capture path this build cannot run; see `trellara check --config`"
    )]
    Unsupported(String),
    #[error("{0}")]
    Native(String),
    #[error(transparent)]
    NativeRelay(#[from] crate::native::NativeError),
    #[error(
        "refused by preflight's checks; nothing was created or changed on the source or the target:\n{}\nhint: trellara preflight --config {config} shows every check",
        blockers.iter().map(|b| format!("  - {b}")).collect::<Vec<_>>().join("\n")
    )]
    Blocked {
        blockers: Vec<String>,
        config: String,
    },
    #[error("preflight of flow {flow}")]
    Preflight {
        flow: String,
        #[source]
        source: crate::preflight::PreflightError,
    },
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityError),
    #[error(transparent)]
    Horizon(#[from] crate::horizon::HorizonError),
    #[error(
        "flow {flow} is already running against this target: {holder} holds its lock; nothing was changed\nhint: one process runs a flow, on any host: stop the other one (SIGTERM) first"
    )]
    Busy { flow: String, holder: String },
    #[error(
        "flow {flow}: sinks {sinks} stopped before they applied everything captured (their errors are above); the flow's other sinks did\nhint: fix what each error names, then run again: a sink resumes from its own checkpoint"
    )]
    SinksStopped { flow: String, sinks: String },
    #[error(
        "flow {flow}, sink {sink}: its target's flow lock is held by {holder} so this sink does not apply\nhint: another process runs this flow into that database, or two of the flow's sinks name one database: give each sink a database of its own"
    )]
    SinkBusy {
        flow: String,
        sink: String,
        holder: String,
    },
    #[error(
        "flow {flow}: the target session holding the flow's lock ended, so another process could take the flow; this round stopped"
    )]
    LockLost { flow: String },
    #[error(
        "flow {flow} has several sinks, and only a flow of one sink splits into `trellara relay` and `trellara apply` services; nothing was started\nhint: run the flow in one process with `trellara run --config CONFIG --flow {flow} --follow`"
    )]
    SplitNeedsOneSink { flow: String },
    #[error("log directory {path}")]
    LogDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl FlowError {
    /// Whether following again may succeed without anyone fixing anything:
    /// a database that could not be reached or went away, or a server
    /// error that is not permanent, an unknown one included (the next
    /// round reconnects and resumes from the target's checkpoint).
    pub fn retryable(&self) -> bool {
        // A session lost, or a server error the one classifier calls
        // transient (trellara_common::retry).
        fn unreachable(e: &tokio_postgres::Error) -> bool {
            e.is_closed()
                || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
                || e.as_db_error()
                    .is_some_and(|d| trellara_common::retry::transient(d.code().code()))
        }
        match self {
            FlowError::Connect(ConnectError::Timeout { .. }) | FlowError::LockLost { .. } => true,
            // The relay replaced the log the apply role followed (a
            // reseed): the next round follows the new one.
            _ if matches!(self.log_cause(), Some(crate::log::Error::Replaced { .. })) => true,
            FlowError::Connect(ConnectError::Session { source, .. })
            | FlowError::Source { source, .. }
            | FlowError::Target(source) => unreachable(source),
            FlowError::Apply(ApplyError::Target(crate::apply::TargetError::Postgres(e))) => {
                unreachable(e)
            }
            FlowError::Snapshot(
                snapshot::SnapshotError::Target(e) | snapshot::SnapshotError::Source(e),
            ) => unreachable(e),
            // A database error deeper down (a check that lost its session
            // mid-preflight, say) is as transient as one met directly.
            _ => match pg_cause(self) {
                Some(PgCause::Session(pg)) => unreachable(pg),
                Some(PgCause::Server(db)) => trellara_common::retry::transient(db.code().code()),
                None => false,
            },
        }
    }

    /// The commit a sink holds at: a schema change no sink applies on its
    /// own, until `schema accept` (or a new snapshot) releases it.
    pub fn held_at(&self) -> Option<Lsn> {
        match self {
            FlowError::Apply(ApplyError::Quarantined {
                commit_lsn,
                held: Some(_),
                ..
            }) => Some(*commit_lsn),
            _ => None,
        }
    }

    /// The log error that ended the round, however deep it was wrapped.
    fn log_cause(&self) -> Option<&crate::log::Error> {
        use crate::transport::TransportError;
        match self {
            FlowError::Log(e)
            | FlowError::Apply(
                ApplyError::Log(e) | ApplyError::Transport(TransportError::Log(e)),
            ) => Some(e),
            _ => None,
        }
    }

    /// Whether a server error no SQLSTATE class names
    /// ([`trellara_common::retry::Class::Unknown`]) ended the round: it is
    /// retried, a bounded number of times in a row.
    pub fn unknown(&self) -> bool {
        let db = match pg_cause(self) {
            Some(PgCause::Session(pg)) => pg.as_db_error(),
            Some(PgCause::Server(db)) => Some(db),
            None => None,
        };
        db.is_some_and(|db| {
            trellara_common::retry::class(db.code().code())
                == trellara_common::retry::Class::Unknown
        })
    }
}

/// The first database error in an error's chain.
enum PgCause<'a> {
    Session(&'a tokio_postgres::Error),
    /// Behind a transparent wrapper, which skips the tokio_postgres error
    /// itself, only its DbError shows.
    Server(&'a tokio_postgres::error::DbError),
}

fn pg_cause<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<PgCause<'a>> {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if let Some(pg) = e.downcast_ref::<tokio_postgres::Error>() {
            return Some(PgCause::Session(pg));
        }
        if let Some(db) = e.downcast_ref::<tokio_postgres::error::DbError>() {
            return Some(PgCause::Server(db));
        }
        cause = e.source();
    }
    None
}

/// How many rounds in a row may end with an unknown server error
/// ([`trellara_common::retry::Class::Unknown`]) before a following flow
/// stops: with the backoff (1, 2, 4 s), about ten seconds; a service
/// manager that restarts a failed process retries at its own pace.
const UNKNOWN_ROUNDS: u32 = 4;

/// What one `run` did.
#[derive(Debug, Default)]
pub struct RunReport {
    pub flow: String,
    pub snapshot: Option<SnapshotReport>,
    pub envelopes_captured: u64,
    pub capture_duplicates_skipped: u64,
    pub apply: ApplyStats,
    pub caught_up_to: Option<Lsn>,
    /// How the flow's sinks after the first ended ([`sinks`]).
    pub sinks: Vec<sinks::SinkOutcome>,
}

impl RunReport {
    /// Adds what a later round of the same flow did.
    fn add(&mut self, later: RunReport) {
        self.snapshot = self.snapshot.take().or(later.snapshot);
        self.envelopes_captured += later.envelopes_captured;
        self.capture_duplicates_skipped += later.capture_duplicates_skipped;
        crate::apply::accumulate(&mut self.apply, later.apply);
        self.caught_up_to = later.caught_up_to.or(self.caught_up_to);
        for sink in later.sinks {
            match self.sinks.iter_mut().find(|s| s.sink == sink.sink) {
                Some(mine) => {
                    crate::apply::accumulate(&mut mine.applied, sink.applied);
                    mine.seeded.extend(sink.seeded);
                    mine.error = sink.error;
                }
                None => self.sinks.push(sink),
            }
        }
    }
}

/// Turns true on the first SIGTERM or Ctrl-C from now on, whatever the
/// process is doing then: a snapshot copy or a wait to retry stops at once,
/// a connection attempt at its timeout, streaming after its last commit.
pub fn shutdown_signal() -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        until_signal().await;
        let _ = tx.send(true);
    });
    rx
}

/// The tuning every run uses (and `config show` prints).
const TUNING: crate::plan::Tuning = crate::plan::Tuning::DEFAULT;

/// Ends a following run when it turns true: the first SIGTERM or Ctrl-C
/// ([`shutdown_signal`]), or whatever its sender decides.
pub type Shutdown = tokio::sync::watch::Receiver<bool>;

/// How long a [`run`] goes on.
#[derive(Debug)]
pub enum Mode {
    /// One round, until everything committed on the source before it
    /// started is applied (`run`, `reseed`). It does not listen for a
    /// shutdown: a signal keeps its default action (but while the slot is
    /// created), which the log and the target's checkpoint make safe.
    Once,
    /// Round after round until shutdown, riding through a source or
    /// target that restarts or cannot be reached for a while
    /// (`run --follow`, the relay and apply services).
    Follow(Shutdown),
    /// One following round, until shutdown or this long has passed; an
    /// error ends it (`semantics`, which reports what it saw until then).
    For(Duration, Shutdown),
}

/// What a [`run`] does: which flow of which config, which role, how long,
/// and who watches it.
#[derive(Debug)]
pub struct Job<'a, W: Watch = NoWatch> {
    /// The flow's place in the config, for its URLs' environment names.
    pub index: usize,
    /// The config's path, for the commands messages suggest.
    pub config_path: &'a str,
    /// [`Role::Both`]; a split flow's [`Role::Relay`] (capture and
    /// publish) or [`Role::Apply`] (apply what the relay published), both
    /// only with [`Mode::Follow`].
    pub role: Role,
    pub mode: Mode,
    /// Runs beside capture and apply on each round's log.
    pub watch: W,
    /// Where the run reports its metrics and health (the service
    /// endpoints); None for a run nobody scrapes.
    pub observe: Option<Observer>,
}

impl<'a> Job<'a> {
    /// Both roles of flow `index`, unwatched and unobserved.
    pub fn new(index: usize, config_path: &'a str, mode: Mode) -> Self {
        Job {
            index,
            config_path,
            role: Role::Both,
            mode,
            watch: NoWatch,
            observe: None,
        }
    }

    /// A service's job: `role` of flow `index` round after round until
    /// SIGTERM or Ctrl-C, reporting to its endpoints. Call it inside the
    /// runtime: it starts listening for the signals.
    pub fn service(index: usize, config_path: &'a str, role: Role, observe: Observer) -> Self {
        Job {
            role,
            observe: Some(observe),
            ..Job::new(index, config_path, Mode::Follow(shutdown_signal()))
        }
    }

    /// The same job with `watch` beside it.
    pub fn watched<W: Watch>(self, watch: W) -> Job<'a, W> {
        let Job {
            index,
            config_path,
            role,
            mode,
            watch: NoWatch,
            observe,
        } = self;
        Job {
            index,
            config_path,
            role,
            mode,
            watch,
            observe,
        }
    }
}

/// The pipeline, composed once: resolves the flow, gates it, snapshots if
/// needed, then captures (external or native) into the durable log and
/// delivers from it (locally or over Kafka) to every sink. The CLI's
/// `run`, `reseed` and `semantics`, and the relay and apply services, all
/// come through here.
pub async fn run<W: Watch>(
    flow: &Flow,
    job: Job<'_, W>,
    progress: &mut dyn FnMut(&str),
) -> Result<RunReport, FlowError> {
    check_split(flow, job.role)?;
    let Job {
        index,
        config_path,
        role,
        mode,
        mut watch,
        observe,
    } = job;
    let following = match mode {
        Mode::Follow(shutdown) => {
            let (config, ends) = ((index, config_path), (watch, observe));
            return follow_rounds(flow, config, role, ends, shutdown, progress).await;
        }
        Mode::Once => None,
        Mode::For(until, shutdown) => Some(Following {
            shutdown,
            until: Some(until),
        }),
    };
    assert!(
        role == Role::Both,
        "a split role runs only as a following service"
    );
    let round = Round {
        role,
        following,
        locked: false,
        observe,
        target_lock: None,
    };
    watched_round(flow, (index, config_path), round, &mut watch, progress).await
}

/// [`Mode::Follow`]: each retry is a new round (connect, lock, capture
/// from the slot, apply from the checkpoint), so nothing is lost or
/// applied twice. Errors that need someone (a quarantined transaction, a
/// bad config) end it.
async fn follow_rounds<W: Watch>(
    flow: &Flow,
    (index, config_path): (usize, &str),
    role: Role,
    (mut watch, observe): (W, Option<Observer>),
    mut shutdown: Shutdown,
    progress: &mut dyn FnMut(&str),
) -> Result<RunReport, FlowError> {
    let report = |state: FlowState, error: Option<&FlowError>| {
        if let Some(o) = &observe {
            match error {
                Some(e) => o.health.failed(state, crate::errors::chain_of(e)),
                None => o.health.state(state),
            }
        }
    };
    let mut total = RunReport {
        flow: flow.name.clone(),
        ..RunReport::default()
    };
    let mut delay = TUNING.retry_first;
    // Held across rounds, so nothing (a teardown, another run) takes the
    // log while this process waits to follow again, even before its
    // target was ever reached. The apply role does not write the log: it
    // reads the topic, or follows the log its relay writes.
    let held = hold_log(flow, role)?;
    // The target lock too, on a session of its own: a round that fails
    // leaves it held for the next.
    let mut target_lock: Option<state::FlowLock> = None;
    // A reload that changes the tables ends the capturing round; the next
    // starts with them. The apply role reads them from the target's state.
    let mut reloaded = observe
        .as_ref()
        .filter(|_| role.captures())
        .map(|o| o.live.tables());
    let mut current = flow.clone();
    // The tables before a live change, until a round with the new ones
    // has started well: a change that fails is undone.
    let mut before: Option<Vec<String>> = None;
    let mut unknown_rounds = 0u32;
    loop {
        let started = std::time::Instant::now();
        if target_lock.as_ref().is_some_and(state::FlowLock::is_lost) {
            target_lock = None;
        }
        let flow = &current;
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let stopping = stop_round(shutdown.clone(), reloaded.as_mut(), stop_tx);
        let round = follow_round(
            flow,
            (index, config_path),
            role,
            (&stop, held.is_some()),
            &mut target_lock,
            (&mut watch, observe.clone()),
            progress,
        );
        let outcome = tokio::select! {
            outcome = round => outcome,
            () = stopping => unreachable!("stopping never resolves"),
        };
        let changed = reloaded.as_ref().and_then(|rx| rx.borrow().clone());
        let next_tables = changed.filter(|t| *t != current.tables);
        match outcome {
            // A reload ended the round, not a signal.
            Ok(done) if *stop.borrow() && !*shutdown.borrow() => {
                total.add(done);
                if let Some(tables) = next_tables {
                    before = Some(std::mem::replace(&mut current.tables, tables));
                    progress(&format!(
                        "reload: the round ends; the next follows {}",
                        current.tables.join(", ")
                    ));
                }
                delay = TUNING.retry_first;
            }
            Ok(done) => {
                report(FlowState::Stopped, None);
                total.add(done);
                return Ok(total);
            }
            Err(
                e @ (FlowError::Blocked { .. }
                | FlowError::Preflight { .. }
                | FlowError::Snapshot(_)),
            ) if (!e.retryable() || e.unknown())
                && !*shutdown.borrow()
                && let Some(tables) = before.take() =>
            {
                // The new tables could not be followed (a check refused
                // one, or its copy failed): the flow goes on as it was.
                report(FlowState::Retrying, Some(&e));
                progress(&format!(
                    "reload: refused, the flow goes on with its tables as they were ({}): {}",
                    tables.join(", "),
                    crate::errors::chain(&anyhow::Error::new(e))
                ));
                current.tables = tables;
            }
            // Held at a schema change (split services, Kafka): the next
            // round starts once the change is accepted on the target.
            Err(e)
                if !*shutdown.borrow()
                    && let Some(at) = e.held_at() =>
            {
                report(FlowState::Held, Some(&e));
                if !held_until_released((flow, index), e, at, shutdown.clone(), progress).await? {
                    return Ok(total);
                }
                delay = TUNING.retry_first;
            }
            Err(e) if e.retryable() && !*shutdown.borrow() => {
                if started.elapsed() >= TUNING.retry_reset {
                    delay = TUNING.retry_first;
                    // A round that ran this long followed its tables.
                    before = None;
                    unknown_rounds = 0;
                }
                // A server error no class names may be deterministic (an
                // extension's internal error on one row): retried, but not
                // for ever.
                if e.unknown() {
                    unknown_rounds += 1;
                    if unknown_rounds >= UNKNOWN_ROUNDS {
                        report(FlowState::Stopped, Some(&e));
                        progress(&format!(
                            "{UNKNOWN_ROUNDS} rounds in a row ended with a server error no SQLSTATE class names as transient or permanent; stopping"
                        ));
                        return Err(e);
                    }
                }
                report(FlowState::Retrying, Some(&e));
                progress(&format!(
                    "{}; following again in {} s",
                    crate::errors::chain(&anyhow::Error::new(e)),
                    delay.as_secs()
                ));
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait_for(|stop| *stop) => return Ok(total),
                }
                delay = (delay * 2).min(TUNING.retry_max);
            }
            Err(e) => {
                report(FlowState::Stopped, Some(&e));
                return Err(e);
            }
        }
    }
}

/// Waits, after a round ended held at a schema change (`e`, at `at`),
/// until the hold is released on the first sink's target (true) or the
/// flow is stopped (false).
async fn held_until_released(
    (flow, index): (&Flow, usize),
    e: FlowError,
    at: Lsn,
    stop: Shutdown,
    progress: &mut dyn FnMut(&str),
) -> Result<bool, FlowError> {
    progress(&format!(
        "{}; the flow holds there until the change is accepted",
        crate::errors::chain(&anyhow::Error::new(e))
    ));
    let url = target_url(flow, index)?;
    if !sinks::released(&url, &flow.name, at, stop).await {
        return Ok(false);
    }
    progress("the schema change was released: following again from its transaction");
    Ok(true)
}

/// A flow splits into relay and apply services when it has one sink:
/// over Kafka, or over its local log, which the apply service follows on
/// the relay's host ([`crate::log::Log::follow`]).
pub fn check_split(flow: &Flow, role: Role) -> Result<(), FlowError> {
    if role != Role::Both && flow.sinks().len() > 1 {
        return Err(FlowError::SplitNeedsOneSink {
            flow: flow.name.clone(),
        });
    }
    Ok(())
}

/// The log's lock for a capturing role, held across [`follow_rounds`]'s rounds
/// so nothing (a teardown, another run) takes the log while this process
/// waits to follow again, even before its target was ever reached. The
/// apply role has no log: it reads the topic.
fn hold_log(flow: &Flow, role: Role) -> Result<Option<crate::lock::LogLock>, FlowError> {
    let Some(dir) = flow.log_dir().filter(|_| role.captures()) else {
        return Ok(None);
    };
    crate::lock::lock(dir).map(Some).map_err(|source| {
        if source.kind() == std::io::ErrorKind::WouldBlock {
            // Only a capturing process locks the log.
            FlowError::Busy {
                flow: flow.name.clone(),
                holder: format!(
                    "another trellara process on this host, playing its capture part (it holds the log {}),",
                    dir.display()
                ),
            }
        } else {
            FlowError::LogDir {
                path: dir.display().to_string(),
                source,
            }
        }
    })
}

/// Ends a [`follow_rounds`] round (sets `stop`) on SIGTERM or when a reload
/// changes the tables; never resolves itself.
async fn stop_round(
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    reloaded: Option<&mut tokio::sync::watch::Receiver<Option<Vec<String>>>>,
    stop: tokio::sync::watch::Sender<bool>,
) {
    tokio::select! {
        _ = shutdown.wait_for(|stop| *stop) => {}
        () = async {
            match reloaded {
                Some(rx) => { let _ = rx.changed().await; }
                None => std::future::pending().await,
            }
        } => {}
    }
    let _ = stop.send(true);
    std::future::pending::<()>().await;
}

/// One round of [`follow_rounds`] for `role`, until `stop`; takes the target
/// lock first if the last round lost it. `(stop, log_held)`.
async fn follow_round<W: Watch>(
    flow: &Flow,
    (index, config_path): (usize, &str),
    role: Role,
    (stop, log_held): (&tokio::sync::watch::Receiver<bool>, bool),
    target_lock: &mut Option<state::FlowLock>,
    (watch, observe): (&mut W, Option<Observer>),
    progress: &mut dyn FnMut(&str),
) -> Result<RunReport, FlowError> {
    if target_lock.is_none() {
        *target_lock = Some(take_flow_lock(flow, index, role).await?);
    }
    let lock = target_lock.as_ref();
    if role == Role::Apply {
        // As watched_round does for the other roles: without its lock the
        // round ends at once, another applier may have it.
        let applying =
            delivery::apply_round(flow, (index, config_path), stop, lock, observe, progress);
        return tokio::select! {
            biased;
            () = lock_lost(lock) => Err(FlowError::LockLost {
                flow: flow.name.clone(),
            }),
            done = applying => done,
        };
    }
    let round = Round {
        role,
        following: Some(Following {
            shutdown: stop.clone(),
            until: None,
        }),
        locked: log_held,
        observe,
        target_lock: lock,
    };
    watched_round(flow, (index, config_path), round, watch, progress).await
}

/// Connects a session to the flow's target that holds its lock and does
/// nothing else.
async fn take_flow_lock(
    flow: &Flow,
    index: usize,
    role: Role,
) -> Result<state::FlowLock, FlowError> {
    let client = connect(&target_url(flow, index)?, "target").await?;
    state::FlowLock::take(client, &flow.name, role)
        .await?
        .map_err(|holder| FlowError::Busy {
            flow: flow.name.clone(),
            holder,
        })
}

/// Preflight's checks, before anything is created or changed on either
/// side: a critical finding about this flow refuses the run
/// ([`FlowError::Blocked`], exit 3); the grader's warnings are shown.
pub async fn gate(
    flow: &Flow,
    source_url: &str,
    source: &Client,
    target: &Client,
    config_path: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(), FlowError> {
    gate_sink(
        flow,
        (source_url, source),
        target,
        config_path,
        false,
        progress,
    )
    .await
}

/// [`gate`] for one of a flow's sinks; `joins_slot`: a sink after the
/// first, whose target has no record of the flow's slot because the
/// first sink's target claimed it. This process holds the flow's log,
/// which the slot streams into, so it is the flow's.
pub async fn gate_sink(
    flow: &Flow,
    (source_url, source): (&str, &Client),
    target: &Client,
    config_path: &str,
    joins_slot: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<(), FlowError> {
    let mut assessment = crate::preflight::assess(flow, source_url, source, target, Duration::ZERO)
        .await
        .map_err(|source| FlowError::Preflight {
            flow: flow.name.clone(),
            source,
        })?;
    if joins_slot {
        assessment
            .flow
            .retain(|f| !(f.side == "source" && f.check == "slot"));
    }
    for warning in assessment.warnings() {
        progress(&format!("preflight: warning {warning}"));
    }
    let blockers = assessment.blockers();
    if !blockers.is_empty() {
        return Err(FlowError::Blocked {
            blockers,
            config: config_path.to_owned(),
        });
    }
    Ok(())
}

/// Refuses a target that is the source database itself (for commands that
/// write state to the target without running the whole gate: verify).
pub async fn refuse_same_database(
    source: &Client,
    target: &Client,
    config_path: &str,
) -> Result<(), FlowError> {
    if crate::identity::same_database(source, target).await? {
        return Err(FlowError::Blocked {
            blockers: vec![
                "target identity: is the source database itself\n    fix: point the flow's target.url at another database".into(),
            ],
            config: config_path.to_owned(),
        });
    }
    Ok(())
}

/// Opens a plain SQL connection; the connection task runs in the background.
pub async fn connect(url: &str, side: &'static str) -> Result<Client, FlowError> {
    Ok(crate::session::connect(url, side).await?)
}

/// The fingerprints the flow's snapshot copied its tables at (the tables'
/// `namespace.name`), and the whole descriptions where kept, for capture
/// to pin.
async fn snapshot_pins(target: &Client, flow: &str) -> Result<Pins, FlowError> {
    let tables = crate::state::runs::tables(target, flow).await?;
    let schemas = tables
        .iter()
        .filter_map(|t| Some((t.name.clone(), t.schema.clone()?)))
        .collect();
    let fingerprints = tables
        .into_iter()
        .filter_map(|t| Some((t.name, t.fingerprint?)))
        .collect();
    Ok((fingerprints, schemas))
}

type Pins = (
    HashMap<String, u64>,
    HashMap<String, trellara_common::envelope::RelationSchema>,
);

/// Source and target URLs of a flow, resolved from their references.
pub fn urls(flow: &Flow, index: usize) -> Result<(String, String), FlowError> {
    let source = flow.source.url.resolve(&format!("flows[{index}].source"))?;
    Ok((source, target_url(flow, index)?))
}

/// The first sink's target URL alone: the apply role needs no source
/// credentials.
pub fn target_url(flow: &Flow, index: usize) -> Result<String, FlowError> {
    let sink = flow
        .first_sink()
        .ok_or_else(|| FlowError::Unsupported(flow.name.clone()))?;
    sink_url(flow, index, sink)
}

/// One sink's target URL, resolved from its reference.
pub fn sink_url(
    flow: &Flow,
    index: usize,
    sink: crate::config::SinkRef<'_>,
) -> Result<String, FlowError> {
    Ok(match &sink.target.throwaway {
        // Started when a command first needs it, left running until teardown.
        Some(dir) => crate::throwaway::start(dir, &flow.name)?,
        None => sink.target.url.resolve(&sink.field(index))?,
    })
}

/// Marks the flow's snapshot run failed_recoverable so the next round
/// re-plans it: a new slot, a new consistent LSN, every table copied again.
pub async fn request_reseed(
    flow: &Flow,
    (index, sink): (usize, crate::config::SinkRef<'_>),
    reason: &str,
    config_path: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<(), FlowError> {
    let source_url = flow.source.url.resolve(&format!("flows[{index}].source"))?;
    let target = connect(&sink_url(flow, index, sink)?, "target").await?;
    // A running flow (any role) would stream on past the mark; its lock
    // goes with this session, before the reseed's own round takes it.
    if let Some(holder) = state::lock_flow(&target, &flow.name, Role::Both).await? {
        return Err(FlowError::Busy {
            flow: flow.name.clone(),
            holder,
        });
    }
    let source = connect(&source_url, "source").await?;
    let joins_slot = sink.position.is_some_and(|p| p > 0);
    gate_sink(
        flow,
        (&source_url, &source),
        &target,
        config_path,
        joins_slot,
        progress,
    )
    .await?;
    state::ensure(&target).await?;
    if snapshot::load(&target, &flow.name).await?.is_some() {
        snapshot::transition(
            &target,
            &flow.name,
            SnapshotState::FailedRecoverable,
            Some(reason),
        )
        .await?;
    }
    Ok(())
}

/// Watches the target while the flow applies (`trellara semantics`): runs
/// beside capture and apply on the same log until `applied` turns true.
#[allow(async_fn_in_trait)] // one task; no Send bound needed
pub trait Watch {
    async fn watch(
        &mut self,
        log: &Log<FsStorage>,
        applied: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), FlowError>;
}

/// A watcher lent to a [`Job`], to read what it saw after the run.
impl<W: Watch> Watch for &mut W {
    async fn watch(
        &mut self,
        log: &Log<FsStorage>,
        applied: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), FlowError> {
        (**self).watch(log, applied).await
    }
}

/// No watcher: a plain run.
#[derive(Debug)]
pub struct NoWatch;

impl Watch for NoWatch {
    async fn watch(
        &mut self,
        _: &Log<FsStorage>,
        _: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), FlowError> {
        Ok(())
    }
}

/// How one round goes: a [`Job`] resolved for this round.
#[derive(Debug)]
struct Round<'a> {
    /// [`Role::Both`], or [`Role::Relay`]: capture and publish to the
    /// flow's topic, applying nothing (the apply role is
    /// [`delivery::apply_round`]).
    role: Role,
    /// Keep following until stopped; None: until caught up.
    following: Option<Following>,
    /// The caller holds the log's lock already ([`follow_rounds`], across its
    /// rounds: a teardown between two rounds would be undone by the next).
    locked: bool,
    observe: Option<Observer>,
    /// The flow's target lock, held by the caller on a session of its own
    /// ([`follow_rounds`]); None: the round takes it on its target session.
    target_lock: Option<&'a state::FlowLock>,
}

/// One round with a watcher beside capture and apply. A stop that needs
/// someone (schema drift, a lost slot, a record of another source) is
/// recorded on the target for `status` and `repair plan`; a run that ends
/// well clears it.
async fn watched_round<W: Watch>(
    flow: &Flow,
    (index, config_path): (usize, &str),
    round: Round<'_>,
    watch: &mut W,
    progress: &mut dyn FnMut(&str),
) -> Result<RunReport, FlowError> {
    // A held target lock that is lost ends the round at once, wherever it
    // is (checks, snapshot, capture or apply): another process may have
    // the flow now. What it was applying rolls back with its session; the
    // next round starts from the checkpoint.
    let held = round.target_lock;
    let result = tokio::select! {
        biased;
        () = lock_lost(held) => Err(FlowError::LockLost {
            flow: flow.name.clone(),
        }),
        done = run_round(flow, index, config_path, round, watch, progress) => done,
    };
    if let Err(e) = &result
        && let Some((kind, detail, commands)) = stop_of(e, flow, config_path)
    {
        // Best effort: the caller reports the stop itself either way.
        let recorded = async {
            let (_, target_url) = urls(flow, index)?;
            let target = connect(&target_url, "target").await?;
            if state::present(&target).await? {
                state::record_stop(&target, &flow.name, kind, &detail, &commands).await?;
            }
            Ok::<(), FlowError>(())
        };
        if let Err(err) = recorded.await {
            tracing::warn!(flow = %flow.name, error = %err, "could not record why the flow stopped");
        }
    }
    result
}

/// The durable record of a stop that needs someone: (kind, detail,
/// commands); `None` for a stop that a rerun may get past or that is
/// recorded elsewhere (a quarantine, a refusal that changed nothing).
fn stop_of(
    e: &FlowError,
    flow: &Flow,
    config_path: &str,
) -> Option<(&'static str, String, Vec<String>)> {
    use trellara_external_relay::assembler::AssemblyError;
    let reseed = format!(
        "trellara reseed --config {config_path} --flow {}",
        flow.name
    );
    let first_line =
        |e: &dyn std::fmt::Display| e.to_string().lines().next().unwrap_or_default().to_owned();
    match e {
        FlowError::Capture(capture::CaptureError::Assembly(AssemblyError::SchemaDrift {
            relation,
            pinned,
            found,
        })) => Some((
            "schema_drift",
            format!(
                "schema drift on {relation}: pinned fingerprint {pinned:#018x}, the source now sends {found:#018x}; capture stopped"
            ),
            vec![
                format!("review the DDL on {relation} at the source"),
                reseed,
            ],
        )),
        FlowError::Capture(
            err @ (capture::CaptureError::Invalidated { .. }
            | capture::CaptureError::SlotAhead { .. }
            | capture::CaptureError::NoSlot { .. }),
        ) => Some(("slot", first_line(err), vec![reseed])),
        FlowError::Apply(err @ ApplyError::Foreign { .. }) => Some((
            "foreign_record",
            first_line(err),
            vec![
                "give each flow its own transport.log_dir (and topic) in the config".into(),
                reseed,
            ],
        )),
        _ => None,
    }
}

/// One round of [`watched_round`].
async fn run_round<W: Watch>(
    flow: &Flow,
    index: usize,
    config_path: &str,
    round: Round<'_>,
    watch: &mut W,
    progress: &mut dyn FnMut(&str),
) -> Result<RunReport, FlowError> {
    let Round {
        role,
        following,
        locked,
        observe,
        target_lock,
    } = round;
    let follow = following.is_some();
    let health = |state: FlowState| {
        if let Some(o) = &observe {
            o.health.state(state);
        }
    };
    health(FlowState::Starting);
    let sessions = open_sessions(
        flow,
        index,
        config_path,
        role,
        target_lock.is_some(),
        locked,
        progress,
    )
    .await?;
    let (source_url, source, log_dir) = (&sessions.source_url, &sessions.source, &sessions.log_dir);
    let mut report = RunReport {
        flow: flow.name.clone(),
        ..RunReport::default()
    };
    let boundary = Boundary {
        flow,
        source_url,
        log_dir,
        stop: following.as_ref().map(|f| f.shutdown.clone()),
        follow,
    };
    let mut rejoin_at = None;
    match ensure_boundary(boundary, source, &sessions.target, &health, progress).await? {
        Start::Snapshotted(copied) => {
            report.snapshot = Some(copied);
            health(FlowState::Starting);
        }
        Start::Resumed => {}
        Start::Joined(at) => rejoin_at = Some(at),
        Start::Stopped => return Ok(report),
    }

    // Capture until everything committed before now is durable, however
    // it was committed (crate::horizon).
    let goal = crate::horizon::last_record_end(source).await?;
    // Capture and apply run together on one log: the applier takes what
    // is durable while capture continues, and finishes after capture stops.
    let (log, floor) = open_round_log(flow, role, &sessions, progress).await?;
    let capture_from = CaptureFrom {
        flow,
        index,
        source_url,
        log_dir,
        floor,
        pinned: snapshot_pins(&sessions.target, &flow.name).await?,
        rejoin_at,
    };
    let capture = start_capture(
        capture_from,
        (source, &log),
        (goal, following),
        observe.clone(),
        progress,
    )?;
    let begun = Arc::clone(&capture.begun);
    let mut stage = open_stage(
        flow,
        role,
        sessions.target,
        config_path,
        observe.as_ref(),
        progress,
    )
    .await?;
    let droppable = delivery::Droppable::of(flow);
    let shared = sinks::Shared {
        flow,
        index,
        config_path,
        role,
        source_url,
        log: &log,
        begun: &begun,
        tuning: &TUNING,
        follow,
        droppable: &droppable,
    };
    let first_retries = follow && target_lock.is_some() && flow.sinks().len() > 1;
    // Held at a schema change, the only sink waits for it on its own while
    // capture goes on (the source's WAL follows the log, not the sink).
    let first_holds = follow
        && target_lock.is_some()
        && role == Role::Both
        && matches!(flow.transport, crate::config::Transport::Local { .. });
    let (shared, log, stage_ref, observe_ref) = (&shared, &log, &mut stage, observe.as_ref());
    let (begun, droppable, first_observe) = (&begun, &droppable, observe.clone());
    let apply = move |captured: tokio::sync::watch::Receiver<bool>| {
        let signals = Signals {
            captured: captured.clone(),
            begun,
            observe: observe_ref,
            tuning: &TUNING,
            droppable,
            hooks: &crate::crash::NoCrash,
        };
        let ends = (first_retries, first_holds, captured);
        apply_part(stage_ref, (shared, log), signals, first_observe, ends)
    };
    // Following is capture's to say, once its session streams (external)
    // or the worker connects (native): a worker that never comes is not
    // ready.
    let beside = |ends: round::Ends| async move {
        let (watched, (), others) = tokio::join!(
            watch.watch(log, ends.applied.clone()),
            gauges(flow, source, log, observe_ref, ends.applied),
            sinks::run_others(shared, observe_ref, &ends.captured)
        );
        (watched, others)
    };
    let (captured, applied, (watched, others)) =
        round::drive(|failed| capture.run(failed), apply, beside).await;
    report.sinks = others;
    let ended = Ended {
        captured,
        applied,
        watched,
    };
    finish_round(
        (flow, role, follow, goal),
        (source, stage.target()),
        ended,
        report,
        progress,
    )
    .await
}

/// A round's capture, set up but not started: [`Capture::run`] streams
/// it; `begun` is notified each time it sees a transaction begin.
struct Capture<'a> {
    flow: &'a Flow,
    config: CaptureConfig,
    source: &'a Client,
    log: &'a Log<FsStorage>,
    native: NativeRun<'a>,
    following: Option<Following>,
    goal: Lsn,
    durable: tokio::sync::watch::Receiver<Lsn>,
    begun: Arc<tokio::sync::Notify>,
}

/// Sets up a round's capture from `from` up to `goal` or, following,
/// until it is stopped.
fn start_capture<'a>(
    from: CaptureFrom<'a>,
    (source, log): (&'a Client, &'a Log<FsStorage>),
    (goal, following): (Lsn, Option<Following>),
    observe: Option<Observer>,
    progress: &mut dyn FnMut(&str),
) -> Result<Capture<'a>, FlowError> {
    let (flow, log_dir, floor) = (from.flow, from.log_dir, from.floor);
    let (tx, durable) = tokio::sync::watch::channel(Lsn::ZERO);
    let tx = Arc::new(tx);
    let begun = Arc::new(tokio::sync::Notify::new());
    let config = capture_config(from, &tx, &begun, observe.clone())?;
    progress(&if following.is_some() {
        format!("capture: following slot {} until SIGTERM", flow.slot())
    } else {
        format!("capture: streaming slot {} until {goal}", flow.slot())
    });
    let native = NativeRun {
        log_dir,
        progress: tx,
        begun: Arc::clone(&begun),
        floor,
        observe,
    };
    Ok(Capture {
        flow,
        config,
        source,
        log,
        native,
        following,
        goal,
        durable,
        begun,
    })
}

impl Capture<'_> {
    /// Captures into the log on the flow's capture path until the round's
    /// stop, or as soon as `failed` turns true (the stage beside failed).
    async fn run(
        self,
        failed: tokio::sync::watch::Receiver<bool>,
    ) -> Result<capture::CaptureStats, FlowError> {
        let stop = capture_stop(self.following, self.goal, self.durable, failed);
        match self.flow.capture {
            CapturePath::External => {
                capture::run_on_own_thread(self.config, self.log.clone(), stop)
                    .await
                    .map_err(FlowError::from)
            }
            CapturePath::Native => {
                native_capture(self.flow, self.source, self.log, self.native, stop).await
            }
        }
    }
}

/// The first sink's part of a round: the stage (apply, or the relay
/// role's publishing) on the log until capture ended and it took all.
/// `first_retries`: following with several sinks under the flow's lock
/// this process holds, the first one's failure ends only its own part,
/// which follows again on its own until `captured`. `first_holds`: so
/// does a hold at a schema change, whatever the number of sinks.
async fn apply_part(
    stage: &mut Stage,
    (shared, log): (&sinks::Shared<'_>, &Log<FsStorage>),
    signals: Signals<'_>,
    observe: Option<Observer>,
    (first_retries, first_holds, captured): (bool, bool, tokio::sync::watch::Receiver<bool>),
) -> Result<(ApplyStats, Option<sinks::SinkOutcome>), FlowError> {
    let flow = shared.flow;
    match stage.run(log, &flow.name, signals).await {
        // Capture and the others go on while it retries on its own.
        Err(e) if first_retries || (first_holds && e.held_at().is_some()) => {
            tracing::warn!(flow = %flow.name, error = %crate::errors::chain_of(&e), "the first sink's apply ended; it follows again on its own, the flow's other sinks go on");
            let first = flow
                .first_sink()
                .expect("a flow of several sinks has a first");
            if let Some(at) = e.held_at() {
                // Met again before its release, it would only be counted
                // (and recorded) once more.
                tracing::warn!(flow = %flow.name, "the sink holds at a schema change until it is accepted; capture and the flow's other sinks go on");
                if let Some(o) = &observe {
                    o.health
                        .failed(FlowState::Held, crate::errors::chain_of(&e));
                }
                let url = sink_url(flow, shared.index, first)?;
                if !sinks::released(&url, &flow.name, at, captured.clone()).await {
                    let held = sinks::SinkOutcome {
                        sink: first.name.to_owned(),
                        applied: ApplyStats::default(),
                        seeded: Vec::new(),
                        error: Some(e),
                    };
                    return Ok((ApplyStats::default(), Some(held)));
                }
            }
            let retried = sinks::run(shared, first, observe, captured, true).await;
            Ok((ApplyStats::default(), Some(retried)))
        }
        other => other.map(|stats| (stats, None)),
    }
}

/// What the parts of a round ended with.
struct Ended {
    captured: Result<capture::CaptureStats, FlowError>,
    applied: Result<(ApplyStats, Option<sinks::SinkOutcome>), FlowError>,
    watched: Result<(), FlowError>,
}

/// The round's report from how its parts ended; the flow's own errors
/// come first, the watcher's after them.
async fn finish_round(
    (flow, role, follow, goal): (&Flow, Role, bool, Lsn),
    (source, target): (&Client, &Client),
    ended: Ended,
    mut report: RunReport,
    progress: &mut dyn FnMut(&str),
) -> Result<RunReport, FlowError> {
    let stats = captured_or_failed(flow, target, ended.captured).await?;
    let (applied, retried) = ended.applied?;
    report.apply = applied;
    // The first sink's own session ended with its failure: its retries
    // did its bookkeeping (sequences) on theirs.
    let first_target = match retried {
        Some(retried) => {
            crate::apply::accumulate(&mut report.apply, retried.applied);
            report.sinks.insert(0, retried);
            None
        }
        None => Some(target),
    };
    ended.watched?;
    report.envelopes_captured = stats.envelopes;
    report.capture_duplicates_skipped = stats.duplicates_skipped;
    report.caught_up_to = (!follow).then_some(goal);
    wrap_up(flow, role, (source, first_target), &report, progress).await?;
    // A run that ends at the source's position has not got there for a
    // sink that stopped; a following one says so above and in /healthz.
    let stopped: Vec<&str> = report
        .sinks
        .iter()
        .filter(|s| s.error.is_some())
        .map(|s| s.sink.as_str())
        .collect();
    if !follow && !stopped.is_empty() {
        return Err(FlowError::SinksStopped {
            flow: flow.name.clone(),
            sinks: stopped.join(", "),
        });
    }
    Ok(report)
}

/// The round's log, and the position capture may not confirm the slot
/// below. The relay role of a local log keeps what its apply service, in
/// another process, has not applied: its cursor is there before the first
/// record (an existing one stays).
async fn open_round_log(
    flow: &Flow,
    role: Role,
    sessions: &Sessions,
    progress: &mut dyn FnMut(&str),
) -> Result<(Log<FsStorage>, Lsn), FlowError> {
    let log = open_log(flow, &sessions.log_dir, &sessions.owner, progress)?;
    let several = flow.sinks().len() > 1;
    // Of several sinks, the log the others read decides what the slot may
    // be confirmed past, not the first one's checkpoint (which a copy of
    // its own moves ahead); a new log has only the first sink's copy.
    let floor = if several && log.next_offset() > 0 {
        Lsn::ZERO
    } else {
        checkpoint_floor(&sessions.target, &flow.name).await?
    };
    let followed =
        role == Role::Relay && matches!(flow.transport, crate::config::Transport::Local { .. });
    if (several && log.next_offset() == 0) || followed {
        log.register_consumer(&crate::apply::first_cursor(flow))?;
    }
    forget_removed_sinks(flow, &log, progress);
    Ok((log, floor))
}

/// What a round holds once its checks passed: both sessions, the log
/// directory it owns and (unless its caller holds it) the log's lock.
struct Sessions {
    source_url: String,
    source: Client,
    target: Client,
    owner: crate::identity::LogOwner,
    log_dir: PathBuf,
    _log_lock: Option<crate::lock::LogLock>,
}

/// Connects, takes the target lock (unless `lock_held`), gates the flow
/// through preflight and its identity checks, and locks the log (unless
/// `log_locked`). The target lock comes first, so a refused process reads
/// nothing from the source; the log's owner is checked again under its
/// lock, because the boundary may remove the directory.
async fn open_sessions(
    flow: &Flow,
    index: usize,
    config_path: &str,
    role: Role,
    lock_held: bool,
    log_locked: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<Sessions, FlowError> {
    let log_dir = flow
        .log_dir()
        .ok_or_else(|| FlowError::Unsupported(flow.name.clone()))?
        .to_path_buf();
    let (source_url, target_url) = urls(flow, index)?;
    let target = connect(&target_url, "target").await?;
    // One process per flow on the target, from whichever host; taken
    // before anything else, so a refused process checks, reads and leaves
    // nothing, on either side or on its own host.
    if !lock_held && let Some(holder) = state::lock_flow(&target, &flow.name, role).await? {
        return Err(FlowError::Busy {
            flow: flow.name.clone(),
            holder,
        });
    }
    let source = connect(&source_url, "source").await?;
    // Of several sinks, the first one's target may not have claimed the
    // slot (a sink added in front): the flow's own log proves it is the
    // flow's.
    let joins_slot = flow.sinks().len() > 1 && log_dir.exists();
    gate_sink(
        flow,
        (&source_url, &source),
        &target,
        config_path,
        joins_slot,
        progress,
    )
    .await?;
    let owner = crate::identity::LogOwner::of(flow, &source).await?;
    state::ensure(&target).await?;
    // One writer per log, across processes, for the whole run.
    let _log_lock = if log_locked {
        None
    } else {
        Some(
            crate::lock::lock(&log_dir).map_err(|source| FlowError::LogDir {
                path: log_dir.display().to_string(),
                source,
            })?,
        )
    };
    let source_failed = |source| FlowError::Source {
        url: redact(&source_url),
        source,
    };
    if let Some(refusal) = snapshot::native_refusal(flow, &source)
        .await
        .map_err(source_failed)?
    {
        return Err(FlowError::Native(format!("flow {}: {refusal}", flow.name)));
    }
    // Checked again under the lock: the directory may be removed below.
    crate::identity::check_dir(&log_dir, &owner)?;
    Ok(Sessions {
        source_url,
        source,
        target,
        owner,
        log_dir,
        _log_lock,
    })
}

/// The stage a round's role runs on the log: the applier (with its
/// delivery, the log itself or the topic), or the relay role's publisher.
async fn open_stage(
    flow: &Flow,
    role: Role,
    target: Client,
    config_path: &str,
    observe: Option<&Observer>,
    progress: &mut dyn FnMut(&str),
) -> Result<Stage, FlowError> {
    Ok(if role == Role::Relay {
        let publisher = match flow.transport {
            crate::config::Transport::Kafka { .. } => {
                Some(delivery::open_publisher(flow, progress).await?)
            }
            crate::config::Transport::Local { .. } => None,
        };
        Stage::Publish { publisher, target }
    } else {
        let delivery = Delivery::open(flow, progress).await?;
        // Applying is data work: a row lock held by a target reader is
        // waited for, not a reason to stop the flow.
        target
            .batch_execute("SET statement_timeout = 0")
            .await
            .map_err(FlowError::Target)?;
        let mut applier = Applier::new(target, &flow.name, &flow.source_id(), config_path)
            .with_patience(TUNING.chunk_patience)
            .with_cursor_every(TUNING.cursor_every);
        // Of several sinks the first one's cursor is there by now (the
        // round registered it): a missing one is an error, never a start
        // from the log's beginning.
        applier = if flow.sinks().len() > 1 {
            applier.with_consumer(crate::apply::first_cursor(flow))
        } else {
            applier.with_cursor_name(crate::apply::first_cursor(flow))
        };
        if delivery.opens_ahead() {
            applier = applier.with_open_after_commit();
        }
        if let Some(o) = observe {
            applier = applier.with_metrics(o.metrics.clone());
        }
        Stage::Apply {
            applier: Box::new(applier),
            delivery,
        }
    })
}

/// How a following round is stopped: its shutdown channel, or after
/// `until`.
#[derive(Debug)]
pub(crate) struct Following {
    pub shutdown: Shutdown,
    pub until: Option<Duration>,
}

/// Resolves when capture should stop: once `goal` is durable for a round
/// that runs to a position, when a following round is stopped, or as soon
/// as the stage beside it failed.
pub(crate) async fn capture_stop(
    following: Option<Following>,
    goal: Lsn,
    mut durable: tokio::sync::watch::Receiver<Lsn>,
    mut failed: tokio::sync::watch::Receiver<bool>,
) {
    let stopped = async {
        match following {
            None => {
                let _ = durable.wait_for(|durable| *durable >= goal).await;
            }
            Some(Following {
                mut shutdown,
                until,
            }) => {
                let signal = async {
                    let _ = shutdown.wait_for(|stop| *stop).await;
                };
                match until {
                    Some(until) => {
                        tokio::select! {
                            () = signal => {}
                            () = tokio::time::sleep(until) => {}
                        }
                    }
                    None => signal.await,
                }
            }
        }
    };
    tokio::select! {
        () = stopped => {}
        _ = failed.wait_for(|f| *f) => {}
    }
}

/// What capture ended with. A stream that cannot continue from where the
/// target stands leaves the run recoverable only by a new snapshot
/// (reseed), and says so in its state.
async fn captured_or_failed<T>(
    flow: &Flow,
    target: &Client,
    captured: Result<T, FlowError>,
) -> Result<T, FlowError> {
    match captured {
        Err(FlowError::Capture(
            err @ (capture::CaptureError::Invalidated { .. }
            | capture::CaptureError::SlotAhead { .. }),
        )) => {
            snapshot::transition(
                target,
                &flow.name,
                SnapshotState::FailedRecoverable,
                Some(&crate::errors::chain_of(&err)),
            )
            .await?;
            Err(err.into())
        }
        other => other,
    }
}

/// What a round does with the log capture writes.
enum Stage {
    /// Applies it to the target (through the log or the topic).
    Apply {
        applier: Box<Applier>,
        delivery: Delivery,
    },
    /// The relay role: publishes it to the flow's topic, or (a local log
    /// its apply service follows) only keeps it; the target session stays
    /// for the round's bookkeeping.
    Publish {
        publisher: Option<Publisher>,
        target: Client,
    },
}

impl Stage {
    /// Runs the stage on the log until capture has ended and it has taken
    /// everything durable, or it fails.
    async fn run(
        &mut self,
        log: &Log<FsStorage>,
        flow: &str,
        signals: Signals<'_>,
    ) -> Result<ApplyStats, FlowError> {
        match self {
            Stage::Apply { applier, delivery } => {
                let result = apply_stage(applier, delivery, log, flow, signals).await;
                // Whatever ended the loop, the session is left outside a
                // transaction for what reads the target next.
                applier.close_opened().await;
                Ok(result?)
            }
            Stage::Publish { publisher, .. } => Ok(publish_stage(publisher.as_ref(), log, signals)
                .await
                .map(|()| ApplyStats::default())?),
        }
    }

    /// The target session, for the round's bookkeeping after the stage.
    fn target(&self) -> &Client {
        match self {
            Stage::Apply { applier, .. } => applier.client(),
            Stage::Publish { target, .. } => target,
        }
    }
}

/// Resolves once the held target lock is lost ([`state::FlowLock::lost`]);
/// never without one.
async fn lock_lost(lock: Option<&state::FlowLock>) {
    match lock {
        Some(lock) => lock.lost().await,
        None => std::future::pending().await,
    }
}

/// What capture of one round reads from.
struct CaptureFrom<'a> {
    flow: &'a Flow,
    index: usize,
    source_url: &'a str,
    log_dir: &'a std::path::Path,
    /// The target checkpoint's end LSN.
    floor: Lsn,
    /// The fingerprints (and descriptions) the boundary copied the tables at.
    pinned: Pins,
    /// Where tables joined this round (external capture restarts its
    /// session there: [`crate::capture::CaptureError::Rejoin`]).
    rejoin_at: Option<Lsn>,
}

/// The external capture's configuration for one round.
fn capture_config(
    from: CaptureFrom<'_>,
    progress: &Arc<tokio::sync::watch::Sender<Lsn>>,
    begun: &Arc<tokio::sync::Notify>,
    observe: Option<Observer>,
) -> Result<CaptureConfig, FlowError> {
    let CaptureFrom {
        flow,
        index,
        source_url,
        log_dir,
        floor,
        pinned,
        rejoin_at,
    } = from;
    Ok(CaptureConfig {
        source: source_url.parse().map_err(|e| {
            crate::config::ConfigIssue::new(
                format!("flows[{index}].source"),
                format!("{e}"),
                "use postgresql://user[:password]@host:port/db (or ?host=/socket/dir for a Unix socket)".into(),
            )
        })?,
        slot: flow.slot(),
        publications: vec![flow.publication()],
        create_slot: false,
        source_id: flow.source_id(),
        dataset_id: flow.name.clone(),
        log_dir: log_dir.to_path_buf(),
        proto_version: ProtoVersion::V2,
        memory_budget: TUNING.memory_budget_bytes,
        chunk_bytes: TUNING.chunk_bytes,
        status_interval: TUNING.status_interval,
        max_backoff: TUNING.max_backoff,
        pinned: pinned.0,
        schemas: pinned.1,
        floor,
        progress: Some(Arc::clone(progress)),
        begun: Some(Arc::clone(begun)),
        observe,
        rejoin_at,
        ddl: Some(Arc::new(flow.clone())),
    })
}

/// Opens the flow's log for the round (cutting a torn tail a crash left)
/// and claims it for the flow and source.
fn open_log(
    flow: &Flow,
    log_dir: &std::path::Path,
    owner: &crate::identity::LogOwner,
    progress: &mut dyn FnMut(&str),
) -> Result<Log<FsStorage>, FlowError> {
    let cap = flow.retention_bytes();
    let log_config = LogConfig {
        retention: crate::log::RetentionPolicy {
            max_total_bytes: cap,
            ..crate::log::RetentionPolicy::keep_all()
        },
        // Retention deletes whole sealed segments: a cap of a few of them
        // can be kept to, where one 64 MiB segment could not.
        max_segment_bytes: cap.map_or(LogConfig::default().max_segment_bytes, |cap| {
            (cap / 8).clamp(1 << 20, LogConfig::default().max_segment_bytes)
        }),
        ..LogConfig::default()
    };
    crate::log::sweep_removed(log_dir);
    let (log, report_open) = Log::open(FsStorage::new(), log_dir, log_config)?;
    crate::identity::claim(&log, log_dir, owner)?;
    if let Some(torn) = &report_open.torn_tail {
        progress(&format!(
            "log: cut a torn tail of {} bytes left by a crash",
            torn.truncated_bytes
        ));
    }
    Ok(log)
}

/// The end of a round that went well: its stop record cleared, the
/// sequences brought forward, what it did said.
async fn wrap_up(
    flow: &Flow,
    role: Role,
    (source, target): (&Client, Option<&Client>),
    report: &RunReport,
    progress: &mut dyn FnMut(&str),
) -> Result<(), FlowError> {
    if let Some(target) = target {
        state::clear_stop(target, &flow.name).await?;
        // pgoutput carries no sequences: a cutover must not reuse a key.
        match crate::sequences::bring_forward(flow, source, target).await {
            Ok(moved) => moved.iter().for_each(|m| progress(m)),
            Err(e) => progress(&format!(
                "warning: the flow's sequences were not brought forward on the target: {}\nhint: grant the source role SELECT on them",
                e.as_db_error()
                    .map_or_else(|| e.to_string(), |d| d.message().to_owned())
            )),
        }
    }
    if role == Role::Relay {
        // The relay role applies nothing: the apply service does.
        let kept = match &flow.transport {
            crate::config::Transport::Kafka { topic, .. } => format!("published to topic {topic}"),
            crate::config::Transport::Local { log_dir, .. } => {
                format!("kept in the log {}", log_dir.display())
            }
        };
        progress(&format!(
            "captured {} transactions; {kept} for the apply service",
            report.envelopes_captured
        ));
        return Ok(());
    }
    progress(&format!(
        "captured {} transactions; applied {} ({} rows), {} duplicates skipped",
        report.envelopes_captured,
        report.apply.transactions,
        report.apply.rows,
        report.apply.duplicates_skipped
    ));
    for sink in &report.sinks {
        progress(&match &sink.error {
            None => format!(
                "sink {}: applied {} ({} rows), {} duplicates skipped",
                sink.sink,
                sink.applied.transactions,
                sink.applied.rows,
                sink.applied.duplicates_skipped
            ),
            Some(e) => format!(
                "sink {}: stopped after {} transactions: {}",
                sink.sink,
                sink.applied.transactions,
                crate::errors::chain_of(e)
            ),
        });
    }
    Ok(())
}

/// Where a round starts its stream from.
struct Boundary<'a> {
    flow: &'a Flow,
    source_url: &'a str,
    log_dir: &'a std::path::Path,
    /// Following: a signal stops a long copy too.
    stop: Option<tokio::sync::watch::Receiver<bool>>,
    follow: bool,
}

/// How a round's stream starts.
enum Start {
    /// From a new boundary, just copied.
    Snapshotted(SnapshotReport),
    /// From the boundary the target has.
    Resumed,
    /// From the boundary the target has, with tables joined at `0`: the
    /// publication changed this round.
    Joined(Lsn),
    /// A signal stopped the copy while following: the round ends.
    Stopped,
}

/// Takes a new snapshot when the flow has no boundary to stream from;
/// otherwise copies the tables that joined the flow since at a boundary of
/// their own, and lets go of those that left it.
async fn ensure_boundary(
    boundary: Boundary<'_>,
    source: &Client,
    target: &Client,
    health: &dyn Fn(FlowState),
    progress: &mut dyn FnMut(&str),
) -> Result<Start, FlowError> {
    let Boundary {
        flow,
        source_url,
        log_dir,
        stop,
        follow,
    } = boundary;
    let current = snapshot::load(target, &flow.name).await?;
    let mut needs = snapshot::needs_snapshot(current.as_ref().map(|r| r.state));
    // Of several sinks, the log the others read, opened once to judge the
    // first sink's copy by (and to place its cursor).
    let shared_log = if flow.sinks().len() > 1 && log_dir.exists() {
        Some(Log::open(FsStorage::new(), log_dir, LogConfig::default())?.0)
    } else {
        None
    };
    let first = crate::apply::first_cursor(flow);
    // The first sink's cursor gone from a log that has records (dropped,
    // or the sinks reordered): it cannot resume.
    let first_lost = shared_log
        .as_ref()
        .is_some_and(|log| log.next_offset() > 0 && log.cursor(&first).is_none());
    if (needs || first_lost)
        && let Some(log) = &shared_log
        && keeps_slot(flow, (source_url, source), target, log).await?
    {
        // One sink of several is copied again: the others stream on from
        // the flow's slot and log, so neither is replaced. Its cursor is
        // at the log's end before the boundary is taken.
        log.register_consumer_at_end(&first)?;
        drop(shared_log);
        health(FlowState::Snapshotting);
        progress(&format!(
            "snapshot: sink {} is copied again at a boundary of its own; the flow's slot and log stay for its other sinks",
            flow.first_sink().map_or("?", |s| s.name)
        ));
        return match snapshot::seed_sink(flow, source_url, source, target, progress, stop).await {
            Ok(copied) => Ok(Start::Snapshotted(copied)),
            Err(e @ snapshot::SnapshotError::Stopped) if follow => {
                progress(&e.to_string());
                Ok(Start::Stopped)
            }
            Err(e) => Err(e.into()),
        };
    }
    // Closed before the round opens it, or a full snapshot removes it.
    drop(shared_log);
    needs |= first_lost;
    if needs {
        progress(&format!(
            "snapshot: {}",
            current.map_or("first run".to_owned(), |r| format!(
                "previous run was {}, re-planning",
                r.state.as_str()
            ))
        ));
        // A long copy stops at a signal too; the next run plans it again
        // (an interrupted snapshot never resumes at its boundary).
        health(FlowState::Snapshotting);
        match snapshot::run(flow, (source_url, log_dir), source, target, progress, stop).await {
            Ok(copied) => Ok(Start::Snapshotted(copied)),
            // Following, a stop is the end asked for; a run that was to
            // end at the source's position did not get there: an error.
            Err(e @ snapshot::SnapshotError::Stopped) if follow => {
                progress(&e.to_string());
                Ok(Start::Stopped)
            }
            Err(e) => Err(e.into()),
        }
    } else {
        let joining = Boundary {
            flow,
            source_url,
            log_dir,
            stop,
            follow,
        };
        joins_and_leaves(joining, source, target, health, progress).await
    }
}

/// Drops the cursors of sinks no longer in the config (removed or
/// renamed), which would hold the log for ever; a sink added back is
/// copied again at a boundary of its own.
fn forget_removed_sinks(flow: &Flow, log: &Log<FsStorage>, progress: &mut dyn FnMut(&str)) {
    let sinks: Vec<String> = flow
        .sinks()
        .iter()
        .map(|s| crate::apply::sink_cursor(&flow.name, s.name))
        .collect();
    let own = crate::apply::cursor_name(&flow.name);
    for (cursor, _) in log.cursors() {
        let a_sink = cursor.starts_with("sink-") || cursor == own;
        if a_sink && !sinks.contains(&cursor) {
            match log.unregister_consumer(&cursor) {
                Ok(()) => progress(&format!(
                    "log: dropped cursor {cursor}: its sink is no longer in the config"
                )),
                Err(e) => progress(&format!("log: could not drop cursor {cursor}: {e}")),
            }
        }
    }
}

/// Whether a flow of several sinks can copy its first sink again without
/// a new slot, so the other sinks' positions in `log` hold: the log's
/// owner was checked under its lock, the slot is on the
/// source, not invalidated and confirmed no further than the log has
/// acknowledged, and no stop (a schema drift, a lost slot) waits on the
/// first target. Anything else needs a new stream for every sink.
async fn keeps_slot(
    flow: &Flow,
    (source_url, source): (&str, &Client),
    target: &Client,
    log: &Log<FsStorage>,
) -> Result<bool, FlowError> {
    if state::stop(target, &flow.name).await?.is_some() {
        return Ok(false);
    }
    // What capture resumes from: the last whole transaction's end, or an
    // idle advance recorded past it.
    let acked = crate::capture::read_resume(log)?.ack_lsn;
    if !acked.is_valid() {
        return Ok(false);
    }
    let acked = acked.0;
    // invalidation_reason exists from PostgreSQL 17 on; wal_status 'lost'
    // says the same before it.
    let slot = source
        .query_opt(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::int8, wal_status = 'lost' OR to_jsonb(s) ->> 'invalidation_reason' IS NOT NULL
             FROM pg_replication_slots s WHERE slot_name = $1 AND database = current_database()",
            &[&flow.slot()],
        )
        .await
        .map_err(|source| FlowError::Source {
            url: redact(source_url),
            source,
        })?;
    Ok(slot.is_some_and(|row| {
        let confirmed: Option<i64> = row.get(0);
        let lost: Option<bool> = row.get(1);
        lost != Some(true) && confirmed.is_some_and(|c| u64::try_from(c).is_ok_and(|c| c <= acked))
    }))
}

/// On a target with a boundary: copies the tables that joined the flow
/// since at a boundary of their own, and lets go of those that left it.
async fn joins_and_leaves(
    boundary: Boundary<'_>,
    source: &Client,
    target: &Client,
    health: &dyn Fn(FlowState),
    progress: &mut dyn FnMut(&str),
) -> Result<Start, FlowError> {
    let Boundary {
        flow,
        source_url,
        stop,
        follow,
        ..
    } = boundary;
    let copied: Vec<String> = crate::state::runs::tables(target, &flow.name)
        .await?
        .into_iter()
        .map(|t| t.name)
        .collect();
    let left: Vec<&String> = copied.iter().filter(|t| !flow.tables.contains(t)).collect();
    for table in left {
        let note = snapshot::leave(flow, source, target, table).await?;
        progress(&format!("{table} left the flow: {note}"));
    }
    let joined: Vec<String> = flow
        .tables
        .iter()
        .filter(|t| !copied.contains(t))
        .cloned()
        .collect();
    if joined.is_empty() {
        return Ok(Start::Resumed);
    }
    health(FlowState::Snapshotting);
    match snapshot::join(flow, source_url, source, target, &joined, progress, stop).await {
        Ok(at) => {
            progress(&format!(
                "{} joined the flow at {at}; their changes before it are in their copy",
                joined.join(", ")
            ));
            Ok(Start::Joined(at))
        }
        Err(e @ snapshot::SnapshotError::Stopped) if follow => {
            progress(&e.to_string());
            Ok(Start::Stopped)
        }
        Err(e) => Err(e.into()),
    }
}

/// The end LSN of the target's checkpoint of `flow` (zero without one):
/// capture's floor.
async fn checkpoint_floor(target: &Client, flow: &str) -> Result<Lsn, FlowError> {
    Ok(crate::state::checkpoint::read(target, flow)
        .await?
        .map_or(Lsn::ZERO, |c| c.end_lsn))
}

/// The native capture path for one run: the extension's worker on the
/// source decodes the flow's slot and sends frames to a relay listening on
/// `<log_dir>.sock` in this process, which appends them to `log`. Sets the
/// worker up through SQL (extension, settings, start) and stops it at the
/// end, so the slot is free again. This process must run as the source
/// server's OS user (the socket admits only that uid).
/// What the native capture of one run needs besides the flow and log.
struct NativeRun<'a> {
    log_dir: &'a std::path::Path,
    progress: Arc<tokio::sync::watch::Sender<Lsn>>,
    begun: Arc<tokio::sync::Notify>,
    /// The target checkpoint's end LSN ([`crate::native::NativeConfig::floor`]).
    floor: Lsn,
    observe: Option<Observer>,
}

async fn native_capture(
    flow: &Flow,
    source: &Client,
    log: &Log<FsStorage>,
    run: NativeRun<'_>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<capture::CaptureStats, FlowError> {
    let NativeRun {
        log_dir,
        progress,
        begun,
        floor,
        observe,
    } = run;
    let socket = set_up_worker(flow, source, log_dir).await?;
    let progress_rx = progress.subscribe();
    let config = crate::native::NativeConfig {
        socket_path: socket,
        log_dir: log_dir.to_path_buf(),
        source_id: flow.source_id(),
        max_envelope_bytes: 256 << 20,
        progress: Some(progress),
        begun: Some(begun),
        floor,
        observe,
        // run claimed the log when it opened it.
        owner: None,
    };
    let serve = crate::native::serve_on(config, log, stop);
    let start = async {
        // A worker left by an interrupted run may be decoding with old
        // settings: replace it.
        source
            .batch_execute("SELECT trellara.stop_worker(); SELECT trellara.start_worker()")
            .await
            .map_err(|e| native_sql_error("trellara.start_worker()", e))
    };
    let mut serve = std::pin::pin!(serve);
    // The socket is bound on serve's first poll, before the worker starts
    // (which retries with backoff anyway). A bind refusal ends serve first.
    let early = tokio::select! {
        served = &mut serve => Some(served),
        started = start => {
            started?;
            None
        }
    };
    let served = match early {
        Some(served) => served,
        None => tokio::select! {
            served = serve => served,
            failed = watch_worker(source) => {
                let _ = source.batch_execute("SELECT trellara.stop_worker()").await;
                return failed;
            }
        },
    };
    // The last Ack is on its way to the worker: let it confirm the slot
    // before stopping it, so the slot ends where the log does.
    let durable = progress_rx.borrow().0;
    slot_confirmed(source, &flow.slot(), durable).await;
    let stopped = source
        .batch_execute("SELECT trellara.stop_worker()")
        .await
        .map_err(|e| native_sql_error("trellara.stop_worker()", e));
    let stats = served?;
    stopped?;
    Ok(capture::CaptureStats {
        envelopes: stats.envelopes,
        duplicates_skipped: stats.duplicates_skipped,
        reconnects: stats.connections.saturating_sub(1),
    })
}

fn native_sql_error(what: &str, e: tokio_postgres::Error) -> FlowError {
    FlowError::Native(format!(
        "capture: native: {what} on the source: {}",
        e.as_db_error()
            .map_or(e.to_string(), |d| d.message().to_owned())
    ))
}

/// Checks the extension is preloaded and points its worker at this flow
/// (extension, settings, reload); the socket path it was given.
async fn set_up_worker(flow: &Flow, source: &Client, log_dir: &Path) -> Result<PathBuf, FlowError> {
    let preload: String = source
        .query_one("SHOW shared_preload_libraries", &[])
        .await
        .map_err(|e| native_sql_error("SHOW shared_preload_libraries", e))?
        .get(0);
    if !preload
        .split(',')
        .any(|l| l.trim().trim_matches('"') == "trellara")
    {
        return Err(FlowError::Native(format!(
            "capture: native needs shared_preload_libraries to include 'trellara' on the source (it is {preload:?})\nhint: set shared_preload_libraries = 'trellara' and restart the source, or use capture: external"
        )));
    }
    // The server resolves the path from its data directory: make it absolute.
    let socket = std::path::absolute(log_dir)
        .map_err(|source| FlowError::LogDir {
            path: log_dir.display().to_string(),
            source,
        })?
        .with_extension("sock");
    let literal = postgres_protocol::escape::escape_literal;
    let setup = [
        "CREATE EXTENSION IF NOT EXISTS trellara".to_owned(),
        format!("ALTER SYSTEM SET trellara.slot = {}", literal(&flow.slot())),
        format!(
            "ALTER SYSTEM SET trellara.source_id = {}",
            literal(&flow.source_id())
        ),
        format!(
            "ALTER SYSTEM SET trellara.dataset_id = {}",
            literal(&flow.name)
        ),
        format!(
            "ALTER SYSTEM SET trellara.socket_path = {}",
            literal(&socket.display().to_string())
        ),
        format!(
            "ALTER SYSTEM SET trellara.tables = {}",
            literal(&flow.tables.join(","))
        ),
        "SELECT pg_reload_conf()".to_owned(),
    ];
    for statement in &setup {
        source
            .batch_execute(statement)
            .await
            .map_err(|e| native_sql_error(statement, e))?;
    }
    Ok(socket)
}

/// The worker reports trouble through trellara.status(); a run must fail
/// with that reason, not wait for progress that cannot come. Resolves only
/// with that failure.
async fn watch_worker(source: &Client) -> Result<capture::CaptureStats, FlowError> {
    let mut waiting_since: Option<std::time::Instant> = None;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let row = source
            .query_one(
                "SELECT state, coalesce(reason, '') FROM trellara.status()",
                &[],
            )
            .await
            .map_err(|e| native_sql_error("trellara.status()", e))?;
        let (state, reason): (String, String) = (row.get(0), row.get(1));
        match state.as_str() {
            "failed_closed" => {
                return Err(FlowError::Native(format!(
                    "capture: native: the worker failed closed: {reason}"
                )));
            }
            "waiting_for_relay" | "not_running" | "stopped" => {
                let since = *waiting_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > NATIVE_WORKER_PATIENCE {
                    return Err(FlowError::Native(format!(
                        "capture: native: the worker has not been streaming for {} s (state {state}: {reason})\nhint: see trellara.status() and the source's server log",
                        NATIVE_WORKER_PATIENCE.as_secs()
                    )));
                }
            }
            _ => waiting_since = None,
        }
    }
}

/// Waits, a few seconds at most, for the slot's confirmed position to
/// reach `durable`.
async fn slot_confirmed(source: &Client, slot: &str, durable: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        let confirmed: Option<String> = source
            .query_opt(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .ok()
            .flatten()
            .and_then(|r| r.get(0));
        if confirmed
            .and_then(|c| c.parse::<Lsn>().ok())
            .is_some_and(|c| c.0 >= durable)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long the native worker may be away from streaming before a run
/// gives up with its reason.
const NATIVE_WORKER_PATIENCE: Duration = Duration::from_secs(30);

/// Reads the gauges every [`TUNING.gauges_every`] until `applied` turns true (the
/// applier ended). A failed read leaves the last value and is logged: a
/// gauge never stops a flow.
async fn gauges(
    flow: &Flow,
    source: &Client,
    log: &Log<FsStorage>,
    observe: Option<&Observer>,
    mut applied: tokio::sync::watch::Receiver<bool>,
) {
    let Some(metrics) = observe.map(|o| &o.metrics) else {
        return;
    };
    let slot = flow.slot();
    loop {
        metrics.log_bytes.set(
            i64::try_from(log.segments().iter().map(|s| s.bytes).sum::<u64>()).unwrap_or(i64::MAX),
        );
        // On a standby pg_current_wal_lsn() fails; its replay position is
        // the WAL it has.
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&slot];
        let query = source.query_opt(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END - restart_lsn)::int8 FROM pg_replication_slots WHERE slot_name = $1",
            &params,
        );
        // A source that stops answering neither holds the round's end nor
        // piles up reads: one at a time, each bounded.
        let retained = tokio::select! {
            read = tokio::time::timeout(TUNING.gauges_every * 5, query) => read,
            _ = applied.wait_for(|done| *done) => return,
        };
        match retained {
            Ok(Ok(Some(row))) => metrics
                .slot_wal
                .set(row.get::<_, Option<i64>>(0).unwrap_or(0).max(0)),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => {
                tracing::warn!(flow = %flow.name, error = %e, "could not read the WAL the slot retains")
            }
            Err(_) => {
                tracing::warn!(flow = %flow.name, "the source did not say the WAL the slot retains within {} s", (TUNING.gauges_every * 5).as_secs())
            }
        }
        tokio::select! {
            () = tokio::time::sleep(TUNING.gauges_every) => {}
            _ = applied.wait_for(|done| *done) => return,
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn until_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::TransportError;

    #[test]
    fn a_failed_source_query_names_the_source_not_a_connect() {
        let e = FlowError::Source {
            url: redact("postgresql://app:s3cret@db.example:5432/shop"),
            source: "port=notaport"
                .parse::<tokio_postgres::Config>()
                .expect_err("not a port"),
        };
        let text = crate::errors::chain_of(&e);
        assert!(
            text.starts_with("source database (postgresql://app:")
                && text.contains("db.example")
                && !text.contains("s3cret")
                && !text.contains("connect to"),
            "{text}"
        );
    }

    #[test]
    fn a_replaced_log_is_retried_however_deep_it_is_wrapped() {
        let replaced = || crate::log::Error::Replaced {
            dir: PathBuf::from("/var/lib/trellara/orders"),
        };
        for e in [
            FlowError::Log(replaced()),
            FlowError::Apply(ApplyError::Log(replaced())),
            FlowError::Apply(ApplyError::Transport(TransportError::Log(replaced()))),
        ] {
            assert!(e.retryable(), "{e:?}");
        }
        // Records the relay had called durable are gone: no retry finds them.
        let back = crate::log::Error::WatermarkBack {
            dir: PathBuf::from("/var/lib/trellara/orders"),
            seen: 10,
            now: 4,
        };
        let e = FlowError::Apply(ApplyError::Transport(TransportError::Log(back)));
        assert!(!e.retryable(), "{e:?}");
    }
}
