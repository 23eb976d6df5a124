//! Backup and restore on real processes (issue 69): `ragctl backup create` while two writers
//! keep upserting; every write acknowledged before the backup began is in what a restore
//! brings back, into a cluster with another number of shard nodes; a restored collection
//! answers BM25 and dense searches as its source does (the same scores; ties at the cut
//! aside, the same hits), vectors unchanged; a damaged file is
//! refused before anything is created; malformed RestoreDocuments calls change nothing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use parking_lot::Mutex;
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{
    Cluster, missing_documents, ragctl_at, refused, same_ranking, upsert_with_vectors,
};
use tonic::Code;
use tonic::transport::Channel;

const DIM: usize = 384;
const C: &str = "bk";
const BASE: usize = 600;

fn vector(seed: usize) -> Vec<f32> {
    let v: Vec<f32> = (0..DIM)
        .map(|j| (((seed * 131 + j * 17) % 101) as f32 / 101.0) - 0.5)
        .collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.into_iter().map(|x| x / n).collect()
}

/// Upserts one document at a time until `stop`, recording each acknowledged id and when.
async fn writer(
    mut c: CoordinatorClient<Channel>,
    who: usize,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<(String, Instant)>>>,
) -> Result<()> {
    let mut k = 0;
    while !stop.load(Ordering::Relaxed) {
        let id = format!("w{who}-{k}");
        let doc = Document {
            id: id.clone(),
            text: format!("write {k} of writer {who} during the backup"),
            fields: [(
                "year".to_owned(),
                Value {
                    kind: Some(value::Kind::Integer(2000 + k as i64 % 20)),
                },
            )]
            .into(),
            embedding: vector(10_000 + who * 100_000 + k),
            ..Default::default()
        };
        c.upsert_documents(UpsertDocumentsRequest {
            collection: C.into(),
            documents: vec![doc],
            ..Default::default()
        })
        .await?;
        acked.lock().push((id, Instant::now()));
        k += 1;
    }
    Ok(())
}

async fn ragctl(addr: &str, args: &[&str]) -> Result<String> {
    let addr = addr.to_owned();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ragctl_at(&addr, &args)
    })
    .await?
}

async fn top10(
    c: &mut CoordinatorClient<Channel>,
    mode: SearchMode,
    q: usize,
    exact: bool,
) -> Result<Vec<(String, f32)>> {
    let r = c
        .search(SearchRequest {
            collection: C.into(),
            query: format!("document {q} {} of base", q * 7 % BASE),
            top_k: 10,
            mode: mode as i32,
            query_vector: vector(q * 3 + 1),
            consistency: Consistency::Strong as i32,
            exact,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(r.hits.into_iter().map(|h| (h.chunk_id, h.score)).collect())
}

fn manifest_documents(dir: &std::path::Path) -> Result<u64> {
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json"))?)?;
    let shards = m["collections"][0]["shards"]
        .as_array()
        .context("no shards in the manifest")?;
    Ok(shards.iter().filter_map(|s| s["documents"].as_u64()).sum())
}

async fn drop_restored(d: &mut CoordinatorClient<Channel>) -> Result<()> {
    d.update_aliases(UpdateAliasesRequest {
        actions: vec![AliasAction {
            action: Some(alias_action::Action::Delete("live".into())),
        }],
    })
    .await?;
    d.drop_collection(DropCollectionRequest { name: C.into() })
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backups_restore_every_acknowledged_write() -> Result<()> {
    let src = Cluster::start(3)?;
    let mut c = src.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: C.into(),
        shard_count: 3,
        replication_factor: 2,
        ..Default::default()
    })
    .await?;
    upsert_with_vectors(
        &mut c,
        C,
        "base",
        "raft replication and snapshots",
        DIM,
        BASE,
    )
    .await?;
    c.update_aliases(UpdateAliasesRequest {
        actions: vec![AliasAction {
            action: Some(alias_action::Action::Put(Alias {
                alias: "live".into(),
                collection: C.into(),
            })),
        }],
    })
    .await?;
    let addr = src.coordinator.grpc.clone();
    let dir = tempfile::tempdir()?;
    let (b1, b2, b3) = (
        dir.path().join("b1"),
        dir.path().join("b2"),
        dir.path().join("b3"),
    );

    // A backup while two writers go on.
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let mut writers = Vec::new();
    for who in 0..2 {
        let w = writer(src.client().await?, who, stop.clone(), acked.clone());
        writers.push(tokio::spawn(w));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let began = Instant::now();
    ragctl(
        &addr,
        &["backup", "create", "--to", b1.to_str().unwrap_or_default()],
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await??;
    }
    let acked = acked.lock().clone();
    let before: Vec<String> = acked
        .iter()
        .filter(|(_, t)| *t < began)
        .map(|(id, _)| id.clone())
        .collect();
    ensure!(
        !before.is_empty() && before.len() < acked.len(),
        "writes before ({}) and during ({}) the backup",
        before.len(),
        acked.len() - before.len()
    );

    // Restored into one shard node: every write acknowledged before the backup is there.
    let dst = Cluster::start(1)?;
    let to = dst.coordinator.grpc.clone();
    ragctl(
        &to,
        &[
            "backup",
            "restore",
            "--from",
            b1.to_str().unwrap_or_default(),
        ],
    )
    .await?;
    let mut d = dst.client().await?;
    let lost = missing_documents(&mut d, "live", &before).await?;
    ensure!(
        lost.is_empty(),
        "acknowledged before the backup, not restored: {lost:?}"
    );
    let count = d
        .count(CountRequest {
            collection: "live".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .documents;
    ensure!(
        count == manifest_documents(&b1)?,
        "restored {count} documents"
    );
    ensure!(count >= (BASE + before.len()) as u64);
    drop_restored(&mut d).await?;

    // A damaged file is refused before anything is created.
    ragctl(
        &addr,
        &["backup", "create", "--to", b2.to_str().unwrap_or_default()],
    )
    .await?;
    copy_dir(&b2, &b3)?;
    let shard_file = b3.join(C).join("shard-0001.pb");
    let mut bytes = std::fs::read(&shard_file)?;
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&shard_file, bytes)?;
    let damaged = ragctl(
        &to,
        &[
            "backup",
            "restore",
            "--from",
            b3.to_str().unwrap_or_default(),
        ],
    )
    .await;
    let msg = format!(
        "{:#}",
        damaged.err().context("a damaged backup was restored")?
    );
    ensure!(msg.contains("shard-0001.pb is damaged"), "{msg}");
    let left = d
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner();
    ensure!(
        left.collections.is_empty(),
        "a refused restore created {left:?}"
    );

    // A quiet backup restores a collection that answers as its source does.
    ragctl(
        &to,
        &[
            "backup",
            "restore",
            "--from",
            b2.to_str().unwrap_or_default(),
        ],
    )
    .await?;
    let (mut same_bm25, mut overlap, mut same_exact) = (0, 0, 0);
    for q in 0..30 {
        let (a, b) = (
            top10(&mut c, SearchMode::Bm25, q, false).await?,
            top10(&mut d, SearchMode::Bm25, q, false).await?,
        );
        if !same_ranking(&a, &b) {
            eprintln!("BM25 q{q}: source {a:?}\nrestored {b:?}");
        }
        same_bm25 += usize::from(same_ranking(&a, &b));
        let (a, b) = (
            top10(&mut c, SearchMode::Dense, q, false).await?,
            top10(&mut d, SearchMode::Dense, q, false).await?,
        );
        overlap += a.iter().filter(|h| b.iter().any(|x| x.0 == h.0)).count();
        // Exact searches: the same list, equal scores ordered by chunk id on both sides.
        let (a, b) = (
            top10(&mut c, SearchMode::Dense, q, true).await?,
            top10(&mut d, SearchMode::Dense, q, true).await?,
        );
        let ids = |h: &[(String, f32)]| h.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
        if ids(&a) != ids(&b) {
            eprintln!("exact dense q{q}: source {a:?}\nrestored {b:?}");
        }
        same_exact += usize::from(ids(&a) == ids(&b) && a.len() == 10);
    }
    eprintln!(
        "restored searches: BM25 top 10 identical {same_bm25}/30, dense overlap {overlap}/300, \
         exact dense identical {same_exact}/30"
    );
    ensure!(
        same_exact == 30,
        "exact dense top 10 identical for {same_exact} of 30 queries"
    );
    ensure!(
        same_bm25 == 30,
        "BM25 top 10 identical for {same_bm25} of 30 queries"
    );
    ensure!(overlap >= 295, "dense top 10 overlap {overlap} of 300");
    let ids = vec!["base-7".to_owned(), "w1-3".to_owned()];
    let get = |ids: Vec<String>| GetDocumentsRequest {
        collection: C.into(),
        ids,
        with_embedding: true,
        ..Default::default()
    };
    let (a, b) = (
        c.get_documents(get(ids.clone())).await?.into_inner(),
        d.get_documents(get(ids)).await?.into_inner(),
    );
    ensure!(
        a.documents == b.documents && a.documents.len() == 2,
        "restored documents differ"
    );

    // Malformed restores change nothing.
    let mut admin = AdminClient::new(Channel::from_shared(to.clone())?.connect().await?);
    let good = a.documents[0].chunks.clone();
    let write = |chunks: Vec<Chunk>| DocumentWrite {
        doc_id: "base-7".into(),
        chunks,
        delete: false,
    };
    let mut short = good.clone();
    short[0].embedding.truncate(10);
    let mut moved = good.clone();
    moved[0].position = 3;
    let bad: Vec<(&str, Vec<DocumentWrite>, &str)> = vec![
        ("empty", vec![], "documents"),
        (
            "dimension",
            vec![write(short)],
            "documents[0].chunks[0].embedding",
        ),
        (
            "position",
            vec![write(moved)],
            "documents[0].chunks[0].chunk_id",
        ),
        (
            "twice",
            vec![write(good.clone()), write(good.clone())],
            "documents[1].doc_id",
        ),
    ];
    for (what, documents, path) in bad {
        let r = admin
            .restore_documents(RestoreDocumentsRequest {
                collection: C.into(),
                documents,
            })
            .await;
        refused(what, r, Code::InvalidArgument, path)?;
    }
    let r = admin
        .backup_shard(BackupShardRequest {
            collection: C.into(),
            shard: 9,
        })
        .await;
    refused("shard 9", r.map(|_| ()), Code::InvalidArgument, "shard")?;
    let after = d
        .get_documents(get(vec!["base-7".into()]))
        .await?
        .into_inner();
    ensure!(
        after.documents[0] == a.documents[0],
        "a refused restore changed base-7"
    );
    Ok(())
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()))?;
        } else {
            std::fs::copy(e.path(), to.join(e.file_name()))?;
        }
    }
    Ok(())
}
