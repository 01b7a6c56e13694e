//! The native capture worker: a background worker that drives logical
//! decoding of its slot through the `trellara` output plugin, puts each frame
//! into the shared-memory ring, writes the ring to the local relay's Unix
//! socket and moves the slot only to what the relay acknowledged as durable.
//!
//! ```text
//!  WAL ─▶ XLogReadRecord (page_read: waits for WAL, pumping the socket meanwhile)
//!          └▶ LogicalDecodingProcessRecord ─▶ plugin commit ─▶ do_write ─▶ ring push
//!                                                         (full: backpressured, pump until a slot frees)
//!  ring front ─▶ socket (non-blocking) ─▶ relay: reassemble, append, fsync ─▶ Ack(end LSN)
//!  Ack ─▶ LogicalConfirmReceivedLocation(end LSN) ─▶ slot confirmed_flush
//! ```
//!
//! One process does both decoding and sending, between decoding steps (the
//! way a walsender does), so the ring is the bound on frames decoded but not
//! yet handed to the kernel: 16 x 64 KiB at most.
//!
//! Invariants:
//! - **Publish before acknowledge.** `LogicalConfirmReceivedLocation` is only
//!   ever called with an LSN the relay acknowledged, after its fsync.
//! - **Replay, never skip.** Every session starts decoding at the slot's
//!   restart LSN and lets the relay drop what it already holds: a restart
//!   (crash, SIGTERM, lost relay) costs duplicates, never a gap.
//! - **No gap across logs.** If the slot is confirmed past the end of the
//!   relay's log, the worker fails closed and decodes nothing.
//! - **Relay down never blocks the server.** The worker waits with capped
//!   exponential backoff; the slot stays where it is.
use crate::shmem::{self, Queue, WorkerState};
use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting};
use pgrx::prelude::*;
use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};
use trellara_common::native_wire::{self, HEADER_LEN, Hello, RelayMessage};

static ENABLED: GucSetting<bool> = GucSetting::<bool>::new(false);
static DATABASE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(c"postgres"));
static SLOT: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"trellara"));
static SOURCE_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static DATASET_ID: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static SOCKET_PATH: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static TABLES: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
static QUEUE_CAPACITY: GucSetting<i32> = GucSetting::<i32>::new(16);
static MAX_BACKOFF_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);
static RELAY_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(10_000);

const WORKER_NAME: &str = "trellara capture";

/// Defines the `trellara.*` settings (from `_PG_init`).
pub fn define_gucs() {
    GucRegistry::define_bool_guc(
        c"trellara.enabled",
        c"Start the native capture worker with the server.",
        c"With trellara in shared_preload_libraries, starts one capture worker at server start (restarted after a crash). trellara.start_worker() starts one on demand instead.",
        &ENABLED,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"trellara.database",
        c"Database the boot-time capture worker connects to.",
        c"The slot's database. Workers started with trellara.start_worker() use the caller's database.",
        &DATABASE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"trellara.slot",
        c"Logical replication slot (plugin trellara) the worker decodes.",
        c"",
        &SLOT,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"trellara.source_id",
        c"source.source_id of every envelope the worker emits (required).",
        c"",
        &SOURCE_ID,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"trellara.dataset_id",
        c"source.dataset_id of every envelope (default: the database name).",
        c"",
        &DATASET_ID,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"trellara.socket_path",
        c"The local relay's Unix socket (mode 0600, owned by the server's OS user).",
        c"",
        &SOCKET_PATH,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"trellara.tables",
        c"Comma-separated schema.table list to capture (default: every table).",
        c"",
        &TABLES,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"trellara.queue_capacity",
        c"Frames (64 KiB each) the shared-memory queue may hold before decoding waits.",
        c"",
        &QUEUE_CAPACITY,
        1,
        shmem::SLOTS as i32,
        GucContext::Sighup,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"trellara.max_backoff",
        c"Longest wait between attempts to reach the relay.",
        c"",
        &MAX_BACKOFF_MS,
        100,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"trellara.relay_timeout",
        c"How long the relay may take to answer the worker's hello.",
        c"",
        &RELAY_TIMEOUT_MS,
        100,
        3_600_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
}

/// Registers the boot-time worker when `trellara.enabled` is on.
pub fn register_static_worker() {
    if !ENABLED.get() {
        return;
    }
    BackgroundWorkerBuilder::new(WORKER_NAME)
        .set_type(WORKER_NAME)
        .set_library("trellara")
        .set_function("trellara_worker_main")
        .enable_spi_access()
        .set_restart_time(Some(Duration::from_secs(1)))
        .set_argument(Some(pg_sys::Datum::from(0u32)))
        .set_extra("1")
        .load();
}

/// `trellara.start_worker()`: starts a capture worker for the calling
/// database, configured by the `trellara.*` settings in the server's
/// configuration files (ALTER SYSTEM; the worker rereads them at start).
#[pg_extern(sql = false)]
fn start_worker() -> i32 {
    let Some(queue) = shmem::get() else {
        error!(
            "trellara is not in shared_preload_libraries; set shared_preload_libraries = 'trellara' and restart the server"
        );
    };
    let status = queue.status();
    if status.pid != 0 && backend_alive(status.pid) {
        error!(
            "a trellara capture worker is already running (pid {}); stop it first with SELECT trellara.stop_worker()",
            status.pid
        );
    }
    queue.set_stop_requested(false);
    let generation = queue.next_generation();
    // SAFETY: a backend global set at connection start.
    let database = unsafe { pg_sys::MyDatabaseId };
    let worker = BackgroundWorkerBuilder::new(WORKER_NAME)
        .set_type(WORKER_NAME)
        .set_library("trellara")
        .set_function("trellara_worker_main")
        .enable_spi_access()
        .set_restart_time(Some(Duration::from_secs(1)))
        .set_argument(Some(pg_sys::Datum::from(database.to_u32())))
        .set_extra(&generation.to_string())
        // SAFETY: a backend global.
        .set_notify_pid(unsafe { pg_sys::MyProcPid })
        .load_dynamic()
        .unwrap_or_else(|_| {
            error!(
                "could not register the trellara capture worker: max_worker_processes is exhausted"
            )
        });
    match worker.wait_for_startup() {
        Ok(pid) => pid,
        Err(status) => error!("the trellara capture worker did not start: {status:?}"),
    }
}

/// `trellara.stop_worker()`: stops the capture worker for good (until the
/// next start_worker or server start); the slot stays where the relay's
/// last acknowledgement put it. Returns whether a worker was running.
#[pg_extern(sql = false)]
fn stop_worker() -> bool {
    let Some(queue) = shmem::get() else {
        return false;
    };
    queue.set_stop_requested(true);
    let pid = queue.status().pid;
    let running = pid != 0 && backend_alive(pid);
    if running {
        let _ = Spi::get_one_with_args::<bool>("SELECT pg_terminate_backend($1)", &[pid.into()]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && backend_alive(pid) {
            std::thread::sleep(Duration::from_millis(20));
            pg_sys::check_for_interrupts!();
        }
        queue.clear_pid(pid);
    }
    // A registration PostgreSQL restarts later sees stop_requested and
    // exits for good; say so now rather than showing its last state.
    queue.set_state(WorkerState::Stopped, "stopped by trellara.stop_worker()");
    running
}

fn backend_alive(pid: i32) -> bool {
    // Not pg_stat_activity: its snapshot is fixed for the transaction, so a
    // loop waiting for the worker to exit would never see it go.
    // SAFETY: a lookup in the shared proc array by pid.
    pid != 0 && !unsafe { pg_sys::BackendPidGetProc(pid) }.is_null()
}

/// What one worker run needs, read at its start.
#[derive(Debug, Clone)]
struct Config {
    slot: String,
    source_id: String,
    dataset_id: Option<String>,
    tables: Option<String>,
    socket_path: String,
    queue_capacity: u32,
    max_backoff: Duration,
    relay_timeout: Duration,
}

fn setting(guc: &GucSetting<Option<CString>>) -> Option<String> {
    guc.get()
        .and_then(|v| v.into_string().ok())
        .filter(|v| !v.is_empty())
}

impl Config {
    fn read() -> Result<Config, String> {
        let required = |guc, name: &str| {
            setting(guc).ok_or_else(|| {
                format!(
                    "{name} is not set; ALTER SYSTEM SET {name} = '...' and SELECT pg_reload_conf()"
                )
            })
        };
        Ok(Config {
            slot: required(&SLOT, "trellara.slot")?,
            source_id: required(&SOURCE_ID, "trellara.source_id")?,
            dataset_id: setting(&DATASET_ID),
            tables: setting(&TABLES),
            socket_path: required(&SOCKET_PATH, "trellara.socket_path")?,
            queue_capacity: QUEUE_CAPACITY.get().clamp(1, shmem::SLOTS as i32) as u32,
            max_backoff: Duration::from_millis(MAX_BACKOFF_MS.get().max(100) as u64),
            relay_timeout: Duration::from_millis(RELAY_TIMEOUT_MS.get().max(100) as u64),
        })
    }
}

/// Entry point of the capture worker (`bgw_function_name`).
#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn trellara_worker_main(arg: pg_sys::Datum) {
    // SIGTERM uses PostgreSQL's die(): CHECK_FOR_INTERRUPTS ends the process
    // cleanly (the slot is released by PostgreSQL's exit callbacks).
    // SAFETY: installing a PostgreSQL signal handler in our own process
    // before signals are unblocked.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        pg_sys::pqsignal(pg_sys::SIGTERM as c_int, Some(c::die));
        #[cfg(feature = "pg18")]
        pg_sys::pqsignal_be(pg_sys::SIGTERM as c_int, Some(c::die));
    }
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP);
    let Some(queue) = shmem::get() else {
        return;
    };
    // SAFETY: a backend global.
    let pid = unsafe { pg_sys::MyProcPid };
    let generation: u64 = BackgroundWorker::get_extra().parse().unwrap_or(1);
    if !queue.claim(generation, pid) {
        // Replaced by a newer start_worker(): exit code 0 unregisters us.
        // SAFETY: ends this process; nothing was acquired yet.
        unsafe { pg_sys::proc_exit(0) };
    }
    if queue.status().stop_requested {
        queue.set_state(WorkerState::Stopped, "stopped by trellara.stop_worker()");
        queue.clear_pid(pid);
        // SAFETY: exit code 0 unregisters the worker (no restart).
        unsafe { pg_sys::proc_exit(0) };
    }
    let database = arg.value() as u32;
    if database == 0 {
        let name = setting(&DATABASE).unwrap_or_else(|| "postgres".into());
        BackgroundWorker::connect_worker_to_spi(Some(&name), None);
    } else {
        BackgroundWorker::connect_worker_to_spi_by_oid(Some(pg_sys::Oid::from(database)), None);
    }
    // Dynamic workers may start before the postmaster applied the
    // pg_reload_conf() that configured them: read the files ourselves.
    // SAFETY: the standard SIGHUP processing, outside any transaction.
    unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    // Values are written by the types' output functions in this session:
    // the same settings as the external path's replication sessions
    // (times in UTC, ISO dates), so both paths write the same text.
    for (name, value) in [
        (c"TimeZone", c"UTC"),
        (c"DateStyle", c"ISO"),
        (c"IntervalStyle", c"postgres"),
        (c"extra_float_digits", c"3"),
    ] {
        // SAFETY: valid NUL-terminated names and values; session-level GUC
        // assignments in a connected background worker.
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
            );
        }
    }
    queue.set_state_unless_failed(WorkerState::Starting, "");
    let config = match Config::read() {
        Ok(config) => config,
        Err(reason) => {
            fail_closed_and_wait(&queue, &reason, Duration::from_secs(5));
            return;
        }
    };

    let mut backoff = Duration::from_millis(250);
    loop {
        if queue.status().stop_requested {
            queue.set_state(WorkerState::Stopped, "stopped by trellara.stop_worker()");
            queue.clear_pid(pid);
            // SAFETY: see above.
            unsafe { pg_sys::proc_exit(0) };
        }
        match connect(&config) {
            Ok((stream, durable_end)) => {
                backoff = Duration::from_millis(250);
                // Record why decoding failed before PostgreSQL ends the
                // process (a relay failure was recorded as such already).
                pgrx::PgTryBuilder::new(|| session(&config, queue, stream, durable_end))
                    .catch_others(|error| {
                        let message = match &error {
                            pgrx::pg_sys::panic::CaughtError::PostgresError(r)
                            | pgrx::pg_sys::panic::CaughtError::ErrorReport(r) => {
                                r.message().to_owned()
                            }
                            pgrx::pg_sys::panic::CaughtError::RustPanic { ereport, .. } => {
                                ereport.message().to_owned()
                            }
                        };
                        if queue.status().state != WorkerState::WaitingForRelay {
                            queue.set_state(WorkerState::FailedClosed, &message);
                        }
                        error.rethrow()
                    })
                    .execute();
            }
            Err(Connect::Retry(reason)) => {
                queue.set_state(
                    WorkerState::WaitingForRelay,
                    &format!("{reason}; retrying in {} ms", backoff.as_millis()),
                );
                sleep(backoff);
                backoff = (backoff * 2).min(config.max_backoff);
            }
            Err(Connect::Refuse(reason)) => {
                fail_closed_and_wait(&queue, &reason, config.max_backoff);
            }
        }
    }
}

fn fail_closed_and_wait(queue: &Queue, reason: &str, wait: Duration) {
    queue.set_state(WorkerState::FailedClosed, reason);
    log!("trellara capture worker: {reason}");
    sleep(wait);
}

/// Sleeps on the process latch (SIGTERM and postmaster death end it).
fn sleep(duration: Duration) {
    let deadline = Instant::now() + duration;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        // SAFETY: our own latch; WL_EXIT_ON_PM_DEATH exits if the
        // postmaster dies.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as c_int,
                left.as_millis().min(1000) as std::ffi::c_long,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        pg_sys::check_for_interrupts!();
    }
}

enum Connect {
    /// The relay is not there (yet): back off and try again.
    Retry(String),
    /// Something is wrong that retrying will not fix quickly.
    Refuse(String),
}

/// The uid of the process at the other end of a connected Unix socket.
fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the descriptor is a connected Unix socket owned by `stream`;
    // `cred` and `len` are valid for writes of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Connects, checks who owns the socket, says hello, reads the welcome.
fn connect(config: &Config) -> Result<(UnixStream, u64), Connect> {
    let path = &config.socket_path;
    let meta =
        std::fs::metadata(path).map_err(|e| Connect::Retry(format!("relay socket {path}: {e}")))?;
    // SAFETY: DataDir is set at startup and owned by the server's OS user.
    let data_dir = unsafe { CStr::from_ptr(pg_sys::DataDir) }
        .to_string_lossy()
        .into_owned();
    let server_uid = std::fs::metadata(&data_dir)
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    if meta.uid() != server_uid {
        return Err(Connect::Refuse(format!(
            "relay socket {path} is owned by uid {}, not the server's uid {server_uid}; the relay must run as the server's OS user",
            meta.uid()
        )));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(Connect::Refuse(format!(
            "relay socket {path} has mode {:o}; it must be 0600",
            meta.permissions().mode() & 0o777
        )));
    }
    let mut stream = UnixStream::connect(path)
        .map_err(|e| Connect::Retry(format!("connect to relay socket {path}: {e}")))?;
    let io = |e: std::io::Error| Connect::Retry(format!("relay socket {path}: {e}"));
    // The file checked above may have been swapped before the connect:
    // what counts is who answered. Only the server's own OS user may see
    // the rows and move the slot.
    let peer = peer_uid(&stream).map_err(io)?;
    if peer != server_uid {
        return Err(Connect::Refuse(format!(
            "relay socket {path} was answered by uid {peer}, not the server's uid {server_uid}; the relay must run as the server's OS user"
        )));
    }
    stream
        .set_read_timeout(Some(config.relay_timeout))
        .map_err(io)?;
    stream
        .set_write_timeout(Some(config.relay_timeout))
        .map_err(io)?;
    let hello = Hello {
        // SAFETY: reads pg_control's identifier from shared memory.
        system_identifier: unsafe { pg_sys::GetSystemIdentifier() },
        slot: config.slot.clone(),
    }
    .encode()
    .map_err(|e| Connect::Refuse(format!("trellara.slot: {e}")))?;
    stream.write_all(&hello).map_err(io)?;
    let mut header = [0u8; HEADER_LEN];
    stream.read_exact(&mut header).map_err(io)?;
    let mut buf = header.to_vec();
    loop {
        match RelayMessage::decode(&buf) {
            Ok(Some((RelayMessage::Welcome { durable_end }, _))) => {
                stream.set_nonblocking(true).map_err(io)?;
                return Ok((stream, durable_end));
            }
            Ok(Some((RelayMessage::Reject { reason }, _))) => {
                return Err(Connect::Refuse(format!(
                    "relay refused the worker: {reason}"
                )));
            }
            Ok(Some((other, _))) => {
                return Err(Connect::Refuse(format!(
                    "relay answered hello with {other:?}, not a welcome"
                )));
            }
            Ok(None) => {
                let mut more = [0u8; 512];
                let n = stream.read(&mut more).map_err(io)?;
                if n == 0 {
                    return Err(Connect::Retry(format!(
                        "relay socket {path}: closed during hello"
                    )));
                }
                buf.extend_from_slice(more.get(..n).unwrap_or_default());
            }
            Err(e) => return Err(Connect::Refuse(format!("relay socket {path}: {e}"))),
        }
    }
}

/// The live connection, reachable from the C callbacks below.
struct Session {
    queue: Queue,
    stream: UnixStream,
    socket_path: String,
    max_backoff: Duration,
    inflight: Vec<u8>,
    inflight_at: usize,
    /// End offsets in `inflight` of the ring frames it holds (none for a
    /// Progress message), and how many of them were popped.
    frame_ends: Vec<usize>,
    popped: usize,
    /// Frames queued since the last pump.
    queued: usize,
    last_pump: Instant,
    /// End of the last WAL record decoded, and whether the reorder buffer
    /// held no transaction after it: then everything committed below it
    /// has been emitted, and it may be reported as progress.
    decoded_to: u64,
    nothing_open: bool,
    progress_sent: u64,
    last_progress: Instant,
    received: Vec<u8>,
    acked: u64,
    confirmed: u64,
    last_activity: Instant,
    state: WorkerState,
}

thread_local! {
    static SESSION: RefCell<Option<Session>> = const { RefCell::new(None) };
}

/// Runs `f` on the live session; an I/O failure ends the worker process
/// with an ERROR (it restarts and replays), after recording why.
fn with_session<R>(f: impl FnOnce(&mut Session) -> Result<R, String>) -> R {
    let result = SESSION.with(|cell| {
        let mut guard = cell.borrow_mut();
        match guard.as_mut() {
            Some(session) => f(session).map_err(|e| (e, Some(session.queue))),
            None => Err((
                "trellara: decoding callback outside a worker session".into(),
                None,
            )),
        }
    });
    match result {
        Ok(r) => r,
        Err((reason, queue)) => {
            if let Some(queue) = queue {
                queue.set_state_unless_failed(WorkerState::WaitingForRelay, &reason);
            }
            error!("trellara capture worker: {reason}");
        }
    }
}

impl Session {
    /// Sends what the socket takes without blocking, reads acks, and
    /// confirms the slot up to the last one. True when anything moved.
    fn pump(&mut self) -> Result<bool, String> {
        let mut moved = false;
        self.queued = 0;
        self.last_pump = Instant::now();
        loop {
            if !self.has_inflight() {
                // Everything copied was written (and popped): take what the
                // ring holds now, in one write, or an idle Progress.
                self.inflight.clear();
                self.frame_ends.clear();
                self.inflight_at = 0;
                self.popped = 0;
                if self
                    .queue
                    .copy_all(&mut self.inflight, &mut self.frame_ends)
                    == 0
                {
                    if !self.progress_due() {
                        break;
                    }
                    self.inflight
                        .extend_from_slice(&native_wire::encode_progress(self.decoded_to));
                    self.progress_sent = self.decoded_to;
                    self.last_progress = Instant::now();
                }
            }
            let rest = self.inflight.get(self.inflight_at..).unwrap_or_default();
            match self.stream.write(rest) {
                Ok(0) => return Err(format!("relay socket {}: closed", self.socket_path)),
                Ok(n) => {
                    moved = true;
                    self.inflight_at += n;
                    // A slot is freed only once its whole frame is out.
                    let written = self
                        .frame_ends
                        .get(self.popped..)
                        .unwrap_or_default()
                        .iter()
                        .take_while(|&&end| end <= self.inflight_at)
                        .count();
                    if written > 0 {
                        self.queue.pop_n(written);
                        self.popped += written;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("write to relay socket {}: {e}", self.socket_path)),
            }
        }
        let mut buf = [0u8; 4096];
        // Acks that arrived before the relay closed still count: confirm
        // them first, then report the close.
        let mut closed = false;
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => self
                    .received
                    .extend_from_slice(buf.get(..n).unwrap_or_default()),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read from relay socket {}: {e}", self.socket_path)),
            }
        }
        let mut acks = 0u64;
        loop {
            match RelayMessage::decode(&self.received) {
                Ok(None) => break,
                Ok(Some((message, used))) => {
                    self.received.drain(..used);
                    match message {
                        RelayMessage::Ack { end_lsn } => {
                            // Nothing past what this worker decoded can be
                            // durable in the relay's log: such an Ack would
                            // move the slot over WAL never captured.
                            if end_lsn > self.decoded_to {
                                return Err(format!(
                                    "relay socket {}: the relay acknowledged {}, past what this worker decoded ({}); refusing to move the slot",
                                    self.socket_path,
                                    lsn_text(end_lsn),
                                    lsn_text(self.decoded_to)
                                ));
                            }
                            acks += 1;
                            self.acked = self.acked.max(end_lsn);
                        }
                        RelayMessage::Reject { reason } => {
                            // Replaying at once would send the same frame
                            // again: wait as long as for a missing relay.
                            let reason = format!("the relay rejected a frame: {reason}");
                            fail_closed_and_wait(&self.queue, &reason, self.max_backoff);
                            return Err(reason);
                        }
                        RelayMessage::Welcome { .. } => {
                            return Err("relay sent a second welcome".into());
                        }
                    }
                }
                Err(e) => return Err(format!("relay socket {}: {e}", self.socket_path)),
            }
        }
        if self.acked > self.confirmed {
            // SAFETY: this process holds the slot for the whole session
            // (MyReplicationSlot); the LSN is one the relay made durable.
            unsafe { pg_sys::LogicalConfirmReceivedLocation(self.acked) };
            self.confirmed = self.acked;
            self.queue.set_acked(self.acked, acks);
            moved = true;
        }
        if closed {
            return Err(format!(
                "relay socket {}: the relay closed the connection",
                self.socket_path
            ));
        }
        if moved {
            self.last_activity = Instant::now();
        }
        Ok(moved)
    }

    fn has_inflight(&self) -> bool {
        self.inflight_at < self.inflight.len()
    }

    /// Idle progress is reported at most once a second, only past what was
    /// acknowledged, and only when no transaction is open.
    fn progress_due(&self) -> bool {
        self.nothing_open
            && self.decoded_to > self.acked
            && self.decoded_to > self.progress_sent
            && self.last_progress.elapsed() >= Duration::from_secs(1)
    }

    fn set_state(&mut self, state: WorkerState, reason: &str) {
        if self.state != state {
            self.state = state;
            self.queue.set_state(state, reason);
        }
    }

    /// Waits for the socket (readable; writable when a frame is pending),
    /// new WAL flushed (PostgreSQL 16 and later), or the timeout, whichever
    /// is first.
    fn wait(&self, timeout: Duration) {
        let mut events = pg_sys::WL_LATCH_SET
            | pg_sys::WL_SOCKET_READABLE
            | pg_sys::WL_TIMEOUT
            | pg_sys::WL_EXIT_ON_PM_DEATH;
        if self.has_inflight() {
            events |= pg_sys::WL_SOCKET_WRITEABLE;
        }
        wal_flush_wakes_us();
        // SAFETY: our latch and an open socket we own.
        unsafe {
            pg_sys::WaitLatchOrSocket(
                pg_sys::MyLatch,
                events as c_int,
                self.stream.as_raw_fd(),
                timeout.as_millis().max(1) as std::ffi::c_long,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        wal_flush_wakes_us_no_more();
    }
}

/// One relay connection: acquire the slot, decode from its restart LSN
/// until an error (which ends the process) or a stop request.
fn session(config: &Config, queue: Queue, stream: UnixStream, durable_end: u64) {
    let slot = CString::new(config.slot.clone()).unwrap_or_default();
    queue.set_state(
        WorkerState::Starting,
        &format!("acquiring slot {}", config.slot),
    );
    // SAFETY: slot acquisition as a walsender's START_REPLICATION does it,
    // outside a transaction (so no CheckSlotPermissions: it reads the
    // catalog, and the worker runs as the bootstrap superuser anyway).
    // Errors (no such slot, held by another process) are ERRORs that end
    // the process after the status was set.
    unsafe {
        pg_sys::CheckLogicalDecodingRequirements();
        #[cfg(not(feature = "pg18"))]
        pg_sys::ReplicationSlotAcquire(slot.as_ptr(), true);
        #[cfg(feature = "pg18")]
        pg_sys::ReplicationSlotAcquire(slot.as_ptr(), true, true);
    }
    // SAFETY: acquired above, so MyReplicationSlot is ours.
    let (confirmed, restart, plugin) = unsafe {
        let slot = pg_sys::MyReplicationSlot;
        (
            (*slot).data.confirmed_flush,
            (*slot).data.restart_lsn,
            pg_sys::name_data_to_str(&(*slot).data.plugin).to_owned(),
        )
    };
    if plugin != "trellara" {
        // SAFETY: we hold it.
        unsafe { pg_sys::ReplicationSlotRelease() };
        fail_closed_and_wait(
            &queue,
            &format!(
                "replication slot {} uses plugin {plugin}, not trellara; create a trellara slot: SELECT pg_create_logical_replication_slot('{}', 'trellara')",
                config.slot, config.slot
            ),
            config.max_backoff,
        );
        return;
    }
    if durable_end != 0 && confirmed > durable_end {
        // SAFETY: we hold it.
        unsafe { pg_sys::ReplicationSlotRelease() };
        fail_closed_and_wait(
            &queue,
            &format!(
                "replication slot {} is confirmed up to {}, past the end of the relay's log ({}): the transactions in between are not in the log; reseed the flow",
                config.slot,
                lsn_text(confirmed),
                lsn_text(durable_end)
            ),
            config.max_backoff,
        );
        return;
    }
    // This process holds the slot: the ring is ours to start afresh.
    queue.reset(config.queue_capacity);
    SESSION.with(|cell| {
        *cell.borrow_mut() = Some(Session {
            queue,
            stream,
            socket_path: config.socket_path.clone(),
            max_backoff: config.max_backoff,
            inflight: Vec::with_capacity(trellara_common::native_frame::MAX_FRAME_BYTES),
            inflight_at: 0,
            frame_ends: Vec::with_capacity(shmem::SLOTS),
            popped: 0,
            queued: 0,
            last_pump: Instant::now(),
            decoded_to: 0,
            nothing_open: false,
            progress_sent: 0,
            last_progress: Instant::now(),
            received: Vec::new(),
            acked: confirmed,
            confirmed,
            last_activity: Instant::now(),
            state: WorkerState::Starting,
        });
    });

    let options = plugin_options(config);
    let mut routine = pg_sys::XLogReaderRoutine {
        page_read: Some(page_read),
        segment_open: Some(c::wal_segment_open),
        segment_close: Some(c::wal_segment_close),
    };
    // SAFETY: as pg_logical_slot_get_changes_guts: the decoding context
    // lives in its own memory context for the rest of this process (it
    // ends by exiting); the reader copies `routine`.
    let ctx = unsafe {
        let cx = pg_sys::AllocSetContextCreateInternal(
            pg_sys::TopMemoryContext,
            c"trellara decoding".as_ptr(),
            0,
            8 * 1024,
            8 * 1024 * 1024,
        );
        pg_sys::MemoryContextSwitchTo(cx);
        let ctx = pg_sys::CreateDecodingContext(
            pg_sys::InvalidXLogRecPtr as u64,
            options,
            false,
            &mut routine,
            Some(prepare_write),
            Some(do_write),
            None,
        );
        pg_sys::XLogBeginRead((*ctx).reader, restart);
        ctx
    };
    with_session(|s| {
        s.set_state(WorkerState::Running, "");
        Ok(())
    });
    log!(
        "trellara capture worker: decoding slot {} from {} (confirmed {}, relay log ends at {})",
        config.slot,
        lsn_text(restart),
        lsn_text(confirmed),
        lsn_text(durable_end)
    );
    loop {
        let mut errm: *mut c_char = std::ptr::null_mut();
        // SAFETY: ctx and its reader are live; errm is NULL or a message
        // owned by the reader.
        unsafe {
            let record = pg_sys::XLogReadRecord((*ctx).reader, &mut errm);
            if !errm.is_null() {
                let message = CStr::from_ptr(errm).to_string_lossy().into_owned();
                error!("trellara capture worker: could not read WAL: {message}");
            }
            if !record.is_null() {
                process_record(ctx);
            }
        }
        // SAFETY: ctx and its reader and reorder buffer are live.
        let (decoded_to, nothing_open) = unsafe {
            (
                (*(*ctx).reader).EndRecPtr,
                pg_sys::ReorderBufferGetOldestTXN((*ctx).reorder).is_null(),
            )
        };
        with_session(|s| {
            s.decoded_to = decoded_to;
            s.nothing_open = nothing_open;
            // Between records, service the socket every 8 frames or every
            // millisecond: a write and a read per WAL record would cost
            // more than decoding it. (At the end of WAL, page_read pumps
            // at once, so a caught-up worker sends each commit right away.)
            if s.queued >= 8 || s.last_pump.elapsed() >= Duration::from_millis(1) {
                s.pump().map(|_| ())
            } else {
                Ok(())
            }
        });
        pg_sys::check_for_interrupts!();
        if queue.status().stop_requested {
            queue.set_state(WorkerState::Stopped, "stopped by trellara.stop_worker()");
            // SAFETY: exit callbacks release the slot.
            unsafe { pg_sys::proc_exit(0) };
        }
    }
}

/// PostgreSQL functions used by address (callbacks and a signal handler;
/// pgrx's bindings are Rust wrappers) or that pgrx does not bind.
mod c {
    use pgrx::pg_sys;
    use std::ffi::c_int;
    unsafe extern "C-unwind" {
        // replication/decode.h, the same in 15-18.
        pub fn LogicalDecodingProcessRecord(
            ctx: *mut pg_sys::LogicalDecodingContext,
            record: *mut pg_sys::XLogReaderState,
        );
        pub fn wal_segment_open(
            state: *mut pg_sys::XLogReaderState,
            segno: pg_sys::XLogSegNo,
            tli: *mut pg_sys::TimeLineID,
        );
        pub fn wal_segment_close(state: *mut pg_sys::XLogReaderState);
        pub fn die(signal: c_int);
    }
}

/// # Safety
/// `ctx` is a live decoding context whose reader just returned a record.
unsafe fn process_record(ctx: *mut pg_sys::LogicalDecodingContext) {
    // SAFETY: per the contract; the boundary turns a PostgreSQL ERROR into
    // a Rust panic that pgrx re-raises at our #[pg_guard] entry point.
    unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| c::LogicalDecodingProcessRecord(ctx, (*ctx).reader))
    }
}

fn plugin_options(config: &Config) -> *mut pg_sys::List {
    let mut pairs = vec![("source_id", config.source_id.clone())];
    if let Some(dataset) = &config.dataset_id {
        pairs.push(("dataset_id", dataset.clone()));
    }
    if let Some(tables) = &config.tables {
        pairs.push(("tables", tables.clone()));
    }
    let mut list: *mut pg_sys::List = std::ptr::null_mut();
    for (name, value) in pairs {
        let name = CString::new(name).unwrap_or_default();
        let value = CString::new(value).unwrap_or_default();
        // SAFETY: palloc'd copies in the current memory context, as the
        // plugin's option parser (defGetString) expects.
        unsafe {
            let elem = pg_sys::makeDefElem(
                pg_sys::pstrdup(name.as_ptr()),
                pg_sys::makeString(pg_sys::pstrdup(value.as_ptr())).cast(),
                -1,
            );
            list = pg_sys::lappend(list, elem.cast());
        }
    }
    list
}

fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

/// Puts the worker on the wait list a logical walsender sleeps on:
/// `WalSndCtl->wal_replay_cv`, which every WAL flush on a primary
/// broadcasts, setting the latch of each process on it. So a commit wakes
/// the worker at once instead of at its next timeout. A flush after this
/// call and before the wait sets the latch, which the wait then sees: no
/// wakeup is lost. PostgreSQL 15 has no such list (it wakes walsenders
/// only); there the wait's timeout is the poll.
fn wal_flush_wakes_us() {
    // SAFETY: WalSndCtl is shared memory set up at startup and the worker
    // has a PGPROC; joining twice leaves it on the list once.
    #[cfg(not(feature = "pg15"))]
    unsafe {
        if !pg_sys::WalSndCtl.is_null() {
            pg_sys::ConditionVariablePrepareToSleep(&raw mut (*pg_sys::WalSndCtl).wal_replay_cv);
        }
    }
}

/// Leaves the wait list of [`wal_flush_wakes_us`] (a no-op if not on it).
fn wal_flush_wakes_us_no_more() {
    // SAFETY: only this process's own wait-list entry is touched.
    #[cfg(not(feature = "pg15"))]
    unsafe {
        pg_sys::ConditionVariableCancelSleep();
    }
}

/// How long to sleep at the end of WAL. Where a WAL flush wakes the worker
/// ([`wal_flush_wakes_us`]) the timeout is only a backstop (stop requests,
/// idle progress): polling every millisecond there cost five wakes, most of
/// the worker's CPU, per transaction of a paced source. Elsewhere it is the
/// poll: short right after activity (low commit-to-durable latency), longer
/// when idle (low CPU).
fn idle_timeout(since_activity: Duration) -> Duration {
    if flushes_wake_us() || since_activity >= Duration::from_secs(1) {
        Duration::from_millis(20)
    } else {
        Duration::from_millis(1)
    }
}

/// Whether WAL flushes broadcast to the list [`wal_flush_wakes_us`] joins:
/// PostgreSQL 16 and later do, unless `max_wal_senders = 0` (then they
/// wake no walsender, nor this worker).
fn flushes_wake_us() -> bool {
    // SAFETY: a GUC read in the worker's own process.
    !cfg!(feature = "pg15") && unsafe { pg_sys::max_wal_senders } > 0
}

/// The WAL page reader: `read_local_xlog_page_no_wait`, and at the end of
/// WAL, pump the socket and wait instead of returning (the way a walsender
/// processes replies while it waits for WAL).
#[pg_guard]
unsafe extern "C-unwind" fn page_read(
    state: *mut pg_sys::XLogReaderState,
    target_page: pg_sys::XLogRecPtr,
    req_len: c_int,
    target_rec: pg_sys::XLogRecPtr,
    buf: *mut c_char,
) -> c_int {
    loop {
        // On the list before looking, so a flush right after the look is
        // not missed.
        wal_flush_wakes_us();
        let mut nowait = pg_sys::ReadLocalXLogPageNoWaitPrivate { end_of_wal: false };
        // SAFETY: the no-wait reader uses private_data only to report
        // end_of_wal; the decoding context's pointer is put back before
        // anything else reads it.
        let read = unsafe {
            let saved = (*state).private_data;
            (*state).private_data = (&raw mut nowait).cast::<c_void>();
            let read =
                pg_sys::read_local_xlog_page_no_wait(state, target_page, req_len, target_rec, buf);
            (*state).private_data = saved;
            read
        };
        if read >= 0 || !nowait.end_of_wal {
            wal_flush_wakes_us_no_more();
            return read;
        }
        with_session(|s| {
            if !s.pump()? && !s.has_inflight() {
                s.set_state(WorkerState::Running, "");
                s.wait(idle_timeout(s.last_activity.elapsed()));
            } else if s.has_inflight() {
                s.wait(Duration::from_millis(10));
            }
            Ok(())
        });
        pg_sys::check_for_interrupts!();
        if let Some(queue) = shmem::get()
            && queue.status().stop_requested
        {
            queue.set_state(WorkerState::Stopped, "stopped by trellara.stop_worker()");
            // SAFETY: exit callbacks release the slot.
            unsafe { pg_sys::proc_exit(0) };
        }
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn prepare_write(
    ctx: *mut pg_sys::LogicalDecodingContext,
    _lsn: pg_sys::XLogRecPtr,
    _xid: pg_sys::TransactionId,
    _last: bool,
) {
    // SAFETY: ctx->out is the context's output buffer.
    unsafe { pg_sys::resetStringInfo((*ctx).out) };
}

/// The plugin wrote one frame: into the ring, waiting (backpressured) while
/// the ring is full.
#[pg_guard]
unsafe extern "C-unwind" fn do_write(
    ctx: *mut pg_sys::LogicalDecodingContext,
    _lsn: pg_sys::XLogRecPtr,
    _xid: pg_sys::TransactionId,
    _last: bool,
) {
    // SAFETY: ctx->out holds exactly the frame the plugin appended.
    let frame = unsafe {
        let out = (*ctx).out;
        std::slice::from_raw_parts((*out).data.cast::<u8>(), (*out).len as usize)
    };
    loop {
        let pushed = with_session(|s| {
            let pushed = s.queue.push(frame);
            s.queued += usize::from(pushed);
            Ok(pushed)
        });
        if pushed {
            break;
        }
        with_session(|s| {
            if !s.pump()? {
                s.set_state(
                    WorkerState::Backpressured,
                    "the shared-memory queue is full: the relay is not taking frames as fast as they are decoded",
                );
                s.wait(Duration::from_millis(100));
            }
            Ok(())
        });
        pg_sys::check_for_interrupts!();
    }
    with_session(|s| {
        if s.state == WorkerState::Backpressured {
            s.set_state(WorkerState::Running, "");
        }
        Ok(())
    });
}
