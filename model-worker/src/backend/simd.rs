//! Vectorised helpers the CPU paths share (the encoder's fused ops, the decoder's attention
//! and the sampler): dispatch to the widest vector unit this CPU has, a branch-free exp, and
//! a sixteen-lane dot product.

/// Runs `op` through `pulp`'s dispatch, compiled for the widest vector unit
/// this CPU has (AVX-512, else AVX2 + FMA), picked at run time: the binary targets baseline
/// x86-64, where plain loops get 4-wide SSE2 (measured: GELU alone took a fifth of
/// a forward). The work is a named op (the encoder's `RowsMap`, `ResidualNormRows`,
/// `EmbedRows`, `HeadJob`) rather than a closure, because `with_simd` is always inlined into the
/// dispatched function, while a closure body of some size is compiled apart as plain x86-64
/// and only called from it (the disassembly showed both LayerNorm passes running so).
#[inline(always)]
pub(crate) fn vectorized<Op: pulp::WithSimd>(op: Op) -> Op::Output {
    pulp::Arch::new().dispatch(op)
}

/// e^x for x <= 0 (softmax after subtracting the maximum): 2^n · p(r) with n = round(x /
/// ln 2), r = x - n ln 2 and p the degree-6 Taylor polynomial (relative error < 3e-7, two
/// f32 ulps; see the test). Branch-free, so a loop of it vectorises, unlike the libm call.
#[inline(always)]
pub(crate) fn exp_fast(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 0.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + c;
    }
    // 2^n from n's bits: n + 1.5 * 2^23 holds n in its low mantissa bits (exact for |n| <
    // 2^22), a float add and integer ops that vectorise where `n as i32` does not.
    let n_bits = (n + 12_582_912.0).to_bits().wrapping_sub(0x4B40_0000);
    p * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// `g * sigmoid(g)`, branch-free: e^-|g| never overflows, and the sign picks which of
/// `1 / (1 + e)` and `e / (1 + e)` is the sigmoid.
#[inline(always)]
pub(crate) fn silu(g: f32) -> f32 {
    let e = exp_fast(-g.abs());
    let inv = 1.0 / (1.0 + e);
    g * if g >= 0.0 { inv } else { e * inv }
}

/// Σ a_i b_i over the shorter of the two, in sixteen lanes, so it vectorises.
#[inline(always)]
pub(crate) fn lane_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((acc, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *acc += x * y;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest absolute difference between two equally long vectors (tests' tolerance).
#[cfg(test)]
pub(crate) fn worst_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_the_exact_function() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            // Relative to the exact value at the f32 input.
            let x = -(i as f32) / 10_000.0;
            let want = f64::from(x).exp();
            worst = worst.max(((f64::from(exp_fast(x)) - want) / want).abs());
        }
        assert!(worst < 3e-7, "max relative exp error {worst}");
        assert_eq!(exp_fast(0.0), 1.0);
        assert!(exp_fast(-200.0) >= 0.0 && exp_fast(-200.0) < 1e-37);
    }
}
