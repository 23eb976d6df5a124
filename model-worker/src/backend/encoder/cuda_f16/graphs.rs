//! CUDA graphs for pooled encoder forwards. A forward of MiniLM issues about 50 kernels,
//! GEMMs and copies; in a serving worker issuing them took 3-7 ms of host time while the
//! device finished the work in 0.1-0.6 ms (docs/bench/2026-11-25-gpu.json, round 10). A
//! graph makes a forward three host calls: one upload of the packed inputs, one graph
//! launch, one copy back of the pooled vectors.
//!
//! A graph's launch sizes are fixed, so batches are padded to a shape: rows up to the next
//! of eight steps per power of two (at most 1/8 padding), sequences up to a power of four,
//! and the attention grid covering the longest sequence the padded rows could hold. Padding
//! rows are token 0 in no sequence (no real row reads them); padding sequences are empty.
//! Graphs are captured per shape over the workspace's buffers (the common shapes at load,
//! `prewarm`; others on first use), and dropped with the workspace when it grows. Measured
//! on an H100 (docs/bench/2026-11-26-gpu.json): issuing a forward 3.5-4.3 ms -> 0.04-0.06
//! ms of host time in the worker; 64 single-text Embed clients 6.2-7.3k -> 12.3-12.9k
//! sentences/s, p99 7-9 ms.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use cudarc::driver::{CudaGraph, sys};

use super::{CudaHalfTransformer, Shape, Workspace, err, inputs};
use crate::backend::{Packed, Seq};
use crate::error::ModelError;

/// Captured graphs kept per workspace; past this many (an unusual spread of shapes) they
/// are all dropped and captured again as needed.
const MAX_GRAPHS: usize = 512;
/// `prewarm` captures every shape of up to this many packed rows and sequences: what
/// single-text and small-batch traffic meets (about 230 graphs).
const PREWARM_ROWS: usize = 8192;
const PREWARM_SEQS: usize = 64;

/// Graphs by shape.
#[derive(Default)]
pub(super) struct Graphs(HashMap<Shape, Graph>);

/// A captured forward.
struct Graph(CudaGraph);

// SAFETY: CUDA asks that a graph be used by one thread at a time; a `Graph` lives in the
// encoder's workspace and is only touched with that workspace's lock held.
unsafe impl Send for Graph {}

/// The rows a graph is captured for: `rows` rounded up to one of eight steps per power of
/// two (at least 64).
fn padded_rows(rows: usize) -> usize {
    if rows <= 64 {
        return 64;
    }
    let step = (rows.next_power_of_two() / 16).max(8);
    rows.next_multiple_of(step)
}

/// The sequences a graph is captured for: the next power of four. Padding sequences are
/// empty (their attention and pooling blocks return at once), so coarse steps cost little
/// and keep the number of shapes (and captures) small.
fn padded_seqs(seqs: usize) -> usize {
    let mut s = 1;
    while s < seqs {
        s *= 4;
    }
    s
}

impl Shape {
    /// The graph shape a batch of `rows` packed rows in `seqs` sequences pads to.
    fn padded(rows: usize, seqs: usize, max_positions: usize) -> Self {
        let rows = padded_rows(rows);
        Shape {
            rows,
            seqs: padded_seqs(seqs),
            span: rows.min(max_positions),
        }
    }
}

impl CudaHalfTransformer {
    /// Whether pooled forwards replay graphs.
    pub fn graphs_on(&self) -> bool {
        self.graphs.load(Ordering::Relaxed)
    }

    /// Turns graph replay of pooled forwards on or off (`bert` checks the replayed output
    /// against the CPU at load before turning it on).
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on, Ordering::Relaxed);
    }

    /// `forward_mean_pooled` replayed from the graph of the batch's padded shape (captured
    /// on first use). `None`: a batch without tokens or with more sequences than the
    /// workspace holds (the caller launches it).
    pub fn pooled_by_graph(&self, batch: &[&Seq]) -> Result<Option<Vec<Vec<f32>>>, ModelError> {
        let p = Packed::new(batch);
        self.longest(&p)?;
        let (rows, n, h) = (p.ids.len(), batch.len(), self.hidden);
        if rows == 0 {
            return Ok(None);
        }
        let shape = Shape::padded(rows, n, self.max_positions);
        let mut guard = self
            .work
            .lock()
            .map_err(|_| err("workspace lock poisoned"))?;
        let w = self.workspace_for(&mut guard, shape.rows)?;
        if shape.seqs > w.seqs {
            return Ok(None);
        }
        let started = std::time::Instant::now();
        let host = inputs(&p, shape);
        self.stream
            .memcpy_htod(&host, &mut w.io.slice_mut(..host.len()))
            .map_err(err)?;
        if !w.graphs.0.contains_key(&shape) {
            self.add_graph(shape, w)?;
        }
        let g = w
            .graphs
            .0
            .get(&shape)
            .ok_or_else(|| err("no encoder graph"))?;
        g.0.launch().map_err(err)?;
        let pooled = self.timed(started, || {
            self.stream
                .clone_dtoh(&w.pooled.slice(..n * h))
                .map_err(err)
        })?;
        Ok(Some(pooled.chunks(h).map(<[f32]>::to_vec).collect()))
    }

    /// Captures the graphs of every batch shape up to `PREWARM_ROWS` rows and `PREWARM_SEQS`
    /// sequences (with graphs on), so that traffic meets no capture; returns how many.
    pub fn prewarm(&self) -> Result<usize, ModelError> {
        if !self.graphs_on() {
            return Ok(0);
        }
        let mut guard = self
            .work
            .lock()
            .map_err(|_| err("workspace lock poisoned"))?;
        let w = self.workspace_for(&mut guard, PREWARM_ROWS)?;
        let mut shapes: Vec<Shape> = Vec::new();
        let mut rows = 1;
        while rows <= PREWARM_ROWS {
            let mut seqs = 1;
            // A sequence holds at least two tokens ([CLS] and [SEP]).
            while seqs <= PREWARM_SEQS && seqs <= rows.div_ceil(2) {
                let shape = Shape::padded(rows, seqs, self.max_positions);
                if shape.seqs <= w.seqs && !shapes.contains(&shape) {
                    shapes.push(shape);
                }
                seqs = padded_seqs(seqs) + 1;
            }
            rows = padded_rows(rows) + 1;
        }
        for &shape in &shapes {
            if !w.graphs.0.contains_key(&shape) {
                self.add_graph(shape, w)?;
            }
        }
        Ok(shapes.len())
    }

    /// Captures `shape`'s graph into the workspace (making room first).
    fn add_graph(&self, shape: Shape, w: &mut Workspace) -> Result<(), ModelError> {
        if w.graphs.0.len() >= MAX_GRAPHS {
            w.graphs.0.clear();
        }
        let g = self.capture(shape, w)?;
        metrics::counter!("model_encoder_graph_captures_total").increment(1);
        w.graphs.0.insert(shape, Graph(g));
        Ok(())
    }

    /// Captures a pooled forward of `shape` over the workspace's buffers.
    fn capture(&self, shape: Shape, w: &mut Workspace) -> Result<CudaGraph, ModelError> {
        use sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        let st = &self.stream;
        st.begin_capture(CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(err)?;
        let launched = self.issue(&mut w.acts, &w.io, shape, Some(&mut w.pooled));
        // Capture ends even when a launch failed, so the stream is usable again.
        let graph = st.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        let g = graph
            .map_err(err)?
            .ok_or_else(|| err("empty encoder graph"))?;
        tracing::debug!(?shape, "encoder forward captured as a CUDA graph");
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_pad_by_at_most_an_eighth() {
        for rows in 1..5000 {
            let p = padded_rows(rows);
            assert!(p >= rows && p >= 64);
            assert!(rows <= 64 || (p - rows) * 8 <= rows, "{rows} -> {p}");
        }
        assert_eq!(padded_rows(1000), 1024);
        assert_eq!(padded_rows(1100), 1152);
        // Few shapes: eight steps per power of two.
        let shapes: std::collections::HashSet<usize> = (1..=32768).map(padded_rows).collect();
        assert!(shapes.len() <= 8 * 10, "{}", shapes.len());
    }

    #[test]
    fn padded_inputs_end_in_empty_sequences_and_token_zero() {
        let seqs = [
            Seq {
                ids: vec![101, 7, 102],
                type_ids: vec![0; 3],
                truncated: false,
            },
            Seq {
                ids: vec![101, 102],
                type_ids: vec![0; 2],
                truncated: false,
            },
        ];
        let refs: Vec<&Seq> = seqs.iter().collect();
        let p = Packed::new(&refs);
        let shape = Shape::padded(5, 3, 512);
        assert_eq!((shape.rows, shape.seqs, shape.span), (64, 4, 64));
        assert_eq!(
            [1, 2, 4, 5, 17, 64, 65].map(padded_seqs),
            [1, 4, 4, 16, 64, 64, 256]
        );
        let v = inputs(&p, shape);
        assert_eq!(v.len(), 3 * 64 + 5);
        assert_eq!(&v[..6], &[101, 7, 102, 101, 102, 0]);
        assert_eq!(&v[128..134], &[0, 1, 2, 0, 1, 0], "positions");
        assert_eq!(&v[192..], &[0, 3, 5, 5, 5], "offsets");
    }
}
