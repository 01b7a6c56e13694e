//! One session (`replication=database` unless asked otherwise): startup, authentication (SCRAM-SHA-256,
//! md5, password), and simple queries. The walsender accepts only the simple
//! query protocol, for replication commands and plain SQL alike.

use super::WireError;
use super::config::ConnectOptions;
use super::tls::{self, Io};
use bytes::{Buf, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::sasl::{self, ChannelBinding, ScramSha256};
use postgres_protocol::message::backend::{ErrorResponseBody, Header, Message};
use postgres_protocol::message::frontend;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

/// Session settings for text that round-trips exactly: ISO dates,
/// postgres intervals, shortest exact floats, times in UTC (so every
/// reader compares the same text, whatever the server's time zone).
pub const SESSION_OPTIONS: &str =
    "-c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3 -c timezone=UTC";

/// Largest backend message accepted: pgoutput rows can carry values up to
/// 1 GiB, plus headers.
const MAX_MESSAGE_LEN: usize = (1 << 30) + (1 << 16);

/// An ErrorResponse, in PostgreSQL's own words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{severity}: {message} (SQLSTATE {code}){}{}", detail.as_ref().map(|d| format!("\nDETAIL: {d}")).unwrap_or_default(), hint.as_ref().map(|h| format!("\nHINT: {h}")).unwrap_or_default())]
pub struct PgError {
    pub severity: String,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl PgError {
    pub(crate) fn parse(body: &ErrorResponseBody) -> PgError {
        let mut e = PgError {
            severity: "ERROR".into(),
            code: String::new(),
            message: String::new(),
            detail: None,
            hint: None,
        };
        let mut fields = body.fields();
        while let Ok(Some(field)) = fields.next() {
            let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
            match field.type_() {
                b'S' => e.severity = value,
                b'C' => e.code = value,
                b'M' => e.message = value,
                b'D' => e.detail = Some(value),
                b'H' => e.hint = Some(value),
                _ => {}
            }
        }
        e
    }
}

/// A result row in text format.
#[derive(Debug, Clone)]
pub struct Row {
    columns: Arc<Vec<String>>,
    values: Vec<Option<String>>,
}

impl Row {
    /// The value of `column`; `None` for NULL or an unknown column.
    pub fn get(&self, column: &str) -> Option<&str> {
        let i = self.columns.iter().position(|c| c == column)?;
        self.values.get(i)?.as_deref()
    }
}

/// What the session reads: a regular message or CopyBothResponse, which
/// postgres-protocol does not know.
pub(crate) enum Backend {
    Message(Message),
    CopyBoth,
}

pub struct Connection {
    pub(crate) io: Box<dyn Io>,
    pub(crate) rbuf: BytesMut,
    pub(crate) wbuf: BytesMut,
    /// See [`Connection::pace_reads`].
    pace: Option<Duration>,
    backend_pid: i32,
    parameters: HashMap<String, String>,
    options: ConnectOptions,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("target", &self.options.target())
            .field("backend_pid", &self.backend_pid)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Opens a `replication=database` session. `connect_timeout` bounds the
    /// whole of it - TCP, TLS, startup and authentication - so a peer that
    /// accepts and never answers is an error, not a hang.
    pub async fn connect(options: &ConnectOptions) -> Result<Connection, WireError> {
        match tokio::time::timeout(options.connect_timeout, Self::open(options)).await {
            Ok(opened) => opened,
            Err(_) => Err(WireError::Connect {
                to: match options.unix_socket() {
                    Some(path) => format!("Unix socket {}", path.display()),
                    None => format!("{}:{}", options.host, options.port),
                },
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no session within connect_timeout ({} s, covering TCP, TLS and authentication)",
                        options.connect_timeout.as_secs_f64()
                    ),
                ),
            }),
        }
    }

    async fn open(options: &ConnectOptions) -> Result<Connection, WireError> {
        let socket = options.unix_socket();
        let connect_err = |source| WireError::Connect {
            to: match &socket {
                Some(path) => format!("Unix socket {}", path.display()),
                None => format!("{}:{}", options.host, options.port),
            },
            source,
        };
        let timed_out = |_| connect_err(std::io::ErrorKind::TimedOut.into());
        let io: Box<dyn tls::Io> = match &socket {
            // No TLS on a Unix socket (the options refuse to require it).
            Some(path) => Box::new(
                tokio::time::timeout(options.connect_timeout, UnixStream::connect(path))
                    .await
                    .map_err(timed_out)?
                    .map_err(connect_err)?,
            ),
            None => {
                let tcp = tokio::time::timeout(
                    options.connect_timeout,
                    TcpStream::connect((options.host.as_str(), options.port)),
                )
                .await
                .map_err(timed_out)?
                .map_err(connect_err)?;
                tcp.set_nodelay(true).map_err(connect_err)?;
                tls::negotiate(tcp, options).await?
            }
        };
        let mut conn = Connection {
            io,
            rbuf: BytesMut::with_capacity(READ_BUFFER),
            wbuf: BytesMut::new(),
            pace: None,
            backend_pid: 0,
            parameters: HashMap::new(),
            options: options.clone(),
        };
        let mut parameters = vec![
            ("user", options.user.as_str()),
            ("database", options.dbname.as_str()),
            ("application_name", options.application_name.as_str()),
            ("client_encoding", "UTF8"),
            // Value text (pgoutput's too) in the unambiguous forms every
            // server parses back the same way, whatever the source's defaults.
            ("options", SESSION_OPTIONS),
        ];
        if options.replication {
            parameters.push(("replication", "database"));
        }
        frontend::startup_message(parameters, &mut conn.wbuf)?;
        conn.flush().await?;
        conn.authenticate().await?;
        loop {
            match conn.read().await? {
                Backend::Message(Message::ParameterStatus(p)) => {
                    conn.parameters
                        .insert(p.name()?.to_owned(), p.value()?.to_owned());
                }
                Backend::Message(Message::BackendKeyData(k)) => conn.backend_pid = k.process_id(),
                Backend::Message(Message::ReadyForQuery(_)) => break,
                Backend::Message(Message::ErrorResponse(e)) => {
                    return Err(PgError::parse(&e).into());
                }
                Backend::Message(Message::NoticeResponse(_)) => {}
                _ => {
                    return Err(WireError::Protocol(
                        "unexpected message during startup".into(),
                    ));
                }
            }
        }
        Ok(conn)
    }

    async fn authenticate(&mut self) -> Result<(), WireError> {
        let (given, target) = (self.options.password.clone(), self.options.target());
        let password = || {
            given.clone().ok_or_else(|| {
                WireError::Auth(format!(
                    "the server at {target} asks for a password and none was given\nhint: add it to the URL or use a password file reference"
                ))
            })
        };
        match self.read().await? {
            Backend::Message(Message::AuthenticationOk) => return Ok(()),
            Backend::Message(Message::AuthenticationCleartextPassword) => {
                let password = password()?;
                frontend::password_message(&password, &mut self.wbuf)?;
                self.flush().await?;
            }
            Backend::Message(Message::AuthenticationMd5Password(body)) => {
                let password = password()?;
                let hash = postgres_protocol::authentication::md5_hash(
                    self.options.user.as_bytes(),
                    &password,
                    body.salt(),
                );
                frontend::password_message(hash.as_bytes(), &mut self.wbuf)?;
                self.flush().await?;
            }
            Backend::Message(Message::AuthenticationSasl(body)) => {
                let password = password()?;
                let mut mechanisms = body.mechanisms();
                let mut scram = false;
                while let Some(m) = mechanisms.next()? {
                    scram |= m == sasl::SCRAM_SHA_256;
                }
                if !scram {
                    return Err(WireError::Auth(
                        "the server offers no SASL mechanism this client supports (SCRAM-SHA-256)"
                            .into(),
                    ));
                }
                // Plain SCRAM-SHA-256 with "n,,": accepted with or without
                // TLS. Channel binding (-PLUS) is not implemented.
                let mut client = ScramSha256::new(&password, ChannelBinding::unsupported());
                frontend::sasl_initial_response(
                    sasl::SCRAM_SHA_256,
                    client.message(),
                    &mut self.wbuf,
                )?;
                self.flush().await?;
                match self.read().await? {
                    Backend::Message(Message::AuthenticationSaslContinue(b)) => {
                        client
                            .update(b.data())
                            .map_err(|e| WireError::Auth(e.to_string()))?;
                    }
                    Backend::Message(Message::ErrorResponse(e)) => {
                        return Err(PgError::parse(&e).into());
                    }
                    _ => return Err(WireError::Protocol("expected SASL continue".into())),
                }
                frontend::sasl_response(client.message(), &mut self.wbuf)?;
                self.flush().await?;
                match self.read().await? {
                    Backend::Message(Message::AuthenticationSaslFinal(b)) => {
                        // Proves the server knew the password too.
                        client
                            .finish(b.data())
                            .map_err(|e| WireError::Auth(format!("server signature: {e}")))?;
                    }
                    Backend::Message(Message::ErrorResponse(e)) => {
                        return Err(PgError::parse(&e).into());
                    }
                    _ => return Err(WireError::Protocol("expected SASL final".into())),
                }
            }
            Backend::Message(Message::ErrorResponse(e)) => return Err(PgError::parse(&e).into()),
            _ => {
                return Err(WireError::Auth(
                    "the server asked for an authentication method this client does not support (GSS, SSPI, Kerberos)".into(),
                ));
            }
        }
        match self.read().await? {
            Backend::Message(Message::AuthenticationOk) => Ok(()),
            Backend::Message(Message::ErrorResponse(e)) => Err(PgError::parse(&e).into()),
            _ => Err(WireError::Protocol("expected AuthenticationOk".into())),
        }
    }

    /// The walsender's process id (to tell our own slot holder from another).
    pub fn backend_pid(&self) -> i32 {
        self.backend_pid
    }

    /// `server_version_num` of the server, e.g. 170009.
    pub fn server_version_num(&self) -> u32 {
        self.parameters
            .get("server_version")
            .and_then(|v| parse_server_version(v))
            .unwrap_or(0)
    }

    pub fn options(&self) -> &ConnectOptions {
        &self.options
    }

    /// Runs one simple query (a replication command or SQL) and returns its
    /// rows. A server error leaves the session usable.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Row>, WireError> {
        frontend::query(sql, &mut self.wbuf)?;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut columns = Arc::new(Vec::new());
        let mut error = None;
        loop {
            match self.read().await? {
                Backend::Message(Message::RowDescription(d)) => {
                    let names: Vec<String> =
                        d.fields().map(|f| Ok(f.name().to_owned())).collect()?;
                    columns = Arc::new(names);
                }
                Backend::Message(Message::DataRow(row)) => {
                    let buf = row.buffer();
                    let values: Vec<Option<String>> = row
                        .ranges()
                        .map(|r| {
                            Ok(r.and_then(|r| buf.get(r))
                                .map(|b| String::from_utf8_lossy(b).into_owned()))
                        })
                        .collect()?;
                    rows.push(Row {
                        columns: Arc::clone(&columns),
                        values,
                    });
                }
                Backend::Message(Message::ErrorResponse(e)) => error = Some(PgError::parse(&e)),
                Backend::Message(Message::ReadyForQuery(_)) => break,
                Backend::Message(_) => {}
                Backend::CopyBoth => {
                    return Err(WireError::Protocol(
                        "simple_query started a COPY stream; use start_replication".into(),
                    ));
                }
            }
        }
        match error {
            Some(e) => Err(e.into()),
            None => Ok(rows),
        }
    }

    pub(crate) async fn flush(&mut self) -> Result<(), WireError> {
        self.io.write_all(&self.wbuf).await?;
        self.io.flush().await?;
        self.wbuf.clear();
        Ok(())
    }

    /// Parses one whole message from the buffer, if there is one.
    pub(crate) fn parse(&mut self) -> Result<Option<Backend>, WireError> {
        let Some(header) = Header::parse(&self.rbuf)? else {
            return Ok(None);
        };
        let len = header.len() as usize + 1;
        if len > MAX_MESSAGE_LEN {
            return Err(WireError::Protocol(format!(
                "message of {len} bytes exceeds the {MAX_MESSAGE_LEN}-byte limit"
            )));
        }
        if self.rbuf.len() < len {
            self.rbuf.reserve(len - self.rbuf.len());
            return Ok(None);
        }
        match header.tag() {
            b'W' => {
                self.rbuf.advance(len);
                Ok(Some(Backend::CopyBoth))
            }
            b'v' => Err(WireError::Protocol(
                "server requested protocol negotiation (NegotiateProtocolVersion)".into(),
            )),
            _ => {
                let message = Message::parse(&mut self.rbuf)?.map(Backend::Message);
                if len > RELEASE_AFTER {
                    self.release_large_buffer();
                }
                Ok(message)
            }
        }
    }

    /// After a message larger than [`RELEASE_AFTER`] (a row with a wide
    /// value), moves what is left to a buffer of the usual size. The
    /// message shares the old allocation and frees it once it is dropped;
    /// the buffer's remainder would otherwise keep all of it alive for as
    /// long as the connection lives.
    fn release_large_buffer(&mut self) {
        let mut fresh = BytesMut::with_capacity(READ_BUFFER.max(self.rbuf.len()));
        fresh.extend_from_slice(&self.rbuf);
        self.rbuf = fresh;
    }

    /// Reads until one whole message is buffered. Cancel-safe (a paced
    /// read cancelled in its wait has read nothing).
    pub(crate) async fn read(&mut self) -> Result<Backend, WireError> {
        loop {
            if let Some(message) = self.parse()? {
                return Ok(message);
            }
            let n = match self.pace {
                None => self.io.read_buf(&mut self.rbuf).await?,
                Some(every) => {
                    self.rbuf.reserve(PACED_READ_BYTES);
                    // Whatever is there now is taken at once (a TLS read
                    // yields one record at a time), so pacing never caps the
                    // rate; only a dry socket waits, letting a batch gather.
                    // Unconstrained: tokio's task budget would make a read
                    // with data waiting look dry.
                    let now = tokio::task::unconstrained(self.io.read_buf(&mut self.rbuf));
                    match now_or_never(now) {
                        Some(read) => read?,
                        None => {
                            tokio::time::sleep(every).await;
                            self.io.read_buf(&mut self.rbuf).await?
                        }
                    }
                }
            };
            if n == 0 {
                return Err(WireError::Closed);
            }
        }
    }

    /// Reads the socket at most once per `every` while it keeps running dry
    /// (`None`: on every arrival, the default): a read that finds nothing
    /// waits `every` before it waits for data. Messages already buffered
    /// still come at once. For a stream whose messages are of no use until
    /// a later one (the rows of an uncommitted transaction): each wake-up
    /// then takes many messages, and the sender is spared a wake-up of this
    /// process per message it sends.
    pub fn pace_reads(&mut self, every: Option<Duration>) {
        self.pace = every;
    }
}

/// Polls `future` once: its output if it is ready now.
fn now_or_never<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(future).poll(&mut cx) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}

/// Room one paced read may fill.
const PACED_READ_BYTES: usize = 1 << 20;
/// The read buffer's usual capacity.
const READ_BUFFER: usize = 64 << 10;
/// A message at least this large gives its buffer back (see
/// `release_large_buffer`); a smaller one's buffer is at most about this
/// large anyway, and copying the rest after every one would cost more.
const RELEASE_AFTER: usize = 1 << 20;

/// "17.9 (Debian ...)" or "18devel" -> 170009 / 180000.
fn parse_server_version(v: &str) -> Option<u32> {
    let numeric: String = v
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let mut parts = numeric.split('.').filter(|p| !p.is_empty());
    let major: u32 = parts.next()?.parse().ok()?;
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    Some(major * 10_000 + minor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use postgres_protocol::message::backend::Message;
    use tokio::io::AsyncWriteExt;
    use tokio::time::Instant;

    /// A connection reading `io`, as if after startup.
    fn connection(io: impl Io + 'static) -> Connection {
        Connection {
            io: Box::new(io),
            rbuf: BytesMut::new(),
            wbuf: BytesMut::new(),
            pace: None,
            backend_pid: 0,
            parameters: HashMap::new(),
            options: ConnectOptions {
                host: "test".into(),
                port: 0,
                user: "test".into(),
                password: None,
                dbname: "test".into(),
                application_name: "test".into(),
                ssl_mode: crate::config::SslMode::Disable,
                ssl_root_cert: None,
                connect_timeout: Duration::from_secs(1),
                replication: true,
            },
        }
    }

    fn copy_data(i: u32, len: usize) -> Vec<u8> {
        let mut m = vec![b'd'];
        m.extend_from_slice(&(4 + len as u32).to_be_bytes());
        m.extend_from_slice(&i.to_be_bytes());
        m.resize(5 + len, b'x');
        m
    }

    /// Reads `n` CopyData messages and checks they come in order.
    async fn read_in_order(conn: &mut Connection, n: u32) {
        for i in 0..n {
            match conn.read().await.expect("read") {
                Backend::Message(Message::CopyData(body)) => {
                    assert_eq!(body.data()[..4], i.to_be_bytes(), "message {i} in order");
                }
                _ => panic!("message {i} is not CopyData"),
            }
        }
    }

    /// Messages trickling in one per millisecond: read on every arrival by
    /// default, in a few batches when paced, none lost or reordered.
    #[tokio::test(start_paused = true)]
    async fn paced_reads_take_a_trickle_in_batches() {
        for pace in [None, Some(Duration::from_millis(20))] {
            let (client, mut server) = tokio::io::duplex(1 << 20);
            let writer = tokio::spawn(async move {
                for i in 0..200 {
                    server.write_all(&copy_data(i, 60)).await.expect("write");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                server
            });
            let (socket, reads) = Socket::new(client, None);
            let mut conn = connection(socket);
            conn.pace_reads(pace);
            read_in_order(&mut conn, 200).await;
            let reads = reads.load(std::sync::atomic::Ordering::Relaxed);
            match pace {
                None => assert!(reads >= 150, "{reads} reads unpaced"),
                Some(_) => assert!(reads <= 15, "{reads} reads for 200 ms paced at 20 ms"),
            }
            drop(writer.await);
        }
    }

    /// A socket that counts the reads that took bytes, and yields at most
    /// `record` bytes per read (as a TLS stream yields one record) if set.
    struct Socket {
        inner: tokio::io::DuplexStream,
        record: Option<usize>,
        reads: Arc<std::sync::atomic::AtomicU64>,
    }

    impl Socket {
        fn new(
            inner: tokio::io::DuplexStream,
            record: Option<usize>,
        ) -> (Self, Arc<std::sync::atomic::AtomicU64>) {
            let reads = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let socket = Socket {
                inner,
                record,
                reads: Arc::clone(&reads),
            };
            (socket, reads)
        }
    }

    impl tokio::io::AsyncRead for Socket {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let mut room = vec![0u8; self.record.unwrap_or(buf.remaining()).min(buf.remaining())];
            let mut small = tokio::io::ReadBuf::new(&mut room);
            let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, &mut small);
            if !small.filled().is_empty() {
                self.reads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            buf.put_slice(small.filled());
            polled
        }
    }

    impl tokio::io::AsyncWrite for Socket {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            data: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.inner).poll_write(cx, data)
        }
        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_flush(cx)
        }
        fn poll_shutdown(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    /// More waiting than one read takes, read a TLS record at a time: paced
    /// reads go on without a pause, so pacing never caps the rate.
    #[tokio::test(start_paused = true)]
    async fn paced_reads_do_not_pause_while_data_waits() {
        let (client, mut server) = tokio::io::duplex(8 << 20);
        let burst: Vec<u8> = (0..4096).flat_map(|i| copy_data(i, 1000)).collect();
        server.write_all(&burst).await.expect("write");
        let (socket, reads) = Socket::new(client, Some(16 * 1024));
        let mut conn = connection(socket);
        conn.pace_reads(Some(Duration::from_millis(50)));
        let started = Instant::now();
        read_in_order(&mut conn, 4096).await;
        assert!(
            started.elapsed() < Duration::from_millis(50),
            "4 MiB waiting took {:?}",
            started.elapsed()
        );
        let reads = reads.load(std::sync::atomic::Ordering::Relaxed);
        assert!(reads >= 2, "several reads: {reads}");
    }

    #[test]
    fn server_versions() {
        assert_eq!(super::parse_server_version("17.9"), Some(170009));
        assert_eq!(
            super::parse_server_version("15.20 (Debian 15.20-0+deb12u1)"),
            Some(150020)
        );
        assert_eq!(super::parse_server_version("18devel"), Some(180000));
        assert_eq!(super::parse_server_version("x"), None);
    }
}
