//! The extension's one error type, raised to PostgreSQL as an `ERROR` with a
//! SQLSTATE, a primary message naming what broke, and optional detail and
//! hint (PostgreSQL message style).
//!
//! Invariant: library code returns `Result<_, PluginError>`; only the
//! `#[pg_guard]` callbacks call [`PluginError::raise`], so Rust destructors
//! have run by the time PostgreSQL unwinds with `longjmp`.

use pgrx::pg_sys::errcodes::PgSqlErrorCode;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::PgLogLevel;

#[derive(Debug)]
pub struct PluginError {
    code: PgSqlErrorCode,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
}

impl PluginError {
    pub fn new(code: PgSqlErrorCode, message: impl Into<String>) -> Self {
        PluginError {
            code,
            message: message.into(),
            detail: None,
            hint: None,
        }
    }

    /// A bad plugin option (SQLSTATE 22023).
    pub fn invalid_option(message: impl Into<String>) -> Self {
        Self::new(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, message)
    }

    /// Something this plugin refuses to capture (SQLSTATE 0A000).
    pub fn not_supported(message: impl Into<String>) -> Self {
        Self::new(PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED, message)
    }

    /// A spill-file read or write failed (SQLSTATE 58030).
    pub fn io(what: &str, err: &std::io::Error) -> Self {
        Self::new(
            PgSqlErrorCode::ERRCODE_IO_ERROR,
            format!("trellara: could not {what}: {err}"),
        )
    }

    /// A broken internal rule (SQLSTATE XX000): a bug, never user input.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(PgSqlErrorCode::ERRCODE_INTERNAL_ERROR, message)
    }

    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    #[cfg(test)]
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Raises this error as a PostgreSQL `ERROR`; does not return. Call only
    /// from a `#[pg_guard]` function.
    pub fn raise(self) -> ! {
        let mut report = ErrorReport::new(self.code, self.message, "trellara");
        if let Some(detail) = self.detail {
            report = report.set_detail(detail);
        }
        if let Some(hint) = self.hint {
            report = report.set_hint(hint);
        }
        report.report(PgLogLevel::ERROR);
        unreachable!("ereport(ERROR) returned")
    }
}
