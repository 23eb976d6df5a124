//! `Coordinator.Ask` end to end: a local cluster (2 shard nodes, a coordinator, a model
//! worker with MiniLM embeddings, MiniLM MaxSim reranking and SmolLM2 generation) answers
//! questions over docs/sample with every shipped flow pattern. Greedy decoding keeps answers
//! deterministic; the assertions are on the trace (operators run, branch counts, loop
//! bounds, routing decisions), on citations pointing at contexts that were retrieved, and on
//! streaming. Then bad input, the deadline with a partial trace, the token budget, and a
//! model worker outage (LLM flows UNAVAILABLE, retrieval-only flows still answer).

use std::collections::HashSet;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, ingest_sample};
use tonic::Code;
use tonic::transport::Channel;

struct Answer {
    result: AskResult,
    streamed: String,
    restarts: usize,
}

async fn ask(
    c: &mut CoordinatorClient<Channel>,
    r: AskRequest,
) -> std::result::Result<Answer, (tonic::Status, Option<AskResult>)> {
    let mut s = c.ask(r).await.map_err(|e| (e, None))?.into_inner();
    let mut streamed = String::new();
    let mut restarts = 0;
    let mut result = None;
    while let Some(m) = s.next().await {
        match m {
            Err(e) => return Err((e, result)),
            Ok(m) => match m.event {
                Some(ask_response::Event::Token(t)) => {
                    if t.restart {
                        restarts += 1;
                        streamed.clear();
                    }
                    streamed.push_str(&t.text);
                }
                Some(ask_response::Event::Result(r)) => result = Some(r),
                None => {}
            },
        }
    }
    let result = result.ok_or_else(|| (tonic::Status::internal("no result message"), None))?;
    Ok(Answer {
        result,
        streamed,
        restarts,
    })
}

fn req(question: &str, flow: &str) -> AskRequest {
    AskRequest {
        collection: "docs".into(),
        question: question.into(),
        flow: flow.into(),
        ..Default::default()
    }
}

fn ops(r: &AskResult) -> Vec<String> {
    r.trace.iter().map(|t| t.op.clone()).collect()
}

fn top_ops(r: &AskResult) -> Vec<String> {
    r.trace
        .iter()
        .filter(|t| !t.path.contains('/'))
        .map(|t| t.op.clone())
        .collect()
}

fn step<'a>(r: &'a AskResult, op: &str) -> Result<&'a TraceStep> {
    r.trace
        .iter()
        .find(|t| t.op == op)
        .with_context(|| format!("no {op} step in {:?}", ops(r)))
}

/// Every citation names a context that was given, and every context is a stored chunk.
fn check_citations(r: &AskResult, chunk_ids: &HashSet<String>) -> Result<()> {
    let given: HashSet<&str> = r.contexts.iter().map(|c| c.chunk_id.as_str()).collect();
    for c in &r.citations {
        ensure!(
            given.contains(c.chunk_id.as_str()),
            "citation {c:?} is not a context"
        );
        let ctx = &r.contexts[c.number as usize - 1];
        ensure!(
            ctx.chunk_id == c.chunk_id,
            "citation number {} names {}",
            c.number,
            c.chunk_id
        );
        ensure!(
            ctx.text.contains(&c.span),
            "span {:?} not in chunk {}",
            c.span,
            c.chunk_id
        );
    }
    for c in &r.contexts {
        ensure!(
            chunk_ids.contains(&c.chunk_id) || c.chunk_id.contains('#'),
            "context {} was never stored",
            c.chunk_id
        );
    }
    Ok(())
}

fn report(name: &str, a: &Answer, t: Instant) {
    println!(
        "[{name}] {:.1}s, {} tokens, {} citations ({} dropped): {:?}",
        t.elapsed().as_secs_f64(),
        a.result.generated_tokens,
        a.result.citations.len(),
        a.result.dropped_citations,
        a.result.answer
    );
    for s in &a.result.trace {
        println!(
            "    {:<14} {:<12} {:>7.1} ms  br {} it {}  {}  {}",
            s.path,
            s.op,
            s.took_us as f64 / 1e3,
            s.branches,
            s.iteration,
            s.decision,
            s.output
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_flows_end_to_end() -> Result<()> {
    let mut cluster = Cluster::start_for_ask(2)?;
    let mut c = cluster.client().await?;
    let up = ingest_sample(&mut c, "docs", 2).await?;
    println!("ingested {} documents, {} chunks", up.documents, up.chunks);
    let all = c
        .search(SearchRequest {
            collection: "docs".into(),
            query: "the".into(),
            top_k: 1000,
            mode: SearchMode::Bm25 as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    let chunk_ids: HashSet<String> = all.hits.iter().map(|h| h.chunk_id.clone()).collect();

    // Linear: rewrite -> hybrid -> rerank -> reorder -> prompt -> generate, streamed.
    let t = Instant::now();
    let q = "How does Raft elect a leader?";
    let a = ask(&mut c, req(q, "linear")).await.map_err(|e| e.0)?;
    report("linear", &a, t);
    ensure!(
        ops(&a.result)
            == [
                "rewrite", "hybrid", "rerank", "reorder", "prompt", "generate"
            ],
        "{:?}",
        ops(&a.result)
    );
    ensure!(a.result.status == "ok" && a.result.flow == "linear");
    ensure!(!a.result.answer.is_empty());
    ensure!(
        a.streamed.trim() == a.result.answer,
        "streamed {:?} vs answer {:?}",
        a.streamed,
        a.result.answer
    );
    ensure!(a.result.contexts.len() == 3, "rerank keeps 3");
    ensure!(
        a.result
            .contexts
            .iter()
            .any(|c| c.doc_id == "raft-consensus.md"),
        "raft chunk retrieved"
    );
    check_citations(&a.result, &chunk_ids)?;
    let again = ask(&mut c, req(q, "linear")).await.map_err(|e| e.0)?;
    ensure!(
        again.result.answer == a.result.answer,
        "greedy answers differ"
    );

    // Conditional: keyword + intent routing (eq. 19-22) picks one of two flows.
    let t = Instant::now();
    let a = ask(
        &mut c,
        req("What does the k1 parameter of BM25 control?", "conditional"),
    )
    .await
    .map_err(|e| e.0)?;
    report("conditional/lexical", &a, t);
    ensure!(
        step(&a.result, "route")?.decision.starts_with("-> lexical"),
        "{}",
        step(&a.result, "route")?.decision
    );
    ensure!(
        ops(&a.result) == ["bm25", "prompt", "generate", "route"],
        "{:?}",
        ops(&a.result)
    );
    ensure!(
        a.result
            .contexts
            .iter()
            .any(|c| c.doc_id == "bm25-ranking.md")
    );
    check_citations(&a.result, &chunk_ids)?;
    let a = ask(
        &mut c,
        req(
            "Which animals live in rock pools at the seashore?",
            "conditional",
        ),
    )
    .await
    .map_err(|e| e.0)?;
    report("conditional/semantic", &a, Instant::now());
    ensure!(
        step(&a.result, "route")?
            .decision
            .starts_with("-> semantic"),
        "{}",
        step(&a.result, "route")?.decision
    );
    ensure!(ops(&a.result).contains(&"mmr".to_string()));

    // Pre-retrieval branching: query variants retrieved in parallel, merged by RRF.
    let t = Instant::now();
    let a = ask(
        &mut c,
        req("How are vectors searched approximately?", "multi_query"),
    )
    .await
    .map_err(|e| e.0)?;
    report("multi_query", &a, t);
    let br = step(&a.result, "branch")?;
    let n_queries = a.result.trace.iter().filter(|s| s.op == "hybrid").count() as u32;
    ensure!(
        br.branches >= 1 && br.branches <= 3 && br.branches == n_queries,
        "branches {} hybrids {n_queries}",
        br.branches
    );
    ensure!(step(&a.result, "fuse")?.decision.starts_with("rrf over"));
    ensure!(a.result.contexts.len() <= 3);
    check_citations(&a.result, &chunk_ids)?;

    // Post-retrieval branching: one generation per chunk, weighted ensemble (eq. 23-24).
    let t = Instant::now();
    let a = ask(
        &mut c,
        req("What is BM25 length normalisation?", "per_chunk"),
    )
    .await
    .map_err(|e| e.0)?;
    report("per_chunk", &a, t);
    ensure!(step(&a.result, "branch")?.branches == 3);
    ensure!(a.result.trace.iter().filter(|s| s.op == "generate").count() == 3);
    ensure!(step(&a.result, "fuse")?.decision.contains("λ"));
    ensure!(!a.result.answer.is_empty() && a.result.contexts.len() == 1);
    check_citations(&a.result, &chunk_ids)?;

    // Iterative (ITER-RETGEN): at most max_iterations rounds, one generation each.
    let t = Instant::now();
    let a = ask(
        &mut c,
        req("How does HNSW handle deleted vectors?", "iterative"),
    )
    .await
    .map_err(|e| e.0)?;
    report("iterative", &a, t);
    let lp = step(&a.result, "loop")?;
    let gens = a.result.trace.iter().filter(|s| s.op == "generate").count() as u32;
    ensure!(
        (1..=2).contains(&lp.iteration) && gens == lp.iteration,
        "iterations {} generations {gens}",
        lp.iteration
    );
    ensure!(
        a.restarts as u32 == lp.iteration - 1,
        "a new round's tokens restart the stream"
    );
    check_citations(&a.result, &chunk_ids)?;

    // Recursive: follow-up questions to depth <= 2, synthesised by the generator.
    let t = Instant::now();
    let a = ask(&mut c, req("How is a sourdough loaf made?", "recursive"))
        .await
        .map_err(|e| e.0)?;
    report("recursive", &a, t);
    let rec = step(&a.result, "recurse")?;
    ensure!((1..=2).contains(&rec.iteration), "depth {}", rec.iteration);
    ensure!(
        rec.branches as usize
            == a.result
                .trace
                .iter()
                .filter(|s| s.op == "generate" && s.path.contains('^'))
                .count()
    );
    ensure!(rec.branches <= 1 + 2, "depth 2 with at most 2 follow-ups");
    ensure!(top_ops(&a.result) == ["recurse", "fuse"]);
    ensure!(!a.result.answer.is_empty());
    check_citations(&a.result, &chunk_ids)?;

    // Active (FLARE): sentences generated one at a time, low-confidence ones re-retrieved.
    let t = Instant::now();
    let a = ask(&mut c, req("What lives in tide pools?", "active"))
        .await
        .map_err(|e| e.0)?;
    report("active", &a, t);
    let act = step(&a.result, "active")?;
    ensure!(
        (1..=3).contains(&act.iteration),
        "sentences {}",
        act.iteration
    );
    let retrievals = a.result.trace.iter().filter(|s| s.op == "hybrid").count();
    ensure!(
        retrievals == 1,
        "retrievals inside active are counted in its decision, not as steps"
    );
    ensure!(!a.result.answer.is_empty());
    ensure!(a.streamed.trim() == a.result.answer);
    check_citations(&a.result, &chunk_ids)?;

    // Verification with at most one widened retry.
    let a = ask(&mut c, req("How long does sourdough ferment?", "verified"))
        .await
        .map_err(|e| e.0)?;
    report("verified", &a, Instant::now());
    let v = step(&a.result, "verify")?;
    ensure!(v.iteration <= 1 && v.decision.contains("P(supported)"));
    check_citations(&a.result, &chunk_ids)?;

    // HyDE, prev-next, rerank, keep-half, compression, long-context reorder.
    let a = ask(&mut c, req("What does ef_search change?", "hyde"))
        .await
        .map_err(|e| e.0)?;
    report("hyde", &a, Instant::now());
    ensure!(ops(&a.result).starts_with(&["hyde".into(), "dense".into(), "prev_next".into()]));
    check_citations(&a.result, &chunk_ids)?;

    // Sub-questions (decompose) and a step-back question, each retrieved in parallel and fused.
    for (op, max) in [("decompose", 3), ("step_back", 2)] {
        let mut r = req("How do BM25 and HNSW each rank results?", "");
        r.inline_flow = format!(
            "steps = [{{ op = \"{op}\" }}, {{ op = \"branch\", over = \"queries\", steps = [{{ op = \"bm25\", top_k = 2 }}] }}, {{ op = \"fuse\", method = \"rrf\" }}]"
        );
        let a = ask(&mut c, r).await.map_err(|e| e.0)?;
        let n = step(&a.result, "branch")?.branches;
        println!("[{op}] {n} queries: {}", step(&a.result, op)?.output);
        ensure!((1..=max).contains(&n), "{op}: {n} branches");
        ensure!(!a.result.contexts.is_empty());
    }

    // A yes/no question answered "Yes" or "No" first, calibrated against the prompt
    // without its contexts (one more one-token generation before the answer).
    let mut r = req("Does sourdough bread rise with commercial yeast?", "");
    r.inline_flow = "steps = [{ op = \"bm25\", top_k = 2 }, { op = \"prompt\" }, \
                     { op = \"generate\", max_tokens = 8, yes_no = \"calibrated\" }]"
        .into();
    let a = ask(&mut c, r).await.map_err(|e| e.0)?;
    ensure!(
        ["Yes", "No"].iter().any(|s| a.result.answer.starts_with(s)),
        "{:?}",
        a.result.answer
    );

    // An inline flow; overrides reach the retriever.
    let mut r = req("What is BM25?", "");
    r.inline_flow =
        "steps = [{ op = \"bm25\", top_k = 5 }, { op = \"threshold\", keep_fraction = 0.5 }]"
            .into();
    r.overrides = Some(AskOverrides {
        top_k: Some(4),
        ..Default::default()
    });
    let a = ask(&mut c, r).await.map_err(|e| e.0)?;
    ensure!(
        a.result.flow == "inline" && a.result.contexts.len() == 2 && a.result.answer.is_empty()
    );

    // Bad input.
    let code = |r: std::result::Result<Answer, (tonic::Status, Option<AskResult>)>| {
        r.err().map(|e| e.0.code())
    };
    ensure!(code(ask(&mut c, req("q", "no-such-flow")).await) == Some(Code::InvalidArgument));
    ensure!(code(ask(&mut c, req("  ", "linear")).await) == Some(Code::InvalidArgument));
    ensure!(
        code(
            ask(
                &mut c,
                AskRequest {
                    collection: "nope".into(),
                    ..req("q", "linear")
                }
            )
            .await
        ) == Some(Code::NotFound)
    );
    for o in [
        AskOverrides {
            top_k: Some(0),
            ..Default::default()
        },
        AskOverrides {
            fusion: Some("borda".into()),
            ..Default::default()
        },
        AskOverrides {
            dense_weight: Some(2.0),
            ..Default::default()
        },
        AskOverrides {
            max_tokens: Some(100_000),
            ..Default::default()
        },
    ] {
        let r = AskRequest {
            overrides: Some(o.clone()),
            ..req("q", "linear")
        };
        ensure!(
            code(ask(&mut c, r).await) == Some(Code::InvalidArgument),
            "{o:?}"
        );
    }
    let mut r = req("q", "");
    r.inline_flow = "steps = [{ op = \"bm25\" }, { op = \"generate\" }]".into();
    let e = ask(&mut c, r)
        .await
        .err()
        .context("inline flow without prompt must fail")?
        .0;
    ensure!(
        e.code() == Code::InvalidArgument && e.message().contains("step 2 (generate)"),
        "{e:?}"
    );

    // The deadline covers the whole flow: DEADLINE_EXCEEDED after a result with the partial trace.
    let r = AskRequest {
        timeout_ms: 400,
        ..req("How does Raft elect a leader?", "per_chunk")
    };
    let (e, partial) = ask(&mut c, r).await.err().context("must time out")?;
    ensure!(e.code() == Code::DeadlineExceeded, "{e:?}");
    let partial = partial.context("partial result before the status")?;
    ensure!(
        partial.status == "deadline_exceeded" && !partial.trace.is_empty(),
        "{partial:?}"
    );
    println!("deadline: partial trace {:?}", ops(&partial));

    // The generated-token budget caps every operator together.
    let r = AskRequest {
        max_generated_tokens: 6,
        ..req("How does Raft elect a leader?", "linear")
    };
    match ask(&mut c, r).await {
        Ok(a) => ensure!(
            a.result.generated_tokens <= 6,
            "{}",
            a.result.generated_tokens
        ),
        Err((e, _)) => ensure!(e.code() == Code::ResourceExhausted, "{e:?}"),
    }

    // Model worker outage: LLM operators are UNAVAILABLE, bm25-only flows keep answering.
    cluster.model_worker.kill9();
    let (e, _) = ask(&mut c, req("How does Raft elect a leader?", "linear"))
        .await
        .err()
        .context("must fail")?;
    ensure!(e.code() == Code::Unavailable, "{e:?}");
    ensure!(e.metadata().get("retry-after-ms").is_some());
    let a = ask(&mut c, req("raft leader election", "retrieve"))
        .await
        .map_err(|e| e.0)?;
    ensure!(a.result.status == "ok" && !a.result.contexts.is_empty() && a.result.answer.is_empty());
    Ok(())
}
