//! Cluster membership with real processes (issue 19): shard nodes and model workers join a
//! coordinator that was configured with none of them, keep stable ids across restarts on new
//! ports, are marked DOWN when they fall silent, and the cluster grows and shrinks under a
//! client load without a failed call. Each test prints its figures (`--nocapture`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::load::{Load, converged};
use ragcluster_tests::{Joined, http_get, metric_sum, ragctl_at, upsert_with_vectors};
use tokio::sync::Mutex;
use tonic::transport::Channel;

const UP_WITHIN: Duration = Duration::from_secs(30);

async fn status(admin: &mut AdminClient<Channel>) -> Result<ClusterStatusResponse> {
    Ok(admin
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner())
}

/// The member row at `address`.
fn row<'a>(st: &'a ClusterStatusResponse, address: &str) -> Option<&'a NodeStatus> {
    st.nodes.iter().find(|n| n.address == address)
}

async fn create(c: &Joined, name: &str, shards: u32, rf: u32) -> Result<CollectionInfo> {
    let mut client = c.client().await?;
    client
        .create_collection(CreateCollectionRequest {
            name: name.into(),
            shard_count: shards,
            replication_factor: rf,
            ..Default::default()
        })
        .await?
        .into_inner()
        .collection
        .context("collection")
}

async fn describe(c: &Joined, name: &str) -> Result<CollectionInfo> {
    c.client()
        .await?
        .describe_collection(DescribeCollectionRequest { name: name.into() })
        .await?
        .into_inner()
        .collection
        .context("collection")
}

/// A shard node killed during writes is marked DOWN (searches go on), then comes back on
/// another port: its entry keeps its id and takes the new address, placements follow, the
/// other replicas reach it there, and it catches up, with no operator action.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_restarted_on_a_new_port_rejoins_during_writes() -> Result<()> {
    let mut j = Joined::start(3, 1, "[coordinator]\ndown_after = \"3s\"\n", None)?;
    j.wait_up(&j.addresses(), UP_WITHIN).await?;
    create(&j, "moved", 2, 3).await?;
    let c = j.client().await?;
    let mut admin = j.admin().await?;
    let load = Load::start(c.clone(), "moved", "mv", SearchMode::Hybrid);
    while load.written().await < 20 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let old = j.shards[2].grpc.clone();
    let id = row(&status(&mut admin).await?, &old)
        .context("member row")?
        .node_id;
    ensure!(id != 0, "shard-2 has no node id");

    // Killed: DOWN once silent for down_after, while the load keeps going.
    j.shards[2].kill9();
    let killed = Instant::now();
    loop {
        let st = status(&mut admin).await?;
        if row(&st, &old).is_some_and(|n| n.state() == MemberState::Down) {
            break;
        }
        ensure!(
            killed.elapsed() < Duration::from_secs(15),
            "not marked DOWN"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let down_after = killed.elapsed();

    // Back on another port.
    let restarted = Instant::now();
    j.shards[2].restart_elsewhere(Duration::from_secs(120))?;
    let new = j.shards[2].grpc.clone();
    ensure!(new != old, "same port again");
    let rows = j.wait_up(std::slice::from_ref(&new), UP_WITHIN).await?;
    ensure!(
        rows.iter().any(|n| n.node_id == id && n.address == new),
        "node {id} not at {new}: {rows:?}"
    );
    ensure!(
        !rows.iter().any(|n| n.address == old),
        "old address still listed"
    );
    let rejoined = restarted.elapsed();
    let info = describe(&j, "moved").await?;
    for (i, p) in info.shards.iter().enumerate() {
        ensure!(
            p.nodes.contains(&new) && !p.nodes.contains(&old) && p.node_ids.contains(&id),
            "shard {i} placement {:?} {:?}",
            p.nodes,
            p.node_ids
        );
    }
    let before = load.written().await;
    while load.written().await < before + 20 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    load.stop().await?;
    let caught_up = converged(&mut admin, "moved", 3, Duration::from_secs(60)).await?;
    load.verify(c).await?;
    // Three nodes, three replicas a shard: removing one would leave every shard a replica
    // short. Refused, and nothing changes (the node is not even marked draining).
    let co = j.coordinator.grpc.clone();
    let refused =
        tokio::task::block_in_place(|| ragctl_at(&co, &["node", "remove", &id.to_string()]));
    let e = refused.err().context("node remove was not refused")?;
    ensure!(e.to_string().contains("one replica short"), "{e:#}");
    ensure!(
        row(&status(&mut admin).await?, &new).is_some_and(|n| n.state() == MemberState::Up),
        "refused remove changed the node's state"
    );
    eprintln!(
        "figures: DOWN after {:.1} s of silence (down_after 3 s); restart on a new port to UP \
         at it {:.2} s; replicas converged {:.2} s after the load stopped; writes acknowledged \
         {}, write retries {}, searches {} (retried {})",
        down_after.as_secs_f64(),
        rejoined.as_secs_f64(),
        caught_up.as_secs_f64(),
        load.written().await,
        load.write_retries.load(Ordering::Relaxed),
        load.searches.load(Ordering::Relaxed),
        load.search_retries.load(Ordering::Relaxed),
    );
    Ok(())
}

/// Replicas per shard node address.
fn spread(st: &ClusterStatusResponse) -> Vec<(String, u32)> {
    st.nodes
        .iter()
        .filter(|n| n.kind() == NodeKind::ShardNode)
        .map(|n| (n.address.clone(), n.shards))
        .collect()
}

/// 3 shard nodes grow to 5 under a writer and a searcher: the new nodes join, `ragctl
/// rebalance` gives them replicas, then `ragctl node remove` takes one of the old nodes out.
/// No client call fails (beyond retried UNAVAILABLE), every acknowledged write is found, and
/// the replicas converge. Logs are compacted early, so moved replicas travel as snapshots
/// and their bytes are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_grows_from_three_to_five_nodes_under_load() -> Result<()> {
    let mut j = Joined::start(
        3,
        1,
        "[coordinator]\n",
        Some("[shard_node]\nraft_log_gc_threshold = 64\n"),
    )?;
    j.wait_up(&j.addresses(), UP_WITHIN).await?;
    let info = create(&j, "grow", 6, 3).await?;
    let c = j.client().await?;
    let mut admin = j.admin().await?;
    // Data to move: RAGCLUSTER_GROW_DOCS documents (default 3000) with their own vectors.
    let docs: usize = std::env::var("RAGCLUSTER_GROW_DOCS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3000);
    let t = Instant::now();
    upsert_with_vectors(
        &mut c.clone(),
        "grow",
        "pre",
        "shard moves, snapshots and Raft learners",
        info.dimension as usize,
        docs,
    )
    .await?;
    let prefill_s = t.elapsed().as_secs_f64();
    let load = Load::start(c.clone(), "grow", "gr", SearchMode::Hybrid);
    while load.written().await < 150 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    j.add_shard_node()?;
    j.add_shard_node()?;
    j.wait_up(&j.addresses(), UP_WITHIN).await?;
    let co = j.coordinator.grpc.clone();
    let t = Instant::now();
    tokio::task::block_in_place(|| ragctl_at(&co, &["rebalance"]))?;
    let rebalance_s = t.elapsed().as_secs_f64();
    let st = status(&mut admin).await?;
    let s = spread(&st);
    eprintln!("replicas per node after rebalance: {s:?}");
    ensure!(s.len() == 5, "{s:?}");
    // Sizes differ a little between shards, so counts may not be exactly 3-4 each.
    ensure!(
        s.iter().all(|(_, n)| (2..=5).contains(n)) && s.iter().map(|(_, n)| n).sum::<u32>() == 18,
        "18 replicas over 5 nodes: {s:?}"
    );

    // Remove one of the first three.
    let gone = j.shards[0].grpc.clone();
    let gone_id = row(&st, &gone).context("shard-0 row")?.node_id;
    let t = Instant::now();
    tokio::task::block_in_place(|| ragctl_at(&co, &["node", "remove", &gone_id.to_string()]))?;
    let remove_s = t.elapsed().as_secs_f64();
    let st = status(&mut admin).await?;
    ensure!(row(&st, &gone).is_none(), "removed node still listed");
    let s = spread(&st);
    ensure!(
        s.len() == 4 && s.iter().map(|(_, n)| n).sum::<u32>() == 18,
        "{s:?}"
    );
    // Removed means removed: a heartbeat from it is refused, not re-registered.
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(row(&status(&mut admin).await?, &gone).is_none());
    let mut m = ragcluster_proto::v1::membership_client::MembershipClient::new(
        Channel::from_shared(co.clone())?.connect().await?,
    );
    let beat = |node_id: u64, address: &str| HeartbeatRequest {
        node_id,
        kind: NodeKind::ShardNode as i32,
        address: address.into(),
        ..Default::default()
    };
    let e = m.heartbeat(beat(gone_id, &gone)).await.unwrap_err();
    ensure!(e.code() == tonic::Code::FailedPrecondition, "{e:?}");
    for bad in [
        beat(0, &gone),
        beat(7, "not-an-address"),
        beat(7, "http://no-port"),
    ] {
        let e = m.heartbeat(bad).await.unwrap_err();
        ensure!(e.code() == tonic::Code::InvalidArgument, "{e:?}");
    }

    load.stop().await?;
    converged(&mut admin, "grow", 3, Duration::from_secs(90)).await?;
    load.verify(c).await?;

    let page = http_get(&j.coordinator.metrics).await?;
    let moves = metric_sum(&page, "coordinator_replica_move_seconds_count");
    let move_s = metric_sum(&page, "coordinator_replica_move_seconds_sum");
    let mut bytes = 0.0;
    for p in &j.shards {
        bytes += metric_sum(
            &http_get(&p.metrics).await?,
            "raft_snapshot_sent_bytes_total",
        );
    }
    ensure!(moves > 0.0, "no moves recorded");
    eprintln!(
        "figures: {docs} documents prefilled in {prefill_s:.1} s; {moves} replica moves in \
         {move_s:.1} s ({:.2} s per replica), snapshot bytes {:.1} MB ({:.2} MB/s of move \
         time); rebalance {rebalance_s:.1} s, node remove {remove_s:.1} s; writes acknowledged \
         {}, write retries {}, searches {} (retried {})",
        move_s / moves,
        bytes / 1e6,
        bytes / 1e6 / move_s.max(1e-9),
        load.written().await,
        load.write_retries.load(Ordering::Relaxed),
        load.searches.load(Ordering::Relaxed),
        load.search_retries.load(Ordering::Relaxed),
    );
    Ok(())
}

/// Two model workers share the embedding load (least outstanding tokens); one is killed with
/// calls in flight. Calls on it move to the other worker; the count of failed client calls
/// is reported and bounded by the calls that were in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn model_worker_killed_under_embedding_load() -> Result<()> {
    const CLIENTS: usize = 6;
    let mut j = Joined::start(1, 2, "[coordinator]\ndown_after = \"3s\"\n", None)?;
    j.wait_up(&j.addresses(), UP_WITHIN).await?;
    create(&j, "emb", 1, 1).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(Mutex::new(Vec::<(f64, String)>::new()));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..CLIENTS {
        let mut c = j.client().await?;
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let documents = (0..4)
                    .map(|k| Document {
                        id: format!("c{t}-{i}-{k}"),
                        text: format!(
                            "client {t} call {i} document {k}: embeddings are computed by \
                             whichever model worker has the fewest tokens outstanding"
                        ),
                        ..Default::default()
                    })
                    .collect();
                let r = c
                    .upsert_documents(UpsertDocumentsRequest {
                        collection: "emb".into(),
                        documents,
                        ..Default::default()
                    })
                    .await;
                match r {
                    Ok(_) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(s) => failed.lock().await.push((
                        started.elapsed().as_secs_f64(),
                        format!("{:?}: {}", s.code(), s.message()),
                    )),
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    let before_kill = ok.load(Ordering::Relaxed);
    // How the embedding calls were shared before the kill.
    let mut served = Vec::new();
    for w in &j.model_workers {
        let page = http_get(&w.metrics).await?;
        let embeds: f64 = page
            .lines()
            .filter(|l| {
                l.starts_with("grpc_server_requests_total{") && l.contains("method=\"Embed\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        served.push(embeds);
    }
    ensure!(
        served.iter().all(|n| *n > 0.0),
        "both workers should serve: {served:?}"
    );
    let killed_at = started.elapsed().as_secs_f64();
    j.model_workers[0].kill9();
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    let failed = failed.lock().await.clone();
    let total = ok.load(Ordering::Relaxed);
    let page = http_get(&j.coordinator.metrics).await?;
    let failovers = metric_sum(&page, "coordinator_model_worker_failovers_total");
    eprintln!(
        "figures: {total} upsert calls of 4 documents succeeded ({before_kill} before the \
         kill at {killed_at:.1} s, {} after); Embed calls per worker before the kill \
         {served:?}; failed calls {}: {failed:?}; model calls moved to the other worker: \
         {failovers}",
        total - before_kill,
        failed.len()
    );
    ensure!(total > before_kill, "no call succeeded after the kill");
    ensure!(
        failed.len() <= CLIENTS,
        "more calls failed than were in flight: {failed:?}"
    );
    ensure!(
        failed.iter().all(|(at, _)| *at < killed_at + 3.0),
        "calls still failing well after the kill: {failed:?}"
    );
    Ok(())
}
