//! Re-embedding a live collection (issue 69) on real processes: a MiniLM collection behind an
//! alias moves to nomic-embed-text-v1.5 while a writer upserts, patches and deletes and two
//! searchers search through the alias. No call fails; after the copy, a switch (writes then
//! go on through the alias to the new collection, mirrored back), a rollback and a second
//! switch, both collections hold exactly the documents the writer's acknowledged calls left
//! (text and metadata), the new one with 768-d vectors of the new model; `finish` drops the
//! old one. Bad steps, and writes by name to the side that does not serve, are refused and
//! change nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use ragcluster_common::skip::{SkipReason, skipped};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::cluster::Options;
use ragcluster_tests::{Cluster, models_dir, ragctl_at, refused};
use tonic::Code;
use tonic::transport::Channel;

const SRC: &str = "kb";
const ALIAS: &str = "live";
const NOMIC: &str = "nomic-embed-text-v1.5.f16";
const IDS: usize = 40;

const TOPICS: [&str; 4] = [
    "Raft elects a leader after an election timeout",
    "HNSW graphs find nearest neighbours in few hops",
    "BM25 weighs rare terms above common ones",
    "RocksDB writes go to a memtable and a write-ahead log",
];

fn doc(i: usize, round: usize) -> Document {
    Document {
        id: format!("d{i:03}"),
        title: format!("Note {i}"),
        text: format!("{}. Note {i}, revision {round}.", TOPICS[i % TOPICS.len()]),
        metadata: [("round".to_owned(), round.to_string())].into(),
        ..Default::default()
    }
}

async fn upsert(c: &mut CoordinatorClient<Channel>, docs: Vec<Document>) -> Result<()> {
    c.upsert_documents(UpsertDocumentsRequest {
        collection: ALIAS.into(),
        documents: docs,
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Runs one step to its end; the last progress message.
async fn step(
    a: &mut AdminClient<Channel>,
    action: ReembedAction,
    model: &str,
) -> std::result::Result<ReembedProgress, tonic::Status> {
    let mut s = a
        .reembed(ReembedRequest {
            collection: ALIAS.into(),
            action: action as i32,
            embedding_model: model.into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut last = None;
    while let Some(p) = s.message().await? {
        last = Some(p);
    }
    last.ok_or_else(|| tonic::Status::internal("no progress"))
}

/// What the writer's acknowledged calls left: id -> (text, round) or None once deleted.
type Expected = BTreeMap<String, Option<(String, String)>>;
/// What a collection holds: id -> (text, metadata) or None.
type Held = BTreeMap<String, Option<(String, BTreeMap<String, String>)>>;

/// One writer (sequential, so the last acknowledged call per id is the state) and two
/// searchers, all through the alias, until `stop`; failures counted.
fn load(
    cluster: &Cluster,
    stop: Arc<AtomicBool>,
    failures: Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<Result<Expected>>> {
    let mut tasks = Vec::new();
    let addr = cluster.coordinator.grpc.clone();
    {
        let (stop, failures, addr) = (stop.clone(), failures.clone(), addr.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = ragcluster_tests::coordinator_client(&addr).await?;
            let mut expected = Expected::new();
            let mut k = 0usize;
            while !stop.load(Ordering::Relaxed) {
                k += 1;
                let i = k * 7 % IDS;
                let id = format!("d{i:03}");
                let ok = if k.is_multiple_of(5) {
                    let r = c
                        .delete_documents(DeleteDocumentsRequest {
                            collection: ALIAS.into(),
                            ids: vec![id.clone()],
                            ..Default::default()
                        })
                        .await;
                    r.map(|_| expected.insert(id, None)).is_ok()
                } else {
                    let d = doc(i, k);
                    let want = (d.text.clone(), k.to_string());
                    upsert(&mut c, vec![d])
                        .await
                        .map(|_| expected.insert(id, Some(want)))
                        .is_ok()
                };
                if !ok {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                if std::env::var_os("REEMBED_TRACE").is_some() {
                    eprintln!(
                        "{:?} write k={k} id=d{i:03} ok={ok}",
                        std::time::SystemTime::now()
                    );
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            Ok(expected)
        }));
    }
    for _ in 0..2 {
        let (stop, failures, addr) = (stop.clone(), failures.clone(), addr.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = ragcluster_tests::coordinator_client(&addr).await?;
            while !stop.load(Ordering::Relaxed) {
                let r = c
                    .search(SearchRequest {
                        collection: ALIAS.into(),
                        query: "how is a leader elected".into(),
                        top_k: 5,
                        mode: SearchMode::Hybrid as i32,
                        ..Default::default()
                    })
                    .await;
                if r.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(Expected::new())
        }));
    }
    tasks
}

/// Every id's document in `collection` as (text, metadata), None where absent.
async fn holdings(
    c: &mut CoordinatorClient<Channel>,
    collection: &str,
    dimension: usize,
) -> Result<Held> {
    let ids: Vec<String> = (0..IDS).map(|i| format!("d{i:03}")).collect();
    let r = c
        .get_documents(GetDocumentsRequest {
            collection: collection.into(),
            ids: ids.clone(),
            with_embedding: true,
            consistency: Consistency::Strong as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut out: Held = ids.into_iter().map(|id| (id, None)).collect();
    for d in r.documents {
        for ch in &d.chunks {
            ensure!(
                ch.embedding.len() == dimension,
                "{collection}: {} has a {}-d vector, want {dimension}",
                ch.chunk_id,
                ch.embedding.len()
            );
        }
        let text = d.chunks.iter().map(|c| c.text.as_str()).collect::<String>();
        out.insert(d.id, Some((text, d.metadata.into_iter().collect())));
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_live_collection_moves_to_another_model_and_back() -> Result<()> {
    let gguf = models_dir().join(format!("{NOMIC}.gguf"));
    if !gguf.exists() {
        let why = format!("{} missing: scripts/fetch-models.sh nomic", gguf.display());
        skipped(SkipReason::NotSetUp, "reembed", &why);
        return Ok(());
    }
    let path = gguf.display().to_string();
    let cluster = Cluster::start_opts(Options {
        shard_nodes: 2,
        model_worker_args: &["--embed-model", &path],
        ..Default::default()
    })?;
    let mut c = cluster.client().await?;
    let mut a = cluster.admin().await?;
    c.create_collection(CreateCollectionRequest {
        name: SRC.into(),
        shard_count: 2,
        ..Default::default()
    })
    .await?;
    c.update_aliases(UpdateAliasesRequest {
        actions: vec![AliasAction {
            action: Some(alias_action::Action::Put(Alias {
                alias: ALIAS.into(),
                collection: SRC.into(),
            })),
        }],
    })
    .await?;
    upsert(&mut c, (0..30).map(|i| doc(i, 0)).collect()).await?;

    // Refused, changing nothing: an unknown model; a step without a job.
    let before = c.list_collections(ListCollectionsRequest {}).await?;
    refused(
        "unknown model",
        step(&mut a, ReembedAction::Start, "no-such-model").await,
        Code::InvalidArgument,
        "not served",
    )?;
    refused(
        "switch without a job",
        step(&mut a, ReembedAction::Switch, "").await,
        Code::FailedPrecondition,
        "not being re-embedded",
    )?;
    let after = c.list_collections(ListCollectionsRequest {}).await?;
    ensure!(
        before.get_ref() == after.get_ref(),
        "a refused step created something"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicU64::new(0));
    let tasks = load(&cluster, stop.clone(), failures.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;

    let p = step(&mut a, ReembedAction::Start, NOMIC).await?;
    let target = p.target.clone();
    eprintln!("start: {p:?}");
    ensure!(p.done && p.documents_copied >= 20, "{p:?}");
    ensure!(p.job.as_ref().is_some_and(|j| j.epoch == 1), "{p:?}");
    // Only the serving side takes writes: the next copy would undo one to the other.
    refused(
        "a write to the target before the switch",
        c.upsert_documents(UpsertDocumentsRequest {
            collection: target.clone(),
            documents: vec![doc(0, 999)],
            ..Default::default()
        })
        .await,
        Code::FailedPrecondition,
        "does not serve",
    )?;
    // A patch by filter while both are written: mirrored as the documents it changed.
    c.update_documents(UpdateDocumentsRequest {
        collection: ALIAS.into(),
        conditions: Some(Filter::default()),
        patch: Some(MetadataPatch {
            set_metadata: [("tier".to_owned(), "gold".to_owned())].into(),
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .ok();
    refused(
        "drop during a re-embedding",
        c.drop_collection(DropCollectionRequest { name: SRC.into() })
            .await,
        Code::FailedPrecondition,
        "takes part in the re-embedding",
    )?;
    refused(
        "finish before the switch",
        step(&mut a, ReembedAction::Finish, "").await,
        Code::FailedPrecondition,
        "was not switched",
    )?;
    tokio::time::sleep(Duration::from_millis(800)).await;

    let p = step(&mut a, ReembedAction::Switch, "").await?;
    eprintln!("switch: {p:?}");
    let d = c
        .describe_collection(DescribeCollectionRequest { name: ALIAS.into() })
        .await?
        .into_inner()
        .collection
        .context("described")?;
    ensure!(
        d.name == target && d.embedding_model == NOMIC && d.dimension == 768,
        "the alias names {} ({})",
        d.name,
        d.embedding_model
    );
    // Writes now go to the target and are mirrored back; a rollback and a second switch,
    // each with writes through the alias around it (versions: epochs 2, 3 and 4).
    tokio::time::sleep(Duration::from_millis(800)).await;
    refused(
        "a write to the source after the switch",
        c.delete_documents(DeleteDocumentsRequest {
            collection: SRC.into(),
            ids: vec!["d001".into()],
            ..Default::default()
        })
        .await,
        Code::FailedPrecondition,
        "does not serve",
    )?;
    let p = step(&mut a, ReembedAction::Rollback, "").await?;
    eprintln!("rollback: {p:?}");
    ensure!(
        p.job.as_ref().is_some_and(|j| j.epoch == 3 && !j.switched),
        "{p:?}"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    let p = step(&mut a, ReembedAction::Switch, "").await?;
    eprintln!("switch again: {p:?}");
    ensure!(
        p.job.as_ref().is_some_and(|j| j.epoch == 4 && j.switched),
        "{p:?}"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    stop.store(true, Ordering::Relaxed);
    let mut expected = Expected::new();
    for t in tasks {
        expected.extend(t.await??);
    }
    ensure!(
        failures.load(Ordering::Relaxed) == 0,
        "{} calls failed during the re-embedding",
        failures.load(Ordering::Relaxed)
    );

    // Both hold what the acknowledged writes left: the same text and metadata.
    let old = holdings(&mut c, SRC, 384).await?;
    let new = holdings(&mut c, &target, 768).await?;
    ensure!(old == new, "source and target differ:\n{old:?}\n{new:?}");
    for (id, want) in &expected {
        let have = new.get(id).cloned().flatten();
        match (want, &have) {
            (None, None) => {}
            (Some((text, round)), Some((t, md))) if t == text && md.get("round") == Some(round) => {
            }
            _ => anyhow::bail!("{id}: acknowledged {want:?}, the target holds {have:?}"),
        }
    }
    eprintln!(
        "{} ids written during the re-embedding, all as acknowledged",
        expected.len()
    );
    // The new model answers through the alias.
    let hits = c
        .search(SearchRequest {
            collection: ALIAS.into(),
            query: "nearest neighbours in a graph".into(),
            top_k: 3,
            mode: SearchMode::Dense as i32,
            ..Default::default()
        })
        .await?
        .into_inner()
        .hits;
    ensure!(
        hits.first().is_some_and(|h| h.text.contains("HNSW")),
        "{hits:?}"
    );

    let out = ragctl_at(
        &cluster.coordinator.grpc,
        &["collection", "reembed", "status", ALIAS],
    )?;
    ensure!(out.contains("switched to"), "{out}");
    step(&mut a, ReembedAction::Finish, "").await?;
    let names: Vec<String> = c
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner()
        .collections
        .into_iter()
        .map(|c| c.name)
        .collect();
    ensure!(names == vec![target.clone()], "{names:?}");
    refused(
        "status after finish",
        step(&mut a, ReembedAction::Status, "").await,
        Code::FailedPrecondition,
        "not being re-embedded",
    )?;
    Ok(())
}
