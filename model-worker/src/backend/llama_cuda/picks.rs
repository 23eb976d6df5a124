//! Rows a caller needs one token of, answered on the device: `pick_rows` computes the
//! greedy token or a target token's log-probability per row, so a greedy decode step or a
//! scoring call copies two numbers per row instead of the vocabulary's logits.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{CudaLlama, THREADS, Workspace, blocks, err};
use crate::backend::llama_batch::{Sampled, Want};
use crate::error::ModelError;

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
        if !on_device {
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
        let picked = self.pick(w, n, any_target.then_some(&targets[..]))?;
        self.assemble(w, how, |i| picked[i])
    }

    /// `pick_rows` over the first `n` wanted rows: (token, log-probability) per row; a row's
    /// target `u32::MAX` (or no targets) asks for its greedy token.
    fn pick(
        &self,
        w: &mut Workspace,
        n: usize,
        targets: Option<&[u32]>,
    ) -> Result<Vec<(u32, f32)>, ModelError> {
        let targets = targets
            .map(|t| self.stream.clone_htod(t).map_err(err))
            .transpose()?;
        self.launch_pick(w, n, targets.as_ref())?;
        self.read_picks(w, n)
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
        w: &Workspace,
        how: &[Want],
    ) -> Result<Vec<Sampled>, ModelError> {
        if !self.device_picks || how.iter().all(|h| *h == Want::Logits) {
            return self.answered_on_host(w, how);
        }
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
