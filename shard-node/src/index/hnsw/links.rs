//! Mending the links hnsw_rs's insert loses, in the flat copy (`hnsw::flat`) of a graph:
//! hnsw_rs adds a new point to each neighbour's list and drops that list's farthest entry when
//! it overflows, so a crowd of near-duplicates pushes out the links that led into it, and
//! whole crowds end up with no link leading in. The copy gives each list back some of its
//! in-links (`with_reverse_links`) and links every point no walk reaches (`link_unreachable`).

use std::collections::HashMap;

use hnsw_rs::hnsw::Neighbour;
use rayon::prelude::*;

use super::prefetch_lines;

/// Marks every point reachable from `from` (layer-0 lists from `list`, upper layers from
/// `upper`) in `seen`.
pub(super) fn spread<'a>(
    from: u32,
    list: &impl Fn(usize) -> &'a [u32],
    upper: &'a HashMap<u32, Vec<Vec<u32>>>,
    seen: &mut [bool],
) {
    if std::mem::replace(&mut seen[from as usize], true) {
        return;
    }
    let mut stack = vec![from];
    while let Some(p) = stack.pop() {
        let up = upper.get(&p).into_iter().flatten().flatten();
        for &nb in list(p as usize).iter().chain(up) {
            if !std::mem::replace(&mut seen[nb as usize], true) {
                stack.push(nb);
            }
        }
    }
}

/// Layer 0's lists as rows of a fixed width, so a row's address is known without a load
/// (`with_reverse_links` prefetches the rows it is about to read): row i's ids are
/// `ids[i * width..][..len[i]]`, its hnsw_rs distances beside them in `dist`.
pub(super) struct Rows {
    width: usize,
    ids: Vec<u32>,
    dist: Vec<f32>,
    len: Vec<u16>,
}

impl Rows {
    pub(super) fn new(rows: usize, width: usize) -> Self {
        let width = width.clamp(1, u16::MAX as usize);
        Self {
            width,
            ids: vec![u32::MAX; rows * width],
            dist: vec![0.0; rows * width],
            len: vec![0; rows],
        }
    }

    /// Each row from `list` of the point at its index, on every index thread; a list
    /// longer than the width keeps its nearest entries, in their order (hnsw_rs bounds
    /// layer 0 at 2M, the width `build` gives, so none is cut).
    pub(super) fn fill<P: Sync>(
        &mut self,
        points: &[Option<(usize, P)>],
        list: impl Fn(&P) -> Vec<Neighbour> + Sync,
    ) {
        let (width, rows) = (self.width, points.len().min(self.len.len()));
        self.ids[..rows * width]
            .par_chunks_mut(width)
            .zip(self.dist[..rows * width].par_chunks_mut(width))
            .zip(self.len[..rows].par_iter_mut())
            .zip(points[..rows].par_iter())
            .for_each(|(((ids, dist), len), p)| {
                let Some((_, p)) = p else { return };
                let mut l = list(p);
                l.retain(|n| n.d_id < rows);
                if l.len() > width {
                    let mut keep: Vec<usize> = (0..l.len()).collect();
                    keep.sort_by(|&a, &b| l[a].distance.total_cmp(&l[b].distance));
                    keep.truncate(width);
                    keep.sort_unstable();
                    l = keep.into_iter().map(|k| l[k]).collect();
                }
                for (k, n) in l.iter().enumerate() {
                    (ids[k], dist[k]) = (n.d_id as u32, n.distance);
                }
                *len = l.len() as u16;
            });
    }

    fn count(&self) -> usize {
        self.len.len()
    }

    fn ids(&self, i: usize) -> &[u32] {
        &self.ids[i * self.width..i * self.width + self.len[i] as usize]
    }

    fn dists(&self, i: usize) -> &[f32] {
        &self.dist[i * self.width..i * self.width + self.len[i] as usize]
    }
}

/// Layer 0's lists (ids, `near`'s order) each followed by up to `extra` of the points that
/// name it but that it does not name, nearest first. hnsw_rs adds a new point to each
/// neighbour's list and drops that list's farthest entry when it overflows, so a point's
/// in-links go whenever a closer crowd arrives; hnswlib keeps links two-way by re-selecting
/// instead. On 100k SciFact vectors the links add 0.005-0.015 recall@10 at ef 32-128 for the
/// same walk time; on 1M with 89 near-copies of each chunk, where whole crowds end up with no
/// in-link at all, 0.08-0.13 (docs/bench/2026-11-28-flat-reverse-links.json).
///
/// Checking whether a link has one back reads the other end's row: one cache miss per link
/// (about 32M at 1M points), so a point's rows are all prefetched before the first is read.
pub(super) fn with_reverse_links(near: &Rows, extra: usize) -> Vec<Vec<u32>> {
    let n = near.count();
    // best[q * extra..]: the nearest `extra` (distance, p) naming q, unordered.
    let mut best = vec![(f32::INFINITY, u32::MAX); n * extra];
    if extra > 0 {
        for p in 0..n {
            let ids = near.ids(p);
            for &q in ids {
                prefetch_lines(near.ids(q as usize), 2);
                prefetch_lines(&best[q as usize * extra..(q as usize + 1) * extra], 1);
            }
            for (&q, &d) in ids.iter().zip(near.dists(p)) {
                let q = q as usize;
                if near.ids(q).contains(&(p as u32)) {
                    continue;
                }
                let slots = &mut best[q * extra..(q + 1) * extra];
                let worst = (0..extra)
                    .max_by(|&a, &b| slots[a].0.total_cmp(&slots[b].0))
                    .unwrap_or(0);
                if d < slots[worst].0 {
                    slots[worst] = (d, p as u32);
                }
            }
        }
    }
    (0..n)
        .map(|q| {
            let mut back: Vec<(f32, u32)> = best
                .get(q * extra..(q + 1) * extra)
                .unwrap_or_default()
                .iter()
                .copied()
                .filter(|b| b.1 != u32::MAX)
                .collect();
            back.sort_by(|a, b| a.0.total_cmp(&b.0));
            near.ids(q)
                .iter()
                .copied()
                .chain(back.into_iter().map(|b| b.1))
                .collect()
        })
        .collect()
}

/// Links each point that no walk from the entry reaches into layer 0 from its nearest
/// neighbour that one does (its own list is nearest first), until no more can be; returns
/// how many it linked. A point none of whose neighbours is reached (hnsw_rs can leave one of
/// the first points of a parallel insert with an empty list that no later list kept) is linked
/// from the reached point nearest it by `dist`, found by scanning them all: once per such
/// island, and only for islands, so rare.
pub(super) fn link_unreachable(
    lists: &mut [Vec<u32>],
    upper: &HashMap<u32, Vec<Vec<u32>>>,
    entry: Option<(u32, usize)>,
    present: &[bool],
    dist: impl Fn(usize, usize) -> f32,
) -> usize {
    let Some((e, _)) = entry else { return 0 };
    let mut seen = vec![false; lists.len()];
    spread(e, &|i| lists[i].as_slice(), upper, &mut seen);
    let mut linked = 0;
    loop {
        let before = linked;
        for p in 0..lists.len() {
            if seen[p] || !present[p] {
                continue;
            }
            let Some(&q) = lists[p].iter().find(|&&q| seen[q as usize]) else {
                continue;
            };
            lists[q as usize].push(p as u32);
            linked += 1;
            spread(p as u32, &|i| lists[i].as_slice(), upper, &mut seen);
        }
        if linked > before {
            continue;
        }
        let Some(p) = (0..lists.len()).find(|&p| present[p] && !seen[p]) else {
            return linked;
        };
        let Some(q) = (0..lists.len())
            .filter(|&q| seen[q] && present[q])
            .min_by(|&a, &b| dist(p, a).total_cmp(&dist(p, b)))
        else {
            return linked;
        };
        lists[q].push(p as u32);
        linked += 1;
        spread(p as u32, &|i| lists[i].as_slice(), upper, &mut seen);
    }
}

#[cfg(test)]
mod tests {
    use hnsw_rs::hnsw::PointId;

    use super::*;

    #[test]
    fn points_no_walk_reaches_are_linked_from_their_nearest_reached_neighbour() {
        // 0 <-> 1 hold the entry; 2 names 4 (unreached), then 1 and 0; 3 names only 2 (reached
        // once 2 is); 4 <-> 5 name only each other; 6 is not in the graph; 7 names nothing and
        // 8 only 7: an island, linked from the reached point nearest 7 (by `dist`: 5).
        let mut lists: Vec<Vec<u32>> = vec![
            vec![1],
            vec![0],
            vec![4, 1, 0],
            vec![2],
            vec![5],
            vec![4],
            vec![],
            vec![],
            vec![7],
        ];
        let mut present = [true; 9];
        present[6] = false;
        let upper = HashMap::from([(0, vec![vec![]])]);
        let dist = |a: usize, b: usize| (a as f32 - b as f32).abs();
        assert_eq!(
            link_unreachable(&mut lists, &upper, Some((0, 1)), &present, dist),
            4
        );
        assert_eq!(
            lists[1],
            vec![0, 2],
            "2 linked from 1, its nearest reached neighbour"
        );
        assert_eq!(lists[2], vec![4, 1, 0, 3]);
        assert_eq!(lists[4], vec![5]);
        assert_eq!((lists[5].clone(), lists[7].clone()), (vec![4, 7], vec![8]));
        assert!(lists[6].is_empty());
        // An upper layer's list reaches a point as well.
        let mut lists: Vec<Vec<u32>> = vec![vec![], vec![0]];
        let upper = HashMap::from([(0, vec![vec![1]])]);
        assert_eq!(
            link_unreachable(&mut lists, &upper, Some((0, 1)), &[true; 2], dist),
            0
        );
        assert_eq!(
            link_unreachable(&mut [], &HashMap::new(), None, &[], dist),
            0
        );
    }

    #[test]
    fn points_that_name_a_point_it_does_not_name_are_added_nearest_first() {
        // 1, 2 and 3 name 0; 0 names 1 only; 3 also names 2, which names it back.
        let rows = |lists: &[Vec<(usize, f32)>]| {
            let points: Vec<Option<(usize, Vec<Neighbour>)>> = lists
                .iter()
                .map(|l| {
                    let l = l
                        .iter()
                        .map(|&(id, d)| Neighbour::new(id, d, PointId(0, 0)));
                    Some((0, l.collect()))
                })
                .collect();
            let mut near = Rows::new(lists.len(), 2);
            near.fill(&points, |l| l.clone());
            near
        };
        let near = rows(&[
            vec![(1, 0.1)],
            vec![(0, 0.1)],
            vec![(0, 0.3), (3, 0.2)],
            vec![(0, 0.2), (2, 0.2)],
        ]);
        assert_eq!(
            with_reverse_links(&near, 4),
            vec![vec![1, 3, 2], vec![0], vec![0, 3], vec![0, 2]]
        );
        // At most `extra` are added: the nearest.
        assert_eq!(with_reverse_links(&near, 1)[0], vec![1, 3]);
        assert_eq!(with_reverse_links(&near, 0)[0], vec![1]);
        // A list longer than its row keeps its nearest entries, in their order; ids past
        // the rows are dropped.
        let near = rows(&[
            vec![],
            vec![],
            vec![(1, 0.5), (9, 0.1), (0, 0.3), (3, 0.2)],
            vec![],
        ]);
        assert_eq!((near.ids(2), near.dists(2)), (&[0, 3][..], &[0.3, 0.2][..]));
    }
}
