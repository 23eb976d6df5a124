//! Member state transitions on a one-coordinator catalog (a real Raft group on RocksDB in a
//! temporary directory) with scripted shard nodes answering the probes: registration UP or
//! JOINING, DOWN after `down_after` of silence, UP again, a node answering under another id,
//! drain, removal refused while replicas remain, and a removed node kept out.

use std::time::Duration;

use ragcluster_proto::v1::*;

use crate::shards::scripted::{Answer, ScriptedNode};
use crate::testing::{DOWN_AFTER, Fixture, INTERVAL, fixture};

fn beat(n: &ScriptedNode) -> HeartbeatRequest {
    HeartbeatRequest {
        node_id: n.id,
        kind: NodeKind::ShardNode as i32,
        address: n.address.clone(),
        ..Default::default()
    }
}

fn state(f: &Fixture, id: u64) -> MemberState {
    f.catalog.member(id).expect("registered").state()
}

#[tokio::test]
async fn a_heartbeat_registers_a_reachable_node_up_and_an_unreachable_one_joining() {
    let f = fixture(2).await;
    let r = f.membership.heartbeat(beat(&f.nodes[0])).await.unwrap();
    assert_eq!(state(&f, 11), MemberState::Up);
    assert_eq!(r.interval_ms, INTERVAL.as_millis() as u32);
    assert_eq!(r.member.unwrap().node_id, 11);
    // Its advertised address does not answer yet: JOINING, and UP once a probe gets through.
    f.nodes[1].script("node_info", [Answer::unavailable()]);
    f.membership.heartbeat(beat(&f.nodes[1])).await.unwrap();
    assert_eq!(state(&f, 12), MemberState::Joining);
    f.membership.check_liveness().await;
    assert_eq!(state(&f, 12), MemberState::Up);
    assert_eq!(
        f.membership.placeable().await,
        vec![
            (11, f.nodes[0].address.clone()),
            (12, f.nodes[1].address.clone())
        ]
    );
}

#[tokio::test]
async fn a_silent_member_goes_down_after_down_after_and_up_when_it_answers_again() {
    let f = fixture(1).await;
    f.membership.heartbeat(beat(&f.nodes[0])).await.unwrap();
    // Silent, and its probes fail: still UP before `down_after`...
    f.nodes[0].script("node_info", (0..100).map(|_| Answer::unavailable()));
    tokio::time::sleep(INTERVAL * 3).await;
    f.membership.check_liveness().await;
    assert_eq!(state(&f, 11), MemberState::Up);
    // ...DOWN after it, and no longer placeable.
    tokio::time::sleep(DOWN_AFTER).await;
    f.membership.check_liveness().await;
    assert_eq!(state(&f, 11), MemberState::Down);
    assert!(f.membership.placeable().await.is_empty());
    // It answers again: UP.
    f.nodes[0].clear("node_info");
    f.membership.check_liveness().await;
    assert_eq!(state(&f, 11), MemberState::Up);
}

#[tokio::test]
async fn a_node_answering_under_another_id_is_not_taken_for_the_member() {
    let f = fixture(1).await;
    // Node 99 claims the address where node 11 answers.
    let mut req = beat(&f.nodes[0]);
    req.node_id = 99;
    f.membership.heartbeat(req).await.unwrap();
    assert_eq!(state(&f, 99), MemberState::Joining);
    let e = f
        .membership
        .probe_at(NodeKind::ShardNode, 99, &f.nodes[0].address)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not 99"), "{e}");
}

#[tokio::test]
async fn drain_and_remove_follow_the_rules() {
    let f = fixture(2).await;
    for n in &f.nodes {
        f.membership.heartbeat(beat(n)).await.unwrap();
    }
    f.catalog
        .insert(
            CollectionInfo {
                name: "c".into(),
                shard_count: 1,
                replication_factor: 1,
                shards: vec![ShardPlacement {
                    nodes: vec![f.nodes[0].address.clone()],
                    node_ids: vec![11],
                }],
                ..Default::default()
            },
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    // Draining takes a node out of placement, UP puts it back; other states are refused.
    f.membership
        .set_drain(11, MemberState::Draining)
        .await
        .unwrap();
    assert_eq!(
        f.membership.placeable().await,
        vec![(12, f.nodes[1].address.clone())]
    );
    let e = f
        .membership
        .set_drain(11, MemberState::Down)
        .await
        .unwrap_err();
    assert_eq!(e.to_status_code(), tonic::Code::InvalidArgument);
    // A node that still holds a replica is not removed.
    let e = f.membership.remove(11).await.unwrap_err();
    assert_eq!(e.to_status_code(), tonic::Code::FailedPrecondition);
    assert!(e.to_string().contains("c/0"), "{e}");
    // One that holds none is, and cannot come back under its id.
    assert_eq!(
        f.membership.remove(12).await.unwrap().state(),
        MemberState::Removed
    );
    let e = f.membership.heartbeat(beat(&f.nodes[1])).await.unwrap_err();
    assert_eq!(e.to_status_code(), tonic::Code::FailedPrecondition);
    assert!(f.membership.remove(404).await.is_err());
}

#[tokio::test]
async fn malformed_heartbeats_are_refused_before_anything_is_recorded() {
    let f = fixture(1).await;
    for (field, req) in [
        (
            "node_id",
            HeartbeatRequest {
                node_id: 0,
                ..beat(&f.nodes[0])
            },
        ),
        (
            "kind",
            HeartbeatRequest {
                kind: 0,
                ..beat(&f.nodes[0])
            },
        ),
        (
            "address",
            HeartbeatRequest {
                address: "127.0.0.1:1".into(),
                ..beat(&f.nodes[0])
            },
        ),
        (
            "models",
            HeartbeatRequest {
                models: vec![String::new()],
                ..beat(&f.nodes[0])
            },
        ),
    ] {
        let e = f.membership.heartbeat(req).await.unwrap_err();
        assert_eq!(e.to_status_code(), tonic::Code::InvalidArgument, "{field}");
        assert!(e.to_string().contains(field), "{field}: {e}");
    }
    assert!(f.catalog.members().is_empty());
}
