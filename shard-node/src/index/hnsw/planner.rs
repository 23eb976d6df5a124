//! How a filtered search walks the graph, chosen by the share of points the filter matches
//! (as Qdrant plans by the cardinality its payload index estimates):
//!
//! - a large share (at least `POST_FILTER_MIN_SHARE`): the plain walk, widened to
//!   ef / sqrt(share), keeping what matches;
//! - otherwise few matches (at most `EXACT_MAX_MATCHES`): no walk at all, every matching
//!   point scored exactly (recall 1, and cheaper than a walk that must cross many
//!   non-matching points); more than `SHORTLIST_ABOVE` candidates are first narrowed to
//!   `SHORTLIST` by their one-bit codes (`bq`), which all fit in cache where the int8 codes
//!   do not;
//! - in between: hnsw_rs's filtered walk, which crosses non-matching points but keeps only
//!   matching ones.
//!
//! The graph keeps a payload index beside its slot table (`Postings`: for every metadata term
//! the BM25 index also stores, the slots holding it, in slot order, as Qdrant's payload index
//! does), so a filter with a selective indexed condition finds its candidates without reading
//! every point: the slots of its smallest `must` condition (or the union of its `should`
//! ones) are checked against the whole filter and scored. Slots only ever append, so a
//! posting list stays sorted; tombstones stay in it and are skipped (a rebuild drops them).
//! The share of a filter the postings answer whole (one condition) is counted from them
//! (tombstones included); any other filter's is estimated from an even sample of the slot
//! table. A wrong guess
//! costs speed, never results (a walk that ends with fewer than top_k matches falls back to
//! the filtered walk, and that one to the exact scan).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::ops::Bound;

use super::distance::{OrdF32, dot};
use super::prefetch_lines;
use crate::index::Filter;
use crate::index::filter::{self, Cond, Meta};

/// What the planner reads of a graph point (the graph's slots implement it).
pub(super) trait Candidate {
    fn alive(&self) -> bool;
    fn meta(&self) -> &Meta;
    fn vector(&self) -> &[f32];
    fn chunk_id(&self) -> &str;
}

/// At most this many estimated matches are scored exactly, by int8 code (384 bytes each for
/// MiniLM, read in slot order) then rescored: `filterbench`, one colocated shard of 100k
/// SciFact chunks, a 10% filter (10k matches) through hnsw_rs's filtered walk took 7.6 ms of
/// CPU per query (247 QPS at 8 clients) where the plain walk takes 0.3; scoring the 10k
/// matches exactly is a linear read of 3.8 MB.
pub const EXACT_MAX_MATCHES: usize = 20_000;
/// Candidate lists longer than this are shortlisted by their one-bit codes (`shortlist`)
/// before the int8 scan.
pub const SHORTLIST_ABOVE: usize = 4 * SHORTLIST;
/// How many candidates the one-bit estimate passes on to the int8 scan. `hnswbench
/// --filters 10`, 100k SciFact MiniLM chunks, a filter matching 10k, one thread: the int8
/// scan of all 10k p50 348 us at recall@10 1.0; shortlists of 256 / 384 / 512 273 / 280 /
/// 301 us at 0.9987 / 0.9997 / 1.0 (Intel Xeon, AVX-512, every code in its 480 MiB L3).
pub const SHORTLIST: usize = 384;
/// Up to this many live points every filtered search is scored exactly.
const SMALL: usize = 5_000;
/// At least this share of matches: the plain walk widened to ef / sqrt(share) (`filterbench`,
/// 100k chunks, 50% filter: 3 shards of 33k points 716 QPS at recall 0.997 walking ef 128,
/// 283 scoring the 16.7k matches of each shard exactly; ef / sqrt(share) = 91 instead of
/// ef / share = 128: 1.97 against 2.52 ms of CPU per query at recall 0.995 against 0.997, and
/// one colocated shard 0.58 against 0.69 ms at 0.977 against 0.981).
pub const POST_FILTER_MIN_SHARE: f64 = 0.2;
/// How many candidates ahead a scan of scattered slots starts loading their codes.
pub(super) const AHEAD: usize = 8;
/// Cache lines of an int8 code prefetched (a MiniLM code spans 7; the hardware prefetcher
/// follows a sequential read from there).
const CODE_LINES: usize = 4;
/// Slots sampled for the estimate.
const SAMPLE: usize = 512;
/// A range condition spanning more distinct values than this is not read from the postings
/// (summing them would cost more than the sample).
const MAX_RANGE_TERMS: usize = 4096;

/// Metadata terms (`index::filter::terms`) to the slots holding them, ascending.
#[derive(Default)]
pub(super) struct Postings(BTreeMap<String, Vec<u32>>);

impl Postings {
    /// Indexes slot `id` (the next one: ids only grow).
    pub(super) fn add(&mut self, id: usize, meta: &Meta) {
        for t in filter::terms(meta) {
            self.0.entry(t).or_default().push(id as u32);
        }
    }

    /// Moves slots from the terms of their old metadata to those of their new one (in place
    /// updates), keeping every list ascending; each touched list is rewritten once.
    pub(super) fn reindex<'a>(
        &mut self,
        changes: impl Iterator<Item = (usize, &'a Meta, &'a Meta)>,
    ) {
        let mut gone: HashMap<String, HashSet<u32>> = HashMap::new();
        let mut came: HashMap<String, Vec<u32>> = HashMap::new();
        for (id, old, new) in changes {
            let (old, new): (HashSet<String>, HashSet<String>) = (
                filter::terms(old).into_iter().collect(),
                filter::terms(new).into_iter().collect(),
            );
            for t in old.difference(&new) {
                gone.entry(t.clone()).or_default().insert(id as u32);
            }
            for t in new.difference(&old) {
                came.entry(t.clone()).or_default().push(id as u32);
            }
        }
        for (t, ids) in gone {
            if let Some(list) = self.0.get_mut(&t) {
                list.retain(|x| !ids.contains(x));
                if list.is_empty() {
                    self.0.remove(&t);
                }
            }
        }
        for (t, ids) in came {
            let list = self.0.entry(t).or_default();
            list.extend(ids);
            list.sort_unstable();
            list.dedup();
        }
    }

    fn term(&self, t: &str) -> &[u32] {
        self.0.get(t).map_or(&[], Vec::as_slice)
    }

    /// Posting lists whose union holds every slot matching `c` (None: not answerable here).
    fn cond<'a>(&'a self, c: &Cond) -> Option<Vec<&'a [u32]>> {
        Some(match c {
            Cond::Eq(f, v) => vec![self.term(&filter::scalar_term(f, v))],
            Cond::AnyOf(f, set) => set
                .iter()
                .map(|v| self.term(&filter::scalar_term(f, v)))
                .collect(),
            Cond::Exists(f) => vec![self.term(&filter::exists_term(f))],
            Cond::Range(f, lo, hi) => {
                let (lo, hi) = filter::range_terms(f, lo, hi);
                // BTreeMap::range panics on an empty range; nothing matches one.
                let empty = match (&lo, &hi) {
                    (Bound::Included(a), Bound::Included(b)) => a > b,
                    (
                        Bound::Included(a) | Bound::Excluded(a),
                        Bound::Included(b) | Bound::Excluded(b),
                    ) => a >= b,
                    _ => false,
                };
                if empty {
                    return Some(Vec::new());
                }
                let lists: Vec<&[u32]> = self
                    .0
                    .range::<String, _>((lo, hi))
                    .take(MAX_RANGE_TERMS + 1)
                    .map(|(_, v)| v.as_slice())
                    .collect();
                if lists.len() > MAX_RANGE_TERMS {
                    return None;
                }
                lists
            }
            Cond::Nested(f) => self.candidates(f)?,
        })
    }

    /// Posting lists whose union holds every slot matching `f`: its smallest answerable
    /// `must` condition, else the union of its `should` ones when all are answerable.
    fn candidates<'a>(&'a self, f: &Filter) -> Option<Vec<&'a [u32]>> {
        let size = |l: &Vec<&[u32]>| l.iter().map(|p| p.len()).sum::<usize>();
        let best = f.must.iter().filter_map(|c| self.cond(c)).min_by_key(size);
        if best.is_some() || f.should.is_empty() {
            return best;
        }
        let mut all = Vec::new();
        for c in &f.should {
            all.extend(self.cond(c)?);
        }
        Some(all)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// Score every matching point among these candidate slots (sorted, deduplicated); with
    /// `exact`, every candidate matches (the filter is one condition the postings answer).
    Candidates { ids: Vec<u32>, exact: bool },
    /// Score every matching point.
    Exact,
    /// The plain walk with this ef, then keep the matching points.
    Walk { ef: usize },
    /// hnsw_rs's filtered walk.
    FilteredWalk,
}

/// The plan for `filter` over a slot table with `live` live points, for a search at `ef`.
pub(super) fn plan(
    slots: &[impl Candidate],
    postings: &Postings,
    live: usize,
    filter: &Filter,
    ef: usize,
) -> Plan {
    if filter.is_empty() {
        return Plan::Walk { ef };
    }
    if live <= SMALL {
        return Plan::Exact;
    }
    // A filter the postings answer whole has its share counted, not sampled.
    let lists = postings.candidates(filter);
    if postings_answer(filter)
        && let Some(lists) = &lists
    {
        let matches: usize = lists.iter().map(|l| l.len()).sum();
        return match counted(matches, live, ef) {
            Counted::Walk { ef } => Plan::Walk { ef },
            Counted::Candidates => Plan::Candidates {
                ids: union(lists),
                exact: true,
            },
            Counted::FilteredWalk => Plan::FilteredWalk,
        };
    }
    let step = (slots.len() / SAMPLE).max(1);
    let (mut seen, mut hits) = (0usize, 0usize);
    for sl in slots.iter().step_by(step) {
        if sl.alive() {
            seen += 1;
            hits += usize::from(filter.matches(sl.meta()));
        }
    }
    let share = hits as f64 / seen.max(1) as f64;
    if seen > 0 && share >= POST_FILTER_MIN_SHARE {
        return Plan::Walk {
            ef: widened(ef, share),
        };
    }
    if let Some(lists) = lists
        && lists.iter().map(|l| l.len()).sum::<usize>() <= EXACT_MAX_MATCHES
    {
        return Plan::Candidates {
            ids: union(&lists),
            exact: false,
        };
    }
    if seen == 0 || share * live as f64 <= EXACT_MAX_MATCHES as f64 {
        Plan::Exact
    } else {
        Plan::FilteredWalk
    }
}

/// Candidates scored by int8 code (with their checks) that cost about as much as one step of
/// a graph walk, and candidates estimated by one-bit code (`bq`) that do: `hnswbench
/// --filters`, 100k SciFact MiniLM chunks, one thread, ef 64: the plain walk p50 112 us
/// (1.75 us a step), 100 / 1,000 postings candidates scanned 11 / 48 us, 10,000 shortlisted
/// to 384 then scanned 286 us.
pub const CANDIDATES_PER_STEP: usize = 32;
const ESTIMATES_PER_STEP: usize = 64;

/// What a search of `filter` at `ef` over `live` points costs, in graph-walk steps (a plain
/// walk at ef costs about ef), read from the postings' list lengths without building the plan;
/// None where only the plan's sample of the slot table could tell. The service runs a cheap
/// search on its async worker and hands a costly one's core to the other connections first.
pub(super) fn cost(postings: &Postings, live: usize, filter: &Filter, ef: usize) -> Option<usize> {
    if filter.is_empty() {
        return Some(ef);
    }
    if live <= SMALL {
        return Some(live.div_ceil(CANDIDATES_PER_STEP));
    }
    let matches: usize = postings.candidates(filter)?.iter().map(|l| l.len()).sum();
    let scan = || {
        if matches > SHORTLIST_ABOVE {
            SHORTLIST.div_ceil(CANDIDATES_PER_STEP) + matches.div_ceil(ESTIMATES_PER_STEP)
        } else {
            matches.div_ceil(CANDIDATES_PER_STEP)
        }
    };
    if postings_answer(filter) {
        return match counted(matches, live, ef) {
            Counted::Walk { ef } => Some(ef),
            Counted::Candidates => Some(scan()),
            Counted::FilteredWalk => None,
        };
    }
    (matches <= EXACT_MAX_MATCHES).then(scan)
}

/// How a filter the postings answer whole is searched, decided by its counted `matches` among
/// `live` points (one decision for `plan` and `cost`): a share of at least
/// `POST_FILTER_MIN_SHARE` by the widened walk, up to `EXACT_MAX_MATCHES` by scoring the
/// postings' candidates, more by hnsw_rs's filtered walk.
enum Counted {
    Walk { ef: usize },
    Candidates,
    FilteredWalk,
}

fn counted(matches: usize, live: usize, ef: usize) -> Counted {
    let share = matches as f64 / live as f64;
    if share >= POST_FILTER_MIN_SHARE {
        Counted::Walk {
            ef: widened(ef, share),
        }
    } else if matches <= EXACT_MAX_MATCHES {
        Counted::Candidates
    } else {
        Counted::FilteredWalk
    }
}

/// The ef of a plain walk that keeps the matches of a filter matching `share` of the points:
/// ef / sqrt(share) (`POST_FILTER_MIN_SHARE`).
fn widened(ef: usize, share: f64) -> usize {
    (ef as f64 / share.min(1.0).sqrt()).ceil() as usize
}

/// The slots of posting lists, ascending, each once.
fn union(lists: &[&[u32]]) -> Vec<u32> {
    let mut ids: Vec<u32> = lists.concat();
    if lists.len() > 1 {
        ids.sort_unstable();
        ids.dedup();
    }
    ids
}

/// The slots an exact search with `filter` has to read: the postings' candidates when the
/// filter has a condition they answer (each still checked against the whole filter), else
/// None (every slot).
pub(super) fn exact_candidates(postings: &Postings, filter: &Filter) -> Option<Vec<u32>> {
    if filter.is_empty() {
        return None;
    }
    postings.candidates(filter).map(|lists| union(&lists))
}

/// Whether the candidates of `filter` are exactly its matches (one condition the postings
/// answer whole), so they need no second check.
fn postings_answer(f: &Filter) -> bool {
    f.should.is_empty()
        && f.must_not.is_empty()
        && matches!(
            f.must.as_slice(),
            [Cond::Eq(..) | Cond::AnyOf(..) | Cond::Exists(_) | Cond::Range(..)]
        )
}

/// The best live points matching `filter` among the slots `ids` yields: (slot, score), in no
/// particular order. With `codes` (the flat copy's int8 codes, 4x fewer bytes to read than the
/// f32 vectors) the `keep` best by code score are returned, for the caller to rescore with
/// their f32 vectors (as `pending`'s scan; slots without a code are scored in f32 at once);
/// without, the `keep` best by f32 score.
pub(super) fn exact<'a>(
    slots: &[impl Candidate],
    ids: impl Iterator<Item = usize> + Clone,
    (query, qcode): (&[f32], &[i8]),
    keep: usize,
    filter: &Filter,
    codes: Option<&dyn Fn(usize) -> Option<&'a [i8]>>,
) -> Vec<(usize, f32)> {
    let mut heap: BinaryHeap<Reverse<(OrdF32, usize)>> = BinaryHeap::with_capacity(keep + 1);
    // Candidates from postings are scattered over the codes: a later one's code starts
    // loading while this one is scored.
    let mut ahead = ids.clone().skip(AHEAD);
    for id in ids {
        if let (Some(a), Some(codes)) = (ahead.next(), codes)
            && let Some(code) = codes(a)
        {
            prefetch_lines(code, CODE_LINES);
        }
        let Some(sl) = slots.get(id) else { continue };
        if !sl.alive() || !filter.matches(sl.meta()) {
            continue;
        }
        let score = match codes.and_then(|c| c(id)) {
            Some(code) => super::sq8::dot(qcode, code),
            None => dot(query, sl.vector()),
        };
        if heap.len() == keep && heap.peek().is_some_and(|m| score <= m.0.0.0) {
            continue;
        }
        heap.push(Reverse((OrdF32(score), id)));
        if heap.len() > keep {
            heap.pop();
        }
    }
    heap.into_iter().map(|Reverse((s, id))| (id, s.0)).collect()
}

/// The `top_k` best live points matching `filter` among the slots `ids` yields, every one
/// scored with its f32 vector (no int8 preselection): (slot, cosine), best first. Equal
/// scores are ordered by chunk id, not slot, so two copies of a collection whose slots were
/// filled in another order (a restore) give the same list.
pub(super) fn exact_f32(
    slots: &[impl Candidate],
    ids: impl Iterator<Item = usize>,
    query: &[f32],
    top_k: usize,
    filter: &Filter,
) -> Vec<(usize, f32)> {
    // Min-heap: its top is the worst kept point (lowest score, then the greatest chunk id).
    let mut heap: BinaryHeap<Reverse<(OrdF32, Reverse<&str>, usize)>> =
        BinaryHeap::with_capacity(top_k + 1);
    for id in ids {
        let Some(sl) = slots.get(id) else { continue };
        if !sl.alive() || !filter.matches(sl.meta()) {
            continue;
        }
        let score = OrdF32(dot(query, sl.vector()).min(1.0));
        let key = (score, Reverse(sl.chunk_id()), id);
        if heap.len() == top_k && heap.peek().is_some_and(|m| key <= m.0) {
            continue;
        }
        heap.push(Reverse(key));
        if heap.len() > top_k {
            heap.pop();
        }
    }
    // Ascending in `Reverse` order: the best key first.
    heap.into_sorted_vec()
        .into_iter()
        .map(|Reverse((s, _, id))| (id, s.0))
        .collect()
}

/// The slots worth scoring by int8 code, ascending: the `SHORTLIST` live ones matching `filter`
/// whose one-bit estimates (`est`: (estimate, slot)) are best, and every matching one of
/// `uncoded` (slots the one-bit codes do not cover). Only those are read from the slot table,
/// in rounds from the best estimate down until enough of them are live and match.
pub(super) fn shortlist(
    slots: &[impl Candidate],
    (mut est, uncoded): (Vec<(f32, u32)>, Vec<u32>),
    filter: &Filter,
) -> Vec<u32> {
    let len = SHORTLIST;
    let check = |id: u32| {
        slots
            .get(id as usize)
            .is_some_and(|s| s.alive() && filter.matches(s.meta()))
    };
    let mut out: Vec<u32> = uncoded.into_iter().filter(|id| check(*id)).collect();
    let (mut rest, mut taken) = (est.as_mut_slice(), 0);
    while taken < len && !rest.is_empty() {
        let n = (len - taken).max(64).min(rest.len());
        if n < rest.len() {
            rest.select_nth_unstable_by(n - 1, |a, b| b.0.total_cmp(&a.0));
        }
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
        for &(_, id) in head.iter() {
            if check(id) {
                out.push(id);
                taken += 1;
            }
        }
        rest = tail;
    }
    out.sort_unstable();
    out
}
