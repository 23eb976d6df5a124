//! The GGML block formats, decoded one row at a time (ggml's `dequantize_row_*`): the
//! reference the integer kernels are checked against, the embedding lookup, and the scalar
//! path of CPUs without AVX2.

/// A quantized weight format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// f16 scale, 32 nibbles; value = (q - 8) * d.
    Q4_0,
    /// f16 scale and minimum, 32 nibbles; value = q * d + m.
    Q4_1,
    /// f16 scale, 32 high bits, 32 nibbles; value = (q - 16) * d.
    Q5_0,
    /// f16 scale, 32 bytes; value = q * d.
    Q8_0,
    /// Super-block of 256: f16 d and dmin, 8 sub-blocks of 32 with 6-bit scale and minimum,
    /// nibbles; value = d * sc * q - dmin * m.
    Q4K,
    /// Super-block of 256: 4 low bits, 2 high bits, 16 i8 scales of 16 values, f16 d;
    /// value = d * sc * (q - 32).
    Q6K,
}

impl Format {
    /// Values per block.
    pub fn block_elems(self) -> usize {
        match self {
            Format::Q4K | Format::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q8_0 => 34,
            Format::Q4K => 144,
            Format::Q6K => 210,
        }
    }
}

/// The little-endian f16 at `b[at..at + 2]`.
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Scale and minimum of Q4_K sub-block `j` from the 12 packed bytes (ggml's
/// `get_scale_min_k4`): 6 bits each, the top two of sub-blocks 4..8 kept in the high bits of
/// the first eight bytes.
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Decodes the blocks of one row into `out` (as many values as the row holds).
pub fn dequantize(format: Format, row: &[u8], out: &mut [f32]) {
    let per = format.block_elems();
    for (b, y) in row
        .chunks_exact(format.block_bytes())
        .zip(out.chunks_exact_mut(per))
    {
        match format {
            Format::Q4_0 | Format::Q4_1 | Format::Q5_0 => small(format, b, y),
            Format::Q8_0 => {
                let d = f16_at(b, 0);
                for (y, q) in y.iter_mut().zip(&b[2..34]) {
                    *y = f32::from(*q as i8) * d;
                }
            }
            Format::Q4K => q4k(b, y),
            Format::Q6K => q6k(b, y),
        }
    }
}

/// Q4_0, Q4_1, Q5_0: element j < 16 in the low nibble of byte j, j >= 16 in the high one.
/// (Straight-line over fixed-size arrays, so it vectorizes: prompts decode every weight.)
fn small(format: Format, b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (qs, offset, min, high) = match format {
        Format::Q4_0 => (&b[2..18], -8.0, 0.0, 0u32),
        Format::Q4_1 => (&b[4..20], 0.0, f16_at(b, 2), 0),
        _ => (
            &b[6..22],
            -16.0,
            0.0,
            u32::from_le_bytes([b[2], b[3], b[4], b[5]]),
        ),
    };
    let (Ok(qs), Ok(y)) = (<&[u8; 16]>::try_from(qs), <&mut [f32; 32]>::try_from(y)) else {
        return;
    };
    let (lo, hi) = y.split_at_mut(16);
    for j in 0..16 {
        let h0 = (((high >> j) & 1) << 4) as u8;
        let h1 = (((high >> (j + 16)) & 1) << 4) as u8;
        lo[j] = (f32::from((qs[j] & 0xF) | h0) + offset) * d + min;
        hi[j] = (f32::from((qs[j] >> 4) | h1) + offset) * d + min;
    }
}

fn q4k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (pair, (q, y)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (s0, m0) = scale_min_k4(2 * pair, scales);
        let (s1, m1) = scale_min_k4(2 * pair + 1, scales);
        let (a0, b0) = (d * f32::from(s0), dmin * f32::from(m0));
        let (a1, b1) = (d * f32::from(s1), dmin * f32::from(m1));
        let (lo, hi) = y.split_at_mut(32);
        for l in 0..32 {
            lo[l] = a0 * f32::from(q[l] & 0xF) - b0;
            hi[l] = a1 * f32::from(q[l] >> 4) - b1;
        }
    }
}

/// Sub-block s (32 values at 32 s) of a Q6_K super-block: half n = s / 4, t = s % 4; low
/// bits from `ql[64 n + 32 (t & 1)..]` (high nibbles when t >= 2), high bits from
/// `qh[32 n..] >> 2 t`, scales `sc[8 n + 2 t]` (first 16) and `sc[8 n + 2 t + 1]`.
pub(super) fn q6k_sub(b: &[u8], s: usize) -> ([i8; 32], [i8; 2]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let (n, t) = (s / 4, s % 4);
    let mut q = [0i8; 32];
    for (l, q) in q.iter_mut().enumerate() {
        let lo = ql[64 * n + 32 * (t & 1) + l];
        let nib = if t < 2 { lo & 0xF } else { lo >> 4 };
        let hb = (qh[32 * n + l] >> (2 * t)) & 3;
        *q = (nib | (hb << 4)) as i8 - 32;
    }
    (q, [sc[8 * n + 2 * t] as i8, sc[8 * n + 2 * t + 1] as i8])
}

fn q6k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for s in 0..8 {
        let (q, sc) = q6k_sub(b, s);
        for (l, q) in q.iter().enumerate() {
            y[32 * s + l] = d * f32::from(sc[l / 16]) * f32::from(*q);
        }
    }
}
