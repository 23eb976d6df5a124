//! `[coordinator]` section of the cluster config.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use ragcluster_common::tls::{ClientAuth, TlsConfig, check_scheme};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    /// gRPC listen address for clients (Coordinator and Admin services); port 0 = any free port.
    pub listen: String,
    /// Also serve the same services on this Unix socket, for clients on the same host (a
    /// sidecar, an application in the same pod): they dial `unix:PATH` and skip the TCP stack.
    /// No TLS on it: the file's permissions decide who may connect; API keys still apply, and
    /// the internal services, which want a member certificate under TLS, refuse its callers.
    /// A stale socket file is replaced; the file is removed at shutdown. Unset: TCP only.
    pub unix_socket: Option<PathBuf>,
    /// Permission bits of the socket file (connecting takes write permission): 0o660, the
    /// owner and its group, e.g. a sidecar sharing a pod's `fsGroup`; 0o600 for the owner only.
    pub unix_socket_mode: u32,
    /// The catalog's Raft log and applied state are persisted here (`catalog/`).
    pub data_dir: PathBuf,
    /// Seed shard node addresses ("http://host:port"), optional: the catalog leader registers
    /// them from their NodeInfo. Membership is the catalog's member table: shard nodes started
    /// with `shard_node.coordinators` register and heartbeat themselves, from any address.
    /// New collections go to the UP shard nodes: shard i to node (hash(collection) + i) mod N.
    pub shard_nodes: Vec<String>,
    /// Seed model worker address, optional: calls go to the registered workers serving the
    /// model (least outstanding tokens first), and here while no worker holds this address.
    pub model_worker: String,
    /// How often shard nodes and model workers heartbeat (told to them in each answer).
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// A member silent (no heartbeat, no answered probe) this long is marked DOWN: searches
    /// avoid it at once, placement skips it.
    #[serde(with = "humantime_serde")]
    pub down_after: Duration,
    /// tokenizer.json of the embedding model; chunk sizes are counted in its tokens.
    pub embedding_tokenizer: PathBuf,
    /// Deadline for one search when the request gives none.
    #[serde(with = "humantime_serde")]
    pub search_timeout: Duration,
    /// Send the small reads of searches (up to 256 hits or chunks) on one multiplexed
    /// `Shard.Reads` stream per shard node instead of one gRPC call each: less CPU per query on
    /// both ends. Off: every read is its own call (the path before; an A/B baseline).
    pub shard_read_streams: bool,
    /// Deadline for one write to a shard (retries, leader changes, its fsync and index commit
    /// included); shorter than the usual client deadline, so a shard without quorum answers
    /// UNAVAILABLE before the client gives up. A tighter client deadline wins.
    #[serde(with = "humantime_serde")]
    pub write_timeout: Duration,
    /// SIGTERM to exit, at most: calls in flight drain, then the process exits anyway.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
    /// Deadline for one embedding call.
    #[serde(with = "humantime_serde")]
    pub embed_timeout: Duration,
    /// Texts per Embed call during ingest (1..=256); 0: the model's advertised `max_batch`
    /// (one forward pass of the worker per call).
    pub embed_batch: usize,
    /// Embed calls in flight per ingest request. 8: an upsert's chunks reach the model worker
    /// in one round, so a GPU worker's batcher stays fed while other upserts write (2 left a
    /// lent H200 idle between rounds: docs/bench/2026-11-27-gpu-ingest-word-cache.json).
    pub embed_concurrency: usize,
    /// Bytes of embeddings kept for reuse, keyed by model revision and exact text: texts
    /// embedded before (re-ingested documents, repeated queries) skip the model. 0: off.
    pub embed_cache_bytes: usize,
    pub port_file: Option<PathBuf>,
    /// This coordinator's Raft id in the catalog group (unique among `peers`). 0 takes it
    /// from the host name's StatefulSet ordinal (`NAME-N` -> N + 1), so that the pods of one
    /// Kubernetes StatefulSet can share one config.
    pub node_id: u64,
    /// Every coordinator of the cluster as "ID=URL" (this one included), the same list on each;
    /// URL is the address other coordinators and clients reach it at. Empty: a lone
    /// coordinator. Use 3 to survive the loss of one.
    pub peers: Vec<String>,
    /// Raft tick of the catalog group; elections take `raft_election_ticks` to
    /// 2 x `raft_election_ticks` ticks, heartbeats go every `raft_heartbeat_ticks`.
    #[serde(with = "humantime_serde")]
    pub raft_tick: Duration,
    pub raft_election_ticks: usize,
    pub raft_heartbeat_ticks: usize,
    /// Catalog log entries kept behind the applied index; a coordinator further behind gets
    /// the (small) catalog as a snapshot.
    pub raft_log_gc_threshold: u64,
    /// Flows for Ask (TOML, schema in coordinator/flows/examples.toml); unset = the shipped
    /// examples. Validated at start: an invalid file stops the coordinator naming the step.
    pub flows_file: Option<PathBuf>,
    /// Deadline of one Ask when the request gives none (the whole flow).
    #[serde(with = "humantime_serde")]
    pub ask_timeout: Duration,
    /// Tokens one Ask may generate over all its operators; requests may only lower it.
    pub ask_max_generated_tokens: usize,
    /// Parallel branches per branch / recurse step, and iterations per loop (caps on the flows'
    /// own bounds; requests may only lower them).
    pub ask_max_branches: usize,
    pub ask_max_iterations: usize,
    /// API keys and roles (`[coordinator.auth]`).
    pub auth: AuthConfig,
    /// Bounds on requests (`[coordinator.limits]`).
    pub limits: LimitsConfig,
    /// TLS for the client port and for calls to other members (`[coordinator.tls]`);
    /// callers' member certificates are optional here (clients use API keys) but required
    /// for the internal CatalogPeer service.
    pub tls: TlsConfig,
    /// Below this many free bytes on the file system of `data_dir` the catalog counts as full:
    /// changes (collections, members, API keys) are refused with RESOURCE_EXHAUSTED, this
    /// coordinator takes no new catalog entries and hands its catalog leadership away, reads
    /// and searches go on; changes are taken again by themselves once space is freed.
    pub disk_min_free_bytes: u64,
    /// Bytes held in `<data_dir>/.disk-reserve` while space is plentiful, released when the
    /// disk becomes full (room for the catalog's Raft state). 0: no reserve.
    pub disk_reserve_bytes: u64,
    /// Between two looks at the free space.
    #[serde(with = "humantime_serde")]
    pub disk_check_interval: Duration,
}

/// `[coordinator.auth]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Require an API key on every Coordinator and Admin call (health and reflection stay
    /// open). Off: every caller is an anonymous admin, as on a trusted network.
    pub enabled: bool,
    /// File holding the bootstrap admin key (one line, at least 32 characters, e.g.
    /// `openssl rand -hex 32`); needed when `enabled`. Read at start.
    pub admin_key_file: Option<PathBuf>,
}

/// `[coordinator.limits]`: what one request may ask for, and how many may run at once.
/// Beyond the concurrency bounds the coordinator answers RESOURCE_EXHAUSTED with a
/// `retry-after-ms` hint at once instead of queueing.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request message, bytes (256 documents of 1 MiB fit in the default).
    pub max_request_bytes: usize,
    /// Documents per UpsertDocuments / ids per DeleteDocuments (at most 256).
    pub max_batch_documents: usize,
    /// Largest top_k (and candidates) of a Search (at most 1000).
    pub max_top_k: u32,
    /// Coordinator and Admin requests in flight on this coordinator (Ask streams count
    /// until they end).
    pub max_concurrent_requests: usize,
    /// ...and per API key (all anonymous callers share one key when auth is off).
    pub max_concurrent_requests_per_key: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_request_bytes: 300 * 1024 * 1024,
            max_batch_documents: crate::limits::MAX_DOCS_PER_BATCH,
            max_top_k: crate::limits::MAX_SEARCH_TOP_K,
            max_concurrent_requests: 512,
            max_concurrent_requests_per_key: 128,
        }
    }
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:7000".into(),
            unix_socket: None,
            unix_socket_mode: 0o660,
            data_dir: PathBuf::from("data/coordinator"),
            shard_nodes: vec!["http://127.0.0.1:7100".into()],
            model_worker: "http://127.0.0.1:7200".into(),
            heartbeat_interval: Duration::from_secs(1),
            down_after: Duration::from_secs(10),
            embedding_tokenizer: PathBuf::from("models/all-MiniLM-L6-v2/tokenizer.json"),
            search_timeout: Duration::from_secs(5),
            shard_read_streams: true,
            write_timeout: Duration::from_secs(8),
            shutdown_timeout: Duration::from_secs(10),
            embed_timeout: Duration::from_secs(120),
            embed_batch: 0,
            embed_concurrency: 8,
            embed_cache_bytes: 64 * 1024 * 1024,
            port_file: None,
            node_id: 1,
            peers: Vec::new(),
            raft_tick: Duration::from_millis(100),
            raft_election_ticks: 10,
            raft_heartbeat_ticks: 2,
            raft_log_gc_threshold: 64,
            flows_file: None,
            ask_timeout: Duration::from_secs(120),
            ask_max_generated_tokens: 1024,
            ask_max_branches: 8,
            ask_max_iterations: 4,
            auth: Default::default(),
            limits: Default::default(),
            tls: TlsConfig::with_client_auth(ClientAuth::Optional),
            disk_min_free_bytes: 64 << 20,
            disk_reserve_bytes: 16 << 20,
            disk_check_interval: Duration::from_millis(500),
        }
    }
}

impl CoordinatorConfig {
    pub fn validate(&self) -> Result<(), String> {
        for (i, a) in self.shard_nodes.iter().enumerate() {
            if !(a.starts_with("http://") || a.starts_with("https://")) {
                return Err(format!(
                    "coordinator.shard_nodes[{i}] must start with http:// or https://"
                ));
            }
        }
        if self.unix_socket_mode > 0o777 {
            return Err(format!(
                "coordinator.unix_socket_mode {:#o}: permission bits are at most 0o777",
                self.unix_socket_mode
            ));
        }
        if self.embed_batch > 256 {
            return Err(
                "coordinator.embed_batch must be in [0, 256] (0: the model's max_batch)".into(),
            );
        }
        if self.embed_concurrency == 0 {
            return Err("coordinator.embed_concurrency must be positive".into());
        }
        if self.disk_check_interval.is_zero() {
            return Err("coordinator.disk_check_interval must be positive".into());
        }
        if self.raft_heartbeat_ticks == 0 || self.raft_election_ticks <= self.raft_heartbeat_ticks {
            return Err(
                "coordinator.raft_election_ticks must exceed raft_heartbeat_ticks (> 0)".into(),
            );
        }
        if !(1..=16_384).contains(&self.ask_max_generated_tokens) {
            return Err("coordinator.ask_max_generated_tokens must be in [1, 16384]".into());
        }
        if !(1..=crate::limits::MAX_FLOW_BRANCHES).contains(&self.ask_max_branches) {
            return Err(format!(
                "coordinator.ask_max_branches must be in [1, {}]",
                crate::limits::MAX_FLOW_BRANCHES
            ));
        }
        if !(1..=crate::limits::MAX_FLOW_ITERATIONS).contains(&self.ask_max_iterations) {
            return Err(format!(
                "coordinator.ask_max_iterations must be in [1, {}]",
                crate::limits::MAX_FLOW_ITERATIONS
            ));
        }
        if self.ask_timeout.is_zero() {
            return Err("coordinator.ask_timeout must be positive".into());
        }
        if self.raft_tick.is_zero() {
            return Err("coordinator.raft_tick must be positive".into());
        }
        let l = &self.limits;
        if !(1024..=1 << 30).contains(&l.max_request_bytes) {
            return Err("coordinator.limits.max_request_bytes must be in [1 KiB, 1 GiB]".into());
        }
        if !(1..=crate::limits::MAX_DOCS_PER_BATCH).contains(&l.max_batch_documents) {
            return Err(format!(
                "coordinator.limits.max_batch_documents must be in [1, {}]",
                crate::limits::MAX_DOCS_PER_BATCH
            ));
        }
        if !(1..=crate::limits::MAX_SEARCH_TOP_K).contains(&l.max_top_k) {
            return Err(format!(
                "coordinator.limits.max_top_k must be in [1, {}]",
                crate::limits::MAX_SEARCH_TOP_K
            ));
        }
        if l.max_concurrent_requests == 0 || l.max_concurrent_requests_per_key == 0 {
            return Err("coordinator.limits: concurrency bounds must be positive".into());
        }
        self.tls.validate("coordinator")?;
        for a in &self.shard_nodes {
            check_scheme("coordinator", "shard_nodes", a, &self.tls)?;
        }
        if !self.model_worker.is_empty() {
            check_scheme("coordinator", "model_worker", &self.model_worker, &self.tls)?;
        }
        if self.heartbeat_interval.is_zero() || self.down_after < self.heartbeat_interval * 3 {
            return Err(
                "coordinator.down_after must be at least 3 x heartbeat_interval (> 0)".into(),
            );
        }
        if self.auth.enabled && self.auth.admin_key_file.is_none() {
            return Err(
                "coordinator.auth.admin_key_file is needed when auth.enabled (the bootstrap \
                 admin key)"
                    .into(),
            );
        }
        if self.auth.enabled && !self.tls.enabled() {
            tracing::warn!(
                "coordinator.auth is enabled without TLS: API keys travel in clear text"
            );
        }
        let members = self.catalog_members()?;
        if members.len() % 2 == 0 {
            tracing::warn!(
                coordinators = members.len(),
                "an even number of coordinators tolerates no more failures than one fewer"
            );
        }
        Ok(())
    }

    /// Replaces `node_id = 0` by the ordinal of `hostname` (`NAME-N` -> N + 1).
    pub fn resolve_node_id(&mut self, hostname: Option<&str>) -> Result<(), String> {
        if self.node_id != 0 {
            return Ok(());
        }
        let host = hostname.unwrap_or_default();
        let ordinal = host
            .rsplit_once('-')
            .and_then(|(_, n)| n.parse::<u64>().ok())
            .ok_or_else(|| {
                format!(
                    "coordinator.node_id = 0 takes the id from a host name NAME-N (a StatefulSet \
                     pod), but the host name is {host:?}"
                )
            })?;
        self.node_id = ordinal + 1;
        Ok(())
    }

    /// The catalog group's members by Raft id, parsed from `peers` (or this coordinator alone).
    pub fn catalog_members(&self) -> Result<BTreeMap<u64, String>, String> {
        if self.node_id == 0 {
            return Err("coordinator.node_id must be non-zero".into());
        }
        let mut m = BTreeMap::new();
        if self.peers.is_empty() {
            let scheme = if self.tls.enabled() { "https" } else { "http" };
            m.insert(self.node_id, format!("{scheme}://{}", self.listen));
            return Ok(m);
        }
        for p in &self.peers {
            let (id, url) = p
                .split_once('=')
                .ok_or_else(|| format!("coordinator.peers: {p:?} is not ID=URL"))?;
            let id: u64 = id.trim().parse().ok().filter(|i| *i != 0).ok_or_else(|| {
                format!("coordinator.peers: {p:?}: ID must be a positive integer")
            })?;
            let url = url.trim();
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "coordinator.peers: {p:?}: URL must start with http:// or https://"
                ));
            }
            if m.insert(id, url.to_owned()).is_some() {
                return Err(format!("coordinator.peers: id {id} appears twice"));
            }
        }
        if !m.contains_key(&self.node_id) {
            return Err(format!(
                "coordinator.peers does not list this coordinator's node_id {}",
                self.node_id
            ));
        }
        for url in m.values() {
            check_scheme("coordinator", "peers", url, &self.tls)?;
        }
        if m.len() > 7 {
            return Err("coordinator.peers: at most 7 coordinators".into());
        }
        Ok(m)
    }
}

/// The coordinator's command-line flags, over `[coordinator]` (a set one wins over the file and
/// the environment); shared by the binaries that run a coordinator.
#[derive(Debug, Default, clap::Args, Serialize)]
pub struct CoordinatorFlags {
    /// gRPC listen address (coordinator.listen).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
    /// Also serve on this Unix socket (coordinator.unix_socket).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    unix_socket: Option<PathBuf>,
    /// Catalog directory (coordinator.data_dir).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    data_dir: Option<PathBuf>,
    /// Shard node addresses, comma separated (coordinator.shard_nodes).
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    shard_nodes: Option<Vec<String>>,
    /// Model worker address (coordinator.model_worker).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    model_worker: Option<String>,
    /// tokenizer.json of the embedding model (coordinator.embedding_tokenizer).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    embedding_tokenizer: Option<PathBuf>,
    /// Raft id of this coordinator in the catalog group (coordinator.node_id).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    node_id: Option<u64>,
    /// All coordinators as ID=URL, comma separated (coordinator.peers).
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    peers: Option<Vec<String>>,
    /// Flow file for Ask (coordinator.flows_file); default: the shipped example flows.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    flows_file: Option<PathBuf>,
    /// Write the bound addresses here as JSON (coordinator.port_file).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    port_file: Option<PathBuf>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_id_zero_comes_from_the_statefulset_ordinal() {
        let mut c = CoordinatorConfig {
            node_id: 0,
            ..Default::default()
        };
        c.resolve_node_id(Some("rag-coordinator-2")).unwrap();
        assert_eq!(c.node_id, 3);
        c.resolve_node_id(Some("other-7")).unwrap();
        assert_eq!(c.node_id, 3, "an explicit id stays");
        let mut c = CoordinatorConfig {
            node_id: 0,
            ..Default::default()
        };
        assert!(c.resolve_node_id(Some("laptop")).is_err());
        assert!(c.resolve_node_id(None).is_err());
    }
}
