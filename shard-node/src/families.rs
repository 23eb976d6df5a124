//! The shard node's metric families, registered at start (`families::register`) so each is on
//! `/metrics` before its first event. Names are the README's.

use ragcluster_common::families::{self, Family, Kind};

pub fn all() -> Vec<Family> {
    use Kind::*;
    let mut f = families::grpc_server();
    f.extend(ragcluster_common::membership::families());
    f.extend(ragcluster_common::disk::families());
    f.extend(families::table(&[
        (
            "shard_write_batch_seconds",
            Histogram,
            "WriteBatch calls: validation, Raft commit and index visibility",
        ),
        (
            "shard_write_batches_total",
            Counter,
            "write batches applied",
        ),
        (
            "shard_duplicate_requests_total",
            Counter,
            "write batches recognised by request id and not applied again",
        ),
        (
            "shard_writes_forwarded_total",
            Counter,
            "write batches a follower passed on to its leader",
        ),
        (
            "shard_documents",
            Gauge,
            "documents per shard (refreshed every 10 s)",
        ),
        ("shard_chunks", Gauge, "chunks per shard"),
        (
            "shard_applied_seq",
            Gauge,
            "highest sequence number visible to searches, per shard",
        ),
        (
            "shard_bm25_index_bytes",
            Gauge,
            "tantivy index size per shard",
        ),
        (
            "shard_hnsw_points",
            Gauge,
            "points in the HNSW graph per shard",
        ),
        (
            "shard_hnsw_tombstones",
            Gauge,
            "deleted points still in the HNSW graph per shard",
        ),
        (
            "shard_hnsw_pending_points",
            Gauge,
            "acknowledged points not in the HNSW graph yet (searched by brute force) per shard",
        ),
        ("shard_node_shards", Gauge, "replicas hosted by this node"),
        (
            "shard_disk_full_handoffs_total",
            Counter,
            "leaderships handed to replicas with room because this node's disk was full",
        ),
        (
            "shard_scrub_files_total",
            Counter,
            "RocksDB files read whole with their block checksums verified (at open and by the scrub)",
        ),
        (
            "shard_scrub_bytes_total",
            Counter,
            "bytes of keys and values read by those verifications",
        ),
        (
            "shard_scrub_passes_total",
            Counter,
            "background scrub passes over every live RocksDB file",
        ),
        (
            "shard_scrub_damaged_files_total",
            Counter,
            "RocksDB files the background scrub found failing their checksums",
        ),
        (
            "shard_store_salvages_total",
            Counter,
            "opens that rebuilt RocksDB without a damaged file (its shards rebuilt from peers)",
        ),
        (
            "shard_bm25_writer_restarts_total",
            Counter,
            "BM25 index writers restarted after a failed update (e.g. a full disk), with the \
             op log replayed into them",
        ),
    ]));
    f.extend(indexes());
    f.extend(rocksdb());
    f.extend(raft());
    f.extend(read_calls());
    f
}

/// The shard's indexes: HNSW dumps and rebuilds, BM25 commits and merges, the index worker.
fn indexes() -> Vec<Family> {
    use Kind::*;
    families::table(&[
        (
            "shard_hnsw_dump_seconds",
            Histogram,
            "time to write one HNSW graph dump",
        ),
        (
            "shard_hnsw_dump_failures_total",
            Counter,
            "HNSW dumps that failed (the op log is kept back to the previous one)",
        ),
        (
            "shard_hnsw_dump_rejected_total",
            Counter,
            "HNSW dumps refused at open (checksum, format or dimension)",
        ),
        (
            "shard_hnsw_relinked_points_total",
            Counter,
            "points hnsw_rs's graph left out of every walk's reach, linked in the flat copy",
        ),
        (
            "shard_hnsw_rebuilds_total",
            Counter,
            "HNSW graphs rebuilt from RocksDB at open (no usable dump)",
        ),
        (
            "shard_bm25_rebuilds_total",
            Counter,
            "BM25 indexes found damaged at open (checksums) and rebuilt from RocksDB",
        ),
        (
            "shard_hnsw_walks_total",
            Counter,
            "HNSW layer-0 walks by kind (flat: the copy taken when writes paused; hnsw_rs: graph changed since; filtered: metadata filter or tombstones)",
        ),
        (
            "shard_bm25_commit_seconds",
            Histogram,
            "one tantivy commit of a shard (at most one per bm25_commit_interval while busy)",
        ),
        (
            "shard_bm25_merge_seconds",
            Histogram,
            "time to merge a BM25 index's segments into one after writes pause",
        ),
        (
            "shard_hnsw_flat_copy_seconds",
            Histogram,
            "time to copy an HNSW graph's bottom layer for fast walks after writes pause",
        ),
        (
            "shard_index_group_seconds",
            Histogram,
            "index worker: time per tantivy commit group",
        ),
        (
            "shard_index_group_entries",
            Histogram,
            "index worker: write batches per tantivy commit",
        ),
    ])
}

/// The node's RocksDB, read from its properties.
fn rocksdb() -> Vec<Family> {
    use Kind::*;
    families::table(&[
        ("rocksdb_live_sst_bytes", Gauge, "RocksDB live SST bytes"),
        ("rocksdb_memtable_bytes", Gauge, "RocksDB memtable bytes"),
        ("rocksdb_estimated_keys", Gauge, "RocksDB estimated keys"),
        (
            "rocksdb_pending_compaction_bytes",
            Gauge,
            "RocksDB estimated pending compaction bytes",
        ),
    ])
}

/// Reads on the coordinator's `Shard.Reads` streams.
fn read_calls() -> Vec<Family> {
    use Kind::*;
    families::table(&[
        (
            "shard_read_calls_total",
            Counter,
            "reads answered on Shard.Reads streams, by call and status code",
        ),
        (
            "shard_read_calls_cancelled_total",
            Counter,
            "reads on Shard.Reads streams stopped by the caller's cancel before they answered",
        ),
        (
            "shard_read_call_seconds",
            Histogram,
            "reads answered on Shard.Reads streams: time on the node, by call",
        ),
        (
            "shard_read_token_wait_seconds",
            Histogram,
            "reads with a read token that waited for this replica to apply the token's index",
        ),
        (
            "shard_read_token_timeouts_total",
            Counter,
            "reads refused (UNAVAILABLE) because this replica did not reach the read token's index in time",
        ),
    ])
}

/// The Raft side: per-shard gauges, snapshots, and the core's counters.
fn raft() -> Vec<Family> {
    use Kind::*;
    let mut f = families::table(&[
        ("raft_term", Gauge, "Raft term per shard"),
        ("raft_commit_index", Gauge, "Raft commit index per shard"),
        ("raft_applied_index", Gauge, "Raft applied index per shard"),
        (
            "raft_is_leader",
            Gauge,
            "1 where this replica leads its shard",
        ),
        ("raft_leaders", Gauge, "shards this node leads"),
        (
            "raft_member_failed",
            Gauge,
            "1 where this replica's Raft member stopped on its own (out of service)",
        ),
        (
            "raft_proposal_seconds",
            Histogram,
            "proposal to apply, on the leader",
        ),
        (
            "raft_snapshots_sent_total",
            Counter,
            "snapshots streamed to followers",
        ),
        (
            "raft_snapshots_received_total",
            Counter,
            "snapshots received from leaders",
        ),
        (
            "raft_snapshots_rejected_total",
            Counter,
            "snapshots refused (checksum, size, stale)",
        ),
        (
            "raft_snapshot_sent_bytes_total",
            Counter,
            "snapshot bytes streamed",
        ),
        (
            "raft_snapshot_send_seconds",
            Histogram,
            "time to stream one snapshot",
        ),
        (
            "raft_snapshot_failures_total",
            Counter,
            "snapshot sends that failed",
        ),
        (
            "raft_snapshots_installed_total",
            Counter,
            "snapshots installed into a replica",
        ),
        (
            "shard_hnsw_graph_adoptions_total",
            Counter,
            "Leader HNSW dumps a follower received, by outcome: adopted (loaded and caught up), refused (could not be caught up; the graph kept), skipped (no longer newer or this replica leads)",
        ),
        (
            "shard_hnsw_graph_fetched_bytes_total",
            Counter,
            "Bytes of leader HNSW dumps fetched by this node's follower replicas",
        ),
        (
            "shard_snapshot_graphs_total",
            Counter,
            "HNSW graphs of installed snapshots by source: the dump the snapshot shipped, or rebuilt",
        ),
    ]);
    f.extend(
        ragcluster_raft::counter_families("raft")
            .into_iter()
            .map(|(n, h)| Family::new(n, Kind::Counter, h)),
    );
    f
}
