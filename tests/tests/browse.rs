//! Reading stored data back on real processes (issue 69): GetDocuments returns documents
//! with their chunks in order; Scroll pages through every chunk of a 3-shard collection in
//! (document id, position) order with no chunk skipped or repeated, filtered or not, while
//! writes go on between pages; Count agrees with the scroll; a write's read token makes each
//! of them see the write; malformed requests are refused whole, naming the field.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use anyhow::{Result, ensure};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, refused};
use tonic::Code;
use tonic::transport::Channel;

const WORDS: [&str; 12] = [
    "raft", "shard", "replica", "leader", "snapshot", "index", "vector", "token", "chunk",
    "segment", "merge", "quorum",
];

/// A document of 60 words in one sentence (cut into 16-token windows), in language `lang`.
fn doc(id: &str, lang: &str, seed: usize) -> Document {
    let text: Vec<String> = (0..60)
        .map(|i| WORDS[(seed * 7 + i * 5) % WORDS.len()].to_owned())
        .collect();
    Document {
        id: id.into(),
        title: format!("Doc {id}"),
        text: format!("{}.", text.join(" ")),
        metadata: [
            ("lang".to_owned(), lang.to_owned()),
            ("bucket".to_owned(), (seed % 10).to_string()),
        ]
        .into(),
        ..Default::default()
    }
}

fn lang(i: usize) -> &'static str {
    if i.is_multiple_of(3) { "de" } else { "en" }
}

/// Every chunk by scrolling pages of `limit`, and how many pages that took.
async fn scroll_all(
    c: &mut CoordinatorClient<Channel>,
    filter: &HashMap<String, String>,
    limit: u32,
    mut between: impl AsyncFnMut(&mut CoordinatorClient<Channel>, usize) -> Result<()>,
) -> Result<(Vec<Chunk>, usize)> {
    let mut out = Vec::new();
    let mut cursor = String::new();
    let mut pages = 0;
    loop {
        let page = c
            .scroll(ScrollRequest {
                collection: "b".into(),
                filter: filter.clone(),
                limit,
                cursor: cursor.clone(),
                ..Default::default()
            })
            .await?
            .into_inner();
        pages += 1;
        ensure!(page.chunks.len() <= limit as usize, "page over its limit");
        out.extend(page.chunks);
        if page.next_cursor.is_empty() {
            return Ok((out, pages));
        }
        ensure!(pages < 10_000, "scroll does not end");
        cursor = page.next_cursor;
        between(c, pages).await?;
    }
}

fn keys(chunks: &[Chunk]) -> Vec<(String, u32)> {
    chunks
        .iter()
        .map(|c| (c.doc_id.clone(), c.position))
        .collect()
}

async fn count(c: &mut CoordinatorClient<Channel>, filter: &[(&str, &str)]) -> Result<(u64, u64)> {
    let r = c
        .count(CountRequest {
            collection: "b".into(),
            filter: filter
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok((r.chunks, r.documents))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_scroll_and_count_read_back_what_was_written() -> Result<()> {
    let cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: "b".into(),
        shard_count: 3,
        chunking: Some(ChunkingConfig {
            strategy: ChunkingStrategy::Sentence as i32,
            chunk_size: 16,
            chunk_overlap: 0,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await?;
    let n = 60;
    let docs: Vec<Document> = (0..n)
        .map(|i| doc(&format!("d{i:03}"), lang(i), i))
        .collect();
    for batch in docs.chunks(20) {
        c.upsert_documents(UpsertDocumentsRequest {
            collection: "b".into(),
            documents: batch.to_vec(),
            ..Default::default()
        })
        .await?;
    }

    // GetDocuments: request order, duplicates once, unknown ids listed, chunks in order.
    let got = c
        .get_documents(GetDocumentsRequest {
            collection: "b".into(),
            ids: vec!["d007".into(), "nope".into(), "d003".into(), "d007".into()],
            with_embedding: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    let ids: Vec<&str> = got.documents.iter().map(|d| d.id.as_str()).collect();
    ensure!(ids == ["d007", "d003"], "documents {ids:?}");
    ensure!(got.not_found == ["nope"], "not found {:?}", got.not_found);
    let d7 = &got.documents[0];
    ensure!(d7.title == "Doc d007" && d7.metadata.get("lang").map(String::as_str) == Some("en"));
    ensure!(d7.chunks.len() >= 3, "{} chunks", d7.chunks.len());
    for (i, ch) in d7.chunks.iter().enumerate() {
        ensure!(
            ch.position == i as u32 && ch.doc_id == "d007",
            "chunk {i} out of order"
        );
        ensure!(
            ch.embedding.len() == 384,
            "embedding of {} dims",
            ch.embedding.len()
        );
    }
    // Chunks are verbatim slices of the text (windows may overlap): together, from its
    // start to its end.
    let text = &docs[7].text;
    ensure!(
        d7.chunks.iter().all(|ch| text.contains(&ch.text))
            && text.starts_with(&d7.chunks[0].text)
            && d7.chunks.last().is_some_and(|ch| text.ends_with(&ch.text)),
        "d007's chunks do not read back its text: {:?}",
        d7.chunks
            .iter()
            .map(|ch| ch.text.as_str())
            .collect::<Vec<_>>()
    );

    // Scroll, small pages: every chunk once, in order; Count agrees.
    let (all, pages) = scroll_all(&mut c, &HashMap::new(), 7, async |_, _| Ok(())).await?;
    let k = keys(&all);
    let mut sorted = k.clone();
    sorted.sort();
    sorted.dedup();
    ensure!(k == sorted, "scroll out of order or repeated");
    let docs_seen: BTreeSet<&str> = all.iter().map(|ch| ch.doc_id.as_str()).collect();
    ensure!(
        docs_seen.len() == n,
        "{} documents scrolled",
        docs_seen.len()
    );
    ensure!(
        all.iter().all(|ch| ch.embedding.is_empty()),
        "embeddings without asking"
    );
    let (chunks, documents) = count(&mut c, &[]).await?;
    ensure!(
        (chunks, documents) == (all.len() as u64, n as u64),
        "count {chunks}/{documents}, scrolled {}/{n}",
        all.len()
    );
    println!(
        "scrolled {} chunks of {n} documents in {pages} pages of 7",
        all.len()
    );

    // Filtered: the same as filtering the whole scroll, and counted alike.
    let de: HashMap<String, String> = [("lang".to_owned(), "de".to_owned())].into();
    let (de_chunks, _) = scroll_all(&mut c, &de, 50, async |_, _| Ok(())).await?;
    let want: Vec<(String, u32)> = all
        .iter()
        .filter(|ch| ch.metadata.get("lang").map(String::as_str) == Some("de"))
        .map(|ch| (ch.doc_id.clone(), ch.position))
        .collect();
    ensure!(keys(&de_chunks) == want, "filtered scroll differs");
    // A selective filter (10%): the shards walk the BM25 index's matches instead.
    let b3: HashMap<String, String> = [("bucket".to_owned(), "3".to_owned())].into();
    let (b3_chunks, _) = scroll_all(&mut c, &b3, 4, async |_, _| Ok(())).await?;
    let want3: Vec<(String, u32)> = all
        .iter()
        .filter(|ch| ch.metadata.get("bucket").map(String::as_str) == Some("3"))
        .map(|ch| (ch.doc_id.clone(), ch.position))
        .collect();
    ensure!(
        !want3.is_empty() && keys(&b3_chunks) == want3,
        "selective scroll differs"
    );
    let de_docs = (0..n).filter(|i| lang(*i) == "de").count() as u64;
    ensure!(count(&mut c, &[("lang", "de")]).await? == (want.len() as u64, de_docs));
    ensure!(count(&mut c, &[("lang", "fr")]).await? == (0, 0));

    // Writes between pages: documents that exist throughout are each read exactly once,
    // whatever is added or deleted meanwhile.
    let (during, _) = scroll_all(&mut c, &HashMap::new(), 9, async |c, page| {
        let i = 1000 + page;
        c.upsert_documents(UpsertDocumentsRequest {
            collection: "b".into(),
            documents: vec![doc(&format!("d{:03}x", page % 60), "en", i)],
            ..Default::default()
        })
        .await?;
        if page % 4 == 0 {
            c.delete_documents(DeleteDocumentsRequest {
                collection: "b".into(),
                ids: vec![format!("d{:03}x", (page + 30) % 60)],
                ..Default::default()
            })
            .await?;
        }
        Ok(())
    })
    .await?;
    let mut seen: BTreeMap<(String, u32), usize> = BTreeMap::new();
    for k in keys(&during) {
        *seen.entry(k).or_default() += 1;
    }
    ensure!(seen.values().all(|n| *n == 1), "a chunk came twice");
    for k in &k {
        ensure!(seen.contains_key(k), "{k:?} stored throughout was skipped");
    }

    // A write's token: an eventual Get, Scroll and Count given it see the write.
    let w = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "b".into(),
            documents: vec![doc("zz-late", "fr", 7)],
            ..Default::default()
        })
        .await?
        .into_inner();
    let got = c
        .get_documents(GetDocumentsRequest {
            collection: "b".into(),
            ids: vec!["zz-late".into()],
            read_token: w.read_token.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        got.documents.len() == 1,
        "the token's write is not read back"
    );
    let page = c
        .scroll(ScrollRequest {
            collection: "b".into(),
            filter: [("lang".to_owned(), "fr".to_owned())].into(),
            read_token: w.read_token.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(page.chunks.iter().any(|ch| ch.doc_id == "zz-late"));
    let counted = c
        .count(CountRequest {
            collection: "b".into(),
            filter: [("lang".to_owned(), "fr".to_owned())].into(),
            read_token: w.read_token,
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(counted.documents == 1, "count {counted:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_reads_are_refused_naming_the_field() -> Result<()> {
    let cluster = Cluster::start(2)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: "b".into(),
        shard_count: 2,
        ..Default::default()
    })
    .await?;
    c.upsert_documents(UpsertDocumentsRequest {
        collection: "b".into(),
        documents: (0..3).map(|i| doc(&format!("d{i}"), "en", i)).collect(),
        ..Default::default()
    })
    .await?;
    let get = |ids: Vec<String>| GetDocumentsRequest {
        collection: "b".into(),
        ids,
        ..Default::default()
    };
    let cases = [
        ("no ids", get(vec![]), Code::InvalidArgument, "ids"),
        (
            "empty id",
            get(vec!["d0".into(), String::new()]),
            Code::InvalidArgument,
            "ids[1]",
        ),
        (
            "long id",
            get(vec!["x".repeat(513)]),
            Code::InvalidArgument,
            "ids[0]",
        ),
        (
            "too many",
            get((0..257).map(|i| i.to_string()).collect()),
            Code::ResourceExhausted,
            "ids",
        ),
        (
            "consistency",
            GetDocumentsRequest {
                consistency: 9,
                ..get(vec!["d0".into()])
            },
            Code::InvalidArgument,
            "consistency",
        ),
        (
            "token",
            GetDocumentsRequest {
                read_token: "rt1.nope".into(),
                ..get(vec!["d0".into()])
            },
            Code::InvalidArgument,
            "read_token",
        ),
        (
            "timeout",
            GetDocumentsRequest {
                timeout_ms: 60_001,
                ..get(vec!["d0".into()])
            },
            Code::InvalidArgument,
            "timeout_ms",
        ),
    ];
    for (case, req, code, field) in cases {
        refused(case, c.get_documents(req).await, code, field)?;
    }
    let first = c
        .scroll(ScrollRequest {
            collection: "b".into(),
            limit: 1,
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        !first.next_cursor.is_empty(),
        "one of several chunks is not the last page"
    );
    let scroll = |cursor: &str| ScrollRequest {
        collection: "b".into(),
        cursor: cursor.into(),
        ..Default::default()
    };
    let cases = [
        (
            "limit",
            ScrollRequest {
                limit: 1001,
                ..scroll("")
            },
            "limit",
        ),
        ("cursor", scroll("sc1.garbage"), "cursor"),
        ("cursor kind", scroll("rt1.AAAA"), "cursor"),
        ("cursor size", scroll(&"x".repeat(16 * 1024 + 1)), "cursor"),
        (
            "cursor of another filter",
            ScrollRequest {
                filter: [("lang".to_owned(), "en".to_owned())].into(),
                ..scroll(&first.next_cursor)
            },
            "cursor",
        ),
        (
            "cursor with embeddings",
            ScrollRequest {
                with_embedding: true,
                ..scroll(&first.next_cursor)
            },
            "cursor",
        ),
        (
            "empty filter key",
            ScrollRequest {
                filter: [(String::new(), "x".to_owned())].into(),
                ..scroll("")
            },
            "filter",
        ),
        (
            "collection",
            ScrollRequest {
                collection: "Bad Name".into(),
                ..scroll("")
            },
            "collection",
        ),
    ];
    for (case, req, field) in cases {
        refused(case, c.scroll(req).await, Code::InvalidArgument, field)?;
    }
    refused(
        "count filter",
        c.count(CountRequest {
            collection: "b".into(),
            filter: [(String::new(), "x".to_owned())].into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "filter",
    )?;
    refused(
        "count missing",
        c.count(CountRequest {
            collection: "missing".into(),
            ..Default::default()
        })
        .await,
        Code::NotFound,
        "missing",
    )?;
    // A cursor outlives neither its collection: dropped and created again, it is refused.
    c.drop_collection(DropCollectionRequest { name: "b".into() })
        .await?;
    c.create_collection(CreateCollectionRequest {
        name: "b".into(),
        shard_count: 2,
        ..Default::default()
    })
    .await?;
    refused(
        "cursor of a dropped collection",
        c.scroll(scroll(&first.next_cursor)).await,
        Code::InvalidArgument,
        "cursor",
    )?;
    Ok(())
}
