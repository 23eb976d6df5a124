//! Flow execution against scripted shard nodes (`shards::scripted`) holding a few chunks, on a
//! one-coordinator catalog, with no model worker: cross-shard retrieval, prev-next
//! augmentation, keyword and form routing, branches fused by RRF, loops under the request's cap, an
//! LLM step failing cleanly after retrieval, a failing replica passed over, and a shard that
//! does not answer ending the Ask at its deadline with the partial trace.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ragcluster_proto::v1::*;

use super::run::Services;
use super::spec::FlowSet;
use super::*;
use crate::chunking::WordTokens;
use crate::search::Searcher;
use crate::shards::scripted::Answer;
use crate::testing::{Fixture, fixture};

const FLOWS: &str = r#"
default = "retrieve"

[flows.retrieve]
description = "bm25 only"
steps = [{ op = "bm25", top_k = 3 }]

[flows.neighbours]
description = "the best chunk and its neighbours"
steps = [{ op = "bm25", top_k = 1 }, { op = "prev_next", before = 1, after = 1 }]

[flows.routed]
description = "keyword routing"
steps = [{ op = "route", method = "keyword", default = "wide", routes = [
  { flow = "narrow", keywords = ["tantivy", "bm25"] },
] }]

[flows.by_form]
description = "routing by the question's form"
steps = [{ op = "route", method = "form", routes = [
  { flow = "narrow", form = "yes_no" },
  { flow = "wide", form = "other" },
] }]

[flows.narrow]
description = "one chunk"
steps = [{ op = "bm25", top_k = 1 }]

[flows.wide]
description = "four chunks"
steps = [{ op = "bm25", top_k = 4 }]

[flows.branched]
description = "one branch per chunk, fused by RRF"
steps = [
  { op = "bm25", top_k = 2 },
  { op = "branch", over = "chunks", max_branches = 2, steps = [{ op = "prev_next", before = 1, after = 1 }] },
  { op = "fuse", method = "rrf" },
]

[flows.looped]
description = "a loop without a judge"
steps = [{ op = "loop", max_iterations = 3, steps = [{ op = "bm25", top_k = 1 }] }]

[flows.answered]
description = "retrieval then generation"
steps = [
  { op = "bm25", top_k = 2 },
  { op = "prompt" },
  { op = "generate", max_tokens = 16 },
]
"#;

/// Chunks of one document, numbered from 0 and linked to their neighbours.
fn doc(id: &str, texts: &[&str]) -> Vec<Chunk> {
    let cid = |i: usize| format!("{id}#{i}");
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| Chunk {
            chunk_id: cid(i),
            doc_id: id.into(),
            position: i as u32,
            prev_chunk_id: if i == 0 { String::new() } else { cid(i - 1) },
            next_chunk_id: if i + 1 == texts.len() {
                String::new()
            } else {
                cid(i + 1)
            },
            title: id.into(),
            text: (*t).into(),
            ..Default::default()
        })
        .collect()
}

/// Collection `docs` of two shards: shard 0 on the first scripted node holds `raft`; shard 1,
/// replicated on the other two, holds `bm25` and `forest`.
async fn setup() -> (Fixture, Arc<Engine>) {
    let f = fixture(3).await;
    f.nodes[0].hold(doc(
        "raft",
        &[
            "Raft elects a leader with randomized election timeouts.",
            "The leader replicates log entries to the followers.",
            "A term number orders the leaders.",
        ],
    ));
    for n in &f.nodes[1..] {
        n.hold(doc(
            "bm25",
            &[
                "BM25 ranks text by term frequency and inverse document frequency.",
                "Tantivy scores with BM25 using k1 and b.",
            ],
        ));
        n.hold(doc(
            "forest",
            &["A forest ecosystem holds trees and animals."],
        ));
    }
    f.catalog
        .insert(
            CollectionInfo {
                name: "docs".into(),
                shard_count: 2,
                replication_factor: 1,
                dimension: 4,
                shards: vec![
                    ShardPlacement {
                        nodes: vec![f.nodes[0].address.clone()],
                        node_ids: vec![f.nodes[0].id],
                    },
                    ShardPlacement {
                        nodes: f.nodes[1..].iter().map(|n| n.address.clone()).collect(),
                        node_ids: f.nodes[1..].iter().map(|n| n.id).collect(),
                    },
                ],
                ..Default::default()
            },
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let engine = Engine {
        flows: Flows {
            set: Arc::new(FlowSet::parse(FLOWS).unwrap()),
            intents: Default::default(),
        },
        catalog: f.catalog.clone(),
        services: Arc::new(Services {
            searcher: Arc::new(Searcher::new(
                f.catalog.clone(),
                f.shards.clone(),
                f.models.clone(),
            )),
            shards: f.shards.clone(),
            models: f.models.clone(),
            tokens: Arc::new(WordTokens),
        }),
        opts: AskOptions {
            timeout: Duration::from_secs(5),
            max_generated_tokens: 256,
            max_branches: 4,
            max_iterations: 4,
        },
    };
    (f, Arc::new(engine))
}

fn request(flow: &str, question: &str) -> AskRequest {
    AskRequest {
        collection: "docs".into(),
        question: question.into(),
        flow: flow.into(),
        ..Default::default()
    }
}

/// Runs an Ask to its end: the result and the status that followed it, if any.
async fn ask(e: &Arc<Engine>, r: AskRequest) -> (AskResult, Option<tonic::Status>) {
    let mut rx = e.ask(r).await.unwrap();
    let mut result = None;
    let mut status = None;
    while let Some(m) = rx.recv().await {
        match m {
            Ok(AskResponse {
                event: Some(ask_response::Event::Result(r)),
            }) => result = Some(r),
            Ok(_) => {}
            Err(s) => status = Some(s),
        }
    }
    (result.expect("an Ask always ends with its result"), status)
}

fn ids(r: &AskResult) -> Vec<&str> {
    r.contexts.iter().map(|c| c.chunk_id.as_str()).collect()
}

fn step<'a>(r: &'a AskResult, op: &str) -> &'a TraceStep {
    r.trace
        .iter()
        .find(|s| s.op == op)
        .unwrap_or_else(|| panic!("no {op} step in {:?}", r.trace))
}

#[tokio::test]
async fn retrieval_merges_both_shards_by_score() {
    let (_f, e) = setup().await;
    let (r, status) = ask(&e, request("retrieve", "raft leader tantivy")).await;
    assert!(status.is_none(), "{status:?}");
    assert_eq!((r.status.as_str(), r.flow.as_str()), ("ok", "retrieve"));
    // raft#0 holds two of the words; bm25#1 and raft#1 one each (ties by id).
    assert_eq!(ids(&r), ["raft#0", "bm25#1", "raft#1"]);
    assert_eq!(r.contexts[0].score, 2.0);
    assert_eq!(
        r.contexts[0].text,
        "Raft elects a leader with randomized election timeouts."
    );
    assert!(r.answer.is_empty());
    assert_eq!(r.trace.len(), 1);
    assert!(step(&r, "bm25").error.is_empty());
}

#[tokio::test]
async fn prev_next_adds_the_neighbours_in_document_order() {
    let (f, e) = setup().await;
    let (r, _) = ask(&e, request("neighbours", "replicates log entries")).await;
    assert_eq!(ids(&r), ["raft#0", "raft#1", "raft#2"]);
    // Neighbours carry the anchor's score.
    assert!(
        r.contexts.iter().all(|c| c.score == 3.0),
        "{:?}",
        r.contexts
    );
    assert_eq!(f.nodes[0].count("get_neighbours"), 1);
    // At the end of its document a chunk has only a previous neighbour.
    let (r, _) = ask(&e, request("neighbours", "term number")).await;
    assert_eq!(ids(&r), ["raft#1", "raft#2"]);
}

#[tokio::test]
async fn keyword_routing_picks_the_flow_and_says_why() {
    let (_f, e) = setup().await;
    let (r, _) = ask(
        &e,
        request("routed", "what does tantivy use to compute scores"),
    )
    .await;
    assert_eq!(r.status, "ok");
    let route = step(&r, "route");
    assert!(
        route.decision.starts_with("-> narrow"),
        "{}",
        route.decision
    );
    assert_eq!(ids(&r), ["bm25#1"]);
    // The routed flow's steps are traced under the route's path.
    assert!(
        r.trace
            .iter()
            .any(|s| s.op == "bm25" && s.path.contains("narrow"))
    );
    // No keyword matches: the default flow.
    let (r, _) = ask(&e, request("routed", "forest leader")).await;
    assert!(step(&r, "route").decision.starts_with("-> wide"));
    assert_eq!(ids(&r), ["forest#0", "raft#0", "raft#1"]);
}

#[tokio::test]
async fn form_routing_sends_yes_no_questions_their_own_way() {
    let (_f, e) = setup().await;
    let (r, _) = ask(
        &e,
        request("by_form", "Does the raft leader replicate entries?"),
    )
    .await;
    assert_eq!(r.status, "ok", "{}", r.error);
    assert_eq!(step(&r, "route").decision, "-> narrow (form YesNo)");
    assert_eq!(ids(&r).len(), 1);
    let (r, _) = ask(
        &e,
        request("by_form", "How does the raft leader replicate entries?"),
    )
    .await;
    assert_eq!(step(&r, "route").decision, "-> wide (form Other)");
    assert!(ids(&r).len() > 1, "{:?}", ids(&r));
}

#[tokio::test]
async fn branches_over_chunks_are_fused_by_rrf() {
    let (_f, e) = setup().await;
    let (r, _) = ask(&e, request("branched", "raft leader tantivy")).await;
    assert_eq!(r.status, "ok", "{}", r.error);
    assert_eq!(step(&r, "branch").branches, 2);
    assert_eq!(step(&r, "fuse").decision, "rrf over 2 lists -> 4 chunks");
    // Each branch's list is its chunk with its neighbours: [raft#0, raft#1] and
    // [bm25#0, bm25#1]; RRF (k = 60) gives each list's first 1/61 and second 1/62.
    assert_eq!(ids(&r), ["bm25#0", "raft#0", "bm25#1", "raft#1"]);
    for (c, want) in r.contexts.iter().zip([61.0, 61.0, 62.0, 62.0]) {
        assert!((c.score - 1.0 / want).abs() < 1e-7, "{c:?}");
    }
    // Both branches' steps are traced, each under its own path.
    let paths: Vec<&str> = r
        .trace
        .iter()
        .filter(|s| s.op == "prev_next")
        .map(|s| s.path.as_str())
        .collect();
    assert_eq!(paths.len(), 2, "{paths:?}");
    assert_ne!(paths[0], paths[1]);
}

#[tokio::test]
async fn a_loop_without_a_judge_runs_to_the_requests_cap() {
    let (f, e) = setup().await;
    let (r, _) = ask(&e, request("looped", "leader")).await;
    let l = step(&r, "loop");
    assert_eq!(
        (l.iteration, l.decision.as_str()),
        (3, "max_iterations 3 reached")
    );
    assert_eq!(f.nodes[0].count("bm25_search"), 3);
    // A request lowers the configured cap; it cannot raise it.
    let (r, _) = ask(
        &e,
        AskRequest {
            max_iterations: 2,
            ..request("looped", "leader")
        },
    )
    .await;
    assert_eq!(step(&r, "loop").iteration, 2);
    let refused = e
        .ask(AskRequest {
            max_iterations: 5,
            ..request("looped", "leader")
        })
        .await
        .expect_err("a cap above the configured one is refused");
    assert!(refused.to_string().contains("max_iterations"), "{refused}");
}

#[tokio::test]
async fn generation_without_a_model_worker_fails_cleanly_after_retrieval() {
    let (_f, e) = setup().await;
    let (r, status) = ask(&e, request("answered", "raft leader")).await;
    let status = status.expect("the result is followed by the error status");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert_eq!(r.status, "unavailable");
    assert!(r.error.contains("model worker"), "{}", r.error);
    // What was retrieved is still there: the contexts and the retrieval step.
    assert_eq!(ids(&r), ["raft#0", "raft#1"]);
    assert!(step(&r, "bm25").error.is_empty());
    assert!(!step(&r, "generate").error.is_empty());
    assert!(r.answer.is_empty());
}

#[tokio::test]
async fn a_failing_replica_is_passed_over_inside_the_flow() {
    let (f, e) = setup().await;
    // The second replica of shard 1 was slow a moment ago (so the first is asked first), and
    // the first fails now: the search moves on to the second.
    f.shards.routing().mark_down(&f.nodes[2].address);
    f.nodes[1].script("bm25_search", [Answer::unavailable()]);
    let (r, status) = ask(&e, request("retrieve", "raft leader tantivy")).await;
    assert!(status.is_none(), "{status:?}");
    assert_eq!(ids(&r), ["raft#0", "bm25#1", "raft#1"]);
    assert_eq!(f.nodes[1].count("bm25_search"), 1);
    assert_eq!(f.nodes[2].count("bm25_search"), 1);
}

#[tokio::test]
async fn a_shard_that_does_not_answer_ends_the_ask_at_its_deadline() {
    let (f, e) = setup().await;
    for n in &f.nodes[1..] {
        n.script("bm25_search", [Answer::Delay(Duration::from_secs(30))]);
    }
    let started = Instant::now();
    let (r, status) = ask(
        &e,
        AskRequest {
            timeout_ms: 300,
            ..request("answered", "raft leader")
        },
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let status = status.expect("the result is followed by the error status");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert_eq!(r.status, "deadline_exceeded");
    // The partial trace: the retrieval that ran out of time, nothing after it.
    assert!(r.trace.iter().all(|s| s.op == "bm25"), "{:?}", r.trace);
    assert!(r.contexts.is_empty());
}
