//! Aliases on real processes (issue 69): every data call accepts an alias for its collection;
//! a switch is atomic and fails no call while four clients search, count and read through
//! the alias; a scroll begun before a switch ends on the collection it began on; an
//! UpdateAliases call applies all of its actions or none; a dropped collection takes its
//! aliases with it; malformed or conflicting changes are refused, naming what is wrong.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use anyhow::{Result, bail, ensure};
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, refused};
use tonic::Code;
use tonic::transport::Channel;

fn put(alias: &str, collection: &str) -> AliasAction {
    AliasAction {
        action: Some(alias_action::Action::Put(Alias {
            alias: alias.into(),
            collection: collection.into(),
        })),
    }
}

fn delete(alias: &str) -> AliasAction {
    AliasAction {
        action: Some(alias_action::Action::Delete(alias.into())),
    }
}

async fn update(
    c: &mut CoordinatorClient<Channel>,
    actions: Vec<AliasAction>,
) -> std::result::Result<Vec<(String, String)>, tonic::Status> {
    let r = c
        .update_aliases(UpdateAliasesRequest { actions })
        .await?
        .into_inner();
    Ok(pairs(&r.aliases))
}

fn pairs(aliases: &[Alias]) -> Vec<(String, String)> {
    aliases
        .iter()
        .map(|a| (a.alias.clone(), a.collection.clone()))
        .collect()
}

async fn listed(c: &mut CoordinatorClient<Channel>) -> Result<Vec<(String, String)>> {
    let r = c
        .list_aliases(ListAliasesRequest::default())
        .await?
        .into_inner();
    Ok(pairs(&r.aliases))
}

/// `n` documents whose ids and text name `tag`, in collection `tag`.
async fn fill(c: &mut CoordinatorClient<Channel>, tag: &str, n: usize) -> Result<()> {
    c.create_collection(CreateCollectionRequest {
        name: tag.into(),
        shard_count: 2,
        ..Default::default()
    })
    .await?;
    let documents = (0..n)
        .map(|i| Document {
            id: format!("{tag}-{i:02}"),
            title: format!("{tag} note {i}"),
            text: format!("Raft replication note {i} of the {tag} collection: leaders and logs."),
            ..Default::default()
        })
        .collect();
    c.upsert_documents(UpsertDocumentsRequest {
        collection: tag.into(),
        documents,
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// Which collection a search through `live` answered from (by its hits' ids).
async fn search_live(c: &mut CoordinatorClient<Channel>) -> Result<&'static str> {
    let r = c
        .search(SearchRequest {
            collection: "live".into(),
            query: "raft leaders".into(),
            top_k: 5,
            ..Default::default()
        })
        .await?
        .into_inner();
    let from_v1 = r.hits.iter().all(|h| h.doc_id.starts_with("v1-"));
    let from_v2 = r.hits.iter().all(|h| h.doc_id.starts_with("v2-"));
    match (r.hits.is_empty(), from_v1, from_v2) {
        (false, true, false) => Ok("v1"),
        (false, false, true) => Ok("v2"),
        _ => bail!(
            "hits {:?}",
            r.hits.iter().map(|h| &h.doc_id).collect::<Vec<_>>()
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliases_switch_atomically_under_load() -> Result<()> {
    let cluster = Cluster::start(2)?;
    let mut c = cluster.client().await?;
    fill(&mut c, "v1", 12).await?;
    fill(&mut c, "v2", 20).await?;

    let now = update(&mut c, vec![put("live", "v1")]).await?;
    ensure!(now == [("live".into(), "v1".into())], "{now:?}");
    ensure!(search_live(&mut c).await? == "v1");
    let n = c
        .count(CountRequest {
            collection: "live".into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(n.documents == 12, "count through the alias: {n:?}");
    let d = c
        .describe_collection(DescribeCollectionRequest {
            name: "live".into(),
        })
        .await?
        .into_inner();
    ensure!(d.collection.is_some_and(|i| i.name == "v1"));

    // A write through the alias lands in its collection, and its token pins a read through
    // the alias.
    let w = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "live".into(),
            documents: vec![Document {
                id: "v1-new".into(),
                text: "Written through the alias.".into(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await?
        .into_inner();
    let got = c
        .get_documents(GetDocumentsRequest {
            collection: "v1".into(),
            ids: vec!["v1-new".into()],
            read_token: w.read_token.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        got.documents.len() == 1,
        "the write through the alias is not in v1"
    );

    // A scroll begun on v1 through the alias.
    let first = c
        .scroll(ScrollRequest {
            collection: "live".into(),
            limit: 5,
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(!first.next_cursor.is_empty());

    // Four clients read through the alias while it is switched back and forth.
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicUsize::new(0));
    let mut readers = Vec::new();
    for k in 0..4 {
        let mut rc = cluster.client().await?;
        let (stop, calls) = (stop.clone(), calls.clone());
        readers.push(tokio::spawn(async move {
            let mut seen = [0usize; 2];
            while !stop.load(Ordering::Relaxed) {
                if k % 2 == 0 {
                    let from = search_live(&mut rc).await?;
                    seen[usize::from(from == "v2")] += 1;
                } else {
                    let n = rc
                        .count(CountRequest {
                            collection: "live".into(),
                            ..Default::default()
                        })
                        .await?
                        .into_inner();
                    ensure!(n.documents == 13 || n.documents == 20, "count {n:?}");
                    seen[usize::from(n.documents == 20)] += 1;
                }
                calls.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(seen)
        }));
    }
    for i in 0..10 {
        let to = if i % 2 == 0 { "v2" } else { "v1" };
        let now = update(&mut c, vec![put("live", to)]).await?;
        ensure!(now == [("live".into(), to.into())], "{now:?}");
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut both = [0usize; 2];
    for r in readers {
        let seen = r.await??;
        both[0] += seen[0];
        both[1] += seen[1];
    }
    ensure!(
        both[0] > 0 && both[1] > 0,
        "reads saw only one side: {both:?}"
    );
    println!(
        "{} calls through the alias during 10 switches, none failed (v1 {}, v2 {})",
        calls.load(Ordering::Relaxed),
        both[0],
        both[1]
    );

    // live -> v1 again after 10 switches; point it at v2 and finish the scroll begun on v1.
    update(&mut c, vec![put("live", "v2")]).await?;
    let mut cursor = first.next_cursor;
    let mut rest = Vec::new();
    while !cursor.is_empty() {
        let page = c
            .scroll(ScrollRequest {
                collection: "live".into(),
                limit: 5,
                cursor,
                ..Default::default()
            })
            .await?
            .into_inner();
        rest.extend(page.chunks);
        cursor = page.next_cursor;
    }
    ensure!(
        !rest.is_empty() && rest.iter().all(|ch| ch.doc_id.starts_with("v1-")),
        "the scroll did not end on v1: {:?}",
        rest.iter().map(|ch| &ch.doc_id).collect::<Vec<_>>()
    );

    // All or none: the second action fails, so the first is not applied either.
    let before = listed(&mut c).await?;
    refused(
        "an action naming a missing collection",
        update(&mut c, vec![put("other", "v1"), put("live", "nope")]).await,
        Code::NotFound,
        "nope",
    )?;
    refused(
        "an alias that is a collection's name",
        update(&mut c, vec![put("v1", "v2")]).await,
        Code::InvalidArgument,
        "actions[0].put.alias",
    )?;
    refused(
        "deleting an unknown alias",
        update(&mut c, vec![delete("ghost")]).await,
        Code::NotFound,
        "ghost",
    )?;
    refused(
        "a malformed name",
        update(&mut c, vec![put("Live!", "v1")]).await,
        Code::InvalidArgument,
        "actions[0].put.alias",
    )?;
    refused(
        "no actions",
        update(&mut c, Vec::new()).await,
        Code::InvalidArgument,
        "actions",
    )?;
    refused(
        "an action naming nothing",
        update(&mut c, vec![AliasAction { action: None }]).await,
        Code::InvalidArgument,
        "actions[0]",
    )?;
    refused(
        "too many actions",
        update(
            &mut c,
            (0..65).map(|i| put(&format!("a{i}"), "v1")).collect(),
        )
        .await,
        Code::ResourceExhausted,
        "at most 64",
    )?;
    refused(
        "a collection named like an alias",
        c.create_collection(CreateCollectionRequest {
            name: "live".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "alias",
    )?;
    refused(
        "dropping an alias",
        c.drop_collection(DropCollectionRequest {
            name: "live".into(),
        })
        .await,
        Code::FailedPrecondition,
        "alias",
    )?;
    ensure!(
        listed(&mut c).await? == before,
        "a refused change changed the aliases"
    );

    // Several aliases of one collection; dropping it takes them with it.
    update(&mut c, vec![put("stable", "v2"), put("old", "v1")]).await?;
    let of_v2 = c
        .list_aliases(ListAliasesRequest {
            collection: "v2".into(),
        })
        .await?
        .into_inner();
    ensure!(pairs(&of_v2.aliases).len() == 2, "{:?}", of_v2.aliases);
    c.drop_collection(DropCollectionRequest { name: "v2".into() })
        .await?;
    let left = listed(&mut c).await?;
    ensure!(left == [("old".into(), "v1".into())], "{left:?}");
    refused(
        "a search through no alias",
        c.search(SearchRequest {
            collection: "live".into(),
            query: "raft".into(),
            top_k: 3,
            ..Default::default()
        })
        .await,
        Code::NotFound,
        "live",
    )?;
    Ok(())
}
