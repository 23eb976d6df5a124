//! The catalog replicated among three coordinators (real processes on loopback): changes made
//! through any coordinator reach all, a leader coordinator's kill -9 costs one election and no
//! collection, a coordinator that was down catches up (by snapshot when the log moved on), and
//! without a coordinator quorum changes fail fast with UNAVAILABLE while reads keep working.

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use ragcluster_proto::v1::admin_client::AdminClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, Options, coordinator_client, http_get};
use tonic::transport::Channel;

const COORDINATOR_CONFIG: &str = r#"
[coordinator]
raft_tick = "50ms"
raft_election_ticks = 10
raft_heartbeat_ticks = 2
raft_log_gc_threshold = 8
"#;

async fn status(addr: &str) -> Result<CatalogStatus> {
    let ch = Channel::from_shared(addr.to_owned())?.connect().await?;
    let st = AdminClient::new(ch)
        .cluster_status(ClusterStatusRequest {})
        .await?
        .into_inner();
    Ok(st.catalog.unwrap_or_default())
}

/// Waits until every coordinator in `addrs` names the same leader; returns its address.
async fn agreed_leader(addrs: &[String], timeout: Duration) -> Result<String> {
    let until = Instant::now() + timeout;
    loop {
        let mut leaders = Vec::new();
        for a in addrs {
            if let Ok(s) = status(a).await {
                leaders.push(if s.role() == RaftRole::Leader {
                    a.clone()
                } else {
                    s.leader_address
                });
            }
        }
        if leaders.len() == addrs.len()
            && !leaders[0].is_empty()
            && leaders.iter().all(|l| *l == leaders[0])
        {
            return Ok(leaders[0].clone());
        }
        if Instant::now() > until {
            bail!("coordinators do not agree on a catalog leader: {leaders:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn names(addr: &str) -> Result<Vec<String>> {
    let mut c = coordinator_client(addr).await?;
    let r = c
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner();
    Ok(r.collections.into_iter().map(|c| c.name).collect())
}

/// Every coordinator in `addrs` lists exactly `want` (after catching up).
async fn all_list(addrs: &[String], want: &[&str], timeout: Duration) -> Result<()> {
    let until = Instant::now() + timeout;
    loop {
        let mut ok = true;
        for a in addrs {
            if names(a).await.ok().as_deref()
                != Some(&want.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            {
                ok = false;
            }
        }
        if ok {
            return Ok(());
        }
        if Instant::now() > until {
            let mut seen = Vec::new();
            for a in addrs {
                seen.push((a.clone(), names(a).await.ok()));
            }
            bail!("coordinators do not all list {want:?}: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn create_req(name: &str) -> CreateCollectionRequest {
    CreateCollectionRequest {
        name: name.into(),
        shard_count: 1,
        replication_factor: 1,
        ..Default::default()
    }
}

/// Creates through `addr`, retrying UNAVAILABLE (an election) for up to `timeout`.
async fn create_retrying(addr: &str, name: &str, timeout: Duration) -> Result<()> {
    let until = Instant::now() + timeout;
    loop {
        let mut c = coordinator_client(addr).await?;
        match c.create_collection(create_req(name)).await {
            Ok(_) => return Ok(()),
            Err(s) if s.code() == tonic::Code::Unavailable && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) => bail!("create {name} through {addr}: {s}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_catalog() -> Result<()> {
    let mut cluster = Cluster::start_opts(Options {
        shard_nodes: 2,
        shard_config: None,
        coordinators: 3,
        coordinator_config: Some(COORDINATOR_CONFIG),
        ..Default::default()
    })?;
    let addrs: Vec<String> = cluster
        .coordinators_mut()
        .iter()
        .map(|p| p.grpc.clone())
        .collect();
    let leader = agreed_leader(&addrs, Duration::from_secs(30)).await?;
    let follower = addrs.iter().find(|a| **a != leader).unwrap().clone();

    // A change through a follower is forwarded to the leader and visible there at once.
    let mut c = coordinator_client(&follower).await?;
    c.create_collection(create_req("alpha")).await?;
    ensure!(
        names(&follower).await? == ["alpha"],
        "forwarding coordinator lags"
    );
    all_list(&addrs, &["alpha"], Duration::from_secs(10)).await?;
    let dup = c.create_collection(create_req("alpha")).await.unwrap_err();
    ensure!(
        dup.code() == tonic::Code::AlreadyExists,
        "duplicate create: {dup}"
    );

    // Writes and searches work through any coordinator.
    let other = addrs
        .iter()
        .find(|a| **a != leader && **a != follower)
        .unwrap()
        .clone();
    let mut w = coordinator_client(&other).await?;
    w.upsert_documents(UpsertDocumentsRequest {
        collection: "alpha".into(),
        documents: vec![Document {
            id: "doc-1".into(),
            title: "Raft".into(),
            text: "Raft keeps a replicated log consistent across a cluster of machines.".into(),
            ..Default::default()
        }],
        ..Default::default()
    })
    .await?;
    let hits = c
        .search(SearchRequest {
            collection: "alpha".into(),
            query: "replicated log".into(),
            top_k: 3,
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(
        hits.hits.first().map(|h| h.doc_id.as_str()) == Some("doc-1"),
        "search through another coordinator: {hits:?}"
    );

    // Kill -9 the leader coordinator: the survivors elect one and keep taking changes.
    let li = addrs.iter().position(|a| *a == leader).unwrap();
    let killed = Instant::now();
    cluster.coordinators_mut()[li].kill9();
    let survivors: Vec<String> = addrs.iter().filter(|a| **a != leader).cloned().collect();
    create_retrying(&survivors[0], "beta", Duration::from_secs(20)).await?;
    eprintln!(
        "catalog failover: first change acknowledged {} ms after kill -9 of the leader coordinator",
        killed.elapsed().as_millis()
    );
    // Enough changes while it is down that its log position is compacted away (threshold 8).
    for i in 0..6 {
        create_retrying(&survivors[1], &format!("tmp{i}"), Duration::from_secs(10)).await?;
    }
    for i in 0..6 {
        let mut c = coordinator_client(&survivors[0]).await?;
        c.drop_collection(DropCollectionRequest {
            name: format!("tmp{i}"),
        })
        .await?;
    }
    all_list(&survivors, &["alpha", "beta"], Duration::from_secs(10)).await?;

    // The old leader restarts and catches up (snapshot: its entries were compacted).
    cluster.coordinators_mut()[li].restart(Duration::from_secs(60))?;
    all_list(&addrs, &["alpha", "beta"], Duration::from_secs(20)).await?;
    let body = http_get(&cluster.coordinators_mut()[li].metrics).await?;
    ensure!(
        body.contains("catalog_snapshots_applied_total"),
        "restarted coordinator did not catch up by snapshot"
    );

    // Changes through the restarted one work too; a drop reaches everyone.
    let mut c = coordinator_client(&leader).await?;
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        match c
            .drop_collection(DropCollectionRequest {
                name: "alpha".into(),
            })
            .await
        {
            Ok(_) => break,
            Err(s) if s.code() == tonic::Code::Unavailable && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(s) => bail!("drop through restarted coordinator: {s}"),
        }
    }
    all_list(&addrs, &["beta"], Duration::from_secs(10)).await?;

    // No quorum: two of three down. Changes fail fast with UNAVAILABLE; reads still work.
    let keep = addrs.iter().position(|a| *a == leader).unwrap();
    for (i, p) in cluster.coordinators_mut().into_iter().enumerate() {
        if i != keep {
            p.kill9();
        }
    }
    let mut c = coordinator_client(&leader).await?;
    let t = Instant::now();
    let mut req = tonic::Request::new(create_req("gamma"));
    req.set_timeout(Duration::from_secs(40));
    let e = c.create_collection(req).await.unwrap_err();
    ensure!(
        e.code() == tonic::Code::Unavailable,
        "create without quorum: {e}"
    );
    ensure!(
        t.elapsed() < Duration::from_secs(35),
        "create without quorum hung"
    );
    ensure!(names(&leader).await? == ["beta"], "reads without quorum");
    for (i, p) in cluster.coordinators_mut().into_iter().enumerate() {
        if i != keep {
            p.restart(Duration::from_secs(60))?;
        }
    }
    create_retrying(&leader, "gamma", Duration::from_secs(30)).await?;
    all_list(&addrs, &["beta", "gamma"], Duration::from_secs(10)).await?;
    Ok(())
}
