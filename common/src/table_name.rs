//! Table names as SQL spells them. `public."Sales"` is that exact name,
//! `public.Sales` folds to `public.sales`, as PostgreSQL reads an unquoted
//! identifier. One parser serves the config, the CLI's `--table` and the
//! extension's `tables` option, and one display form ([`TableName`]'s
//! `Display`) is the key everywhere a table is named: pins, snapshot rows,
//! messages. SQL text always quotes both parts ([`TableName::quoted`]).

use std::fmt;

/// The longest identifier PostgreSQL keeps (NAMEDATALEN - 1); a longer one
/// it truncates with only a NOTICE, so it is refused here instead.
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// A schema-qualified table name, both parts exact (already folded).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

/// Why a text is not `schema.table`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("is not schema.table")]
    NotQualified,
    #[error("has a quoted identifier without its closing \"")]
    Unterminated,
    #[error("has an empty identifier")]
    Empty,
    #[error(
        "has an identifier longer than {MAX_IDENTIFIER_BYTES} bytes, which PostgreSQL would truncate"
    )]
    TooLong,
    #[error("has {0:?} where an identifier or `.` should be (quote the name to use it)")]
    Unexpected(char),
}

impl TableName {
    pub fn new(schema: impl Into<String>, name: impl Into<String>) -> Self {
        TableName {
            schema: schema.into(),
            name: name.into(),
        }
    }

    /// Reads `schema.table` by SQL's rules: a `"quoted"` part is exact (with
    /// `""` for a quote), an unquoted part folds ASCII to lower case.
    pub fn parse(text: &str) -> Result<Self, NameError> {
        let mut parts = Vec::new();
        let mut chars = text.trim().chars().peekable();
        loop {
            let mut part = String::new();
            if chars.peek() == Some(&'"') {
                chars.next();
                loop {
                    match chars.next() {
                        None => return Err(NameError::Unterminated),
                        Some('"') if chars.peek() == Some(&'"') => {
                            chars.next();
                            part.push('"');
                        }
                        Some('"') => break,
                        Some(c) => part.push(c),
                    }
                }
            } else {
                while let Some(&c) = chars.peek() {
                    let starts = part.is_empty();
                    let allowed = c.is_ascii_alphabetic()
                        || c == '_'
                        || !c.is_ascii()
                        || (!starts && (c.is_ascii_digit() || c == '$'));
                    if c == '.' || !allowed {
                        break;
                    }
                    part.push(c.to_ascii_lowercase());
                    chars.next();
                }
            }
            if part.is_empty() {
                return Err(match chars.peek() {
                    Some(&c) if c != '.' => NameError::Unexpected(c),
                    _ => NameError::Empty,
                });
            }
            if part.len() > MAX_IDENTIFIER_BYTES {
                return Err(NameError::TooLong);
            }
            parts.push(part);
            match chars.next() {
                None => break,
                Some('.') => {}
                Some(c) => return Err(NameError::Unexpected(c)),
            }
        }
        match <[String; 2]>::try_from(parts) {
            Ok([schema, name]) => Ok(TableName { schema, name }),
            Err(_) => Err(NameError::NotQualified),
        }
    }

    /// A comma-separated list of names (commas inside quotes belong to
    /// the name), as the extension's `tables` option carries them.
    pub fn parse_list(text: &str) -> Result<Vec<Self>, (String, NameError)> {
        let mut items = Vec::new();
        let (mut start, mut quoted) = (0, false);
        for (i, c) in text.char_indices() {
            match c {
                '"' => quoted = !quoted,
                ',' if !quoted => {
                    items.push(&text[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        items.push(&text[start..]);
        items
            .into_iter()
            .map(|item| TableName::parse(item).map_err(|e| (item.trim().to_owned(), e)))
            .collect()
    }

    /// For SQL text: both parts quoted by postgres-protocol.
    pub fn quoted(&self) -> String {
        format!(
            "{}.{}",
            postgres_protocol::escape::escape_identifier(&self.schema),
            postgres_protocol::escape::escape_identifier(&self.name)
        )
    }
}

/// One identifier as people read it: plain when plain, else quoted, so the
/// text parses back to the same name.
pub fn display_ident(name: &str) -> String {
    let plain = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        name.to_owned()
    } else {
        postgres_protocol::escape::escape_identifier(name)
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{}",
            display_ident(&self.schema),
            display_ident(&self.name)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> (String, String) {
        let t = TableName::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        (t.schema, t.name)
    }

    #[test]
    fn unquoted_folds_and_quoted_is_exact() {
        assert_eq!(parsed("public.sales"), ("public".into(), "sales".into()));
        assert_eq!(parsed("Public.Sales"), ("public".into(), "sales".into()));
        assert_eq!(
            parsed("public.\"Sales\""),
            ("public".into(), "Sales".into())
        );
        assert_eq!(parsed("\"a.b\".\"c\"\"d\""), ("a.b".into(), "c\"d".into()));
        assert_eq!(parsed("s.t$1"), ("s".into(), "t$1".into()));
        assert_eq!(parsed("s.Été"), ("s".into(), "Été".into()));
    }

    #[test]
    fn malformed_names_say_why() {
        for (text, err) in [
            ("sales", NameError::NotQualified),
            ("a.b.c", NameError::NotQualified),
            ("public.", NameError::Empty),
            (".sales", NameError::Empty),
            ("public.\"\"", NameError::Empty),
            ("public.\"Sales", NameError::Unterminated),
            ("public.sa les", NameError::Unexpected(' ')),
            ("public.1st", NameError::Unexpected('1')),
            ("public.\"Sales\"x", NameError::Unexpected('x')),
        ] {
            assert_eq!(TableName::parse(text), Err(err), "{text}");
        }
        let long = format!("public.{}", "x".repeat(64));
        assert_eq!(TableName::parse(&long), Err(NameError::TooLong));
        assert!(TableName::parse(&format!("public.{}", "x".repeat(63))).is_ok());
    }

    #[test]
    fn lists_split_on_commas_outside_quotes() {
        let list = TableName::parse_list("public.a, s.\"B,c\",x.Y").unwrap();
        assert_eq!(
            list,
            [
                TableName::new("public", "a"),
                TableName::new("s", "B,c"),
                TableName::new("x", "y")
            ]
        );
        assert_eq!(
            TableName::parse_list("public.a,nodot"),
            Err(("nodot".into(), NameError::NotQualified))
        );
    }

    #[test]
    fn display_parses_back_to_the_same_name() {
        for (schema, name) in [
            ("public", "sales"),
            ("public", "Sales"),
            ("my schema", "a.b"),
            ("s", "with\"quote"),
            ("s", "t$1"),
        ] {
            let t = TableName::new(schema, name);
            assert_eq!(TableName::parse(&t.to_string()), Ok(t.clone()), "{t}");
        }
        assert_eq!(
            TableName::new("public", "Sales").to_string(),
            "public.\"Sales\""
        );
        assert_eq!(
            TableName::new("public", "sales").quoted(),
            "\"public\".\"sales\""
        );
    }
}
