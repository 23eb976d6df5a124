//! Bigger corpora made from a real one, for scale benchmarks: SciFact's chunks repeated with
//! their MiniLM vectors perturbed (a fixed seed, so every run sees the same corpus). Real
//! vectors keep the neighbourhood structure that HNSW's speed and recall depend on, which
//! random vectors would not. Also the benchmarks' shared client paths: writes straight to the
//! shard nodes (embedding excluded), query embedding, and one search request per mode.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use futures::{StreamExt, TryStreamExt};
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::*;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;

use crate::BeirQuery;
use shard_node::index::hnsw::distance::normalize;

/// Noise added per coordinate (sum of 4 uniforms, scaled); about 0.07 in cosine distance.
const NOISE: f32 = 0.035;

/// `n` chunks: `real` in order, then copies with new document and chunk ids (`doc~rep`) and
/// perturbed, re-normalised vectors.
pub fn perturbed_copies(real: &[Chunk], n: usize) -> Vec<Chunk> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    (0..n)
        .map(|i| {
            let src = &real[i % real.len()];
            let rep = i / real.len();
            let mut c = src.clone();
            let doc = format!("{}~{rep}", src.doc_id);
            c.chunk_id = format!("{doc}#{}", src.position);
            c.prev_chunk_id = if src.prev_chunk_id.is_empty() {
                String::new()
            } else {
                format!("{doc}#{}", src.position - 1)
            };
            c.next_chunk_id = if src.next_chunk_id.is_empty() {
                String::new()
            } else {
                format!("{doc}#{}", src.position + 1)
            };
            c.doc_id = doc;
            if rep > 0 {
                perturb(&mut rng, &mut c.embedding);
            }
            c
        })
        .collect()
}

/// Adds the benchmark's noise to a vector and re-normalises it.
pub fn perturb(rng: &mut impl Rng, v: &mut [f32]) {
    for x in v.iter_mut() {
        let u: f32 = (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>() * NOISE;
        *x += u;
    }
    normalize(v);
}

/// Retries a write while the shard's Raft group is still electing its leader.
pub async fn write_retrying(sc: &mut ShardClient<Channel>, req: WriteBatchRequest) -> Result<()> {
    for _ in 0..100 {
        match sc.write_batch(req.clone()).await {
            Ok(_) => return Ok(()),
            Err(s) if s.code() == tonic::Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => return Err(s.into()),
        }
    }
    anyhow::bail!("shard {:?} has no leader", req.shard)
}

/// Waits until every shard's HNSW graph holds all its points (`ShardInfo.hnsw_pending` 0 on
/// each shard's first node, its leader in a fresh rf-1 collection: written-behind points
/// inserted), polling every 50 ms for at most `limit`.
pub async fn wait_graphs(info: &CollectionInfo, limit: Duration) -> Result<()> {
    let until = std::time::Instant::now() + limit;
    for (i, (mut sc, req)) in first_replicas(info).await?.into_iter().enumerate() {
        loop {
            let pending = sc.shard_info(req.clone()).await?.into_inner().hnsw_pending;
            if pending == 0 {
                break;
            }
            anyhow::ensure!(
                std::time::Instant::now() < until,
                "shard {i}: {pending} points still outside the graph after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// Waits until the shards' first replicas have settled after a load: no point held outside
/// the graph, at most 100 bytes of op log per chunk (the graph dumped and the log behind it
/// dropped) and the data directories (`disk`) steady within 1% over 2 s (memtables flushed,
/// write-ahead log deleted), polling every 500 ms for at most `limit`. Returns the seconds
/// waited, the directories' bytes, and the shards' bytes per chunk by place
/// (`ShardInfo.bytes_by_family`, summed over the shards), what `ragctl status` shows.
pub async fn settled_bytes(
    info: &CollectionInfo,
    disk: impl Fn() -> u64,
    limit: Duration,
) -> Result<(f64, u64, std::collections::BTreeMap<String, f64>)> {
    let t = std::time::Instant::now();
    let replicas = first_replicas(info).await?;
    let mut sizes: Vec<u64> = Vec::new();
    loop {
        let mut infos = Vec::with_capacity(replicas.len());
        for (sc, req) in &replicas {
            infos.push(sc.clone().shard_info(req.clone()).await?.into_inner());
        }
        sizes.push(disk());
        let recent = &sizes[sizes.len().saturating_sub(5)..];
        let (lo, hi) = (recent.iter().min(), recent.iter().max());
        let steady = recent.len() == 5 && lo.zip(hi).is_some_and(|(l, h)| h - l <= h / 100);
        let settled = steady
            && infos.iter().all(|i| {
                let oplog = i.bytes_by_family.get("oplog").copied().unwrap_or(0);
                i.hnsw_pending == 0 && oplog <= 100 * i.chunks
            });
        if settled || t.elapsed() >= limit {
            let chunks = infos.iter().map(|i| i.chunks).sum::<u64>().max(1) as f64;
            let mut by_place = std::collections::BTreeMap::new();
            for i in &infos {
                for (k, v) in &i.bytes_by_family {
                    *by_place.entry(k.clone()).or_insert(0.0) += *v as f64 / chunks;
                }
            }
            let bytes = *sizes.last().unwrap_or(&0);
            return Ok((t.elapsed().as_secs_f64(), bytes, by_place));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until the processes behind `cpu_seconds` (summed CPU seconds) go quiet: under
/// `QUIET_CORES` busy over each of 3 consecutive seconds, at least `min` and at most `limit`
/// in all. A load's background work (tantivy merges, the flat HNSW copy, dumps, RocksDB
/// flushes) runs for seconds after the graphs are complete, and a latency figure taken during
/// it measures that work, not the query path. Returns the seconds waited.
pub async fn quiet_cpu(cpu_seconds: impl Fn() -> f64, min: Duration, limit: Duration) -> f64 {
    const QUIET_CORES: f64 = 0.05;
    let t = std::time::Instant::now();
    let mut quiet = 0;
    let mut last = cpu_seconds();
    while t.elapsed() < limit {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = cpu_seconds();
        quiet = if now - last < QUIET_CORES {
            quiet + 1
        } else {
            0
        };
        last = now;
        if quiet >= 3 && t.elapsed() >= min {
            break;
        }
    }
    t.elapsed().as_secs_f64()
}

/// Points the shards' first replicas hold outside their graphs (written behind) right now.
pub async fn held_points(info: &CollectionInfo) -> Result<u64> {
    let mut held = 0;
    for (mut sc, req) in first_replicas(info).await? {
        held += sc.shard_info(req).await?.into_inner().hnsw_pending;
    }
    Ok(held)
}

/// A client of each shard's first replica with the request for that shard's figures.
async fn first_replicas(
    info: &CollectionInfo,
) -> Result<Vec<(ShardClient<Channel>, ShardInfoRequest)>> {
    let mut out = Vec::new();
    for (i, s) in info.shards.iter().enumerate() {
        let sc = ShardClient::new(Channel::from_shared(s.nodes[0].clone())?.connect().await?);
        let req = ShardInfoRequest {
            shard: Some(ShardRef {
                collection: info.name.clone(),
                shard: i as u32,
            }),
        };
        out.push((sc, req));
    }
    Ok(out)
}

/// Writes chunks straight to the shard nodes through Shard.WriteBatch, by document, on the shard
/// the coordinator's placement gives it (3 shards in parallel, 512 chunks per batch).
pub async fn write_direct(info: &CollectionInfo, chunks: Vec<Chunk>) -> Result<()> {
    write_direct_with(info, chunks, 1).await
}

/// `write_direct` with `in_flight` batches of 512 chunks sent to each shard at once (1: each
/// batch waits for the previous one's acknowledgement).
pub async fn write_direct_with(
    info: &CollectionInfo,
    chunks: Vec<Chunk>,
    in_flight: usize,
) -> Result<()> {
    let mut by_shard: HashMap<u32, Vec<DocumentWrite>> = HashMap::new();
    let mut by_doc: HashMap<String, Vec<Chunk>> = HashMap::new();
    for c in chunks {
        by_doc.entry(c.doc_id.clone()).or_default().push(c);
    }
    for (doc, cs) in by_doc {
        let shard = coordinator::placement::shard_for_doc(&doc, info.shard_count);
        by_shard.entry(shard).or_default().push(DocumentWrite {
            doc_id: doc,
            chunks: cs,
            delete: false,
        });
    }
    let tasks = by_shard.into_iter().map(|(shard, writes)| {
        // The preferred leader; a fresh group may still be electing it (retried below).
        let node = info.shards[shard as usize].nodes[0].clone();
        let coll = info.name.clone();
        async move {
            let sc = ShardClient::new(Channel::from_shared(node)?.connect().await?)
                .max_encoding_message_size(256 << 20);
            let mut batches = Vec::new();
            let mut batch = Vec::new();
            let mut n = 0;
            for w in writes {
                n += w.chunks.len();
                batch.push(w);
                if n >= 512 {
                    batches.push(std::mem::take(&mut batch));
                    n = 0;
                }
            }
            if !batch.is_empty() {
                batches.push(batch);
            }
            futures::stream::iter(batches)
                .map(|writes| {
                    let mut sc = sc.clone();
                    let req = WriteBatchRequest {
                        shard: Some(ShardRef {
                            collection: coll.clone(),
                            shard,
                        }),
                        writes,
                        ..Default::default()
                    };
                    async move { write_retrying(&mut sc, req).await }
                })
                .buffer_unordered(in_flight.max(1))
                .try_collect::<Vec<_>>()
                .await?;
            anyhow::Ok(())
        }
    });
    for r in futures::future::join_all(tasks).await {
        r?;
    }
    Ok(())
}

pub async fn embed_queries(
    mw: &mut ModelWorkerClient<Channel>,
    queries: &[BeirQuery],
) -> Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(queries.len());
    for b in queries.chunks(64) {
        let texts = b.iter().map(|q| q.text.clone()).collect();
        let r = mw
            .embed(EmbedRequest {
                texts,
                ..Default::default()
            })
            .await?
            .into_inner();
        out.extend(r.embeddings.into_iter().map(|e| e.values));
    }
    Ok(out)
}

pub fn req(
    coll: &str,
    q: &BeirQuery,
    vec: &[f32],
    mode: SearchMode,
    fusion: &str,
    top_k: u32,
) -> SearchRequest {
    SearchRequest {
        collection: coll.into(),
        query: q.text.clone(),
        top_k,
        mode: mode as i32,
        fusion: fusion.into(),
        query_vector: if mode == SearchMode::Bm25 {
            vec![]
        } else {
            vec.to_vec()
        },
        timeout_ms: 30_000,
        ..Default::default()
    }
}

pub const MODES: [(&str, SearchMode, &str); 5] = [
    ("bm25", SearchMode::Bm25, ""),
    ("dense", SearchMode::Dense, ""),
    ("hybrid-rrf", SearchMode::Hybrid, "rrf"),
    ("hybrid-cc", SearchMode::Hybrid, "cc"),
    ("hybrid-dbsf", SearchMode::Hybrid, "dbsf"),
];

/// Seconds a QPS figure is measured over at least: one pass over a few hundred queries lasts
/// 0.1-0.4 s on 2 cores, where one background flush or merge moved the figure by 2x.
pub const QPS_SECONDS: f64 = 3.0;

/// Queries per second with `concurrency` requests in flight over one channel, cycling through
/// `reqs` (each at least once) until `min_seconds` have passed; also the queries sent.
pub async fn qps(
    c: &coordinator_client::CoordinatorClient<Channel>,
    reqs: Vec<SearchRequest>,
    concurrency: usize,
    min_seconds: f64,
) -> Result<(f64, usize)> {
    use futures::stream::{self, StreamExt};
    let t = std::time::Instant::now();
    let len = reqs.len();
    let sends = reqs
        .iter()
        .cycle()
        .enumerate()
        .take_while(|(i, _)| *i < len || t.elapsed().as_secs_f64() < min_seconds)
        .map(|(_, r)| {
            let (mut c, r) = (c.clone(), r.clone());
            async move { c.search(r).await }
        });
    let done: Vec<_> = stream::iter(sends)
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let n = done.len();
    for d in done {
        d?;
    }
    Ok((n as f64 / t.elapsed().as_secs_f64(), n))
}

/// One search shape measured: 20 warm-up queries, then each query once from one client
/// (p50 / p99 and the hit ids), then QPS with `concurrency` clients for at least
/// `qps_seconds`, with the coordinator and shard nodes' CPU per query (the client not
/// counted).
pub async fn measure(
    cluster: &crate::Cluster,
    c: &mut coordinator_client::CoordinatorClient<Channel>,
    queries: &[BeirQuery],
    qvecs: &[Vec<f32>],
    request: &dyn Fn(&BeirQuery, &[f32]) -> SearchRequest,
    (concurrency, qps_seconds): (usize, f64),
) -> Result<(serde_json::Value, Vec<Vec<String>>)> {
    for (q, v) in queries.iter().zip(qvecs).take(20) {
        c.search(request(q, v)).await?;
    }
    let mut lat = Vec::with_capacity(queries.len());
    let mut top = Vec::with_capacity(queries.len());
    for (q, v) in queries.iter().zip(qvecs) {
        let t = Instant::now();
        let r = c.search(request(q, v)).await?.into_inner();
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        top.push(r.hits.into_iter().map(|h| h.chunk_id).collect());
    }
    let reqs: Vec<SearchRequest> = queries
        .iter()
        .zip(qvecs)
        .map(|(q, v)| request(q, v))
        .collect();
    let cpu_before = cluster.data_path_cpu_seconds();
    let (qps, n) = qps(c, reqs, concurrency, qps_seconds).await?;
    let cpu_ms = 1e3 * (cluster.data_path_cpu_seconds() - cpu_before) / n as f64;
    let row = serde_json::json!({"p50_ms": crate::percentile(&mut lat, 50.0), "p99_ms": crate::percentile(&mut lat, 99.0),
                     "qps": qps, "qps_queries": n, "cpu_ms_per_query": cpu_ms});
    Ok((row, top))
}

/// Creates a collection and returns its placement (which `write_direct` needs).
pub async fn create_collection(
    c: &mut coordinator_client::CoordinatorClient<Channel>,
    req: CreateCollectionRequest,
) -> Result<CollectionInfo> {
    let name = req.name.clone();
    c.create_collection(req).await?;
    c.describe_collection(DescribeCollectionRequest { name })
        .await?
        .into_inner()
        .collection
        .ok_or_else(|| anyhow::anyhow!("DescribeCollection returned no collection"))
}

/// Every chunk (with its vector) of the documents `doc_ids` in `collection`, asked of every
/// node for each of its `shards` shard numbers (placement puts a shard on some node), sorted
/// by chunk id. Chunk ids are `doc#position`; up to 32 positions per document are asked for.
pub async fn fetch_chunks(
    nodes: &[String],
    collection: &str,
    shards: u32,
    doc_ids: &[String],
) -> Result<Vec<Chunk>> {
    let mut out = Vec::new();
    for node in nodes {
        let mut sc = ShardClient::new(Channel::from_shared(node.clone())?.connect().await?)
            .max_decoding_message_size(256 << 20);
        for shard in 0..shards {
            for docs in doc_ids.chunks(500) {
                let ids: Vec<String> = docs
                    .iter()
                    .flat_map(|d| (0..32).map(move |p| format!("{d}#{p}")))
                    .collect();
                let r = sc
                    .get_chunks(GetChunksRequest {
                        shard: Some(ShardRef {
                            collection: collection.into(),
                            shard,
                        }),
                        chunk_ids: ids,
                        with_embedding: true,
                        consistency: 0,
                        ..Default::default()
                    })
                    .await;
                match r {
                    Ok(r) => out.extend(r.into_inner().chunks),
                    Err(s) if s.code() == tonic::Code::NotFound => break,
                    Err(s) => return Err(s.into()),
                }
            }
        }
    }
    out.sort_by(|a, b| a.chunk_id.cmp(&b.chunk_id));
    out.dedup_by(|a, b| a.chunk_id == b.chunk_id);
    Ok(out)
}
