//! The model worker's prefix cache (`model_worker.prefix_cache_mb`) against none, one worker
//! after the other on the same requests, the generator on the CPU. Two loads:
//! - `examples`: answer prompts as a flow with two worked examples asks them (the default
//!   system prompt, the examples as earlier turns, three contexts and a CMU QA question),
//!   so every request shares the system prompt and the examples and differs after them;
//! - `chat`: conversations of several turns, each turn's prompt holding the earlier turns
//!   and the model's replies to them.
//!
//! Each load runs with 1 and with `--clients` concurrent clients; reported per worker: time to
//! first token p50 / p90, wall seconds, prompt and cached tokens, and how many replies equal
//! the uncached worker's. Prints one JSON object.

use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use futures::StreamExt;
use ragcluster_common::prompt::{
    DEFAULT_PROMPT, DEFAULT_STOP, DEFAULT_SYSTEM, Example, chunk_tag, example_turns, fill,
};
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::{ChatMessage, GenerateRequest};
use ragcluster_tests::{Proc, datasets_dir, percentile};
use serde_json::{Value, json};
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Answer prompts of the `examples` load (CMU QA questions spread over the file).
    #[arg(long, default_value_t = 24)]
    questions: usize,
    /// Conversations of the `chat` load, and turns per conversation.
    #[arg(long, default_value_t = 4)]
    chats: usize,
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Concurrent clients of the second run of each load.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Tokens generated per request (greedy).
    #[arg(long, default_value_t = 32)]
    tokens: u32,
    /// MiB of the cached worker's prefix cache.
    #[arg(long, default_value_t = 256)]
    cache_mb: usize,
}

/// The two worked examples of `docs/eval/flow-examples2.toml` (from the sample documents).
fn examples() -> Vec<Example> {
    let title = "Baking sourdough bread";
    vec![
        Example {
            title: title.into(),
            context:
                "Shape the loaf, let it proof in the refrigerator overnight, then bake it in a \
                      preheated Dutch oven at 250 °C: twenty minutes with the lid on, twenty more \
                      with the lid off until the crust is deep brown."
                    .into(),
            question: "At what temperature is the loaf baked?".into(),
            answer: "250 °C".into(),
        },
        Example {
            title: title.into(),
            context: "Sourdough bread rises with a culture of wild yeast and lactic acid bacteria \
                      instead of commercial yeast. The starter is fed with flour and water every \
                      day and kept at room temperature."
                .into(),
            question: "Is the starter kept in the refrigerator?".into(),
            answer: "No.".into(),
        },
    ]
}

/// `n` CMU QA questions spread over the file, each with three 500-character passages of its
/// gold article as contexts: (question, contexts).
fn questions(n: usize) -> Result<Vec<(String, String)>> {
    let dir = datasets_dir().join("cmuqa");
    let mut articles = std::collections::HashMap::new();
    for l in std::fs::read_to_string(dir.join("corpus.jsonl"))?.lines() {
        let v: Value = serde_json::from_str(l)?;
        let id = v["_id"].as_str().context("_id")?.to_owned();
        articles.insert(
            id,
            (
                v["title"].as_str().unwrap_or("").to_owned(),
                v["text"].as_str().unwrap_or("").to_owned(),
            ),
        );
    }
    let qa: Vec<Value> = std::fs::read_to_string(dir.join("qa.jsonl"))?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let step = (qa.len() / n.max(1)).max(1);
    let mut out = Vec::new();
    for q in qa.iter().step_by(step).take(n) {
        let doc = q["gold_doc_ids"][0].as_str().unwrap_or_default();
        let Some((title, text)) = articles.get(doc) else {
            continue;
        };
        let chars: Vec<char> = text.chars().collect();
        let contexts: String = (0..3)
            .map(|i| {
                let at = (chars.len() * i / 3).min(chars.len());
                let piece: String = chars[at..(at + 500).min(chars.len())].iter().collect();
                chunk_tag(i + 1, title, "", &piece)
            })
            .collect();
        out.push((
            q["question"].as_str().unwrap_or_default().to_owned(),
            contexts,
        ));
    }
    Ok(out)
}

/// One generation's reply, time to first token (s), prompt and cached tokens.
struct Reply {
    text: String,
    ttft: f64,
    prompt: u32,
    cached: u32,
}

async fn ask(mut c: ModelWorkerClient<Channel>, r: GenerateRequest) -> Result<Reply> {
    let t = Instant::now();
    let mut s = c.generate(r).await?.into_inner();
    let (mut text, mut ttft, mut prompt, mut cached) = (String::new(), None, 0, 0);
    while let Some(m) = s.next().await {
        let m = m?;
        ttft.get_or_insert(t.elapsed().as_secs_f64());
        text.push_str(&m.text);
        if m.finished {
            (prompt, cached) = (m.prompt_tokens, m.cached_tokens);
        }
    }
    Ok(Reply {
        text,
        ttft: ttft.context("no token")?,
        prompt,
        cached,
    })
}

/// The `examples` load's requests.
fn answer_requests(qs: &[(String, String)], tokens: u32) -> Vec<GenerateRequest> {
    let history = example_turns(DEFAULT_PROMPT, &examples());
    qs.iter()
        .map(|(question, contexts)| GenerateRequest {
            system: DEFAULT_SYSTEM.into(),
            history: history.clone(),
            prompt: fill(
                DEFAULT_PROMPT,
                &[("contexts", contexts.trim_end()), ("question", question)],
            ),
            max_tokens: tokens,
            stop: vec![DEFAULT_STOP.into()],
            ..Default::default()
        })
        .collect()
}

/// Runs `requests` over `clients` concurrent clients (each takes the next request).
async fn run_requests(
    c: &ModelWorkerClient<Channel>,
    requests: Vec<GenerateRequest>,
    clients: usize,
) -> Result<(Vec<Reply>, f64)> {
    let t = Instant::now();
    let replies = futures::stream::iter(requests.into_iter().map(|r| ask(c.clone(), r)))
        .buffered(clients)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    Ok((replies, t.elapsed().as_secs_f64()))
}

/// The `chat` load: `chats` conversations of `turns` turns, the conversations concurrently
/// over `clients` clients, each turn after the previous one's reply.
async fn run_chats(
    c: &ModelWorkerClient<Channel>,
    qs: &[(String, String)],
    a: &Args,
    clients: usize,
) -> Result<(Vec<Reply>, f64)> {
    let t = Instant::now();
    let chat = |k: usize| {
        let c = c.clone();
        let turns: Vec<(String, String)> =
            qs.iter().skip(k * a.turns).take(a.turns).cloned().collect();
        let tokens = a.tokens;
        async move {
            let mut history: Vec<ChatMessage> = Vec::new();
            let mut replies = Vec::new();
            for (i, (question, contexts)) in turns.iter().enumerate() {
                // The first turn brings the contexts; later ones only ask.
                let prompt = if i == 0 {
                    fill(
                        DEFAULT_PROMPT,
                        &[("contexts", contexts.trim_end()), ("question", question)],
                    )
                } else {
                    question.clone()
                };
                let r = ask(
                    c.clone(),
                    GenerateRequest {
                        system: DEFAULT_SYSTEM.into(),
                        history: history.clone(),
                        prompt: prompt.clone(),
                        max_tokens: tokens,
                        ..Default::default()
                    },
                )
                .await?;
                history.push(ChatMessage {
                    role: "user".into(),
                    content: prompt,
                });
                history.push(ChatMessage {
                    role: "assistant".into(),
                    content: r.text.clone(),
                });
                replies.push(r);
            }
            anyhow::Ok(replies)
        }
    };
    let all = futures::stream::iter((0..a.chats).map(chat))
        .buffered(clients)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    Ok((
        all.into_iter().flatten().collect(),
        t.elapsed().as_secs_f64(),
    ))
}

fn summary(replies: &[Reply], wall: f64, reference: Option<&[Reply]>) -> Value {
    let mut ttft: Vec<f64> = replies.iter().map(|r| r.ttft * 1e3).collect();
    let prompt: u32 = replies.iter().map(|r| r.prompt).sum();
    let cached: u32 = replies.iter().map(|r| r.cached).sum();
    let mut v = json!({
        "requests": replies.len(),
        "ttft_p50_ms": percentile(&mut ttft, 50.0),
        "ttft_p90_ms": percentile(&mut ttft, 90.0),
        "wall_s": wall,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
    });
    if let Some(r) = reference {
        v["same_reply_as_uncached"] = json!(
            replies
                .iter()
                .zip(r)
                .filter(|(a, b)| a.text == b.text)
                .count()
        );
    }
    v
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    // Each run asks questions of its own, so no run finds its prompts cached by an earlier
    // one: per client setting, `questions` answer prompts, then `chats * turns` chat turns.
    let per_run = a.questions + a.chats * a.turns;
    let qs = questions(2 * per_run)?;
    anyhow::ensure!(
        qs.len() == 2 * per_run,
        "CMU QA gave {} questions",
        qs.len()
    );
    let model = std::env::var("RAGCLUSTER_GENERATE_MODEL").unwrap_or_default();
    let mut out = serde_json::Map::new();
    // (load, clients) -> the uncached worker's replies, to compare with.
    let mut reference: std::collections::HashMap<String, Vec<Reply>> = Default::default();
    for mb in [0, a.cache_mb] {
        let dir = tempfile::tempdir()?;
        let cfg = dir.path().join("mw.toml");
        std::fs::write(
            &cfg,
            format!("[model_worker]\nprefix_cache_mb = {mb}\nmax_concurrent_generations = 16\n"),
        )?;
        let worker = Proc::model_worker(dir.path(), true, Some(&cfg))?;
        let c = ModelWorkerClient::new(Channel::from_shared(worker.grpc.clone())?.connect().await?);
        // Warm-up on a prompt of its own (no shared beginning with the loads beyond the
        // template's first tokens).
        ask(
            c.clone(),
            GenerateRequest {
                prompt: "Say hello.".into(),
                max_tokens: 4,
                ..Default::default()
            },
        )
        .await?;
        let mut row = serde_json::Map::new();
        for (run, clients) in [1, a.clients].into_iter().enumerate() {
            let own = &qs[run * per_run..(run + 1) * per_run];
            let key = format!("examples_clients_{clients}");
            let reqs = answer_requests(&own[..a.questions], a.tokens);
            let (replies, wall) = run_requests(&c, reqs, clients).await?;
            row.insert(
                key.clone(),
                summary(&replies, wall, reference.get(&key).map(Vec::as_slice)),
            );
            reference.entry(key).or_insert(replies);
            let key = format!("chat_clients_{clients}");
            let (replies, wall) = run_chats(&c, &own[a.questions..], &a, clients).await?;
            row.insert(
                key.clone(),
                summary(&replies, wall, reference.get(&key).map(Vec::as_slice)),
            );
            reference.entry(key).or_insert(replies);
            eprintln!("prefix_cache_mb {mb}, {clients} client(s): done");
        }
        out.insert(format!("prefix_cache_mb_{mb}"), Value::Object(row));
    }
    out.insert("model".into(), json!(model));
    out.insert("tokens_per_request".into(), json!(a.tokens));
    out.insert("questions".into(), json!(a.questions));
    out.insert("chats".into(), json!(a.chats));
    out.insert("turns".into(), json!(a.turns));
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
