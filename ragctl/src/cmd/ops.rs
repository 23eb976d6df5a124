//! Operator commands over nodes and replicas: `ragctl shard move`, `ragctl node list`, `node
//! drain`, `node remove` and `ragctl rebalance` (which also empties DRAINING nodes). Plans come from `ragctl::plan` over the cluster's current
//! state, so running a command again after an interruption plans only what is left (and a
//! half-done move resumes where it stopped); moves run one at a time, each with a progress
//! bar.

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use indicatif::{ProgressBar, ProgressStyle};
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;
use ragctl::plan::{self, ShardView, Step, plan_leaders, plan_replicas};

#[derive(clap::Subcommand)]
pub enum ShardCmd {
    /// Move one replica of a shard to another node while it serves.
    Move {
        /// COLLECTION/SHARD, e.g. docs/0.
        shard: String,
        /// Shard node that gives up its replica (address or node id).
        #[arg(long)]
        from: String,
        /// Shard node that gets the replica (address or node id).
        #[arg(long)]
        to: String,
    },
}

#[derive(clap::Subcommand)]
pub enum NodeCmd {
    /// Shard nodes and model workers: id, address, state, health, replicas, leaders, data
    /// held, disk used, last heartbeat.
    List,
    /// Move every replica off a shard node (before taking it out of service).
    Drain {
        /// The shard node to empty: its id or address.
        node: String,
        /// Show the plan only.
        #[arg(long)]
        dry_run: bool,
    },
    /// Take a node out of the cluster: mark it draining (no new replicas), move its replicas
    /// to other nodes, then remove it from the member table. Refused when a shard could not
    /// keep its replication factor (no other node can take its replica): removing the node
    /// would leave that shard one replica short, below quorum with the next failure.
    Remove {
        /// The node: its id (ragctl node list) or address.
        node: String,
        /// Show the plan only.
        #[arg(long)]
        dry_run: bool,
    },
}

/// The cluster as the planner needs it.
struct ClusterView {
    /// ClusterStatus rows.
    rows: Vec<NodeStatus>,
    /// Shard nodes that may take replicas (UP, or configured without an id yet).
    targets: Vec<String>,
    /// Shard nodes whose replicas must leave (DRAINING).
    draining: Vec<String>,
    shards: Vec<ShardView>,
}

impl ClusterView {
    /// A node row by id or address.
    fn find(&self, node: &str) -> Option<&NodeStatus> {
        let id = node.parse::<u64>().ok();
        self.rows
            .iter()
            .find(|n| n.address == node || (id.is_some() && Some(n.node_id) == id))
    }
}

/// Shard nodes and every shard's placement, leader and size.
async fn state(admin: &mut AdminClient<KeyedChannel>) -> Result<ClusterView> {
    let st = admin
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner();
    let shard_nodes = || st.nodes.iter().filter(|n| n.kind() == NodeKind::ShardNode);
    let targets = shard_nodes()
        .filter(|n| matches!(n.state(), MemberState::Up | MemberState::Unspecified))
        .map(|n| n.address.clone())
        .collect();
    let draining = shard_nodes()
        .filter(|n| n.state() == MemberState::Draining)
        .map(|n| n.address.clone())
        .collect();
    let mut shards = Vec::new();
    for c in &st.collections {
        let info = c.collection.as_ref().context("collection")?;
        for (i, p) in info.shards.iter().enumerate() {
            let stats = c.shards.iter().find(|s| s.shard == i as u32);
            shards.push(ShardView {
                collection: info.name.clone(),
                shard: i as u32,
                nodes: p.nodes.clone(),
                leader: stats.map(|s| s.leader.clone()).unwrap_or_default(),
                weight: stats.map_or(plan::weight(0, 0), |s| {
                    plan::weight(s.chunks, s.bm25_index_bytes)
                }),
            });
        }
    }
    Ok(ClusterView {
        rows: st.nodes,
        targets,
        draining,
        shards,
    })
}

fn bytes(n: u64) -> String {
    match n {
        0 => "-".into(),
        n if n < 1 << 20 => format!("{:.1} KiB", n as f64 / 1024.0),
        n if n < 1 << 30 => format!("{:.1} MiB", n as f64 / (1 << 20) as f64),
        n => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
    }
}

/// `ragctl node list`.
async fn list(admin: &mut AdminClient<KeyedChannel>) -> Result<()> {
    let st = state(admin).await?;
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header([
        "id",
        "kind",
        "address",
        "state",
        "health",
        "replicas",
        "leaders",
        "chunks",
        "disk used",
        "heartbeat",
        "models",
    ]);
    for n in &st.rows {
        let kind = ragcluster_common::names::node_kind_name(n.kind());
        let state = match n.state() {
            MemberState::Unspecified => "(seed)".to_owned(),
            s => s
                .as_str_name()
                .trim_start_matches("MEMBER_STATE_")
                .to_lowercase(),
        };
        t.add_row([
            if n.node_id == 0 {
                "-".into()
            } else {
                n.node_id.to_string()
            },
            kind.into(),
            n.address.clone(),
            state,
            n.health.clone(),
            n.shards.to_string(),
            n.leaders.to_string(),
            n.chunks.to_string(),
            bytes(n.disk_used_bytes),
            if n.heartbeat_age_ms == 0 {
                "-".into()
            } else {
                format!("{:.1} s ago", n.heartbeat_age_ms as f64 / 1000.0)
            },
            n.models.join(","),
        ]);
    }
    println!("{t}");
    Ok(())
}

fn show(steps: &[Step]) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED).set_header([
        "#",
        "action",
        "collection",
        "shard",
        "from",
        "to",
    ]);
    for (i, s) in steps.iter().enumerate() {
        let row = match s {
            Step::Move {
                collection,
                shard,
                from,
                to,
            } => [
                "move replica",
                collection.as_str(),
                &shard.to_string(),
                from.as_str(),
                to.as_str(),
            ]
            .map(String::from),
            Step::Leader {
                collection,
                shard,
                to,
            } => [
                "move leader",
                collection.as_str(),
                &shard.to_string(),
                "",
                to.as_str(),
            ]
            .map(String::from),
        };
        let mut r = vec![(i + 1).to_string()];
        r.extend(row);
        t.add_row(r);
    }
    println!("{t}");
}

/// Runs the steps in order, one at a time, each with a progress bar.
async fn execute(admin: &mut AdminClient<KeyedChannel>, steps: &[Step]) -> Result<()> {
    for (i, s) in steps.iter().enumerate() {
        let label = format!("[{}/{}]", i + 1, steps.len());
        match s {
            Step::Move {
                collection,
                shard,
                from,
                to,
            } => {
                let bar = ProgressBar::new(1);
                bar.set_style(ProgressStyle::with_template(
                    "{prefix} {bar:30} {pos}/{len} {msg}",
                )?);
                bar.set_prefix(format!("{label} {collection}/{shard} {from} -> {to}"));
                let mut stream = admin
                    .move_replica(MoveReplicaRequest {
                        collection: collection.clone(),
                        shard: *shard,
                        from: from.clone(),
                        to: to.clone(),
                    })
                    .await?
                    .into_inner();
                while let Some(p) = stream
                    .message()
                    .await
                    .with_context(|| format!("moving {collection}/{shard} {from} -> {to}"))?
                {
                    if p.step == "catching-up" {
                        bar.set_length(p.target.max(1));
                        bar.set_position(p.applied.min(p.target));
                    }
                    bar.set_message(p.step.clone());
                }
                bar.finish();
            }
            Step::Leader {
                collection,
                shard,
                to,
            } => {
                admin
                    .transfer_shard_leader(TransferShardLeaderRequest {
                        collection: collection.clone(),
                        shard: *shard,
                        to: to.clone(),
                    })
                    .await
                    .with_context(|| format!("leader of {collection}/{shard} to {to}"))?;
                println!("{label} leader of {collection}/{shard} -> {to}");
            }
        }
    }
    Ok(())
}

pub async fn shard(admin: &mut AdminClient<KeyedChannel>, cmd: &ShardCmd) -> Result<()> {
    let ShardCmd::Move { shard, from, to } = cmd;
    let (collection, n) = shard
        .rsplit_once('/')
        .context("SHARD is COLLECTION/NUMBER, e.g. docs/0")?;
    let n: u32 = n.parse().context("SHARD is COLLECTION/NUMBER")?;
    execute(
        admin,
        &[Step::Move {
            collection: collection.into(),
            shard: n,
            from: from.clone(),
            to: to.clone(),
        }],
    )
    .await
}

pub async fn node(admin: &mut AdminClient<KeyedChannel>, cmd: &NodeCmd) -> Result<()> {
    match cmd {
        NodeCmd::List => list(admin).await,
        NodeCmd::Drain { node, dry_run } => drain(admin, node, *dry_run).await,
        NodeCmd::Remove { node, dry_run } => remove(admin, node, *dry_run).await,
    }
}

/// The moves that empty `node`, and its row. Shards no other node can take are named in the
/// error, before anything moves.
fn drain_plan(st: &ClusterView, node: &str) -> Result<(NodeStatus, Vec<Step>)> {
    let Some(row) = st.find(node).cloned() else {
        let known: Vec<String> = st
            .rows
            .iter()
            .filter(|n| n.kind() == NodeKind::ShardNode)
            .map(|n| format!("{} ({})", n.node_id, n.address))
            .collect();
        bail!(
            "{node} is not a shard node; shard nodes: {}",
            known.join(", ")
        );
    };
    let addr = row.address.clone();
    let steps = plan_replicas(&st.targets, &st.shards, std::slice::from_ref(&addr));
    let moved = |s: &ShardView| {
        steps.iter().any(|m| {
            matches!(m, Step::Move { collection, shard, from, .. }
                if *collection == s.collection && *shard == s.shard && *from == addr)
        })
    };
    let stuck: Vec<String> = st
        .shards
        .iter()
        .filter(|s| s.nodes.contains(&addr) && !moved(s))
        .map(|s| format!("{}/{}", s.collection, s.shard))
        .collect();
    if !stuck.is_empty() {
        bail!(
            "no other shard node can take the replicas of {} on {addr}: removing it would leave \
             those shards one replica short (below quorum with the next failure). Add a shard \
             node first.",
            stuck.join(", ")
        );
    }
    Ok((row, steps))
}

/// Moves every replica off `node`.
async fn drain(admin: &mut AdminClient<KeyedChannel>, node: &str, dry_run: bool) -> Result<()> {
    let (row, steps) = drain_plan(&state(admin).await?, node)?;
    if steps.is_empty() {
        println!("{} holds no replicas", row.address);
        return Ok(());
    }
    show(&steps);
    if !dry_run {
        execute(admin, &steps).await?;
        println!("{} drained", row.address);
    }
    Ok(())
}

/// `ragctl node remove`: drain (marked DRAINING so nothing new lands there), then remove.
async fn remove(admin: &mut AdminClient<KeyedChannel>, node: &str, dry_run: bool) -> Result<()> {
    let st = state(admin).await?;
    let row = st
        .find(node)
        .cloned()
        .with_context(|| format!("{node} is not a member (ragctl node list)"))?;
    if row.node_id == 0 {
        bail!(
            "{} has no node id yet (it never registered): nothing to remove",
            row.address
        );
    }
    if row.kind() == NodeKind::ShardNode {
        // Planned before anything is marked: a refused remove changes nothing.
        let (_, steps) = drain_plan(&st, &row.address)?;
        if dry_run {
            show(&steps);
            return Ok(());
        }
        admin
            .set_node_state(SetNodeStateRequest {
                node_id: row.node_id,
                state: MemberState::Draining as i32,
            })
            .await
            .context("marking the node draining")?;
        drain(admin, &row.node_id.to_string(), false).await?;
    } else if dry_run {
        println!(
            "would remove model worker {} at {}",
            row.node_id, row.address
        );
        return Ok(());
    }
    let r = admin
        .remove_node(RemoveNodeRequest {
            node_id: row.node_id,
        })
        .await
        .context("removing the node")?
        .into_inner();
    let m = r.member.unwrap_or_default();
    println!("removed node {} ({})", m.node_id, m.address);
    Ok(())
}

/// Evens replicas per node, then (on the state after the moves) leaders per node.
pub async fn rebalance(admin: &mut AdminClient<KeyedChannel>, dry_run: bool) -> Result<()> {
    let ClusterView {
        targets: nodes,
        draining,
        shards,
        ..
    } = state(admin).await?;
    let moves = plan_replicas(&nodes, &shards, &draining);
    if dry_run {
        // Leaders are planned on the placement the moves leave (leaders of moved replicas
        // are only known after the moves run).
        let mut after = shards.clone();
        for m in &moves {
            if let Step::Move {
                collection,
                shard,
                from,
                to,
            } = m
                && let Some(v) = after
                    .iter_mut()
                    .find(|v| &v.collection == collection && v.shard == *shard)
            {
                for n in v.nodes.iter_mut().filter(|n| *n == from) {
                    *n = to.clone();
                }
            }
        }
        let mut all = moves;
        all.extend(plan_leaders(&nodes, &after));
        if all.is_empty() {
            println!("balanced: nothing to do");
        } else {
            show(&all);
        }
        return Ok(());
    }
    if !moves.is_empty() {
        show(&moves);
        execute(admin, &moves).await?;
    }
    let st = state(admin).await?;
    let leaders = plan_leaders(&st.targets, &st.shards);
    if !leaders.is_empty() {
        show(&leaders);
        execute(admin, &leaders).await?;
    }
    if moves.is_empty() && leaders.is_empty() {
        println!("balanced: nothing to do");
    }
    Ok(())
}
