//! The deterministic simulator: Trellara's real ordering code - the native
//! relay's [`serve_frames`](crate::native), the durable log, the applier -
//! run over simulated storage ([`SimStorage`](crate::log::storage::SimStorage):
//! unsynced writes lost on crash, torn and garbage tails, failing fsyncs) and
//! simulated peers (a capture worker on an in-memory pipe, an in-memory
//! target database), stopped at the named [`CrashPoint`]s as if the process
//! died, then restarted. Everything random comes from one seed, so a failing
//! seed replays exactly (`trellara chaos run --seed S --seeds 1`).
//!
//! Families: [`relay`] (source and stream), [`apply`] (target apply, over
//! the in-memory [`target`]), [`capture`] (the external relay's pgoutput
//! path), [`snapshot`] (snapshot and handoff) and [`pipeline`] (whole
//! following rounds through the live run's own round composition). Qualification is not a
//! simulation but the verdict over all of them (`chaos run`, `chaos
//! report`).
//!
//! [`SCENARIOS`] is the matrix as data for `trellara chaos run` and
//! `trellara chaos report`: each names the invariant it protects and the
//! commands that prove and recover it, and each can fail (the mutation
//! tests break one ordering rule and watch the matching scenarios fail).

pub(crate) mod apply;
pub(crate) mod capture;
pub(crate) mod pipeline;
pub(crate) mod relay;
pub(crate) mod snapshot;
pub(crate) mod target;
pub(crate) mod topic;

use crate::crash::{CrashHooks, CrashPoint};
use crate::log::LogConfig;
use crate::log::storage::SimCrash;
use apply::{ApplyFault, FenceWindow};
use capture::CaptureFault;
use pipeline::PipelineFault;
use relay::RelayFault;
use snapshot::SnapshotFault;
use std::cell::Cell;
use trellara_common::envelope::{
    self, BeforeImage, Boundary, Capture, Change, ColumnSchema, Envelope, Operation,
    RelationSchema, ReplicaIdentity, RowChange, SourceIdentity, Value, boundary, change, value,
};

/// Crashes at the `nth` time `point` is reached (once).
#[derive(Debug)]
struct CrashOnce {
    point: CrashPoint,
    nth: u32,
    seen: Cell<u32>,
    fired: Cell<bool>,
}

impl CrashOnce {
    fn new(point: CrashPoint, nth: u32) -> Self {
        CrashOnce {
            point,
            nth,
            seen: Cell::new(0),
            fired: Cell::new(false),
        }
    }

    fn never() -> Self {
        let hooks = CrashOnce::new(CrashPoint::Acknowledged, 0);
        hooks.fired.set(true);
        hooks
    }
}

impl CrashHooks for CrashOnce {
    fn crash_at(&self, point: CrashPoint) -> bool {
        if self.fired.get() || point != self.point {
            return false;
        }
        self.seen.set(self.seen.get() + 1);
        if self.seen.get() >= self.nth {
            self.fired.set(true);
            return true;
        }
        false
    }
}

/// SplitMix64: the only randomness, from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Small segments, so histories seal several and index files exist.
fn sim_log_config() -> LogConfig {
    LogConfig {
        max_segment_bytes: 4096,
        ..LogConfig::default()
    }
}

/// The simulated source table `public.sim (id bigint primary key, note text)`.
fn sim_relation() -> RelationSchema {
    let column = |name: &str, type_oid, key| ColumnSchema {
        name: name.into(),
        type_oid,
        type_modifier: -1,
        key,
    };
    let mut relation = RelationSchema {
        relation_id: 16_385,
        namespace: "public".into(),
        name: "sim".into(),
        replica_identity: ReplicaIdentity::Default as i32,
        columns: vec![column("id", 20, true), column("note", 25, false)],
        fingerprint: 0,
    };
    relation.fingerprint = trellara_common::fingerprint::fingerprint(&relation);
    relation
}

fn text(s: impl Into<String>) -> Value {
    Value {
        kind: Some(value::Kind::Text(s.into())),
    }
}

/// One row change of `public.sim`; `before` is the old key of a
/// key-changing update or a delete (None: the key is in `after`).
fn sim_row(operation: Operation, id: u64, note: &str, before: Option<u64>) -> RowChange {
    let relation_id = sim_relation().relation_id;
    let (before_kind, before) = match before {
        Some(old) => (
            BeforeImage::Key,
            vec![
                text(old.to_string()),
                Value {
                    kind: Some(value::Kind::Null(true)),
                },
            ],
        ),
        None => (BeforeImage::None, Vec::new()),
    };
    RowChange {
        relation_id,
        operation: operation as i32,
        before_kind: before_kind as i32,
        before,
        after: if operation == Operation::Delete {
            Vec::new()
        } else {
            vec![text(id.to_string()), text(note)]
        },
        truncate_cascade: false,
        truncate_restart_identity: false,
    }
}

/// A transaction of `rows` on `public.sim`, or the chunk `(index, count)`
/// of one with `total` changes, as the capture side hands it over. LSNs
/// and xid are the caller's to set.
fn sim_envelope(
    rows: Vec<RowChange>,
    first_sequence: u64,
    chunk: (u32, u32),
    total: u64,
) -> Envelope {
    let changes = rows
        .into_iter()
        .enumerate()
        .map(|(i, row)| Change {
            sequence: first_sequence + i as u64,
            body: Some(change::Body::Row(row)),
        })
        .collect();
    let (chunk_index, chunk_count) = chunk;
    Envelope {
        protocol_version: envelope::PROTOCOL_VERSION,
        source: Some(SourceIdentity {
            source_id: "sim".into(),
            dataset_id: "sim".into(),
            system_identifier: 1,
            database: "sim".into(),
            timeline: 1,
        }),
        xid: 1_000,
        begin_lsn: 0,
        commit_lsn: 0,
        end_lsn: 0,
        commit_time_micros: 1_796_000_000_000_000,
        relations: vec![sim_relation()],
        changes,
        boundary: Some(Boundary {
            mode: if chunk_count > 1 {
                boundary::Mode::Chunked
            } else {
                boundary::Mode::Whole
            } as i32,
            chunk_index,
            chunk_count,
            first_sequence,
            total_changes: total,
            partition: 0,
            manifest_partitions: Vec::new(),
        }),
        origin: String::new(),
        capture: Some(Capture {
            path: envelope::capture::Path::Native as i32,
            server_version_num: 170_009,
            decoder: "trellara/1".into(),
            captured_at_micros: 1_796_000_000_001_000,
        }),
        checksum: 0,
    }
}

/// Which simulation a scenario runs, with its fault.
#[derive(Debug, Clone, Copy)]
enum Simulation {
    Relay(RelayFault),
    Apply(ApplyFault),
    Capture(CaptureFault),
    Snapshot(SnapshotFault),
    Pipeline(PipelineFault),
}

/// One scenario of the failure matrix: what it simulates, the invariant it
/// protects, how a user proves it and how they recover.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    pub id: &'static str,
    pub family: &'static str,
    pub simulation: &'static str,
    pub invariant: &'static str,
    pub proof: &'static str,
    pub recovery: &'static str,
    run: Simulation,
}

const SOURCE: &str = "source-and-stream";
const SOURCE_PROOF: &str = "trellara chaos run --family source-and-stream";
const SOURCE_RECOVERY: &str =
    "restart the relay: the worker replays from its slot; the log skips what it holds";
const TARGET: &str = "target-apply";
const TARGET_PROOF: &str = "trellara chaos run --family target-apply";
const TARGET_RECOVERY: &str = "rerun `trellara run --config trellara.yml`: the applier resumes from its cursor and the checkpoint skips what the target holds; then `trellara verify`";
const CAPTURE: &str = "capture";
const CAPTURE_PROOF: &str = "trellara chaos run --family capture";
const CAPTURE_RECOVERY: &str = "restart `trellara run` (or `trellara relay`): capture resumes from the log's last durable transaction; the slot replays the rest";
const SNAPSHOT: &str = "snapshot";
const SNAPSHOT_PROOF: &str = "trellara chaos run --family snapshot";
const SNAPSHOT_RECOVERY: &str = "rerun `trellara run --config trellara.yml`: a run not handed off is re-planned (new slot, new boundary), a handed-off one streams on from its slot; then `trellara verify`";
const PIPELINE: &str = "pipeline";
const PIPELINE_PROOF: &str = "trellara chaos run --family pipeline";
const PIPELINE_RECOVERY: &str = "restart `trellara run --follow` (or the services): the round resumes from the log and the checkpoint; then `trellara verify`";
const FENCE_RECOVERY: &str = "nothing to do: the apply goes on by itself once no verify holds its fence; rerun `trellara verify` for a verdict";
const QUARANTINE_RECOVERY: &str = "fix the cause the quarantine record names (`trellara status --view diagnostics`, `trellara repair plan`), rerun `trellara run`: the quarantined transaction is retried first; then `trellara verify`";

macro_rules! relay_crash {
    ($id:literal, $point:ident, $mode:ident, $sim:literal, $inv:literal) => {
        Scenario {
            id: $id,
            family: SOURCE,
            simulation: $sim,
            invariant: $inv,
            proof: SOURCE_PROOF,
            recovery: SOURCE_RECOVERY,
            run: Simulation::Relay(RelayFault::Crash(CrashPoint::$point, SimCrash::$mode)),
        }
    };
}

macro_rules! capture {
    ($id:literal, $fault:expr, $recovery:expr, $sim:literal, $inv:literal) => {
        Scenario {
            id: $id,
            family: CAPTURE,
            simulation: $sim,
            invariant: $inv,
            proof: CAPTURE_PROOF,
            recovery: $recovery,
            run: Simulation::Capture($fault),
        }
    };
}

macro_rules! snapshot {
    ($id:literal, $fault:expr, $recovery:expr, $sim:literal, $inv:literal) => {
        Scenario {
            id: $id,
            family: SNAPSHOT,
            simulation: $sim,
            invariant: $inv,
            proof: SNAPSHOT_PROOF,
            recovery: $recovery,
            run: Simulation::Snapshot($fault),
        }
    };
}

macro_rules! target {
    ($id:literal, $fault:expr, $recovery:expr, $sim:literal, $inv:literal) => {
        Scenario {
            id: $id,
            family: TARGET,
            simulation: $sim,
            invariant: $inv,
            proof: TARGET_PROOF,
            recovery: $recovery,
            run: Simulation::Apply($fault),
        }
    };
}

macro_rules! pipeline {
    ($id:literal, $fault:expr, $recovery:expr, $sim:literal, $inv:literal) => {
        Scenario {
            id: $id,
            family: PIPELINE,
            simulation: $sim,
            invariant: $inv,
            proof: PIPELINE_PROOF,
            recovery: $recovery,
            run: Simulation::Pipeline($fault),
        }
    };
}

/// The matrix as built so far.
pub const SCENARIOS: [Scenario; 57] = [
    relay_crash!(
        "SS-01",
        ReceivedNotAppended,
        LoseUnsynced,
        "relay crash after receiving, before the append",
        "no gap: nothing acknowledged is lost"
    ),
    relay_crash!(
        "SS-02",
        ReceivedNotAppended,
        TornTail,
        "relay crash before the append, torn write on disk",
        "a torn tail is cut, never read as a transaction"
    ),
    relay_crash!(
        "SS-03",
        ReceivedNotAppended,
        GarbageTail,
        "relay crash before the append, garbage on disk",
        "garbage past the durable end is cut, never applied"
    ),
    relay_crash!(
        "SS-04",
        AppendedNotAcknowledged,
        LoseUnsynced,
        "relay crash after publish (fsync) before the source ack",
        "duplicates only: the replay is skipped, not appended twice"
    ),
    relay_crash!(
        "SS-05",
        AppendedNotAcknowledged,
        TornTail,
        "crash after publish before ack, torn later writes",
        "what was fsynced survives; the source resumes behind it"
    ),
    relay_crash!(
        "SS-06",
        AppendedNotAcknowledged,
        GarbageTail,
        "crash after publish before ack, garbage later writes",
        "what was fsynced survives intact"
    ),
    relay_crash!(
        "SS-07",
        Acknowledged,
        LoseUnsynced,
        "relay crash right after the source ack",
        "the source checkpoint is never ahead of the durable log"
    ),
    relay_crash!(
        "SS-08",
        Acknowledged,
        TornTail,
        "crash after the ack, torn writes of the next batch",
        "acknowledged transactions are all in the log"
    ),
    relay_crash!(
        "SS-09",
        Acknowledged,
        GarbageTail,
        "crash after the ack, garbage writes of the next batch",
        "acknowledged transactions are all in the log, once"
    ),
    Scenario {
        id: "SS-10",
        family: SOURCE,
        simulation: "log fsync fails (the log poisons itself) and the relay restarts",
        invariant: "no acknowledgement without a successful fsync; nothing lost",
        proof: SOURCE_PROOF,
        recovery: "restart the relay on healthy storage: the worker replays from its last ack",
        run: Simulation::Relay(RelayFault::FsyncFails(SimCrash::LoseUnsynced)),
    },
    Scenario {
        id: "SS-11",
        family: SOURCE,
        simulation: "crash after publish, sparse index files lost",
        invariant: "the log index is rebuilt from the segments; every transaction readable once",
        proof: SOURCE_PROOF,
        recovery: SOURCE_RECOVERY,
        run: Simulation::Relay(RelayFault::CrashLosingIndex(
            CrashPoint::AppendedNotAcknowledged,
        )),
    },
    Scenario {
        id: "SS-12",
        family: SOURCE,
        simulation: "crash after the ack, sparse index files lost",
        invariant: "acknowledged transactions survive index loss",
        proof: SOURCE_PROOF,
        recovery: SOURCE_RECOVERY,
        run: Simulation::Relay(RelayFault::CrashLosingIndex(CrashPoint::Acknowledged)),
    },
    Scenario {
        id: "SS-13",
        family: SOURCE,
        simulation: "relay dies inside fsync (append -> fsync), a torn write on disk",
        invariant: "source ack only after fsync: nothing unsynced is acknowledged",
        proof: SOURCE_PROOF,
        recovery: SOURCE_RECOVERY,
        run: Simulation::Relay(RelayFault::FsyncFails(SimCrash::TornTail)),
    },
    Scenario {
        id: "SS-14",
        family: SOURCE,
        simulation: "relay dies inside fsync (append -> fsync), garbage on disk",
        invariant: "a tail that was never synced is cut, never read as a transaction",
        proof: SOURCE_PROOF,
        recovery: SOURCE_RECOVERY,
        run: Simulation::Relay(RelayFault::FsyncFails(SimCrash::GarbageTail)),
    },
    target!(
        "TA-01",
        ApplyFault::CommitLost { applied: false },
        TARGET_RECOVERY,
        "target connection lost before COMMIT reached the server",
        "no committed source transaction missing from the target"
    ),
    target!(
        "TA-02",
        ApplyFault::CommitLost { applied: true },
        TARGET_RECOVERY,
        "COMMIT succeeded on the target, its reply lost",
        "none applied twice: the redelivery is skipped and counted"
    ),
    target!(
        "TA-03",
        ApplyFault::Crash(CrashPoint::AppliedNotCommitted),
        TARGET_RECOVERY,
        "applier crash after rows and checkpoint were written, before COMMIT",
        "no half-visible transaction: the target shows none of it"
    ),
    target!(
        "TA-04",
        ApplyFault::Crash(CrashPoint::CommittedCursorNotMoved),
        TARGET_RECOVERY,
        "applier crash after the target commit, before the log cursor moved",
        "none applied twice: the redelivery is skipped and counted"
    ),
    target!(
        "TA-05",
        ApplyFault::Rewind,
        TARGET_RECOVERY,
        "the whole log redelivered (cursor rewound to the start)",
        "none applied twice: the redelivery is skipped and counted"
    ),
    target!(
        "TA-06",
        ApplyFault::CheckpointFails,
        TARGET_RECOVERY,
        "the checkpoint write fails during apply (disk full)",
        "rows and checkpoint commit together or not at all"
    ),
    target!(
        "TA-07",
        ApplyFault::MissingTable,
        "create the target table (`trellara preflight` names it), rerun `trellara run`; then `trellara verify`",
        "the target table is missing",
        "fail closed: quarantined, the flow stops at it, never skips it"
    ),
    target!(
        "TA-08",
        ApplyFault::RowDeletedBehind,
        "`trellara verify` names the key range; restore the row (or `trellara reseed`), rerun `trellara run`",
        "a target row deleted behind Trellara's back, then updated or deleted at the source",
        "no silent divergence: an update or delete matching zero rows fails closed"
    ),
    target!(
        "TA-09",
        ApplyFault::Constraint,
        QUARANTINE_RECOVERY,
        "a target check constraint the source data breaks; repaired and replayed",
        "fail closed: quarantined, the flow stops at it, never skips it"
    ),
    Scenario {
        id: "SS-15",
        family: SOURCE,
        simulation: "Kafka transport: relay crash after the broker acknowledged a batch, before the publisher's cursor moved",
        invariant: "publish, then move the cursor: the tail is re-sent (duplicates, never a gap) and skipped by the checkpoint",
        proof: SOURCE_PROOF,
        recovery: "restart `trellara run`: the publisher re-sends from its cursor; the applier skips what the target holds",
        run: Simulation::Apply(ApplyFault::TopicPublishCrash),
    },
    Scenario {
        id: "SS-16",
        family: SOURCE,
        simulation: "Kafka transport: a batch fails after part of it reached the broker",
        invariant: "the topic holds the log in order; partial batches are re-sent whole, copies skipped and counted",
        proof: SOURCE_PROOF,
        recovery: "fix the broker; the next round re-sends from the publisher's cursor",
        run: Simulation::Apply(ApplyFault::TopicSendFails),
    },
    target!(
        "TA-11",
        ApplyFault::TopicApplierCrash,
        TARGET_RECOVERY,
        "Kafka transport: applier crash after the target commit, before the group offset moved",
        "none applied twice: the redelivery is skipped and counted"
    ),
    target!(
        "TA-12",
        ApplyFault::LogFsyncFails,
        TARGET_RECOVERY,
        "the log's fsync fails while the applier has a batch's rows on the target (it reads written records early)",
        "nothing commits before the log holds it durably: the target shows none of it, the re-sent transactions apply once"
    ),
    target!(
        "TA-13",
        ApplyFault::TargetServerCrash,
        TARGET_RECOVERY,
        "target server crash undoing its asynchronous commits (the cursor persisted lazily in between)",
        "the cursor never passes a commit the target could lose: the lost tail is applied again, once"
    ),
    target!(
        "TA-10",
        ApplyFault::CutChunkRun,
        TARGET_RECOVERY,
        "the log holds a chunk run cut by a relay crash, then the transaction whole",
        "never split: a transaction applies whole or not at all"
    ),
    target!(
        "TA-14",
        ApplyFault::Fence(FenceWindow::BeforeHold),
        FENCE_RECOVERY,
        "verify dies holding its fence lock, before it set the fence",
        "a fence without a live holder holds nothing: the applier goes on to the source's last commit"
    ),
    target!(
        "TA-15",
        ApplyFault::Fence(FenceWindow::DuringSnapshot),
        FENCE_RECOVERY,
        "verify dies with the applier held at its fence, taking the target's snapshot",
        "while the holder lives nothing at or past the fence applies, and held the target is exactly the commits before it; the holder gone, the rest applies by itself"
    ),
    target!(
        "TA-16",
        ApplyFault::Fence(FenceWindow::AfterRelease),
        FENCE_RECOVERY,
        "verify releases its fence, left in the checkpoint row, and a second verify fences further on",
        "a released fence holds nothing; the next fence holds at its own position, exactly"
    ),
    capture!(
        "CA-01",
        CaptureFault::SchemaDrift,
        "review the DDL, then `trellara reseed --config trellara.yml` re-pins the relation",
        "a column added to a captured relation mid-stream; the relay rerun unrepaired",
        "schema drift stops capture before any row under the new schema, again on every rerun"
    ),
    capture!(
        "CA-02",
        CaptureFault::UnknownRelation,
        "check the publication and the source's pgoutput, then restart capture; `trellara reseed` if the relation is new",
        "a row arrives for a relation whose metadata was never sent",
        "fail closed: capture stops; everything before it durable, nothing after it"
    ),
    capture!(
        "CA-03",
        CaptureFault::Crash(CrashPoint::ReceivedNotAppended, SimCrash::TornTail),
        CAPTURE_RECOVERY,
        "relay crash before the append while rows, logical messages and re-sent relation metadata mix",
        "every transaction keeps its boundary, its order and exactly its changes"
    ),
    capture!(
        "CA-04",
        CaptureFault::Crash(CrashPoint::AppendedNotAcknowledged, SimCrash::LoseUnsynced),
        CAPTURE_RECOVERY,
        "streamed transactions interleaved with plain ones; crash after the append, before the ack",
        "a streamed transaction appears only at its Stream Commit, in commit order, once"
    ),
    capture!(
        "CA-05",
        CaptureFault::Crash(CrashPoint::Acknowledged, SimCrash::GarbageTail),
        CAPTURE_RECOVERY,
        "Stream Abort of whole transactions and of subtransactions; crash after a status reply",
        "Stream Abort discards only the aborted (sub)transaction"
    ),
    capture!(
        "CA-06",
        CaptureFault::Crash(CrashPoint::Acknowledged, SimCrash::LoseUnsynced),
        CAPTURE_RECOVERY,
        "keepalives inside open transactions and streams, and idle ones; crash after a status reply",
        "status replies report only the durable position"
    ),
    capture!(
        "CA-07",
        CaptureFault::Crash(CrashPoint::AppendedNotAcknowledged, SimCrash::TornTail),
        CAPTURE_RECOVERY,
        "updates leaving a TOASTed column unchanged; crash and replay",
        "unchanged TOAST stays marked unchanged, never NULL"
    ),
    capture!(
        "CA-08",
        CaptureFault::Crash(CrashPoint::ReceivedNotAppended, SimCrash::LoseUnsynced),
        CAPTURE_RECOVERY,
        "key-changing updates and deletes; crash and replay",
        "a key-changing update carries the old key it matches"
    ),
    capture!(
        "CA-09",
        CaptureFault::Failover,
        "point the flow at the new primary and restart capture: it resumes from the log's durable position",
        "the source fails over in the ack window: the session drops, the promoted standby's synced slot lags the acknowledged position",
        "no gap and no duplicate across a source failover"
    ),
    capture!(
        "CA-10",
        CaptureFault::Rejoin,
        "none needed: capture starts its new session at the boundary by itself",
        "a table joins mid-stream: the session ends at the join's boundary (just before, at or after a commit) and a new one starts there",
        "a session ended at a join boundary acknowledges exactly the boundary: nothing before it replayed, nothing at or past it skipped"
    ),
    snapshot!(
        "SN-01",
        SnapshotFault::Writes,
        SNAPSHOT_RECOVERY,
        "the source keeps writing while every table is copied",
        "the copy uses the exported snapshot's boundary: no gap, no duplicate at the handoff"
    ),
    snapshot!(
        "SN-02",
        SnapshotFault::Crash(CrashPoint::CopyInProgress),
        SNAPSHOT_RECOVERY,
        "relay crash in the middle of a table's copy",
        "an incomplete copy is redone from a new boundary, never continued at a wrong one"
    ),
    snapshot!(
        "SN-03",
        SnapshotFault::SourceFails,
        SNAPSHOT_RECOVERY,
        "the source's COPY fails mid-table",
        "an incomplete copy is redone from a new boundary, never continued at a wrong one"
    ),
    snapshot!(
        "SN-04",
        SnapshotFault::TargetFails,
        SNAPSHOT_RECOVERY,
        "the target loses the COMMIT of a table's copy (committed or not)",
        "a table's copy is idempotent: truncate, rows and progress commit together"
    ),
    snapshot!(
        "SN-05",
        SnapshotFault::Crash(CrashPoint::TableCopied),
        SNAPSHOT_RECOVERY,
        "crash after a table's copy committed; the run copies it again",
        "duplicate copy attempts never double a row"
    ),
    snapshot!(
        "SN-06",
        SnapshotFault::Crash(CrashPoint::CopiedNotHandedOff),
        SNAPSHOT_RECOVERY,
        "crash after the copy, before the handoff record",
        "a run not handed off is re-planned; streaming never starts without a handoff"
    ),
    snapshot!(
        "SN-07",
        SnapshotFault::Crash(CrashPoint::HandedOffNotStreaming),
        SNAPSHOT_RECOVERY,
        "crash after the handoff record, before the stream starts",
        "the handoff is recorded before the stream starts; the slot holds it from the boundary"
    ),
    snapshot!(
        "SN-08",
        SnapshotFault::Ddl,
        "add the column on the target (the error names it), rerun `trellara run`; then `trellara verify`",
        "a column added to a source table during the run",
        "DDL during the copy fails closed until the target has the column"
    ),
    snapshot!(
        "SN-09",
        SnapshotFault::Backward,
        "none needed: the stale process's move is refused; `trellara status` shows the run",
        "a stale process tries to move the handed-off run back to copying, planned or copied",
        "the state machine refuses unsafe backward transitions"
    ),
    pipeline!(
        "PL-01",
        PipelineFault::CaptureCrash(CrashPoint::ReceivedNotAppended, SimCrash::LoseUnsynced),
        PIPELINE_RECOVERY,
        "the process dies in capture while its applier follows the log",
        "a round ends however capture ends; nothing the log lost was applied"
    ),
    pipeline!(
        "PL-02",
        PipelineFault::CaptureCrash(CrashPoint::AppendedNotAcknowledged, SimCrash::TornTail),
        PIPELINE_RECOVERY,
        "the process dies in capture after an append, a torn write on disk",
        "a round ends however capture ends; the next resumes from the log's durable transaction"
    ),
    pipeline!(
        "PL-03",
        PipelineFault::ApplierCrash(CrashPoint::AppliedNotCommitted),
        PIPELINE_RECOVERY,
        "the process dies in the applier with rows in its open target transaction",
        "a failed stage stops capture: the round ends, never a capture following for no one"
    ),
    pipeline!(
        "PL-04",
        PipelineFault::ApplierCrash(CrashPoint::CommittedCursorNotMoved),
        PIPELINE_RECOVERY,
        "the process dies in the applier after a commit, before its cursor moved",
        "a failed stage stops capture; the checkpoint skips what the target holds"
    ),
    pipeline!(
        "PL-05",
        PipelineFault::Refused,
        QUARANTINE_RECOVERY,
        "the target refuses a row while the flow follows",
        "a failed stage stops capture: the round ends with the quarantine, never a hang"
    ),
    pipeline!(
        "PL-06",
        PipelineFault::SessionLost,
        PIPELINE_RECOVERY,
        "the source session drops while the applier has rows to apply",
        "the stage learns that capture ended and applies all that is durable before the round reports the error"
    ),
];

/// Runs `scenario` over `seeds` seeds (from `first_seed`): the failing
/// seed and what broke, or how many faults the histories went through.
pub fn run_scenario(scenario: &Scenario, first_seed: u64, seeds: u64) -> Result<u32, String> {
    let mut faults = 0;
    for seed in first_seed..first_seed + seeds {
        faults += match scenario.run {
            Simulation::Relay(fault) => relay::history_with(seed, fault)?.crashes,
            Simulation::Apply(fault) => apply::history(seed, fault)?.faults,
            Simulation::Capture(fault) => capture::history(seed, fault)?.faults,
            Simulation::Snapshot(fault) => snapshot::history(seed, fault)?.faults,
            Simulation::Pipeline(fault) => pipeline::history(seed, fault)?.faults,
        };
    }
    Ok(faults)
}

/// Qualification: a run qualifies a build only when every scenario of the
/// matrix ran over at least one seed and every invariant held. Computed
/// from the results, never configured: there is no switch that says
/// "qualified".
pub fn qualified(results: &[(&Scenario, Result<u32, String>)]) -> bool {
    SCENARIOS
        .iter()
        .all(|s| results.iter().any(|(r, _)| r.id == s.id))
        && results.iter().all(|(_, r)| r.is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_all(seeds: u64) -> Vec<(&'static Scenario, Result<u32, String>)> {
        SCENARIOS
            .iter()
            .map(|s| (s, run_scenario(s, 0, seeds)))
            .collect()
    }

    /// The verdict follows the results: the whole matrix holding qualifies;
    /// one broken ordering rule, or a partial run, does not.
    #[test]
    fn qualification_is_computed_from_the_runs() {
        assert!(qualified(&run_all(3)));
        crate::native::mutation::ACK_BEFORE_APPEND.with(|m| m.set(true));
        let broken = run_all(3);
        crate::native::mutation::ACK_BEFORE_APPEND.with(|m| m.set(false));
        assert!(!qualified(&broken));
        let partial: Vec<_> = run_all(1)
            .into_iter()
            .filter(|(s, _)| s.family == TARGET)
            .collect();
        assert!(!qualified(&partial));
    }

    /// Every scenario of the matrix holds over 30 seeds, and its fault
    /// actually happens in most histories.
    #[test]
    fn every_scenario_holds() {
        for scenario in &SCENARIOS {
            let faults =
                run_scenario(scenario, 0, 30).unwrap_or_else(|e| panic!("{}: {e}", scenario.id));
            assert!(
                faults >= 20,
                "{}: only {faults} faults in 30 histories",
                scenario.id
            );
        }
    }

    #[test]
    fn scenario_ids_are_unique() {
        let ids: std::collections::BTreeSet<_> = SCENARIOS.iter().map(|s| s.id).collect();
        assert_eq!(ids.len(), SCENARIOS.len());
    }
}
