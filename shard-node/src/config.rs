//! `[shard_node]` section of the cluster config.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShardNodeConfig {
    /// gRPC listen address; port 0 picks a free port (see `port_file`).
    pub listen: String,
    /// RocksDB lives in `<data_dir>/rocksdb`, BM25 indexes in `<data_dir>/bm25/<collection>/<shard>`,
    /// HNSW dumps in `<data_dir>/hnsw/<collection>/<shard>`.
    pub data_dir: PathBuf,
    /// fsync the RocksDB WAL before acknowledging a write. Turning it off trades durability
    /// for speed: acknowledged writes can be lost on power failure (not on process crash).
    pub sync_writes: bool,
    /// Rebuild a shard's HNSW graph once tombstones exceed this fraction of its points.
    pub hnsw_compact_ratio: f64,
    /// ...and at least this many tombstones.
    pub hnsw_compact_min: usize,
    /// Dump a shard's HNSW graph to `<data_dir>/hnsw/<collection>/<shard>` once this many points
    /// changed since the last dump (or a tenth of the graph, if more), so that a restart loads
    /// it and re-indexes only what changed since. Bounds the work after a kill -9.
    pub hnsw_dump_min_changes: usize,
    /// ...or once this long passed since the last dump with anything changed.
    #[serde(with = "humantime_serde")]
    pub hnsw_dump_interval: std::time::Duration,
    /// Followers load their leader's HNSW dumps instead of inserting every written point
    /// themselves (the graph is built once per shard, not once per replica); points written
    /// since the dump a follower loaded are searched exactly beside its graph.
    pub hnsw_follow_leader_graph: bool,
    /// ...with at most this many such points per shard (plus `hnsw_write_behind_max`, by
    /// which the leader's graph may lag): beyond it a follower inserts new points itself.
    /// Bounds a follower's exact-search work and what a new leader inserts.
    pub hnsw_follower_pending_max: usize,
    /// A leader acknowledges up to this many written points per shard before they are in its
    /// HNSW graph (searched by brute force beside it meanwhile) and inserts them when writes
    /// pause, or the oldest first to make room: ingest runs at the rest of the pipeline's
    /// speed until the bound, then at the graph's. 0: every point is inserted before its
    /// write is acknowledged. Bounds the exact-search work a query does beside the graph.
    pub hnsw_write_behind_max: usize,
    /// Threads that insert points into HNSW graphs (one pool shared by the node's shards,
    /// threads named `hnsw-insert`). 0: one per core. Nodes that share a machine should
    /// split its cores: idle pool threads spin before they sleep, and three nodes' pools of
    /// 16 on 16 cores made 20x the context switches of pools of 4 for the same ingest rate.
    pub index_threads: usize,
    /// Memory budget of each shard's tantivy writer, bytes (at least 15 MB).
    pub bm25_writer_memory: usize,
    /// Least time between two tantivy commits of a busy shard: writes applied sooner after
    /// the last commit become searchable (and are acknowledged) with the next one, at most
    /// this much later; a write after a quiet spell commits at once. A commit costs the
    /// same for 25 chunks as for 500 (a new segment), so this bounds that cost per shard
    /// under load. 0: a commit per group of applied writes.
    #[serde(with = "humantime_serde")]
    pub bm25_commit_interval: std::time::Duration,
    /// Where to write `{"grpc": addr, "metrics": addr}` once listening.
    pub port_file: Option<PathBuf>,
    /// Raft tick. Elections time out after `raft_election_ticks` ticks (randomised up to
    /// twice that); leaders heartbeat every `raft_heartbeat_ticks`.
    #[serde(with = "humantime_serde")]
    pub raft_tick: std::time::Duration,
    pub raft_election_ticks: usize,
    pub raft_heartbeat_ticks: usize,
    /// Compact a shard's Raft log once it holds this many entries (keeping the newest half);
    /// replicas further behind catch up from a snapshot.
    pub raft_log_gc_threshold: u64,
    /// Sending one Raft snapshot may take this long plus 1 s per 4 MiB; a send still running
    /// then is reported failed and Raft sends another (until a send's outcome is reported,
    /// raft-rs sends that follower nothing else, so a stalled one would leave it behind).
    #[serde(with = "humantime_serde")]
    pub snapshot_send_timeout: std::time::Duration,
    /// How long a write waits to be committed and applied before UNAVAILABLE.
    #[serde(with = "humantime_serde")]
    pub write_timeout: std::time::Duration,
    /// SIGTERM to exit, at most: leaderships are handed to other replicas first (up to a
    /// third of it), calls in flight drain, indexes flush; what is left then is cut off.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: std::time::Duration,
    /// Mutual TLS (`[shard_node.tls]`): with a certificate set, only callers presenting a
    /// member certificate of the cluster CA get through the handshake, and this node dials
    /// its Raft peers over TLS (their addresses are then `https://`).
    pub tls: ragcluster_common::tls::TlsConfig,
    /// Coordinator addresses this node registers with and heartbeats to (any one answers;
    /// they pass it on to the catalog leader), learning from each answer where the other
    /// shard nodes are now. Empty: the node is only found through a coordinator's
    /// `shard_nodes` seeds, and must keep its address.
    pub coordinators: Vec<String>,
    /// The address other members reach this node at. Empty: `http(s)://` plus the bound
    /// listen address (its port resolved); needed when listening on 0.0.0.0.
    pub advertise_address: String,
    /// Between two heartbeats until the coordinators say otherwise.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: std::time::Duration,
    /// Below this many free bytes on the file system of `data_dir` the node counts as full:
    /// it refuses writes (RESOURCE_EXHAUSTED naming it and the cause), takes no new Raft log
    /// entries, hands its leaderships to replicas that can write, keeps serving reads, and
    /// takes writes again by itself once space is freed.
    pub disk_min_free_bytes: u64,
    /// Bytes held in `<data_dir>/.disk-reserve` while space is plentiful and released when
    /// the disk becomes full: room for what must still be written then (Raft state, index
    /// commits of acknowledged writes, RocksDB flushes). 0: no reserve.
    pub disk_reserve_bytes: u64,
    /// Between two looks at the free space.
    #[serde(with = "humantime_serde")]
    pub disk_check_interval: std::time::Duration,
    /// Between two passes of the background scrub, which reads every RocksDB file with its
    /// block checksums verified (files not verified yet are checked at every open). A damaged
    /// file takes the replicas with keys in it out of service, to be rebuilt from their peers.
    /// 0: no background scrub.
    #[serde(with = "humantime_serde")]
    pub scrub_interval: std::time::Duration,
    /// The scrub reads at most this many bytes a second. 0: no limit.
    pub scrub_bytes_per_sec: u64,
}

impl Default for ShardNodeConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7100".into(),
            data_dir: PathBuf::from("data/shard-node"),
            sync_writes: true,
            hnsw_compact_ratio: 0.25,
            hnsw_compact_min: 1000,
            hnsw_dump_min_changes: 10_000,
            hnsw_dump_interval: std::time::Duration::from_secs(60),
            hnsw_follow_leader_graph: true,
            hnsw_follower_pending_max: 20_000,
            hnsw_write_behind_max: 40_000,
            index_threads: 0,
            bm25_writer_memory: 32 * 1024 * 1024,
            bm25_commit_interval: std::time::Duration::from_millis(50),
            port_file: None,
            raft_tick: std::time::Duration::from_millis(100),
            raft_election_ticks: 10,
            raft_heartbeat_ticks: 2,
            raft_log_gc_threshold: 10_000,
            snapshot_send_timeout: std::time::Duration::from_secs(30),
            write_timeout: std::time::Duration::from_secs(10),
            shutdown_timeout: std::time::Duration::from_secs(10),
            tls: Default::default(),
            coordinators: Vec::new(),
            advertise_address: String::new(),
            heartbeat_interval: std::time::Duration::from_secs(1),
            disk_min_free_bytes: 256 << 20,
            disk_reserve_bytes: 64 << 20,
            disk_check_interval: std::time::Duration::from_millis(500),
            scrub_interval: std::time::Duration::from_secs(3600),
            scrub_bytes_per_sec: 16 << 20,
        }
    }
}

impl ShardNodeConfig {
    /// How the data directory's free space is watched.
    pub fn disk_policy(&self) -> ragcluster_common::disk::DiskPolicy {
        ragcluster_common::disk::DiskPolicy {
            min_free: self.disk_min_free_bytes,
            reserve: self.disk_reserve_bytes,
            interval: self.disk_check_interval,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.hnsw_compact_ratio) {
            return Err("shard_node.hnsw_compact_ratio must be in [0, 1]".into());
        }
        if self.hnsw_dump_min_changes == 0 || self.hnsw_dump_interval.is_zero() {
            return Err(
                "shard_node.hnsw_dump_min_changes and hnsw_dump_interval must be > 0".into(),
            );
        }
        if self.bm25_writer_memory < 15_000_000 {
            return Err("shard_node.bm25_writer_memory must be at least 15000000 bytes".into());
        }
        if self.raft_heartbeat_ticks == 0 || self.raft_election_ticks <= self.raft_heartbeat_ticks {
            return Err(
                "shard_node.raft_election_ticks must exceed raft_heartbeat_ticks (>= 1)".into(),
            );
        }
        if self.shutdown_timeout < std::time::Duration::from_secs(1) {
            return Err("shard_node.shutdown_timeout must be at least 1s".into());
        }
        if self.raft_tick.is_zero() || self.raft_log_gc_threshold < 2 {
            return Err("shard_node.raft_tick must be > 0 and raft_log_gc_threshold >= 2".into());
        }
        self.tls.validate("shard_node")?;
        for a in &self.coordinators {
            ragcluster_common::tls::check_scheme("shard_node", "coordinators", a, &self.tls)?;
        }
        if !self.advertise_address.is_empty() {
            ragcluster_common::tls::check_scheme(
                "shard_node",
                "advertise_address",
                &self.advertise_address,
                &self.tls,
            )?;
        }
        if self.snapshot_send_timeout < std::time::Duration::from_secs(1) {
            return Err("shard_node.snapshot_send_timeout must be at least 1s".into());
        }
        if self.heartbeat_interval.is_zero() {
            return Err("shard_node.heartbeat_interval must be positive".into());
        }
        if self.disk_check_interval.is_zero() {
            return Err("shard_node.disk_check_interval must be positive".into());
        }
        if self.tls.client_auth != ragcluster_common::tls::ClientAuth::Required {
            return Err(
                "shard_node.tls.client_auth must be \"required\": shard nodes serve members only"
                    .into(),
            );
        }
        Ok(())
    }
}
