//! One decoded transaction: its changes in the shared [`Spool`] (which
//! plans the chunks as they arrive), the relation schema versions they
//! refer to, and the commit-time assembly into envelope v1 bytes.
//!
//! ```text
//!  push(Change) ─▶ Spool (chunk planned on arrival) ── commit ──▶ per chunk: decode
//!                  its changes, attach the relations they use, set the boundary,
//!                  envelope::encode (validates) ─▶ emit(index, count, bytes)
//! ```
//!
//! Invariants:
//! - Every emitted envelope is valid on its own (`envelope::encode` checked
//!   it) and at most `chunk_bytes` long, unless it holds a single change that
//!   alone exceeds the target: the spool plans relations and changes within
//!   `chunk_bytes` less [`header_bound`], the most the rest can take.
//! - One chunk: `MODE_WHOLE`; more: `MODE_CHUNKED` with `chunk_index`,
//!   `chunk_count`, `first_sequence`, `total_changes`, changes in order.
//! - Memory at commit is bounded by one chunk's changes plus the spool's
//!   budget. Pure Rust: unit-testable without a server.

use std::path::PathBuf;

use prost::Message as _;
use trellara_common::envelope::{
    self, Boundary, Capture, Change, Envelope, RelationSchema, SourceIdentity, boundary, capture,
    change,
};
use trellara_common::spool::{RelationUse, Spool};

use crate::error::PluginError;

/// The most bytes an envelope of `source` and `origin` takes besides its
/// relations and changes: every other field at the widest value it can
/// hold. The origin is given, not bounded: its name is `text`.
pub fn header_bound(
    source: &SourceIdentity,
    origin: &str,
    server_version_num: u32,
    decoder: &str,
) -> usize {
    Envelope {
        protocol_version: envelope::PROTOCOL_VERSION,
        source: Some(SourceIdentity {
            timeline: u32::MAX,
            ..source.clone()
        }),
        xid: u64::MAX,
        begin_lsn: u64::MAX,
        commit_lsn: u64::MAX,
        end_lsn: u64::MAX,
        commit_time_micros: i64::MIN,
        relations: Vec::new(),
        changes: Vec::new(),
        boundary: Some(Boundary {
            mode: boundary::Mode::Chunked as i32,
            chunk_index: u32::MAX,
            chunk_count: u32::MAX,
            first_sequence: u64::MAX,
            total_changes: u64::MAX,
            partition: 0,
            manifest_partitions: Vec::new(),
        }),
        origin: origin.into(),
        capture: Some(Capture {
            path: capture::Path::Native as i32,
            server_version_num,
            decoder: decoder.into(),
            captured_at_micros: i64::MIN,
        }),
        checksum: u64::MAX,
    }
    .encoded_len()
}

#[derive(Debug)]
pub struct Transaction {
    spool: Spool,
    /// Relation schemas the changes refer to; a record's tag indexes this
    /// list. A relation whose schema changes mid-transaction has several
    /// versions.
    versions: Vec<(RelationSchema, usize)>,
    scratch: Vec<u8>,
    /// The replication origin's name, empty for a local transaction.
    pub origin: String,
}

impl Transaction {
    /// A transaction holding up to `memory_budget` bytes of changes in
    /// memory, cut into envelopes of at most `chunk_bytes`, of which
    /// `header` ([`header_bound`]) go to the fields besides relations and
    /// changes, replayed from `origin`.
    pub fn new(
        memory_budget: usize,
        spill_dir: PathBuf,
        chunk_bytes: usize,
        header: usize,
        origin: String,
    ) -> Self {
        Transaction {
            spool: Spool::new(memory_budget, spill_dir, chunk_bytes.saturating_sub(header)),
            versions: Vec::new(),
            scratch: Vec::new(),
            origin,
        }
    }

    /// Number of changes so far.
    pub fn len(&self) -> u64 {
        self.spool.records()
    }

    /// Bytes of spooled changes so far.
    pub fn bytes(&self) -> u64 {
        self.spool.mark().bytes
    }

    /// The version index of `schema` (`encoded_len` is its protobuf length),
    /// adding it if this exact schema is new to the transaction.
    pub fn version_of(&mut self, schema: &RelationSchema, encoded_len: usize) -> u32 {
        let found = self.versions.iter().position(|(v, _)| {
            v.relation_id == schema.relation_id && v.fingerprint == schema.fingerprint
        });
        let index = found.unwrap_or_else(|| {
            self.versions.push((schema.clone(), encoded_len));
            self.versions.len() - 1
        });
        index as u32
    }

    /// Appends the next change (sequence numbers are assigned here); a row
    /// names its relation `version`, anything else
    /// [`NO_RELATION`](trellara_common::spool::NO_RELATION). Returns
    /// true when this push moved the transaction to its spill file.
    pub fn push(&mut self, version: u32, body: change::Body) -> Result<bool, PluginError> {
        let change = Change {
            sequence: self.spool.records(),
            body: Some(body),
        };
        self.scratch.clear();
        change
            .encode(&mut self.scratch)
            .map_err(|e| PluginError::internal(format!("trellara: encoding a change: {e}")))?;
        let relation = self
            .versions
            .get(version as usize)
            .map(|(schema, encoded_len)| RelationUse {
                key: version,
                id: schema.relation_id,
                encoded_len: *encoded_len,
            });
        let spilled = self.spool.is_spilled();
        self.spool
            .push(&self.scratch, relation)
            .map_err(|e| PluginError::io("append to the transaction's spill file", &e))?;
        Ok(!spilled && self.spool.is_spilled())
    }

    /// Builds the transaction's envelopes from `template` (every header
    /// field set; relations, changes and boundary are filled in here) and
    /// hands each, in order, to `emit(chunk_index, chunk_count, bytes)`.
    /// Emits nothing for a transaction without changes.
    pub fn assemble(
        self,
        mut template: Envelope,
        mut emit: impl FnMut(u32, u32, &[u8]) -> Result<(), PluginError>,
    ) -> Result<(), PluginError> {
        let io = |what: &'static str| move |e: std::io::Error| PluginError::io(what, &e);
        let mut planned = self
            .spool
            .finish()
            .map_err(io("rewind the transaction's spool"))?;
        let total = planned.total();
        if total == 0 {
            return Ok(());
        }
        for index in 0..planned.count() {
            let (span, chunk) = planned
                .chunk(index)
                .ok_or_else(|| PluginError::internal("trellara: more than u32::MAX chunks"))?;
            template.relations = chunk
                .keys()
                .filter_map(|v| self.versions.get(v as usize).map(|(r, _)| r.clone()))
                .collect();
            let mut changes = Vec::with_capacity(usize::try_from(span.changes).unwrap_or(0));
            for _ in 0..span.changes {
                let (_, record) = planned
                    .next_record()
                    .map_err(io("read the transaction's spool"))?
                    .ok_or_else(|| {
                        PluginError::internal("trellara: the transaction's spool ended early")
                    })?;
                let change = Change::decode(record).map_err(|e| {
                    PluginError::internal(format!("trellara: a spooled change is unreadable: {e}"))
                })?;
                changes.push(change);
            }
            template.changes = changes;
            template.boundary = Some(Boundary {
                mode: if span.count == 1 {
                    boundary::Mode::Whole
                } else {
                    boundary::Mode::Chunked
                } as i32,
                chunk_index: span.index,
                chunk_count: span.count,
                first_sequence: span.first_sequence,
                total_changes: total,
                partition: 0,
                manifest_partitions: Vec::new(),
            });
            template.checksum = 0;
            let bytes = envelope::encode(&template).map_err(|e| {
                PluginError::internal(format!(
                    "trellara: transaction {} (commit {:X}) does not form a valid envelope: {e}",
                    template.xid, template.commit_lsn
                ))
            })?;
            emit(span.index, span.count, &bytes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use trellara_common::envelope::{
        BeforeImage, ColumnSchema, LogicalMessage, Operation, RowChange, Value, value,
    };
    use trellara_common::fingerprint::fingerprint;
    use trellara_common::sample;
    use trellara_common::spool::NO_RELATION;

    fn dir() -> PathBuf {
        std::env::temp_dir().join(format!("trellara-assemble-test-{}", std::process::id()))
    }

    /// `sales` and a second version of it with one more column.
    fn versions() -> [RelationSchema; 2] {
        let v1 = sample::sales_relation();
        let mut v2 = v1.clone();
        v2.columns.push(ColumnSchema {
            name: "region".into(),
            type_oid: 25,
            type_modifier: -1,
            key: false,
        });
        v2.fingerprint = fingerprint(&v2);
        [v1, v2]
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert { version: usize, note: Option<usize> },
        Message(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..2usize, proptest::option::of(0..3000usize))
                .prop_map(|(version, note)| Op::Insert { version, note }),
            1 => (0..500usize).prop_map(Op::Message),
        ]
    }

    fn body(op: &Op, i: usize, versions: &[RelationSchema]) -> change::Body {
        match op {
            Op::Insert { version, note } => {
                let width = versions[*version].columns.len();
                let mut after = vec![
                    sample::text(i.to_string()),
                    sample::text("1.50"),
                    note.map_or_else(sample::null, |n| sample::text("n".repeat(n))),
                ];
                after.resize(
                    width,
                    Value {
                        kind: Some(value::Kind::Text("eu".into())),
                    },
                );
                change::Body::Row(RowChange {
                    relation_id: versions[*version].relation_id,
                    operation: Operation::Insert as i32,
                    before_kind: BeforeImage::None as i32,
                    before: Vec::new(),
                    after,
                    truncate_cascade: false,
                    truncate_restart_identity: false,
                })
            }
            Op::Message(n) => change::Body::Message(LogicalMessage {
                prefix: "app".into(),
                content: vec![7; *n],
            }),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Whatever the changes, budget and target: envelopes are valid, in
        /// order, within the target (or a single oversized change), and
        /// together hold exactly the changes pushed.
        #[test]
        fn envelopes_are_valid_bounded_and_complete(
            ops in proptest::collection::vec(op(), 1..120),
            chunk_bytes in 4096usize..40_000,
            budget in prop_oneof![Just(0usize), Just(usize::MAX), 0usize..20_000],
            origin in 0usize..600,
        ) {
            let versions = versions();
            let mut template = sample::insert_transaction(0, 0);
            template.boundary = None;
            // A replication origin's name is text of any length.
            template.origin = "u".repeat(origin);
            let capture = template.capture.clone().unwrap_or_default();
            let header = header_bound(
                &template.source.clone().unwrap_or_default(),
                &template.origin,
                capture.server_version_num,
                &capture.decoder,
            );
            let mut txn = Transaction::new(budget, dir(), chunk_bytes, header, String::new());
            let mut pushed = Vec::new();
            for (i, op) in ops.iter().enumerate() {
                let version = match op {
                    Op::Insert { version, .. } => {
                        let schema = &versions[*version];
                        txn.version_of(schema, schema.encoded_len())
                    }
                    Op::Message(_) => NO_RELATION,
                };
                let body = body(op, i, &versions);
                pushed.push(body.clone());
                txn.push(version, body).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
            }
            let mut out: Vec<(u32, u32, Vec<u8>)> = Vec::new();
            txn.assemble(template, |i, n, bytes| {
                out.push((i, n, bytes.to_vec()));
                Ok(())
            })
            .map_err(|e| TestCaseError::fail(format!("{e:?}")))?;

            let count = out.len() as u32;
            let mut next_sequence = 0u64;
            let mut got = Vec::new();
            for (k, (i, n, bytes)) in out.iter().enumerate() {
                prop_assert_eq!((*i, *n), (k as u32, count));
                let env = envelope::decode(bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
                let b = env.boundary.clone().unwrap_or_default();
                let mode = if count == 1 { boundary::Mode::Whole } else { boundary::Mode::Chunked };
                prop_assert_eq!(b.mode, mode as i32);
                prop_assert_eq!(b.first_sequence, next_sequence);
                prop_assert_eq!(b.total_changes, ops.len() as u64);
                prop_assert!(
                    bytes.len() <= chunk_bytes || env.changes.len() == 1,
                    "envelope {} is {} bytes > {} with {} changes", k, bytes.len(), chunk_bytes, env.changes.len()
                );
                next_sequence += env.changes.len() as u64;
                got.extend(env.changes.into_iter().filter_map(|c| c.body));
            }
            prop_assert_eq!(got, pushed);
        }
    }

    #[test]
    fn empty_transactions_emit_nothing() {
        let txn = Transaction::new(0, dir(), 4096, 0, String::new());
        let mut called = false;
        let result = txn.assemble(sample::insert_transaction(0, 0), |_, _, _| {
            called = true;
            Ok(())
        });
        assert!(result.is_ok() && !called);
    }
}
