//! The coordinator's metric families, registered at start (`families::register`) so each is on
//! `/metrics` before its first event. Names are the README's.

use ragcluster_common::families::{self, Family, Kind};

pub fn all() -> Vec<Family> {
    use Kind::*;
    let mut f = families::grpc_server();
    f.extend(ragcluster_common::disk::families());
    f.extend(shard_calls());
    f.extend(families::table(&[
        (
            "coordinator_search_seconds",
            Histogram,
            "Search latency by mode",
        ),
        (
            "coordinator_bm25_stats_cache_total",
            Counter,
            "multi-shard BM25 searches by statistics cache outcome (hit: one round; stale, miss: two)",
        ),
        (
            "coordinator_query_embed_seconds",
            Histogram,
            "query embedding time of dense and hybrid searches",
        ),
        (
            "coordinator_ingested_documents_total",
            Counter,
            "documents acknowledged by UpsertDocuments",
        ),
        (
            "coordinator_ingested_chunks_total",
            Counter,
            "chunks acknowledged by UpsertDocuments",
        ),
        (
            "coordinator_ingest_stage_seconds",
            Histogram,
            "UpsertDocuments time by stage (chunk, embed, write)",
        ),
        (
            "coordinator_ask_seconds",
            Histogram,
            "Ask latency by flow and status",
        ),
        (
            "coordinator_ask_operator_seconds",
            Histogram,
            "time per flow operator",
        ),
        (
            "coordinator_ask_generated_tokens_total",
            Counter,
            "tokens generated for Ask",
        ),
        (
            "coordinator_ask_citations_dropped_total",
            Counter,
            "citations of chunks that were not in the prompt",
        ),
        (
            "coordinator_requests_shed_total",
            Counter,
            "requests refused by admission control",
        ),
        (
            "coordinator_auth_refusals_total",
            Counter,
            "calls refused for credentials or role",
        ),
        (
            "coordinator_replica_moves_total",
            Counter,
            "replicas moved by rebalancing",
        ),
        (
            "coordinator_replica_repairs_total",
            Counter,
            "failed replicas rebuilt in place from their peers",
        ),
        (
            "coordinator_replica_repair_failures_total",
            Counter,
            "replica rebuilds that failed (tried again at the next scan)",
        ),
        (
            "coordinator_replica_move_seconds",
            Histogram,
            "time of one replica move, learner added to catalog updated",
        ),
        (
            "coordinator_member_state_changes_total",
            Counter,
            "member table state changes made by this coordinator, by new state",
        ),
        ("catalog_term", Gauge, "catalog Raft term"),
        ("catalog_commit_index", Gauge, "catalog Raft commit index"),
        ("catalog_applied_index", Gauge, "catalog Raft applied index"),
        (
            "catalog_is_leader",
            Gauge,
            "1 where this coordinator leads the catalog",
        ),
        (
            "catalog_proposal_seconds",
            Histogram,
            "catalog proposal to apply",
        ),
    ]));
    f.extend(model_calls());
    f.extend(
        ragcluster_raft::counter_families("catalog")
            .into_iter()
            .map(|(n, h)| Family::new(n, Kind::Counter, h)),
    );
    f
}

/// The model worker as the coordinator calls it: failovers and the embedding cache.
fn model_calls() -> Vec<Family> {
    use Kind::*;
    families::table(&[
        (
            "coordinator_model_worker_failovers_total",
            Counter,
            "model calls moved to another worker after one failed",
        ),
        (
            "coordinator_embed_backlog_waits_total",
            Counter,
            "Embed calls sent again after a worker's load refusal and its retry hint",
        ),
        (
            "coordinator_reembed_batch_retries_total",
            Counter,
            "re-embedding copy batches tried again after a retryable refusal",
        ),
        (
            "coordinator_embed_cache_hits_total",
            Counter,
            "texts whose embedding came from the embedding cache",
        ),
        (
            "coordinator_embed_cache_misses_total",
            Counter,
            "texts looked up in the embedding cache and embedded by a model worker",
        ),
        (
            "coordinator_embed_cache_bytes",
            Gauge,
            "bytes held by the embedding cache",
        ),
    ])
}

/// How calls to shard nodes went: failovers, retries, broken read streams.
fn shard_calls() -> Vec<Family> {
    use Kind::*;
    families::table(&[
        (
            "coordinator_read_failovers_total",
            Counter,
            "shard reads retried on another replica",
        ),
        (
            "coordinator_read_streams_closed_total",
            Counter,
            "Shard.Reads streams that ended or broke (their calls in flight fail over)",
        ),
        (
            "coordinator_read_calls_cancelled_total",
            Counter,
            "calls on Shard.Reads streams given up before their reply (a cancel sent to the node)",
        ),
        (
            "coordinator_colocated_calls_total",
            Counter,
            "shard calls served by the shard node in this process (colocated binary), no network hop",
        ),
        (
            "coordinator_write_retries_total",
            Counter,
            "shard write attempts retried (leader moved, node down)",
        ),
        (
            "coordinator_write_hedges_total",
            Counter,
            "shard writes answered through another replica after the leader gave no answer for 1 s",
        ),
        (
            "coordinator_write_failures_total",
            Counter,
            "shard writes not committed within write_timeout",
        ),
    ])
}
