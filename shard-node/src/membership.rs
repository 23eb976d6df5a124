//! This node in the cluster's member table: it registers with the coordinators under its
//! stable Raft id (kept in its RocksDB) at whatever address it has now, heartbeats, and learns
//! from every answer where the other shard nodes are, so Raft traffic follows a peer that
//! came back on another address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ragcluster_common::membership::{self as member, Heartbeat};
use ragcluster_proto::v1::{HeartbeatRequest, MemberState, NodeKind};

use crate::config::ShardNodeConfig;
use crate::node::Node;

/// Disk use is measured at most this often (a directory walk).
const DISK_EVERY: Duration = Duration::from_secs(10);

/// The address other members reach this node at.
pub fn advertised(cfg: &ShardNodeConfig, bound: SocketAddr) -> anyhow::Result<String> {
    if !cfg.advertise_address.is_empty() {
        return Ok(cfg.advertise_address.clone());
    }
    if bound.ip().is_unspecified() {
        anyhow::bail!(
            "shard_node.advertise_address is needed when listening on {bound} (other members \
             cannot dial an unspecified address)"
        );
    }
    let scheme = if cfg.tls.enabled() { "https" } else { "http" };
    Ok(format!("{scheme}://{bound}"))
}

/// Starts heartbeating when coordinators are configured.
pub fn spawn(
    cfg: &ShardNodeConfig,
    bound: SocketAddr,
    node: &Arc<Node>,
    tls: Option<Arc<ragcluster_common::tls::Tls>>,
) -> anyhow::Result<Option<tokio::task::JoinHandle<()>>> {
    if cfg.coordinators.is_empty() {
        return Ok(None);
    }
    let address = advertised(cfg, bound)?;
    let node_id = node.node_id();
    tracing::info!(node_id, %address, coordinators = ?cfg.coordinators, "joining the cluster");
    let data_dir = cfg.data_dir.clone();
    let space = node.space().clone();
    let disk = Mutex::new((Instant::now() - DISK_EVERY * 2, 0u64));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let report = Arc::new(move || {
        let mut d = disk.lock();
        if d.0.elapsed() >= DISK_EVERY {
            *d = (Instant::now(), member::dir_bytes(&data_dir));
        }
        HeartbeatRequest {
            node_id,
            kind: NodeKind::ShardNode as i32,
            address: address.clone(),
            models: Vec::new(),
            cpus,
            disk_total_bytes: 0,
            disk_used_bytes: d.1,
            disk_full: space.full().unwrap_or_default(),
        }
    });
    let transport = node.transport().clone();
    let space = node.space().clone();
    let on_answer = Arc::new(move |r: &ragcluster_proto::v1::HeartbeatResponse| {
        space.set_full_peers(
            r.disk_full
                .iter()
                .filter(|(id, _)| **id != node_id)
                .map(|(id, why)| (*id, why.clone()))
                .collect(),
        );
        for m in &r.members {
            if m.kind() == NodeKind::ShardNode
                && m.node_id != node_id
                && m.state() != MemberState::Removed
            {
                if transport.address(m.node_id).as_deref() != Some(m.address.as_str()) {
                    tracing::info!(peer = m.node_id, address = %m.address, "peer address learned");
                }
                transport.learn_peer(m.node_id, &m.address);
            }
        }
    });
    Ok(Some(member::spawn(
        Heartbeat {
            coordinators: cfg.coordinators.clone(),
            interval: cfg.heartbeat_interval,
            tls,
        },
        report,
        on_answer,
    )))
}
