//! A collection's typed fields (issue 69): the schema in the catalog (`CollectionInfo.fields`),
//! how documents grow it (a field's first value fixes its type, as Elasticsearch's dynamic
//! mapping does), and the check of a filter against it, so that a shard only ever sees
//! conditions that fit their fields' types and every mistake is named by its path.

use std::collections::{BTreeMap, HashMap};

use ragcluster_proto::v1::{
    AddFieldsRequest, CollectionInfo, Condition, Document, DocumentWrite, FieldSchema, FieldType,
    Filter, MetadataPatch, Range, Value, condition, value,
};

use crate::error::{CoordError, Result};
use crate::limits::{
    MAX_ANY_OF, MAX_DOC_FIELDS, MAX_FIELD_NAME_BYTES, MAX_FILTER_CONDITIONS, MAX_FILTER_DEPTH,
    MAX_KEYWORD_BYTES, MAX_KEYWORD_LIST, MAX_SAFE_INTEGER, MAX_SCHEMA_FIELDS,
};

/// The field chunking adds to every chunk with a heading path: a keyword in every schema.
pub const SECTION: &str = "section";

/// A collection's fields by name, `section` included.
pub fn schema_of(info: &CollectionInfo) -> BTreeMap<String, FieldType> {
    let mut m: BTreeMap<String, FieldType> = info
        .fields
        .iter()
        .map(|f| (f.name.clone(), f.r#type()))
        .collect();
    m.entry(SECTION.to_owned()).or_insert(FieldType::Keyword);
    m
}

/// 1 to `MAX_FIELD_NAME_BYTES` bytes, no control characters (the shards' index terms use
/// them as separators).
pub fn check_field_name(path: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_FIELD_NAME_BYTES || name.chars().any(char::is_control) {
        return Err(CoordError::invalid(
            path,
            format!(
                "field name {name:?} must be 1 to {MAX_FIELD_NAME_BYTES} bytes without control characters"
            ),
        ));
    }
    Ok(())
}

fn type_name(t: FieldType) -> &'static str {
    match t {
        FieldType::Unspecified => "unspecified",
        FieldType::Keyword => "keyword",
        FieldType::Integer => "integer",
        FieldType::Float => "float",
        FieldType::Bool => "bool",
        FieldType::Datetime => "datetime",
        FieldType::KeywordList => "keyword list",
    }
}

fn check_keyword(path: &str, s: &str) -> Result<()> {
    if s.len() > MAX_KEYWORD_BYTES {
        return Err(CoordError::invalid(
            path,
            format!("is longer than {MAX_KEYWORD_BYTES} bytes"),
        ));
    }
    Ok(())
}

fn check_integer(path: &str, i: i64) -> Result<()> {
    if !(-MAX_SAFE_INTEGER..=MAX_SAFE_INTEGER).contains(&i) {
        return Err(CoordError::invalid(path, format!("{i} is beyond +-2^53")));
    }
    Ok(())
}

/// The type of a well-formed value.
pub fn check_value(path: &str, v: &Value) -> Result<FieldType> {
    use value::Kind;
    Ok(match v.kind.as_ref() {
        None => return Err(CoordError::invalid(path, "holds no value")),
        Some(Kind::Keyword(s)) => {
            check_keyword(path, s)?;
            FieldType::Keyword
        }
        Some(Kind::Integer(i)) => {
            check_integer(path, *i)?;
            FieldType::Integer
        }
        Some(Kind::Float(f)) => {
            if !f.is_finite() {
                return Err(CoordError::invalid(path, "is not finite"));
            }
            FieldType::Float
        }
        Some(Kind::Boolean(_)) => FieldType::Bool,
        Some(Kind::DatetimeUs(t)) => {
            check_integer(path, *t)?;
            FieldType::Datetime
        }
        Some(Kind::Keywords(k)) => {
            if k.values.len() > MAX_KEYWORD_LIST {
                return Err(CoordError::invalid(
                    path,
                    format!("holds more than {MAX_KEYWORD_LIST} keywords"),
                ));
            }
            for (j, s) in k.values.iter().enumerate() {
                check_keyword(&format!("{path}[{j}]"), s)?;
            }
            FieldType::KeywordList
        }
    })
}

/// Checks the typed fields and metadata of a batch against the collection's schema, and
/// returns the fields it adds (by name): each new field with the type of its first value.
/// A value of another type than its field's, in the schema or earlier in the batch, is
/// INVALID_ARGUMENT.
pub fn growth(docs: &[Document], info: &CollectionInfo) -> Result<Vec<FieldSchema>> {
    grow(
        docs.iter().enumerate().map(|(i, d)| Source {
            fields_path: format!("documents[{i}].fields"),
            metadata_path: format!("documents[{i}].metadata"),
            fields: &d.fields,
            metadata: &d.metadata,
        }),
        info,
        "documents",
    )
}

/// The fields a metadata patch sets, checked and grown as an upsert's are (`growth`).
pub fn patch_growth(p: &MetadataPatch, info: &CollectionInfo) -> Result<Vec<FieldSchema>> {
    grow(
        std::iter::once(Source {
            fields_path: "patch.set_fields".into(),
            metadata_path: "patch.set_metadata".into(),
            fields: &p.set_fields,
            metadata: &p.set_metadata,
        }),
        info,
        "patch",
    )
}

/// The fields of restored chunks (`RestoreDocuments`), checked and grown as an upsert's are.
pub fn chunk_growth(docs: &[DocumentWrite], info: &CollectionInfo) -> Result<Vec<FieldSchema>> {
    grow(
        docs.iter().enumerate().flat_map(|(i, d)| {
            d.chunks.iter().enumerate().map(move |(j, c)| Source {
                fields_path: format!("documents[{i}].chunks[{j}].fields"),
                metadata_path: format!("documents[{i}].chunks[{j}].metadata"),
                fields: &c.fields,
                metadata: &c.metadata,
            })
        }),
        info,
        "documents",
    )
}

/// Typed fields and string metadata of one document (or patch), and how errors name them.
struct Source<'a> {
    fields_path: String,
    metadata_path: String,
    fields: &'a HashMap<String, Value>,
    metadata: &'a HashMap<String, String>,
}

fn grow<'a>(
    sources: impl Iterator<Item = Source<'a>>,
    info: &CollectionInfo,
    whole: &str,
) -> Result<Vec<FieldSchema>> {
    let schema = schema_of(info);
    let mut added: BTreeMap<String, FieldType> = BTreeMap::new();
    let mut see = |path: String, name: &str, t: FieldType| -> Result<()> {
        let have = schema.get(name).or_else(|| added.get(name)).copied();
        match have {
            Some(h) if h == t => Ok(()),
            Some(h) => Err(CoordError::invalid(
                path,
                format!(
                    "field {name:?} is a {} field; this value is a {}",
                    type_name(h),
                    type_name(t)
                ),
            )),
            None => {
                added.insert(name.to_owned(), t);
                Ok(())
            }
        }
    };
    for d in sources {
        if d.fields.len() > MAX_DOC_FIELDS {
            return Err(CoordError::invalid(
                d.fields_path,
                format!("has more than {MAX_DOC_FIELDS} fields"),
            ));
        }
        let mut names: Vec<&String> = d.fields.keys().collect();
        names.sort();
        for name in names {
            let path = format!("{}[{name:?}]", d.fields_path);
            check_field_name(&path, name)?;
            if d.metadata.contains_key(name) {
                return Err(CoordError::invalid(path, "is also a metadata key"));
            }
            let t = check_value(&path, &d.fields[name])?;
            see(path, name, t)?;
        }
        let mut keys: Vec<&String> = d.metadata.keys().collect();
        keys.sort();
        for k in keys {
            let path = format!("{}[{k:?}]", d.metadata_path);
            check_field_name(&path, k)?;
            check_keyword(&path, &d.metadata[k])?;
            see(path, k, FieldType::Keyword)?;
        }
    }
    if info.fields.len() + added.len() > MAX_SCHEMA_FIELDS {
        return Err(CoordError::TooLarge {
            field: whole.into(),
            reason: format!(
                "adds {} fields to a schema of {}; at most {MAX_SCHEMA_FIELDS}",
                added.len(),
                info.fields.len()
            ),
        });
    }
    Ok(added
        .into_iter()
        .map(|(name, t)| FieldSchema {
            name,
            r#type: t as i32,
        })
        .collect())
}

/// An AddFields request (or CreateCollection's `fields`) on its own: names, types, no name
/// twice with two types.
pub fn check_fields(path: &str, fields: &[FieldSchema]) -> Result<()> {
    if fields.len() > MAX_SCHEMA_FIELDS {
        return Err(CoordError::TooLarge {
            field: path.into(),
            reason: format!("at most {MAX_SCHEMA_FIELDS} fields"),
        });
    }
    let mut seen: BTreeMap<&str, FieldType> = BTreeMap::new();
    for (i, f) in fields.iter().enumerate() {
        let p = format!("{path}[{i}]");
        check_field_name(&format!("{p}.name"), &f.name)?;
        let t = FieldType::try_from(f.r#type).unwrap_or(FieldType::Unspecified);
        if t == FieldType::Unspecified {
            return Err(CoordError::invalid(
                format!("{p}.type"),
                "is unspecified or unknown",
            ));
        }
        if f.name == SECTION && t != FieldType::Keyword {
            return Err(CoordError::invalid(
                format!("{p}.type"),
                "\"section\" is the keyword field chunking sets",
            ));
        }
        if seen.insert(&f.name, t).is_some_and(|was| was != t) {
            return Err(CoordError::invalid(
                p,
                format!("{:?} is given two types", f.name),
            ));
        }
    }
    Ok(())
}

/// Adds `r.fields` to the collection's schema (catalog apply, on every replica alike): all of
/// them or none.
pub fn apply_add_fields(info: &mut CollectionInfo, r: &AddFieldsRequest) -> Result<()> {
    let mut next = info.fields.clone();
    for (i, f) in r.fields.iter().enumerate() {
        match next.iter().find(|have| have.name == f.name) {
            Some(have) if have.r#type == f.r#type => {}
            Some(have) => {
                return Err(CoordError::invalid(
                    format!("fields[{i}]"),
                    format!(
                        "field {:?} is already a {} field",
                        f.name,
                        type_name(have.r#type())
                    ),
                ));
            }
            None => next.push(f.clone()),
        }
    }
    if next.len() > MAX_SCHEMA_FIELDS && next.len() > info.fields.len() {
        return Err(CoordError::TooLarge {
            field: "fields".into(),
            reason: format!("a schema holds at most {MAX_SCHEMA_FIELDS} fields"),
        });
    }
    next.sort_by(|a, b| a.name.cmp(&b.name));
    info.fields = next;
    Ok(())
}

/// Whether `info`'s schema holds every field of `fields` with its type.
pub fn holds(info: &CollectionInfo, fields: &[FieldSchema]) -> bool {
    fields.iter().all(|f| {
        info.fields
            .iter()
            .any(|have| have.name == f.name && have.r#type == f.r#type)
    })
}

/// Checks a typed filter against the collection's schema. `path` names the request field.
pub fn check_filter(path: &str, f: &Filter, info: &CollectionInfo) -> Result<()> {
    let schema = schema_of(info);
    let mut count = 0;
    Check {
        schema: &schema,
        count: &mut count,
    }
    .filter(path, f, 1)
}

struct Check<'a> {
    schema: &'a BTreeMap<String, FieldType>,
    count: &'a mut usize,
}

impl Check<'_> {
    fn filter(&mut self, path: &str, f: &Filter, depth: usize) -> Result<()> {
        if depth > MAX_FILTER_DEPTH {
            return Err(CoordError::invalid(
                path,
                format!("nests more than {MAX_FILTER_DEPTH} levels"),
            ));
        }
        for (name, list) in [
            ("must", &f.must),
            ("should", &f.should),
            ("must_not", &f.must_not),
        ] {
            for (i, c) in list.iter().enumerate() {
                *self.count += 1;
                if *self.count > MAX_FILTER_CONDITIONS {
                    return Err(CoordError::invalid(
                        path,
                        format!("holds more than {MAX_FILTER_CONDITIONS} conditions"),
                    ));
                }
                self.condition(&format!("{path}.{name}[{i}]"), c, depth)?;
            }
        }
        Ok(())
    }

    fn field(&self, path: &str, name: &str) -> Result<FieldType> {
        self.schema.get(name).copied().ok_or_else(|| {
            CoordError::invalid(
                path,
                format!("no field {name:?} in the collection's schema"),
            )
        })
    }

    fn condition(&mut self, path: &str, c: &Condition, depth: usize) -> Result<()> {
        use FieldType as T;
        use condition::Kind;
        let mismatch = |p: String, t: FieldType, what: &str| {
            CoordError::invalid(p, format!("a {} field takes no {what}", type_name(t)))
        };
        match c.kind.as_ref() {
            None => Err(CoordError::invalid(path, "names no condition")),
            Some(Kind::Exists(name)) => self.field(&format!("{path}.exists"), name).map(|_| ()),
            Some(Kind::Filter(f)) => self.filter(&format!("{path}.filter"), f, depth + 1),
            Some(Kind::Match(m)) => {
                let t = self.field(&format!("{path}.match.field"), &m.field)?;
                let vp = format!("{path}.match.value");
                let v = m.value.as_ref().and_then(|v| v.kind.as_ref());
                let fits = match v {
                    None => return Err(CoordError::invalid(vp, "holds no value")),
                    Some(value::Kind::Keyword(s)) => {
                        check_keyword(&vp, s)?;
                        matches!(t, T::Keyword | T::KeywordList)
                    }
                    Some(value::Kind::Integer(i)) => {
                        check_integer(&vp, *i)?;
                        t == T::Integer
                    }
                    Some(value::Kind::Boolean(_)) => t == T::Bool,
                    Some(value::Kind::DatetimeUs(x)) => {
                        check_integer(&vp, *x)?;
                        t == T::Datetime
                    }
                    Some(value::Kind::Float(_)) => {
                        return Err(CoordError::invalid(vp, "floats are matched with a range"));
                    }
                    Some(value::Kind::Keywords(_)) => {
                        return Err(CoordError::invalid(
                            vp,
                            "a match takes one keyword; use any_of",
                        ));
                    }
                };
                if !fits {
                    return Err(mismatch(vp, t, "such value"));
                }
                Ok(())
            }
            Some(Kind::AnyOf(a)) => {
                let t = self.field(&format!("{path}.any_of.field"), &a.field)?;
                let p = format!("{path}.any_of");
                let n = a.keywords.len() + a.integers.len();
                if a.keywords.is_empty() == a.integers.is_empty() {
                    return Err(CoordError::invalid(
                        p,
                        "needs keywords or integers (one of them)",
                    ));
                }
                if n > MAX_ANY_OF {
                    return Err(CoordError::invalid(
                        p,
                        format!("holds more than {MAX_ANY_OF} values"),
                    ));
                }
                if !a.keywords.is_empty() && !matches!(t, T::Keyword | T::KeywordList) {
                    return Err(mismatch(format!("{p}.keywords"), t, "keywords"));
                }
                if !a.integers.is_empty() && t != T::Integer {
                    return Err(mismatch(format!("{p}.integers"), t, "integers"));
                }
                for (j, s) in a.keywords.iter().enumerate() {
                    check_keyword(&format!("{p}.keywords[{j}]"), s)?;
                }
                for (j, i) in a.integers.iter().enumerate() {
                    check_integer(&format!("{p}.integers[{j}]"), *i)?;
                }
                Ok(())
            }
            Some(Kind::Range(r)) => {
                let t = self.field(&format!("{path}.range.field"), &r.field)?;
                if !matches!(t, T::Integer | T::Float | T::Datetime) {
                    return Err(mismatch(format!("{path}.range"), t, "range"));
                }
                check_range(&format!("{path}.range"), r)
            }
        }
    }
}

/// At least one bound, each finite, not two on one side, and something between them.
fn check_range(path: &str, r: &Range) -> Result<()> {
    for (name, b) in [("gt", r.gt), ("gte", r.gte), ("lt", r.lt), ("lte", r.lte)] {
        if b.is_some_and(|x| !x.is_finite()) {
            return Err(CoordError::invalid(
                format!("{path}.{name}"),
                "is not finite",
            ));
        }
    }
    if r.gt.is_some() && r.gte.is_some() {
        return Err(CoordError::invalid(path, "sets both gt and gte"));
    }
    if r.lt.is_some() && r.lte.is_some() {
        return Err(CoordError::invalid(path, "sets both lt and lte"));
    }
    let lo = r.gt.or(r.gte);
    let hi = r.lt.or(r.lte);
    match (lo, hi) {
        (None, None) => Err(CoordError::invalid(path, "sets no bound")),
        (Some(l), Some(h)) => {
            let open = r.gt.is_some() || r.lt.is_some();
            if l > h || (open && l == h) {
                let (ln, hn) = (
                    if r.gt.is_some() { "gt" } else { "gte" },
                    if r.lt.is_some() { "lt" } else { "lte" },
                );
                Err(CoordError::invalid(
                    format!("{path}.{ln}"),
                    format!("the range {ln} {l} {hn} {h} is empty"),
                ))
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ragcluster_proto::v1::{AnyOf, KeywordList, Match};

    fn info() -> CollectionInfo {
        CollectionInfo {
            fields: vec![
                FieldSchema {
                    name: "lang".into(),
                    r#type: FieldType::Keyword as i32,
                },
                FieldSchema {
                    name: "year".into(),
                    r#type: FieldType::Integer as i32,
                },
                FieldSchema {
                    name: "tags".into(),
                    r#type: FieldType::KeywordList as i32,
                },
            ],
            ..Default::default()
        }
    }

    fn cond(k: condition::Kind) -> Condition {
        Condition { kind: Some(k) }
    }

    fn err(f: &Filter) -> String {
        check_filter("conditions", f, &info())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn filters_are_checked_against_the_schema_by_path() {
        let ok = Filter {
            must: vec![
                cond(condition::Kind::Range(Range {
                    field: "year".into(),
                    gte: Some(2000.0),
                    lt: Some(2010.0),
                    ..Default::default()
                })),
                cond(condition::Kind::Match(Match {
                    field: "section".into(),
                    value: Some(Value {
                        kind: Some(value::Kind::Keyword("Intro".into())),
                    }),
                })),
            ],
            should: vec![cond(condition::Kind::AnyOf(AnyOf {
                field: "tags".into(),
                keywords: vec!["a".into()],
                ..Default::default()
            }))],
            must_not: vec![cond(condition::Kind::Exists("lang".into()))],
        };
        check_filter("conditions", &ok, &info()).unwrap();
        let unknown = Filter {
            must: vec![cond(condition::Kind::Exists("nope".into()))],
            ..Default::default()
        };
        assert!(
            err(&unknown).contains("conditions.must[0].exists"),
            "{}",
            err(&unknown)
        );
        let wrong_type = Filter {
            should: vec![cond(condition::Kind::Filter(Filter {
                must: vec![cond(condition::Kind::Range(Range {
                    field: "lang".into(),
                    gt: Some(1.0),
                    ..Default::default()
                }))],
                ..Default::default()
            }))],
            ..Default::default()
        };
        assert!(
            err(&wrong_type).contains("conditions.should[0].filter.must[0].range"),
            "{}",
            err(&wrong_type)
        );
        let empty = Filter {
            must: vec![cond(condition::Kind::Range(Range {
                field: "year".into(),
                gte: Some(3.0),
                lt: Some(3.0),
                ..Default::default()
            }))],
            ..Default::default()
        };
        assert!(
            err(&empty).contains("conditions.must[0].range.gte"),
            "{}",
            err(&empty)
        );
        let float_match = Filter {
            must: vec![cond(condition::Kind::Match(Match {
                field: "year".into(),
                value: Some(Value {
                    kind: Some(value::Kind::Float(1.5)),
                }),
            }))],
            ..Default::default()
        };
        assert!(err(&float_match).contains("conditions.must[0].match.value"));
    }

    #[test]
    fn documents_grow_the_schema_and_keep_its_types() {
        let doc = |fields: Vec<(&str, value::Kind)>| Document {
            fields: fields
                .into_iter()
                .map(|(k, v)| (k.to_owned(), Value { kind: Some(v) }))
                .collect(),
            metadata: [("source".to_owned(), "wiki".to_owned())].into(),
            ..Default::default()
        };
        let grown = growth(
            &[
                doc(vec![
                    ("year", value::Kind::Integer(2020)),
                    ("score", value::Kind::Float(0.5)),
                ]),
                doc(vec![(
                    "tags",
                    value::Kind::Keywords(KeywordList {
                        values: vec!["x".into()],
                    }),
                )]),
            ],
            &info(),
        )
        .unwrap();
        let names: Vec<(&str, FieldType)> = grown
            .iter()
            .map(|f| (f.name.as_str(), f.r#type()))
            .collect();
        assert_eq!(
            names,
            [("score", FieldType::Float), ("source", FieldType::Keyword)]
        );
        let e = growth(
            &[doc(vec![("year", value::Kind::Keyword("x".into()))])],
            &info(),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("documents[0].fields[\"year\"]"),
            "{e}"
        );
        let e = growth(
            &[
                doc(vec![("new", value::Kind::Integer(1))]),
                doc(vec![("new", value::Kind::Boolean(true))]),
            ],
            &info(),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("documents[1].fields[\"new\"]"),
            "{e}"
        );
        let e = growth(
            &[doc(vec![("big", value::Kind::Integer(1 << 60))])],
            &info(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("2^53"), "{e}");
    }
}
