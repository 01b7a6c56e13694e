//! The native capture stage, relay side: the extension's background worker
//! connects to a 0600 Unix socket; its frames are validated, reassembled
//! into envelopes, appended to the durable log, fsynced, and only then
//! acknowledged with the transaction's end LSN (which the worker confirms
//! on its slot).
//!
//! ```text
//!  worker ─Hello─▶ accept (peer uid = ours) ─Welcome(durable end)─▶ worker
//!  frames ─▶ Reassembler ─▶ envelope::decode ─▶ batch ─▶ log.append_batch (fsync) ─▶ Ack(end LSN)
//!  bad frame ─▶ quarantine/native-<xxh3>.bin + Reject; the acknowledged position stays behind it
//! ```
//!
//! Invariants:
//! * **Publish, then acknowledge.** An Ack names the end LSN of a
//!   transaction whose every chunk is in the log and fsynced.
//! * **Private socket.** The socket file is 0600 in a directory no one else
//!   can write, and only a peer with our uid (the server's OS user, which is
//!   the user the relay must run as) is served.
//! * **Duplicates, never gaps.** A worker replays from its slot; transactions
//!   at or below the log's last complete one are skipped (and acknowledged).
//! * **Fail closed.** A frame that does not validate is never appended: it
//!   is kept in `quarantine/` with the reason, the worker is told why, and
//!   the connection ends.

use crate::capture::{SOURCE_ACK, read_resume};
use crate::crash::{CrashHooks, CrashPoint, NoCrash};
use crate::errors::Chain;
use crate::log::CursorPosition;
use crate::log::{Log, LogConfig, storage::FsStorage};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use trellara_common::Lsn;
use trellara_common::envelope;
use trellara_common::native_frame::{self, FrameHeader, Reassembler};
use trellara_common::native_wire::{self, Hello, RelayMessage};

#[derive(Debug, Clone)]
pub struct NativeConfig {
    pub socket_path: PathBuf,
    pub log_dir: PathBuf,
    /// Every envelope must carry this `source.source_id`.
    pub source_id: String,
    /// Largest envelope (chunk) accepted; the plugin's `chunk_bytes` bound.
    pub max_envelope_bytes: usize,
    /// Receives the acknowledged (durable) source position as it moves.
    pub progress: Option<Arc<tokio::sync::watch::Sender<Lsn>>>,
    /// Told as each frame starts, before it is read whole: the applier
    /// opens its target transaction meanwhile.
    pub begun: Option<Arc<tokio::sync::Notify>>,
    /// Where the relay counts each transaction once durable
    /// (`trellara_captured_transactions_total`) and reports the worker
    /// away or streaming again.
    pub observe: Option<crate::service::Observer>,
    /// The position a consumer downstream already holds (the applier's
    /// checkpoint end LSN). The worker takes the larger of it and the log's
    /// end as what is safe: with an empty or replaced log, a slot confirmed
    /// past both is a gap, refused, not a fresh start.
    pub floor: Lsn,
    /// The flow that owns the log ([`crate::identity`]): [`serve`] claims
    /// it, or refuses a log of another flow or source.
    pub owner: Option<crate::identity::LogOwner>,
}

#[derive(Debug, thiserror::Error)]
pub enum NativeError {
    #[error(
        "socket directory {dir} is writable by group or others (mode {mode:o})\nhint: put the socket in a directory only the server's OS user can write: chmod go-w {dir}"
    )]
    UnsafeDirectory { dir: String, mode: u32 },
    #[error(
        "{path} is owned by uid {owner}, not by this relay's uid {ours}\nhint: run the relay as the PostgreSQL server's OS user, or choose another socket path"
    )]
    ForeignOwner { path: String, owner: u32, ours: u32 },
    #[error("{path} exists and is not a socket\nhint: choose another --native-socket path")]
    NotASocket { path: String },
    #[error(
        "another relay is listening on {path}\nhint: one relay serves one socket; stop the other one"
    )]
    InUse { path: String },
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Log(#[from] crate::log::Error),
    #[error(transparent)]
    Capture(#[from] crate::capture::CaptureError),
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityError),
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> NativeError {
    let context = context.into();
    move |source| NativeError::Io { context, source }
}

/// What was relayed, for reporting and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NativeStats {
    pub connections: u64,
    pub envelopes: u64,
    pub duplicates_skipped: u64,
    pub rejected_frames: u64,
}

/// Binds the socket (after the safety checks) and serves workers until
/// `shutdown` resolves.
pub async fn serve(
    config: NativeConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<NativeStats, NativeError> {
    let _lock = crate::lock::lock(&config.log_dir).map_err(io("lock the log directory"))?;
    if let Some(owner) = &config.owner {
        crate::identity::check_dir(&config.log_dir, owner)?;
    }
    let (log, report) = Log::open(FsStorage::new(), &config.log_dir, LogConfig::default())?;
    if let Some(owner) = &config.owner {
        crate::identity::claim(&log, &config.log_dir, owner)?;
    }
    if let Some(torn) = &report.torn_tail {
        tracing::warn!(segment = %torn.segment.display(), bytes = torn.truncated_bytes, "cut torn log tail left by a crash");
    }
    serve_on(config, &log, shutdown).await
}

/// Like [`serve`], on a log the caller opened.
pub async fn serve_on(
    config: NativeConfig,
    log: &Log<FsStorage>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<NativeStats, NativeError> {
    log.register_consumer(SOURCE_ACK)?;
    let listener = bind(&config.socket_path)?;
    let _remove = RemoveOnDrop(config.socket_path.clone());
    tracing::info!(socket = %config.socket_path.display(), "listening for the native capture worker");
    let mut stats = NativeStats::default();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => accepted.map_err(io("accept on the native socket"))?,
            () = &mut shutdown => return Ok(stats),
        };
        stats.connections += 1;
        let result = tokio::select! {
            r = connection(&config, log, stream, &mut stats) => r,
            () = &mut shutdown => return Ok(stats),
        };
        match result {
            Ok(()) => {
                tracing::info!("native capture worker disconnected");
                if let Some(o) = &config.observe {
                    o.health.failed(
                        crate::service::FlowState::Retrying,
                        "capture: the native worker disconnected; waiting for it".into(),
                    );
                }
            }
            // The log refusing writes is ours to report; a worker's bad
            // frame or a dropped connection only ends that connection.
            Err(ConnectionError::Fatal(e)) => return Err(e),
            Err(ConnectionError::Ended(reason)) => {
                tracing::warn!(%reason, "native capture connection ended");
                if let Some(o) = &config.observe {
                    o.health.failed(
                        crate::service::FlowState::Retrying,
                        format!("capture: the native worker's connection ended: {reason}"),
                    );
                }
            }
        }
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Creates the listening socket with mode 0600, refusing unsafe places.
pub fn bind(path: &Path) -> Result<UnixListener, NativeError> {
    let ours = nix::unistd::geteuid().as_raw();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let dir_meta =
        std::fs::metadata(&dir).map_err(io(format!("socket directory {}", dir.display())))?;
    let mode = dir_meta.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(NativeError::UnsafeDirectory {
            dir: dir.display().to_string(),
            mode: mode & 0o7777,
        });
    }
    if dir_meta.uid() != ours {
        return Err(NativeError::ForeignOwner {
            path: dir.display().to_string(),
            owner: dir_meta.uid(),
            ours,
        });
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            if meta.uid() != ours {
                return Err(NativeError::ForeignOwner {
                    path: path.display().to_string(),
                    owner: meta.uid(),
                    ours,
                });
            }
            if !meta.file_type().is_socket() {
                return Err(NativeError::NotASocket {
                    path: path.display().to_string(),
                });
            }
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(NativeError::InUse {
                    path: path.display().to_string(),
                });
            }
            // A stale socket of ours, left by a crash.
            std::fs::remove_file(path)
                .map_err(io(format!("remove stale socket {}", path.display())))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(format!("socket path {}", path.display()))(e)),
    }
    // Bound under a temporary name, made 0600, then renamed into place: the
    // socket never exists at `path` with any other mode.
    let staging = path.with_extension(format!("binding-{}", std::process::id()));
    let _ = std::fs::remove_file(&staging);
    let listener =
        UnixListener::bind(&staging).map_err(io(format!("bind {}", staging.display())))?;
    std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o600))
        .map_err(io(format!("chmod 0600 {}", staging.display())))?;
    std::fs::rename(&staging, path).map_err(io(format!("rename into {}", path.display())))?;
    Ok(listener)
}

#[derive(Debug)]
pub(crate) enum ConnectionError {
    Fatal(NativeError),
    Ended(String),
}

fn crash(hooks: &dyn CrashHooks, point: CrashPoint) -> Result<(), ConnectionError> {
    if hooks.crash_at(point) {
        return Err(ConnectionError::Ended(format!(
            "simulated crash at {point:?}"
        )));
    }
    Ok(())
}

impl From<NativeError> for ConnectionError {
    fn from(e: NativeError) -> Self {
        ConnectionError::Fatal(e)
    }
}

/// Appends gathered in one durability wait.
const BATCH_BYTES: usize = 8 << 20;

async fn connection(
    config: &NativeConfig,
    log: &Log<FsStorage>,
    stream: UnixStream,
    stats: &mut NativeStats,
) -> Result<(), ConnectionError> {
    let ended = |what: &str| {
        let what = what.to_owned();
        move |e: std::io::Error| ConnectionError::Ended(format!("{what}: {e}"))
    };
    let ours = nix::unistd::geteuid().as_raw();
    let (read, mut write) = stream.into_split();
    let peer = read
        .as_ref()
        .peer_cred()
        .map_err(ended("read the peer's credentials"))?;
    if peer.uid() != ours {
        let reason = format!(
            "peer uid {} (pid {:?}) is not the relay's uid {ours}; only the server's OS user may connect",
            peer.uid(),
            peer.pid()
        );
        return Err(refuse(&mut write, reason).await);
    }
    let mut read = BufReader::with_capacity(256 << 10, read);
    let mut header = [0u8; native_wire::HEADER_LEN];
    read.read_exact(&mut header)
        .await
        .map_err(ended("read hello"))?;
    let hello = match Hello::name_len(&header) {
        Ok(len) => {
            let mut name = vec![0u8; len];
            read.read_exact(&mut name)
                .await
                .map_err(ended("read hello"))?;
            Hello::decode(&header, &name)
        }
        Err(e) => Err(e),
    };
    let hello = match hello {
        Ok(h) => h,
        Err(e) => return Err(refuse(&mut write, format!("bad hello: {e}")).await),
    };
    let resume = read_resume(log).map_err(NativeError::from)?;
    write
        .write_all(
            &RelayMessage::Welcome {
                durable_end: resume.ack_lsn.max(config.floor).0,
            }
            .encode(),
        )
        .await
        .map_err(ended("send welcome"))?;
    tracing::info!(slot = %hello.slot, system_identifier = hello.system_identifier, pid = ?peer.pid(), durable_end = %resume.ack_lsn, "native capture worker connected");
    if let Some(o) = &config.observe {
        o.health.state(crate::service::FlowState::Following);
    }
    serve_frames(config, log, resume, &mut read, &mut write, stats, &NoCrash).await
}

/// The relay's ordering after the hello: frames in, validated, batched,
/// appended with one fsync, then acknowledged. Generic over the log's
/// storage and the byte streams so the simulator runs this very code.
pub(crate) async fn serve_frames<S, R, W>(
    config: &NativeConfig,
    log: &Log<S>,
    resume: crate::capture::Resume,
    read: &mut BufReader<R>,
    mut write: &mut W,
    stats: &mut NativeStats,
    hooks: &dyn CrashHooks,
) -> Result<(), ConnectionError>
where
    S: crate::log::storage::Storage,
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let ended = |what: &str| {
        let what = what.to_owned();
        move |e: std::io::Error| ConnectionError::Ended(format!("{what}: {e}"))
    };

    let mut reassembler = Reassembler::new(config.max_envelope_bytes);
    let mut frame = Vec::with_capacity(native_frame::MAX_FRAME_BYTES);
    let mut pending = Pending::default();
    // Appends what is batched (one fsync), then acknowledges.
    macro_rules! flush {
        () => {
            flush(log, &mut pending, &mut write, config, stats, hooks).await?
        };
    }
    loop {
        // Group commit: append (and acknowledge) what is gathered before any
        // read that would wait - the rest of a frame may take long to come.
        if !pending.is_empty() && !next_message_buffered(read.buffer()) {
            flush!();
        }
        // A Progress message and a frame header start alike: read 16 bytes,
        // then the rest of a frame header when it is one.
        frame.resize(native_wire::HEADER_LEN, 0);
        match read.read_exact(&mut frame).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                // The worker went away; what is batched is complete
                // transactions (or chunks) and safe to keep.
                flush!();
                return Ok(());
            }
            Err(e) => return Err(ConnectionError::Ended(format!("read frame: {e}"))),
        }
        let mut first = [0u8; native_wire::HEADER_LEN];
        first.copy_from_slice(&frame);
        match native_wire::decode_progress(&first) {
            Ok(Some(lsn)) => {
                // Everything before it is appended first; then the advance
                // is made durable before it is acknowledged.
                flush!();
                let recorded = log.cursor(SOURCE_ACK).and_then(|c| c.last_commit_lsn);
                if recorded.is_none_or(|r| r < lsn) {
                    log.commit_cursor(
                        SOURCE_ACK,
                        CursorPosition {
                            next_offset: log.next_offset(),
                            last_commit_lsn: Some(lsn),
                        },
                    )
                    .map_err(NativeError::from)?;
                }
                pending.ack = Some(lsn);
                flush!();
                continue;
            }
            Ok(None) => {
                if let Some(begun) = &config.begun {
                    begun.notify_one();
                    // The applier's BEGIN goes out before this frame is
                    // read, checked and logged (not mid-burst, when it is
                    // busy anyway).
                    if pending.is_empty() {
                        tokio::task::yield_now().await;
                    }
                }
            }
            Err(e) => {
                let reason = Chain(&e).to_string();
                return Err(reject(config, &mut write, &frame, &reason, stats).await);
            }
        }
        frame.resize(native_frame::HEADER_LEN, 0);
        read.read_exact(&mut frame[native_wire::HEADER_LEN..])
            .await
            .map_err(ended("read frame header"))?;
        let payload_len = payload_len(&frame).unwrap_or(usize::MAX);
        if payload_len <= native_frame::MAX_PAYLOAD_BYTES {
            frame.resize(native_frame::HEADER_LEN + payload_len, 0);
            read.read_exact(&mut frame[native_frame::HEADER_LEN..])
                .await
                .map_err(ended("read frame payload"))?;
        }
        let header = match FrameHeader::parse(&frame) {
            Ok((header, _)) => header,
            Err(e) => {
                let reason = Chain(&e).to_string();
                return Err(reject(config, &mut write, &frame, &reason, stats).await);
            }
        };
        let complete = reassembler.push(&frame).map_err(|e| Chain(&e).to_string());
        let envelope_bytes = match complete {
            Ok(None) => None,
            Ok(Some(bytes)) => Some(bytes),
            Err(reason) => {
                return Err(reject(config, &mut write, &frame, &reason, stats).await);
            }
        };
        if let Some(bytes) = envelope_bytes {
            let env = match envelope::decode(&bytes) {
                Ok(env) => env,
                Err(e) => {
                    let reason = format!(
                        "envelope at commit LSN {}: {}",
                        Lsn(header.commit_lsn),
                        Chain(&e)
                    );
                    return Err(reject(config, &mut write, &bytes, &reason, stats).await);
                }
            };
            let source_id = env
                .source
                .as_ref()
                .map(|s| s.source_id.as_str())
                .unwrap_or("");
            let boundary = env.boundary.clone().unwrap_or_default();
            let problem = if source_id != config.source_id {
                Some(format!(
                    "envelope source_id {source_id:?} is not this relay's {:?} (trellara.source_id must match the relay's --source-id)",
                    config.source_id
                ))
            } else if env.commit_lsn != header.commit_lsn
                || boundary.chunk_index != header.envelope_index
            {
                Some(format!(
                    "frame header (commit LSN {}, envelope {}) disagrees with its envelope (commit LSN {}, chunk {})",
                    Lsn(header.commit_lsn),
                    header.envelope_index,
                    Lsn(env.commit_lsn),
                    boundary.chunk_index
                ))
            } else {
                None
            };
            if let Some(reason) = problem {
                return Err(reject(config, &mut write, &bytes, &reason, stats).await);
            }
            let last_chunk = boundary.chunk_index + 1 >= boundary.chunk_count.max(1);
            tracing::debug!(xid = env.xid, commit_lsn = %Lsn(env.commit_lsn), end_lsn = %Lsn(env.end_lsn), chunk = boundary.chunk_index, duplicate = Lsn(env.commit_lsn) <= resume.commit_lsn, "envelope");
            if Lsn(env.commit_lsn) <= resume.commit_lsn {
                stats.duplicates_skipped += 1;
            } else {
                pending.bytes += bytes.len();
                pending.records.push((env.commit_lsn, bytes));
                crash(hooks, CrashPoint::ReceivedNotAppended)?;
            }
            if last_chunk {
                pending.ack = Some(env.end_lsn);
                if Lsn(env.commit_lsn) > resume.commit_lsn {
                    pending.transactions += 1;
                }
            }
        }
        if pending.bytes >= BATCH_BYTES {
            flush!();
        }
    }
}

/// Whether `buffered` holds a whole next message (a Progress, or a frame
/// with its payload), so reading it will not wait.
fn next_message_buffered(buffered: &[u8]) -> bool {
    if buffered.starts_with(&native_wire::PROGRESS_MAGIC) {
        return buffered.len() >= native_wire::HEADER_LEN;
    }
    payload_len(buffered)
        .is_some_and(|len| buffered.len() >= native_frame::HEADER_LEN.saturating_add(len))
}

/// The payload length a frame header declares (bytes 24..28), when those
/// bytes are there; the header itself is checked by `FrameHeader::parse`.
fn payload_len(header: &[u8]) -> Option<usize> {
    match header.get(24..28) {
        Some(&[a, b, c, d]) => Some(u32::from_le_bytes([a, b, c, d]) as usize),
        _ => None,
    }
}

/// Tells the worker why it is refused, then ends the connection.
async fn refuse<W: tokio::io::AsyncWrite + Unpin>(
    write: &mut W,
    reason: String,
) -> ConnectionError {
    let _ = write
        .write_all(
            &RelayMessage::Reject {
                reason: reason.clone(),
            }
            .encode(),
        )
        .await;
    ConnectionError::Ended(reason)
}

/// Envelopes received but not yet appended, and the position to
/// acknowledge once they are.
#[derive(Default)]
struct Pending {
    records: Vec<(u64, Vec<u8>)>,
    bytes: usize,
    ack: Option<u64>,
    /// Transactions whose last envelope is in `records`: counted as
    /// captured once the append that holds them is durable, so a
    /// reconnect that drops them never counts them twice.
    transactions: u64,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.records.is_empty() && self.ack.is_none()
    }
}

async fn flush<S: crate::log::storage::Storage, W: tokio::io::AsyncWrite + Unpin>(
    log: &Log<S>,
    pending: &mut Pending,
    write: &mut W,
    config: &NativeConfig,
    stats: &mut NativeStats,
    hooks: &dyn CrashHooks,
) -> Result<(), ConnectionError> {
    #[cfg(test)]
    if mutation::ACK_BEFORE_APPEND.with(std::cell::Cell::get)
        && let Some(end_lsn) = pending.ack.take()
    {
        // The broken ordering the mutation check expects the simulator to
        // catch: acknowledge first, append after.
        send_ack(write, end_lsn, hooks).await?;
    }
    if !pending.records.is_empty() {
        log.append_batch_async(
            pending
                .records
                .iter()
                .map(|(lsn, bytes)| (*lsn, bytes.as_slice())),
        )
        .await
        .map_err(NativeError::from)?;
        stats.envelopes += pending.records.len() as u64;
        pending.records.clear();
        pending.bytes = 0;
        if let Some(o) = &config.observe {
            o.metrics.captured.inc_by(pending.transactions);
        }
        pending.transactions = 0;
        crash(hooks, CrashPoint::AppendedNotAcknowledged)?;
    }
    if let Some(end_lsn) = pending.ack.take() {
        tracing::debug!(end_lsn = %Lsn(end_lsn), "ack");
        if let Some(progress) = &config.progress {
            progress.send_if_modified(|p| {
                let moved = p.0 < end_lsn;
                *p = Lsn(p.0.max(end_lsn));
                moved
            });
        }
        send_ack(write, end_lsn, hooks).await?;
    }
    Ok(())
}

async fn send_ack<W: tokio::io::AsyncWrite + Unpin>(
    write: &mut W,
    end_lsn: u64,
    hooks: &dyn CrashHooks,
) -> Result<(), ConnectionError> {
    let sent = async {
        write
            .write_all(&RelayMessage::Ack { end_lsn }.encode())
            .await?;
        write.flush().await
    };
    sent.await
        .map_err(|e| ConnectionError::Ended(format!("send ack: {e}")))?;
    crash(hooks, CrashPoint::Acknowledged)
}

/// Keeps the refused bytes and the reason in `quarantine/` (one file per
/// distinct content), tells the
/// worker, and ends the connection.
async fn reject<W: tokio::io::AsyncWrite + Unpin>(
    config: &NativeConfig,
    write: &mut W,
    bytes: &[u8],
    reason: &str,
    stats: &mut NativeStats,
) -> ConnectionError {
    stats.rejected_frames += 1;
    let dir = config.log_dir.join("quarantine");
    // Named by content: a worker replaying the same bad frame after its
    // backoff overwrites one file instead of filling the disk.
    let stamp = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes));
    let kept = trellara_common::owner_only::create_dir_all(&dir)
        .and_then(|()| {
            trellara_common::owner_only::write(&dir.join(format!("native-{stamp}.bin")), bytes)
        })
        .and_then(|()| {
            trellara_common::owner_only::write(
                &dir.join(format!("native-{stamp}.reason")),
                reason.as_bytes(),
            )
        });
    let kept = match kept {
        Ok(()) => format!("kept in {}/native-{stamp}.bin", dir.display()),
        Err(e) => format!("could not be kept in {}: {e}", dir.display()),
    };
    let message = format!("{reason} ({kept})");
    tracing::error!(%message, "rejected a native frame; the acknowledged position stays behind it");
    // The worker hears the reason itself; our error says what happened.
    let _ = refuse(write, message.clone()).await;
    ConnectionError::Ended(format!("rejected a frame: {message}"))
}

/// Test-only switches that break one ordering rule, so a test can prove
/// the simulator notices (the mutation check).
#[cfg(test)]
pub(crate) mod mutation {
    thread_local! {
        pub(crate) static ACK_BEFORE_APPEND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
}
