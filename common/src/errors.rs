//! How a failure prints: the error and each of its causes once, on one
//! line, then every hint they carry. Every Trellara error's `Display` states
//! its own message only and exposes its cause through `source()`, so this
//! one printer, at each binary's edge, is where the story is told.
//!
//! A hint is a line of an error's own message that starts `hint: `. It is
//! moved after the whole chain, so the reader sees what failed and why
//! before what to do about it, whichever level of the chain added it.
//!
//! Errors from other crates do not all keep that rule (`tokio_postgres`
//! prints its cause and also exposes it), so a cause whose text the line
//! already ends with is not printed again.

use std::error::Error;
use std::fmt;

/// Displays an error with its whole chain: `what: why: why\nhint: ...`.
#[derive(Debug)]
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&chain(self.0))
    }
}

/// [`Chain`] as a string.
pub fn chain(err: &(dyn Error + 'static)) -> String {
    let mut line = String::new();
    let mut hints: Vec<&str> = Vec::new();
    let texts: Vec<String> = std::iter::successors(Some(err), |&e| e.source())
        .map(ToString::to_string)
        .collect();
    for text in &texts {
        let mut own = Vec::new();
        for part in text.split('\n') {
            if part.starts_with("hint: ") {
                hints.push(part);
            } else {
                own.push(part);
            }
        }
        let own = own.join("\n");
        if own.is_empty() {
            continue;
        }
        if line.is_empty() {
            line = own;
        } else if !line.ends_with(&own) {
            line.push_str(": ");
            line.push_str(&own);
        }
    }
    for hint in hints {
        line.push('\n');
        line.push_str(hint);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("connect to /run/pg/.s.PGSQL.1\nhint: start the server")]
    struct Connect {
        #[source]
        source: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("preflight flow main")]
    struct Preflight(#[source] Connect);

    /// A cause that prints its own cause too, as `tokio_postgres::Error` does.
    #[derive(Debug, thiserror::Error)]
    #[error("db error: {0}")]
    struct Repeats(#[source] std::io::Error);

    fn io() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory")
    }

    #[test]
    fn each_cause_prints_once_and_hints_come_last() {
        let err = Preflight(Connect { source: io() });
        assert_eq!(
            chain(&err),
            "preflight flow main: connect to /run/pg/.s.PGSQL.1: No such file or directory\n\
             hint: start the server"
        );
        assert_eq!(Chain(&err).to_string(), chain(&err));
    }

    #[test]
    fn a_cause_already_printed_by_a_foreign_error_is_not_repeated() {
        assert_eq!(chain(&Repeats(io())), "db error: No such file or directory");
    }
}
