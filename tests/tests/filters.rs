//! Typed metadata and the filter language on real processes (issue 69): documents with
//! integer, float, bool, datetime and keyword-list fields grow the collection's schema; a
//! value of the wrong type is refused whole (nothing written, the schema unchanged); every
//! kind of condition (match, any-of, range, exists, must / should / must_not, nesting)
//! selects exactly the chunks a local evaluation of the same predicate selects, through
//! Count, Scroll, BM25 and dense Search alike; a malformed filter is INVALID_ARGUMENT naming
//! its path; AddFields declares fields and refuses a change of type.

use std::collections::BTreeSet;

use anyhow::{Result, ensure};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, refused};
use tonic::Code;
use tonic::transport::Channel;

const DOCS: usize = 60;
const DIM: usize = 384;

fn val(k: value::Kind) -> Value {
    Value { kind: Some(k) }
}

/// Document i: year 2000 + i % 25, score i / 10, tags by divisibility, draft on every 7th,
/// a datetime i days after 2024-01-01, lang in metadata; a unit vector of its own.
fn doc(i: usize) -> Document {
    let mut tags = Vec::new();
    for (d, t) in [(2, "even"), (3, "three"), (5, "five")] {
        if i.is_multiple_of(d) {
            tags.push(t.to_owned());
        }
    }
    let mut fields = std::collections::HashMap::new();
    fields.insert(
        "year".to_owned(),
        val(value::Kind::Integer(2000 + (i % 25) as i64)),
    );
    fields.insert("score".to_owned(), val(value::Kind::Float(i as f64 / 10.0)));
    fields.insert(
        "tags".to_owned(),
        val(value::Kind::Keywords(KeywordList { values: tags })),
    );
    if i.is_multiple_of(7) {
        fields.insert("draft".to_owned(), val(value::Kind::Boolean(true)));
    }
    fields.insert(
        "at".to_owned(),
        val(value::Kind::DatetimeUs(
            1_704_067_200_000_000 + i as i64 * 86_400_000_000,
        )),
    );
    let mut v: Vec<f32> = (0..DIM)
        .map(|j| (((i * 31 + j * 7) % 97) as f32 / 97.0) - 0.5)
        .collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter_mut().for_each(|x| *x /= n);
    Document {
        id: format!("d{i:03}"),
        title: format!("Document {i}"),
        text: format!("raft shard replica number {i} of the filter test."),
        metadata: [(
            "lang".to_owned(),
            if i.is_multiple_of(3) { "de" } else { "en" }.to_owned(),
        )]
        .into(),
        fields,
        embedding: v,
    }
}

fn cond(k: condition::Kind) -> Condition {
    Condition { kind: Some(k) }
}

fn matches(field: &str, v: value::Kind) -> Condition {
    cond(condition::Kind::Match(Match {
        field: field.into(),
        value: Some(val(v)),
    }))
}

fn range(field: &str, gte: Option<f64>, lt: Option<f64>) -> Condition {
    cond(condition::Kind::Range(Range {
        field: field.into(),
        gte,
        lt,
        ..Default::default()
    }))
}

/// Filters with the documents each should select, evaluated here on the generated values.
/// A filter case: its name, the filter, and which documents it selects.
type Case = (&'static str, Filter, Box<dyn Fn(usize) -> bool>);

fn cases() -> Vec<Case> {
    let must = |c: Vec<Condition>| Filter {
        must: c,
        ..Default::default()
    };
    vec![
        (
            "integer match",
            must(vec![matches("year", value::Kind::Integer(2003))]),
            Box::new(|i| i % 25 == 3),
        ),
        (
            "range",
            must(vec![range("year", Some(2010.0), Some(2015.0))]),
            Box::new(|i| (10..15).contains(&(i % 25))),
        ),
        (
            "float range",
            must(vec![range("score", None, Some(1.5))]),
            Box::new(|i| (i as f64) / 10.0 < 1.5),
        ),
        (
            "keyword list",
            must(vec![matches("tags", value::Kind::Keyword("three".into()))]),
            Box::new(|i| i % 3 == 0),
        ),
        (
            "any of",
            must(vec![cond(condition::Kind::AnyOf(AnyOf {
                field: "tags".into(),
                keywords: vec!["five".into(), "three".into()],
                ..Default::default()
            }))]),
            Box::new(|i| i % 3 == 0 || i % 5 == 0),
        ),
        (
            "bool",
            must(vec![matches("draft", value::Kind::Boolean(true))]),
            Box::new(|i| i % 7 == 0),
        ),
        (
            "exists",
            Filter {
                must_not: vec![cond(condition::Kind::Exists("draft".into()))],
                ..Default::default()
            },
            Box::new(|i| i % 7 != 0),
        ),
        (
            "datetime range",
            must(vec![range(
                "at",
                Some(1_704_067_200_000_000.0 + 10.0 * 86_400_000_000.0),
                None,
            )]),
            Box::new(|i| i >= 10),
        ),
        (
            "should with must_not",
            Filter {
                must: vec![matches("lang", value::Kind::Keyword("en".into()))],
                should: vec![
                    matches("tags", value::Kind::Keyword("even".into())),
                    range("score", Some(5.0), None),
                ],
                must_not: vec![matches("year", value::Kind::Integer(2004))],
            },
            Box::new(|i| i % 3 != 0 && (i % 2 == 0 || i >= 50) && i % 25 != 4),
        ),
        (
            "nested",
            must(vec![cond(condition::Kind::Filter(Filter {
                should: vec![
                    cond(condition::Kind::Filter(must(vec![
                        matches("lang", value::Kind::Keyword("de".into())),
                        range("year", None, Some(2005.0)),
                    ]))),
                    matches("draft", value::Kind::Boolean(true)),
                ],
                ..Default::default()
            }))]),
            Box::new(|i| (i % 3 == 0 && i % 25 < 5) || i % 7 == 0),
        ),
    ]
}

async fn count(c: &mut CoordinatorClient<Channel>, f: &Filter) -> Result<u64> {
    Ok(c.count(CountRequest {
        collection: "typed".into(),
        conditions: Some(f.clone()),
        ..Default::default()
    })
    .await?
    .into_inner()
    .chunks)
}

async fn scroll_docs(c: &mut CoordinatorClient<Channel>, f: &Filter) -> Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    let mut cursor = String::new();
    loop {
        let page = c
            .scroll(ScrollRequest {
                collection: "typed".into(),
                conditions: Some(f.clone()),
                limit: 7,
                cursor: cursor.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        out.extend(page.chunks.into_iter().map(|c| c.doc_id));
        if page.next_cursor.is_empty() {
            return Ok(out);
        }
        cursor = page.next_cursor;
    }
}

/// The documents a filtered search finds; asked again with `ids_only`, the same hits in the
/// same order with the same scores, documents and positions, and no chunk bodies.
async fn search_docs(
    c: &mut CoordinatorClient<Channel>,
    f: &Filter,
    mode: SearchMode,
) -> Result<BTreeSet<String>> {
    let req = SearchRequest {
        collection: "typed".into(),
        query: "raft shard replica".into(),
        top_k: 100,
        mode: mode as i32,
        conditions: Some(f.clone()),
        query_vector: if mode == SearchMode::Dense {
            doc(1).embedding
        } else {
            vec![]
        },
        ..Default::default()
    };
    let full = c.search(req.clone()).await?.into_inner().hits;
    let ids = c
        .search(SearchRequest {
            ids_only: true,
            ..req
        })
        .await?
        .into_inner()
        .hits;
    let key = |h: &SearchHit| (h.chunk_id.clone(), h.doc_id.clone(), h.position, h.score);
    assert_eq!(
        full.iter().map(key).collect::<Vec<_>>(),
        ids.iter().map(key).collect::<Vec<_>>(),
        "{mode:?} {f:?}"
    );
    assert!(
        ids.iter()
            .all(|h| h.text.is_empty() && h.title.is_empty() && h.metadata.is_empty()),
        "ids_only hits carry no chunk bodies"
    );
    Ok(full.into_iter().map(|h| h.doc_id).collect())
}

async fn schema(c: &mut CoordinatorClient<Channel>) -> Result<Vec<(String, FieldType)>> {
    let info = c
        .describe_collection(DescribeCollectionRequest {
            name: "typed".into(),
        })
        .await?
        .into_inner()
        .collection
        .unwrap_or_default();
    Ok(info
        .fields
        .iter()
        .map(|f| (f.name.clone(), f.r#type()))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_filters_select_the_same_chunks_everywhere() -> Result<()> {
    let cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: "typed".into(),
        shard_count: 3,
        fields: vec![FieldSchema {
            name: "year".into(),
            r#type: FieldType::Integer as i32,
        }],
        ..Default::default()
    })
    .await?;
    let docs: Vec<Document> = (0..DOCS).map(doc).collect();
    for batch in docs.chunks(20) {
        c.upsert_documents(UpsertDocumentsRequest {
            collection: "typed".into(),
            documents: batch.to_vec(),
            ..Default::default()
        })
        .await?;
    }
    let want = [
        ("at", FieldType::Datetime),
        ("draft", FieldType::Bool),
        ("lang", FieldType::Keyword),
        ("score", FieldType::Float),
        ("section", FieldType::Keyword),
        ("tags", FieldType::KeywordList),
        ("year", FieldType::Integer),
    ]
    .map(|(n, t)| (n.to_owned(), t));
    ensure!(
        schema(&mut c).await? == want,
        "schema grown by the upserts: {:?}",
        schema(&mut c).await?
    );

    // A value of another type is refused whole: the valid document before it is not written.
    let mut bad = doc(100);
    bad.fields
        .insert("year".into(), val(value::Kind::Keyword("1999".into())));
    let r = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "typed".into(),
            documents: vec![doc(99), bad],
            ..Default::default()
        })
        .await;
    refused(
        "wrong type",
        r,
        Code::InvalidArgument,
        "documents[1].fields[\"year\"]",
    )?;
    let mut new_and_bad = doc(101);
    new_and_bad
        .fields
        .insert("fresh".into(), val(value::Kind::Integer(1)));
    new_and_bad
        .fields
        .insert("score".into(), val(value::Kind::Boolean(false)));
    let r = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "typed".into(),
            documents: vec![new_and_bad],
            ..Default::default()
        })
        .await;
    refused(
        "wrong type beside a new field",
        r,
        Code::InvalidArgument,
        "score",
    )?;
    ensure!(
        count(&mut c, &Filter::default()).await? == DOCS as u64,
        "nothing written"
    );
    ensure!(
        schema(&mut c).await? == want,
        "the schema did not grow from a refused upsert"
    );

    for (name, f, pred) in cases() {
        let expected: BTreeSet<String> = (0..DOCS)
            .filter(|&i| pred(i))
            .map(|i| format!("d{i:03}"))
            .collect();
        ensure!(
            count(&mut c, &f).await? == expected.len() as u64,
            "{name}: count"
        );
        ensure!(scroll_docs(&mut c, &f).await? == expected, "{name}: scroll");
        ensure!(
            search_docs(&mut c, &f, SearchMode::Dense).await? == expected,
            "{name}: dense search"
        );
        ensure!(
            search_docs(&mut c, &f, SearchMode::Bm25).await? == expected,
            "{name}: bm25 search"
        );
    }

    // Malformed filters name their path.
    let bad = [
        (
            "unknown field",
            Filter {
                must: vec![matches("nope", value::Kind::Integer(1))],
                ..Default::default()
            },
            "conditions.must[0].match.field",
        ),
        (
            "range on a keyword",
            Filter {
                should: vec![range("lang", Some(1.0), None)],
                ..Default::default()
            },
            "conditions.should[0].range",
        ),
        (
            "empty range",
            Filter {
                must: vec![range("year", Some(2010.0), Some(2010.0))],
                ..Default::default()
            },
            "conditions.must[0].range.gte",
        ),
        (
            "keyword on an integer",
            Filter {
                must_not: vec![matches("year", value::Kind::Keyword("x".into()))],
                ..Default::default()
            },
            "conditions.must_not[0].match.value",
        ),
        (
            "no condition",
            Filter {
                must: vec![Condition::default()],
                ..Default::default()
            },
            "conditions.must[0]",
        ),
    ];
    for (case, f, path) in bad {
        let r = c
            .count(CountRequest {
                collection: "typed".into(),
                conditions: Some(f.clone()),
                ..Default::default()
            })
            .await;
        refused(case, r, Code::InvalidArgument, path)?;
        let r = c
            .search(SearchRequest {
                collection: "typed".into(),
                query: "raft".into(),
                top_k: 5,
                mode: SearchMode::Bm25 as i32,
                conditions: Some(f),
                ..Default::default()
            })
            .await;
        refused(case, r, Code::InvalidArgument, path)?;
    }

    // AddFields declares; a change of type is refused and changes nothing.
    let r = c
        .add_fields(AddFieldsRequest {
            collection: "typed".into(),
            fields: vec![
                FieldSchema {
                    name: "views".into(),
                    r#type: FieldType::Integer as i32,
                },
                FieldSchema {
                    name: "lang".into(),
                    r#type: FieldType::Keyword as i32,
                },
            ],
        })
        .await?
        .into_inner();
    ensure!(r.fields.iter().any(|f| f.name == "views"), "views added");
    let r = c
        .add_fields(AddFieldsRequest {
            collection: "typed".into(),
            fields: vec![
                FieldSchema {
                    name: "other".into(),
                    r#type: FieldType::Bool as i32,
                },
                FieldSchema {
                    name: "year".into(),
                    r#type: FieldType::Keyword as i32,
                },
            ],
        })
        .await;
    refused("type change", r, Code::InvalidArgument, "year")?;
    ensure!(
        !schema(&mut c).await?.iter().any(|f| f.0 == "other"),
        "all or nothing"
    );

    // GetDocuments returns the typed fields.
    let got = c
        .get_documents(GetDocumentsRequest {
            collection: "typed".into(),
            ids: vec!["d007".into()],
            ..Default::default()
        })
        .await?
        .into_inner();
    let d = &got.documents[0];
    ensure!(
        d.fields.get("draft") == Some(&val(value::Kind::Boolean(true))),
        "fields read back: {:?}",
        d.fields
    );
    Ok(())
}
