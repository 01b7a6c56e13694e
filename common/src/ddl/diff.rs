//! Detection: what changed between a relation's pinned description and
//! the one the source sends now, as [`DdlKind`]s.
//!
//! A pgoutput Relation message carries the relation's id, name, namespace,
//! replica identity and, per column, its name, type, modifier and key
//! flag. That is all a diff can see: NOT NULL, defaults, constraints, enum
//! values and domains are invisible here (capture reads the catalog for
//! an added column), and a change shows only with the table's next row.
//!
//! Invariants:
//! * Nothing is silent: a difference that none of the eleven kinds
//!   explains (a type change that neither widens nor narrows, a column
//!   dropped and added again under its name) is reported with no kind,
//!   which the contract treats as manual review.
//! * A column rename is told from a drop and an add only when one column
//!   left and one arrived at the same position with the same type and key.

use crate::envelope::{ColumnSchema, DdlKind, RelationSchema, ReplicaIdentity};
use crate::table_name::TableName;

/// One difference between two descriptions of a relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Detected {
    /// `None`: outside the eleven kinds (manual review, never silence).
    pub kind: Option<DdlKind>,
    /// The column a column change is about: its new name (a drop: its old).
    pub column: Option<String>,
    /// A rename's old name (a table's as `schema.table`).
    pub old_name: Option<String>,
    /// What changed, in words, for the quarantine record and the log.
    pub what: String,
}

const INT2: u32 = 21;
const INT4: u32 = 23;
const INT8: u32 = 20;
const FLOAT4: u32 = 700;
const FLOAT8: u32 = 701;
const NUMERIC: u32 = 1700;
const TEXT: u32 = 25;
const VARCHAR: u32 = 1043;
const TIME_TYPES: [u32; 4] = [1083, 1266, 1114, 1184];

/// Digits before the point a numeric modifier allows (`None`: unbounded),
/// and its scale.
fn numeric_shape(modifier: i32) -> Option<(i32, i32)> {
    (modifier >= 4).then(|| {
        let m = modifier - 4;
        ((m >> 16) - (m & 0xffff), m & 0xffff)
    })
}

/// Integer digits an integer type needs.
fn integer_digits(oid: u32) -> Option<i32> {
    match oid {
        INT2 => Some(5),
        INT4 => Some(10),
        INT8 => Some(19),
        _ => None,
    }
}

/// The kind of a column's type change, `None` when it is none of them.
/// Widening: every old value has exactly one new value and reads back the
/// same (a longer varchar is its own kind). Narrowing: some old value may
/// not fit.
pub fn type_change(old: &ColumnSchema, new: &ColumnSchema) -> Option<DdlKind> {
    use DdlKind::{IncreaseVarchar, NarrowType, WidenType};
    let (from, to) = (old.type_oid, new.type_oid);
    let (fm, tm) = (old.type_modifier, new.type_modifier);
    let rank = |oid| [INT2, INT4, INT8].iter().position(|&o| o == oid);
    match (from, to) {
        _ if from == to && fm == tm => None,
        (VARCHAR, VARCHAR) if tm < 0 || (fm >= 0 && tm > fm) => Some(IncreaseVarchar),
        (VARCHAR, VARCHAR) => Some(NarrowType),
        (VARCHAR, TEXT) => Some(WidenType),
        (TEXT, VARCHAR) if tm < 0 => Some(WidenType),
        (TEXT, VARCHAR) => Some(NarrowType),
        (NUMERIC, NUMERIC) => match (numeric_shape(fm), numeric_shape(tm)) {
            (_, None) => Some(WidenType),
            (None, Some(_)) => Some(NarrowType),
            // Another scale rewrites every value's text form (1.5 -> 1.50).
            (Some((_, fs)), Some((_, ts))) if fs != ts => None,
            (Some((fd, _)), Some((td, _))) if td >= fd => Some(WidenType),
            _ => Some(NarrowType),
        },
        (f, t) if f == t && TIME_TYPES.contains(&f) => {
            if tm < 0 || (fm >= 0 && tm > fm) {
                Some(WidenType)
            } else {
                Some(NarrowType)
            }
        }
        (f, t) if rank(f).is_some() && rank(t).is_some() => {
            if rank(t) > rank(f) {
                Some(WidenType)
            } else {
                Some(NarrowType)
            }
        }
        (f, NUMERIC) if integer_digits(f).is_some() => match numeric_shape(tm) {
            None => Some(WidenType),
            Some((digits, _)) if Some(digits) >= integer_digits(f) => Some(WidenType),
            Some(_) => Some(NarrowType),
        },
        (NUMERIC, t) if integer_digits(t).is_some() => Some(NarrowType),
        (FLOAT4, FLOAT8) | (INT2 | INT4, FLOAT8) | (INT2, FLOAT4) => Some(WidenType),
        (FLOAT8, FLOAT4) | (INT8, FLOAT8) | (INT4 | INT8, FLOAT4) => Some(NarrowType),
        _ => None,
    }
}

fn column_list(relation: &RelationSchema) -> String {
    relation
        .columns
        .iter()
        .map(|c| c.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every difference from `old` to `new` (two descriptions of one relation
/// id), in the order: table, key, columns.
pub fn diff(old: &RelationSchema, new: &RelationSchema) -> Vec<Detected> {
    let table = |r: &RelationSchema| TableName::new(&r.namespace, &r.name).to_string();
    let mut found = Vec::new();
    if (old.namespace.as_str(), old.name.as_str()) != (new.namespace.as_str(), new.name.as_str()) {
        found.push(Detected {
            kind: Some(DdlKind::RenameTable),
            column: None,
            old_name: Some(table(old)),
            what: format!("table {} renamed to {}", table(old), table(new)),
        });
    }
    let find = |r: &'_ RelationSchema, name: &str| r.columns.iter().position(|c| c.name == name);
    let gone: Vec<usize> = (0..old.columns.len())
        .filter(|&i| find(new, &old.columns[i].name).is_none())
        .collect();
    let came: Vec<usize> = (0..new.columns.len())
        .filter(|&i| find(old, &new.columns[i].name).is_none())
        .collect();
    let renamed = match (gone.as_slice(), came.as_slice()) {
        ([g], [c])
            if g == c
                && (
                    old.columns[*g].type_oid,
                    old.columns[*g].type_modifier,
                    old.columns[*g].key,
                ) == (
                    new.columns[*c].type_oid,
                    new.columns[*c].type_modifier,
                    new.columns[*c].key,
                ) =>
        {
            Some((*g, *c))
        }
        _ => None,
    };
    let keys = |r: &RelationSchema, renamed_to: Option<(&str, &str)>| {
        let mut keys: Vec<String> = r
            .columns
            .iter()
            .filter(|c| c.key)
            .map(|c| match renamed_to {
                Some((from, to)) if c.name == from => to.to_owned(),
                _ => c.name.clone(),
            })
            .collect();
        keys.sort();
        keys
    };
    let rename_names =
        renamed.map(|(g, c)| (old.columns[g].name.as_str(), new.columns[c].name.as_str()));
    // Under FULL every column is a key column: the key set follows the
    // column list, and only a change of identity itself is a key change.
    let full = ReplicaIdentity::Full as i32;
    let both_full = old.replica_identity == full && new.replica_identity == full;
    if old.replica_identity != new.replica_identity
        || (!both_full && keys(old, rename_names) != keys(new, None))
    {
        found.push(Detected {
            kind: Some(DdlKind::KeyChange),
            column: None,
            old_name: None,
            what: format!(
                "replica identity key of {} changed: ({}) -> ({})",
                table(new),
                keys(old, None).join(", "),
                keys(new, None).join(", ")
            ),
        });
    }
    if let Some((g, c)) = renamed {
        found.push(Detected {
            kind: Some(DdlKind::RenameColumn),
            column: Some(new.columns[c].name.clone()),
            old_name: Some(old.columns[g].name.clone()),
            what: format!(
                "column {} of {} renamed to {}",
                old.columns[g].name,
                table(new),
                new.columns[c].name
            ),
        });
    } else {
        for &g in &gone {
            found.push(Detected {
                kind: Some(DdlKind::DropColumn),
                column: Some(old.columns[g].name.clone()),
                old_name: None,
                what: format!("column {} of {} dropped", old.columns[g].name, table(new)),
            });
        }
        for &c in &came {
            found.push(Detected {
                kind: Some(DdlKind::AddNullableColumn),
                column: Some(new.columns[c].name.clone()),
                old_name: None,
                what: format!("column {} added to {}", new.columns[c].name, table(new)),
            });
        }
    }
    // Columns in both: the same order, or one was dropped and added again
    // under its name (its values are gone on the source).
    let kept_old: Vec<&str> = old
        .columns
        .iter()
        .map(|c| c.name.as_str())
        .filter(|n| find(new, n).is_some())
        .collect();
    let kept_new: Vec<&str> = new
        .columns
        .iter()
        .map(|c| c.name.as_str())
        .filter(|n| find(old, n).is_some())
        .collect();
    if kept_old != kept_new {
        found.push(Detected {
            kind: None,
            column: None,
            old_name: None,
            what: format!(
                "columns of {} reordered ({}) -> ({}): a column was dropped and added again under its name",
                table(new),
                column_list(old),
                column_list(new)
            ),
        });
        return found;
    }
    for column in &new.columns {
        let Some(before) = find(old, &column.name).map(|i| &old.columns[i]) else {
            continue;
        };
        if (before.type_oid, before.type_modifier) == (column.type_oid, column.type_modifier) {
            continue;
        }
        let kind = type_change(before, column);
        found.push(Detected {
            kind,
            column: Some(column.name.clone()),
            old_name: None,
            what: format!(
                "column {} of {} changed type (oid {} modifier {} -> oid {} modifier {}){}",
                column.name,
                table(new),
                before.type_oid,
                before.type_modifier,
                column.type_oid,
                column.type_modifier,
                if kind.is_none() {
                    ": neither a widening nor a narrowing"
                } else {
                    ""
                }
            ),
        });
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(name: &str, type_oid: u32, type_modifier: i32, key: bool) -> ColumnSchema {
        ColumnSchema {
            name: name.into(),
            type_oid,
            type_modifier,
            key,
        }
    }

    fn orders(columns: Vec<ColumnSchema>) -> RelationSchema {
        RelationSchema {
            relation_id: 16_384,
            namespace: "public".into(),
            name: "orders".into(),
            replica_identity: ReplicaIdentity::Default as i32,
            columns,
            fingerprint: 0,
        }
    }

    fn base() -> Vec<ColumnSchema> {
        vec![
            column("id", INT8, -1, true),
            column("qty", INT4, -1, false),
            column("note", VARCHAR, 20 + 4, false),
        ]
    }

    fn kinds(old: &RelationSchema, new: &RelationSchema) -> Vec<(Option<DdlKind>, Option<String>)> {
        diff(old, new)
            .into_iter()
            .map(|d| (d.kind, d.column))
            .collect()
    }

    #[test]
    fn each_visible_change_is_named_by_its_kind() {
        let old = orders(base());
        let with = |f: &dyn Fn(&mut Vec<ColumnSchema>)| {
            let mut c = base();
            f(&mut c);
            orders(c)
        };
        let col = |n: &str| Some(n.to_owned());
        assert_eq!(kinds(&old, &old), vec![]);
        assert_eq!(
            kinds(&old, &with(&|c| c.push(column("region", TEXT, -1, false)))),
            vec![(Some(DdlKind::AddNullableColumn), col("region"))]
        );
        assert_eq!(
            kinds(
                &old,
                &with(&|c| {
                    c.remove(1);
                })
            ),
            vec![(Some(DdlKind::DropColumn), col("qty"))]
        );
        assert_eq!(
            kinds(&old, &with(&|c| c[1].name = "quantity".into())),
            vec![(Some(DdlKind::RenameColumn), col("quantity"))]
        );
        assert_eq!(
            kinds(&old, &with(&|c| c[1].type_oid = INT8)),
            vec![(Some(DdlKind::WidenType), col("qty"))]
        );
        assert_eq!(
            kinds(&old, &with(&|c| c[0].type_oid = INT4)),
            vec![(Some(DdlKind::NarrowType), col("id"))]
        );
        assert_eq!(
            kinds(&old, &with(&|c| c[2].type_modifier = 40 + 4)),
            vec![(Some(DdlKind::IncreaseVarchar), col("note"))]
        );
        assert_eq!(
            kinds(&old, &with(&|c| c[2].type_modifier = 10 + 4)),
            vec![(Some(DdlKind::NarrowType), col("note"))]
        );
        assert_eq!(
            kinds(&old, &with(&|c| c[1].key = true)),
            vec![(Some(DdlKind::KeyChange), None)]
        );
        let mut renamed = old.clone();
        renamed.name = "purchases".into();
        assert_eq!(
            kinds(&old, &renamed),
            vec![(Some(DdlKind::RenameTable), None)]
        );
        let mut full = old.clone();
        full.replica_identity = ReplicaIdentity::Full as i32;
        assert_eq!(kinds(&old, &full), vec![(Some(DdlKind::KeyChange), None)]);
        // Under FULL every column is a key: an added one is an add alone.
        let mut all_keys = full.clone();
        all_keys.columns.iter_mut().for_each(|c| c.key = true);
        let mut wider = all_keys.clone();
        wider.columns.push(column("region", TEXT, -1, true));
        assert_eq!(
            kinds(&all_keys, &wider),
            vec![(Some(DdlKind::AddNullableColumn), col("region"))]
        );
    }

    #[test]
    fn what_no_kind_explains_is_reported_without_one() {
        let old = orders(base());
        // DROP COLUMN qty, ADD COLUMN qty: same name, moved to the end.
        let mut c = base();
        let qty = c.remove(1);
        c.push(qty);
        assert_eq!(kinds(&old, &orders(c)), vec![(None, None)]);
        // int -> text is neither wider nor narrower.
        let mut c = base();
        c[1].type_oid = TEXT;
        assert_eq!(kinds(&old, &orders(c)), vec![(None, Some("qty".into()))]);
        // Two columns gone and two come: not a rename, two drops and adds.
        let mut c = base();
        c[1].name = "a".into();
        c[2].name = "b".into();
        let found = kinds(&old, &orders(c));
        assert_eq!(found.len(), 4, "{found:?}");
        // A rename that also changes type is a drop and an add.
        let mut c = base();
        c[1].name = "quantity".into();
        c[1].type_oid = INT8;
        assert_eq!(
            kinds(&old, &orders(c)),
            vec![
                (Some(DdlKind::DropColumn), Some("qty".into())),
                (Some(DdlKind::AddNullableColumn), Some("quantity".into()))
            ]
        );
    }

    #[test]
    fn widening_is_exactly_what_keeps_every_value() {
        let numeric = |p: i32, s: i32| ((p << 16) | s) + 4;
        let change = |f: (u32, i32), t: (u32, i32)| {
            type_change(&column("c", f.0, f.1, false), &column("c", t.0, t.1, false))
        };
        let widen = Some(DdlKind::WidenType);
        let narrow = Some(DdlKind::NarrowType);
        assert_eq!(change((INT2, -1), (INT8, -1)), widen);
        assert_eq!(change((INT8, -1), (INT2, -1)), narrow);
        assert_eq!(change((INT4, -1), (NUMERIC, -1)), widen);
        assert_eq!(change((INT4, -1), (NUMERIC, numeric(12, 2))), widen);
        assert_eq!(change((INT4, -1), (NUMERIC, numeric(8, 0))), narrow);
        assert_eq!(
            change((NUMERIC, numeric(10, 2)), (NUMERIC, numeric(12, 2))),
            widen
        );
        assert_eq!(
            change((NUMERIC, numeric(12, 2)), (NUMERIC, numeric(10, 2))),
            narrow
        );
        assert_eq!(
            change((NUMERIC, numeric(10, 2)), (NUMERIC, numeric(12, 4))),
            None
        );
        assert_eq!(change((NUMERIC, numeric(10, 2)), (NUMERIC, -1)), widen);
        assert_eq!(change((FLOAT4, -1), (FLOAT8, -1)), widen);
        assert_eq!(change((INT8, -1), (FLOAT8, -1)), narrow);
        assert_eq!(change((VARCHAR, 24), (TEXT, -1)), widen);
        assert_eq!(
            change((VARCHAR, 24), (VARCHAR, -1)),
            Some(DdlKind::IncreaseVarchar)
        );
        assert_eq!(change((TEXT, -1), (VARCHAR, 24)), narrow);
        assert_eq!(change((1114, 3), (1114, 6)), widen);
        assert_eq!(change((1114, 6), (1114, 3)), narrow);
        // timestamp -> timestamptz reads each value in a time zone.
        assert_eq!(change((1114, -1), (1184, -1)), None);
        // char(n) pads: another length changes values.
        assert_eq!(change((1042, 14), (1042, 24)), None);
    }
}
