//! `ragctl status`: nodes, catalog and every shard's replicas.

use anyhow::Result;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use ragcluster_common::names::{node_kind_name, raft_role_name};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;

use crate::{Cli, channel};

pub fn print_shards(shards: &[ShardStats]) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header([
        "shard",
        "leader",
        "term",
        "replicas",
        "docs",
        "chunks",
        "applied",
        "bm25 bytes",
        "hnsw",
        "tombstones",
        "disk per chunk",
        "error",
    ]);
    for s in shards {
        t.add_row([
            s.shard.to_string(),
            s.leader.clone(),
            s.term.to_string(),
            s.replicas
                .iter()
                .map(|r| {
                    let mut line = format!(
                        "{} {} @{} lag {}",
                        r.node,
                        raft_role_name(r.role()),
                        r.applied_index,
                        s.commit_index.saturating_sub(r.applied_index)
                    );
                    if !r.failed.is_empty() {
                        line.push_str(&format!(" OUT OF SERVICE: {}", r.failed));
                    }
                    line
                })
                .collect::<Vec<_>>()
                .join("\n"),
            s.documents.to_string(),
            s.chunks.to_string(),
            s.applied_seq.to_string(),
            s.bm25_index_bytes.to_string(),
            match s.hnsw_pending {
                0 => s.hnsw_points.to_string(),
                p => format!("{} ({p} outside the graph)", s.hnsw_points),
            },
            s.hnsw_tombstones.to_string(),
            per_chunk(s),
            s.error.clone(),
        ]);
    }
    println!("{t}");
}

/// "3.4 KB: vectors 1.6 KB, hnsw_dump 1.2 KB, ..." (places under 1% of the total left out).
fn per_chunk(s: &ShardStats) -> String {
    if s.chunks == 0 || s.bytes_by_family.is_empty() {
        return String::new();
    }
    let total: u64 = s.bytes_by_family.values().sum();
    let kb = |b: u64| format!("{:.2} KB", b as f64 / s.chunks as f64 / 1000.0);
    let mut parts: Vec<(&String, &u64)> = s
        .bytes_by_family
        .iter()
        .filter(|(_, b)| **b * 100 >= total)
        .collect();
    parts.sort_by(|a, b| b.1.cmp(a.1));
    let lines: Vec<String> = parts
        .iter()
        .map(|(n, b)| format!("{n} {}", kb(**b)))
        .collect();
    format!("{}\n{}", kb(total), lines.join("\n"))
}

pub async fn status(cli: &Cli, json: bool) -> Result<()> {
    let st = AdminClient::new(channel(cli).await?)
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner();
    if json {
        let nodes: Vec<_> = st.nodes.iter().map(|n| serde_json::json!({"address": n.address, "role": node_kind_name(n.kind()), "health": n.health, "shards": n.shards, "leaders": n.leaders, "disk_full": n.disk_full})).collect();
        let cols: Vec<_> = st
            .collections
            .iter()
            .map(|c| {
                let shards: Vec<_> = c.shards.iter().map(|s| serde_json::json!({"shard": s.shard, "leader": s.leader, "term": s.term, "replicas": s.replicas.iter().map(|r| serde_json::json!({"node": r.node, "role": raft_role_name(r.role()), "applied": r.applied_index, "lag": s.commit_index.saturating_sub(r.applied_index), "chunks": r.chunks, "failed": r.failed})).collect::<Vec<_>>(), "documents": s.documents, "chunks": s.chunks, "bytes_by_family": s.bytes_by_family, "error": s.error})).collect();
                serde_json::json!({"name": c.collection.as_ref().map(|x| x.name.clone()), "shards": shards})
            })
            .collect();
        let catalog = st.catalog.as_ref().map(|c| serde_json::json!({"node_id": c.node_id, "role": raft_role_name(c.role()), "leader_id": c.leader_id, "leader": c.leader_address, "term": c.term, "commit_index": c.commit_index, "applied_index": c.applied_index}));
        println!(
            "{}",
            serde_json::json!({"nodes": nodes, "collections": cols, "catalog": catalog})
        );
        return Ok(());
    }
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_header(["role", "address", "health", "shards", "leaders", "disk"]);
    for n in &st.nodes {
        t.add_row([
            node_kind_name(n.kind()).to_string(),
            n.address.clone(),
            n.health.clone(),
            n.shards.to_string(),
            n.leaders.to_string(),
            if n.disk_full.is_empty() {
                String::new()
            } else {
                format!("FULL: {}", n.disk_full)
            },
        ]);
    }
    println!("{t}");
    if let Some(c) = &st.catalog {
        println!(
            "catalog: coordinator {} is {} (leader {} {}), term {}, commit {}, applied {}",
            c.node_id,
            raft_role_name(c.role()),
            c.leader_id,
            c.leader_address,
            c.term,
            c.commit_index,
            c.applied_index
        );
        for p in c.peers.iter().filter(|p| p.node_id != c.node_id) {
            println!("  peer {} {} matched {}", p.node_id, p.address, p.matched);
        }
    }
    for c in &st.collections {
        println!(
            "collection {}",
            c.collection
                .as_ref()
                .map(|x| x.name.as_str())
                .unwrap_or("?")
        );
        print_shards(&c.shards);
    }
    Ok(())
}
