//! `--write-config`: a minimal `trellara.yml` draft from an assessment.
//!
//! Invariants:
//! - No draft is written for a blocked or unassessed source: the refusal
//!   names every critical finding.
//! - The draft never holds a credential: the source URL is the reference
//!   `env:TRELLARA_SOURCE_DATABASE_URL`.
//! - The shape is the minimal subset of schema v2 (one flow, `capture:
//!   external`, `transport: local`); the full schema comes with the config
//!   issue.

use crate::report::{Report, Verdict};
use std::fmt::Write as _;
use std::path::Path;

/// The environment variable the draft points the source at.
pub const SOURCE_URL_ENV: &str = "TRELLARA_SOURCE_DATABASE_URL";

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("not writing a config: the source is blocked by {0}")]
    Blocked(String),
    #[error("not writing a config: the source could not be fully assessed")]
    Unassessed,
    #[error("could not write {path}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The YAML text of the draft, or why there is none.
pub fn draft(report: &Report, tables: &[String]) -> Result<String, DraftError> {
    match report.verdict() {
        Verdict::Ready => {}
        Verdict::Blocked => {
            let names: Vec<String> = report
                .critical()
                .map(|f| match &f.subject {
                    Some(s) => format!("{} {} ({s})", f.rule, f.name),
                    None => format!("{} {}", f.rule, f.name),
                })
                .collect();
            return Err(DraftError::Blocked(names.join(", ")));
        }
        Verdict::Unassessed => return Err(DraftError::Unassessed),
    }
    let db = &report.facts.server.database;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# trellara.yml draft written by trellara-check {} from {} (grade {}).",
        env!("CARGO_PKG_VERSION"),
        report.target,
        report.grade.letter
    );
    let _ = writeln!(
        out,
        "# Minimal schema v2 subset; the full schema comes with the config issue. Review before use."
    );
    let _ = writeln!(out, "schema_version: 2");
    let _ = writeln!(out, "flows:");
    let _ = writeln!(out, "  - name: {}", yaml_scalar(&format!("{db}-capture")));
    let _ = writeln!(out, "    source:");
    let _ = writeln!(out, "      url: env:{SOURCE_URL_ENV}");
    if tables.is_empty() {
        let _ = writeln!(out, "    tables: []  # add schema.name entries");
    } else {
        let _ = writeln!(out, "    tables:");
        for t in tables {
            let _ = writeln!(out, "      - {}", yaml_scalar(t.trim()));
        }
    }
    let _ = writeln!(out, "    capture: external");
    let _ = writeln!(out, "    transport: local");
    Ok(out)
}

/// Writes the draft to `path` (see [`draft`]).
pub fn write(report: &Report, tables: &[String], path: &Path) -> Result<(), DraftError> {
    let text = draft(report, tables)?;
    std::fs::write(path, text).map_err(|source| DraftError::Write {
        path: path.display().to_string(),
        source,
    })
}

/// A YAML scalar: plain when safe, double-quoted otherwise.
fn yaml_scalar(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        && !s.starts_with(['-', '.']);
    if plain {
        s.to_owned()
    } else {
        format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn scalars() {
        assert_eq!(super::yaml_scalar("public.orders"), "public.orders");
        assert_eq!(
            super::yaml_scalar("public.\"Odd\""),
            "\"public.\\\"Odd\\\"\""
        );
    }
}
