//! The CUDA llama decoder (`model_worker::backend::decoder::cuda`) against the CPU one
//! (`llama_batch`, weights dequantized to f32) on SmolLM2-135M-Instruct, on a machine with an
//! NVIDIA GPU (skipped with a message elsewhere; the decoder's unit test still compiles its
//! kernels with NVRTC there).
//!
//! The GPU holds f16 weights and rounds activations to f16 between kernels, so its greedy
//! tokens may leave the CPU's at a near-tie; what must hold is that its logits match the
//! CPU's wherever both see the same tokens. So: three prompts decode greedily on the GPU,
//! batched in one forward per step over the paged cache; the CPU then reads each prompt plus
//! the GPU's tokens in one prefill, and the logits must agree at every step (cosine > 0.999,
//! the GPU's token among the CPU's three best). Through the engine, three concurrent streams
//! must produce their tokens.

use anyhow::Result;
use model_worker::backend::decoder::cuda::{CudaLlama, PagedCache};
use model_worker::backend::decoder::llama::{GenParams, LlamaGenerator};
use model_worker::backend::decoder::sampling::{Draw, picks_near};
use model_worker::backend::decoder::{Row, Sampled, Want, logprob};
use model_worker::backend::device::Placement;
use ragcluster_tests::generate_model;
use ragcluster_tests::llama::{PROMPTS, TOKENS, argmax};

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (n(a) * n(b))
}

/// The prompts prefilled together in one forward, as the engine does: a cache per prompt
/// and the logits of each prompt's last row.
fn prefill(m: &CudaLlama, prompts: &[Vec<u32>]) -> Result<(Vec<PagedCache>, Vec<Vec<f32>>)> {
    let mut caches: Vec<PagedCache> = prompts.iter().map(|_| m.new_cache()).collect();
    let mut rows = Vec::new();
    let mut last = Vec::new();
    for (seq, p) in prompts.iter().enumerate() {
        rows.extend(p.iter().map(|&token| Row { seq, token }));
        last.push(rows.len() - 1);
    }
    let mut refs: Vec<&mut PagedCache> = caches.iter_mut().collect();
    let logits = m.forward(&rows, &mut refs, &last)?;
    Ok((caches, logits))
}

/// A decode step: one row per sequence (its next token), every row wanted.
fn decode_rows(next: &[u32]) -> (Vec<Row>, Vec<usize>) {
    let rows: Vec<Row> = next
        .iter()
        .enumerate()
        .map(|(seq, &token)| Row { seq, token })
        .collect();
    let want = (0..rows.len()).collect();
    (rows, want)
}

/// One sequence's greedy tokens, each with the logits it was chosen from.
type Decoded = Vec<(u32, Vec<f32>)>;

/// Greedy tokens and their logits for each prompt, every sequence in one forward per step.
fn gpu_greedy(m: &CudaLlama, prompts: &[Vec<u32>]) -> Result<Vec<Decoded>> {
    let (mut caches, mut logits) = prefill(m, prompts)?;
    let mut out: Vec<Decoded> = prompts.iter().map(|_| Vec::new()).collect();
    for _ in 0..TOKENS {
        let next: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
        for ((o, &t), l) in out.iter_mut().zip(&next).zip(logits) {
            o.push((t, l));
        }
        let (rows, want) = decode_rows(&next);
        let mut refs: Vec<&mut PagedCache> = caches.iter_mut().collect();
        logits = m.forward(&rows, &mut refs, &want)?;
    }
    Ok(out)
}

/// As `gpu_greedy`, with every decode step through `forward_sampled` (one greedy row per
/// sequence: the steps the decoder replays from CUDA graphs).
fn gpu_greedy_sampled(m: &CudaLlama, prompts: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    let (mut caches, logits) = prefill(m, prompts)?;
    let mut next: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
    let mut out: Vec<Vec<u32>> = prompts.iter().map(|_| Vec::new()).collect();
    for _ in 0..TOKENS {
        for (o, &t) in out.iter_mut().zip(&next) {
            o.push(t);
        }
        let (rows, want) = decode_rows(&next);
        let mut refs: Vec<&mut PagedCache> = caches.iter_mut().collect();
        let how = vec![Want::Greedy; rows.len()];
        next = m
            .forward_sampled(&rows, &mut refs, &want, &how)?
            .into_iter()
            .map(|s| match s {
                Sampled::Token { token, .. } => token,
                Sampled::Logits(l) => argmax(&l),
            })
            .collect();
    }
    Ok(out)
}

#[test]
fn cuda_decoder_matches_the_cpu_decoder() -> Result<()> {
    if !model_worker::backend::cuda::available() {
        ragcluster_common::skip::skipped(
            ragcluster_common::skip::SkipReason::NoGpu,
            "llama_cuda::cuda_decoder_matches_the_cpu_decoder",
            "no usable CUDA device",
        );
        return Ok(());
    }
    // SAFETY: the only test in this binary, before any other thread reads the environment;
    // candle reads the variable when the CPU weights are loaded below.
    #[allow(unsafe_code)]
    unsafe {
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1")
    };
    let path = generate_model()?;
    let generator = LlamaGenerator::load("smollm2", &path)?;
    let cpu = model_worker::backend::decoder::load(&path, 4096)?;
    let mut f = std::fs::File::open(&path)?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)?;
    let gpu = CudaLlama::from_gguf(&content, &mut f, 4096, 8 * 4096, 0)?;
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| generator.prompt_tokens(p, "", &[], false, ""))
        .collect::<Result<_, _>>()?;
    let decoded = gpu_greedy(&gpu, &prompts)?;
    // Decode steps replayed from CUDA graphs against the launched ones: the same greedy
    // tokens until a near-tie (after which the sequences may rightly differ).
    let replayed = gpu_greedy_sampled(&gpu, &prompts)?;
    for (i, (r, d)) in replayed.iter().zip(&decoded).enumerate() {
        for (step, (t, (dt, l))) in r.iter().zip(d).enumerate() {
            let tie = l.iter().filter(|&&x| x >= l[*dt as usize] - 1e-3).count() > 1;
            assert!(
                tie || t == dt,
                "prompt {i} step {step}: graph {t}, launched {dt}"
            );
            if t != dt {
                break;
            }
        }
    }
    for (i, p) in prompts.iter().enumerate() {
        let tokens: Vec<u32> = decoded[i].iter().map(|(t, _)| *t).collect();
        let rows: Vec<Row> = p
            .iter()
            .chain(&tokens[..TOKENS - 1])
            .map(|&token| Row { seq: 0, token })
            .collect();
        let want: Vec<usize> = (p.len() - 1..rows.len()).collect();
        let reference = cpu.forward(&rows, &mut [&mut cpu.new_cache()], &want)?;
        for (step, ((t, l), r)) in decoded[i].iter().zip(&reference).enumerate() {
            let c = cosine(l, r);
            assert!(c > 0.999, "prompt {i} step {step}: cosine {c}");
            let better = r.iter().filter(|&&x| x > r[*t as usize]).count();
            assert!(
                better < 3,
                "prompt {i} step {step}: GPU token is the CPU's #{}",
                better + 1
            );
        }
    }

    // A prompt longer than an attention tile (64 rows) against the CPU, at rows inside and
    // across tiles; then the same prompt prefilled in two forwards (the second chunk's keys
    // partly in the cache already, as when the engine splits a prompt between steps) must
    // give the one-forward logits.
    let long: Vec<u32> = prompts.concat().repeat(3);
    assert!(long.len() > 2 * 64, "{} tokens", long.len());
    let rows: Vec<Row> = long.iter().map(|&token| Row { seq: 0, token }).collect();
    let want: Vec<usize> = [0, 1, 63, 64, 65, 100, rows.len() - 1].to_vec();
    let one = gpu.forward(&rows, &mut [&mut gpu.new_cache()], &want)?;
    let reference = cpu.forward(&rows, &mut [&mut cpu.new_cache()], &want)?;
    for ((w, g), r) in want.iter().zip(&one).zip(&reference) {
        let c = cosine(g, r);
        assert!(c > 0.999, "long prompt row {w}: cosine {c} against the CPU");
    }
    let mut cache = gpu.new_cache();
    gpu.forward(&rows[..37], &mut [&mut cache], &[])?;
    let split = gpu.forward(&rows[37..], &mut [&mut cache], &[rows.len() - 38])?;
    let c = cosine(&split[0], &one[want.len() - 1]);
    assert!(c > 0.9999, "prompt prefilled in two forwards: cosine {c}");

    // Tokens picked on the device (pick_rows) against the host's picks from the same
    // device logits, rows of every kind mixed in one forward, in order.
    let p = &prompts[0];
    let rows: Vec<Row> = p.iter().map(|&token| Row { seq: 0, token }).collect();
    let want: Vec<usize> = (rows.len() - 4..rows.len()).collect();
    let target = p[1];
    let how = [
        Want::Greedy,
        Want::Logits,
        Want::LogprobOf(target),
        Want::Greedy,
    ];
    let logits = gpu.forward(&rows, &mut [&mut gpu.new_cache()], &want)?;
    let answers = gpu.forward_sampled(&rows, &mut [&mut gpu.new_cache()], &want, &how)?;
    for (i, (a, l)) in answers.iter().zip(&logits).enumerate() {
        match (how[i], a) {
            (Want::Logits, Sampled::Logits(got)) => {
                assert!(cosine(got, l) > 0.99999, "row {i}: logits");
            }
            (Want::Greedy, Sampled::Token { token, logprob: lp }) => {
                assert_eq!(*token, argmax(l), "row {i}: greedy token");
                assert!((lp - logprob(l, *token)).abs() < 1e-3, "row {i}: {lp}");
            }
            (Want::LogprobOf(t), Sampled::Token { token, logprob: lp }) => {
                assert_eq!(*token, t);
                assert!((lp - logprob(l, t)).abs() < 1e-3, "row {i}: {lp}");
            }
            (h, a) => panic!("row {i}: {h:?} answered with {a:?}"),
        }
    }
    // Sampled rows drawn on the device (sample_rows) against the host's draw with the same
    // variate on the same device logits, over temperatures, cut-offs and variates; a draw
    // within 1e-4 of a boundary (variate or cut-off) may take either side.
    let settings = [
        (1.0f32, 1.0f32),
        (0.7, 0.9),
        (1.3, 0.95),
        (0.5, 0.5),
        (2.0, 0.99),
    ];
    for (k, &(temperature, top_p)) in settings.iter().enumerate() {
        for round in 0..4 {
            let draws: Vec<Draw> = (0..want.len())
                .map(|i| Draw {
                    inv_temperature: 1.0 / temperature,
                    top_p,
                    u: ((i * 5 + k * 3 + round * 7) % 16) as f32 / 16.0 + 0.013,
                })
                .collect();
            let how: Vec<Want> = draws.iter().map(|&d| Want::Sample(d)).collect();
            let answers = gpu.forward_sampled(&rows, &mut [&mut gpu.new_cache()], &want, &how)?;
            for ((a, l), d) in answers.iter().zip(&logits).zip(&draws) {
                let near = picks_near(l, *d);
                let Sampled::Token { token, logprob: lp } = a else {
                    panic!("{d:?} answered with logits");
                };
                assert!(near.contains(token), "{d:?}: device {token}, host {near:?}");
                assert!((lp - logprob(l, *token)).abs() < 1e-3, "{d:?}: {lp}");
            }
        }
    }

    // UPR scoring on the GPU (target log-probabilities computed there) against the CPU.
    let upr_target = generator.encode("Paris is the capital.")?;
    let served_cpu = generator.continuation_logprobs(&prompts, &upr_target)?;

    // The engine on the GPU: three concurrent greedy streams.
    let served = LlamaGenerator::load_on("smollm2", &path, Placement::Cuda, 8 * 4096, 0)?;
    assert_eq!(served.placement(), Placement::Cuda);
    let params = GenParams {
        max_tokens: TOKENS,
        temperature: 0.0,
        top_p: 1.0,
        stop: vec![],
        seed: 0,
        starts_with: Vec::new(),
        starts_bias: Vec::new(),
    };
    let served_gpu = served.continuation_logprobs(&prompts, &upr_target)?;
    for (c, g) in served_cpu.iter().zip(&served_gpu) {
        assert!(
            (c - g).abs() < 0.05,
            "UPR score on the GPU {g} vs the CPU {c}"
        );
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                s.spawn(|| {
                    let mut n = 0;
                    served.generate(p, &params, |_| {
                        n += 1;
                        true
                    })?;
                    anyhow::Ok(n)
                })
            })
            .collect();
        for h in handles {
            let n = h.join().expect("stream thread")?;
            assert!(n > 0, "a stream produced no token");
        }
        anyhow::Ok(())
    })?;
    // A sampled stream (drawn on the device) repeats its tokens for its seed.
    let sampled = GenParams {
        temperature: 0.7,
        top_p: 0.9,
        seed: 5,
        ..params
    };
    let run = || -> Result<Vec<u32>> {
        let mut tokens = Vec::new();
        served.generate(&prompts[0], &sampled, |piece| {
            tokens.push(piece.token_id);
            true
        })?;
        Ok(tokens)
    };
    let first = run()?;
    assert!(!first.is_empty(), "the sampled stream produced no token");
    assert_eq!(first, run()?, "one seed, two texts");
    Ok(())
}
