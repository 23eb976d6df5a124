//! Replica moves against a scripted Raft group (`shards::scripted::ScriptedGroup`) on a
//! one-coordinator catalog: every step in order, leadership leaving the source, the newcomer
//! taking the source's place in the placement, a move interrupted after a step resuming
//! there, and moves that make no sense refused before any step.

use std::sync::Arc;

use ragcluster_proto::v1::*;
use tokio::sync::mpsc;

use super::*;
use crate::shards::scripted::{Answer, ScriptedGroup};
use crate::testing::{Fixture, fixture};

/// Four registered shard nodes (ids 11-14); collection `c` has one shard on the first three,
/// led by 11; the fourth can open a replica of it.
async fn setup() -> (Fixture, Arc<ScriptedGroup>, Rebalancer) {
    let f = fixture(4).await;
    for n in &f.nodes {
        f.membership
            .heartbeat(HeartbeatRequest {
                node_id: n.id,
                kind: NodeKind::ShardNode as i32,
                address: n.address.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let group = ScriptedGroup::new(&[&f.nodes[0], &f.nodes[1], &f.nodes[2]], 42);
    group.attach(&f.nodes[3]);
    f.catalog
        .insert(
            CollectionInfo {
                name: "c".into(),
                shard_count: 1,
                replication_factor: 3,
                dimension: 4,
                shards: vec![ShardPlacement {
                    nodes: f.nodes[..3].iter().map(|n| n.address.clone()).collect(),
                    node_ids: vec![11, 12, 13],
                }],
                ..Default::default()
            },
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let r = Rebalancer::new(f.catalog.clone(), f.shards.clone(), f.membership.clone());
    (f, group, r)
}

/// Runs a move; its outcome and the steps it reported (repeated steps once).
async fn run(r: &Rebalancer, from: &str, to: &str) -> (Result<()>, Vec<String>) {
    let (tx, mut rx) = mpsc::channel(256);
    let res = r.move_replica("c", 0, from, to, &tx).await;
    drop(tx);
    let mut steps: Vec<String> = Vec::new();
    while let Some(Ok(p)) = rx.recv().await {
        if steps.last() != Some(&p.step) {
            steps.push(p.step);
        }
    }
    (res, steps)
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

#[tokio::test]
async fn moving_the_leaders_replica_runs_every_step_in_order() {
    let (f, g, r) = setup().await;
    let (res, steps) = run(&r, &f.nodes[0].address, "14").await;
    res.unwrap();
    assert_eq!(
        steps,
        [
            "learner-added",
            "catching-up",
            "promoted",
            "leader-moved",
            "removed",
            "placed",
            "done"
        ]
    );
    assert_eq!(sorted(g.voters()), [12, 13, 14]);
    assert!(g.learners().is_empty());
    // Leadership went to another old replica, not to the newcomer.
    assert_eq!(g.leader(), 12);
    // The newcomer takes the source's place, so the preferred-leader order is kept.
    let p = &f.catalog.get("c").unwrap().shards[0];
    assert_eq!(p.node_ids, [14, 12, 13]);
    assert_eq!(p.nodes[0], f.nodes[3].address);
    assert_eq!(f.nodes[3].count("open_shard"), 1);
    assert_eq!(f.nodes[0].count("drop_shard"), 1);
    // Asked again, it is done already.
    let (res, steps) = run(&r, &f.nodes[0].address, "14").await;
    res.unwrap();
    assert_eq!(steps, ["done"]);
}

#[tokio::test]
async fn a_follower_moves_without_touching_leadership() {
    let (f, g, r) = setup().await;
    let (res, steps) = run(&r, "13", "14").await;
    res.unwrap();
    assert!(!steps.contains(&"leader-moved".to_owned()), "{steps:?}");
    assert_eq!(g.leader(), 11);
    assert_eq!(sorted(g.voters()), [11, 12, 14]);
    assert_eq!(f.catalog.get("c").unwrap().shards[0].node_ids, [11, 12, 14]);
    assert_eq!(f.nodes[0].count("transfer_leader"), 0);
}

#[tokio::test]
async fn an_interrupted_move_resumes_where_it_stopped() {
    let (f, g, r) = setup().await;
    // The learner joins, then the promotion is refused: the move stops there.
    f.nodes[0].script("change_replicas", [Answer::Ok, Answer::rejected()]);
    let (res, steps) = run(&r, "12", "14").await;
    assert!(res.is_err());
    assert_eq!(steps, ["learner-added", "catching-up"]);
    assert_eq!(g.learners(), [14]);
    assert_eq!(f.catalog.get("c").unwrap().shards[0].node_ids, [11, 12, 13]);
    // Again: no second replica opened, no second learner added; promoted and finished.
    let (res, steps) = run(&r, "12", "14").await;
    res.unwrap();
    assert_eq!(steps[0], "catching-up", "{steps:?}");
    assert_eq!(f.nodes[3].count("open_shard"), 1);
    assert_eq!(sorted(g.voters()), [11, 13, 14]);
    assert_eq!(f.catalog.get("c").unwrap().shards[0].node_ids, [11, 14, 13]);
}

#[tokio::test]
async fn moves_that_make_no_sense_are_refused_before_any_step() {
    let (f, g, r) = setup().await;
    for (from, to, field) in [
        ("11", "11", "to"),
        ("11", "12", "to"),
        ("99", "14", "from"),
        ("11", "http://127.0.0.1:9", "to"),
    ] {
        let (res, steps) = run(&r, from, to).await;
        let e = res.unwrap_err();
        assert_eq!(
            e.to_status_code(),
            tonic::Code::InvalidArgument,
            "{from} {to}"
        );
        assert!(e.to_string().contains(field), "{from} {to}: {e}");
        assert!(steps.is_empty(), "{steps:?}");
    }
    let (tx, _rx) = mpsc::channel(8);
    let e = r.move_replica("c", 5, "11", "14", &tx).await.unwrap_err();
    assert!(e.to_string().contains("shard"), "{e}");
    let e = r
        .move_replica("nope", 0, "11", "14", &tx)
        .await
        .unwrap_err();
    assert_eq!(e.to_status_code(), tonic::Code::NotFound);
    let changes: usize = f.nodes.iter().map(|n| n.count("change_replicas")).sum();
    assert_eq!(changes, 0);
    assert_eq!(sorted(g.voters()), [11, 12, 13]);
}
