//! Hybrid fusion of a lexical (BM25) and a semantic (dense) ranked list, exactly as the AutoRAG
//! paper defines it (§2.2, "Hybrid RRF / CC / DBSF"):
//!
//! * RRF:  f(d) = 1/(η + π_LEX(d)) + 1/(η + π_SEM(d)), π the 1-based rank; a list that does not
//!   contain d contributes nothing.
//! * Convex: f(d) = α·φ_LEX(f_LEX(d)) + (1 − α)·φ_SEM(f_SEM(d)), α the lexical weight
//!   (UniversalRAG eq. 4 uses α = 0.2; our default is 0.5, see `search`). A list that does not contain d
//!   contributes 0 (the bottom of its normalised range).
//!   - CC:   φ_MM(x) = (x − m)/(M − m), m and M the list's min and max.
//!   - DBSF: φ_ts(x) = (x − (μ − 3σ)) / ((μ + 3σ) − (μ − 3σ)), μ and σ the list's mean and
//!     (population) standard deviation.
//!
//! A degenerate list (M = m, or σ = 0) normalises every score to 1.
//!
//! Lists are normalised over the candidates each retriever returned for the query.

use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fusion {
    Rrf {
        k: f32,
    },
    /// `lex_weight` = α.
    Cc {
        lex_weight: f32,
    },
    Dbsf {
        lex_weight: f32,
    },
}

/// One retriever's result for a query, best first.
#[derive(Debug, Clone)]
pub struct Ranked {
    pub id: String,
    pub score: f32,
}

/// A fused entry: the id, the fused score, and (rank, raw score) in each input list.
#[derive(Debug, Clone, PartialEq)]
pub struct Fused {
    pub id: String,
    pub score: f32,
    pub lex: Option<(u32, f32)>,
    pub sem: Option<(u32, f32)>,
}

pub fn min_max(scores: &[f32]) -> Vec<f32> {
    let (m, mx) = scores
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &s| {
            (a.min(s), b.max(s))
        });
    let range = mx - m;
    scores
        .iter()
        .map(|&s| if range > 0.0 { (s - m) / range } else { 1.0 })
        .collect()
}

pub fn three_sigma(scores: &[f32]) -> Vec<f32> {
    let n = scores.len() as f64;
    if n == 0.0 {
        return Vec::new();
    }
    let mean = scores.iter().map(|&s| f64::from(s)).sum::<f64>() / n;
    let var = scores
        .iter()
        .map(|&s| (f64::from(s) - mean).powi(2))
        .sum::<f64>()
        / n;
    let sd = var.sqrt();
    let (lo, hi) = (mean - 3.0 * sd, mean + 3.0 * sd);
    scores
        .iter()
        .map(|&s| {
            if hi > lo {
                ((f64::from(s) - lo) / (hi - lo)) as f32
            } else {
                1.0
            }
        })
        .collect()
}

/// Fuses two ranked lists and returns the best `top_k`, ties broken by id for determinism.
pub fn fuse(lex: &[Ranked], sem: &[Ranked], how: Fusion, top_k: usize) -> Vec<Fused> {
    let mut acc: HashMap<String, Fused> = HashMap::new();
    let mut add = |list: &[Ranked], is_lex: bool, contrib: &dyn Fn(usize) -> f32| {
        for (i, r) in list.iter().enumerate() {
            let e = acc.entry(r.id.clone()).or_insert_with(|| Fused {
                id: r.id.clone(),
                score: 0.0,
                lex: None,
                sem: None,
            });
            e.score += contrib(i);
            let slot = Some((i as u32 + 1, r.score));
            if is_lex { e.lex = slot } else { e.sem = slot }
        }
    };
    match how {
        Fusion::Rrf { k } => {
            add(lex, true, &|i| 1.0 / (k + (i + 1) as f32));
            add(sem, false, &|i| 1.0 / (k + (i + 1) as f32));
        }
        Fusion::Cc { lex_weight } | Fusion::Dbsf { lex_weight } => {
            let norm = |l: &[Ranked]| {
                let s: Vec<f32> = l.iter().map(|r| r.score).collect();
                if matches!(how, Fusion::Cc { .. }) {
                    min_max(&s)
                } else {
                    three_sigma(&s)
                }
            };
            let (nl, ns) = (norm(lex), norm(sem));
            add(lex, true, &|i| lex_weight * nl[i]);
            add(sem, false, &|i| (1.0 - lex_weight) * ns[i]);
        }
    }
    let mut out: Vec<Fused> = acc.into_values().collect();
    out.sort_by(|a, b| b.score.total_cmp(&a.score).then_with(|| a.id.cmp(&b.id)));
    out.truncate(top_k);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(v: &[(&str, f32)]) -> Vec<Ranked> {
        v.iter()
            .map(|(id, s)| Ranked {
                id: id.to_string(),
                score: *s,
            })
            .collect()
    }

    fn close(a: f32, b: f32) {
        assert!((a - b).abs() < 1e-6, "{a} != {b}");
    }

    #[test]
    fn rrf_by_hand() {
        // η = 60. a: lex rank 1, sem rank 2; b: lex rank 2; c: sem rank 1.
        let f = fuse(
            &list(&[("a", 9.0), ("b", 3.0)]),
            &list(&[("c", 0.9), ("a", 0.8)]),
            Fusion::Rrf { k: 60.0 },
            10,
        );
        close(f[0].score, 1.0 / 61.0 + 1.0 / 62.0);
        assert_eq!(f[0].id, "a");
        assert_eq!(f[0].lex, Some((1, 9.0)));
        assert_eq!(f[0].sem, Some((2, 0.8)));
        // b and c tie at 1/62 vs 1/61: c (sem rank 1) first.
        assert_eq!(f[1].id, "c");
        close(f[1].score, 1.0 / 61.0);
        close(f[2].score, 1.0 / 62.0);
    }

    #[test]
    fn cc_min_max_by_hand() {
        // lex scores 10, 6, 2 -> 1, .5, 0; sem .9, .5 -> 1, 0; α = .2.
        let f = fuse(
            &list(&[("a", 10.0), ("b", 6.0), ("c", 2.0)]),
            &list(&[("b", 0.9), ("d", 0.5)]),
            Fusion::Cc { lex_weight: 0.2 },
            10,
        );
        let get = |id: &str| f.iter().find(|x| x.id == id).unwrap().score;
        close(get("b"), 0.2 * 0.5 + 0.8 * 1.0);
        close(get("a"), 0.2);
        close(get("c"), 0.0);
        close(get("d"), 0.0);
        assert_eq!(f[0].id, "b");
    }

    #[test]
    fn dbsf_three_sigma_by_hand() {
        // scores 1, 2, 3: μ = 2, σ = sqrt(2/3); bounds 2 ± 3σ.
        let s = three_sigma(&[1.0, 2.0, 3.0]);
        let sd = (2.0f64 / 3.0).sqrt();
        let (lo, hi) = (2.0 - 3.0 * sd, 2.0 + 3.0 * sd);
        close(s[0], ((1.0 - lo) / (hi - lo)) as f32);
        close(s[1], 0.5);
        close(s[2], ((3.0 - lo) / (hi - lo)) as f32);
        let f = fuse(
            &list(&[("a", 3.0), ("b", 2.0), ("c", 1.0)]),
            &list(&[("c", 0.7)]),
            Fusion::Dbsf { lex_weight: 0.5 },
            2,
        );
        assert_eq!(f.len(), 2);
        // c: 0.5·φ(1) + 0.5·1 (a single-score list is degenerate -> 1) beats a: 0.5·φ(3).
        assert_eq!(f[0].id, "c");
        assert_eq!(f[1].id, "a");
        close(f[1].score, 0.5 * s[2]);
        close(f[0].score, 0.5 * s[0] + 0.5);
    }

    #[test]
    fn degenerate_lists_normalise_to_one() {
        assert_eq!(min_max(&[4.0, 4.0]), vec![1.0, 1.0]);
        assert_eq!(three_sigma(&[4.0]), vec![1.0]);
        assert!(fuse(&[], &[], Fusion::Rrf { k: 60.0 }, 5).is_empty());
    }
}
