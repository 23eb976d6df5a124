//! A read-optimised copy of an hnsw_rs graph. hnsw_rs's own walk allocates two `Arc`s per
//! accepted candidate and keeps its visited set in a SipHash map (the profile in docs/bench
//! shows that overhead next to the distance itself). This copy holds the layer-0 neighbour
//! lists, where a search spends its time, as one flat array indexed by slot, reuses a
//! per-thread visited array, and walks it with the same beam search. The upper layers' lists
//! (a few percent of the points) are copied too, so the descent to layer 0 takes no lock and
//! no allocation either (through hnsw_rs it was 6% of a 100k-chunk dense soak's samples); it
//! moves greedily while a neighbour is nearer, where hnsw_rs looks once per layer, so it
//! reaches layer 0 at least as near the query.
//!
//! The codes are copied too, into one array by slot: reading a neighbour's code through
//! hnsw_rs's points is three dependent loads (the slot's `Arc`, the point, its vector) that
//! miss the cache once the graph outgrows it, while a code at `slot * stride` is one load whose
//! address is known before the distance is needed, so the walk prefetches every unvisited
//! neighbour's code before scoring the first (as hnswlib does). The copy costs one more code
//! per point (388 bytes for MiniLM, about 7% of a chunk's resident memory at 1M chunks), and
//! its one-bit code (`bq`: 52 bytes for MiniLM), which shortlists a filter's many matches.
//!
//! hnsw_rs keeps its neighbour lists private and changes existing points' lists on every
//! insert, so the copy is taken when writes pause (the index worker does it) and used only
//! while it matches the graph's insert count; otherwise searches take hnsw_rs's walk. Like the
//! graph it walks on int8 codes (`sq8`); the caller rescores what it returns.
//!
//! The copy also mends links hnsw_rs's insert loses (`hnsw::links`): among near-duplicates
//! whole crowds end up with no link leading in.

use std::cell::RefCell;
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use hnsw_rs::anndists::dist::Distance;
use hnsw_rs::hnsw::{Neighbour, Point};
use rayon::prelude::*;

use super::bq::Signs;
use super::links::{Rows, link_unreachable, spread, with_reverse_links};
use super::sq8::Sq8Cosine;
use super::{CodeGraph, prefetch_lines};

/// Most layer-0 neighbours one expansion prefetches and scores as a group (hnsw_rs keeps 2M
/// per point, M at most 256); a longer list is done in groups of this size.
const GROUP: usize = 64;

pub struct FlatGraph {
    /// The graph's insert count this copy reflects.
    pub version: u64,
    /// Bytes of one code; slot i's code is `codes[i * stride..(i + 1) * stride]`.
    stride: usize,
    /// Every slot's code, zeros for a slot not in the graph.
    codes: Vec<i8>,
    /// Whether slot i is in the graph (has a code).
    present: Vec<bool>,
    /// Every slot's one-bit code, for filtered scans of many candidates.
    signs: Signs,
    /// Neighbours of slot i: `adj[offsets[i]..offsets[i + 1]]`.
    offsets: Vec<u32>,
    adj: Vec<u32>,
    /// Where a walk starts: a point of the top layer and that layer's number.
    entry: Option<(u32, usize)>,
    /// The upper layers' neighbour lists of the points above layer 0, `[layer - 1]`: a few
    /// percent of the points, walked greedily down to layer 0's entry.
    upper: HashMap<u32, Vec<Vec<u32>>>,
    /// Points hnsw_rs's graph left out of every walk's reach, linked in this copy.
    relinked: usize,
}

/// Points of a graph copy and how many of them no walk can reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Reach {
    pub points: usize,
    /// Points no neighbour list names (the entry point aside).
    pub no_in_links: usize,
    /// Points no path from the entry point leads to (includes `no_in_links`).
    pub unreachable: usize,
    /// Points hnsw_rs's graph left unreachable that the copy linked in (counted before).
    pub relinked: usize,
}

#[derive(PartialEq)]
struct Dist(f32, u32);

impl Eq for Dist {}

impl PartialOrd for Dist {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Dist {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
    }
}

thread_local! {
    /// Visited marks: slot -> the stamp of the search that saw it (no clearing per search).
    static VISITED: RefCell<(Vec<u32>, u32)> = const { RefCell::new((Vec::new(), 0)) };
}

impl FlatGraph {
    /// Copies the bottom layer of `hnsw`, whose points carry slot ids below `slots`.
    pub fn build(hnsw: &CodeGraph, slots: usize, version: u64) -> Self {
        let ix = hnsw.get_point_indexation();
        let stride = ix.get_data_dimension();
        let mut entry = None;
        // Each slot's point and its top layer. Layer by layer from the top (hnsw_rs's
        // all-points iterator unwraps the entry point, so it panics on an empty graph); every
        // point is in exactly one layer list, its top one. hnsw_rs keeps its own entry point
        // private: any point of the top layer serves.
        let mut at: Vec<Option<(usize, Arc<Point<'static, i8>>)>> = vec![None; slots];
        let layers = ix.get_max_level_observed() as usize;
        for (level, p) in (0..=layers)
            .rev()
            .flat_map(|l| ix.get_layer_iterator(l).map(move |p| (l, p)))
        {
            let id = p.get_origin_id();
            if id >= slots || p.get_v().len() != stride {
                continue;
            }
            entry.get_or_insert((id as u32, level));
            at[id] = Some((level, p));
        }
        // Reading a point's lists dereferences every neighbour in hnsw_rs (a cache miss each,
        // about 32 a point): on every index thread, writes paused meanwhile. Both passes write
        // only their own slot's rows.
        let mut near = Rows::new(slots, 2 * hnsw.get_max_nb_connection() as usize);
        near.fill(&at, |p| {
            let hood = p.get_neighborhood_id();
            hood.into_iter().next().unwrap_or_default()
        });
        let mut codes = vec![0i8; slots * stride];
        if stride > 0 {
            codes
                .par_chunks_mut(stride)
                .zip(at.par_iter())
                .for_each(|(code, p)| {
                    if let Some((_, p)) = p {
                        code.copy_from_slice(p.get_v());
                    }
                });
        }
        let present: Vec<bool> = at.iter().map(Option::is_some).collect();
        let signs = Signs::build(&codes, stride, &present);
        // The upper layers' lists: a few percent of the points, read again.
        let upper: HashMap<u32, Vec<Vec<u32>>> = at
            .par_iter()
            .enumerate()
            .filter_map(|(id, p)| {
                let (_, p) = p.as_ref().filter(|(level, _)| *level > 0)?;
                let hood = p.get_neighborhood_id();
                let lists = hood.iter().skip(1).map(|l| ids_below(l, slots));
                Some((id as u32, lists.collect()))
            })
            .collect();
        drop(at);
        let mut lists = with_reverse_links(&near, hnsw.get_max_nb_connection() as usize / 2);
        drop(near);
        let code = |i: usize| &codes[i * stride..(i + 1) * stride];
        let relinked = link_unreachable(&mut lists, &upper, entry, &present, |a, b| {
            Sq8Cosine.eval(code(a), code(b))
        });
        if relinked > 0 {
            metrics::counter!("shard_hnsw_relinked_points_total").increment(relinked as u64);
            tracing::debug!(
                relinked,
                "points no walk reached linked from a reached neighbour"
            );
        }
        let mut offsets = Vec::with_capacity(slots + 1);
        let mut adj = Vec::with_capacity(lists.iter().map(Vec::len).sum());
        offsets.push(0);
        for l in lists {
            adj.extend(l);
            offsets.push(adj.len() as u32);
        }
        Self {
            version,
            stride,
            codes,
            present,
            signs,
            offsets,
            adj,
            entry,
            upper,
            relinked,
        }
    }

    /// How well the copy's points can be reached: a point no list names cannot be found by
    /// any walk. hnsw_rs's insert can leave a point without in-links: a full list drops its
    /// farthest entry for each closer newcomer (crowds of near-duplicates fill every list near
    /// them), and a parallel insert can overwrite a list another insert had just added to.
    pub fn reach(&self) -> Reach {
        let n = self.present.len();
        let list = |i: usize| &self.adj[self.offsets[i] as usize..self.offsets[i + 1] as usize];
        let mut linked = vec![false; n];
        for &nb in self
            .adj
            .iter()
            .chain(self.upper.values().flatten().flatten())
        {
            linked[nb as usize] = true;
        }
        let mut seen = vec![false; n];
        if let Some((e, _)) = self.entry {
            spread(e, &list, &self.upper, &mut seen);
        }
        let entry = self.entry.map(|e| e.0 as usize);
        let count = |f: &dyn Fn(usize) -> bool| (0..n).filter(|&i| self.present[i] && f(i)).count();
        Reach {
            points: count(&|_| true),
            no_in_links: count(&|i| !linked[i] && entry != Some(i)),
            unreachable: count(&|i| !seen[i]),
            relinked: self.relinked,
        }
    }

    /// Slot `slot`'s code, if it is in the graph.
    #[inline]
    pub(super) fn code(&self, slot: u32) -> Option<&[i8]> {
        let i = slot as usize;
        if !*self.present.get(i)? {
            return None;
        }
        self.codes.get(i * self.stride..(i + 1) * self.stride)
    }

    /// The one-bit estimates (`bq`) of the query's dot product with the slots of `ids` in the
    /// graph, up to a constant of the query, as (estimate, slot); and the slots not in it.
    pub(super) fn estimates(&self, query: &[f32], ids: &[u32]) -> (Vec<(f32, u32)>, Vec<u32>) {
        let q = self.signs.query(query);
        let present = |id: &u32| self.present.get(*id as usize).is_some_and(|p| *p);
        let mut est = Vec::with_capacity(ids.len());
        if ids.iter().all(present) {
            self.signs.estimates(&q, ids, &mut est);
            return (est, Vec::new());
        }
        let (coded, uncoded): (Vec<u32>, Vec<u32>) = ids.iter().partition(|id| present(id));
        self.signs.estimates(&q, &coded, &mut est);
        (est, uncoded)
    }

    /// Up to `ef` (slot, code distance) pairs nearest the query's code, nearest first: a
    /// greedy descent through the upper layers from the entry point, then a beam search of
    /// breadth `ef` in layer 0 (as hnsw_rs searches, without its allocations and locks).
    pub fn search(&self, query: &[i8], ef: usize) -> Vec<(usize, f32)> {
        let Some((mut at, top)) = self.entry else {
            return Vec::new();
        };
        let Some(mut d) = self.code(at).map(|c| Sq8Cosine.eval(query, c)) else {
            return Vec::new();
        };
        for layer in (1..=top).rev() {
            // Move to the nearest neighbour while one is nearer than where the walk stands.
            loop {
                let mut moved = false;
                let list = self.upper.get(&at).and_then(|l| l.get(layer - 1));
                for &nb in list.map(Vec::as_slice).unwrap_or_default() {
                    if let Some(dn) = self.code(nb).map(|c| Sq8Cosine.eval(query, c))
                        && dn < d
                    {
                        (at, d, moved) = (nb, dn, true);
                    }
                }
                if !moved {
                    break;
                }
            }
        }
        self.beam(query, at as usize, ef)
    }

    /// Beam search of breadth `ef` in layer 0 from slot `entry`: up to `ef` (slot, code
    /// distance) pairs, nearest first.
    fn beam(&self, query: &[i8], entry: usize, ef: usize) -> Vec<(usize, f32)> {
        let Some(d0) = self.code(entry as u32).map(|c| Sq8Cosine.eval(query, c)) else {
            return Vec::new();
        };
        let n = self.present.len();
        VISITED.with(|v| {
            let (marks, stamp) = &mut *v.borrow_mut();
            if marks.len() < n {
                marks.resize(n, 0);
            }
            *stamp = stamp.wrapping_add(1);
            if *stamp == 0 {
                marks.iter_mut().for_each(|m| *m = 0);
                *stamp = 1;
            }
            let stamp = *stamp;
            marks[entry] = stamp;
            let mut candidates = BinaryHeap::with_capacity(ef * 4);
            let mut results = BinaryHeap::with_capacity(ef + 1);
            candidates.push(Reverse(Dist(d0, entry as u32)));
            results.push(Dist(d0, entry as u32));
            let mut group = [0u32; GROUP];
            while let Some(Reverse(Dist(d, c))) = candidates.pop() {
                if results.len() >= ef && results.peek().is_some_and(|w| d > w.0) {
                    break;
                }
                let (a, b) = (
                    self.offsets[c as usize] as usize,
                    self.offsets[c as usize + 1] as usize,
                );
                for list in self.adj[a..b].chunks(GROUP) {
                    // The unvisited neighbours first, their codes' loads started ...
                    let mut k = 0;
                    for &nb in list {
                        let m = &mut marks[nb as usize];
                        if *m == stamp {
                            continue;
                        }
                        *m = stamp;
                        if let Some(code) = self.code(nb) {
                            prefetch(code);
                            group[k] = nb;
                            k += 1;
                        }
                    }
                    // ... then scored while the later ones arrive. The slot is looked up again
                    // rather than its slice kept: a group of (slot, slice) pairs measured slower
                    // (hnswbench, 100k points: ef 64 183-186 against 139-156 us).
                    for &nb in &group[..k] {
                        let Some(code) = self.code(nb) else { continue };
                        let dn = Sq8Cosine.eval(query, code);
                        if results.len() < ef || results.peek().is_some_and(|w| dn < w.0) {
                            candidates.push(Reverse(Dist(dn, nb)));
                            results.push(Dist(dn, nb));
                            if results.len() > ef {
                                results.pop();
                            }
                        }
                    }
                }
            }
            results
                .into_sorted_vec()
                .into_iter()
                .map(|Dist(d, s)| (s as usize, d))
                .collect()
        })
    }
}

/// The ids of `layer`'s neighbours below `slots`.
fn ids_below(layer: &[Neighbour], slots: usize) -> Vec<u32> {
    layer
        .iter()
        .filter(|n| n.d_id < slots)
        .map(|n| n.d_id as u32)
        .collect()
}

/// Starts loading `code` into the cache (its first lines; the hardware prefetcher follows a
/// sequential read from there).
#[inline]
fn prefetch(code: &[i8]) {
    prefetch_lines(code, PREFETCH_LINES);
}

/// Cache lines of a code prefetched up front (a MiniLM code spans 7).
const PREFETCH_LINES: usize = 2;

#[cfg(test)]
mod tests {
    use hnsw_rs::hnsw::Hnsw;

    use super::*;
    use crate::index::Filter;
    use crate::index::hnsw::distance::dot;
    use crate::index::hnsw::sq8;
    use crate::index::hnsw::tests::unit;
    use crate::index::hnsw::{HnswIndex, HnswParams, Point as IndexPoint};

    fn exact(points: &[Vec<f32>], q: &[f32], k: usize) -> Vec<usize> {
        let mut s: Vec<(f32, usize)> = points
            .iter()
            .enumerate()
            .map(|(i, p)| (dot(q, p), i))
            .collect();
        s.sort_by(|a, b| b.0.total_cmp(&a.0));
        s.into_iter().take(k).map(|x| x.1).collect()
    }

    fn index(dim: usize, m: u32, ef_construction: u32, expected: usize) -> HnswIndex {
        let params = HnswParams {
            m,
            ef_construction,
            ef_search: 64,
        };
        HnswIndex::new(dim, params, expected)
    }

    fn point(i: u32, vector: Vec<f32>) -> IndexPoint {
        IndexPoint {
            chunk_id: format!("d{i}#0"),
            doc_id: format!("d{i}"),
            vector,
            meta: vec![],
        }
    }

    #[test]
    fn an_empty_graph_copies_to_nothing() {
        let hnsw: CodeGraph = Hnsw::new(8, 16, 16, 100, Sq8Cosine);
        let flat = FlatGraph::build(&hnsw, 0, 0);
        assert!(flat.search(&sq8::encode(&unit(1, 24)), 16).is_empty());
    }

    #[test]
    fn the_flat_walk_finds_what_hnsw_rs_finds() {
        let points: Vec<Vec<f32>> = (0..600).map(|i| unit(i, 24)).collect();
        let codes: Vec<Vec<i8>> = points.iter().map(|p| sq8::encode(p)).collect();
        let hnsw: CodeGraph = Hnsw::new(8, 600, 16, 100, Sq8Cosine);
        for (i, c) in codes.iter().enumerate() {
            hnsw.insert((c.as_slice(), i));
        }
        let flat = FlatGraph::build(&hnsw, points.len(), 7);
        assert_eq!(flat.version, 7);
        for q in 1000..1020 {
            let qv = unit(q, 24);
            let qc = sq8::encode(&qv);
            let got = flat.search(&qc, 64);
            assert!(got.len() <= 64 && got.windows(2).all(|w| w[0].1 <= w[1].1));
            assert!((got[0].1 - Sq8Cosine.eval(&qc, &codes[got[0].0])).abs() < 1e-6);
            // Rescored with the f32 vectors, a 600-point graph at ef 64 is exact.
            let mut rescored: Vec<(f32, usize)> = got
                .iter()
                .map(|&(s, _)| (dot(&qv, &points[s]), s))
                .collect();
            rescored.sort_by(|a, b| b.0.total_cmp(&a.0));
            let top: Vec<usize> = rescored.iter().take(10).map(|x| x.1).collect();
            assert_eq!(top, exact(&points, &qv, 10), "query {q}");
        }
        // The descent starts at hnsw_rs's top layer and ends where hnsw_rs's does or nearer.
        let (_, top) = flat.entry.unwrap();
        assert_eq!(top, hnsw.get_max_level_observed() as usize);
        assert!(top > 0 && !flat.upper.is_empty());
        // An entry the copy does not hold gives nothing.
        assert!(flat.beam(&sq8::encode(&unit(1, 24)), 10_000, 16).is_empty());
    }

    #[test]
    fn neighbour_lists_longer_than_a_group_are_walked_whole() {
        // M 48 keeps up to 96 layer-0 neighbours: expansions span two prefetch groups.
        let points: Vec<Vec<f32>> = (0..400).map(|i| unit(i, 16)).collect();
        let hnsw: CodeGraph = Hnsw::new(48, 400, 16, 200, Sq8Cosine);
        for (i, p) in points.iter().enumerate() {
            hnsw.insert((sq8::encode(p).as_slice(), i));
        }
        let flat = FlatGraph::build(&hnsw, points.len(), 1);
        assert!((0..points.len()).any(|i| flat.offsets[i + 1] - flat.offsets[i] > GROUP as u32));
        for q in 2000..2010 {
            let qv = unit(q, 16);
            let qc = sq8::encode(&qv);
            // ef above the point count: the walk reaches every point of the connected graph.
            let got = flat.search(&qc, 500);
            assert_eq!(got.len(), points.len(), "query {q}");
            let mut seen: Vec<usize> = got.iter().map(|g| g.0).collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), points.len());
        }
    }

    /// Near-duplicates (here: points on a circle) leave hnsw_rs's neighbour selection few links
    /// per point, so a parallel insert's lost reverse link can cut a point off; the copy
    /// reaches every point however the inserts interleaved.
    #[test]
    fn every_point_of_a_crowded_graph_is_reached() {
        let mut relinked = 0;
        for round in 0..40 {
            let idx = index(8, 16, 200, 256);
            let circle = |i: u32| (0..8).map(move |k| (round as f32 * 0.37 + (i + k) as f32).sin());
            idx.insert((0..200).map(|i| point(i, circle(i).collect())).collect());
            assert!(idx.refresh_flat());
            let r = idx.flat_reach().unwrap();
            assert_eq!(
                (r.points, r.unreachable, r.no_in_links),
                (200, 0, 0),
                "round {round}"
            );
            relinked += r.relinked;
        }
        eprintln!("relinked {relinked} points in 40 graphs");
    }

    /// A corpus repeats itself (boilerplate, copied documents): every copy of a repeated
    /// vector is found. Exact duplicates are where hnsw_rs's selection keeps the fewest links.
    #[test]
    fn every_copy_of_a_repeated_vector_is_found() {
        let idx = index(32, 16, 200, 2048);
        let mut points: Vec<IndexPoint> = (0..1500).map(|i| point(i, unit(i, 32))).collect();
        points.extend((1500..1560).map(|i| point(i, unit(7, 32))));
        for group in points.chunks(300) {
            idx.insert(group.to_vec());
        }
        assert!(idx.refresh_flat());
        let r = idx.flat_reach().unwrap();
        assert_eq!((r.points, r.unreachable), (1560, 0));
        let h = idx.search(&unit(7, 32), 61, 128, &Filter::default());
        let copies = h.iter().filter(|(_, s)| *s > 0.9999).count();
        assert_eq!(copies, 61, "d7 and its 60 copies; relinked {}", r.relinked);
    }

    #[test]
    fn a_stale_copy_is_not_used_and_is_refreshed() {
        let idx = index(24, 8, 100, 100);
        assert!(idx.refresh_flat(), "an empty graph copies too");
        idx.insert((0..100).map(|i| point(i, unit(i, 24))).collect());
        assert!(idx.refresh_flat());
        assert!(!idx.refresh_flat(), "already current");
        let top = |seed| {
            idx.search(&unit(seed, 24), 1, 32, &Filter::default())[0]
                .0
                .clone()
        };
        assert_eq!(top(42), "d42#0");
        // A point inserted after the copy is found (the copy is stale, hnsw_rs walks) ...
        idx.insert(vec![point(500, unit(500, 24))]);
        assert_eq!(top(500), "d500#0");
        // ... and after the next copy.
        assert!(idx.refresh_flat());
        assert_eq!(top(500), "d500#0");
        // Tombstones are dropped from the flat walk's results too.
        idx.remove(&["d42#0".to_string()]);
        assert_ne!(top(42), "d42#0");
    }
}
