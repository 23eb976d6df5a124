//! A coordinator under 10x its per-key concurrency limit, on a real cluster on loopback:
//! requests over the documented limits are refused before any side effect, a caller's
//! deadline bounds a search, the excess load is shed at once with RESOURCE_EXHAUSTED (and a
//! retry hint), admitted requests keep a bounded p99, and the process stays up.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, Options, ingest_sample, percentile};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overload_is_shed_with_resource_exhausted_and_admitted_p99_stays_bounded() -> Result<()> {
    const LIMIT: usize = 4;
    let config = format!(
        "[coordinator.limits]\nmax_concurrent_requests_per_key = {LIMIT}\nmax_top_k = 50\n\
         max_batch_documents = 8\nmax_request_bytes = 1048576\n"
    );
    let cluster = Cluster::start_opts(Options {
        shard_nodes: 2,
        coordinators: 1,
        coordinator_config: Some(&config),
        ..Default::default()
    })?;
    let mut c = cluster.client().await?;
    ingest_sample(&mut c, "docs", 2).await?;

    // Limits on what one request may ask for.
    let search = |top_k| SearchRequest {
        collection: "docs".into(),
        query: "how does raft elect a leader".into(),
        top_k,
        mode: SearchMode::Bm25 as i32,
        ..Default::default()
    };
    let e = c.search(search(51)).await.unwrap_err();
    ensure!(
        e.code() == Code::InvalidArgument,
        "top_k over the limit: {e:?}"
    );
    let docs = (0..9)
        .map(|i| Document {
            id: format!("d{i}"),
            text: "x".into(),
            ..Default::default()
        })
        .collect();
    let e = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "docs".into(),
            documents: docs,
            ..Default::default()
        })
        .await
        .unwrap_err();
    ensure!(
        e.code() == Code::ResourceExhausted,
        "batch over the limit: {e:?}"
    );
    let e = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "docs".into(),
            documents: vec![Document {
                id: "big".into(),
                text: "word ".repeat(300_000),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    ensure!(
        matches!(e.code(), Code::OutOfRange | Code::ResourceExhausted),
        "request over max_request_bytes: {e:?}"
    );
    // A caller's deadline bounds the search (embedding, shards): 1 ms cannot be met by a
    // hybrid search, and the answer comes at once (DEADLINE_EXCEEDED from the coordinator, or
    // CANCELLED when tonic's own deadline check fires first).
    let mut r = tonic::Request::new(SearchRequest {
        mode: SearchMode::Hybrid as i32,
        ..search(10)
    });
    r.set_timeout(Duration::from_millis(1));
    let started = Instant::now();
    let e = c.search(r).await.unwrap_err();
    ensure!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled)
            && started.elapsed() < Duration::from_secs(2),
        "deadline: {e:?} after {:?}",
        started.elapsed()
    );

    // Run `clients` searchers for `secs`; latencies of admitted calls and refusal counts.
    let run = |clients: usize, secs: u64| {
        let addr = cluster.coordinator.grpc.clone();
        async move {
            let stop = Instant::now() + Duration::from_secs(secs);
            let mut tasks = Vec::new();
            for _ in 0..clients {
                let addr = addr.clone();
                tasks.push(tokio::spawn(async move {
                    let mut c = ragcluster_tests::coordinator_client(&addr).await?;
                    let (mut ok, mut shed, mut hinted) = (Vec::new(), 0usize, 0usize);
                    while Instant::now() < stop {
                        let t = Instant::now();
                        match c.search(search(10)).await {
                            Ok(_) => ok.push(t.elapsed().as_secs_f64() * 1000.0),
                            Err(s) if s.code() == Code::ResourceExhausted => {
                                shed += 1;
                                if s.metadata().contains_key("retry-after-ms") {
                                    hinted += 1;
                                }
                                // An eager client: back off 2 ms, not the hinted 100.
                                tokio::time::sleep(Duration::from_millis(2)).await;
                            }
                            Err(s) => anyhow::bail!("unexpected {s:?}"),
                        }
                    }
                    anyhow::Ok((ok, shed, hinted))
                }));
            }
            let (mut ok, mut shed, mut hinted) = (Vec::new(), 0, 0);
            for t in tasks {
                let (o, s, h) = t.await??;
                ok.extend(o);
                shed += s;
                hinted += h;
            }
            anyhow::Ok((ok, shed, hinted))
        }
    };
    // The deadline-cut search above may still hold its admission slot on the coordinator
    // (the client gave up first; the handler ends when its own work does): wait until the
    // limit's worth of concurrent searches is admitted again before measuring at the limit.
    let mut settled = false;
    for _ in 0..100 {
        let calls = (0..LIMIT).map(|_| {
            let mut c = c.clone();
            async move { c.search(search(10)).await }
        });
        if futures::future::join_all(calls)
            .await
            .iter()
            .all(|r| r.is_ok())
        {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(
        settled,
        "the coordinator never admitted {LIMIT} concurrent searches again"
    );
    let (mut base, base_shed, _) = run(LIMIT, 4).await?;
    ensure!(base_shed == 0, "at the limit nothing is shed ({base_shed})");
    let (mut over, shed, hinted) = run(10 * LIMIT, 6).await?;
    let (b50, b99) = (percentile(&mut base, 50.0), percentile(&mut base, 99.0));
    let (o50, o99) = (percentile(&mut over, 50.0), percentile(&mut over, 99.0));
    eprintln!(
        "at the limit ({LIMIT} clients): {} searches, p50 {b50:.1} ms, p99 {b99:.1} ms; \
         at 10x ({} clients): {} admitted, {shed} shed, p50 {o50:.1} ms, p99 {o99:.1} ms \
         (ratio {:.2})",
        base.len(),
        10 * LIMIT,
        over.len(),
        o99 / b99
    );
    ensure!(
        shed > 0 && hinted == shed,
        "the excess is shed with a retry hint"
    );
    ensure!(!over.is_empty(), "admitted requests still complete");
    ensure!(
        o99 <= 4.0 * b99 + 200.0,
        "p99 of admitted searches grew from {b99:.1} ms to {o99:.1} ms under 10x overload"
    );
    // Alive and serving, and the refusals are counted.
    c.search(search(10)).await?;
    let page = ragcluster_tests::http_get(&cluster.coordinator.metrics).await?;
    ensure!(ragcluster_tests::metric_sum(&page, "coordinator_requests_shed_total") >= shed as f64);
    Ok(())
}

/// A client that sends every call with a 1 ms deadline (searches, writes, Asks) beside a
/// normal writer and searcher: its calls end DEADLINE_EXCEEDED (an Ask with its partial
/// trace, status `deadline_exceeded`), never as a worker or shard failure, no node is marked
/// down for them (no model worker failover), and the normal clients see 0 failed calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_with_1ms_deadlines_fails_no_one_else() -> Result<()> {
    let cluster = Cluster::start_opts(Options {
        shard_nodes: 3,
        coordinators: 1,
        generation: true,
        ..Default::default()
    })?;
    let mut c = cluster.client().await?;
    ingest_sample(&mut c, "docs", 2).await?;
    let failovers = || async {
        let page = ragcluster_tests::http_get(&cluster.coordinator.metrics).await?;
        anyhow::Ok(ragcluster_tests::metric_sum(
            &page,
            "coordinator_model_worker_failovers_total",
        ))
    };
    let before = failovers().await?;
    let normal =
        ragcluster_tests::load::Load::start(c.clone(), "docs", "normal", SearchMode::Hybrid);
    let (mut calls, mut asks) = (0usize, 0usize);
    let until = Instant::now() + Duration::from_secs(8);
    let mut a = cluster.client().await?;
    while Instant::now() < until {
        let mut s = tonic::Request::new(SearchRequest {
            collection: "docs".into(),
            query: "how does raft elect a leader".into(),
            top_k: 5,
            mode: SearchMode::Hybrid as i32,
            ..Default::default()
        });
        s.set_timeout(Duration::from_millis(1));
        let mut w = tonic::Request::new(UpsertDocumentsRequest {
            collection: "docs".into(),
            documents: vec![Document {
                id: format!("tiny-{calls}"),
                text: "a write whose caller gives it one millisecond".into(),
                ..Default::default()
            }],
            ..Default::default()
        });
        w.set_timeout(Duration::from_millis(1));
        for r in [
            a.search(s).await.map(|_| ()),
            a.upsert_documents(w).await.map(|_| ()),
        ] {
            if let Err(e) = r {
                ensure!(
                    matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
                    "a 1 ms call failed as {e:?}"
                );
            }
            calls += 1;
        }
        // Ask with timeout_ms = 1 through the default flow (rewrite -> ... -> generate).
        let mut stream = a
            .ask(AskRequest {
                collection: "docs".into(),
                question: "How does Raft elect a leader?".into(),
                timeout_ms: 1,
                ..Default::default()
            })
            .await?
            .into_inner();
        let (mut result, mut status) = (None, None);
        loop {
            match stream.message().await {
                Ok(Some(AskResponse {
                    event: Some(ask_response::Event::Result(r)),
                })) => result = Some(r),
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(s) => {
                    status = Some(s);
                    break;
                }
            }
        }
        let result = result.expect("an Ask ends with its result");
        if result.status != "ok" {
            ensure!(
                result.status == "deadline_exceeded"
                    && status.as_ref().map(tonic::Status::code) == Some(Code::DeadlineExceeded),
                "a 1 ms Ask ended {:?} ({:?}), then {status:?}",
                result.status,
                result.error
            );
        }
        asks += 1;
    }
    let acked = normal.stop().await?;
    eprintln!(
        "1 ms client: {calls} searches and writes, {asks} Asks; normal clients: {} writes, {} \
         searches",
        acked.len(),
        normal.searches.load(std::sync::atomic::Ordering::Relaxed)
    );
    let retries = normal
        .write_retries
        .load(std::sync::atomic::Ordering::Relaxed)
        + normal
            .search_retries
            .load(std::sync::atomic::Ordering::Relaxed);
    ensure!(retries == 0, "{retries} calls of the normal clients failed");
    ensure!(
        failovers().await? == before,
        "the 1 ms client made the coordinator pass over its model worker"
    );
    normal.verify(c).await
}
