//! Who a database is, and whose a log is.
//!
//! A flow's source and target must be two databases: applying into the
//! source would empty its tables at the snapshot. URL text cannot decide it
//! (localhost and 127.0.0.1, a socket and TCP, a DNS alias all reach one
//! server), and neither can the system identifier and database OID, which a
//! target restored from a physical backup of the source shares. They only
//! rule sameness out. What decides is a nonce: the target session takes a
//! random `application_name`, and the source is asked whether one of its own
//! sessions, in its own database, carries it. Any role may read another
//! session's `application_name` in `pg_stat_activity`, so this works for a
//! target role that is not a superuser.
//!
//! A log directory belongs to one flow of one source. Its `meta/owner`
//! records the flow, the flow's source id and the source's system identifier
//! and database; a run, relay or snapshot of another flow or source refuses
//! the directory instead of applying, extending or deleting what it holds.

use crate::log::{Log, storage::FsStorage};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tokio_postgres::Client;

/// The metadata blob naming a log's owner (docs/LOG_FORMAT.md).
pub const OWNER_META: &str = "owner";

/// A database as the server knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Database {
    /// pg_control's system identifier, as text (it is an unsigned 64-bit value).
    pub system_identifier: String,
    pub database_oid: u32,
    pub database: String,
}

impl Database {
    pub async fn read(client: &Client) -> Result<Database, tokio_postgres::Error> {
        let row = client
            .query_one(
                "SELECT (SELECT system_identifier::text FROM pg_control_system()),
                        oid::int8, datname::text
                 FROM pg_database WHERE datname = current_database()",
                &[],
            )
            .await?;
        Ok(Database {
            system_identifier: row.get(0),
            database_oid: u32::try_from(row.get::<_, i64>(1)).unwrap_or(0),
            database: row.get(2),
        })
    }

    /// `postgres (oid 5) on system 7301...`.
    pub fn describe(&self) -> String {
        format!(
            "database {} (oid {}) on system {}",
            self.database, self.database_oid, self.system_identifier
        )
    }
}

/// Whether `source` and `target` are sessions of the same database. The
/// target's `application_name` is set back to what it was.
pub async fn same_database(source: &Client, target: &Client) -> Result<bool, IdentityError> {
    let (s, t) = (
        Database::read(source)
            .await
            .map_err(IdentityError::Source)?,
        Database::read(target)
            .await
            .map_err(IdentityError::Target)?,
    );
    if s != t {
        return Ok(false);
    }
    let nonce = format!(
        "trellara-identity-{:016x}",
        getrandom::u64().map_err(|e| IdentityError::Random(e.to_string()))?
    );
    let before: String = target
        .query_one(
            "SELECT current_setting('application_name'), set_config('application_name', $1, false)",
            &[&nonce],
        )
        .await
        .map_err(IdentityError::Target)?
        .get(0);
    let seen = source
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                            WHERE application_name = $1 AND datname = current_database())",
            &[&nonce],
        )
        .await
        .map_err(IdentityError::Source);
    target
        .execute(
            "SELECT set_config('application_name', $1, false)",
            &[&before],
        )
        .await
        .map_err(IdentityError::Target)?;
    Ok(seen?.get(0))
}

/// Who may write a log directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogOwner {
    pub flow: String,
    pub source_id: String,
    pub source: Database,
}

impl LogOwner {
    /// The owner of `flow`'s log: the flow, its source id, and the source
    /// database `source` is connected to.
    pub async fn of(flow: &crate::config::Flow, source: &Client) -> Result<Self, IdentityError> {
        Ok(LogOwner {
            flow: flow.name.clone(),
            source_id: flow.source_id(),
            source: Database::read(source)
                .await
                .map_err(IdentityError::Source)?,
        })
    }

    fn describe(&self) -> String {
        format!(
            "flow {} (source id {}, {})",
            self.flow,
            self.source_id,
            self.source.describe()
        )
    }
}

/// Whether `dir` may be used by `owner`: it does not exist, or its
/// `meta/owner` names `owner`. A directory with records but no owner
/// (written by a build before owners, or by hand) is refused too: what it
/// holds cannot be told apart from another flow's.
pub fn check_dir(dir: &Path, owner: &LogOwner) -> Result<(), IdentityError> {
    if !dir.exists() {
        return Ok(());
    }
    let path = dir.join("meta").join(OWNER_META);
    match std::fs::read(&path) {
        Ok(bytes) => compare(dir, &bytes, owner),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let has_segments = std::fs::read_dir(dir)
                .map_err(|source| IdentityError::Io {
                    path: dir.display().to_string(),
                    source,
                })?
                .filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().ends_with(".seg"));
            if has_segments {
                return Err(IdentityError::Unowned {
                    dir: dir.display().to_string(),
                    owner: owner.describe(),
                });
            }
            Ok(())
        }
        Err(source) => Err(IdentityError::Io {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// [`check_dir`] on an open log, then records `owner` if the log has none.
pub fn claim(log: &Log<FsStorage>, dir: &Path, owner: &LogOwner) -> Result<(), IdentityError> {
    match log.read_meta(OWNER_META)? {
        Some(bytes) => compare(dir, &bytes, owner),
        None if log.next_offset() > 0 => Err(IdentityError::Unowned {
            dir: dir.display().to_string(),
            owner: owner.describe(),
        }),
        None => {
            let bytes = serde_json::to_vec_pretty(owner).unwrap_or_default();
            log.write_meta(OWNER_META, &bytes)?;
            Ok(())
        }
    }
}

fn compare(dir: &Path, bytes: &[u8], owner: &LogOwner) -> Result<(), IdentityError> {
    let recorded: LogOwner =
        serde_json::from_slice(bytes).map_err(|e| IdentityError::BadOwner {
            dir: dir.display().to_string(),
            problem: e.to_string(),
        })?;
    if &recorded == owner {
        return Ok(());
    }
    Err(IdentityError::Foreign {
        dir: dir.display().to_string(),
        recorded: recorded.describe(),
        owner: owner.describe(),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("read the source's identity")]
    Source(#[source] tokio_postgres::Error),
    #[error("read the target's identity")]
    Target(#[source] tokio_postgres::Error),
    #[error("draw a random nonce: {0}")]
    Random(String),
    #[error(
        "log directory {dir} belongs to {recorded}, not to {owner}\nhint: give this flow its own transport.log_dir in trellara.yml (`trellara init` gives each flow one)"
    )]
    Foreign {
        dir: String,
        recorded: String,
        owner: String,
    },
    #[error(
        "log directory {dir} holds records but names no owner, so they cannot be told from another flow's ({owner} would use it)\nhint: give this flow its own transport.log_dir, or remove the directory if nothing in it is still to be applied"
    )]
    Unowned { dir: String, owner: String },
    #[error(
        "log directory {dir}: meta/owner does not parse ({problem})\nhint: restore it, or give this flow its own transport.log_dir"
    )]
    BadOwner { dir: String, problem: String },
    #[error("read {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Log(#[from] crate::log::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(flow: &str, system: &str) -> LogOwner {
        LogOwner {
            flow: flow.into(),
            source_id: flow.into(),
            source: Database {
                system_identifier: system.into(),
                database_oid: 5,
                database: "postgres".into(),
            },
        }
    }

    #[test]
    fn a_log_is_claimed_once_and_refused_to_any_other_owner() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        let a = owner("a", "1");
        check_dir(&path, &a).expect("a missing directory is free");
        let (log, _) = Log::open(FsStorage::new(), &path, Default::default()).expect("open");
        claim(&log, &path, &a).expect("claim");
        claim(&log, &path, &a).expect("the owner again");
        check_dir(&path, &a).expect("the owner again, unopened");
        for other in [owner("b", "1"), owner("a", "2")] {
            let err = claim(&log, &path, &other).expect_err("another flow or source");
            assert!(matches!(err, IdentityError::Foreign { .. }), "{err}");
            assert!(check_dir(&path, &other).is_err());
        }
    }

    #[test]
    fn a_log_with_records_and_no_owner_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        let (log, _) = Log::open(FsStorage::new(), &path, Default::default()).expect("open");
        log.append(1, b"x").expect("append");
        let err = claim(&log, &path, &owner("a", "1")).expect_err("unowned");
        assert!(matches!(err, IdentityError::Unowned { .. }), "{err}");
    }
}
