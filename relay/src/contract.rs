//! Capture's half of a schema contract (docs/SCHEMA.md): a relation whose
//! description drifted from its pin is diffed ([`ddl::diff`]), each
//! difference classified and decided under the flow's `schema` config
//! ([`ddl::plan`]), and, when every one of them is auto-apply, turned
//! into the [`DdlEvent`]s that go into the log ahead of the table's rows
//! under the new description. Anything else goes into the log too, as an
//! event marked held (`DdlEvent.held`: the change, its decision and why):
//! capture goes on, and each sink holds the transaction at it until the
//! operator accepts the change (`trellara schema accept`) or copies the
//! table again.
//!
//! Invariants:
//! * An added column is read from the source catalog, never guessed from
//!   the Relation message: a NOT NULL column is add_not_null_column, and
//!   the value the rows before it read (a constant DEFAULT writes no WAL
//!   for them) travels with the event, so the sink's old rows read it too.
//!   A default the catalog cannot state as that value (a volatile one
//!   rewrote the table) is held for review.
//! * Only names and values leave the source: a sink resolves the type name
//!   in its own catalog and builds its own statement; no SQL text from the
//!   log is ever run.
//! * A table the flow does not replicate is re-pinned and goes on: its
//!   rows reach no sink.

/// What reading the source catalog fails with (capture takes it as its own
/// wire error: retried when transient).
pub type CatalogError = trellara_external_relay::pgwire::WireError;
use trellara_common::config::{ApplyMode, Flow};
use trellara_common::ddl::{self, Change, Decision, diff::Detected};
use trellara_common::envelope::{DdlEvent, DdlKind, RelationSchema, Value, value};
use trellara_common::table_name::TableName;
use trellara_external_relay::assembler::Drift;
use trellara_external_relay::pgwire::{self, Connection};

/// Reads the source catalog for what a Relation message cannot say.
#[allow(async_fn_in_trait)] // one task; no Send bound needed
pub trait Catalog {
    /// The column `column` of relation `relation_id` with type `type_oid`;
    /// `None` when it is not there (dropped or changed again since).
    async fn added(
        &mut self,
        relation_id: u32,
        column: &str,
        type_oid: u32,
    ) -> Result<Option<AddedColumn>, CatalogError>;
    /// The column `column` of relation `relation_id`, whatever its type.
    async fn added_by_name(
        &mut self,
        relation_id: u32,
        column: &str,
    ) -> Result<Option<AddedColumn>, CatalogError>;
    /// `format_type(type_oid, NULL)`.
    async fn type_name(&mut self, type_oid: u32) -> Result<String, CatalogError>;
}

/// What the source catalog says of a column that appeared (see
/// [`Catalog::added`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedColumn {
    pub not_null: bool,
    pub type_name: String,
    /// `Some(v)`: the column has a missing value, `v` (NULL: `None`).
    pub fill: Option<Option<String>>,
    pub has_default: bool,
    pub array: bool,
}

/// The source catalog over a SQL session opened when first needed (a
/// drift is rare: no session is held for it otherwise).
pub struct SourceCatalog<'a> {
    options: &'a pgwire::ConnectOptions,
    session: Option<Connection>,
}

impl std::fmt::Debug for SourceCatalog<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceCatalog")
            .field("open", &self.session.is_some())
            .finish()
    }
}

impl<'a> SourceCatalog<'a> {
    pub fn new(options: &'a pgwire::ConnectOptions) -> Self {
        SourceCatalog {
            options,
            session: None,
        }
    }

    /// Runs `sql` on a plain SQL session (no walsender slot taken), with
    /// an empty search_path, so `format_type` qualifies every type outside
    /// pg_catalog. A session found dead is opened again once.
    async fn query(&mut self, sql: &str) -> Result<Vec<pgwire::Row>, CatalogError> {
        let sql = format!("SET search_path TO ''; SET statement_timeout TO '30s'; {sql}");
        for attempt in 0..2 {
            let session = match &mut self.session {
                Some(s) => s,
                None => {
                    let mut options = self.options.clone();
                    options.replication = false;
                    self.session.insert(Connection::connect(&options).await?)
                }
            };
            match session.simple_query(&sql).await {
                Ok(rows) => return Ok(rows),
                Err(e) => {
                    self.session = None;
                    if attempt == 1 || !e.is_transient() {
                        return Err(e);
                    }
                }
            }
        }
        unreachable!("the second attempt returns")
    }
    /// Column `column` of `relation_id` (of type `type_oid`, when given)
    /// as the catalog has it now.
    async fn column(
        &mut self,
        relation_id: u32,
        column: &str,
        type_oid: Option<u32>,
    ) -> Result<Option<AddedColumn>, CatalogError> {
        let of_type = type_oid
            .map(|t| format!(" AND a.atttypid = {t}::oid"))
            .unwrap_or_default();
        let sql = format!(
            "SELECT a.attnotnull::text AS not_null, format_type(a.atttypid, NULL) AS type_name,
                    a.atthasmissing::text AS has_missing,
                    CASE WHEN a.atthasmissing THEN ((a.attmissingval::text)::text[])[1] END AS fill,
                    (d.oid IS NOT NULL)::text AS has_default, (t.typcategory = 'A')::text AS array
             FROM pg_catalog.pg_attribute a
             JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
             LEFT JOIN pg_catalog.pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
             WHERE a.attrelid = {relation_id}::oid AND a.attname = {} {of_type}
               AND a.attnum > 0 AND NOT a.attisdropped",
            postgres_protocol::escape::escape_literal(column)
        );
        let rows = self.query(&sql).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let flag = |name: &str| row.get(name) == Some("true");
        Ok(Some(AddedColumn {
            not_null: flag("not_null"),
            type_name: row.get("type_name").unwrap_or_default().to_owned(),
            fill: flag("has_missing").then(|| row.get("fill").map(str::to_owned)),
            has_default: flag("has_default"),
            array: flag("array"),
        }))
    }
}

impl Catalog for SourceCatalog<'_> {
    async fn added(
        &mut self,
        relation_id: u32,
        column: &str,
        type_oid: u32,
    ) -> Result<Option<AddedColumn>, CatalogError> {
        self.column(relation_id, column, Some(type_oid)).await
    }

    async fn added_by_name(
        &mut self,
        relation_id: u32,
        column: &str,
    ) -> Result<Option<AddedColumn>, CatalogError> {
        self.column(relation_id, column, None).await
    }

    async fn type_name(&mut self, type_oid: u32) -> Result<String, CatalogError> {
        let rows = self
            .query(&format!(
                "SELECT format_type({type_oid}::oid, NULL) AS type_name"
            ))
            .await?;
        Ok(rows
            .first()
            .and_then(|r| r.get("type_name"))
            .unwrap_or_default()
            .to_owned())
    }
}

/// The DDL events that explain `drift` on `flow`, one per change, each
/// with whether its fill waits for the transaction's commit
/// ([`complete`]). A change that is not auto-apply is an event marked
/// held.
pub async fn explain<C: Catalog>(
    flow: &Flow,
    drift: &Drift,
    catalog: &mut C,
) -> Result<Vec<(DdlEvent, bool)>, CatalogError> {
    let now = &drift.now;
    let table = TableName::new(&now.namespace, &now.name).to_string();
    let replicated = |name: &str| {
        flow.tables
            .iter()
            .any(|t| TableName::parse(t).is_ok_and(|t| t.to_string() == name))
    };
    if !replicated(&table) && !replicated(&drift.relation) {
        return Ok(Vec::new());
    }
    let Some(pinned) = &drift.pinned else {
        let what = format!(
            "pinned fingerprint {:#018x}, the source now sends {:#018x}: the pinned description is not known to this log (pinned by an older build, or changed before its first row), so the change cannot be named",
            drift.pinned_fingerprint, now.fingerprint
        );
        let unnamed = held_event(
            (drift.pinned_fingerprint, now),
            DdlKind::Unspecified,
            None,
            &what,
        );
        return Ok(vec![(unnamed, false)]);
    };
    let mut events = Vec::new();
    for found in ddl::diff::diff(pinned, now) {
        let sides = (pinned, now, drift.xid.is_some());
        events.push(event(flow, sides, &table, &found, catalog).await?);
    }
    Ok(events)
}

/// A change no sink applies on its own: `why` names it, its decision and
/// the reason.
fn held_event(
    (before, now): (u64, &RelationSchema),
    kind: DdlKind,
    found: Option<&Detected>,
    why: &str,
) -> DdlEvent {
    DdlEvent {
        kind: kind as i32,
        relation_id: now.relation_id,
        command_tag: "ALTER TABLE".into(),
        statement: found.map_or_else(|| why.to_owned(), |f| f.what.clone()),
        fingerprint_before: before,
        fingerprint_after: now.fingerprint,
        column: found.and_then(|f| f.column.clone()).unwrap_or_default(),
        old_name: found.and_then(|f| f.old_name.clone()).unwrap_or_default(),
        held: why.to_owned(),
        ..DdlEvent::default()
    }
}

/// What changed between `pinned` (fingerprint `pinned_fingerprint`) and
/// `now` when no event said so (a path that propagates no schema change:
/// native capture), one line per change.
pub fn unexplained(
    pinned: Option<&RelationSchema>,
    pinned_fingerprint: u64,
    now: &RelationSchema,
) -> Vec<String> {
    match pinned {
        Some(pinned) => ddl::diff::diff(pinned, now)
            .into_iter()
            .map(|d| {
                format!(
                    "{}: {}",
                    d.kind.map_or("outside the eleven kinds", ddl::kind_name),
                    d.what
                )
            })
            .collect(),
        None => vec![format!(
            "pinned fingerprint {pinned_fingerprint:#018x}, the source now sends {:#018x} (the pinned description is not known, so the change cannot be named)",
            now.fingerprint
        )],
    }
}

/// The added column, waiting a little for its transaction to be visible:
/// a commit is decoded once its WAL is flushed, before the committing
/// session ends it (a synchronous standby's confirmation comes between).
/// Inside a streamed transaction one look: it may not have committed.
async fn added_when_visible<C: Catalog>(
    catalog: &mut C,
    relation_id: u32,
    column: &str,
    type_oid: u32,
    in_stream: bool,
) -> Result<Option<AddedColumn>, CatalogError> {
    let looks = if in_stream { 1 } else { 6 };
    for look in 0..looks {
        if let Some(added) = catalog.added(relation_id, column, type_oid).await? {
            return Ok(Some(added));
        }
        if look + 1 < looks {
            tokio::time::sleep(std::time::Duration::from_millis(250 << look.min(3))).await;
        }
    }
    Ok(None)
}

fn gone(what: &str) -> String {
    format!(
        "{what}: the source catalog no longer has it as sent (dropped or changed again since), manual-review"
    )
}

/// An added column's kind and fill as the catalog states them, or why it
/// holds.
fn judge(what: &str, added: &AddedColumn) -> Result<(DdlKind, Option<String>), String> {
    if added.not_null {
        return Ok((DdlKind::AddNotNullColumn, None));
    }
    if added.has_default && added.fill.is_none() {
        return Err(format!(
            "{what}: it has a default but no value for the rows before it: a volatile default rewrote the source table (values no event carries), or the default was set after the column was added; manual-review"
        ));
    }
    if added.array && added.fill.as_ref().is_some_and(Option::is_some) {
        return Err(format!(
            "{what}: an array column with a default for the rows before it, manual-review"
        ));
    }
    Ok((DdlKind::AddNullableColumn, added.fill.clone().flatten()))
}

/// The added columns of a streamed transaction's changes, read from the
/// catalog now that it committed: each event completed with its fill, or
/// marked held with why.
pub async fn complete<C: Catalog>(
    events: Vec<(String, DdlEvent)>,
    catalog: &mut C,
) -> Result<Vec<DdlEvent>, CatalogError> {
    let mut done = Vec::with_capacity(events.len());
    for (table, mut event) in events {
        let what = format!("column {} added to {table}", event.column);
        let held = match catalog
            .added_by_name(event.relation_id, &event.column)
            .await?
        {
            Some(added) if added.type_name != event.type_name => Some(gone(&what)),
            None => Some(gone(&what)),
            Some(added) => match judge(&what, &added) {
                Ok((DdlKind::AddNullableColumn, fill)) => {
                    event.fill = fill.map(|v| Value {
                        kind: Some(value::Kind::Text(v)),
                    });
                    None
                }
                Ok((kind, _)) => {
                    event.kind = kind as i32;
                    Some(format!(
                        "{what}: {}, block (destructive-or-ambiguous)",
                        ddl::kind_name(kind)
                    ))
                }
                Err(line) => Some(line),
            },
        };
        if let Some(held) = held {
            event.held = held;
        }
        done.push(event);
    }
    Ok(done)
}

/// One detected change as its event (and whether its fill waits for the
/// transaction's commit); marked held with why when no sink applies it.
async fn event<C: Catalog>(
    flow: &Flow,
    (pinned, now, in_stream): (&RelationSchema, &RelationSchema, bool),
    table: &str,
    found: &Detected,
    catalog: &mut C,
) -> Result<(DdlEvent, bool), CatalogError> {
    let on = match &found.column {
        Some(c) => format!("{table}.{}", trellara_common::table_name::display_ident(c)),
        None => table.to_owned(),
    };
    let held = |kind: DdlKind, why: String| {
        Ok((
            held_event((pinned.fingerprint, now), kind, Some(found), &why),
            false,
        ))
    };
    let Some(mut kind) = found.kind else {
        let why = format!("{}: outside the eleven kinds, manual-review", found.what);
        return held(DdlKind::Unspecified, why);
    };
    let column = found
        .column
        .as_ref()
        .and_then(|name| now.columns.iter().find(|c| &c.name == name));
    let mut fill = None;
    let mut type_name = String::new();
    let mut pending = false;
    if let (DdlKind::AddNullableColumn, Some(c)) = (kind, column) {
        match added_when_visible(catalog, now.relation_id, &c.name, c.type_oid, in_stream).await? {
            Some(added) => match judge(&found.what, &added) {
                Ok((k, f)) => {
                    (kind, fill) = (k, f);
                    type_name = added.type_name;
                }
                Err(line) => return held(kind, line),
            },
            // Inside a streamed transaction the column is not committed
            // yet: the catalog is read again at its commit.
            None if in_stream => {
                pending = true;
                type_name = catalog.type_name(c.type_oid).await?;
            }
            None => return held(kind, gone(&found.what)),
        }
    } else if let Some(c) = column {
        type_name = catalog.type_name(c.type_oid).await?;
    }
    let change = Change {
        kind,
        table: table.to_owned(),
        column: found.column.clone(),
    };
    let contract = ddl::plan(flow, &change, None);
    if contract.decision != Decision::AutoApply.as_str() {
        let staged = flow.schema.apply_mode == ApplyMode::Staged
            && contract.decision == Decision::StageThenApply.as_str();
        let why = format!(
            "{} on {on}: {} ({}){}",
            ddl::kind_name(kind),
            contract.decision,
            contract.reason,
            if staged {
                "; stage-then-apply is not built yet: hold"
            } else {
                ""
            }
        );
        return held(kind, why);
    }
    let statement = match (kind, column) {
        (DdlKind::AddNullableColumn, Some(c)) => format!(
            "ALTER TABLE {} ADD COLUMN {} {}{}",
            TableName::new(&now.namespace, &now.name).quoted(),
            postgres_protocol::escape::escape_identifier(&c.name),
            type_name,
            fill.as_ref()
                .map(|v| format!(" DEFAULT {}", postgres_protocol::escape::escape_literal(v)))
                .unwrap_or_default()
        ),
        (_, Some(c)) => format!(
            "ALTER TABLE {} ALTER COLUMN {} TYPE {type_name} (modifier {})",
            TableName::new(&now.namespace, &now.name).quoted(),
            postgres_protocol::escape::escape_identifier(&c.name),
            c.type_modifier
        ),
        (_, None) => found.what.clone(),
    };
    Ok((
        DdlEvent {
            kind: kind as i32,
            relation_id: now.relation_id,
            command_tag: "ALTER TABLE".into(),
            statement,
            fingerprint_before: pinned.fingerprint,
            fingerprint_after: now.fingerprint,
            column: found.column.clone().unwrap_or_default(),
            type_name,
            type_modifier: column.map_or(-1, |c| c.type_modifier),
            fill: fill.map(|v| Value {
                kind: Some(value::Kind::Text(v)),
            }),
            old_name: found.old_name.clone().unwrap_or_default(),
            held: String::new(),
        },
        pending,
    ))
}
