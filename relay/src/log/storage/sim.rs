//! [`Storage`] in memory, with crash semantics and fault injection: the same
//! log code runs over it in tests and in the deterministic simulator.
//!
//! Model (a conservative POSIX file system):
//! * Every file keeps the bytes readers see and the bytes that were durable at
//!   its last successful `sync`. [`SimStorage::crash`] throws the former away;
//!   depending on [`SimCrash`] a seeded-random prefix of un-synced *appended*
//!   bytes survives, as itself or as garbage (a torn write).
//! * Directory entries (create, rename, remove) survive a crash only if the
//!   parent directory was `sync_dir`-ed afterwards. Directories themselves are
//!   durable as soon as `create_dir_all` returns.
//! * A crash invalidates every open handle: operations on a handle from before
//!   the crash fail, like a process that no longer exists.
//! * Everything is ordered (`BTreeMap`) and all randomness comes from the seed
//!   given to [`SimStorage::new`], so one seed replays one history (given the
//!   same sequence of calls).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::{OpenMode, Storage, StorageFile, SyncMode};

/// What survives [`SimStorage::crash`] beyond the durable bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimCrash {
    /// Every byte written since the file's last sync is lost.
    LoseUnsynced,
    /// A random-length prefix of the bytes appended since the last sync
    /// survives intact (a torn write).
    TornTail,
    /// Like `TornTail`, but the surviving bytes are random garbage (a device
    /// that acknowledged sectors it never wrote correctly).
    GarbageTail,
}

/// An operation [`SimFault`] can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimOp {
    Open,
    Append,
    WriteAt,
    ReadAt,
    Truncate,
    Sync,
    List,
    Remove,
    Rename,
    SyncDir,
}

/// Makes matching operations fail with an I/O error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimFault {
    pub op: SimOp,
    /// Only operations on a path containing this string match; `None`
    /// matches every path.
    pub path_contains: Option<String>,
    /// Matching operations to let through before failing.
    pub skip: u32,
    /// How many matching operations fail (after `skip`).
    pub times: u32,
}

impl SimFault {
    /// Fails the next matching `op` once, on any path.
    pub fn once(op: SimOp) -> Self {
        SimFault {
            op,
            path_contains: None,
            skip: 0,
            times: 1,
        }
    }

    /// Restricts the fault to paths containing `fragment`.
    pub fn on_path(mut self, fragment: impl Into<String>) -> Self {
        self.path_contains = Some(fragment.into());
        self
    }
}

/// Operation counts since [`SimStorage::new`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    pub syncs: u64,
    pub dir_syncs: u64,
    pub bytes_written: u64,
    pub crashes: u64,
    pub injected_faults: u64,
}

/// The simulated file system. Clones share the same state.
#[derive(Clone, Debug)]
pub struct SimStorage {
    shared: Arc<Mutex<SimState>>,
}

/// A handle on a simulated file.
#[derive(Debug)]
pub struct SimFile {
    shared: Arc<Mutex<SimState>>,
    inode: u64,
    generation: u64,
    path: PathBuf,
}

#[derive(Clone, Debug)]
struct SimState {
    rng: SplitMix64,
    generation: u64,
    next_inode: u64,
    inodes: BTreeMap<u64, Inode>,
    entries: BTreeMap<PathBuf, u64>,
    durable_entries: BTreeMap<PathBuf, u64>,
    dirs: BTreeSet<PathBuf>,
    faults: Vec<SimFault>,
    sync_latency: Duration,
    stats: SimStats,
}

#[derive(Clone, Debug, Default)]
struct Inode {
    data: Vec<u8>,
    durable: Vec<u8>,
    // Lowest byte changed since the last sync: `data[..dirty_from]` equals
    // `durable[..dirty_from]`, which keeps `sync` proportional to the change.
    dirty_from: Option<usize>,
}

impl Inode {
    fn touch(&mut self, pos: usize) {
        let pos = pos.min(self.data.len());
        self.dirty_from = Some(self.dirty_from.map_or(pos, |d| d.min(pos)));
    }

    fn write_at(&mut self, buf: &[u8], pos: usize) {
        self.touch(pos);
        let end = pos + buf.len();
        if self.data.len() < end {
            self.data.resize(end, 0);
        }
        if let Some(dst) = self.data.get_mut(pos..end) {
            dst.copy_from_slice(buf);
        }
    }

    fn sync(&mut self) {
        if let Some(from) = self.dirty_from.take() {
            self.durable.truncate(from);
            self.durable
                .extend_from_slice(self.data.get(from..).unwrap_or_default());
        }
    }

    fn crash(&mut self, mode: SimCrash, rng: &mut SplitMix64) {
        let durable_len = self.durable.len();
        let pure_append = self.dirty_from == Some(durable_len) && self.data.len() > durable_len;
        let mut survivor = std::mem::take(&mut self.durable);
        if pure_append && mode != SimCrash::LoseUnsynced {
            let extra = self.data.len() - durable_len;
            let keep = usize::try_from(rng.below(extra as u64 + 1)).unwrap_or(0);
            match mode {
                SimCrash::TornTail => survivor.extend_from_slice(
                    self.data
                        .get(durable_len..durable_len + keep)
                        .unwrap_or_default(),
                ),
                _ => survivor.extend((0..keep).map(|_| rng.next() as u8)),
            }
        }
        self.durable = survivor.clone();
        self.data = survivor;
        self.dirty_from = None;
    }
}

/// A tiny deterministic generator (SplitMix64); no dependency, stable output.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 { 0 } else { self.next() % bound }
    }
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("simulated file system has no {}", path.display()),
    )
}

fn parent_of(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).unwrap_or_default()
}

impl SimState {
    fn check_fault(&mut self, op: SimOp, path: &Path) -> io::Result<()> {
        let text = path.to_string_lossy();
        for fault in &mut self.faults {
            if fault.op != op || fault.times == 0 {
                continue;
            }
            if let Some(fragment) = &fault.path_contains
                && !text.contains(fragment.as_str())
            {
                continue;
            }
            if fault.skip > 0 {
                fault.skip -= 1;
                continue;
            }
            fault.times -= 1;
            self.stats.injected_faults += 1;
            return Err(io::Error::other(format!(
                "injected {op:?} failure on {}",
                path.display()
            )));
        }
        Ok(())
    }

    fn check_alive(&self, file: &SimFile) -> io::Result<()> {
        if file.generation == self.generation {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::BrokenPipe,
            format!(
                "handle on {} is from before a simulated crash",
                file.path.display()
            ),
        ))
    }

    fn inode_of_handle(&mut self, file: &SimFile, op: SimOp) -> io::Result<&mut Inode> {
        self.check_alive(file)?;
        self.check_fault(op, &file.path)?;
        self.inodes
            .get_mut(&file.inode)
            .ok_or_else(|| not_found(&file.path))
    }

    fn require_dir(&self, dir: &Path) -> io::Result<()> {
        if self.dirs.contains(dir) {
            Ok(())
        } else {
            Err(not_found(dir))
        }
    }
}

impl SimStorage {
    /// An empty file system whose crash outcomes are drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        let mut dirs = BTreeSet::new();
        dirs.insert(PathBuf::from("/"));
        dirs.insert(PathBuf::new());
        SimStorage {
            shared: Arc::new(Mutex::new(SimState {
                rng: SplitMix64(seed),
                generation: 0,
                next_inode: 1,
                inodes: BTreeMap::new(),
                entries: BTreeMap::new(),
                durable_entries: BTreeMap::new(),
                dirs,
                faults: Vec::new(),
                sync_latency: Duration::ZERO,
                stats: SimStats::default(),
            })),
        }
    }

    fn state(&self) -> MutexGuard<'_, SimState> {
        // State mutations complete before any early return, so a panic in
        // another thread (a failing test) leaves consistent state behind.
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Simulates power loss: un-synced bytes and un-synced directory entries
    /// are lost (see [`SimCrash`] for torn tails) and every open handle dies.
    pub fn crash(&self, mode: SimCrash) {
        let mut state = self.state();
        let state = &mut *state;
        state.generation += 1;
        state.stats.crashes += 1;
        state.entries = state.durable_entries.clone();
        let live: BTreeSet<u64> = state.entries.values().copied().collect();
        state.inodes.retain(|id, _| live.contains(id));
        for inode in state.inodes.values_mut() {
            inode.crash(mode, &mut state.rng);
        }
    }

    /// An independent copy of the current state (open handles stay with the
    /// original). Handy for trying many corruptions of one history.
    pub fn fork(&self) -> SimStorage {
        let mut copy = self.state().clone();
        copy.generation += 1;
        SimStorage {
            shared: Arc::new(Mutex::new(copy)),
        }
    }

    /// Adds a fault; faults are checked in the order added.
    pub fn inject(&self, fault: SimFault) {
        self.state().faults.push(fault);
    }

    /// Removes every pending fault.
    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// Makes every file sync take `latency` (outside the state lock, so other
    /// threads keep writing meanwhile, as with a real disk).
    pub fn set_sync_latency(&self, latency: Duration) {
        self.state().sync_latency = latency;
    }

    pub fn stats(&self) -> SimStats {
        self.state().stats
    }

    /// The current (not necessarily durable) contents of `path`.
    pub fn read_file(&self, path: &Path) -> Option<Vec<u8>> {
        let state = self.state();
        let inode = state.entries.get(path)?;
        state.inodes.get(inode).map(|i| i.data.clone())
    }

    /// Replaces `path` with `data`, durably (entry included); the parent
    /// directory must exist. Test and simulator helper for corrupting files.
    pub fn write_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let mut state = self.state();
        state.require_dir(&parent_of(path))?;
        let id = state.next_inode;
        state.next_inode += 1;
        state.inodes.insert(
            id,
            Inode {
                data: data.to_vec(),
                durable: data.to_vec(),
                dirty_from: None,
            },
        );
        state.entries.insert(path.to_path_buf(), id);
        state.durable_entries.insert(path.to_path_buf(), id);
        Ok(())
    }

    /// Names of the files in `dir` (current view).
    pub fn file_names(&self, dir: &Path) -> Vec<String> {
        self.list(dir).unwrap_or_default()
    }
}

impl Storage for SimStorage {
    type File = SimFile;

    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.state();
        for ancestor in dir.ancestors() {
            state.dirs.insert(ancestor.to_path_buf());
        }
        Ok(())
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<SimFile> {
        let mut state = self.state();
        state.check_fault(SimOp::Open, path)?;
        state.require_dir(&parent_of(path))?;
        let inode = match (state.entries.get(path).copied(), mode) {
            (Some(id), OpenMode::Truncate) => {
                if let Some(inode) = state.inodes.get_mut(&id) {
                    inode.touch(0);
                    inode.data.clear();
                }
                id
            }
            (Some(id), _) => id,
            (None, OpenMode::Existing) => return Err(not_found(path)),
            (None, OpenMode::Create | OpenMode::Truncate) => {
                let id = state.next_inode;
                state.next_inode += 1;
                state.inodes.insert(id, Inode::default());
                state.entries.insert(path.to_path_buf(), id);
                id
            }
        };
        Ok(SimFile {
            shared: Arc::clone(&self.shared),
            inode,
            generation: state.generation,
            path: path.to_path_buf(),
        })
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut state = self.state();
        state.check_fault(SimOp::List, dir)?;
        state.require_dir(dir)?;
        Ok(state
            .entries
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
            .collect())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut state = self.state();
        state.check_fault(SimOp::Remove, path)?;
        state
            .entries
            .remove(path)
            .map(|_| ())
            .ok_or_else(|| not_found(path))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut state = self.state();
        state.check_fault(SimOp::Rename, from)?;
        state.require_dir(&parent_of(to))?;
        let id = state.entries.remove(from).ok_or_else(|| not_found(from))?;
        state.entries.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.state();
        state.check_fault(SimOp::SyncDir, dir)?;
        state.require_dir(dir)?;
        state.stats.dir_syncs += 1;
        let state = &mut *state;
        state.durable_entries.retain(|p, _| p.parent() != Some(dir));
        for (path, id) in &state.entries {
            if path.parent() == Some(dir) {
                state.durable_entries.insert(path.clone(), *id);
            }
        }
        Ok(())
    }
}

impl SimFile {
    fn state(&self) -> MutexGuard<'_, SimState> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn to_usize(pos: u64) -> io::Result<usize> {
    usize::try_from(pos).map_err(|_| io::Error::other("position beyond address space"))
}

impl StorageFile for SimFile {
    fn append(&self, buf: &[u8]) -> io::Result<()> {
        let mut state = self.state();
        let inode = state.inode_of_handle(self, SimOp::Append)?;
        let end = inode.data.len();
        inode.write_at(buf, end);
        state.stats.bytes_written += buf.len() as u64;
        Ok(())
    }

    fn write_at(&self, buf: &[u8], pos: u64) -> io::Result<()> {
        let pos = to_usize(pos)?;
        let mut state = self.state();
        let inode = state.inode_of_handle(self, SimOp::WriteAt)?;
        inode.write_at(buf, pos);
        state.stats.bytes_written += buf.len() as u64;
        Ok(())
    }

    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<usize> {
        let pos = to_usize(pos)?;
        let mut state = self.state();
        let inode = state.inode_of_handle(self, SimOp::ReadAt)?;
        let available = inode.data.get(pos..).unwrap_or_default();
        let n = available.len().min(buf.len());
        if let (Some(dst), Some(src)) = (buf.get_mut(..n), available.get(..n)) {
            dst.copy_from_slice(src);
        }
        Ok(n)
    }

    fn len(&self) -> io::Result<u64> {
        let mut state = self.state();
        let inode = state.inode_of_handle(self, SimOp::ReadAt)?;
        Ok(inode.data.len() as u64)
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        let len = to_usize(len)?;
        let mut state = self.state();
        let inode = state.inode_of_handle(self, SimOp::Truncate)?;
        inode.touch(len);
        inode.data.resize(len, 0);
        Ok(())
    }

    fn sync(&self, _mode: SyncMode) -> io::Result<()> {
        let latency = {
            let state = self.state();
            state.check_alive(self)?;
            state.sync_latency
        };
        if !latency.is_zero() {
            std::thread::sleep(latency);
        }
        let mut state = self.state();
        let inode = state.inode_of_handle(self, SimOp::Sync)?;
        inode.sync();
        state.stats.syncs += 1;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        PathBuf::from("/log")
    }

    #[test]
    fn unsynced_bytes_and_entries_are_lost_on_crash() {
        let sim = SimStorage::new(7);
        sim.create_dir_all(&dir()).unwrap();
        let a = sim.open(&dir().join("a"), OpenMode::Create).unwrap();
        a.append(b"durable").unwrap();
        a.sync(SyncMode::Data).unwrap();
        sim.sync_dir(&dir()).unwrap();
        a.append(b" lost").unwrap();
        let b = sim.open(&dir().join("b"), OpenMode::Create).unwrap();
        b.append(b"b").unwrap();
        b.sync(SyncMode::Data).unwrap();

        sim.crash(SimCrash::LoseUnsynced);

        assert!(a.append(b"x").is_err(), "pre-crash handle must be dead");
        assert_eq!(sim.read_file(&dir().join("a")).unwrap(), b"durable");
        assert_eq!(sim.read_file(&dir().join("b")), None, "entry never synced");
    }

    #[test]
    fn torn_tail_keeps_a_prefix_of_the_unsynced_append() {
        let sim = SimStorage::new(42);
        sim.create_dir_all(&dir()).unwrap();
        let f = sim.open(&dir().join("f"), OpenMode::Create).unwrap();
        f.append(b"head").unwrap();
        f.sync(SyncMode::Data).unwrap();
        sim.sync_dir(&dir()).unwrap();
        f.append(b"0123456789").unwrap();
        sim.crash(SimCrash::TornTail);
        let data = sim.read_file(&dir().join("f")).unwrap();
        assert!(data.starts_with(b"head"));
        assert!(b"head0123456789".starts_with(&data));
    }

    #[test]
    fn same_seed_same_crash() {
        let run = |seed| {
            let sim = SimStorage::new(seed);
            sim.create_dir_all(&dir()).unwrap();
            let f = sim.open(&dir().join("f"), OpenMode::Create).unwrap();
            sim.sync_dir(&dir()).unwrap();
            f.append(&[1u8; 4096]).unwrap();
            sim.crash(SimCrash::GarbageTail);
            sim.read_file(&dir().join("f")).unwrap()
        };
        assert_eq!(run(3), run(3));
    }

    #[test]
    fn faults_fire_after_skip_and_only_on_matching_paths() {
        let sim = SimStorage::new(1);
        sim.create_dir_all(&dir()).unwrap();
        let f = sim.open(&dir().join("x.seg"), OpenMode::Create).unwrap();
        let g = sim.open(&dir().join("y.idx"), OpenMode::Create).unwrap();
        sim.inject(SimFault {
            op: SimOp::Sync,
            path_contains: Some(".seg".into()),
            skip: 1,
            times: 1,
        });
        g.sync(SyncMode::Data).unwrap();
        f.sync(SyncMode::Data).unwrap();
        assert!(f.sync(SyncMode::Data).is_err());
        f.sync(SyncMode::Data).unwrap();
        assert_eq!(sim.stats().injected_faults, 1);
    }

    #[test]
    fn rename_is_durable_only_after_sync_dir() {
        let sim = SimStorage::new(1);
        sim.create_dir_all(&dir()).unwrap();
        sim.write_file(&dir().join("cur"), b"old").unwrap();
        sim.write_file(&dir().join("cur.tmp"), b"new").unwrap();
        sim.rename(&dir().join("cur.tmp"), &dir().join("cur"))
            .unwrap();
        let crashed = sim.fork();
        crashed.crash(SimCrash::LoseUnsynced);
        assert_eq!(crashed.read_file(&dir().join("cur")).unwrap(), b"old");
        sim.sync_dir(&dir()).unwrap();
        sim.crash(SimCrash::LoseUnsynced);
        assert_eq!(sim.read_file(&dir().join("cur")).unwrap(), b"new");
        assert_eq!(sim.read_file(&dir().join("cur.tmp")), None);
    }
}
