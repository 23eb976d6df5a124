//! Typed metadata as a shard holds it, and the filters over it (issue 69): one evaluation that
//! every reader shares (the HNSW walk, its exact scan, Scroll's ordered scan) and the terms
//! the BM25 index stores so that tantivy answers the same filter from its postings.
//!
//! The coordinator has checked a filter against the collection's schema (field names, types,
//! ranges) before it reaches a shard, so here a condition only needs to be well formed.
//! Numbers (integers, floats, datetimes in microseconds) are compared as doubles: the
//! coordinator keeps integers and datetimes within +-2^53, where doubles are exact, so one
//! order-preserving term encoding serves every numeric type.

use std::collections::HashMap;
use std::ops::Bound;

use ragcluster_proto::v1 as pb;

use crate::error::{Result, ShardError};

/// A metadata value of one chunk.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Keyword(String),
    /// Integers, floats and datetimes (microseconds), compared as doubles.
    Number(f64),
    Bool(bool),
    Keywords(Vec<String>),
}

/// A chunk's metadata: string metadata as keywords, then its typed fields.
pub type Meta = Vec<(String, Value)>;

/// The metadata of a stored chunk, by name (so equal metadata compares equal).
pub fn meta_of(c: &pb::Chunk) -> Meta {
    let mut m: Meta = c
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), Value::Keyword(v.clone())))
        .collect();
    m.extend(
        c.fields
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), value(v)?))),
    );
    m.sort_by(|a, b| a.0.cmp(&b.0));
    m
}

/// A proto value as the shard holds it (None for an unset value).
pub fn value(v: &pb::Value) -> Option<Value> {
    use pb::value::Kind;
    Some(match v.kind.as_ref()? {
        Kind::Keyword(s) => Value::Keyword(s.clone()),
        Kind::Integer(i) => Value::Number(*i as f64),
        Kind::Float(f) => Value::Number(*f),
        Kind::Boolean(b) => Value::Bool(*b),
        Kind::DatetimeUs(t) => Value::Number(*t as f64),
        Kind::Keywords(k) => Value::Keywords(k.values.clone()),
    })
}

/// What an equality condition compares with.
#[derive(Clone, Debug, PartialEq)]
pub enum Scalar {
    Keyword(String),
    Number(f64),
    Bool(bool),
}

impl Scalar {
    fn equals(&self, v: &Value) -> bool {
        match (self, v) {
            (Scalar::Keyword(a), Value::Keyword(b)) => a == b,
            (Scalar::Keyword(a), Value::Keywords(b)) => b.iter().any(|x| x == a),
            (Scalar::Number(a), Value::Number(b)) => a == b,
            (Scalar::Bool(a), Value::Bool(b)) => a == b,
            _ => false,
        }
    }
}

/// One condition on one field, or a nested filter.
#[derive(Clone, Debug, PartialEq)]
pub enum Cond {
    Eq(String, Scalar),
    AnyOf(String, Vec<Scalar>),
    Range(String, Bound<f64>, Bound<f64>),
    Exists(String),
    Nested(Filter),
}

/// must AND (any should, when there are some) AND NOT any must_not. Empty: everything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filter {
    pub must: Vec<Cond>,
    pub should: Vec<Cond>,
    pub must_not: Vec<Cond>,
}

fn lookup<'a>(meta: &'a [(String, Value)], field: &str) -> Option<&'a Value> {
    meta.iter().find(|(k, _)| k == field).map(|(_, v)| v)
}

fn in_range(x: f64, lo: &Bound<f64>, hi: &Bound<f64>) -> bool {
    let above = match lo {
        Bound::Included(l) => x >= *l,
        Bound::Excluded(l) => x > *l,
        Bound::Unbounded => true,
    };
    let below = match hi {
        Bound::Included(h) => x <= *h,
        Bound::Excluded(h) => x < *h,
        Bound::Unbounded => true,
    };
    above && below
}

impl Cond {
    fn matches(&self, meta: &[(String, Value)]) -> bool {
        match self {
            Cond::Eq(f, s) => lookup(meta, f).is_some_and(|v| s.equals(v)),
            Cond::AnyOf(f, set) => lookup(meta, f).is_some_and(|v| set.iter().any(|s| s.equals(v))),
            Cond::Range(f, lo, hi) => {
                matches!(lookup(meta, f), Some(Value::Number(x)) if in_range(*x, lo, hi))
            }
            Cond::Exists(f) => match lookup(meta, f) {
                Some(Value::Keywords(k)) => !k.is_empty(),
                Some(_) => true,
                None => false,
            },
            Cond::Nested(f) => f.matches(meta),
        }
    }
}

impl Filter {
    pub fn is_empty(&self) -> bool {
        self.must.is_empty() && self.should.is_empty() && self.must_not.is_empty()
    }

    /// The filter of a shard request: the exact-match map (each pair a keyword `must`) and
    /// the typed filter, together.
    pub fn of_request(
        legacy: &HashMap<String, String>,
        typed: Option<&pb::Filter>,
    ) -> Result<Self> {
        let mut f = match typed {
            Some(t) => Self::from_proto(t, "conditions", 0)?,
            None => Self::default(),
        };
        let mut pairs: Vec<_> = legacy.iter().collect();
        pairs.sort();
        f.must.extend(
            pairs
                .into_iter()
                .map(|(k, v)| Cond::Eq(k.clone(), Scalar::Keyword(v.clone()))),
        );
        Ok(f)
    }

    /// Keyword equality on every pair (tests and callers with plain pairs).
    pub fn keywords<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Self {
            must: pairs
                .into_iter()
                .map(|(k, v)| Cond::Eq(k.into(), Scalar::Keyword(v.into())))
                .collect(),
            ..Self::default()
        }
    }

    fn from_proto(f: &pb::Filter, path: &str, depth: usize) -> Result<Self> {
        if depth > MAX_DEPTH {
            return Err(invalid(path, "nested too deep"));
        }
        let list = |cs: &[pb::Condition], name: &str| -> Result<Vec<Cond>> {
            cs.iter()
                .enumerate()
                .map(|(i, c)| cond(c, &format!("{path}.{name}[{i}]"), depth))
                .collect()
        };
        Ok(Self {
            must: list(&f.must, "must")?,
            should: list(&f.should, "should")?,
            must_not: list(&f.must_not, "must_not")?,
        })
    }

    /// Whether a chunk with this metadata matches.
    pub fn matches(&self, meta: &[(String, Value)]) -> bool {
        self.must.iter().all(|c| c.matches(meta))
            && (self.should.is_empty() || self.should.iter().any(|c| c.matches(meta)))
            && !self.must_not.iter().any(|c| c.matches(meta))
    }

    /// Whether a chunk matches (its metadata read from the chunk itself).
    pub fn matches_chunk(&self, c: &pb::Chunk) -> bool {
        self.is_empty() || self.matches(&meta_of(c))
    }
}

/// Nesting beyond the coordinator's limit (8) is refused here too.
const MAX_DEPTH: usize = 8;

fn invalid(path: &str, why: &str) -> ShardError {
    ShardError::InvalidArgument(format!("{path}: {why}"))
}

fn scalar(v: Option<&pb::Value>, path: &str) -> Result<Scalar> {
    use pb::value::Kind;
    match v.and_then(|v| v.kind.as_ref()) {
        Some(Kind::Keyword(s)) => Ok(Scalar::Keyword(s.clone())),
        Some(Kind::Integer(i)) => Ok(Scalar::Number(*i as f64)),
        Some(Kind::DatetimeUs(t)) => Ok(Scalar::Number(*t as f64)),
        Some(Kind::Boolean(b)) => Ok(Scalar::Bool(*b)),
        Some(Kind::Float(_)) | Some(Kind::Keywords(_)) => Err(invalid(
            path,
            "a match takes a keyword, integer, boolean or datetime",
        )),
        None => Err(invalid(path, "no value")),
    }
}

fn bound(incl: Option<f64>, excl: Option<f64>, path: &str) -> Result<Bound<f64>> {
    match (incl, excl) {
        (Some(_), Some(_)) => Err(invalid(path, "both an inclusive and an exclusive bound")),
        (Some(x), None) if x.is_finite() => Ok(Bound::Included(x)),
        (None, Some(x)) if x.is_finite() => Ok(Bound::Excluded(x)),
        (None, None) => Ok(Bound::Unbounded),
        _ => Err(invalid(path, "bound not finite")),
    }
}

fn cond(c: &pb::Condition, path: &str, depth: usize) -> Result<Cond> {
    use pb::condition::Kind;
    Ok(match c.kind.as_ref() {
        Some(Kind::Match(m)) => Cond::Eq(
            m.field.clone(),
            scalar(m.value.as_ref(), &format!("{path}.match.value"))?,
        ),
        Some(Kind::AnyOf(a)) => {
            let mut set: Vec<Scalar> = a.keywords.iter().cloned().map(Scalar::Keyword).collect();
            set.extend(a.integers.iter().map(|i| Scalar::Number(*i as f64)));
            Cond::AnyOf(a.field.clone(), set)
        }
        Some(Kind::Range(r)) => {
            let lo = bound(r.gte, r.gt, &format!("{path}.range"))?;
            let hi = bound(r.lte, r.lt, &format!("{path}.range"))?;
            if matches!((lo, hi), (Bound::Unbounded, Bound::Unbounded)) {
                return Err(invalid(&format!("{path}.range"), "no bound"));
            }
            Cond::Range(r.field.clone(), lo, hi)
        }
        Some(Kind::Exists(f)) => Cond::Exists(f.clone()),
        Some(Kind::Filter(f)) => {
            Cond::Nested(Filter::from_proto(f, &format!("{path}.filter"), depth + 1)?)
        }
        None => return Err(invalid(path, "names no condition")),
    })
}

// ---- Terms the BM25 index stores for metadata ----

/// `key 0x1f keyword`: keywords, keyword-list elements and booleans ("true" / "false"); the
/// form string metadata always had.
pub const KEYWORD_SEP: char = '\u{1f}';
/// `key 0x1e hex16`: numbers, as 16 hex digits of an order-preserving u64, so a range of
/// values is a range of terms.
pub const NUMBER_SEP: char = '\u{1e}';
/// `key 0x1d`: the field is present.
pub const EXISTS_SEP: char = '\u{1d}';

/// The order-preserving u64 of a double (negative numbers flipped whole, positive ones with
/// the sign bit set), as 16 hex digits.
pub fn number_key(x: f64) -> String {
    let bits = if x == 0.0 { 0.0f64 } else { x }.to_bits();
    let ordered = if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    };
    format!("{ordered:016x}")
}

pub fn keyword_term(field: &str, v: &str) -> String {
    format!("{field}{KEYWORD_SEP}{v}")
}

pub fn number_term(field: &str, x: f64) -> String {
    format!("{field}{NUMBER_SEP}{}", number_key(x))
}

pub fn exists_term(field: &str) -> String {
    format!("{field}{EXISTS_SEP}")
}

pub fn scalar_term(field: &str, s: &Scalar) -> String {
    match s {
        Scalar::Keyword(k) => keyword_term(field, k),
        Scalar::Number(x) => number_term(field, *x),
        Scalar::Bool(b) => keyword_term(field, if *b { "true" } else { "false" }),
    }
}

/// A numeric range on `field` as bounds on its terms. An unbounded side ends at the field's
/// numeric terms: `key 0x1e` sorts before every one of them, `key 0x1f` after.
pub fn range_terms(
    field: &str,
    lo: &Bound<f64>,
    hi: &Bound<f64>,
) -> (Bound<String>, Bound<String>) {
    let lo = match lo {
        Bound::Included(x) => Bound::Included(number_term(field, *x)),
        Bound::Excluded(x) => Bound::Excluded(number_term(field, *x)),
        Bound::Unbounded => Bound::Included(format!("{field}{NUMBER_SEP}")),
    };
    let hi = match hi {
        Bound::Included(x) => Bound::Included(number_term(field, *x)),
        Bound::Excluded(x) => Bound::Excluded(number_term(field, *x)),
        Bound::Unbounded => Bound::Excluded(format!("{field}{KEYWORD_SEP}")),
    };
    (lo, hi)
}

/// Every term a chunk with this metadata is indexed under.
pub fn terms(meta: &[(String, Value)]) -> Vec<String> {
    let mut out = Vec::with_capacity(meta.len() * 2);
    for (k, v) in meta {
        match v {
            Value::Keyword(s) => out.push(keyword_term(k, s)),
            Value::Number(x) => out.push(number_term(k, *x)),
            Value::Bool(b) => out.push(scalar_term(k, &Scalar::Bool(*b))),
            Value::Keywords(list) => out.extend(list.iter().map(|s| keyword_term(k, s))),
        }
        if !matches!(v, Value::Keywords(l) if l.is_empty()) {
            out.push(exists_term(k));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_keys_sort_as_numbers() {
        let xs = [
            -1e300,
            -2.5,
            -1.0,
            -0.0,
            0.0,
            1e-300,
            1.0,
            2.0,
            2.5,
            9.007199254740992e15,
            1e300,
        ];
        let keys: Vec<String> = xs.iter().map(|x| number_key(*x)).collect();
        for w in keys.windows(2) {
            assert!(w[0] <= w[1], "{w:?}");
        }
        assert_eq!(number_key(-0.0), number_key(0.0));
    }

    #[test]
    fn conditions_combine() {
        let meta: Meta = vec![
            ("lang".into(), Value::Keyword("en".into())),
            ("year".into(), Value::Number(2020.0)),
            ("tags".into(), Value::Keywords(vec!["a".into(), "b".into()])),
            ("draft".into(), Value::Bool(false)),
        ];
        let eq = |f: &str, s: Scalar| Cond::Eq(f.into(), s);
        let f = Filter {
            must: vec![
                eq("lang", Scalar::Keyword("en".into())),
                Cond::Range(
                    "year".into(),
                    Bound::Included(2020.0),
                    Bound::Excluded(2021.0),
                ),
            ],
            should: vec![
                eq("tags", Scalar::Keyword("z".into())),
                eq("tags", Scalar::Keyword("b".into())),
            ],
            must_not: vec![
                eq("draft", Scalar::Bool(true)),
                Cond::Exists("missing".into()),
            ],
        };
        assert!(f.matches(&meta));
        let mut g = f.clone();
        g.should.pop();
        assert!(!g.matches(&meta), "no should condition holds");
        let mut h = f.clone();
        h.must_not
            .push(Cond::Nested(Filter::keywords([("lang", "en")])));
        assert!(!h.matches(&meta));
        assert!(Filter::default().matches(&meta));
        assert!(
            !Filter {
                must: vec![Cond::Range(
                    "lang".into(),
                    Bound::Unbounded,
                    Bound::Included(1.0)
                )],
                ..Filter::default()
            }
            .matches(&meta)
        );
    }

    #[test]
    fn malformed_conditions_name_their_path() {
        let f = pb::Filter {
            must: vec![pb::Condition {
                kind: Some(pb::condition::Kind::Filter(pb::Filter {
                    should: vec![pb::Condition::default()],
                    ..Default::default()
                })),
            }],
            ..Default::default()
        };
        let e = Filter::of_request(&HashMap::new(), Some(&f))
            .unwrap_err()
            .to_string();
        assert!(e.contains("conditions.must[0].filter.should[0]"), "{e}");
    }
}
