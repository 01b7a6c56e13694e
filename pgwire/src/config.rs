//! Connection options from a libpq-style URL or key=value string.
//!
//! tokio-postgres parses everything it knows; the two TLS settings it does
//! not (`sslmode=verify-ca|verify-full`, `sslrootcert`) are taken out first.
//! A string that names no host or port is completed as libpq completes it:
//! `PGHOST` and `PGPORT`, then the server's default socket directory.

use super::WireError;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// TLS if the server offers it, unverified (libpq's default).
    Prefer,
    /// TLS, certificate unverified unless `sslrootcert` is given.
    Require,
    /// TLS, certificate chain verified, host name not.
    VerifyCa,
    /// TLS, chain and host name verified.
    VerifyFull,
}

#[derive(Clone)]
pub struct ConnectOptions {
    /// A host name or address, or (starting with `/`) the directory of the
    /// server's Unix socket, as in libpq.
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: Option<Vec<u8>>,
    pub dbname: String,
    pub application_name: String,
    pub ssl_mode: SslMode,
    pub ssl_root_cert: Option<PathBuf>,
    pub connect_timeout: Duration,
    /// Open a `replication=database` session (replication commands and SQL)
    /// rather than a plain one. Plain sessions need no REPLICATION privilege.
    pub replication: bool,
}

impl std::fmt::Debug for ConnectOptions {
    // Never print the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("dbname", &self.dbname)
            .field("ssl_mode", &self.ssl_mode)
            .finish_non_exhaustive()
    }
}

impl ConnectOptions {
    /// `host:port/dbname` for messages; no credentials.
    pub fn target(&self) -> String {
        match self.unix_socket() {
            Some(socket) => format!("{}/{}", socket.display(), self.dbname),
            None => format!("{}:{}/{}", self.host, self.port, self.dbname),
        }
    }

    /// The socket file, when `host` names a socket directory
    /// (`<dir>/.s.PGSQL.<port>`, libpq's convention).
    pub fn unix_socket(&self) -> Option<PathBuf> {
        self.host
            .starts_with('/')
            .then(|| PathBuf::from(&self.host).join(format!(".s.PGSQL.{}", self.port)))
    }
}

impl FromStr for ConnectOptions {
    type Err = WireError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ConnectOptions::parse_with(s, &|key| std::env::var(key).ok(), &|path| path.exists())
    }
}

/// Where PostgreSQL servers put their socket when nothing says otherwise:
/// Debian's and Red Hat's packages, then the upstream build's default.
const SOCKET_DIRS: [&str; 2] = ["/var/run/postgresql", "/tmp"];

impl ConnectOptions {
    /// [`FromStr`] with the environment and the file system passed in, so
    /// the libpq defaults can be tested without touching the process's.
    fn parse_with(
        s: &str,
        env: &dyn Fn(&str) -> Option<String>,
        exists: &dyn Fn(&Path) -> bool,
    ) -> Result<Self, WireError> {
        let (rest, ssl_mode, ssl_root_cert) = take_tls_params(s);
        let config = tokio_postgres::Config::from_str(&rest).map_err(|e| {
            WireError::Config(format!(
                "{e}; expected postgresql://user[:password]@host[:port]/dbname[?sslmode=...] or host=... dbname=..."
            ))
        })?;
        // A URL's query may name the port again (`?port=`): the last one
        // counts, as in libpq. The 5432 tokio-postgres adds for a URL host
        // without a port is not one the string named.
        let mut ports = config.get_ports();
        if url_host_without_port(&rest) {
            ports = ports.get(1..).unwrap_or_default();
        }
        let port = match ports.last() {
            Some(port) => *port,
            None => match env("PGPORT").filter(|p| !p.is_empty()) {
                Some(p) => p.parse().map_err(|_| {
                    WireError::Config(format!(
                        "PGPORT={p} is not a port number; set it to one (e.g. 5432) or give the port in the URL"
                    ))
                })?,
                None => 5432,
            },
        };
        let host = match config.get_hosts() {
            // `postgresql://u@:5433/db` names no host either.
            [tokio_postgres::config::Host::Tcp(h)] if h.is_empty() => None,
            [tokio_postgres::config::Host::Tcp(h)] => Some(h.clone()),
            // tokio-postgres takes a host starting with '/' for a socket
            // directory, and nothing else.
            [tokio_postgres::config::Host::Unix(dir)] => Some(dir.to_string_lossy().into_owned()),
            [] => None,
            _ => {
                return Err(WireError::Config(
                    "exactly one host is supported (no host lists)".into(),
                ));
            }
        };
        let host = match host {
            Some(host) => host,
            None => default_host(port, env, exists)?,
        };
        let user = config
            .get_user()
            .ok_or_else(|| WireError::Config("no user given; add user@ to the URL".into()))?
            .to_owned();
        let ssl_mode = match ssl_mode {
            Some(mode) => mode,
            None => match config.get_ssl_mode() {
                tokio_postgres::config::SslMode::Disable => SslMode::Disable,
                tokio_postgres::config::SslMode::Require => SslMode::Require,
                _ => SslMode::Prefer,
            },
        };
        // PostgreSQL offers no TLS on a Unix socket: preferring it means
        // going without, requiring it cannot be met.
        let ssl_mode = match (host.starts_with('/'), ssl_mode) {
            (false, mode) => mode,
            (true, SslMode::Disable | SslMode::Prefer) => SslMode::Disable,
            (true, _) => {
                return Err(WireError::Config(format!(
                    "sslmode requires TLS, which PostgreSQL does not offer on the Unix socket in {host}; use a TCP host for TLS, or drop sslmode"
                )));
            }
        };
        Ok(ConnectOptions {
            host,
            port,
            dbname: config.get_dbname().unwrap_or(&user).to_owned(),
            user,
            password: config.get_password().map(<[u8]>::to_vec),
            application_name: config
                .get_application_name()
                .unwrap_or("trellara")
                .to_owned(),
            ssl_mode,
            ssl_root_cert,
            connect_timeout: config
                .get_connect_timeout()
                .copied()
                .unwrap_or(Duration::from_secs(10)),
            replication: true,
        })
    }
}

/// The host of a string that names none, as libpq picks it: `PGHOST`,
/// else the first default socket directory holding the port's socket.
/// Where no server socket is found, TCP on localhost.
fn default_host(
    port: u16,
    env: &dyn Fn(&str) -> Option<String>,
    exists: &dyn Fn(&Path) -> bool,
) -> Result<String, WireError> {
    if let Some(host) = env("PGHOST").filter(|h| !h.is_empty()) {
        if host.contains(',') {
            return Err(WireError::Config(format!(
                "PGHOST={host} lists several hosts; exactly one is supported: set PGHOST to one host or socket directory, or name the host in the URL"
            )));
        }
        return Ok(host);
    }
    Ok(SOCKET_DIRS
        .into_iter()
        .find(|dir| exists(&Path::new(dir).join(format!(".s.PGSQL.{port}"))))
        .unwrap_or("localhost")
        .to_owned())
}

/// Whether `s` is a URL whose authority names a host but no port.
fn url_host_without_port(s: &str) -> bool {
    let Some(rest) = s
        .strip_prefix("postgresql://")
        .or_else(|| s.strip_prefix("postgres://"))
    else {
        return false;
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    match host.strip_prefix('[') {
        Some(v6) => v6
            .split_once(']')
            .is_some_and(|(_, after)| after.is_empty()),
        None => !host.is_empty() && !host.contains(':'),
    }
}

/// Removes `sslmode=verify-*` and `sslrootcert=` from a URL query or a
/// key=value string, returning what is left and the values taken.
fn take_tls_params(s: &str) -> (String, Option<SslMode>, Option<PathBuf>) {
    let mut mode = None;
    let mut root = None;
    let mut take = |key: &str, value: &str| -> bool {
        match (key, value) {
            ("sslmode", "verify-ca") => mode = Some(SslMode::VerifyCa),
            ("sslmode", "verify-full") => mode = Some(SslMode::VerifyFull),
            ("sslrootcert", path) => root = Some(PathBuf::from(path)),
            _ => return false,
        }
        true
    };
    let rest = if s.starts_with("postgres://") || s.starts_with("postgresql://") {
        match s.split_once('?') {
            Some((base, query)) => {
                let kept: Vec<&str> = query
                    .split('&')
                    .filter(|kv| {
                        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                        !take(k, v)
                    })
                    .collect();
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
            None => s.to_owned(),
        }
    } else {
        s.split_whitespace()
            .filter(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                !take(k.trim(), v.trim())
            })
            .collect::<Vec<_>>()
            .join(" ")
    };
    (rest, mode, root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls_and_key_values() {
        let o: ConnectOptions = "postgresql://rep:s3cret@db.example:6543/shop?sslmode=verify-full&sslrootcert=/etc/ca.pem&application_name=x"
            .parse()
            .expect("parses");
        assert_eq!(
            (o.host.as_str(), o.port, o.user.as_str(), o.dbname.as_str()),
            ("db.example", 6543, "rep", "shop")
        );
        assert_eq!(o.password.as_deref(), Some(&b"s3cret"[..]));
        assert_eq!(o.ssl_mode, SslMode::VerifyFull);
        assert_eq!(o.ssl_root_cert, Some(PathBuf::from("/etc/ca.pem")));
        assert_eq!(o.application_name, "x");
        assert!(
            !format!("{o:?}").contains("s3cret"),
            "Debug must redact the password"
        );

        let kv: ConnectOptions =
            "host=127.0.0.1 port=5433 user=postgres dbname=postgres sslmode=disable"
                .parse()
                .expect("parses");
        assert_eq!((kv.port, kv.ssl_mode), (5433, SslMode::Disable));
    }

    #[test]
    fn a_socket_directory_is_a_unix_socket_without_tls() {
        for url in [
            "postgresql://trellara@%2Fvar%2Frun%2Fpostgresql:5433/shop",
            "postgresql://trellara@/shop?host=/var/run/postgresql&port=5433",
            "host=/var/run/postgresql port=5433 user=trellara dbname=shop",
        ] {
            let o: ConnectOptions = url.parse().expect(url);
            assert_eq!(
                o.unix_socket(),
                Some(PathBuf::from("/var/run/postgresql/.s.PGSQL.5433")),
                "{url}"
            );
            assert_eq!(o.ssl_mode, SslMode::Disable, "{url}");
            assert_eq!(o.target(), "/var/run/postgresql/.s.PGSQL.5433/shop");
        }
        let tcp: ConnectOptions = "postgresql://u@db/x".parse().expect("tcp");
        assert_eq!(tcp.unix_socket(), None);
        let err = "host=/tmp user=u sslmode=require"
            .parse::<ConnectOptions>()
            .expect_err("no TLS on a Unix socket");
        assert!(err.to_string().contains("Unix socket in /tmp"), "{err}");
    }

    #[test]
    fn a_string_without_host_or_port_takes_libpq_defaults() {
        let parse = |url: &str, vars: &[(&str, &str)], sockets: &[&str]| {
            let env = |key: &str| {
                vars.iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, v)| (*v).to_owned())
            };
            let exists = |path: &Path| sockets.iter().any(|s| Path::new(s) == path);
            ConnectOptions::parse_with(url, &env, &exists)
        };
        let target = |url: &str, vars: &[(&str, &str)], sockets: &[&str]| {
            parse(url, vars, sockets).expect(url).target()
        };
        // PGHOST and PGPORT fill in what the string leaves out, in either form.
        let env = [("PGHOST", "/run/pg"), ("PGPORT", "5433")];
        for url in [
            "postgresql://u@/shop",
            "postgresql://u@:5433/shop",
            "user=u dbname=shop",
        ] {
            assert_eq!(
                target(url, &env, &[]),
                "/run/pg/.s.PGSQL.5433/shop",
                "{url}"
            );
        }
        assert_eq!(
            target("postgresql://u@/shop", &[("PGHOST", "db.example")], &[]),
            "db.example:5432/shop"
        );
        // A URL host without a port takes PGPORT too; `?port=` overrides
        // the authority's port.
        assert_eq!(target("postgresql://u@db/shop", &env, &[]), "db:5433/shop");
        assert_eq!(
            target("postgresql://u@[::1]/shop", &env, &[]),
            "::1:5433/shop"
        );
        assert_eq!(
            target("postgresql://u@db:6000/shop?port=6001", &[], &[]),
            "db:6001/shop"
        );
        assert_eq!(
            target("postgresql://u@db/shop?port=6001", &env, &[]),
            "db:6001/shop"
        );
        // What the string names wins over the environment.
        assert_eq!(
            target("postgresql://u@db:6000/shop", &env, &[]),
            "db:6000/shop"
        );
        assert_eq!(
            target("user=u host=h port=7000 dbname=shop", &env, &[]),
            "h:7000/shop"
        );
        // No PGHOST: the default socket directory that holds the port's socket.
        assert_eq!(
            target("postgresql://u@/shop", &[], &["/tmp/.s.PGSQL.5432"]),
            "/tmp/.s.PGSQL.5432/shop"
        );
        assert_eq!(
            target(
                "postgresql://u@/shop?port=5433",
                &[],
                &["/var/run/postgresql/.s.PGSQL.5433", "/tmp/.s.PGSQL.5433"]
            ),
            "/var/run/postgresql/.s.PGSQL.5433/shop"
        );
        // A socket for another port is not this server's.
        assert_eq!(
            target(
                "postgresql://u@/shop",
                &[],
                &["/var/run/postgresql/.s.PGSQL.5433"]
            ),
            "localhost:5432/shop"
        );
        let err =
            parse("postgresql://u@/shop", &[("PGPORT", "fifty")], &[]).expect_err("bad PGPORT");
        assert!(err.to_string().contains("PGPORT=fifty"), "{err}");
        let err = parse("postgresql://u@/shop", &[("PGHOST", "a,b")], &[]).expect_err("host list");
        assert!(err.to_string().contains("PGHOST=a,b"), "{err}");
    }

    #[test]
    fn refuses_what_it_cannot_do() {
        assert!(
            "postgresql://127.0.0.1/db"
                .parse::<ConnectOptions>()
                .is_err(),
            "no user"
        );
        assert!(
            "postgresql://u@h/db?bogus=1"
                .parse::<ConnectOptions>()
                .is_err()
        );
    }
}
