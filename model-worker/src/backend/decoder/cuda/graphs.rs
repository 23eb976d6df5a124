//! CUDA graphs for decode steps. A step of n streams (one row per sequence) launches nine
//! kernels and GEMMs per layer, 272 launches for SmolLM2, each a few microseconds of host
//! work while the GPU's share of a one-row launch is about as short. So a step's launches
//! are captured once per row count over fixed index buffers and replayed as one graph
//! launch per step; only the index arrays are copied in first. The attention kernel's
//! shared memory is sized for the whole context in a graph, since a sequence's span grows
//! with every replay. Measured (docs/bench/2026-11-25-gpu.json): a one-row step 2.3 -> 2.0
//! ms, one stream +10-15% tokens/s, 8 streams +7-10%, 64 streams unchanged.

use std::collections::HashMap;

use cudarc::driver::{CudaGraph, sys};

use super::attention::fits;
use super::{CudaLlama, Indexes, PagedCache, Plan, Workspace, err};
use crate::backend::decoder::{Row, Sampled, Want};
use crate::error::ModelError;

/// The largest decode step (rows) replayed from a graph; larger ones are launched directly.
pub(super) const GRAPH_ROWS: usize = 64;

/// A captured step.
pub(super) struct Graph(CudaGraph);

// SAFETY: CUDA asks that a graph be used by one thread at a time; a `Graph` lives in the
// decoder's workspace and is only touched with that workspace's lock held.
unsafe impl Send for Graph {}

/// Graphs by row count, over index buffers of `GRAPH_ROWS` rows that every replay refills.
pub(super) struct Decode {
    io: Indexes,
    by_rows: HashMap<usize, Graph>,
}

impl CudaLlama {
    /// Whether pure decode steps replay graphs.
    pub fn graphs_on(&self) -> bool {
        self.graphs
    }

    /// Turns decode-step graphs on (where the attention fits, `fits`) or off (every step
    /// launches its kernels).
    pub fn set_graphs(&mut self, on: bool) {
        let threads = self
            .row_threads
            .unwrap_or(2 * super::attention::ROW_THREADS);
        self.graphs = on && fits(&self.dims, threads);
    }

    /// A decode step replayed from a graph: when `rows` hold one row per sequence in
    /// order, every row is wanted and none asks for a target token's log-probability.
    /// `None`: not such a step (the caller launches it directly).
    pub(super) fn decode_step(
        &self,
        rows: &[Row],
        caches: &mut [&mut PagedCache],
        want: &[usize],
        how: &[Want],
    ) -> Result<Option<Vec<Sampled>>, ModelError> {
        let n = rows.len();
        let decode = self.graphs
            && !self.profiling()
            && (1..=GRAPH_ROWS).contains(&n)
            && caches.len() == n
            && want.len() == n
            && rows.iter().enumerate().all(|(i, r)| r.seq == i)
            && want.iter().enumerate().all(|(i, &w)| w == i)
            && !how.iter().any(|h| matches!(h, Want::LogprobOf(_)));
        if !decode {
            return Ok(None);
        }
        let plan = self.plan(rows, caches, want)?;
        let mut guard = self
            .work
            .lock()
            .map_err(|_| err("workspace lock poisoned"))?;
        let w = self.workspace_for(&mut guard, GRAPH_ROWS)?;
        self.with_decode(w, |dec, w| self.replay(&plan, dec, w))?;
        let out = self.after_greedy_picks(w, how)?;
        drop(guard);
        for c in caches.iter_mut() {
            c.len += 1;
        }
        Ok(Some(out))
    }

    /// Captures the decode-step graph of every row count up to `GRAPH_ROWS` (with graphs
    /// on), so that no step pays for a capture while streams join one by one; returns how
    /// many. Measured on an H100 (docs/bench/2026-11-26-gpu.json): without it, 64 streams
    /// arriving together met a new row count, and a capture, in many of their first steps.
    pub fn prewarm_graphs(&self) -> Result<usize, ModelError> {
        if !self.graphs || self.profiling() {
            return Ok(0);
        }
        let mut guard = self
            .work
            .lock()
            .map_err(|_| err("workspace lock poisoned"))?;
        let w = self.workspace_for(&mut guard, GRAPH_ROWS)?;
        self.with_decode(w, |dec, w| {
            for n in 1..=GRAPH_ROWS {
                self.graph_for(n, dec, w)?;
            }
            Ok(GRAPH_ROWS)
        })
    }

    /// Runs `f` with the workspace's decode buffers and graphs (made on first use), which
    /// go back into the workspace whatever `f` returns.
    fn with_decode<T>(
        &self,
        w: &mut Workspace,
        f: impl FnOnce(&mut Decode, &mut Workspace) -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        let mut dec = match w.decode.take() {
            Some(d) => d,
            None => Box::new(self.decode_buffers()?),
        };
        let result = f(&mut dec, w);
        w.decode = Some(dec);
        result
    }

    /// The graph of a step of `n` rows, captured if it is not yet.
    fn graph_for<'d>(
        &self,
        n: usize,
        dec: &'d mut Decode,
        w: &mut Workspace,
    ) -> Result<&'d Graph, ModelError> {
        if !dec.by_rows.contains_key(&n) {
            let g = self.capture(n, &dec.io, w)?;
            dec.by_rows.insert(n, Graph(g));
        }
        dec.by_rows.get(&n).ok_or_else(|| err("no decode graph"))
    }

    /// Index buffers for `GRAPH_ROWS` rows, each sequence's page table up to the context.
    fn decode_buffers(&self) -> Result<Decode, ModelError> {
        let st = &self.stream;
        let pages = GRAPH_ROWS * self.dims.context.div_ceil(super::PAGE);
        let zeros = |n: usize| st.alloc_zeros::<i32>(n).map_err(err);
        let want: Vec<i32> = (0..GRAPH_ROWS as i32).collect();
        Ok(Decode {
            io: Indexes {
                tokens: st.alloc_zeros::<u32>(GRAPH_ROWS).map_err(err)?,
                pos: zeros(GRAPH_ROWS)?,
                slots: zeros(GRAPH_ROWS)?,
                tstart: zeros(GRAPH_ROWS)?,
                tables: zeros(pages)?,
                want: st.clone_htod(&want).map_err(err)?,
                longest: self.dims.context,
                tiles: None,
            },
            by_rows: HashMap::new(),
        })
    }

    /// Copies the step's indexes in and launches its graph (captured on first use).
    fn replay(&self, plan: &Plan, dec: &mut Decode, w: &mut Workspace) -> Result<(), ModelError> {
        let st = &self.stream;
        let n = plan.tokens.len();
        let io = &mut dec.io;
        if plan.tables.len() > io.tables.len() {
            return Err(err("page tables beyond the context"));
        }
        st.memcpy_htod(&plan.tokens, &mut io.tokens).map_err(err)?;
        st.memcpy_htod(&plan.pos, &mut io.pos).map_err(err)?;
        st.memcpy_htod(&plan.slots, &mut io.slots).map_err(err)?;
        st.memcpy_htod(&plan.tstart, &mut io.tstart).map_err(err)?;
        st.memcpy_htod(&plan.tables, &mut io.tables).map_err(err)?;
        self.graph_for(n, dec, w)?.0.launch().map_err(err)
    }

    /// Captures a step of `n` rows: the layers, the final norm, the logits and the greedy
    /// picks (every row's logits stay in the workspace for rows that sample on the host).
    fn capture(&self, n: usize, io: &Indexes, w: &mut Workspace) -> Result<CudaGraph, ModelError> {
        use sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        let st = &self.stream;
        st.begin_capture(CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(err)?;
        let launched = (|| {
            self.layers_forward(n, io, w)?;
            self.rms_norm(&mut w.hn, &w.x, &self.norm, Some(&io.want), n)?;
            self.head(n, w)?;
            self.launch_pick(w, n, None)
        })();
        // Capture ends even when a launch failed, so the stream is usable again.
        let graph = st.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        let g = graph
            .map_err(err)?
            .ok_or_else(|| err("empty decode graph"))?;
        tracing::debug!(rows = n, "decode step captured as a CUDA graph");
        Ok(g)
    }
}
