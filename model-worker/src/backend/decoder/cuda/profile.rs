//! Device time per operation of a forward, for `gpubench`'s breakdown (not for serving).
//! With profiling on, a forward first launches a kernel that holds the GPU for a while, so
//! the host has issued the whole forward before the device starts it; an event is recorded
//! on the stream after each operation, and the time between consecutive events is then the
//! device's own time for that operation, without the host's launch gaps. Decode-step graphs
//! are bypassed while profiling is on.

use std::collections::BTreeMap;

use cudarc::driver::{CudaEvent, CudaFunction, LaunchConfig, PushKernelArg, sys};

use super::{CudaLlama, err};
use crate::backend::cuda::compile;
use crate::error::ModelError;

/// Holds the GPU until `ns` nanoseconds (its global timer) have passed.
const SPIN: &str = r#"
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"#;

/// How long the GPU is held at the start of a profiled forward: longer than the host needs
/// to issue the largest forward with an event after every operation.
const HOLD_NS: u64 = 30_000_000;

/// Events recorded since profiling was turned on (or last taken), and the holding kernel.
pub(super) struct Profile {
    spin: CudaFunction,
    marks: Vec<(&'static str, CudaEvent)>,
}

impl CudaLlama {
    /// Turns per-operation device timing on (compiling the holding kernel) or off.
    pub fn set_profiling(&self, on: bool) -> Result<(), ModelError> {
        let p = if on {
            let module = compile(self.stream.context(), SPIN).map_err(err)?;
            Some(Profile {
                spin: module.load_function("spin").map_err(err)?,
                marks: Vec::new(),
            })
        } else {
            None
        };
        *self.lock_profile()? = p;
        Ok(())
    }

    pub(super) fn profiling(&self) -> bool {
        self.lock_profile().is_ok_and(|p| p.is_some())
    }

    fn lock_profile(&self) -> Result<std::sync::MutexGuard<'_, Option<Profile>>, ModelError> {
        self.profile
            .lock()
            .map_err(|_| err("profile lock poisoned"))
    }

    /// Marks the end of operation `op` on the stream (when profiling). `"start"` begins a
    /// forward: the GPU is held first, and the interval before it belongs to no operation.
    pub(super) fn mark(&self, op: &'static str) -> Result<(), ModelError> {
        let mut guard = self.lock_profile()?;
        let Some(p) = guard.as_mut() else {
            return Ok(());
        };
        if op == "start" {
            let mut l = self.stream.launch_builder(&p.spin);
            l.arg(&HOLD_NS);
            // SAFETY: the kernel takes one integer and touches no memory.
            unsafe { l.launch(LaunchConfig::for_num_elems(1)) }.map_err(err)?;
        }
        let e = self
            .stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(err)?;
        e.record(&self.stream).map_err(err)?;
        p.marks.push((op, e));
        Ok(())
    }

    /// Milliseconds of device time per operation over the forwards profiled since the last
    /// call, and under `"forwards"` their count.
    pub fn take_profile(&self) -> Result<BTreeMap<&'static str, f64>, ModelError> {
        let marks = match self.lock_profile()?.as_mut() {
            Some(p) => std::mem::take(&mut p.marks),
            None => return Err(err("profiling is off")),
        };
        let mut out = BTreeMap::new();
        for pair in marks.windows(2) {
            let ((_, a), (op, b)) = (&pair[0], &pair[1]);
            if *op == "start" {
                *out.entry("forwards").or_default() += 1.0;
            } else {
                *out.entry(*op).or_default() += f64::from(a.elapsed_ms(b).map_err(err)?);
            }
        }
        if marks.first().is_some_and(|(op, _)| *op == "start") {
            *out.entry("forwards").or_default() += 1.0;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    /// The holding kernel compiles with NVRTC (no GPU needed; see `encoder::cuda_f16`'s test).
    #[test]
    fn spin_kernel_compiles_with_nvrtc() {
        // SAFETY: only tries to dlopen libnvrtc.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            ragcluster_common::skip::skipped(
                ragcluster_common::skip::SkipReason::NotSetUp,
                "decoder::cuda::profile::spin_kernel_compiles_with_nvrtc",
                "no libnvrtc on LD_LIBRARY_PATH (scripts/setup.sh fetches one)",
            );
            return;
        }
        let opts = crate::backend::cuda::nvrtc_options();
        cudarc::nvrtc::compile_ptx_with_opts(super::SPIN, opts)
            .unwrap_or_else(|e| panic!("spin kernel: {e:?}"));
    }
}
