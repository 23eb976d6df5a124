use std::collections::HashSet;

use super::*;
use crate::index::filter::{Meta, Value};

fn parity(i: u32) -> Meta {
    vec![("parity".into(), Value::Keyword((i % 2).to_string()))]
}

/// A unit vector determined by `seed` (shared with the `hnsw::flat` tests).
pub(crate) fn unit(seed: u32, dim: usize) -> Vec<f32> {
    let mut v: Vec<f32> = (0..dim)
        .map(|i| ((seed as f32 + 1.0) * (i as f32 + 0.5)).sin())
        .collect();
    normalize(&mut v);
    v
}

/// An index of `n` points `d{i}#0` with vectors `unit(i, dim)` and metadata `meta(i)`.
fn index_of(n: u32, dim: usize, meta: impl Fn(u32) -> Meta) -> HnswIndex {
    let idx = HnswIndex::new(dim, params(), n as usize);
    idx.insert(
        (0..n)
            .map(|i| Point {
                chunk_id: format!("d{i}#0"),
                doc_id: format!("d{i}"),
                vector: unit(i, dim),
                meta: meta(i),
            })
            .collect(),
    );
    idx
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
            doc_id: format!("d{i}"),
            vector: unit(i, 32),
            meta: parity(i),
        })
        .collect();
    idx.insert(pts);
    let h = idx.search(&unit(5, 32), 3, 64, &Filter::default());
    assert_eq!(h[0].0, "d5#0");
    assert!((h[0].1 - 1.0).abs() < 1e-5);
    idx.remove(&["d5#0".to_string()]);
    let h = idx.search(&unit(5, 32), 3, 64, &Filter::default());
    assert!(h.iter().all(|(id, _)| id != "d5#0"));
    assert_eq!(idx.counts(), (199, 1));
    // Small filtered sets are scored exactly: the best odd points, d5 gone.
    let h = idx.search(&unit(5, 32), 3, 64, &Filter::keywords([("parity", "1")]));
    let mut exact: Vec<(String, f32)> = (1..200)
        .step_by(2)
        .filter(|&i| i != 5)
        .map(|i| (format!("d{i}#0"), dot(&unit(5, 32), &unit(i, 32))))
        .collect();
    exact.sort_by(|a, b| b.1.total_cmp(&a.1));
    let ids = |v: &[(String, f32)]| v.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&h), ids(&exact[..3]));
    // Re-inserting a chunk id replaces the old point.
    idx.insert(vec![Point {
        chunk_id: "d7#0".into(),
        doc_id: "d7".into(),
        vector: unit(500, 32),
        meta: vec![],
    }]);
    assert_eq!(idx.counts(), (199, 2));
}

/// The unfiltered walk drops tombstones after the fact; when they crowd out the live
/// neighbours (all of the walk's ef results dead), the filtered walk still finds top_k. That
/// walk can itself stall inside the dead cluster (hnsw_rs grows its results only from accepted
/// points), which graph builds (parallel, so not deterministic) do now and then: several builds,
/// and every one must answer in full, by the filtered walk or the exact scan behind it.
#[test]
fn tombstones_crowding_the_walk_fall_back_to_the_filtered_walk() {
    let base = unit(3, 32);
    for _build in 0..8 {
        let idx = HnswIndex::new(32, params(), 300);
        // 40 near-copies of one vector, then 200 unrelated points.
        let near: Vec<Point> = (0..40)
            .map(|i| {
                let mut v: Vec<f32> = base
                    .iter()
                    .enumerate()
                    .map(|(j, x)| x + 0.001 * ((i * 7 + j) % 5) as f32)
                    .collect();
                normalize(&mut v);
                Point {
                    chunk_id: format!("n{i}#0"),
                    doc_id: format!("n{i}"),
                    vector: v,
                    meta: vec![],
                }
            })
            .collect();
        let far: Vec<Point> = (100..300)
            .map(|i| Point {
                chunk_id: format!("d{i}#0"),
                doc_id: format!("d{i}"),
                vector: unit(i, 32),
                meta: vec![],
            })
            .collect();
        idx.insert(near);
        idx.insert(far);
        let dead: Vec<String> = (0..40).map(|i| format!("n{i}#0")).collect();
        idx.remove(&dead);
        // ef 16 < 40 tombstones nearest the query: every unfiltered result is dead.
        let h = idx.search(&base, 5, 16, &Filter::default());
        assert_eq!(h.len(), 5, "{h:?}");
        assert!(h.iter().all(|(id, _)| id.starts_with('d')), "{h:?}");
    }
}

/// Pending points (caught up at open) are found before and after they enter the graph,
/// filtered like graph points, and never twice.
#[test]
fn pending_points_are_searched_beside_the_graph() {
    let idx = HnswIndex::new(32, params(), 100);
    let point = |i: u32| Point {
        chunk_id: format!("d{i}#0"),
        doc_id: format!("d{i}"),
        vector: unit(i, 32),
        meta: parity(i),
    };
    idx.insert((0..100).map(point).collect());
    idx.set_pending((100..110).map(point).collect(), 0);
    assert_eq!(idx.counts(), (110, 0));
    let top = |idx: &HnswIndex| idx.search(&unit(105, 32), 3, 64, &Filter::default());
    let before = top(&idx);
    assert_eq!(before[0].0, "d105#0");
    assert!((before[0].1 - 1.0).abs() < 1e-5);
    let odd = idx.search(&unit(105, 32), 55, 64, &Filter::keywords([("parity", "1")]));
    assert_eq!(odd.len(), 55, "every odd point, the pending ones included");
    assert_eq!(odd[0].0, "d105#0");
    // Removing a pending chunk drops it before it ever reaches the graph.
    idx.remove(&["d109#0".to_string()]);
    assert_eq!(idx.absorb_pending(), 9);
    assert_eq!(idx.counts(), (109, 0));
    let after = top(&idx);
    assert_eq!(after[0].0, "d105#0");
    let ids: HashSet<&String> = after.iter().map(|h| &h.0).collect();
    assert_eq!(ids.len(), after.len(), "no hit twice");
}

/// Above the small-graph size every plan is taken: postings candidates (one indexed
/// condition, answered whole; a range; a union of `should`s; candidates checked against the
/// rest of the filter), the widened plain walk for a large share, and the full scan for a
/// condition the postings cannot answer. Each returns the exact filtered top 10 (the walk:
/// nearly), and never a tombstone.
#[test]
fn planned_filtered_searches_find_the_exact_filtered_top() {
    use crate::index::filter::{Cond, Scalar};
    use std::ops::Bound;
    let n = 6_000u32;
    let meta = |i: u32| -> Meta {
        vec![
            ("m10".into(), Value::Keyword((i % 10).to_string())),
            ("half".into(), Value::Keyword((i % 2).to_string())),
            ("n".into(), Value::Number(f64::from(i))),
        ]
    };
    let idx = index_of(n, 32, meta);
    idx.remove(
        &(0..n)
            .step_by(7)
            .map(|i| format!("d{i}#0"))
            .collect::<Vec<_>>(),
    );
    let kw = |f: &str, v: &str| Cond::Eq(f.into(), Scalar::Keyword(v.into()));
    let must = |c: Vec<Cond>| Filter {
        must: c,
        ..Filter::default()
    };
    let cases: Vec<(Filter, f64)> = vec![
        (Filter::keywords([("m10", "3")]), 1.0),
        (
            must(vec![Cond::Range(
                "n".into(),
                Bound::Included(100.0),
                Bound::Excluded(700.0),
            )]),
            1.0,
        ),
        (
            Filter {
                must: vec![kw("m10", "4")],
                must_not: vec![Cond::Range(
                    "n".into(),
                    Bound::Unbounded,
                    Bound::Excluded(3000.0),
                )],
                ..Filter::default()
            },
            1.0,
        ),
        (
            Filter {
                should: vec![kw("m10", "1"), kw("m10", "2")],
                ..Filter::default()
            },
            1.0,
        ),
        (
            Filter {
                must_not: vec![
                    kw("m10", "0"),
                    kw("m10", "1"),
                    kw("m10", "2"),
                    kw("m10", "3"),
                    kw("m10", "4"),
                ],
                ..Filter::default()
            },
            0.9,
        ),
        (Filter::keywords([("half", "1")]), 0.9),
    ];
    for (f, want) in &cases {
        let mut found = 0usize;
        for q in 0..20u32 {
            let query = unit(10_000 + q, 32);
            let got = idx.search(&query, 10, 64, f);
            let mut exact: Vec<(String, f32)> = (0..n)
                .filter(|i| !i.is_multiple_of(7) && f.matches(&meta(*i)))
                .map(|i| (format!("d{i}#0"), dot(&query, &unit(i, 32))))
                .collect();
            exact.sort_by(|a, b| b.1.total_cmp(&a.1));
            exact.truncate(10);
            assert!(got.iter().all(|(id, _)| {
                let i: u32 = id[1..id.len() - 2].parse().unwrap();
                !i.is_multiple_of(7) && f.matches(&meta(i))
            }));
            let want_ids: HashSet<&String> = exact.iter().map(|e| &e.0).collect();
            found += got.iter().filter(|g| want_ids.contains(&g.0)).count();
        }
        let recall = found as f64 / 200.0;
        assert!(recall >= *want, "{f:?}: recall {recall}");
    }
}

/// A filter with more matches than `planner::SHORTLIST_ABOVE` (and under the share that walks
/// the graph) is scored through the one-bit shortlist once the flat copy is current: the
/// results stay live and matching, and near the exact filtered top.
#[test]
fn many_filter_matches_are_shortlisted_by_their_one_bit_codes() {
    use crate::index::filter::{Cond, Scalar};
    use std::ops::Bound;
    let n = 30_000u32;
    let dim = 48;
    let meta = |i: u32| -> Meta {
        vec![
            ("m10".into(), Value::Keyword((i % 10).to_string())),
            ("n".into(), Value::Number(f64::from(i))),
        ]
    };
    let idx = index_of(n, dim, meta);
    let dead = |i: u32| i.is_multiple_of(7);
    idx.remove(
        &(0..n)
            .filter(|i| dead(*i))
            .map(|i| format!("d{i}#0"))
            .collect::<Vec<_>>(),
    );
    idx.refresh_flat();
    let cases = [
        // The postings answer it whole: 3,000 candidates, tombstones among them.
        Filter::keywords([("m10", "3")]),
        // Candidates from the postings, each checked against the range too.
        Filter {
            must: vec![
                Cond::Eq("m10".into(), Scalar::Keyword("4".into())),
                Cond::Range("n".into(), Bound::Included(5_000.0), Bound::Unbounded),
            ],
            ..Filter::default()
        },
    ];
    for f in &cases {
        let mut found = 0usize;
        for q in 0..20u32 {
            let query = unit(100_000 + q, dim);
            let got = idx.search(&query, 10, 64, f);
            assert_eq!(got.len(), 10);
            let mut exact: Vec<(String, f32)> = (0..n)
                .filter(|i| !dead(*i) && f.matches(&meta(*i)))
                .map(|i| (format!("d{i}#0"), dot(&query, &unit(i, dim))))
                .collect();
            exact.sort_by(|a, b| b.1.total_cmp(&a.1));
            exact.truncate(10);
            assert!(got.iter().all(|(id, _)| {
                let i: u32 = id[1..id.len() - 2].parse().unwrap();
                !dead(i) && f.matches(&meta(i))
            }));
            let want: HashSet<&String> = exact.iter().map(|e| &e.0).collect();
            found += got.iter().filter(|g| want.contains(&g.0)).count();
        }
        let recall = found as f64 / 200.0;
        assert!(recall >= 0.9, "{f:?}: recall {recall}");
    }
}

/// Points whose vector is unchanged take their new metadata in place (no new slot, no
/// tombstone), and a selective filter answered from the payload postings finds exactly the
/// points that hold the value now: the moved ones under their new term, none under the old.
#[test]
fn metadata_updated_in_place_moves_the_postings() {
    let n = 6_000u32;
    let idx = HnswIndex::new(32, params(), n as usize);
    let meta = |i: u32, tag: &str| -> Meta {
        vec![
            ("m100".into(), Value::Keyword((i % 100).to_string())),
            ("tag".into(), Value::Keyword(tag.into())),
        ]
    };
    let point = |i: u32, tag: &str| Point {
        chunk_id: format!("d{i}#0"),
        doc_id: format!("d{i}"),
        vector: unit(i, 32),
        meta: meta(i, tag),
    };
    idx.insert((0..n).map(|i| point(i, "old")).collect());
    // Every 100th point is tagged "new"; one more comes with a changed vector.
    let mut changed: Vec<Point> = (0..n).step_by(100).map(|i| point(i, "new")).collect();
    changed.push(Point {
        vector: unit(99_999, 32),
        ..point(1, "new")
    });
    let rest = idx.update_in_place(changed);
    assert_eq!(
        rest.len(),
        1,
        "only the point with a new vector is left to insert"
    );
    assert_eq!(rest[0].chunk_id, "d1#0");
    assert_eq!(idx.counts(), (n as usize, 0));
    let query = unit(3, 32);
    let new: Vec<String> = idx
        .search(&query, 100, 64, &Filter::keywords([("tag", "new")]))
        .into_iter()
        .map(|h| h.0)
        .collect();
    assert_eq!(new.len(), (n / 100) as usize);
    assert!(
        new.iter()
            .all(|id| id[1..id.len() - 2].parse::<u32>().unwrap() % 100 == 0)
    );
    let old_and_0 = idx.search(
        &query,
        10,
        64,
        &Filter::keywords([("tag", "old"), ("m100", "0")]),
    );
    assert!(
        old_and_0.is_empty(),
        "no point keeps its old term: {old_and_0:?}"
    );
}

/// An exact search scores every live matching point, graph and pending alike, and orders
/// equal scores by chunk id whatever order the slots were filled in.
#[test]
fn exact_search_is_the_brute_force_top_with_ties_by_chunk_id() {
    let idx = HnswIndex::new(32, params(), 2_000);
    let point = |id: String, seed: u32, i: u32| Point {
        doc_id: id.clone(),
        chunk_id: format!("{id}#0"),
        vector: unit(seed, 32),
        meta: parity(i),
    };
    let mut pts: Vec<Point> = (0..1_500).map(|i| point(format!("d{i}"), i, i)).collect();
    // Two more copies of d7's vector, slots filled against chunk-id order.
    pts.push(point("dup-b".into(), 7, 1));
    pts.push(point("dup-a".into(), 7, 1));
    idx.insert(pts);
    idx.set_pending(
        (1_500..1_600)
            .map(|i| point(format!("d{i}"), i, i))
            .collect(),
        0,
    );
    let gone: Vec<String> = (0..1_600).step_by(7).map(|i| format!("d{i}#0")).collect();
    idx.remove(&gone[1..]); // d0 stays; d7 is removed with the rest
    let mut live: Vec<(String, Vec<f32>, u32)> = (0..1_600u32)
        .filter(|i| i % 7 != 0 || *i == 0)
        .map(|i| (format!("d{i}#0"), unit(i, 32), i))
        .collect();
    live.push(("dup-a#0".into(), unit(7, 32), 1));
    live.push(("dup-b#0".into(), unit(7, 32), 1));
    let brute = |q: &[f32], odd_only: bool, k: usize| {
        let mut v: Vec<(String, f32)> = live
            .iter()
            .filter(|p| !odd_only || p.2 % 2 == 1)
            .map(|p| (p.0.clone(), dot(q, &p.1).min(1.0)))
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v.truncate(k);
        v
    };
    let odd = Filter::keywords([("parity", "1")]);
    for seed in [7, 11, 1_550, 4_000] {
        let q = unit(seed, 32);
        assert_eq!(
            idx.search_exact(&q, 10, &Filter::default()),
            brute(&q, false, 10)
        );
        assert_eq!(idx.search_exact(&q, 25, &odd), brute(&q, true, 25));
    }
    let tied = idx.search_exact(&unit(7, 32), 2, &Filter::default());
    assert_eq!(tied[0].0, "dup-a#0");
    assert_eq!(tied[1].0, "dup-b#0");
}

/// A search's cost estimate (which decides whether the service runs it inline) follows what
/// its plan reads: a plain walk costs ef, a filter of a few postings matches a step or two, a
/// wide one the widened walk, deferred points their scan, and a filter only the plan's sample
/// could size is unknown.
#[test]
fn search_cost_follows_the_plan() {
    use crate::index::filter::{Cond, Scalar};
    let meta = |i: u32| -> Meta {
        vec![
            ("m1000".into(), Value::Keyword((i % 1000).to_string())),
            ("half".into(), Value::Keyword((i % 2).to_string())),
        ]
    };
    let idx = index_of(6_000, 16, meta);
    assert_eq!(idx.search_cost(64, &Filter::default()), Some(64));
    // 6 matches: one step of scoring.
    assert_eq!(
        idx.search_cost(64, &Filter::keywords([("m1000", "3")])),
        Some(1)
    );
    // Half the points: the walk widened to 64 / sqrt(0.5).
    assert_eq!(
        idx.search_cost(64, &Filter::keywords([("half", "1")])),
        Some(91)
    );
    let only_not = Filter {
        must_not: vec![Cond::Eq("half".into(), Scalar::Keyword("1".into()))],
        ..Filter::default()
    };
    assert_eq!(idx.search_cost(64, &only_not), None);
    idx.defer(
        (0..64u32)
            .map(|i| Point {
                chunk_id: format!("p{i}#0"),
                doc_id: format!("p{i}"),
                vector: unit(50_000 + i, 16),
                meta: meta(i),
            })
            .collect(),
        1,
    );
    assert_eq!(idx.search_cost(64, &Filter::default()), Some(66));
}
