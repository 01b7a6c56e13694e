//! How a failure prints: the error and each of its causes once, on one
//! line. Shared by the CLI edge and the rounds of `run --follow`, which
//! report a failure they retry without ending.

/// An error and its causes on one line, as `{:#}` prints them, but without
/// a cause that the error before it already printed (many errors here
/// print their source and also expose it).
pub fn chain(err: &anyhow::Error) -> String {
    chain_of(err.as_ref())
}

/// [`chain`] of an error held by reference.
pub fn chain_of(err: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    for cause in std::iter::successors(Some(err), |e| e.source()) {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}
