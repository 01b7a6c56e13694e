//! The workspace's module layout: no two top-level modules of a crate
//! import each other, directly or around a circle. A circle means neither
//! can be read, tested or replaced without the other; a child module
//! (`flow/delivery.rs`) may use its parent.
//!
//! References are read from the source text (`crate::name`, and the names
//! in `use crate::{...}`), outside comments and `#[cfg(test)] mod tests`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: [&str; 5] = ["common", "pgwire", "external-relay", "relay", "check"];

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

/// The code of a file without its comments and its unit-test module.
fn code(text: &str) -> String {
    let text = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default();
    text.lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
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
        let mut named = BTreeSet::new();
        for (i, _) in text.match_indices("crate::") {
            let rest = &text[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                named.extend(
                    group
                        .split(',')
                        .map(|p| p.trim().split("::").next().unwrap_or_default().to_owned()),
                );
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                named.insert(name);
            }
        }
        named.remove(&module);
        graph.entry(module).or_default().extend(named);
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
        assert!(graph.len() > 2, "{krate}: its modules were not found");
        for module in graph.keys() {
            if let Some(path) = circle(&graph, module) {
                found.push(format!("{krate}: {} -> {module}", path.join(" -> ")));
            }
        }
    }
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
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
