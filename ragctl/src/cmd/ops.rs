//! Operator commands that move shard replicas: `ragctl shard move`, `ragctl node drain` and
//! `ragctl rebalance`. Plans come from `ragctl::plan` over the cluster's current
//! state, so running a command again after an interruption plans only what is left (and a
//! half-done move resumes where it stopped); moves run one at a time, each with a progress
//! bar.

use anyhow::{Context, Result, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use indicatif::{ProgressBar, ProgressStyle};
use ragcluster_common::client::KeyedChannel;
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;
use ragctl::plan::{ShardView, Step, plan_leaders, plan_replicas};

#[derive(clap::Subcommand)]
pub enum ShardCmd {
    /// Move one replica of a shard to another node while it serves.
    Move {
        /// COLLECTION/SHARD, e.g. docs/0.
        shard: String,
        /// Shard node that gives up its replica (address).
        #[arg(long)]
        from: String,
        /// Shard node that gets the replica (address).
        #[arg(long)]
        to: String,
    },
}

#[derive(clap::Subcommand)]
pub enum NodeCmd {
    /// Move every replica off a shard node (before taking it out of service).
    Drain {
        /// Address of the shard node to empty.
        node: String,
        /// Show the plan only.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Shard-node addresses and every shard's placement and leader.
async fn state(admin: &mut AdminClient<KeyedChannel>) -> Result<(Vec<String>, Vec<ShardView>)> {
    let st = admin
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner();
    let nodes = st
        .nodes
        .iter()
        .filter(|n| n.kind() == NodeKind::ShardNode)
        .map(|n| n.address.clone())
        .collect();
    let mut shards = Vec::new();
    for c in &st.collections {
        let info = c.collection.as_ref().context("collection")?;
        for (i, p) in info.shards.iter().enumerate() {
            shards.push(ShardView {
                collection: info.name.clone(),
                shard: i as u32,
                nodes: p.nodes.clone(),
                leader: c
                    .shards
                    .iter()
                    .find(|s| s.shard == i as u32)
                    .map(|s| s.leader.clone())
                    .unwrap_or_default(),
            });
        }
    }
    Ok((nodes, shards))
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
    let NodeCmd::Drain { node, dry_run } = cmd;
    let (nodes, shards) = state(admin).await?;
    if !nodes.contains(node) {
        bail!("{node} is not a shard node; shard nodes: {nodes:?}");
    }
    let steps = plan_replicas(&nodes, &shards, Some(node));
    if steps.is_empty() {
        println!("{node} holds no replicas");
        return Ok(());
    }
    show(&steps);
    if !dry_run {
        execute(admin, &steps).await?;
        println!("{node} drained");
    }
    Ok(())
}

/// Evens replicas per node, then (on the state after the moves) leaders per node.
pub async fn rebalance(admin: &mut AdminClient<KeyedChannel>, dry_run: bool) -> Result<()> {
    let (nodes, shards) = state(admin).await?;
    let moves = plan_replicas(&nodes, &shards, None);
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
    let (nodes, shards) = state(admin).await?;
    let leaders = plan_leaders(&nodes, &shards);
    if !leaders.is_empty() {
        show(&leaders);
        execute(admin, &leaders).await?;
    }
    if moves.is_empty() && leaders.is_empty() {
        println!("balanced: nothing to do");
    }
    Ok(())
}
