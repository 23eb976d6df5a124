//! The index itself: hnsw_rs's graph over int8 codes, the slot table that maps its ids to
//! chunks (alive or tombstoned, with metadata and the f32 vectors hits are rescored with), and
//! the pending points searched beside it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hnsw_rs::hnsw::Hnsw;
use parking_lot::RwLock;

use super::distance::dot;
use super::flat::{FlatGraph, Reach};
use super::pending::Pending;
use super::planner::{self, Plan};
use super::sq8::{self, Sq8Cosine};
use super::{CodeGraph, Filter, HnswParams, Meta, Point, prefetch_lines};

/// One graph id: the chunk it stands for, alive or a tombstone.
pub(super) struct Slot {
    pub(super) chunk_id: String,
    /// Kept so that a dump can be caught up by document (`tombstone_docs`).
    pub(super) doc_id: String,
    pub(super) meta: Meta,
    /// The f32 vector hits are rescored with; emptied when the slot dies (the graph keeps only
    /// its code).
    pub(super) vector: Box<[f32]>,
    pub(super) alive: bool,
}

impl Slot {
    pub(super) fn new(p: Point, alive: bool) -> Self {
        Self {
            chunk_id: p.chunk_id,
            doc_id: p.doc_id,
            meta: p.meta,
            vector: p.vector.into_boxed_slice(),
            alive,
        }
    }

    fn kill(&mut self) {
        self.alive = false;
        self.vector = Box::default();
    }
}

impl planner::Candidate for Slot {
    fn alive(&self) -> bool {
        self.alive
    }

    fn meta(&self) -> &Meta {
        &self.meta
    }

    fn vector(&self) -> &[f32] {
        &self.vector
    }

    fn chunk_id(&self) -> &str {
        &self.chunk_id
    }
}

/// The graph's codes of `points`, in order.
fn codes(points: &[Point]) -> Vec<Vec<i8>> {
    points.iter().map(|p| sq8::encode(&p.vector)).collect()
}

/// The slot table: graph ids to chunks, and live chunk ids to their slot.
#[derive(Default)]
pub(super) struct Slots {
    pub(super) slots: Vec<Slot>,
    pub(super) by_chunk: HashMap<String, usize>,
    pub(super) dead: usize,
    /// The payload index the planner reads (`planner::Postings`).
    pub(super) postings: planner::Postings,
}

impl Slots {
    /// Appends a slot (its id is the next one) and indexes its metadata.
    pub(super) fn push(&mut self, slot: Slot) {
        self.postings.add(self.slots.len(), &slot.meta);
        self.slots.push(slot);
    }
}

/// hnsw_rs's graph with its slot table and the flat copy of its bottom layer.
pub(super) struct Graph {
    pub(super) hnsw: CodeGraph,
    pub(super) slots: RwLock<Slots>,
    /// Insert batches so far; `flat` is used only while its version equals this.
    pub(super) inserts: AtomicU64,
    /// The bottom layer copied for fast walks (`hnsw::flat`), taken when writes pause.
    pub(super) flat: RwLock<Option<Arc<FlatGraph>>>,
}

impl Graph {
    pub(super) fn new(hnsw: CodeGraph, slots: Slots) -> Self {
        Self {
            hnsw,
            slots: RwLock::new(slots),
            inserts: AtomicU64::new(0),
            flat: RwLock::new(None),
        }
    }

    /// The flat copy, if it still describes the graph.
    fn fresh_flat(&self) -> Option<Arc<FlatGraph>> {
        let f = self.flat.read().clone()?;
        (f.version == self.inserts.load(Ordering::Acquire)).then_some(f)
    }

    /// Takes the flat copy of the graph as it stands; false if hnsw_rs failed it.
    fn copy_flat(&self) -> bool {
        let version = self.inserts.load(Ordering::Acquire);
        let slots = self.slots.read().slots.len();
        // hnsw_rs asserts and unwraps inside; a failed copy leaves searches on its own walk.
        let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            FlatGraph::build(&self.hnsw, slots, version)
        }));
        match built {
            Ok(flat) => {
                *self.flat.write() = Some(Arc::new(flat));
                true
            }
            Err(_) => {
                tracing::error!("copying the hnsw bottom layer failed; searches walk hnsw_rs");
                false
            }
        }
    }

    /// Up to `ef` (slot, code distance) pairs of the unfiltered walk for the query's code,
    /// nearest first.
    fn walk(&self, query: &[i8], ef: usize) -> Vec<(usize, f32)> {
        if let Some(f) = self.fresh_flat() {
            let found = f.search(query, ef);
            // Empty only when the copy holds no point.
            if !found.is_empty() {
                metrics::counter!("shard_hnsw_walks_total", "walk" => "flat").increment(1);
                return found;
            }
        }
        metrics::counter!("shard_hnsw_walks_total", "walk" => "hnsw_rs").increment(1);
        self.hnsw
            .search_filter(query, ef, ef, None)
            .into_iter()
            .map(|n| (n.d_id, n.distance))
            .collect()
    }

    /// Every matching slot among `ids` scored (`planner::exact`): by the flat copy's codes
    /// when it is current, keeping max(ef, 4 top_k, 64) for the f32 rescoring every search
    /// ends with, else by f32 vectors, keeping top_k.
    fn exact(
        &self,
        s: &Slots,
        ids: impl Iterator<Item = usize> + Clone,
        query: (&[f32], &[i8]),
        top_k: usize,
        ef: usize,
        filter: &Filter,
    ) -> Vec<(usize, f32)> {
        match self.fresh_flat() {
            Some(f) => {
                let code = |id: usize| f.code(id as u32);
                let keep = ef.max(4 * top_k).max(64);
                planner::exact(&s.slots, ids, query, keep, filter, Some(&code))
            }
            None => planner::exact(&s.slots, ids, query, top_k, filter, None),
        }
    }

    /// hnsw_rs's walk keeping only the points `accept` takes.
    fn filtered_walk(
        &self,
        s: &Slots,
        code: &[i8],
        ef: usize,
        top_k: usize,
        accept: &(impl Fn(&usize) -> bool + Sync),
    ) -> Vec<(usize, f32)> {
        metrics::counter!("shard_hnsw_walks_total", "walk" => "filtered").increment(1);
        let found: Vec<(usize, f32)> = self
            .hnsw
            .search_filter(code, ef, ef, Some(accept))
            .into_iter()
            .map(|n| (n.d_id, n.distance))
            .collect();
        // hnsw_rs's filtered walk only grows its result set from accepted points, so a walk
        // that enters a cluster of tombstones whose edges lead only to each other ends with
        // nothing. Rare (compaction rebuilds such graphs), but the answer must stay right:
        // score every live point instead.
        let live = s.slots.len() - s.dead;
        if found.len() < top_k && found.len() < live {
            metrics::counter!("shard_hnsw_walks_total", "walk" => "exact").increment(1);
            return (0..s.slots.len())
                .filter(|id| accept(id))
                .map(|id| (id, 0.0))
                .collect();
        }
        found
    }
}

pub struct HnswIndex {
    pub(super) dim: usize,
    pub(super) params: HnswParams,
    pub(super) graph: RwLock<Graph>,
    /// Points that belong in the index but are not in the graph yet (`hnsw::pending`: a dump
    /// caught up at open, a follower's writes since the leader's dump it loaded, a leader's
    /// write-behind): scored by brute force and merged with the graph's hits until the index
    /// worker has inserted them (`absorb_some`) or a newer dump holds them, so a replica
    /// serves, and acknowledges writes, before that work is done.
    pub(super) pending: RwLock<Pending>,
}

impl HnswIndex {
    pub fn new(dim: usize, params: HnswParams, expected: usize) -> Self {
        Self {
            dim,
            graph: RwLock::new(Self::empty_graph(&params, expected)),
            params,
            pending: RwLock::default(),
        }
    }

    fn empty_graph(params: &HnswParams, expected: usize) -> Graph {
        // M is validated in [2, 256] by the coordinator: hnsw_rs exits the process above 256.
        let m = (params.m as usize).clamp(2, 256);
        Graph::new(
            Hnsw::new(
                m,
                expected.max(1024),
                16,
                params.ef_construction.max(1) as usize,
                Sq8Cosine,
            ),
            Slots::default(),
        )
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn params(&self) -> HnswParams {
        self.params
    }

    /// Takes `other`'s graph and pending points: a snapshot's state replaced this one's.
    /// Searches use the old graph until the swap.
    pub fn replace(&self, other: HnswIndex) {
        let HnswIndex { graph, pending, .. } = other;
        *self.graph.write() = graph.into_inner();
        *self.pending.write() = pending.into_inner();
    }

    /// Copies the graph's bottom layer for fast walks unless the copy is current; the index
    /// worker calls it when writes pause. Returns whether it copied.
    pub fn refresh_flat(&self) -> bool {
        let g = self.graph.read();
        g.fresh_flat().is_none() && g.copy_flat()
    }

    /// Reachability of the current flat copy's points (None while there is no fresh copy).
    pub fn flat_reach(&self) -> Option<Reach> {
        self.graph.read().fresh_flat().map(|f| f.reach())
    }

    /// Inserts points (in parallel inside hnsw_rs); a point whose chunk id is already present
    /// replaces it (the old slot becomes a tombstone once the new point is in the graph).
    pub fn insert(&self, points: Vec<Point>) {
        if points.is_empty() {
            return;
        }
        self.drop_pending(points.iter().map(|p| p.chunk_id.as_str()));
        self.insert_graph(points);
    }

    /// Holds points written by the entry at `seq` beside the graph instead of inserting them
    /// (`hnsw::pending`): an older copy of a chunk leaves the graph and the pending points, so
    /// each chunk is searched once, exactly.
    pub fn defer(&self, points: Vec<Point>, seq: u64) {
        if points.is_empty() {
            return;
        }
        let ids: Vec<String> = points.iter().map(|p| p.chunk_id.clone()).collect();
        self.remove(&ids);
        self.pending.write().push(points, seq);
    }

    /// Points searched beside the graph, not in it yet.
    pub fn pending_len(&self) -> usize {
        self.pending.read().len()
    }

    /// The seq through which the graph holds every point written, for an index at `at`
    /// (`Pending::graph_through`): what a dump of the graph alone is labelled with.
    pub fn graph_through(&self, at: u64) -> u64 {
        self.pending.read().graph_through(at)
    }

    /// Holds `points` beside the graph (see `pending`), as written by entries after `seq`.
    pub fn set_pending(&self, points: Vec<Point>, seq: u64) {
        let mut p = self.pending.write();
        p.clear();
        p.push(points, seq + 1);
    }

    /// Moves the pending points into the graph; returns how many. Searches see each point
    /// throughout (for a moment twice, which the merge removes).
    pub fn absorb_pending(&self) -> usize {
        self.absorb_some(usize::MAX)
    }

    /// Moves at least `max` pending points into the graph, oldest first and whole entries at
    /// a time (fewer if fewer are pending); returns how many. The index worker is the only
    /// writer, so the points are still the oldest when they are dropped.
    pub fn absorb_some(&self, max: usize) -> usize {
        let batch = self.pending.read().front(max);
        let n = batch.len();
        if n > 0 {
            self.insert_graph(batch);
            self.pending.write().drop_front(n);
        }
        n
    }

    fn drop_pending<'a>(&self, ids: impl Iterator<Item = &'a str>) {
        if self.pending.read().is_empty() {
            return;
        }
        let ids: HashSet<&str> = ids.collect();
        self.pending.write().drop_chunks(&ids);
    }

    fn insert_graph(&self, points: Vec<Point>) {
        let codes = codes(&points);
        let g = self.graph.read();
        let mut chunk_ids = Vec::with_capacity(points.len());
        let first = {
            let mut s = g.slots.write();
            let first = s.slots.len();
            for p in points {
                chunk_ids.push(p.chunk_id.clone());
                s.push(Slot::new(p, false));
            }
            first
        };
        let data: Vec<(&Vec<i8>, usize)> = codes
            .iter()
            .enumerate()
            .map(|(i, c)| (c, first + i))
            .collect();
        // The flat copy goes stale as the graph starts changing (it stays a consistent older
        // graph for searches already using it).
        g.inserts.fetch_add(1, Ordering::AcqRel);
        if data.len() >= 32 {
            g.hnsw.parallel_insert(&data);
        } else {
            for (c, id) in data {
                g.hnsw.insert((c.as_slice(), id));
            }
        }
        let mut s = g.slots.write();
        for (i, chunk_id) in chunk_ids.into_iter().enumerate() {
            let id = first + i;
            s.slots[id].alive = true;
            if let Some(old) = s.by_chunk.insert(chunk_id, id)
                && s.slots[old].alive
            {
                s.slots[old].kill();
                s.dead += 1;
            }
        }
    }

    /// Takes the metadata of points already in the graph with the same vector (a metadata
    /// patch, or an upsert that changed nothing the embedding sees) in place of inserting them
    /// again: the slot keeps its place in the graph and only its payload postings change.
    /// Returns the points still to insert.
    pub fn update_in_place(&self, points: Vec<Point>) -> Vec<Point> {
        if points.is_empty() {
            return points;
        }
        let g = self.graph.read();
        let mut s = g.slots.write();
        let mut rest = Vec::new();
        let mut changes = Vec::new();
        for p in points {
            // A pending copy is never alive in the graph too (`defer` removes it first).
            match s.by_chunk.get(&p.chunk_id).copied() {
                Some(slot) if s.slots[slot].alive && *s.slots[slot].vector == *p.vector => {
                    let old = std::mem::replace(&mut s.slots[slot].meta, p.meta);
                    if old != s.slots[slot].meta {
                        changes.push((slot, old));
                    }
                }
                _ => rest.push(p),
            }
        }
        let Slots {
            slots, postings, ..
        } = &mut *s;
        postings.reindex(changes.iter().map(|(id, old)| (*id, old, &slots[*id].meta)));
        rest
    }

    /// Tombstones chunks (unknown ids are ignored).
    pub fn remove(&self, chunk_ids: &[String]) {
        self.drop_pending(chunk_ids.iter().map(String::as_str));
        let g = self.graph.read();
        let mut s = g.slots.write();
        for id in chunk_ids {
            if let Some(slot) = s.by_chunk.remove(id)
                && s.slots[slot].alive
            {
                s.slots[slot].kill();
                s.dead += 1;
            }
        }
    }

    /// (live points, tombstones)
    pub fn counts(&self) -> (usize, usize) {
        let g = self.graph.read();
        let s = g.slots.read();
        (s.slots.len() - s.dead + self.pending.read().len(), s.dead)
    }

    /// The estimated cost of `search` at `ef` with `filter`, in graph-walk steps
    /// (`planner::cost`, the pending points' scan included); None when it cannot be told
    /// without planning.
    pub fn search_cost(&self, ef: usize, filter: &Filter) -> Option<usize> {
        let g = self.graph.read();
        let s = g.slots.read();
        let pending = self.pending.read().len();
        let graph = planner::cost(&s.postings, s.slots.len() - s.dead, filter, ef)?;
        Some(graph + pending.div_ceil(planner::CANDIDATES_PER_STEP))
    }

    /// The `top_k` nearest live points that match `filter`, best first, with exact cosines.
    /// A filter is planned by the share of points it matches (`hnsw::planner`).
    pub fn search(
        &self,
        query: &[f32],
        top_k: usize,
        ef: usize,
        filter: &Filter,
    ) -> Vec<(String, f32)> {
        let g = self.graph.read();
        let s = g.slots.read();
        let pending = self.pending.read();
        let ef = ef.max(top_k);
        let accept = |id: &usize| {
            s.slots
                .get(*id)
                .is_some_and(|sl| sl.alive && filter.matches(&sl.meta))
        };
        let code = sq8::encode(query);
        let plan = planner::plan(&s.slots, &s.postings, s.slots.len() - s.dead, filter, ef);
        let found = match plan {
            Plan::Candidates { ids, exact } => {
                metrics::counter!("shard_hnsw_walks_total", "walk" => "postings").increment(1);
                let all = Filter::default();
                let check = if exact { &all } else { filter };
                // Many candidates: their one-bit codes pick the few the int8 scan reads.
                let ids = match g.fresh_flat() {
                    Some(f) if ids.len() > planner::SHORTLIST_ABOVE => {
                        planner::shortlist(&s.slots, f.estimates(query, &ids), check)
                    }
                    _ => ids,
                };
                let ids = ids.into_iter().map(|i| i as usize);
                g.exact(&s, ids, (query, &code), top_k, ef, check)
            }
            Plan::Exact => {
                metrics::counter!("shard_hnsw_walks_total", "walk" => "exact").increment(1);
                g.exact(&s, 0..s.slots.len(), (query, &code), top_k, ef, filter)
            }
            // hnsw_rs never ends its layer-0 walk early when given a filter (it expands every
            // candidate left), which costs several times the distance evaluations: walk
            // unfiltered, keep what matches (tombstones dropped too); only when fewer than
            // top_k survive walk again with the filter.
            Plan::Walk { ef: walk_ef } => {
                let mut found = g.walk(&code, walk_ef);
                found.retain(|n| accept(&n.0));
                if found.len() < top_k {
                    found = g.filtered_walk(&s, &code, ef, top_k, &accept);
                }
                found
            }
            Plan::FilteredWalk => g.filtered_walk(&s, &code, ef, top_k, &accept),
        };
        // Every candidate rescored with its f32 vector: exact scores, exact order. The vectors
        // are separate allocations, so all their loads are started before the first is scored.
        for (id, _) in &found {
            if let Some(sl) = s.slots.get(*id) {
                prefetch_lines(&sl.vector, 2);
            }
        }
        let mut scored: Vec<(usize, f32)> = found
            .into_iter()
            .filter_map(|(id, _)| Some((id, dot(query, &s.slots.get(id)?.vector).min(1.0))))
            .collect();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        scored.truncate(top_k);
        let hits: Vec<(String, f32)> = scored
            .into_iter()
            .map(|(id, score)| (s.slots[id].chunk_id.clone(), score))
            .collect();
        merge_pending(hits, &pending, (query, &code), top_k, ef, filter)
    }

    /// The exact `top_k` live points matching `filter`: every one (or every candidate of the
    /// filter's postings) scored with its f32 vector, no graph walk, best first, equal scores
    /// by chunk id. Linear in the shard: for recall checks and comparing copies.
    pub fn search_exact(&self, query: &[f32], top_k: usize, filter: &Filter) -> Vec<(String, f32)> {
        let g = self.graph.read();
        let s = g.slots.read();
        let pending = self.pending.read();
        metrics::counter!("shard_hnsw_walks_total", "walk" => "exact_request").increment(1);
        let found = match planner::exact_candidates(&s.postings, filter) {
            Some(ids) => {
                let ids = ids.into_iter().map(|i| i as usize);
                planner::exact_f32(&s.slots, ids, query, top_k, filter)
            }
            None => planner::exact_f32(&s.slots, 0..s.slots.len(), query, top_k, filter),
        };
        let hits: Vec<(String, f32)> = found
            .into_iter()
            .map(|(id, score)| (s.slots[id].chunk_id.clone(), score))
            .collect();
        // An unbounded ef makes the pending scan score every match in f32.
        let code = sq8::encode(query);
        merge_pending(hits, &pending, (query, &code), top_k, usize::MAX, filter)
    }

    /// Replaces the graph with one built from `points` (the shard's live chunks), dropping every
    /// tombstone. Searches keep using the old graph until the swap.
    pub fn rebuild(&self, points: Vec<Point>) {
        let fresh = Self::empty_graph(&self.params, points.len());
        let codes = codes(&points);
        {
            let mut s = fresh.slots.write();
            for (i, p) in points.into_iter().enumerate() {
                s.by_chunk.insert(p.chunk_id.clone(), i);
                s.push(Slot::new(p, true));
            }
        }
        let data: Vec<(&Vec<i8>, usize)> = codes.iter().enumerate().map(|(i, c)| (c, i)).collect();
        fresh.hnsw.parallel_insert(&data);
        // Nothing changes a rebuilt graph before it is served: searches walk the copy at once.
        fresh.copy_flat();
        *self.graph.write() = fresh;
        self.pending.write().clear();
    }
}

/// The graph's `hits` (best first) merged with the pending points' own top_k for the same
/// query: best first, equal scores by chunk id, each chunk once.
fn merge_pending(
    mut hits: Vec<(String, f32)>,
    pending: &Pending,
    (query, code): (&[f32], &[i8]),
    top_k: usize,
    ef: usize,
    filter: &Filter,
) -> Vec<(String, f32)> {
    if pending.is_empty() {
        return hits;
    }
    let points = pending.points();
    hits.extend(
        pending
            .search(query, code, top_k, ef, filter)
            .into_iter()
            .map(|(i, score)| (points[i].chunk_id.clone(), score)),
    );
    hits.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut seen = HashSet::new();
    hits.retain(|h| seen.insert(h.0.clone()));
    hits.truncate(top_k);
    hits
}

impl HnswIndex {
    /// Tombstones every live point of the given documents; returns how many.
    pub fn tombstone_docs(&self, docs: &HashSet<String>) -> usize {
        let g = self.graph.read();
        let mut s = g.slots.write();
        let mut n = 0;
        for i in 0..s.slots.len() {
            if s.slots[i].alive && docs.contains(&s.slots[i].doc_id) {
                s.slots[i].kill();
                let id = s.slots[i].chunk_id.clone();
                if s.by_chunk.get(&id) == Some(&i) {
                    s.by_chunk.remove(&id);
                }
                s.dead += 1;
                n += 1;
            }
        }
        n
    }
}
