//! One throwaway PostgreSQL cluster per [`Cluster`] value.
//!
//! Invariants:
//! - Everything a cluster writes lives in one temp dir: the data dir `data/`, the unix
//!   socket at the temp dir's root and the server log `data/trellara-server.log`.
//! - The server listens on 127.0.0.1 only, on a port that was free when picked; a start
//!   that loses the port to another process is retried on a new port.
//! - initdb and postgres never run as root: when the test runs as root they run as the
//!   OS user [`OS_USER`] through `runuser`, and the temp dir belongs to that user.
//! - Every server is stopped and its temp dir removed: by `Drop` (also while unwinding
//!   from a panic) with `pg_ctl stop -m immediate`, falling back to SIGKILL of the
//!   postmaster; and, if the test process dies without running `Drop` (SIGKILL,
//!   abort, a test runner's timeout), by a watchdog in its own process group that
//!   waits for the test process to exit.
//! - Unless told otherwise, a server that has `output_plugin_libraries`
//!   (CVE-2026-6471 minors) allows `pgoutput`, `test_decoding` and `trellara`, and a
//!   server without it is never given that setting (it would refuse to start).

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::{self, Gid, Pid, Uid, User};
use postgres::{Client, NoTls, SimpleQueryMessage};
use tempfile::TempDir;

use crate::major::{Install, Major, MissingMajor};

/// The unprivileged OS user (created by `scripts/setup`) that runs initdb and postgres
/// when the tests run as root.
pub const OS_USER: &str = "trellara";

/// The superuser initdb creates; connections use trust authentication.
pub const SUPERUSER: &str = "postgres";

/// The address every cluster listens on.
pub const HOST: &str = "127.0.0.1";

const LOG_FILE: &str = "trellara-server.log";
const CONF_FILE: &str = "trellara.conf";
const PG_CTL_TIMEOUT_SECS: &str = "60";
const START_ATTEMPTS: u32 = 5;
const DEFAULT_OUTPUT_PLUGINS: [&str; 3] = ["pgoutput", "test_decoding", "trellara"];
/// libpq environment variables that would redirect initdb/pg_ctl to another cluster.
const PG_ENV_VARS: [&str; 8] = [
    "PGDATA",
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGUSER",
    "PGDATABASE",
    "PGOPTIONS",
    "PGSERVICE",
];

/// Why a cluster could not be started or used.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("PostgreSQL binaries are missing")]
    Missing(#[source] MissingMajor),
    #[error(
        "OS user `{OS_USER}` does not exist (initdb and postgres refuse to run as root); \
         run scripts/setup"
    )]
    NoOsUser,
    #[error("could not look up OS user `{OS_USER}`")]
    OsUserLookup(#[source] nix::Error),
    #[error("could not {action}")]
    Io {
        action: String,
        #[source]
        source: io::Error,
    },
    #[error("could not change the owner of {path} to `{OS_USER}`")]
    Chown {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("`{command}` failed ({status}):\n{output}")]
    Command {
        command: String,
        status: ExitStatus,
        output: String,
    },
    #[error("{major} did not start after {attempts} attempt(s); server log tail:\n{log_tail}")]
    StartFailed {
        major: Major,
        attempts: u32,
        log_tail: String,
        #[source]
        cause: Box<ClusterError>,
    },
    #[error("{major} started but could not be prepared for tests; server log tail:\n{log_tail}")]
    NotReady {
        major: Major,
        log_tail: String,
        #[source]
        cause: Box<ClusterError>,
    },
    #[error("invalid setting name `{0}`: use letters, digits, `_` and `.` only")]
    InvalidSettingName(String),
    #[error("{context}")]
    Sql {
        context: String,
        #[source]
        source: postgres::Error,
    },
    #[error("unexpected answer to `{query}`: {answer:?}")]
    UnexpectedAnswer { query: String, answer: String },
    #[error("the server in {bindir} reports server_version_num {version_num}, not {expected}")]
    WrongMajor {
        expected: Major,
        bindir: PathBuf,
        version_num: u32,
    },
    #[error("output_plugin_libraries is `{actual}` after reload, expected `{expected}`")]
    OutputPluginLibraries { expected: String, actual: String },
}

impl ClusterError {
    /// The server's error (SQLSTATE, message, hint) when this is a failed SQL command.
    pub fn db_error(&self) -> Option<&postgres::error::DbError> {
        match self {
            ClusterError::Sql { source, .. } => source.as_db_error(),
            _ => None,
        }
    }
}

/// Extra configuration for [`Cluster::start`]. The default is the harness baseline
/// (see [`Cluster::start`]) with `output_plugin_libraries` allowing `pgoutput`,
/// `test_decoding` and `trellara` where the server has that setting.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    settings: Vec<(String, String)>,
    shared_preload_libraries: Vec<String>,
    output_plugin_libraries: Option<Vec<String>>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            settings: Vec::new(),
            shared_preload_libraries: Vec::new(),
            output_plugin_libraries: Some(
                DEFAULT_OUTPUT_PLUGINS
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            ),
        }
    }
}

impl ClusterOptions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `name = 'value'` to the server configuration (the value is quoted and
    /// escaped here; list settings take `"a, b"`). Later settings win, and these win
    /// over the harness baseline.
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Adds a library to `shared_preload_libraries` (e.g. `"trellara"`).
    pub fn shared_preload_library(mut self, library: impl Into<String>) -> Self {
        self.shared_preload_libraries.push(library.into());
        self
    }

    /// Sets the plugins allowed by `output_plugin_libraries` on servers that have it
    /// (an empty list allows none).
    pub fn output_plugin_libraries<I, S>(mut self, plugins: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.output_plugin_libraries = Some(plugins.into_iter().map(Into::into).collect());
        self
    }

    /// Leaves `output_plugin_libraries` at the server's default (`pgoutput,
    /// test_decoding` in 15.20 and 18.6, so `trellara` is refused), e.g. to test that
    /// refusal.
    pub fn keep_default_output_plugin_libraries(mut self) -> Self {
        self.output_plugin_libraries = None;
        self
    }
}

/// A running PostgreSQL server in a temp dir, stopped and removed on drop.
#[derive(Debug)]
pub struct Cluster {
    install: Install,
    /// `Some` until drop; the temp dir holding `data/` and the unix socket.
    dir: Option<TempDir>,
    root: PathBuf,
    owner: Option<(Uid, Gid)>,
    watchdog: Option<Child>,
    port: u16,
    server_version_num: u32,
    server_version: String,
    has_output_plugin_libraries: bool,
}

impl Cluster {
    /// Creates a cluster with initdb (`--auth=trust -U postgres --encoding=UTF8
    /// --locale=C --no-sync`) and starts it on a free 127.0.0.1 port with
    /// `wal_level=logical`, 16 replication slots and WAL senders, `fsync=off`,
    /// `shared_buffers=32MB`, plus `options`. Fails if the server is not of `major`.
    pub fn start(major: Major, options: &ClusterOptions) -> Result<Cluster, ClusterError> {
        let install = major.locate().map_err(ClusterError::Missing)?;
        for (name, _) in &options.settings {
            validate_setting_name(name)?;
        }
        let owner = if unistd::geteuid().is_root() {
            let user = User::from_name(OS_USER)
                .map_err(ClusterError::OsUserLookup)?
                .ok_or(ClusterError::NoOsUser)?;
            Some((user.uid, user.gid))
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("trellara-pg{}-", major.number()))
            .tempdir()
            .map_err(|source| ClusterError::Io {
                action: "create a temp dir for the cluster".into(),
                source,
            })?;
        // From here on `cluster` owns the temp dir: any early return drops it, which
        // stops whatever was started and removes the dir.
        let mut cluster = Cluster {
            install,
            root: dir.path().to_path_buf(),
            dir: Some(dir),
            owner,
            watchdog: None,
            port: 0,
            server_version_num: 0,
            server_version: String::new(),
            has_output_plugin_libraries: false,
        };
        cluster.chown(&cluster.root)?;
        cluster.watchdog = Some(cluster.spawn_watchdog()?);
        cluster.initdb()?;
        cluster.start_server(options)?;
        let prepared =
            cluster
                .inspect_server()
                .and_then(|()| match &options.output_plugin_libraries {
                    Some(plugins) => cluster.allow_output_plugins(plugins),
                    None => Ok(()),
                });
        match prepared {
            Ok(()) => Ok(cluster),
            Err(cause) => Err(ClusterError::NotReady {
                major,
                log_tail: tail(&cluster.log_contents(), 40),
                cause: Box::new(cause),
            }),
        }
    }

    pub fn major(&self) -> Major {
        self.install.major()
    }

    /// The installation the server runs from (bin dir, `pg_config`, other programs).
    pub fn install(&self) -> &Install {
        &self.install
    }

    pub fn host(&self) -> &'static str {
        HOST
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory holding the server's unix socket.
    pub fn socket_dir(&self) -> &Path {
        &self.root
    }

    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    /// `server_version_num`, e.g. 170009.
    pub fn server_version_num(&self) -> u32 {
        self.server_version_num
    }

    /// The version number part of `server_version`, e.g. `15.20` or `16.2`.
    pub fn server_version(&self) -> &str {
        &self.server_version
    }

    /// Whether the server has the `output_plugin_libraries` setting.
    pub fn has_output_plugin_libraries(&self) -> bool {
        self.has_output_plugin_libraries
    }

    /// `postgresql://postgres@127.0.0.1:PORT/DB`.
    pub fn connection_string(&self, db: &str) -> String {
        format!("postgresql://{SUPERUSER}@{HOST}:{}/{db}", self.port)
    }

    /// `host=127.0.0.1 port=PORT user=postgres dbname=DB` (libpq key-value form).
    pub fn connection_config(&self, db: &str) -> String {
        format!(
            "host={HOST} port={} user={SUPERUSER} dbname={db}",
            self.port
        )
    }

    /// The server log so far (or a note saying why it could not be read).
    pub fn log_contents(&self) -> String {
        let path = self.log_path();
        fs::read_to_string(&path)
            .unwrap_or_else(|err| format!("<could not read {}: {err}>", path.display()))
    }

    /// A new blocking connection to database `db` as the superuser.
    pub fn try_connect(&self, db: &str) -> Result<Client, ClusterError> {
        postgres::Config::new()
            .host(HOST)
            .port(self.port)
            .user(SUPERUSER)
            .dbname(db)
            .application_name("trellara-tests")
            .connect_timeout(Duration::from_secs(10))
            .connect(NoTls)
            .map_err(|source| ClusterError::Sql {
                context: format!("connect to {}", self.connection_string(db)),
                source,
            })
    }

    /// A new blocking connection to the `postgres` database; panics with the server
    /// log if the server cannot be reached.
    pub fn connect(&self) -> Client {
        self.try_connect("postgres")
            .unwrap_or_else(|err| self.fail("connect", &err))
    }

    /// Runs `sql` (one or more statements, simple query protocol) in the `postgres`
    /// database on a new connection; returns the rows of every statement as text,
    /// NULL as `None`.
    pub fn try_psql(&self, sql: &str) -> Result<Vec<Vec<Option<String>>>, ClusterError> {
        let mut client = self.try_connect("postgres")?;
        simple_rows(&mut client, sql)
    }

    /// [`Cluster::try_psql`] that panics (with the SQL, the error and the server log)
    /// on failure and renders NULL as an empty string, like psql.
    pub fn psql(&self, sql: &str) -> Vec<Vec<String>> {
        match self.try_psql(sql) {
            Ok(rows) => rows
                .into_iter()
                .map(|row| row.into_iter().map(Option::unwrap_or_default).collect())
                .collect(),
            Err(err) => self.fail(&format!("run SQL `{sql}`"), &err),
        }
    }

    /// The first column of the first row of `sql` (panics like [`Cluster::psql`] if
    /// there is none).
    pub fn psql_value(&self, sql: &str) -> String {
        let rows = self.psql(sql);
        match rows.first().and_then(|row| row.first()) {
            Some(value) => value.clone(),
            None => panic!("SQL `{sql}` returned no value on {}", self.major()),
        }
    }

    /// Restarts the server (`pg_ctl restart -m fast`) on the same port and data dir.
    pub fn restart(&mut self) -> Result<(), ClusterError> {
        self.restart_mode("fast")
    }

    /// Crashes the server and starts it again (`pg_ctl restart -m
    /// immediate`): WAL still in its shared buffers (not yet written to the
    /// OS) is gone, and the server runs crash recovery.
    pub fn crash_restart(&mut self) -> Result<(), ClusterError> {
        self.restart_mode("immediate")
    }

    fn restart_mode(&mut self, mode: &str) -> Result<(), ClusterError> {
        let data = self.data_dir();
        let log = self.log_path();
        let mut cmd = self.owner_command(&self.install.bin("pg_ctl"));
        cmd.arg("restart")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .args(["-m", mode, "-w", "-t", PG_CTL_TIMEOUT_SECS]);
        run(cmd, "pg_ctl restart")?;
        Ok(())
    }

    /// Panics with `what`, the error chain and the tail of the server log.
    fn fail(&self, what: &str, err: &ClusterError) -> ! {
        panic!(
            "could not {what} on {} (port {}): {}\nserver log tail:\n{}",
            self.major(),
            self.port,
            error_chain(err),
            tail(&self.log_contents(), 40)
        )
    }

    fn log_path(&self) -> PathBuf {
        self.data_dir().join(LOG_FILE)
    }

    /// A command for `program` that runs as the cluster's owner (via `runuser` when
    /// we are root), in the temp dir, without libpq environment overrides.
    fn owner_command(&self, program: &Path) -> Command {
        let mut cmd = if self.owner.is_some() {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", OS_USER, "--"]).arg(program);
            cmd
        } else {
            Command::new(program)
        };
        cmd.current_dir(&self.root).stdin(Stdio::null());
        for var in PG_ENV_VARS {
            cmd.env_remove(var);
        }
        cmd
    }

    fn chown(&self, path: &Path) -> Result<(), ClusterError> {
        if let Some((uid, gid)) = self.owner {
            unistd::chown(path, Some(uid), Some(gid)).map_err(|source| ClusterError::Chown {
                path: path.to_path_buf(),
                source,
            })?;
        }
        Ok(())
    }

    /// Starts a process, in its own process group so that signals to the test's group
    /// spare it, that waits for this test process to exit and then stops the server
    /// (SIGQUIT = immediate shutdown, then SIGKILL) and removes the temp dir. `Drop`
    /// kills it once it has cleaned up itself.
    fn spawn_watchdog(&self) -> Result<Child, ClusterError> {
        const SCRIPT: &str = r#"
parent=$1 data=$2 dir=$3
while kill -0 "$parent" 2>/dev/null; do sleep 1; done
pid=$(head -n 1 "$data/postmaster.pid" 2>/dev/null)
if [ -n "$pid" ] && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF "$data"; then
    kill -QUIT "$pid" 2>/dev/null
    i=0
    while kill -0 "$pid" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
    kill -KILL "$pid" 2>/dev/null
fi
rm -rf "$dir"
"#;
        Command::new("/bin/sh")
            .arg("-c")
            .arg(SCRIPT)
            .arg("trellara-pg-watchdog")
            .arg(std::process::id().to_string())
            .arg(self.data_dir())
            .arg(&self.root)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|source| ClusterError::Io {
                action: "spawn the cluster watchdog (/bin/sh)".into(),
                source,
            })
    }

    fn initdb(&self) -> Result<(), ClusterError> {
        let mut cmd = self.owner_command(&self.install.bin("initdb"));
        cmd.arg("-D").arg(self.data_dir()).args([
            "--auth=trust",
            "-U",
            SUPERUSER,
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ]);
        run(cmd, "initdb")?;
        let conf = self.data_dir().join("postgresql.conf");
        append_file(&conf, &format!("\ninclude '{CONF_FILE}'\n"))
    }

    fn write_conf(&self, options: &ClusterOptions) -> Result<(), ClusterError> {
        let mut settings: Vec<(String, String)> = vec![
            ("listen_addresses".into(), HOST.into()),
            ("port".into(), self.port.to_string()),
            (
                "unix_socket_directories".into(),
                self.root.to_string_lossy().into_owned(),
            ),
            ("wal_level".into(), "logical".into()),
            ("max_replication_slots".into(), "16".into()),
            ("max_wal_senders".into(), "16".into()),
            ("fsync".into(), "off".into()),
            ("shared_buffers".into(), "32MB".into()),
            ("logging_collector".into(), "off".into()),
            ("log_line_prefix".into(), "%m [%p] %q%a ".into()),
        ];
        if !options.shared_preload_libraries.is_empty() {
            settings.push((
                "shared_preload_libraries".into(),
                options.shared_preload_libraries.join(", "),
            ));
        }
        settings.extend(options.settings.iter().cloned());
        let mut text = String::from("# Written by trellara-tests for this cluster.\n");
        for (name, value) in &settings {
            // writeln! to a String cannot fail.
            let _ = writeln!(text, "{name} = '{}'", quote_conf_value(value));
        }
        let path = self.data_dir().join(CONF_FILE);
        fs::write(&path, text).map_err(|source| ClusterError::Io {
            action: format!("write {}", path.display()),
            source,
        })?;
        self.chown(&path)
    }

    /// Picks a port, writes the configuration and runs `pg_ctl start -w`; retries on
    /// a new port when the server could not bind.
    fn start_server(&mut self, options: &ClusterOptions) -> Result<(), ClusterError> {
        let log = self.log_path();
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.port = free_port()?;
            self.write_conf(options)?;
            let log_len_before = fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
            let mut cmd = self.owner_command(&self.install.bin("pg_ctl"));
            cmd.arg("start")
                .arg("-D")
                .arg(self.data_dir())
                .arg("-l")
                .arg(&log)
                .args(["-w", "-t", PG_CTL_TIMEOUT_SECS]);
            let err = match run(cmd, "pg_ctl start") {
                Ok(_) => return Ok(()),
                Err(err) => err,
            };
            let log_text = self.log_contents();
            let new_log = log_text
                .get(usize::try_from(log_len_before).unwrap_or(0)..)
                .unwrap_or(&log_text);
            let lost_port = new_log.contains("could not bind")
                || new_log.contains("Address already in use")
                || new_log.contains("could not create any TCP/IP sockets");
            if !(lost_port && attempt < START_ATTEMPTS) {
                return Err(ClusterError::StartFailed {
                    major: self.major(),
                    attempts: attempt,
                    log_tail: tail(&log_text, 40),
                    cause: Box::new(err),
                });
            }
        }
    }

    fn inspect_server(&mut self) -> Result<(), ClusterError> {
        let mut client = self.try_connect("postgres")?;
        let num_query = "SHOW server_version_num";
        let num_text = single_value(&mut client, num_query)?;
        self.server_version_num =
            num_text
                .trim()
                .parse()
                .map_err(|_| ClusterError::UnexpectedAnswer {
                    query: num_query.into(),
                    answer: num_text.clone(),
                })?;
        let version = single_value(&mut client, "SHOW server_version")?;
        // "15.20 (Debian 15.20-0+deb12u1)" -> "15.20"
        self.server_version = version
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned();
        if Major::from_server_version_num(self.server_version_num) != Some(self.major()) {
            return Err(ClusterError::WrongMajor {
                expected: self.major(),
                bindir: self.install.bindir().to_path_buf(),
                version_num: self.server_version_num,
            });
        }
        let rows = simple_rows(
            &mut client,
            "SELECT 1 FROM pg_settings WHERE name = 'output_plugin_libraries'",
        )?;
        self.has_output_plugin_libraries = !rows.is_empty();
        Ok(())
    }

    /// Sets `output_plugin_libraries` (a list, quoted per item) on servers that have
    /// it, reloads (restarts if the setting needs it) and waits until new sessions
    /// see the value.
    fn allow_output_plugins(&mut self, plugins: &[String]) -> Result<(), ClusterError> {
        if !self.has_output_plugin_libraries {
            return Ok(());
        }
        let mut client = self.try_connect("postgres")?;
        let list = if plugins.is_empty() {
            "''".to_owned()
        } else {
            plugins
                .iter()
                .map(|p| format!("'{}'", p.replace('\'', "''")))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let alter = format!("ALTER SYSTEM SET output_plugin_libraries = {list}");
        simple_rows(&mut client, &alter)?;
        let context = single_value(
            &mut client,
            "SELECT context FROM pg_settings WHERE name = 'output_plugin_libraries'",
        )?;
        drop(client);
        if context == "postmaster" {
            self.restart()?;
        } else {
            simple_rows(
                &mut self.try_connect("postgres")?,
                "SELECT pg_reload_conf()",
            )?;
        }
        let expected = plugins.join(", ");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let actual = single_value(
                &mut self.try_connect("postgres")?,
                "SHOW output_plugin_libraries",
            )?;
            if normalize_list(&actual) == normalize_list(&expected) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ClusterError::OutputPluginLibraries { expected, actual });
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server and removes the temp dir; never panics.
    fn teardown(&mut self) {
        let data = self.data_dir();
        let pid_file = data.join("postmaster.pid");
        if pid_file.exists() {
            let mut cmd = self.owner_command(&self.install.bin("pg_ctl"));
            cmd.arg("stop")
                .arg("-D")
                .arg(&data)
                .args(["-m", "immediate", "-w", "-t", "30"]);
            if let Err(err) = run(cmd, "pg_ctl stop") {
                eprintln!(
                    "trellara-tests: {} in {}: {}; killing the postmaster",
                    self.major(),
                    self.root.display(),
                    error_chain(&err)
                );
            }
            kill_postmaster(&data);
        }
        if let Some(mut watchdog) = self.watchdog.take() {
            // Our own child, by pid: it has nothing left to do.
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        if let Some(dir) = self.dir.take() {
            let path = dir.path().to_path_buf();
            if let Err(err) = dir.close() {
                eprintln!("trellara-tests: could not remove {}: {err}", path.display());
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// SIGKILLs the postmaster named in `data/postmaster.pid` if it is still alive and is
/// really this data dir's server (guards against pid reuse), then waits for it to go.
fn kill_postmaster(data: &Path) {
    let Ok(text) = fs::read_to_string(data.join("postmaster.pid")) else {
        return;
    };
    let Some(raw_pid) = text
        .lines()
        .next()
        .and_then(|l| l.trim().parse::<i32>().ok())
    else {
        return;
    };
    if !is_postmaster_of(raw_pid, data) {
        return;
    }
    if signal::kill(Pid::from_raw(raw_pid), Signal::SIGKILL).is_err() {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_postmaster_of(raw_pid, data) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
}

/// Whether `pid` is a live (not zombie: its cmdline would be empty) process whose
/// command line names `data`, as the postmaster's does (`postgres -D <data>`).
fn is_postmaster_of(pid: i32, data: &Path) -> bool {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&cmdline)
        .replace('\0', " ")
        .contains(&*data.to_string_lossy())
}

/// Runs `cmd` to completion; a non-zero exit is an error carrying its output.
fn run(mut cmd: Command, what: &str) -> Result<Output, ClusterError> {
    let output = cmd.output().map_err(|source| ClusterError::Io {
        action: format!("run {what} ({cmd:?})"),
        source,
    })?;
    if output.status.success() {
        Ok(output)
    } else {
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stderr));
        Err(ClusterError::Command {
            command: what.to_owned(),
            status: output.status,
            output: tail(&text, 40),
        })
    }
}

fn append_file(path: &Path, text: &str) -> Result<(), ClusterError> {
    use std::io::Write as _;
    fs::OpenOptions::new()
        .append(true)
        .open(path)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .map_err(|source| ClusterError::Io {
            action: format!("append to {}", path.display()),
            source,
        })
}

/// A port on 127.0.0.1 that was free a moment ago.
fn free_port() -> Result<u16, ClusterError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|source| ClusterError::Io {
            action: "bind 127.0.0.1:0 to find a free port".into(),
            source,
        })
}

fn simple_rows(client: &mut Client, sql: &str) -> Result<Vec<Vec<Option<String>>>, ClusterError> {
    let messages = client
        .simple_query(sql)
        .map_err(|source| ClusterError::Sql {
            context: format!("run `{sql}`"),
            source,
        })?;
    Ok(messages
        .iter()
        .filter_map(|message| match message {
            SimpleQueryMessage::Row(row) => Some(
                (0..row.len())
                    .map(|i| row.get(i).map(str::to_owned))
                    .collect(),
            ),
            _ => None,
        })
        .collect())
}

fn single_value(client: &mut Client, sql: &str) -> Result<String, ClusterError> {
    let rows = simple_rows(client, sql)?;
    rows.into_iter()
        .next()
        .and_then(|row| row.into_iter().next().flatten())
        .ok_or_else(|| ClusterError::UnexpectedAnswer {
            query: sql.to_owned(),
            answer: "no rows".into(),
        })
}

fn validate_setting_name(name: &str) -> Result<(), ClusterError> {
    let valid = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if valid {
        Ok(())
    } else {
        Err(ClusterError::InvalidSettingName(name.to_owned()))
    }
}

/// Escapes a value for a single-quoted postgresql.conf string.
fn quote_conf_value(value: &str) -> String {
    value.replace('\\', "\\\\").replace('\'', "''")
}

/// `"a, \"b\",c"` -> `["a", "b", "c"]`, for comparing list settings.
fn normalize_list(list: &str) -> Vec<String> {
    list.split(',')
        .map(|item| item.trim().trim_matches('"').to_owned())
        .filter(|item| !item.is_empty())
        .collect()
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `err: cause: cause...`: an error with its whole source chain, for panic messages
/// (`postgres::Error` alone displays as just "db error").
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    trellara_common::errors::chain(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conf_values_are_escaped() {
        assert_eq!(quote_conf_value(r"it's a\b"), r"it''s a\\b");
    }

    #[test]
    fn setting_names_are_checked() {
        assert!(validate_setting_name("trellara.slot_name").is_ok());
        assert!(validate_setting_name("x = 1\nfsync").is_err());
        assert!(validate_setting_name("").is_err());
    }

    #[test]
    fn lists_normalize() {
        assert_eq!(
            normalize_list("pgoutput, \"test_decoding\",trellara"),
            ["pgoutput", "test_decoding", "trellara"]
        );
        assert!(normalize_list("").is_empty());
    }

    #[test]
    fn tail_keeps_last_lines() {
        assert_eq!(tail("a\nb\nc", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }
}
