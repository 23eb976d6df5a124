//! Where a generator's llama decoder runs: the CPU (`batch`, candle weights) or an
//! NVIDIA GPU (`cuda`, f16 weights and a paged KV cache). The decode engine and the
//! scoring calls see one interface: a cache per sequence and a forward over rows.

use candle_core::quantized::gguf_file;
use rayon::prelude::*;

use super::batch::{KvCache, LlamaModel};
use super::cuda::{CudaLlama, PagedCache};
use super::sampling::{Draw, greedy, logprob, picks_near};
use super::{Row, Sampled, Want, check_wants};
use crate::backend::device::Placement;
use crate::error::ModelError;

pub enum Decoder {
    Cpu(LlamaModel),
    Cuda(Box<CudaLlama>),
}

/// One sequence's keys and values, where its decoder keeps them.
pub enum Cache {
    Cpu(KvCache),
    Cuda(PagedCache),
}

impl Cache {
    /// Positions cached so far.
    pub fn len(&self) -> usize {
        match self {
            Cache::Cpu(c) => c.len(),
            Cache::Cuda(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn mismatch() -> ModelError {
    ModelError::Inference("a cache of another decoder was passed".into())
}

impl Decoder {
    pub fn placement(&self) -> Placement {
        match self {
            Decoder::Cpu(_) => Placement::Cpu,
            Decoder::Cuda(_) => Placement::Cuda,
        }
    }

    /// Whether sampled rows should be asked for as `Want::Sample` (drawn by the decoder on
    /// the device) rather than as logits the engine samples from on the host.
    pub fn samples_on_device(&self) -> bool {
        match self {
            Decoder::Cpu(_) => false,
            Decoder::Cuda(m) => m.samples_on_device(),
        }
    }

    /// Prompt rows per forward (shared by the streams still prefilling): bounds how long one
    /// step takes while long prompts come in. A GPU runs 2,048 rows of a small model in
    /// about the time of a few decode steps, so new streams reach their first token sooner.
    pub fn prefill_rows(&self) -> usize {
        match self {
            Decoder::Cpu(_) => 256,
            Decoder::Cuda(_) => 2048,
        }
    }

    pub fn new_cache(&self) -> Cache {
        match self {
            Decoder::Cpu(m) => Cache::Cpu(m.new_cache()),
            Decoder::Cuda(m) => Cache::Cuda(m.new_cache()),
        }
    }

    /// Runs `rows` (each sequence's rows contiguous, continuing its cache) and returns the
    /// logits of the rows named in `want`, in that order.
    pub fn forward(
        &self,
        rows: &[Row],
        caches: &mut [&mut Cache],
        want: &[usize],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        match self {
            Decoder::Cpu(m) => m.forward(rows, &mut cpu_caches(caches)?, want),
            Decoder::Cuda(m) => m.forward(rows, &mut cuda_caches(caches)?, want),
        }
    }

    /// As `forward`, with what each wanted row is for (`how`, one per `want`): the GPU
    /// decoder answers greedy and single-token rows on the device; on the CPU they are
    /// computed from the logits, the rows in parallel.
    pub fn forward_sampled(
        &self,
        rows: &[Row],
        caches: &mut [&mut Cache],
        want: &[usize],
        how: &[Want],
    ) -> Result<Vec<Sampled>, ModelError> {
        match self {
            Decoder::Cpu(m) => {
                check_wants(how, want.len(), m.dims.vocab)?;
                let logits = m.forward(rows, &mut cpu_caches(caches)?, want)?;
                Ok(logits
                    .into_par_iter()
                    .zip(how.par_iter())
                    .map(|(l, &h)| Sampled::from_logits(l, h))
                    .collect())
            }
            Decoder::Cuda(m) => m.forward_sampled(rows, &mut cuda_caches(caches)?, want, how),
        }
    }

    /// The decoder of a llama GGUF on `placement`. On CUDA the GPU decoder must agree with
    /// the CPU one on `probe` (prompt tokens): cosine of the logits after every probe token
    /// above 0.999 (0.995 against quantized CPU weights, whose 8-bit activations alone put
    /// SmolLM2's probe at 0.998 from the f32 model) and the GPU's top token among the CPU's
    /// top 5 at each; otherwise the load
    /// fails (the registry then falls back to the CPU under `device = "auto"`). The GPU's own
    /// token picks must then match the host's on its logits, or they are switched off.
    pub fn load<R: std::io::Read + std::io::Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        context: usize,
        placement: Placement,
        pool_tokens: usize,
        probe: &[u32],
    ) -> Result<Self, ModelError> {
        let cpu = LlamaModel::from_gguf(content, reader, context)?;
        if placement == Placement::Cpu {
            return Ok(Decoder::Cpu(cpu));
        }
        let mut gpu = CudaLlama::from_gguf(content, reader, context, pool_tokens, 0)?;
        let rows: Vec<Row> = probe.iter().map(|&token| Row { seq: 0, token }).collect();
        let want: Vec<usize> = (0..rows.len()).collect();
        let a = cpu.forward(&rows, &mut [&mut cpu.new_cache()], &want)?;
        let b = gpu.forward(&rows, &mut [&mut gpu.new_cache()], &want)?;
        let (cos, top_ok) = agreement(&a, &b);
        let floor = if cpu.quantized() { 0.995 } else { 0.999 };
        if cos <= floor || !top_ok {
            return Err(ModelError::Inference(format!(
                "the CUDA decoder disagrees with the CPU on the probe (lowest logits cosine {cos}, top tokens agree: {top_ok})"
            )));
        }
        let picks_ok = device_picks_agree(&gpu, &rows, &want, &b)?;
        if !picks_ok {
            tracing::warn!(gpu = %gpu.device_name, "device-side token picks disagree with the host's: logits are copied to the host instead");
        }
        gpu.set_device_picks(picks_ok);
        // RAGCLUSTER_DEVICE_SAMPLING=0 copies sampled rows' logits to the host sampler (an
        // escape hatch, and the other side of an A/B).
        let samples_wanted =
            picks_ok && std::env::var("RAGCLUSTER_DEVICE_SAMPLING").map_or(true, |v| v != "0");
        let samples_ok = samples_wanted && device_samples_agree(&gpu, &rows, &want, &b)?;
        if samples_wanted && !samples_ok {
            tracing::warn!(gpu = %gpu.device_name, "device-side sampling disagrees with the host's: sampled rows' logits are copied to the host instead");
        }
        gpu.set_device_samples(samples_ok);
        // RAGCLUSTER_CUDA_GRAPHS=0 launches every step kernel by kernel (an escape hatch,
        // and the other side of an A/B).
        let graphs_wanted = std::env::var("RAGCLUSTER_CUDA_GRAPHS").map_or(true, |v| v != "0");
        let graphs_ok = graphs_wanted && graph_steps_agree(&mut gpu, probe)?;
        if graphs_wanted && !graphs_ok {
            tracing::warn!(gpu = %gpu.device_name, "decode steps replayed from CUDA graphs disagree with launched ones: graphs off");
        }
        gpu.set_graphs(graphs_ok);
        let t = std::time::Instant::now();
        match gpu.prewarm_graphs() {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                graphs = n,
                ms = t.elapsed().as_millis() as u64,
                "decode-step CUDA graphs captured ahead of traffic"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "decode-step CUDA graphs could not be captured ahead: graphs off");
                gpu.set_graphs(false);
            }
        }
        tracing::info!(gpu = %gpu.device_name, cosine = cos, device_picks = picks_ok, device_sampling = samples_ok, graphs = gpu.graphs_on(), "decoder on CUDA, checked against CPU");
        Ok(Decoder::Cuda(Box::new(gpu)))
    }
}

fn cpu_caches<'a>(caches: &'a mut [&mut Cache]) -> Result<Vec<&'a mut KvCache>, ModelError> {
    caches
        .iter_mut()
        .map(|c| match &mut **c {
            Cache::Cpu(c) => Ok(c),
            Cache::Cuda(_) => Err(mismatch()),
        })
        .collect()
}

fn cuda_caches<'a>(caches: &'a mut [&mut Cache]) -> Result<Vec<&'a mut PagedCache>, ModelError> {
    caches
        .iter_mut()
        .map(|c| match &mut **c {
            Cache::Cuda(c) => Ok(c),
            Cache::Cpu(_) => Err(mismatch()),
        })
        .collect()
}

/// Whether the GPU's own token picks (`pick_rows`) match the host's on the GPU's logits of
/// the probe (`logits`): the same greedy token, and log-probabilities within 1e-3 for the
/// greedy token and for a target token per row.
fn device_picks_agree(
    gpu: &CudaLlama,
    rows: &[Row],
    want: &[usize],
    logits: &[Vec<f32>],
) -> Result<bool, ModelError> {
    let greedy_how = vec![Want::Greedy; want.len()];
    let greedy_out = gpu.forward_sampled(rows, &mut [&mut gpu.new_cache()], want, &greedy_how)?;
    // A target per row: the probe's next token (any in-vocabulary token would do).
    let target_how: Vec<Want> = (0..want.len())
        .map(|i| Want::LogprobOf(rows[(i + 1) % rows.len()].token))
        .collect();
    let target_out = gpu.forward_sampled(rows, &mut [&mut gpu.new_cache()], want, &target_how)?;
    let close = |out: &Sampled, host: Sampled| match (out, host) {
        (
            Sampled::Token { token, logprob },
            Sampled::Token {
                token: t,
                logprob: lp,
            },
        ) => *token == t && (logprob - lp).abs() <= 1e-3,
        _ => false,
    };
    Ok(logits.iter().enumerate().all(|(i, l)| {
        let g = greedy(l);
        // The GPU's own logits can differ between two forwards in the last bits; a
        // near-tie then may pick another token, which is no fault of the kernel.
        let tie = l.iter().filter(|&&x| x >= l[g as usize] - 1e-4).count() > 1;
        (tie || close(
            &greedy_out[i],
            Sampled::from_logits(l.clone(), Want::Greedy),
        )) && close(
            &target_out[i],
            Sampled::from_logits(l.clone(), target_how[i]),
        )
    }))
}

/// Whether the GPU's sampled tokens (`sample_rows`) are the host's (`sampling`) for the same
/// draws on the GPU's logits of the probe, over temperatures, cut-offs and variates. Where
/// the host's own pick changes within 1e-4 of the variate or of the cut-off, the draw sits
/// on a boundary that the GPU's logits (equal only to the last bits between forwards) may
/// cross: any of the host's picks there is accepted.
fn device_samples_agree(
    gpu: &CudaLlama,
    rows: &[Row],
    want: &[usize],
    logits: &[Vec<f32>],
) -> Result<bool, ModelError> {
    let settings = [(1.0f32, 1.0f32), (0.7, 0.9), (1.3, 0.95), (0.5, 0.5)];
    for (k, &(temperature, top_p)) in settings.iter().enumerate() {
        let draw = |i: usize| Draw {
            inv_temperature: 1.0 / temperature,
            top_p,
            // Variates spread over [0, 1), another per row and setting.
            u: ((i * 7 + k * 13) % 20) as f32 / 20.0 + 0.0237,
        };
        let how: Vec<Want> = (0..want.len()).map(|i| Want::Sample(draw(i))).collect();
        let out = gpu.forward_sampled(rows, &mut [&mut gpu.new_cache()], want, &how)?;
        for (i, (o, l)) in out.iter().zip(logits).enumerate() {
            let d = draw(i);
            let near = picks_near(l, d);
            let Sampled::Token { token, logprob: lp } = o else {
                return Ok(false);
            };
            let want_lp = logprob(l, *token);
            if !near.contains(token) || (lp - want_lp).abs() > 1e-3 {
                tracing::warn!(row = i, temperature, top_p, u = d.u, gpu = token, host = ?near, "device sample differs from the host's");
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Whether three greedy decode steps after the probe's prefill pick the same tokens (log-
/// probabilities within 1e-3) replayed from CUDA graphs as launched kernel by kernel; the
/// second and third replays check that a graph reads each step's new indexes.
fn graph_steps_agree(gpu: &mut CudaLlama, probe: &[u32]) -> Result<bool, ModelError> {
    let Some((&last, prompt)) = probe.split_last() else {
        return Ok(true);
    };
    let steps = |gpu: &mut CudaLlama, graphs: bool| -> Result<Vec<(u32, f32)>, ModelError> {
        gpu.set_graphs(graphs);
        let mut cache = gpu.new_cache();
        let rows: Vec<Row> = prompt.iter().map(|&token| Row { seq: 0, token }).collect();
        gpu.forward(&rows, &mut [&mut cache], &[])?;
        let (mut next, mut out) = (last, Vec::new());
        for _ in 0..3 {
            let row = [Row {
                seq: 0,
                token: next,
            }];
            let s = gpu.forward_sampled(&row, &mut [&mut cache], &[0], &[Want::Greedy])?;
            let (token, logprob) = match s.into_iter().next() {
                Some(Sampled::Token { token, logprob }) => (token, logprob),
                _ => return Err(ModelError::Inference("a greedy step gave logits".into())),
            };
            out.push((token, logprob));
            next = token;
        }
        Ok(out)
    };
    let launched = steps(gpu, false)?;
    // A graph that cannot be captured or replayed turns graphs off; the decoder still loads.
    let replayed = match steps(gpu, true) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "a decode step could not run from a CUDA graph");
            return Ok(false);
        }
    };
    Ok(launched
        .iter()
        .zip(&replayed)
        .all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() <= 1e-3))
}

/// Lowest cosine between matching logit rows, and whether each GPU top token is among the
/// CPU's five best.
fn agreement(cpu: &[Vec<f32>], gpu: &[Vec<f32>]) -> (f32, bool) {
    let mut worst = if cpu.len() == gpu.len() { 1f32 } else { 0f32 };
    let mut top_ok = true;
    for (a, b) in cpu.iter().zip(gpu) {
        let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        worst = worst.min(dot / (n(a) * n(b)).max(1e-12));
        let argmax = |v: &[f32]| {
            v.iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .map_or(0, |(i, _)| i)
        };
        let g = argmax(b);
        let better = a.iter().filter(|&&x| x > a[g]).count();
        top_ok &= better < 5;
    }
    (worst, top_ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_needs_close_logits_and_the_same_leaders() {
        let cpu = vec![vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]];
        let (cos, top) = agreement(&cpu, &cpu);
        assert!(cos > 0.9999 && top);
        // The GPU's best token is the CPU's sixth best: refused.
        let gpu = vec![vec![7.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0]];
        assert!(!agreement(&cpu, &gpu).1);
        assert!(agreement(&cpu, &[]).0 < 0.5);
    }
}
