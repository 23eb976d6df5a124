//! Partial updates on real processes (issue 69): metadata patched by filter and by id without
//! re-embedding (the vectors read back unchanged, searches filter by the new values at once),
//! a patch of the wrong type refused whole, new fields joining the schema, deletes by filter
//! removing exactly their matches, an empty delete filter refused, `ragctl update` /
//! `ragctl delete`, and upserts of unchanged text reusing the stored vectors (MiniLM).

use std::collections::BTreeSet;

use anyhow::{Result, ensure};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, ragctl_at, refused};
use tonic::Code;
use tonic::transport::Channel;

const DOCS: usize = 40;
const DIM: usize = 384;
const C: &str = "upd";

fn val(k: value::Kind) -> Value {
    Value { kind: Some(k) }
}

fn kw(field: &str, v: &str) -> Filter {
    Filter {
        must: vec![Condition {
            kind: Some(condition::Kind::Match(Match {
                field: field.into(),
                value: Some(val(value::Kind::Keyword(v.into()))),
            })),
        }],
        ..Default::default()
    }
}

/// Document i: lang de on every third, year 2000 + i % 10, its own unit vector.
fn doc(i: usize) -> Document {
    let mut v: Vec<f32> = (0..DIM)
        .map(|j| (((i * 31 + j * 7) % 97) as f32 / 97.0) - 0.5)
        .collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter_mut().for_each(|x| *x /= n);
    Document {
        id: format!("d{i:03}"),
        title: format!("Document {i}"),
        text: format!("raft shard replica number {i} of the update test."),
        metadata: [(
            "lang".to_owned(),
            if i.is_multiple_of(3) { "de" } else { "en" }.to_owned(),
        )]
        .into(),
        fields: [(
            "year".to_owned(),
            val(value::Kind::Integer(2000 + (i % 10) as i64)),
        )]
        .into(),
        embedding: v,
    }
}

fn is_de(i: usize) -> bool {
    i.is_multiple_of(3)
}

async fn count(c: &mut CoordinatorClient<Channel>, f: Option<Filter>) -> Result<u64> {
    Ok(c.count(CountRequest {
        collection: C.into(),
        conditions: f,
        ..Default::default()
    })
    .await?
    .into_inner()
    .documents)
}

async fn dense_docs(c: &mut CoordinatorClient<Channel>, f: &Filter) -> Result<BTreeSet<String>> {
    let r = c
        .search(SearchRequest {
            collection: C.into(),
            query: "raft shard replica".into(),
            top_k: 100,
            mode: SearchMode::Dense as i32,
            conditions: Some(f.clone()),
            query_vector: doc(1).embedding,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(r.hits.into_iter().map(|h| h.doc_id).collect())
}

async fn get(c: &mut CoordinatorClient<Channel>, ids: &[String]) -> Result<GetDocumentsResponse> {
    Ok(c.get_documents(GetDocumentsRequest {
        collection: C.into(),
        ids: ids.to_vec(),
        with_embedding: true,
        ..Default::default()
    })
    .await?
    .into_inner())
}

async fn upsert(
    c: &mut CoordinatorClient<Channel>,
    documents: Vec<Document>,
) -> Result<UpsertDocumentsResponse> {
    Ok(c.upsert_documents(UpsertDocumentsRequest {
        collection: C.into(),
        documents,
        ..Default::default()
    })
    .await?
    .into_inner())
}

fn ids(pred: impl Fn(usize) -> bool) -> Vec<String> {
    (0..DOCS)
        .filter(|&i| pred(i))
        .map(|i| format!("d{i:03}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_patches_and_deletes_by_filter() -> Result<()> {
    let cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: C.into(),
        shard_count: 3,
        ..Default::default()
    })
    .await?;
    let docs: Vec<Document> = (0..DOCS).map(doc).collect();
    c.upsert_documents(UpsertDocumentsRequest {
        collection: C.into(),
        documents: docs,
        ..Default::default()
    })
    .await?;
    let de = ids(is_de);
    let before = get(&mut c, &de).await?;

    // Patch by filter: every German document becomes gold, year 1999, and gains "views".
    let patch = MetadataPatch {
        set_metadata: [("tier".to_owned(), "gold".to_owned())].into(),
        set_fields: [
            ("year".to_owned(), val(value::Kind::Integer(1999))),
            ("views".to_owned(), val(value::Kind::Integer(7))),
        ]
        .into(),
        ..Default::default()
    };
    let r = c
        .update_documents(UpdateDocumentsRequest {
            collection: C.into(),
            conditions: Some(kw("lang", "de")),
            patch: Some(patch),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(r.updated as usize == de.len(), "updated {}", r.updated);
    ensure!(r.shards.len() == 3 && r.shards.iter().all(|s| s.applied));
    ensure!(count(&mut c, Some(kw("tier", "gold"))).await? == de.len() as u64);
    let want: BTreeSet<String> = de.iter().cloned().collect();
    ensure!(dense_docs(&mut c, &kw("tier", "gold")).await? == want);
    let after = get(&mut c, &de).await?;
    for (b, a) in before.documents.iter().zip(&after.documents) {
        ensure!(a.metadata.get("tier").map(String::as_str) == Some("gold"));
        ensure!(a.fields["year"].kind == Some(value::Kind::Integer(1999)));
        let (bv, av) = (&b.chunks[0].embedding, &a.chunks[0].embedding);
        ensure!(!bv.is_empty() && bv == av, "{}: the vector changed", a.id);
    }
    let info = c
        .describe_collection(DescribeCollectionRequest { name: C.into() })
        .await?
        .into_inner()
        .collection
        .unwrap_or_default();
    ensure!(
        info.fields
            .iter()
            .any(|f| f.name == "views" && f.r#type() == FieldType::Integer),
        "the patch grew the schema: {:?}",
        info.fields
    );

    // By id: unknown ids are reported; a wrong type is refused whole.
    let r = c
        .update_documents(UpdateDocumentsRequest {
            collection: C.into(),
            ids: vec!["d001".into(), "nope".into()],
            patch: Some(MetadataPatch {
                delete_metadata: vec!["lang".into()],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(r.updated == 1 && r.not_found == ["nope"], "{r:?}");
    let wrong = c
        .update_documents(UpdateDocumentsRequest {
            collection: C.into(),
            conditions: Some(Filter::default()),
            patch: Some(MetadataPatch {
                set_fields: [("views".to_owned(), val(value::Kind::Keyword("x".into())))].into(),
                set_metadata: [("tier".to_owned(), "tin".to_owned())].into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await;
    refused(
        "wrong type",
        wrong,
        Code::InvalidArgument,
        "patch.set_fields[\"views\"]",
    )?;
    ensure!(count(&mut c, Some(kw("tier", "tin"))).await? == 0);
    let section = c
        .update_documents(UpdateDocumentsRequest {
            collection: C.into(),
            ids: vec!["d001".into()],
            patch: Some(MetadataPatch {
                delete_metadata: vec!["section".into()],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await;
    refused("section", section, Code::InvalidArgument, "chunking")?;

    // Delete by filter: exactly the gold documents go.
    let empty = c
        .delete_documents(DeleteDocumentsRequest {
            collection: C.into(),
            conditions: Some(Filter::default()),
            ..Default::default()
        })
        .await;
    refused("empty filter", empty, Code::InvalidArgument, "conditions")?;
    let r = c
        .delete_documents(DeleteDocumentsRequest {
            collection: C.into(),
            conditions: Some(kw("tier", "gold")),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(r.deleted as usize == de.len(), "deleted {}", r.deleted);
    ensure!(count(&mut c, None).await? == (DOCS - de.len()) as u64);
    ensure!(get(&mut c, &de).await?.not_found.len() == de.len());

    // The same through ragctl.
    let addr = &cluster.coordinator.grpc;
    ragctl_at(
        addr,
        &[
            "update",
            "--collection",
            C,
            "--where",
            "year = 2002",
            "--set",
            "tier=silver",
        ],
    )?;
    let silver = ids(|i| !is_de(i) && i % 10 == 2);
    ensure!(count(&mut c, Some(kw("tier", "silver"))).await? == silver.len() as u64);
    let out = ragctl_at(
        addr,
        &[
            "delete",
            "--collection",
            C,
            "--where",
            "tier = silver",
            "--json",
        ],
    )?;
    ensure!(
        out.contains(&format!("\"deleted\":{}", silver.len())),
        "{out}"
    );
    Ok(())
}

/// An upsert of unchanged text keeps the stored vectors (MiniLM is not asked again); a changed
/// document is embedded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unchanged_chunks_keep_their_vectors() -> Result<()> {
    let cluster = Cluster::start(1)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: C.into(),
        shard_count: 2,
        ..Default::default()
    })
    .await?;
    let text = |i: usize, v: &str| Document {
        id: format!("t{i}"),
        title: "Raft".into(),
        text: format!("Raft elects a leader by randomized timeouts, {v} number {i}."),
        ..Default::default()
    };
    let first = upsert(&mut c, (0..6).map(|i| text(i, "first")).collect()).await?;
    ensure!(first.reused_chunks == 0 && first.chunks == 6, "{first:?}");
    let stored = get(&mut c, &["t0".into()]).await?;
    let mut again: Vec<Document> = (0..6).map(|i| text(i, "first")).collect();
    again[5] = text(5, "second");
    let second = upsert(&mut c, again).await?;
    ensure!(
        second.reused_chunks == 5 && second.chunks == 6,
        "five unchanged chunks reused: {second:?}"
    );
    let now = get(&mut c, &["t0".into()]).await?;
    ensure!(now.documents[0].chunks[0].embedding == stored.documents[0].chunks[0].embedding);
    ensure!(!now.documents[0].chunks[0].embedding_revision.is_empty());
    Ok(())
}
