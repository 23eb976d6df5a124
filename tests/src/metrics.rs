//! Retrieval metrics as trec_eval / BEIR compute them (linear gain nDCG, recall at a cut-off).

use std::collections::HashMap;

/// nDCG@k with gain = relevance grade and log2(rank + 1) discount (trec_eval `ndcg_cut`).
pub fn ndcg_at(ranked_docs: &[String], rels: &HashMap<String, u32>, k: usize) -> f64 {
    let dcg: f64 = ranked_docs
        .iter()
        .take(k)
        .enumerate()
        .map(|(i, d)| f64::from(*rels.get(d).unwrap_or(&0)) / ((i + 2) as f64).log2())
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

/// Share of relevant documents found in the first k.
pub fn recall_at(ranked_docs: &[String], rels: &HashMap<String, u32>, k: usize) -> f64 {
    let relevant = rels.values().filter(|&&r| r > 0).count();
    if relevant == 0 {
        return 0.0;
    }
    let found = ranked_docs
        .iter()
        .take(k)
        .filter(|d| rels.get(*d).is_some_and(|&r| r > 0))
        .count();
    found as f64 / relevant as f64
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ndcg_and_recall_by_hand() {
        let rels: HashMap<String, u32> = [("a".to_string(), 1), ("b".to_string(), 1)].into();
        let run: Vec<String> = ["x", "a", "y", "b"].iter().map(|s| s.to_string()).collect();
        // DCG = 1/log2(3) + 1/log2(5); IDCG = 1 + 1/log2(3).
        let want = (1.0 / 3f64.log2() + 1.0 / 5f64.log2()) / (1.0 + 1.0 / 3f64.log2());
        assert!((ndcg_at(&run, &rels, 10) - want).abs() < 1e-12);
        assert_eq!(recall_at(&run, &rels, 2), 0.5);
        assert_eq!(recall_at(&run, &rels, 4), 1.0);
        assert_eq!(doc_ranking(["a", "b", "a", "c"]), vec!["a", "b", "c"]);
    }
}
