//! Secrets out of text that may echo a connection string: a message, a
//! parse error, a config shown to someone else. The one redaction every
//! Trellara binary uses.

/// Replaces the password in a `postgres://` URL or a `password=` key-value
/// pair with `<redacted>` (for messages that may echo the input).
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        // The userinfo ends at the last '@' of the URL (a password may hold
        // '/', '?' or '@' when not percent-encoded).
        let token_end = tail.find(char::is_whitespace).unwrap_or(tail.len());
        match tail[..token_end].rfind('@') {
            Some(at) => {
                let userinfo = &tail[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..colon]);
                        out.push_str(":<redacted>");
                    }
                    None => out.push_str(userinfo),
                }
                rest = &tail[at..];
            }
            None => rest = tail,
        }
    }
    out.push_str(rest);
    redact_keywords(&out)
}

/// The keywords whose values are secrets, in libpq's key=value form and
/// in a URL's query.
const SECRET_KEYWORDS: [&str; 2] = ["password", "sslpassword"];

/// Replaces the value of each secret keyword: `password=x`, `password = x`,
/// `password='a b\' c'` (libpq's quoting), and `?password=x&...` in a URL,
/// whatever whitespace (spaces, tabs, newlines) separates them.
fn redact_keywords(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        // Any non-word byte before the keyword: a space, `?`, `&`, or the
        // quote of a whole quoted connection string.
        let starts_word = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let keyword = SECRET_KEYWORDS
            .iter()
            .find(|k| starts_word && bytes[i..].starts_with(k.as_bytes()));
        let Some(keyword) = keyword else {
            i += 1;
            continue;
        };
        let in_query = i > 0 && matches!(bytes[i - 1], b'?' | b'&');
        let mut j = i + keyword.len();
        while j < bytes.len() && bytes[j].is_ascii_whitespace() && !in_query {
            j += 1;
        }
        if bytes.get(j) != Some(&b'=') {
            i += keyword.len();
            continue;
        }
        j += 1;
        while j < bytes.len() && bytes[j].is_ascii_whitespace() && !in_query {
            j += 1;
        }
        let value_start = j;
        if bytes.get(j) == Some(&b'\'') && !in_query {
            j += 1;
            while j < bytes.len() && bytes[j] != b'\'' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            j = (j + 1).min(bytes.len());
        } else {
            // libpq reads a backslash-escaped byte as itself in an unquoted
            // value too, so an escaped space does not end it.
            while j < bytes.len()
                && !bytes[j].is_ascii_whitespace()
                && !(in_query && matches!(bytes[j], b'&' | b'#'))
            {
                j += if bytes[j] == b'\\' && !in_query { 2 } else { 1 };
            }
            j = j.min(bytes.len());
        }
        out.push_str(&text[copied..value_start]);
        out.push_str("<redacted>");
        copied = j;
        i = j;
    }
    out.push_str(&text[copied..]);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts_passwords() {
        assert_eq!(
            super::redact("postgresql://rep:s3cr@t@db:5432/shop?sslmode=require"),
            "postgresql://rep:<redacted>@db:5432/shop?sslmode=require"
        );
        assert_eq!(super::redact("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(
            super::redact("could not parse postgres://u:p/w?d@h/db: bad"),
            "could not parse postgres://u:<redacted>@h/db: bad"
        );
        assert_eq!(
            super::redact("postgresql://u@/db?host=/run/pg&password=x&port=1"),
            "postgresql://u@/db?host=/run/pg&password=<redacted>&port=1"
        );
        assert_eq!(
            super::redact("host=h password=x user=u"),
            "host=h password=<redacted> user=u"
        );
    }

    #[test]
    fn redacts_every_libpq_spelling_of_a_secret() {
        let cases = [
            (
                "host=h password = x user=u",
                "host=h password = <redacted> user=u",
            ),
            (
                "host=h\tpassword=x\tuser=u",
                "host=h\tpassword=<redacted>\tuser=u",
            ),
            ("password='a b\\' c' user=u", "password=<redacted> user=u"),
            ("sslpassword=k host=h", "sslpassword=<redacted> host=h"),
            ("password=a&b host=h", "password=<redacted> host=h"),
            (
                "postgresql://u@h/db?sslpassword=k&sslmode=require",
                "postgresql://u@h/db?sslpassword=<redacted>&sslmode=require",
            ),
            ("password=ab\\ cd user=u", "password=<redacted> user=u"),
            ("'password=s3cret host=h'", "'password=<redacted> host=h'"),
            ("(password=x)", "(password=<redacted>"),
            // Not a keyword of its own: left alone.
            ("mypassword=x", "mypassword=x"),
            ("the password is short", "the password is short"),
        ];
        for (input, redacted) in cases {
            assert_eq!(super::redact(input), redacted, "{input:?}");
        }
    }
}
