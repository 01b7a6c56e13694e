//! A Kafka-compatible broker for tests: the static `tansu` binary that
//! `scripts/setup` installs (located by `TRELLARA_TANSU`, then the env file
//! `/opt/trellara/pg.env`), started on a free 127.0.0.1 port with memory
//! storage. Memory storage is not durable across broker restarts: a test
//! that restarts the broker must not expect its topics back.
//!
//! A [`Broker`] never outlives its value: it is killed on drop, and (through
//! the parent-death signal) when the test process dies. A missing binary
//! fails tests under `CI=true` and skips them (loudly) elsewhere.

use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The variable (or env-file key) naming the broker binary.
pub const TANSU_VAR: &str = "TRELLARA_TANSU";

#[derive(Debug)]
pub struct Broker {
    child: Child,
    port: u16,
}

fn locate() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(TANSU_VAR) {
        return Some(PathBuf::from(path));
    }
    crate::major::env_file_value(TANSU_VAR).map(PathBuf::from)
}

impl Broker {
    /// Starts a broker, or `None` (skipped, said on stderr) when none is
    /// installed outside CI.
    pub fn start() -> Option<Broker> {
        let Some(binary) = locate().filter(|p| p.is_file()) else {
            let hint = "no tansu broker installed (TRELLARA_TANSU): run scripts/setup";
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{hint}");
            }
            eprintln!("trellara-tests: skipping a Kafka test: {hint}");
            return None;
        };
        let port = TcpListener::bind((crate::HOST, 0))
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or_else(|e| panic!("pick a free port: {e}"));
        let url = format!("tcp://{}:{port}", crate::HOST);
        let mut command = Command::new(&binary);
        command
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", "memory://tansu/"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork
        // and exec.
        unsafe {
            command.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                    .map_err(std::io::Error::from)
            });
        }
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        let broker = Broker { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((crate::HOST, port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the broker did not listen on {url} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(broker)
    }

    /// `host:port` for `bootstrap.servers`.
    pub fn bootstrap(&self) -> String {
        format!("{}:{}", crate::HOST, self.port)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
