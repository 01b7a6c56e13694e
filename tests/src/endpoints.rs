//! Reading a running service's endpoints in tests: one HTTP/1.1 GET per
//! connection (the endpoints are four fixed paths; a client library would
//! add nothing), and one series' value out of Prometheus text.

use std::io::{Read, Write};
use std::time::Duration;

/// GET `path` from `addr` (`host:port`) on a fresh connection: (status, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the endpoints");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("a head and a body");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    (status, body.to_owned())
}

/// The value of the one series named `name` in Prometheus text (panics
/// unless there is exactly one).
pub fn metric(metrics: &str, name: &str) -> f64 {
    let values: Vec<f64> = metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .map(|l| {
            l.rsplit_once(' ')
                .expect("a value")
                .1
                .parse()
                .expect("a number")
        })
        .collect();
    assert_eq!(values.len(), 1, "one series of {name}:\n{metrics}");
    values[0]
}

/// A peer that accepts every connection and never says a word, on a free
/// loopback port: what a hung server looks like to a client. Returns the
/// port; the listener lives as long as the test process.
pub fn mute_peer() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            held.push(stream);
        }
    });
    port
}
