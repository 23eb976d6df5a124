//! Rebalancing plans over the cluster's current placement (`ragctl node drain`, `node
//! remove`, `rebalance`): replica moves that empty draining nodes and even the load per node
//! (shard sizes, not only replica counts), leadership transfers that even leaders. The coordinator carries each step out (`Admin.MoveReplica`,
//! `Admin.TransferShardLeader`).

use std::collections::BTreeMap;

/// One shard as the planner sees it.
#[derive(Debug, Clone)]
pub struct ShardView {
    pub collection: String,
    pub shard: u32,
    pub nodes: Vec<String>,
    /// Empty when unknown.
    pub leader: String,
    /// What one replica weighs (`weight`).
    pub weight: u64,
}

/// What a replica costs a node, in units: one for being there, one per chunk, one per KiB of
/// its BM25 index. An empty shard still counts, a large one counts for its size.
pub fn weight(chunks: u64, index_bytes: u64) -> u64 {
    1 + chunks + index_bytes / 1024
}

/// One step of a plan.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Move {
        collection: String,
        shard: u32,
        from: String,
        to: String,
    },
    Leader {
        collection: String,
        shard: u32,
        to: String,
    },
}

/// A node's load: the weights of the replicas it holds.
fn load(shards: &[ShardView], n: &str) -> u64 {
    shards
        .iter()
        .filter(|s| s.nodes.iter().any(|x| x == n))
        .map(|s| s.weight)
        .sum()
}

/// Replica moves that empty the `drain` nodes onto `targets` (a shard no target can take
/// is left where it is: the caller finds it in the result), then even the load of the
/// targets: each move takes the replica from the most loaded target to the least loaded one
/// whose weight best halves the gap between them, while that narrows it.
pub fn plan_replicas(targets: &[String], shards: &[ShardView], drain: &[String]) -> Vec<Step> {
    let mut shards = shards.to_vec();
    let targets: Vec<&String> = targets.iter().filter(|n| !drain.contains(n)).collect();
    let mut steps = Vec::new();
    let mut apply = |shards: &mut Vec<ShardView>, i: usize, from: &str, to: &str| {
        let s = &mut shards[i];
        for n in s.nodes.iter_mut() {
            if n == from {
                *n = to.to_owned();
            }
        }
        steps.push(Step::Move {
            collection: s.collection.clone(),
            shard: s.shard,
            from: from.to_owned(),
            to: to.to_owned(),
        });
    };
    for d in drain {
        // Heaviest first, so the big ones get the emptiest targets.
        let mut order: Vec<usize> = (0..shards.len())
            .filter(|i| shards[*i].nodes.contains(d))
            .collect();
        order.sort_by_key(|i| std::cmp::Reverse(shards[*i].weight));
        for i in order {
            let to = targets
                .iter()
                .filter(|t| !shards[i].nodes.contains(t))
                .min_by_key(|t| (load(&shards, t), t.as_str()));
            if let Some(to) = to {
                let to = to.to_string();
                apply(&mut shards, i, d, &to);
            }
        }
    }
    // Bounded: every move narrows the gap between the fullest and the emptiest node.
    for _ in 0..shards.len() * targets.len().max(1) {
        let (Some(max), Some(min)) = (
            targets
                .iter()
                .max_by_key(|t| (load(&shards, t), std::cmp::Reverse(t.as_str()))),
            targets
                .iter()
                .min_by_key(|t| (load(&shards, t), t.as_str())),
        ) else {
            break;
        };
        let gap = load(&shards, max) - load(&shards, min);
        // Moving weight w leaves the two at (hi - w, lo + w): better only while w < gap.
        let Some(i) = (0..shards.len())
            .filter(|i| {
                let s = &shards[*i];
                s.nodes.contains(max) && !s.nodes.contains(min) && s.weight < gap
            })
            .min_by_key(|i| (gap.abs_diff(2 * shards[*i].weight), shards[*i].shard))
        else {
            break;
        };
        let (from, to) = (max.to_string(), min.to_string());
        apply(&mut shards, i, &from, &to);
    }
    steps
}

/// Leadership transfers that even the leaders per node to within one.
pub fn plan_leaders(nodes: &[String], shards: &[ShardView]) -> Vec<Step> {
    let mut leaders: BTreeMap<&str, usize> = nodes.iter().map(|n| (n.as_str(), 0)).collect();
    for s in shards {
        if let Some(c) = leaders.get_mut(s.leader.as_str()) {
            *c += 1;
        }
    }
    let mut shards = shards.to_vec();
    let mut steps = Vec::new();
    for _ in 0..shards.len() {
        let (Some((&max, &hi)), Some((&min, &lo))) = (
            leaders
                .iter()
                .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n))),
            leaders.iter().min_by_key(|(n, c)| (**c, **n)),
        ) else {
            break;
        };
        if hi <= lo + 1 {
            break;
        }
        let Some(s) = shards
            .iter_mut()
            .find(|s| s.leader == max && s.nodes.iter().any(|n| n == min))
        else {
            break;
        };
        s.leader = min.to_owned();
        steps.push(Step::Leader {
            collection: s.collection.clone(),
            shard: s.shard,
            to: min.to_owned(),
        });
        *leaders.get_mut(max).unwrap_or(&mut 0) -= 1;
        *leaders.get_mut(min).unwrap_or(&mut 0) += 1;
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("n{i}")).collect()
    }

    fn view(shard: u32, nodes: &[&str], leader: &str) -> ShardView {
        ShardView {
            collection: "c".into(),
            shard,
            nodes: nodes.iter().map(|s| s.to_string()).collect(),
            leader: leader.into(),
            weight: weight(0, 0),
        }
    }

    fn counts(nodes: &[String], shards: &[ShardView], steps: &[Step]) -> Vec<usize> {
        let mut shards = shards.to_vec();
        for s in steps {
            if let Step::Move {
                shard, from, to, ..
            } = s
            {
                let v = shards.iter_mut().find(|v| v.shard == *shard).unwrap();
                assert!(!v.nodes.contains(to), "a shard twice on {to}");
                for n in v.nodes.iter_mut() {
                    if n == from {
                        *n = to.clone();
                    }
                }
            }
        }
        nodes
            .iter()
            .map(|n| shards.iter().filter(|s| s.nodes.contains(n)).count())
            .collect()
    }

    #[test]
    fn drain_empties_a_node_and_rebalance_evens_replicas() {
        let n = nodes(4);
        // 4 shards x 3 replicas, all piled on n0..n2; n3 empty.
        let shards: Vec<ShardView> = (0..4).map(|i| view(i, &["n0", "n1", "n2"], "n0")).collect();
        let steps = plan_replicas(&n, &shards, &[]);
        let c = counts(&n, &shards, &steps);
        assert_eq!(c.iter().sum::<usize>(), 12);
        assert!(
            c.iter().max().unwrap() - c.iter().min().unwrap() <= 1,
            "{c:?}"
        );
        assert_eq!(steps.len(), 3, "{steps:?}");
        // Draining n1 moves its four replicas; the rest stays within one.
        let steps = plan_replicas(&n, &shards, &["n1".to_string()]);
        let c = counts(&n, &shards, &steps);
        assert_eq!(c[1], 0, "{c:?}");
        assert_eq!(c.iter().sum::<usize>(), 12);
        // Balanced already: nothing to do.
        let balanced = vec![view(0, &["n0", "n1"], "n0"), view(1, &["n2", "n3"], "n2")];
        assert!(plan_replicas(&n, &balanced, &[]).is_empty());
    }

    #[test]
    fn rebalance_weighs_shard_sizes() {
        let n = nodes(2);
        // n0 holds one big shard, n1 four small ones: equal counts would be wrong.
        let mut shards = vec![view(0, &["n0"], "n0")];
        shards[0].weight = weight(10_000, 0);
        for i in 1..5 {
            shards.push(view(i, &["n1"], "n1"));
        }
        assert!(
            plan_replicas(&n, &shards, &[]).is_empty(),
            "moving small shards onto the big one only widens the gap"
        );
        // Two big shards on n0, none on n1: one moves, whatever the counts.
        let mut shards = vec![view(0, &["n0"], "n0"), view(1, &["n0"], "n0")];
        for s in &mut shards {
            s.weight = weight(5_000, 2 << 20);
        }
        shards.push(view(2, &["n1"], "n1"));
        shards.push(view(3, &["n1"], "n1"));
        let steps = plan_replicas(&n, &shards, &[]);
        let big_moves = steps
            .iter()
            .filter(|s| matches!(s, Step::Move { shard: 0 | 1, .. }))
            .count();
        assert_eq!(big_moves, 1, "{steps:?}");
        let mut after = shards.clone();
        for st in &steps {
            if let Step::Move { shard, to, .. } = st {
                after[*shard as usize].nodes = vec![to.clone()];
            }
        }
        let loads: Vec<u64> = n.iter().map(|x| load(&after, x)).collect();
        assert!(loads[0].abs_diff(loads[1]) <= 2, "{loads:?}");
    }

    #[test]
    fn leaders_even_out_among_replicas() {
        let n = nodes(3);
        let shards: Vec<ShardView> = (0..6).map(|i| view(i, &["n0", "n1", "n2"], "n0")).collect();
        let steps = plan_leaders(&n, &shards);
        assert_eq!(steps.len(), 4, "{steps:?}");
        let mut led = BTreeMap::new();
        for s in &shards {
            *led.entry(s.leader.clone()).or_insert(0) += 1;
        }
        for s in &steps {
            if let Step::Leader { to, .. } = s {
                *led.entry(to.clone()).or_insert(0) += 1;
                *led.get_mut("n0").unwrap() -= 1;
            }
        }
        assert_eq!(led.values().copied().collect::<Vec<_>>(), vec![2, 2, 2]);
    }
}
