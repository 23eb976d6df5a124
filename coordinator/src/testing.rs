//! What the coordinator's unit tests share: a one-coordinator catalog (a real Raft group on
//! RocksDB in a temporary directory) with its membership keeper, and a shard client over
//! scripted shard nodes (`shards::scripted`), and a model worker client with no worker.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::catalog::{Catalog, CatalogOptions};
use crate::channels::Channels;
use crate::membership::{Membership, MembershipOptions};
use crate::models::{EmbedOptions, Models};
use crate::shards::Shards;
use crate::shards::scripted::{ScriptedConnector, ScriptedNode};

/// A catalog, its membership keeper and shard client over scripted nodes.
pub struct Fixture {
    pub membership: Arc<Membership>,
    pub catalog: Arc<Catalog>,
    pub shards: Arc<Shards>,
    /// A model worker client with no worker: every model call is UNAVAILABLE.
    pub models: Arc<Models>,
    pub nodes: Vec<Arc<ScriptedNode>>,
    _dir: tempfile::TempDir,
}

/// Members heartbeat this often.
pub const INTERVAL: Duration = Duration::from_millis(50);
/// Silence after which a member is DOWN.
pub const DOWN_AFTER: Duration = Duration::from_millis(300);

/// A lone coordinator's catalog in `dir` (fast ticks), its disk never counting as full.
pub fn lone_catalog(dir: &std::path::Path) -> CatalogOptions {
    CatalogOptions {
        node_id: 1,
        members: BTreeMap::from([(1, "http://127.0.0.1:1".to_owned())]),
        data_dir: dir.to_owned(),
        tick: Duration::from_millis(10),
        election_ticks: 10,
        heartbeat_ticks: 2,
        log_gc_threshold: 100,
        disk: ragcluster_common::disk::DiskPolicy {
            min_free: 0,
            reserve: 0,
            interval: Duration::from_secs(1),
        },
    }
}

/// `n` scripted shard nodes `http://127.0.0.1:17100`... with ids 11, 12, ..., not registered
/// yet, and a one-coordinator catalog that leads.
pub async fn fixture(n: usize) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let catalog = Catalog::open(
        &lone_catalog(dir.path()),
        &tokio::runtime::Handle::current(),
        None,
    )
    .unwrap();
    let catalog = Arc::new(catalog);
    catalog.wait_leader(Duration::from_secs(5)).await;
    assert!(catalog.is_leader());
    let nodes: Vec<_> = (0..n)
        .map(|i| ScriptedNode::new(&format!("http://127.0.0.1:{}", 17100 + i), i as u64 + 11))
        .collect();
    let shards = Arc::new(Shards::new(ScriptedConnector::new(&nodes)));
    let channels = Arc::new(Channels::new(None));
    let models = Arc::new(Models::new(
        String::new(),
        channels.clone(),
        EmbedOptions {
            batch: 0,
            concurrency: 1,
            timeout: Duration::from_secs(1),
            cache_bytes: 0,
        },
    ));
    let membership = Membership::new(
        catalog.clone(),
        shards.clone(),
        models.clone(),
        channels,
        MembershipOptions {
            interval: INTERVAL,
            down_after: DOWN_AFTER,
            shard_seeds: Vec::new(),
        },
    );
    Fixture {
        membership,
        catalog,
        shards,
        models,
        nodes,
        _dir: dir,
    }
}
