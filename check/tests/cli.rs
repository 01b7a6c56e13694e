//! The `trellara-check` binary: exit statuses (0 ready, 3 blocked, 2 could
//! not assess), the URL from the environment, passwords never printed, the
//! JSON and HTML renderings, `--output`, and `--write-config` (written when
//! ready, refused with the blocker named when blocked).

use std::path::Path;
use std::process::{Command, Output};
use trellara_tests::{ClusterOptions, Major, test_cluster};

const SOURCE_URL_ENV: &str = "TRELLARA_SOURCE_DATABASE_URL";

fn grader() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trellara-check"));
    cmd.env_remove(SOURCE_URL_ENV);
    cmd
}

fn run(cmd: &mut Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().expect("trellara-check runs");
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

#[test]
fn unusable_urls_exit_2_without_the_password() {
    let (code, out, err) = run(grader().arg("not a url"));
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("could not assess"), "{err}");

    // Nothing listens on port 1: connection refused.
    let (code, out, err) = run(grader().arg("postgresql://rep:sekret@127.0.0.1:1/shop"));
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("could not connect to rep@127.0.0.1:1/shop"),
        "{err}"
    );
    assert!(
        !out.contains("sekret") && !err.contains("sekret"),
        "{out}{err}"
    );

    // The same from the environment.
    let (code, out, err) =
        run(grader().env(SOURCE_URL_ENV, "postgresql://rep:sekret@127.0.0.1:1/shop"));
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        !out.contains("sekret") && !err.contains("sekret"),
        "{out}{err}"
    );

    // No URL at all: a usage error, also 2.
    let (code, _, err) = run(&mut grader());
    assert_eq!(code, 2, "{err}");
}

#[test]
fn binary_on_a_live_server() {
    let Some(cluster) = test_cluster(Major::Pg18, &ClusterOptions::new()) else {
        return;
    };
    cluster.psql(
        "CREATE TABLE items (id int PRIMARY KEY, qty int);
         CREATE TABLE noid (a int);
         CREATE TABLE \"Odd<b>\" (id int PRIMARY KEY);",
    );
    // Trust authentication ignores the password, so it can be in the URL
    // and must still never be printed.
    let url = format!(
        "postgresql://postgres:sekret@{}:{}/postgres",
        cluster.host(),
        cluster.port()
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let json_path = dir.path().join("report.json");
    let config_path = dir.path().join("trellara.yml");

    // Ready: JSON report to a file, config draft written.
    let (code, out, err) = run(grader()
        .env(SOURCE_URL_ENV, &url)
        .args([
            "--format",
            "json",
            "--sample-seconds",
            "1",
            "--table",
            "public.items",
        ])
        .arg("--output")
        .arg(&json_path)
        .arg("--write-config")
        .arg(&config_path));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.is_empty(), "the report went to --output: {out}");
    let json = std::fs::read_to_string(&json_path).expect("report written");
    assert!(!json.contains("sekret") && !err.contains("sekret"));
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    assert_eq!(v["verdict"], "ready");
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["created"], "nothing");
    assert_eq!(
        v["target"],
        format!("postgres@127.0.0.1:{}/postgres", cluster.port())
    );
    assert!(v["grade"]["letter"].is_string());
    assert!(v["grade"]["score"].is_u64());
    assert!(v["grade"]["deductions"].is_array());
    assert!(v["findings"].is_array() && v["actions"].is_array());
    assert_eq!(v["tables"]["tables"][0]["name"], "public.items");
    assert_eq!(v["tables"]["tables"][0]["identity"], "primary_key");
    assert_eq!(v["settings"]["wal_level"], "logical");
    assert_eq!(v["server"]["transaction_read_only"], true);
    let config = std::fs::read_to_string(&config_path).expect("config draft written");
    assert!(!config.contains("sekret") && !config.contains("postgresql://"));
    // The relay's own model reads it back, and finds nothing to fix.
    let draft = trellara_common::config::parse(&config).expect("the draft parses");
    assert!(
        trellara_common::config::validate(&draft).is_empty(),
        "{config}"
    );
    let flow = &draft.flows[0];
    assert_eq!(
        draft.environment,
        trellara_common::config::Environment::Production
    );
    assert_eq!(
        flow.source.url.url_env.as_deref(),
        Some(SOURCE_URL_ENV),
        "{config}"
    );
    assert_eq!(
        flow.target.as_ref().expect("target").url.url_env.as_deref(),
        Some("TRELLARA_TARGET_DATABASE_URL"),
        "{config}"
    );
    assert_eq!(flow.tables, ["public.items"]);
    assert_eq!(flow.capture, trellara_common::config::CapturePath::External);
    assert_eq!(
        flow.log_dir(),
        Some(Path::new(&format!("./.trellara/{}/log", flow.name)))
    );

    // Blocked: exit 3, no config, the blocker named.
    let blocked_config = dir.path().join("blocked.yml");
    let (code, out, err) = run(grader()
        .arg(&url)
        .args([
            "--sample-seconds",
            "1",
            "--table",
            "public.noid,public.items",
        ])
        .arg("--write-config")
        .arg(&blocked_config));
    assert_eq!(code, 3, "{out}{err}");
    assert!(
        !Path::new(&blocked_config).exists(),
        "no draft for a blocked source"
    );
    assert!(err.contains("not writing a config: the source is blocked by C06 table_without_identity (public.noid)"), "{err}");
    assert!(out.contains("grade              F"), "{out}");
    assert!(
        out.contains("verdict            blocked by C06 (public.noid)"),
        "{out}"
    );
    assert!(
        out.contains("ALTER TABLE public.noid REPLICA IDENTITY FULL;"),
        "{out}"
    );
    assert!(
        out.trim_end().ends_with(trellara_check::NOTHING_CREATED),
        "{out}"
    );
    assert!(!out.contains("sekret") && !err.contains("sekret"));

    // HTML: one self-contained page, escaped.
    let (code, html, err) =
        run(grader()
            .env(SOURCE_URL_ENV, &url)
            .args(["--format", "html", "--sample-seconds", "1"]));
    assert_eq!(code, 0, "{err}");
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert!(
        html.contains("public.&quot;Odd&lt;b&gt;&quot;"),
        "escaped table name"
    );
    assert!(!html.contains("Odd<b>"));
    for external in ["http://", "https://", "<script", "<link", "src="] {
        assert!(!html.contains(external), "external asset {external}");
    }
    assert!(!html.contains("sekret"));
}

#[test]
fn wal_level_replica_exits_3() {
    let options = ClusterOptions::new().setting("wal_level", "replica");
    let Some(cluster) = test_cluster(Major::Pg15, &options) else {
        return;
    };
    let (code, out, err) = run(grader()
        .arg(cluster.connection_string("postgres"))
        .args(["--sample-seconds", "1"]));
    assert_eq!(code, 3, "{out}{err}");
    assert!(
        out.contains("[C01] critical wal_level: wal_level is replica"),
        "{out}"
    );
    assert!(
        out.contains("1. ALTER SYSTEM SET wal_level = logical; -- then restart PostgreSQL"),
        "{out}"
    );
}

/// A catalog the role may not read is an unknown with its grant, and the
/// reads after it still run: the refusal is rolled back to its savepoint,
/// not left aborting the grader's one transaction.
#[test]
fn a_refused_catalog_read_is_named_and_the_reads_after_it_still_run() {
    let Some(cluster) = test_cluster(Major::Pg17, &ClusterOptions::new()) else {
        return;
    };
    cluster.psql(
        "CREATE ROLE limited LOGIN;
         REVOKE SELECT ON pg_catalog.pg_replication_slots FROM PUBLIC;
         CREATE TABLE items (id int PRIMARY KEY);
         CREATE PUBLICATION shop FOR TABLE items;",
    );
    let url = format!(
        "postgresql://limited@{}:{}/postgres",
        cluster.host(),
        cluster.port()
    );
    let (code, out, err) =
        run(grader()
            .arg(&url)
            .args(["--format", "json", "--sample-seconds", "1"]));
    assert_ne!(code, 2, "the source was assessed: {out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    let facts = &v; // the facts sit beside the verdict
    assert_eq!(facts["slots_visible"], false, "{out}");
    let unknowns = facts["unknowns"].as_array().expect("unknowns");
    let slots = unknowns
        .iter()
        .find(|u| u["what"] == "replication slots")
        .unwrap_or_else(|| panic!("the refused read is named: {out}"));
    assert!(
        slots["reason"]
            .as_str()
            .is_some_and(|r| r.contains("pg_replication_slots refused") && r.contains("42501")),
        "{slots}"
    );
    assert_eq!(
        slots["grant"],
        "GRANT SELECT ON pg_catalog.pg_replication_slots TO limited;"
    );
    // Read after the refusal, in the same transaction.
    assert_eq!(facts["publications_visible"], true, "{out}");
    let pubs = facts["publications"].as_array().expect("publications");
    assert!(pubs.iter().any(|p| p["name"] == "shop"), "{out}");
}
