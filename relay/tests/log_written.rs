//! Records written but not yet durable: visible early to a written-horizon
//! reader (the applier's), to nothing else until `sync_through` covers
//! them, and gone after a crash before it.

mod log_support;

use log_support::{contents, open, open_sim, payload, small_config};
use trellara_relay::log::storage::{FsStorage, SimCrash, SimFault, SimOp, SimStorage};
use trellara_relay::log::{Error, Log, Record};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

fn written<S: trellara_relay::log::storage::Storage>(log: &Log<S>) -> Vec<(u64, Vec<u8>)> {
    log.read_written_from(log.first_offset())
        .unwrap()
        .collect::<Result<Vec<Record>, _>>()
        .unwrap()
        .into_iter()
        .map(|r| (r.commit_lsn, r.payload))
        .collect()
}

#[test]
fn written_records_are_read_early_and_durable_only_after_sync_through() {
    let sim = SimStorage::new(31);
    let cfg = small_config(4096);
    let (log, _) = open_sim(&sim, &cfg);
    let durable: Vec<(u64, Vec<u8>)> = (0..2).map(|i| (i + 1, payload(i, 40))).collect();
    log.append_batch(durable.iter().map(|(l, p)| (*l, p.as_slice())))
        .unwrap();
    let early: Vec<(u64, Vec<u8>)> = (2..4).map(|i| (i + 1, payload(i, 40))).collect();
    let range = log
        .write_batch(early.iter().map(|(l, p)| (*l, p.as_slice())))
        .unwrap();
    assert_eq!(range, 2..4);

    // Only the applier's reader sees them; the durable end has not moved.
    assert_eq!((log.next_offset(), log.written_end()), (2, 4));
    assert_eq!(contents(&log), durable);
    let all: Vec<_> = durable.iter().chain(&early).cloned().collect();
    assert_eq!(written(&log), all);
    assert_eq!(log.last_durable().unwrap().offset, 1);

    // A crash now loses them: nothing durable had claimed them.
    drop(log);
    sim.crash(SimCrash::LoseUnsynced);
    let (log, _) = open_sim(&sim, &cfg);
    assert_eq!(written(&log), durable);

    // Written again and synced: durable for every reader, across a crash.
    let range = log
        .write_batch(early.iter().map(|(l, p)| (*l, p.as_slice())))
        .unwrap();
    runtime().block_on(log.sync_through(range.end)).unwrap();
    assert_eq!(log.next_offset(), 4);
    assert_eq!(contents(&log), all);
    drop(log);
    sim.crash(SimCrash::LoseUnsynced);
    let (log, _) = open_sim(&sim, &cfg);
    assert_eq!(contents(&log), all);
}

#[test]
fn a_failed_fsync_leaves_written_records_undurable_and_says_so() {
    let sim = SimStorage::new(32);
    let (log, _) = open_sim(&sim, &small_config(4096));
    log.append(1, b"durable").unwrap();
    let range = log.write_batch([(2, b"early".as_slice())]).unwrap();
    sim.inject(SimFault::once(SimOp::Sync).on_path(".seg"));
    let err = runtime().block_on(log.sync_through(range.end)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Io {
                op: "fsync segment",
                ..
            }
        ),
        "{err}"
    );
    // What was durable stays the only durable thing; the log is poisoned,
    // so a later wait fails too instead of pretending.
    assert_eq!(contents(&log), vec![(1, b"durable".to_vec())]);
    assert_eq!(log.next_offset(), 1);
    assert!(matches!(
        runtime().block_on(log.sync_through(range.end)),
        Err(Error::Poisoned { .. })
    ));
    // Already durable is answered without touching the disk.
    runtime().block_on(log.sync_through(1)).unwrap();
}

#[test]
fn subscribers_hear_of_writes_and_of_durability() {
    let sim = SimStorage::new(33);
    let (log, _) = open_sim(&sim, &small_config(4096));
    let mut moved = log.subscribe();
    assert!(!moved.has_changed().unwrap());
    let range = log.write_batch([(1, b"one".as_slice())]).unwrap();
    assert!(moved.has_changed().unwrap(), "a write is news");
    moved.borrow_and_update();
    runtime().block_on(log.sync_through(range.end)).unwrap();
    assert!(moved.has_changed().unwrap(), "durability is news");
}

#[test]
fn on_real_storage_sync_through_makes_written_records_durable() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(&FsStorage::new(), dir.path(), &small_config(1 << 20));
    let range = log
        .write_batch((0..64).map(|i| (i + 1, payload(i, 1000))))
        .unwrap();
    assert_eq!(log.next_offset(), 0);
    runtime().block_on(log.sync_through(range.end)).unwrap();
    assert_eq!(log.next_offset(), 64);
    drop(log);
    let (log, _) = open(&FsStorage::new(), dir.path(), &small_config(1 << 20));
    assert_eq!(contents(&log).len(), 64);
}

#[test]
fn concurrent_waiters_share_one_fsync() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(&FsStorage::new(), dir.path(), &small_config(1 << 20));
    let range = log
        .write_batch((0..8).map(|i| (i + 1, payload(i, 100))))
        .unwrap();
    let before = log.stats().fsyncs;
    let (a, b) = runtime()
        .block_on(async { tokio::join!(log.sync_through(range.end), log.sync_through(range.end)) });
    a.unwrap();
    b.unwrap();
    assert_eq!(
        log.stats().fsyncs - before,
        1,
        "the second waiter followed the first"
    );
    assert_eq!(log.next_offset(), 8);
}

/// Real storage whose first armed segment fsync waits until released, so a
/// test can hold an fsync in flight.
#[derive(Clone, Debug, Default)]
struct Gated {
    fs: FsStorage,
    gate: std::sync::Arc<Gate>,
}

#[derive(Debug, Default)]
struct Gate {
    /// Armed: the next segment fsync holds until released.
    state: std::sync::Mutex<(bool, bool)>,
    changed: std::sync::Condvar,
}

impl Gate {
    fn arm(&self) {
        *self.state.lock().unwrap() = (true, false);
    }
    fn release(&self) {
        self.state.lock().unwrap().1 = true;
        self.changed.notify_all();
    }
    fn pass(&self) {
        let mut state = self.state.lock().unwrap();
        if !state.0 {
            return;
        }
        state.0 = false;
        self.changed.notify_all();
        while !state.1 {
            state = self.changed.wait(state).unwrap();
        }
    }
    /// Whether the armed fsync has started (and now holds).
    fn holding(&self) -> bool {
        let state = self.state.lock().unwrap();
        !state.0 && !state.1
    }
}

#[derive(Debug)]
struct GatedFile {
    file: trellara_relay::log::storage::FsFile,
    segment: bool,
    gate: std::sync::Arc<Gate>,
}

impl trellara_relay::log::storage::Storage for Gated {
    type File = GatedFile;
    fn sync_blocks(&self) -> bool {
        true
    }
    fn create_dir_all(&self, dir: &std::path::Path) -> std::io::Result<()> {
        self.fs.create_dir_all(dir)
    }
    fn open(
        &self,
        path: &std::path::Path,
        mode: trellara_relay::log::storage::OpenMode,
    ) -> std::io::Result<GatedFile> {
        Ok(GatedFile {
            file: self.fs.open(path, mode)?,
            segment: path.extension().is_some_and(|e| e == "seg"),
            gate: std::sync::Arc::clone(&self.gate),
        })
    }
    fn list(&self, dir: &std::path::Path) -> std::io::Result<Vec<String>> {
        self.fs.list(dir)
    }
    fn remove(&self, path: &std::path::Path) -> std::io::Result<()> {
        self.fs.remove(path)
    }
    fn rename(&self, from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
        self.fs.rename(from, to)
    }
    fn sync_dir(&self, dir: &std::path::Path) -> std::io::Result<()> {
        self.fs.sync_dir(dir)
    }
}

impl trellara_relay::log::storage::StorageFile for GatedFile {
    fn append(&self, buf: &[u8]) -> std::io::Result<()> {
        self.file.append(buf)
    }
    fn write_at(&self, buf: &[u8], pos: u64) -> std::io::Result<()> {
        self.file.write_at(buf, pos)
    }
    fn read_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
        self.file.read_at(buf, pos)
    }
    fn len(&self) -> std::io::Result<u64> {
        self.file.len()
    }
    fn truncate(&self, len: u64) -> std::io::Result<()> {
        self.file.truncate(len)
    }
    fn sync(&self, mode: trellara_relay::log::storage::SyncMode) -> std::io::Result<()> {
        if self.segment {
            self.gate.pass();
        }
        self.file.sync(mode)
    }
}

/// An fsync in flight, a segment roll that covers what it covers, then an
/// async waiter for what came after the roll: the waiter must hear that
/// the fsync ended (nothing else moves), lead the next one and return.
#[test]
fn an_async_waiter_hears_the_end_of_an_fsync_a_roll_already_covered() {
    let dir = tempfile::tempdir().unwrap();
    let storage = Gated::default();
    let gate = std::sync::Arc::clone(&storage.gate);
    let (log, _) = open(&storage, dir.path(), &small_config(4096));
    log.write_batch((0..4).map(|i| (i + 1, payload(i, 500))))
        .unwrap();
    gate.arm();
    let leader = {
        let log = log.clone();
        std::thread::spawn(move || log.sync())
    };
    while !gate.holding() {
        std::thread::yield_now();
    }
    // The roll fsyncs the old segment past the held fsync's end, then the
    // rest goes to a new segment.
    let range = log
        .write_batch((4..16).map(|i| (i + 1, payload(i, 500))))
        .unwrap();
    assert!(log.next_offset() > 4 && log.next_offset() < range.end);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let waited = rt.block_on(async {
        let release = async {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            gate.release();
        };
        let wait = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            log.sync_through(range.end),
        );
        tokio::join!(wait, release).0
    });
    waited.expect("the waiter was never woken").unwrap();
    leader.join().unwrap().unwrap();
    assert_eq!(log.next_offset(), range.end);
}
