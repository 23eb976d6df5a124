//! The model worker as a process: model registry and ListModels, dynamic batching (merged
//! batches give the same vectors as requests alone; a full queue answers RESOURCE_EXHAUSTED
//! with a retry hint), truncation flags, every bad-input status, and the three rerankers:
//! a cross-encoder (a small randomly initialised BERT classifier built here and saved as
//! safetensors, checked against an independent forward pass and batch-equals-single), MaxSim
//! over MiniLM token vectors, and UPR query likelihood and yes/no relevance with SmolLM2. Then the
//! OpenAI-compatible HTTP API and the remote generation backend pointed at it.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{Module, VarBuilder, VarMap};
use candle_transformers::models::bert::{BertModel, Config};
use futures::StreamExt;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::{Proc, bin_dir, embed_model, http_get, http_post_json, metric_sum};
use tonic::Code;
use tonic::transport::Channel;

async fn client(p: &Proc) -> Result<ModelWorkerClient<Channel>> {
    Ok(ModelWorkerClient::new(
        Channel::from_shared(p.grpc.clone())?.connect().await?,
    ))
}

/// A 2-layer, 32-wide BERT sequence classifier with random weights, in HF layout, using
/// MiniLM's tokenizer. Returns the directory and the weights for the reference forward.
fn tiny_cross_encoder(dir: &Path) -> Result<(PathBuf, VarMap, Config)> {
    let out = dir.join("tiny-cross-encoder");
    std::fs::create_dir_all(&out)?;
    let minilm = embed_model()?;
    for f in ["tokenizer.json", "vocab.txt", "tokenizer_config.json"] {
        if minilm.join(f).exists() {
            std::fs::copy(minilm.join(f), out.join(f))?;
        }
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(minilm.join("config.json"))?)?;
    cfg["architectures"] = serde_json::json!(["BertForSequenceClassification"]);
    cfg["hidden_size"] = 32.into();
    cfg["num_hidden_layers"] = 2.into();
    cfg["num_attention_heads"] = 2.into();
    cfg["intermediate_size"] = 64.into();
    cfg["id2label"] = serde_json::json!({"0": "LABEL_0"});
    cfg["label2id"] = serde_json::json!({"LABEL_0": 0});
    std::fs::write(out.join("config.json"), cfg.to_string())?;
    let config: Config = serde_json::from_value(cfg)?;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    BertModel::load(vb.pp("bert"), &config)?;
    candle_nn::linear(32, 32, vb.pp("bert.pooler.dense"))?;
    candle_nn::linear(32, 1, vb.pp("classifier"))?;
    vars.save(out.join("model.safetensors"))?;
    Ok((out, vars, config))
}

/// sigmoid(classifier(tanh(pooler(h_CLS)))) for one tokenised pair, with candle directly.
fn reference_score(vars: &VarMap, config: &Config, ids: &[u32], types: &[u32]) -> Result<f32> {
    let vb = VarBuilder::from_varmap(vars, DType::F32, &Device::Cpu);
    let bert = BertModel::load(vb.pp("bert"), config)?;
    let pooler = candle_nn::linear(32, 32, vb.pp("bert.pooler.dense"))?;
    let head = candle_nn::linear(32, 1, vb.pp("classifier"))?;
    let ids = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
    let types = Tensor::new(types, &Device::Cpu)?.unsqueeze(0)?;
    let h = bert.forward(&ids, &types, None)?;
    let cls = h.i((.., 0))?.contiguous()?;
    let logit = head.forward(&pooler.forward(&cls)?.tanh()?)?;
    Ok(candle_nn::ops::sigmoid(&logit)?
        .flatten_all()?
        .to_vec1::<f32>()?[0])
}

/// ListModels' models.
async fn list(c: &mut ModelWorkerClient<Channel>) -> Result<Vec<ModelInfo>> {
    Ok(c.list_models(ListModelsRequest {})
        .await?
        .into_inner()
        .models)
}

fn code<T>(r: std::result::Result<T, tonic::Status>) -> Code {
    r.err().map_or(Code::Ok, |s| s.code())
}

fn write_config(dir: &Path, name: &str, text: &str) -> Result<PathBuf> {
    let p = dir.join(name);
    std::fs::write(&p, text)?;
    Ok(p)
}

const PASSAGES: [&str; 4] = [
    "Bananas are rich in potassium and grow in tropical climates.",
    "Paris is the capital and largest city of France.",
    "The mitochondrion is the powerhouse of the cell.",
    "Raft elects a leader by majority vote among the servers.",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoders_batching_and_rerank() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (cross_dir, vars, config) = tiny_cross_encoder(dir.path())?;
    let minilm = embed_model()?;
    let cfg = write_config(
        dir.path(),
        "worker.toml",
        &format!(
            "[model_worker]\nbatch_wait = \"5ms\"\n\
             [[model_worker.models]]\nname = \"tiny-cross\"\nkind = \"rerank\"\npath = \"{}\"\nmax_batch = 3\n\
             [[model_worker.models]]\nname = \"minilm-maxsim\"\nkind = \"rerank\"\npath = \"{}\"\n",
            cross_dir.display(),
            minilm.display()
        ),
    )?;
    let worker = Proc::model_worker(dir.path(), false, Some(&cfg))?;
    let mut c = client(&worker).await?;

    // Registry: every model with its kind, method and limits.
    let models = list(&mut c).await?;
    let find = |n: &str| models.iter().find(|m| m.name == n).cloned();
    let cross = find("tiny-cross").context("tiny-cross listed")?;
    ensure!(cross.kind == "rerank" && cross.method == "cross-encoder" && cross.max_batch == 3);
    ensure!(cross.state == "ready" && cross.device == "cpu", "{cross:?}");
    let maxsim = find("minilm-maxsim").context("maxsim listed")?;
    ensure!(
        maxsim.method == "maxsim" && maxsim.dimension == 384,
        "{maxsim:?}"
    );
    let embed = models
        .iter()
        .find(|m| m.kind == "embed")
        .context("embed model listed")?;
    // max_batch_tokens unset: chosen by device (model_worker.max_batch_tokens = 0).
    let auto_tokens = if embed.device == "cuda" { 8192 } else { 2048 };
    ensure!(
        embed.max_batch_tokens == auto_tokens && embed.max_sequence_length == 256,
        "{embed:?}"
    );

    // Truncation is flagged per text.
    let long = "retrieval augmented generation ".repeat(400);
    let r = c
        .embed(EmbedRequest {
            texts: vec!["short".into(), long.clone()],
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(r.truncated == vec![1], "truncated {:?}", r.truncated);

    // Batching: 48 concurrent single-text clients get exactly what each gets alone.
    let texts: Vec<String> = (0..48)
        .map(|i| format!("sentence number {i} about {}", PASSAGES[i % 4]))
        .collect();
    let mut alone = Vec::new();
    for t in &texts[..6] {
        let r = c
            .embed(EmbedRequest {
                texts: vec![t.clone()],
                ..Default::default()
            })
            .await?
            .into_inner();
        alone.push(r.embeddings[0].values.clone());
    }
    let page = http_get(&format!("http://{}/metrics", worker.metrics)).await?;
    let (batches0, seqs0) = (
        metric_sum(&page, "model_batch_size_count"),
        metric_sum(&page, "model_batch_size_sum"),
    );
    let calls = texts.iter().map(|t| {
        let mut c = c.clone();
        let t = t.clone();
        async move {
            c.embed(EmbedRequest {
                texts: vec![t],
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().embeddings[0].values.clone())
        }
    });
    let together: Vec<Vec<f32>> = futures::future::try_join_all(calls).await?;
    for (i, a) in alone.iter().enumerate() {
        let d = a
            .iter()
            .zip(&together[i])
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        ensure!(d < 1e-4, "text {i}: batched differs from alone by {d}");
    }
    let page = http_get(&format!("http://{}/metrics", worker.metrics)).await?;
    let batches = metric_sum(&page, "model_batch_size_count") - batches0;
    let seqs = metric_sum(&page, "model_batch_size_sum") - seqs0;
    ensure!(seqs >= 48.0, "{seqs} sequences counted");
    ensure!(
        batches < 48.0,
        "48 concurrent requests ran as {batches} batches: nothing was merged"
    );
    println!(
        "48 concurrent requests -> {batches} forward passes (mean batch {:.1})",
        seqs / batches
    );
    for m in [
        "model_queue_depth",
        "model_batch_tokens_count",
        "model_tokens_total",
        "model_queue_seconds_count",
        "model_device_seconds_count",
    ] {
        ensure!(page.contains(m), "metric {m} missing");
    }

    // Cross-encoder: the served scores match an independent forward pass, batch = single.
    let query = "What is the capital of France?";
    let passages: Vec<String> = PASSAGES.iter().map(|s| s.to_string()).collect();
    let all = c
        .rerank(RerankRequest {
            model: "tiny-cross".into(),
            query: query.into(),
            passages: passages.clone(),
        })
        .await?
        .into_inner();
    ensure!(all.scores.len() == 4 && all.model == "tiny-cross");
    let tok = model_worker::backend::encoder::bert::BertEncoder::load(
        "reference",
        &cross_dir,
        0,
        model_worker::backend::encoder::bert::HeadKind::Classifier,
    )?
    .tokenizer();
    for (i, p) in passages.iter().enumerate() {
        let one = c
            .rerank(RerankRequest {
                model: "tiny-cross".into(),
                query: query.into(),
                passages: vec![p.clone()],
            })
            .await?
            .into_inner();
        let d = (one.scores[0] - all.scores[i]).abs();
        ensure!(
            d < 1e-5,
            "passage {i}: batch {} vs single {}",
            all.scores[i],
            one.scores[0]
        );
        let seq = model_worker::backend::encoder::bert::tokenize_pairs(
            &tok,
            query,
            std::slice::from_ref(p),
        )?;
        let want = reference_score(&vars, &config, &seq[0].ids, &seq[0].type_ids)?;
        ensure!(
            (want - all.scores[i]).abs() < 1e-4,
            "passage {i}: served {} vs reference {want}",
            all.scores[i]
        );
        ensure!((0.0..=1.0).contains(&all.scores[i]));
    }

    // MaxSim over MiniLM token vectors ranks the answer first.
    let ms = c
        .rerank(RerankRequest {
            model: "minilm-maxsim".into(),
            query: query.into(),
            passages: passages.clone(),
        })
        .await?
        .into_inner();
    let best = argmax(&ms.scores);
    ensure!(best == 1, "maxsim scores {:?}", ms.scores);
    // The first rerank model is the default.
    let d = c
        .rerank(RerankRequest {
            query: query.into(),
            passages: passages.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    ensure!(d.model == "tiny-cross");

    // Bad input.
    let e = |texts: Vec<String>, model: &str| EmbedRequest {
        model: model.into(),
        texts,
        ..Default::default()
    };
    ensure!(code(c.embed(e(vec![], "")).await) == Code::InvalidArgument);
    ensure!(code(c.embed(e(vec!["x".into(); 257], "")).await) == Code::InvalidArgument);
    ensure!(code(c.embed(e(vec!["x".into()], "nope")).await) == Code::NotFound);
    // Rerank models are not embedders.
    ensure!(code(c.embed(e(vec!["x".into()], "tiny-cross")).await) == Code::NotFound);
    let rr = |q: &str, p: Vec<String>, m: &str| RerankRequest {
        model: m.into(),
        query: q.into(),
        passages: p,
    };
    ensure!(code(c.rerank(rr("q", vec![], "")).await) == Code::InvalidArgument);
    ensure!(code(c.rerank(rr(" ", vec!["p".into()], "")).await) == Code::InvalidArgument);
    ensure!(code(c.rerank(rr("q", vec!["p".into()], "nope")).await) == Code::NotFound);
    ensure!(code(c.rerank(rr("q", vec!["p".into(); 257], "")).await) == Code::InvalidArgument);
    // No generation model here.
    let g = c
        .generate(GenerateRequest {
            prompt: "hi".into(),
            ..Default::default()
        })
        .await;
    ensure!(code(g) == Code::NotFound);
    Ok(())
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_and_bad_model_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = write_config(
        dir.path(),
        "worker.toml",
        "[model_worker]\nmax_queue = 1\nmax_batch = 8\n",
    )?;
    let worker = Proc::model_worker(dir.path(), false, Some(&cfg))?;
    let c = client(&worker).await?;
    let text = "a long passage about distributed consensus ".repeat(30);
    let calls = (0..24).map(|_| {
        let mut c = c.clone();
        let texts = vec![text.clone(); 64];
        async move {
            c.embed(EmbedRequest {
                texts,
                ..Default::default()
            })
            .await
        }
    });
    let results = futures::future::join_all(calls).await;
    let refused: Vec<&tonic::Status> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    ensure!(
        results.iter().any(|r| r.is_ok()),
        "some requests must be served"
    );
    ensure!(!refused.is_empty(), "a queue of 1 must refuse some of 24");
    for s in &refused {
        ensure!(s.code() == Code::ResourceExhausted, "{s:?}");
        ensure!(
            s.metadata().get("retry-after-ms").is_some(),
            "no retry hint"
        );
    }

    // A corrupt weights file stops the worker at start with a message naming the path.
    let bad = dir.path().join("corrupt-model");
    std::fs::create_dir_all(&bad)?;
    let minilm = embed_model()?;
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(minilm.join(f), bad.join(f))?;
    }
    std::fs::write(
        bad.join("model.safetensors"),
        b"this is not a safetensors file",
    )?;
    for (kind, path) in [("embed", bad.clone()), ("rerank", bad.join("missing.gguf"))] {
        let cfg = write_config(
            dir.path(),
            "bad.toml",
            &format!(
                "[model_worker]\nlisten = \"127.0.0.1:0\"\n[telemetry]\nmetrics_listen = \"127.0.0.1:0\"\n\
                 [[model_worker.models]]\nname = \"bad\"\nkind = \"{kind}\"\npath = \"{}\"\n",
                path.display()
            ),
        )?;
        let out = std::process::Command::new(bin_dir().join("model-worker"))
            .args(["--config", &cfg.display().to_string()])
            .output()?;
        ensure!(
            !out.status.success(),
            "{kind}: worker started on a bad file"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            err.contains(&path.display().to_string()),
            "{kind}: error does not name {}: {err}",
            path.display()
        );
    }
    Ok(())
}

async fn collect(
    c: &mut ModelWorkerClient<Channel>,
    r: GenerateRequest,
) -> Result<Vec<GenerateResponse>> {
    let mut s = c.generate(r).await?.into_inner();
    let mut out = Vec::new();
    while let Some(m) = s.next().await {
        out.push(m?);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_rerank_openai_api_and_remote_backend() -> Result<()> {
    let gguf = ragcluster_tests::generate_model()?;
    // Worker A: SmolLM2 for generation and LLM reranking, with the OpenAI-compatible API.
    let dir_a = tempfile::tempdir()?;
    let cfg_a = write_config(
        dir_a.path(),
        "a.toml",
        &format!(
            "[model_worker]\nhttp_listen = \"127.0.0.1:0\"\n\
             [[model_worker.models]]\nname = \"smol-upr\"\nkind = \"rerank\"\npath = \"{0}\"\n\
             [[model_worker.models]]\nname = \"smol-judge\"\nkind = \"rerank\"\nmethod = \"llm\"\npath = \"{0}\"\n",
            gguf.display()
        ),
    )?;
    let a = Proc::model_worker(dir_a.path(), true, Some(&cfg_a))?;
    let ports: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        dir_a.path().join("model-worker").join("port.json"),
    )?)?;
    let http = ports["http"]
        .as_str()
        .context("http address in port file")?
        .to_owned();
    let mut ca = client(&a).await?;

    // UPR (the default for a GGUF reranker): log P(query | passage) ranks the answer first.
    let models = ca
        .list_models(ListModelsRequest {})
        .await?
        .into_inner()
        .models;
    ensure!(
        models
            .iter()
            .any(|m| m.name == "smol-upr" && m.method == "upr")
    );
    ensure!(
        models
            .iter()
            .any(|m| m.name == "smol-judge" && m.method == "llm")
    );
    let rr = |model: &str| RerankRequest {
        model: model.into(),
        query: "What is the capital of France?".into(),
        passages: PASSAGES.iter().map(|s| s.to_string()).collect(),
    };
    let r = ca.rerank(rr("smol-upr")).await?.into_inner();
    println!("upr rerank scores {:?}", r.scores);
    ensure!(argmax(&r.scores) == 1, "upr scores {:?}", r.scores);
    ensure!(r.scores.iter().all(|s| *s <= 0.0));
    // Pointwise yes/no: a probability per passage, in order, deterministic. SmolLM2-135M
    // answers "no" to nearly everything (scores 0.04-0.09 on these passages), so its ranking
    // is reported, not asserted.
    let r = ca.rerank(rr("smol-judge")).await?.into_inner();
    println!("llm yes/no rerank scores {:?}", r.scores);
    ensure!(r.scores.len() == 4 && r.scores.iter().all(|s| (0.0..=1.0).contains(s)));
    let again = ca.rerank(rr("smol-judge")).await?.into_inner();
    ensure!(again.scores == r.scores);

    // OpenAI-compatible HTTP: models, embeddings equal to gRPC's, errors in OpenAI's shape.
    let (status, body) = http_post_json(
        &format!("http://{http}/v1/embeddings"),
        &serde_json::json!({"input": ["Paris is in France."]}),
    )
    .await?;
    ensure!(status == 200, "{status} {body}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    let via_http: Vec<f32> = v["data"][0]["embedding"]
        .as_array()
        .context("embedding")?
        .iter()
        .map(|x| x.as_f64().unwrap_or(0.0) as f32)
        .collect();
    let via_grpc = ca
        .embed(EmbedRequest {
            texts: vec!["Paris is in France.".into()],
            ..Default::default()
        })
        .await?
        .into_inner()
        .embeddings[0]
        .values
        .clone();
    ensure!(via_http.len() == 384);
    ensure!(
        via_http
            .iter()
            .zip(&via_grpc)
            .all(|(x, y)| (x - y).abs() < 1e-6)
    );
    let (status, body) = http_post_json(
        &format!("http://{http}/v1/chat/completions"),
        &serde_json::json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await?;
    ensure!(
        status == 404 && body.contains("\"error\""),
        "{status} {body}"
    );
    let (status, _) = http_post_json(
        &format!("http://{http}/v1/chat/completions"),
        &serde_json::json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}),
    )
    .await?;
    ensure!(status == 400);
    // Asked twice: the second asking reads the prompt's keys and values and the first pick
    // after it from the prefix cache, so the same answer, every prompt token cached (OpenAI's
    // usage field).
    let mut replies = Vec::new();
    for _ in 0..2 {
        let (status, body) = http_post_json(
            &format!("http://{http}/v1/chat/completions"),
            &serde_json::json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                "temperature": 0, "max_tokens": 12}),
        )
        .await?;
        ensure!(status == 200, "{status} {body}");
        replies.push(serde_json::from_str::<serde_json::Value>(&body)?);
    }
    let text = |v: &serde_json::Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .map(str::to_owned)
    };
    let http_text = text(&replies[0]).context("content")?;
    ensure!(http_text.contains("Paris"), "{http_text:?}");
    ensure!(text(&replies[1]).as_deref() == Some(http_text.as_str()));
    let usage = &replies[1]["usage"];
    ensure!(
        usage["prompt_tokens_details"]["cached_tokens"].as_u64() == usage["prompt_tokens"].as_u64(),
        "{usage}"
    );

    // Worker B forwards Generate to A over HTTP (streamed chat and raw completions).
    let dir_b = tempfile::tempdir()?;
    let cfg_b = write_config(
        dir_b.path(),
        "b.toml",
        &format!(
            "[[model_worker.models]]\nname = \"remote-smol\"\nkind = \"generate\"\n\
             endpoint = \"http://{http}/v1\"\nremote_model = \"smollm2-135m-instruct.Q4_1\"\n\
             [[model_worker.models]]\nname = \"dead\"\nkind = \"generate\"\n\
             endpoint = \"http://127.0.0.1:{}/v1\"\n",
            ragcluster_tests::free_port()?
        ),
    )?;
    let b = Proc::model_worker(dir_b.path(), false, Some(&cfg_b))?;
    let mut cb = client(&b).await?;
    let models = cb
        .list_models(ListModelsRequest {})
        .await?
        .into_inner()
        .models;
    ensure!(
        models
            .iter()
            .any(|m| m.name == "remote-smol" && m.state == "remote" && m.method == "openai")
    );
    for raw in [false, true] {
        let req = GenerateRequest {
            model: String::new(),
            prompt: if raw {
                "The capital of France is".into()
            } else {
                "What is the capital of France?".into()
            },
            raw,
            max_tokens: 12,
            history: if raw {
                vec![]
            } else {
                vec![
                    ChatMessage {
                        role: "user".into(),
                        content: "Hello".into(),
                    },
                    ChatMessage {
                        role: "assistant".into(),
                        content: "Hello! How can I help?".into(),
                    },
                ]
            },
            ..Default::default()
        };
        let local = collect(&mut ca, req.clone()).await?;
        let remote = collect(
            &mut cb,
            GenerateRequest {
                model: "remote-smol".into(),
                ..req
            },
        )
        .await?;
        let lt: String = local.iter().map(|m| m.text.as_str()).collect();
        let rt: String = remote.iter().map(|m| m.text.as_str()).collect();
        ensure!(lt == rt, "raw={raw}: local {lt:?} vs remote {rt:?}");
        let last = remote.last().context("remote stream empty")?;
        ensure!(last.finished && last.completion_tokens > 0, "{last:?}");
        let (lsum, rsum): (f32, f32) = (
            local.iter().map(|m| m.logprob).sum(),
            remote.iter().map(|m| m.logprob).sum(),
        );
        ensure!(
            (lsum - rsum).abs() < 1e-3,
            "logprobs local {lsum} remote {rsum}"
        );
        println!("raw={raw}: remote == local: {rt:?}");
    }
    // Bad parameters are refused before any call; an unreachable server is UNAVAILABLE.
    let bad = cb
        .generate(GenerateRequest {
            model: "remote-smol".into(),
            prompt: "x".into(),
            top_p: 2.0,
            ..Default::default()
        })
        .await;
    ensure!(code(bad) == Code::InvalidArgument);
    let dead = collect(
        &mut cb,
        GenerateRequest {
            model: "dead".into(),
            prompt: "x".into(),
            ..Default::default()
        },
    )
    .await;
    let err = dead.err().context("dead endpoint must fail")?;
    let status = err.downcast_ref::<tonic::Status>().context("a status")?;
    ensure!(status.code() == Code::Unavailable, "{status:?}");
    ensure!(status.metadata().get("retry-after-ms").is_some());
    Ok(())
}

/// nomic-embed-text served beside MiniLM (a second `--embed-model`, a GGUF): the worker puts
/// the model's own task prefix before each text by `EmbedRequest.input` ("search_query: " or
/// "search_document: "), so a query and a document of the same words differ and queries find
/// their passages; MiniLM has no prefixes and gives one vector either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nomic_gguf_prefixes_by_input() -> Result<()> {
    use ragcluster_common::skip::{SkipReason, skipped};
    let gguf = ragcluster_tests::models_dir().join("nomic-embed-text-v1.5.f16.gguf");
    if !gguf.exists() {
        let why = format!("{} missing: scripts/fetch-models.sh nomic", gguf.display());
        skipped(SkipReason::NotSetUp, "nomic_gguf_prefixes_by_input", &why);
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let path = gguf.display().to_string();
    let worker = Proc::model_worker_with(dir.path(), false, None, &["--embed-model", &path])?;
    let mut c = client(&worker).await?;
    let models = list(&mut c).await?;
    let nomic = models
        .iter()
        .find(|m| m.name == "nomic-embed-text-v1.5.f16")
        .context("nomic listed under its file stem")?;
    ensure!(
        nomic.kind == "embed" && nomic.dimension == 768 && nomic.max_sequence_length == 2048,
        "{nomic:?}"
    );
    let mut embed =
        async |model: &str, texts: Vec<String>, input: EmbedInput| -> Result<Vec<Vec<f32>>> {
            let r = c
                .embed(EmbedRequest {
                    model: model.into(),
                    texts,
                    input: input.into(),
                })
                .await?
                .into_inner();
            Ok(r.embeddings.into_iter().map(|e| e.values).collect())
        };
    let q = "How does Raft elect a leader?".to_owned();
    let name = "nomic-embed-text-v1.5.f16";
    let as_query = embed(name, vec![q.clone()], EmbedInput::Query).await?;
    let as_doc = embed(name, vec![q.clone()], EmbedInput::Document).await?;
    let unspecified = embed(name, vec![q.clone()], EmbedInput::Unspecified).await?;
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    ensure!(
        dot(&as_query[0], &as_doc[0]) < 0.99,
        "the prefixes must differ"
    );
    ensure!(as_doc == unspecified, "unspecified input is a document");
    let passages = embed(
        name,
        PASSAGES.iter().map(|p| p.to_string()).collect(),
        EmbedInput::Document,
    )
    .await?;
    let best = (0..passages.len())
        .max_by(|&a, &b| {
            dot(&as_query[0], &passages[a]).total_cmp(&dot(&as_query[0], &passages[b]))
        })
        .context("passages")?;
    ensure!(best == 3, "the Raft passage ranks first, got {best}");
    let minilm = "all-MiniLM-L6-v2";
    let mq = embed(minilm, vec![q.clone()], EmbedInput::Query).await?;
    let md = embed(minilm, vec![q], EmbedInput::Document).await?;
    ensure!(mq == md, "MiniLM has no prefixes");
    Ok(())
}
