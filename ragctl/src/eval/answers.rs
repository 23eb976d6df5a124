//! Answer metrics from the seeds: ROUGE-L (AutoRAG), SQuAD-style token F1, SemScore (cosine
//! of answer and gold embeddings, UniversalRAG eq. 6), UniversalRAG's key-fact score
//! (eq. 5) and final score S = 0.4·S_cos + 0.6·S_key (eq. 7, averaged over questions by
//! eq. 8), and citation precision (cited chunks that are relevant); SQuAD exact match and
//! token F1 taken as the best over every gold answer, yes/no accuracy, and the paragraph of a
//! gold article an oracle reader is given.

use std::collections::{HashMap, HashSet};

use serde::Deserialize;

/// One line of a QA file (`ragctl eval answers --qa FILE`, JSON lines).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct QaItem {
    #[serde(default)]
    pub id: String,
    pub question: String,
    /// The gold answer.
    pub answer: String,
    /// Every acceptable gold answer (SQuAD style: a prediction scores its best match); empty
    /// = `answer` alone.
    #[serde(default)]
    pub answers: Vec<String>,
    /// A yes/no question: scored by the yes or no the answer starts with, not by overlap.
    #[serde(default)]
    pub yes_no: bool,
    /// Key fact phrases for S_key; none = S_key is not reported for this item.
    #[serde(default)]
    pub key_facts: Vec<String>,
    /// Relevant chunks / documents for citation precision.
    #[serde(default)]
    pub gold_chunk_ids: Vec<String>,
    #[serde(default)]
    pub gold_doc_ids: Vec<String>,
}

impl QaItem {
    /// The gold answers a prediction is scored against.
    pub fn golds(&self) -> Vec<&str> {
        if self.answers.is_empty() {
            vec![self.answer.as_str()]
        } else {
            self.answers.iter().map(String::as_str).collect()
        }
    }

    /// The gold yes/no of a yes/no question: that of the first gold answer giving one.
    pub fn gold_yes_no(&self) -> Option<bool> {
        if !self.yes_no {
            return None;
        }
        self.golds().into_iter().find_map(yes_no)
    }
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

/// SQuAD exact match: 1 when the normalised answers are equal.
pub fn exact_match(candidate: &str, reference: &str) -> f64 {
    if squad_tokens(candidate) == squad_tokens(reference) {
        1.0
    } else {
        0.0
    }
}

/// The best score of `candidate` over the gold answers (SQuAD's `metric_max_over_ground_truths`).
pub fn best_over(golds: &[&str], candidate: &str, metric: fn(&str, &str) -> f64) -> f64 {
    golds
        .iter()
        .map(|g| metric(candidate, g))
        .fold(0.0, f64::max)
}

/// The yes or no an answer starts with ("Yes, he did." is yes); `None` for anything else.
pub fn yes_no(answer: &str) -> Option<bool> {
    match squad_tokens(answer).first().map(String::as_str) {
        Some("yes") => Some(true),
        Some("no") => Some(false),
        _ => None,
    }
}

/// The answer without its citation markers (`[1]`, `[1, 3]`, `[chunk 2]`), which are not part
/// of what is scored against the gold text.
pub fn strip_citations(answer: &str) -> String {
    let mut out = String::with_capacity(answer.len());
    let mut last = 0;
    for (_, start, end) in ragcluster_common::prompt::citation_markers(answer) {
        out.push_str(&answer[last..start]);
        last = end;
    }
    out.push_str(&answer[last..]);
    out.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace(" .", ".")
        .replace(" ,", ",")
}

/// The paragraph of a gold article an oracle reader gets: for a short-answer question the
/// first paragraph holding a gold answer; otherwise (yes/no, or an answer not found
/// verbatim) the paragraph sharing the most informative words with the question and gold
/// answers (each word weighted by ln((paragraphs + 1) / paragraphs holding it)).
pub fn oracle_paragraph<'a>(article: &'a str, item: &QaItem) -> &'a str {
    let paras: Vec<&str> = article
        .split("\n\n")
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    if paras.is_empty() {
        return article.trim();
    }
    if !item.yes_no {
        for g in item.golds() {
            let g = squash(g.trim_end_matches(['.', ',', ';', ':', '!', '?', '"', '\'']));
            if g.len() < 2 {
                continue;
            }
            if let Some(p) = paras.iter().find(|p| squash(p).contains(&g)) {
                return p;
            }
        }
    }
    let sets: Vec<HashSet<String>> = paras
        .iter()
        .map(|p| squad_tokens(p).into_iter().collect())
        .collect();
    let mut words: HashSet<String> = squad_tokens(&item.question).into_iter().collect();
    if !item.yes_no {
        for g in item.golds() {
            words.extend(squad_tokens(g));
        }
    }
    let n = paras.len() as f64;
    let weight = |w: &String| {
        let df = sets.iter().filter(|s| s.contains(w)).count() as f64;
        if df == 0.0 {
            0.0
        } else {
            ((n + 1.0) / df).ln()
        }
    };
    let weights: Vec<(&String, f64)> = words.iter().map(|w| (w, weight(w))).collect();
    let mut best = (0, f64::MIN);
    for (i, s) in sets.iter().enumerate() {
        let score: f64 = weights
            .iter()
            .filter(|(w, _)| s.contains(*w))
            .map(|(_, x)| x)
            .sum();
        if score > best.1 {
            best = (i, score);
        }
    }
    paras[best.0]
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
            gold_chunk_ids: vec!["d#1".into()],
            gold_doc_ids: vec!["e".into()],
            ..Default::default()
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

    #[test]
    fn squad_scores_take_the_best_gold_and_ignore_citations() {
        let item = QaItem {
            answer: "Wellington".into(),
            answers: vec!["Wellington".into(), "the city of Wellington".into()],
            ..Default::default()
        };
        let answer = strip_citations("The city of Wellington [2].");
        assert_eq!(answer, "The city of Wellington.");
        close(best_over(&item.golds(), &answer, exact_match), 1.0);
        close(exact_match("Wellington", "wellington!"), 1.0);
        close(exact_match("in Wellington", "Wellington"), 0.0);
        close(
            best_over(&item.golds(), "Wellington, New Zealand", token_f1),
            0.5,
        );
        // Brackets that are not markers stay.
        assert_eq!(
            strip_citations("x [a note] y [1, 3] z [chunk 2]"),
            "x [a note] y z"
        );
    }

    #[test]
    fn yes_no_is_the_first_word() {
        assert_eq!(yes_no("Yes, he did [1]."), Some(true));
        assert_eq!(yes_no("no."), Some(false));
        assert_eq!(yes_no("Nobody knows"), None);
        let item = QaItem {
            answer: "Yes, in 1863.".into(),
            yes_no: true,
            ..Default::default()
        };
        assert_eq!(item.gold_yes_no(), Some(true));
        assert_eq!(QaItem::default().gold_yes_no(), None);
    }

    #[test]
    fn the_oracle_paragraph_holds_the_answer_or_shares_the_rarest_words() {
        let article = "Kangaroos live in Australia.\n\nThe red kangaroo is the largest marsupial.\n\n\
                       Kangaroos eat grass and live in mobs.";
        let short = QaItem {
            question: "What is the largest marsupial?".into(),
            answer: "The red kangaroo.".into(),
            ..Default::default()
        };
        assert_eq!(
            oracle_paragraph(article, &short),
            "The red kangaroo is the largest marsupial."
        );
        let yn = QaItem {
            question: "Do kangaroos eat grass?".into(),
            answer: "yes".into(),
            yes_no: true,
            ..Default::default()
        };
        assert_eq!(
            oracle_paragraph(article, &yn),
            "Kangaroos eat grass and live in mobs."
        );
        assert_eq!(oracle_paragraph("  one paragraph ", &yn), "one paragraph");
    }
}
