//! The batched llama decoder (`model_worker::backend::decoder::batch`) against candle's
//! quantized llama on SmolLM2-135M-Instruct, with weights dequantized to f32 so that both do
//! exact f32 arithmetic: the same logits for a prompt (up to summation order), the same greedy
//! tokens, the same tokens whether a sequence decodes alone or beside others, and the same
//! tokens through the continuous-batching engine with three streams at once, and again from
//! its prefix cache; and scoring calls that share a forward score as they do alone.
//!
//! With f16 or quantized weights (`model_worker.dequantize`) the two implementations round
//! activations at different points (candle quantizes a prefill's and a decode step's rows
//! alike, but sums attention in another order), so near-ties can break differently: on
//! "Write a haiku about databases." the top two logits after the first token differ by 0.013.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use model_worker::backend::decoder::Decoder;
use model_worker::backend::decoder::llama::{GenParams, LlamaGenerator};
use model_worker::backend::decoder::{KvCache, LlamaModel, Row, Sampled, Want, logprob};
use model_worker::backend::device::Placement;
use model_worker::error::ModelError;
use ragcluster_tests::generate_model;
use ragcluster_tests::llama::{PROMPTS, TOKENS, argmax};

/// Greedy tokens after each prompt, all sequences decoding in one forward per step.
fn greedy_batched(m: &LlamaModel, prompts: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    let mut caches: Vec<KvCache> = prompts.iter().map(|_| m.new_cache()).collect();
    let mut next = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        let rows: Vec<Row> = p.iter().map(|&token| Row { seq: 0, token }).collect();
        let logits = m.forward(&rows, &mut [&mut caches[s]], &[rows.len() - 1])?;
        next.push(argmax(&logits[0]));
    }
    let mut out: Vec<Vec<u32>> = prompts.iter().map(|_| Vec::new()).collect();
    for _ in 0..TOKENS {
        for (o, t) in out.iter_mut().zip(&next) {
            o.push(*t);
        }
        let rows: Vec<Row> = next
            .iter()
            .enumerate()
            .map(|(seq, &token)| Row { seq, token })
            .collect();
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let want: Vec<usize> = (0..rows.len()).collect();
        next = m
            .forward(&rows, &mut refs, &want)?
            .iter()
            .map(|l| argmax(l))
            .collect();
    }
    Ok(out)
}

/// candle's quantized llama, greedy, one token per forward (as the worker used to decode).
fn greedy_candle(w: &mut ModelWeights, prompt: &[u32]) -> Result<(Vec<f32>, Vec<u32>)> {
    w.clear_kv_cache();
    let input = Tensor::new(prompt, &Device::Cpu)?.unsqueeze(0)?;
    let first = w.forward(&input, 0)?.squeeze(0)?.to_vec1::<f32>()?;
    let mut logits = first.clone();
    let mut out = Vec::new();
    for step in 0..TOKENS {
        let next = argmax(&logits);
        out.push(next);
        let input = Tensor::new(&[next], &Device::Cpu)?.unsqueeze(0)?;
        logits = w
            .forward(&input, prompt.len() + step)?
            .squeeze(0)?
            .to_vec1::<f32>()?;
    }
    Ok((first, out))
}

#[test]
fn batched_decoder_matches_candle_quantized_llama() -> Result<()> {
    // SAFETY: the only test in this binary, before any other thread reads the environment;
    // candle reads the variable when the weights are loaded below.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1")
    };
    let path = generate_model()?;
    let generator = LlamaGenerator::load("smollm2", &path)?;
    let model = model_worker::backend::decoder::load(&path, 4096)?;
    assert!(
        !model.quantized(),
        "CANDLE_DEQUANTIZE_ALL leaves f32 weights"
    );
    // A thread of its own reads the variable afresh (candle keeps it per thread): unset
    // there, the weights stay quantized.
    let quantized = std::thread::scope(|s| {
        s.spawn(|| {
            #[allow(unsafe_code)]
            // SAFETY: no other thread of this test reads the environment meanwhile.
            unsafe {
                std::env::remove_var("CANDLE_DEQUANTIZE_ALL")
            };
            let q = model_worker::backend::decoder::load(&path, 4096).map(|m| m.quantized());
            #[allow(unsafe_code)]
            // SAFETY: as above.
            unsafe {
                std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1")
            };
            q
        })
        .join()
        .expect("loader thread")
    })?;
    assert!(quantized, "without the variable the weights stay quantized");
    let mut f = std::fs::File::open(&path)?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)?;
    let mut candle = ModelWeights::from_gguf(content, &mut f, &Device::Cpu)?;
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| generator.prompt_tokens(p, "", &[], false, ""))
        .collect::<Result<_, _>>()?;

    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| greedy_batched(&model, std::slice::from_ref(p)).map(|mut v| v.remove(0)))
        .collect::<Result<_>>()?;
    let together = greedy_batched(&model, &prompts)?;
    for (i, p) in prompts.iter().enumerate() {
        let (reference, tokens) = greedy_candle(&mut candle, p)?;
        let mut cache = model.new_cache();
        let rows: Vec<Row> = p.iter().map(|&token| Row { seq: 0, token }).collect();
        let ours = model.forward(&rows, &mut [&mut cache], &[rows.len() - 1])?;
        let diff = reference
            .iter()
            .zip(&ours[0])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff < 1e-3,
            "prompt {:?}: logits differ by {diff}",
            PROMPTS[i]
        );
        assert_eq!(alone[i], tokens, "prompt {:?}: alone vs candle", PROMPTS[i]);
        assert_eq!(together[i], alone[i], "prompt {:?}: batched", PROMPTS[i]);
    }

    // Through the engine: three streams at once, each greedy, stopping at end of sequence.
    let params = GenParams {
        max_tokens: TOKENS,
        temperature: 0.0,
        top_p: 1.0,
        stop: vec![],
        seed: 0,
        starts_with: Vec::new(),
        starts_bias: Vec::new(),
    };
    let streamed: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                s.spawn(|| {
                    let mut ids = Vec::new();
                    generator
                        .generate(p, &params, |piece| {
                            ids.push(piece.token_id);
                            true
                        })
                        .map(|_| ids)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("stream thread"))
            .collect::<Result<_, _>>()
    })?;
    for (i, ids) in streamed.iter().enumerate() {
        assert!(!ids.is_empty());
        assert_eq!(
            ids[..],
            alone[i][..ids.len()],
            "prompt {:?}: engine",
            PROMPTS[i]
        );
    }

    // The prefix cache: a stream leaves its keys and values and its first pick when it ends,
    // so each prompt asked again reads all of it from there, and decodes the same tokens; a
    // prompt that begins the same way (the next turn of a chat) reads the shared beginning; a
    // generator without a cache computes every token, to the same result.
    let run = |g: &LlamaGenerator, p: &[u32]| -> Result<(Vec<u32>, usize)> {
        let (mut ids, mut cached) = (Vec::new(), usize::MAX);
        g.generate(p, &params, |piece| {
            ids.push(piece.token_id);
            cached = piece.cached_tokens;
            true
        })?;
        Ok((ids, cached))
    };
    for (i, p) in prompts.iter().enumerate() {
        let (ids, cached) = run(&generator, p)?;
        assert_eq!(cached, p.len(), "prompt {:?}: cached", PROMPTS[i]);
        assert_eq!(ids, streamed[i], "prompt {:?}: from the cache", PROMPTS[i]);
    }
    let system = "You answer in one short sentence.";
    let turn = |q: &str| {
        generator.prompt_tokens(
            q,
            system,
            &[("user", PROMPTS[0]), ("assistant", "Paris.")],
            false,
            "",
        )
    };
    let (first, second) = (turn(PROMPTS[1])?, turn(PROMPTS[2])?);
    let shared = first
        .iter()
        .zip(&second)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        shared > 20,
        "the system prompt and the first turn: {shared} tokens"
    );
    run(&generator, &first)?;
    let (ids, cached) = run(&generator, &second)?;
    assert_eq!(cached, shared);
    let fresh = greedy_batched(&model, std::slice::from_ref(&second))?.remove(0);
    assert_eq!(ids[..], fresh[..ids.len()], "second turn from the cache");
    let uncached = LlamaGenerator::load_on("smollm2", &path, Placement::Cpu, 0, 0)?;
    for p in [&second, &second] {
        let (ids, cached) = run(&uncached, p)?;
        assert_eq!(cached, 0, "no prefix cache");
        assert_eq!(ids[..], fresh[..ids.len()]);
    }

    // Scoring (UPR, LLM relevance): prompts sharing a forward score as they do alone.
    let target = generator.encode("Paris is the capital.")?;
    let together = generator.continuation_logprobs(&prompts, &target)?;
    let yes_together = generator.yes_probabilities(&prompts)?;
    for (i, p) in prompts.iter().enumerate() {
        let alone = generator.continuation_logprobs(std::slice::from_ref(p), &target)?[0];
        assert!(
            (alone - together[i]).abs() < 1e-4,
            "prompt {i}: {alone} vs {}",
            together[i]
        );
        let yes = generator.yes_probabilities(std::slice::from_ref(p))?[0];
        assert!(
            (yes - yes_together[i]).abs() < 1e-4,
            "prompt {i}: P(yes) {yes} vs {}",
            yes_together[i]
        );
    }

    // The decoder's answers per wanted row (what the engine and the scoring calls ask for):
    // on the CPU, computed from the same logits `forward` returns.
    let decoder = Decoder::Cpu(model_worker::backend::decoder::load(&path, 4096)?);
    let p = &prompts[0];
    let rows: Vec<Row> = p.iter().map(|&token| Row { seq: 0, token }).collect();
    let want: Vec<usize> = vec![rows.len() - 3, rows.len() - 2, rows.len() - 1];
    let how = [Want::Logits, Want::LogprobOf(target[0]), Want::Greedy];
    let answers = decoder.forward_sampled(&rows, &mut [&mut decoder.new_cache()], &want, &how)?;
    let logits = model.forward(&rows, &mut [&mut model.new_cache()], &want)?;
    assert_eq!(answers[0], Sampled::Logits(logits[0].clone()));
    assert_eq!(
        answers[1],
        Sampled::Token {
            token: target[0],
            logprob: logprob(&logits[1], target[0])
        }
    );
    let next = argmax(&logits[2]);
    assert_eq!(
        answers[2],
        Sampled::Token {
            token: next,
            logprob: logprob(&logits[2], next)
        }
    );
    // UPR's score is the mean log-probability of the target's tokens after the prompt.
    let mut teacher: Vec<Row> = rows.clone();
    teacher.extend(
        target[..target.len() - 1]
            .iter()
            .map(|&token| Row { seq: 0, token }),
    );
    let at: Vec<usize> = (rows.len() - 1..teacher.len()).collect();
    let forced = model.forward(&teacher, &mut [&mut model.new_cache()], &at)?;
    let mean = forced
        .iter()
        .zip(&target)
        .map(|(l, &t)| logprob(l, t))
        .sum::<f32>()
        / target.len() as f32;
    assert!(
        (mean - together[0]).abs() < 1e-4,
        "UPR {mean} vs {}",
        together[0]
    );
    let vocab = model.dims.vocab;
    let bad = decoder.forward_sampled(
        &rows,
        &mut [&mut decoder.new_cache()],
        &want[..1],
        &[Want::LogprobOf(vocab as u32)],
    );
    assert!(
        matches!(bad, Err(ModelError::InvalidArgument(_))),
        "a target outside the vocabulary is refused: {bad:?}"
    );
    Ok(())
}
