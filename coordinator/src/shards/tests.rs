//! The shard client's retry and failover policy against scripted shard nodes (`scripted`):
//! leader hints, same-request-id retries, refusals that must not be retried, write and read
//! deadlines, eventual-read failover, strong reads pinned to the leader, elections waited out.

use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;

use super::scripted::{Answer, ScriptedConnector};
use super::*;
use crate::error::CoordError;

fn nodes(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("n{i}")).collect()
}

fn placement(n: usize) -> Vec<ShardPlacement> {
    vec![ShardPlacement {
        nodes: nodes(n),
        node_ids: (1..=n as u64).collect(),
    }]
}

fn plan<'a>(
    replicas: &'a [ShardPlacement],
    consistency: Consistency,
    within: Duration,
) -> ReadPlan<'a> {
    ReadPlan {
        collection: "c",
        replicas,
        consistency,
        deadline: Instant::now() + within,
        token: &crate::read_token::NO_TOKEN,
    }
}

fn sref() -> ShardRef {
    ShardRef {
        collection: "c".into(),
        shard: 0,
    }
}

async fn write(s: &Shards, within: Duration) -> Result<WriteBatchResponse> {
    s.write("c", 0, &nodes(3), super::Batch::Writes(Vec::new()), within)
        .await
}

#[tokio::test]
async fn a_write_follows_the_leader_hint_and_then_goes_straight_there() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    // n0, the preferred leader, does not lead: it names n2.
    ns[0].script("write_batch", [Answer::not_leader(Some((3, "n2")))]);
    write(&s, Duration::from_secs(2)).await.unwrap();
    assert_eq!(ns[0].count("write_batch"), 1);
    assert_eq!(ns[1].count("write_batch"), 0);
    assert_eq!(ns[2].count("write_batch"), 1);
    // One request id across attempts: a batch whose first try did commit is applied once.
    assert_eq!(ns[0].calls()[0].request_id, ns[2].calls()[0].request_id);
    write(&s, Duration::from_secs(2)).await.unwrap();
    assert_eq!(
        ns[0].count("write_batch"),
        1,
        "the known leader is asked first"
    );
    assert_eq!(ns[2].count("write_batch"), 2);
    // A new write gets a new request id.
    assert_ne!(ns[2].calls()[0].request_id, ns[2].calls()[1].request_id);
}

#[tokio::test]
async fn a_write_moves_past_an_unreachable_leader_and_keeps_its_request_id() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    ns[0].script("write_batch", [Answer::unavailable()]);
    // n1 is a follower without a leader yet (an election): it is polled again soon.
    ns[1].script(
        "write_batch",
        [Answer::not_leader(None), Answer::not_leader(None)],
    );
    write(&s, Duration::from_secs(3)).await.unwrap();
    let ids: Vec<String> = ns
        .iter()
        .flat_map(|n| n.calls())
        .map(|c| c.request_id)
        .collect();
    assert!(ids.len() >= 3, "{ids:?}");
    assert!(ids.iter().all(|i| *i == ids[0]), "{ids:?}");
    // n0 failed as unreachable and is avoided for a while: the next write starts at the
    // replica that answered.
    let before = ns[0].count("write_batch");
    write(&s, Duration::from_secs(2)).await.unwrap();
    assert_eq!(ns[0].count("write_batch"), before);
}

#[tokio::test]
async fn a_refused_write_is_not_retried() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    ns[0].script("write_batch", [Answer::rejected()]);
    let e = write(&s, Duration::from_secs(2)).await.unwrap_err();
    assert_eq!(e.to_status_code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(!e.is_retryable());
    let calls: usize = ns.iter().map(|n| n.count("write_batch")).sum();
    assert_eq!(calls, 1);
}

#[tokio::test]
async fn a_write_no_replica_takes_in_time_is_unavailable_with_a_retry_hint() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    for n in &ns {
        n.script("write_batch", (0..100).map(|_| Answer::not_leader(None)));
    }
    let started = Instant::now();
    let e = write(&s, Duration::from_millis(400)).await.unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, CoordError::Unavailable { .. }), "{e:?}");
    assert!(e.retry_after_ms().is_some());
    assert!(
        e.to_string().contains("retrying the same call is safe"),
        "{e}"
    );
    assert!(took >= Duration::from_millis(400), "{took:?}");
    assert!(took < Duration::from_secs(2), "gave up late: {took:?}");
}

#[tokio::test]
async fn an_attempt_is_capped_so_a_hung_leader_leaves_time_for_the_others() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    // n0 hangs past every deadline; the write's own timeout is 8 s, one attempt 3 s. After
    // 1 s without an answer the batch goes again through n1, which names n2 as the leader.
    ns[0].script("write_batch", [Answer::Delay(Duration::from_secs(60))]);
    ns[1].script("write_batch", [Answer::not_leader(Some((3, "n2")))]);
    let started = Instant::now();
    write(&s, Duration::from_secs(8)).await.unwrap();
    let first = &ns[0].calls()[0];
    assert_eq!(first.timeout, Duration::from_secs(3));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(ns[1].count("write_batch"), 1);
    assert_eq!(ns[2].count("write_batch"), 1);
}

#[tokio::test]
async fn reads_fail_over_strong_ones_from_the_leader_on() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    let replicas = placement(3);
    // Eventual: the replica asked first fails, another answers.
    ns[0].script("get_chunks", [Answer::unavailable()]);
    let p = plan(&replicas, Consistency::Eventual, Duration::from_secs(2));
    s.chunks(&p, 0, "n0", vec!["x".into()], false)
        .await
        .unwrap();
    assert_eq!(ns[0].count("get_chunks"), 1);
    assert_eq!(ns[1].count("get_chunks") + ns[2].count("get_chunks"), 1);
    // Strong: asked of the leader first; when it cannot be reached a follower answers (after
    // its own read index with the leader, so not stale: a coordinator cut off from the leader
    // still reads).
    let p = plan(&replicas, Consistency::Strong, Duration::from_secs(2));
    s.chunks(&p, 0, "n0", vec!["x".into()], false)
        .await
        .unwrap();
    assert_eq!(ns[0].count("get_chunks"), 2);
    ns[0].script("get_chunks", [Answer::unavailable()]);
    s.chunks(&p, 0, "n0", vec!["x".into()], false)
        .await
        .unwrap();
    assert_eq!(ns[0].count("get_chunks"), 3);
    assert_eq!(ns[1].count("get_chunks") + ns[2].count("get_chunks"), 2);
    // When no replica answers, the error is the shard's.
    for n in &ns {
        n.script("get_chunks", [Answer::unavailable()]);
    }
    let e = s
        .chunks(&p, 0, "n0", vec!["x".into()], false)
        .await
        .unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
}

#[tokio::test]
async fn a_slow_replica_gets_half_the_time_left_then_the_read_moves_on() {
    let (conn, ns) = ScriptedConnector::with_nodes(2);
    let s = Shards::new(conn);
    let replicas = placement(2);
    ns[0].script("vector_search", [Answer::Delay(Duration::from_secs(30))]);
    let p = plan(&replicas, Consistency::Eventual, Duration::from_secs(1));
    let started = Instant::now();
    s.vector(&p, 0, "n0", VectorSearchRequest::default())
        .await
        .unwrap();
    let budget = ns[0].calls()[0].timeout;
    assert!(
        budget <= Duration::from_millis(500) && budget > Duration::from_millis(300),
        "{budget:?}"
    );
    assert!(started.elapsed() < Duration::from_millis(900));
    assert_eq!(ns[1].count("vector_search"), 1);
    // The slow replica is passed over by the next read's routing.
    let target = s
        .routing()
        .read_target("c", 0, &nodes(2), Consistency::Eventual);
    assert_eq!(target, "n1");
}

#[tokio::test]
async fn a_callers_tiny_deadline_does_not_steer_others_away_from_a_replica() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    let replicas = placement(2);
    // A client with a 1 ms deadline: neither replica answers in time, the read fails...
    for n in &ns {
        n.script("vector_search", [Answer::Delay(Duration::from_millis(50))]);
    }
    let p = plan(&replicas, Consistency::Eventual, Duration::from_millis(1));
    let e = s
        .vector(&p, 0, "n0", VectorSearchRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.to_status_code(), tonic::Code::DeadlineExceeded, "{e:?}");
    // ...and says nothing of the replicas: the next read still starts on n0.
    let target = s
        .routing()
        .read_target("c", 0, &nodes(2), Consistency::Eventual);
    assert_eq!(target, "n0");
    // Nor of the leader: a write cut off by its caller's deadline leaves the leader in place.
    ns[0].script("write_batch", [Answer::Delay(Duration::from_millis(50))]);
    write(&s, Duration::from_millis(1)).await.unwrap_err();
    assert_eq!(s.routing().leader("c", 0, &nodes(3)), "n0");
    write(&s, Duration::from_secs(2)).await.unwrap();
    assert_eq!(ns[0].count("write_batch"), 2);
    assert_eq!(ns[1].count("write_batch") + ns[2].count("write_batch"), 0);
    // Nor is a replica whose group is electing ("no leader" to a strong read's read index):
    // the read moves on, the replica is not avoided.
    ns[0].script("get_chunks", [Answer::not_leader(None)]);
    let p = plan(&replicas, Consistency::Strong, Duration::from_secs(2));
    s.chunks(&p, 0, "n0", vec!["x".into()], false)
        .await
        .unwrap();
    assert_eq!(s.routing().failover(&nodes(2), &[]), Some("n0".to_owned()));
}

#[tokio::test]
async fn a_hung_leader_is_hedged_through_a_follower_only_when_time_allows() {
    // Two seconds to spare: after the hedge delay the batch also goes through n1, which
    // answers; the same request id on both, and n0 is passed over from then on.
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    ns[0].script("write_batch", [Answer::Delay(Duration::from_secs(5))]);
    let started = Instant::now();
    write(&s, Duration::from_secs(2)).await.unwrap();
    assert!(started.elapsed() < Duration::from_millis(1900));
    assert_eq!(ns[1].count("write_batch"), 1);
    assert_eq!(ns[0].calls()[0].request_id, ns[1].calls()[0].request_id);
    assert!(ns[1].calls()[0].timeout <= Duration::from_secs(1));
    // Less time than the hedge delay: no second call that could only outrun the deadline.
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    ns[0].script("write_batch", [Answer::Delay(Duration::from_secs(5))]);
    write(&s, Duration::from_millis(300)).await.unwrap_err();
    assert_eq!(ns[1].count("write_batch") + ns[2].count("write_batch"), 0);
}

#[tokio::test]
async fn a_read_no_replica_serves_names_the_shard() {
    let (conn, ns) = ScriptedConnector::with_nodes(2);
    let s = Shards::new(conn);
    let replicas = placement(2);
    for n in &ns {
        n.script("bm25_search", [Answer::unavailable()]);
    }
    let p = plan(&replicas, Consistency::Eventual, Duration::from_secs(1));
    let e = s
        .bm25(&p, 0, "n0", Bm25SearchRequest::default())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("shard 0 of c"), "{e}");
    assert!(
        !e.to_string().contains("n0") && !e.to_string().contains("n1"),
        "{e}"
    );
}

#[tokio::test]
async fn the_leader_is_found_after_an_election_and_remembered() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    // Nobody leads at first; n1 wins term 2 while the coordinator polls.
    let n1 = ns[1].clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(250)).await;
        n1.set_view(RaftRole::Leader, 2);
    });
    let (leader, view) = s.leader(&sref(), &nodes(3)).await.unwrap();
    assert_eq!(leader, "n1");
    assert_eq!(view.term, 2);
    assert_eq!(s.routing().leader("c", 0, &nodes(3)), "n1");
    // Two claim to lead (a deposed leader has not heard yet): the higher term wins.
    ns[2].set_view(RaftRole::Leader, 3);
    let (leader, _) = s.leader(&sref(), &nodes(3)).await.unwrap();
    assert_eq!(leader, "n2");
}

#[tokio::test]
async fn a_membership_change_retries_a_retryable_failure_and_stops_at_a_refusal() {
    let (conn, ns) = ScriptedConnector::with_nodes(3);
    let s = Shards::new(conn);
    ns[0].set_view(RaftRole::Leader, 1);
    ns[0].script(
        "change_replicas",
        [Answer::unavailable(), Answer::not_leader(None)],
    );
    let peer = Peer {
        node_id: 4,
        address: "n3".into(),
    };
    s.change_replicas(&sref(), &nodes(3), ReplicaChange::AddLearner, peer.clone())
        .await
        .unwrap();
    assert_eq!(ns[0].count("change_replicas"), 3);
    ns[0].script("change_replicas", [Answer::rejected()]);
    let e = s
        .change_replicas(&sref(), &nodes(3), ReplicaChange::AddLearner, peer)
        .await
        .unwrap_err();
    assert!(!e.is_retryable(), "{e:?}");
    assert_eq!(ns[0].count("change_replicas"), 4);
}

#[tokio::test]
async fn node_ids_are_asked_once_and_probes_ask_again() {
    let (conn, ns) = ScriptedConnector::with_nodes(2);
    let s = Shards::new(conn);
    assert_eq!(s.node_id("n1").await.unwrap(), 2);
    assert_eq!(s.node_id("n1").await.unwrap(), 2);
    assert_eq!(ns[1].count("node_info"), 1);
    assert_eq!(s.probe("n1", Duration::from_secs(1)).await.unwrap(), 2);
    assert_eq!(ns[1].count("node_info"), 2);
    // An address no node answers at is an error naming the node, not a panic.
    let e = s.node_id("gone").await.unwrap_err();
    assert!(e.to_string().contains("gone"), "{e}");
}
