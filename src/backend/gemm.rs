//! A matrix product on the host for the compute above the store: the `gemm` crate's kernels
//! (candle's own CPU matrix product, so nothing new is compiled) behind one safe function that
//! checks its slices, so the modules above hold no `unsafe` (feature `candle`).
//!
//! `gemm` runs on the calling thread's rayon pool (candle's). It splits the output among the
//! threads and walks the inner dimension in blocks whose size depends on the shapes and the
//! machine's caches, never on the number of threads: each output element is summed in one fixed
//! order, so a result has the same bits whatever the pool.

use crate::base::error::{Error, Result};

/// `c += aᵀ · b` in f32, in place, all three row-major and dense: `a` is `[k, m]`, `b` is
/// `[k, n]`, `c` is `[m, n]` (beta = 1: `c`'s values are added to, never overwritten). For a
/// linear layer `y = x·Wᵀ`, `a` is the output's gradient `dY` (`[rows, out]`), `b` the input
/// `X` (`[rows, in]`) and `c` the weight's gradient `[out, in]`. Slices that do not hold what
/// the dimensions say are an [`Error::InvalidArgument`]; nothing is computed.
pub(crate) fn add_at_b(c: &mut [f32], [k, m, n]: [usize; 3], a: &[f32], b: &[f32]) -> Result<()> {
    let size = |r: usize, cols: usize, what: &str, len: usize| match r.checked_mul(cols) {
        Some(need) if need == len => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "c += aᵀ·b: {what} holds {len} values, not {r} × {cols}"
        ))),
    };
    size(k, m, "a", a.len())?;
    size(k, n, "b", b.len())?;
    size(m, n, "c", c.len())?;
    if k == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    // Strides in elements; each fits an isize (a slice never holds more than isize::MAX bytes).
    let (m_s, n_s) = (m as isize, n as isize);
    // SAFETY: `gemm` reads `a` at `p·m + i` (lhs `[m × k]`: row stride 1, column stride `m`)
    // and `b` at `p·n + j` (rhs `[k × n]`: row stride `n`, column stride 1) for `i < m`,
    // `j < n`, `p < k`, and reads and writes `c` at `i·n + j` (dst: row stride `n`, column
    // stride 1): every offset is inside its slice, whose lengths were checked above to be
    // `k·m`, `k·n` and `m·n`. `c` is borrowed mutably, so nothing else reads or writes it
    // meanwhile, and `a` and `b` cannot overlap it. With `read_dst`, `c = 1·c + 1·(aᵀ·b)`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n_s,
            true,
            a.as_ptr(),
            m_s,
            1,
            b.as_ptr(),
            1,
            n_s,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `c += aᵀ·b` in f64, element by element.
    fn reference(c: &[f32], [k, m, n]: [usize; 3], a: &[f32], b: &[f32]) -> Vec<f64> {
        let mut out: Vec<f64> = c.iter().map(|&v| f64::from(v)).collect();
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    out[i * n + j] += f64::from(a[p * m + i]) * f64::from(b[p * n + j]);
                }
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 17) as f32 - 8.0)
            .collect()
    }

    #[test]
    fn adds_a_transposed_times_b_into_c() {
        for dims in [[3, 2, 4], [1, 1, 1], [70, 33, 65], [5, 1, 9]] {
            let [k, m, n] = dims;
            let (a, b) = (values(k * m, 1), values(k * n, 2));
            let mut c = values(m * n, 3);
            let want = reference(&c, dims, &a, &b);
            add_at_b(&mut c, dims, &a, &b).unwrap();
            // Small integers: every sum is exact in f32.
            let got: Vec<f64> = c.iter().map(|&v| f64::from(v)).collect();
            assert_eq!(got, want, "{dims:?}");
        }
    }

    #[test]
    fn the_same_bits_on_one_thread_as_on_several() {
        let dims @ [k, m, n] = [300, 96, 130];
        let a: Vec<f32> = (0..k * m).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104_729) % 997) as f32 * 1e-3 - 0.5).collect();
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut c = vec![0.25f32; m * n];
            pool.install(|| add_at_b(&mut c, dims, &a, &b)).unwrap();
            c
        };
        let one = run(1);
        assert_eq!(one, run(4));
        let want = reference(&vec![0.25; m * n], dims, &a, &b);
        for (g, w) in one.iter().zip(&want) {
            assert!((f64::from(*g) - w).abs() < 1e-4 * (1.0 + w.abs()), "{g} against {w}");
        }
    }

    #[test]
    fn slices_that_do_not_fit_are_refused() {
        let mut c = vec![0f32; 6];
        let e = add_at_b(&mut c, [2, 2, 3], &[0.0; 4], &[0.0; 5]).unwrap_err();
        assert!(e.to_string().contains("b holds 5 values"), "{e}");
        assert!(add_at_b(&mut c, [2, 3, 3], &[0.0; 6], &[0.0; 6]).is_err());
        assert!(add_at_b(&mut [], [0, 0, 0], &[], &[]).is_ok());
    }
}
