//! Named crash points: every window in Trellara's ordering where a process
//! death leaves durable state half-way between two steps. Production code
//! asks [`CrashHooks::crash_at`] at each window and gets [`NoCrash`]; the
//! deterministic simulator (`crate::sim`) passes hooks that stop the process
//! there, then checks the invariants after restart.
//!
//! | point | window | protected by |
//! |---|---|---|
//! | `ReceivedNotAppended` | receive → append | the source replays from its last ack |
//! | `AppendedNotSynced` | append → fsync | torn tails are cut on reopen; no ack yet |
//! | `AppendedNotAcknowledged` | fsync → source ack | duplicates skipped by commit LSN |
//! | `Acknowledged` | source ack sent | ack only after fsync |
//! | `AppliedNotCommitted` | rows applied → checkpoint and commit (sent together) | rows and checkpoint in one target transaction |
//! | `CommittedCursorNotMoved` | checkpoint → log cursor | the checkpoint skips the redelivery |
//! | `CopyInProgress` | a table's copy transaction open | truncate, rows and progress commit together |
//! | `TableCopied` | one table copied, the next not started | each table's copy is idempotent |
//! | `CopiedNotHandedOff` | copy → handoff record | a run not handed off is re-planned |
//! | `HandedOffNotStreaming` | handoff → stream start | the slot holds the stream from the boundary |
//! | `PublishedCursorNotMoved` | Kafka publish → publisher cursor | the tail is published again; the checkpoint skips it |

/// A window where the simulator can stop a process as if it died.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// Relay: a whole envelope was received and batched, not yet appended.
    ReceivedNotAppended,
    /// Relay: appended, the fsync not returned. Reached through the
    /// simulated storage (the process dies inside fsync), not a hook call.
    AppendedNotSynced,
    /// Relay: appended and fsynced, the source's Ack not yet sent.
    AppendedNotAcknowledged,
    /// Relay: the Ack was sent.
    Acknowledged,
    /// Applier: rows written in the open target transaction; the
    /// checkpoint and COMMIT (sent together) not sent.
    AppliedNotCommitted,
    /// Applier: the target transaction committed, the log cursor not moved.
    CommittedCursorNotMoved,
    /// Snapshot: a table's copy transaction is open on the target. Reached
    /// through the simulated target (the process dies mid-COPY), not a hook.
    CopyInProgress,
    /// Snapshot: a table's copy committed, the next not started.
    TableCopied,
    /// Snapshot: every table copied (state copied), the handoff not recorded.
    CopiedNotHandedOff,
    /// Snapshot: the handoff recorded (stream_handoff_ready), the stream not
    /// started.
    HandedOffNotStreaming,
    /// Kafka transport: records acknowledged by the broker, the publisher's
    /// log cursor not moved.
    PublishedCursorNotMoved,
}

pub trait CrashHooks: std::fmt::Debug {
    /// True: stop here (the caller treats it as the process dying).
    fn crash_at(&self, point: CrashPoint) -> bool;
}

/// Production: never stop.
#[derive(Debug, Clone, Copy)]
pub struct NoCrash;

impl CrashHooks for NoCrash {
    fn crash_at(&self, _: CrashPoint) -> bool {
        false
    }
}
