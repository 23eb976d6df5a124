//! Rows a caller needs one token of, answered on the device: `pick_rows` computes the
//! greedy token or a target token's log-probability per row, and `sample_rows` draws a
//! sampled row's token (`sampling`'s rule, the host's variate), so a decode step or a
//! scoring call copies two numbers per row instead of the vocabulary's logits (196 KB).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{CudaLlama, THREADS, Workspace, blocks, err};
use crate::backend::decoder::{Sampled, Want};
use crate::error::ModelError;

/// Threads per `sample_rows` block (a power of two; 48 logits each for SmolLM2).
const SAMPLE_THREADS: u32 = 1024;
/// Nucleus candidates `sample_rows` holds in shared memory (its `SAMPLE_CAP`).
const SAMPLE_CAP: u32 = 4096;

fn is_sample(h: &Want) -> bool {
    matches!(h, Want::Sample(_))
}

impl CudaLlama {
    /// Each wanted row's result as `how` asks: one `pick_rows` launch on the device for
    /// greedy and single-token rows (every row, then only the two numbers of those rows come
    /// back), logits copied for the rest, one transfer per run of consecutive logit rows.
    pub(super) fn sampled(
        &self,
        w: &mut Workspace,
        how: &[Want],
    ) -> Result<Vec<Sampled>, ModelError> {
        let n = how.len();
        let on_device = self.device_picks && how.iter().any(|h| *h != Want::Logits);
        if !on_device || (!self.device_samples && how.iter().any(is_sample)) {
            return self.answered_on_host(w, how);
        }
        // One launch for every row: a greedy (or logits) row's target is the kernel's
        // "greedy" sentinel; the targets go up only when some row has one.
        let targets: Vec<u32> = how
            .iter()
            .map(|h| match *h {
                Want::LogprobOf(t) => t,
                _ => u32::MAX,
            })
            .collect();
        let any_target = how.iter().any(|h| matches!(h, Want::LogprobOf(_)));
        let targets = any_target
            .then(|| self.stream.clone_htod(&targets).map_err(err))
            .transpose()?;
        self.launch_pick(w, n, targets.as_ref())?;
        self.launch_samples(w, how)?;
        let picked = self.read_picks(w, n)?;
        self.assemble(w, how, |i| picked[i])
    }

    /// `sample_rows` over `how`'s rows when any is `Want::Sample` (after `pick_rows`, whose
    /// answers the other rows keep): the draws go up as (1/T, top-p, u, 0) per row, zeros
    /// for the rows it skips.
    fn launch_samples(&self, w: &mut Workspace, how: &[Want]) -> Result<(), ModelError> {
        if !how.iter().any(is_sample) {
            return Ok(());
        }
        let draws: Vec<f32> = how
            .iter()
            .flat_map(|h| match *h {
                Want::Sample(d) => [d.inv_temperature, d.top_p, d.u, 0.0],
                _ => [0.0; 4],
            })
            .collect();
        let draws = self.stream.clone_htod(&draws).map_err(err)?;
        let vocab = self.dims.vocab as i32;
        let mut l = self.stream.launch_builder(&self.k.sample_rows);
        l.arg(&w.logits)
            .arg(&vocab)
            .arg(&draws)
            .arg(&mut w.picked)
            .arg(&mut w.picked_logprob);
        let cfg = LaunchConfig {
            grid_dim: (how.len() as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 4 * (2 * SAMPLE_THREADS + 2 * SAMPLE_CAP),
        };
        // SAFETY: one block per wanted row (how.len() <= the workspace's rows), each reading
        // its row of vocab logits written by `head` and its four draw values; shared memory
        // is the kernel's two reduction arrays of SAMPLE_THREADS words and its SAMPLE_CAP
        // candidates (weight and id); check_wants bounded every draw.
        unsafe { l.launch(cfg) }.map_err(err)?;
        Ok(())
    }

    /// Launches `pick_rows` over the first `n` rows of the logits (targets on the device).
    pub(super) fn launch_pick(
        &self,
        w: &mut Workspace,
        n: usize,
        targets: Option<&CudaSlice<u32>>,
    ) -> Result<(), ModelError> {
        let vocab = self.dims.vocab as i32;
        let null = 0u64;
        let mut l = self.stream.launch_builder(&self.k.pick_rows);
        l.arg(&w.logits).arg(&vocab);
        match targets {
            Some(t) => l.arg(t),
            None => l.arg(&null),
        };
        l.arg(&mut w.picked).arg(&mut w.picked_logprob);
        // SAFETY: one block per wanted row (n <= the workspace's rows), each reading its row
        // of vocab logits written by `head`; targets hold one per row, each checked against
        // the vocabulary (forward_sampled) or the greedy sentinel; shared memory is the two
        // reduction arrays of THREADS words.
        unsafe { l.launch(blocks(n, 2 * THREADS as usize)) }.map_err(err)?;
        Ok(())
    }

    /// The first `n` picks (token, log-probability) of the last `pick_rows`.
    fn read_picks(&self, w: &Workspace, n: usize) -> Result<Vec<(u32, f32)>, ModelError> {
        let tokens = self.stream.clone_dtoh(&w.picked.slice(..n)).map_err(err)?;
        let logprobs = self
            .stream
            .clone_dtoh(&w.picked_logprob.slice(..n))
            .map_err(err)?;
        Ok(tokens.into_iter().zip(logprobs).collect())
    }

    /// Each row's result after a graph step, which ran `pick_rows` (greedy) over all `how`
    /// rows and left every row's logits in the workspace.
    pub(super) fn after_greedy_picks(
        &self,
        w: &mut Workspace,
        how: &[Want],
    ) -> Result<Vec<Sampled>, ModelError> {
        if !self.device_picks
            || how.iter().all(|h| *h == Want::Logits)
            || (!self.device_samples && how.iter().any(is_sample))
        {
            return self.answered_on_host(w, how);
        }
        self.launch_samples(w, how)?;
        let picked = self.read_picks(w, how.len())?;
        self.assemble(w, how, |i| picked[i])
    }

    /// Every row answered on the host from its logits (copied in one transfer).
    fn answered_on_host(&self, w: &Workspace, how: &[Want]) -> Result<Vec<Sampled>, ModelError> {
        let logits = self.copy_logits(w, 0..how.len())?;
        Ok(logits
            .into_iter()
            .zip(how)
            .map(|(l, &h)| Sampled::from_logits(l, h))
            .collect())
    }

    /// The results in `how`'s order: picked rows from `picked(i)`, logit rows copied in runs.
    fn assemble(
        &self,
        w: &Workspace,
        how: &[Want],
        picked: impl Fn(usize) -> (u32, f32),
    ) -> Result<Vec<Sampled>, ModelError> {
        let mut out = Vec::with_capacity(how.len());
        let mut i = 0;
        while i < how.len() {
            if how[i] == Want::Logits {
                let end = (i..how.len())
                    .find(|&j| how[j] != Want::Logits)
                    .unwrap_or(how.len());
                out.extend(
                    self.copy_logits(w, i..end)?
                        .into_iter()
                        .map(Sampled::Logits),
                );
                i = end;
            } else {
                let (token, logprob) = picked(i);
                out.push(Sampled::Token { token, logprob });
                i += 1;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    /// The launch sizes shared memory from `SAMPLE_CAP`; the kernel indexes by its own.
    #[test]
    fn sample_cap_matches_the_kernel() {
        let define = format!("#define SAMPLE_CAP {}\n", super::SAMPLE_CAP);
        assert!(super::super::kernel_source().contains(&define));
        assert!(super::SAMPLE_THREADS.is_power_of_two() && super::SAMPLE_THREADS <= 1024);
    }
}
