//! Which PostgreSQL majors a test runs on.
//!
//! Invariants:
//! - Under CI (`CI=true`) or with `TRELLARA_REQUIRE_ALL_MAJORS=1`, a missing major fails
//!   the test, naming the major and the fix (`scripts/setup`); elsewhere it is skipped
//!   with a note on stderr.
//! - `TRELLARA_MAJORS=15,18` narrows the set for local iteration; deselected majors
//!   are skipped even under CI, and the rule above applies to the rest.
//! - [`for_each_major`] fails when no major ran, so a machine without PostgreSQL never
//!   passes silently.

use crate::cluster::{Cluster, ClusterOptions, error_chain};
use crate::major::{Major, MissingMajor};

/// Set to `1` to fail instead of skipping when a major is missing (implied by `CI=true`).
pub const REQUIRE_ALL_MAJORS_VAR: &str = "TRELLARA_REQUIRE_ALL_MAJORS";

/// Comma-separated major numbers to run on, e.g. `15,18`; unset means all.
pub const MAJORS_VAR: &str = "TRELLARA_MAJORS";

/// Whether a missing major is a test failure here (CI, or
/// `TRELLARA_REQUIRE_ALL_MAJORS=1`).
pub fn all_majors_required() -> bool {
    let is = |var: &str, values: &[&str]| {
        std::env::var(var)
            .map(|v| values.iter().any(|ok| v.trim().eq_ignore_ascii_case(ok)))
            .unwrap_or(false)
    };
    is("CI", &["true", "1"]) || is(REQUIRE_ALL_MAJORS_VAR, &["1", "true"])
}

/// The majors selected by `TRELLARA_MAJORS` (all when unset); panics on a bad value.
pub fn selected_majors() -> Vec<Major> {
    let Ok(list) = std::env::var(MAJORS_VAR) else {
        return Major::ALL.to_vec();
    };
    let mut majors: Vec<Major> = list
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.parse()
                .ok()
                .and_then(Major::from_number)
                .unwrap_or_else(|| {
                    panic!("{MAJORS_VAR}={list:?}: `{item}` is not one of 15, 16, 17, 18")
                })
        })
        .collect();
    majors.sort();
    majors.dedup();
    majors
}

/// The selected majors whose binaries are present. Under CI a missing one panics,
/// naming every missing major and the fix; otherwise it is skipped with a note.
pub fn majors_for_test() -> Vec<Major> {
    let mut present = Vec::new();
    let mut missing: Vec<MissingMajor> = Vec::new();
    for major in selected_majors() {
        match major.locate() {
            Ok(_) => present.push(major),
            Err(err) => missing.push(err),
        }
    }
    if !missing.is_empty() {
        let lines: Vec<String> = missing.iter().map(|m| format!("  - {m}")).collect();
        if all_majors_required() {
            panic!(
                "{} PostgreSQL major(s) missing and CI requires all of them:\n{}\n\
                 fix: run scripts/setup (as root) on this machine",
                missing.len(),
                lines.join("\n")
            );
        }
        eprintln!(
            "trellara-tests: skipping missing majors (CI=true makes this a failure):\n{}",
            lines.join("\n")
        );
    }
    present
}

/// A started cluster of `major` for a test, or `None` (with a note on stderr) when
/// the major is deselected or, outside CI, missing. Panics when the major is
/// required but missing, or when the cluster does not start.
pub fn test_cluster(major: Major, options: &ClusterOptions) -> Option<Cluster> {
    if !selected_majors().contains(&major) {
        eprintln!("trellara-tests: skipping {major}: not in {MAJORS_VAR}");
        return None;
    }
    if let Err(missing) = major.locate() {
        if all_majors_required() {
            panic!("{missing}\nCI requires every major; fix: run scripts/setup (as root)");
        }
        eprintln!("trellara-tests: skipping: {missing}");
        return None;
    }
    Some(start_or_panic(major, options))
}

/// Runs `test` once per major from [`majors_for_test`], each on a fresh cluster with
/// default options, one after the other; prints which versions ran and panics if
/// none did.
pub fn for_each_major(test: impl FnMut(&Cluster)) {
    for_each_major_with(&ClusterOptions::default(), test);
}

/// [`for_each_major`] with cluster options.
pub fn for_each_major_with(options: &ClusterOptions, mut test: impl FnMut(&Cluster)) {
    let mut ran: Vec<String> = Vec::new();
    for major in majors_for_test() {
        let cluster = start_or_panic(major, options);
        println!(
            "trellara-tests: running on PostgreSQL {} (port {}, data {})",
            cluster.server_version(),
            cluster.port(),
            cluster.data_dir().display()
        );
        test(&cluster);
        ran.push(cluster.server_version().to_owned());
    }
    assert!(
        !ran.is_empty(),
        "no PostgreSQL major ran (selected: {:?}); fix: run scripts/setup (as root)",
        selected_majors()
    );
    println!("trellara-tests: ran on PG {}", ran.join(", "));
}

fn start_or_panic(major: Major, options: &ClusterOptions) -> Cluster {
    Cluster::start(major, options)
        .unwrap_or_else(|err| panic!("could not start {major}: {}", error_chain(&err)))
}
