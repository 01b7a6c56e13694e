//! The shared-memory queue and status block: 16 slots of 64 KiB that hold
//! finished frames between the decoder and the socket sender, plus what
//! `trellara.status()` reports. One LWLock (tranche `trellara`) guards it.
//!
//! ```text
//!  plugin write ─▶ push (full: the decoder waits, sending) ─▶ [ 16 x 64 KiB ] ─▶ front ─▶ socket
//!                                                                     status ◀─ trellara.status()
//! ```
//!
//! Invariants:
//! - The ring never holds more than `capacity` (1..=16) frames and never
//!   grows: a push into a full ring is refused and the caller waits.
//! - A frame stays in its slot until it was completely written to the
//!   socket; only then is it popped (a crash loses nothing: the slot replays).
//! - Present only when the library is in `shared_preload_libraries`;
//!   otherwise [`get`] returns `None` and callers say so.
use pgrx::pg_sys;
use std::sync::atomic::{AtomicPtr, Ordering};
use trellara_common::native_frame::MAX_FRAME_BYTES;

/// Slots in the ring (the design's bound; `trellara.queue_capacity` may use fewer).
pub const SLOTS: usize = 16;
const TRANCHE: &std::ffi::CStr = c"trellara";
const SEGMENT: &std::ffi::CStr = c"trellara native queue";
const REASON_BYTES: usize = 512;

/// What the worker is doing, as `trellara.status()` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum WorkerState {
    NotRunning = 0,
    Starting = 1,
    Running = 2,
    WaitingForRelay = 3,
    Backpressured = 4,
    FailedClosed = 5,
    Stopped = 6,
}

impl WorkerState {
    fn from_u32(v: u32) -> WorkerState {
        match v {
            1 => WorkerState::Starting,
            2 => WorkerState::Running,
            3 => WorkerState::WaitingForRelay,
            4 => WorkerState::Backpressured,
            5 => WorkerState::FailedClosed,
            6 => WorkerState::Stopped,
            _ => WorkerState::NotRunning,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkerState::NotRunning => "not_running",
            WorkerState::Starting => "starting",
            WorkerState::Running => "running",
            WorkerState::WaitingForRelay => "waiting_for_relay",
            WorkerState::Backpressured => "backpressured",
            WorkerState::FailedClosed => "failed_closed",
            WorkerState::Stopped => "stopped",
        }
    }
}

#[repr(C)]
struct Shared {
    head: u32,
    len: u32,
    capacity: u32,
    state: u32,
    pid: i32,
    stop_requested: bool,
    /// Bumped by every start_worker(): a worker registered for an older
    /// generation (one PostgreSQL restarts after it was replaced) exits.
    generation: u64,
    reason_len: u32,
    acked_lsn: u64,
    frames_sent: u64,
    transactions_acked: u64,
    frame_len: [u32; SLOTS],
    reason: [u8; REASON_BYTES],
    data: [[u8; MAX_FRAME_BYTES]; SLOTS],
}

static SHARED: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
static LOCK: AtomicPtr<pg_sys::LWLock> = AtomicPtr::new(std::ptr::null_mut());
static mut PREV_REQUEST: pg_sys::shmem_request_hook_type = None;
static mut PREV_STARTUP: pg_sys::shmem_startup_hook_type = None;

/// Installs the shared-memory hooks. Call from `_PG_init` while
/// `shared_preload_libraries` is being processed (the only time
/// PostgreSQL accepts shared-memory requests).
pub fn install_hooks() {
    // SAFETY: _PG_init runs single-threaded in the postmaster before any
    // hook fires; we chain the previous hooks.
    unsafe {
        PREV_REQUEST = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(request);
        PREV_STARTUP = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(startup);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn request() {
    // SAFETY: called by PostgreSQL in the postmaster during shared-memory
    // sizing; the previous hook (if any) is called first, as it expects.
    unsafe {
        if let Some(prev) = PREV_REQUEST {
            prev();
        }
        pg_sys::RequestAddinShmemSpace(std::mem::size_of::<Shared>());
        pg_sys::RequestNamedLWLockTranche(TRANCHE.as_ptr(), 1);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn startup() {
    // SAFETY: called once per shared-memory (re)initialisation in the
    // postmaster; AddinShmemInitLock (MainLWLockArray[21] in 15-18)
    // serialises ShmemInitStruct as PostgreSQL documents for add-ins.
    unsafe {
        if let Some(prev) = PREV_STARTUP {
            prev();
        }
        let init_lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock;
        pg_sys::LWLockAcquire(init_lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let shared =
            pg_sys::ShmemInitStruct(SEGMENT.as_ptr(), std::mem::size_of::<Shared>(), &mut found)
                .cast::<Shared>();
        if !found {
            // All-zero is a valid empty ring in state NotRunning.
            std::ptr::write_bytes(shared.cast::<u8>(), 0, std::mem::size_of::<Shared>());
            (*shared).capacity = SLOTS as u32;
        }
        let lock = &raw mut (*pg_sys::GetNamedLWLockTranche(TRANCHE.as_ptr())).lock;
        pg_sys::LWLockRelease(init_lock);
        SHARED.store(shared, Ordering::Release);
        LOCK.store(lock, Ordering::Release);
    }
}

/// The shared block, when the library was preloaded.
pub fn get() -> Option<Queue> {
    let shared = SHARED.load(Ordering::Acquire);
    let lock = LOCK.load(Ordering::Acquire);
    (!shared.is_null() && !lock.is_null()).then_some(Queue { shared, lock })
}

/// A handle on the shared block; every access takes the LWLock.
#[derive(Debug, Clone, Copy)]
pub struct Queue {
    shared: *mut Shared,
    lock: *mut pg_sys::LWLock,
}

/// A consistent copy of the status fields.
#[derive(Debug, Clone)]
pub struct Status {
    pub state: WorkerState,
    pub reason: String,
    pub pid: i32,
    pub occupancy: u32,
    pub capacity: u32,
    pub acked_lsn: u64,
    pub frames_sent: u64,
    pub transactions_acked: u64,
    pub stop_requested: bool,
}

impl Queue {
    fn with<R>(&self, mode: pg_sys::LWLockMode::Type, f: impl FnOnce(&mut Shared) -> R) -> R {
        // SAFETY: the lock and block were set up by startup() and live as
        // long as shared memory; PostgreSQL releases LWLocks held at an
        // ERROR, and f does not raise.
        unsafe {
            pg_sys::LWLockAcquire(self.lock, mode);
            let result = f(&mut *self.shared);
            pg_sys::LWLockRelease(self.lock);
            result
        }
    }

    /// Copies `frame` into the next free slot; false when the ring is full.
    pub fn push(&self, frame: &[u8]) -> bool {
        debug_assert!(frame.len() <= MAX_FRAME_BYTES);
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            let capacity = s.capacity.clamp(1, SLOTS as u32);
            if s.len >= capacity || frame.len() > MAX_FRAME_BYTES {
                return false;
            }
            let at = ((s.head + s.len) as usize) % SLOTS;
            match (
                s.data.get_mut(at).and_then(|d| d.get_mut(..frame.len())),
                s.frame_len.get_mut(at),
            ) {
                (Some(slot), Some(len)) => {
                    slot.copy_from_slice(frame);
                    *len = frame.len() as u32;
                    s.len += 1;
                    true
                }
                _ => false,
            }
        })
    }

    /// Appends every queued frame, oldest first, to `out`, and each one's
    /// end offset in `out` to `ends` (one lock for the lot, so the sender
    /// can hand them to the socket in one write). Returns how many.
    pub fn copy_all(&self, out: &mut Vec<u8>, ends: &mut Vec<usize>) -> usize {
        // Room for a full ring first: nothing under the lock may allocate
        // (an allocation failure there would abort the whole server).
        out.reserve(SLOTS * MAX_FRAME_BYTES);
        ends.reserve(SLOTS);
        self.with(pg_sys::LWLockMode::LW_SHARED, |s| {
            for i in 0..s.len {
                let at = ((s.head + i) as usize) % SLOTS;
                let len = s.frame_len.get(at).copied().unwrap_or(0) as usize;
                if let Some(bytes) = s.data.get(at).and_then(|d| d.get(..len)) {
                    out.extend_from_slice(bytes);
                }
                ends.push(out.len());
            }
            s.len as usize
        })
    }

    /// Frees the `n` oldest slots (their frames were written to the socket).
    pub fn pop_n(&self, n: usize) {
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            let n = (n as u32).min(s.len);
            s.head = (s.head + n) % SLOTS as u32;
            s.len -= n;
            s.frames_sent += u64::from(n);
        });
    }

    /// Empties the ring (a new session, holding the slot, replays from it).
    pub fn reset(&self, capacity: u32) {
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            s.head = 0;
            s.len = 0;
            s.capacity = capacity.clamp(1, SLOTS as u32);
        });
    }

    /// Claims the worker role for `generation`: false when a newer
    /// start_worker() replaced it. After a crash-restart (shared memory
    /// re-initialised, generation 0) the first worker to start adopts its
    /// own generation.
    pub fn claim(&self, generation: u64, pid: i32) -> bool {
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            if s.generation == 0 {
                s.generation = generation;
            }
            if s.generation != generation {
                return false;
            }
            s.pid = pid;
            true
        })
    }

    /// A new generation for start_worker(); the previous workers retire.
    pub fn next_generation(&self) -> u64 {
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            // Never 0 (that means "not claimed yet" after a restart) and
            // never 1 (the boot-time worker's).
            s.generation = s.generation.max(1) + 1;
            s.generation
        })
    }

    /// The worker is gone (it stops for good, or lost its role).
    pub fn clear_pid(&self, pid: i32) {
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            if s.pid == pid {
                s.pid = 0;
            }
        });
    }

    /// Sets the state, except over a recorded `failed_closed` (a later,
    /// vaguer error must not hide the reason).
    pub fn set_state_unless_failed(&self, state: WorkerState, reason: &str) {
        let failed = WorkerState::FailedClosed as u32;
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| s.state != failed)
            .then(|| self.set_state(state, reason));
    }

    pub fn set_state(&self, state: WorkerState, reason: &str) {
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            s.state = state as u32;
            let mut n = reason.len().min(REASON_BYTES);
            while !reason.is_char_boundary(n) {
                n -= 1;
            }
            if let (Some(dst), Some(src)) = (s.reason.get_mut(..n), reason.as_bytes().get(..n)) {
                dst.copy_from_slice(src);
            }
            s.reason_len = n as u32;
        });
    }

    pub fn set_acked(&self, lsn: u64, transactions: u64) {
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            s.acked_lsn = s.acked_lsn.max(lsn);
            s.transactions_acked += transactions;
        });
    }

    pub fn set_stop_requested(&self, stop: bool) {
        self.with(pg_sys::LWLockMode::LW_EXCLUSIVE, |s| {
            s.stop_requested = stop
        });
    }

    pub fn status(&self) -> Status {
        // Copied as plain bytes under the lock, made text after it: nothing
        // under the lock allocates.
        let mut reason = [0u8; REASON_BYTES];
        let (mut status, reason_len) = self.with(pg_sys::LWLockMode::LW_SHARED, |s| {
            reason = s.reason;
            (
                Status {
                    state: WorkerState::from_u32(s.state),
                    reason: String::new(),
                    pid: s.pid,
                    occupancy: s.len,
                    capacity: s.capacity,
                    acked_lsn: s.acked_lsn,
                    frames_sent: s.frames_sent,
                    transactions_acked: s.transactions_acked,
                    stop_requested: s.stop_requested,
                },
                s.reason_len as usize,
            )
        });
        status.reason =
            String::from_utf8_lossy(reason.get(..reason_len).unwrap_or_default()).into_owned();
        status
    }
}
