//! The workspace's module layout: no two top-level modules of a crate
//! import each other, directly or around a circle. A circle means neither
//! can be read, tested or replaced without the other; a child module
//! (`flow/delivery.rs`) may use its parent.
//!
//! References are read from the source text (`crate::name`, a `super::`
//! that reaches the crate root, and the names in `use crate::{...}`),
//! outside comments and unit-test modules. Paths through `lib.rs`
//! re-exports are not followed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: [&str; 6] = [
    "common",
    "pgwire",
    "external-relay",
    "relay",
    "check",
    "extension",
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read the source directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments, up to its unit-test module
/// (`#[cfg(test)]`, other attributes, then `mod`).
fn code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut end = lines.len();
    for (i, line) in lines.iter().enumerate() {
        if line.trim() == "#[cfg(test)]"
            && lines[i + 1..]
                .iter()
                .find(|l| !l.trim_start().starts_with("#["))
                .is_some_and(|l| l.trim_start().starts_with("mod "))
        {
            end = i;
            break;
        }
    }
    lines[..end]
        .iter()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first name of each path in a `use` group's text (`a::b, c::{d, e}`
/// names a and c), split only at its own commas.
fn group_heads(group: &str) -> Vec<String> {
    let (mut heads, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                heads.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    heads.push(&group[start..]);
    heads
        .iter()
        .map(|h| h.trim().split("::").next().unwrap_or_default().to_owned())
        .filter(|h| !h.is_empty())
        .collect()
}

/// The top-level modules named by what follows `crate::` (or a `super::`
/// that reaches the crate root) at the start of `rest`.
fn named(rest: &str) -> Vec<String> {
    let Some(group) = rest.strip_prefix('{') else {
        return vec![
            rest.chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect(),
        ];
    };
    let mut depth = 1;
    let mut end = group.len();
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            end = i;
            break;
        }
    }
    group_heads(&group[..end])
}

/// Each top-level module of the crate in `src` and the top-level modules
/// it names.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let top = |path: &Path| {
        let rel = path.strip_prefix(src).expect("under src");
        let first = rel.components().next().expect("a component");
        first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned()
    };
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let module = top(file);
        if module == "lib" || module == "main" {
            continue;
        }
        let text = code(&std::fs::read_to_string(file).expect("read a source file"));
        // The `super::`s that reach the crate root from this file: one
        // from src/a.rs and src/a/mod.rs, two from src/a/b.rs.
        let rel = file.strip_prefix(src).expect("under src");
        let depth =
            rel.components().count() - usize::from(rel.file_name().is_some_and(|n| n == "mod.rs"));
        let to_root = "super::".repeat(depth);
        let mut names = BTreeSet::new();
        for prefix in ["crate::", to_root.as_str()] {
            for (i, _) in text.match_indices(prefix) {
                // A longer run of super:: is read from its own start.
                if prefix.starts_with("super") && text[..i].ends_with("super::") {
                    continue;
                }
                names.extend(named(&text[i + prefix.len()..]));
            }
        }
        names.remove(&module);
        graph.entry(module).or_default().extend(names);
    }
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for deps in graph.values_mut() {
        deps.retain(|d| modules.contains(d));
    }
    graph
}

/// A circle through `from`, if there is one: the path back to it.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> Option<Vec<String>> {
    let mut stack = vec![vec![from.to_owned()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        let last = path.last().expect("a path");
        for next in &graph[last] {
            if next == from {
                return Some(path.clone());
            }
            if seen.insert(next.clone()) {
                let mut longer = path.clone();
                longer.push(next.clone());
                stack.push(longer);
            }
        }
    }
    None
}

#[test]
fn no_two_modules_of_a_crate_import_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    for krate in CRATES {
        let graph = graph(&root.join(krate).join("src"));
        assert!(graph.len() >= 2, "{krate}: its modules were not found");
        for module in graph.keys() {
            if let Some(path) = circle(&graph, module) {
                found.push(format!("{krate}: {} -> {module}", path.join(" -> ")));
            }
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

#[test]
fn use_groups_and_super_paths_are_read() {
    assert_eq!(named("{a::{b, c}, d}; x"), vec!["a", "d"]);
    assert_eq!(named("log::Log;"), vec!["log"]);
    assert_eq!(group_heads("a, b::c, d::{e, f}"), vec!["a", "b", "d"]);
    let text = "use x;\n#[cfg(test)]\n#[allow(dead_code)]\nmod tests {\n use crate::y;\n}";
    assert!(!code(text).contains("crate::y"), "{}", code(text));
}

#[test]
fn a_circle_is_found() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(m, d)| (m.to_owned(), d.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(
        circle(&graph, "a"),
        Some(vec!["a".to_owned(), "b".to_owned(), "c".to_owned()])
    );
    assert_eq!(circle(&graph, "d"), None);
}

/// The functions that compose the pipeline's parts: each stays short
/// enough to read whole, its parts in functions of their own.
const COMPOSITION: [(&str, &str); 8] = [
    ("relay/src/flow.rs", "pub async fn run<"),
    ("relay/src/flow.rs", "async fn follow_rounds"),
    ("relay/src/flow.rs", "async fn follow_round<"),
    ("relay/src/flow.rs", "async fn watched_round"),
    ("relay/src/flow.rs", "async fn run_round"),
    ("relay/src/flow/delivery.rs", "pub async fn apply_round"),
    ("relay/src/flow/sinks.rs", "async fn round"),
    ("relay/src/flow/round.rs", "pub async fn drive"),
];
const COMPOSITION_MAX_LINES: usize = 150;

/// Lines from the line holding `signature` to the first line after it that
/// closes a block at the indentation the signature starts at.
fn function_lines(text: &str, signature: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.iter().position(|l| l.contains(signature))?;
    let first = lines.get(start)?;
    let indent = first.len() - first.trim_start().len();
    let close = format!("{}}}", " ".repeat(indent));
    let end = lines
        .iter()
        .skip(start + 1)
        .position(|l| l.trim_end() == close)?;
    Some(end + 2)
}

#[test]
fn no_composition_function_is_over_150_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut long = Vec::new();
    for (file, signature) in COMPOSITION {
        let text = std::fs::read_to_string(root.join(file)).expect("read the source");
        let lines = function_lines(&text, signature)
            .unwrap_or_else(|| panic!("{file}: `{signature}` not found"));
        if lines > COMPOSITION_MAX_LINES {
            long.push(format!("{file}: `{signature}` has {lines} lines"));
        }
    }
    assert!(
        long.is_empty(),
        "over {COMPOSITION_MAX_LINES} lines:\n{}",
        long.join("\n")
    );
    let text = "fn a() {\n    x;\n}\nfn b() {\n}\n";
    assert_eq!(function_lines(text, "fn a"), Some(3));
}
