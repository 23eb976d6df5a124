//! Collection-wide BM25 statistics of recent queries, with the seq each shard was at when they
//! were summed. A repeated query sends them straight away and skips the statistics round;
//! every shard checks the seq (`Bm25SearchRequest.stats_seq`) and refuses to score when it
//! moved, so a cached figure is only used while it is exact.

use std::collections::HashMap;

use parking_lot::Mutex;
use ragcluster_proto::v1::GlobalBm25Stats;

/// (collection, its creation time: a recreated collection is another one, the query text).
pub type Key = (String, u64, String);

#[derive(Clone)]
pub struct Entry {
    /// Visible seq of every shard, by shard number.
    pub seqs: Vec<u64>,
    pub stats: GlobalBm25Stats,
}

pub struct StatsCache {
    entries: Mutex<HashMap<Key, Entry>>,
    capacity: usize,
}

impl StatsCache {
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::default(),
            capacity,
        }
    }

    pub fn get(&self, key: &Key) -> Option<Entry> {
        self.entries.lock().get(key).cloned()
    }

    /// Stores an entry; a full cache starts over (cheap, and the hot queries come back at once).
    pub fn put(&self, key: Key, entry: Entry) {
        let mut e = self.entries.lock();
        if e.len() >= self.capacity && !e.contains_key(&key) {
            e.clear();
        }
        e.insert(key, entry);
    }
}
