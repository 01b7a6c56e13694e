//! One table at a new boundary while its flow follows:
//! `trellara reseed --flow F --table T`.
//!
//! ```text
//!  checks (nothing touched yet)
//!  fence: the flow's applier holds at L, having applied every commit < L
//!  target: BEGIN; DELETE FROM T; COPY T at the source snapshot of L;
//!          T's row in snapshot_tables (boundary L, stream_handoff_ready);
//!          checkpoint still < L; COMMIT
//!  fence released: the applier goes on from L, T's changes with the rest
//! ```
//!
//! Invariants:
//! * No reader sees a source transaction half applied. Until the copy
//!   commits, T holds what the applier applied, the same commits as every
//!   other table; from its commit T is at L, and so is the rest, because the
//!   applier holds there: a transaction touching T and another table waits
//!   with the held apply. The table is emptied with DELETE, not TRUNCATE,
//!   so a reader whose snapshot predates the commit still sees the old
//!   rows (TRUNCATE shows it an empty table).
//! * The copy is one target transaction: a copy that fails, or a reseed
//!   that dies, leaves T as it was, and the fence lock goes with the
//!   session, so the applier resumes by itself.
//! * T's changes that committed before L are in its copy. The held
//!   applier applied all of them already, so nothing is applied twice; the
//!   boundary is recorded so that an applier reading them again skips T's
//!   share (crate::apply's joined tables).
//!
//! A sink held at a schema change of T (its open quarantine records are
//! holds of T alone) has no apply to fence: it stays below the change.
//! Once its target's T takes the description after each held change, T
//! is copied at a boundary B of its own, a temporary slot's exported
//! snapshot, the same way as above (DELETE and COPY in one target
//! transaction, T locked on the source, a rewrite refused); that
//! transaction also holds T in SHARE UPDATE EXCLUSIVE mode, as `schema
//! accept` does (an accept since the first look refuses the copy), checks
//! the target takes the description the copy pinned, and resolves the
//! holds below B. The sink goes on from the held transaction passing T's
//! share of everything before B. Until it has caught up, T is ahead of
//! the other tables: the one reseed whose readers may see a transaction's
//! share of T before its share of another table.

use crate::config::Flow;
use crate::fence::FenceError;
use crate::snapshot::SnapshotError;
use crate::state::SnapshotState;
use std::time::Duration;
use tokio::time::Instant;
use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum ReseedError {
    #[error(
        "flow {flow} is not following: no `run --follow` or relay holds its log, so there is no running apply to hold at the table's new boundary\nhint: start it (trellara run --follow --config {config} --flow {flow}, or the relay and apply services) and reseed the table while it follows, or recopy every table: trellara reseed --config {config} --flow {flow}"
    )]
    NotFollowing { flow: String, config: String },
    #[error(
        "flow {flow}: its apply holds at the quarantined transaction {commit_lsn} ({reason}), so it cannot reach the fence a one-table copy takes; nothing was changed\nhint: {recovery}"
    )]
    Quarantined {
        flow: String,
        commit_lsn: String,
        reason: String,
        recovery: String,
    },
    #[error(
        "flow {flow} is on the kafka transport: its applier reads the topic, which has no position record to hold it at, so one table cannot be copied again under it\nhint: recopy the whole flow: trellara reseed --config {config} --flow {flow}"
    )]
    Kafka { flow: String, config: String },
    #[error(
        "flow {flow}: its snapshot run is {state}, so no table has a copy to replace yet\nhint: trellara reseed --config {config} --flow {flow} copies every table"
    )]
    NotHandedOff {
        flow: String,
        state: String,
        config: String,
    },
    #[error(
        "flow {flow}: table {table} has no copy on the target yet (it joins the flow in its next round)\nhint: wait until `trellara status --config {config} --flow {flow}` lists it, then reseed it"
    )]
    NotCopied {
        flow: String,
        table: String,
        config: String,
    },
    #[error(
        "flow {flow}: the sink holds at a schema change of {table} ({commit_lsn}), and the target's {table} cannot take the table's columns after it, so nothing was copied:\n  {}\nhint: make the target's {table} match the source's (the change on the target as on the source), then reseed it again; or `trellara schema accept --config {config} --flow {flow} --table {table}` once it matches",
        problems.join("\n  ")
    )]
    HeldMismatch {
        flow: String,
        table: String,
        commit_lsn: String,
        problems: Vec<String>,
        config: String,
    },
    #[error(
        "flow {flow}: the hold at {commit_lsn} on {table} was accepted while this reseed looked, so the sink goes on from it by itself; nothing was copied\nhint: reseed the table again once `trellara status --config {config} --flow {flow}` shows the sink following"
    )]
    ReleasedMeanwhile {
        flow: String,
        table: String,
        commit_lsn: String,
        config: String,
    },
    #[error(
        "flow {flow}: the sink's log cursor {cursor} is not in the log after {waited_s} s (dropped when the sink held the log past transport.retention_mib, or its applier has not started reading), so every table of the sink may be behind, not this one alone\nhint: if `trellara status --config {config} --flow {flow}` says the sink needs a copy, copy it whole: trellara reseed --config {config} --flow {flow} --sink NAME; otherwise reseed again once the flow applies"
    )]
    NoCursor {
        flow: String,
        cursor: String,
        waited_s: u64,
        config: String,
    },
    #[error(
        "flow {flow}: the target's trellara state tables are an older build's, which no following applier of this build has brought up to date\nhint: run every process of the flow with this build (the applier updates them when it starts), then reseed"
    )]
    OlderState { flow: String },
    #[error(
        "flow {flow}: table {table} has the DELETE trigger {trigger} on the target, which emptying the table for the copy would fire for every row\nhint: disable it for the reseed (ALTER TABLE {table} DISABLE TRIGGER {trigger}, then ENABLE it), or recopy the whole flow: trellara reseed --config {config} --flow {flow}"
    )]
    Trigger {
        flow: String,
        table: String,
        trigger: String,
        config: String,
    },
    #[error(
        "table {table} is referenced on the target by {from} (foreign key {constraint}), so it cannot be emptied alone: the copy would break or cascade into {from}\nhint: recopy the whole flow (trellara reseed --config {config} --flow {flow}), or drop the constraint on the target: ALTER TABLE {from} DROP CONSTRAINT {constraint}"
    )]
    Referenced {
        flow: String,
        table: String,
        from: String,
        constraint: String,
        config: String,
    },
    #[error(
        "flow {flow}: table {table} does not exist on the {side}\nhint: {}",
        if *side == "source" { "it was dropped there: take it out of flows[].tables (it then leaves the flow)" } else { "create it on the target with the source's columns" }
    )]
    Missing {
        flow: String,
        table: String,
        side: &'static str,
    },
    #[error(
        "table {table} was altered on the source after the boundary {at}, before it was copied (a rewrite shows a snapshot no rows); nothing was changed on the target\nhint: run the reseed again"
    )]
    SchemaMoved { table: String, at: String },
    #[error(transparent)]
    Connect(#[from] crate::session::ConnectError),
    #[error("reseed: the source database")]
    Source(#[source] tokio_postgres::Error),
    #[error("reseed: the target database")]
    Target(#[source] tokio_postgres::Error),
    #[error(transparent)]
    Following(#[from] crate::fence::Following),
    #[error(transparent)]
    Fence(#[from] FenceError),
    #[error(transparent)]
    Copy(#[from] SnapshotError),
}

/// What a one-table reseed did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Reseeded {
    pub flow: String,
    pub sink: String,
    pub table: String,
    /// L: the table's new boundary, where the apply was held.
    pub boundary_lsn: String,
    pub rows: u64,
    /// From the first fence to the release: what the flow's apply waited.
    pub apply_held_ms: u64,
    /// Emptying and copying the table, inside the hold.
    pub copy_ms: u64,
    /// The held transactions (commit LSNs) the copy released: a sink held
    /// at a schema change of the table goes on from there.
    pub released: Vec<String>,
}

/// Copies `table` of the following `flow` again, on the sink whose log
/// cursor is `cursor`, at a boundary of its own (see the module docs).
/// `source` and `target` are the flow's sessions; `timeout` bounds
/// reaching the hold and every lock the copy waits for (the copy itself
/// takes what the table's size needs).
pub async fn table(
    flow: &Flow,
    (sink, cursor): (&str, &str),
    (source_url, source, target): (&str, &Client, &Client),
    table: &str,
    (timeout, config): (Duration, &str),
    progress: &mut dyn FnMut(&str),
) -> Result<Reseeded, ReseedError> {
    let refuse = Refuse {
        flow,
        table,
        config,
    };
    let qualified = crate::config::quote_table(table).unwrap_or_else(|| table.to_owned());
    let (log_dir, holds) = refuse
        .checks((source, target), &qualified, (cursor, timeout))
        .await?;
    if !holds.is_empty() {
        return refuse
            .release(
                (sink, timeout),
                (source_url, source, target),
                &holds,
                progress,
            )
            .await;
    }
    // Outside the fence's snapshot: the table as it is now.
    let watch = crate::session::connect(source_url, "source").await?;
    progress(&format!(
        "reseed {table}: holding the flow's apply at a fence (up to {} s to reach it)",
        timeout.as_secs()
    ));
    let lock_timeout = format!("SET LOCAL lock_timeout = '{}s'", timeout.as_secs());
    let (at, (rows, copy), held) = crate::fence::hold_apply(
        flow,
        (log_dir, cursor),
        (source_url, source, target),
        timeout,
        async |at| -> Result<(u64, Duration), ReseedError> {
            progress(&format!(
                "reseed {table}: the apply holds at {at}; copying the table at it"
            ));
            let started = Instant::now();
            // Locked from here, so no rewrite lands between the stamp
            // below and the COPY.
            source
                .batch_execute(&format!(
                    "SET LOCAL statement_timeout = 0; {lock_timeout}; LOCK TABLE {qualified} IN ACCESS SHARE MODE"
                ))
                .await
                .map_err(ReseedError::Source)?;
            let seen = crate::verify::catalog_stamp(source, &qualified)
                .await
                .map_err(ReseedError::Source)?;
            target
                .batch_execute(&format!(
                    "BEGIN; SET LOCAL statement_timeout = 0; {lock_timeout}; LOCK TABLE {qualified} IN ROW EXCLUSIVE MODE"
                ))
                .await
                .map_err(ReseedError::Target)?;
            // Kept until the commit: an applier that did not hold cannot
            // commit past the fence under the copy either.
            let applied: Option<String> = target
                .query_opt(
                    "SELECT commit_lsn::text FROM trellara.checkpoints WHERE flow = $1 FOR SHARE",
                    &[&flow.name],
                )
                .await
                .map_err(ReseedError::Target)?
                .and_then(|r| r.get(0));
            if let Some(applied) = applied.and_then(|a| a.parse::<trellara_common::Lsn>().ok())
                && applied >= at
            {
                return Err(FenceError::Passed {
                    flow: flow.name.clone(),
                    applied,
                    at,
                }
                .into());
            }
            let rows = refuse
                .empty_and_copy((source, target), &qualified, at, progress)
                .await?;
            refuse.unmoved(&watch, &qualified, &seen, at).await?;
            // The source's is read-only: ended first, so that nothing can
            // fail once the copy is committed.
            source
                .batch_execute("COMMIT")
                .await
                .map_err(ReseedError::Source)?;
            target
                .batch_execute("COMMIT")
                .await
                .map_err(ReseedError::Target)?;
            Ok((rows, started.elapsed()))
        },
    )
    .await?;
    crate::fence::forget(target, flow).await;
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    Ok(Reseeded {
        flow: flow.name.clone(),
        sink: sink.to_owned(),
        table: table.to_owned(),
        boundary_lsn: at.to_string(),
        rows,
        apply_held_ms: ms(held),
        copy_ms: ms(copy),
        released: Vec::new(),
    })
}

/// What would refuse a reseed of `table`, and the errors that say so.
struct Refuse<'a> {
    flow: &'a Flow,
    table: &'a str,
    config: &'a str,
}

impl<'f> Refuse<'f> {
    /// Everything that would refuse the reseed, before the source or the
    /// target is changed; the flow's log, which its running process holds.
    async fn checks(
        &self,
        (source, target): (&Client, &Client),
        qualified: &str,
        (cursor, timeout): (&str, Duration),
    ) -> Result<(&'f std::path::Path, Vec<crate::state::quarantine::Hold>), ReseedError> {
        let (flow, table, config) = (self.flow, self.table, self.config);
        let name = &flow.name;
        if matches!(flow.transport, crate::config::Transport::Kafka { .. }) {
            return Err(ReseedError::Kafka {
                flow: name.clone(),
                config: config.to_owned(),
            });
        }
        let Some(log_dir) = crate::fence::followed_log(flow, target).await? else {
            return Err(ReseedError::NotFollowing {
                flow: name.clone(),
                config: config.to_owned(),
            });
        };
        // A following flow's applier brought the state tables up to date
        // when it started; an older build's are refused, not changed.
        if !crate::state::current(target)
            .await
            .map_err(ReseedError::Target)?
        {
            return Err(ReseedError::OlderState { flow: name.clone() });
        }
        // A quarantined transaction holds the apply below any fence; holds
        // of this table alone are what a copy of it can release.
        let open = crate::state::quarantine::open(target, name)
            .await
            .map_err(ReseedError::Target)?;
        let ours = !open.is_empty();
        if let Some(q) = open
            .into_iter()
            .find(|q| q.held_table.as_deref() != Some(table))
        {
            return Err(ReseedError::Quarantined {
                flow: name.clone(),
                commit_lsn: q.commit_lsn,
                reason: q.reason.lines().next().unwrap_or_default().to_owned(),
                recovery: q.recovery,
            });
        }
        let holds = if ours {
            crate::state::quarantine::holds(target, name, table)
                .await
                .map_err(ReseedError::Target)?
        } else {
            Vec::new()
        };
        let run = crate::state::runs::load(target, name)
            .await
            .map_err(ReseedError::Target)?;
        let state = run.map(|r| r.state);
        if !matches!(
            state,
            Some(SnapshotState::StreamHandoffReady | SnapshotState::Verified)
        ) {
            return Err(ReseedError::NotHandedOff {
                flow: name.clone(),
                state: state.map_or("missing", SnapshotState::as_str).to_owned(),
                config: config.to_owned(),
            });
        }
        let copied = crate::state::runs::tables(target, name)
            .await
            .map_err(ReseedError::Target)?;
        if !copied.iter().any(|t| t.name == table) {
            return Err(ReseedError::NotCopied {
                flow: name.clone(),
                table: table.to_owned(),
                config: config.to_owned(),
            });
        }
        // A sink whose cursor is gone is behind in every table: copying
        // one would put it ahead of the rest. An applier registers its
        // cursor when it starts reading the log, a moment after the
        // handoff: waited for.
        let path = log_dir.join("cursors").join(format!("{cursor}.cursor"));
        let deadline = Instant::now() + timeout;
        while !path.exists() {
            if Instant::now() >= deadline {
                return Err(ReseedError::NoCursor {
                    flow: name.clone(),
                    cursor: cursor.to_owned(),
                    waited_s: timeout.as_secs(),
                    config: config.to_owned(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for (side, client) in [("source", source), ("target", target)] {
            let exists: bool = client
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
                .await
                .map_err(|e| match side {
                    "source" => ReseedError::Source(e),
                    _ => ReseedError::Target(e),
                })?
                .get(0);
            if !exists {
                return Err(ReseedError::Missing {
                    flow: name.clone(),
                    table: table.to_owned(),
                    side,
                });
            }
        }
        self.dependents(target, qualified, true).await?;
        Ok((log_dir, holds))
    }

    /// Releases a sink held at schema changes of the table (`holds`, its
    /// only open quarantine records): checks the target's table takes
    /// the description after each, copies the table at a boundary of its
    /// own and resolves the holds below it in the copy's transaction (see
    /// the module docs).
    async fn release(
        &self,
        (sink, timeout): (&str, Duration),
        (source_url, source, target): (&str, &Client, &Client),
        holds: &[crate::state::quarantine::Hold],
        progress: &mut dyn FnMut(&str),
    ) -> Result<Reseeded, ReseedError> {
        let (flow, table) = (self.flow, self.table);
        let qualified = crate::config::quote_table(table).unwrap_or_else(|| table.to_owned());
        for hold in holds {
            let after = prost::Message::decode(hold.schema.as_slice()).ok();
            self.takes(source, target, &hold.commit_lsn, after).await?;
        }
        progress(&format!(
            "reseed {table}: the sink holds at a schema change of it ({}); copying it at a boundary of its own",
            holds
                .iter()
                .map(|h| h.commit_lsn.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
        let watch = crate::session::connect(source_url, "source").await?;
        let (_slot, snapshot, boundary) =
            crate::snapshot::temporary_slot((source_url, source), "reseed", None, Some(timeout))
                .await?;
        let lock_timeout = format!("SET LOCAL lock_timeout = '{}s'", timeout.as_secs());
        let started = Instant::now();
        source
            .batch_execute(&format!(
                "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SET TRANSACTION SNAPSHOT '{snapshot}';
                 SET LOCAL statement_timeout = 0; {lock_timeout}; LOCK TABLE {qualified} IN ACCESS SHARE MODE"
            ))
            .await
            .map_err(ReseedError::Source)?;
        let seen = crate::verify::catalog_stamp(source, &qualified)
            .await
            .map_err(ReseedError::Source)?;
        // SHARE UPDATE EXCLUSIVE as `schema accept` takes it: an accept
        // and this copy come one after the other, never interleaved.
        target
            .batch_execute(&format!(
                "BEGIN; SET LOCAL statement_timeout = 0; {lock_timeout};
                 LOCK TABLE {qualified} IN SHARE UPDATE EXCLUSIVE MODE"
            ))
            .await
            .map_err(ReseedError::Target)?;
        // Under the lock: a hold accepted since the first look lets its
        // sink apply on from the hold, over what this copy would hold.
        for hold in holds {
            // An LSN the target printed; one that does not parse is
            // treated as released, which refuses the copy.
            let released = match hold.commit_lsn.parse() {
                Ok(lsn) => crate::state::quarantine::released(target, &flow.name, lsn)
                    .await
                    .map_err(ReseedError::Target)?,
                Err(_) => true,
            };
            if released {
                return Err(ReseedError::ReleasedMeanwhile {
                    flow: flow.name.clone(),
                    table: table.to_owned(),
                    commit_lsn: hold.commit_lsn.clone(),
                    config: self.config.to_owned(),
                });
            }
        }
        let rows = self
            .empty_and_copy((source, target), &qualified, boundary, progress)
            .await?;
        // The copy pinned the table as the snapshot has it, which may be
        // past the holds: the target must take that description too.
        let pinned = crate::state::runs::tables(target, &flow.name)
            .await
            .map_err(ReseedError::Target)?
            .into_iter()
            .find(|t| t.name == table)
            .and_then(|t| t.schema);
        self.takes(source, target, &boundary.to_string(), pinned)
            .await?;
        self.unmoved(&watch, &qualified, &seen, boundary).await?;
        let released = crate::state::quarantine::release_below(target, &flow.name, table, boundary)
            .await
            .map_err(ReseedError::Target)?;
        source
            .batch_execute("COMMIT")
            .await
            .map_err(ReseedError::Source)?;
        target
            .batch_execute("COMMIT")
            .await
            .map_err(ReseedError::Target)?;
        Ok(Reseeded {
            flow: flow.name.clone(),
            sink: sink.to_owned(),
            table: table.to_owned(),
            boundary_lsn: boundary.to_string(),
            rows,
            apply_held_ms: 0,
            copy_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            released,
        })
    }

    /// Under the table's lock, inside the target transaction: refuses a
    /// constraint or trigger added since the first look, empties the
    /// table and copies it from `source`'s snapshot, recording `boundary`.
    async fn empty_and_copy(
        &self,
        (source, target): (&Client, &Client),
        qualified: &str,
        boundary: trellara_common::Lsn,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64, ReseedError> {
        self.dependents(target, qualified, true).await?;
        target
            .batch_execute(&format!("DELETE FROM {qualified}"))
            .await
            .map_err(ReseedError::Target)?;
        Ok(crate::snapshot::copy_in_snapshot(
            self.table,
            (source, target),
            &self.flow.name,
            Some(boundary),
            progress,
        )
        .await?)
    }

    /// A snapshot reads the catalog as of its boundary but the rows
    /// through the table's current files: a rewrite or TRUNCATE since, of
    /// it or a partition, shows it none. Refused when the table's stamp
    /// now (`watch`, outside the snapshot) is not the one `seen` in it.
    async fn unmoved(
        &self,
        watch: &Client,
        qualified: &str,
        seen: &Option<String>,
        at: trellara_common::Lsn,
    ) -> Result<(), ReseedError> {
        let now = crate::verify::catalog_stamp(watch, qualified)
            .await
            .map_err(ReseedError::Source)?;
        if now == *seen {
            return Ok(());
        }
        Err(ReseedError::SchemaMoved {
            table: self.table.to_owned(),
            at: at.to_string(),
        })
    }

    /// Whether the target's table takes rows under `after` (the table's
    /// description at `at`): refused by name otherwise, as a description
    /// that could not be read (None) is.
    async fn takes(
        &self,
        source: &Client,
        target: &Client,
        at: &str,
        after: Option<trellara_common::envelope::RelationSchema>,
    ) -> Result<(), ReseedError> {
        let (flow, table) = (self.flow, self.table);
        let refused = |problems: Vec<String>| ReseedError::HeldMismatch {
            flow: flow.name.clone(),
            table: table.to_owned(),
            commit_lsn: at.to_owned(),
            problems,
            config: self.config.to_owned(),
        };
        let Some(after) = after else {
            return Err(refused(vec![
                "the table's description there cannot be read".into(),
            ]));
        };
        let Ok(name) = trellara_common::table_name::TableName::parse(table) else {
            return Err(refused(vec![format!("{table} is not schema.table")]));
        };
        let named = crate::accept::source_types(source, &after)
            .await
            .map_err(ReseedError::Source)?;
        let problems = crate::accept::mismatches(target, (&name, &named), &after)
            .await
            .map_err(ReseedError::Target)?;
        if problems.is_empty() {
            Ok(())
        } else {
            Err(refused(problems))
        }
    }

    /// What the DELETE would reach beyond the table's rows on the target:
    /// another table's foreign key to it or to one of its partitions (the
    /// delete would fail, or cascade), a DELETE trigger (it would fire for
    /// every row).
    async fn dependents(
        &self,
        target: &Client,
        qualified: &str,
        triggers: bool,
    ) -> Result<(), ReseedError> {
        let link = target
            .query_opt(
                "WITH tree AS (SELECT to_regclass($1) AS relid UNION SELECT relid FROM pg_partition_tree(to_regclass($1)))
                 SELECT rn.nspname || '.' || r.relname, c.conname
                 FROM pg_constraint c
                 JOIN pg_class r ON r.oid = c.conrelid JOIN pg_namespace rn ON rn.oid = r.relnamespace
                 WHERE c.contype = 'f' AND c.confrelid IN (SELECT relid FROM tree)
                   AND c.conrelid NOT IN (SELECT relid FROM tree)
                 ORDER BY 1, 2 LIMIT 1",
                &[&qualified],
            )
            .await
            .map_err(ReseedError::Target)?;
        if let Some(link) = link {
            return Err(ReseedError::Referenced {
                flow: self.flow.name.clone(),
                table: self.table.to_owned(),
                from: link.get(0),
                constraint: link.get(1),
                config: self.config.to_owned(),
            });
        }
        if !triggers {
            return Ok(());
        }
        // tgtype bit 3 (8): fires on DELETE; 'D': disabled.
        let trigger: Option<String> = target
            .query_opt(
                "WITH tree AS (SELECT to_regclass($1) AS relid UNION SELECT relid FROM pg_partition_tree(to_regclass($1)))
                 SELECT tgname::text FROM pg_trigger
                 WHERE tgrelid IN (SELECT relid FROM tree)
                   AND NOT tgisinternal AND tgenabled <> 'D' AND tgtype & 8 <> 0
                 ORDER BY 1 LIMIT 1",
                &[&qualified],
            )
            .await
            .map_err(ReseedError::Target)?
            .map(|r| r.get(0));
        if let Some(trigger) = trigger {
            return Err(ReseedError::Trigger {
                flow: self.flow.name.clone(),
                table: self.table.to_owned(),
                trigger,
                config: self.config.to_owned(),
            });
        }
        Ok(())
    }
}
