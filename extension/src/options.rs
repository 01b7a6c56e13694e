//! Output plugin options (`pg_logical_slot_get_binary_changes(..., 'name',
//! 'value', ...)` or `START_REPLICATION ... (name 'value')`).
//!
//! Invariant: an option this plugin does not know, a repeated option or a
//! value out of range is an `ERROR` naming the option; nothing is ignored.

use crate::error::PluginError;
use trellara_common::native_frame::{MAX_FRAME_BYTES, MIN_FRAME_BYTES};
use trellara_common::table_name::TableName;

/// Default envelope size target: 1 MiB.
pub const DEFAULT_CHUNK_BYTES: usize = 1024 * 1024;
const MIN_CHUNK_BYTES: usize = 4 * 1024;
const MAX_CHUNK_BYTES: usize = 256 * 1024 * 1024;
/// Default in-memory budget for a transaction's encoded changes: 4 MiB.
pub const DEFAULT_MEMORY_BUDGET_BYTES: usize = 4 * 1024 * 1024;
const MAX_MEMORY_BUDGET_BYTES: usize = 1024 * 1024 * 1024;

pub const KNOWN: [&str; 8] = [
    "source_id",
    "tables",
    "dataset_id",
    "max_frame_bytes",
    "chunk_bytes",
    "memory_budget_bytes",
    "origin",
    // Accepted and checked so clients that always send it get a clear answer.
    "protocol_version",
];

/// Which transactions `filter_by_origin` lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OriginFilter {
    /// Every transaction, local or replayed from a replication origin.
    Any,
    /// Only transactions that originated locally (no replication origin).
    None,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub source_id: Option<String>,
    pub dataset_id: Option<String>,
    pub max_frame_bytes: usize,
    pub chunk_bytes: usize,
    pub memory_budget_bytes: usize,
    pub origin: OriginFilter,
    /// Only these relations (`schema.table`) are captured; all when `None`.
    pub tables: Option<Vec<TableName>>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            source_id: None,
            dataset_id: None,
            max_frame_bytes: MAX_FRAME_BYTES,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            memory_budget_bytes: DEFAULT_MEMORY_BUDGET_BYTES,
            origin: OriginFilter::Any,
            tables: None,
        }
    }
}

fn size(name: &str, value: &str, min: usize, max: usize) -> Result<usize, PluginError> {
    match value.trim().parse::<usize>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(PluginError::invalid_option(format!(
            "trellara: option \"{name}\" must be an integer from {min} to {max}, got \"{value}\""
        ))),
    }
}

fn required<'a>(name: &str, value: Option<&'a str>) -> Result<&'a str, PluginError> {
    match value {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(PluginError::invalid_option(format!(
            "trellara: option \"{name}\" needs a non-empty value"
        ))),
    }
}

/// Parses `(name, value)` pairs in the order given.
pub fn parse(pairs: &[(String, Option<String>)]) -> Result<Options, PluginError> {
    let mut options = Options::default();
    let mut seen: Vec<&str> = Vec::new();
    for (name, value) in pairs {
        let name = name.as_str();
        if seen.contains(&name) {
            return Err(PluginError::invalid_option(format!(
                "trellara: option \"{name}\" given more than once"
            )));
        }
        seen.push(name);
        let value = value.as_deref();
        match name {
            "source_id" => options.source_id = Some(required(name, value)?.to_owned()),
            "dataset_id" => options.dataset_id = Some(required(name, value)?.to_owned()),
            "max_frame_bytes" => {
                options.max_frame_bytes = size(
                    name,
                    required(name, value)?,
                    MIN_FRAME_BYTES,
                    MAX_FRAME_BYTES,
                )?
            }
            "chunk_bytes" => {
                options.chunk_bytes = size(
                    name,
                    required(name, value)?,
                    MIN_CHUNK_BYTES,
                    MAX_CHUNK_BYTES,
                )?
            }
            "memory_budget_bytes" => {
                options.memory_budget_bytes =
                    size(name, required(name, value)?, 0, MAX_MEMORY_BUDGET_BYTES)?
            }
            "origin" => {
                options.origin = match required(name, value)? {
                    "any" => OriginFilter::Any,
                    "none" => OriginFilter::None,
                    other => {
                        return Err(PluginError::invalid_option(format!(
                            "trellara: option \"origin\" must be \"any\" or \"none\", got \"{other}\""
                        )));
                    }
                }
            }
            "tables" => {
                let tables = TableName::parse_list(required(name, value)?).map_err(|(item, e)| {
                    PluginError::invalid_option(format!(
                        "trellara: option \"tables\" lists \"{item}\", which {e}"
                    ))
                    .hint("Give a comma-separated list such as public.orders,public.\"LineItems\" (SQL spelling: quoted names are exact, others fold to lower case).")
                })?;
                options.tables = Some(tables);
            }
            "protocol_version" => {
                let v = required(name, value)?;
                if v.trim() != "1" {
                    return Err(PluginError::invalid_option(format!(
                        "trellara: option \"protocol_version\" must be 1 (envelope v1), got \"{v}\""
                    )));
                }
            }
            other => {
                return Err(PluginError::invalid_option(format!(
                    "trellara: unknown option \"{other}\""
                ))
                .hint(format!("Known options: {}.", KNOWN.join(", "))));
            }
        }
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, Option<&str>)]) -> Vec<(String, Option<String>)> {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.map(str::to_owned)))
            .collect()
    }

    #[test]
    fn defaults_and_values() {
        let o = parse(&pairs(&[])).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(o, Options::default());
        let o = parse(&pairs(&[
            ("source_id", Some("src")),
            ("max_frame_bytes", Some("41")),
            ("chunk_bytes", Some("4096")),
            ("origin", Some("none")),
            ("tables", Some("public.a, s.\"B\"")),
        ]))
        .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(
            o.tables,
            Some(vec![
                TableName::new("public", "a"),
                TableName::new("s", "B")
            ])
        );
        assert_eq!(o.source_id.as_deref(), Some("src"));
        assert_eq!((o.max_frame_bytes, o.chunk_bytes), (41, 4096));
        assert_eq!(o.origin, OriginFilter::None);
    }

    #[test]
    fn refusals_name_the_option() {
        for (list, needle) in [
            (vec![("bogus", Some("1"))], "unknown option \"bogus\""),
            (
                vec![("max_frame_bytes", Some("65537"))],
                "\"max_frame_bytes\"",
            ),
            (vec![("max_frame_bytes", Some("40"))], "\"max_frame_bytes\""),
            (vec![("chunk_bytes", Some("x"))], "\"chunk_bytes\""),
            (vec![("origin", Some("some"))], "\"origin\""),
            (vec![("tables", Some("public.a,nodot"))], "\"nodot\""),
            (vec![("source_id", None)], "\"source_id\""),
            (
                vec![("protocol_version", Some("2"))],
                "\"protocol_version\"",
            ),
            (
                vec![("source_id", Some("a")), ("source_id", Some("b"))],
                "more than once",
            ),
        ] {
            let err = parse(&pairs(&list)).err().map(|e| e.message().to_owned());
            assert!(
                err.as_deref().is_some_and(|e| e.contains(needle)),
                "{list:?}: {err:?}"
            );
        }
    }
}
