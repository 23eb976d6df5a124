//! Embeddings already computed, so that text the cluster has embedded before costs no model
//! time: re-ingesting an unchanged corpus (a nightly sync, a second collection over the same
//! documents) and repeated queries skip the model worker. Entries are keyed by a SHA-256 of
//! the model's name, its revision (the worker's digest of the weights and tokenizer it
//! loaded, `ModelInfo.revision`) and the exact text, so a model replaced under the same name
//! misses instead of answering with the old model's vectors, and no chosen text can collide
//! with another's entry. Bounded by bytes, least recently used out first.

use std::sync::Arc;

use lru::LruCache;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};

pub type Key = [u8; 32];

/// Bytes an entry holds beyond its floats: the key twice (map and list), the LRU links, the
/// `Arc` header and the map's slot.
const ENTRY_OVERHEAD: usize = 128;

pub struct EmbedCache {
    max_bytes: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    map: LruCache<Key, Arc<[f32]>>,
    bytes: usize,
}

fn entry_bytes(v: &[f32]) -> usize {
    ENTRY_OVERHEAD + std::mem::size_of_val(v)
}

impl EmbedCache {
    /// None when `max_bytes` is 0 (caching off).
    pub fn new(max_bytes: usize) -> Option<Self> {
        (max_bytes > 0).then(|| Self {
            max_bytes,
            inner: Mutex::new(Inner {
                map: LruCache::unbounded(),
                bytes: 0,
            }),
        })
    }

    /// The key of `text` embedded by `model` at `revision`. Lengths are hashed in front of
    /// the name and revision, so no two (name, revision, text) triples share a key.
    pub fn key(model: &str, revision: &str, text: &str) -> Key {
        let mut h = Sha256::new();
        for part in [model, revision] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        h.update(text.as_bytes());
        h.finalize().into()
    }

    /// The cached vector of each key (None: not cached); hits become most recently used.
    pub fn get_many(&self, keys: &[Key]) -> Vec<Option<Arc<[f32]>>> {
        let mut g = self.inner.lock();
        let out: Vec<Option<Arc<[f32]>>> = keys.iter().map(|k| g.map.get(k).cloned()).collect();
        drop(g);
        let hits = out.iter().filter(|v| v.is_some()).count() as u64;
        metrics::counter!("coordinator_embed_cache_hits_total").increment(hits);
        metrics::counter!("coordinator_embed_cache_misses_total")
            .increment(keys.len() as u64 - hits);
        out
    }

    /// Stores vectors, evicting the least recently used beyond the byte bound. A vector larger
    /// than the whole bound is not kept.
    pub fn put_many(&self, entries: impl IntoIterator<Item = (Key, Arc<[f32]>)>) {
        let mut g = self.inner.lock();
        for (k, v) in entries {
            let size = entry_bytes(&v);
            if size > self.max_bytes {
                continue;
            }
            if let Some(old) = g.map.put(k, v) {
                g.bytes -= entry_bytes(&old);
            }
            g.bytes += size;
            while g.bytes > self.max_bytes {
                match g.map.pop_lru() {
                    Some((_, old)) => g.bytes -= entry_bytes(&old),
                    None => break,
                }
            }
        }
        metrics::gauge!("coordinator_embed_cache_bytes").set(g.bytes as f64);
    }

    /// Entries and bytes held.
    pub fn usage(&self) -> (usize, usize) {
        let g = self.inner.lock();
        (g.map.len(), g.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(x: f32, dim: usize) -> Arc<[f32]> {
        vec![x; dim].into()
    }

    #[test]
    fn keys_separate_model_revision_and_text() {
        let k = EmbedCache::key("m", "r1", "text");
        assert_eq!(k, EmbedCache::key("m", "r1", "text"));
        assert_ne!(k, EmbedCache::key("m", "r2", "text"));
        assert_ne!(k, EmbedCache::key("n", "r1", "text"));
        assert_ne!(k, EmbedCache::key("m", "r1", "text "));
        // Moving bytes between the parts changes the key.
        assert_ne!(
            EmbedCache::key("ab", "c", "d"),
            EmbedCache::key("a", "bc", "d")
        );
        assert_ne!(
            EmbedCache::key("a", "b", "cd"),
            EmbedCache::key("a", "bc", "d")
        );
    }

    #[test]
    fn least_recently_used_leave_first_within_the_byte_bound() {
        let dim = 4;
        let one = entry_bytes(&v(0.0, dim));
        let c = EmbedCache::new(3 * one).unwrap();
        let k: Vec<Key> = (0..4)
            .map(|i| EmbedCache::key("m", "r", &i.to_string()))
            .collect();
        c.put_many((0..3).map(|i| (k[i], v(i as f32, dim))));
        assert_eq!(c.usage(), (3, 3 * one));
        // Touch 0, so 1 is the least recently used when 3 arrives.
        assert!(c.get_many(&k[..1])[0].is_some());
        c.put_many([(k[3], v(3.0, dim))]);
        let got = c.get_many(&k);
        assert_eq!(got[0].as_deref(), Some(&[0.0; 4][..]));
        assert!(got[1].is_none(), "least recently used evicted");
        assert_eq!(got[2].as_deref(), Some(&[2.0; 4][..]));
        assert_eq!(got[3].as_deref(), Some(&[3.0; 4][..]));
        assert_eq!(c.usage(), (3, 3 * one));
        // Replacing an entry does not count it twice.
        c.put_many([(k[3], v(9.0, dim))]);
        assert_eq!(c.usage(), (3, 3 * one));
        // An entry larger than the bound is not kept.
        c.put_many([(EmbedCache::key("m", "r", "big"), v(1.0, 100 * dim))]);
        assert_eq!(c.usage().0, 3);
        assert!(EmbedCache::new(0).is_none(), "0 bytes: caching off");
    }
}
