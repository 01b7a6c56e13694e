//! The names a replication slot may have: PostgreSQL's rule
//! (ReplicationSlotValidateName), checked before a name reaches a server
//! or a config is accepted, so both refuse the same names.

/// 1-63 lower-case letters, digits and underscores.
pub fn is_valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}
