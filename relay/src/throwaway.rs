//! The evaluation loop's throwaway target: `init --evaluate` without a
//! target URL makes a local cluster under the flow's directory with the
//! source major's own server binaries, copies the flow's table definitions
//! into it, and records `target.throwaway: DIR` in the config. Any command
//! that needs the target starts it when it is down; teardown stops it and
//! removes the directory. It listens on a Unix socket inside its own
//! directory only, so it takes no port and no other process reaches it.
//!
//! initdb refuses root: as root the cluster runs as the dedicated system
//! user `scripts/setup` creates ([`OS_USER`]), as the quickstart's do.

use std::path::{Path, PathBuf};
use std::process::Command;
use tokio_postgres::Client;
use trellara_common::table_name::TableName;

/// The system user a root caller runs the cluster as.
pub const OS_USER: &str = "trellara";
/// Marks a directory as a throwaway target that teardown may remove.
const MARKER: &str = "trellara-throwaway";
/// The socket's port number: the socket lives in the cluster's own
/// directory, so no other server's number can clash with it.
const PORT: u16 = 5432;
/// sun_path is 108 bytes; the socket file name takes 15 of them.
const MAX_SOCKET_DIR: usize = 92;

#[derive(Debug, thiserror::Error)]
pub enum ThrowawayError {
    #[error(
        "no PostgreSQL {major} server binaries (initdb, pg_ctl, postgres) on this machine: looked in {looked}\nhint: install PostgreSQL {major} (scripts/setup does for 15-18), put its bin directory on PATH, or pass --target-database-url"
    )]
    NoBinaries { major: u32, looked: String },
    #[error(
        "the throwaway target's directory {0} is too long for a Unix socket path ({MAX_SOCKET_DIR} bytes at most)\nhint: run init from a shorter directory, or pass --target-database-url"
    )]
    PathTooLong(String),
    #[error(
        "the throwaway target's directory {0} has a comma, a double quote or a backslash, which the server's unix_socket_directories cannot hold\nhint: run init from another directory, use another --output name, or pass --target-database-url"
    )]
    PathCharacters(String),
    #[error(
        "{0} exists and is not a throwaway target made by trellara init\nhint: remove it or choose another --flow or --output"
    )]
    NotOurs(String),
    #[error(
        "{0} holds the throwaway target of an earlier init (it may be running, with the flow's state)\nhint: remove it with `trellara teardown --config ... --yes` first, or choose another --flow or --output"
    )]
    Earlier(String),
    #[error(
        "the throwaway target {0} is gone\nhint: recreate it with `trellara init --evaluate --force` (without --target-database-url); what the flow left on the source (its slot and publication, trellara_<flow> by default) is then removed by `trellara teardown --yes`, or by hand: SELECT pg_drop_replication_slot('trellara_<flow>'); DROP PUBLICATION trellara_<flow>"
    )]
    Missing(String),
    #[error(
        "{dir} is not the throwaway target init made for flow {flow} (another flow's, a link, or not one at all); nothing there is used, stopped or removed\nhint: point target.throwaway at this flow's own, or run `trellara init --evaluate` for it"
    )]
    NotThisFlows { dir: String, flow: String },
    #[error(
        "running as root, the throwaway target needs the system user {OS_USER} (initdb refuses root), and it does not exist\nhint: run scripts/setup (it creates the user), or run trellara as a user that is not root"
    )]
    NoOsUser,
    #[error("{what}: {detail}")]
    Command { what: String, detail: String },
    #[error("{path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("copy table {table} into the throwaway target: {message}")]
    Table { table: String, message: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ThrowawayError + '_ {
    move |source| ThrowawayError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where `init` puts a flow's throwaway target, beside its log.
pub fn default_dir(config_stem: &str, flow: &str) -> PathBuf {
    PathBuf::from(format!("./.trellara/{config_stem}/{flow}/target"))
}

/// The connection string of the cluster in `dir` (absolute).
pub fn url(dir: &Path) -> String {
    format!(
        "postgresql://postgres@/postgres?host={}&port={PORT}&connect_timeout=10",
        percent_encode(&dir.display().to_string())
    )
}

fn percent_encode(text: &str) -> String {
    let mut out = String::new();
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The bin directory of PostgreSQL `major`'s server: pg_config's, then
/// PATH's, then the set-up's (/opt/trellara/pg.env), then Debian's.
pub fn find_bindir(major: u32) -> Result<PathBuf, ThrowawayError> {
    let mut candidates = Vec::new();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        candidates.push(PathBuf::from(
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        ));
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path));
    }
    if let Ok(env) = std::fs::read_to_string("/opt/trellara/pg.env") {
        let key = format!("TRELLARA_PG{major}_BINDIR=");
        for line in env.lines() {
            let line = line.trim_start_matches("export ");
            if let Some(value) = line.strip_prefix(&key) {
                candidates.push(PathBuf::from(value.trim_matches(['"', '\''])));
            }
        }
    }
    candidates.push(PathBuf::from(format!("/usr/lib/postgresql/{major}/bin")));
    let found = candidates.iter().find(|dir| {
        ["initdb", "pg_ctl"].iter().all(|b| dir.join(b).is_file())
            && server_major(&dir.join("postgres")) == Some(major)
    });
    found.cloned().ok_or_else(|| ThrowawayError::NoBinaries {
        major,
        looked: "pg_config --bindir, PATH, /opt/trellara/pg.env, /usr/lib/postgresql/N/bin".into(),
    })
}

/// `postgres --version` -> its major.
fn server_major(postgres: &Path) -> Option<u32> {
    let out = Command::new(postgres).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.rsplit(' ').next()?.trim();
    version.split(['.', 'b', 'r', 'd']).next()?.parse().ok()
}

fn as_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Runs a server binary as the cluster's owner.
fn run(bindir: &Path, binary: &str, args: &[&str], what: &str) -> Result<String, ThrowawayError> {
    let program = bindir.join(binary);
    let mut command = if as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", OS_USER, "--"]).arg(&program);
        c
    } else {
        Command::new(&program)
    };
    let out = command
        .args(args)
        .output()
        .map_err(|e| ThrowawayError::Command {
            what: what.to_owned(),
            detail: format!("cannot run {}: {e}", program.display()),
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        Err(ThrowawayError::Command {
            what: what.to_owned(),
            detail: format!("{} {}: {}", program.display(), out.status, stderr.trim()),
        })
    }
}

/// Initialises a cluster of `major` in `dir` (which must not hold one) and
/// starts it. The directories between `base` and it are made owner-only;
/// as root, the cluster's user may also pass through them (0711: no
/// listing). A failure removes the cluster.
pub fn create(
    dir: &Path,
    base: &Path,
    major: u32,
    locale: Option<(&str, &str)>,
    flow: &str,
) -> Result<(), ThrowawayError> {
    if dir.exists() {
        return Err(if dir.join(MARKER).is_file() {
            ThrowawayError::Earlier(dir.display().to_string())
        } else {
            ThrowawayError::NotOurs(dir.display().to_string())
        });
    }
    if dir.display().to_string().len() > MAX_SOCKET_DIR {
        return Err(ThrowawayError::PathTooLong(dir.display().to_string()));
    }
    // unix_socket_directories is a comma-separated list of quoted names.
    if dir.display().to_string().contains([',', '"', '\\']) {
        return Err(ThrowawayError::PathCharacters(dir.display().to_string()));
    }
    let bindir = find_bindir(major)?;
    if as_root()
        && nix::unistd::User::from_name(OS_USER)
            .ok()
            .flatten()
            .is_none()
    {
        return Err(ThrowawayError::NoOsUser);
    }
    let result = (|| {
        let parent = dir.parent().unwrap_or(base);
        trellara_common::owner_only::create_dir_all(parent).map_err(io(parent))?;
        if as_root() {
            use std::os::unix::fs::PermissionsExt;
            for ancestor in parent
                .ancestors()
                .take_while(|a| a.starts_with(base) && *a != base)
            {
                let mode = std::fs::metadata(ancestor)
                    .map_err(io(ancestor))?
                    .permissions()
                    .mode();
                std::fs::set_permissions(ancestor, std::fs::Permissions::from_mode(mode | 0o011))
                    .map_err(io(ancestor))?;
            }
        }
        std::fs::create_dir(dir).map_err(io(dir))?;
        if as_root()
            && let Some(user) = nix::unistd::User::from_name(OS_USER).ok().flatten()
        {
            nix::unistd::chown(dir, Some(user.uid), Some(user.gid)).map_err(|e| {
                ThrowawayError::Io {
                    path: dir.display().to_string(),
                    source: e.into(),
                }
            })?;
        }
        let d = dir.display().to_string();
        let initdb = |collate: &str, ctype: &str| {
            run(
                &bindir,
                "initdb",
                &[
                    "-D",
                    &d,
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "--encoding=UTF8",
                    &format!("--lc-collate={collate}"),
                    &format!("--lc-ctype={ctype}"),
                    "--lc-messages=C",
                ],
                "initdb the throwaway target",
            )
        };
        // The source database's sort order, so text keys compare alike on
        // both sides; C where this machine lacks that locale, said so.
        let made = match locale {
            Some((collate, ctype)) if (collate, ctype) != ("C", "C") => {
                initdb(collate, ctype).or_else(|e| {
                    tracing::warn!(collate, ctype, error = %e, "the source's locale is not usable here; the throwaway target sorts text as C");
                    initdb("C", "C")
                })
            }
            _ => initdb("C", "C"),
        };
        made.map_err(|e| match e {
            ThrowawayError::Command { what, detail } if as_root() => ThrowawayError::Command {
                what,
                detail: format!(
                    "{detail}\nhint: user {OS_USER} must be able to reach {d}: make its parent directories traversable (chmod o+x) or run init elsewhere"
                ),
            },
            e => e,
        })?;
        // Only its own socket: no TCP port to take or to expose.
        let conf = format!(
            "\n# trellara throwaway target for flow {flow}\nlisten_addresses = ''\nunix_socket_directories = '{}'\nport = {PORT}\n",
            d.replace('\'', "''")
        );
        use std::io::Write;
        let conf_path = dir.join("postgresql.conf");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&conf_path)
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .map_err(io(&conf_path))?;
        let marker = dir.join(MARKER);
        std::fs::write(&marker, format!("{flow}\n")).map_err(io(&marker))?;
        start(dir, flow).map(drop)
    })();
    if result.is_err() {
        let _ = stop(dir, flow);
        let _ = std::fs::remove_dir_all(dir);
        remove_empty_parents(dir);
    }
    result
}

/// Whether `dir` is the throwaway target init made for `flow`: its own
/// directory (not a link to one), marked with the flow's name. Another
/// flow's is not this flow's to apply into, stop or remove.
pub fn is_ours(dir: &Path, flow: &str) -> bool {
    let real = std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir());
    real && dir.join("PG_VERSION").is_file()
        && std::fs::read_to_string(dir.join(MARKER)).is_ok_and(|m| m.trim() == flow)
}

fn major_of(dir: &Path, flow: &str) -> Result<u32, ThrowawayError> {
    if !is_ours(dir, flow) {
        return Err(if !dir.exists() {
            ThrowawayError::Missing(dir.display().to_string())
        } else {
            ThrowawayError::NotThisFlows {
                dir: dir.display().to_string(),
                flow: flow.to_owned(),
            }
        });
    }
    let path = dir.join("PG_VERSION");
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    text.trim()
        .parse()
        .map_err(|_| ThrowawayError::Missing(dir.display().to_string()))
}

/// Whether its server is up (`pg_ctl status`).
pub fn running(dir: &Path, flow: &str) -> Result<bool, ThrowawayError> {
    let bindir = find_bindir(major_of(dir, flow)?)?;
    let d = dir.display().to_string();
    Ok(run(&bindir, "pg_ctl", &["status", "-D", &d], "pg_ctl status").is_ok())
}

/// Starts `flow`'s cluster unless it is up; returns its URL.
pub fn start(dir: &Path, flow: &str) -> Result<String, ThrowawayError> {
    let bindir = find_bindir(major_of(dir, flow)?)?;
    let d = dir.display().to_string();
    if run(&bindir, "pg_ctl", &["status", "-D", &d], "pg_ctl status").is_err() {
        let log = dir.join("server.log").display().to_string();
        run(
            &bindir,
            "pg_ctl",
            &["start", "-w", "-t", "60", "-D", &d, "-l", &log],
            "start the throwaway target",
        )
        .map_err(|e| match e {
            ThrowawayError::Command { what, detail } => ThrowawayError::Command {
                what,
                detail: format!("{detail}\nhint: its server log is {log}"),
            },
            e => e,
        })?;
    }
    Ok(url(dir))
}

/// Stops `flow`'s cluster if it is up.
pub fn stop(dir: &Path, flow: &str) -> Result<(), ThrowawayError> {
    let bindir = find_bindir(major_of(dir, flow)?)?;
    let d = dir.display().to_string();
    if run(&bindir, "pg_ctl", &["status", "-D", &d], "pg_ctl status").is_ok() {
        run(
            &bindir,
            "pg_ctl",
            &["stop", "-w", "-m", "fast", "-D", &d],
            "stop the throwaway target",
        )?;
    }
    Ok(())
}

/// Stops `flow`'s cluster and removes its directory, and the parents init
/// made for it when that leaves them empty.
pub fn remove(dir: &Path, flow: &str) -> Result<(), ThrowawayError> {
    stop(dir, flow)?;
    std::fs::remove_dir_all(dir).map_err(io(dir))?;
    remove_empty_parents(dir);
    Ok(())
}

/// Removes `path`'s parents up to `.trellara` (included) while each is
/// empty: what init made for a flow, and nothing that holds anything.
pub fn remove_empty_parents(path: &Path) {
    for parent in path.ancestors().skip(1) {
        let top = parent.file_name().is_some_and(|n| n == ".trellara");
        if std::fs::remove_dir(parent).is_err() || top {
            break;
        }
    }
}

/// Creates on the target each table of `tables` it lacks, as the source
/// defines it: columns with their types, NOT NULL, generated expressions,
/// and the primary key and unique constraints. One transaction: all or none.
pub async fn copy_tables(
    source: &Client,
    target: &Client,
    tables: &[String],
) -> Result<Vec<String>, ThrowawayError> {
    let mut ddl = Vec::new();
    let mut created = Vec::new();
    for table in tables {
        let fail = |message: String| ThrowawayError::Table {
            table: table.clone(),
            message,
        };
        let name = TableName::parse(table).map_err(|e| fail(e.to_string()))?;
        let quoted = name.quoted();
        let exists: bool = target
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&quoted])
            .await
            .map_err(|e| fail(format!("target: {e}")))?
            .get(0);
        if exists {
            continue;
        }
        let columns = source
            .query(
                "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                        CASE WHEN a.attgenerated <> '' THEN pg_get_expr(d.adbin, d.adrelid) END,
                        a.attgenerated::text,
                        CASE WHEN a.attcollation <> 0 AND a.attcollation <> t.typcollation
                             THEN quote_ident(cn.nspname) || '.' || quote_ident(co.collname) END
                 FROM pg_attribute a
                 JOIN pg_type t ON t.oid = a.atttypid
                 LEFT JOIN pg_collation co ON co.oid = a.attcollation
                 LEFT JOIN pg_namespace cn ON cn.oid = co.collnamespace
                 LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                 WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
                 ORDER BY a.attnum",
                &[&quoted],
            )
            .await
            .map_err(|e| fail(format!("source: {e}")))?;
        if columns.is_empty() {
            return Err(fail(
                "the source has no such table (or none of its columns is readable)".into(),
            ));
        }
        let mut parts: Vec<String> = columns
            .iter()
            .map(|c| {
                let mut column = format!(
                    "{} {}",
                    postgres_protocol::escape::escape_identifier(c.get::<_, &str>(0)),
                    c.get::<_, &str>(1)
                );
                if let Some(collation) = c.get::<_, Option<&str>>(5) {
                    column.push_str(&format!(" COLLATE {collation}"));
                }
                if let Some(expr) = c.get::<_, Option<&str>>(3) {
                    let kind = if c.get::<_, &str>(4) == "v" {
                        "VIRTUAL"
                    } else {
                        "STORED"
                    };
                    column.push_str(&format!(" GENERATED ALWAYS AS ({expr}) {kind}"));
                }
                if c.get::<_, bool>(2) {
                    column.push_str(" NOT NULL");
                }
                column
            })
            .collect();
        let constraints = source
            .query(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint
                 WHERE conrelid = to_regclass($1) AND contype IN ('p', 'u') ORDER BY contype, conname",
                &[&quoted],
            )
            .await
            .map_err(|e| fail(format!("source: {e}")))?;
        parts.extend(constraints.iter().map(|c| c.get::<_, String>(0)));
        ddl.push((
            table.clone(),
            format!(
                "CREATE SCHEMA IF NOT EXISTS {}; CREATE TABLE {quoted} ({});",
                postgres_protocol::escape::escape_identifier(&name.schema),
                parts.join(", ")
            ),
        ));
        created.push(table.clone());
    }
    // One transaction, each table's statements alone, so a failure names
    // its own table.
    let fail = |table: &str, e: tokio_postgres::Error| ThrowawayError::Table {
        table: table.to_owned(),
        message: format!(
            "{}\nhint: create what the table needs on the throwaway target first (a type, a domain, a collation), or replicate into a target you prepared with --target-database-url",
            e.as_db_error()
                .map_or(e.to_string(), |d| d.message().to_owned())
        ),
    };
    target
        .batch_execute("BEGIN")
        .await
        .map_err(|e| fail("-", e))?;
    for (table, statement) in &ddl {
        if let Err(e) = target.batch_execute(statement).await {
            let _ = target.batch_execute("ROLLBACK").await;
            return Err(fail(table, e));
        }
    }
    target
        .batch_execute("COMMIT")
        .await
        .map_err(|e| fail("-", e))?;
    Ok(created)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_reaches_the_socket_in_its_directory() {
        let url = url(Path::new("/tmp/a b&c/target"));
        assert_eq!(
            url,
            "postgresql://postgres@/postgres?host=/tmp/a%20b%26c/target&port=5432&connect_timeout=10"
        );
        let options: trellara_external_relay::pgwire::ConnectOptions = url.parse().unwrap();
        assert!(
            format!("{options:?}").contains("/tmp/a b&c/target"),
            "{options:?}"
        );
    }
}
