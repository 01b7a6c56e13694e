//! Capture: the external relay's real streaming loop
//! ([`capture::stream_changes`]: decode, assemble, group commit, status
//! replies) over the real log on [`SimStorage`], fed by a simulated
//! walsender that speaks pgoutput v2 - written with [`pgoutput::encode`],
//! read by the real decoder - from a seeded source: plain transactions,
//! streamed transactions interleaved with them (some aborted whole, some
//! with an aborted subtransaction), transactional and non-transactional
//! logical messages, unchanged TOAST, key-changing updates, truncates, and
//! keepalives inside and between transactions.
//!
//! The walsender behaves like PostgreSQL's where it matters: a session
//! starts at `max(requested, confirmed)` and sends every transaction whose
//! end lies past it (a streamed one from its first segment), sends each
//! relation's metadata before its first use in the session, and moves the
//! slot only on a status reply.
//!
//! Invariants checked:
//! - every position offered to the source (`set_durable`) and every status
//!   reply is at or below what the log holds durably (or recorded as an
//!   idle advance first);
//! - at the end the log holds every committed transaction exactly once, in
//!   commit order, with exactly the changes the source committed (streamed
//!   ones only at their Stream Commit, aborted ones and aborted
//!   subtransactions never; unchanged TOAST marked unchanged; the old key
//!   of a key-changing update);
//! - schema drift and a row without relation metadata stop capture before
//!   the transaction, with everything before it durable, and stop it again
//!   on a rerun.

use super::{CrashOnce, Rng, sim_log_config};
use crate::capture::{self, CaptureConfig, CaptureError, CaptureStats, SourceStream};
use crate::crash::CrashPoint;
use crate::log::Log;
use crate::log::storage::{SimCrash, SimStorage};
use bytes::Bytes;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, VecDeque};
use std::rc::Rc;
use std::time::Duration;
use trellara_common::Lsn;
use trellara_common::envelope::{
    self, BeforeImage, LogicalMessage, Operation, RowChange, Value, change, value,
};
use trellara_external_relay::pgoutput::{self as pg, Column, Message, ProtoVersion};
use trellara_external_relay::pgwire::{ReplicationEvent, WireError};
use trellara_external_relay::{Assembler, AssemblerConfig};

/// What goes wrong in a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CaptureFault {
    /// The relay dies at the point (the k-th time); the storage loses what
    /// `SimCrash` says.
    Crash(CrashPoint, SimCrash),
    /// A column is added to the relation mid-stream.
    SchemaDrift,
    /// A row arrives for a relation whose metadata was never sent.
    UnknownRelation,
    /// The source fails over in the ack window: the session drops, and the
    /// new primary's synced slot lags what the relay acknowledged.
    Failover,
    /// A table joined mid-stream: the session ends at the join's boundary
    /// and the next starts there ([`CaptureError::Rejoin`]).
    Rejoin,
}

/// What one simulated history did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct CaptureHistory {
    pub transactions: usize,
    pub crashes: u32,
    pub sessions: u32,
    pub duplicates_skipped: u64,
    pub streamed: usize,
    pub aborted: usize,
    pub toast: usize,
    pub key_changes: usize,
    pub mid_transaction_keepalives: usize,
    /// Faults that fired (crashes, or the refusal and its rerun).
    pub faults: u32,
}

const OID: u32 = 16_385;
const UNKNOWN_OID: u32 = 99_999;

/// One thing the walsender sends, in WAL order.
#[derive(Debug, Clone)]
enum Emission {
    /// A message of transaction `txn`; `uses` names the relation whose
    /// metadata must precede it in a session.
    Data {
        txn: usize,
        pos: u64,
        message: Message,
        uses: Option<u32>,
    },
    /// Not part of any transaction (non-transactional message).
    Loose {
        pos: u64,
        message: Message,
    },
    Keepalive {
        pos: u64,
        reply: bool,
    },
}

/// What the source committed: the log must hold exactly this.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Committed {
    pub commit_lsn: u64,
    pub end_lsn: u64,
    xid: u64,
    pub bodies: Vec<change::Body>,
}

pub(super) struct Source {
    emissions: Vec<Emission>,
    /// End position of every transaction (aborted ones: the abort).
    ends: Vec<u64>,
    pub committed: Vec<Committed>,
    /// The transaction whose first message must stop capture, if any.
    refused: Option<usize>,
    history: CaptureHistory,
}

fn text_column(s: &str) -> Column {
    Column::Text(Bytes::copy_from_slice(s.as_bytes()))
}

fn text_value(s: &str) -> Value {
    Value {
        kind: Some(value::Kind::Text(s.to_owned())),
    }
}

fn kind_value(kind: value::Kind) -> Value {
    Value { kind: Some(kind) }
}

fn relation_message(xid: Option<u32>, extra: bool) -> Message {
    let column = |name: &str, type_oid, key| pg::RelationColumn {
        key,
        name: name.into(),
        type_oid,
        type_modifier: -1,
    };
    let mut columns = vec![
        column("id", 20, true),
        column("note", 25, false),
        column("doc", 25, false),
    ];
    if extra {
        columns.push(column("extra", 25, false));
    }
    Message::Relation(pg::Relation {
        xid,
        oid: OID,
        namespace: "public".into(),
        name: "sim".into(),
        replica_identity: b'd',
        columns,
    })
}

fn row_body(op: Operation, before: Vec<Value>, after: Vec<Value>) -> change::Body {
    let before_kind = if before.is_empty() {
        BeforeImage::None
    } else {
        BeforeImage::Key
    };
    change::Body::Row(RowChange {
        relation_id: OID,
        operation: op as i32,
        before_kind: before_kind as i32,
        before,
        after,
        truncate_cascade: false,
        truncate_restart_identity: false,
    })
}

/// The key-only old image as pgoutput sends it, and as it is captured.
fn old_key(id: u64) -> (Vec<Column>, Vec<Value>) {
    let absent = || kind_value(value::Kind::Absent(true));
    (
        vec![text_column(&id.to_string()), Column::Null, Column::Null],
        vec![text_value(&id.to_string()), absent(), absent()],
    )
}

/// An update of `id` to (`note`, `doc`) as pgoutput sends it and as it is
/// captured; `old`: the key it had (a key-changing update).
fn update(
    xid: Option<u32>,
    id: u64,
    note: &str,
    doc: (Column, value::Kind),
    old: Option<u64>,
) -> (Message, Option<u32>, change::Body) {
    let (old_tuple, before) = match old {
        Some(key) => {
            let (columns, before) = old_key(key);
            (Some((pg::OldKind::Key, columns)), before)
        }
        None => (None, Vec::new()),
    };
    let new = vec![text_column(&id.to_string()), text_column(note), doc.0];
    let after = vec![
        text_value(&id.to_string()),
        text_value(note),
        kind_value(doc.1),
    ];
    (
        Message::Update(pg::Update {
            xid,
            relation: OID,
            old: old_tuple,
            new,
        }),
        Some(OID),
        row_body(Operation::Update, before, after),
    )
}

/// Generates one change of a transaction: the message (with `xid` inside a
/// stream block) and the body the log must carry.
struct Changes<'a> {
    rng: &'a mut Rng,
    live: &'a mut BTreeSet<u64>,
    next_id: &'a mut u64,
    history: &'a mut CaptureHistory,
}

impl Changes<'_> {
    fn next(&mut self, xid: Option<u32>) -> (Message, Option<u32>, change::Body) {
        let roll = self.rng.below(20);
        let note = format!("n{}", self.rng.below(1000));
        let existing = self.live.iter().copied().nth(
            self.rng
                .below(self.live.len().max(1) as u64)
                .try_into()
                .unwrap_or(0),
        );
        match (roll, existing) {
            (0, _) => (
                Message::Message(pg::LogicalMessage {
                    xid,
                    transactional: true,
                    lsn: 0,
                    prefix: "sim".into(),
                    content: Bytes::from(note.clone().into_bytes()),
                }),
                None,
                change::Body::Message(LogicalMessage {
                    prefix: "sim".into(),
                    content: note.into_bytes(),
                }),
            ),
            (1, _) => {
                self.live.clear();
                (
                    Message::Truncate(pg::Truncate {
                        xid,
                        cascade: false,
                        restart_identity: false,
                        relations: vec![OID],
                    }),
                    Some(OID),
                    change::Body::Row(RowChange {
                        relation_id: OID,
                        operation: Operation::Truncate as i32,
                        before_kind: BeforeImage::None as i32,
                        before: Vec::new(),
                        after: Vec::new(),
                        truncate_cascade: false,
                        truncate_restart_identity: false,
                    }),
                )
            }
            (2..=5, Some(id)) => {
                // An update that leaves the TOASTed doc alone.
                self.history.toast += 1;
                let unchanged = (Column::UnchangedToast, value::Kind::UnchangedToast(true));
                update(xid, id, &note, unchanged, None)
            }
            (6..=8, Some(old)) => {
                // A key-changing update: located by its old key.
                self.history.key_changes += 1;
                let id = *self.next_id;
                *self.next_id += 1;
                self.live.remove(&old);
                self.live.insert(id);
                update(
                    xid,
                    id,
                    &note,
                    (Column::Null, value::Kind::Null(true)),
                    Some(old),
                )
            }
            (9..=10, Some(old)) => {
                self.live.remove(&old);
                let (old_columns, before) = old_key(old);
                (
                    Message::Delete(pg::Delete {
                        xid,
                        relation: OID,
                        old_kind: pg::OldKind::Key,
                        old: old_columns,
                    }),
                    Some(OID),
                    row_body(Operation::Delete, before, Vec::new()),
                )
            }
            _ => {
                let id = *self.next_id;
                *self.next_id += 1;
                self.live.insert(id);
                let doc = "d".repeat(self.rng.below(40) as usize);
                (
                    Message::Insert(pg::Insert {
                        xid,
                        relation: OID,
                        new: vec![
                            text_column(&id.to_string()),
                            text_column(&note),
                            text_column(&doc),
                        ],
                    }),
                    Some(OID),
                    row_body(
                        Operation::Insert,
                        Vec::new(),
                        vec![
                            text_value(&id.to_string()),
                            text_value(&note),
                            text_value(&doc),
                        ],
                    ),
                )
            }
        }
    }
}

/// An open streamed transaction while the source is generated.
struct OpenStream {
    txn: usize,
    xid: u32,
    bodies: Vec<change::Body>,
    next_subxid: u32,
}

/// The seeded source: its WAL (what the walsender sends) and what it
/// committed.
pub(super) fn source(rng: &mut Rng, fault: CaptureFault, streams: bool) -> Source {
    let mut src = Source {
        emissions: Vec::new(),
        ends: Vec::new(),
        committed: Vec::new(),
        refused: None,
        history: CaptureHistory::default(),
    };
    let mut live = BTreeSet::new();
    let mut next_id = 1u64;
    let mut pos = 0x0300_0000u64;
    let mut xid = 700u32;
    let mut open: Vec<OpenStream> = Vec::new();
    let steps = 12 + rng.below(24);
    let refuse_at = 2 + rng.below(steps / 2);
    for step in 0..steps {
        let roll = rng.below(20);
        // Drift is drift from a pinned schema: some committed row must have
        // pinned the relation first (with no pin, the first schema seen is
        // the pin).
        let pinned = src
            .committed
            .iter()
            .flat_map(|c| &c.bodies)
            .any(|b| matches!(b, change::Body::Row(_)));
        let refuse_here = step >= refuse_at
            && (pinned || fault == CaptureFault::UnknownRelation)
            && matches!(
                fault,
                CaptureFault::SchemaDrift | CaptureFault::UnknownRelation
            );
        if refuse_here
            || roll < 9
            || (open.is_empty() && (14..17).contains(&roll))
            || (!streams && roll < 17)
        {
            // A plain transaction, sent whole at its commit.
            xid += 1;
            let txn = src.ends.len();
            let commit = pos + 0x200 + rng.below(0x400);
            let end = commit + 0x28;
            src.ends.push(end);
            let commit_message = Message::Commit(pg::Commit {
                flags: 0,
                commit_lsn: commit,
                end_lsn: end,
                commit_time: 0,
            });
            let push = |src: &mut Source, pos: &mut u64, message, uses| {
                *pos += 0x10;
                src.emissions.push(Emission::Data {
                    txn,
                    pos: *pos,
                    message,
                    uses,
                });
            };
            push(
                &mut src,
                &mut pos,
                Message::Begin(pg::Begin {
                    final_lsn: commit,
                    commit_time: 0,
                    xid,
                }),
                None,
            );
            if refuse_here {
                // The last transaction: after ALTER TABLE every row has the
                // new shape, so a rerun that accepted it would append it.
                src.refused = Some(txn);
                let (relation, width) = match fault {
                    CaptureFault::SchemaDrift => {
                        push(&mut src, &mut pos, relation_message(None, true), None);
                        (OID, 4)
                    }
                    _ => (UNKNOWN_OID, 3),
                };
                let new = (0..width).map(|i| text_column(&i.to_string())).collect();
                push(
                    &mut src,
                    &mut pos,
                    Message::Insert(pg::Insert {
                        xid: None,
                        relation,
                        new,
                    }),
                    None,
                );
                pos = pos.max(commit);
                push(&mut src, &mut pos, commit_message, None);
                pos = pos.max(end);
                break;
            }
            let mut bodies = Vec::new();
            let mut changes = Changes {
                rng,
                live: &mut live,
                next_id: &mut next_id,
                history: &mut src.history,
            };
            let count = 1 + changes.rng.below(6);
            let mut generated = Vec::new();
            for _ in 0..count {
                generated.push(changes.next(None));
            }
            let keepalive_inside = rng.below(3) == 0;
            for (i, (message, uses, body)) in generated.into_iter().enumerate() {
                push(&mut src, &mut pos, message, uses);
                bodies.push(body);
                if keepalive_inside && i == 0 {
                    // Sent while decoding; its wal_end is already past the
                    // commit record.
                    src.history.mid_transaction_keepalives += 1;
                    src.emissions.push(Emission::Keepalive {
                        pos: end,
                        reply: rng.below(2) == 0,
                    });
                }
            }
            pos = pos.max(commit);
            push(&mut src, &mut pos, commit_message, None);
            pos = pos.max(end);
            src.committed.push(Committed {
                commit_lsn: commit,
                end_lsn: end,
                xid: u64::from(xid),
                bodies,
            });
        } else if roll < 14 {
            // A new streamed transaction, or the next segment of one.
            let index = if open.is_empty() || roll < 11 {
                xid += 1;
                src.ends.push(0);
                src.history.streamed += 1;
                open.push(OpenStream {
                    txn: src.ends.len() - 1,
                    xid,
                    bodies: Vec::new(),
                    next_subxid: xid * 100,
                });
                open.len() - 1
            } else {
                rng.below(open.len() as u64) as usize
            };
            let stream = &mut open[index];
            let first = stream.bodies.is_empty();
            let abort_sub = !first && rng.below(4) == 0;
            let subxid = if abort_sub || rng.below(3) == 0 {
                stream.next_subxid += 1;
                stream.next_subxid
            } else {
                stream.xid
            };
            pos += 0x10;
            src.emissions.push(Emission::Data {
                txn: stream.txn,
                pos,
                message: Message::StreamStart(pg::StreamStart {
                    xid: stream.xid,
                    first_segment: first,
                }),
                uses: None,
            });
            let mut changes = Changes {
                rng,
                live: &mut live,
                next_id: &mut next_id,
                history: &mut src.history,
            };
            let count = 1 + changes.rng.below(5);
            // An aborted subtransaction's rows must not change what later
            // rows see: generate them against a scratch copy.
            let mut scratch = changes.live.clone();
            let mut scratch_next = *changes.next_id;
            let mut segment = Vec::new();
            for _ in 0..count {
                let generated = if abort_sub {
                    Changes {
                        rng: changes.rng,
                        live: &mut scratch,
                        next_id: &mut scratch_next,
                        history: changes.history,
                    }
                    .next(Some(subxid))
                } else {
                    changes.next(Some(subxid))
                };
                segment.push(generated);
            }
            if abort_sub {
                // Keep ids unique across the aborted rows too.
                next_id = next_id.max(scratch_next);
            }
            for (message, uses, body) in segment {
                pos += 0x10;
                src.emissions.push(Emission::Data {
                    txn: stream.txn,
                    pos,
                    message,
                    uses,
                });
                if !abort_sub {
                    stream.bodies.push(body);
                }
            }
            pos += 0x10;
            src.emissions.push(Emission::Data {
                txn: stream.txn,
                pos,
                message: Message::StreamStop,
                uses: None,
            });
            if abort_sub {
                src.history.aborted += 1;
                pos += 0x10;
                src.emissions.push(Emission::Data {
                    txn: stream.txn,
                    pos,
                    message: Message::StreamAbort(pg::StreamAbort {
                        xid: stream.xid,
                        subxid,
                    }),
                    uses: None,
                });
            }
            if rng.below(2) == 0 {
                // Between segments: the stream is open, the slot must stay.
                pos += 0x10;
                src.emissions.push(Emission::Keepalive {
                    pos,
                    reply: rng.below(2) == 0,
                });
            }
        } else if roll < 17 && !open.is_empty() {
            // A streamed transaction ends: committed, or aborted whole.
            let stream = open.remove(rng.below(open.len() as u64) as usize);
            let commit = pos + 0x100;
            let end = commit + 0x28;
            pos = end;
            if stream.bodies.is_empty() || rng.below(5) == 0 {
                src.history.aborted += 1;
                src.ends[stream.txn] = end;
                src.emissions.push(Emission::Data {
                    txn: stream.txn,
                    pos: end,
                    message: Message::StreamAbort(pg::StreamAbort {
                        xid: stream.xid,
                        subxid: stream.xid,
                    }),
                    uses: None,
                });
            } else {
                src.ends[stream.txn] = end;
                src.emissions.push(Emission::Data {
                    txn: stream.txn,
                    pos: end,
                    message: Message::StreamCommit(pg::StreamCommit {
                        xid: stream.xid,
                        flags: 0,
                        commit_lsn: commit,
                        end_lsn: end,
                        commit_time: 0,
                    }),
                    uses: None,
                });
                src.committed.push(Committed {
                    commit_lsn: commit,
                    end_lsn: end,
                    xid: u64::from(stream.xid),
                    bodies: stream.bodies,
                });
            }
        } else if roll < 19 {
            pos += 0x40;
            src.emissions.push(Emission::Loose {
                pos,
                message: Message::Message(pg::LogicalMessage {
                    xid: None,
                    transactional: false,
                    lsn: pos,
                    prefix: "loose".into(),
                    content: Bytes::from_static(b"x"),
                }),
            });
        } else {
            // Idle: WAL of other databases moves the position.
            pos += 0x100;
            src.emissions.push(Emission::Keepalive {
                pos,
                reply: rng.below(2) == 0,
            });
        }
    }
    // Whatever is still streaming commits at the end (after a refused
    // transaction nothing more is captured anyway).
    if src.refused.is_some() {
        open.clear();
    }
    for stream in open.drain(..) {
        let commit = pos + 0x100;
        let end = commit + 0x28;
        pos = end;
        src.ends[stream.txn] = end;
        src.emissions.push(Emission::Data {
            txn: stream.txn,
            pos: end,
            message: Message::StreamCommit(pg::StreamCommit {
                xid: stream.xid,
                flags: 0,
                commit_lsn: commit,
                end_lsn: end,
                commit_time: 0,
            }),
            uses: None,
        });
        if stream.bodies.is_empty() {
            // Nothing left after its aborted subtransactions: an empty
            // transaction is not sent at all by the server; keep the model
            // equally empty by dropping it.
            src.emissions
                .retain(|e| !matches!(e, Emission::Data { txn, .. } if *txn == stream.txn));
            continue;
        }
        src.committed.push(Committed {
            commit_lsn: commit,
            end_lsn: end,
            xid: u64::from(stream.xid),
            bodies: stream.bodies,
        });
    }
    src.emissions.push(Emission::Keepalive {
        pos: pos + 0x100,
        reply: true,
    });
    src.history.transactions = src.committed.len();
    src
}

/// The simulated walsender of one session.
pub(super) struct Walsender {
    queue: VecDeque<ReplicationEvent>,
    durable: Lsn,
    /// The slot's confirmed position: survives sessions.
    confirmed: Rc<Cell<u64>>,
    log: Log<SimStorage>,
    violations: Rc<RefCell<Vec<String>>>,
    exhausted: Rc<Cell<bool>>,
    rng: Rng,
    status_every: u64,
    since_status: u64,
    /// Events left before the session drops (a failover), once a history.
    drop_after: Option<u64>,
    /// Every confirmed position, oldest first: a failover's synced slot
    /// is one of them.
    confirmed_history: Rc<RefCell<Vec<u64>>>,
}

impl Walsender {
    /// Starts a session at `requested`: everything of a transaction ending
    /// past the start, with relation metadata before each relation's first
    /// use in this session.
    pub(super) fn start(src: &Source, requested: u64, session: Session) -> Walsender {
        let start = requested.max(session.confirmed.get());
        let mut queue = VecDeque::new();
        let mut sent = BTreeSet::new();
        let mut in_block = false;
        for emission in &src.emissions {
            let (pos, message) = match emission {
                Emission::Data {
                    txn, pos, message, ..
                } if src.ends[*txn] > start => (*pos, message.clone()),
                Emission::Loose { pos, message } if *pos > start => (*pos, message.clone()),
                Emission::Keepalive { pos, reply } if *pos > start => {
                    queue.push_back(ReplicationEvent::Keepalive {
                        wal_end: Lsn(*pos),
                        reply_requested: *reply,
                    });
                    continue;
                }
                _ => continue,
            };
            match &message {
                Message::StreamStart(_) => in_block = true,
                Message::StreamStop => in_block = false,
                _ => {}
            }
            if let Emission::Data {
                uses: Some(oid), ..
            } = emission
                && sent.insert(*oid)
            {
                let xid = match (&message, in_block) {
                    (Message::Insert(m), true) => m.xid,
                    (Message::Update(m), true) => m.xid,
                    (Message::Delete(m), true) => m.xid,
                    (Message::Truncate(m), true) => m.xid,
                    _ => None,
                };
                let relation = relation_message(xid, false);
                queue.push_back(ReplicationEvent::XLogData {
                    start: Lsn(pos),
                    end: Lsn(pos),
                    data: pg::encode(&relation),
                });
            }
            queue.push_back(ReplicationEvent::XLogData {
                start: Lsn(pos),
                end: Lsn(pos),
                data: pg::encode(&message),
            });
        }
        Walsender {
            queue,
            durable: Lsn(start),
            confirmed: session.confirmed,
            log: session.log,
            violations: session.violations,
            exhausted: session.exhausted,
            rng: Rng(session.seed),
            status_every: 3 + session.seed % 5,
            since_status: 0,
            drop_after: session.drop_after,
            confirmed_history: session.confirmed_history,
        }
    }

    /// The most the log can vouch for: its last complete transaction's end,
    /// or an idle advance recorded first.
    fn vouched(&self) -> u64 {
        crate::capture::read_resume(&self.log).map_or(0, |r| r.ack_lsn.0)
    }
}

/// What survives a relay crash, shared with each session's walsender.
#[derive(Clone)]
pub(super) struct Session {
    pub seed: u64,
    pub confirmed: Rc<Cell<u64>>,
    pub log: Log<SimStorage>,
    pub violations: Rc<RefCell<Vec<String>>>,
    pub exhausted: Rc<Cell<bool>>,
    pub drop_after: Option<u64>,
    pub confirmed_history: Rc<RefCell<Vec<u64>>>,
}

impl SourceStream for Walsender {
    async fn recv(&mut self) -> Result<Option<ReplicationEvent>, WireError> {
        // Sometimes nothing more has arrived yet: the relay's group commit
        // flushes then.
        if self.rng.below(4) == 0 {
            tokio::task::yield_now().await;
        }
        self.since_status += 1;
        if let Some(left) = self.drop_after.as_mut() {
            if *left == 0 {
                return Err(WireError::Closed);
            }
            *left -= 1;
        }
        match self.queue.pop_front() {
            Some(event) => Ok(Some(event)),
            None => {
                self.exhausted.set(true);
                std::future::pending().await
            }
        }
    }

    fn set_durable(&mut self, lsn: Lsn) {
        let vouched = self.vouched();
        if lsn.0 > vouched {
            self.violations.borrow_mut().push(format!(
                "the relay offered the source {lsn} while the log vouches only for {}",
                Lsn(vouched)
            ));
        }
        self.durable = self.durable.max(lsn);
    }

    fn durable(&self) -> Lsn {
        self.durable
    }

    fn status_due(&self, _every: Duration) -> bool {
        self.since_status >= self.status_every
    }

    async fn send_status(&mut self) -> Result<(), WireError> {
        self.since_status = 0;
        let vouched = self.vouched();
        if self.durable.0 > vouched {
            self.violations.borrow_mut().push(format!(
                "a status reply reported {} flushed while the log vouches only for {}",
                self.durable,
                Lsn(vouched)
            ));
        }
        self.confirmed.set(self.confirmed.get().max(self.durable.0));
        self.confirmed_history
            .borrow_mut()
            .push(self.confirmed.get());
        Ok(())
    }
}

pub(super) fn config() -> CaptureConfig {
    CaptureConfig {
        source: "postgres://sim@localhost/sim"
            .parse()
            .unwrap_or_else(|_| unreachable!("a valid URL")),
        slot: "sim".into(),
        publications: vec!["sim".into()],
        create_slot: false,
        source_id: "sim".into(),
        dataset_id: "sim".into(),
        log_dir: "/log".into(),
        proto_version: ProtoVersion::V2,
        memory_budget: 1 << 20,
        chunk_bytes: 512,
        status_interval: Duration::from_secs(10),
        max_backoff: Duration::from_secs(1),
        pinned: std::collections::HashMap::new(),
        schemas: std::collections::HashMap::new(),
        floor: Lsn::ZERO,
        progress: None,
        begun: None,
        observe: None,
        rejoin_at: None,
        ddl: None,
    }
}

/// A simulated session's assembler, spilling under the temp dir's `spill`.
pub(super) fn assembler(
    config: &CaptureConfig,
    chunk_bytes: usize,
    spill: &str,
    pinned: std::collections::HashMap<String, u64>,
) -> Assembler {
    Assembler::new(AssemblerConfig {
        source: envelope::SourceIdentity {
            source_id: "sim".into(),
            dataset_id: "sim".into(),
            system_identifier: 1,
            database: "sim".into(),
            timeline: 1,
        },
        server_version_num: 170_009,
        decoder: "pgoutput/2".into(),
        memory_budget: config.memory_budget,
        chunk_bytes,
        spill_dir: std::env::temp_dir().join(spill),
        pinned,
        schemas: std::collections::HashMap::new(),
    })
}

/// The log's transactions: chunk runs joined, runs cut by a crash skipped.
fn logged(log: &Log<SimStorage>, seed: u64) -> Result<Vec<Committed>, String> {
    let reader = log
        .read_from(log.first_offset())
        .map_err(|e| format!("seed {seed}: read the log: {e}"))?;
    let mut out: Vec<Committed> = Vec::new();
    let mut run: Option<(Committed, u32)> = None;
    for record in reader {
        let record = record.map_err(|e| format!("seed {seed}: log record: {e}"))?;
        let env = envelope::decode(&record.payload)
            .map_err(|e| format!("seed {seed}: log envelope: {e}"))?;
        let boundary = env.boundary.clone().unwrap_or_default();
        let bodies: Vec<change::Body> = env.changes.into_iter().filter_map(|c| c.body).collect();
        if boundary.chunk_index == 0 {
            run = Some((
                Committed {
                    commit_lsn: env.commit_lsn,
                    end_lsn: env.end_lsn,
                    xid: env.xid,
                    bodies: Vec::new(),
                },
                0,
            ));
        }
        let Some((txn, next)) = run.as_mut() else {
            continue;
        };
        if txn.commit_lsn != env.commit_lsn || *next != boundary.chunk_index {
            run = None;
            continue;
        }
        txn.bodies.extend(bodies);
        *next += 1;
        if *next >= boundary.chunk_count.max(1)
            && let Some((txn, _)) = run.take()
        {
            out.push(txn);
        }
    }
    Ok(out)
}

/// Reopens the log as a restarted relay does, with `consumers`
/// registered, and where capture resumes; Err when the slot was confirmed
/// past what the log holds (a gap no later session can fill).
pub(super) fn reopen(
    storage: &SimStorage,
    consumers: &[&str],
    confirmed: u64,
) -> Result<(Log<SimStorage>, capture::Resume), String> {
    let (log, _) = Log::open(storage.clone(), "/log", sim_log_config())
        .map_err(|e| format!("reopen the log: {e}"))?;
    for consumer in consumers {
        log.register_consumer(consumer)
            .map_err(|e| format!("register {consumer}: {e}"))?;
    }
    let resume = capture::read_resume(&log).map_err(|e| format!("resume: {e}"))?;
    if confirmed > resume.ack_lsn.0 {
        return Err(format!(
            "the slot was confirmed to {} but the log holds only up to {}",
            Lsn(confirmed),
            resume.ack_lsn
        ));
    }
    Ok((log, resume))
}

/// Runs one capture history with `fault`. Err names the broken invariant.
pub(crate) fn history(seed: u64, fault: CaptureFault) -> Result<CaptureHistory, String> {
    let mut rng = Rng(seed ^ 0x00CA_97E5);
    let src = source(&mut rng, fault, true);
    let mut history = src.history.clone();
    let storage = SimStorage::new(seed);
    let (point, mode) = match fault {
        CaptureFault::Crash(point, mode) => (point, mode),
        _ => (CrashPoint::Acknowledged, SimCrash::LoseUnsynced),
    };
    let hooks = match fault {
        CaptureFault::Crash(..) => CrashOnce::new(point, 1 + rng.below(4) as u32),
        _ => CrashOnce::never(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| format!("runtime: {e}"))?;
    let confirmed = Rc::new(Cell::new(0u64));
    let confirmed_history = Rc::new(RefCell::new(Vec::new()));
    let drop_after = 5 + rng.below(40);
    let lag = 1 + rng.below(3) as usize;
    let violations = Rc::new(RefCell::new(Vec::new()));
    // One counter across sessions, as one process's metric lives across
    // its reconnects.
    let registry = crate::metrics::Metrics::new();
    let observer = crate::service::Observer {
        metrics: registry.flow(crate::service::Role::Both, "sim", "sim"),
        registry,
        health: crate::service::Health::new("relay", Duration::from_secs(60))
            .flow("sim", "sim", "sim"),
        live: crate::service::LiveSettings::new(None),
    };
    let captured = observer.metrics.captured.clone();
    let mut config = CaptureConfig {
        observe: Some(observer),
        rejoin_at: None,
        ..config()
    };
    // The boundary falls just before, at, or just after a commit, and
    // before the last: the Begin of the transaction after it shows it.
    if fault == CaptureFault::Rejoin && src.committed.len() >= 2 {
        let k = 1 + rng.below(src.committed.len() as u64 - 1) as usize;
        let at = match rng.below(3) {
            0 => src.committed[k].commit_lsn - 1,
            1 => src.committed[k].commit_lsn,
            _ => src.committed[k - 1].commit_lsn + 1,
        };
        config.rejoin_at = Some(Lsn(at));
    }
    let boundary = config.rejoin_at;
    let mut refusals = 0;
    loop {
        history.sessions += 1;
        if history.sessions > 6 {
            return Err(format!("seed {seed}: no progress after 6 sessions"));
        }
        let (log, resume) = reopen(&storage, &[capture::SOURCE_ACK], confirmed.get())
            .map_err(|e| format!("seed {seed}: {e} after a crash at {point:?} ({mode:?})"))?;
        let exhausted = Rc::new(Cell::new(false));
        let session = Session {
            seed: seed.wrapping_add(u64::from(history.sessions)),
            confirmed: confirmed.clone(),
            log: log.clone(),
            violations: violations.clone(),
            exhausted: exhausted.clone(),
            drop_after: (fault == CaptureFault::Failover && history.faults == 0)
                .then_some(drop_after),
            confirmed_history: confirmed_history.clone(),
        };
        let mut walsender = Walsender::start(&src, resume.ack_lsn.0, session);
        let mut assembler = assembler(
            &config,
            config.chunk_bytes,
            &format!("trellara-sim-capture-{seed}"),
            capture::pinned(&config, &log).map_err(|e| format!("seed {seed}: pins: {e}"))?,
        );
        let mut stats = CaptureStats::default();
        let outcome = runtime.block_on(async {
            use futures_util::FutureExt;
            let done = exhausted.clone();
            let shutdown = async move {
                while !done.get() {
                    tokio::task::yield_now().await;
                }
            };
            let shutdown = std::pin::pin!(shutdown.fuse());
            let result = capture::stream_changes(
                &config,
                &log,
                &mut walsender,
                &mut assembler,
                resume,
                &mut stats,
                shutdown,
                &hooks,
            )
            .await;
            if let Ok(true) = result {
                // As the session does at shutdown: report what is durable.
                let _ = walsender.send_status().await;
            }
            result
        });
        history.duplicates_skipped += stats.duplicates_skipped;
        if let Some(v) = violations.borrow().first() {
            return Err(format!("seed {seed}: {v} ({fault:?})"));
        }
        match outcome {
            Ok(_) => break,
            Err(CaptureError::Crashed(_)) => {
                history.crashes += 1;
                history.faults += 1;
                drop(log);
                storage.crash(mode);
            }
            Err(CaptureError::Wire(WireError::Closed)) if fault == CaptureFault::Failover => {
                // The relay reconnects to the promoted standby, whose slot
                // was synced a few status replies ago.
                history.faults += 1;
                let synced = {
                    let seen = confirmed_history.borrow();
                    seen.len()
                        .checked_sub(lag + 1)
                        .and_then(|i| seen.get(i).copied())
                        .unwrap_or(0)
                };
                confirmed.set(synced);
            }
            Err(CaptureError::Rejoin { at }) if boundary == Some(at) => {
                // Acknowledged to the boundary, not short of it (the slot
                // would replay what the log holds) and not past the first
                // commit at or after it (that one was not taken).
                history.faults += 1;
                let first_after = src
                    .committed
                    .iter()
                    .map(|c| c.commit_lsn)
                    .find(|&c| c >= at.0);
                let acked = confirmed.get();
                if acked < at.0 || first_after.is_some_and(|c| acked > c) {
                    return Err(format!(
                        "seed {seed}: the session ended at the join boundary {at} with the source acknowledged to {} ({fault:?})",
                        Lsn(acked)
                    ));
                }
                config.rejoin_at = None;
            }
            Err(CaptureError::Assembly(e)) if src.refused.is_some() => {
                let text = e.to_string();
                let expected = match fault {
                    CaptureFault::SchemaDrift => "schema drift on public.sim",
                    _ => "arrived without its Relation message",
                };
                if !text.contains(expected) {
                    return Err(format!(
                        "seed {seed}: capture stopped with {text:?}, expected {expected:?}"
                    ));
                }
                history.faults += 1;
                refusals += 1;
                // An operator reruns without repairing: it must stop again.
                if refusals == 2 {
                    break;
                }
            }
            Err(e) => return Err(format!("seed {seed}: capture failed: {e} ({fault:?})")),
        }
    }
    if boundary.is_some() && history.faults != 1 {
        return Err(format!(
            "seed {seed}: the session did not end once at the join boundary {boundary:?}: {} times",
            history.faults
        ));
    }
    let (log, _) = Log::open(storage.clone(), "/log", sim_log_config())
        .map_err(|e| format!("seed {seed}: reopen the log: {e}"))?;
    let got = logged(&log, seed)?;
    // A transaction resent after a crash or a reconnect is counted once:
    // the counter moves only when its write is durable.
    // And, with no crash to lose the count, every one is counted: also
    // those a lost session left to an fsync still in flight.
    let counted = captured.get();
    let logged = got.len() as u64;
    if counted > logged || (!matches!(fault, CaptureFault::Crash(..)) && counted != logged) {
        return Err(format!(
            "seed {seed}: {counted} transactions counted as captured, the log holds {logged} ({fault:?})"
        ));
    }
    let expected: Vec<&Committed> = match src.refused {
        Some(txn) => {
            let limit = src.ends[txn];
            src.committed.iter().filter(|c| c.end_lsn < limit).collect()
        }
        None => src.committed.iter().collect(),
    };
    let commits = |v: &mut dyn Iterator<Item = &Committed>| {
        v.map(|c| Lsn(c.commit_lsn).to_string()).collect::<Vec<_>>()
    };
    if got.len() != expected.len() {
        return Err(format!(
            "seed {seed}: the log holds {:?}, the source committed {:?} ({fault:?})",
            commits(&mut got.iter()),
            commits(&mut expected.iter().copied())
        ));
    }
    for (g, e) in got.iter().zip(&expected) {
        if g != *e {
            return Err(format!(
                "seed {seed}: transaction {} in the log differs from what the source committed ({fault:?}):\n log: {g:?}\n source: {e:?}",
                Lsn(e.commit_lsn)
            ));
        }
    }
    if src.refused.is_none() && confirmed.get() < expected.last().map_or(0, |c| c.end_lsn) {
        return Err(format!(
            "seed {seed}: the slot ended confirmed at {}, behind the last commit",
            Lsn(confirmed.get())
        ));
    }
    Ok(history)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::mutation;

    const CRASH: CaptureFault =
        CaptureFault::Crash(CrashPoint::AppendedNotAcknowledged, SimCrash::LoseUnsynced);

    /// Runs `fault` over 40 seeds with `switch` on and returns the failures.
    fn failures(
        switch: &'static std::thread::LocalKey<Cell<bool>>,
        fault: CaptureFault,
    ) -> Vec<String> {
        switch.with(|m| m.set(true));
        let failed = (0..40u64)
            .filter_map(|seed| history(seed, fault).err())
            .collect();
        switch.with(|m| m.set(false));
        failed
    }

    /// The mutation check: offering the source a position before the
    /// append is caught at once.
    #[test]
    fn acknowledging_before_append_is_caught() {
        let failed = failures(&mutation::ACK_BEFORE_APPEND, CRASH);
        assert!(
            failed.len() >= 30 && failed.iter().all(|f| f.contains("vouches only for")),
            "{failed:?}"
        );
    }

    /// The mutation check: advancing on a keepalive inside an open
    /// transaction moves the slot past a transaction the log does not hold;
    /// a crash before it is appended loses it for good.
    #[test]
    fn keepalive_advance_inside_a_transaction_is_caught() {
        let failed = failures(
            &mutation::KEEPALIVE_IN_TRANSACTION,
            CaptureFault::Crash(CrashPoint::ReceivedNotAppended, SimCrash::LoseUnsynced),
        );
        assert!(!failed.is_empty(), "a lost transaction went unnoticed");
    }

    /// A walsender pings after each transaction it sends while the relay's
    /// acknowledged position is behind. Capture records such an idle
    /// position at most once per status interval, so a stream of
    /// transactions each followed by a ping costs a few fsyncs, not one per
    /// transaction (which capped live capture at one transaction per
    /// fsync); the last ping's position is still recorded and acknowledged
    /// at shutdown.
    /// A source that sends a fixed script, then nothing (and says so).
    struct Scripted {
        queue: VecDeque<ReplicationEvent>,
        durable: Lsn,
        exhausted: Rc<Cell<bool>>,
        /// Each pacing change, with how many events were still to come.
        paces: Vec<(usize, Option<Duration>)>,
    }

    impl SourceStream for Scripted {
        async fn recv(&mut self) -> Result<Option<ReplicationEvent>, WireError> {
            match self.queue.pop_front() {
                Some(event) => Ok(Some(event)),
                None => {
                    self.exhausted.set(true);
                    std::future::pending().await
                }
            }
        }
        fn set_durable(&mut self, lsn: Lsn) {
            self.durable = self.durable.max(lsn);
        }
        fn durable(&self) -> Lsn {
            self.durable
        }
        fn status_due(&self, _every: Duration) -> bool {
            false
        }
        async fn send_status(&mut self) -> Result<(), WireError> {
            Ok(())
        }
        fn pace_reads(&mut self, every: Option<Duration>) {
            self.paces.push((self.queue.len(), every));
        }
    }

    fn xlog(pos: u64, message: Message) -> ReplicationEvent {
        ReplicationEvent::XLogData {
            start: Lsn(pos),
            end: Lsn(pos),
            data: pg::encode(&message),
        }
    }

    /// A transaction of `rows` inserts, begun at `begin`, committing at
    /// `commit` (its end 0x28 past it).
    fn script_txn(
        queue: &mut VecDeque<ReplicationEvent>,
        xid: u32,
        begin: u64,
        commit: u64,
        rows: u32,
    ) {
        queue.push_back(xlog(
            begin,
            Message::Begin(pg::Begin {
                final_lsn: commit,
                commit_time: 0,
                xid,
            }),
        ));
        for i in 0..rows {
            queue.push_back(xlog(
                begin + 0x10 + u64::from(i),
                Message::Insert(pg::Insert {
                    xid: None,
                    relation: OID,
                    new: vec![
                        text_column(&i.to_string()),
                        text_column("n"),
                        text_column("d"),
                    ],
                }),
            ));
        }
        queue.push_back(xlog(
            commit,
            Message::Commit(pg::Commit {
                flags: 0,
                commit_lsn: commit,
                end_lsn: commit + 0x28,
                commit_time: 0,
            }),
        ));
    }

    /// A simulated log with capture's consumer, and a source sending the
    /// relation, then `script`.
    fn scripted(script: VecDeque<ReplicationEvent>) -> (Log<SimStorage>, Scripted) {
        let (log, _) =
            Log::open(SimStorage::new(7), "/log", crate::log::LogConfig::default()).expect("open");
        log.register_consumer(capture::SOURCE_ACK)
            .expect("register");
        let mut queue = VecDeque::from([xlog(0x100, relation_message(None, false))]);
        queue.extend(script);
        let stream = Scripted {
            queue,
            durable: Lsn::ZERO,
            exhausted: Rc::new(Cell::new(false)),
            paces: Vec::new(),
        };
        (log, stream)
    }

    /// Runs one capture session over `stream` on a paused clock, until the
    /// script is exhausted; `beside` runs on the same thread meanwhile.
    fn capture_script(
        log: &Log<SimStorage>,
        stream: &mut Scripted,
        assembler: &mut Assembler,
        beside: impl std::future::Future<Output = ()>,
    ) -> Result<bool, CaptureError> {
        let exhausted = stream.exhausted.clone();
        let config = config();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        runtime.block_on(async {
            use futures_util::FutureExt;
            let shutdown = async move {
                while !exhausted.get() {
                    tokio::task::yield_now().await;
                }
            };
            let shutdown = std::pin::pin!(shutdown.fuse());
            let (mut stats, hooks) = (CaptureStats::default(), CrashOnce::never());
            let capture = capture::stream_changes(
                &config,
                log,
                stream,
                assembler,
                capture::read_resume(log).expect("resume"),
                &mut stats,
                shutdown,
                &hooks,
            );
            // `beside` runs only as long as capture does.
            let beside = async {
                beside.await;
                std::future::pending::<()>().await
            };
            tokio::select! {
                stopped = capture => stopped,
                () = beside => unreachable!("beside never ends"),
            }
        })
    }

    /// The first chunks of a large transaction are in the log, for the
    /// applier on the same thread to read, before its last chunk is built;
    /// the whole run ends acknowledged.
    #[test]
    fn a_large_transaction_is_written_chunk_by_chunk() {
        let (commit, end) = (0x9000u64, 0x9028u64);
        let mut script = VecDeque::new();
        script_txn(&mut script, 700, 0x1000, commit, 400);
        let (log, mut stream) = scripted(script);
        let mut assembler = assembler(
            &config(),
            512,
            "trellara-sim-capture-chunk-by-chunk",
            std::collections::HashMap::new(),
        );
        // What a reader beside capture sees of the log as it grows.
        let seen = Rc::new(std::cell::RefCell::new(Vec::new()));
        let watch = {
            let (log, seen) = (&log, seen.clone());
            async move {
                let mut moved = log.subscribe();
                loop {
                    seen.borrow_mut().push(log.written_end());
                    if moved.changed().await.is_err() {
                        return;
                    }
                }
            }
        };
        let stopped = capture_script(&log, &mut stream, &mut assembler, watch);
        assert!(matches!(stopped, Ok(true)), "{stopped:?}");
        let chunks = log.next_offset();
        assert!(chunks > 10, "a run of chunks: {chunks}");
        let seen = seen.borrow();
        let partial: std::collections::BTreeSet<u64> = seen
            .iter()
            .copied()
            .filter(|&w| w > 0 && w < chunks)
            .collect();
        assert!(
            partial.len() as u64 >= chunks / 2,
            "the reader saw the run grow one chunk at a time, not at once: {seen:?}"
        );
        assert_eq!(
            stream.durable(),
            Lsn(end),
            "acknowledged after the last chunk"
        );
    }

    /// The socket is read in batches only inside a large transaction, and
    /// at once again from its commit on.
    #[test]
    fn reads_are_paced_inside_a_large_transaction_only() {
        let mut script = VecDeque::new();
        script_txn(&mut script, 800, 0x1000, 0x10_1000, 10);
        script_txn(&mut script, 801, 0x20_0000, 0x30_0000, 5000);
        script_txn(&mut script, 802, 0x40_0000, 0x50_0000, 10);
        let (log, mut stream) = scripted(script);
        let mut assembler = assembler(
            &config(),
            1 << 20,
            "trellara-sim-capture-paced",
            std::collections::HashMap::new(),
        );
        let stopped = capture_script(&log, &mut stream, &mut assembler, std::future::pending());
        assert!(matches!(stopped, Ok(true)), "{stopped:?}");
        // Paced once 801 holds 4096 rows (904 rows, its Commit and 802's 12
        // events still to come), at once again after its Commit.
        let pace = Some(Duration::from_millis(5));
        assert_eq!(
            stream.paces,
            [(904 + 1 + 12, pace), (12, None), (0, None)],
            "paced within 801 only (and never at the stop)"
        );
        assert_eq!(
            stream.durable(),
            Lsn(0x40_0000 + 0x10_0028),
            "all three acknowledged"
        );
    }

    #[test]
    fn pings_between_transactions_do_not_cost_an_fsync_each() {
        let mut script = VecDeque::new();
        let (mut pos, mut last_ping) = (0x1000u64, 0);
        for i in 0..100u32 {
            let commit = pos + 0x100;
            script_txn(&mut script, 1000 + i, pos, commit, 1);
            last_ping = commit + 0x28 + 0x8;
            script.push_back(ReplicationEvent::Keepalive {
                wal_end: Lsn(last_ping),
                reply_requested: false,
            });
            pos = commit + 0x128;
        }
        let (log, mut stream) = scripted(script);
        let mut assembler = assembler(
            &config(),
            1 << 20,
            "trellara-sim-capture-pings",
            std::collections::HashMap::new(),
        );
        let fsyncs_before = log.stats().fsyncs;
        let stopped = capture_script(&log, &mut stream, &mut assembler, std::future::pending());
        assert!(matches!(stopped, Ok(true)), "{stopped:?}");
        assert_eq!(log.next_offset(), 100, "every transaction is in the log");
        let fsyncs = log.stats().fsyncs - fsyncs_before;
        assert!(
            fsyncs <= 5,
            "{fsyncs} fsyncs for 100 transactions and 100 pings"
        );
        assert_eq!(
            stream.durable(),
            Lsn(last_ping),
            "the last ping is acknowledged"
        );
        assert_eq!(
            capture::read_resume(&log).expect("resume").ack_lsn,
            Lsn(last_ping),
            "and recorded in the log before it was"
        );
    }

    /// A replayed history is the same history.
    #[test]
    fn a_seed_replays_exactly() {
        for fault in [CRASH, CaptureFault::SchemaDrift] {
            assert_eq!(history(11, fault), history(11, fault));
        }
    }

    /// The source exercises what the scenarios claim.
    #[test]
    fn the_source_covers_streams_aborts_toast_key_changes_and_keepalives() {
        let mut total = CaptureHistory::default();
        for seed in 0..30 {
            let h = history(seed, CRASH).unwrap_or_else(|e| panic!("{e}"));
            total.streamed += h.streamed;
            total.aborted += h.aborted;
            total.toast += h.toast;
            total.key_changes += h.key_changes;
            total.mid_transaction_keepalives += h.mid_transaction_keepalives;
            total.duplicates_skipped += h.duplicates_skipped;
            total.crashes += h.crashes;
        }
        assert!(
            total.streamed >= 30
                && total.aborted >= 20
                && total.toast >= 30
                && total.key_changes >= 30
                && total.mid_transaction_keepalives >= 20
                && total.crashes >= 25,
            "{total:?}"
        );
    }
}
