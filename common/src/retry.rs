//! The one retry classifier: may the same work succeed if it is simply
//! tried again, with nobody changing anything? Capture's reconnects, the
//! applier's choice between a retry and a quarantine, and a following
//! flow's next round all ask it of a server's SQLSTATE.
//!
//! A code is permanent only when its class says the statement, the data,
//! the schema, the privileges or the setup is wrong, so a retry meets the
//! same answer. Everything else, an unknown code included, is retried: a
//! retry costs a backoff, while stopping on an error that would have
//! passed costs someone's night. An unknown one ([`Class::Unknown`]) that
//! keeps coming back is bounded by the caller that retries (a following
//! flow stops after a few rounds in a row end with one), so a deterministic
//! failure the classes do not name never loops for ever.

/// What a SQLSTATE says of a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Waiting may change it: a lost or refused session, a deadlock or
    /// serialization failure, a lock not available, resources, a shutdown,
    /// a server that is read-only for now (a switchover).
    Transient,
    /// Someone must change something first.
    Permanent,
    /// Neither is known (an internal error, an I/O error, a code outside
    /// the standard classes): retried, but a caller that retries on its
    /// own bounds how often the same one may come back.
    Unknown,
}

/// The class of SQLSTATE `code`.
pub fn class(code: &str) -> Class {
    match code {
        // object_not_in_prerequisite_state: an invalidated slot, a
        // wal_level too low; waiting changes neither.
        "55000" => return Class::Permanent,
        // The session was ended for idling in a transaction; a server
        // read-only during a switchover.
        "25P03" | "25006" => return Class::Transient,
        _ => {}
    }
    match code.get(..2) {
        Some("08" | "40" | "53" | "55" | "57" | "72") => Class::Transient,
        Some(
            // Feature not supported, invalid grantor or role, diagnostics.
            "0A" | "0B" | "0F" | "0L" | "0P" | "0Z"
            // Triggered action, case not found, cardinality.
            | "09" | "20" | "21"
            // Data exception, integrity constraint violation.
            | "22" | "23"
            // Cursor and transaction state, statement name, authorization.
            | "24" | "25" | "26" | "27" | "28" | "2B" | "2D" | "2F"
            // Cursor name, external routine, savepoint, catalog and schema
            // names.
            | "34" | "38" | "39" | "3B" | "3D" | "3F"
            // Syntax error or access rule violation, check option, program
            // limit exceeded (a row too large).
            | "42" | "44" | "54"
            // Configuration file, foreign data wrapper, PL/pgSQL (an
            // exception a trigger raised).
            | "F0" | "HV" | "P0",
        ) => Class::Permanent,
        _ => Class::Unknown,
    }
}

/// Whether an error with SQLSTATE `code` may pass on a retry: every code
/// but a permanent one, an unknown one included.
pub fn transient(code: &str) -> bool {
    class(code) != Class::Permanent
}

#[cfg(test)]
mod tests {
    use super::transient;

    #[test]
    fn what_a_wait_can_change_is_transient() {
        for code in [
            "08006", // connection failure
            "40001", // serialization failure
            "40P01", // deadlock
            "53300", // too many connections
            "55006", // object in use (a slot another process streams)
            "55P03", // lock not available
            "57014", // query canceled
            "57P01", // admin shutdown
            "58030", // io error
            "XX000", // internal error
            "25P03", // idle-in-transaction timeout
            "25006", // read-only transaction (a switchover)
        ] {
            assert!(transient(code), "{code}");
        }
        for code in ["XX000", "58030", "U0001"] {
            assert_eq!(super::class(code), super::Class::Unknown, "{code}");
        }
    }

    #[test]
    fn what_only_someone_can_fix_is_permanent() {
        for code in [
            "23505", // unique violation
            "23503", // foreign key violation
            "22P02", // invalid text representation
            "42501", // insufficient privilege
            "42P01", // undefined table
            "42704", // undefined object (a missing slot or publication)
            "28P01", // invalid password
            "3D000", // database does not exist
            "55000", // object not in prerequisite state
            "0A000", // feature not supported
            "P0001", // raise_exception in a trigger
            "54000", // program limit exceeded
            "25001", // active SQL transaction
        ] {
            assert!(!transient(code), "{code}");
        }
    }

    #[test]
    fn an_unknown_code_is_transient() {
        for code in ["ZZ999", "", "1", "Q1234"] {
            assert!(transient(code), "{code:?}");
        }
    }
}
