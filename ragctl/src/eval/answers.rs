//! Answer metrics from the seeds: ROUGE-L (AutoRAG), SQuAD-style token F1, SemScore (cosine
//! of answer and gold embeddings, UniversalRAG eq. 6), UniversalRAG's key-fact score
//! (eq. 5) and final score S = 0.4·S_cos + 0.6·S_key (eq. 7, averaged over questions by
//! eq. 8), and citation precision (cited chunks that are relevant).

use std::collections::{HashMap, HashSet};

use serde::Deserialize;

/// One line of a QA file (`ragctl eval answers --qa FILE`, JSON lines).
#[derive(Debug, Clone, Deserialize)]
pub struct QaItem {
    pub question: String,
    /// The gold answer.
    pub answer: String,
    /// Key fact phrases for S_key; none = S_key is not reported for this item.
    #[serde(default)]
    pub key_facts: Vec<String>,
    /// Relevant chunks / documents for citation precision.
    #[serde(default)]
    pub gold_chunk_ids: Vec<String>,
    #[serde(default)]
    pub gold_doc_ids: Vec<String>,
}

/// Lower-cased alphanumeric tokens (the rouge-score tokenizer without stemming).
fn rouge_tokens(s: &str) -> Vec<String> {
    s.to_lowercase()
        .split(|c: char| !c.is_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect()
}

/// ROUGE-L F1: LCS of the token sequences, F = 2PR / (P + R).
pub fn rouge_l(candidate: &str, reference: &str) -> f64 {
    let (c, r) = (rouge_tokens(candidate), rouge_tokens(reference));
    if c.is_empty() || r.is_empty() {
        return 0.0;
    }
    let mut prev = vec![0usize; r.len() + 1];
    for a in &c {
        let mut cur = vec![0usize; r.len() + 1];
        for (j, b) in r.iter().enumerate() {
            cur[j + 1] = if a == b {
                prev[j] + 1
            } else {
                cur[j].max(prev[j + 1])
            };
        }
        prev = cur;
    }
    let lcs = prev[r.len()] as f64;
    if lcs == 0.0 {
        return 0.0;
    }
    let (p, rec) = (lcs / c.len() as f64, lcs / r.len() as f64);
    2.0 * p * rec / (p + rec)
}

/// SQuAD normalisation: lower case, punctuation and the articles a / an / the removed.
fn squad_tokens(s: &str) -> Vec<String> {
    s.to_lowercase()
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c.is_whitespace() {
                c
            } else {
                ' '
            }
        })
        .collect::<String>()
        .split_whitespace()
        .filter(|t| !matches!(*t, "a" | "an" | "the"))
        .map(str::to_owned)
        .collect()
}

/// Token F1 over the multiset of normalised tokens (SQuAD's `f1_score`).
pub fn token_f1(candidate: &str, reference: &str) -> f64 {
    let (c, r) = (squad_tokens(candidate), squad_tokens(reference));
    if c.is_empty() || r.is_empty() {
        return if c == r { 1.0 } else { 0.0 };
    }
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for t in &r {
        *counts.entry(t).or_default() += 1;
    }
    let mut common = 0;
    for t in &c {
        if let Some(n) = counts.get_mut(t.as_str())
            && *n > 0
        {
            *n -= 1;
            common += 1;
        }
    }
    if common == 0 {
        return 0.0;
    }
    let (p, rec) = (
        f64::from(common) / c.len() as f64,
        f64::from(common) / r.len() as f64,
    );
    2.0 * p * rec / (p + rec)
}

fn squash(s: &str) -> String {
    s.to_lowercase()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Eq. 5: the share of key fact phrases present in the answer (case and spacing ignored).
pub fn key_fact_score(answer: &str, facts: &[String]) -> Option<f64> {
    if facts.is_empty() {
        return None;
    }
    let a = squash(answer);
    let hits = facts.iter().filter(|f| a.contains(&squash(f))).count();
    Some(hits as f64 / facts.len() as f64)
}

/// Eq. 6: cosine of the two embeddings.
pub fn sem_score(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}

/// Eq. 7: S_i = 0.4·S_cos + 0.6·S_key.
pub fn final_score(s_cos: f64, s_key: f64) -> f64 {
    0.4 * s_cos + 0.6 * s_key
}

/// Share of cited chunks that are relevant (by chunk id, or by document id); `None` when the
/// answer cites nothing or no gold is given.
pub fn citation_precision(cited: &[(String, String)], item: &QaItem) -> Option<f64> {
    if cited.is_empty() || (item.gold_chunk_ids.is_empty() && item.gold_doc_ids.is_empty()) {
        return None;
    }
    let chunks: HashSet<&str> = item.gold_chunk_ids.iter().map(String::as_str).collect();
    let docs: HashSet<&str> = item.gold_doc_ids.iter().map(String::as_str).collect();
    let ok = cited
        .iter()
        .filter(|(chunk, doc)| chunks.contains(chunk.as_str()) || docs.contains(doc.as_str()))
        .count();
    Some(ok as f64 / cited.len() as f64)
}

/// The 1-5 score of a G-Eval style judge reply: the first digit 1-5 in it.
pub fn judge_score(reply: &str) -> Option<u32> {
    reply
        .chars()
        .find_map(|c| c.to_digit(10).filter(|d| (1..=5).contains(d)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }

    #[test]
    fn rouge_and_f1_by_hand() {
        // LCS("the cat sat on mat", "the cat is on the mat") = the cat on mat = 4;
        // P = 4/5, R = 4/6.
        close(
            rouge_l("The cat sat on mat", "the cat is on the mat"),
            2.0 * 0.8 * (4.0 / 6.0) / (0.8 + 4.0 / 6.0),
        );
        close(rouge_l("", "x"), 0.0);
        // Articles and punctuation go: {cat, sat} vs {cat, is, on, mat}: common 1.
        close(
            token_f1("The cat, sat!", "a cat is on the mat"),
            2.0 * 0.5 * 0.25 / 0.75,
        );
        close(token_f1("Paris", "paris."), 1.0);
    }

    #[test]
    fn universalrag_scores_by_hand() {
        let facts = vec![
            "majority vote".to_string(),
            "Election  Timeout".to_string(),
            "term".to_string(),
        ];
        let s_key = key_fact_score(
            "A leader wins a MAJORITY vote after an election timeout.",
            &facts,
        )
        .unwrap();
        close(s_key, 2.0 / 3.0);
        assert_eq!(key_fact_score("x", &[]), None);
        close(sem_score(&[1.0, 0.0], &[1.0, 1.0]), 1.0 / 2f64.sqrt());
        close(final_score(0.5, 1.0), 0.8);
        let item = QaItem {
            question: "q".into(),
            answer: "a".into(),
            key_facts: vec![],
            gold_chunk_ids: vec!["d#1".into()],
            gold_doc_ids: vec!["e".into()],
        };
        let cited = vec![
            ("d#1".into(), "d".into()),
            ("e#0".into(), "e".into()),
            ("f#0".into(), "f".into()),
        ];
        close(citation_precision(&cited, &item).unwrap(), 2.0 / 3.0);
        assert_eq!(citation_precision(&[], &item), None);
        assert_eq!(judge_score("Score: 4/5"), Some(4));
        assert_eq!(judge_score("0 or 9"), None);
    }
}
