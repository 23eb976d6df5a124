//! Where a model runs. `cpu` always works; `cuda` needs a usable GPU (driver, NVRTC and
//! cuBLAS libraries plus a device) and fails at start without one; `auto` takes the GPU when
//! there is one and otherwise falls back to the CPU with a log line, so one config serves both
//! kinds of machines. Encoder models (embed, cross-encoder, maxsim) have a CUDA path
//! (`backend::encoder::cuda_f16`, `backend::encoder::cuda_f32`), and so do local GGUF generators
//! (`backend::decoder::cuda`).

use crate::error::ModelError;

/// Where a model will run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Cpu,
    Cuda,
}

impl Placement {
    pub fn as_str(self) -> &'static str {
        match self {
            Placement::Cpu => "cpu",
            Placement::Cuda => "cuda",
        }
    }
}

/// Resolves a configured device ("cpu", "cuda", "auto") for a model; `has_cuda_path` says
/// whether this kind of model can run on the GPU at all.
pub fn resolve(model: &str, wanted: &str, has_cuda_path: bool) -> Result<Placement, ModelError> {
    let fail = |reason: String| ModelError::Load {
        name: model.to_owned(),
        path: String::new(),
        reason,
    };
    match wanted {
        "cpu" => Ok(Placement::Cpu),
        "cuda" if !has_cuda_path => Err(fail(
            "device \"cuda\": this kind of model runs on the cpu (use \"cpu\" or \"auto\")".into(),
        )),
        "cuda" if !super::cuda::available() => Err(fail(
            "device \"cuda\": no usable CUDA device (driver, NVRTC and cuBLAS libraries and a GPU are needed; \"auto\" falls back to cpu)".into(),
        )),
        "cuda" => Ok(Placement::Cuda),
        _ if has_cuda_path && super::cuda::available() => Ok(Placement::Cuda),
        _ => {
            let why = if has_cuda_path {
                "no usable CUDA device"
            } else {
                "this kind of model runs on the cpu"
            };
            tracing::info!(model, "device auto: {why}, using cpu");
            Ok(Placement::Cpu)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolution_without_and_with_a_gpu() {
        assert_eq!(resolve("m", "cpu", true).unwrap(), Placement::Cpu);
        assert!(resolve("m", "cuda", false).is_err());
        assert_eq!(resolve("m", "auto", false).unwrap(), Placement::Cpu);
        if super::super::cuda::available() {
            assert_eq!(resolve("m", "auto", true).unwrap(), Placement::Cuda);
            assert_eq!(resolve("m", "cuda", true).unwrap(), Placement::Cuda);
        } else {
            // CI and this project's build machines: auto falls back, cuda is refused.
            assert_eq!(resolve("m", "auto", true).unwrap(), Placement::Cpu);
            let e = resolve("m", "cuda", true).unwrap_err().to_string();
            assert!(e.contains("no usable CUDA device"), "{e}");
        }
    }
}
