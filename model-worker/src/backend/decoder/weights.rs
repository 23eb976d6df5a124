//! How the CPU decoder holds and applies a weight matrix (`model_worker.dequantize`):
//! dequantized at load ("f32", "f16": candle tensors, decode steps through `skinny`, prompts
//! through candle's GEMM) or kept quantized ("none": our integer kernels in `quant` for the
//! formats they know, candle's `QMatMul` for any other). The token embedding table follows
//! the same choice: kept quantized, a row is decoded when a token is looked up.

use std::io::{Read, Seek, SeekFrom};
use std::sync::Arc;

use candle_core::quantized::{QMatMul, QTensor, gguf_file};
use candle_core::{CpuStorage, Device, Module, Storage, Tensor};

use super::quant::{DENSE_FROM_ROWS, Format, Q8Rows, QMatrix};
use super::skinny;
use crate::error::ModelError;

fn infer(e: candle_core::Error) -> ModelError {
    ModelError::Inference(e.to_string())
}

/// One weight matrix `(n, k)`.
pub(super) enum Matrix {
    Candle(QMatMul),
    Quant(Arc<QMatrix>),
}

/// Whether quantized weights stay quantized: candle's own rule (`QMatMul::from_arc`), from
/// the environment variables the model worker sets from its config before any thread.
fn keep_quantized() -> bool {
    std::env::var_os("CANDLE_DEQUANTIZE_ALL").is_none()
        && std::env::var_os("CANDLE_DEQUANTIZE_ALL_F16").is_none()
}

/// Tensor `name`: for our kernels (`read_quant`), else candle's tensor.
fn read<R: Read + Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    name: &str,
) -> Result<Result<Arc<QMatrix>, QTensor>, ModelError> {
    if let Some(m) = read_quant(content, reader, name)? {
        return Ok(Ok(Arc::new(m)));
    }
    Ok(Err(content
        .tensor(reader, name, &Device::Cpu)
        .map_err(infer)?))
}

/// Tensor `name` of the file read as it is stored, when the weights stay quantized and our
/// kernels know its format (no candle tensor in between: the bytes are held once).
fn read_quant<R: Read + Seek>(
    content: &gguf_file::Content,
    reader: &mut R,
    name: &str,
) -> Result<Option<QMatrix>, ModelError> {
    let Some(info) = content.tensor_infos.get(name) else {
        return Err(ModelError::Inference(format!("GGUF tensor {name} missing")));
    };
    let (Some(format), Ok((n, k))) = (Format::of(info.ggml_dtype), info.shape.dims2()) else {
        return Ok(None);
    };
    if !keep_quantized() || !QMatrix::supported() || !k.is_multiple_of(format.block_elems()) {
        return Ok(None);
    }
    let mut data = vec![0u8; n * k / format.block_elems() * format.block_bytes()];
    let io = |e: std::io::Error| ModelError::Inference(format!("GGUF tensor {name}: {e}"));
    reader
        .seek(SeekFrom::Start(content.tensor_data_offset + info.offset))
        .map_err(io)?;
    reader.read_exact(&mut data).map_err(io)?;
    QMatrix::new(format, n, k, data)
        .map(Some)
        .ok_or_else(|| ModelError::Inference(format!("GGUF tensor {name}: bad size")))
}

impl Matrix {
    /// Matrix `name` of the file: kept quantized for our kernels, or as candle holds it
    /// (dequantized when the config says so; quantized in a format our kernels lack).
    pub(super) fn read<R: Read + Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        name: &str,
    ) -> Result<Self, ModelError> {
        Ok(match read(content, reader, name)? {
            Ok(m) => Self::Quant(m),
            Err(t) => Self::Candle(QMatMul::from_qtensor(t).map_err(infer)?),
        })
    }

    /// Whether the weights stay quantized.
    pub(super) fn quantized(&self) -> bool {
        matches!(self, Self::Quant(_) | Self::Candle(QMatMul::QTensor(_)))
    }

    /// `x` (rows x cols) times the matrix: our kernels, the skinny kernel for dense weights
    /// and few rows (decode steps), candle for the rest.
    pub(super) fn apply(
        &self,
        x: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let w = match self {
            Self::Quant(q) => return q.matmul(x, rows).map_err(infer),
            Self::Candle(w) => w,
        };
        if rows <= skinny::MAX_ROWS
            && let QMatMul::Tensor(t) | QMatMul::TensorF16(t) = w
            && let Some(y) = skinny_matmul(t, x, rows, cols)
        {
            return Ok(y);
        }
        let t = Tensor::from_slice(x, (rows, cols), &Device::Cpu).map_err(infer)?;
        w.forward(&t)
            .and_then(|y| y.flatten_all()?.to_vec1::<f32>())
            .map_err(infer)
    }
}

/// The skinny kernel over a dense candle weight `(n, cols)`, read in place.
fn skinny_matmul(w: &Tensor, x: &[f32], rows: usize, cols: usize) -> Option<Vec<f32>> {
    let (n, k) = w.dims2().ok()?;
    if k != cols {
        return None;
    }
    let (storage, layout) = w.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    let weights = match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => skinny::Weights::F32(&v[start..end]),
        Storage::Cpu(CpuStorage::F16(v)) => skinny::Weights::F16(&v[start..end]),
        _ => return None,
    };
    skinny::matmul(weights, n, k, x, rows)
}

/// Weight matrices applied to the same input. When candle holds them dense (dequantized
/// weights) they are stacked into one matrix at load, so one matmul call (one pass of the
/// thread pool) replaces two or three; quantized ones stay apart and share one quantization
/// of the input.
pub(super) enum Group {
    Fused { w: Matrix, widths: Vec<usize> },
    Apart(Vec<Matrix>),
}

impl Group {
    pub(super) fn new(parts: Vec<Matrix>) -> Result<Self, ModelError> {
        let dense: Option<Vec<&Tensor>> = parts
            .iter()
            .map(|p| match p {
                Matrix::Candle(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) => Some(t),
                _ => None,
            })
            .collect();
        let Some(ts) = dense.filter(|ts| ts.iter().all(|t| t.dtype() == ts[0].dtype())) else {
            return Ok(Self::Apart(parts));
        };
        let widths = ts
            .iter()
            .map(|t| t.dim(0))
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(infer)?;
        let stacked = Tensor::cat(&ts, 0).map_err(infer)?;
        let w = match parts[0] {
            Matrix::Candle(QMatMul::TensorF16(_)) => QMatMul::TensorF16(stacked),
            _ => QMatMul::Tensor(stacked),
        };
        Ok(Self::Fused {
            w: Matrix::Candle(w),
            widths,
        })
    }

    /// Each matrix's output for `x` (rows x cols), row-major.
    pub(super) fn apply(
        &self,
        x: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let (w, widths) = match self {
            Self::Apart(ws)
                if rows < DENSE_FROM_ROWS && ws.iter().all(|w| matches!(w, Matrix::Quant(_))) =>
            {
                let a = Q8Rows::quantize(x, rows, cols);
                return Ok(ws
                    .iter()
                    .filter_map(|w| match w {
                        Matrix::Quant(q) => Some(q.matmul_q8(&a)),
                        Matrix::Candle(_) => None,
                    })
                    .collect());
            }
            Self::Apart(ws) => return ws.iter().map(|w| w.apply(x, rows, cols)).collect(),
            Self::Fused { w, widths } => (w, widths),
        };
        let y = w.apply(x, rows, cols)?;
        let total: usize = widths.iter().sum();
        let mut out: Vec<Vec<f32>> = widths
            .iter()
            .map(|w| Vec::with_capacity(w * rows))
            .collect();
        for row in y.chunks_exact(total) {
            let mut at = 0;
            for (o, w) in out.iter_mut().zip(widths) {
                o.extend_from_slice(&row[at..at + w]);
                at += w;
            }
        }
        Ok(out)
    }
}

/// The token embedding table: f32 rows, or the file's quantized rows decoded on lookup
/// (Qwen2.5 0.5B: 544 MB of f32 against 93 MB of Q5_0).
pub(super) enum Embedding {
    Dense { rows: Vec<f32>, width: usize },
    Quant(Arc<QMatrix>),
}

impl Embedding {
    /// Table `name` of the file, kept quantized as the matrices are. With tied embeddings
    /// the output matrix is the same bytes (`tied`).
    pub(super) fn read<R: Read + Seek>(
        content: &gguf_file::Content,
        reader: &mut R,
        name: &str,
    ) -> Result<Self, ModelError> {
        match read(content, reader, name)? {
            Ok(m) => Ok(Self::Quant(m)),
            Err(t) => Self::dense(&t),
        }
    }

    /// The output matrix of a model whose file has none: the table itself.
    pub(super) fn tied<R: Read + Seek>(
        &self,
        content: &gguf_file::Content,
        reader: &mut R,
        name: &str,
    ) -> Result<Matrix, ModelError> {
        match self {
            Self::Quant(m) => Ok(Matrix::Quant(m.clone())),
            Self::Dense { .. } => Matrix::read(content, reader, name),
        }
    }

    fn dense(t: &QTensor) -> Result<Self, ModelError> {
        let (_, width) = t.shape().dims2().map_err(infer)?;
        let rows = t
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .map_err(infer)?;
        Ok(Self::Dense { rows, width })
    }

    /// Rows in the table.
    pub(super) fn vocab(&self) -> usize {
        match self {
            Self::Dense { rows, width } => rows.len() / width,
            Self::Quant(m) => m.n,
        }
    }

    /// Appends row `t` (t < vocab) to `out`.
    pub(super) fn push_row(&self, t: usize, out: &mut Vec<f32>) {
        match self {
            Self::Dense { rows, width } => out.extend_from_slice(&rows[t * width..(t + 1) * width]),
            Self::Quant(m) => {
                let at = out.len();
                out.resize(at + m.k, 0.0);
                m.dequantize_row(t, &mut out[at..]);
            }
        }
    }
}
