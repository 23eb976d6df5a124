//! Retrieval through the coordinator's search and the post-retrieval operators over chunks:
//! rerank, MMR, prev-next augmentation, thresholds, extractive compression, reordering.

use std::collections::HashMap;
use std::time::Duration;

use futures::future::join_all;

use super::{At, Operator};
use crate::error::CoordError;
use crate::error::Result;
use crate::flow::llm;
use crate::flow::run::{Ctx, Note, Run};
use crate::flow::run::{Passage, read_plan, sort_desc};
use crate::flow::spec::Op;
use crate::flow::spec::{Mode, ReorderMode, Retrieve, parse_fusion};
use crate::fusion::{Fusion, min_max};
use crate::search;
use ragcluster_proto::v1::EmbedInput;

pub struct Retrieval;

#[tonic::async_trait]
impl Operator for Retrieval {
    async fn run(&self, rt: &Run, op: &Op, _at: At<'_>, ctx: &mut Ctx) -> Result<Note> {
        match op {
            Op::Retrieve(r) => {
                ctx.chunks = retrieve(rt, r, &ctx.query, ctx.hyde.as_deref(), ctx.widen).await?;
            }
            Op::Rerank {
                model,
                keep,
                min_score,
                blend,
            } if !ctx.chunks.is_empty() => {
                let model = rt
                    .overrides
                    .rerank_model
                    .clone()
                    .unwrap_or_else(|| model.clone());
                let texts = ctx.chunks.iter().map(|c| c.text.clone()).collect();
                let scores = llm::rerank(rt, &model, &ctx.query, texts).await?;
                let mut scored: Vec<(Passage, f32)> = std::mem::take(&mut ctx.chunks)
                    .into_iter()
                    .zip(scores)
                    .collect();
                if let Some(m) = min_score {
                    scored.retain(|(_, s)| s >= m);
                }
                if let Some(w) = blend {
                    blend_scores(&mut scored, *w);
                }
                ctx.chunks = scored
                    .into_iter()
                    .map(|(mut c, s)| {
                        c.score = s;
                        c
                    })
                    .collect();
                sort_desc(&mut ctx.chunks);
                ctx.chunks.truncate(*keep);
            }
            Op::Mmr { lambda, keep } => {
                ctx.chunks = mmr(
                    rt,
                    &ctx.query,
                    std::mem::take(&mut ctx.chunks),
                    *lambda,
                    *keep,
                )
                .await?;
            }
            Op::PrevNext { before, after } => {
                ctx.chunks =
                    prev_next(rt, std::mem::take(&mut ctx.chunks), *before, *after).await?;
            }
            Op::Threshold {
                min_score,
                keep_fraction,
                keep,
            } => {
                sort_desc(&mut ctx.chunks);
                if let Some(m) = min_score {
                    ctx.chunks.retain(|c| c.score >= *m);
                }
                if let Some(f) = keep_fraction {
                    let n = ((ctx.chunks.len() as f32) * f).ceil().max(1.0) as usize;
                    ctx.chunks.truncate(n);
                }
                if let Some(k) = keep {
                    ctx.chunks.truncate(*k);
                }
            }
            Op::Compress { budget_tokens } => {
                ctx.chunks = compress(
                    rt,
                    &ctx.query,
                    std::mem::take(&mut ctx.chunks),
                    *budget_tokens,
                )
                .await?;
            }
            Op::Reorder(m) => reorder(&mut ctx.chunks, *m),
            _ => {}
        }
        Ok(Note::default())
    }
}

/// One retrieval through the coordinator's own distributed search.
pub async fn retrieve(
    rt: &Run,
    r: &Retrieve,
    query: &str,
    hyde: Option<&str>,
    widen: usize,
) -> Result<Vec<Passage>> {
    let top_k = rt.overrides.top_k.unwrap_or(r.top_k) * widen.max(1);
    let (mode, fusion_name) = (
        r.mode,
        rt.overrides
            .fusion
            .clone()
            .unwrap_or_else(|| r.fusion_name.clone()),
    );
    // HyDE: the dense side searches with the hypothetical passage's embedding.
    let query_vector = match (hyde, mode) {
        // The hypothetical passage is embedded as the documents are (HyDE's point).
        (Some(h), Mode::Dense | Mode::Hybrid) => {
            llm::embed(rt, vec![h.to_owned()], EmbedInput::Document)
                .await?
                .pop()
                .unwrap_or_default()
        }
        _ => Vec::new(),
    };
    // The step's fusion, or the request's override, as the search API would parse them.
    let rrf_k = match r.fusion {
        Fusion::Rrf { k } => k,
        _ => search::query::DEFAULT_RRF_K as f32,
    };
    let dense_weight = rt.overrides.dense_weight.or(r.dense_weight);
    let fusion = parse_fusion(&fusion_name, dense_weight, rrf_k)
        .map_err(|e| CoordError::invalid("overrides.fusion", e))?;
    let top_k = top_k.min(crate::limits::MAX_SEARCH_TOP_K as usize);
    let q = search::Query {
        collection: rt.info.name.clone(),
        text: query.to_owned(),
        vector: (!query_vector.is_empty()).then_some(query_vector),
        mode: match mode {
            Mode::Bm25 => search::Mode::Bm25,
            Mode::Dense => search::Mode::Dense,
            Mode::Hybrid => search::Mode::Hybrid,
        },
        fusion,
        top_k,
        candidates: if mode == Mode::Hybrid {
            top_k.max(search::query::DEFAULT_CANDIDATES as usize)
        } else {
            top_k
        },
        filter: r.filter.clone(),
        conditions: rt.conditions.clone(),
        ef_search: 0,
        exact: false,
        ids_only: false,
        consistency: search::Consistency::Eventual,
        token: rt.read_token.clone(),
        timeout: rt.left().max(Duration::from_millis(1)),
    };
    Ok(rt
        .services
        .searcher
        .search(q)
        .await?
        .hits
        .into_iter()
        .map(Passage::from)
        .collect())
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(1e-12)
}

/// Stored embeddings of passages, read from their shards (no re-embedding).
async fn stored_vectors(rt: &Run, ps: &[Passage]) -> Result<HashMap<String, Vec<f32>>> {
    let mut by_shard: HashMap<u32, Vec<String>> = HashMap::new();
    for p in ps {
        by_shard
            .entry(p.shard)
            .or_default()
            .push(p.chunk_id.clone());
    }
    let plan = read_plan(rt);
    let plan = &plan;
    let shards = &rt.services.shards;
    let loads = by_shard.into_iter().map(|(shard, ids)| async move {
        let nodes = plan
            .replicas
            .get(shard as usize)
            .map(|s| &s.nodes[..])
            .unwrap_or(&[]);
        let first = shards
            .routing()
            .read_target(plan.collection, shard, nodes, plan.consistency);
        shards.chunks(plan, shard, &first, ids, true).await
    });
    let mut out = HashMap::new();
    for r in join_all(loads).await {
        for c in r? {
            out.insert(c.chunk_id, c.embedding);
        }
    }
    Ok(out)
}

/// Maximal marginal relevance: λ·sim(q, d) − (1 − λ)·max sim(d, selected).
async fn mmr(
    rt: &Run,
    query: &str,
    ps: Vec<Passage>,
    lambda: f32,
    keep: usize,
) -> Result<Vec<Passage>> {
    if ps.len() <= 1 {
        return Ok(ps);
    }
    let q = llm::embed(rt, vec![query.to_owned()], EmbedInput::Query)
        .await?
        .pop()
        .unwrap_or_default();
    let vecs = stored_vectors(rt, &ps).await?;
    let v: Vec<&[f32]> = ps
        .iter()
        .map(|p| vecs.get(&p.chunk_id).map_or(&[][..], Vec::as_slice))
        .collect();
    let rel: Vec<f32> = v.iter().map(|d| cosine(&q, d)).collect();
    let mut chosen: Vec<usize> = Vec::new();
    let mut left: Vec<usize> = (0..ps.len()).collect();
    while chosen.len() < keep && !left.is_empty() {
        let (pos, _) = left
            .iter()
            .enumerate()
            .map(|(pos, &i)| {
                let red = chosen
                    .iter()
                    .map(|&j| cosine(v[i], v[j]))
                    .fold(f32::NEG_INFINITY, f32::max);
                let red = if chosen.is_empty() { 0.0 } else { red };
                (pos, lambda * rel[i] - (1.0 - lambda) * red)
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, 0.0));
        chosen.push(left.remove(pos));
    }
    Ok(chosen
        .into_iter()
        .map(|i| Passage {
            score: rel[i],
            ..ps[i].clone()
        })
        .collect())
}

/// AutoRAG's prev-next augmenter: each passage is joined by its neighbours in the document
/// (previous ones before it, next ones after it), with its score; duplicates are skipped.
async fn prev_next(rt: &Run, ps: Vec<Passage>, before: u32, after: u32) -> Result<Vec<Passage>> {
    let plan = read_plan(rt);
    let plan = &plan;
    let loads = ps.iter().map(|p| {
        rt.services
            .shards
            .neighbours(plan, p.shard, &p.chunk_id, before, after)
    });
    let results = join_all(loads).await;
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (p, r) in ps.iter().zip(results) {
        let mut group: Vec<Passage> = r?
            .into_iter()
            .map(|c| Passage {
                chunk_id: c.chunk_id,
                doc_id: c.doc_id,
                title: c.title,
                section: c.section,
                text: c.text,
                score: p.score,
                shard: p.shard,
                position: c.position,
            })
            .collect();
        if !group.iter().any(|g| g.chunk_id == p.chunk_id) {
            group.push(p.clone());
        }
        group.sort_by_key(|g| g.position);
        for g in group {
            if seen.insert(g.chunk_id.clone()) {
                out.push(g);
            }
        }
    }
    Ok(out)
}

/// Extractive compression: the sentences most similar to the query, within a token budget,
/// kept in document order; passages left without a sentence are dropped.
async fn compress(rt: &Run, query: &str, ps: Vec<Passage>, budget: usize) -> Result<Vec<Passage>> {
    use unicode_segmentation::UnicodeSegmentation;
    let mut sents: Vec<(usize, String)> = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        for s in p.text.split_sentence_bounds() {
            if !s.trim().is_empty() {
                sents.push((i, s.to_owned()));
            }
        }
    }
    if sents.is_empty() {
        return Ok(ps);
    }
    sents.truncate(255);
    let mut vecs = llm::embed(rt, vec![query.to_owned()], EmbedInput::Query).await?;
    let texts = sents.iter().map(|(_, s)| s.clone()).collect();
    vecs.extend(llm::embed(rt, texts, EmbedInput::Document).await?);
    let mut order: Vec<(usize, f32)> = (0..sents.len())
        .map(|k| (k, cosine(&vecs[0], &vecs[k + 1])))
        .collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut keep = vec![false; sents.len()];
    let mut used = 0;
    for (k, _) in order {
        let n = rt.services.tokens.spans(&sents[k].1).len();
        if used + n > budget && used > 0 {
            continue;
        }
        used += n;
        keep[k] = true;
    }
    let mut out = Vec::new();
    for (i, p) in ps.into_iter().enumerate() {
        let text: String = sents
            .iter()
            .zip(&keep)
            .filter(|((j, _), k)| *j == i && **k)
            .map(|((_, s), _)| s.as_str())
            .collect();
        if !text.trim().is_empty() {
            out.push(Passage {
                text: text.trim().to_owned(),
                ..p
            });
        }
    }
    Ok(out)
}

pub fn reorder(c: &mut Vec<Passage>, m: ReorderMode) {
    sort_desc(c);
    match m {
        ReorderMode::BestFirst => {}
        ReorderMode::BestLast => c.reverse(),
        ReorderMode::LongContext => {
            // Ranks 1, 3, 5, ... from the front, 2, 4, 6, ... from the back.
            let mut front = Vec::new();
            let mut back = Vec::new();
            for (i, p) in c.drain(..).enumerate() {
                if i % 2 == 0 {
                    front.push(p);
                } else {
                    back.push(p);
                }
            }
            back.reverse();
            front.extend(back);
            *c = front;
        }
    }
}

/// A reranker's scores fused with the scores the chunks came with, as AutoRAG's convex
/// combination (§2.2, CC): `w`·φ_MM(rerank) + (1 − `w`)·φ_MM(retrieval), each min-max
/// normalised over the candidates (`fusion::min_max`). A small reranker's judgement alone can
/// be worse than the first stage's order; blended, it only moves what it is sure of.
fn blend_scores(scored: &mut [(Passage, f32)], w: f32) {
    let first: Vec<f32> = scored.iter().map(|(c, _)| c.score).collect();
    let rerank: Vec<f32> = scored.iter().map(|(_, s)| *s).collect();
    let (first, rerank) = (min_max(&first), min_max(&rerank));
    for (((_, s), f), r) in scored.iter_mut().zip(first).zip(rerank) {
        *s = w * r + (1.0 - w) * f;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: &str, score: f32) -> Passage {
        Passage::scored(id, score)
    }

    #[test]
    fn reorders() {
        let base: Vec<Passage> = (1..=5).map(|i| p(&i.to_string(), 1.0 / i as f32)).collect();
        let ids = |v: &[Passage]| {
            v.iter()
                .map(|c| c.chunk_id.clone())
                .collect::<Vec<_>>()
                .join("")
        };
        let mut c = base.clone();
        reorder(&mut c, ReorderMode::LongContext);
        assert_eq!(ids(&c), "13542");
        let mut c = base.clone();
        reorder(&mut c, ReorderMode::BestLast);
        assert_eq!(ids(&c), "54321");
    }

    #[test]
    fn blend_is_a_convex_combination_of_min_max_scores() {
        // First-stage scores 0.9 / 0.5 / 0.1 normalise to 1 / 0.5 / 0; reranker scores
        // 0.2 / 0.6 / 1.0 (logits, any range) to 0 / 0.5 / 1.
        let mut scored = vec![(p("a", 0.9), 0.2), (p("b", 0.5), 0.6), (p("c", 0.1), 1.0)];
        blend_scores(&mut scored, 0.25);
        let got: Vec<f32> = scored.iter().map(|(_, s)| *s).collect();
        for (g, want) in got.iter().zip([0.75, 0.5, 0.25]) {
            assert!((g - want).abs() < 1e-6, "{got:?}");
        }
        // Weight 1 is the reranker alone, weight 0 the first stage alone (normalised).
        let mut scored = vec![(p("a", 0.9), 0.2), (p("b", 0.5), 0.6)];
        blend_scores(&mut scored, 1.0);
        assert_eq!(scored[0].1, 0.0);
        assert_eq!(scored[1].1, 1.0);
        blend_scores(&mut scored, 0.0);
        assert_eq!(scored[0].1, 1.0);
        assert_eq!(scored[1].1, 0.0);
    }
}
