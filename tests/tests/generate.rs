//! Generation through a real model-worker process serving SmolLM2-135M-Instruct (GGUF):
//! streamed tokens with log-probabilities, greedy and seeded sampling, stop strings,
//! max_tokens, concurrent streams, a client that goes away, and every bad-input status.

use std::time::Instant;

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use ragcluster_proto::v1::model_worker_client::ModelWorkerClient;
use ragcluster_proto::v1::*;
use ragcluster_tests::Proc;
use tonic::transport::Channel;

struct Out {
    text: String,
    messages: Vec<GenerateResponse>,
}

async fn generate(c: &mut ModelWorkerClient<Channel>, r: GenerateRequest) -> Result<Out> {
    let mut s = c.generate(r).await?.into_inner();
    let mut messages = Vec::new();
    while let Some(m) = s.next().await {
        messages.push(m?);
    }
    let text = messages.iter().map(|m| m.text.as_str()).collect();
    Ok(Out { text, messages })
}

fn req(prompt: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.into(),
        max_tokens,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_generation() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let worker = Proc::model_worker(dir.path(), true, None)?;
    let mut c = ModelWorkerClient::new(Channel::from_shared(worker.grpc.clone())?.connect().await?);
    let models = c
        .list_models(ListModelsRequest {})
        .await?
        .into_inner()
        .models;
    ensure!(
        models
            .iter()
            .any(|m| m.kind == "generate" && m.max_sequence_length == 4096),
        "{models:?}"
    );

    // Greedy: deterministic, knows the answer, one message per token, logprobs <= 0.
    let t = Instant::now();
    let a = generate(&mut c, req("What is the capital of France?", 24)).await?;
    let secs = t.elapsed().as_secs_f64();
    let last = a.messages.last().context("no message")?;
    ensure!(last.finished && a.messages.iter().filter(|m| m.finished).count() == 1);
    ensure!(a.text.contains("Paris"), "greedy answer: {:?}", a.text);
    ensure!(
        last.completion_tokens as usize == a.messages.len(),
        "one message per token"
    );
    ensure!(last.prompt_tokens > 5);
    ensure!(
        a.messages
            .iter()
            .all(|m| m.logprob <= 0.0 && m.logprob.is_finite())
    );
    eprintln!(
        "greedy: {} tokens in {secs:.2} s ({:.1} tokens/s incl. prompt), finish {}: {:?}",
        last.completion_tokens,
        f64::from(last.completion_tokens) / secs,
        last.finish_reason,
        a.text
    );
    let b = generate(&mut c, req("What is the capital of France?", 24)).await?;
    ensure!(a.text == b.text, "greedy is not deterministic");

    // Sampling: the same seed gives the same text.
    let sampled = |seed| GenerateRequest {
        prompt: "Write one sentence about the sea.".into(),
        max_tokens: 20,
        temperature: 0.9,
        top_p: 0.95,
        seed,
        ..Default::default()
    };
    // The second asking reads the whole prompt and the logits after it from the prefix cache.
    let s1 = generate(&mut c, sampled(7)).await?;
    let s2 = generate(&mut c, sampled(7)).await?;
    ensure!(s1.text == s2.text, "same seed, different text");
    let end = s2.messages.last().context("no message")?;
    ensure!(end.cached_tokens == end.prompt_tokens, "{end:?}");

    // max_tokens and stop strings.
    let l = generate(&mut c, req("Count from one to fifty in words.", 5)).await?;
    let ll = l.messages.last().unwrap();
    ensure!(
        ll.finish_reason == "length" && ll.completion_tokens == 5,
        "{ll:?}"
    );
    let full = generate(&mut c, req("What is the capital of France?", 24))
        .await?
        .text;
    let cut = full.find("Paris").context("Paris")?;
    let st = generate(
        &mut c,
        GenerateRequest {
            stop: vec!["Paris".into()],
            ..req("What is the capital of France?", 24)
        },
    )
    .await?;
    ensure!(
        st.text == full[..cut],
        "stop: {:?} vs {:?}",
        st.text,
        &full[..cut]
    );

    // A constrained start: the reply begins with one of the strings and goes on freely; of
    // "Yes" and "No" the one the model finds likelier (its unconstrained first log-prob)
    // is picked.
    let starting = |starts: &[&str]| GenerateRequest {
        starts_with: starts.iter().map(|s| s.to_string()).collect(),
        ..req("Is Paris the capital of France?", 12)
    };
    let mut first_logprob = Vec::new();
    for one in ["Yes", "No"] {
        let r = generate(&mut c, starting(&[one])).await?;
        ensure!(r.text.starts_with(one), "{one}: {:?}", r.text);
        first_logprob.push(r.messages[0].logprob);
    }
    let either = generate(&mut c, starting(&["Yes", "No"])).await?;
    let likelier = if first_logprob[0] >= first_logprob[1] {
        "Yes"
    } else {
        "No"
    };
    ensure!(
        either.text.starts_with(likelier),
        "{:?} after log-probs {first_logprob:?}",
        either.text
    );
    let reported = &either.messages[0].start_logprobs;
    ensure!(
        reported.len() == 2
            && reported
                .iter()
                .zip(&first_logprob)
                .all(|(a, b)| (a - b).abs() < 1e-3),
        "{:?} vs {first_logprob:?}",
        either.messages[0].start_logprobs
    );
    // A bias for the other beginning, larger than the gap, turns the pick.
    let gap = (first_logprob[0] - first_logprob[1]).abs() + 1.0;
    let other = if likelier == "Yes" { "No" } else { "Yes" };
    let turned = generate(
        &mut c,
        GenerateRequest {
            starts_bias: if other == "Yes" {
                vec![gap, 0.0]
            } else {
                vec![0.0, gap]
            },
            ..starting(&["Yes", "No"])
        },
    )
    .await?;
    ensure!(turned.text.starts_with(other), "{:?}", turned.text);
    let phrase = generate(&mut c, starting(&["The capital of France is", "No"])).await?;
    ensure!(
        phrase.text.starts_with("The capital of France is") || phrase.text.starts_with("No"),
        "{:?}",
        phrase.text
    );
    ensure!(st.messages.last().unwrap().finish_reason == "stop");

    // Several streams at once all complete; a client that leaves early is dropped.
    let mut early = c
        .generate(req("Tell me a long story about a dragon.", 500))
        .await?
        .into_inner();
    let _ = early.next().await;
    drop(early);
    let jobs = (0..4).map(|i| {
        let mut c = c.clone();
        async move { generate(&mut c, req(&format!("Name a colour. ({i})"), 8)).await }
    });
    for r in futures::future::join_all(jobs).await {
        ensure!(r?.messages.last().is_some_and(|m| m.finished));
    }

    // Bad input.
    let bad = [
        GenerateRequest {
            prompt: String::new(),
            ..req("", 8)
        },
        req("hi", 5000),
        GenerateRequest {
            temperature: -1.0,
            ..req("hi", 8)
        },
        GenerateRequest {
            temperature: f32::NAN,
            ..req("hi", 8)
        },
        GenerateRequest {
            top_p: 1.5,
            ..req("hi", 8)
        },
        GenerateRequest {
            stop: vec![String::new()],
            ..req("hi", 8)
        },
        GenerateRequest {
            stop: vec!["x".into(); 9],
            ..req("hi", 8)
        },
        GenerateRequest {
            starts_with: vec![String::new()],
            ..req("hi", 8)
        },
        GenerateRequest {
            starts_with: vec!["x".repeat(65)],
            ..req("hi", 8)
        },
        GenerateRequest {
            starts_with: vec!["x".into(); 9],
            ..req("hi", 8)
        },
        GenerateRequest {
            starts_with: vec!["Yes".into(), "No".into()],
            starts_bias: vec![1.0],
            ..req("hi", 8)
        },
        GenerateRequest {
            starts_with: vec!["Yes".into()],
            starts_bias: vec![f32::NAN],
            ..req("hi", 8)
        },
        GenerateRequest {
            prompt: "word ".repeat(5000),
            ..req("", 8)
        },
    ];
    for (i, r) in bad.into_iter().enumerate() {
        let e = c
            .generate(r)
            .await
            .err()
            .with_context(|| format!("bad case {i} accepted"))?;
        ensure!(e.code() == tonic::Code::InvalidArgument, "case {i}: {e}");
    }
    let e = c
        .generate(GenerateRequest {
            model: "nope".into(),
            ..req("hi", 8)
        })
        .await
        .err()
        .context("unknown model accepted")?;
    ensure!(e.code() == tonic::Code::NotFound, "{e}");
    Ok(())
}
