//! The LSN fence: how `trellara verify` reads a flow that is following
//! (`run --follow`, or the relay and apply services) at one source
//! position L without stopping capture.
//!
//! ```text
//!  verify                                   applier (another process)
//!  fence lock (target, session) ─┐
//!  H = pg_current_wal_lsn()      │
//!  fence_lsn = H ───────────────────────▶ applies only commits < H
//!  temporary slot, exported snapshot: L, source snapshot at L
//!  fence_lsn = L ───────────────────────▶ applies only commits < L, holds
//!  slot confirmed past L: the log holds every commit < L
//!  checkpoint = last commit < L in the log ◀── (applied)
//!  target snapshot (REPEATABLE READ)
//!  fence lock released ─────────────────▶ goes on
//!  compare both snapshots
//! ```
//!
//! Invariants:
//! * The applier never passes L, before L is known too: every source
//!   transaction it applied before the first fence committed before the
//!   slot's creation began, so below L; after it, nothing at or past H
//!   (read before the creation, so at most L).
//! * Both snapshots are at L: the source's is the slot's own (a snapshot
//!   read beside a separately read LSN is not: visibility order is not WAL
//!   order), the target's is taken once the applier applied exactly every
//!   transaction committing before L and holds there. The snapshot
//!   handoff's rule is the fence's: a commit record starting at L is not in
//!   the slot's snapshot, so it is held.
//! * Bounded and safe. Every wait has the fence's deadline, and on any
//!   error or timeout the fence is released before verify answers. The
//!   hold is the fence lock of verify's target session, so a verify that
//!   dies releases it; the temporary slot ends with its session and is
//!   dropped as soon as the source snapshot is imported.

use crate::config::Flow;
use crate::log::{Log, LogConfig};
use std::path::Path;
use std::time::Duration;
use tokio::time::Instant;
use tokio_postgres::Client;
use trellara_common::Lsn;
use trellara_external_relay::pgwire::{self, ConnectOptions, Connection};

/// How often an applier held at a fence looks whether it moved.
pub const HELD_POLL: Duration = Duration::from_millis(5);
/// How often verify looks whether capture and the applier reached L.
const STEP_POLL: Duration = Duration::from_millis(5);
/// How long clearing a released fence waits for the checkpoint row.
const FORGET_PATIENCE: Duration = Duration::from_secs(5);
/// How long a fence may take unless verify is told otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error(
        "flow {flow}: another verify or one-table reseed holds the flow's fence on this target\nhint: wait for it to finish, then run this command again"
    )]
    Busy { flow: String },
    #[error(
        "flow {flow} has no checkpoint on the target (its snapshot was not handed off yet), so no applier follows it to hold\nhint: wait until `trellara status --flow {flow}` shows the flow streaming, then run this command again"
    )]
    NoCheckpoint { flow: String },
    #[error(
        "flow {flow}: the fence was given up after {secs} s: {waiting}; the flow's apply goes on, nothing was compared or copied\nhint: {hint}"
    )]
    TimedOut {
        flow: String,
        secs: u64,
        waiting: String,
        hint: String,
    },
    #[error(
        "flow {flow}: the target's checkpoint {applied} is at or past the fence {at}, so the applier did not hold; nothing was compared or copied\nhint: an applier of an older trellara build ignores the fence: upgrade every process of the flow, then run this command again"
    )]
    Passed { flow: String, applied: Lsn, at: Lsn },
    #[error("fence: the source database")]
    Source(#[source] tokio_postgres::Error),
    #[error("fence: the target database")]
    Target(#[source] tokio_postgres::Error),
    #[error("fence: the source's replication session")]
    Replication(#[from] pgwire::WireError),
    #[error("fence: the source URL for a replication session: {0}")]
    Url(String),
    #[error("fence: the source exported no snapshot for the temporary slot")]
    NoSnapshot,
    #[error("fence: read the flow's log")]
    Log(#[from] crate::log::Error),
}

/// Where a fenced verify compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fence {
    /// L: both snapshots hold exactly the transactions committing before it.
    pub at: Lsn,
    /// The target's checkpoint in its snapshot: the last of them applied.
    pub applied: Option<Lsn>,
    /// How long the applier was held (from the first fence to the release).
    pub held: Duration,
}

/// Takes both sides' snapshots at one position. On `Ok`, `source` and
/// `target` are each inside a `REPEATABLE READ READ ONLY` transaction at
/// [`Fence::at`], which the caller ends (then [`forget`]s the fence); the
/// applier was released. On
/// `Err`, neither is in a transaction and the applier was released.
/// `cursor`: the sink's log cursor in `log_dir`, from which the log is
/// read for the last transaction before L.
pub async fn take(
    flow: &Flow,
    log: (&Path, &str),
    sides: (&str, &Client, &Client),
    timeout: Duration,
) -> Result<Fence, FenceError> {
    let target = sides.2;
    let (at, applied, held) = hold_apply(flow, log, sides, timeout, async |at| {
        target
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await
            .map_err(FenceError::Target)?;
        // The snapshot is taken here: this is what the comparison sees.
        not_passed(target, &flow.name, at).await
    })
    .await?;
    Ok(Fence { at, applied, held })
}

/// Holds the flow's applier at L (the one position both sides are then
/// at: the source's snapshot, imported in `source` inside a `REPEATABLE
/// READ READ ONLY` transaction, and the target's applied commits) and runs
/// `at_hold(L)` while it holds; then releases it. The deadline covers
/// reaching the hold, not `at_hold`. Returns L, what `at_hold` returned
/// and how long the applier was held. On `Err`, neither session is left in
/// a transaction.
pub async fn hold_apply<T, E: From<FenceError>>(
    flow: &Flow,
    (log_dir, cursor): (&Path, &str),
    (source_url, source, target): (&str, &Client, &Client),
    timeout: Duration,
    at_hold: impl AsyncFnOnce(Lsn) -> Result<T, E>,
) -> Result<(Lsn, T, Duration), E> {
    let name = &flow.name;
    if !crate::state::fence::hold(target, name)
        .await
        .map_err(FenceError::Target)?
    {
        return Err(FenceError::Busy { flow: name.clone() }.into());
    }
    let started = Instant::now();
    let steps = Steps {
        flow,
        deadline: started + timeout,
        timeout,
    };
    let taken = match steps
        .run((log_dir, cursor), (source_url, source, target))
        .await
    {
        Ok(at) => at_hold(at).await.map(|done| (at, done)),
        Err(e) => Err(e.into()),
    };
    // Whatever happened, the applier goes on; a session gone releases it
    // on its own. A failed step's transaction is rolled back first: the
    // unlock cannot run in an aborted one, and nothing uncommitted is left
    // when the applier moves.
    if taken.is_err() {
        let _ = target.batch_execute("ROLLBACK").await;
    }
    if let Err(e) = crate::state::fence::release(target, name).await {
        tracing::warn!(flow = %name, error = %crate::errors::Chain(&e), "the fence was not released: the applier holds until this session ends");
    }
    let held = started.elapsed();
    match taken {
        Ok((at, done)) => Ok((at, done, held)),
        Err(e) => {
            let _ = crate::state::fence::clear(target, name, FORGET_PATIENCE).await;
            // Last: it may wait for the rest of a COPY the target left.
            let _ = source.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

/// The target's checkpoint, checked to be before the fence `at`: an
/// applier that passed it did not hold, and nothing read at it is at L.
pub async fn not_passed(target: &Client, flow: &str, at: Lsn) -> Result<Option<Lsn>, FenceError> {
    let applied = crate::state::checkpoint::applied(target, flow)
        .await
        .map_err(FenceError::Target)?;
    match applied.filter(|a| *a >= at) {
        Some(applied) => Err(FenceError::Passed {
            flow: flow.to_owned(),
            applied,
            at,
        }),
        None => Ok(applied),
    }
}

/// The log of `flow` when a running process holds it, or an applier
/// applies it (the apply service goes on while its relay is down), and the
/// fence can reach that applier through it (the local transport: an
/// applier reading a Kafka topic has no position record to be held at).
pub async fn followed_log<'f>(
    flow: &'f Flow,
    target: &Client,
) -> Result<Option<&'f Path>, Following> {
    let Some(dir) = flow.log_dir().filter(|d| d.exists()) else {
        return Ok(None);
    };
    if matches!(flow.transport, crate::config::Transport::Kafka { .. }) {
        return Ok(None);
    }
    let held = crate::lock::try_lock(dir)
        .map_err(|source| Following::LogLock {
            path: dir.display().to_string(),
            source,
        })?
        .is_none();
    let applying = held
        || crate::state::applying(target, &flow.name)
            .await
            .map_err(Following::Target)?;
    Ok(applying.then_some(dir))
}

/// Why [`followed_log`] could not tell.
#[derive(Debug, thiserror::Error)]
pub enum Following {
    #[error("lock the log directory {path} to read it\nhint: check that this user may write there")]
    LogLock {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("ask the target whether the flow's applier runs")]
    Target(#[source] tokio_postgres::Error),
}

/// Clears the released fence's row once the caller's snapshot ended, so
/// the applier's lock stops looking for its holder. Best effort: a fence
/// left there holds nothing.
pub async fn forget(target: &Client, flow: &Flow) {
    if let Err(e) = crate::state::fence::clear(target, &flow.name, FORGET_PATIENCE).await {
        tracing::warn!(flow = %flow.name, error = %crate::errors::Chain(&e), "the released fence was not cleared from trellara.checkpoints");
    }
}

/// One fence's steps under its deadline.
struct Steps<'a> {
    flow: &'a Flow,
    deadline: Instant,
    timeout: Duration,
}

impl Steps<'_> {
    /// L, once the applier applied every commit before it and holds.
    async fn run(
        &self,
        (log_dir, cursor): (&Path, &str),
        (source_url, source, target): (&str, &Client, &Client),
    ) -> Result<Lsn, FenceError> {
        let hold_at: Lsn = source
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .map_err(FenceError::Source)?
            .get::<_, String>(0)
            .parse()
            .map_err(|_| FenceError::Url("pg_current_wal_lsn() is not an LSN".into()))?;
        self.set(target, hold_at).await?;
        let at = self.source_snapshot(source_url, source).await?;
        self.set(target, at).await?;
        let expected = self.last_below(log_dir, cursor, source, at).await?;
        self.applied_through(target, expected, at).await?;
        Ok(at)
    }

    fn timed_out(&self, waiting: String, hint: &str) -> FenceError {
        FenceError::TimedOut {
            flow: self.flow.name.clone(),
            secs: self.timeout.as_secs(),
            waiting,
            hint: hint.to_owned(),
        }
    }

    /// Moves the fence; the update waits for the applier's open
    /// transaction, under the deadline.
    async fn set(&self, target: &Client, at: Lsn) -> Result<(), FenceError> {
        let patience = self.deadline.saturating_duration_since(Instant::now());
        match crate::state::fence::set(target, &self.flow.name, at, patience).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(FenceError::NoCheckpoint {
                flow: self.flow.name.clone(),
            }),
            Err(e) if e.code() != Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                Err(FenceError::Target(e))
            }
            // Its lock timeout: the fence's deadline.
            Err(_) => Err(self.timed_out(
                "the flow's checkpoint row stayed locked on the target".into(),
                "a long target transaction holds trellara.checkpoints: see pg_stat_activity on the target",
            )),
        }
    }

    /// Creates a temporary slot exporting its snapshot, imports it into
    /// `source` and drops the slot; its consistent point.
    async fn source_snapshot(&self, source_url: &str, source: &Client) -> Result<Lsn, FenceError> {
        let mut options: ConnectOptions = source_url
            .parse()
            .map_err(|e: pgwire::WireError| FenceError::Url(e.to_string()))?;
        options.replication = true;
        let mut repl = Connection::connect(&options).await?;
        let pid = repl.backend_pid();
        let slot = format!("trellara_fence_{pid}");
        // It waits for every transaction with an xid running now to end,
        // prepared ones included.
        let created = match tokio::time::timeout_at(
            self.deadline,
            repl.create_temporary_slot(&slot),
        )
        .await
        {
            Ok(created) => created?,
            Err(_) => {
                let waiting = crate::snapshot::blocking_transactions(source, pid).await;
                // Not left waiting on the server: it would create the
                // slot once they end.
                let _ = source
                    .execute("SELECT pg_cancel_backend($1)", &[&pid])
                    .await;
                return Err(self.timed_out(
                        format!("creating the fence's temporary slot waited for: {waiting}"),
                        "let these transactions finish (COMMIT PREPARED / ROLLBACK PREPARED a prepared one), or give the command longer with --fence-timeout",
                    ));
            }
        };
        let snapshot = created.snapshot_name.ok_or(FenceError::NoSnapshot)?;
        source
            .batch_execute(&format!(
                "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT {}",
                pgwire::quote_literal(&snapshot)
            ))
            .await
            .map_err(FenceError::Source)?;
        // Imported: the slot and its session are no longer needed.
        drop(repl);
        Ok(created.consistent_point)
    }

    /// The commit LSN of the last transaction before `at` in the log past
    /// the sink's cursor (everything before the cursor is applied), once
    /// the log holds every one of them durably: it holds a record
    /// committing at or past `at` (they come in commit order), or capture
    /// recorded an idle position past it (the source-ack cursor), or the
    /// slot is confirmed past it (capture acknowledges only what its log
    /// holds durably). None when there is none past the cursor.
    async fn last_below(
        &self,
        log_dir: &Path,
        cursor: &str,
        source: &Client,
        at: Lsn,
    ) -> Result<Option<Lsn>, FenceError> {
        // A follower whose capture has not started yet (its snapshot just
        // handed off) opens the log in a moment.
        let log = loop {
            match Log::follow(log_dir, LogConfig::default()) {
                Ok(log) => break log,
                Err(crate::log::Error::NotWritten { .. }) if Instant::now() < self.deadline => {
                    tokio::time::sleep(STEP_POLL).await;
                }
                Err(crate::log::Error::NotWritten { .. }) => {
                    return Err(self.timed_out(
                        "the flow's capture did not open its log".into(),
                        "is the flow's capture running? `trellara status` shows it",
                    ));
                }
                Err(e) => return Err(e.into()),
            }
        };
        let mut next = log
            .cursor(cursor)
            .map_or(log.first_offset(), |c| c.next_offset);
        let mut last = None;
        let mut captured = false;
        loop {
            log.refresh()?;
            // Behind the first record, every consumer is past (retention
            // deleted it); ahead of the durable end, the cursor of an
            // applier that reads what is written moved first.
            next = next.max(log.first_offset());
            let readable = if next < log.next_offset() {
                Some(log.read_from(next)?)
            } else {
                None
            };
            for record in readable.into_iter().flatten() {
                let record = record?;
                if Lsn(record.commit_lsn) >= at {
                    return Ok(last);
                }
                next = record.offset + 1;
                last = Some(Lsn(record.commit_lsn));
            }
            // Known captured before the read above: that read saw it all.
            if captured {
                return Ok(last);
            }
            log.reload_cursors()?;
            let idle = log
                .cursor(crate::capture::SOURCE_ACK)
                .and_then(|c| c.last_commit_lsn)
                .map(Lsn);
            let confirmed = self.confirmed(source).await?;
            if idle.max(confirmed).is_some_and(|c| c >= at) {
                captured = true;
                continue;
            }
            if Instant::now() >= self.deadline {
                return Err(self.timed_out(
                    format!(
                        "the flow's capture did not pass the fence {at} (slot {} is confirmed at {})",
                        self.flow.slot(),
                        confirmed.map_or("nothing".to_owned(), |c| c.to_string())
                    ),
                    "is the flow's capture running? `trellara status` shows it (a flow that is not following is verified stopped)",
                ));
            }
            tokio::time::sleep(STEP_POLL).await;
        }
    }

    /// The flow's slot's confirmed position.
    async fn confirmed(&self, source: &Client) -> Result<Option<Lsn>, FenceError> {
        let confirmed: Option<String> = source
            .query_opt(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.flow.slot()],
            )
            .await
            .map_err(FenceError::Source)?
            .and_then(|r| r.get(0));
        Ok(confirmed.and_then(|c| c.parse().ok()))
    }

    /// Waits until the target's checkpoint reached `expected` (the last
    /// commit before `at` in the log, if the cursor had not passed it).
    async fn applied_through(
        &self,
        target: &Client,
        expected: Option<Lsn>,
        at: Lsn,
    ) -> Result<(), FenceError> {
        let Some(expected) = expected else {
            return Ok(());
        };
        loop {
            let applied = crate::state::checkpoint::applied(target, &self.flow.name)
                .await
                .map_err(FenceError::Target)?;
            if applied.is_some_and(|a| a >= expected) {
                return Ok(());
            }
            if Instant::now() >= self.deadline {
                return Err(self.timed_out(
                    format!(
                        "the flow's apply did not reach the last transaction before the fence {at} (commit {expected}; the target's checkpoint is at {})",
                        applied.map_or("nothing".to_owned(), |a| a.to_string())
                    ),
                    "is the flow's apply running, and not stopped by a quarantine? `trellara status` shows it",
                ));
            }
            tokio::time::sleep(STEP_POLL).await;
        }
    }
}
