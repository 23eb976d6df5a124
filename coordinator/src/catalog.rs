//! The collection catalog, persisted as one protobuf file (`catalog.pb`) replaced atomically
//! (write temp, fsync, rename, fsync dir) so a crash leaves the old or the new catalog, never
//! half of one. The Raft issue replaces this file with a replicated state machine.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use prost::Message;
use ragcluster_proto::v1::{CollectionInfo, ListCollectionsResponse};

use crate::error::{CoordError, Result};

pub struct Catalog {
    path: PathBuf,
    collections: Mutex<BTreeMap<String, CollectionInfo>>,
}

impl Catalog {
    pub fn open(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| CoordError::Catalog(format!("{}: {e}", dir.display())))?;
        let path = dir.join("catalog.pb");
        let mut collections = BTreeMap::new();
        if path.exists() {
            let bytes = std::fs::read(&path)
                .map_err(|e| CoordError::Catalog(format!("{}: {e}", path.display())))?;
            let list = ListCollectionsResponse::decode(&*bytes)
                .map_err(|e| CoordError::Catalog(format!("{} is corrupt: {e}", path.display())))?;
            for c in list.collections {
                collections.insert(c.name.clone(), c);
            }
        }
        Ok(Self {
            path,
            collections: Mutex::new(collections),
        })
    }

    pub fn get(&self, name: &str) -> Result<CollectionInfo> {
        self.collections
            .lock()
            .get(name)
            .cloned()
            .ok_or_else(|| CoordError::UnknownCollection(name.to_owned()))
    }

    pub fn list(&self) -> Vec<CollectionInfo> {
        self.collections.lock().values().cloned().collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.collections.lock().contains_key(name)
    }

    /// Adds a collection and persists the catalog before returning.
    pub fn insert(&self, c: CollectionInfo) -> Result<()> {
        let mut g = self.collections.lock();
        if g.contains_key(&c.name) {
            return Err(CoordError::CollectionExists(c.name));
        }
        let mut next = g.clone();
        next.insert(c.name.clone(), c);
        self.persist(&next)?;
        *g = next;
        Ok(())
    }

    pub fn remove(&self, name: &str) -> Result<CollectionInfo> {
        let mut g = self.collections.lock();
        let mut next = g.clone();
        let c = next
            .remove(name)
            .ok_or_else(|| CoordError::UnknownCollection(name.to_owned()))?;
        self.persist(&next)?;
        *g = next;
        Ok(c)
    }

    fn persist(&self, m: &BTreeMap<String, CollectionInfo>) -> Result<()> {
        let bytes = ListCollectionsResponse {
            collections: m.values().cloned().collect(),
        }
        .encode_to_vec();
        let tmp = self.path.with_extension("pb.tmp");
        let io = |e: std::io::Error| CoordError::Catalog(format!("{}: {e}", self.path.display()));
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &self.path).map_err(io)?;
        if let Some(dir) = self.path.parent() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io)?;
        }
        Ok(())
    }
}
