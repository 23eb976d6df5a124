//! `--where` expressions: a typed filter (`Filter`) written as one line, e.g.
//! `lang = en AND year >= 2020 AND (tags IN [rust, go] OR NOT exists(draft))`.
//!
//! Grammar (keywords in any case; values bare or in double quotes):
//!
//! ```text
//! expr  := and ("OR" and)*
//! and   := unary ("AND" unary)*
//! unary := "NOT" unary | "(" expr ")" | "exists(" field ")"
//!        | field ("=" | "!=" | "<" | "<=" | ">" | ">=") value
//!        | field "IN" "[" value ("," value)* "]"
//! ```
//!
//! A value is read by its field's type in the collection's schema (DescribeCollection), so
//! `year = 2020` is an integer and `lang = 2020` a keyword; datetimes are RFC 3339 in UTC
//! (`2024-05-01T00:00:00Z`) or microseconds since the epoch.

use std::collections::BTreeMap;

use ragcluster_proto::v1::{
    AnyOf, Condition, FieldType, Filter, Match, Range, Value, condition, value,
};

/// Why an expression does not parse, with the byte offset where it went wrong.
#[derive(Debug, thiserror::Error)]
#[error("--where at byte {at}: {why}")]
pub struct ParseError {
    pub at: usize,
    pub why: String,
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Word(String),
    Quoted(String),
    Op(&'static str),
}

fn lex(s: &str) -> Result<Vec<(usize, Tok)>, ParseError> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let two = s.get(i..i + 2).unwrap_or("");
        if let Some(op) = ["<=", ">=", "!="].into_iter().find(|o| *o == two) {
            out.push((i, Tok::Op(op)));
            i += 2;
            continue;
        }
        if let Some(op) = ["(", ")", "[", "]", ",", "=", "<", ">"]
            .into_iter()
            .find(|o| o.as_bytes()[0] == c)
        {
            out.push((i, Tok::Op(op)));
            i += 1;
            continue;
        }
        if c == b'"' {
            let start = i;
            let mut v = String::new();
            i += 1;
            loop {
                match s[i..].chars().next() {
                    None => {
                        return Err(ParseError {
                            at: start,
                            why: "unterminated quote".into(),
                        });
                    }
                    Some('"') => {
                        i += 1;
                        break;
                    }
                    Some('\\') if s[i + 1..].starts_with(['"', '\\']) => {
                        v.push(s.as_bytes()[i + 1] as char);
                        i += 2;
                    }
                    Some(ch) => {
                        v.push(ch);
                        i += ch.len_utf8();
                    }
                }
            }
            out.push((start, Tok::Quoted(v)));
            continue;
        }
        let start = i;
        while i < b.len() && !b[i].is_ascii_whitespace() && !b"()[],=<>!\"".contains(&b[i]) {
            i += s[i..].chars().next().map_or(1, char::len_utf8);
        }
        if start == i {
            return Err(ParseError {
                at: i,
                why: format!("unexpected {:?}", c as char),
            });
        }
        out.push((start, Tok::Word(s[start..i].to_owned())));
    }
    Ok(out)
}

struct Parser<'a> {
    toks: Vec<(usize, Tok)>,
    pos: usize,
    end: usize,
    schema: &'a BTreeMap<String, FieldType>,
}

impl Parser<'_> {
    fn at(&self) -> usize {
        self.toks.get(self.pos).map_or(self.end, |t| t.0)
    }

    fn err<T>(&self, why: impl Into<String>) -> Result<T, ParseError> {
        Err(ParseError {
            at: self.at(),
            why: why.into(),
        })
    }

    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.1)
    }

    fn keyword(&self, k: &str) -> bool {
        matches!(self.peek(), Some(Tok::Word(w)) if w.eq_ignore_ascii_case(k))
    }

    fn eat_op(&mut self, op: &str) -> Result<(), ParseError> {
        match self.peek() {
            Some(Tok::Op(o)) if *o == op => {
                self.pos += 1;
                Ok(())
            }
            _ => self.err(format!("expected {op:?}")),
        }
    }

    fn word(&mut self, what: &str) -> Result<String, ParseError> {
        match self.peek().cloned() {
            Some(Tok::Word(w) | Tok::Quoted(w)) => {
                self.pos += 1;
                Ok(w)
            }
            _ => self.err(format!("expected {what}")),
        }
    }

    fn expr(&mut self) -> Result<Condition, ParseError> {
        let mut any = vec![self.and()?];
        while self.keyword("or") {
            self.pos += 1;
            any.push(self.and()?);
        }
        Ok(group(any, |should| Filter {
            should,
            ..Default::default()
        }))
    }

    fn and(&mut self) -> Result<Condition, ParseError> {
        let mut all = vec![self.unary()?];
        while self.keyword("and") {
            self.pos += 1;
            all.push(self.unary()?);
        }
        Ok(group(all, |must| Filter {
            must,
            ..Default::default()
        }))
    }

    fn unary(&mut self) -> Result<Condition, ParseError> {
        if self.keyword("not") {
            self.pos += 1;
            let inner = self.unary()?;
            return Ok(not(inner));
        }
        if self.peek() == Some(&Tok::Op("(")) {
            self.pos += 1;
            let inner = self.expr()?;
            self.eat_op(")")?;
            return Ok(inner);
        }
        if self.keyword("exists")
            && self.toks.get(self.pos + 1).map(|t| &t.1) == Some(&Tok::Op("("))
        {
            self.pos += 2;
            let field = self.field()?.0;
            self.eat_op(")")?;
            return Ok(cond(condition::Kind::Exists(field)));
        }
        let (field, t) = self.field()?;
        if self.keyword("in") {
            self.pos += 1;
            return self.any_of(field, t);
        }
        let op = match self.peek() {
            Some(Tok::Op(o)) if ["=", "!=", "<", "<=", ">", ">="].contains(o) => *o,
            _ => return self.err("expected a comparison (= != < <= > >=) or IN"),
        };
        self.pos += 1;
        let at = self.at();
        let raw = self.word("a value")?;
        if op == "=" || op == "!=" {
            let v = typed(&raw, t).map_err(|why| ParseError { at, why })?;
            if matches!(v, value::Kind::Float(_)) {
                return Err(ParseError {
                    at,
                    why: format!("{field} is a float field: compare it with < <= > >="),
                });
            }
            let m = cond(condition::Kind::Match(Match {
                field,
                value: Some(Value { kind: Some(v) }),
            }));
            return Ok(if op == "=" { m } else { not(m) });
        }
        let x = number(&raw, t).map_err(|why| ParseError { at, why })?;
        let mut r = Range {
            field,
            ..Default::default()
        };
        match op {
            "<" => r.lt = Some(x),
            "<=" => r.lte = Some(x),
            ">" => r.gt = Some(x),
            _ => r.gte = Some(x),
        }
        Ok(cond(condition::Kind::Range(r)))
    }

    fn field(&mut self) -> Result<(String, FieldType), ParseError> {
        let at = self.at();
        let name = self.word("a field name")?;
        match self.schema.get(&name) {
            Some(t) => Ok((name, *t)),
            None => Err(ParseError {
                at,
                why: format!(
                    "no field {name:?} in the collection's schema (it has: {})",
                    self.schema.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            }),
        }
    }

    fn any_of(&mut self, field: String, t: FieldType) -> Result<Condition, ParseError> {
        self.eat_op("[")?;
        let mut a = AnyOf {
            field,
            ..Default::default()
        };
        loop {
            let at = self.at();
            let raw = self.word("a value")?;
            match t {
                FieldType::Integer => a.integers.push(raw.parse().map_err(|_| ParseError {
                    at,
                    why: format!("{raw:?} is not an integer"),
                })?),
                _ => a.keywords.push(raw),
            }
            if self.peek() == Some(&Tok::Op(",")) {
                self.pos += 1;
                continue;
            }
            self.eat_op("]")?;
            return Ok(cond(condition::Kind::AnyOf(a)));
        }
    }
}

fn cond(k: condition::Kind) -> Condition {
    Condition { kind: Some(k) }
}

fn not(c: Condition) -> Condition {
    cond(condition::Kind::Filter(Filter {
        must_not: vec![c],
        ..Default::default()
    }))
}

/// One condition stays itself; several become a nested filter.
fn group(mut cs: Vec<Condition>, make: impl Fn(Vec<Condition>) -> Filter) -> Condition {
    if cs.len() == 1 {
        return cs.pop().unwrap_or_default();
    }
    cond(condition::Kind::Filter(make(cs)))
}

fn number(raw: &str, t: FieldType) -> Result<f64, String> {
    match t {
        FieldType::Datetime => datetime_us(raw).map(|us| us as f64),
        FieldType::Integer | FieldType::Float => raw
            .parse::<f64>()
            .map_err(|_| format!("{raw:?} is not a number")),
        _ => Err(format!(
            "a {} field is compared with = and IN",
            type_name(t)
        )),
    }
}

fn type_name(t: FieldType) -> &'static str {
    match t {
        FieldType::Keyword => "keyword",
        FieldType::KeywordList => "keyword list",
        FieldType::Bool => "bool",
        FieldType::Integer => "integer",
        FieldType::Float => "float",
        FieldType::Datetime => "datetime",
        FieldType::Unspecified => "untyped",
    }
}

/// RFC 3339 in UTC, or microseconds since the epoch.
pub fn datetime_us(raw: &str) -> Result<i64, String> {
    if let Ok(us) = raw.parse::<i64>() {
        return Ok(us);
    }
    let t = humantime::parse_rfc3339_weak(raw)
        .map_err(|e| format!("{raw:?} is not an RFC 3339 UTC time: {e}"))?;
    Ok(match t.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => d.as_micros() as i64,
        Err(e) => -(e.duration().as_micros() as i64),
    })
}

/// A literal as a value of a field of type `t`.
pub fn typed(raw: &str, t: FieldType) -> Result<value::Kind, String> {
    Ok(match t {
        FieldType::Keyword | FieldType::KeywordList | FieldType::Unspecified => {
            value::Kind::Keyword(raw.to_owned())
        }
        FieldType::Integer => value::Kind::Integer(
            raw.parse()
                .map_err(|_| format!("{raw:?} is not an integer"))?,
        ),
        FieldType::Float => value::Kind::Float(
            raw.parse()
                .map_err(|_| format!("{raw:?} is not a number"))?,
        ),
        FieldType::Bool => match raw.to_ascii_lowercase().as_str() {
            "true" => value::Kind::Boolean(true),
            "false" => value::Kind::Boolean(false),
            _ => return Err(format!("{raw:?} is not true or false")),
        },
        FieldType::Datetime => value::Kind::DatetimeUs(datetime_us(raw)?),
    })
}

/// Parses `expr` against a schema (field name to type).
pub fn parse(expr: &str, schema: &BTreeMap<String, FieldType>) -> Result<Filter, ParseError> {
    let mut p = Parser {
        toks: lex(expr)?,
        pos: 0,
        end: expr.len(),
        schema,
    };
    if p.toks.is_empty() {
        return p.err("empty expression");
    }
    let c = p.expr()?;
    if p.pos < p.toks.len() {
        return p.err("unexpected text after the expression");
    }
    Ok(Filter {
        must: vec![c],
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> BTreeMap<String, FieldType> {
        [
            ("lang", FieldType::Keyword),
            ("year", FieldType::Integer),
            ("tags", FieldType::KeywordList),
            ("draft", FieldType::Bool),
            ("at", FieldType::Datetime),
        ]
        .into_iter()
        .map(|(k, t)| (k.to_owned(), t))
        .collect()
    }

    #[test]
    fn expressions_become_typed_filters() {
        let f = parse(
            r#"lang = "en" AND year >= 2020 AND (tags IN [rust, go] OR NOT exists(draft))"#,
            &schema(),
        )
        .unwrap();
        let Some(condition::Kind::Filter(all)) = &f.must[0].kind else {
            panic!("{f:?}")
        };
        assert_eq!(all.must.len(), 3);
        let Some(condition::Kind::Range(r)) = &all.must[1].kind else {
            panic!()
        };
        assert_eq!((r.field.as_str(), r.gte), ("year", Some(2020.0)));
        let Some(condition::Kind::Filter(or)) = &all.must[2].kind else {
            panic!()
        };
        assert_eq!(or.should.len(), 2);
        let at = parse("at < 2024-05-01T00:00:00Z", &schema()).unwrap();
        let Some(condition::Kind::Range(r)) = &at.must[0].kind else {
            panic!()
        };
        assert_eq!(r.lt, Some(1_714_521_600_000_000.0));
    }

    #[test]
    fn mistakes_point_at_their_place() {
        let e = parse("lang = en AND nope = 1", &schema()).unwrap_err();
        assert_eq!(e.at, 14, "{e}");
        let e = parse("year = soon", &schema()).unwrap_err();
        assert!(e.why.contains("not an integer"), "{e}");
        assert!(parse("(lang = en", &schema()).is_err());
        assert!(parse("lang = en extra", &schema()).is_err());
    }
}
