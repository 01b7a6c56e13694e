//! Connection options from a libpq-style URL or key=value string.
//!
//! tokio-postgres parses everything it knows; the two TLS settings it does
//! not (`sslmode=verify-ca|verify-full`, `sslrootcert`) are taken out first.

use super::WireError;
use std::path::PathBuf;
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
        let (rest, ssl_mode, ssl_root_cert) = take_tls_params(s);
        let config = tokio_postgres::Config::from_str(&rest).map_err(|e| {
            WireError::Config(format!(
                "{e}; expected postgresql://user[:password]@host[:port]/dbname[?sslmode=...] or host=... dbname=..."
            ))
        })?;
        let host = match config.get_hosts() {
            [tokio_postgres::config::Host::Tcp(h)] => h.clone(),
            // tokio-postgres takes a host starting with '/' for a socket
            // directory, and nothing else.
            [tokio_postgres::config::Host::Unix(dir)] => dir.to_string_lossy().into_owned(),
            [] => "localhost".to_owned(),
            _ => {
                return Err(WireError::Config(
                    "exactly one host is supported (no host lists)".into(),
                ));
            }
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
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
