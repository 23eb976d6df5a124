use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

use super::*;

const FORMATS: [(GgmlDType, Format); 6] = [
    (GgmlDType::Q4_0, Format::Q4_0),
    (GgmlDType::Q4_1, Format::Q4_1),
    (GgmlDType::Q5_0, Format::Q5_0),
    (GgmlDType::Q8_0, Format::Q8_0),
    (GgmlDType::Q4K, Format::Q4K),
    (GgmlDType::Q6K, Format::Q6K),
];

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// A matrix quantized by candle (ggml's quantizers) and its candle-dequantized values.
fn quantized(t: GgmlDType, n: usize, k: usize, seed: u64) -> (QTensor, Vec<f32>) {
    let w = Tensor::from_vec(values(n * k, seed), (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, t).unwrap();
    let dense = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    (q, dense)
}

/// Our block decoding gives ggml's values, bit for bit, in every format.
#[test]
fn rows_decode_as_ggml_does() {
    for (t, f) in FORMATS {
        let (n, k) = (3, 512);
        let (q, dense) = quantized(t, n, k, 1);
        let m = QMatrix::from_qtensor(&q).unwrap();
        assert_eq!(m.format, f);
        let mut row = vec![0f32; k];
        for i in 0..n {
            m.dequantize_row(i, &mut row);
            assert_eq!(row, dense[i * k..(i + 1) * k], "{f:?} row {i}");
        }
    }
}

/// The integer kernels equal the decoded weights times the same 8-bit activations (up to
/// float summation order), for tiles of 1 to 4 rows and a remainder.
#[test]
fn kernels_match_the_decoded_product() {
    for (t, f) in FORMATS {
        let (n, k) = (37, 768);
        let (q, _) = quantized(t, n, k, 2);
        let w = QMatrix::from_qtensor(&q).unwrap();
        for m in [1, 2, 3, 4, 7, 8, 13] {
            let a = Q8Rows::quantize(&values(m * k, 3 + m as u64), m, k);
            let mut want = vec![0f32; n * m];
            avx2::scalar(f, &w.data, w.row_bytes, &a, &mut want);
            for (name, kernel) in avx2::kernels() {
                let mut got = vec![0f32; n * m];
                kernel(f, &w.data, w.row_bytes, &a, &mut got);
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - e).abs() <= 1e-4 * (1.0 + e.abs()),
                        "{name} {f:?} m {m} output {i}: {g} vs {e}"
                    );
                }
            }
            // The parallel product, transposed back.
            let got = w.matmul_q8(&a);
            for j in 0..n {
                for r in 0..m {
                    let (g, e) = (got[r * n + j], want[j * m + r]);
                    assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{f:?} m {m}");
                }
            }
        }
    }
}

/// Against the f32 product of the decoded weights and unrounded activations: the only
/// difference is the activations' 8-bit rounding (relative error well under 1%).
#[test]
fn products_stay_close_to_f32() {
    for (t, f) in FORMATS {
        let (n, k, m) = (64, 1024, 5);
        let (q, dense) = quantized(t, n, k, 4);
        let w = QMatrix::from_qtensor(&q).unwrap();
        let x = values(m * k, 5);
        let got = w.matmul(&x, m).unwrap();
        let (mut err, mut norm) = (0f64, 0f64);
        for r in 0..m {
            for j in 0..n {
                let e: f32 = (0..k).map(|c| x[r * k + c] * dense[j * k + c]).sum();
                err += f64::from(got[r * n + j] - e).powi(2);
                norm += f64::from(e).powi(2);
            }
        }
        let rel = (err / norm).sqrt();
        assert!(rel < 0.01, "{f:?}: relative error {rel}");
    }
}

#[test]
fn shapes_that_do_not_fit_are_refused() {
    assert!(QMatrix::new(Format::Q4K, 2, 896, vec![0; 2 * 504]).is_none());
    assert!(QMatrix::new(Format::Q8_0, 2, 64, vec![0; 3]).is_none());
    assert!(QMatrix::new(Format::Q8_0, 2, 64, vec![0; 2 * 68]).is_some());
}

/// A product over no rows (a prompt chunk whose logits nobody wants) is empty, not a panic.
#[test]
fn products_over_no_rows_are_empty() {
    let w = QMatrix::new(Format::Q8_0, 2, 64, vec![0; 2 * 68]).unwrap();
    assert!(w.matmul(&[], 0).unwrap().is_empty());
}

/// A prompt-sized product (`matmul_dense`: decoded weights, unrounded activations) equals the
/// f32 product up to float summation order, across several decoded slices.
#[test]
fn prompt_products_decode_the_weights() {
    for (t, f) in FORMATS {
        let (n, k, m) = (1100, 2048, DENSE_FROM_ROWS + 3);
        let (q, dense) = quantized(t, n, k, 6);
        let w = QMatrix::from_qtensor(&q).unwrap();
        let x = values(m * k, 7);
        let got = w.matmul(&x, m).unwrap();
        for r in 0..m {
            for j in 0..n {
                let e: f32 = (0..k).map(|c| x[r * k + c] * dense[j * k + c]).sum();
                let g = got[r * n + j];
                assert!(
                    (g - e).abs() <= 1e-3 * (1.0 + e.abs()),
                    "{f:?} {r} {j}: {g} vs {e}"
                );
            }
        }
    }
}

/// The vector rounding of activations gives the scalar one's bytes, scale and sums, ties and
/// an all-zero block included.
#[test]
fn activation_blocks_round_alike_on_every_path() {
    let mut cases: Vec<[f32; 32]> = (0..200)
        .map(|s| values(32, 100 + s).try_into().unwrap())
        .collect();
    // 127 / 2 steps of 0.5 (ties) and zeros.
    cases.push(std::array::from_fn(|i| (i as f32 - 16.0) * 0.5 + 0.25));
    cases.push(std::array::from_fn(|i| {
        if i == 3 { 127.0 } else { (i as f32) + 0.5 }
    }));
    cases.push([0.0; 32]);
    for src in &cases {
        let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
        let fast = avx2::quantize_block(src, &mut a);
        let slow = avx2::quantize_block_scalar(src, &mut b);
        assert_eq!((a, fast), (b, slow));
    }
}

/// The kernels' scale conversion gives F16C's (candle's `half`) value for every finite half.
#[test]
fn block_scales_convert_exactly() {
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h);
        if !want.is_finite() {
            continue;
        }
        let Some(got) = avx2::block_scale(&h.to_le_bytes()) else {
            return;
        };
        assert_eq!(got.to_bits(), want.to_f32().to_bits(), "half {h:#06x}");
    }
}
