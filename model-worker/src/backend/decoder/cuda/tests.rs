/// The decoder's kernels compile with NVRTC (no GPU needed; see `encoder::cuda_f16`'s test).
#[test]
fn kernels_compile_with_nvrtc() {
    // SAFETY: only tries to dlopen libnvrtc.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        ragcluster_common::skip::skipped(
            ragcluster_common::skip::SkipReason::NotSetUp,
            "decoder::cuda::kernels_compile_with_nvrtc",
            "no libnvrtc on LD_LIBRARY_PATH (scripts/setup.sh fetches one)",
        );
        return;
    }
    let opts = crate::backend::cuda::nvrtc_options();
    cudarc::nvrtc::compile_ptx_with_opts(super::kernel_source(), opts)
        .unwrap_or_else(|e| panic!("llama kernels: {e:?}"));
}
