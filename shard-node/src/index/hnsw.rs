//! A shard's dense index: an hnsw_rs graph over L2-normalised embeddings, scored by cosine.
//!
//! hnsw_rs cannot delete points, so a replaced or deleted chunk leaves a tombstone: its slot is
//! marked dead and filtered out at query time. When tombstones pile up the shard rebuilds the
//! graph from RocksDB (`HnswIndex::rebuild`). Metadata filters run inside the graph search; a
//! filter that matches few points is answered exactly by brute force instead, because graph
//! search degrades when most neighbours are filtered out.

use std::collections::HashMap;

use hnsw_rs::anndists::dist::Distance;
use hnsw_rs::hnsw::Hnsw;
use parking_lot::RwLock;

use super::Filter;
pub use crate::storage::HnswParams;

/// Cosine distance for unit vectors, `1 - a·b`, clamped at 0. (hnsw_rs's `DistDot` asserts
/// `1 - a·b >= 0`, which rounding breaks for near-duplicates and would abort the node.)
#[derive(Default, Clone, Copy)]
pub struct UnitCosine;

impl Distance<f32> for UnitCosine {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        (1.0 - dot(a, b)).max(0.0)
    }
}

/// Dot product in 8 independent lanes so the compiler vectorises it.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Scales `v` to unit length; returns false for a zero or non-finite vector.
pub fn normalize(v: &mut [f32]) -> bool {
    let n = dot(v, v).sqrt();
    if !n.is_finite() || n == 0.0 {
        return false;
    }
    v.iter_mut().for_each(|x| *x /= n);
    true
}

/// Below this many matching points a filtered search is answered by exact brute force.
pub const BRUTE_FORCE_LIMIT: usize = 2000;

struct Slot {
    chunk_id: String,
    meta: Vec<(String, String)>,
    alive: bool,
}

impl Slot {
    fn matches(&self, filter: &Filter) -> bool {
        filter
            .iter()
            .all(|(k, v)| self.meta.iter().any(|(mk, mv)| mk == k && mv == v))
    }
}

#[derive(Default)]
struct Slots {
    slots: Vec<Slot>,
    by_chunk: HashMap<String, usize>,
    dead: usize,
}

struct Graph {
    hnsw: Hnsw<'static, f32, UnitCosine>,
    slots: RwLock<Slots>,
}

pub struct HnswIndex {
    dim: usize,
    params: HnswParams,
    graph: RwLock<Graph>,
}

/// One point to insert.
pub struct Point {
    pub chunk_id: String,
    pub vector: Vec<f32>,
    pub meta: Vec<(String, String)>,
}

/// Outcome of a search: graph hits, or the ids a caller must score exactly (brute force needs
/// the vectors, which live in RocksDB).
pub enum SearchPlan {
    Hits(Vec<(String, f32)>),
    Exact(Vec<String>),
}

impl HnswIndex {
    pub fn new(dim: usize, params: HnswParams, expected: usize) -> Self {
        Self {
            dim,
            graph: RwLock::new(Self::empty_graph(&params, expected)),
            params,
        }
    }

    fn empty_graph(params: &HnswParams, expected: usize) -> Graph {
        // M is validated in [2, 256] by the coordinator: hnsw_rs exits the process above 256.
        let m = (params.m as usize).clamp(2, 256);
        Graph {
            hnsw: Hnsw::new(
                m,
                expected.max(1024),
                16,
                params.ef_construction.max(1) as usize,
                UnitCosine,
            ),
            slots: RwLock::new(Slots::default()),
        }
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Inserts points (in parallel inside hnsw_rs); a point whose chunk id is already present
    /// replaces it (the old slot becomes a tombstone once the new point is in the graph).
    pub fn insert(&self, points: Vec<Point>) {
        if points.is_empty() {
            return;
        }
        let g = self.graph.read();
        let first = {
            let mut s = g.slots.write();
            let first = s.slots.len();
            for p in &points {
                s.slots.push(Slot {
                    chunk_id: p.chunk_id.clone(),
                    meta: p.meta.clone(),
                    alive: false,
                });
            }
            first
        };
        let data: Vec<(&Vec<f32>, usize)> = points
            .iter()
            .enumerate()
            .map(|(i, p)| (&p.vector, first + i))
            .collect();
        if data.len() >= 32 {
            g.hnsw.parallel_insert(&data);
        } else {
            for (v, id) in data {
                g.hnsw.insert((v.as_slice(), id));
            }
        }
        let mut s = g.slots.write();
        for (i, p) in points.into_iter().enumerate() {
            let id = first + i;
            s.slots[id].alive = true;
            if let Some(old) = s.by_chunk.insert(p.chunk_id, id)
                && s.slots[old].alive
            {
                s.slots[old].alive = false;
                s.dead += 1;
            }
        }
    }

    /// Tombstones chunks (unknown ids are ignored).
    pub fn remove(&self, chunk_ids: &[String]) {
        let g = self.graph.read();
        let mut s = g.slots.write();
        for id in chunk_ids {
            if let Some(slot) = s.by_chunk.remove(id)
                && s.slots[slot].alive
            {
                s.slots[slot].alive = false;
                s.dead += 1;
            }
        }
    }

    /// (live points, tombstones)
    pub fn counts(&self) -> (usize, usize) {
        let g = self.graph.read();
        let s = g.slots.read();
        (s.slots.len() - s.dead, s.dead)
    }

    pub fn search(&self, query: &[f32], top_k: usize, ef: usize, filter: &Filter) -> SearchPlan {
        let g = self.graph.read();
        let s = g.slots.read();
        if !filter.is_empty() {
            let matching: Vec<&Slot> = s
                .slots
                .iter()
                .filter(|sl| sl.alive && sl.matches(filter))
                .collect();
            if matching.len() <= BRUTE_FORCE_LIMIT.max(ef) {
                return SearchPlan::Exact(
                    matching.into_iter().map(|sl| sl.chunk_id.clone()).collect(),
                );
            }
        }
        let accept = |id: &usize| {
            s.slots
                .get(*id)
                .is_some_and(|sl| sl.alive && sl.matches(filter))
        };
        let found = g
            .hnsw
            .search_filter(query, top_k, ef.max(top_k), Some(&accept));
        SearchPlan::Hits(
            found
                .into_iter()
                .filter_map(|n| {
                    s.slots
                        .get(n.d_id)
                        .map(|sl| (sl.chunk_id.clone(), 1.0 - n.distance))
                })
                .collect(),
        )
    }

    /// Replaces the graph with one built from `points` (the shard's live chunks), dropping every
    /// tombstone. Searches keep using the old graph until the swap.
    pub fn rebuild(&self, points: Vec<Point>) {
        let fresh = Self::empty_graph(&self.params, points.len());
        {
            let mut s = fresh.slots.write();
            for (i, p) in points.iter().enumerate() {
                s.slots.push(Slot {
                    chunk_id: p.chunk_id.clone(),
                    meta: p.meta.clone(),
                    alive: true,
                });
                s.by_chunk.insert(p.chunk_id.clone(), i);
            }
        }
        let data: Vec<(&Vec<f32>, usize)> = points
            .iter()
            .enumerate()
            .map(|(i, p)| (&p.vector, i))
            .collect();
        fresh.hnsw.parallel_insert(&data);
        *self.graph.write() = fresh;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(seed: u32, dim: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..dim)
            .map(|i| ((seed as f32 + 1.0) * (i as f32 + 0.5)).sin())
            .collect();
        normalize(&mut v);
        v
    }

    fn params() -> HnswParams {
        HnswParams {
            m: 16,
            ef_construction: 100,
            ef_search: 64,
        }
    }

    #[test]
    fn finds_itself_and_respects_tombstones() {
        let idx = HnswIndex::new(32, params(), 100);
        let pts: Vec<Point> = (0..200)
            .map(|i| Point {
                chunk_id: format!("d{i}#0"),
                vector: unit(i, 32),
                meta: vec![("parity".into(), (i % 2).to_string())],
            })
            .collect();
        idx.insert(pts);
        let SearchPlan::Hits(h) = idx.search(&unit(5, 32), 3, 64, &vec![]) else {
            panic!()
        };
        assert_eq!(h[0].0, "d5#0");
        assert!((h[0].1 - 1.0).abs() < 1e-5);
        idx.remove(&["d5#0".to_string()]);
        let SearchPlan::Hits(h) = idx.search(&unit(5, 32), 3, 64, &vec![]) else {
            panic!()
        };
        assert!(h.iter().all(|(id, _)| id != "d5#0"));
        assert_eq!(idx.counts(), (199, 1));
        // Small filtered sets are answered exactly by the caller.
        match idx.search(&unit(5, 32), 3, 64, &vec![("parity".into(), "1".into())]) {
            SearchPlan::Exact(ids) => assert_eq!(ids.len(), 99),
            SearchPlan::Hits(_) => panic!("expected exact plan"),
        }
        // Re-inserting a chunk id replaces the old point.
        idx.insert(vec![Point {
            chunk_id: "d7#0".into(),
            vector: unit(500, 32),
            meta: vec![],
        }]);
        assert_eq!(idx.counts(), (199, 2));
    }

    #[test]
    fn identical_vectors_do_not_abort() {
        let v = unit(1, 8);
        let d = UnitCosine.eval(&v, &v);
        assert!((0.0..1e-6).contains(&d), "{d}");
        // A dot product rounding above 1 would make 1 - dot negative: clamped, not asserted.
        let w: Vec<f32> = v.iter().map(|x| x * 1.0001).collect();
        assert_eq!(UnitCosine.eval(&v, &w), 0.0);
    }
}
