//! External capture for managed PostgreSQL, where no extension can be
//! installed: the pgoutput decoder ([`pgoutput`]). It produces exactly the
//! envelope the native path produces.

pub mod pgoutput;
