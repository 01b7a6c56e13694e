//! PostgreSQL log sequence numbers.
//!
//! An [`Lsn`] is a byte position in the WAL stream. It prints and parses in
//! PostgreSQL's own `XXXXXXXX/XXXXXXXX` form (high and low 32 bits in hex), so
//! a value can be pasted between `trellara` output and `pg_lsn` SQL.

use std::fmt;
use std::str::FromStr;

/// A WAL position. `Lsn::ZERO` is PostgreSQL's `InvalidXLogRecPtr`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);

    pub fn is_valid(self) -> bool {
        self.0 != 0
    }
}

impl From<u64> for Lsn {
    fn from(value: u64) -> Self {
        Lsn(value)
    }
}

impl From<Lsn> for u64 {
    fn from(lsn: Lsn) -> Self {
        lsn.0
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

/// `value` is not of the form `HEX/HEX` with each half fitting 32 bits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {value:?}: expected PostgreSQL's form such as 16/B374D848")]
pub struct ParseLsnError {
    pub value: String,
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError {
            value: s.to_owned(),
        };
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let half = |part: &str| {
            if part.is_empty() || part.len() > 8 {
                return Err(err());
            }
            u32::from_str_radix(part, 16).map_err(|_| err())
        };
        Ok(Lsn((u64::from(half(hi)?) << 32) | u64::from(half(lo)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_like_postgres() {
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(0).to_string(), "0/0");
    }

    #[test]
    fn parses_what_it_prints() {
        for v in [0, 1, 0x16_B374_D848, u64::MAX] {
            assert_eq!(Lsn(v).to_string().parse::<Lsn>(), Ok(Lsn(v)));
        }
        assert_eq!("0/1a".parse::<Lsn>(), Ok(Lsn(0x1a)));
    }

    #[test]
    fn rejects_malformed() {
        for bad in ["", "16", "/1", "1/", "x/1", "1/2/3", "123456789/0", "-1/0"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} parsed");
        }
    }
}
