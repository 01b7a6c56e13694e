//! The `trellara` binary: `log inspect` over a real log directory, and the
//! commands that have not landed refusing clearly instead of pretending.

use std::process::Command;
use trellara_common::{envelope, sample};
use trellara_relay::log::{CursorPosition, Log, LogConfig, storage::FsStorage};

fn trellara(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_trellara"))
        .args(args)
        .output()
        .expect("run trellara")
}

/// `--version` names the version and the commit the binary was built
/// from, the checkout's own when it is built from one.
#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = trellara(&["--version"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or("unknown".to_owned(), |o| {
            String::from_utf8_lossy(&o.stdout).trim().to_owned()
        });
    assert_eq!(
        text.trim(),
        format!("trellara {} (commit {head})", env!("CARGO_PKG_VERSION")),
        "{text}"
    );
}

/// The short help shows exactly the nine public commands; the operator
/// and evidence commands (relay, apply, chaos, log, ...) stay out of it.
#[test]
fn the_short_help_lists_exactly_the_nine_commands() {
    let out = trellara(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let listed: Vec<&str> = text
        .split("Commands:\n")
        .nth(1)
        .expect("a command list")
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        listed,
        [
            "init",
            "check",
            "preflight",
            "run",
            "verify",
            "status",
            "fleet",
            "lake",
            "config"
        ],
        "{text}"
    );
    // Hidden is not gone: the operator commands still answer.
    for hidden in ["relay", "apply", "chaos"] {
        assert!(
            trellara(&[hidden, "--help"]).status.success(),
            "{hidden} --help"
        );
    }
}

#[test]
fn log_inspect_verifies_every_envelope() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let (log, _) = Log::open(FsStorage, dir.path(), LogConfig::default()).expect("open");
        for i in 0..5u64 {
            let mut env = sample::insert_transaction(3, 10);
            env.commit_lsn += i * 0x100;
            env.end_lsn = env.commit_lsn + 0x30;
            log.append(env.commit_lsn, &envelope::encode(&env).expect("valid"))
                .expect("append");
        }
        log.register_consumer("applier").expect("register");
        log.commit_cursor("applier", CursorPosition::start_at(2))
            .expect("cursor");
    }
    let dir_arg = dir.path().to_str().expect("utf-8 path");
    let out = trellara(&[
        "log", "inspect", "--dir", dir_arg, "--verify", "--format", "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(report["next_offset"], 5);
    assert_eq!(report["verified"]["records"], 5);
    assert_eq!(
        report["verified"]["invalid_envelopes"]
            .as_array()
            .map(Vec::len),
        Some(0)
    );
    assert_eq!(report["cursors"][0]["consumer"], "applier");
    assert_eq!(report["cursors"][0]["next_offset"], 2);
    assert_eq!(report["last_durable_commit_lsn"], "16/B374DC48");

    let text = trellara(&["log", "inspect", "--dir", dir_arg]);
    assert!(text.status.success());
    assert!(String::from_utf8_lossy(&text.stdout).contains("cursor      applier at offset 2"));
}

#[test]
fn log_inspect_names_an_invalid_envelope_and_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let (log, _) = Log::open(FsStorage, dir.path(), LogConfig::default()).expect("open");
        let good = envelope::encode(&sample::mixed_transaction()).expect("valid");
        log.append(1, &good).expect("append");
        log.append(2, b"not an envelope").expect("append");
    }
    let out = trellara(&[
        "log",
        "inspect",
        "--dir",
        dir.path().to_str().expect("utf-8"),
        "--verify",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(report["verified"]["invalid_envelopes"][0]["offset"], 1);
}

#[test]
fn missing_directory_is_named() {
    let out = trellara(&["log", "inspect", "--dir", "/nonexistent/trellara-log"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/trellara-log") && err.contains("hint:"),
        "{err}"
    );
}

/// The failure matrix ships in the binary: every scenario prints its
/// verdict, invariant, proof and recovery; JSON says the same; exit 0 when
/// all held. The report is refused by name until it is built.
#[test]
fn chaos_run_prints_the_matrix() {
    let out = trellara(&["chaos", "run", "--seeds", "3"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("SS-01")
            && text.contains("TA-12")
            && text.contains("CA-08")
            && text.contains("SN-09"),
        "{text}"
    );
    assert!(
        text.contains("invariant:") && text.contains("recovery:"),
        "{text}"
    );
    assert!(text.contains("57 scenarios, 0 failed"), "{text}");
    assert!(
        text.contains("qualification: qualified: every invariant held"),
        "{text}"
    );

    let out = trellara(&["chaos", "run", "--seeds", "2", "--format", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["failed"], 0);
    assert_eq!(json["scenarios"].as_array().map(Vec::len), Some(57));
    assert_eq!(json["qualified"], true);
    assert_eq!(json["scenarios"][3]["passed"], true);

    let out = trellara(&["chaos", "run", "--family", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("source-and-stream"));
    // One family is not a qualification.
    let out = trellara(&["chaos", "run", "--family", "snapshot", "--seeds", "2"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("not a qualification run"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let page = dir.path().join("r.html");
    let out = trellara(&[
        "chaos",
        "report",
        "--seeds",
        "3",
        "--output",
        page.to_str().expect("path"),
    ]);
    assert_eq!(out.status.code(), Some(0));
    let html = std::fs::read_to_string(&page).expect("report");
    assert!(
        html.contains("SS-12") && html.contains("Verdict: qualified"),
        "{html}"
    );
    assert!(!html.contains("http"), "self-contained: no external assets");
    let again = dir.path().join("again.html");
    trellara(&[
        "chaos",
        "report",
        "--seeds",
        "3",
        "--output",
        again.to_str().expect("path"),
    ]);
    assert_eq!(
        std::fs::read(&again).expect("again"),
        html.as_bytes(),
        "deterministic"
    );
}

#[test]
fn unbuilt_commands_say_so() {
    for cmd in ["fleet", "lake", "pilot-scorecard", "pilot-package"] {
        let out = trellara(&[cmd, "--config", "trellara.yml"]);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("is not built yet") && err.contains("issue"),
            "{cmd}: {err}"
        );
    }
}

/// `trellara args` in `dir` with `vars` set.
fn trellara_in(
    dir: &std::path::Path,
    args: &[&str],
    vars: &[(&str, &str)],
) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_trellara"))
        .current_dir(dir)
        .envs(vars.iter().copied())
        .args(args)
        .output()
        .expect("run trellara")
}

/// A production `init` of one table: the config holds references only.
const INIT_SALES: [&str; 7] = [
    "init",
    "--source-database-url",
    "postgresql://u@h/db",
    "--target-database-url",
    "postgresql://u@h/t",
    "--table",
    "public.sales",
];

#[test]
fn config_errors_name_the_file_and_the_fix() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |args: &[&str]| trellara_in(dir.path(), args, &[]);
    let out = run(&["run", "--config", "missing.yml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("trellara init"));
    std::fs::write(
        dir.path().join("bad.yml"),
        "schema_version: 2\nenvironment: production\nflows:\n  - name: x\n    source: {url: postgresql://u@h/db}\n    target: {url_env: T}\n    tables: [sales]\n",
    )
    .expect("write");
    let out = run(&["check", "--config", "bad.yml", "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let fields: Vec<&str> = report["issues"]
        .as_array()
        .expect("issues")
        .iter()
        .filter_map(|i| i["field"].as_str())
        .collect();
    assert_eq!(fields, ["flows[0].source.url", "flows[0].tables[0]"]);
    let out = run(&INIT_SALES);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = std::fs::read_to_string(dir.path().join("trellara.yml")).expect("written");
    assert!(
        written.contains("url_env: TRELLARA_SOURCE_DATABASE_URL") && !written.contains("u@h"),
        "production config holds references only: {written}"
    );
    let again = run(&[
        "init",
        "--source-database-url",
        "x",
        "--target-database-url",
        "y",
        "--table",
        "public.sales",
    ]);
    assert_eq!(again.status.code(), Some(1), "refuses to overwrite");
}

/// The URL exported as `init` advises does not collide with `--config`
/// (clap counts an environment value as given).
#[test]
fn an_exported_source_url_leaves_config_commands_alone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let vars = [
        ("TRELLARA_SOURCE_DATABASE_URL", "postgresql://u@h/db"),
        ("TRELLARA_TARGET_DATABASE_URL", "postgresql://u@h/t"),
    ];
    let run = |args: &[&str]| trellara_in(dir.path(), args, &vars);
    let out = run(&INIT_SALES);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["check", "--config", "trellara.yml"]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `trellara chaos run | head`: a reader that goes away ends the run
/// quietly (SIGPIPE), never with a panic.
#[test]
fn chaos_run_into_a_closed_pipe_does_not_panic() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_trellara"))
        .args(["chaos", "run", "--seeds", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut first = [0u8; 16];
    child
        .stdout
        .take()
        .expect("stdout")
        .read_exact(&mut first)
        .expect("some output");
    // The reader is gone (its end of the pipe dropped above).
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut stderr)
        .expect("stderr");
    let status = child.wait().expect("wait");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        status.success() || status.signal() == Some(13),
        "{status:?}: {stderr}"
    );
}

#[test]
fn config_show_and_redact_never_print_a_secret() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_file = dir.path().join("target-url");
    std::fs::write(&secret_file, "postgresql://bob:file-pass-3@t.example/t\n").expect("secret");
    std::fs::write(
        dir.path().join("trellara.yml"),
        format!(
            "schema_version: 2\nenvironment: evaluation\nflows:\n  - name: shop\n    source:\n      url: postgresql://alice:inline-pass-1@db.example:5432/shop?password=query-pass-2\n    target:\n      url: host=/tmp dbname=t user=bob password=kv-pass-4\n    tables: [public.orders]\n  - name: two\n    source:\n      url_env: TWO_SOURCE\n    target:\n      url_file: {}\n    tables: [public.x]\n    transport:\n      kind: local\n      log_dir: ./.trellara/two\n",
            secret_file.display()
        ),
    )
    .expect("config");
    let vars = [("TWO_SOURCE", "postgresql://carol:env-pass-5@s.example/s")];
    let secrets = [
        "inline-pass-1",
        "query-pass-2",
        "file-pass-3",
        "kv-pass-4",
        "env-pass-5",
    ];
    for args in [
        &["config", "show", "--config", "trellara.yml"][..],
        &[
            "config",
            "show",
            "--config",
            "trellara.yml",
            "--format",
            "json",
        ],
        &["config", "redact", "--config", "trellara.yml"],
    ] {
        let out = trellara_in(dir.path(), args, &vars);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        for secret in secrets {
            assert!(!text.contains(secret), "{args:?} printed {secret}:\n{text}");
        }
        assert!(text.contains("<redacted>"), "{args:?}: {text}");
    }
    // The plan resolves the references (hosts stay, for the reader).
    let out = trellara_in(
        dir.path(),
        &[
            "config",
            "show",
            "--config",
            "trellara.yml",
            "--flow",
            "two",
            "--format",
            "json",
        ],
        &vars,
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(plan[0]["source"]["from"], "env:TWO_SOURCE");
    assert!(
        plan[0]["source"]["url"]
            .as_str()
            .unwrap()
            .contains("s.example"),
        "{plan}"
    );
    assert!(
        plan[0]["sinks"][0]["target"]["url"]
            .as_str()
            .unwrap()
            .contains("t.example"),
        "{plan}"
    );
    assert_eq!(plan[0]["slot"], "trellara_two");
    // Unset, it says so instead of failing the plan.
    let out = trellara_in(
        dir.path(),
        &[
            "config",
            "show",
            "--config",
            "trellara.yml",
            "--flow",
            "two",
        ],
        &[],
    );
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("TWO_SOURCE is not set"));
    // The redacted copy is still a config that validates.
    let out = trellara_in(
        dir.path(),
        &["config", "redact", "--config", "trellara.yml"],
        &vars,
    );
    std::fs::write(dir.path().join("shared.yml"), &out.stdout).expect("copy");
    let out = trellara_in(dir.path(), &["check", "--config", "shared.yml"], &vars);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn the_systemd_units_run_command_lines_the_binary_accepts() {
    let units = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/systemd");
    for (unit, command) in [
        ("trellara-flow@.service", "run"),
        ("trellara-relay@.service", "relay"),
        ("trellara-apply@.service", "apply"),
    ] {
        let text = std::fs::read_to_string(format!("{units}/{unit}")).expect("the unit");
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .expect("ExecStart");
        assert!(
            text.contains("ExecReload=/bin/kill -HUP $MAINPID"),
            "{unit}"
        );
        assert!(
            text.contains("Restart=on-failure") && text.contains("RestartPreventExitStatus=3"),
            "{unit}"
        );
        let mut words = exec.split_whitespace();
        assert_eq!(words.next(), Some("/usr/local/bin/trellara"), "{unit}");
        // The arguments as systemd passes them for <unit>shop, with the
        // config moved to a file that does not exist: a config error (exit
        // 1), not a usage error (2).
        let dir = tempfile::tempdir().expect("tempdir");
        let args: Vec<String> = words
            .map(|w| match w {
                "/etc/trellara/trellara.yml" => dir.path().join("absent.yml").display().to_string(),
                other => other.replace("%i", "shop"),
            })
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        assert_eq!(&args[..3], [command, "--config", args[2]], "{unit}");
        let out = trellara_in(dir.path(), &args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{unit}: {err}");
        assert!(err.contains("absent.yml"), "{unit}: {err}");
    }
}

#[test]
fn a_flow_of_several_sinks_is_not_split_into_relay_and_apply_services() {
    // Unreachable databases: the refusal comes before anything connects.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("local.yml"),
        "schema_version: 2\nenvironment: evaluation\nflows:\n  - name: shop\n    source: {url: postgresql://u@127.0.0.1:1/db}\n    sinks:\n      - {name: shop, target: {url: postgresql://u@127.0.0.1:1/t}}\n      - {name: lake, target: {url: postgresql://u@127.0.0.1:1/l}}\n    tables: [public.orders]\n    transport:\n      kind: local\n      log_dir: ./.trellara/shop\nservice:\n  relay_listen: 127.0.0.1:0\n  apply_listen: 127.0.0.1:0\n",
    )
    .expect("config");
    for command in ["relay", "apply"] {
        let out = trellara_in(dir.path(), &[command, "--config", "local.yml"], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{command}: {err}");
        assert!(
            err.contains("flow shop has several sinks")
                && err.contains("trellara run --config CONFIG --flow shop --follow"),
            "{command}: {err}"
        );
        assert!(!err.contains("connect"), "{command} connected: {err}");
    }
    assert!(
        !dir.path().join(".trellara").exists(),
        "nothing written for a refused service"
    );
}

/// `--fence-timeout` bounds a one-table reseed's hold: without `--table`
/// it would be ignored, so it is refused before the config is read.
#[test]
fn reseed_refuses_a_fence_timeout_without_a_table() {
    let out = trellara(&[
        "reseed",
        "--config",
        "/nonexistent.yml",
        "--fence-timeout",
        "5",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--table"), "{err}");
}

/// `schema ddl-plan` prints a change's contract from the config alone
/// (its URLs name a host that does not exist and are never resolved):
/// the flow's mode unless `--apply-mode` says otherwise, a rename held
/// until its mapping, a drop blocked with its fixes; bad input refused
/// with the form to use; so is `schema accept` with a table name SQL
/// would not read.
#[test]
fn schema_ddl_plan_prints_the_contract_and_touches_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("trellara.yml"),
        "schema_version: 2\nflows:\n  - name: shop\n    source: {url_env: NOT_SET_SOURCE}\n    sinks:\n      - {name: main, target: {url: postgresql://u@nowhere.invalid/t}}\n      - {name: lake, target: {url: postgresql://u@nowhere.invalid/l}}\n    tables: [public.orders]\n    schema: {apply_mode: staged}\n",
    )
    .expect("config");
    let plan = |extra: &[&str]| {
        let mut args = vec!["schema", "ddl-plan", "--format", "json"];
        args.extend(extra);
        let out = trellara_in(dir.path(), &args, &[]);
        let json: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        (
            out.status.code(),
            json,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, c, err) = plan(&["--change", "add_nullable_column:public.orders.note"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        (&c["compatibility"], &c["decision"], &c["apply_mode"]),
        (
            &"compatible".into(),
            &"stage-then-apply".into(),
            &"staged".into()
        ),
        "{c:#}"
    );
    assert_eq!(c["affected_sinks"], serde_json::json!(["main", "lake"]));
    assert_eq!(c["acknowledgement"].as_array().map(Vec::len), Some(2));
    assert!(
        c["barrier_id"]
            .as_str()
            .is_some_and(|b| b.starts_with("ddl-"))
    );
    let (_, auto, _) = plan(&[
        "--change",
        "add_nullable_column:public.orders.note",
        "--apply-mode",
        "auto",
    ]);
    assert_eq!(auto["decision"], "auto-apply");
    assert_eq!(auto["barrier_id"], c["barrier_id"]);
    let (_, rename, _) = plan(&["--change", "rename_column:public.orders.cust"]);
    assert_eq!(
        (&rename["compatibility"], &rename["decision"]),
        (&"requires-mapping".into(), &"manual-review".into())
    );
    let (_, drop, _) = plan(&["--change", "drop_column:public.orders.note"]);
    assert_eq!(drop["decision"], "block");
    assert!(
        drop["fix"].as_array().is_some_and(|f| f.iter().any(|x| x
            .as_str()
            .is_some_and(|x| x.contains("reseed --flow shop --table public.orders")))),
        "{drop:#}"
    );
    let text = trellara_in(
        dir.path(),
        &[
            "schema",
            "ddl-plan",
            "--change",
            "widen_type:public.orders.total",
        ],
        &[],
    );
    let out = String::from_utf8_lossy(&text.stdout);
    assert!(
        out.contains("decision           stage-then-apply") && out.contains("nothing was touched"),
        "{out}"
    );
    let (code, _, err) = plan(&["--change", "add_column:public.orders.note"]);
    assert!(
        code == Some(1) && err.contains("add_nullable_column"),
        "{err}"
    );
    let (code, _, err) = plan(&["--change", "drop_column:public.orders"]);
    assert!(
        code == Some(1) && err.contains("drop_column:public.orders.COLUMN"),
        "{err}"
    );
    // A table name SQL would not read is named before anything connects.
    let accept = trellara_in(
        dir.path(),
        &["schema", "accept", "--flow", "shop", "--table", "public."],
        &[],
    );
    assert_eq!(accept.status.code(), Some(1));
    let err = String::from_utf8_lossy(&accept.stderr);
    assert!(err.contains("--table \"public.\""), "{err}");
    assert!(!err.contains("nowhere.invalid"), "{err}");
}
