//! Read tokens: reads pinned to a write. A write answers with, for every shard it touched, the
//! Raft index at which it was applied; a read given the token is served only by replicas that
//! applied at least that far (the shard node waits for it, `min_applied_seq`). Raft indexes
//! only compare within one incarnation of a shard group, so the token names the collection and
//! its creation time, and a token of a dropped or re-created collection is refused.
//!
//! The wire form is `rt1.` + base64url (no padding) of `ReadTokenBody`: opaque to clients,
//! readable by operators.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use prost::Message as _;
use ragcluster_proto::v1::{CollectionInfo, ReadTokenBody};

use crate::error::{CoordError, Result};
use crate::limits::MAX_READ_TOKEN_BYTES;

const PREFIX: &str = "rt1.";

/// Per shard, the Raft index a read must see (index = shard number; 0 = no requirement).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadToken {
    pub applied: Vec<u64>,
}

/// No requirement: the reads of a request without a token.
pub static NO_TOKEN: ReadToken = ReadToken {
    applied: Vec::new(),
};

impl ReadToken {
    /// The token `field` carries for `info`, which the request `named` (itself or an alias;
    /// empty string: no token). Refused whole when it does not decode or belongs to another
    /// collection or incarnation, but for one of another collection read through an alias:
    /// the alias was switched since that write, which is not in this collection, so the token
    /// pins nothing here (a switch fails no call).
    pub fn parse(field: &str, token: &str, info: &CollectionInfo, named: &str) -> Result<Self> {
        if token.is_empty() {
            return Ok(Self::default());
        }
        if token.len() > MAX_READ_TOKEN_BYTES {
            return Err(CoordError::invalid(
                field,
                format!(
                    "{} bytes; a read token has at most {MAX_READ_TOKEN_BYTES}",
                    token.len()
                ),
            ));
        }
        let bad = |why: &str| {
            CoordError::invalid(
                field,
                format!("not a read token ({why}); pass a write's read_token as it is"),
            )
        };
        let body = token
            .strip_prefix(PREFIX)
            .ok_or_else(|| bad("no rt1. prefix"))?;
        let bytes = URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|_| bad("not base64url"))?;
        let t = ReadTokenBody::decode(bytes.as_slice()).map_err(|_| bad("undecodable"))?;
        Self::from_body(field, t, info, named)
    }

    /// The token of a decoded body (a Scroll cursor carries one), checked as `parse` does.
    pub fn from_body(
        field: &str,
        t: ReadTokenBody,
        info: &CollectionInfo,
        named: &str,
    ) -> Result<Self> {
        if t.collection != info.name && named != info.name {
            return Ok(Self::default());
        }
        if t.collection != info.name {
            return Err(CoordError::invalid(
                field,
                format!(
                    "the token is for collection {:?}, not {:?}",
                    t.collection, info.name
                ),
            ));
        }
        if t.created_at_ms != info.created_at_ms {
            return Err(CoordError::invalid(
                field,
                format!(
                    "the token is for an earlier collection named {:?} (dropped since)",
                    info.name
                ),
            ));
        }
        if t.applied.len() > info.shards.len() {
            return Err(CoordError::invalid(
                field,
                format!(
                    "the token names {} shards; {:?} has {}",
                    t.applied.len(),
                    info.name,
                    info.shards.len()
                ),
            ));
        }
        Ok(Self { applied: t.applied })
    }

    /// Raises shard `shard`'s index to at least `seq`.
    pub fn raise(&mut self, shard: u32, seq: u64) {
        let i = shard as usize;
        if self.applied.len() <= i {
            self.applied.resize(i + 1, 0);
        }
        self.applied[i] = self.applied[i].max(seq);
    }

    /// The index shard `shard` must reach (0: none).
    pub fn min_applied(&self, shard: u32) -> u64 {
        self.applied.get(shard as usize).copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.applied.iter().all(|a| *a == 0)
    }

    /// The body naming `info`'s collection.
    pub fn body(&self, info: &CollectionInfo) -> ReadTokenBody {
        ReadTokenBody {
            collection: info.name.clone(),
            created_at_ms: info.created_at_ms,
            applied: self.applied.clone(),
        }
    }

    /// The wire form for `info`'s collection.
    pub fn encode(&self, info: &CollectionInfo) -> String {
        let body = self.body(info);
        format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(body.encode_to_vec()))
    }

    /// The larger of the two indexes, shard by shard.
    pub fn merge(&mut self, other: &ReadToken) {
        for (shard, seq) in other.applied.iter().enumerate() {
            self.raise(shard as u32, *seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::MAX_SHARDS;
    use ragcluster_proto::v1::ShardPlacement;

    fn info(name: &str, created: u64, shards: usize) -> CollectionInfo {
        CollectionInfo {
            name: name.into(),
            created_at_ms: created,
            shards: vec![ShardPlacement::default(); shards],
            ..Default::default()
        }
    }

    #[test]
    fn a_token_round_trips_and_merges_by_maximum() {
        let c = info("docs", 7, 3);
        let mut t = ReadToken::default();
        t.raise(2, 40);
        t.raise(0, 9);
        t.raise(2, 31);
        let s = t.encode(&c);
        assert!(s.starts_with("rt1."));
        let back = ReadToken::parse("read_token", &s, &c, "docs").unwrap();
        assert_eq!(back.applied, [9, 0, 40]);
        assert_eq!(back.min_applied(1), 0);
        assert_eq!(back.min_applied(7), 0);
        assert!(
            ReadToken::parse("read_token", "", &c, "docs")
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_foreign_or_malformed_token_is_invalid_argument_naming_the_field() {
        let c = info("docs", 7, 2);
        let mut t = ReadToken::default();
        t.raise(1, 5);
        let cases = [
            ("garbage".to_owned(), "prefix"),
            ("rt1.!!!".to_owned(), "base64url"),
            ("rt1.AAAA_w".to_owned(), "undecodable"),
            (t.encode(&info("other", 7, 2)), "collection \"other\""),
            (t.encode(&info("docs", 8, 2)), "earlier collection"),
            (
                t.encode(&info("docs", 7, 2)).replace("rt1.", "rt2."),
                "prefix",
            ),
            ("x".repeat(MAX_READ_TOKEN_BYTES + 1), "at most"),
        ];
        for (token, why) in cases {
            let e = ReadToken::parse("search.read_token", &token, &c, "docs").unwrap_err();
            let s = e.to_string();
            assert!(matches!(e, CoordError::InvalidArgument { .. }), "{s}");
            assert!(s.starts_with("search.read_token: "), "{s}");
            assert!(s.contains(why), "{token:?}: {s}");
        }
        let mut wide = ReadToken::default();
        wide.raise(2, 1);
        let e = ReadToken::parse("t", &wide.encode(&c), &c, "docs").unwrap_err();
        assert!(e.to_string().contains("names 3 shards"), "{e}");
        // Read through an alias that was switched since the write: the token pins nothing.
        let other = t.encode(&info("other", 7, 2));
        let through = ReadToken::parse("t", &other, &c, "live").unwrap();
        assert!(through.is_empty());
    }

    /// The largest token (every shard at the largest index, the longest name) fits the limit.
    #[test]
    fn the_largest_token_fits_the_limit() {
        let c = info(&"n".repeat(64), u64::MAX, MAX_SHARDS as usize);
        let t = ReadToken {
            applied: vec![u64::MAX; MAX_SHARDS as usize],
        };
        let s = t.encode(&c);
        assert!(s.len() <= MAX_READ_TOKEN_BYTES, "{}", s.len());
        assert_eq!(ReadToken::parse("t", &s, &c, "docs").unwrap(), t);
    }
}
