//! One decoded transaction: its changes in a [`ChangeLog`], the relation
//! schema versions they refer to, and the commit-time assembly into
//! envelope v1 bytes.
//!
//! ```text
//!  push(Change) ─▶ ChangeLog ── commit ──▶ pass 1: plan_chunks (lengths only)
//!                                          pass 2: per chunk, decode its changes,
//!                                          attach the relations they use, set the
//!                                          boundary, envelope::encode (validates)
//!                                          ─▶ emit(index, count, bytes)
//! ```
//!
//! Invariants:
//! - Every emitted envelope is valid on its own (`envelope::encode` checked
//!   it) and at most `chunk_bytes` long, unless it holds a single change that
//!   alone exceeds the target.
//! - One chunk: `MODE_WHOLE`; more: `MODE_CHUNKED` with `chunk_index`,
//!   `chunk_count`, `first_sequence`, `total_changes`, changes in order.
//! - Memory at commit is bounded by one chunk's changes plus the change log's
//!   budget. Pure Rust: unit-testable without a server.

use std::path::PathBuf;

use prost::Message as _;
use trellara_common::envelope::{
    self, Boundary, Change, Envelope, RelationSchema, boundary, change,
};

use crate::error::PluginError;
use crate::spill::{self, ChangeLog, NO_RELATION};

#[derive(Debug)]
pub struct Transaction {
    log: ChangeLog,
    /// Relation schemas the changes refer to; a record's relation version
    /// indexes this list. A relation whose schema changes mid-transaction
    /// has several versions.
    versions: Vec<RelationSchema>,
    version_lens: Vec<(u32, usize)>,
    scratch: Vec<u8>,
}

impl Transaction {
    pub fn new(memory_budget: usize, spill_dir: PathBuf) -> Self {
        Transaction {
            log: ChangeLog::new(memory_budget, spill_dir),
            versions: Vec::new(),
            version_lens: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Number of changes so far.
    pub fn len(&self) -> u64 {
        self.log.len()
    }

    /// Bytes of encoded changes so far.
    pub fn bytes(&self) -> u64 {
        self.log.bytes()
    }

    /// The version index of `schema` (`encoded_len` is its protobuf length),
    /// adding it if this exact schema is new to the transaction.
    pub fn version_of(&mut self, schema: &RelationSchema, encoded_len: usize) -> u32 {
        let found = self.versions.iter().position(|v| {
            v.relation_id == schema.relation_id && v.fingerprint == schema.fingerprint
        });
        let index = found.unwrap_or_else(|| {
            self.versions.push(schema.clone());
            self.version_lens.push((schema.relation_id, encoded_len));
            self.versions.len() - 1
        });
        index as u32
    }

    /// Appends the next change (sequence numbers are assigned here). Returns
    /// true when this push moved the log to its spill file.
    pub fn push(&mut self, version: u32, body: change::Body) -> Result<bool, PluginError> {
        let change = Change {
            sequence: self.log.len(),
            body: Some(body),
        };
        self.scratch.clear();
        change
            .encode(&mut self.scratch)
            .map_err(|e| PluginError::internal(format!("trellara: encoding a change: {e}")))?;
        let spilled = self.log.spilled();
        self.log
            .push(version, &self.scratch)
            .map_err(|e| PluginError::io("append to the transaction's spill file", &e))?;
        Ok(!spilled && self.log.spilled())
    }

    /// Builds the transaction's envelopes from `template` (every header
    /// field set; relations, changes and boundary are filled in here) and
    /// hands each, in order, to `emit(chunk_index, chunk_count, bytes)`.
    /// Emits nothing for a transaction without changes.
    pub fn assemble(
        &mut self,
        mut template: Envelope,
        chunk_bytes: usize,
        mut emit: impl FnMut(u32, u32, &[u8]) -> Result<(), PluginError>,
    ) -> Result<(), PluginError> {
        let total = self.log.len();
        if total == 0 {
            return Ok(());
        }
        // An upper bound on everything but relations and changes: the
        // boundary and checksum hold the largest values they can take.
        template.relations.clear();
        template.changes.clear();
        template.boundary = Some(Boundary {
            mode: boundary::Mode::Chunked as i32,
            chunk_index: u32::MAX,
            chunk_count: u32::MAX,
            first_sequence: total,
            total_changes: total,
            partition: 0,
            manifest_partitions: Vec::new(),
        });
        template.checksum = u64::MAX;
        let base = template.encoded_len();
        let io = |what: &'static str| move |e: std::io::Error| PluginError::io(what, &e);
        let plans = {
            let mut reader = self.log.reader().map_err(io("rewind the change log"))?;
            spill::plan_chunks(&mut reader, base, chunk_bytes, &self.version_lens)
                .map_err(io("read the change log"))?
        };
        let count = u32::try_from(plans.len())
            .map_err(|_| PluginError::internal("trellara: more than u32::MAX chunks"))?;
        let whole = count == 1;
        let mut reader = self.log.reader().map_err(io("rewind the change log"))?;
        let mut payload = Vec::new();
        for (index, plan) in (0u32..).zip(plans.iter()) {
            let mut changes = Vec::with_capacity(usize::try_from(plan.count).unwrap_or(0));
            let mut used: Vec<u32> = Vec::new();
            for _ in 0..plan.count {
                let version = reader
                    .next_into(&mut payload)
                    .map_err(io("read the change log"))?
                    .ok_or_else(|| PluginError::internal("trellara: change log ended early"))?;
                let change = Change::decode(payload.as_slice()).map_err(|e| {
                    PluginError::internal(format!("trellara: change log record unreadable: {e}"))
                })?;
                if version != NO_RELATION && !used.contains(&version) {
                    used.push(version);
                }
                changes.push(change);
            }
            template.relations = used
                .iter()
                .filter_map(|v| self.versions.get(*v as usize).cloned())
                .collect();
            template.changes = changes;
            template.boundary = Some(Boundary {
                mode: if whole {
                    boundary::Mode::Whole
                } else {
                    boundary::Mode::Chunked
                } as i32,
                chunk_index: index,
                chunk_count: count,
                first_sequence: plan.first_sequence,
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
            emit(index, count, &bytes)?;
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
        ) {
            let versions = versions();
            let mut txn = Transaction::new(budget, dir());
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
            let mut template = sample::insert_transaction(0, 0);
            template.boundary = None;
            let mut out: Vec<(u32, u32, Vec<u8>)> = Vec::new();
            txn.assemble(template, chunk_bytes, |i, n, bytes| {
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
        let mut txn = Transaction::new(0, dir());
        let mut called = false;
        let result = txn.assemble(sample::insert_transaction(0, 0), 4096, |_, _, _| {
            called = true;
            Ok(())
        });
        assert!(result.is_ok() && !called);
    }
}
