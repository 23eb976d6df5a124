//! Distributed search. BM25 runs in two rounds so that N shards score like one index: first
//! every shard reports its statistics for the query terms, the coordinator sums them, then
//! every shard scores with the sums. A repeated query skips the first round while no shard
//! moved (`bm25_stats`). Dense search fans out in parallel with it. Each
//! retriever's shard lists are merged by score into one global candidate list, then fused.
//! Hybrid searches are query-then-fetch: shards return ids and scores, and only the fused
//! top_k chunks are loaded afterwards. An `ids_only` search never loads a chunk: hits are
//! their ids (a chunk id is `{doc_id}#{position}`) and scores.

pub mod bm25_stats;
pub mod query;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use futures::future::{join_all, try_join};
use prost::Message;
use prost::bytes::Bytes;
use ragcluster_proto::v1::{
    Bm25SearchRequest, Chunk, CollectionInfo, EmbedInput, GlobalBm25Stats, ShardHit,
    VectorSearchRequest,
};
use tonic::Status;

pub use query::{Consistency, Hit, Mode, Query, Rank, Results};

use crate::catalog::Catalog;
use crate::error::{CoordError, Result};
use crate::fusion::{self, Fusion, Ranked};
use crate::models::Models;
use crate::shards::{ReadPlan, Shards};

pub struct Searcher {
    catalog: Arc<Catalog>,
    shards: Arc<Shards>,
    models: Arc<Models>,
    stats: bm25_stats::StatsCache,
}

/// Queries whose collection-wide BM25 statistics are kept (a few KB each at most).
const STATS_CACHE_QUERIES: usize = 10_000;

/// One replica per shard chosen for every phase of a search.
struct Targets<'a> {
    plan: ReadPlan<'a>,
    nodes: Vec<String>,
}

impl Targets<'_> {
    fn each(&self) -> impl Iterator<Item = (u32, &String)> {
        self.nodes.iter().enumerate().map(|(i, n)| (i as u32, n))
    }
}

/// A hit's chunk as its shard returned it. Shards send chunks encoded as they store them
/// (`ShardHit.chunk_encoded`), and only the top_k kept after the merge are decoded: of the
/// N x top_k a search over N shards receives, the rest are never parsed nor copied.
enum Stored {
    Chunk(Box<Chunk>),
    Encoded(Bytes),
}

/// Whether shards are asked for hits' chunks as stored (the default).
/// `RAGCLUSTER_DECODED_HITS=1` asks for decoded chunks instead, the path before
/// `encoded_chunks`: an escape hatch, and the baseline of an A/B run on one build.
fn encoded_hits() -> bool {
    static ENCODED: std::sync::LazyLock<bool> =
        std::sync::LazyLock::new(|| std::env::var("RAGCLUSTER_DECODED_HITS").as_deref() != Ok("1"));
    *ENCODED
}

/// The hits of every shard's list by score, best first, cut at `n`; their chunks go to
/// `chunks` (by id, with the shard that returned them).
fn merge(
    lists: Vec<Vec<ShardHit>>,
    n: usize,
    chunks: &mut HashMap<String, (Stored, u32)>,
) -> Vec<Ranked> {
    let mut all: Vec<Ranked> = Vec::new();
    for (shard, list) in lists.into_iter().enumerate() {
        for h in list {
            let (id, stored) = match h.chunk {
                Some(c) => (c.chunk_id.clone(), Stored::Chunk(Box::new(c))),
                // A shard that predates `encoded_chunks` answers with `chunk` above.
                None if !h.chunk_id.is_empty() => (h.chunk_id, Stored::Encoded(h.chunk_encoded)),
                None => continue,
            };
            all.push(Ranked {
                id: id.clone(),
                score: h.score,
            });
            chunks.entry(id).or_insert((stored, shard as u32));
        }
    }
    all.sort_by(|a, b| b.score.total_cmp(&a.score).then_with(|| a.id.cmp(&b.id)));
    all.truncate(n);
    all
}

/// Single-retriever searches rank by that retriever's own score.
fn rank(q: &Query, lex: &[Ranked], sem: &[Ranked]) -> Vec<fusion::Fused> {
    let only = |f: Vec<fusion::Fused>, pick: fn(&fusion::Fused) -> Option<(u32, f32)>| {
        f.into_iter()
            .map(|mut x| {
                x.score = pick(&x).map_or(0.0, |p| p.1);
                x
            })
            .collect()
    };
    match q.mode {
        Mode::Bm25 => only(
            fusion::fuse(lex, &[], Fusion::Rrf { k: 0.0 }, q.top_k),
            |f| f.lex,
        ),
        Mode::Dense => only(
            fusion::fuse(&[], sem, Fusion::Rrf { k: 0.0 }, q.top_k),
            |f| f.sem,
        ),
        Mode::Hybrid => fusion::fuse(lex, sem, q.fusion, q.top_k),
    }
}

/// A kept hit, its chunk decoded if the shard sent it encoded.
fn hit((stored, shard): (Stored, u32), f: fusion::Fused) -> Result<Hit> {
    let c = match stored {
        Stored::Chunk(c) => *c,
        Stored::Encoded(b) => Chunk::decode(b).map_err(|e| {
            CoordError::Upstream(Status::internal(format!(
                "shard {shard} returned chunk {:?} undecodable: {e}",
                f.id
            )))
        })?,
    };
    Ok(hit_of(c, shard, f))
}

/// A kept hit of an `ids_only` search: its document and position read from its chunk id
/// (`{doc_id}#{position}`, as ingest names chunks), nothing loaded.
fn id_hit(shard: u32, f: fusion::Fused) -> Hit {
    let (doc_id, position) = match f.id.rsplit_once('#') {
        Some((doc, pos)) => (doc.to_owned(), pos.parse().unwrap_or(0)),
        None => (String::new(), 0),
    };
    let c = Chunk {
        chunk_id: f.id.clone(),
        doc_id,
        position,
        ..Default::default()
    };
    hit_of(c, shard, f)
}

/// The hit of chunk `c` from `shard`, ranked as `f`.
fn hit_of(c: Chunk, shard: u32, f: fusion::Fused) -> Hit {
    let rank = |x: Option<(u32, f32)>| x.map(|(rank, score)| Rank { rank, score });
    Hit {
        chunk_id: c.chunk_id,
        doc_id: c.doc_id,
        title: c.title,
        section: c.section,
        text: c.text,
        metadata: c.metadata,
        position: c.position,
        shard,
        score: f.score,
        bm25: rank(f.lex),
        dense: rank(f.sem),
    }
}

impl Searcher {
    pub fn new(catalog: Arc<Catalog>, shards: Arc<Shards>, models: Arc<Models>) -> Self {
        Self {
            catalog,
            shards,
            models,
            stats: bm25_stats::StatsCache::new(STATS_CACHE_QUERIES),
        }
    }

    /// Runs `q` under its deadline; a shard call cut short by that deadline makes the whole
    /// search DEADLINE_EXCEEDED (not UNAVAILABLE: retrying elsewhere with the same budget
    /// would not help).
    pub async fn search(&self, q: Query) -> Result<Results> {
        let started = Instant::now();
        let info = self.catalog.get(&q.collection)?;
        let budget = q.timeout;
        let res = tokio::time::timeout(budget, self.run(&info, &q, started)).await;
        match res {
            Err(_) => Err(CoordError::Deadline("search fan-out".into())),
            Ok(Err(e)) if e.is_retryable() && started.elapsed() >= budget => Err(
                CoordError::Deadline(format!("search ({} ms)", budget.as_millis())),
            ),
            Ok(r) => r,
        }
    }

    async fn run(&self, info: &CollectionInfo, q: &Query, started: Instant) -> Result<Results> {
        let plan = ReadPlan {
            collection: &info.name,
            replicas: &info.shards,
            consistency: match q.consistency {
                Consistency::Strong => ragcluster_proto::v1::Consistency::Strong,
                Consistency::Eventual => ragcluster_proto::v1::Consistency::Eventual,
            },
            deadline: started + q.timeout,
            token: &q.token,
        };
        let (nodes, _inflight) = self.shards.targets(&plan);
        let t = Targets { plan, nodes };
        let (lex_lists, sem_lists) =
            try_join(self.lexical(info, &t, q), self.semantic(info, &t, q)).await?;
        let mut chunks = HashMap::new();
        let lex = merge(lex_lists, q.candidates, &mut chunks);
        let sem = merge(sem_lists, q.candidates, &mut chunks);
        let fused = rank(q, &lex, &sem);
        if q.mode == Mode::Hybrid && !q.ids_only {
            self.fetch(&t, &fused, &mut chunks).await?;
        }
        let hits = fused
            .into_iter()
            .filter_map(|f| {
                let kept = chunks.remove(&f.id)?;
                Some(if q.ids_only {
                    Ok(id_hit(kept.1, f))
                } else {
                    hit(kept, f)
                })
            })
            .collect::<Result<_>>()?;
        let took = started.elapsed();
        metrics::histogram!("coordinator_search_seconds", "mode" => q.mode.name())
            .record(took.as_secs_f64());
        let n = t.nodes.len() as u32;
        Ok(Results {
            hits,
            took,
            shards_total: n,
            shards_ok: n,
        })
    }

    /// BM25 lists of every shard, scored with collection-wide statistics.
    async fn lexical(
        &self,
        info: &CollectionInfo,
        t: &Targets<'_>,
        q: &Query,
    ) -> Result<Vec<Vec<ShardHit>>> {
        if q.mode == Mode::Dense {
            return Ok(Vec::new());
        }
        let req = Bm25SearchRequest {
            query: q.text.clone(),
            top_k: q.candidates as u32,
            filter: q.filter.clone(),
            conditions: q.conditions.clone(),
            ids_only: q.mode == Mode::Hybrid || q.ids_only,
            encoded_chunks: encoded_hits(),
            ..Default::default()
        };
        // A single shard's own statistics already are the collection's.
        if t.nodes.len() == 1 {
            return self.scored_with(t, &req).await;
        }
        let key = (info.name.clone(), info.created_at_ms, q.text.clone());
        if let Some(e) = self
            .stats
            .get(&key)
            .filter(|e| e.seqs.len() == t.nodes.len())
        {
            if let Some(lists) = self.scored(t, &req, &e).await? {
                metrics::counter!("coordinator_bm25_stats_cache_total", "outcome" => "hit")
                    .increment(1);
                return Ok(lists);
            }
            metrics::counter!("coordinator_bm25_stats_cache_total", "outcome" => "stale")
                .increment(1);
        } else {
            metrics::counter!("coordinator_bm25_stats_cache_total", "outcome" => "miss")
                .increment(1);
        }
        // Round 1: collection-wide statistics for the query terms; round 2: score everywhere
        // with them (unchecked, as before the cache: no retry loop under steady writes).
        let e = self.global_stats(t, &q.text).await?;
        let mut req = req;
        req.stats = Some(e.stats.clone());
        let lists = self.scored_with(t, &req).await?;
        self.stats.put(key, e);
        Ok(lists)
    }

    /// Round 2 with the cached statistics `e`; None when a shard moved since (it checks its
    /// seq and scores nothing then).
    async fn scored(
        &self,
        t: &Targets<'_>,
        req: &Bm25SearchRequest,
        e: &bm25_stats::Entry,
    ) -> Result<Option<Vec<Vec<ShardHit>>>> {
        let answers = join_all(t.each().map(|(i, node)| {
            let mut req = req.clone();
            req.stats = Some(e.stats.clone());
            req.stats_seq = e.seqs[i as usize];
            self.shards.bm25(&t.plan, i, node, req)
        }))
        .await;
        let mut lists = Vec::with_capacity(answers.len());
        for a in answers {
            let a = a?;
            if a.stats_stale {
                return Ok(None);
            }
            lists.push(a.hits);
        }
        Ok(Some(lists))
    }

    /// Round 2 with the statistics in `req` as they are (no seq check).
    async fn scored_with(
        &self,
        t: &Targets<'_>,
        req: &Bm25SearchRequest,
    ) -> Result<Vec<Vec<ShardHit>>> {
        let answers = join_all(
            t.each()
                .map(|(i, node)| self.shards.bm25(&t.plan, i, node, req.clone())),
        )
        .await;
        answers.into_iter().map(|a| a.map(|a| a.hits)).collect()
    }

    /// Sums every shard's BM25 statistics for the analysed terms of `query`, with the seq
    /// each shard was at.
    async fn global_stats(&self, t: &Targets<'_>, query: &str) -> Result<bm25_stats::Entry> {
        let stats = join_all(
            t.each()
                .map(|(i, node)| self.shards.term_stats(&t.plan, i, node, query)),
        )
        .await;
        let mut global = GlobalBm25Stats::default();
        let mut seqs = Vec::with_capacity(stats.len());
        for s in stats {
            let s = s?;
            seqs.push(s.seq);
            global.num_docs += s.num_docs;
            global.total_tokens += s.total_tokens;
            for (t, df) in s.doc_freq {
                *global.doc_freq.entry(t).or_insert(0) += df;
            }
        }
        Ok(bm25_stats::Entry {
            seqs,
            stats: global,
        })
    }

    /// HNSW lists of every shard, for the query's own vector or its embedding.
    async fn semantic(
        &self,
        info: &CollectionInfo,
        t: &Targets<'_>,
        q: &Query,
    ) -> Result<Vec<Vec<ShardHit>>> {
        if q.mode == Mode::Bm25 {
            return Ok(Vec::new());
        }
        let vector = match &q.vector {
            Some(v) => v.clone(),
            None => {
                let t0 = Instant::now();
                let v = self
                    .models
                    .embed(
                        &info.embedding_model,
                        vec![q.text.clone()],
                        EmbedInput::Query,
                    )
                    .await?;
                metrics::histogram!("coordinator_query_embed_seconds")
                    .record(t0.elapsed().as_secs_f64());
                v.into_iter().next().unwrap_or_default()
            }
        };
        let ef = match q.ef_search {
            0 => info.hnsw.unwrap_or_default().ef_search,
            ef => ef,
        };
        let req = VectorSearchRequest {
            vector,
            top_k: q.candidates as u32,
            ef_search: ef.max(q.candidates as u32),
            filter: q.filter.clone(),
            conditions: q.conditions.clone(),
            ids_only: q.mode == Mode::Hybrid || q.ids_only,
            encoded_chunks: encoded_hits(),
            exact: q.exact,
            ..Default::default()
        };
        let lists = join_all(
            t.each()
                .map(|(i, node)| self.shards.vector(&t.plan, i, node, req.clone())),
        )
        .await;
        lists.into_iter().collect()
    }

    /// Loads the chunks of the final hits from their shards (the fetch of query-then-fetch).
    /// Ids whose chunk vanished between the two phases (a concurrent delete) drop out.
    async fn fetch(
        &self,
        t: &Targets<'_>,
        fused: &[fusion::Fused],
        chunks: &mut HashMap<String, (Stored, u32)>,
    ) -> Result<()> {
        let mut wanted: HashMap<u32, Vec<String>> = HashMap::new();
        for f in fused {
            if let Some((_, shard)) = chunks.get(&f.id) {
                wanted.entry(*shard).or_default().push(f.id.clone());
            }
        }
        // The chunks come from the replicas that ranked them, which are as fresh as the
        // ranking: no second read index.
        let plan = ReadPlan {
            consistency: ragcluster_proto::v1::Consistency::Eventual,
            ..t.plan
        };
        let plan = &plan;
        let loads = wanted.into_iter().map(|(shard, ids)| async move {
            let node = &t.nodes[shard as usize];
            let got = self.shards.chunks(plan, shard, node, ids, false).await?;
            Ok::<_, CoordError>((shard, got))
        });
        let results = join_all(loads).await;
        for f in fused {
            chunks.remove(&f.id);
        }
        for r in results {
            let (shard, loaded) = r?;
            for c in loaded {
                chunks.insert(c.chunk_id.clone(), (Stored::Chunk(Box::new(c)), shard));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(id: &str, text: &str) -> Chunk {
        Chunk {
            chunk_id: id.into(),
            doc_id: id.split('#').next().unwrap_or_default().into(),
            text: text.into(),
            metadata: [("lang".to_owned(), "en".to_owned())].into(),
            ..Default::default()
        }
    }

    fn encoded(c: &Chunk, score: f32) -> ShardHit {
        ShardHit {
            chunk: None,
            score,
            chunk_id: c.chunk_id.clone(),
            chunk_encoded: c.encode_to_vec().into(),
        }
    }

    fn fused(id: &str, score: f32) -> fusion::Fused {
        fusion::Fused {
            id: id.into(),
            score,
            lex: Some((1, score)),
            sem: None,
        }
    }

    /// Encoded hits (current shards) and decoded ones (shards that predate `encoded_chunks`)
    /// merge into one ranking, and the kept ones come out as the same hits either way.
    #[test]
    fn encoded_and_decoded_hits_merge_alike() {
        let (a, b, c) = (
            chunk("a#0", "alpha"),
            chunk("b#0", "bravo"),
            chunk("c#0", "charlie"),
        );
        let lists = vec![
            vec![encoded(&a, 3.0), encoded(&c, 1.0)],
            vec![ShardHit {
                chunk: Some(b.clone()),
                score: 2.0,
                ..Default::default()
            }],
        ];
        let mut chunks = HashMap::new();
        let ranked = merge(lists, 2, &mut chunks);
        let ids: Vec<&str> = ranked.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["a#0", "b#0"]);
        let ha = hit(chunks.remove("a#0").unwrap(), fused("a#0", 3.0)).unwrap();
        let hb = hit(chunks.remove("b#0").unwrap(), fused("b#0", 2.0)).unwrap();
        for (h, c, shard) in [(ha, &a, 0), (hb, &b, 1)] {
            assert_eq!(
                (&h.chunk_id, &h.doc_id, &h.text, &h.metadata, h.shard),
                (&c.chunk_id, &c.doc_id, &c.text, &c.metadata, shard)
            );
        }
    }

    /// An ids-only hit reads its document and position from the chunk id (a document id may
    /// hold '#' itself).
    #[test]
    fn an_ids_only_hit_names_its_document_and_position() {
        let h = id_hit(2, fused("notes#v2#7", 0.5));
        assert_eq!(
            (h.chunk_id.as_str(), h.doc_id.as_str(), h.position, h.shard),
            ("notes#v2#7", "notes#v2", 7, 2)
        );
        assert!(h.text.is_empty() && h.metadata.is_empty() && h.title.is_empty());
        assert_eq!(
            h.bm25,
            Some(Rank {
                rank: 1,
                score: 0.5
            })
        );
    }

    /// A shard answering bytes that are no chunk fails the search with INTERNAL, no panic.
    #[test]
    fn an_undecodable_chunk_is_an_error() {
        let bad = ShardHit {
            chunk: None,
            score: 1.0,
            chunk_id: "x#0".into(),
            chunk_encoded: Bytes::from_static(&[0x42, 0xff, 0xff]),
        };
        let mut chunks = HashMap::new();
        merge(vec![vec![bad]], 10, &mut chunks);
        let e = hit(chunks.remove("x#0").unwrap(), fused("x#0", 1.0)).unwrap_err();
        assert_eq!(e.to_status_code(), tonic::Code::Internal);
    }
}
