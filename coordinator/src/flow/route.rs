//! Routing between flows, Modular RAG eq. 19-22.
//!
//! - Keyword (eq. 19): K' = the query's words that are routing keywords of some flow;
//!   score_key(q, F_j) = |K_j ∩ K'| / |K'| (0 when K' is empty).
//! - Semantic (eq. 21): P(θ | q) = softmax over all intents of cos(q, θ) / temperature (the
//!   embedding similarity standing in for P_LM); score_sem(q, F_j) = max over F_j's intents.
//! - Hybrid (eq. 22): α_j = a · score_key + (1 − a) · score_sem.
//!
//! The flow with the highest score wins (eq. 20); when every score is 0 the route's default
//! (or its first target) runs.
//!
//! - Form: the first target whose form (yes/no or other) the question has; pipelines differ
//!   by "the nature of the question" (Modular RAG, §conditional pattern), and a yes/no
//!   question is one a reader either gets right in one word or not.

use std::collections::{HashMap, HashSet};

use parking_lot::Mutex;
use unicode_segmentation::UnicodeSegmentation;

use super::spec::{QuestionForm, RouteTarget};
use ragcluster_common::prompt::is_yes_no_question;

/// The form of `question`.
pub fn form_of(question: &str) -> QuestionForm {
    if is_yes_no_question(question) {
        QuestionForm::YesNo
    } else {
        QuestionForm::Other
    }
}

/// The first target for a question of `form`, if any names it.
pub fn form_target(form: QuestionForm, routes: &[RouteTarget]) -> Option<usize> {
    routes.iter().position(|r| r.form == Some(form))
}

/// Embeddings of intent descriptions, by (model, text): computed once per coordinator.
#[derive(Default)]
pub struct IntentCache(pub Mutex<HashMap<(String, String), Vec<f32>>>);

/// Eq. 19 for every target.
pub fn keyword_scores(query: &str, routes: &[RouteTarget]) -> Vec<f32> {
    let q = query.to_lowercase();
    let words: HashSet<&str> = q.unicode_words().collect();
    // A multi-word keyword matches as a phrase.
    let hit = |k: &str| {
        if k.contains(' ') {
            q.contains(k)
        } else {
            words.contains(k)
        }
    };
    let found: HashSet<&str> = routes
        .iter()
        .flat_map(|r| r.keywords.iter())
        .map(String::as_str)
        .filter(|k| hit(k))
        .collect();
    if found.is_empty() {
        return vec![0.0; routes.len()];
    }
    routes
        .iter()
        .map(|r| {
            let own: HashSet<&str> = r.keywords.iter().map(String::as_str).collect();
            own.intersection(&found).count() as f32 / found.len() as f32
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(1e-12)
}

/// Eq. 21 for every target, from the query vector and each target's intent vectors.
pub fn semantic_scores(q: &[f32], intents: &[Vec<Vec<f32>>], temperature: f32) -> Vec<f32> {
    let sims: Vec<Vec<f32>> = intents
        .iter()
        .map(|vs| vs.iter().map(|v| cosine(q, v) / temperature).collect())
        .collect();
    let max = sims
        .iter()
        .flatten()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return vec![0.0; intents.len()];
    }
    let z: f32 = sims.iter().flatten().map(|s| (s - max).exp()).sum();
    sims.iter()
        .map(|vs| vs.iter().map(|s| (s - max).exp() / z).fold(0.0, f32::max))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(flow: &str, kw: &[&str]) -> RouteTarget {
        RouteTarget {
            flow: flow.into(),
            keywords: kw.iter().map(|s| s.to_string()).collect(),
            intents: Vec::new(),
            form: None,
        }
    }

    #[test]
    fn form_routes_yes_no_questions_apart() {
        let mut yes_no = t("strong", &[]);
        yes_no.form = Some(QuestionForm::YesNo);
        let mut other = t("fast", &[]);
        other.form = Some(QuestionForm::Other);
        let routes = [yes_no, other];
        assert_eq!(
            form_target(form_of("Is Helsinki the capital of Finland?"), &routes),
            Some(0)
        );
        assert_eq!(
            form_target(form_of("In 1796, did he marry?"), &routes),
            Some(0)
        );
        assert_eq!(
            form_target(form_of("What is the capital of Finland?"), &routes),
            Some(1)
        );
        // No target for the form: the route's default decides.
        assert_eq!(form_target(form_of("Who won?"), &routes[..1]), None);
    }

    #[test]
    fn eq19_keyword_overlap() {
        let routes = [
            t("a", &["bm25", "k1", "term frequency"]),
            t("b", &["raft", "k1"]),
        ];
        // K' = {bm25, k1, term frequency}: a has 3/3, b 1/3.
        let s = keyword_scores("How do BM25's k1 and term frequency interact?", &routes);
        assert_eq!(s, vec![1.0, 1.0 / 3.0]);
        assert_eq!(keyword_scores("nothing here", &routes), vec![0.0, 0.0]);
    }

    #[test]
    fn eq21_softmax_over_intents() {
        let q = vec![1.0, 0.0];
        let intents = vec![vec![vec![1.0, 0.0]], vec![vec![0.0, 1.0], vec![0.6, 0.8]]];
        let s = semantic_scores(&q, &intents, 1.0);
        let z = 1f32.exp() + 0f32.exp() + 0.6f32.exp();
        assert!((s[0] - 1f32.exp() / z).abs() < 1e-6);
        assert!((s[1] - 0.6f32.exp() / z).abs() < 1e-6);
    }
}
