//! What the CUDA paths share (the f16 and f32 encoders, the llama decoder): probing for a
//! usable GPU, NVRTC compilation, one-stream contexts, cuBLAS workspaces and f16 GEMMs, and
//! the f16 conversions every f16 kernel source starts with.
//!
//! cudarc loads libcuda / libnvrtc / libcublas at run time (`dynamic-loading`), so this
//! builds and runs on machines without CUDA: `available()` probes the libraries and a device
//! before anything else is touched, and `device = "auto"` then stays on the CPU.

// cudarc marks raw allocations, cuBLAS calls and the library probes as `unsafe`; every block
// below states why its arguments are in bounds.
#![allow(unsafe_code)]

use std::sync::Arc;

use candle_core::Tensor;
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, LaunchConfig};

use crate::error::ModelError;

/// True when the CUDA driver, NVRTC and cuBLAS libraries load and a device exists.
pub fn available() -> bool {
    // SAFETY: the probes only try to dlopen the libraries; no CUDA call happens unless all
    // three are present.
    let libs = unsafe {
        cudarc::driver::sys::is_culib_present()
            && cudarc::nvrtc::sys::is_culib_present()
            && cudarc::cublas::sys::is_culib_present()
    };
    libs && CudaContext::device_count().is_ok_and(|n| n > 0)
}

/// The name of GPU 0, when one is usable.
pub fn device_name() -> Option<String> {
    if !available() {
        return None;
    }
    CudaContext::new(0).ok()?.name().ok()
}

fn err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Inference(format!("cuda: {e}"))
}

/// One thread per element.
pub(crate) fn elems(n: usize) -> LaunchConfig {
    LaunchConfig::for_num_elems(n as u32)
}

/// NVRTC options of every kernel: PTX for the oldest architecture CUDA 13 targets, which
/// the driver JIT-compiles for newer GPUs.
pub(crate) fn nvrtc_options() -> cudarc::nvrtc::CompileOptions {
    cudarc::nvrtc::CompileOptions {
        arch: Some("compute_75"),
        ..Default::default()
    }
}

/// A context and one stream for a model whose buffers are used only on that stream. Once a
/// context has a stream of its own, cudarc records and waits on an event for every buffer
/// each kernel or copy touches (cross-stream safety); one stream already orders every use,
/// so tracking is off before any buffer exists: a decode step launches hundreds of kernels.
pub(crate) fn single_stream(
    ordinal: usize,
) -> Result<(Arc<CudaContext>, Arc<CudaStream>), cudarc::driver::DriverError> {
    let ctx = CudaContext::new(ordinal)?;
    // SAFETY: every buffer made on this context (a `CudaContext` value of its own) is made,
    // used and freed on the stream returned here only, so stream order synchronises them.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    Ok((ctx, stream))
}

/// cuBLAS's workspace for one handle: 32 MB, as cuBLAS recommends for Hopper.
const BLAS_WORKSPACE: usize = 32 << 20;

/// Gives a cuBLAS handle a workspace of its own on `stream` (kept alive by the caller, with
/// the handle): GEMMs then never allocate scratch memory, so they cost the same on every
/// call and can be captured into CUDA graphs.
pub(crate) fn set_blas_workspace(
    blas: &CudaBlas,
    stream: &Arc<CudaStream>,
) -> Result<CudaSlice<u8>, String> {
    use cudarc::driver::DevicePtr;
    // SAFETY: cuBLAS writes its scratch data before reading it.
    let ws = unsafe { stream.alloc::<u8>(BLAS_WORKSPACE) }.map_err(|e| e.to_string())?;
    {
        let (p, _g) = ws.device_ptr(stream);
        // SAFETY: the handle is live; the buffer holds BLAS_WORKSPACE bytes (device
        // allocations are 256-byte aligned) and the caller keeps it as long as the handle.
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *blas.handle(),
                p as *mut std::ffi::c_void,
                BLAS_WORKSPACE,
            )
        }
        .result()
        .map_err(|e| e.to_string())?;
    }
    Ok(ws)
}

/// Compiles kernel source with NVRTC and loads it on `ctx`.
pub(crate) fn compile(
    ctx: &Arc<CudaContext>,
    src: &str,
) -> Result<Arc<cudarc::driver::CudaModule>, String> {
    let ptx =
        cudarc::nvrtc::compile_ptx_with_opts(src, nvrtc_options()).map_err(|e| format!("{e:?}"))?;
    ctx.load_module(ptx).map_err(|e| e.to_string())
}

/// `y (rows, out) = x (rows, inp) . W` on tensor cores: f16 `x` and `W`, f32 accumulation,
/// `y` f16 or f32 (`y_type`). `W` is row-major `(inp, out)` (pre-transposed) when
/// `transposed`, else `(out, inp)` as HF and GGUF store it. Row-major meets column-major
/// cuBLAS as `y^T = W' . x^T`.
pub(crate) fn gemm_f16<Y: cudarc::driver::DeviceRepr>(
    blas: &CudaBlas,
    stream: &Arc<CudaStream>,
    (w, transposed): (&CudaSlice<u16>, bool),
    x: &CudaSlice<u16>,
    (rows, inp, out): (usize, usize, usize),
    (y, y_type): (&mut CudaSlice<Y>, cudarc::cublas::sys::cudaDataType_t),
) -> Result<(), ModelError> {
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    use std::ffi::c_void;
    let (xp, _gx) = x.device_ptr(stream);
    let (wp, _gw) = w.device_ptr(stream);
    let (yp, _gy) = y.device_ptr_mut(stream);
    let (alpha, beta) = (1f32, 0f32);
    let f16 = cudaDataType_t::CUDA_R_16F;
    let (op_w, ld_w) = if transposed {
        (CUBLAS_OP_N, out)
    } else {
        (CUBLAS_OP_T, inp)
    };
    // SAFETY: the callers' buffers hold w: inp*out halves, x: at least rows*inp halves and
    // y: at least rows*out elements of y_type; leading dimensions follow the layouts above;
    // alpha and beta are host f32 scalars as CUBLAS_COMPUTE_32F expects.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op_w,
            CUBLAS_OP_N,
            out as i32,
            rows as i32,
            inp as i32,
            (&alpha as *const f32).cast::<c_void>(),
            wp as *const c_void,
            f16,
            ld_w as i32,
            xp as *const c_void,
            f16,
            inp as i32,
            (&beta as *const f32).cast::<c_void>(),
            yp as *mut c_void,
            y_type,
            out as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(err)
}

/// A tensor's values as f16 bits on the device (weights of the f16 paths).
pub(crate) fn upload_f16(
    stream: &Arc<CudaStream>,
    t: &Tensor,
) -> Result<CudaSlice<u16>, ModelError> {
    let host: Vec<u16> = t
        .contiguous()?
        .flatten_all()?
        .to_dtype(candle_core::DType::F16)?
        .to_vec1::<half::f16>()?
        .into_iter()
        .map(half::f16::to_bits)
        .collect();
    stream.clone_htod(&host).map_err(err)
}

/// f16 <-> f32 as PTX conversions on `unsigned short` bits: no cuda_fp16.h (NVRTC then
/// needs no CUDA include directory). Every f16 kernel source starts with them.
pub(crate) const HALF_HELPERS: &str = r#"
__device__ __forceinline__ float h2f(unsigned short h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
"#;
