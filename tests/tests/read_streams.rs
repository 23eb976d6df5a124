//! `Shard.Reads`, the stream the coordinator multiplexes the small reads of queries on, with
//! real processes on loopback: every call answers on the stream as its unary RPC does (errors
//! included, whatever order the replies come in), a cancelled call is dropped on the node, and
//! searches through the coordinator keep answering when the node at the other end of a stream
//! is killed.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use ragcluster_proto::v1::read_call::Call;
use ragcluster_proto::v1::read_reply::Reply;
use ragcluster_proto::v1::*;
use ragcluster_tests::{
    Cluster, Options, http_get, metric_sum, set_failpoint, shard_client, upsert_with_vectors,
};
use tonic::Code;
use tonic::transport::Channel;

fn sref(collection: &str) -> Option<ShardRef> {
    Some(ShardRef {
        collection: collection.into(),
        shard: 0,
    })
}

/// A unary status as the stream reports it.
fn status(s: &tonic::Status) -> CallStatus {
    CallStatus {
        code: s.code() as i32,
        message: s.message().to_owned(),
        details: s.details().to_vec(),
    }
}

/// A one-shard collection `name` with `replicas` replicas (0: the default) and `n` documents
/// about `topic` (with vectors); returns its dimension.
async fn collection(
    c: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<Channel>,
    name: &str,
    replicas: u32,
    topic: &str,
    n: usize,
) -> Result<usize> {
    let info = c
        .create_collection(CreateCollectionRequest {
            name: name.into(),
            shard_count: 1,
            replication_factor: replicas,
            ..Default::default()
        })
        .await?
        .into_inner()
        .collection
        .context("no collection")?;
    let dim = info.dimension as usize;
    upsert_with_vectors(c, name, name, topic, dim, n).await?;
    Ok(dim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_stream_answers_like_unary_calls() -> Result<()> {
    let cluster = Cluster::start(1)?;
    let mut c = cluster.client().await?;
    let dim = collection(&mut c, "rs", 0, "streams of reads", 300).await?;
    let mut sc = shard_client(&cluster.shards[0].grpc).await?;

    let bm25 = Bm25SearchRequest {
        shard: sref("rs"),
        query: "document streams of reads 17".into(),
        top_k: 10,
        ..Default::default()
    };
    let vector = VectorSearchRequest {
        shard: sref("rs"),
        vector: (0..dim).map(|i| ((i % 7) as f32 - 3.0) / 10.0).collect(),
        top_k: 10,
        ef_search: 64,
        ..Default::default()
    };
    let stats = TermStatisticsRequest {
        shard: sref("rs"),
        query: "streams of reads".into(),
        ..Default::default()
    };
    let u_bm25 = sc.bm25_search(bm25.clone()).await?.into_inner();
    ensure!(u_bm25.hits.len() == 10, "{} bm25 hits", u_bm25.hits.len());
    let chunks = GetChunksRequest {
        shard: sref("rs"),
        chunk_ids: u_bm25.hits.iter().map(|h| h.chunk_id.clone()).collect(),
        ..Default::default()
    };
    let u_vector = sc.vector_search(vector.clone()).await?.into_inner();
    let u_stats = sc.term_statistics(stats.clone()).await?.into_inner();
    let u_chunks = sc.get_chunks(chunks.clone()).await?.into_inner();
    let missing = Bm25SearchRequest {
        shard: sref("no-such-collection"),
        ..bm25.clone()
    };
    let u_missing = sc.bm25_search(missing.clone()).await.err().context("ok")?;
    ensure!(u_missing.code() == Code::NotFound, "{u_missing:?}");
    let zero = VectorSearchRequest {
        top_k: 0,
        ..vector.clone()
    };
    let u_zero = sc.vector_search(zero.clone()).await.err().context("ok")?;
    ensure!(u_zero.code() == Code::InvalidArgument, "{u_zero:?}");

    // The same calls on one stream, in two messages, plus a call without a request.
    let calls = |base: u64| {
        vec![
            (base + 1, Call::Bm25(bm25.clone())),
            (base + 2, Call::Vector(vector.clone())),
            (base + 3, Call::TermStats(stats.clone())),
            (base + 4, Call::Chunks(chunks.clone())),
            (base + 5, Call::Bm25(missing.clone())),
            (base + 6, Call::Vector(zero.clone())),
        ]
    };
    let message = |base: u64| ReadCalls {
        calls: calls(base)
            .into_iter()
            .map(|(id, call)| ReadCall {
                id,
                timeout_us: 5_000_000,
                call: Some(call),
                cancel: false,
            })
            .chain((base == 0).then_some(ReadCall {
                id: 99,
                ..Default::default()
            }))
            .collect(),
    };
    let outbound = futures::stream::iter([message(0), message(10)]);
    let mut inbound = sc.reads(outbound).await?.into_inner();
    let mut replies: HashMap<u64, Reply> = HashMap::new();
    while replies.len() < 13 {
        let batch = tokio::time::timeout(Duration::from_secs(10), inbound.message())
            .await
            .context("replies stopped coming")??
            .context("stream ended early")?;
        for r in batch.replies {
            ensure!(
                replies
                    .insert(r.id, r.reply.context("empty reply")?)
                    .is_none(),
                "id {} answered twice",
                r.id
            );
        }
    }
    let search = |r: &ShardSearchResponse| {
        r.hits
            .iter()
            .map(|h| (h.chunk_id.clone(), h.score.to_bits()))
            .collect::<Vec<_>>()
    };
    for base in [0, 10] {
        match &replies[&(base + 1)] {
            Reply::Search(r) => ensure!(search(r) == search(&u_bm25), "bm25 differs"),
            r => anyhow::bail!("bm25 answered {r:?}"),
        }
        match &replies[&(base + 2)] {
            Reply::Search(r) => ensure!(search(r) == search(&u_vector), "vector differs"),
            r => anyhow::bail!("vector answered {r:?}"),
        }
        match &replies[&(base + 3)] {
            Reply::TermStats(r) => ensure!(*r == u_stats, "term statistics differ"),
            r => anyhow::bail!("term statistics answered {r:?}"),
        }
        match &replies[&(base + 4)] {
            Reply::Chunks(r) => ensure!(*r == u_chunks, "chunks differ"),
            r => anyhow::bail!("chunks answered {r:?}"),
        }
        match &replies[&(base + 5)] {
            Reply::Error(e) => ensure!(*e == status(&u_missing), "{e:?} vs {u_missing:?}"),
            r => anyhow::bail!("unknown shard answered {r:?}"),
        }
        match &replies[&(base + 6)] {
            Reply::Error(e) => ensure!(*e == status(&u_zero), "{e:?} vs {u_zero:?}"),
            r => anyhow::bail!("top_k 0 answered {r:?}"),
        }
    }
    match &replies[&99] {
        Reply::Error(e) => ensure!(e.code == Code::InvalidArgument as i32, "{e:?}"),
        r => anyhow::bail!("an empty call answered {r:?}"),
    }
    // Our two messages were all: the node ends the reply stream once they are answered.
    let end = tokio::time::timeout(Duration::from_secs(10), inbound.message()).await??;
    ensure!(end.is_none(), "more replies: {end:?}");

    // Searches through the coordinator go on the stream.
    let before = metric_sum(
        &http_get(&cluster.shards[0].metrics).await?,
        "shard_read_calls_total",
    );
    for mode in [SearchMode::Bm25, SearchMode::Dense, SearchMode::Hybrid] {
        let r = c
            .search(SearchRequest {
                collection: "rs".into(),
                query: "document 17 of rs".into(),
                query_vector: vector.vector.clone(),
                top_k: 5,
                mode: mode as i32,
                ..Default::default()
            })
            .await?
            .into_inner();
        ensure!(r.hits.len() == 5, "{mode:?}: {} hits", r.hits.len());
    }
    let after = metric_sum(
        &http_get(&cluster.shards[0].metrics).await?,
        "shard_read_calls_total",
    );
    // bm25 1 call, dense 1, hybrid 2 searches and a chunk load.
    ensure!(
        after - before >= 5.0,
        "{} calls on the stream",
        after - before
    );
    Ok(())
}

/// Two replicas of one shard; the node at the other end of the coordinator's streams is
/// killed: searches (eventual) keep answering from the other, and again once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn searches_fail_over_when_a_stream_breaks() -> Result<()> {
    let mut cluster = Cluster::start_opts(Options {
        shard_nodes: 2,
        ..Default::default()
    })?;
    let mut c = cluster.client().await?;
    collection(&mut c, "fo", 2, "failover of reads", 200).await?;
    let query = SearchRequest {
        collection: "fo".into(),
        query: "document 5 of fo failover".into(),
        top_k: 5,
        mode: SearchMode::Bm25 as i32,
        consistency: Consistency::Eventual as i32,
        ..Default::default()
    };
    let searches =
        |c: &mut ragcluster_proto::v1::coordinator_client::CoordinatorClient<Channel>| {
            let mut c = c.clone();
            let q = query.clone();
            async move {
                for i in 0..40 {
                    let r = c
                        .search(q.clone())
                        .await
                        .with_context(|| format!("search {i}"))?
                        .into_inner();
                    ensure!(r.hits.len() == 5, "search {i}: {} hits", r.hits.len());
                }
                Ok::<_, anyhow::Error>(())
            }
        };
    // Eventual reads may reach the follower before it applied the writes: wait for both.
    let started = std::time::Instant::now();
    while searches(&mut c).await.is_err() {
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "replicas never caught up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The replica that answered (a stream to it is open) dies.
    let mut calls = Vec::new();
    for s in &cluster.shards {
        calls.push(metric_sum(
            &http_get(&s.metrics).await?,
            "shard_read_calls_total",
        ));
    }
    let victim = if calls[0] >= calls[1] { 0 } else { 1 };
    ensure!(calls[victim] > 0.0, "no read went on a stream: {calls:?}");
    cluster.shards[victim].kill9();
    searches(&mut c).await?;
    cluster.shards[victim].restart(Duration::from_secs(60))?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    searches(&mut c).await?;
    let page = http_get(&cluster.coordinator.metrics).await?;
    let closed = metric_sum(&page, "coordinator_read_streams_closed_total");
    eprintln!("figures: {closed} read streams closed");
    ensure!(closed >= 1.0, "no stream saw its node die");
    Ok(())
}

/// A call its caller cancels stops on the node and is never answered; the coordinator cancels
/// the calls of a search whose client went away. Calls are held on the node by the failpoint
/// `shard_read_call_stall` (1.5 s), so that each is still running when its cancel arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_calls_stop_on_the_node() -> Result<()> {
    let cluster = Cluster::start(1)?;
    let mut c = cluster.client().await?;
    collection(&mut c, "cx", 0, "cancelled reads", 50).await?;
    let node = &cluster.shards[0];
    let cancelled = || async {
        let page = http_get(&node.metrics).await?;
        anyhow::Ok(metric_sum(&page, "shard_read_calls_cancelled_total"))
    };
    set_failpoint(&node.grpc, "shard_read_call_stall", "return(1500)").await?;

    let call = |id: u64| ReadCall {
        id,
        timeout_us: 5_000_000,
        call: Some(Call::Bm25(Bm25SearchRequest {
            shard: sref("cx"),
            query: "cancelled reads".into(),
            top_k: 5,
            ..Default::default()
        })),
        cancel: false,
    };
    let (tx, rx) = futures::channel::mpsc::unbounded::<ReadCalls>();
    let mut sc = shard_client(&node.grpc).await?;
    tx.unbounded_send(ReadCalls {
        calls: vec![call(1), call(2)],
    })?;
    let mut inbound = sc.reads(rx).await?.into_inner();
    tokio::time::sleep(Duration::from_millis(200)).await;
    tx.unbounded_send(ReadCalls {
        calls: vec![ReadCall {
            id: 1,
            cancel: true,
            ..Default::default()
        }],
    })?;
    // Both calls would have answered after 1.5 s; only the one not cancelled does.
    let mut answered = Vec::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(m) = tokio::time::timeout_at(until, inbound.message()).await {
        let batch = m?.context("stream ended early")?;
        answered.extend(batch.replies.iter().map(|r| r.id));
    }
    ensure!(answered == [2], "replies for {answered:?}");
    ensure!(
        cancelled().await? == 1.0,
        "the node did not count the cancel"
    );
    drop(tx);

    // A client that gives up on its search: the coordinator cancels the reads it had sent.
    let query = SearchRequest {
        collection: "cx".into(),
        query: "cancelled reads".into(),
        top_k: 5,
        mode: SearchMode::Bm25 as i32,
        ..Default::default()
    };
    let gave_up = tokio::time::timeout(Duration::from_millis(400), c.search(query.clone())).await;
    ensure!(
        gave_up.is_err(),
        "the search answered through a 1.5 s stall"
    );
    let started = std::time::Instant::now();
    while cancelled().await? < 2.0 {
        ensure!(
            started.elapsed() < Duration::from_secs(5),
            "the coordinator sent no cancel for the abandoned search"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let page = http_get(&cluster.coordinator.metrics).await?;
    let sent = metric_sum(&page, "coordinator_read_calls_cancelled_total");
    ensure!(sent >= 1.0, "coordinator counted {sent} cancels");

    // The stream stays in use afterwards.
    set_failpoint(&node.grpc, "shard_read_call_stall", "off").await?;
    let r = c.search(query).await?.into_inner();
    ensure!(r.hits.len() == 5, "{} hits after the cancels", r.hits.len());
    Ok(())
}
