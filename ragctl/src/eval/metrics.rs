//! Retrieval metrics over a ranked list of document ids and graded qrels, computed as
//! trec_eval does (what BEIR and pytrec_eval report), plus the AutoRAG seed's context
//! precision. A document is relevant when its grade is > 0.

use std::collections::HashMap;

/// Graded relevance of one query: doc id -> grade.
pub type Rels = HashMap<String, u32>;

fn grade(rels: &Rels, d: &str) -> u32 {
    rels.get(d).copied().unwrap_or(0)
}

fn relevant(rels: &Rels) -> usize {
    rels.values().filter(|&&r| r > 0).count()
}

/// nDCG@k with gain = grade and a log2(rank + 1) discount (trec_eval `ndcg_cut_k`).
pub fn ndcg_at(ranked: &[String], rels: &Rels, k: usize) -> f64 {
    let dcg: f64 = ranked
        .iter()
        .take(k)
        .enumerate()
        .map(|(i, d)| f64::from(grade(rels, d)) / ((i + 2) as f64).log2())
        .sum();
    let mut ideal: Vec<u32> = rels.values().copied().filter(|&r| r > 0).collect();
    ideal.sort_unstable_by(|a, b| b.cmp(a));
    let idcg: f64 = ideal
        .iter()
        .take(k)
        .enumerate()
        .map(|(i, &r)| f64::from(r) / ((i + 2) as f64).log2())
        .sum();
    if idcg == 0.0 { 0.0 } else { dcg / idcg }
}

/// Share of the relevant documents found in the first k (trec_eval `recall_k`).
pub fn recall_at(ranked: &[String], rels: &Rels, k: usize) -> f64 {
    let n = relevant(rels);
    if n == 0 {
        return 0.0;
    }
    let found = ranked.iter().take(k).filter(|d| grade(rels, d) > 0).count();
    found as f64 / n as f64
}

/// Share of the first k that is relevant, k fixed even when fewer were retrieved
/// (trec_eval `P_k`).
pub fn precision_at(ranked: &[String], rels: &Rels, k: usize) -> f64 {
    if k == 0 {
        return 0.0;
    }
    let found = ranked.iter().take(k).filter(|d| grade(rels, d) > 0).count();
    found as f64 / k as f64
}

/// Reciprocal rank of the first relevant document within the first k, else 0
/// (trec_eval `recip_rank` on a run cut at k).
pub fn mrr_at(ranked: &[String], rels: &Rels, k: usize) -> f64 {
    ranked
        .iter()
        .take(k)
        .position(|d| grade(rels, d) > 0)
        .map_or(0.0, |i| 1.0 / (i + 1) as f64)
}

/// Average precision over the first k: the sum of precision@rank at every relevant rank
/// <= k, divided by the number of relevant documents (trec_eval `map_cut_k`).
pub fn map_at(ranked: &[String], rels: &Rels, k: usize) -> f64 {
    let n = relevant(rels);
    if n == 0 {
        return 0.0;
    }
    let mut hits = 0;
    let mut sum = 0.0;
    for (i, d) in ranked.iter().take(k).enumerate() {
        if grade(rels, d) > 0 {
            hits += 1;
            sum += f64::from(hits) / (i + 1) as f64;
        }
    }
    sum / n as f64
}

/// Context precision@K as the AutoRAG seed defines it (Ragas):
/// `Σ_{k=1..K} (Precision@k × v_k) / true positives@K`, v_k = 1 when rank k is relevant
/// (here the qrels are the relevance oracle instead of an LLM), 0 when nothing relevant was
/// retrieved.
pub fn context_precision_at(ranked: &[String], rels: &Rels, k: usize) -> f64 {
    let mut tp = 0;
    let mut sum = 0.0;
    for (i, d) in ranked.iter().take(k).enumerate() {
        if grade(rels, d) > 0 {
            tp += 1;
            sum += f64::from(tp) / (i + 1) as f64;
        }
    }
    if tp == 0 { 0.0 } else { sum / f64::from(tp) }
}

/// Chunk hits to a document ranking: each document at the rank of its best chunk.
pub fn doc_ranking<'a>(chunk_doc_ids: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    chunk_doc_ids
        .into_iter()
        .filter(|d| seen.insert(*d))
        .map(str::to_owned)
        .collect()
}

/// The metrics `ragctl eval retrieval` reports for one query, by name.
pub fn all(ranked: &[String], rels: &Rels, cp_k: usize) -> Vec<(String, f64)> {
    vec![
        ("ndcg@10".into(), ndcg_at(ranked, rels, 10)),
        ("recall@10".into(), recall_at(ranked, rels, 10)),
        ("recall@100".into(), recall_at(ranked, rels, 100)),
        ("mrr@10".into(), mrr_at(ranked, rels, 10)),
        ("map@100".into(), map_at(ranked, rels, 100)),
        ("p@10".into(), precision_at(ranked, rels, 10)),
        (
            format!("context_precision@{cp_k}"),
            context_precision_at(ranked, rels, cp_k),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }

    #[test]
    fn binary_relevance_by_hand() {
        let rels: Rels = [
            ("a".to_string(), 1),
            ("b".to_string(), 1),
            ("c".to_string(), 0),
        ]
        .into();
        let r = run(&["x", "a", "c", "b", "y"]);
        // DCG = 1/log2(3) + 1/log2(5); IDCG = 1 + 1/log2(3).
        close(
            ndcg_at(&r, &rels, 10),
            (1.0 / 3f64.log2() + 1.0 / 5f64.log2()) / (1.0 + 1.0 / 3f64.log2()),
        );
        close(recall_at(&r, &rels, 2), 0.5);
        close(recall_at(&r, &rels, 4), 1.0);
        close(precision_at(&r, &rels, 4), 0.5);
        close(precision_at(&r, &rels, 10), 0.2);
        close(mrr_at(&r, &rels, 10), 0.5);
        close(mrr_at(&r, &rels, 1), 0.0);
        // AP = (1/2 + 2/4) / 2.
        close(map_at(&r, &rels, 100), 0.5);
        close(map_at(&r, &rels, 3), 0.25);
        // CP@5 = (P@2·1 + P@4·1) / 2 = (1/2 + 2/4) / 2.
        close(context_precision_at(&r, &rels, 5), 0.5);
        close(context_precision_at(&r, &rels, 1), 0.0);
        // Only missing relevants lower MAP; context precision ignores them.
        let rels3: Rels = [("a".to_string(), 1), ("z".to_string(), 1)].into();
        let r = run(&["a"]);
        close(map_at(&r, &rels3, 100), 0.5);
        close(context_precision_at(&r, &rels3, 10), 1.0);
    }

    #[test]
    fn graded_ndcg_by_hand() {
        let rels: Rels = [("a".to_string(), 2), ("b".to_string(), 1)].into();
        let r = run(&["b", "a"]);
        // DCG = 1 + 2/log2(3); IDCG = 2 + 1/log2(3).
        close(
            ndcg_at(&r, &rels, 10),
            (1.0 + 2.0 / 3f64.log2()) / (2.0 + 1.0 / 3f64.log2()),
        );
        assert_eq!(doc_ranking(["a", "b", "a", "c"]), vec!["a", "b", "c"]);
        assert_eq!(ndcg_at(&r, &Rels::new(), 10), 0.0);
    }
}
