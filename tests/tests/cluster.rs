//! End to end on real processes: a model worker, three shard nodes and a coordinator on
//! loopback. Ingest, the three search modes, filters, replace and delete, bad input, catalog
//! restart, graceful shutdown, and a shard node killed with SIGKILL in the middle of a write
//! stream that must lose no acknowledged document.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, ensure};
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, http_get, metric_sum, workspace};
use tokio::sync::Mutex;
use tonic::Code;

fn sample_docs() -> Result<Vec<Document>> {
    let mut docs = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(workspace().join("docs/sample"))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        let text = std::fs::read_to_string(&p)?;
        let id = p.file_stem().unwrap().to_string_lossy().into_owned();
        let topic = if [
            "raft-consensus",
            "bm25-ranking",
            "hnsw-vectors",
            "retrieval-augmented-generation",
        ]
        .contains(&id.as_str())
        {
            "systems"
        } else {
            "life"
        };
        let title = text
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("# ")
            .to_owned();
        docs.push(Document {
            fields: Default::default(),
            id,
            title,
            text,
            metadata: HashMap::from([("topic".into(), topic.into())]),
            embedding: vec![],
        });
    }
    Ok(docs)
}

fn search(collection: &str, query: &str, mode: SearchMode) -> SearchRequest {
    SearchRequest {
        collection: collection.into(),
        query: query.into(),
        top_k: 5,
        mode: mode as i32,
        ..Default::default()
    }
}

fn top_doc(r: &SearchResponse) -> &str {
    r.hits.first().map(|h| h.doc_id.as_str()).unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_end_to_end() -> Result<()> {
    let mut cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    let md = ChunkingConfig {
        strategy: ChunkingStrategy::Markdown as i32,
        ..Default::default()
    };
    let info = c
        .create_collection(CreateCollectionRequest {
            name: "e2e".into(),
            shard_count: 3,
            chunking: Some(md),
            ..Default::default()
        })
        .await?
        .into_inner()
        .collection
        .unwrap();
    assert_eq!(info.dimension, 384);
    assert_eq!(info.shards.len(), 3);
    let docs = sample_docs()?;
    let n_docs = docs.len() as u32;
    let up = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "e2e".into(),
            documents: docs.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(up.documents, n_docs);
    assert!(
        up.chunks > n_docs,
        "markdown sections should give several chunks per document"
    );
    embedding_cache(&cluster, &mut c, docs.clone(), up.chunks).await?;

    // All three modes find the obvious document; hybrid explains both retrievers.
    for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
        let r = c
            .search(search("e2e", "sourdough starter flour and water", mode))
            .await?
            .into_inner();
        ensure!(
            top_doc(&r) == "sourdough-bread",
            "{mode:?}: top hit {}",
            top_doc(&r)
        );
        assert_eq!(r.shards_ok, 3);
    }
    let r = c
        .search(search("e2e", "how is a leader elected", SearchMode::Hybrid))
        .await?
        .into_inner();
    assert_eq!(top_doc(&r), "raft-consensus");
    let h = &r.hits[0];
    assert_eq!(h.section, "Raft consensus > Leader election");
    assert!(
        h.bm25.as_ref().is_some_and(|s| s.rank >= 1)
            && h.dense.as_ref().is_some_and(|s| s.rank >= 1)
    );
    // Paraphrase without shared terms: dense finds it.
    let r = c
        .search(search(
            "e2e",
            "animals living among rocks by the ocean",
            SearchMode::Dense,
        ))
        .await?
        .into_inner();
    assert_eq!(top_doc(&r), "tide-pools");
    for fusion in ["rrf", "cc", "dbsf"] {
        let mut q = search("e2e", "vector index graph neighbours", SearchMode::Hybrid);
        q.fusion = fusion.into();
        let r = c.search(q).await?.into_inner();
        assert_eq!(top_doc(&r), "hnsw-vectors", "fusion {fusion}");
    }
    // Metadata filters apply to both retrievers.
    for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
        let mut q = search("e2e", "temperature", mode);
        q.filter = HashMap::from([("topic".into(), "life".into())]);
        let r = c.search(q).await?.into_inner();
        assert!(!r.hits.is_empty(), "{mode:?}");
        assert!(
            r.hits
                .iter()
                .all(|h| h.metadata.get("topic").map(String::as_str) == Some("life")),
            "{mode:?}"
        );
    }

    // Replace a document: its old chunks disappear from both indexes.
    let volcano = Document {
        fields: Default::default(),
        id: "tide-pools".into(),
        title: "Volcanoes".into(),
        text: "Volcanoes erupt molten lava and ash when magma rises through the crust.".into(),
        metadata: HashMap::from([("topic".into(), "life".into())]),
        embedding: vec![],
    };
    c.upsert_documents(UpsertDocumentsRequest {
        collection: "e2e".into(),
        documents: vec![volcano],
        ..Default::default()
    })
    .await?;
    let r = c
        .search(search("e2e", "magma lava eruption", SearchMode::Hybrid))
        .await?
        .into_inner();
    assert_eq!(top_doc(&r), "tide-pools");
    let r = c
        .search(search(
            "e2e",
            "starfish mussels keystone predator",
            SearchMode::Bm25,
        ))
        .await?
        .into_inner();
    assert!(
        r.hits.iter().all(|h| h.doc_id != "tide-pools"),
        "old chunks still match bm25"
    );
    let r = c
        .search(search(
            "e2e",
            "starfish mussels keystone predator",
            SearchMode::Dense,
        ))
        .await?
        .into_inner();
    assert!(
        r.hits.iter().all(|h| !h.text.contains("Starfish")),
        "old chunks still match dense"
    );

    // Delete.
    let d = c
        .delete_documents(DeleteDocumentsRequest {
            collection: "e2e".into(),
            ids: vec!["sourdough-bread".into(), "nope".into()],
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(d.deleted, 1);
    assert_eq!(d.not_found, vec!["nope".to_string()]);
    for mode in [SearchMode::Bm25, SearchMode::Dense] {
        let r = c
            .search(search("e2e", "sourdough bread starter", mode))
            .await?
            .into_inner();
        assert!(
            r.hits.iter().all(|h| h.doc_id != "sourdough-bread"),
            "{mode:?} still finds a deleted doc"
        );
    }

    bad_input(&mut c).await?;
    operability(&cluster).await?;

    // The catalog survives a coordinator restart (graceful this time: exit status 0).
    let status = cluster.coordinator.terminate()?;
    assert!(status.success(), "coordinator exit {status}");
    cluster.coordinator.restart(Duration::from_secs(60))?;
    let mut c = cluster.client().await?;
    let list = c
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner();
    assert!(list.collections.iter().any(|x| x.name == "e2e"));
    let dsc = c
        .describe_collection(DescribeCollectionRequest { name: "e2e".into() })
        .await?
        .into_inner();
    assert_eq!(
        dsc.shards.iter().map(|s| s.documents).sum::<u64>(),
        u64::from(n_docs) - 1
    );

    kill_during_writes(&mut cluster).await
}

/// The same documents ingested into a second collection take their vectors from the
/// coordinator's embedding cache (keyed by the model revision the worker reports), and those
/// are the vectors the worker computed: dense search scores both collections alike.
async fn embedding_cache(
    cluster: &Cluster,
    c: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
    docs: Vec<Document>,
    chunks: u32,
) -> Result<()> {
    let mini = ragcluster_tests::embed_model_info(&cluster.model_worker.grpc).await?;
    ensure!(
        mini.revision.len() == 32 && mini.max_batch > 0,
        "revision {:?}, max_batch {}",
        mini.revision,
        mini.max_batch
    );
    let hits = || async {
        let page = http_get(&cluster.coordinator.metrics).await?;
        anyhow::Ok(metric_sum(&page, "coordinator_embed_cache_hits_total"))
    };
    let before = hits().await?;
    c.create_collection(CreateCollectionRequest {
        name: "e2e-copy".into(),
        shard_count: 1,
        chunking: Some(ChunkingConfig {
            strategy: ChunkingStrategy::Markdown as i32,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await?;
    let up = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "e2e-copy".into(),
            documents: docs,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(up.chunks, chunks);
    let hit = hits().await? - before;
    ensure!(
        hit >= f64::from(chunks),
        "{hit} cache hits for {chunks} chunks embedded before"
    );
    for q in [
        "sourdough starter flour and water",
        "how is a leader elected",
    ] {
        let a = c
            .search(search("e2e", q, SearchMode::Dense))
            .await?
            .into_inner();
        let b = c
            .search(search("e2e-copy", q, SearchMode::Dense))
            .await?
            .into_inner();
        let top = |r: &SearchResponse| (r.hits[0].chunk_id.clone(), r.hits[0].score);
        assert_eq!(top(&a), top(&b), "{q}");
    }
    c.drop_collection(DropCollectionRequest {
        name: "e2e-copy".into(),
    })
    .await?;
    Ok(())
}

/// Every process answers grpc.health.v1 and serves Prometheus metrics per RPC.
async fn operability(cluster: &Cluster) -> Result<()> {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let procs = std::iter::once(&cluster.coordinator)
        .chain(&cluster.shards)
        .chain([&cluster.model_worker]);
    for p in procs {
        let ch = tonic::transport::Channel::from_shared(p.grpc.clone())?
            .connect()
            .await?;
        let r = HealthClient::new(ch)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await?
            .into_inner();
        ensure!(r.status == 1, "{} is not SERVING", p.name);
        let body = http_get(&p.metrics).await?;
        ensure!(
            body.contains("grpc_server_requests_total"),
            "{} /metrics lacks request counts",
            p.name
        );
    }
    let body = http_get(&cluster.coordinator.metrics).await?;
    ensure!(
        body.contains("method=\"Search\"") && body.contains("coordinator_search_seconds"),
        "coordinator metrics: {body}"
    );
    Ok(())
}

async fn bad_input(
    c: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<tonic::transport::Channel>,
) -> Result<()> {
    let before = c
        .describe_collection(DescribeCollectionRequest { name: "e2e".into() })
        .await?
        .into_inner();
    let expect = |r: std::result::Result<tonic::Response<SearchResponse>, tonic::Status>,
                  code: Code,
                  field: &str| {
        let s = r
            .err()
            .unwrap_or_else(|| panic!("expected {code:?} naming {field}"));
        assert_eq!(s.code(), code, "{}", s.message());
        assert!(
            s.message().contains(field),
            "message {:?} should name {field}",
            s.message()
        );
    };
    let base = search("e2e", "raft", SearchMode::Hybrid);
    expect(
        c.search(SearchRequest {
            query: "   ".into(),
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "query",
    );
    expect(
        c.search(SearchRequest {
            top_k: 0,
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "top_k",
    );
    expect(
        c.search(SearchRequest {
            top_k: 1001,
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "top_k",
    );
    expect(
        c.search(SearchRequest {
            collection: "nope".into(),
            ..base.clone()
        })
        .await,
        Code::NotFound,
        "nope",
    );
    expect(
        c.search(SearchRequest {
            fusion: "borda".into(),
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "fusion",
    );
    expect(
        c.search(SearchRequest {
            dense_weight: Some(1.5),
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "dense_weight",
    );
    expect(
        c.search(SearchRequest {
            query_vector: vec![0.1; 17],
            ..base.clone()
        })
        .await,
        Code::InvalidArgument,
        "query_vector",
    );

    let doc = |id: &str, text: String| Document {
        id: id.into(),
        text,
        ..Default::default()
    };
    let up = |docs: Vec<Document>| UpsertDocumentsRequest {
        collection: "e2e".into(),
        documents: docs,
        ..Default::default()
    };
    let code_of = |r: std::result::Result<
        tonic::Response<UpsertDocumentsResponse>,
        tonic::Status,
    >| r.err().map(|s| (s.code(), s.message().to_owned()));
    let (code, msg) = code_of(
        c.upsert_documents(up(vec![doc("big", "x".repeat((1 << 20) + 1))]))
            .await,
    )
    .unwrap();
    assert_eq!(code, Code::ResourceExhausted);
    assert!(msg.contains("documents[0].text"), "{msg}");
    let many: Vec<Document> = (0..257)
        .map(|i| doc(&format!("m{i}"), "text".into()))
        .collect();
    assert_eq!(
        code_of(c.upsert_documents(up(many)).await).unwrap().0,
        Code::ResourceExhausted
    );
    let (code, msg) = code_of(
        c.upsert_documents(up(vec![doc("dup", "a".into()), doc("dup", "b".into())]))
            .await,
    )
    .unwrap();
    assert_eq!(code, Code::InvalidArgument);
    assert!(msg.contains("documents[1].id"), "{msg}");
    let (code, msg) = code_of(c.upsert_documents(up(vec![doc("", "a".into())])).await).unwrap();
    assert_eq!(code, Code::InvalidArgument);
    assert!(msg.contains("documents[0].id"), "{msg}");
    let r = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "missing".into(),
            documents: vec![doc("a", "b".into())],
            ..Default::default()
        })
        .await;
    assert_eq!(r.unwrap_err().code(), Code::NotFound);
    let bad_creates = [
        (
            CreateCollectionRequest {
                name: "Bad Name".into(),
                ..Default::default()
            },
            Code::InvalidArgument,
        ),
        (
            CreateCollectionRequest {
                name: "e2e".into(),
                ..Default::default()
            },
            Code::AlreadyExists,
        ),
        (
            CreateCollectionRequest {
                name: "hnswbad".into(),
                hnsw: Some(HnswParams {
                    m: 300,
                    ef_construction: 0,
                    ef_search: 0,
                }),
                ..Default::default()
            },
            Code::InvalidArgument,
        ),
    ];
    for (req, code) in bad_creates {
        let name = req.name.clone();
        assert_eq!(
            c.create_collection(req).await.unwrap_err().code(),
            code,
            "create {name}"
        );
    }
    // No state changed.
    let after = c
        .describe_collection(DescribeCollectionRequest { name: "e2e".into() })
        .await?
        .into_inner();
    let docs = |d: &DescribeCollectionResponse| {
        d.shards
            .iter()
            .map(|s| (s.documents, s.chunks, s.applied_seq))
            .collect::<Vec<_>>()
    };
    assert_eq!(docs(&before), docs(&after));
    let list = c
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner();
    assert_eq!(list.collections.len(), 1);
    Ok(())
}

/// One writer upserts documents one by one while the test SIGKILLs a shard node and restarts
/// it. Every write the coordinator acknowledged must be searchable afterwards, by BM25 and by
/// vector; failed writes may or may not be there.
async fn kill_during_writes(cluster: &mut Cluster) -> Result<()> {
    let c = cluster.client().await?;
    let acked = Arc::new(Mutex::new(Vec::<usize>::new()));
    let failed = Arc::new(Mutex::new(0usize));
    const N: usize = 90;
    let writer = {
        let (acked, failed, mut c) = (acked.clone(), failed.clone(), c.clone());
        tokio::spawn(async move {
            for i in 0..N {
                let d = Document {
                    fields: Default::default(),
                    id: format!("w-{i}"),
                    title: format!("write {i}"),
                    text: format!(
                        "Stream document number {i} carries the unique marker zq{i}x for the crash test."
                    ),
                    metadata: HashMap::from([("doc".into(), format!("w-{i}"))]),
                    embedding: vec![],
                };
                match c
                    .upsert_documents(UpsertDocumentsRequest {
                        collection: "e2e".into(),
                        documents: vec![d],
                        ..Default::default()
                    })
                    .await
                {
                    Ok(_) => acked.lock().await.push(i),
                    Err(s) => {
                        assert!(
                            matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded),
                            "unexpected {s:?}"
                        );
                        *failed.lock().await += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
        })
    };
    while acked.lock().await.len() < 20 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::task::block_in_place(|| -> Result<()> {
        cluster.shards[1].kill9();
        std::thread::sleep(Duration::from_millis(300));
        cluster.shards[1].restart(Duration::from_secs(120))
    })?;
    writer.await?;
    let acked = acked.lock().await.clone();
    let failed = *failed.lock().await;
    eprintln!(
        "crash test: {} acknowledged, {failed} failed while the node was down",
        acked.len()
    );
    ensure!(acked.len() >= 20, "too few acknowledged writes");
    let mut c = c;
    for i in acked {
        let r = c
            .search(SearchRequest {
                top_k: 1,
                ..search("e2e", &format!("zq{i}x"), SearchMode::Bm25)
            })
            .await?
            .into_inner();
        ensure!(
            top_doc(&r) == format!("w-{i}"),
            "acknowledged w-{i} missing from bm25"
        );
        let mut q = search(
            "e2e",
            &format!("Stream document number {i}"),
            SearchMode::Dense,
        );
        q.filter = HashMap::from([("doc".into(), format!("w-{i}"))]);
        let r = c.search(q).await?.into_inner();
        ensure!(
            r.hits.len() == 1 && top_doc(&r) == format!("w-{i}"),
            "acknowledged w-{i} missing from hnsw"
        );
    }
    Ok(())
}

/// Dropping a collection gives its disk back (issue 20): the shard node's RocksDB shrinks to
/// about what the remaining collection needs, and that one is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_collection_gives_its_disk_back() -> Result<()> {
    let cluster = Cluster::start(1)?;
    let mut c = cluster.client().await?;
    let rocksdb = cluster.dir.path().join("shard-0/data/rocksdb");
    let size = || ragcluster_common::membership::dir_bytes(&rocksdb);
    for (name, docs) in [("keep", 50usize), ("big", 4000)] {
        let info = c
            .create_collection(CreateCollectionRequest {
                name: name.into(),
                shard_count: 1,
                ..Default::default()
            })
            .await?
            .into_inner()
            .collection
            .unwrap_or_default();
        ragcluster_tests::upsert_with_vectors(
            &mut c,
            name,
            name,
            "a collection that takes disk space",
            info.dimension as usize,
            docs,
        )
        .await?;
    }
    let before = size();
    c.drop_collection(DropCollectionRequest { name: "big".into() })
        .await?;
    let started = std::time::Instant::now();
    let mut after = size();
    while after * 3 > before && started.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        after = size();
    }
    eprintln!(
        "figures: shard node RocksDB {:.1} MB with 4,050 documents, {:.1} MB {:.1} s after \
         dropping the 4,000-document collection",
        before as f64 / 1e6,
        after as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    ensure!(
        after * 3 <= before,
        "RocksDB still holds {after} of {before} bytes after the drop"
    );
    let r = c
        .search(search(
            "keep",
            "collection that takes disk space",
            SearchMode::Bm25,
        ))
        .await?
        .into_inner();
    ensure!(r.hits.len() == 5, "the kept collection lost documents");
    Ok(())
}
