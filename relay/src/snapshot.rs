//! Initial snapshot and handoff to the stream, as a state machine persisted
//! in `trellara.snapshot_runs` / `trellara.snapshot_tables` on the target:
//!
//! ```text
//!  planned ─▶ copying ─▶ copied ─▶ stream_handoff_ready ─▶ verified
//!     ▲          │  (any state) ─▶ failed_recoverable ──────────┘ (verify)
//!     └──────────┴──── re-plan (new slot, new consistent LSN) ◀──┘
//! ```
//!
//! Invariants:
//! * The consistent LSN (the slot's exported snapshot) is recorded before
//!   any row is copied, and every table is copied from that one snapshot.
//! * A table's copy is idempotent: truncate, COPY and its progress row
//!   commit in one target transaction, so a crashed copy leaves the table as
//!   before and is simply redone.
//! * The handoff (checkpoint at the consistent LSN, state
//!   stream_handoff_ready) is recorded before streaming starts; the stream
//!   then carries exactly the transactions that committed after it.
//! * An exported snapshot lives only while its replication session is idle;
//!   a run interrupted mid-copy cannot resume at the same boundary, so it is
//!   re-planned (new slot, new boundary) rather than continued at a wrong one.
//!
//! The machine ([`run_machine`]) is generic over [`SnapshotIo`]; PostgreSQL
//! source and target in [`PgSnapshot`], a simulated pair in the
//! deterministic simulator, which stops it at the named crash points.

use crate::config::{Flow, quote_table};
use crate::crash::{CrashHooks, CrashPoint, NoCrash};
use crate::errors::Chain;
use crate::state::SnapshotState;
use futures_util::{SinkExt, StreamExt};
use std::path::Path;
use std::time::{Duration, Instant};
use tokio_postgres::Client;
use trellara_common::Lsn;
use trellara_external_relay::pgwire::{self, ConnectOptions, Connection};

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("target database")]
    Target(#[source] tokio_postgres::Error),
    #[error("source database")]
    Source(#[source] tokio_postgres::Error),
    #[error("source replication session")]
    Wire(#[from] pgwire::WireError),
    #[error("table {table}: {problem}\nhint: {hint}")]
    Table {
        table: String,
        problem: String,
        hint: String,
    },
    #[error("publication {name} on the source {problem}\nhint: {fix}")]
    Publication {
        name: String,
        problem: String,
        fix: String,
    },
    #[error(
        "the snapshot was stopped by a signal before its handoff (nothing of it is kept); the next run plans it again"
    )]
    Stopped,
    #[error("could not remove the flow's old log {path}")]
    LogDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("snapshot state {from} cannot become {to}")]
    Transition {
        from: &'static str,
        to: &'static str,
    },
    /// A simulated source or target failed (simulator only).
    #[error("simulated failure: {0}")]
    Simulated(String),
    /// Only the simulator's crash hooks produce this.
    #[error("simulated crash at {0:?}")]
    Crashed(CrashPoint),
}

pub use crate::state::runs::RunState;

/// The durable run row of one flow's snapshot machine.
#[allow(async_fn_in_trait)] // one task; no Send bound needed
pub trait RunStore {
    async fn load_run(&mut self) -> Result<Option<RunState>, SnapshotError>;
    /// Writes `next` unconditionally; [`advance`] checks the machine first.
    async fn set_state(
        &mut self,
        next: SnapshotState,
        reason: Option<&str>,
    ) -> Result<(), SnapshotError>;
}

/// A slot created with an exported snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub name: String,
    /// Transactions committing before it are in the snapshot; from it on,
    /// in the stream.
    pub consistent: Lsn,
    /// The exported snapshot every table is copied at.
    pub snapshot: String,
}

/// What the machine does at the source and the target.
#[allow(async_fn_in_trait)]
pub trait SnapshotIo: RunStore {
    /// Creates the flow's publication if missing, or brings it up to the
    /// flow; what it did, when it did something.
    async fn ensure_publication(&mut self) -> Result<Option<String>, SnapshotError>;
    /// Creates the flow's slot exporting a snapshot; true when it first
    /// dropped one left by an interrupted run (its snapshot died with it).
    async fn create_slot(&mut self) -> Result<(Slot, bool), SnapshotError>;
    /// Records a new run at `consistent` in state planned and forgets the
    /// previous run's copied tables.
    async fn plan(&mut self, consistent: Lsn) -> Result<(), SnapshotError>;
    /// Empties the flow's tables on the target and returns the order to
    /// copy them in: a table that others reference by foreign key before
    /// them. By default the given order, emptied table by table.
    async fn prepare_copy(&mut self, tables: &[String]) -> Result<Vec<String>, SnapshotError> {
        Ok(tables.to_vec())
    }
    /// Copies `table` at `snapshot`: its rows and its progress row, which
    /// [`finish_copy`](SnapshotIo::finish_copy) commits with every other
    /// table's (an implementation without it commits each copy alone).
    /// `progress` hears how far a long copy is, every few seconds.
    async fn copy_table(
        &mut self,
        table: &str,
        snapshot: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64, SnapshotError>;
    /// Makes the copies of every table (and their emptying) visible
    /// together; until then a failed copy leaves every target table as it
    /// was. By default each copy committed on its own.
    async fn finish_copy(&mut self) -> Result<(), SnapshotError> {
        Ok(())
    }
    /// Undoes what [`prepare_copy`](SnapshotIo::prepare_copy) and the
    /// copies did when one of them failed.
    async fn abort_copy(&mut self) {}
    /// Ends the exported snapshot: every table holds its boundary.
    async fn release_snapshot(&mut self);
    /// Removes what this run created on the source (its slot, a publication
    /// it created) after it failed before the handoff, so no slot is left
    /// holding WAL for a flow that never streamed; says what it removed.
    async fn undo_created(&mut self) -> Vec<String> {
        Vec::new()
    }
    /// Records the handoff: the flow's checkpoint at `checkpoint` (see
    /// [`handoff_checkpoint`]) for the boundary `consistent`, and the
    /// previous boundary's quarantine records superseded.
    async fn handoff(&mut self, checkpoint: Lsn, consistent: Lsn) -> Result<(), SnapshotError>;
}

/// The checkpoint a handoff records for the boundary `consistent`. The
/// snapshot holds every transaction that committed before the consistent
/// point; one whose commit record starts exactly at it is not in the
/// snapshot and is streamed. The applier skips commits at or below the
/// checkpoint, so the checkpoint sits just below the boundary.
pub fn handoff_checkpoint(consistent: Lsn) -> Lsn {
    #[cfg(test)]
    if mutation::CHECKPOINT_AT_BOUNDARY.with(std::cell::Cell::get) {
        return consistent;
    }
    Lsn(consistent.0.saturating_sub(1))
}

/// Whether a flow must (re-)plan a snapshot before streaming: unless its
/// run was handed off, the stream cannot continue from its boundary.
pub fn needs_snapshot(current: Option<SnapshotState>) -> bool {
    #[cfg(test)]
    if mutation::CONTINUE_INTERRUPTED.with(std::cell::Cell::get) {
        return current.is_none();
    }
    !matches!(
        current,
        Some(SnapshotState::StreamHandoffReady | SnapshotState::Verified)
    )
}

/// How often a long table copy reports how far it is.
const COPY_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Newlines in `bytes`: the rows of a piece of COPY text.
fn newlines(bytes: &[u8]) -> u64 {
    bytes.iter().filter(|&&b| b == b'\n').count() as u64
}

/// `tables` in an order where a table comes after every table it
/// references (`links`: referencing, referenced); otherwise as given. A
/// cycle of foreign keys keeps the given order for its tables.
fn referenced_first(tables: &[String], links: &[(String, String, String)]) -> Vec<String> {
    let mut order: Vec<String> = Vec::with_capacity(tables.len());
    let mut left: Vec<&String> = tables.iter().collect();
    while !left.is_empty() {
        let ready = left.iter().position(|t| {
            links.iter().all(|(from, to, _)| {
                from != *t || to == *t || order.contains(to) || !left.contains(&to)
            })
        });
        // Only a cycle leaves nothing ready: take the first as given.
        order.push(left.remove(ready.unwrap_or(0)).clone());
    }
    order
}

/// What a table's rows are read from: the table alone (`ONLY`: an
/// inheritance child's rows are its own relation's, published apart), or
/// for a partitioned table, which holds no rows itself, its partitions.
pub(crate) async fn rows_of(
    client: &Client,
    qualified: &str,
) -> Result<String, tokio_postgres::Error> {
    Ok(if partitioned(client, qualified).await? {
        qualified.to_owned()
    } else {
        format!("ONLY {qualified}")
    })
}

/// Whether `qualified` is a partitioned table.
pub(crate) async fn partitioned(
    client: &Client,
    qualified: &str,
) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)",
            &[&qualified],
        )
        .await?
        .get(0))
}

/// Native capture names each change by the relation it was written to:
/// a partitioned table's arrive under its partitions' names, which the
/// target does not replicate. Refused before anything is copied.
pub(crate) async fn native_refusal(
    flow: &crate::config::Flow,
    source: &Client,
) -> Result<Option<String>, tokio_postgres::Error> {
    if flow.capture != crate::config::CapturePath::Native {
        return Ok(None);
    }
    for table in &flow.tables {
        let Some(quoted) = quote_table(table) else {
            continue;
        };
        if partitioned(source, &quoted).await? {
            return Ok(Some(format!(
                "table {table} is partitioned, and native capture does not capture partitions under their table's name; use capture: external for this flow (its publication publishes via the partition root)"
            )));
        }
    }
    Ok(None)
}

/// Test-only switches that break one rule each, for the simulator's
/// mutation checks.
#[cfg(test)]
pub(crate) mod mutation {
    use std::cell::Cell;
    thread_local! {
        /// Continue an interrupted run instead of re-planning it.
        pub(crate) static CONTINUE_INTERRUPTED: Cell<bool> = const { Cell::new(false) };
        /// Put the handoff checkpoint at the boundary, not just below it.
        pub(crate) static CHECKPOINT_AT_BOUNDARY: Cell<bool> = const { Cell::new(false) };
    }
}

/// Moves the run to `next` if the machine allows it from its current state.
pub async fn advance<R: RunStore>(
    store: &mut R,
    next: SnapshotState,
    reason: Option<&str>,
) -> Result<(), SnapshotError> {
    if let Some(current) = store.load_run().await? {
        if current.state == next {
            return Ok(());
        }
        if !current.state.may_become(next) {
            return Err(SnapshotError::Transition {
                from: current.state.as_str(),
                to: next.as_str(),
            });
        }
    }
    store.set_state(next, reason).await
}

/// The run row of `flow` in the target's `trellara.snapshot_runs`.
struct PgRunStore<'a> {
    client: &'a Client,
    flow: &'a str,
}

impl RunStore for PgRunStore<'_> {
    async fn load_run(&mut self) -> Result<Option<RunState>, SnapshotError> {
        load(self.client, self.flow).await
    }

    async fn set_state(
        &mut self,
        next: SnapshotState,
        reason: Option<&str>,
    ) -> Result<(), SnapshotError> {
        crate::state::runs::set_state(self.client, self.flow, next, reason)
            .await
            .map_err(SnapshotError::Target)
    }
}

pub async fn load(client: &Client, flow: &str) -> Result<Option<RunState>, SnapshotError> {
    crate::state::runs::load(client, flow)
        .await
        .map_err(SnapshotError::Target)
}

/// Moves the run to `next` if the machine allows it from its current state.
pub async fn transition(
    client: &Client,
    flow: &str,
    next: SnapshotState,
    reason: Option<&str>,
) -> Result<(), SnapshotError> {
    advance(&mut PgRunStore { client, flow }, next, reason).await
}

/// Moves the run `seen` to `next` only if it is still that run in that
/// state: what verify checked may have been re-planned meanwhile (a
/// reseed), and its verdict must not land on the new run. False when the
/// run moved.
pub async fn transition_from(
    client: &Client,
    flow: &str,
    seen: &RunState,
    next: SnapshotState,
    reason: Option<&str>,
) -> Result<bool, SnapshotError> {
    if !seen.state.may_become(next) {
        return Err(SnapshotError::Transition {
            from: seen.state.as_str(),
            to: next.as_str(),
        });
    }
    crate::state::runs::set_state_from(client, flow, seen, next, reason)
        .await
        .map_err(SnapshotError::Target)
}

/// What a snapshot did, for progress and reports.
#[derive(Debug, Clone, Default)]
pub struct SnapshotReport {
    pub consistent_lsn: Lsn,
    pub tables: Vec<(String, u64)>,
}

/// Runs the whole machine from planned to stream_handoff_ready: creates the
/// publication if missing, the slot with an exported snapshot, copies every
/// table at that boundary, and records the handoff.
///
/// `stop` turning true ends a table copy at once ([`SnapshotError::Stopped`]:
/// the next run plans the snapshot again); once every table is copied the
/// handoff, a few statements, completes.
pub async fn run(
    flow: &Flow,
    (source_url, old_log): (&str, &Path),
    source: &Client,
    target: &Client,
    progress: &mut dyn FnMut(&str),
    stop: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<SnapshotReport, SnapshotError> {
    let mut io = PgSnapshot::new(flow, source_url, (source, target), stop);
    io.old_log = Some(old_log);
    run_machine(&mut io, &flow.tables, progress, &NoCrash).await
}

/// Copies every table of the flow into one sink's target at a boundary of
/// its own, through the same machine as a first run (planned to
/// stream_handoff_ready, the handoff checkpoint at the boundary), but
/// from a temporary slot's snapshot: the flow's slot and log stay as they
/// are, and the sink's cursor, registered before this is called, finds
/// every transaction after the boundary in the log. A failure rolls the
/// copy back; the next attempt plans again.
pub async fn seed_sink(
    flow: &Flow,
    source_url: &str,
    source: &Client,
    target: &Client,
    progress: &mut dyn FnMut(&str),
    stop: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<SnapshotReport, SnapshotError> {
    let mut io = PgSnapshot::new(flow, source_url, (source, target), stop);
    io.own_boundary = true;
    run_machine(&mut io, &flow.tables, progress, &NoCrash).await
}

/// Whether `quoted` is a member of `publication` by name.
async fn listed(source: &Client, publication: &str, quoted: &str) -> Result<bool, SnapshotError> {
    Ok(source
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                            WHERE p.pubname = $1 AND pr.prrelid = to_regclass($2))",
            &[&publication, &quoted],
        )
        .await
        .map_err(SnapshotError::Source)?
        .get(0))
}

/// Lets go of `table`, which left the flow: forgets its copy (its rows on
/// the target stay as they are) and, when the flow made the publication,
/// takes the table out of it. Says what it did.
pub async fn leave(
    flow: &Flow,
    source: &Client,
    target: &Client,
    table: &str,
) -> Result<String, SnapshotError> {
    let publication = flow.publication();
    let quoted = quote_table(table);
    let note = match (&flow.source.publication, quoted) {
        (None, Some(quoted)) => {
            if listed(source, &publication, &quoted).await? {
                source
                    .batch_execute(&format!(
                        "ALTER PUBLICATION {publication} DROP TABLE {quoted}"
                    ))
                    .await
                    .map_err(SnapshotError::Source)?;
                format!("removed from publication {publication}; its rows on the target stay")
            } else {
                "its rows on the target stay".to_owned()
            }
        }
        _ => format!(
            "its rows on the target stay; publication {publication} is not the flow's to change, so it may still stream the table: ALTER PUBLICATION {publication} DROP TABLE {table} on the source ends that"
        ),
    };
    crate::state::runs::forget_table(target, &flow.name, table)
        .await
        .map_err(SnapshotError::Target)?;
    Ok(note)
}

/// Copies `tables`, which joined a following flow after its boundary, at
/// a boundary of their own, and returns it. The same checks as a first
/// run have passed (the round's gate); the publication is brought to the
/// flow's tables first, so the boundary comes after that change commits.
/// A temporary slot (gone with its session, whatever happens) exports the
/// snapshot; the tables are emptied and copied in one target transaction,
/// which a failure rolls back. Changes of these tables that committed
/// before the boundary are in the copy: the applier skips them
/// (state::runs::CopiedTable::boundary). The flow's slot is not touched.
pub async fn join(
    flow: &Flow,
    source_url: &str,
    source: &Client,
    target: &Client,
    tables: &[String],
    progress: &mut dyn FnMut(&str),
    stop: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<Lsn, SnapshotError> {
    let mut io = PgSnapshot::new(flow, source_url, (source, target), stop);
    let publication = flow.publication();
    let mut unlisted = Vec::new();
    if flow.source.publication.is_none() {
        for quoted in tables.iter().filter_map(|t| quote_table(t)) {
            if !listed(source, &publication, &quoted).await? {
                unlisted.push(quoted);
            }
        }
    }
    if let Some(change) = io.ensure_publication().await? {
        progress(&format!("join: {change}"));
    }
    let joined = copy_at_own_boundary(&mut io, tables, progress).await;
    if joined.is_err() && !unlisted.is_empty() {
        // Not left streaming tables the target never got.
        let undo = format!(
            "ALTER PUBLICATION {publication} DROP TABLE {}",
            unlisted.join(", ")
        );
        // A session of its own: a copy that was stopped may have left the
        // round's inside its read-only transaction.
        let undone = match crate::session::connect(source_url, "source").await {
            Ok(session) => session
                .batch_execute(&undo)
                .await
                .map_err(|e| Chain(&e).to_string()),
            Err(e) => Err(Chain(&e).to_string()),
        };
        match undone {
            Ok(()) => progress(&format!("join: undone: {undo}")),
            // Its changes are not applied meanwhile: the table has no copy.
            Err(e) => progress(&format!("join: could not undo ({undo}): {e}")),
        }
    }
    joined
}

/// A boundary of its own for one copy: a temporary slot named for
/// `purpose` (`join`, `reseed`), its exported snapshot and consistent
/// point, which live as long as the returned connection. The wait for the
/// slot ends at `stop`, or past `timeout` with the transactions it waited
/// for named.
pub(crate) async fn temporary_slot(
    (source_url, source): (&str, &Client),
    purpose: &str,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
    timeout: Option<Duration>,
) -> Result<(Connection, String, Lsn), SnapshotError> {
    let mut options: ConnectOptions = source_url.parse()?;
    options.replication = true;
    let mut repl = Connection::connect(&options).await?;
    let pid = repl.backend_pid();
    let name = format!("trellara_{purpose}_{pid}");
    let created = {
        let create = slot_created(repl.create_temporary_slot(&name), &name, source, pid, stop);
        match timeout {
            Some(limit) => tokio::time::timeout(limit, create).await.ok(),
            None => Some(create.await),
        }
    };
    let Some(created) = created else {
        let waiting = blocking_transactions(source, pid).await;
        // Not left waiting on the server to make a slot nobody reads.
        let _ = source
            .execute("SELECT pg_cancel_backend($1)", &[&pid])
            .await;
        return Err(SnapshotError::Table {
            table: "-".into(),
            problem: format!(
                "a temporary slot for the copy's boundary was not made within {} s, waiting for: {waiting}",
                timeout.unwrap_or_default().as_secs(),
            ),
            hint: "let those transactions end (COMMIT PREPARED / ROLLBACK PREPARED a prepared one), or reseed with a longer --fence-timeout".into(),
        });
    };
    let created = created?;
    let snapshot = created.snapshot_name.ok_or_else(no_snapshot)?;
    Ok((repl, snapshot, created.consistent_point))
}

/// [`join`]'s copy: a temporary slot's snapshot, every table emptied and
/// copied in one target transaction; the slot's consistent point.
async fn copy_at_own_boundary(
    io: &mut PgSnapshot<'_>,
    tables: &[String],
    progress: &mut dyn FnMut(&str),
) -> Result<Lsn, SnapshotError> {
    let (repl, snapshot, boundary) =
        temporary_slot((io.source_url, io.source), "join", io.stop.clone(), None).await?;
    io.boundary = Some(boundary);
    progress(&format!(
        "join: copying {} at a boundary of their own, {boundary}",
        tables.join(", ")
    ));
    let order = io.prepare_copy(tables).await?;
    for table in &order {
        match io.copy_table(table, &snapshot, progress).await {
            Ok(rows) => progress(&format!("join: copied {rows} rows of {table}")),
            Err(e) => {
                io.abort_copy().await;
                return Err(e);
            }
        }
    }
    io.finish_copy().await?;
    // The exported snapshot and the temporary slot end with the session.
    drop(repl);
    Ok(boundary)
}

/// A slot created without the snapshot it was asked to export.
fn no_snapshot() -> SnapshotError {
    SnapshotError::Table {
        table: "-".into(),
        problem: "the server exported no snapshot".into(),
        hint: "the slot must be created outside a transaction on a primary".into(),
    }
}

fn crash(hooks: &dyn CrashHooks, point: CrashPoint) -> Result<(), SnapshotError> {
    if hooks.crash_at(point) {
        return Err(SnapshotError::Crashed(point));
    }
    Ok(())
}

/// The machine from planned to stream_handoff_ready over `io`, stopping at
/// the crash points `hooks` names (production passes [`NoCrash`]).
pub(crate) async fn run_machine<I: SnapshotIo>(
    io: &mut I,
    tables: &[String],
    progress: &mut dyn FnMut(&str),
    hooks: &dyn CrashHooks,
) -> Result<SnapshotReport, SnapshotError> {
    // Publication first: the slot's stream is filtered by it.
    if let Some(done) = io.ensure_publication().await? {
        progress(&done);
    }
    match to_handoff(io, tables, progress, hooks).await {
        Ok(report) => Ok(report),
        // A crash leaves what it left (the next run finds it); a failure
        // removes what the run created.
        Err(e @ SnapshotError::Crashed(_)) => Err(e),
        Err(e) => {
            for removed in io.undo_created().await {
                progress(&removed);
            }
            Err(e)
        }
    }
}

/// [`run_machine`] from the slot to the handoff.
async fn to_handoff<I: SnapshotIo>(
    io: &mut I,
    tables: &[String],
    progress: &mut dyn FnMut(&str),
    hooks: &dyn CrashHooks,
) -> Result<SnapshotReport, SnapshotError> {
    let (slot, dropped) = io.create_slot().await?;
    if dropped {
        progress(&format!(
            "dropped slot {} of an interrupted snapshot run",
            slot.name
        ));
    }
    io.plan(slot.consistent).await?;
    advance(io, SnapshotState::Copying, None).await?;
    progress(&format!(
        "slot {} created; consistent LSN {}, copying at exported snapshot {}",
        slot.name, slot.consistent, slot.snapshot
    ));
    let mut report = SnapshotReport {
        consistent_lsn: slot.consistent,
        tables: Vec::new(),
    };
    let copied = async {
        for table in &io.prepare_copy(tables).await? {
            let started = Instant::now();
            let rows = io.copy_table(table, &slot.snapshot, progress).await?;
            progress(&format!(
                "copied {table}: {rows} rows in {:.1}s",
                started.elapsed().as_secs_f64()
            ));
            report.tables.push((table.clone(), rows));
            crash(hooks, CrashPoint::TableCopied)?;
        }
        io.finish_copy().await
    }
    .await;
    if let Err(e) = copied {
        // A copy stopped by a signal was dropped mid-COPY: its session is
        // closed with the process, which rolls the transaction back.
        if !matches!(e, SnapshotError::Stopped) {
            io.abort_copy().await;
        }
        return Err(e);
    }
    io.release_snapshot().await;
    advance(io, SnapshotState::Copied, None).await?;
    crash(hooks, CrashPoint::CopiedNotHandedOff)?;
    io.handoff(handoff_checkpoint(slot.consistent), slot.consistent)
        .await?;
    advance(io, SnapshotState::StreamHandoffReady, None).await?;
    crash(hooks, CrashPoint::HandedOffNotStreaming)?;
    Ok(report)
}

/// How often a slot creation that waits says what it waits for.
const SLOT_WAIT_REPORT: Duration = Duration::from_secs(10);

/// Waits for a slot being created, which waits for every transaction
/// running now to end, prepared ones included: says which, every 10 s,
/// and on a stop cancels the wait on the server rather than leave it
/// there.
async fn slot_created(
    create: impl std::future::Future<Output = Result<pgwire::SlotCreated, pgwire::WireError>>,
    name: &str,
    source: &Client,
    pid: i32,
    mut stop: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<pgwire::SlotCreated, SnapshotError> {
    // Without a stop channel (a run that does not follow), SIGTERM or
    // Ctrl-C would kill the process and leave the server's walsender
    // waiting: once the transaction ends it would create the slot, and
    // nobody would ever read it. Catch them for the wait only.
    let mut signals = SlotWaitSignals::new(stop.is_none());
    tokio::pin!(create);
    let mut ticker = tokio::time::interval_at(
        tokio::time::Instant::now() + SLOT_WAIT_REPORT,
        SLOT_WAIT_REPORT,
    );
    loop {
        tokio::select! {
            created = &mut create => return Ok(created?),
            _ = ticker.tick() => {
                let waiting = blocking_transactions(source, pid).await;
                tracing::warn!(slot = %name, waiting = %waiting, "creating the slot waits for these transactions to end; the fix: let them finish, or COMMIT PREPARED / ROLLBACK PREPARED the prepared ones");
            }
            _ = async {
                match stop.as_mut() {
                    Some(stop) => { let _ = stop.wait_for(|s| *s).await; }
                    None => std::future::pending().await,
                }
            } => {
                let _ = source.execute("SELECT pg_cancel_backend($1)", &[&pid]).await;
                return Err(SnapshotError::Stopped);
            }
            () = signals.recv() => {
                let _ = source.execute("SELECT pg_cancel_backend($1)", &[&pid]).await;
                return Err(SnapshotError::Stopped);
            }
        }
    }
}

/// The transactions a slot creation on backend `pid` may be waiting for:
/// prepared ones by gid, running ones by xid and backend.
pub(crate) async fn blocking_transactions(source: &Client, pid: i32) -> String {
    let prepared = source
        .query("SELECT gid, transaction::text FROM pg_prepared_xacts", &[])
        .await
        .map(|rows| {
            rows.iter()
                .map(|r| {
                    format!(
                        "prepared gid {} (xid {})",
                        r.get::<_, String>(0),
                        r.get::<_, String>(1)
                    )
                })
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let running = source
        .query(
            "SELECT pid, backend_xid::text, coalesce(now() - xact_start, '0')::text FROM pg_stat_activity
             WHERE backend_xid IS NOT NULL AND pid <> $1 AND pid <> pg_backend_pid()",
            &[&pid],
        )
        .await
        .map(|rows| {
            rows.iter()
                .map(|r| format!("xid {} (backend {}, open {})", r.get::<_, String>(1), r.get::<_, i32>(0), r.get::<_, String>(2)))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let all: Vec<String> = prepared.into_iter().chain(running).collect();
    if all.is_empty() {
        "none visible to this role (pg_stat_activity shows other roles' xids to pg_read_all_stats)"
            .into()
    } else {
        all.join(", ")
    }
}

/// A flow's snapshot between a PostgreSQL source and target.
pub struct PgSnapshot<'a> {
    flow: &'a Flow,
    source_url: &'a str,
    source: &'a Client,
    target: &'a Client,
    /// The replication session whose exported snapshot the copy uses.
    repl: Option<Connection>,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
    /// What this run created on the source, removed again if it fails
    /// before the handoff.
    created_publication: bool,
    created_slot: bool,
    /// Set for tables joining a following flow: the boundary of their own
    /// their copy is recorded at.
    boundary: Option<Lsn>,
    /// One sink of several copied at a boundary of its own: a temporary
    /// slot exports the snapshot, and the flow's slot is left alone.
    own_boundary: bool,
    /// The flow's log of the stream a full snapshot replaces, removed with
    /// the old slot once every check passed.
    old_log: Option<&'a Path>,
}

impl<'a> PgSnapshot<'a> {
    fn new(
        flow: &'a Flow,
        source_url: &'a str,
        (source, target): (&'a Client, &'a Client),
        stop: Option<tokio::sync::watch::Receiver<bool>>,
    ) -> Self {
        PgSnapshot {
            flow,
            source_url,
            source,
            target,
            repl: None,
            stop,
            created_publication: false,
            created_slot: false,
            boundary: None,
            own_boundary: false,
            old_log: None,
        }
    }
}

impl std::fmt::Debug for PgSnapshot<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSnapshot")
            .field("flow", &self.flow.name)
            .finish_non_exhaustive()
    }
}

impl PgSnapshot<'_> {
    /// An existing publication must stream everything the flow copies:
    /// every table, every kind of change, no row filter, partitioned tables
    /// under their own name. The flow's own publication (default name) is
    /// brought up to that; one the operator named is refused with the fix.
    /// Claims the flow's slot on the target before anything is created on
    /// the source, refusing a slot of its name this target never claimed:
    /// another config's flow of the same name streams it, and dropping or
    /// sharing it would lose that flow's changes.
    async fn claim_slot(&mut self) -> Result<(), SnapshotError> {
        let slot = self.flow.slot();
        let here: bool = self
            .source
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND database = current_database())",
                &[&slot],
            )
            .await
            .map_err(SnapshotError::Source)?
            .get(0);
        // A sink seeded at its own boundary joins a slot the flow's first
        // sink claimed; this process holds the flow's log, so it is ours.
        if here
            && !self.own_boundary
            && !crate::state::owns_slot(self.target, &self.flow.name, &slot)
                .await
                .map_err(SnapshotError::Target)?
        {
            return Err(SnapshotError::Table {
                table: "-".into(),
                problem: format!("{}", crate::state::NotOurSlot(&slot)),
                hint: crate::state::not_our_slot_fix(&slot),
            });
        }
        crate::state::claim_slot(self.target, &self.flow.name, &slot)
            .await
            .map_err(SnapshotError::Target)
    }

    /// A temporary slot (gone with its session, whatever happens) whose
    /// exported snapshot and consistent point are one sink's own boundary.
    async fn temporary_slot(
        &mut self,
        mut repl: Connection,
    ) -> Result<(Slot, bool), SnapshotError> {
        let pid = repl.backend_pid();
        let name = format!("trellara_seed_{pid}");
        let created = {
            let create = repl.create_temporary_slot(&name);
            slot_created(create, &name, self.source, pid, self.stop.clone()).await?
        };
        let snapshot = created.snapshot_name.ok_or_else(no_snapshot)?;
        self.repl = Some(repl);
        Ok((
            Slot {
                name,
                consistent: created.consistent_point,
                snapshot,
            },
            false,
        ))
    }

    async fn reconcile_publication(
        &mut self,
        publication: &str,
    ) -> Result<Option<String>, SnapshotError> {
        let source = self.source;
        let row = source
            .query_one(
                "SELECT puballtables, pubinsert AND pubupdate AND pubdelete AND pubtruncate, pubviaroot
                 FROM pg_publication WHERE pubname = $1",
                &[&publication],
            )
            .await
            .map_err(SnapshotError::Source)?;
        let (all_tables, every_action, via_root): (bool, bool, bool) =
            (row.get(0), row.get(1), row.get(2));
        let mut missing = Vec::new();
        let mut filtered = Vec::new();
        let mut partitioned = false;
        for table in &self.flow.tables {
            let Some(quoted) = quote_table(table) else {
                continue;
            };
            partitioned |= crate::snapshot::partitioned(source, &quoted)
                .await
                .map_err(SnapshotError::Source)?;
            // A member by name (a partitioned one is listed by its leaves
            // without publish_via_partition_root), or by schema / ALL TABLES.
            // A row filter or a column list drops what the copy has.
            let row = source
                .query_one(
                    "WITH rel AS (SELECT pr.prqual, pr.prattrs FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid
                                  WHERE p.pubname = $1 AND pr.prrelid = to_regclass($2))
                     SELECT EXISTS (SELECT 1 FROM rel)
                            OR EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND format('%I.%I', schemaname, tablename)::regclass = to_regclass($2)),
                            EXISTS (SELECT 1 FROM rel WHERE prqual IS NOT NULL OR prattrs IS NOT NULL)",
                    &[&publication, &quoted],
                )
                .await
                .map_err(SnapshotError::Source)?;
            let (member, has_filter): (bool, bool) = (row.get(0), row.get(1));
            if has_filter {
                filtered.push(table.clone());
            } else if !member && !all_tables {
                missing.push(quoted);
            }
        }
        if !filtered.is_empty() {
            return Err(SnapshotError::Publication {
                name: publication.to_owned(),
                problem: format!(
                    "filters the rows or columns of {}: the stream would lack what the snapshot copies",
                    filtered.join(", ")
                ),
                fix: format!(
                    "drop the row filter and column list (ALTER PUBLICATION {publication} SET TABLE ... without WHERE or a column list), or name another publication in source.publication"
                ),
            });
        }
        let mut fixes = Vec::new();
        if !missing.is_empty() {
            fixes.push(format!(
                "ALTER PUBLICATION {publication} ADD TABLE {}",
                missing.join(", ")
            ));
        }
        if !every_action || (partitioned && !via_root) {
            fixes.push(format!(
                "ALTER PUBLICATION {publication} SET (publish = 'insert, update, delete, truncate', publish_via_partition_root = true)"
            ));
        }
        if fixes.is_empty() {
            return Ok(None);
        }
        if self.flow.source.publication.is_some() {
            return Err(SnapshotError::Publication {
                name: publication.to_owned(),
                problem: "does not stream all the flow copies (a table, or a kind of change, is left out)".into(),
                fix: format!("on the source: {}", fixes.join("; ")),
            });
        }
        source
            .batch_execute(&fixes.join("; "))
            .await
            .map_err(SnapshotError::Source)?;
        Ok(Some(format!(
            "publication {publication}: {}",
            fixes.join("; ")
        )))
    }
}

impl RunStore for PgSnapshot<'_> {
    async fn load_run(&mut self) -> Result<Option<RunState>, SnapshotError> {
        load(self.target, &self.flow.name).await
    }

    async fn set_state(
        &mut self,
        next: SnapshotState,
        reason: Option<&str>,
    ) -> Result<(), SnapshotError> {
        PgRunStore {
            client: self.target,
            flow: &self.flow.name,
        }
        .set_state(next, reason)
        .await
    }
}

impl SnapshotIo for PgSnapshot<'_> {
    async fn ensure_publication(&mut self) -> Result<Option<String>, SnapshotError> {
        self.claim_slot().await?;
        let publication = self.flow.publication();
        let exists: bool = self
            .source
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
                &[&publication],
            )
            .await
            .map_err(SnapshotError::Source)?
            .get(0);
        if exists {
            return self.reconcile_publication(&publication).await;
        }
        let tables: Vec<String> = self
            .flow
            .tables
            .iter()
            .filter_map(|t| quote_table(t))
            .collect();
        self.source
            .batch_execute(&format!(
                // A partitioned table's changes then arrive under its own
                // name, as the snapshot copied it, not under each partition's.
                // The comment marks it as Trellara's: teardown drops only those.
                "CREATE PUBLICATION {publication} FOR TABLE {} WITH (publish_via_partition_root = true); COMMENT ON PUBLICATION {publication} IS {}",
                tables.join(", "),
                crate::teardown::publication_marker_literal(&self.flow.name)
            ))
            .await
            .map_err(SnapshotError::Source)?;
        self.created_publication = true;
        Ok(Some(format!("created publication {publication}")))
    }

    async fn create_slot(&mut self) -> Result<(Slot, bool), SnapshotError> {
        let mut options: ConnectOptions = self.source_url.parse()?;
        options.replication = true;
        let mut repl = Connection::connect(&options).await?;
        if self.own_boundary {
            return self.temporary_slot(repl).await;
        }
        let name = self.flow.slot();
        // Left by an interrupted run: its snapshot is gone with its session.
        // Slot names are the server's, not the database's: one on another
        // database is another flow's, and is not ours to drop.
        let existing = repl.slot_info(&name).await?;
        if let Some(info) = &existing
            && info
                .database
                .as_deref()
                .is_some_and(|db| db != options.dbname)
        {
            return Err(SnapshotError::Table {
                table: "-".into(),
                problem: format!(
                    "replication slot {name} on the source belongs to database {}, not {}: another flow's",
                    info.database.as_deref().unwrap_or("?"),
                    options.dbname
                ),
                hint: "give this flow its own slot (source.slot in trellara.yml)".into(),
            });
        }
        // A new boundary means a new stream: the old log cannot be applied
        // on top of it. It goes here, once the slot and publication checks
        // passed, with the old slot.
        if let Some(dir) = self.old_log.take() {
            // Off the round's thread: a large log takes a while to delete.
            let owned = dir.to_path_buf();
            tokio::task::spawn_blocking(move || crate::log::remove_log_dir(&owned))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)))
                .map_err(|source| SnapshotError::LogDir {
                    path: dir.display().to_string(),
                    source,
                })?;
        }
        let dropped = existing.is_some();
        if dropped {
            repl.drop_slot(&name).await?;
        }
        let plugin = match self.flow.capture {
            crate::config::CapturePath::Native => "trellara",
            crate::config::CapturePath::External => "pgoutput",
        };
        // Creating a logical slot waits for every transaction running now
        // to end, prepared ones included: say which, every 10 s, and on a
        // stop cancel the wait on the server rather than leave it there.
        let pid = repl.backend_pid();
        let created = {
            let create = repl.create_logical_slot_for(&name, plugin, true, false);
            slot_created(create, &name, self.source, pid, self.stop.clone()).await?
        };
        self.created_slot = true;
        let snapshot = created.snapshot_name.clone().ok_or_else(no_snapshot)?;
        // The exported snapshot lives while this session stays idle.
        self.repl = Some(repl);
        Ok((
            Slot {
                name,
                consistent: created.consistent_point,
                snapshot,
            },
            dropped,
        ))
    }

    async fn plan(&mut self, consistent: Lsn) -> Result<(), SnapshotError> {
        crate::state::runs::plan(self.target, &self.flow.name, consistent)
            .await
            .map_err(SnapshotError::Target)
    }

    /// All the flow's tables are emptied in one `TRUNCATE` (foreign keys
    /// between them allow nothing else); each copy then only deletes what
    /// a retried copy of its table left.
    async fn prepare_copy(&mut self, tables: &[String]) -> Result<Vec<String>, SnapshotError> {
        let target = self.target;
        // Foreign keys on the target that reach the flow's tables:
        // (referencing table, referenced table, constraint).
        let links = target
            .query(
                "SELECT rn.nspname || '.' || r.relname, fn.nspname || '.' || f.relname, c.conname
                 FROM pg_constraint c
                 JOIN pg_class r ON r.oid = c.conrelid JOIN pg_namespace rn ON rn.oid = r.relnamespace
                 JOIN pg_class f ON f.oid = c.confrelid JOIN pg_namespace fn ON fn.oid = f.relnamespace
                 WHERE c.contype = 'f' AND c.conparentid = 0 AND fn.nspname || '.' || f.relname = ANY($1)",
                &[&tables],
            )
            .await
            .map_err(SnapshotError::Target)?;
        let links: Vec<(String, String, String)> = links
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        if let Some((from, to, name)) = links.iter().find(|(from, _, _)| !tables.contains(from)) {
            return Err(SnapshotError::Table {
                table: to.clone(),
                problem: format!(
                    "is referenced on the target by {from} (foreign key {name}), which the flow does not replicate, so it cannot be emptied for the copy"
                ),
                hint: format!(
                    "add {from} to flows[].tables, or drop the constraint on the target: ALTER TABLE {from} DROP CONSTRAINT {name}"
                ),
            });
        }
        let order = referenced_first(tables, &links);
        let quoted: Vec<String> = order.iter().filter_map(|t| quote_table(t)).collect();
        // Emptying and every copy in one target transaction: a copy that
        // fails (or a signal) leaves every table as it was. No staging
        // table swapped in: that would change the table's OID under its
        // views, foreign keys and grants.
        target
            // The copy is data work, as long as the tables are large:
            // no catalog bound (crate::session::CATALOG_TIMEOUT) in it.
            .batch_execute(&format!(
                "BEGIN; SET LOCAL statement_timeout = 0; TRUNCATE {}",
                quoted.join(", ")
            ))
            .await
            .map_err(|e| SnapshotError::Table {
                table: order.join(", "),
                problem: format!(
                    "cannot be emptied on the target: {}",
                    e.as_db_error().map_or(e.to_string(), |d| d.message().to_owned())
                ),
                hint: "create the tables on the target with the source's columns, and let the role truncate them".into(),
            })?;
        Ok(order)
    }

    async fn copy_table(
        &mut self,
        table: &str,
        snapshot: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64, SnapshotError> {
        let copy = copy_table(
            table,
            snapshot,
            (self.source, self.target),
            &self.flow.name,
            self.boundary,
            progress,
        );
        match self.stop.clone() {
            // Dropping the copy rolls its target transaction back.
            Some(mut stop) => tokio::select! {
                copied = copy => copied,
                _ = stop.wait_for(|stop| *stop) => Err(SnapshotError::Stopped),
            },
            None => copy.await,
        }
    }

    async fn finish_copy(&mut self) -> Result<(), SnapshotError> {
        self.target
            .batch_execute("COMMIT")
            .await
            .map_err(SnapshotError::Target)
    }

    async fn abort_copy(&mut self) {
        let _ = self.target.batch_execute("ROLLBACK").await;
    }

    async fn release_snapshot(&mut self) {
        self.repl = None;
    }

    async fn undo_created(&mut self) -> Vec<String> {
        // The exported snapshot's session goes first: it may still be
        // closing when the drop runs, which waits for it.
        self.repl = None;
        let mut removed = Vec::new();
        // A session of its own: the copy's may still be inside its COPY.
        let source = match crate::session::connect(self.source_url, "source").await {
            Ok(source) => source,
            Err(e) => {
                removed.push(format!(
                    "could not remove what this run created on the source ({})\nhint: trellara teardown --config ... removes it",
                    Chain(&e)
                ));
                return removed;
            }
        };
        if self.created_slot {
            let slot = self.flow.slot();
            match crate::teardown::drop_slot(&source, &slot).await {
                Ok(true) => removed.push(format!(
                    "dropped slot {slot}, created by this run, which failed before its handoff"
                )),
                Ok(false) => {}
                Err(e) => removed.push(format!(
                    "could not drop slot {slot} that this run created: {}\nhint: trellara teardown --config ... removes it",
                    Chain(&e)
                )),
            }
        }
        if self.created_publication {
            let publication = self.flow.publication();
            match source
                .batch_execute(&format!("DROP PUBLICATION IF EXISTS {publication}"))
                .await
            {
                Ok(()) => removed.push(format!(
                    "dropped publication {publication}, created by this run"
                )),
                Err(e) => removed.push(format!(
                    "could not drop publication {publication} that this run created: {}",
                    Chain(&e)
                )),
            }
        }
        removed
    }

    async fn handoff(&mut self, checkpoint: Lsn, consistent: Lsn) -> Result<(), SnapshotError> {
        let flow = &self.flow.name;
        crate::state::checkpoint::reset_at_boundary(
            self.target,
            flow,
            &self.flow.source_id(),
            checkpoint,
            consistent,
        )
        .await
        .map_err(SnapshotError::Target)?;
        // Quarantined transactions of the previous boundary are superseded
        // by this copy.
        crate::state::quarantine::supersede(self.target, flow)
            .await
            .map_err(SnapshotError::Target)
    }
}

/// `qualified` as pgoutput's Relation message describes it, fingerprinted,
/// read from the catalog inside the open snapshot transaction (catalog
/// rows are MVCC, so this is the schema at the snapshot): published columns
/// (not dropped, not generated) in order with type OID and modifier, the
/// replica identity, and the key flag pgoutput sets (every column under
/// FULL, the key columns - not INCLUDE ones - of an immediate, valid
/// primary key under DEFAULT, of the identity index under INDEX).
async fn schema_at_snapshot(
    source: &Client,
    qualified: &str,
) -> Result<trellara_common::envelope::RelationSchema, SnapshotError> {
    use trellara_common::envelope::{ColumnSchema, RelationSchema, ReplicaIdentity};
    let rows = source
        .query(
            "SELECT n.nspname::text, c.relname::text, c.relreplident::text, a.attname::text,
                    a.atttypid::int8, a.atttypmod,
                    CASE c.relreplident
                        WHEN 'f' THEN true
                        WHEN 'd' THEN coalesce(a.attnum = ANY ((pk.indkey::int2[])[0:pk.indnkeyatts - 1]), false)
                        WHEN 'i' THEN coalesce(a.attnum = ANY ((ri.indkey::int2[])[0:ri.indnkeyatts - 1]), false)
                        ELSE false END,
                    c.oid::int8
             FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             JOIN pg_attribute a ON a.attrelid = c.oid
             LEFT JOIN pg_index pk ON pk.indrelid = c.oid AND pk.indisprimary
                 AND pk.indimmediate AND pk.indisvalid
             LEFT JOIN pg_index ri ON ri.indrelid = c.oid AND ri.indisreplident
             WHERE c.oid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
               AND a.attgenerated = ''
             ORDER BY a.attnum",
            &[&qualified],
        )
        .await
        .map_err(SnapshotError::Source)?;
    let Some(first) = rows.first() else {
        return Err(SnapshotError::Table {
            table: qualified.to_owned(),
            problem: "has no columns at the snapshot".into(),
            hint: "check the table on the source".into(),
        });
    };
    let identity = match first.get::<_, String>(2).as_str() {
        "f" => ReplicaIdentity::Full,
        "n" => ReplicaIdentity::Nothing,
        "i" => ReplicaIdentity::Index,
        _ => ReplicaIdentity::Default,
    };
    let columns: Vec<ColumnSchema> = rows
        .iter()
        .map(|r| ColumnSchema {
            name: r.get(3),
            type_oid: u32::try_from(r.get::<_, i64>(4)).unwrap_or(0),
            type_modifier: r.get(5),
            key: r.get(6),
        })
        .collect();
    let mut schema = RelationSchema {
        relation_id: u32::try_from(first.get::<_, i64>(7)).unwrap_or(0),
        namespace: first.get(0),
        name: first.get(1),
        replica_identity: identity as i32,
        columns,
        fingerprint: 0,
    };
    schema.fingerprint = trellara_common::fingerprint::fingerprint(&schema);
    Ok(schema)
}

/// Copies one table at the exported snapshot, inside the target
/// transaction [`SnapshotIo::prepare_copy`] opened.
async fn copy_table(
    table: &str,
    snapshot: &str,
    sides: (&Client, &Client),
    flow: &str,
    boundary: Option<Lsn>,
    progress: &mut dyn FnMut(&str),
) -> Result<u64, SnapshotError> {
    sides
        .0
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT '{snapshot}'; SET LOCAL statement_timeout = 0"
        ))
        .await
        .map_err(SnapshotError::Source)?;
    let result = copy_in_snapshot(table, sides, flow, boundary, progress).await;
    let _ = sides.0.batch_execute("COMMIT").await;
    result
}

/// Copies one table from the snapshot `source`'s transaction is at into
/// `target`'s open transaction, and records the copy there (with
/// `boundary` when the table has one of its own).
pub(crate) async fn copy_in_snapshot(
    table: &str,
    (source, target): (&Client, &Client),
    flow: &str,
    boundary: Option<Lsn>,
    progress: &mut dyn FnMut(&str),
) -> Result<u64, SnapshotError> {
    let bad = |problem: String, hint: &str| SnapshotError::Table {
        table: table.to_owned(),
        problem,
        hint: hint.to_owned(),
    };
    let qualified = quote_table(table)
        .ok_or_else(|| bad("is not schema.table".into(), "fix flows[].tables"))?;
    let columns: Vec<String> = source
        .query(
            "SELECT quote_ident(attname) FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped AND attgenerated = ''
             ORDER BY attnum",
            &[&qualified],
        )
        .await
        .map_err(SnapshotError::Source)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if columns.is_empty() {
        return Err(bad(
            "does not exist on the source".into(),
            "create it or remove it from flows[].tables",
        ));
    }
    let list = columns.join(", ");
    let rows_of = rows_of(source, &qualified)
        .await
        .map_err(SnapshotError::Source)?;
    // Inside the target transaction the caller opened, after it emptied
    // the table.
    {
        let out = source
            .copy_out(&format!("COPY (SELECT {list} FROM {rows_of}) TO STDOUT"))
            .await
            .map_err(SnapshotError::Source)?;
        let sink = target
            .copy_in(&format!("COPY {qualified} ({list}) FROM STDIN"))
            .await
            .map_err(|e| {
                bad(
                    format!("cannot COPY into the target: {e}"),
                    "make the target's columns match the source",
                )
            })?;
        futures_util::pin_mut!(out);
        futures_util::pin_mut!(sink);
        // COPY text ends every row with a newline (one inside a value is
        // escaped), so counting them counts rows.
        let started = Instant::now();
        let mut told = started;
        let (mut rows, mut bytes) = (0u64, 0u64);
        while let Some(chunk) = out.next().await {
            let chunk = chunk.map_err(SnapshotError::Source)?;
            rows += newlines(&chunk);
            bytes += chunk.len() as u64;
            sink.send(chunk).await.map_err(SnapshotError::Target)?;
            if told.elapsed() >= COPY_PROGRESS_EVERY {
                told = Instant::now();
                let secs = started.elapsed().as_secs_f64();
                progress(&format!(
                    "copying {table}: {rows} rows ({:.1} MiB) in {secs:.0}s, {:.0} rows/s",
                    bytes as f64 / (1 << 20) as f64,
                    rows as f64 / secs
                ));
            }
        }
        let rows = sink.finish().await.map_err(SnapshotError::Target)?;
        // The schema the copy saw, as the stream will describe it: capture
        // pins it, so DDL between the boundary and the first streamed row
        // stops capture instead of being taken for the schema.
        let pinned = schema_at_snapshot(source, &qualified).await?;
        crate::state::runs::record_table(target, flow, table, rows, &pinned, boundary)
            .await
            .map_err(SnapshotError::Target)?;
        Ok(rows)
    }
}

#[cfg(test)]
mod copy_order_tests {
    use super::referenced_first;

    fn link(from: &str, to: &str) -> (String, String, String) {
        (from.into(), to.into(), format!("{from}_fk"))
    }

    #[test]
    fn referenced_tables_are_copied_first() {
        let tables: Vec<String> = [
            "public.line_items",
            "public.orders",
            "public.customers",
            "public.notes",
        ]
        .map(String::from)
        .to_vec();
        let links = [
            link("public.line_items", "public.orders"),
            link("public.orders", "public.customers"),
            // Self-references and tables outside the flow do not hold a table back.
            link("public.notes", "public.notes"),
            link("public.notes", "public.elsewhere"),
        ];
        assert_eq!(
            referenced_first(&tables, &links),
            [
                "public.customers",
                "public.orders",
                "public.line_items",
                "public.notes"
            ]
        );
        // A cycle keeps the given order for its tables.
        let cycle = [link("public.a", "public.b"), link("public.b", "public.a")];
        let ab: Vec<String> = ["public.a", "public.b"].map(String::from).to_vec();
        assert_eq!(referenced_first(&ab, &cycle), ab);
    }
}

/// SIGTERM and SIGINT caught while a slot is being created by a run that
/// has no stop channel; dropping it gives both back their default action
/// (tokio keeps its handler installed for the process's life otherwise).
struct SlotWaitSignals {
    streams: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl SlotWaitSignals {
    fn new(catch: bool) -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        let streams = catch
            .then(|| {
                Some((
                    signal(SignalKind::terminate()).ok()?,
                    signal(SignalKind::interrupt()).ok()?,
                ))
            })
            .flatten();
        SlotWaitSignals { streams }
    }

    /// Resolves at the first signal; never when none is caught.
    async fn recv(&mut self) {
        match &mut self.streams {
            Some((term, int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            None => std::future::pending().await,
        }
    }
}

impl Drop for SlotWaitSignals {
    fn drop(&mut self) {
        use nix::sys::signal::{SigHandler, Signal, signal};
        if self.streams.take().is_some() {
            for s in [Signal::SIGTERM, Signal::SIGINT] {
                // SAFETY: SIG_DFL installs no handler code of ours.
                let _ = unsafe { signal(s, SigHandler::SigDfl) };
            }
        }
    }
}
