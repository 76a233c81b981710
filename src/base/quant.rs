//! Block-quantized tensors (GGUF's `Q4_0` … `Q8_K`) to `f32`, on the CPU.
//!
//! Each block is read as llama.cpp's `ggml-common.h` lays it out (little-endian, f16 scales) and
//! computed in the order the `gguf` Python package's `gguf.quants.dequantize` computes it (f16
//! scales widened to f32; a sub-block's scale `d * sc` rounded to f32 before it multiplies a
//! quant; `a * q - m` / `d * q + m` as two roundings, never fused), so that the two agree bit for
//! bit: `tests/fixtures/quants.gguf` (written by that package) holds each type beside its
//! reference dequantization, and the tests here compare every value's bits.

use half::f16;

use crate::base::error::{Error, Result};
use crate::base::types::DType;

/// Dequantizes `bytes`, whole blocks of `dtype`, into `f32` values (a block's elements in order).
///
/// A float dtype (`f32`, `f16`, `bf16`, `f64`) is converted too, each value rounded to the
/// nearest `f32`; integer dtypes are refused. [`Error::LengthMismatch`] when `bytes` is not a
/// whole number of blocks (elements), [`Error::InvalidArgument`] for a dtype with no `f32`
/// reading.
///
/// ```
/// use strata::{quant, DType};
/// // One Q8_0 block: scale 0.5 (f16 0x3800), quants 0, 1, ..., 31.
/// let mut block = vec![0x00, 0x38];
/// block.extend((0..32).map(|q: u8| q));
/// let x = quant::dequantize(DType::Q8_0, &block).unwrap();
/// assert_eq!(x.len(), 32);
/// assert_eq!((x[0], x[3], x[31]), (0.0, 1.5, 15.5));
/// assert!(quant::dequantize(DType::Q8_0, &block[..20]).is_err());
/// ```
pub fn dequantize(dtype: DType, bytes: &[u8]) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    dequantize_into(dtype, bytes, &mut out)?;
    Ok(out)
}

/// [`dequantize`] appending to `out` (which is left as it was on an error).
///
/// ```
/// use strata::{quant, DType};
/// let mut out = vec![1.0];
/// quant::dequantize_into(DType::F16, &[0x00, 0x3c], &mut out).unwrap(); // f16 1.0
/// assert_eq!(out, vec![1.0, 1.0]);
/// ```
pub fn dequantize_into(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) -> Result<()> {
    let (elems, size) = dtype.block().unwrap_or((1, dtype.size_of()));
    if bytes.len() % size != 0 {
        return Err(Error::LengthMismatch {
            got: bytes.len() as u64,
            expected: (bytes.len() / size * size) as u64,
            what: format!("{dtype} data is whole blocks of {size} bytes"),
        });
    }
    let start = out.len();
    out.reserve(bytes.len() / size * elems);
    let block: fn(&[u8], &mut Vec<f32>) = match dtype {
        DType::F32 => |b, o| o.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::F16 => |b, o| o.push(f16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::BF16 => |b, o| o.push(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::F64 => |b, o| o.push(f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32),
        DType::Q4_0 => q4_0,
        DType::Q4_1 => q4_1,
        DType::Q5_0 => q5_0,
        DType::Q5_1 => q5_1,
        DType::Q8_0 => q8_0,
        DType::Q2K => q2_k,
        DType::Q3K => q3_k,
        DType::Q4K => q4_k,
        DType::Q5K => q5_k,
        DType::Q6K => q6_k,
        DType::Q8K => q8_k,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "{dtype} has no f32 reading: dequantize takes a float or block-quantized dtype"
            )))
        }
    };
    for b in bytes.chunks_exact(size) {
        block(b, out);
    }
    debug_assert_eq!(out.len() - start, bytes.len() / size * elems);
    Ok(())
}

/// An f16 at `b[at..at + 2]`, widened to f32.
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Quant `i` (0..32) of a 32-element block whose quants are nibbles of `qs`: element `i` is the
/// low nibble of `qs[i]` for the first 16, the high nibble of `qs[i - 16]` for the rest.
fn nibble32(qs: &[u8], i: usize) -> u8 {
    (qs[i % 16] >> (4 * (i / 16))) & 0x0f
}

/// Bit `i` of a 32-bit little-endian mask at `b[at..at + 4]`.
fn bit32(b: &[u8], at: usize, i: usize) -> u8 {
    (b[at + i / 8] >> (i % 8)) & 1
}

fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half(b, 0);
    out.extend((0..32).map(|i| d * (nibble32(&b[2..], i) as i8 - 8) as f32));
}

fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (half(b, 0), half(b, 2));
    out.extend((0..32).map(|i| d * nibble32(&b[4..], i) as f32 + m));
}

fn q5_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half(b, 0);
    out.extend((0..32).map(|i| {
        let q = nibble32(&b[6..], i) | (bit32(b, 2, i) << 4);
        d * (q as i8 - 16) as f32
    }));
}

fn q5_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (half(b, 0), half(b, 2));
    out.extend((0..32).map(|i| {
        let q = nibble32(&b[8..], i) | (bit32(b, 4, i) << 4);
        d * q as f32 + m
    }));
}

fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = half(b, 0);
    out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
}

/// Element `i` (0..256) of a super-block whose 2-bit quants are packed four to a byte of `qs`
/// (64 bytes): each half of 128 elements reads 32 bytes, the crumb at bits `2s..2s + 2` of byte
/// `l` holding element `32s + l` of the half.
fn crumb256(qs: &[u8], i: usize) -> u8 {
    let (half, s, l) = (i / 128, (i % 128) / 32, i % 32);
    (qs[half * 32 + l] >> (2 * s)) & 3
}

fn q2_k(b: &[u8], out: &mut Vec<f32>) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (half(b, 80), half(b, 82));
    for (sub, &sc) in scales.iter().enumerate() {
        let dl = d * (sc & 0x0f) as f32;
        let ml = dmin * (sc >> 4) as f32;
        out.extend((0..16).map(|j| dl * crumb256(qs, sub * 16 + j) as f32 - ml));
    }
}

fn q3_k(b: &[u8], out: &mut Vec<f32>) {
    let (hmask, qs, scales) = (&b[..32], &b[32..96], &b[96..108]);
    let d = half(b, 108);
    for sub in 0..16 {
        // Low 4 bits from bytes 0..8 (two to a byte), high 2 bits from bytes 8..12 (four to one).
        let lo = (scales[sub % 8] >> (4 * (sub / 8))) & 0x0f;
        let hi = (scales[8 + sub % 4] >> (2 * (sub / 4))) & 0x03;
        let dl = d * ((lo | (hi << 4)) as i8 - 32) as f32;
        out.extend((sub * 16..sub * 16 + 16).map(|i| {
            // The high bit clear subtracts 4 (llama.cpp stores the complement).
            let high = (hmask[i % 32] >> (i / 32)) & 1;
            dl * (crumb256(qs, i) as i8 - (((high ^ 1) << 2) as i8)) as f32
        }));
    }
}

/// Scale and minimum of sub-block `j` (0..8) of a `Q4_K` / `Q5_K` super-block, from its 12
/// bytes of packed 6-bit values.
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 0x3f, s[j + 4] & 0x3f)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30), (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30))
    }
}

/// Element `i` (0..256) of a super-block whose 4-bit quants fill 128 bytes: each 64 elements
/// read 32 bytes, low nibbles first.
fn nibble256(qs: &[u8], i: usize) -> u8 {
    let (chunk, s, l) = (i / 64, (i % 64) / 32, i % 32);
    (qs[chunk * 32 + l] >> (4 * s)) & 0x0f
}

fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin, scales, qs) = (half(b, 0), half(b, 2), &b[4..16], &b[16..144]);
    for sub in 0..8 {
        let (sc, m) = scale_min_k4(scales, sub);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        out.extend((sub * 32..sub * 32 + 32).map(|i| dl * nibble256(qs, i) as f32 - ml));
    }
}

fn q5_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin, scales) = (half(b, 0), half(b, 2), &b[4..16]);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for sub in 0..8 {
        let (sc, m) = scale_min_k4(scales, sub);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        out.extend((sub * 32..sub * 32 + 32).map(|i| {
            let q = nibble256(qs, i) | (((qh[i % 32] >> (i / 32)) & 1) << 4);
            dl * q as f32 - ml
        }));
    }
}

fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    let d = half(b, 208);
    for (sub, &sc) in scales.iter().enumerate() {
        let dl = d * sc as i8 as f32;
        out.extend((sub * 16..sub * 16 + 16).map(|i| {
            // Each half of 128 elements: low nibbles of 64 bytes, then their high nibbles; the
            // top two bits four to a byte of 32.
            let (h, r) = (i / 128, i % 128);
            let lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
            let hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
            dl * ((lo | (hi << 4)) as i8 - 32) as f32
        }));
    }
}

fn q8_k(b: &[u8], out: &mut Vec<f32>) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    out.extend(b[4..260].iter().map(|&q| d * q as i8 as f32));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_partial_blocks_and_integers() {
        for d in DType::ALL.into_iter().filter(|d| d.is_quantized()) {
            let size = d.block().unwrap().1;
            let e = dequantize(d, &vec![0; size + 1]).unwrap_err();
            assert!(matches!(e, Error::LengthMismatch { .. }), "{d}: {e}");
            assert_eq!(
                dequantize(d, &vec![0; 2 * size]).unwrap(),
                vec![0.0; 2 * d.block().unwrap().0]
            );
        }
        let e = dequantize(DType::U8, &[1, 2]).unwrap_err();
        assert!(e.to_string().contains("u8 has no f32 reading"), "{e}");
        let mut out = vec![7.0];
        assert!(dequantize_into(DType::F32, &[0; 3], &mut out).is_err());
        assert_eq!(out, vec![7.0]);
    }

    #[test]
    fn q8_k_is_its_scale_times_its_quants() {
        let mut b = 0.25f32.to_le_bytes().to_vec();
        b.extend((0..256).map(|i| (i as i8).wrapping_sub(100) as u8));
        b.extend([0; 32]);
        let x = dequantize(DType::Q8K, &b).unwrap();
        assert_eq!((x[0], x[100], x[255]), (-25.0, 0.0, 0.25 * (255i32 - 100 - 256) as f32));
    }

    #[test]
    fn q4_0_reads_low_nibbles_first() {
        // Scale 2.0 (f16 0x4000); byte 0 holds element 0 (low) and element 16 (high).
        let mut b = vec![0x00, 0x40, 0x9f];
        b.extend([0x88; 15]);
        let x = dequantize(DType::Q4_0, &b).unwrap();
        assert_eq!((x[0], x[16], x[1], x[17]), (14.0, 2.0, 0.0, 0.0));
    }
}
