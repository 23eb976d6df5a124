//! Distributed search. BM25 runs in two rounds so that N shards score like one index: first
//! every shard reports its statistics for the query terms, the coordinator sums them, then
//! every shard scores with the sums. Dense search fans out in parallel with it. Each
//! retriever's shard lists are merged by score into one global candidate list, then fused.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::future::{join_all, try_join};
use ragcluster_proto::v1::shard_client::ShardClient;
use ragcluster_proto::v1::*;
use tonic::transport::Channel;

use crate::State;
use crate::error::{CoordError, Result};
use crate::fanout::{call, request};
use crate::fusion::{self, Fusion, Ranked};

pub const MAX_TOP_K: u32 = 1000;
pub const MAX_QUERY_BYTES: usize = 8 * 1024;
pub const MAX_TIMEOUT_MS: u32 = 60_000;
/// Dense weight of cc/dbsf. UniversalRAG uses 0.8; on SciFact's train queries (our dev set)
/// 0.5 scored higher for dbsf (nDCG@10 0.7317 vs 0.7105; test 0.7312 vs 0.7215), measured with
/// `ragbench --tune`.
pub const DEFAULT_DENSE_WEIGHT: f32 = 0.5;
pub const DEFAULT_RRF_K: u32 = 60;
pub const DEFAULT_CANDIDATES: u32 = 50;

/// What every shard read of one search shares.
struct ShardRead<'a> {
    info: &'a CollectionInfo,
    consistency: Consistency,
    deadline: Instant,
}

/// A validated search request.
pub struct Plan {
    pub mode: SearchMode,
    pub fusion: Fusion,
    pub top_k: usize,
    pub candidates: usize,
    pub timeout: Duration,
}

pub fn plan(
    r: &SearchRequest,
    dimension: u32,
    default_timeout: Duration,
    max_top_k: u32,
) -> Result<Plan> {
    let max_top_k = max_top_k.min(MAX_TOP_K);
    if r.query.trim().is_empty() && r.query_vector.is_empty() {
        return Err(CoordError::invalid("query", "is empty"));
    }
    if r.query.len() > MAX_QUERY_BYTES {
        return Err(CoordError::invalid(
            "query",
            format!("is longer than {MAX_QUERY_BYTES} bytes"),
        ));
    }
    if r.top_k == 0 || r.top_k > max_top_k {
        return Err(CoordError::invalid(
            "top_k",
            format!("must be in [1, {max_top_k}], got {}", r.top_k),
        ));
    }
    let mode = match SearchMode::try_from(r.mode) {
        Ok(SearchMode::Unspecified) => SearchMode::Hybrid,
        Ok(m) => m,
        Err(_) => {
            return Err(CoordError::invalid(
                "mode",
                format!("unknown value {}", r.mode),
            ));
        }
    };
    if mode != SearchMode::Dense && r.query.trim().is_empty() {
        return Err(CoordError::invalid(
            "query",
            "is empty (bm25 and hybrid need text)",
        ));
    }
    let w = r.dense_weight.unwrap_or(DEFAULT_DENSE_WEIGHT);
    if !(0.0..=1.0).contains(&w) {
        return Err(CoordError::invalid(
            "dense_weight",
            format!("must be in [0, 1], got {w}"),
        ));
    }
    let k = r.rrf_k.unwrap_or(DEFAULT_RRF_K);
    if !(1..=10_000).contains(&k) {
        return Err(CoordError::invalid("rrf_k", "must be in [1, 10000]"));
    }
    let fusion = match r.fusion.as_str() {
        "" | "dbsf" => Fusion::Dbsf {
            lex_weight: 1.0 - w,
        },
        "cc" => Fusion::Cc {
            lex_weight: 1.0 - w,
        },
        "rrf" => Fusion::Rrf { k: k as f32 },
        other => {
            return Err(CoordError::invalid(
                "fusion",
                format!("unknown fusion {other:?}; use rrf, cc or dbsf"),
            ));
        }
    };
    if r.candidates > max_top_k {
        return Err(CoordError::invalid(
            "candidates",
            format!("must be at most {max_top_k}"),
        ));
    }
    // A single retriever needs no more than top_k; fusion needs a deeper pool per retriever.
    let candidates = match (r.candidates, mode) {
        (0, SearchMode::Hybrid) => r.top_k.max(DEFAULT_CANDIDATES),
        (0, _) => r.top_k,
        (c, _) => c.max(r.top_k),
    };
    if !r.query_vector.is_empty() && r.query_vector.len() != dimension as usize {
        return Err(CoordError::invalid(
            "query_vector",
            format!(
                "has dimension {}, collection expects {dimension}",
                r.query_vector.len()
            ),
        ));
    }
    if r.query_vector.iter().any(|x| !x.is_finite()) {
        return Err(CoordError::invalid("query_vector", "has non-finite values"));
    }
    if r.timeout_ms > MAX_TIMEOUT_MS {
        return Err(CoordError::invalid(
            "timeout_ms",
            format!("must be at most {MAX_TIMEOUT_MS}"),
        ));
    }
    for k in r.filter.keys() {
        if k.is_empty() {
            return Err(CoordError::invalid("filter", "has an empty key"));
        }
    }
    let timeout = if r.timeout_ms == 0 {
        default_timeout
    } else {
        Duration::from_millis(u64::from(r.timeout_ms))
    };
    Ok(Plan {
        mode,
        fusion,
        top_k: r.top_k as usize,
        candidates: candidates as usize,
        timeout,
    })
}

fn merge(
    lists: Vec<Vec<ShardHit>>,
    shard_of: &[u32],
    n: usize,
    chunks: &mut HashMap<String, (Chunk, u32)>,
) -> Vec<Ranked> {
    let mut all: Vec<Ranked> = Vec::new();
    for (list, &shard) in lists.into_iter().zip(shard_of) {
        for h in list {
            if let Some(c) = h.chunk {
                all.push(Ranked {
                    id: c.chunk_id.clone(),
                    score: h.score,
                });
                chunks.entry(c.chunk_id.clone()).or_insert((c, shard));
            }
        }
    }
    all.sort_by(|a, b| b.score.total_cmp(&a.score).then_with(|| a.id.cmp(&b.id)));
    all.truncate(n);
    all
}

impl State {
    /// One read of a shard, starting on the replica `first`. An eventual read that fails on a
    /// replica, or gets no answer within its share of the time left, marks that replica down
    /// for a while and goes on to the next one: a lost or cut-off node costs latency, not an
    /// error. Strong reads stay on the leader.
    async fn read_shard<T, F, Fut>(
        &self,
        r: &ShardRead<'_>,
        shard: u32,
        first: &str,
        f: F,
    ) -> Result<T>
    where
        F: Fn(ShardClient<Channel>, Duration) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    {
        let replicas = r
            .info
            .shards
            .get(shard as usize)
            .map_or(&[][..], |p| &p.nodes[..]);
        let mut tried: Vec<String> = Vec::new();
        let mut node = first.to_owned();
        loop {
            tried.push(node.clone());
            let next = if r.consistency == Consistency::Strong {
                None
            } else {
                self.routing.failover(replicas, &tried)
            };
            let left = r.deadline.saturating_duration_since(Instant::now());
            let budget = if next.is_some() { left / 2 } else { left };
            let what = format!("shard {shard} on {node}");
            let res = match self.clients.shard(&node) {
                Ok(c) => call(&what, budget, f(c, budget)).await,
                Err(e) => Err(e),
            };
            match (res, next) {
                (Ok(v), _) => return Ok(v),
                (Err(e), Some(n)) if e.is_retryable() => {
                    tracing::warn!(shard, from = %node, to = %n, error = %e, "read failover");
                    metrics::counter!("coordinator_read_failovers_total").increment(1);
                    self.routing.mark_down(&node);
                    node = n;
                }
                (Err(e), _) => return Err(e),
            }
        }
    }

    /// Sums every shard's BM25 statistics for the analysed terms of `query`.
    async fn global_stats(
        &self,
        r: &ShardRead<'_>,
        query: &str,
        shards: &[(u32, &String)],
    ) -> Result<GlobalBm25Stats> {
        let stats = join_all(shards.iter().map(|(i, node)| {
            let req = TermStatisticsRequest {
                shard: Some(ShardRef {
                    collection: r.info.name.clone(),
                    shard: *i,
                }),
                query: query.to_owned(),
            };
            self.read_shard(r, *i, node, move |mut c, t| {
                let req = req.clone();
                async move { c.term_statistics(request(req, t)).await }
            })
        }))
        .await;
        let mut global = GlobalBm25Stats::default();
        for s in stats {
            let s = s?;
            global.num_docs += s.num_docs;
            global.total_tokens += s.total_tokens;
            for (t, df) in s.doc_freq {
                *global.doc_freq.entry(t).or_insert(0) += df;
            }
        }
        Ok(global)
    }

    /// Loads the chunks of the final hits from their shards (the fetch of query-then-fetch).
    async fn fetch(
        &self,
        r: &ShardRead<'_>,
        shards: &[(u32, &String)],
        fused: &[fusion::Fused],
        chunks: &mut HashMap<String, (Chunk, u32)>,
    ) -> Result<()> {
        let mut wanted: HashMap<u32, Vec<String>> = HashMap::new();
        for f in fused {
            if let Some((_, shard)) = chunks.get(&f.id) {
                wanted.entry(*shard).or_default().push(f.id.clone());
            }
        }
        let node_of: HashMap<u32, &String> = shards.iter().map(|(i, n)| (*i, *n)).collect();
        let loads = wanted.into_iter().map(|(shard, ids)| {
            let node = node_of.get(&shard).copied().cloned().unwrap_or_default();
            let req = GetChunksRequest {
                shard: Some(ShardRef {
                    collection: r.info.name.clone(),
                    shard,
                }),
                chunk_ids: ids,
                with_embedding: false,
                consistency: Consistency::Eventual as i32,
            };
            async move {
                let got = self
                    .read_shard(r, shard, &node, move |mut c, t| {
                        let req = req.clone();
                        async move { c.get_chunks(request(req, t)).await }
                    })
                    .await?;
                Ok::<_, CoordError>((shard, got.chunks))
            }
        });
        let results = join_all(loads).await;
        // Ids whose chunk vanished between the two phases (a concurrent delete) drop out.
        for f in fused {
            chunks.remove(&f.id);
        }
        for r in results {
            let (shard, loaded) = r?;
            for c in loaded {
                chunks.insert(c.chunk_id.clone(), (c, shard));
            }
        }
        Ok(())
    }

    /// Distributed search under the request's deadline; a shard call cut short by that
    /// deadline makes the whole search DEADLINE_EXCEEDED (not UNAVAILABLE: retrying elsewhere
    /// with the same budget would not help).
    pub async fn search(&self, r: SearchRequest) -> Result<SearchResponse> {
        let started = Instant::now();
        let budget = match r.timeout_ms {
            0 => self.cfg.search_timeout,
            ms => Duration::from_millis(u64::from(ms)),
        };
        match self.search_within(r, started).await {
            Err(e) if e.is_retryable() && started.elapsed() >= budget => Err(CoordError::Deadline(
                format!("search ({} ms)", budget.as_millis()),
            )),
            r => r,
        }
    }

    async fn search_within(&self, r: SearchRequest, started: Instant) -> Result<SearchResponse> {
        let info = self.catalog.get(&r.collection)?;
        let p = plan(
            &r,
            info.dimension,
            self.cfg.search_timeout,
            self.cfg.limits.max_top_k,
        )?;
        let deadline = started + p.timeout;
        let consistency = Consistency::try_from(r.consistency).unwrap_or(Consistency::Eventual);
        // One replica per shard for every phase of this search.
        let targets: Vec<(u32, String)> = info
            .shards
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let t = self
                    .routing
                    .read_target(&info.name, i as u32, &p.nodes, consistency);
                (i as u32, t)
            })
            .collect();
        let _inflight: Vec<_> = targets.iter().map(|(_, n)| self.routing.track(n)).collect();
        let shards: Vec<(u32, &String)> = targets.iter().map(|(i, n)| (*i, n)).collect();
        let shard_ids: Vec<u32> = shards.iter().map(|s| s.0).collect();
        let sref = |i: u32| {
            Some(ShardRef {
                collection: info.name.clone(),
                shard: i,
            })
        };
        let filter = r.filter.clone();
        let read = ShardRead {
            info: &info,
            consistency,
            deadline,
        };
        let read = &read;
        // Hybrid: query-then-fetch. Shards return ids and scores of their candidates; only the
        // fused top_k are loaded afterwards.
        let hybrid = p.mode == SearchMode::Hybrid;

        let lexical = async {
            if p.mode == SearchMode::Dense {
                return Ok(Vec::new());
            }
            // Round 1: collection-wide statistics for the query terms (a single shard's own
            // statistics already are the collection's).
            let global = if shards.len() == 1 {
                None
            } else {
                Some(self.global_stats(read, &r.query, &shards).await?)
            };
            // Round 2: score everywhere with the same statistics.
            let lists = join_all(shards.iter().map(|(i, node)| {
                let req = Bm25SearchRequest {
                    shard: sref(*i),
                    query: r.query.clone(),
                    top_k: p.candidates as u32,
                    filter: filter.clone(),
                    stats: global.clone(),
                    ids_only: hybrid,
                    consistency: consistency as i32,
                };
                self.read_shard(read, *i, node, move |mut c, t| {
                    let req = req.clone();
                    async move { c.bm25_search(request(req, t)).await }
                })
            }))
            .await;
            lists
                .into_iter()
                .map(|l| l.map(|r| r.hits))
                .collect::<Result<Vec<_>>>()
        };
        let semantic = async {
            if p.mode == SearchMode::Bm25 {
                return Ok(Vec::new());
            }
            let vector = if r.query_vector.is_empty() {
                let t0 = Instant::now();
                let v = self
                    .embed(&info.embedding_model, vec![r.query.clone()])
                    .await?;
                metrics::histogram!("coordinator_query_embed_seconds")
                    .record(t0.elapsed().as_secs_f64());
                v.into_iter().next().unwrap_or_default()
            } else {
                r.query_vector.clone()
            };
            let ef = if r.ef_search == 0 {
                info.hnsw.unwrap_or_default().ef_search
            } else {
                r.ef_search
            };
            let lists = join_all(shards.iter().map(|(i, node)| {
                let req = VectorSearchRequest {
                    shard: sref(*i),
                    vector: vector.clone(),
                    top_k: p.candidates as u32,
                    ef_search: ef.max(p.candidates as u32),
                    filter: filter.clone(),
                    ids_only: hybrid,
                    consistency: consistency as i32,
                };
                self.read_shard(read, *i, node, move |mut c, t| {
                    let req = req.clone();
                    async move { c.vector_search(request(req, t)).await }
                })
            }))
            .await;
            lists
                .into_iter()
                .map(|l| l.map(|r| r.hits))
                .collect::<Result<Vec<_>>>()
        };
        let (lex_lists, sem_lists) =
            match tokio::time::timeout(p.timeout, try_join(lexical, semantic)).await {
                Err(_) => return Err(CoordError::Deadline("search fan-out".into())),
                Ok(r) => r?,
            };
        let mut chunks = HashMap::new();
        let lex = merge(lex_lists, &shard_ids, p.candidates, &mut chunks);
        let sem = merge(sem_lists, &shard_ids, p.candidates, &mut chunks);
        let fused = match p.mode {
            SearchMode::Bm25 => fusion::fuse(&lex, &[], Fusion::Rrf { k: 0.0 }, p.top_k)
                .into_iter()
                .map(|mut f| {
                    f.score = f.lex.map_or(0.0, |l| l.1);
                    f
                })
                .collect(),
            SearchMode::Dense => fusion::fuse(&[], &sem, Fusion::Rrf { k: 0.0 }, p.top_k)
                .into_iter()
                .map(|mut f| {
                    f.score = f.sem.map_or(0.0, |s| s.1);
                    f
                })
                .collect(),
            _ => fusion::fuse(&lex, &sem, p.fusion, p.top_k),
        };
        if hybrid {
            self.fetch(read, &shards, &fused, &mut chunks).await?;
        }
        let hits = fused
            .into_iter()
            .filter_map(|f| {
                let (c, shard) = chunks.remove(&f.id)?;
                let rs =
                    |x: Option<(u32, f32)>| x.map(|(rank, score)| RetrieverScore { rank, score });
                Some(SearchHit {
                    chunk_id: c.chunk_id,
                    doc_id: c.doc_id,
                    title: c.title,
                    section: c.section,
                    text: c.text,
                    metadata: c.metadata,
                    score: f.score,
                    bm25: rs(f.lex),
                    dense: rs(f.sem),
                    shard,
                    position: c.position,
                })
            })
            .collect();
        let took = started.elapsed();
        let mode = format!("{:?}", p.mode).to_lowercase();
        metrics::histogram!("coordinator_search_seconds", "mode" => mode)
            .record(took.as_secs_f64());
        Ok(SearchResponse {
            hits,
            took_us: took.as_micros() as u64,
            shards_total: shards.len() as u32,
            shards_ok: shards.len() as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> SearchRequest {
        SearchRequest {
            collection: "c".into(),
            query: "what is rust".into(),
            top_k: 10,
            ..Default::default()
        }
    }

    fn field_of(r: SearchRequest) -> String {
        match plan(&r, 4, Duration::from_secs(1), MAX_TOP_K) {
            Err(CoordError::InvalidArgument { field, .. }) => field,
            Err(e) => panic!("unexpected {e}"),
            Ok(_) => "ok".into(),
        }
    }

    #[test]
    fn rejects_bad_requests_naming_the_field() {
        assert_eq!(field_of(req()), "ok");
        assert_eq!(
            field_of(SearchRequest {
                query: "  ".into(),
                ..req()
            }),
            "query"
        );
        assert_eq!(field_of(SearchRequest { top_k: 0, ..req() }), "top_k");
        assert_eq!(
            field_of(SearchRequest {
                top_k: MAX_TOP_K + 1,
                ..req()
            }),
            "top_k"
        );
        assert_eq!(
            field_of(SearchRequest {
                fusion: "borda".into(),
                ..req()
            }),
            "fusion"
        );
        assert_eq!(
            field_of(SearchRequest {
                dense_weight: Some(1.5),
                ..req()
            }),
            "dense_weight"
        );
        assert_eq!(
            field_of(SearchRequest {
                dense_weight: Some(-0.1),
                ..req()
            }),
            "dense_weight"
        );
        assert_eq!(
            field_of(SearchRequest {
                query_vector: vec![1.0; 3],
                ..req()
            }),
            "query_vector"
        );
        assert_eq!(field_of(SearchRequest { mode: 9, ..req() }), "mode");
    }

    #[test]
    fn defaults_are_the_tuned_dbsf() {
        let p = plan(&req(), 4, Duration::from_secs(1), MAX_TOP_K).unwrap();
        assert_eq!(p.mode, SearchMode::Hybrid);
        assert_eq!(
            p.fusion,
            Fusion::Dbsf {
                lex_weight: 1.0 - DEFAULT_DENSE_WEIGHT
            }
        );
        assert_eq!(p.candidates, 50);
    }
}
