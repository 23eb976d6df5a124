//! Points that belong in a shard's dense index but are not in its HNSW graph yet, searched by
//! brute force beside the graph. They come from three places: a follower holding its writes
//! until it loads the leader's dump of them, a dump caught up at open, and a leader's
//! write-behind (a write is acknowledged once durable and searchable here; the index worker
//! inserts it into the graph when writes pause or room is needed), which is how ingest runs at
//! the speed of the rest of the pipeline instead of hnsw_rs's insert, as Qdrant's unindexed
//! segments and Milvus's growing segments do.
//!
//! Each point keeps the seq of the entry that wrote it, so the graph is known to hold every
//! point up to the seq before the oldest pending one (`graph_through`): a dump taken while
//! points are pending is labelled with that seq and caught up from the op log like any other.
//! The scan reads the points' int8 codes from one array (a quarter of the f32 bytes) and
//! rescores the best candidates with their f32 vectors, so returned scores are exact.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};

use super::distance::{OrdF32, dot};
use super::{Filter, Point, sq8};

/// Candidates kept from the int8 scan for f32 rescoring, at least (or `ef`, or 4 x top_k).
const RESCORE_MIN: usize = 64;

#[derive(Default)]
pub struct Pending {
    points: Vec<Point>,
    /// Seq of the entry that wrote each point, ascending.
    seqs: Vec<u64>,
    /// The points' codes back to back, `code_len` bytes each.
    codes: Vec<i8>,
    code_len: usize,
}

impl Pending {
    pub fn len(&self) -> usize {
        self.points.len()
    }

    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// Appends points written by the entry at `seq` (not older than any held).
    pub fn push(&mut self, points: Vec<Point>, seq: u64) {
        for p in points {
            let code = sq8::encode(&p.vector);
            if self.code_len == 0 {
                self.code_len = code.len();
            }
            // Vectors were validated against the shard's dimension; a mismatch would misalign
            // every later code, so such a point is scored at zero instead.
            if code.len() == self.code_len {
                self.codes.extend_from_slice(&code);
            } else {
                self.codes.resize(self.codes.len() + self.code_len, 0);
            }
            self.points.push(p);
            self.seqs.push(seq);
        }
    }

    /// The seq through which the graph holds every point: the one before the oldest pending
    /// point's, or `at` when none is pending.
    pub fn graph_through(&self, at: u64) -> u64 {
        self.seqs
            .first()
            .map_or(at, |s| s.saturating_sub(1).min(at))
    }

    /// The oldest points, at least `max` of them unless fewer are held, extended to the end of
    /// the last one's entry so the graph never holds half an entry (a dump labelled with
    /// `graph_through` then holds exactly the entries up to it).
    pub fn front(&self, max: usize) -> Vec<Point> {
        let mut n = max.min(self.len());
        while n > 0 && n < self.len() && self.seqs[n] == self.seqs[n - 1] {
            n += 1;
        }
        self.points[..n].to_vec()
    }

    /// Drops the `n` oldest points (after `front(..)` put them into the graph).
    pub fn drop_front(&mut self, n: usize) {
        let n = n.min(self.len());
        self.points.drain(..n);
        self.seqs.drain(..n);
        self.codes.drain(..n * self.code_len);
    }

    /// Drops the points of the given chunks (replaced or deleted before reaching the graph).
    pub fn drop_chunks(&mut self, ids: &HashSet<&str>) {
        let mut keep = 0;
        for i in 0..self.points.len() {
            if ids.contains(self.points[i].chunk_id.as_str()) {
                continue;
            }
            if keep != i {
                self.points.swap(keep, i);
                self.seqs[keep] = self.seqs[i];
                let (l, src) = (self.code_len, i * self.code_len);
                self.codes.copy_within(src..src + l, keep * l);
            }
            keep += 1;
        }
        self.points.truncate(keep);
        self.seqs.truncate(keep);
        self.codes.truncate(keep * self.code_len);
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }

    pub fn points(&self) -> &[Point] {
        &self.points
    }

    /// The `top_k` best points for `query` (its code `qcode`) that match `filter`, as (index,
    /// exact cosine), best first: the int8 scan keeps `max(ef, 4 top_k, 64)` candidates, which
    /// are rescored with their f32 vectors.
    pub fn search(
        &self,
        query: &[f32],
        qcode: &[i8],
        top_k: usize,
        ef: usize,
        filter: &Filter,
    ) -> Vec<(usize, f32)> {
        let keep = ef.max(4 * top_k).max(RESCORE_MIN);
        let matches = |i: usize| filter.is_empty() || filter.matches(&self.points[i].meta);
        let candidates: Vec<usize> = if self.len() <= keep || qcode.len() != self.code_len {
            (0..self.len()).filter(|&i| matches(i)).collect()
        } else {
            // Min-heap of the best `keep` approximate scores seen so far.
            let mut heap: BinaryHeap<Reverse<(OrdF32, usize)>> =
                BinaryHeap::with_capacity(keep + 1);
            for (i, code) in self.codes.chunks_exact(self.code_len).enumerate() {
                let s = sq8::dot(qcode, code);
                if heap.len() == keep && heap.peek().is_some_and(|m| s <= m.0.0.0) {
                    continue;
                }
                if !matches(i) {
                    continue;
                }
                heap.push(Reverse((OrdF32(s), i)));
                if heap.len() > keep {
                    heap.pop();
                }
            }
            heap.into_iter().map(|Reverse((_, i))| i).collect()
        };
        let mut scored: Vec<(usize, f32)> = candidates
            .into_iter()
            .map(|i| (i, dot(query, &self.points[i].vector).min(1.0)))
            .collect();
        scored.sort_by(|a, b| {
            b.1.total_cmp(&a.1)
                .then_with(|| self.points[a.0].chunk_id.cmp(&self.points[b.0].chunk_id))
        });
        scored.truncate(top_k);
        scored
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::filter::Value;

    fn unit(seed: u64, dim: usize) -> Vec<f32> {
        // A small LCG: deterministic, spread over the sphere well enough for ranking checks.
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut v: Vec<f32> = (0..dim)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect();
        super::super::distance::normalize(&mut v);
        v
    }

    fn point(i: u64, dim: usize) -> Point {
        Point {
            chunk_id: format!("c{i}"),
            doc_id: format!("d{i}"),
            vector: unit(i, dim),
            meta: vec![("parity".into(), Value::Keyword((i % 2).to_string()))],
        }
    }

    /// The int8 scan with f32 rescoring returns the exact top-k of a brute-force f32 scan.
    #[test]
    fn scan_matches_brute_force() {
        let dim = 48;
        let mut p = Pending::default();
        for s in 0..20u64 {
            p.push(
                (s * 100..s * 100 + 100).map(|i| point(i, dim)).collect(),
                s + 1,
            );
        }
        assert_eq!(p.len(), 2000);
        for q in 0..20u64 {
            let query = unit(10_000 + q, dim);
            let qcode = sq8::encode(&query);
            for filter in [Filter::default(), Filter::keywords([("parity", "1")])] {
                let got = p.search(&query, &qcode, 10, 16, &filter);
                let mut exact: Vec<(usize, f32)> = (0..p.len())
                    .filter(|&i| filter.is_empty() || i % 2 == 1)
                    .map(|i| (i, dot(&query, &p.points[i].vector).min(1.0)))
                    .collect();
                exact.sort_by(|a, b| b.1.total_cmp(&a.1));
                exact.truncate(10);
                let ids = |v: &[(usize, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
                assert_eq!(ids(&got), ids(&exact), "query {q}, filter {filter:?}");
            }
        }
    }

    /// `graph_through` follows the oldest pending entry; `front` never splits an entry; dropped
    /// chunks keep the others' codes aligned.
    #[test]
    fn seqs_fronts_and_drops() {
        let dim = 16;
        let mut p = Pending::default();
        assert_eq!(p.graph_through(9), 9);
        p.push((0..3).map(|i| point(i, dim)).collect(), 5);
        p.push((3..6).map(|i| point(i, dim)).collect(), 7);
        assert_eq!(p.graph_through(9), 4);
        assert_eq!(p.front(1).len(), 3, "extended to the end of entry 5");
        assert_eq!(p.front(4).len(), 6);
        p.drop_front(3);
        assert_eq!(p.graph_through(9), 6);
        p.drop_chunks(&["c4"].into_iter().collect());
        assert_eq!(p.len(), 2);
        let q = p.points[1].vector.clone();
        let got = p.search(&q, &sq8::encode(&q), 1, 1, &crate::index::Filter::default());
        assert_eq!(p.points[got[0].0].chunk_id, "c5");
        assert!((got[0].1 - 1.0).abs() < 1e-5);
        p.drop_front(5);
        assert!(p.is_empty());
        assert_eq!(p.graph_through(9), 9);
    }
}
