//! The external capture stage: pgoutput v2 from a logical slot, assembled
//! into envelopes, appended to the durable log, and only then acknowledged
//! to the source.
//!
//! ```text
//!  slot ──START_REPLICATION──▶ decode ─▶ assemble ─▶ log.append (fsync)
//!    ▲                                                     │
//!    └──── standby status: flush = last durable end LSN ◀──┘
//! ```
//!
//! Invariants:
//! * **Publish, then acknowledge.** The position reported to the server is
//!   only ever the end LSN of an envelope whose append returned (fsync done),
//!   or - when nothing is open - a keepalive position recorded durably first.
//!   A crash between the two costs a duplicate, never a gap.
//! * **Resume from the log.** On (re)connect, streaming restarts at the log's
//!   last durable position; transactions at or below it are skipped and
//!   counted as duplicates.
//! * **No silent gap.** A slot whose confirmed position is past what the log
//!   holds, that was invalidated, or that another process holds, stops
//!   capture with an error naming it and the recovery.

use crate::crash::{CrashHooks, CrashPoint, NoCrash};
use crate::log::storage::{FsStorage, Storage};
use crate::log::{CursorPosition, Log, LogConfig};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use trellara_common::Lsn;
use trellara_common::envelope::{self, SourceIdentity};
use trellara_common::table_name::TableName;
use trellara_external_relay::pgoutput::{self, DecodeContext, Message, ProtoVersion};
use trellara_external_relay::pgwire::{
    ConnectOptions, Connection, ReplicationEvent, ReplicationStream, WireError,
};
use trellara_external_relay::{
    AssembleOrSink, Assembled, Assembler, AssemblerConfig, AssemblyError,
};

/// The consumer name under which the log records how far the source was
/// acknowledged past the last envelope (idle keepalive advances).
pub(crate) const SOURCE_ACK: &str = "source-ack";

/// Moves the source-ack cursor's offset to the log's end (its LSN stays),
/// so it never holds segments back from retention: it records a source
/// position, not a place in the log a reader still needs.
pub fn release_source_ack<S: Storage>(log: &Log<S>) -> Result<(), crate::log::Error> {
    if let Some(position) = log.cursor(SOURCE_ACK) {
        log.commit_cursor(
            SOURCE_ACK,
            CursorPosition {
                next_offset: log.next_offset(),
                last_commit_lsn: position.last_commit_lsn,
            },
        )?;
    }
    Ok(())
}

#[derive(Debug, Clone)]
pub struct CaptureConfig {
    pub source: ConnectOptions,
    pub slot: String,
    pub publications: Vec<String>,
    pub create_slot: bool,
    pub source_id: String,
    pub dataset_id: String,
    pub log_dir: PathBuf,
    pub proto_version: ProtoVersion,
    pub memory_budget: usize,
    pub chunk_bytes: usize,
    pub status_interval: Duration,
    pub max_backoff: Duration,
    pub pinned: HashMap<String, u64>,
    /// The whole descriptions behind `pinned`, where known.
    pub schemas: HashMap<String, envelope::RelationSchema>,
    /// The position a consumer downstream already holds (the applier's
    /// checkpoint end LSN); with an empty or replaced log, a slot confirmed
    /// past both it and the log is a gap, not a fresh start.
    pub floor: Lsn,
    /// Receives the acknowledged (durable) source position as it moves.
    pub progress: Option<std::sync::Arc<tokio::sync::watch::Sender<Lsn>>>,
    /// Told as each source transaction begins, before the rest of it is
    /// received: the applier opens its target transaction meanwhile.
    pub begun: Option<std::sync::Arc<tokio::sync::Notify>>,
    /// Where capture counts each transaction once durable
    /// (`trellara_captured_transactions_total`) and reports its session
    /// lost or streaming again.
    pub observe: Option<crate::service::Observer>,
    /// The boundary tables joined the flow at in this round, if any: the
    /// session reconnects once when the stream reaches it (see
    /// [`CaptureError::Rejoin`]).
    pub rejoin_at: Option<Lsn>,
    /// The flow whose schema contract decides a drifted relation's changes
    /// ([`crate::contract`]); `None`: every drift stops capture.
    pub ddl: Option<std::sync::Arc<trellara_common::config::Flow>>,
}

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error(transparent)]
    Assembly(#[from] AssemblyError),
    #[error(transparent)]
    Log(#[from] crate::log::Error),
    #[error("pgoutput")]
    Decode(#[from] pgoutput::DecodeError),
    #[error(
        "the log's last record at offset {offset} is not a valid envelope\nhint: inspect it with `trellara log inspect --dir {dir} --verify`"
    )]
    BadTail {
        offset: u64,
        dir: String,
        #[source]
        source: envelope::EnvelopeError,
    },
    #[error(
        "replication slot {slot:?} does not exist on {target}\nhint: for a flow, take a new snapshot and slot: `trellara reseed --config trellara.yml --flow <name>`; for `trellara relay` alone, pass --create-slot"
    )]
    NoSlot { slot: String, target: String },
    #[error(
        "replication slot {slot:?} uses plugin {plugin:?}, not pgoutput\nhint: the external relay decodes pgoutput; use a pgoutput slot (or capture: native for trellara slots)"
    )]
    WrongPlugin { slot: String, plugin: String },
    #[error(
        "replication slot {slot:?} was invalidated ({reason}); the WAL it needed is gone\nhint: reseed the flow: `trellara reseed --config trellara.yml`"
    )]
    Invalidated { slot: String, reason: String },
    #[error(
        "replication slot {slot:?} is held by another process (pid {pid})\nhint: stop the other consumer; one slot feeds one relay"
    )]
    HeldElsewhere { slot: String, pid: i32 },
    #[error(
        "replication slot {slot:?} is confirmed up to {confirmed}, past what the log holds ({durable}): the transactions in between are not in the log\nhint: another consumer advanced the slot or the log was replaced; reseed the flow: `trellara reseed --config trellara.yml`"
    )]
    SlotAhead {
        slot: String,
        confirmed: Lsn,
        durable: Lsn,
    },
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Lock(#[from] std::io::Error),
    #[error("could not start capture's thread")]
    Thread(#[source] std::io::Error),
    /// Only the simulator's crash hooks produce this.
    #[error("simulated crash at {0:?}")]
    Crashed(CrashPoint),
    /// The stream reached the boundary of tables that joined the
    /// publication this round: the session ends there and the next one
    /// starts at it. A walsender that decoded a transaction open across
    /// the `ALTER PUBLICATION` may cache a joined table as unpublished and
    /// skip its changes in every later transaction (PostgreSQL before
    /// 15.13, 16.9 and 17.5; seen on 16.2 here). A walsender started at
    /// the boundary replays no such transaction: every one open across
    /// the change committed before it (the boundary's slot waited for
    /// them), and their changes to the joined tables are in the copy.
    #[error("the stream reached the join boundary {at}; its session starts again there")]
    Rejoin { at: Lsn },
}

impl CaptureError {
    fn is_transient(&self) -> bool {
        match self {
            CaptureError::Wire(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// What was captured, for reporting and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CaptureStats {
    pub envelopes: u64,
    pub duplicates_skipped: u64,
    pub reconnects: u64,
}

/// Durable resume state read from the log.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resume {
    /// Highest commit LSN in the log: transactions at or below it are
    /// duplicates.
    pub(crate) commit_lsn: Lsn,
    /// Where the source may resume: the last envelope's end LSN, or a
    /// recorded idle advance past it.
    pub(crate) ack_lsn: Lsn,
}

pub(crate) fn read_resume<S: crate::log::storage::Storage>(
    log: &Log<S>,
) -> Result<Resume, CaptureError> {
    let mut resume = Resume {
        commit_lsn: Lsn::ZERO,
        ack_lsn: Lsn::ZERO,
    };
    // The last *complete* transaction: a crash mid-way through appending a
    // chunked transaction leaves its first chunks at the tail; those do not
    // count, so the transaction is streamed and appended again whole (the
    // applier discards the orphaned chunks).
    let mut offset = log.last_durable().map(|d| d.offset);
    while let Some(at) = offset {
        let record = log
            .read_from(at)?
            .next()
            .transpose()?
            .ok_or_else(|| CaptureError::Config("log tail vanished while reading".into()))?;
        let env = envelope::decode(&record.payload).map_err(|source| CaptureError::BadTail {
            offset: at,
            dir: log.dir().display().to_string(),
            source,
        })?;
        let boundary = env.boundary.unwrap_or_default();
        if boundary.chunk_index + 1 >= boundary.chunk_count.max(1) {
            resume.commit_lsn = Lsn(env.commit_lsn);
            resume.ack_lsn = Lsn(env.end_lsn);
            break;
        }
        // An incomplete run: look before its first chunk.
        offset = at
            .checked_sub(u64::from(boundary.chunk_index) + 1)
            .filter(|o| *o >= log.first_offset());
    }
    if let Some(ack) = log.cursor(SOURCE_ACK).and_then(|c| c.last_commit_lsn) {
        resume.ack_lsn = resume.ack_lsn.max(Lsn(ack));
    }
    Ok(resume)
}

/// Runs capture until `shutdown` resolves (then reports the durable
/// position to the server and ends the stream cleanly) or a definite error.
/// Transient errors reconnect with capped exponential backoff.
pub async fn run(
    config: CaptureConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<CaptureStats, CaptureError> {
    let _lock = crate::lock::lock(&config.log_dir)?;
    let (log, report) = Log::open(FsStorage::new(), &config.log_dir, LogConfig::default())?;
    if let Some(torn) = &report.torn_tail {
        tracing::warn!(segment = %torn.segment.display(), bytes = torn.truncated_bytes, "cut torn log tail left by a crash");
    }
    run_on(config, &log, shutdown).await
}

/// Like [`run`], on a log the caller opened (and may read concurrently, as
/// the applier does in `trellara run`).
pub async fn run_on(
    config: CaptureConfig,
    log: &Log<FsStorage>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<CaptureStats, CaptureError> {
    use futures_util::FutureExt;
    let mut config = config;
    log.register_consumer(SOURCE_ACK)?;
    let mut stats = CaptureStats::default();
    let mut backoff = Duration::from_millis(250);
    // Fused: it may be polled again after it fired, and then stays pending.
    let mut shutdown = std::pin::pin!(shutdown.fuse());
    loop {
        let mut stopped = false;
        let result = session(&config, log, &mut stats, shutdown.as_mut(), &mut stopped).await;
        if stopped {
            return result.map(|()| stats);
        }
        match result {
            Ok(()) => return Ok(stats),
            Err(CaptureError::Rejoin { at }) => {
                tracing::info!(%at, "capture: a new session from the join boundary");
                config.rejoin_at = None;
            }
            Err(err) if err.is_transient() => {
                tracing::warn!(error = %err, retry_in = ?backoff, "capture connection lost; retrying");
                if let Some(o) = &config.observe {
                    o.health.failed(
                        crate::service::FlowState::Retrying,
                        format!("capture: {}", crate::errors::chain_of(&err)),
                    );
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = &mut shutdown => return Ok(stats),
                }
                backoff = (backoff * 2).min(config.max_backoff);
                stats.reconnects += 1;
            }
            Err(err) => return Err(err),
        }
    }
}

/// [`run_on`] on a thread of its own, with a single-thread runtime of its
/// own. Capture and the applier then work side by side: on one thread they
/// took turns, and while capture decoded a backlog the applier's target
/// waited (PG 15, 20,000 single-row transactions: the first 1,500 applied
/// in 76 ms, then 500 per 2.5 ms once capture had caught up). `shutdown`
/// runs on that thread. Dropped before it ends (a round ended by a lost
/// lock), this drops capture there and waits for the thread, as dropping
/// capture on the caller's thread would: nothing of it writes to the log
/// once the next round may open it.
pub async fn run_on_own_thread(
    config: CaptureConfig,
    log: Log<FsStorage>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<CaptureStats, CaptureError> {
    use tracing::Instrument;
    let span = tracing::Span::current();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (cancel, cancelled) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("capture".into())
        // The stack of the main thread it ran on before: block_on keeps the
        // whole capture future on it.
        .stack_size(8 << 20)
        .spawn(move || {
            let result = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime.block_on(
                    async {
                        tokio::select! {
                            result = run_on(config, &log, shutdown) => Some(result),
                            // Its sender dropped: the caller went away.
                            _ = cancelled => None,
                        }
                    }
                    .instrument(span),
                ),
                Err(e) => Some(Err(CaptureError::Thread(e))),
            };
            if let Some(result) = result {
                let _ = tx.send(result);
            }
        })
        .map_err(CaptureError::Thread)?;
    let mut thread = Joined {
        cancel: Some(cancel),
        thread: Some(thread),
    };
    match rx.await {
        Ok(result) => result,
        // It ended without a result: it panicked, and the panic goes on here.
        Err(_) => match thread.thread.take().map(std::thread::JoinHandle::join) {
            Some(Err(panic)) => std::panic::resume_unwind(panic),
            _ => unreachable!("the capture thread sends its result before it ends"),
        },
    }
}

/// The capture thread, cancelled and joined when its caller is dropped.
struct Joined {
    cancel: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Joined {
    fn drop(&mut self) {
        drop(self.cancel.take());
        if let Some(thread) = self.thread.take() {
            // Dropping capture there sends nothing and waits for no peer:
            // this waits for its spill files' removal and for an fsync
            // already in flight on its runtime's blocking pool.
            let _ = thread.join();
        }
    }
}

/// One replication session, from connect to error.
async fn session(
    config: &CaptureConfig,
    log: &Log<FsStorage>,
    stats: &mut CaptureStats,
    shutdown: std::pin::Pin<&mut futures_util::future::Fuse<impl std::future::Future<Output = ()>>>,
    stopped: &mut bool,
) -> Result<(), CaptureError> {
    let resume = read_resume(log)?;
    // The session that re-reads the slot once it is held is opened beside
    // the streaming one: its connect is off the path to the first change.
    let (conn, probe) = tokio::join!(
        Connection::connect(&config.source),
        Connection::connect(&config.source)
    );
    let mut conn = conn?;
    let system = conn.identify_system().await?;
    let server_version_num = conn.server_version_num();
    match conn.slot_info(&config.slot).await? {
        None if config.create_slot => {
            let created = conn.create_logical_slot(&config.slot, false, false).await?;
            tracing::info!(slot = %config.slot, consistent_point = %created.consistent_point, "created replication slot");
        }
        None => {
            return Err(CaptureError::NoSlot {
                slot: config.slot.clone(),
                target: config.source.target(),
            });
        }
        Some(info) => check_slot(config, &info, resume)?,
    }
    if config.proto_version == ProtoVersion::V1 {
        tracing::info!("proto_version 1: streaming of in-progress transactions is off");
    }
    let mut options = vec![
        ("proto_version", (config.proto_version as u8).to_string()),
        ("publication_names", config.publications.join(",")),
        ("messages", "true".to_owned()),
    ];
    if config.proto_version == ProtoVersion::V2 {
        options.push(("streaming", "on".to_owned()));
    }
    let mut stream = match conn
        .start_replication(&config.slot, resume.ack_lsn, &options)
        .await
    {
        Ok(stream) => stream,
        // object_in_use: another walsender streams this slot.
        Err(WireError::Server(e)) if e.code == "55006" => {
            let pid = probe?
                .slot_info(&config.slot)
                .await?
                .and_then(|i| i.active_pid)
                .unwrap_or(0);
            return Err(CaptureError::HeldElsewhere {
                slot: config.slot.clone(),
                pid,
            });
        }
        Err(e) => return Err(e.into()),
    };

    // Re-read the slot now that we hold it: someone else may have held it,
    // or it may have been invalidated between the check and the start.
    let mut probe = probe?;
    if let Some(info) = probe.slot_info(&config.slot).await? {
        if let Some(pid) = info.active_pid
            && pid != stream.backend_pid()
        {
            return Err(CaptureError::HeldElsewhere {
                slot: config.slot.clone(),
                pid,
            });
        }
        check_slot(config, &info, resume)?;
    }
    drop(probe);
    if let Some(o) = &config.observe {
        o.health.state(crate::service::FlowState::Following);
    }

    let mut assembler = Assembler::new(AssemblerConfig {
        source: SourceIdentity {
            source_id: config.source_id.clone(),
            dataset_id: config.dataset_id.clone(),
            system_identifier: system.system_id,
            database: config.source.dbname.clone(),
            timeline: system.timeline,
        },
        server_version_num,
        decoder: format!("pgoutput/{}", config.proto_version as u8),
        memory_budget: config.memory_budget,
        chunk_bytes: config.chunk_bytes,
        spill_dir: config.log_dir.join("spill-capture"),
        pinned: pinned(config, log)?,
        schemas: {
            let mut schemas = config.schemas.clone();
            schemas.extend(pinned_schemas(log)?);
            schemas
        },
    });
    let stopped_cleanly = stream_changes(
        config,
        log,
        &mut stream,
        &mut assembler,
        resume,
        stats,
        shutdown,
        &NoCrash,
    )
    .await?;
    if stopped_cleanly {
        // Leave the slot exactly at what is durable.
        *stopped = true;
        stream.send_status().await?;
        stream.finish().await?;
    }
    Ok(())
}

/// The log metadata holding pinned relation fingerprints.
const PINS: &str = "capture-pins";
/// The log metadata holding the whole pinned descriptions.
const SCHEMAS: &str = "capture-schemas";

/// The fingerprints capture holds relations to: the configured ones and
/// every one pinned while filling this log (`namespace.name fingerprint`
/// lines), so schema drift stops every rerun, not only the session that
/// saw it. A reseed starts a new log and so pins afresh.
pub(crate) fn pinned<S: Storage>(
    config: &CaptureConfig,
    log: &Log<S>,
) -> Result<HashMap<String, u64>, CaptureError> {
    let mut pins = config.pinned.clone();
    let Some(bytes) = log.read_meta(PINS)? else {
        return Ok(pins);
    };
    let text = String::from_utf8_lossy(&bytes);
    for line in text.lines().filter(|l| !l.is_empty()) {
        let parsed = line
            .rsplit_once(' ')
            .and_then(|(name, hex)| Some((name, u64::from_str_radix(hex, 16).ok()?)));
        let Some((name, fingerprint)) = parsed else {
            return Err(CaptureError::Config(format!(
                "{}/meta/{PINS}: unreadable line {line:?}\nhint: the file holds `namespace.name fingerprint` lines; restore it or reseed the flow",
                log.dir().display()
            )));
        };
        pins.entry(name.to_owned()).or_insert(fingerprint);
    }
    // A description stored here was pinned by this log's capture, which a
    // target only ever applies after it: a change accepted here wins over
    // the target's older pin.
    for (name, schema) in pinned_schemas(log)? {
        pins.insert(name, schema.fingerprint);
    }
    Ok(pins)
}

/// The whole descriptions pinned while filling this log, by
/// `namespace.name`: what a later drift is diffed against.
pub(crate) fn pinned_schemas<S: Storage>(
    log: &Log<S>,
) -> Result<HashMap<String, envelope::RelationSchema>, CaptureError> {
    use prost::Message as _;
    let Some(bytes) = log.read_meta(SCHEMAS)? else {
        return Ok(HashMap::new());
    };
    let mut rest = bytes.as_slice();
    let mut schemas = HashMap::new();
    while !rest.is_empty() {
        let schema = envelope::RelationSchema::decode_length_delimited(&mut rest).map_err(|e| {
            CaptureError::Config(format!(
                "{}/meta/{SCHEMAS}: unreadable ({e})\nhint: the file holds the pinned relation descriptions; restore it or reseed the flow",
                log.dir().display()
            ))
        })?;
        let name = TableName::new(&schema.namespace, &schema.name).to_string();
        schemas.insert(name, schema);
    }
    Ok(schemas)
}

fn store_pins<S: Storage>(log: &Log<S>, assembler: &Assembler) -> Result<(), CaptureError> {
    use prost::Message as _;
    let mut lines: Vec<String> = assembler
        .pinned()
        .iter()
        .map(|(name, fingerprint)| format!("{name} {fingerprint:016x}\n"))
        .collect();
    lines.sort();
    let mut schemas: Vec<_> = assembler.schemas().iter().collect();
    schemas.sort_by(|a, b| a.0.cmp(b.0));
    let mut bytes = Vec::new();
    for (_, schema) in schemas {
        schema
            .encode_length_delimited(&mut bytes)
            .map_err(|e| CaptureError::Config(format!("encoding pinned descriptions: {e}")))?;
    }
    log.write_meta(SCHEMAS, &bytes)?;
    log.write_meta(PINS, lines.concat().as_bytes())?;
    Ok(())
}

/// What a capture session reads from: the walsender's replication stream,
/// or the simulator's. `durable` is the position the next standby status
/// reports as flushed.
#[allow(async_fn_in_trait)] // one task; no Send bound needed
pub trait SourceStream {
    async fn recv(&mut self) -> Result<Option<ReplicationEvent>, WireError>;
    fn set_durable(&mut self, lsn: Lsn);
    fn durable(&self) -> Lsn;
    fn status_due(&self, every: Duration) -> bool;
    async fn send_status(&mut self) -> Result<(), WireError>;
    /// Reads at most once per `every` while the source runs dry (`None`:
    /// at once). Only an optimisation; a source may ignore it.
    fn pace_reads(&mut self, every: Option<Duration>) {
        let _ = every;
    }
}

impl SourceStream for ReplicationStream {
    async fn recv(&mut self) -> Result<Option<ReplicationEvent>, WireError> {
        ReplicationStream::recv(self).await
    }
    fn set_durable(&mut self, lsn: Lsn) {
        ReplicationStream::set_durable(self, lsn);
    }
    fn durable(&self) -> Lsn {
        ReplicationStream::durable(self)
    }
    fn status_due(&self, every: Duration) -> bool {
        ReplicationStream::status_due(self, every)
    }
    async fn send_status(&mut self) -> Result<(), WireError> {
        ReplicationStream::send_status(self).await
    }
    fn pace_reads(&mut self, every: Option<Duration>) {
        ReplicationStream::pace_reads(self, every);
    }
}

/// Test-only switches that break one ordering rule each, for the
/// simulator's mutation checks.
#[cfg(test)]
pub(crate) mod mutation {
    use std::cell::Cell;
    thread_local! {
        /// Let the source position move before the append.
        pub(crate) static ACK_BEFORE_APPEND: Cell<bool> = const { Cell::new(false) };
        /// Advance on a keepalive even inside an open transaction.
        pub(crate) static KEEPALIVE_IN_TRANSACTION: Cell<bool> = const { Cell::new(false) };
    }
}

/// The streaming loop: decode, assemble, append (group commit), and only
/// then let the source position move. Returns true when `shutdown` fired
/// (the caller reports the durable position and ends the stream), or the
/// error that ended the session. `hooks` stop it at the named crash points
/// (the simulator's; production passes [`NoCrash`]).
///
/// Group commit is pipelined: what is decoded from data already received
/// is written together, and while its fsync runs the loop goes on
/// receiving and writing; the next fsync covers everything written
/// meanwhile. So a live stream costs one fsync per fsync time, not one per
/// transaction, and the source is acknowledged as each fsync returns.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn stream_changes<S: Storage, R: SourceStream>(
    config: &CaptureConfig,
    log: &Log<S>,
    stream: &mut R,
    assembler: &mut Assembler,
    resume: Resume,
    stats: &mut CaptureStats,
    shutdown: std::pin::Pin<&mut futures_util::future::Fuse<impl std::future::Future<Output = ()>>>,
    hooks: &dyn CrashHooks,
) -> Result<bool, CaptureError> {
    let mut batch = Batch {
        captured: config.observe.as_ref().map(|o| o.metrics.captured.clone()),
        ..Batch::default()
    };
    // Kept outside the stream's loop, so what it wrote is still known once
    // a lost session ends it.
    let batch = &mut batch;
    let mut shutdown = shutdown;
    let result = async {
    let mut in_stream_block = false;
    // How many pins and descriptions the log holds: a first sight grows
    // either (a flow's tables are pinned by the target, often without a
    // description from an older build).
    let stored = |a: &Assembler| (a.pinned().len(), a.schemas().len());
    let mut pins_stored = (pinned(config, log)?.len(), pinned_schemas(log)?.len());
    let mut catalog = crate::contract::SourceCatalog::new(&config.source);
    // A description re-pinned by an accepted change is stored once what
    // carries the change is durable: stored before, a crash would replay
    // the change's transaction with no drift left to see.
    // Changes accepted, and how many of them the stored pins hold.
    let (mut accepted, mut stored_accepted) = (0u64, 0u64);
    // Where the log must be durable for the re-pin to be stored, and how
    // many changes were accepted when it was taken (a later one re-arms).
    let mut repin_at: Option<(u64, u64)> = None;
    let mut acked_end = 0u64;
    // The fsync in flight: the written end it covers, and its wait.
    type Syncing<'a> = (
        u64,
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), crate::log::Error>> + 'a>>,
    );
    let mut syncing: Option<Syncing<'_>> = None;
    let mut paced = false;
    tracing::info!(slot = %config.slot, from = %resume.ack_lsn, "streaming");
    loop {
        if let Some((end, wait)) = &mut syncing
            && let Some(done) = futures_util::FutureExt::now_or_never(wait.as_mut())
        {
            done?;
            let end = *end;
            syncing = None;
            batch.acknowledge(end, stream, hooks)?;
            acked_end = acked_end.max(end);
        }
        if syncing.is_none()
            && let Some(&(end, _, _)) = batch.written.back()
        {
            syncing = Some((end, Box::pin(log.sync_through(end))));
            continue;
        }
        // A large transaction's chunks are built and written one at a time,
        // each followed by a yield: the applier reads the written chunks
        // into its open target transaction while the next ones are built
        // (on its own thread in `trellara run`; the simulator's shares
        // this one, and each of its waits costs at most one chunk's build).
        if assembler.finishing() {
            {
                let mut emit = |env: Assembled| batch.take(env, resume, log, stream, stats, hooks);
                if let Err(e) = assembler.emit_next(&mut emit) {
                    let e = match e {
                        AssembleOrSink::Assembly(e) => e.into(),
                        AssembleOrSink::Sink(e) => e,
                    };
                    return Err(batch.stop_at(e, log, stream, stats, hooks).await);
                }
            }
            batch.write(log, stream, stats)?;
            // Handing out a very large transaction can outlast the
            // server's wal_sender_timeout: keep the session alive.
            if stream.status_due(config.status_interval) {
                stream.send_status().await?;
                crash(hooks, CrashPoint::Acknowledged)?;
            }
            tokio::task::yield_now().await;
            continue;
        }
        // Inside a large transaction nothing can be applied before its
        // commit: read the socket in batches. Waking per arriving message
        // costs both ends (perf, 1M-row transaction: 69% of this process's
        // time in the kernel, 21% in task switches; the walsender 84% in
        // the kernel, sending and waking us per message); the end of the
        // transaction costs at most one pace more.
        let large = assembler.open_changes() >= LARGE_TRANSACTION_CHANGES;
        if large != paced {
            stream.pace_reads(large.then_some(READ_PACE));
            paced = large;
        }
        let event = if batch.records.is_empty() {
            let synced = async {
                match &mut syncing {
                    Some((_, wait)) => wait.as_mut().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                done = synced => {
                    done?;
                    if let Some((end, _)) = syncing.take() {
                        batch.acknowledge(end, stream, hooks)?;
                        acked_end = acked_end.max(end);
                    }
                    None
                }
                ev = stream.recv() => Some(ev?.ok_or(WireError::Closed)?),
                () = tokio::time::sleep(config.status_interval) => None,
                () = &mut shutdown => {
                    batch.advance(log, stream, stats, hooks).await?;
                    if accepted != stored_accepted && !assembler.in_transaction() {
                        store_pins(log, assembler)?;
                    }
                    // The rest of the stream is read to its end at once.
                    stream.pace_reads(None);
                    return Ok(true);
                }
            }
        } else {
            let full = batch.bytes >= BATCH_BYTES || batch.records.len() >= BATCH_RECORDS;
            // recv is cancel-safe: polling it once loses nothing. When
            // nothing more is already here, the batch is written.
            let ready = if full {
                None
            } else {
                futures_util::FutureExt::now_or_never(stream.recv())
            };
            match ready {
                Some(ev) => Some(ev?.ok_or(WireError::Closed)?),
                None => {
                    batch.write(log, stream, stats)?;
                    None
                }
            }
        };
        if let Some(ev) = event {
            let mut state = Session {
                assembler,
                in_stream_block: &mut in_stream_block,
                batch: &mut *batch,
                resume,
                stats,
                catalog: &mut catalog,
                repinned: &mut accepted,
            };
            let relation = matches!(&ev, ReplicationEvent::XLogData { data, .. } if data.first() == Some(&b'R'));
            if let Err(e) = handle_event(ev, config, &mut state, log, stream, hooks).await {
                return Err(batch.stop_at(e, log, stream, stats, hooks).await);
            }
            if relation && stored(assembler) != pins_stored && accepted == stored_accepted {
                store_pins(log, assembler)?;
                pins_stored = stored(assembler);
            }
        }
        if accepted != stored_accepted && !assembler.in_transaction() && batch.records.is_empty() {
            if repin_at.is_none_or(|(_, n)| n != accepted) {
                repin_at = Some((log.written_end(), accepted));
            }
            if let Some((at, _)) = repin_at
                && acked_end >= at
            {
                store_pins(log, assembler)?;
                pins_stored = stored(assembler);
                stored_accepted = accepted;
            }
        }
        // The walsender pings after each transaction it sends while the
        // acknowledged position is behind: advancing (an fsync wait and a
        // cursor commit) on every ping would cap capture at one transaction
        // per fsync. So at most once per status interval.
        if batch.advance_due(config.status_interval) {
            batch.advance(log, stream, stats, hooks).await?;
        }
        if stream.status_due(config.status_interval) {
            stream.send_status().await?;
            crash(hooks, CrashPoint::Acknowledged)?;
        }
        if let Some(progress) = &config.progress {
            let durable = stream.durable();
            progress.send_if_modified(|p| {
                let moved = *p < durable;
                *p = (*p).max(durable);
                moved
            });
        }
    }
    }
    .await;
    if result.as_ref().is_err_and(CaptureError::is_transient) {
        batch.settle(log).await;
    }
    result
}

/// Inside a transaction this large, the socket is read in batches...
const LARGE_TRANSACTION_CHANGES: u64 = 4096;
/// ...at most once per this while it runs dry.
const READ_PACE: Duration = Duration::from_millis(5);

/// Appends gathered in one write.
const BATCH_BYTES: usize = 8 << 20;
const BATCH_RECORDS: usize = 1000;

/// Envelopes assembled but not yet written, and what was written but is
/// not yet known durable.
#[derive(Debug, Default)]
struct Batch {
    /// Counts each transaction once it is durable (the metric).
    captured: Option<prometheus::IntCounter>,
    /// Transactions whose last envelope is in `records`.
    transactions: u64,
    records: Vec<(u64, Vec<u8>)>,
    bytes: usize,
    /// End LSN of the last complete transaction in the batch.
    ack: Option<Lsn>,
    /// Written writes in order: where each ends in the log, the end LSN
    /// the source may move to once it is durable, and how many whole
    /// transactions it completes (counted as captured only then, so a
    /// reconnect that drops an undurable write never counts it twice).
    written: std::collections::VecDeque<(u64, Option<Lsn>, u64)>,
    /// The latest keepalive position seen with no transaction open: past
    /// WAL with nothing to capture, recorded by [`Batch::advance`].
    idle: Option<Lsn>,
    advanced_at: Option<tokio::time::Instant>,
}

impl Batch {
    /// Takes one assembled envelope: a duplicate is counted and dropped;
    /// a transaction's last envelope is what the source may move past.
    fn take<S: Storage>(
        &mut self,
        env: Assembled,
        resume: Resume,
        log: &Log<S>,
        stream: &mut impl SourceStream,
        stats: &mut CaptureStats,
        hooks: &dyn CrashHooks,
    ) -> Result<(), CaptureError> {
        if Lsn(env.commit_lsn) <= resume.commit_lsn {
            stats.duplicates_skipped += 1;
            return Ok(());
        }
        self.bytes += env.bytes.len();
        self.records.push((env.commit_lsn, env.bytes));
        if env.last {
            self.ack = Some(Lsn(env.end_lsn));
            self.transactions += 1;
        }
        crash(hooks, CrashPoint::ReceivedNotAppended)?;
        // A large transaction's chunks go to disk as they come, so memory
        // stays bounded; the source is acknowledged only at the end of a
        // complete transaction.
        if self.bytes >= BATCH_BYTES {
            self.write(log, stream, stats)?;
        }
        Ok(())
    }

    /// Writes the records (not yet durable); their acknowledgement waits
    /// in `written` for an fsync.
    fn write<S: Storage>(
        &mut self,
        log: &Log<S>,
        stream: &mut impl SourceStream,
        stats: &mut CaptureStats,
    ) -> Result<(), CaptureError> {
        #[cfg(test)]
        if mutation::ACK_BEFORE_APPEND.with(std::cell::Cell::get)
            && let Some(ack) = self.ack.take()
        {
            stream.set_durable(ack);
        }
        #[cfg(not(test))]
        let _ = stream;
        if self.records.is_empty() {
            if let Some(ack) = self.ack.take() {
                self.written
                    .push_back((log.written_end(), Some(ack), self.transactions));
                self.transactions = 0;
            }
            return Ok(());
        }
        let written = log.write_batch(
            self.records
                .iter()
                .map(|(lsn, bytes)| (*lsn, bytes.as_slice())),
        )?;
        stats.envelopes += self.records.len() as u64;
        self.records.clear();
        self.bytes = 0;
        self.written
            .push_back((written.end, self.ack.take(), self.transactions));
        self.transactions = 0;
        Ok(())
    }

    /// Everything written up to `durable` (an end offset) is durable: the
    /// source may move past it.
    fn acknowledge(
        &mut self,
        durable: u64,
        stream: &mut impl SourceStream,
        hooks: &dyn CrashHooks,
    ) -> Result<(), CaptureError> {
        let mut ack = None;
        let mut appended = false;
        while let Some(&(end, lsn, transactions)) = self.written.front()
            && end <= durable
        {
            self.written.pop_front();
            appended = true;
            ack = lsn.or(ack);
            if let Some(captured) = &self.captured {
                captured.inc_by(transactions);
            }
        }
        if appended {
            crash(hooks, CrashPoint::AppendedNotAcknowledged)?;
        }
        if let Some(ack) = ack {
            stream.set_durable(ack);
        }
        Ok(())
    }

    /// A lost session ended with writes not known durable: an fsync in
    /// flight may make them so after it, and the next session then skips
    /// them as duplicates. So they are counted here once their sync
    /// returns; nothing is acknowledged, the stream is gone.
    async fn settle<S: Storage>(&mut self, log: &Log<S>) {
        if let Some(&(end, _, _)) = self.written.back()
            && log.sync_through(end).await.is_ok()
        {
            for (_, _, transactions) in self.written.drain(..) {
                if let Some(captured) = &self.captured {
                    captured.inc_by(transactions);
                }
            }
        }
    }

    /// An idle position waits, and the last advance is `every` ago.
    fn advance_due(&self, every: Duration) -> bool {
        self.idle.is_some() && self.advanced_at.is_none_or(|at| at.elapsed() >= every)
    }

    /// Moves the source past the idle keepalive position: everything
    /// before it durable first, then the position recorded in the log
    /// (the source-ack cursor), and only then acknowledged.
    async fn advance<S: Storage>(
        &mut self,
        log: &Log<S>,
        stream: &mut impl SourceStream,
        stats: &mut CaptureStats,
        hooks: &dyn CrashHooks,
    ) -> Result<(), CaptureError> {
        self.flush(log, stream, stats, hooks).await?;
        self.advanced_at = Some(tokio::time::Instant::now());
        if let Some(idle) = self.idle.take()
            && idle > stream.durable()
        {
            log.commit_cursor(
                SOURCE_ACK,
                CursorPosition {
                    next_offset: log.next_offset(),
                    last_commit_lsn: Some(idle.0),
                },
            )?;
            stream.set_durable(idle);
        }
        Ok(())
    }

    /// Ends the session at the join boundary `at`: whatever is received
    /// is made durable, and the source is acknowledged to `at`. Called
    /// once the stream shows a position at or past `at`, so every
    /// transaction committed before it was received, and none at or past
    /// it was taken: the next session replays exactly those.
    async fn rejoin<S: Storage>(
        &mut self,
        at: Lsn,
        log: &Log<S>,
        stream: &mut impl SourceStream,
        stats: &mut CaptureStats,
        hooks: &dyn CrashHooks,
    ) -> CaptureError {
        self.idle = Some(at);
        if let Err(e) = self.advance(log, stream, stats, hooks).await {
            return e;
        }
        match stream.send_status().await {
            Ok(()) => CaptureError::Rejoin { at },
            Err(e) => e.into(),
        }
    }

    /// The error capture stops with. A refused message (fail closed) stops
    /// it, but everything assembled before it is whole and committed: that
    /// is made durable and acknowledged first, or every rerun would lose it
    /// again at the same place.
    async fn stop_at<S: Storage>(
        &mut self,
        error: CaptureError,
        log: &Log<S>,
        stream: &mut impl SourceStream,
        stats: &mut CaptureStats,
        hooks: &dyn CrashHooks,
    ) -> CaptureError {
        if !matches!(error, CaptureError::Assembly(_) | CaptureError::Decode(_)) {
            return error;
        }
        if let Err(e) = self.flush(log, stream, stats, hooks).await {
            return e;
        }
        match stream.send_status().await {
            Ok(()) => error,
            Err(e) => e.into(),
        }
    }

    /// Writes everything and returns once all of it is durable and
    /// acknowledged.
    async fn flush<S: Storage>(
        &mut self,
        log: &Log<S>,
        stream: &mut impl SourceStream,
        stats: &mut CaptureStats,
        hooks: &dyn CrashHooks,
    ) -> Result<(), CaptureError> {
        self.write(log, stream, stats)?;
        if let Some(&(end, _, _)) = self.written.back() {
            log.sync_through(end).await?;
            self.acknowledge(end, stream, hooks)?;
        }
        Ok(())
    }
}

/// Held changes go to the log like the others; each sink holds at them.
fn say_held<'a>(
    flow: &str,
    events: impl IntoIterator<Item = &'a trellara_common::envelope::DdlEvent>,
) {
    for event in events.into_iter().filter(|e| !e.held.is_empty()) {
        tracing::warn!(flow = %flow, change = %event.statement, why = %event.held, "schema change held: it goes to the log, and each sink holds its transaction until the change is accepted (`trellara schema accept`) or the table copied again");
    }
}

fn crash(hooks: &dyn CrashHooks, point: CrashPoint) -> Result<(), CaptureError> {
    if hooks.crash_at(point) {
        return Err(CaptureError::Crashed(point));
    }
    Ok(())
}

/// A session's state between events.
struct Session<'a, 'c> {
    assembler: &'a mut Assembler,
    in_stream_block: &'a mut bool,
    batch: &'a mut Batch,
    resume: Resume,
    stats: &'a mut CaptureStats,
    catalog: &'a mut crate::contract::SourceCatalog<'c>,
    /// Changes accepted so far (each re-pins a description to store).
    repinned: &'a mut u64,
}

async fn handle_event<S: Storage>(
    event: ReplicationEvent,
    config: &CaptureConfig,
    state: &mut Session<'_, '_>,
    log: &Log<S>,
    stream: &mut impl SourceStream,
    hooks: &dyn CrashHooks,
) -> Result<(), CaptureError> {
    let Session {
        assembler,
        in_stream_block,
        batch,
        resume,
        stats,
        catalog,
        repinned,
    } = state;
    match event {
        ReplicationEvent::XLogData { start, data, .. } => {
            let ctx = DecodeContext {
                version: config.proto_version,
                in_stream_block: **in_stream_block,
            };
            let message = pgoutput::decode(&data, ctx)?;
            let past = match &message {
                Message::Begin(b) => Some(b.final_lsn),
                Message::StreamCommit(c) => Some(c.commit_lsn),
                _ => None,
            };
            if let Some(at) = config.rejoin_at
                && past.is_some_and(|lsn| Lsn(lsn) >= at)
            {
                return Err(batch.rejoin(at, log, stream, stats, hooks).await);
            }
            if let (Message::Begin(_), Some(begun)) = (&message, &config.begun) {
                begun.notify_one();
                // Even when the rest is already here: the applier's BEGIN
                // goes out first, and the target wakes while this decodes.
                // Not mid-burst (records waiting to be written): then the
                // applier is busy and the yield would only cost.
                if batch.records.is_empty() {
                    tokio::task::yield_now().await;
                }
            }
            match message {
                Message::StreamStart(_) => **in_stream_block = true,
                Message::StreamStop => **in_stream_block = false,
                _ => {}
            }
            if let (Message::StreamCommit(commit), Some(flow)) = (&message, &config.ddl) {
                let unfilled = assembler.unfilled(commit.xid);
                if !unfilled.is_empty() {
                    let events = crate::contract::complete(unfilled, &mut **catalog).await?;
                    say_held(&flow.name, &events);
                    assembler.fill(commit.xid, events);
                }
            }
            if let (Message::Relation(rel), Some(_)) = (&message, &config.ddl)
                && let Some(drift) = assembler.drift(rel)
                && assembler
                    .open_commit_lsn()
                    .is_some_and(|lsn| Lsn(lsn) <= resume.commit_lsn)
            {
                // A transaction the log holds already (with its change):
                // it is dropped as a duplicate, the pin just moves.
                assembler.accept(drift, Vec::new())?;
                **repinned += 1;
                return Ok(());
            }
            if let (Message::Relation(rel), Some(flow)) = (&message, &config.ddl)
                && let Some(drift) = assembler.drift(rel)
            {
                // Everything before the change goes out first: nothing
                // waits on the catalog read but the change's transaction.
                while assembler
                    .emit_next(&mut |env: Assembled| {
                        batch.take(env, *resume, log, stream, stats, hooks)
                    })
                    .map_err(|e| match e {
                        AssembleOrSink::Assembly(e) => e.into(),
                        AssembleOrSink::Sink(e) => e,
                    })?
                {}
                let events = crate::contract::explain(flow, &drift, &mut **catalog).await?;
                for (event, _) in events.iter().filter(|(e, _)| e.held.is_empty()) {
                    tracing::info!(flow = %flow.name, relation = %drift.relation, change = %event.statement, "schema change accepted: it goes to the log ahead of the rows under it");
                }
                say_held(&flow.name, events.iter().map(|(e, _)| e));
                assembler.accept(drift, events)?;
                **repinned += 1;
                return Ok(());
            }
            let mut emit = |env: Assembled| batch.take(env, *resume, log, stream, stats, hooks);
            match assembler.handle(message, start.0, &mut emit) {
                Ok(()) => {}
                Err(AssembleOrSink::Assembly(e)) => return Err(e.into()),
                Err(AssembleOrSink::Sink(e)) => return Err(e),
            }
        }
        ReplicationEvent::Keepalive {
            wal_end,
            reply_requested,
        } => {
            // Mid-transaction a keepalive can pass the boundary before
            // that transaction's commit below it is received.
            if let Some(at) = config.rejoin_at
                && wal_end >= at
                && !assembler.in_transaction()
            {
                return Err(batch.rejoin(at, log, stream, stats, hooks).await);
            }
            // Everything up to wal_end was sent and processed: with nothing
            // open here, no committed transaction lies below it that is not
            // in the batch or the log. The source may move there once all
            // of that is durable.
            let open = assembler.in_transaction();
            #[cfg(test)]
            let open = open && !mutation::KEEPALIVE_IN_TRANSACTION.with(std::cell::Cell::get);
            if !open {
                batch.idle = batch.idle.max(Some(wal_end));
            }
            // The streaming loop advances to it when due; a reply the
            // server asks for reports it at once.
            if reply_requested {
                batch.advance(log, stream, stats, hooks).await?;
                stream.send_status().await?;
                crash(hooks, CrashPoint::Acknowledged)?;
            }
        }
    }
    Ok(())
}

fn check_slot(
    config: &CaptureConfig,
    info: &trellara_external_relay::pgwire::SlotInfo,
    resume: Resume,
) -> Result<(), CaptureError> {
    if info.plugin.as_deref() != Some("pgoutput") {
        return Err(CaptureError::WrongPlugin {
            slot: config.slot.clone(),
            plugin: info.plugin.clone().unwrap_or_default(),
        });
    }
    if let Some(reason) = &info.invalidation_reason {
        return Err(CaptureError::Invalidated {
            slot: config.slot.clone(),
            reason: reason.clone(),
        });
    }
    if info.wal_status.as_deref() == Some("lost") {
        return Err(CaptureError::Invalidated {
            slot: config.slot.clone(),
            reason: "wal_status lost".into(),
        });
    }
    let known = resume.ack_lsn.max(config.floor);
    if let Some(confirmed) = info.confirmed_flush_lsn
        && known.is_valid()
        && confirmed > known
    {
        return Err(CaptureError::SlotAhead {
            slot: config.slot.clone(),
            confirmed,
            durable: known,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellara_common::sample;

    fn capture_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .expect("tasks")
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "capture")
            })
            .count()
    }

    /// A round dropped mid-capture (its lock lost) may be followed at once
    /// by the next, which opens the same log: the dropped one's thread
    /// must be gone by then, not still connecting or writing.
    #[test]
    fn a_dropped_capture_leaves_no_thread_behind() {
        let port = trellara_tests::endpoints::mute_peer();
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("log");
        let config = CaptureConfig {
            source: format!("postgresql://u@127.0.0.1:{port}/db?connect_timeout=30")
                .parse()
                .expect("url"),
            slot: "s".into(),
            publications: vec!["p".into()],
            create_slot: false,
            source_id: "s".into(),
            dataset_id: "d".into(),
            log_dir: dir.path().to_path_buf(),
            proto_version: ProtoVersion::V2,
            memory_budget: 1 << 20,
            chunk_bytes: 1 << 16,
            status_interval: Duration::from_secs(10),
            max_backoff: Duration::from_secs(1),
            pinned: HashMap::new(),
            schemas: HashMap::new(),
            floor: Lsn::ZERO,
            progress: None,
            begun: None,
            observe: None,
            rejoin_at: None,
            ddl: None,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let started = std::time::Instant::now();
        runtime.block_on(async {
            let capture = run_on_own_thread(config, log, std::future::pending());
            let ended = tokio::time::timeout(Duration::from_millis(300), capture).await;
            assert!(ended.is_err(), "capture of a mute peer ended: {ended:?}");
        });
        assert_eq!(capture_threads(), 0, "the dropped capture's thread runs on");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "dropping capture waited for its connect"
        );
    }

    #[test]
    fn resume_ignores_a_chunk_run_cut_by_a_crash() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("open");
        let append = |commit, index, count| {
            let bytes = envelope::encode(&sample::chunk(commit, index, count)).expect("valid");
            log.append(commit, &bytes).expect("append");
        };
        append(0x1000, 0, 2);
        append(0x1000, 1, 2);
        append(0x2000, 0, 3);
        append(0x2000, 1, 3);
        let resume = read_resume(&log).expect("resume");
        // The last complete transaction is 0x1000: streaming restarts after
        // it, so 0x2000 comes again whole and is not taken for a duplicate.
        assert_eq!(
            (resume.commit_lsn, resume.ack_lsn),
            (Lsn(0x1000), Lsn(0x1010))
        );

        append(0x2000, 0, 3);
        append(0x2000, 1, 3);
        append(0x2000, 2, 3);
        let resume = read_resume(&log).expect("resume");
        assert_eq!(
            (resume.commit_lsn, resume.ack_lsn),
            (Lsn(0x2000), Lsn(0x2010))
        );
    }

    /// A session lost while its last write's fsync runs: the next session
    /// skips those transactions as duplicates (they turn durable), so they
    /// are counted as the session ends, once, and nothing is acknowledged.
    #[tokio::test]
    async fn a_lost_session_counts_what_its_last_fsync_makes_durable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, _) = Log::open(FsStorage::new(), dir.path(), LogConfig::default()).expect("open");
        let captured = prometheus::IntCounter::new("c", "c").expect("counter");
        let mut batch = Batch {
            captured: Some(captured.clone()),
            ..Batch::default()
        };
        for commit in [0x1000u64, 0x2000] {
            let bytes = envelope::encode(&sample::chunk(commit, 0, 1)).expect("valid");
            batch.records.push((commit, bytes));
            batch.ack = Some(Lsn(commit + 0x10));
            batch.transactions += 1;
            let written = log
                .write_batch(batch.records.iter().map(|(l, b)| (*l, b.as_slice())))
                .expect("write");
            batch.records.clear();
            batch
                .written
                .push_back((written.end, batch.ack.take(), batch.transactions));
            batch.transactions = 0;
        }
        assert_eq!(captured.get(), 0, "nothing counted before it is durable");
        batch.settle(&log).await;
        assert_eq!(captured.get(), 2);
        assert!(batch.written.is_empty());
        assert_eq!(read_resume(&log).expect("resume").commit_lsn, Lsn(0x2000));
        batch.settle(&log).await;
        assert_eq!(captured.get(), 2, "counted once");
    }

    #[test]
    fn the_source_ack_cursor_never_holds_retention() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = LogConfig {
            max_segment_bytes: 4096,
            retention: crate::log::RetentionPolicy {
                max_total_bytes: Some(8192),
                ..crate::log::RetentionPolicy::keep_all()
            },
            ..LogConfig::default()
        };
        let (log, _) = Log::open(FsStorage::new(), dir.path(), config).expect("open");
        log.register_consumer(SOURCE_ACK).expect("register");
        let ack = CursorPosition {
            next_offset: 0,
            last_commit_lsn: Some(0x42),
        };
        log.commit_cursor(SOURCE_ACK, ack).expect("ack");
        let payload = vec![7u8; 1000];
        for i in 0..40 {
            log.append(i, &payload).expect("append");
        }
        log.register_consumer("applier-x").expect("applier");
        log.commit_cursor("applier-x", CursorPosition::after(39, 39))
            .expect("applied");
        let held = log.enforce_retention().expect("retention");
        assert!(
            held.deleted.is_empty() && held.under_pressure(),
            "the stale source-ack offset holds segments"
        );
        release_source_ack(&log).expect("release");
        let freed = log.enforce_retention().expect("retention");
        assert!(
            !freed.deleted.is_empty() && !freed.under_pressure(),
            "{freed:?}"
        );
        assert_eq!(
            log.cursor(SOURCE_ACK).and_then(|c| c.last_commit_lsn),
            Some(0x42),
            "the acknowledged LSN is kept"
        );
    }
}
