//! Turns decoded pgoutput messages into envelopes: one per committed
//! transaction (or, past `chunk_bytes`, a run of chunked envelopes), in
//! commit order.
//!
//! ```text
//!  Begin ─ changes ─ Commit ─────────────────────────────▶ envelope(s)
//!  Stream Start(x) ─ changes ─ Stream Stop ─ ... ─ Stream Commit(x) ─▶ envelope(s)
//!                                              └─ Stream Abort(x, sub) ─▶ discard sub..
//! ```
//!
//! Invariants:
//! * Nothing is emitted before its commit: streamed in-progress transactions
//!   are held per top-level xid (interleaved streams stay apart) and dropped
//!   on Stream Abort - only the aborted subtransaction's changes and those
//!   after them, as PostgreSQL's own apply worker does, on a subtransaction
//!   abort.
//! * Memory is bounded: every transaction's changes go to a [`Spool`] (the
//!   one the extension uses too) that
//!   spills past `memory_budget`; at commit the changes are read back one
//!   chunk (at most `chunk_bytes` of changes) at a time, and each chunk is
//!   handed over before the next is built, so the caller can write it (and
//!   a consumer apply it) meanwhile.
//! * Every envelope handed over is valid: each change is validated and
//!   encoded once, with its final sequence, as it arrives, and its chunk
//!   planned then; at commit a chunk is framed from those bytes as they
//!   are ([`envelope::RawEnvelope`] validates the frame), with no decode
//!   and re-encode. Debug builds decode every envelope again.
//! * Schema is pinned: the first fingerprint seen for a relation (or the one
//!   given at start) is kept; a Relation message with another fingerprint
//!   stops capture with [`AssemblyError::SchemaDrift`] naming the relation
//!   and both fingerprints, before any row under the new schema is assembled,
//!   unless the caller saw the [`Drift`] first and [`accept`](Assembler::accept)ed
//!   it with its DDL events, which then precede the new version's rows in
//!   the change order. A relation id seen under another name is drift too.
//! * Each version of a relation in one transaction is its own schema in the
//!   envelopes: two versions never share one.
//! * A row for a relation whose metadata never arrived fails closed.

use crate::pgoutput::{self, Column, Message, OldKind};
use prost::Message as _;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use trellara_common::envelope::{
    self, BeforeImage, Boundary, Capture, Change, ColumnSchema, DdlEvent, Envelope, LogicalMessage,
    Operation, PROTOCOL_VERSION, RelationSchema, ReplicaIdentity, RowChange, SourceIdentity, Value,
    boundary, capture, change, value,
};
use trellara_common::fingerprint::fingerprint;
use trellara_common::spool::{Mark, Planned, RelationUse, Spool};
use trellara_common::table_name::TableName;

#[derive(Debug, Clone)]
pub struct AssemblerConfig {
    pub source: SourceIdentity,
    pub server_version_num: u32,
    /// `pgoutput/1` or `pgoutput/2`, recorded in every envelope.
    pub decoder: String,
    /// In-memory bytes per transaction before its changes spill to disk.
    pub memory_budget: usize,
    /// Relations and changes per envelope, in encoded bytes; a larger
    /// transaction becomes several chunked envelopes.
    pub chunk_bytes: usize,
    pub spill_dir: PathBuf,
    /// Fingerprints pinned before capture started, by `namespace.name`.
    pub pinned: HashMap<String, u64>,
    /// The whole descriptions pinned before capture started, where known
    /// (a drift from one of these can be diffed), by `namespace.name`.
    pub schemas: HashMap<String, RelationSchema>,
}

/// A Relation message whose description is not the pinned one.
#[derive(Debug, Clone, PartialEq)]
pub struct Drift {
    /// `namespace.name` as pinned (a renamed table's old name).
    pub relation: String,
    pub pinned_fingerprint: u64,
    /// The pinned description, when known.
    pub pinned: Option<RelationSchema>,
    /// The description the source sends now.
    pub now: RelationSchema,
    /// The subtransaction the Relation message came in (a stream block).
    pub xid: Option<u32>,
}

/// What an accepted drift replaced, put back if its subtransaction aborts.
#[derive(Debug)]
struct Repin {
    at: Mark,
    relation_id: u32,
    relation: Option<RelationSchema>,
    /// Each name it touched: its pinned fingerprint and description before.
    names: Vec<(String, Option<u64>, Option<RelationSchema>)>,
}

#[derive(Debug, thiserror::Error)]
pub enum AssemblyError {
    #[error(
        "schema drift on {relation}: pinned fingerprint {pinned:#018x}, the source now sends {found:#018x}; capture stopped before assembling rows under the new schema\n\
         hint: review the DDL, then re-pin with a reseed of {relation}"
    )]
    SchemaDrift {
        relation: String,
        pinned: u64,
        found: u64,
    },
    #[error(
        "{operation} for relation oid {relation_id} arrived without its Relation message; capture stopped (fail closed)"
    )]
    UnknownRelation {
        operation: &'static str,
        relation_id: u32,
    },
    #[error(
        "{operation} on {relation}: tuple has {found} columns, the Relation message declared {expected}"
    )]
    TupleWidth {
        operation: &'static str,
        relation: String,
        expected: usize,
        found: usize,
    },
    #[error("{message} arrived outside a transaction")]
    OutsideTransaction { message: &'static str },
    #[error("{message} arrived while transaction {xid} was still open")]
    NestedTransaction { message: &'static str, xid: u32 },
    #[error("stream message for transaction {xid}, whose stream never started")]
    UnknownStream { xid: u32 },
    #[error("text value of {relation}.{column} is not UTF-8; Trellara requires UTF8 databases")]
    NotUtf8 { relation: String, column: String },
    #[error("spilling transaction {xid} to disk failed")]
    Spill {
        xid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("assembled envelope for transaction {xid} is invalid")]
    Invalid {
        xid: u32,
        #[source]
        source: envelope::EnvelopeError,
    },
}

/// One transaction being assembled.
#[derive(Debug)]
struct Txn {
    xid: u32,
    begin_lsn: u64,
    /// A plain transaction's commit LSN, from its Begin (0: streamed).
    final_lsn: u64,
    origin: String,
    /// Its changes, planned into chunks as they come: at commit each chunk
    /// is framed from the spooled bytes as they are.
    spool: Spool,
    /// Schema of every relation version a change refers to, by its key,
    /// and its encoded length.
    relations: BTreeMap<u32, (RelationSchema, usize)>,
    /// The key of each `(relation id, fingerprint)` version used.
    versions: HashMap<(u32, u64), u32>,
    /// Where each subtransaction's first change starts (streamed only).
    subxacts: HashMap<u32, Mark>,
    /// Drifts accepted inside it, in order.
    repins: Vec<Repin>,
    /// DDL events whose fill the caller reads at commit (a streamed
    /// transaction's column is not in the catalog before): sequence,
    /// table and event.
    unfilled: Vec<(u64, String, DdlEvent)>,
    /// Their completed encodings, by sequence.
    patches: HashMap<u64, Vec<u8>>,
}

impl Txn {
    fn new(xid: u32, begin_lsn: u64, config: &AssemblerConfig) -> Self {
        Txn {
            xid,
            begin_lsn,
            final_lsn: 0,
            origin: String::new(),
            spool: Spool::new(
                config.memory_budget,
                config.spill_dir.clone(),
                config.chunk_bytes,
            ),
            relations: BTreeMap::new(),
            versions: HashMap::new(),
            subxacts: HashMap::new(),
            repins: Vec::new(),
            unfilled: Vec::new(),
            patches: HashMap::new(),
        }
    }
}

/// Where the next data message goes.
#[derive(Debug)]
enum Open {
    None,
    Plain(Box<Txn>),
    Stream(u32),
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AssemblerStats {
    pub transactions: u64,
    pub envelopes: u64,
    pub changes: u64,
    pub spilled_transactions: u64,
    pub aborted_streams: u64,
    /// Most change bytes any one transaction held in memory.
    pub peak_memory: usize,
    /// Non-transactional logical messages: they belong to no transaction,
    /// so no envelope carries them; counted, not silently lost.
    pub skipped_nontransactional_messages: u64,
}

#[derive(Debug)]
pub struct Assembler {
    config: AssemblerConfig,
    relations: HashMap<u32, RelationSchema>,
    pinned: HashMap<String, u64>,
    /// Whole pinned descriptions, by `namespace.name`.
    schemas: HashMap<String, RelationSchema>,
    open: Open,
    streams: HashMap<u32, Txn>,
    finishing: Option<Finishing>,
    stats: AssemblerStats,
}

impl Assembler {
    pub fn new(config: AssemblerConfig) -> Self {
        let pinned = config.pinned.clone();
        let schemas = config.schemas.clone();
        Assembler {
            config,
            relations: HashMap::new(),
            pinned,
            schemas,
            open: Open::None,
            streams: HashMap::new(),
            finishing: None,
            stats: AssemblerStats::default(),
        }
    }

    pub fn stats(&self) -> AssemblerStats {
        self.stats
    }

    /// Pinned fingerprints, by `namespace.name`.
    pub fn pinned(&self) -> &HashMap<String, u64> {
        &self.pinned
    }

    /// Whole pinned descriptions, by `namespace.name`.
    pub fn schemas(&self) -> &HashMap<String, RelationSchema> {
        &self.schemas
    }

    /// The drift `rel` would stop capture with, if any: its fingerprint is
    /// not its name's pinned one, or its relation id is pinned under
    /// another name.
    pub fn drift(&self, rel: &pgoutput::Relation) -> Option<Drift> {
        let now = schema_of(rel);
        let qualified = TableName::new(&now.namespace, &now.name).to_string();
        match self.pinned.get(&qualified) {
            Some(&pinned) if pinned != now.fingerprint => Some(Drift {
                relation: qualified.clone(),
                pinned_fingerprint: pinned,
                pinned: self
                    .schemas
                    .get(&qualified)
                    .filter(|s| s.fingerprint == pinned)
                    .cloned(),
                now,
                xid: rel.xid,
            }),
            Some(_) => None,
            None => self
                .schemas
                .iter()
                .find(|(_, s)| s.relation_id == now.relation_id)
                .map(|(name, s)| Drift {
                    relation: name.clone(),
                    pinned_fingerprint: s.fingerprint,
                    pinned: Some(s.clone()),
                    now,
                    xid: rel.xid,
                }),
        }
    }

    /// The commit LSN of the plain transaction open now.
    pub fn open_commit_lsn(&self) -> Option<u64> {
        match &self.open {
            Open::Plain(txn) => Some(txn.final_lsn),
            _ => None,
        }
    }

    /// The DDL events of streamed transaction `xid` whose fill waits for
    /// its commit, with their tables, in order.
    pub fn unfilled(&self, xid: u32) -> Vec<(String, DdlEvent)> {
        self.streams.get(&xid).map_or_else(Vec::new, |t| {
            t.unfilled
                .iter()
                .map(|(_, table, e)| (table.clone(), e.clone()))
                .collect()
        })
    }

    /// Completes the events [`unfilled`](Self::unfilled) gave, in its order:
    /// the transaction's envelopes carry these instead.
    pub fn fill(&mut self, xid: u32, events: Vec<DdlEvent>) {
        let Some(txn) = self.streams.get_mut(&xid) else {
            return;
        };
        for ((sequence, _, _), event) in std::mem::take(&mut txn.unfilled).into_iter().zip(events) {
            let change = Change {
                sequence,
                body: Some(change::Body::Ddl(event)),
            };
            txn.patches.insert(sequence, change.encode_to_vec());
        }
    }

    /// Takes `drift` as the relation's new pinned description, with the
    /// DDL `events` that explain it: they join the open transaction here,
    /// ahead of every row under the new description. An event marked
    /// `true` is completed at commit ([`fill`](Self::fill)).
    pub fn accept(
        &mut self,
        drift: Drift,
        events: Vec<(DdlEvent, bool)>,
    ) -> Result<(), AssemblyError> {
        let now = drift.now;
        let qualified = TableName::new(&now.namespace, &now.name).to_string();
        let mut names = vec![qualified.clone()];
        if drift.relation != qualified {
            names.push(drift.relation.clone());
        }
        let repin = Repin {
            at: Mark::default(),
            relation_id: now.relation_id,
            relation: self.relations.get(&now.relation_id).cloned(),
            names: names
                .into_iter()
                .map(|n| {
                    let (p, s) = (self.pinned.get(&n).copied(), self.schemas.get(&n).cloned());
                    (n, p, s)
                })
                .collect(),
        };
        let txn = self.current().ok_or(AssemblyError::OutsideTransaction {
            message: "Relation",
        })?;
        if let Some(sub) = drift.xid {
            let mark = txn.spool.mark();
            txn.subxacts.entry(sub).or_insert(mark);
        }
        let at = txn.spool.mark();
        txn.repins.push(Repin { at, ..repin });
        if drift.relation != qualified {
            self.pinned.remove(&drift.relation);
            self.schemas.remove(&drift.relation);
        }
        for (event, unfilled) in events {
            if unfilled && let Some(txn) = self.current() {
                let sequence = txn.spool.records();
                txn.unfilled
                    .push((sequence, qualified.clone(), event.clone()));
            }
            self.push(
                change::Body::Ddl(event),
                Some(now.clone()),
                drift.xid,
                "Relation",
            )?;
        }
        self.pinned.insert(qualified.clone(), now.fingerprint);
        self.schemas.insert(qualified, now.clone());
        self.relations.insert(now.relation_id, now);
        Ok(())
    }

    /// True between Begin and Commit or Stream Start and Stream Stop, or
    /// while any streamed transaction awaits its commit or abort, or a
    /// committed one has chunks not emitted yet: then the source position
    /// must not be advanced past what was emitted.
    pub fn in_transaction(&self) -> bool {
        !matches!(self.open, Open::None) || !self.streams.is_empty() || self.finishing.is_some()
    }

    /// Changes held so far by the transaction data messages go to now (0
    /// outside one).
    pub fn open_changes(&self) -> u64 {
        match &self.open {
            Open::None => 0,
            Open::Plain(txn) => txn.spool.records(),
            Open::Stream(xid) => self.streams.get(xid).map_or(0, |t| t.spool.records()),
        }
    }

    /// Feeds one message; `wal_start` is its XLogData start position.
    /// A commit hands its transaction's first envelope to `emit`; the rest
    /// of a chunk run follows through [`emit_next`](Self::emit_next), or
    /// all at once at the start of the next call.
    pub fn handle<E>(
        &mut self,
        message: Message,
        wal_start: u64,
        emit: &mut dyn FnMut(Assembled) -> Result<(), E>,
    ) -> Result<(), AssembleOrSink<E>> {
        while self.emit_next(emit)? {}
        match message {
            Message::Begin(begin) => {
                self.refuse_nesting("Begin", false)?;
                let first = if wal_start != 0 {
                    wal_start
                } else {
                    begin.final_lsn
                };
                let mut txn = Txn::new(begin.xid, first, &self.config);
                txn.final_lsn = begin.final_lsn;
                self.open = Open::Plain(Box::new(txn));
            }
            Message::Commit(commit) => {
                let Open::Plain(txn) = std::mem::replace(&mut self.open, Open::None) else {
                    return Err(AssemblyError::OutsideTransaction { message: "Commit" }.into());
                };
                self.finish(
                    *txn,
                    commit.commit_lsn,
                    commit.end_lsn,
                    commit.commit_time,
                    emit,
                )?;
            }
            Message::Origin(origin) => match self.current() {
                Some(txn) => txn.origin = origin.name,
                None => return Err(AssemblyError::OutsideTransaction { message: "Origin" }.into()),
            },
            Message::Relation(rel) => self.relation(rel)?,
            Message::Type(_) => {}
            Message::StreamStart(start) => {
                self.refuse_nesting("Stream Start", true)?;
                // A later segment of a stream we never saw start would
                // assemble a transaction without its beginning.
                if !start.first_segment && !self.streams.contains_key(&start.xid) {
                    return Err(AssemblyError::UnknownStream { xid: start.xid }.into());
                }
                let config = &self.config;
                self.streams
                    .entry(start.xid)
                    .or_insert_with(|| Txn::new(start.xid, wal_start, config));
                self.open = Open::Stream(start.xid);
            }
            Message::StreamStop => self.open = Open::None,
            Message::StreamCommit(commit) => {
                let txn = self
                    .streams
                    .remove(&commit.xid)
                    .ok_or(AssemblyError::UnknownStream { xid: commit.xid })?;
                self.finish(
                    txn,
                    commit.commit_lsn,
                    commit.end_lsn,
                    commit.commit_time,
                    emit,
                )?;
            }
            Message::StreamAbort(abort) => {
                self.stats.aborted_streams += 1;
                if abort.xid == abort.subxid {
                    if let Some(txn) = self.streams.remove(&abort.xid) {
                        self.unpin(txn.repins);
                    }
                } else if let Some(txn) = self.streams.get_mut(&abort.xid)
                    && let Some(mark) = txn.subxacts.get(&abort.subxid).copied()
                {
                    // Schema changes go back with the subtransaction that
                    // made them: later rows are described as before it.
                    let keep = txn
                        .repins
                        .iter()
                        .take_while(|r| r.at.bytes < mark.bytes)
                        .count();
                    let undone = txn.repins.split_off(keep);
                    self.unpin(undone);
                    let Some(txn) = self.streams.get_mut(&abort.xid) else {
                        return Ok(());
                    };
                    txn.spool
                        .truncate(mark)
                        .map_err(|source| AssemblyError::Spill {
                            xid: abort.xid,
                            source,
                        })?;
                    // Subtransactions that started after the aborted one
                    // went with it.
                    txn.subxacts.retain(|_, m| m.bytes < mark.bytes);
                    txn.unfilled
                        .retain(|(sequence, _, _)| *sequence < mark.records);
                }
            }
            Message::Message(msg) if !msg.transactional => {
                self.stats.skipped_nontransactional_messages += 1;
            }
            Message::Message(msg) => {
                let body = change::Body::Message(LogicalMessage {
                    prefix: msg.prefix,
                    content: msg.content.to_vec(),
                });
                self.push(body, None, msg.xid, "Message")?;
            }
            Message::Insert(insert) => {
                let relation = self.relation_for(insert.relation, "Insert")?;
                let after = self.image(&relation, insert.new, "Insert", false)?;
                let row = row(
                    &relation,
                    Operation::Insert,
                    BeforeImage::None,
                    Vec::new(),
                    after,
                );
                self.push(row, Some(relation), insert.xid, "Insert")?;
            }
            Message::Update(update) => {
                let relation = self.relation_for(update.relation, "Update")?;
                let (kind, before) = match update.old {
                    None => (BeforeImage::None, Vec::new()),
                    Some((OldKind::Key, old)) => (
                        BeforeImage::Key,
                        self.image(&relation, old, "Update", true)?,
                    ),
                    Some((OldKind::Full, old)) => (
                        BeforeImage::Full,
                        self.image(&relation, old, "Update", false)?,
                    ),
                };
                let after = self.image(&relation, update.new, "Update", false)?;
                let row = row(&relation, Operation::Update, kind, before, after);
                self.push(row, Some(relation), update.xid, "Update")?;
            }
            Message::Delete(delete) => {
                let relation = self.relation_for(delete.relation, "Delete")?;
                let key_only = delete.old_kind == OldKind::Key;
                let kind = if key_only {
                    BeforeImage::Key
                } else {
                    BeforeImage::Full
                };
                let before = self.image(&relation, delete.old, "Delete", key_only)?;
                let row = row(&relation, Operation::Delete, kind, before, Vec::new());
                self.push(row, Some(relation), delete.xid, "Delete")?;
            }
            Message::Truncate(truncate) => {
                for relation_id in truncate.relations {
                    let relation = self.relation_for(relation_id, "Truncate")?;
                    let body = change::Body::Row(RowChange {
                        relation_id,
                        operation: Operation::Truncate as i32,
                        before_kind: BeforeImage::None as i32,
                        before: Vec::new(),
                        after: Vec::new(),
                        truncate_cascade: truncate.cascade,
                        truncate_restart_identity: truncate.restart_identity,
                    });
                    self.push(body, Some(relation), truncate.xid, "Truncate")?;
                }
            }
        }
        Ok(())
    }

    /// `message` opens a transaction: refuse it while a plain transaction
    /// (or, with `streams`, a stream block) is open.
    fn refuse_nesting(&self, message: &'static str, streams: bool) -> Result<(), AssemblyError> {
        let xid = match &self.open {
            Open::Plain(txn) => Some(txn.xid),
            Open::Stream(xid) if streams => Some(*xid),
            _ => None,
        };
        match xid {
            Some(xid) => Err(AssemblyError::NestedTransaction { message, xid }),
            None => Ok(()),
        }
    }

    fn current(&mut self) -> Option<&mut Txn> {
        match &mut self.open {
            Open::None => None,
            Open::Plain(txn) => Some(txn),
            Open::Stream(xid) => self.streams.get_mut(xid),
        }
    }

    fn relation(&mut self, rel: pgoutput::Relation) -> Result<(), AssemblyError> {
        if let Some(drift) = self.drift(&rel) {
            return Err(AssemblyError::SchemaDrift {
                relation: drift.relation,
                pinned: drift.pinned_fingerprint,
                found: drift.now.fingerprint,
            });
        }
        let schema = schema_of(&rel);
        let qualified = TableName::new(&schema.namespace, &schema.name).to_string();
        self.pinned
            .entry(qualified.clone())
            .or_insert(schema.fingerprint);
        self.schemas.insert(qualified, schema.clone());
        self.relations.insert(schema.relation_id, schema);
        Ok(())
    }

    /// Puts back what `repins` replaced, latest first.
    fn unpin(&mut self, repins: Vec<Repin>) {
        for repin in repins.into_iter().rev() {
            match repin.relation {
                Some(r) => self.relations.insert(repin.relation_id, r),
                None => self.relations.remove(&repin.relation_id),
            };
            for (name, pinned, schema) in repin.names {
                match pinned {
                    Some(p) => self.pinned.insert(name.clone(), p),
                    None => self.pinned.remove(&name),
                };
                match schema {
                    Some(s) => self.schemas.insert(name, s),
                    None => self.schemas.remove(&name),
                };
            }
        }
    }

    fn relation_for(
        &self,
        relation_id: u32,
        operation: &'static str,
    ) -> Result<RelationSchema, AssemblyError> {
        self.relations
            .get(&relation_id)
            .cloned()
            .ok_or(AssemblyError::UnknownRelation {
                operation,
                relation_id,
            })
    }

    /// Maps a TupleData onto the relation's columns. In a key-only old
    /// image, pgoutput sends non-key columns as NULL: they are `absent`.
    fn image(
        &self,
        relation: &RelationSchema,
        columns: Vec<Column>,
        operation: &'static str,
        key_only: bool,
    ) -> Result<Vec<Value>, AssemblyError> {
        if columns.len() != relation.columns.len() {
            return Err(AssemblyError::TupleWidth {
                operation,
                relation: TableName::new(&relation.namespace, &relation.name).to_string(),
                expected: relation.columns.len(),
                found: columns.len(),
            });
        }
        columns
            .into_iter()
            .zip(&relation.columns)
            .map(|(column, schema)| {
                let kind = match column {
                    _ if key_only && !schema.key => value::Kind::Absent(true),
                    Column::Null => value::Kind::Null(true),
                    Column::UnchangedToast => value::Kind::UnchangedToast(true),
                    Column::Binary(b) => value::Kind::Binary(b.to_vec()),
                    Column::Text(t) => {
                        value::Kind::Text(String::from_utf8(t.to_vec()).map_err(|_| {
                            AssemblyError::NotUtf8 {
                                relation: TableName::new(&relation.namespace, &relation.name)
                                    .to_string(),
                                column: schema.name.clone(),
                            }
                        })?)
                    }
                };
                Ok(Value { kind: Some(kind) })
            })
            .collect()
    }

    fn push(
        &mut self,
        body: change::Body,
        relation: Option<RelationSchema>,
        subxid: Option<u32>,
        message: &'static str,
    ) -> Result<(), AssemblyError> {
        let txn = self
            .current()
            .ok_or(AssemblyError::OutsideTransaction { message })?;
        let xid = txn.xid;
        if let Some(sub) = subxid {
            let mark = txn.spool.mark();
            txn.subxacts.entry(sub).or_insert(mark);
        }
        // Its place in the transaction is final: a subtransaction abort
        // only ever forgets a suffix.
        let change = Change {
            sequence: txn.spool.records(),
            body: Some(body),
        };
        // Each version of a relation is its own key: the spool never puts
        // two in one chunk, so every envelope carries the one its rows use.
        let used = relation.map(|relation| {
            let next = u32::try_from(txn.versions.len()).unwrap_or(u32::MAX);
            let key = *txn
                .versions
                .entry((relation.relation_id, relation.fingerprint))
                .or_insert(next);
            let (schema, len) = txn.relations.entry(key).or_insert_with(|| {
                let len = relation.encoded_len();
                (relation, len)
            });
            (
                RelationUse {
                    key,
                    id: schema.relation_id,
                    encoded_len: *len,
                },
                schema.columns.len(),
            )
        });
        // Against the schema its envelope will carry.
        envelope::validate_change(&change, |id| {
            used.filter(|(u, _)| u.id == id).map(|(_, width)| width)
        })
        .map_err(|source| AssemblyError::Invalid { xid, source })?;
        let row_relation = used.map(|(u, _)| u);
        let encoded = change.encode_to_vec();
        let was_spilled = txn.spool.is_spilled();
        txn.spool
            .push(&encoded, row_relation)
            .map_err(|source| AssemblyError::Spill { xid, source })?;
        if !was_spilled && txn.spool.is_spilled() {
            self.stats.spilled_transactions += 1;
        }
        self.stats.changes += 1;
        Ok(())
    }

    /// Starts handing out the committed transaction, as one whole envelope
    /// or its planned run of chunks, and emits the first;
    /// [`emit_next`](Self::emit_next) emits the rest.
    fn finish<E>(
        &mut self,
        mut txn: Txn,
        commit_lsn: u64,
        end_lsn: u64,
        commit_time: i64,
        emit: &mut dyn FnMut(Assembled) -> Result<(), E>,
    ) -> Result<(), AssembleOrSink<E>> {
        let xid = txn.xid;
        self.stats.peak_memory = self.stats.peak_memory.max(txn.spool.peak_memory());
        let begin_lsn = if txn.begin_lsn != 0 && txn.begin_lsn <= commit_lsn {
            txn.begin_lsn
        } else {
            commit_lsn
        };
        let frame = Envelope {
            protocol_version: PROTOCOL_VERSION,
            source: Some(self.config.source.clone()),
            xid: u64::from(xid),
            begin_lsn,
            commit_lsn,
            end_lsn,
            commit_time_micros: commit_time.saturating_add(pgoutput::POSTGRES_EPOCH_UNIX_MICROS),
            relations: Vec::new(),
            changes: Vec::new(),
            boundary: None,
            origin: std::mem::take(&mut txn.origin),
            capture: Some(Capture {
                path: capture::Path::External as i32,
                server_version_num: self.config.server_version_num,
                decoder: self.config.decoder.clone(),
                captured_at_micros: 0,
            }),
            checksum: 0,
        };
        // One chunk per call, so the caller can write each (and let the
        // applier take it) before the next is built.
        self.finishing = Some(Finishing {
            frame,
            patches: std::mem::take(&mut txn.patches),
            relations: std::mem::take(&mut txn.relations),
            planned: txn
                .spool
                .finish()
                .map_err(|source| AssemblyError::Spill { xid, source })?,
            next_chunk: 0,
        });
        self.emit_next(emit)?;
        Ok(())
    }

    /// Emits the next chunk of the committed transaction being handed out;
    /// true while more remain. Any other call into the assembler emits
    /// them all first, so none is ever skipped.
    pub fn emit_next<E>(
        &mut self,
        emit: &mut dyn FnMut(Assembled) -> Result<(), E>,
    ) -> Result<bool, AssembleOrSink<E>> {
        let Some(f) = &mut self.finishing else {
            return Ok(false);
        };
        let xid = f.frame.xid as u32;
        let spill = |source| AssemblyError::Spill { xid, source };
        let invalid = |source| AssemblyError::Invalid { xid, source };
        let Some((span, chunk)) = f.planned.chunk(f.next_chunk) else {
            // Only past u32::MAX chunks, which a boundary cannot number.
            return Err(spill(std::io::Error::other("more than u32::MAX chunks")).into());
        };
        let mut frame = f.frame.clone();
        frame.relations = chunk
            .keys()
            .filter_map(|id| f.relations.get(&id).map(|(r, _)| r.clone()))
            .collect();
        frame.boundary = Some(Boundary {
            mode: if span.count == 1 {
                boundary::Mode::Whole
            } else {
                boundary::Mode::Chunked
            } as i32,
            chunk_index: span.index,
            chunk_count: span.count,
            first_sequence: span.first_sequence,
            total_changes: f.planned.total(),
            partition: 0,
            manifest_partitions: Vec::new(),
        });
        if let Some(capture) = &mut frame.capture {
            capture.captured_at_micros = now_micros();
        }
        let (commit_lsn, end_lsn) = (frame.commit_lsn, frame.end_lsn);
        let mut raw = envelope::RawEnvelope::new(frame, span.changes).map_err(invalid)?;
        raw.reserve(span.changes, span.bytes);
        for k in 0..span.changes {
            let Some((_, record)) = f.planned.next_record().map_err(spill)? else {
                break;
            };
            match f.patches.get(&(span.first_sequence + k)) {
                Some(patched) => raw.push(patched).map_err(invalid)?,
                None => raw.push(record).map_err(invalid)?,
            }
        }
        let bytes = raw.finish().map_err(invalid)?;
        // Each change was checked as it came and the frame just now; the
        // whole is checked again wherever it is read. Tests check it here.
        debug_assert!(
            envelope::decode(&bytes).is_ok(),
            "{:?}",
            envelope::decode(&bytes)
        );
        f.next_chunk += 1;
        let more = f.next_chunk < f.planned.count();
        emit(Assembled {
            commit_lsn,
            end_lsn,
            last: !more,
            bytes,
        })
        .map_err(AssembleOrSink::Sink)?;
        self.stats.envelopes += 1;
        if !more {
            self.finishing = None;
            self.stats.transactions += 1;
        }
        Ok(more)
    }

    /// Chunks of a committed transaction wait to be emitted.
    pub fn finishing(&self) -> bool {
        self.finishing.is_some()
    }
}

/// A committed transaction whose chunks are being handed out.
#[derive(Debug)]
struct Finishing {
    /// Every field but relations, changes and boundary, which are per chunk.
    frame: Envelope,
    /// Records replaced by their completed encoding, by sequence.
    patches: HashMap<u64, Vec<u8>>,
    relations: BTreeMap<u32, (RelationSchema, usize)>,
    planned: Planned,
    next_chunk: usize,
}

/// One envelope, encoded (checksum included), with what its publisher
/// needs to know of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assembled {
    pub commit_lsn: u64,
    pub end_lsn: u64,
    /// The last envelope of its transaction: the source may move past
    /// `end_lsn` once it is durable.
    pub last: bool,
    pub bytes: Vec<u8>,
}

impl Assembled {
    /// Decodes (and validates) the envelope.
    pub fn decode(&self) -> Result<Envelope, envelope::EnvelopeError> {
        envelope::decode(&self.bytes)
    }
}

fn row(
    relation: &RelationSchema,
    operation: Operation,
    before_kind: BeforeImage,
    before: Vec<Value>,
    after: Vec<Value>,
) -> change::Body {
    change::Body::Row(RowChange {
        relation_id: relation.relation_id,
        operation: operation as i32,
        before_kind: before_kind as i32,
        before,
        after,
        truncate_cascade: false,
        truncate_restart_identity: false,
    })
}

fn now_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Either the assembler refused, or the sink (the durable log) failed.
#[derive(Debug, thiserror::Error)]
pub enum AssembleOrSink<E> {
    #[error(transparent)]
    Assembly(#[from] AssemblyError),
    #[error("publishing the envelope failed")]
    Sink(#[source] E),
}

/// The envelope's description of a Relation message, fingerprinted.
pub fn schema_of(rel: &pgoutput::Relation) -> RelationSchema {
    let namespace = if rel.namespace.is_empty() {
        "pg_catalog".to_owned()
    } else {
        rel.namespace.clone()
    };
    let replica_identity = match rel.replica_identity {
        b'd' => ReplicaIdentity::Default,
        b'n' => ReplicaIdentity::Nothing,
        b'f' => ReplicaIdentity::Full,
        _ => ReplicaIdentity::Index,
    };
    let mut schema = RelationSchema {
        relation_id: rel.oid,
        namespace,
        name: rel.name.clone(),
        replica_identity: replica_identity as i32,
        columns: rel
            .columns
            .iter()
            .map(|c| ColumnSchema {
                name: c.name.clone(),
                type_oid: c.type_oid,
                type_modifier: c.type_modifier,
                key: c.key,
            })
            .collect(),
        fingerprint: 0,
    };
    schema.fingerprint = fingerprint(&schema);
    schema
}
