//! Schema contracts: how a source schema change is classified, decided
//! and propagated (docs/SCHEMA.md).
//!
//! A change is one of the eleven [`DdlKind`]s on one table (and column).
//! It is classified on three independent axes:
//!
//! ```text
//!  kind + where it lands (the flow's table? a mapping? the policy)
//!      ─▶ compatibility: compatible | requires-mapping | destructive-or-ambiguous | blocked-by-policy
//!  compatibility + the apply mode asked for (auto | staged | manual)
//!      ─▶ decision: auto-apply | stage-then-apply | manual-review | block
//! ```
//!
//! Invariants:
//! * Only add_nullable_column, widen_type and increase_varchar are ever
//!   compatible, and only on a table the flow replicates; add_table joins
//!   them only under `unknown_table_policy: allow_compatible`.
//! * Destructive or ambiguous kinds (drops, narrowing, a NOT NULL column,
//!   a key change) and anything the policy blocks are `block` in every mode.
//! * A rename is `requires-mapping`: without its mapping in config it is
//!   `manual-review` in every mode.
//! * The mode only ever makes a decision more careful, never less:
//!   auto ≤ staged ≤ manual.
//!
//! The contract is computed from the config alone: planning touches no
//! database.

pub mod diff;

use crate::config::{ApplyMode, Flow, UnknownTablePolicy};
use crate::envelope::DdlKind;
use serde::Serialize;

/// The eleven kinds, by the name the CLI and docs use.
pub const KINDS: [(&str, DdlKind); 11] = [
    ("add_table", DdlKind::AddTable),
    ("add_nullable_column", DdlKind::AddNullableColumn),
    ("add_not_null_column", DdlKind::AddNotNullColumn),
    ("drop_column", DdlKind::DropColumn),
    ("rename_column", DdlKind::RenameColumn),
    ("widen_type", DdlKind::WidenType),
    ("narrow_type", DdlKind::NarrowType),
    ("increase_varchar", DdlKind::IncreaseVarchar),
    ("drop_table", DdlKind::DropTable),
    ("rename_table", DdlKind::RenameTable),
    ("key_change", DdlKind::KeyChange),
];

/// The CLI and docs name of `kind`.
pub fn kind_name(kind: DdlKind) -> &'static str {
    KINDS
        .iter()
        .find(|(_, k)| *k == kind)
        .map_or("unspecified", |(n, _)| n)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Compatibility {
    Compatible,
    RequiresMapping,
    DestructiveOrAmbiguous,
    BlockedByPolicy,
}

/// In order of care: each later one holds post-change rows longer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    AutoApply,
    StageThenApply,
    ManualReview,
    Block,
}

impl Compatibility {
    pub fn as_str(self) -> &'static str {
        match self {
            Compatibility::Compatible => "compatible",
            Compatibility::RequiresMapping => "requires-mapping",
            Compatibility::DestructiveOrAmbiguous => "destructive-or-ambiguous",
            Compatibility::BlockedByPolicy => "blocked-by-policy",
        }
    }
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::AutoApply => "auto-apply",
            Decision::StageThenApply => "stage-then-apply",
            Decision::ManualReview => "manual-review",
            Decision::Block => "block",
        }
    }
}

/// One change: its kind, the table it lands on, and the column for the
/// column kinds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub kind: DdlKind,
    /// `schema.table` as the config spells it.
    pub table: String,
    pub column: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ChangeError {
    #[error(
        "--change {0:?} is not KIND:schema.table[.column]\nhint: for example add_nullable_column:public.orders.note"
    )]
    Shape(String),
    #[error(
        "--change kind {kind:?} is not one of the eleven kinds\nhint: one of {}",
        kind_names()
    )]
    Kind { kind: String },
    #[error(
        "--change {change:?}: {problem}\nhint: write the table as SQL does: public.orders, or public.\"Orders\" for a mixed-case name"
    )]
    Table { change: String, problem: String },
    #[error("--change {change:?}: {kind} names a column\nhint: {kind}:{table}.COLUMN")]
    NoColumn {
        change: String,
        kind: &'static str,
        table: String,
    },
    #[error(
        "--change {change:?}: {kind} is a change of the whole table, not of a column\nhint: {kind}:{table}"
    )]
    Column {
        change: String,
        kind: &'static str,
        table: String,
    },
}

fn kind_names() -> String {
    KINDS.map(|(n, _)| n).join(", ")
}

/// Whether `kind` changes a column (and so names one).
fn of_column(kind: DdlKind) -> bool {
    matches!(
        kind,
        DdlKind::AddNullableColumn
            | DdlKind::AddNotNullColumn
            | DdlKind::DropColumn
            | DdlKind::RenameColumn
            | DdlKind::WidenType
            | DdlKind::NarrowType
            | DdlKind::IncreaseVarchar
    )
}

impl std::str::FromStr for Change {
    type Err = ChangeError;

    /// `KIND:schema.table[.column]`, names as SQL spells them.
    fn from_str(text: &str) -> Result<Self, ChangeError> {
        let (kind, target) = text
            .split_once(':')
            .ok_or_else(|| ChangeError::Shape(text.to_owned()))?;
        let kind = KINDS
            .iter()
            .find(|(n, _)| *n == kind)
            .map(|(_, k)| *k)
            .ok_or_else(|| ChangeError::Kind {
                kind: kind.to_owned(),
            })?;
        let dots = unquoted_dots(target);
        let (table, column) = match dots.as_slice() {
            [_] => (target, None),
            [_, last] => (&target[..*last], Some(&target[last + 1..])),
            _ => return Err(ChangeError::Shape(text.to_owned())),
        };
        let table = crate::table_name::TableName::parse(table)
            .map_err(|e| ChangeError::Table {
                change: text.to_owned(),
                problem: e.to_string(),
            })?
            .to_string();
        let column = column.map(identifier);
        let name = kind_name(kind);
        match (of_column(kind), &column) {
            (true, None) => Err(ChangeError::NoColumn {
                change: text.to_owned(),
                kind: name,
                table,
            }),
            (false, Some(_)) => Err(ChangeError::Column {
                change: text.to_owned(),
                kind: name,
                table,
            }),
            _ => Ok(Change {
                kind,
                table,
                column,
            }),
        }
    }
}

/// Byte offsets of the dots outside double quotes.
fn unquoted_dots(text: &str) -> Vec<usize> {
    let mut quoted = false;
    text.char_indices()
        .filter_map(|(i, c)| {
            if c == '"' {
                quoted = !quoted;
            }
            (c == '.' && !quoted).then_some(i)
        })
        .collect()
}

/// A column name as SQL reads it: quoted as written, unquoted folded.
fn identifier(text: &str) -> String {
    match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(quoted) => quoted.replace("\"\"", "\""),
        None => text.to_lowercase(),
    }
}

/// What a change's propagation looks like, before anything happens.
#[derive(Debug, Clone, Serialize)]
pub struct Contract {
    pub flow: String,
    pub kind: &'static str,
    pub table: String,
    pub column: Option<String>,
    pub apply_mode: &'static str,
    pub compatibility: &'static str,
    pub decision: &'static str,
    /// Why this compatibility and decision.
    pub reason: String,
    /// Stable for the flow, kind, table and column; a live change's
    /// barrier adds its commit LSN.
    pub barrier_id: String,
    pub affected_sinks: Vec<String>,
    /// In order.
    pub phases: Vec<String>,
    /// What each affected sink acknowledges before its post-change rows
    /// are released.
    pub acknowledgement: Vec<Acknowledgement>,
    /// How long post-change rows stay invisible on the sinks.
    pub visibility_pause: String,
    /// What the operator does, when the decision holds the change.
    pub fix: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Acknowledgement {
    pub sink: String,
    pub acknowledges: String,
}

/// The compatibility of `change` on `flow`, and why.
pub fn classify(flow: &Flow, change: &Change) -> (Compatibility, String) {
    let replicated = flow.tables.contains(&change.table);
    let policy = flow.schema.unknown_table_policy;
    match change.kind {
        DdlKind::AddTable if replicated => (
            Compatibility::BlockedByPolicy,
            format!("{} is already one of the flow's tables", change.table),
        ),
        DdlKind::AddTable => match policy {
            UnknownTablePolicy::AllowCompatible => (
                Compatibility::Compatible,
                "a new table under unknown_table_policy: allow_compatible".into(),
            ),
            other => (
                Compatibility::BlockedByPolicy,
                format!(
                    "unknown_table_policy is {}: a table the config does not list is {}",
                    other.as_str(),
                    match other {
                        UnknownTablePolicy::Ignore => "not replicated",
                        _ => "held for review",
                    }
                ),
            ),
        },
        _ if !replicated => (
            Compatibility::BlockedByPolicy,
            format!(
                "{} is not one of the flow's tables (flows[].tables)",
                change.table
            ),
        ),
        DdlKind::AddNullableColumn | DdlKind::WidenType | DdlKind::IncreaseVarchar => (
            Compatibility::Compatible,
            "every existing row and reader stays valid on the target".into(),
        ),
        DdlKind::RenameColumn | DdlKind::RenameTable => (
            Compatibility::RequiresMapping,
            match mapping(flow, change) {
                Some(to) => format!("mapped in schema.rename to {to}"),
                None => "a rename looks like a drop and an add: only an explicit mapping in schema.rename says which".into(),
            },
        ),
        DdlKind::AddNotNullColumn => (
            Compatibility::DestructiveOrAmbiguous,
            "existing target rows have no value for a NOT NULL column".into(),
        ),
        DdlKind::DropColumn | DdlKind::DropTable => (
            Compatibility::DestructiveOrAmbiguous,
            "a drop destroys target data".into(),
        ),
        DdlKind::NarrowType => (
            Compatibility::DestructiveOrAmbiguous,
            "a narrower type may not hold the values the target has".into(),
        ),
        DdlKind::KeyChange => (
            Compatibility::DestructiveOrAmbiguous,
            "the key identifies rows for every update and delete".into(),
        ),
        DdlKind::Unspecified => (
            Compatibility::DestructiveOrAmbiguous,
            "an unknown kind".into(),
        ),
    }
}

/// The rename `change` is mapped to in `schema.rename`, if any.
fn mapping<'f>(flow: &'f Flow, change: &Change) -> Option<&'f str> {
    let from = match &change.column {
        Some(column) => format!("{}.{column}", change.table),
        None => change.table.clone(),
    };
    flow.schema.rename.get(&from).map(String::as_str)
}

/// The decision for `compatibility` under `mode` (`mapped`: a rename's
/// mapping is in the config).
pub fn decide(compatibility: Compatibility, mapped: bool, mode: ApplyMode) -> Decision {
    let by_mode = match mode {
        ApplyMode::Auto => Decision::AutoApply,
        ApplyMode::Staged => Decision::StageThenApply,
        ApplyMode::Manual => Decision::ManualReview,
    };
    match compatibility {
        Compatibility::Compatible => by_mode,
        // A rename changes what readers query: staged even in auto.
        Compatibility::RequiresMapping if mapped => by_mode.max(Decision::StageThenApply),
        Compatibility::RequiresMapping => Decision::ManualReview,
        Compatibility::DestructiveOrAmbiguous | Compatibility::BlockedByPolicy => Decision::Block,
    }
}

/// The propagation contract of `change` on `flow` under `mode` (the
/// flow's `schema.apply_mode` unless given).
pub fn plan(flow: &Flow, change: &Change, mode: Option<ApplyMode>) -> Contract {
    let mode = mode.unwrap_or(flow.schema.apply_mode);
    let (compatibility, reason) = classify(flow, change);
    let mapped = mapping(flow, change);
    let decision = decide(compatibility, mapped.is_some(), mode);
    let kind = kind_name(change.kind);
    let target = match &change.column {
        Some(c) => format!("{}.{c}", change.table),
        None => change.table.clone(),
    };
    let barrier_id = barrier_id(&flow.name, change);
    // A table the flow does not replicate reaches no sink, so its change
    // holds none; only a new one's arrival is the policy's to decide.
    let policy_decides = change.kind == DdlKind::AddTable
        && flow.schema.unknown_table_policy != UnknownTablePolicy::Ignore;
    let ignored = !(flow.tables.contains(&change.table) || policy_decides);
    let sinks: Vec<String> = if ignored {
        Vec::new()
    } else {
        flow.sinks().iter().map(|s| s.name.to_owned()).collect()
    };
    let statement = statement(change, mapped);
    let (phases, acknowledges, pause, fix) = match decision {
        Decision::AutoApply => (
            vec![
                format!(
                    "barrier {barrier_id} at the change's commit: the table's later rows wait behind it on each sink"
                ),
                format!(
                    "each sink applies `{statement}` in the same target transaction as its first rows under the new schema, and re-pins the table's fingerprint there"
                ),
                "each sink records its acknowledgement in that transaction".into(),
                "the rows are visible with the change, in one commit".into(),
            ],
            "the change applied and the fingerprint re-pinned, in the commit of its first post-change rows",
            "none: the change and its first rows commit together".to_owned(),
            Vec::new(),
        ),
        Decision::StageThenApply => (
            vec![
                format!(
                    "barrier {barrier_id} at the change's commit: the table's later rows wait behind it on each sink"
                ),
                format!(
                    "each sink applies `{statement}` in a transaction of its own and records its acknowledgement"
                ),
                "once every affected sink acknowledged, each releases the rows after the barrier"
                    .into(),
            ],
            "the change applied on its target (its own transaction)",
            "until every affected sink has acknowledged".to_owned(),
            Vec::new(),
        ),
        Decision::ManualReview | Decision::Block => {
            let mut fix = Vec::new();
            if compatibility == Compatibility::RequiresMapping && mapped.is_none() {
                fix.push(format!(
                    "map the rename in flows[{}].schema.rename ({target}: NEW_NAME), then the change is staged",
                    flow.name
                ));
            }
            if !ignored {
                fix.push(format!(
                    "apply the change on each sink's target yourself, then `trellara schema accept --flow {} --table {}`",
                    flow.name, change.table
                ));
                if flow.tables.contains(&change.table) {
                    fix.push(format!(
                        "or copy the table again at its own boundary: `trellara reseed --flow {} --table {}`",
                        flow.name, change.table
                    ));
                }
            }
            let phases = if ignored {
                vec![format!(
                    "{} is not replicated: its rows reach no sink, and the flow goes on",
                    change.table
                )]
            } else {
                vec![
                    format!("barrier {barrier_id} at the change's commit: that transaction is quarantined on each sink, which holds there"),
                    "capture goes on logging, so the source's slot follows the log and its disk is not held; other flows and sinks go on".into(),
                    "after the fix, each sink replays from the change".into(),
                ]
            };
            (
                phases,
                "the operator's fix (schema accept, or the table's reseed)",
                if ignored {
                    "none: no sink receives the table".to_owned()
                } else {
                    "until the fix on each sink".to_owned()
                },
                fix,
            )
        }
    };
    Contract {
        flow: flow.name.clone(),
        kind,
        table: change.table.clone(),
        column: change.column.clone(),
        apply_mode: mode.as_str(),
        compatibility: compatibility.as_str(),
        decision: decision.as_str(),
        reason,
        barrier_id,
        acknowledgement: sinks
            .iter()
            .map(|s| Acknowledgement {
                sink: s.clone(),
                acknowledges: acknowledges.to_owned(),
            })
            .collect(),
        affected_sinks: sinks,
        phases,
        visibility_pause: pause,
        fix,
    }
}

/// The barrier id of `change` on flow `flow`: stable for the flow, kind,
/// table and column (a live change's barrier adds `@` and its commit LSN).
pub fn barrier_id(flow: &str, change: &Change) -> String {
    let kind = kind_name(change.kind);
    let target = match &change.column {
        Some(c) => format!("{}.{c}", change.table),
        None => change.table.clone(),
    };
    format!(
        "ddl-{:016x}",
        xxhash_rust::xxh3::xxh3_64(format!("{flow}\0{kind}\0{target}").as_bytes())
    )
}

/// The target-side statement a change stands for, in outline.
fn statement(change: &Change, mapped: Option<&str>) -> String {
    let table = &change.table;
    let column = change.column.as_deref().unwrap_or("COLUMN");
    match change.kind {
        DdlKind::AddTable => format!("CREATE TABLE {table} (...) from the source catalog"),
        DdlKind::AddNullableColumn => {
            format!("ALTER TABLE {table} ADD COLUMN {column} TYPE [DEFAULT as on the source]")
        }
        DdlKind::WidenType | DdlKind::IncreaseVarchar | DdlKind::NarrowType => {
            format!("ALTER TABLE {table} ALTER COLUMN {column} TYPE the source's")
        }
        DdlKind::RenameColumn => format!(
            "ALTER TABLE {table} RENAME COLUMN {column} TO {}",
            mapped.unwrap_or("NEW_NAME")
        ),
        DdlKind::RenameTable => format!(
            "ALTER TABLE {table} RENAME TO {}",
            mapped.unwrap_or("NEW_NAME")
        ),
        DdlKind::AddNotNullColumn => {
            format!("ALTER TABLE {table} ADD COLUMN {column} ... NOT NULL")
        }
        DdlKind::DropColumn => format!("ALTER TABLE {table} DROP COLUMN {column}"),
        DdlKind::DropTable => format!("DROP TABLE {table}"),
        DdlKind::KeyChange | DdlKind::Unspecified => format!("the key change on {table}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn flow(extra: &str) -> Flow {
        let text = format!(
            "schema_version: 2\nflows:\n  - name: shop\n    source: {{url: postgresql://s/db}}\n    target: {{url: postgresql://t/db}}\n    tables: [public.orders]\n{extra}"
        );
        let config: Config = serde_yaml_ng::from_str(&text).expect("config");
        config.flows[0].clone()
    }

    fn change(text: &str) -> Change {
        text.parse().expect("a change")
    }

    const MODES: [ApplyMode; 3] = [ApplyMode::Auto, ApplyMode::Staged, ApplyMode::Manual];

    #[test]
    fn only_three_kinds_are_ever_compatible_and_only_on_the_flows_tables() {
        let f = flow("    schema: {unknown_table_policy: block}\n");
        for (name, kind) in KINDS {
            let on_column = of_column(kind);
            for table in ["public.orders", "public.other"] {
                let text = if on_column {
                    format!("{name}:{table}.c")
                } else {
                    format!("{name}:{table}")
                };
                let (compatibility, _) = classify(&f, &change(&text));
                let expect_compatible = table == "public.orders"
                    && matches!(
                        kind,
                        DdlKind::AddNullableColumn | DdlKind::WidenType | DdlKind::IncreaseVarchar
                    );
                assert_eq!(
                    compatibility == Compatibility::Compatible,
                    expect_compatible,
                    "{text}: {compatibility:?}"
                );
            }
        }
    }

    #[test]
    fn destructive_kinds_are_blocked_in_every_mode() {
        let f = flow("");
        for text in [
            "drop_column:public.orders.c",
            "narrow_type:public.orders.c",
            "add_not_null_column:public.orders.c",
            "key_change:public.orders",
            "drop_table:public.orders",
        ] {
            for mode in MODES {
                let c = plan(&f, &change(text), Some(mode));
                assert_eq!(
                    (c.compatibility, c.decision),
                    ("destructive-or-ambiguous", "block"),
                    "{text} under {mode:?}"
                );
                assert!(
                    c.fix
                        .iter()
                        .any(|f| f.contains("reseed --flow shop --table public.orders"))
                );
            }
        }
    }

    #[test]
    fn a_compatible_change_follows_the_mode() {
        let f = flow("");
        let decisions: Vec<&str> = MODES
            .map(|m| {
                plan(
                    &f,
                    &change("add_nullable_column:public.orders.note"),
                    Some(m),
                )
                .decision
            })
            .to_vec();
        assert_eq!(
            decisions,
            ["auto-apply", "stage-then-apply", "manual-review"]
        );
        // The config's mode when none is given.
        let staged = flow("    schema: {apply_mode: staged}\n");
        let c = plan(&staged, &change("widen_type:public.orders.total"), None);
        assert_eq!((c.apply_mode, c.decision), ("staged", "stage-then-apply"));
        assert_eq!(c.affected_sinks, ["shop"]);
        assert_eq!(c.acknowledgement.len(), 1);
        assert!(c.visibility_pause.contains("every affected sink"));
    }

    #[test]
    fn a_rename_needs_its_mapping() {
        let unmapped = flow("");
        for mode in MODES {
            let c = plan(
                &unmapped,
                &change("rename_column:public.orders.cust"),
                Some(mode),
            );
            assert_eq!(
                (c.compatibility, c.decision),
                ("requires-mapping", "manual-review")
            );
            assert!(c.fix[0].contains("schema.rename"), "{:?}", c.fix);
        }
        let mapped = flow("    schema: {rename: {public.orders.cust: customer}}\n");
        let decisions: Vec<&str> = MODES
            .map(|m| {
                plan(
                    &mapped,
                    &change("rename_column:public.orders.cust"),
                    Some(m),
                )
                .decision
            })
            .to_vec();
        assert_eq!(
            decisions,
            ["stage-then-apply", "stage-then-apply", "manual-review"]
        );
    }

    #[test]
    fn a_new_table_is_compatible_only_under_allow_compatible() {
        let by_policy = |policy: &str| {
            let f = flow(&format!("    schema: {{unknown_table_policy: {policy}}}\n"));
            let c = plan(&f, &change("add_table:public.fresh"), Some(ApplyMode::Auto));
            (c.compatibility, c.decision, c.affected_sinks.len())
        };
        assert_eq!(
            by_policy("allow_compatible"),
            ("compatible", "auto-apply", 1)
        );
        assert_eq!(by_policy("block"), ("blocked-by-policy", "block", 1));
        // Ignored: it reaches no sink, and nothing holds.
        assert_eq!(by_policy("ignore"), ("blocked-by-policy", "block", 0));
    }

    #[test]
    fn the_mode_never_loosens_a_decision() {
        let f = flow("    schema: {rename: {public.orders.a: b}}\n");
        for (name, kind) in KINDS {
            let text = if of_column(kind) {
                format!("{name}:public.orders.a")
            } else {
                format!("{name}:public.orders")
            };
            let order: Vec<Decision> = MODES
                .map(|m| {
                    let (c, _) = classify(&f, &change(&text));
                    decide(c, mapping(&f, &change(&text)).is_some(), m)
                })
                .to_vec();
            assert!(order.windows(2).all(|w| w[0] <= w[1]), "{text}: {order:?}");
        }
    }

    #[test]
    fn a_change_is_parsed_as_sql_spells_it_or_refused_with_the_fix() {
        assert_eq!(
            change("add_nullable_column:public.\"Orders\".\"Note.x\""),
            Change {
                kind: DdlKind::AddNullableColumn,
                table: "public.\"Orders\"".into(),
                column: Some("Note.x".into()),
            }
        );
        assert_eq!(change("drop_table:Public.Orders").table, "public.orders");
        let err = |t: &str| t.parse::<Change>().expect_err(t).to_string();
        assert!(err("add_column:public.t.c").contains("one of add_table, add_nullable_column"));
        assert!(err("public.t").contains("KIND:schema.table[.column]"));
        assert!(err("drop_column:public.t").contains("drop_column:public.t.COLUMN"));
        assert!(err("drop_table:public.t.c").contains("drop_table:public.t"));
    }

    /// docs/SCHEMA.md's decision table, rendered from [`plan`]: every
    /// kind, where it lands, and its decision under each mode.
    fn decision_table() -> String {
        let mut rows = vec![
            "| kind | on | compatibility | auto | staged | manual | reaches |".to_owned(),
            "|---|---|---|---|---|---|---|".to_owned(),
        ];
        let mut row = |kind: &str, on: &str, f: &Flow, text: &str| {
            let c: Vec<Contract> = MODES.map(|m| plan(f, &change(text), Some(m))).to_vec();
            let held = if c[0].affected_sinks.is_empty() {
                "no: not replicated, nothing held"
            } else {
                "every sink"
            };
            rows.push(format!(
                "| {kind} | {on} | {} | {} | {} | {} | {held} |",
                c[0].compatibility, c[0].decision, c[1].decision, c[2].decision
            ));
        };
        let plain = flow("");
        let mapped =
            flow("    schema: {rename: {public.orders.a: b, public.orders: public.sales}}\n");
        for (name, kind) in KINDS {
            let at = |table: &str| {
                if of_column(kind) {
                    format!("{name}:{table}.a")
                } else {
                    format!("{name}:{table}")
                }
            };
            if kind == DdlKind::AddTable {
                for policy in ["ignore", "allow_compatible", "block"] {
                    let f = flow(&format!("    schema: {{unknown_table_policy: {policy}}}\n"));
                    row(
                        name,
                        &format!("a table not in flows[].tables, unknown_table_policy: {policy}"),
                        &f,
                        &at("public.fresh"),
                    );
                }
                row(
                    name,
                    "a table already in flows[].tables",
                    &plain,
                    &at("public.orders"),
                );
                continue;
            }
            if matches!(kind, DdlKind::RenameColumn | DdlKind::RenameTable) {
                row(
                    name,
                    "a flow table, mapped in schema.rename",
                    &mapped,
                    &at("public.orders"),
                );
                row(
                    name,
                    "a flow table, no mapping",
                    &plain,
                    &at("public.orders"),
                );
            } else {
                row(name, "a flow table", &plain, &at("public.orders"));
            }
            row(
                name,
                "a table not in flows[].tables",
                &plain,
                &at("public.other"),
            );
        }
        rows.join("\n")
    }

    #[test]
    fn docs_schema_md_holds_the_decision_table_as_the_code_decides() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/SCHEMA.md");
        let doc = std::fs::read_to_string(path).expect("docs/SCHEMA.md");
        let table = decision_table();
        assert!(
            doc.contains(&table),
            "docs/SCHEMA.md's decision table is not what the code decides; put this there:\n{table}"
        );
    }

    #[test]
    fn the_barrier_id_is_stable_and_names_the_change() {
        let f = flow("");
        let a = plan(&f, &change("widen_type:public.orders.total"), None);
        let b = plan(
            &f,
            &change("widen_type:public.orders.total"),
            Some(ApplyMode::Manual),
        );
        let c = plan(&f, &change("widen_type:public.orders.qty"), None);
        assert_eq!(a.barrier_id, b.barrier_id);
        assert_ne!(a.barrier_id, c.barrier_id);
    }
}
