//! The replication client over TLS with SCRAM-SHA-256 against a real
//! server: verify-full with the server's CA, require without one, a wrong CA
//! refused, a wrong password refused as definite (not retried), and a
//! capture session streaming over the encrypted connection (a large
//! transaction too, read in bursts).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use trellara_common::Lsn;
use trellara_external_relay::pgwire::{ConnectOptions, Connection, WireError};
use trellara_tests::{Cluster, ClusterOptions, Major, OS_USER, test_cluster};

fn openssl(args: &[&str], dir: &Path) {
    let status = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run openssl");
    assert!(status.success(), "openssl {args:?} failed");
}

/// A CA named `name` and a server certificate for 127.0.0.1 it signed.
/// Returns (CA certificate, server certificate, server key).
fn issue(dir: &Path, name: &str) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let (ca, ca_key) = (format!("{name}-ca.crt"), format!("{name}-ca.key"));
    let (crt, key, csr, ext) = (
        format!("{name}.crt"),
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.ext"),
    );
    openssl(
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}-ca"),
            "-keyout",
            &ca_key,
            "-out",
            &ca,
        ],
        dir,
    );
    openssl(
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            &key,
            "-out",
            &csr,
        ],
        dir,
    );
    std::fs::write(
        dir.join(&ext),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )
    .expect("ext file");
    openssl(
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &crt,
        ],
        dir,
    );
    (dir.join(ca), dir.join(crt), dir.join(key))
}

/// Turns on TLS with a fresh certificate and requires SCRAM over TLS for
/// the role `rep`. Returns the CA (the self-signed certificate) path.
fn secure(cluster: &Cluster, dir: &Path) -> std::path::PathBuf {
    let (ca, crt, key) = issue(dir, "server");
    let data = cluster.data_dir();
    for (from, to) in [(&crt, "server.crt"), (&key, "server.key")] {
        let dest = data.join(to);
        std::fs::copy(from, &dest).expect("copy cert");
        Command::new("chown")
            .arg(OS_USER)
            .arg(&dest)
            .status()
            .expect("chown");
        Command::new("chmod")
            .arg("600")
            .arg(&dest)
            .status()
            .expect("chmod");
    }
    let hba = data.join("pg_hba.conf");
    let old = std::fs::read_to_string(&hba).expect("read pg_hba.conf");
    std::fs::write(
        &hba,
        format!("hostssl all rep 127.0.0.1/32 scram-sha-256\nhostssl replication rep 127.0.0.1/32 scram-sha-256\nhost all rep 127.0.0.1/32 reject\n{old}"),
    )
    .expect("write pg_hba.conf");
    cluster.psql("ALTER SYSTEM SET ssl = on");
    cluster.psql("ALTER SYSTEM SET password_encryption = 'scram-sha-256'");
    cluster.psql("SELECT pg_reload_conf()");
    std::thread::sleep(Duration::from_millis(300));
    cluster.psql("CREATE ROLE rep LOGIN REPLICATION PASSWORD 'correct horse'");
    ca
}

fn options(cluster: &Cluster, query: &str, password: &str) -> ConnectOptions {
    format!(
        "postgresql://rep:{}@127.0.0.1:{}/postgres?{query}",
        password.replace(' ', "%20"),
        cluster.port()
    )
    .parse()
    .expect("url")
}

fn connect(o: &ConnectOptions) -> Result<Connection, WireError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(Connection::connect(o))
}

#[test]
fn tls_and_scram_on_a_real_server() {
    // PostgreSQL 15 from Debian: the 16-18 wheels are built without SSL.
    let Some(cluster) = test_cluster(Major::Pg15, &ClusterOptions::new()) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = secure(&cluster, dir.path());
    let ca_arg = format!("sslrootcert={}", ca.display());

    let verified = options(
        &cluster,
        &format!("sslmode=verify-full&{ca_arg}"),
        "correct horse",
    );
    let conn = connect(&verified).expect("verify-full with the right CA and password");
    assert!(conn.backend_pid() > 0);
    assert!(
        connect(&options(&cluster, "sslmode=require", "correct horse")).is_ok(),
        "require: encrypted, unverified"
    );

    let (other_ca, _, _) = issue(dir.path(), "other");
    let wrong_ca = options(
        &cluster,
        &format!("sslmode=verify-full&sslrootcert={}", other_ca.display()),
        "correct horse",
    );
    let err = connect(&wrong_ca).expect_err("a certificate from another CA is refused");
    assert!(matches!(err, WireError::Tls(_)), "{err}");
    assert!(!err.is_transient());

    let err = connect(&options(&cluster, "sslmode=verify-full", "correct horse"))
        .expect_err("no CA given: the public web roots do not trust a self-signed certificate");
    assert!(matches!(err, WireError::Tls(_)), "{err}");

    let err = connect(&options(
        &cluster,
        &format!("sslmode=verify-full&{ca_arg}"),
        "wrong",
    ))
    .expect_err("wrong password");
    assert!(
        matches!(&err, WireError::Server(e) if e.code == "28P01"),
        "{err}"
    );
    assert!(!err.is_transient(), "a wrong password is not retried");

    let err = connect(&options(&cluster, "sslmode=disable", "correct horse"))
        .expect_err("plaintext is rejected by pg_hba");
    assert!(
        matches!(&err, WireError::Server(e) if e.code == "28000"),
        "{err}"
    );

    // A capture session end to end over TLS + SCRAM.
    cluster.psql(
        "CREATE TABLE sales (id bigint PRIMARY KEY);
         CREATE PUBLICATION p FOR TABLE sales;",
    );
    let log_dir = tempfile::tempdir().expect("tempdir");
    let config = trellara_relay::capture::CaptureConfig {
        source: verified,
        slot: "tls_s".into(),
        publications: vec!["p".into()],
        create_slot: true,
        source_id: "src".into(),
        dataset_id: "sales".into(),
        log_dir: log_dir.path().to_path_buf(),
        proto_version: trellara_external_relay::pgoutput::ProtoVersion::V2,
        memory_budget: 1 << 20,
        chunk_bytes: 1 << 20,
        status_interval: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
        pinned: Default::default(),
        schemas: Default::default(),
        floor: Default::default(),
        progress: None,
        begun: None,
        observe: None,
        rejoin_at: None,
        ddl: None,
    };
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(trellara_relay::capture::run(config, async {
                let _ = rx.await;
            }))
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.psql_value("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'tls_s'")
        != "1"
    {
        assert!(Instant::now() < deadline, "slot not created over TLS");
        std::thread::sleep(Duration::from_millis(50));
    }
    cluster.psql("INSERT INTO sales VALUES (1)");
    // And one large enough to be read in bursts (paced): over TLS each read
    // yields one record, which must not be taken for a dry socket.
    cluster.psql("INSERT INTO sales SELECT g FROM generate_series(2, 50001) g");
    let end: Lsn = cluster
        .psql_value("SELECT pg_current_wal_lsn()")
        .parse()
        .expect("lsn");
    loop {
        let c: Lsn = cluster
            .psql_value(
                "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'tls_s'",
            )
            .parse()
            .expect("lsn");
        if c >= end {
            break;
        }
        assert!(Instant::now() < deadline, "not confirmed over TLS");
        std::thread::sleep(Duration::from_millis(50));
    }
    let ssl = cluster.psql_value(
        "SELECT bool_and(ssl)::text FROM pg_stat_ssl JOIN pg_stat_replication USING (pid)",
    );
    assert_eq!(ssl, "true", "the walsender connection is encrypted");
    let _ = tx.send(());
    let stats = handle.join().expect("thread").expect("capture ok");
    let (log, _) = trellara_relay::log::Log::open(
        trellara_relay::log::storage::FsStorage::new(),
        log_dir.path(),
        trellara_relay::log::LogConfig::default(),
    )
    .expect("open log");
    let changes: Vec<(u64, usize)> = log
        .read_from(log.first_offset())
        .expect("read")
        .map(|r| {
            let env = trellara_common::envelope::decode(&r.expect("record").payload)
                .expect("valid envelope");
            (env.commit_lsn, env.changes.len())
        })
        .collect();
    assert_eq!(stats.envelopes, changes.len() as u64);
    let rows_of = |i: usize| {
        changes
            .iter()
            .filter(|(c, _)| *c == changes[i].0)
            .map(|(_, n)| n)
            .sum::<usize>()
    };
    assert_eq!(
        (rows_of(0), rows_of(changes.len() - 1)),
        (1, 50_000),
        "both transactions whole over TLS: {changes:?}"
    );
}

/// Plain SQL sessions (snapshot copy, apply, verify use them) through
/// tokio-postgres with the same TLS: verify-full with the right CA is
/// encrypted (pg_stat_ssl says so), a wrong CA and a server without TLS are
/// refused when TLS is required.
#[test]
fn sql_sessions_use_the_same_tls() {
    let Some(cluster) = test_cluster(Major::Pg15, &ClusterOptions::new()) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = secure(&cluster, dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let sql = |query: &str| -> Result<bool, String> {
        let options = options(&cluster, query, "correct horse");
        rt.block_on(async {
            let (config, tls) =
                trellara_external_relay::pgwire::sql_config(&options).map_err(|e| e.to_string())?;
            let (client, connection) = config.connect(tls).await.map_err(|e| e.to_string())?;
            tokio::spawn(connection);
            let row = client
                .query_one(
                    "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
                    &[],
                )
                .await
                .map_err(|e| e.to_string())?;
            Ok(row.get::<_, bool>(0))
        })
    };
    assert_eq!(
        sql(&format!("sslmode=verify-full&sslrootcert={}", ca.display())),
        Ok(true),
        "verify-full with the right CA is an encrypted session"
    );
    assert_eq!(sql("sslmode=require"), Ok(true));
    let (other_ca, _, _) = issue(dir.path(), "other");
    let wrong = sql(&format!(
        "sslmode=verify-full&sslrootcert={}",
        other_ca.display()
    ));
    assert!(
        wrong.is_err(),
        "a certificate from another CA is refused: {wrong:?}"
    );
    // pg_hba rejects rep without TLS: sslmode=disable cannot get in.
    let plain = sql("sslmode=disable");
    assert!(plain.is_err(), "{plain:?}");
}

#[test]
fn slots_with_exported_snapshot_and_failover() {
    for major in [Major::Pg16, Major::Pg17] {
        let Some(cluster) = test_cluster(major, &ClusterOptions::new()) else {
            continue;
        };
        let o: ConnectOptions = cluster.connection_string("postgres").parse().expect("url");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut conn = rt.block_on(Connection::connect(&o)).expect("connect");
        let system = rt.block_on(conn.identify_system()).expect("identify");
        assert!(system.system_id > 0 && system.timeline >= 1);
        let created = rt
            .block_on(conn.create_logical_slot("exported", true, false))
            .expect("create");
        let snapshot = created.snapshot_name.expect("exported snapshot name");
        assert!(created.consistent_point.is_valid());
        // The snapshot is importable while the creating session stays idle.
        let mut reader =
            postgres::Client::connect(&cluster.connection_string("postgres"), postgres::NoTls)
                .expect("reader");
        let mut tx = reader
            .build_transaction()
            .isolation_level(postgres::IsolationLevel::RepeatableRead)
            .start()
            .expect("begin");
        tx.batch_execute(&format!("SET TRANSACTION SNAPSHOT '{snapshot}'"))
            .expect("import the exported snapshot");
        tx.commit().expect("commit");

        let failover = rt.block_on(conn.create_logical_slot("failover_s", false, true));
        if major >= Major::Pg17 {
            failover.expect("FAILOVER slot on 17+");
            let info = rt
                .block_on(conn.slot_info("failover_s"))
                .expect("info")
                .expect("exists");
            assert_eq!(info.plugin.as_deref(), Some("pgoutput"));
            assert_eq!(
                cluster.psql_value(
                    "SELECT failover::text FROM pg_replication_slots WHERE slot_name = 'failover_s'"
                ),
                "true"
            );
        } else {
            let err = failover.expect_err("no failover slots before 17");
            assert!(err.to_string().contains("PostgreSQL 17"), "{err}");
        }
        assert!(
            rt.block_on(conn.slot_info("missing"))
                .expect("query")
                .is_none()
        );
    }
}
