//! Where things live: documents to shards by a stable hash of the document id (all chunks of
//! a document on one shard, so prev/next neighbours are local), shards of a new collection to
//! the UP shard nodes of the member table (later moves change it).

/// FNV-1a, 64 bit: stable across Rust versions and platforms (unlike `DefaultHasher`), which
/// matters because it decides where stored documents live.
pub fn stable_hash(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub fn shard_for_doc(doc_id: &str, shard_count: u32) -> u32 {
    (stable_hash(doc_id) % u64::from(shard_count.max(1))) as u32
}

/// Replicas of each shard: shard i on `rf` consecutive nodes starting at node (offset + i),
/// the offset derived from the collection name so small collections do not all start on node
/// 0. The first replica is the preferred leader, so leaders spread like shards do.
pub fn place_shards<N: Clone>(
    collection: &str,
    shard_count: u32,
    rf: u32,
    nodes: &[N],
) -> Vec<Vec<N>> {
    let n = nodes.len() as u64;
    let start = stable_hash(collection) % n;
    (0..u64::from(shard_count))
        .map(|i| {
            (0..u64::from(rf).min(n))
                .map(|j| nodes[((start + i + j) % n) as usize].clone())
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_reference_values() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(stable_hash(""), 0xcbf29ce484222325);
        assert_eq!(stable_hash("a"), 0xaf63dc4c8601ec8c);
    }

    #[test]
    fn spreads_shards_over_nodes() {
        let nodes: Vec<String> = (0..3).map(|i| format!("n{i}")).collect();
        let p = place_shards("docs", 6, 1, &nodes);
        for n in &nodes {
            assert_eq!(p.iter().filter(|x| x[0] == *n).count(), 2);
        }
        // rf 3 on 3 nodes: every node holds every shard, each leads two.
        let p = place_shards("docs", 6, 3, &nodes);
        for r in &p {
            let mut s = r.clone();
            s.sort();
            assert_eq!(s, nodes);
        }
        for n in &nodes {
            assert_eq!(p.iter().filter(|x| x[0] == *n).count(), 2);
        }
        let counts = (0..1000).fold([0; 4], |mut c, i| {
            c[shard_for_doc(&format!("doc-{i}"), 4) as usize] += 1;
            c
        });
        assert!(counts.iter().all(|&c| c > 200), "{counts:?}");
    }
}
