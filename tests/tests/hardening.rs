//! What an outside client found (issue 18), on real processes: a refused request changes
//! nothing and names the client's field without internal addresses, every documented cap is
//! enforced, a partly failed batch says which documents were stored, a fresh collection
//! answers STRONG reads, reflection lists only what a port serves, every documented metric is
//! there from the start, and a shard node holding rf-3 leaderships stops on SIGTERM in time
//! and hands its leaderships over.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use parking_lot::Mutex;
use prost::Message;
use ragcluster_proto::v1::coordinator_client::CoordinatorClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Cluster, Options, http_get, workspace};
use tonic::Code;
use tonic::transport::Channel;

const DIM: usize = 384;

/// A unit vector of the collection's dimension, different per seed.
fn unit(seed: u64) -> Vec<f32> {
    let mut v: Vec<f32> = (0..DIM)
        .map(|i| (((seed + 1) * 7919 + i as u64 * 104_729) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter_mut().for_each(|x| *x /= n);
    v
}

fn doc(id: &str, seed: u64) -> Document {
    Document {
        id: id.into(),
        title: "Hardening".into(),
        text: format!("document {id} about replicated storage and retrieval number {seed}"),
        embedding: unit(seed),
        ..Default::default()
    }
}

/// What a refused request must leave as it was: every collection's per-shard figures.
async fn state(c: &mut CoordinatorClient<Channel>) -> Result<Vec<(String, Vec<(u64, u64, u64)>)>> {
    let list = c
        .list_collections(ListCollectionsRequest {})
        .await?
        .into_inner();
    let mut out = Vec::new();
    for col in list.collections {
        let d = c
            .describe_collection(DescribeCollectionRequest {
                name: col.name.clone(),
            })
            .await?
            .into_inner();
        let shards = d
            .shards
            .iter()
            .map(|s| (s.documents, s.chunks, s.applied_seq))
            .collect();
        out.push((col.name, shards));
    }
    Ok(out)
}

/// The refusal `r` has `code` and a message naming every one of `words`, and no address.
fn refused<T>(
    case: &str,
    r: std::result::Result<T, tonic::Status>,
    code: Code,
    words: &[&str],
) -> Result<()> {
    let Err(s) = r else {
        bail!("{case}: answered OK, expected {code:?}");
    };
    ensure!(
        s.code() == code,
        "{case}: {:?} {:?}, expected {code:?}",
        s.code(),
        s.message()
    );
    for w in words {
        ensure!(
            s.message().contains(w),
            "{case}: message {:?} does not name {w:?}",
            s.message()
        );
    }
    ensure!(
        !s.message().contains("127.0.0.1") && !s.message().contains("http://"),
        "{case}: message leaks an address: {:?}",
        s.message()
    );
    Ok(())
}

fn search(collection: &str) -> SearchRequest {
    SearchRequest {
        collection: collection.into(),
        query: "replicated storage".into(),
        top_k: 5,
        mode: SearchMode::Bm25 as i32,
        ..Default::default()
    }
}

fn ask(collection: &str) -> AskRequest {
    AskRequest {
        collection: collection.into(),
        question: "what is stored?".into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_refused_whole() -> Result<()> {
    let cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: "h".into(),
        shard_count: 3,
        ..Default::default()
    })
    .await?;
    c.upsert_documents(UpsertDocumentsRequest {
        collection: "h".into(),
        documents: (0..4).map(|i| doc(&format!("seed{i}"), i)).collect(),
        ..Default::default()
    })
    .await?;
    let before = state(&mut c).await?;

    // 1. Six valid documents and one bad embedding: nothing is written.
    let mut nan = unit(99);
    nan[3] = f32::NAN;
    let mut inf = unit(99);
    inf[0] = f32::INFINITY;
    let bad = [
        (nan, "not finite"),
        (inf, "not finite"),
        (vec![0.0; DIM], "zero"),
        (vec![0.5; 17], "dimension"),
    ];
    for (embedding, what) in bad {
        let mut documents: Vec<Document> = (0..6).map(|i| doc(&format!("ok{i}"), i + 10)).collect();
        documents.push(Document {
            embedding,
            ..doc("bad", 50)
        });
        let r = c
            .upsert_documents(UpsertDocumentsRequest {
                collection: "h".into(),
                documents,
                ..Default::default()
            })
            .await;
        refused(
            &format!("embedding {what}"),
            r,
            Code::InvalidArgument,
            &["documents[6].embedding", what],
        )?;
    }

    // Valid documents or ids with a token that does not decode: nothing is written.
    let up = c
        .upsert_documents(UpsertDocumentsRequest {
            collection: "h".into(),
            documents: (0..3).map(|i| doc(&format!("tok{i}"), i + 60)).collect(),
            read_token: "rt1.AAAA".into(),
        })
        .await;
    refused(
        "upsert read token",
        up,
        Code::InvalidArgument,
        &["read_token"],
    )?;
    let del = c
        .delete_documents(DeleteDocumentsRequest {
            collection: "h".into(),
            ids: vec!["seed0".into()],
            read_token: "rt1.AAAA".into(),
            ..Default::default()
        })
        .await;
    refused(
        "delete read token",
        del,
        Code::InvalidArgument,
        &["read_token"],
    )?;

    // 2. Every documented cap, with and without a tighter client deadline.
    let cases: Vec<(&str, SearchRequest, &str)> = vec![
        (
            "consistency 9",
            SearchRequest {
                consistency: 9,
                ..search("h")
            },
            "consistency",
        ),
        (
            "search timeout",
            SearchRequest {
                timeout_ms: 60_001,
                ..search("h")
            },
            "timeout_ms",
        ),
        (
            "read token",
            SearchRequest {
                read_token: "rt1.not-a-token".into(),
                ..search("h")
            },
            "read_token",
        ),
        (
            "read token over 8 KiB",
            SearchRequest {
                read_token: "x".repeat(8 * 1024 + 1),
                ..search("h")
            },
            "read_token",
        ),
        (
            "exact with ef_search",
            SearchRequest {
                exact: true,
                ef_search: 64,
                ..search("h")
            },
            "ef_search",
        ),
    ];
    for (case, req, field) in cases {
        refused(
            case,
            c.search(req.clone()).await,
            Code::InvalidArgument,
            &[field],
        )?;
        let mut with_deadline = tonic::Request::new(req);
        with_deadline.set_timeout(Duration::from_secs(5));
        refused(
            case,
            c.search(with_deadline).await,
            Code::InvalidArgument,
            &[field],
        )?;
    }
    for flow in ["", "multi_query", "iterative"] {
        let base = AskRequest {
            flow: flow.into(),
            ..ask("h")
        };
        let asks: Vec<(AskRequest, &str)> = vec![
            (
                AskRequest {
                    timeout_ms: 600_001,
                    ..base.clone()
                },
                "timeout_ms",
            ),
            (
                AskRequest {
                    max_branches: 100,
                    ..base.clone()
                },
                "max_branches",
            ),
            (
                AskRequest {
                    max_iterations: 100,
                    ..base.clone()
                },
                "max_iterations",
            ),
            (
                AskRequest {
                    max_generated_tokens: 5000,
                    ..base.clone()
                },
                "max_generated_tokens",
            ),
            (
                AskRequest {
                    read_token: "garbage".into(),
                    ..base.clone()
                },
                "read_token",
            ),
            (
                AskRequest {
                    overrides: Some(AskOverrides {
                        generate_model: Some("no-such-model".into()),
                        ..Default::default()
                    }),
                    ..base.clone()
                },
                "overrides.generate_model",
            ),
            (
                AskRequest {
                    overrides: Some(AskOverrides {
                        rerank_model: Some("no-such-model".into()),
                        ..Default::default()
                    }),
                    ..base.clone()
                },
                "overrides.rerank_model",
            ),
        ];
        for (req, field) in asks {
            let case = format!("ask {field} (flow {flow:?})");
            refused(&case, c.ask(req).await, Code::InvalidArgument, &[field])?;
        }
    }

    // 5. Bad names are the request's fault, not missing collections.
    for name in ["", "../x", "Bad Name"] {
        let case = format!("name {name:?}");
        let describe = c
            .describe_collection(DescribeCollectionRequest { name: name.into() })
            .await;
        refused(&case, describe, Code::InvalidArgument, &["name"])?;
        let drop = c
            .drop_collection(DropCollectionRequest { name: name.into() })
            .await;
        refused(&case, drop, Code::InvalidArgument, &["name"])?;
        let up = c
            .upsert_documents(UpsertDocumentsRequest {
                collection: name.into(),
                documents: vec![doc("a", 1)],
                ..Default::default()
            })
            .await;
        refused(&case, up, Code::InvalidArgument, &["collection"])?;
        let del = c
            .delete_documents(DeleteDocumentsRequest {
                collection: name.into(),
                ids: vec!["a".into()],
                ..Default::default()
            })
            .await;
        refused(&case, del, Code::InvalidArgument, &["collection"])?;
        refused(
            &case,
            c.search(search(name)).await,
            Code::InvalidArgument,
            &["collection"],
        )?;
        refused(
            &case,
            c.ask(ask(name)).await,
            Code::InvalidArgument,
            &["collection"],
        )?;
    }
    refused(
        "missing collection",
        c.search(search("missing")).await,
        Code::NotFound,
        &["missing"],
    )?;

    // Partial updates and deletes by filter: each malformed request is refused whole.
    let set = |k: &str, v: &str| MetadataPatch {
        set_metadata: [(k.to_owned(), v.to_owned())].into(),
        ..Default::default()
    };
    let updates: Vec<(&str, UpdateDocumentsRequest, &str)> = vec![
        (
            "no selection",
            UpdateDocumentsRequest {
                patch: Some(set("k", "v")),
                ..Default::default()
            },
            "ids",
        ),
        (
            "empty patch",
            UpdateDocumentsRequest {
                ids: vec!["seed0".into()],
                ..Default::default()
            },
            "patch",
        ),
        (
            "section",
            UpdateDocumentsRequest {
                ids: vec!["seed0".into()],
                patch: Some(set("section", "x")),
                ..Default::default()
            },
            "section",
        ),
        (
            "ids and filter",
            UpdateDocumentsRequest {
                ids: vec!["seed0".into()],
                conditions: Some(Filter::default()),
                patch: Some(set("k", "v")),
                ..Default::default()
            },
            "conditions",
        ),
        (
            "repeated id",
            UpdateDocumentsRequest {
                ids: vec!["seed0".into(), "seed0".into()],
                patch: Some(set("k", "v")),
                ..Default::default()
            },
            "ids[1]",
        ),
        (
            "unknown field in filter",
            UpdateDocumentsRequest {
                conditions: Some(Filter {
                    must: vec![Condition {
                        kind: Some(condition::Kind::Exists("nope".into())),
                    }],
                    ..Default::default()
                }),
                patch: Some(set("k", "v")),
                ..Default::default()
            },
            "conditions.must[0]",
        ),
        (
            "too many entries",
            UpdateDocumentsRequest {
                ids: vec!["seed0".into()],
                patch: Some(MetadataPatch {
                    delete_fields: (0..65).map(|i| format!("f{i}")).collect(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            "patch",
        ),
    ];
    for (case, mut r, says) in updates {
        r.collection = "h".into();
        let code = if case == "too many entries" {
            Code::ResourceExhausted
        } else {
            Code::InvalidArgument
        };
        refused(case, c.update_documents(r).await, code, &[says])?;
    }
    let del = c
        .delete_documents(DeleteDocumentsRequest {
            collection: "h".into(),
            conditions: Some(Filter::default()),
            ..Default::default()
        })
        .await;
    refused(
        "delete everything by an empty filter",
        del,
        Code::InvalidArgument,
        &["conditions"],
    )?;

    // Re-embedding steps, malformed or out of order: refused, nothing created.
    let mut a = cluster.admin().await?;
    let reembed = |action: ReembedAction, model: &str| ReembedRequest {
        collection: "h".into(),
        action: action as i32,
        embedding_model: model.into(),
        ..Default::default()
    };
    let steps: Vec<(&str, ReembedRequest, Code, &str)> = vec![
        (
            "reembed bad name",
            ReembedRequest {
                collection: "Bad Name".into(),
                ..reembed(ReembedAction::Start, "m")
            },
            Code::InvalidArgument,
            "collection",
        ),
        (
            "reembed without an action",
            reembed(ReembedAction::Unspecified, "m"),
            Code::InvalidArgument,
            "action",
        ),
        (
            "reembed too parallel",
            ReembedRequest {
                parallel: 17,
                ..reembed(ReembedAction::Start, "m")
            },
            Code::InvalidArgument,
            "parallel",
        ),
        (
            "reembed bad target",
            ReembedRequest {
                target: "Bad/Name".into(),
                ..reembed(ReembedAction::Start, "m")
            },
            Code::InvalidArgument,
            "target",
        ),
        (
            "reembed without a model",
            reembed(ReembedAction::Start, ""),
            Code::InvalidArgument,
            "embedding_model",
        ),
        (
            "reembed an unknown model",
            reembed(ReembedAction::Start, "no-such-model"),
            Code::InvalidArgument,
            "embedding_model",
        ),
        (
            "reembed switch without a job",
            reembed(ReembedAction::Switch, ""),
            Code::FailedPrecondition,
            "not being re-embedded",
        ),
    ];
    for (case, r, code, says) in steps {
        let run = async {
            let mut s = a.reembed(r).await?.into_inner();
            while s.message().await?.is_some() {}
            Ok::<_, tonic::Status>(())
        };
        refused(case, run.await, code, &[says])?;
    }

    ensure!(
        state(&mut c).await? == before,
        "a refused request changed the cluster"
    );
    Ok(())
}

/// A valid batch over three shards, one of them down: UNAVAILABLE whose details say, per
/// document, what was stored; retrying the whole batch once the node is back stores all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_write_names_what_was_stored() -> Result<()> {
    let mut cluster = Cluster::start_opts(Options {
        shard_nodes: 3,
        coordinator_config: Some("[coordinator]\nwrite_timeout = \"2s\"\n"),
        ..Default::default()
    })?;
    let mut c = cluster.client().await?;
    let info = c
        .create_collection(CreateCollectionRequest {
            name: "p".into(),
            shard_count: 3,
            ..Default::default()
        })
        .await?
        .into_inner()
        .collection
        .context("no collection")?;
    let victim_addr = info.shards[0].nodes[0].clone();
    let victim = cluster
        .shards
        .iter()
        .position(|s| s.grpc == victim_addr)
        .context("shard 0's node")?;
    cluster.shards[victim].kill9();
    let documents: Vec<Document> = (0..12).map(|i| doc(&format!("d{i}"), i)).collect();
    let req = UpsertDocumentsRequest {
        collection: "p".into(),
        documents,
        ..Default::default()
    };
    let s = c
        .upsert_documents(req.clone())
        .await
        .err()
        .context("a write to a dead shard answered OK")?;
    ensure!(s.code() == Code::Unavailable, "{s:?}");
    ensure!(
        s.message().contains("retry"),
        "no retry hint: {}",
        s.message()
    );
    let partial = UpsertDocumentsResponse::decode(s.details())
        .context("UNAVAILABLE without per-document details")?;
    ensure!(partial.results.len() == 12, "{partial:?}");
    let stored: Vec<&str> = partial
        .results
        .iter()
        .filter(|r| r.stored)
        .map(|r| r.id.as_str())
        .collect();
    let failed: Vec<&DocumentResult> = partial.results.iter().filter(|r| !r.stored).collect();
    ensure!(!failed.is_empty(), "nothing failed: {partial:?}");
    ensure!(
        failed.iter().all(|r| r.code == Code::Unavailable as i32),
        "{failed:?}"
    );
    ensure!(partial.documents as usize == stored.len());
    // The coordinator said so in its log: shard, node and reason of the failed write.
    let log = std::fs::read_to_string(cluster.coordinator.log())?;
    ensure!(
        log.lines()
            .any(|l| l.contains("write not committed in time") && l.contains("shard=")),
        "no log line for the failed write"
    );
    ensure!(log.contains("write retry"), "retries are not logged");
    eprintln!(
        "partial write: {} of 12 stored, {} failed",
        stored.len(),
        failed.len()
    );
    cluster.shards[victim].restart(Duration::from_secs(60))?;
    let mut ok = None;
    for _ in 0..40 {
        match c.upsert_documents(req.clone()).await {
            Ok(r) => {
                ok = Some(r.into_inner());
                break;
            }
            Err(s) if s.code() == Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(s) => bail!("retry: {s:?}"),
        }
    }
    let ok = ok.context("the retried batch never succeeded")?;
    ensure!(ok.documents == 12 && ok.results.iter().all(|r| r.stored));
    let d = c
        .describe_collection(DescribeCollectionRequest { name: "p".into() })
        .await?
        .into_inner();
    let total: u64 = d.shards.iter().map(|s| s.documents).sum();
    ensure!(total == 12, "{total} documents after the retry");
    Ok(())
}

/// CreateCollection answers once every shard has a leader that serves read indexes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_collections_answer_strong_reads() -> Result<()> {
    let cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    for (name, shard_count, replication_factor) in [("f1", 1, 1), ("f2", 3, 2), ("f3", 2, 3)] {
        let t = Instant::now();
        c.create_collection(CreateCollectionRequest {
            name: name.into(),
            shard_count,
            replication_factor,
            ..Default::default()
        })
        .await?;
        let created = t.elapsed();
        let t = Instant::now();
        let r = c
            .search(SearchRequest {
                consistency: Consistency::Strong as i32,
                ..search(name)
            })
            .await
            .with_context(|| format!("STRONG search right after creating {name}"))?
            .into_inner();
        ensure!(r.hits.is_empty() && r.shards_ok == shard_count);
        eprintln!(
            "{name} (rf {replication_factor}): created in {created:?}, first STRONG search {:?}",
            t.elapsed()
        );
    }
    Ok(())
}

/// Services a port lists through reflection, in the protocol version of module `$pb`.
macro_rules! list_services {
    ($pb:path, $ch:expr) => {{
        use $pb as pb;
        let req = pb::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(pb::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let mut s = pb::server_reflection_client::ServerReflectionClient::new($ch)
            .server_reflection_info(futures::stream::iter([req]))
            .await?
            .into_inner();
        match s.message().await?.and_then(|m| m.message_response) {
            Some(pb::server_reflection_response::MessageResponse::ListServicesResponse(l)) => l
                .service
                .into_iter()
                .map(|s| s.name)
                .collect::<BTreeSet<String>>(),
            other => bail!("list services: {other:?}"),
        }
    }};
}

/// Services a port lists through reflection (v1 or v1alpha).
async fn listed(addr: &str, alpha: bool) -> Result<BTreeSet<String>> {
    let ch = Channel::from_shared(addr.to_owned())?.connect().await?;
    Ok(if alpha {
        list_services!(tonic_reflection::pb::v1alpha, ch)
    } else {
        list_services!(tonic_reflection::pb::v1, ch)
    })
}

/// Every documented metric name (the README and the pages of `docs/`, where
/// `docs/configuration.md` lists them all), by the process that exports it.
fn documented_metrics() -> Result<Vec<String>> {
    let mut readme = std::fs::read_to_string(workspace().join("README.md"))?;
    for e in std::fs::read_dir(workspace().join("docs"))? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "md") {
            readme.push_str(&std::fs::read_to_string(&p)?);
        }
    }
    let mut names = BTreeSet::new();
    for (i, tok) in readme.split('`').enumerate() {
        if i % 2 == 0 {
            continue;
        }
        // A trailing `{labels}` names labels; braces inside expand to alternatives.
        let tok = match tok.strip_suffix('}') {
            Some(t) if !t.contains('{') || t.rfind('{') > t.rfind('}') => {
                &t[..t.rfind('{').unwrap_or(t.len())]
            }
            _ => tok,
        };
        if !tok
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_{},".contains(c))
        {
            continue;
        }
        let known = [
            "grpc_",
            "coordinator_",
            "catalog_",
            "shard_",
            "rocksdb_",
            "raft_",
            "model_",
            "member_",
        ];
        // Config keys that share a prefix with metric names.
        let config_keys = ["shard_nodes", "model_worker"];
        if !known.iter().any(|p| tok.starts_with(p)) || config_keys.contains(&tok) {
            continue;
        }
        match (tok.find('{'), tok.find('}')) {
            (Some(a), Some(b)) if a < b => {
                for alt in tok[a + 1..b].split(',') {
                    names.insert(format!("{}{alt}{}", &tok[..a], &tok[b + 1..]));
                }
            }
            _ => {
                names.insert(tok.to_owned());
            }
        }
    }
    Ok(names.into_iter().collect())
}

/// Reflection lists only a port's own services, in v1 and v1alpha; every metric family the
/// README names is on /metrics before its first event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ports_describe_only_what_they_serve() -> Result<()> {
    let cluster = Cluster::start(1)?;
    let own: [(&str, &[&str]); 3] = [
        (
            &cluster.coordinator.grpc,
            &[
                "ragcluster.v1.Coordinator",
                "ragcluster.v1.Admin",
                "ragcluster.v1.CatalogPeer",
                "ragcluster.v1.Membership",
            ],
        ),
        (&cluster.shards[0].grpc, &["ragcluster.v1.Shard"]),
        (&cluster.model_worker.grpc, &["ragcluster.v1.ModelWorker"]),
    ];
    for (addr, services) in own {
        for alpha in [false, true] {
            let names = listed(addr, alpha).await?;
            for s in services.iter().chain(&["grpc.health.v1.Health"]) {
                ensure!(
                    names.contains(*s),
                    "{addr} (alpha {alpha}) lacks {s}: {names:?}"
                );
            }
            // The shard node of `make test` also serves the test-only Failpoints service.
            let foreign: Vec<&String> = names
                .iter()
                .filter(|n| n.starts_with("ragcluster."))
                .filter(|n| !services.contains(&n.as_str()) && *n != "ragcluster.v1.Failpoints")
                .collect();
            ensure!(foreign.is_empty(), "{addr} lists {foreign:?}");
        }
    }

    let pages = HashMap::from([
        ("coordinator", http_get(&cluster.coordinator.metrics).await?),
        ("shard", http_get(&cluster.shards[0].metrics).await?),
        ("model", http_get(&cluster.model_worker.metrics).await?),
    ]);
    let names = documented_metrics()?;
    ensure!(names.len() > 50, "README names only {names:?}");
    let mut missing = Vec::new();
    for n in &names {
        let procs: &[&str] = match n.split('_').next() {
            Some("grpc") => &["coordinator", "shard", "model"],
            Some("coordinator" | "catalog") => &["coordinator"],
            Some("shard" | "rocksdb" | "raft") => &["shard"],
            Some("member") => &["shard", "model"],
            _ => &["model"],
        };
        for p in procs {
            let page = &pages[p];
            let present = page.lines().any(|l| l.starts_with(&format!("# TYPE {n} ")));
            if !present {
                missing.push(format!("{p}: {n}"));
            }
        }
    }
    ensure!(missing.is_empty(), "not on /metrics at start: {missing:?}");
    Ok(())
}

/// A node leading rf-3 shards gets SIGTERM while a writer runs: it exits within 10 s, its
/// leaderships move before it goes (no write waits for an election timeout), and every
/// acknowledged write is there afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_off_leaderships_and_exits_in_time() -> Result<()> {
    let mut cluster = Cluster::start(3)?;
    let mut c = cluster.client().await?;
    c.create_collection(CreateCollectionRequest {
        name: "t".into(),
        shard_count: 3,
        replication_factor: 3,
        ..Default::default()
    })
    .await?;
    let writes: Arc<Mutex<Vec<(Instant, Duration, bool)>>> = Default::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (writes, stop, mut c) = (writes.clone(), stop.clone(), c.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                let ok = c
                    .upsert_documents(UpsertDocumentsRequest {
                        collection: "t".into(),
                        documents: vec![doc(&format!("w{i}"), i)],
                        ..Default::default()
                    })
                    .await
                    .is_ok();
                writes.lock().push((t, t.elapsed(), ok));
                i += 1;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The node that leads the most shards.
    let d = c
        .describe_collection(DescribeCollectionRequest { name: "t".into() })
        .await?
        .into_inner();
    let mut leads: HashMap<String, usize> = HashMap::new();
    for s in &d.shards {
        *leads.entry(s.leader.clone()).or_default() += 1;
    }
    let leader = leads
        .iter()
        .max_by_key(|(_, n)| **n)
        .map(|(a, _)| a.clone())
        .context("no leaders")?;
    let victim = cluster
        .shards
        .iter()
        .position(|s| s.grpc == leader)
        .with_context(|| format!("leader {leader} is no shard node"))?;
    let sent = Instant::now();
    let status = cluster.shards[victim].terminate()?;
    let exit = sent.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await?;
    let w = writes.lock().clone();
    let after: Vec<&(Instant, Duration, bool)> = w.iter().filter(|(t, _, _)| *t >= sent).collect();
    let worst = after.iter().map(|(_, d, _)| *d).max().unwrap_or_default();
    let failed = after.iter().filter(|(_, _, ok)| !ok).count();
    eprintln!(
        "SIGTERM of a node leading {} of 3 rf-3 shards: exit {status} after {exit:?}; \
         {} writes after it, {failed} failed, slowest {worst:?}",
        leads[&leader],
        after.len()
    );
    ensure!(exit < Duration::from_secs(10), "exit took {exit:?}");
    ensure!(failed == 0, "{failed} writes failed after SIGTERM");
    // Without the hand-off a write waits out an election timeout (1-2 s).
    ensure!(
        worst < Duration::from_secs(1),
        "a write waited {worst:?}: leaderships were not handed over"
    );
    let acked = w.iter().filter(|(_, _, ok)| *ok).count() as u64;
    let d = c
        .describe_collection(DescribeCollectionRequest { name: "t".into() })
        .await?
        .into_inner();
    let total: u64 = d.shards.iter().map(|s| s.documents).sum();
    ensure!(total >= acked, "{acked} acknowledged, {total} stored");
    Ok(())
}

/// `ragctl local up` names every process with its metrics address in cluster.json, `collection
/// create` prints what it created with the API's default chunking, and `local down` waits for
/// the processes and says how they ended.
#[test]
fn ragctl_local_cluster_names_and_stops_every_process() -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("ragcluster-test-ragctl-")
        .tempdir()?;
    let ragctl = |args: &[&str]| ragcluster_tests::ragctl_ok(dir.path(), args);
    let models = ragcluster_tests::models_dir();
    let up = ragctl(&[
        "local",
        "up",
        "--shard-nodes",
        "2",
        "--models",
        &models.display().to_string(),
    ]);
    let result = (|| -> Result<()> {
        let up = up?;
        let cluster: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("cluster.json"))?)?;
        let procs = cluster["processes"].as_array().context("no processes")?;
        let names: Vec<&str> = procs.iter().filter_map(|p| p["name"].as_str()).collect();
        ensure!(
            names == ["coordinator", "model-worker", "shard-0", "shard-1"],
            "{names:?}"
        );
        for p in procs {
            let m = p["metrics"].as_str().context("metrics")?;
            ensure!(up.contains(m), "`local up` does not print {m}: {up}");
        }
        let created = ragctl(&["collection", "create", "rtest", "--shards", "2"])?;
        ensure!(
            created.contains(
                "created collection rtest (2 shards, replication factor 1, sentence chunking"
            ),
            "{created}"
        );
        Ok(())
    })();
    let down = ragctl(&["local", "down"]);
    result?;
    let down = down?;
    ensure!(
        down.contains("local cluster stopped (4 processes exited in"),
        "{down}"
    );
    Ok(())
}
